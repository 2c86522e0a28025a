"""Executors and the two phases of any aclnn operator.

:func:`build` runs the first phase (``<api>GetWorkspaceSize``) and returns an
:class:`ExecutorCore`; :func:`launch` runs the second (``<api>``) on a stream, holding what the
kernel uses there until it has run. A one-shot executor is CANN's from its launch on.
:class:`Executor` is the public face of a core, for callers who drive the two phases
themselves. An executor is destroyed once nothing holds its core (its Executor, a plan, a
stream's cache); launches already queued captured what they need.

Lock order: an executor's lock, then a stream's lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import _args, _contract
from .._cann import aclnn
from ..array import DeviceArray
from ..device import EXECUTORS, Allocation, Device, Holder, Owner, calling, collect, current_device, resolve_device
from ..errors import ClosedError, InvalidArgument
from ..release import cann_version
from ..stream import Stream, StreamState, resolve_stream
from ..tensor import AclTensor, TensorCore
from .spec import OpSpec

__all__ = ["Executor", "ExecutorCore", "build", "check_output_layout", "checked_workspace", "device_of", "execute",
           "first_phase", "fits", "launch"]


class ExecutorCore:
    """An aclOpExecutor and what it was built from: what an Executor, a plan or a stream's
    cache holds. Its holder's lock serializes the uses of the handle (a launch, setting
    addresses, making it repeatable, the release); the handle is empty once a one-shot launch
    consumed it. The tensor cores stay alive as long as the executor does."""

    __slots__ = ("spec", "device", "holder", "tensors", "workspace_size", "repeatable", "__weakref__")

    def __init__(self, spec: OpSpec, device: Device, tensors: Mapping[str, TensorCore]) -> None:
        self.spec, self.device, self.tensors = spec, device, dict(tensors)
        self.workspace_size, self.repeatable = 0, False
        self.holder = Holder(aclnn.ExecutorHandle(), EXECUTORS)
        device.own(self.holder, self)

    @property
    def handle(self) -> aclnn.ExecutorHandle:
        return self.holder.handle  # type: ignore[return-value]

    def check_live(self) -> None:
        if not self.holder.handle:
            raise ClosedError("executor", "it was destroyed, or a launch consumed it (one-shot executors run once)")
        self.device.check_open()

    def set_repeatable(self) -> None:
        with self.holder.lock:
            self.check_live()
            aclnn.set_repeatable(self.handle)
            self.repeatable = True

    def destroy(self) -> int:
        """aclDestroyAclOpExecutor now (after a launch in progress on another thread); the
        status. Launches already queued are unaffected."""
        return self.device.release(self.holder)

    def set_address(self, kind: str, index: int, tensor: TensorCore, address: int) -> None:
        """Point the executor's ``kind`` ("input" or "output") tensor ``index`` at ``address``
        (the storage base CANN keeps)."""
        setter = aclnn.set_input_addr if kind == "input" else aclnn.set_output_addr
        with self.holder.lock:
            self.check_live()
            setter(self.handle, index, tensor.handle, address)


def build(spec: OpSpec, device: Device, tensors: Mapping[str, TensorCore], attrs: Mapping[str, Any]) -> ExecutorCore:
    """The first phase: ``<api>GetWorkspaceSize`` over ``tensors`` (absent: a null pointer)
    and ``attrs``, which the caller has checked for their C types."""
    device.activate()
    core = ExecutorCore(spec, device, tensors)
    args = [attrs[p.name] if p.kind == "attr" else (t.handle if (t := tensors.get(p.name)) is not None else None)
            for p in spec.params]
    with calling(device, device.context):
        core.workspace_size = aclnn.get_workspace_size(spec.api, args, core.handle)
    return core


def first_phase(spec: OpSpec, args: Sequence[Any], device: Device | int | None) -> tuple[int, Executor]:
    """An op's ``get_workspace_size`` on what the caller gave: the first phase's arguments in C
    order (``spec.params``), its tensors AclTensors, DeviceArrays wrapped in aclTensors the
    executor keeps, or None for a null pointer, its attributes' values checked for their C
    types; (workspace bytes, executor). The device is ``device``, else the first tensor's,
    else the current one."""
    attrs = spec.attr_values(*(a for p, a in zip(spec.params, args) if p.kind == "attr"))
    asked = resolve_device(device) if device is not None else None
    tensors: dict[str, AclTensor] = {}  # (a null pointer: absent)
    for p, value in zip(spec.params, args):
        if value is not None and p.kind != "attr":
            value = AclTensor(value) if isinstance(value, DeviceArray) else value
            tensors[p.name] = _args.instance(p.name, value, AclTensor, "an AclTensor, a DeviceArray or None")
    dev = device_of({n: t.array for n, t in tensors.items()}, asked)
    collect()
    core = build(spec, dev, {n: t.core(n) for n, t in tensors.items()}, attrs)
    return core.workspace_size, Executor(core, tuple(tensors.values()))


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
    if not out.is_contiguous and (applies := cann_version().behaviour).behaviour.strided_out != "strides":
        raise InvalidArgument(name, f"must be contiguous: the op of CANN {applies.release or 'this release'} writes "
                                    "its outputs densely from the view's address (from 9.1 it writes through the "
                                    "strides)")


def fits(name: str, want: tuple[tuple[int, ...], np.dtype] | None, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """A given output must be what the contract says the inputs make."""
    if want is None:
        raise InvalidArgument(name, "is not written in this scenario: pass None")
    if shape != want[0] or dtype != want[1]:
        raise InvalidArgument(name, f"must have shape {want[0]} and dtype {_contract.dtype_name(want[1])} (what the "
                                    f"inputs make), got shape {shape} and dtype {_contract.dtype_name(dtype)}")


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


def launch(core: ExecutorCore, state: StreamState, workspace: int, size: int, hold: Any,
           outputs: Sequence[Allocation | None]) -> None:
    """The second phase on ``state``'s stream, keeping ``hold`` (what the kernel reads and
    writes, the workspace) there until the kernel has run; ``outputs`` are what it writes."""
    state.device.check()
    with core.holder.lock:
        core.check_live()
        state.enqueue(hold, [(aclnn.launch, (core.spec.api, workspace, size, core.handle, not core.repeatable))],
                      outputs)


class Executor(Owner):
    """An aclOpExecutor from the first phase.

    A one-shot executor is consumed by its launch (CANN frees it); call
    :meth:`set_repeatable` before launching to reuse it, and :meth:`close` to destroy it
    (aclDestroyAclOpExecutor, unless a launch consumed it or a plan still uses it). It keeps
    the aclTensors it was built from alive until it is consumed or closed.
    """

    __slots__ = ("_core", "_tensors", "__weakref__")

    def __init__(self, core: ExecutorCore, tensors: tuple[AclTensor, ...]) -> None:
        self._core: ExecutorCore | None = core
        self._tensors = tensors

    def core(self) -> ExecutorCore:
        """The executor's core, checked live (for pyacl_moe's own layers)."""
        c = self._core
        if c is None:
            raise ClosedError("executor", "it was closed")
        c.check_live()
        return c

    @property
    def workspace_size(self) -> int:
        """Bytes of workspace the second phase needs."""
        return self._of("workspace_size", 0)  # type: ignore[no-any-return]

    @property
    def repeatable(self) -> bool:
        """True once aclSetAclOpExecutorRepeatable was called."""
        return self._of("repeatable", False)  # type: ignore[no-any-return]

    @property
    def closed(self) -> bool:
        """True once consumed by a one-shot launch or closed."""
        return not self._of("handle", None)

    @property
    def device(self) -> Device | None:
        """The device it was built on (None once closed)."""
        return self._of("device", None)  # type: ignore[no-any-return]

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
        core.set_address(kind, i, t.core(), _args.integer("address", address, 0, 2**64 - 1))

    def set_input_addr(self, index: int, tensor: AclTensor, address: int) -> None:
        """aclSetInputTensorAddr: the storage base of input ``index`` (the operator's order)."""
        self._set_address("input", index, tensor, address)

    def set_output_addr(self, index: int, tensor: AclTensor, address: int) -> None:
        """aclSetOutputTensorAddr: the storage base of output ``index`` (the operator's order,
        an optional output passed as a null pointer included: it keeps its index, and has no
        address to set)."""
        self._set_address("output", index, tensor, address)

    def close(self) -> None:
        """Destroy the executor, at once unless a plan still uses it (then when it lets go);
        CANN's refusal is raised (the device tries again later). Safe twice."""
        self._tensors = ()
        super().close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("repeatable" if self.repeatable else "one-shot")
        return f"<Executor {self.handle:#x} {state} workspace={self.workspace_size}>"


def execute(workspace: DeviceArray | int | None, workspace_size: Any, executor: Executor,
            stream: Stream | None = None) -> None:
    """Phase two, as CANN has it: queue the kernel on ``stream`` (default stream if None) and
    return. A one-shot executor is consumed by the launch.

    Refused on the host, since CANN would return without recycling a one-shot executor: a
    workspace_size below the executor's, and a missing (or too small) workspace for a
    non-zero size."""
    core = _args.instance("executor", executor, Executor, "an Executor").core()
    size = _args.uint64("workspace_size", workspace_size)
    if size < core.workspace_size:
        raise InvalidArgument("workspace_size",
                              f"must be at least the executor's {core.workspace_size} bytes, got {size}")
    ws_alloc: Allocation | None = None
    if isinstance(workspace, DeviceArray):  # (its address: a checked int)
        ws_alloc, workspace = checked_workspace(workspace, size, core.device, "executor"), workspace.address
    ws = 0 if workspace is None else _args.integer("workspace", workspace, 0, 2**64 - 1)
    if size and not ws:
        raise InvalidArgument("workspace", f"is missing but workspace_size is {size}: pass device memory of that size")
    allocs = tuple(t.alloc for t in core.tensors.values())
    launch(core, resolve_stream(stream, core.device), ws, size, (ws_alloc, allocs),
           [t.alloc for n, t in core.tensors.items() if n in core.spec.outputs])
