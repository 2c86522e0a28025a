"""Shared fixtures.

Every test runs against the bundled emulator, through the real C ABI, unless
PYACL_MOE_TEST_BACKEND=cann selects an installed CANN; tests marked ``cann`` run only then.

``emu`` gives direct cffi access to the three emulated libraries, declared from headers/ by a
separate FFI object, not through the binding. The libraries are the same loaded objects the
binding uses, so direct tests work in deltas: they open their own device reference, and check
that the counters come back to where they started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

import pyacl_moe

from .emu_raw import Emu

ROOT = Path(__file__).resolve().parent.parent
# The suite starts a few hundred fresh interpreters (children, the CLI, the README's snippets,
# the examples). Under PYTHONDONTWRITEBYTECODE each of them compiles every module of the
# package from source again (about 0.2 s of CPU apiece); the bytecode cache (in __pycache__/,
# ignored by git) lets them load it. Read here, before pytest-xdist starts its workers, so
# they and every child inherit it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
BACKEND = os.environ.get("PYACL_MOE_TEST_BACKEND", "emulator")
# What changes the binding's or the emulated CANN's behaviour is the suite's to set, test by
# test: a caller's exported PYACL_MOE_EMU_RELEASE=8.1.RC1 (a user checking that release) must
# not turn the suite's expectations. Dropped here, before pytest-xdist starts its workers, so
# they and every child start without them; not in a child (tests/child.py), whose environment
# is its test's. (Kept: the test backend, the sanitizer build, the build cache and timeout, the
# iteration counts of the long tests.)
BEHAVIOUR = ("PYACL_MOE_EMULATOR", "PYACL_MOE_CACHE_ALLOCATIONS", "PYACL_MOE_EMU_RELEASE", "PYACL_MOE_EMU_SOC",
             "PYACL_MOE_EMU_MEMORY", "PYACL_MOE_EMU_DEVICES", "PYACL_MOE_EMU_MUTATION", "PYACL_MOE_EMU_STREAMS",
             "PYACL_MOE_EMU_THREADS", "PYACL_MOE_EMU_QUEUE_DEPTH", "ASCEND_RT_VISIBLE_DEVICES")
if getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None) != "tests.child":
    for _name in BEHAVIOUR + (("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME") if BACKEND == "emulator" else ()):
        os.environ.pop(_name, None)

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
    leaked = {k: (before[k], after[k]) for k in LIVE if before[k] != after[k]}
    assert not leaked, f"objects left behind (before, after): {leaked}"


def child_command(fn: Callable[..., object], *args: object) -> list[str]:
    """The command that runs ``fn(*args)`` in a fresh interpreter: ``python -m tests.child
    MODULE:FUNCTION JSON`` (tests/child.py). ``fn`` is a module-level function of a module of
    tests/ (by convention named ``child_<what>``); ``args`` pass through JSON, so tuples arrive
    as lists. The child imports ``fn``'s module first: its top-level imports run there."""
    module, name = fn.__module__, fn.__qualname__
    if not module.startswith("tests.") or not name.isidentifier():
        raise ValueError(f"{module}:{name} is not a module-level function of a module of tests/")
    return [sys.executable, "-m", "tests.child", f"{module}:{name}", json.dumps(list(args))]


def _child_env(env: Mapping[str, str | None] | None) -> dict[str, str]:
    full = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    return full


def run_isolated(fn: Callable[..., object], *args: object, env: Mapping[str, str | None] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``fn(*args)`` in a fresh interpreter (for process-wide state: aclInit, environment,
    fork, exit) and wait for it: the finished process, its output as text. It runs from the
    repository's root, so it imports this checkout's pyacl_moe and tests; ``env`` is added to
    this process's environment (a None value removes the variable)."""
    full = _child_env(env)
    full.setdefault("PYTHONFAULTHANDLER", "1")  # a hung child, sent SIGABRT, prints its threads' stacks
    with subprocess.Popen(child_command(fn, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=full, cwd=str(ROOT)) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise AssertionError(f"{fn.__name__} hung for {timeout:g} s; its threads:\n{err[-20000:]}\n{out[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start_isolated(fn: Callable[..., object], *args: object,
                   env: Mapping[str, str | None] | None = None) -> subprocess.Popen[str]:
    """run_isolated without the wait, for children that run side by side: the started process,
    its output piped as text."""
    return subprocess.Popen(child_command(fn, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_child_env(env), cwd=str(ROOT))


@pytest.fixture
def isolated():
    """run_isolated, for tests of the emulator backend only."""
    _needs_emulator()
    return run_isolated


@pytest.fixture(autouse=True)
def _no_fault_outlives_a_test():
    """A device fault is sticky until Device.reset(): a test that faults a device leaves it
    faulted, and the next test gets it reset (its objects are dead by then anyway)."""
    yield
    if pyacl_moe.loaded_info() is not None:
        for dev in pyacl_moe.device.open_devices():
            if dev.fault is not None:
                dev.reset()


@pytest.fixture
def device():
    """The binding's device 0."""
    return pyacl_moe.Device(0)


# The emulator's counters of live objects: what a test that creates and drops objects must leave
# as it found it (the one definition, used by every leak check).
LIVE = ("device_allocations", "device_bytes", "host_allocations", "host_bytes", "streams", "events", "tensors",
        "scalars", "int_arrays", "executors", "pending_tasks", "tensor_lists")


def settle() -> dict[str, int]:
    """Let everything finish and go (collect, synchronize, empty the caches), then the live
    counters."""
    import gc

    gc.collect()
    for dev in pyacl_moe.device.open_devices():
        dev.synchronize()
    pyacl_moe.empty_cache()
    st = pyacl_moe.emulator.stats()
    return {k: st[k] for k in LIVE}


@pytest.fixture
def no_leaks():
    """Fails the test if binding-created emulator objects outlive it (after GC)."""
    _needs_emulator()
    before = settle()  # work queued by earlier tests is not this test's
    yield
    after = settle()
    leaked = {k: (before[k], after[k]) for k in LIVE if before[k] != after[k]}
    assert not leaked, f"objects left behind (before, after): {leaked}"


@pytest.fixture
def lazy_streams():
    """The emulator in lazy mode for the test: queued work runs only when waited for."""
    _needs_emulator()
    pyacl_moe.emulator.set_stream_mode("lazy")
    yield
    dev = pyacl_moe.Device(0)
    if dev.fault is not None:
        dev.reset()
    dev.synchronize()
    pyacl_moe.emulator.set_stream_mode("async")


@pytest.fixture(scope="session", autouse=True)
def guards_intact():
    """After the whole run (of each worker process), no live device allocation may have
    corrupt guard bytes: something wrote past the end of a block."""
    yield
    if BACKEND != "emulator" or pyacl_moe.loaded_info() is None:
        return
    corrupt = pyacl_moe.emulator.check_guards()
    assert corrupt == 0, f"emulator: {corrupt} live device allocation(s) with corrupt guard bytes after the run"


@pytest.fixture
def uncached():
    """Blocks of dropped DeviceArrays freed as soon as they are idle (no array cache), for
    tests that watch when memory goes back to CANN."""
    pyacl_moe.set_caching(False)
    yield
    pyacl_moe.set_caching(True)


def default_capacity(devices: int = 1) -> int:
    """An emulated device's memory when PYACL_MOE_EMU_MEMORY is not set and the process has no
    address-space limit: 32 GiB, or half the host's physical memory shared by the devices, in
    whole MiB, if that is less (docs/emulator.md, *Memory*)."""
    half = os.sysconf("SC_PHYS_PAGES") // 2 * os.sysconf("SC_PAGE_SIZE") // devices
    return min(32 << 30, max(1 << 20, half & ~((1 << 20) - 1)))


def forward_inputs(seed: int = 0, n: int = 8, k: int = 2, h: int = 4, experts: int = 4):
    """The forward's inputs: x [n, h] float32 and each token's top-k of ``experts`` experts."""
    import numpy as np

    x = np.random.default_rng(seed).standard_normal((n, h)).astype(np.float32)
    return x, pyacl_moe.routing.random_top_k(n, k, experts, seed=seed)


@pytest.fixture
def clean_emulator():
    """No mutation or injected fault outlives the test."""
    yield
    pyacl_moe.emulator.set_mutation(None)
    pyacl_moe.emulator.clear_faults()


@pytest.fixture
def main(device, capsys):
    """pyacl_moe.cli.main in this process: (exit status, stdout, stderr)."""
    from pyacl_moe import cli

    def call(*args: str) -> tuple[int, str, str]:
        code = cli.main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    call.readouterr = capsys.readouterr  # type: ignore[attr-defined]  # after a SystemExit
    yield call
    pyacl_moe.emulator.set_mutation(None)
