"""Device and pinned host memory: allocations, what the binding knows of the work queued on
them, and the one block cache per device (and one for pinned memory).

An :class:`Allocation` is one block shared by the DeviceArrays that view it and by the queued
work that uses it. When the last of them is gone (queued work holds it on its stream's ledger
until it is known complete), its block goes to the device's :class:`BlockCache`, idle, and the
next allocation of the same rounded size takes it, on any stream, with no event. A stream's
workspace is one such block the stream holds (:mod:`.pool`). On real CANN this matters more
than the call itself: aclrtFree may synchronize the device.

A :class:`Track` is what the binding knows of work on a piece of memory: the streams that
queued work using it (a host write waits for them), those that wrote it (a read back waits for
them), and its latest write (the fault rule: :mod:`.stream`). Every Allocation has one; two
wrappers of the same foreign memory (``from_pointer``, ``from_torch``) share one.

The caches give their idle blocks back on ``empty_cache()``, when an allocation fails for lack
of memory (then it retries once), and when the device closes; ``set_caching(False)`` (or
``PYACL_MOE_CACHE_ALLOCATIONS=0`` at import) frees every block as soon as it is idle.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _args, _lifetime
from ._cann import acl
from ._cann.errcheck import check
from .device import Device, open_devices, resolve_device
from .errors import AclRuntimeError, InvalidArgument

__all__ = ["Allocation", "BlockCache", "Track", "allocate", "borrowed", "cache_stats", "caching", "is_pinned",
           "on_memory_pressure", "pinned_block", "pinned_empty", "set_caching", "trim_caches"]

_ROUND = 512  # CANN aligns device blocks to at least this; rounding makes sizes meet in bins
_OOM = (207001, 207018)  # ACL_ERROR_RT_MEMORY_ALLOCATION, ACL_ERROR_RT_DEVICE_OOM


def _rounded(nbytes: int) -> int:
    return max(_ROUND, -(-nbytes // _ROUND) * _ROUND)


def _env_caching() -> bool:
    value = os.environ.get("PYACL_MOE_CACHE_ALLOCATIONS", "1").strip()
    if value not in ("0", "1"):
        raise InvalidArgument("PYACL_MOE_CACHE_ALLOCATIONS", f"must be 0 or 1, got {value!r}")
    return value == "1"


# Read without a lock: a stale answer only keeps or frees one block. None until the first
# allocation reads the environment: a bad value is refused there, by name, not at import.
_caching: list[bool | None] = [None]


def _read_caching() -> None:
    if _caching[0] is None:
        _caching[0] = _env_caching()


def caching() -> bool:
    """Whether idle blocks are kept for reuse (the default)."""
    _read_caching()
    return bool(_caching[0])


def set_caching(enabled: bool) -> None:
    """Keep idle device and pinned blocks for reuse (True, the default) or free each one as
    soon as it is idle (False; what is cached now is freed)."""
    if not isinstance(enabled, bool):
        raise InvalidArgument("enabled", f"must be a bool, got {type(enabled).__name__}")
    _caching[0] = enabled
    if not enabled:
        for dev in open_devices():
            trim_caches(dev)


# ---------------------------------------------------------------------------- block caches

class BlockCache:
    """A device's idle blocks of one kind ("device" or "pinned"), by rounded size.

    ``lock`` guards every field. ``made`` lists every handle the cache's blocks got and that
    is not yet freed: a handle is on one block (``_Block.mem``), idle, or being freed. Moves
    between those places clear the old place before filling the new one, so an interrupt
    between the two leaves a handle in none (never in two): :meth:`trim` frees such strays
    too, so an interrupt never loses memory for good, and never hands one block out twice.
    Freeing is once per handle (its slot), so a free an interrupt cut short is made again."""

    def __init__(self, device: Device, kind: str) -> None:
        self.device = device
        self.kind = kind
        self.lock = threading.Lock()
        self.idle: dict[int, list[Any]] = {}  # rounded size -> idle memory handles, newest last
        self.made: dict[Any, None] = {}  # every handle not yet freed
        self.closed = False
        self.hits = 0
        self.misses = 0
        self.bytes_idle = 0
        self.bytes_in_use = 0

    def take_into(self, block: _Block, state: Any = None) -> tuple[Any, ...] | None:
        """Give ``block`` an idle handle of its size: one no queued work uses any more, or, for
        memory about to be used on stream ``state``, one only ``state``'s queued work still
        uses (stream order puts the new work after it). Returns the streams whose work may
        still use it (the new allocation's Track takes them), or None when none is idle."""
        with self.lock:
            return self._take(block, state)

    def _take(self, block: _Block, state: Any) -> tuple[Any, ...] | None:
        # (lock held; a loop under a lock is a function of its own: ARCHITECTURE.md)
        blocks = self.idle.get(block.size)
        if blocks:
            for i in range(len(blocks) - 1, -1, -1):
                mem, pending = blocks[i]
                streams = _unfinished(pending) if pending else ()
                if streams and (len(streams) > 1 or streams[0] is not state):
                    continue
                del blocks[i]
                block.mem = mem
                self.bytes_idle -= block.size
                self.bytes_in_use += block.size
                self.hits += 1
                return streams
        self.misses += 1
        return None

    def made_for(self, block: _Block, mem: Any) -> None:
        """``block`` gets a new (not yet allocated) handle."""
        with self.lock:
            self.made[mem] = None
            block.mem = mem
            self.bytes_in_use += block.size

    def keep(self, block: _Block, pending: tuple[Any, ...]) -> bool:
        """Take ``block``'s handle as idle, with the (stream, ledger point) pairs of work that
        may still use it; False when it must be freed now (caching off, device closing,
        ``block.uncached``, and no queued work uses it). One to be freed that queued work
        still uses is kept idle, and freed once that work has run (:class:`_FreeWhenDone`)."""
        with self.lock:
            mem = block.mem
            if mem is None:
                return True  # kept by an earlier call that an interrupt cut short
            if not mem:
                return False  # nothing allocated
            free = self.closed or not _caching[0] or self.device.closed or block.uncached
            if free and not _unfinished(pending):
                return False
            block.mem = None
            self.idle.setdefault(block.size, []).append((mem, pending))
            self.bytes_idle += block.size
            self.bytes_in_use -= block.size
        if free:
            _lifetime.retiring(_FreeWhenDone(self, block.size, mem, pending))
        return True

    def free_idle(self, size: int, mem: Any) -> None:
        """Free ``mem`` if it is still idle (no allocation took it meanwhile)."""
        with self.lock:
            taken = self._take_idle(size, mem)
        if not taken:
            return
        mem.release()  # once per handle
        with self.lock:
            self.made.pop(mem, None)

    def _take_idle(self, size: int, mem: Any) -> bool:
        # (lock held; a loop under a lock is a function of its own: ARCHITECTURE.md)
        blocks = self.idle.get(size, [])
        for i, (m, _) in enumerate(blocks):
            if m is mem:
                del blocks[i]
                self.bytes_idle -= size
                return True
        return False

    def freed(self, block: _Block, mem: Any) -> None:
        """``block``'s handle ``mem`` was freed."""
        with self.lock:
            if block.mem is mem:
                block.mem = None
                self.bytes_in_use -= block.size
            self.made.pop(mem, None)

    def trim(self, close: bool = False) -> list[BaseException]:
        """Free the idle blocks no queued work uses and the strays (and with ``close``, keep
        nothing from now on). Blocks queued work still uses stay idle until a later trim."""
        with self.lock:
            unheld = self._trim_idle(close)
        errors: list[BaseException] = []
        for mem in unheld:
            status = mem.release()  # once per handle: a repeat finds it empty
            with self.lock:
                self.made.pop(mem, None)
            if status:
                try:
                    check(status, mem.API)
                except Exception as exc:
                    errors.append(exc)
        return errors

    def _trim_idle(self, close: bool) -> list[Any]:
        # (lock held; a loop under a lock is a function of its own: ARCHITECTURE.md) Keep the
        # idle blocks queued work still uses; return the handles to free (nothing holds them).
        busy = {}
        for size, blocks in self.idle.items():
            left = [(mem, pending) for mem, pending in blocks if _unfinished(pending)]
            if left:
                busy[size] = left
        self.idle = busy
        self.bytes_idle = sum(size * len(b) for size, b in busy.items())
        if close:
            self.closed = True
        held = {b.mem for b in _lifetime.holders(_Block) if b.cache is self}
        held.update(mem for blocks in busy.values() for mem, _ in blocks)
        return [m for m in self.made if m not in held]

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {"hits": self.hits, "misses": self.misses, "bytes_idle": self.bytes_idle,
                    "bytes_in_use": self.bytes_in_use, "blocks_idle": sum(len(b) for b in self.idle.values())}


Device.attachments["block_cache"] = lambda device: BlockCache(device, "device")
Device.attachments["pinned_cache"] = lambda device: BlockCache(device, "pinned")


def _close_caches(device: Device) -> None:
    # First in Device.close: idle blocks go before the streams are torn down, and nothing is
    # cached afterwards (live blocks are then freed by the device's own release, in order).
    for name in ("block_cache", "pinned_cache"):
        cache = device.attached_if_made(name)
        if cache is not None:
            errors = cache.trim(close=True)
            if errors:
                raise errors[0]


Device.close_hooks.append(_close_caches)


def _unfinished(pending: tuple[Any, ...]) -> tuple[Any, ...]:
    """The streams of ``pending`` ((stream, ledger point) pairs) whose work up to the point
    may still run (a destroyed stream ran everything; a device closing has not yet).
    ``completed`` and ``closed`` are read without the stream's lock: they only grow, so a
    stale value only keeps a block waiting longer."""
    out: tuple[Any, ...] = ()
    for s, point in pending:
        if s.ledger.completed < point and not s.closed:
            out += (s,)
    return out


class _Block:
    """The holder of a cached block: its release gives the block to the cache (or frees it
    when the cache keeps nothing), with what queued work may still use it (its Track's
    streams, up to the work they have queued so far)."""

    __slots__ = ("mem", "cache", "size", "context", "uncached", "track")

    def __init__(self, mem: Any, cache: BlockCache, size: int, track: Track | None = None) -> None:
        self.mem = mem
        self.cache = cache
        self.size = size
        self.context = cache.device.context  # the device closing releases it (Device.memory_kinds)
        self.uncached = False  # set once (Allocation.uncache): freed, not kept, when released
        self.track = track

    def pending(self) -> tuple[Any, ...]:
        """(stream, ledger point) for each stream whose queued work may still use the memory."""
        t = self.track
        if t is None or not t.users:
            return ()
        out = []
        for s in t.users:
            with s.lock:
                point = s.ledger.count
            if s.ledger.completed < point and not s.closed:
                out.append((s, point))
        return tuple(out)

    def release(self) -> int:
        mem = self.mem
        if mem is None:
            return 0
        if self.cache.keep(self, self.pending()):
            return 0
        status = int(mem.release())  # once: a repeat finds the handle empty
        self.cache.freed(self, mem)
        return status


class _FreeWhenDone:
    """An idle block to free once the work that may use it has run (polled at safe points)."""

    __slots__ = ("cache", "size", "mem", "pending")

    def __init__(self, cache: BlockCache, size: int, mem: Any, pending: tuple[Any, ...]) -> None:
        self.cache, self.size, self.mem, self.pending = cache, size, mem, pending

    def poll(self) -> bool:
        for s in _unfinished(self.pending):
            s.poll()  # its fences
        if _unfinished(self.pending):
            return False
        self.cache.free_idle(self.size, self.mem)
        return True


Device.memory_kinds.append(_Block)

_pressure_hooks: list[Callable[[Device], None]] = []


def on_memory_pressure(hook: Callable[[Device], None]) -> None:
    """Register a cache to shrink when device memory runs out."""
    _pressure_hooks.append(hook)


def trim_caches(device: Device) -> None:
    """Free the device's idle device and pinned blocks."""
    for name in ("block_cache", "pinned_cache"):
        cache = device.attached_if_made(name)
        if cache is not None:
            errors = cache.trim()
            if errors:
                raise errors[0]


on_memory_pressure(trim_caches)


def _fresh(device: Device, make: Callable[[Any, int], None], mem: Any, size: int) -> None:
    """``make(mem, size)``; on lack of memory, shrink every cache and retry once."""
    try:
        device.call(make, mem, size)
    except AclRuntimeError as exc:
        if exc.status not in _OOM:
            raise
        device.reclaim()  # what completed work held
        for hook in _pressure_hooks:
            hook(device)
        _lifetime.collect()
        device.call(make, mem, size)


# ---------------------------------------------------------------------------- device memory

class Track:
    """What the binding knows of queued work on one piece of memory (see the module docstring).

    ``users`` and ``writers`` (tuples of streams) are replaced whole under ``lock`` and read
    without it: a reader sees one complete tuple, and a stream it misses was being registered
    by a call that has not queued its work yet. ``written`` is the
    latest write, ``((stream state, epoch), ...)``, replaced whole (one reference stored) by the
    stream that queues a write, under that stream's lock (:meth:`.StreamState.stamp`)."""

    __slots__ = ("lock", "users", "writers", "written", "__weakref__")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users: tuple[Any, ...] = ()
        self.writers: tuple[Any, ...] = ()
        self.written: tuple[tuple[Any, int], ...] = ()

    def merge(self, other: Track) -> None:
        """Take in what ``other`` knows (its memory overlaps ours)."""
        with self.lock:
            self.users = tuple(dict.fromkeys(self.users + other.users))
            self.writers = tuple(dict.fromkeys(self.writers + other.writers))
            self.written = self.written + other.written

    def forget(self, state: Any) -> None:
        """A closed stream: nothing of it is pending."""
        with self.lock:
            self.users = tuple(s for s in self.users if s is not state)
            self.writers = tuple(s for s in self.writers if s is not state)


class Allocation:
    """One device allocation, shared by every DeviceArray that views it and by queued work
    that uses it. Owned memory goes to the device's block cache (or back to CANN) once this
    object is gone; borrowed memory (``owned`` False) stays its owner's, kept alive here."""

    __slots__ = ("device", "ptr", "nbytes", "owned", "owner", "track", "block", "__weakref__")

    def __init__(self, device: Device, nbytes: int, ptr: int = 0, owner: Any = None, track: Track | None = None
                 ) -> None:
        self.device = device
        self.nbytes = nbytes
        self.ptr = ptr
        self.owner = owner  # what keeps borrowed memory alive
        self.owned = False
        self.track = track if track is not None else Track()
        self.block: _Block | None = None  # owned memory's cached block

    def uncache(self) -> None:
        """Give the memory back to CANN, not to the cache, once it is idle (what empty_cache
        does with a workspace queued work still uses)."""
        if self.block is not None:
            self.block.uncached = True

    def used_on(self, state: Any, write: bool) -> None:
        """Queued work on ``state`` reads (or writes) this memory."""
        t = self.track
        if state in t.users and (not write or state in t.writers):
            return
        with t.lock:
            if state not in t.users:
                t.users += (state,)
            if write and state not in t.writers:
                t.writers += (state,)


def allocate(device: Device, nbytes: int, state: Any = None) -> Allocation:
    """A new allocation of ``nbytes``: an idle cached block of the same rounded size (for
    memory about to be used on stream ``state``, one that only ``state``'s queued work still
    uses, too), else aclrtMalloc."""
    _read_caching()
    _lifetime.collect()
    device.check_open()  # (a miss's aclrtMalloc makes the device's context current: Device.call)
    size = _rounded(nbytes)
    cache: BlockCache = device.attached("block_cache")
    alloc = Allocation(device, nbytes)
    alloc.owned = True
    block = alloc.block = _Block(None, cache, size, alloc.track)
    _lifetime.track(alloc, block)  # before the block is taken or made: nothing can be lost in between
    if cache.take_into(block, state) is None:
        mem = acl.DeviceMemory(device.context)
        cache.made_for(block, mem)
        _fresh(device, acl.malloc, mem, size)
    if state is not None:
        # The memory is about to be written on ``state`` (and the block taken may still be in
        # use by work queued there before): registered now, while no other thread sees it.
        alloc.track.users = alloc.track.writers = (state,)
    alloc.ptr = _address(block, device)
    return alloc


def _address(block: _Block, device: Device) -> int:
    """The address of ``block``'s memory, just taken or made; ClosedError if the device closed
    meanwhile (its close marks it closed, then frees every block, this one too)."""
    mem = block.mem
    # .ptr, which malloc stored (reading the handle's slot is a foreign-object conversion);
    # the slot only when .ptr is 0: an interrupt fell between aclrtMalloc and the store. A
    # handle taken or just made is never freed on an open device (.ptr is not cleared when it
    # is), so the device's state is the one check.
    address = 0 if mem is None or device.closed else mem.ptr or mem.address
    if not address:
        device.check_open()
        raise AssertionError("a block lost its memory on an open device")  # never: only a close frees it
    return int(address)


Device.attachments["borrowed"] = lambda device: _lifetime.WeakMap()


def borrowed(device: Device, ptr: int, nbytes: int, owner: Any) -> Allocation:
    """An Allocation of foreign memory: its Track is shared with every live Allocation that
    overlaps it, borrowed (another wrapper of the same memory) or, through ``owner``, owned."""
    registry: _lifetime.WeakMap[Allocation, None] = device.attached("borrowed")
    overlapping = [a for a in registry.keys() if a.ptr < ptr + nbytes and ptr < a.ptr + a.nbytes]
    owner_alloc = getattr(owner, "alloc", None)
    if isinstance(owner_alloc, Allocation) and owner_alloc.device is device:
        overlapping.insert(0, owner_alloc)
    track = overlapping[0].track if overlapping else Track()
    for a in overlapping[1:]:
        if a.track is not track:
            track.merge(a.track)
            a.track = track
    alloc = Allocation(device, nbytes, ptr=ptr, owner=owner, track=track)
    registry.add(alloc)
    return alloc


# ---------------------------------------------------------------------------- pinned host memory

class _PinnedOwner:
    """What a pinned NumPy array's base keeps alive: the block goes back when it dies."""

    __slots__ = ("__array_interface__", "__weakref__")
    __array_interface__: dict[str, Any]


def pinned_block(device: Device, nbytes: int) -> np.ndarray:
    """A 1-D uint8 NumPy array over a pinned host block of at least ``nbytes``, cached per
    device; the block is reused once the array (and every view of it) is gone."""
    _read_caching()
    _lifetime.collect()
    device.activate()
    size = _rounded(nbytes)
    cache: BlockCache = device.attached("pinned_cache")
    owner = _PinnedOwner()
    block = _Block(None, cache, size)
    _lifetime.track(owner, block)
    if cache.take_into(block) is None:
        mem = acl.HostMemory(device.context)
        cache.made_for(block, mem)
        _fresh(device, acl.malloc_host, mem, size)
    owner.__array_interface__ = {"version": 3, "shape": (nbytes,), "typestr": "|u1",
                                 "data": (_address(block, device), False)}
    return np.asarray(owner)


def is_pinned(array: np.ndarray) -> bool:
    """Whether ``array`` lies in pinned memory handed out here (a view of a pinned block)."""
    a: Any = array
    while a is not None:
        if isinstance(a, _PinnedOwner):
            return True
        a = getattr(a, "base", None)
    return False


def pinned_empty(shape: Any, dtype: Any, device: Device | int | None = None) -> np.ndarray:
    """A NumPy array in pinned (page-locked) host memory, aclrtMallocHost: copies between it
    and the device need no staging. Freed (to the device's cache) when the array is gone."""
    shp = _args.shape("shape", shape)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise InvalidArgument("dtype", f"{dtype!r} is not a numpy dtype") from None
    nbytes = _args.nbytes("shape", shp, dt.itemsize)
    raw = pinned_block(resolve_device(device), nbytes)
    out: np.ndarray = raw[:nbytes].view(dt).reshape(shp)
    return out


def cache_stats(device: Device) -> dict[str, int]:
    """The block caches' figures for ``device``, prefixed ``array_`` and ``pinned_``."""
    out: dict[str, int] = {}
    for prefix, name in (("array_", "block_cache"), ("pinned_", "pinned_cache")):
        for k, v in device.attached(name).stats().items():
            out[prefix + k] = v
    return out
