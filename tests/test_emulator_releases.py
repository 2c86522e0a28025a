"""Where the 9.1 op entries differ from 9.0's, raw, with the two profiles side by side.

Up to 9.0 each op's aclnn entry is the generated one onto nnopbase; from 9.1 (ops-transformer
v9.1.0.pre op_api/aclnn_moe_init_routing_v2{,_grad}.cpp) it is built from l0op calls
(Contiguous, the op, ViewCopy) on the composite executor. One fresh interpreter per profile
(PYACL_MOE_EMU_RELEASE) runs every scenario below and reports what each call returned; each
test then checks one rule on both profiles. The two interpreters run at the same time, once
per test session: the workers share their answers through a file.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import threading

import numpy as np
import pytest

from .conftest import _needs_emulator, start_isolated
from .emu_raw import Emu

OLD, NEW = "9.0.0", "9.1.0"

ACLNN_ERR_PARAM_NULLPTR = 161001
ACLNN_ERR_PARAM_INVALID = 161002
ACLNN_ERR_RUNTIME_ERROR = 361001
ACLNN_ERR_INNER_TILING_ERROR = 561002
ACLNN_ERR_INNER_NULLPTR = 561103
RT_AICORE_EXCEPTION = 507015

TILING_WS = 16 * 1024 * 1024


def align(n: int) -> int:
    """The composite executor's size of a workspace tensor of n bytes (opbase's MaxAllocator)."""
    return (n + 32 + 511) & ~511


F32, F16, I32, I64, F64 = 0, 1, 3, 9, 11  # aclDataType
ND, HWCN = 2, 16  # aclFormat
SENTINEL = -7.0  # what an output buffer holds before a run


# What the child runs: each scenario stores [status, workspace or None, message] (first phase)
# or the figures of a run in R, printed as JSON at the end. Data are small integers in fp32, so
# every sum is exact whatever its order.
def child_every_scenario(tiling_ws_plus: int) -> None:
    emu = Emu()
    ffi, acl, nn, op, NULL = emu.ffi, emu.acl, emu.nn, emu.op, emu.NULL
    emu.ok(acl.aclInit(NULL))
    emu.ok(acl.aclrtSetDevice(0))
    R = {"release": int(acl.aclemuRelease())}

    def T(shape, dtype=F32, p=NULL, **kw):
        return emu.tensor(shape, dtype, p, **kw)

    def dev(a):
        a = np.ascontiguousarray(a)
        p = emu.malloc(max(a.nbytes, 1))
        if a.nbytes:
            emu.h2d(p, a.tobytes())
        return p

    def read(p, shape, dtype):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return np.frombuffer(emu.d2h(p, n), dtype).reshape(shape)

    def grad1(x, idx, out, topk=2, mode=0, active=0, ws=True, ex=True):
        wsp = ffi.new("uint64_t *") if ws else NULL
        exp = ffi.new("aclOpExecutor **") if ex else NULL
        st = op.aclnnMoeInitRoutingV2GradGetWorkspaceSize(x, idx, topk, mode, active, out, wsp, exp)
        m = emu.msg()
        return st, (int(wsp[0]) if st == 0 else None), (exp[0] if st == 0 else None), m

    def g(name, *a, **kw):
        st, ws, ex, m = grad1(*a, **kw)
        if ex is not None:
            emu.ok(nn.aclDestroyAclOpExecutor(ex))
        R[name] = [st, ws, m]

    def fwd1(x, idx, exo, ri, cnt=NULL, bc=NULL, active=0, cap=0, num=0, mode=0, flag=0, before=False,
             ws=True, ex=True):
        wsp = ffi.new("uint64_t *") if ws else NULL
        exp = ffi.new("aclOpExecutor **") if ex else NULL
        st = op.aclnnMoeInitRoutingV2GetWorkspaceSize(x, idx, active, cap, num, mode, flag, before, exo, ri,
                                                       cnt, bc, wsp, exp)
        m = emu.msg()
        return st, (int(wsp[0]) if st == 0 else None), (exp[0] if st == 0 else None), m

    def f(name, *a, **kw):
        st, ws, ex, m = fwd1(*a, **kw)
        if ex is not None:
            emu.ok(nn.aclDestroyAclOpExecutor(ex))
        R[name] = [st, ws, m]

    def sync():
        st = acl.aclrtSynchronizeStream(NULL)
        return st, emu.msg()

    def in_thread(fn):
        box = []
        t = threading.Thread(target=lambda: box.append(fn()))
        t.start()
        t.join()
        return box[0]

    # ------------------------------------------------------------------ backward: first phase
    x84, i8, o44 = T((8, 4)), T((8,), I32), T((4, 4))
    g("g_null_ws_and_x", NULL, i8, o44, ws=False)
    g("g_null_ex_and_out", x84, i8, NULL, ex=False)
    stale = T((8, 4))
    emu.ok(nn.aclDestroyTensor(stale))
    g("g_stale", stale, i8, o44)
    g("g_f64_x", T((8, 4), F64), i8, o44)
    g("g_f16_x_f32_out", T((8, 4), F16), i8, o44)
    g("g_empty_f64", T((0, 4), F64), T((0,), I32), T((0, 4), F64))
    g("g_empty_i64_idx", T((0, 4)), T((0,), I64), T((0, 4)))
    g("g_empty_out_f64_x", T((8, 4), F64), i8, T((0, 4)))
    # Drop/pad mode takes an empty [E, C, H] with a non-empty out: then out's type is compared.
    g("g_empty_f64_x_out_f32", T((0, 2, 4), F64), i8, o44, mode=1)
    g("g_empty_i64_idx_out_f32", T((4, 4)), T((4, 0), I64), T((2, 4)))
    g("g_topk_divides_not", T((10, 4)), T((10,), I32), T((3, 4)), topk=3)
    g("g_negative_dim", T((2, -1, 4)), i8, o44, mode=1)
    g("g_format_x", T((8, 4), fmt=HWCN), i8, o44)
    g("g_format_idx", x84, T((8,), I32, fmt=HWCN), o44)
    g("g_format_out", x84, i8, T((4, 4), fmt=HWCN))
    g("g_format_x_empty_out", T((0, 4), fmt=HWCN), T((0,), I32), T((0, 4)))
    g("g_out_huge_stride", x84, i8, T((4, 4), strides=(1 << 62, 1), storage=(16,)))
    g("g_x_huge_stride", T((8, 4), strides=(1 << 62, 1), storage=(32,)), i8, o44)
    g("g_ws_contiguous", x84, i8, o44)
    g("g_ws_strided_x", T((8, 4), strides=(8, 1), storage=(64,)), i8, o44)
    g("g_ws_strided_out", x84, i8, T((4, 4), strides=(8, 1), offset=2, storage=(32,)))
    g("g_ws_strided_out_fp16", T((8, 4), F16), i8, T((4, 4), F16, strides=(1, 4), storage=(16,)))
    g("g_ws_empty", T((0, 4)), T((0,), I32), T((0, 4)))
    R["g_no_device"] = list(in_thread(lambda: grad1(x84, i8, o44))[::3])
    R["g_no_device_f64"] = list(in_thread(lambda: grad1(T((8, 4), F64), i8, o44))[::3])
    R["g_no_device_format"] = list(in_thread(lambda: grad1(T((8, 4), fmt=HWCN), i8, o44))[::3])

    # ------------------------------------------------------------------ backward: runs
    rng = np.random.default_rng(7)
    N, K, H = 4, 2, 8  # N * H fp32 is more than a one-element block holds with its padding (64 bytes)
    xg = rng.integers(-8, 9, (N * K, H)).astype(np.float32)
    ig = rng.permutation(N * K).astype(np.int32)
    ref = np.zeros((N, H), np.float32)
    for j, r in enumerate(ig):
        ref[j // K] += xg[r]
    R["g_ref"] = ref.tolist()
    xp, ip = dev(xg), dev(ig)
    xt, it = T((N * K, H), F32, xp), T((N * K,), I32, ip)

    def grad_run(out_shape, buf_shape, strides=None, offset=0, storage=None, ws_bytes=None, ws_size=None,
                 null_ws=False, runs=1):
        """One launch into a buffer of SENTINEL: the first phase's status and workspace, each
        launch's status, the synchronize's status and message, and the buffer after it."""
        buf = dev(np.full(buf_shape, SENTINEL, np.float32))
        ot = T(out_shape, F32, buf, strides=strides, offset=offset, storage=storage)
        st, ws, ex, m = grad1(xt, it, ot)
        res = {"phase1": st, "ws": ws}
        if st:
            res["msg"] = m
            return res
        size = ws if ws_size is None else ws_size
        wsp = NULL if null_ws else emu.malloc(ws if ws_bytes is None else ws_bytes)
        res["phase2"] = []
        for _ in range(runs):
            res["phase2"].append(op.aclnnMoeInitRoutingV2Grad(wsp, size, ex, NULL))
            res["msg2"] = emu.msg()
        res["sync"], res["sync_msg"] = sync()
        res["buf"] = read(buf, buf_shape, np.float32).tolist()
        if res["phase2"][0] != 0 and ex is not None:
            nn.aclDestroyAclOpExecutor(ex)
        return res

    R["g_run_contiguous"] = grad_run((N, H), (N, H), runs=2)
    R["g_run_strided_out"] = grad_run((N, H), (N, 2 * H), strides=(2 * H, 1), offset=2, storage=(N * 2 * H,))
    R["g_run_transposed_out"] = grad_run((N, H), (H, N), strides=(1, N), storage=(N * H,))
    R["g_run_broadcast_out"] = grad_run((N, H), (1,), strides=(0, 0), storage=(1,))
    R["g_run_small_ws"] = grad_run((N, H), (N, H), ws_bytes=4096, ws_size=4096)
    R["g_run_null_ws"] = grad_run((N, H), (N, H), null_ws=True, ws_size=0)
    R["g_run_oversized_ws"] = grad_run((N, H), (N, H), ws_size=tiling_ws_plus)
    R["g_run_small_ws_strided"] = grad_run((N, H), (N, 2 * H), strides=(2 * H, 1), storage=(N * 2 * H,),
                                           ws_bytes=4096, ws_size=4096)
    R["g_run_null_ws_with_size"] = grad_run((N, H), (N, H), null_ws=True, ws_size=64)

    # ------------------------------------------------------------------ forward: first phase
    NT, KT, HT = 4, 2, 3
    x43, i42, e83, r8 = T((NT, HT)), T((NT, KT), I32), T((NT * KT, HT)), T((NT * KT,), I32)
    f("f_null_ws_and_x", NULL, i42, e83, r8, ws=False)
    f("f_null_ex_and_ri", x43, i42, e83, NULL, ex=False)
    f("f_f64_x", T((NT, HT), F64), i42, T((NT * KT, HT), F64), r8)
    f("f_f16_x_f32_ex", T((NT, HT), F16), i42, e83, r8)
    f("f_empty_f64", T((0, HT), F64), T((0, KT), I32), T((0, HT), F64), T((0,), I32))
    f("f_empty_x_f64_ri_written", T((NT, 0), F64), i42, T((NT * KT, 0), F64), r8)
    f("f_empty_idx_i64_count_written", x43, T((NT, 0), I64), T((0, HT)), T((0,), I32), T((4,), I32),
      num=4, flag=1)
    f("f_tiling", x43, i42, e83, r8, mode=2)
    f("f_format_x", T((NT, HT), fmt=HWCN), i42, e83, r8)
    f("f_format_ex", x43, i42, T((NT * KT, HT), fmt=HWCN), r8)
    f("f_ws_contiguous", x43, i42, e83, r8)
    f("f_ws_count_given", x43, i42, e83, r8, T((4,), I32), num=4, flag=1)
    f("f_ws_strided_ex", x43, i42, T((NT * KT, HT), strides=(2 * HT, 1), storage=(NT * KT * 2 * HT,)), r8)
    f("f_ws_strided_ri", x43, i42, e83, T((NT * KT,), I32, strides=(2,), storage=(2 * NT * KT,)))
    f("f_ws_empty", T((0, HT)), T((0, KT), I32), T((0, HT)), T((0,), I32))
    f("f_ex_huge_stride", x43, i42, T((NT * KT, HT), strides=(1 << 62, 1), storage=(24,)), r8)
    R["f_no_device"] = list(in_thread(lambda: fwd1(x43, i42, e83, r8))[::3])
    R["f_no_device_format"] = list(in_thread(lambda: fwd1(T((NT, HT), fmt=HWCN), i42, e83, r8))[::3])

    # ------------------------------------------------------------------ forward: runs
    xf = rng.integers(-8, 9, (NT, HT)).astype(np.float32)
    idf = rng.integers(0, 4, (NT, KT)).astype(np.int32)
    order = np.argsort(idf.reshape(-1), kind="stable")
    ex_ref = xf[order // KT]
    ri_ref = np.empty(NT * KT, np.int32)
    ri_ref[order] = np.arange(NT * KT)
    R["f_ex_ref"], R["f_ri_ref"] = ex_ref.tolist(), ri_ref.tolist()
    xfp, ifp = dev(xf), dev(idf)
    xft, ift = T((NT, HT), F32, xfp), T((NT, KT), I32, ifp)

    def fwd_run(ex_view, ri_view, ws_bytes=None, ws_size=None, ex_shape=(NT * KT, HT), **attrs):
        """ex_view/ri_view: (buffer shape, strides or None, offset). Both buffers start as SENTINEL."""
        (eb, es, eo), (rb, rs, ro) = ex_view, ri_view
        ebuf, rbuf = dev(np.full(eb, SENTINEL, np.float32)), dev(np.full(rb, -7, np.int32))
        et = T(ex_shape, F32, ebuf, strides=es, offset=eo, storage=(int(np.prod(eb)),))
        rt = T((NT * KT,), I32, rbuf, strides=rs, offset=ro, storage=(int(np.prod(rb)),))
        st, ws, ex, m = fwd1(xft, ift, et, rt, **attrs)
        res = {"phase1": st, "ws": ws}
        if st:
            res["msg"] = m
            return res
        size = ws if ws_size is None else ws_size
        wsp = emu.malloc(ws if ws_bytes is None else ws_bytes)
        res["phase2"] = op.aclnnMoeInitRoutingV2(wsp, size, ex, NULL)
        res["msg2"] = emu.msg()
        res["sync"], res["sync_msg"] = sync()
        res["ex"] = read(ebuf, eb, np.float32).tolist()
        res["ri"] = read(rbuf, rb, np.int32).tolist()
        if res["phase2"] != 0:
            nn.aclDestroyAclOpExecutor(ex)
        return res

    DENSE_EX, DENSE_RI = ((NT * KT, HT), None, 0), ((NT * KT,), None, 0)
    STRIDED_EX = ((NT * KT, 2 * HT), (2 * HT, 1), 1)
    STRIDED_RI = ((2 * NT * KT,), (2,), 1)
    R["f_run_contiguous"] = fwd_run(DENSE_EX, DENSE_RI)
    R["f_run_strided"] = fwd_run(STRIDED_EX, STRIDED_RI)
    R["f_run_small_ws"] = fwd_run(DENSE_EX, DENSE_RI, ws_bytes=4096, ws_size=4096)
    R["f_run_small_ws_strided"] = fwd_run(STRIDED_EX, DENSE_RI, ws_bytes=4096, ws_size=4096)

    # Drop/pad: expandedXOut [E, C, H] as columns 1..H of [E, C, 2H] (a view of three dimensions).
    E, C = 4, 2
    dp_ex = np.zeros((E, C, HT), np.float32)
    dp_ri = np.full(NT * KT, -1, np.int32)
    rank = {}
    for pos in order:
        e = int(idf.reshape(-1)[pos])
        rank[e] = rank.get(e, -1) + 1
        if rank[e] < C:
            dp_ex[e, rank[e]] = xf[pos // KT]
            dp_ri[pos] = e * C + rank[e]
    R["f_dp_ex_ref"], R["f_dp_ri_ref"] = dp_ex.tolist(), dp_ri.tolist()
    R["f_run_drop_pad_strided"] = fwd_run(((E, C, 2 * HT), (C * 2 * HT, 2 * HT, 1), 1), DENSE_RI,
                                          ex_shape=(E, C, HT), mode=1, cap=C, num=E)

    print(json.dumps(R))


def _child(release: str) -> subprocess.Popen:
    return start_isolated(child_every_scenario, TILING_WS + (1 << 20), env={"PYACL_MOE_EMU_RELEASE": release})


def _run_both() -> dict[str, dict]:
    procs = {r: _child(r) for r in (OLD, NEW)}
    out = {}
    for release, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{release}: {stderr}"
        out[release] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def by_release(tmp_path_factory) -> dict[str, dict]:
    """Every scenario's answers on the 9.0.0 and the 9.1.0 profile: the first worker to get here
    runs them, the others wait for its file (in the folder all workers of a session share)."""
    _needs_emulator()
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    answers = shared / "emulator_releases.json"
    with open(shared / "emulator_releases.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if answers.is_file():
            out = json.loads(answers.read_text())
        else:
            out = _run_both()
            answers.write_text(json.dumps(out))
    assert out[OLD]["release"] == 90000 and out[NEW]["release"] == 90100
    return out


@pytest.fixture
def old(by_release):
    return by_release[OLD]


@pytest.fixture
def new(by_release):
    return by_release[NEW]


# ============================================================================ backward, first phase

def test_workspace_size_and_executor_are_checked_before_the_tensors_on_9_1(old, new):
    # OP_CHECK_COMM_INPUT is 9.1's first statement; the generated entry tests the tensors first.
    for r in (old, new):
        assert r["g_null_ws_and_x"][0] == ACLNN_ERR_PARAM_NULLPTR
        assert r["g_null_ex_and_out"][0] == ACLNN_ERR_PARAM_NULLPTR
    assert "gradExpandedX is a null pointer" in old["g_null_ws_and_x"][2]
    assert "workspaceSize is a null pointer" in new["g_null_ws_and_x"][2]
    assert "out is a null pointer" in old["g_null_ex_and_out"][2]
    assert "executor is a null pointer" in new["g_null_ex_and_out"][2]


def test_a_stale_tensor_is_161002_on_both(old, new):
    for r in (old, new):
        assert r["g_stale"][0] == ACLNN_ERR_PARAM_INVALID
        assert "not a live aclTensor" in r["g_stale"][2]


def test_unsupported_dtypes_of_non_empty_tensors_are_161002_on_both(old, new):
    for r in (old, new):
        assert r["g_f64_x"][0] == ACLNN_ERR_PARAM_INVALID
        assert "gradExpandedX has data type DOUBLE" in r["g_f64_x"][2]
        assert r["g_f16_x_f32_out"][0] == ACLNN_ERR_PARAM_INVALID
        assert "out has data type FLOAT (0) but gradExpandedX has FLOAT16" in r["g_f16_x_f32_out"][2]
        # An empty out skips the tiling, but a non-empty x is still checked.
        assert r["g_empty_out_f64_x"][0] == ACLNN_ERR_PARAM_INVALID


def test_empty_tensors_skip_the_dtype_checks_on_9_1(old, new):
    # Every output empty: 9.1 accepts any type there (no kernel, workspace 0), nnopbase's
    # binary lookup refuses it.
    for name in ("g_empty_f64", "g_empty_i64_idx"):
        assert old[name][0] == ACLNN_ERR_PARAM_INVALID, name
        assert new[name][:2] == [0, 0], name
    # A non-empty out must have gradExpandedX's type even when gradExpandedX is empty.
    assert old["g_empty_f64_x_out_f32"][0] == new["g_empty_f64_x_out_f32"][0] == ACLNN_ERR_PARAM_INVALID
    assert "gradExpandedX has data type DOUBLE" in old["g_empty_f64_x_out_f32"][2]
    assert "out has data type FLOAT (0) but gradExpandedX has DOUBLE" in new["g_empty_f64_x_out_f32"][2]
    # An empty INT64 index beside a non-empty out passes the entry, and no kernel binary takes it.
    assert old["g_empty_i64_idx_out_f32"][0] == ACLNN_ERR_PARAM_INVALID
    assert new["g_empty_i64_idx_out_f32"][0] == ACLNN_ERR_INNER_NULLPTR
    assert "expandedRowIdx has data type INT64" in new["g_empty_i64_idx_out_f32"][2]


def test_tiling_refusals_are_561002_then_561103(old, new):
    for name, text in (("g_topk_divides_not", "not divisible by topK = 3"),
                       ("g_negative_dim", "dimension 1 of gradExpandedX is -1")):
        assert old[name][0] == ACLNN_ERR_INNER_TILING_ERROR, name
        assert new[name][0] == ACLNN_ERR_INNER_NULLPTR, name
        assert text in old[name][2] and text in new[name][2]


def test_formats_are_the_support_lists_then_the_kernels(old, new):
    # 9.1's entry checks no format; an input format no binary takes fails inside the l0op;
    # out's format never reaches the kernel (its result is ND, and ViewCopy copies into any).
    for name in ("g_format_x", "g_format_idx"):
        assert old[name][0] == ACLNN_ERR_PARAM_INVALID, name
        assert new[name][0] == ACLNN_ERR_INNER_NULLPTR, name
        assert "has format 16" in new[name][2]
    assert old["g_format_out"][0] == ACLNN_ERR_PARAM_INVALID
    assert new["g_format_out"][:2] == [0, align(TILING_WS)]
    # Nothing is selected for an empty out.
    assert old["g_format_x_empty_out"][0] == ACLNN_ERR_PARAM_INVALID
    assert new["g_format_x_empty_out"][:2] == [0, 0]


def test_the_device_comes_after_the_dtypes_and_before_the_kernel(old, new):
    for r in (old, new):
        assert r["g_no_device"][0] == ACLNN_ERR_RUNTIME_ERROR
        assert r["g_no_device_f64"][0] == ACLNN_ERR_PARAM_INVALID
    assert old["g_no_device_format"][0] == ACLNN_ERR_PARAM_INVALID
    assert new["g_no_device_format"][0] == ACLNN_ERR_RUNTIME_ERROR


def test_extent_guards_use_outs_real_strides_on_9_1(old, new):
    for r in (old, new):
        assert r["g_x_huge_stride"][0] == ACLNN_ERR_PARAM_INVALID
    # Up to 9.0 the kernel writes out densely whatever its strides; 9.1 writes through them.
    assert old["g_out_huge_stride"][:2] == [0, TILING_WS]
    assert new["g_out_huge_stride"][0] == ACLNN_ERR_PARAM_INVALID
    assert "out: the memory its view spans cannot be addressed" in new["g_out_huge_stride"][2]


def test_workspace_figures(old, new):
    assert old["g_ws_contiguous"][:2] == [0, TILING_WS]
    assert new["g_ws_contiguous"][:2] == [0, align(TILING_WS)] == [0, 16777728]
    # A strided input's dense copy, on both.
    assert old["g_ws_strided_x"][1] == TILING_WS + align(8 * 4 * 4)
    assert new["g_ws_strided_x"][1] == align(TILING_WS) + align(8 * 4 * 4)
    # A strided out's dense result, on 9.1 only.
    assert old["g_ws_strided_out"][1] == TILING_WS
    assert new["g_ws_strided_out"][1] == align(TILING_WS) + align(4 * 4 * 4)
    assert old["g_ws_strided_out_fp16"][1] == TILING_WS
    assert new["g_ws_strided_out_fp16"][1] == align(TILING_WS) + align(4 * 4 * 2)
    assert old["g_ws_empty"][:2] == new["g_ws_empty"][:2] == [0, 0]


# ============================================================================ backward, runs

def _ref(r):
    return np.array(r["g_ref"], np.float32)


def test_a_contiguous_out_is_written_in_place_on_both(old, new):
    for r in (old, new):
        run = r["g_run_contiguous"]
        assert run["phase2"][0] == 0 and run["sync"] == 0
        np.testing.assert_array_equal(np.array(run["buf"], np.float32), _ref(r))
        # One-shot: the second launch finds the executor gone, on both.
        assert run["phase2"][1] != 0
    assert old["g_run_contiguous"]["phase2"][1] == new["g_run_contiguous"]["phase2"][1]


def test_a_strided_out_is_dense_at_its_address_then_through_its_strides(old, new):
    ref = _ref(old)
    n, h = ref.shape
    for r in (old, new):
        run = r["g_run_strided_out"]
        assert (run["phase1"], run["phase2"][0], run["sync"]) == (0, 0, 0), run
    # 9.0: [N, H] densely from the view's address (data + offset 2), whatever the strides.
    got = np.array(old["g_run_strided_out"]["buf"], np.float32).reshape(-1)
    expect = np.full(n * 2 * h, -7.0, np.float32)
    expect[2:2 + n * h] = ref.reshape(-1)
    np.testing.assert_array_equal(got, expect)
    # 9.1: ViewCopy puts each element through the strides: columns 2..5 of [N, 2H].
    got = np.array(new["g_run_strided_out"]["buf"], np.float32)
    expect = np.full((n, 2 * h), -7.0, np.float32)
    expect[:, 2:2 + h] = ref
    np.testing.assert_array_equal(got, expect)


def test_a_transposed_out_is_written_transposed_on_9_1(old, new):
    ref = _ref(old)
    np.testing.assert_array_equal(np.array(old["g_run_transposed_out"]["buf"], np.float32).reshape(-1),
                                  ref.reshape(-1))
    np.testing.assert_array_equal(np.array(new["g_run_transposed_out"]["buf"], np.float32), ref.T)


def test_a_broadcast_out_faults_then_keeps_the_last_element(old, new):
    # One element of storage: 9.0's dense write does not fit in it (a device fault, nothing
    # written); 9.1's ViewCopy writes every element there, the last one staying.
    o, n = old["g_run_broadcast_out"], new["g_run_broadcast_out"]
    assert o["sync"] == RT_AICORE_EXCEPTION and o["buf"] == [-7.0]
    assert n["sync"] == 0 and n["buf"] == [float(_ref(new)[-1, -1])]


def test_a_short_workspace_is_refused_then_accepted(old, new):
    ref = _ref(old)
    for name in ("g_run_small_ws", "g_run_null_ws"):
        o, n = old[name], new[name]
        assert o["phase2"][0] == ACLNN_ERR_PARAM_INVALID, name
        assert "workspaceSize is" in o["msg2"]
        assert np.all(np.array(o["buf"]) == -7.0)
        # 9.1: CommonOpExecutorRun checks no size, and the kernel uses none of it here.
        assert (n["phase2"][0], n["sync"]) == (0, 0), (name, n)
        np.testing.assert_array_equal(np.array(n["buf"], np.float32), ref)


def test_a_short_workspace_for_a_strided_out_is_a_device_fault_on_9_1(old, new):
    o, n = old["g_run_small_ws_strided"], new["g_run_small_ws_strided"]
    assert o["phase2"][0] == ACLNN_ERR_PARAM_INVALID
    assert n["phase2"][0] == 0
    assert n["sync"] == RT_AICORE_EXCEPTION
    assert "out's dense result in the workspace" in n["sync_msg"]
    assert np.all(np.array(n["buf"]) == -7.0)  # out not written


def test_the_launch_checks_the_callers_workspace_size_on_9_1(old, new):
    # The block holds the first phase's figure; the caller claims 1 MiB more.
    o, n = old["g_run_oversized_ws"], new["g_run_oversized_ws"]
    assert (o["phase2"][0], o["sync"]) == (0, 0)
    np.testing.assert_array_equal(np.array(o["buf"], np.float32), _ref(old))
    assert n["phase2"][0] == ACLNN_ERR_PARAM_INVALID
    assert "is not inside a live device allocation" in n["msg2"]


def test_a_null_workspace_with_a_size_is_161001_on_both(old, new):
    for r in (old, new):
        assert r["g_run_null_ws_with_size"]["phase2"][0] == ACLNN_ERR_PARAM_NULLPTR


# ============================================================================ forward

def test_forward_null_checks_order(old, new):
    for r in (old, new):
        assert r["f_null_ws_and_x"][0] == r["f_null_ex_and_ri"][0] == ACLNN_ERR_PARAM_NULLPTR
    assert "x is a null pointer" in old["f_null_ws_and_x"][2]
    assert "workspaceSize is a null pointer" in new["f_null_ws_and_x"][2]
    assert "expandedRowIdxOut is a null pointer" in old["f_null_ex_and_ri"][2]
    assert "executor is a null pointer" in new["f_null_ex_and_ri"][2]


def test_forward_dtypes(old, new):
    for r in (old, new):
        assert r["f_f64_x"][0] == ACLNN_ERR_PARAM_INVALID
        assert "x has data type DOUBLE" in r["f_f64_x"][2]
        assert r["f_f16_x_f32_ex"][0] == ACLNN_ERR_PARAM_INVALID
        assert "expandedXOut has data type FLOAT (0) but x has FLOAT16" in r["f_f16_x_f32_ex"][2]
    assert old["f_empty_f64"][0] == ACLNN_ERR_PARAM_INVALID
    assert new["f_empty_f64"][:2] == [0, 0]
    # Empty tensors of other types beside a written output: past 9.1's entry, no kernel binary.
    for name, text in (("f_empty_x_f64_ri_written", "x has data type DOUBLE"),
                       ("f_empty_idx_i64_count_written", "expertIdx has data type INT64")):
        assert old[name][0] == ACLNN_ERR_PARAM_INVALID, name
        assert new[name][0] == ACLNN_ERR_INNER_NULLPTR, name
        assert text in new[name][2] and "no kernel binary" in new[name][2]


def test_forward_tiling_and_formats(old, new):
    assert old["f_tiling"][0] == ACLNN_ERR_INNER_TILING_ERROR
    assert new["f_tiling"][0] == ACLNN_ERR_INNER_NULLPTR
    assert "dropPadMode is 2" in new["f_tiling"][2]
    assert old["f_format_x"][0] == ACLNN_ERR_PARAM_INVALID
    assert new["f_format_x"][0] == ACLNN_ERR_INNER_NULLPTR
    assert old["f_format_ex"][0] == ACLNN_ERR_PARAM_INVALID
    assert new["f_format_ex"][0] == 0
    for r in (old, new):
        assert r["f_no_device"][0] == ACLNN_ERR_RUNTIME_ERROR
    assert old["f_no_device_format"][0] == ACLNN_ERR_PARAM_INVALID
    assert new["f_no_device_format"][0] == ACLNN_ERR_RUNTIME_ERROR


def _fwd_tiling_ws(total: int) -> int:
    # sort + scatter + two int32 flags for each of 40 vector cores + 16 MiB.
    return total * 24 + total * 8 + 40 * 8 + TILING_WS


def test_forward_workspace_figures(old, new):
    t = _fwd_tiling_ws(8)
    assert old["f_ws_contiguous"][1] == t
    assert new["f_ws_contiguous"][1] == align(t) + 2 * 512  # two NULL optional outputs
    assert old["f_ws_count_given"][1] == t
    assert new["f_ws_count_given"][1] == align(t) + 512
    assert old["f_ws_strided_ex"][1] == t
    assert new["f_ws_strided_ex"][1] == align(t) + 1024 + align(8 * 3 * 4)
    assert old["f_ws_strided_ri"][1] == t
    assert new["f_ws_strided_ri"][1] == align(t) + 1024 + align(8 * 4)
    assert old["f_ws_empty"][:2] == new["f_ws_empty"][:2] == [0, 0]
    assert old["f_ex_huge_stride"][0] == 0
    assert new["f_ex_huge_stride"][0] == ACLNN_ERR_PARAM_INVALID


def test_forward_strided_outputs(old, new):
    ex_ref, ri_ref = np.array(old["f_ex_ref"], np.float32), np.array(old["f_ri_ref"], np.int32)
    rows, h = ex_ref.shape
    for r in (old, new):
        c = r["f_run_contiguous"]
        assert (c["phase1"], c["phase2"], c["sync"]) == (0, 0, 0), c
        np.testing.assert_array_equal(np.array(c["ex"], np.float32), ex_ref)
        np.testing.assert_array_equal(np.array(c["ri"], np.int32), ri_ref)
        assert (r["f_run_strided"]["phase2"], r["f_run_strided"]["sync"]) == (0, 0)
    # 9.0: each output densely from its view's address (offset 1).
    o = old["f_run_strided"]
    expect = np.full(rows * 2 * h, -7.0, np.float32)
    expect[1:1 + rows * h] = ex_ref.reshape(-1)
    np.testing.assert_array_equal(np.array(o["ex"], np.float32).reshape(-1), expect)
    expect = np.full(2 * rows, -7, np.int32)
    expect[1:1 + rows] = ri_ref
    np.testing.assert_array_equal(np.array(o["ri"], np.int32), expect)
    # 9.1: through the strides.
    n = new["f_run_strided"]
    expect = np.full((rows, 2 * h), -7.0, np.float32)
    expect[:, 1:1 + h] = ex_ref
    np.testing.assert_array_equal(np.array(n["ex"], np.float32), expect)
    expect = np.full(2 * rows, -7, np.int32)
    expect[1::2] = ri_ref
    np.testing.assert_array_equal(np.array(n["ri"], np.int32), expect)


def test_forward_strided_output_of_three_dimensions(old, new):
    ex_ref, ri_ref = np.array(old["f_dp_ex_ref"], np.float32), np.array(old["f_dp_ri_ref"], np.int32)
    e, c, h = ex_ref.shape
    for r in (old, new):
        run = r["f_run_drop_pad_strided"]
        assert (run["phase1"], run["phase2"], run["sync"]) == (0, 0, 0), run
        np.testing.assert_array_equal(np.array(run["ri"], np.int32), ri_ref)
    expect = np.full(e * c * 2 * h, -7.0, np.float32)
    expect[1:1 + e * c * h] = ex_ref.reshape(-1)
    np.testing.assert_array_equal(np.array(old["f_run_drop_pad_strided"]["ex"], np.float32).reshape(-1), expect)
    expect = np.full((e, c, 2 * h), -7.0, np.float32)
    expect[:, :, 1:1 + h] = ex_ref
    np.testing.assert_array_equal(np.array(new["f_run_drop_pad_strided"]["ex"], np.float32), expect)


def test_forward_short_workspace(old, new):
    for name in ("f_run_small_ws", "f_run_small_ws_strided"):
        assert old[name]["phase2"] == ACLNN_ERR_PARAM_INVALID, name
    n = new["f_run_small_ws"]
    assert (n["phase2"], n["sync"]) == (0, 0)
    np.testing.assert_array_equal(np.array(n["ex"], np.float32), np.array(new["f_ex_ref"], np.float32))
    np.testing.assert_array_equal(np.array(n["ri"], np.int32), np.array(new["f_ri_ref"], np.int32))
    n = new["f_run_small_ws_strided"]
    assert n["phase2"] == 0 and n["sync"] == RT_AICORE_EXCEPTION
    assert "expandedXOut's dense result in the workspace" in n["sync_msg"]
    assert np.all(np.array(n["ex"]) == -7.0) and np.all(np.array(n["ri"]) == -7)
