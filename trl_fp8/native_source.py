"""The C source of the fused CPU export kernels (stochastic rounding, error feedback) that
:mod:`trl_fp8.native` compiles on first use, and of the bitwise comparison the weight-sync checks use on
CPU tensors and the token statistics of their logprob check; kept apart from the build and load logic. The source is part of the library's cache key: any change here
builds a new library."""

C_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x7FEB352DU; x ^= x >> 15; x *= 0x846CA68BU; x ^= x >> 16;
    return x;
}

/* Round-to-nearest-even fp32 bits -> bf16 bits, for finite inputs whose result is finite. */
static inline uint16_t rne_bf16(uint32_t b) {
    return (uint16_t)((b + 0x7FFFU + ((b >> 16) & 1U)) >> 16);
}

#define SR_BLOCK 4096
#define EXP_MASK 0x7F800000U
#define GOLDEN 0x9E3779B9U

/* The full rule for one element: fp32 bits b plus 16 random bits r, truncated to bf16; inf kept, NaN -> canonical
   NaN, a finite value whose sum overflows saturates at +-max finite. */
static inline uint16_t sr_full(uint32_t b, uint32_t r) {
    uint32_t s = b + r;
    uint32_t out = s >> 16;
    uint32_t sat = ((b >> 16) & 0x8000U) | 0x7F7FU;
    uint32_t special = (b & 0x007FFFFFU) ? 0x7FC0U : (b >> 16);
    out = ((s & EXP_MASK) == EXP_MASK) ? sat : out;
    out = ((b & EXP_MASK) == EXP_MASK) ? special : out;
    return (uint16_t)out;
}

/* One block of at most SR_BLOCK elements whose first element draws counter c0. Written for 32-bit vector lanes
   (AVX2 as much as AVX-512): the counter hash (c0 + k) * GOLDEN + key is carried as h += GOLDEN (no multiply, no
   64-bit index to narrow per vector), and the common case (finite in, finite out: (b + r) >> 16) runs in one pass
   that keeps the largest exponent field seen in b or b + r; only a block where it is all ones (an inf/NaN input,
   or a sum that overflowed) is redone with the full rule. The same bits as sr_full everywhere. */
static inline void sr_block(const uint32_t *restrict src, uint16_t *restrict dst, uint32_t count, uint32_t c0,
                            uint32_t key) {
    uint32_t h = c0 * GOLDEN + key;
    uint32_t worst = 0;
    #pragma omp simd reduction(max:worst) linear(h:GOLDEN)
    for (uint32_t k = 0; k < count; ++k) {
        uint32_t b = src[k];
        uint32_t s = b + (mix32(h) >> 16);
        uint32_t eb = b & EXP_MASK, es = s & EXP_MASK;
        uint32_t e = eb > es ? eb : es;
        worst = worst > e ? worst : e;
        dst[k] = (uint16_t)(s >> 16);
        h += GOLDEN;
    }
    if (worst == EXP_MASK) {
        uint32_t g = c0 * GOLDEN + key;
        for (uint32_t k = 0; k < count; ++k, g += GOLDEN)
            dst[k] = sr_full(src[k], mix32(g) >> 16);
    }
}

/* offset: the global index of src[0] in its tensor (a shard's start), so shards draw the one-process bits
   (element i draws counter (uint32)(offset + i)). */
void trl_fp8_sr_bf16(const uint32_t *src, uint16_t *dst, int64_t n, uint32_t key, int nthreads, int64_t offset) {
    int64_t blocks = (n + SR_BLOCK - 1) / SR_BLOCK;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t j = 0; j < blocks; ++j) {
        int64_t start = j * SR_BLOCK;
        int64_t count = n - start < SR_BLOCK ? n - start : SR_BLOCK;
        sr_block(src + start, dst + start, (uint32_t)count, (uint32_t)(start + offset), key);
    }
}

/* Branch-free (one vector pass with AVX2 as with AVX-512): a non-finite input passes through (NaN -> canonical NaN)
   and leaves a zero residual; the finite path's lanes are computed for every element and selected away there. */
void trl_fp8_ef_bf16(const float *src, float *res, uint16_t *dst, int64_t n, int nthreads) {
    #pragma omp parallel for simd schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n; ++i) {
        float w = src[i];
        uint32_t bw, b, q32;
        memcpy(&bw, &w, 4);
        int finite = (bw & 0x7F800000U) != 0x7F800000U;
        float v = w + res[i];
        memcpy(&b, &v, 4);
        /* saturate at +-big in the integers (a float compare is not if-converted under -ftrapping-math): |v| past
           big (0x7F7F0000), infinities included, becomes +-big; a NaN (above 0x7F800000) stays NaN */
        uint32_t mag = b & 0x7FFFFFFFU;
        b = (mag > 0x7F7F0000U && mag <= 0x7F800000U) ? ((b & 0x80000000U) | 0x7F7F0000U) : b;
        memcpy(&v, &b, 4);
        uint16_t q = rne_bf16(b);
        q32 = ((uint32_t)q) << 16;
        float qf;
        memcpy(&qf, &q32, 4);
        float r = v - qf;  /* computed for every lane (only a NaN's invalid flag differs), then selected */
        uint32_t rb;
        memcpy(&rb, &r, 4);
        rb &= 0U - (uint32_t)finite;  /* +0.0f where not finite, selected in the integers (a float select lets the
                                         compiler sink the subtraction into a branch it cannot vectorize) */
        memcpy(res + i, &rb, 4);
        uint16_t passed = (bw & 0x007FFFFFU) ? (uint16_t)0x7FC0U : (uint16_t)(bw >> 16);
        dst[i] = finite ? q : passed;
    }
}

/* The index of the first of count pairs whose memory differs, or -1. Pair i is a[i], b[i] (addresses) and n[i]:
   kind[i] 0 compares n[i] bytes as they are; kind[i] 1 compares n[i] fp32 words at a[i] with the n[i] bf16 words at
   b[i] widened exactly (b << 16: fp32 bits equal to a bf16 value's), without a widened copy. */
int64_t trl_fp8_first_unequal(int64_t count, const uint64_t *a, const uint64_t *b, const int64_t *n,
                              const int32_t *kind) {
    for (int64_t i = 0; i < count; ++i) {
        if (kind[i] == 0) {
            if (n[i] > 0 && memcmp((const void *)(uintptr_t)a[i], (const void *)(uintptr_t)b[i], (size_t)n[i]))
                return i;
            continue;
        }
        const uint32_t *x = (const uint32_t *)(uintptr_t)a[i];
        const uint16_t *y = (const uint16_t *)(uintptr_t)b[i];
        uint32_t diff = 0;
        #pragma omp simd reduction(|:diff)
        for (int64_t k = 0; k < n[i]; ++k)
            diff |= x[k] ^ ((uint32_t)y[k] << 16);
        if (diff)
            return i;
    }
    return -1;
}

static inline int mask_at(const void *m, int width, int64_t i) {
    switch (width) {
    case 1: return ((const uint8_t *)m)[i] != 0;
    case 2: return ((const uint16_t *)m)[i] != 0;
    case 4: return ((const uint32_t *)m)[i] != 0;
    default: return ((const uint64_t *)m)[i] != 0;
    }
}

/* The logprob check's token statistics (trl_fp8/sync_checks/tokenstats.py) over a rows x cols batch in one pass.
   On the tokens where mask is set, the gap w = (double)(learner - sampler) (an fp32 subtraction, widened):
   out[0] sum |w|, [1] sum w^2, [2] tokens, [3] max |w|, [4] the masked (row-major) index of the first largest,
   [5] sum exp(w), [6] min exp(w), [7] max exp(w); per row with a token, r = exp(sum of its w): [8] sum r, [9] min r,
   [10] max r, [11] rows. With reference (else NULL), on the tokens where covered (NULL: mask) and mask are set:
   [12] sum |(double)(learner - reference)|, [13] sum |(double)(reference - sampler)|, [14] sum |w|, [15] tokens,
   [16] sum w^2. Then out[17 + k], k = 0..n_edges: the tokens whose |w| has k of the ascending edges at or below it.
   Masks are 0/nonzero words of mask_width / covered_width bytes (1, 2, 4, 8). out is zeroed here. Returns 0, or 1
   (out then means nothing) when a masked gap is not finite: the caller computes those statistics another way. */
int trl_fp8_logprob_stats(int64_t rows, int64_t cols, const float *learner, const float *sampler, const void *mask,
                          int mask_width, const float *reference, const void *covered, int covered_width,
                          const double *edges, int64_t n_edges, double *out) {
    memset(out, 0, sizeof(double) * (size_t)(17 + n_edges + 1));
    double *hist = out + 17;
    double largest = -1.0, where = -1.0, ratio_min = INFINITY, ratio_max = -INFINITY;
    double seq_min = INFINITY, seq_max = -INFINITY;
    int64_t count = 0;
    for (int64_t r = 0; r < rows; ++r) {
        double row_sum = 0.0;
        int any = 0;
        for (int64_t c = 0; c < cols; ++c) {
            int64_t i = r * cols + c;
            if (!mask_at(mask, mask_width, i))
                continue;
            float gap = learner[i] - sampler[i];
            double w = (double)gap;
            if (!isfinite(w))
                return 1;
            double d = fabs(w);
            out[0] += d;
            out[1] += d * d;
            if (d > largest) {
                largest = d;
                where = (double)count;
            }
            double ratio = exp(w);
            out[5] += ratio;
            if (ratio < ratio_min) ratio_min = ratio;
            if (ratio > ratio_max) ratio_max = ratio;
            row_sum += w;
            any = 1;
            int64_t lo = 0, hi = n_edges;  /* the number of edges <= d */
            while (lo < hi) {
                int64_t mid = lo + (hi - lo) / 2;
                if (edges[mid] <= d) lo = mid + 1; else hi = mid;
            }
            hist[lo] += 1.0;
            ++count;
            if (reference && (!covered || mask_at(covered, covered_width, i))) {
                float explained = learner[i] - reference[i], path = reference[i] - sampler[i];
                out[12] += fabs((double)explained);
                out[13] += fabs((double)path);
                out[14] += d;
                out[15] += 1.0;
                out[16] += d * d;
            }
        }
        if (any) {
            double seq = exp(row_sum);
            out[8] += seq;
            if (seq < seq_min) seq_min = seq;
            if (seq > seq_max) seq_max = seq;
            out[11] += 1.0;
        }
    }
    out[2] = (double)count;
    out[3] = count ? largest : 0.0;
    out[4] = where;
    out[6] = ratio_min; out[7] = ratio_max; out[9] = seq_min; out[10] = seq_max;
    return 0;
}
"""
