"""Conformance of the installed aclnnMoeInitRoutingV2Grad (and of its forward,
aclnnMoeInitRoutingV2, with the pair's identities: :mod:`.pair`) with their contracts.

A catalogue of cases, each run through the binding and judged:

- positive: every dtype x scenario over shape families, index patterns, non-contiguous device
  views and values built to stress accumulation; the result must match the golden reference
  under the dtype's precision standard (:mod:`pyacl_moe.tools.cases`);
- negative: inputs the vendor must refuse, passed untouched (``validate=False`` semantics) so
  CANN's own first phase answers; its status must be the documented one;
- determinism: the same launch twice must give bit-identical results;
- the forward's cases of the same three kinds, and the pair's adjoint and round-trip cases,
  which need no golden reference (:mod:`.pair`).

``run()`` returns a :class:`Report` (JSON and JUnit XML writers, a summary table).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import json
import multiprocessing
import os
import platform
import queue
import re
import socket
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TextIO

import ml_dtypes
import numpy as np

from .. import __version__, reference
from .._paths import read_regular
from .._cann.loader import library_info, load
from .._contract import scenario as scenario_of
from ..array import DeviceArray, empty, to_device
from ..device import Device, chip, current_device, soc_name
from ..errors import AclError, InvalidArgument
from ..op.moe_init_routing_v2_grad import get_workspace_size, moe_init_routing_v2_grad
from ..release import cann_version
from ..stream import Stream
from . import cases as _cases
from . import pair, precision, visible
from .cases import size_text
from .harness import JUDGES, OPS, OUTCOMES, SOURCES, Case, CaseResult, Context, Guarded, digest
from .precision import DEFAULT_STANDARD, STANDARD_NAMES

__all__ = ["DEFAULT_STANDARD", "JUDGES", "OPS", "OUTCOMES", "SOURCES", "STANDARD_NAMES", "Case", "CaseResult",
           "Context", "Report", "catalogue",
           "compare_baseline", "load_baseline", "run", "select", "selection", "shard"]

DTYPES = ("float32", "float16", "bfloat16")
SCENARIOS = ("dropless", "active", "drop-pad")


# ---------------------------------------------------------------------------- inputs

def _values(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, values: str,
            k: int) -> tuple[np.ndarray, bool]:
    """Input values; the flag says whether the case cancels (compare against sum |terms|)."""
    dt = _cases.DTYPES[dtype]
    if values == "normal":
        return rng.standard_normal(shape, dtype=np.float32).astype(dt), False
    if values == "mixed-signs":
        # Large terms of both signs that largely cancel, plus small noise: the order of a
        # float32 summation shows here, and a low-precision accumulator fails.
        big = rng.choice(np.array([-1.0, 1.0], np.float32), size=shape) * np.float32(
            {"float32": 1e4, "float16": 1e2, "bfloat16": 1e2}[dtype])
        return (big + rng.standard_normal(shape, dtype=np.float32)).astype(dt), True
    if values == "subnormal":
        tiny = {"float32": np.float32(1e-39), "float16": np.float32(3e-6), "bfloat16": np.float32(1e-39)}[dtype]
        return (rng.integers(1, 50, size=shape).astype(np.float32) * tiny).astype(dt), False
    if values == "near-max":
        # Each token's K terms add up to between 0.3 and 0.9 of the dtype's largest value.
        top = float(ml_dtypes.finfo(dt).max)  # type: ignore[no-untyped-call]
        return (rng.uniform(0.3, 0.9, size=shape) * (top / k)).astype(np.float32).astype(dt), False
    if values == "overflow":
        top = float(ml_dtypes.finfo(dt).max)  # type: ignore[no-untyped-call]
        return np.full(shape, top * 0.75, np.float32).astype(dt), False
    raise ValueError(values)


def _indices(rng: np.random.Generator, scenario: str, tokens: int, k: int, pattern: str,
             experts: int, capacity: int, active: int) -> np.ndarray:
    bsk = tokens * k
    if scenario == "drop-pad":
        if pattern == "all-dropped":
            return np.full(bsk, -1, np.int32)
        return _cases.drop_pad_indices(rng, tokens, k, experts, capacity)
    if pattern == "sorted":
        return np.arange(bsk, dtype=np.int32)
    if pattern == "reversed":
        return np.arange(bsk - 1, -1, -1, dtype=np.int32)
    return rng.permutation(bsk).astype(np.int32)


@dataclass(frozen=True)
class Shape:
    tokens: int
    k: int
    hidden: int
    experts: int = 8
    capacity: int | None = None  # None: tokens*k/experts (some drops)
    active: int | None = None  # None: half the rows


def _build(ctx: Context, name: str, dtype: str, scenario: str, s: Shape, pattern: str = "random",
           values: str = "normal") -> tuple[_cases.Case, bool]:
    rng = ctx.rng(name)
    bsk = s.tokens * s.k
    cap = s.capacity if s.capacity is not None else max(1, bsk // s.experts)
    active = s.active if s.active is not None else max(1, bsk // 2)
    idx = _indices(rng, scenario, s.tokens, s.k, pattern, s.experts, cap, active)
    if scenario == "dropless":
        xshape: tuple[int, ...] = (bsk, s.hidden)
    elif scenario == "active":
        xshape = (active, s.hidden)
    else:
        xshape = (s.experts, cap, s.hidden)
    x, cancels = _values(rng, xshape, dtype, values, s.k)
    mode = 1 if scenario == "drop-pad" else 0
    return _cases.Case(x, idx, s.k, mode, active if scenario == "active" else 0), cancels


def _shape_text(case: _cases.Case) -> str:
    return f"x{list(case.grad_expanded_x.shape)} idx[{case.expanded_row_idx.shape[0]}] k={case.top_k}"


def _nbytes(dtype: str, scenario: str, s: Shape, x_factor: float = 1.0) -> int:
    """Device bytes of a case's inputs and output, known before any input is made (the same
    arithmetic as _build)."""
    bsk = s.tokens * s.k
    cap = s.capacity if s.capacity is not None else max(1, bsk // s.experts)
    active = s.active if s.active is not None else max(1, bsk // 2)
    rows = {"dropless": bsk, "active": active, "drop-pad": s.experts * cap}[scenario]
    item = _cases.DTYPES[dtype].itemsize
    return int(rows * s.hidden * item * x_factor) + bsk * 4 + s.tokens * s.hidden * item


# ---------------------------------------------------------------------------- case bodies

def _judge(ctx: Context, name: str, kind: str, dtype: str, case: _cases.Case, got: np.ndarray, cancels: bool,
           t0: float, no_atol: bool = False) -> CaseResult:
    want = reference.moe_init_routing_v2_grad(*case.args(), chip=chip())
    scale = None
    if cancels and ctx.standard == "pyacl":
        absx = np.abs(case.grad_expanded_x.astype(np.float32))
        scale = reference.moe_init_routing_v2_grad(absx, *case.args()[1:], chip=chip())
    std = ctx.standards[dtype]
    if no_atol:
        # Tiny values would all pass an absolute tolerance: judge them relatively only, so
        # flushing subnormals to zero shows.
        std = _cases.Standard(std.rtol, 0.0, std.max_share, std.hard_factor)
    j = precision.judge(ctx.standard, got, want, dtype, scale=scale, pyacl=std)
    m = j.metrics
    return CaseResult(
        name, kind, dtype, case.scenario, _shape_text(case), j.passed, time.perf_counter() - t0,
        m["max_abs_error"], m["max_rel_error"], round(m["mismatch_ratio"] * m["elements"]), m["elements"],
        detail="" if j.passed else f"{j.standard}: {j.reason}", source="op", digest=digest(got),
        standard=j.standard, thresholds=j.thresholds, metrics=m,
    )


@functools.lru_cache(maxsize=4)
def _random_bytes(n: int) -> np.ndarray:
    """``n`` random bytes for a workspace (a random 64 KiB block repeated: CANN's workspaces
    run to 16 MiB, and what matters is that nothing in them is zero or stale)."""
    block = np.random.default_rng(n).integers(0, 256, min(n, 1 << 16), dtype=np.uint8)
    out = np.resize(block, n)
    out.flags.writeable = False
    return out


def _launch_guarded(ctx: Context, name: str, case: _cases.Case) -> tuple[np.ndarray, str, str]:
    """Run the case on the device as the vendor's test kit does: out starts as poison and the
    workspace as random bytes, each inside guard bands (harness.Guarded); the op's call is the
    one --perf times. Returns (out as written, memory status, what is wrong with the memory:
    "" when nothing)."""
    s = ctx.stream
    dx, di = to_device(case.grad_expanded_x, stream=s), to_device(case.expanded_row_idx, stream=s)
    x = case.grad_expanded_x
    out = Guarded("out", (case.tokens, x.shape[-1]), x.dtype, s)
    size, executor = get_workspace_size(dx, di, case.top_k, case.drop_pad_mode, case.active_num, out=out.array)
    executor.close()
    ws = Guarded("workspace", (size,), np.uint8, s, fill=_random_bytes(size)) if size else None
    ctx.measured(moe_init_routing_v2_grad, dx, di, case.top_k, case.drop_pad_mode, case.active_num, out=out.array,
                 workspace=ws.array if ws is not None else None, stream=s)
    got, status, left = out.check()
    wrong = [] if status == "ok" else [out.where()]
    if ws is not None and not ws.guards_intact():
        status = "oob"
        wrong.append(ws.where())
    if left:
        wrong.append(f"{left} of {got.size} elements of out were left unwritten (they still hold the poison)")
    return got.copy(), status, "; ".join(wrong)


def _positive(name: str, dtype: str, scenario: str, shape: Shape, pattern: str = "random",
              values: str = "normal") -> Case:
    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        case, cancels = _build(ctx, name, dtype, scenario, shape, pattern, values)
        got, memory, detail = _launch_guarded(ctx, name, case)
        result = _judge(ctx, name, "positive", dtype, case, got, cancels, t0, no_atol=values == "subnormal")
        result.memory_status = memory
        if detail:
            result.passed = False
            result.detail = "; ".join(d for d in (detail, result.detail) if d)
        return result

    desc = f"N={shape.tokens} K={shape.k} H={shape.hidden}"
    return Case(name, "positive", dtype, scenario, desc, body, source="op", nbytes=_nbytes(dtype, scenario, shape),
                judged_by="reference")


def _invalid_rows(name: str, dtype: str, scenario: str, shape: Shape) -> Case:
    """Indices outside the rows (every eighth slot: negative ones, and past the rows where the
    scenario allows), launched without the binding's checks: the Ascend950 from 9.1 reads each
    as a zero row (op_kernel/arch35/moe_init_routing_v2_grad_base.h:65-75), bit for bit the
    reference's model of it; every other chip's kernel reads outside the input: a device fault
    (507015), after which the harness resets the device."""
    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        case, _ = _build(ctx, name, dtype, scenario, shape)
        idx = case.expanded_row_idx.copy()
        pos = ctx.rng(name + "/invalid").permutation(idx.size)[:max(1, idx.size // 8)]
        beyond = idx.size + 3 if scenario == "dropless" else -9
        idx[pos] = np.where(np.arange(pos.size) % 2, beyond, -5)
        bad = dataclasses.replace(case, expanded_row_idx=idx)
        s, zero = ctx.stream, ctx.chip.invalid_index == "zero"
        shape_text = _shape_text(bad)
        try:
            got = ctx.measured(moe_init_routing_v2_grad, to_device(bad.grad_expanded_x, stream=s),
                               to_device(idx, stream=s), bad.top_k, bad.drop_pad_mode, bad.active_num, stream=s,
                               validate=False).to_host(s)
        except AclError as exc:
            ok = not zero and exc.status == 507015
            return CaseResult(name, "positive", dtype, scenario, shape_text, ok, time.perf_counter() - t0,
                              expected_status=None if zero else 507015, status=exc.status,
                              detail="" if ok else f"expected zero rows on {ctx.chip.soc}, "
                                                                      f"the kernel faulted: {exc.status}",
                              source="op")
        if not zero:
            return CaseResult(name, "positive", dtype, scenario, shape_text, False, time.perf_counter() - t0,
                              expected_status=507015, status=0,
                              detail=f"expected a device fault on {ctx.chip.soc}: the kernel read no row there",
                              source="op")
        want = reference.moe_init_routing_v2_grad(*bad.args(), validate=False, chip=ctx.chip)
        j = precision.judge("exact", got, want, dtype)
        m = j.metrics
        return CaseResult(name, "positive", dtype, scenario, shape_text, j.passed, time.perf_counter() - t0,
                          m["max_abs_error"], m["max_rel_error"], round(m["mismatch_ratio"] * m["elements"]),
                          m["elements"], detail="" if j.passed else f"exact: {j.reason}", source="op",
                          digest=digest(got), standard="exact", thresholds={}, metrics=j.metrics)

    return Case(name, "positive", dtype, scenario, f"N={shape.tokens} K={shape.k} H={shape.hidden}", body,
                source="op", nbytes=_nbytes(dtype, scenario, shape), judged_by="reference")


def _strided(name: str, dtype: str, scenario: str, shape: Shape) -> Case:
    """Inputs as device views with strides and an offset (no copy): every other column of a
    wider buffer starting at column 3, and indices at every third position after the first."""

    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        case, _ = _build(ctx, name, dtype, scenario, shape)
        x = case.grad_expanded_x
        wide = np.zeros(x.shape[:-1] + (x.shape[-1] * 2 + 5,), x.dtype)
        wide[..., 3:3 + 2 * x.shape[-1]:2] = x
        idx_wide = np.full(case.expanded_row_idx.size * 3 + 1, -7, np.int32)
        idx_wide[1::3] = case.expanded_row_idx
        s = ctx.stream
        dx = to_device(wide, stream=s)[..., 3:3 + 2 * x.shape[-1]:2]
        di = to_device(idx_wide, stream=s)[1::3]
        out = ctx.measured(moe_init_routing_v2_grad, dx, di, case.top_k, case.drop_pad_mode, case.active_num, stream=s)
        got = out.to_host(s)
        return _judge(ctx, name, "positive", dtype, case, got, False, t0)

    return Case(name, "positive", dtype, scenario, f"strided N={shape.tokens} K={shape.k} H={shape.hidden}", body,
                source="op", nbytes=_nbytes(dtype, scenario, shape, x_factor=3.0))


def _strided_out(name: str, dtype: str, shape: Shape) -> Case:
    """A strided out (every other column of a wider buffer, past a poisoned first column),
    handed to CANN untouched (validate=False): where do the values land? Up to 9.0 [N, H]
    densely from the view's address (nnopbase checks the contiguity of inputs only; inferred),
    from 9.1 through the view's strides (l0op::ViewCopy). Every element of the buffer the
    release must not write keeps its poison."""

    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        case, _ = _build(ctx, name, dtype, "dropless", shape)
        s = ctx.stream
        n, h = shape.tokens, shape.hidden
        poison = np.full((n, 2 * h + 1), -3.0, case.grad_expanded_x.dtype)
        buf = to_device(poison, stream=s)
        view = buf[:, 1::2]
        ctx.measured(moe_init_routing_v2_grad, to_device(case.grad_expanded_x, stream=s),
                     to_device(case.expanded_row_idx, stream=s), case.top_k, out=view, stream=s, validate=False)
        whole = buf.to_host(s)
        want = poison.copy()
        ref = reference.moe_init_routing_v2_grad(*case.args(), chip=chip())
        if ctx.behaviour.strided_out == "strides":
            want[:, 1::2] = ref
            got = whole[:, 1::2]
        else:
            flat = want.reshape(-1)
            flat[1:1 + n * h] = ref.reshape(-1)
            got = whole.reshape(-1)[1:1 + n * h].reshape(n, h)
        result = _judge(ctx, name, "positive", dtype, case, got, False, t0)
        untouched = np.array_equal(np.where(want == -3.0, whole, -3.0), np.full_like(whole, -3.0))
        if not untouched:
            result.passed = False
            result.detail = (f"elements outside the {ctx.behaviour.strided_out} layout of the strided out were "
                             "written; " + result.detail)
        where = "through its strides" if ctx.behaviour.strided_out == "strides" else "densely at the view's address"
        result.detail = result.detail or f"written {where}"
        return result

    return Case(name, "positive", dtype, "dropless", f"strided out N={shape.tokens} K={shape.k} H={shape.hidden}",
                body, source="nnopbase", nbytes=_nbytes(dtype, "dropless", shape, x_factor=1.0) * 3)


def _determinism(name: str, dtype: str, scenario: str, shape: Shape) -> Case:
    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        case, _ = _build(ctx, name, dtype, scenario, shape)
        s = ctx.stream
        dx, di = to_device(case.grad_expanded_x, stream=s), to_device(case.expanded_row_idx, stream=s)
        first = ctx.measured(moe_init_routing_v2_grad, dx, di, *case.args()[2:], stream=s).to_host(s)
        second = ctx.measured(moe_init_routing_v2_grad, dx, di, *case.args()[2:], stream=s).to_host(s)
        same = first.tobytes() == second.tobytes()
        differing = int(np.count_nonzero(first.view(np.uint8) != second.view(np.uint8)))
        return CaseResult(
            name, "determinism", dtype, case.scenario, _shape_text(case), same, time.perf_counter() - t0,
            mismatches=0 if same else differing, elements=first.size,
            detail="" if same else f"two runs differ in {differing} bytes", source="op", digest=digest(first),
        )

    return Case(name, "determinism", dtype, scenario, f"N={shape.tokens} K={shape.k} H={shape.hidden}", body,
                source="op", nbytes=2 * _nbytes(dtype, scenario, shape), judged_by="rerun")


@dataclass(frozen=True)
class Neg:
    """A first phase whose status must be ``status`` (0: accepted), or, with ``binding``, a
    call the binding's own checks (validate=True) must refuse with InvalidArgument."""

    x: tuple[int, ...] | None
    x_dtype: str
    n_idx: int | None
    idx_dtype: str
    out: tuple[int, ...] | None
    out_dtype: str
    top_k: int
    mode: int = 0
    active: int = 0
    out_strided: bool = False
    idx_shape: tuple[int, ...] | None = None
    x_over_small_buffer: bool = False  # describe x over 1 MiB, whatever its shape claims
    binding: bool = False  # run the one-call function with validate=True instead of CANN's first phase


def _negative(name: str, status: int | str, spec: Neg, why: str, source: str = "op") -> Case:
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, not {source!r}")

    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        dev = ctx.stream.device
        x: DeviceArray | None
        if spec.x is not None and spec.x_over_small_buffer:
            small = empty((1 << 20,), np.uint8, dev)
            x = DeviceArray.from_pointer(small.data_ptr, spec.x, spec.x_dtype, owner=small, device=dev)
        else:
            x = empty(spec.x, spec.x_dtype, dev) if spec.x is not None else None
        ishape = spec.idx_shape if spec.idx_shape is not None else ((spec.n_idx,) if spec.n_idx is not None else None)
        idx = empty(ishape, spec.idx_dtype, dev) if ishape is not None else None
        out: DeviceArray | None = None
        if spec.out is not None:
            if spec.out_strided:
                out = empty((spec.out[0], spec.out[1] * 2), spec.out_dtype, dev)[:, ::2]
            else:
                out = empty(spec.out, spec.out_dtype, dev)
        shape = f"x{list(spec.x) if spec.x else None}"
        if spec.binding:
            # The binding's refusal happens on the host, before any CANN call: no status. Its
            # expected status is 0 when the binding must accept the call, else any refusal.
            if x is None or idx is None:
                raise ValueError(f"{name}: a binding case needs gradExpandedX and expandedRowIdx")
            # Inputs the contract accepts (zeros, the identity routing): a call the binding
            # accepts runs.
            x.fill(0)
            idx.copy_from_host(np.arange(idx.size, dtype=np.int32).reshape(idx.shape), ctx.stream)
            accept = ctx.expected(status) == 0
            try:
                ctx.measured(moe_init_routing_v2_grad, x, idx, spec.top_k, spec.mode, spec.active, out=out,
                             stream=ctx.stream)
                ctx.stream.synchronize()
                ok, detail = accept, why if accept else "expected InvalidArgument from the binding, it accepted"
            except InvalidArgument as exc:
                ok, detail = not accept, f"{why}: {exc}" if not accept else f"the binding refused it: {exc}"
            except AclError as exc:
                ok, detail = False, f"expected the binding to {'accept' if accept else 'refuse'} it, CANN " \
                                    f"returned {exc.status}"
            return CaseResult(name, "negative", spec.x_dtype, "-", shape, ok, time.perf_counter() - t0,
                              detail=detail, source=source)
        got: int | None = 0
        text = ""
        want = ctx.expected(status)
        try:
            _, executor = ctx.measured(get_workspace_size, x, idx, spec.top_k, spec.mode, spec.active, out,
                                       device=dev)
            executor.close()
        except AclError as exc:
            got, text = exc.status, exc.message
        passed = got == want
        detail = why if passed else f"expected {want}, CANN returned {got}" + (f": {text}" if text else "")
        return CaseResult(name, "negative", spec.x_dtype, "-", shape, passed, time.perf_counter() - t0,
                          expected_status=want, status=got, detail=detail, source=source)

    return Case(name, "negative", spec.x_dtype, "-", "", body, source=source, judged_by="status")


# ---------------------------------------------------------------------------- catalogue

def _negatives() -> list[Case]:
    """First phases with their expected status. ``source`` says where the expectation comes
    from: "op" for the op's own tiling (op_host of moe_init_routing_v2_grad); "nnopbase" for
    the generic layer's rules, read from the public opbase source (null pointers, the support
    list's data types, what it does with empty outputs and strided views: inferred); "binding"
    for pyacl_moe's own checks. Some cases expect acceptance (status 0). Where the releases
    differ the status names the field of the release's behaviour (pyacl_moe.release): a tiling
    refusal is 561002 up to 9.0 and 561103 from 9.1's l0op entry, and so on."""
    T, P, M, N, OK = "tiling_status", "dtype_status", "mixed_dtype_status", 161001, 0
    f32, bf, f16 = "float32", "bfloat16", "float16"
    ok = dict(x=(8, 4), x_dtype=f32, n_idx=8, idx_dtype="int32", out=(4, 4), out_dtype=f32, top_k=2)

    def neg(name: str, status: int | str, why: str, source: str = "op", **changes: Any) -> Case:
        return _negative(f"neg-{name}", status, Neg(**{**ok, **changes}), why, source)

    def nnop(name: str, status: int | str, why: str, **changes: Any) -> Case:
        return neg(name, status, why, "nnopbase", **changes)

    return [
        nnop("null-grad-expanded-x", N, "null gradExpandedX", x=None),
        nnop("null-expanded-row-idx", N, "null expandedRowIdx", n_idx=None),
        nnop("null-out", N, "null out", out=None),
        nnop("x-float64", P, "gradExpandedX float64", x_dtype="float64", out_dtype="float64"),
        nnop("x-int32", P, "gradExpandedX int32", x_dtype="int32", out_dtype="int32"),
        nnop("x-int8", P, "gradExpandedX int8", x_dtype="int8", out_dtype="int8"),
        nnop("idx-int64", P, "expandedRowIdx int64", idx_dtype="int64"),
        nnop("idx-float32", P, "expandedRowIdx float32", idx_dtype="float32"),
        nnop("out-dtype-differs", M, "out float16, gradExpandedX float32", out_dtype=f16),
        # Every output empty: up to 9.0 the support list is still matched (161002), from 9.1
        # the entry skips the data type of an empty tensor and succeeds.
        nnop("empty-out-x-float64", "empty_dtype_status", "empty out, gradExpandedX float64", x=(0, 4),
             x_dtype="float64", n_idx=0, out=(0, 4), out_dtype="float64"),
        # nnopbase checks the contiguity of inputs only: CANN accepts a strided out (up to 9.0
        # it writes it densely at the view's address, from 9.1 through its strides: see
        # strided-out-layout); the binding refuses it where it would be written wrong.
        nnop("out-non-contiguous", OK, "strided out accepted: contiguity is checked for inputs only",
             out_strided=True),
        neg("out-non-contiguous-binding", "binding_strided_out_status", "strided out: refused by validate=True "
            "where the release writes it densely, accepted where it writes through the strides", "binding",
            out_strided=True, binding=True),
        neg("drop-pad-mode-2", T, "dropPadMode 2", mode=2),
        neg("drop-pad-mode-minus-1", T, "dropPadMode -1", mode=-1),
        neg("top-k-0", T, "topK 0", top_k=0),
        neg("top-k-negative", T, "topK -3", top_k=-3),
        neg("active-num-negative", T, "activeNum -1", active=-1),
        neg("x-1d", T, "gradExpandedX 1-D", x=(8,)),
        neg("x-4d", T, "gradExpandedX 4-D", x=(2, 2, 2, 4)),
        neg("x-4d-huge", T, "40x512x1024x1024 descriptor over a small buffer: rejected, not read",
            x=(40, 512, 1024, 1024), x_dtype=bf, out_dtype=bf, n_idx=640, out=(10, 512), top_k=64,
            active=40, x_over_small_buffer=True),
        neg("drop-pad-needs-3d", T, "2-D gradExpandedX in drop/pad mode", mode=1),
        neg("dropless-rows-differ", T, "dropless: rows != len(idx)", x=(7, 4)),
        neg("active-rows-differ", T, "active: rows != activeNum", x=(8, 4), active=5),
        neg("out-3d", T, "out 3-D", out=(4, 4, 1)),
        neg("out-hidden-differs", T, "out H != gradExpandedX H", out=(4, 5)),
        neg("out-rows-differ", T, "out rows != len(idx)/topK", out=(3, 4)),
        neg("not-divisible", T, "len(idx) not divisible by topK", x=(9, 4), n_idx=9, out=(4, 4)),
        # Every output empty: nnopbase skips the tiling and succeeds with workspace 0.
        nnop("idx-zero-length", OK, "empty expandedRowIdx and out: accepted, nothing tiled", x=(0, 4),
             n_idx=0, out=(0, 4)),
        nnop("x-zero-rows-dropless", OK, "zero-size gradExpandedX, empty out: accepted, nothing tiled",
             x=(0, 4), n_idx=0, out=(0, 4)),
        nnop("out-zero-hidden", OK, "zero hidden size, empty out: accepted, nothing tiled", x=(8, 0),
             out=(4, 0)),
        # The vendor's own tiling tests, as refusals (VENDOR_UT says which test each one is;
        # its 4-D gradExpandedX is neg-x-4d-huge above).
        neg("vendor-2d-in-drop-pad", T, "[10,512] bf16 in drop/pad", x=(10, 512), x_dtype=bf, n_idx=640,
            out=(80, 512), out_dtype=bf, top_k=8, mode=1, active=40),
        neg("vendor-hidden-510", T, "out [10,510] for [40,512]", x=(40, 512), x_dtype=bf, n_idx=640,
            out=(10, 510), out_dtype=bf, top_k=64, active=40),
        neg("vendor-rows-196607", T, "[196608,8] with 196607 indices", x=(196608, 8), n_idx=196607,
            out=(4096, 8), top_k=6),
        neg("vendor-top-k-10", T, "640 indices, topK 10, out 10 rows", x=(40, 512), x_dtype=bf, n_idx=640,
            out=(10, 512), out_dtype=bf, top_k=10, active=40),
        neg("vendor-drop-pad-mode-minus-1", T, "dropPadMode -1 on [10,8,512] bf16", x=(10, 8, 512), x_dtype=bf,
            n_idx=640, out=(80, 512), out_dtype=bf, top_k=8, mode=-1, active=40),
        neg("vendor-active-num-minus-1", T, "activeNum -1 on [40,512] bf16", x=(40, 512), x_dtype=bf, n_idx=640,
            out=(10, 512), out_dtype=bf, top_k=64, active=-1),
        neg("vendor-active-rows-differ", T, "activeNum 30 for a [40,512] gradExpandedX", x=(40, 512), x_dtype=bf,
            n_idx=640, out=(10, 512), out_dtype=bf, top_k=64, active=30),
        # The vendor's infershape tests that fail, as the aclnn entry answers them: it runs no
        # infershape, the tiling refuses each (out is the shape topK 64 would give). The first
        # one infershape accepts (out [2,16]) and the tiling refuses: 16 indices, topK 6.
        neg("vendor-infershape-not-divisible", T, "16 indices, topK 6: infershape gives out [2,16], the tiling "
            "refuses", x=(16, 16), n_idx=16, out=(2, 16), top_k=6),
        neg("vendor-infershape-top-k-0", T, "topK 0 on [1024,512] fp16", x=(1024, 512), x_dtype=f16, n_idx=1024,
            out=(16, 512), out_dtype=f16, top_k=0),
        neg("vendor-infershape-drop-pad-mode-2", T, "dropPadMode 2 on [1024,512] fp16", x=(1024, 512), x_dtype=f16,
            n_idx=1024, out=(16, 512), out_dtype=f16, top_k=64, mode=2),
        neg("vendor-infershape-active-num-minus-1", T, "activeNum -1 on [1024,512] fp16", x=(1024, 512),
            x_dtype=f16, n_idx=1024, out=(16, 512), out_dtype=f16, top_k=64, active=-1),
        neg("vendor-infershape-idx-2d-active-neg", T, "2-D expandedRowIdx [1024,512] and activeNum -1",
            x=(1024, 512), x_dtype=f16, n_idx=None, idx_shape=(1024, 512), out=(16, 512), out_dtype=f16,
            top_k=64, active=-1),
        neg("vendor-infershape-mode-2-active-neg", T, "dropPadMode 2 and activeNum -1",
            x=(1024, 512), x_dtype=f16, n_idx=1024, out=(16, 512), out_dtype=f16, top_k=64, mode=2, active=-1),
    ]


# The tiling's workspace: a fixed 16 MiB whatever the shapes (GetWorkspaceSize in the op's
# op_host/moe_init_routing_v2_grad_tiling_base.cpp), which the vendor's tiling tests expect of
# every case they tile; nnopbase reports it as it is for contiguous inputs.
TILING_WORKSPACE = 16 * 1024 * 1024


@dataclass(frozen=True)
class Vendor:
    """A call the vendor's unit tests accept: shapes, dtype and attributes as the test gives
    them. ``values``: "normal" (standard normal), "unit" (uniform in [0, 1), as the kernel
    test's data generator draws them) or "api" (uniform in [-10, 10), the op_api test's range)."""

    x: tuple[int, ...]
    idx: tuple[int, ...]
    out: tuple[int, ...]
    dtype: str
    top_k: int
    mode: int = 0
    active: int = 0
    values: str = "normal"

    @property
    def rows(self) -> int:
        """Rows of gradExpandedX as the kernel reads them: [E*C] in drop/pad mode, dim 0 otherwise."""
        return self.x[0] * self.x[1] if self.mode == 1 else self.x[0]

    def infershape(self) -> tuple[int, int]:
        """out's shape by the op's infershape rule: [len(expandedRowIdx) / topK, H], H being
        gradExpandedX's dim 1 in mode 0 and dim 2 in mode 1 (op_host/moe_init_routing_v2_grad_infershape.cpp)."""
        return self.idx[0] // self.top_k, self.x[1] if self.mode == 0 else self.x[2]


def _vendor_inputs(rng: np.random.Generator, v: Vendor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gradExpandedX, the indices as passed, the indices the kernel reads). The kernel reads
    dim 0 of expandedRowIdx elements in row-major order; any others hold -7, which addresses
    no row, so a kernel that read them would fault. Indices follow the documented ranges: a
    permutation of the positions outside drop/pad (active mode skips those >= activeNum), and
    in drop/pad mode distinct flattened [E*C] rows at random positions, -1 elsewhere."""
    dt = _cases.DTYPES[v.dtype]
    if v.values == "normal":
        x = rng.standard_normal(v.x, dtype=np.float32).astype(dt)
    else:
        lo, hi = (0.0, 1.0) if v.values == "unit" else (-10.0, 10.0)
        x = rng.uniform(lo, hi, v.x).astype(np.float32).astype(dt)
    n = v.idx[0]
    if v.mode == 1:
        used = np.full(n, -1, np.int32)
        kept = min(v.rows, n)
        used[rng.choice(n, kept, replace=False)] = rng.choice(v.rows, kept, replace=False)
    else:
        used = rng.permutation(n).astype(np.int32)
    given = np.full(v.idx, -7, np.int32)
    given.reshape(-1)[:n] = used
    return x, given, used


def _vendor_positive(name: str, v: Vendor, why: str) -> Case:
    """An accepted case of the vendor's tests: the first phase with the test's own out must
    succeed with the tiling's workspace; then the one-call function (validate=False, out
    allocated by the binding) must give out the infershape rule's shape and the reference's
    values."""

    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        s, dev = ctx.stream, ctx.stream.device
        x, given, used = _vendor_inputs(ctx.rng(name), v)
        case = _cases.Case(x, used, v.top_k, v.mode, v.active)
        text = f"x{list(v.x)} idx{list(v.idx)} k={v.top_k}"
        dx, di = to_device(x, stream=s), to_device(given, stream=s)
        step = "the first phase refused it"
        try:
            size, executor = get_workspace_size(dx, di, v.top_k, v.mode, v.active, empty(v.out, x.dtype, dev),
                                                device=dev)
            executor.close()
            step = "the one call (validate=False) failed"
            got = ctx.measured(moe_init_routing_v2_grad, dx, di, v.top_k, v.mode, v.active, stream=s,
                               validate=False).to_host(s)
        except AclError as exc:
            return CaseResult(name, "positive", v.dtype, case.scenario, text, False, time.perf_counter() - t0,
                              expected_status=0, status=exc.status, detail=f"{why}: {step}: {exc.message}")
        wrong: list[str] = []
        # The tiling's sum up to 9.0; from 9.1 the composite allocator's rounding of it (inferred,
        # so anything from the tiling's own figure up to that is accepted).
        most = ctx.behaviour.workspace(TILING_WORKSPACE)
        if not TILING_WORKSPACE <= size <= most:
            wrong.append(f"workspace {size} bytes, the tiling's is {TILING_WORKSPACE}"
                         + (f" (at most {most} with the allocator's rounding)" if most != TILING_WORKSPACE else ""))
        if got.shape != v.infershape() or v.out != v.infershape():
            wrong.append(f"out {got.shape}, the test's {v.out}, the infershape rule's {v.infershape()}")
        result = _judge(ctx, name, "positive", v.dtype, case, got, False, t0)
        result.shape = text
        if wrong:
            result.passed = False
            result.detail = "; ".join([*wrong, result.detail] if result.detail else wrong)
        return result

    item = _cases.DTYPES[v.dtype].itemsize
    nbytes = int(np.prod(v.x)) * item + int(np.prod(v.idx)) * 4 + 2 * int(np.prod(v.out)) * item
    scen = scenario_of(v.mode, v.active)
    return Case(name, "positive", v.dtype, scen, f"x{list(v.x)} idx{list(v.idx)} K={v.top_k}", body, source="op",
                nbytes=nbytes, judged_by="reference")


def _vendor_accepted() -> list[Case]:
    """What the vendor's unit tests accept (VENDOR_UT says which test each case is): its tiling
    tests tile one case per dtype and scenario (drop/pad with activeNum 40, which the drop/pad
    kernel ignores), its infershape tests two (one with a 2-D expandedRowIdx, which only
    infershape refuses), its op_api test one, and its kernel test runs four. Names put the
    dtype before the scenario, so that no other case's --filter selects them."""
    f32, f16, bf = "float32", "float16", "bfloat16"
    cases = [
        ("tiling-float32-dropless", Vendor((480, 8), (480,), (80, 8), f32, 6), "tiling test 01, key 1000"),
        ("tiling-float16-dropless", Vendor((16, 5120), (16,), (8, 5120), f16, 2), "tiling test 02, key 1001"),
        ("tiling-bfloat16-dropless", Vendor((16, 5120), (16,), (8, 5120), bf, 2), "tiling test 03, key 1002"),
        ("tiling-float32-active", Vendor((40, 512), (640,), (10, 512), f32, 64, 0, 40), "tiling test 04, key 1010"),
        ("tiling-float16-active", Vendor((40, 512), (80,), (80, 512), f16, 1, 0, 40), "tiling test 05, key 1011"),
        ("tiling-bfloat16-active", Vendor((40, 512), (640,), (10, 512), bf, 64, 0, 40), "tiling test 06, key 1012"),
        ("tiling-float32-drop-pad", Vendor((10, 8, 512), (640,), (80, 512), f32, 8, 1, 40),
         "tiling test 07, key 1100"),
        ("tiling-float16-drop-pad", Vendor((10, 8, 512), (640,), (80, 512), f16, 8, 1, 40),
         "tiling test 08, key 1101"),
        ("tiling-bfloat16-drop-pad", Vendor((10, 8, 512), (640,), (80, 512), bf, 8, 1, 40),
         "tiling test 09, key 1102"),
        ("infershape-float16-dropless", Vendor((1024, 512), (1024,), (16, 512), f16, 64), "infershape test 03"),
        ("infershape-float16-idx-2d", Vendor((1024, 512), (1024, 512), (16, 512), f16, 64),
         "infershape test 11: the tiling reads dim 0 of a 2-D expandedRowIdx"),
        ("api-float32-dropless", Vendor((1, 64), (1,), (1, 64), f32, 1, values="api"), "op_api test"),
        ("kernel-float32-dropless", Vendor((16, 5120), (16,), (8, 5120), f32, 2, values="unit"),
         "kernel test case 0, key 1000"),
        ("kernel-float16-dropless", Vendor((163840, 8), (163840,), (4096, 8), f16, 40, values="unit"),
         "kernel test case 1, key 1001"),
        ("kernel-float16-active", Vendor((40, 512), (640,), (10, 512), f16, 64, 0, 40, values="unit"),
         "kernel test case 2, key 1011"),
        ("kernel-bfloat16-drop-pad", Vendor((10, 8, 512), (640,), (80, 512), bf, 8, 1, 40, values="unit"),
         "kernel test case 3, key 1102"),
    ]
    return [_vendor_positive(f"vendor-{name}", v, why) for name, v, why in cases]


# Every test of the vendor's unit tests of the backward (repo-mirror-test/ops-transformer,
# moe/moe_init_routing_v2_grad/tests/ut/: op_host/test_moe_init_routing_v2_grad_tiling.cpp,
# op_host/test_moe_init_routing_v2_grad_infershape.cpp,
# op_host/op_api/test_aclnn_moe_init_routing_v2_grad.cpp, op_kernel/test_moe_init_routing_v2_grad.cpp)
# and the catalogue case that makes its call through the aclnn entry. None: the test describes
# unknown dimensions of graph mode (-1, -2), which an aclnn call cannot pass;
# tests/test_emulator_vendor_ut.py runs them as negative dimensions. docs/conformance.md has the table.
VENDOR_UT: dict[str, str | None] = {
    "tiling_01": "vendor-tiling-float32-dropless",
    "tiling_02": "vendor-tiling-float16-dropless",
    "tiling_03": "vendor-tiling-bfloat16-dropless",
    "tiling_04": "vendor-tiling-float32-active",
    "tiling_05": "vendor-tiling-float16-active",
    "tiling_06": "vendor-tiling-bfloat16-active",
    "tiling_07": "vendor-tiling-float32-drop-pad",
    "tiling_08": "vendor-tiling-float16-drop-pad",
    "tiling_09": "vendor-tiling-bfloat16-drop-pad",
    "tiling_10": "neg-vendor-drop-pad-mode-minus-1",
    "tiling_11": "neg-vendor-active-num-minus-1",
    "tiling_12": "neg-x-4d-huge",
    "tiling_13": "neg-vendor-2d-in-drop-pad",
    "tiling_14": "neg-vendor-rows-196607",
    "tiling_15": "neg-vendor-active-rows-differ",
    "tiling_16": "neg-vendor-hidden-510",
    "tiling_17": "neg-vendor-top-k-10",
    "infershape_00": "neg-vendor-infershape-not-divisible",
    "infershape_01": None,
    "infershape_02": None,
    "infershape_03": "vendor-infershape-float16-dropless",
    "infershape_04": "neg-vendor-infershape-top-k-0",
    "infershape_05": "neg-vendor-infershape-drop-pad-mode-2",
    "infershape_06": "neg-vendor-infershape-active-num-minus-1",
    "infershape_07": "neg-vendor-infershape-idx-2d-active-neg",
    "infershape_08": "neg-vendor-infershape-mode-2-active-neg",
    "infershape_09": None,
    "infershape_10": None,
    "infershape_11": "vendor-infershape-float16-idx-2d",
    "api_fp32": "vendor-api-float32-dropless",
    "kernel_case0": "vendor-kernel-float32-dropless",
    "kernel_case1": "vendor-kernel-float16-dropless",
    "kernel_case2": "vendor-kernel-float16-active",
    "kernel_case3": "vendor-kernel-bfloat16-drop-pad",
}


def catalogue(profile: str = "quick") -> list[Case]:
    """The cases of a profile: 'quick' (small shapes, under a minute on the emulator) or
    'full' (adds the large shapes)."""
    if profile not in ("quick", "full"):
        raise ValueError(f"profile must be 'quick' or 'full', not {profile!r}")
    families = [
        ("tiny", Shape(1, 1, 1, experts=2, capacity=1, active=1)),
        ("small", Shape(3, 2, 7, experts=3, capacity=2, active=4)),
        ("h16", Shape(16, 8, 16)),
        ("h510", Shape(16, 2, 510)),
        ("k64", Shape(4, 64, 16, experts=16)),
        ("medium", Shape(64, 8, 4096)),
        # The Ascend950's templates (pyacl_moe.reference.arch35_chunk), each in each scenario:
        # split-H (N below H/512/dtype bytes), full load ("medium"), the general one summing
        # K in chunks (14 and 6 terms for K = 16, H = 4096; 2 and 1 at H = 16384).
        ("arch35-split-h", Shape(1, 4, 8192, experts=2, capacity=2, active=3)),
        ("arch35-general", Shape(8, 16, 4096)),
        ("arch35-general-wide", Shape(8, 16, 16384, experts=16, capacity=8)),
    ]
    if profile == "full":
        families += [
            ("h7168", Shape(512, 8, 7168)),
            ("k64-wide", Shape(256, 64, 1024, experts=64)),
            ("tokens16k", Shape(16384, 2, 1024)),
            ("k1-h7168", Shape(4096, 1, 7168)),
            ("large-512mib", Shape(8192, 8, 4096)),
        ]
    out: list[Case] = []
    for dtype in DTYPES:
        for scenario in SCENARIOS:
            for fam, shape in families:
                out.append(_positive(f"{scenario}-{dtype}-{fam}", dtype, scenario, shape))
    for dtype in DTYPES:
        out += [
            _positive(f"dropless-{dtype}-sorted", dtype, "dropless", Shape(32, 4, 64), "sorted"),
            _positive(f"dropless-{dtype}-reversed", dtype, "dropless", Shape(32, 4, 64), "reversed"),
            _positive(f"drop-pad-{dtype}-many-dropped", dtype, "drop-pad", Shape(64, 4, 32, experts=8, capacity=3)),
            _positive(f"drop-pad-{dtype}-all-dropped", dtype, "drop-pad", Shape(16, 2, 8, experts=4, capacity=0),
                      "all-dropped"),
            _positive(f"active-{dtype}-mostly-skipped", dtype, "active", Shape(32, 4, 64, active=3)),
            _strided(f"dropless-{dtype}-strided", dtype, "dropless", Shape(24, 4, 33)),
            _strided(f"drop-pad-{dtype}-strided", dtype, "drop-pad", Shape(24, 4, 33)),
            _strided_out(f"dropless-{dtype}-strided-out", dtype, Shape(12, 2, 17)),
            _positive(f"dropless-{dtype}-mixed-signs-k64", dtype, "dropless", Shape(16, 64, 64), values="mixed-signs"),
            _positive(f"dropless-{dtype}-subnormal", dtype, "dropless", Shape(16, 4, 64), values="subnormal"),
            *(_invalid_rows(f"invalid-rows-{dtype}-{scenario}", dtype, scenario, Shape(16, 4, 32))
              for scenario in SCENARIOS),
            _positive(f"dropless-{dtype}-near-max", dtype, "dropless", Shape(16, 4, 64), values="near-max"),
            _positive(f"dropless-{dtype}-overflow", dtype, "dropless", Shape(8, 2, 16), values="overflow"),
            _determinism(f"determinism-{dtype}-k8", dtype, "dropless", Shape(64, 8, 1024)),
            _determinism(f"determinism-{dtype}-k128", dtype, "drop-pad", Shape(8, 128, 256, experts=16)),
        ]
    return out + _negatives() + _vendor_accepted() + pair.catalogue(profile)


# ---------------------------------------------------------------------------- the install

def _environment(devices: list[int]) -> dict[str, Any]:
    info = library_info()
    version = cann_version()
    applies = version.behaviour
    c = chip()
    return {
        "backend": info.backend,
        "cann_version": version.toolkit_version,
        "toolkit_version": version.toolkit_version,
        "ops_version": version.ops_version,
        "runtime_version": version.runtime_version,
        "acl_version": version.acl_version,
        "op_library": version.op_library,
        "version_sources": dict(version.sources),
        "expectations": {"release": applies.release, "since": applies.behaviour.since,
                         "source": applies.behaviour.source, "inferred": list(applies.behaviour.inferred),
                         "note": applies.note,
                         # The chip's rules as that release ships them (pyacl_moe.release.CHIP_RULES).
                         "chip": {"soc": c.soc, "family": c.family, "summation": c.summation,
                                  "invalid_index": c.invalid_index, "forward_relaxed": c.forward_relaxed,
                                  "vector_cores": c.vector_cores, "ub_bytes": c.ub_bytes}},
        "ascend_home": info.home,
        "libraries": dict(info.paths),
        "soc": soc_name(),
        "chip": c.family,
        "devices": list(devices),
        # The host's ids of those devices, as ASCEND_RT_VISIBLE_DEVICES numbers them (tools.visible).
        "physical_devices": [visible.host_device(d) for d in devices],
        "visible_devices": os.environ.get(visible.VARIABLE),
        "pyacl_moe": __version__,
        "host": socket.gethostname() or "localhost",
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------------------- running and reporting

@dataclass
class Report:
    backend: str
    cann_version: str | None  # the toolkit release (as toolkit_version), None when the install does not say
    soc: str | None
    profile: str
    seed: int
    cases: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0
    toolkit_version: str | None = None
    ops_version: str | None = None  # ops-transformer's release, where it is installed apart (8.5 and later)
    runtime_version: str | None = None  # the runtime package's release (up to 8.3 its inner build number)
    acl_version: str = ""  # aclrtGetVersion
    op_library: str = ""  # the real path of the library the op came from
    version_sources: dict[str, str] = field(default_factory=dict)
    expectations: dict[str, Any] = field(default_factory=dict)  # which release's behaviour was expected, and why
    ascend_home: str | None = None
    chip: str = ""  # the SoC's family: Ascend910B, Ascend910_93 or Ascend950
    libraries: dict[str, str] = field(default_factory=dict)
    devices: list[int] = field(default_factory=lambda: [0])
    physical_devices: list[int] = field(default_factory=list)  # the host's ids of devices (visible.host_device)
    visible_devices: str | None = None  # ASCEND_RT_VISIBLE_DEVICES as the run found it
    # What was selected (profile, filter, count and digest of the cases, before --shard) and
    # which part of it ran: what tools.cluster checks before it merges reports.
    selection: dict[str, Any] = field(default_factory=dict)
    shard: dict[str, int] | None = None  # {"index": I, "count": N}, 1-based
    pyacl_moe: str = __version__
    host: str = ""
    python: str = ""
    timestamp: str = ""  # start of the run, UTC, ISO 8601
    exact: bool = False
    strict: bool = False
    standard: str = precision.DEFAULT_STANDARD  # what numeric results were judged by
    perf: int = 0  # timed runs per passing case (--perf)
    perf_threshold: float = 1.2  # --baseline: a device time this many times the old one is listed as slower
    timing_note: str = ""
    standards: dict[str, dict[str, float]] = field(default_factory=dict)
    max_memory: int | None = None
    baseline: dict[str, Any] | None = None

    def count(self, outcome: str) -> int:
        return sum(c.outcome == outcome for c in self.cases)

    @property
    def passed(self) -> int:
        return self.count("pass")

    @property
    def failed(self) -> int:
        """Cases that fail the run: wrong results or refusals, crashes, and under strict the
        cases where CANN differs from an inferred rule."""
        return self.count("fail") + self.count("error") + (self.count("differs") if self.strict else 0)

    @property
    def ok(self) -> bool:
        return self.failed == 0 and any(c.outcome != "skipped" for c in self.cases)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "cases"}
        d.update(passed=self.passed, failed=self.count("fail"), errors=self.count("error"),
                 differs=self.count("differs"), skipped=self.count("skipped"), ok=self.ok,
                 cases=[c.as_dict() for c in self.cases])
        return d

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=2)
            f.write("\n")

    def write_csv(self, path: str) -> None:
        """One row per case, as the vendor's test kit writes its results (CSV_COLUMNS)."""
        with open(path, "w", newline="", errors="backslashreplace") as f:  # (a lone surrogate, escaped)
            w = csv.writer(f)
            w.writerow(CSV_COLUMNS)
            for c in self.cases:
                m = c.metrics or {}
                precision_status = "" if c.outcome == "skipped" else (
                    "PASS" if c.passed else "FAIL") if c.standard else ""
                w.writerow([*map(csv_text, (c.name, c.op, c.shape, c.dtype, c.attributes or f"scenario={c.scenario}",
                                            c.standard or "", precision_status, c.outcome)),
                            *(_csv_value(m.get(k)) for k in CSV_METRICS),
                            _csv_value(c.api_us), _csv_value(c.device_us), csv_text(c.memory_status or "")])

    def write_junit(self, path: str) -> None:
        """JUnit XML in the Ant/Jenkins layout: one testsuite with properties, a testcase per
        case (failure: the op was wrong; error: the harness could not run it; skipped: left out
        by the memory budget), figures in each testcase's system-out, the summary in the
        suite's."""
        when = self.timestamp[:19] if self.timestamp else time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        differs_fail = self.strict
        suite = ET.Element(
            "testsuite", name=f"aclnnMoeInitRoutingV2Grad and aclnnMoeInitRoutingV2 conformance ({self.backend})",
            tests=str(len(self.cases)),
            failures=str(self.count("fail") + (self.count("differs") if differs_fail else 0)),
            errors=str(self.count("error")), skipped=str(self.count("skipped")),
            time=f"{self.seconds:.3f}", timestamp=when, hostname=self.host or "localhost",
        )
        props = ET.SubElement(suite, "properties")
        for key in ("backend", "cann_version", "toolkit_version", "ops_version", "runtime_version", "acl_version",
                    "op_library", "soc", "chip", "devices", "physical_devices", "profile", "seed", "exact",
                    "strict", "pyacl_moe", "ascend_home", "max_memory", "shard"):
            value = getattr(self, key)
            ET.SubElement(props, "property", name=key, value="" if value is None else str(value))
        for lib, where in self.libraries.items():
            ET.SubElement(props, "property", name=f"lib{lib}", value=where)
        for c in self.cases:
            tc = ET.SubElement(suite, "testcase", classname=f"conformance.{c.kind}", name=c.name,
                               time=f"{c.seconds:.3f}")
            text = json.dumps(c.as_dict(), indent=1)
            if c.outcome == "error":
                ET.SubElement(tc, "error", message=c.detail.splitlines()[0] if c.detail else "error",
                              type="harness").text = text
            elif c.outcome == "fail" or (c.outcome == "differs" and differs_fail):
                ET.SubElement(tc, "failure", message=c.detail or "failed", type=c.kind).text = text
            elif c.outcome == "skipped":
                ET.SubElement(tc, "skipped", message=c.detail)
            else:
                note = "CANN differs from the inferred rule (not failed without --strict)\n" \
                    if c.outcome == "differs" else ""
                ET.SubElement(tc, "system-out").text = note + text
        ET.SubElement(suite, "system-out").text = self.summary()
        ET.SubElement(suite, "system-err").text = ""
        for el in suite.iter():  # what XML 1.0 cannot hold (a case name's control characters), escaped
            el.text, el.tail = xml_text(el.text), xml_text(el.tail)
            el.attrib.update({k: _NOT_XML.sub(_escaped, v) for k, v in el.attrib.items()})
        ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)

    def summary(self) -> str:
        parts = [f"{self.passed} passed", f"{self.count('fail')} failed"]
        for outcome, label in (("error", "errors"), ("differs", "differ from inferred rules"),
                               ("skipped", "skipped")):
            if self.count(outcome):
                parts.append(f"{self.count(outcome)} {label}")
        devs = ",".join(map(str, self.devices))
        # Each standard that judged a result, the run's first: the forward's outputs (and integer
        # outputs) are judged bit for bit under every standard, and a summary must not say otherwise.
        used = Counter(c.standard for c in self.cases if c.standard and c.outcome != "skipped")
        if set(used) <= {self.standard}:
            mode = f", judged by {self.standard}"
        else:
            order = sorted(used, key=lambda k: (k != self.standard, -used[k], k))
            mode = ", judged by " + ", ".join(f"{k} ({used[k]} case{'s' if used[k] != 1 else ''})" for k in order)
        unchecked = sum(not c.host_checks for c in self.cases if c.outcome != "skipped")
        checks = f"; {unchecked} with the binding's host checks off (*)" if unchecked else ""
        free = sum(c.judged_by == "identity" and c.outcome != "skipped" for c in self.cases)
        pair = f"; {free} of them judged by identities between the forward and the backward alone, " \
            "with no golden reference" if free else ""
        ops = f", ops {self.ops_version}" if self.ops_version else ""
        note = f"; {self.expectations['note']}" if self.expectations.get("note") else ""
        if self.timing_note:
            note += f"; {self.timing_note}"
        return (f"{', '.join(parts)} in {self.seconds:.1f} s ({self.backend}, CANN {self.cann_version or 'unknown'}"
                f"{ops}, ACL {self.acl_version}, {self.soc}{f' ({self.chip})' if self.chip else ''}, device {devs}"
                f"{mode}{checks}{note}){pair}")

    def table(self) -> str:
        rows: list[tuple[str, ...]] = [("case", "runs", "dtype", "scenario", "shape", "source", "judged by", "result",
                                        "max error")]
        for c in self.cases:
            if c.outcome == "skipped":
                err = c.detail
            elif c.kind == "negative":
                err = f"status {c.status} (want {c.expected_status})"
            elif c.kind == "adjoint" and c.max_rel_error is not None:
                err = f"{c.max_rel_error:.3g} of the float32 bound"
            elif c.kind == "round-trip" or (c.op == "forward" and c.kind == "positive"):
                err = "exact" if c.passed else f"{c.mismatches} of {c.elements} differ"
            elif c.max_abs_error is not None:
                err = f"{c.max_abs_error:.3g} abs, {c.max_rel_error:.3g} rel"
            else:
                err = "bit-identical" if c.passed else c.detail.splitlines()[0] if c.detail else ""
            # A result judged against the reference reads as the standard that judged it.
            judge = c.standard if c.judged_by == "reference" and c.standard else c.judged_by
            rows.append(tuple(map(printable, (c.name, c.op, c.dtype, c.scenario, c.shape, c.source,
                                              judge + ("" if c.host_checks else " *"), _LABEL.get(c.outcome, "?"),
                                              err))))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append("")
        if any(not c.host_checks for c in self.cases):
            lines.append("* run with the binding's host checks off: the test kit draws the indices as the vendor's "
                         "golden does (repeats allowed), outside the documented contract")
        lines.append(self.summary())
        for c in self.cases:
            name = printable(c.name)
            if c.outcome == "fail":
                lines.append(f"FAILED {name}: {printable(c.detail)}")
            elif c.outcome == "error":
                lines.append(f"ERROR {name}: {printable(c.detail.splitlines()[0] if c.detail else '')}")
            elif c.outcome == "differs":
                lines.append(f"DIFFERS {name}: CANN differs from the inferred rule ({c.source}): {printable(c.detail)}"
                             + ("" if self.strict else " [not a failure without --strict]"))
        if self.baseline is not None:
            b = self.baseline
            lines.append(f"baseline {b['path']}: {len(b['changed'])} of {b['compared']} outputs changed bits, "
                         f"{len(b['regressed'])} went from pass to fail")
            lines += [f"CHANGED {n}" for n in b["changed"]]
            lines += [f"REGRESSED {n}" for n in b["regressed"]]
            lines += [f"SLOWER {s['name']}: {s['device_us']:.1f} us on the device, {s['ratio']:.2f}x the baseline's "
                      f"{s['baseline_device_us']:.1f} us (threshold {b['perf_threshold']:g}x)"
                      for s in b.get("slower", [])]
        return "\n".join(lines)


CSV_METRICS = ("mere", "mare", "rmse", "max_abs_error", "max_rel_error", "mismatch_ratio", "nan_inf_match")
CSV_COLUMNS = ("testcase_name", "op", "shapes", "dtypes", "attributes", "standard", "precision_status", "outcome",
               *CSV_METRICS, "api_us", "device_us", "memory_status")


# Characters XML 1.0 cannot hold, and those a terminal acts on (C0 and C1 controls, DEL).
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _escaped(m: re.Match[str]) -> str:
    return repr(m.group())[1:-1] if m.group() not in "\\'" else m.group()


def xml_text(text: str | None) -> str | None:
    """``text`` with what XML 1.0 cannot hold written as its Python escape (``\\x1b``)."""
    return text if text is None else _NOT_XML.sub(_escaped, text)


def printable(text: str) -> str:
    """``text`` for a terminal: control characters written as their escapes, never sent."""
    return _CONTROL.sub(_escaped, text)


def csv_text(text: str) -> str:
    """A text cell of a CSV report: one a spreadsheet would run as a formula (it begins with
    ``=``, ``+``, ``-``, ``@``, a tab or a carriage return) is neutralised with a leading
    apostrophe, as the common practice does."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def _csv_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


_LABEL = {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "differs": "DIFFERS", "skipped": "SKIP"}


MAX_REPORT_BYTES = 64 << 20  # a report of the full profile is a few MiB


def load_baseline(path: str) -> dict[str, Any]:
    """A report written by ``write_json``, checked enough to compare with (ValueError saying
    what is wrong otherwise)."""
    try:
        raw = read_regular(path, MAX_REPORT_BYTES)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if len(raw) > MAX_REPORT_BYTES:
        raise ValueError(f"{path}: more than a report holds ({MAX_REPORT_BYTES} bytes)")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise ValueError(f"{path}: not a JSON report ({printable(str(exc))[:200]})") from None
    cases = data.get("cases") if isinstance(data, dict) else None
    if not isinstance(cases, list) or not all(isinstance(c, dict) and "name" in c for c in cases):
        raise ValueError(f"{path}: not a conformance report (no list of cases with names)")
    if not any(c.get("digest") for c in cases):
        raise ValueError(f"{path}: its cases carry no output digest (a report of pyacl-moe 0.2.0 "
                         f"or older); write a new one")
    report: dict[str, Any] = data
    return report


def compare_baseline(report: Report, baseline: dict[str, Any], path: str = "",
                     perf_threshold: float = 1.2) -> dict[str, Any]:
    """Which cases' output bits changed since the baseline (``compared``: the cases with an
    output digest in both), which went from pass to fail, and which got slower: a device time
    above ``perf_threshold`` times the baseline's (both reports timed, --perf). Cases present
    in one report only are listed, not compared."""
    old = {c["name"]: c for c in baseline["cases"]}
    changed, regressed, fixed, compared = [], [], [], 0
    slower: list[dict[str, Any]] = []
    for c in report.cases:
        b = old.get(c.name)
        if b is None or c.outcome == "skipped" or b.get("outcome") == "skipped":
            continue
        was_us = b.get("device_us")
        if c.device_us is not None and isinstance(was_us, (int, float)) and was_us > 0 \
                and c.device_us > perf_threshold * was_us:
            slower.append({"name": c.name, "device_us": c.device_us, "baseline_device_us": float(was_us),
                           "ratio": c.device_us / float(was_us)})
        if c.digest and b.get("digest"):
            compared += 1
            if c.digest != b["digest"]:
                changed.append(c.name)
        was = b.get("outcome") or ("pass" if b.get("passed") else "fail")
        if was in ("pass", "differs") and c.outcome in ("fail", "error"):
            regressed.append(c.name)
        elif was in ("fail", "error") and c.outcome == "pass":
            fixed.append(c.name)
    names = {c.name for c in report.cases}
    return {
        "path": path, "compared": compared, "changed": changed, "regressed": regressed, "fixed": fixed,
        "slower": slower, "perf_threshold": perf_threshold,
        "new": sorted(names - set(old)), "missing": sorted(set(old) - names),
        "baseline_cann_version": baseline.get("cann_version"), "baseline_soc": baseline.get("soc"),
        "baseline_timestamp": baseline.get("timestamp"),
    }


class _Progress:
    """A counter and bar with the current case, redrawn in place on a terminal; silent when the
    stream is not one (a CI log gets the table at the end)."""

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total, self.stream, self.done = total, stream, 0
        self.tty = bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())
        self.failed = 0

    def _draw(self, current: str) -> None:
        if not self.tty or self.stream is None:
            return
        width = 30
        fill = int(width * self.done / max(self.total, 1))
        bad = f" {self.failed} failing" if self.failed else ""
        shown = printable(current)[:48]
        self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total}{bad} {shown:<48}")
        self.stream.flush()

    def start(self, name: str) -> None:
        self._draw(name)

    def step(self, name: str, outcome: str) -> None:
        self.done += 1
        self.failed += outcome in ("fail", "error")
        self._draw(name)

    def close(self) -> None:
        if self.tty and self.stream is not None:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()


def _run_case(case: Case, ctx: Context, device: int, max_memory: int | None) -> CaseResult:
    t0 = time.perf_counter()
    if max_memory is not None and case.nbytes > max_memory:
        result = CaseResult(case.name, case.kind, case.dtype, case.scenario, case.shape, True,
                            detail=f"needs {size_text(case.nbytes)}, over --max-memory {size_text(max_memory)}")
        result.outcome = "skipped"
    else:
        try:
            result = case.body(ctx)
        except Exception as exc:  # a crash of the harness: reported as an error of the case, not a verdict
            stream_ok = True
            try:
                ctx.stream.synchronize()
            except Exception:
                stream_ok = False
            result = CaseResult(case.name, case.kind, case.dtype, case.scenario, case.shape, False,
                                detail=f"{type(exc).__name__}: {exc}".strip()
                                + ("" if stream_ok else " (stream error afterwards)")
                                + "\n" + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
            result.outcome = "error"
        else:
            if result.passed:
                result.outcome = "pass"
                if ctx.perf:
                    _time_case(case, ctx, result)
            else:
                result.outcome = "differs" if case.source == "nnopbase" else "fail"
    result.seconds = time.perf_counter() - t0
    result.source, result.device, result.nbytes = case.source, device, case.nbytes
    result.op, result.judged_by = case.op, case.judged_by
    return result


def _time_case(case: Case, ctx: Context, result: CaseResult) -> None:
    """--perf: run the passing ``case`` ctx.perf more times (its first run was the warm-up) and
    record the medians of its measured calls' host and device times (Context.measured)."""
    ctx.timings = []
    try:
        for _ in range(ctx.perf):
            case.body(ctx)
        timings = ctx.timings
    except Exception as exc:  # the verdict stands; the case just has no times
        timings = []
        result.detail = "; ".join(d for d in (result.detail, f"--perf: a timed run raised {type(exc).__name__}: "
                                              f"{exc}") if d)
    finally:
        ctx.timings = None
    if timings:
        result.api_us = float(np.median([t[0] for t in timings])) * 1e6
        result.device_us = float(np.median([t[1] for t in timings])) * 1e3


def standards(rtol: dict[str, float] | None = None, atol: dict[str, float] | None = None) -> dict[str, _cases.Standard]:
    """The documented standards with rtol/atol overridden per dtype."""
    out = {}
    for name, std in _cases.STANDARDS.items():
        out[name] = _cases.Standard((rtol or {}).get(name, std.rtol), (atol or {}).get(name, std.atol),
                                    std.max_share, std.hard_factor)
    return out


def select(profile: str = "quick", name_filter: str | None = None, cases: Iterable[Case] | None = None) -> list[Case]:
    """The cases a run would run, in order."""
    return [c for c in (cases if cases is not None else catalogue(profile)) if not name_filter or name_filter in c.name]


def _shards(selected: list[Case], n: int) -> list[list[str]]:
    """Cases spread over n devices, the largest first onto the least loaded, so one device does
    not get every large case."""
    loads = [0] * n
    names: list[list[str]] = [[] for _ in range(n)]
    for case in sorted(selected, key=lambda c: -c.nbytes):
        i = loads.index(min(loads))
        names[i].append(case.name)
        loads[i] += case.nbytes + (1 << 20)  # every case costs something, even a refusal
    return names


def shard(selected: list[Case], index: int, count: int) -> list[Case]:
    """The ``index``-th (1-based) of ``count`` disjoint parts of ``selected``, in its order.
    The parts together are exactly ``selected``, and the same selection gives the same parts
    (whatever the seed: a case's size does not depend on it): the largest cases are dealt
    first, each to the lightest part, as over devices (_shards)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"shard: the count of parts must be an integer >= 1, not {count!r}")
    if isinstance(index, bool) or not isinstance(index, int) or not 1 <= index <= count:
        raise ValueError(f"shard: the part must be an integer from 1 to {count}, not {index!r}")
    names = set(_shards(selected, count)[index - 1])
    return [c for c in selected if c.name in names]


def selection(profile: str, name_filter: str | None, selected: list[Case]) -> dict[str, Any]:
    """What a run selected, for telling reports of the same catalogue apart from others: the
    profile, the filter, how many cases and a digest of their names, kinds, dtypes, scenarios
    and shapes."""
    h = hashlib.sha256()
    for c in selected:
        h.update(json.dumps([c.name, c.op, c.kind, c.dtype, c.scenario, c.shape]).encode("utf-8", "backslashreplace"))
    return {"profile": profile, "filter": name_filter or "", "cases": len(selected),
            "digest": "sha256:" + h.hexdigest()}


def run(profile: str = "quick", name_filter: str | None = None, seed: int = 0,
        progress: TextIO | None = sys.stderr, cases: Iterable[Case] | None = None, *,
        devices: Iterable[int] | None = None, exact: bool = False, strict: bool = False,
        rtol: dict[str, float] | None = None, atol: dict[str, float] | None = None,
        max_memory: int | None = None, baseline: dict[str, Any] | None = None, baseline_path: str = "",
        standard: str = precision.DEFAULT_STANDARD, perf: int = 0, perf_threshold: float = 1.2,
        part: tuple[int, int] | None = None) -> Report:
    """Run a profile (or the given cases) and return the report.

    ``devices``: ids to run on (default: the current device); with more than one, the cases
    are spread over one worker process per device (spawned, so each initializes CANN afresh)
    and merged in catalogue order. ``standard``: what numeric results are judged by (one of
    tools.precision.STANDARD_NAMES); ``exact``: the same as standard="exact". ``strict``: a case
    whose expectation is inferred ("nnopbase") fails the run when CANN differs. ``rtol`` /
    ``atol``: per-dtype overrides of the standard. ``max_memory``: skip cases needing more
    device bytes. ``baseline``: a loaded earlier report to compare output digests with (and,
    with ``perf``, device times: a case whose time grew beyond ``perf_threshold`` times the
    baseline's is listed as slower). ``perf``: run each passing case that many more times,
    timed (CaseResult.api_us, device_us: medians). ``part``: (I, N), run only the I-th of N
    disjoint parts of the selection (:func:`shard`; 1-based).
    """
    if perf < 0 or perf_threshold <= 0:
        raise ValueError("perf must be >= 0 and perf_threshold > 0")
    if exact:
        standard = "exact"
    precision.thresholds(standard, "float32")  # refuses an unknown standard before anything runs
    exact = standard == "exact"
    selected = select(profile, name_filter, cases)
    chosen = selection(profile, name_filter, selected)
    if part is not None:
        selected = shard(selected, *part)
    devs = list(devices) if devices is not None else [current_device().device_id]
    if not devs:
        raise ValueError("devices must name at least one device")
    stds = standards(rtol, atol)
    env = _environment(devs)
    report = Report(env.pop("backend"), env.pop("cann_version"), env.pop("soc"), profile, seed,
                    exact=exact, strict=strict, standard=standard, perf=perf, perf_threshold=perf_threshold,
                    max_memory=max_memory,
                    standards={k: {"rtol": v.rtol, "atol": v.atol, "max_share": v.max_share}
                               for k, v in stds.items()},
                    timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"), selection=chosen,
                    shard={"index": part[0], "count": part[1]} if part is not None else None, **env)
    bar = _Progress(len(selected), progress)
    t_all = time.perf_counter()
    if len(devs) == 1:
        results = _run_here(selected, devs[0], seed, standard, stds, max_memory, bar, perf=perf)
    else:
        if cases is not None:
            raise ValueError("a run over several devices takes cases from the catalogue, not a list")
        opts = {"profile": profile, "seed": seed, "standard": standard, "perf": perf, "rtol": rtol, "atol": atol,
                "max_memory": max_memory}
        results = _run_workers(selected, devs, opts, bar)
    bar.close()
    order = {c.name: i for i, c in enumerate(selected)}
    report.cases = sorted(results, key=lambda r: order[r.name])
    report.seconds = time.perf_counter() - t_all
    if perf and report.backend == "emulator":
        report.timing_note = "times are the emulator's (host threads), not a device's"
    if baseline is not None:
        report.baseline = compare_baseline(report, baseline, baseline_path, perf_threshold)
    return report


def _run_here(selected: list[Case], device: int, seed: int, standard: str, stds: dict[str, _cases.Standard],
              max_memory: int | None, bar: _Progress, on_result: Callable[[CaseResult], None] | None = None,
              perf: int = 0) -> list[CaseResult]:
    dev = Device(device)
    dev.set_current()
    results = []
    ctx = Context(seed, Stream(dev), standard == "exact", stds, cann_version().behaviour.behaviour, standard, perf,
                  chip=chip())
    try:
        for case in selected:
            bar.start(case.name)
            result = _run_case(case, ctx, device, max_memory)
            if dev.fault is not None:
                # Faults are sticky: a case that faulted the device (as a case expecting a fault
                # does) leaves it raising until reset; the next case gets a fresh device and stream.
                dev.reset()
                ctx.stream = Stream(dev)
            results.append(result)
            bar.step(case.name, result.outcome)
            if on_result is not None:
                on_result(result)
    finally:
        ctx.stream.close()
    return results


def _worker(device: int, names: list[str], opts: dict[str, Any], backend: str, home: str | None,
            out: Any) -> None:
    """One device's share of a run, in a spawned process: results go back through ``out``."""
    try:
        if backend == "emulator":
            from ..emulator import use_emulator

            use_emulator()
        else:
            load(ascend_home=home, emulator=False)
        wanted = set(names)
        mine = [c for c in catalogue(opts["profile"]) if c.name in wanted]
        stds = standards(opts["rtol"], opts["atol"])
        _run_here(mine, device, opts["seed"], opts["standard"], stds, opts["max_memory"], _Progress(0, None),
                  on_result=lambda r: out.put(("result", device, r.as_dict())), perf=opts["perf"])
    except BaseException as exc:
        out.put(("fatal", device, f"{type(exc).__name__}: {exc}"))
    else:
        out.put(("done", device, None))


def _run_workers(selected: list[Case], devs: list[int], opts: dict[str, Any], bar: _Progress) -> list[CaseResult]:
    info = library_info()
    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    shards = _shards(selected, len(devs))
    procs = {d: mp.Process(target=_worker, args=(d, names, opts, info.backend, info.home, out), daemon=True)
             for d, names in zip(devs, shards)}
    for p in procs.values():
        p.start()
    by_name = {c.name: c for c in selected}
    pending = {d: set(names) for d, names in zip(devs, shards)}
    fatal: dict[int, str] = {}
    results: list[CaseResult] = []
    running = set(devs)
    while running:
        try:
            kind, dev, payload = out.get(timeout=0.5)
        except queue.Empty:
            for d in list(running):
                if not procs[d].is_alive():
                    fatal.setdefault(d, f"the worker for device {d} exited with status {procs[d].exitcode}")
                    running.discard(d)
            continue
        if kind == "result":
            r = CaseResult(**payload)
            pending[dev].discard(r.name)
            results.append(r)
            bar.step(f"{r.name} (device {dev})", r.outcome)
        else:
            if kind == "fatal":
                fatal[dev] = payload
            running.discard(dev)
    for p in procs.values():
        p.join()
    for d, names in pending.items():
        for name in sorted(names):
            c = by_name[name]
            r = CaseResult(c.name, c.kind, c.dtype, c.scenario, c.shape, False,
                           detail=f"not run: {fatal.get(d, 'the worker stopped')}", source=c.source, device=d,
                           nbytes=c.nbytes)
            r.outcome = "error"
            results.append(r)
    return results
