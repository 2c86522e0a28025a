"""Devices: CANN's process set-up, the current device of each thread, and everything a device
owns.

A :class:`Device` is opened once per process (aclInit with the first, aclrtSetDevice once) and
owns what is made on it: its *inventory* (streams, events, plans, executors, aclTensors: each
a holder with ``release()``), its memory blocks (device and pinned, idle in its caches or
behind an :class:`Allocation`), and its fault. A thread that uses its objects makes its
context current (aclrtSetCurrentContext), which leaves aclrtSetDevice's count alone.

**Faults are sticky**, as in CUDA: once any wait learns of a device fault (:meth:`Device.learn`),
every launch, copy, wait and read on the device raises it until :meth:`Device.reset`.

**Release order.** close() (and interpreter exit) and reset() refuse new work, wait for the
device, then release the inventory in CANN's order (streams, plans, executors, tensors,
events), free the memory and reset the device; every object of it is then dead (ClosedError).
aclFinalize comes only at exit: CANN 8.1.RC1 allows one aclInit per process.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from . import _args, _lifetime, release
from ._cann import acl
from ._cann.errcheck import check
from ._contract import Chip
from .errors import AclError, AclRuntimeError, ClosedError, InvalidArgument, error_for

__all__ = ["Allocation", "Device", "Holder", "Owner", "acl_version", "calling", "chip", "collect", "current_device",
           "device_count", "empty_cache", "is_fault", "is_pinned", "memory_stats", "open_devices", "pinned_empty",
           "resolve_device", "set_caching", "soc_name"]

_ROUND = 512  # CANN aligns blocks to at least this; rounding makes sizes meet in the caches
_SIZES_KEPT = 4096  # the sizes a device's shelves are found by, rounded or as asked for
_OOM = (207001, 207018)  # ACL_ERROR_RT_MEMORY_ALLOCATION, ACL_ERROR_RT_DEVICE_OOM
_NOT_FAULTS = (507046, 507047)  # a wait that timed out: about the wait, not the work
NOT_YET = -1  # what a holder's dropped() returns when its release must wait (for queued work)
_COUNTS = ("array_hits", "array_misses", "pinned_hits", "pinned_misses", "workspace_takes")
STREAMS, PLANS, EXECUTORS, TENSORS, EVENTS = range(5)  # holders' RANK: the order a device releases them


def is_fault(exc: BaseException) -> bool:
    """Whether a wait's error is a device fault of the work it waited for."""
    return isinstance(exc, AclRuntimeError) and exc.status >= 500000 and exc.status not in _NOT_FAULTS


class Holder:
    """What a device's inventory holds for one CANN object: its handle, and the lock that makes
    the release once (and that calls on the handle take, so a release waits for them)."""

    __slots__ = ("handle", "lock", "RANK", "API", "__weakref__")

    def __init__(self, handle: acl.Handle, rank: int) -> None:
        self.handle, self.lock, self.RANK, self.API = handle, threading.Lock(), rank, handle.API

    def release(self) -> int:
        with self.lock:
            return self.handle.release()

    dropped = release  # its owner is gone (a safe point): release it


class Owner:
    """The public face of one CANN object over its *core* (``_core``: what queued work and other
    objects hold too, with the device and the inventory's ``holder``): ``close()`` drops this
    object's hold, and ``with`` closes."""

    __slots__ = ()
    _core: Any

    @property
    def handle(self) -> int:
        """The CANN object's handle as an integer (0 once closed, or consumed by a one-shot
        launch)."""
        c = self._core
        return c.holder.handle.address if c is not None else 0

    def _of(self, name: str, default: Any) -> Any:
        """The core's ``name`` (``default`` once closed)."""
        c = self._core
        return default if c is None else getattr(c, name)

    def close(self) -> None:
        """Drop this object's hold: its CANN object is released at once unless queued work or
        another object still uses it (then once they let go); CANN's refusal is raised (the
        device tries again later). Safe twice."""
        core, self._core = self._core, None
        if core is not None:
            device, holder = core.device, core.holder
            del core
            # Released now, CANN's refusal raised, if nothing else holds the core (queued work,
            # an executor); otherwise it goes once they let go.
            with device.lock:
                token = device._owned.get(holder)
            if token is not None and token() is None:
                check(device.release(holder), holder.API)
            collect()

    def __enter__(self: _O) -> _O:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_O = TypeVar("_O", bound=Owner)


class Block:
    """One block of device (or pinned host) memory: behind the Allocation (or pinned array)
    whose ``token`` it keeps, or idle on its *shelf* once that token is dead. Its fields are
    guarded by the device's lock.

    A device block is *homed* on the stream it was taken for: once its Allocation is gone, that
    stream may take it again at once (its later work runs after the work that used it), any
    other once the home's work queued until then (point ``since``) is known complete. Memory
    used on another stream than its home is held there, alive, until that work is complete."""

    __slots__ = ("handle", "size", "pinned", "ptr", "token", "home", "since", "shelf")

    def __init__(self, handle: acl.Handle, size: int, pinned: bool, token: _lifetime.Token, home: Any,
                 shelf: _Shelf) -> None:
        self.handle, self.size, self.pinned, self.ptr = handle, size, pinned, 0
        # The device's idle blocks of its kind and size, as the dead tokens of their users: a
        # token's callback is its shelf's append, so a block is back the moment its user is
        # gone, no code of ours run (a block whose token is None is a stray an interrupt left).
        self.shelf = shelf
        self.token: _lifetime.Token | None = token  # alive: in use; dead: idle
        self.home: Any = home  # the StreamState it was taken for (None: free for any, pinned memory)
        self.since = -1  # the home's point when another stream first asked for it (-1: not yet)


class _Shelf(collections.deque):  # type: ignore[type-arg]
    """The idle blocks of one kind and size, as the dead tokens of their users, newest last:
    ``put`` (its append, bound once) is their tokens' callback."""

    __slots__ = ("put", "size")

    def __init__(self, size: int) -> None:
        super().__init__()
        self.put, self.size = self.append, size  # (size: its blocks', rounded up)


class Allocation:
    """Device memory in use: one block, shared by the DeviceArrays that view it and by queued
    work that uses it (a stream holds it until that work is known complete); its block goes
    back to the cache once all of them are gone. Borrowed memory (``block`` None) stays its
    owner's, kept alive here. ``writer`` is the stream that last queued a write to it, from the
    start the stream it was taken for (its earlier work may have used the block; None: pinned
    memory, or borrowed memory, whose writer is unknown): stored at the allocation, before
    anyone else sees it, then by a stream under that stream's lock; read without a lock
    (ARCHITECTURE.md, published fields)."""

    __slots__ = ("device", "context", "ptr", "nbytes", "block", "owner", "writer", "__weakref__")

    def __init__(self, device: Device, nbytes: int, ptr: int = 0, owner: Any = None) -> None:
        self.device, self.context, self.nbytes, self.ptr, self.owner = device, device.context, nbytes, ptr, owner
        self.block: Block | None = None
        self.writer: Any = None

    def check_open(self, what: str = "array") -> None:
        """ClosedError once the memory went with its device."""
        if not self.context.open:
            raise ClosedError(what, f"its memory went with device {self.device.device_id}, which was closed or "
                                    "reset" + (" (or this is a fork() child)" if acl.forked() else ""))


class _Process:
    """aclInit once per process; the open devices. Guarded by ``lock`` (held while a device
    opens, closes or resets)."""

    lock = threading.RLock()
    devices: dict[int, Device] = {}
    live: tuple[Device, ...] = ()  # the open devices, published whole under lock (read without it)
    # aclInit: not yet (None), done by us (True: aclFinalize at exit is ours to call), or by
    # someone else in the process (False; also once the exit finalized it).
    owns_init: bool | None = None
    # Idle blocks kept for reuse: PYACL_MOE_CACHE_ALLOCATIONS (0 or 1, default 1), read when the
    # first device opens (a bad value is refused by name there, not at import), or
    # set_caching(). One store, read without a lock.
    caching: list[bool | None] = [None]
    # The chip the process runs the ops on, with its release's rules: read once (one SoC and one
    # CANN a process), stored whole under ``lock``, read without it.
    chip: Chip | None = None


_tls = threading.local()  # .device: the Device this thread last used; .saved: `with device:` stack


class Device:
    """An Ascend device (NPU), by id.

    ``Device(0)`` returns the process's shared object for device 0, opening it on first use.
    ``with device:`` makes it the calling thread's current device, restoring the previous one
    on exit, closing nothing. ``close()`` releases everything of it (see the module docstring);
    the next ``Device(0)`` opens it again. ``reset()`` does the same and opens it again under
    the same object: the way out of a fault.
    """

    # The class of the default stream's public object: pyacl_moe.stream sets it, so that this
    # module never imports the stream layer above it (the one registration between modules).
    stream_class: Any = None
    _id: int
    # ``lock`` guards _owned, which outlives a reset: the host objects of the inventory
    # (plans, executors, tensors) go when their owners go.
    lock: threading.Lock
    _owned: dict[Any, _lifetime.Token | None]  # holder -> token (None: no owner to wait for)

    def __new__(cls, device_id: int = 0) -> Device:
        did = _args.int32("device_id", device_id, lo=0)
        _refuse_after_fork()
        with _Process.lock:
            dev = _Process.devices.get(did)
            if dev is None:
                dev = super().__new__(cls)
                dev._id, dev.lock, dev._owned = did, threading.Lock(), {}
                dev._start()
                _Process.devices[did] = dev
                _Process.live = tuple(_Process.devices.values())
            return dev

    def _start(self) -> None:
        """Open the device (Process.lock held): a new context, an empty inventory, no fault."""
        if _Process.caching[0] is None:
            value = os.environ.get("PYACL_MOE_CACHE_ALLOCATIONS", "1").strip()
            if value not in ("0", "1"):
                raise InvalidArgument("PYACL_MOE_CACHE_ALLOCATIONS", f"must be 0 or 1, got {value!r}")
            _Process.caching[0] = value == "1"
        if _Process.owns_init is None:
            _Process.owns_init = acl.init()
        count = acl.device_count()
        if self._id >= count:
            raise InvalidArgument("device_id", f"must be in [0, {count}): CANN sees {count} device(s), got {self._id}")
        ctx = acl.open_device(self._id)
        # ``lock`` also guards _blocks, _shelves, _counts, _hits and fault (fault: one store, read
        # without it); ``sync_lock`` is held across every aclrtSynchronizeDevice and what it learns;
        # ``free_lock`` across every aclrtFree(Host), so that a block is freed once.
        self.sync_lock, self.free_lock = threading.Lock(), threading.Lock()
        self.fault: tuple[int, str, str, str] | None = None  # (status, api, message, which wait learned it)
        self._blocks: dict[Block, None] = {}  # every block made and not yet freed
        # [pinned][size] -> its shelf (by the rounded size, and by up to _SIZES_KEPT sizes asked
        # for that round to one): the tokens of the blocks' users that are gone, newest last. A
        # dying user's token appends itself (a deque's append is thread-safe by its
        # documentation); only a holder of ``lock`` pops or removes.
        self._shelves: tuple[dict[int, _Shelf], dict[int, _Shelf]] = ({}, {})
        self._counts = dict.fromkeys(_COUNTS, 0)  # memory_stats' counts, by its names
        self._hits = [0, 0]  # memory_stats' array_hits and pinned_hits
        self.context = ctx
        self._default: Any = Device.stream_class.default(self)
        _tls.device = self

    # -- identity and state

    @property
    def device_id(self) -> int:
        """The device's id, as CANN numbers it."""
        return self._id

    @property
    def closed(self) -> bool:
        """True once the device was closed (or, in a fork() child, inherited)."""
        return not self.context.open

    def __repr__(self) -> str:
        return f"<Device {self._id}{' closed' if self.closed else ''}>"

    def __int__(self) -> int:
        return self._id

    def check_open(self) -> None:
        """Raise ClosedError if the device was closed."""
        if not self.context.open:
            raise ClosedError(f"device {self._id}", _closed_reason())

    def check(self) -> None:
        """Raise ClosedError if the device was closed, its fault if it is faulted."""
        self.check_open()
        if self.fault is not None:
            raise self.fault_error()

    def learn(self, error: AclError, where: str) -> bool:
        """A wait learned of a device fault: the device is faulted from now on (the first fault
        stays). True when this was the first."""
        with self.lock:
            first = self.fault is None
            if first:
                self.fault = (error.status, error.api, error.message, where)
        return first

    def fault_error(self) -> AclError:
        """The exception every launch, copy, wait and read of a faulted device raises."""
        status, api, message, where = self.fault  # type: ignore[misc]
        return error_for(status, api, f"{message}\n  (device {self._id} is faulted since {where} learned of it: "
                                      "every launch, copy, wait and read on it raises this until Device.reset())")

    def set_current(self) -> Device:
        """Make this device the calling thread's current device; returns self."""
        self.check_open()
        acl.use_context(self.context)
        _tls.device = self
        return self

    activate = set_current

    @property
    def default_stream(self) -> Any:
        """The device's default Stream (CANN's NULL stream)."""
        self.check_open()
        return self._default

    def mem_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device's memory (what the process dropped is freed first)."""
        collect()
        self.activate()
        return acl.get_mem_info()

    # -- the inventory

    def own(self, holder: Any, owner: Any = None) -> None:
        """Add ``holder`` (with ``release()``, ``RANK`` and ``API``) to the inventory, before
        the C call that creates its object; with ``owner``, it is released at a safe point
        once ``owner`` is gone."""
        token = _lifetime.track(owner, self, holder) if owner is not None else None
        with self.lock:
            self.check_open()
            self._owned[holder] = token

    def release(self, holder: Any, dropped: bool = False) -> int:
        """Release ``holder`` now (its own lock makes that once; ``dropped``: its owner is gone,
        at a safe point); CANN's status. One CANN refuses stays in the inventory: the device's
        close tries it again."""
        status: int = holder.dropped() if dropped else holder.release()
        if not status:
            with self.lock:
                self._owned.pop(holder, None)
        return status

    def holders(self, rank: int) -> list[Any]:
        """The inventory's holders of one rank (STREAMS: the device's stream states)."""
        with self.lock:
            owned = list(self._owned)
        return [h for h in owned if h.RANK == rank]

    def drop(self, tokens: Sequence[_lifetime.Token]) -> None:
        """Tokens of owners that are gone (the safe point): release their holders; one whose
        release must wait is handed to the next safe point. Taking a token twice does nothing."""
        with self.lock:
            holders = _owned_by(self._owned, tokens)
        for token in holders:
            status = self.release(token.what, dropped=True)
            if status and (status == NOT_YET or token.tries < 3):  # a refusal is tried at three more safe points
                token.tries += status != NOT_YET
                _lifetime.retry(token)

    # -- memory

    def allocate(self, sizes: Sequence[int], home: Any = None, pinned: bool = False,
                 owners: Sequence[Any] | None = None, counts: str = "") -> list[Allocation]:
        """New memory of each size in bytes for work on stream ``home`` (a StreamState): an
        idle block of the same rounded size that is free for it (no call to CANN), else
        aclrtMalloc (aclrtMallocHost when ``pinned``: free blocks only, homed on no stream, the
        host writes them directly). A block goes back to its shelf once its Allocation (or,
        for pinned memory, ``owners[i]``) is gone. ``counts``: a figure of memory_stats to add
        one to (``workspace_takes``)."""
        with self.lock:
            if not self.context.open:
                self.check_open()
            allocs, missing = self._take(sizes, owners, pinned, home)
            if counts:
                self._counts[counts] += 1
        for i, token in missing:
            self._malloc(allocs[i], token, pinned, home)
        if not _Process.caching[0]:
            self.trim()  # what went idle is freed, not kept
        return allocs

    def _take(self, sizes: Sequence[int], owners: Sequence[Any] | None, pinned: bool,
              home: Any) -> tuple[list[Allocation], list[tuple[int, _lifetime.Token]]]:
        # (lock held; a loop under a lock is a function of its own) For each size, an
        # Allocation, a token of its owner that goes to the shelf of its size when the owner
        # does, and an idle block of that shelf free for ``home``, newest first (the one its
        # own stream let go of last); the positions and tokens of the rest.
        allocs: list[Allocation] = []
        missing: list[tuple[int, _lifetime.Token]] = []
        shelves, token, new, ctx = self._shelves[pinned], _lifetime.Token, object.__new__, self.context
        for i, n in enumerate(sizes):
            shelf = shelves.get(n)
            if shelf is None:
                shelf = _shelf(shelves, n)
            dead = shelf.pop() if shelf else None  # (popped first: a user dying meanwhile appends behind it)
            try:
                block = dead.what if dead is not None else None
            except AttributeError:  # (a token an interrupt left before its block was set: _free_one drops it)
                block = None
            if block is None or block.token is not dead or block.home is not home and block.home is not None or (
                    not block.ptr):
                if dead is not None:
                    shelf.append(dead)
                block = _free_one(shelf)
            # (Allocation.__init__ inline, its block and address known: a one call makes three)
            a = new(Allocation)
            a.device, a.context, a.nbytes, a.owner, a.writer = self, ctx, n, None, home
            allocs.append(a)
            mine = token(a if owners is None else owners[i], shelf.put)
            mine.what = a.block = block
            if block is None:  # (its block: made by _malloc)
                a.ptr = 0
                missing.append((i, mine))
            else:
                a.ptr = block.ptr
                block.token, block.home, block.since = mine, home, -1
        self._hits[pinned] += len(allocs) - len(missing)  # (one store: an interrupt before it counts nothing)
        return allocs, missing

    def _malloc(self, alloc: Allocation, token: _lifetime.Token, pinned: bool, home: Any) -> None:
        ctx = self.context
        with self.lock:  # owned before it exists: an interrupt after the C call loses nothing
            self.check_open()
            alloc.check_open()  # (a reset since _take: this device's shelves are new ones)
            shelf = _shelf(self._shelves[pinned], alloc.nbytes)  # (_take's: found again, by n or past the sizes kept)
            token.what = block = Block(acl.HostMemory(ctx) if pinned else acl.DeviceMemory(ctx), shelf.size, pinned,
                                       token, home, shelf)
            self._blocks[block] = None
            self._counts["pinned_misses" if pinned else "array_misses"] += 1
        fill = acl.malloc_host if pinned else acl.malloc
        try:
            with calling(self, ctx):
                acl.use_context(ctx)
                try:
                    ptr = fill(block.handle, block.size)  # type: ignore[arg-type]
                except AclRuntimeError as exc:
                    if exc.status not in _OOM:
                        raise
                    self.reclaim()
                    acl.use_context(ctx)
                    ptr = fill(block.handle, block.size)  # type: ignore[arg-type]
            with self.lock:  # (an interrupt before this leaves the address in the handle: _free_one reads it)
                block.ptr = ptr
        except BaseException:
            with self.lock:
                block.token = None  # a stray: freed by the next trim (an empty handle frees nothing)
            raise
        alloc.block, alloc.ptr = block, block.ptr

    def trim(self, every: bool = False) -> list[BaseException]:
        """Free the idle blocks and the strays an interrupt left (``every``: every block, for
        the teardown); the errors CANN reported."""
        with self.free_lock:
            with self.lock:
                blocks = list(self._blocks) if every else self._unused()
            return self._free(blocks)

    def _free(self, blocks: list[Block]) -> list[BaseException]:
        # (free_lock held, so each handle is released once; a loop under a lock is a function
        # of its own: ARCHITECTURE.md) The errors CANN reported.
        errors: list[BaseException] = []
        for block in blocks:
            status = block.handle.release()
            if status:
                _noting(errors, check, status, block.handle.API)
            else:
                with self.lock:
                    self._blocks.pop(block, None)
                    block.ptr = 0  # (a token of it on a shelf names no idle block: _take passes it over)
        return errors

    def _unused(self) -> list[Block]:
        # (lock held; a loop under a lock is a function of its own) The idle blocks no queued
        # work may still use, off their shelves, and the strays (no token: neither idle nor in use).
        unused = [b for b in self._blocks if b.token is None or b.token() is None and _free_for_any(b)]
        for b in unused:
            if b.token is not None and b.token in b.shelf:
                b.shelf.remove(b.token)
        return unused

    def reclaim(self, empty: bool = False) -> list[BaseException]:
        """Give back what completed work held and the streams' idle workspaces (``empty``: their
        cached executors and workspaces, empty_cache), then free the idle blocks (an allocation
        that ran out of memory tries again after this); the errors CANN reported."""
        for s in self.holders(STREAMS):
            s.reclaim(empty)
        collect()
        return self.trim()

    def stats(self) -> dict[str, int]:
        """The memory figures of memory_stats for this device."""
        if not _Process.caching[0]:
            self.trim()  # (what went idle is freed first)
        with self.lock:
            out = self._figures()
        held = [n for n in (s.workspace_size() for s in self.holders(STREAMS)) if n]
        out.update(workspace_blocks=len(held), workspace_bytes=sum(held))
        return out

    def _figures(self) -> dict[str, int]:
        # (lock held; a loop under a lock is a function of its own)
        out = dict(self._counts)
        for prefix, pinned in (("array_", False), ("pinned_", True)):
            out[prefix + "hits"] = self._hits[pinned]
            # (each block's token read once: a user dying meanwhile cannot count it as both idle and in use)
            sized = [(b.size, b.token() is None) for b in self._blocks if b.pinned is pinned and b.token is not None]
            idle = [n for n, dead in sized if dead]
            out.update({prefix + "bytes_idle": sum(idle), prefix + "blocks_idle": len(idle),
                        prefix + "bytes_in_use": sum(n for n, dead in sized if not dead)})
        return out

    # -- waiting

    def synchronize(self) -> None:
        """Wait for every stream of the device (aclrtSynchronizeDevice). Raises the device's
        fault (AclRuntimeError, e.g. 507015) if this or any earlier wait learned of one."""
        self.check()
        collect()
        self.wait_all("Device.synchronize")
        self.check()

    def wait_all(self, where: str) -> None:
        """aclrtSynchronizeDevice, learning a fault it reports; what the streams' work held is
        given back. CANN reports a fault to one wait only: a stream's wait that finds this in
        progress waits for it to learn what it was told, and this, once clean, waits for each
        stream's wait in progress to learn what it was told (its ``wait_lock``)."""
        streams = self.holders(STREAMS)
        marks = [s.mark() for s in streams]
        with self.sync_lock:
            try:
                acl.use_context(self.context)
                acl.synchronize_device()
            except AclError as exc:
                if not is_fault(exc):
                    raise
                self.learn(exc, where)
                return
        for s in self.holders(STREAMS):
            with s.wait_lock:
                pass
        for s, mark in zip(streams, marks):
            s.completed(mark)

    # -- release

    def close(self) -> None:
        """Wait for the device, then release everything it owns in CANN's order, then reset it.
        Safe twice. Another thread's call on an object of the device completes first or raises
        ClosedError. The first error a release reported is raised once everything is
        released."""
        with _Process.lock:
            if _Process.devices.get(self._id) is not self:  # closed already (a reset keeps it there)
                return
            errors = self._teardown("Device.close")
            del _Process.devices[self._id]
            _Process.live = tuple(_Process.devices.values())
        if errors:
            raise errors[0]

    def reset(self) -> None:
        """Release everything of the device, reset it through CANN and open it again under this
        object, fault cleared: every stream, array, plan and executor of it is dead
        (ClosedError), the device itself is usable."""
        with _Process.lock:
            if _Process.devices.get(self._id) is not self:
                self.check_open()
            self._teardown("Device.reset")
            self._start()

    def _teardown(self, where: str) -> list[BaseException]:
        """(Process.lock held) Each step may be made again: a teardown an interrupt cut short is
        finished by the next (at the latest the exit hook's)."""
        collect()  # what was dropped goes first (a release CANN refused is tried again)
        with self.lock:
            self.context.open = False  # no new work: every call checks it before it takes a lock
        if acl.forked():
            return []
        errors: list[BaseException] = []
        for s in self.holders(STREAMS):
            s.shut()  # (under its lock: launches in progress end first)
        known = self.fault
        _noting(errors, self.wait_all, where)
        if self.fault is not known:  # this wait learned of a fault: the close reports it
            errors.append(self.fault_error())
            _noting([], acl.synchronize_device)  # CANN reported and cleared it: wait for what is left
        # (plans, executors and tensors are host objects: they go with their owners)
        for holder in self.holders(STREAMS) + self.holders(EVENTS):
            _noting(errors, lambda h: check(self.release(h), h.API), holder)
        errors += self.trim(every=True)
        if self.context.alive:
            _noting(errors, acl.reset_device, self.context)
        return errors  # (a reset's _start makes the caches anew; a block CANN refused to free stays in _blocks)

    def __enter__(self) -> Device:
        previous = getattr(_tls, "device", None)
        self.activate()  # (first: a device that cannot be made current is not entered, nothing saved)
        _tls.__dict__.setdefault("saved", []).append(previous)
        return self

    def __exit__(self, *exc: object) -> None:
        previous = _tls.saved.pop()
        if previous is None or previous.closed:
            _tls.device = None  # the next call without a device picks device 0 again
        else:
            previous.activate()


def collect() -> None:
    """The safe point, called on entry by every call that allocates, synchronizes or closes:
    what dropped owners held is released (:func:`pyacl_moe._lifetime.collect`), and the
    blocks of Allocations that are gone go back to their devices' caches. Never waits for
    queued work; never called with a lock of the runtime held."""
    _lifetime.collect()
    if not _Process.caching[0] and not acl.forked():  # (a fork() child frees nothing it inherited)
        for dev in _Process.live:
            dev.trim()  # what went idle is freed, not kept


def _free_for_any(block: Block) -> bool:
    """Whether an idle block is free for any stream: no home, or its home's work queued before
    it was first asked for is known complete, or the home is gone. (The device's lock held;
    the home's lock taken inside it: the lock order.)"""
    home = block.home
    if home is None:
        return True
    with home.lock:
        if block.since < 0:
            block.since = home.point
        return home.done >= block.since or not home.live()


def _owned_by(owned: dict[Any, Any], tokens: Sequence[_lifetime.Token]) -> list[_lifetime.Token]:
    # (the device's lock held; a loop under a lock is a function of its own) The tokens that
    # are their holders' in the inventory (one taken already is not).
    return [t for t in tokens if owned.get(t.what) is t]


def _shelf(shelves: dict[int, _Shelf], n: int) -> _Shelf:
    # (the device's lock held) The shelf of the blocks n bytes round up to, made if there is none
    # yet, and found by n itself from then on (for the first _SIZES_KEPT sizes: past them a size
    # is rounded each time), so that a size asked for again is not rounded again.
    size = -(-n // _ROUND) * _ROUND or _ROUND
    shelf = shelves.get(size)
    if shelf is None:
        shelf = shelves[size] = _Shelf(size)
    if len(shelves) < _SIZES_KEPT:
        shelves[n] = shelf
    return shelf


def _free_one(shelf: _Shelf) -> Block | None:
    # (the device's lock held) The newest idle block of ``shelf`` free for any stream, taken
    # off it; a token that names no idle block any more is dropped from it on the way.
    for j in reversed(range(len(shelf))):
        dead = shelf[j]
        block: Block | None = getattr(dead, "what", None)
        if block is not None and block.token is dead and not block.ptr:  # an interrupt cut its _malloc short:
            block.ptr = block.handle.address  # the address is the handle's,
            if not block.ptr:
                block.token = None  # or none (a stray: the next trim frees it)
        if block is None or block.token is not dead or _free_for_any(block):
            del shelf[j]  # (a token naming no idle block is dropped; a free block taken)
            if block is not None and block.token is dead:
                return block
    return None


def _noting(errors: list[BaseException], fn: Any, *args: Any) -> None:
    """``fn(*args)``, CANN's error appended to ``errors`` rather than raised."""
    try:
        fn(*args)
    except AclError as exc:
        errors.append(exc)


@contextlib.contextmanager
def calling(device: Device, ctx: acl.Context) -> Iterator[None]:
    """A CANN call of ``device`` made outside any stream's lock (an allocation, a stream or an
    event made): the device may close meanwhile, on another thread; CANN's error is then a
    ClosedError, as every other call of a closed device raises."""
    try:
        yield
    except AclError:
        if ctx.open:
            raise
        raise ClosedError(f"device {device.device_id}", _closed_reason()) from None


def _closed_reason() -> str:
    if acl.forked():
        return "CANN does not survive fork(): objects inherited from the parent are dead in the child"
    return "it was closed (Device.close(), Device.reset() or interpreter exit)"


def _refuse_after_fork() -> None:
    if acl.forked():
        raise ClosedError("CANN in this process",
                          "this is a fork() child of a process that initialized CANN, which does not survive fork(); "
                          "start worker processes with multiprocessing's 'spawn' or 'forkserver' method")


def open_devices() -> list[Device]:
    """The devices open now, in id order."""
    if acl.forked():
        return []
    with _Process.lock:
        return sorted(_Process.devices.values(), key=lambda d: d.device_id)


def current_device() -> Device:
    """The device this thread last used through pyacl_moe, else device 0."""
    dev: Device | None = getattr(_tls, "device", None)
    return dev if dev is not None and not dev.closed else Device(0)


def resolve_device(device: Device | int | None, name: str = "device") -> Device:
    """A Device from a Device, an id or None (the current device); ClosedError if closed."""
    if device is None:
        return current_device()
    if isinstance(device, Device):
        device.check_open()
        return device
    if isinstance(device, bool) or not hasattr(device, "__index__"):
        raise InvalidArgument(name, f"must be a Device, a device id or None, got {type(device).__name__}")
    return Device(device)


def chip() -> Chip:
    """The chip this process runs the ops on: the family of the SoC CANN reports
    (aclrtGetSocName) with the rules of the loaded ops release (release.chip_for). The host
    checks, the reference, conformance and the reports follow it."""
    c = _Process.chip
    if c is None:
        _refuse_after_fork()
        found = release.chip_for(acl.soc_name(), release.cann_version().ops_release)
        with _Process.lock:
            c = _Process.chip = _Process.chip or found
    return c


def device_count() -> int:
    """How many devices CANN sees."""
    _refuse_after_fork()
    return acl.device_count()


def acl_version() -> tuple[int, int, int]:
    """The ACL interface version (aclrtGetVersion): (major, minor, patch)."""
    _refuse_after_fork()
    return acl.get_version()


def soc_name() -> str | None:
    """The SoC name CANN reports (aclrtGetSocName), e.g. 'Ascend910B3'; opens device 0 if no
    device is open yet."""
    current_device()
    return acl.soc_name()


# ---------------------------------------------------------------------------- memory, process-wide

def set_caching(enabled: bool) -> None:
    """Keep idle device and pinned blocks for reuse (True, the default) or free each one as
    soon as it is idle (False; what is cached now is freed)."""
    _args.instance("enabled", enabled, bool)
    with _Process.lock:
        _Process.caching[0] = enabled
    if not enabled:
        for dev in open_devices():
            dev.trim()


def memory_stats(device: Device | int | None = None) -> dict[str, int]:
    """Memory figures for a device (default: the current one): its streams' workspaces
    (``workspace_blocks`` streams hold ``workspace_bytes``; ``workspace_takes`` times a stream
    took or grew one), and the block caches of DeviceArrays and workspaces (``array_*``) and of
    pinned host memory (``pinned_*``): hits, misses, bytes idle and in use, blocks idle."""
    return resolve_device(device).stats()


def empty_cache(device: Device | int | None = None) -> None:
    """Give back what is cached for speed on ``device`` (all open devices if None): each
    stream's cached executors and workspace (once the work queued on it is done), what completed
    work held, and the idle blocks. Never waits for the device."""
    for dev in [resolve_device(device)] if device is not None else open_devices():
        errors = dev.reclaim(empty=True)
        if errors:
            raise errors[0]


class _PinnedBase:
    """The base of a pinned NumPy array: its block goes back once the array (and every view of
    it) is gone."""

    __slots__ = ("__array_interface__", "__weakref__")
    __array_interface__: dict[str, Any]


def pinned_block(device: Device, nbytes: int) -> np.ndarray:
    """A 1-D uint8 NumPy array over a pinned host block of at least ``nbytes`` (aclrtMallocHost),
    from the device's cache."""
    collect()
    base = _PinnedBase()
    alloc = device.allocate((nbytes,), None, True, (base,))[0]
    base.__array_interface__ = {"version": 3, "shape": (nbytes,), "typestr": "|u1", "data": (alloc.ptr, False)}
    return np.asarray(base)


def is_pinned(array: np.ndarray) -> bool:
    """Whether ``array`` lies in pinned memory handed out here (a view of a pinned block)."""
    a: Any = array
    while a is not None:
        if isinstance(a, _PinnedBase):
            return True
        a = getattr(a, "base", None)
    return False


def pinned_empty(shape: Any, dtype: Any, device: Device | int | None = None) -> np.ndarray:
    """A NumPy array in pinned (page-locked) host memory, aclrtMallocHost: copies between it
    and the device are asynchronous. Its block goes back to the device's cache when the array
    is gone. The device's close() or reset() frees it even while the array lives: do not use
    the array after either."""
    shp, dt = _args.shape("shape", shape), _args.dtype("dtype", dtype)
    nbytes = _args.nbytes("shape", shp, dt.itemsize)
    return pinned_block(resolve_device(device), nbytes)[:nbytes].view(dt).reshape(shp)


# ---------------------------------------------------------------------------- exit

def _close_all_at_exit() -> None:
    """Close every open device in id order, then aclFinalize if this process called aclInit."""
    if acl.forked():
        return
    # From now on, a daemon thread that the teardown stops (its next call raises ClosedError)
    # ends without a traceback: non-daemon threads were joined before atexit ran.
    previous = threading.excepthook

    def hook(args: Any) -> None:
        if not (isinstance(args.exc_value, ClosedError) and args.thread is not None and args.thread.daemon):
            previous(args)

    threading.excepthook = hook
    with _Process.lock:
        _close_each()
        if _Process.owns_init:
            _Process.owns_init = False
            with contextlib.suppress(Exception):
                acl.finalize()


def _close_each() -> None:
    # (_Process.lock held; a loop under a lock is a function of its own: ARCHITECTURE.md)
    for dev in open_devices():
        try:
            dev.close()
        except Exception as exc:  # nobody is left to catch it: said once on stderr
            with contextlib.suppress(Exception):
                sys.stderr.write(f"pyacl_moe: at exit, closing device {dev.device_id} reported: {exc}\n")


atexit.register(_close_all_at_exit)
