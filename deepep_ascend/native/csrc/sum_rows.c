/* Combine's reduction in one pass: every output row is the float32 sum of its BF16 input rows,
 * added in source order to a +0.0 (or bias) start and rounded once to BF16 -- DeepEP's combine
 * arithmetic, the bits of deepep_ascend.ep.reduce.accumulate_rows' torch paths.
 *
 * Plain C, no Python headers: deepep_ascend/native.py loads it with ctypes (which releases the
 * GIL for the call). Built by setuptools as an optional extension (pyproject.toml); without it
 * the library falls back to the torch paths.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

/* Bumped whenever an exported signature changes: native.py refuses a library built from an older
 * source (an editable install whose extension was not rebuilt) instead of calling it wrongly. It
 * covers moe_act.c, amx_gemm.c, ll_rows.c, ll_calls.c, ll_cast.c and layout.c too (one library). */
int64_t deepep_native_abi(void) { return 31; }

/* Floats of one output row summed at a time: the accumulator (4 KiB) stays in L1 while every
 * input row's slice streams past it. */
#define CHUNK 1024

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* -1: not asked yet; then whether deepep_row_sum_avx2 runs. By default where the CPU has AVX2 but not
 * AVX-512BW: the AVX-512 hosts keep the x86-64-v4 clones of the portable loops, which this kernel was not
 * measured against (python -m bench combine-sum times both where it runs). */
static int avx2_on = -1;

int deepep_row_sums_avx2_on(void)
{
    if (avx2_on < 0)
        avx2_on = __builtin_cpu_supports("avx2") && !__builtin_cpu_supports("avx512bw");
    return avx2_on;
}

/* Whether the register-blocked AVX2 row sums run (mode -1: unchanged), for tests and benchmarks of both paths:
 * mode 0 turns them off (the portable loops, the same bits), 1 on where the CPU has AVX2, 2 back to the
 * default. Returns the state after the call. */
int64_t deepep_row_sums_avx2(int64_t mode)
{
    if (mode == 0)
        avx2_on = 0;
    else if (mode == 1)
        avx2_on = __builtin_cpu_supports("avx2") ? 1 : 0;
    else if (mode == 2)
        avx2_on = -1;
    return deepep_row_sums_avx2_on();
}

/* 8 BF16 values widened to float32 (exact: the bits shifted into the high half). */
__attribute__((target("avx2"))) static inline __m256 bf16x8(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* f32_to_bf16 on 8 lanes, as 32-bit lanes holding the 16-bit results. */
__attribute__((target("avx2"))) static inline __m256i bf16_round8(__m256 f, __m256i nan)
{
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                              _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, nan, is_nan);
}

/* 8 rounded lanes stored as 8 BF16 values. */
__attribute__((target("avx2"))) static inline void store8(uint16_t *o, __m256 f, __m256i nan)
{
    const __m256i packed = _mm256_packus_epi32(bf16_round8(f, nan), _mm256_setzero_si256()); /* per 128-bit lane */
    _mm_storeu_si128((__m128i *)o, _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xD8)));
}

/* Columns [h, h + 8 * nv) of the output row, their sums in nv registers while every row is added. Inlined with
 * nv a constant (8, then 1), so that the compiler keeps the array in registers. */
__attribute__((target("avx2"), always_inline)) static inline void sum_columns(
    int64_t h, int nv, int64_t n, const uint16_t *const *row, const float *w, const uint16_t *b0, const uint16_t *b1,
    uint16_t *o, __m256i nan)
{
    __m256 a[8];
    for (int i = 0; i < nv; i++)
        a[i] = b0 && b1 ? _mm256_add_ps(bf16x8(b0 + h + 8 * i), bf16x8(b1 + h + 8 * i))
               : b0     ? _mm256_add_ps(bf16x8(b0 + h + 8 * i), _mm256_setzero_ps())
                        : _mm256_setzero_ps();
    if (w) {
        for (int64_t j = 0; j < n; j++) {
            const __m256 wj = _mm256_set1_ps(w[j]);
            for (int i = 0; i < nv; i++)
                a[i] = _mm256_add_ps(a[i], _mm256_mul_ps(bf16x8(row[j] + h + 8 * i), wj));
        }
    } else {
        for (int64_t j = 0; j < n; j++)
            for (int i = 0; i < nv; i++)
                a[i] = _mm256_add_ps(a[i], bf16x8(row[j] + h + 8 * i));
    }
    for (int i = 0; i < nv; i++)
        store8(o + h + 8 * i, a[i], nan);
}

/* bf16.h's contract. 64 columns at a time in eight registers, then 8 at a time in one, the last few by the
 * scalar arithmetic of the portable loops. No FMA: a product is rounded before its add, as there. */
__attribute__((target("avx2"))) void deepep_row_sum_avx2(int64_t hidden, int64_t n, const uint16_t *const *row,
                                                          const float *w, const uint16_t *b0, const uint16_t *b1,
                                                          uint16_t *o, uint16_t nan_bits)
{
    const __m256i nan = _mm256_set1_epi32(nan_bits);
    int64_t h = 0;
    for (; h + 64 <= hidden; h += 64)
        sum_columns(h, 8, n, row, w, b0, b1, o, nan);
    for (; h + 8 <= hidden; h += 8)
        sum_columns(h, 1, n, row, w, b0, b1, o, nan);
    for (; h < hidden; h++) {
        float acc = b0 && b1 ? bf16_to_f32(b0[h]) + bf16_to_f32(b1[h]) : b0 ? bf16_to_f32(b0[h]) + 0.0f : 0.0f;
        for (int64_t j = 0; j < n; j++)
            acc += w ? bf16_to_f32(row[j][h]) * w[j] : bf16_to_f32(row[j][h]);
        o[h] = f32_to_bf16(acc, nan_bits);
    }
}
#else
int deepep_row_sums_avx2_on(void) { return 0; }

int64_t deepep_row_sums_avx2(int64_t mode)
{
    (void)mode;
    return 0;
}

void deepep_row_sum_avx2(int64_t hidden, int64_t n, const uint16_t *const *row, const float *w, const uint16_t *b0,
                         const uint16_t *b1, uint16_t *o, uint16_t nan_bits)
{
    (void)hidden, (void)n, (void)row, (void)w, (void)b0, (void)b1, (void)o, (void)nan_bits;
}
#endif


/* out[t] = bf16(start(t) + sum over sources j, in order, of the rows i of j with tokens[j][i] == t)
 * (or, with row_key, over the token's rows in ascending key order, ties in source order)
 *
 * m, hidden       output rows and columns; out row t at out + t * out_ld (elements)
 * tokens[j]       ascending token ids in [0, m) of source j's counts[j] rows (int64)
 * rows[j]         source j's first row; its row i at rows[j] + r * row_ld[j], r = i, or r =
 *                 row_index[j][i] if row_index and row_index[j] are not NULL (a gather: the
 *                 caller checks those indices)
 * row_key[j]      NULL, or the sort key of each of source j's rows (int64): a token's rows are added
 *                 in ascending key, ties in source order -- EPBuffer's combine adds each rank's row
 *                 at the position of that rank's last top-k slot (docs/semantics/deepep-api.md)
 * bias0, bias1    NULL, or row t at bias + t * ld: start(t) = f32(bias0[t]) + f32(bias1[t]), a
 *                 missing one being +0.0; with no bias start(t) = +0.0
 *
 * Returns 0; -1 if memory ran out (rows from that token on not written); j + 1 if source j has a
 * token outside [0, m) or out of order (those rows were left out of the sums).
 */
MULTIVERSION
int64_t deepep_sum_rows_bf16(int64_t m, int64_t hidden, int64_t num_sources,
                             const int64_t *const *tokens, const int64_t *counts,
                             const uint16_t *const *rows, const int64_t *row_ld,
                             const int64_t *const *row_index,
                             const int64_t *const *row_key,
                             const uint16_t *bias0, int64_t bias0_ld,
                             const uint16_t *bias1, int64_t bias1_ld,
                             uint16_t *out, int64_t out_ld, uint16_t nan_bits)
{
    int64_t cap = num_sources > 0 ? num_sources : 1;
    int64_t *cur = calloc((size_t)cap, sizeof *cur);
    const uint16_t **row = malloc((size_t)cap * sizeof *row); /* this token's rows, in order */
    int64_t *key = malloc((size_t)cap * sizeof *key);          /* their keys, with row_key */
    if (!cur || !row || !key) {
        free(cur);
        free(row);
        free(key);
        return -1;
    }
    int64_t status = 0;
    float acc[CHUNK];
    for (int64_t t = 0; t < m && !status; t++) {
        int64_t n = 0;
        for (int64_t j = 0; j < num_sources; j++) {
            for (; cur[j] < counts[j] && tokens[j][cur[j]] == t; cur[j]++) {
                if (n == cap) {
                    const uint16_t **grown = realloc(row, (size_t)(2 * cap) * sizeof *row);
                    if (grown)
                        row = grown;
                    int64_t *grown_key = grown ? realloc(key, (size_t)(2 * cap) * sizeof *key) : NULL;
                    if (!grown_key) {
                        status = -1;
                        break;
                    }
                    key = grown_key;
                    cap *= 2;
                }
                const int64_t r = row_index && row_index[j] ? row_index[j][cur[j]] : cur[j];
                key[n] = row_key && row_key[j] ? row_key[j][cur[j]] : 0;
                row[n++] = rows[j] + r * row_ld[j];
            }
            if (status)
                break;
        }
        if (status)
            break;
        if (row_key) {
            /* stable insertion sort by key: a token has a handful of rows */
            for (int64_t a = 1; a < n; a++) {
                const int64_t k = key[a];
                const uint16_t *p = row[a];
                int64_t b = a;
                for (; b > 0 && key[b - 1] > k; b--) {
                    key[b] = key[b - 1];
                    row[b] = row[b - 1];
                }
                key[b] = k;
                row[b] = p;
            }
        }
        uint16_t *o = out + t * out_ld;
        const uint16_t *b0 = bias0 ? bias0 + t * bias0_ld : NULL;
        const uint16_t *b1 = bias1 ? bias1 + t * bias1_ld : NULL;
        if ((b0 || n >= 2) && deepep_row_sums_avx2_on()) { /* one row alone: the integer lanes below are faster */
            deepep_row_sum_avx2(hidden, n, row, NULL, b0, b1, o, nan_bits);
            continue;
        }
        for (int64_t h0 = 0; h0 < hidden; h0 += CHUNK) {
            const int64_t w = hidden - h0 < CHUNK ? hidden - h0 : CHUNK;
            if (!b0 && n <= 2) {
                /* the common cases, without an accumulator: +0.0 + a (+ b), rounded */
                if (n == 0) {
                    for (int64_t h = 0; h < w; h++)
                        o[h0 + h] = 0;
                } else if (n == 1) {
                    /* bf16(+0.0 + f32(a)) is a itself but for -0.0 (+0.0) and NaN (nan_bits): integer lanes */
                    const uint16_t *a = row[0] + h0;
                    for (int64_t h = 0; h < w; h++) {
                        const uint16_t v = a[h];
                        o[h0 + h] = (uint16_t)((v & 0x7fffu) > 0x7f80u ? nan_bits : v == 0x8000u ? 0u : v);
                    }
                } else {
                    const uint16_t *a = row[0] + h0, *b = row[1] + h0;
                    for (int64_t h = 0; h < w; h++)
                        o[h0 + h] = f32_to_bf16((0.0f + bf16_to_f32(a[h])) + bf16_to_f32(b[h]), nan_bits);
                }
                continue;
            }
            if (b0 && b1) {
                for (int64_t h = 0; h < w; h++)
                    acc[h] = bf16_to_f32(b0[h0 + h]) + bf16_to_f32(b1[h0 + h]);
            } else if (b0) {
                for (int64_t h = 0; h < w; h++)
                    acc[h] = bf16_to_f32(b0[h0 + h]) + 0.0f;
            } else {
                for (int64_t h = 0; h < w; h++)
                    acc[h] = 0.0f;
            }
            /* every row but the last into acc; the last one's add is fused with the rounding */
            for (int64_t r = 0; r + 1 < n; r++) {
                const uint16_t *a = row[r] + h0;
                for (int64_t h = 0; h < w; h++)
                    acc[h] += bf16_to_f32(a[h]);
            }
            if (n) {
                const uint16_t *a = row[n - 1] + h0;
                for (int64_t h = 0; h < w; h++)
                    o[h0 + h] = f32_to_bf16(acc[h] + bf16_to_f32(a[h]), nan_bits);
            } else {
                for (int64_t h = 0; h < w; h++)
                    o[h0 + h] = f32_to_bf16(acc[h], nan_bits);
            }
        }
    }
    for (int64_t j = 0; j < num_sources && !status; j++)
        if (cur[j] != counts[j])
            status = j + 1;
    free(cur);
    free(row);
    free(key);
    return status;
}
