"""Conformance of the installed aclnnMoeInitRoutingV2Grad with its contract.

A catalogue of cases, each run through the binding and judged:

- positive: every dtype x scenario over shape families, index patterns, non-contiguous device
  views and values built to stress accumulation; the result must match the golden reference
  under the dtype's precision standard (:mod:`pyacl_moe.tools.cases`);
- negative: inputs the vendor must refuse, passed untouched (``validate=False`` semantics) so
  CANN's own first phase answers; its status must be the documented one;
- determinism: the same launch twice must give bit-identical results.

``run()`` returns a :class:`Report` (JSON and JUnit XML writers, a summary table).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, TextIO

import ml_dtypes
import numpy as np

from .. import reference
from .._cann.loader import library_info
from ..array import DeviceArray, empty, to_device
from ..device import acl_version, current_device, soc_name
from ..errors import AclError
from ..op.moe_init_routing_v2_grad import get_workspace_size, moe_init_routing_v2_grad
from ..stream import Stream
from . import cases as _cases

__all__ = ["CaseResult", "Report", "catalogue", "run"]

DTYPES = ("float32", "float16", "bfloat16")
SCENARIOS = ("dropless", "active", "drop-pad")
# Where a case's expectation comes from: "op", the vendor op's own files (docs, tiling,
# kernel); "nnopbase", CANN's generic aclnn layer as read from the public opbase source
# (inferred: newer than some releases, so a mismatch on hardware means CANN differs from the
# inferred rule); "binding", pyacl_moe's own contract.
SOURCES = ("op", "nnopbase", "binding")


@dataclass
class CaseResult:
    name: str
    kind: str  # positive | negative | determinism
    dtype: str
    scenario: str
    shape: str
    passed: bool
    seconds: float = 0.0
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    mismatches: int | None = None
    elements: int | None = None
    expected_status: int | None = None
    status: int | None = None
    detail: str = ""
    source: str = "op"  # one of SOURCES

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Case:
    name: str
    kind: str
    dtype: str
    scenario: str
    shape: str
    body: Callable[[Context], CaseResult]
    source: str = "op"  # one of SOURCES: where the expectation comes from


@dataclass
class Context:
    seed: int
    stream: Stream
    # Each case derives its own generator from the seed and its name, so a case gives the
    # same inputs whatever else runs, and --filter reproduces a failure exactly.
    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, *name.encode()])


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
        top = float(ml_dtypes.finfo(dt).max)
        return (rng.uniform(0.3, 0.9, size=shape) * (top / k)).astype(np.float32).astype(dt), False
    if values == "overflow":
        top = float(ml_dtypes.finfo(dt).max)
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


# ---------------------------------------------------------------------------- case bodies

def _judge(name: str, kind: str, dtype: str, case: _cases.Case, got: np.ndarray, cancels: bool,
           t0: float, no_atol: bool = False) -> CaseResult:
    want = reference.moe_init_routing_v2_grad(*case.args())
    scale = None
    if cancels:
        absx = np.abs(case.grad_expanded_x.astype(np.float32))
        scale = reference.moe_init_routing_v2_grad(absx, *case.args()[1:])
    std = _cases.STANDARDS[dtype]
    if no_atol:
        # Tiny values would all pass an absolute tolerance: judge them relatively only, so
        # flushing subnormals to zero shows.
        std = _cases.Standard(std.rtol, 0.0, std.max_share, std.hard_factor)
    cmp = _cases.compare(got, want, dtype, scale=scale, standard=std)
    return CaseResult(
        name, kind, dtype, case.scenario, _shape_text(case), cmp.passed, time.perf_counter() - t0,
        cmp.max_abs_error, cmp.max_rel_error, cmp.mismatches, cmp.elements,
        detail="" if cmp.passed else
        f"{cmp.mismatches} of {cmp.elements} elements outside rtol={cmp.rtol:g} atol={cmp.atol:g}",
    )


def _positive(name: str, dtype: str, scenario: str, shape: Shape, pattern: str = "random",
              values: str = "normal") -> Case:
    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        case, cancels = _build(ctx, name, dtype, scenario, shape, pattern, values)
        got = moe_init_routing_v2_grad(*case.args(), stream=ctx.stream)
        return _judge(name, "positive", dtype, case, got, cancels, t0, no_atol=values == "subnormal")

    desc = f"N={shape.tokens} K={shape.k} H={shape.hidden}"
    return Case(name, "positive", dtype, scenario, desc, body)


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
        out = moe_init_routing_v2_grad(dx, di, case.top_k, case.drop_pad_mode, case.active_num, stream=s)
        got = out.to_host(s)
        return _judge(name, "positive", dtype, case, got, False, t0)

    return Case(name, "positive", dtype, scenario, f"strided N={shape.tokens} K={shape.k} H={shape.hidden}", body)


def _determinism(name: str, dtype: str, scenario: str, shape: Shape) -> Case:
    def body(ctx: Context) -> CaseResult:
        t0 = time.perf_counter()
        case, _ = _build(ctx, name, dtype, scenario, shape)
        s = ctx.stream
        dx, di = to_device(case.grad_expanded_x, stream=s), to_device(case.expanded_row_idx, stream=s)
        first = moe_init_routing_v2_grad(dx, di, *case.args()[2:], stream=s).to_host(s)
        second = moe_init_routing_v2_grad(dx, di, *case.args()[2:], stream=s).to_host(s)
        same = first.tobytes() == second.tobytes()
        differing = int(np.count_nonzero(first.view(np.uint8) != second.view(np.uint8)))
        return CaseResult(
            name, "determinism", dtype, case.scenario, _shape_text(case), same, time.perf_counter() - t0,
            mismatches=0 if same else differing, elements=first.size,
            detail="" if same else f"two runs differ in {differing} bytes",
        )

    return Case(name, "determinism", dtype, scenario, f"N={shape.tokens} K={shape.k} H={shape.hidden}", body)


@dataclass(frozen=True)
class Neg:
    """A first phase the vendor must refuse with ``status``."""

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


def _negative(name: str, status: int, spec: Neg, why: str) -> Case:
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
        got: int | None = 0
        text = ""
        try:
            _, executor = get_workspace_size(x, idx, spec.top_k, spec.mode, spec.active, out, device=dev)
            executor.close()
        except AclError as exc:
            got, text = exc.status, exc.message
        passed = got == status
        detail = why if passed else f"expected {status}, CANN returned {got}" + (f": {text}" if text else "")
        return CaseResult(name, "negative", spec.x_dtype, "-", f"x{list(spec.x) if spec.x else None}",
                          passed, time.perf_counter() - t0, expected_status=status, status=got, detail=detail)

    return Case(name, "negative", spec.x_dtype, "-", "", body)


# ---------------------------------------------------------------------------- catalogue

def _negatives() -> list[Case]:
    P, T, N = 161002, 561002, 161001
    f32, bf, f16 = "float32", "bfloat16", "float16"
    ok = dict(x=(8, 4), x_dtype=f32, n_idx=8, idx_dtype="int32", out=(4, 4), out_dtype=f32, top_k=2)

    def neg(name: str, status: int, why: str, **changes: Any) -> Case:
        return _negative(f"neg-{name}", status, Neg(**{**ok, **changes}), why)

    return [
        neg("null-grad-expanded-x", N, "null gradExpandedX", x=None),
        neg("null-expanded-row-idx", N, "null expandedRowIdx", n_idx=None),
        neg("null-out", N, "null out", out=None),
        neg("x-float64", P, "gradExpandedX float64", x_dtype="float64", out_dtype="float64"),
        neg("x-int32", P, "gradExpandedX int32", x_dtype="int32", out_dtype="int32"),
        neg("x-int8", P, "gradExpandedX int8", x_dtype="int8", out_dtype="int8"),
        neg("idx-int64", P, "expandedRowIdx int64", idx_dtype="int64"),
        neg("idx-float32", P, "expandedRowIdx float32", idx_dtype="float32"),
        neg("out-dtype-differs", P, "out float16, gradExpandedX float32", out_dtype=f16),
        neg("out-non-contiguous", P, "strided out", out_strided=True),
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
        neg("idx-zero-length", T, "empty expandedRowIdx", x=(0, 4), n_idx=0, out=(0, 4)),
        neg("x-zero-rows-dropless", T, "zero-size gradExpandedX in dropless mode", x=(0, 4), n_idx=0,
            out=(0, 4)),
        neg("out-zero-hidden", T, "zero hidden size", x=(8, 0), out=(4, 0)),
        # The vendor's own tiling tests, as refusals.
        neg("vendor-2d-in-drop-pad", T, "[10,512] bf16 in drop/pad", x=(10, 512), x_dtype=bf, n_idx=640,
            out=(80, 512), out_dtype=bf, top_k=8, mode=1, active=40),
        neg("vendor-hidden-510", T, "out [10,510] for [40,512]", x=(40, 512), x_dtype=bf, n_idx=640,
            out=(10, 510), out_dtype=bf, top_k=64, active=40),
        neg("vendor-rows-196607", T, "[196608,8] with 196607 indices", x=(196608, 8), n_idx=196607,
            out=(4096, 8), top_k=6),
        neg("vendor-top-k-10", T, "640 indices, topK 10, out 10 rows", x=(40, 512), x_dtype=bf, n_idx=640,
            out=(10, 512), out_dtype=bf, top_k=10, active=40),
    ]


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
            _positive(f"dropless-{dtype}-mixed-signs-k64", dtype, "dropless", Shape(16, 64, 64), values="mixed-signs"),
            _positive(f"dropless-{dtype}-subnormal", dtype, "dropless", Shape(16, 4, 64), values="subnormal"),
            _positive(f"dropless-{dtype}-near-max", dtype, "dropless", Shape(16, 4, 64), values="near-max"),
            _positive(f"dropless-{dtype}-overflow", dtype, "dropless", Shape(8, 2, 16), values="overflow"),
            _determinism(f"determinism-{dtype}-k8", dtype, "dropless", Shape(64, 8, 1024)),
            _determinism(f"determinism-{dtype}-k128", dtype, "drop-pad", Shape(8, 128, 256, experts=16)),
        ]
    return out + _negatives()


# ---------------------------------------------------------------------------- running and reporting

@dataclass
class Report:
    backend: str
    cann_version: str
    soc: str | None
    profile: str
    seed: int
    cases: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> int:
        return sum(c.passed for c in self.cases)

    @property
    def failed(self) -> int:
        return len(self.cases) - self.passed

    @property
    def ok(self) -> bool:
        return self.failed == 0 and bool(self.cases)

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "cann_version": self.cann_version,
            "soc": self.soc,
            "profile": self.profile,
            "seed": self.seed,
            "seconds": self.seconds,
            "passed": self.passed,
            "failed": self.failed,
            "cases": [c.as_dict() for c in self.cases],
        }

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=2)

    def write_junit(self, path: str) -> None:
        suite = ET.Element(
            "testsuite", name=f"aclnnMoeInitRoutingV2Grad conformance ({self.backend})",
            tests=str(len(self.cases)), failures=str(self.failed), errors="0", time=f"{self.seconds:.3f}",
        )
        props = ET.SubElement(suite, "properties")
        for key in ("backend", "cann_version", "soc", "profile", "seed"):
            ET.SubElement(props, "property", name=key, value=str(getattr(self, key)))
        for c in self.cases:
            tc = ET.SubElement(suite, "testcase", classname=f"conformance.{c.kind}", name=c.name,
                               time=f"{c.seconds:.3f}")
            if not c.passed:
                ET.SubElement(tc, "failure", message=c.detail or "failed").text = json.dumps(c.as_dict(), indent=1)
        ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)

    def table(self) -> str:
        rows = [("case", "dtype", "scenario", "shape", "result", "max error")]
        for c in self.cases:
            if c.kind == "negative":
                err = f"status {c.status} (want {c.expected_status})"
            elif c.max_abs_error is not None:
                err = f"{c.max_abs_error:.3g} abs, {c.max_rel_error:.3g} rel"
            else:
                err = "bit-identical" if c.passed else c.detail
            rows.append((c.name, c.dtype, c.scenario, c.shape, "PASS" if c.passed else "FAIL", err))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append("")
        lines.append(f"{self.passed} passed, {self.failed} failed in {self.seconds:.1f} s "
                     f"({self.backend}, ACL {self.cann_version}, {self.soc})")
        for c in self.cases:
            if not c.passed:
                lines.append(f"FAILED {c.name}: {c.detail}")
        return "\n".join(lines)


class _Progress:
    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total, self.stream, self.done = total, stream, 0
        self.tty = bool(stream is not None and stream.isatty())

    def step(self, name: str, ok: bool) -> None:
        self.done += 1
        if self.stream is None:
            return
        if self.tty:
            width = 30
            fill = int(width * self.done / max(self.total, 1))
            self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {name[:40]:<40}")
            if self.done == self.total:
                self.stream.write("\n")
        elif not ok or self.done == self.total or self.done % max(1, self.total // 10) == 0:
            self.stream.write(f"[{self.done}/{self.total}] {'ok  ' if ok else 'FAIL'} {name}\n")
        self.stream.flush()


def run(profile: str = "quick", name_filter: str | None = None, seed: int = 0,
        progress: TextIO | None = sys.stderr, cases: Iterable[Case] | None = None) -> Report:
    """Run a profile (or the given cases) and return the report."""

    selected = [c for c in (cases if cases is not None else catalogue(profile))
                if not name_filter or name_filter in c.name]
    dev = current_device()
    major, minor, patch = acl_version()
    report = Report(library_info().backend, f"{major}.{minor}.{patch}", soc_name(), profile, seed)
    bar = _Progress(len(selected), progress)
    t_all = time.perf_counter()
    with closing(Stream(dev)) as stream:
        ctx = Context(seed, stream)
        for case in selected:
            t0 = time.perf_counter()
            try:
                result = case.body(ctx)
            except Exception as exc:  # a crash of the case is a failure of the case, reported
                stream_ok = True
                try:
                    stream.synchronize()
                except Exception:
                    stream_ok = False
                result = CaseResult(case.name, case.kind, case.dtype, case.scenario, case.shape, False,
                                    time.perf_counter() - t0,
                                    detail=f"{type(exc).__name__}: {exc}".strip()
                                    + ("" if stream_ok else " (stream error afterwards)")
                                    + "\n" + "".join(traceback.format_exception_only(type(exc), exc)).strip())
            report.cases.append(result)
            bar.step(case.name, result.passed)
    report.seconds = time.perf_counter() - t_all
    return report
