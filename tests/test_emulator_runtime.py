"""The emulated runtime follows CANN's runtime source API by API, through the raw C ABI.

Each test names the rule it checks; docs/emulator.md, "The runtime, API by API", gives the
hicann/runtime (and hicann/driver) lines each rule was read from. The in-process tests run on
the default profile (9.0.0). Where the release profiles differ (aclInit after aclFinalize, an
empty copy, the memory attributes aclrtGetMemInfo takes), one fresh interpreter per profile
(PYACL_MOE_EMU_RELEASE) runs every scenario once per test session and each test checks one rule
on every profile, as test_emulator_releases.py does for the op.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time

import numpy as np
import pytest

from .conftest import _needs_emulator, start_isolated
from .emu_raw import Emu
from .test_emulator import (  # noqa: F401  (res and lazy are fixtures)
    ACL_ERROR_INVALID_PARAM,
    ACL_FLOAT,
    D2D,
    D2H,
    H2D,
    RT_AICORE_EXCEPTION,
    RT_CONTEXT_NULL,
    RT_INTERNAL_ERROR,
    RT_INVALID_HANDLE,
    RT_PARAM_INVALID,
    RT_STREAM_SYNC_TIMEOUT,
    launch,
    lazy,
    op_on,
    res,
    try_malloc,
)

RT_STREAM_CONTEXT = 107003
RT_INVALID_MEMORY_TYPE = 107016
RT_SYS_DMA = 507013
RT_CONTEXT_RELEASE_ERROR = 507007
NOT_READY_EVENT, COMPLETE_EVENT = 0, 1
BIG = 64 << 20  # a memset of this many bytes takes well over a millisecond


def _faulting_kernel(emu, res, stream, bad=99):
    """Queue a kernel whose index at position 5 addresses no row of its 6-row input (507015)."""
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    idx = np.array([0, 1, 2, 3, 4, bad], np.int32)
    xt, it, ot, _ = op_on(emu, res, x, idx, 2, 0, 0, ACL_FLOAT)
    launch(emu, res, xt, it, 2, 0, 0, ot, stream=stream, sync=False)


def _dma_fault(emu, res, stream):
    """Queue (lazy mode) a copy whose source is freed before it runs: 507013 when it runs."""
    src, dst = emu.malloc(64), res.dev(64)
    emu.ok(emu.acl.aclrtMemcpyAsync(dst, 64, src, 64, D2D, stream))
    emu.ok(emu.acl.aclrtFree(src))


def _event_status(emu, ev) -> int:
    st = emu.ffi.new("aclrtEventRecordedStatus *", 7)
    emu.ok(emu.acl.aclrtQueryEventStatus(ev, st))
    return int(st[0])


def _in_thread(fn):
    box = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join()
    return box[0]


# ============================================================================ devices, contexts

def test_the_getters_return_107002_silently_without_a_device(emu):
    acl, ffi = emu.acl, emu.ffi

    def worker():
        d, c = ffi.new("int32_t *", -5), ffi.new("aclrtContext *")
        emu.msg()
        out = [acl.aclrtGetDevice(d), emu.msg(), acl.aclrtGetCurrentContext(c), emu.msg(), d[0]]
        out += [acl.aclrtCreateStream(ffi.new("aclrtStream *")), emu.msg()]
        return out

    got = _in_thread(worker)
    assert got[:5] == [RT_CONTEXT_NULL, "", RT_CONTEXT_NULL, "", -5]  # no message, output untouched
    assert got[5] == RT_CONTEXT_NULL and "aclrtSetDevice" in got[6]  # the others say why
    assert acl.aclrtSetDevice(-1) == 107001 and acl.aclrtResetDevice(1 << 20) == 107001


# ============================================================================ streams

def test_synchronize_with_timeout_takes_minus_one_or_a_positive_timeout(emu, res):
    acl = emu.acl
    s = res.stream()
    emu.ok(acl.aclrtSynchronizeStreamWithTimeout(s, -1))
    emu.ok(acl.aclrtSynchronizeStreamWithTimeout(s, 1000))
    # 0 is the runtime's 107000 (ApiErrorDecorator::StreamSynchronize), below -1 the ACL layer's.
    assert acl.aclrtSynchronizeStreamWithTimeout(s, 0) == RT_PARAM_INVALID
    assert "timeout 0" in emu.msg()
    assert acl.aclrtSynchronizeStreamWithTimeout(s, -2) == RT_PARAM_INVALID
    # The ACL check comes before the handle's, the runtime's after it.
    gone = emu.ffi.new("aclrtStream *")
    emu.ok(acl.aclrtCreateStream(gone))
    emu.ok(acl.aclrtDestroyStream(gone[0]))
    assert acl.aclrtSynchronizeStreamWithTimeout(gone[0], -2) == RT_PARAM_INVALID
    assert acl.aclrtSynchronizeStreamWithTimeout(gone[0], 0) == RT_INVALID_HANDLE


def test_a_timeout_is_507046_and_leaves_the_fault_for_the_next_synchronize(emu, res, lazy):
    acl = emu.acl
    s = res.stream()
    big = res.dev(BIG)
    _faulting_kernel(emu, res, s)
    for _ in range(2):
        emu.ok(acl.aclrtMemsetAsync(big, BIG, 1, BIG, s))
    # The call runs the kernel and a memset itself (lazy), then finds its deadline passed.
    assert acl.aclrtSynchronizeStreamWithTimeout(s, 1) == RT_STREAM_SYNC_TIMEOUT
    assert "still queued" in emu.msg()
    assert acl.aclrtSynchronizeStream(s) == RT_AICORE_EXCEPTION  # the fault survived it
    emu.ok(acl.aclrtSynchronizeStream(s))  # reported once


def test_destroy_stream_checks_null_handle_device_in_that_order(emu, res):
    acl, ffi = emu.acl, emu.ffi
    assert acl.aclrtDestroyStream(emu.NULL) == ACL_ERROR_INVALID_PARAM  # not the default stream
    s = ffi.new("aclrtStream *")
    emu.ok(acl.aclrtCreateStream(s))
    gone = ffi.new("aclrtStream *")
    emu.ok(acl.aclrtCreateStream(gone))
    emu.ok(acl.aclrtDestroyStream(gone[0]))
    # A thread with no current device: the handle is judged first, then the device.
    assert _in_thread(lambda: acl.aclrtDestroyStream(gone[0])) == RT_INVALID_HANDLE
    assert _in_thread(lambda: acl.aclrtDestroyStream(s[0])) == RT_CONTEXT_NULL
    sst = ffi.new("aclrtStreamStatus *")
    assert _in_thread(lambda: acl.aclrtStreamQuery(s[0], sst)) == RT_CONTEXT_NULL
    emu.ok(acl.aclrtDestroyStream(s[0]))
    assert acl.aclrtDestroyStream(s[0]) == RT_INVALID_HANDLE


# ============================================================================ faults

def test_the_latest_fault_of_a_stream_wins(emu, res, lazy):
    s = res.stream()
    _dma_fault(emu, res, s)            # 507013 first
    _faulting_kernel(emu, res, s)      # then 507015: it overwrites the first
    assert emu.acl.aclrtSynchronizeStream(s) == RT_AICORE_EXCEPTION
    assert "2 tasks faulted" in emu.msg()
    emu.ok(emu.acl.aclrtSynchronizeStream(s))
    _faulting_kernel(emu, res, s)
    _dma_fault(emu, res, s)
    assert emu.acl.aclrtSynchronizeStream(s) == RT_SYS_DMA
    emu.ok(emu.acl.aclrtSynchronizeStream(s))


def test_event_synchronize_and_queries_neither_report_nor_clear_a_fault(emu, res, lazy):
    acl = emu.acl
    s, ev = res.stream(), res.event()
    _faulting_kernel(emu, res, s)
    emu.ok(acl.aclrtRecordEvent(ev, s))
    emu.ok(acl.aclrtSynchronizeEvent(ev))  # waits for the kernel, reports nothing
    assert _event_status(emu, ev) == COMPLETE_EVENT
    sst = emu.ffi.new("aclrtStreamStatus *")
    emu.ok(acl.aclrtStreamQuery(s, sst))
    emu.ok(acl.aclrtSynchronizeEvent(ev))
    assert acl.aclrtSynchronizeStream(s) == RT_AICORE_EXCEPTION
    emu.ok(acl.aclrtSynchronizeStream(s))


def test_synchronize_device_clears_every_fault_and_returns_the_first_streams(emu, res, lazy):
    acl = emu.acl
    first, second = res.stream(), res.stream()   # the order they were created
    _faulting_kernel(emu, res, second)           # 507015 on the second
    _dma_fault(emu, res, first)                  # 507013 on the first
    _faulting_kernel(emu, res, emu.NULL)         # and one on the default stream, last
    assert acl.aclrtSynchronizeDevice() == RT_SYS_DMA
    m = emu.msg()
    assert m.index("freed before the stream ran it") < m.index("expandedRowIdx[5] = 99"), m
    for s in (first, second, emu.NULL):          # every fault was consumed
        emu.ok(acl.aclrtSynchronizeStream(s))
    _faulting_kernel(emu, res, emu.NULL)
    _dma_fault(emu, res, second)
    assert acl.aclrtSynchronizeDevice() == RT_SYS_DMA  # the default stream comes last
    emu.ok(acl.aclrtSynchronizeDevice())


# ============================================================================ events

def test_an_event_never_recorded(emu, res, lazy):
    acl, ffi = emu.acl, emu.ffi
    s, never, done = res.stream(), res.event(), res.event()
    assert _event_status(emu, never) == NOT_READY_EVENT       # aclrtCreateEvent: old mode
    emu.ok(acl.aclrtSynchronizeEvent(never))                  # returns at once
    assert acl.aclrtStreamWaitEvent(s, never) == RT_PARAM_INVALID
    assert "never recorded" in emu.msg()
    emu.ok(acl.aclrtRecordEvent(done, s))
    emu.ok(acl.aclrtSynchronizeStream(s))
    ms = ffi.new("float *")
    assert acl.aclrtEventElapsedTime(ms, never, done) == RT_INTERNAL_ERROR  # RECORDER_NULL
    assert acl.aclrtEventElapsedTime(ms, done, never) == RT_INTERNAL_ERROR
    # A wait on a record that already ran, or on one of the same stream, queues nothing (lazy
    # mode: no other work of the process runs meanwhile and changes the count).
    pending = emu.stats()["pending_tasks"]
    emu.ok(acl.aclrtStreamWaitEvent(s, done))
    emu.ok(acl.aclrtStreamWaitEvent(emu.NULL, done))
    assert emu.stats()["pending_tasks"] == pending


def test_event_handles_null_and_stale(emu, res):
    acl, ffi = emu.acl, emu.ffi
    s, ev = res.stream(), res.event()
    st, ms = ffi.new("aclrtEventRecordedStatus *"), ffi.new("float *")
    null = emu.NULL
    for call in (lambda: acl.aclrtDestroyEvent(null), lambda: acl.aclrtRecordEvent(null, s),
                 lambda: acl.aclrtSynchronizeEvent(null), lambda: acl.aclrtQueryEventStatus(null, st),
                 lambda: acl.aclrtQueryEventStatus(ev, null), lambda: acl.aclrtStreamWaitEvent(s, null),
                 lambda: acl.aclrtEventElapsedTime(null, ev, ev), lambda: acl.aclrtEventElapsedTime(ms, null, ev),
                 lambda: acl.aclrtEventElapsedTime(ms, ev, null)):
        assert call() == ACL_ERROR_INVALID_PARAM
    gone = ffi.new("aclrtEvent *")
    emu.ok(acl.aclrtCreateEvent(gone))
    emu.ok(acl.aclrtDestroyEvent(gone[0]))
    g = gone[0]
    for call in (lambda: acl.aclrtDestroyEvent(g), lambda: acl.aclrtRecordEvent(g, s),
                 lambda: acl.aclrtSynchronizeEvent(g), lambda: acl.aclrtQueryEventStatus(g, st),
                 lambda: acl.aclrtStreamWaitEvent(s, g), lambda: acl.aclrtEventElapsedTime(ms, g, ev)):
        assert call() == RT_INVALID_HANDLE
    # The event's own context: synchronize, query and elapsed time need no current device.
    emu.ok(acl.aclrtRecordEvent(ev, s))
    emu.ok(acl.aclrtSynchronizeStream(s))
    assert _in_thread(lambda: acl.aclrtSynchronizeEvent(ev)) == 0
    assert _in_thread(lambda: acl.aclrtQueryEventStatus(ev, st)) == 0 and st[0] == COMPLETE_EVENT
    assert _in_thread(lambda: acl.aclrtEventElapsedTime(ms, ev, ev)) == 0 and ms[0] == 0.0
    assert _in_thread(lambda: acl.aclrtRecordEvent(ev, null)) == RT_CONTEXT_NULL


def test_elapsed_time_is_end_minus_start_even_when_negative(emu, res, lazy):
    acl = emu.acl
    s, a, b = res.stream(), res.event(), res.event()
    emu.ok(acl.aclrtRecordEvent(b, s))
    emu.ok(acl.aclrtSynchronizeStream(s))
    time.sleep(0.005)
    emu.ok(acl.aclrtRecordEvent(a, s))
    emu.ok(acl.aclrtSynchronizeStream(s))
    ms = emu.ffi.new("float *")
    emu.ok(acl.aclrtEventElapsedTime(ms, a, b))  # no order check: the end ran first
    assert ms[0] <= -4.0


# ============================================================================ memory and copies

def test_free_and_free_host(emu, res):
    acl, ffi = emu.acl, emu.ffi
    hp = ffi.new("void **")
    assert acl.aclrtFree(emu.NULL) == ACL_ERROR_INVALID_PARAM
    assert acl.aclrtFreeHost(emu.NULL) == ACL_ERROR_INVALID_PARAM
    dev = res.dev(64)
    assert acl.aclrtFreeHost(dev) == RT_PARAM_INVALID       # device memory is not host memory
    assert "device memory" in emu.msg()
    emu.ok(acl.aclrtMallocHost(hp, 33))
    host = hp[0]
    emu.ok(acl.aclrtFreeHost(host))
    assert acl.aclrtFreeHost(host) == RT_PARAM_INVALID      # freed twice
    # aclrtMallocHost needs a current device (ApiImpl::HostMalloc); the frees do not.
    assert _in_thread(lambda: acl.aclrtMallocHost(hp, 64)) == RT_CONTEXT_NULL
    p = emu.malloc(64)
    assert _in_thread(lambda: acl.aclrtFree(p)) == 0
    # Any policy value is taken (one CANN does not name is its default).
    p2 = ffi.new("void **")
    emu.ok(acl.aclrtMalloc(p2, 64, 0x7777))
    emu.ok(acl.aclrtFree(p2[0]))


def test_copy_argument_checks_in_order(emu, res):
    acl, ffi = emu.acl, emu.ffi
    dev, dev2 = res.dev(64), res.dev(64)
    host = bytearray(64)
    hb = ffi.from_buffer(host)
    s = res.stream()
    null = emu.NULL
    # The ACL layer: NULL pointers and the kind, 100000 (INNER/INTER_DEVICE_TO_DEVICE included).
    assert acl.aclrtMemcpy(null, 64, hb, 8, H2D) == ACL_ERROR_INVALID_PARAM
    assert acl.aclrtMemcpy(dev, 64, null, 8, H2D) == ACL_ERROR_INVALID_PARAM
    for kind in (6, 7, 99):
        assert acl.aclrtMemcpy(dev, 64, hb, 8, kind) == ACL_ERROR_INVALID_PARAM
        assert acl.aclrtMemcpyAsync(dev, 64, hb, 8, kind, s) == ACL_ERROR_INVALID_PARAM
    # The runtime: destMax 0 and count above destMax, 107000.
    assert acl.aclrtMemcpy(dev, 0, hb, 8, H2D) == RT_PARAM_INVALID
    assert acl.aclrtMemcpy(dev, 8, hb, 9, H2D) == RT_PARAM_INVALID
    assert acl.aclrtMemcpyAsync(dev, 8, hb, 9, H2D, s) == RT_PARAM_INVALID
    assert acl.aclrtMemsetAsync(dev, 8, 0, 9, s) == RT_PARAM_INVALID
    assert acl.aclrtMemset(dev, 8, 0, 9) == RT_PARAM_INVALID   # the driver's drvMemsetD8
    assert "exceeds maxCount" in emu.msg()
    # A stale stream is judged before the counts.
    gone = ffi.new("aclrtStream *")
    emu.ok(acl.aclrtCreateStream(gone))
    emu.ok(acl.aclrtDestroyStream(gone[0]))
    assert acl.aclrtMemcpyAsync(dev, 8, hb, 9, H2D, gone[0]) == RT_INVALID_HANDLE
    assert acl.aclrtMemsetAsync(dev, 8, 0, 9, gone[0]) == RT_INVALID_HANDLE
    # dst == src: success without a copy, even at an address that is no memory at all.
    bogus = ffi.cast("void *", 0x10)
    emu.ok(acl.aclrtMemcpy(bogus, 8, bogus, 8, 0))
    # HOST_TO_BUF_TO_DEVICE is a host-to-device copy.
    host[:8] = b"abcdefgh"
    emu.ok(acl.aclrtMemcpy(dev2, 64, hb, 8, 5))
    assert emu.d2h(dev2, 8) == b"abcdefgh"
    # Without a current device: 107002 after the argument checks.
    assert _in_thread(lambda: acl.aclrtMemcpy(dev, 64, hb, 8, H2D)) == RT_CONTEXT_NULL
    assert _in_thread(lambda: acl.aclrtMemcpy(dev, 8, hb, 9, H2D)) == RT_PARAM_INVALID
    assert _in_thread(lambda: acl.aclrtMemset(dev, 64, 0, 8)) == RT_CONTEXT_NULL
    assert _in_thread(lambda: acl.aclrtMemcpy(hb, 64, dev, 8, D2H)) == RT_CONTEXT_NULL


def test_get_mem_info_refuses_an_unknown_attribute_with_107016(emu):
    f, t = emu.ffi.new("size_t *"), emu.ffi.new("size_t *")
    assert emu.acl.aclrtGetMemInfo(1, emu.NULL, t) == ACL_ERROR_INVALID_PARAM
    for attr in (18, 1000):
        assert emu.acl.aclrtGetMemInfo(attr, f, t) == RT_INVALID_MEMORY_TYPE
    emu.ok(emu.acl.aclrtGetMemInfo(17, f, t))  # ACL_MEM_P2P_HUGE1G, from 9.0's headers
    assert t[0] > 0


# ============================================================================ release profiles

PROFILES = ("8.1.RC1", "8.5.0", "9.0.0", "9.1.0")

# What each profile's child runs: every scenario stores its statuses in R, printed as JSON at
# the end.
def child_every_scenario() -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    R = {"release": int(acl.aclemuRelease())}
    R["fin_no_init"] = acl.aclFinalize()
    R["init"] = acl.aclInit(ffi.NULL)
    R["fin"] = acl.aclFinalize()
    R["reinit"] = acl.aclInit(ffi.NULL)
    R["reinit_msg"] = emu.msg()
    R["set"] = acl.aclrtSetDevice(0)
    dev = try_malloc(emu, 64)[1]
    host = bytearray(64)
    hb = ffi.from_buffer(host)
    s = ffi.new("aclrtStream *")
    assert acl.aclrtCreateStream(s) == 0
    R["copy0"] = acl.aclrtMemcpy(dev, 64, hb, 0, 1)
    R["copy0_null"] = acl.aclrtMemcpy(ffi.NULL, 64, hb, 0, 1)
    R["copy0_bad_kind"] = acl.aclrtMemcpy(dev, 64, hb, 0, 6)
    R["copy0_async"] = acl.aclrtMemcpyAsync(dev, 64, hb, 0, 1, s[0])
    R["set0"] = acl.aclrtMemset(dev, 64, 0, 0)
    R["set0_null"] = acl.aclrtMemset(ffi.NULL, 64, 0, 0)
    R["set0_async"] = acl.aclrtMemsetAsync(dev, 64, 0, 0, s[0])
    R["sync"] = acl.aclrtSynchronizeStream(s[0])
    f, t = ffi.new("size_t *"), ffi.new("size_t *")
    R["meminfo12"] = acl.aclrtGetMemInfo(12, f, t)
    R["meminfo11"] = acl.aclrtGetMemInfo(11, f, t)
    ctx = ffi.new("aclrtContext *")
    assert acl.aclrtGetCurrentContext(ctx) == 0
    R["reset"] = acl.aclrtResetDevice(0)
    R["reset_again"] = acl.aclrtResetDevice(0)
    R["reset_bad_id"] = acl.aclrtResetDevice(5)
    R["set_dead_ctx"] = acl.aclrtSetCurrentContext(ctx[0])
    d = ffi.new("int32_t *")
    R["getdev_dead_ctx"] = acl.aclrtGetDevice(d)
    print(json.dumps(R))


def _run_profiles() -> dict[str, dict]:
    # One child per profile, side by side.
    procs = {release: start_isolated(child_every_scenario, env={"PYACL_MOE_EMU_RELEASE": release})
             for release in PROFILES}
    out = {}
    for release, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{release}: {stderr}"
        out[release] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def profiles(tmp_path_factory) -> dict[str, dict]:
    """Every scenario's answers on each profile: the first worker to get here runs them, the
    others wait for its file (in the folder all workers of a session share)."""
    _needs_emulator()
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    answers = shared / "emulator_runtime_profiles.json"
    with open(shared / "emulator_runtime_profiles.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if answers.is_file():
            out = json.loads(answers.read_text())
        else:
            out = _run_profiles()
            answers.write_text(json.dumps(out))
    assert [out[p]["release"] for p in PROFILES] == [80100, 80500, 90000, 90100]
    return out


def test_aclinit_after_aclfinalize_is_allowed_from_8_5(profiles):
    for name, r in profiles.items():
        assert r["fin_no_init"] == 0 and r["init"] == 0 and r["fin"] == 0, (name, r)
        if r["release"] < 80500:  # acl.h of 8.1.RC1: aclInit once per process
            assert r["reinit"] == 100002 and "only once per process" in r["reinit_msg"], (name, r)
        else:                     # acl.cpp of v8.5.0 and later initializes again
            assert r["reinit"] == 0, (name, r)
        assert r["set"] == 0  # either way the runtime works (nothing checks aclInit)


def test_an_empty_copy_is_success_from_9_1_and_107000_before(profiles):
    for name, r in profiles.items():
        if r["release"] >= 90100:  # commit 93f9f113d: count 0 returns before any other check
            want = {"copy0": 0, "copy0_null": 0, "copy0_bad_kind": 0, "copy0_async": 0, "set0": 0,
                    "set0_null": 0, "set0_async": 0}
        else:                      # the runtime's ZERO_RETURN, after the ACL layer's checks
            want = {"copy0": RT_PARAM_INVALID, "copy0_null": ACL_ERROR_INVALID_PARAM,
                    "copy0_bad_kind": ACL_ERROR_INVALID_PARAM, "copy0_async": RT_PARAM_INVALID,
                    "set0": RT_PARAM_INVALID, "set0_null": ACL_ERROR_INVALID_PARAM,
                    "set0_async": RT_PARAM_INVALID}
        assert {k: r[k] for k in want} == want, name
        assert r["sync"] == 0


def test_get_mem_info_takes_the_attributes_of_each_release(profiles):
    for name, r in profiles.items():
        assert r["meminfo11"] == 0, name
        assert r["meminfo12"] == (0 if r["release"] >= 90000 else RT_INVALID_MEMORY_TYPE), name


def test_a_dead_context_is_refused_from_9_0(profiles):
    # ApiErrorDecorator::ContextSetCurrent checks the live set from v9.0.0; v8.5.0 makes the
    # pointer current, and the next call that needs a context finds none.
    for name, r in profiles.items():
        assert r["set_dead_ctx"] == (RT_PARAM_INVALID if r["release"] >= 90000 else 0), name
        assert r["getdev_dead_ctx"] == RT_CONTEXT_NULL, name


def test_resetting_more_than_setting_is_507007_on_every_profile(profiles):
    for name, r in profiles.items():
        assert (r["reset"], r["reset_again"], r["reset_bad_id"]) == (0, RT_CONTEXT_RELEASE_ERROR, 107001), name
