"""aclnnMoeInitRoutingV2Grad: the two phases as they are, and the one-call function.

Low level, for callers who manage everything::

    size, executor = get_workspace_size(x_t, idx_t, top_k, drop_pad_mode, active_num, out_t)
    execute(workspace, size, executor, stream)

High level: :func:`moe_init_routing_v2_grad` takes NumPy arrays (copy in, run, synchronize,
copy out) or DeviceArrays (queued on a stream, returns at once).
"""

from __future__ import annotations

import operator
import threading
from typing import Any

import numpy as np

from . import _ffi, _validate
from .errors import InvalidArgument
from .memory import DeviceArray, _empty_pools, _host_array, _pin, _pool, empty, to_device
from .runtime import Device, Stream, _tls, current_device
from .tensor import AclTensor

__all__ = [
    "Executor",
    "MoeInitRoutingV2Grad",
    "empty_cache",
    "execute",
    "get_workspace_size",
    "moe_init_routing_v2_grad",
]


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
        # operator.index: ints pass (NumPy's too), a float is a TypeError, never truncated.
        size, h = _ffi.moe_get_workspace_size(
            tx._use() if tx else None, ti._use() if ti else None,
            operator.index(top_k), operator.index(drop_pad_mode), operator.index(active_num),
            to._use() if to else None,
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
    s._keep(_pin(workspace) if isinstance(workspace, DeviceArray) else None,
            *(_pin(t.array) for t in executor._tensors))
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


def _arg_checks(x: DeviceArray, idx: DeviceArray, out: DeviceArray | None, stream: Stream | None,
                workspace: DeviceArray | None) -> Device:
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
    return dev


# Validated layouts: the contract's checks depend only on shapes, dtypes, strides and the
# attributes, so a layout that passed once passes again. Keys carry the attributes' types, so
# True never stands for 1.
_validated: dict[tuple[Any, ...], _validate.Geometry] = {}
_VALIDATED_MAX = 256


def _check_layout(key: tuple[Any, ...], x: DeviceArray, idx: DeviceArray, top_k: Any, mode: Any, active: Any,
                  out: DeviceArray | None) -> _validate.Geometry:
    geo = _validated.get(key)
    if geo is None:
        geo = _validate.check_shapes(
            x.shape, x.dtype, idx.shape, idx.dtype, top_k, mode, active,
            None if out is None else out.shape, None if out is None else out.dtype,
        )
        if out is not None and not out.is_contiguous:
            raise InvalidArgument("out", "must be contiguous (the op writes its output densely)")
        if len(_validated) >= _VALIDATED_MAX:
            _validated.clear()
        _validated[key] = geo
    return geo


def _fast_device(x: DeviceArray, idx: DeviceArray, out: DeviceArray | None, stream: Stream | None) -> Device | None:
    """The common case's checks, without building anything: all arrays live on one device,
    the stream (if any) open on it. None: fall back to the thorough checks (and their errors)."""
    xa, ia = x._alloc, idx._alloc
    if xa is None or ia is None or not xa.alive or not ia.alive:
        return None
    dev = xa.device
    if ia.device is not dev:
        return None
    if out is not None:
        oa = out._alloc
        if oa is None or not oa.alive or oa.device is not dev:
            return None
    if stream is not None and (stream._closed or stream._device is not dev or dev._closed):
        return None
    return dev


def _run_device(x: DeviceArray, idx: DeviceArray, top_k: Any, mode: Any, active: Any,
                out: DeviceArray | None, stream: Stream | None, workspace: DeviceArray | None,
                validate: bool) -> DeviceArray:
    dev = None
    if workspace is None and (out is None or type(out) is DeviceArray) and type(stream) in (Stream, type(None)):
        dev = _fast_device(x, idx, out, stream)
    if dev is None:
        dev = _arg_checks(x, idx, out, stream, workspace)
    s = stream if stream is not None else dev.default_stream
    if validate:
        key = (dev, x._shape, x._dtype, x._strides, idx._shape, idx._dtype, idx._strides,
               type(top_k), top_k, type(mode), mode, type(active), active,
               None if out is None else (out._shape, out._dtype, out._strides))
        geo = _check_layout(key[1:], x, idx, top_k, mode, active, out)
        if out is None:
            out = empty((geo.tokens, geo.hidden), x.dtype, dev)
            key = (*key[:-1], (out._shape, out._dtype, out._strides))
        # A layout seen before relaunches its cached executor with the new addresses.
        _plans.launch(dev, key, x, idx, top_k, mode, active, out, s, workspace)
        return out
    n = idx.shape[0] // int(top_k) if idx.ndim and int(top_k) > 0 else 0
    h = x.shape[-1] if x.ndim else 0
    if out is None:
        out = empty((n, h), x.dtype, dev)
    size, executor = get_workspace_size(x, idx, top_k, mode, active, out, device=dev)
    try:
        if workspace is not None:
            execute(workspace, size, executor, s)
        elif size:
            pool = _pool(dev)
            block = pool.acquire(size, s)
            try:
                execute(block.address, size, executor, s)
            finally:
                pool.release(block, s)  # stream-ordered: later work on s may reuse it at once
        else:
            execute(None, 0, executor, s)
    finally:
        executor.close()
    return out


class _CachedPlan:
    """A repeatable executor for one layout, rebound to each call's arrays. It holds raw
    aclTensor handles, not the arrays, so it never keeps a caller's memory alive."""

    __slots__ = ("device", "executor", "tensors", "offsets", "itemsizes", "bound", "size", "lock", "pool")

    def __init__(self, dev: Device, x: DeviceArray, idx: DeviceArray, top_k: int, mode: int, active: int,
                 out: DeviceArray) -> None:
        self.device = dev
        self.tensors: list[Any] = []
        self.executor = None
        arrays = (x, idx, out)
        try:
            for a in arrays:
                self.tensors.append(_ffi.create_tensor_from_desc(a._tensor_desc(), a.data_ptr))
            dev._activate()
            self.size, self.executor = _ffi.moe_get_workspace_size(*self.tensors[:2], int(top_k), int(mode),
                                                                   int(active), self.tensors[2])
            _ffi.executor_set_repeatable(self.executor)
        except BaseException:
            self.destroy()
            raise
        self.offsets = tuple(a._offset for a in arrays)
        self.itemsizes = tuple(a._dtype.itemsize for a in arrays)
        self.bound = [a.address for a in arrays]
        self.lock = threading.Lock()
        self.pool = _pool(dev)

    def _rebind(self, slot: int, a: DeviceArray) -> None:
        alloc = a._alloc
        if alloc is None or not alloc.alive:
            a._live_alloc()  # raises the right error
        item = self.itemsizes[slot]
        addr = alloc.ptr + a._offset * item  # type: ignore[union-attr]
        if addr != self.bound[slot]:
            base = addr - self.offsets[slot] * item
            if slot < 2:
                _ffi.executor_set_input_addr(self.executor, slot, self.tensors[slot], base)
            else:
                _ffi.executor_set_output_addr(self.executor, 0, self.tensors[2], base)
            self.bound[slot] = addr

    def launch(self, x: DeviceArray, idx: DeviceArray, out: DeviceArray, s: Stream,
               workspace: DeviceArray | None) -> None:
        dev = self.device
        if getattr(_tls, "device", None) is not dev:
            dev._activate()
        h = s._h
        with self.lock:
            self._rebind(0, x)
            self._rebind(1, idx)
            self._rebind(2, out)
            if workspace is not None:
                if workspace.nbytes < self.size:
                    raise InvalidArgument("workspace", f"must hold at least {self.size} bytes, got {workspace.nbytes}")
                _ffi.moe_execute(workspace.address, self.size, self.executor, h)
            elif self.size:
                pool = self.pool
                block = pool.acquire(self.size, s)
                try:
                    _ffi.moe_execute(block.alloc.ptr, self.size, self.executor, h)
                finally:
                    pool.release(block, s)
            else:
                _ffi.moe_execute(0, 0, self.executor, h)
        # The kernel reads these when the stream runs it.
        s._keep(x._alloc, idx._alloc, out._alloc, _pin(workspace))
        out._alloc.last_stream = s  # type: ignore[union-attr]

    def destroy(self) -> None:
        ex, self.executor = self.executor, None
        tensors, self.tensors = self.tensors, []
        try:
            if ex is not None:
                _ffi.executor_destroy(ex)
        finally:
            for t in tensors:
                _ffi.destroy_tensor(t)


class _PlanCache:
    """The high-level function's cache of executors, keyed by device, layout and attributes.
    Lookups take no lock (a dict read is atomic); inserting evicts the oldest entries."""

    SIZE = 8

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[tuple[Any, ...], _CachedPlan] = {}

    def launch(self, dev: Device, key: tuple[Any, ...], x: DeviceArray, idx: DeviceArray, top_k: Any, mode: Any,
               active: Any, out: DeviceArray, s: Stream, workspace: DeviceArray | None) -> None:
        plan = self.entries.get(key)
        if plan is None:
            plan = _CachedPlan(dev, x, idx, top_k, mode, active, out)
            evicted = []
            with self.lock:
                if key in self.entries:  # another thread built it meanwhile
                    evicted.append(plan)
                    plan = self.entries[key]
                else:
                    self.entries[key] = plan
                    while len(self.entries) > self.SIZE:
                        evicted.append(self.entries.pop(next(iter(self.entries))))
            for p in evicted:
                with p.lock:
                    p.destroy()
        plan.launch(x, idx, out, s, workspace)

    def clear(self, device: Device | None = None) -> None:
        with self.lock:
            doomed = [k for k, p in self.entries.items() if device is None or p.device is device]
            plans = [self.entries.pop(k) for k in doomed]
        for p in plans:
            with p.lock:
                try:
                    p.destroy()
                except Exception:
                    pass


_plans = _PlanCache()
Device._close_hooks.append(_plans.clear)  # cached executors go before their device


def empty_cache(device: Device | int | None = None) -> None:
    """Release what is cached for speed: the high-level function's executors and the
    workspace pool's idle blocks (all devices if ``device`` is None). Waits for the device(s)
    first, since pooled blocks may still be in use by queued kernels."""
    dev = None if device is None else (device if isinstance(device, Device) else Device(device))
    _plans.clear(dev)
    _empty_pools(dev)


def _run_host(x: Any, idx: Any, top_k: Any, mode: Any, active: Any, out: Any,
              stream: Stream | None, workspace: DeviceArray | None, validate: bool) -> np.ndarray:
    hx, hi = _validate.native(np.asarray(x)), _validate.native(np.asarray(idx))
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
            # The indices were checked above; the layout check below is a memo lookup.
            dout = _run_device(dx, di, top_k, mode, active, None, s, workspace, validate)
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


# ---------------------------------------------------------------------------- prepared plans

def _layout(a: DeviceArray) -> tuple[Any, ...]:
    return (a.shape, a.dtype, a.strides)


# id(plan) -> the allocations its launches read (see MoeInitRoutingV2Grad._pin_arrays).
_plan_arrays: dict[int, tuple[Any, ...]] = {}


class MoeInitRoutingV2Grad:
    """A prepared launch of the op on fixed DeviceArrays: the first phase runs once, and each
    call relaunches the same (repeatable) executor.

    ``plan(stream=None, workspace=None)`` queues the kernel and returns ``out``;
    ``plan.rebind(...)`` points it at other arrays of the same shape, dtype and strides;
    ``close()`` (or the context manager) destroys the executor and returns the workspace.
    With ``repeatable=False`` the plan launches once, as CANN's one-shot executors do.
    """

    def __init__(
        self,
        grad_expanded_x: DeviceArray,
        expanded_row_idx: DeviceArray,
        top_k: int,
        drop_pad_mode: int = 0,
        active_num: int = 0,
        *,
        out: DeviceArray | None = None,
        repeatable: bool = True,
        validate: bool = True,
    ) -> None:
        self._h = None
        self._closed = True  # until the executor exists: close() and __del__ then do nothing
        self._lock = threading.Lock()
        # One pool block per stream the plan launched on, kept until close: launches on a
        # stream are ordered, so its block is never in use twice at once.
        self._blocks: dict[Stream, Any] = {}
        # (stream argument, bound launch) of the last slow launch, read and replaced as one
        # tuple so that a thread never pairs one stream with another stream's launch.
        self._fast: Any = None
        arrays = {"grad_expanded_x": grad_expanded_x, "expanded_row_idx": expanded_row_idx}
        for name, a in arrays.items():
            if not isinstance(a, DeviceArray):
                raise InvalidArgument(name, f"must be a DeviceArray, got {type(a).__name__}")
        if out is not None:
            if not isinstance(out, DeviceArray):
                raise InvalidArgument("out", f"must be a DeviceArray, got {type(out).__name__}")
            arrays["out"] = out
        dev = _check_device_arrays(arrays)
        x, idx = grad_expanded_x, expanded_row_idx
        if validate:
            geo = _validate.check_shapes(
                x.shape, x.dtype, idx.shape, idx.dtype, top_k, drop_pad_mode, active_num,
                None if out is None else out.shape, None if out is None else out.dtype,
            )
            if out is not None and not out.is_contiguous:
                raise InvalidArgument("out", "must be contiguous (the op writes its output densely)")
            n, h = geo.tokens, geo.hidden
        else:
            n, h = idx.shape[0] // int(top_k) if idx.ndim and int(top_k) > 0 else 0, x.shape[-1] if x.ndim else 0
        if out is None:
            out = empty((n, h), x.dtype, dev)
        self._device = dev
        self._x, self._idx, self._out = x, idx, out
        self._size, self._executor = get_workspace_size(x, idx, top_k, drop_pad_mode, active_num, out, device=dev)
        # The aclTensors keep the view offsets they were built with, whatever they are rebound to.
        self._view_offsets = (x.offset, idx.offset, out.offset)
        self._repeatable = repeatable
        if repeatable:
            try:
                self._executor.set_repeatable()
            except BaseException:
                self._executor.close()
                raise
        self._closed = False
        self._pin_arrays()
        self._h = self._executor._h
        self._pool = _pool(dev)

    def _pin_arrays(self) -> None:
        # Launches of the fast path keep nothing on the stream: the plan's arrays stay
        # reachable from this registry until close(), which hands them to the streams the
        # plan used. A plan caught in a reference cycle thus never has its memory freed by the
        # collector under a queued launch.
        _plan_arrays[id(self)] = (self._x._alloc, self._idx._alloc, self._out._alloc)

    # -- properties

    @property
    def workspace_size(self) -> int:
        return self._size

    @property
    def executor(self) -> Executor:
        return self._executor

    @property
    def out(self) -> DeviceArray:
        return self._out

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return (f"<MoeInitRoutingV2Grad x={self._x.shape} idx={self._idx.shape} out={self._out.shape} "
                f"{'closed' if self._closed else 'repeatable' if self._repeatable else 'one-shot'}>")

    # -- launching

    def __call__(self, stream: Stream | None = None, workspace: DeviceArray | None = None) -> DeviceArray:
        """Queue the kernel on ``stream`` (default: the device's default stream) and return
        ``out``. ``workspace``: your own DeviceArray of at least ``workspace_size`` bytes;
        by default the plan keeps a block from the device's workspace pool."""
        fast = self._fast
        if fast is not None and stream is fast[0] and workspace is None:
            # The steady state: same stream, own workspace. One foreign call, and the device
            # check inlined (a method call here costs a measurable share of the launch).
            if getattr(_tls, "device", None) is not self._device:
                self._device._activate()
            st = fast[1]()
            if st:
                _ffi.check(st, "aclnnMoeInitRoutingV2Grad")
            return self._out
        return self._launch_slow(stream, workspace)

    def _launch_slow(self, stream: Stream | None, workspace: DeviceArray | None) -> DeviceArray:
        with self._lock:
            if self._closed:
                raise InvalidArgument("plan", "is closed")
            if self._executor.closed:
                raise InvalidArgument("plan", "was one-shot (repeatable=False) and has launched; build a new plan")
            s = stream if stream is not None else self._device.default_stream
            if not isinstance(s, Stream) or s.closed:
                raise InvalidArgument("stream", "must be an open Stream")
            if s.device is not self._device:
                raise InvalidArgument(
                    "stream", f"is on device {s.device.device_id}, the plan on {self._device.device_id}"
                )
            if workspace is not None:
                if not isinstance(workspace, DeviceArray) or workspace.nbytes < self._size:
                    raise InvalidArgument("workspace", f"must be a DeviceArray of at least {self._size} bytes")
                execute(workspace, self._size, self._executor, s)
                self._fast = None
                return self._out
            block = self._blocks.get(s)
            if self._size and block is None:
                block = self._blocks[s] = self._pool.acquire(self._size, s)
            ws = block.address if block is not None else 0
            execute(ws, self._size, self._executor, s)
            if self._repeatable:
                self._fast = (stream, _ffi.bound_launch(ws, self._size, self._executor._h, s._h))
            return self._out

    def rebind(self, grad_expanded_x: DeviceArray | None = None, expanded_row_idx: DeviceArray | None = None,
               out: DeviceArray | None = None) -> None:
        """Point the executor at other arrays with the same shape, dtype and strides (the
        offset may differ). Launches already queued keep the arrays they were queued with."""
        if self._closed:
            raise InvalidArgument("plan", "is closed")
        if not self._repeatable:
            raise InvalidArgument("plan", "is one-shot (repeatable=False): rebinding needs a repeatable executor")
        x_t, idx_t, out_t = self._executor.tensors
        changes = []
        for name, new, old, tensor, kind, index, view_offset in (
            ("grad_expanded_x", grad_expanded_x, self._x, x_t, "input", 0, self._view_offsets[0]),
            ("expanded_row_idx", expanded_row_idx, self._idx, idx_t, "input", 1, self._view_offsets[1]),
            ("out", out, self._out, out_t, "output", 0, self._view_offsets[2]),
        ):
            if new is None:
                continue
            if not isinstance(new, DeviceArray):
                raise InvalidArgument(name, f"must be a DeviceArray, got {type(new).__name__}")
            if _layout(new) != _layout(old):
                raise InvalidArgument(
                    name,
                    f"has shape {new.shape}, dtype {new.dtype}, strides {new.strides} but the plan was built for "
                    f"{old.shape}, {old.dtype}, {old.strides}: build a new plan for a different layout",
                )
            if new.device is not self._device:
                raise InvalidArgument(
                    name, f"is on device {new.device.device_id}, the plan on {self._device.device_id}"
                )
            changes.append((name, new, tensor, kind, index, view_offset))
        # The next launch takes the slow path once: it records the stream on the new out.
        self._fast = None
        for name, new, tensor, kind, index, view_offset in changes:
            # Give CANN the base that puts the tensor's first element (at its fixed view
            # offset) where the new array has it.
            base = new.address - view_offset * new.itemsize
            if kind == "input":
                self._executor.set_input_addr(index, tensor, base)
            else:
                self._executor.set_output_addr(index, tensor, base)
            tensor._rebind(new)
            setattr(self, {"grad_expanded_x": "_x", "expanded_row_idx": "_idx", "out": "_out"}[name], new)
        if changes:
            for s in list(self._blocks):  # launches queued before the rebind still read the old ones
                if not s.closed:
                    s._keep(*_plan_arrays.get(id(self), ()))
            self._pin_arrays()

    def close(self) -> None:
        """Destroy the executor and give the workspace back to the pool. Safe twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._fast = None
            blocks, self._blocks = self._blocks, {}
        pinned = _plan_arrays.pop(id(self), ())
        for s in blocks:
            if not s.closed:
                # Launches may still be queued: their arrays must outlive them, not the plan.
                s._keep(*pinned)
        try:
            self._executor.close()
        finally:
            for s, block in blocks.items():
                self._pool.release(block, s)

    def __enter__(self) -> MoeInitRoutingV2Grad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass
