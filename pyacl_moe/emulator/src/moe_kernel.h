/*
 * The emulated MoeInitRoutingV2Grad kernel, shared by the op library's two phases.
 */
#ifndef PYACL_MOE_KERNEL_H
#define PYACL_MOE_KERNEL_H

#include "emu.h"

/* Everything a launch captures: tensor views with the addresses bound at launch time, the
 * attributes and the shape figures the first phase derived from them. */
typedef struct moe_kernel_args {
    emu_tensor_desc x, idx, out;
    int64_t top_k, drop_pad_mode, active_num;
    int64_t n;    /* tokens: rows of out */
    int64_t h;    /* hidden size */
    int64_t rows; /* rows of gradExpandedX as the kernel sees it: numel / H */
    int64_t c;    /* dim 1 of a 3-D input whose last dim is H (drop/pad), else 0 */
    int flat;     /* H is not the view's last dim (3-D input, dropPadMode 0): rows are
                     read as the vendor does, flat runs of H in the view's row-major order */
    int64_t bsk;  /* length of expandedRowIdx */
    uintptr_t workspace;
    uint64_t workspace_size; /* the range pinned whole: the first phase's figure up to 9.0, where
                                nnopbase makes sure the workspace has it; 0 from 9.1 */
    int via_scratch;  /* 9.1, a non-contiguous out: the result goes densely to workspace +
                         scratch, then through out's strides (l0op::ViewCopy) */
    uint64_t scratch;
    int mutation;
    /* The Ascend 950 (arch35): its kernel sums from +0.0 in fours, K in chunks of k_chunk terms
     * (the tiling's kUbFactor; K under its split-H and full-load templates), and from 9.1 reads
     * every index outside the rows as a zero row (zero_invalid). 0: the 910B's kernel. */
    int arch35;
    int64_t k_chunk;
    int zero_invalid;
} moe_kernel_args;

/* The Ascend 950's tiling of the backward (arch35): the K terms a pass sums, for N tokens,
 * K, H, element bytes ts, aiv vector cores and ub bytes of UB (opapi.c). */
EMU_HIDDEN int64_t moe_arch35_k_chunk(int64_t n, int64_t k, int64_t h, int64_t ts, int64_t aiv, int64_t ub);

/* Task entry point: runs the kernel, returns 0 or a device fault status with msg filled. */
EMU_HIDDEN int moe_kernel_run(void *args, char *msg, size_t msg_len);

/* Bytes of an element of the data types the ops take (0 for any other). Inline: every library
 * that needs it has its own copy, and the kernels call it in their loops. */
static inline size_t moe_dtype_size(aclDataType dt) {
    switch (dt) {
    case ACL_FLOAT: case ACL_INT32: return 4;
    case ACL_INT64: return 8;
    case ACL_FLOAT16: case ACL_BF16: return 2;
    default: return 0;
    }
}

/* The element range [*lo, *hi] a view touches; 0 when it has no elements (kernel.c). */
EMU_HIDDEN int view_extent(const emu_tensor_desc *t, int64_t *lo, int64_t *hi);

/* Pin the n device ranges a kernel touches (range i is names[which[i]]); 0 when all are
 * pinned, else ACL_ERROR_RT_AICORE_EXCEPTION with the fault described in msg (kernel.c). */
EMU_HIDDEN int moe_pin_ranges(const uintptr_t *starts, const size_t *lens, const int *which,
                              const char *const *names, int n, emu_pin *pins, char *msg, size_t len);

/* nnopbase rules and emulator guards shared by the ops' first phases (opapi.c). */
EMU_HIDDEN const char *dtype_name(aclDataType dt);
EMU_HIDDEN int format_is_nd_like(aclFormat f);
EMU_HIDDEN int is_empty(const emu_tensor_desc *t);
EMU_HIDDEN int check_extent(const char *api, const emu_tensor_desc *t, const char *name);
/* The data type rules both ops' entries share, each 0 or 161002 naming the tensor: a float type
 * the kernels take (FLOAT16, BF16, FLOAT), INT32, and the data type of `ref`. */
EMU_HIDDEN int want_float(const char *api, const emu_tensor_desc *t, const char *name);
EMU_HIDDEN int want_int32(const char *api, const emu_tensor_desc *t, const char *name);
EMU_HIDDEN int want_same(const char *api, const emu_tensor_desc *t, const char *name,
                         const emu_tensor_desc *ref, const char *ref_name);

/* Where the releases' entries differ. Up to 9.0 each op's aclnn entry is the generated one onto
 * nnopbase (ops-transformer v8.5.0 to v9.0.1, op_api/aclnn_moe_init_routing_v2{,_grad}.cpp
 * forward to aclnnInner*); from 9.1 (v9.1.0.pre) it is written by hand from l0op calls on the
 * composite executor: l0op::Contiguous of the inputs, the op's l0op, l0op::ViewCopy of each
 * output, run by CommonOpExecutorRun. emu_l0op_entry() tells which (aclemuRelease() >= 90100). */
EMU_HIDDEN int emu_l0op_entry(void);
/* A tiling refusal: 561002 from nnopbase's tiling step up to 9.0; from 9.1 the l0op gets no
 * launcher, returns nullptr, and the entry's CHECK_RET answers 561103 (ACLNN_ERR_INNER_NULLPTR). */
EMU_HIDDEN int emu_tiling_status(void);
/* 9.1: an input whose format no kernel binary takes (nnopbase's ND-like formats are ND) makes
 * the binary selection inside the l0op fail: 561103 (inferred: the selection is opbase's
 * SelectBin, whose format matching was not read to the end). 0 otherwise. */
EMU_HIDDEN int kernel_format(const char *api, const emu_tensor_desc *t, const char *name);
/* 9.1: likewise a data type no kernel binary takes, which the entry lets through on an empty
 * tensor while another tensor is not empty (`ok`: whether t's type is the binary's). 561103
 * (inferred, as kernel_format), or 0. */
EMU_HIDDEN int kernel_dtype(const char *api, const emu_tensor_desc *t, const char *name, int ok);

/* The float types the kernels take. */
static inline int emu_is_float(aclDataType dt) {
    return dt == ACL_FLOAT || dt == ACL_FLOAT16 || dt == ACL_BF16;
}
/* 9.1: a non-contiguous output is computed into a dense workspace tensor that l0op::ViewCopy
 * then copies through the output's strides. Places it at *workspace (its offset in *scratch,
 * *via set) and adds its allocator size; a contiguous output needs none (ViewCopy points the
 * result at the output itself). 0, or 161002 when the size does not fit in 64 bits. */
EMU_HIDDEN int view_copy_scratch(const char *api, const emu_tensor_desc *t, const char *name,
                                 uint64_t *workspace, uint64_t *scratch, int *via);

/* The composite executor's size for a workspace tensor of `bytes` (opbase v9.1.0.pre
 * src/nnopbase/composite_op/mem_mgr/memory_allocator.cpp, Align: 32 bytes more, rounded up to
 * 512), added to *total. 0, or -1 when a sum does not fit in 64 bits. */
static inline int emu_workspace_add(uint64_t *total, uint64_t bytes) {
    uint64_t aligned;
    if (__builtin_add_overflow(bytes, (uint64_t)(32 + 511), &aligned)) return -1;
    return __builtin_add_overflow(*total, aligned & ~(uint64_t)511, total) ? -1 : 0;
}

/* ops-math's part (opapi_math.c: libopapi_math.so from 8.5, part of libopapi.so before). */
EMU_API int64_t aclemuViewNumel(const emu_tensor_desc *t);
EMU_API int aclemuIsContiguous(const emu_tensor_desc *t);
EMU_API int aclemuContiguousWorkspace(const char *api, const emu_tensor_desc *t, const char *name,
                                      uint64_t *total);
/* l0op::ViewCopy's copy into a non-contiguous output: element i of the dense `src`, in row-major
 * order, goes to element i of view t, whose storage element `lo` is at `dst`. */
EMU_API void aclemuViewCopy(const unsigned char *src, const emu_tensor_desc *t, unsigned char *dst,
                            int64_t lo);

/* Record the message and return the status: the shape of every refusal of a first phase. */
EMU_HIDDEN int emu_fail(const char *api, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Dimension d of a shape, or INT64_MIN when the rank is too small (as the vendor's shape
 * accessor reports a missing dimension, which then fails every comparison). */
static inline int64_t dim(const emu_tensor_desc *t, int64_t d) {
    return d < t->ndim ? t->shape[d] : INT64_MIN;
}

/* What the shared second phase (opapi.c) needs to know of an op's plan. */
typedef struct emu_op_kind {
    void (*op_free)(void *);  /* the destructor its first phase gives executors: marks them */
    const char *first_phase;  /* that first phase's name, for messages */
    int (*unchecked)(const void *op_data);
    int (*empty)(const void *op_data);
} emu_op_kind;

/* nnopbase's first phase, the parts every op shares. The opening: a fault injected at `api`
 * (ACLEMU_SKIP_CHECKS weakens the op's checks instead: *unchecked), then the n required
 * pointers in order, the first NULL one 161001 naming it; the last two are workspaceSize and
 * executor, which 9.1 tests first. */
EMU_HIDDEN int emu_first_phase_open(const char *api, int n, const void *const *required,
                                    const char *const *names, int *unchecked);
/* After the support list: the thread's device (361001 without a context). */
EMU_HIDDEN int emu_first_phase_device(const char *api, int32_t *device);
/* The closing: an executor over `info` (its op_data freed on failure), and the workspace. */
EMU_HIDDEN int emu_first_phase_finish(const char *api, const emu_executor_info *info,
                                      uint64_t *workspaceSize, aclOpExecutor **executor);

/* nnopbase's second phase up to the kernel: argument checks in its order, the executor taken
 * (a one-shot one is consumed whatever follows). 0 with *nothing set when every output is empty
 * (no launch; the executor released), or a status. From 9.1 no size check, and
 * info->workspace_size is then the caller's workspaceSize. */
EMU_HIDDEN int emu_second_phase_take(const char *api, const emu_op_kind *kind, void *workspace,
                                     uint64_t workspaceSize, aclOpExecutor *executor,
                                     emu_executor_info *info, int *nothing);
/* An op's plan (what its first phase validated) is shared by its executor and by every launch
 * still queued: one reference each. A launch takes its reference before the executor may go (a
 * one-shot one is released by the launch itself); the last one frees the plan. */
static inline void emu_plan_hold(int *refs) { __atomic_add_fetch(refs, 1, __ATOMIC_RELAXED); }
static inline int emu_plan_drop(int *refs) { return __atomic_sub_fetch(refs, 1, __ATOMIC_ACQ_REL) == 0; }

/* The range of the workspace a kernel pins whole: the first phase's figure up to 9.0, which
 * nnopbase made sure the caller's workspace holds; 0 from 9.1, where nothing checks the
 * caller's size and the kernel pins only the parts it uses (its dense results). */
EMU_HIDDEN uint64_t emu_kernel_workspace(const emu_executor_info *info);

/* Then: release the executor and queue ``run(args)`` (args NULL: out of host memory). */
EMU_HIDDEN int emu_second_phase_launch(const char *api, emu_executor_info *info, aclrtStream stream,
                                       void *workspace, int *mutation, emu_task_run run,
                                       emu_task_release release, void *args);

/* The emulated MoeInitRoutingV2 kernel (kernel_fwd.c): what a launch captures. */
typedef struct moe_fwd_args {
    emu_tensor_desc x, idx;   /* inputs, any strides */
    /* Outputs, written densely from these addresses (the view's address plus its offset). The
     * optional ones are written when the scenario switches them on (write_cnt, write_bc),
     * whatever address they were given: a null one faults, as on a device. */
    uintptr_t ex_addr, ri_addr, cnt_addr, bc_addr;
    int write_cnt, write_bc;
    /* 9.1, a non-contiguous output (expandedXOut, expandedRowIdxOut, then the two optional
     * ones): its view, whose address is then the one above (the view's offset not added), and
     * the offset in the workspace of the dense result l0op::ViewCopy copies through it. NULL:
     * written densely at its address. The views belong to the plan, which outlives the run. */
    const emu_tensor_desc *view[4];
    uint64_t scratch[4];
    int64_t n, k, h;          /* tokens, experts per token, hidden size */
    int64_t ex_rows;          /* rows of expandedXOut: expertNum * C in drop/pad mode, else N*k
                                 or min(activeNum, N*k); the first phase made sure it and
                                 ex_rows * h * element size fit in int64 */
    int64_t capacity, expert_num, drop_pad_mode, count_flag;
    int before_capacity;
    uintptr_t workspace;
    uint64_t workspace_size; /* pinned whole, as the backward's */
    int mutation;
} moe_fwd_args;

EMU_HIDDEN int moe_fwd_kernel_run(void *args, char *msg, size_t msg_len);

#endif
