"""One regression test per defect of the lifetimes-and-threads review (defects 1 to 13), each
written against the public API so that it also runs, and fails, on the code the defects were
found in; then the same for the forward's review (defects 14 to 20), with the forward's
interrupt and fork soaks (21, 22). Stress tests of each shared object, run longer, are in
test_threads.py."""

from __future__ import annotations

import _thread
import atexit
import gc
import os
import random
import signal
import sys
import threading
import time
from contextlib import closing

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe.tools.cases import make_case

from .conftest import LIVE, settle
from .emu_raw import Emu
from .stress import ITERATIONS, Progress, hammer

# Older code has no ClosedError: a class nothing raises makes the test fail there.
ClosedError = getattr(pm, "ClosedError", type("NeverRaised", (Exception,), {}))


def _lazy(on: bool) -> None:
    if hasattr(pm.emulator, "set_stream_mode"):
        pm.emulator.set_stream_mode("lazy" if on else "async")


@pytest.fixture
def lazy():
    _lazy(True)
    yield
    pm.Device(0).synchronize()
    _lazy(False)


# ------------------------------------------------------------------------------------------- 1

@pytest.mark.parametrize("mode", ["async", "lazy"])
def test_01_synchronize_on_one_thread_never_frees_what_another_thread_queued(device, mode):
    """Synchronizing a stream dropped everything kept alive, including what another thread
    queued during the wait: the NumPy path then copied a freed host temporary."""
    _lazy(mode == "lazy")
    try:
        # Each caller its own data: memory freed under one caller's queued copy and reused by
        # the other's shows as the other's values.
        cases = [make_case(64, 4, 256, "float32", "dropless", seed=11 + i) for i in range(2)]
        xs = [np.asfortranarray(c.grad_expanded_x) for c in cases]  # the NumPy path copies them to a temporary
        expected = [pm.moe_init_routing_v2_grad(c.grad_expanded_x, c.expanded_row_idx, 4) for c in cases]
        wrong = []

        calls = Progress()

        def caller(i, steps):
            for _ in calls.steps(steps):
                got = pm.moe_init_routing_v2_grad(xs[i], cases[i].expanded_row_idx, 4)
                if not np.array_equal(got, expected[i]):
                    wrong.append(1)

        def syncer(i, steps):
            while calls.running:
                device.default_stream.synchronize()

        errors = hammer([calls.counted(caller), calls.counted(caller), syncer, syncer], 4 * ITERATIONS)
        assert not errors, errors[0]
        assert not wrong, f"{len(wrong)} wrong results"
    finally:
        _lazy(False)


# ------------------------------------------------------------------------------------------- 2

def test_02_empty_cache_never_frees_a_workspace_a_queued_kernel_uses(device):
    case = make_case(64, 4, 128, "float32", "dropless", seed=12)
    expected = pm.moe_init_routing_v2_grad(*case.args())  # the kernel is deterministic: bit-exact

    launches = Progress()

    def launcher(i, steps):
        with closing(pm.Stream(device)) as s:
            x, idx = pm.to_device(case.grad_expanded_x, stream=s), pm.to_device(case.expanded_row_idx, stream=s)
            for _ in launches.steps(steps):
                outs = [pm.moe_init_routing_v2_grad(x, idx, 4, stream=s) for _ in range(4)]
                for o in outs:
                    assert np.array_equal(o.to_host(s), expected)

    def emptier(i, steps):
        while launches.running:
            pm.empty_cache()

    faults = pm.emulator.stats()["device_faults"]
    errors = hammer([launches.counted(launcher), launches.counted(launcher), emptier], 4 * ITERATIONS)
    assert not errors, errors[0]
    assert pm.emulator.stats()["device_faults"] == faults


# ------------------------------------------------------------------------------------------- 3

def child_close_a_plan_while_threads_launch_it() -> None:
    pm.use_emulator()
    dev = pm.Device(0)
    closed = getattr(pm, "ClosedError", pm.InvalidArgument)
    s = pm.Stream(dev)
    x = pm.to_device(np.ones((8, 4), np.float32), stream=s)
    idx = pm.to_device(np.arange(8, dtype=np.int32), stream=s)
    unexpected = []
    for _ in range(200):
        _close_while_launched(pm.MoeInitRoutingV2Grad(x, idx, 2), s, closed, unexpected)
    s.synchronize()
    print("unexpected", unexpected[:3])
    assert not unexpected
    print("ok")


def _close_while_launched(plan, s, closed, unexpected: list) -> None:
    """Three threads launch ``plan`` on ``s`` until it is closed, 1 ms in."""
    plan(s)
    stop = threading.Event()

    def launch():
        while not stop.is_set():
            try:
                plan(s)
            except (closed, pm.InvalidArgument):
                return
            except BaseException as e:
                unexpected.append(repr(e))
                return

    ts = [threading.Thread(target=launch) for _ in range(3)]
    for t in ts:
        t.start()
    time.sleep(0.001)
    plan.close()
    stop.set()
    for t in ts:
        t.join()


def test_03_closing_a_plan_while_another_thread_launches_it_is_safe(isolated):
    r = isolated(child_close_a_plan_while_threads_launch_it, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok")


# ------------------------------------------------------------------------------------------- 4

def test_04_the_executor_cache_never_destroys_an_executor_in_use(device):
    # More layouts than a stream's cache holds.
    cases = [make_case(8, 2, 8 + 4 * i, "float32", "dropless", seed=i) for i in range(12)]
    arrays = [(pm.to_device(c.grad_expanded_x), pm.to_device(c.expanded_row_idx),
               pm.moe_init_routing_v2_grad(*c.args())) for c in cases]

    def worker(w, steps):
        for i in range(steps):
            x, idx, expected = arrays[i % len(arrays)]
            assert np.array_equal(pm.moe_init_routing_v2_grad(x, idx, 2).to_host(), expected)

    errors = hammer([worker] * 6, 4 * ITERATIONS)
    assert not errors, errors[0]


# ------------------------------------------------------------------------------------------- 5

def test_05_the_pool_keeps_count_of_every_block_under_threads(device):
    settle()
    shared = pm.Stream(device)
    # One layout per thread: each has an executor of its own, and they all take and give back
    # workspace on the one stream at the same time.
    cases = [make_case(16, 2, 16 + 8 * i, "float32", "dropless", seed=i) for i in range(6)]
    arrays = [(pm.to_device(c.grad_expanded_x, stream=shared), pm.to_device(c.expanded_row_idx, stream=shared),
               pm.empty((16, c.grad_expanded_x.shape[1]), np.float32)) for c in cases]

    def worker(i, steps):
        x, idx, out = arrays[i]
        for _ in range(steps):
            pm.moe_init_routing_v2_grad(x, idx, 2, out=out, stream=shared)

    errors = hammer([worker] * 6, 4 * ITERATIONS)
    shared.close()
    arrays.clear()
    assert not errors, errors[0]
    settle()
    assert pm.memory_stats()["bytes_held"] == 0
    assert pm.memory_stats()["blocks_in_use"] == 0


# ------------------------------------------------------------------------------------------- 6

def test_06_a_plan_never_launches_on_a_closed_stream(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=6)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    expected = pm.moe_init_routing_v2_grad(*case.args())
    with pm.MoeInitRoutingV2Grad(x, idx, 2) as plan:
        s1 = pm.Stream(device)
        plan(s1)
        s1.close()
        with closing(pm.Stream(device)) as s2:
            launched = pm.emulator.stats()["kernels_launched"]
            with pytest.raises(ClosedError):
                plan(s1)
            assert pm.emulator.stats()["kernels_launched"] == launched  # nothing landed on s2
            plan(s2)
            assert np.array_equal(plan.out.to_host(s2), expected)


# ------------------------------------------------------------------------------------------- 7

def test_07_an_asynchronous_call_never_blocks_and_a_fault_keeps_its_own_error(device, lazy):
    case = make_case(8, 2, 16, "float32", "dropless", seed=7)
    with closing(pm.Stream(device)) as s:
        x, idx = pm.to_device(case.grad_expanded_x, stream=s), pm.to_device(case.expanded_row_idx, stream=s)
        bad = pm.to_device(np.full(16, 99, np.int32), stream=s)
        pm.moe_init_routing_v2_grad(x, bad, 2, stream=s, validate=False)  # faults when it runs
        ran = pm.emulator.stats()["kernels_run"]
        for _ in range(5000):  # past any keep-alive limit
            pm.moe_init_routing_v2_grad(x, idx, 2, stream=s)
        assert pm.emulator.stats()["kernels_run"] == ran, "an asynchronous call waited for the stream"
        with pytest.raises(pm.AclRuntimeError) as info:
            s.synchronize()
        assert info.value.status == 507015
        s.synchronize()


# ------------------------------------------------------------------------------------------- 8

class Interrupter:
    """A thread that interrupts the main thread every 0.2 to 3 ms until stopped. The interrupts
    land only while ``armed`` is true (the handler runs on the main thread and reads the flag
    there), so none escapes the soak's own bookkeeping around the loop body."""

    def __init__(self, seed: int) -> None:
        self.armed = False
        self._stop = threading.Event()
        signal.signal(signal.SIGINT, self._on_sigint)
        self._thread = threading.Thread(target=self._interrupt, args=(seed,), daemon=True)
        self._thread.start()

    def _interrupt(self, seed: int) -> None:
        rnd = random.Random(seed)
        while not self._stop.is_set():
            time.sleep(rnd.uniform(0.0002, 0.003))
            _thread.interrupt_main()

    def _on_sigint(self, signum, frame) -> None:
        if self.armed:
            raise KeyboardInterrupt

    def stop(self) -> None:
        """Stop the interrupter and let its last interrupt land outside the cleanup."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._thread.join(0.1)
            except KeyboardInterrupt:
                pass
        for _ in range(3):
            try:
                time.sleep(0.02)
            except KeyboardInterrupt:
                pass


def _interrupt_soak(seed: int, iterations: int, attempt, switch_interval: float | None = None) -> int:
    """Run ``attempt()`` ``iterations`` times, interrupted at random (Interrupter), the
    interpreter switching threads every ``switch_interval`` seconds if given: how many attempts
    were interrupted. Nothing an attempt made outlives it but what it leaks."""
    interrupter = Interrupter(seed)
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    interrupts = 0
    for _ in range(iterations):
        try:
            interrupter.armed = True
            attempt()
            interrupter.armed = False
        except KeyboardInterrupt:
            interrupter.armed = False
            interrupts += 1
    interrupter.stop()
    return interrupts


def _soak_verdict(dev, before: dict, interrupts: int, wrong, min_interrupts: int) -> None:
    """After an interrupt soak begun at ``before``: let everything finish, then require that it
    was interrupted more than ``min_interrupts`` times, that every result that completed was
    right, and that no live object, device fault or corrupt guard is left."""
    faults = before["device_faults"]
    gc.collect()
    dev.synchronize()
    pm.empty_cache()
    after = pm.emulator.stats()
    leaked = {k: (before[k], after[k]) for k in LIVE if before[k] != after[k]}
    print("interrupts", interrupts, "wrong", wrong, "leaked", leaked, "faults", after["device_faults"] - faults,
          "guards", pm.emulator.check_guards())
    assert interrupts > min_interrupts, interrupts
    assert not wrong and not leaked and after["device_faults"] == faults and pm.emulator.check_guards() == 0
    print("ok")


def wait_child(pid: int, seconds: float) -> int | None:
    """A fork() child's exit code, or None when it had to be killed after ``seconds`` (it hung)."""
    deadline = time.time() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.time() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.005)


def child_keyboard_interrupt_anywhere(iterations: int) -> None:
    pm.use_emulator()
    dev = pm.Device(0)
    x = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    idx = np.random.default_rng(1).permutation(64).astype(np.int32)
    expected = pm.moe_init_routing_v2_grad(x, idx, 4)  # the kernel is deterministic: bit-exact
    dev.synchronize()
    pm.empty_cache()
    before = pm.emulator.stats()
    wrong = 0

    def attempt():
        nonlocal wrong
        got = pm.moe_init_routing_v2_grad(x, idx, 4)
        if not np.array_equal(got, expected):
            wrong += 1
        with closing(pm.Stream(dev)) as s:
            dx = pm.to_device(x, stream=s)
            di = pm.to_device(idx, stream=s)
            ev = pm.Event(dev)
            ev.record(s)
            with pm.MoeInitRoutingV2Grad(dx, di, 4) as plan:
                plan(s)
                plan(s)
            out = pm.moe_init_routing_v2_grad(dx, di, 4, stream=s)
            t_ = pm.AclTensor(out)
            if not np.array_equal(out.to_host(s), expected):
                wrong += 1
            ev.close()
            t_.close()

    interrupts = _interrupt_soak(3, iterations, attempt)
    _soak_verdict(dev, before, interrupts, wrong, 100)


def test_08_keyboard_interrupt_anywhere_leaks_nothing_and_frees_nothing_early(isolated):
    r = isolated(child_keyboard_interrupt_anywhere, 2000, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout
    print(r.stdout)


# ------------------------------------------------------------------------------------------- 9

def child_device_close_and_exit_wait_for_the_default_stream():
    emu = Emu()

    def check_at_exit():  # registered after pyacl_moe's exit hook (imported with tests/emu_raw.py)
        print("faults at exit", emu.stats()["device_faults"])

    atexit.register(check_at_exit)
    pm.use_emulator()
    if hasattr(pm.emulator, "set_stream_mode"):
        pm.emulator.set_stream_mode("lazy")
    dev = pm.Device(0)
    for _ in range(3):
        x = pm.to_device(np.ones((64, 8), np.float32), stream=dev.default_stream)
        idx = pm.to_device(np.arange(64, dtype=np.int32), stream=dev.default_stream)
        out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=dev.default_stream)
        del x, idx
    dev.close()
    print("faults after close", pm.emulator.stats()["device_faults"])
    dev = pm.Device(0)
    x = pm.to_device(np.ones((64, 8), np.float32), stream=dev.default_stream)
    idx = pm.to_device(np.arange(64, dtype=np.int32), stream=dev.default_stream)
    out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=dev.default_stream)
    del x, idx  # exit with the work still queued
    return [dev, out]  # (tests/child.py keeps them alive until exit)


def test_09_device_close_and_exit_wait_for_the_default_stream(isolated):
    r = isolated(child_device_close_and_exit_wait_for_the_default_stream)
    assert r.returncode == 0, r.stderr
    assert "faults after close 0" in r.stdout, r.stdout + r.stderr
    assert "faults at exit 0" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------ 10

def test_10_a_dropped_stream_is_released_without_any_synchronize(device):
    settle()
    streams = pm.emulator.stats()["streams"]
    case = make_case(64, 4, 64, "float32", "dropless", seed=10)
    s = pm.Stream(device)
    x, idx = pm.to_device(case.grad_expanded_x, stream=s), pm.to_device(case.expanded_row_idx, stream=s)
    pm.moe_init_routing_v2_grad(x, idx, 4, stream=s)
    del s, x, idx
    # No synchronize: the stream goes once its work has run, at a later call into pyacl_moe.
    deadline = time.time() + 5
    while pm.emulator.stats()["streams"] != streams and time.time() < deadline:
        time.sleep(0.01)
    assert pm.emulator.stats()["streams"] == streams


def child_switch_devices() -> None:
    pm.use_emulator()
    d0, d1 = pm.Device(0), pm.Device(1)
    base = pm.emulator.stats()["devices_set"]
    for _ in range(2000):  # a reference per switch would show at once
        d0.set_current()
        d1.set_current()
    print(base, pm.emulator.stats()["devices_set"])


def test_10_switching_devices_does_not_grow_aclrtsetdevice_references(isolated):
    r = isolated(child_switch_devices, env={"PYACL_MOE_EMU_DEVICES": "2"})
    assert r.returncode == 0, r.stderr
    base, after = r.stdout.split()
    assert base == after == "2"


# ------------------------------------------------------------------------------------------ 11

def child_fork_while_another_thread_is_inside() -> None:
    pm.use_emulator()
    closed = getattr(pm, "ClosedError", None)
    dev = pm.Device(0)
    s = pm.Stream(dev)
    x = np.ones((256, 64), np.float32)
    idx = np.arange(256, dtype=np.int32)
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            pm.moe_init_routing_v2_grad(x, idx, 4)
            with closing(pm.Stream(dev)) as t:
                pm.to_device(x, stream=t).to_host(t)
            pm.empty_cache()

    ts = [threading.Thread(target=busy) for _ in range(2)]
    for t in ts:
        t.start()
    hung = bad = 0
    for _ in range(30):
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                s.synchronize()
            except Exception as e:
                code = 0 if closed is not None and isinstance(e, closed) else 4
            if code == 0:
                try:
                    pm.Device(0)
                    code = 5
                except Exception as e:
                    code = 0 if isinstance(e, closed) else 6
            os._exit(code)
        code = wait_child(pid, 10)
        if code is None:
            hung += 1
        elif code != 0:
            bad += 1
    stop.set()
    for t in ts:
        t.join()
    print("hung", hung, "bad", bad)
    assert hung == 0 and bad == 0
    print("ok")


def test_11_fork_while_another_thread_is_inside_never_hangs_the_child(isolated):
    r = isolated(child_fork_while_another_thread_is_inside, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout


# ------------------------------------------------------------------------------------------ 12

def test_12_an_out_overlapping_an_input_is_refused(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=12)
    expected = pm.moe_init_routing_v2_grad(*case.args())
    both = pm.to_device(np.concatenate([case.grad_expanded_x, np.zeros((8, 16), np.float32)]))
    x, idx = both[:16], pm.to_device(case.expanded_row_idx)
    with pytest.raises(pm.InvalidArgument, match="out"):
        pm.moe_init_routing_v2_grad(x, idx, 2, out=both[8:16])  # overlaps x's last 8 rows
    with pytest.raises(pm.InvalidArgument, match="out"):
        pm.MoeInitRoutingV2Grad(x, idx, 2, out=both[8:16])
    # Disjoint views of the same memory are fine.
    out = both[16:]
    pm.moe_init_routing_v2_grad(x, idx, 2, out=out)
    assert np.array_equal(out.to_host(), expected)
    with pm.MoeInitRoutingV2Grad(x, idx, 2, out=out) as plan:
        with pytest.raises(pm.InvalidArgument, match="out"):
            plan.rebind(out=both[0:8])


def test_12_a_host_write_waits_for_queued_work_that_reads_the_array(device, lazy):
    case = make_case(8, 2, 16, "float32", "dropless", seed=13)
    expected = pm.moe_init_routing_v2_grad(*case.args())
    with closing(pm.Stream(device)) as s:
        x, idx = pm.to_device(case.grad_expanded_x, stream=s), pm.to_device(case.expanded_row_idx, stream=s)
        out = pm.moe_init_routing_v2_grad(x, idx, 2, stream=s)  # queued: reads x when it runs
        x.copy_from_host(np.zeros_like(case.grad_expanded_x))  # must not overtake the kernel
        assert np.array_equal(out.to_host(s), expected)
        with closing(pm.Stream(device)) as t:
            out2 = pm.moe_init_routing_v2_grad(x, idx, 2, stream=s)
            x.copy_from_host(case.grad_expanded_x, stream=t)  # on another stream: ordered by an event
            assert np.array_equal(out2.to_host(s), np.zeros_like(expected))
            t.synchronize()
        assert np.array_equal(x.to_host(), case.grad_expanded_x)


# ------------------------------------------------------------------------------------------ 13

def test_13_wrong_types_and_out_of_range_integers_are_refused_by_name(device, no_leaks):
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
        with pytest.raises(ClosedError):
            use()


# =============================================================================================
# The forward's review (defects 14 to 20, soaks 21 and 22): the forward's one call, its plan
# and pm.routing under interrupts, threads and fork, through the op layer it shares with the
# backward. An interrupt that lands as a foreign call returns (where most land: see test_21)
# is made by a wrapper that makes the call, then raises KeyboardInterrupt, as the handler of
# a SIGINT arriving then would.

def _forward_inputs(seed: int = 0, n: int = 8, k: int = 2, h: int = 4, experts: int = 4):
    x = np.random.default_rng(seed).standard_normal((n, h)).astype(np.float32)
    return x, pm.routing.random_top_k(n, k, experts, seed=seed)


def _interrupt_after(monkeypatch, module, name: str, times: int = 1) -> None:
    """``module.name`` makes its call, then raises KeyboardInterrupt (``times`` times)."""
    real = getattr(module, name)
    left = [times]

    def then_interrupted(*args, **kwargs):
        result = real(*args, **kwargs)
        if left[0]:
            left[0] -= 1
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(module, name, then_interrupted)


# ------------------------------------------------------------------------------------------ 14

def test_14_an_interrupted_rebind_of_a_streams_cached_executor_is_redone_in_full(device, monkeypatch):
    """The one call rebinds the stream's cached executor tensor by tensor: an interrupt after
    some were set left the cache believing the old addresses were bound, so a later call on
    the old arrays read the new x and wrote the new outputs."""
    from pyacl_moe._cann import aclnn

    x1, ids = _forward_inputs(14)
    x2 = x1 + 100
    want = pm.reference.moe_init_routing_v2(x1, ids)
    with closing(pm.Stream(device)) as s:
        a1, a2, di = (pm.to_device(a, stream=s) for a in (x1, x2, ids))
        first = pm.moe_init_routing_v2(a1, di, stream=s)
        other = pm.RoutingResult(pm.empty((16, 4), np.float32), pm.empty((16,), np.int32), None, None)
        _interrupt_after(monkeypatch, aclnn, "set_output_addr")
        with pytest.raises(KeyboardInterrupt):
            pm.moe_init_routing_v2(a2, di, stream=s, out=other)  # x and expanded_x set, then interrupted
        monkeypatch.undo()
        first.expanded_x.fill(0, stream=s)
        again = pm.moe_init_routing_v2(a1, di, stream=s, out=first)  # the addresses bound before
        np.testing.assert_array_equal(again.expanded_x.to_host(s), want[0])


# ------------------------------------------------------------------------------------------ 15

def test_15_an_interrupted_plan_rebind_frees_nothing_the_executor_points_at(device, monkeypatch):
    """A plan's rebind set the executor's address, then recorded the new array: an interrupt
    in between left the executor on memory nothing held, which the next allocation of its
    size took, and the plan's launches wrote into it."""
    from pyacl_moe._cann import aclnn

    x, ids = _forward_inputs(15)
    want = pm.reference.moe_init_routing_v2(x, ids)
    with pm.MoeInitRoutingV2(pm.to_device(x), pm.to_device(ids)) as plan:
        plan()
        new = pm.empty((16, 4), np.float32)
        _interrupt_after(monkeypatch, aclnn, "set_output_addr")
        with pytest.raises(KeyboardInterrupt):
            plan.rebind(expanded_x=new)
        monkeypatch.undo()
        del new  # its block goes back to the cache unless the plan holds it
        bystander = pm.zeros((16, 4), np.float32)  # the cache's block of that size, if any
        r = plan()
        np.testing.assert_array_equal(bystander.to_host(), np.zeros((16, 4), np.float32))
        np.testing.assert_array_equal(r.expanded_x.to_host(), want[0])


# ------------------------------------------------------------------------------------------ 16

def test_16_an_interrupted_detach_leaves_no_launch_of_the_old_binding_published(device, monkeypatch):
    """Detaching a plan's slots forgot them all before stopping each: an interrupt in between
    left the steady state published, so after the next rebind the plan's launches returned
    the old outputs while writing the new ones."""
    from pyacl_moe.op import plan as plan_mod

    x, ids = _forward_inputs(16)
    with pm.MoeInitRoutingV2(pm.to_device(x), pm.to_device(ids)) as plan:
        plan()
        plan()  # the steady state, published
        real, calls = plan_mod._Slot.detach, []

        def interrupted_once(slot):
            if not calls:
                calls.append(1)
                raise KeyboardInterrupt
            return real(slot)

        monkeypatch.setattr(plan_mod._Slot, "detach", interrupted_once)
        new = pm.empty((16, 4), np.float32)
        with pytest.raises(KeyboardInterrupt):
            plan.rebind(expanded_x=new)
        monkeypatch.undo()
        plan.rebind(expanded_x=new)
        r = plan()
        assert r.expanded_x is new
        np.testing.assert_array_equal(new.to_host(), pm.reference.moe_init_routing_v2(x, ids)[0])


# ------------------------------------------------------------------------------------------ 17

def test_17_an_interrupted_close_is_finished_by_the_next_and_waits_for_launches_in_flight(device, monkeypatch):
    """close() waits for launches in flight through the plan's slots; interrupted there, it
    had already marked the plan closed, so the next close() returned at once, and the slot's
    arrays and workspace were never handed to its stream while a launch still used them."""
    import threading
    import types

    from pyacl_moe.op import plan as plan_mod

    x, ids = _forward_inputs(17)
    with closing(pm.Stream(device)) as s:
        plan = pm.MoeInitRoutingV2(pm.to_device(x, stream=s), pm.to_device(ids, stream=s))
        plan(s)
        plan(s)  # published for s
        # A launch in flight: its foreign call waits until released.
        stream, fn, args, result, context = plan._now
        inside, release = threading.Event(), threading.Event()

        def held_call(*a):
            inside.set()
            release.wait(30)
            return fn(*a)

        plan._now = (stream, held_call, args, result, context)
        launcher = threading.Thread(target=lambda: (device.set_current(), plan(s)))  # its context current
        launcher.start()
        assert inside.wait(10)
        sleeps: list[float] = []

        def interrupted_sleep(seconds):
            if not sleeps:
                sleeps.append(seconds)
                raise KeyboardInterrupt
            time.sleep(seconds)

        monkeypatch.setattr(plan_mod, "time", types.SimpleNamespace(sleep=interrupted_sleep))
        with pytest.raises(KeyboardInterrupt):
            plan.close()  # interrupted while it waits for the launch
        closed = threading.Event()
        closer = threading.Thread(target=lambda: (plan.close(), closed.set()))
        closer.start()
        try:
            assert not closed.wait(0.3), "close() returned while a launch through the plan was in flight"
        finally:
            release.set()
            launcher.join(30)
            closer.join(30)
        assert closed.is_set()
        s.synchronize()


# ------------------------------------------------------------------------------------------ 18

def test_18_two_rebinds_at_once_never_make_two_outputs_share_memory(device, monkeypatch):
    """Each rebind checked its arrays against the plan's before taking the plan's lock: two
    at once each passed against the old arrays, and together gave two outputs that share
    memory."""
    import threading

    from pyacl_moe.array import may_overlap
    from pyacl_moe.op.plan import Plan

    x, ids = _forward_inputs(18)
    with pm.MoeInitRoutingV2(pm.to_device(x), pm.to_device(ids), expert_num=4,
                             expert_tokens_count_or_cumsum_flag=2) as plan:
        mem = pm.empty((20,), np.int32)
        row_idx, counts = mem[:16], mem[15:19]  # one element in common
        both = threading.Barrier(2)
        real = Plan._checked_changes

        def checked_then_both(self, given):
            changes = real(self, given)
            both.wait(10)  # each has checked its arrays before either rebinds
            return changes

        monkeypatch.setattr(Plan, "_checked_changes", checked_then_both)
        outcomes: list[str] = []

        def rebind(**kw):
            try:
                plan.rebind(**kw)
                outcomes.append("rebound")
            except pm.InvalidArgument as exc:
                outcomes.append(exc.parameter)

        threads = [threading.Thread(target=rebind, kwargs={"expanded_row_idx": row_idx}),
                   threading.Thread(target=rebind, kwargs={"expert_tokens_count_or_cumsum": counts})]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(outcomes) in (["expanded_row_idx", "rebound"], ["expert_tokens_count_or_cumsum", "rebound"])
        out = plan.outputs
        assert not may_overlap(out.expanded_row_idx, out.expert_tokens_count_or_cumsum)


# ------------------------------------------------------------------------------------------ 19

def child_fork_while_a_thread_holds_the_plans_locks() -> None:
    pm.use_emulator()
    dev = pm.Device(0)
    s = pm.Stream(dev)
    x = np.ones((8, 4), np.float32)
    ids = pm.routing.random_top_k(8, 2, 4, seed=0)
    dx, di = pm.to_device(x, stream=s), pm.to_device(ids, stream=s)
    plan = pm.MoeInitRoutingV2(dx, di, expert_num=4)
    plan(s)
    dropped = pm.MoeInitRoutingV2(dx, di)
    dropped(s)
    held, release = threading.Event(), threading.Event()

    def inside():  # a parent thread inside the plan, its executor and its stream at fork
        with plan._lock, plan._core.lock, s.state.lock:
            held.set()
            release.wait()

    t = threading.Thread(target=inside)
    t.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        code = 0
        for use in (plan, lambda: plan(s), lambda: plan.rebind(), lambda: plan.rebind(x=dx),
                    lambda: pm.moe_init_routing_v2(dx, di, stream=s), lambda: pm.routing.dropless(di, 4)):
            try:
                use()
                code = code or 3
            except pm.ClosedError:
                pass
            except BaseException as e:
                print(type(e).__name__, e, flush=True)
                code = code or 4
        try:
            plan.close()
        except BaseException as e:
            print("close:", type(e).__name__, e, flush=True)
            code = code or 5
        del dropped
        gc.collect()
        try:
            pm.empty_cache()  # a safe point: releases what was dropped
        except BaseException as e:
            print("empty_cache:", type(e).__name__, e, flush=True)
            code = code or 6
        os._exit(code)
    release.set()
    t.join()
    code = wait_child(pid, 20)
    print("child hung" if code is None else f"child {code}")


def test_19_a_fork_child_never_waits_for_a_lock_a_parent_thread_held(isolated):
    """In a fork() child, closing, rebinding or dropping an inherited plan took the plan's,
    its executor's and its stream's locks, which a parent thread may have held at fork (the
    child then hung), and called CANN (AclRuntimeError 100001 instead of nothing)."""
    r = isolated(child_fork_while_a_thread_holds_the_plans_locks, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("child 0"), r.stdout + r.stderr


# ------------------------------------------------------------------------------------------ 20

def child_a_plan_whose_device_closed() -> None:
    pm.use_emulator()
    x = np.ones((8, 4), np.float32)
    ids = pm.routing.random_top_k(8, 2, 4, seed=0)
    old = pm.Device(0)
    fwd = pm.MoeInitRoutingV2(pm.to_device(x), pm.to_device(ids))
    back = pm.MoeInitRoutingV2Grad(pm.to_device(x.repeat(2, 0)), pm.to_device(np.arange(16, dtype=np.int32)), 2)
    old.close()
    new = pm.Device(0)
    s = pm.Stream(new)
    ws = pm.empty((fwd.workspace_size,), np.uint8, new)
    for use in (lambda: fwd.rebind(x=pm.to_device(x)), lambda: fwd(s), lambda: fwd(None, ws),
                lambda: back.rebind(out=pm.empty((8, 4), np.float32)), lambda: back(s)):
        try:
            use()
            print("accepted")
        except pm.ClosedError:
            print("closed")
        except Exception as e:
            print(type(e).__name__, e)
    fwd.close()
    back.close()


def test_20_a_plan_whose_device_closed_raises_closed_error_whatever_it_is_given(isolated):
    """Once its device was closed and device 0 opened again, a plan given arrays or a stream
    of the new device 0 said they were on another device ("on device 0, the plan on 0")
    instead of that it was closed."""
    r = isolated(child_a_plan_whose_device_closed)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["closed"] * 5, r.stdout


# ------------------------------------------------------------------------------------------ 21

def child_keyboard_interrupt_anywhere_in_the_forward(iterations: int) -> None:
    pm.use_emulator()
    dev = pm.Device(0)
    x = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    ids = pm.routing.random_top_k(64, 2, 8, seed=1)
    kw = dict(expert_num=8, expert_tokens_count_or_cumsum_flag=2)
    dp = dict(drop_pad_mode=1, expert_num=8, expert_capacity=12, expert_tokens_before_capacity_flag=True)
    want, want_dp = pm.reference.moe_init_routing_v2(x, ids, **kw), pm.reference.moe_init_routing_v2(x, ids, **dp)

    def same(r, w, s=None):
        return all((a is None) == (b is None) and (b is None or np.array_equal(
            a if isinstance(a, np.ndarray) else a.to_host(s), b)) for a, b in zip(r, w))

    dev.synchronize()
    pm.empty_cache()
    before = pm.emulator.stats()
    wrong = set()

    def attempt():
        if not same(pm.moe_init_routing_v2(x, ids, **kw), want):
            wrong.add("host")
        with closing(pm.Stream(dev)) as s:
            dx = pm.to_device(x, stream=s)
            di = pm.to_device(ids, stream=s)
            r = pm.moe_init_routing_v2(dx, di, **kw, stream=s)
            if not same(r, want, s):
                wrong.add("device")
            r = pm.moe_init_routing_v2(dx, di, **kw, stream=s, out=r)
            if not same(r, want, s):
                wrong.add("out=")
            if not same(pm.moe_init_routing_v2(dx, di, **dp, stream=s), want_dp, s):
                wrong.add("drop/pad")
            with pm.MoeInitRoutingV2(dx, di, **kw) as plan:
                plan(s)
                if not same(plan(s), want, s):
                    wrong.add("plan")
                plan.rebind(x=pm.to_device(x, stream=s), expanded_x=pm.zeros((128, 32), np.float32))
                if not same(plan(s), want, s):
                    wrong.add("rebound plan")
            rt = pm.routing.drop_pad(di, 8, 12, stream=s)
            if not np.array_equal(rt.expanded_row_idx.to_host(s), want_dp[1]):
                wrong.add("routing")

    # Threads switch often, so that the interrupts land in Python code too, not only as foreign
    # calls that let the interrupter run return.
    interrupts = _interrupt_soak(21, iterations, attempt, switch_interval=1e-5)
    _soak_verdict(dev, before, interrupts, wrong, 50)


@pytest.mark.parametrize("iterations", [600, pytest.param(6000, marks=pytest.mark.slow)], ids=["short", "long"])
def test_21_keyboard_interrupt_anywhere_in_the_forward_leaks_nothing_and_frees_nothing_early(isolated, iterations):
    """test_08's method on the forward: its one call on host arrays and on DeviceArrays (with
    and without out=, dropless and drop/pad), its plan (launched, rebound, closed) and
    pm.routing on the device, interrupted at random; every result that completes is the
    reference's, and nothing is left behind (defects 14 to 17 are the places found)."""
    r = isolated(child_keyboard_interrupt_anywhere_in_the_forward, iterations, timeout=120 + iterations // 20)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout


# ------------------------------------------------------------------------------------------ 22

def child_fork_while_threads_are_inside_the_forward() -> None:
    pm.use_emulator()
    dev = pm.Device(0)
    s = pm.Stream(dev)
    x = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    ids = pm.routing.random_top_k(256, 2, 8, seed=1)
    kw = dict(expert_num=8, expert_tokens_count_or_cumsum_flag=2)
    dx, di = pm.to_device(x, stream=s), pm.to_device(ids, stream=s)
    plan = pm.MoeInitRoutingV2(dx, di, **kw)
    r0 = plan(s)
    stop = threading.Event()

    def busy(i):
        out = None
        while not stop.is_set():
            pm.moe_init_routing_v2(x, ids, **kw)
            with closing(pm.Stream(dev)) as t:
                out = pm.moe_init_routing_v2(pm.to_device(x, stream=t), pm.to_device(ids, stream=t), **kw, stream=t,
                                             out=out if i else None)
                plan(t)
                pm.routing.dropless(pm.to_device(ids, stream=t), 8, stream=t).to_host(t)
            try:
                plan.rebind(x=pm.to_device(x))
            except pm.ClosedError:
                pass
            out = None

    ts = [threading.Thread(target=busy, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    uses = {
        "plan()": lambda: plan(), "plan(s)": lambda: plan(s), "rebind()": lambda: plan.rebind(),
        "rebind(x)": lambda: plan.rebind(x=dx), "one call": lambda: pm.moe_init_routing_v2(dx, di, **kw, stream=s),
        "one call, out=": lambda: pm.moe_init_routing_v2(dx, di, **kw, out=r0),
        "unvalidated": lambda: pm.moe_init_routing_v2(dx, di, **kw, validate=False),
        "host arrays": lambda: pm.moe_init_routing_v2(x, ids, **kw), "new plan": lambda: pm.MoeInitRoutingV2(dx, di),
        "routing": lambda: pm.routing.dropless(di, 8), "result": lambda: r0.expanded_x.to_host(),
    }
    hung, bad = 0, set()
    for _ in range(12):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            report = []
            for what, use in uses.items():
                try:
                    use()
                    report.append(what + ": accepted")
                except pm.ClosedError:
                    pass
                except BaseException as e:
                    report.append(f"{what}: {type(e).__name__} {e}")
            try:
                plan.close()
                pm.routing.dropless(ids, 8)  # the host routing needs no device
            except BaseException as e:
                report.append(f"close or host routing: {type(e).__name__} {e}")
            os.write(wfd, "; ".join(report).encode())
            os._exit(0)
        os.close(wfd)
        code = wait_child(pid, 10)
        if code is None:
            hung += 1
        else:
            text = os.read(rfd, 1 << 16).decode()
            if text or code:
                bad.add(text or f"exit {code}")
        os.close(rfd)
    stop.set()
    for t in ts:
        t.join()
    plan.close()
    print("hung", hung, "bad", sorted(bad))
    assert hung == 0 and not bad
    print("ok")


def test_22_fork_while_threads_are_inside_the_forward_never_hangs_the_child(isolated):
    """test_11's method on the forward: the parent's threads run the forward's one calls,
    its plan (launched and rebound) and routing on the device while it forks; in each child
    every inherited forward object raises ClosedError, closing the plan is quiet, and the
    child exits. Before defect 19 was fixed the children hung or raised AclRuntimeError."""
    r = isolated(child_fork_while_threads_are_inside_the_forward, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout


# ------------------------------------------------------------------------------------------ 23
# Found in this review: the one call on DeviceArrays took its stream's lock before it looked at
# the device, so a fork() child hung on a lock a parent thread held at fork.

def child_fork_while_a_thread_holds_the_streams_locks() -> None:
    pm.use_emulator()
    dev = pm.Device(0)
    s = pm.Stream(dev)
    x = np.ones((8, 4), np.float32)
    idx = np.arange(8, dtype=np.int32)
    dx, di = pm.to_device(x, stream=s), pm.to_device(idx, stream=s)
    dout = pm.empty((4, 4), np.float32)
    ws = pm.empty((16 << 20,), np.uint8)
    pm.moe_init_routing_v2_grad(dx, di, 2, out=dout, stream=s)  # the stream's executor is cached
    pm.moe_init_routing_v2_grad(dx, di, 2, out=dout)
    s.synchronize()
    dev.synchronize()
    held, release = threading.Event(), threading.Event()

    def inside():  # a parent thread inside both streams at fork
        with s.state.lock, dev.default_stream.state.lock:
            held.set()
            release.wait()

    t = threading.Thread(target=inside)
    t.start()
    held.wait()
    uses = {
        "one call, stream given": lambda: pm.moe_init_routing_v2_grad(dx, di, 2, out=dout, stream=s),
        "one call, default stream": lambda: pm.moe_init_routing_v2_grad(dx, di, 2, out=dout),
        "one call, out made": lambda: pm.moe_init_routing_v2_grad(dx, di, 2, stream=s),
        "one call, own workspace": lambda: pm.moe_init_routing_v2_grad(dx, di, 2, out=dout, stream=s, workspace=ws),
        "one call, unvalidated": lambda: pm.moe_init_routing_v2_grad(dx, di, 2, out=dout, stream=s, validate=False),
        "copy in": lambda: pm.to_device(x, stream=s),
        "copy out": lambda: dx.to_host(s),
        "copy from host": lambda: dout.copy_from_host(np.zeros((4, 4), np.float32), stream=s),
        "stream synchronize": lambda: s.synchronize(),
        "stream query": lambda: s.query(),
        "device synchronize": lambda: dev.synchronize(),
    }
    pid = os.fork()
    if pid == 0:
        code = 0
        for name, use in uses.items():
            print(name, flush=True)  # the last one printed is the one that hung
            try:
                use()
                print("  no error", flush=True)
                code = 3
            except pm.ClosedError:
                pass
            except BaseException as e:
                print("  ", type(e).__name__, e, flush=True)
                code = 4
        os._exit(code)
    code = wait_child(pid, 20)
    report = ["child hung"] if code is None else [f"child exit {code}"] if code else []
    release.set()
    t.join()
    print(report)
    assert not report
    print("ok")


def test_23_a_fork_child_gets_closed_error_from_every_stream_use_never_a_parent_threads_lock(isolated):
    """In a fork() child whose parent had threads inside a stream (its lock held at fork), the
    one call on DeviceArrays (stream given, default stream, output made, own workspace),
    copies, waits and queries raise ClosedError and never wait for that lock."""
    r = isolated(child_fork_while_a_thread_holds_the_streams_locks, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout


# ------------------------------------------------------------------------------------------ 24
# Found in this review (a rare failure of test 21): a stream's destroy marks it closed before it
# releases the handle, and an interrupt in between left the handle to nobody.

@pytest.mark.parametrize("how", ["close", "dropped"])
def test_24_an_interrupt_after_a_stream_is_marked_closed_still_destroys_it(device, no_leaks, monkeypatch, how):
    """close() (or the release of a dropped Stream) interrupted after the stream was marked
    closed and before aclrtDestroyStream: a second close(), or the drop, destroys it."""
    base = pm.emulator.stats()["streams"]
    real = type(device).remove_queue
    hits = []

    def interrupted_once(self, q):
        if not hits:
            hits.append(q)
            raise KeyboardInterrupt
        real(self, q)

    monkeypatch.setattr(type(device), "remove_queue", interrupted_once)
    s = pm.Stream(device)
    assert pm.emulator.stats()["streams"] == base + 1
    if how == "close":
        with pytest.raises(KeyboardInterrupt):
            s.close()
        assert s.closed
        s.close()  # finishes the job
    else:
        x = pm.to_device(np.ones(4, np.float32), stream=s)  # queued work: released at a safe point
        del s
        with pytest.raises(KeyboardInterrupt):
            gc.collect()
            device.synchronize()  # a safe point: the dropped stream is released there
        del x
    assert hits, "the interrupt was not injected"
    monkeypatch.undo()
    gc.collect()
    pm.empty_cache()
    assert pm.emulator.stats()["streams"] == base
