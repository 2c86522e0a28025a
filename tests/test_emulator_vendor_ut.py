"""The vendor's own unit tests of the backward, through the emulated aclnn entry (raw calls).

The tests are repo-mirror-test/ops-transformer's, under moe/moe_init_routing_v2_grad/tests/ut/
(``conformance.VENDOR_UT`` lists every one): the tiling tests call the op's tiling on a test
platform, the infershape tests its shape inference, which the aclnn entry never runs; what the
aclnn call returns is derived from the tiling source (docs/emulator.md, "The vendor's unit
tests of the backward"). The conformance catalogue makes the same calls through the binding
(tests/test_conformance.py). Here, what the catalogue cannot see: each refusal is refused for
the rule its test is about (the message names it) and the call with that put right is
accepted; the unknown dimensions of the infershape tests, which only graph mode has, are passed
as the negative dimensions an aclnn caller could give; the kernel test's own index law in
drop/pad mode.
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_emulator import (  # noqa: F401  (res is a fixture)
    ACL_BF16,
    ACL_FLOAT,
    ACL_FLOAT16,
    ACL_INT32,
    ACLNN_ERR_INNER_TILING_ERROR,
    RT_AICORE_EXCEPTION,
    WORKSPACE,
    launch,
    op_on,
    phase1,
    res,
)

F32, F16, BF = ACL_FLOAT, ACL_FLOAT16, ACL_BF16

# A refused call of the vendor's tests: gradExpandedX shape and dtype, expandedRowIdx shape,
# out shape (for an infershape test that fails, the shape topK 64 would give), topK,
# dropPadMode, activeNum; words the message must hold; what puts the call right.
REFUSED = {
    "tiling_10": (((10, 8, 512), BF, (640,), (80, 512), 8, -1, 40), "dropPadMode is -1", {"mode": 1}),
    "tiling_11": (((40, 512), BF, (640,), (10, 512), 64, 0, -1), "activeNum is -1", {"active": 40}),
    "tiling_12": (((40, 512, 1024, 1024), BF, (640,), (10, 512), 64, 0, 40), "gradExpandedX has 4 dimensions",
                  {"x": (40, 512)}),
    "tiling_13": (((10, 512), BF, (640,), (80, 512), 8, 1, 40), "drop/pad mode (dropPadMode 1) needs 3",
                  {"x": (10, 8, 512)}),
    "tiling_14": (((196608, 8), F32, (196607,), (4096, 8), 6, 0, 0),
                  "gradExpandedX has 196608 rows but expandedRowIdx has 196607", {"idx": (196608,), "out": (32768, 8)}),
    "tiling_15": (((40, 512), BF, (640,), (10, 512), 64, 0, 30), "gradExpandedX has 40 rows but activeNum is 30",
                  {"active": 40}),
    "tiling_16": (((40, 512), BF, (640,), (10, 510), 64, 0, 40), "out's dim 1 is 510 but gradExpandedX's dim 1",
                  {"out": (10, 512)}),
    "tiling_17": (((40, 512), BF, (640,), (10, 512), 10, 0, 40), "out has 10 rows: it must have", {"k": 64}),
    # Infershape gives out [2,16] (16 // 6); the tiling refuses the remainder.
    "infershape_00": (((16, 16), F32, (16,), (2, 16), 6, 0, 0), "16 is not divisible by topK = 6", {"k": 8}),
    "infershape_04": (((1024, 512), F16, (1024,), (16, 512), 0, 0, 0), "topK is 0", {"k": 64}),
    "infershape_05": (((1024, 512), F16, (1024,), (16, 512), 64, 2, 0), "dropPadMode is 2", {"mode": 0}),
    "infershape_06": (((1024, 512), F16, (1024,), (16, 512), 64, 0, -1), "activeNum is -1", {"active": 0}),
    # The tiling never looks at expandedRowIdx's rank: put right, the 2-D indices pass.
    "infershape_07": (((1024, 512), F16, (1024, 512), (16, 512), 64, 0, -1), "activeNum is -1", {"active": 0}),
    # dropPadMode is checked before activeNum.
    "infershape_08": (((1024, 512), F16, (1024,), (16, 512), 64, 2, -1), "dropPadMode is 2",
                      {"mode": 0, "active": 0}),
}


@pytest.fixture
def shapes(emu, res):
    """Tensors over one 1 MiB block (the first phase reads none), released after the test."""
    buf = res.dev(1 << 20)

    def make(shape, dtype):
        return res.tensor(shape, dtype, buf)

    return make


def first_phase(emu, shapes, x, dtype, idx, out, k, mode, active):
    st, ws, ex = phase1(emu, shapes(x, dtype), shapes(idx, ACL_INT32), k, mode, active, shapes(out, dtype))
    if st == 0:
        emu.ok(emu.nn.aclDestroyAclOpExecutor(ex))
    return st, ws


@pytest.mark.parametrize("name", list(REFUSED))
def test_each_refusal_is_for_the_rule_its_test_is_about(emu, shapes, name):
    (x, dtype, idx, out, k, mode, active), words, fix = REFUSED[name]
    st, _ = first_phase(emu, shapes, x, dtype, idx, out, k, mode, active)
    assert st == ACLNN_ERR_INNER_TILING_ERROR, emu.msg()
    assert words in emu.msg()
    right = {"x": x, "idx": idx, "out": out, "k": k, "mode": mode, "active": active, **fix}
    st, ws = first_phase(emu, shapes, right["x"], dtype, right["idx"], right["out"], right["k"], right["mode"],
                         right["active"])
    assert (st, ws) == (0, WORKSPACE), emu.msg()


# The infershape tests with unknown dimensions (-1) or rank (-2): gradExpandedX, expandedRowIdx,
# out (what infershape gives, or [-1, -1] where it fails), topK, dropPadMode; and the rule the
# tiling refuses them by. Infershape accepts the first three.
UNKNOWN = {
    "infershape_01": (((-2,), (-2,), (-1, -1), 6, 0), "gradExpandedX has 1 dimensions"),
    "infershape_02": (((-1, -1), (-1,), (-1, -1), 6, 0), "out has -1 rows"),
    "infershape_09": (((-1, -1, -1), (-1,), (-1, -1), 6, 1), "out has -1 rows"),
    "infershape_10": (((-1, -1), (-1,), (-1, -1), 6, 1), "drop/pad mode (dropPadMode 1) needs 3"),
}


@pytest.mark.parametrize("name", list(UNKNOWN))
def test_unknown_dimensions_as_negative_dimensions_are_refused_by_the_tiling(emu, shapes, name):
    (x, idx, out, k, mode), words = UNKNOWN[name]
    st, _ = first_phase(emu, shapes, x, F16, idx, out, k, mode, 0)
    assert st == ACLNN_ERR_INNER_TILING_ERROR, emu.msg()
    assert words in emu.msg()


def test_the_kernel_tests_index_law_in_drop_pad_reads_past_the_rows(emu, res):
    # The kernel test's data generator draws every scenario's indices as a permutation of the
    # N*K positions (gen_data.py), so in its drop/pad case (N=80, K=8, E=10, C=8) most
    # indices address rows past E*C = 80. The vendor kernel reads them unchecked; the emulator
    # reports the device fault at the next synchronize and leaves out untouched. The catalogue
    # case (vendor-kernel-bfloat16-drop-pad) uses the documented range, [-1, E*C).
    rng = np.random.default_rng(3)
    x = rng.uniform(0, 1, (10, 8, 512)).astype(np.float32)
    idx = rng.permutation(640).astype(np.int32)
    xt = res.tensor(x.shape, F32, res.dev(x))
    it = res.tensor(idx.shape, ACL_INT32, res.dev(idx))
    out_p = res.dev(np.full((80, 512), 7.0, np.float32))
    st, ws, ex = phase1(emu, xt, it, 8, 1, 40, res.tensor((80, 512), F32, out_p))
    emu.ok(st)
    emu.ok(emu.op.aclnnMoeInitRoutingV2Grad(res.workspace(), ws, ex, emu.NULL))
    assert emu.acl.aclrtSynchronizeStream(emu.NULL) == RT_AICORE_EXCEPTION
    assert "expandedRowIdx" in emu.msg()
    assert (res.read(out_p, (80, 512), np.float32) == 7.0).all()


def test_the_vendor_samples_values(emu, res):
    # The vendor's sample (examples/test_aclnn_moe_init_routing_v2_grad.cpp): dropless, topK 2,
    # its own four rows; it prints out with %f. tests/test_cann.py builds the sample itself.
    x = np.float32([[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]])
    idx = np.int32([2, 0, 1, 3])
    xt, it, ot, out_p = op_on(emu, res, x, idx, 2, 0, 0, F32)
    launch(emu, res, xt, it, 2, 0, 0, ot)
    out = res.read(out_p, (2, 2), np.float32)
    assert out.tolist() == [[x[2, 0] + x[0, 0]] * 2, [x[1, 0] + x[3, 0]] * 2]
    assert [f"{v:f}" for v in out.ravel()] == ["0.300000", "0.300000", "0.700000", "0.700000"]
