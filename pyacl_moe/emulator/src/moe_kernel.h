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
    uint64_t workspace_size;
    int mutation;
} moe_kernel_args;

/* Task entry point: runs the kernel, returns 0 or a device fault status with msg filled. */
EMU_HIDDEN int moe_kernel_run(void *args, char *msg, size_t msg_len);

/* Rounding helpers, exposed for the first phase's dtype checks and for tests of the kernel. */
EMU_HIDDEN size_t moe_dtype_size(aclDataType dt);

/* The element range [*lo, *hi] a view touches; 0 when it has no elements (kernel.c). */
EMU_HIDDEN int view_extent(const emu_tensor_desc *t, int64_t *lo, int64_t *hi);

/* Pin the n device ranges a kernel touches (range i is names[which[i]]); 0 when all are
 * pinned, else ACL_ERROR_RT_AICORE_EXCEPTION with the fault described in msg (kernel.c). */
EMU_HIDDEN int moe_pin_ranges(const uintptr_t *starts, const size_t *lens, const int *which,
                              const char *const *names, int n, emu_pin *pins, char *msg, size_t len);

/* nnopbase rules and emulator guards shared by the ops' first phases (opapi.c). */
EMU_HIDDEN const char *dtype_name(aclDataType dt);
EMU_HIDDEN int format_is_nd_like(aclFormat f);
EMU_HIDDEN int64_t view_numel(const emu_tensor_desc *t);
EMU_HIDDEN int is_contiguous(const emu_tensor_desc *t);
EMU_HIDDEN int is_empty(const emu_tensor_desc *t);
EMU_HIDDEN int check_extent(const char *api, const emu_tensor_desc *t, const char *name);
EMU_HIDDEN int add_copy_scratch(const char *api, const emu_tensor_desc *t, const char *name,
                                uint64_t *total);

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
 * pointers in order, the first NULL one 161001 naming it. */
EMU_HIDDEN int emu_first_phase_open(const char *api, int n, const void *const *required,
                                    const char *const *names, int *unchecked);
/* After the support list: the thread's device (361001 without a context). */
EMU_HIDDEN int emu_first_phase_device(const char *api, int32_t *device);
/* The closing: an executor over `info` (its op_data freed on failure), and the workspace. */
EMU_HIDDEN int emu_first_phase_finish(const char *api, const emu_executor_info *info,
                                      uint64_t *workspaceSize, aclOpExecutor **executor);

/* nnopbase's second phase up to the kernel: argument checks in its order, the executor taken
 * (a one-shot one is consumed whatever follows). 0 with *nothing set when every output is empty
 * (no launch; the executor released), or a status. */
EMU_HIDDEN int emu_second_phase_take(const char *api, const emu_op_kind *kind, void *workspace,
                                     uint64_t workspaceSize, aclOpExecutor *executor,
                                     emu_executor_info *info, int *nothing);
/* An op's plan (what its first phase validated) is shared by its executor and by every launch
 * still queued: one reference each. A launch takes its reference before the executor may go (a
 * one-shot one is released by the launch itself); the last one frees the plan. */
static inline void emu_plan_hold(int *refs) { __atomic_add_fetch(refs, 1, __ATOMIC_RELAXED); }
static inline int emu_plan_drop(int *refs) { return __atomic_sub_fetch(refs, 1, __ATOMIC_ACQ_REL) == 0; }

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
    int64_t n, k, h;          /* tokens, experts per token, hidden size */
    int64_t ex_rows;          /* rows of expandedXOut: expertNum * C in drop/pad mode, else N*k
                                 or min(activeNum, N*k); the first phase made sure it and
                                 ex_rows * h * element size fit in int64 */
    int64_t capacity, expert_num, drop_pad_mode, count_flag;
    int before_capacity;
    uintptr_t workspace;
    uint64_t workspace_size;
    int mutation;
} moe_fwd_args;

EMU_HIDDEN int moe_fwd_kernel_run(void *args, char *msg, size_t msg_len);

#endif
