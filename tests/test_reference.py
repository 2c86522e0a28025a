"""The golden reference against the plainest possible definition."""

from __future__ import annotations

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe.tools.cases import make_case


def per_token_loop(case) -> np.ndarray:
    x, idx, k = case.grad_expanded_x, case.expanded_row_idx, case.top_k
    rows = x.reshape(-1, x.shape[-1])
    out = np.zeros((idx.size // k, x.shape[-1]), np.float64)
    for i in range(out.shape[0]):
        for t in range(k):
            j = int(idx[i * k + t])
            if case.drop_pad_mode == 1 and j == -1:
                continue
            if case.drop_pad_mode == 0 and case.active_num and j >= case.active_num:
                continue
            out[i] += rows[j].astype(np.float64)
    return out


@pytest.mark.parametrize("mode", ["dropless", "active", "drop-pad"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_a_plain_loop(mode, dtype, seed):
    case = make_case(13, 3, 21, dtype, mode, seed=seed)
    got = pm.reference.moe_init_routing_v2_grad(*case.args())
    want = per_token_loop(case)
    assert got.dtype == case.grad_expanded_x.dtype and got.shape == want.shape
    # float32 accumulation of three terms, one rounding: within one unit of the output type.
    ulp = {"float32": 2.0**-22, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=ulp, atol=1e-6)


def test_reference_rounds_once_to_nearest_even():
    # 1 + 2^-8 + 2^-9 in bfloat16 terms: the float32 sum is exact, one rounding gives 1 + 2^-7.
    x = np.array([[1.0], [2.0**-8], [2.0**-9]], dtype=pm.bfloat16)
    out = pm.reference.moe_init_routing_v2_grad(x, np.arange(3, dtype=np.int32), 3)
    assert float(out[0, 0]) == 1.0 + 2.0**-7


def test_reference_validates_like_the_binding():
    with pytest.raises(pm.InvalidArgument, match="top_k"):
        pm.reference.moe_init_routing_v2_grad(np.zeros((4, 2), np.float32), np.arange(4, dtype=np.int32), 3)
    with pytest.raises(pm.InvalidArgument, match="expanded_row_idx"):
        pm.reference.moe_init_routing_v2_grad(np.zeros((4, 2), np.float32), np.array([0, 1, 2, 9], np.int32), 2)


def test_reference_chunks_large_inputs_with_little_memory():
    import tracemalloc

    case = make_case(2048, 4, 512, "bfloat16", "dropless", seed=3)
    tracemalloc.start()
    out = pm.reference.moe_init_routing_v2_grad(*case.args())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak - out.nbytes < 4 << 20  # a few chunk buffers, not a copy of the 8 MiB input
    assert np.array_equal(out, pm.reference.moe_init_routing_v2_grad(*case.args()))


def test_bfloat16_widening_moves_the_bits_for_every_pattern():
    # The reference widens bfloat16 with ml_dtypes' cast; it must be the exact bit move (the
    # top half of a float32), NaN payloads and infinities included, as the kernel's is.
    import ml_dtypes

    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    widened = np.empty(bits.shape, np.float32)
    np.copyto(widened, bits.view(ml_dtypes.bfloat16), casting="unsafe")
    assert np.array_equal(widened.view(np.uint32), bits.astype(np.uint32) << 16)


def test_the_forward_reference_refuses_attributes_of_the_wrong_type_by_name():
    """int() converted them: "3" and 2.5 passed as 3 and 2, 1 as a flag."""
    x, ids = np.ones((4, 2), np.float32), np.zeros((4, 1), np.int32)
    for kw, name in ((dict(expert_num="3"), "expert_num"), (dict(active_num=2.5), "active_num"),
                     (dict(expert_tokens_before_capacity_flag=1), "expert_tokens_before_capacity_flag"),
                     (dict(drop_pad_mode=None), "drop_pad_mode")):
        with pytest.raises(pm.InvalidArgument) as e:
            pm.reference.moe_init_routing_v2(x, ids, **kw)
        assert e.value.parameter == name
    counts = pm.reference.moe_init_routing_v2(x, ids, expert_num=np.int64(2), expert_tokens_count_or_cumsum_flag=2)[2]
    assert counts is not None and counts.tolist() == [4, 0]
