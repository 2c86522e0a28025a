/*
 * Emulated libopapi.so: the two phases of aclnnMoeInitRoutingV2Grad.
 *
 * The first phase checks what the vendor checks, in the vendor's order and with its status
 * codes: null tensors (161001), data types (161002), then the tiling conditions (561002). It
 * reads no tensor memory. The second phase checks workspace, executor and stream, queues the
 * kernel on the stream and returns at once; a one-shot executor is consumed by every launch
 * that passes the argument checks, as the vendor's nnopbase recycles it.
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

typedef struct moe_op {
    moe_kernel_args args; /* addresses are refreshed from the executor at each launch */
    int unchecked;        /* built with the checks skipped: never launched */
} moe_op;

static const char *dtype_name(aclDataType dt) {
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

/* Formats an ND-only operator accepts: ND and the plain layouts that are ND in memory. Private
 * (fractal, C0-blocked) formats are rejected. */
static int format_is_nd_compatible(aclFormat f) {
    switch (f) {
    case ACL_FORMAT_ND: case ACL_FORMAT_NCHW: case ACL_FORMAT_NHWC: case ACL_FORMAT_HWCN:
    case ACL_FORMAT_NDHWC: case ACL_FORMAT_NCDHW: case ACL_FORMAT_NC: case ACL_FORMAT_NCL:
        return 1;
    default:
        return 0;
    }
}

static int is_contiguous(const emu_tensor_desc *t) {
    for (int64_t d = 0; d < t->ndim; d++)
        if (t->shape[d] == 0) return 1; /* no elements: nothing is laid out */
    int64_t expect = 1;
    for (int64_t d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] != 1 && t->strides[d] != expect) return 0;
        expect *= t->shape[d];
    }
    return 1;
}

/* Dimension d of a shape, or INT64_MIN when the rank is too small (as the vendor's shape
 * accessor reports a missing dimension). */
static int64_t dim(const emu_tensor_desc *t, int64_t d) {
    return d < t->ndim ? t->shape[d] : INT64_MIN;
}

static int tiling_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int tiling_error(const char *fmt, ...) {
    char buf[EMU_MSG_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    aclemuSetErrMsg(API1, ACLNN_ERR_INNER_TILING_ERROR, "%s", buf);
    return ACLNN_ERR_INNER_TILING_ERROR;
}

static int check_positive(const emu_tensor_desc *t, const char *name, int allow_zero) {
    for (int64_t d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 0 || (!allow_zero && t->shape[d] == 0)) {
            aclemuSetErrMsg(API1, ACLNN_ERR_INNER_TILING_ERROR,
                            "dimension %lld of %s is %lld: it must be %s", (long long)d, name,
                            (long long)t->shape[d], allow_zero ? "non-negative" : "positive");
            return ACLNN_ERR_INNER_TILING_ERROR;
        }
    }
    return 0;
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
        return tiling_error("out's last dimension is %lld but gradExpandedX's is %lld; they must "
                            "be equal",
                            (long long)dim(out, 1), (long long)hidden);
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
    int r = aclemuTensorDesc(t, d);
    if (r == -1) {
        aclemuSetErrMsg(API1, ACLNN_ERR_PARAM_INVALID, "%s (%p) is not a live aclTensor", name,
                        (const void *)t);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (r == -2) {
        aclemuSetErrMsg(API1, ACLNN_ERR_PARAM_INVALID,
                        "%s has %lld dimensions: operator tensors have at most %d", name,
                        (long long)d->ndim, EMU_OP_MAX_DIMS);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return 0;
}

EMU_API aclnnStatus aclnnMoeInitRoutingV2GradGetWorkspaceSize(
    const aclTensor *gradExpandedX, const aclTensor *expandedRowIdx, int64_t topK,
    int64_t dropPadMode, int64_t activeNum, const aclTensor *out, uint64_t *workspaceSize,
    aclOpExecutor **executor) {
    int f = aclemuFaultPoint(API1, ACLNN_ERR_INNER);
    const int unchecked = f == ACLEMU_SKIP_CHECKS; /* validation weakened by fault injection */
    if (f && !unchecked) return f;
    const char *null_name = !gradExpandedX    ? "gradExpandedX"
                            : !expandedRowIdx ? "expandedRowIdx"
                            : !out            ? "out"
                            : !workspaceSize  ? "workspaceSize"
                            : !executor       ? "executor"
                                              : NULL;
    if (null_name) {
        aclemuSetErrMsg(API1, ACLNN_ERR_PARAM_NULLPTR, "%s is a null pointer", null_name);
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    int32_t device;
    if (aclemuRequireDevice(API1, &device)) {
        aclemuSetErrMsg(API1, ACLNN_ERR_RUNTIME_ERROR,
                        "no device context: call aclInit and aclrtSetDevice on this thread first");
        return ACLNN_ERR_RUNTIME_ERROR;
    }
    /* The descriptors are large; keep them off the caller's stack. */
    moe_op *op = calloc(1, sizeof *op);
    if (!op) {
        aclemuSetErrMsg(API1, ACLNN_ERR_INNER, "out of host memory");
        return ACLNN_ERR_INNER;
    }
    emu_tensor_desc *x = &op->args.x, *idx = &op->args.idx, *o = &op->args.out;
    int st = get_desc(gradExpandedX, "gradExpandedX", x);
    if (!st) st = get_desc(expandedRowIdx, "expandedRowIdx", idx);
    if (!st) st = get_desc(out, "out", o);
    if (unchecked) goto checked;
    if (!st && x->dtype != ACL_FLOAT && x->dtype != ACL_FLOAT16 && x->dtype != ACL_BF16) {
        st = ACLNN_ERR_PARAM_INVALID;
        aclemuSetErrMsg(API1, st,
                        "gradExpandedX has data type %s (%d): it must be FLOAT16, BF16 or FLOAT",
                        dtype_name(x->dtype), (int)x->dtype);
    }
    if (!st && idx->dtype != ACL_INT32) {
        st = ACLNN_ERR_PARAM_INVALID;
        aclemuSetErrMsg(API1, st, "expandedRowIdx has data type %s (%d): it must be INT32",
                        dtype_name(idx->dtype), (int)idx->dtype);
    }
    if (!st && o->dtype != x->dtype) {
        st = ACLNN_ERR_PARAM_INVALID;
        aclemuSetErrMsg(API1, st,
                        "out has data type %s (%d) but gradExpandedX has %s (%d): they must match",
                        dtype_name(o->dtype), (int)o->dtype, dtype_name(x->dtype), (int)x->dtype);
    }
    const emu_tensor_desc *all[3] = {x, idx, o};
    const char *names[3] = {"gradExpandedX", "expandedRowIdx", "out"};
    for (int i = 0; !st && i < 3; i++) {
        if (!format_is_nd_compatible(all[i]->format)) {
            st = ACLNN_ERR_PARAM_INVALID;
            aclemuSetErrMsg(API1, st, "%s has format %d: the operator supports ND only", names[i],
                            (int)all[i]->format);
        }
    }
    if (!st && !is_contiguous(o)) {
        st = ACLNN_ERR_PARAM_INVALID;
        aclemuSetErrMsg(API1, st, "out is not contiguous: the operator writes its output densely "
                                  "and does not support a strided out");
    }
    if (!st) st = check_tiling(x, idx, o, topK, dropPadMode, activeNum);
checked:
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
    int64_t numel = 1;
    for (int64_t d = 0; d < x->ndim; d++) numel *= x->shape[d] > 0 ? x->shape[d] : 0;
    a->rows = a->h > 0 ? numel / a->h : 0;
    a->flat = x->ndim == 3 && dropPadMode != 1;
    a->c = x->ndim == 3 && !a->flat ? x->shape[1] : 0;
    op->unchecked = unchecked;
    emu_executor_info info;
    memset(&info, 0, sizeof info);
    info.device = device;
    info.workspace_size = MOE_WORKSPACE_BYTES;
    info.n_inputs = 2;
    info.n_outputs = 1;
    info.input_addr[0] = x->addr;
    info.input_addr[1] = idx->addr;
    info.output_addr[0] = o->addr;
    info.input_tensor[0] = gradExpandedX;
    info.input_tensor[1] = expandedRowIdx;
    info.output_tensor[0] = out;
    info.op_data = op;
    info.op_free = free;
    aclOpExecutor *ex = aclemuExecutorCreate(&info);
    if (!ex) {
        free(op);
        aclemuSetErrMsg(API1, ACLNN_ERR_INNER, "out of host memory");
        return ACLNN_ERR_INNER;
    }
    *workspaceSize = MOE_WORKSPACE_BYTES;
    *executor = ex;
    return ACLNN_SUCCESS;
}

static void kernel_release(void *p) { free(p); }

EMU_API aclnnStatus aclnnMoeInitRoutingV2Grad(void *workspace, uint64_t workspaceSize,
                                              aclOpExecutor *executor, aclrtStream stream) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    /* The vendor's argument checks (nnopbase's NnopbaseRunWithWorkspace) return without
     * touching the executor: null executor, null workspace, workspaceSize below what the first
     * phase asked for. Past them a guard recycles a one-shot executor whatever happens next,
     * so every later failure (device, stream, workspace block) consumes it too. */
    if (!executor) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR, "executor is a null pointer");
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    emu_executor_info info;
    int st = aclemuExecutorAcquire(api, executor, &info, 0);
    if (st) return st;
    const moe_op *op = info.op_data;
    if (op->unchecked) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID,
                        "this executor was built with the first phase's checks skipped by fault "
                        "injection; it is not launched, since its shapes were never validated");
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (workspaceSize < info.workspace_size) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID,
                        "workspaceSize is %llu but the first phase asked for %llu bytes",
                        (unsigned long long)workspaceSize,
                        (unsigned long long)info.workspace_size);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (info.workspace_size && !workspace) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR,
                        "workspace is a null pointer but %llu bytes are needed",
                        (unsigned long long)info.workspace_size);
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    if (!info.repeatable) {
        /* Take it now (another thread may have launched it meanwhile: then it is stale). */
        st = aclemuExecutorAcquire(api, executor, &info, 1);
        if (st) return st;
        op = info.op_data;
    }
    moe_kernel_args *k = malloc(sizeof *k);
    if (!k) {
        aclemuExecutorRelease(&info);
        aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        return ACLNN_ERR_INNER;
    }
    /* A launch captures the addresses bound now; later rebinding affects later launches. */
    *k = op->args;
    k->x.addr = info.input_addr[0];
    k->idx.addr = info.input_addr[1];
    k->out.addr = info.output_addr[0];
    k->workspace = (uintptr_t)workspace;
    k->workspace_size = info.workspace_size;
    aclemuExecutorRelease(&info); /* frees a consumed one-shot executor */
    st = aclemuLaunch(api, info.device, stream, (uintptr_t)workspace, info.workspace_size,
                      &k->mutation, moe_kernel_run, kernel_release, k);
    if (st) return st;
    aclemuCountAdd(EMU_C_KERNELS_LAUNCHED, 1);
    return ACLNN_SUCCESS;
}
