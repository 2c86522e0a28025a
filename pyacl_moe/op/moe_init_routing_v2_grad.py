"""aclnnMoeInitRoutingV2Grad: the backward of MoE token routing.

Low level, the two phases as CANN has them::

    size, executor = get_workspace_size(x_t, idx_t, top_k, drop_pad_mode, active_num, out_t)
    execute(workspace, size, executor, stream)

A prepared plan, :class:`MoeInitRoutingV2Grad`, runs the first phase once and relaunches. The
one-call function :func:`moe_init_routing_v2_grad` takes NumPy arrays (copy in, run,
synchronize, copy out) or DeviceArrays (queued on a stream, returns at once).
"""

from __future__ import annotations

from typing import Any, overload

import numpy as np

from .. import _args, _contract
from ..array import DeviceArray, empty, host_array, to_device
from ..device import Device, current_device, resolve_device
from ..errors import InvalidArgument
from ..host import TORCH, host_view, in_family
from ..pool import workspace_for
from ..stream import Stream, current_stream, resolve_stream, thread_current
from ..tensor import AclTensor
from .executor import Executor, check_output_layout, device_of, first_phase, launch, mark_uses
from .executor import execute as execute
from .plan import Plan, check_no_overlap, check_workspace_apart, launch_cached, relaunch
from .spec import OpSpec, Param

__all__ = ["SPEC", "MoeInitRoutingV2Grad", "execute", "get_workspace_size", "moe_init_routing_v2_grad"]

SPEC = OpSpec(
    "aclnnMoeInitRoutingV2Grad",
    (
        Param("grad_expanded_x", "input", "gradExpandedX"),
        Param("expanded_row_idx", "input", "expandedRowIdx"),
        Param("top_k", "attr", "topK"),
        Param("drop_pad_mode", "attr", "dropPadMode"),
        Param("active_num", "attr", "activeNum"),
        Param("out", "output", "out"),
    ),
)


def _attrs(top_k: Any, drop_pad_mode: Any, active_num: Any) -> dict[str, int]:
    return {"top_k": _args.int64("top_k", top_k), "drop_pad_mode": _args.int64("drop_pad_mode", drop_pad_mode),
            "active_num": _args.int64("active_num", active_num)}


# ---------------------------------------------------------------------------- the two phases

def get_workspace_size(
    grad_expanded_x: AclTensor | DeviceArray | None,
    expanded_row_idx: AclTensor | DeviceArray | None,
    top_k: int,
    drop_pad_mode: int = 0,
    active_num: int = 0,
    out: AclTensor | DeviceArray | None = None,
    device: Device | int | None = None,
) -> tuple[int, Executor]:
    """Phase one, as CANN has it: (workspace bytes, executor).

    Nothing of the contract is checked on the host (the vendor validates; None passes a null
    pointer), only the attributes' C type (int64). DeviceArrays are wrapped in aclTensors the
    executor keeps.
    """
    attrs = _attrs(top_k, drop_pad_mode, active_num)
    given = {"grad_expanded_x": grad_expanded_x, "expanded_row_idx": expanded_row_idx, "out": out}
    return first_phase(SPEC, given, attrs, resolve_device(device) if device is not None else None)


# ---------------------------------------------------------------------------- the contract on device arrays

# Layouts that passed the contract: the checks depend only on shapes, dtypes, strides and the
# attributes, so a layout that passed once passes again. Keys carry the attributes' types, so
# True never stands for 1.
_validated: dict[tuple[Any, ...], _contract.Geometry] = {}
_VALIDATED_MAX = 256


def _check_layout(key: tuple[Any, ...], x: DeviceArray, idx: DeviceArray, top_k: Any, mode: Any, active: Any,
                  out: DeviceArray | None) -> _contract.Geometry:
    geo = _validated.get(key)
    if geo is None:
        geo = _contract.check_shapes(
            x.shape, x.dtype, idx.shape, idx.dtype, top_k, mode, active,
            None if out is None else out.shape, None if out is None else out.dtype,
        )
        if out is not None:
            check_output_layout("out", out)
        if len(_validated) >= _VALIDATED_MAX:
            _validated.clear()
        _validated[key] = geo
    return geo


# ---------------------------------------------------------------------------- the prepared plan

class MoeInitRoutingV2Grad(Plan):
    """A prepared launch of the op on fixed DeviceArrays: the first phase runs once, and each
    call relaunches the same (repeatable) executor.

    ``plan(stream=None, workspace=None)`` queues the kernel and returns ``out``;
    ``plan.rebind(...)`` points it at other arrays of the same shape, dtype and strides;
    ``close()`` (or the context manager) releases it once its queued launches have run. With
    ``repeatable=False`` the plan launches once, as CANN's one-shot executors do. Any thread
    may launch a plan, on any stream of its device.
    """

    _spec = SPEC

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
        self._closed = True  # until prepared
        validate = _args.boolean("validate", validate)
        arrays = {
            "grad_expanded_x": _args.instance("grad_expanded_x", grad_expanded_x, DeviceArray, "a DeviceArray"),
            "expanded_row_idx": _args.instance("expanded_row_idx", expanded_row_idx, DeviceArray, "a DeviceArray"),
        }
        if out is not None:
            arrays["out"] = _args.instance("out", out, DeviceArray, "a DeviceArray or None")
        dev = device_of(arrays)
        attrs = _attrs(top_k, drop_pad_mode, active_num)
        x, idx = grad_expanded_x, expanded_row_idx
        if validate:
            geo = _contract.check_shapes(x.shape, x.dtype, idx.shape, idx.dtype, top_k, drop_pad_mode, active_num,
                                         None if out is None else out.shape, None if out is None else out.dtype)
            if out is not None:
                check_output_layout("out", out)
                check_no_overlap(SPEC, arrays)
            n, h = geo.tokens, geo.hidden
        else:
            k = attrs["top_k"]
            n, h = (idx.shape[0] // k if idx.ndim and k > 0 else 0), (x.shape[-1] if x.ndim else 0)
        if out is None:
            out = arrays["out"] = empty((n, h), x.dtype, dev)
        self._validate = validate
        self._prepare(dev, arrays, attrs, _args.boolean("repeatable", repeatable))

    @property
    def out(self) -> DeviceArray:
        """The output array the plan writes (after a rebind, the new one)."""
        return self._arrays["out"]

    def _result(self) -> DeviceArray:
        return self._arrays["out"]

    def __repr__(self) -> str:
        a = self._arrays
        state = "closed" if self._closed else "repeatable" if self._repeatable else "one-shot"
        return (f"<MoeInitRoutingV2Grad x={a['grad_expanded_x'].shape} idx={a['expanded_row_idx'].shape} "
                f"out={a['out'].shape} {state}>")

    def rebind(self, grad_expanded_x: DeviceArray | None = None, expanded_row_idx: DeviceArray | None = None,
               out: DeviceArray | None = None) -> None:
        """Point the executor at other arrays with the same shape, dtype and strides (the
        offset may differ). Launches already queued keep the arrays they were queued with; a
        launch in flight on another thread completes first."""
        self._rebind(self._checked_changes({"grad_expanded_x": grad_expanded_x,
                                            "expanded_row_idx": expanded_row_idx, "out": out}))


# ---------------------------------------------------------------------------- one call

@overload
def moe_init_routing_v2_grad(grad_expanded_x: DeviceArray, expanded_row_idx: DeviceArray, top_k: int,
                             drop_pad_mode: int = ..., active_num: int = ..., *, out: DeviceArray | None = ...,
                             stream: Stream | None = ..., workspace: DeviceArray | None = ...,
                             validate: bool = ...) -> DeviceArray: ...


@overload
def moe_init_routing_v2_grad(grad_expanded_x: np.ndarray, expanded_row_idx: np.ndarray, top_k: int,
                             drop_pad_mode: int = ..., active_num: int = ..., *, out: np.ndarray | None = ...,
                             stream: Stream | None = ..., workspace: DeviceArray | None = ...,
                             validate: bool = ...) -> np.ndarray: ...


@overload
def moe_init_routing_v2_grad(grad_expanded_x: Any, expanded_row_idx: Any, top_k: int,
                             drop_pad_mode: int = ..., active_num: int = ..., *, out: Any = ...,
                             stream: Stream | None = ..., workspace: DeviceArray | None = ...,
                             validate: bool = ...) -> Any: ...


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
    out: optional output [N, H], same dtype as grad_expanded_x, contiguous, sharing no memory
        with the inputs.
    stream: where to run (default: the thread's current stream; see `with stream:`).
    workspace: a DeviceArray of at least the op's workspace size (default: the stream's).
    validate: check the contract on the host first (index values too when the indices are a
        NumPy array) and raise InvalidArgument; False hands everything to CANN untouched.

    Host arrays in (NumPy, torch CPU tensors, anything with DLPack, the buffer or array
    interface): copies in, runs, synchronizes, returns the result in the inputs' family (a
    torch tensor for torch inputs, else NumPy). DeviceArray in: returns a DeviceArray at once,
    the kernel queued on the stream.
    """
    if (type(grad_expanded_x) is DeviceArray and type(expanded_row_idx) is DeviceArray and workspace is None
            and validate is True and (stream is None or type(stream) is Stream)):
        # The common device call, its argument checks in one test (each is a share of it).
        return _run_device(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, out, stream, None,
                           True)
    on_device = isinstance(grad_expanded_x, DeviceArray)
    if on_device != isinstance(expanded_row_idx, DeviceArray):
        raise InvalidArgument(
            "expanded_row_idx", "must be a DeviceArray when grad_expanded_x is one, and a host array otherwise"
        )
    if stream is not None and not isinstance(stream, Stream):
        raise InvalidArgument("stream", f"must be a Stream or None, got {type(stream).__name__}")
    if workspace is not None and not isinstance(workspace, DeviceArray):
        raise InvalidArgument("workspace", f"must be a DeviceArray or None, got {type(workspace).__name__}")
    validate = _args.boolean("validate", validate)
    if on_device:
        return _run_device(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, out, stream,
                           workspace, validate)
    return _run_host(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, out, stream, workspace,
                     validate)


def _run_device(x: DeviceArray, idx: DeviceArray, top_k: Any, mode: Any, active: Any, out: Any,
                stream: Stream | None, workspace: DeviceArray | None, validate: bool) -> DeviceArray:
    # The common case's checks come first and cheaply (a closed device is caught at the
    # launch); anything unusual takes device_of for its errors.
    xa, ia = x.alloc, idx.alloc
    if xa is None or ia is None:
        xa, ia = x.allocation("grad_expanded_x"), idx.allocation("expanded_row_idx")  # raises ClosedError
    dev = xa.device
    oa = None
    if out is not None:
        if type(out) is not DeviceArray and not isinstance(out, DeviceArray):
            raise InvalidArgument("out", f"must be a DeviceArray when the inputs are, got {type(out).__name__}")
        oa = out.alloc
        if oa is None:
            oa = out.allocation("out")  # raises ClosedError
    if ia.device is not dev or (oa is not None and oa.device is not dev) or workspace is not None:
        arrays = {"grad_expanded_x": x, "expanded_row_idx": idx}
        if out is not None:
            arrays["out"] = out
        if workspace is not None:
            arrays["workspace"] = workspace
        device_of(arrays)
    if stream is None:
        cur = thread_current.stream
        state = cur.state if cur is not None and cur.state.device is dev else dev.default_stream.state
    else:
        state = stream.state
    if state.device is not dev:
        resolve_stream(stream, dev)  # raises, naming the devices
    if validate:
        if type(top_k) is int and type(mode) is int and type(active) is int:
            key: tuple[Any, ...] = (x.layout_id, idx.layout_id, -1 if out is None else out.layout_id, top_k, mode,
                                    active)
        else:  # NumPy integers, or what the checks refuse: the types go in the key too
            key = (x.layout_id, idx.layout_id, -1 if out is None else out.layout_id, type(top_k), top_k, type(mode),
                   mode, type(active), active)
        xlo, xhi = x.span
        ilo, ihi = idx.span
        if out is not None:
            assert oa is not None
            olo, ohi = out.span
            # The steady state: an out apart from the inputs, the stream's workspace, and a
            # layout this stream has an executor for (so validated before).
            if workspace is None and not ((olo <= xhi and xlo <= ohi) or (olo <= ihi and ilo <= ohi)) and relaunch(
                    SPEC, key, (xlo, ilo, olo), (xa, ia, oa), state,
                    state not in xa.users or state not in ia.users or state not in oa.writers):
                result: DeviceArray = out
                return result
        geo = _validated.get(key)
        if geo is None:
            geo = _check_layout(key, x, idx, top_k, mode, active, out)
        if out is None:
            out = empty((geo.tokens, geo.hidden), x.dtype, dev)
            oa = out.allocation("out")
            key = (key[0], key[1], out.layout_id, *key[3:])
            olo = out.span[0]
        elif (olo <= xhi and xlo <= ohi) or (olo <= ihi and ilo <= ohi):
            check_no_overlap(SPEC, {"grad_expanded_x": x, "expanded_row_idx": idx, "out": out})
        if workspace is not None:
            check_workspace_apart(workspace, {"grad_expanded_x": x, "expanded_row_idx": idx, "out": out})
        assert oa is not None
        # A layout seen before on this stream relaunches its cached executor, rebound.
        launch_cached(SPEC, key, (x, idx, out), (xa, ia, oa), (xlo, ilo, olo), (top_k, mode, active), state,
                      workspace)
        made: DeviceArray = out
        return made
    attrs = _attrs(top_k, mode, active)
    k = attrs["top_k"]
    n = idx.shape[0] // k if idx.ndim and k > 0 else 0
    h = x.shape[-1] if x.ndim else 0
    if out is None:
        out = empty((n, h), x.dtype, dev)
    size, executor = get_workspace_size(x, idx, k, attrs["drop_pad_mode"], attrs["active_num"], out, device=dev)
    try:
        if workspace is None:
            block = workspace_for(state, size) if size else None
            core = executor.core()
            mark_uses(core, state)
            launch(core, state, block.ptr if block is not None else 0, size,
                   (block, xa, ia, out.allocation("out")))
        else:
            execute(workspace, size, executor, stream)
    finally:
        executor.close()
    written: DeviceArray = out
    return written


def _run_host(x: Any, idx: Any, top_k: Any, mode: Any, active: Any, out: Any, stream: Stream | None,
              workspace: DeviceArray | None, validate: bool) -> Any:
    vx, family = host_view(x, "grad_expanded_x")
    vi, _ = host_view(idx, "expanded_row_idx")
    hx, hi = _contract.native(vx), _contract.native(vi)
    out_given = out
    if out is not None:
        if not isinstance(out, np.ndarray) and family is not TORCH:
            raise InvalidArgument("out", f"must be a NumPy array when the inputs are, got {type(out).__name__}")
        out, _ = host_view(out, "out")  # a torch tensor's own memory, written in place
    if validate:
        geo = _contract.check_shapes(
            hx.shape, hx.dtype, hi.shape, hi.dtype, top_k, mode, active,
            None if out is None else out.shape, None if out is None else out.dtype,
        )
        if out is not None and not out.flags.writeable:
            raise InvalidArgument("out", "must be writable")
        _contract.check_indices(hi, geo, int(top_k), int(active))
    hx, hi = host_array(hx, "grad_expanded_x"), host_array(hi, "expanded_row_idx")
    dev = stream.device if stream is not None else current_device()
    s = stream if stream is not None else current_stream(dev)
    dx = to_device(hx, stream=s)
    di = to_device(hi, stream=s)
    # The indices were checked above; the layout check below is a memo lookup.
    dout = _run_device(dx, di, top_k, mode, active, None, s, workspace, validate)
    result = dout.to_host(s)
    dx.close()
    di.close()
    dout.close()
    if out is not None:
        out[...] = result
        return out_given
    return in_family(result, family)
