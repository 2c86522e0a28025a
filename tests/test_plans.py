"""Prepared plans (repeatable executors) and the high-level function's executor cache."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe.tools.cases import compare, make_case


def _on_device(case, stream=None):
    return pm.to_device(case.grad_expanded_x, stream=stream), pm.to_device(case.expanded_row_idx, stream=stream)


def _ref(case):
    return pm.reference.moe_init_routing_v2_grad(*case.args())


def test_plan_relaunches_and_rebinds(device, no_leaks):
    a = make_case(16, 4, 32, "float32", "dropless", seed=1)
    b = make_case(16, 4, 32, "float32", "dropless", seed=2)
    xa, ia = _on_device(a)
    xb, ib = _on_device(b)
    with pm.Stream(device) as s, pm.MoeInitRoutingV2Grad(xa, ia, 4) as plan:
        assert plan.workspace_size == 16 << 20
        out = plan(s)
        assert out is plan.out and out.shape == (16, 32)
        plan(s)  # again: the executor is repeatable
        assert compare(out.to_host(s), _ref(a)).passed
        out_b = pm.empty((16, 32), np.float32)
        plan.rebind(grad_expanded_x=xb, expanded_row_idx=ib, out=out_b)
        assert plan(s) is out_b
        assert compare(out_b.to_host(s), _ref(b)).passed
        assert compare(out.to_host(s), _ref(a)).passed  # the old out was left alone
    assert plan.closed


def test_rebind_accepts_another_offset_but_not_another_layout(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=3)
    x, idx = _on_device(case)
    big = pm.to_device(np.concatenate([np.zeros((1, 16), np.float32), case.grad_expanded_x]))
    shifted = big[1:]  # same shape, dtype and strides; offset 16
    plan = pm.MoeInitRoutingV2Grad(x, idx, 2)
    plan.rebind(grad_expanded_x=shifted)
    assert compare(plan().to_host(), _ref(case)).passed
    other = make_case(8, 2, 16, "float32", "dropless", seed=30)
    plan.rebind(grad_expanded_x=pm.to_device(other.grad_expanded_x))  # back to offset 0
    assert compare(plan().to_host(), pm.reference.moe_init_routing_v2_grad(other.grad_expanded_x,
                                                                         case.expanded_row_idx, 2)).passed
    with pytest.raises(pm.InvalidArgument, match="build a new plan"):
        plan.rebind(grad_expanded_x=pm.empty((16, 8), np.float32))
    with pytest.raises(pm.InvalidArgument, match="build a new plan"):
        plan.rebind(grad_expanded_x=pm.to_device(np.zeros((16, 32), np.float32))[:, ::2])
    with pytest.raises(pm.InvalidArgument, match="build a new plan"):
        plan.rebind(out=pm.empty((8, 16), np.float16))
    plan.close()


def test_close_and_use_after_close(device, no_leaks):
    case = make_case(4, 2, 8, "float16", "drop-pad", seed=4)
    x, idx = _on_device(case)
    plan = pm.MoeInitRoutingV2Grad(x, idx, 2, 1)
    executors = pm.emulator.stats()["executors"]
    plan()
    plan.close()
    plan.close()  # twice is fine
    assert pm.emulator.stats()["executors"] == executors - 1
    with pytest.raises(pm.InvalidArgument, match="closed"):
        plan()
    with pytest.raises(pm.InvalidArgument, match="closed"):
        plan.rebind(out=pm.empty((4, 8), np.float16))


def test_one_shot_plan_launches_once(device, no_leaks):
    case = make_case(4, 2, 8, "float32", "dropless", seed=5)
    x, idx = _on_device(case)
    with pm.MoeInitRoutingV2Grad(x, idx, 2, repeatable=False) as plan:
        out = plan()
        assert compare(out.to_host(), _ref(case)).passed
        with pytest.raises(pm.InvalidArgument, match="one-shot"):
            plan()
        with pytest.raises(pm.InvalidArgument, match="one-shot"):
            plan.rebind(out=pm.empty((4, 8), np.float32))


def test_plan_validates_like_the_function(device):
    x = pm.empty((8, 4), np.float32)
    with pytest.raises(pm.InvalidArgument, match="top_k"):
        pm.MoeInitRoutingV2Grad(x, pm.empty((8,), np.int32), 3)
    with pytest.raises(pm.InvalidArgument, match="expanded_row_idx"):
        pm.MoeInitRoutingV2Grad(x, np.arange(8, dtype=np.int32), 2)


def test_a_thousand_relaunches_leave_the_counters_where_they_were(device):
    case = make_case(2, 2, 4, "float32", "dropless", seed=6)
    with pm.Stream(device) as s:
        x, idx = _on_device(case, s)
        plan = pm.MoeInitRoutingV2Grad(x, idx, 2)
        plan(s)
        s.synchronize()
        gc.collect()
        before = pm.emulator.stats()
        for _ in range(1000):
            plan(s)
        s.synchronize()
        after = pm.emulator.stats()
        live = ("device_allocations", "device_bytes", "tensors", "executors", "streams", "events", "pending_tasks")
        assert {k: after[k] for k in live} == {k: before[k] for k in live}
        assert after["mallocs_total"] == before["mallocs_total"]
        assert after["kernels_run"] - before["kernels_run"] == 1000
        assert compare(plan.out.to_host(s), _ref(case)).passed
        plan.close()


def test_plan_keeps_its_arrays_alive_while_launches_are_queued(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=7)
    with pm.Stream(device) as s:
        x, idx = _on_device(case, s)
        plan = pm.MoeInitRoutingV2Grad(x, idx, 2)
        out = plan(s)
        plan.close()
        del x, idx, plan
        gc.collect()
        assert compare(out.to_host(s), _ref(case)).passed  # no device fault: nothing was freed early


def test_function_caches_executors_per_layout(device, no_leaks):
    pm.empty_cache()
    cases = [make_case(8, 2, 16, "bfloat16", "dropless", seed=i) for i in range(4)]
    with pm.Stream(device) as s:
        arrays = [_on_device(c, s) for c in cases]
        outs = [pm.moe_init_routing_v2_grad(x, i, 2, stream=s) for x, i in arrays]
        st = pm.emulator.stats()
        assert st["executors"] == 1  # one cached executor for the one layout, rebound each call
        for o, c in zip(outs, cases):
            assert np.array_equal(o.to_host(s), _ref(c))
        # Another layout gets its own.
        other = make_case(8, 4, 16, "bfloat16", "dropless", seed=9)
        ox, oi = _on_device(other, s)
        assert np.array_equal(pm.moe_init_routing_v2_grad(ox, oi, 4, stream=s).to_host(s), _ref(other))
        assert pm.emulator.stats()["executors"] == 2
        # validate=False hands every call to the vendor's first phase: nothing cached.
        pm.moe_init_routing_v2_grad(ox, oi, 4, stream=s, validate=False)
        assert pm.emulator.stats()["executors"] == 2
    pm.empty_cache()
    assert pm.emulator.stats()["executors"] == 0 and pm.emulator.stats()["tensors"] == 0


def test_cached_executor_does_not_keep_arrays_alive(device):
    pm.empty_cache()
    gc.collect()
    allocs = pm.emulator.stats()["device_allocations"]
    case = make_case(64, 2, 256, "float32", "dropless", seed=10)
    x, idx = _on_device(case)
    out = pm.moe_init_routing_v2_grad(x, idx, 2)
    out.to_host()
    del x, idx, out
    gc.collect()
    st = pm.emulator.stats()
    assert st["executors"] == 1  # cached...
    assert st["device_allocations"] == allocs + 1  # ...but only the pooled workspace stays
    pm.empty_cache()


def test_function_from_many_threads_with_one_layout(device, no_leaks):
    # Every thread hits the same cached executor: rebinding and launching are one atomic step.
    results, errors = {}, []

    def worker(i: int) -> None:
        try:
            case = make_case(8, 2, 16, "float32", "dropless", seed=100 + i)
            with pm.Stream(device) as s:
                x, idx = _on_device(case, s)
                for _ in range(20):
                    out = pm.moe_init_routing_v2_grad(x, idx, 2, stream=s)
                results[i] = (out.to_host(s), _ref(case))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for got, want in results.values():
        assert compare(got, want).passed
    pm.empty_cache()
