"""aclnnMoeInitRoutingV2Grad: the two phases as they are, and the one-call function.

Low level, for callers who manage everything::

    size, executor = get_workspace_size(x_t, idx_t, top_k, drop_pad_mode, active_num, out_t)
    execute(workspace, size, executor, stream)

High level: :func:`moe_init_routing_v2_grad` takes NumPy arrays (copy in, run, synchronize,
copy out) or DeviceArrays (queued on a stream, returns at once).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _ffi, _validate
from .errors import InvalidArgument
from .memory import DeviceArray, _host_array, empty, to_device
from .runtime import Device, Stream, current_device
from .tensor import AclTensor

__all__ = ["Executor", "execute", "get_workspace_size", "moe_init_routing_v2_grad"]


class Executor:
    """An aclOpExecutor from the first phase.

    A one-shot executor is consumed (and freed by CANN) by its launch; call
    :meth:`set_repeatable` before launching to reuse it, and :meth:`close` to destroy it.
    It keeps the aclTensors it was built from alive until it is consumed or closed.
    """

    __slots__ = ("_h", "_workspace_size", "_device", "_tensors", "_owned", "_repeatable", "__weakref__")

    def __init__(self, handle: Any, workspace_size: int, device: Device,
                 tensors: tuple[AclTensor, ...], owned: tuple[AclTensor, ...]) -> None:
        self._h = handle
        self._workspace_size = workspace_size
        self._device = device
        self._tensors = tensors
        self._owned = owned
        self._repeatable = False

    @property
    def handle(self) -> int:
        """The aclOpExecutor* as an integer (0 once consumed or closed)."""
        return _ffi.address(self._h) if self._h is not None else 0

    @property
    def workspace_size(self) -> int:
        return self._workspace_size

    @property
    def repeatable(self) -> bool:
        return self._repeatable

    @property
    def closed(self) -> bool:
        """True once consumed by a one-shot launch or destroyed."""
        return self._h is None

    @property
    def tensors(self) -> tuple[AclTensor, ...]:
        """The aclTensors it was built from: grad_expanded_x, expanded_row_idx, out."""
        return self._tensors

    def _use(self) -> Any:
        if self._h is None:
            raise InvalidArgument(
                "executor", "is closed: it was destroyed, or a launch consumed it (one-shot executors run once)"
            )
        return self._h

    def set_repeatable(self) -> Executor:
        """aclSetAclOpExecutorRepeatable: keep the executor after a launch."""
        self._device._activate()
        _ffi.executor_set_repeatable(self._use())
        self._repeatable = True
        return self

    def set_input_addr(self, index: int, tensor: AclTensor, address: int) -> None:
        """aclSetInputTensorAddr (0: grad_expanded_x, 1: expanded_row_idx)."""
        _ffi.executor_set_input_addr(self._use(), index, tensor._use(), address)

    def set_output_addr(self, index: int, tensor: AclTensor, address: int) -> None:
        """aclSetOutputTensorAddr (0: out)."""
        _ffi.executor_set_output_addr(self._use(), index, tensor._use(), address)

    def _consumed(self) -> None:
        """A one-shot launch took the executor: CANN freed it."""
        self._h = None
        self._release_tensors()

    def _release_tensors(self) -> None:
        owned, self._owned, self._tensors = self._owned, (), ()
        for t in owned:
            t.close()

    def close(self) -> None:
        """aclDestroyAclOpExecutor (unless a launch already consumed it). Safe twice."""
        h, self._h = self._h, None
        try:
            if h is not None:
                _ffi.executor_destroy(h)
        finally:
            self._release_tensors()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._h is None else ("repeatable" if self._repeatable else "one-shot")
        return f"<Executor {self.handle:#x} {state} workspace={self._workspace_size}>"


def _as_tensor(value: Any, name: str, owned: list[AclTensor]) -> AclTensor | None:
    if value is None or isinstance(value, AclTensor):
        return value
    if isinstance(value, DeviceArray):
        t = AclTensor(value)
        owned.append(t)
        return t
    raise InvalidArgument(name, f"must be an AclTensor, a DeviceArray or None, got {type(value).__name__}")


def get_workspace_size(
    grad_expanded_x: AclTensor | DeviceArray | None,
    expanded_row_idx: AclTensor | DeviceArray | None,
    top_k: int,
    drop_pad_mode: int = 0,
    active_num: int = 0,
    out: AclTensor | DeviceArray | None = None,
    device: Device | None = None,
) -> tuple[int, Executor]:
    """Phase one, as CANN has it: (workspace bytes, executor).

    Nothing is checked on the host: the vendor validates (None passes a null pointer).
    DeviceArrays are wrapped in aclTensors the executor owns.
    """
    owned: list[AclTensor] = []
    try:
        tx = _as_tensor(grad_expanded_x, "grad_expanded_x", owned)
        ti = _as_tensor(expanded_row_idx, "expanded_row_idx", owned)
        to = _as_tensor(out, "out", owned)
        dev = device
        for t in (tx, ti, to):
            if dev is None and t is not None:
                dev = t.array.device
        dev = dev or current_device()
        dev._activate()
        size, h = _ffi.moe_get_workspace_size(
            tx._use() if tx else None, ti._use() if ti else None,
            int(top_k), int(drop_pad_mode), int(active_num), to._use() if to else None,
        )
    except BaseException:
        for t in owned:
            t.close()
        raise
    tensors = tuple(t for t in (tx, ti, to) if t is not None)
    return size, Executor(h, size, dev, tensors, tuple(owned))


def execute(
    workspace: DeviceArray | int | None,
    workspace_size: int,
    executor: Executor,
    stream: Stream | None = None,
) -> None:
    """Phase two, as CANN has it: queue the kernel on ``stream`` (default stream if None)
    and return. A one-shot executor is consumed by a successful launch."""
    if not isinstance(executor, Executor):
        raise InvalidArgument("executor", f"must be an Executor, got {type(executor).__name__}")
    s = stream if stream is not None else executor._device.default_stream
    h = s._use()
    if isinstance(workspace, DeviceArray):
        ws = workspace.address
    elif workspace is None:
        ws = 0
    else:
        ws = int(workspace)
    _ffi.moe_execute(ws, int(workspace_size), executor._use(), h)
    # The kernel reads these when the stream runs it: keep them until then.
    s._keep(workspace, *executor._tensors)
    for t in executor._tensors[2:]:
        t.array._live_alloc().last_stream = s
    if not executor._repeatable:
        executor._consumed()


# ---------------------------------------------------------------------------- one call

def _check_device_arrays(arrays: dict[str, DeviceArray]) -> Device:
    dev: Device | None = None
    first = ""
    for name, a in arrays.items():
        d = a.device
        if dev is None:
            dev, first = d, name
        elif d is not dev:
            raise InvalidArgument(
                name, f"is on device {d.device_id} but {first} is on device {dev.device_id}: all must share one device"
            )
    assert dev is not None
    return dev


def moe_init_routing_v2_grad(
    grad_expanded_x: Any,
    expanded_row_idx: Any,
    top_k: int,
    drop_pad_mode: int = 0,
    active_num: int = 0,
    *,
    out: Any = None,
    stream: Stream | None = None,
    workspace: DeviceArray | None = None,
    validate: bool = True,
) -> Any:
    """The backward of MoE token routing: ``out[i] = sum_t grad_expanded_x[expanded_row_idx[i*top_k+t]]``.

    grad_expanded_x: [N*top_k, H] (dropless), [A, H] (active, A = active_num) or [E, C, H]
        (drop/pad), float16, bfloat16 (ml_dtypes) or float32.
    expanded_row_idx: [N*top_k] int32.
    top_k, drop_pad_mode (0 or 1), active_num (>= 0): the op's attributes.
    out: optional output [N, H], same dtype as grad_expanded_x, contiguous.
    stream: where to run (default: the device's default stream).
    workspace: a DeviceArray of at least the op's workspace size (allocated if None).
    validate: check the contract on the host first (index values too when the indices are a
        NumPy array) and raise InvalidArgument; False hands everything to CANN untouched.

    NumPy in: copies in, runs, synchronizes, returns a NumPy array. DeviceArray in: returns a
    DeviceArray at once, the kernel queued on the stream.
    """
    on_device = isinstance(grad_expanded_x, DeviceArray)
    if on_device != isinstance(expanded_row_idx, DeviceArray):
        raise InvalidArgument(
            "expanded_row_idx",
            "must be a DeviceArray when grad_expanded_x is one, and a host array otherwise",
        )
    if on_device:
        return _run_device(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num,
                           out, stream, workspace, validate)
    return _run_host(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num,
                     out, stream, workspace, validate)


def _run_device(x: DeviceArray, idx: DeviceArray, top_k: Any, mode: Any, active: Any,
                out: DeviceArray | None, stream: Stream | None, workspace: DeviceArray | None,
                validate: bool) -> DeviceArray:
    arrays = {"grad_expanded_x": x, "expanded_row_idx": idx}
    if out is not None:
        if not isinstance(out, DeviceArray):
            raise InvalidArgument("out", f"must be a DeviceArray when the inputs are, got {type(out).__name__}")
        arrays["out"] = out
    if workspace is not None:
        if not isinstance(workspace, DeviceArray):
            raise InvalidArgument("workspace", f"must be a DeviceArray, got {type(workspace).__name__}")
        arrays["workspace"] = workspace
    dev = _check_device_arrays(arrays)
    if stream is not None:
        if not isinstance(stream, Stream):
            raise InvalidArgument("stream", f"must be a Stream, got {type(stream).__name__}")
        if stream.closed:
            raise InvalidArgument("stream", "is closed")
        if stream.device is not dev:
            raise InvalidArgument("stream", f"is on device {stream.device.device_id}, the arrays on {dev.device_id}")
    if validate:
        geo = _validate.check_shapes(
            x.shape, x.dtype, idx.shape, idx.dtype, top_k, mode, active,
            None if out is None else out.shape, None if out is None else out.dtype,
        )
        if out is not None and not out.is_contiguous:
            raise InvalidArgument("out", "must be contiguous (the op writes its output densely)")
        n, h = geo.tokens, geo.hidden
    else:
        n = idx.shape[0] // int(top_k) if idx.ndim and int(top_k) > 0 else 0
        h = x.shape[-1] if x.ndim else 0
    if out is None:
        out = empty((n, h), x.dtype, dev)
    s = stream if stream is not None else dev.default_stream
    size, executor = get_workspace_size(x, idx, top_k, mode, active, out, device=dev)
    try:
        if workspace is not None:
            if validate and workspace.nbytes < size:
                raise InvalidArgument("workspace", f"must hold at least {size} bytes, got {workspace.nbytes}")
            ws: DeviceArray | None = workspace
        else:
            ws = empty((size,), np.uint8, dev) if size else None
        execute(ws, size, executor, s)
    finally:
        executor.close()
    return out


def _run_host(x: Any, idx: Any, top_k: Any, mode: Any, active: Any, out: Any,
              stream: Stream | None, workspace: DeviceArray | None, validate: bool) -> np.ndarray:
    hx, hi = np.asarray(x), np.asarray(idx)
    if out is not None and not isinstance(out, np.ndarray):
        raise InvalidArgument("out", f"must be a NumPy array when the inputs are, got {type(out).__name__}")
    if validate:
        geo = _validate.check_shapes(
            hx.shape, hx.dtype, hi.shape, hi.dtype, top_k, mode, active,
            None if out is None else out.shape, None if out is None else out.dtype,
        )
        if out is not None and not out.flags.writeable:
            raise InvalidArgument("out", "must be writable")
        _validate.check_indices(hi, geo, int(top_k), int(active))
    for name, a in (("grad_expanded_x", hx), ("expanded_row_idx", hi)):
        if a.dtype == object:
            raise InvalidArgument(name, "dtype object cannot go to the device")
    dev = stream.device if stream is not None else current_device()
    s = stream if stream is not None else dev.default_stream
    dx = to_device(_host_array(hx, "grad_expanded_x"), stream=s)
    try:
        di = to_device(_host_array(hi, "expanded_row_idx"), stream=s)
        try:
            dout = _run_device(dx, di, top_k, mode, active, None, s, workspace, False)
            try:
                result = dout.to_host(s)
            finally:
                dout.close()
        finally:
            di.close()
    finally:
        dx.close()
    if out is not None:
        out[...] = result
        return out
    return result
