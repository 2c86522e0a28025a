/*
 * Emulated libnnopbase.so: aclTensor, aclScalar, aclIntArray and the executor objects the op
 * library hands out. Handles are checked against a registry, so a stale or foreign pointer is
 * an error status instead of a crash.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "emu.h"

#define TENSOR_MAGIC 0x54454e53U
#define SCALAR_MAGIC 0x5343414cU
#define INTARR_MAGIC 0x494e5441U
#define EXEC_MAGIC 0x45584543U

struct aclTensor {
    uint32_t magic;
    aclDataType dtype;
    aclFormat format;
    uint64_t ndim;
    int64_t *view;
    int64_t *strides;
    int64_t offset;
    uint64_t storage_ndim;
    int64_t *storage;
    void *data;
};

struct aclScalar {
    uint32_t magic;
    aclDataType dtype;
    unsigned char value[16];
};

struct aclIntArray {
    uint32_t magic;
    uint64_t size;
    int64_t *values;
};

struct aclOpExecutor {
    uint32_t magic;
    emu_executor_info info;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

/* ------------------------------------------------------------------ handle registry */

/* Open-addressing set of live handles; deletions leave tombstones, rebuilt when they pile up. */
typedef struct handle_set {
    uintptr_t *slots;
    size_t cap, used, tomb;
} handle_set;

#define SLOT_EMPTY ((uintptr_t)0)
#define SLOT_TOMB ((uintptr_t)1)

static size_t hash_ptr(uintptr_t p, size_t cap) {
    uint64_t x = (uint64_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x & (cap - 1);
}

static int set_contains(const handle_set *s, const void *p) {
    if (!s->cap || !p) return 0;
    for (size_t i = hash_ptr((uintptr_t)p, s->cap);; i = (i + 1) & (s->cap - 1)) {
        if (s->slots[i] == SLOT_EMPTY) return 0;
        if (s->slots[i] == (uintptr_t)p) return 1;
    }
}

static int set_rehash(handle_set *s, size_t ncap) {
    uintptr_t *old = s->slots;
    size_t ocap = s->cap;
    uintptr_t *slots = calloc(ncap, sizeof *slots);
    if (!slots) return -1;
    s->slots = slots;
    s->cap = ncap;
    s->used = s->tomb = 0;
    for (size_t i = 0; i < ocap; i++) {
        uintptr_t p = old[i];
        if (p == SLOT_EMPTY || p == SLOT_TOMB) continue;
        size_t j = hash_ptr(p, ncap);
        while (slots[j] != SLOT_EMPTY) j = (j + 1) & (ncap - 1);
        slots[j] = p;
        s->used++;
    }
    free(old);
    return 0;
}

static int set_add(handle_set *s, const void *p) {
    if ((s->used + s->tomb + 1) * 2 > s->cap) {
        size_t ncap = s->cap ? s->cap : 64;
        while ((s->used + 1) * 2 > ncap) ncap *= 2;
        if (set_rehash(s, ncap * (s->used * 4 > ncap ? 2 : 1))) return -1;
    }
    size_t i = hash_ptr((uintptr_t)p, s->cap);
    while (s->slots[i] != SLOT_EMPTY && s->slots[i] != SLOT_TOMB) i = (i + 1) & (s->cap - 1);
    if (s->slots[i] == SLOT_TOMB) s->tomb--;
    s->slots[i] = (uintptr_t)p;
    s->used++;
    return 0;
}

static int set_remove(handle_set *s, const void *p) {
    if (!s->cap || !p) return 0;
    for (size_t i = hash_ptr((uintptr_t)p, s->cap);; i = (i + 1) & (s->cap - 1)) {
        if (s->slots[i] == SLOT_EMPTY) return 0;
        if (s->slots[i] == (uintptr_t)p) {
            s->slots[i] = SLOT_TOMB;
            s->used--;
            s->tomb++;
            return 1;
        }
    }
}

static handle_set g_tensors, g_scalars, g_arrays, g_executors;

/* ------------------------------------------------------------------ tensors */

static void tensor_free(struct aclTensor *t) {
    t->magic = 0;
    free(t->view);
    free(t->strides);
    free(t->storage);
    free(t);
}

EMU_API aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum,
                                   aclDataType dataType, const int64_t *stride, int64_t offset,
                                   aclFormat format, const int64_t *storageDims,
                                   uint64_t storageDimsNum, void *tensorData) {
    static const char *api = "aclCreateTensor";
    if (aclemuFaultPoint(api, ACLNN_ERR_INNER)) return NULL;
    if (viewDimsNum > EMU_MAX_DIMS || storageDimsNum > EMU_MAX_DIMS) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, "at most %d dimensions are supported",
                        EMU_MAX_DIMS);
        return NULL;
    }
    if ((!viewDims && viewDimsNum) || (!storageDims && storageDimsNum)) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR, "%s is NULL but its length is not 0",
                        viewDims ? "storageDims" : "viewDims");
        return NULL;
    }
    if (offset < 0) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, "offset %lld is negative", (long long)offset);
        return NULL;
    }
    struct aclTensor *t = calloc(1, sizeof *t);
    size_t vn = viewDimsNum ? viewDimsNum : 1, sn = storageDimsNum ? storageDimsNum : 1;
    if (t) {
        t->view = calloc(vn, sizeof(int64_t));
        t->strides = calloc(vn, sizeof(int64_t));
        t->storage = calloc(sn, sizeof(int64_t));
    }
    if (!t || !t->view || !t->strides || !t->storage) {
        if (t) tensor_free(t);
        aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        return NULL;
    }
    t->magic = TENSOR_MAGIC;
    t->dtype = dataType;
    t->format = format;
    t->ndim = viewDimsNum;
    t->offset = offset;
    t->storage_ndim = storageDimsNum;
    t->data = tensorData;
    if (viewDimsNum) memcpy(t->view, viewDims, viewDimsNum * sizeof(int64_t));
    if (storageDimsNum) memcpy(t->storage, storageDims, storageDimsNum * sizeof(int64_t));
    if (stride) {
        if (viewDimsNum) memcpy(t->strides, stride, viewDimsNum * sizeof(int64_t));
    } else { /* no strides given: the view is contiguous */
        int64_t acc = 1;
        for (uint64_t i = viewDimsNum; i-- > 0;) {
            t->strides[i] = acc;
            acc *= viewDims[i] > 0 ? viewDims[i] : 1;
        }
    }
    pthread_mutex_lock(&g_lock);
    int bad = set_add(&g_tensors, t);
    pthread_mutex_unlock(&g_lock);
    if (bad) {
        tensor_free(t);
        aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        return NULL;
    }
    aclemuCountAdd(EMU_C_TENSORS, 1);
    return t;
}

EMU_API aclnnStatus aclDestroyTensor(const aclTensor *tensor) {
    static const char *api = "aclDestroyTensor";
    int f = aclemuFaultPoint(api, ACLNN_ERR_INNER);
    if (f) return f;
    if (!tensor) return ACLNN_SUCCESS; /* destroying nothing is allowed, as with free(NULL) */
    pthread_mutex_lock(&g_lock);
    int live = set_remove(&g_tensors, tensor);
    pthread_mutex_unlock(&g_lock);
    if (!live) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID,
                        "%p is not a live aclTensor (already destroyed, or never created)",
                        (const void *)tensor);
        return ACLNN_ERR_PARAM_INVALID;
    }
    tensor_free((struct aclTensor *)tensor);
    aclemuCountAdd(EMU_C_TENSORS, -1);
    return ACLNN_SUCCESS;
}

/* The live tensor behind a handle; the caller holds the lock. */
static int tensor_get(const char *api, const aclTensor *tensor, struct aclTensor **out) {
    if (!tensor) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR, "tensor is NULL");
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    if (!set_contains(&g_tensors, tensor)) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, "%p is not a live aclTensor",
                        (const void *)tensor);
        return ACLNN_ERR_PARAM_INVALID;
    }
    *out = (struct aclTensor *)tensor;
    return 0;
}

EMU_API int aclemuTensorDesc(const aclTensor *tensor, emu_tensor_desc *out) {
    pthread_mutex_lock(&g_lock);
    int st = set_contains(&g_tensors, tensor) ? 0 : -1;
    if (!st) {
        const struct aclTensor *t = tensor;
        memset(out, 0, sizeof *out);
        out->dtype = t->dtype;
        out->format = t->format;
        out->ndim = (int64_t)t->ndim;
        if (t->ndim > EMU_OP_MAX_DIMS) {
            st = -2;
        } else {
            memcpy(out->shape, t->view, t->ndim * sizeof(int64_t));
            memcpy(out->strides, t->strides, t->ndim * sizeof(int64_t));
        }
        out->offset = t->offset;
        out->addr = (uintptr_t)t->data;
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* Copy `n` dims into a malloc'd array the caller frees (CANN hands these arrays to the caller). */
static int dims_out(const char *api, const int64_t *src, uint64_t n, int64_t **dst,
                    uint64_t *dst_n) {
    int64_t *a = malloc((n ? n : 1) * sizeof(int64_t));
    if (!a) {
        aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        return ACLNN_ERR_INNER;
    }
    if (n) memcpy(a, src, n * sizeof(int64_t));
    *dst = a;
    *dst_n = n;
    return 0;
}

typedef enum { DIMS_VIEW, DIMS_STORAGE, DIMS_STRIDES } dims_kind;

static aclnnStatus get_dims(const char *api, const aclTensor *tensor, int64_t **dims,
                            uint64_t *num, dims_kind kind) {
    int f = aclemuFaultPoint(api, ACLNN_ERR_INNER);
    if (f) return f;
    if (!dims || !num) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR, "an output pointer is NULL");
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    pthread_mutex_lock(&g_lock);
    struct aclTensor *t;
    int st = tensor_get(api, tensor, &t);
    if (!st) {
        if (kind == DIMS_VIEW) st = dims_out(api, t->view, t->ndim, dims, num);
        else if (kind == DIMS_STRIDES) st = dims_out(api, t->strides, t->ndim, dims, num);
        else st = dims_out(api, t->storage, t->storage_ndim, dims, num);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclnnStatus aclGetViewShape(const aclTensor *tensor, int64_t **viewDims,
                                    uint64_t *viewDimsNum) {
    return get_dims("aclGetViewShape", tensor, viewDims, viewDimsNum, DIMS_VIEW);
}

EMU_API aclnnStatus aclGetStorageShape(const aclTensor *tensor, int64_t **storageDims,
                                       uint64_t *storageDimsNum) {
    return get_dims("aclGetStorageShape", tensor, storageDims, storageDimsNum, DIMS_STORAGE);
}

EMU_API aclnnStatus aclGetViewStrides(const aclTensor *tensor, int64_t **stridesValue,
                                      uint64_t *stridesNum) {
    return get_dims("aclGetViewStrides", tensor, stridesValue, stridesNum, DIMS_STRIDES);
}

/* One scalar field of a live tensor, copied out under the lock. */
#define TENSOR_FIELD_GETTER(name, type, expr)                                             \
    EMU_API aclnnStatus name(const aclTensor *tensor, type *value) {                      \
        int f = aclemuFaultPoint(#name, ACLNN_ERR_INNER);                                 \
        if (f) return f;                                                                  \
        if (!value) {                                                                     \
            aclemuSetErrMsg(#name, ACLNN_ERR_PARAM_NULLPTR, "the output pointer is NULL"); \
            return ACLNN_ERR_PARAM_NULLPTR;                                               \
        }                                                                                 \
        pthread_mutex_lock(&g_lock);                                                      \
        struct aclTensor *t;                                                              \
        int st = tensor_get(#name, tensor, &t);                                           \
        if (!st) *value = (expr);                                                         \
        pthread_mutex_unlock(&g_lock);                                                    \
        return st;                                                                        \
    }

TENSOR_FIELD_GETTER(aclGetViewOffset, int64_t, t->offset)
TENSOR_FIELD_GETTER(aclGetFormat, aclFormat, t->format)
TENSOR_FIELD_GETTER(aclGetDataType, aclDataType, t->dtype)
TENSOR_FIELD_GETTER(aclGetRawTensorAddr, void *, t->data)

EMU_API aclnnStatus aclSetRawTensorAddr(aclTensor *tensor, void *addr) {
    static const char *api = "aclSetRawTensorAddr";
    int f = aclemuFaultPoint(api, ACLNN_ERR_INNER);
    if (f) return f;
    pthread_mutex_lock(&g_lock);
    struct aclTensor *t;
    int st = tensor_get(api, tensor, &t);
    if (!st) t->data = addr;
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* ------------------------------------------------------------------ scalars and int arrays */

static size_t dtype_size(aclDataType dt) {
    switch (dt) {
    case ACL_INT8: case ACL_UINT8: case ACL_BOOL: return 1;
    case ACL_FLOAT16: case ACL_BF16: case ACL_INT16: case ACL_UINT16: return 2;
    case ACL_FLOAT: case ACL_INT32: case ACL_UINT32: case ACL_COMPLEX32: return 4;
    case ACL_INT64: case ACL_UINT64: case ACL_DOUBLE: case ACL_COMPLEX64: return 8;
    case ACL_COMPLEX128: return 16;
    default: return 0;
    }
}

EMU_API aclScalar *aclCreateScalar(void *value, aclDataType dataType) {
    static const char *api = "aclCreateScalar";
    if (aclemuFaultPoint(api, ACLNN_ERR_INNER)) return NULL;
    size_t n = dtype_size(dataType);
    if (!value || !n) {
        aclemuSetErrMsg(api, value ? ACLNN_ERR_PARAM_INVALID : ACLNN_ERR_PARAM_NULLPTR,
                        value ? "data type %d has no scalar form" : "value is NULL",
                        (int)dataType);
        return NULL;
    }
    struct aclScalar *s = calloc(1, sizeof *s);
    if (!s) {
        aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        return NULL;
    }
    s->magic = SCALAR_MAGIC;
    s->dtype = dataType;
    memcpy(s->value, value, n);
    pthread_mutex_lock(&g_lock);
    int bad = set_add(&g_scalars, s);
    pthread_mutex_unlock(&g_lock);
    if (bad) {
        free(s);
        aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        return NULL;
    }
    aclemuCountAdd(EMU_C_SCALARS, 1);
    return s;
}

EMU_API aclnnStatus aclDestroyScalar(const aclScalar *scalar) {
    static const char *api = "aclDestroyScalar";
    int f = aclemuFaultPoint(api, ACLNN_ERR_INNER);
    if (f) return f;
    if (!scalar) return ACLNN_SUCCESS;
    pthread_mutex_lock(&g_lock);
    int live = set_remove(&g_scalars, scalar);
    pthread_mutex_unlock(&g_lock);
    if (!live) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, "%p is not a live aclScalar",
                        (const void *)scalar);
        return ACLNN_ERR_PARAM_INVALID;
    }
    ((struct aclScalar *)scalar)->magic = 0;
    free((void *)scalar);
    aclemuCountAdd(EMU_C_SCALARS, -1);
    return ACLNN_SUCCESS;
}

EMU_API aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size) {
    static const char *api = "aclCreateIntArray";
    if (aclemuFaultPoint(api, ACLNN_ERR_INNER)) return NULL;
    if (!value && size) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR, "value is NULL but size is %llu",
                        (unsigned long long)size);
        return NULL;
    }
    if (size > ((uint64_t)1 << 32)) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, "size %llu is too large",
                        (unsigned long long)size);
        return NULL;
    }
    struct aclIntArray *a = calloc(1, sizeof *a);
    if (a) a->values = malloc((size ? size : 1) * sizeof(int64_t));
    if (!a || !a->values) {
        if (a) free(a);
        aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        return NULL;
    }
    a->magic = INTARR_MAGIC;
    a->size = size;
    if (size) memcpy(a->values, value, size * sizeof(int64_t));
    pthread_mutex_lock(&g_lock);
    int bad = set_add(&g_arrays, a);
    pthread_mutex_unlock(&g_lock);
    if (bad) {
        free(a->values);
        free(a);
        aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        return NULL;
    }
    aclemuCountAdd(EMU_C_INT_ARRAYS, 1);
    return a;
}

EMU_API aclnnStatus aclDestroyIntArray(const aclIntArray *array) {
    static const char *api = "aclDestroyIntArray";
    int f = aclemuFaultPoint(api, ACLNN_ERR_INNER);
    if (f) return f;
    if (!array) return ACLNN_SUCCESS;
    pthread_mutex_lock(&g_lock);
    int live = set_remove(&g_arrays, array);
    pthread_mutex_unlock(&g_lock);
    if (!live) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, "%p is not a live aclIntArray",
                        (const void *)array);
        return ACLNN_ERR_PARAM_INVALID;
    }
    struct aclIntArray *a = (struct aclIntArray *)array;
    a->magic = 0;
    free(a->values);
    free(a);
    aclemuCountAdd(EMU_C_INT_ARRAYS, -1);
    return ACLNN_SUCCESS;
}

/* ------------------------------------------------------------------ executors */

static void executor_free(struct aclOpExecutor *ex) {
    if (ex->info.op_free) ex->info.op_free(ex->info.op_data);
    ex->magic = 0;
    free(ex);
    aclemuCountAdd(EMU_C_EXECUTORS, -1);
}

EMU_API aclOpExecutor *aclemuExecutorCreate(const emu_executor_info *info) {
    struct aclOpExecutor *ex = calloc(1, sizeof *ex);
    if (!ex) return NULL;
    ex->magic = EXEC_MAGIC;
    ex->info = *info;
    pthread_mutex_lock(&g_lock);
    int bad = set_add(&g_executors, ex);
    pthread_mutex_unlock(&g_lock);
    if (bad) {
        free(ex);
        return NULL;
    }
    aclemuCountAdd(EMU_C_EXECUTORS, 1);
    return ex;
}

static const char *const k_dead_executor =
    "%p is not a live aclOpExecutor: it was destroyed, or it was a one-shot executor that a "
    "launch already consumed (call aclSetAclOpExecutorRepeatable to launch it again)";

EMU_API int aclemuExecutorAcquire(const char *api, aclOpExecutor *ex, emu_executor_info *info,
                                  int consume) {
    pthread_mutex_lock(&g_lock);
    int live = set_contains(&g_executors, ex);
    if (live) {
        *info = ex->info;
        if (consume && !ex->info.repeatable) set_remove(&g_executors, ex);
    }
    pthread_mutex_unlock(&g_lock);
    if (!live) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, k_dead_executor, (void *)ex);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return 0;
}

EMU_API void aclemuExecutorRelease(aclOpExecutor *ex) {
    pthread_mutex_lock(&g_lock);
    int still_registered = set_contains(&g_executors, ex);
    pthread_mutex_unlock(&g_lock);
    if (!still_registered) executor_free(ex);
}

EMU_API aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor *executor) {
    static const char *api = "aclSetAclOpExecutorRepeatable";
    int f = aclemuFaultPoint(api, ACLNN_ERR_INNER);
    if (f) return f;
    if (!executor) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR, "executor is NULL");
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    pthread_mutex_lock(&g_lock);
    int live = set_contains(&g_executors, executor);
    if (live) executor->info.repeatable = 1;
    pthread_mutex_unlock(&g_lock);
    if (!live) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, k_dead_executor, (void *)executor);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return ACLNN_SUCCESS;
}

EMU_API aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor) {
    static const char *api = "aclDestroyAclOpExecutor";
    int f = aclemuFaultPoint(api, ACLNN_ERR_INNER);
    if (f) return f;
    if (!executor) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR, "executor is NULL");
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    pthread_mutex_lock(&g_lock);
    int live = set_remove(&g_executors, executor);
    pthread_mutex_unlock(&g_lock);
    if (!live) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, k_dead_executor, (void *)executor);
        return ACLNN_ERR_PARAM_INVALID;
    }
    executor_free(executor);
    return ACLNN_SUCCESS;
}

static aclnnStatus set_io_addr(const char *api, aclOpExecutor *executor, size_t index,
                               aclTensor *tensor, void *addr, int is_output) {
    int f = aclemuFaultPoint(api, ACLNN_ERR_INNER);
    if (f) return f;
    if (!executor || !tensor) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR, "%s is NULL", executor ? "tensor" : "executor");
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    pthread_mutex_lock(&g_lock);
    int st = 0;
    if (!set_contains(&g_executors, executor)) {
        st = ACLNN_ERR_PARAM_INVALID;
        aclemuSetErrMsg(api, st, k_dead_executor, (void *)executor);
    } else if (!executor->info.repeatable) {
        st = ACLNN_ERR_PARAM_INVALID;
        aclemuSetErrMsg(api, st,
                        "executor %p is not repeatable: call aclSetAclOpExecutorRepeatable first",
                        (void *)executor);
    } else if (!set_contains(&g_tensors, tensor)) {
        st = ACLNN_ERR_PARAM_INVALID;
        aclemuSetErrMsg(api, st, "%p is not a live aclTensor", (void *)tensor);
    } else {
        int n = is_output ? executor->info.n_outputs : executor->info.n_inputs;
        if (index >= (size_t)n) {
            st = ACLNN_ERR_PARAM_INVALID;
            aclemuSetErrMsg(api, st, "%s index %zu is out of range: the op has %d", 
                            is_output ? "output" : "input", index, n);
        } else {
            if (is_output) executor->info.output_addr[index] = (uintptr_t)addr;
            else executor->info.input_addr[index] = (uintptr_t)addr;
            tensor->data = addr;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclnnStatus aclSetInputTensorAddr(aclOpExecutor *executor, const size_t index,
                                          aclTensor *tensor, void *addr) {
    return set_io_addr("aclSetInputTensorAddr", executor, index, tensor, addr, 0);
}

EMU_API aclnnStatus aclSetOutputTensorAddr(aclOpExecutor *executor, const size_t index,
                                           aclTensor *tensor, void *addr) {
    return set_io_addr("aclSetOutputTensorAddr", executor, index, tensor, addr, 1);
}
