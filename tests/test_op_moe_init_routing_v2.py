"""The forward op, aclnnMoeInitRoutingV2, through the binding: equal to the NumPy reference in
every scenario (outputs are copies and counts: exact), refusals that name the parameter, the
two phases as CANN has them, and the pair with the backward."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe.op import moe_init_routing_v2 as fwd

SCENARIOS = {
    "dropless": {},
    "dropless-cumsum": {"expert_num": 6, "expert_tokens_count_or_cumsum_flag": 1},
    "dropless-count": {"expert_num": 6, "expert_tokens_count_or_cumsum_flag": 2},
    "active": {"active_num": 20, "expert_num": 6, "expert_tokens_count_or_cumsum_flag": 2},
    "drop-pad": {"drop_pad_mode": 1, "expert_capacity": 4, "expert_num": 6},
    "drop-pad-before": {"drop_pad_mode": 1, "expert_capacity": 3, "expert_num": 6,
                        "expert_tokens_before_capacity_flag": True},
}


def _inputs(dtype: object, n: int = 12, k: int = 3, h: int = 16, experts: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(dtype)
    idx = rng.integers(0, experts, (n, k)).astype(np.int32)  # repeats: ties must keep their order
    return x, idx


def _same(got: pm.RoutingResult, want: tuple) -> None:
    for name, g, w in zip(pm.RoutingResult._fields, got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert g.dtype == w.dtype and g.shape == w.shape, name
            np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_host_arrays_equal_the_reference(device, scenario, dtype):
    x, idx = _inputs(dtype)
    kw = SCENARIOS[scenario]
    _same(pm.moe_init_routing_v2(x, idx, **kw), pm.reference.moe_init_routing_v2(x, idx, **kw))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_device_arrays_on_a_stream(device, scenario):
    x, idx = _inputs(np.float32, seed=1)
    kw = SCENARIOS[scenario]
    s = pm.Stream(device)
    r = pm.moe_init_routing_v2(pm.to_device(x, stream=s), pm.to_device(idx, stream=s), stream=s, **kw)
    assert isinstance(r.expanded_x, pm.DeviceArray)
    _same(pm.RoutingResult(*(None if a is None else a.to_host(s) for a in r)),
          pm.reference.moe_init_routing_v2(x, idx, **kw))
    s.close()


def test_the_two_phases_as_cann_has_them(device):
    x, idx = _inputs(np.float32, seed=2)
    dx, di = pm.to_device(x), pm.to_device(idx)
    ex, ri = pm.empty((36, 16), np.float32), pm.empty((36,), np.int32)
    size, executor = fwd.get_workspace_size(dx, di, 0, 0, 0, 0, 0, False, ex, ri)
    assert size >= 16 << 20
    ws = pm.empty((size,), np.uint8)
    fwd.execute(ws, size, executor)
    want = pm.reference.moe_init_routing_v2(x, idx)
    np.testing.assert_array_equal(ex.to_host(), want[0])
    np.testing.assert_array_equal(ri.to_host(), want[1])
    with pytest.raises(pm.AclnnError) as info:  # the vendor's tiling refuses a wrong expandedXOut
        fwd.get_workspace_size(dx, di, 0, 0, 0, 0, 0, False, pm.empty((35, 16), np.float32), ri)
    assert info.value.status == 561002


@pytest.mark.parametrize("kw, name", [
    ({"drop_pad_mode": 2}, "drop_pad_mode"),
    ({"expert_tokens_count_or_cumsum_flag": 3, "expert_num": 6}, "expert_tokens_count_or_cumsum_flag"),
    ({"expert_tokens_count_or_cumsum_flag": 1}, "expert_num"),
    ({"drop_pad_mode": 1, "expert_num": 6}, "expert_capacity"),
    ({"active_num": -1}, "active_num"),
    ({"expert_num": 3, "expert_tokens_count_or_cumsum_flag": 2}, "expert_idx"),  # ids up to 5
    ({"expert_tokens_before_capacity_flag": 1}, "expert_tokens_before_capacity_flag"),
])
def test_refusals_name_the_parameter(device, kw, name):
    x, idx = _inputs(np.float32)
    with pytest.raises(pm.InvalidArgument, match=name):
        pm.moe_init_routing_v2(x, idx, **kw)


def test_bad_inputs_name_the_parameter(device):
    x, idx = _inputs(np.float32)
    with pytest.raises(pm.InvalidArgument, match="expert_idx.*int32"):
        pm.moe_init_routing_v2(x, idx.astype(np.int64))
    with pytest.raises(pm.InvalidArgument, match="expert_idx.*2-D"):
        pm.moe_init_routing_v2(x, idx[:5])
    with pytest.raises(pm.InvalidArgument, match="x.*dtype"):
        pm.moe_init_routing_v2(x.astype(np.int32), idx)
    with pytest.raises(pm.InvalidArgument, match="expert_idx.*DeviceArray"):
        pm.moe_init_routing_v2(pm.to_device(x), idx)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_backward_of_the_forward_is_k_times_x_when_every_slot_is_kept(device, k):
    x, idx = _inputs(np.float32, k=k, seed=3)
    r = pm.moe_init_routing_v2(pm.to_device(x), pm.to_device(idx))
    g = pm.moe_init_routing_v2_grad(r.expanded_x, r.expanded_row_idx, k)
    np.testing.assert_array_equal(g.to_host(), x * np.float32(k))  # k*x is exact in float32 here


def child_forward_kernel_mutation() -> None:
    pm.use_emulator()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 8)).astype(np.float32)
    idx = rng.integers(0, 4, (12, 3)).astype(np.int32)
    got = pm.moe_init_routing_v2(x, idx)
    want = pm.reference.moe_init_routing_v2(x, idx)
    print(np.array_equal(got.expanded_row_idx, want[1]))


def test_the_forward_kernel_mutation_is_caught(isolated):
    r = isolated(child_forward_kernel_mutation, env={"PYACL_MOE_EMU_MUTATION": "fwd-unstable-sort"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_the_reference_equals_plain_loops_over_the_documented_formulas():
    from tests.test_emulator_forward import reference as loops

    rng = np.random.default_rng(7)
    for _ in range(200):
        n, k, h, num = (int(v) for v in (rng.integers(0, 9), rng.integers(1, 5), rng.integers(1, 4),
                                         rng.integers(1, 6)))
        x = rng.standard_normal((n, h)).astype(np.float32)
        idx = rng.integers(0, num, (n, k)).astype(np.int32)
        mode = int(rng.integers(0, 2))
        flag = int(rng.integers(0, 3)) if mode == 0 else 0
        active = int(rng.integers(0, n * k + 3)) if mode == 0 else 0
        cap = int(rng.integers(1, max(2, n + 1))) if mode == 1 else 0
        before = bool(rng.integers(0, 2))
        got = pm.reference.moe_init_routing_v2(x, idx, active, cap, num, mode, flag, before)
        want = loops(x, idx, active, cap, num if (mode == 1 or flag) else 0, mode, flag, before)
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if w is not None:
                np.testing.assert_array_equal(g, w)


def test_threads_share_a_stream_for_the_forward(device):
    import threading

    s = pm.Stream(device)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(25):
                x, idx = _inputs(np.float32, seed=seed * 100 + i)
                kw = SCENARIOS[sorted(SCENARIOS)[i % len(SCENARIOS)]]
                r = pm.moe_init_routing_v2(pm.to_device(x, stream=s), pm.to_device(idx, stream=s), stream=s, **kw)
                _same(pm.RoutingResult(*(None if a is None else a.to_host(s) for a in r)),
                      pm.reference.moe_init_routing_v2(x, idx, **kw))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    s.close()


def _host(r: pm.RoutingResult, stream=None) -> pm.RoutingResult:
    return pm.RoutingResult(*(None if a is None else a.to_host(stream) for a in r))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_prepared_plan_relaunches_and_rebinds_every_output(device, scenario):
    kw = SCENARIOS[scenario]
    x, idx = _inputs(np.float32, seed=2)
    with pm.MoeInitRoutingV2(pm.to_device(x), pm.to_device(idx), **kw) as plan:
        for _ in range(3):
            r = plan()
        _same(_host(r), pm.reference.moe_init_routing_v2(x, idx, **kw))
        # Rebinding every array, the optional outputs too: an output the scenario leaves out
        # (a null pointer) has no index, so the ones after it count from one less.
        x2, idx2 = _inputs(np.float32, seed=3)
        fresh = {n: pm.empty(a.shape, a.dtype) for n, a in zip(r._fields, r) if a is not None}
        plan.rebind(pm.to_device(x2), pm.to_device(idx2), **fresh)
        r2 = plan()
        assert all(a is fresh.get(n) for n, a in zip(r2._fields, r2) if a is not None)
        _same(_host(r2), pm.reference.moe_init_routing_v2(x2, idx2, **kw))
        _same(_host(r), pm.reference.moe_init_routing_v2(x, idx, **kw))  # the old outputs were left alone
        assert plan.outputs.expanded_x is fresh["expanded_x"]


def test_a_plan_writes_into_given_outputs_and_leaves_unwritten_ones_out(device):
    x, idx = _inputs(np.float32)
    kw = SCENARIOS["drop-pad-before"]
    want = pm.reference.moe_init_routing_v2(x, idx, **kw)
    before = pm.empty((6,), np.int32)
    plan = pm.MoeInitRoutingV2(pm.to_device(x), pm.to_device(idx), **kw, expert_tokens_before_capacity=before)
    r = plan()
    assert r.expert_tokens_before_capacity is before and r.expert_tokens_count_or_cumsum is None
    _same(_host(r), want)
    plan.close()
    with pytest.raises(pm.ClosedError):
        plan()


@pytest.mark.parametrize("outputs, name, rule", [
    ({"expert_tokens_count_or_cumsum": ((6,), np.int32)}, "expert_tokens_count_or_cumsum", "not written"),
    ({"expanded_x": ((6, 4, 16), np.float16)}, "expanded_x", "must have shape (6, 4, 16) and dtype float32"),
    ({"expanded_row_idx": ((35,), np.int32)}, "expanded_row_idx", "must have shape (36,) and dtype int32"),
])
def test_plan_refuses_outputs_the_scenario_does_not_write_as_given(device, outputs, name, rule):
    x, idx = _inputs(np.float32)
    given = {n: pm.empty(shape, dt) for n, (shape, dt) in outputs.items()}
    with pytest.raises(pm.InvalidArgument, match=re.escape(rule)) as e:
        pm.MoeInitRoutingV2(pm.to_device(x), pm.to_device(idx), **SCENARIOS["drop-pad"], **given)
    assert e.value.parameter == name


def test_plan_refuses_overlap_and_rebinding_what_it_was_not_built_with(device):
    x, idx = _inputs(np.float32)
    big = pm.to_device(np.concatenate([x, np.zeros((36, 16), np.float32)]))
    dx, di = big[:12], pm.to_device(idx)
    with pytest.raises(pm.InvalidArgument, match="shares device memory") as e:
        pm.MoeInitRoutingV2(dx, di, expert_num=6, expanded_x=big[:36])
    assert e.value.parameter == "expanded_x"
    with pm.MoeInitRoutingV2(dx, di, expert_num=6, expanded_x=big[12:]) as plan:
        _same(_host(plan()), pm.reference.moe_init_routing_v2(x, idx, expert_num=6))
        with pytest.raises(pm.InvalidArgument, match="shares device memory") as e:
            plan.rebind(expanded_x=big[:36])
        assert e.value.parameter == "expanded_x"
        with pytest.raises(pm.InvalidArgument, match="not part of the plan") as e:
            plan.rebind(expert_tokens_count_or_cumsum=pm.empty((6,), np.int32))
        assert e.value.parameter == "expert_tokens_count_or_cumsum"
        with pytest.raises(pm.InvalidArgument, match="build a new plan") as e:
            plan.rebind(x=pm.empty((12, 8), np.float32))
        assert e.value.parameter == "x"


def test_one_shot_plan_launches_once(device):
    x, idx = _inputs(np.float32)
    plan = pm.MoeInitRoutingV2(pm.to_device(x), pm.to_device(idx), expert_num=6, repeatable=False)
    _same(_host(plan()), pm.reference.moe_init_routing_v2(x, idx, expert_num=6))
    with pytest.raises(pm.ClosedError, match="one-shot"):
        plan()
    plan.close()


def test_threads_share_a_forward_plan_while_one_closes_it(device):
    """Launches from several threads on their own streams, and a close in the middle: each
    launch either completes (and its result is right) or raises ClosedError."""
    import threading

    x, idx = _inputs(np.float32, seed=7)
    kw = SCENARIOS["dropless-count"]
    want = pm.reference.moe_init_routing_v2(x, idx, **kw)
    plan = pm.MoeInitRoutingV2(pm.to_device(x), pm.to_device(idx), **kw)
    errors: list[BaseException] = []
    launched = [0] * 4
    go = threading.Barrier(5)

    def worker(t: int) -> None:
        s = pm.Stream(device)
        try:
            go.wait()
            for _ in range(400):
                r = plan(s)
                launched[t] += 1
            _same(_host(r, s), want)
        except pm.ClosedError:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            s.synchronize()
            s.close()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    go.wait()
    while sum(launched) < 200 and any(t.is_alive() for t in threads):
        threading.Event().wait(0.001)
    plan.close()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    with pytest.raises(pm.ClosedError):
        plan()


def test_one_call_on_device_reuses_the_streams_executor_for_a_layout(device, monkeypatch):
    """The second call of a layout runs no first phase: the stream's cached executor is rebound
    to the new arrays, absent optional outputs included."""
    from pyacl_moe._cann import aclnn

    phases: list[str] = []
    real = aclnn.get_workspace_size

    def counting(api, *args):
        phases.append(api)
        return real(api, *args)

    monkeypatch.setattr(aclnn, "get_workspace_size", counting)
    s = pm.Stream(device)
    kw = SCENARIOS["drop-pad-before"]  # the count output is a null pointer, before-capacity is not
    x, idx = _inputs(np.float32, seed=11)
    pm.moe_init_routing_v2(pm.to_device(x, stream=s), pm.to_device(idx, stream=s), stream=s, **kw)
    assert phases == ["aclnnMoeInitRoutingV2"]
    for seed in (12, 13):
        x2, idx2 = _inputs(np.float32, seed=seed)
        r = pm.moe_init_routing_v2(pm.to_device(x2, stream=s), pm.to_device(idx2, stream=s), stream=s, **kw)
        _same(_host(r, s), pm.reference.moe_init_routing_v2(x2, idx2, **kw))
    assert phases == ["aclnnMoeInitRoutingV2"]
    s.close()


def test_executor_indices_are_the_ops_and_a_null_output_has_no_address(device):
    x, idx = _inputs(np.float32)
    dx, di = pm.to_device(x), pm.to_device(idx)
    kw = SCENARIOS["drop-pad-before"]
    r = pm.moe_init_routing_v2(dx, di, **kw)
    size, ex = fwd.get_workspace_size(dx, di, 0, 3, 6, 1, 0, True, *r)
    with pytest.raises(pm.InvalidArgument, match="passed as a null pointer") as e:
        ex.set_output_addr(2, ex.tensors[-1], r.expert_tokens_before_capacity.address)
    assert e.value.parameter == "index"
    other = pm.empty((6,), np.int32)
    ex.set_repeatable()
    ex.set_output_addr(3, ex.tensors[-1], other.address)
    fwd.execute(pm.empty((size,), np.uint8) if size else None, size, ex)
    pm.current_stream().synchronize()
    np.testing.assert_array_equal(other.to_host(), pm.reference.moe_init_routing_v2(x, idx, **kw)[3])
    ex.close()


def test_one_call_writes_into_given_outputs_and_workspace_and_allocates_nothing(device):
    s = pm.Stream(device)
    kw = SCENARIOS["drop-pad-before"]
    x, idx = _inputs(np.float32, seed=21)
    dx, di = pm.to_device(x, stream=s), pm.to_device(idx, stream=s)
    first = pm.moe_init_routing_v2(dx, di, stream=s, **kw)
    size, ex = fwd.get_workspace_size(dx, di, 0, 3, 6, 1, 0, True, *first)
    ex.close()
    ws = pm.empty((size,), np.uint8)
    pm.moe_init_routing_v2(dx, di, stream=s, out=first, workspace=ws, **kw)  # binds the cache to ws
    s.synchronize()
    mallocs = pm.emulator.stats()["mallocs_total"]
    for seed in (22, 23):
        x2, idx2 = _inputs(np.float32, seed=seed)
        dx.copy_from_host(x2, stream=s)
        di.copy_from_host(idx2, stream=s)
        r = pm.moe_init_routing_v2(dx, di, stream=s, out=first, workspace=ws, **kw)
        assert all(a is b for a, b in zip(r, first))
        _same(_host(r, s), pm.reference.moe_init_routing_v2(x2, idx2, **kw))
    assert pm.emulator.stats()["mallocs_total"] == mallocs
    # Only some outputs given: the others are made.
    part = pm.moe_init_routing_v2(dx, di, stream=s, out=pm.RoutingResult(None, first.expanded_row_idx, None, None),
                                  **kw)
    assert part.expanded_row_idx is first.expanded_row_idx and part.expanded_x is not first.expanded_x
    s.close()


@pytest.mark.parametrize("make, name, rule", [
    (lambda r: r._replace(expanded_x=pm.empty((6, 4, 16), np.float32)), "expanded_x",
     "must have shape (6, 3, 16) and dtype float32"),
    (lambda r: r._replace(expert_tokens_count_or_cumsum=pm.empty((6,), np.int32)), "expert_tokens_count_or_cumsum",
     "not written"),
    (lambda r: r._replace(expanded_row_idx=r.expanded_x.reshape(-1)[:36].reshape(36)), "expanded_row_idx",
     "must have shape (36,) and dtype int32"),
    (lambda r: (r.expanded_x,), "out", "RoutingResult"),
    (lambda r: r._replace(expanded_x=np.zeros((6, 3, 16), np.float32)), "out.expanded_x", "DeviceArray"),
])
def test_one_call_refuses_outputs_it_would_not_write_as_given(device, make, name, rule):
    kw = SCENARIOS["drop-pad-before"]
    x, idx = _inputs(np.float32)
    dx, di = pm.to_device(x), pm.to_device(idx)
    r = pm.moe_init_routing_v2(dx, di, **kw)
    with pytest.raises(pm.InvalidArgument, match=re.escape(rule)) as e:
        pm.moe_init_routing_v2(dx, di, out=make(r), **kw)
    assert e.value.parameter == name


def test_one_call_refuses_overlap_a_small_workspace_and_outputs_for_host_inputs(device):
    x, idx = _inputs(np.float32)
    big = pm.to_device(np.concatenate([x, np.zeros((36, 16), np.float32)]))
    dx, di = big[:12], pm.to_device(idx)
    r = pm.moe_init_routing_v2(dx, di, expert_num=6)
    with pytest.raises(pm.InvalidArgument, match="shares device memory") as e:
        pm.moe_init_routing_v2(dx, di, expert_num=6, out=r._replace(expanded_x=big[:36]))
    assert e.value.parameter == "expanded_x"
    with pytest.raises(pm.InvalidArgument, match="less than") as e:
        pm.moe_init_routing_v2(dx, di, expert_num=6, workspace=pm.empty((16,), np.uint8))
    assert e.value.parameter == "workspace"
    with pytest.raises(pm.InvalidArgument, match="must be a host array or None when the inputs are host arrays") as e:
        pm.moe_init_routing_v2(x, idx, expert_num=6, out=r)
    assert e.value.parameter == "out.expanded_x"


def test_a_plans_executor_lists_the_tensors_it_was_built_with(device):
    """An optional output passed as a null pointer has no aclTensor: asking a forward plan
    for its executor raised KeyError."""
    x, idx = _inputs(np.float32)
    dx, di = pm.to_device(x), pm.to_device(idx)
    with pm.MoeInitRoutingV2(dx, di, **SCENARIOS["drop-pad-before"]) as plan:
        ex = plan.executor
        assert ex.repeatable and ex.workspace_size == plan.workspace_size
        out = plan.outputs
        assert [t.array for t in ex.tensors] == [dx, di, out.expanded_x, out.expanded_row_idx,
                                                 out.expert_tokens_before_capacity]


def test_a_workspace_that_shares_memory_with_a_tensor_or_is_strided_is_refused(device, no_leaks):
    """The kernel writes its workspace (the forward sorts in it), as one block: a workspace
    over an input or an output would be overwritten, or overwrite them, and a strided view's
    gaps belong to other views."""
    x, idx = _inputs(np.float32)
    kw = SCENARIOS["dropless-count"]
    dx, di = pm.to_device(x), pm.to_device(idx)
    r = pm.moe_init_routing_v2(dx, di, **kw)
    size = pm.MoeInitRoutingV2(dx, di, **kw).workspace_size
    room = pm.empty((size + 4096,), np.uint8)
    ws = room[:size]
    # x, expert_idx and every output in turn placed in the workspace's memory.
    x_in = pm.from_pointer(room.address + size - 64, x.shape, np.float32, owner=room)
    idx_in = pm.from_pointer(room.address + 128, idx.shape, np.int32, owner=room)
    count_in = pm.from_pointer(room.address, (6,), np.int32, owner=room)
    for call, name in [
        (lambda: pm.moe_init_routing_v2(x_in, di, **kw, workspace=ws), "x"),
        (lambda: pm.moe_init_routing_v2(dx, idx_in, **kw, workspace=ws), "expert_idx"),
        (lambda: pm.moe_init_routing_v2(dx, di, **kw, workspace=ws,
                                        out=r._replace(expert_tokens_count_or_cumsum=count_in)),
         "expert_tokens_count_or_cumsum"),
        (lambda: pm.MoeInitRoutingV2(x_in, di, **kw)(None, ws), "x"),
        (lambda: pm.MoeInitRoutingV2(dx, di, **kw, expert_tokens_count_or_cumsum=count_in)(None, ws),
         "expert_tokens_count_or_cumsum"),
    ]:
        with pytest.raises(pm.InvalidArgument, match=f"shares device memory with {name}") as e:
            call()
        assert e.value.parameter == "workspace"
    strided = pm.empty((2 * size,), np.uint8)[::2]
    size0, executor = fwd.get_workspace_size(dx, di, 0, 0, 6, 0, 2, False, *r[:3])
    for call in (lambda: pm.moe_init_routing_v2(dx, di, **kw, workspace=strided),
                 lambda: pm.moe_init_routing_v2(dx, di, **kw, workspace=strided, validate=False),
                 lambda: pm.MoeInitRoutingV2(dx, di, **kw)(None, strided),
                 lambda: fwd.execute(strided, size0, executor)):
        with pytest.raises(pm.InvalidArgument, match="contiguous") as e:
            call()
        assert e.value.parameter == "workspace"
    executor.close()
    # Apart from every tensor, it is used.
    got = pm.moe_init_routing_v2(dx, di, **kw, workspace=ws)
    _same(_host(got), pm.reference.moe_init_routing_v2(x, idx, **kw))


@pytest.mark.parametrize("kw, c_name", [
    ({"active_num": -1}, "activeNum"),
    ({"drop_pad_mode": 1, "expert_num": -1, "expert_capacity": 4}, "expertNum"),
    ({"drop_pad_mode": 1, "expert_num": 6, "expert_capacity": -4}, "expertCapacity"),
    ({"expert_tokens_count_or_cumsum_flag": 1, "expert_num": -5}, "expertNum"),
])
def test_without_validation_a_negative_attribute_is_the_vendors_to_refuse(device, kw, c_name):
    """validate=False hands the attributes to CANN: the outputs the binding makes for them
    were sized from them, so a negative one was refused as an unnamed "shape[0]" before CANN
    saw it."""
    x, idx = _inputs(np.float32)
    dx, di = pm.to_device(x), pm.to_device(idx)
    for call in (lambda: pm.moe_init_routing_v2(x, idx, **kw, validate=False),
                 lambda: pm.moe_init_routing_v2(dx, di, **kw, validate=False),
                 lambda: pm.MoeInitRoutingV2(dx, di, **kw, validate=False)):
        with pytest.raises(pm.AclnnError) as e:
            call()
        assert e.value.status == 561002 and c_name in e.value.message


@pytest.mark.parametrize("kw, output", [
    ({"drop_pad_mode": 1, "expert_num": 2**62, "expert_capacity": 2}, "expanded_x"),
    ({"expert_num": 2**62, "expert_tokens_count_or_cumsum_flag": 2}, "expert_tokens_count_or_cumsum"),
    ({"drop_pad_mode": 1, "expert_num": 2**62, "expert_capacity": 2, "expert_tokens_before_capacity_flag": True},
     "expanded_x"),
])
def test_an_expert_num_whose_outputs_cannot_be_addressed_is_refused_by_name(device, kw, output):
    x, idx = _inputs(np.float32)
    dx, di = pm.to_device(x), pm.to_device(idx)
    for validate, name in ((True, "expert_num"), (False, output)):
        for fn, a, b in ((pm.moe_init_routing_v2, x, idx), (pm.moe_init_routing_v2, dx, di),
                         (pm.MoeInitRoutingV2, dx, di)):
            with pytest.raises(pm.InvalidArgument, match="cannot be addressed") as e:
                fn(a, b, **kw, validate=validate)
            assert e.value.parameter == name


def test_numpy_bools_are_bools_and_other_flags_are_refused_by_type(device):
    """NumPy's bool was refused as "must be a bool, got bool"."""
    x, idx = _inputs(np.float32)
    kw = {"drop_pad_mode": 1, "expert_capacity": 3, "expert_num": 6}
    want = pm.reference.moe_init_routing_v2(x, idx, **kw, expert_tokens_before_capacity_flag=True)
    _same(pm.moe_init_routing_v2(x, idx, **kw, expert_tokens_before_capacity_flag=np.True_, validate=np.True_), want)
    with pm.MoeInitRoutingV2(pm.to_device(x), pm.to_device(idx), **kw, expert_tokens_before_capacity_flag=np.True_,
                             repeatable=np.False_, validate=np.True_) as plan:
        _same(_host(plan()), want)
    for value, shown in ((1, "int 1"), (np.int8(1), "int8"), ("True", "str 'True'"), (None, "NoneType None")):
        with pytest.raises(pm.InvalidArgument, match=f"must be a bool, got {re.escape(shown)}") as e:
            pm.moe_init_routing_v2(x, idx, **kw, expert_tokens_before_capacity_flag=value)
        assert e.value.parameter == "expert_tokens_before_capacity_flag"


def child_every_forward_entry_refuses_another_device() -> None:
    pm.use_emulator()
    d1 = pm.Device(1)
    d0 = pm.Device(0)
    d0.set_current()
    x = np.ones((12, 16), np.float32)
    ids = pm.routing.random_top_k(12, 3, 6, seed=0)
    kw = dict(expert_num=6, expert_tokens_count_or_cumsum_flag=2)
    dx, di = pm.to_device(x), pm.to_device(ids)
    ox, oi = pm.to_device(x, stream=d1.default_stream), pm.to_device(ids, stream=d1.default_stream)
    r = pm.moe_init_routing_v2(dx, di, **kw)
    far = pm.moe_init_routing_v2(ox, oi, **kw)
    plan = pm.MoeInitRoutingV2(dx, di, **kw)
    s1 = pm.Stream(d1)
    ws1 = pm.empty((plan.workspace_size,), np.uint8, d1)
    size, executor = fwd.get_workspace_size(dx, di, 0, 0, 6, 0, 2, False, *r[:3])
    uses = {
        "first phase, device=": lambda: fwd.get_workspace_size(dx, di, 0, 0, 6, 0, 2, False, *r[:3], device=1),
        "first phase, an output": lambda: fwd.get_workspace_size(dx, di, 0, 0, 6, 0, 2, False, far.expanded_x,
                                                                 *r[1:3]),
        "first phase, an input": lambda: fwd.get_workspace_size(dx, oi, 0, 0, 6, 0, 2, False, *r[:3]),
        "execute, workspace": lambda: fwd.execute(ws1, size, executor),
        "execute, stream": lambda: fwd.execute(pm.empty((size,), np.uint8), size, executor, s1),
        "one call, expert_idx": lambda: pm.moe_init_routing_v2(dx, oi, **kw),
        "one call, out": lambda: pm.moe_init_routing_v2(dx, di, **kw, out=r._replace(expanded_x=far.expanded_x)),
        "one call, stream": lambda: pm.moe_init_routing_v2(dx, di, **kw, stream=s1),
        "one call, workspace": lambda: pm.moe_init_routing_v2(dx, di, **kw, workspace=ws1),
        "one call unvalidated, workspace": lambda: pm.moe_init_routing_v2(dx, di, **kw, workspace=ws1,
                                                                          validate=False),
        "plan, expert_idx": lambda: pm.MoeInitRoutingV2(dx, oi, **kw),
        "plan, an output": lambda: pm.MoeInitRoutingV2(dx, di, **kw, expanded_x=far.expanded_x),
        "plan, stream": lambda: plan(s1),
        "plan, workspace": lambda: plan(None, ws1),
        "rebind": lambda: plan.rebind(x=ox),
        "routing, stream": lambda: pm.routing.dropless(di, 6, stream=s1),
    }
    for what, use in uses.items():
        try:
            use()
            print(what, "accepted")
        except pm.InvalidArgument as e:
            if "device" not in e.rule:
                print(what, e)
        except Exception as e:
            print(what, type(e).__name__, e)
    executor.close()
    plan.close()
    print("done")


def test_every_forward_entry_refuses_arrays_streams_and_workspaces_of_another_device(isolated):
    """CANN sees only addresses: the binding is where a launch's tensors are kept on one
    device. The first phase took the first tensor's device (or device=) and handed CANN
    tensors of another."""
    r = isolated(child_every_forward_entry_refuses_another_device, env={"PYACL_MOE_EMU_DEVICES": "2"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "done", r.stdout


def test_launch_probe_needs_a_repeatable_plan(device):
    """A one-shot plan has no slot to probe: launch_probe launched it, then raised KeyError."""
    x, idx = _inputs(np.float32)
    with pm.MoeInitRoutingV2(pm.to_device(x), pm.to_device(idx), repeatable=False) as plan:
        with pytest.raises(pm.InvalidArgument, match="one-shot") as e:
            plan.launch_probe()
        assert e.value.parameter == "plan"
        _same(_host(plan()), pm.reference.moe_init_routing_v2(x, idx))  # not launched by the probe
    with pm.MoeInitRoutingV2(pm.to_device(x), pm.to_device(idx)) as plan:
        fn, args = plan.launch_probe()
        assert fn(*args) == 0
