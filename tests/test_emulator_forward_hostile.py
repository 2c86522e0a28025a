"""The emulated forward op, aclnnMoeInitRoutingV2, under hostile raw calls, and against the cases
of the vendor's own unit tests.

Each test names the misuse it survives. Several defects these tests pin down were undefined
behaviour that a plain build computes "correctly" by luck (a signed product that wraps, a store
through a misaligned int32_t pointer, a memcpy whose ranges overlap): those tests pass on a plain
build and fail under the ASan+UBSan build that .ci/run runs them against, where the report aborts
the process. The others fail on any build.
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_emulator import (  # noqa: F401  (res is a fixture)
    ACL_FLOAT,
    ACL_FLOAT16,
    ACL_INT32,
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    RT_AICORE_EXCEPTION,
    res,
)
from .test_emulator_forward import Case, check, data, reference, status

BIG = 1 << 62


def dense(shape):
    """Row-major element strides of a shape, for shapes whose product Python would carry past
    int64 (a dimension of 0 or less counts as 1, as aclCreateTensor does)."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.insert(0, acc if acc < 1 << 63 else 0)
        acc *= max(n, 1)
    return strides


def shape_only(res, mem, shape, dtype, **kw):
    """A tensor whose memory the first phase never reads: any shape on a small block."""
    kw.setdefault("strides", dense(shape))
    kw.setdefault("storage", (1,))
    return res.tensor(shape, dtype, mem, **kw)


def at(emu, block, nbytes):
    """A device address `nbytes` past the start of a block."""
    return emu.ffi.cast("char *", block) + nbytes


def launch(emu, res, exe, ws):
    """The second phase on the default stream, then its synchronize: (launch, sync) statuses."""
    st = emu.op.aclnnMoeInitRoutingV2(res.dev(ws) if ws else emu.NULL, ws, exe, emu.NULL)
    emu.msg()
    return st, emu.acl.aclrtSynchronizeStream(emu.NULL)


# ============================================================================ 1. overflow

def test_expert_num_times_capacity_past_int64_is_161002_even_when_h_is_0(emu, res):
    # expandedXOut [expertNum, C, 0] spans nothing, so the extent guard passed it, and the
    # kernel multiplied expertNum * C in int64 (signed overflow); a launch must never see it.
    mem = res.dev(4096)
    x = res.tensor((4, 0), ACL_FLOAT, mem)
    idx = res.tensor((4, 1), ACL_INT32, mem)
    ex = shape_only(res, mem, (BIG, 4, 0), ACL_FLOAT)
    ri = res.tensor((4,), ACL_INT32, mem)
    assert status(emu, x, idx, 0, 4, BIG, 1, 0, False, ex, ri) == ACLNN_ERR_PARAM_INVALID
    assert "expertNum = 4611686018427387904 times expertCapacity = 4" in emu.msg()
    # k = 0: no slot at all, a capacity as large as the rows, and a before-capacity output to
    # keep the outputs from being all empty.
    n = BIG
    x = shape_only(res, mem, (n, 0), ACL_FLOAT)
    idx = shape_only(res, mem, (n, 0), ACL_INT32)
    ex = shape_only(res, mem, (4, n, 0), ACL_FLOAT)
    ri = res.tensor((0,), ACL_INT32, mem)
    bc = res.tensor((4,), ACL_INT32, mem)
    assert status(emu, x, idx, 0, n, 4, 1, 0, True, ex, ri, None, bc) == ACLNN_ERR_PARAM_INVALID
    assert "times expertCapacity = 4611686018427387904" in emu.msg()


def test_wrapped_slot_count_meets_the_tilings_shape_checks_first(emu, res):
    # The vendor's tiling computes N * k unchecked and compares the outputs with the wrapped
    # product: a wrong output shape is its 561002 before the emulator's overflow guard (161002).
    mem = res.dev(4096)
    n, k = (1 << 58) + 1, 64          # N * k = 2^64 + 64, which wraps to 64
    x = shape_only(res, mem, (n, 3), ACL_FLOAT, strides=(0, 1))
    idx = shape_only(res, mem, (n, k), ACL_INT32, strides=(0, 0))
    ri = res.tensor((64,), ACL_INT32, mem)
    wrong = res.tensor((8, 3), ACL_FLOAT, mem)
    assert status(emu, x, idx, 0, 0, 0, 0, 0, False, wrong, ri) == ACLNN_ERR_INNER_TILING_ERROR
    assert "dim 0 of expandedXOut is 8" in emu.msg()
    wrong_ri = res.tensor((8,), ACL_INT32, mem)
    right = res.tensor((64, 3), ACL_FLOAT, mem)
    assert status(emu, x, idx, 0, 0, 0, 0, 0, False, right, wrong_ri) == ACLNN_ERR_INNER_TILING_ERROR
    assert "expandedRowIdxOut has 8 elements" in emu.msg()
    # Shapes that match the wrapped product pass the tiling and meet the guard.
    assert status(emu, x, idx, 0, 0, 0, 0, 0, False, right, ri) == ACLNN_ERR_PARAM_INVALID
    assert "more than int64 can count" in emu.msg()


@pytest.mark.parametrize("which", ["empty expandedXOut", "unused before-capacity output"])
def test_output_the_kernel_does_not_write_may_have_any_offset(emu, res, which):
    # The launch computed every output's address as offset * element size in int64: an empty
    # or switched-off output with a huge offset overflowed it. Such an output is never written,
    # so the call succeeds and the others are right.
    x, idx = data(4, 2, 3, 3, seed=11)
    h = 0 if which == "empty expandedXOut" else 3
    x = x[:, :h]
    c = Case(emu, res, x, idx, ex_shape=(8, h))
    if h == 0:
        c.ext = res.tensor((8, 0), ACL_FLOAT, c.ex_p, offset=BIG)
    else:
        c.bc = res.tensor((3,), ACL_INT32, res.dev(16), offset=BIG)
    c.run()
    assert c.outputs()[1].tolist() == reference(x, idx, 0, 0, 0, 0, 0, False)[1].tolist()


def test_output_the_kernel_does_not_write_is_not_judged(emu, res):
    # The tiling never looks at a count output that its flag leaves off, so a view of it that
    # no memory could hold is no reason to refuse the call (it was 161002 from the extent guard).
    x, idx = data(5, 2, 3, 3, seed=12)
    c = Case(emu, res, x, idx, cap=2, num=3, mode=1)
    c.cnt = shape_only(res, res.dev(16), (BIG,), ACL_INT32)
    c.run()
    check(c, x, idx)


# ============================================================================ 2. addresses

def test_expanded_x_overlapping_x_is_computed_without_a_host_fault(emu, res):
    # expandedXOut one element past x's address: each row copied from x overlaps the row it
    # lands in (memcpy with overlapping ranges, an ASan report). The values are whatever a
    # device would leave; the row indices, which overlap nothing, are exact.
    x, idx = data(4, 2, 3, 3, seed=13)
    block = res.dev(np.concatenate([x.reshape(-1), np.zeros(30, np.float32)]))
    c = Case(emu, res, x, idx)
    c.xt = res.tensor((4, 3), ACL_FLOAT, block)
    c.ext = res.tensor((8, 3), ACL_FLOAT, block, offset=1, storage=(25,))
    for xs in [(3, 1), (1, 4)]:  # row-major, then a transposed-like view: element copies
        c.xt = res.tensor((4, 3), ACL_FLOAT, block, strides=xs, storage=(12,))
        c.run()
        assert c.outputs()[1].tolist() == reference(x, idx, 0, 0, 0, 0, 0, False)[1].tolist()


@pytest.mark.parametrize("shifted", [("ri",), ("cnt",), ("x", "i", "ex", "ri", "cnt")],
                         ids=["expandedRowIdxOut", "count output", "every tensor"])
@pytest.mark.parametrize("flag", [1, 2], ids=["cumsum", "count"])
def test_addresses_not_aligned_to_the_element_size_give_exact_results(emu, res, shifted, flag):
    # nnopbase hands the kernel any address it is given. The int32 outputs were stored through
    # int32_t pointers: at an odd address, undefined behaviour (UBSan: misaligned store).
    x, idx = data(6, 2, 4, 3, seed=14)
    c = Case(emu, res, x, idx, num=3, flag=flag)

    def moved(shape, dtype, src=None, by=1):
        """A tensor of `shape` starting `by` bytes into a fresh block; (tensor, address)."""
        p = at(emu, res.dev(int(np.prod(shape)) * 4 + 8), by)
        if src is not None:
            emu.h2d(p, np.ascontiguousarray(src).tobytes())
        return res.tensor(shape, dtype, p), p

    if "x" in shifted:
        c.xt, _ = moved((6, 4), ACL_FLOAT, x, by=1)
    if "i" in shifted:
        c.it, _ = moved((6, 2), ACL_INT32, idx, by=3)
    if "ex" in shifted:
        c.ext, c.ex_p = moved(c.ex_shape, ACL_FLOAT, by=2)
    if "ri" in shifted:
        c.rit, c.ri_p = moved((12,), ACL_INT32, by=1)
    if "cnt" in shifted:
        c.cnt, c.cnt_p = moved((3,), ACL_INT32, by=2)
    c.run()
    check(c, x, idx)


def test_count_output_bound_to_a_null_address_is_a_device_fault(emu, res):
    # With its flag on, the count output is written wherever it points. Rebound to NULL it was
    # silently skipped, as if absent; a device writing to address 0 faults.
    x, idx = data(4, 2, 3, 3, seed=15)
    c = Case(emu, res, x, idx, num=3, flag=1)
    st, ws, exe = c.phase1()
    emu.ok(st)
    emu.ok(emu.nn.aclSetOutputTensorAddr(exe, 2, c.cnt, emu.NULL))
    assert launch(emu, res, exe, ws) == (0, RT_AICORE_EXCEPTION)
    assert "expertTokensCountOrCumsumOut spans" in emu.msg()


@pytest.mark.parametrize("bad", [-1, 3, (1 << 31) - 1, -(1 << 31)])
def test_out_of_range_id_with_every_output_is_a_fault_never_a_write(emu, res, bad):
    # Drop/pad with the before-capacity output on, and a count output given too (unused): an
    # id outside [0, expertNum) must not index the histogram or a slot.
    x, idx = data(4, 2, 3, 3, seed=16)
    idx[3, 1] = bad
    c = Case(emu, res, x, idx, cap=2, num=3, mode=1, before=True, with_cnt=True)
    st, ws, exe = c.phase1()
    emu.ok(st)
    assert launch(emu, res, exe, ws) == (0, RT_AICORE_EXCEPTION)
    assert f"expertIdx[3][1] = {bad}" in emu.msg()
    ex, ri, cnt, bc = c.outputs()
    assert (ex == 9).all() and (ri == -7).all() and (cnt == -5).all() and (bc == -6).all()


# ============================================================================ 3. rebinding

ACLNN_ERR_INNER = 561000
ACLNN_ERR_INNER_NULLPTR = 561103


class Lists:
    """aclTensorLists a test makes; destroy() releases each (and, as in CANN, its tensors)."""

    def __init__(self, emu):
        self.emu, self.made = emu, []

    def __call__(self, *tensors):
        ffi = self.emu.ffi
        lst = self.emu.nn.aclCreateTensorList(ffi.new("aclTensor *[]", list(tensors)), len(tensors))
        assert lst != self.emu.NULL, self.emu.msg()
        self.made.append(lst)
        return lst

    def destroy(self):
        for lst in self.made:
            self.emu.ok(self.emu.nn.aclDestroyTensorList(lst))
        self.made.clear()


def test_dynamic_setters_rebind_a_forward_executor_like_the_plain_ones(emu, res):
    # Every parameter of the forward holds one tensor, so irIndex counts parameters as the
    # plain setters' index does and relativeIndex 0 is the tensor itself.
    x, idx = data(5, 2, 3, 3, seed=18)
    c = Case(emu, res, x, idx, num=3, flag=2)
    st, ws, exe = c.phase1()
    emu.ok(st)
    emu.ok(emu.nn.aclSetAclOpExecutorRepeatable(exe))
    lists = Lists(emu)
    # Tensors that a list owns: their own handles over the same memory.
    idx2 = (idx + 1) % 3
    i2 = res.dev(idx2)
    ri2, cnt2 = res.dev(np.full(10, -3, np.int32)), res.dev(np.full(3, -3, np.int32))
    it = emu.tensor((5, 2), ACL_INT32, i2)
    rit = emu.tensor((10,), ACL_INT32, ri2)
    cntt = emu.tensor((3,), ACL_INT32, cnt2)
    emu.ok(emu.nn.aclSetDynamicInputTensorAddr(exe, 1, 0, lists(it), i2))
    emu.ok(emu.nn.aclSetDynamicOutputTensorAddr(exe, 1, 0, lists(rit), ri2))
    emu.ok(emu.nn.aclSetDynamicOutputTensorAddr(exe, 2, 0, lists(cntt), cnt2))
    assert launch(emu, res, exe, ws) == (0, 0)
    _, want_ri, want_cnt, _ = reference(x, idx2, *c.args)
    assert res.read(ri2, (10,), np.int32).tolist() == want_ri.tolist()
    assert res.read(cnt2, (3,), np.int32).tolist() == want_cnt.tolist()
    assert (c.outputs()[1] == -7).all()  # the addresses the first phase was given: untouched
    emu.ok(emu.nn.aclDestroyAclOpExecutor(exe))
    lists.destroy()


@pytest.mark.parametrize("is_output,index", [(0, 2), (0, 1 << 63), (0, (1 << 64) - 1), (1, 4), (1, (1 << 64) - 1)],
                         ids=["input 2", "input 2^63", "input 2^64 - 1", "output 4", "output 2^64 - 1"])
def test_plain_setters_refuse_an_index_past_the_ops_parameters(emu, res, is_output, index):
    # size_t indices far past the op's two inputs and four outputs: 161002, and the executor's
    # bindings are as they were (nnopbase sets the tensor's own address first, as here).
    x, idx = data(4, 2, 3, 3, seed=20)
    c = Case(emu, res, x, idx)
    st, ws, exe = c.phase1()
    emu.ok(st)
    setter = emu.nn.aclSetOutputTensorAddr if is_output else emu.nn.aclSetInputTensorAddr
    spare = res.tensor((8,), ACL_INT32, c.ri_p)
    assert setter(exe, index, spare, res.dev(64)) == ACLNN_ERR_PARAM_INVALID
    assert f"index {index} is out of range" in emu.msg()
    assert launch(emu, res, exe, ws) == (0, 0)
    check(c, x, idx)


# name: (is_output, irIndex, relativeIndex, list, executor, status, words); list is "list" (the
# output or input tensor), "null", "two" (two tensors), "null entry", "stale", "stale entry";
# executor is "live", "null" or "stale"
DYNAMIC_REFUSALS = {
    "null list": (1, 1, 0, "null", "live", ACLNN_ERR_INNER_NULLPTR, "tensors is NULL"),
    "relativeIndex past the list": (1, 1, 1, "list", "live", ACLNN_ERR_PARAM_INVALID,
                                     "relativeIndex 1 is out of range: the list holds 1"),
    "null list entry": (1, 1, 0, "null entry", "live", ACLNN_ERR_INNER_NULLPTR, "element 0 of the list is NULL"),
    "stale list": (1, 1, 0, "stale", "live", ACLNN_ERR_PARAM_INVALID, "is not a live aclTensorList"),
    "stale list entry": (1, 1, 0, "stale entry", "live", ACLNN_ERR_PARAM_INVALID, "is not a live aclTensor"),
    "null executor": (1, 1, 0, "list", "null", ACLNN_ERR_INNER_NULLPTR, "executor is NULL"),
    "stale executor": (1, 1, 0, "list", "stale", ACLNN_ERR_INNER, "is not a live aclOpExecutor"),
    "output irIndex 4": (1, 4, 0, "list", "live", ACLNN_ERR_PARAM_INVALID, "output index 4 is out of range"),
    "output irIndex 2^64 - 1": (1, (1 << 64) - 1, 0, "list", "live", ACLNN_ERR_PARAM_INVALID, "is out of range"),
    "input irIndex 2": (0, 2, 0, "list", "live", ACLNN_ERR_PARAM_INVALID, "input index 2 is out of range"),
    "input irIndex 2^63": (0, 1 << 63, 0, "list", "live", ACLNN_ERR_PARAM_INVALID, "is out of range"),
    "relativeIndex past the parameter": (1, 1, 1, "two", "live", ACLNN_ERR_PARAM_INVALID,
                                         "output 1 of the op holds 1 tensor (it is not a dynamic"),
    "optional output passed as null": (1, 3, 0, "list", "live", ACLNN_ERR_PARAM_INVALID,
                                       "output 3 of the op holds 0 tensors"),
}


@pytest.mark.parametrize("name", list(DYNAMIC_REFUSALS))
def test_dynamic_setters_refuse_what_addresses_no_tensor_of_the_op(emu, res, name):
    is_output, ir, rel, which, executor, want, words = DYNAMIC_REFUSALS[name]
    x, idx = data(4, 2, 3, 3, seed=19)
    c = Case(emu, res, x, idx, num=3, flag=1)   # count output at 2; before-capacity (3) null
    st, ws, exe = c.phase1()
    emu.ok(st)
    nn, lists = emu.nn, Lists(emu)
    mine = emu.tensor((8,), ACL_INT32, c.ri_p)  # owned by the list it goes in
    lst = {"null": emu.NULL, "list": None, "two": None, "null entry": None, "stale": None,
           "stale entry": None}[which]
    if which == "list":
        lst = lists(mine)
    elif which == "two":
        lst = lists(mine, emu.tensor((8,), ACL_INT32, c.ri_p))
    elif which == "null entry":
        lst = lists(emu.NULL)
        emu.ok(nn.aclDestroyTensor(mine))
    elif which == "stale":
        lst = lists(mine)
        lists.destroy()
    elif which == "stale entry":
        dead = emu.tensor((8,), ACL_INT32, c.ri_p)
        emu.ok(nn.aclDestroyTensor(dead))
        lst = lists(dead)
        emu.ok(nn.aclDestroyTensor(mine))
    elif which == "null":
        emu.ok(nn.aclDestroyTensor(mine))
    target = {"live": exe, "null": emu.NULL, "stale": exe}[executor]
    if executor == "stale":
        emu.ok(nn.aclDestroyAclOpExecutor(exe))
    setter = nn.aclSetDynamicOutputTensorAddr if is_output else nn.aclSetDynamicInputTensorAddr
    try:
        assert setter(target, ir, rel, lst, c.ri_p) == want
        assert words in emu.msg()
        if executor != "stale":
            assert launch(emu, res, exe, ws) == (0, 0)  # the refusal changed no binding
            check(c, x, idx)
        if which == "stale entry":
            assert nn.aclDestroyTensorList(lists.made.pop()) == ACLNN_ERR_PARAM_INVALID  # its tensor was gone
            assert "element 0" in emu.msg()
    finally:
        lists.destroy()


def test_destroying_a_tensor_list_destroys_its_tensors(emu, res):
    # As nnopbase does (aclDestroyTensorList): the tensors are stale afterwards, and a tensor
    # the list holds twice is refused the second time, never freed twice.
    nn, mem = emu.nn, res.dev(64)
    before = emu.stats()
    a, b = emu.tensor((4,), ACL_INT32, mem), emu.tensor((4,), ACL_INT32, mem)
    lst = nn.aclCreateTensorList(emu.ffi.new("aclTensor *[]", [a, emu.NULL, b]), 3)
    size = emu.ffi.new("uint64_t *")
    emu.ok(nn.aclGetTensorListSize(lst, size))
    assert size[0] == 3 and emu.stats()["tensor_lists"] == before["tensor_lists"] + 1
    emu.ok(nn.aclDestroyTensorList(lst))
    assert emu.stats()["tensors"] == before["tensors"] and emu.stats()["tensor_lists"] == before["tensor_lists"]
    assert nn.aclDestroyTensor(a) == ACLNN_ERR_PARAM_INVALID
    assert nn.aclGetTensorListSize(lst, size) == ACLNN_ERR_PARAM_INVALID
    assert nn.aclDestroyTensorList(lst) == ACLNN_ERR_PARAM_INVALID
    c = emu.tensor((4,), ACL_INT32, mem)
    twice = nn.aclCreateTensorList(emu.ffi.new("aclTensor *[]", [c, c]), 2)
    assert nn.aclDestroyTensorList(twice) == ACLNN_ERR_PARAM_INVALID
    assert "element 1" in emu.msg()
    assert emu.stats()["tensors"] == before["tensors"]
    assert nn.aclCreateTensorList(emu.NULL, 1) == emu.NULL and "value is NULL" in emu.msg()
    assert nn.aclGetTensorListSize(emu.NULL, size) == 161001


def test_array_handles_refuse_a_null_or_huge_array_and_make_empty_ones(emu):
    # aclCreateIntArray and aclCreateTensorList share their checks: NULL with a size, a size
    # past 2^32, and an empty array (size 0, even from NULL) is a live handle of size 0.
    nn, ffi = emu.nn, emu.ffi
    before = emu.stats()
    for create, ctype in ((nn.aclCreateIntArray, "int64_t[]"), (nn.aclCreateTensorList, "aclTensor *[]")):
        assert create(emu.NULL, 2) == emu.NULL and "value is NULL" in emu.msg()
        assert create(ffi.new(ctype, 1), (1 << 32) + 1) == emu.NULL and "too large" in emu.msg()
    assert emu.stats() == before
    arr, lst = nn.aclCreateIntArray(emu.NULL, 0), nn.aclCreateTensorList(emu.NULL, 0)
    assert arr != emu.NULL and lst != emu.NULL
    size = ffi.new("uint64_t *")
    emu.ok(nn.aclGetTensorListSize(lst, size))
    assert size[0] == 0
    assert emu.stats()["int_arrays"] == before["int_arrays"] + 1
    assert emu.stats()["tensor_lists"] == before["tensor_lists"] + 1
    emu.ok(nn.aclDestroyIntArray(arr))
    emu.ok(nn.aclDestroyTensorList(lst))
    assert emu.stats() == before


# ============================================================================ 4. the vendor's cases

# The cases of moe/moe_init_routing_v2/tests/utest/ts_moe_init_routing_v2_tc.cpp
# (repo-mirror-test/ops-transformer): N, H, K, activeNum, C, E, dropPadMode, count flag,
# before-capacity flag, and the tensors its case builder makes (x [N, H], expertIdx [N, K],
# expandedX [N*K or min(activeNum, N*K), H] or [E, C, H], expandedRowIdx [N*K], both token
# outputs [E], always given). Its x is INT32, which only its direct tiling call lets through;
# FLOAT16 here keeps the support list out of the way. Overrides replace one tensor's shape.
VENDOR_REFUSALS = {
    "x_dim_check": ((320, 60, 56, 1000, 0, 64, 0, 1, False), {"x": (320,)}, "x has 1 dimensions"),
    "e_check": ((320, 3000, 56, 1000, 0, 0, 0, 1, False), {}, "expertNum must be greater than 0"),
    "c_check": ((320, 3000, 56, 1000, 0, 64, 1, 1, False), {}, "expertCapacity is 0 and expertNum is 64"),
    "droppad expandedX 2-D": ((320, 3000, 56, 0, 30, 64, 1, 0, True), {"ex": (56 * 320, 3000)},
                              "expandedXOut has 2 dimensions"),
    "droppad expandedX dim 1": ((320, 3000, 56, 0, 30, 64, 1, 0, True), {"ex": (64, 300, 3000)},
                                "dim 1 of expandedXOut is 300"),
    "droppad expandedX dim 0": ((320, 3000, 56, 0, 30, 64, 1, 0, True), {"ex": (128, 300, 3000)},
                                "dim 0 of expandedXOut is 128"),
    "droppad expandedX dim 2": ((320, 3000, 56, 0, 30, 64, 1, 0, True), {"ex": (128, 300, 3001)},
                                "dim 0 of expandedXOut is 128"),
    "before-capacity shape": ((320, 3000, 56, 0, 30, 64, 1, 0, True), {"bc": (128,)},
                              "expertTokensBeforeCapacityOut has 128 elements"),
    "activenum expandedX 3-D": ((320, 3000, 56, 0, 30, 64, 0, 1, False), {"ex": (64, 30, 3000)},
                                "expandedXOut has 3 dimensions"),
    "activenum expandedX rows": ((320, 3000, 56, 0, 30, 64, 0, 1, False), {"ex": (2939, 3000)},
                                 "dim 0 of expandedXOut is 2939"),
    "activenum expandedX h": ((320, 3000, 56, 0, 30, 64, 0, 1, False), {"ex": (300, 3001)},
                              "dim 0 of expandedXOut is 300"),
    "activeNum negative": ((320, 3000, 56, -3, 0, 64, 0, 1, False), {}, "activeNum is -3"),
    "C negative": ((320, 3000, 56, 0, -5, 64, 0, 1, False), {}, "expertCapacity is -5"),
    "E negative": ((320, 3000, 56, 0, 0, -4, 0, 1, False), {}, "expertNum is -4"),
    "capacity_check": ((160, 30000, 12, 0, 1000, 32, 1, 0, False), {}, "expertCapacity is 1000 but x has 160 rows"),
}


def vendor_tensors(res, params, over):
    n, h, k, active, c, e, mode = params[:7]
    first = n * k if not 0 < active < n * k else active
    shapes = {"x": (n, h), "i": (n, k), "ex": (e, c, h) if mode == 1 else (first, h), "ri": (n * k,),
              "cnt": (e,), "bc": (e,)}
    shapes.update(over)
    mem = res.dev(64)
    dtypes = {"x": ACL_FLOAT16, "ex": ACL_FLOAT16}
    return {key: shape_only(res, mem, s, dtypes.get(key, ACL_INT32)) for key, s in shapes.items()}


@pytest.mark.parametrize("name", list(VENDOR_REFUSALS))
def test_vendor_unit_test_refusals(emu, res, name):
    params, over, words = VENDOR_REFUSALS[name]
    n, h, k, active, c, e, mode, flag, before = params
    t = vendor_tensors(res, params, over)
    st = status(emu, t["x"], t["i"], active, c, e, mode, flag, before, t["ex"], t["ri"], t["cnt"], t["bc"])
    assert st == ACLNN_ERR_INNER_TILING_ERROR, emu.msg()
    assert words in emu.msg()
    if over:  # the same case without the override is accepted: the override is what fails
        t = vendor_tensors(res, params, {})
        st = status(emu, t["x"], t["i"], active, c, e, mode, flag, before, t["ex"], t["ri"], t["cnt"], t["bc"])
        assert st == 0, emu.msg()


@pytest.mark.parametrize("params", [
    (8, 30, 6, 32, 0, 8, 0, 1, False),   # perf_template: active, cumulative counts
    (8, 30, 6, 0, 6, 8, 1, 0, True),     # single_core_drop: drop/pad, before-capacity counts
], ids=["perf_template", "single_core_drop"])
def test_vendor_unit_test_successes_compute_the_documented_values(emu, res, params):
    n, h, k, active, c, e, mode, flag, before = params
    x, idx = data(n, k, h, e, seed=17)
    case = Case(emu, res, x, idx, active=active, cap=c, num=e, mode=mode, flag=flag, before=before,
                dtype=ACL_FLOAT16, with_cnt=True, with_bc=True)
    case.run()
    check(case, x, idx)
    _, _, cnt, bc = case.outputs()
    if mode == 0:
        assert (bc == -6).all()       # switched off: not written
    else:
        assert (cnt == -5).all()
