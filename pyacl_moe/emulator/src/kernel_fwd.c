/*
 * The emulated MoeInitRoutingV2 kernel: sort the flattened expert ids, gather the token rows
 * into expert order (dropping and padding to a capacity in drop/pad mode), and count the
 * tokens of each expert. Results are those of the vendor's kernel as read from its source
 * (docs/emulator.md, "The forward op"); its multi-core split and sort passes are not modelled,
 * since they do not change the result.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_kernel.h"

/* A flattened position of expertIdx and its expert id: the sort's key and value. */
typedef struct slot {
    int64_t expert; /* an INT32 id, or the Ascend 950's INT64 one */
    int64_t pos;
} slot;

/* Equal ids keep the order of their flattened positions (token * k + j), as the vendor's
 * sort leaves them. */
static int by_expert_then_position(const void *pa, const void *pb) {
    const slot *a = pa, *b = pb;
    if (a->expert != b->expert) return a->expert < b->expert ? -1 : 1;
    return (a->pos > b->pos) - (a->pos < b->pos);
}

/* The fwd-unstable-sort mutation: equal ids in reverse order of position. */
static int by_expert_then_reverse_position(const void *pa, const void *pb) {
    const slot *a = pa, *b = pb;
    if (a->expert != b->expert) return a->expert < b->expert ? -1 : 1;
    return (a->pos < b->pos) - (a->pos > b->pos);
}

/* The ranges a run pins: the inputs, the outputs, the whole workspace (up to 9.0), and the
 * dense results in the workspace of the outputs that keep their views (9.1), in the order of
 * the outputs. */
enum { V_X, V_IDX, V_EX, V_RI, V_CNT, V_BC, V_WS, V_DENSE, V_COUNT = V_DENSE + 4 };

/* Element i of an int32 output. Device pointers need not be aligned to 4 bytes (nnopbase
 * passes any address it is given), so the store goes through memcpy, never an int32_t *. */
static void store_i32(unsigned char *base, int64_t i, int64_t v) {
    int32_t w = (int32_t)v;
    memcpy(base + i * (int64_t)sizeof w, &w, sizeof w);
}

/* Output o keeps its view (9.1): its dense range (bytes[V_EX + o], figured as for an output
 * written densely) moves to its dense result in the workspace, and the output's range becomes
 * what its view spans from its address. The first phase guarded that extent and made sure the
 * view has elements (a view of none is contiguous). */
static void keep_view(const moe_fwd_args *a, int o, uintptr_t *start, size_t *bytes, int64_t *lo) {
    const emu_tensor_desc *t = a->view[o];
    const size_t es = moe_dtype_size(t->dtype);
    int64_t hi = 0;
    start[V_DENSE + o] = a->workspace + (uintptr_t)a->scratch[o];
    bytes[V_DENSE + o] = bytes[V_EX + o];
    view_extent(t, lo, &hi);
    start[V_EX + o] += (uintptr_t)(*lo * (int64_t)es);
    bytes[V_EX + o] = (size_t)(hi - *lo + 1) * es;
}

EMU_HIDDEN int moe_fwd_kernel_run(void *payload, char *msg, size_t len) {
    const moe_fwd_args *a = payload;
    aclemuCountAdd(EMU_C_KERNELS_RUN, 1);
    static const char *const names[V_COUNT] = {
        "x", "expertIdx", "expandedXOut", "expandedRowIdxOut", "expertTokensCountOrCumsumOut",
        "expertTokensBeforeCapacityOut", "the workspace",
        "expandedXOut's dense result in the workspace",
        "expandedRowIdxOut's dense result in the workspace",
        "expertTokensCountOrCumsumOut's dense result in the workspace",
        "expertTokensBeforeCapacityOut's dense result in the workspace"};
    const int64_t total = a->n * a->k, h = a->h;
    const size_t es = moe_dtype_size(a->x.dtype);
    const int droppad = a->drop_pad_mode == 1;
    const int64_t ex_rows = a->ex_rows;

    /* The device ranges to pin: the inputs' views, the outputs written densely, the workspace. */
    uintptr_t start[V_COUNT] = {0};
    size_t bytes[V_COUNT] = {0};
    int64_t xlo = 0, ilo = 0, hi;
    if (view_extent(&a->x, &xlo, &hi)) {
        start[V_X] = a->x.addr + (uintptr_t)(xlo * (int64_t)es);
        bytes[V_X] = (size_t)(hi - xlo + 1) * es;
    }
    const int64_t ies = a->idx.dtype == ACL_INT64 ? 8 : 4; /* the 950 reads 8-byte ids */
    if (view_extent(&a->idx, &ilo, &hi)) {
        start[V_IDX] = a->idx.addr + (uintptr_t)(ilo * ies);
        bytes[V_IDX] = (size_t)(hi - ilo + 1) * (size_t)ies;
    }
    start[V_EX] = a->ex_addr;
    bytes[V_EX] = (size_t)(ex_rows * h) * es;
    start[V_RI] = a->ri_addr;
    bytes[V_RI] = (size_t)total * 4;
    start[V_CNT] = a->cnt_addr;
    bytes[V_CNT] = a->write_cnt ? (size_t)a->expert_num * 4 : 0;
    start[V_BC] = a->bc_addr;
    bytes[V_BC] = a->write_bc ? (size_t)a->expert_num * 4 : 0;
    start[V_WS] = a->workspace;
    bytes[V_WS] = a->workspace_size;
    int64_t view_lo[4] = {0};
    for (int o = 0; o < 4; o++) {
        if (a->view[o]) keep_view(a, o, start, bytes, &view_lo[o]);
    }
    uintptr_t starts[V_COUNT];
    size_t lens[V_COUNT];
    int which[V_COUNT], n = 0;
    for (int v = 0; v < V_COUNT; v++) {
        if (!bytes[v]) continue;
        starts[n] = start[v];
        lens[n] = bytes[v];
        which[n++] = v;
    }
    emu_pin pins[V_COUNT];
    int fault = moe_pin_ranges(starts, lens, which, names, n, pins, msg, len);
    if (fault) return fault;
    unsigned char *host[V_COUNT] = {NULL};
    for (int i = 0; i < n; i++) host[which[i]] = pins[i].host;
    /* The kernel writes an output that keeps its view into its dense result. */
    unsigned char *view_host[4] = {NULL};
    for (int o = 0; o < 4; o++) {
        if (!a->view[o]) continue;
        view_host[o] = host[V_EX + o];
        host[V_EX + o] = host[V_DENSE + o];
    }

    int status = ACL_ERROR_RT_AICORE_EXCEPTION;
    slot *s = malloc((size_t)(total ? total : 1) * sizeof *s);
    /* Only a count output needs the histogram, and then expertNum is its (mapped) length.
     * Counted in int64: the outputs are int32, and a count past that wraps on storing. */
    const int counts = a->write_cnt || a->write_bc;
    int64_t *hist = counts ? calloc((size_t)(a->expert_num ? a->expert_num : 1), sizeof *hist) : NULL;
    if (!s || (counts && !hist)) {
        snprintf(msg, len, "emulator out of host memory");
        status = ACL_ERROR_RT_INTERNAL_ERROR;
        goto done;
    }
    /* The ids, copied once in row-major order of the view: checked and used from this
     * snapshot, never re-read, so a concurrent write cannot slip an unchecked id past the
     * check. */
    for (int64_t p = 0; p < total; p++) {
        int64_t off = a->idx.offset + (p / a->k) * a->idx.strides[0];
        if (a->idx.ndim == 2) off += (p % a->k) * a->idx.strides[1]; /* (1-D: K = 1) */
        if (ies == 8) {
            memcpy(&s[p].expert, host[V_IDX] + (off - ilo) * 8, sizeof(int64_t));
        } else {
            int32_t v;
            memcpy(&v, host[V_IDX] + (off - ilo) * 4, sizeof v);
            s[p].expert = v;
        }
        s[p].pos = p;
    }
    /* The documented ranges: [0, expertNum) where an expert's slots or counts are addressed by
     * its id (drop/pad mode, or a count output), else 0 or greater. The vendor's kernel does
     * not check them; on a device a bad id writes out of bounds, here it is a fault. */
    const int bounded = droppad || a->count_flag != 0;
    for (int64_t p = 0; p < total; p++) {
        int64_t v = s[p].expert;
        if (v < 0 || (bounded && v >= a->expert_num)) {
            if (bounded)
                snprintf(msg, len,
                         "device fault (AI Core exception): expertIdx[%lld][%lld] = %lld is outside "
                         "[0, expertNum = %lld); no output was written",
                         (long long)(p / a->k), (long long)(p % a->k), (long long)v,
                         (long long)a->expert_num);
            else
                snprintf(msg, len,
                         "device fault (AI Core exception): expertIdx[%lld][%lld] = %lld is "
                         "negative; no output was written",
                         (long long)(p / a->k), (long long)(p % a->k), (long long)v);
            goto done;
        }
    }
    qsort(s, (size_t)total, sizeof *s,
          a->mutation == EMU_MUT_FWD_UNSTABLE_SORT ? by_expert_then_reverse_position
                                                   : by_expert_then_position);

    /* The fwd-wrong-row mutation gathers the next token's row: its outputs stay consistent
     * with themselves, and only a check against x itself (the reference, or the backward's
     * adjoint identity) can tell. */
    const int64_t shift = a->mutation == EMU_MUT_FWD_WRONG_ROW && a->n > 1 ? 1 : 0;
    unsigned char *ri = host[V_RI];
    unsigned char *ex = host[V_EX];
    const int64_t *xs = a->x.strides;
    /* Token row r of x into slot row `row` of expandedXOut. An output may overlap x (nothing
     * stops a caller; a device then reads what it has already written), so the copy is a
     * memmove: the values are as undefined as on a device, the host's behaviour is not. */
#define COPY_ROW(row, r)                                                                      \
    do {                                                                                      \
        unsigned char *dst_ = ex + (row) * h * (int64_t)es;                                   \
        int64_t base_ = a->x.offset + (r) * xs[0] - xlo;                                      \
        if (xs[1] == 1) memmove(dst_, host[V_X] + base_ * (int64_t)es, (size_t)h * es);       \
        else                                                                                  \
            for (int64_t c_ = 0; c_ < h; c_++)                                                \
                memmove(dst_ + c_ * (int64_t)es, host[V_X] + (base_ + c_ * xs[1]) * (int64_t)es, es); \
    } while (0)
    if (!droppad) {
        /* Slot i of the sorted order is row i of expandedXOut; rows past activeNum are not
         * gathered, but every position still gets its slot number. */
        for (int64_t i = 0; i < total; i++) {
            store_i32(ri, s[i].pos, i);
            if (i < ex_rows && h > 0) COPY_ROW(i, (s[i].pos / a->k + shift) % a->n);
        }
    } else {
        /* Each expert owns expertCapacity rows, filled in sorted order; a token past the
         * capacity is dropped (-1), and rows no token reaches are zero. */
        if (ex_rows * h > 0) memset(ex, 0, (size_t)(ex_rows * h) * es);
        int64_t prev = -1;
        int64_t rank = 0;
        for (int64_t i = 0; i < total; i++) {
            rank = s[i].expert == prev ? rank + 1 : 0;
            prev = s[i].expert;
            if (rank < a->capacity) {
                int64_t row = (int64_t)s[i].expert * a->capacity + rank;
                store_i32(ri, s[i].pos, row);
                if (h > 0) COPY_ROW(row, (s[i].pos / a->k + shift) % a->n);
            } else {
                store_i32(ri, s[i].pos, -1);
            }
        }
    }
#undef COPY_ROW
    if (counts) {
        for (int64_t i = 0; i < total; i++) hist[s[i].expert]++;
    }
    if (a->write_cnt) {
        int64_t run = 0;
        for (int64_t e = 0; e < a->expert_num; e++) {
            run += hist[e];
            store_i32(host[V_CNT], e, a->count_flag == 1 ? run : hist[e]);
        }
    }
    if (a->write_bc)
        for (int64_t e = 0; e < a->expert_num; e++) store_i32(host[V_BC], e, hist[e]);
    /* 9.1's l0op::ViewCopy of each output that keeps its view, the next kernels on the stream. */
    for (int o = 0; o < 4; o++)
        if (a->view[o]) aclemuViewCopy(host[V_EX + o], a->view[o], view_host[o], view_lo[o]);
    status = 0;

done:
    free(s);
    free(hist);
    aclemuUnpinMany(pins, n);
    return status;
}
