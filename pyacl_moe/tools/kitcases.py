"""Cases from the vendor's operator test kit's case files (CSV): ``conformance --cases FILE.csv``.

A file has a header row naming its columns (in any order): ``testcase_name``, ``api_name``
(``aclnnMoeInitRoutingV2Grad`` or ``aclnnMoeInitRoutingV2``: which op the row runs),
``tensor_view_shapes`` (one shape per tensor, inputs then outputs, in the C API's order),
``tensor_dtypes`` (one per tensor, or one for all: ``float16``, ``bfloat16``, ``float32``,
``int32`` or their short forms), ``attributes`` (a dict of the aclnn attribute names), and
optionally ``precision_tolerances`` (an (rtol, ptol) pair per output, read by the close
standard), ``absolute_precision`` (atol, for close), ``input_data_ranges`` (a (low, high) pair
per input: values drawn uniformly between them, a constant when equal) and
``output_tensor_indexes``. Every cell is a Python literal. docs/conformance.md, "Test-kit case
files", says how each op's inputs are made.

Everything is parsed and checked before anything runs: a malformed row raises CaseFileError
naming the file, the row and the column.
"""

from __future__ import annotations

import csv
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import reference
from ..array import to_device
from ..device import chip
from ..op.moe_init_routing_v2 import moe_init_routing_v2
from . import cases as _cases
from . import precision
from .harness import Case, CaseResult, Context, digest

__all__ = ["CaseFileError", "KitRow", "load"]

BACKWARD_API = "aclnnMoeInitRoutingV2Grad"
FORWARD_API = "aclnnMoeInitRoutingV2"
REQUIRED = ("testcase_name", "api_name", "tensor_view_shapes", "tensor_dtypes", "attributes")
_DTYPES = {"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float32": "float32", "fp32": "float32", "float": "float32", "int32": "int32", "s32": "int32"}
_BACKWARD_ATTRS = {"topK": 1, "dropPadMode": 0, "activeNum": 0}  # name -> default (topK required)
_FORWARD_ATTRS = {"activeNumOptional": 0, "expertCapacityOptional": 0, "expertNumOptional": 0,
                  "dropPadModeOptional": 0, "expertTokensCountOrCumsumFlagOptional": 0,
                  "expertTokensBeforeCapacityFlagOptional": False}
_DEFAULT_RANGE = (-2.0, 2.0)  # the kit's, for a range not given


class CaseFileError(ValueError):
    """A case file that cannot be run as written: names the file, the row and the column."""


@dataclass
class KitRow:
    """One row, parsed and checked."""

    file: str
    row: int  # 1-based line of the file (the header is line 1)
    name: str
    api: str
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    attributes: dict[str, Any]
    tolerances: list[tuple[float, float]]
    atol: float | None
    ranges: list[tuple[float, float]]
    text: dict[str, str]  # the cells as written, for the report


# What one cell may hold: the kit's cells are small Python literals (it writes infinity as a
# bare ``inf``). A file from elsewhere is read by a parser of our own, bounded before anything
# is computed: no compiler (30,000 minus signs exhausted it), no int of a thousand digits.
MAX_CELL = 4096  # characters
MAX_DEPTH = 4  # nesting (a list of shapes is 2 deep)
MAX_VALUES = 1024  # numbers, strings and names in one cell
MAX_INT = 2**63 - 1  # what an int64 attribute holds
MAX_DIM = 2**31 - 1  # one dimension of a shape
MAX_ELEMENTS = 2**40  # elements of one tensor (the memory budget judges what is left)
_TOKEN = re.compile(r"""\s*(?:(?P<num>[+-]?(?:inf\b|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?))"""
                    r"""|(?P<str>'[^'\\\n\r]*'|"[^"\\\n\r]*")|(?P<name>True|False|None)\b|(?P<punct>[()\[\]{},:]))""")
_INT = re.compile(r"[+-]?\d+")


def _literal(text: str) -> Any:
    """The value of a cell written as a small Python literal: numbers (one sign at most;
    ``inf``), strings without escapes, True, False, None, and tuples, lists and dicts of them,
    within the bounds above; ValueError saying what is wrong otherwise."""
    if len(text) > MAX_CELL:
        raise ValueError(f"longer than {MAX_CELL} characters")
    pos, count = 0, 0

    def token() -> re.Match[str]:
        nonlocal pos, count
        m = _TOKEN.match(text, pos)
        if m is None:
            rest = text[pos:].strip()
            raise ValueError(f"unexpected {rest[:12]!r} at character {pos + 1}" if rest else "it ends too soon")
        pos = m.end()
        if not m["punct"]:
            count += 1
            if count > MAX_VALUES:
                raise ValueError(f"more than {MAX_VALUES} values")
        return m

    def peek() -> str | None:
        m = _TOKEN.match(text, pos)
        return m["punct"] if m is not None else None

    def value(depth: int) -> Any:
        m = token()
        if m["num"] is not None:
            t = m["num"]
            if not _INT.fullmatch(t):
                return float(t)
            if len(t.lstrip("+-")) > 19 or abs(int(t)) > MAX_INT:
                raise ValueError(f"the integer {t[:24]}{'...' if len(t) > 24 else ''} is out of range "
                                 f"(at most {MAX_INT} in size)")
            return int(t)
        if m["str"] is not None:
            return m["str"][1:-1]
        if m["name"] is not None:
            return {"True": True, "False": False, "None": None}[m["name"]]
        opening = m["punct"]
        if opening not in "([{":
            raise ValueError(f"unexpected {opening!r} at character {pos}")
        if depth >= MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH}")
        closing = {"(": ")", "[": "]", "{": "}"}[opening]
        items: list[Any] = []
        comma = False
        while peek() != closing:
            if opening == "{":
                key = value(depth + 1)
                if token()["punct"] != ":":
                    raise ValueError(f"a dict entry needs a ':' (character {pos})")
                if isinstance(key, (list, dict)):
                    raise ValueError("a dict key must be a number, a string or a name")
                items.append((key, value(depth + 1)))
            else:
                items.append(value(depth + 1))
            if peek() != ",":
                break
            token()
            comma = True
        if token()["punct"] != closing:
            raise ValueError(f"{opening!r} is not closed by {closing!r} (character {pos})")
        if opening == "(":
            return items[0] if len(items) == 1 and not comma else tuple(items)
        return items if opening == "[" else dict(items)

    out = value(0)
    if text[pos:].strip():
        raise ValueError(f"unexpected {text[pos:].strip()[:12]!r} after the value (character {pos + 1})")
    return out


def _parse_row(file: str, line: int, cells: dict[str, str]) -> KitRow:
    def bad(column: str, why: str) -> CaseFileError:
        return CaseFileError(f"{file}: row {line}, column {column}: {why}")

    def cell(column: str) -> Any:
        text = (cells.get(column) or "").strip()
        if not text:
            return None
        if column == "tensor_dtypes" and text.isidentifier():
            return text  # one dtype, unquoted
        try:
            return _literal(text)
        except ValueError as exc:
            raise bad(column, f"not a Python literal, or not a small one ({exc}): {_shown(text)}") from None

    name = (cells.get("testcase_name") or "").strip()
    if not name:
        raise bad("testcase_name", "empty")
    if len(name) > 256:
        raise bad("testcase_name", f"longer than 256 characters: {_shown(name)}")
    api = (cells.get("api_name") or "").strip()
    if api not in (BACKWARD_API, FORWARD_API):
        raise bad("api_name", f"must be {BACKWARD_API} or {FORWARD_API}, got {_shown(api)}")
    n_tensors = 3 if api == BACKWARD_API else 6
    shapes = cell("tensor_view_shapes")
    if not isinstance(shapes, (tuple, list)) or len(shapes) != n_tensors or not all(
            isinstance(s, (tuple, list)) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)
            for s in shapes):
        raise bad("tensor_view_shapes", f"must give {n_tensors} shapes of non-negative integers (the op's "
                                        f"tensors in the C API's order), got {_shown(cells.get('tensor_view_shapes'))}")
    for s in shapes:
        if any(d > MAX_DIM for d in s) or math.prod(s) > MAX_ELEMENTS:
            raise bad("tensor_view_shapes", f"{tuple(s)} is too large (at most {MAX_DIM} in a dimension and "
                                            f"{MAX_ELEMENTS} elements in a tensor)")
    dtypes = cell("tensor_dtypes")
    if isinstance(dtypes, str):
        dtypes = (dtypes,)
    if not isinstance(dtypes, (tuple, list)) or len(dtypes) not in (1, n_tensors) or not all(
            isinstance(d, str) and d.lower() in _DTYPES for d in dtypes):
        raise bad("tensor_dtypes", f"must give 1 or {n_tensors} of {', '.join(sorted(set(_DTYPES)))}, "
                                   f"got {_shown(cells.get('tensor_dtypes'))}")
    dts = [_DTYPES[d.lower()] for d in dtypes] * (n_tensors if len(dtypes) == 1 else 1)
    attrs = cell("attributes")
    known = _BACKWARD_ATTRS if api == BACKWARD_API else _FORWARD_ATTRS
    if not isinstance(attrs, dict) or not all(isinstance(k, str) and k in known for k in attrs):
        raise bad("attributes", f"must be a dict of {', '.join(known)}, got {_shown(cells.get('attributes'))}")
    for k, v in attrs.items():
        if not isinstance(v, int):
            raise bad("attributes", f"{k} must be an integer (or True/False), got {_shown(repr(v))}")
    if api == BACKWARD_API and "topK" not in attrs:
        raise bad("attributes", "topK is required")
    tols = cell("precision_tolerances")
    if tols is None:
        tols = ()
    if not isinstance(tols, (tuple, list)) or not all(
            isinstance(t, (tuple, list)) and len(t) == 2 and all(_number(v) and v >= 0 for v in t) for t in tols):
        raise bad("precision_tolerances",
                  f"must be (rtol, ptol) pairs, got {_shown(cells.get('precision_tolerances'))}")
    atol = cell("absolute_precision")
    if atol is not None and not (_number(atol) and atol >= 0):
        raise bad("absolute_precision", f"must be a number >= 0, got {_shown(cells.get('absolute_precision'))}")
    ranges = cell("input_data_ranges")
    if ranges is None:
        ranges = ()
    if not isinstance(ranges, (tuple, list)) or not all(
            isinstance(r, (tuple, list)) and len(r) == 2 and all(v is None or _number(v) for v in r) for r in ranges):
        raise bad("input_data_ranges", f"must be (low, high) pairs, got {_shown(cells.get('input_data_ranges'))}")
    spans = [(float(_DEFAULT_RANGE[0] if lo is None else lo), float(_DEFAULT_RANGE[1] if hi is None else hi))
             for lo, hi in ranges]
    if any(lo > hi or not (math.isfinite(lo) and math.isfinite(hi)) for lo, hi in spans[:1]):
        raise bad("input_data_ranges", f"the first input's range must be finite with low <= high, got {spans[0]}")
    row = KitRow(file, line, name, api, [tuple(s) for s in shapes], dts, dict(attrs),
                 [(float(a), float(b)) for a, b in tols], None if atol is None else float(atol), spans,
                 {k: (cells.get(k) or "").strip() for k in ("tensor_view_shapes", "tensor_dtypes", "attributes")})
    _check_geometry(row, bad)
    return row


def _shown(text: str | None, at_most: int = 80) -> str:
    """A cell as an error message quotes it: repr (control characters escaped), cut short."""
    r = repr(text)
    return r if len(r) <= at_most else f"{r[:at_most]}... ({len(text or '')} characters)"


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_geometry(row: KitRow, bad: Any) -> None:
    """What the inputs are made from must hold together (the op itself judges the rest)."""
    if row.api == BACKWARD_API:
        x, idx = row.shapes[0], row.shapes[1]
        k = row.attributes["topK"]
        if len(idx) != 1 or len(x) not in (2, 3) or k < 1 or idx[0] % k:
            raise bad("tensor_view_shapes", f"the backward needs gradExpandedX of 2 or 3 dims and expandedRowIdx of "
                                            f"1 dim whose length topK={k} divides, got {x} and {idx}")
        if row.dtypes[1] != "int32" or row.dtypes[0] == "int32":
            raise bad("tensor_dtypes", "gradExpandedX must be a float type and expandedRowIdx int32")
        if tuple(row.shapes[2]) != (idx[0] // k, x[-1]):
            raise bad("tensor_view_shapes", f"out must be (len(expandedRowIdx) / topK, H) = {(idx[0] // k, x[-1])}, "
                                            f"got {row.shapes[2]}")
    else:
        x, ids = row.shapes[0], row.shapes[1]
        if len(x) != 2 or len(ids) != 2 or x[0] != ids[0]:
            raise bad("tensor_view_shapes", f"the forward needs x (N, H) and expertIdx (N, K), got {x} and {ids}")
        if row.dtypes[1] != "int32" or row.dtypes[0] == "int32":
            raise bad("tensor_dtypes", "x must be a float type and expertIdx int32")


def load(paths: Sequence[str]) -> list[Case]:
    """The cases of every row of every file, each checked before any runs (CaseFileError)."""
    rows: list[KitRow] = []
    seen: dict[str, str] = {}
    for path in paths:
        try:
            with open(path, newline="") as f:
                lines = list(csv.reader(f))
        except OSError as exc:
            raise CaseFileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
        except (csv.Error, UnicodeDecodeError) as exc:
            raise CaseFileError(f"{path}: not a CSV file ({exc})") from None
        numbered = [(i + 1, r) for i, r in enumerate(lines) if any(c.strip() for c in r)]
        if not numbered:
            raise CaseFileError(f"{path}: empty")
        header_line, header = numbered[0]
        names = [h.strip() for h in header]
        missing = [c for c in REQUIRED if c not in names]
        if missing:
            raise CaseFileError(f"{path}: row {header_line}, the header lacks the column(s) {', '.join(missing)}")
        if not numbered[1:]:
            raise CaseFileError(f"{path}: no case rows")
        for line, cells in numbered[1:]:
            if len(cells) != len(names):
                raise CaseFileError(f"{path}: row {line}: {len(cells)} cells for {len(names)} columns")
            row = _parse_row(path, line, dict(zip(names, cells)))
            if row.name in seen:
                raise CaseFileError(f"{path}: row {line}, column testcase_name: {_shown(row.name)} is also a case of "
                                    f"{seen[row.name]}")
            seen[row.name] = f"{path} row {line}"
            rows.append(row)
    return [_case(r) for r in rows]


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, span: tuple[float, float]) -> np.ndarray:
    lo, hi = span
    values = np.full(shape, lo, np.float64) if lo == hi else rng.uniform(lo, hi, shape)
    return values.astype(np.float32).astype(_cases.DTYPES[dtype])


def _note(row: KitRow) -> str:
    return f"test-kit case {row.file} row {row.row}"


def _case(row: KitRow) -> Case:
    shape_text = row.text["tensor_view_shapes"]
    if row.api == BACKWARD_API:
        return Case(row.name, "positive", row.dtypes[0], _scenario(row), shape_text,
                    lambda ctx: _run_backward(ctx, row), source="op", nbytes=_nbytes(row), op="backward",
                    judged_by="reference")
    return Case(row.name, "positive", row.dtypes[0], "dropless" if not row.attributes.get("dropPadModeOptional")
                else "drop-pad", shape_text, lambda ctx: _run_forward(ctx, row), source="op", nbytes=_nbytes(row),
                op="forward", judged_by="reference")


def _scenario(row: KitRow) -> str:
    a = row.attributes
    return "drop-pad" if a.get("dropPadMode") == 1 else "active" if a.get("activeNum", 0) > 0 else "dropless"


def _nbytes(row: KitRow) -> int:
    return sum(math.prod(s) * _cases.DTYPES.get(d, np.dtype(np.int32)).itemsize for s, d in zip(row.shapes, row.dtypes))


def _run_backward(ctx: Context, row: KitRow) -> CaseResult:
    """The backward's inputs as the op's test golden in the vendor's repository makes them:
    gradExpandedX uniform in its range; expandedRowIdx drawn uniformly from the rows of
    gradExpandedX, repeats allowed, and -1 from activeNum on in drop/pad mode. Repeated indices
    are outside the binding's documented contract, so the binding's host checks are off."""
    t0 = time.perf_counter()
    rng = ctx.rng(row.name)
    a = row.attributes
    k, mode, active = int(a["topK"]), int(a.get("dropPadMode", 0)), int(a.get("activeNum", 0))
    xs, (bsk,) = row.shapes[0], row.shapes[1]
    x = _uniform(rng, xs, row.dtypes[0], row.ranges[0] if row.ranges else _DEFAULT_RANGE)
    rows = int(np.prod(xs[:-1], dtype=np.int64))
    idx = rng.integers(0, max(rows, 1), bsk, dtype=np.int32) if rows else np.zeros(bsk, np.int32)
    if mode == 1 and 0 < active < bsk:
        idx[active:] = -1
    s = ctx.stream
    got = ctx.measured(_backward_call, x, idx, k, mode, active, s)
    want = reference.moe_init_routing_v2_grad(x, idx, k, mode, active, validate=False, chip=chip())
    rtol, ptol = row.tolerances[0] if row.tolerances else (None, None)
    j = precision.judge(ctx.standard, got, want, row.dtypes[0], rtol=rtol, ptol=ptol, atol=row.atol)
    m = j.metrics
    note = f"{_note(row)}; indices drawn as the vendor's golden draws them (repeats allowed, outside the " \
           f"documented contract): run with the binding's host checks off"
    return CaseResult(row.name, "positive", row.dtypes[0], _scenario(row), row.text["tensor_view_shapes"], j.passed,
                      time.perf_counter() - t0, m["max_abs_error"], m["max_rel_error"],
                      round(m["mismatch_ratio"] * m["elements"]), m["elements"],
                      detail=note if j.passed else f"{j.standard}: {j.reason}; {note}", digest=digest(got),
                      standard=j.standard, thresholds=j.thresholds, metrics=m, attributes=row.text["attributes"])


def _backward_call(x: np.ndarray, idx: np.ndarray, k: int, mode: int, active: int, s: Any) -> np.ndarray:
    from ..op.moe_init_routing_v2_grad import moe_init_routing_v2_grad

    return moe_init_routing_v2_grad(to_device(x, stream=s), to_device(idx, stream=s), k, mode, active, stream=s,
                                    validate=False).to_host(s)


def _run_forward(ctx: Context, row: KitRow) -> CaseResult:
    """The forward's inputs as the op's test golden makes them: x uniform in its range (the
    kit's -2 to 2 when the file gives none), expertIdx uniform over the experts (over 100 when
    expertNum is not positive). Its outputs only move data: judged bit for bit."""
    t0 = time.perf_counter()
    rng = ctx.rng(row.name)
    a = row.attributes
    attrs: dict[str, Any] = {
        "active_num": int(a.get("activeNumOptional", 0)),
        "expert_capacity": int(a.get("expertCapacityOptional", 0)),
        "expert_num": int(a.get("expertNumOptional", 0)),
        "drop_pad_mode": int(a.get("dropPadModeOptional", 0)),
        "expert_tokens_count_or_cumsum_flag": int(a.get("expertTokensCountOrCumsumFlagOptional", 0)),
        "expert_tokens_before_capacity_flag": bool(a.get("expertTokensBeforeCapacityFlagOptional", False)),
    }
    x = _uniform(rng, row.shapes[0], row.dtypes[0], row.ranges[0] if row.ranges else _DEFAULT_RANGE)
    experts = attrs["expert_num"] if attrs["expert_num"] > 0 else 100
    ids = rng.integers(0, experts, row.shapes[1], dtype=np.int32)
    s = ctx.stream
    r = ctx.measured(moe_init_routing_v2, to_device(x, stream=s), to_device(ids, stream=s), **attrs, stream=s)
    got = [None if o is None else o.to_host(s) for o in r]
    want = reference.moe_init_routing_v2(x, ids, **attrs, chip=chip())
    wrong = []
    for field, g, w in zip(("expanded_x", "expanded_row_idx", "expert_tokens_count_or_cumsum",
                            "expert_tokens_before_capacity"), got, want):
        if (g is None) != (w is None):
            wrong.append(f"{field} {'missing' if g is None else 'not expected'}")
        elif g is not None and w is not None and not precision.judge("exact", g, w, _cases.dtype_name(w.dtype)).passed:
            wrong.append(f"{field} differs in its bits from the reference")
    m = precision.judge("exact", got[0], want[0], row.dtypes[0]).metrics if got[0] is not None and \
        want[0] is not None and got[0].shape == want[0].shape else None
    note = _note(row)
    return CaseResult(row.name, "positive", row.dtypes[0], "drop-pad" if attrs["drop_pad_mode"] else "dropless",
                      row.text["tensor_view_shapes"], not wrong, time.perf_counter() - t0,
                      m["max_abs_error"] if m else None, m["max_rel_error"] if m else None,
                      detail="; ".join([*wrong, note]), standard="exact", thresholds={}, metrics=m,
                      digest=digest(np.concatenate([np.ascontiguousarray(o).view(np.uint8).reshape(-1)
                                                    for o in got if o is not None])),
                      attributes=row.text["attributes"])
