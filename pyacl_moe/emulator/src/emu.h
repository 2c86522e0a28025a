/*
 * Internal header of the host emulator. The public declarations come from the
 * project's headers/ (the same files cffi reads), so the emulator and the
 * binding can never disagree about a prototype or a constant.
 */
#ifndef PYACL_MOE_EMU_H
#define PYACL_MOE_EMU_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "acl_base.h"
#include "acl_rt.h"
#include "acl.h"
#include "acl_meta.h"
#include "aclnn_moe_init_routing_v2_grad.h"
#include "aclnn_moe_init_routing_v2.h"
#include "aclemu.h"

#define EMU_API __attribute__((visibility("default")))
#define EMU_HIDDEN __attribute__((visibility("hidden")))

/* aclnn status codes: CANN defines them in an op-development header that is not part of the
 * public API, so they live here and in the Python status table, not in headers/. */
#define ACLNN_SUCCESS 0
#define ACLNN_ERR_PARAM_NULLPTR 161001
#define ACLNN_ERR_PARAM_INVALID 161002
#define ACLNN_ERR_RUNTIME_ERROR 361001
#define ACLNN_ERR_INNER 561000
#define ACLNN_ERR_INNER_TILING_ERROR 561002
#define ACLNN_ERR_INNER_NULLPTR 561103

/* Runtime codes headers/acl_base.h does not declare (the binding has no use for their names);
 * the values are CANN's (include/external/acl/error_codes/rt_error_codes.h). */
#define ACL_ERROR_RT_INVALID_MEMORY_TYPE 107016
#define ACL_ERROR_RT_CONTEXT_RELEASE_ERROR 507007

#define EMU_MAX_DIMS 64    /* what aclCreateTensor accepts */
/* nnopbase puts no rank limit of its own on an operator's tensors: the op's tiling judges the
 * ranks it cares about, so a descriptor holds every dimension aclCreateTensor accepts. */
#define EMU_OP_MAX_DIMS EMU_MAX_DIMS
#define EMU_MSG_LEN 1024

/* Counter slots, in the order of the fields of aclemuStats. */
enum {
    EMU_C_INITIALIZED,
    EMU_C_DEVICES_SET,
    EMU_C_DEVICE_ALLOCATIONS,
    EMU_C_DEVICE_BYTES,
    EMU_C_HOST_ALLOCATIONS,
    EMU_C_HOST_BYTES,
    EMU_C_STREAMS,
    EMU_C_EVENTS,
    EMU_C_TENSORS,
    EMU_C_SCALARS,
    EMU_C_INT_ARRAYS,
    EMU_C_EXECUTORS,
    EMU_C_PENDING_TASKS,
    EMU_C_MALLOCS_TOTAL,
    EMU_C_KERNELS_LAUNCHED,
    EMU_C_KERNELS_RUN,
    EMU_C_DEVICE_FAULTS,
    EMU_C_GUARD_CORRUPTIONS,
    EMU_C_FAULTS_HIT,
    EMU_C_TENSOR_LISTS,
    EMU_C_COUNT
};

/* A task queued on a stream. `run` executes it on whichever host thread drains the stream;
 * a non-zero return is a device-side failure reported by the stream's next synchronize. */
typedef struct emu_task emu_task;
typedef int (*emu_task_run)(void *payload, char *msg, size_t msg_len);
typedef void (*emu_task_release)(void *payload);

/* A device range translated to host memory and pinned so that a concurrent aclrtFree cannot
 * release the backing store while a task is still using it. */
typedef struct emu_pin {
    void *host;
    void *block; /* opaque allocation record */
} emu_pin;

/* ---- cross-library internals exported by libascendcl (prefix aclemu, never a CANN name) ---- */

/* Record the calling thread's error message (what aclGetRecentErrMsg returns next). */
EMU_API void aclemuSetErrMsg(const char *api, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Fault injection check: the injected status for this call, or 0. */
EMU_API int aclemuFaultPoint(const char *api, int default_status);

/* The first statement of every CANN entry point: names the function `api` (for messages and
 * fault matching; __func__ is the CANN name) and returns an injected fault at once. The _NULL
 * form is for functions that return a pointer. */
#define EMU_ENTRY(default_status)                                 \
    const char *const api = __func__;                             \
    do {                                                          \
        int emu_fault_ = aclemuFaultPoint(api, (default_status)); \
        if (emu_fault_) return emu_fault_;                        \
    } while (0)
#define EMU_ENTRY_NULL(default_status)                   \
    const char *const api = __func__;                    \
    do {                                                 \
        if (aclemuFaultPoint(api, (default_status))) return NULL; \
    } while (0)
/* 0 when the calling thread has a current device (stored in *device); otherwise the CANN status
 * and a message. aclInit is not required (CANN's runtime checks it nowhere). */
EMU_API int aclemuRequireDevice(const char *api, int32_t *device);
EMU_API void aclemuCountAdd(int slot, int64_t delta);
/* The second phase's runtime part, under one lock: the calling thread must have `device`
 * current, `stream` (NULL: default) must be a live stream of it, [workspace, +size) must lie in
 * one live allocation of it; then the active mutation is written to *mutation_slot and the
 * task is queued. With run == NULL only the checks are made. Returns an aclnn status (0,
 * 361001 for device or stream, 161002 for the workspace) with the message set; on failure
 * `payload` is released. */
EMU_API int aclemuLaunch(const char *api, int32_t device, aclrtStream stream, uintptr_t workspace,
                         uint64_t workspace_size, int *mutation_slot, emu_task_run run,
                         emu_task_release release, void *payload);
/* Translate and pin [addr, addr + len); 0 on success, -1 if not inside a live allocation. */
EMU_API int aclemuPin(uintptr_t addr, size_t len, emu_pin *pin);
EMU_API void aclemuUnpin(emu_pin *pin);
/* Pin n ranges under one lock (zero-length ranges are not allowed). Returns -1 when all are
 * pinned, else the index of the first range that is not inside a live allocation of the
 * device whose stream runs the calling task (then nothing stays pinned, and *owner is the
 * device the range belongs to, or -1 when it is inside no live allocation). */
EMU_API int aclemuPinMany(const uintptr_t *addr, const size_t *len, emu_pin *pins, int n, int32_t *owner);
EMU_API void aclemuUnpinMany(emu_pin *pins, int n);
/* Active mutation id (0 none, 1 skip-last-k, 2 fp16-accumulate, 3 off-by-one-row; 4
 * fwd-unstable-sort and 5 fwd-wrong-row, which only the forward kernel reads; 6 skip-last-row
 * and 7 overrun, memory faults of the backward kernel). */
EMU_API int aclemuMutationId(void);

enum { EMU_MUT_NONE = 0, EMU_MUT_SKIP_LAST_K = 1, EMU_MUT_FP16_ACC = 2, EMU_MUT_OFF_BY_ONE = 3,
       EMU_MUT_FWD_UNSTABLE_SORT = 4, EMU_MUT_FWD_WRONG_ROW = 5, EMU_MUT_SKIP_LAST_ROW = 6,
       EMU_MUT_OVERRUN = 7 };

/* ---- chips (docs/emulator.md, "Chips"; pyacl_moe/_contract.py holds the same table) ---- */

/* The families the ops are built for (ops-transformer moe_init_routing_v2_grad_def.cpp:42-54):
 * Atlas A2 (Ascend910B*) and A3 (Ascend910_93*) run the same kernels; the Ascend 950 (arch35)
 * its own. 0: no family. */
enum { EMU_CHIP_NONE = 0, EMU_CHIP_910B = 1, EMU_CHIP_910_93 = 2, EMU_CHIP_950 = 3 };

/* The SoCs the emulator can be, with their vector (AIV) cores, as CANN's platform files give
 * them (github:hicann/runtime 681ef7610 src/platform/platform_config/cann/Ascend910*.ini and
 * cann-dev/Ascend950*.ini: vector_core_cnt). Returns the family, 0 for a name not listed. */
static inline int emu_soc_lookup(const char *soc, int64_t *cores) {
    static const struct { const char *name; int family; int cores; } socs[] = {
        {"Ascend910B1", EMU_CHIP_910B, 48}, {"Ascend910B2", EMU_CHIP_910B, 48},
        {"Ascend910B2C", EMU_CHIP_910B, 48}, {"Ascend910B3", EMU_CHIP_910B, 40},
        {"Ascend910B4", EMU_CHIP_910B, 40}, {"Ascend910B4-1", EMU_CHIP_910B, 40},
        {"Ascend910_9362", EMU_CHIP_910_93, 40}, {"Ascend910_9363", EMU_CHIP_910_93, 40},
        {"Ascend910_9372", EMU_CHIP_910_93, 40}, {"Ascend910_9381", EMU_CHIP_910_93, 48},
        {"Ascend910_9382", EMU_CHIP_910_93, 48}, {"Ascend910_9391", EMU_CHIP_910_93, 48},
        {"Ascend910_9392", EMU_CHIP_910_93, 48},
        {"Ascend950PR_950z", EMU_CHIP_950, 8}, {"Ascend950PR_9579", EMU_CHIP_950, 56},
        {"Ascend950PR_957b", EMU_CHIP_950, 56}, {"Ascend950PR_957bx", EMU_CHIP_950, 56},
        {"Ascend950PR_957c", EMU_CHIP_950, 56}, {"Ascend950PR_957d", EMU_CHIP_950, 56},
        {"Ascend950PR_9589", EMU_CHIP_950, 64}, {"Ascend950PR_958b", EMU_CHIP_950, 64},
        {"Ascend950PR_9599", EMU_CHIP_950, 72},
        {"Ascend950DT_950x", EMU_CHIP_950, 16}, {"Ascend950DT_950y", EMU_CHIP_950, 16},
        {"Ascend950DT_9571", EMU_CHIP_950, 56}, {"Ascend950DT_9572", EMU_CHIP_950, 56},
        {"Ascend950DT_9573", EMU_CHIP_950, 56}, {"Ascend950DT_9574", EMU_CHIP_950, 56},
        {"Ascend950DT_9575", EMU_CHIP_950, 56}, {"Ascend950DT_9576", EMU_CHIP_950, 56},
        {"Ascend950DT_9577", EMU_CHIP_950, 56}, {"Ascend950DT_9578", EMU_CHIP_950, 56},
        {"Ascend950DT_9581", EMU_CHIP_950, 64}, {"Ascend950DT_9581x", EMU_CHIP_950, 64},
        {"Ascend950DT_9582", EMU_CHIP_950, 64}, {"Ascend950DT_9582x", EMU_CHIP_950, 64},
        {"Ascend950DT_9583", EMU_CHIP_950, 64}, {"Ascend950DT_9584", EMU_CHIP_950, 64},
        {"Ascend950DT_9585", EMU_CHIP_950, 64}, {"Ascend950DT_9586", EMU_CHIP_950, 64},
        {"Ascend950DT_9587", EMU_CHIP_950, 64}, {"Ascend950DT_9588", EMU_CHIP_950, 64},
        {"Ascend950DT_9591", EMU_CHIP_950, 72}, {"Ascend950DT_9592", EMU_CHIP_950, 72},
        {"Ascend950DT_9595", EMU_CHIP_950, 72}, {"Ascend950DT_9596", EMU_CHIP_950, 72},
        {"Ascend950DT_95A1", EMU_CHIP_950, 72}, {"Ascend950DT_95A2", EMU_CHIP_950, 72},
    };
    for (size_t i = 0; soc && i < sizeof socs / sizeof socs[0]; i++) {
        if (strcmp(soc, socs[i].name) == 0) {
            if (cores) *cores = socs[i].cores;
            return socs[i].family;
        }
    }
    return EMU_CHIP_NONE;
}

static inline int emu_soc_family(const char *soc) { return emu_soc_lookup(soc, NULL); }

static inline int64_t emu_soc_vector_cores(const char *soc) {
    int64_t cores = 40; /* the default SoC's (Ascend910B3) */
    emu_soc_lookup(soc, &cores);
    return cores;
}

/* UB bytes a core (GetCoreMemSize(UB); the same files' ub_size): 192 KiB on A2/A3, 248 KiB on
 * the 950. */
static inline int64_t emu_soc_ub_bytes(const char *soc) {
    return emu_soc_family(soc) == EMU_CHIP_950 ? 253952 : 196608;
}

/* ---- internals exported by libnnopbase ---- */

typedef struct emu_tensor_desc {
    aclDataType dtype;
    aclFormat format;
    int64_t ndim;
    int64_t shape[EMU_OP_MAX_DIMS];
    int64_t strides[EMU_OP_MAX_DIMS];
    int64_t offset;
    uintptr_t addr;
} emu_tensor_desc;

/* Snapshot of a live aclTensor; 0 on success, -1 if `t` is not a live tensor. */
EMU_API int aclemuTensorDesc(const aclTensor *t, emu_tensor_desc *out);

/* Executors: the op library registers its payload; nnopbase owns lifetime and rebinding. */
#define EMU_EXEC_MAX_IO 4
typedef struct emu_executor_info {
    int32_t device;
    uint64_t workspace_size;
    int repeatable;
    int n_inputs;
    int n_outputs;
    uintptr_t input_addr[EMU_EXEC_MAX_IO];
    uintptr_t output_addr[EMU_EXEC_MAX_IO];
    const aclTensor *input_tensor[EMU_EXEC_MAX_IO];
    const aclTensor *output_tensor[EMU_EXEC_MAX_IO];
    void *op_data; /* owned, freed with op_free */
    void (*op_free)(void *);
    void *consumed; /* set by a consuming aclemuExecutorAcquire: pass to aclemuExecutorRelease */
} emu_executor_info;

EMU_API aclOpExecutor *aclemuExecutorCreate(const emu_executor_info *info);
/* Copy a live executor's state into *info (op_data is borrowed). With `consume`, a one-shot
 * executor is taken for a launch: its handle is stale at once, and info->consumed keeps the
 * object (and op_data) alive until aclemuExecutorRelease. Returns 0, or a status with the
 * message. */
EMU_API int aclemuExecutorAcquire(const char *api, aclOpExecutor *ex, emu_executor_info *info,
                                  int consume);
/* Finish a launch started with aclemuExecutorAcquire: frees a consumed one-shot executor. */
EMU_API void aclemuExecutorRelease(emu_executor_info *info);

/* ---- small helpers shared by the three libraries (static, one copy each) ---- */

static inline int64_t emu_min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t emu_max64(int64_t a, int64_t b) { return a > b ? a : b; }

#endif
