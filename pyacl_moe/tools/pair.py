"""Conformance of the forward, aclnnMoeInitRoutingV2, and of the forward and backward as a pair.

Forward cases: positive (every output equal to the golden reference bit for bit: expandedX
holds copies of token rows, the others are integers), negative (the vendor's refusals, from
CANN's own first phase, with their codes) and determinism (two launches, the same bits).

Pair cases need no golden reference at all: they check the vendor's backward against the
vendor's forward, with nothing of pyacl_moe in between, through two identities that hold for
any x and g:

- adjoint: <forward(x), g> = <x, backward(g)>, summed over the slots the forward keeps (the
  backward reads exactly those). Computed in float64 from the device's outputs, for each token
  (x restricted to one token's row, so that one wrong row cannot hide in a large sum) within a
  bound derived from float32 accumulation of at most K terms and one rounding to the dtype.
  g is built so that each token's terms cancel (large values of both signs plus small noise):
  the exact result is small, and an accumulation in less than float32 shows.
- round trip: backward(forward(x)) = K*x, exactly, where every slot is kept (distinct experts
  per token; active_num = N*K; the capacity of the busiest expert). x is chosen so that every partial sum j*x
  (j <= K) is exact in the dtype, so that no rounding mode is assumed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import reference
from ..array import DeviceArray, empty, to_device
from ..device import chip
from ..errors import AclError
from ..op.moe_init_routing_v2 import RoutingResult, get_workspace_size, moe_init_routing_v2
from ..op.moe_init_routing_v2_grad import moe_init_routing_v2_grad
from . import cases as _cases
from . import precision
from .harness import ARCH35_ACCEPTS, Case, CaseResult, Context, digest

__all__ = ["FORWARD_SCENARIOS", "catalogue"]

DTYPES = ("float32", "float16", "bfloat16")

# The forward's scenarios: attributes besides expert_num (capacity and active_num come from
# the shape).
FORWARD_SCENARIOS: dict[str, dict[str, Any]] = {
    "dropless": {},
    "dropless-cumsum": {"expert_tokens_count_or_cumsum_flag": 1},
    "dropless-count": {"expert_tokens_count_or_cumsum_flag": 2},
    "active": {"active": True, "expert_tokens_count_or_cumsum_flag": 2},
    "drop-pad": {"drop_pad_mode": 1},
    "drop-pad-before": {"drop_pad_mode": 1, "expert_tokens_before_capacity_flag": True},
}


@dataclass(frozen=True)
class Shape:
    tokens: int
    k: int
    hidden: int
    experts: int


# ---------------------------------------------------------------------------- inputs

def _attrs(scenario: str, s: Shape, keep_for: np.ndarray | None = None) -> dict[str, Any]:
    """The forward's attributes for a scenario: some slots dropped or skipped, or, given the
    expert ids ``keep_for``, every slot kept (active_num N*K; the capacity of the busiest
    expert, at most N with distinct experts per token)."""
    keep_all = keep_for is not None
    base = dict(FORWARD_SCENARIOS[scenario])
    attrs: dict[str, Any] = {"expert_num": s.experts}
    if base.pop("active", False):
        attrs["active_num"] = s.tokens * s.k if keep_all else max(1, s.tokens * s.k // 2)
    if base.get("drop_pad_mode") == 1:
        attrs["expert_capacity"] = max(1, int(np.bincount(keep_for.ravel()).max())) if keep_for is not None \
            else max(1, min(s.tokens, s.tokens * s.k // s.experts))
    attrs.update(base)
    return attrs


def _expert_ids(rng: np.random.Generator, s: Shape, distinct: bool) -> np.ndarray:
    """[N, K] int32 expert ids: each token's K distinct experts (as a top-k gives), or any
    ids with repeats (equal ids must keep their order)."""
    if distinct:
        return np.argsort(rng.random((s.tokens, s.experts)), axis=1)[:, :s.k].astype(np.int32)
    return rng.integers(0, s.experts, (s.tokens, s.k)).astype(np.int32)


_PRECISION = {"float32": 24, "float16": 11, "bfloat16": 8}
# Exponents for the round trip's x: wide where the dtype allows (values float16 cannot hold
# show an accumulation in float16), within range where it does not.
_EXPONENTS = {"float32": (-20, 20), "float16": (-12, 4), "bfloat16": (-30, 30)}


def _exact_multiples(rng: np.random.Generator, shape: tuple[int, int], dtype: str, k: int) -> np.ndarray:
    """Values m * 2**e whose multiples j*x, j <= k, are all exact in ``dtype``: |m| has at most
    precision - ceil(log2 k) bits."""
    bits = _PRECISION[dtype] - max(1, math.ceil(math.log2(k)))
    m = rng.integers(1, 2 ** bits, shape) * rng.choice(np.array([-1, 1]), shape)
    lo, hi = _EXPONENTS[dtype]
    e = rng.integers(lo, hi + 1, shape)
    out: np.ndarray = np.ldexp(m.astype(np.float64), e).astype(_cases.DTYPES[dtype])
    return out


# g's large values, exact in the dtype: a token's partial sums carry one while the small
# terms are added, which loses them in anything narrower than float32 (float16 cannot hold
# bfloat16's at all); and the scale of the small terms.
_BIG = {"float32": 2.0 ** 13, "float16": 2.0 ** 10, "bfloat16": 2.0 ** 17}
_SMALL = {"float32": 1.0, "float16": 0.125, "bfloat16": 1.0}


def _cancelling_gradient(rng: np.random.Generator, rows: int, hidden: int, dtype: str, ri: np.ndarray,
                         kept: np.ndarray, k: int) -> np.ndarray:
    """g [rows, H] of small terms, except that each token with three kept slots or more
    carries +B and -B on its first and last (B exact, its sign drawn per column): the exact
    sums are small, and whatever the order of the backward's additions, a partial sum holds B
    while small terms come in. (Two terms are rounded once in any precision: nothing to show
    there, and a pair +B, -B alone would hide a wrong row of x.)"""
    g = rng.standard_normal((rows, hidden), dtype=np.float32) * np.float32(_SMALL[dtype])
    keep = kept.reshape(-1, k)
    slots = ri.reshape(-1, k)
    m = keep.sum(axis=1)
    rank = np.cumsum(keep, axis=1) - 1
    tokens = np.nonzero(m >= 3)[0]
    first = slots[tokens, np.argmax(keep[tokens] & (rank[tokens] == 0), axis=1)]
    last = slots[tokens, np.argmax(keep[tokens] & (rank[tokens] == (m[tokens] - 1)[:, None]), axis=1)]
    big = rng.choice(np.array([-1.0, 1.0], np.float32), size=(tokens.size, hidden)) * np.float32(_BIG[dtype])
    g[first] = big
    g[last] = -big
    return g.astype(_cases.DTYPES[dtype])


# ---------------------------------------------------------------------------- shared steps

def _forward_on_device(ctx: Context, x: np.ndarray, ids: np.ndarray, attrs: dict[str, Any]
                       ) -> tuple[DeviceArray, DeviceArray, RoutingResult]:
    s = ctx.stream
    dx, di = to_device(x, stream=s), to_device(ids, stream=s)
    r = ctx.measured(moe_init_routing_v2, dx, di, **attrs, stream=s)
    return dx, di, r


def _backward_args(attrs: dict[str, Any], k: int) -> tuple[int, int, int]:
    mode = attrs.get("drop_pad_mode", 0)
    return k, mode, attrs.get("active_num", 0) if mode == 0 else 0


def _kept(ri: np.ndarray, rows: int, mode: int) -> tuple[np.ndarray, str]:
    """Which positions the forward kept (the backward reads those), and what is wrong with
    expanded_row_idx as a layout ("" if nothing): kept slots must be distinct rows of
    expanded_x; in mode 0 every position gets a distinct slot number."""
    if mode == 0:
        if ri.size and not np.array_equal(np.sort(ri), np.arange(ri.size)):
            return np.zeros(ri.size, bool), "expanded_row_idx is not a permutation of the slots"
        return ri < rows, ""
    kept = ri >= 0
    if np.any(ri < -1) or np.any(ri >= rows):
        return kept, f"expanded_row_idx has values outside -1 .. {rows - 1}"
    if np.unique(ri[kept]).size != int(kept.sum()):
        return kept, "expanded_row_idx gives two positions the same slot"
    return kept, ""


def _shape_text(s: Shape) -> str:
    return f"N={s.tokens} K={s.k} H={s.hidden} E={s.experts}"


def _nbytes(dtype: str, s: Shape, factor: float = 3.0) -> int:
    return int(s.tokens * s.k * s.hidden * _cases.DTYPES[dtype].itemsize * factor) + s.tokens * s.k * 16


# ---------------------------------------------------------------------------- forward cases

def _host_outputs(r: RoutingResult, stream: Any) -> list[np.ndarray | None]:
    return [None if a is None else a.to_host(stream) for a in r]


def _outputs_digest(outs: list[np.ndarray | None]) -> str:
    return digest(np.concatenate([np.ascontiguousarray(o).view(np.uint8).reshape(-1) for o in outs
                                  if o is not None]))


def _forward_positive(name: str, dtype: str, scenario: str, shape: Shape) -> Case:
    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        rng = ctx.rng(name)
        x = _cases.random_values(rng, (shape.tokens, shape.hidden), _cases.DTYPES[dtype])
        ids = _expert_ids(rng, shape, distinct=False)
        attrs = _attrs(scenario, shape)
        _, _, r = _forward_on_device(ctx, x, ids, attrs)
        got = _host_outputs(r, ctx.stream)
        want = reference.moe_init_routing_v2(x, ids, **attrs, chip=chip())
        wrong: list[str] = []
        differ = elements = 0
        for field, g, w in zip(RoutingResult._fields, got, want):
            if (g is None) != (w is None):
                wrong.append(f"{field} {'missing' if g is None else 'not expected'}")
                continue
            if g is None or w is None:
                continue
            elements += w.size
            if g.shape != w.shape or g.dtype != w.dtype:
                wrong.append(f"{field} is {g.shape} {g.dtype}, expected {w.shape} {w.dtype}")
                differ += w.size
                continue
            n = int(np.count_nonzero(g.view(np.uint8).reshape(w.size, -1) != w.view(np.uint8).reshape(w.size, -1))
                    if w.size else 0)
            if n:
                wrong.append(f"{field}: {n} of {w.size} elements differ in their bits from the reference")
                differ += n
        # The forward only moves data: its outputs are judged bit for bit under every standard
        # (as the test kit judges pure data movement); the metrics are expanded_x's.
        m = None
        if got[0] is not None and want[0] is not None and got[0].shape == want[0].shape:
            j = precision.judge("exact", got[0], want[0], dtype)
            m = j.metrics
        return CaseResult(name, "positive", dtype, scenario, _shape_text(shape), not wrong,
                          time.perf_counter() - t0, mismatches=differ, elements=elements,
                          detail="; ".join(wrong), digest=_outputs_digest(got),
                          max_abs_error=m["max_abs_error"] if m else None,
                          max_rel_error=m["max_rel_error"] if m else None,
                          standard="exact", thresholds={}, metrics=m)

    return Case(name, "positive", dtype, scenario, _shape_text(shape), body, nbytes=_nbytes(dtype, shape),
                op="forward", judged_by="reference")


def _forward_determinism(name: str, dtype: str, scenario: str, shape: Shape) -> Case:
    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        rng = ctx.rng(name)
        x = _cases.random_values(rng, (shape.tokens, shape.hidden), _cases.DTYPES[dtype])
        ids = _expert_ids(rng, shape, distinct=False)  # many ties: their order must not vary
        attrs = _attrs(scenario, shape)
        dx, di, r1 = _forward_on_device(ctx, x, ids, attrs)
        r2 = moe_init_routing_v2(dx, di, **attrs, stream=ctx.stream)
        a, b = _host_outputs(r1, ctx.stream), _host_outputs(r2, ctx.stream)
        same = _outputs_digest(a) == _outputs_digest(b)
        return CaseResult(name, "determinism", dtype, scenario, _shape_text(shape), same,
                          time.perf_counter() - t0, detail="" if same else "two launches differ",
                          digest=_outputs_digest(a))

    return Case(name, "determinism", dtype, scenario, _shape_text(shape), body,
                nbytes=2 * _nbytes(dtype, shape), op="forward", judged_by="rerun")


@dataclass(frozen=True)
class Neg:
    """A forward first phase and the status it must give (0: accepted). Shapes None: a null
    pointer."""

    x: tuple[int, ...] | None = (4, 3)
    x_dtype: str = "float32"
    idx: tuple[int, ...] | None = (4, 2)
    idx_dtype: str = "int32"
    ex: tuple[int, ...] | None = (8, 3)
    ex_dtype: str | None = None  # None: x's
    ri: tuple[int, ...] | None = (8,)
    ri_dtype: str = "int32"
    cnt: tuple[int, ...] | None = None
    cnt_dtype: str = "int32"
    bc: tuple[int, ...] | None = None
    attrs: tuple[int, int, int, int, int, bool] = (0, 0, 0, 0, 0, False)  # active, cap, num, mode, flag, before
    small_buffer: bool = False  # describe every tensor over one 1 MiB buffer (the first phase reads none)


def _forward_negative(name: str, status: int | str, spec: Neg, why: str, source: str) -> Case:
    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        dev = ctx.stream.device

        small = empty((1 << 20,), np.uint8, dev) if spec.small_buffer else None

        def make(shape: tuple[int, ...] | None, dtype: str) -> DeviceArray | None:
            if shape is None:
                return None
            if small is not None:
                return DeviceArray.from_pointer(small.data_ptr, shape, dtype, owner=small, device=dev)
            return empty(shape, dtype, dev)

        arrays = (make(spec.x, spec.x_dtype), make(spec.idx, spec.idx_dtype),
                  make(spec.ex, spec.ex_dtype or spec.x_dtype), make(spec.ri, spec.ri_dtype),
                  make(spec.cnt, spec.cnt_dtype), make(spec.bc, "int32"))
        got: int = 0
        text = ""
        want = ctx.expected(status)
        try:
            _, executor = ctx.measured(get_workspace_size, arrays[0], arrays[1], *spec.attrs, *arrays[2:], device=dev)
            executor.close()
        except AclError as exc:
            got, text = exc.status, exc.message
        passed = got == want
        detail = why if passed else f"expected {want}, CANN returned {got}" + (f": {text}" if text else "")
        return CaseResult(name, "negative", spec.x_dtype, "-", f"x{list(spec.x) if spec.x else None}", passed,
                          time.perf_counter() - t0, expected_status=want, status=got, detail=detail)

    return Case(name, "negative", spec.x_dtype, "-", "", body, source=source, op="forward", judged_by="status")


def _forward_negatives() -> list[Case]:
    """The forward's refusals: "op" for the tiling's checks (op_host/moe_init_routing_v2_tiling.cpp
    of moe_init_routing_v2), "nnopbase" for the generic layer's (null pointers, the support
    list from moe_init_routing_v2_def.cpp, every output empty: inferred). Where the releases
    differ the status names the field of the release's behaviour (pyacl_moe.release)."""
    P, T, M, N, OK = "dtype_status", "tiling_status", "mixed_dtype_status", 161001, 0
    A = ARCH35_ACCEPTS

    def neg(name: str, status: int | str, why: str, source: str = "op", **spec: Any) -> Case:
        return _forward_negative(f"fwd-neg-{name}", status, Neg(**spec), why, source)

    def nnop(name: str, status: int | str, why: str, **spec: Any) -> Case:
        return neg(name, status, why, "nnopbase", **spec)

    return [
        nnop("null-x", N, "null x", x=None),
        nnop("null-expert-idx", N, "null expertIdx", idx=None),
        nnop("null-expanded-x", N, "null expandedXOut", ex=None),
        nnop("null-expanded-row-idx", N, "null expandedRowIdxOut", ri=None),
        nnop("x-int32", P, "x int32", x_dtype="int32", ex_dtype="int32"),
        nnop("x-float64", P, "x float64", x_dtype="float64", ex_dtype="float64"),
        nnop("expert-idx-float32", P, "expertIdx float32", idx_dtype="float32"),
        nnop("expanded-x-dtype-differs", M, "expandedXOut float16, x float32", ex_dtype="float16"),
        nnop("expanded-row-idx-float32", P, "expandedRowIdxOut float32", ri_dtype="float32"),
        nnop("count-int64", P, "count output int64", cnt=(4,), cnt_dtype="int64", attrs=(0, 0, 4, 0, 1, False)),
        nnop("every-output-empty", OK, "no tokens: every output empty, accepted, nothing tiled", x=(0, 3),
             idx=(0, 2), ex=(0, 3), ri=(0,), attrs=(0, 0, 0, 2, 0, False)),
        neg("x-3d", T, "x 3-D", x=(4, 3, 1)),
        neg("rows-differ", T, "x has 5 rows, expertIdx 4", x=(5, 3)),
        neg("expert-idx-1d", T, "expertIdx 1-D", idx=(4,)),
        neg("active-num-negative", T, "activeNum -1", attrs=(-1, 0, 0, 0, 0, False)),
        # What the Ascend950 takes and the 910B refuses (op_api/aclnn_moe_init_routing_v2.cpp:38-41,
        # op_host/moe_init_routing_v2_tiling.cpp:180-184, 387-397), with outputs that fit it.
        nnop("expert-idx-int64", A + P, "expertIdx int64: the Ascend950 takes it", idx_dtype="int64"),
        neg("expert-idx-1d-k1", A + T, "expertIdx 1-D [N]: K = 1 on the Ascend950", idx=(4,), ex=(4, 3), ri=(4,)),
        neg("active-num-minus-3", A + T, "activeNum -3: N*K - 3 rows on the Ascend950", ex=(5, 3),
            attrs=(-3, 0, 0, 0, 0, False)),
        neg("expert-capacity-negative", T, "expertCapacity -1", attrs=(0, -1, 0, 0, 0, False)),
        neg("expert-num-negative", T, "expertNum -1", attrs=(0, 0, -1, 0, 0, False)),
        neg("drop-pad-mode-2", T, "dropPadMode 2", attrs=(0, 0, 0, 2, 0, False)),
        neg("flag-3", T, "expertTokensCountOrCumsumFlag 3", attrs=(0, 0, 4, 0, 3, False)),
        neg("flag-without-expert-num", T, "a count output with expertNum 0", cnt=(0,),
            attrs=(0, 0, 0, 0, 1, False)),
        neg("drop-pad-capacity-0", T, "drop/pad with expertCapacity 0", ex=(3, 0, 3), attrs=(0, 0, 3, 1, 0, False)),
        neg("capacity-over-rows", T, "expertCapacity 5 > N = 4", ex=(2, 5, 3), attrs=(0, 5, 2, 1, 0, False)),
        neg("expanded-x-rows-dropless", T, "expandedXOut 7 rows, N*K = 8", ex=(7, 3)),
        neg("expanded-x-rows-active", T, "expandedXOut 8 rows, min(activeNum, N*K) = 5",
            attrs=(5, 0, 0, 0, 0, False)),
        neg("expanded-x-hidden", T, "expandedXOut H 4, x H 3", ex=(8, 4)),
        neg("expanded-x-2d-drop-pad", T, "2-D expandedXOut in drop/pad", attrs=(0, 2, 4, 1, 0, False)),
        neg("expanded-x-capacity", T, "expandedXOut [4, 3, 3], capacity 2", ex=(4, 3, 3),
            attrs=(0, 2, 4, 1, 0, False)),
        neg("expanded-row-idx-length", T, "expandedRowIdxOut 7 elements, N*K = 8", ri=(7,)),
        neg("count-missing", T, "count flag 2 with a null count output", attrs=(0, 0, 4, 0, 2, False)),
        neg("count-length", T, "count output 3 elements, expertNum 4", cnt=(3,), attrs=(0, 0, 4, 0, 1, False)),
        neg("before-capacity-missing", T, "before-capacity flag with a null output", ex=(4, 2, 3),
            attrs=(0, 2, 4, 1, 0, True)),
    ] + _vendor_tiling_cases()


def _vendor_tiling_cases() -> list[Case]:
    """The vendor's own tiling unit tests of the forward (moe/moe_init_routing_v2/tests/utest/
    ts_moe_init_routing_v2_tc.cpp), as first phases: two it runs, and what it refuses. Tensors
    are described over a small buffer: the first phase reads none."""
    T, OK = "tiling_status", 0

    def case(name: str, status: int | str, why: str, n: int, h: int, k: int, active: int, cap: int, e: int, mode: int,
             flag: int, before: bool, **over: Any) -> Case:
        rows = (e, cap, h) if mode == 1 else (min(active, n * k) if active else n * k, h)
        spec: dict[str, Any] = dict(
            x=(n, h), idx=(n, k), ex=rows, ri=(n * k,), cnt=(e,) if mode == 0 and flag else None,
            bc=(e,) if mode == 1 and before else None, attrs=(active, cap, e, mode, flag, before), small_buffer=True)
        spec.update(over)
        return _forward_negative(f"fwd-vendor-{name}", status, Neg(**spec), why, "op")

    big = (320, 3000, 56)
    return [
        case("active-runs", OK, "N=8 H=30 K=6 activeNum 32, count output: tiled", 8, 30, 6, 32, 0, 8, 0, 1, False),
        case("drop-pad-runs", OK, "N=8 H=30 K=6 C=6 E=8 with the before-capacity output: tiled", 8, 30, 6, 0, 6, 8,
             1, 0, True),
        case("x-1d", T, "x 1-D", *big, 1000, 0, 64, 0, 1, False, x=(320,)),
        case("count-without-experts", T, "count flag with expertNum 0", *big, 1000, 0, 0, 0, 1, False, cnt=(0,)),
        case("drop-pad-capacity-0", T, "drop/pad with capacity 0", *big, 1000, 0, 64, 1, 1, False, ex=(64, 0, 3000)),
        case("drop-pad-expanded-x-2d", T, "drop/pad, expandedXOut [N*K, H]", *big, 0, 30, 64, 1, 0, True,
             ex=(320 * 56, 3000)),
        case("drop-pad-expanded-x-capacity", T, "drop/pad, expandedXOut [E, 10*C, H]", *big, 0, 30, 64, 1, 0, True,
             ex=(64, 300, 3000)),
        case("drop-pad-expanded-x-experts", T, "drop/pad, expandedXOut [2E, 10*C, H]", *big, 0, 30, 64, 1, 0, True,
             ex=(128, 300, 3000)),
        case("drop-pad-expanded-x-hidden", T, "drop/pad, expandedXOut [2E, 10*C, H+1]", *big, 0, 30, 64, 1, 0, True,
             ex=(128, 300, 3001)),
        case("before-capacity-length", T, "before-capacity output [2E]", *big, 0, 30, 64, 1, 0, True, bc=(128,)),
        case("dropless-expanded-x-3d", T, "dropless, expandedXOut 3-D", *big, 0, 30, 64, 0, 1, False,
             ex=(64, 30, 3000)),
        case("dropless-expanded-x-rows", T, "dropless, expandedXOut [2939, H]", *big, 0, 30, 64, 0, 1, False,
             ex=(2939, 3000)),
        case("dropless-expanded-x-hidden", T, "dropless, expandedXOut [300, H+1]", *big, 0, 30, 64, 0, 1, False,
             ex=(300, 3001)),
        case("active-negative", T, "activeNum -3", *big, -3, 0, 64, 0, 1, False, ex=(320 * 56, 3000)),
        case("capacity-negative", T, "expertCapacity -5", *big, 0, -5, 64, 0, 1, False),
        case("experts-negative", T, "expertNum -4", *big, 0, 0, -4, 0, 1, False, cnt=(4,)),
        case("capacity-over-tokens", T, "expertCapacity 1000 > N = 160", 160, 30000, 12, 0, 1000, 32, 1, 0, False,
             ex=(32, 1000, 30000)),
    ]


# ---------------------------------------------------------------------------- pair cases

_UNIT = {"float32": 0.0, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}  # rounding of the float32 sum
_TINY = {"float32": 2.0 ** -150, "float16": 2.0 ** -25, "bfloat16": 2.0 ** -134}  # half the least spacing
_U32 = 2.0 ** -24
_U64 = 2.0 ** -53


def adjoint_check(x: np.ndarray, ex: np.ndarray, ri: np.ndarray, g: np.ndarray, dx: np.ndarray, k: int,
                  kept: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Each token's two sides of the adjoint identity, from the device's outputs, in float64:
    (|<forward(x), g>_n - <x, backward(g)>_n| per token, the bound per token, the total
    difference, the total bound). ``ex`` and ``g`` are [rows, H]."""
    n, h = x.shape
    x64, dx64 = x.astype(np.float64), dx.astype(np.float64)
    ex64, g64 = ex.astype(np.float64), g.astype(np.float64)
    rows = np.where(kept, ri, 0).reshape(n, k)
    keep = kept.reshape(n, k)
    prod = (ex64 * g64).sum(axis=1)  # each slot's row inner product (products exact in float64)
    lhs = np.where(keep, prod[rows], 0.0).sum(axis=1)
    rhs = (x64 * dx64).sum(axis=1)
    # S[n, h]: the sum of |terms| the backward adds for token n, column h.
    s = np.zeros((n, h))
    for t in range(k):
        s += np.where(keep[:, t:t + 1], np.abs(g64[rows[:, t]]), 0.0)
    m = keep.sum(axis=1, keepdims=True).astype(np.float64)
    gamma = np.maximum(m - 1, 0) * _U32 / (1 - np.maximum(m - 1, 0) * _U32)
    u = _UNIT[dtype]
    per_element = gamma * s + u * (1 + 2 * u) * np.abs(dx64) + m * _TINY[dtype] + m * 2.0 ** -150
    ax = np.abs(x64)
    # float64's own rounding in the two sums above, for each token.
    eps64 = 2 * (h * k + h + k) * _U64 * (np.abs(ex64 * g64).sum(axis=1)[rows] * keep).sum(axis=1) \
        + 2 * (h + 1) * _U64 * (ax * np.abs(dx64)).sum(axis=1)
    bound = (ax * per_element).sum(axis=1) * (1 + 4 * _U64 * h) + eps64
    diff = np.abs(lhs - rhs)
    return diff, bound, float(abs(lhs.sum() - rhs.sum())), float(bound.sum() + 2 * n * _U64 * np.abs(lhs).sum())


def _adjoint(name: str, dtype: str, scenario: str, shape: Shape) -> Case:
    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        rng = ctx.rng(name)
        s = ctx.stream
        x = _cases.random_values(rng, (shape.tokens, shape.hidden), _cases.DTYPES[dtype])
        ids = _expert_ids(rng, shape, distinct=False)
        attrs = _attrs(scenario, shape)
        _, _, r = _forward_on_device(ctx, x, ids, attrs)
        ex = r.expanded_x.to_host(s)
        ri = r.expanded_row_idx.to_host(s)
        ex2 = ex.reshape(-1, shape.hidden)
        kept, bad = _kept(ri, ex2.shape[0], attrs.get("drop_pad_mode", 0))
        text = _shape_text(shape)
        if bad:
            return CaseResult(name, "adjoint", dtype, scenario, text, False, time.perf_counter() - t0, detail=bad)
        g = _cancelling_gradient(rng, ex2.shape[0], shape.hidden, dtype, ri, kept, shape.k).reshape(ex.shape)
        dg = to_device(g, stream=s)
        dx = moe_init_routing_v2_grad(dg, r.expanded_row_idx, *_backward_args(attrs, shape.k), stream=s).to_host(s)
        if not np.all(np.isfinite(dx.astype(np.float32))):
            return CaseResult(name, "adjoint", dtype, scenario, text, False, time.perf_counter() - t0,
                              detail="backward(g) has non-finite values where every sum is finite",
                              digest=digest(dx))
        diff, bound, total, total_bound = adjoint_check(x, ex2, ri, g.reshape(-1, shape.hidden), dx, shape.k,
                                                        kept, dtype)
        over = diff > bound
        worst = float(np.max(np.where(bound > 0, diff / np.where(bound > 0, bound, 1), np.where(diff > 0, np.inf, 0))))
        passed = not over.any() and total <= total_bound
        detail = "" if passed else (
            f"{int(over.sum())} of {diff.size} tokens break <forward(x), g> = <x, backward(g)> beyond the float32 "
            f"bound (worst {worst:.3g}x it); in total {total:.6g} against a bound of {total_bound:.6g}")
        return CaseResult(name, "adjoint", dtype, scenario, text, passed, time.perf_counter() - t0,
                          max_abs_error=float(diff.max(initial=0.0)), max_rel_error=worst,
                          mismatches=int(over.sum()), elements=int(diff.size), detail=detail, digest=digest(dx))

    return Case(name, "adjoint", dtype, scenario, _shape_text(shape), body, nbytes=_nbytes(dtype, shape, 4.0),
                op="pair", judged_by="identity")


def _round_trip(name: str, dtype: str, scenario: str, shape: Shape) -> Case:
    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        rng = ctx.rng(name)
        s = ctx.stream
        x = _exact_multiples(rng, (shape.tokens, shape.hidden), dtype, shape.k)
        ids = _expert_ids(rng, shape, distinct=True)
        attrs = _attrs(scenario, shape, keep_for=ids)
        _, _, r = _forward_on_device(ctx, x, ids, attrs)
        ri = r.expanded_row_idx.to_host(s)
        text = _shape_text(shape)
        rows = int(np.prod(r.expanded_x.shape[:-1]))
        kept, bad = _kept(ri, rows, attrs.get("drop_pad_mode", 0))
        if not bad and not kept.all():
            bad = f"{int((~kept).sum())} slots were not kept where every slot fits"
        if bad:
            return CaseResult(name, "round-trip", dtype, scenario, text, False, time.perf_counter() - t0, detail=bad)
        dx = moe_init_routing_v2_grad(r.expanded_x, r.expanded_row_idx, *_backward_args(attrs, shape.k),
                                      stream=s).to_host(s)
        want = x.astype(np.float64) * shape.k
        got = dx.astype(np.float64)
        wrong = ~((got == want) | (np.isnan(got) & np.isnan(want)))
        n = int(wrong.sum())
        err = np.abs(np.where(wrong, got - want, 0.0))
        return CaseResult(name, "round-trip", dtype, scenario, text, n == 0, time.perf_counter() - t0,
                          max_abs_error=float(np.nan_to_num(err, nan=np.inf).max(initial=0.0)),
                          mismatches=n, elements=int(want.size),
                          detail="" if n == 0 else f"backward(forward(x)) differs from {shape.k}*x in {n} of "
                                                   f"{want.size} elements (every partial sum is exact: none may)",
                          digest=digest(dx))

    return Case(name, "round-trip", dtype, scenario, _shape_text(shape), body, nbytes=_nbytes(dtype, shape),
                op="pair", judged_by="identity")


# ---------------------------------------------------------------------------- catalogue

def catalogue(profile: str = "quick") -> list[Case]:
    """The forward's and the pair's cases of a profile ('quick' or 'full')."""
    # Names put the dtype before the scenario and name shapes by their sizes, so that no
    # backward case's name (dropless-float32-..., -tiny, -h16) selects these by --filter.
    forward = [("n1", Shape(1, 1, 1, 2)), ("n3", Shape(3, 2, 7, 3)), ("ties", Shape(16, 4, 16, 4)),
               ("n64k8", Shape(64, 8, 256, 16))]
    pair = [("n3k2", Shape(3, 2, 7, 3)), ("n16k8", Shape(16, 8, 16, 16)), ("wide", Shape(16, 2, 510, 8)),
            ("n4k64", Shape(4, 64, 16, 64)), ("n64k8", Shape(64, 8, 1024, 16))]
    if profile == "full":
        forward += [("hidden7168", Shape(512, 8, 7168, 64)), ("n16384", Shape(16384, 2, 1024, 64))]
        pair += [("hidden7168", Shape(512, 8, 7168, 64)), ("n256k64", Shape(256, 64, 1024, 64))]
    out: list[Case] = []
    for dtype in DTYPES:
        for scenario in FORWARD_SCENARIOS:
            for fam, shape in forward:
                out.append(_forward_positive(f"fwd-{dtype}-{scenario}-{fam}", dtype, scenario, shape))
        out.append(_forward_determinism(f"fwd-determinism-{dtype}-ties", dtype, "dropless", Shape(256, 8, 64, 8)))
        out.append(_forward_determinism(f"fwd-determinism-{dtype}-drop-pad", dtype, "drop-pad",
                                        Shape(256, 8, 64, 8)))
        for scenario in ("dropless", "active", "drop-pad"):
            for fam, shape in pair:
                out.append(_adjoint(f"pair-adjoint-{dtype}-{scenario}-{fam}", dtype, scenario, shape))
                out.append(_round_trip(f"pair-round-trip-{dtype}-{scenario}-{fam}", dtype, scenario, shape))
    return out + _forward_negatives()

