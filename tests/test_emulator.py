"""Direct tests of the bundled CANN emulator, through its C ABI.

These tests drive libascendcl.so, libnnopbase.so and libopapi.so with a cffi FFI declared from
headers/ (conftest's ``emu`` fixture), never through the pyacl_moe binding, so that a bug in the
binding cannot hide a bug in the emulator or the other way round. The statuses asserted are the
ones the op contract (CANN 8.x) names; every test releases what it creates, because the fixture
fails a test that leaves a live object behind.

Process-wide state (a process that never called aclInit, finalize twice, variables read at load)
is tested in a fresh interpreter via ``isolated``. The runtime's rules API by API, and where the
release profiles differ, are in test_emulator_runtime.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import zlib

import ml_dtypes
import numpy as np
import pytest

from pyacl_moe import emulator as emulator_mod

from .conftest import LIVE, default_capacity
from .emu_raw import Emu

# ---------------------------------------------------------------------------- constants

# aclDataType / aclFormat / memcpy kinds, as headers/acl_base.h and acl_rt.h define them.
ACL_FLOAT, ACL_FLOAT16, ACL_INT32, ACL_INT64, ACL_DOUBLE, ACL_BF16 = 0, 1, 3, 9, 11, 27
ACL_FORMAT_NCHW, ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ = 0, 2, 29
H2D, D2H, D2D = 1, 2, 3
ACL_HBM_MEM = 1

# Status codes (acl_base.h for the runtime ones; emu.h mirrors CANN's aclnn ones).
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_REPEAT_FINALIZE = 100037
RT_PARAM_INVALID = 107000
RT_INVALID_DEVICEID = 107001
RT_CONTEXT_NULL = 107002
RT_EVENT_TIMESTAMP_INVALID = 107006
RT_INVALID_HANDLE = 107017
RT_MEMORY_ALLOCATION = 207001
RT_INTERNAL_ERROR = 507000
RT_CONTEXT_RELEASE_ERROR = 507007
RT_STREAM_SYNC_TIMEOUT = 507046
RT_AICORE_EXCEPTION = 507015
RT_DEVICE_MEM_ERROR = 507053
ACLNN_ERR_PARAM_NULLPTR = 161001
ACLNN_ERR_PARAM_INVALID = 161002
ACLNN_ERR_RUNTIME_ERROR = 361001
ACLNN_ERR_INNER = 561000
ACLNN_ERR_INNER_TILING_ERROR = 561002

WORKSPACE = 16 * 1024 * 1024  # the vendor's fixed tiling workspace

NP_DTYPE = {ACL_FLOAT: np.dtype(np.float32), ACL_FLOAT16: np.dtype(np.float16),
            ACL_BF16: np.dtype(ml_dtypes.bfloat16)}
DTYPE_IDS = {ACL_FLOAT: "fp32", ACL_FLOAT16: "fp16", ACL_BF16: "bf16"}


# ---------------------------------------------------------------------------- helpers

class Res:
    """Objects a test creates, released in reverse order at teardown (before ``emu`` checks
    for leaks). Tests that check a counter going down release explicitly instead."""

    def __init__(self, emu) -> None:
        self.emu = emu
        self._undo: list[tuple[str, object]] = []
        self._ws = None

    # device memory
    def dev(self, data) -> object:
        """A device block: ``data`` is a byte count, or an array copied in."""
        if isinstance(data, int):
            p = self.emu.malloc(data)
        else:
            raw = np.ascontiguousarray(data).tobytes()
            p = self.emu.malloc(max(len(raw), 1))
            if raw:
                self.emu.h2d(p, raw)
        self._undo.append(("mem", p))
        return p

    def read(self, p, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        return np.frombuffer(self.emu.d2h(p, n), dtype=dtype).reshape(shape).copy()

    def workspace(self):
        if self._ws is None:
            self._ws = self.dev(WORKSPACE)
        return self._ws

    # handles
    def tensor(self, shape, dtype, p, **kw):
        t = self.emu.tensor(shape, dtype, p, **kw)
        self._undo.append(("tensor", t))
        return t

    def stream(self):
        s = self.emu.ffi.new("aclrtStream *")
        self.emu.ok(self.emu.acl.aclrtCreateStream(s))
        self._undo.append(("stream", s[0]))
        return s[0]

    def event(self):
        e = self.emu.ffi.new("aclrtEvent *")
        self.emu.ok(self.emu.acl.aclrtCreateEvent(e))
        self._undo.append(("event", e[0]))
        return e[0]

    def close(self) -> None:
        emu = self.emu
        # Let queued work finish before its memory goes (an async task on freed memory would be
        # a device fault that the fixture's final synchronize reports).
        emu.acl.aclrtSynchronizeDevice()
        emu.msg()
        for kind, h in reversed(self._undo):
            if kind == "mem":
                emu.acl.aclrtFree(h)
            elif kind == "tensor":
                emu.nn.aclDestroyTensor(h)
            elif kind == "stream":
                emu.acl.aclrtDestroyStream(h)
            elif kind == "event":
                emu.acl.aclrtDestroyEvent(h)
        self._undo.clear()
        emu.msg()


@pytest.fixture
def res(emu):
    r = Res(emu)
    yield r
    r.close()


@pytest.fixture
def lazy(emu):
    """Lazy streams for the test (work runs only when something waits for it), so that it can
    see queued-but-not-run work deterministically; the previous mode (async by default) again
    afterwards."""
    previous = emu.ffi.string(emu.acl.aclemuGetStreamMode())
    assert emu.acl.aclemuSetStreamMode(b"lazy") == 0
    try:
        yield emu
    finally:
        assert emu.acl.aclemuSetStreamMode(previous) == 0


def phase1(emu, x, idx, k, mode, active, out):
    """First phase: (status, workspace size, executor)."""
    ws = emu.ffi.new("uint64_t *")
    ex = emu.ffi.new("aclOpExecutor **")
    st = emu.op.aclnnMoeInitRoutingV2GradGetWorkspaceSize(x, idx, k, mode, active, out, ws, ex)
    return st, int(ws[0]), ex[0]


def phase1_status(emu, x, idx, k, mode, active, out) -> int:
    """First-phase status; a successful executor is destroyed at once (it is never launched)."""
    st, _, ex = phase1(emu, x, idx, k, mode, active, out)
    if st == 0:
        emu.ok(emu.nn.aclDestroyAclOpExecutor(ex))
    return st


def launch(emu, res, x, idx, k, mode, active, out, stream=None, sync=True):
    """Both phases with a one-shot executor (consumed by the launch), then synchronize."""
    stream = emu.NULL if stream is None else stream
    st, ws, ex = phase1(emu, x, idx, k, mode, active, out)
    emu.ok(st)
    # 16 MiB, plus the dense copy of each non-contiguous input (see test_emulator_nnopbase).
    assert ws >= WORKSPACE and ws % 512 == 0
    wsp = res.workspace() if ws == WORKSPACE else res.dev(ws)
    emu.ok(emu.op.aclnnMoeInitRoutingV2Grad(wsp, ws, ex, stream))
    if sync:
        emu.ok(emu.acl.aclrtSynchronizeStream(stream))


def reference(x, idx, k, mode, active, out_dtype):
    """A plain per-token loop: float32 accumulation, one rounding to out_dtype. Also returns
    the float64 sum of |terms| per element, which bounds float32 summation error."""
    h = x.shape[-1]
    rows = np.asarray(x).reshape(-1, h)
    n = len(idx) // k
    acc = np.zeros((n, h), np.float32)
    mag = np.zeros((n, h), np.float64)
    for i in range(n):
        for t in range(k):
            v = int(idx[i * k + t])
            if mode == 1 and v == -1:
                continue
            if mode == 0 and active > 0 and v >= active:
                continue
            term = rows[v].astype(np.float32)
            acc[i] += term
            mag[i] += np.abs(term.astype(np.float64))
    return acc.astype(out_dtype), mag


def ordered(a: np.ndarray) -> np.ndarray:
    """Float bit patterns mapped to integers that are consecutive for consecutive floats."""
    if a.dtype.itemsize == 4:
        u = a.view(np.uint32).astype(np.int64)
        sign, mag = u >> 31, u & 0x7FFFFFFF
    else:
        u = a.view(np.uint16).astype(np.int64)
        sign, mag = u >> 15, u & 0x7FFF
    return np.where(sign == 1, -mag, mag)


def assert_matches(got, want, mag):
    """float32: within 1e-5 of the sum of magnitudes; 16-bit types: at most one ulp apart."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == np.float32:
        err = np.abs(got.astype(np.float64) - want.astype(np.float64))
        assert np.all(err <= 1e-5 * mag + 1e-30), f"max error {err.max()}"
    else:
        ulps = np.abs(ordered(got) - ordered(want))
        assert ulps.max() <= 1, f"{ulps.max()} ulps apart"


def make_case(rng, scenario, n, k, h, dtype, e=6, c=10, active=None):
    """Inputs of one scenario: (x, idx, mode, activeNum), indices unique apart from -1."""
    length = n * k
    if scenario == "dropless":
        x = rng.standard_normal((length, h))
        idx = rng.permutation(length)
        mode, act = 0, 0
    elif scenario == "active":
        act = active or (length // 2 + 1)
        x = rng.standard_normal((act, h))
        idx = rng.permutation(length)  # values >= act are skipped
        mode = 0
    else:
        x = rng.standard_normal((e, c, h))
        m = min(length, e * c) * 2 // 3
        idx = np.full(length, -1)
        idx[rng.choice(length, m, replace=False)] = rng.choice(e * c, m, replace=False)
        mode, act = 1, 0
    return x.astype(NP_DTYPE[dtype]), idx.astype(np.int32), mode, act


def op_on(emu, res, x, idx, k, mode, act, dtype, sentinel=7.0, h=None):
    """Device buffers and contiguous tensors for x and idx, an out prefilled with a sentinel.
    ``h``: out's width when it is not x's last dimension (3-D x in dropless/active mode)."""
    n, h = len(idx) // k, (x.shape[-1] if h is None else h)
    xt = res.tensor(x.shape, dtype, res.dev(x))
    it = res.tensor(idx.shape, ACL_INT32, res.dev(idx))
    out_p = res.dev(np.full((n, h), sentinel, NP_DTYPE[dtype]))
    ot = res.tensor((n, h), dtype, out_p)
    return xt, it, ot, out_p


def run_fresh(isolated, child, *args, env=None) -> dict:
    """Run ``child(*args)`` in a fresh interpreter; it prints one JSON object last."""
    proc = isolated(child, *args, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def try_malloc(emu: Emu, size: int) -> tuple[int, object]:
    """aclrtMalloc's status and the block (NULL when it failed)."""
    p = emu.ffi.new("void **")
    st = emu.acl.aclrtMalloc(p, size, 0)
    return st, p[0]


# ============================================================================ 1. status codes

def child_runtime_calls_without_aclinit() -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    p = ffi.new("void **")
    s = ffi.new("aclrtStream *")
    d = ffi.new("int32_t *")
    c = ffi.new("uint32_t *")
    out = {
        "count": acl.aclrtGetDeviceCount(c),
        "soc": ffi.string(acl.aclrtGetSocName()).decode(),
        "getdev": [acl.aclrtGetDevice(d), emu.msg()],      # silent: no message
        "malloc": acl.aclrtMalloc(p, 64, 0),
        "free_no_heap": acl.aclrtFree(ffi.cast("void *", 0x1000)),
        "stream": acl.aclrtCreateStream(s),
        "syncdev": acl.aclrtSynchronizeDevice(),
        "set": acl.aclrtSetDevice(0),
    }
    out["getdev_after"] = [acl.aclrtGetDevice(d), d[0]]
    st, p0 = try_malloc(emu, 64)
    out["malloc_after"] = st
    out["free_unknown"] = acl.aclrtFree(ffi.cast("void *", 0x1000))
    out["free"] = acl.aclrtFree(p0)
    out["reset"] = acl.aclrtResetDevice(0)
    out["initialized"] = emu.stats()["initialized"]
    print(json.dumps(out))


def test_runtime_calls_need_no_aclinit(isolated):
    # No runtime call checks aclInit (CANN's runtime never looks at it): without a device the
    # calls that need one are 107002, and aclrtSetDevice works at once.
    r = run_fresh(isolated, child_runtime_calls_without_aclinit)
    assert r["count"] == 0 and r["soc"]
    assert r["getdev"] == [RT_CONTEXT_NULL, ""]
    assert r["malloc"] == r["stream"] == r["syncdev"] == RT_CONTEXT_NULL
    assert r["free_no_heap"] == RT_INVALID_HANDLE  # the driver's heap exists once a device opened
    assert r["set"] == 0 and r["getdev_after"] == [0, 0] and r["malloc_after"] == 0
    assert r["free_unknown"] == RT_PARAM_INVALID and r["free"] == 0 and r["reset"] == 0
    assert r["initialized"] == 0


def child_init_twice_and_finalize_twice() -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    out = {}
    out["fin_first"] = acl.aclFinalize()  # the flag starts clear: it runs
    out["fin_again"] = acl.aclFinalize()
    out["init1"] = acl.aclInit(ffi.NULL)
    out["init2"] = acl.aclInit(ffi.NULL)
    out["init2_msg"] = emu.msg()
    out["set"] = acl.aclrtSetDevice(0)
    st, p = try_malloc(emu, 1000)
    out["malloc"] = st
    out["allocs_before_fin"] = emu.stats()["device_allocations"]
    out["fin1"] = acl.aclFinalize()
    # aclFinalize releases nothing: the block and the device stay usable.
    out["allocs_after_fin"] = emu.stats()["device_allocations"]
    out["initialized"] = emu.stats()["initialized"]
    host = bytearray(1000)
    out["copy_after_fin"] = acl.aclrtMemcpy(ffi.from_buffer(host), 1000, p, 1000, 2)
    out["fin2"] = acl.aclFinalize()
    out["fin2_msg"] = emu.msg()
    out["free"] = acl.aclrtFree(p)
    print(json.dumps(out))


def test_init_twice_and_finalize_twice(isolated):
    r = run_fresh(isolated, child_init_twice_and_finalize_twice)
    assert r["fin_first"] == 0 and r["fin_again"] == ACL_ERROR_REPEAT_FINALIZE
    assert r["init1"] == 0
    assert r["init2"] == ACL_ERROR_REPEAT_INITIALIZE
    assert "aclInit" in r["init2_msg"]
    assert r["set"] == 0 and r["malloc"] == 0
    assert r["allocs_before_fin"] == 1 and r["allocs_after_fin"] == 1
    assert r["fin1"] == 0 and r["initialized"] == 0 and r["copy_after_fin"] == 0
    assert r["fin2"] == ACL_ERROR_REPEAT_FINALIZE
    assert "aclFinalize" in r["fin2_msg"]
    assert r["free"] == 0


def test_second_aclinit_in_process_is_repeat_initialize(emu):
    # The fixture (or the binding) already initialized this process.
    assert emu.acl.aclInit(emu.NULL) == ACL_ERROR_REPEAT_INITIALIZE
    assert "100002" in emu.msg()
    assert emu.stats()["initialized"] == 1


def test_set_device_invalid_id(emu):
    count = emu.ffi.new("uint32_t *")
    emu.ok(emu.acl.aclrtGetDeviceCount(count))
    before = emu.stats()["devices_set"]
    for bad in (-1, int(count[0]), 1000):
        assert emu.acl.aclrtSetDevice(bad) == RT_INVALID_DEVICEID, bad
        assert f"device id {bad}" in emu.msg()
    # A rejected aclrtSetDevice takes no reference, and leaves device 0 current.
    assert emu.stats()["devices_set"] == before
    d = emu.ffi.new("int32_t *")
    emu.ok(emu.acl.aclrtGetDevice(d))
    assert d[0] == 0


def child_device_count_and_ids() -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    c = ffi.new("uint32_t *")
    acl.aclInit(ffi.NULL)
    out = {"count": (acl.aclrtGetDeviceCount(c), c[0])}
    out["set2"] = acl.aclrtSetDevice(2)
    d = ffi.new("int32_t *")
    out["get"] = (acl.aclrtGetDevice(d), d[0])
    out["set3"] = acl.aclrtSetDevice(3)
    print(json.dumps(out))


def test_device_count_and_ids_follow_env(isolated):
    r = run_fresh(isolated, child_device_count_and_ids, env={"PYACL_MOE_EMU_DEVICES": "3"})
    assert r["count"] == [0, 3]
    assert r["set2"] == 0 and r["get"] == [0, 2]
    assert r["set3"] == RT_INVALID_DEVICEID


def test_get_device_on_thread_without_device(emu):
    seen = {}

    def worker():
        d = emu.ffi.new("int32_t *")
        seen["get"] = emu.acl.aclrtGetDevice(d)
        seen["get_msg"] = emu.msg()
        p = emu.ffi.new("void **")
        seen["malloc"] = emu.acl.aclrtMalloc(p, 64, 0)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["get"] == RT_CONTEXT_NULL
    assert seen["get_msg"] == ""  # CANN returns it silently: no message
    # The current device is per thread: allocating needs one too.
    assert seen["malloc"] == RT_CONTEXT_NULL
    d = emu.ffi.new("int32_t *")
    emu.ok(emu.acl.aclrtGetDevice(d))  # this thread still has device 0


def test_malloc_beyond_capacity_and_size_zero(emu):
    free_, total = emu.ffi.new("size_t *"), emu.ffi.new("size_t *")
    emu.ok(emu.acl.aclrtGetMemInfo(ACL_HBM_MEM, free_, total))
    if not os.environ.get("PYACL_MOE_EMU_MEMORY"):
        assert total[0] == default_capacity()
    p = emu.ffi.new("void **")
    before = emu.stats()
    assert emu.acl.aclrtMalloc(p, total[0] + 1, 0) == RT_MEMORY_ALLOCATION
    assert "cannot allocate" in emu.msg()
    assert emu.acl.aclrtMalloc(p, 0, 0) == ACL_ERROR_INVALID_PARAM
    assert "size is 0" in emu.msg()
    after = emu.stats()
    assert after["device_allocations"] == before["device_allocations"]
    assert after["mallocs_total"] == before["mallocs_total"]


def child_malloc_capacity() -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    acl.aclInit(ffi.NULL)
    acl.aclrtSetDevice(0)
    f, t = ffi.new("size_t *"), ffi.new("size_t *")
    out = {"info": acl.aclrtGetMemInfo(1, f, t), "total": t[0]}
    out["whole"] = try_malloc(emu, 1 << 20)[0]  # the block's padding does not fit
    st, half = try_malloc(emu, 512 << 10)
    out["half"] = st
    out["more"] = try_malloc(emu, 600 << 10)[0]  # 512 KiB + 600 KiB > 1 MiB
    out["small"] = try_malloc(emu, 400 << 10)[0]
    acl.aclrtGetMemInfo(1, f, t)
    out["free_after"] = f[0]
    print(json.dumps(out))


def test_malloc_capacity_follows_env(isolated):
    r = run_fresh(isolated, child_malloc_capacity, env={"PYACL_MOE_EMU_MEMORY": "1M"})
    assert r["info"] == 0 and r["total"] == 1 << 20
    assert r["whole"] == RT_MEMORY_ALLOCATION
    assert r["half"] == 0
    assert r["more"] == RT_MEMORY_ALLOCATION
    assert r["small"] == 0
    # 32-byte rounding plus 32 bytes per block, as CANN accounts it.
    assert r["free_after"] == (1 << 20) - ((512 << 10) + 32) - ((400 << 10) + 32)


def test_free_unknown_and_double_free(emu):
    # The driver's answer for an address it did not allocate (or freed already): 107000.
    before = emu.stats()["device_allocations"]
    p = emu.malloc(256)
    assert emu.acl.aclrtFree(emu.NULL) == ACL_ERROR_INVALID_PARAM
    # Not the start of a block, and an address that was never allocated.
    assert emu.acl.aclrtFree(emu.ffi.cast("char *", p) + 32) == RT_PARAM_INVALID
    assert "not the start of a live device allocation" in emu.msg()
    assert emu.acl.aclrtFree(emu.ffi.cast("void *", 0x1000)) == RT_PARAM_INVALID
    emu.ok(emu.acl.aclrtFree(p))
    assert emu.stats()["device_allocations"] == before
    assert emu.acl.aclrtFree(p) == RT_PARAM_INVALID
    assert emu.stats()["device_allocations"] == before


def test_memcpy_device_side_checks(emu, res):
    ffi = emu.ffi
    dev = res.dev(1024)
    host = bytearray(4096)
    hb = ffi.from_buffer(host)
    # Device side inside no live allocation: a freed block, and a plain host address.
    gone = emu.malloc(1024)
    emu.ok(emu.acl.aclrtFree(gone))
    assert emu.acl.aclrtMemcpy(gone, 1024, hb, 1024, H2D) == RT_PARAM_INVALID
    assert "not inside a live device allocation" in emu.msg()
    assert emu.acl.aclrtMemcpy(hb, 1024, gone, 1024, D2H) == RT_PARAM_INVALID
    other = bytearray(64)
    assert emu.acl.aclrtMemcpy(ffi.from_buffer(other), 64, hb, 64, H2D) == RT_PARAM_INVALID
    # Runs past the end of the block (well past CANN's 32-byte padding).
    tail = ffi.cast("char *", dev) + 1000
    assert emu.acl.aclrtMemcpy(tail, 200, hb, 200, H2D) == RT_PARAM_INVALID
    assert "runs past the end" in emu.msg()
    assert emu.acl.aclrtMemcpy(hb, 4096, dev, 4096, D2H) == RT_PARAM_INVALID
    # The host side is a device pointer although the kind says host.
    dev2 = res.dev(1024)
    assert emu.acl.aclrtMemcpy(dev, 1024, dev2, 1024, H2D) == RT_PARAM_INVALID
    assert "device memory but the copy kind says host" in emu.msg()
    assert emu.acl.aclrtMemcpy(dev2, 1024, dev, 1024, D2H) == RT_PARAM_INVALID
    # count > destMax: the runtime's check, 107000.
    assert emu.acl.aclrtMemcpy(dev, 16, hb, 17, H2D) == RT_PARAM_INVALID
    assert "exceeds destMax" in emu.msg()
    # None of the rejected copies wrote anything.
    host[:] = b"\x5a" * 4096
    emu.ok(emu.acl.aclrtMemcpy(dev, 1024, hb, 1024, H2D))
    emu.ok(emu.acl.aclrtMemcpy(dev2, 1024, dev, 1024, D2D))
    assert emu.d2h(dev2, 1024) == b"\x5a" * 1024


def test_memcpy_bound_is_the_padded_block(emu, res):
    # CANN rounds a block up to 32 bytes and adds 32: those bytes are allocated device memory,
    # so a copy into them is legal; one byte more leaves the block.
    dev = res.dev(1000)
    padded = 1024 + 32
    host = bytearray(padded + 1)
    hb = emu.ffi.from_buffer(host)
    emu.ok(emu.acl.aclrtMemcpy(dev, padded, hb, padded, H2D))
    assert emu.acl.aclrtMemcpy(dev, padded + 1, hb, padded + 1, H2D) == RT_PARAM_INVALID
    assert emu.acl.aclemuCheckGuards() == 0


# ============================================================================ 2. first phase

@pytest.fixture
def shapes(emu, res):
    """A tensor factory over one 1 MiB device block: the first phase reads no tensor memory."""
    buf = res.dev(1 << 20)

    def make(shape, dtype=ACL_FLOAT, **kw):
        return res.tensor(shape, dtype, buf, **kw)

    return make


def test_first_phase_null_arguments(emu, shapes):
    x, i, o = shapes((8, 4)), shapes((8,), ACL_INT32), shapes((4, 4))
    ws, ex = emu.ffi.new("uint64_t *"), emu.ffi.new("aclOpExecutor **")
    f = emu.op.aclnnMoeInitRoutingV2GradGetWorkspaceSize
    N = emu.NULL
    before = emu.stats()["executors"]
    for args, name in (((N, i, 2, 0, 0, o, ws, ex), "gradExpandedX"),
                       ((x, N, 2, 0, 0, o, ws, ex), "expandedRowIdx"),
                       ((x, i, 2, 0, 0, N, ws, ex), "out"),
                       ((x, i, 2, 0, 0, o, N, ex), "workspaceSize"),
                       ((x, i, 2, 0, 0, o, ws, N), "executor")):
        assert f(*args) == ACLNN_ERR_PARAM_NULLPTR, name
        assert f"{name} is a null pointer" in emu.msg()
    assert emu.stats()["executors"] == before


@pytest.mark.parametrize("bad", [ACL_DOUBLE, ACL_INT32, ACL_INT64])
def test_first_phase_unsupported_x_dtype(emu, shapes, bad):
    x, i, o = shapes((8, 4), bad), shapes((8,), ACL_INT32), shapes((4, 4), bad)
    assert phase1_status(emu, x, i, 2, 0, 0, o) == ACLNN_ERR_PARAM_INVALID
    assert "gradExpandedX has data type" in emu.msg()


def test_first_phase_index_dtype_and_out_dtype(emu, shapes):
    x, o = shapes((8, 4), ACL_FLOAT16), shapes((4, 4), ACL_FLOAT16)
    assert phase1_status(emu, x, shapes((8,), ACL_INT64), 2, 0, 0, o) == ACLNN_ERR_PARAM_INVALID
    assert "must be INT32" in emu.msg()
    i = shapes((8,), ACL_INT32)
    for other in (ACL_FLOAT, ACL_BF16):
        assert phase1_status(emu, x, i, 2, 0, 0, shapes((4, 4), other)) == ACLNN_ERR_PARAM_INVALID
        assert "they must match" in emu.msg()
    assert phase1_status(emu, x, i, 2, 0, 0, o) == 0


def test_first_phase_rejects_private_format(emu, shapes):
    # A strided out is accepted, as nnopbase checks contiguity of inputs only
    # (test_emulator_nnopbase.py); a private format is not ND.
    i = shapes((8,), ACL_INT32)
    nz = shapes((8, 4), fmt=ACL_FORMAT_FRACTAL_NZ)
    assert phase1_status(emu, nz, i, 2, 0, 0, shapes((4, 4))) == ACLNN_ERR_PARAM_INVALID
    assert "format 29" in emu.msg()


# (gradExpandedX shape, len(idx), out shape, topK, dropPadMode, activeNum), each one tiling
# condition of op-contract.md broken.
TILING_FAILURES = {
    "dropPadMode 2": ((8, 4), 8, (4, 4), 2, 2, 0),
    "dropPadMode -1": ((8, 4), 8, (4, 4), 2, -1, 0),
    "topK 0": ((8, 4), 8, (4, 4), 0, 0, 0),
    "topK negative": ((8, 4), 8, (4, 4), -2, 0, 0),
    "activeNum -1": ((8, 4), 8, (4, 4), 2, 0, -1),
    "activeNum -1 in drop/pad": ((2, 4, 4), 8, (4, 4), 2, 1, -1),
    "1-D x": ((32,), 8, (4, 4), 2, 0, 0),
    "4-D x": ((2, 2, 2, 4), 8, (4, 4), 2, 0, 0),
    "2-D x in drop/pad": ((8, 4), 8, (4, 4), 2, 1, 0),
    "dropless rows != len(idx)": ((9, 4), 8, (4, 4), 2, 0, 0),
    "active rows != activeNum": ((6, 4), 8, (4, 4), 2, 0, 5),
    "out 3-D": ((8, 4), 8, (4, 4, 1), 2, 0, 0),
    "out 1-D": ((8, 4), 8, (16,), 2, 0, 0),
    "out H differs": ((8, 4), 8, (4, 5), 2, 0, 0),
    "out H differs (drop/pad)": ((2, 4, 4), 8, (4, 3), 2, 1, 0),
    "out rows != len/topK": ((8, 4), 8, (3, 4), 2, 0, 0),
    "len not divisible by topK": ((10, 4), 10, (3, 4), 3, 0, 0),
    "idx negative length": ((2, 3, 4), -4, (-2, 4), 2, 1, 0),
    "negative dim of x (drop/pad)": ((2, -4, 4), 8, (4, 4), 2, 1, 0),
}


@pytest.mark.parametrize("case", list(TILING_FAILURES), ids=list(TILING_FAILURES))
def test_first_phase_tiling_errors(emu, shapes, case):
    xs, n_idx, os_, k, mode, act = TILING_FAILURES[case]
    before = emu.stats()["executors"]
    st = phase1_status(emu, shapes(xs), shapes((n_idx,), ACL_INT32), k, mode, act, shapes(os_))
    assert st == ACLNN_ERR_INNER_TILING_ERROR, (case, emu.msg())
    assert "aclnnMoeInitRoutingV2GradGetWorkspaceSize failed with status 561002" in emu.msg()
    assert emu.stats()["executors"] == before


def test_zero_size_x_accepted_in_drop_pad(emu, res):
    # Every index is -1, so no row is read: x may be empty; the sums are all zero.
    x_p = res.dev(64)
    for xs in ((0, 4, 8), (3, 0, 8)):
        xt = res.tensor(xs, ACL_FLOAT, x_p)
        idx = np.full(6, -1, np.int32)
        it = res.tensor((6,), ACL_INT32, res.dev(idx))
        out_p = res.dev(np.full((3, 8), 5.0, np.float32))
        ot = res.tensor((3, 8), ACL_FLOAT, out_p)
        launch(emu, res, xt, it, 2, 1, 0, ot)
        assert np.array_equal(res.read(out_p, (3, 8), np.float32), np.zeros((3, 8), np.float32))


# The vendor's own examples (op-contract.md): shapes, dtype, topK, dropPadMode, activeNum, result.
VENDOR_EXAMPLES = [
    ((480, 8), 480, (80, 8), ACL_FLOAT, 6, 0, 0, 0),
    ((40, 512), 640, (10, 512), ACL_BF16, 64, 0, 40, 0),
    ((40, 512), 80, (80, 512), ACL_FLOAT16, 1, 0, 40, 0),
    ((10, 8, 512), 640, (80, 512), ACL_FLOAT, 8, 1, 40, 0),
    ((10, 512), 640, (80, 512), ACL_BF16, 8, 1, 40, ACLNN_ERR_INNER_TILING_ERROR),
    ((40, 512), 640, (10, 510), ACL_BF16, 64, 0, 40, ACLNN_ERR_INNER_TILING_ERROR),
]


@pytest.mark.parametrize("example", VENDOR_EXAMPLES, ids=[f"vendor{i}" for i in range(len(VENDOR_EXAMPLES))])
def test_vendor_examples(emu, res, example):
    xs, n_idx, os_, dt, k, mode, act, want = example
    rng = np.random.default_rng(n_idx + k)
    x = rng.standard_normal(xs).astype(NP_DTYPE[dt])
    rows = int(np.prod(xs[:-1]))
    if mode == 1:  # unique flattened positions or -1
        idx = np.full(n_idx, -1)
        m = min(rows, n_idx) // 2
        idx[rng.choice(n_idx, m, replace=False)] = rng.choice(rows, m, replace=False)
    else:  # a permutation: in active mode values >= activeNum are skipped
        idx = rng.permutation(n_idx)
    idx = idx.astype(np.int32)
    xt = res.tensor(xs, dt, res.dev(x))
    it = res.tensor((n_idx,), ACL_INT32, res.dev(idx))
    out_p = res.dev(int(np.prod(os_)) * NP_DTYPE[dt].itemsize)
    ot = res.tensor(os_, dt, out_p)
    if want:
        assert phase1_status(emu, xt, it, k, mode, act, ot) == want
        return
    launch(emu, res, xt, it, k, mode, act, ot)
    ref, mag = reference(x, idx, k, mode, act, NP_DTYPE[dt])
    assert_matches(res.read(out_p, os_, NP_DTYPE[dt]), ref, mag)


def test_workspace_is_fixed_16_mib(emu, shapes):
    for xs, n_idx, os_, k, mode, act in (((2, 1), 2, (1, 1), 2, 0, 0),
                                         ((4096, 1024), 4096, (512, 1024), 8, 0, 0),
                                         ((64, 128, 256), 1024, (128, 256), 8, 1, 0)):
        st, ws, ex = phase1(emu, shapes(xs), shapes((n_idx,), ACL_INT32), k, mode, act, shapes(os_))
        emu.ok(st)
        assert ws == 16777216
        emu.ok(emu.nn.aclDestroyAclOpExecutor(ex))


def test_huge_4d_descriptor_over_small_buffer(emu, res):
    # 40x512x1024x1024 bf16 is 40 GiB of view over a 1 MiB block: the shape check must fail
    # without touching memory.
    buf = res.dev(1 << 20)
    x = res.tensor((40, 512, 1024, 1024), ACL_BF16, buf)
    i = res.tensor((1024,), ACL_INT32, buf)
    o = res.tensor((128, 1024), ACL_BF16, buf)
    assert phase1_status(emu, x, i, 8, 0, 0, o) == ACLNN_ERR_INNER_TILING_ERROR
    assert "4 dimensions" in emu.msg()


def test_mode0_hidden_size_is_dim1_as_the_vendor_tiling_reads_it(emu, shapes):
    # The vendor's tiling takes H from dim 1 when dropPadMode is 0 and from dim 2 otherwise,
    # whatever the rank (op-contract.md item 7 says "last dimension", which is the same thing
    # for the documented 2-D input). A 3-D x in mode 0 is compared through dim 1.
    x, i = shapes((4, 8, 16)), shapes((8,), ACL_INT32)
    assert phase1_status(emu, x, i, 2, 0, 4, shapes((4, 16))) == ACLNN_ERR_INNER_TILING_ERROR
    assert "out's dim 1 is 16 but gradExpandedX's dim 1 (H) is 8" in emu.msg()
    assert phase1_status(emu, x, i, 2, 0, 4, shapes((4, 8))) == 0


# ============================================================================ 3. kernel

@pytest.mark.parametrize("dtype", [ACL_FLOAT, ACL_FLOAT16, ACL_BF16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("scenario,k", [("dropless", 4), ("dropless", 1), ("active", 3),
                                        ("droppad", 2), ("droppad", 8)])
def test_kernel_matches_reference(emu, res, scenario, k, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{scenario}-{k}-{dtype}".encode()))  # stable per case
    x, idx, mode, act = make_case(rng, scenario, n=24, k=k, h=37, dtype=dtype,
                                  e=8, c=30)
    xt, it, ot, out_p = op_on(emu, res, x, idx, k, mode, act, dtype)
    launch(emu, res, xt, it, k, mode, act, ot)
    got = res.read(out_p, (24, 37), NP_DTYPE[dtype])
    ref, mag = reference(x, idx, k, mode, act, NP_DTYPE[dtype])
    assert_matches(got, ref, mag)
    if scenario != "dropless":  # something was skipped, so rows with fewer terms exist
        assert mag.min() < mag.max()


def test_kernel_many_terms_and_determinism(emu, res):
    # topK 130 exercises the 64 partial buffers; two launches give identical bits.
    rng = np.random.default_rng(5)
    x, idx, mode, act = make_case(rng, "dropless", n=3, k=130, h=16, dtype=ACL_FLOAT)
    xt, it, ot, out_p = op_on(emu, res, x, idx, 130, mode, act, ACL_FLOAT)
    launch(emu, res, xt, it, 130, mode, act, ot)
    first = res.read(out_p, (3, 16), np.float32)
    launch(emu, res, xt, it, 130, mode, act, ot)
    assert first.tobytes() == res.read(out_p, (3, 16), np.float32).tobytes()
    ref, mag = reference(x, idx, 130, mode, act, np.float32)
    assert_matches(first, ref, mag)


@pytest.mark.parametrize("dtype", [ACL_FLOAT, ACL_FLOAT16, ACL_BF16], ids=DTYPE_IDS.get)
def test_kernel_accumulates_in_float32_and_rounds_once(emu, res, dtype):
    # 1 plus four terms of a quarter ulp of the 16-bit type (fp16 for float32 too): rounding
    # any partial sum to 16 bits drops each quarter ulp, while a float32 accumulator rounded
    # once at the end gives exactly 1 + 1 ulp.
    npdt = NP_DTYPE[dtype]
    small = 2.0 ** -9 if dtype == ACL_BF16 else 2.0 ** -12
    x = np.array([[1.0], [small], [small], [small], [small]]).astype(npdt)
    x = np.repeat(x, 3, axis=1)
    idx = np.arange(5, dtype=np.int32)
    xt, it, ot, out_p = op_on(emu, res, x, idx, 5, 0, 0, dtype)
    launch(emu, res, xt, it, 5, 0, 0, ot)
    got = res.read(out_p, (1, 3), npdt)
    want = np.full((1, 3), 1.0 + 4 * small, np.float32).astype(npdt)
    assert want[0, 0] != npdt.type(1.0)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", [ACL_FLOAT16, ACL_BF16], ids=DTYPE_IDS.get)
def test_kernel_rounds_once_to_nearest_even(emu, res, dtype):
    # Two terms per token: their float32 sum is what the reference computes too, so the one
    # rounding to the output type must match NumPy's (round to nearest even) bit for bit:
    # ties, carries into the exponent, overflow to inf, subnormals and signed zero.
    npdt = NP_DTYPE[dtype]
    if dtype == ACL_FLOAT16:
        pairs = [(2048, 1), (2050, 1), (2052, 1), (65504, 16), (65504, 8), (-65504, -16),
                 (2.0 ** -24, 2.0 ** -24), (2.0 ** -14, -(2.0 ** -24)), (1.0, -1.0), (-0.0, -0.0),
                 (1.0, 2.0 ** -11), (1.0 + 2.0 ** -10, 2.0 ** -11), (2047, 0.5), (-3.0, 1.5)]
    else:
        pairs = [(1.0, 2.0 ** -8), (1.0 + 2.0 ** -7, 2.0 ** -8), (256, 1), (258, 1),
                 (3.3895313892515355e38, 2.0 ** 119), (3.3895313892515355e38, 2.0 ** 118),
                 (-(2.0 ** -133), -(2.0 ** -133)),
                 (1.0, -1.0), (-0.0, -0.0), (255, 0.5), (-3.0, 1.5)]
    terms = np.array(pairs, np.float64)
    x32 = terms.astype(npdt).reshape(-1, 1)
    assert np.array_equal(x32.astype(np.float64).ravel(), terms.ravel())  # exact inputs
    x = np.repeat(x32, 2, axis=1)
    n = len(pairs)
    idx = np.arange(2 * n, dtype=np.int32)
    xt, it, ot, out_p = op_on(emu, res, x, idx, 2, 0, 0, dtype)
    launch(emu, res, xt, it, 2, 0, 0, ot)
    got = res.read(out_p, (n, 2), npdt)
    with np.errstate(over="ignore"):  # the overflow to inf is intended
        want = (terms[:, 0].astype(np.float32) + terms[:, 1].astype(np.float32)).astype(npdt)
    assert np.isinf(want.astype(np.float32)).any()
    want = np.repeat(want.reshape(-1, 1), 2, axis=1)
    assert got.view(np.uint16).tolist() == want.view(np.uint16).tolist()


@pytest.mark.parametrize("dtype", [ACL_FLOAT16, ACL_BF16], ids=DTYPE_IDS.get)
def test_kernel_conversions_bit_exact_on_random_bit_patterns(emu, res, dtype):
    # 2^16 token sums of two terms drawn from every finite bit pattern of the type (subnormals,
    # both signs, the largest values): the widening of each term and the one rounding of the
    # float32 sum must agree with NumPy / ml_dtypes bit for bit.
    npdt = NP_DTYPE[dtype]
    rng = np.random.default_rng(71)
    bits = rng.integers(0, 1 << 16, size=2 * 65536, dtype=np.uint32).astype(np.uint16)
    exp_mask = 0x7C00 if dtype == ACL_FLOAT16 else 0x7F80
    bits = bits[(bits & exp_mask) != exp_mask][: 2 * 65536 - 4096]  # no inf / NaN inputs
    n, h = 2 * 64, (len(bits) // 2) // (2 * 64)
    terms = bits[: 2 * n * h].view(npdt).reshape(2 * n, h)
    idx = np.arange(2 * n, dtype=np.int32)
    xt, it, ot, out_p = op_on(emu, res, terms, idx, 2, 0, 0, dtype)
    launch(emu, res, xt, it, 2, 0, 0, ot)
    got = res.read(out_p, (n, h), npdt).view(np.uint16)
    with np.errstate(over="ignore"):
        want = (terms[0::2].astype(np.float32) + terms[1::2].astype(np.float32)).astype(npdt)
    assert np.array_equal(got, want.view(np.uint16)), np.count_nonzero(got != want.view(np.uint16))


@pytest.mark.parametrize("threads", ["1", "2", "3", "7", "64"])
def test_kernel_token_split_across_threads_is_bit_identical(emu, res, monkeypatch, threads):
    # Kernels with at least 2^20 multiply-adds split their tokens over host threads
    # (PYACL_MOE_EMU_THREADS, read at each run); the split must neither drop nor repeat a token
    # nor change a bit. 5 tokens over 7 or 64 threads leaves some threads without work.
    monkeypatch.setenv("PYACL_MOE_EMU_THREADS", threads)
    for n, k, h, seed in ((1000, 8, 132, 81), (5, 2, 1 << 17, 82)):
        rng = np.random.default_rng(seed)
        x, idx, mode, act = make_case(rng, "dropless", n=n, k=k, h=h, dtype=ACL_FLOAT16)
        xt, it, ot, out_p = op_on(emu, res, x, idx, k, mode, act, ACL_FLOAT16, sentinel=float("nan"))
        launch(emu, res, xt, it, k, mode, act, ot)
        got = res.read(out_p, (n, h), np.float16)
        rows = x.astype(np.float32)[idx.reshape(n, k)]  # (n, k, h), summed in the kernel's order
        nb = 4 if k == 8 else 1
        bins = [rows[:, b * 2] for b in range(nb)]       # S1 seeds, S3 adds the odd terms
        for t in range(1, k, 2):
            bins[(t - 1) // 2 % nb] = bins[(t - 1) // 2 % nb] + rows[:, t]
        while len(bins) > 1:                             # S4: pairwise tree
            bins = [bins[i] + bins[i + 1] for i in range(0, len(bins), 2)]
        assert got.view(np.uint16).tobytes() == bins[0].astype(np.float16).view(np.uint16).tobytes()


def test_kernel_strided_x_rows_and_offset(emu, res):
    # x is a view: rows 2H apart (the other half is NaN), starting 5 elements into the block.
    rng = np.random.default_rng(11)
    n, k, h = 10, 3, 12
    length = n * k
    x = rng.standard_normal((length, h)).astype(np.float32)
    store = np.full(5 + length * 2 * h, np.nan, np.float32)
    store[5:].reshape(length, 2 * h)[:, :h] = x
    xt = res.tensor((length, h), ACL_FLOAT, res.dev(store), strides=(2 * h, 1), offset=5,
                    storage=(store.size,))
    idx = rng.permutation(length).astype(np.int32)
    it = res.tensor((length,), ACL_INT32, res.dev(idx))
    out_p = res.dev(n * h * 4)
    ot = res.tensor((n, h), ACL_FLOAT, out_p)
    launch(emu, res, xt, it, k, 0, 0, ot)
    got = res.read(out_p, (n, h), np.float32)
    ref, mag = reference(x, idx, k, 0, 0, np.float32)
    assert not np.isnan(got).any()
    assert_matches(got, ref, mag)


@pytest.mark.parametrize("dtype", [ACL_FLOAT, ACL_FLOAT16, ACL_BF16], ids=DTYPE_IDS.get)
def test_kernel_strided_elements_and_strided_index(emu, res, dtype):
    # x in drop/pad mode as [E, C, H] with every other element and an expert stride; the
    # index view takes every other int32 (the ones in between would fault if read).
    rng = np.random.default_rng(12)
    npdt = NP_DTYPE[dtype]
    e, c, h, n, k = 4, 5, 9, 6, 3
    length = n * k
    x = rng.standard_normal((e, c, h)).astype(npdt)
    store = np.full((e, c + 1, 2 * h), np.nan, np.float32).astype(npdt)
    store[:, :c, ::2] = x
    xt = res.tensor((e, c, h), dtype, res.dev(store), strides=((c + 1) * 2 * h, 2 * h, 2),
                    storage=(store.size,))
    idx = np.full(length, -1)
    m = 12
    idx[rng.choice(length, m, replace=False)] = rng.choice(e * c, m, replace=False)
    idx = idx.astype(np.int32)
    istore = np.full(2 * length + 3, 1 << 30, np.int32)
    istore[3::2] = idx
    it = res.tensor((length,), ACL_INT32, res.dev(istore), strides=(2,), offset=3,
                    storage=(istore.size,))
    out_p = res.dev(n * h * npdt.itemsize)
    ot = res.tensor((n, h), dtype, out_p)
    launch(emu, res, xt, it, k, 1, 0, ot)
    ref, mag = reference(x, idx, k, 1, 0, npdt)
    assert_matches(res.read(out_p, (n, h), npdt), ref, mag)


def test_kernel_out_view_offset(emu, res):
    # out is contiguous but starts 4 elements into its block: the first 4 stay untouched.
    rng = np.random.default_rng(13)
    x, idx, mode, act = make_case(rng, "dropless", n=4, k=2, h=6, dtype=ACL_FLOAT)
    xt = res.tensor(x.shape, ACL_FLOAT, res.dev(x))
    it = res.tensor(idx.shape, ACL_INT32, res.dev(idx))
    out_p = res.dev(np.full(4 + 24 + 4, -3.0, np.float32))
    ot = res.tensor((4, 6), ACL_FLOAT, out_p, offset=4, storage=(32,))
    launch(emu, res, xt, it, 2, mode, act, ot)
    got = res.read(out_p, (32,), np.float32)
    ref, mag = reference(x, idx, 2, mode, act, np.float32)
    assert np.all(got[:4] == -3.0) and np.all(got[28:] == -3.0)
    assert_matches(got[4:28].reshape(4, 6), ref, mag)


# A 3-D gradExpandedX passes the first phase with dropPadMode 0 (the vendor's tiling accepts
# it and takes H from dim 1). The vendor's kernel then reads x as flat rows of that H, and only
# numel / H rows exist: an index past them is a device fault, and a zero-size x has none.

def test_3d_x_mode0_index_outside_x_is_a_device_fault(emu, res):
    x = np.arange(8, dtype=np.float32).reshape(2, 4, 1)  # as the vendor reads it: 2 rows of 4
    idx = np.array([0, 7], np.int32)
    xt, it, ot, out_p = op_on(emu, res, x, idx, 1, 0, 0, ACL_FLOAT, sentinel=9.0, h=4)
    launch(emu, res, xt, it, 1, 0, 0, ot, sync=False)
    assert emu.acl.aclrtSynchronizeStream(emu.NULL) == RT_AICORE_EXCEPTION
    assert "expandedRowIdx[1] = 7" in emu.msg()
    assert np.all(res.read(out_p, (2, 4), np.float32) == 9.0)


def test_3d_x_mode0_rows_are_read_as_the_vendor_kernel_reads_them(emu, res):
    x = np.arange(8, dtype=np.float32).reshape(2, 4, 1)
    idx = np.array([1, 0], np.int32)
    xt, it, ot, out_p = op_on(emu, res, x, idx, 1, 0, 0, ACL_FLOAT, h=4)
    launch(emu, res, xt, it, 1, 0, 0, ot)
    flat = x.reshape(2, 4)
    assert np.array_equal(res.read(out_p, (2, 4), np.float32), flat[[1, 0]])


def child_zero_size_3d_x_in_active_mode() -> None:
    emu = Emu()
    acl, nn, op, ffi = emu.acl, emu.nn, emu.op, emu.ffi
    acl.aclInit(ffi.NULL)
    acl.aclrtSetDevice(0)

    def tensor(shape, dt, p):
        s = ffi.new("int64_t[]", list(shape))
        return nn.aclCreateTensor(s, len(shape), dt, ffi.NULL, 0, 2, s, len(shape), p)

    x_p, i_p, o_p, w_p = (try_malloc(emu, n)[1] for n in (64, 32, 64, 16 << 20))
    idx = np.arange(8, dtype=np.int32)
    acl.aclrtMemcpy(i_p, 32, ffi.from_buffer(idx), 32, 1)
    ws, ex = ffi.new("uint64_t *"), ffi.new("aclOpExecutor **")
    out = {"phase1": op.aclnnMoeInitRoutingV2GradGetWorkspaceSize(
        tensor((5, 4, 0), 0, x_p), tensor((8,), 3, i_p), 2, 0, 5, tensor((4, 4), 0, o_p),
        ws, ex)}
    out["phase2"] = op.aclnnMoeInitRoutingV2Grad(w_p, ws[0], ex[0], ffi.NULL)
    out["sync"] = acl.aclrtSynchronizeStream(ffi.NULL)
    print(json.dumps(out))


def test_zero_size_3d_x_in_active_mode_does_not_crash(isolated):
    r = run_fresh(isolated, child_zero_size_3d_x_in_active_mode)
    assert r == {"phase1": 0, "phase2": 0, "sync": RT_AICORE_EXCEPTION}


# ============================================================================ 4. lazy streams (run when waited for)

def test_kernel_runs_only_when_stream_is_synchronized(emu, res, lazy):
    rng = np.random.default_rng(21)
    x, idx, mode, act = make_case(rng, "dropless", n=8, k=2, h=5, dtype=ACL_FLOAT)
    xt, it, ot, out_p = op_on(emu, res, x, idx, 2, mode, act, ACL_FLOAT, sentinel=7.0)
    s = res.stream()
    before = emu.stats()
    launch(emu, res, xt, it, 2, mode, act, ot, stream=s, sync=False)
    mid = emu.stats()
    assert mid["kernels_launched"] == before["kernels_launched"] + 1
    assert mid["kernels_run"] == before["kernels_run"]
    assert mid["pending_tasks"] == before["pending_tasks"] + 1
    # A synchronous copy waits for no stream: it sees out as it was.
    assert np.all(res.read(out_p, (8, 5), np.float32) == 7.0)
    emu.ok(emu.acl.aclrtSynchronizeStream(s))
    assert emu.stats()["pending_tasks"] == before["pending_tasks"]
    ref, mag = reference(x, idx, 2, mode, act, np.float32)
    assert_matches(res.read(out_p, (8, 5), np.float32), ref, mag)


def test_queued_launches_outlive_their_executor_and_keep_their_addresses(emu, res, lazy):
    # A queued launch shares its executor's plan (it does not copy its descriptors): launches
    # rebound in between, then the executor destroyed, all still run on their own addresses
    # once the stream is waited for. Under ASan this is also the use-after-free check.
    rng = np.random.default_rng(22)
    x, idx, mode, act = make_case(rng, "dropless", n=6, k=2, h=4, dtype=ACL_FLOAT)
    xt, it, ot, out_p = op_on(emu, res, x, idx, 2, mode, act, ACL_FLOAT)
    s = res.stream()
    before = emu.stats()
    st, ws, ex = phase1(emu, xt, it, 2, mode, act, ot)
    emu.ok(st)
    emu.ok(emu.nn.aclSetAclOpExecutorRepeatable(ex))
    wsp = res.workspace()
    xs = [(x * (i + 1) - i).astype(np.float32) for i in range(3)]
    outs = [res.dev(np.zeros((6, 4), np.float32)) for _ in xs]
    for xi, o in zip(xs, outs):
        emu.ok(emu.nn.aclSetInputTensorAddr(ex, 0, xt, res.dev(xi)))
        emu.ok(emu.nn.aclSetOutputTensorAddr(ex, 0, ot, o))
        emu.ok(emu.op.aclnnMoeInitRoutingV2Grad(wsp, ws, ex, s))
    emu.ok(emu.nn.aclDestroyAclOpExecutor(ex))
    assert emu.stats()["executors"] == before["executors"]
    assert emu.stats()["kernels_run"] == before["kernels_run"]  # nothing has run yet
    emu.ok(emu.acl.aclrtSynchronizeStream(s))
    for xi, o in zip(xs, outs):
        ref, mag = reference(xi, idx, 2, mode, act, np.float32)
        assert_matches(res.read(o, (6, 4), np.float32), ref, mag)


def test_async_copies_and_memset_are_ordered(emu, res, lazy):
    ffi = emu.ffi
    s = res.stream()
    a, b = res.dev(bytes(range(256))), res.dev(256)
    emu.ok(emu.acl.aclrtMemset(b, 256, 0x11, 256))
    host = bytearray(256)
    hb = ffi.from_buffer(host)
    emu.ok(emu.acl.aclrtMemsetAsync(a, 256, 0xAB, 128, s))       # a[:128] = 0xAB
    emu.ok(emu.acl.aclrtMemcpyAsync(b, 256, a, 256, D2D, s))       # b = a
    emu.ok(emu.acl.aclrtMemsetAsync(a, 256, 0x00, 256, s))         # a = 0
    emu.ok(emu.acl.aclrtMemcpyAsync(hb, 256, b, 256, D2H, s))      # host = b
    # Nothing ran yet.
    assert host == bytearray(256)
    assert emu.d2h(a, 256) == bytes(range(256))
    assert emu.d2h(b, 256) == b"\x11" * 256
    emu.ok(emu.acl.aclrtSynchronizeStream(s))
    expect = b"\xab" * 128 + bytes(range(128, 256))
    assert bytes(host) == expect
    assert emu.d2h(b, 256) == expect
    assert emu.d2h(a, 256) == bytes(256)


# ============================================================================ 5. device faults

@pytest.mark.parametrize("mode", [0, 1], ids=["dropless-out-of-range", "droppad-minus-two"])
def test_bad_index_is_a_device_fault_at_synchronize(emu, res, mode):
    rng = np.random.default_rng(31)
    scenario = "dropless" if mode == 0 else "droppad"
    x, idx, mode, act = make_case(rng, scenario, n=6, k=2, h=4, dtype=ACL_FLOAT, e=3, c=5)
    bad_pos, bad = 7, (len(x) if mode == 0 else -2)
    good_idx = idx.copy()
    idx[bad_pos] = bad
    xt, it, ot, out_p = op_on(emu, res, x, idx, 2, mode, act, ACL_FLOAT, sentinel=9.0)
    s = res.stream()
    faults = emu.stats()["device_faults"]
    launch(emu, res, xt, it, 2, mode, act, ot, stream=s, sync=False)  # the launch succeeds
    assert emu.acl.aclrtSynchronizeStream(s) == RT_AICORE_EXCEPTION
    m = emu.msg()
    assert f"expandedRowIdx[{bad_pos}] = {bad}" in m, m
    assert emu.stats()["device_faults"] == faults + 1
    assert np.all(res.read(out_p, (6, 4), np.float32) == 9.0)
    # The fault is reported once; the stream then works again.
    emu.ok(emu.acl.aclrtSynchronizeStream(s))
    it2 = res.tensor(good_idx.shape, ACL_INT32, res.dev(good_idx))
    launch(emu, res, xt, it2, 2, mode, act, ot, stream=s)
    ref, mag = reference(x, good_idx, 2, mode, act, np.float32)
    assert_matches(res.read(out_p, (6, 4), np.float32), ref, mag)


def test_index_past_active_num_is_skipped_not_a_fault(emu, res):
    # In active mode large indices are skipped terms; a negative one addresses no row.
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    idx = np.array([0, 1000, 2, 1], np.int32)
    xt, it, ot, out_p = op_on(emu, res, x, idx, 2, 0, 3, ACL_FLOAT)
    launch(emu, res, xt, it, 2, 0, 3, ot)
    assert np.array_equal(res.read(out_p, (2, 4), np.float32), np.stack([x[0], x[2] + x[1]]))
    idx_neg = np.array([0, -1, 2, 1], np.int32)
    it2 = res.tensor((4,), ACL_INT32, res.dev(idx_neg))
    launch(emu, res, xt, it2, 2, 0, 3, ot, sync=False)
    assert emu.acl.aclrtSynchronizeStream(emu.NULL) == RT_AICORE_EXCEPTION
    assert "expandedRowIdx[1] = -1" in emu.msg()


# ============================================================================ 6. executors

def _simple(emu, res, seed=41, n=4, k=2, h=3):
    rng = np.random.default_rng(seed)
    x, idx, mode, act = make_case(rng, "dropless", n=n, k=k, h=h, dtype=ACL_FLOAT)
    return (x, idx) + op_on(emu, res, x, idx, k, mode, act, ACL_FLOAT)


def test_one_shot_executor_launches_once(emu, res):
    x, idx, xt, it, ot, out_p = _simple(emu, res)
    before = emu.stats()["executors"]
    st, ws, ex = phase1(emu, xt, it, 2, 0, 0, ot)
    emu.ok(st)
    assert emu.stats()["executors"] == before + 1
    emu.ok(emu.op.aclnnMoeInitRoutingV2Grad(res.workspace(), ws, ex, emu.NULL))
    # The launch consumed it: no destroy is needed, and it cannot run again.
    assert emu.stats()["executors"] == before
    assert emu.op.aclnnMoeInitRoutingV2Grad(res.workspace(), ws, ex, emu.NULL) == ACLNN_ERR_PARAM_INVALID
    assert "aclSetAclOpExecutorRepeatable" in emu.msg()
    assert emu.nn.aclDestroyAclOpExecutor(ex) == ACLNN_ERR_INNER
    emu.ok(emu.acl.aclrtSynchronizeDevice())
    ref, mag = reference(x, idx, 2, 0, 0, np.float32)
    assert_matches(res.read(out_p, (4, 3), np.float32), ref, mag)


def test_repeatable_executor_and_rebinding(emu, res):
    x, idx, xt, it, ot, out_p = _simple(emu, res, n=4, k=2, h=3)
    before = emu.stats()["executors"]
    st, ws, ex = phase1(emu, xt, it, 2, 0, 0, ot)
    emu.ok(st)
    emu.ok(emu.nn.aclSetAclOpExecutorRepeatable(ex))
    wsp = res.workspace()

    def run_and_read(p):
        emu.ok(emu.op.aclnnMoeInitRoutingV2Grad(wsp, ws, ex, emu.NULL))
        emu.ok(emu.acl.aclrtSynchronizeStream(emu.NULL))
        return res.read(p, (4, 3), np.float32)

    ref, mag = reference(x, idx, 2, 0, 0, np.float32)
    for _ in range(3):
        assert_matches(run_and_read(out_p), ref, mag)
    assert emu.stats()["executors"] == before + 1  # still alive after three launches

    # New gradExpandedX buffer (input 0).
    x2 = (x * -2.0 + 1.0).astype(np.float32)
    emu.ok(emu.nn.aclSetInputTensorAddr(ex, 0, xt, res.dev(x2)))
    ref2, mag2 = reference(x2, idx, 2, 0, 0, np.float32)
    assert_matches(run_and_read(out_p), ref2, mag2)
    # New expandedRowIdx buffer (input 1).
    idx2 = idx[::-1].copy()
    emu.ok(emu.nn.aclSetInputTensorAddr(ex, 1, it, res.dev(idx2)))
    ref3, mag3 = reference(x2, idx2, 2, 0, 0, np.float32)
    assert not np.array_equal(ref3, ref2)
    assert_matches(run_and_read(out_p), ref3, mag3)
    # New out buffer (output 0): the old one keeps the previous result.
    out2 = res.dev(np.zeros((4, 3), np.float32))
    emu.ok(emu.nn.aclSetOutputTensorAddr(ex, 0, ot, out2))
    before_old = res.read(out_p, (4, 3), np.float32)
    emu.ok(emu.nn.aclSetInputTensorAddr(ex, 0, xt, res.dev(x)))
    ref4, mag4 = reference(x, idx2, 2, 0, 0, np.float32)
    assert_matches(run_and_read(out2), ref4, mag4)
    assert np.array_equal(res.read(out_p, (4, 3), np.float32), before_old)
    # Indices past the op's two inputs and one output are rejected.
    assert emu.nn.aclSetInputTensorAddr(ex, 2, xt, out2) == ACLNN_ERR_PARAM_INVALID
    assert emu.nn.aclSetOutputTensorAddr(ex, 1, ot, out2) == ACLNN_ERR_PARAM_INVALID
    emu.ok(emu.nn.aclDestroyAclOpExecutor(ex))
    assert emu.stats()["executors"] == before
    assert emu.op.aclnnMoeInitRoutingV2Grad(wsp, ws, ex, emu.NULL) == ACLNN_ERR_PARAM_INVALID


def test_launch_captures_addresses_bound_at_launch(emu, res):
    x, idx, xt, it, ot, out_p = _simple(emu, res, seed=43)
    s = res.stream()
    st, ws, ex = phase1(emu, xt, it, 2, 0, 0, ot)
    emu.ok(st)
    emu.ok(emu.nn.aclSetAclOpExecutorRepeatable(ex))
    emu.ok(emu.op.aclnnMoeInitRoutingV2Grad(res.workspace(), ws, ex, s))
    out2 = res.dev(np.full((4, 3), 7.0, np.float32))
    emu.ok(emu.nn.aclSetOutputTensorAddr(ex, 0, ot, out2))  # after the launch, before it ran
    emu.ok(emu.acl.aclrtSynchronizeStream(s))
    ref, mag = reference(x, idx, 2, 0, 0, np.float32)
    assert_matches(res.read(out_p, (4, 3), np.float32), ref, mag)
    assert np.all(res.read(out2, (4, 3), np.float32) == 7.0)
    emu.ok(emu.nn.aclDestroyAclOpExecutor(ex))


def test_argument_check_failures_leave_one_shot_executor_alive(emu, res):
    # nnopbase's own argument checks (null executor, null workspace, workspaceSize below the
    # first phase's figure) return before its recycling guard: the executor survives them.
    x, idx, xt, it, ot, out_p = _simple(emu, res, seed=44)
    before = emu.stats()["executors"]
    st, ws, ex = phase1(emu, xt, it, 2, 0, 0, ot)
    emu.ok(st)
    wsp = res.workspace()
    launches = emu.stats()["kernels_launched"]
    f = emu.op.aclnnMoeInitRoutingV2Grad
    assert f(wsp, ws - 1, ex, emu.NULL) == ACLNN_ERR_PARAM_INVALID
    assert "workspaceSize is 16777215" in emu.msg()
    assert f(emu.NULL, ws, ex, emu.NULL) == ACLNN_ERR_PARAM_NULLPTR
    assert f(wsp, ws, emu.NULL, emu.NULL) == ACLNN_ERR_PARAM_NULLPTR
    assert emu.stats()["kernels_launched"] == launches
    assert emu.stats()["executors"] == before + 1  # every rejection left it alive
    # A corrected launch still works with the same executor.
    emu.ok(f(wsp, ws + 4096, ex, emu.NULL))
    emu.ok(emu.acl.aclrtSynchronizeStream(emu.NULL))
    assert emu.stats()["executors"] == before
    ref, mag = reference(x, idx, 2, 0, 0, np.float32)
    assert_matches(res.read(out_p, (4, 3), np.float32), ref, mag)


LATE_FAILURES = ["small-block", "freed-block", "host-workspace", "dead-stream", "foreign-stream"]


@pytest.mark.parametrize("bad", LATE_FAILURES)
def test_launch_failing_past_argument_checks_consumes_one_shot_executor(emu, res, bad):
    # Past its argument checks nnopbase recycles a one-shot executor whatever happens next
    # (NnopbaseExecutorRunWithWorkspace's guard), so a launch that then fails consumed it.
    _, _, xt, it, ot, _ = _simple(emu, res, seed=46)
    before = emu.stats()["executors"]
    st, ws, ex = phase1(emu, xt, it, 2, 0, 0, ot)
    emu.ok(st)
    wsp, stream = res.workspace(), emu.NULL
    host = bytearray(WORKSPACE)
    if bad == "small-block":
        wsp, want = res.dev(1 << 20), ACLNN_ERR_PARAM_INVALID
    elif bad == "freed-block":
        wsp = emu.malloc(WORKSPACE)
        emu.ok(emu.acl.aclrtFree(wsp))
        want = ACLNN_ERR_PARAM_INVALID
    elif bad == "host-workspace":
        wsp, want = emu.ffi.from_buffer(host), ACLNN_ERR_PARAM_INVALID
    elif bad == "dead-stream":
        s = emu.ffi.new("aclrtStream *")
        emu.ok(emu.acl.aclrtCreateStream(s))
        emu.ok(emu.acl.aclrtDestroyStream(s[0]))
        stream, want = s[0], ACLNN_ERR_RUNTIME_ERROR
    else:
        stream, want = emu.ffi.cast("void *", 0x1234), ACLNN_ERR_RUNTIME_ERROR
    launches = emu.stats()["kernels_launched"]
    assert emu.op.aclnnMoeInitRoutingV2Grad(wsp, ws, ex, stream) == want
    assert emu.stats()["executors"] == before  # consumed, success or not
    assert emu.stats()["kernels_launched"] == launches
    assert emu.op.aclnnMoeInitRoutingV2Grad(res.workspace(), ws, ex, emu.NULL) == ACLNN_ERR_PARAM_INVALID
    assert "already consumed" in emu.msg()
    assert emu.nn.aclDestroyAclOpExecutor(ex) == ACLNN_ERR_INNER


def test_rejected_launch_then_destroy(emu, res):
    _, _, xt, it, ot, _ = _simple(emu, res, seed=45)
    before = emu.stats()["executors"]
    st, ws, ex = phase1(emu, xt, it, 2, 0, 0, ot)
    emu.ok(st)
    assert emu.op.aclnnMoeInitRoutingV2Grad(emu.NULL, ws, ex, emu.NULL) == ACLNN_ERR_PARAM_NULLPTR
    emu.ok(emu.nn.aclDestroyAclOpExecutor(ex))
    assert emu.stats()["executors"] == before
    assert emu.nn.aclDestroyAclOpExecutor(ex) == ACLNN_ERR_INNER


# ============================================================================ 7. guards

def test_corrupt_guard_detected_and_block_still_freed(emu):
    before = emu.stats()
    p = emu.malloc(100)
    q = emu.malloc(100)
    assert emu.acl.aclemuCheckGuards() == 0
    assert emu.acl.aclemuCorruptGuard(p) == 0
    assert emu.acl.aclemuCheckGuards() == 1
    assert emu.acl.aclemuCorruptGuard(emu.ffi.cast("void *", 0x1000)) == -1
    assert emu.acl.aclrtFree(p) == RT_DEVICE_MEM_ERROR
    assert "guard bytes" in emu.msg()
    after = emu.stats()
    assert after["device_allocations"] == before["device_allocations"] + 1  # only q is left
    assert after["guard_corruptions"] == before["guard_corruptions"] + 1
    assert emu.acl.aclemuCheckGuards() == 0
    assert emu.acl.aclrtFree(p) == RT_PARAM_INVALID  # it really is gone
    emu.ok(emu.acl.aclrtFree(q))


# ============================================================================ 8. counters

def test_live_counters_follow_create_and_destroy(emu):
    ffi, acl, nn = emu.ffi, emu.acl, emu.nn
    base = emu.stats()

    def delta():
        now = emu.stats()
        return {k: now[k] - base[k] for k in LIVE if k != "pending_tasks"}

    p = emu.malloc(1000)
    hp = ffi.new("void **")
    emu.ok(acl.aclrtMallocHost(hp, 300))
    s, e = ffi.new("aclrtStream *"), ffi.new("aclrtEvent *")
    emu.ok(acl.aclrtCreateStream(s))
    emu.ok(acl.aclrtCreateEvent(e))
    t = emu.tensor((2, 3), ACL_FLOAT, p)
    idx_t = emu.tensor((2,), ACL_INT32, p)
    out_t = emu.tensor((1, 3), ACL_FLOAT, p)
    val = ffi.new("float *", 1.5)
    sc = nn.aclCreateScalar(val, ACL_FLOAT)
    arr = nn.aclCreateIntArray(ffi.new("int64_t[]", [1, 2, 3]), 3)
    lst = nn.aclCreateTensorList(ffi.new("aclTensor *[]", [emu.tensor((3,), ACL_FLOAT, p)]), 1)
    assert sc != emu.NULL and arr != emu.NULL and lst != emu.NULL
    st, _, ex = phase1(emu, t, idx_t, 2, 0, 0, out_t)
    emu.ok(st)
    assert delta() == {"device_allocations": 1, "device_bytes": 1000, "host_allocations": 1,
                       "host_bytes": 300, "streams": 1, "events": 1, "tensors": 4, "scalars": 1,
                       "int_arrays": 1, "executors": 1, "tensor_lists": 1}
    emu.ok(nn.aclDestroyTensorList(lst))  # and the tensor it holds
    emu.ok(nn.aclDestroyAclOpExecutor(ex))
    emu.ok(nn.aclDestroyIntArray(arr))
    emu.ok(nn.aclDestroyScalar(sc))
    for tt in (t, idx_t, out_t):
        emu.ok(nn.aclDestroyTensor(tt))
    emu.ok(acl.aclrtDestroyEvent(e[0]))
    emu.ok(acl.aclrtDestroyStream(s[0]))
    emu.ok(acl.aclrtFreeHost(hp[0]))
    emu.ok(acl.aclrtFree(p))
    assert all(v == 0 for v in delta().values()), delta()
    # Destroying again is a stale handle, not a crash, and counts nothing.
    assert nn.aclDestroyScalar(sc) == ACLNN_ERR_PARAM_INVALID
    assert nn.aclDestroyIntArray(arr) == ACLNN_ERR_PARAM_INVALID
    assert nn.aclDestroyTensorList(lst) == ACLNN_ERR_PARAM_INVALID
    assert nn.aclDestroyTensor(t) == ACLNN_ERR_PARAM_INVALID
    assert acl.aclrtDestroyStream(s[0]) == RT_INVALID_HANDLE
    assert acl.aclrtDestroyEvent(e[0]) == RT_INVALID_HANDLE
    assert acl.aclrtFreeHost(hp[0]) == RT_PARAM_INVALID
    assert all(v == 0 for v in delta().values()), delta()


# ============================================================================ 9. fault injection

def test_inject_fault_fires_on_nth_call(emu):
    before = emu.stats()["faults_hit"]
    assert emu.acl.aclemuInjectFault(b"aclrtMalloc", 2, RT_MEMORY_ALLOCATION) == 0
    p = emu.ffi.new("void **")
    first = emu.malloc(64)
    assert emu.acl.aclrtMalloc(p, 64, 0) == RT_MEMORY_ALLOCATION
    m = emu.msg()
    assert "aclrtMalloc failed with status 207001" in m and "fault injected" in m
    third = emu.malloc(64)  # fired once, then gone
    assert emu.stats()["faults_hit"] == before + 1
    emu.ok(emu.acl.aclrtFree(first))
    emu.ok(emu.acl.aclrtFree(third))


def test_inject_fault_default_status_wildcard_and_clear(emu, shapes):
    ffi, acl = emu.ffi, emu.acl
    s = ffi.new("aclrtStream *")
    # Status 0: the API's own usual failure.
    assert acl.aclemuInjectFault(b"aclrtCreateStream", 1, 0) == 0
    assert acl.aclrtCreateStream(s) == RT_INTERNAL_ERROR
    assert "fault injected" in emu.msg()
    x, i, o = shapes((4, 2)), shapes((4,), ACL_INT32), shapes((2, 2))
    assert acl.aclemuInjectFault(b"aclnnMoeInitRoutingV2GradGetWorkspaceSize", 1, 0) == 0
    assert phase1_status(emu, x, i, 2, 0, 0, o) == ACLNN_ERR_INNER
    # "*" counts every call except releases and queries: aclrtFree does not advance it.
    assert acl.aclemuInjectFault(b"*", 2, 123) == 0
    p = emu.malloc(32)                        # call 1
    emu.ok(acl.aclrtFree(p))                  # not counted
    d = ffi.new("int32_t *")
    emu.ok(acl.aclrtGetDevice(d))             # a query: not counted
    assert acl.aclrtCreateStream(s) == 123    # call 2
    # Cleared faults never fire.
    assert acl.aclemuInjectFault(b"aclrtCreateStream", 1, 0) == 0
    assert acl.aclemuInjectFault(b"*", 1, 0) == 0
    acl.aclemuClearFaults()
    emu.ok(acl.aclrtCreateStream(s))
    emu.ok(acl.aclrtDestroyStream(s[0]))
    # Invalid requests are refused.
    assert acl.aclemuInjectFault(b"aclrtMalloc", -1, 0) == -1
    assert acl.aclemuInjectFault(b"", 1, 0) == -1


# ============================================================================ 10. threads

def test_two_threads_two_streams(emu):
    errors: list[BaseException] = []
    results: dict[int, int] = {}

    def worker(seed: int) -> None:
        acl = emu.acl
        try:
            emu.ok(acl.aclrtSetDevice(0))  # the current device is per thread
            r = Res(emu)
            try:
                rng = np.random.default_rng(seed)
                s = r.stream()
                x, idx, mode, act = make_case(rng, "dropless", n=16, k=4, h=24, dtype=ACL_FLOAT16)
                xt, it, ot, out_p = op_on(emu, r, x, idx, 4, mode, act, ACL_FLOAT16)
                ref, mag = reference(x, idx, 4, mode, act, np.float16)
                ok = 0
                for _ in range(40):
                    emu.ok(acl.aclrtMemset(out_p, 16 * 24 * 2, 0, 16 * 24 * 2))
                    launch(emu, r, xt, it, 4, mode, act, ot, stream=s)
                    assert_matches(r.read(out_p, (16, 24), np.float16), ref, mag)
                    ok += 1
                results[seed] = ok
            finally:
                r.close()
                emu.ok(acl.aclrtResetDevice(0))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert results == {1: 40, 2: 40}


# ============================================================================ 11. events

def test_synchronize_event_runs_stream_up_to_event(emu, res, lazy):
    x, idx, xt, it, ot, out_p = _simple(emu, res, seed=51)
    out2 = res.dev(np.full((4, 3), 7.0, np.float32))
    ot2 = res.tensor((4, 3), ACL_FLOAT, out2)
    s, ev = res.stream(), res.event()
    launch(emu, res, xt, it, 2, 0, 0, ot, stream=s, sync=False)
    emu.ok(emu.acl.aclrtRecordEvent(ev, s))
    launch(emu, res, xt, it, 2, 0, 0, ot2, stream=s, sync=False)
    emu.ok(emu.acl.aclrtSynchronizeEvent(ev))
    ref, mag = reference(x, idx, 2, 0, 0, np.float32)
    assert_matches(res.read(out_p, (4, 3), np.float32), ref, mag)
    assert np.all(res.read(out2, (4, 3), np.float32) == 7.0)  # after the event: not run
    emu.ok(emu.acl.aclrtSynchronizeStream(s))
    assert_matches(res.read(out2, (4, 3), np.float32), ref, mag)


def test_event_elapsed_time(emu, res, lazy):
    s = res.stream()
    a, b, never = res.event(), res.event(), res.event()
    ms = emu.ffi.new("float *", -1.0)
    emu.ok(emu.acl.aclrtRecordEvent(a, s))
    buf = res.dev(1 << 16)
    emu.ok(emu.acl.aclrtMemsetAsync(buf, 1 << 16, 1, 1 << 16, s))
    emu.ok(emu.acl.aclrtRecordEvent(b, s))
    # Recorded but not run yet: no timestamp yet, 107006.
    assert emu.acl.aclrtEventElapsedTime(ms, a, b) == RT_EVENT_TIMESTAMP_INVALID
    emu.ok(emu.acl.aclrtSynchronizeStream(s))
    emu.ok(emu.acl.aclrtEventElapsedTime(ms, a, b))
    assert ms[0] >= 0.0
    # Never recorded: RT_ERROR_EVENT_RECORDER_NULL, 507000.
    assert emu.acl.aclrtEventElapsedTime(ms, a, never) == RT_INTERNAL_ERROR
    assert "never recorded" in emu.msg()
    assert emu.acl.aclrtEventElapsedTime(ms, never, b) == RT_INTERNAL_ERROR


def test_stream_wait_event_orders_streams(emu, res, lazy):
    x, idx, xt, it, ot, out_p = _simple(emu, res, seed=52)
    s1, s2, ev = res.stream(), res.stream(), res.event()
    copy = res.dev(np.zeros((4, 3), np.float32))
    pending = emu.stats()["pending_tasks"]
    launch(emu, res, xt, it, 2, 0, 0, ot, stream=s1, sync=False)
    emu.ok(emu.acl.aclrtRecordEvent(ev, s1))
    emu.ok(emu.acl.aclrtMemsetAsync(out_p, 48, 0, 48, s1))  # after the event on s1
    emu.ok(emu.acl.aclrtStreamWaitEvent(s2, ev))
    emu.ok(emu.acl.aclrtMemcpyAsync(copy, 48, out_p, 48, D2D, s2))
    # Synchronizing s2 runs s1 up to the event (the kernel) first, and not beyond.
    emu.ok(emu.acl.aclrtSynchronizeStream(s2))
    ref, mag = reference(x, idx, 2, 0, 0, np.float32)
    assert_matches(res.read(copy, (4, 3), np.float32), ref, mag)
    assert_matches(res.read(out_p, (4, 3), np.float32), ref, mag)
    assert emu.stats()["pending_tasks"] == pending + 1  # only the memset behind the event
    emu.ok(emu.acl.aclrtSynchronizeStream(s1))
    assert np.all(res.read(out_p, (4, 3), np.float32) == 0.0)


# ============================================================================ 12. exported symbols

EXPECTED_SYMBOLS = {
    "ascendcl": """aclInit aclFinalize aclrtGetVersion aclGetRecentErrMsg aclrtGetSocName
        aclrtGetDeviceCount aclrtSetDevice aclrtGetDevice aclrtResetDevice aclrtSynchronizeDevice
        aclrtCreateStream aclrtDestroyStream aclrtSynchronizeStream aclrtSynchronizeStreamWithTimeout
        aclrtStreamWaitEvent aclrtMalloc aclrtFree aclrtMallocHost aclrtFreeHost aclrtMemcpy
        aclrtMemcpyAsync aclrtMemset aclrtMemsetAsync aclrtGetMemInfo aclrtCreateEvent
        aclrtDestroyEvent aclrtRecordEvent aclrtSynchronizeEvent aclrtEventElapsedTime
        aclrtQueryEventStatus aclrtStreamQuery aclrtSetCurrentContext aclrtGetCurrentContext""",
    "nnopbase": """aclCreateTensor aclDestroyTensor aclCreateScalar aclDestroyScalar
        aclCreateIntArray aclDestroyIntArray aclGetViewShape aclGetViewStrides aclGetViewOffset
        aclGetStorageShape aclGetDataType aclGetFormat aclSetAclOpExecutorRepeatable
        aclDestroyAclOpExecutor aclSetInputTensorAddr aclSetOutputTensorAddr aclSetRawTensorAddr
        aclGetRawTensorAddr aclCreateTensorList aclDestroyTensorList aclGetTensorListSize
        aclSetDynamicInputTensorAddr aclSetDynamicOutputTensorAddr""",
    "opapi_math": "",  # only the emulator's cross-library internals (aclemu*)
    "op": """aclnnMoeInitRoutingV2GradGetWorkspaceSize aclnnMoeInitRoutingV2Grad
        aclnnMoeInitRoutingV2GetWorkspaceSize aclnnMoeInitRoutingV2""",
}
# The runtime of 8.5 and later adds aclsysGetVersionStr (hicann/runtime v8.5.0 acl_rt.h).
SINCE_8_5 = {"ascendcl": "aclsysGetVersionStr"}


def _readelf(path: str, *flags: str) -> str:
    return subprocess.run(["readelf", *flags, path], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("release", emulator_mod.RELEASES)
def test_exported_symbols(release):
    if not shutil.which("nm"):
        pytest.skip("nm (binutils) is not installed")
    for lib, path in emulator_mod.library_paths(release):
        out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True,
                             check=True).stdout
        names = set()
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1] in "TDBR":
                names.add(parts[2].split("@")[0])
        cann = {n for n in names if not n.startswith("aclemu")}
        expected = set(EXPECTED_SYMBOLS[lib].split())
        if release not in ("8.0.0", "8.1.RC1"):
            expected |= set(SINCE_8_5.get(lib, "").split())
        assert cann == expected, (release, lib)


@pytest.mark.parametrize("release", emulator_mod.RELEASES)
def test_libraries_need_each_other_by_name_without_a_runpath(release):
    # CANN's release builds skip the RUNPATH (ops-transformer cmake/config.cmake): each library
    # names what it needs, and whoever loads it must have loaded that first (the binding does).
    if not shutil.which("readelf"):
        pytest.skip("readelf (binutils) is not installed")
    libs = dict(emulator_mod.library_paths(release))
    op = _readelf(libs["op"], "-d")
    assert "Shared library: [libnnopbase.so]" in op and "Shared library: [libascendcl.so]" in op
    assert ("Shared library: [libopapi_math.so]" in op) == ("opapi_math" in libs)
    for path in libs.values():
        dynamic = _readelf(path, "-d")
        assert "RUNPATH" not in dynamic and "RPATH" not in dynamic, path


# ============================================================================ 13. mutations

@pytest.mark.parametrize("mutation", [b"skip-last-k", b"fp16-accumulate", b"off-by-one-row"])
def test_mutations_break_the_result(emu, res, mutation):
    rng = np.random.default_rng(61)
    n, k, h = 8, 4, 16
    x, idx, mode, act = make_case(rng, "dropless", n=n, k=k, h=h, dtype=ACL_FLOAT)
    x = (1.0 + x * 1e-3).astype(np.float32)  # fine mantissa bits: fp16 partial sums lose them
    xt, it, ot, out_p = op_on(emu, res, x, idx, k, mode, act, ACL_FLOAT)
    ref, mag = reference(x, idx, k, mode, act, np.float32)
    try:
        assert emu.acl.aclemuSetMutation(mutation) == 0
        assert emu.ffi.string(emu.acl.aclemuGetMutation()) == mutation
        launch(emu, res, xt, it, k, mode, act, ot)
        bad = res.read(out_p, (n, h), np.float32)
    finally:
        emu.acl.aclemuSetMutation(b"")
    err = np.abs(bad.astype(np.float64) - ref)
    assert np.any(err > 1e-5 * mag), f"{mutation!r} gave the right answer"
    assert emu.ffi.string(emu.acl.aclemuGetMutation()) == b""
    launch(emu, res, xt, it, k, mode, act, ot)
    assert_matches(res.read(out_p, (n, h), np.float32), ref, mag)
    assert emu.acl.aclemuSetMutation(b"no-such-mutation") == -1


def child_print_mutation() -> None:
    emu = Emu()
    print(json.dumps({"m": emu.ffi.string(emu.acl.aclemuGetMutation()).decode()}))


def test_mutation_from_environment(isolated):
    r = run_fresh(isolated, child_print_mutation, env={"PYACL_MOE_EMU_MUTATION": "off-by-one-row"})
    assert r["m"] == "off-by-one-row"


# ============================================================================ 14. tensor queries

def test_tensor_descriptor_round_trip(emu):
    ffi, nn = emu.ffi, emu.nn
    data = ffi.cast("void *", 0x7000)
    t = emu.tensor((2, 3, 4), ACL_BF16, data, strides=(40, 8, 2), offset=5, storage=(100,),
                   fmt=ACL_FORMAT_NCHW)
    try:
        dims, num = ffi.new("int64_t **"), ffi.new("uint64_t *")

        def get(fn):
            emu.ok(fn(t, dims, num))
            try:
                return [dims[0][i] for i in range(num[0])]
            finally:
                emu.libc.free(dims[0])

        assert get(nn.aclGetViewShape) == [2, 3, 4]
        assert get(nn.aclGetViewStrides) == [40, 8, 2]
        assert get(nn.aclGetStorageShape) == [100]
        off = ffi.new("int64_t *")
        emu.ok(nn.aclGetViewOffset(t, off))
        assert off[0] == 5
        dt, fmt = ffi.new("aclDataType *"), ffi.new("aclFormat *")
        emu.ok(nn.aclGetDataType(t, dt))
        emu.ok(nn.aclGetFormat(t, fmt))
        assert dt[0] == ACL_BF16 and fmt[0] == ACL_FORMAT_NCHW
        addr = ffi.new("void **")
        emu.ok(nn.aclGetRawTensorAddr(t, addr))
        assert addr[0] == data
        emu.ok(nn.aclSetRawTensorAddr(t, ffi.cast("void *", 0x9000)))
        emu.ok(nn.aclGetRawTensorAddr(t, addr))
        assert int(ffi.cast("uintptr_t", addr[0])) == 0x9000
        # Bad handles are statuses, not crashes.
        assert nn.aclGetViewShape(emu.NULL, dims, num) == ACLNN_ERR_PARAM_NULLPTR
        assert nn.aclGetViewOffset(t, emu.NULL) == ACLNN_ERR_PARAM_NULLPTR
    finally:
        emu.ok(nn.aclDestroyTensor(t))
    assert nn.aclGetDataType(t, ffi.new("aclDataType *")) == ACLNN_ERR_PARAM_INVALID


def test_tensor_without_strides_is_contiguous(emu):
    ffi, nn = emu.ffi, emu.nn
    shape = ffi.new("int64_t[]", [3, 4, 5])
    t = nn.aclCreateTensor(shape, 3, ACL_FLOAT, emu.NULL, 0, ACL_FORMAT_ND, shape, 3, emu.NULL)
    assert t != emu.NULL
    try:
        dims, num = ffi.new("int64_t **"), ffi.new("uint64_t *")
        emu.ok(nn.aclGetViewStrides(t, dims, num))
        got = [dims[0][i] for i in range(num[0])]
        emu.libc.free(dims[0])
        assert got == [20, 5, 1]
    finally:
        emu.ok(nn.aclDestroyTensor(t))
    # A negative offset is refused.
    assert nn.aclCreateTensor(shape, 3, ACL_FLOAT, emu.NULL, -1, ACL_FORMAT_ND, shape, 3,
                              emu.NULL) == emu.NULL
    assert "negative" in emu.msg()
