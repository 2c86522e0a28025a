"""Executors and the two phases of any aclnn operator.

:func:`build` runs the first phase (``<api>GetWorkspaceSize``) and returns an
:class:`ExecutorCore`; :func:`launch` runs the second (``<api>``) on a stream, holding what the
kernel uses on the stream's ledger until it has run. A one-shot executor is CANN's from its
launch on. :class:`Executor` is the public face of a core, for callers who drive the two
phases themselves.

Lock order: an executor's lock, then a stream's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _args, _lifetime
from .._cann import aclnn
from ..array import Allocation, DeviceArray
from ..device import Device, current_device
from ..errors import ClosedError, InvalidArgument
from ..release import cann_version
from ..stream import Stream, StreamState, check_written, resolve_stream
from ..tensor import AclTensor, TensorCore
from .spec import OpSpec

__all__ = ["Executor", "ExecutorCore", "build", "check_output_layout", "checked_workspace", "device_of", "execute",
           "launch", "mark_uses", "output_tracks"]


class ExecutorCore:
    """An aclOpExecutor and what it was built from. ``lock`` serializes its uses (a launch,
    setting addresses, making it repeatable); its handle is empty once a one-shot launch
    consumed it. The tensor cores stay alive as long as the executor does."""

    __slots__ = ("spec", "device", "handle", "token", "tensors", "workspace_size", "repeatable", "lock",
                 "__weakref__")

    def __init__(self, spec: OpSpec, device: Device, tensors: Mapping[str, TensorCore | None]) -> None:
        self.spec = spec
        self.device = device
        self.tensors = dict(tensors)
        self.workspace_size = 0
        self.repeatable = False
        self.lock = threading.Lock()
        self.handle = aclnn.ExecutorHandle()
        self.token = _lifetime.track(self, self.handle)

    def check_live(self) -> None:
        if not self.handle:
            raise ClosedError("executor", "it was destroyed, or a launch consumed it (one-shot executors run once)")
        self.device.check_open()

    def set_repeatable(self) -> None:
        with self.lock:
            self.check_live()
            self.device.activate()
            aclnn.set_repeatable(self.handle)
            self.repeatable = True

    def destroy(self) -> int:
        """aclDestroyAclOpExecutor now (after any launch in progress on another thread).
        Launches already queued are unaffected: a launch captures what it needs."""
        with self.lock:
            return _lifetime.release(self.token)

    def set_address(self, name: str, tensor: TensorCore, address: int) -> None:
        """Point the executor's tensor ``name`` at ``address`` (the storage base CANN keeps)."""
        kind, index = self.spec.slot(name)
        with self.lock:
            self.check_live()
            if kind == "input":
                aclnn.set_input_addr(self.handle, index, tensor.handle, address)
            else:
                aclnn.set_output_addr(self.handle, index, tensor.handle, address)


def build(spec: OpSpec, device: Device, tensors: Mapping[str, TensorCore | None],
          attrs: Mapping[str, Any]) -> ExecutorCore:
    """The first phase: ``<api>GetWorkspaceSize`` over ``tensors`` (None or absent: a null pointer) and
    ``attrs``, which the caller has checked for their C types."""
    device.activate()
    core = ExecutorCore(spec, device, tensors)
    args = [attrs[p.name] if p.kind == "attr" else (t.handle if (t := tensors.get(p.name)) is not None else None)
            for p in spec.params]
    core.workspace_size = aclnn.get_workspace_size(spec.api, args, core.handle)
    return core


def first_phase(spec: OpSpec, given: Mapping[str, AclTensor | DeviceArray | None], attrs: Mapping[str, Any],
                device: Device | None) -> tuple[int, Executor]:
    """An op's ``get_workspace_size`` on what the caller gave (AclTensors, DeviceArrays wrapped
    in aclTensors the executor keeps, or None for a null pointer): (workspace bytes,
    executor). The device is ``device``, else the first tensor's, else the current one."""
    owned: list[AclTensor] = []
    tensors: dict[str, AclTensor | None] = {}
    for name, value in given.items():
        if isinstance(value, DeviceArray):
            value = AclTensor(value)
            owned.append(value)
        elif value is not None and not isinstance(value, AclTensor):
            raise InvalidArgument(name, f"must be an AclTensor, a DeviceArray or None, got {type(value).__name__}")
        tensors[name] = value
    dev = device_of({n: t.array for n, t in tensors.items() if t is not None}, device)
    core = build(spec, dev, {n: (t.core(n) if t is not None else None) for n, t in tensors.items()}, attrs)
    return core.workspace_size, Executor(core, tuple(t for t in tensors.values() if t is not None))


def device_of(arrays: Mapping[str, DeviceArray], device: Device | None = None) -> Device:
    """The one device ``arrays`` are all on, and ``device`` when given; refused if they differ
    (CANN sees only addresses: the binding knows each array's device). With no array and no
    ``device``, the current device."""
    dev, first = device, ""
    for name, a in arrays.items():
        d = a.allocation(name).device
        if dev is None:
            dev, first = d, name
        elif d is not dev:
            where = f"{first} is on device {dev.device_id}" if first else f"device={dev.device_id} was asked for"
            raise InvalidArgument(name, f"is on device {d.device_id} but {where}: a launch's arrays share one device")
    return dev if dev is not None else current_device()


def check_output_layout(name: str, out: DeviceArray) -> None:
    """A strided output is refused where the loaded release's op writes its outputs densely
    from the view's address (up to 9.0: nnopbase checks the contiguity of inputs only, so the
    values would land in the wrong elements, silently), and accepted where it writes through
    the strides (9.1's l0op::ViewCopy)."""
    if out.is_contiguous:
        return
    applies = cann_version().behaviour
    if applies.behaviour.strided_out != "strides":
        raise InvalidArgument(name, f"must be contiguous: the op of CANN {applies.release or 'this release'} writes "
                                    "its outputs densely from the view's address (from 9.1 it writes through the "
                                    "strides)")


def checked_workspace(workspace: Any, size: int, device: Device, user: str) -> Allocation:
    """A caller's workspace: a DeviceArray of at least ``size`` bytes on ``device`` (where
    ``user``, the executor or the plan, is). Its allocation, to hold during the launch."""
    ws = _args.instance("workspace", workspace, DeviceArray, "a DeviceArray or None")
    alloc = ws.allocation("workspace")
    if ws.nbytes < size:
        raise InvalidArgument("workspace", f"holds {ws.nbytes} bytes, less than the {size} the launch needs")
    if not ws.is_contiguous:
        # The kernel uses its bytes as one block: a strided view's gaps belong to other views.
        raise InvalidArgument("workspace", "must be contiguous (the kernel uses it as one block of bytes)")
    if alloc.device is not device:
        raise InvalidArgument("workspace", f"is on device {alloc.device.device_id}, the {user} on {device.device_id}")
    return alloc


def launch(core: ExecutorCore, state: StreamState, workspace: int, size: int, hold: tuple[Any, ...],
           writes: Sequence[Any]) -> None:
    """The second phase on ``state``'s stream. ``hold`` is what the kernel reads and writes
    (allocations, the workspace), kept on the stream until the kernel has run; ``writes`` are
    the tracks of the outputs. The executor and its aclTensors are not held: a launch captures
    what it needs (CANN frees a one-shot executor as soon as it is launched)."""
    for name, t in core.tensors.items():
        if t is not None and t.alloc is not None and name not in core.spec.outputs:
            check_written(t.alloc.track, waiting=False)  # a faulted input would hand its garbage on
    with core.lock:
        core.check_live()
        consumes = not core.repeatable
        with state.lock:
            state.check_open()
            state.device.activate()
            state.ledger.hold(hold)
            aclnn.launch(core.spec.api, workspace, size, core.handle, state.handle, consumes)
            state.stamp(writes)
            done = state.ledger.after_enqueue()
    del done
    _lifetime.collect()


def _allocations(core: ExecutorCore) -> tuple[Allocation, ...]:
    return tuple(t.alloc for t in core.tensors.values() if t is not None and t.alloc is not None)


def output_tracks(core: ExecutorCore) -> tuple[tuple[Any, bool], ...]:
    """(Track, whole) of the memory the executor's outputs point at (StreamState.stamp)."""
    return tuple((t.alloc.track, t.whole) for n, t in core.tensors.items()
                 if t is not None and t.alloc is not None and n in core.spec.outputs)


def mark_uses(core: ExecutorCore, state: StreamState) -> None:
    """Record that work on ``state`` reads the inputs and writes the outputs."""
    for name, t in core.tensors.items():
        if t is not None and t.alloc is not None:
            t.alloc.used_on(state, write=name in core.spec.outputs)


class Executor(_lifetime.Owner):
    """An aclOpExecutor from the first phase.

    A one-shot executor is consumed by its launch (CANN frees it); call
    :meth:`set_repeatable` before launching to reuse it, and :meth:`close` to destroy it
    (aclDestroyAclOpExecutor, unless a launch consumed it). It keeps the aclTensors it was
    built from alive until it is consumed or closed.
    """

    __slots__ = ("_core", "_tensors", "__weakref__")
    RELEASE_API = "aclDestroyAclOpExecutor"

    def __init__(self, core: ExecutorCore, tensors: tuple[AclTensor, ...]) -> None:
        self._core: ExecutorCore | None = core
        self._tensors = tensors

    def core(self) -> ExecutorCore:
        """The executor's owner, checked live (for pyacl_moe's own layers)."""
        c = self._core
        if c is None:
            raise ClosedError("executor", "it was closed")
        c.check_live()
        return c

    @property
    def handle(self) -> int:
        """The aclOpExecutor* as an integer (0 once consumed or closed)."""
        c = self._core
        return c.handle.address if c is not None else 0

    @property
    def workspace_size(self) -> int:
        """Bytes of workspace the second phase needs."""
        c = self._core
        return c.workspace_size if c is not None else 0

    @property
    def repeatable(self) -> bool:
        """True once aclSetAclOpExecutorRepeatable was called."""
        c = self._core
        return c is not None and c.repeatable

    @property
    def closed(self) -> bool:
        """True once consumed by a one-shot launch or closed."""
        c = self._core
        return c is None or not c.handle

    @property
    def device(self) -> Device | None:
        """The device it was built on (None once closed)."""
        c = self._core
        return c.device if c is not None else None

    @property
    def tensors(self) -> tuple[AclTensor, ...]:
        """The aclTensors it was built from, in the operator's parameter order."""
        return self._tensors

    def set_repeatable(self) -> Executor:
        """aclSetAclOpExecutorRepeatable: keep the executor after a launch."""
        self.core().set_repeatable()
        return self

    def _set_address(self, kind: str, index: Any, tensor: AclTensor, address: Any) -> None:
        core = self.core()
        names = core.spec.inputs if kind == "input" else core.spec.outputs
        i = _args.integer("index", index, 0, len(names) - 1)
        if core.tensors.get(names[i]) is None:
            raise InvalidArgument("index", f"{kind} {i} ({names[i]}) was passed as a null pointer to the first "
                                           "phase: it has no address to set")
        t = _args.instance("tensor", tensor, AclTensor, "an AclTensor")
        addr = _args.integer("address", address, 0, 2**64 - 1)
        core.set_address(names[i], t.core(), addr)

    def set_input_addr(self, index: int, tensor: AclTensor, address: int) -> None:
        """aclSetInputTensorAddr: the storage base of input ``index`` (the operator's order)."""
        self._set_address("input", index, tensor, address)

    def set_output_addr(self, index: int, tensor: AclTensor, address: int) -> None:
        """aclSetOutputTensorAddr: the storage base of output ``index`` (the operator's order,
        an optional output passed as a null pointer included: it keeps its index, and has no
        address to set)."""
        self._set_address("output", index, tensor, address)

    def _dropped(self) -> None:
        self._tensors = ()

    def __repr__(self) -> str:
        c = self._core
        state = "closed" if self.closed else ("repeatable" if c is not None and c.repeatable else "one-shot")
        return f"<Executor {self.handle:#x} {state} workspace={self.workspace_size}>"


def execute(workspace: DeviceArray | int | None, workspace_size: Any, executor: Executor,
            stream: Stream | None = None) -> None:
    """Phase two, as CANN has it: queue the kernel on ``stream`` (default stream if None) and
    return. A one-shot executor is consumed by the launch.

    Refused on the host, since CANN would return without recycling a one-shot executor: a
    workspace_size below the executor's, and a missing (or too small) workspace for a
    non-zero size."""
    ex = _args.instance("executor", executor, Executor, "an Executor")
    core = ex.core()
    size = _args.uint64("workspace_size", workspace_size)
    if size < core.workspace_size:
        raise InvalidArgument("workspace_size",
                              f"must be at least the executor's {core.workspace_size} bytes, got {size}")
    ws_alloc: Allocation | None = None
    if isinstance(workspace, DeviceArray):
        ws_alloc = checked_workspace(workspace, size, core.device, "executor")
        ws = workspace.address
    elif workspace is None:
        ws = 0
    else:
        ws = _args.integer("workspace", workspace, 0, 2**64 - 1)
    if size and not ws:
        raise InvalidArgument("workspace", f"is missing but workspace_size is {size}: pass device memory of that size")
    state = resolve_stream(stream, core.device)
    mark_uses(core, state)
    launch(core, state, ws, size, (ws_alloc, *_allocations(core)), output_tracks(core))
