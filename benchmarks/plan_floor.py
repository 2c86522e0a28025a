"""The plan overhead's floor for each way of taking the stream's lock (BENCHMARKS.md).

Each row replaces ``Plan.__call__``'s steady state with a skeleton: the frame, the slot lookup,
the bound foreign call and the lock as named; no context check, no fault flag, no stamp. They
are measurements, not correct code. Run: ``python benchmarks/plan_floor.py [RUNS]``.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import pyacl_moe as pm
from pyacl_moe.op import plan as plan_module
from pyacl_moe.tools import bench

_RLOCK = threading.RLock()


def no_lock(self: Any, stream: Any = None, workspace: Any = None) -> Any:
    s, slot = self._now
    if s is stream:
        return slot.call()
    return self._launch(stream, workspace)


def with_lock(self: Any, stream: Any = None, workspace: Any = None) -> Any:
    s, slot = self._now
    if s is stream:
        with slot.state.lock:
            return slot.call()
    return self._launch(stream, workspace)


def acquire_release(self: Any, stream: Any = None, workspace: Any = None) -> Any:
    # Not interrupt-safe: an interrupt between the acquire and the try leaves the lock held.
    s, slot = self._now
    if s is stream:
        lock = slot.state.lock
        lock.acquire()
        try:
            return slot.call()
        finally:
            lock.release()
    return self._launch(stream, workspace)


def rlock_if_owned(self: Any, stream: Any = None, workspace: Any = None) -> Any:
    # Interrupt-safe, through RLock's private _is_owned().
    s, slot = self._now
    if s is stream:
        try:
            _RLOCK.acquire()
            return slot.call()
        finally:
            if _RLOCK._is_owned():  # type: ignore[attr-defined]
                _RLOCK.release()
    return self._launch(stream, workspace)


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    pm.use_emulator()
    today = plan_module.Plan.__call__
    rows = [("today's (lock, checks, stamp)", today), ("no lock", no_lock), ("with state.lock:", with_lock),
            ("acquire()/release()", acquire_release), ("RLock, released if _is_owned()", rlock_if_owned)]
    sizes = bench.QUICK
    try:
        for name, call in rows:
            plan_module.Plan.__call__ = call  # type: ignore[method-assign]
            figures = []
            for _ in range(runs):
                h = bench._host_costs(sizes.calls, sizes.batches)
                figures.append(f"{h['overhead'] / h['ffi']:.2f}")
            print(f"{name:32s} {', '.join(figures)} units", flush=True)
    finally:
        plan_module.Plan.__call__ = today  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
