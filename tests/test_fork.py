"""fork(): in a child of a process that initialized CANN every inherited object is dead, every
use raises ClosedError, and the child never waits for a lock a parent thread held."""

from __future__ import annotations

import gc
import os
import threading
import time
from contextlib import closing

import numpy as np

import pyacl_moe as pm


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


def test_fork_while_another_thread_is_inside_never_hangs_the_child(isolated):
    r = isolated(child_fork_while_another_thread_is_inside, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout


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
        with plan._c.lock, plan._c.executor.holder.lock, s.state.lock:
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


def test_a_fork_child_never_waits_for_a_lock_a_parent_thread_held(isolated):
    """In a fork() child, closing, rebinding or dropping an inherited plan took the plan's,
    its executor's and its stream's locks, which a parent thread may have held at fork (the
    child then hung), and called CANN (AclRuntimeError 100001 instead of nothing)."""
    r = isolated(child_fork_while_a_thread_holds_the_plans_locks, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("child 0"), r.stdout + r.stderr


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


def test_fork_while_threads_are_inside_the_forward_never_hangs_the_child(isolated):
    """test_11's method on the forward: the parent's threads run the forward's one calls,
    its plan (launched and rebound) and routing on the device while it forks; in each child
    every inherited forward object raises ClosedError, closing the plan is quiet, and the
    child exits. Before defect 19 was fixed the children hung or raised AclRuntimeError."""
    r = isolated(child_fork_while_threads_are_inside_the_forward, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout


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


def test_a_fork_child_gets_closed_error_from_every_stream_use_never_a_parent_threads_lock(isolated):
    """In a fork() child whose parent had threads inside a stream (its lock held at fork), the
    one call on DeviceArrays (stream given, default stream, output made, own workspace),
    copies, waits and queries raise ClosedError and never wait for that lock."""
    r = isolated(child_fork_while_a_thread_holds_the_streams_locks, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout


def child_fork_with_caching_off_while_a_thread_holds_the_devices_lock() -> None:
    pm.use_emulator()
    dev = pm.Device(0)
    pm.set_caching(False)  # every safe point frees what went idle: it must not do so in the child
    a = pm.empty((1024,), np.uint8)
    held, go = threading.Event(), threading.Event()

    def hold():
        with dev.lock:  # as a thread inside an allocation would
            held.set()
            go.wait()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        a.close()  # a safe point: it took the lock a parent thread held, and hung
        os._exit(0)
    go.set()
    t.join()
    print("child exit", wait_child(pid, 10))
    print("ok")


def test_a_fork_child_with_caching_off_frees_nothing_and_never_waits_at_a_safe_point(isolated):
    """With caching off every safe point frees what went idle; in a fork() child it took the
    device's lock, which a parent thread held at fork(), and hung."""
    r = isolated(child_fork_with_caching_off_while_a_thread_holds_the_devices_lock)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "child exit 0" in r.stdout and r.stdout.strip().endswith("ok"), r.stdout
