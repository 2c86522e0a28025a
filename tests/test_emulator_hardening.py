"""The emulator under hostile use: concurrent writes to what a kernel reads, addresses that are
not device memory, deep chains of stream waits, devices set and reset from racing threads, calls
with no device (no aclInit either), repeated device faults, and a malformed environment.

Each test names the misuse it survives. Tests that could take the interpreter down with them
(a segfault, a stack overflow) run in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

import pyacl_moe as pm

from . import children
from .conftest import run_isolated
from .emu_raw import Emu
from .test_emulator import (  # noqa: F401  (res is a fixture)
    ACL_BF16,
    ACL_ERROR_INVALID_PARAM,
    ACL_FLOAT,
    ACL_FLOAT16,
    ACL_INT32,
    NP_DTYPE,
    RT_AICORE_EXCEPTION,
    RT_CONTEXT_NULL,
    RT_PARAM_INVALID,
    launch,
    op_on,
    res,
)


def run_raw(isolated, child, *args, env=None, timeout: float = 120) -> dict:
    """Run ``child(*args)`` in a fresh interpreter; it prints one JSON object last."""
    proc = isolated(child, *args, env=env, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ============================================================================ indices read once

def child_index_written_while_the_kernel_runs() -> None:
    emu = Emu()
    acl, op, ffi = emu.acl, emu.op, emu.ffi
    n, k, h = 64, 8, 8192
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n * k, h)).astype(np.float32)
    idx = rng.permutation(n * k).astype(np.int32)
    acl.aclInit(ffi.NULL)
    emu.ok(acl.aclrtSetDevice(0))
    xp, ip, op_ = emu.malloc(x.nbytes), emu.malloc(idx.nbytes), emu.malloc(n * h * 4)
    emu.h2d(xp, x.tobytes())
    xt = emu.tensor(x.shape, 0, xp)
    it = emu.tensor(idx.shape, 3, ip)
    ot = emu.tensor((n, h), 0, op_)
    ws = emu.malloc(16 << 20)
    s = ffi.new("aclrtStream *")
    emu.ok(acl.aclrtCreateStream(s))
    bad = np.array([0x7FFFFF00], np.int32).tobytes()
    last = ffi.cast("char *", ip) + (n * k - 1) * 4
    want = x[idx.reshape(n, k)].sum(axis=1, dtype=np.float32)
    seen = {0: 0, 507015: 0}
    for i in range(40):
        emu.h2d(ip, idx.tobytes())
        wsz, ex = ffi.new("uint64_t *"), ffi.new("aclOpExecutor **")
        emu.ok(op.aclnnMoeInitRoutingV2GradGetWorkspaceSize(xt, it, k, 0, 0, ot, wsz, ex))
        emu.ok(op.aclnnMoeInitRoutingV2Grad(ws, wsz[0], ex[0], s[0]))
        time.sleep(0.0005 * (i % 8))
        emu.h2d(last, bad)
        st = acl.aclrtSynchronizeStream(s[0])
        emu.msg()
        seen[st] = seen.get(st, 0) + 1
        if st == 0:
            got = np.frombuffer(emu.d2h(op_, n * h * 4), np.float32).reshape(n, h)
            assert np.allclose(got, want, rtol=1e-4, atol=1e-3)
    print(json.dumps({str(a): b for a, b in seen.items()}))


def test_index_written_while_the_kernel_runs_is_a_fault_or_ignored_never_a_crash(isolated):
    # The kernel checks the indices before computing; a synchronous copy (which waits for no
    # stream) overwrites the last token's index with one far outside gradExpandedX while the
    # kernel runs. Checked and used from one snapshot, each launch either faults (507015, the
    # write came first) or computes with the old index; re-read from device memory after the
    # check, the bad index reaches the row arithmetic and the process dies.
    r = run_raw(isolated, child_index_written_while_the_kernel_runs, env={"PYACL_MOE_EMU_THREADS": "1"})
    assert set(r) <= {"0", str(RT_AICORE_EXCEPTION)}, r
    assert sum(r.values()) == 40


# ============================================================================ addresses

def child_memset_and_copies_of_addresses_that_are_not_memory() -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    acl.aclInit(ffi.NULL)
    emu.ok(acl.aclrtSetDevice(0))
    dev = emu.malloc(256)
    hp = ffi.new("void **")
    emu.ok(acl.aclrtMallocHost(hp, 256))
    bogus = ffi.cast("void *", 0x1000)
    plain = ffi.new("char[256]")  # host memory, but not from aclrtMallocHost
    s = ffi.new("aclrtStream *")
    emu.ok(acl.aclrtCreateStream(s))
    calls = {
        "memset": lambda: acl.aclrtMemset(bogus, 64, 0, 64),
        "memset_plain_host": lambda: acl.aclrtMemset(plain, 64, 0, 64),
        "memset_async": lambda: acl.aclrtMemsetAsync(bogus, 64, 0, 64, s[0]),
        "d2h": lambda: acl.aclrtMemcpy(bogus, 64, dev, 64, 2),
        "h2d": lambda: acl.aclrtMemcpy(dev, 64, bogus, 64, 1),
        "h2h": lambda: acl.aclrtMemcpy(plain, 64, bogus, 64, 0),
        "default": lambda: acl.aclrtMemcpy(bogus, 64, dev, 64, 4),
        "d2h_async": lambda: acl.aclrtMemcpyAsync(bogus, 64, dev, 64, 2, s[0]),
        "h2d_async": lambda: acl.aclrtMemcpyAsync(dev, 64, bogus, 64, 1, s[0]),
    }
    out = {}
    for name, call in calls.items():
        st = call()
        out[name] = [st, emu.msg()]
    out["memset_host_block"] = acl.aclrtMemset(hp[0], 256, 7, 256)
    out["memset_device"] = acl.aclrtMemset(dev, 256, 7, 256)
    out["h2d_plain"] = acl.aclrtMemcpy(dev, 256, plain, 256, 1)
    out["sync"] = acl.aclrtSynchronizeStream(s[0])
    emu.ok(acl.aclrtDestroyStream(s[0]))
    emu.ok(acl.aclrtFreeHost(hp[0]))
    emu.ok(acl.aclrtFree(dev))
    print(json.dumps(out))


def test_memset_and_copies_refuse_addresses_that_are_not_memory(isolated):
    # A made-up address (here a small integer, never mapped) used to be memset or copied as
    # host memory and crashed the process. Every such call now returns 107000 with a message
    # naming the argument; memory of the right kind still works.
    r = run_raw(isolated, child_memset_and_copies_of_addresses_that_are_not_memory)
    for name in ("memset", "memset_plain_host", "memset_async", "d2h", "h2d", "h2h", "default",
                 "d2h_async", "h2d_async"):
        st, msg = r[name]
        assert st == RT_PARAM_INVALID, (name, r[name])
        assert "0x1000" in msg or "devPtr" in msg, (name, msg)
    assert "aclrtMallocHost" in r["memset_plain_host"][1]
    assert "neither device memory nor mapped host memory" in r["h2d"][1]
    assert r["memset_host_block"] == 0 and r["memset_device"] == 0 and r["h2d_plain"] == 0
    assert r["sync"] == 0


# ============================================================================ chains of waits

def child_a_chain_of_8000_stream_waits(mode: str) -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    n = 8000
    acl.aclInit(ffi.NULL)
    emu.ok(acl.aclrtSetDevice(0))
    assert acl.aclemuSetStreamMode(b"lazy") == 0
    buf = emu.malloc(1 << 20)
    streams, events = [], []
    for _ in range(n):
        s, e = ffi.new("aclrtStream *"), ffi.new("aclrtEvent *")
        emu.ok(acl.aclrtCreateStream(s))
        emu.ok(acl.aclrtCreateEvent(e))
        streams.append(s[0])
        events.append(e[0])
    for _ in range(70):  # more than the engine takes in one batch: the chain's origin is slow
        emu.ok(acl.aclrtMemsetAsync(buf, 1 << 20, 3, 1 << 20, streams[-1]))
    emu.ok(acl.aclrtMemsetAsync(buf, 1 << 20, 1, 1 << 20, streams[-1]))
    for i in reversed(range(n)):
        if i < n - 1:
            emu.ok(acl.aclrtStreamWaitEvent(streams[i], events[i + 1]))
        emu.ok(acl.aclrtRecordEvent(events[i], streams[i]))
    emu.ok(acl.aclrtMemsetAsync(buf, 1 << 20, 2, 4, streams[0]))
    assert acl.aclemuSetStreamMode(mode.encode()) == 0
    if mode == "async":
        q = ffi.new("aclrtStreamStatus *")
        while True:
            emu.ok(acl.aclrtStreamQuery(streams[0], q))
            if q[0] == 0:  # ACL_STREAM_STATUS_COMPLETE
                break
    st = acl.aclrtSynchronizeStream(streams[0])
    head = emu.d2h(buf, 8)
    for s in streams:
        emu.ok(acl.aclrtDestroyStream(s))
    for e in events:
        emu.ok(acl.aclrtDestroyEvent(e))
    emu.ok(acl.aclrtFree(buf))
    print(json.dumps({"sync": st, "head": list(head), "pending": emu.stats()["pending_tasks"]}))


@pytest.mark.parametrize("mode", ["async", pytest.param("lazy", marks=pytest.mark.slow)])  # lazy: slow step
def test_a_chain_of_8000_stream_waits_resolves_without_recursion(isolated, mode):
    # Stream i waits for an event recorded on stream i+1, 8,000 deep, all queued in lazy mode
    # so nothing has run. Lazy: stream 0, the far end of the chain, is synchronized; resolved by
    # recursion, each link costs C stack and the thread overflows its stack. Async: the engine
    # is handed every stream and runs the chain alone (the test only polls), meeting blocked
    # streams first. Either way the chain must run in order: the last memset after the first.
    r = run_raw(isolated, child_a_chain_of_8000_stream_waits, mode)
    assert r == {"sync": 0, "head": [2, 2, 2, 2, 1, 1, 1, 1], "pending": 0}


# ============================================================================ set and reset racing

def child_set_device_racing_the_last_reset() -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    acl.aclInit(ffi.NULL)
    errors, lock = [], threading.Lock()

    def worker(rounds):
        p = ffi.new("void **")
        for i in range(rounds):
            calls = []
            calls.append(("set", acl.aclrtSetDevice(0)))
            calls.append(("malloc", acl.aclrtMalloc(p, 1 << 22, 0)))
            for _ in range(3):
                calls.append(("memset", acl.aclrtMemsetAsync(p[0], 1 << 22, i & 0xFF, 1 << 22, ffi.NULL)))
            if i % 2:
                calls.append(("sync", acl.aclrtSynchronizeStream(ffi.NULL)))
                calls.append(("free", acl.aclrtFree(p[0])))
            calls.append(("reset", acl.aclrtResetDevice(0)))
            bad = [(name, st) for name, st in calls if st]
            if bad:
                with lock:
                    errors.append((i, bad, emu.msg()))
                return

    threads = [threading.Thread(target=worker, args=(60,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = emu.stats()
    print(json.dumps({"errors": errors[:5], "devices_set": s["devices_set"],
                      "streams": s["streams"], "allocations": s["device_allocations"]}))


def test_set_device_racing_the_last_reset_keeps_its_context_and_stream(isolated):
    # Two threads set and reset device 0 over and over, each queueing work on the default
    # stream in between, so the last reset often drains work with the lock released. An
    # aclrtSetDevice arriving then must wait for the release to finish and open the device
    # anew: before, it reopened it at once and the finishing teardown freed the new context and
    # default stream under it (its next calls: 107002, or a use after free).
    r = run_raw(isolated, child_set_device_racing_the_last_reset)
    assert r == {"errors": [], "devices_set": 0, "streams": 0, "allocations": 0}


# ============================================================================ no device

def child_memory_and_stream_calls_without_a_device() -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    p = ffi.new("void **", ffi.cast("void *", 0x5A5A))
    f, t = ffi.new("size_t *", 7), ffi.new("size_t *", 7)
    host = bytearray(64)
    hb = ffi.from_buffer(host)
    s, e = ffi.new("aclrtStream *"), ffi.new("aclrtEvent *")
    out = {
        "malloc": [acl.aclrtMalloc(p, 64, 0), emu.msg()],
        "malloc_host": [acl.aclrtMallocHost(p, 64), emu.msg()],
        "mem_info": [acl.aclrtGetMemInfo(1, f, t), emu.msg()],
        "memcpy": [acl.aclrtMemcpy(hb, 64, hb, 64, 0), emu.msg()],
        "memcpy_async": [acl.aclrtMemcpyAsync(hb, 64, hb, 64, 0, ffi.NULL), emu.msg()],
        "memset_async": [acl.aclrtMemsetAsync(hb, 64, 0, 64, ffi.NULL), emu.msg()],
        "create_stream": [acl.aclrtCreateStream(s), emu.msg()],
        "create_event": [acl.aclrtCreateEvent(e), emu.msg()],
        "sync_stream": [acl.aclrtSynchronizeStream(ffi.NULL), emu.msg()],
    }
    out["untouched"] = [int(ffi.cast("uintptr_t", p[0])), f[0], t[0]]
    out["stats"] = {k: v for k, v in emu.stats().items() if k in ("device_allocations", "host_allocations",
                                                                 "mallocs_total", "streams", "events")}
    print(json.dumps(out))


def test_memory_and_stream_calls_without_a_device_touch_nothing(isolated):
    # No aclInit and no device: nothing checks aclInit, and each call that needs a device
    # returns 107002 with a message naming aclrtSetDevice, leaves its output untouched and
    # allocates nothing (the sanitizer step of CI runs this too, which would report a read of
    # device state through an unset index). A synchronous copy onto itself is success before
    # the device is looked at (ApiErrorDecorator::MemCopySync: dst == src).
    r = run_raw(isolated, child_memory_and_stream_calls_without_a_device)
    assert r["memcpy"] == [0, ""]
    for name in ("malloc", "malloc_host", "mem_info", "memcpy_async", "memset_async",
                 "create_stream", "create_event", "sync_stream"):
        st, msg = r[name]
        assert st == RT_CONTEXT_NULL and "aclrtSetDevice" in msg, (name, r[name])
    assert r["untouched"] == [0x5A5A, 7, 7]
    assert set(r["stats"].values()) == {0}, r["stats"]


# ============================================================================ every fault reported

# ============================================================================ unaligned addresses

@pytest.mark.parametrize("dtype", [ACL_FLOAT, ACL_FLOAT16, ACL_BF16], ids=["fp32", "fp16", "bf16"])
def test_addresses_not_aligned_to_the_element_size_give_exact_results(emu, res, dtype):
    # nnopbase passes the kernel any address it is given. Rows of gradExpandedX were read through
    # float/uint16_t pointers and half-precision outputs stored through uint16_t pointers: at
    # an address not aligned to the element size, undefined behaviour (UBSan reports it).
    np_dt = NP_DTYPE[dtype]
    x = (np.arange(24, dtype=np.float32).reshape(8, 3) / 4).astype(np_dt)  # sums are exact
    idx = np.random.default_rng(3).permutation(8).astype(np.int32)
    want = x.astype(np.float32)[idx].reshape(4, 2, 3).sum(axis=1)

    def at(nbytes, by):
        """An address `by` bytes into a fresh block."""
        return emu.ffi.cast("char *", res.dev(nbytes)) + by

    for x_by, idx_by, out_by in [(1, 3, 1), (3, 1, 2), (2, 2, 3)]:
        xp, ip, op_ = at(x.nbytes + 8, x_by), at(40, idx_by), at(64, out_by)
        emu.h2d(xp, x.tobytes())
        emu.h2d(ip, idx.tobytes())
        xt, it, ot = res.tensor((8, 3), dtype, xp), res.tensor((8,), ACL_INT32, ip), res.tensor((4, 3), dtype, op_)
        launch(emu, res, xt, it, 2, 0, 0, ot)
        got = np.frombuffer(emu.d2h(op_, 12 * x.itemsize), np_dt).reshape(4, 3)
        np.testing.assert_array_equal(got.astype(np.float32), want)


def _faulting_kernel(emu, res, bad, stream):
    """Queue a kernel whose index at position 5 addresses no row of its 6-row input."""
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    idx = np.array([0, 1, 2, 3, 4, bad], np.int32)
    xt, it, ot, _ = op_on(emu, res, x, idx, 2, 0, 0, ACL_FLOAT)
    launch(emu, res, xt, it, 2, 0, 0, ot, stream=stream, sync=False)


@pytest.mark.parametrize("stream_mode", ["lazy", "async"])
def test_the_latest_fault_is_reported_once_by_a_synchronize(emu, res, stream_mode):
    # CANN stores a failed task's code on its stream, a later one overwriting an earlier one
    # (Stream::SetErrCode); the next synchronize of the stream reports it and clears it.
    previous = emu.ffi.string(emu.acl.aclemuGetStreamMode())
    assert emu.acl.aclemuSetStreamMode(stream_mode.encode()) == 0
    try:
        s = res.stream()
        faults = emu.stats()["device_faults"]
        _faulting_kernel(emu, res, 99, s)
        _faulting_kernel(emu, res, 77, s)
        q = emu.ffi.new("aclrtStreamStatus *")
        emu.ok(emu.acl.aclrtStreamQuery(s, q))  # a query observes nothing
        assert emu.acl.aclrtSynchronizeStream(s) == RT_AICORE_EXCEPTION
        m = emu.msg()
        assert "2 tasks faulted" in m and "expandedRowIdx[5] = 77" in m, m
        assert "= 99" not in m  # the latest overwrote it
        assert emu.stats()["device_faults"] == faults + 2
        emu.ok(emu.acl.aclrtSynchronizeStream(s))  # reported once
        # A later fault is reported by the next synchronize, even of the whole device, which
        # synchronizes every stream and reports each one's fault, the first stream's status.
        _faulting_kernel(emu, res, 55, s)
        _faulting_kernel(emu, res, 44, emu.NULL)
        assert emu.acl.aclrtSynchronizeDevice() == RT_AICORE_EXCEPTION
        m = emu.msg()
        assert "expandedRowIdx[5] = 55" in m and "expandedRowIdx[5] = 44" in m, m
        assert m.index("= 55") < m.index("= 44")  # created streams first, the default one last
        emu.ok(emu.acl.aclrtSynchronizeStream(s))
        emu.ok(emu.acl.aclrtSynchronizeStream(emu.NULL))
    finally:
        assert emu.acl.aclemuSetStreamMode(previous) == 0


# ============================================================================ the environment

# (variable, value, accepted): what the emulated libascendcl and the Python check both decide.
ENV_CASES = [
    ("PYACL_MOE_EMU_MEMORY", "-1", False),
    ("PYACL_MOE_EMU_MEMORY", "garbage", False),
    ("PYACL_MOE_EMU_MEMORY", "1e30", False),
    ("PYACL_MOE_EMU_MEMORY", "nan", False),
    ("PYACL_MOE_EMU_MEMORY", "2T", False),
    ("PYACL_MOE_EMU_MEMORY", "8GB", False),
    ("PYACL_MOE_EMU_MEMORY", "1.5M", True),
    ("PYACL_MOE_EMU_MEMORY", "4096", True),
    ("PYACL_MOE_EMU_DEVICES", "abc", False),
    ("PYACL_MOE_EMU_DEVICES", "1000", False),
    ("PYACL_MOE_EMU_DEVICES", " 2", False),
    ("PYACL_MOE_EMU_DEVICES", "0", True),
    ("PYACL_MOE_EMU_MUTATION", "garbage", False),
    ("PYACL_MOE_EMU_MUTATION", "none", True),
    ("PYACL_MOE_EMU_STREAMS", "sync", False),
    ("PYACL_MOE_EMU_STREAMS", "lazy", True),
    ("PYACL_MOE_EMU_QUEUE_DEPTH", "0", False),
    ("PYACL_MOE_EMU_QUEUE_DEPTH", "16777217", False),
    ("PYACL_MOE_EMU_THREADS", "four", False),
    ("PYACL_MOE_EMU_THREADS", "0", False),
    ("PYACL_MOE_EMU_THREADS", "64", True),
    ("PYACL_MOE_EMU_SOC", "Ascend 910", False),
    ("PYACL_MOE_EMU_SOC", "Ascend910B4", True),
    ("PYACL_MOE_EMU_SOC", "Ascend950PR_9599", True),  # (the default release, 9.0.0, models the 950)
    ("PYACL_MOE_EMU_SOC", "Ascend310P3", False),  # a SoC of no family the op is built for
    ("PYACL_MOE_EMU_SOC", "Ascend950", False),  # a family, not a SoC
]

def _c_config(name: str, value: str) -> dict:
    """What the C library alone (children.child_c_config) says of ``name=value``, no other
    PYACL_MOE_EMU_* variable set."""
    from pyacl_moe import emulator

    env = {k: None for k in os.environ if k.startswith("PYACL_MOE_EMU_")}
    env[name] = value
    proc = run_isolated(children.child_c_config, emulator.build(), env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(("name", "value", "accepted"), ENV_CASES, ids=[f"{n[14:]}={v}" for n, v, _ in ENV_CASES])
def test_malformed_environment_fails_aclinit_with_a_message_naming_the_variable(name, value, accepted):
    r = _c_config(name, value)
    if accepted:
        assert r["count"] == 0 and r["init"] == 0, r
        return
    # A raw C user: aclInit fails with ACL_ERROR_INVALID_PARAM, and so does every call that reads
    # the configuration, each saying which variable and what it accepts.
    assert r["init"] == ACL_ERROR_INVALID_PARAM, r
    assert name in r["msg"] and f'"{value}"' in r["msg"] and "use " in r["msg"], r["msg"]
    assert r["count"] == ACL_ERROR_INVALID_PARAM
    assert r["set"] == ACL_ERROR_INVALID_PARAM and name in r["set_msg"]


@pytest.mark.parametrize(("name", "value", "accepted"), ENV_CASES, ids=[f"{n[14:]}={v}" for n, v, _ in ENV_CASES])
def test_python_checks_the_environment_as_the_library_does(name, value, accepted):
    from pyacl_moe.emulator import EmulatorConfigError, check_environment

    if accepted:
        check_environment({name: value})
        return
    with pytest.raises(EmulatorConfigError, match=name) as info:
        check_environment({name: value})
    assert repr(value) in str(info.value) and "use " in str(info.value)


def test_selecting_or_building_the_emulator_with_a_malformed_variable_raises_first(monkeypatch):
    # A Python user learns it before any library is loaded or built, from use_emulator() (or
    # the build the loader asks for), with the same message.
    from pyacl_moe import emulator

    monkeypatch.setenv("PYACL_MOE_EMU_MEMORY", "lots")
    with pytest.raises(emulator.EmulatorConfigError, match="PYACL_MOE_EMU_MEMORY='lots' is malformed"):
        emulator.use_emulator()
    with pytest.raises(emulator.EmulatorBuildError, match="PYACL_MOE_EMU_MEMORY"):
        emulator.build()
    monkeypatch.delenv("PYACL_MOE_EMU_MEMORY")
    monkeypatch.setenv("PYACL_MOE_EMU_MEMROY", "8G")  # a typo is not ignored silently
    with pytest.warns(UserWarning, match="PYACL_MOE_EMU_MEMROY"):
        emulator.check_environment()


def child_a_kernel_reading_another_devices_memory() -> None:
    pm.use_emulator()
    d0, d1 = pm.Device(0), pm.Device(1)
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    ids = pm.routing.random_top_k(8, 2, 4, seed=0)
    elsewhere = pm.to_device(x + 100, stream=d0.default_stream)
    d0.synchronize()
    plans = (lambda s1: pm.MoeInitRoutingV2(pm.to_device(x, stream=s1), pm.to_device(ids, stream=s1)),
             lambda s1: pm.MoeInitRoutingV2Grad(pm.to_device(np.ones((16, 4), np.float32), stream=s1),
                                                pm.to_device(np.arange(16, dtype=np.int32), stream=s1), 2))
    for make in plans:
        s1 = d1.default_stream
        plan = make(s1)
        d1.synchronize()  # the inputs are written: a fault later is no fault of their copies
        ex = plan.executor
        ex.set_input_addr(0, ex.tensors[0], elsewhere.address)
        plan(s1)
        try:
            d1.synchronize()
            print("no fault")
        except pm.AclRuntimeError as e:
            print(e.status, "memory of device 0" in str(e))
        plan.close()
        d1.reset()  # the fault is the device's until then
    print(pm.emulator.stats()["device_faults"])


def test_a_kernel_reading_another_devices_memory_is_a_device_fault(isolated):
    """Each device's AI Cores reach their own memory only: an executor pointed (by a raw address
    setter) at memory of device 0 and launched on device 1 faults, for both ops, and the
    message names the device the memory belongs to."""
    r = isolated(child_a_kernel_reading_another_devices_memory, env={"PYACL_MOE_EMU_DEVICES": "2"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["507015", "True", "507015", "True", "2"], r.stdout
