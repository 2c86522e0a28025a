/*
 * Emulated ops-math part of the aclnn layer: what CANN's ops-math package provides to the
 * other op repositories (l0op::Contiguous and the aclnnContiguous copy, l0op::ViewCopy). From
 * 8.5 it is libopapi_math.so, which ops-transformer's libopapi_transformer.so needs (DT_NEEDED,
 * and no RUNPATH: the binding loads it from the home first); up to 8.3 the same code is part of
 * the all-in-one libopapi.so. Its functions are cross-library internals (prefix aclemu).
 */
#define _GNU_SOURCE
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_kernel.h"

/* Elements of a view: 0 when a dimension is 0 (whatever the others), -1 when a dimension is
 * negative or the count does not fit in int64. */
EMU_API int64_t aclemuViewNumel(const emu_tensor_desc *t) {
    int64_t n = 1;
    int overflow = 0;
    for (int64_t d = 0; d < t->ndim; d++) {
        if (t->shape[d] == 0) return 0;
        if (t->shape[d] < 0) return -1;
        overflow |= __builtin_mul_overflow(n, t->shape[d], &n);
    }
    return overflow ? -1 : n;
}

/* nnopbase's contiguity test (IsContiguousShape, individual_op/executor/indv_executor_utils.h):
 * a view of 0 or 1 element is contiguous; otherwise every dimension but those of size 1 must
 * have the row-major stride. The view offset plays no part. Only called on views without
 * negative dimensions whose element count fits in int64, so the running product cannot
 * overflow. */
EMU_API int aclemuIsContiguous(const emu_tensor_desc *t) {
    int64_t n = aclemuViewNumel(t);
    if (n == 0 || n == 1) return 1;
    int64_t expect = 1;
    for (int64_t d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] == 1) continue;
        if (t->strides[d] != expect) return 0;
        expect *= t->shape[d];
    }
    return 1;
}

/* Workspace for the dense copy nnopbase makes of a non-contiguous input before the kernel
 * runs: the op's aclnn entry asks the contiguous-copy executor for its workspace and adds it
 * to the op's own. That executor places each copy as an intermediate tensor, sized like the
 * composite-op allocator does (composite_op/mem_mgr/memory_allocator.cpp): the bytes plus 32,
 * rounded up to 512. Both copies are alive when the kernel runs, so they do not share space.
 * Returns 0 and adds to *total, or 161002 when a size does not fit in 64 bits (an uncountable
 * view included). */
EMU_API int aclemuContiguousWorkspace(const char *api, const emu_tensor_desc *t, const char *name,
                                uint64_t *total) {
    int64_t n = aclemuViewNumel(t);
    if (n >= 0 && aclemuIsContiguous(t)) return 0;
    uint64_t bytes = 0;
    int bad = n < 0 || __builtin_mul_overflow((uint64_t)n, (uint64_t)moe_dtype_size(t->dtype), &bytes);
    if (!bad) bad = emu_workspace_add(total, bytes);
    if (!bad) return 0;
    aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID,
                    "%s: its element count or the workspace of its dense copy does not fit in 64 "
                    "bits",
                    name);
    return ACLNN_ERR_PARAM_INVALID;
}


/* One element of 2 or 4 bytes (the ops' data types): a copy of a known size, which the compiler
 * inlines. memmove: a caller's workspace may overlap its output, and then the bytes are as
 * undefined as on a device while the host's behaviour stays defined. */
static inline void move_element(unsigned char *dst, const unsigned char *src, int64_t es) {
    if (es == 4) memmove(dst, src, 4);
    else memmove(dst, src, 2);
}

/* l0op::ViewCopy into a non-contiguous output (ops-math v9.1.0.pre
 * conversion/contiguous/op_host/op_api/contiguous.cpp, ViewCopy: a Transpose kernel when the
 * strides permute a contiguous layout, else the ViewCopy kernel; both put element i of the
 * dense source at element i of the view, so one loop stands for both). Elements go in row-major
 * order: where a view meets itself (a stride of 0) the last one stays. The caller's extent
 * guard bounded every offset the view reaches, and the steps below never leave that range:
 * a dimension's offset goes back by (size - 1) * stride, never past it. */
EMU_API void aclemuViewCopy(const unsigned char *src, const emu_tensor_desc *t, unsigned char *dst,
                            int64_t lo) {
    const int64_t es = (int64_t)moe_dtype_size(t->dtype), nd = t->ndim;
    if (aclemuViewNumel(t) <= 0 || (es != 2 && es != 4)) return;
    if (nd == 0) {
        move_element(dst + (t->offset - lo) * es, src, es);
        return;
    }
    int64_t pos[EMU_OP_MAX_DIMS] = {0};
    const int64_t inner = t->shape[nd - 1], step = t->strides[nd - 1];
    int64_t row = t->offset - lo; /* element offset, from dst, of the current row's first element */
    for (;;) {
        if (step == 1) { /* a dense row (a column slice, say): one move */
            memmove(dst + row * es, src, (size_t)(inner * es));
            src += inner * es;
        } else {
            for (int64_t j = 0; j < inner; j++, src += es)
                move_element(dst + (row + j * step) * es, src, es);
        }
        int64_t d = nd - 2;
        for (; d >= 0; d--) {
            if (pos[d] + 1 < t->shape[d]) {
                pos[d]++;
                row += t->strides[d];
                break;
            }
            row -= pos[d] * t->strides[d];
            pos[d] = 0;
        }
        if (d < 0) return;
    }
}
