"""Threaded stress tests, one per shared object: a stream, a plan, an array, the workspace pool,
the executor cache, a device being closed, and the forward's plan and one call beside the
backward's. Each runs 8 threads for PYACL_MOE_STRESS_SECONDS
(3 s by default, 20 s under ``-m slow``) with the interpreter switching threads every
microsecond, checks every result bit for bit, and leaves the emulator's live counters where
it found them."""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import closing

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import routing
from pyacl_moe.tools.cases import make_case

SECONDS = float(os.environ.get("PYACL_MOE_STRESS_SECONDS", "3"))
LONG_SECONDS = float(os.environ.get("PYACL_MOE_STRESS_LONG_SECONDS", "20"))
THREADS = 8

# Every stress test runs SECONDS in the default run and LONG_SECONDS under -m slow.
duration = pytest.mark.parametrize(
    "seconds", [SECONDS, pytest.param(LONG_SECONDS, marks=pytest.mark.slow)], ids=["short", "long"]
)


def hammer(workers, seconds: float) -> list[BaseException]:
    """Run each ``worker(stop, i)`` on its own thread for ``seconds``; return what they raised."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(fn, i):
        try:
            fn(stop, i)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=run, args=(w, i)) for i, w in enumerate(workers)]
    try:
        for t in threads:
            t.start()
        time.sleep(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return errors


@pytest.fixture(scope="module")
def case():
    c = make_case(32, 4, 64, "float32", "dropless", seed=21)
    return c, pm.moe_init_routing_v2_grad(*c.args())  # the kernel is deterministic: bit-exact


@duration
def test_a_shared_stream(device, no_leaks, case, seconds):
    c, expected = case
    shared = pm.Stream(device)

    def worker(stop, i):
        while not stop.is_set():
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

    errors = hammer([worker] * THREADS, seconds)
    shared.close()
    assert not errors, errors[0]


@duration
def test_a_shared_plan(device, no_leaks, case, seconds):
    c, expected = case
    x, idx = pm.to_device(c.grad_expanded_x), pm.to_device(c.expanded_row_idx)
    current = [pm.MoeInitRoutingV2Grad(x, idx, 4)]
    swap = threading.Lock()
    closed_seen = []

    def launcher(stop, i):
        with closing(pm.Stream(device)) as own:
            while not stop.is_set():
                plan = current[0]
                s = own if i % 2 else None
                try:
                    out = plan(s)
                    got = out.to_host(s)
                except pm.ClosedError:
                    closed_seen.append(1)
                    continue
                assert np.array_equal(got, expected)

    def rebinder(stop, i):
        while not stop.is_set():
            plan = current[0]
            try:
                plan.rebind(grad_expanded_x=pm.to_device(c.grad_expanded_x), out=pm.empty((32, 64), np.float32))
            except pm.ClosedError:
                continue
            time.sleep(0.001)

    def replacer(stop, i):
        while not stop.is_set():
            time.sleep(0.02)
            with swap:
                old, current[0] = current[0], pm.MoeInitRoutingV2Grad(x, idx, 4)
            old.close()

    errors = hammer([launcher] * (THREADS - 2) + [rebinder, replacer], seconds)
    current[0].close()
    assert not errors, errors[0]
    assert closed_seen, "no launch met a closed plan: the test did not exercise closing"


@duration
def test_a_shared_array(device, no_leaks, case, seconds):
    c, expected = case
    x = pm.to_device(c.grad_expanded_x)
    idx = pm.to_device(c.expanded_row_idx)

    def reader(stop, i):
        with closing(pm.Stream(device)) as own:
            while not stop.is_set():
                out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=own)
                assert np.array_equal(out.to_host(own), expected)
                assert np.array_equal(x[i % 32].to_host(), c.grad_expanded_x[i % 32])

    def writer(stop, i):
        with closing(pm.Stream(device)) as own:
            while not stop.is_set():
                # Same values, so every reader's result stays exact; the writes must still wait
                # for (or be ordered after) the kernels that read x.
                x.copy_from_host(c.grad_expanded_x, stream=own if i % 2 else None)

    errors = hammer([reader] * (THREADS - 2) + [writer] * 2, seconds)
    assert not errors, errors[0]


@duration
def test_the_pool_and_empty_cache(device, no_leaks, case, seconds):
    c, expected = case

    def launcher(stop, i):
        while not stop.is_set():
            with closing(pm.Stream(device)) as s:  # each stream takes a workspace and gives it back
                x = pm.to_device(c.grad_expanded_x, stream=s)
                idx = pm.to_device(c.expanded_row_idx, stream=s)
                outs = [pm.moe_init_routing_v2_grad(x, idx, 4, stream=s) for _ in range(3)]
                assert all(np.array_equal(o.to_host(s), expected) for o in outs)

    def dropper(stop, i):
        while not stop.is_set():  # streams dropped with work queued: released without a wait
            s = pm.Stream(device)
            pm.moe_init_routing_v2_grad(pm.to_device(c.grad_expanded_x, stream=s),
                                        pm.to_device(c.expanded_row_idx, stream=s), 4, stream=s)
            del s

    def emptier(stop, i):
        while not stop.is_set():
            pm.empty_cache()
            pm.memory_stats()
            time.sleep(0.002)

    errors = hammer([launcher] * (THREADS - 3) + [dropper, emptier, emptier], seconds)
    assert not errors, errors[0]


@duration
def test_closing_the_device_under_load(isolated, seconds):
    rounds = max(5, int(seconds / 0.6))
    r = isolated(f"""
import sys, threading, time, numpy as np, pyacl_moe as pm
pm.use_emulator()
sys.setswitchinterval(1e-6)
x = np.ones((32, 16), np.float32); idx = np.arange(32, dtype=np.int32)
for round_ in range({rounds}):
    dev = pm.Device(0)
    dx, di = pm.to_device(x), pm.to_device(idx)
    plan = pm.MoeInitRoutingV2Grad(dx, di, 4)
    s = pm.Stream(dev)
    stop = threading.Event(); unexpected = []
    def work(i):
        while not stop.is_set():
            try:
                if i % 3 == 0: plan(s)
                elif i % 3 == 1: pm.moe_init_routing_v2_grad(dx, di, 4, stream=s).to_host(s)
                else: pm.moe_init_routing_v2_grad(x, idx, 4)
            except pm.ClosedError:
                pass
            except Exception as e:
                unexpected.append(repr(e))
    ts = [threading.Thread(target=work, args=(i,)) for i in range({THREADS})]
    [t.start() for t in ts]
    time.sleep(0.55)
    dev.close()
    time.sleep(0.05)
    stop.set(); [t.join() for t in ts]
    assert not unexpected, unexpected[:3]
for d in pm.device.open_devices():   # the NumPy path may have opened device 0 again meanwhile
    d.close()
st = pm.emulator.stats()
assert st['device_allocations'] == 0 and st['streams'] == 0 and st['events'] == 0, st
print('ok')
""", timeout=300 + 2 * seconds)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok")


def _fwd_host(r, s=None):
    return [None if a is None else a.to_host(s) for a in r]


def _fwd_same(got, want) -> None:
    for name, g, w in zip(pm.RoutingResult._fields, got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert g.dtype == w.dtype and np.array_equal(g, w), name


@duration
def test_the_forward_shared_plan_and_stream_beside_the_backward(device, no_leaks, seconds):
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
    current = [pm.MoeInitRoutingV2(dx, di, **kw)]
    shared = pm.Stream(device)
    closed_seen = []

    def launcher(stop, i):
        with closing(pm.Stream(device)) as own:
            while not stop.is_set():
                s = own if i % 2 else None
                try:
                    got = _fwd_host(current[0](s), s)
                except pm.ClosedError:
                    closed_seen.append(1)
                    continue
                _fwd_same(got, want)

    def rebinder(stop, i):
        while not stop.is_set():
            try:
                current[0].rebind(x=pm.to_device(x), expanded_x=pm.zeros((n * k, h), np.float32),
                                  expert_tokens_count_or_cumsum=pm.zeros((e,), np.int32))
            except pm.ClosedError:
                continue
            time.sleep(0.001)

    def replacer(stop, i):
        while not stop.is_set():
            time.sleep(0.002)
            old, current[0] = current[0], pm.MoeInitRoutingV2(dx, di, **kw)
            old.close()

    def one_call(stop, i):
        out = None
        while not stop.is_set():
            r = pm.moe_init_routing_v2(pm.to_device(x, stream=shared), pm.to_device(ids, stream=shared), **kw,
                                       stream=shared, out=out)
            _fwd_same(_fwd_host(r, shared), want)
            if i % 2:
                out = r  # written again by the next call

    def pair(stop, i):
        while not stop.is_set():
            r = pm.moe_init_routing_v2(pm.to_device(x, stream=shared), pm.to_device(ids, stream=shared), **kw,
                                       stream=shared)
            grad = pm.moe_init_routing_v2_grad(pm.to_device(g, stream=shared), r.expanded_row_idx, k, stream=shared)
            assert np.array_equal(grad.to_host(shared), want_grad)

    errors = hammer([launcher, launcher, rebinder, replacer, one_call, one_call, pair, pair], seconds)
    current[0].close()
    shared.close()
    assert not errors, errors[0]
    assert closed_seen, "no launch met a closed plan: the test did not exercise closing"


@duration
def test_the_executor_cache(device, no_leaks, seconds):
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

    def forward(stop, i):
        j = i
        while not stop.is_set():
            dx, di, kw, want = fwd[j % len(fwd)]
            s = shared if j % 2 else None
            _fwd_same(_fwd_host(pm.moe_init_routing_v2(dx, di, **kw, stream=s), s), want)
            j += 3

    def backward(stop, i):
        j = i
        while not stop.is_set():
            x, idx, want = back[j % len(back)]
            assert np.array_equal(pm.moe_init_routing_v2_grad(x, idx, 2, stream=shared).to_host(shared), want)
            j += 3

    def own_stream(stop, i):
        j = i
        while not stop.is_set():
            with closing(pm.Stream(device)) as s:
                dx, di, kw, want = fwd[j % len(fwd)]
                for r in [pm.moe_init_routing_v2(dx, di, **kw, stream=s) for _ in range(3)]:
                    _fwd_same(_fwd_host(r, s), want)
            j += 1

    def emptier(stop, i):
        while not stop.is_set():
            pm.empty_cache()
            time.sleep(0.002)

    errors = hammer([forward] * 3 + [backward] * 2 + [own_stream] * 2 + [emptier], seconds)
    shared.close()
    assert not errors, errors[0]
