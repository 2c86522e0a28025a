/*
 * Emulator-only extras, exported by the emulated libascendcl.so under the
 * aclemu prefix (never a CANN name). Plain C for cffi's cdef and for the
 * emulator itself: no includes, no conditionals.
 */

/* Live-object counters and cumulative figures, all int64 so Python reads them uniformly. */
typedef struct aclemuStats {
    int64_t initialized;        /* 1 between aclInit and aclFinalize */
    int64_t devices_set;        /* sum over devices of the aclrtSetDevice reference count */
    int64_t device_allocations; /* live aclrtMalloc blocks */
    int64_t device_bytes;       /* bytes requested by the live blocks */
    int64_t host_allocations;   /* live aclrtMallocHost blocks */
    int64_t host_bytes;
    int64_t streams;            /* live streams created by aclrtCreateStream */
    int64_t events;
    int64_t tensors;
    int64_t scalars;
    int64_t int_arrays;
    int64_t executors;          /* executors neither run (one-shot) nor destroyed */
    int64_t pending_tasks;      /* tasks queued on streams and not yet run */
    int64_t mallocs_total;      /* cumulative successful aclrtMalloc calls */
    int64_t kernels_launched;   /* cumulative kernel launches (second phase) */
    int64_t kernels_run;        /* cumulative kernels executed by a stream */
    int64_t device_faults;      /* cumulative device faults raised by kernels or copies */
    int64_t guard_corruptions;  /* cumulative guard corruptions detected */
    int64_t faults_hit;         /* cumulative injected faults that fired */
    int64_t tensor_lists;       /* live aclTensorLists (last: the fields above keep their offsets) */
} aclemuStats;

int aclemuGetStats(aclemuStats *stats);

/* Make the nth call (counted from now) of `api` return `status`; nth 0 means every call until
 * aclemuClearFaults. api "*" counts every call except releases and queries (see
 * docs/emulator.md). status 0 picks the API's default failure. status ACLEMU_SKIP_CHECKS on
 * aclnnMoeInitRoutingV2GradGetWorkspaceSize weakens it instead: that call skips the vendor's
 * data type, format and tiling checks (its executor cannot be launched). Returns 0, or -1
 * when the table is full or an argument is invalid. */
#define ACLEMU_SKIP_CHECKS -1
int aclemuInjectFault(const char *api, int64_t nth, int32_t status);
void aclemuClearFaults(void);

/* Deliberately wrong kernels: "" (none), "skip-last-k", "fp16-accumulate", "off-by-one-row"
 * (the backward), "fwd-unstable-sort" (the forward). Returns 0, or -1 for an unknown name. */
int aclemuSetMutation(const char *name);
const char *aclemuGetMutation(void);

/* How streams execute. "async" (the default, or PYACL_MOE_EMU_STREAMS=async): a device engine
 * thread runs queued work in the background, as hardware does, and a thread that synchronizes
 * helps it. "lazy" (PYACL_MOE_EMU_STREAMS=lazy): queued work runs only when something waits for
 * it (a synchronize, an event wait, destroying the stream, resetting the device), so a test can
 * see work that is queued and not yet run. Returns 0, or -1 for an unknown name. */
int aclemuSetStreamMode(const char *mode);
const char *aclemuGetStreamMode(void);

/* Checks the guard bytes of every live device allocation; returns how many are corrupt. */
int64_t aclemuCheckGuards(void);
/* Test hook: overwrite one guard byte of the allocation holding devPtr, as a stray device
 * write past its end would. Returns 0, or -1 if devPtr is not in a live allocation. */
int aclemuCorruptGuard(void *devPtr);

const char *aclemuVersion(void);

/* The CANN release this build stands for (PYACL_MOE_EMU_RELEASE when it was built): its code,
 * major * 10000 + minor * 100 + patch (80100 for 8.1.RC1, 90100 for 9.1.0), and its name. */
int aclemuRelease(void);
const char *aclemuReleaseName(void);

/* The host's id of visible device `deviceId` (what ASCEND_RT_VISIBLE_DEVICES names it; the
 * same id when the variable is unset), or -1 when no visible device has that id. */
int32_t aclemuVisibleDevice(int32_t deviceId);
