"""Property-based fuzzing of the one-call functions of both ops: hypothesis builds shapes,
dtypes, modes, attributes and index arrays, valid and invalid; a worker process runs each one.

Valid inputs must match the golden reference; invalid ones must raise InvalidArgument or an
AclError. Anything else (a wrong result, another exception, a crashed worker) fails.

The default run draws a few hundred examples ($PYACL_MOE_FUZZ_EXAMPLES sets how many); the
``slow`` variants draw thousands.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyacl_moe as pm
from pyacl_moe.tools.cases import compare

from . import fuzz_worker

HERE = Path(__file__).resolve().parent


class Worker:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, PYACL_MOE_EMULATOR="1")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "fuzz_worker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)

    def run(self, req: dict) -> tuple:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        try:
            fuzz_worker._write(self.proc.stdin, req)
            reply = fuzz_worker._read(self.proc.stdout)
        except (BrokenPipeError, OSError):
            reply = None
        if reply is None:
            code = self.proc.wait()
            self.proc = None
            return ("crash", code)
        return reply

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=30)
            self.proc = None


@pytest.fixture(scope="module")
def worker():
    if os.environ.get("PYACL_MOE_TEST_BACKEND", "emulator") != "emulator":
        pytest.skip("the fuzz worker runs on the emulator")
    w = Worker()
    yield w
    w.stop()


DATA = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)]
BAD_DATA = [np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.bool_)]


@st.composite
def cases(draw):
    scenario = draw(st.sampled_from(["dropless", "active", "drop-pad"]))
    k = draw(st.integers(1, 6))
    n = draw(st.integers(1, 12))
    h = draw(st.integers(1, 33))
    dtype = draw(st.sampled_from(DATA))
    bsk = n * k
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mode, active = 0, 0
    if scenario == "drop-pad":
        e, c = draw(st.integers(1, 4)), draw(st.integers(0, 6))
        slots = rng.permutation(bsk)
        kept = min(bsk, e * c, draw(st.integers(0, bsk)))
        idx = np.full(bsk, -1, np.int64)
        idx[slots[:kept]] = rng.permutation(e * c)[:kept]
        xshape: tuple[int, ...] = (e, c, h)
        mode = 1
    else:
        idx = rng.permutation(bsk).astype(np.int64)
        if scenario == "active":
            active = draw(st.integers(1, bsk))
            xshape = (active, h)
        else:
            xshape = (bsk, h)
    # Break it, or not.
    flaw = draw(st.sampled_from(["none"] * 6 + ["duplicate", "out-of-range", "minus-one", "top-k", "idx-dtype",
                                                "x-dtype", "rows", "mode", "active", "rank", "empty-h"]))
    idx_dtype = np.int32
    if flaw == "duplicate" and bsk > 1 and (idx >= 0).sum() > 1:
        kept_pos = np.flatnonzero(idx >= 0)
        idx[kept_pos[-1]] = idx[kept_pos[0]]
    elif flaw == "out-of-range":
        idx[draw(st.integers(0, bsk - 1))] = draw(st.sampled_from([bsk + 5, 10**6, -2, -(2**31)]))
    elif flaw == "minus-one" and mode == 0:
        idx[draw(st.integers(0, bsk - 1))] = -1
    elif flaw == "top-k":
        k = draw(st.sampled_from([0, -1, k + 1 if bsk % (k + 1) else k + 2, 2**40]))
    elif flaw == "idx-dtype":
        idx_dtype = draw(st.sampled_from([np.int64, np.float32, np.uint8]))
    elif flaw == "x-dtype":
        dtype = draw(st.sampled_from(BAD_DATA))
    elif flaw == "rows":
        xshape = (xshape[0] + draw(st.integers(1, 3)),) + xshape[1:]
    elif flaw == "mode":
        mode = draw(st.sampled_from([2, -1, 7]))
    elif flaw == "active":
        active = draw(st.sampled_from([-1, -(2**20)]))
    elif flaw == "rank":
        xshape = xshape + (1,) if mode == 0 else xshape[1:]
    elif flaw == "empty-h":
        xshape = xshape[:-1] + (0,)
    x = rng.standard_normal(xshape).astype(np.float32).astype(dtype) if dtype != np.bool_ else rng.random(xshape) > 0.5
    on_device = draw(st.booleans())
    return dict(x=x, idx=idx.astype(idx_dtype), top_k=k, drop_pad_mode=mode, active_num=active,
                validate=True, device=on_device, stream=on_device and draw(st.booleans()))


def _judge(req: dict, reply: tuple) -> None:
    assert reply[0] != "crash", f"the worker died (exit code {reply[1]}) on {req}"
    try:
        want = pm.reference.moe_init_routing_v2_grad(req["x"], req["idx"], req["top_k"], req["drop_pad_mode"],
                                                     req["active_num"])
    except pm.InvalidArgument as exc:
        values_only = exc.parameter == "expanded_row_idx" and ("range" in exc.rule or "once" in exc.rule)
        if req["device"] and values_only and reply[0] == "ok":
            # Index values on the device are the vendor's to judge (the binding checks them
            # only on the host): what it computed must be what the formula gives.
            want = pm.reference.moe_init_routing_v2_grad(req["x"], req["idx"], req["top_k"], req["drop_pad_mode"],
                                                         req["active_num"], validate=False)
            assert compare(reply[1], want).passed, "result differs from the reference"
            return
        assert reply[0] == "error", f"invalid input accepted (the reference says: {exc})"
        assert reply[3], f"invalid input raised {reply[1]}, not InvalidArgument or AclError: {reply[2]}"
        return
    assert reply[0] == "ok", f"valid input raised {reply[1]}: {reply[2]}"
    assert compare(reply[1], want).passed, "result differs from the reference"


EXAMPLES = int(os.environ.get("PYACL_MOE_FUZZ_EXAMPLES", "200"))  # the default run's; LONG_EXAMPLES: slow
LONG_EXAMPLES = 5000
HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def _one_call(worker, req) -> None:
    _judge(req, worker.run(req))


def _vendor_alone(worker, req) -> None:
    # validate=False: the vendor judges alone. Whatever it refuses, or faults on, must come
    # back as an AclError (or the binding's own refusal of what has no CANN type), never a
    # crash; inputs within the contract must compute right. Outside the contract the vendor
    # may compute something of its own (it skips active-mode indices past activeNum, reads a
    # 3-D input as flat rows): only that it does not crash is asserted.
    req = dict(req, validate=False, device=True)
    reply = worker.run(req)
    assert reply[0] != "crash", f"the worker died (exit code {reply[1]})"
    if reply[0] == "error":
        assert reply[1] in ("AclnnError", "AclRuntimeError", "InvalidArgument"), reply
    try:
        want = pm.reference.moe_init_routing_v2_grad(req["x"], req["idx"], req["top_k"], req["drop_pad_mode"],
                                                     req["active_num"])
    except pm.InvalidArgument:
        return
    assert reply[0] == "ok", f"valid input refused: {reply}"
    assert compare(reply[1], want).passed


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=HEALTH)
@given(req=cases())
def test_fuzz_one_call_function(worker, req):
    _one_call(worker, req)


@settings(max_examples=EXAMPLES // 4, deadline=None, suppress_health_check=HEALTH)
@given(req=cases())
def test_fuzz_vendor_checks_without_host_validation(worker, req):
    _vendor_alone(worker, req)


@pytest.mark.slow
@settings(max_examples=LONG_EXAMPLES, deadline=None, suppress_health_check=HEALTH)
@given(req=cases())
def test_fuzz_one_call_function_long(worker, req):
    _one_call(worker, req)


@pytest.mark.slow
@settings(max_examples=LONG_EXAMPLES // 4, deadline=None, suppress_health_check=HEALTH)
@given(req=cases())
def test_fuzz_vendor_checks_without_host_validation_long(worker, req):
    _vendor_alone(worker, req)


# ---------------------------------------------------------------------------- the forward

@st.composite
def forward_cases(draw):
    n, k, h = draw(st.integers(1, 10)), draw(st.integers(1, 5)), draw(st.integers(1, 17))
    experts = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mode = draw(st.sampled_from([0, 0, 1]))
    active = draw(st.sampled_from([0, 0, draw(st.integers(1, n * k + 3))])) if mode == 0 else 0
    capacity = draw(st.integers(1, n)) if mode == 1 else 0
    flag = draw(st.sampled_from([0, 1, 2])) if mode == 0 else 0
    before = mode == 1 and draw(st.booleans())
    xshape: tuple[int, ...] = (n, h)
    ishape: tuple[int, ...] = (n, k)
    dtype, idx_dtype = draw(st.sampled_from(DATA)), np.int32
    ids = rng.integers(0, experts, ishape)
    flaw = draw(st.sampled_from(["none"] * 6 + ["id-range", "negative-id", "x-dtype", "idx-dtype", "rows", "rank",
                                                "idx-rank", "mode", "flag", "capacity", "attr-negative"]))
    if flaw == "id-range":
        ids.flat[draw(st.integers(0, ids.size - 1))] = experts + draw(st.integers(0, 2**20))
    elif flaw == "negative-id":
        ids.flat[draw(st.integers(0, ids.size - 1))] = draw(st.sampled_from([-1, -(2**31)]))
    elif flaw == "x-dtype":
        dtype = draw(st.sampled_from(BAD_DATA))
    elif flaw == "idx-dtype":
        idx_dtype = draw(st.sampled_from([np.int64, np.float32, np.uint8]))
    elif flaw == "rows":
        xshape = (n + draw(st.integers(1, 3)), h)
    elif flaw == "rank":
        xshape = (n, h, 1)
    elif flaw == "idx-rank":
        ishape = (n * k,)
        ids = ids.reshape(ishape)
    elif flaw == "mode":
        mode = draw(st.sampled_from([2, -1]))
    elif flaw == "flag":
        flag = draw(st.sampled_from([3, -1]))
    elif flaw == "capacity":
        capacity = draw(st.sampled_from([0, n + 1, -1, 2**40])) if mode == 1 else capacity
    elif flaw == "attr-negative":
        active = -draw(st.integers(1, 2**31))
    x = rng.standard_normal(xshape).astype(np.float32).astype(dtype) if dtype != np.bool_ else rng.random(xshape) > 0.5
    return dict(op="forward", x=x, idx=ids.astype(idx_dtype), attrs=(active, capacity, experts, mode, flag, before),
                validate=draw(st.booleans()), device=draw(st.booleans()))


def _same_outputs(got: tuple, want: tuple) -> bool:
    return all((g is None) == (w is None) and (w is None or (g.shape == w.shape and g.dtype == w.dtype and
                                                             np.array_equal(g.view(np.uint8), w.view(np.uint8))))
               for g, w in zip(got, want))


def _judge_forward(req: dict, reply: tuple) -> None:
    """Valid inputs give the reference's outputs bit for bit. Invalid ones raise InvalidArgument
    or an AclError; with validate=False on the device the vendor judges alone, and where its
    checks let a case through (ids are not range-checked on the device) only the absence of a
    crash is asserted."""
    assert reply[0] != "crash", f"the worker died (exit code {reply[1]}) on {req}"
    active, capacity, _, mode, _, _ = req["attrs"]
    if mode == 1 and req["x"].ndim == 2 and capacity > req["x"].shape[0]:
        # The reference computes any capacity; the vendor's tiling (and the binding) refuse one
        # above N.
        assert reply[0] == "error" and reply[3], f"capacity above N accepted: {reply}"
        return
    try:
        want = pm.reference.moe_init_routing_v2(req["x"], req["idx"], *req["attrs"])
    except pm.InvalidArgument as exc:
        if reply[0] == "ok":
            assert not req["validate"] or (req["device"] and exc.parameter == "expert_idx"), \
                f"invalid input accepted (the reference says: {exc})"
            return
        assert reply[3], f"invalid input raised {reply[1]}, not InvalidArgument or AclError: {reply[2]}"
        return
    assert reply[0] == "ok", f"valid input refused: {reply}"
    assert _same_outputs(reply[1], want), "outputs differ from the reference"


@settings(max_examples=EXAMPLES // 4, deadline=None, suppress_health_check=HEALTH)
@given(req=forward_cases())
def test_fuzz_forward(worker, req):
    _judge_forward(req, worker.run(req))


@pytest.mark.slow
@settings(max_examples=LONG_EXAMPLES // 2, deadline=None, suppress_health_check=HEALTH)
@given(req=forward_cases())
def test_fuzz_forward_long(worker, req):
    _judge_forward(req, worker.run(req))


def test_worker_crash_fails_the_example_instead_of_pytest(worker):
    # A worker that dies reports a crash (the harness restarts it for the next example).
    worker.run(dict(x=np.zeros((2, 2), np.float32), idx=np.arange(2, dtype=np.int32), top_k=1,
                    drop_pad_mode=0, active_num=0, validate=True, device=False, stream=False))
    worker.proc.kill()
    worker.proc.wait()
    worker.proc = None if worker.proc.poll() is None else worker.proc
    reply = worker.run(dict(x=np.zeros((2, 2), np.float32), idx=np.arange(2, dtype=np.int32), top_k=1,
                            drop_pad_mode=0, active_num=0, validate=True, device=False, stream=False))
    assert reply[0] == "ok"
