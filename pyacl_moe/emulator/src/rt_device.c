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
        if (!st && (deviceId < 0 || deviceId >= g_device_count)) {
            st = ACL_ERROR_RT_INVALID_DEVICEID;
            aclemuSetErrMsg(api, st, "device id %d is not in [0, %d)", (int)deviceId,
                            g_device_count);
        }
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
        st = ACL_ERROR_RT_INVALID_DEVICEID;
        aclemuSetErrMsg(api, st, "device id %d is not in [0, %d)", (int)deviceId, g_device_count);
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
