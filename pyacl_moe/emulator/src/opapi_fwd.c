/*
 * Emulated libopapi.so: the two phases of aclnnMoeInitRoutingV2, the forward of the MoE token
 * routing, on the same generic layer as the backward (opapi.c).
 *
 * The first phase answers in nnopbase's order: null inputs, null required outputs and null
 * output pointers (161001); data types and formats against the op's support list (161002);
 * the current device (361001); then, unless every output is empty (success, nothing tiled,
 * nothing launched), the tiling's checks in the order of its source (561002), the emulator's
 * extent guards (161002) and the workspace. It reads no tensor memory: expert ids out of the
 * documented range are a device fault of the kernel (kernel_fwd.c). docs/emulator.md, "The
 * forward op", says where each rule was read.
 *
 * From 9.1 (ops-transformer v9.1.0.pre op_api/aclnn_moe_init_routing_v2.cpp) the entry is built
 * from l0op calls, with the backward's differences (opapi.c): workspaceSize and executor
 * first, data types of non-empty tensors only, input formats and tiling refusals 561103, the
 * composite executor's workspace, strided outputs written through their strides.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_kernel.h"

/* The tiling's fixed reserve (16 MiB), whatever the shapes. */
#define FWD_FIXED_WORKSPACE ((uint64_t)16 * 1024 * 1024)
/* The emulated SoC is an Ascend 950 (arch35): it takes INT64 and 1-D expert ids and an
 * activeNum <= 0, and its workspace holds 4 more bytes an expert (docs/emulator.md, "Chips"). */
static int arch35(void) { return emu_soc_family(aclrtGetSocName()) == EMU_CHIP_950; }

static const char *const API = "aclnnMoeInitRoutingV2GetWorkspaceSize";

enum { T_X, T_IDX, T_EX, T_RI, T_CNT, T_BC, T_COUNT };
static const char *const NAMES[T_COUNT] = {"x", "expertIdx", "expandedXOut", "expandedRowIdxOut",
                                           "expertTokensCountOrCumsumOut",
                                           "expertTokensBeforeCapacityOut"};

typedef struct fwd_op {
    moe_fwd_args args;
    int present[T_COUNT];
    emu_tensor_desc d[T_COUNT];
    int unchecked; /* built with the checks skipped: never launched */
    int empty;     /* every output is empty: nothing is ever launched */
    int refs;      /* the executor's, and one per launch still queued */
} fwd_op;

/* A destructor of its own: it also tells this op's executors from the backward's (emu_op_kind).
 * The plan goes once no queued launch still reads it. */
static void fwd_op_free(void *p) {
    fwd_op *op = p;
    if (emu_plan_drop(&op->refs)) free(op);
}

#define tiling_error(...) emu_fail(API, emu_tiling_status(), __VA_ARGS__)
#define invalid(...) emu_fail(API, ACLNN_ERR_PARAM_INVALID, __VA_ARGS__)

/* expertIdx must be INT32, or INT64 on the Ascend 950 (161002; ops-transformer v9.1.0.pre
 * op_api/aclnn_moe_init_routing_v2.cpp:38-41, 126-128; its def.cpp:104-117 lists the pairs). */
static int want_expert_idx(const emu_tensor_desc *t) {
    if (t->dtype == ACL_INT32 || (t->dtype == ACL_INT64 && arch35())) return 0;
    return invalid("expertIdx has data type %s (%d): it must be INT32 (INT64 only on the Ascend "
                   "950; this SoC is %s)",
                   dtype_name(t->dtype), (int)t->dtype, aclrtGetSocName());
}

/* The support list (moe_init_routing_v2_def.cpp, ascend910b), as nnopbase matches it up to 9.0:
 * x and expandedXOut FLOAT16, BF16 or FLOAT and the same; expertIdx and every index or count
 * output INT32; ND formats. */
static int check_support_list(const fwd_op *op) {
    const emu_tensor_desc *x = &op->d[T_X];
    int st = want_float(API, x, "x");
    if (!st) st = want_expert_idx(&op->d[T_IDX]);
    if (!st) st = want_same(API, &op->d[T_EX], "expandedXOut", x, "x");
    for (int i = T_RI; i < T_COUNT && !st; i++)
        if (op->present[i]) st = want_int32(API, &op->d[i], NAMES[i]);
    if (st) return st;
    for (int i = 0; i < T_COUNT; i++) {
        if (op->present[i] && !format_is_nd_like(op->d[i].format))
            return invalid("%s has format %d: the operator supports ND, and NCHW, NHWC, NCL, "
                           "NCDHW and DHWCN as ND",
                           NAMES[i], (int)op->d[i].format);
    }
    return 0;
}

/* 9.1's CheckDtypeValid, the variant for SoCs other than 310P and the regbase ones
 * (ops-transformer v9.1.0.pre op_api/aclnn_moe_init_routing_v2.cpp): each tensor's list only
 * when it is non-empty, and a non-empty expandedXOut with x's data type even if x is empty
 * (161002). No format is checked here (kernel_format). */
static int check_dtypes_l0op(const fwd_op *op) {
    const emu_tensor_desc *x = &op->d[T_X], *ex = &op->d[T_EX];
    int st = is_empty(x) ? 0 : want_float(API, x, "x");
    if (!st && !is_empty(&op->d[T_IDX])) st = want_expert_idx(&op->d[T_IDX]);
    if (!st && !is_empty(ex)) st = want_float(API, ex, "expandedXOut");
    if (!st && !is_empty(ex)) st = want_same(API, ex, "expandedXOut", x, "x");
    for (int i = T_RI; i < T_COUNT && !st; i++)
        if (op->present[i] && !is_empty(&op->d[i])) st = want_int32(API, &op->d[i], NAMES[i]);
    return st;
}

/* A token-count output the tiling checks (its CheckTokenCount): present, 1-D, [expertNum]. */
static int check_token_count(const fwd_op *op, int which, int64_t expert_num) {
    if (!op->present[which])
        return tiling_error("%s is a null pointer, but the flag that switches it on is set",
                            NAMES[which]);
    const emu_tensor_desc *t = &op->d[which];
    if (t->ndim != 1)
        return tiling_error("%s has %lld dimensions: it must have 1, [expertNum]", NAMES[which],
                            (long long)t->ndim);
    if (t->shape[0] != expert_num)
        return tiling_error("%s has %lld elements: it must have expertNum = %lld", NAMES[which],
                            (long long)t->shape[0], (long long)expert_num);
    return 0;
}

/* Rows of expandedXOut in mode 0: all N*K for activeNum 0, else min(activeNum, N*K); a negative
 * one (the 950's) N*K + activeNum, floored at 0 (tiling:178-184). */
static int64_t fwd_rows(int64_t total, int64_t active) {
    int64_t r = active <= 0 ? total + active : emu_min64(total, active);
    return r < 0 ? 0 : r;
}

/* The tiling's checks (GetShapeAttrsInfo, then CheckOutShape), in the order of its source. */
static int check_tiling(fwd_op *op, int64_t active, int64_t cap, int64_t num, int64_t mode,
                        int64_t flag, int before) {
    const emu_tensor_desc *x = &op->d[T_X], *idx = &op->d[T_IDX];
    if (x->ndim != 2)
        return tiling_error("x has %lld dimensions: it must have 2, [numRows, h]",
                            (long long)x->ndim);
    if (dim(x, 0) != dim(idx, 0))
        return tiling_error("x has %lld rows but expertIdx has %lld: dim 0 of both must be equal",
                            (long long)dim(x, 0), (long long)dim(idx, 0));
    if (dim(x, 0) < 0) return tiling_error("dim 0 of x is %lld: it must be 0 or greater",
                                           (long long)dim(x, 0));
    if (dim(x, 1) < 0) return tiling_error("dim 1 of x is %lld: it must be 0 or greater",
                                           (long long)dim(x, 1));
    if (dim(idx, 0) < 0) return tiling_error("dim 0 of expertIdx is %lld: it must be 0 or greater",
                                             (long long)dim(idx, 0));
    if (cap < 0) return tiling_error("expertCapacity is %lld: it must be 0 or greater", (long long)cap);
    if (num < 0) return tiling_error("expertNum is %lld: it must be 0 or greater", (long long)num);
    if (mode != 0 && mode != 1)
        return tiling_error("dropPadMode is %lld: it must be 0 (dropless/active) or 1 (drop/pad)",
                            (long long)mode);
    if (mode == 1 && (cap < 1 || num < 1))
        return tiling_error("drop/pad mode (dropPadMode 1): expertCapacity is %lld and expertNum "
                            "is %lld; both must be greater than 0",
                            (long long)cap, (long long)num);
    if (flag < 0 || flag > 2)
        return tiling_error("expertTokensCountOrCumsumFlag is %lld: it must be 0 (no output), 1 "
                            "(cumulative sum) or 2 (count)",
                            (long long)flag);
    if (flag > 0 && num <= 0)
        return tiling_error("expertTokensCountOrCumsumFlag is %lld but expertNum is %lld: "
                            "expertNum must be greater than 0 when the flag is set",
                            (long long)flag, (long long)num);
    if (mode == 1 && cap > dim(x, 0))
        return tiling_error("expertCapacity is %lld but x has %lld rows: it must not exceed them",
                            (long long)cap, (long long)dim(x, 0));
    /* Each mode ignores the other mode's output flag from here on. */
    if (mode == 1) flag = 0;
    else before = 0;
    /* The Ascend 950 checks no activeNum and takes a 1-D expertIdx as K = 1 (tiling:387-397). */
    const int a35 = arch35();
    if (active < 0 && !a35)
        return tiling_error("activeNum is %lld: it must be 0 or greater", (long long)active);
    if (a35 ? idx->ndim != 1 && idx->ndim != 2 : idx->ndim != 2)
        return tiling_error("expertIdx has %lld dimensions: it must have %s", (long long)idx->ndim,
                            a35 ? "1 or 2, [numRows] or [numRows, k]" : "2, [numRows, k]");
    if (idx->ndim == 2 && idx->shape[1] < 0)
        return tiling_error("dim 1 of expertIdx is %lld: it must be 0 or greater",
                            (long long)idx->shape[1]);
    const int64_t n = idx->shape[0], k = idx->ndim == 2 ? idx->shape[1] : 1, h = x->shape[1];
    /* The tiling multiplies in int64 without a check and compares the outputs with the
     * wrapped product (the builtin leaves it in total), so a wrong output shape is its 561002
     * first; an overflow that gets through is the emulator's guard, below. */
    int64_t total;
    const int wrapped = __builtin_mul_overflow(n, k, &total);
    const emu_tensor_desc *ex = &op->d[T_EX], *ri = &op->d[T_RI];
    if (mode == 1) {
        if (ex->ndim != 3)
            return tiling_error("drop/pad mode: expandedXOut has %lld dimensions: it must have 3, "
                                "[expertNum, expertCapacity, h]",
                                (long long)ex->ndim);
        if (ex->shape[0] != num)
            return tiling_error("dim 0 of expandedXOut is %lld: it must be expertNum = %lld",
                                (long long)ex->shape[0], (long long)num);
        if (ex->shape[1] != cap)
            return tiling_error("dim 1 of expandedXOut is %lld: it must be expertCapacity = %lld",
                                (long long)ex->shape[1], (long long)cap);
        if (ex->shape[2] != h)
            return tiling_error("dim 2 of expandedXOut is %lld: it must be h (dim 1 of x) = %lld",
                                (long long)ex->shape[2], (long long)h);
    } else {
        if (ex->ndim != 2)
            return tiling_error("expandedXOut has %lld dimensions: it must have 2, [rows, h]",
                                (long long)ex->ndim);
        const int64_t rows = fwd_rows(total, active);
        if (ex->shape[0] != rows)
            return tiling_error("dim 0 of expandedXOut is %lld: it must be %s = %lld",
                                (long long)ex->shape[0],
                                active == 0   ? "numRows * k"
                                : active < 0 ? "max(numRows * k + activeNum, 0)"
                                              : "min(activeNum, numRows * k)",
                                (long long)rows);
        if (ex->shape[1] != h)
            return tiling_error("dim 1 of expandedXOut is %lld: it must be h (dim 1 of x) = %lld",
                                (long long)ex->shape[1], (long long)h);
    }
    if (ri->ndim != 1)
        return tiling_error("expandedRowIdxOut has %lld dimensions: it must have 1, [numRows * k]",
                            (long long)ri->ndim);
    if (ri->shape[0] != total)
        return tiling_error("expandedRowIdxOut has %lld elements: it must have numRows * k = %lld",
                            (long long)ri->shape[0], (long long)total);
    int st = 0;
    if (mode == 0 && flag != 0) st = check_token_count(op, T_CNT, num);
    if (!st && mode == 1 && before) st = check_token_count(op, T_BC, num);
    if (st) return st;
    if (wrapped)
        return invalid("expertIdx has %lld x %lld elements: more than int64 can count",
                       (long long)n, (long long)k);
    moe_fwd_args *a = &op->args;
    a->n = n;
    a->k = k;
    a->h = h;
    a->ex_rows = mode == 1 ? 0 : fwd_rows(total, active);
    a->capacity = cap;
    a->expert_num = num;
    a->drop_pad_mode = mode;
    a->count_flag = flag;
    a->before_capacity = before;
    a->write_cnt = flag != 0;
    a->write_bc = before != 0;
    return 0;
}

/* The tiling's workspace (its GetWorkspaceSize, for SoCs other than 310P): six floats a slot
 * for the sort, two int32 a slot for the scatter, two int32 flags a vector core (the SoC's),
 * on the Ascend 950 an int32 an expert more (tiling:627-630), and a fixed 16 MiB. Returns 0,
 * or 161002 when it does not fit in 64 bits. */
static int tiling_workspace(int64_t total, int64_t expert_num, uint64_t *ws) {
    uint64_t sort = 0, scatter = 0, sum = 0;
    const uint64_t cores = (uint64_t)emu_soc_vector_cores(aclrtGetSocName());
    const uint64_t experts = arch35() ? (uint64_t)expert_num * sizeof(int32_t) : 0;
    int bad = __builtin_mul_overflow((uint64_t)total, (uint64_t)(sizeof(float) * 2 * 3), &sort) ||
              __builtin_mul_overflow((uint64_t)total, (uint64_t)(sizeof(int32_t) * 2), &scatter) ||
              __builtin_add_overflow(sort, scatter, &sum) ||
              __builtin_add_overflow(sum, cores * 2 * sizeof(int32_t), &sum) ||
              __builtin_add_overflow(sum, experts, &sum) ||
              __builtin_add_overflow(sum, FWD_FIXED_WORKSPACE, &sum);
    if (bad) return invalid("the workspace for %lld slots does not fit in 64 bits", (long long)total);
    *ws = sum;
    return 0;
}

/* The output views the kernel writes: nnopbase accepts strided outputs, and the kernel writes
 * each one densely from its view's address (data + offset) whatever the strides, so the kernel
 * is handed that dense view and maps (and a launch faults on) the memory it really writes. */
static void densify(emu_tensor_desc *t) {
    int64_t s = 1;
    for (int64_t d = t->ndim - 1; d >= 0; d--) {
        t->strides[d] = s;
        /* A stride past int64 saturates, so that the extent guard then refuses the view. */
        if (__builtin_mul_overflow(s, t->shape[d] > 0 ? t->shape[d] : 1, &s)) s = INT64_MAX;
    }
}

/* Whether the kernel writes output i: the two required ones always, an optional one when the
 * scenario switches it on (the tiling leaves the others alone, whatever they describe). */
static int writes(const fwd_op *op, int i) {
    return i == T_EX || i == T_RI || (i == T_CNT && op->args.write_cnt) ||
           (i == T_BC && op->args.write_bc);
}

/* 9.1: the l0op picks the kernel binary before it tiles: by the inputs' formats (its outputs
 * are tensors of its own in ND, which ViewCopy takes into any format) and by every tensor's
 * data type, which the entry checked only where the tensor is not empty; a NULL optional
 * output is an INT32 placeholder (op_api/moe_init_routing_v2.cpp). */
static int check_kernel_binary(const fwd_op *op) {
    const emu_tensor_desc *x = &op->d[T_X];
    int st = kernel_format(API, x, "x");
    if (!st) st = kernel_format(API, &op->d[T_IDX], "expertIdx");
    if (!st) st = kernel_dtype(API, x, "x", emu_is_float(x->dtype));
    if (!st) st = kernel_dtype(API, &op->d[T_IDX], "expertIdx", op->d[T_IDX].dtype == ACL_INT32 ||
                                                                (op->d[T_IDX].dtype == ACL_INT64 && arch35()));
    if (!st) st = kernel_dtype(API, &op->d[T_EX], "expandedXOut", op->d[T_EX].dtype == x->dtype);
    for (int i = T_RI; i < T_COUNT && !st; i++)
        if (op->present[i]) st = kernel_dtype(API, &op->d[i], NAMES[i], op->d[i].dtype == ACL_INT32);
    return st;
}

/* Whether output i keeps its view: from 9.1 a non-contiguous one, which the kernel writes
 * densely into the workspace and l0op::ViewCopy then copies through its strides. A view whose
 * elements cannot be counted is not contiguous (its dense result then has no size: 161002). */
static int keeps_view(const fwd_op *op, int i) {
    const emu_tensor_desc *t = &op->d[i];
    return emu_l0op_entry() && !(aclemuViewNumel(t) >= 0 && aclemuIsContiguous(t));
}

/* 9.1's workspace, the composite executor's (inferred from opbase v9.1.0.pre's MaxAllocator,
 * src/nnopbase/composite_op/mem_mgr/memory_allocator.cpp: each tensor of one kernel node in a
 * bucket of its own, aligned): the tiling's figure; the zero-size placeholder the l0op
 * allocates for each NULL optional output (op_api/moe_init_routing_v2.cpp), Align(0) = 512
 * each; then the dense result of each strided output the kernel writes. An output the caller
 * gave but the scenario leaves unwritten (an optional one whose flag is off) is not modelled:
 * the l0op would give a strided one a dense result too, which ViewCopy would copy, never
 * written, into it; the emulator reserves nothing for it and leaves it alone. */
static int l0op_workspace(fwd_op *op, uint64_t *workspace) {
    uint64_t ws = 0;
    int bad = emu_workspace_add(&ws, *workspace);
    for (int i = T_CNT; i < T_COUNT && !bad; i++)
        if (!op->present[i]) bad = emu_workspace_add(&ws, 0);
    if (bad) return invalid("the workspace does not fit in 64 bits");
    int st = 0;
    for (int i = T_EX; i < T_COUNT && !st; i++) {
        int via = 0;
        if (writes(op, i) && keeps_view(op, i))
            st = view_copy_scratch(API, &op->d[i], NAMES[i], &ws, &op->args.scratch[i - T_EX], &via);
        op->args.view[i - T_EX] = via ? &op->d[i] : NULL;
    }
    *workspace = ws;
    return st;
}

static int check_shapes(fwd_op *op, int64_t active, int64_t cap, int64_t num, int64_t mode,
                        int64_t flag, int before, uint64_t *workspace) {
    /* nnopbase's "every output is empty": each present output has a dimension equal to 0 (from
     * 9.1 the l0op's test, with an empty placeholder for a NULL optional output). */
    op->empty = 1;
    for (int i = T_EX; i < T_COUNT; i++)
        if (op->present[i] && !is_empty(&op->d[i])) op->empty = 0;
    *workspace = 0;
    int st = 0;
    if (!op->empty) {
        if (emu_l0op_entry()) st = check_kernel_binary(op);
        if (!st) st = check_tiling(op, active, cap, num, mode, flag, before);
        /* The emulator's guard: the kernel numbers expandedXOut's rows in int64 (expert *
         * expertCapacity + rank), also when h is 0 and the view spans nothing. The tiling
         * leaves expertNum unbounded. */
        if (!st && mode == 1 && __builtin_mul_overflow(num, cap, &op->args.ex_rows))
            st = invalid("expertNum = %lld times expertCapacity = %lld, the rows of expandedXOut, "
                         "is more than int64 can count",
                         (long long)num, (long long)cap);
        for (int i = T_EX; i < T_COUNT && !st; i++) {
            if (!writes(op, i)) continue;
            if (!keeps_view(op, i)) densify(&op->d[i]);
            st = check_extent(API, &op->d[i], NAMES[i]);
        }
        if (!st) st = check_extent(API, &op->d[T_X], "x");
        if (!st) st = check_extent(API, &op->d[T_IDX], "expertIdx");
        if (!st) st = tiling_workspace(op->args.n * op->args.k, op->args.expert_num, workspace);
        if (!st && emu_l0op_entry()) st = l0op_workspace(op, workspace);
    } else {
        for (int i = T_X; i <= T_IDX && !st; i++)
            if (aclemuViewNumel(&op->d[i]) < 0)
                st = invalid("%s has a negative dimension or more elements than int64 can count",
                             NAMES[i]);
    }
    if (!st) st = aclemuContiguousWorkspace(API, &op->d[T_X], "x", workspace);
    if (!st) st = aclemuContiguousWorkspace(API, &op->d[T_IDX], "expertIdx", workspace);
    return st;
}

EMU_API aclnnStatus aclnnMoeInitRoutingV2GetWorkspaceSize(
    const aclTensor *x, const aclTensor *expertIdx, int64_t activeNumOptional,
    int64_t expertCapacityOptional, int64_t expertNumOptional, int64_t dropPadModeOptional,
    int64_t expertTokensCountOrCumsumFlagOptional, bool expertTokensBeforeCapacityFlagOptional,
    const aclTensor *expandedXOut, const aclTensor *expandedRowIdxOut,
    const aclTensor *expertTokensCountOrCumsumOutOptional,
    const aclTensor *expertTokensBeforeCapacityOutOptional, uint64_t *workspaceSize,
    aclOpExecutor **executor) {
    /* The optional outputs may be null: nnopbase only requires the required tensors. */
    static const char *const required[] = {"x", "expertIdx", "expandedXOut", "expandedRowIdxOut",
                                           "workspaceSize", "executor"};
    const void *const given[] = {x, expertIdx, expandedXOut, expandedRowIdxOut, workspaceSize,
                                 executor};
    int unchecked = 0;
    int f = emu_first_phase_open(API, 6, given, required, &unchecked);
    if (f) return f;
    /* The descriptors are large; keep them off the caller's stack. */
    fwd_op *op = calloc(1, sizeof *op);
    if (!op) {
        aclemuSetErrMsg(API, ACLNN_ERR_INNER, "out of host memory");
        return ACLNN_ERR_INNER;
    }
    op->refs = 1;
    const aclTensor *t[T_COUNT] = {x, expertIdx, expandedXOut, expandedRowIdxOut,
                                   expertTokensCountOrCumsumOutOptional,
                                   expertTokensBeforeCapacityOutOptional};
    int st = 0;
    for (int i = 0; i < T_COUNT && !st; i++) {
        op->present[i] = t[i] != NULL;
        if (t[i] && aclemuTensorDesc(t[i], &op->d[i]))
            st = invalid("%s (%p) is not a live aclTensor", NAMES[i], (const void *)t[i]);
    }
    /* Up to 9.0 nnopbase's support list, from 9.1 the entry's data type checks; then the
     * device, as in the backward (opapi.c says why). */
    if (!st && !unchecked) st = emu_l0op_entry() ? check_dtypes_l0op(op) : check_support_list(op);
    int32_t device = 0;
    if (!st) st = emu_first_phase_device(API, &device);
    uint64_t workspace = FWD_FIXED_WORKSPACE;
    if (!st && !unchecked)
        st = check_shapes(op, activeNumOptional, expertCapacityOptional, expertNumOptional,
                          dropPadModeOptional, expertTokensCountOrCumsumFlagOptional,
                          expertTokensBeforeCapacityFlagOptional, &workspace);
    if (st) {
        free(op);
        return st;
    }
    op->unchecked = unchecked;
    op->args.x = op->d[T_X];
    op->args.idx = op->d[T_IDX];
    emu_executor_info info;
    memset(&info, 0, sizeof info);
    info.device = device;
    info.workspace_size = workspace;
    info.n_inputs = 2;
    info.input_addr[0] = op->d[T_X].addr;
    info.input_addr[1] = op->d[T_IDX].addr;
    info.input_tensor[0] = x;
    info.input_tensor[1] = expertIdx;
    /* Outputs keep their places in the op's definition (moe_init_routing_v2_def.cpp), a null
     * optional one included: nnopbase's executor has a slot for each, marked null, and
     * aclSetOutputTensorAddr counts them all. */
    info.n_outputs = T_COUNT - T_EX;
    for (int i = T_EX; i < T_COUNT; i++) {
        info.output_addr[i - T_EX] = op->present[i] ? op->d[i].addr : 0;
        info.output_tensor[i - T_EX] = op->present[i] ? t[i] : NULL;
    }
    info.op_data = op;
    info.op_free = fwd_op_free;
    return emu_first_phase_finish(API, &info, workspaceSize, executor);
}

/* What a queued launch keeps: the plan it shares with its executor and the addresses bound
 * when it was launched, as the backward's (opapi.c says why it is not a copy of the plan). */
typedef struct fwd_launch {
    fwd_op *op;
    uintptr_t x, idx, ex, ri, cnt, bc, workspace;
    uint64_t workspace_size;
    int mutation;
} fwd_launch;

static int fwd_launch_run(void *p, char *msg, size_t len) {
    const fwd_launch *l = p;
    moe_fwd_args a = l->op->args;
    a.x.addr = l->x;
    a.idx.addr = l->idx;
    a.ex_addr = l->ex;
    a.ri_addr = l->ri;
    a.cnt_addr = l->cnt;
    a.bc_addr = l->bc;
    a.workspace = l->workspace;
    a.workspace_size = l->workspace_size;
    a.mutation = l->mutation;
    return moe_fwd_kernel_run(&a, msg, len);
}

static void fwd_launch_release(void *p) {
    fwd_launch *l = p;
    fwd_op_free(l->op);
    free(l);
}

/* Where the kernel writes an output: its bound address plus the view offset in bytes. The
 * extent guard bounded offset * element size for the outputs the kernel writes; unsigned
 * arithmetic keeps any other figure defined (a wrapped address is refused when pinned). */
static uintptr_t out_addr(const emu_tensor_desc *d, uintptr_t base) {
    return base + (uintptr_t)d->offset * (uintptr_t)moe_dtype_size(d->dtype);
}

static int fwd_unchecked(const void *op) { return ((const fwd_op *)op)->unchecked; }
static int fwd_empty(const void *op) { return ((const fwd_op *)op)->empty; }
static const emu_op_kind FWD = {fwd_op_free, "aclnnMoeInitRoutingV2GetWorkspaceSize", fwd_unchecked, fwd_empty};

EMU_API aclnnStatus aclnnMoeInitRoutingV2(void *workspace, uint64_t workspaceSize,
                                          aclOpExecutor *executor, aclrtStream stream) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    emu_executor_info info;
    int nothing;
    int st = emu_second_phase_take(api, &FWD, workspace, workspaceSize, executor, &info, &nothing);
    if (st || nothing) return st;
    fwd_op *op = info.op_data;
    fwd_launch *l = malloc(sizeof *l);
    if (l) {
        emu_plan_hold(&op->refs);
        l->op = op;
        l->x = info.input_addr[0];
        l->idx = info.input_addr[1];
        uintptr_t *slots[T_COUNT] = {NULL, NULL, &l->ex, &l->ri, &l->cnt, &l->bc};
        /* An output that keeps its view (9.1) gets its bound address: the copy through the
         * view adds the view's offset. */
        for (int i = T_EX; i < T_COUNT; i++) {
            const uintptr_t base = info.output_addr[i - T_EX];
            *slots[i] = !writes(op, i) ? 0 : op->args.view[i - T_EX] ? base : out_addr(&op->d[i], base);
        }
        l->workspace = (uintptr_t)workspace;
        l->workspace_size = emu_kernel_workspace(&info);
    }
    return emu_second_phase_launch(api, &info, stream, workspace, l ? &l->mutation : NULL,
                                   fwd_launch_run, fwd_launch_release, l);
}
