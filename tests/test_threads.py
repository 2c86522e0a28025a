"""Threaded stress tests, one per shared object: a stream, a plan, an array, the workspace pool,
the executor cache, a device being closed, and the forward's plan and one call beside the
backward's. Each runs 8 threads (tests/stress.py's hammer), each worker for a number of
iterations (PYACL_MOE_STRESS_ITERATIONS in the default run, PYACL_MOE_STRESS_LONG_ITERATIONS
under ``-m slow``) with the interpreter switching threads every microsecond, checks every result
bit for bit, and leaves the emulator's live counters where it found them."""

from __future__ import annotations

import threading
import time
import traceback
from contextlib import closing

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import routing
from pyacl_moe.tools.cases import make_case

from .stress import ITERATIONS, Progress, hammer, stress_iterations

THREADS = 8


class SharedPlan:
    """The plan some launchers share (``plan``), replaced and closed under them by a replacer:
    a launcher that meets a closed plan calls ``met_closed(plan)``, which counts it
    (``closed_seen``) and waits for the next one."""

    def __init__(self, plan, launches: Progress) -> None:
        self.plan = plan
        self.closed_seen = 0
        self._launches = launches
        self._cond = threading.Condition()

    def steps(self, n: int):
        """The launchers' loop: ``n`` counted steps, then more (10,000 at most) until a launch
        has met a closed plan, so that closing is exercised however the threads are scheduled."""
        for step in self._launches.steps(n + 10_000):
            if step >= n and self.closed_seen:
                return
            yield step

    def met_closed(self, plan) -> None:
        with self._cond:
            self.closed_seen += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.plan is not plan, timeout=10)

    def replace(self, new, close_first: bool) -> None:
        """Publish ``new`` and close the plan it replaces: first (then ``new`` is published once
        a launch has met the closed plan, or the launchers are done), or after (launches of the
        old plan may be in flight)."""
        old = self.plan
        if close_first:
            seen = self.closed_seen
            old.close()
            with self._cond:
                for _ in range(200):  # 10 s at most
                    if self._cond.wait_for(lambda: self.closed_seen > seen, 0.05) or not self._launches.running:
                        break
                self.plan = new
                self._cond.notify_all()
        else:
            with self._cond:
                self.plan = new
                self._cond.notify_all()
            old.close()


@pytest.fixture(scope="module")
def case():
    c = make_case(32, 4, 64, "float32", "dropless", seed=21)
    return c, pm.moe_init_routing_v2_grad(*c.args())  # the kernel is deterministic: bit-exact


@stress_iterations
def test_a_shared_stream(device, no_leaks, case, iterations):
    c, expected = case
    shared = pm.Stream(device)

    def worker(i, steps):
        for _ in range(steps):
            x = pm.to_device(c.grad_expanded_x, stream=shared)
            idx = pm.to_device(c.expanded_row_idx, stream=shared)
            out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=shared)
            if i % 2:
                ev = shared.record()
                with closing(pm.Stream(device)) as own:
                    own.wait_event(ev)
                    got = out.to_host(own)
                ev.close()
            else:
                got = out.to_host(shared)
            assert np.array_equal(got, expected)
            if i == 0:
                shared.synchronize()
            elif i == 1:
                shared.query()

    errors = hammer([worker] * THREADS, iterations)
    shared.close()
    assert not errors, errors[0]


@stress_iterations
def test_a_shared_plan(device, no_leaks, case, iterations):
    c, expected = case
    x, idx = pm.to_device(c.grad_expanded_x), pm.to_device(c.expanded_row_idx)
    launches = Progress()
    shared = SharedPlan(pm.MoeInitRoutingV2Grad(x, idx, 4), launches)

    def launcher(i, steps):
        with closing(pm.Stream(device)) as own:
            for _ in shared.steps(steps):
                plan = shared.plan
                s = own if i % 2 else None
                try:
                    out = plan(s)
                    got = out.to_host(s)
                except pm.ClosedError:
                    shared.met_closed(plan)
                    continue
                assert np.array_equal(got, expected)

    def rebinder(i, steps):
        for _ in range(steps):
            plan = shared.plan
            try:
                plan.rebind(grad_expanded_x=pm.to_device(c.grad_expanded_x), out=pm.empty((32, 64), np.float32))
            except pm.ClosedError:
                continue
            time.sleep(0.001)

    def replacer(i, steps):
        # Ten launches per launcher between replacements, whatever their speed, while they
        # launch; closing first, then replacing, every other time.
        for step in range(steps):
            if step and not launches.wait(10 * launches.workers):
                return
            shared.replace(pm.MoeInitRoutingV2Grad(x, idx, 4), close_first=step % 2 == 0)

    launchers = [launches.counted(launcher) for _ in range(THREADS - 2)]
    errors = hammer(launchers + [rebinder, replacer], iterations)
    shared.plan.close()
    assert not errors, errors[0]
    assert shared.closed_seen, "no launch met a closed plan: the test did not exercise closing"


@stress_iterations
def test_a_shared_array(device, no_leaks, case, iterations):
    c, expected = case
    x = pm.to_device(c.grad_expanded_x)
    idx = pm.to_device(c.expanded_row_idx)

    def reader(i, steps):
        with closing(pm.Stream(device)) as own:
            for _ in range(steps):
                out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=own)
                assert np.array_equal(out.to_host(own), expected)
                assert np.array_equal(x[i % 32].to_host(), c.grad_expanded_x[i % 32])

    def writer(i, steps):
        with closing(pm.Stream(device)) as own:
            for _ in range(steps):
                # Same values, so every reader's result stays exact whatever the order (ordering
                # a write after kernels of other streams that read x is the caller's, as in CUDA).
                x.copy_from_host(c.grad_expanded_x, stream=own if i % 2 else None)

    errors = hammer([reader] * (THREADS - 2) + [writer] * 2, iterations)
    assert not errors, errors[0]


@stress_iterations
def test_the_pool_and_empty_cache(device, no_leaks, case, iterations):
    c, expected = case

    def launcher(i, steps):
        for _ in range(steps):
            with closing(pm.Stream(device)) as s:  # each stream takes a workspace and gives it back
                x = pm.to_device(c.grad_expanded_x, stream=s)
                idx = pm.to_device(c.expanded_row_idx, stream=s)
                outs = [pm.moe_init_routing_v2_grad(x, idx, 4, stream=s) for _ in range(3)]
                assert all(np.array_equal(o.to_host(s), expected) for o in outs)

    def dropper(i, steps):
        for _ in range(steps):  # streams dropped with work queued: released without a wait
            s = pm.Stream(device)
            pm.moe_init_routing_v2_grad(pm.to_device(c.grad_expanded_x, stream=s),
                                        pm.to_device(c.expanded_row_idx, stream=s), 4, stream=s)
            del s

    def emptier(i, steps):
        for _ in range(steps):
            pm.empty_cache()
            pm.memory_stats()
            time.sleep(0.002)

    errors = hammer([launcher] * (THREADS - 3) + [dropper, emptier, emptier], iterations)
    assert not errors, errors[0]


def _close_under_load(x: np.ndarray, idx: np.ndarray, threads: int, iterations: int) -> None:
    """``threads`` workers launch a plan, the one call on DeviceArrays and the one call on NumPy
    arrays ``iterations`` times each, and device 0 is closed once every worker is nine tenths
    of the way (as the time-bound version closed it 0.55 s into 0.6); a worker may meet
    ClosedError, nothing else."""
    dev = pm.Device(0)
    dx, di = pm.to_device(x), pm.to_device(idx)
    plan = pm.MoeInitRoutingV2Grad(dx, di, 4)
    s = pm.Stream(dev)
    unexpected = []
    nearly_done = [threading.Event() for _ in range(threads)]

    def work(i, steps):
        for step in range(steps):
            if step == steps * 9 // 10:
                nearly_done[i].set()
            try:
                if i % 3 == 0:
                    plan(s)
                elif i % 3 == 1:
                    pm.moe_init_routing_v2_grad(dx, di, 4, stream=s).to_host(s)
                else:
                    pm.moe_init_routing_v2_grad(x, idx, 4)
            except pm.ClosedError:
                pass
            except Exception:
                unexpected.append(traceback.format_exc())

    def closer(i, steps):
        for e in nearly_done:
            e.wait(60)
        dev.close()

    errors = hammer([work] * threads + [closer], iterations)
    assert not errors, errors[0]
    assert not unexpected, unexpected[:3]


def child_close_the_device_under_load(rounds: int, threads: int, iterations: int) -> None:
    pm.use_emulator()
    x = np.ones((32, 16), np.float32)
    idx = np.arange(32, dtype=np.int32)
    for _ in range(rounds):
        _close_under_load(x, idx, threads, iterations)
    for d in pm.device.open_devices():  # the NumPy path may have opened device 0 again meanwhile
        d.close()
    st = pm.emulator.stats()
    assert st["device_allocations"] == 0 and st["streams"] == 0 and st["events"] == 0, st
    print("ok")


@stress_iterations
def test_closing_the_device_under_load(isolated, iterations):
    rounds, steps = max(5, iterations // 100), min(iterations, 50)  # short: 5 rounds of 25 steps; long: 40 of 50
    r = isolated(child_close_the_device_under_load, rounds, THREADS, steps, timeout=300 + rounds * 20)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok")


def _fwd_host(r, s=None):
    return [None if a is None else a.to_host(s) for a in r]


def _fwd_same(got, want) -> None:
    for name, g, w in zip(pm.RoutingResult._fields, got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert g.dtype == w.dtype and np.array_equal(g, w), name


@stress_iterations
def test_the_forward_shared_plan_and_stream_beside_the_backward(device, no_leaks, iterations):
    """One forward plan launched (on a stream of each launcher's and on the default stream),
    rebound, and closed and replaced meanwhile; forward one calls on a shared stream, with
    and without out=; and the pair, forward then backward on that stream. Every result is
    checked bit for bit against the NumPy reference."""
    n, k, h, e = 16, 2, 32, 4
    x = np.random.default_rng(31).standard_normal((n, h)).astype(np.float32)
    ids = routing.random_top_k(n, k, e, seed=31)
    kw = {"expert_num": e, "expert_tokens_count_or_cumsum_flag": 2}
    want = pm.reference.moe_init_routing_v2(x, ids, **kw)
    g = np.random.default_rng(32).standard_normal((n * k, h)).astype(np.float32)
    want_grad = pm.reference.moe_init_routing_v2_grad(g, want[1], k)
    dx, di = pm.to_device(x), pm.to_device(ids)
    launches = Progress()
    current = SharedPlan(pm.MoeInitRoutingV2(dx, di, **kw), launches)
    shared = pm.Stream(device)

    def launcher(i, steps):
        with closing(pm.Stream(device)) as own:
            for _ in current.steps(steps):
                plan = current.plan
                s = own if i % 2 else None
                try:
                    got = _fwd_host(plan(s), s)
                except pm.ClosedError:
                    current.met_closed(plan)
                    continue
                _fwd_same(got, want)

    def rebinder(i, steps):
        for _ in range(steps):
            try:
                current.plan.rebind(x=pm.to_device(x), expanded_x=pm.zeros((n * k, h), np.float32),
                                    expert_tokens_count_or_cumsum=pm.zeros((e,), np.int32))
            except pm.ClosedError:
                continue
            time.sleep(0.001)

    def replacer(i, steps):
        # Ten launches per launcher between replacements, whatever their speed, while they
        # launch; closing first, then replacing, every other time.
        for step in range(steps):
            if step and not launches.wait(10 * launches.workers):
                return
            current.replace(pm.MoeInitRoutingV2(dx, di, **kw), close_first=step % 2 == 0)

    def one_call(i, steps):
        out = None
        for _ in range(steps):
            r = pm.moe_init_routing_v2(pm.to_device(x, stream=shared), pm.to_device(ids, stream=shared), **kw,
                                       stream=shared, out=out)
            _fwd_same(_fwd_host(r, shared), want)
            if i % 2:
                out = r  # written again by the next call

    def pair(i, steps):
        for _ in range(steps):
            r = pm.moe_init_routing_v2(pm.to_device(x, stream=shared), pm.to_device(ids, stream=shared), **kw,
                                       stream=shared)
            grad = pm.moe_init_routing_v2_grad(pm.to_device(g, stream=shared), r.expanded_row_idx, k, stream=shared)
            assert np.array_equal(grad.to_host(shared), want_grad)

    launchers = [launches.counted(launcher) for _ in range(2)]
    errors = hammer(launchers + [rebinder, replacer, one_call, one_call, pair, pair], iterations)
    current.plan.close()
    shared.close()
    assert not errors, errors[0]
    assert current.closed_seen, "no launch met a closed plan: the test did not exercise closing"


@stress_iterations
def test_the_executor_cache(device, no_leaks, iterations):
    """More layouts of each op than a stream caches, on one shared stream and the default
    one: entries of both ops are evicted while others launch; streams made and dropped take
    and give back workspace; empty_cache() runs throughout."""
    rng = np.random.default_rng(33)
    fwd = []
    for i in range(10):
        n, k, h = 8 + i, 1 + i % 3, 8 + 4 * i
        x = rng.standard_normal((n, h)).astype(np.float32)
        ids = routing.random_top_k(n, k, 4, seed=i)
        kw = [{"expert_num": 4, "expert_tokens_count_or_cumsum_flag": 1 + i % 2},
              {"drop_pad_mode": 1, "expert_num": 4, "expert_capacity": 2, "expert_tokens_before_capacity_flag": True},
              {"active_num": n}][i % 3]
        fwd.append((pm.to_device(x), pm.to_device(ids), kw, pm.reference.moe_init_routing_v2(x, ids, **kw)))
    cases = [make_case(8, 2, 8 + 8 * i, "float32", "dropless", seed=i) for i in range(10)]
    back = [(pm.to_device(c.grad_expanded_x), pm.to_device(c.expanded_row_idx), pm.moe_init_routing_v2_grad(*c.args()))
            for c in cases]
    shared = pm.Stream(device)

    def forward(i, steps):
        for j in range(i, i + 3 * steps, 3):
            dx, di, kw, want = fwd[j % len(fwd)]
            s = shared if j % 2 else None
            _fwd_same(_fwd_host(pm.moe_init_routing_v2(dx, di, **kw, stream=s), s), want)

    def backward(i, steps):
        for j in range(i, i + 3 * steps, 3):
            x, idx, want = back[j % len(back)]
            assert np.array_equal(pm.moe_init_routing_v2_grad(x, idx, 2, stream=shared).to_host(shared), want)

    def own_stream(i, steps):
        for j in range(i, i + steps):
            with closing(pm.Stream(device)) as s:
                dx, di, kw, want = fwd[j % len(fwd)]
                for r in [pm.moe_init_routing_v2(dx, di, **kw, stream=s) for _ in range(3)]:
                    _fwd_same(_fwd_host(r, s), want)

    def emptier(i, steps):
        for _ in range(steps):
            pm.empty_cache()
            time.sleep(0.002)

    errors = hammer([forward] * 3 + [backward] * 2 + [own_stream] * 2 + [emptier], iterations)
    shared.close()
    assert not errors, errors[0]


@pytest.mark.parametrize("mode", ["async", pytest.param("lazy", marks=pytest.mark.slow)])  # lazy: slow step
def test_a_synchronize_on_one_thread_never_frees_what_another_thread_queued(device, mode):
    """Synchronizing a stream dropped everything kept alive, including what another thread
    queued during the wait: the NumPy path then copied a freed host temporary."""
    pm.emulator.set_stream_mode(mode)
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
        pm.emulator.set_stream_mode("async")


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


def test_closing_a_plan_while_another_thread_launches_it_is_safe(isolated):
    r = isolated(child_close_a_plan_while_threads_launch_it, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok")


def test_the_executor_cache_never_destroys_an_executor_in_use(device):
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


@stress_iterations
def test_layout_ids_stay_one_per_layout_while_threads_add_new_ones(device, iterations):
    """The layout-id table is published whole (readers take no lock, a new layout is added to a
    copy): threads making views of new shapes, and of shapes the others make, never see one id
    for two layouts, nor lose a layout another thread added (only a start-over of the full
    table gives a layout a new id, a higher one)."""
    base = pm.empty((4 * iterations * THREADS + 64,), np.float32)
    seen: dict[int, tuple] = {}
    lock = threading.Lock()
    clashes: list[str] = []
    fills = len(pm.array._layout_ids) + 2 * iterations * THREADS + 64 >= pm.array._LAYOUTS_MAX  # ids start over

    def worker(i, steps):
        for n in range(steps):
            for length in (1 + i * steps + n, 1 + n):  # one shape of its own, one the others make too
                v = base[:length]
                again = base[1:length + 1]  # the same layout at another address
                same = again.layout_id >= v.layout_id if fills else again.layout_id == v.layout_id
                assert again.layout == v.layout and same, (length, v.layout_id, again.layout_id)
                with lock:
                    known = seen.setdefault(v.layout_id, v.layout)
                if known != v.layout:
                    clashes.append(f"id {v.layout_id} names {known} and {v.layout}")

    errors = hammer([worker] * THREADS, iterations)
    assert not errors, errors[0]
    assert not clashes, clashes[:3]


@stress_iterations
def test_blocks_that_go_back_on_other_threads_are_never_handed_out_twice(device, no_leaks, iterations):
    """A block goes back to its shelf the moment its last user goes, on whatever thread that
    is: makers take blocks while droppers let go of the makers' arrays on their own threads
    (the shelf is appended to without the device's lock, popped under it). No block is handed
    out twice (each array reads back what was written to it), and afterwards the figures add
    up: each array one hit or one miss, nothing in use, the idle blocks freed by empty_cache.
    Sizes of their own vary step by step, so the shelves gain sizes they are found by meanwhile."""
    handed: list[list[pm.DeviceArray]] = [[] for _ in range(THREADS)]
    locks = [threading.Lock() for _ in range(THREADS)]
    progress = Progress()
    made, made_lock = [0], threading.Lock()
    st0 = pm.memory_stats()

    def maker(i, steps):
        for n in progress.steps(steps):
            for size in (128, 640, 128):  # one size all share, one of its own
                v = float(i * 100000 + n * 10 + size % 7)
                a = pm.to_device(np.full(size + (8 * i + n % 9) * (size == 640), v, np.float32))
                b = pm.empty((size,), np.float32)
                b.fill(v + 0.5)
                if not ((a.to_host() == v).all() and (b.to_host() == v + 0.5).all()):
                    raise AssertionError(f"maker {i} step {n}: a block was handed out twice")
                with locks[i]:
                    handed[i] += [a, b]  # let go of by a dropper, on its thread
                with made_lock:
                    made[0] += 2
                del a, b

    def dropper(i, steps):
        mine = i - THREADS // 2
        while progress.running:
            with locks[mine]:
                gone, handed[mine] = handed[mine], []
            del gone  # (the blocks go back to their shelves here, on this thread)
            time.sleep(0)

    half = THREADS // 2
    errors = hammer([progress.counted(maker) for _ in range(half)] + [dropper] * half, iterations)
    assert not errors, errors[0]
    for h in handed:
        h.clear()
    pm.empty_cache()
    st = pm.memory_stats()
    assert st["array_hits"] + st["array_misses"] - st0["array_hits"] - st0["array_misses"] == made[0], (st, made)
    assert st["array_bytes_in_use"] == 0 or st["array_bytes_in_use"] == st["workspace_bytes"], st
    assert st["array_bytes_idle"] == 0 and st["array_blocks_idle"] == 0, st
