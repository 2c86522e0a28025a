"""What a conformance case is: its description, the context it runs in, and what it reports.
Shared by the catalogue of the backward (:mod:`.conformance`) and that of the forward and the
pair (:mod:`.pair`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..release import BEHAVIOURS, OpBehaviour
from ..stream import Stream
from . import cases as _cases

__all__ = ["JUDGES", "OPS", "OUTCOMES", "SOURCES", "Case", "CaseResult", "Context", "digest"]

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

    def expected(self, status: int | str) -> int:
        """The status the release under test must give: ``status`` itself (every release gives
        it), or the value of the behaviour field it names ("tiling_status", ...)."""
        return status if isinstance(status, int) else int(getattr(self.behaviour, status))

    # Each case derives its own generator from the seed and its name, so a case gives the
    # same inputs whatever else runs, and --filter reproduces a failure exactly.
    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, *name.encode()])


def digest(out: np.ndarray) -> str:
    """The digest of an output's bytes (C order): equal digests mean bit-identical results."""
    return "sha256:" + hashlib.sha256(np.ascontiguousarray(out).tobytes()).hexdigest()
