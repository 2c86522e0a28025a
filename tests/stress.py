"""The stress helper: worker callables on threads of their own, each bounded by a number of
iterations (not by a time, so that a test costs what its work costs on any machine), with the
interpreter switching threads every microsecond meanwhile so that races show up. A worker whose
job is to interfere with the others (synchronize, empty a cache, replace a plan) paces itself
by their Progress instead of by the clock.

A stress test takes ``iterations`` from the ``stress_iterations`` parametrisation: ITERATIONS in
the default run (PYACL_MOE_STRESS_ITERATIONS, 25 unless set), LONG_ITERATIONS in its soak
variant, marked slow (PYACL_MOE_STRESS_LONG_ITERATIONS, 4000 unless set).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

ITERATIONS = int(os.environ.get("PYACL_MOE_STRESS_ITERATIONS", "25"))
LONG_ITERATIONS = int(os.environ.get("PYACL_MOE_STRESS_LONG_ITERATIONS", "4000"))

stress_iterations = pytest.mark.parametrize(
    "iterations", [ITERATIONS, pytest.param(LONG_ITERATIONS, marks=pytest.mark.slow)], ids=["short", "long"]
)

Worker = Callable[[int, int], object]


def hammer(workers: Sequence[Worker], iterations: int, *, switch_interval: float | None = 1e-6,
           timeout: float = 120.0) -> list[BaseException]:
    """Run each ``worker(i, iterations)`` on a thread of its own (``i``: its index in
    ``workers``; each loops ``iterations`` times), all starting at once, and wait for them all;
    return what they raised, in the order they raised it. The interpreter switches threads
    every ``switch_interval`` seconds meanwhile (None: leave it as it is). Raises
    AssertionError naming the workers still running ``timeout`` seconds after the start: they
    hung."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(workers))  # they all start together, not as each thread is made

    def run(fn: Worker, i: int) -> None:
        try:
            start.wait(timeout)
            fn(i, iterations)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w, i), name=f"worker {i} ({getattr(w, '__name__', w)})",
                                daemon=True) for i, w in enumerate(workers)]
    interval = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    finally:
        sys.setswitchinterval(interval)
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"hung after {timeout:g} s: {', '.join(hung)}"
    return errors


class Progress:
    """The steps some workers have done, for others to pace themselves by. The counted workers
    are given to hammer as ``progress.counted(worker)``, one call per thread, and loop over
    ``progress.steps(n)``; an interfering worker loops ``while progress.running``, or waits for
    ``progress.wait(k)`` (k more steps) between its own."""

    def __init__(self) -> None:
        self.workers = 0
        self._cond = threading.Condition()
        self._done = 0
        self._running = 0

    def counted(self, worker: Worker) -> Worker:
        """``worker``, counted from now until it returns or raises."""
        with self._cond:
            self.workers += 1
            self._running += 1

        def run(i: int, iterations: int) -> None:
            try:
                worker(i, iterations)
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

        run.__name__ = getattr(worker, "__name__", "worker")
        return run

    def steps(self, n: int) -> Iterator[int]:
        """range(n) for a counted worker: each step is counted once its body is done."""
        for i in range(n):
            yield i
            with self._cond:
                self._done += 1
                self._cond.notify_all()

    @property
    def running(self) -> bool:
        """Whether any counted worker is still at work."""
        return self._running > 0

    def wait(self, k: int, timeout: float = 60.0) -> bool:
        """Wait for ``k`` more steps; False if the counted workers finished first. Each counted
        worker is in one step at most: after a change, ``workers + 1`` more steps include one
        begun after it."""
        with self._cond:
            target = self._done + k
            self._cond.wait_for(lambda: self._done >= target or not self._running, timeout)
            return self._done >= target
