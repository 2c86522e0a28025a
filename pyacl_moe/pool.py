"""The workspace pool: device memory for the ops' workspaces, cached per device and per stream.

Each stream keeps one workspace block while it lives (its *workspace*): launches on a stream
run in order, so every launch on it may share that block, and the steady state allocates
nothing. A block goes back to the device's pool only once no queued work uses it (its stream
was closed, or ran everything before being dropped), so any stream may take it at once, with no
event. :func:`empty_cache` gives the memory back to CANN: idle blocks at once, blocks of live
streams once their queued work is done. Lock order: a stream's lock, then the pool's.
"""

from __future__ import annotations

import threading
from typing import Any

from . import _lifetime
from .allocator import Allocation, allocate, cache_stats, on_memory_pressure, trim_caches
from .device import Device, open_devices, resolve_device
from .stream import StreamState

__all__ = ["WORKSPACE", "WorkspacePool", "empty_cache", "memory_stats", "workspace_for"]

WORKSPACE = "workspace"  # key of a stream's workspace in its caches
_MIB = 1 << 20


def _fits(block: Allocation, nbytes: int) -> bool:
    # Big enough, and not wastefully bigger (a 16 MiB request never pins a 1 GiB block).
    return nbytes <= block.nbytes <= 2 * nbytes + _MIB


class WorkspacePool:
    """A device's idle workspace blocks. ``lock`` guards every field."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.lock = threading.Lock()
        self.idle: list[Allocation] = []
        # every live block it made, and the stream that took it last
        self.blocks: _lifetime.WeakMap[Allocation, StreamState] = _lifetime.WeakMap()
        self.hits = 0
        self.misses = 0
        self.cross_stream = 0

    def take(self, nbytes: int, state: StreamState) -> Allocation:
        """An idle block of at least ``nbytes`` (allocating one on a miss). Call with no
        stream lock held: a miss allocates, which is a safe point."""
        with self.lock:
            best = None
            for b in self.idle:
                if _fits(b, nbytes) and (best is None or b.nbytes < best.nbytes):
                    best = b
            if best is not None:
                i = self.idle.index(best)
                del self.idle[i]
                self.hits += 1
                if self.blocks.get(best) not in (None, state):
                    self.cross_stream += 1
                self.blocks.set(best, state)
                return best
        block = allocate(self.device, nbytes)
        with self.lock:
            self.misses += 1
            self.blocks.set(block, state)
        return block

    def give(self, block: Allocation) -> None:
        """Return a block no queued work uses."""
        if block.device.closed:
            return
        with self.lock:
            self.idle.append(block)

    def trim(self) -> None:
        """Give the idle blocks back to CANN."""
        with self.lock:
            idle, self.idle = self.idle, []
        del idle
        _lifetime.collect()

    def stats(self) -> dict[str, int]:
        with self.lock:
            blocks = self.blocks.keys()
            return {
                "hits": self.hits,
                "misses": self.misses,
                "cross_stream_reuses": self.cross_stream,
                "blocks_free": len(self.idle),
                "blocks_in_use": len(blocks) - len(self.idle),
                "bytes_held": sum(b.nbytes for b in blocks),
            }


Device.attachments["workspace_pool"] = WorkspacePool
on_memory_pressure(lambda device: device.attached("workspace_pool").trim())


class _StreamWorkspace:
    """A stream's workspace block, in the stream's caches."""

    __slots__ = ("pool", "block")

    def __init__(self, pool: WorkspacePool, block: Allocation) -> None:
        self.pool = pool
        self.block = block

    def release(self, idle: bool) -> list[Any]:
        """The stream stops using it: back to the pool when the stream ran everything (idle),
        else to be kept until its queued work is done (then freed)."""
        if idle:
            self.pool.give(self.block)
            return []
        return [self.block]


def workspace_for(state: StreamState, nbytes: int) -> Allocation:
    """The stream's workspace, at least ``nbytes`` (made or grown here). Call with no stream
    lock held; the caller then holds the block in its launch, since another thread may
    replace the stream's workspace (empty_cache, a larger request) meanwhile."""
    ws = state.caches.get(WORKSPACE)
    if ws is not None and ws.block.nbytes >= nbytes:
        return ws.block  # type: ignore[no-any-return]
    pool: WorkspacePool = state.device.attached("workspace_pool")
    block = pool.take(nbytes, state)
    old = mine = None
    with state.lock:
        state.check_open()
        ws = state.caches.get(WORKSPACE)
        if ws is not None and ws.block.nbytes >= nbytes:
            mine, block = block, ws.block  # another thread got there first
        else:
            old = ws.block if ws is not None else None
            state.caches[WORKSPACE] = _StreamWorkspace(pool, block)
    if mine is not None:
        pool.give(mine)
    if old is not None:
        state.retire(old)  # launches queued before may still use it
    return block


def memory_stats(device: Device | int | None = None) -> dict[str, int]:
    """Memory figures for a device (default: the current one). The workspace pool: hits,
    misses, cross-stream reuses, blocks free and in use, bytes held. The block caches of
    DeviceArrays (``array_*``) and of pinned host memory (``pinned_*``): hits, misses,
    bytes idle and in use, blocks idle."""
    dev = resolve_device(device)
    stats: dict[str, int] = dev.attached("workspace_pool").stats()
    stats.update(cache_stats(dev))
    return stats


def empty_cache(device: Device | int | None = None) -> None:
    """Release what is cached for speed on ``device`` (all open devices if None): each
    stream's cached executors and workspace, once the work queued on the stream is done, and
    the idle blocks of the workspace pool and of the DeviceArray and pinned caches at once.
    Never waits for the device."""
    devices = [resolve_device(device)] if device is not None else open_devices()
    for dev in devices:
        if dev.closed:
            continue
        for q in dev.queues():
            q.drop_caches()
        dev.attached("workspace_pool").trim()
    _lifetime.quiesce()  # what died goes to the block caches first, then they are emptied
    for dev in devices:
        if not dev.closed:
            trim_caches(dev)
