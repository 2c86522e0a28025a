"""Random inputs for the op in each scenario, and the comparison of a result with the
reference. Pure NumPy: used by the CLI, the conformance harness, the benchmarks and the tests.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .._contract import scenario as scenario_of

DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
}

@dataclass(frozen=True)
class Standard:
    """A precision standard for one output dtype.

    An element is within tolerance when ``|actual - expected| <= atol + rtol * scale``, where
    ``scale`` is ``|expected|``, or, when the magnitude of the summed terms is known, the larger
    of ``|expected|`` and ``sum |term|`` (cancellation makes any float32 summation order lose
    accuracy relative to the result, never relative to the terms). A result passes when the
    share of elements outside tolerance is at most ``max_share`` and no element is off by more
    than ``hard_factor`` times its tolerance. NaN must match NaN, infinities must be equal.
    See docs/conformance.md for where the numbers come from.
    """

    rtol: float
    atol: float
    max_share: float
    hard_factor: float = 10.0


STANDARDS: dict[str, Standard] = {
    "float32": Standard(rtol=1e-4, atol=1e-4, max_share=1e-4),
    "float16": Standard(rtol=1e-3, atol=1e-3, max_share=1e-3),
    "bfloat16": Standard(rtol=4e-3, atol=4e-3, max_share=4e-3),
}


def dtype_name(dtype: Any) -> str:
    dt = np.dtype(dtype)
    for name, d in DTYPES.items():
        if d == dt:
            return name
    return str(dt)


@dataclass
class Case:
    """One input set: arrays plus attributes."""

    grad_expanded_x: np.ndarray
    expanded_row_idx: np.ndarray
    top_k: int
    drop_pad_mode: int = 0
    active_num: int = 0

    @property
    def scenario(self) -> str:
        return scenario_of(self.drop_pad_mode, self.active_num)

    @property
    def tokens(self) -> int:
        return int(self.expanded_row_idx.shape[0]) // self.top_k

    def args(self) -> tuple[Any, ...]:
        return (self.grad_expanded_x, self.expanded_row_idx, self.top_k, self.drop_pad_mode, self.active_num)


def random_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Standard-normal values in ``dtype`` (bfloat16 via ml_dtypes)."""
    return rng.standard_normal(shape, dtype=np.float32).astype(np.dtype(dtype))


def drop_pad_indices(rng: np.random.Generator, tokens: int, top_k: int, experts: int, capacity: int) -> np.ndarray:
    """Route each (token, k) slot to a random expert; slots past an expert's capacity are
    dropped (-1). Values address the flattened [experts * capacity] rows."""
    experts_of = rng.integers(0, experts, size=tokens * top_k)
    idx = np.full(tokens * top_k, -1, dtype=np.int32)
    fill = np.zeros(experts, dtype=np.int64)
    for slot in rng.permutation(tokens * top_k):
        e = experts_of[slot]
        if fill[e] < capacity:
            idx[slot] = e * capacity + fill[e]
            fill[e] += 1
    return idx


def x_shape(tokens: int, top_k: int, hidden: int, mode: str = "dropless", active_num: int | None = None,
            experts: int | None = None, capacity: int | None = None) -> tuple[int, ...]:
    """The shape of grad_expanded_x that make_case makes, with its defaults filled in."""
    bsk = tokens * top_k
    if mode == "dropless":
        return (bsk, hidden)
    if mode == "active":
        return (active_num if active_num is not None else max(1, bsk // 2), hidden)
    if mode == "drop-pad":
        e = experts if experts is not None else 8
        return (e, capacity if capacity is not None else max(1, bsk // e), hidden)
    raise ValueError(f"mode must be 'dropless', 'active' or 'drop-pad', not {mode!r}")


def make_case(
    tokens: int,
    top_k: int,
    hidden: int,
    dtype: Any = "float32",
    mode: str = "dropless",
    active_num: int | None = None,
    experts: int | None = None,
    capacity: int | None = None,
    seed: int = 0,
) -> Case:
    """A random valid case of the given scenario ('dropless', 'active' or 'drop-pad')."""
    shape = x_shape(tokens, top_k, hidden, mode, active_num, experts, capacity)
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    bsk = tokens * top_k
    if mode == "dropless":
        idx = rng.permutation(bsk).astype(np.int32)
        return Case(random_values(rng, shape, dt), idx, top_k)
    if mode == "active":
        idx = rng.permutation(bsk).astype(np.int32)
        return Case(random_values(rng, shape, dt), idx, top_k, 0, shape[0])
    idx = drop_pad_indices(rng, tokens, top_k, shape[0], shape[1])
    return Case(random_values(rng, shape, dt), idx, top_k, 1, 0)


def too_large(tokens: int, top_k: int, hidden: int, dtype: str = "float32", mode: str = "dropless",
              active_num: int | None = None, experts: int | None = None, capacity: int | None = None,
              memory: int | None = None) -> str | None:
    """Why make_case and one op call on these sizes cannot work, or None. Only the certain
    cases: a row the int32 expanded_row_idx cannot address, or inputs and output that alone
    exceed ``memory`` (default: this machine's physical memory). The run needs more than that
    (the float32 draw, device copies, the reference), so a None is no promise it fits, but a
    refusal never turns away a size that could have run."""
    shape = x_shape(tokens, top_k, hidden, mode, active_num, experts, capacity)
    rows = tokens * top_k if mode != "drop-pad" else shape[0] * shape[1]
    if rows > np.iinfo(np.int32).max:
        return f"{rows} rows to address, more than the int32 expanded_row_idx can ({np.iinfo(np.int32).max})"
    item = DTYPES[dtype].itemsize
    need = math.prod(shape) * item + tokens * top_k * 4 + tokens * hidden * item
    memory = physical_memory() if memory is None else memory
    if need > memory:
        return (f"the inputs and the output alone need {need} bytes ({size_text(need)}), more than the "
                f"{size_text(memory)} of memory this machine has")
    return None


def physical_memory() -> int:
    """Bytes of RAM on this machine (swap not counted: a run that lives in it never ends)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def size_text(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"


@dataclass
class Comparison:
    passed: bool
    max_abs_error: float
    max_rel_error: float
    mismatches: int
    elements: int
    rtol: float
    atol: float
    max_share: float
    hard_factor: float = 10.0
    # The worst element's error in units of its own tolerance (atol + rtol * scale): above 1 it
    # is outside tolerance, above hard_factor it fails the result alone. inf for a wrong NaN
    # or infinity, or an error where the tolerance is 0.
    worst: float = 0.0
    exact: bool = False  # judged bit for bit (compare_exact), not by the tolerances

    @property
    def share(self) -> float:
        """The share of elements outside tolerance (or, when exact, with other bits)."""
        return self.mismatches / self.elements if self.elements else 0.0

    def verdict(self) -> str:
        """The criterion that decided, in words, so a figure never reads against its verdict."""
        if self.exact:
            return (f"{self.mismatches} of {self.elements} elements differ in their bits from the reference "
                    f"(exact: none may)")
        outside = (f"{self.mismatches} of {self.elements} elements ({self.share:.3%}) outside "
                   f"rtol={self.rtol:g} atol={self.atol:g}, at most {self.max_share:.3%} allowed")
        worst = "worst element off by a wrong NaN or infinity" if self.worst == float("inf") else \
            f"worst element at {self.worst:.3g}x its tolerance, at most {self.hard_factor:g}x allowed"
        return f"{outside}; {worst}"

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def compare(
    actual: np.ndarray,
    expected: np.ndarray,
    dtype: Any = None,
    *,
    scale: np.ndarray | None = None,
    standard: Standard | None = None,
) -> Comparison:
    """Compare a result with the reference under the dtype's :class:`Standard`.

    ``scale`` (optional, same shape): the sum of the absolute values of the terms behind each
    element, for cases built to cancel. ``max_rel_error`` is relative to ``|expected|``.
    """
    name = dtype_name(dtype if dtype is not None else expected.dtype)
    std = standard or STANDARDS.get(name, Standard(0.0, 0.0, 0.0))
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    if a.shape != e.shape:
        return Comparison(False, float("inf"), float("inf"), e.size, e.size, std.rtol, std.atol, std.max_share,
                          std.hard_factor, float("inf"))
    finite = np.isfinite(a) & np.isfinite(e)
    special_ok = (np.isnan(a) & np.isnan(e)) | (a == e)
    mag = np.abs(e)
    if scale is not None:
        mag = np.maximum(mag, np.abs(np.asarray(scale, dtype=np.float64)))
    allowed = std.atol + std.rtol * np.where(finite, mag, 0.0)
    with np.errstate(invalid="ignore"):
        diff = np.where(finite, np.abs(a - e), 0.0)
    bad = np.where(finite, diff > allowed, ~special_ok)
    gross = np.where(finite, diff > std.hard_factor * allowed, ~special_ok)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(finite & (e != 0), diff / np.abs(e), 0.0)
        units = np.where(diff == 0, 0.0, diff / allowed)
    wrong_special = bool((~finite & ~special_ok).any())
    mismatches = int(bad.sum())
    return Comparison(
        passed=not gross.any() and mismatches <= std.max_share * e.size,
        max_abs_error=float(diff.max(initial=0.0)) if not wrong_special else float("inf"),
        max_rel_error=float(rel.max(initial=0.0)),
        mismatches=mismatches,
        elements=int(e.size),
        rtol=std.rtol,
        atol=std.atol,
        max_share=std.max_share,
        hard_factor=std.hard_factor,
        worst=float("inf") if wrong_special else float(units.max(initial=0.0)),
    )


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def compare_exact(actual: np.ndarray, expected: np.ndarray) -> Comparison:
    """Compare bit for bit: an element matches when its bits equal the reference's, the sign of
    zero included, except that any NaN matches any NaN (IEEE 754 leaves the payload and sign of
    a computed NaN to the hardware, and the reference runs on another one). The figures
    (errors, worst) are those of :func:`compare` under the dtype's standard, for information."""
    a, e = np.ascontiguousarray(actual), np.ascontiguousarray(expected)
    figures = compare(a, e, e.dtype)
    if a.shape != e.shape or a.dtype != e.dtype:
        differ = e.size
    else:
        uint = _UINT[e.dtype.itemsize]
        nan = np.isnan(a.astype(np.float32)) & np.isnan(e.astype(np.float32))
        differ = int(np.count_nonzero((a.view(uint) != e.view(uint)) & ~nan))
    figures.passed, figures.mismatches, figures.exact = differ == 0, differ, True
    figures.rtol = figures.atol = figures.max_share = 0.0
    return figures
