"""Prepared launches of any aclnn operator, and the per-stream executor cache behind the one
call.

A :class:`Plan` runs the first phase once over fixed DeviceArrays and relaunches its
(repeatable) executor. On each stream it launches on, it binds a :class:`_Slot`: the second
phase's function with every argument bound, and what those arguments point at. Every launch,
the steady state's included, makes its one foreign call under the stream's lock, and a slot is
stopped (a rebind, a close, its stream or device closing) under that same lock: once stopped,
no launch through it is still in flight, and what it kept is retired on the stream, released
once the work queued there is done.

The one call uses :func:`launch_cached`: each stream keeps a few repeatable executors by layout
(:class:`_ExecutorCache`), used under the stream's lock, and rebinds the one that matches to
each call's arrays. A layout is cached only once it was validated, so a caller checks layouts
only when :func:`relaunch` finds none.

Lock order: a plan's lock, an executor's lock, a stream's lock.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from .. import _args, _lifetime
from .._cann import acl, aclnn, declare
from .._cann.errcheck import check
from ..array import Allocation, DeviceArray, may_overlap
from ..device import Device
from ..errors import ClosedError, InvalidArgument
from ..pool import workspace_for
from ..stream import Stream, StreamState, any_fault, check_written, resolve_stream, thread_current
from ..tensor import AclTensor, TensorCore
from .executor import Executor, build, checked_workspace, launch, mark_uses
from .spec import OpSpec

__all__ = ["Plan", "check_no_overlap", "check_workspace_apart", "launch_cached", "relaunch"]

_P = TypeVar("_P", bound="Plan")  # a plan's `with` gives the subclass it was entered on
_thread = acl.thread_state  # the calling thread's current context (read only)


class _Slot:
    """A plan's launch on one stream: the bound second phase, what its arguments point at
    (``keep``), what it writes, and what the plan returns. ``live`` is guarded
    by the stream's lock."""

    __slots__ = ("state", "fn", "args", "call", "keep", "writes", "whole", "result", "live")

    def __init__(self, state: StreamState, call: tuple[Any, tuple[Any, ...]], keep: tuple[Any, ...],
                 writes: tuple[tuple[Any, bool], ...], result: Any) -> None:
        self.state = state
        self.fn, self.args = call
        self.call = functools.partial(self.fn, *self.args)
        self.keep = keep
        self.writes = writes  # (Track, whole) of each output (StreamState.stamp)
        # The outputs' tracks when each output is all of its memory (the steady state's case).
        self.whole = tuple(t for t, w in writes) if all(w for _, w in writes) else None
        self.result = result
        self.live = True

    def stop(self) -> None:
        """No launch through the slot from now on (and none is in flight: it holds the lock);
        what it kept goes once the stream has run what was queued."""
        with self.state.lock:
            self.live = False
        self.state.retire(self.keep)


_NO_STREAM = object()  # matches no stream argument (not even None)
_NOT_STEADY: tuple[Any, Any] = (_NO_STREAM, None)


def check_no_overlap(spec: OpSpec, arrays: Mapping[str, DeviceArray | None]) -> None:
    """Refuse an output that shares memory with another tensor of the launch: the kernel would
    read what it is overwriting."""
    for out_name in spec.outputs:
        out = arrays.get(out_name)
        if out is None:
            continue
        for name in spec.tensors:
            other = arrays.get(name)
            if name != out_name and other is not None and may_overlap(out, other):
                raise InvalidArgument(
                    out_name, f"shares device memory with {name}: the kernel would overwrite what it reads "
                              "(use a separate output array)"
                )


def check_workspace_apart(workspace: DeviceArray, arrays: Mapping[str, DeviceArray | None]) -> None:
    """Refuse a caller's workspace that shares memory with a tensor of the launch: the kernel
    writes its workspace (the forward sorts in it) and would overwrite what it reads or
    writes."""
    for name, a in arrays.items():
        if a is not None and may_overlap(workspace, a):
            raise InvalidArgument("workspace", f"shares device memory with {name}: the kernel writes its workspace "
                                               "(use a separate array)")


class Plan:
    """A prepared launch of an operator on fixed DeviceArrays (see the module docstring).

    Subclasses (one per operator) check their contract and call ``_prepare``. ``plan(stream,
    workspace)`` queues the kernel; ``rebind(...)`` points it at other arrays of the same
    layout; ``close()`` releases it once the work it queued is done.
    """

    _spec: OpSpec
    _validate = True  # whether outputs are checked against sharing memory (a subclass sets it)
    # (stream argument, slot) of the last launch, replaced whole: the steady state's lookup.
    _now: tuple[Any, Any] = _NOT_STEADY

    def _prepare(self, device: Device, arrays: Mapping[str, DeviceArray], attrs: Mapping[str, Any],
                 repeatable: bool) -> None:
        # ``_lock`` guards _slots, _closed, _spent, _arrays, _rebinding and the executor's addresses.
        self._lock = threading.Lock()
        self._slots: dict[StreamState, _Slot] = {}
        holder = _SlotsHolder(self._slots)
        _lifetime.track(self, holder)  # a plan dropped without close() retires its slots
        self._closed = True  # until the executor exists
        self._spent = False  # a one-shot plan that has launched
        self._device = device
        self._arrays = dict(arrays)
        self._tensors = {n: AclTensor(a) for n, a in arrays.items()}
        core = build(self._spec, device, {n: t.core() for n, t in self._tensors.items()}, attrs)
        if repeatable:
            core.set_repeatable()
        self._core = core
        self._repeatable = repeatable
        # The aclTensors keep the view offsets they were built with, whatever they are rebound to.
        self._view_offsets = {n: a.offset for n, a in arrays.items()}
        # A rebind not finished (see _finish_rebind): name -> (array, its allocation, base).
        self._rebinding: dict[str, tuple[DeviceArray, Allocation, int]] = {}
        self._closed = False

    # -- properties

    @property
    def workspace_size(self) -> int:
        """Bytes of workspace a launch needs."""
        return self._core.workspace_size

    @property
    def executor(self) -> Executor:
        """The plan's executor (closing it is the plan's business: use ``plan.close()``)."""
        return Executor(self._core, tuple(self._tensors[n] for n in self._spec.tensors if n in self._tensors))

    @property
    def closed(self) -> bool:
        """True once closed."""
        return self._closed

    @property
    def device(self) -> Device:
        """The device the plan launches on."""
        return self._device

    def _result(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    # -- launching

    def __call__(self, stream: Stream | None = None, workspace: DeviceArray | None = None) -> Any:
        """Queue the kernel on ``stream`` (default: the thread's current stream) and return the
        output(s). ``workspace``: your own DeviceArray of at least ``workspace_size`` bytes; by
        default the stream's workspace."""
        if stream is None:
            cur = thread_current.stream  # inside `with stream:`, a call without one goes there
            if cur is not None and cur.state.device is self._device:
                stream = cur
        s, slot = self._now
        if s is stream and workspace is None and not any_fault[0]:
            state = slot.state
            with state.lock:
                if slot.live and not state.closing:
                    if _thread.context is not state.context:
                        acl.use_context(state.context)
                    st = slot.call()
                    if not st:
                        whole = slot.whole
                        if whole is None:
                            state.stamp(slot.writes)
                        else:
                            mark = state.mark
                            for t in whole:
                                t.written = mark
                        return slot.result
                    check(st, self._spec.api)
        return self._launch(stream, workspace)

    def _usable(self) -> None:
        # Before any lock of the plan: in a fork() child a parent thread may have held it.
        if self._device.closed:
            raise ClosedError("plan", f"its device {self._device.device_id} was closed"
                                      + (" (or this is a fork() child)" if _lifetime.forked() else ""))
        if self._closed:
            raise ClosedError("plan", "it was closed")
        if self._spent:
            raise ClosedError("plan", "it was one-shot (repeatable=False) and has launched; build a new plan")

    def _launch(self, stream: Stream | None, workspace: DeviceArray | None) -> Any:
        """Every launch but the steady state's; returns the output(s) the launch writes."""
        self._usable()
        state = resolve_stream(stream, self._device)
        size = self._core.workspace_size
        for name in self._spec.inputs:
            if name in self._arrays:
                check_written(self._arrays[name].allocation(name).track, waiting=False)
        if workspace is not None or not self._repeatable:
            if workspace is not None:
                ws_alloc = checked_workspace(workspace, size, self._device, "plan")
                if self._validate:
                    check_workspace_apart(workspace, self._arrays)
                return self._launch_held(state, workspace.address, size, ws_alloc)
            block = workspace_for(state, size) if size else None
            return self._launch_held(state, block.ptr if block is not None else 0, size, block)
        block = workspace_for(state, size) if size else None
        with self._lock:
            self._usable()
            self._finish_rebind()
            slot = self._slots.get(state)
            if slot is None or not slot.live or slot.keep[0] is not block:
                if slot is not None:
                    slot.stop()
                allocs = tuple(a.allocation(n) for n, a in self._arrays.items())
                call = aclnn.bound_call(self._spec.api, block.ptr if block is not None else 0, size,
                                        self._core.handle, state.handle)
                slot = _Slot(state, call, (block, *allocs), self._writes(), self._result())
                mark_uses(self._core, state)
                self._slots[state] = slot
            with state.lock:
                state.check_open()
                if _thread.context is not state.context:
                    state.device.activate()
                check(slot.call(), self._spec.api)
                state.stamp(slot.writes)
            self._now = (stream, slot)
            return slot.result

    def _writes(self) -> tuple[tuple[Any, bool], ...]:
        """(Track, whole) of each output the plan writes (StreamState.stamp)."""
        return tuple((a.allocation(n).track, a.whole) for n, a in self._arrays.items() if n in self._spec.outputs)

    def _launch_held(self, state: StreamState, ws: int, size: int, ws_alloc: Any) -> Any:
        """A launch that holds what it uses on the stream (a user's workspace, a one-shot
        plan), under the plan's lock so that no rebind falls between its arrays and its
        launch."""
        with self._lock:
            self._usable()
            self._finish_rebind()
            core = self._core
            mark_uses(core, state)
            if not self._repeatable:
                self._spent = True
            allocs = tuple(a.allocation(n) for n, a in self._arrays.items())
            result = self._result()
            launch(core, state, ws, size, (ws_alloc, *allocs), self._writes())
        return result

    def launch_probe(self, stream: Stream | None = None) -> tuple[Any, tuple[Any, ...]]:
        """The second phase's function and the arguments a launch on ``stream`` passes it, for
        timing one bare foreign call (the floor under the plan's launch). Launches once to bind
        the stream first."""
        if not self._repeatable:
            raise InvalidArgument("plan", "is one-shot (repeatable=False): only a repeatable plan has a launch to "
                                          "repeat")
        self(stream)
        slot = self._slots[resolve_stream(stream, self._device)]
        return slot.fn, slot.args

    # -- rebinding and release

    def _stop_slots(self) -> None:
        """Stop every slot (the plan's lock held) and hand what they kept to their streams."""
        self._now = _NOT_STEADY
        while self._slots:
            state = next(iter(self._slots))
            self._slots[state].stop()
            del self._slots[state]

    def _checked_changes(self, given: Mapping[str, Any]) -> dict[str, DeviceArray]:
        """The arrays a rebind was given (None: unchanged), each checked to have the layout
        the plan was built for and to be on its device."""
        if not self._repeatable and not self._closed:  # fixed at construction: no lock
            raise InvalidArgument("plan", "is one-shot (repeatable=False): rebinding needs a repeatable executor")
        self._usable()
        changes: dict[str, DeviceArray] = {}
        for name, new in given.items():
            if new is None:
                continue
            _args.instance(name, new, DeviceArray, "a DeviceArray or None")
            old = self._arrays.get(name)
            if old is None:
                raise InvalidArgument(name, "was not part of the plan (built as a null pointer): build a new plan "
                                            "to add it")
            if new.layout != old.layout:
                raise InvalidArgument(
                    name,
                    f"has shape {new.shape}, dtype {new.dtype}, strides {new.strides} but the plan was built for "
                    f"{old.shape}, {old.dtype}, {old.strides}: build a new plan for a different layout",
                )
            if new.allocation(name).device is not self._device:
                raise InvalidArgument(name, f"is on device {new.device.device_id}, the plan on "
                                            f"{self._device.device_id}")
            changes[name] = new
        return changes

    def _rebind(self, changes: Mapping[str, DeviceArray]) -> None:
        """Point the executor at ``changes`` (checked by :meth:`_checked_changes` for layout and
        device; for overlap here, under the lock). Launches already queued keep their arrays."""
        # CANN keeps the tensor's view offset: the base puts the first element where the new
        # array has it.
        todo = {name: (new, new.allocation(name), new.address - self._view_offsets[name] * new.itemsize)
                for name, new in changes.items()}
        with self._lock:
            if self._closed:
                raise ClosedError("plan", "it was closed")
            if self._validate and todo:
                bound = {**self._arrays, **{n: v[0] for n, v in self._rebinding.items()}}
                check_no_overlap(self._spec, {**bound, **changes})
            self._rebinding = {**self._rebinding, **todo}
            self._finish_rebind()

    def _finish_rebind(self) -> None:
        """Carry out the recorded rebind (lock held): stop the slots, then set each address and
        record its array. The record holds the new arrays until it is done, and the plan the
        old ones, so an interrupt anywhere leaves the executor on memory held; the next rebind
        or launch repeats the steps (setting an address again is harmless)."""
        todo = self._rebinding
        if not todo:
            return
        self._stop_slots()
        for name, (new, alloc, base) in todo.items():
            tcore = self._tensors[name].core()
            self._core.set_address(name, tcore, base)
            tcore.alloc = alloc
            self._tensors[name].rebound(new)
            self._arrays[name] = new
        self._rebinding = {}

    def close(self) -> None:
        """Destroy the executor, and release the plan's hold on its arrays and workspace once
        the work it queued is done. Safe twice; a launch in flight on another thread completes
        first. In a fork() child there is nothing left to release: the plan is only marked
        closed."""
        if _lifetime.forked():
            self._closed = True  # no lock: a parent thread may have held it at fork
            return
        with self._lock:
            self._closed = True
            self._stop_slots()
            self._rebinding = {}
        status = self._core.destroy()
        _lifetime.collect()
        check(status, "aclDestroyAclOpExecutor")

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SlotsHolder:
    """What a plan dropped without close() leaves: its slots, stopped at the next safe point."""

    __slots__ = ("slots",)

    def __init__(self, slots: dict[StreamState, _Slot]) -> None:
        self.slots = slots

    def release(self) -> int:
        while self.slots:
            state = next(iter(self.slots))
            self.slots[state].stop()
            del self.slots[state]
        return 0


# ---------------------------------------------------------------------------- the executor cache

class _Cached:
    """A repeatable executor for one layout on one stream, the addresses it is bound to now,
    and its launch with every argument bound for the workspace it was bound with (kept alive
    here: the stream may have taken another since, and this one is still good)."""

    __slots__ = ("core", "tensors", "offsets", "bound", "unknown", "call", "call_ws", "size")

    def __init__(self, spec: OpSpec, device: Device, arrays: Sequence[DeviceArray | None],
                 attrs: Mapping[str, Any]) -> None:
        # None: an optional tensor passed as a null pointer (its first address is 0 for good).
        nd = declare.const("ACL_FORMAT_ND")
        self.tensors = [None if a is None else TensorCore(a, nd) for a in arrays]
        # A cache must not keep a caller's memory alive: each launch holds its own arrays.
        for tc in self.tensors:
            if tc is not None:
                tc.alloc = None
        core = build(spec, device, {n: t for n, t in zip(spec.tensors, self.tensors) if t is not None}, attrs)
        core.set_repeatable()
        self.core = core
        self.size = core.workspace_size
        self.offsets = [0 if a is None else a.offset * a.itemsize for a in arrays]
        self.bound = [0 if a is None else a.span[0] for a in arrays]  # first-element addresses bound now
        # What ``bound`` is while a rebind is under way: no address (a null pointer's stays 0).
        self.unknown = [0 if a is None else -1 for a in arrays]
        self.call: Any = None
        self.call_ws: Any = None

    def rebind(self, spec: OpSpec, firsts: Sequence[int]) -> None:
        """Point the executor at views whose first elements are at ``firsts`` (the stream's
        lock held). Until every address is set the entry claims none, so that an interrupt
        half-way leaves the next call to set them all."""
        bound = self.bound
        self.bound = self.unknown
        for i, addr in enumerate(firsts):
            if addr != bound[i]:
                kind, index = spec.slot(spec.tensors[i])
                setter = aclnn.set_input_addr if kind == "input" else aclnn.set_output_addr
                tensor = self.tensors[i]
                assert tensor is not None  # a null pointer's first address is always 0
                setter(self.core.handle, index, tensor.handle, addr - self.offsets[i])
        self.bound = list(firsts)

    def bind(self, spec: OpSpec, block: Allocation | None, state: StreamState) -> Any:
        """The launch with every argument bound, for the workspace ``block``."""
        self.call = aclnn.bound_launch(spec.api, block.ptr if block is not None else 0, self.size, self.core.handle,
                                       state.handle)
        self.call_ws = block
        return self.call


class _ExecutorCache:
    """A stream's executors for one operator, by layout (in the stream's caches)."""

    SIZE = 8
    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: collections.OrderedDict[Any, _Cached] = collections.OrderedDict()

    def evict(self) -> None:
        """Destroy the least recently used executors beyond SIZE (the stream's lock held)."""
        while len(self.entries) > self.SIZE:
            self.entries.popitem(last=False)[1].core.destroy()

    def release(self, idle: bool) -> list[Any]:
        """Destroy the executors now: launches already queued captured what they need."""
        entries = list(self.entries.values())
        self.entries.clear()
        for e in entries:
            e.core.destroy()
        return []


def relaunch(spec: OpSpec, key: Any, firsts: list[int], allocs: list[Allocation | None],
             arrays: list[DeviceArray | None], state: StreamState) -> bool:
    """The steady state of :func:`launch_cached` (its arguments, the allocations and arrays in
    lists): launch the stream's cached executor for ``key`` with one bound foreign call and
    return True; False, launching nothing, when the stream has none for ``key`` yet (or a
    fault was recorded anywhere: the inputs are checked the long way). A key is cached only
    once its layout was validated, so a caller may check the layout only when this returns
    False.

    The launch holds only the allocations of foreign memory (whose owners must outlive it):
    the binding's own memory, once its arrays are gone, goes back to the block cache at once,
    reusable by later work on this stream only until this launch has run
    (:func:`~.allocator.allocate`)."""
    if state.device.closed or any_fault[0]:
        return False  # before the lock: in a fork() child a parent thread may have held it
    with state.lock:
        cache = state.caches.get(spec.api)  # a closing stream has none
        entry = cache.entries.get(key) if cache is not None else None
        if entry is None or entry.call is None or state.closing:
            return False
        keep = _mark_launch(state, allocs, arrays, len(spec.inputs))
        if _thread.context is not state.context:
            state.device.activate()
        if firsts != entry.bound:
            entry.rebind(spec, firsts)
        ledger = state.ledger
        ledger.count += 1  # Ledger.hold, inline
        ledger.holds.append((ledger.count, entry.call_ws, keep))
        st = entry.call()
        if st:
            check(st, spec.api)
        done = ledger.after_enqueue() if ledger.count >= ledger.next_fence else None
    del done  # outside the lock: dropping the last reference may free memory
    return True


def _mark_launch(state: StreamState, allocs: list[Allocation | None], arrays: list[DeviceArray | None],
                 n_in: int) -> list[Allocation] | None:
    """The stream uses the inputs and writes the outputs (Allocation.used_on, only when new),
    and the outputs' latest write is this launch (StreamState.stamp): a launch that then fails
    leaves a mark no fault can be recorded for. Returns the allocations of foreign memory, for
    the launch to hold. (The stream's lock held; a loop under a lock is a function of its own:
    ARCHITECTURE.md.)"""
    keep: list[Any] | None = None
    for a in allocs[:n_in]:  # (an input is never a null pointer)
        if state not in a.track.users:  # type: ignore[union-attr]
            a.used_on(state, False)  # type: ignore[union-attr]
        if not a.owned:  # type: ignore[union-attr]
            keep = [a] if keep is None else [*keep, a]
    mark = state.mark
    for i in range(n_in, len(allocs)):
        a = allocs[i]
        if a is None:
            continue
        t = a.track
        if state not in t.writers:
            a.used_on(state, True)
        if not a.owned:
            keep = [a] if keep is None else [*keep, a]
        if arrays[i].whole:  # type: ignore[union-attr]
            t.written = mark
        else:
            state.stamp(((t, False),))
    return keep


def launch_cached(spec: OpSpec, key: Any, arrays: Sequence[DeviceArray | None],
                  allocs: tuple[Allocation | None, ...], firsts: tuple[int, ...], attrs: Sequence[Any],
                  state: StreamState, workspace: DeviceArray | None) -> None:
    """Launch ``spec`` on ``arrays`` (in ``spec.tensors`` order, with their allocations and the
    addresses of their first elements, checked by the caller; None and 0 for an optional
    tensor passed as a null pointer) through the stream's cached executor for ``key`` (a
    number naming the layouts, which tensors are present and the attribute values: the one
    call's memo entry), made on a miss (the caller tried :func:`relaunch` first)."""
    state.check_open()
    for i, a in enumerate(allocs):
        if a is not None and i not in spec.output_positions:
            check_written(a.track, waiting=False)  # a faulted input would hand its garbage on
    # A miss (a new layout, a user's workspace, a stream without a workspace yet): the first
    # phase and the workspace are made outside the lock, then the launch under it. An entry
    # is only ever used under the lock: another thread may evict (and destroy) it meanwhile.
    built: _Cached | None = None
    outs = spec.output_positions
    while True:
        cache = state.caches.get(spec.api)
        entry = cache.entries.get(key) if cache is not None else None
        if entry is None:
            if built is None:
                built = _Cached(spec, state.device, arrays, dict(zip(spec.attrs, attrs)))
            entry = built
        size = entry.size
        block = workspace_for(state, size) if workspace is None and size else None
        if workspace is not None:
            block = checked_workspace(workspace, size, state.device, "stream")
        for i, a in enumerate(allocs):
            if a is not None:
                a.used_on(state, i in outs)
        with state.lock:
            state.check_open()
            cache = state.caches.get(spec.api)
            if cache is None:
                cache = state.caches[spec.api] = _ExecutorCache()
            current = cache.entries.get(key)
            if current is None:
                if built is None:
                    continue  # evicted since it was looked up: make one
                cache.entries[key] = entry = built
                cache.evict()
            else:
                entry = current  # ours, if made, goes
            if entry.size > size:
                continue  # another thread's entry needs more workspace than was fetched
            if _thread.context is not state.context:
                state.device.activate()
            if list(firsts) != entry.bound:
                entry.rebind(spec, firsts)
            state.ledger.hold((block, allocs))
            if workspace is None:
                check(entry.bind(spec, block, state)(), spec.api)
            else:
                aclnn.launch(spec.api, workspace.address, entry.size, entry.core.handle, state.handle, False)
            state.stamp((a.track, arrays[i].whole) for i, a in enumerate(allocs)  # type: ignore[union-attr]
                        if a is not None and i in outs)
            done = state.ledger.after_enqueue()
        del done
        if built is not None and built is not entry:
            built.core.destroy()
        _lifetime.collect()
        return
