/*
 * Emulated libascendcl.so, devices and contexts.
 *
 * aclrtSetDevice/aclrtResetDevice are reference-counted per device across the process. The
 * count going 0 -> 1 creates the device's default context and default stream; going back to 0
 * runs the device's queued work and releases its streams, events, memory and context. A
 * thread's current device is the device of its current context: aclrtSetDevice makes the
 * device's default context current, aclrtSetCurrentContext switches to another one without
 * touching any reference count.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "rt_internal.h"

/* ------------------------------------------------------------------ ASCEND_RT_VISIBLE_DEVICES */

/* Which devices the process sees, read as CANN's runtime reads the variable (hicann/runtime
 * v9.1.0 src/runtime/core/src/runtime.cc: SplitString at 4223, Runtime::GetVisibleDevices at
 * 4430; the same in v8.5.0 and v9.0.0; docs/emulator.md, *Visible devices*). Once per process,
 * with the rest of the environment. The visible devices are renumbered from 0 in the order
 * given; the emulator's devices are indexed by those numbers (CANN's "user" ids), g_visible
 * maps each to the id of the host (what the variable names: CANN's logic id). */
static int32_t g_visible[EMU_MAX_DEVICES];
static int g_visible_set;   /* the variable was set (an empty value too) and the host has devices */
static int g_visible_error; /* 0, or why none is visible: 1 no valid id first, 2 not ascending, 3 twice */
static int g_host_devices;  /* PYACL_MOE_EMU_DEVICES: the devices of the host (the driver's count) */
static char g_visible_text[129]; /* the first 128 characters, as the runtime keeps them */

static int is_digit(char c) { return c >= '0' && c <= '9'; }

int visible_devices_locked(int host_devices) {
    g_host_devices = host_devices;
    g_visible_set = g_visible_error = 0;
    for (int i = 0; i < EMU_MAX_DEVICES; i++) g_visible[i] = i;
    const char *v = getenv("ASCEND_RT_VISIBLE_DEVICES");
    /* No device: the runtime does not read the variable (isHaveDevice_). Unset: all visible. */
    if (!v || host_devices == 0) return host_devices;
    g_visible_set = 1;
    snprintf(g_visible_text, sizeof g_visible_text, "%s", v);
    /* The ids: runs of digits separated by single commas, read up to the first other character
     * (or a second comma in a row); a value that does not begin with a digit has none. */
    int n = 0, commas = 0;
    const char *c = g_visible_text;
    while (is_digit(*g_visible_text) && *c) {
        if (!is_digit(*c)) {
            if (*c != ',' || ++commas > 1) break;
            c++;
            continue;
        }
        commas = 0;
        long long id = 0;
        for (; is_digit(*c); c++)
            if (id <= 2147483647LL) id = id * 10 + (*c - '0'); /* std::stoi: beyond int, invalid */
        /* An id the host does not have ends the list (those before it stay visible). */
        if (id > (long long)host_devices - 1) break;
        if (n > 0 && id < g_visible[n - 1]) {
            g_visible_error = 2;
            break;
        }
        for (int j = 0; j < n && !g_visible_error; j++)
            if (g_visible[j] == id) g_visible_error = 3;
        if (g_visible_error) break;
        g_visible[n++] = (int32_t)id;
        if (n >= host_devices) break;
    }
    if (!g_visible_error && n == 0) g_visible_error = 1;
    if (g_visible_error) {
        for (int i = 0; i < EMU_MAX_DEVICES; i++) g_visible[i] = -1;
        return 0; /* userDeviceCnt stays 0: every aclrtSetDevice is refused */
    }
    for (int i = n; i < EMU_MAX_DEVICES; i++) g_visible[i] = -1;
    return n;
}

static void visible_reason(char *reason, size_t len) {
    static const char *const why[] = {
        "", "it names no device id of the host first (ids 0 to %d, separated by single commas)",
        "its ids must be in ascending order", "it names a device twice"};
    snprintf(reason, len, why[g_visible_error], g_host_devices - 1);
}

/* aclrtGetDeviceCount under a list that makes no device visible: ApiImpl::GetDeviceCount
 * (v9.1.0 src/runtime/core/src/api_impl/api_impl.cc:3195) returns RT_ERROR_DRV_NO_DEVICE,
 * which is 207004 ACL_ERROR_RT_NO_DEVICE (errcode_manage.cc:82). */
static int visible_error_locked(const char *api) {
    if (!g_visible_error) return 0;
    char reason[128];
    visible_reason(reason, sizeof reason);
    aclemuSetErrMsg(api, ACL_ERROR_RT_NO_DEVICE,
                    "environment variable ASCEND_RT_VISIBLE_DEVICES=\"%s\" makes no device visible: %s",
                    g_visible_text, reason);
    return ACL_ERROR_RT_NO_DEVICE;
}

/* 107001 for an id outside the visible devices (ApiErrorDecorator::SetDevice, api_error.cc:2642:
 * RT_ERROR_DEVICE_ID), saying what the variable made visible. */
static int device_id_error_locked(const char *api, int32_t deviceId) {
    char reason[128];
    if (g_visible_error) {
        visible_reason(reason, sizeof reason);
        aclemuSetErrMsg(api, ACL_ERROR_RT_INVALID_DEVICEID,
                        "device id %d is not visible: ASCEND_RT_VISIBLE_DEVICES=\"%s\" makes no device "
                        "visible: %s",
                        (int)deviceId, g_visible_text, reason);
    } else if (g_visible_set) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_INVALID_DEVICEID,
                        "device id %d is not in [0, %d): ASCEND_RT_VISIBLE_DEVICES=\"%s\" makes %d of "
                        "the host's %d devices visible, numbered from 0",
                        (int)deviceId, g_device_count, g_visible_text, g_device_count,
                        g_host_devices);
    } else {
        aclemuSetErrMsg(api, ACL_ERROR_RT_INVALID_DEVICEID, "device id %d is not in [0, %d)",
                        (int)deviceId, g_device_count);
    }
    return ACL_ERROR_RT_INVALID_DEVICEID;
}

EMU_API int32_t aclemuVisibleDevice(int32_t deviceId) {
    pthread_mutex_lock(&g_lock);
    int32_t id = -1;
    if (!config_locked() && deviceId >= 0 && deviceId < g_device_count) id = g_visible[deviceId];
    pthread_mutex_unlock(&g_lock);
    return id;
}

int device_active_locked(int32_t d) {
    return d >= 0 && d < g_device_count && g_devices[d].refcount > 0;
}

int32_t current_device_locked(void) {
    const emu_context *c = emu_ht_get(&g_contexts, (const void *)tls_ctx);
    return c && device_active_locked(c->device) ? c->device : -1;
}

/* CANN's ApiImpl entries take the thread's current context (CurrentContext, api_impl.cc) and
 * refuse none with RT_ERROR_CONTEXT_NULL (107002); no default device is configured here
 * (aclInit's json is not read), so there is no implicit aclrtSetDevice. */
int require_device_locked(const char *api, int32_t *device) {
    int st = config_error_locked(api);
    if (st) return st;
    int32_t d = current_device_locked();
    if (d < 0) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_CONTEXT_NULL,
                        "no current device on this thread: call aclrtSetDevice first");
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
    if (device) *device = d;
    return 0;
}

EMU_API int aclemuRequireDevice(const char *api, int32_t *device) {
    pthread_mutex_lock(&g_lock);
    int st = require_device_locked(api, device);
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* CANN releases the default context, its streams and the device memory of the process once
 * the device's last reference goes. Queued work runs first, as the hardware would finish it. */
void device_teardown_locked(int32_t d) {
    emu_device *dev = &g_devices[d];
    /* Draining releases the lock: an aclrtSetDevice meanwhile must not open the device anew
     * only to have this teardown free its fresh context and default stream. */
    dev->closing = 1;
    drain_device_locked(d);
    event_release_all_of_device_locked(d);
    stream_release_all_of_device_locked(d);
    if (dev->default_stream) {
        dev->default_stream->dead = 1;
        stream_unref_locked(dev->default_stream);
        dev->default_stream = NULL;
    }
    if (dev->context) {
        emu_ht_remove(&g_contexts, (const void *)dev->context->handle);
        free(dev->context);
        dev->context = NULL;
    }
    release_device_blocks_locked(d);
    dev->used = 0; /* va_bump is kept: old pointers must not alias new blocks */
    dev->closing = 0;
    if (g_waiters) pthread_cond_broadcast(&g_cond); /* an aclrtSetDevice waiting for it */
}

EMU_API aclError aclrtGetDeviceCount(uint32_t *count) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (!count) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "count is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int st = config_error_locked(api);
    if (!st) st = visible_error_locked(api);
    if (!st) *count = (uint32_t)g_device_count;
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* The device's default context and stream, created when its count goes 0 -> 1. */
static int device_open_locked(const char *api, int32_t d) {
    emu_device *dev = &g_devices[d];
    size_t tried = 0;
    if (reserve_va_locked(dev, &tried)) {
        /* Under `ulimit -v` the cause is nearly always the capacity: say which knob to turn. */
        struct rlimit rl;
        char limit[64] = "none";
        if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
            snprintf(limit, sizeof limit, "%llu bytes", (unsigned long long)rl.rlim_cur);
        aclemuSetErrMsg(api, ACL_ERROR_RT_MEMORY_ALLOCATION,
                        "cannot reserve a device address range of %zu bytes for device %d's %zu "
                        "bytes of memory (the process's address-space limit, ulimit -v: %s); "
                        "lower PYACL_MOE_EMU_MEMORY",
                        tried, (int)d, g_capacity, limit);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    emu_context *c = calloc(1, sizeof *c);
    emu_stream *s = c ? stream_new_locked(d, 1) : NULL;
    if (!s || emu_ht_add(&g_contexts, c, &c->handle)) {
        if (s) stream_unref_locked(s);
        free(c);
        aclemuSetErrMsg(api, ACL_ERROR_RT_INTERNAL_ERROR, "out of host memory");
        return ACL_ERROR_RT_INTERNAL_ERROR;
    }
    c->device = d;
    dev->context = c;
    dev->default_stream = s;
    return 0;
}

EMU_API aclError aclrtSetDevice(int32_t deviceId) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    pthread_mutex_lock(&g_lock);
    int st;
    for (;;) { /* a device being released by its last reset is opened only once that is done */
        st = config_error_locked(api);
        if (!st && (deviceId < 0 || deviceId >= g_device_count))
            st = device_id_error_locked(api, deviceId);
        if (st || !g_devices[deviceId].closing) break;
        g_waiters++;
        pthread_cond_wait(&g_cond, &g_lock);
        g_waiters--;
    }
    if (!st && g_devices[deviceId].refcount == 0) st = device_open_locked(api, deviceId);
    if (!st) {
        g_devices[deviceId].refcount++;
        count_add(EMU_C_DEVICES_SET, 1);
        tls_ctx = g_devices[deviceId].context->handle;
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* No current context is 107002 returned silently (api_impl.cc ApiImpl::GetDevice,
 * COND_RETURN_WITH_NOLOG): no message is recorded for aclGetRecentErrMsg. */
EMU_API aclError aclrtGetDevice(int32_t *deviceId) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (!deviceId) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "deviceId is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int st = config_error_locked(api);
    int32_t d = st ? -1 : current_device_locked();
    if (!st && d < 0) st = ACL_ERROR_RT_CONTEXT_NULL;
    if (!st) *deviceId = d;
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtResetDevice(int32_t deviceId) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    pthread_mutex_lock(&g_lock);
    int st = config_error_locked(api);
    if (!st && (deviceId < 0 || deviceId >= g_device_count)) {
        st = device_id_error_locked(api, deviceId);
    } else if (!st && g_devices[deviceId].refcount == 0) {
        /* Runtime::PrimaryContextRelease: TryDecRef fails at count 0, RT_ERROR_CONTEXT_DEL. */
        st = ACL_ERROR_RT_CONTEXT_RELEASE_ERROR;
        aclemuSetErrMsg(api, st, "device %d is not set (more resets than aclrtSetDevice calls)",
                        (int)deviceId);
    }
    if (!st) {
        count_add(EMU_C_DEVICES_SET, -1);
        if (--g_devices[deviceId].refcount == 0) device_teardown_locked(deviceId);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* Context::Synchronize (context.cc): every stream of the context, in its list's order (the
 * order they were created), then the default stream; in continue-on-failure mode each stream's
 * synchronize reports and clears its fault, and the call returns the first. The message names
 * each stream's fault, the first one's first. */
EMU_API aclError aclrtSynchronizeDevice(void) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    pthread_mutex_lock(&g_lock);
    int32_t d = 0; /* set by require_device_locked; 0 keeps the error paths defined */
    int st = require_device_locked(api, &d);
    if (!st) {
        char msg[EMU_MSG_LEN], one[EMU_MSG_LEN];
        msg[0] = 0;
        emu_stream *def = g_devices[d].default_stream;
        def->refs++;
        drain_device_locked(d);
        for (;;) { /* the stream created first among those with a fault, then the default one */
            emu_stream *next = NULL;
            for (uint32_t i = 0; i < g_streams.n; i++) {
                emu_stream *s = emu_ht_at(&g_streams, i);
                if (s && s->device == d && s->pending_status && (!next || s->created < next->created))
                    next = s;
            }
            if (!next && def->pending_status) next = def;
            if (!next) break;
            int sst = take_pending_locked(next, one, sizeof one);
            size_t used = strlen(msg);
            if (!st) st = sst;
            if (used + 4 < sizeof msg)
                snprintf(msg + used, sizeof msg - used, "%s%s", used ? " | " : "", one);
        }
        stream_unref_locked(def);
        if (st) aclemuSetErrMsg(api, st, "%s", msg);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* ------------------------------------------------------------------ contexts */

EMU_API aclError aclrtSetCurrentContext(aclrtContext context) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (!context) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "context is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int st = config_error_locked(api);
    const emu_context *c = NULL;
    if (!st && !(c = emu_ht_get(&g_contexts, context))) {
        if (aclemuRelease() >= 90000) {
            /* ApiErrorDecorator::ContextSetCurrent (from v9.0.0): not in the live set,
             * RT_ERROR_INVALID_VALUE. */
            st = ACL_ERROR_RT_PARAM_INVALID;
            aclemuSetErrMsg(api, st,
                            "context %p is not a live context (its device was reset, or it never "
                            "existed)",
                            context);
        } else {
            /* v8.5.0 has no such check: the pointer becomes current, and the calls that need
             * a context then find none (107002). */
            tls_ctx = (uintptr_t)context;
        }
    } else if (!st) {
        tls_ctx = c->handle; /* no reference count changes: that is the point */
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtGetCurrentContext(aclrtContext *context) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (!context) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "context is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int st = config_error_locked(api);
    const emu_context *c = NULL;
    /* None is 107002, returned silently (ApiImpl::ContextGetCurrent, COND_RETURN_WITH_NOLOG): no
     * message. A context that died with its device counts as none here. */
    if (!st && !(c = emu_ht_get(&g_contexts, (const void *)tls_ctx))) st = ACL_ERROR_RT_CONTEXT_NULL;
    if (!st) *context = (aclrtContext)c->handle;
    pthread_mutex_unlock(&g_lock);
    return st;
}
