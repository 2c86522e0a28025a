"""The emulator's stream engine, queries, handles, contexts and fork, through raw cffi.

Async mode (the default) runs queued work on a background engine thread; lazy mode runs it
only when something waits. Tests that must see queued-but-not-run work use the ``lazy``
fixture. Process-wide state (device count, queue depth, fork) is tested in fresh interpreters.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from .emu_raw import Emu
from .test_emulator import (  # noqa: F401  (res and lazy are fixtures)
    ACL_ERROR_INVALID_PARAM,
    ACL_ERROR_REPEAT_INITIALIZE,
    ACL_FLOAT,
    ACLNN_ERR_INNER,
    ACLNN_ERR_PARAM_INVALID,
    RT_AICORE_EXCEPTION,
    RT_CONTEXT_NULL,
    RT_INVALID_HANDLE,
    RT_PARAM_INVALID,
    _simple,
    assert_matches,
    launch,
    lazy,
    op_on,
    phase1,
    reference,
    res,
    run_fresh,
    try_malloc,
)

COMPLETE_EVENT, NOT_READY_EVENT = 1, 0      # aclrtEventRecordedStatus
COMPLETE_STREAM, NOT_READY_STREAM = 0, 1    # aclrtStreamStatus
RT_STREAM_CONTEXT = 107003


def event_status(emu, ev) -> int:
    st = emu.ffi.new("aclrtEventRecordedStatus *", 7)
    emu.ok(emu.acl.aclrtQueryEventStatus(ev, st))
    return int(st[0])


def stream_status(emu, s) -> int:
    st = emu.ffi.new("aclrtStreamStatus *", 7)
    emu.ok(emu.acl.aclrtStreamQuery(s, st))
    return int(st[0])


def poll(cond, deadline_s: float = 10.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.001)
    return cond()


# ============================================================================ modes

def child_print_stream_mode() -> None:
    emu = Emu()
    print(json.dumps({"m": emu.ffi.string(emu.acl.aclemuGetStreamMode()).decode()}))


def test_stream_mode_default_env_and_switch(emu, isolated):
    assert emu.ffi.string(emu.acl.aclemuGetStreamMode()) == b"async"
    assert emu.acl.aclemuSetStreamMode(b"bogus") == -1
    assert emu.acl.aclemuSetStreamMode(emu.NULL) == -1
    assert emu.ffi.string(emu.acl.aclemuGetStreamMode()) == b"async"
    r = run_fresh(isolated, child_print_stream_mode, env={"PYACL_MOE_EMU_STREAMS": "lazy"})
    assert r["m"] == "lazy"


# ============================================================================ queries

def test_queries_in_lazy_mode_run_nothing(emu, res, lazy):
    x, idx, xt, it, ot, out_p = _simple(emu, res, seed=101)
    s, ev, never = res.stream(), res.event(), res.event()
    assert stream_status(emu, s) == COMPLETE_STREAM          # nothing queued
    assert stream_status(emu, emu.NULL) == COMPLETE_STREAM   # NULL: the default stream
    assert event_status(emu, never) == NOT_READY_EVENT       # never recorded: not ready (CANN)
    launch(emu, res, xt, it, 2, 0, 0, ot, stream=s, sync=False)
    emu.ok(emu.acl.aclrtRecordEvent(ev, s))
    for _ in range(3):  # a query never runs work itself
        assert event_status(emu, ev) == NOT_READY_EVENT
        assert stream_status(emu, s) == NOT_READY_STREAM
    assert emu.stats()["pending_tasks"] >= 2
    emu.ok(emu.acl.aclrtSynchronizeEvent(ev))
    assert event_status(emu, ev) == COMPLETE_EVENT
    assert stream_status(emu, s) == COMPLETE_STREAM
    # Recording again makes it not ready until the new record runs.
    emu.ok(emu.acl.aclrtRecordEvent(ev, s))
    assert event_status(emu, ev) == NOT_READY_EVENT
    emu.ok(emu.acl.aclrtSynchronizeStream(s))
    assert event_status(emu, ev) == COMPLETE_EVENT
    ref, mag = reference(x, idx, 2, 0, 0, np.float32)
    assert_matches(res.read(out_p, (4, 3), np.float32), ref, mag)


def test_query_arguments_and_stale_handles(emu, res):
    ev, s = res.event(), res.stream()
    assert emu.acl.aclrtQueryEventStatus(ev, emu.NULL) == ACL_ERROR_INVALID_PARAM
    assert emu.acl.aclrtStreamQuery(s, emu.NULL) == ACL_ERROR_INVALID_PARAM
    e2, s2 = emu.ffi.new("aclrtEvent *"), emu.ffi.new("aclrtStream *")
    emu.ok(emu.acl.aclrtCreateEvent(e2))
    emu.ok(emu.acl.aclrtDestroyEvent(e2[0]))
    emu.ok(emu.acl.aclrtCreateStream(s2))
    emu.ok(emu.acl.aclrtDestroyStream(s2[0]))
    st = emu.ffi.new("aclrtEventRecordedStatus *")
    assert emu.acl.aclrtQueryEventStatus(e2[0], st) == RT_INVALID_HANDLE
    assert "not a live event" in emu.msg()
    sst = emu.ffi.new("aclrtStreamStatus *")
    assert emu.acl.aclrtStreamQuery(s2[0], sst) == RT_INVALID_HANDLE
    # A stream handle is not an event handle, nor the other way round.
    assert emu.acl.aclrtQueryEventStatus(s, st) == RT_INVALID_HANDLE
    assert emu.acl.aclrtStreamQuery(ev, sst) == RT_INVALID_HANDLE


def test_stream_query_leaves_a_device_fault_for_the_next_synchronize(emu, res):
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    idx = np.array([0, 1, 2, 3, 4, 99], np.int32)  # 99 addresses no row: a device fault
    xt, it, ot, out_p = op_on(emu, res, x, idx, 2, 0, 0, ACL_FLOAT)
    s, ev = res.stream(), res.event()
    faults = emu.stats()["device_faults"]
    launch(emu, res, xt, it, 2, 0, 0, ot, stream=s, sync=False)
    emu.ok(emu.acl.aclrtRecordEvent(ev, s))
    assert poll(lambda: stream_status(emu, s) == COMPLETE_STREAM)  # the engine ran it
    assert emu.stats()["device_faults"] == faults + 1
    assert stream_status(emu, s) == COMPLETE_STREAM  # queries do not report or consume it
    assert event_status(emu, ev) == COMPLETE_EVENT
    assert emu.acl.aclrtSynchronizeStream(s) == RT_AICORE_EXCEPTION  # reported once
    assert "expandedRowIdx[5] = 99" in emu.msg()
    emu.ok(emu.acl.aclrtSynchronizeStream(s))


# ============================================================================ the engine

def test_async_engine_runs_queued_work_without_synchronize(emu, res):
    x, idx, xt, it, ot, out_p = _simple(emu, res, seed=102)
    s, ev = res.stream(), res.event()
    before = emu.stats()["kernels_run"]
    launch(emu, res, xt, it, 2, 0, 0, ot, stream=s, sync=False)
    emu.ok(emu.acl.aclrtRecordEvent(ev, s))
    # Nobody synchronizes: the engine must reach the record by itself.
    assert poll(lambda: event_status(emu, ev) == COMPLETE_EVENT), "the engine never ran the stream"
    assert emu.stats()["kernels_run"] == before + 1
    assert stream_status(emu, s) == COMPLETE_STREAM
    ref, mag = reference(x, idx, 2, 0, 0, np.float32)
    assert_matches(res.read(out_p, (4, 3), np.float32), ref, mag)  # a plain copy sees the result


def test_switching_to_async_hands_queued_work_to_the_engine(emu, res):
    s, ev = res.stream(), res.event()
    buf = res.dev(4096)
    assert emu.acl.aclemuSetStreamMode(b"lazy") == 0
    try:
        emu.ok(emu.acl.aclrtMemsetAsync(buf, 4096, 0x5A, 4096, s))
        emu.ok(emu.acl.aclrtRecordEvent(ev, s))
        time.sleep(0.05)
        assert event_status(emu, ev) == NOT_READY_EVENT  # lazy: still queued
    finally:
        assert emu.acl.aclemuSetStreamMode(b"async") == 0
    assert poll(lambda: event_status(emu, ev) == COMPLETE_EVENT)
    assert emu.d2h(buf, 4096) == b"\x5a" * 4096


def test_cross_stream_wait_in_async_mode(emu, res):
    # s2 waits for an event on s1; the engine must run s1 up to the event first, and a chain
    # of waits across several streams must not deadlock.
    x, idx, xt, it, ot, out_p = _simple(emu, res, seed=103)
    streams = [res.stream() for _ in range(4)]
    events = [res.event() for _ in range(4)]
    copy = res.dev(48)
    launch(emu, res, xt, it, 2, 0, 0, ot, stream=streams[0], sync=False)
    emu.ok(emu.acl.aclrtRecordEvent(events[0], streams[0]))
    for i in range(1, 4):
        emu.ok(emu.acl.aclrtStreamWaitEvent(streams[i], events[i - 1]))
        emu.ok(emu.acl.aclrtRecordEvent(events[i], streams[i]))
    emu.ok(emu.acl.aclrtMemcpyAsync(copy, 48, out_p, 48, 3, streams[3]))
    emu.ok(emu.acl.aclrtRecordEvent(events[3], streams[3]))
    assert poll(lambda: event_status(emu, events[3]) == COMPLETE_EVENT)
    ref, mag = reference(x, idx, 2, 0, 0, np.float32)
    assert_matches(res.read(copy, (4, 3), np.float32), ref, mag)


def test_event_timestamp_is_taken_when_the_record_runs(emu, res, lazy):
    # In lazy mode the record runs when waited for, so the gap between two records includes
    # the host's sleep only if the second record ran after it.
    s = res.stream()
    a, b = res.event(), res.event()
    emu.ok(emu.acl.aclrtRecordEvent(a, s))
    emu.ok(emu.acl.aclrtSynchronizeStream(s))
    emu.ok(emu.acl.aclrtRecordEvent(b, s))
    time.sleep(0.05)
    emu.ok(emu.acl.aclrtSynchronizeStream(s))
    ms = emu.ffi.new("float *")
    emu.ok(emu.acl.aclrtEventElapsedTime(ms, a, b))
    assert ms[0] >= 45.0


# For the fresh interpreters below: tensors and a slow kernel (about 0.1 to 1 s on one thread).

def nd_tensor(emu: Emu, shape, dt: int, p):
    s = emu.ffi.new("int64_t[]", list(shape))
    return emu.nn.aclCreateTensor(s, len(shape), dt, emu.NULL, 0, 2, s, len(shape), p)


def slow_kernel(emu: Emu, n: int, k: int, h: int, rows: int = 16):
    """Active mode over a small x: n*k*h additions, little memory. Returns launch(stream)."""
    acl, ffi = emu.acl, emu.ffi
    x = np.ones((rows, h), np.float32)
    idx = (np.arange(n * k) % rows).astype(np.int32)
    ps = [try_malloc(emu, b)[1] for b in (x.nbytes, idx.nbytes, n * h * 4, 16 << 20)]
    acl.aclrtMemcpy(ps[0], x.nbytes, ffi.from_buffer(x), x.nbytes, 1)
    acl.aclrtMemcpy(ps[1], idx.nbytes, ffi.from_buffer(idx), idx.nbytes, 1)
    ws, ex = ffi.new("uint64_t *"), ffi.new("aclOpExecutor **")
    assert emu.op.aclnnMoeInitRoutingV2GradGetWorkspaceSize(
        nd_tensor(emu, (rows, h), 0, ps[0]), nd_tensor(emu, (n * k,), 3, ps[1]), k, 0, rows,
        nd_tensor(emu, (n, h), 0, ps[2]), ws, ex) == 0, emu.msg()
    assert emu.nn.aclSetAclOpExecutorRepeatable(ex[0]) == 0
    return lambda stream: emu.op.aclnnMoeInitRoutingV2Grad(ps[3], ws[0], ex[0], stream)


def new_handle(emu: Emu, kind: str):
    """A new aclrtStream or aclrtEvent."""
    h = emu.ffi.new(kind + " *")
    assert getattr(emu.acl, "aclrtCreate" + kind[5:])(h) == 0, emu.msg()
    return h[0]


def ev_status(emu: Emu, e) -> int:
    st = emu.ffi.new("aclrtEventRecordedStatus *")
    assert emu.acl.aclrtQueryEventStatus(e, st) == 0
    return st[0]


def child_full_stream() -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    acl.aclInit(ffi.NULL)
    acl.aclrtSetDevice(0)
    slow = slow_kernel(emu, 4096, 128, 2048)
    s, ev = new_handle(emu, "aclrtStream"), new_handle(emu, "aclrtEvent")
    buf = try_malloc(emu, 64)[1]
    out = {"tries": 0}
    for _ in range(4):  # calibrate: the kernel must still run when the enqueues start
        out["tries"] += 1
        assert slow(s) == 0 and acl.aclrtRecordEvent(ev, s) == 0
        if ev_status(emu, ev) == 0:
            break
        assert acl.aclrtSynchronizeStream(s) == 0
    out["running_at_start"] = ev_status(emu, ev) == 0
    peak = 0
    for _ in range(8):  # depth 4: the kernel and the record fill half of it
        assert acl.aclrtMemsetAsync(buf, 64, 1, 64, s) == 0
        peak = max(peak, emu.stats()["pending_tasks"])
    # Room for the last enqueues appeared only once the kernel (and the record) had run.
    out["record_done_after_enqueues"] = ev_status(emu, ev) == 1
    out["peak"] = peak
    assert acl.aclrtSynchronizeStream(s) == 0
    out["pending_after"] = emu.stats()["pending_tasks"]
    print(json.dumps(out))


def test_full_stream_makes_the_enqueue_wait_for_room(isolated):
    r = run_fresh(isolated, child_full_stream, env={"PYACL_MOE_EMU_QUEUE_DEPTH": "4", "PYACL_MOE_EMU_THREADS": "1"})
    assert r["running_at_start"], r
    assert r["record_done_after_enqueues"], r
    assert r["peak"] <= 4, r
    assert r["pending_after"] == 0


def child_lazy_mode_has_no_bound() -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    acl.aclInit(ffi.NULL)
    acl.aclrtSetDevice(0)
    assert acl.aclemuSetStreamMode(b"lazy") == 0
    s = new_handle(emu, "aclrtStream")
    buf = try_malloc(emu, 64)[1]
    for _ in range(50):
        assert acl.aclrtMemsetAsync(buf, 64, 1, 64, s) == 0
    out = {"pending": emu.stats()["pending_tasks"]}
    assert acl.aclrtSynchronizeStream(s) == 0
    print(json.dumps(out))


def test_lazy_mode_has_no_bound(isolated):
    r = run_fresh(isolated, child_lazy_mode_has_no_bound, env={"PYACL_MOE_EMU_QUEUE_DEPTH": "4"})
    assert r["pending"] == 50


def child_finalize_stops_the_engine() -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi

    def threads():
        return len(os.listdir("/proc/self/task"))

    base = threads()
    out = {}

    def run_some():
        s, ev = new_handle(emu, "aclrtStream"), new_handle(emu, "aclrtEvent")
        buf = try_malloc(emu, 1 << 20)[1]
        assert acl.aclrtMemsetAsync(buf, 1 << 20, 3, 1 << 20, s) == 0
        assert acl.aclrtRecordEvent(ev, s) == 0
        end = time.monotonic() + 10
        while ev_status(emu, ev) != 1 and time.monotonic() < end:
            time.sleep(0.001)
        return ev_status(emu, ev) == 1

    for round_ in range(2):
        assert acl.aclInit(ffi.NULL) == 0 and acl.aclrtSetDevice(0) == 0
        out[f"ran{round_}"] = run_some()
        out[f"threads_running{round_}"] = threads() - base
        assert acl.aclFinalize() == 0
        out[f"threads_after{round_}"] = threads() - base
    out["ran_after_finalize"] = run_some()
    out["threads_after_finalize"] = threads() - base
    print(json.dumps(out))


def test_finalize_stops_the_engine(isolated):
    # Two rounds (aclInit after aclFinalize is allowed on the default 9.0.0 profile). aclFinalize
    # releases nothing, so work queued after it, without a new aclInit, still runs: on an engine
    # thread started anew.
    r = run_fresh(isolated, child_finalize_stops_the_engine)
    assert r == {"ran0": True, "threads_running0": 1, "threads_after0": 0,
                 "ran1": True, "threads_running1": 1, "threads_after1": 0,
                 "ran_after_finalize": True, "threads_after_finalize": 1}


# ============================================================================ handles

def test_stale_runtime_handles_never_alias_new_objects(emu):
    acl, ffi = emu.acl, emu.ffi
    seen_streams, seen_events = set(), set()
    s, e = ffi.new("aclrtStream *"), ffi.new("aclrtEvent *")
    emu.ok(acl.aclrtCreateStream(s))
    emu.ok(acl.aclrtCreateEvent(e))
    buf = emu.malloc(64)
    old_s, old_e = s[0], e[0]
    emu.ok(acl.aclrtDestroyStream(old_s))
    emu.ok(acl.aclrtDestroyEvent(old_e))
    for _ in range(200):  # recreate: the slot is reused, the handle is not
        emu.ok(acl.aclrtCreateStream(s))
        emu.ok(acl.aclrtCreateEvent(e))
        hs, he = int(ffi.cast("uintptr_t", s[0])), int(ffi.cast("uintptr_t", e[0]))
        assert hs not in seen_streams and he not in seen_events
        seen_streams.add(hs)
        seen_events.add(he)
        assert s[0] != old_s and e[0] != old_e
        # The stale handle reaches nothing, while the new one works.
        assert acl.aclrtSynchronizeStream(old_s) == RT_INVALID_HANDLE
        assert acl.aclrtRecordEvent(old_e, s[0]) == RT_INVALID_HANDLE
        assert acl.aclrtMemsetAsync(buf, 64, 0, 64, old_s) == RT_INVALID_HANDLE
        emu.ok(acl.aclrtRecordEvent(e[0], s[0]))
        emu.ok(acl.aclrtSynchronizeStream(s[0]))
        emu.ok(acl.aclrtDestroyEvent(e[0]))
        emu.ok(acl.aclrtDestroyStream(s[0]))
        old_s, old_e = s[0], e[0]
    emu.ok(acl.aclrtFree(buf))
    # Handles are not host addresses: the emulator never hands out a dereferenceable pointer.
    assert all(h >> 56 for h in seen_streams | seen_events)


def test_stale_aclnn_handles_never_alias_new_objects(emu, res):
    nn = emu.nn
    buf = res.dev(4096)
    t_old = emu.tensor((2, 3), ACL_FLOAT, buf)
    emu.ok(nn.aclDestroyTensor(t_old))
    t_new = emu.tensor((2, 3), ACL_FLOAT, buf)
    try:
        assert t_new != t_old
        dt = emu.ffi.new("aclDataType *")
        assert nn.aclGetDataType(t_old, dt) == ACLNN_ERR_PARAM_INVALID
        emu.ok(nn.aclGetDataType(t_new, dt))
        assert nn.aclDestroyTensor(t_old) == ACLNN_ERR_PARAM_INVALID  # not the new one
        emu.ok(nn.aclGetDataType(t_new, dt))
    finally:
        emu.ok(nn.aclDestroyTensor(t_new))
    # Executors: a consumed one-shot executor's handle stays dead after a new one is built.
    x, idx, xt, it, ot, out_p = _simple(emu, res, seed=104)
    st, ws, ex_old = phase1(emu, xt, it, 2, 0, 0, ot)
    emu.ok(st)
    emu.ok(emu.op.aclnnMoeInitRoutingV2Grad(res.workspace(), ws, ex_old, emu.NULL))
    st, ws, ex_new = phase1(emu, xt, it, 2, 0, 0, ot)
    emu.ok(st)
    assert ex_new != ex_old
    assert emu.op.aclnnMoeInitRoutingV2Grad(res.workspace(), ws, ex_old, emu.NULL) == ACLNN_ERR_PARAM_INVALID
    assert nn.aclSetAclOpExecutorRepeatable(ex_old) == ACLNN_ERR_INNER
    emu.ok(emu.op.aclnnMoeInitRoutingV2Grad(res.workspace(), ws, ex_new, emu.NULL))
    emu.ok(emu.acl.aclrtSynchronizeStream(emu.NULL))
    # Scalars and int arrays.
    v = emu.ffi.new("float *", 1.0)
    sc = nn.aclCreateScalar(v, ACL_FLOAT)
    emu.ok(nn.aclDestroyScalar(sc))
    sc2 = nn.aclCreateScalar(v, ACL_FLOAT)
    assert sc2 != sc and nn.aclDestroyScalar(sc) == ACLNN_ERR_PARAM_INVALID
    emu.ok(nn.aclDestroyScalar(sc2))
    arr = nn.aclCreateIntArray(emu.ffi.new("int64_t[]", [1]), 1)
    emu.ok(nn.aclDestroyIntArray(arr))
    arr2 = nn.aclCreateIntArray(emu.ffi.new("int64_t[]", [1]), 1)
    assert arr2 != arr and nn.aclDestroyIntArray(arr) == ACLNN_ERR_PARAM_INVALID
    emu.ok(nn.aclDestroyIntArray(arr2))
    # A tensor handle is not an executor handle.
    t = emu.tensor((2, 3), ACL_FLOAT, buf)
    try:
        assert nn.aclDestroyAclOpExecutor(emu.ffi.cast("aclOpExecutor *", t)) == ACLNN_ERR_INNER
    finally:
        emu.ok(nn.aclDestroyTensor(t))


# ============================================================================ contexts

def test_current_context_set_and_get(emu):
    acl, ffi = emu.acl, emu.ffi
    c = ffi.new("aclrtContext *")
    emu.ok(acl.aclrtGetCurrentContext(c))
    assert c[0] != emu.NULL
    assert acl.aclrtGetCurrentContext(emu.NULL) == ACL_ERROR_INVALID_PARAM
    assert acl.aclrtSetCurrentContext(emu.NULL) == ACL_ERROR_INVALID_PARAM
    # Not a live context: RT_ERROR_INVALID_VALUE (ApiErrorDecorator::ContextSetCurrent), 107000.
    assert acl.aclrtSetCurrentContext(ffi.cast("void *", 0x1234)) == RT_PARAM_INVALID
    sets = emu.stats()["devices_set"]
    seen = {}

    def worker():
        cc = ffi.new("aclrtContext *")
        d = ffi.new("int32_t *")
        seen["get_before"] = acl.aclrtGetCurrentContext(cc)
        seen["dev_before"] = acl.aclrtGetDevice(d)
        seen["set"] = acl.aclrtSetCurrentContext(c[0])  # no aclrtSetDevice on this thread
        seen["dev_after"] = (acl.aclrtGetDevice(d), d[0])
        seen["get_after"] = (acl.aclrtGetCurrentContext(cc), cc[0] == c[0])
        s = ffi.new("aclrtStream *")
        seen["stream"] = acl.aclrtCreateStream(s)
        acl.aclrtDestroyStream(s[0])

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["get_before"] == RT_CONTEXT_NULL and seen["dev_before"] == RT_CONTEXT_NULL
    assert seen["set"] == 0 and seen["dev_after"] == (0, 0) and seen["get_after"] == (0, True)
    assert seen["stream"] == 0
    assert emu.stats()["devices_set"] == sets  # switching took no device reference


def child_contexts_switch_devices() -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    acl.aclInit(ffi.NULL)
    c0, c1 = ffi.new("aclrtContext *"), ffi.new("aclrtContext *")
    assert acl.aclrtSetDevice(1) == 0 and acl.aclrtGetCurrentContext(c1) == 0
    assert acl.aclrtSetDevice(0) == 0 and acl.aclrtGetCurrentContext(c0) == 0
    out = {"distinct": c0[0] != c1[0], "sets_before": emu.stats()["devices_set"]}
    d = ffi.new("int32_t *")
    t0 = time.perf_counter()
    bad = 0
    for i in range(100_000):
        bad += acl.aclrtSetCurrentContext(c1[0] if i & 1 else c0[0]) != 0
        if i % 10_000 == 0:
            bad += acl.aclrtGetDevice(d) != 0 or d[0] != (i & 1)
    out["seconds"] = time.perf_counter() - t0
    out["bad"] = bad
    out["sets_after"] = emu.stats()["devices_set"]
    # Streams follow the current context's device. Synchronizing one of another device
    # switches to its context (ApiImpl::StreamSynchronize); queueing work on it is 107003.
    assert acl.aclrtSetCurrentContext(c1[0]) == 0
    s = ffi.new("aclrtStream *")
    assert acl.aclrtCreateStream(s) == 0
    assert acl.aclrtSetCurrentContext(c0[0]) == 0
    out["foreign_stream"] = acl.aclrtSynchronizeStream(s[0])
    sst = ffi.new("aclrtStreamStatus *")
    out["foreign_query"] = acl.aclrtStreamQuery(s[0], sst)
    ev = ffi.new("aclrtEvent *")
    assert acl.aclrtCreateEvent(ev) == 0
    out["foreign_record"] = acl.aclrtRecordEvent(ev[0], s[0])
    out["foreign_destroy"] = acl.aclrtDestroyStream(s[0])
    assert acl.aclrtDestroyEvent(ev[0]) == 0
    assert acl.aclrtSetCurrentContext(c1[0]) == 0
    assert acl.aclrtDestroyStream(s[0]) == 0
    # Device 1's last reset destroys its context, for every thread.
    assert acl.aclrtResetDevice(1) == 0
    cc = ffi.new("aclrtContext *")
    out["get_dead"] = acl.aclrtGetCurrentContext(cc)
    out["getdev_dead"] = acl.aclrtGetDevice(d)
    out["set_dead"] = acl.aclrtSetCurrentContext(c1[0])
    out["set_dead_msg"] = emu.msg()
    assert acl.aclrtSetDevice(1) == 0 and acl.aclrtGetCurrentContext(cc) == 0
    out["new_ctx_differs"] = cc[0] != c1[0]
    out["set_dead_again"] = acl.aclrtSetCurrentContext(c1[0])
    out["set_c0"] = acl.aclrtSetCurrentContext(c0[0])
    print(json.dumps(out))


def test_contexts_switch_devices_without_references_and_die_with_the_device(isolated):
    r = run_fresh(isolated, child_contexts_switch_devices, env={"PYACL_MOE_EMU_DEVICES": "2"})
    assert r["distinct"] and r["bad"] == 0
    assert r["sets_before"] == 2 and r["sets_after"] == 2  # flat over 100k switches
    assert r["foreign_stream"] == 0 and r["foreign_query"] == 0
    assert r["foreign_record"] == RT_STREAM_CONTEXT and r["foreign_destroy"] == RT_STREAM_CONTEXT
    assert r["get_dead"] == RT_CONTEXT_NULL and r["getdev_dead"] == RT_CONTEXT_NULL
    assert r["set_dead"] == RT_PARAM_INVALID and "not a live context" in r["set_dead_msg"]
    assert r["new_ctx_differs"] and r["set_dead_again"] == RT_PARAM_INVALID
    assert r["set_c0"] == 0
    assert r["seconds"] < 10


# ============================================================================ fork

def fork_child_report(emu: Emu, parent: dict) -> dict:
    """Runs in the forked child: every call must return promptly; no device is set there."""
    acl, nn, ffi = emu.acl, emu.nn, emu.ffi
    d = ffi.new("int32_t *")
    st = ffi.new("aclrtEventRecordedStatus *")
    r = {"getdev": acl.aclrtGetDevice(d),
         "create_stream": acl.aclrtCreateStream(ffi.new("aclrtStream *")),
         "sync_parent_stream": acl.aclrtSynchronizeStream(parent["stream"]),
         "query_parent_event": acl.aclrtQueryEventStatus(parent["event"], st),
         "initialized": emu.stats()["initialized"], "streams": emu.stats()["streams"],
         "mode": ffi.string(acl.aclemuGetStreamMode()).decode()}
    acl.aclemuSetStreamMode(b"async")  # the child's own engine starts on first need
    r["init"] = acl.aclInit(ffi.NULL)
    r["set"] = acl.aclrtSetDevice(0)
    r["parent_stream_after_init"] = acl.aclrtSynchronizeStream(parent["stream"])
    r["parent_event_after_init"] = acl.aclrtQueryEventStatus(parent["event"], st)
    r["parent_tensor"] = nn.aclDestroyTensor(parent["tensor"])
    r["free_parent_block"] = acl.aclrtFree(parent["block"])
    # The child's own work runs (async: on an engine thread the child starts).
    s, e = new_handle(emu, "aclrtStream"), new_handle(emu, "aclrtEvent")
    buf = try_malloc(emu, 4096)[1]
    r["memset"] = acl.aclrtMemsetAsync(buf, 4096, 7, 4096, s)
    r["record"] = acl.aclrtRecordEvent(e, s)
    end = time.monotonic() + 10
    while ev_status(emu, e) != 1 and time.monotonic() < end:
        time.sleep(0.001)
    r["ran"] = ev_status(emu, e) == 1
    r["new_stream_not_parent"] = s != parent["stream"]
    small = slow_kernel(emu, 4, 2, 8, rows=4)
    r["launch"] = small(s)
    r["sync"] = acl.aclrtSynchronizeStream(s)
    r["finalize"] = acl.aclFinalize()
    return r


def resolve_all(emu: Emu) -> None:
    """cffi resolves a library function on first use under a Python lock; a thread of the parent
    may hold that lock at fork time, so the child must only use functions resolved before."""
    for lib in (emu.acl, emu.nn, emu.op):
        for name in dir(lib):
            try:
                getattr(lib, name)
            except AttributeError:  # declared, but exported by another of the three libraries
                pass


def fork_and_check(emu: Emu, parent: dict, timeout: float = 20.0) -> dict:
    """fork_child_report in a fork() child: what it returned, or {"hung": True}."""
    resolve_all(emu)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rfd)
            os.write(wfd, json.dumps(fork_child_report(emu, parent)).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            data = b""
            while chunk := os.read(rfd, 65536):
                data += chunk
            return json.loads(data) if data else {"child_status": status}
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return {"hung": True}


def child_fork_while_a_thread_is_inside(mode: str) -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    acl.aclInit(ffi.NULL)
    acl.aclrtSetDevice(0)
    assert acl.aclemuSetStreamMode(mode.encode()) == 0
    slow = slow_kernel(emu, 4096, 128, 2048)
    s, ev = new_handle(emu, "aclrtStream"), new_handle(emu, "aclrtEvent")
    block = try_malloc(emu, 4096)[1]
    parent = {"stream": s, "event": ev, "block": block, "tensor": nd_tensor(emu, (2,), 0, block)}
    runs = emu.stats()["kernels_run"]
    assert slow(s) == 0 and acl.aclrtRecordEvent(ev, s) == 0
    results = {}
    ctx = ffi.new("aclrtContext *")
    assert acl.aclrtGetCurrentContext(ctx) == 0

    def sync(name):
        acl.aclrtSetCurrentContext(ctx[0])
        results[name] = acl.aclrtSynchronizeStream(s)

    waiters = [threading.Thread(target=sync, args=(n,)) for n in ("a", "b")]
    for t in waiters:
        t.start()
    end = time.monotonic() + 10
    while emu.stats()["kernels_run"] == runs and time.monotonic() < end:
        time.sleep(0.0005)
    out = {"kernel_started": emu.stats()["kernels_run"] == runs + 1}
    time.sleep(0.005)  # let the second waiter block on the stream
    out["busy_at_fork"] = ev_status(emu, ev) == 0
    out["child"] = fork_and_check(emu, parent)
    for t in waiters:
        t.join()
    out["parent_syncs"] = results
    out["parent_still_works"] = acl.aclrtSynchronizeStream(s)
    print(json.dumps(out))


@pytest.mark.parametrize("mode", ["async", pytest.param("lazy", marks=pytest.mark.slow)])  # lazy: slow step
def test_fork_child_never_hangs_and_starts_without_devices(isolated, mode):
    # A parent thread is inside the emulator at fork time: in lazy mode it runs a slow kernel
    # while synchronizing, in async mode the engine runs it; either way a second thread waits
    # for the stream. The child must get errors promptly: no device is set there, the parent's
    # handles are stale, aclInit's flags are inherited (nothing checks them).
    r = run_fresh(isolated, child_fork_while_a_thread_is_inside, mode, env={"PYACL_MOE_EMU_THREADS": "1"})
    assert r["kernel_started"] and r["busy_at_fork"], r
    c = r["child"]
    assert not c.get("hung"), "the fork child hung on the emulator's locks"
    assert c["getdev"] == RT_CONTEXT_NULL and c["create_stream"] == RT_CONTEXT_NULL
    assert c["sync_parent_stream"] == RT_INVALID_HANDLE  # the handle is checked first
    assert c["query_parent_event"] == RT_INVALID_HANDLE
    assert c["initialized"] == 1 and c["streams"] == 0
    assert c["mode"] == mode
    assert c["init"] == ACL_ERROR_REPEAT_INITIALIZE and c["set"] == 0
    assert c["parent_stream_after_init"] == RT_INVALID_HANDLE
    assert c["parent_event_after_init"] == RT_INVALID_HANDLE
    assert c["parent_tensor"] == ACLNN_ERR_PARAM_INVALID
    assert c["free_parent_block"] == RT_PARAM_INVALID
    assert c["ran"] and c["new_stream_not_parent"]
    assert c["launch"] == 0 and c["sync"] == 0 and c["finalize"] == 0
    assert r["parent_syncs"] == {"a": 0, "b": 0} and r["parent_still_works"] == 0


def child_fork_while_threads_hammer_the_locks() -> None:
    emu = Emu()
    acl, nn, ffi = emu.acl, emu.nn, emu.ffi
    acl.aclInit(ffi.NULL)
    acl.aclrtSetDevice(0)
    ctx = ffi.new("aclrtContext *")
    assert acl.aclrtGetCurrentContext(ctx) == 0
    block = try_malloc(emu, 64)[1]
    t = nd_tensor(emu, (2,), 0, block)
    stop = threading.Event()

    def hammer():
        acl.aclrtSetCurrentContext(ctx[0])
        d, dt = ffi.new("int32_t *"), ffi.new("aclDataType *")
        while not stop.is_set():
            acl.aclrtGetDevice(d)
            nn.aclGetDataType(t, dt)

    resolve_all(emu)
    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for th in threads:
        th.start()
    time.sleep(0.05)  # both hammering
    results = []
    for _ in range(20):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            d = ffi.new("int32_t *")
            out = [acl.aclrtGetDevice(d), nn.aclDestroyTensor(t), acl.aclInit(ffi.NULL),
                   acl.aclrtSetDevice(0), acl.aclrtGetDevice(d), acl.aclFinalize()]
            os.write(wfd, json.dumps(out).encode())
            os._exit(0)
        os.close(wfd)
        end = time.monotonic() + 10
        while time.monotonic() < end and not os.waitpid(pid, os.WNOHANG)[0]:
            time.sleep(0.002)
        if time.monotonic() >= end:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            results.append("hung")
        else:
            results.append(json.loads(os.read(rfd, 4096) or b'"no output"'))
        os.close(rfd)
    stop.set()
    for th in threads:
        th.join()
    print(json.dumps({"children": results}))


def test_fork_while_threads_hammer_the_locks(isolated):
    # Parent threads call into both libraries in tight loops, so at fork time their locks are
    # often held; without fork handlers a child would inherit a held lock and hang. Twenty
    # children: each must finish its calls promptly.
    r = run_fresh(isolated, child_fork_while_threads_hammer_the_locks)
    want = [RT_CONTEXT_NULL, ACLNN_ERR_PARAM_INVALID, ACL_ERROR_REPEAT_INITIALIZE, 0, 0, 0]
    assert r["children"] == [want] * 20, r


# ============================================================================ fault injection

def test_fault_injection_on_the_new_calls(emu, res):
    acl, ffi = emu.acl, emu.ffi
    s, ev = res.stream(), res.event()
    ctx = ffi.new("aclrtContext *")
    est, sst = ffi.new("aclrtEventRecordedStatus *"), ffi.new("aclrtStreamStatus *")
    calls = {
        b"aclrtQueryEventStatus": lambda: acl.aclrtQueryEventStatus(ev, est),
        b"aclrtStreamQuery": lambda: acl.aclrtStreamQuery(s, sst),
        b"aclrtGetCurrentContext": lambda: acl.aclrtGetCurrentContext(ctx),
    }
    for name, call in calls.items():
        assert acl.aclemuInjectFault(name, 1, 0) == 0
        assert call() == 507000, name  # the runtime's usual failure
        assert "fault injected" in emu.msg()
        emu.ok(call())  # fired once
    emu.ok(acl.aclrtGetCurrentContext(ctx))
    assert acl.aclemuInjectFault(b"aclrtSetCurrentContext", 1, 107017) == 0
    assert acl.aclrtSetCurrentContext(ctx[0]) == 107017
    emu.ok(acl.aclrtSetCurrentContext(ctx[0]))
    # "*" skips the queries: the first call it counts is the aclrtSetCurrentContext.
    assert acl.aclemuInjectFault(b"*", 1, 123) == 0
    for call in calls.values():
        emu.ok(call())
    assert acl.aclrtSetCurrentContext(ctx[0]) == 123
    acl.aclemuClearFaults()
