/*
 * Internal header of the emulated libascendcl.so, shared by its sources:
 *   rt_state.c   process state, configuration, messages, counters, fault injection, fork
 *   rt_device.c  devices and contexts
 *   rt_stream.c  streams, events and the device engine that runs their tasks
 *   rt_memory.c  device and host memory, copies, the second phase's runtime checks
 *
 * Everything declared here is hidden: the library exports only CANN's names and aclemu*.
 *
 * Locking: one process-wide mutex, g_lock, guards all of this state. Tasks run with it
 * released, holding pins on the memory they touch. g_cond is broadcast whenever a task
 * finishes and someone waits (g_waiters); the engine sleeps on g_engine_cond.
 */
#ifndef PYACL_MOE_RT_INTERNAL_H
#define PYACL_MOE_RT_INTERNAL_H

#include <pthread.h>

#include "emu.h"
#include "emu_handles.h"

#pragma GCC visibility push(hidden)

#define EMU_VERSION "pyacl-moe emulator 2 (CANN 8.x ABI)"
#define EMU_MAX_DEVICES 64
#define EMU_GUARD 64
#define EMU_GUARD_BYTE 0xFD
#define EMU_DEV_ALIGN 512
#define EMU_VA_GAP 4096
#define EMU_MAX_FAULTS 64
#define EMU_DEFAULT_QUEUE_DEPTH 1024

/* ------------------------------------------------------------------ objects */

typedef struct emu_task {
    struct emu_task *next;
    uint64_t seq;
    emu_task_run run;
    emu_task_release release;
    void *payload;
} emu_task;

typedef struct emu_stream {
    uintptr_t handle; /* 0 for a device's default stream (its handle is NULL) */
    int32_t device;
    int is_default;
    int dead;
    int refs;
    emu_task *head, *tail;
    uint64_t next_seq; /* seq of the latest task queued */
    uint64_t done_seq; /* seq of the latest task finished; tasks finish in order */
    int running;       /* a thread (the engine or a helper) is running the head task */
    int in_ready;      /* on the engine's ready list */
    struct emu_stream *ready_next;
    uint64_t created;  /* creation order: aclrtSynchronizeDevice reports in stream-list order */
    /* The device fault latched since a synchronize of the stream last reported one. As CANN's
     * Stream::SetErrCode, a later fault overwrites an earlier one: the latest task's status and
     * message are kept, and how many faulted since the last report. */
    int pending_status;
    int64_t pending_faults;
    char pending_msg[EMU_MSG_LEN];
} emu_stream;

typedef struct emu_event {
    uintptr_t handle;
    int32_t device;
    int dead;
    int refs;
    uint64_t records;   /* id of the latest record */
    uint64_t completed; /* id of the latest record that ran */
    emu_stream *stream; /* stream of the latest record (a reference is held) */
    uint64_t seq;       /* its position in that stream */
    double ts_ms;       /* host clock when the latest record ran */
} emu_event;

typedef struct emu_context {
    uintptr_t handle;
    int32_t device;
} emu_context;

typedef struct emu_block {
    uintptr_t addr;
    size_t size;
    size_t padded;
    int32_t device;
    unsigned char *base; /* guard | padded bytes | guard */
    int pins;
    int freed;
} emu_block;

typedef struct emu_device {
    int refcount;
    int closing; /* its last reset is releasing it (the lock is dropped while work drains) */
    emu_stream *default_stream;
    emu_context *context; /* the default context, while refcount > 0 */
    unsigned char *va_base;
    size_t va_size;
    size_t va_bump;
    size_t used;
} emu_device;

typedef struct emu_host_block {
    void *ptr;
    size_t size;
} emu_host_block;

/* ------------------------------------------------------------------ state (rt_state.c) */

extern pthread_mutex_t g_lock;
extern pthread_cond_t g_cond;        /* a task finished (broadcast only when g_waiters > 0) */
extern pthread_cond_t g_engine_cond; /* the engine has something to do */
extern int g_waiters;                /* threads waiting on g_cond */
extern int64_t g_counters[EMU_C_COUNT];
extern int g_initialized; /* aclInit's reference count is above 0 (nothing else checks it) */
extern int g_device_count;
extern size_t g_capacity;
extern char g_soc[64];
extern int g_mutation;
extern __thread int32_t g_task_device; /* device of the stream whose task this thread runs, or -1 */
extern int g_async;       /* stream mode: 1 async (engine), 0 lazy */
extern int g_queue_depth; /* bound of a stream's queue in async mode */
extern emu_device g_devices[EMU_MAX_DEVICES];

extern emu_htab g_streams, g_events, g_contexts;
extern emu_block **g_blocks; /* sorted by address */
extern size_t g_nblocks, g_cap_blocks;
extern emu_host_block *g_host;
extern size_t g_nhost, g_cap_host;

/* The calling thread's current context (a handle of g_contexts; 0: none). */
extern __thread uintptr_t tls_ctx;

/* Counters are read without the lock (aclemuGetStats) and bumped from other libraries: every
 * update is atomic. */
static inline void count_add(int slot, int64_t delta) {
    __atomic_add_fetch(&g_counters[slot], delta, __ATOMIC_RELAXED);
}
static inline void count_set(int slot, int64_t value) {
    __atomic_store_n(&g_counters[slot], value, __ATOMIC_RELAXED);
}

double now_ms(void);
int grow(void **arr, size_t *cap, size_t need, size_t elem);
/* Read the environment once (device count, capacity, SoC name, mutation, stream mode, queue
 * depth, and the kernel thread count's form). 0, or ACL_ERROR_INVALID_PARAM while a variable is
 * malformed; config_error_locked also sets the calling thread's message saying which. No call
 * checks aclInit (CANN's runtime does not): the environment is read at the first call that
 * needs it, whichever that is. */
int config_locked(void);
int config_error_locked(const char *api);

/* ------------------------------------------------------------------ devices (rt_device.c) */

/* The calling thread's current device, or -1 (no context, or its device was reset). */
/* ASCEND_RT_VISIBLE_DEVICES read against the host's `host_devices`: how many the process sees
 * (0 when the list makes none visible; aclrtGetDeviceCount then says why). */
int visible_devices_locked(int host_devices);
int32_t current_device_locked(void);
int device_active_locked(int32_t d);
/* 0 with the current device in *device; else the configuration's status, or 107002 (no current
 * context) with a message. */
int require_device_locked(const char *api, int32_t *device);
/* Release everything device d holds (after running its queued work). */
void device_teardown_locked(int32_t d);

/* ------------------------------------------------------------------ streams (rt_stream.c) */

emu_stream *stream_new_locked(int32_t device, int is_default);
void stream_unref_locked(emu_stream *s);
/* Resolve a stream for use on `device` (NULL: its default stream): 107017 for a handle that is
 * not a live stream, 107003 for another device's stream. */
int resolve_stream_locked(const char *api, aclrtStream h, int32_t device, emu_stream **out);
/* A stream argument in CANN's order: a non-NULL handle must be a live stream (107017), then the
 * thread needs a current device (107002, stored in *device); NULL is that device's default
 * stream; with `same_device`, a stream of another device is 107003 (calls that queue work), else
 * it is used as it is (synchronize and query switch to the stream's context). */
int stream_arg_locked(const char *api, aclrtStream h, int same_device, int32_t *device, emu_stream **out);
/* Queue a task; in async mode a full stream first waits for room (the lock is released
 * meanwhile). 0, or -1 when out of memory. */
int enqueue_locked(emu_stream *s, emu_task_run run, emu_task_release release, void *payload);
/* Run (or wait for) s's tasks up to seq `upto`. deadline_ms > 0: stop with 1 once it passes. */
int drain_locked(emu_stream *s, uint64_t upto, double deadline_ms);
/* The status (and message) for enqueue_locked's result: 0, 507000 out of memory, 107017 when
 * the stream was destroyed while the caller waited for room. */
int enqueue_status(const char *api, int r);
void drain_device_locked(int32_t d);
/* Report (and clear) s's latched fault: the latest's status (0: none) and its message. */
int take_pending_locked(emu_stream *s, char *msg, size_t len);
/* aclFinalize: run every queued task of every device, then stop the engine thread (a later
 * enqueue starts another). Called with the lock held, returns with it held. */
void engine_finalize_locked(void);
/* After fork, in the child: forget the engine thread and the ready list. */
void engine_forget_after_fork(void);
void event_release_all_of_device_locked(int32_t d);
void stream_release_all_of_device_locked(int32_t d);

/* ------------------------------------------------------------------ memory (rt_memory.c) */

emu_block *find_block_locked(uintptr_t addr, size_t *index);
void block_release_locked(emu_block *b);
int reserve_va_locked(emu_device *dev, size_t *tried);
void release_device_blocks_locked(int32_t d);

#pragma GCC visibility pop

#endif
