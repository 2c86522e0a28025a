/*
 * The emulated MoeInitRoutingV2Grad kernel.
 *
 * It computes what the vendor's AI Core kernel computes, in the same order: each of a token's
 * K terms is converted to float32 and summed into 2^e partial buffers (e chosen from K as the
 * vendor's tiling does), the buffers are combined by a pairwise tree, and the float32 sum is
 * rounded once to the output type (round to nearest even). Terms the scenario skips (-1 in
 * drop/pad mode, index >= activeNum in active mode) contribute nothing. Summing in the same
 * order makes float32 results bit-identical to a kernel that follows that order.
 *
 * NaN: every NaN of the result is the positive canonical quiet NaN of the output type (float32
 * 0x7FC00000, float16 0x7E00, bfloat16 0x7FC0), whatever the signs and payloads of the NaN
 * terms. IEEE 754 leaves a computed NaN's sign and payload open, and the host's choice follows
 * the operand order the compiler picked for each addition (x86 returns the first NaN operand,
 * and a vectorized `dst += src` may be emitted either way round), so only a fixed encoding is
 * reproducible; whether a value is NaN does not depend on that order. The rule is applied
 * where the float32 sum is stored or narrowed (docs/emulator.md, "NaN results").
 *
 * An index that addresses no row of gradExpandedX is what a device reports as an AI Core
 * exception: the emulator checks every index before writing anything, leaves `out` untouched,
 * and fails the task with ACL_ERROR_RT_AICORE_EXCEPTION naming the index.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moe_kernel.h"

/* ------------------------------------------------------------------ number formats */

static float g_f16_to_f32[65536];
static pthread_once_t g_tables_once = PTHREAD_ONCE_INIT;

static float bits_to_float(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static uint32_t float_to_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24, exact in float32 */
        float v = (float)mant * 5.9604644775390625e-08f;
        return bits_to_float(float_to_bits(v) | sign);
    }
    if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
    return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* float16 -> float32 without branches or tables, so the compiler can vectorize row loops:
 * shift the exponent and mantissa into place and rebias; infinities and NaNs get the rest of
 * the exponent; zeros and subnormals are rebuilt by a float subtraction. Exact for all inputs. */
static inline float half_to_float_fast(uint16_t h) {
    uint32_t o = (uint32_t)(h & 0x7fffu) << 13;
    uint32_t exp = o & 0x0f800000u;
    uint32_t normal = o + (112u << 23);
    uint32_t special = o + (224u << 23);                       /* inf / NaN */
    float sub = bits_to_float(o + (113u << 23)) - bits_to_float(113u << 23); /* zero / subnormal */
    uint32_t is_special = 0u - (uint32_t)(exp == 0x0f800000u); /* all ones or zero: no branch */
    uint32_t is_sub = 0u - (uint32_t)(exp == 0u);
    uint32_t bits = (normal & ~is_special) | (special & is_special);
    bits = (bits & ~is_sub) | (float_to_bits(sub) & is_sub);
    return bits_to_float(bits | ((uint32_t)(h & 0x8000u) << 16));
}

static void init_tables(void) {
    for (uint32_t i = 0; i < 65536; i++) g_f16_to_f32[i] = half_to_float((uint16_t)i);
}

/* float32 -> float16, round to nearest even, subnormals kept, overflow to inf, NaN quiet.
 * Branch-free so the output loops vectorize: the three candidate encodings (normal, subnormal,
 * inf/NaN) are all computed and selected with masks. Normal: rebias the exponent and round
 * the 13 dropped mantissa bits to even. Subnormal: adding 0.5f aligns the value so that the
 * float addition itself rounds it to units of 2^-24. Checked against a step-by-step
 * conversion on all 2^32 inputs. A NaN becomes the canonical 0x7E00, its sign and payload
 * dropped (the kernel's NaN rule, above). */
static inline uint16_t float_to_half(float f) {
    uint32_t x = float_to_bits(f);
    uint32_t ax = x & 0x7fffffffu;
    uint32_t normal = ((ax - (112u << 23)) + 0xfffu + ((ax >> 13) & 1u)) >> 13;
    uint32_t sub = float_to_bits(bits_to_float(ax) + 0.5f) - (126u << 23);
    uint32_t is_nan = 0u - (uint32_t)(ax > 0x7f800000u);
    uint32_t special = (0x7e00u & is_nan) | (0x7c00u & ~is_nan);
    uint32_t is_sub = 0u - (uint32_t)(ax < 0x38800000u);
    uint32_t is_big = 0u - (uint32_t)(ax >= 0x47800000u); /* 2^16 and up: inf or NaN */
    uint32_t r = (normal & ~is_sub) | (sub & is_sub);
    r = (r & ~is_big) | (special & is_big);
    return (uint16_t)(r | ((x >> 16) & 0x8000u & ~is_nan));
}

/* float32 -> bfloat16, round to nearest even, a NaN the canonical 0x7FC0; branch-free like the
 * above (the rounding addition would carry a NaN's payload into the exponent or the sign). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t x = float_to_bits(f);
    uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    uint32_t is_nan = 0u - (uint32_t)((x & 0x7fffffffu) > 0x7f800000u);
    return (uint16_t)((rounded & ~is_nan) | (0x7fc0u & is_nan));
}

/* A float32 result as stored: its bits, a NaN the canonical 0x7FC00000. Branch-free, so the
 * store loop vectorizes as the copy it replaces did. */
static inline uint32_t float_to_f32_bits(float f) {
    uint32_t x = float_to_bits(f);
    uint32_t is_nan = 0u - (uint32_t)((x & 0x7fffffffu) > 0x7f800000u);
    return (x & ~is_nan) | (0x7fc00000u & is_nan);
}

/* ------------------------------------------------------------------ row arithmetic */

/* One term of a sum: a row of gradExpandedX, `h` elements `stride` apart. */
typedef struct row_ref {
    const unsigned char *p;
    int64_t stride; /* in elements */
} row_ref;

/* dst = row (set) or dst += row (add), in float32. Contiguous rows take loops the compiler
 * vectorizes; strided rows, and rows at an address not aligned to their element size (nnopbase
 * passes any device address it is given), are converted element by element through memcpy. */
static void row_apply(float *restrict dst, row_ref r, int64_t h, aclDataType dt, int add) {
    if (r.stride == 1 && (uintptr_t)r.p % moe_dtype_size(dt) == 0) {
        if (dt == ACL_FLOAT) {
            const float *restrict s = (const float *)r.p;
            if (add)
                for (int64_t j = 0; j < h; j++) dst[j] += s[j];
            else
                memcpy(dst, s, (size_t)h * sizeof(float));
        } else if (dt == ACL_BF16) {
            const uint16_t *restrict s = (const uint16_t *)r.p;
            if (add)
                for (int64_t j = 0; j < h; j++) dst[j] += bits_to_float((uint32_t)s[j] << 16);
            else
                for (int64_t j = 0; j < h; j++) dst[j] = bits_to_float((uint32_t)s[j] << 16);
        } else {
            const uint16_t *restrict s = (const uint16_t *)r.p;
            if (add)
                for (int64_t j = 0; j < h; j++) dst[j] += half_to_float_fast(s[j]);
            else
                for (int64_t j = 0; j < h; j++) dst[j] = half_to_float_fast(s[j]);
        }
        return;
    }
    for (int64_t j = 0; j < h; j++) {
        const unsigned char *e = r.p + j * r.stride * (int64_t)moe_dtype_size(dt);
        float v;
        if (dt == ACL_FLOAT) memcpy(&v, e, sizeof v);
        else {
            uint16_t u;
            memcpy(&u, e, sizeof u);
            v = dt == ACL_BF16 ? bits_to_float((uint32_t)u << 16) : g_f16_to_f32[u];
        }
        dst[j] = add ? dst[j] + v : v;
    }
}

/* The fp16-accumulate mutation: every partial sum is rounded to float16. */
static void round_to_half(float *v, int64_t h) {
    for (int64_t j = 0; j < h; j++) v[j] = g_f16_to_f32[float_to_half(v[j])];
}

/* ------------------------------------------------------------------ the kernel */

/* Element-offset range [lo, hi] a view touches; returns 0 if it has no elements. */
EMU_HIDDEN int view_extent(const emu_tensor_desc *t, int64_t *lo, int64_t *hi) {
    int64_t a = t->offset, b = t->offset;
    for (int64_t d = 0; d < t->ndim; d++) {
        if (t->shape[d] <= 0) return 0;
        int64_t span = (t->shape[d] - 1) * t->strides[d];
        if (span < 0) a += span;
        else b += span;
    }
    *lo = a;
    *hi = b;
    return 1;
}

EMU_HIDDEN int moe_pin_ranges(const uintptr_t *starts, const size_t *lens, const int *which,
                              const char *const *names, int n, emu_pin *pins, char *msg, size_t len) {
    int32_t owner;
    int bad = aclemuPinMany(starts, lens, pins, n, &owner);
    if (bad < 0) return 0;
    if (owner >= 0)
        snprintf(msg, len,
                 "device fault (AI Core exception): %s spans [%p, +%zu), memory of device %d, which "
                 "this device's AI Cores cannot reach",
                 names[which[bad]], (void *)starts[bad], lens[bad], (int)owner);
    else
        snprintf(msg, len,
                 "device fault (AI Core exception): %s spans [%p, +%zu) but that is not inside a "
                 "live device allocation (freed before the kernel ran?)",
                 names[which[bad]], (void *)starts[bad], lens[bad]);
    return ACL_ERROR_RT_AICORE_EXCEPTION;
}

typedef struct mapped_view {
    const emu_tensor_desc *t;
    size_t esize;
    int64_t lo;           /* element offset mapped at `host` */
    unsigned char *host;  /* NULL when the view has no elements */
    uintptr_t start;      /* device range the view touches (bytes 0: none) */
    size_t bytes;
} mapped_view;

static void plan_view(mapped_view *m, const emu_tensor_desc *t) {
    memset(m, 0, sizeof *m);
    m->t = t;
    m->esize = moe_dtype_size(t->dtype);
    int64_t lo, hi;
    if (!view_extent(t, &lo, &hi)) return;
    m->lo = lo;
    m->start = t->addr + (uintptr_t)(lo * (int64_t)m->esize);
    m->bytes = (size_t)(hi - lo + 1) * m->esize;
}

/* Partial buffers the vendor's kernel uses for K terms: 2^e with e = floor(log2 K) - 1 (at
 * least 0), and 64 (e = 6) from K = 128 on. */
static int64_t bin_exponent(int64_t k) {
    if (k >= 128) return 6;
    int64_t e = -1;
    for (int64_t v = k; v > 1; v >>= 1) e++;
    return e < 0 ? 0 : e;
}

/* What every token's computation needs, shared read-only by the worker threads. */
typedef struct token_job {
    const moe_kernel_args *a;
    const int32_t *ids;
    const unsigned char *x_host;
    int64_t x_lo;
    size_t es;
    unsigned char *out_base;
    int64_t exp, nb;
    int droppad, active;
} token_job;

/* Row r of a view read as flat runs of H (see moe_kernel_args.flat): gather its elements, in
 * the view's row-major order, into `scratch`. */
static row_ref flat_row(const token_job *j, int64_t r, unsigned char *scratch) {
    const emu_tensor_desc *x = &j->a->x;
    const int64_t h = j->a->h;
    for (int64_t c = 0; c < h; c++) {
        int64_t f = r * h + c, off = x->offset;
        for (int64_t d = x->ndim - 1; d >= 0; d--) {
            off += (f % x->shape[d]) * x->strides[d];
            f /= x->shape[d];
        }
        memcpy(scratch + c * (int64_t)j->es, j->x_host + (off - j->x_lo) * (int64_t)j->es, j->es);
    }
    return (row_ref){scratch, 1};
}

/* One rounding of a float32 row to the output type, into out row i. */
static void store_row(const token_job *j, int64_t i, float *acc) {
    const int64_t h = j->a->h;
    const aclDataType dt = j->a->x.dtype;
    unsigned char *orow = j->out_base + i * h * (int64_t)j->es;
    if (dt == ACL_FLOAT) {
        /* Even a token whose one term was copied, not added, stores a canonical NaN: one rule
         * for every K and dtype. The buffer is this thread's own, so it is rewritten in place
         * (the quiet NaN goes through a float unchanged) and copied out whole: out may be at
         * any address. */
        for (int64_t c = 0; c < h; c++) acc[c] = bits_to_float(float_to_f32_bits(acc[c]));
        memcpy(orow, acc, (size_t)h * sizeof(float));
    } else if ((uintptr_t)orow % sizeof(uint16_t)) {
        /* An output address that is not 2-byte aligned: no uint16_t stores. */
        for (int64_t c = 0; c < h; c++) {
            uint16_t v = dt == ACL_BF16 ? float_to_bf16(acc[c]) : float_to_half(acc[c]);
            memcpy(orow + c * (int64_t)sizeof v, &v, sizeof v);
        }
    } else if (dt == ACL_BF16) {
        uint16_t *restrict o = (uint16_t *)orow;
        for (int64_t c = 0; c < h; c++) o[c] = float_to_bf16(acc[c]);
    } else {
        uint16_t *restrict o = (uint16_t *)orow;
        for (int64_t c = 0; c < h; c++) o[c] = float_to_half(acc[c]);
    }
}

/* Term t of token i on the Ascend 950: its row, or a NULL row where the kernel reads a zero row
 * (arch35/moe_init_routing_v2_grad_base.h:65-75, IsInvalidRowIdx): the scenario's marks, and
 * from 9.1 (zero_invalid) a negative index, and in dropless mode one of N*K or more. */
static row_ref arch35_term(const token_job *j, int64_t i, int64_t t, unsigned char *scratch) {
    const moe_kernel_args *a = j->a;
    const int64_t *xs = a->x.strides;
    int64_t r = j->ids[i * a->top_k + t];
    const int zi = a->zero_invalid;
    int zero = (j->droppad && (r == -1 || (zi && r < 0))) ||
               (j->active && (r >= a->active_num || (zi && r < 0))) ||
               (!j->droppad && !j->active && zi && (r < 0 || r >= a->n * a->top_k));
    if (zero) return (row_ref){NULL, 0};
    if (a->mutation == EMU_MUT_OFF_BY_ONE && r + 1 < a->rows) r++;
    if (a->flat) return flat_row(j, r, scratch);
    int64_t off = a->x.offset + (a->x.ndim == 3 ? (r / a->c) * xs[0] + (r % a->c) * xs[1] : r * xs[0]);
    return (row_ref){j->x_host + (off - j->x_lo) * (int64_t)j->es, xs[a->x.ndim - 1]};
}

/* dst = term (set) or dst + term (add); a zero row is +0.0, added as one (so that a -0.0 there
 * becomes +0.0, as on the device). */
static void arch35_apply(float *dst, row_ref r, int64_t h, aclDataType dt, int add) {
    if (r.p) row_apply(dst, r, h, dt, add);
    else if (add)
        for (int64_t c = 0; c < h; c++) dst[c] += 0.0f;
    else
        memset(dst, 0, (size_t)h * sizeof(float));
}

/* The Ascend 950's kernel (ops-transformer op_kernel/arch35/moe_init_routing_v2_grad_base.h:204-377,
 * SequenceReduceSum, from v9.0.0-beta.2): per token a float32 sum from +0.0; K in chunks of
 * k_chunk terms, and in each chunk every four terms added as acc + ((t0 + t1) + (t2 + t3)), the
 * rest one by one; the sum carried exactly across chunks; one rounding at the end. */
static void compute_tokens_arch35(const token_job *j, int64_t begin, int64_t end, float *bufs,
                                  unsigned char *scratch) {
    const moe_kernel_args *a = j->a;
    const int64_t h = a->h, k = a->top_k;
    const aclDataType dt = a->x.dtype;
    const int mut = a->mutation;
    const int64_t kk = mut == EMU_MUT_SKIP_LAST_K ? k - 1 : k;
    const int64_t chunk = a->k_chunk > 0 ? a->k_chunk : k;
    float *acc = bufs, *ta = bufs + h, *tb = bufs + 2 * h;
    for (int64_t i = begin; i < end; i++) {
        if (mut == EMU_MUT_SKIP_LAST_ROW && i == a->n - 1) continue; /* leaves it unwritten */
        memset(acc, 0, (size_t)h * sizeof(float));
        for (int64_t k0 = 0; k0 < kk; k0 += chunk) {
            const int64_t len = emu_min64(chunk, kk - k0);
            int64_t q = 0;
            for (; q + 3 < len; q += 4) {
                arch35_apply(ta, arch35_term(j, i, k0 + q, scratch), h, dt, 0);
                arch35_apply(ta, arch35_term(j, i, k0 + q + 1, scratch), h, dt, 1);
                arch35_apply(tb, arch35_term(j, i, k0 + q + 2, scratch), h, dt, 0);
                arch35_apply(tb, arch35_term(j, i, k0 + q + 3, scratch), h, dt, 1);
                for (int64_t c = 0; c < h; c++) ta[c] += tb[c];
                for (int64_t c = 0; c < h; c++) acc[c] += ta[c];
                if (mut == EMU_MUT_FP16_ACC) round_to_half(acc, h);
            }
            for (; q < len; q++) {
                arch35_apply(acc, arch35_term(j, i, k0 + q, scratch), h, dt, 1);
                if (mut == EMU_MUT_FP16_ACC) round_to_half(acc, h);
            }
        }
        store_row(j, i, acc);
    }
}

/* Token i's terms, summed the vendor's way, rounded once into out row i. */
static void compute_tokens(const token_job *j, int64_t begin, int64_t end, float *bins,
                           unsigned char *scratch) {
    if (j->a->arch35) {
        compute_tokens_arch35(j, begin, end, bins, scratch);
        return;
    }
    const moe_kernel_args *a = j->a;
    const int64_t h = a->h, k = a->top_k, nb = j->nb;
    const aclDataType dt = a->x.dtype;
    const int64_t *xs = a->x.strides;
    const int64_t sh = xs[a->x.ndim - 1];
    const int mut = a->mutation;
    const int64_t kk = mut == EMU_MUT_SKIP_LAST_K ? k - 1 : k; /* positions that count */

    for (int64_t i = begin; i < end; i++) {
        if (mut == EMU_MUT_SKIP_LAST_ROW && i == a->n - 1) continue; /* leaves it unwritten */
        const int32_t *tk = j->ids + i * k;
        /* The row of the term at position t, or NULL when the scenario skips it. */
#define TERM(t, ref_out)                                                                          \
    do {                                                                                          \
        int32_t v_ = tk[t];                                                                       \
        int skip_ = (t) >= kk || (j->droppad && v_ == -1) || (j->active && (int64_t)v_ >= a->active_num); \
        if (skip_) {                                                                              \
            (ref_out).p = NULL;                                                                   \
        } else {                                                                                  \
            int64_t r_ = v_;                                                                      \
            if (mut == EMU_MUT_OFF_BY_ONE && r_ + 1 < a->rows) r_++;                              \
            if (a->flat) {                                                                        \
                (ref_out) = flat_row(j, r_, scratch);                                             \
            } else {                                                                              \
                int64_t off_ = a->x.offset + (a->x.ndim == 3 ? (r_ / a->c) * xs[0] + (r_ % a->c) * xs[1] \
                                                              : r_ * xs[0]);                      \
                (ref_out).p = j->x_host + (off_ - j->x_lo) * (int64_t)j->es;                     \
                (ref_out).stride = sh;                                                            \
            }                                                                                     \
        }                                                                                         \
    } while (0)

        /* S1: the first terms at even positions seed the partial buffers. */
        int64_t t = 0, b = 0;
        for (; t < k && b < nb; t += 2, b++) {
            row_ref r;
            TERM(t, r);
            float *dst = bins + b * h;
            if (r.p) row_apply(dst, r, h, dt, 0);
            else memset(dst, 0, (size_t)h * sizeof(float));
            if (mut == EMU_MUT_FP16_ACC) round_to_half(dst, h);
        }
        for (; b < nb; b++) memset(bins + b * h, 0, (size_t)h * sizeof(float));
        /* S2: the remaining even positions, round robin over the buffers. */
        for (int64_t t2 = t; t2 < k; t2 += 2) {
            row_ref r;
            TERM(t2, r);
            if (!r.p) continue;
            float *dst = bins + (((t2 - t) / 2) % nb) * h;
            row_apply(dst, r, h, dt, 1);
            if (mut == EMU_MUT_FP16_ACC) round_to_half(dst, h);
        }
        /* S3: the odd positions, round robin over the buffers. */
        for (int64_t t3 = 1; t3 < k; t3 += 2) {
            row_ref r;
            TERM(t3, r);
            if (!r.p) continue;
            float *dst = bins + (((t3 - 1) / 2) % nb) * h;
            row_apply(dst, r, h, dt, 1);
            if (mut == EMU_MUT_FP16_ACC) round_to_half(dst, h);
        }
#undef TERM
        /* S4: pairwise tree over the buffers. */
        for (int64_t e = 0, stride = 1; e < j->exp; e++, stride *= 2) {
            for (int64_t q = stride; q < nb; q += 2 * stride) {
                float *restrict da = bins + (q - stride) * h;
                const float *restrict db = bins + q * h;
                for (int64_t c = 0; c < h; c++) da[c] += db[c];
                if (mut == EMU_MUT_FP16_ACC) round_to_half(da, h);
            }
        }
        store_row(j, i, bins); /* one rounding to the output type */
    }
}

typedef struct token_worker {
    pthread_t thread;
    const token_job *job;
    int64_t begin, end;
    int failed;
} token_worker;

/* One thread's working memory: the partial buffers, then a row of scratch for flat reads. */
static float *alloc_bins(const token_job *j) {
    size_t bytes = (size_t)(j->nb * j->a->h) * sizeof(float) + (size_t)j->a->h * j->es;
    return aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
}

static unsigned char *scratch_of(const token_job *j, float *bins) {
    return (unsigned char *)(bins + j->nb * j->a->h);
}

static void *token_worker_main(void *p) {
    token_worker *w = p;
    float *bins = alloc_bins(w->job);
    if (!bins) {
        w->failed = 1;
        return NULL;
    }
    compute_tokens(w->job, w->begin, w->end, bins, scratch_of(w->job, bins));
    free(bins);
    return NULL;
}

/* Host threads the kernel may use: the CPUs online (at most 16), or PYACL_MOE_EMU_THREADS
 * (read at each run, so a test can change it; its form, digits for 1 to 1024, is enforced by
 * aclInit and by the Python layer, and anything else here means the CPU count).
 * Tokens are independent, so the result does not depend on the split. */
static int kernel_threads(void) {
    const char *env = getenv("PYACL_MOE_EMU_THREADS");
    long n = 0;
    for (const char *c = env; c && *c && n <= 1024; c++)
        n = *c >= '0' && *c <= '9' ? n * 10 + (*c - '0') : 1025;
    if (n < 1 || n > 1024) n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 16 ? 16 : (int)n;
}

/* The overrun mutation: the kernel also writes one element just past the last byte out's view
 * touches (a copy of the last element), where a caller's guard band would sit. Only when that
 * element lies in a live allocation: a deliberate bug must not corrupt the emulator's heap. */
static void overrun(const mapped_view *out, size_t esize) {
    uintptr_t past = out->start + out->bytes;
    emu_pin pin;
    if (aclemuPin(past, esize, &pin) != 0) return;
    memcpy(pin.host, out->host + out->bytes - esize, esize);
    aclemuUnpin(&pin);
}

/* Compute every token, splitting large kernels across threads. Returns -1 if out of memory. */
static int run_tokens(const token_job *j) {
    const int64_t n = j->a->n;
    const int64_t work = n * j->a->top_k * j->a->h;
    /* Small kernels run on this thread: thread start-up would dominate, and asking for the
     * CPU count (a read of sysfs) would cost more than the kernel itself. */
    int threads = work < ((int64_t)1 << 20) ? 1 : kernel_threads();
    if (threads > n) threads = (int)(n > 0 ? n : 1);
    token_worker workers[16];
    int started = 0, failed = 0;
    int64_t per = (n + threads - 1) / threads;
    for (int w = 1; w < threads; w++) {
        workers[w] = (token_worker){.job = j, .begin = w * per, .end = emu_min64(n, (w + 1) * per)};
        if (workers[w].begin >= workers[w].end) break;
        if (pthread_create(&workers[w].thread, NULL, token_worker_main, &workers[w]) != 0) break;
        started = w;
    }
    /* This thread takes the first share, and whatever threads could not be started. */
    int64_t mine_end = started ? per : n;
    float *bins = alloc_bins(j);
    if (bins) compute_tokens(j, 0, emu_min64(n, mine_end), bins, scratch_of(j, bins));
    else failed = 1;
    if (started && bins && started + 1 < threads) {
        int64_t rest = (started + 1) * per;
        if (rest < n) compute_tokens(j, rest, n, bins, scratch_of(j, bins));
    }
    free(bins);
    for (int w = 1; w <= started; w++) {
        pthread_join(workers[w].thread, NULL);
        failed |= workers[w].failed;
    }
    return failed ? -1 : 0;
}

EMU_HIDDEN int moe_kernel_run(void *payload, char *msg, size_t len) {
    const moe_kernel_args *a = payload;
    pthread_once(&g_tables_once, init_tables);
    aclemuCountAdd(EMU_C_KERNELS_RUN, 1);

    const int64_t k = a->top_k, bsk = a->bsk;
    mapped_view mx, mi, mo;
    int status = ACL_ERROR_RT_AICORE_EXCEPTION;
    int32_t *ids_buf = NULL;

    /* Pin the device memory of the three views and the workspace under one lock: up to 9.0 the
     * whole workspace, from 9.1 only the dense result of a strided out (in 9.1 nothing checks
     * the workspace's size, so that is where a short one faults). */
    plan_view(&mx, &a->x);
    plan_view(&mi, &a->idx);
    plan_view(&mo, &a->out);
    mapped_view *views[3] = {&mx, &mi, &mo};
    static const char *const names[5] = {"gradExpandedX", "expandedRowIdx", "out", "the workspace",
                                         "out's dense result in the workspace"};
    uintptr_t starts[5];
    size_t lens[5];
    int which[5], n = 0;
    for (int v = 0; v < 3; v++) {
        if (!views[v]->bytes) continue;
        starts[n] = views[v]->start;
        lens[n] = views[v]->bytes;
        which[n++] = v;
    }
    if (a->workspace_size) {
        starts[n] = a->workspace;
        lens[n] = a->workspace_size;
        which[n++] = 3;
    }
    if (a->via_scratch) {
        starts[n] = a->workspace + (uintptr_t)a->scratch;
        lens[n] = (size_t)(a->n * a->h) * mo.esize;
        which[n++] = 4;
    }
    emu_pin pins[5];
    if (moe_pin_ranges(starts, lens, which, names, n, pins, msg, len)) return status;
    unsigned char *dense = NULL; /* the dense result of a strided out (9.1) */
    for (int i = 0; i < n; i++) {
        if (which[i] < 3) views[which[i]]->host = pins[i].host;
        else if (which[i] == 4) dense = pins[i].host;
    }

    /* The first bsk indices in row-major order of the index view, copied once: they are checked
     * and used from this snapshot, never re-read from device memory, so a concurrent write (a
     * copy on another stream, another thread) cannot slip an unchecked index past the check. */
    ids_buf = malloc((size_t)(bsk ? bsk : 1) * sizeof(int32_t));
    if (!ids_buf) {
        snprintf(msg, len, "emulator out of host memory");
        status = ACL_ERROR_RT_INTERNAL_ERROR;
        goto done;
    }
    if (a->idx.ndim == 1 && a->idx.strides[0] == 1) {
        if (bsk) memcpy(ids_buf, mi.host + (a->idx.offset - mi.lo) * 4, (size_t)bsk * sizeof(int32_t));
    } else {
        int64_t pos[EMU_OP_MAX_DIMS] = {0};
        for (int64_t j = 0; j < bsk; j++) {
            int64_t off = a->idx.offset;
            for (int64_t d = 0; d < a->idx.ndim; d++) off += pos[d] * a->idx.strides[d];
            memcpy(&ids_buf[j], mi.host + (off - mi.lo) * 4, sizeof(int32_t));
            for (int64_t d = a->idx.ndim - 1; d >= 0; d--) {
                if (++pos[d] < a->idx.shape[d]) break;
                pos[d] = 0;
            }
        }
    }
    const int32_t *ids = ids_buf;

    /* Which terms count, and whether every counted one addresses a row that exists. */
    const int droppad = a->drop_pad_mode == 1, active = !droppad && a->active_num > 0;
    for (int64_t j = 0; j < bsk; j++) {
        int32_t v = ids[j];
        if ((droppad && v == -1) || (active && (int64_t)v >= a->active_num)) continue;
        /* The 950 from 9.1 reads these as zero rows (arch35/moe_init_routing_v2_grad_base.h:65-75;
         * dropless: N*K and more); past the rows in drop/pad mode it reads outside the input: a
         * fault here. */
        if (a->zero_invalid && (v < 0 || (!droppad && !active && (int64_t)v >= a->n * k))) continue;
        if (v < 0 || (int64_t)v >= a->rows) {
            snprintf(msg, len,
                     "device fault (AI Core exception): expandedRowIdx[%lld] = %d addresses no "
                     "row of gradExpandedX, which has %lld rows; out was not written",
                     (long long)j, (int)v, (long long)a->rows);
            goto done;
        }
    }

    token_job job = {
        .a = a, .ids = ids, .x_host = mx.host, .x_lo = mx.lo, .es = mx.esize,
        .out_base = dense ? dense : mo.host + (a->out.offset - mo.lo) * (int64_t)mx.esize,
        .exp = bin_exponent(k), .droppad = droppad, .active = active,
    };
    job.nb = a->arch35 ? 3 : (int64_t)1 << job.exp; /* arch35: the sum and two group buffers */
    if (run_tokens(&job)) {
        snprintf(msg, len, "emulator out of host memory");
        status = ACL_ERROR_RT_INTERNAL_ERROR;
        goto done;
    }
    /* 9.1's l0op::ViewCopy, the next kernel on the stream: the dense result into out's view. */
    if (dense) aclemuViewCopy(dense, &a->out, mo.host, mo.lo);
    if (a->mutation == EMU_MUT_OVERRUN && views[2]->bytes) overrun(views[2], mx.esize);
    status = 0;

done:
    free(ids_buf);
    aclemuUnpinMany(pins, n);
    return status;
}
