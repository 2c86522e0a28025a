"""What a conformance case is: its description, the context it runs in, and what it reports.
Shared by the catalogue of the backward (:mod:`.conformance`) and that of the forward and the
pair (:mod:`.pair`)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._contract import Chip, chip_named
from ..array import DeviceArray, empty, from_pointer
from ..release import BEHAVIOURS, OpBehaviour
from ..stream import Event, Stream
from . import cases as _cases

__all__ = ["JUDGES", "OPS", "OUTCOMES", "SOURCES", "Case", "CaseResult", "Context", "Guarded", "digest"]

# Where a case's expectation comes from: "op", the vendor op's own files (docs, tiling,
# kernel); "nnopbase", CANN's generic aclnn layer as read from the public opbase source
# (inferred: newer than some releases, so a mismatch on hardware means CANN differs from the
# inferred rule); "binding", pyacl_moe's own contract.
SOURCES = ("op", "nnopbase", "binding")


# How a case ended, as reported: the op met the expectation; it did not; the case could not
# be run (a crash of the harness, not a verdict on the op); it missed an expectation inferred
# from the opbase source (reported, fails only under strict); it was left out (memory budget).
OUTCOMES = ("pass", "fail", "error", "differs", "skipped")

# What a case runs: the backward (aclnnMoeInitRoutingV2Grad), the forward
# (aclnnMoeInitRoutingV2), or both, the forward's outputs feeding the backward.
OPS = ("backward", "forward", "pair")

# What a verdict compares with: the golden reference (pyacl_moe.reference); a status code;
# a second launch; an identity between the two ops, which needs no reference at all.
JUDGES = ("reference", "status", "rerun", "identity")


@dataclass
class CaseResult:
    name: str
    kind: str  # positive | negative | determinism | adjoint | round-trip
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
    outcome: str = ""  # one of OUTCOMES, set by the runner
    digest: str | None = None  # sha256 of the output bytes, for --baseline
    device: int | None = None
    nbytes: int = 0  # inputs and outputs, for --max-memory
    op: str = "backward"  # one of OPS, set by the runner
    judged_by: str = "reference"  # one of JUDGES, set by the runner
    # A numeric result judged against a golden: the standard applied (tools.precision), its
    # thresholds and the metrics it read.
    standard: str | None = None
    thresholds: dict[str, float] | None = None
    metrics: dict[str, Any] | None = None
    # A launch into poisoned, guarded memory (Guarded): "ok", or "oob" when a guard band changed.
    memory_status: str | None = None
    # --perf: medians over the timed runs of the host time of the op's call (both phases) and
    # of the device time between events recorded around it on its stream.
    api_us: float | None = None
    device_us: float | None = None
    attributes: str = ""  # the case's attributes as given (a test-kit row's), for the CSV report
    # False: the op was called with the binding's host checks off (a test-kit row of the
    # backward, whose indices are drawn as the vendor's golden draws them, repeats allowed).
    host_checks: bool = True

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
    nbytes: int = 0  # device inputs and outputs; 0 for the small fixed-size refusals
    op: str = "backward"  # one of OPS: what the case runs
    judged_by: str = "reference"  # one of JUDGES: what its verdict compares with


ARCH35_ACCEPTS = "arch35-accepts:"


@dataclass
class Context:
    seed: int
    stream: Stream
    exact: bool = False
    # Per dtype, the standard a result is judged by (the documented one unless overridden).
    standards: dict[str, _cases.Standard] = field(default_factory=lambda: dict(_cases.STANDARDS))
    # What the release under test does where releases differ (pyacl_moe.release).
    behaviour: OpBehaviour = BEHAVIOURS[-1]
    # The precision standard numeric results are judged by (tools.precision.STANDARD_NAMES).
    standard: str = "pyacl"
    # --perf: how many more times each passing case runs, timed; and while it does, the (api
    # seconds, device milliseconds) of each measured call.
    perf: int = 0
    timings: list[tuple[float, float]] | None = None
    # The chip the cases run on, with its release's rules (pyacl_moe.release.chip_for).
    chip: Chip = field(default_factory=lambda: chip_named(None))

    def measured(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, the op's call (both phases, on ``self.stream``), timed while
        --perf reruns the case: host time around the call, device time between events recorded
        on the stream before and after it (a refused call is timed as well)."""
        if self.timings is None:
            return fn(*args, **kwargs)
        dev = self.stream.device
        start, end = Event(dev), Event(dev)
        try:
            start.record(self.stream)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                api = time.perf_counter() - t0
                end.record(self.stream)
                end.synchronize()
                self.timings.append((api, start.elapsed_ms(end)))
        finally:
            start.close()
            end.close()

    def expected(self, status: int | str) -> int:
        """The status the release under test must give: ``status`` itself (every release gives
        it), or the value of the behaviour field it names ("tiling_status", ...); with the
        prefix "arch35-accepts:" 0 on a chip whose forward takes what the 910B refuses (the
        Ascend950: INT64 and 1-D ids, active_num <= 0), else that field's value."""
        if isinstance(status, str) and status.startswith(ARCH35_ACCEPTS):
            if self.chip.forward_relaxed:
                return 0
            status = status[len(ARCH35_ACCEPTS):]
        return status if isinstance(status, int) else int(getattr(self.behaviour, status))

    # Each case derives its own generator from the seed and its name, so a case gives the
    # same inputs whatever else runs, and --filter reproduces a failure exactly.
    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, *name.encode()])


GUARD_BYTES = 64  # each side; a multiple of every element size and of 32-byte alignment
GUARD_BYTE = 0xA5
# The poison an output starts as: a quiet NaN with a payload no kernel computes, per float type
# (as raw bits), so an element left unwritten is told from a NaN the op wrote.
POISON = {"float32": np.uint32(0x7FC0BAD1), "float16": np.uint16(0x7E5B), "bfloat16": np.uint16(0x7FDB)}


class Guarded:
    """Device memory for one tensor the kernel writes, inside guard bands: ``array`` views the
    middle, filled with the poison (outputs) or random bytes (a workspace); :meth:`check` reads
    it all back after the launch."""

    def __init__(self, name: str, shape: Sequence[int], dtype: Any, stream: Stream,
                 fill: np.ndarray | None = None) -> None:
        self.name, self.stream = name, stream
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(d) for d in shape)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self._base = empty((2 * GUARD_BYTES + self.nbytes,), np.uint8, stream.device)
        host = np.full(2 * GUARD_BYTES + self.nbytes, GUARD_BYTE, np.uint8)
        body = host[GUARD_BYTES:GUARD_BYTES + self.nbytes]
        if fill is not None:
            body[:] = fill.reshape(-1).view(np.uint8)[:self.nbytes]
        else:
            poison = POISON.get(_cases.dtype_name(self.dtype))
            body[:] = np.full(self.nbytes // self.dtype.itemsize, poison).view(np.uint8) if poison is not None \
                else 0xBD
        self._base.copy_from_host(host, stream=stream)
        self.array: DeviceArray = from_pointer(self._base.address + GUARD_BYTES, self.shape, self.dtype,
                                               owner=self._base)

    def guards_intact(self) -> bool:
        """Whether both guard bands still hold their pattern (reads only them back)."""
        n = GUARD_BYTES + self.nbytes
        return bool(np.all(self._base[:GUARD_BYTES].to_host(self.stream) == GUARD_BYTE)
                    and np.all(self._base[n:].to_host(self.stream) == GUARD_BYTE))

    def check(self) -> tuple[np.ndarray, str, int]:
        """(the tensor's bytes as written, "ok" or "oob", how many elements still hold the
        poison). "oob": a guard band changed, the kernel wrote outside the tensor."""
        raw = self._base.to_host(self.stream)
        lo, hi = raw[:GUARD_BYTES], raw[GUARD_BYTES + self.nbytes:]
        status = "ok" if bool(np.all(lo == GUARD_BYTE) and np.all(hi == GUARD_BYTE)) else "oob"
        body = raw[GUARD_BYTES:GUARD_BYTES + self.nbytes]
        got = body.view(self.dtype).reshape(self.shape)
        poison = POISON.get(_cases.dtype_name(self.dtype))
        left = int(np.count_nonzero(body.view(type(poison)) == poison)) if poison is not None else 0
        return got, status, left

    def where(self) -> str:
        raw = self._base.to_host(self.stream)
        sides = [side for side, band in (("before", raw[:GUARD_BYTES]), ("after", raw[GUARD_BYTES + self.nbytes:]))
                 if not np.all(band == GUARD_BYTE)]
        return f"{self.name} was written outside its {self.nbytes} bytes ({' and '.join(sides)} it)"


def digest(out: np.ndarray) -> str:
    """The digest of an output's bytes (C order): equal digests mean bit-identical results."""
    return "sha256:" + hashlib.sha256(np.ascontiguousarray(out).tobytes()).hexdigest()
