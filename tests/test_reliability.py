"""Hostile input, device faults, threads and lifetimes."""

from __future__ import annotations

import gc
import threading
from contextlib import closing

import ml_dtypes
import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe.tools.cases import compare, make_case

BF16 = ml_dtypes.bfloat16
F32 = np.float32


def x_(rows=8, h=4, dt=F32):
    return np.zeros((rows, h), dt)


def i_(n=8):
    return np.arange(n, dtype=np.int32)


# (name, call kwargs, parameter named, words of the rule). Arguments not given take a valid
# dropless case: x [8, 4] float32, idx arange(8), top_k 2.
HOSTILE = [
    ("x float64", dict(x=x_(dt=np.float64)), "grad_expanded_x", "float16, bfloat16 or float32"),
    ("x int32", dict(x=x_(dt=np.int32)), "grad_expanded_x", "float16, bfloat16 or float32"),
    ("x bool", dict(x=x_(dt=np.bool_)), "grad_expanded_x", "got bool"),
    ("x object", dict(x=np.array([[object()] * 4] * 8)), "grad_expanded_x", "got object"),
    ("x complex", dict(x=x_(dt=np.complex64)), "grad_expanded_x", "float16"),
    ("idx int64", dict(idx=np.arange(8, dtype=np.int64)), "expanded_row_idx", "int32"),
    ("idx float32", dict(idx=np.arange(8, dtype=np.float32)), "expanded_row_idx", "int32"),
    ("idx bool", dict(idx=np.ones(8, np.bool_)), "expanded_row_idx", "int32"),
    ("idx uint32", dict(idx=np.arange(8, dtype=np.uint32)), "expanded_row_idx", "int32"),
    ("x 1-D", dict(x=np.zeros(32, F32)), "grad_expanded_x", "2-D"),
    ("x 3-D in dropless", dict(x=np.zeros((8, 2, 4), F32)), "grad_expanded_x", "2-D"),
    ("x 2-D in drop/pad", dict(mode=1), "grad_expanded_x", "3-D"),
    ("x 4-D", dict(x=np.zeros((2, 2, 2, 4), F32), mode=1), "grad_expanded_x", "3-D"),
    ("idx 2-D", dict(idx=np.arange(8, dtype=np.int32).reshape(4, 2)), "expanded_row_idx", "1-D"),
    ("idx 0-D", dict(idx=np.array(3, np.int32)), "expanded_row_idx", "1-D"),
    ("idx empty", dict(x=x_(rows=0), idx=i_(0)), "expanded_row_idx", "empty"),
    ("hidden 0", dict(x=x_(h=0)), "grad_expanded_x", "positive"),
    ("rows differ", dict(x=x_(rows=7)), "grad_expanded_x", "rows"),
    ("active rows differ", dict(x=x_(rows=5), active=4), "grad_expanded_x", "active_num"),
    ("H mismatch with out", dict(out=np.zeros((4, 5), F32)), "out", "shape"),
    ("out rows", dict(out=np.zeros((3, 4), F32)), "out", "shape"),
    ("out 1-D", dict(out=np.zeros(16, F32)), "out", "shape"),
    ("out dtype", dict(out=np.zeros((4, 4), np.float16)), "out", "dtype"),
    ("out read-only", dict(out=np.zeros((4, 4), F32), readonly_out=True), "out", "writable"),
    ("out not NumPy", dict(out=[[0.0] * 4] * 4), "out", "NumPy"),
    ("top_k not divisor", dict(k=3), "top_k", "divide"),
    ("top_k 0", dict(k=0), "top_k", "greater than 0"),
    ("top_k negative", dict(k=-2), "top_k", "greater than 0"),
    ("top_k huge", dict(k=10**12), "top_k", "divide"),
    ("top_k beyond int64", dict(k=2**70), "top_k", "9223372036854775807]"),
    ("top_k float", dict(k=2.0), "top_k", "int"),
    ("top_k bool", dict(k=True), "top_k", "int"),
    ("top_k None", dict(k=None), "top_k", "int"),
    ("top_k str", dict(k="2"), "top_k", "int"),
    ("drop_pad_mode 2", dict(mode=2), "drop_pad_mode", "0"),
    ("drop_pad_mode -1", dict(mode=-1), "drop_pad_mode", "0"),
    ("drop_pad_mode float", dict(mode=0.0), "drop_pad_mode", "int"),
    ("active_num negative", dict(active=-1), "active_num", "positive"),
    ("active_num float", dict(active=1.5), "active_num", "int"),
    ("index too big", dict(idx=np.array([0, 1, 2, 3, 4, 5, 6, 8], np.int32)), "expanded_row_idx", "out of range"),
    ("index negative", dict(idx=np.array([0, 1, 2, 3, 4, 5, 6, -5], np.int32)), "expanded_row_idx", "out of range"),
    ("-1 outside drop/pad", dict(idx=np.array([0, 1, 2, 3, 4, 5, 6, -1], np.int32)), "expanded_row_idx",
     "only in drop/pad"),
    ("duplicate index", dict(idx=np.array([0, 1, 2, 3, 4, 5, 5, 6], np.int32)), "expanded_row_idx", "more than once"),
    ("duplicate in drop/pad", dict(x=np.zeros((2, 4, 4), F32), mode=1,
                                   idx=np.array([0, -1, 3, 3, -1, -1, 1, 2], np.int32)), "expanded_row_idx",
     "apart from -1"),
    ("drop/pad index past E*C", dict(x=np.zeros((2, 3, 4), F32), mode=1,
                                     idx=np.array([0, 6, -1, -1, 1, 2, 3, 4], np.int32)), "expanded_row_idx",
     "out of range"),
    ("x a list of strings", dict(x=[["a"] * 4] * 8), "grad_expanded_x", "float16"),
]


@pytest.mark.parametrize("name, kw, param, words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_host_input(device, name, kw, param, words):
    kw = dict(kw)
    x = kw.pop("x", x_())
    idx = kw.pop("idx", i_())
    k = kw.pop("k", 2)
    extra = {}
    if "mode" in kw:
        extra["drop_pad_mode"] = kw.pop("mode")
    if "active" in kw:
        extra["active_num"] = kw.pop("active")
    if "out" in kw:
        extra["out"] = kw.pop("out")
        if kw.pop("readonly_out", False):
            extra["out"].flags.writeable = False
    before = pm.emulator.stats()
    with pytest.raises(pm.InvalidArgument) as info:
        pm.moe_init_routing_v2_grad(x, idx, k, **extra)
    assert info.value.parameter == param, str(info.value)
    assert words in str(info.value), str(info.value)
    # Refused on the host: nothing reached CANN.
    after = pm.emulator.stats()
    assert after["device_allocations"] == before["device_allocations"]
    assert after["kernels_launched"] == before["kernels_launched"]


def test_at_least_forty_hostile_cases():
    assert len(HOSTILE) >= 40


def test_hostile_device_input(device):
    x, idx = pm.to_device(x_()), pm.to_device(i_())
    with pytest.raises(pm.InvalidArgument, match="out: must be contiguous"):
        pm.moe_init_routing_v2_grad(x, idx, 2, out=pm.empty((4, 8), F32)[:, ::2])
    closed = pm.Stream(device)
    closed.close()
    with pytest.raises(pm.ClosedError, match="stream is closed"):
        pm.moe_init_routing_v2_grad(x, idx, 2, stream=closed)
    with pytest.raises(pm.InvalidArgument, match="stream: must be a Stream"):
        pm.moe_init_routing_v2_grad(x, idx, 2, stream="default")
    with pytest.raises(pm.InvalidArgument, match="workspace: must be a DeviceArray"):
        pm.moe_init_routing_v2_grad(x, idx, 2, workspace=np.zeros(16 << 20, np.uint8))
    with pytest.raises(pm.InvalidArgument, match="out: must be a DeviceArray"):
        pm.moe_init_routing_v2_grad(x, idx, 2, out=np.zeros((4, 4), F32))
    dead = pm.to_device(x_())
    dead.close()
    with pytest.raises(pm.ClosedError, match="closed"):
        pm.moe_init_routing_v2_grad(dead, idx, 2)
    with pytest.raises(pm.ClosedError, match="closed"):
        pm.moe_init_routing_v2_grad(x, idx, 2, out=dead)
    with pytest.raises(pm.InvalidArgument, match="stream: must be a Stream"):
        pm.moe_init_routing_v2_grad(x, idx, 2, stream=device)


def test_odd_host_layouts_work(device):
    case = make_case(8, 2, 6, "float32", "dropless", seed=3)
    want = pm.reference.moe_init_routing_v2_grad(*case.args())
    fortran = np.asfortranarray(case.grad_expanded_x)
    swapped = case.grad_expanded_x.astype(">f4")
    swapped_idx = case.expanded_row_idx.astype(">i4")
    strided = np.zeros((32, 6), F32)
    strided[::2] = case.grad_expanded_x
    for x, idx in ((fortran, case.expanded_row_idx), (swapped, case.expanded_row_idx), (strided[::2], swapped_idx)):
        got = pm.moe_init_routing_v2_grad(x, idx, 2)
        assert compare(got, want).passed


def test_nan_and_inf_propagate(device):
    x = np.ones((8, 3), F32)
    x[0, 0], x[3, 1], x[4, 2], x[5, 2] = np.nan, np.inf, -np.inf, np.inf
    idx = np.arange(8, dtype=np.int32)
    got = pm.moe_init_routing_v2_grad(x, idx, 2)
    assert np.isnan(got[0, 0]) and got[1, 1] == np.inf and np.isnan(got[2, 2])
    assert got[3, 0] == 2.0


def test_device_fault_is_reported_at_synchronize_and_the_process_goes_on(device, no_leaks):
    x, idx = pm.to_device(np.ones((8, 4), F32)), pm.to_device(np.array([0, 1, 2, 3, 4, 5, 6, 99], np.int32))
    with closing(pm.Stream(device)) as s:
        out = pm.moe_init_routing_v2_grad(x, idx, 2, stream=s, validate=False)  # queued: no error yet
        with pytest.raises(pm.AclRuntimeError) as info:
            s.synchronize()
        e = info.value
        assert e.status == 507015 and e.name == "ACL_ERROR_RT_AICORE_EXCEPTION"
        assert "expandedRowIdx[7] = 99" in e.message and e.api == "aclrtSynchronizeStream"
        del e, info, out
        # The fault is the device's until a reset; then the process works on.
        with pytest.raises(pm.AclRuntimeError, match="507015"):
            pm.moe_init_routing_v2_grad(x, idx, 2, stream=s)
    device.reset()
    x, good = pm.to_device(np.ones((8, 4), F32)), pm.to_device(np.arange(8, dtype=np.int32))
    with closing(pm.Stream(device)) as s:
        np.testing.assert_array_equal(pm.moe_init_routing_v2_grad(x, good, 2, stream=s).to_host(s),
                                      np.full((4, 4), 2.0, F32))


def test_device_fault_through_numpy_call(device):
    with pytest.raises(pm.AclRuntimeError) as info:
        pm.moe_init_routing_v2_grad(np.ones((8, 4), F32), np.array([0, 1, 2, 3, 4, 5, 6, -3], np.int32), 2,
                                    validate=False)
    assert info.value.status == 507015 and "-3" in info.value.message
    device.reset()
    assert compare(pm.moe_init_routing_v2_grad(np.ones((8, 4), F32), i_(), 2), np.full((4, 4), 2.0, F32)).passed


def test_eight_threads_five_hundred_launches_each(device, no_leaks):
    errors, done = [], []

    def worker(t: int) -> None:
        try:
            cases = [make_case(8, 2, 16, "bfloat16", "dropless", seed=1000 * t + j) for j in range(4)]
            with closing(pm.Stream(device)) as s:
                arrays = [(pm.to_device(c.grad_expanded_x, stream=s), pm.to_device(c.expanded_row_idx, stream=s))
                          for c in cases]
                outs = [pm.empty((8, 16), BF16) for _ in cases]
                for launch in range(500):
                    j = launch % 4
                    pm.moe_init_routing_v2_grad(*arrays[j], 2, out=outs[j], stream=s)
                for c, o in zip(cases, outs):
                    if not np.array_equal(o.to_host(s), pm.reference.moe_init_routing_v2_grad(*c.args())):
                        errors.append(f"thread {t}: wrong result")
            done.append(t)
        except Exception as exc:  # reported below
            errors.append(f"thread {t}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and sorted(done) == list(range(8))


def test_one_plan_from_two_threads(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=5)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    plan = pm.MoeInitRoutingV2Grad(x, idx, 2)
    errors = []

    def worker() -> None:
        try:
            with closing(pm.Stream(device)) as s:
                for _ in range(300):
                    plan(s)
                s.synchronize()
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # It works: each thread's launches went to its own stream with its own workspace.
    assert not errors
    assert compare(plan.out.to_host(), pm.reference.moe_init_routing_v2_grad(*case.args())).passed
    plan.close()


def child_lifetimes() -> None:
    pm.use_emulator()
    dev = pm.Device(0)
    s = pm.Stream(dev)
    base = pm.to_device(np.arange(16, dtype=np.float32))
    view = base[4:8]
    base.close()
    base.close()  # close twice: a no-op
    assert view.to_host().tolist() == [4, 5, 6, 7]  # the view outlives its base
    arr = pm.to_device(np.ones(4, np.float32), stream=s)
    s.close()
    s.close()
    assert arr.to_host().tolist() == [1, 1, 1, 1]  # an array outlives its stream
    owner = pm.to_device(np.arange(4, dtype=np.float32))
    borrowed = pm.DeviceArray.from_pointer(owner.data_ptr, (4,), np.float32, owner=owner)
    del owner
    gc.collect()
    assert borrowed.to_host().tolist() == [0, 1, 2, 3]  # a borrowed pointer keeps its owner
    plan = pm.MoeInitRoutingV2Grad(pm.to_device(np.ones((4, 2), np.float32)),
                                   pm.to_device(np.arange(4, dtype=np.int32)), 2)
    tensor = pm.AclTensor(view)
    dev.close()  # a reset with live arrays, tensors, a plan (no aclFinalize)
    for thing in (view, arr, borrowed):
        try:
            thing.to_host()
        except pm.ClosedError:
            pass
        else:
            raise SystemExit("an array of a closed device still read")
    for closer in (view.close, arr.close, plan.close, tensor.close, s.close, dev.close):
        closer()  # safe no-ops
    try:
        plan()
    except pm.ClosedError:
        pass
    else:
        raise SystemExit("a plan of a closed device still launched")
    st = pm.emulator.stats()
    assert st["device_allocations"] == 0 and st["devices_set"] == 0 and st["initialized"] == 1, st
    print("ok")


def test_lifetimes_in_a_fresh_process(isolated):
    r = isolated(child_lifetimes)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def child_finalizers_under_constant_garbage_collection() -> None:
    pm.use_emulator()
    gc.set_threshold(1, 1, 1)
    dev = pm.Device(0)
    case_x, case_i = np.ones((8, 4), np.float32), np.arange(8, dtype=np.int32)
    for _ in range(300):
        s = pm.Stream(dev)
        x, idx = pm.to_device(case_x, stream=s), pm.to_device(case_i, stream=s)
        plan = pm.MoeInitRoutingV2Grad(x, idx, 2)
        t = pm.AclTensor(x)
        out = pm.moe_init_routing_v2_grad(x, idx, 2, stream=s)
        plan(s)
        ev = s.record()
        cycle = [x, idx, plan, t, out, ev, s]
        cycle.append(cycle)  # only the collector can free these
        del x, idx, plan, t, out, ev, s, cycle
    gc.collect()
    dev.synchronize()
    pm.empty_cache()
    gc.collect()
    st = pm.emulator.stats()
    assert st["tensors"] == 0 and st["executors"] == 0 and st["streams"] == 0, st
    print("ok")


def test_finalizers_under_constant_garbage_collection(isolated):
    # Objects caught in reference cycles are freed by the collector, at arbitrary points of
    # other work, including inside the binding and inside cffi. Their finalizers call CANN:
    # they must never wait for a lock the interrupted code holds (this once hung the suite).
    r = isolated(child_finalizers_under_constant_garbage_collection, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def child_work_queued_by_objects_in_a_cycle() -> None:
    pm.use_emulator()
    pm.emulator.set_stream_mode("lazy")  # the work stays queued until something waits
    dev = pm.Device(0)
    faults = pm.emulator.stats()["device_faults"]
    for _ in range(25):
        s = pm.Stream(dev)
        x = pm.to_device(np.ones((64, 32), np.float32), stream=s)
        idx = pm.to_device(np.arange(64, dtype=np.int32), stream=s)
        plan = pm.MoeInitRoutingV2Grad(x, idx, 2)
        for _ in range(3):
            plan(s)  # queued, not run
        out = pm.moe_init_routing_v2_grad(x, idx, 2, stream=s)
        cycle = [s, x, idx, plan, out]
        cycle.append(cycle)
        del s, x, idx, plan, out, cycle
        gc.collect()  # frees the cycle while its work is queued
        assert pm.emulator.stats()["pending_tasks"] > 0
    dev.synchronize()
    pm.empty_cache()
    gc.collect()
    st = pm.emulator.stats()
    assert st["device_faults"] == faults, "queued work read memory the collector had freed"
    assert st["device_allocations"] == 0 and st["streams"] == 0 and st["executors"] == 0, st
    print("ok")


def test_work_queued_by_objects_in_a_cycle_finishes_before_their_memory_goes(isolated):
    # Plans, arrays and streams caught in one reference cycle are freed by the collector in an
    # order of its choosing. Memory that queued launches read must outlive them: no device
    # fault may surface, and everything is freed in the end.
    r = isolated(child_work_queued_by_objects_in_a_cycle, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_weak_references_run_no_python_code_when_their_object_dies(device):
    """The binding's weak references (a plan, a stream, its workspace's memory, an event's
    core) have no callback that runs Python code: a KeyboardInterrupt that lands while one of
    them dies can never be swallowed inside one (only the safe point's own callback,
    deque.append, which runs none, is allowed)."""
    import weakref

    from pyacl_moe import _lifetime

    x = pm.to_device(np.ones((8, 4), np.float32))
    idx = pm.to_device(np.arange(8, dtype=np.int32))
    with closing(pm.Stream(device)) as s, pm.MoeInitRoutingV2Grad(x, idx, 2) as plan:
        plan(s)
        ev = s.record()
        members = [plan, s, s.state, s.state.workspace, ev._core, x.alloc]
        assert s.state.workspace is not None
        seen = 0
        for obj in members:
            for r in weakref.getweakrefs(obj):
                cb = r.__callback__  # (a block's token: its shelf's append, bound once)
                shelf = getattr(cb, "__self__", None)
                assert cb in (None, _lifetime._dead.append) or type(shelf).__name__ == "_Shelf" and cb == shelf.append, (
                    obj, cb)
                seen += r.__callback__ is not None
        assert seen >= 5
        s.synchronize()


def test_wrong_types_and_out_of_range_integers_are_refused_by_name(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=14)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    with pytest.raises(pm.InvalidArgument, match="shape"):
        pm.empty((2**62, 4), np.float32)
    with pytest.raises(pm.InvalidArgument, match="shape"):
        pm.empty("12", np.float32)
    with pytest.raises(pm.InvalidArgument, match="stream"):
        pm.moe_init_routing_v2_grad(x, idx, 2, stream=5)
    with closing(pm.Stream(device)) as s:
        with pytest.raises(pm.InvalidArgument, match="event"):
            s.wait_event(None)
        with pytest.raises(pm.InvalidArgument, match="timeout_ms"):
            s.synchronize(timeout_ms=2**40)
        size, ex = pm.get_workspace_size(x, idx, 2, 0, 0, pm.empty((8, 16), np.float32))
        ws = pm.empty((size,), np.uint8)
        with pytest.raises(pm.InvalidArgument, match="workspace_size"):
            pm.execute(ws, -1, ex, s)
        pm.execute(ws, size, ex, s)
        s.synchronize()
    with pytest.raises(pm.InvalidArgument, match="ptr"):
        pm.DeviceArray.from_pointer(2**64, (4,), np.float32)
    with pytest.raises(pm.InvalidArgument, match="top_k"):
        pm.get_workspace_size(x, idx, 2.0)


@pytest.mark.parametrize("value", [[2], np.array([2]), {2: 2}], ids=["list", "array", "dict"])
def test_an_unhashable_attribute_of_a_device_call_is_refused_by_name(device, no_leaks, value):
    # The device call's memo of validated calls hashed the values first: a list gave Python's
    # "unhashable type" TypeError instead of the parameter's name (the host call named it).
    case = make_case(8, 2, 16, "float32", "dropless", seed=14)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    with pytest.raises(pm.InvalidArgument, match="top_k: must be an int"):
        pm.moe_init_routing_v2_grad(x, idx, value)
    fx, ids = pm.to_device(np.ones((4, 8), np.float32)), pm.to_device(np.zeros((4, 2), np.int32))
    with pytest.raises(pm.InvalidArgument, match="active_num: must be an int"):
        pm.moe_init_routing_v2(fx, ids, active_num=value)


def test_every_closed_object_raises_closed_error(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=15)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    s = pm.Stream(device)
    s.close()
    ev = pm.Event(device)
    ev.close()
    a = pm.to_device(np.ones(4, np.float32))
    a.close()
    t = pm.AclTensor(pm.to_device(np.ones(4, np.float32)))
    t.close()
    plan = pm.MoeInitRoutingV2Grad(x, idx, 2)
    plan.close()
    size, ex = pm.get_workspace_size(x, idx, 2, 0, 0, pm.empty((8, 16), np.float32))
    ex.close()
    other_out = pm.empty((8, 16), np.float32)
    for use in (s.synchronize, s.query, lambda: s.record(), ev.synchronize, ev.query, lambda: ev.record(),
                a.to_host, lambda: a[0], t.core, lambda: t.view_shape, plan, lambda: plan.rebind(out=other_out),
                ex.set_repeatable, lambda: pm.execute(None, 0, ex)):
        with pytest.raises(pm.ClosedError):
            use()
