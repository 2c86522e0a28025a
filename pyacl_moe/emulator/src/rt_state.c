/*
 * Emulated libascendcl.so, process state: aclInit/aclFinalize, configuration read from the
 * environment, the per-thread error message, live-object counters, fault injection, kernel
 * mutations, and what a child process inherits across fork().
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>
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
                                               "off-by-one-row", "fwd-unstable-sort",
                                               "fwd-wrong-row", "skip-last-row", "overrun"};

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

/* ------------------------------------------------------------------ configuration */

/* The environment is parsed strictly (pyacl_moe/emulator/_env.py applies the same rules from
 * Python, before the libraries are loaded): a malformed value is an error naming the variable
 * and the accepted forms, never a silent default. Empty means unset. It is read once, at the
 * first call that needs it (aclInit or any runtime call: none of them requires aclInit); while it
 * is malformed every call that reads it fails with ACL_ERROR_INVALID_PARAM and says why. */
static int g_config_read;
static int g_config_status;
static char g_config_error[EMU_MSG_LEN];

static int config_fail(const char *name, const char *value, const char *forms) {
    if (!g_config_status) {
        g_config_status = ACL_ERROR_INVALID_PARAM;
        snprintf(g_config_error, sizeof g_config_error,
                 "environment variable %s=\"%s\" is malformed: %s", name, value, forms);
    }
    return -1;
}

static const char *env_value(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

/* A decimal integer in [lo, hi], digits only (no sign, blanks or exponent). */
static int env_int(const char *name, long long lo, long long hi, long long dflt, long long *out,
                   const char *forms) {
    const char *v = env_value(name);
    *out = dflt;
    if (!v) return 0;
    long long x = 0;
    for (const char *c = v; *c; c++) {
        if (*c < '0' || *c > '9' || x > hi) return config_fail(name, v, forms);
        x = x * 10 + (*c - '0');
    }
    if (x < lo || x > hi) return config_fail(name, v, forms);
    *out = x;
    return 0;
}

#define EMU_MAX_CAPACITY ((size_t)1 << 40) /* the largest device address range reserved */

/* A byte count: digits, an optional fraction, an optional K/M/G/T suffix (powers of 1024). */
static int env_size(const char *name, size_t dflt, size_t *out) {
    static const char forms[] =
        "use a positive number of bytes, optionally with a fraction and one of the suffixes "
        "K, M, G, T (powers of 1024), e.g. 8G or 1.5M, at most 1T";
    const char *v = env_value(name);
    *out = dflt;
    if (!v) return 0;
    double x = 0, scale = 1;
    int digits = 0, fraction = 0;
    const char *c = v;
    for (; *c; c++) {
        if (*c >= '0' && *c <= '9') {
            if (++digits > 20) return config_fail(name, v, forms);
            if (fraction) x += (*c - '0') * (scale /= 10);
            else x = x * 10 + (*c - '0');
        } else if (*c == '.' && !fraction && digits) {
            fraction = 1;
        } else {
            break;
        }
    }
    if (!digits || (fraction && c[-1] == '.')) return config_fail(name, v, forms);
    double unit = 1;
    if (*c) {
        switch (*c) {
        case 'k': case 'K': unit = 1024.0; break;
        case 'm': case 'M': unit = 1024.0 * 1024.0; break;
        case 'g': case 'G': unit = 1024.0 * 1024.0 * 1024.0; break;
        case 't': case 'T': unit = 1024.0 * 1024.0 * 1024.0 * 1024.0; break;
        default: return config_fail(name, v, forms);
        }
        if (c[1]) return config_fail(name, v, forms);
    }
    x *= unit;
    if (x < 1 || x > (double)EMU_MAX_CAPACITY) return config_fail(name, v, forms);
    *out = (size_t)x;
    return 0;
}

/* `total` shared by the devices, in whole MiB (as one would write it), at least 1 MiB. */
static size_t share_of(size_t total, int devices) {
    size_t share = total / (size_t)(devices > 1 ? devices : 1);
    share &= ~(((size_t)1 << 20) - 1);
    return share < ((size_t)1 << 20) ? (size_t)1 << 20 : share;
}

/* The capacity a device has when PYACL_MOE_EMU_MEMORY is not set: 32 GiB, or less where the
 * host cannot back it. A device's memory is host memory: written beyond what the host has, a
 * job (or a hostile attribute that sizes an output) was killed by the kernel's OOM killer
 * instead of getting 207001, so the devices share half the host's physical memory at most,
 * leaving the other half to the host's own copies. Under an address-space limit (RLIMIT_AS,
 * `ulimit -v`) they share an eighth of the limit at most: a device's address range is reserved
 * address space (reserve_va_locked: about twice the capacity), counted by that limit with the
 * memory itself, and what is left must still hold the Python process itself, its libraries
 * and its threads' stacks and malloc arenas. */
static size_t default_capacity(int devices) {
    size_t cap = (size_t)32 << 30;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) {
        size_t half = share_of((size_t)pages / 2 * (size_t)page, devices);
        if (half < cap) cap = half;
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        size_t eighth = share_of((size_t)(rl.rlim_cur / 8), devices);
        if (eighth < cap) cap = eighth;
    }
    return cap;
}

/* One of `names` (NULL-terminated); its index, or dflt when unset. */
static int env_choice(const char *name, const char *const *names, int dflt, int *out,
                      const char *forms) {
    const char *v = env_value(name);
    *out = dflt;
    if (!v) return 0;
    for (int i = 0; names[i]; i++)
        if (strcmp(v, names[i]) == 0) {
            *out = i;
            return 0;
        }
    return config_fail(name, v, forms);
}

/* The kernel's thread count, as env_int parses it (kernel.c reads it at each run). */
#define EMU_MAX_THREADS_SETTING 1024

int config_locked(void) {
    if (g_config_read) return g_config_status;
    g_config_read = 1;
    long long count, depth, threads;
    env_int("PYACL_MOE_EMU_DEVICES", 0, EMU_MAX_DEVICES, 1, &count,
            "use a whole number of devices from 0 to 64");
    /* The host's devices share its memory; the process sees those ASCEND_RT_VISIBLE_DEVICES names. */
    g_device_count = visible_devices_locked((int)count);
    env_size("PYACL_MOE_EMU_MEMORY", default_capacity((int)count), &g_capacity);
    const char *soc = env_value("PYACL_MOE_EMU_SOC");
    int soc_ok = 1;
    for (const char *c = soc; c && *c; c++)
        if (!((*c >= 'A' && *c <= 'Z') || (*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') ||
              *c == '_' || *c == '-' || *c == '.'))
            soc_ok = 0;
    if (soc && (!soc_ok || strlen(soc) >= sizeof g_soc)) {
        config_fail("PYACL_MOE_EMU_SOC", soc,
                    "use a SoC name of 1 to 63 letters, digits, '_', '-' or '.', e.g. Ascend910B3");
        soc = NULL;
    } else if (soc && !emu_soc_family(soc)) {
        config_fail("PYACL_MOE_EMU_SOC", soc,
                    "use a SoC name CANN's platform files give a family the op is built for: "
                    "Ascend910B1 to Ascend910B4 (Atlas A2), Ascend910_9362 to Ascend910_9392 "
                    "(Atlas A3), Ascend950PR_* or Ascend950DT_* (arch35), e.g. Ascend950PR_9599");
        soc = NULL;
    } else if (soc && emu_soc_family(soc) == EMU_CHIP_950 && aclemuRelease() < 90000) {
        config_fail("PYACL_MOE_EMU_SOC", soc,
                    "the emulator models the Ascend 950 from release 9.0 (8.5 named it Ascend910_95 "
                    "and summed another way): use PYACL_MOE_EMU_RELEASE=9.0.0 or 9.1.0");
        soc = NULL;
    }
    snprintf(g_soc, sizeof g_soc, "%s", soc ? soc : "Ascend910B3");
    static const char *const mutations[] = {"none", "skip-last-k", "fp16-accumulate",
                                            "off-by-one-row", "fwd-unstable-sort", "fwd-wrong-row",
                                            "skip-last-row", "overrun", NULL};
    int mutation = EMU_MUT_NONE;
    env_choice("PYACL_MOE_EMU_MUTATION", mutations, EMU_MUT_NONE, &mutation,
               "use none, skip-last-k, fp16-accumulate, off-by-one-row, fwd-unstable-sort, "
               "fwd-wrong-row, skip-last-row or overrun");
    if (g_mutation < 0) g_mutation = mutation; /* aclemuSetMutation may have come first */
    static const char *const modes[] = {"lazy", "async", NULL};
    int async = 1;
    env_choice("PYACL_MOE_EMU_STREAMS", modes, 1, &async, "use async or lazy");
    g_async = async;
    env_int("PYACL_MOE_EMU_QUEUE_DEPTH", 1, 1 << 24, EMU_DEFAULT_QUEUE_DEPTH, &depth,
            "use a whole number of tasks from 1 to 16777216");
    g_queue_depth = (int)depth;
    env_int("PYACL_MOE_EMU_THREADS", 1, EMU_MAX_THREADS_SETTING, 1, &threads,
            "use a whole number of kernel threads from 1 to 1024 (at most 16 are used)");
    return g_config_status;
}

int config_error_locked(const char *api) {
    int st = config_locked();
    if (st) aclemuSetErrMsg(api, st, "%s", g_config_error);
    return st;
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
        "aclDestroyTensorList", "aclGetTensorListSize", "aclDestroyAclOpExecutor", "aclrtFree",
        "aclrtFreeHost", "aclrtDestroyStream", "aclrtDestroyEvent", "aclrtResetDevice", "aclFinalize",
        "aclrtGetDevice", "aclrtGetDeviceCount", "aclrtGetVersion", "aclrtGetSocName", "aclGetViewShape",
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
    for (int i = 1; name && i < (int)(sizeof g_mutation_names / sizeof *g_mutation_names); i++)
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

/* aclInit and aclFinalize as CANN's acl.cpp has them (hicann/runtime v9.1.0
 * src/acl/aclrt_impl/acl.cpp, aclInitImpl and aclFinalizeImpl; v8.5.0 is the same): a second
 * aclInit while initialized counts one more reference and returns 100002 before looking at
 * anything else; aclFinalize returns 100037 only when it already ran and no aclInit came since
 * (a flag that starts clear, so the first aclFinalize of a process succeeds even without
 * aclInit), ignores the reference count, and resets no device, releases nothing: memory,
 * streams and devices stay usable, since no runtime call checks aclInit. aclInit after
 * aclFinalize initializes again from 8.5. The 8.0.0 and 8.1.RC1 profiles keep what their acl.h
 * says ("aclInit can be called only once in a process"): a second successful aclInit in a
 * process, after aclFinalize, is 100002 there. A fork() child inherits these flags (they are
 * plain memory to CANN). */
static int64_t g_init_refs;   /* aclInit's reference count (g_initialized is g_init_refs > 0) */
static int g_finalize_flag;   /* aclFinalize ran and no aclInit since */
static int g_ever_initialized; /* an aclInit succeeded in this process */

EMU_API aclError aclInit(const char *configPath) {
    EMU_ENTRY(ACL_ERROR_INTERNAL_ERROR);
    (void)configPath; /* no configuration items are emulated */
    pthread_mutex_lock(&g_lock);
    int st = 0;
    if (g_init_refs > 0) {
        g_init_refs++;
        st = ACL_ERROR_REPEAT_INITIALIZE;
        aclemuSetErrMsg(api, st, "aclInit was already called in this process (and no aclFinalize since)");
    } else if ((st = config_error_locked(api))) { /* a malformed PYACL_MOE_EMU_* variable */
    } else if (aclemuRelease() < 80500 && g_ever_initialized) {
        st = ACL_ERROR_REPEAT_INITIALIZE;
        aclemuSetErrMsg(api, st,
                        "aclFinalize was already called in this process: this release allows aclInit "
                        "only once per process");
    } else {
        g_init_refs = 1;
        g_initialized = 1;
        g_finalize_flag = 0;
        g_ever_initialized = 1;
        count_set(EMU_C_INITIALIZED, 1);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclFinalize(void) {
    EMU_ENTRY(ACL_ERROR_INTERNAL_ERROR);
    pthread_mutex_lock(&g_lock);
    int st = 0;
    if (g_finalize_flag) {
        st = ACL_ERROR_REPEAT_FINALIZE;
        aclemuSetErrMsg(api, st, "aclFinalize was already called, and no aclInit since");
    } else {
        g_init_refs = 0;
        g_initialized = 0;
        g_finalize_flag = 1;
        count_set(EMU_C_INITIALIZED, 0);
        /* Nothing is released (CANN resets no device here). The engine thread stops, once it
         * has run what is queued; the next enqueue starts another. */
        engine_finalize_locked();
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* aclrtGetVersion is in release.c: each release declares its own interface version. */

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

/* Needs neither aclInit nor a device (acl_rt_impl_base.cpp, aclrtGetSocNameImpl); NULL only
 * while the environment is malformed (the emulator's failure of rtGetSocVersion). */
EMU_API const char *aclrtGetSocName(void) {
    EMU_ENTRY_NULL(1);
    pthread_mutex_lock(&g_lock);
    int st = config_error_locked(api);
    pthread_mutex_unlock(&g_lock);
    return st ? NULL : g_soc;
}

/* ------------------------------------------------------------------ fork */

/* Real CANN does not support use across fork(); the emulator's choice is that a child never
 * hangs on a lock another thread of the parent held, and starts with no device set. prepare
 * takes the lock, so the child's copy of the state is consistent; the child then gets fresh
 * locks and condition variables and abandons (leaks, never frees) what the parent had: its
 * streams, events, contexts, memory and executors are gone, their handles stale. aclInit's
 * flags are inherited, as fork copies them; nothing checks them, so the child may set a device
 * at once. The device address ranges are kept, so a parent's device pointer never aliases a
 * child's. */
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
    static const int live[] = {EMU_C_DEVICES_SET, EMU_C_DEVICE_ALLOCATIONS,
                               EMU_C_DEVICE_BYTES, EMU_C_HOST_ALLOCATIONS, EMU_C_HOST_BYTES,
                               EMU_C_STREAMS, EMU_C_EVENTS, EMU_C_TENSORS, EMU_C_SCALARS,
                               EMU_C_INT_ARRAYS, EMU_C_EXECUTORS, EMU_C_PENDING_TASKS,
                               EMU_C_TENSOR_LISTS};
    for (size_t i = 0; i < sizeof live / sizeof live[0]; i++) count_set(live[i], 0);
}

__attribute__((constructor)) static void rt_state_init(void) {
    init_conds();
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}
