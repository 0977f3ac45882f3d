/* MegaMoE's elementwise stages in one pass each, bit for bit the torch paths of
 * deepep_ascend.mega_moe (_dequant_x and _activation):
 *
 *   deepep_dequant_rows_e4m3_bf16  gather rows of e4m3 codes and their UE8M0 scale bytes, decode to BF16
 *   deepep_swiglu_gate_bf16        -(alpha * f32(min(g, clamp))), the argument of the sigmoid's exp
 *   deepep_swiglu_bf16             clamp, SwiGLU (or swigluoai's up + up_bias), routing weight,
 *                                  e4m3/UE8M0 round trip, BF16
 *
 * The exp itself stays with torch (its vectorized exp), so both paths compute the same sigmoid.
 * float32 arithmetic in the reference's order; built with -ffp-contract=off (no FMA) like
 * sum_rows.c, whose conventions (plain C, ctypes, target_clones: bf16.h) this file follows.
 */
#include <stdint.h>

#include "bf16.h"

/* out[r] = bf16(e4m3[code] * sf[byte]) per element, from row i = index[r] (r if index is NULL) of
 * codes (hidden e4m3 codes) and of scales (hidden / gran UE8M0 bytes). e4m3 and sf are 256-entry
 * float32 tables the caller builds with the torch codecs, so the products are the torch path's.
 * (Decoding the codes from their bits instead, so that the loop vectorizes, measured slower.) */
MULTIVERSION
void deepep_dequant_rows_e4m3_bf16(int64_t n, int64_t hidden, int64_t gran, const uint8_t *codes, int64_t codes_ld,
                                   const uint8_t *scales, int64_t scales_ld, const int64_t *index,
                                   const float *e4m3, const float *sf, uint16_t *out, int64_t out_ld,
                                   uint16_t nan_bits)
{
    for (int64_t r = 0; r < n; r++) {
        const int64_t i = index ? index[r] : r;
        const uint8_t *row = codes + i * codes_ld, *scale = scales + i * scales_ld;
        uint16_t *o = out + r * out_ld;
        for (int64_t q = 0; q < hidden / gran; q++) {
            const float s = sf[scale[q]];
            for (int64_t c = q * gran; c < (q + 1) * gran; c++)
                o[c] = f32_to_bf16(e4m3[row[c]] * s, nan_bits);
        }
    }
}

/* t[r][c] = -(alpha * f32(min(g, clamp))) for the gate half g = h[r][0:inter] (no clamp if
 * !has_clamp; a NaN g stays NaN, as torch.clamp). alpha is 1 for plain SwiGLU (1 * x is x, bit for
 * bit), swigluoai's sigmoid scale otherwise. t is [n, inter], contiguous. */
MULTIVERSION
void deepep_swiglu_gate_bf16(int64_t n, int64_t inter, const uint16_t *h, int64_t h_ld, int64_t has_clamp,
                             float clamp, float alpha, float *t)
{
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *g = h + r * h_ld;
        float *o = t + r * inter;
        for (int64_t c = 0; c < inter; c++) {
            const float x = bf16_to_f32(g[c]);
            o[c] = -(alpha * (has_clamp && x > clamp ? clamp : x));
        }
    }
}

/* e4m3 round trip with UE8M0 scale per group of gran values, in place: what
 * quant._e4m3_ue8m0_round_trip_ computes (see there: RNE by adding and subtracting c). Returns 1
 * (values partly rewritten) if a value is NaN, infinite or at least 2^100. */
static inline int round_trip_e4m3(float *a, int64_t gran)
{
    /* |a|'s bits order as |a| does, and an integer max vectorizes where a float one (NaN rules) does not */
    uint32_t amax = 0;
    for (int64_t c = 0; c < gran; c++) {
        const uint32_t ab = f32_bits(a[c]) & 0x7fffffffu;
        amax = ab > amax ? ab : amax;
    }
    if (amax >= 0x71800000u) /* 2^100, infinity or NaN */
        return 1;
    const float m = bits_f32(amax);
    const float q = (m > 1e-4f ? m : 1e-4f) / 448.0f;
    const uint32_t qb = f32_bits(q);
    int32_t e = (int32_t)((qb >> 23) & 0xffu) + ((qb & 0x7fffffu) != 0);
    e = e < 1 ? 1 : (e > 254 ? 254 : e);
    const int32_t floor_c = (e + 14) << 23; /* s * 2^14: the subnormals' fixed step s * 2^-9 */
    for (int64_t c = 0; c < gran; c++) {
        const uint32_t u = f32_bits(a[c]);
        const float ax = bits_f32(u & 0x7fffffffu);
        int32_t cb = (int32_t)(u & 0x7f800000u) + (20 << 23);
        cb = cb > floor_c ? cb : floor_c;
        const float cf = bits_f32((uint32_t)cb);
        const float r = (ax + cf) - cf;
        a[c] = bits_f32(f32_bits(r) | (u & 0x80000000u));
    }
    return 0;
}

/* The L2 input of SwiGLU, h [n, 2 * inter] bf16 (gate g, then up u):
 *   a = g' / (1 + e)  (fast_math: (1 / (1 + e)) * g'),  e = exp(-alpha g') from deepep_swiglu_gate_bf16
 *   a = a * v * weights[r]   v = u' + up_bias if has_up_bias (swigluoai), else u'
 *   (g', u': clamped to clamp / [-clamp, clamp] if has_clamp; weights NULL: 1)
 *   gran > 0: e4m3 round trip with UE8M0 scales per gran columns (inter % gran == 0)
 *   out[r][c] = bf16(a)
 * Returns 0, or 1 if a gran group held a NaN, infinity or |a| >= 2^100 (out is then partly
 * written: the caller recomputes through the codecs). */
MULTIVERSION
int64_t deepep_swiglu_bf16(int64_t n, int64_t inter, const uint16_t *h, int64_t h_ld, const float *e,
                           const float *weights, int64_t has_clamp, float clamp, int64_t fast_math,
                           int64_t has_up_bias, float up_bias, int64_t gran, uint16_t *out, int64_t out_ld,
                           uint16_t nan_bits)
{
    enum { CHUNK = 256 };
    const int64_t step = gran > 0 ? (CHUNK / gran) * gran : CHUNK;
    if (gran > CHUNK)
        return 1;
    float a[CHUNK];
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *g = h + r * h_ld, *u = g + inter;
        const float *er = e + r * inter;
        uint16_t *o = out + r * out_ld;
        for (int64_t c0 = 0; c0 < inter; c0 += step) {
            const int64_t w = inter - c0 < step ? inter - c0 : step;
            for (int64_t c = 0; c < w; c++) {
                float x = bf16_to_f32(g[c0 + c]), y = bf16_to_f32(u[c0 + c]);
                if (has_clamp) {
                    x = x > clamp ? clamp : x;
                    y = y > clamp ? clamp : (y < -clamp ? -clamp : y);
                }
                /* plain SwiGLU adds nothing: u' + 0 would turn a -0 into +0 */
                if (has_up_bias)
                    y = y + up_bias;
                const float d = er[c0 + c] + 1.0f;
                a[c] = fast_math ? (1.0f / d) * x : x / d;
                a[c] = a[c] * y;
            }
            if (weights) {
                const float wr = weights[r];
                for (int64_t c = 0; c < w; c++)
                    a[c] = a[c] * wr;
            }
            if (gran > 0)
                for (int64_t q = 0; q < w; q += gran)
                    if (round_trip_e4m3(a + q, gran))
                        return 1;
            for (int64_t c = 0; c < w; c++)
                o[c0 + c] = f32_to_bf16(a[c], nan_bits);
        }
    }
    return 0;
}
