"""Shared fixtures.

Every test runs against the bundled emulator, through the real C ABI, unless
PYACL_MOE_TEST_BACKEND=cann selects an installed CANN; tests marked ``cann`` run only then.

``emu`` gives direct cffi access to the three emulated libraries, declared from headers/ by a
separate FFI object, not through the binding. The libraries are the same loaded objects the
binding uses, so direct tests work in deltas: they open their own device reference, and check
that the counters come back to where they started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import cffi
import pytest

import pyacl_moe
from pyacl_moe import _paths
from pyacl_moe import emulator as emulator_mod

ROOT = Path(__file__).resolve().parent.parent
BACKEND = os.environ.get("PYACL_MOE_TEST_BACKEND", "emulator")

if BACKEND == "emulator":
    pyacl_moe.use_emulator()


def pytest_collection_modifyitems(config, items):
    if BACKEND == "cann":
        return
    skip = pytest.mark.skip(reason="needs a real CANN and an Ascend device (set PYACL_MOE_TEST_BACKEND=cann)")
    for item in items:
        if "cann" in item.keywords:
            item.add_marker(skip)


def _needs_emulator():
    if BACKEND != "emulator":
        pytest.skip("emulator-only test")


class Emu:
    """Direct cffi access to the emulated libraries."""

    SUCCESS = 0

    def __init__(self) -> None:
        self.home = emulator_mod.build()
        self.ffi = cffi.FFI()
        for name in _paths.HEADER_FILES:
            self.ffi.cdef((_paths.headers_dir() / name).read_text())
        self.ffi.cdef((ROOT / "pyacl_moe" / "emulator" / "src" / "aclemu.h").read_text())
        self.ffi.cdef("void free(void *);")
        lib64 = Path(self.home) / "lib64"
        self.acl = self.ffi.dlopen(str(lib64 / "libascendcl.so"))
        self.nn = self.ffi.dlopen(str(lib64 / "libnnopbase.so"))
        self.op = self.ffi.dlopen(str(lib64 / "libopapi.so"))
        self.libc = self.ffi.dlopen(None)
        self.NULL = self.ffi.NULL

    # -- conveniences

    def msg(self) -> str:
        p = self.acl.aclGetRecentErrMsg()
        return self.ffi.string(p).decode() if p != self.NULL else ""

    def ok(self, status: int) -> None:
        assert status == 0, f"status {status}: {self.msg()}"

    def stats(self) -> dict[str, int]:
        s = self.ffi.new("aclemuStats *")
        self.acl.aclemuGetStats(s)
        return {n: int(getattr(s, n)) for n, _ in self.ffi.typeof("aclemuStats").fields}

    def malloc(self, size: int) -> object:
        p = self.ffi.new("void **")
        self.ok(self.acl.aclrtMalloc(p, size, 0))
        return p[0]

    def h2d(self, dev: object, data: bytes | bytearray | memoryview) -> None:
        buf = self.ffi.from_buffer(data)
        self.ok(self.acl.aclrtMemcpy(dev, len(buf), buf, len(buf), 1))

    def d2h(self, dev: object, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        cbuf = self.ffi.from_buffer(buf)
        self.ok(self.acl.aclrtMemcpy(cbuf, nbytes, dev, nbytes, 2))
        return bytes(buf)

    def tensor(self, shape, dtype: int, dev: object, strides=None, offset: int = 0, storage=None, fmt: int = 2):
        shape = list(shape)
        if strides is None:
            strides, acc = [], 1
            for n in reversed(shape):
                strides.insert(0, acc)
                acc *= n
        storage = list(storage) if storage is not None else shape
        t = self.nn.aclCreateTensor(
            self.ffi.new("int64_t[]", shape or [0]), len(shape), dtype,
            self.ffi.new("int64_t[]", list(strides) or [0]), offset, fmt,
            self.ffi.new("int64_t[]", storage or [0]), len(storage), dev,
        )
        assert t != self.NULL, self.msg()
        return t


@pytest.fixture(scope="session")
def _emu_session() -> Emu:
    return Emu()


@pytest.fixture
def emu(_emu_session: Emu):
    """Direct access with a device reference of its own (device 0 current on this thread);
    fails the test if it leaves any object behind."""
    _needs_emulator()
    e = _emu_session
    st = e.acl.aclInit(e.NULL)
    assert st in (0, 100002)
    e.msg()
    e.ok(e.acl.aclrtSetDevice(0))
    before = e.stats()
    yield e
    e.acl.aclemuClearFaults()
    e.acl.aclemuSetMutation(b"")
    e.acl.aclrtSynchronizeDevice()  # run whatever the test left queued; drop a pending fault
    e.msg()
    after = e.stats()
    e.ok(e.acl.aclrtResetDevice(0))
    live = ("device_allocations", "device_bytes", "host_allocations", "host_bytes", "streams", "events",
            "tensors", "scalars", "int_arrays", "executors", "pending_tasks")
    leaked = {k: (before[k], after[k]) for k in live if before[k] != after[k]}
    assert not leaked, f"objects left behind (before, after): {leaked}"


def run_isolated(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run Python code in a fresh interpreter (for process-wide state: aclInit, environment)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=str(ROOT),
    )


@pytest.fixture
def isolated():
    _needs_emulator()
    return run_isolated


@pytest.fixture
def device():
    """The binding's device 0."""
    return pyacl_moe.Device(0)


@pytest.fixture
def no_leaks():
    """Fails the test if binding-created emulator objects outlive it (after GC)."""
    _needs_emulator()
    import gc

    gc.collect()
    pyacl_moe.Device(0).synchronize()  # work queued by earlier tests is not this test's
    pyacl_moe.empty_cache()  # pooled workspaces are cached on purpose, not leaked
    before = pyacl_moe.emulator.stats()
    yield
    gc.collect()
    pyacl_moe.Device(0).synchronize()
    pyacl_moe.empty_cache()
    after = pyacl_moe.emulator.stats()
    live = ("device_allocations", "device_bytes", "streams", "events", "tensors", "executors", "pending_tasks")
    leaked = {k: (before[k], after[k]) for k in live if before[k] != after[k]}
    assert not leaked, f"objects left behind (before, after): {leaked}"


def pytest_sessionfinish(session, exitstatus):
    """After the whole run, no live device allocation may have corrupt guard bytes."""
    if BACKEND != "emulator" or pyacl_moe.loaded_info() is None:
        return
    corrupt = pyacl_moe.emulator.check_guards()
    if corrupt:
        session.config.get_terminal_writer().line(
            f"emulator: {corrupt} live device allocation(s) with corrupt guard bytes after the run", red=True
        )
        session.exitstatus = 1
