/* Combine's reduction in one pass: every output row is the float32 sum of its BF16 input rows,
 * added in source order to a +0.0 (or bias) start and rounded once to BF16 -- DeepEP's combine
 * arithmetic, the bits of deepep_ascend.intranode.accumulate_rows' torch paths.
 *
 * Plain C, no Python headers: deepep_ascend/native.py loads it with ctypes (which releases the
 * GIL for the call). Built by setuptools as an optional extension (pyproject.toml); without it
 * the library falls back to the torch paths.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Floats of one output row summed at a time: the accumulator (4 KiB) stays in L1 while every
 * input row's slice streams past it. */
#define CHUNK 1024

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion; NaN becomes nan_bits (torch's
 * canonical NaN, passed in by the caller so both agree bit for bit). */
static inline uint16_t f32_to_bf16(float f, uint16_t nan_bits)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return nan_bits;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__x86_64__) && defined(__GNUC__)
/* One build for any x86-64; the loader picks the widest vector unit at run time. */
#define MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MULTIVERSION
#endif

/* out[t] = bf16(start(t) + sum over sources j, in order, of the rows i of j with tokens[j][i] == t)
 *
 * m, hidden       output rows and columns; out row t at out + t * out_ld (elements)
 * tokens[j]       ascending token ids in [0, m) of source j's counts[j] rows (int64)
 * rows[j]         source j's first row; row i at rows[j] + i * row_ld[j]
 * bias0, bias1    NULL, or row t at bias + t * ld: start(t) = f32(bias0[t]) + f32(bias1[t]), a
 *                 missing one being +0.0; with no bias start(t) = +0.0
 *
 * Returns 0; -1 if memory for the cursors ran out (nothing written); j + 1 if source j has a
 * token outside [0, m) or out of order (those rows were left out of the sums).
 */
MULTIVERSION
int64_t deepep_sum_rows_bf16(int64_t m, int64_t hidden, int64_t num_sources,
                             const int64_t *const *tokens, const int64_t *counts,
                             const uint16_t *const *rows, const int64_t *row_ld,
                             const uint16_t *bias0, int64_t bias0_ld,
                             const uint16_t *bias1, int64_t bias1_ld,
                             uint16_t *out, int64_t out_ld, uint16_t nan_bits)
{
    int64_t *cur = calloc(num_sources > 0 ? (size_t)num_sources : 1, sizeof *cur);
    if (!cur)
        return -1;
    float acc[CHUNK];
    for (int64_t t = 0; t < m; t++) {
        for (int64_t h0 = 0; h0 < hidden; h0 += CHUNK) {
            const int64_t n = hidden - h0 < CHUNK ? hidden - h0 : CHUNK;
            if (bias0) {
                const uint16_t *b0 = bias0 + t * bias0_ld + h0;
                if (bias1) {
                    const uint16_t *b1 = bias1 + t * bias1_ld + h0;
                    for (int64_t h = 0; h < n; h++)
                        acc[h] = bf16_to_f32(b0[h]) + bf16_to_f32(b1[h]);
                } else {
                    for (int64_t h = 0; h < n; h++)
                        acc[h] = bf16_to_f32(b0[h]) + 0.0f;
                }
            } else {
                for (int64_t h = 0; h < n; h++)
                    acc[h] = 0.0f;
            }
            for (int64_t j = 0; j < num_sources; j++) {
                for (int64_t i = cur[j]; i < counts[j] && tokens[j][i] == t; i++) {
                    const uint16_t *r = rows[j] + i * row_ld[j] + h0;
                    for (int64_t h = 0; h < n; h++)
                        acc[h] += bf16_to_f32(r[h]);
                }
            }
            uint16_t *o = out + t * out_ld + h0;
            for (int64_t h = 0; h < n; h++)
                o[h] = f32_to_bf16(acc[h], nan_bits);
        }
        for (int64_t j = 0; j < num_sources; j++)
            while (cur[j] < counts[j] && tokens[j][cur[j]] == t)
                cur[j]++;
    }
    int64_t status = 0;
    for (int64_t j = 0; j < num_sources && !status; j++)
        if (cur[j] != counts[j])
            status = j + 1;
    free(cur);
    return status;
}
