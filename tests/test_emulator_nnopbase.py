"""The emulator's generic aclnn layer follows CANN's nnopbase, through the raw C ABI.

Each test names the rule of nnopbase it checks (docs/emulator.md, "The generic aclnn layer",
says which opbase source file each rule was read from); the overflow tests at the end are
regressions for hostile descriptors that once made the first phase or the kernel compute
wrapped extents (out-of-bounds host reads under AddressSanitizer, signed overflow under UBSan).
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import pyacl_moe as pm

from .emu_raw import Emu
from .test_emulator import (  # noqa: F401  (res and shapes are fixtures)
    ACL_BF16,
    ACL_DOUBLE,
    ACL_ERROR_REPEAT_INITIALIZE,
    ACL_FLOAT,
    ACL_FLOAT16,
    ACL_INT32,
    ACLNN_ERR_INNER,
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    ACLNN_ERR_RUNTIME_ERROR,
    RT_AICORE_EXCEPTION,
    WORKSPACE,
    assert_matches,
    launch,
    make_case,
    op_on,
    phase1,
    phase1_status,
    reference,
    res,
    run_fresh,
    shapes,
)

ACLNN_ERR_INNER_NULLPTR = 561103

# aclFormat values (acl_base.h; DHWCN has no name there, 31 is the graph engine's number).
FMT_NCHW, FMT_NHWC, FMT_ND, FMT_HWCN, FMT_NDHWC, FMT_NCDHW, FMT_DHWCN, FMT_NC, FMT_NCL = (
    0, 1, 2, 16, 27, 30, 31, 35, 47)

BIG = 1 << 62


def scratch(nbytes: int) -> int:
    """The workspace of one input's dense copy: bytes + 32, rounded up to 512."""
    return (nbytes + 32 + 511) // 512 * 512


def in_thread_without_device(fn):
    """Run fn on a fresh thread, which has no current device."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    t.join()
    return out["r"]


# ============================================================================ 1. empty outputs

# (gradExpandedX shape, len(idx), out shape, topK, dropPadMode, activeNum): out has a zero
# dimension, so nnopbase skips the tiling, whatever it would have said.
EMPTY_OUT = {
    "idx zero length": ((0, 4), 0, (0, 4), 2, 0, 0),
    "out zero rows (drop/pad)": ((2, 4, 4), 1, (0, 4), 2, 1, 0),
    "out zero H": ((8, 0), 8, (4, 0), 2, 0, 0),
    "tiling would refuse dropPadMode 2": ((8, 4), 8, (0, 4), 2, 2, 0),
    "tiling would refuse topK 0": ((8, 4), 8, (4, 0), 0, 0, 0),
    "negative out rows, zero H": ((8, 4), 8, (-4, 0), 2, 0, 0),
}


@pytest.mark.parametrize("case", list(EMPTY_OUT), ids=list(EMPTY_OUT))
def test_every_output_empty_skips_tiling_with_workspace_0(emu, shapes, case):
    xs, n_idx, os_, k, mode, act = EMPTY_OUT[case]
    st, ws, ex = phase1(emu, shapes(xs), shapes((n_idx,), ACL_INT32), k, mode, act, shapes(os_))
    assert (st, ws) == (0, 0), emu.msg()
    emu.ok(emu.nn.aclDestroyAclOpExecutor(ex))


def test_empty_output_still_checks_dtypes_formats_and_device(emu, shapes):
    x, i, o = shapes((0, 4)), shapes((0,), ACL_INT32), shapes((0, 4))
    assert phase1_status(emu, shapes((0, 4), ACL_DOUBLE), i, 2, 0, 0, shapes((0, 4), ACL_DOUBLE)) == \
        ACLNN_ERR_PARAM_INVALID
    assert phase1_status(emu, x, i, 2, 0, 0, shapes((0, 4), fmt=FMT_HWCN)) == ACLNN_ERR_PARAM_INVALID
    assert in_thread_without_device(lambda: phase1_status(emu, x, i, 2, 0, 0, o)) == ACLNN_ERR_RUNTIME_ERROR


def test_empty_output_executor_launches_nothing(emu, res):
    out_p = res.dev(np.full(8, 5.0, np.float32))
    xt = res.tensor((0, 4), ACL_FLOAT, out_p)
    it = res.tensor((0,), ACL_INT32, out_p)
    ot = res.tensor((0, 4), ACL_FLOAT, out_p)
    before = emu.stats()
    st, ws, ex = phase1(emu, xt, it, 2, 0, 0, ot)
    assert (st, ws) == (0, 0)
    # No workspace, and a stream that is not one: nothing is launched, so nothing looks at it.
    bogus = emu.ffi.cast("void *", 0x1234)
    emu.ok(emu.op.aclnnMoeInitRoutingV2Grad(emu.NULL, 0, ex, bogus))
    after = emu.stats()
    assert after["kernels_launched"] == before["kernels_launched"]
    assert after["executors"] == before["executors"]  # the one-shot executor was recycled
    assert emu.op.aclnnMoeInitRoutingV2Grad(emu.NULL, 0, ex, emu.NULL) == ACLNN_ERR_PARAM_INVALID
    emu.ok(emu.acl.aclrtSynchronizeDevice())
    assert np.all(res.read(out_p, (8,), np.float32) == 5.0)


def test_empty_output_through_the_binding(device):
    x, idx = np.zeros((0, 4), np.float32), np.zeros((0,), np.int32)
    size, ex = pm.get_workspace_size(pm.to_device(x), pm.to_device(idx), 2, 0, 0, pm.empty((0, 4), np.float32))
    assert size == 0
    pm.execute(None, 0, ex, device.default_stream)
    got = pm.moe_init_routing_v2_grad(x, idx, 2, validate=False)
    assert got.shape == (0, 4) and got.dtype == np.float32
    with pytest.raises(pm.InvalidArgument, match="expanded_row_idx"):  # the binding's own rule
        pm.moe_init_routing_v2_grad(x, idx, 2)


# ============================================================================ 2. contiguity of inputs only

@pytest.mark.parametrize("strides,storage", [((8, 1), (4, 8)), ((1, 4), (4, 4))], ids=["rows", "transposed"])
def test_strided_out_is_accepted_and_written_densely(emu, res, strides, storage):
    rng = np.random.default_rng(3)
    x, idx, mode, act = make_case(rng, "dropless", n=4, k=2, h=4, dtype=ACL_FLOAT)
    xt, it, _, _ = op_on(emu, res, x, idx, 2, mode, act, ACL_FLOAT)
    out_p = res.dev(np.zeros(32, np.float32))
    ot = res.tensor((4, 4), ACL_FLOAT, out_p, strides=strides, storage=storage)
    launch(emu, res, xt, it, 2, mode, act, ot)
    ref, mag = reference(x, idx, 2, mode, act, np.float32)
    dense = res.read(out_p, (32,), np.float32)[:16].reshape(4, 4)
    assert_matches(dense, ref, mag)


def test_strided_out_is_written_where_the_dense_view_lies(emu, res):
    # A broadcast out spans one element, but the kernel writes all N*H densely: the launch
    # maps that dense range, so a block too small for it is a device fault, not a host write
    # past the block.
    rng = np.random.default_rng(4)
    x, idx, mode, act = make_case(rng, "dropless", n=8, k=2, h=8, dtype=ACL_FLOAT)
    xt, it, _, _ = op_on(emu, res, x, idx, 2, mode, act, ACL_FLOAT)
    small = res.dev(np.full(1, 5.0, np.float32))
    ot = res.tensor((8, 8), ACL_FLOAT, small, strides=(0, 0), storage=(1,))
    launch(emu, res, xt, it, 2, mode, act, ot, sync=False)
    assert emu.acl.aclrtSynchronizeStream(emu.NULL) == RT_AICORE_EXCEPTION
    assert "out spans" in emu.msg()
    assert res.read(small, (1,), np.float32)[0] == 5.0


# ============================================================================ 3. executor APIs

def test_executor_apis_null_is_561103_and_unknown_is_561000(emu, shapes):
    nn = emu.nn
    t = shapes((4,))
    assert nn.aclSetAclOpExecutorRepeatable(emu.NULL) == ACLNN_ERR_INNER_NULLPTR
    assert nn.aclDestroyAclOpExecutor(emu.NULL) == ACLNN_ERR_INNER_NULLPTR
    assert nn.aclSetInputTensorAddr(emu.NULL, 0, t, emu.NULL) == ACLNN_ERR_INNER_NULLPTR
    assert nn.aclSetOutputTensorAddr(emu.NULL, 0, t, emu.NULL) == ACLNN_ERR_INNER_NULLPTR
    st, _, ex = phase1(emu, shapes((8, 4)), shapes((8,), ACL_INT32), 2, 0, 0, shapes((4, 4)))
    emu.ok(st)
    assert nn.aclSetInputTensorAddr(ex, 0, emu.NULL, emu.NULL) == ACLNN_ERR_INNER_NULLPTR
    assert nn.aclSetOutputTensorAddr(ex, 0, emu.NULL, emu.NULL) == ACLNN_ERR_INNER_NULLPTR
    emu.ok(nn.aclDestroyAclOpExecutor(ex))
    for unknown in (ex, emu.ffi.cast("aclOpExecutor *", 0x1234)):
        assert nn.aclSetAclOpExecutorRepeatable(unknown) == ACLNN_ERR_INNER
        assert nn.aclDestroyAclOpExecutor(unknown) == ACLNN_ERR_INNER
        assert nn.aclSetInputTensorAddr(unknown, 0, t, emu.NULL) == ACLNN_ERR_INNER
        assert nn.aclSetOutputTensorAddr(unknown, 0, t, emu.NULL) == ACLNN_ERR_INNER
        assert "not a live aclOpExecutor" in emu.msg()


def test_tensor_address_is_set_before_the_executor_is_checked(emu, shapes):
    t = shapes((4,))
    addr = emu.ffi.new("void **")
    assert emu.nn.aclSetInputTensorAddr(emu.NULL, 0, t, emu.ffi.cast("void *", 0x5000)) == ACLNN_ERR_INNER_NULLPTR
    emu.ok(emu.nn.aclGetRawTensorAddr(t, addr))
    assert int(emu.ffi.cast("uintptr_t", addr[0])) == 0x5000


def test_one_shot_executor_can_be_rebound_without_repeatable(emu, res):
    rng = np.random.default_rng(5)
    x, idx, mode, act = make_case(rng, "dropless", n=4, k=2, h=3, dtype=ACL_FLOAT)
    xt, it, ot, out_p = op_on(emu, res, x, idx, 2, mode, act, ACL_FLOAT)
    st, ws, ex = phase1(emu, xt, it, 2, mode, act, ot)
    emu.ok(st)
    x2 = (x * 3.0 - 1.0).astype(np.float32)
    out2 = res.dev(np.zeros((4, 3), np.float32))
    emu.ok(emu.nn.aclSetInputTensorAddr(ex, 0, xt, res.dev(x2)))
    emu.ok(emu.nn.aclSetOutputTensorAddr(ex, 0, ot, out2))
    assert emu.nn.aclSetInputTensorAddr(ex, 2, xt, out2) == ACLNN_ERR_PARAM_INVALID  # index past the inputs
    emu.ok(emu.op.aclnnMoeInitRoutingV2Grad(res.workspace(), ws, ex, emu.NULL))
    emu.ok(emu.acl.aclrtSynchronizeStream(emu.NULL))
    ref, mag = reference(x2, idx, 2, mode, act, np.float32)
    assert_matches(res.read(out2, (4, 3), np.float32), ref, mag)
    assert np.all(res.read(out_p, (4, 3), np.float32) == 7.0)  # the old out: untouched


# ============================================================================ 5. formats

@pytest.mark.parametrize("fmt,want", [(FMT_ND, 0), (FMT_NCHW, 0), (FMT_NHWC, 0), (FMT_NCL, 0), (FMT_NCDHW, 0),
                                      (FMT_DHWCN, 0), (FMT_HWCN, ACLNN_ERR_PARAM_INVALID),
                                      (FMT_NDHWC, ACLNN_ERR_PARAM_INVALID), (FMT_NC, ACLNN_ERR_PARAM_INVALID)],
                         ids=["ND", "NCHW", "NHWC", "NCL", "NCDHW", "DHWCN", "HWCN", "NDHWC", "NC"])
@pytest.mark.parametrize("which", ["x", "idx", "out"])
def test_only_nnopbase_nd_like_formats_pass(emu, shapes, fmt, want, which):
    f = {w: (fmt if w == which else FMT_ND) for w in ("x", "idx", "out")}
    st = phase1_status(emu, shapes((8, 4), fmt=f["x"]), shapes((8,), ACL_INT32, fmt=f["idx"]), 2, 0, 0,
                       shapes((4, 4), fmt=f["out"]))
    assert st == want, emu.msg()


# ============================================================================ 6. order of checks, ranks

def test_null_workspace_with_a_size_is_161001_before_the_size_check(emu, res):
    rng = np.random.default_rng(6)
    x, idx, mode, act = make_case(rng, "dropless", n=4, k=2, h=3, dtype=ACL_FLOAT)
    xt, it, ot, _ = op_on(emu, res, x, idx, 2, mode, act, ACL_FLOAT)
    st, ws, ex = phase1(emu, xt, it, 2, mode, act, ot)
    emu.ok(st)
    f = emu.op.aclnnMoeInitRoutingV2Grad
    assert f(emu.NULL, 1, ex, emu.NULL) == ACLNN_ERR_PARAM_NULLPTR  # size too small, but NULL first
    assert "workspace is a null pointer" in emu.msg()
    assert f(emu.NULL, 0, ex, emu.NULL) == ACLNN_ERR_PARAM_INVALID  # no size: the size check answers
    assert "workspaceSize is 0" in emu.msg()
    emu.ok(f(res.workspace(), ws, ex, emu.NULL))  # both rejections left it alive


def test_dtype_and_format_are_checked_before_the_device(emu, shapes):
    x, i, o = shapes((8, 4)), shapes((8,), ACL_INT32), shapes((4, 4))
    bad = shapes((8, 4), ACL_DOUBLE)
    assert in_thread_without_device(lambda: phase1_status(emu, bad, i, 2, 0, 0, shapes((4, 4), ACL_DOUBLE))) == \
        ACLNN_ERR_PARAM_INVALID
    nz = shapes((8, 4), fmt=FMT_HWCN)
    assert in_thread_without_device(lambda: phase1_status(emu, nz, i, 2, 0, 0, o)) == ACLNN_ERR_PARAM_INVALID
    assert in_thread_without_device(lambda: phase1_status(emu, x, i, 2, 0, 0, o)) == ACLNN_ERR_RUNTIME_ERROR


def test_no_rank_limit_of_eight_and_index_rank_unchecked(emu, res):
    # nnopbase has no 8-dimension rule; the tiling reads expandedRowIdx's dim 0 only, and the
    # kernel its first dim-0 elements in row-major order.
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    flat = np.array([3, 0, 2, 1, 9, 9, 9, 9], np.int32)  # only the first 4 are read
    xt = res.tensor((4, 3), ACL_FLOAT, res.dev(x))
    out_p = res.dev(np.zeros((2, 3), np.float32))
    ot = res.tensor((2, 3), ACL_FLOAT, out_p)
    for shape in ((4, 2), (4, 1, 1, 1, 1, 1, 1, 1, 1, 2)):
        it = res.tensor(shape, ACL_INT32, res.dev(flat))
        launch(emu, res, xt, it, 2, 0, 0, ot)
        ref, mag = reference(x, flat[:4], 2, 0, 0, np.float32)
        assert_matches(res.read(out_p, (2, 3), np.float32), ref, mag)


def test_hidden_size_is_dim_2_in_drop_pad_mode(emu, shapes):
    x, i = shapes((2, 4, 6)), shapes((8,), ACL_INT32)
    assert phase1_status(emu, x, i, 2, 1, 0, shapes((4, 4))) == ACLNN_ERR_INNER_TILING_ERROR
    assert "gradExpandedX's dim 2 (H) is 6" in emu.msg()
    assert phase1_status(emu, x, i, 2, 1, 0, shapes((4, 6))) == 0


def test_negative_index_in_active_mode_is_read_not_skipped(emu, res):
    x = np.ones((3, 2), np.float32)
    idx = np.array([0, -1, 1, 2], np.int32)
    xt, it, ot, _ = op_on(emu, res, x, idx, 2, 0, 3, ACL_FLOAT)
    launch(emu, res, xt, it, 2, 0, 3, ot, sync=False)
    assert emu.acl.aclrtSynchronizeStream(emu.NULL) == RT_AICORE_EXCEPTION
    assert "expandedRowIdx[1] = -1" in emu.msg()


# ============================================================================ 7. aclInit after aclFinalize

def child_aclinit_after_aclfinalize() -> None:
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    out = {"init": acl.aclInit(ffi.NULL), "fin": acl.aclFinalize()}
    out["reinit"] = acl.aclInit(ffi.NULL)
    out["msg"] = emu.msg()
    out["set"] = acl.aclrtSetDevice(0)
    out["initialized"] = emu.stats()["initialized"]
    print(json.dumps(out))


def test_aclinit_after_aclfinalize_is_refused(isolated):
    r = run_fresh(isolated, child_aclinit_after_aclfinalize)
    assert r["init"] == 0 and r["fin"] == 0
    assert r["reinit"] == ACL_ERROR_REPEAT_INITIALIZE
    assert "aclFinalize was already called" in r["msg"]
    assert r["set"] == 100001 and r["initialized"] == 0  # nothing works after aclFinalize


# ============================================================================ 8. contiguous-copy scratch

@pytest.mark.parametrize("dtype,esize", [(ACL_FLOAT, 4), (ACL_FLOAT16, 2), (ACL_BF16, 2)], ids=["fp32", "fp16", "bf16"])
def test_workspace_grows_by_the_dense_copy_of_each_strided_input(emu, shapes, dtype, esize):
    i, o = shapes((8,), ACL_INT32), shapes((4, 4), dtype)
    cases = [
        (shapes((8, 4), dtype), i, 0),                                          # contiguous
        (shapes((8, 4), dtype, strides=(4, 1), offset=3), i, 0),               # an offset is not a stride
        (shapes((8, 4), dtype, strides=(8, 1)), i, scratch(32 * esize)),        # every other row
        (shapes((8, 4), dtype, strides=(1, 8)), i, scratch(32 * esize)),        # transposed
        (shapes((8, 4), dtype), shapes((8,), ACL_INT32, strides=(2,)), scratch(32)),
        (shapes((8, 4), dtype, strides=(8, 2)), shapes((8,), ACL_INT32, strides=(3,)),
         scratch(32 * esize) + scratch(32)),
    ]
    for x, idx, extra in cases:
        st, ws, ex = phase1(emu, x, idx, 2, 0, 0, o)
        emu.ok(st)
        emu.ok(emu.nn.aclDestroyAclOpExecutor(ex))
        assert ws == WORKSPACE + extra
    # A dimension of size 1 carries no stride: still contiguous.
    st, ws, ex = phase1(emu, shapes((2, 1, 4), dtype, strides=(4, 999, 1)), shapes((2,), ACL_INT32), 2, 1, 0,
                        shapes((1, 4), dtype))
    emu.ok(st)
    emu.ok(emu.nn.aclDestroyAclOpExecutor(ex))
    assert ws == WORKSPACE
    # Empty outputs: nothing tiled, but a strided input is still copied.
    st, ws, ex = phase1(emu, shapes((8, 4), dtype, strides=(8, 1)), i, 2, 0, 0, shapes((0, 4), dtype))
    emu.ok(st)
    emu.ok(emu.nn.aclDestroyAclOpExecutor(ex))
    assert ws == scratch(32 * esize)


def test_strided_input_launch_needs_the_larger_workspace(emu, res):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    idx = rng.permutation(8).astype(np.int32)
    xt = res.tensor((8, 4), ACL_FLOAT, res.dev(x), strides=(8, 2), storage=(8, 8))
    it = res.tensor((8,), ACL_INT32, res.dev(idx))
    out_p = res.dev(np.zeros((4, 4), np.float32))
    ot = res.tensor((4, 4), ACL_FLOAT, out_p)
    st, ws, ex = phase1(emu, xt, it, 2, 0, 0, ot)
    emu.ok(st)
    assert ws == WORKSPACE + scratch(128)
    wsp = res.dev(ws)
    assert emu.op.aclnnMoeInitRoutingV2Grad(wsp, WORKSPACE, ex, emu.NULL) == ACLNN_ERR_PARAM_INVALID
    emu.ok(emu.op.aclnnMoeInitRoutingV2Grad(wsp, ws, ex, emu.NULL))
    emu.ok(emu.acl.aclrtSynchronizeStream(emu.NULL))
    ref, mag = reference(x[:, ::2], idx, 2, 0, 0, np.float32)
    assert_matches(res.read(out_p, (4, 4), np.float32), ref, mag)


def test_strided_input_workspace_through_the_binding(device):
    x = pm.to_device(np.zeros((8, 8), np.float16))[:, ::2]
    idx = pm.to_device(np.arange(8, dtype=np.int32))
    size, ex = pm.get_workspace_size(x, idx, 2, 0, 0, pm.empty((4, 4), np.float16))
    ex.close()
    assert size == WORKSPACE + scratch(8 * 4 * 2)
    got = pm.moe_init_routing_v2_grad(x, idx, 2).to_host()
    assert got.shape == (4, 4) and not got.any()


# ============================================================================ overflow regressions

def _x_idx_out(res, x_strides=None, x_offset=0, x_shape=(8, 4), idx_shape=(8,), idx_strides=None,
               out_shape=(4, 4), out_offset=0):
    buf = res.dev(1 << 20)
    return (res.tensor(x_shape, ACL_FLOAT, buf, strides=x_strides, offset=x_offset, storage=(1,)),
            res.tensor(idx_shape, ACL_INT32, buf, strides=idx_strides, storage=(1,)),
            res.tensor(out_shape, ACL_FLOAT, buf, offset=out_offset, storage=(1,)))


OVERFLOWS = {
    # (shape - 1) * stride fits, times the element size does not.
    "stride times element size": dict(x_strides=(BIG // 8, 1)),
    # (shape - 1) * stride itself overflows.
    "(shape - 1) * stride": dict(x_shape=(8, 4), x_strides=(BIG // 2, 1)),
    # A negative stride whose span wraps below INT64_MIN.
    "negative span": dict(x_strides=(-(BIG // 4), 1)),
    # offset * element size.
    "offset times element size": dict(x_offset=BIG),
    # The sum of two spans.
    "sum of spans": dict(x_shape=(2, 2), x_strides=(BIG + (BIG >> 1), BIG + (BIG >> 1)), idx_shape=(2,),
                         out_shape=(1, 2)),
    # The index view and out are checked too.
    "index stride": dict(idx_strides=(BIG,)),
    # out is written densely from its offset: the offset is what can overflow.
    "out offset": dict(out_offset=BIG),
}


@pytest.mark.parametrize("case", list(OVERFLOWS), ids=list(OVERFLOWS))
def test_overflowing_view_extent_is_refused(emu, res, case):
    x, i, o = _x_idx_out(res, **OVERFLOWS[case])
    assert phase1_status(emu, x, i, 2, 0, 0, o) == ACLNN_ERR_PARAM_INVALID
    assert "cannot be addressed" in emu.msg()


def test_element_count_overflow_is_refused(emu, res):
    # A broadcast (stride 0) gradExpandedX spans one element but counts 2^63 of them; the
    # indices are broadcast too, and out (dense, 64 times fewer rows) fits.
    rows, h = 1 << 40, 1 << 23
    x, i, o = _x_idx_out(res, x_shape=(rows, h), x_strides=(0, 0), idx_shape=(rows,), idx_strides=(0,),
                         out_shape=(rows // 64, h))
    assert phase1_status(emu, x, i, 64, 0, 0, o) == ACLNN_ERR_PARAM_INVALID
    assert "more elements than int64" in emu.msg()


def test_copy_scratch_overflow_is_refused(emu, res):
    # 2^62 broadcast elements of 4 bytes: the dense copy needs 2^64 bytes.
    h = 1 << 31
    x, i, o = _x_idx_out(res, x_shape=(h, h), x_strides=(0, 0), idx_shape=(h,), idx_strides=(0,),
                         out_shape=(h // 64, h))
    assert phase1_status(emu, x, i, 64, 0, 0, o) == ACLNN_ERR_PARAM_INVALID
    assert "does not fit in 64 bits" in emu.msg()


def test_default_strides_overflow_is_refused_by_aclcreatetensor(emu, res):
    buf = res.dev(64)
    dims = emu.ffi.new("int64_t[]", [2, 1 << 32, 1 << 32, 2])
    t = emu.nn.aclCreateTensor(dims, 4, ACL_FLOAT, emu.NULL, 0, FMT_ND, dims, 4, buf)
    assert t == emu.NULL
    assert "overflow int64" in emu.msg()
    # The outermost dimension is never multiplied on: a large one is fine.
    dims = emu.ffi.new("int64_t[]", [1 << 62, 2])
    t = emu.nn.aclCreateTensor(dims, 2, ACL_FLOAT, emu.NULL, 0, FMT_ND, dims, 2, buf)
    assert t != emu.NULL
    emu.ok(emu.nn.aclDestroyTensor(t))


def test_huge_workspace_is_not_inside_a_small_block(emu, res):
    # A workspace near 2^64 bytes, from a legal first phase: the launch's bound check must not
    # wrap (workspace + size) and pass a block of 16 MiB.
    rows, h = 1 << 23, (1 << 39) - 1
    buf = res.dev(1 << 20)
    x = res.tensor((rows, h), ACL_FLOAT, buf, strides=(0, 0), storage=(1,))
    i = res.tensor((rows,), ACL_INT32, buf, storage=(1,))
    o = res.tensor((rows // 64, h), ACL_FLOAT, buf, storage=(1,))
    st, ws, ex = phase1(emu, x, i, 64, 0, 0, o)
    emu.ok(st)
    assert ws == WORKSPACE + scratch(rows * h * 4) and ws > (1 << 63)
    assert emu.op.aclnnMoeInitRoutingV2Grad(res.workspace(), ws, ex, emu.NULL) == ACLNN_ERR_PARAM_INVALID
    assert "is not inside a live device allocation" in emu.msg()
