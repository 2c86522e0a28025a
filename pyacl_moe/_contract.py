"""The op's contract, checked on the host.

Shared by the binding (``validate=True``) and the golden reference, so both refuse the same
inputs with the same message: the parameter's name and the rule it breaks. Pure NumPy. Where
the chips differ the rule takes the :class:`Chip`: what one accepts is refused on another,
naming the chip and the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import ml_dtypes
import numpy as np

from . import _args
from .errors import InvalidArgument

# ---------------------------------------------------------------------------- chips

# The SoCs of the three families the ops are built for (ops-transformer
# moe/moe_init_routing_v2_grad/op_host/moe_init_routing_v2_grad_def.cpp:42-54: ascend910b,
# ascend910_93, ascend950) with their vector (AIV) cores, as CANN's platform files give them
# (github:hicann/runtime 681ef7610, src/platform/platform_config/cann/Ascend910*.ini and
# cann-dev/Ascend950*.ini: vector_core_cnt). family -> {vector cores: SoC names}. The emulator's
# table (emulator/src/emu.h, emu_soc_vector_cores) is the same; a test compares them.
_FAMILY_SOCS: dict[str, dict[int, str]] = {
    "Ascend910B": {48: "Ascend910B1 Ascend910B2 Ascend910B2C", 40: "Ascend910B3 Ascend910B4 Ascend910B4-1"},
    "Ascend910_93": {40: "Ascend910_9362 Ascend910_9363 Ascend910_9372",
                     48: "Ascend910_9381 Ascend910_9382 Ascend910_9391 Ascend910_9392"},
    "Ascend950": {
        8: "Ascend950PR_950z", 16: "Ascend950DT_950x Ascend950DT_950y",
        56: "Ascend950PR_9579 Ascend950PR_957b Ascend950PR_957bx Ascend950PR_957c Ascend950PR_957d "
            + " ".join(f"Ascend950DT_957{i}" for i in range(1, 9)),
        64: "Ascend950PR_9589 Ascend950PR_958b Ascend950DT_9581 Ascend950DT_9581x Ascend950DT_9582 "
            "Ascend950DT_9582x " + " ".join(f"Ascend950DT_958{i}" for i in range(3, 9)),
        72: "Ascend950PR_9599 Ascend950DT_9591 Ascend950DT_9592 Ascend950DT_9595 Ascend950DT_9596 "
            "Ascend950DT_95A1 Ascend950DT_95A2",
    },
}
SOCS: dict[str, tuple[str, int]] = {name: (family, cores) for family, by_cores in _FAMILY_SOCS.items()
                                    for cores, names in by_cores.items() for name in names.split()}
# family -> (name prefixes CANN gives its SoCs, the family's default SoC, UB bytes a core (the
# same platform files: ub_size), the newest rules: summation, invalid index, forward relaxed).
# 8.5 named the 950 Ascend910_95 (ops-transformer v8.5.0 moe_init_routing_v2_def.cpp:142).
FAMILIES: dict[str, tuple[tuple[str, ...], str, int, str, str, bool]] = {
    "Ascend910B": (("Ascend910B",), "Ascend910B3", 196608, "tree", "fault", False),
    "Ascend910_93": (("Ascend910_93",), "Ascend910_9391", 196608, "tree", "fault", False),
    "Ascend950": (("Ascend950", "Ascend910_95"), "Ascend950PR_9599", 253952, "quads", "zero", True),
}


@dataclass(frozen=True)
class Chip:
    """One chip family's rules for this op pair as one release ships them, and the numbers
    the Ascend 950's tiling reads (docs/emulator.md, "Chips")."""

    family: str  # "Ascend910B" (Atlas A2), "Ascend910_93" (Atlas A3) or "Ascend950" (arch35)
    soc: str  # the SoC name, as aclrtGetSocName reports it
    vector_cores: int  # AIV cores (GetCoreNumAiv)
    ub_bytes: int  # unified buffer a core (GetCoreMemSize(UB))
    # The backward's sum: "tree" (the 910B kernel's partial buffers and pairwise tree), "quads"
    # (arch35 from 9.0.0-beta.2: from +0.0, ((a+b)+(c+d)) per four terms, the rest one by one,
    # K in chunks) or "sequential" (arch35 before: from +0.0, each term in turn).
    summation: str
    # A backward index outside the rows the scenario does not mark: "fault" (read outside the
    # input) or "zero" (arch35 from 9.1: read as a zero row, in its place among the terms).
    invalid_index: str
    forward_relaxed: bool  # the forward takes INT64 and 1-D expert ids and active_num <= 0
    release: str | None = None  # the ops release whose rules these are (None: the newest known)

    @property
    def arch35(self) -> bool:
        return self.family == "Ascend950"

    def describe(self) -> str:
        """One line for reports: the SoC, its family and what sets it apart."""
        if not self.arch35:
            return f"{self.soc} ({self.family})"
        rows = "invalid indices read as zero rows" if self.invalid_index == "zero" else "invalid indices fault"
        return (f"{self.soc} ({self.family}, arch35: {self.vector_cores} vector cores, {self.ub_bytes} bytes of UB; "
                f"{rows})")


def family_of(soc: str | None) -> str | None:
    """The family of a SoC name (None for a name no family of this op claims)."""
    if soc in SOCS:
        return SOCS[soc][0]
    return next((f for f, spec in FAMILIES.items() if soc and soc.startswith(spec[0])), None)


def chip_named(soc: str | None, release: str | None = None, **rules: Any) -> Chip:
    """The chip ``soc`` names (a SoC or a family name) with its family's newest rules, or
    ``rules``; a name no family claims (or None) gets the 910B's, the chip the op was first
    written for. A SoC of a family that CANN's platform files do not list gets its family's
    default SoC's figures."""
    family = family_of(soc) or "Ascend910B"
    _prefixes, default, ub, summation, invalid, relaxed = FAMILIES[family]
    name = soc if soc and family_of(soc) and soc != family else default
    cores = SOCS.get(name, SOCS[default])[1]
    return replace(Chip(family, name, cores, ub, summation, invalid, relaxed, release), **rules)


_A2 = chip_named(None)  # the rules where no chip is given: the 910B's

DATA_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float32),
)
INDEX_DTYPE = np.dtype(np.int32)
SCENARIOS = ("dropless", "active", "drop-pad")


# The one data-dtype rule of both ops; float64 is named because torch.autograd.gradcheck asks
# for it and the op cannot give it.
DATA_RULE = ("dtype must be float16, bfloat16 or float32, the dtypes the op computes in (float64, as "
             "torch.autograd.gradcheck uses, is not one: check gradients in float32 with a tolerance)")


def native(a: np.ndarray) -> np.ndarray:
    """The array in native byte order (a copy only if it was byte-swapped): the values are
    what matter, and CANN reads native order."""
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def scenario(drop_pad_mode: int, active_num: int) -> str:
    """'dropless', 'active' or 'drop-pad' for a (drop_pad_mode, active_num) pair."""
    if drop_pad_mode == 1:
        return "drop-pad"
    return "active" if active_num > 0 else "dropless"


def forward_scenario(drop_pad_mode: int, active_num: int) -> str:
    """The forward's scenario for its attributes, named as the backward's: an active_num other
    than 0 in dropless mode (the 950's negative one too) is 'active', whatever rows it keeps."""
    if drop_pad_mode == 1:
        return "drop-pad"
    return "active" if active_num != 0 else "dropless"


@dataclass(frozen=True)
class Geometry:
    """What the attributes and shapes imply."""

    tokens: int  # N: rows of the output
    hidden: int  # H
    rows: int  # rows of grad_expanded_x seen as [rows, H]
    scenario: str


def dtype_name(dt: np.dtype) -> str:
    """A dtype as the messages name it (ml_dtypes' bfloat16 as 'bfloat16')."""
    return "bfloat16" if dt == DATA_DTYPES[1] else str(dt)


def check_attributes(top_k: Any, drop_pad_mode: Any, active_num: Any) -> tuple[int, int, int]:
    """The three attributes as ints, or InvalidArgument."""
    k = _args.int64("top_k", top_k)
    mode = _args.int64("drop_pad_mode", drop_pad_mode)
    active = _args.int64("active_num", active_num)
    if k <= 0:
        raise InvalidArgument("top_k", f"must be greater than 0, got {k}")
    if mode not in (0, 1):
        raise InvalidArgument("drop_pad_mode", f"must be 0 (dropless or active) or 1 (drop/pad), got {mode}")
    if active < 0:
        raise InvalidArgument("active_num", f"must be 0 (not active) or positive, got {active}")
    return k, mode, active


def check_shapes(
    x_shape: tuple[int, ...],
    x_dtype: np.dtype,
    idx_shape: tuple[int, ...],
    idx_dtype: np.dtype,
    top_k: Any,
    drop_pad_mode: Any,
    active_num: Any,
    out_shape: tuple[int, ...] | None = None,
    out_dtype: np.dtype | None = None,
) -> Geometry:
    """Check dtypes, ranks, shapes and attributes against the contract."""
    k, mode, active = check_attributes(top_k, drop_pad_mode, active_num)
    if x_dtype not in DATA_DTYPES:
        raise InvalidArgument(
            "grad_expanded_x", f"{DATA_RULE}, got {dtype_name(x_dtype)}"
        )
    if idx_dtype != INDEX_DTYPE:
        raise InvalidArgument("expanded_row_idx", f"dtype must be int32, got {dtype_name(idx_dtype)}")
    if len(idx_shape) != 1:
        raise InvalidArgument("expanded_row_idx", f"must be 1-D [N*top_k], got shape {idx_shape}")
    bsk = idx_shape[0]
    if bsk == 0:
        raise InvalidArgument("expanded_row_idx", "must not be empty")
    if bsk % k:
        raise InvalidArgument("top_k", f"must divide len(expanded_row_idx) = {bsk}, got {k}")
    n = bsk // k
    scen = scenario(mode, active)
    if mode == 1:
        if len(x_shape) != 3:
            raise InvalidArgument("grad_expanded_x", f"must be 3-D [E, C, H] in drop/pad mode, got shape {x_shape}")
        rows = x_shape[0] * x_shape[1]
    else:
        if len(x_shape) != 2:
            raise InvalidArgument(
                "grad_expanded_x",
                f"must be 2-D [{'A' if active else 'N*top_k'}, H] in {scen} mode, got shape {x_shape}",
            )
        rows = x_shape[0]
        if active == 0 and rows != bsk:
            raise InvalidArgument(
                "grad_expanded_x", f"must have len(expanded_row_idx) = {bsk} rows in dropless mode, got {rows}"
            )
        if active > 0 and rows != active:
            raise InvalidArgument("grad_expanded_x", f"must have active_num = {active} rows in active mode, got {rows}")
    h = x_shape[-1]
    if h <= 0:
        raise InvalidArgument("grad_expanded_x", f"hidden size (last dimension) must be positive, got {h}")
    if out_shape is not None:
        if out_dtype is not None and out_dtype != x_dtype:
            raise InvalidArgument(
                "out", f"dtype must match grad_expanded_x ({dtype_name(x_dtype)}), got {dtype_name(out_dtype)}"
            )
        if tuple(out_shape) != (n, h):
            raise InvalidArgument("out", f"must have shape (N, H) = ({n}, {h}), got {tuple(out_shape)}")
    return Geometry(n, h, rows, scen)


def zero_rows(idx: np.ndarray, geometry: Geometry, top_k: int, active_num: int, chip: Chip) -> np.ndarray | None:
    """Where the kernel reads a zero row instead of a row of grad_expanded_x (a bool mask the
    shape of ``idx``), or None where there is none: the scenario's marks (-1 in drop/pad mode,
    >= active_num in active mode) on every chip, and on a chip whose invalid indices read as
    zero rows (the 950 from 9.1) every index outside the rows but one past the end in drop/pad
    mode, which it reads outside the input."""
    v = np.asarray(idx)
    scen = geometry.scenario
    if scen == "drop-pad":
        mask = v < 0 if chip.invalid_index == "zero" else v == -1
    elif scen == "active":
        mask = (v >= active_num) | (v < 0) if chip.invalid_index == "zero" else v >= active_num
    else:
        mask = (v < 0) | (v >= geometry.tokens * top_k) if chip.invalid_index == "zero" else None
    return mask if mask is not None and mask.any() else None


def check_indices(idx: np.ndarray, geometry: Geometry, top_k: int, active_num: int, chip: Chip = _A2) -> None:
    """Check index values on the host: range and uniqueness for the scenario, on ``chip``."""
    v = np.asarray(idx).ravel()
    if not v.size:
        return
    scen = geometry.scenario
    drop_pad = scen == "drop-pad"
    zero = chip.invalid_index == "zero"
    if drop_pad:
        hi, what = geometry.rows, "-1 or a row of the flattened [E*C] rows"
    else:
        hi, what = geometry.tokens * top_k, "a position in [0, N*top_k)"
    # The common case costs a min and a max; the masks are made only to name a bad value.
    low, high = int(v.min()), int(v.max())
    read_as_zero = zero_rows(v, geometry, top_k, active_num, chip) if zero else None
    if (low < (-1 if drop_pad else 0) or high >= hi) and not (zero and scen != "drop-pad"):
        v64 = v.astype(np.int64)
        counted = ~read_as_zero if read_as_zero is not None else (
            v64 != -1 if drop_pad else np.ones(v64.shape, dtype=bool))
        bad = counted & ((v64 < 0) | (v64 >= hi))
        if bad.any():
            pos = int(np.argmax(bad))
            hint = " (-1 marks a dropped slot only in drop/pad mode)" if v64[pos] == -1 else ""
            arch35 = "" if zero or (drop_pad and v64[pos] >= 0) else (
                f"; on {chip.soc} ({chip.family}) the kernel reads outside the input there: the Ascend950 from CANN "
                "9.1 reads such an index as a zero row")
            raise InvalidArgument(
                "expanded_row_idx",
                f"value {int(v64[pos])} at position {pos} is out of range: in {scen} mode each index must be "
                f"{what} (0 <= index < {hi}){hint}{arch35}",
            )
    if read_as_zero is not None:
        v = v[~read_as_zero]
        low = int(v.min()) if v.size else 0
    kept = v[v != -1] if drop_pad and low == -1 else v
    if kept.size:
        counts = np.bincount(kept, minlength=1)
        if counts.max(initial=0) > 1:
            dup = int(np.argmax(counts))
            positions = np.flatnonzero(v == dup)[:2].tolist()
            raise InvalidArgument(
                "expanded_row_idx",
                f"value {dup} appears more than once (positions {positions[0]} and {positions[1]}): "
                "indices must be unique" + (" apart from -1" if drop_pad else ""),
            )


# ---------------------------------------------------------------------------- the forward op

_ROUTING_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))


def _on(chip: Chip) -> str:
    return f"on {chip.soc} ({chip.family})"


def check_routing(x_shape: tuple[int, ...], x_dtype: Any, idx_shape: tuple[int, ...], idx_dtype: Any,
                  active_num: int, expert_capacity: int, expert_num: int, drop_pad_mode: int,
                  count_flag: int, chip: Chip = _A2) -> None:
    """aclnnMoeInitRoutingV2's documented contract on shapes, dtypes and attributes (the binding
    and the reference both check it), naming the parameter of each rule. The Ascend950 also
    takes INT64 and 1-D expert ids (K = 1) and an active_num <= 0 (ops-transformer
    op_api/aclnn_moe_init_routing_v2.cpp:40-41, 126-128; op_host/moe_init_routing_v2_tiling.cpp:180-184,
    387-397)."""
    if len(x_shape) != 2:
        raise InvalidArgument("x", f"must be 2-D [N, H], got shape {x_shape}")
    if np.dtype(x_dtype) not in _ROUTING_DTYPES:
        raise InvalidArgument("x", f"{DATA_RULE}, got {dtype_name(np.dtype(x_dtype))}")
    if len(idx_shape) == 1 and idx_shape[0] == x_shape[0] and not chip.forward_relaxed:
        raise InvalidArgument("expert_idx", f"must be 2-D [N, K] {_on(chip)}: only the Ascend950 takes a 1-D "
                                            f"[N] (as K = 1), got shape {idx_shape}")
    if len(idx_shape) not in (1, 2) or idx_shape[0] != x_shape[0]:
        what = "2-D [N, K] or 1-D [N]" if chip.forward_relaxed else "2-D [N, K]"
        raise InvalidArgument("expert_idx", f"must be {what} with N = {x_shape[0]} (x's rows), got shape "
                                            f"{idx_shape}")
    if np.dtype(idx_dtype) == np.int64 and not chip.forward_relaxed:
        raise InvalidArgument("expert_idx", f"dtype must be int32 {_on(chip)}: only the Ascend950 takes int64, "
                                            "got int64")
    if np.dtype(idx_dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise InvalidArgument("expert_idx", f"dtype must be int32{' or int64' if chip.forward_relaxed else ''}, "
                                            f"got {idx_dtype}")
    if drop_pad_mode not in (0, 1):
        raise InvalidArgument("drop_pad_mode", f"must be 0 (dropless/active) or 1 (drop/pad), got {drop_pad_mode}")
    if count_flag not in (0, 1, 2):
        raise InvalidArgument("expert_tokens_count_or_cumsum_flag",
                              f"must be 0, 1 (cumsum) or 2 (count), got {count_flag}")
    if active_num < 0 and not chip.forward_relaxed:
        raise InvalidArgument("active_num", f"must not be negative {_on(chip)}: only the Ascend950 takes one "
                                            f"(N*K + active_num rows), got {active_num}")
    for name, value in (("expert_capacity", expert_capacity), ("expert_num", expert_num)):
        if value < 0:
            raise InvalidArgument(name, f"must not be negative, got {value}")
    if drop_pad_mode == 1:
        if expert_capacity < 1 or expert_num < 1:
            raise InvalidArgument("expert_capacity", "drop/pad mode needs expert_capacity and expert_num above 0")
    elif count_flag and expert_num < 1:
        raise InvalidArgument("expert_num", "a count output (expert_tokens_count_or_cumsum_flag 1 or 2) needs "
                                            "expert_num above 0")


ROUTING_OUTPUTS = ("expanded_x", "expanded_row_idx", "expert_tokens_count_or_cumsum", "expert_tokens_before_capacity")


def routing_outputs(n: int, k: int, h: int, x_dtype: Any, active_num: int, expert_capacity: int, expert_num: int,
                    drop_pad_mode: int, count_flag: int, before_flag: bool) -> dict[str, Any]:
    """What aclnnMoeInitRoutingV2 writes for N tokens of K ids and H columns: each output's
    (shape, dtype), None where the scenario writes none. A negative attribute (unchecked)
    gives an empty dimension, not a negative one, so that the vendor sees it and refuses it."""
    total, num, cap = n * k, max(expert_num, 0), max(expert_capacity, 0)
    # 0: every row; a negative one (the 950's: N*K + active_num), floored at 0 (where it is
    # refused, an empty dimension the vendor sees and refuses as well).
    rows = max(min(total + active_num if active_num <= 0 else active_num, total), 0) if active_num else total
    i32 = np.dtype(np.int32)
    return {
        "expanded_x": ((num, cap, h) if drop_pad_mode == 1 else (rows, h), np.dtype(x_dtype)),
        "expanded_row_idx": ((total,), i32),
        "expert_tokens_count_or_cumsum": ((num,), i32) if drop_pad_mode == 0 and count_flag else None,
        "expert_tokens_before_capacity": ((num,), i32) if drop_pad_mode == 1 and before_flag else None,
    }


def check_routing_call(x_shape: tuple[int, ...], x_dtype: Any, idx_shape: tuple[int, ...], idx_dtype: Any,
                       attrs: tuple[int, int, int, int, int, bool], chip: Chip = _A2) -> dict[str, Any]:
    """:func:`check_routing`, the vendor's tiling rule on the capacity, and outputs that can be
    addressed: what :func:`routing_outputs` gives."""
    active, cap, num, mode, flag, _ = attrs
    check_routing(x_shape, x_dtype, idx_shape, idx_dtype, active, cap, num, mode, flag, chip)
    if mode == 1 and cap > x_shape[0]:  # the vendor's tiling rule; the reference computes any capacity
        raise InvalidArgument("expert_capacity", f"must be at most N = {x_shape[0]}, got {cap}")
    outs = routing_outputs(x_shape[0], top_k_of(idx_shape), x_shape[1], x_dtype, *attrs)
    for name, want in outs.items():
        # The vendor sets no bound on expert_num, but the outputs it sizes must be addressable:
        # only it makes an output bigger than the inputs, bar mode 0's N*K rows.
        if want is not None:
            by_x = name == "expanded_x" and mode == 0
            _args.nbytes(name if by_x else "expert_num", want[0], want[1].itemsize, makes="" if by_x else name)
    return outs


def top_k_of(idx_shape: tuple[int, ...]) -> int:
    """K of an expert_idx shape: its second dimension, 1 for the 950's 1-D ids."""
    return idx_shape[1] if len(idx_shape) == 2 else 1


def check_expert_ids(ids: np.ndarray, expert_num: int, drop_pad_mode: int, count_flag: int) -> None:
    """The ids' documented range: [0, expert_num) when drop/pad or a count output uses them as
    expert numbers, else not negative."""
    if not ids.size:
        return
    counted = drop_pad_mode == 1 or count_flag != 0
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (counted and hi >= expert_num):
        bound = f"[0, expert_num = {expert_num})" if counted else "[0, ...)"
        raise InvalidArgument("expert_idx", f"ids must be in {bound}, got {lo} to {hi}")
