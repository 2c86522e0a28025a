/*
 * Emulated libascendcl.so, process state: aclInit/aclFinalize, configuration read from the
 * environment, the per-thread error message, live-object counters, fault injection, kernel
 * mutations, and what a child process inherits across fork().
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rt_internal.h"

/* ------------------------------------------------------------------ process state */

/* Adaptive: critical sections are short and the engine and a launching thread meet here all
 * the time; spinning briefly avoids a futex sleep on most contended acquisitions. */
#ifdef PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP
pthread_mutex_t g_lock = PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP;
#else
pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
#endif
pthread_cond_t g_cond;        /* both use CLOCK_MONOTONIC (see rt_state_init): timed waits */
pthread_cond_t g_engine_cond; /* must not stretch when the wall clock is set back */
int g_waiters;
int64_t g_counters[EMU_C_COUNT];
int g_initialized;
int g_device_count = -1; /* -1: the environment was not read yet */
size_t g_capacity;
char g_soc[64];
int g_mutation = -1;
int g_async = 1;
int g_queue_depth = EMU_DEFAULT_QUEUE_DEPTH;
emu_device g_devices[EMU_MAX_DEVICES];

emu_htab g_streams = EMU_HTAB_INIT(EMU_KIND_STREAM);
emu_htab g_events = EMU_HTAB_INIT(EMU_KIND_EVENT);
emu_htab g_contexts = EMU_HTAB_INIT(EMU_KIND_CONTEXT);
emu_block **g_blocks;
size_t g_nblocks, g_cap_blocks;
emu_host_block *g_host;
size_t g_nhost, g_cap_host;

__thread uintptr_t tls_ctx;
static __thread char tls_msg[EMU_MSG_LEN];
static __thread int tls_msg_set;
static __thread char tls_msg_out[EMU_MSG_LEN];

typedef struct emu_fault {
    char api[96];
    int64_t nth;
    int64_t calls;
    int status;
} emu_fault;

static emu_fault g_faults[EMU_MAX_FAULTS];
static int g_nfaults;
static int g_faults_armed;

static const char *const g_mutation_names[] = {"", "skip-last-k", "fp16-accumulate",
                                               "off-by-one-row"};

double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

int grow(void **arr, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t ncap = *cap ? *cap * 2 : 16;
    while (ncap < need) ncap *= 2;
    void *p = realloc(*arr, ncap * elem);
    if (!p) return -1;
    *arr = p;
    *cap = ncap;
    return 0;
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

void config_locked(void) {
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
    const char *mode = getenv("PYACL_MOE_EMU_STREAMS");
    g_async = !(mode && strcmp(mode, "lazy") == 0);
    const char *depth = getenv("PYACL_MOE_EMU_QUEUE_DEPTH");
    long d = depth && *depth ? strtol(depth, NULL, 10) : EMU_DEFAULT_QUEUE_DEPTH;
    g_queue_depth = d < 1 ? 1 : d > (1L << 24) ? (1 << 24) : (int)d;
}

int require_init_locked(const char *api) {
    config_locked();
    if (!g_initialized) {
        aclemuSetErrMsg(api, ACL_ERROR_UNINITIALIZE, "aclInit has not been called");
        return ACL_ERROR_UNINITIALIZE;
    }
    return 0;
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
    if (slot >= 0 && slot < EMU_C_COUNT) count_add(slot, delta);
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
        "aclGetFormat", "aclGetRawTensorAddr", "aclrtQueryEventStatus", "aclrtStreamQuery",
        "aclrtGetCurrentContext", NULL};
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
            count_add(EMU_C_FAULTS_HIT, 1);
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

/* ------------------------------------------------------------------ acl.h */

/* acl.h allows one aclInit per process and no service after aclFinalize. CANN's acl.cpp of
 * that generation keeps its "initialized" flag set through aclFinalize, so a later aclInit
 * answers as a repeated one (100002); versions that added aclFinalizeReference (after 8.1.RC1)
 * count references and allow it. The emulator follows 8.1.RC1. A fork() child starts over. */
static int g_finalized;

EMU_API aclError aclInit(const char *configPath) {
    EMU_ENTRY(ACL_ERROR_INTERNAL_ERROR);
    (void)configPath; /* no configuration items are emulated */
    pthread_mutex_lock(&g_lock);
    config_locked();
    int st = 0;
    if (g_initialized) {
        st = ACL_ERROR_REPEAT_INITIALIZE;
        aclemuSetErrMsg(api, st, "aclInit was already called in this process");
    } else if (g_finalized) {
        st = ACL_ERROR_REPEAT_INITIALIZE;
        aclemuSetErrMsg(api, st,
                        "aclFinalize was already called in this process: aclInit can be called "
                        "only once per process, and CANN cannot be used after aclFinalize");
    } else {
        g_initialized = 1;
        count_set(EMU_C_INITIALIZED, 1);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclFinalize(void) {
    EMU_ENTRY(ACL_ERROR_INTERNAL_ERROR);
    pthread_mutex_lock(&g_lock);
    int st = 0;
    if (!g_initialized) {
        st = ACL_ERROR_REPEAT_FINALIZE;
        aclemuSetErrMsg(api, st, "aclFinalize without a matching aclInit");
    } else {
        for (int d = 0; d < g_device_count; d++) {
            if (g_devices[d].refcount > 0) {
                count_add(EMU_C_DEVICES_SET, -g_devices[d].refcount);
                g_devices[d].refcount = 0;
                device_teardown_locked(d);
            }
        }
        release_host_blocks_locked();
        g_initialized = 0;
        g_finalized = 1;
        count_set(EMU_C_INITIALIZED, 0);
        /* Every queue is empty now: the engine has nothing left to do. The next aclInit
         * starts a new one when work is queued. */
        engine_stop_locked();
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtGetVersion(int32_t *majorVersion, int32_t *minorVersion,
                                 int32_t *patchVersion) {
    EMU_ENTRY(ACL_ERROR_INTERNAL_ERROR);
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
    if (aclemuFaultPoint(__func__, 1)) {
        tls_msg_set = 0; /* the injected fault's own message is dropped with it */
        return NULL;
    }
    if (!tls_msg_set) return NULL;
    memcpy(tls_msg_out, tls_msg, sizeof tls_msg_out);
    tls_msg_set = 0;
    return tls_msg_out;
}

EMU_API const char *aclrtGetSocName(void) {
    EMU_ENTRY_NULL(1);
    pthread_mutex_lock(&g_lock);
    int st = require_init_locked(api);
    pthread_mutex_unlock(&g_lock);
    return st ? NULL : g_soc;
}

/* ------------------------------------------------------------------ fork */

/* Real CANN does not support use across fork(); the emulator's choice is that a child never
 * hangs on a lock another thread of the parent held, and starts with CANN uninitialized.
 * prepare takes the lock, so the child's copy of the state is consistent; the child then gets
 * fresh locks and condition variables and abandons (leaks, never frees) what the parent had:
 * its streams, events, contexts, memory and executors are gone, their handles stale. The
 * device address ranges are kept, so a parent's device pointer never aliases a child's. */
static void atfork_prepare(void) { pthread_mutex_lock(&g_lock); }

static void atfork_parent(void) { pthread_mutex_unlock(&g_lock); }

static void init_conds(void) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&g_cond, &attr);
    pthread_cond_init(&g_engine_cond, &attr);
    pthread_condattr_destroy(&attr);
}

static void atfork_child(void) {
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
#ifdef PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
#endif
    pthread_mutex_init(&g_lock, &attr);
    pthread_mutexattr_destroy(&attr);
    init_conds();
    g_waiters = 0;
    engine_forget_after_fork();
    g_initialized = 0;
    g_finalized = 0;
    for (int d = 0; d < EMU_MAX_DEVICES; d++) {
        emu_device *dev = &g_devices[d];
        dev->refcount = 0;
        dev->default_stream = NULL;
        dev->context = NULL;
        dev->used = 0; /* va_base and va_bump are kept */
    }
    emu_ht_abandon(&g_streams);
    emu_ht_abandon(&g_events);
    emu_ht_abandon(&g_contexts);
    g_blocks = NULL;
    g_nblocks = g_cap_blocks = 0;
    g_host = NULL;
    g_nhost = g_cap_host = 0;
    tls_ctx = 0;
    /* Live counts start from nothing; cumulative figures are the parent's history, kept. */
    static const int live[] = {EMU_C_INITIALIZED, EMU_C_DEVICES_SET, EMU_C_DEVICE_ALLOCATIONS,
                               EMU_C_DEVICE_BYTES, EMU_C_HOST_ALLOCATIONS, EMU_C_HOST_BYTES,
                               EMU_C_STREAMS, EMU_C_EVENTS, EMU_C_TENSORS, EMU_C_SCALARS,
                               EMU_C_INT_ARRAYS, EMU_C_EXECUTORS, EMU_C_PENDING_TASKS};
    for (size_t i = 0; i < sizeof live / sizeof live[0]; i++) count_set(live[i], 0);
}

__attribute__((constructor)) static void rt_state_init(void) {
    init_conds();
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}
