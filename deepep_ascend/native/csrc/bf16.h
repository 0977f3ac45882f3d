/* What the native kernels share: float32 bit views, torch's BF16 conversions, the weighted row sum,
 * and the build for any x86-64 (the loader picks the widest vector unit at run time). */
#ifndef DEEPEP_ASCEND_BF16_H
#define DEEPEP_ASCEND_BF16_H

#include <stdint.h>
#include <string.h>

/* The AVX-512 clone targets x86-64-v4 (AVX-512 F/BW/DQ/VL): the 16-bit lanes of the BF16 and FP8 kernels need
 * BW, and that level's tuning vectorises at 512 bits (python -m bench combine-sum times the row sums on the
 * host at hand). GCC 12 resolves that clone at run time; older compilers and clang get the avx512f one. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__x86_64__) && defined(__GNUC__)
#define MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MULTIVERSION
#endif

static inline float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* Round to nearest even, as torch's float -> bfloat16 conversion; NaN becomes nan_bits (torch's
 * canonical NaN, passed in by the caller so both agree bit for bit). */
static inline uint16_t f32_to_bf16(float f, uint16_t nan_bits)
{
    const uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return nan_bits;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Floats of one output row accumulated at a time (the accumulator stays in L1). */
#define WEIGHTED_CHUNK 1024

/* One output row's sum with its accumulator in AVX2 registers (sum_rows.c), where deepep_row_sums_avx2_on()
 * says so: o[h] = bf16(start[h] + the rows in order), start = f32(b0) + f32(b1), f32(b0) + 0.0, or +0.0 (b0, b1
 * NULL), each row's term f32(row[j][h]) or, with w, f32(row[j][h]) * w[j] rounded to float32 before its add:
 * the bits of the portable loops below and in sum_rows.c, 64 columns at a time instead of a float32 row
 * in memory that every input row reads and writes again. Tokens with more than ROW_SUM_SLOTS weighted rows
 * take the portable loop. */
#define ROW_SUM_SLOTS 64
int deepep_row_sums_avx2_on(void);
void deepep_row_sum_avx2(int64_t hidden, int64_t n, const uint16_t *const *row, const float *w, const uint16_t *b0,
                         const uint16_t *b1, uint16_t *o, uint16_t nan_bits);

/* Where the rows of some ranks live when not in `rows`: index s of rank d = s / (m * num_local) with
 * addr[d] != 0 is row begin[d * num_local + le] + r (le = (s / m) % num_local, r = s % m) of block le at
 * addr[d] + le * ld[2d] + (begin[...] + r) * ld[2d + 1] (elements). The low-latency combine reads a rank's
 * returned rows this way where they already lie: its own experts' outputs in the caller's tensor, and a
 * zero-copy source's in that source's send region, instead of from copies in this rank's window. */
struct row_redirect {
    int64_t m, num_local;
    const int64_t *addr, *ld, *begin;
};

static inline __attribute__((always_inline)) const uint16_t *redirected_row(const struct row_redirect *alt,
                                                                            int64_t s)
{
    const int64_t g = s / alt->m, d = g / alt->num_local, le = g % alt->num_local;
    if (!alt->addr[d])
        return NULL;
    return (const uint16_t *)(intptr_t)alt->addr[d] + le * alt->ld[2 * d]
           + (alt->begin[g] + s % alt->m) * alt->ld[2 * d + 1];
}

/* The low-latency combine's weighted sum, for every token t < n:
 *
 *   out[t] = bf16( ((+0.0 + f32(rows[idx[t,0]]) * w[t,0]) + f32(rows[idx[t,1]]) * w[t,1]) + ... )
 *
 * over the slots j = 0..k-1 of token t whose idx[t,j] >= 0 and, with a mask, whose rank
 * idx[t,j] / rows_per_rank is not masked; in slot order, each product rounded to float32 before its
 * add, one rounding to BF16 at the end (torch's y = f32(row) * w; acc += y; acc.to(bf16)). A token
 * with no slot gets +0.0. rows: row r at rows + r * row_ld (elements), except the indices of `alt`
 * (NULL: none), read where it says; idx, w: [n, k] row-major; out row t at out + t * out_ld. The
 * caller has checked every idx value against its rows. Inlined into each caller, so that each of its
 * target clones vectorises it. */
static inline __attribute__((always_inline)) void weighted_sum_rows_into(
    int64_t n, int64_t hidden, int64_t k, const uint16_t *rows, int64_t row_ld, const int64_t *idx, const float *w,
    uint16_t *out, int64_t out_ld, uint16_t nan_bits, const int32_t *mask, int64_t rows_per_rank,
    const struct row_redirect *alt)
{
    float acc[WEIGHTED_CHUNK];
    const int vector = k <= ROW_SUM_SLOTS && deepep_row_sums_avx2_on();
    for (int64_t t = 0; t < n; t++) {
        const int64_t *ti = idx + t * k;
        const float *tw = w + t * k;
        uint16_t *o = out + t * out_ld;
        if (vector) {
            const uint16_t *src[ROW_SUM_SLOTS];
            float wt[ROW_SUM_SLOTS];
            int64_t c = 0;
            for (int64_t j = 0; j < k; j++) {
                const int64_t s = ti[j];
                if (s < 0 || (mask && mask[s / rows_per_rank]))
                    continue;
                const uint16_t *a = alt ? redirected_row(alt, s) : NULL;
                src[c] = a ? a : rows + s * row_ld;
                wt[c++] = tw[j];
            }
            deepep_row_sum_avx2(hidden, c, src, wt, NULL, NULL, o, nan_bits);
            continue;
        }
        for (int64_t h0 = 0; h0 < hidden; h0 += WEIGHTED_CHUNK) {
            const int64_t width = hidden - h0 < WEIGHTED_CHUNK ? hidden - h0 : WEIGHTED_CHUNK;
            for (int64_t h = 0; h < width; h++)
                acc[h] = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                const int64_t s = ti[j];
                if (s < 0 || (mask && mask[s / rows_per_rank]))
                    continue;
                const uint16_t *a = alt ? redirected_row(alt, s) : NULL;
                a = a ? a + h0 : rows + s * row_ld + h0;
                const float wj = tw[j];
                for (int64_t h = 0; h < width; h++) {
                    const float y = bf16_to_f32(a[h]) * wj;
                    acc[h] += y;
                }
            }
            for (int64_t h = 0; h < width; h++)
                o[h0 + h] = f32_to_bf16(acc[h], nan_bits);
        }
    }
}

#endif
