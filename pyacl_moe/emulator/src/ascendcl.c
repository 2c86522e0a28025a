/*
 * Emulated libascendcl.so: process state, devices, streams, events, device memory, the
 * per-thread error message, fault injection and the live-object counters.
 *
 * Model (see docs/emulator.md):
 *  - Device memory lives in a PROT_NONE address range reserved per device, so a device pointer
 *    is never a valid host pointer: touching one from the host faults, as on hardware. Each
 *    allocation is backed by host memory with guard bytes on both sides.
 *  - Streams are FIFO queues that run lazily, on the thread that waits for them. Nothing runs
 *    because time passed, so every test is deterministic.
 *  - One process-wide lock protects all state. Tasks run with the lock released, holding pins
 *    on the memory they touch.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "emu.h"

#define EMU_VERSION "pyacl-moe emulator 1 (CANN 8.x ABI)"
#define EMU_MAX_DEVICES 64
#define EMU_GUARD 64
#define EMU_GUARD_BYTE 0xFD
#define EMU_DEV_ALIGN 512
#define EMU_VA_GAP 4096
#define EMU_STREAM_MAGIC 0x5354524dU
#define EMU_EVENT_MAGIC 0x4556454eU
#define EMU_MAX_FAULTS 64

/* ------------------------------------------------------------------ process state */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cond = PTHREAD_COND_INITIALIZER;
static int64_t g_counters[EMU_C_COUNT];
static int g_initialized;

static __thread int32_t tls_device = -1;
static __thread char tls_msg[EMU_MSG_LEN];
static __thread int tls_msg_set;
static __thread char tls_msg_out[EMU_MSG_LEN];

typedef struct emu_task {
    struct emu_task *next;
    uint64_t seq;
    emu_task_run run;
    emu_task_release release;
    void *payload;
} emu_task;

typedef struct emu_stream {
    uint32_t magic;
    int32_t device;
    int is_default;
    int dead;
    int refs;
    emu_task *head, *tail;
    uint64_t next_seq;
    uint64_t done_seq;
    int running;
    int pending_status;
    char pending_msg[EMU_MSG_LEN];
} emu_stream;

typedef struct emu_event {
    uint32_t magic;
    int32_t device;
    int dead;
    int refs;
    uint64_t records;   /* id of the latest record */
    uint64_t completed; /* id of the latest record that ran */
    emu_stream *stream; /* stream of the latest record (a reference is held) */
    uint64_t seq;       /* its position in that stream */
    double ts_ms;       /* host clock when the latest record ran */
} emu_event;

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
    emu_stream *default_stream;
    unsigned char *va_base;
    size_t va_size;
    size_t va_bump;
    size_t used;
} emu_device;

typedef struct emu_host_block {
    void *ptr;
    size_t size;
} emu_host_block;

typedef struct emu_fault {
    char api[96];
    int64_t nth;
    int64_t calls;
    int status;
} emu_fault;

static int g_device_count = -1;
static size_t g_capacity;
static char g_soc[64];
static emu_device g_devices[EMU_MAX_DEVICES];

static emu_block **g_blocks;
static size_t g_nblocks, g_cap_blocks;
static emu_host_block *g_host;
static size_t g_nhost, g_cap_host;
static emu_stream **g_streams;
static size_t g_nstreams, g_cap_streams;
static emu_event **g_events;
static size_t g_nevents, g_cap_events;

static emu_fault g_faults[EMU_MAX_FAULTS];
static int g_nfaults;
static int g_faults_armed;
static int g_mutation = -1; /* -1: not read from the environment yet */

static const char *const g_mutation_names[] = {"", "skip-last-k", "fp16-accumulate",
                                               "off-by-one-row"};

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static size_t parse_size(const char *s, size_t dflt) {
    if (!s || !*s) return dflt;
    char *end = NULL;
    double v = strtod(s, &end);
    if (end == s || v <= 0) return dflt;
    switch (*end) {
    case 'k': case 'K': v *= 1024.0; break;
    case 'm': case 'M': v *= 1024.0 * 1024.0; break;
    case 'g': case 'G': v *= 1024.0 * 1024.0 * 1024.0; break;
    case 't': case 'T': v *= 1024.0 * 1024.0 * 1024.0 * 1024.0; break;
    default: break;
    }
    return (size_t)v;
}

/* Lazily read the environment (device count, capacity, SoC name, mutation). Lock held. */
static void config_locked(void) {
    if (g_device_count >= 0) return;
    const char *n = getenv("PYACL_MOE_EMU_DEVICES");
    int count = n && *n ? atoi(n) : 1;
    if (count < 0) count = 0;
    if (count > EMU_MAX_DEVICES) count = EMU_MAX_DEVICES;
    g_device_count = count;
    g_capacity = parse_size(getenv("PYACL_MOE_EMU_MEMORY"), (size_t)32 << 30);
    const char *soc = getenv("PYACL_MOE_EMU_SOC");
    snprintf(g_soc, sizeof g_soc, "%s", soc && *soc ? soc : "Ascend910B3");
    if (g_mutation < 0) {
        g_mutation = EMU_MUT_NONE;
        const char *m = getenv("PYACL_MOE_EMU_MUTATION");
        for (int i = 1; m && i < 4; i++)
            if (strcmp(m, g_mutation_names[i]) == 0) g_mutation = i;
    }
}

/* ------------------------------------------------------------------ messages, counters, faults */

EMU_API void aclemuSetErrMsg(const char *api, int status, const char *fmt, ...) {
    char body[EMU_MSG_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(body, sizeof body, fmt, ap);
    va_end(ap);
    snprintf(tls_msg, sizeof tls_msg, "%s failed with status %d: %s", api, status, body);
    tls_msg_set = 1;
}

EMU_API void aclemuCountAdd(int slot, int64_t delta) {
    if (slot >= 0 && slot < EMU_C_COUNT) __atomic_add_fetch(&g_counters[slot], delta, __ATOMIC_RELAXED);
}

/* Releases and queries are not counted by the "*" wildcard: failing them cannot be recovered
 * from, so a sweep over "every call" would only measure leaks it caused itself. */
static int wildcard_skips(const char *api) {
    static const char *const skip[] = {
        "aclGetRecentErrMsg", "aclDestroyTensor", "aclDestroyScalar", "aclDestroyIntArray",
        "aclDestroyAclOpExecutor", "aclrtFree", "aclrtFreeHost", "aclrtDestroyStream",
        "aclrtDestroyEvent", "aclrtResetDevice", "aclFinalize", "aclrtGetDevice",
        "aclrtGetDeviceCount", "aclrtGetVersion", "aclrtGetSocName", "aclGetViewShape",
        "aclGetViewStrides", "aclGetViewOffset", "aclGetStorageShape", "aclGetDataType",
        "aclGetFormat", "aclGetRawTensorAddr", NULL};
    for (int i = 0; skip[i]; i++)
        if (strcmp(api, skip[i]) == 0) return 1;
    return 0;
}

EMU_API int aclemuFaultPoint(const char *api, int default_status) {
    if (!__atomic_load_n(&g_faults_armed, __ATOMIC_ACQUIRE)) return 0;
    int status = 0;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_nfaults; i++) {
        emu_fault *f = &g_faults[i];
        int match = strcmp(f->api, api) == 0 || (strcmp(f->api, "*") == 0 && !wildcard_skips(api));
        if (!match) continue;
        if (f->nth == 0 || ++f->calls == f->nth) {
            status = f->status ? f->status : default_status;
            if (f->nth != 0) { /* one-shot; nth 0 fires on every call until cleared */
                g_faults[i] = g_faults[--g_nfaults];
                __atomic_store_n(&g_faults_armed, g_nfaults > 0, __ATOMIC_RELEASE);
            }
            g_counters[EMU_C_FAULTS_HIT]++;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (status > 0) aclemuSetErrMsg(api, status, "fault injected by the emulator (aclemuInjectFault)");
    return status;
}

EMU_API int aclemuInjectFault(const char *api, int64_t nth, int32_t status) {
    if (!api || !*api || strlen(api) >= sizeof g_faults[0].api || nth < 0) return -1;
    pthread_mutex_lock(&g_lock);
    if (g_nfaults >= EMU_MAX_FAULTS) {
        pthread_mutex_unlock(&g_lock);
        return -1;
    }
    emu_fault *f = &g_faults[g_nfaults++];
    snprintf(f->api, sizeof f->api, "%s", api);
    f->nth = nth;
    f->calls = 0;
    f->status = status;
    __atomic_store_n(&g_faults_armed, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_lock);
    return 0;
}

EMU_API void aclemuClearFaults(void) {
    pthread_mutex_lock(&g_lock);
    g_nfaults = 0;
    __atomic_store_n(&g_faults_armed, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_lock);
}

EMU_API int aclemuSetMutation(const char *name) {
    int id = -1;
    if (!name || !*name || strcmp(name, "none") == 0) id = EMU_MUT_NONE;
    for (int i = 1; name && i < 4; i++)
        if (strcmp(name, g_mutation_names[i]) == 0) id = i;
    if (id < 0) return -1;
    pthread_mutex_lock(&g_lock);
    config_locked();
    g_mutation = id;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

EMU_API int aclemuMutationId(void) {
    pthread_mutex_lock(&g_lock);
    config_locked();
    int m = g_mutation;
    pthread_mutex_unlock(&g_lock);
    return m;
}

EMU_API const char *aclemuGetMutation(void) { return g_mutation_names[aclemuMutationId()]; }

EMU_API const char *aclemuVersion(void) { return EMU_VERSION; }

EMU_API int aclemuGetStats(aclemuStats *stats) {
    if (!stats) return -1;
    int64_t *dst = (int64_t *)stats;
    for (int i = 0; i < EMU_C_COUNT; i++) dst[i] = __atomic_load_n(&g_counters[i], __ATOMIC_RELAXED);
    return 0;
}

/* ------------------------------------------------------------------ registries */

static int grow(void **arr, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t ncap = *cap ? *cap * 2 : 16;
    while (ncap < need) ncap *= 2;
    void *p = realloc(*arr, ncap * elem);
    if (!p) return -1;
    *arr = p;
    *cap = ncap;
    return 0;
}

static emu_stream *find_stream_locked(aclrtStream h) {
    for (size_t i = 0; i < g_nstreams; i++)
        if (g_streams[i] == (emu_stream *)h) return g_streams[i];
    return NULL;
}

static emu_event *find_event_locked(aclrtEvent h) {
    for (size_t i = 0; i < g_nevents; i++)
        if (g_events[i] == (emu_event *)h) return g_events[i];
    return NULL;
}

/* The live event behind a handle, or the status (and message) for a stale one. Lock held. */
static int event_locked(const char *api, aclrtEvent h, emu_event **out) {
    *out = find_event_locked(h);
    if (*out) return 0;
    aclemuSetErrMsg(api, ACL_ERROR_RT_INVALID_HANDLE, "event %p is not a live event", h);
    return ACL_ERROR_RT_INVALID_HANDLE;
}

static void stream_unref_locked(emu_stream *s) {
    if (--s->refs == 0) {
        s->magic = 0;
        free(s);
    }
}

static void event_unref_locked(emu_event *e) {
    if (--e->refs == 0) {
        if (e->stream) stream_unref_locked(e->stream);
        e->magic = 0;
        free(e);
    }
}

static emu_stream *stream_new_locked(int32_t device, int is_default) {
    emu_stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    if (!is_default) {
        if (grow((void **)&g_streams, &g_cap_streams, g_nstreams + 1, sizeof *g_streams)) {
            free(s);
            return NULL;
        }
        g_streams[g_nstreams++] = s;
    }
    s->magic = EMU_STREAM_MAGIC;
    s->device = device;
    s->is_default = is_default;
    s->refs = 1;
    return s;
}

/* ------------------------------------------------------------------ stream execution */

/* Run `s` in order until every task up to `upto` has run. Called and returns with the lock
 * held; releases it around each task. deadline_ms > 0 stops (returning 1) once it has passed,
 * after at least one task, so that polling always makes progress. */
static int drain_locked(emu_stream *s, uint64_t upto, double deadline_ms) {
    int timed_out = 0;
    int ran = 0;
    s->refs++;
    while (s->done_seq < upto) {
        if (s->running) {
            pthread_cond_wait(&g_cond, &g_lock);
            continue;
        }
        if (deadline_ms > 0 && ran && now_ms() >= deadline_ms) {
            timed_out = 1;
            break;
        }
        emu_task *t = s->head;
        if (!t) break;
        s->head = t->next;
        if (!s->head) s->tail = NULL;
        s->running = 1;
        pthread_mutex_unlock(&g_lock);
        char msg[EMU_MSG_LEN];
        msg[0] = 0;
        int st = t->run ? t->run(t->payload, msg, sizeof msg) : 0;
        pthread_mutex_lock(&g_lock);
        ran = 1;
        s->running = 0;
        s->done_seq = t->seq;
        g_counters[EMU_C_PENDING_TASKS]--;
        if (st) {
            g_counters[EMU_C_DEVICE_FAULTS]++;
            if (!s->pending_status) {
                s->pending_status = st;
                snprintf(s->pending_msg, sizeof s->pending_msg, "%s", msg);
            }
        }
        if (t->release) t->release(t->payload);
        free(t);
        pthread_cond_broadcast(&g_cond);
    }
    stream_unref_locked(s);
    return timed_out;
}

static void drain_all_locked(emu_stream *s) { drain_locked(s, s->next_seq, 0); }

/* The device-side failure a synchronize reports, once. Lock held. */
static int take_pending_locked(emu_stream *s, char *msg, size_t len) {
    int st = s->pending_status;
    if (st) {
        snprintf(msg, len, "%s", s->pending_msg);
        s->pending_status = 0;
        s->pending_msg[0] = 0;
    }
    return st;
}

static int enqueue_locked(emu_stream *s, emu_task_run run, emu_task_release release,
                          void *payload) {
    emu_task *t = calloc(1, sizeof *t);
    if (!t) return -1;
    t->seq = ++s->next_seq;
    t->run = run;
    t->release = release;
    t->payload = payload;
    if (s->tail) s->tail->next = t;
    else s->head = t;
    s->tail = t;
    g_counters[EMU_C_PENDING_TASKS]++;
    return 0;
}

/* ------------------------------------------------------------------ devices */

static int device_active_locked(int32_t d) {
    return g_initialized && d >= 0 && d < g_device_count && g_devices[d].refcount > 0;
}

static void block_release_locked(emu_block *b);

/* Free everything a device holds once its last reference goes: CANN releases the default
 * context, its streams and the device memory of the process. */
/* Run every queued task of device d. The lock is released while tasks run, so streams may come
 * and go: rescan until a full pass finds nothing left. Lock held. */
static void drain_device_locked(int32_t d) {
    emu_stream *def = g_devices[d].default_stream;
    if (def) {
        def->refs++;
        drain_all_locked(def);
    }
    for (int again = 1; again;) {
        again = 0;
        for (size_t i = 0; i < g_nstreams; i++) {
            emu_stream *s = g_streams[i];
            if (s->device == d && s->done_seq < s->next_seq) {
                drain_all_locked(s);
                again = 1;
                break;
            }
        }
    }
    if (def) stream_unref_locked(def);
}

static void device_teardown_locked(int32_t d) {
    emu_device *dev = &g_devices[d];
    drain_device_locked(d);
    for (size_t i = 0; i < g_nevents;) {
        emu_event *e = g_events[i];
        if (e->device == d) {
            e->dead = 1;
            g_events[i] = g_events[--g_nevents];
            g_counters[EMU_C_EVENTS]--;
            event_unref_locked(e);
        } else {
            i++;
        }
    }
    for (size_t i = 0; i < g_nstreams;) {
        emu_stream *s = g_streams[i];
        if (s->device == d) {
            s->dead = 1;
            g_streams[i] = g_streams[--g_nstreams];
            g_counters[EMU_C_STREAMS]--;
            stream_unref_locked(s);
        } else {
            i++;
        }
    }
    if (dev->default_stream) {
        dev->default_stream->dead = 1;
        stream_unref_locked(dev->default_stream);
        dev->default_stream = NULL;
    }
    for (size_t i = 0; i < g_nblocks;) {
        emu_block *b = g_blocks[i];
        if (b->device == d) {
            memmove(&g_blocks[i], &g_blocks[i + 1], (g_nblocks - i - 1) * sizeof *g_blocks);
            g_nblocks--;
            block_release_locked(b);
        } else {
            i++;
        }
    }
    dev->used = 0; /* va_bump is kept: old pointers must not alias new blocks */
}

EMU_API int aclemuRequireDevice(const char *api, int32_t *device) {
    pthread_mutex_lock(&g_lock);
    config_locked();
    int st = 0;
    if (!g_initialized) {
        st = ACL_ERROR_UNINITIALIZE;
        aclemuSetErrMsg(api, st, "aclInit has not been called");
    } else if (tls_device < 0 || !device_active_locked(tls_device)) {
        st = ACL_ERROR_RT_CONTEXT_NULL;
        aclemuSetErrMsg(api, st, "no current device on this thread: call aclrtSetDevice first");
    } else if (device) {
        *device = tls_device;
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* Same as aclemuRequireDevice with the lock already held. */
static int require_device_locked(const char *api, int32_t *device) {
    config_locked();
    if (!g_initialized) {
        aclemuSetErrMsg(api, ACL_ERROR_UNINITIALIZE, "aclInit has not been called");
        return ACL_ERROR_UNINITIALIZE;
    }
    if (tls_device < 0 || !device_active_locked(tls_device)) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_CONTEXT_NULL,
                        "no current device on this thread: call aclrtSetDevice first");
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
    if (device) *device = tls_device;
    return 0;
}

static int require_init_locked(const char *api) {
    config_locked();
    if (!g_initialized) {
        aclemuSetErrMsg(api, ACL_ERROR_UNINITIALIZE, "aclInit has not been called");
        return ACL_ERROR_UNINITIALIZE;
    }
    return 0;
}

/* Resolve a stream handle for use on `device`; NULL is the device's default stream. */
static int resolve_stream_locked(const char *api, aclrtStream h, int32_t device, emu_stream **out) {
    if (!h) {
        if (!device_active_locked(device)) {
            aclemuSetErrMsg(api, ACL_ERROR_RT_CONTEXT_NULL, "device %d is not set", (int)device);
            return ACL_ERROR_RT_CONTEXT_NULL;
        }
        *out = g_devices[device].default_stream;
        return 0;
    }
    emu_stream *s = find_stream_locked(h);
    if (!s) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_INVALID_HANDLE,
                        "stream %p is not a live stream (destroyed, or never created)", h);
        return ACL_ERROR_RT_INVALID_HANDLE;
    }
    if (s->device != device) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_STREAM_CONTEXT,
                        "stream %p belongs to device %d but the current device is %d", h,
                        (int)s->device, (int)device);
        return ACL_ERROR_RT_STREAM_CONTEXT;
    }
    *out = s;
    return 0;
}

/* ------------------------------------------------------------------ device memory */

static emu_block *find_block_locked(uintptr_t addr, size_t *index) {
    size_t lo = 0, hi = g_nblocks;
    while (lo < hi) { /* first block with addr > target */
        size_t mid = (lo + hi) / 2;
        if (g_blocks[mid]->addr <= addr) lo = mid + 1;
        else hi = mid;
    }
    if (lo == 0) return NULL;
    emu_block *b = g_blocks[lo - 1];
    if (addr >= b->addr + b->padded) return NULL;
    if (index) *index = lo - 1;
    return b;
}

static int in_device_va_locked(uintptr_t p) {
    for (int d = 0; d < EMU_MAX_DEVICES; d++) {
        emu_device *dev = &g_devices[d];
        if (dev->va_base && p >= (uintptr_t)dev->va_base && p < (uintptr_t)dev->va_base + dev->va_size)
            return 1;
    }
    return 0;
}

static int guards_ok(const emu_block *b) {
    for (size_t i = 0; i < EMU_GUARD; i++)
        if (b->base[i] != EMU_GUARD_BYTE || b->base[EMU_GUARD + b->padded + i] != EMU_GUARD_BYTE)
            return 0;
    return 1;
}

static void block_release_locked(emu_block *b) {
    emu_device *dev = &g_devices[b->device];
    dev->used -= b->padded;
    g_counters[EMU_C_DEVICE_ALLOCATIONS]--;
    g_counters[EMU_C_DEVICE_BYTES] -= (int64_t)b->size;
    b->freed = 1;
    if (b->pins == 0) {
        free(b->base);
        free(b);
    }
}

static int reserve_va_locked(emu_device *dev) {
    if (dev->va_base) return 0;
    for (size_t size = (size_t)1 << 40; size >= ((size_t)1 << 34); size >>= 1) {
        void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p != MAP_FAILED) {
            dev->va_base = p;
            dev->va_size = size;
            dev->va_bump = EMU_VA_GAP;
            return 0;
        }
    }
    return -1;
}

/* Find device addresses for `span` bytes: bump allocation first (addresses are not reused
 * while there is room, so a stale pointer never aliases a new block), then first fit. */
static int place_locked(int32_t d, size_t span, uintptr_t *addr) {
    emu_device *dev = &g_devices[d];
    size_t start = (dev->va_bump + EMU_DEV_ALIGN - 1) & ~(size_t)(EMU_DEV_ALIGN - 1);
    if (start + span + EMU_VA_GAP <= dev->va_size) {
        *addr = (uintptr_t)dev->va_base + start;
        dev->va_bump = start + span + EMU_VA_GAP;
        return 0;
    }
    uintptr_t lo = (uintptr_t)dev->va_base + EMU_VA_GAP;
    uintptr_t end = (uintptr_t)dev->va_base + dev->va_size;
    for (size_t i = 0; i <= g_nblocks; i++) {
        uintptr_t next = end;
        if (i < g_nblocks) {
            if (g_blocks[i]->device != d) continue;
            next = g_blocks[i]->addr;
        }
        uintptr_t cand = (lo + EMU_DEV_ALIGN - 1) & ~(uintptr_t)(EMU_DEV_ALIGN - 1);
        if (cand + span + EMU_VA_GAP <= next) {
            *addr = cand;
            return 0;
        }
        if (i < g_nblocks) lo = g_blocks[i]->addr + g_blocks[i]->padded + EMU_VA_GAP;
    }
    return -1;
}

static int pin_locked(uintptr_t addr, size_t len, emu_pin *pin) {
    emu_block *b = find_block_locked(addr, NULL);
    if (!b || addr + len > b->addr + b->padded || addr + len < addr) return -1;
    b->pins++;
    pin->block = b;
    pin->host = b->base + EMU_GUARD + (addr - b->addr);
    return 0;
}

EMU_API int aclemuPin(uintptr_t addr, size_t len, emu_pin *pin) {
    pthread_mutex_lock(&g_lock);
    int r = pin_locked(addr, len, pin);
    pthread_mutex_unlock(&g_lock);
    return r;
}

static void unpin_locked(emu_pin *pin) {
    emu_block *b = pin->block;
    if (!b) return;
    pin->block = NULL;
    if (--b->pins == 0 && b->freed) {
        free(b->base);
        free(b);
    }
}

EMU_API void aclemuUnpin(emu_pin *pin) {
    pthread_mutex_lock(&g_lock);
    unpin_locked(pin);
    pthread_mutex_unlock(&g_lock);
}

EMU_API int64_t aclemuCheckGuards(void) {
    int64_t bad = 0;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_nblocks; i++)
        if (!guards_ok(g_blocks[i])) bad++;
    pthread_mutex_unlock(&g_lock);
    return bad;
}

EMU_API int aclemuCorruptGuard(void *devPtr) {
    pthread_mutex_lock(&g_lock);
    emu_block *b = find_block_locked((uintptr_t)devPtr, NULL);
    if (b) b->base[EMU_GUARD + b->padded] ^= 0xFF;
    pthread_mutex_unlock(&g_lock);
    return b ? 0 : -1;
}

EMU_API int aclemuLaunch(const char *api, int32_t device, aclrtStream stream, uintptr_t workspace,
                         uint64_t workspace_size, int *mutation_slot, emu_task_run run,
                         emu_task_release release, void *payload) {
    pthread_mutex_lock(&g_lock);
    config_locked();
    int st = 0;
    emu_stream *s = NULL;
    if (!g_initialized || tls_device < 0 || !device_active_locked(tls_device)) {
        st = ACLNN_ERR_RUNTIME_ERROR;
        aclemuSetErrMsg(api, st, "no device context: call aclInit and aclrtSetDevice on this thread first");
    } else if (tls_device != device) {
        st = ACLNN_ERR_RUNTIME_ERROR;
        aclemuSetErrMsg(api, st, "the executor was built on device %d but the current device is %d",
                        (int)device, (int)tls_device);
    } else {
        int rt = resolve_stream_locked(api, stream, device, &s);
        if (rt) {
            st = ACLNN_ERR_RUNTIME_ERROR;
            aclemuSetErrMsg(api, st,
                            "stream %p cannot run the kernel (runtime status %d): it is not a live "
                            "stream of device %d",
                            stream, rt, (int)device);
        }
    }
    if (!st && workspace_size) {
        emu_block *b = find_block_locked(workspace, NULL);
        if (!b || b->device != device || workspace + workspace_size > b->addr + b->padded) {
            st = ACLNN_ERR_PARAM_INVALID;
            aclemuSetErrMsg(api, st,
                            "workspace [%p, +%llu) is not inside a live device allocation of device %d",
                            (void *)workspace, (unsigned long long)workspace_size, (int)device);
        }
    }
    if (!st && run) {
        if (mutation_slot) *mutation_slot = g_mutation;
        if (enqueue_locked(s, run, release, payload)) {
            st = ACLNN_ERR_INNER;
            aclemuSetErrMsg(api, st, "out of host memory while queueing the kernel");
        }
    }
    if (st && release) release(payload);
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* ------------------------------------------------------------------ acl.h */

EMU_API aclError aclInit(const char *configPath) {
    static const char *api = "aclInit";
    int f = aclemuFaultPoint(api, ACL_ERROR_INTERNAL_ERROR);
    if (f) return f;
    (void)configPath; /* no configuration items are emulated */
    pthread_mutex_lock(&g_lock);
    config_locked();
    int st = 0;
    if (g_initialized) {
        st = ACL_ERROR_REPEAT_INITIALIZE;
        aclemuSetErrMsg(api, st, "aclInit was already called in this process");
    } else {
        g_initialized = 1;
        g_counters[EMU_C_INITIALIZED] = 1;
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclFinalize(void) {
    static const char *api = "aclFinalize";
    int f = aclemuFaultPoint(api, ACL_ERROR_INTERNAL_ERROR);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    int st = 0;
    if (!g_initialized) {
        st = ACL_ERROR_REPEAT_FINALIZE;
        aclemuSetErrMsg(api, st, "aclFinalize without a matching aclInit");
    } else {
        for (int d = 0; d < g_device_count; d++) {
            if (g_devices[d].refcount > 0) {
                g_counters[EMU_C_DEVICES_SET] -= g_devices[d].refcount;
                g_devices[d].refcount = 0;
                device_teardown_locked(d);
            }
        }
        for (size_t i = 0; i < g_nhost; i++) free(g_host[i].ptr);
        g_counters[EMU_C_HOST_ALLOCATIONS] = 0;
        g_counters[EMU_C_HOST_BYTES] = 0;
        g_nhost = 0;
        g_initialized = 0;
        g_counters[EMU_C_INITIALIZED] = 0;
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtGetVersion(int32_t *majorVersion, int32_t *minorVersion,
                                 int32_t *patchVersion) {
    static const char *api = "aclrtGetVersion";
    int f = aclemuFaultPoint(api, ACL_ERROR_INTERNAL_ERROR);
    if (f) return f;
    if (!majorVersion || !minorVersion || !patchVersion) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "an output pointer is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    /* The interface version the CANN 8.1.RC1 headers declare. */
    *majorVersion = 1;
    *minorVersion = 13;
    *patchVersion = 0;
    return ACL_SUCCESS;
}

EMU_API const char *aclGetRecentErrMsg(void) {
    if (aclemuFaultPoint("aclGetRecentErrMsg", 1)) {
        tls_msg_set = 0; /* the injected fault's own message is dropped with it */
        return NULL;
    }
    if (!tls_msg_set) return NULL;
    memcpy(tls_msg_out, tls_msg, sizeof tls_msg_out);
    tls_msg_set = 0;
    return tls_msg_out;
}

/* ------------------------------------------------------------------ acl_base.h */

EMU_API const char *aclrtGetSocName(void) {
    static const char *api = "aclrtGetSocName";
    if (aclemuFaultPoint(api, 1)) return NULL;
    pthread_mutex_lock(&g_lock);
    int st = require_init_locked(api);
    pthread_mutex_unlock(&g_lock);
    return st ? NULL : g_soc;
}

/* ------------------------------------------------------------------ devices */

EMU_API aclError aclrtGetDeviceCount(uint32_t *count) {
    static const char *api = "aclrtGetDeviceCount";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    if (!count) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "count is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    config_locked();
    *count = (uint32_t)g_device_count;
    pthread_mutex_unlock(&g_lock);
    return ACL_SUCCESS;
}

EMU_API aclError aclrtSetDevice(int32_t deviceId) {
    static const char *api = "aclrtSetDevice";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    int st = require_init_locked(api);
    if (!st && (deviceId < 0 || deviceId >= g_device_count)) {
        st = ACL_ERROR_RT_INVALID_DEVICEID;
        aclemuSetErrMsg(api, st, "device id %d is not in [0, %d)", (int)deviceId, g_device_count);
    }
    if (!st) {
        emu_device *dev = &g_devices[deviceId];
        if (dev->refcount == 0) {
            if (reserve_va_locked(dev)) {
                st = ACL_ERROR_RT_MEMORY_ALLOCATION;
                aclemuSetErrMsg(api, st, "cannot reserve a device address range");
            } else if (!(dev->default_stream = stream_new_locked(deviceId, 1))) {
                st = ACL_ERROR_RT_INTERNAL_ERROR;
                aclemuSetErrMsg(api, st, "out of host memory");
            }
        }
        if (!st) {
            dev->refcount++;
            g_counters[EMU_C_DEVICES_SET]++;
            tls_device = deviceId;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtGetDevice(int32_t *deviceId) {
    static const char *api = "aclrtGetDevice";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    if (!deviceId) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "deviceId is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int st = require_device_locked(api, deviceId);
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtResetDevice(int32_t deviceId) {
    static const char *api = "aclrtResetDevice";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    int st = require_init_locked(api);
    if (!st && (deviceId < 0 || deviceId >= g_device_count)) {
        st = ACL_ERROR_RT_INVALID_DEVICEID;
        aclemuSetErrMsg(api, st, "device id %d is not in [0, %d)", (int)deviceId, g_device_count);
    } else if (!st && g_devices[deviceId].refcount == 0) {
        st = ACL_ERROR_RT_PARAM_INVALID;
        aclemuSetErrMsg(api, st, "device %d is not set (more resets than aclrtSetDevice calls)",
                        (int)deviceId);
    }
    if (!st) {
        g_counters[EMU_C_DEVICES_SET]--;
        if (--g_devices[deviceId].refcount == 0) device_teardown_locked(deviceId);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtSynchronizeDevice(void) {
    static const char *api = "aclrtSynchronizeDevice";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    int32_t d;
    int st = require_device_locked(api, &d);
    if (!st) {
        char msg[EMU_MSG_LEN];
        emu_stream *def = g_devices[d].default_stream;
        def->refs++;
        drain_device_locked(d);
        st = take_pending_locked(def, msg, sizeof msg);
        for (size_t i = 0; !st && i < g_nstreams; i++)
            if (g_streams[i]->device == d) st = take_pending_locked(g_streams[i], msg, sizeof msg);
        stream_unref_locked(def);
        if (st) aclemuSetErrMsg(api, st, "%s", msg);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* ------------------------------------------------------------------ streams */

EMU_API aclError aclrtCreateStream(aclrtStream *stream) {
    static const char *api = "aclrtCreateStream";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    if (!stream) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "stream is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int32_t d;
    int st = require_device_locked(api, &d);
    if (!st) {
        emu_stream *s = stream_new_locked(d, 0);
        if (!s) {
            st = ACL_ERROR_RT_INTERNAL_ERROR;
            aclemuSetErrMsg(api, st, "out of host memory");
        } else {
            g_counters[EMU_C_STREAMS]++;
            *stream = s;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtDestroyStream(aclrtStream stream) {
    static const char *api = "aclrtDestroyStream";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    int st = require_init_locked(api);
    emu_stream *s = NULL;
    if (!st && !(s = find_stream_locked(stream))) {
        st = ACL_ERROR_RT_INVALID_HANDLE;
        aclemuSetErrMsg(api, st, "stream %p is not a live stream created by aclrtCreateStream",
                        stream);
    }
    if (!st) {
        /* Tasks still queued run to completion first, as the hardware would finish them. */
        drain_all_locked(s);
        for (size_t i = 0; i < g_nstreams; i++) {
            if (g_streams[i] == s) {
                g_streams[i] = g_streams[--g_nstreams];
                break;
            }
        }
        s->dead = 1;
        g_counters[EMU_C_STREAMS]--;
        stream_unref_locked(s);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

static int sync_stream(const char *api, aclrtStream stream, int32_t timeout) {
    pthread_mutex_lock(&g_lock);
    int32_t d;
    int st = require_device_locked(api, &d);
    emu_stream *s = NULL;
    if (!st) st = resolve_stream_locked(api, stream, d, &s);
    if (!st) {
        s->refs++;
        double deadline = timeout >= 0 ? now_ms() + (double)timeout : 0;
        if (timeout == 0) deadline = now_ms() + 1e-9;
        int timed_out = drain_locked(s, s->next_seq, deadline);
        char msg[EMU_MSG_LEN];
        st = take_pending_locked(s, msg, sizeof msg);
        if (st) {
            aclemuSetErrMsg(api, st, "%s", msg);
        } else if (timed_out) {
            st = ACL_ERROR_RT_STREAM_SYNC_TIMEOUT;
            aclemuSetErrMsg(api, st, "%lld task(s) still queued after %d ms",
                            (long long)(s->next_seq - s->done_seq), (int)timeout);
        }
        stream_unref_locked(s);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtSynchronizeStream(aclrtStream stream) {
    int f = aclemuFaultPoint("aclrtSynchronizeStream", ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    return sync_stream("aclrtSynchronizeStream", stream, -1);
}

EMU_API aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout) {
    static const char *api = "aclrtSynchronizeStreamWithTimeout";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    if (timeout < -1) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "timeout %d is below -1", (int)timeout);
        return ACL_ERROR_INVALID_PARAM;
    }
    return sync_stream(api, stream, timeout);
}

typedef struct wait_payload {
    emu_stream *target;
    uint64_t seq;
} wait_payload;

static int wait_run(void *p, char *msg, size_t len) {
    (void)msg;
    (void)len;
    wait_payload *w = p;
    pthread_mutex_lock(&g_lock);
    drain_locked(w->target, w->seq, 0);
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static void wait_release(void *p) { /* lock held */
    wait_payload *w = p;
    stream_unref_locked(w->target);
    free(w);
}

EMU_API aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event) {
    static const char *api = "aclrtStreamWaitEvent";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    int32_t d;
    int st = require_device_locked(api, &d);
    emu_stream *s = NULL;
    emu_event *e = NULL;
    if (!st) st = resolve_stream_locked(api, stream, d, &s);
    if (!st) st = event_locked(api, event, &e);
    if (!st && e->stream && e->stream != s) { /* waiting on an unrecorded event is a no-op */
        wait_payload *w = malloc(sizeof *w);
        if (!w || enqueue_locked(s, wait_run, wait_release, w)) {
            free(w);
            st = ACL_ERROR_RT_INTERNAL_ERROR;
            aclemuSetErrMsg(api, st, "out of host memory");
        } else {
            w->target = e->stream;
            w->seq = e->seq;
            e->stream->refs++;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* ------------------------------------------------------------------ events */

EMU_API aclError aclrtCreateEvent(aclrtEvent *event) {
    static const char *api = "aclrtCreateEvent";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    if (!event) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "event is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int32_t d;
    int st = require_device_locked(api, &d);
    if (!st) {
        emu_event *e = calloc(1, sizeof *e);
        if (!e || grow((void **)&g_events, &g_cap_events, g_nevents + 1, sizeof *g_events)) {
            free(e);
            st = ACL_ERROR_RT_INTERNAL_ERROR;
            aclemuSetErrMsg(api, st, "out of host memory");
        } else {
            e->magic = EMU_EVENT_MAGIC;
            e->device = d;
            e->refs = 1;
            g_events[g_nevents++] = e;
            g_counters[EMU_C_EVENTS]++;
            *event = e;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtDestroyEvent(aclrtEvent event) {
    static const char *api = "aclrtDestroyEvent";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    int st = require_init_locked(api);
    emu_event *e = NULL;
    if (!st) st = event_locked(api, event, &e);
    if (!st) {
        for (size_t i = 0; i < g_nevents; i++) {
            if (g_events[i] == e) {
                g_events[i] = g_events[--g_nevents];
                break;
            }
        }
        e->dead = 1;
        g_counters[EMU_C_EVENTS]--;
        event_unref_locked(e);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

typedef struct record_payload {
    emu_event *event;
    uint64_t id;
} record_payload;

static int record_run(void *p, char *msg, size_t len) {
    (void)msg;
    (void)len;
    record_payload *r = p;
    double t = now_ms();
    pthread_mutex_lock(&g_lock);
    if (r->id > r->event->completed) {
        r->event->completed = r->id;
        r->event->ts_ms = t;
    }
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static void record_release(void *p) { /* lock held */
    record_payload *r = p;
    event_unref_locked(r->event);
    free(r);
}

EMU_API aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
    static const char *api = "aclrtRecordEvent";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    int32_t d;
    int st = require_device_locked(api, &d);
    emu_stream *s = NULL;
    emu_event *e = NULL;
    if (!st) st = event_locked(api, event, &e);
    if (!st) st = resolve_stream_locked(api, stream, d, &s);
    if (!st) {
        record_payload *r = malloc(sizeof *r);
        if (!r || enqueue_locked(s, record_run, record_release, r)) {
            free(r);
            st = ACL_ERROR_RT_INTERNAL_ERROR;
            aclemuSetErrMsg(api, st, "out of host memory");
        } else {
            r->event = e;
            r->id = ++e->records;
            e->refs++;
            if (e->stream) stream_unref_locked(e->stream);
            e->stream = s;
            s->refs++;
            e->seq = s->next_seq;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtSynchronizeEvent(aclrtEvent event) {
    static const char *api = "aclrtSynchronizeEvent";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    int st = require_init_locked(api);
    emu_event *e = NULL;
    if (!st) st = event_locked(api, event, &e);
    if (!st && e->stream) {
        emu_stream *s = e->stream;
        s->refs++;
        drain_locked(s, e->seq, 0);
        char msg[EMU_MSG_LEN];
        st = take_pending_locked(s, msg, sizeof msg);
        if (st) aclemuSetErrMsg(api, st, "%s", msg);
        stream_unref_locked(s);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtEventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent) {
    static const char *api = "aclrtEventElapsedTime";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    if (!ms) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "ms is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int st = require_init_locked(api);
    emu_event *a = NULL, *b = NULL;
    if (!st && (!(a = find_event_locked(startEvent)) || !(b = find_event_locked(endEvent)))) {
        st = ACL_ERROR_RT_INVALID_HANDLE;
        aclemuSetErrMsg(api, st, "%s event is not a live event", a ? "the end" : "the start");
    }
    if (!st && (a->records == 0 || b->records == 0)) {
        st = ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID;
        aclemuSetErrMsg(api, st, "the %s event was never recorded", a->records ? "end" : "start");
    }
    if (!st && (a->completed != a->records || b->completed != b->records)) {
        st = ACL_ERROR_RT_EVENT_NOT_COMPLETE;
        aclemuSetErrMsg(api, st,
                        "the %s event has not completed: synchronize its stream or the event first",
                        a->completed != a->records ? "start" : "end");
    }
    if (!st) {
        double d = b->ts_ms - a->ts_ms;
        if (d < 0) {
            st = ACL_ERROR_RT_EVENT_TIMESTAMP_REVERSAL;
            aclemuSetErrMsg(api, st, "the end event completed %.3f ms before the start event", -d);
        } else {
            *ms = (float)d;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* ------------------------------------------------------------------ memory */

EMU_API aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    static const char *api = "aclrtMalloc";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_MEMORY_ALLOCATION);
    if (f) return f;
    (void)policy; /* every policy is served from the same emulated HBM */
    if (!devPtr) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "devPtr is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    if (size == 0) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "size is 0");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int32_t d;
    int st = require_device_locked(api, &d);
    /* CANN rounds every block up to 32 bytes and adds 32 more. */
    size_t padded = ((size + 31) & ~(size_t)31) + 32;
    emu_device *dev = &g_devices[d];
    uintptr_t addr = 0;
    emu_block *b = NULL;
    if (!st && (size > g_capacity || padded > g_capacity - dev->used)) {
        st = ACL_ERROR_RT_MEMORY_ALLOCATION;
        aclemuSetErrMsg(api, st, "cannot allocate %zu bytes: device %d has %zu of %zu bytes free",
                        size, (int)d, g_capacity - dev->used, g_capacity);
    }
    if (!st && place_locked(d, padded, &addr)) {
        st = ACL_ERROR_RT_MEMORY_ALLOCATION;
        aclemuSetErrMsg(api, st, "device %d address space is exhausted", (int)d);
    }
    if (!st) {
        b = calloc(1, sizeof *b);
        unsigned char *base = NULL;
        if (!b || posix_memalign((void **)&base, 64, padded + 2 * EMU_GUARD) ||
            grow((void **)&g_blocks, &g_cap_blocks, g_nblocks + 1, sizeof *g_blocks)) {
            free(b);
            free(base);
            st = ACL_ERROR_RT_MEMORY_ALLOCATION;
            aclemuSetErrMsg(api, st, "the host cannot back %zu bytes of emulated device memory",
                            size);
        } else {
            memset(base, EMU_GUARD_BYTE, EMU_GUARD);
            memset(base + EMU_GUARD + padded, EMU_GUARD_BYTE, EMU_GUARD);
            b->addr = addr;
            b->size = size;
            b->padded = padded;
            b->device = d;
            b->base = base;
            size_t i = g_nblocks;
            while (i > 0 && g_blocks[i - 1]->addr > addr) i--;
            memmove(&g_blocks[i + 1], &g_blocks[i], (g_nblocks - i) * sizeof *g_blocks);
            g_blocks[i] = b;
            g_nblocks++;
            dev->used += padded;
            g_counters[EMU_C_DEVICE_ALLOCATIONS]++;
            g_counters[EMU_C_DEVICE_BYTES] += (int64_t)size;
            g_counters[EMU_C_MALLOCS_TOTAL]++;
            *devPtr = (void *)addr;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtFree(void *devPtr) {
    static const char *api = "aclrtFree";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_MEMORY_FREE);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    int st = require_init_locked(api);
    size_t idx = 0;
    emu_block *b = NULL;
    if (!st) {
        b = find_block_locked((uintptr_t)devPtr, &idx);
        if (!b || b->addr != (uintptr_t)devPtr) {
            st = ACL_ERROR_RT_MEMORY_FREE;
            aclemuSetErrMsg(api, st,
                            "%p is not the start of a live device allocation (never allocated, "
                            "already freed, or freed by aclrtResetDevice/aclFinalize)",
                            devPtr);
            b = NULL;
        }
    }
    if (b) {
        int corrupt = !guards_ok(b);
        memmove(&g_blocks[idx], &g_blocks[idx + 1], (g_nblocks - idx - 1) * sizeof *g_blocks);
        g_nblocks--;
        size_t size = b->size;
        block_release_locked(b);
        if (corrupt) {
            g_counters[EMU_C_GUARD_CORRUPTIONS]++;
            st = ACL_ERROR_RT_DEVICE_MEM_ERROR;
            aclemuSetErrMsg(api, st,
                            "the guard bytes around the %zu-byte block at %p were overwritten: "
                            "something wrote past its end (the block was freed)",
                            size, devPtr);
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtMallocHost(void **hostPtr, size_t size) {
    static const char *api = "aclrtMallocHost";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_MEMORY_ALLOCATION);
    if (f) return f;
    if (!hostPtr || size == 0) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, hostPtr ? "size is 0" : "hostPtr is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int st = require_init_locked(api);
    void *p = NULL;
    if (!st && (posix_memalign(&p, 64, size) ||
                grow((void **)&g_host, &g_cap_host, g_nhost + 1, sizeof *g_host))) {
        free(p);
        st = ACL_ERROR_RT_MEMORY_ALLOCATION;
        aclemuSetErrMsg(api, st, "cannot allocate %zu bytes of host memory", size);
    } else if (!st) {
        g_host[g_nhost].ptr = p;
        g_host[g_nhost].size = size;
        g_nhost++;
        g_counters[EMU_C_HOST_ALLOCATIONS]++;
        g_counters[EMU_C_HOST_BYTES] += (int64_t)size;
        *hostPtr = p;
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtFreeHost(void *hostPtr) {
    static const char *api = "aclrtFreeHost";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_MEMORY_FREE);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    int st = require_init_locked(api);
    if (!st) {
        size_t i = 0;
        while (i < g_nhost && g_host[i].ptr != hostPtr) i++;
        if (i == g_nhost) {
            st = ACL_ERROR_RT_MEMORY_FREE;
            aclemuSetErrMsg(api, st, "%p was not returned by aclrtMallocHost or is already freed",
                            hostPtr);
        } else {
            free(g_host[i].ptr);
            g_counters[EMU_C_HOST_ALLOCATIONS]--;
            g_counters[EMU_C_HOST_BYTES] -= (int64_t)g_host[i].size;
            g_host[i] = g_host[--g_nhost];
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* Where a copy goes: each side is checked against the kind and against live allocations. */
typedef struct copy_plan {
    int dst_dev, src_dev;
} copy_plan;

static const char *const g_kind_names[] = {"HOST_TO_HOST", "HOST_TO_DEVICE", "DEVICE_TO_HOST",
                                           "DEVICE_TO_DEVICE", "DEFAULT"};

static int check_side_locked(const char *api, const char *what, uintptr_t p, size_t count,
                             int want_dev) {
    if (want_dev) {
        emu_block *b = find_block_locked(p, NULL);
        if (!b || p + count > b->addr + b->padded || p + count < p) {
            aclemuSetErrMsg(api, ACL_ERROR_RT_PARAM_INVALID,
                            "%s [%p, +%zu) is not inside a live device allocation%s", what,
                            (void *)p, count,
                            b ? " (it runs past the end of the block)" : "");
            return ACL_ERROR_RT_PARAM_INVALID;
        }
    } else if (in_device_va_locked(p)) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_PARAM_INVALID,
                        "%s %p is device memory but the copy kind says host", what, (void *)p);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    return 0;
}

static int plan_copy_locked(const char *api, void *dst, size_t destMax, const void *src,
                            size_t count, aclrtMemcpyKind kind, copy_plan *plan) {
    if (!dst || !src) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "%s is NULL", dst ? "src" : "dst");
        return ACL_ERROR_INVALID_PARAM;
    }
    if (count > destMax) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "count %zu exceeds destMax %zu", count,
                        destMax);
        return ACL_ERROR_INVALID_PARAM;
    }
    switch (kind) {
    case ACL_MEMCPY_HOST_TO_HOST: plan->dst_dev = 0; plan->src_dev = 0; break;
    case ACL_MEMCPY_HOST_TO_DEVICE: plan->dst_dev = 1; plan->src_dev = 0; break;
    case ACL_MEMCPY_DEVICE_TO_HOST: plan->dst_dev = 0; plan->src_dev = 1; break;
    case ACL_MEMCPY_DEVICE_TO_DEVICE: plan->dst_dev = 1; plan->src_dev = 1; break;
    case ACL_MEMCPY_DEFAULT:
        plan->dst_dev = in_device_va_locked((uintptr_t)dst);
        plan->src_dev = in_device_va_locked((uintptr_t)src);
        break;
    default:
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "copy kind %d is not supported",
                        (int)kind);
        return ACL_ERROR_INVALID_PARAM;
    }
    (void)g_kind_names;
    if (count == 0) return 0;
    int st = check_side_locked(api, "dst", (uintptr_t)dst, count, plan->dst_dev);
    if (!st) st = check_side_locked(api, "src", (uintptr_t)src, count, plan->src_dev);
    return st;
}

/* Pin whichever sides are device memory and return host addresses for both. */
static int pin_copy_locked(uintptr_t dst, uintptr_t src, size_t count, const copy_plan *plan,
                           emu_pin *pd, emu_pin *ps, void **hd, const void **hs) {
    pd->block = ps->block = NULL;
    *hd = (void *)dst;
    *hs = (const void *)src;
    if (plan->dst_dev) {
        if (pin_locked(dst, count, pd)) return -1;
        *hd = pd->host;
    }
    if (plan->src_dev) {
        if (pin_locked(src, count, ps)) {
            unpin_locked(pd);
            return -1;
        }
        *hs = ps->host;
    }
    return 0;
}

EMU_API aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
                             aclrtMemcpyKind kind) {
    static const char *api = "aclrtMemcpy";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    copy_plan plan;
    int st = require_init_locked(api);
    if (!st) st = plan_copy_locked(api, dst, destMax, src, count, kind, &plan);
    emu_pin pd, ps;
    void *hd;
    const void *hs;
    if (!st && count && pin_copy_locked((uintptr_t)dst, (uintptr_t)src, count, &plan, &pd, &ps,
                                        &hd, &hs)) {
        st = ACL_ERROR_RT_PARAM_INVALID;
        aclemuSetErrMsg(api, st, "device memory vanished during the copy");
    }
    pthread_mutex_unlock(&g_lock);
    /* A synchronous copy waits for no stream, as on hardware: it sees memory as it is now. */
    if (!st && count) {
        memmove(hd, hs, count);
        pthread_mutex_lock(&g_lock);
        unpin_locked(&pd);
        unpin_locked(&ps);
        pthread_mutex_unlock(&g_lock);
    }
    return st;
}

typedef struct copy_payload {
    uintptr_t dst, src;
    size_t count;
    int value; /* memset when is_set */
    int is_set;
    copy_plan plan;
} copy_payload;

static int copy_run(void *p, char *msg, size_t len) {
    copy_payload *c = p;
    if (c->count == 0) return 0;
    emu_pin pd, ps;
    void *hd;
    const void *hs;
    pthread_mutex_lock(&g_lock);
    int bad = pin_copy_locked(c->dst, c->src, c->count, &c->plan, &pd, &ps, &hd, &hs);
    pthread_mutex_unlock(&g_lock);
    if (bad) {
        snprintf(msg, len,
                 "device fault: an asynchronous %s of %zu bytes touched device memory that was "
                 "freed before the stream ran it",
                 c->is_set ? "memset" : "memcpy", c->count);
        return ACL_ERROR_RT_SYS_DMA;
    }
    if (c->is_set) memset(hd, c->value, c->count);
    else memmove(hd, hs, c->count);
    pthread_mutex_lock(&g_lock);
    unpin_locked(&pd);
    unpin_locked(&ps);
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static void copy_release(void *p) { free(p); }

EMU_API aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                                  aclrtMemcpyKind kind, aclrtStream stream) {
    static const char *api = "aclrtMemcpyAsync";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    int32_t d;
    copy_plan plan;
    emu_stream *s = NULL;
    int st = require_device_locked(api, &d);
    if (!st) st = resolve_stream_locked(api, stream, d, &s);
    if (!st) st = plan_copy_locked(api, dst, destMax, src, count, kind, &plan);
    if (!st) {
        copy_payload *c = calloc(1, sizeof *c);
        if (!c || enqueue_locked(s, copy_run, copy_release, c)) {
            free(c);
            st = ACL_ERROR_RT_INTERNAL_ERROR;
            aclemuSetErrMsg(api, st, "out of host memory");
        } else {
            /* Host memory is read or written when the stream runs, not now. */
            c->dst = (uintptr_t)dst;
            c->src = (uintptr_t)src;
            c->count = count;
            c->plan = plan;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

static int plan_set_locked(const char *api, void *devPtr, size_t maxCount, size_t count,
                           copy_plan *plan) {
    if (!devPtr) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "devPtr is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    if (count > maxCount) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "count %zu exceeds maxCount %zu", count,
                        maxCount);
        return ACL_ERROR_INVALID_PARAM;
    }
    /* The runtime decides host or device from the address. */
    plan->dst_dev = in_device_va_locked((uintptr_t)devPtr);
    plan->src_dev = 0;
    if (count == 0) return 0;
    return check_side_locked(api, "devPtr", (uintptr_t)devPtr, count, plan->dst_dev);
}

EMU_API aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count) {
    static const char *api = "aclrtMemset";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    copy_plan plan;
    int st = require_init_locked(api);
    if (!st) st = plan_set_locked(api, devPtr, maxCount, count, &plan);
    pthread_mutex_unlock(&g_lock);
    if (!st && count) {
        copy_payload c = {(uintptr_t)devPtr, 0, count, value, 1, plan};
        char msg[EMU_MSG_LEN];
        st = copy_run(&c, msg, sizeof msg);
        if (st) aclemuSetErrMsg(api, st, "%s", msg);
    }
    return st;
}

EMU_API aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count,
                                  aclrtStream stream) {
    static const char *api = "aclrtMemsetAsync";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    int32_t d;
    copy_plan plan;
    emu_stream *s = NULL;
    int st = require_device_locked(api, &d);
    if (!st) st = resolve_stream_locked(api, stream, d, &s);
    if (!st) st = plan_set_locked(api, devPtr, maxCount, count, &plan);
    if (!st) {
        copy_payload *c = calloc(1, sizeof *c);
        if (!c || enqueue_locked(s, copy_run, copy_release, c)) {
            free(c);
            st = ACL_ERROR_RT_INTERNAL_ERROR;
            aclemuSetErrMsg(api, st, "out of host memory");
        } else {
            c->dst = (uintptr_t)devPtr;
            c->count = count;
            c->value = value;
            c->is_set = 1;
            c->plan = plan;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free_bytes, size_t *total) {
    static const char *api = "aclrtGetMemInfo";
    int f = aclemuFaultPoint(api, ACL_ERROR_RT_INTERNAL_ERROR);
    if (f) return f;
    if (!free_bytes || !total) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "an output pointer is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    if ((int)attr < ACL_DDR_MEM || (int)attr > ACL_HBM_MEM_P2P_HUGE1G) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "attr %d is not an aclrtMemAttr", (int)attr);
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int32_t d;
    int st = require_device_locked(api, &d);
    if (!st) {
        int is_ddr = attr == ACL_DDR_MEM || attr == ACL_DDR_MEM_HUGE || attr == ACL_DDR_MEM_NORMAL ||
                     attr == ACL_DDR_MEM_P2P_HUGE || attr == ACL_DDR_MEM_P2P_NORMAL;
        /* The emulated chip, like Atlas A2, has HBM only. */
        *total = is_ddr ? 0 : g_capacity;
        *free_bytes = is_ddr ? 0 : g_capacity - g_devices[d].used;
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}
