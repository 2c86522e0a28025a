"""The emulator's NaN rule (docs/emulator.md, "NaN results"), bit for bit.

IEEE 754 fixes which results are NaN but not their sign or payload; the host picks them from
the operand order its compiler chose for each addition. So the emulated backward kernel
returns one fixed NaN per dtype, the positive canonical quiet NaN, and the NumPy model
(pyacl_moe.reference) returns the same bits. These tests compare bits strictly: unlike the
conformance checks, a NaN matches only the same NaN. The forward op only moves rows, so its
NaNs keep every bit.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import reference

# dtype -> (its bits' type, the canonical NaN, NaNs of both signs with assorted payloads, quiet
# and signalling, the all-ones payload included, as bit patterns).
NANS = {
    "float32": (np.float32, np.uint32, 0x7FC00000,
                [0xFFC00000, 0x7FC12345, 0x7F800001, 0xFFFFFFFF, 0xFFA00000, 0x7FFFFFFF]),
    "float16": (np.float16, np.uint16, 0x7E00, [0xFE00, 0x7E55, 0x7C01, 0xFFFF, 0xFD00, 0x7FFF]),
    "bfloat16": (ml_dtypes.bfloat16, np.uint16, 0x7FC0, [0xFFC0, 0x7FD5, 0x7F81, 0xFFFF, 0xFFA0, 0x7FFF]),
}
INF = {"float32": (0x7F800000, 0xFF800000), "float16": (0x7C00, 0xFC00), "bfloat16": (0x7F80, 0xFF80)}


def nan_case(dtype: str, k: int, seed: int):
    """Rows mixing ones, NaNs of every sign and payload, and +-inf (so that inf + -inf makes a
    NaN of the host's own, negative on x86); every token's K slots name distinct rows, each
    token a different draw."""
    dt, uint, _, nans = NANS[dtype]
    tokens, hidden = 5, 24
    rng = np.random.default_rng([seed, k])
    pick = np.array([0x3F800000 if dt == np.float32 else (0x3C00 if dt == np.float16 else 0x3F80),
                     *nans, *INF[dtype]], np.uint64)
    # A term is special with probability 1/(K+1): about a third of the sums stay finite.
    special = 1.0 / (k + 1)
    p = np.array([1.0 - special, *[special / (pick.size - 1)] * (pick.size - 1)])
    bits = rng.choice(pick, size=(tokens * k, hidden), p=p).astype(uint)
    return bits.view(dt), rng.permutation(tokens * k).astype(np.int32)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


@pytest.mark.parametrize("dtype", list(NANS))
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8, 9])
def test_every_nan_of_the_backward_is_the_canonical_one(dtype, k):
    _, _, canonical, _ = NANS[dtype]
    x, idx = nan_case(dtype, k, seed=k)
    got = pm.moe_init_routing_v2_grad(x, idx, k)
    want = reference.moe_init_routing_v2_grad(x, idx, k)
    nan = np.isnan(got.astype(np.float32))
    assert nan.any() and (~nan).any()  # the case has both, so the rule is what is checked
    assert set(np.unique(bits(got)[nan]).tolist()) == {canonical}
    assert set(np.unique(bits(want)[np.isnan(want.astype(np.float32))]).tolist()) == {canonical}
    np.testing.assert_array_equal(bits(got), bits(want))  # strictly: NaN bits too


@pytest.mark.parametrize("dtype", list(NANS))
def test_single_nans_of_either_sign_and_any_payload(dtype):
    """One NaN term among ones, in each slot of K = 4 in turn, and a pair of NaNs of opposite
    signs in both orders: the result is the canonical NaN whichever operand the NaN was."""
    dt, uint, canonical, nans = NANS[dtype]
    one = np.array(1.0, np.float32).astype(dt).view(uint)
    k = 4
    for nan in nans:
        for slot in range(k):
            rows = np.full((k, 3), one, uint)
            rows[slot] = nan
            x, idx = rows.view(dt), np.arange(k, dtype=np.int32)
            got, want = pm.moe_init_routing_v2_grad(x, idx, k), reference.moe_init_routing_v2_grad(x, idx, k)
            assert bits(got).tolist() == [[canonical] * 3], (hex(nan), slot)
            assert bits(want).tolist() == [[canonical] * 3], (hex(nan), slot)
    pair = np.array([[nans[0]], [nans[1]]], uint)  # negative first, then positive
    infs = np.array([[INF[dtype][0]], [INF[dtype][1]]], uint)  # inf + -inf: the host's own NaN
    for rows in (pair, pair[::-1], infs, infs[::-1]):
        x = np.ascontiguousarray(rows).view(dt)
        idx = np.arange(2, dtype=np.int32)
        got, want = pm.moe_init_routing_v2_grad(x, idx, 2), reference.moe_init_routing_v2_grad(x, idx, 2)
        assert bits(got).tolist() == bits(want).tolist() == [[canonical]], rows.tolist()


@pytest.mark.parametrize("dtype", list(NANS))
def test_the_forward_copies_nans_bit_for_bit(dtype):
    """The forward op gathers rows and computes nothing: every NaN keeps its sign and payload,
    signalling ones included."""
    dt, uint, _, nans = NANS[dtype]
    x = np.array([nans, nans[::-1]], uint).view(dt)
    expert_idx = np.array([[1, 0], [0, 1]], np.int32)
    got = pm.moe_init_routing_v2(x, expert_idx, expert_num=2)[0]
    want = reference.moe_init_routing_v2(x, expert_idx, expert_num=2)[0]
    np.testing.assert_array_equal(bits(got), bits(want))
    assert {tuple(r) for r in bits(got).tolist()} == {tuple(nans), tuple(nans[::-1])}
