"""Cases from the vendor's operator test kit's case files: ``conformance --cases FILE.csv`` and
``--cases FILE.json`` (the ATK format, :func:`load_atk`).

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
naming the file, the row and the column (the case, in an ATK file).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .. import reference
from .._paths import read_regular
from .._contract import forward_scenario, scenario
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
    # ATK rows only: each input tensor's values, (kind, low, high) with kind "uniform" or
    # "fill"; the attributes drawn from a range (name -> (low, high)); the file's standard.
    values: list[tuple[str, float, float]] = field(default_factory=list)
    drawn: dict[str, tuple[int, int]] = field(default_factory=dict)
    standard: str | None = None
    standard_text: str = ""


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
    if any(lo > hi or not math.isfinite(hi - lo) for lo, hi in spans[:1]):  # (an infinite width: no uniform draw)
        raise bad("input_data_ranges", f"the first input's range must be finite with low <= high and high - low "
                                       f"finite, got {spans[0]}")
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


def load(paths: Sequence[str], own_standards: bool = True) -> list[Case]:
    """The cases of every row of every file, each checked before any runs (CaseFileError). A
    file whose name ends in ``.json`` is read as the ATK format (:func:`load_atk`);
    ``own_standards``: its cases are judged by the standard the file names (else by the run's)."""
    rows: list[KitRow] = []
    seen: dict[str, str] = {}
    for path in paths:
        if path.lower().endswith(".json"):
            for row in load_atk(path):
                if row.name in seen:
                    raise CaseFileError(f"{path}: case {row.text['case']}: its name {_shown(row.name)} is also a "
                                        f"case of {seen[row.name]}")
                seen[row.name] = f"{path} case {row.text['case']}"
                if not own_standards:
                    row.standard = None
                rows.append(row)
            continue
        names: list[str] | None = None
        before = len(rows)
        try:  # (row by row: each is checked as it is read, and what is kept is the parsed rows)
            for line, cells in enumerate(csv.reader(io.StringIO(_read(path).decode("utf-8"), newline="")), 1):
                if not any(c.strip() for c in cells):
                    continue
                if names is None:
                    names = [h.strip() for h in cells]
                    if missing := [c for c in REQUIRED if c not in names]:
                        raise CaseFileError(f"{path}: row {line}, the header lacks the column(s) {', '.join(missing)}")
                    continue
                if len(cells) != len(names):
                    raise CaseFileError(f"{path}: row {line}: {len(cells)} cells for {len(names)} columns")
                if len(rows) >= MAX_CASES:
                    raise CaseFileError(f"{path}: more than {MAX_CASES} cases in all")
                row = _parse_row(path, line, dict(zip(names, cells)))
                if row.name in seen:
                    raise CaseFileError(f"{path}: row {line}, column testcase_name: {_shown(row.name)} is also a case "
                                        f"of {seen[row.name]}")
                seen[row.name] = f"{path} row {line}"
                rows.append(row)
        except (csv.Error, UnicodeDecodeError) as exc:
            raise CaseFileError(f"{path}: not a CSV file ({_shown(str(exc), 160)})") from None
        if names is None:
            raise CaseFileError(f"{path}: empty")
        if len(rows) == before:
            raise CaseFileError(f"{path}: no case rows")
    return [_case(r) for r in rows]


def _read(path: str) -> bytes:
    """A case file's bytes, at most MAX_CASE_FILE of them, from a regular file only."""
    try:
        data = read_regular(path, MAX_CASE_FILE)
    except OSError as exc:
        raise CaseFileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > MAX_CASE_FILE:
        raise CaseFileError(f"{path}: larger than {MAX_CASE_FILE} bytes")
    return data


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, span: tuple[float, float]) -> np.ndarray:
    lo, hi = span
    values = np.full(shape, lo, np.float64) if lo == hi else rng.uniform(lo, hi, shape)
    return values.astype(np.float32).astype(_cases.DTYPES[dtype])


def _note(row: KitRow) -> str:
    return f"test-kit case {row.file} row {row.row}"


def _case(row: KitRow) -> Case:
    shape_text = row.text["tensor_view_shapes"]
    if row.values:
        return _atk_case(row)
    if row.api == BACKWARD_API:
        return Case(row.name, "positive", row.dtypes[0], _scenario(row), shape_text,
                    lambda ctx: _run_backward(ctx, row), source="op", nbytes=_nbytes(row), op="backward",
                    judged_by="reference")
    return Case(row.name, "positive", row.dtypes[0], _forward_scenario(row.attributes), shape_text,
                lambda ctx: _run_forward(ctx, row), source="op", nbytes=_nbytes(row), op="forward",
                judged_by="reference")


def _scenario(row: KitRow) -> str:
    a = row.attributes
    return scenario(int(a.get("dropPadMode", 0)), int(a.get("activeNum", 0)))


def _forward_scenario(a: dict[str, Any]) -> str:
    return forward_scenario(int(a.get("dropPadModeOptional", 0)), int(a.get("activeNumOptional", 0)))


def _forward_attrs(a: dict[str, Any]) -> dict[str, Any]:
    """The forward's keyword arguments from a row's attributes (the kit's names, absent ones 0)."""
    return {
        "active_num": int(a.get("activeNumOptional", 0)),
        "expert_capacity": int(a.get("expertCapacityOptional", 0)),
        "expert_num": int(a.get("expertNumOptional", 0)),
        "drop_pad_mode": int(a.get("dropPadModeOptional", 0)),
        "expert_tokens_count_or_cumsum_flag": int(a.get("expertTokensCountOrCumsumFlagOptional", 0)),
        "expert_tokens_before_capacity_flag": bool(a.get("expertTokensBeforeCapacityFlagOptional", False)),
    }


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
                      standard=j.standard, thresholds=j.thresholds, metrics=m, attributes=row.text["attributes"],
                      host_checks=False)


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
    attrs = _forward_attrs(row.attributes)
    x = _uniform(rng, row.shapes[0], row.dtypes[0], row.ranges[0] if row.ranges else _DEFAULT_RANGE)
    experts = attrs["expert_num"] if attrs["expert_num"] > 0 else 100
    ids = rng.integers(0, experts, row.shapes[1], dtype=np.int32)
    s = ctx.stream
    r = ctx.measured(moe_init_routing_v2, to_device(x, stream=s), to_device(ids, stream=s), **attrs, stream=s)
    got = [None if o is None else o.to_host(s) for o in r]
    want = reference.moe_init_routing_v2(x, ids, **attrs, chip=chip())
    wrong = []
    for name, g, w in zip(("expanded_x", "expanded_row_idx", "expert_tokens_count_or_cumsum",
                           "expert_tokens_before_capacity"), got, want):
        if (g is None) != (w is None):
            wrong.append(f"{name} {'missing' if g is None else 'not expected'}")
        elif g is not None and w is not None and not precision.judge("exact", g, w, _cases.dtype_name(w.dtype)).passed:
            wrong.append(f"{name} differs in its bits from the reference")
    m = precision.judge("exact", got[0], want[0], row.dtypes[0]).metrics if got[0] is not None and \
        want[0] is not None and got[0].shape == want[0].shape else None
    note = _note(row)
    scen = forward_scenario(attrs["drop_pad_mode"], attrs["active_num"])
    return CaseResult(row.name, "positive", row.dtypes[0], scen,
                      row.text["tensor_view_shapes"], not wrong, time.perf_counter() - t0,
                      m["max_abs_error"] if m else None, m["max_rel_error"] if m else None,
                      detail="; ".join([*wrong, note]), standard="exact", thresholds={}, metrics=m,
                      digest=digest(np.concatenate([np.ascontiguousarray(o).view(np.uint8).reshape(-1)
                                                    for o in got if o is not None])),
                      attributes=row.text["attributes"])


# ---------------------------------------------------------------------------- ATK JSON files

# The ATK format, as the vendor's case files for these ops write it (ops-transformer
# moe/moe_init_routing_v2_grad/tests/st/aclnnMoeInitRoutingV2Grad/atk_aclnnMoeInitRoutingV2Grad.json
# and moe/moe_init_routing_v2/tests/st/aclnnMoeInitRoutingV2/atk_aclnnMoeInitRoutingV2.json): a
# list of cases, each with ``id``, ``aclnn_name``, ``standard`` ({"acc": name or {name: {...}}})
# and ``inputs``: the op's inputs by name, each ``type`` "tensor" or "attr", ``dtype``, ``shape``
# (tensors) and ``range_values``. docs/conformance.md, "ATK case files", says how each is read.
ATK_OPS = {"MoeInitRoutingV2Grad": BACKWARD_API, "MoeInitRoutingV2": FORWARD_API}
# api -> input name -> (type, accepted dtypes, required, the aclnn attribute name)
_ATK_INPUTS: dict[str, dict[str, tuple[str, tuple[str, ...], bool, str]]] = {
    BACKWARD_API: {
        "grad_expanded_x": ("tensor", ("float16", "bfloat16", "float32"), True, ""),
        "expanded_row_idx": ("tensor", ("int32",), True, ""),
        "top_k": ("attr", ("int",), True, "topK"),
        "drop_pad_mode": ("attr", ("int",), False, "dropPadMode"),
        "active_num": ("attr", ("int",), False, "activeNum"),
    },
    FORWARD_API: {
        "x": ("tensor", ("float16", "bfloat16", "float32"), True, ""),
        "expert_idx": ("tensor", ("int32", "int64"), True, ""),
        "active_num": ("attr", ("int",), False, "activeNumOptional"),
        "expert_capacity": ("attr", ("int",), False, "expertCapacityOptional"),
        "expert_num": ("attr", ("int",), False, "expertNumOptional"),
        "drop_pad_mode": ("attr", ("int",), False, "dropPadModeOptional"),
        "expert_tokens_count_or_cumsum_flag": ("attr", ("int",), False, "expertTokensCountOrCumsumFlagOptional"),
        "expert_tokens_before_capacity_flag": ("attr", ("bool",), False, "expertTokensBeforeCapacityFlagOptional"),
    },
}
_ATK_DTYPES = {"fp16": "float16", "float16": "float16", "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp32": "float32", "float32": "float32", "float": "float32", "int32": "int32", "int64": "int64",
               "int": "int", "bool": "bool"}
# The kit's accuracy standards, as our standards apply them (docs/conformance.md says what was
# read and what was not): single_bm, one golden (the community MERE/MARE standard: the test
# kit's stat_rel_err, hicann/ops-test-kit ttk/core_modules/comparison/stat_rel_err.py); default,
# the kit's routing by output dtype (ttk/core_modules/comparison/resolve.py, resolve_tolerance:
# integer outputs binary_equal, floating ones stat_rel_err).
ATK_STANDARDS = {"single_bm": "stat-rel-err", "default": "stat-rel-err"}
# A case file, either format: the vendor's largest is 216 KB. At 8 MiB a file of nothing but
# empty JSON objects, the worst for its parse, holds about 200 MB while it is read.
MAX_CASE_FILE = 8 << 20  # bytes
MAX_CASES = 100_000  # in all the files of one run
_SPECIAL = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf}


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 19 or abs(int(text)) > MAX_INT:
        raise ValueError(f"the integer {text[:24]}{'...' if len(text) > 24 else ''} is out of range (at most "
                         f"{MAX_INT} in size)")
    return int(text)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON (write \"nan\", \"inf\" or \"-inf\" as strings)")


def load_atk(path: str) -> list[KitRow]:
    """The cases of an ATK JSON file, each checked before any runs: CaseFileError naming the
    file and the case (by its id, or its place when it has none) and what is wrong."""
    data = _read(path)
    try:
        doc = json.loads(data.decode("utf-8"), parse_int=_bounded_int, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise CaseFileError(f"{path}: not an ATK JSON file ({_shown(str(exc), 160)})") from None
    if not isinstance(doc, list) or not doc:
        raise CaseFileError(f"{path}: an ATK file is a non-empty list of cases, got {type(doc).__name__}"
                            f"{'' if doc else ' (empty)'}")
    if len(doc) > MAX_CASES:
        raise CaseFileError(f"{path}: more than {MAX_CASES} cases")
    return [_atk_row(path, i, case) for i, case in enumerate(doc)]


def _atk_row(path: str, index: int, case: Any) -> KitRow:
    cid = case.get("id") if isinstance(case, dict) else None
    label = str(cid) if isinstance(cid, int) and not isinstance(cid, bool) else f"#{index + 1} (no id)"

    def bad(where: str, why: str) -> CaseFileError:
        return CaseFileError(f"{path}: case {label}: {where}: {why}")

    if not isinstance(case, dict):
        raise bad("the case", f"must be an object, got {type(case).__name__}")
    op = case.get("aclnn_name")
    api = ATK_OPS.get(op) if isinstance(op, str) else None
    if api is None:
        raise bad("aclnn_name", f"must be {' or '.join(ATK_OPS)}, got {_shown(repr(case.get('aclnn_name')))}")
    spec = _ATK_INPUTS[api]
    inputs = case.get("inputs")
    if not isinstance(inputs, list) or not all(isinstance(i, dict) for i in inputs):
        raise bad("inputs", "must be a list of objects, one per input")
    given: dict[str, dict[str, Any]] = {}
    for item in inputs:
        name = item.get("name")
        if not isinstance(name, str) or name not in spec:
            raise bad("inputs", f"{_shown(repr(name))} is not an input of {op} (its inputs: "
                                f"{', '.join(spec)})")
        if name in given:
            raise bad(f"input {name}", "given twice")
        given[name] = item
    missing = [n for n, (_t, _d, required, _a) in spec.items() if required and n not in given]
    if missing:
        raise bad("inputs", f"lacks {', '.join(missing)}")
    tensors: list[tuple[tuple[int, ...], str, tuple[str, float, float]]] = []
    attrs: dict[str, Any] = {}
    drawn: dict[str, tuple[int, int]] = {}
    for name, (kind, dtypes, _required, aclnn) in spec.items():
        if name not in given:
            continue
        item = given[name]
        if item.get("type") != kind:
            raise bad(f"input {name}", f"type must be {kind!r}, got {_shown(repr(item.get('type')))}")
        dtype = _ATK_DTYPES.get(str(item.get("dtype")).lower()) if isinstance(item.get("dtype"), str) else None
        if dtype not in dtypes:
            raise bad(f"input {name}", f"dtype must be one of {', '.join(dtypes)} (or their short forms), got "
                                       f"{_shown(repr(item.get('dtype')))}")
        rv = item.get("range_values")
        try:
            if kind == "tensor":
                shape = item.get("shape")
                if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and
                                                          0 <= d <= MAX_DIM for d in shape) or \
                        math.prod(shape) > MAX_ELEMENTS:
                    raise ValueError(f"shape must be a list of dimensions from 0 to {MAX_DIM} of at most "
                                     f"{MAX_ELEMENTS} elements, got {_shown(repr(shape))}")
                tensors.append((tuple(shape), dtype, _atk_values(rv, dtype)))
            elif dtype == "bool":
                if not isinstance(rv, bool):
                    raise ValueError(f"range_values must be true or false, got {_shown(repr(rv))}")
                attrs[aclnn] = rv
            else:
                lo, hi = _atk_int_range(rv)
                if lo == hi:
                    attrs[aclnn] = lo
                else:
                    attrs[aclnn], drawn[aclnn] = lo, (lo, hi)
        except ValueError as exc:
            raise bad(f"input {name}", str(exc)) from None
    acc = case.get("standard", {"acc": "default"})
    acc = acc.get("acc", "default") if isinstance(acc, dict) else acc
    std_name = next(iter(acc)) if isinstance(acc, dict) and len(acc) == 1 else acc
    if not isinstance(std_name, str) or std_name not in ATK_STANDARDS:
        raise bad("standard", f"acc must name one of the kit's standards {', '.join(ATK_STANDARDS)}, got "
                              f"{_shown(repr(acc))}")
    (xs, xdt, xv), (ids, idt, iv) = tensors
    fixed = {k: v for k, v in attrs.items() if k not in drawn}
    text = {"tensor_view_shapes": repr((xs, ids)), "tensor_dtypes": repr((xdt, idt)),
            "attributes": repr({**fixed, **{k: list(r) for k, r in drawn.items()}}), "case": label}
    row = KitRow(path, index + 1, f"{Path(path).stem}#{label}", api, [xs, ids], [xdt, idt], attrs, [], None, [],
                 text, values=[xv, iv], drawn=drawn, standard=ATK_STANDARDS[std_name],
                 standard_text=f"ATK {std_name}" + (f" {json.dumps(acc[std_name])}" if isinstance(acc, dict) else ""))
    if api == BACKWARD_API and (len(ids) != 1 or len(xs) not in (2, 3)):
        raise bad("inputs", f"grad_expanded_x must have 2 or 3 dimensions and expanded_row_idx 1, got {xs} and {ids}")
    if api == FORWARD_API and (len(xs) != 2 or len(ids) not in (1, 2) or xs[0] != ids[0]):
        raise bad("inputs", f"x must be (N, H) and expert_idx (N, K) or (N,), got {xs} and {ids}")
    return row


def _atk_number(v: Any) -> float:
    if isinstance(v, str) and v.strip().lower() in _SPECIAL:
        return _SPECIAL[v.strip().lower()]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"a value must be a number or \"nan\", \"inf\" or \"-inf\", got {_shown(repr(v))}")
    return float(v)


def _atk_values(rv: Any, dtype: str) -> tuple[str, float, float]:
    """A tensor's range_values: [low, high] (uniform between them; a bound of +-inf stands for
    the dtype's largest finite value, as the test kit reads it: hicann/ops-test-kit
    ttk/utilities/data.py, RandomData._digitize_inf_nan), [v] or [v, v] (every element v, NaN and
    infinities included)."""
    items = rv if isinstance(rv, list) else [rv]
    if len(items) not in (1, 2):
        raise ValueError(f"range_values must be [value] or [low, high], got {_shown(repr(rv))}")
    vals = [_atk_number(v) for v in items]
    lo, hi = vals[0], vals[-1]
    integer = dtype.startswith("int")
    if integer and not all(math.isfinite(v) and v == int(v) for v in vals):
        raise ValueError(f"an integer tensor's range_values must be whole numbers, got {_shown(repr(rv))}")
    if integer and not all(np.iinfo(dtype).min <= v <= np.iinfo(dtype).max for v in vals):
        raise ValueError(f"range_values {_shown(repr(rv))} do not fit {dtype}")
    if math.isnan(lo) or math.isnan(hi):
        if not (math.isnan(lo) and math.isnan(hi)):
            raise ValueError(f"range_values mixes NaN with a number: {_shown(repr(rv))}")
        return ("fill", lo, hi)
    if lo > hi:
        raise ValueError(f"range_values low {lo:g} is above high {hi:g}")
    if lo == hi:
        return ("fill", lo, hi)
    big = math.inf
    if not integer:
        big = float(ml_dtypes.finfo(_cases.DTYPES[dtype]).max)  # type: ignore[no-untyped-call]
    return ("uniform", max(lo, -big), min(hi, big))


def _atk_int_range(rv: Any) -> tuple[int, int]:
    items = rv if isinstance(rv, list) else [rv]
    if len(items) not in (1, 2) or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ValueError(f"range_values must be an integer or [low, high] integers, got {_shown(repr(rv))}")
    lo, hi = items[0], items[-1]
    if lo > hi:
        raise ValueError(f"range_values low {lo} is above high {hi}")
    return lo, hi


def _atk_tensor(rng: np.random.Generator, shape: tuple[int, ...], dtype: str,
                spec: tuple[str, float, float]) -> np.ndarray:
    kind, lo, hi = spec
    if dtype.startswith("int"):
        if kind == "fill":
            return np.full(shape, int(lo), dtype)
        return rng.integers(int(lo), int(hi), shape, dtype=np.int64, endpoint=True).astype(dtype)
    if kind == "fill":
        return np.full(shape, lo, np.float32).astype(_cases.DTYPES[dtype])
    return _uniform(rng, shape, dtype, (lo, hi))


def _atk_case(row: KitRow) -> Case:
    a = row.attributes
    if row.api == BACKWARD_API:
        return Case(row.name, "positive", row.dtypes[0], _scenario(row), row.text["tensor_view_shapes"],
                    lambda ctx: _run_atk(ctx, row), source="op", nbytes=3 * _nbytes(row), op="backward",
                    judged_by="reference")
    return Case(row.name, "positive", row.dtypes[0], _forward_scenario(a), row.text["tensor_view_shapes"],
                lambda ctx: _run_atk(ctx, row), source="op",
                nbytes=3 * _nbytes(row), op="forward", judged_by="reference")


def _run_atk(ctx: Context, row: KitRow) -> CaseResult:
    """An ATK case: its inputs drawn as its ranges say (every tensor, the indices included;
    attributes given as a range drawn in it), run, and judged against the reference of the
    chip by the file's standard (or the run's, when ``--standard`` was given)."""
    from ..errors import AclError, InvalidArgument

    t0 = time.perf_counter()
    rng = ctx.rng(row.name)
    attrs = {**row.attributes, **{k: int(rng.integers(lo, hi, endpoint=True)) for k, (lo, hi) in row.drawn.items()}}
    x = _atk_tensor(rng, row.shapes[0], row.dtypes[0], row.values[0])
    ids = _atk_tensor(rng, row.shapes[1], row.dtypes[1], row.values[1])
    standard = row.standard or ctx.standard
    shown = {k: (int(v) if not isinstance(v, bool) else v) for k, v in attrs.items()}
    note = f"{row.standard_text or 'ATK case'} of {row.file}, judged by {standard}; attributes {shown}"
    scen = "dropless"
    got: list[np.ndarray | None]
    want: list[np.ndarray | None]
    try:
        if row.api == BACKWARD_API:
            k, mode, active = int(attrs["topK"]), int(attrs.get("dropPadMode", 0)), int(attrs.get("activeNum", 0))
            scen = scenario(mode, active)
            got = [ctx.measured(_backward_call, x, ids, k, mode, active, ctx.stream)]
            want = [reference.moe_init_routing_v2_grad(x, ids, k, mode, active, validate=False, chip=chip())]
        else:
            kw = _forward_attrs(attrs)
            scen = forward_scenario(kw["drop_pad_mode"], kw["active_num"])
            s = ctx.stream
            r = ctx.measured(moe_init_routing_v2, to_device(x, stream=s), to_device(ids, stream=s), **kw, stream=s)
            got = [None if o is None else o.to_host(s) for o in r]
            want = list(reference.moe_init_routing_v2(x, ids, **kw, chip=chip()))
    except (AclError, InvalidArgument, IndexError) as exc:
        status = exc.status if isinstance(exc, AclError) else None
        return CaseResult(row.name, "positive", row.dtypes[0], scen, row.text["tensor_view_shapes"], False,
                          time.perf_counter() - t0, status=status, detail=f"{exc}; {note}", source="op",
                          attributes=row.text["attributes"], host_checks=row.api != BACKWARD_API)
    wrong, first = [], None
    for field_name, g, w in zip(("out", "expanded_x", "expanded_row_idx", "expert_tokens_count_or_cumsum",
                                 "expert_tokens_before_capacity")[0 if row.api == BACKWARD_API else 1:], got, want):
        if (g is None) != (w is None):
            wrong.append(f"{field_name} {'missing' if g is None else 'not expected'}")
            continue
        if g is None or w is None:
            continue
        name = _cases.dtype_name(w.dtype)
        # Integer outputs are judged bit for bit under every standard (the kit's binary_equal).
        std = "exact" if name.startswith("int") else standard
        j = precision.judge(std, g, w, name, pyacl=ctx.standards.get(name))
        first = first or j
        if not j.passed:
            wrong.append(f"{field_name}: {std}: {j.reason}")
    m = first.metrics if first else {}
    return CaseResult(row.name, "positive", row.dtypes[0], scen, row.text["tensor_view_shapes"], not wrong,
                      time.perf_counter() - t0, m.get("max_abs_error"), m.get("max_rel_error"),
                      detail="; ".join([*wrong, note]), source="op",
                      digest=digest(np.concatenate([np.ascontiguousarray(o).view(np.uint8).reshape(-1)
                                                    for o in got if o is not None])),
                      standard=standard, thresholds=first.thresholds if first else {}, metrics=m,
                      attributes=row.text["attributes"], host_checks=row.api != BACKWARD_API)
