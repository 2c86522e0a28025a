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
from ..array import DeviceArray, empty
from ..device import Device, resolve_device
from ..errors import InvalidArgument
from ..stream import Stream
from ..tensor import AclTensor
from .call import OneCall, Outputs, run_device, run_host
from .executor import Executor, check_output_layout, device_of, first_phase
from .executor import execute as execute
from .plan import Plan, check_no_overlap
from .spec import OpSpec, Param

__all__ = ["SPEC", "MoeInitRoutingV2", "RoutingResult", "execute", "get_workspace_size", "moe_init_routing_v2",
           "output_shapes"]

SPEC = OpSpec(
    "aclnnMoeInitRoutingV2",
    (
        Param("x", "input", "x"),
        Param("expert_idx", "input", "expertIdx"),
        Param("active_num", "attr", "activeNumOptional"),
        Param("expert_capacity", "attr", "expertCapacityOptional"),
        Param("expert_num", "attr", "expertNumOptional"),
        Param("drop_pad_mode", "attr", "dropPadModeOptional"),
        Param("expert_tokens_count_or_cumsum_flag", "attr", "expertTokensCountOrCumsumFlagOptional"),
        Param("expert_tokens_before_capacity_flag", "attr", "expertTokensBeforeCapacityFlagOptional"),
        Param("expanded_x", "output", "expandedXOut"),
        Param("expanded_row_idx", "output", "expandedRowIdxOut"),
        Param("expert_tokens_count_or_cumsum", "output", "expertTokensCountOrCumsumOutOptional"),
        Param("expert_tokens_before_capacity", "output", "expertTokensBeforeCapacityOutOptional"),
    ),
)

class RoutingResult(NamedTuple):
    """The forward's outputs; the two optional ones are None unless the scenario switches them
    on (count: drop_pad_mode 0 with a count flag; before-capacity: drop_pad_mode 1 with its
    flag)."""

    expanded_x: Any
    expanded_row_idx: Any
    expert_tokens_count_or_cumsum: Any
    expert_tokens_before_capacity: Any


def _attrs(active_num: Any, expert_capacity: Any, expert_num: Any, drop_pad_mode: Any, count_flag: Any,
           before_flag: Any) -> dict[str, Any]:
    return {
        "active_num": _args.int64("active_num", active_num),
        "expert_capacity": _args.int64("expert_capacity", expert_capacity),
        "expert_num": _args.int64("expert_num", expert_num),
        "drop_pad_mode": _args.int64("drop_pad_mode", drop_pad_mode),
        "expert_tokens_count_or_cumsum_flag": _args.int64("expert_tokens_count_or_cumsum_flag", count_flag),
        "expert_tokens_before_capacity_flag": _args.boolean("expert_tokens_before_capacity_flag", before_flag),
    }


# ---------------------------------------------------------------------------- the two phases

def get_workspace_size(
    x: AclTensor | DeviceArray | None,
    expert_idx: AclTensor | DeviceArray | None,
    active_num: int = 0,
    expert_capacity: int = 0,
    expert_num: int = 0,
    drop_pad_mode: int = 0,
    expert_tokens_count_or_cumsum_flag: int = 0,
    expert_tokens_before_capacity_flag: bool = False,
    expanded_x: AclTensor | DeviceArray | None = None,
    expanded_row_idx: AclTensor | DeviceArray | None = None,
    expert_tokens_count_or_cumsum: AclTensor | DeviceArray | None = None,
    expert_tokens_before_capacity: AclTensor | DeviceArray | None = None,
    device: Device | int | None = None,
) -> tuple[int, Executor]:
    """Phase one, as CANN has it: (workspace bytes, executor). Nothing of the contract is
    checked on the host (the vendor validates; None passes a null pointer), only the
    attributes' C types."""
    attrs = _attrs(active_num, expert_capacity, expert_num, drop_pad_mode, expert_tokens_count_or_cumsum_flag,
                   expert_tokens_before_capacity_flag)
    given = {"x": x, "expert_idx": expert_idx, "expanded_x": expanded_x, "expanded_row_idx": expanded_row_idx,
             "expert_tokens_count_or_cumsum": expert_tokens_count_or_cumsum,
             "expert_tokens_before_capacity": expert_tokens_before_capacity}
    return first_phase(SPEC, given, attrs, resolve_device(device) if device is not None else None)


# ---------------------------------------------------------------------------- the prepared plan

_OUTPUTS = SPEC.outputs


def _check_outputs(outs: Mapping[str, DeviceArray | None], shapes: dict[str, tuple[int, ...] | None],
                   x_dtype: np.dtype) -> None:
    """Given outputs: present exactly when the scenario writes them, of the shape and dtype
    it writes, contiguous where the release's kernel writes densely (check_output_layout)."""
    for name, want in shapes.items():
        got = outs.get(name)
        if got is None:
            continue
        if want is None:
            raise InvalidArgument(name, "is not written in this scenario (count: drop_pad_mode 0 with a count flag; "
                                        "before-capacity: drop_pad_mode 1 with its flag): pass None")
        dtype = _dtype_of(name, x_dtype)
        if got.shape != want or got.dtype != dtype:
            raise InvalidArgument(name, f"must be {want} {dtype}, got {got.shape} {got.dtype}")
        check_output_layout(name, got)


class MoeInitRoutingV2(Plan):
    """A prepared launch of the forward on fixed DeviceArrays: the first phase runs once, and
    each call relaunches the same (repeatable) executor.

    ``plan(stream=None, workspace=None)`` queues the kernel and returns a
    :class:`RoutingResult` of the DeviceArrays it writes; ``plan.rebind(...)`` points it at
    other arrays of the same layouts; ``close()`` (or the context manager) releases it once
    its queued launches have run. Outputs not given are allocated (those the scenario
    writes); the optional outputs the scenario does not write stay None (a null pointer).
    """

    _spec = SPEC

    def __init__(
        self,
        x: DeviceArray,
        expert_idx: DeviceArray,
        active_num: int = 0,
        expert_capacity: int = 0,
        expert_num: int = 0,
        drop_pad_mode: int = 0,
        expert_tokens_count_or_cumsum_flag: int = 0,
        expert_tokens_before_capacity_flag: bool = False,
        *,
        expanded_x: DeviceArray | None = None,
        expanded_row_idx: DeviceArray | None = None,
        expert_tokens_count_or_cumsum: DeviceArray | None = None,
        expert_tokens_before_capacity: DeviceArray | None = None,
        repeatable: bool = True,
        validate: bool = True,
    ) -> None:
        validate = _args.boolean("validate", validate)
        attrs = _attrs(active_num, expert_capacity, expert_num, drop_pad_mode, expert_tokens_count_or_cumsum_flag,
                       expert_tokens_before_capacity_flag)
        arrays = {"x": _args.instance("x", x, DeviceArray, "a DeviceArray"),
                  "expert_idx": _args.instance("expert_idx", expert_idx, DeviceArray, "a DeviceArray")}
        given = {"expanded_x": expanded_x, "expanded_row_idx": expanded_row_idx,
                 "expert_tokens_count_or_cumsum": expert_tokens_count_or_cumsum,
                 "expert_tokens_before_capacity": expert_tokens_before_capacity}
        for name, a in given.items():
            if a is not None:
                arrays[name] = _args.instance(name, a, DeviceArray, "a DeviceArray or None")
        dev = device_of(arrays)
        shapes = _shapes(*_sizes(x, expert_idx), attrs)
        if validate:
            _check(x.shape, x.dtype, expert_idx.shape, expert_idx.dtype, attrs)
            _check_outputs(arrays, shapes, x.dtype)
            check_no_overlap(SPEC, arrays)
        for name in _OUTPUTS:
            shape = shapes[name]
            if name not in arrays and shape is not None:
                arrays[name] = _new_output(name, shape, x.dtype, dev)
        self._validate = validate
        self._prepare(dev, arrays, attrs, _args.boolean("repeatable", repeatable))

    @staticmethod
    def _result_of(arrays: Mapping[str, DeviceArray]) -> RoutingResult:
        return RoutingResult(*(arrays.get(n) for n in _OUTPUTS))

    @property
    def outputs(self) -> RoutingResult:
        """The output arrays the plan writes (after a rebind, the new ones)."""
        return self._result_of(self._c.arrays)

    def __repr__(self) -> str:
        a = self._c.arrays
        state = "closed" if self.closed else "repeatable" if self._repeatable else "one-shot"
        return f"<MoeInitRoutingV2 x={a['x'].shape} expert_idx={a['expert_idx'].shape} {state}>"

    def rebind(self, x: DeviceArray | None = None, expert_idx: DeviceArray | None = None, *,
               expanded_x: DeviceArray | None = None, expanded_row_idx: DeviceArray | None = None,
               expert_tokens_count_or_cumsum: DeviceArray | None = None,
               expert_tokens_before_capacity: DeviceArray | None = None) -> None:
        """Point the executor at other arrays with the same shapes, dtypes and strides (the
        offset may differ). Launches already queued keep the arrays they were queued with."""
        self._rebind(self._checked_changes({
            "x": x, "expert_idx": expert_idx, "expanded_x": expanded_x, "expanded_row_idx": expanded_row_idx,
            "expert_tokens_count_or_cumsum": expert_tokens_count_or_cumsum,
            "expert_tokens_before_capacity": expert_tokens_before_capacity}))


# ---------------------------------------------------------------------------- one call

def _check(x_shape: tuple[int, ...], x_dtype: np.dtype, idx_shape: tuple[int, ...], idx_dtype: np.dtype,
           attrs: dict[str, Any]) -> None:
    """The documented contract, on the host, with the parameter each rule is about."""
    _contract.check_routing(x_shape, x_dtype, idx_shape, idx_dtype, attrs["active_num"], attrs["expert_capacity"],
                            attrs["expert_num"], attrs["drop_pad_mode"], attrs["expert_tokens_count_or_cumsum_flag"])
    if attrs["drop_pad_mode"] == 1 and attrs["expert_capacity"] > x_shape[0]:
        # The vendor's tiling rule; the reference computes any capacity.
        raise InvalidArgument("expert_capacity", f"must be at most N = {x_shape[0]}, got {attrs['expert_capacity']}")
    # The vendor sets no bound on expert_num, but the outputs it sizes must be addressable.
    for name, shape in _shapes(x_shape[0], idx_shape[1], x_shape[1], attrs).items():
        if shape is not None:
            # Only the expert count makes an output bigger than the inputs, bar mode 0's N*K rows.
            if name == "expanded_x" and attrs["drop_pad_mode"] == 0:
                _args.nbytes(name, shape, _dtype_of(name, x_dtype).itemsize)
            else:
                _args.nbytes("expert_num", shape, _dtype_of(name, x_dtype).itemsize, makes=name)


def _sizes(x: DeviceArray, idx: DeviceArray) -> tuple[int, int, int]:
    """N, K and H as the arrays have them (0 where a rank is wrong: validate=False)."""
    return (x.shape[0] if x.ndim else 0, idx.shape[1] if idx.ndim == 2 else 0, x.shape[1] if x.ndim == 2 else 0)


def _shapes(n: int, k: int, h: int, attrs: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    # A negative attribute (validate=False) gives an empty dimension, not a negative one, so
    # that the vendor's first phase sees the attribute and refuses it itself.
    total, num, cap = n * k, max(attrs["expert_num"], 0), max(attrs["expert_capacity"], 0)
    if attrs["drop_pad_mode"] == 1:
        ex: tuple[int, ...] = (num, cap, h)
    else:
        ex = (total if attrs["active_num"] == 0 else max(min(attrs["active_num"], total), 0), h)
    return {
        "expanded_x": ex,
        "expanded_row_idx": (total,),
        "expert_tokens_count_or_cumsum": (num,) if attrs["drop_pad_mode"] == 0
        and attrs["expert_tokens_count_or_cumsum_flag"] else None,
        "expert_tokens_before_capacity": (num,) if attrs["drop_pad_mode"] == 1
        and attrs["expert_tokens_before_capacity_flag"] else None,
    }


def output_shapes(x_shape: tuple[int, ...], expert_idx_shape: tuple[int, ...], active_num: int = 0,
                  expert_capacity: int = 0, expert_num: int = 0, drop_pad_mode: int = 0,
                  expert_tokens_count_or_cumsum_flag: int = 0,
                  expert_tokens_before_capacity_flag: bool = False) -> RoutingResult:
    """The shape of each output the op writes for inputs of these shapes and these attributes
    (None where the scenario writes none), as :func:`moe_init_routing_v2` allocates them:
    for callers that allocate the outputs themselves (an ``out=`` of their own, a framework's
    shape function)."""
    attrs = _attrs(active_num, expert_capacity, expert_num, drop_pad_mode, expert_tokens_count_or_cumsum_flag,
                   expert_tokens_before_capacity_flag)
    n = x_shape[0] if x_shape else 0
    h = x_shape[1] if len(x_shape) == 2 else 0
    k = expert_idx_shape[1] if len(expert_idx_shape) == 2 else 0
    return RoutingResult(**_shapes(n, k, h, attrs))


def _dtype_of(name: str, x_dtype: np.dtype) -> np.dtype:
    """An output's dtype: x's for expanded_x, int32 for the indices and counts."""
    return x_dtype if name == "expanded_x" else np.dtype(np.int32)


def _new_output(name: str, shape: tuple[int, ...], x_dtype: np.dtype, device: Device) -> DeviceArray:
    """A new output ``name`` of ``shape`` (as the attributes size it), refused by name when it
    cannot be addressed (validate=False: the contract was not checked)."""
    dtype = _dtype_of(name, x_dtype)
    _args.nbytes(name, shape, dtype.itemsize)
    return empty(shape, dtype, device)


def _one_check(layouts: Mapping[str, tuple[tuple[int, ...], np.dtype]], attrs: Mapping[str, Any]) -> Outputs:
    (xs, xd), (ixs, ixd) = layouts["x"], layouts["expert_idx"]
    _check(xs, xd, ixs, ixd, dict(attrs))
    return {name: None if shape is None else (shape, _dtype_of(name, xd))
            for name, shape in _shapes(xs[0], ixs[1], xs[1], dict(attrs)).items()}


def _one_sizes(arrays: Mapping[str, DeviceArray], attrs: Mapping[str, Any]) -> Outputs:
    x = arrays["x"]
    return {name: None if shape is None else (shape, _dtype_of(name, x.dtype))
            for name, shape in _shapes(*_sizes(x, arrays["expert_idx"]), dict(attrs)).items()}


def _one_values(hosts: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> None:
    _contract.check_expert_ids(hosts["expert_idx"], attrs["expert_num"], attrs["drop_pad_mode"],
                               attrs["expert_tokens_count_or_cumsum_flag"])


ONE_CALL = OneCall(SPEC, _attrs, _one_check, _one_sizes, _one_values)


def moe_init_routing_v2(
    x: Any,
    expert_idx: Any,
    active_num: int = 0,
    expert_capacity: int = 0,
    expert_num: int = 0,
    drop_pad_mode: int = 0,
    expert_tokens_count_or_cumsum_flag: int = 0,
    expert_tokens_before_capacity_flag: bool = False,
    *,
    out: RoutingResult | None = None,
    stream: Stream | None = None,
    workspace: DeviceArray | None = None,
    validate: bool = True,
) -> RoutingResult:
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
            workspace is None and validate is True):  # the common device call, checked in one test
        return RoutingResult(*run_device(ONE_CALL, [x, expert_idx, *_given_outputs(out, True)], values, stream, None,
                                         True))
    validate = _args.boolean("validate", validate)
    if stream is not None:
        _args.instance("stream", stream, Stream, "a Stream or None")
    if workspace is not None:
        _args.instance("workspace", workspace, DeviceArray, "a DeviceArray or None")
    on_device = isinstance(x, DeviceArray)
    if on_device != isinstance(expert_idx, DeviceArray):
        raise InvalidArgument("expert_idx", "must be a DeviceArray when x is one, and a host array otherwise")
    given = _given_outputs(out, on_device)
    if on_device:
        return RoutingResult(*run_device(ONE_CALL, [x, expert_idx, *given], values, stream, workspace, validate))
    return RoutingResult(*run_host(ONE_CALL, [x, expert_idx], values, given, stream, workspace, validate))


_DEVICE_OR_NONE = frozenset({DeviceArray, type(None)})


def _given_outputs(out: Any, on_device: bool) -> list[Any]:
    """The outputs a caller gave, in ``SPEC.outputs`` order (checked to be DeviceArrays for
    device inputs, host arrays for host inputs)."""
    if out is None:
        return [None] * len(_OUTPUTS)
    if on_device and type(out) is RoutingResult and _DEVICE_OR_NONE.issuperset(map(type, out)):
        return list(out)  # (the common case, without a loop)
    if type(out) is not RoutingResult and (not isinstance(out, tuple) or len(out) != len(_OUTPUTS)):
        raise InvalidArgument("out", f"must be a RoutingResult (or a tuple of {len(_OUTPUTS)}) of arrays or None, "
                                     f"got {type(out).__name__}")
    for name, a in zip(_OUTPUTS, out):
        if a is None or type(a) is DeviceArray and on_device:
            continue
        if on_device:
            _args.instance(f"out.{name}", a, DeviceArray, "a DeviceArray or None")
        elif isinstance(a, DeviceArray):
            raise InvalidArgument(f"out.{name}", "must be a host array or None when the inputs are host arrays, "
                                                 "got a DeviceArray")
    return list(out)
