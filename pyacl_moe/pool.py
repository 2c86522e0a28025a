"""Workspaces, the memory figures and empty_cache.

Each stream holds one workspace block while it lives (``StreamState.workspace``, guarded by the
stream's lock): launches on a stream run in order, so every launch on it may share that block,
and the steady state allocates nothing. The block comes from the device's block cache like any
array's and goes back to it once no queued work uses it (its stream closed, or it was replaced
by a larger one). :func:`empty_cache` gives the memory back to CANN: idle blocks at once, the
streams' workspaces and cached executors once their queued work is done.
"""

from __future__ import annotations

import threading

from . import _lifetime
from .allocator import Allocation, allocate, cache_stats, trim_caches
from .device import Device, open_devices, resolve_device
from .stream import StreamState

__all__ = ["empty_cache", "memory_stats", "workspace_for"]

_counts_lock = threading.Lock()  # guards _takes
_takes: dict[Device, int] = {}  # device -> workspaces taken or grown on its streams


def workspace_for(state: StreamState, nbytes: int) -> Allocation:
    """The stream's workspace, at least ``nbytes`` (made or grown here). Call with no stream
    lock held; the caller then holds the block in its launch, since another thread may
    replace the stream's workspace (empty_cache, a larger request) meanwhile."""
    ws = state.workspace
    if ws is not None and ws.nbytes >= nbytes:
        return ws  # type: ignore[no-any-return]
    block = allocate(state.device, nbytes)
    with _counts_lock:
        _takes[state.device] = _takes.get(state.device, 0) + 1
    with state.lock:
        state.check_open()
        old = state.workspace
        if old is not None and old.nbytes >= nbytes:
            return old  # type: ignore[no-any-return]  # another thread got there first (ours goes back)
        state.workspace = block
    if old is not None:
        state.retire(old)  # launches queued before may still use it
    return block


def memory_stats(device: Device | int | None = None) -> dict[str, int]:
    """Memory figures for a device (default: the current one): its streams' workspaces
    (``workspace_blocks`` streams hold ``workspace_bytes``; ``workspace_takes`` times a stream
    took or grew one), and the block caches of DeviceArrays and workspaces (``array_*``) and of
    pinned host memory (``pinned_*``): hits, misses, bytes idle and in use, blocks idle."""
    dev = resolve_device(device)
    held = [q.workspace for q in dev.queues() if isinstance(q, StreamState) and q.workspace is not None]
    with _counts_lock:
        takes = _takes.get(dev, 0)
    stats = {"workspace_blocks": len(held), "workspace_bytes": sum(w.nbytes for w in held),
             "workspace_takes": takes}
    stats.update(cache_stats(dev))
    return stats


def empty_cache(device: Device | int | None = None) -> None:
    """Release what is cached for speed on ``device`` (all open devices if None): each
    stream's cached executors and workspace, once the work queued on the stream is done, and
    the idle blocks of the DeviceArray and pinned caches at once. Never waits for the device."""
    devices = [resolve_device(device)] if device is not None else open_devices()
    for dev in devices:
        if not dev.closed:
            for q in dev.queues():
                q.drop_caches()
    _lifetime.collect()  # what died goes to the block caches first, then they are emptied
    for dev in devices:
        if not dev.closed:
            trim_caches(dev)
