"""aclnnMoeInitRoutingV2Grad: the backward of MoE token routing.

Low level, the two phases as CANN has them::

    size, executor = get_workspace_size(x_t, idx_t, top_k, drop_pad_mode, active_num, out_t)
    execute(workspace, size, executor, stream)

A prepared plan, :class:`MoeInitRoutingV2Grad`, runs the first phase once and relaunches. The
one-call function :func:`moe_init_routing_v2_grad` takes NumPy arrays (copy in, run,
synchronize, copy out) or DeviceArrays (queued on a stream, returns at once).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, overload

import numpy as np

from .. import _contract
from ..array import DeviceArray
from ..device import Device, chip
from ..stream import Stream
from ..tensor import AclTensor
from .call import OneCall, Outputs, one_call, run_device
from .executor import Executor, execute, first_phase
from .plan import Plan
from .spec import OpSpec, Param

__all__ = ["SPEC", "MoeInitRoutingV2Grad", "execute", "get_workspace_size", "moe_init_routing_v2_grad"]

SPEC = OpSpec("aclnnMoeInitRoutingV2Grad", (
    Param("grad_expanded_x", "input", "gradExpandedX"), Param("expanded_row_idx", "input", "expandedRowIdx"),
    Param("top_k", "attr", "topK"), Param("drop_pad_mode", "attr", "dropPadMode"),
    Param("active_num", "attr", "activeNum"), Param("out", "output", "out")))


def get_workspace_size(grad_expanded_x: AclTensor | DeviceArray | None,
                       expanded_row_idx: AclTensor | DeviceArray | None, top_k: int, drop_pad_mode: int = 0,
                       active_num: int = 0,
                       out: AclTensor | DeviceArray | None = None, device: Device | int | None = None
                       ) -> tuple[int, Executor]:
    """Phase one, as CANN has it: (workspace bytes, executor).

    Nothing of the contract is checked on the host (the vendor validates; None passes a null
    pointer), only the attributes' C type (int64). DeviceArrays are wrapped in aclTensors the
    executor keeps.
    """
    return first_phase(SPEC, (grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode, active_num, out), device)


def _check(layouts: Mapping[str, tuple[tuple[int, ...], np.dtype]], attrs: Mapping[str, Any]) -> Outputs:
    # (the attributes in SPEC's order: top_k, drop_pad_mode, active_num, as check_shapes takes them)
    geo = _contract.check_shapes(*layouts["grad_expanded_x"], *layouts["expanded_row_idx"], *attrs.values())
    return {"out": ((geo.tokens, geo.hidden), layouts["grad_expanded_x"][1])}


def _sizes(arrays: Mapping[str, Any], attrs: Mapping[str, Any]) -> Outputs:
    # validate=False: [len(idx) / top_k, H] as far as the arrays say (0 where a rank is wrong).
    x, idx, k = arrays["grad_expanded_x"], arrays["expanded_row_idx"], attrs["top_k"]
    return {"out": (((idx.shape[0] // k if idx.ndim and k > 0 else 0), (x.shape[-1] if x.ndim else 0)), x.dtype)}


def _check_values(hosts: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> None:
    # (the shapes passed the contract already: the geometry is theirs, H > 0, and the rows are
    # grad_expanded_x's seen as [rows, H] in every mode)
    x, idx, k, mode, active = hosts["grad_expanded_x"], hosts["expanded_row_idx"], *attrs.values()
    geo = _contract.Geometry(idx.shape[0] // k, x.shape[-1], x.size // x.shape[-1], _contract.scenario(mode, active))
    _contract.check_indices(idx, geo, k, active, chip())


ONE_CALL = OneCall(SPEC, _check, _sizes, _check_values)


class MoeInitRoutingV2Grad(Plan):
    """A prepared launch of the op on fixed DeviceArrays: the first phase runs once, and each
    call relaunches the same (repeatable) executor.

    ``plan(stream=None, workspace=None)`` queues the kernel and returns ``out``;
    ``plan.rebind(...)`` points it at other arrays of the same shape, dtype and strides;
    ``close()`` (or the context manager) releases it once its queued launches have run. With
    ``repeatable=False`` the plan launches once, as CANN's one-shot executors do. Any thread
    may launch a plan, on any stream of its device.
    """

    _op = ONE_CALL

    def __init__(self, grad_expanded_x: DeviceArray, expanded_row_idx: DeviceArray, top_k: int,
                 drop_pad_mode: int = 0, active_num: int = 0, *, out: DeviceArray | None = None,
                 repeatable: bool = True, validate: bool = True) -> None:
        self._build([grad_expanded_x, expanded_row_idx, out], (top_k, drop_pad_mode, active_num), repeatable, validate)

    @property
    def out(self) -> DeviceArray:
        """The output array the plan writes (after a rebind, the new one)."""
        return self._c.arrays["out"]

    @staticmethod
    def _result_of(arrays: Mapping[str, DeviceArray]) -> DeviceArray:
        return arrays["out"]

    def rebind(self, grad_expanded_x: DeviceArray | None = None, expanded_row_idx: DeviceArray | None = None,
               out: DeviceArray | None = None) -> None:
        """Point the executor at other arrays with the same shape, dtype and strides (the
        offset may differ). Launches already queued keep the arrays they were queued with; a
        launch in flight on another thread completes first."""
        self._rebind((grad_expanded_x, expanded_row_idx, out))


@overload
def moe_init_routing_v2_grad(grad_expanded_x: DeviceArray, expanded_row_idx: DeviceArray, top_k: int,
                             drop_pad_mode: int = ..., active_num: int = ..., *, out: DeviceArray | None = ...,
                             stream: Stream | None = ..., workspace: DeviceArray | None = ...,
                             validate: bool = ...) -> DeviceArray: ...
@overload
def moe_init_routing_v2_grad(grad_expanded_x: Any, expanded_row_idx: Any, top_k: int, drop_pad_mode: int = ...,
                             active_num: int = ..., *, out: Any = ..., stream: Stream | None = ...,
                             workspace: DeviceArray | None = ..., validate: bool = ...) -> Any: ...
def moe_init_routing_v2_grad(grad_expanded_x: Any, expanded_row_idx: Any, top_k: int, drop_pad_mode: int = 0,
                             active_num: int = 0, *, out: Any = None, stream: Stream | None = None,
                             workspace: DeviceArray | None = None, validate: bool = True) -> Any:
    """The backward of MoE token routing: ``out[i] = sum_t grad_expanded_x[expanded_row_idx[i*top_k+t]]``.

    grad_expanded_x: [N*top_k, H] (dropless), [A, H] (active, A = active_num) or [E, C, H]
        (drop/pad), float16, bfloat16 (ml_dtypes) or float32.
    expanded_row_idx: [N*top_k] int32.
    top_k, drop_pad_mode (0 or 1), active_num (>= 0): the op's attributes.
    out: optional output [N, H], same dtype as grad_expanded_x, sharing no memory with the
        inputs, contiguous up to CANN 9.0 (a DeviceArray for device inputs, a host array for
        host inputs, written in place).
    stream: where to run (default: the thread's current stream; see `with stream:`).
    workspace: a DeviceArray of at least the op's workspace size (default: the stream's).
    validate: check the contract on the host first (index values too when the indices are a
        host array) and raise InvalidArgument; False hands everything to CANN untouched.

    Host arrays in (NumPy, torch CPU tensors, anything with DLPack, the buffer or array
    interface): copies in, runs, synchronizes, returns the result in the inputs' family (a
    torch tensor for torch inputs, else NumPy). DeviceArray in: returns a DeviceArray at once,
    the kernel queued on the stream.
    """
    values = (top_k, drop_pad_mode, active_num)
    if type(grad_expanded_x) is DeviceArray and type(expanded_row_idx) is DeviceArray and (
            out is None or type(out) is DeviceArray) and (stream is None or type(stream) is Stream) and (
            workspace is None and validate is True):  # the common device call, checked in one test
        return run_device(ONE_CALL, [grad_expanded_x, expanded_row_idx, out], values, stream, None, True)[0]
    return one_call(ONE_CALL, [grad_expanded_x, expanded_row_idx], values, [out], ["out"], stream, workspace,
                    validate)[0]
