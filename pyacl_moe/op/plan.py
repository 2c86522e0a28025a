"""Prepared launches of any aclnn operator, and the executor cache behind the one-call functions.

A :class:`Plan` runs the first phase once over fixed DeviceArrays and relaunches its
(repeatable) executor. On each stream it launches on, it makes a :class:`_Slot`: the second
phase with every argument bound, and what those arguments point at. The steady state launches
through the slot with one foreign call and no lock. Whoever ends a slot (the plan closing or
rebinding, its stream or device closing) *detaches* it: marks it dead and waits for launches in
flight through it, then retires what it kept on its stream, to be released once the work queued
there is done.

The one-call functions use :func:`launch_cached`: each stream keeps a small cache of repeatable
executors by layout, used under the stream's lock, and rebinds the one that matches to each
call's arrays. Its steady state, :func:`relaunch`, comes first: a layout cached on the stream
was validated when its executor was made, so a caller checks layouts only on a miss.

Lock order: a plan's lock, an executor's lock, a stream's lock, a pool's lock.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from .. import _args, _lifetime
from .._cann import acl, aclnn, declare
from .._cann.errcheck import check, recent_message
from ..array import Allocation, DeviceArray, may_overlap
from ..device import Device
from ..errors import ClosedError, InvalidArgument
from ..pool import workspace_for
from ..stream import Stream, StreamState, resolve_stream, thread_current
from ..tensor import AclTensor, TensorCore
from .executor import Executor, build, checked_workspace, launch, mark_uses, register_uses
from .spec import OpSpec

__all__ = ["Plan", "check_no_overlap", "check_workspace_apart", "launch_cached", "relaunch"]

_P = TypeVar("_P", bound="Plan")  # a plan's `with` gives the subclass it was entered on
_thread = acl.thread_state  # the calling thread's current context (read only)


class _Slot:
    """A plan's launch on one stream: the second phase's function and its bound arguments,
    and what those arguments point at (see the module docstring).

    The steady state launches with no lock and no counter: it unpacks the function and its
    argument tuple from the plan's published ``_now`` into local variables and calls
    ``fn(*args)``. ``detach()`` swaps in a call that reaches no CANN (it answers -1; no CANN
    status is negative), unpublishes ``_now``, then waits until no thread can still be
    making the old call: the reference count of its argument tuple is back to ours, or else
    (a reference kept by something else, a traceback say) no frame of the launch code holds
    it in ``args``. A read-copy-update whose grace period costs the steady state nothing.
    Launch code deletes its local ``args`` before anything that may wait."""

    __slots__ = ("state", "context", "call", "keep", "result", "dead", "plan", "stopping", "__weakref__")

    def __init__(self, state: StreamState, keep: tuple[Any, ...], result: Any, plan: Plan) -> None:
        self.state = state
        self.context = state.context
        self.call: tuple[Any, tuple[Any, ...]] = _DETACHED  # bound once the slot is registered
        self.keep = keep  # what the bound arguments point at: the workspace, the allocations
        self.result = result  # what the plan returns
        self.dead = False
        self.plan = weakref.ref(plan)  # whose _now may publish this slot (the plan holds us)
        self.stopping: tuple[Any, ...] = ()  # the arguments of the call a detach waits to see go

    def publish(self, stream: Stream | None) -> None:
        """Make this slot the plan's steady state for calls with this ``stream`` argument,
        unless it was detached meanwhile. With one device open the launch skips the thread's
        context check (None); opening a second device unpublishes every plan (see
        :func:`_unpublish_all`)."""
        with _DETACH_LOCK:
            plan = self.plan()
            if not self.dead and plan is not None:
                fn, args = self.call
                context = None if acl.contexts_open == 1 else self.context
                plan._now = (stream, fn, args, self.result, context)

    def detach(self) -> None:
        """Stop the slot and wait for the launches in flight through it (they are short: one
        foreign call each). Safe twice and from several threads (the plan, its stream, its
        device may each stop it): the first does it, the others wait for it under the lock.
        An interrupted detach is resumed by the next: the call it waits for is kept on the
        slot until no launch makes it."""
        with _DETACH_LOCK:
            if self.dead:
                return
            if self.call is not _DETACHED:
                self.stopping = self.call[1]
                self.call = _DETACHED
            old = self.stopping
            plan = self.plan()
            if plan is not None and plan._now[2] is old:
                plan._now = _NOT_STEADY
            del plan
            # Three references are ours: the slot's, `old`, and getrefcount's own argument.
            while old and sys.getrefcount(old) > 3 and _in_a_launch(old):
                time.sleep(0.0001)
            self.dead = True
            self.stopping = ()


def _in_a_launch(args: tuple[Any, ...]) -> bool:
    """Whether some thread is inside a launch with this argument tuple (a frame of the launch
    code holding it). Only asked when another reference to it exists."""
    for top in sys._current_frames().values():
        frame: types.FrameType | None = top
        while frame is not None:
            if frame.f_code in _LAUNCH_CODES and frame.f_locals.get("args") is args:
                return True
            frame = frame.f_back
    return False


_DETACHED: tuple[Any, tuple[Any, ...]] = (functools.partial(int, -1), ())  # reaches no CANN
_DETACH_LOCK = threading.Lock()  # one detach or publish at a time (launches never take it)
_NO_STREAM = object()  # matches no stream argument (not even None)
# A plan's _now before a launch and after its slot is detached: (stream argument, function,
# arguments, result, context to check or None).
_NOT_STEADY = (_NO_STREAM, *_DETACHED, None, None)
_plans: _lifetime.WeakMap[Plan, None] = _lifetime.WeakMap()  # every plan, to unpublish


def _unpublish_all() -> None:
    """A second device opened: published launches that skip the context check must go (the
    next launch of each plan publishes again, with the check)."""
    with _DETACH_LOCK:
        for plan in _plans.keys():
            if plan._now[4] is None:
                plan._now = _NOT_STEADY


acl.watch_contexts(_unpublish_all)


def _after_fork_in_child() -> None:
    global _DETACH_LOCK
    _DETACH_LOCK = threading.Lock()  # a parent thread may have held it
    # Inherited CANN objects are dead here: no launch may reach them without the slow way's
    # checks.
    for plan in _plans.keys():
        plan._now = _NOT_STEADY


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Slots:
    """A plan's slots by stream, and their one release: stop each, then hand what it kept to
    its stream until the launches queued there have run."""

    __slots__ = ("slots",)

    def __init__(self) -> None:
        self.slots: dict[StreamState, _Slot] = {}

    @staticmethod
    def detach(slots: dict[StreamState, _Slot]) -> None:
        # A slot is forgotten only once it is stopped and what it kept is retired: an
        # interrupt leaves it (and the rest) to the next detach, which repeats what was done
        # (a second retire of the same arrays only holds them as long as the first).
        while slots:
            state = next(iter(slots))
            slot = slots[state]
            slot.detach()
            slot.state.retire(slot.keep)
            del slots[state]

    def release(self) -> int:
        """The plan went without close() (the holder's release, at a safe point)."""
        self.detach(self.slots)
        return 0


def check_no_overlap(spec: OpSpec, arrays: Mapping[str, DeviceArray | None]) -> None:
    """Refuse an output that shares memory with another tensor of the launch: the kernel would
    read what it is overwriting."""
    for out_name in spec.outputs:
        out = arrays.get(out_name)
        if out is None:
            continue
        for name in spec.tensors:
            other = arrays.get(name)
            if name == out_name or other is None:
                continue
            if may_overlap(out, other):
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
    _now: tuple[Any, Any, tuple[Any, ...], Any, Any] = _NOT_STEADY  # the steady state (see _Slot)

    def _prepare(self, device: Device, arrays: Mapping[str, DeviceArray], attrs: Mapping[str, Any],
                 repeatable: bool) -> None:
        self._lock = threading.Lock()  # guards _slots, _closed, _spent, _arrays, _rebinding, the executor's addresses
        _plans.add(self)
        # The slots, by stream. Their holder hands what they keep to their streams when the plan
        # goes without close(): launches it queued may not have run.
        holder = _Slots()
        self._slots = holder.slots
        _lifetime.track(self, holder)
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
        # An optional tensor passed as a null pointer has no aclTensor.
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

    def _device_open(self) -> None:
        # In a fork() child too (its devices are closed): checked before any lock of the plan,
        # which a parent thread may have held at fork.
        if self._device.closed:
            raise ClosedError("plan", f"its device {self._device.device_id} was closed"
                                      + (" (or this is a fork() child)" if _lifetime.forked() else ""))

    def _usable(self) -> None:
        if self._closed:
            raise ClosedError("plan", "it was closed")
        self._device_open()
        if self._spent:
            raise ClosedError("plan", "it was one-shot (repeatable=False) and has launched; build a new plan")

    def _launch(self, stream: Stream | None, workspace: DeviceArray | None) -> Any:
        """Every launch but the steady state's; returns the output(s) the launch writes."""
        self._usable()
        state = resolve_stream(stream, self._device)
        size = self._core.workspace_size
        if workspace is not None:
            ws_alloc = checked_workspace(workspace, size, self._device, "plan")
            if self._validate:
                check_workspace_apart(workspace, self._arrays)
            return self._launch_held(state, workspace.address, size, ws_alloc)
        if not self._repeatable:
            block = workspace_for(state, size) if size else None
            return self._launch_held(state, block.ptr if block is not None else 0, size, block)
        while True:
            slot = self._slots.get(state)
            if slot is None or slot.dead:
                slot = self._make_slot(state)
            if _thread.context is not slot.context:
                slot.state.device.activate()
            fn, args = slot.call
            st = fn(*args)
            del args  # before anything that may wait (see _Slot)
            if st >= 0:  # -1: detached between being made and launched
                check(st, self._spec.api)
                slot.publish(stream)
                return slot.result  # the outputs this slot's executor writes, whatever rebinds since
            # The slot died between being made and launched: a rebind (look again), or a close.
            self._usable()
            state.check_open()

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
            launch(core, state, ws, size, (ws_alloc, *allocs))
        return result

    def _make_slot(self, state: StreamState) -> _Slot:
        core = self._core
        size = core.workspace_size
        block = workspace_for(state, size) if size else None
        with self._lock:
            self._usable()
            self._finish_rebind()
            slot = self._slots.get(state)
            if slot is not None and not slot.dead:
                return slot
            keep = (block, *(a.allocation(n) for n, a in self._arrays.items()))
            slot = _Slot(state, keep, self._result(), self)
            slot.call = aclnn.bound_call(self._spec.api, block.ptr if block is not None else 0, size, core.handle,
                                         state.handle)
            mark_uses(core, state)
            state.add_launcher(slot)
            self._slots[state] = slot
            return slot

    def __call__(self, stream: Stream | None = None, workspace: DeviceArray | None = None) -> Any:
        """Queue the kernel on ``stream`` (default: the thread's current stream) and return the
        output(s). ``workspace``: your own DeviceArray of at least ``workspace_size`` bytes; by
        default the stream's workspace from the device's pool."""
        # The steady state, inlined (a call here is a measurable share of a launch): one
        # foreign call with the tuple of arguments as it is, no lock (see _Slot). ``context``
        # is None while one device is open: a launch on a thread without its context then
        # fails cleanly and goes the slow way, which makes it current.
        if stream is None:
            # Inside `with stream:` a call without a stream goes there (and publishes for it,
            # never for None, which means the default stream).
            cur = thread_current.stream
            if cur is not None and cur.state.device is self._device:
                stream = cur
        s, fn, args, result, context = self._now
        if s is stream and workspace is None and (context is None or _thread.context is context):
            st = fn(*args)
            if not st:
                return result
            del args  # before anything that may wait (see _Slot)
            if st > 0:  # -1: detached meanwhile; the slow way says why
                if _thread.context is (context or acl.only_context):
                    check(st, self._spec.api)  # a real failure: the context was right
                recent_message()  # no context on this thread yet: drop the message, retry
        else:
            del args
        return self._launch(stream, workspace)

    def launch_probe(self, stream: Stream | None = None) -> tuple[Any, tuple[Any, ...]]:
        """The second phase's function and the arguments a launch on ``stream`` passes it, for
        timing one bare foreign call (the floor under the plan's launch). Launches once to bind
        the stream first (again if a rebind meanwhile unbound it)."""
        if not self._repeatable:
            raise InvalidArgument("plan", "is one-shot (repeatable=False): only a repeatable plan has a launch to "
                                          "repeat")
        while True:
            self(stream)
            slot = self._slots.get(resolve_stream(stream, self._device))
            if slot is not None and not slot.dead:
                break
        block = slot.keep[0]
        fn, args = aclnn.bound_call(self._spec.api, block.ptr if block is not None else 0, self._core.workspace_size,
                                    self._core.handle, slot.state.handle)
        return fn, args

    # -- rebinding and release

    def _detach_all(self) -> None:
        """Stop every slot (lock held) and hand what they kept to their streams."""
        _Slots.detach(self._slots)

    def _checked_changes(self, given: Mapping[str, Any]) -> dict[str, DeviceArray]:
        """The arrays a rebind was given (None: unchanged), each checked to have the layout
        the plan was built for and to be on its device."""
        self._device_open()  # a closed device's plan has none to compare with
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
                raise InvalidArgument(
                    name, f"is on device {new.device.device_id}, the plan on {self._device.device_id}"
                )
            changes[name] = new
        return changes

    def _rebind(self, changes: Mapping[str, DeviceArray]) -> None:
        """Point the executor at ``changes`` (name -> array, checked by :meth:`_checked_changes`
        for its layout and device; for overlap here, under the lock, against the arrays the
        plan has then). Launches already queued keep the arrays they were queued with."""
        self._device_open()
        # What CANN is told of each new array, read before anything changes. CANN keeps the
        # tensor's view offset: the base puts the first element where the new array has it.
        todo = {name: (new, new.allocation(name), new.address - self._view_offsets[name] * new.itemsize)
                for name, new in changes.items()}
        with self._lock:
            if self._closed:
                raise ClosedError("plan", "it was closed")
            if not self._repeatable:
                raise InvalidArgument("plan", "is one-shot (repeatable=False): rebinding needs a repeatable executor")
            if self._validate and todo:
                bound = {**self._arrays, **{n: v[0] for n, v in self._rebinding.items()}}
                check_no_overlap(self._spec, {**bound, **changes})
            self._rebinding = {**self._rebinding, **todo}
            self._finish_rebind()

    def _finish_rebind(self) -> None:
        """Carry out the recorded rebind (lock held): stop the slots, then set each address
        and record its array. The record holds the new arrays until it is done, and the plan
        the old ones, so an interrupt anywhere leaves the executor on memory held; the next
        rebind or launch repeats the steps (setting an address again is harmless)."""
        todo = self._rebinding
        if not todo:
            return
        self._detach_all()
        core = self._core
        for name, (new, alloc, base) in todo.items():
            tcore = self._tensors[name].core()
            core.set_address(name, tcore, base)
            tcore.alloc = alloc
            self._tensors[name].rebound(new)
            self._arrays[name] = new
        self._rebinding = {}

    def close(self) -> None:
        """Destroy the executor, and release the plan's hold on its arrays and workspace once
        the work it queued is done. Safe twice; a launch in flight on another thread completes
        first; a close that was interrupted is finished by the next. In a fork() child there
        is nothing left to release: the plan is only marked closed."""
        if _lifetime.forked():
            self._closed = True  # no lock: a parent thread may have held it at fork
            return
        with self._lock:
            self._closed = True
            self._detach_all()  # nothing left to do after a complete close
            self._rebinding = {}
        status = self._core.destroy()  # exactly once, whoever calls
        _lifetime.collect()
        check(status, "aclDestroyAclOpExecutor")

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The code objects of the launches that hold a slot while they call it.
_LAUNCH_CODES = (Plan.__call__.__code__, Plan._launch.__code__)


# ---------------------------------------------------------------------------- the executor cache

class _Cached:
    """A repeatable executor for one layout on one stream, the addresses it is bound to now,
    and its launch with every argument bound, with the workspace it was bound with (kept alive
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
        self.bound = tuple(0 if a is None else a.span[0] for a in arrays)  # first-element addresses bound now
        # What ``bound`` is while a rebind is under way: no address (a null pointer's stays 0).
        self.unknown = tuple(0 if a is None else -1 for a in arrays)
        self.call: Any = None
        self.call_ws: Any = None

    def rebind(self, spec: OpSpec, firsts: tuple[int, ...]) -> None:
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
        self.bound = firsts

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

    def release(self, idle: bool) -> list[Any]:
        """Destroy the executors now: launches already queued captured what they need."""
        entries = list(self.entries.values())
        self.entries.clear()
        for e in entries:
            e.core.destroy()
        return []


def relaunch(spec: OpSpec, key: Any, firsts: tuple[int, ...], allocs: tuple[Allocation | None, ...],
             state: StreamState, unregistered: bool) -> bool:
    """The steady state of :func:`launch_cached` (same arguments): launch the stream's cached
    executor for ``key`` with one bound foreign call and return True; False, launching
    nothing, when the stream has none for ``key`` yet. A key is cached only once its layout
    was validated, so a caller may check the layout only when this returns False.
    ``unregistered``: the caller could not tell that the allocations are registered as used on
    the stream already (:func:`~.executor.register_uses`)."""
    if state.device.closed:
        # Before the lock: in a fork() child (its devices are closed) a parent thread may have
        # held it.
        state.check_open()
    with state.lock:
        cache = state.caches.get(spec.api)  # a closing stream has none
        entry = cache.entries.get(key) if cache is not None else None
        if entry is None or entry.call is None:
            return False
        if unregistered:
            register_uses(spec, allocs, state)
        # With one device open, the thread's context is not checked first: a launch without
        # one fails cleanly, and the context is made current for the retry.
        if acl.only_context is not state.context and _thread.context is not state.context:
            state.device.activate()
        if firsts != entry.bound:
            entry.rebind(spec, firsts)
        ledger = state.ledger
        ledger.count += 1
        ledger.holds.append((ledger.count, entry.call_ws, allocs))
        st = entry.call()
        if st:
            if _thread.context is state.context:
                check(st, spec.api)
            recent_message()
            state.device.activate()
            check(entry.call(), spec.api)
        done = ledger.after_enqueue() if ledger.count >= ledger.next_fence else None
    del done  # outside the lock: dropping the last reference may free memory
    return True


def launch_cached(spec: OpSpec, key: Any, arrays: Sequence[DeviceArray | None],
                  allocs: tuple[Allocation | None, ...], firsts: tuple[int, ...], attrs: Sequence[Any],
                  state: StreamState, workspace: DeviceArray | None) -> None:
    """Launch ``spec`` on ``arrays`` (in ``spec.tensors`` order, with their allocations and the
    addresses of their first elements, checked by the caller; None and 0 for an optional
    tensor passed as a null pointer) through the stream's cached executor for ``key`` (layout,
    which tensors are present, and attribute values, in ``spec.attrs`` order), made on a
    miss."""
    if workspace is None and relaunch(spec, key, firsts, allocs, state, True):
        return
    if state.device.closed:
        state.check_open()  # before any lock (see relaunch)
    register_uses(spec, allocs, state)
    # A miss (a new layout, a user's workspace, a stream without a workspace yet): the first
    # phase and the workspace are made outside the lock, then the launch under it. An entry
    # is only ever used under the lock: another thread may evict (and destroy) it meanwhile.
    built: _Cached | None = None
    while True:
        cache = state.caches.get(spec.api)
        entry = cache.entries.get(key) if cache is not None else None
        if entry is None:
            if built is None:
                built = _Cached(spec, state.device, arrays, dict(zip(spec.attrs, attrs)))
            entry = built
        size = entry.size
        if workspace is None:
            block = workspace_for(state, size) if size else None
        else:
            block = checked_workspace(workspace, size, state.device, "stream")
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
                while len(cache.entries) > _ExecutorCache.SIZE:
                    cache.entries.popitem(last=False)[1].core.destroy()
            else:
                entry = current  # ours, if made, goes
            if entry.size > size:
                continue  # another thread's entry needs more workspace than was fetched
            if _thread.context is not state.context:
                state.device.activate()
            if firsts != entry.bound:
                entry.rebind(spec, firsts)
            state.ledger.hold((block, allocs))
            if workspace is None:
                st = entry.bind(spec, block, state)()
                if st:
                    check(st, spec.api)
            else:
                aclnn.launch(spec.api, workspace.address, entry.size, entry.core.handle, state.handle, False)
            done = state.ledger.after_enqueue()
        del done
        return
