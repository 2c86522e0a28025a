"""KeyboardInterrupt anywhere: never a crash, never memory freed while in use, never a lock left
held, never memory lost for good (after it, ``empty_cache()`` returns every block); a release
or rebind it cut short is finished by the next use (README, "Threads and lifetimes").

An interrupt that lands as a foreign call returns (where most land) is made by a wrapper that
makes the call, then raises KeyboardInterrupt, as the handler of a SIGINT arriving then would.

The promise rests on one property of the interpreter, checked here first: an interrupt never
skips the exit of a ``with lock:`` block. CPython before 3.10 breaks it (it may handle a signal
between a with block's end and the call of its ``__exit__``, bpo-29988), so there the soaks,
whose interrupts land anywhere, are skipped: on 3.9 an interrupt can leave a lock held. CPython
3.13 breaks it for loops (some backward jumps of a loop in a with block lie outside the with's
handler), so no loop of the package runs in a lock's with block, which a test checks."""

from __future__ import annotations

import _thread
import ast
import dis
import gc
import importlib.util
import pathlib
import pkgutil
import random
import signal
import sys
import threading
import time
import types
from contextlib import closing

import numpy as np
import pytest

import pyacl_moe as pm

from .conftest import LIVE, forward_inputs

with_is_interrupt_safe = pytest.mark.skipif(
    sys.version_info < (3, 10),
    reason="CPython before 3.10 may skip a with block's __exit__ on an interrupt (bpo-29988)")


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


def _interrupt_soak(seed: int, iterations: int, attempt, switch_interval: float | None = None,
                    at_least: int = 0) -> int:
    """Run ``attempt()`` ``iterations`` times, interrupted at random (Interrupter), the
    interpreter switching threads every ``switch_interval`` seconds if given, and on (up to four
    times as many) until more than ``at_least`` were interrupted: how many attempts were. (The
    interrupts come at random intervals of wall time, so faster attempts catch fewer: a fixed
    count made the soak's verdict depend on the machine.) Nothing an attempt made outlives it
    but what it leaks."""
    interrupter = Interrupter(seed)
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    interrupts = 0
    for n in range(4 * iterations):
        if n >= iterations and interrupts > at_least:
            break
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


def child_with_lock_under_interrupts(interrupts: int) -> None:
    lock = threading.Lock()
    interrupter = Interrupter(7)
    got = held = 0
    while got < interrupts:
        try:
            interrupter.armed = True
            for _ in range(1000):
                with lock:
                    pass
            interrupter.armed = False
        except KeyboardInterrupt:
            interrupter.armed = False
            got += 1
        if lock.locked():
            held += 1
            lock.release()
    interrupter.stop()
    print("interrupts", got, "lock left held", held)
    assert held == 0
    print("ok")


@with_is_interrupt_safe
def test_an_interrupt_never_skips_the_exit_of_a_with_lock_block(isolated):
    """The interpreter property every lock of the package relies on under interrupts."""
    r = isolated(child_with_lock_under_interrupts, 100)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout


def _with_bodies(tree: ast.AST) -> dict[int, tuple[int, int]]:
    """Line of a lock's ``with`` (a name or an attribute: the package's locks, not ``open()``)
    -> the first and last lines of its body."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.With):
            span = (min(n.lineno for n in node.body), max(n.end_lineno for n in node.body))
            for item in node.items:
                if isinstance(item.context_expr, (ast.Name, ast.Attribute)):
                    out[item.context_expr.lineno] = span
    return out


def _unprotected(code: types.CodeType, bodies: dict[int, tuple[int, int]]) -> list[tuple[int, str]]:
    """(line, instruction) of each instruction in a lock's with body of ``code`` that may
    raise a KeyboardInterrupt (a backward jump or a call) but lies outside the with's
    exception handler, directly or through the handlers nested in it."""
    instrs = list(dis.get_instructions(code))
    entries = dis.Bytecode(code).exception_entries

    def handler_of(offset):
        return next((e.target for e in entries if e.start <= offset < e.end), None)

    def reaches(offset, handler):
        seen = set()
        target = handler_of(offset)
        while target is not None and target not in seen:
            if target == handler:
                return True
            seen.add(target)
            target = handler_of(target)
        return False

    found = []
    enters = [(i, ins) for i, ins in enumerate(instrs) if ins.opname == "BEFORE_WITH"
              and ins.positions.lineno in bodies]
    for i, ins in enters:
        span = bodies[ins.positions.lineno]
        handler = handler_of(instrs[i + 1].offset)
        copies = [x.offset for _, x in enters if bodies[x.positions.lineno] == span]
        for k in instrs:
            line = k.positions.lineno
            if line is None or not span[0] <= line <= span[1]:
                continue
            if max((o for o in copies if o < k.offset), default=None) != ins.offset:
                continue  # another copy of the same with statement (a finally's)
            if (k.opname == "JUMP_BACKWARD" or k.opname.startswith("CALL")) and not reaches(k.offset, handler):
                found.append((line, k.opname))
    return found


@pytest.mark.skipif(sys.version_info < (3, 11), reason="before 3.11 with blocks are not exception-table based")
def test_no_lock_of_the_package_is_held_across_an_instruction_its_with_does_not_cover():
    """The compiler's side of the promise: in every with block over a lock, each instruction
    that may raise an interrupt is inside the with's handler. CPython 3.12 and 3.13 leave some
    of a loop's backward jumps out (the jump of an ``if`` that ends an iteration), so an
    interrupt landing there skipped the release (a hang at the next acquire): loops run under
    a lock are functions of their own."""
    found = []
    for info in pkgutil.walk_packages(pm.__path__, "pyacl_moe."):
        spec = importlib.util.find_spec(info.name)
        if spec is None or not (spec.origin or "").endswith(".py"):
            continue
        text = pathlib.Path(spec.origin).read_text()
        bodies = _with_bodies(ast.parse(text))
        codes = [compile(text, spec.origin, "exec")]
        while codes:
            code = codes.pop()
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
            found += [f"{info.name}:{line} {code.co_name}: {op}" for line, op in _unprotected(code, bodies)]
    assert not found, "\n".join(sorted(set(found)))


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

    interrupts = _interrupt_soak(3, iterations, attempt, at_least=100)
    _soak_verdict(dev, before, interrupts, wrong, 100)


@with_is_interrupt_safe
@pytest.mark.parametrize("iterations", [500, pytest.param(4000, marks=pytest.mark.slow)], ids=["short", "long"])
def test_keyboard_interrupt_anywhere_leaks_nothing_and_frees_nothing_early(isolated, iterations):
    r = isolated(child_keyboard_interrupt_anywhere, iterations, timeout=120 + iterations // 20)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout
    print(r.stdout)


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


def test_an_interrupted_rebind_of_a_streams_cached_executor_is_redone_in_full(device, monkeypatch):
    """The one call rebinds the stream's cached executor tensor by tensor: an interrupt after
    some were set left the cache believing the old addresses were bound, so a later call on
    the old arrays read the new x and wrote the new outputs."""
    from pyacl_moe._cann import aclnn

    x1, ids = forward_inputs(14)
    x2 = x1 + 100
    want = pm.reference.moe_init_routing_v2(x1, ids)
    with closing(pm.Stream(device)) as s:
        a1, a2, di = (pm.to_device(a, stream=s) for a in (x1, x2, ids))
        first = pm.moe_init_routing_v2(a1, di, stream=s)
        pm.moe_init_routing_v2(a1, di, stream=s, out=first)  # the executor of calls given out=, on a1 and first
        other = pm.RoutingResult(pm.empty((16, 4), np.float32), pm.empty((16,), np.int32), None, None)
        _interrupt_after(monkeypatch, aclnn, "set_output_addr")
        with pytest.raises(KeyboardInterrupt):
            pm.moe_init_routing_v2(a2, di, stream=s, out=other)  # x and expanded_x set, then interrupted
        monkeypatch.undo()
        first.expanded_x.fill(0, stream=s)
        again = pm.moe_init_routing_v2(a1, di, stream=s, out=first)  # the addresses bound before
        np.testing.assert_array_equal(again.expanded_x.to_host(s), want[0])


def test_an_interrupted_plan_rebind_frees_nothing_the_executor_points_at(device, monkeypatch):
    """A plan's rebind set the executor's address, then recorded the new array: an interrupt
    in between left the executor on memory nothing held, which the next allocation of its
    size took, and the plan's launches wrote into it."""
    from pyacl_moe._cann import aclnn

    x, ids = forward_inputs(15)
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


def test_an_interrupted_stop_of_a_plans_launches_leaves_none_of_the_old_binding(device, monkeypatch):
    """A rebind stops the plan's launches on each stream before setting any address: an
    interrupt in between leaves the rebind recorded, and the plan's next use finishes it, so
    no launch ever returns the old outputs while writing the new ones."""
    from pyacl_moe.op import plan as plan_mod

    x, ids = forward_inputs(16)
    with pm.MoeInitRoutingV2(pm.to_device(x), pm.to_device(ids)) as plan:
        plan()
        plan()  # the steady state
        real, calls = plan_mod._unbind, []

        def interrupted_once(state, core):
            if not calls:
                calls.append(1)
                raise KeyboardInterrupt
            return real(state, core)

        monkeypatch.setattr(plan_mod, "_unbind", interrupted_once)
        new = pm.empty((16, 4), np.float32)
        with pytest.raises(KeyboardInterrupt):
            plan.rebind(expanded_x=new)
        monkeypatch.undo()
        r = plan()  # finishes the rebind first
        assert r.expanded_x is new
        np.testing.assert_array_equal(new.to_host(), pm.reference.moe_init_routing_v2(x, ids)[0])


def child_a_plans_close_waits_for_launches_in_flight() -> None:
    from pyacl_moe.op import plan as plan_mod

    pm.use_emulator()
    device = pm.Device(0)
    x, ids = forward_inputs(17)
    with closing(pm.Stream(device)) as s:
        plan = pm.MoeInitRoutingV2(pm.to_device(x, stream=s), pm.to_device(ids, stream=s))
        plan(s)
        plan(s)  # the steady state for s
        inside, release = threading.Event(), threading.Event()
        real_call = plan._c.fn

        def held_call(*args):  # a launch in flight: its foreign call waits until released
            inside.set()
            release.wait(30)
            return real_call(*args)

        plan._c.fn = held_call
        launcher = threading.Thread(target=lambda: (device.set_current(), plan(s)))  # its context current
        launcher.start()
        assert inside.wait(10)
        real_unbind, stops = plan_mod._unbind, []

        def interrupted_unbind(state, core):
            if not stops:
                stops.append(1)
                raise KeyboardInterrupt
            return real_unbind(state, core)

        plan_mod._unbind = interrupted_unbind
        try:
            plan.close()
        except KeyboardInterrupt:
            print("interrupted")
        plan_mod._unbind = real_unbind
        closed = threading.Event()
        closer = threading.Thread(target=lambda: (plan.close(), closed.set()))
        closer.start()
        try:
            print("returned early", closed.wait(0.3))
        finally:
            release.set()
            launcher.join(30)
            closer.join(30)
        print("closed", closed.is_set() and plan.closed)
        try:
            plan(s)
        except pm.ClosedError:
            print("refused")
        s.synchronize()


def test_a_plans_close_waits_for_launches_in_flight_and_an_interrupted_one_is_finished(isolated):
    """close() stops the plan's launches under their stream's lock, so it returns only once a
    launch in flight on another thread is done; interrupted, the next close() finishes it."""
    r = isolated(child_a_plans_close_waits_for_launches_in_flight)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split("\n")[:4] == ["interrupted", "returned early False", "closed True", "refused"], r.stdout


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
    interrupts = _interrupt_soak(21, iterations, attempt, switch_interval=1e-5, at_least=50)
    _soak_verdict(dev, before, interrupts, wrong, 50)


@with_is_interrupt_safe
@pytest.mark.parametrize("iterations", [300, pytest.param(6000, marks=pytest.mark.slow)], ids=["short", "long"])
def test_keyboard_interrupt_anywhere_in_the_forward_leaks_nothing_and_frees_nothing_early(isolated, iterations):
    """test_08's method on the forward: its one call on host arrays and on DeviceArrays (with
    and without out=, dropless and drop/pad), its plan (launched, rebound, closed) and
    pm.routing on the device, interrupted at random; every result that completes is the
    reference's, and nothing is left behind (defects 14 to 17 are the places found)."""
    r = isolated(child_keyboard_interrupt_anywhere_in_the_forward, iterations, timeout=120 + iterations // 20)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout


@pytest.mark.parametrize("how", ["close", "dropped"])
def test_an_interrupt_after_a_stream_is_marked_closed_still_destroys_it(device, no_leaks, monkeypatch, how):
    """close() (or the release of a dropped Stream) interrupted after the stream was marked
    closed and before aclrtDestroyStream: a second close(), or the drop, destroys it."""
    from pyacl_moe.stream import StreamState

    base = pm.emulator.stats()["streams"]
    real = StreamState.release
    hits = []

    def interrupted_once(self):
        if not hits:
            hits.append(self)
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(StreamState, "release", interrupted_once)
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


def child_interrupt_storm_in_releases(iterations: int) -> None:
    pm.use_emulator()
    dev = pm.Device(0)
    before = pm.emulator.stats()
    s = pm.Stream(dev)
    dx = pm.to_device(np.ones((64, 32), np.float32))
    di = pm.to_device(np.arange(64, dtype=np.int32))
    interrupter = Interrupter(29)
    interrupts = 0
    for n in range(iterations):
        # Made with no interrupt armed; released with one armed: array drops (at the safe points
        # of the calls after), plan closes, empty_cache.
        arrays = [pm.empty((64 + n % 7, 8), np.float32) for _ in range(40)]
        plans = [pm.MoeInitRoutingV2Grad(dx, di, 4) for _ in range(3)]
        for plan in plans:
            plan(s)
        del plan
        outs = [pm.moe_init_routing_v2_grad(dx, di, 4, stream=s) for _ in range(4)]
        try:
            interrupter.armed = True
            del arrays[:]
            while plans:
                plans[-1].close()
                plans.pop()
            del outs[:]
            pm.empty_cache()
            pm.empty_cache(dev)
            interrupter.armed = False
        except KeyboardInterrupt:
            interrupter.armed = False
            interrupts += 1
        del arrays, plans, outs
    interrupter.stop()
    del dx, di
    gc.collect()
    s.close()
    dev.synchronize()
    pm.empty_cache()
    after = pm.emulator.stats()
    memory = ("device_allocations", "device_bytes", "host_allocations", "host_bytes", "streams", "pending_tasks")
    left = {k: (before[k], after[k]) for k in memory if after[k] != before[k]}
    print("interrupts", interrupts, "left", left, "guards", pm.emulator.check_guards(),
          "faults", after["device_faults"] - before["device_faults"])
    assert interrupts > 20 and not left and pm.emulator.check_guards() == 0
    assert after["device_faults"] == before["device_faults"]
    print("ok")


@with_is_interrupt_safe
def test_an_interrupt_storm_in_releases_leaves_nothing_allocated_after_empty_cache(isolated):
    """Interrupts landing anywhere in array drops, plan closes and empty_cache(): once the
    storm is over, empty_cache() gives every block back (device and pinned memory), no
    stream is left, no queued work faulted (nothing was freed under it)."""
    r = isolated(child_interrupt_storm_in_releases, 400, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test: a run started in the background of a
    non-interactive shell inherits SIGINT ignored, and Python then installs none, so a SIGINT
    the test sends would be lost."""
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, saved)


@pytest.mark.parametrize("how", ["validate=False", "execute", "one-shot plan"])
def test_an_interrupt_at_a_one_shot_launch_loses_no_executor(device, no_leaks, monkeypatch, python_sigint, how):
    """A one-shot executor is CANN's from its launch on: the binding forgot it before the
    call, so an interrupt in between lost it for good (never launched, never destroyed), even
    past Device.close(). The launch and the forgetting are now one step for SIGINT."""
    import signal

    from pyacl_moe._cann import loader

    case_x, case_i = np.ones((8, 4), np.float32), np.arange(8, dtype=np.int32)
    x, idx, out = pm.to_device(case_x), pm.to_device(case_i), pm.empty((4, 4), np.float32)
    executors = pm.emulator.stats()["executors"]
    libs = loader.libs()
    real = libs.op

    class SigintFirst:  # the launch function delivers SIGINT to this process just before CANN runs
        def __getattr__(self, name):
            fn = getattr(real, name)
            if name != "aclnnMoeInitRoutingV2Grad":
                return fn

            def launch(*args):
                signal.raise_signal(signal.SIGINT)
                return fn(*args)
            return launch

    monkeypatch.setattr(libs, "op", SigintFirst())
    with pytest.raises(KeyboardInterrupt):
        if how == "validate=False":
            pm.moe_init_routing_v2_grad(x, idx, 2, out=out, validate=False)
        elif how == "execute":
            size, ex = pm.get_workspace_size(x, idx, 2, 0, 0, out)
            pm.execute(pm.empty((size,), np.uint8), size, ex)
        else:
            pm.MoeInitRoutingV2Grad(x, idx, 2, out=out, repeatable=False)()
    monkeypatch.undo()
    device.synchronize()
    np.testing.assert_array_equal(out.to_host(), np.full((4, 4), 2.0, np.float32))  # it did launch
    gc.collect()
    assert pm.emulator.stats()["executors"] == executors  # consumed by its launch, not lost


def test_an_interrupted_allocation_counts_no_hit_and_no_miss_it_did_not_make(device, monkeypatch):
    """memory_stats' hits are blocks taken from a shelf, its misses mallocs made: an interrupt
    inside a take (at its second token) or before a block is made counts neither (the hits went
    negative when a take counted its misses before its takes)."""
    from pyacl_moe import _lifetime
    from pyacl_moe import device as device_mod

    dev = pm.current_device()
    kinds = ("array_hits", "array_misses")
    for where in ("token", "_malloc"):
        pm.empty_cache()
        st0, mallocs = pm.memory_stats(), pm.emulator.stats()["mallocs_total"]
        if where == "token":
            real, calls = _lifetime.Token, []

            def token(*args: object) -> object:
                calls.append(1)
                if len(calls) == 2:
                    raise KeyboardInterrupt
                return real(*args)
            monkeypatch.setattr(device_mod._lifetime, "Token", token)
        else:
            def refuse(*args: object) -> None:
                raise KeyboardInterrupt
            monkeypatch.setattr(device_mod.Device, "_malloc", refuse)
        with pytest.raises(KeyboardInterrupt):
            dev.allocate([123457, 223457])  # two sizes not cached: two misses, had it run
        monkeypatch.undo()
        st1 = pm.memory_stats()
        assert [st1[k] - st0[k] for k in kinds] == [0, 0], where
        assert st1["array_hits"] >= 0 and pm.emulator.stats()["mallocs_total"] == mallocs
    gc.collect()
    pm.empty_cache()
    assert pm.memory_stats()["array_bytes_in_use"] == 0


def test_an_interrupted_allocation_or_give_back_leaves_memory_stats_true(device, monkeypatch):
    """An interrupt inside the allocator (taking a block, making one, the NumPy call's blocks
    going back) leaves no block lost and memory_stats true once the caches are emptied (it was
    16 MiB off: a workspace counted in use that no one held)."""
    from pyacl_moe import device as device_mod
    from pyacl_moe.op import call as call_mod

    pm.empty_cache()
    before = pm.emulator.stats()["device_allocations"]
    x, idx = np.ones((8, 4), np.float32), np.arange(8, dtype=np.int32)
    for module, name in ((device_mod.Device, "_take"), (device_mod.Device, "_malloc"), (call_mod, "wait_for")):
        for k, size in enumerate((1 << 20, 3 << 20, 1 << 20)):  # (a size seen before and a new one: a hit, a miss)
            a = pm.empty((size,), np.uint8)
            del a  # its block: on its shelf, for the next allocation (or the interrupted one)
            _interrupt_after(monkeypatch, module, name)
            with pytest.raises(KeyboardInterrupt):
                if name == "wait_for":  # (the NumPy call's blocks, back in the cache once its arrays go)
                    pm.moe_init_routing_v2_grad(x, idx, 2)
                else:
                    pm.empty((size + (k + 1) * 4096 * (name == "_malloc"),), np.uint8)  # (_malloc: a new size)
            monkeypatch.undo()
    gc.collect()
    pm.empty_cache()
    st = pm.memory_stats()
    assert st["array_bytes_in_use"] == 0 and st["array_bytes_idle"] == 0, st
    assert pm.emulator.stats()["device_allocations"] == before
