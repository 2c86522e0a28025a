/*
 * Emulated libascendcl.so, memory: device blocks in a PROT_NONE address range reserved per
 * device (a device pointer is never a valid host pointer), backed by host memory with guard
 * bytes on both sides; host blocks; synchronous and asynchronous copies and memsets.
 *
 * A task that touches device memory pins the block, so a concurrent aclrtFree cannot release
 * the backing store while the task still uses it.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "rt_internal.h"

/* ------------------------------------------------------------------ device memory */

emu_block *find_block_locked(uintptr_t addr, size_t *index) {
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

/* Whether [p, p + n) is mapped in this process. A host address the caller made up (a small
 * integer, a freed mapping) would otherwise take the process down inside memmove; msync with
 * MS_ASYNC does no I/O and fails with ENOMEM exactly when part of the range is unmapped. It
 * cannot see protections: a read-only page passed as a destination still faults, as it would
 * under CANN. */
static int host_range_mapped(uintptr_t p, size_t n) {
    if (n == 0) return 1;
    if (p + n < p) return 0;
    static size_t page;
    if (!page) page = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = p & ~(uintptr_t)(page - 1);
    return msync((void *)lo, p + n - lo, MS_ASYNC) == 0;
}

static emu_host_block *find_host_block_locked(uintptr_t p, size_t n) {
    for (size_t i = 0; i < g_nhost; i++) {
        uintptr_t a = (uintptr_t)g_host[i].ptr;
        if (p >= a && p - a <= g_host[i].size && n <= g_host[i].size - (p - a)) return &g_host[i];
    }
    return NULL;
}

static int guards_ok(const emu_block *b) {
    for (size_t i = 0; i < EMU_GUARD; i++)
        if (b->base[i] != EMU_GUARD_BYTE || b->base[EMU_GUARD + b->padded + i] != EMU_GUARD_BYTE)
            return 0;
    return 1;
}

void block_release_locked(emu_block *b) {
    emu_device *dev = &g_devices[b->device];
    dev->used -= b->padded;
    count_add(EMU_C_DEVICE_ALLOCATIONS, -1);
    count_add(EMU_C_DEVICE_BYTES, -((int64_t)b->size));
    b->freed = 1;
    if (b->pins == 0) {
        free(b->base);
        free(b);
    }
}

/* The device's address range. Without an address-space limit it is as large as the host allows
 * (1 TiB, halved until the mmap succeeds: a PROT_NONE, MAP_NORESERVE range costs no memory),
 * so that bump allocation goes a long way before addresses are reused. Under a limit
 * (RLIMIT_AS, `ulimit -v`) the range counts against it like any mapping, so it is sized from
 * the capacity: twice it plus 1 MiB, room for every block's alignment and guard gap, halved
 * when that does not fit, down to the capacity plus 1 MiB (or 16 GiB, the old floor, for a
 * larger capacity, which then runs out of addresses before it runs out of bytes). 0, or -1
 * with *tried the smallest size refused. */
int reserve_va_locked(emu_device *dev, size_t *tried) {
    if (dev->va_base) return 0;
    const size_t mib = (size_t)1 << 20, most = (size_t)1 << 40;
    size_t cap = (g_capacity + mib - 1) & ~(mib - 1);
    size_t least = cap + mib < ((size_t)16 << 30) ? cap + mib : (size_t)16 << 30;
    size_t want = most;
    struct rlimit rl;
    if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && cap < most / 2)
        want = 2 * cap + mib;
    if (want < least) want = least;
    for (size_t size = want;; size = size / 2 > least ? size / 2 : least) {
        void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p != MAP_FAILED) {
            dev->va_base = p;
            dev->va_size = size;
            dev->va_bump = EMU_VA_GAP;
            return 0;
        }
        if (size == least) break;
    }
    *tried = least;
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

EMU_API int aclemuPinMany(const uintptr_t *addr, const size_t *len, emu_pin *pins, int n, int32_t *owner) {
    int bad = -1;
    *owner = -1;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < n && bad < 0; i++) {
        int failed = pin_locked(addr[i], len[i], &pins[i]);
        /* A device's AI Cores reach their own device's memory only: another device's address
         * is not mapped there, whatever it holds. */
        if (!failed && g_task_device >= 0 && ((emu_block *)pins[i].block)->device != g_task_device) {
            *owner = ((emu_block *)pins[i].block)->device;
            unpin_locked(&pins[i]);
            failed = 1;
        }
        if (failed) {
            bad = i;
            while (i-- > 0) unpin_locked(&pins[i]);
        }
    }
    pthread_mutex_unlock(&g_lock);
    return bad;
}

EMU_API void aclemuUnpinMany(emu_pin *pins, int n) {
    if (n <= 0) return;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < n; i++) unpin_locked(&pins[i]);
    pthread_mutex_unlock(&g_lock);
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

/* ------------------------------------------------------------------ memory
 *
 * Each entry follows hicann/runtime v9.1.0 (src/acl/aclrt_impl/memory.cpp, then api_c.cc,
 * api_error.cc and api_impl.cc) and, where the runtime hands over, hicann/driver's svm code. */

/* devPtr NULL, then size 0: 100000 (aclMallocMemInner); the policy is not judged (a value CANN
 * does not name is its default; every policy is served from the same emulated HBM); no current
 * device 107002; more than is free 207001. A block is the size rounded up to 32 bytes plus 32
 * (CANN's rounding and padding: GetAlignedAndPaddingSize, padding 32 by default), and starts at
 * a multiple of 512 (CANN documents 64). */
EMU_API aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    EMU_ENTRY(ACL_ERROR_RT_MEMORY_ALLOCATION);
    (void)policy;
    if (!devPtr) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "devPtr is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    if (size == 0) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "size is 0");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int32_t d = -1;
    int st = require_device_locked(api, &d);
    size_t padded = ((size + 31) & ~(size_t)31) + 32;
    /* No device state is looked at before there is a device (without one, d is not one). */
    emu_device *dev = st ? NULL : &g_devices[d];
    uintptr_t addr = 0;
    emu_block *b = NULL;
    if (!st && (size > g_capacity || padded < size || padded > g_capacity - dev->used)) {
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
            count_add(EMU_C_DEVICE_ALLOCATIONS, 1);
            count_add(EMU_C_DEVICE_BYTES, (int64_t)size);
            count_add(EMU_C_MALLOCS_TOTAL, 1);
            *devPtr = (void *)addr;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* Whether the driver's heap exists: it is made when a device is first opened in the process. */
static int heap_ready_locked(void) {
    for (int d = 0; d < EMU_MAX_DEVICES; d++)
        if (g_devices[d].va_base) return 1;
    return 0;
}

/* NULL 100000 (memory.cpp); no current device needed (ApiImpl::DevFree falls back to the
 * driver); then the driver's halMemFree (hicann/driver src/ascend_hal/svm/v2/devmm/devmm_svm.c,
 * devmm_free_managed_nomal): no heap yet (no device ever opened) DRV_ERROR_INVALID_HANDLE, 107017;
 * an address that is not a live allocation (never allocated, freed already, released by the
 * device's reset, or not a block's start) DRV_ERROR_INVALID_VALUE, 107000 (svm v3's
 * svm_mem_free answers the same). A block whose guard bytes were overwritten is freed and 507053:
 * the emulator's own check. */
EMU_API aclError aclrtFree(void *devPtr) {
    EMU_ENTRY(ACL_ERROR_RT_PARAM_INVALID);
    if (!devPtr) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "devPtr is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int st = config_error_locked(api);
    size_t idx = 0;
    emu_block *b = NULL;
    if (!st && !heap_ready_locked()) {
        st = ACL_ERROR_RT_INVALID_HANDLE;
        aclemuSetErrMsg(api, st, "no device was ever opened in this process: there is no device heap to free %p from",
                        devPtr);
    } else if (!st) {
        b = find_block_locked((uintptr_t)devPtr, &idx);
        if (!b || b->addr != (uintptr_t)devPtr) {
            st = ACL_ERROR_RT_PARAM_INVALID;
            aclemuSetErrMsg(api, st,
                            "%p is not the start of a live device allocation (never allocated, "
                            "already freed, or freed by aclrtResetDevice)",
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
            count_add(EMU_C_GUARD_CORRUPTIONS, 1);
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

/* hostPtr NULL, then size 0: 100000; no current device 107002 (ApiImpl::HostMalloc); the size
 * is rounded up to 32 bytes, as CANN rounds it (the counters show the size asked for). */
EMU_API aclError aclrtMallocHost(void **hostPtr, size_t size) {
    EMU_ENTRY(ACL_ERROR_RT_MEMORY_ALLOCATION);
    if (!hostPtr || size == 0) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, hostPtr ? "size is 0" : "hostPtr is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int st = require_device_locked(api, NULL);
    size_t rounded = (size + 31) & ~(size_t)31;
    void *p = NULL;
    if (!st && (rounded < size || posix_memalign(&p, 64, rounded) ||
                grow((void **)&g_host, &g_cap_host, g_nhost + 1, sizeof *g_host))) {
        free(p);
        st = ACL_ERROR_RT_MEMORY_ALLOCATION;
        aclemuSetErrMsg(api, st, "cannot allocate %zu bytes of host memory", size);
    } else if (!st) {
        g_host[g_nhost].ptr = p;
        g_host[g_nhost].size = size;
        g_nhost++;
        count_add(EMU_C_HOST_ALLOCATIONS, 1);
        count_add(EMU_C_HOST_BYTES, (int64_t)size);
        *hostPtr = p;
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* NULL 100000; no current device needed; device memory 107000 (ApiImpl::HostFree: the location
 * must be host); anything else that is not a live block of aclrtMallocHost (never allocated,
 * freed already) 107000, the driver's answer for an address it did not allocate. */
EMU_API aclError aclrtFreeHost(void *hostPtr) {
    EMU_ENTRY(ACL_ERROR_RT_PARAM_INVALID);
    if (!hostPtr) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "hostPtr is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int st = config_error_locked(api);
    if (!st && in_device_va_locked((uintptr_t)hostPtr)) {
        st = ACL_ERROR_RT_PARAM_INVALID;
        aclemuSetErrMsg(api, st, "%p is device memory, not host memory", hostPtr);
    } else if (!st) {
        size_t i = 0;
        while (i < g_nhost && g_host[i].ptr != hostPtr) i++;
        if (i == g_nhost) {
            st = ACL_ERROR_RT_PARAM_INVALID;
            aclemuSetErrMsg(api, st, "%p was not returned by aclrtMallocHost or is already freed",
                            hostPtr);
        } else {
            free(g_host[i].ptr);
            count_add(EMU_C_HOST_ALLOCATIONS, -1);
            count_add(EMU_C_HOST_BYTES, -((int64_t)g_host[i].size));
            g_host[i] = g_host[--g_nhost];
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* ------------------------------------------------------------------ copies and memsets */

/* count 0 is success before any other check from 9.1 (commit 93f9f113d, first in v9.1.0.pre:
 * memory.cpp and api_c.cc return at once); up to 9.0 it reaches the runtime's checks, 107000. */
static int count_zero_is_success(void) { return aclemuRelease() >= 90100; }

#define COPY_DONE (-1) /* the checks found nothing to do: success */

/* Where a copy goes: each side is checked against the kind and against live allocations. */
typedef struct copy_plan {
    int dst_dev, src_dev;
} copy_plan;

/* The ACL layer's checks of aclrtMemcpy and aclrtMemcpyAsync (memory.cpp): count 0 (9.1), dst,
 * src, then the kind (MemcpyKindTranslate: the four directions, DEFAULT and
 * HOST_TO_BUF_TO_DEVICE; INNER/INTER_DEVICE_TO_DEVICE and anything else 100000). */
static int copy_acl_checks(const char *api, void *dst, const void *src, size_t count, aclrtMemcpyKind kind) {
    if (count == 0 && count_zero_is_success()) return COPY_DONE;
    if (!dst || !src) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "%s is NULL", dst ? "src" : "dst");
        return ACL_ERROR_INVALID_PARAM;
    }
    if ((int)kind < ACL_MEMCPY_HOST_TO_HOST || (int)kind > ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "copy kind %d is not supported", (int)kind);
        return ACL_ERROR_INVALID_PARAM;
    }
    return 0;
}

/* The runtime's count checks (ApiErrorDecorator::MemCopySync, MemcpyAsync): for the synchronous
 * copy destMax 0, then count 0 (reached before 9.1 only), then count above destMax, all 107000,
 * then dst == src: success without a copy; the asynchronous one checks count 0 and count above
 * destMax (dst == src comes later, after the current device and the addresses). */
static int copy_count_checks(const char *api, int sync, void *dst, size_t destMax, const void *src, size_t count) {
    if (sync && destMax == 0) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_PARAM_INVALID, "destMax is 0");
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    if (count == 0) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_PARAM_INVALID, "count is 0 (this release refuses an empty copy)");
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    if (count > destMax) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_PARAM_INVALID, "count %zu exceeds destMax %zu", count, destMax);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    if (sync && dst == src) return COPY_DONE;
    return 0;
}

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
    } else if (!host_range_mapped(p, count)) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_PARAM_INVALID,
                        "%s [%p, +%zu) is neither device memory nor mapped host memory", what,
                        (void *)p, count);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    return 0;
}

/* The emulator's checks of the addresses (CANN's driver does the copy and answers for them):
 * each side must be what the kind says, device memory inside one live block, host memory
 * mapped; 107000 otherwise. DEFAULT takes each side from its address. */
static int plan_copy_locked(const char *api, void *dst, const void *src, size_t count,
                            aclrtMemcpyKind kind, copy_plan *plan) {
    switch (kind) {
    case ACL_MEMCPY_HOST_TO_HOST: plan->dst_dev = 0; plan->src_dev = 0; break;
    case ACL_MEMCPY_HOST_TO_DEVICE:
    case ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE: plan->dst_dev = 1; plan->src_dev = 0; break;
    case ACL_MEMCPY_DEVICE_TO_HOST: plan->dst_dev = 0; plan->src_dev = 1; break;
    case ACL_MEMCPY_DEVICE_TO_DEVICE: plan->dst_dev = 1; plan->src_dev = 1; break;
    default: /* ACL_MEMCPY_DEFAULT (copy_acl_checks refused the rest) */
        plan->dst_dev = in_device_va_locked((uintptr_t)dst);
        plan->src_dev = in_device_va_locked((uintptr_t)src);
        break;
    }
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

/* count 0 (9.1: success); dst, src NULL, bad kind 100000; destMax 0, count 0 (before 9.1),
 * count above destMax 107000; dst == src: success, nothing copied; no current device 107002;
 * then the addresses (107000). Waits for no stream. */
EMU_API aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
                             aclrtMemcpyKind kind) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    int st = copy_acl_checks(api, dst, src, count, kind);
    if (st) return st == COPY_DONE ? 0 : st;
    pthread_mutex_lock(&g_lock);
    copy_plan plan;
    st = config_error_locked(api);
    if (!st) st = copy_count_checks(api, 1, dst, destMax, src, count);
    int done = st == COPY_DONE;
    if (done) st = 0;
    if (!st && !done) st = require_device_locked(api, NULL);
    if (!st && !done) st = plan_copy_locked(api, dst, src, count, kind, &plan);
    emu_pin pd, ps;
    void *hd;
    const void *hs;
    if (!st && !done && pin_copy_locked((uintptr_t)dst, (uintptr_t)src, count, &plan, &pd, &ps, &hd, &hs)) {
        st = ACL_ERROR_RT_PARAM_INVALID;
        aclemuSetErrMsg(api, st, "device memory vanished during the copy");
    }
    pthread_mutex_unlock(&g_lock);
    /* A synchronous copy waits for no stream, as on hardware: it sees memory as it is now. */
    if (!st && !done) {
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
    /* Host memory is touched when the stream runs the task: it may have been unmapped since
     * the call was checked. */
    if (!bad && ((!c->plan.dst_dev && !host_range_mapped(c->dst, c->count)) ||
                 (!c->is_set && !c->plan.src_dev && !host_range_mapped(c->src, c->count)))) {
        pthread_mutex_lock(&g_lock);
        unpin_locked(&pd);
        unpin_locked(&ps);
        pthread_mutex_unlock(&g_lock);
        snprintf(msg, len,
                 "device fault: an asynchronous %s of %zu bytes found its host memory unmapped "
                 "when the stream ran it",
                 c->is_set ? "memset" : "memcpy", c->count);
        return ACL_ERROR_RT_SYS_DMA;
    }
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

/* A stream handle that is not a live stream: 107017 (validated before the runtime's checks). */
static int stream_handle_locked(const char *api, aclrtStream stream) {
    if (!stream || emu_ht_get(&g_streams, stream)) return 0;
    aclemuSetErrMsg(api, ACL_ERROR_RT_INVALID_HANDLE,
                    "stream %p is not a live stream (destroyed, or never created)", stream);
    return ACL_ERROR_RT_INVALID_HANDLE;
}

/* count 0 (9.1: success); dst, src NULL, bad kind 100000; the stream not live 107017; count 0
 * (before 9.1), count above destMax 107000; no current device 107002; the addresses 107000;
 * dst == src: success, nothing queued; another device's stream 107003 (NULL: the default
 * stream). Host memory is read or written when the stream runs the task (CANN's copy from
 * pageable memory, done at once after a stream synchronize, is not modelled). */
EMU_API aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                                  aclrtMemcpyKind kind, aclrtStream stream) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    int st = copy_acl_checks(api, dst, src, count, kind);
    if (st) return st == COPY_DONE ? 0 : st;
    pthread_mutex_lock(&g_lock);
    int32_t d = 0;
    copy_plan plan;
    emu_stream *s = NULL;
    st = config_error_locked(api);
    if (!st) st = stream_handle_locked(api, stream);
    if (!st) st = copy_count_checks(api, 0, dst, destMax, src, count);
    if (!st) st = stream_arg_locked(api, stream, 0, &d, &s);
    if (!st) st = plan_copy_locked(api, dst, src, count, kind, &plan);
    if (!st && dst != src && s->device != d) st = resolve_stream_locked(api, stream, d, &s); /* 107003 */
    if (!st && dst != src) {
        copy_payload *c = calloc(1, sizeof *c);
        if (c) { /* host memory is read or written when the stream runs, not now */
            c->dst = (uintptr_t)dst;
            c->src = (uintptr_t)src;
            c->count = count;
            c->plan = plan;
        }
        st = enqueue_status(api, c ? enqueue_locked(s, copy_run, copy_release, c) : -1);
        if (st) free(c);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* The emulator's checks of a memset's address. The runtime decides host or device from the
 * address; host memory must be a block of aclrtMallocHost here: any other address is refused
 * (107000), as a made-up one would crash the host. */
static int plan_set_locked(const char *api, void *devPtr, size_t count, copy_plan *plan) {
    plan->dst_dev = in_device_va_locked((uintptr_t)devPtr);
    plan->src_dev = 0;
    if (!plan->dst_dev && !find_host_block_locked((uintptr_t)devPtr, count)) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_PARAM_INVALID,
                        "devPtr [%p, +%zu) is not device memory (nor host memory from "
                        "aclrtMallocHost)",
                        devPtr, count);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    return check_side_locked(api, "devPtr", (uintptr_t)devPtr, count, plan->dst_dev);
}

static int set_count_checks(const char *api, size_t maxCount, size_t count, int check_max) {
    if (count == 0) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_PARAM_INVALID, "count is 0 (this release refuses an empty memset)");
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    if (check_max && count > maxCount) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_PARAM_INVALID, "count %zu exceeds maxCount %zu", count, maxCount);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    return 0;
}

/* count 0 (9.1: success); devPtr NULL 100000; count 0 (before 9.1) 107000; no current device
 * 107002; then the driver (drvMemsetD8, hicann/driver svm v2 devmm_svm.c and v3 svm_set.c):
 * count above maxCount DRV_ERROR_INVALID_VALUE, 107000; the address 107000. The value is
 * truncated to a byte. */
EMU_API aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (count == 0 && count_zero_is_success()) return 0;
    if (!devPtr) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "devPtr is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    copy_plan plan;
    int st = config_error_locked(api);
    if (!st) st = set_count_checks(api, maxCount, count, 0);
    if (!st) st = require_device_locked(api, NULL);
    if (!st) st = set_count_checks(api, maxCount, count, 1);
    if (!st) st = plan_set_locked(api, devPtr, count, &plan);
    pthread_mutex_unlock(&g_lock);
    if (!st) {
        copy_payload c = {(uintptr_t)devPtr, 0, count, value, 1, plan};
        char msg[EMU_MSG_LEN];
        st = copy_run(&c, msg, sizeof msg);
        if (st) aclemuSetErrMsg(api, st, "%s", msg);
    }
    return st;
}

/* count 0 (9.1: success); devPtr NULL 100000; the stream not live 107017; count 0 (before
 * 9.1), count above maxCount 107000 (ApiErrorDecorator::MemsetAsync); no current device 107002;
 * another device's stream 107003 (NULL: the default stream); the address 107000. */
EMU_API aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count,
                                  aclrtStream stream) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (count == 0 && count_zero_is_success()) return 0;
    if (!devPtr) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "devPtr is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int32_t d = 0;
    copy_plan plan;
    emu_stream *s = NULL;
    int st = config_error_locked(api);
    if (!st) st = stream_handle_locked(api, stream);
    if (!st) st = set_count_checks(api, maxCount, count, 1);
    if (!st) st = stream_arg_locked(api, stream, 1, &d, &s);
    if (!st) st = plan_set_locked(api, devPtr, count, &plan);
    if (!st) {
        copy_payload *c = calloc(1, sizeof *c);
        if (c) {
            c->dst = (uintptr_t)devPtr;
            c->count = count;
            c->value = value;
            c->is_set = 1;
            c->plan = plan;
        }
        st = enqueue_status(api, c ? enqueue_locked(s, copy_run, copy_release, c) : -1);
        if (st) free(c);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* free, then total, NULL 100000; attr outside the runtime's rtMemInfoType range 107016
 * (ApiErrorDecorator::MemGetInfoEx: [0, 17] from 9.0, whose headers add ACL_MEM_NORMAL to
 * ACL_MEM_P2P_HUGE1G; [0, 11] up to 8.5); no current device 107002. The emulated chip, like
 * Atlas A2, has HBM only: DDR attributes report 0, the others the device's HBM. */
EMU_API aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free_bytes, size_t *total) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (!free_bytes || !total) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "%s is NULL", !free_bytes ? "free" : "total");
        return ACL_ERROR_INVALID_PARAM;
    }
    int last = aclemuRelease() >= 90000 ? 17 : ACL_HBM_MEM_P2P_HUGE1G;
    if ((int)attr < ACL_DDR_MEM || (int)attr > last) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_INVALID_MEMORY_TYPE, "attr %d is not in [0, %d]", (int)attr, last);
        return ACL_ERROR_RT_INVALID_MEMORY_TYPE;
    }
    pthread_mutex_lock(&g_lock);
    int32_t d = 0; /* set by require_device_locked; 0 keeps the error paths defined */
    int st = require_device_locked(api, &d);
    if (!st) {
        int is_ddr = attr == ACL_DDR_MEM || attr == ACL_DDR_MEM_HUGE || attr == ACL_DDR_MEM_NORMAL ||
                     attr == ACL_DDR_MEM_P2P_HUGE || attr == ACL_DDR_MEM_P2P_NORMAL;
        *total = is_ddr ? 0 : g_capacity;
        *free_bytes = is_ddr ? 0 : g_capacity - g_devices[d].used;
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* ------------------------------------------------------------------ release in bulk */

/* Every block of device d (its last reset). Host blocks are never released in bulk: neither a
 * reset nor aclFinalize frees them. */
void release_device_blocks_locked(int32_t d) {
    size_t keep = 0;
    for (size_t i = 0; i < g_nblocks; i++) {
        emu_block *b = g_blocks[i];
        if (b->device == d) block_release_locked(b);
        else g_blocks[keep++] = b;
    }
    g_nblocks = keep;
}
