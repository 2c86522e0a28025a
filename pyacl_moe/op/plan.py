"""Prepared launches of any aclnn operator.

A :class:`Plan` runs the first phase once over fixed DeviceArrays and relaunches its
(repeatable) executor. A launch on the stream of its last launch (``last``), open and with a
workspace that holds the plan's, is that one foreign call under the stream's lock. The plan
keeps its arrays and the streams it launched on; when it lets go of them (a rebind, a close,
the plan dropped) it clears ``last`` and hands its arrays to each stream, under that stream's
lock, to keep until the work queued there so far has run: no launch through it is in flight
afterwards.

Lock order: a plan's lock, an executor's lock, a stream's lock.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import _args
from .._cann import acl, aclnn
from .._cann.errcheck import check
from ..array import DeviceArray, empty_from, may_overlap
from ..device import PLANS, Allocation, Device, Owner, collect
from ..errors import ClosedError, InvalidArgument
from ..stream import Stream, StreamState, resolve_stream, thread_current, written
from ..tensor import AclTensor
from .executor import Executor, build, checked_workspace, device_of, launch
from .spec import OpSpec

__all__ = ["Plan", "check_no_overlap", "check_workspace_apart"]

_thread = acl.thread_state  # the calling thread's current context (read only)


def check_no_overlap(spec: OpSpec, arrays: Mapping[str, DeviceArray | None]) -> None:
    """Refuse an output that shares memory with another tensor of the launch: the kernel would
    read what it is overwriting."""
    for out_name, name in itertools.product(spec.outputs, spec.tensors):
        out, other = arrays.get(out_name), arrays.get(name)
        if name != out_name and out is not None and other is not None and may_overlap(out, other):
            raise InvalidArgument(out_name, f"shares device memory with {name}: the kernel would overwrite what "
                                            "it reads (use a separate output array)")


def check_workspace_apart(workspace: DeviceArray, arrays: Mapping[str, DeviceArray | None]) -> None:
    """Refuse a caller's workspace that shares memory with a tensor of the launch: the kernel
    writes its workspace (the forward sorts in it) and would overwrite what it reads or
    writes."""
    for name, a in arrays.items():
        if a is not None and may_overlap(workspace, a):
            raise InvalidArgument("workspace", f"shares device memory with {name}: the kernel writes its workspace "
                                               "(use a separate array)")


class _PlanCore:
    """A plan's state, the device's holder for it (released when the Plan is gone: it lets go
    of its streams then). ``lock`` guards ``allocs``, ``streams``, ``rebinding``, ``closed``,
    ``spent`` and the executor's addresses. ``arrays``, ``outs`` and ``result`` are replaced
    whole under ``lock`` and read without it (published: a reader sees one complete value);
    so is ``last`` (the stream of the last launch, the steady state's test; None once it must
    not be trusted)."""

    __slots__ = ("lock", "spec", "device", "ctx", "executor", "tensors", "arrays", "allocs", "outs", "streams",
                 "rebinding", "closed", "spent", "last", "result", "result_of", "fn", "ex", "size",
                 "__weakref__")
    RANK = PLANS
    API = "aclDestroyAclOpExecutor"

    def __init__(self, spec: OpSpec, device: Device, arrays: Mapping[str, DeviceArray], attrs: Mapping[str, Any],
                 repeatable: bool, result_of: Any) -> None:
        self.lock, self.spec, self.device, self.ctx = threading.Lock(), spec, device, device.context
        self.arrays = dict(arrays)
        self.allocs = {n: a.allocation(n) for n, a in arrays.items()}
        self.outs = tuple(self.allocs[n] for n in spec.outputs if n in self.allocs)
        self.streams: dict[StreamState, Any] = {}
        self.rebinding: dict[str, tuple[DeviceArray, Allocation, int]] = {}
        self.closed = self.spent = False
        self.last: StreamState | None = None
        self.tensors = {n: AclTensor(arrays[n]) for n in spec.tensors if n in arrays}  # (the op's order: Plan.executor)
        self.executor = build(spec, device, {n: t.core() for n, t in self.tensors.items()}, attrs)
        if repeatable:
            self.executor.set_repeatable()
        # The second phase, launched as fn(the stream's workspace, size, ex, stream) where bound.
        self.fn, self.ex, self.size = aclnn.second_phase(spec.api), acl.raw(self.executor.handle), \
            self.executor.workspace_size
        self.result_of = result_of
        self.result = result_of(self.arrays)

    def release(self) -> int:
        """Let go of every stream, then destroy the executor."""
        with self.lock:
            self.closed = True
            self.let_go()
        return self.executor.destroy()

    dropped = release

    def let_go(self) -> None:
        """(lock held) Unbind from every stream, each keeping the plan's arrays until the work
        queued there so far has run."""
        self.last = None
        while self.streams:
            _unbind(next(iter(self.streams)), self)

    def finish_rebind(self) -> None:
        """(lock held) Carry out the recorded rebind: let go of the streams, then set each
        address and record its array. The record holds the new arrays until it is done, and the
        plan the old ones, so an interrupt anywhere leaves the executor on memory held; the
        next rebind or launch repeats the steps (setting an address again is harmless)."""
        if not self.rebinding:
            return
        self.let_go()
        for name, (new, alloc, base) in self.rebinding.items():
            self.executor.set_address(*self.spec.slot(name), self.tensors[name].core(), base)
            self.tensors[name].rebound(new)
            self.allocs[name] = alloc
            self.arrays = {**self.arrays, name: new}  # (published whole: read without the lock)
        self.outs = tuple(self.allocs[n] for n in self.spec.outputs if n in self.allocs)
        self.result = self.result_of(self.arrays)
        self.rebinding = {}


def _workspace(state: StreamState, size: int) -> Allocation | None:
    """The stream's workspace when it holds ``size`` bytes (read under its lock: another
    thread's empty_cache may take it, or a smaller one replace it)."""
    with state.lock:
        return state.workspace if state.ws_size >= size else None


def _unbind(state: StreamState, core: _PlanCore) -> None:
    with state.lock:
        # What became free is dropped at the return, outside the lock.
        done = state.keep(tuple(core.allocs.values()))  # noqa: F841
    del core.streams[state]


class Plan(Owner):
    """A prepared launch of an operator on fixed DeviceArrays (see the module docstring).

    Subclasses (one per operator) name their op's one call (``_op``: its contract) and call
    ``_build``. ``plan(stream, workspace)`` queues the kernel; ``rebind(...)`` points it at
    other arrays of the same layout; ``close()`` releases it once the work it queued is done.
    """

    _op: Any  # the op's OneCall: its spec and contract
    _c: _PlanCore
    # What a launch returns, from the plan's arrays (each subclass's staticmethod).
    _result_of: Callable[[Mapping[str, DeviceArray]], Any]

    def _build(self, given: list[Any], values: tuple[Any, ...], repeatable: Any, validate: Any) -> None:
        """The plan on ``given`` (the op's tensors in order: the inputs, then the outputs, None
        for one to make) and the attribute ``values``: the contract checked (with
        ``validate``), the outputs not given made (those the scenario writes)."""
        op = self._op
        spec = op.spec
        self._validate = validate = _args.boolean("validate", validate)
        self._repeatable = repeatable = _args.boolean("repeatable", repeatable)
        n_in = len(spec.inputs)
        arrays = {name: _args.instance(name, a, DeviceArray, "a DeviceArray" if i < n_in else "a DeviceArray or None")
                  for i, (name, a) in enumerate(zip(spec.tensors, given)) if a is not None or i < n_in}
        dev = device_of(arrays)
        attrs, _, at, makes = op.outputs(given, values, validate)
        # Homed on no stream, free for any: the plan launches on whichever it is given (the plan
        # keeps them alive until the work it queued has run).
        for i, made in zip(at, empty_from(makes, [m[1] for m in makes], dev, None)):
            arrays[spec.tensors[i]] = made
        if validate:
            check_no_overlap(spec, arrays)
        collect()
        # The aclTensors keep the view offsets they were built with, whatever they are rebound to.
        self._view_offsets = {n: a.offset for n, a in arrays.items()}
        self._c = _PlanCore(spec, dev, arrays, attrs, repeatable, type(self)._result_of)
        dev.own(self._c, self)

    # -- properties

    @property
    def workspace_size(self) -> int:
        """Bytes of workspace a launch needs."""
        return self._c.executor.workspace_size

    @property
    def executor(self) -> Executor:
        """The plan's executor (closing it is the plan's business: use ``plan.close()``)."""
        return Executor(self._c.executor, tuple(self._c.tensors.values()))

    @property
    def closed(self) -> bool:
        """True once closed."""
        c = getattr(self, "_c", None)
        return c is None or c.closed

    @property
    def handle(self) -> int:
        """The plan's aclOpExecutor* as an integer (0 once closed)."""
        c = getattr(self, "_c", None)
        return c.executor.holder.handle.address if c is not None else 0

    @property
    def device(self) -> Device:
        """The device the plan launches on."""
        return self._c.device

    # -- launching

    def __call__(self, stream: Stream | None = None, workspace: DeviceArray | None = None) -> Any:
        """Queue the kernel on ``stream`` (default: the thread's current stream) and return the
        output(s). ``workspace``: your own DeviceArray of at least ``workspace_size`` bytes; by
        default the stream's workspace."""
        c = self._c
        if stream is None:
            cur = thread_current.stream  # inside `with stream:`, a call without one goes there
            state = cur.state if cur is not None and cur.state.device is c.device else None
        else:
            state = stream.state if type(stream) is Stream else None
        # The steady state: the stream of the last launch, the device open (checked before the
        # lock: in a fork() child a parent thread may have held it) and not faulted.
        if state is not None and state is c.last and workspace is None and c.ctx.open and c.device.fault is None:
            with state.lock:
                if c.last is state and not state.closing and state.ws_size >= c.size:  # (let go of: last is None)
                    if _thread.context is not state.ctx:
                        acl.use_context(state.ctx)
                    # A point for the launch: the stream's workspace it uses (and a block it
                    # lets go of) is free for another stream only once a wait or fence covers it.
                    state.point += 1
                    st = c.fn(state.ws_arg, c.size, c.ex, state.arg)
                    if not st:
                        if len(c.outs) == 1:  # (the backward: its one output, without a loop's frame)
                            c.outs[0].writer = state
                        else:
                            written(c.outs, state)
                        return c.result
                    check(st, c.spec.api)
        return self._launch(stream, workspace)

    def _usable(self) -> None:
        c = self._c
        if not c.ctx.open:
            raise ClosedError("plan", f"its device {c.device.device_id} was closed or reset"
                                      + (" (or this is a fork() child)" if acl.forked() else ""))
        if c.closed:
            raise ClosedError("plan", "it was closed")
        if c.spent:
            raise ClosedError("plan", "it was one-shot (repeatable=False) and has launched; build a new plan")

    def _launch(self, stream: Stream | None, workspace: DeviceArray | None) -> Any:
        """Every launch but the steady state's; returns the output(s) the launch writes."""
        self._usable()
        c = self._c
        state = resolve_stream(stream, c.device)
        c.device.check()
        ws_alloc = None if workspace is None else checked_workspace(workspace, c.size, c.device, "plan")
        if workspace is not None and self._validate:
            check_workspace_apart(workspace, c.arrays)
        while True:
            if c.size and ws_alloc is None:
                state.ensure_workspace(c.size)
            with c.lock:
                self._usable()
                c.finish_rebind()
                if ws_alloc is not None or not self._repeatable:  # a launch of its own, not bound to the stream
                    ws = ws_alloc or _workspace(state, c.size)
                    if c.size and ws is None:
                        continue  # the stream's workspace went meanwhile (empty_cache): grow it again
                    c.spent = not self._repeatable
                    launch(c.executor, state, ws.ptr if ws is not None else 0, c.size, (ws, tuple(c.allocs.values())),
                           c.outs)
                    return c.result
                # Bind the plan to the stream and launch, unless the stream's workspace went
                # meanwhile (then try again).
                with c.executor.holder.lock, state.lock:
                    state.check_open()
                    c.executor.check_live()
                    if state.ws_size >= c.size:
                        c.streams[state] = None
                        acl.use_context(state.ctx)
                        state.point += 1  # (as the steady state's launch)
                        check(c.fn(state.ws_arg, c.size, c.ex, state.arg), c.spec.api)
                        written(c.outs, state)
                        c.last = state
                        return c.result

    def launch_probe(self, stream: Stream | None = None) -> tuple[Any, tuple[Any, ...]]:
        """The second phase's function and the arguments a launch on ``stream`` passes it, for
        timing one bare foreign call (the floor under the plan's launch). Launches once to bind
        the stream first."""
        if not self._repeatable:
            raise InvalidArgument("plan", "is one-shot (repeatable=False): only a repeatable plan has a launch to "
                                          "repeat")
        self(stream)
        state, c = resolve_stream(stream, self._c.device), self._c
        with state.lock:
            return c.fn, (state.ws_arg, c.size, c.ex, state.arg)

    # -- rebinding and release

    def _rebind(self, given: Sequence[Any]) -> None:
        """Point the executor at the arrays ``given`` (the op's tensors in order, None:
        unchanged), each checked to have the layout the plan was built for and to be on its
        device (for overlap under the lock), with its allocation and the base to set: CANN
        keeps the tensor's view offset, so the base puts the first element where the new array
        has it. Launches already queued keep theirs."""
        if not self._repeatable and not self._c.closed:
            raise InvalidArgument("plan", "is one-shot (repeatable=False): rebinding needs a repeatable executor")
        self._usable()
        c = self._c
        todo: dict[str, tuple[DeviceArray, Allocation, int]] = {}
        for name, new in zip(c.spec.tensors, given):
            if new is None:
                continue
            _args.instance(name, new, DeviceArray, "a DeviceArray or None")
            old = c.arrays.get(name)
            if old is None:
                raise InvalidArgument(name, "was not part of the plan (built as a null pointer): build a new plan "
                                            "to add it")
            if new.layout != old.layout:
                raise InvalidArgument(
                    name, f"has shape {new.shape}, dtype {new.dtype}, strides {new.strides} but the plan was built "
                          f"for {old.shape}, {old.dtype}, {old.strides}: build a new plan for a different layout")
            alloc = new.allocation(name)
            if alloc.device is not c.device:
                raise InvalidArgument(name, f"is on device {new.device.device_id}, the plan on {c.device.device_id}")
            todo[name] = (new, alloc, new.address - self._view_offsets[name] * new.itemsize)
        with c.lock:
            self._usable()  # (closed meanwhile?)
            pending = {**c.rebinding, **todo}
            if self._validate and todo:
                check_no_overlap(c.spec, {**c.arrays, **{n: v[0] for n, v in pending.items()}})
            c.rebinding = pending
            c.finish_rebind()

    def close(self) -> None:
        """Destroy the executor, and let go of the plan's arrays and workspace once the work it
        queued is done. Safe twice; a launch in flight on another thread completes first."""
        c = self._c
        if not c.ctx.open and acl.forked():
            c.closed = True  # nothing of the parent's to release (and its locks may be held)
            return
        check(c.device.release(c), "aclDestroyAclOpExecutor")
        collect()

    def __repr__(self) -> str:
        c = getattr(self, "_c", None)
        arrays = "" if c is None else "".join(f" {n}={a.shape}" for n, a in c.arrays.items())
        state = "closed" if self.closed else "repeatable" if self._repeatable else "one-shot"
        return f"<{type(self).__name__}{arrays} {state}>"
