/* LogFMT-10 (the low-latency combine's lossy transport, docs/semantics/deepep-api.md §6.3) over groups of 128
 * BF16 channels, one pass per step where torch makes about twenty over int64 and float64 temporaries.
 *
 *   deepep_logfmt_meta    each group's (amax, amin) magnitude bits: the format's metadata
 *   deepep_logfmt_params  each group's parameters from them (lb, step, rho; the decoder's 2**step and 2**lb)
 *   deepep_logfmt_encode  each group's 160-byte body (ten-bit codes, or a BF16 group's first 160 bytes) and
 *                         the BF16 groups' last 96 bytes, in group order
 *   deepep_logfmt_decode  float32 values from body, tail and the groups' parameters
 *   deepep_logfmt_avx512  whether the AVX-512 paths run (tests switch them off to check the portable ones)
 *
 * Each repeats the torch path's arithmetic (deepep_ascend.gemm.logfmt) operation by operation in the same
 * precision (float32 for the codes, float64 for the parameters' series and the decode tables, no contraction:
 * -ffp-contract=off), so both paths give the same bits (tests/native/test_logfmt.py).
 *
 * Plain C, no Python headers, loaded with ctypes; built for any x86-64, the widest vector unit picked at run time
 * (bf16.h). The callers (deepep_ascend.native.logfmt) check shapes, dtypes and contiguity.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define GROUP 128
#define BODY 160
#define TAIL 96

/* The element lookups (a 32768-entry table in the encoder, two 32-entry ones per group in the decoder) are
 * gathers, which GCC emulates lane by lane; with AVX-512 they are one instruction per 16 values (a gather, a
 * two-register permute). Same operations, same bits. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX512_PATH 1

static int avx512_on = -1; /* -1: not asked yet; then whether the AVX-512 paths run */

static int avx512f(void) {
    if (avx512_on < 0)
        avx512_on = __builtin_cpu_supports("avx512f") ? 1 : 0;
    return avx512_on;
}
#endif

/* Whether the AVX-512 paths run (mode -1: unchanged), for tests of both paths: mode 0 turns them off, 1 on where
 * the CPU has AVX-512F. Returns the state after the call. */
int64_t deepep_logfmt_avx512(int64_t mode) {
#ifdef HAVE_AVX512_PATH
    if (mode == 0)
        avx512_on = 0;
    else if (mode == 1)
        avx512_on = __builtin_cpu_supports("avx512f") ? 1 : 0;
    return avx512f();
#else
    (void)mode;
    return 0;
#endif
}

#ifdef HAVE_AVX512_PATH

/* q[j] = log2_of[v[j] & 0x7FFF], j < 128 */
__attribute__((target("avx512f"))) static void gather_log2_avx512(const uint16_t *v, const float *log2_of, float *q) {
    for (int j = 0; j < GROUP; j += 16) {
        const __m512i m = _mm512_and_si512(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + j))),
                                           _mm512_set1_epi32(0x7FFF));
        _mm512_storeu_ps(q + j, _mm512_i32gather_ps(m, log2_of, 4));
    }
}

/* o[j] for the ten-bit values lo[j] | top[j] << 8: ±mag[c' >> 5] · fine[c' & 31], c' = (v & 0x1FF) + 31, the
 * sign only where c' >> 5 > 0 (mag[0] = +0 stays +0) */
__attribute__((target("avx512f"))) static void decode_values_avx512(const uint8_t *lo, const uint8_t *top,
                                                                   const float *mag, const float *fine, float *o) {
    const __m512 f0 = _mm512_loadu_ps(fine), f1 = _mm512_loadu_ps(fine + 16);
    const __m512 m0 = _mm512_loadu_ps(mag), m1 = _mm512_loadu_ps(mag + 16);
    for (int j = 0; j < GROUP; j += 16) {
        const __m512i v = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(lo + j))),
                                          _mm512_slli_epi32(_mm512_cvtepu8_epi32(
                                              _mm_loadu_si128((const __m128i *)(top + j))), 8));
        const __m512i c = _mm512_add_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x1FF)), _mm512_set1_epi32(31));
        const __m512i k = _mm512_srli_epi32(c, 5);
        const __m512 r = _mm512_mul_ps(_mm512_permutex2var_ps(m0, k, m1),
                                       _mm512_permutex2var_ps(f0, _mm512_and_si512(c, _mm512_set1_epi32(31)), f1));
        const __mmask16 neg = _mm512_test_epi32_mask(v, _mm512_set1_epi32(0x200)) &
                              _mm512_cmpneq_epi32_mask(k, _mm512_setzero_si512());
        _mm512_storeu_si512(o + j, _mm512_mask_xor_epi32(_mm512_castps_si512(r), neg, _mm512_castps_si512(r),
                                                         _mm512_set1_epi32((int)0x80000000u)));
    }
}
#endif

/* meta[2g], meta[2g+1] = the largest magnitude of group g and its smallest nonzero one (0 if every element is
 * zero), as bf16 bits without the sign; a NaN's bits order above inf's, as in the torch path. */
MULTIVERSION void deepep_logfmt_meta(int64_t g, const uint16_t *x, int16_t *meta) {
    for (int64_t i = 0; i < g; ++i) {
        const uint16_t *v = x + i * GROUP;
        uint16_t hi = 0, lo = 0x7FFF;
        for (int j = 0; j < GROUP; ++j) {
            const uint16_t m = v[j] & 0x7FFF;
            const uint16_t m1 = (uint16_t)((m - 1) & 0x7FFF); /* 0 -> 0x7FFF: zeros never the minimum */
            hi = m > hi ? m : hi;
            lo = m1 < lo ? m1 : lo;
        }
        meta[2 * i] = (int16_t)hi;
        meta[2 * i + 1] = (int16_t)(hi == 0 ? 0 : lo + 1);
    }
}

/* e**r - 1 by Horner's rule on the Taylor series to degree (deepep_ascend.gemm.logfmt._expm1_f64) */
static double expm1_series(double r, int degree) {
    double q = 1.0;
    for (int k = degree; k > 1; --k)
        q = 1.0 + q * r / (double)k;
    return q * r;
}

/* Each group's parameters from its metadata (deepep_ascend.gemm.logfmt._logfmt_params, operation by operation):
 * la = log2_of[amax], lb = max(log2_of[amin], la - 32), use = la < 0 and lb < la; where use, step = (la - lb) /
 * 510 (float32) and rho = 2 - log2((1 + 2**step) / 2) / step, else lb = 0, step = 1; p = 2**step and
 * two_lb = 2**lb (float64 series, the decoder's). Returns the groups without use. */
int64_t deepep_logfmt_params(int64_t g, const int16_t *meta, const float *log2_of, uint8_t *use, float *lb,
                             float *step, float *rho, double *p, double *two_lb) {
    const double ln2 = 0.6931471805599453;
    int64_t fallback = 0;
    for (int64_t i = 0; i < g; ++i) {
        const float la = log2_of[meta[2 * i] & 0x7FFF]; /* torch indexes a negative int16 from the end: the same */
        const float lo = log2_of[meta[2 * i + 1] & 0x7FFF], clip = la - 32.0f;
        float b = lo > clip ? lo : clip;
        const int u = la < 0.0f && b < la;
        const float st = u ? (la - b) / 510.0f : 1.0f;
        b = u ? b : 0.0f;
        const double s = (double)st;
        const double em1 = expm1_series(s * ln2, 10);
        const double h = em1 / 2.0;
        const double z = h / (2.0 + h);
        const double z2 = z * z;
        const double atanh = z * (1.0 + z2 * (1.0 / 3 + z2 * (1.0 / 5 + z2 * (1.0 / 7 + z2 / 9))));
        const double v = (double)b, n = __builtin_floor(v);
        const int64_t scale_bits = ((int64_t)n + 1023) * ((int64_t)1 << 52); /* 2**n from the bits */
        double scale;
        memcpy(&scale, &scale_bits, 8);
        use[i] = (uint8_t)u;
        lb[i] = b;
        step[i] = st;
        rho[i] = (float)(2.0 - (2.0 * atanh / ln2) / s);
        p[i] = 1.0 + em1;
        two_lb[i] = (1.0 + expm1_series((v - n) * ln2, 14)) * scale;
        fallback += !u;
    }
    return fallback;
}

/* Groups with use[g] get codes c = (int)clamp(((log2_of[|x|] - lb) / step) + rho, 0, 511) (float32, each
 * operation rounded), the ten-bit value c | sign << 9 written as two planes (bytes 0..127 the low 8 bits,
 * byte 128 + j/4 bits 8-9 of value j at bit 2·(j % 4)); the others their BF16 bytes 0..159 into body and
 * 160..255 into the next row of tail. Returns 0, or 1 (body written, tail partly) when the groups without
 * use are not exactly num_tail. */
MULTIVERSION int64_t deepep_logfmt_encode(int64_t g, const uint16_t *x, const uint8_t *use, const float *lb,
                                          const float *step, const float *rho, const float *log2_of, uint8_t *body,
                                          uint8_t *tail, int64_t num_tail) {
    int64_t f = 0;
    for (int64_t i = 0; i < g; ++i) {
        const uint16_t *v = x + i * GROUP;
        uint8_t *b = body + i * BODY;
        if (!use[i]) {
            memcpy(b, v, BODY);
            if (f < num_tail)
                memcpy(tail + f * TAIL, (const uint8_t *)v + BODY, TAIL);
            ++f;
            continue;
        }
        const float l = lb[i], s = step[i], r = rho[i];
        float q[GROUP];
        int32_t c[GROUP];
#ifdef HAVE_AVX512_PATH
        if (avx512f())
            gather_log2_avx512(v, log2_of, q);
        else
#endif
            for (int j = 0; j < GROUP; ++j) /* the table lookups apart, so the arithmetic below vectorizes */
                q[j] = log2_of[v[j] & 0x7FFF];
        for (int j = 0; j < GROUP; ++j) {
            float t = ((q[j] - l) / s) + r;
            t = t > 0.0f ? t : 0.0f; /* -inf (a zero) to 0; t is never NaN in a group that uses the format */
            t = t < 511.0f ? t : 511.0f;
            c[j] = (int32_t)t | ((int32_t)(v[j] >> 15) << 9);
        }
        uint8_t top[GROUP];
        for (int j = 0; j < GROUP; ++j) {
            b[j] = (uint8_t)c[j];
            top[j] = (uint8_t)((c[j] >> 8) & 3);
        }
        /* four values' top bits from one little-endian word of top[]: byte u's two bits to bits 2u, 2u + 1 */
        for (int w = 0; w < GROUP / 4; ++w) {
            uint32_t t;
            memcpy(&t, top + 4 * w, 4);
            b[GROUP + w] = (uint8_t)((t & 0x3) | ((t >> 6) & 0xC) | ((t >> 12) & 0x30) | ((t >> 18) & 0xC0));
        }
    }
    return f == num_tail ? 0 : 1;
}

/* out[g, 128] float32: a group with use[g] decodes value c | sign << 9 to sign · coarse[k] · fine[l] with
 * c + 31 = 32k + l (c = 0: +0), fine[l] = p^l and coarse[k] = (p^31 · p)^(k - 1) · two_lb (float64 products
 * in this order, each table rounded to float32 once, the product in float32), p = 2**step; the others are
 * their BF16 bytes (body's 160, then their tail row's 96) widened exactly. Returns 0, or 1 (groups after the
 * last tail row left unwritten) when the groups without use outnumber num_tail. */
MULTIVERSION int64_t deepep_logfmt_decode(int64_t g, const uint8_t *body, const uint8_t *tail, int64_t num_tail,
                                          const uint8_t *use, const double *p, const double *two_lb, float *out) {
    int64_t f = 0;
    for (int64_t i = 0; i < g; ++i) {
        const uint8_t *b = body + i * BODY;
        float *o = out + i * GROUP;
        if (!use[i]) {
            if (f >= num_tail)
                return 1;
            uint16_t raw[GROUP];
            memcpy(raw, b, BODY);
            memcpy((uint8_t *)raw + BODY, tail + f * TAIL, TAIL);
            ++f;
            for (int j = 0; j < GROUP; ++j) {
                const uint32_t w = (uint32_t)raw[j] << 16;
                memcpy(o + j, &w, 4);
            }
            continue;
        }
        /* mag[k] = |coarse| of k = c' >> 5: mag[0] = 0, mag[k] = (p^31 · p)^(k-1) · two_lb (k = 1..16); the
         * sign of a value applies to k > 0 only (torch's table: +0 at k = 0 for either sign) */
        double fd[32], cd = 1.0;
        float fine[32], mag[32] = {0.0f};
        fd[0] = 1.0;
        for (int l = 1; l < 32; ++l)
            fd[l] = fd[l - 1] * p[i];
        const double stride = fd[31] * p[i];
        for (int k = 0; k < 16; ++k) {
            if (k)
                cd = cd * stride;
            mag[1 + k] = (float)(cd * two_lb[i]);
        }
        for (int l = 0; l < 32; ++l)
            fine[l] = (float)fd[l];
        uint8_t top[GROUP];
        for (int w = 0; w < GROUP / 4; ++w) { /* byte w's bit pairs to four bytes (the inverse of the encoder's) */
            const uint32_t t = b[GROUP + w];
            const uint32_t spread = (t & 0x3) | ((t & 0xC) << 6) | ((t & 0x30) << 12) | ((t & 0xC0) << 18);
            memcpy(top + 4 * w, &spread, 4);
        }
#ifdef HAVE_AVX512_PATH
        if (avx512f()) {
            decode_values_avx512(b, top, mag, fine, o);
            continue;
        }
#endif
        for (int j = 0; j < GROUP; ++j) {
            const int32_t v = b[j] | (top[j] << 8);
            const int32_t c = (v & 0x1FF) + 31;
            const float r = mag[c >> 5] * fine[c & 31];
            o[j] = (v & 0x200) && (c >> 5) ? -r : r;
        }
    }
    return 0;
}
