"""The shape of a warm call, measured, not guessed: the package's Python frames it runs, the
locks it releases and the locks it creates, counted with sys.setprofile (ARCHITECTURE.md,
"Costs"). Warm means every cache it uses is filled: the memo of checks, the stream's executor
and workspace, the device's idle blocks."""

from __future__ import annotations

import statistics
import sys
import threading
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

import pyacl_moe as pm

PACKAGE = str(Path(pm.__file__).parent)
RELEASES = {"lock.__exit__", "lock.release", "RLock.__exit__", "RLock.release"}
MAKERS = {"allocate_lock", "allocate", "RLock", "Lock"}


def shape(fn: Callable[[], object]) -> tuple[int, int, int]:
    """(package frames, locks released, locks created) of one call of ``fn``."""
    frames, released, made = [0], [0], [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            frames[0] += 1
        elif event == "c_call":
            name = getattr(arg, "__qualname__", "")
            released[0] += name in RELEASES
            made[0] += name in MAKERS

    real = threading.Lock, threading.RLock

    def counted(maker):  # CPython 3.13's Lock is a type: its calls are no c_call event
        def make(*args):
            made[0] += 1
            return maker(*args)
        return make

    threading.Lock, threading.RLock = counted(real[0]), counted(real[1])
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.Lock, threading.RLock = real
    return frames[0], released[0], made[0]


def typical(fn: Callable[[], object], calls: int = 40) -> tuple[int, int, int]:
    """The median of each count over ``calls`` calls (a fence falls on one call in
    StreamState.FENCE_EVERY, and costs two foreign calls and their frames there)."""
    got = [shape(fn) for _ in range(calls)]
    return tuple(int(statistics.median(g[i] for g in got)) for i in range(3))  # type: ignore[return-value]


@pytest.fixture
def warm(device):
    with closing(pm.Stream(device)) as s:
        yield device, s
        s.synchronize()


def test_the_numpy_call_of_the_backward(warm):
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    idx = np.random.default_rng(1).permutation(16).astype(np.int32)
    call = lambda: pm.moe_init_routing_v2_grad(x, idx, 2)  # noqa: E731 - 8 tokens, K 2, H 64
    for _ in range(5):
        call()
    frames, released, made = typical(call, 10)
    assert frames <= 80 and released <= 10 and made == 0, (frames, released, made)


def test_the_device_one_call_of_the_backward_given_out(warm):
    device, s = warm
    x = pm.to_device(np.ones((16, 64), np.float32), stream=s)
    idx = pm.to_device(np.arange(16, dtype=np.int32), stream=s)
    out = pm.empty((8, 64), np.float32, stream=s)
    call = lambda: pm.moe_init_routing_v2_grad(x, idx, 2, out=out, stream=s)  # noqa: E731
    for _ in range(5):
        call()
    frames, released, made = typical(call)
    assert frames <= 5 and released <= 1 and made == 0, (frames, released, made)


def test_the_forward_one_call_making_its_outputs(warm):
    device, s = warm
    x = pm.to_device(np.ones((8, 64), np.float32), stream=s)
    ids = pm.to_device(pm.routing.random_top_k(8, 2, 4, seed=0), stream=s)
    call = lambda: pm.moe_init_routing_v2(x, ids, expert_num=4, expert_tokens_count_or_cumsum_flag=1,  # noqa: E731
                                          stream=s)
    for _ in range(50):  # the outputs each call drops are taken again by the next, on its stream
        call()
    frames, released, made = typical(call)
    assert frames <= 20 and released <= 3 and made == 0, (frames, released, made)


def test_a_plans_launch(warm):
    device, s = warm
    x = pm.to_device(np.ones((16, 64), np.float32), stream=s)
    idx = pm.to_device(np.arange(16, dtype=np.int32), stream=s)
    with pm.MoeInitRoutingV2Grad(x, idx, 2) as plan:
        plan(s)
        frames, released, made = typical(lambda: plan(s))
        assert frames <= 1 and released <= 1 and made == 0, (frames, released, made)
