/*
 * Emulated libopapi.so: the two phases of aclnnMoeInitRoutingV2Grad, with the generic aclnn
 * layer (nnopbase) around them.
 *
 * The first phase answers in nnopbase's order: null tensors and output pointers (161001),
 * data types and formats against the op's support list (161002), the current device (361001);
 * then, unless every output is empty (success, nothing tiled, nothing ever launched), the
 * op's tiling conditions (561002). It reads no tensor memory. The workspace is the tiling's
 * plus the dense copies of non-contiguous inputs. The second phase checks its arguments,
 * queues the kernel on the stream and returns at once; a one-shot executor is consumed by
 * every launch that passes the argument checks, as nnopbase recycles it. docs/emulator.md,
 * "The generic aclnn layer", says where each rule was read.
 *
 * From 9.1 (emu_l0op_entry: ops-transformer v9.1.0.pre op_api/aclnn_moe_init_routing_v2_grad.cpp)
 * the entry is built from l0op calls instead, and answers differently: workspaceSize and
 * executor first, then the tensors (161001); data types only of non-empty tensors, with out's
 * equal to gradExpandedX's (161002); no format check at the entry, but an input format no
 * kernel binary takes, and every tiling refusal, make the l0op fail (561103). The workspace is
 * the composite executor's (each tensor aligned), a strided out is written through its strides
 * (l0op::ViewCopy from a dense result in the workspace), and the second phase
 * (CommonOpExecutorRun) does not compare the caller's workspace size with anything.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_kernel.h"

/* The vendor's tiling reserves this fixed workspace whatever the shapes. */
#define MOE_WORKSPACE_BYTES ((uint64_t)16 * 1024 * 1024)

static const char *const API1 = "aclnnMoeInitRoutingV2GradGetWorkspaceSize";

EMU_HIDDEN int emu_l0op_entry(void) { return aclemuRelease() >= 90100; }

EMU_HIDDEN int emu_tiling_status(void) {
    return emu_l0op_entry() ? ACLNN_ERR_INNER_NULLPTR : ACLNN_ERR_INNER_TILING_ERROR;
}

/* The tiling's reserve as the first phase reports it: nnopbase's plain sum up to 9.0; from 9.1
 * a workspace tensor of the composite executor, Align(16 MiB) = 16,777,728 (inferred from
 * opbase v9.1.0.pre's MaxAllocator, src/nnopbase/composite_op/mem_mgr/memory_allocator.cpp). */
static uint64_t tiling_workspace(void) {
    uint64_t ws = 0;
    if (!emu_l0op_entry()) return MOE_WORKSPACE_BYTES;
    emu_workspace_add(&ws, MOE_WORKSPACE_BYTES); /* cannot overflow */
    return ws;
}

typedef struct moe_op {
    moe_kernel_args args; /* addresses are refreshed from the executor at each launch */
    int unchecked;        /* built with the checks skipped: never launched */
    int empty;            /* out has no elements: tiling skipped, nothing is ever launched */
    int refs;             /* the executor's, and one per launch still queued */
} moe_op;

/* The executor's destructor (and what tells this op's executors from the forward's): the
 * plan goes once no queued launch still reads it. */
static void moe_op_unref(void *p) {
    moe_op *op = p;
    if (emu_plan_drop(&op->refs)) free(op);
}

/* What a queued launch keeps: the plan it shares with its executor and the addresses bound
 * when it was launched (later rebinding affects later launches). A few dozen bytes, where a
 * copy of the plan's descriptors is over 3 KiB: a device's task queue does not grow the
 * host's heap by kilobytes per queued kernel, and a host heap that grows and shrinks by
 * megabytes around each synchronize makes every launch pay page faults. */
typedef struct moe_launch {
    moe_op *op;
    uintptr_t x, idx, out, workspace;
    uint64_t workspace_size;
    int mutation;
} moe_launch;

static int moe_launch_run(void *p, char *msg, size_t len) {
    const moe_launch *l = p;
    moe_kernel_args a = l->op->args;
    a.x.addr = l->x;
    a.idx.addr = l->idx;
    a.out.addr = l->out;
    a.workspace = l->workspace;
    a.workspace_size = l->workspace_size;
    a.mutation = l->mutation;
    return moe_kernel_run(&a, msg, len);
}

static void moe_launch_release(void *p) {
    moe_launch *l = p;
    moe_op_unref(l->op);
    free(l);
}

EMU_HIDDEN const char *dtype_name(aclDataType dt) {
    switch (dt) {
    case ACL_FLOAT: return "FLOAT";
    case ACL_FLOAT16: return "FLOAT16";
    case ACL_BF16: return "BF16";
    case ACL_INT32: return "INT32";
    case ACL_INT64: return "INT64";
    case ACL_DOUBLE: return "DOUBLE";
    case ACL_BOOL: return "BOOL";
    case ACL_INT8: return "INT8";
    case ACL_UINT8: return "UINT8";
    case ACL_INT16: return "INT16";
    default: return "unsupported";
    }
}

/* The formats nnopbase stores as ND before matching the op's support list (FormatsLikeND in
 * its individual_op/executor/indv_executor_tensor.cpp); any other format, HWCN, NDHWC and NC
 * included, fails the match. */
EMU_HIDDEN int format_is_nd_like(aclFormat f) {
    /* acl_base.h names no DHWCN; aclFormat values are the graph engine's format numbers, where
     * DHWCN is 31 (FORMAT_DHWCN in 8.1.RC1's include/proto/dump_data.proto). */
    if ((int)f == 31) return 1;
    switch (f) {
    case ACL_FORMAT_ND: case ACL_FORMAT_NCHW: case ACL_FORMAT_NHWC: case ACL_FORMAT_NCL:
    case ACL_FORMAT_NCDHW:
        return 1;
    default:
        return 0;
    }
}

/* The emulator's own guard, not a CANN check: the kernel maps the byte range a view touches,
 * [offset + the negative spans, offset + the positive spans] elements scaled by the element
 * size, so every term must be computable in int64 or the mapped range would wrap and the host
 * would read outside it. A view with an empty dimension touches nothing. CANN has no such
 * check (a device would fault or read garbage), so the code is the one for an invalid
 * parameter, 161002. */
EMU_HIDDEN int check_extent(const char *api, const emu_tensor_desc *t, const char *name) {
    for (int64_t d = 0; d < t->ndim; d++)
        if (t->shape[d] <= 0) return 0;
    const int64_t es = (int64_t)moe_dtype_size(t->dtype);
    int64_t lo = t->offset, hi = t->offset, span, bytes;
    int bad = 0;
    for (int64_t d = 0; d < t->ndim && !bad; d++) {
        bad |= __builtin_mul_overflow(t->shape[d] - 1, t->strides[d], &span);
        if (!bad) bad |= span < 0 ? __builtin_add_overflow(lo, span, &lo)
                                  : __builtin_add_overflow(hi, span, &hi);
    }
    /* lo * es and (hi + 1) * es are the byte offsets the kernel computes from the address. */
    if (!bad) bad |= __builtin_mul_overflow(lo, es, &bytes) || __builtin_add_overflow(hi, 1, &span) ||
                     __builtin_mul_overflow(span, es, &bytes) ||
                     __builtin_sub_overflow(span, lo, &span) || __builtin_mul_overflow(span, es, &bytes);
    if (!bad) return 0;
    aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID,
                    "%s: the memory its view spans cannot be addressed: offset %lld and "
                    "(dimension - 1) * stride, in elements of %lld bytes, overflow int64",
                    name, (long long)t->offset, (long long)es);
    return ACLNN_ERR_PARAM_INVALID;
}

#define tiling_error(...) emu_fail(API1, emu_tiling_status(), __VA_ARGS__)

EMU_HIDDEN int emu_fail(const char *api, int status, const char *fmt, ...) {
    char buf[EMU_MSG_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    aclemuSetErrMsg(api, status, "%s", buf);
    return status;
}

static int check_positive(const emu_tensor_desc *t, const char *name, int allow_zero) {
    for (int64_t d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 0 || (!allow_zero && t->shape[d] == 0))
            return tiling_error("dimension %lld of %s is %lld: it must be %s", (long long)d, name,
                                (long long)t->shape[d], allow_zero ? "non-negative" : "positive");
    }
    return 0;
}

/* The Ascend 950's templates, tried in their priority order (ops-transformer v9.1.0.pre,
 * moe/moe_init_routing_v2_grad/op_host/, the registry's map: 20000 split-H, 30000 full load,
 * 40000 the general one; the 910B's template, 10000, runs the shared checks and declines):
 * - split-H (..._split_h_tiling_arch35.cpp:49-58): K <= 64, N below the vector cores and below
 *   H / 512 / ts: every pass sums all K terms;
 * - full load (..._full_load_tiling_arch35.cpp:104-137): (2K+1) rows of H (aligned to 32 bytes)
 *   fit in the UB, or, split across H, K <= 10: all K terms;
 * - the general one (..._tiling_arch35.cpp:100-129): kUbFactor = (UB - (ts+4) * Ha) / (2 ts Ha)
 *   terms a pass (at most 65535), or 1 when not even that fits.
 * Only the number of terms a pass sums changes the result's bits (kernel.c). The tiling keys
 * (200001-200003, 300001-300003, 400001-400003: the template, then dropless, drop/pad,
 * active) are not visible through aclnn. The workspace stays the 910B's 16 MiB (tiling_base.cpp:271-276). */
EMU_HIDDEN int64_t moe_arch35_k_chunk(int64_t n, int64_t k, int64_t h, int64_t ts, int64_t aiv, int64_t ub) {
    if (ts <= 0 || k <= 0) return k > 0 ? k : 1;
    if (k <= 64 && n < aiv && n < (h / 512) / ts) return k;
    int64_t h_align = (h * ts + 31) / 32 * 32 / ts;
    if ((2 * k + 1) * ts * h_align <= ub || k <= 10) return k;
    if ((3 * ts + 4) * h_align <= ub) {
        int64_t f = (ub - (ts + 4) * h_align) / (2 * ts * h_align);
        return f > 65535 ? 65535 : f < 1 ? 1 : f;
    }
    return 1;
}

/* The tiling conditions, in the vendor's order. */
static int check_tiling(const emu_tensor_desc *x, const emu_tensor_desc *idx,
                        const emu_tensor_desc *out, int64_t top_k, int64_t mode, int64_t active) {
    if (mode != 0 && mode != 1)
        return tiling_error("dropPadMode is %lld: it must be 0 (dropless/active) or 1 (drop/pad)",
                            (long long)mode);
    if (top_k <= 0)
        return tiling_error("topK is %lld: it must be greater than 0", (long long)top_k);
    if (active < 0)
        return tiling_error("activeNum is %lld: it must be 0 or greater", (long long)active);
    if (x->ndim != 2 && x->ndim != 3)
        return tiling_error("gradExpandedX has %lld dimensions: it must have 2 or 3",
                            (long long)x->ndim);
    if (mode == 1 && x->ndim != 3)
        return tiling_error("gradExpandedX has %lld dimensions: drop/pad mode (dropPadMode 1) "
                            "needs 3, [E, C, H]",
                            (long long)x->ndim);
    if (mode == 0 && active == 0 && dim(x, 0) != dim(idx, 0))
        return tiling_error("dropless mode: gradExpandedX has %lld rows but expandedRowIdx has "
                            "%lld elements; they must be equal",
                            (long long)dim(x, 0), (long long)dim(idx, 0));
    if (mode == 0 && active > 0 && dim(x, 0) != active)
        return tiling_error("active mode: gradExpandedX has %lld rows but activeNum is %lld; "
                            "they must be equal",
                            (long long)dim(x, 0), (long long)active);
    if (out->ndim != 2)
        return tiling_error("out has %lld dimensions: it must have 2, [N, H]",
                            (long long)out->ndim);
    int64_t hidden = mode == 0 ? dim(x, 1) : dim(x, 2);
    if (dim(out, 1) != hidden)
        return tiling_error("out's dim 1 is %lld but gradExpandedX's dim %d (H) is %lld; they "
                            "must be equal",
                            (long long)dim(out, 1), mode == 0 ? 1 : 2, (long long)hidden);
    if (dim(out, 0) != dim(idx, 0) / top_k)
        return tiling_error("out has %lld rows: it must have len(expandedRowIdx) / topK = %lld",
                            (long long)dim(out, 0), (long long)(dim(idx, 0) / top_k));
    int st = check_positive(idx, "expandedRowIdx", 0);
    if (!st) st = check_positive(out, "out", 0);
    /* Zero-size gradExpandedX is allowed where indices can skip every row. */
    if (!st) st = check_positive(x, "gradExpandedX", !(mode == 0 && active == 0));
    if (st) return st;
    if (dim(idx, 0) % top_k != 0)
        return tiling_error("len(expandedRowIdx) = %lld is not divisible by topK = %lld",
                            (long long)dim(idx, 0), (long long)top_k);
    return 0;
}

static int get_desc(const aclTensor *t, const char *name, emu_tensor_desc *d) {
    if (aclemuTensorDesc(t, d)) {
        aclemuSetErrMsg(API1, ACLNN_ERR_PARAM_INVALID, "%s (%p) is not a live aclTensor", name,
                        (const void *)t);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return 0;
}

EMU_HIDDEN int want_float(const char *api, const emu_tensor_desc *t, const char *name) {
    if (emu_is_float(t->dtype)) return 0;
    return emu_fail(api, ACLNN_ERR_PARAM_INVALID,
                    "%s has data type %s (%d): it must be FLOAT16, BF16 or FLOAT", name,
                    dtype_name(t->dtype), (int)t->dtype);
}

EMU_HIDDEN int want_int32(const char *api, const emu_tensor_desc *t, const char *name) {
    if (t->dtype == ACL_INT32) return 0;
    return emu_fail(api, ACLNN_ERR_PARAM_INVALID, "%s has data type %s (%d): it must be INT32",
                    name, dtype_name(t->dtype), (int)t->dtype);
}

EMU_HIDDEN int want_same(const char *api, const emu_tensor_desc *t, const char *name,
                         const emu_tensor_desc *ref, const char *ref_name) {
    if (t->dtype == ref->dtype) return 0;
    return emu_fail(api, ACLNN_ERR_PARAM_INVALID,
                    "%s has data type %s (%d) but %s has %s (%d): they must match", name,
                    dtype_name(t->dtype), (int)t->dtype, ref_name, dtype_name(ref->dtype),
                    (int)ref->dtype);
}

EMU_HIDDEN int kernel_format(const char *api, const emu_tensor_desc *t, const char *name) {
    if (format_is_nd_like(t->format)) return 0;
    return emu_fail(api, ACLNN_ERR_INNER_NULLPTR,
                    "%s has format %d: no kernel binary of the operator takes it (they take ND, "
                    "and NCHW, NHWC, NCL, NCDHW and DHWCN as ND), so the l0op finds no kernel",
                    name, (int)t->format);
}

EMU_HIDDEN int kernel_dtype(const char *api, const emu_tensor_desc *t, const char *name, int ok) {
    if (ok) return 0;
    return emu_fail(api, ACLNN_ERR_INNER_NULLPTR,
                    "%s has data type %s (%d): no kernel binary of the operator takes it with the "
                    "others' types, so the l0op finds no kernel",
                    name, dtype_name(t->dtype), (int)t->dtype);
}

EMU_HIDDEN int view_copy_scratch(const char *api, const emu_tensor_desc *t, const char *name,
                                 uint64_t *workspace, uint64_t *scratch, int *via) {
    const int64_t n = aclemuViewNumel(t);
    *via = !(n >= 0 && aclemuIsContiguous(t));
    if (!*via) return 0;
    *scratch = *workspace;
    return aclemuContiguousWorkspace(api, t, name, workspace);
}

/* The support-list match of nnopbase, up to 9.0: data types and formats (161002). */
static int check_dtypes_and_formats(const emu_tensor_desc *x, const emu_tensor_desc *idx,
                                    const emu_tensor_desc *o) {
    int st = want_float(API1, x, "gradExpandedX");
    if (!st) st = want_int32(API1, idx, "expandedRowIdx");
    if (!st) st = want_same(API1, o, "out", x, "gradExpandedX");
    if (st) return st;
    const emu_tensor_desc *all[3] = {x, idx, o};
    const char *names[3] = {"gradExpandedX", "expandedRowIdx", "out"};
    for (int i = 0; i < 3; i++) {
        if (!format_is_nd_like(all[i]->format)) {
            aclemuSetErrMsg(API1, ACLNN_ERR_PARAM_INVALID,
                            "%s has format %d: the operator supports ND, and NCHW, NHWC, NCL, "
                            "NCDHW and DHWCN as ND",
                            names[i], (int)all[i]->format);
            return ACLNN_ERR_PARAM_INVALID;
        }
    }
    return 0;
}

/* 9.1's CheckDtypeValid (ops-transformer v9.1.0.pre op_api/aclnn_moe_init_routing_v2_grad.cpp):
 * each support list is checked on a non-empty tensor only, and a non-empty out must have
 * gradExpandedX's data type even when gradExpandedX is empty (161002). No format is checked
 * here: see kernel_format. */
static int check_dtypes_l0op(const emu_tensor_desc *x, const emu_tensor_desc *idx,
                             const emu_tensor_desc *o) {
    int st = is_empty(x) ? 0 : want_float(API1, x, "gradExpandedX");
    if (!st && !is_empty(idx)) st = want_int32(API1, idx, "expandedRowIdx");
    if (!st && !is_empty(o)) st = want_float(API1, o, "out");
    if (!st && !is_empty(o)) st = want_same(API1, o, "out", x, "gradExpandedX");
    return st;
}

/* nnopbase's test for "every output is empty" (aclTensor::IsEmpty): a dimension equal to 0. */
EMU_HIDDEN int is_empty(const emu_tensor_desc *t) {
    for (int64_t d = 0; d < t->ndim; d++)
        if (t->shape[d] == 0) return 1;
    return 0;
}

/* What a non-empty out needs before the kernel can run: from 9.1 the kernel binary, then the
 * tiling conditions (561002, from 9.1 561103), the emulator's extent guards (161002) and, from
 * 9.1, the place of a strided out's dense result in the workspace (after the tiling's). */
static int check_kernel(moe_op *op, int64_t top_k, int64_t mode, int64_t active,
                        uint64_t *workspace) {
    const emu_tensor_desc *x = &op->args.x, *idx = &op->args.idx, *o = &op->args.out;
    const int l0op = emu_l0op_entry();
    /* 9.1: the l0op picks the kernel binary before it tiles. The inputs' formats count, out's
     * does not: the l0op's result is a tensor of its own in ND (op_api/moe_init_routing_v2_grad.cpp
     * allocates it with out's shape and type and FORMAT_ND), and ViewCopy takes an ND source
     * into an output of any format. Of the types only an empty expandedRowIdx's can still be
     * wrong here (out, non-empty, has gradExpandedX's type, checked). */
    int st = l0op ? kernel_format(API1, x, "gradExpandedX") : 0;
    if (!st && l0op) st = kernel_format(API1, idx, "expandedRowIdx");
    if (!st && l0op) st = kernel_dtype(API1, idx, "expandedRowIdx", idx->dtype == ACL_INT32);
    if (!st) st = check_tiling(x, idx, o, top_k, mode, active);
    /* Up to 9.0 nnopbase accepts a strided out, and the kernel writes [N, H] densely from the
     * view's address (data + offset) whatever its strides: the kernel is handed that dense
     * view, so it maps (and a launch faults on) the memory it really writes. The tiling made
     * out 2-D with positive dimensions. From 9.1 ViewCopy writes out through its own strides,
     * so out keeps its view. */
    if (!st && !l0op) {
        op->args.out.strides[0] = o->shape[1];
        op->args.out.strides[1] = 1;
    }
    if (!st) st = check_extent(API1, x, "gradExpandedX");
    if (!st) st = check_extent(API1, idx, "expandedRowIdx");
    if (!st) st = check_extent(API1, o, "out");
    /* The tiling bounds no element count: a broadcast (stride 0) view may count more
     * elements than int64 holds while spanning little memory. */
    if (!st && aclemuViewNumel(x) < 0) {
        st = ACLNN_ERR_PARAM_INVALID;
        aclemuSetErrMsg(API1, st, "gradExpandedX has more elements than int64 can count");
    }
    if (!st && l0op)
        st = view_copy_scratch(API1, o, "out", workspace, &op->args.scratch, &op->args.via_scratch);
    return st;
}

/* What the first phase checks once the data types, formats and device are known. An empty
 * out skips the op's tiling, as nnopbase skips it when every output is empty (from 9.1: the
 * l0op adds no kernel), and the executor then launches nothing. Otherwise check_kernel. The
 * workspace: the tiling's fixed 16 MiB (aligned from 9.1), a strided out's dense result (9.1),
 * and the dense copies of non-contiguous inputs. */
static int check_shapes(moe_op *op, int64_t top_k, int64_t mode, int64_t active,
                        uint64_t *workspace) {
    const emu_tensor_desc *x = &op->args.x, *idx = &op->args.idx;
    int st = 0;
    op->empty = is_empty(&op->args.out);
    *workspace = op->empty ? 0 : tiling_workspace();
    if (!op->empty) {
        st = check_kernel(op, top_k, mode, active, workspace);
    } else {
        /* Nothing is tiled, but the dense copies of the inputs are still sized; a view with
         * a negative dimension or an uncountable one has no size (the copy's own first phase
         * would refuse it; which code CANN gives was not verified). */
        const emu_tensor_desc *in[2] = {x, idx};
        const char *names[2] = {"gradExpandedX", "expandedRowIdx"};
        for (int i = 0; i < 2 && !st; i++) {
            if (aclemuViewNumel(in[i]) < 0) {
                st = ACLNN_ERR_PARAM_INVALID;
                aclemuSetErrMsg(API1, st,
                                "%s has a negative dimension or more elements than int64 can "
                                "count",
                                names[i]);
            }
        }
    }
    if (!st) st = aclemuContiguousWorkspace(API1, x, "gradExpandedX", workspace);
    if (!st) st = aclemuContiguousWorkspace(API1, idx, "expandedRowIdx", workspace);
    return st;
}

EMU_API aclnnStatus aclnnMoeInitRoutingV2GradGetWorkspaceSize(
    const aclTensor *gradExpandedX, const aclTensor *expandedRowIdx, int64_t topK,
    int64_t dropPadMode, int64_t activeNum, const aclTensor *out, uint64_t *workspaceSize,
    aclOpExecutor **executor) {
    static const char *const required[] = {"gradExpandedX", "expandedRowIdx", "out", "workspaceSize",
                                           "executor"};
    const void *const given[] = {gradExpandedX, expandedRowIdx, out, workspaceSize, executor};
    int unchecked = 0;
    int f = emu_first_phase_open(API1, 5, given, required, &unchecked);
    if (f) return f;
    /* The descriptors are large; keep them off the caller's stack. */
    moe_op *op = calloc(1, sizeof *op);
    if (!op) {
        aclemuSetErrMsg(API1, ACLNN_ERR_INNER, "out of host memory");
        return ACLNN_ERR_INNER;
    }
    op->refs = 1;
    emu_tensor_desc *x = &op->args.x, *idx = &op->args.idx, *o = &op->args.out;
    int st = get_desc(gradExpandedX, "gradExpandedX", x);
    if (!st) st = get_desc(expandedRowIdx, "expandedRowIdx", idx);
    if (!st) st = get_desc(out, "out", o);
    /* nnopbase matches data types and formats against the op's support list before it
     * registers the kernel on the current device; 9.1's entry checks data types only. The
     * device is then the emulator's place for 9.1 too (its entry asks for none: the platform
     * calls inside the l0op would fail without one; which code they give was not read). */
    if (!st && !unchecked)
        st = emu_l0op_entry() ? check_dtypes_l0op(x, idx, o) : check_dtypes_and_formats(x, idx, o);
    int32_t device = 0;
    if (!st) st = emu_first_phase_device(API1, &device);
    uint64_t workspace = tiling_workspace();
    if (!st && !unchecked) st = check_shapes(op, topK, dropPadMode, activeNum, &workspace);
    if (st) {
        free(op);
        return st;
    }
    moe_kernel_args *a = &op->args;
    a->top_k = topK;
    a->drop_pad_mode = dropPadMode;
    a->active_num = dropPadMode == 1 ? 0 : activeNum; /* activeNum is ignored in drop/pad mode */
    /* Unchecked descriptors may be anything: derive nothing that could trap. */
    a->bsk = idx->ndim >= 1 ? idx->shape[0] : 0;
    a->n = topK > 0 ? a->bsk / topK : 0;
    a->h = o->ndim >= 2 ? o->shape[1] : 0;
    /* The vendor's kernel reads gradExpandedX, made contiguous, as rows of H elements: H is dim
     * 1 in dropless/active mode and dim 2 in drop/pad mode. For a 2-D input and for drop/pad
     * that is the view's last dimension; a 3-D input in dropless/active mode passes the tiling
     * too, and is then read as flat runs of H. Rows that exist: numel / H. */
    int64_t numel = aclemuViewNumel(x);
    a->rows = a->h > 0 && numel > 0 ? numel / a->h : 0;
    a->flat = x->ndim == 3 && dropPadMode != 1;
    a->c = x->ndim == 3 && !a->flat ? x->shape[1] : 0;
    const char *soc = aclrtGetSocName();
    if (emu_soc_family(soc) == EMU_CHIP_950) {
        a->arch35 = 1;
        a->k_chunk = moe_arch35_k_chunk(a->n, topK, a->h, (int64_t)moe_dtype_size(x->dtype),
                                        emu_soc_vector_cores(soc), emu_soc_ub_bytes(soc));
        a->zero_invalid = aclemuRelease() >= 90100;
    }
    op->unchecked = unchecked;
    emu_executor_info info;
    memset(&info, 0, sizeof info);
    info.device = device;
    info.workspace_size = workspace;
    info.n_inputs = 2;
    info.n_outputs = 1;
    info.input_addr[0] = x->addr;
    info.input_addr[1] = idx->addr;
    info.output_addr[0] = o->addr;
    info.input_tensor[0] = gradExpandedX;
    info.input_tensor[1] = expandedRowIdx;
    info.output_tensor[0] = out;
    info.op_data = op;
    info.op_free = moe_op_unref;
    return emu_first_phase_finish(API1, &info, workspaceSize, executor);
}

EMU_HIDDEN int emu_first_phase_open(const char *api, int n, const void *const *required,
                                    const char *const *names, int *unchecked) {
    int f = aclemuFaultPoint(api, ACLNN_ERR_INNER);
    *unchecked = f == ACLEMU_SKIP_CHECKS;
    if (f && !*unchecked) return f;
    /* The last two are workspaceSize and executor. 9.1's entries test them before anything
     * else (OP_CHECK_COMM_INPUT, ops-transformer v9.1.0.pre op_api/aclnn_moe_init_routing_v2_grad.cpp
     * and aclnn_moe_init_routing_v2.cpp); the generated ones of 8.5/9.0, after the tensors. */
    const int first = emu_l0op_entry() ? n - 2 : 0;
    for (int k = 0; k < n; k++) {
        const int i = (first + k) % n;
        if (!required[i]) {
            aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR, "%s is a null pointer", names[i]);
            return ACLNN_ERR_PARAM_NULLPTR;
        }
    }
    return 0;
}

EMU_HIDDEN int emu_first_phase_device(const char *api, int32_t *device) {
    if (!aclemuRequireDevice(api, device)) return 0;
    aclemuSetErrMsg(api, ACLNN_ERR_RUNTIME_ERROR,
                    "no device context: call aclInit and aclrtSetDevice on this thread first");
    return ACLNN_ERR_RUNTIME_ERROR;
}

EMU_HIDDEN int emu_first_phase_finish(const char *api, const emu_executor_info *info,
                                      uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclOpExecutor *ex = aclemuExecutorCreate(info);
    if (!ex) {
        info->op_free(info->op_data);
        aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        return ACLNN_ERR_INNER;
    }
    *workspaceSize = info->workspace_size;
    *executor = ex;
    return ACLNN_SUCCESS;
}

EMU_HIDDEN int emu_second_phase_take(const char *api, const emu_op_kind *kind, void *workspace,
                                     uint64_t workspaceSize, aclOpExecutor *executor,
                                     emu_executor_info *info, int *nothing) {
    /* nnopbase's argument checks (NnopbaseRunWithWorkspace) return without touching the
     * executor: a null executor, then a null workspace for a non-zero workspaceSize (both
     * 161001), then a workspaceSize below what the first phase asked for (161002). Past them
     * a guard recycles a one-shot executor whatever happens next, so every later failure
     * (device, stream, workspace block) consumes it too. 9.1's CommonOpExecutorRun (opbase
     * v9.1.0.pre src/nnopbase/composite_op/aclnn_engine/op_executor.cpp) makes the first two
     * checks and compares the size with nothing: it records the workspace it is given, and
     * from then on that is the workspace (the launch checks it lies in a live block; a kernel
     * that reaches past it faults on the device). */
    *nothing = 0;
    if (!executor) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR, "executor is a null pointer");
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    if (workspaceSize > 0 && !workspace) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR,
                        "workspace is a null pointer but workspaceSize is %llu",
                        (unsigned long long)workspaceSize);
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    int st = aclemuExecutorAcquire(api, executor, info, 0);
    if (st) return st;
    if (info->op_free != kind->op_free) {
        /* Each op keeps its plan in its own form: another op's executor is not run here (CANN
         * would run that op's kernel; no caller relies on it). */
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID,
                        "executor was made by another op's first phase, not by %s",
                        kind->first_phase);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (kind->unchecked(info->op_data)) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID,
                        "this executor was built with the first phase's checks skipped by fault "
                        "injection; it is not launched, since its shapes were never validated");
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (!emu_l0op_entry() && workspaceSize < info->workspace_size) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID,
                        "workspaceSize is %llu but the first phase asked for %llu bytes",
                        (unsigned long long)workspaceSize,
                        (unsigned long long)info->workspace_size);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (!info->repeatable) {
        /* Take it now (another thread may have launched it meanwhile: then it is stale). */
        st = aclemuExecutorAcquire(api, executor, info, 1);
        if (st) return st;
    }
    if (emu_l0op_entry()) info->workspace_size = workspaceSize;
    if (kind->empty(info->op_data)) {
        /* Every output is empty: nnopbase launches no kernel, so neither the device nor the
         * stream is looked at. */
        aclemuExecutorRelease(info);
        *nothing = 1;
    }
    return ACLNN_SUCCESS;
}

EMU_HIDDEN uint64_t emu_kernel_workspace(const emu_executor_info *info) {
    return emu_l0op_entry() ? 0 : info->workspace_size;
}

EMU_HIDDEN int emu_second_phase_launch(const char *api, emu_executor_info *info, aclrtStream stream,
                                       void *workspace, int *mutation, emu_task_run run,
                                       emu_task_release release, void *args) {
    aclemuExecutorRelease(info); /* frees a consumed one-shot executor */
    if (!args) {
        aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        return ACLNN_ERR_INNER;
    }
    int st = aclemuLaunch(api, info->device, stream, (uintptr_t)workspace, info->workspace_size,
                          mutation, run, release, args);
    if (st) return st;
    aclemuCountAdd(EMU_C_KERNELS_LAUNCHED, 1);
    return ACLNN_SUCCESS;
}

static int grad_unchecked(const void *op) { return ((const moe_op *)op)->unchecked; }
static int grad_empty(const void *op) { return ((const moe_op *)op)->empty; }
static const emu_op_kind GRAD = {moe_op_unref, "aclnnMoeInitRoutingV2GradGetWorkspaceSize", grad_unchecked,
                                 grad_empty};

EMU_API aclnnStatus aclnnMoeInitRoutingV2Grad(void *workspace, uint64_t workspaceSize,
                                              aclOpExecutor *executor, aclrtStream stream) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    emu_executor_info info;
    int nothing;
    int st = emu_second_phase_take(api, &GRAD, workspace, workspaceSize, executor, &info, &nothing);
    if (st || nothing) return st;
    moe_op *op = info.op_data;
    moe_launch *l = malloc(sizeof *l);
    if (l) {
        emu_plan_hold(&op->refs);
        l->op = op;
        l->x = info.input_addr[0];
        l->idx = info.input_addr[1];
        l->out = info.output_addr[0];
        l->workspace = (uintptr_t)workspace;
        l->workspace_size = emu_kernel_workspace(&info);
    }
    return emu_second_phase_launch(api, &info, stream, workspace, l ? &l->mutation : NULL,
                                   moe_launch_run, moe_launch_release, l);
}
