/*
 * Emulated libnnopbase.so: aclTensor, aclScalar, aclIntArray and the executor objects the op
 * library hands out. Handles come from generation-tagged tables (emu_handles.h): a stale or
 * foreign handle is an error status, never a crash, and never reaches a newer object.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "emu.h"
#include "emu_handles.h"


struct aclTensor {
    uintptr_t handle;
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
    uintptr_t handle;
    aclDataType dtype;
    unsigned char value[16];
};

struct aclIntArray {
    uintptr_t handle;
    uint64_t size;
    int64_t *values;
};

struct aclOpExecutor {
    uintptr_t handle;
    emu_executor_info info;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static emu_htab g_tensors = EMU_HTAB_INIT(EMU_KIND_TENSOR);
static emu_htab g_scalars = EMU_HTAB_INIT(EMU_KIND_SCALAR);
static emu_htab g_arrays = EMU_HTAB_INIT(EMU_KIND_INT_ARRAY);
static emu_htab g_executors = EMU_HTAB_INIT(EMU_KIND_EXECUTOR);
static emu_htab g_lists = EMU_HTAB_INIT(EMU_KIND_TENSOR_LIST);

/* fork(): the child must not inherit a held lock (see rt_state.c for the model). prepare takes
 * it so the tables are consistent; the child gets a fresh lock and abandons every object of
 * the parent, leaking it: the handles stay stale and never alias the child's objects. */
static void atfork_prepare(void) { pthread_mutex_lock(&g_lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&g_lock); }
static void atfork_child(void) {
    pthread_mutex_init(&g_lock, NULL);
    emu_ht_abandon(&g_tensors);
    emu_ht_abandon(&g_scalars);
    emu_ht_abandon(&g_arrays);
    emu_ht_abandon(&g_executors);
    emu_ht_abandon(&g_lists);
}

__attribute__((constructor)) static void nnopbase_init(void) {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* ------------------------------------------------------------------ tensors */

static void tensor_free(struct aclTensor *t) {
    free(t->view);
    free(t->strides);
    free(t->storage);
    free(t);
}

EMU_API aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum,
                                   aclDataType dataType, const int64_t *stride, int64_t offset,
                                   aclFormat format, const int64_t *storageDims,
                                   uint64_t storageDimsNum, void *tensorData) {
    EMU_ENTRY_NULL(ACLNN_ERR_INNER);
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
            /* The outermost stride is never multiplied on, so only a product that is used
             * can overflow; such a view spans more elements than int64 can count. */
            if (i > 0 && __builtin_mul_overflow(acc, viewDims[i] > 0 ? viewDims[i] : 1, &acc)) {
                tensor_free(t);
                aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID,
                                "viewDims: the contiguous strides of this shape overflow int64 "
                                "(dimension %llu is %lld)",
                                (unsigned long long)i, (long long)viewDims[i]);
                return NULL;
            }
        }
    }
    pthread_mutex_lock(&g_lock);
    int bad = emu_ht_add(&g_tensors, t, &t->handle);
    pthread_mutex_unlock(&g_lock);
    if (bad) {
        tensor_free(t);
        aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        return NULL;
    }
    aclemuCountAdd(EMU_C_TENSORS, 1);
    return (aclTensor *)t->handle;
}

static aclnnStatus destroy_tensor(const char *api, const aclTensor *tensor) {
    if (!tensor) return ACLNN_SUCCESS; /* destroying nothing is allowed, as with free(NULL) */
    pthread_mutex_lock(&g_lock);
    struct aclTensor *t = emu_ht_remove(&g_tensors, tensor);
    pthread_mutex_unlock(&g_lock);
    if (!t) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID,
                        "%p is not a live aclTensor (already destroyed, or never created)",
                        (const void *)tensor);
        return ACLNN_ERR_PARAM_INVALID;
    }
    tensor_free(t);
    aclemuCountAdd(EMU_C_TENSORS, -1);
    return ACLNN_SUCCESS;
}

EMU_API aclnnStatus aclDestroyTensor(const aclTensor *tensor) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    return destroy_tensor(api, tensor);
}

/* The live tensor behind a handle; the caller holds the lock. */
static int tensor_get(const char *api, const aclTensor *tensor, struct aclTensor **out) {
    if (!tensor) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR, "tensor is NULL");
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    if (!(*out = emu_ht_get(&g_tensors, tensor))) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, "%p is not a live aclTensor",
                        (const void *)tensor);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return 0;
}

EMU_API int aclemuTensorDesc(const aclTensor *tensor, emu_tensor_desc *out) {
    pthread_mutex_lock(&g_lock);
    const struct aclTensor *t = emu_ht_get(&g_tensors, tensor);
    int st = t ? 0 : -1;
    if (t) {
        memset(out, 0, sizeof *out);
        out->dtype = t->dtype;
        out->format = t->format;
        out->ndim = (int64_t)t->ndim; /* aclCreateTensor keeps ndim <= EMU_OP_MAX_DIMS */
        memcpy(out->shape, t->view, t->ndim * sizeof(int64_t));
        memcpy(out->strides, t->strides, t->ndim * sizeof(int64_t));
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
    EMU_ENTRY(ACLNN_ERR_INNER);
    return get_dims(api, tensor, viewDims, viewDimsNum, DIMS_VIEW);
}

EMU_API aclnnStatus aclGetStorageShape(const aclTensor *tensor, int64_t **storageDims,
                                       uint64_t *storageDimsNum) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    return get_dims(api, tensor, storageDims, storageDimsNum, DIMS_STORAGE);
}

EMU_API aclnnStatus aclGetViewStrides(const aclTensor *tensor, int64_t **stridesValue,
                                      uint64_t *stridesNum) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    return get_dims(api, tensor, stridesValue, stridesNum, DIMS_STRIDES);
}

/* One scalar field of a live tensor, copied out under the lock. */
#define TENSOR_FIELD_GETTER(name, type, expr)                                           \
    EMU_API aclnnStatus name(const aclTensor *tensor, type *value) {                    \
        EMU_ENTRY(ACLNN_ERR_INNER);                                                     \
        if (!value) {                                                                   \
            aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR, "the output pointer is NULL"); \
            return ACLNN_ERR_PARAM_NULLPTR;                                             \
        }                                                                               \
        pthread_mutex_lock(&g_lock);                                                    \
        struct aclTensor *t;                                                            \
        int st = tensor_get(api, tensor, &t);                                           \
        if (!st) *value = (expr);                                                       \
        pthread_mutex_unlock(&g_lock);                                                  \
        return st;                                                                      \
    }

TENSOR_FIELD_GETTER(aclGetViewOffset, int64_t, t->offset)
TENSOR_FIELD_GETTER(aclGetFormat, aclFormat, t->format)
TENSOR_FIELD_GETTER(aclGetDataType, aclDataType, t->dtype)
TENSOR_FIELD_GETTER(aclGetRawTensorAddr, void *, t->data)

EMU_API aclnnStatus aclSetRawTensorAddr(aclTensor *tensor, void *addr) {
    EMU_ENTRY(ACLNN_ERR_INNER);
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
    EMU_ENTRY_NULL(ACLNN_ERR_INNER);
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
    s->dtype = dataType;
    memcpy(s->value, value, n);
    pthread_mutex_lock(&g_lock);
    int bad = emu_ht_add(&g_scalars, s, &s->handle);
    pthread_mutex_unlock(&g_lock);
    if (bad) {
        free(s);
        aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        return NULL;
    }
    aclemuCountAdd(EMU_C_SCALARS, 1);
    return (aclScalar *)s->handle;
}

EMU_API aclnnStatus aclDestroyScalar(const aclScalar *scalar) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    if (!scalar) return ACLNN_SUCCESS;
    pthread_mutex_lock(&g_lock);
    struct aclScalar *s = emu_ht_remove(&g_scalars, scalar);
    pthread_mutex_unlock(&g_lock);
    if (!s) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, "%p is not a live aclScalar",
                        (const void *)scalar);
        return ACLNN_ERR_PARAM_INVALID;
    }
    free(s);
    aclemuCountAdd(EMU_C_SCALARS, -1);
    return ACLNN_SUCCESS;
}

/* What the array-like handles (aclIntArray, aclTensorList) share: a copy of the `size`
 * elements of `esize` bytes at `value`, or NULL with the thread's message set. */
static void *copy_values(const char *api, const void *value, uint64_t size, size_t esize) {
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
    void *values = malloc((size ? size : 1) * esize);
    if (!values) aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
    else if (size) memcpy(values, value, size * esize);
    return values;
}

/* Register a complete object under a new handle; -1 (the message set) when out of memory. */
static int add_handle(const char *api, emu_htab *table, void *obj, uintptr_t *handle) {
    pthread_mutex_lock(&g_lock);
    int bad = emu_ht_add(table, obj, handle);
    pthread_mutex_unlock(&g_lock);
    if (bad) aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
    return bad ? -1 : 0;
}

EMU_API aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size) {
    EMU_ENTRY_NULL(ACLNN_ERR_INNER);
    int64_t *values = copy_values(api, value, size, sizeof *values);
    if (!values) return NULL;
    struct aclIntArray *a = calloc(1, sizeof *a);
    if (a) {
        a->values = values;
        a->size = size;
    }
    if (!a || add_handle(api, &g_arrays, a, &a->handle)) {
        if (!a) aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        free(values);
        free(a);
        return NULL;
    }
    aclemuCountAdd(EMU_C_INT_ARRAYS, 1);
    return (aclIntArray *)a->handle;
}

EMU_API aclnnStatus aclDestroyIntArray(const aclIntArray *array) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    if (!array) return ACLNN_SUCCESS;
    pthread_mutex_lock(&g_lock);
    struct aclIntArray *a = emu_ht_remove(&g_arrays, array);
    pthread_mutex_unlock(&g_lock);
    if (!a) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, "%p is not a live aclIntArray",
                        (const void *)array);
        return ACLNN_ERR_PARAM_INVALID;
    }
    free(a->values);
    free(a);
    aclemuCountAdd(EMU_C_INT_ARRAYS, -1);
    return ACLNN_SUCCESS;
}

/* ------------------------------------------------------------------ tensor lists */

struct aclTensorList {
    uintptr_t handle;
    uint64_t size;
    const aclTensor **items; /* as given: a NULL or stale entry is refused when it is used */
};

EMU_API aclTensorList *aclCreateTensorList(const aclTensor *const *value, uint64_t size) {
    EMU_ENTRY_NULL(ACLNN_ERR_INNER);
    const aclTensor **items = copy_values(api, value, size, sizeof *items);
    if (!items) return NULL;
    struct aclTensorList *l = calloc(1, sizeof *l);
    if (l) {
        l->items = items;
        l->size = size;
    }
    if (!l || add_handle(api, &g_lists, l, &l->handle)) {
        if (!l) aclemuSetErrMsg(api, ACLNN_ERR_INNER, "out of host memory");
        free(items);
        free(l);
        return NULL;
    }
    aclemuCountAdd(EMU_C_TENSOR_LISTS, 1);
    return (aclTensorList *)l->handle;
}

/* CANN destroys a list's tensors with it (aclDestroyTensorList, opbase's
 * common/api/acl_op_api.cpp): its tensors are stale afterwards. An entry that is not a live
 * tensor (destroyed already, or in the list twice) is refused by name once the list and its
 * live tensors are released, where CANN would free it again. */
EMU_API aclnnStatus aclDestroyTensorList(const aclTensorList *array) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    if (!array) return ACLNN_SUCCESS;
    pthread_mutex_lock(&g_lock);
    struct aclTensorList *l = emu_ht_remove(&g_lists, array);
    pthread_mutex_unlock(&g_lock);
    if (!l) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, "%p is not a live aclTensorList",
                        (const void *)array);
        return ACLNN_ERR_PARAM_INVALID;
    }
    const uint64_t n = l->size;
    uint64_t first_bad = n;
    for (uint64_t i = 0; i < n; i++)
        if (destroy_tensor(api, l->items[i]) && first_bad == n) first_bad = i;
    const void *bad = first_bad < n ? (const void *)l->items[first_bad] : NULL;
    free(l->items);
    free(l);
    aclemuCountAdd(EMU_C_TENSOR_LISTS, -1);
    if (first_bad == n) return ACLNN_SUCCESS;
    aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID,
                    "element %llu (%p) is not a live aclTensor (destroyed already, or in the list "
                    "twice); the list and its live tensors were released",
                    (unsigned long long)first_bad, bad);
    return ACLNN_ERR_PARAM_INVALID;
}

EMU_API aclnnStatus aclGetTensorListSize(const aclTensorList *tensorList, uint64_t *size) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    if (!tensorList || !size) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_NULLPTR, "%s is NULL", tensorList ? "size" : "tensorList");
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    pthread_mutex_lock(&g_lock);
    const struct aclTensorList *l = emu_ht_get(&g_lists, tensorList);
    if (l) *size = l->size;
    pthread_mutex_unlock(&g_lock);
    if (l) return ACLNN_SUCCESS;
    aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, "%p is not a live aclTensorList",
                    (const void *)tensorList);
    return ACLNN_ERR_PARAM_INVALID;
}

/* ------------------------------------------------------------------ executors */

static void executor_free(struct aclOpExecutor *ex) {
    if (ex->info.op_free) ex->info.op_free(ex->info.op_data);
    free(ex);
    aclemuCountAdd(EMU_C_EXECUTORS, -1);
}

EMU_API aclOpExecutor *aclemuExecutorCreate(const emu_executor_info *info) {
    struct aclOpExecutor *ex = calloc(1, sizeof *ex);
    if (!ex) return NULL;
    ex->info = *info;
    ex->info.consumed = NULL;
    pthread_mutex_lock(&g_lock);
    int bad = emu_ht_add(&g_executors, ex, &ex->handle);
    pthread_mutex_unlock(&g_lock);
    if (bad) {
        free(ex);
        return NULL;
    }
    aclemuCountAdd(EMU_C_EXECUTORS, 1);
    return (aclOpExecutor *)ex->handle;
}

static const char *const k_dead_executor =
    "%p is not a live aclOpExecutor: it was destroyed, or it was a one-shot executor that a "
    "launch already consumed (call aclSetAclOpExecutorRepeatable to launch it again)";

EMU_API int aclemuExecutorAcquire(const char *api, aclOpExecutor *executor,
                                  emu_executor_info *info, int consume) {
    pthread_mutex_lock(&g_lock);
    struct aclOpExecutor *ex = emu_ht_get(&g_executors, executor);
    if (ex) {
        *info = ex->info;
        if (consume && !ex->info.repeatable) {
            emu_ht_remove(&g_executors, executor); /* its handle is stale from now on */
            info->consumed = ex;
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (!ex) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, k_dead_executor, (void *)executor);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return 0;
}

EMU_API void aclemuExecutorRelease(emu_executor_info *info) {
    if (info->consumed) executor_free(info->consumed);
    info->consumed = NULL;
    info->op_data = NULL;
}

/* The executor APIs answer as nnopbase's common/api/acl_op_api.cpp does: a NULL pointer is
 * ACLNN_ERR_INNER_NULLPTR (561103) and an object that is not a live executor ACLNN_ERR_INNER
 * (561000), not the parameter codes 161001/161002 the op's two phases use. */
static int executor_missing(const char *api, aclOpExecutor *executor) {
    if (!executor) {
        aclemuSetErrMsg(api, ACLNN_ERR_INNER_NULLPTR, "executor is NULL");
        return ACLNN_ERR_INNER_NULLPTR;
    }
    aclemuSetErrMsg(api, ACLNN_ERR_INNER, k_dead_executor, (void *)executor);
    return ACLNN_ERR_INNER;
}

EMU_API aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor *executor) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    pthread_mutex_lock(&g_lock);
    struct aclOpExecutor *ex = executor ? emu_ht_get(&g_executors, executor) : NULL;
    if (ex) ex->info.repeatable = 1;
    pthread_mutex_unlock(&g_lock);
    return ex ? ACLNN_SUCCESS : executor_missing(api, executor);
}

EMU_API aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    pthread_mutex_lock(&g_lock);
    struct aclOpExecutor *ex = executor ? emu_ht_remove(&g_executors, executor) : NULL;
    pthread_mutex_unlock(&g_lock);
    if (!ex) return executor_missing(api, executor);
    executor_free(ex);
    return ACLNN_SUCCESS;
}

/* The executor side of every address setter, with g_lock held: the executor (NULL: 561103, not
 * live: 561000), then the tensor's place in the op's definition (161002). `index` counts every
 * input or output parameter of the op, an optional one passed as NULL included: nnopbase keeps
 * a slot for it, marked null, and setting its address is refused. The dynamic setters also give
 * the position in the parameter's tensors (`relative`, or -1 for the plain setters); every
 * parameter of these ops holds one tensor, or none when it was passed as NULL
 * (NnopbaseSetDynamicInputTensorAddr, individual_op/api/individual_op_api.cpp). */
static aclnnStatus bind_locked(const char *api, aclOpExecutor *executor, size_t index,
                               size_t relative, void *addr, int is_output) {
    struct aclOpExecutor *ex = executor ? emu_ht_get(&g_executors, executor) : NULL;
    if (!ex) return executor_missing(api, executor);
    const char *kind = is_output ? "output" : "input";
    int n = is_output ? ex->info.n_outputs : ex->info.n_inputs;
    const aclTensor *const *given = is_output ? ex->info.output_tensor : ex->info.input_tensor;
    if (index >= (size_t)n) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID, "%s index %zu is out of range: the op has %d",
                        kind, index, n);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (relative != (size_t)-1 && relative >= (size_t)(given[index] ? 1 : 0)) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID,
                        "relativeIndex %zu is out of range: %s %zu of the op holds %d tensor%s (it "
                        "is not a dynamic parameter)",
                        relative, kind, index, given[index] ? 1 : 0, given[index] ? "" : "s");
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (!given[index]) {
        aclemuSetErrMsg(api, ACLNN_ERR_PARAM_INVALID,
                        "%s index %zu was passed as a null pointer to the first phase: it has no "
                        "address to set",
                        kind, index);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (is_output) ex->info.output_addr[index] = (uintptr_t)addr;
    else ex->info.input_addr[index] = (uintptr_t)addr;
    return ACLNN_SUCCESS;
}

/* nnopbase's order: the tensor first (NULL: 561103), whose address is updated before the
 * executor is even looked at; then the executor and the index (bind_locked). Any executor may
 * be rebound, repeatable or not: a one-shot executor's next launch uses the new address. */
static aclnnStatus set_io_addr(const char *api, aclOpExecutor *executor, size_t index,
                               aclTensor *tensor, void *addr, int is_output) {
    if (!tensor) {
        aclemuSetErrMsg(api, ACLNN_ERR_INNER_NULLPTR, "tensor is NULL");
        return ACLNN_ERR_INNER_NULLPTR;
    }
    pthread_mutex_lock(&g_lock);
    int st;
    struct aclTensor *t = emu_ht_get(&g_tensors, tensor);
    if (!t) {
        st = ACLNN_ERR_PARAM_INVALID;
        aclemuSetErrMsg(api, st, "%p is not a live aclTensor", (void *)tensor);
    } else {
        t->data = addr;
        st = bind_locked(api, executor, index, (size_t)-1, addr, is_output);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* aclSetDynamic{Input,Output}TensorAddr (common/api/acl_op_api.cpp): the list (NULL: 561103),
 * relativeIndex within it (161002), its tensor (NULL: 561103), whose address is updated; then
 * the executor and the parameter as above. A list or tensor that is not live is 161002 here,
 * where CANN would read freed memory. */
static aclnnStatus set_dynamic_addr(const char *api, aclOpExecutor *executor, size_t ir_index,
                                    size_t relative, aclTensorList *tensors, void *addr,
                                    int is_output) {
    if (!tensors) {
        aclemuSetErrMsg(api, ACLNN_ERR_INNER_NULLPTR, "tensors is NULL");
        return ACLNN_ERR_INNER_NULLPTR;
    }
    pthread_mutex_lock(&g_lock);
    int st = ACLNN_ERR_PARAM_INVALID;
    const struct aclTensorList *l = emu_ht_get(&g_lists, tensors);
    struct aclTensor *t = NULL;
    if (!l) {
        aclemuSetErrMsg(api, st, "%p is not a live aclTensorList", (void *)tensors);
    } else if (relative >= l->size) {
        aclemuSetErrMsg(api, st, "relativeIndex %zu is out of range: the list holds %llu tensors",
                        relative, (unsigned long long)l->size);
    } else if (!l->items[relative]) {
        st = ACLNN_ERR_INNER_NULLPTR;
        aclemuSetErrMsg(api, st, "element %zu of the list is NULL", relative);
    } else if (!(t = emu_ht_get(&g_tensors, l->items[relative]))) {
        aclemuSetErrMsg(api, st, "element %zu of the list (%p) is not a live aclTensor", relative,
                        (const void *)l->items[relative]);
    } else {
        t->data = addr;
        st = bind_locked(api, executor, ir_index, relative, addr, is_output);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclnnStatus aclSetInputTensorAddr(aclOpExecutor *executor, const size_t index,
                                          aclTensor *tensor, void *addr) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    return set_io_addr(api, executor, index, tensor, addr, 0);
}

EMU_API aclnnStatus aclSetOutputTensorAddr(aclOpExecutor *executor, const size_t index,
                                           aclTensor *tensor, void *addr) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    return set_io_addr(api, executor, index, tensor, addr, 1);
}

EMU_API aclnnStatus aclSetDynamicInputTensorAddr(aclOpExecutor *executor, size_t irIndex,
                                                 const size_t relativeIndex, aclTensorList *tensors,
                                                 void *addr) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    return set_dynamic_addr(api, executor, irIndex, relativeIndex, tensors, addr, 0);
}

EMU_API aclnnStatus aclSetDynamicOutputTensorAddr(aclOpExecutor *executor, size_t irIndex,
                                                  const size_t relativeIndex, aclTensorList *tensors,
                                                  void *addr) {
    EMU_ENTRY(ACLNN_ERR_INNER);
    return set_dynamic_addr(api, executor, irIndex, relativeIndex, tensors, addr, 1);
}
