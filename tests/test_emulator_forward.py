"""The emulated forward op, aclnnMoeInitRoutingV2, through raw cffi calls.

Every result is checked against plain loops written here from the vendor's documented formulas
(docs/emulator.md, "The forward op", says which vendor file each rule was read from): the
flattened expert ids sorted with equal ids in order of position, expandedRowIdxOut mapping each
position to its slot, expandedXOut gathering token rows into slot order (dropped past the
capacity and zero-padded in drop/pad mode), and the per-expert counts.
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
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    ACLNN_ERR_RUNTIME_ERROR,
    NP_DTYPE,
    RT_AICORE_EXCEPTION,
    res,
)
from .test_emulator_nnopbase import FMT_HWCN, in_thread_without_device, scratch

ACL_INT64 = 9
MIB16 = 16 * 1024 * 1024
BIG = 1 << 62


def tiling_workspace(total: int) -> int:
    """The vendor tiling's workspace on the emulated Ascend910B3 (40 vector cores): six floats
    a slot for the sort, two int32 a slot for the scatter, two int32 a core, 16 MiB."""
    return total * 4 * 2 * 3 + total * 4 * 2 + 40 * 2 * 4 + MIB16


# ---------------------------------------------------------------------------- the reference

def reference(x, idx, active, cap, num, mode, flag, before):
    """Plain loops over the documented formulas: (expanded_x, expanded_row_idx, count_or_cumsum
    or None, before_capacity or None)."""
    n, k = idx.shape
    h = x.shape[1]
    flat = [int(v) for v in idx.reshape(-1)]
    total = n * k
    order = sorted(range(total), key=lambda p: (flat[p], p))  # ties: by flattened position
    ri = np.zeros(total, np.int32)
    if mode == 0:
        rows = total if active == 0 else min(active, total)
        ex = np.zeros((rows, h), x.dtype)
        for i, p in enumerate(order):
            ri[p] = i
            if i < rows:
                ex[i] = x[p // k]
    else:
        ex = np.zeros((num, cap, h), x.dtype)
        seen: dict[int, int] = {}
        for p in order:
            e = flat[p]
            r = seen.get(e, 0)
            seen[e] = r + 1
            if r < cap:
                ri[p] = e * cap + r
                ex[e, r] = x[p // k]
            else:
                ri[p] = -1
    hist = [0] * max(num, 0)
    if num > 0:
        for v in flat:
            hist[v] += 1
    cnt = None
    if mode == 0 and flag:
        run, cnt = 0, np.zeros(num, np.int32)
        for e in range(num):
            run += hist[e]
            cnt[e] = run if flag == 1 else hist[e]
    bc = np.array(hist, np.int32) if mode == 1 and before else None
    return ex, ri, cnt, bc


# ---------------------------------------------------------------------------- the op's calls

def phase1(emu, x, i, active, cap, num, mode, flag, before, ex, ri, cnt=None, bc=None):
    ws = emu.ffi.new("uint64_t *")
    exe = emu.ffi.new("aclOpExecutor **")
    null = emu.NULL
    st = emu.op.aclnnMoeInitRoutingV2GetWorkspaceSize(
        x, i, active, cap, num, mode, flag, before, ex, ri,
        null if cnt is None else cnt, null if bc is None else bc, ws, exe)
    return st, int(ws[0]), exe[0]


def status(emu, *args, **kw) -> int:
    st, _, exe = phase1(emu, *args, **kw)
    if st == 0:
        emu.ok(emu.nn.aclDestroyAclOpExecutor(exe))
    return st


class Case:
    """Device buffers and tensors for one call; outputs prefilled with sentinels."""

    def __init__(self, emu, res, x, idx, active=0, cap=0, num=0, mode=0, flag=0, before=False,
                 dtype=ACL_FLOAT, with_cnt=None, with_bc=None, ex_shape=None, ri_len=None):
        self.emu, self.res = emu, res
        self.args = (active, cap, num, mode, flag, before)
        n, k = idx.shape
        total = n * k
        h = x.shape[1]
        if ex_shape is None:
            ex_shape = (num, cap, h) if mode == 1 else (total if active == 0 else min(active, total), h)
        self.ex_shape = tuple(ex_shape)
        self.ri_len = total if ri_len is None else ri_len
        self.np_dtype = NP_DTYPE[dtype]
        self.xt = res.tensor(x.shape, dtype, res.dev(x.astype(self.np_dtype)))
        self.it = res.tensor(idx.shape, ACL_INT32, res.dev(idx.astype(np.int32)))
        self.ex_p = res.dev(np.full(self.ex_shape, 9, self.np_dtype))
        self.ext = res.tensor(self.ex_shape, dtype, self.ex_p)
        self.ri_p = res.dev(np.full(max(self.ri_len, 1), -7, np.int32))
        self.rit = res.tensor((self.ri_len,), ACL_INT32, self.ri_p)
        with_cnt = (mode == 0 and flag != 0) if with_cnt is None else with_cnt
        with_bc = (mode == 1 and before) if with_bc is None else with_bc
        self.cnt_p = self.cnt = self.bc_p = self.bc = None
        if with_cnt:
            self.cnt_p = res.dev(np.full(max(num, 1), -5, np.int32))
            self.cnt = res.tensor((num,), ACL_INT32, self.cnt_p)
        if with_bc:
            self.bc_p = res.dev(np.full(max(num, 1), -6, np.int32))
            self.bc = res.tensor((num,), ACL_INT32, self.bc_p)

    def phase1(self):
        return phase1(self.emu, self.xt, self.it, *self.args, self.ext, self.rit, self.cnt, self.bc)

    def run(self, sync=True):
        emu = self.emu
        st, ws, exe = self.phase1()
        emu.ok(st)
        wsp = self.res.dev(ws) if ws else emu.NULL
        emu.ok(emu.op.aclnnMoeInitRoutingV2(wsp, ws, exe, emu.NULL))
        if sync:
            emu.ok(emu.acl.aclrtSynchronizeStream(emu.NULL))
        return ws

    def outputs(self):
        r = self.res
        num = self.args[2]
        return (r.read(self.ex_p, self.ex_shape, self.np_dtype),
                r.read(self.ri_p, (self.ri_len,), np.int32),
                None if self.cnt_p is None else r.read(self.cnt_p, (num,), np.int32),
                None if self.bc_p is None else r.read(self.bc_p, (num,), np.int32))


def check(case, x, idx):
    ex, ri, cnt, bc = case.outputs()
    rex, rri, rcnt, rbc = reference(x.astype(case.np_dtype), idx, *case.args)
    np.testing.assert_array_equal(ri, rri)
    np.testing.assert_array_equal(ex.astype(np.float32), rex.astype(np.float32))
    if rcnt is not None:
        np.testing.assert_array_equal(cnt, rcnt)
    if rbc is not None:
        np.testing.assert_array_equal(bc, rbc)


def data(n, k, h, experts, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(-50, 50, (n, h)).astype(np.float32) / 4
    idx = rng.integers(0, experts, (n, k)).astype(np.int32)  # few experts: many equal ids
    return x, idx


# ============================================================================ 1. scenarios

@pytest.mark.parametrize("dtype", [ACL_FLOAT, ACL_FLOAT16, ACL_BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("flag", [0, 1, 2], ids=["no-count", "cumsum", "count"])
def test_dropless(emu, res, dtype, flag):
    x, idx = data(7, 3, 5, 4, seed=flag)
    c = Case(emu, res, x, idx, num=4 if flag else 0, flag=flag, dtype=dtype)
    assert c.run() == tiling_workspace(21)
    check(c, x, idx)


@pytest.mark.parametrize("active", [1, 8, 21, 40])
@pytest.mark.parametrize("flag", [0, 1, 2])
def test_active(emu, res, active, flag):
    x, idx = data(7, 3, 5, 5, seed=active)
    c = Case(emu, res, x, idx, active=active, num=5, flag=flag)
    assert c.ex_shape[0] == min(active, 21)
    c.run()
    check(c, x, idx)


@pytest.mark.parametrize("dtype", [ACL_FLOAT, ACL_FLOAT16, ACL_BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cap", [1, 3, 9])
@pytest.mark.parametrize("before", [False, True])
def test_drop_pad(emu, res, dtype, cap, before):
    x, idx = data(9, 2, 4, 4, seed=cap)
    c = Case(emu, res, x, idx, cap=cap, num=4, mode=1, before=before, dtype=dtype)
    c.run()
    check(c, x, idx)
    ex, ri, _, _ = c.outputs()
    if cap == 1:
        assert (ri == -1).any()  # some tokens were dropped
    if cap == 9:
        assert not ex.any(axis=2).all()  # some slots were padded with zeros


def test_vendor_sample_values(emu, res):
    """The vendor's example: 3 tokens, k 2, 3 experts of capacity 2."""
    x = np.repeat(np.array([[0.1], [0.2], [0.3]], np.float32), 4, axis=1)
    idx = np.array([[1, 2], [0, 1], [0, 2]], np.int32)
    c = Case(emu, res, x, idx, cap=2, num=3, mode=1, before=True)
    c.run()
    ex, ri, _, bc = c.outputs()
    assert ri.tolist() == [2, 4, 0, 3, 1, 5]
    assert bc.tolist() == [2, 2, 2]
    np.testing.assert_array_equal(ex[:, :, 0], np.float32([[0.2, 0.3], [0.1, 0.2], [0.1, 0.3]]))


def test_equal_ids_keep_the_order_of_their_flattened_positions(emu, res):
    # Expert 1 is chosen at positions 0, 1, 2 and 5 (token 0 twice, token 1, token 2).
    x = np.arange(3, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    idx = np.array([[1, 1], [1, 0], [0, 1]], np.int32)
    c = Case(emu, res, x, idx)
    c.run()
    ex, ri, _, _ = c.outputs()
    # slots: expert 0 at positions 3, 4; expert 1 at positions 0, 1, 2, 5
    assert ri.tolist() == [2, 3, 4, 0, 1, 5]
    assert ex[:, 0].tolist() == [1, 2, 0, 0, 1, 2]


def test_outputs_a_flag_does_not_switch_on_are_not_written(emu, res):
    x, idx = data(4, 2, 3, 3, seed=1)
    # Dropless with flag 0 and a count tensor given anyway; a before-capacity tensor too.
    c = Case(emu, res, x, idx, num=3, flag=0, with_cnt=True, with_bc=True, before=True)
    c.run()
    _, _, cnt, bc = c.outputs()
    assert (cnt == -5).all() and (bc == -6).all()
    # Drop/pad mode ignores the count flag (its output is only checked and written dropless).
    c = Case(emu, res, x, idx, cap=2, num=3, mode=1, flag=1, with_cnt=True)
    c.run()
    assert (c.outputs()[2] == -5).all()


def test_ids_past_expert_num_are_fine_without_a_count_output(emu, res):
    x, idx = data(3, 2, 2, 3, seed=2)
    idx[1, 1] = 1_000_000
    c = Case(emu, res, x, idx)
    c.run()
    check(c, x, idx)


# ============================================================================ 2. device faults

@pytest.mark.parametrize("mode,flag,bad", [
    (0, 0, -1),   # dropless: ids must be 0 or greater
    (0, 1, 3),    # with a count output: ids must be below expertNum
    (0, 2, -2),
    (1, 0, 3),    # drop/pad: ids must be below expertNum
])
def test_out_of_range_id_is_a_device_fault_and_writes_nothing(emu, res, mode, flag, bad):
    x, idx = data(4, 2, 3, 3, seed=3)
    idx[2, 1] = bad
    c = Case(emu, res, x, idx, cap=2 if mode else 0, num=3, mode=mode, flag=flag)
    st, ws, exe = c.phase1()
    assert st == 0  # the first phase reads no tensor memory
    emu.ok(emu.op.aclnnMoeInitRoutingV2(res.dev(ws), ws, exe, emu.NULL))
    assert emu.acl.aclrtSynchronizeStream(emu.NULL) == RT_AICORE_EXCEPTION
    assert f"expertIdx[2][1] = {bad}" in emu.msg()
    ex, ri, _, _ = c.outputs()
    assert (ri == -7).all() and (ex == 9).all()


def test_mutation_fwd_unstable_sort_is_caught(emu, res):
    x, idx = data(6, 2, 3, 2, seed=4)
    assert emu.acl.aclemuSetMutation(b"fwd-unstable-sort") == 0
    c = Case(emu, res, x, idx)
    c.run()
    with pytest.raises(AssertionError):
        check(c, x, idx)
    assert emu.acl.aclemuSetMutation(b"") == 0
    c = Case(emu, res, x, idx)
    c.run()
    check(c, x, idx)


# ============================================================================ 3. refusals

def _tensors(emu, res, x_shape=(4, 3), idx_shape=(4, 2), ex_shape=(8, 3), ri_len=8, x_dtype=ACL_FLOAT,
             idx_dtype=ACL_INT32, ex_dtype=None, ri_dtype=ACL_INT32, fmt=2, cnt=None, bc=None,
             cnt_dtype=ACL_INT32):
    mem = res.dev(4096)
    t = {
        "x": res.tensor(x_shape, x_dtype, mem, fmt=fmt),
        "i": res.tensor(idx_shape, idx_dtype, mem),
        "ex": res.tensor(ex_shape, x_dtype if ex_dtype is None else ex_dtype, mem),
        "ri": res.tensor((ri_len,), ri_dtype, mem),
        "cnt": None if cnt is None else res.tensor(cnt, cnt_dtype, mem),
        "bc": None if bc is None else res.tensor(bc, ACL_INT32, mem),
    }
    return t


# name: (tensor overrides, (active, cap, num, mode, flag, before), status, words in the message)
REFUSALS = {
    "x int32": (dict(x_dtype=ACL_INT32), (0, 0, 0, 0, 0, False), ACLNN_ERR_PARAM_INVALID, "x has data type"),
    "expertIdx int64": (dict(idx_dtype=ACL_INT64), (0, 0, 0, 0, 0, False), ACLNN_ERR_PARAM_INVALID,
                        "expertIdx has data type"),
    "expandedXOut other dtype": (dict(ex_dtype=ACL_FLOAT16), (0, 0, 0, 0, 0, False),
                                 ACLNN_ERR_PARAM_INVALID, "expandedXOut has data type"),
    "expandedRowIdxOut float": (dict(ri_dtype=ACL_FLOAT), (0, 0, 0, 0, 0, False), ACLNN_ERR_PARAM_INVALID,
                                "expandedRowIdxOut has data type"),
    "count output int64": (dict(cnt=(4,), cnt_dtype=ACL_INT64), (0, 0, 4, 0, 1, False),
                           ACLNN_ERR_PARAM_INVALID, "expertTokensCountOrCumsumOut has data type"),
    "x format HWCN": (dict(fmt=FMT_HWCN), (0, 0, 0, 0, 0, False), ACLNN_ERR_PARAM_INVALID, "x has format"),
    # the support list comes before every shape rule
    "dtype before shape": (dict(x_dtype=ACL_INT32, x_shape=(4, 3, 1)), (0, 0, 0, 0, 0, False),
                           ACLNN_ERR_PARAM_INVALID, "x has data type"),
    "x 3-D": (dict(x_shape=(4, 3, 1)), (0, 0, 0, 0, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
              "x has 3 dimensions"),
    "rows differ": (dict(x_shape=(5, 3)), (0, 0, 0, 0, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                    "x has 5 rows but expertIdx has 4"),
    "expertCapacity negative": (dict(), (0, -1, 0, 0, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                                "expertCapacity is -1"),
    "expertNum negative": (dict(), (0, 0, -1, 0, 0, False), ACLNN_ERR_INNER_TILING_ERROR, "expertNum is -1"),
    # expertCapacity is checked before dropPadMode
    "capacity before mode": (dict(), (0, -1, 0, 2, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                             "expertCapacity is -1"),
    "dropPadMode 2": (dict(), (0, 0, 0, 2, 0, False), ACLNN_ERR_INNER_TILING_ERROR, "dropPadMode is 2"),
    "drop/pad capacity 0": (dict(ex_shape=(3, 0, 3)), (0, 0, 3, 1, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                            "expertCapacity is 0 and expertNum is 3"),
    "drop/pad expertNum 0": (dict(ex_shape=(0, 2, 3)), (0, 2, 0, 1, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                             "expertCapacity is 2 and expertNum is 0"),
    "flag 3": (dict(), (0, 0, 4, 0, 3, False), ACLNN_ERR_INNER_TILING_ERROR,
               "expertTokensCountOrCumsumFlag is 3"),
    "flag without expertNum": (dict(cnt=(0,)), (0, 0, 0, 0, 1, False), ACLNN_ERR_INNER_TILING_ERROR,
                               "expertNum must be greater than 0"),
    # checked before the flag is cleared in drop/pad mode
    "flag without expertNum, drop/pad": (dict(ex_shape=(0, 2, 3)), (0, 2, 0, 1, 1, False),
                                         ACLNN_ERR_INNER_TILING_ERROR, "expertCapacity is 2 and expertNum is 0"),
    "capacity over rows": (dict(ex_shape=(2, 5, 3)), (0, 5, 2, 1, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                           "expertCapacity is 5 but x has 4 rows"),
    "activeNum negative": (dict(), (-1, 0, 0, 0, 0, False), ACLNN_ERR_INNER_TILING_ERROR, "activeNum is -1"),
    "expertIdx 1-D": (dict(idx_shape=(4,)), (0, 0, 0, 0, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                      "expertIdx has 1 dimensions"),
    "expertIdx negative k": (dict(idx_shape=(4, -2)), (0, 0, 0, 0, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                             "dim 1 of expertIdx is -2"),
    "expandedXOut 3-D dropless": (dict(ex_shape=(8, 3, 1)), (0, 0, 0, 0, 0, False),
                                  ACLNN_ERR_INNER_TILING_ERROR, "expandedXOut has 3 dimensions"),
    "expandedXOut rows dropless": (dict(ex_shape=(7, 3)), (0, 0, 0, 0, 0, False),
                                   ACLNN_ERR_INNER_TILING_ERROR, "must be numRows * k = 8"),
    "expandedXOut rows active": (dict(ex_shape=(8, 3)), (5, 0, 0, 0, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                                 "must be min(activeNum, numRows * k) = 5"),
    "expandedXOut h": (dict(ex_shape=(8, 4)), (0, 0, 0, 0, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                       "dim 1 of expandedXOut is 4"),
    "expandedXOut 2-D drop/pad": (dict(ex_shape=(8, 3)), (0, 2, 4, 1, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                                  "must have 3, [expertNum, expertCapacity, h]"),
    "expandedXOut experts": (dict(ex_shape=(3, 2, 3)), (0, 2, 4, 1, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                             "dim 0 of expandedXOut is 3"),
    "expandedXOut capacity": (dict(ex_shape=(4, 3, 3)), (0, 2, 4, 1, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                              "dim 1 of expandedXOut is 3"),
    "expandedXOut h drop/pad": (dict(ex_shape=(4, 2, 2)), (0, 2, 4, 1, 0, False),
                                ACLNN_ERR_INNER_TILING_ERROR, "dim 2 of expandedXOut is 2"),
    "expandedRowIdxOut length": (dict(ri_len=7), (0, 0, 0, 0, 0, False), ACLNN_ERR_INNER_TILING_ERROR,
                                 "expandedRowIdxOut has 7 elements"),
    "count output missing": (dict(), (0, 0, 4, 0, 2, False), ACLNN_ERR_INNER_TILING_ERROR,
                             "expertTokensCountOrCumsumOut is a null pointer"),
    "count output length": (dict(cnt=(3,)), (0, 0, 4, 0, 1, False), ACLNN_ERR_INNER_TILING_ERROR,
                            "expertTokensCountOrCumsumOut has 3 elements"),
    "count output 2-D": (dict(cnt=(4, 1)), (0, 0, 4, 0, 1, False), ACLNN_ERR_INNER_TILING_ERROR,
                         "expertTokensCountOrCumsumOut has 2 dimensions"),
    "before-capacity output missing": (dict(ex_shape=(4, 2, 3)), (0, 2, 4, 1, 0, True),
                                       ACLNN_ERR_INNER_TILING_ERROR, "expertTokensBeforeCapacityOut is a null"),
    "before-capacity output length": (dict(ex_shape=(4, 2, 3), bc=(5,)), (0, 2, 4, 1, 0, True),
                                      ACLNN_ERR_INNER_TILING_ERROR, "expertTokensBeforeCapacityOut has 5"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusal(emu, res, name):
    over, attrs, want, words = REFUSALS[name]
    t = _tensors(emu, res, **over)
    st = status(emu, t["x"], t["i"], *attrs, t["ex"], t["ri"], t["cnt"], t["bc"])
    assert st == want, emu.msg()
    assert words in emu.msg()


@pytest.mark.parametrize("which", ["x", "expertIdx", "expandedXOut", "expandedRowIdxOut",
                                   "workspaceSize", "executor"])
def test_null_required_pointer_is_161001(emu, res, which):
    t = _tensors(emu, res)
    args = {"x": t["x"], "expertIdx": t["i"], "expandedXOut": t["ex"], "expandedRowIdxOut": t["ri"],
            "workspaceSize": emu.ffi.new("uint64_t *"), "executor": emu.ffi.new("aclOpExecutor **")}
    args[which] = emu.NULL
    st = emu.op.aclnnMoeInitRoutingV2GetWorkspaceSize(
        args["x"], args["expertIdx"], 0, 0, 0, 0, 0, False, args["expandedXOut"],
        args["expandedRowIdxOut"], emu.NULL, emu.NULL, args["workspaceSize"], args["executor"])
    assert st == ACLNN_ERR_PARAM_NULLPTR
    assert f"{which} is a null pointer" in emu.msg()


def test_no_device_is_361001_after_the_support_list(emu, res):
    t = _tensors(emu, res)
    bad = _tensors(emu, res, idx_dtype=ACL_INT64)
    assert in_thread_without_device(
        lambda: status(emu, t["x"], t["i"], 0, 0, 0, 0, 0, False, t["ex"], t["ri"])) == ACLNN_ERR_RUNTIME_ERROR
    assert in_thread_without_device(
        lambda: status(emu, bad["x"], bad["i"], 0, 0, 0, 0, 0, False, bad["ex"], bad["ri"])) == ACLNN_ERR_PARAM_INVALID


def test_another_ops_executor_is_refused(emu, res):
    t = _tensors(emu, res)
    st, ws, exe = phase1(emu, t["x"], t["i"], 0, 0, 0, 0, 0, False, t["ex"], t["ri"])
    emu.ok(st)
    assert emu.op.aclnnMoeInitRoutingV2Grad(res.dev(ws), ws, exe, emu.NULL) == ACLNN_ERR_PARAM_INVALID
    assert "another op" in emu.msg()
    emu.ok(emu.nn.aclDestroyAclOpExecutor(exe))
    # and the backward's executor given to the forward's launch
    wsp = emu.ffi.new("uint64_t *")
    bexe = emu.ffi.new("aclOpExecutor **")
    emu.ok(emu.op.aclnnMoeInitRoutingV2GradGetWorkspaceSize(t["ex"], t["ri"], 2, 0, 0, t["x"], wsp, bexe))
    ws = int(wsp[0])
    assert emu.op.aclnnMoeInitRoutingV2(res.dev(ws), ws, bexe[0], emu.NULL) == ACLNN_ERR_PARAM_INVALID
    assert "another op" in emu.msg()
    emu.ok(emu.nn.aclDestroyAclOpExecutor(bexe[0]))


# ============================================================================ 4. generic rules

def test_every_output_empty_skips_the_tiling_and_launches_nothing(emu, res):
    # No tokens: both outputs are empty, so even a dropPadMode the tiling refuses passes.
    t = _tensors(emu, res, x_shape=(0, 3), idx_shape=(0, 2), ex_shape=(0, 3), ri_len=0)
    st, ws, exe = phase1(emu, t["x"], t["i"], 0, 0, 0, 2, 0, False, t["ex"], t["ri"])
    emu.ok(st)
    assert ws == 0
    before = emu.stats()["kernels_launched"]
    emu.ok(emu.op.aclnnMoeInitRoutingV2(emu.NULL, 0, exe, emu.NULL))
    assert emu.stats()["kernels_launched"] == before


def test_no_tokens_with_a_count_output_writes_zero_counts(emu, res):
    x = np.zeros((0, 3), np.float32)
    idx = np.zeros((0, 2), np.int32)
    c = Case(emu, res, x, idx, num=3, flag=1)
    assert c.run() == tiling_workspace(0)
    assert c.outputs()[2].tolist() == [0, 0, 0]


def test_strided_inputs_are_read_and_add_their_dense_copies_to_the_workspace(emu, res):
    x, idx = data(5, 2, 3, 3, seed=5)
    big = np.zeros((5, 6), np.float32)
    big[:, ::2] = x  # x is every other column of a [5, 6] buffer
    idx_t = np.ascontiguousarray(idx.T)  # expertIdx read through a transposed view
    c = Case(emu, res, x, idx, num=3, flag=2)
    c.xt = res.tensor((5, 3), ACL_FLOAT, res.dev(big), strides=(6, 2), storage=(30,))
    c.it = res.tensor((5, 2), ACL_INT32, res.dev(idx_t), strides=(1, 5), storage=(10,))
    ws = c.run()
    assert ws == tiling_workspace(10) + scratch(5 * 3 * 4) + scratch(10 * 4)
    check(c, x, idx)


@pytest.mark.parametrize("stride", [2, BIG])
def test_strided_output_is_written_densely_from_its_address(emu, res, stride):
    # nnopbase accepts a strided output and the kernel writes it densely: even a stride whose
    # span no memory could hold is no reason to refuse it.
    x, idx = data(3, 2, 2, 2, seed=6)
    c = Case(emu, res, x, idx)
    c.rit = res.tensor((6,), ACL_INT32, c.ri_p, strides=(stride,), storage=(12,))
    c.run()
    check(c, x, idx)


@pytest.mark.parametrize("case", ["expertIdx elements overflow", "x strides overflow",
                                  "expandedXOut bytes overflow"])
def test_overflow_hostile_descriptors_are_161002(emu, res, case):
    mem = res.dev(4096)
    x = res.tensor((4, 3), ACL_FLOAT, mem)
    i = res.tensor((4, 2), ACL_INT32, mem)
    ex = res.tensor((8, 3), ACL_FLOAT, mem)
    ri = res.tensor((8,), ACL_INT32, mem)
    if case == "expertIdx elements overflow":
        # 2^64 + 64 slots: the outputs match the product the tiling's int64 wraps to (64), so
        # the tiling passes and the emulator's guard refuses (test_emulator_forward_hostile.py)
        x = res.tensor(((1 << 58) + 1, 3), ACL_FLOAT, mem, strides=(0, 1), storage=(3,))
        i = res.tensor(((1 << 58) + 1, 64), ACL_INT32, mem, strides=(0, 0), storage=(1,))
        ex = res.tensor((64, 3), ACL_FLOAT, mem)
        ri = res.tensor((64,), ACL_INT32, mem)
    elif case == "x strides overflow":
        x = res.tensor((4, 3), ACL_FLOAT, mem, strides=(BIG, 1), storage=(3,))
    else:
        x = res.tensor((4, BIG), ACL_FLOAT, mem, strides=(0, 0), storage=(1,))
        ex = res.tensor((8, BIG), ACL_FLOAT, mem)
    assert status(emu, x, i, 0, 0, 0, 0, 0, False, ex, ri) == ACLNN_ERR_PARAM_INVALID
    assert emu.msg()


# ============================================================================ 5. with the backward

@pytest.mark.parametrize("dtype", [ACL_FLOAT, ACL_BF16], ids=["fp32", "bf16"])
def test_backward_of_the_forward_is_k_times_x_dropless(emu, res, dtype):
    k = 3
    x, idx = data(6, k, 4, 4, seed=7)
    c = Case(emu, res, x, idx, dtype=dtype)
    c.run()
    # The backward sums, for each token, the rows its positions were routed to.
    out_p = res.dev(np.zeros((6, 4), NP_DTYPE[dtype]))
    out = res.tensor((6, 4), dtype, out_p)
    ws = emu.ffi.new("uint64_t *")
    exe = emu.ffi.new("aclOpExecutor **")
    emu.ok(emu.op.aclnnMoeInitRoutingV2GradGetWorkspaceSize(c.ext, c.rit, k, 0, 0, out, ws, exe))
    emu.ok(emu.op.aclnnMoeInitRoutingV2Grad(res.dev(int(ws[0])), int(ws[0]), exe[0], emu.NULL))
    emu.ok(emu.acl.aclrtSynchronizeStream(emu.NULL))
    got = res.read(out_p, (6, 4), NP_DTYPE[dtype]).astype(np.float32)
    np.testing.assert_array_equal(got, k * x.astype(NP_DTYPE[dtype]).astype(np.float32))


def test_mutation_fwd_wrong_row_gathers_the_next_tokens_row(emu, res):
    x, idx = data(6, 2, 3, 4, seed=6)
    assert emu.acl.aclemuSetMutation(b"fwd-wrong-row") == 0
    try:
        c = Case(emu, res, x, idx)
        c.run()
        ex, ri, _, _ = c.outputs()
        # The indices are right; each slot holds the row after its token's (wrapping around).
        want_ex, want_ri, _, _ = reference(x, idx, 0, 0, 0, 0, 0, False)
        assert np.array_equal(ri, want_ri)
        src = np.argsort(ri) // 2
        assert np.array_equal(ex, x[(src + 1) % 6]) and not np.array_equal(ex, want_ex)
    finally:
        assert emu.acl.aclemuSetMutation(b"") == 0


def test_output_indices_count_a_null_optional_output(emu, res):
    """aclSetOutputTensorAddr numbers the op's outputs as its definition does: a null optional
    output keeps index 2, refuses an address (161002), and the before-capacity output is 3."""
    x, idx = data(5, 2, 3, 3, seed=8)
    c = Case(emu, res, x, idx, cap=2, num=3, mode=1, before=True)
    st, ws, exe = c.phase1()
    emu.ok(st)
    emu.ok(emu.nn.aclSetAclOpExecutorRepeatable(exe))
    nn = emu.nn
    assert nn.aclSetOutputTensorAddr(exe, 2, c.bc, c.bc_p) == ACLNN_ERR_PARAM_INVALID
    assert "output index 2 was passed as a null pointer" in emu.msg()
    assert nn.aclSetOutputTensorAddr(exe, 4, c.bc, c.bc_p) == ACLNN_ERR_PARAM_INVALID
    assert "out of range: the op has 4" in emu.msg()
    bc2 = res.dev(np.full(3, -4, np.int32))
    emu.ok(nn.aclSetOutputTensorAddr(exe, 3, c.bc, bc2))
    wsp = res.dev(ws) if ws else emu.NULL
    emu.ok(emu.op.aclnnMoeInitRoutingV2(wsp, ws, exe, emu.NULL))
    emu.ok(emu.acl.aclrtSynchronizeStream(emu.NULL))
    want = reference(x, idx, *c.args)[3]
    assert np.array_equal(res.read(bc2, (3,), np.int32), want)
    assert (res.read(c.bc_p, (3,), np.int32) == -6).all()  # the old address was left alone
    emu.ok(nn.aclDestroyAclOpExecutor(exe))


def test_queued_launches_outlive_their_executor_and_keep_their_addresses(emu, res):
    """As the backward's: a queued launch shares its executor's plan and keeps the addresses
    bound when it was made (x and every output rebound between launches), so launches queued
    before the executor was destroyed all run, each on its own buffers."""
    previous = emu.ffi.string(emu.acl.aclemuGetStreamMode())
    assert emu.acl.aclemuSetStreamMode(b"lazy") == 0
    try:
        x, idx = data(6, 2, 4, 3, seed=31)
        c = Case(emu, res, x, idx, num=3, flag=1)
        st, ws, exe = c.phase1()
        emu.ok(st)
        emu.ok(emu.nn.aclSetAclOpExecutorRepeatable(exe))
        wsp = res.dev(ws) if ws else emu.NULL
        s = res.stream()
        xs = [x * (i + 1) for i in range(3)]
        outs = []
        for xi in xs:
            ex_p = res.dev(np.zeros(c.ex_shape, np.float32))
            ri_p = res.dev(np.zeros(c.ri_len, np.int32))
            cnt_p = res.dev(np.zeros(3, np.int32))
            emu.ok(emu.nn.aclSetInputTensorAddr(exe, 0, c.xt, res.dev(xi)))
            for slot, (t, p) in enumerate(((c.ext, ex_p), (c.rit, ri_p), (c.cnt, cnt_p))):
                emu.ok(emu.nn.aclSetOutputTensorAddr(exe, slot, t, p))
            emu.ok(emu.op.aclnnMoeInitRoutingV2(wsp, ws, exe, s))
            outs.append((ex_p, ri_p, cnt_p))
        emu.ok(emu.nn.aclDestroyAclOpExecutor(exe))
        emu.ok(emu.acl.aclrtSynchronizeStream(s))
        for xi, (ex_p, ri_p, cnt_p) in zip(xs, outs):
            rex, rri, rcnt, _ = reference(xi, idx, *c.args)
            np.testing.assert_array_equal(res.read(ex_p, c.ex_shape, np.float32), rex)
            np.testing.assert_array_equal(res.read(ri_p, (c.ri_len,), np.int32), rri)
            np.testing.assert_array_equal(res.read(cnt_p, (3,), np.int32), rcnt)
    finally:
        assert emu.acl.aclemuSetStreamMode(previous) == 0
