"""aclnnMoeInitRoutingV2: the forward of MoE token routing (sort the top-k expert ids, gather
token rows into expert order, optionally drop and pad to a capacity, count tokens per expert).

Low level, the two phases as CANN has them::

    size, executor = get_workspace_size(x_t, idx_t, active_num, expert_capacity, expert_num,
                                        drop_pad_mode, count_flag, before_capacity_flag,
                                        expanded_x_t, expanded_row_idx_t, count_t, before_t)
    execute(workspace, size, executor, stream)

A prepared plan, :class:`MoeInitRoutingV2`, runs the first phase once and relaunches. The
one-call function :func:`moe_init_routing_v2` takes host arrays (copy in, run,
synchronize, copy out) or DeviceArrays (queued on a stream, returns at once), and allocates the
outputs the scenario switches on. Its ``expanded_row_idx`` is what the backward,
:func:`~pyacl_moe.moe_init_routing_v2_grad`, takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from .. import _args, _contract
from ..array import DeviceArray
from ..device import Device, chip
from ..errors import InvalidArgument
from ..stream import Stream
from ..tensor import AclTensor
from .call import OneCall, Outputs, one_call, run_device
from .executor import Executor, execute, first_phase
from .plan import Plan
from .spec import OpSpec, Param

__all__ = ["SPEC", "MoeInitRoutingV2", "RoutingResult", "execute", "get_workspace_size", "moe_init_routing_v2",
           "output_shapes"]

SPEC = OpSpec("aclnnMoeInitRoutingV2", (
    Param("x", "input", "x"), Param("expert_idx", "input", "expertIdx"),
    Param("active_num", "attr", "activeNumOptional"), Param("expert_capacity", "attr", "expertCapacityOptional"),
    Param("expert_num", "attr", "expertNumOptional"), Param("drop_pad_mode", "attr", "dropPadModeOptional"),
    Param("expert_tokens_count_or_cumsum_flag", "attr", "expertTokensCountOrCumsumFlagOptional"),
    Param("expert_tokens_before_capacity_flag", "attr", "expertTokensBeforeCapacityFlagOptional", _args.boolean),
    Param("expanded_x", "output", "expandedXOut"), Param("expanded_row_idx", "output", "expandedRowIdxOut"),
    Param("expert_tokens_count_or_cumsum", "output", "expertTokensCountOrCumsumOutOptional"),
    Param("expert_tokens_before_capacity", "output", "expertTokensBeforeCapacityOutOptional")))


class RoutingResult(NamedTuple):
    """The forward's outputs; the two optional ones are None unless the scenario switches them
    on (count: drop_pad_mode 0 with a count flag; before-capacity: drop_pad_mode 1 with its
    flag)."""

    expanded_x: Any
    expanded_row_idx: Any
    expert_tokens_count_or_cumsum: Any
    expert_tokens_before_capacity: Any


def get_workspace_size(x: AclTensor | DeviceArray | None, expert_idx: AclTensor | DeviceArray | None,
                       active_num: int = 0, expert_capacity: int = 0, expert_num: int = 0, drop_pad_mode: int = 0,
                       expert_tokens_count_or_cumsum_flag: int = 0, expert_tokens_before_capacity_flag: bool = False,
                       expanded_x: AclTensor | DeviceArray | None = None,
                       expanded_row_idx: AclTensor | DeviceArray | None = None,
                       expert_tokens_count_or_cumsum: AclTensor | DeviceArray | None = None,
                       expert_tokens_before_capacity: AclTensor | DeviceArray | None = None,
                       device: Device | int | None = None) -> tuple[int, Executor]:
    """Phase one, as CANN has it: (workspace bytes, executor). Nothing of the contract is
    checked on the host (the vendor validates; None passes a null pointer), only the
    attributes' C types."""
    return first_phase(SPEC, (x, expert_idx, active_num, expert_capacity, expert_num, drop_pad_mode,
                              expert_tokens_count_or_cumsum_flag, expert_tokens_before_capacity_flag, expanded_x,
                              expanded_row_idx, expert_tokens_count_or_cumsum, expert_tokens_before_capacity), device)


def _check(layouts: Mapping[str, tuple[tuple[int, ...], np.dtype]], attrs: Mapping[str, Any]) -> Outputs:
    return _contract.check_routing_call(*layouts["x"], *layouts["expert_idx"], tuple(attrs.values()), chip())


def _shaped(x_shape: Any, idx_shape: Any, dtype: Any, attrs: Mapping[str, Any]) -> Outputs:
    # N, K and H as the shapes have them (0 where a rank is wrong).
    n, h = (x_shape[0] if x_shape else 0), (x_shape[1] if len(x_shape) == 2 else 0)
    k = _contract.top_k_of(tuple(idx_shape)) if idx_shape else 0
    return _contract.routing_outputs(n, k, h, dtype, *attrs.values())


def _sizes(arrays: Mapping[str, Any], attrs: Mapping[str, Any]) -> Outputs:
    # validate=False: as the arrays have them.
    return _shaped(arrays["x"].shape, arrays["expert_idx"].shape, arrays["x"].dtype, attrs)


def _check_values(hosts: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> None:
    _contract.check_expert_ids(hosts["expert_idx"], attrs["expert_num"], attrs["drop_pad_mode"],
                               attrs["expert_tokens_count_or_cumsum_flag"])


ONE_CALL = OneCall(SPEC, _check, _sizes, _check_values)


def output_shapes(x_shape: tuple[int, ...], expert_idx_shape: tuple[int, ...], active_num: int = 0,
                  expert_capacity: int = 0, expert_num: int = 0, drop_pad_mode: int = 0,
                  expert_tokens_count_or_cumsum_flag: int = 0,
                  expert_tokens_before_capacity_flag: bool = False) -> RoutingResult:
    """The shape of each output the op writes for inputs of these shapes and these attributes
    (None where the scenario writes none), as :func:`moe_init_routing_v2` allocates them:
    for callers that allocate the outputs themselves (an ``out=`` of their own, a framework's
    shape function)."""
    attrs = SPEC.attr_values(active_num, expert_capacity, expert_num, drop_pad_mode,
                             expert_tokens_count_or_cumsum_flag, expert_tokens_before_capacity_flag)
    outs = _shaped(x_shape, expert_idx_shape, np.float32, attrs)
    return RoutingResult(*(None if w is None else w[0] for w in outs.values()))


class MoeInitRoutingV2(Plan):
    """A prepared launch of the forward on fixed DeviceArrays: the first phase runs once, and
    each call relaunches the same (repeatable) executor.

    ``plan(stream=None, workspace=None)`` queues the kernel and returns a
    :class:`RoutingResult` of the DeviceArrays it writes; ``plan.rebind(...)`` points it at
    other arrays of the same layouts; ``close()`` (or the context manager) releases it once
    its queued launches have run. Outputs not given are allocated (those the scenario
    writes); the optional outputs the scenario does not write stay None (a null pointer).
    """

    _op = ONE_CALL

    def __init__(self, x: DeviceArray, expert_idx: DeviceArray, active_num: int = 0, expert_capacity: int = 0,
                 expert_num: int = 0, drop_pad_mode: int = 0, expert_tokens_count_or_cumsum_flag: int = 0,
                 expert_tokens_before_capacity_flag: bool = False, *, expanded_x: DeviceArray | None = None,
                 expanded_row_idx: DeviceArray | None = None,
                 expert_tokens_count_or_cumsum: DeviceArray | None = None,
                 expert_tokens_before_capacity: DeviceArray | None = None, repeatable: bool = True,
                 validate: bool = True) -> None:
        self._build([x, expert_idx, expanded_x, expanded_row_idx, expert_tokens_count_or_cumsum,
                     expert_tokens_before_capacity],
                    (active_num, expert_capacity, expert_num, drop_pad_mode, expert_tokens_count_or_cumsum_flag,
                     expert_tokens_before_capacity_flag), repeatable, validate)

    @staticmethod
    def _result_of(arrays: Mapping[str, DeviceArray]) -> RoutingResult:
        return RoutingResult(*(arrays.get(n) for n in SPEC.outputs))

    @property
    def outputs(self) -> RoutingResult:
        """The output arrays the plan writes (after a rebind, the new ones)."""
        return self._result_of(self._c.arrays)

    def rebind(self, x: DeviceArray | None = None, expert_idx: DeviceArray | None = None, *,
               expanded_x: DeviceArray | None = None, expanded_row_idx: DeviceArray | None = None,
               expert_tokens_count_or_cumsum: DeviceArray | None = None,
               expert_tokens_before_capacity: DeviceArray | None = None) -> None:
        """Point the executor at other arrays with the same shapes, dtypes and strides (the
        offset may differ). Launches already queued keep the arrays they were queued with."""
        self._rebind((x, expert_idx, expanded_x, expanded_row_idx, expert_tokens_count_or_cumsum,
                      expert_tokens_before_capacity))


def moe_init_routing_v2(x: Any, expert_idx: Any, active_num: int = 0, expert_capacity: int = 0, expert_num: int = 0,
                        drop_pad_mode: int = 0, expert_tokens_count_or_cumsum_flag: int = 0,
                        expert_tokens_before_capacity_flag: bool = False, *, out: RoutingResult | None = None,
                        stream: Stream | None = None, workspace: DeviceArray | None = None,
                        validate: bool = True) -> RoutingResult:
    """Route tokens to experts with CANN's aclnnMoeInitRoutingV2.

    x: [N, H] float16, bfloat16 or float32. expert_idx: [N, K] int32, each token's top-k
    expert ids. drop_pad_mode 0 (dropless, or active with active_num > 0) or 1 (drop/pad to
    expert_capacity slots for each of expert_num experts). The count flag (mode 0) asks for
    the cumulative sum (1) or the count (2) of tokens per expert; the before-capacity flag
    (mode 1) for the count before dropping.

    Host arrays in (NumPy, torch CPU tensors, DLPack, buffers): copies in, runs, synchronizes
    and returns a :class:`RoutingResult` of arrays in the inputs' family. DeviceArrays in:
    returns DeviceArrays at once, the kernel queued on ``stream`` (default: the thread's
    current stream). With ``validate`` the contract is checked on the host first (for host
    inputs, the ids' range too); False hands everything to CANN.

    ``out``: a :class:`RoutingResult` of arrays to write (DeviceArrays for device inputs, host
    arrays for host inputs; None for an output to make; one the scenario does not write must
    be None), as a plan's ``outputs`` or an earlier call's result, so that a loop allocates
    nothing. ``workspace``: a DeviceArray of at least the op's workspace size (default: the
    stream's).
    """
    values = (active_num, expert_capacity, expert_num, drop_pad_mode, expert_tokens_count_or_cumsum_flag,
              expert_tokens_before_capacity_flag)
    if type(x) is DeviceArray and type(expert_idx) is DeviceArray and (stream is None or type(stream) is Stream) and (
            workspace is None and validate is True) and (out is None or type(out) is RoutingResult and _DEVICE_OR_NONE
                                                         .issuperset(map(type, out))):  # the common device call
        arrays = [x, expert_idx, None, None, None, None] if out is None else [x, expert_idx, *out]
        # (tuple.__new__: the NamedTuple's own __new__ is one frame more)
        return _new(RoutingResult, run_device(ONE_CALL, arrays, values, stream, None, True))
    if type(out) is not RoutingResult and (not isinstance(out, tuple) or len(out) != 4) and out is not None:
        raise InvalidArgument("out", f"must be a RoutingResult (or a tuple of 4) of arrays or None, got "
                                     f"{type(out).__name__}")
    return RoutingResult(*one_call(ONE_CALL, [x, expert_idx], values, [None] * 4 if out is None else list(out),
                                   [f"out.{n}" for n in SPEC.outputs], stream, workspace, validate))


_DEVICE_OR_NONE = frozenset({DeviceArray, type(None)})
_new = tuple.__new__
