/* The low-latency dispatch's FP8 messages in one pass per token, straight from the BF16 rows.
 *
 * The torch path (deepep_ascend.ep.low_latency, LowLatencyEngine._write_messages) widens x into a float32
 * scratch, reduces each 128-element group twice (amax, amin), scales, clamps and casts in separate passes
 * (about eight passes over n * hidden floats); here each group is read twice while in L1 (its amax, then
 * its codes) and each message byte is written once. Same bits as that path, DeepEP's arithmetic
 * (docs/semantics/deepep-api.md §6.4):
 *
 *   amax  = max(f32(1e-4), |x_i| over the group's non-NaN elements)        (fmaxf skips NaN)
 *   plain:       mult = 448 / amax (one IEEE division), scale = amax * f32(1/448)
 *   round_scale: e = clamp(exponent(amax * f32(1/448)) + (any mantissa bit), 1, 254),
 *                scale = 2^(e - 127), mult = 1 / scale (exact)
 *   code  = e4m3(clamp(x_i * mult, -448, 448)): round to nearest even, NaN -> 0x7f with x_i * mult's sign
 *           (torch's c10 float -> float8_e4m3fn conversion, whose clamp keeps a NaN's sign)
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define GROUP 128
#define E4M3_MAX_BITS 0x43E00000u /* 448.0f */

/* e4m3fn code of y, saturating finite values and infinities at +-448 (the torch path clamps before its cast):
 * c10's fp8e4m3fn_from_fp32_value of the clamped value. Signed 32-bit lanes and masks, so that the
 * caller's loop vectorises into few instructions (AVX2 has no unsigned compare). */
static inline __attribute__((always_inline)) uint32_t e4m3_code(float y)
{
    const uint32_t u = f32_bits(y);
    const int32_t a0 = (int32_t)(u & 0x7fffffffu);
    const int32_t a = a0 < (int32_t)E4M3_MAX_BITS ? a0 : (int32_t)E4M3_MAX_BITS; /* a NaN too: 448's code 0x7e */
    const uint32_t nan = (uint32_t)(0x7f800000 - a0) >> 31;                     /* 1 for a NaN: 0x7e -> 0x7f */
    /* below 2^-6 (e4m3's smallest normal) the float add rounds the value onto e4m3's subnormal grid; above,
     * the mantissa rounds to 3 bits (to nearest even) with the exponent rebiased from 127 to 7 */
    const int32_t denorm = 141 << 23;
    const int32_t sub = (int32_t)f32_bits(bits_f32((uint32_t)a) + bits_f32((uint32_t)denorm)) - denorm;
    const int32_t norm = (a + (7 - 127) * (1 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20;
    const int32_t small = -(int32_t)(a < (121 << 23)); /* a mask, not a branch: the float add is done anyway */
    return (uint32_t)((sub & small) | (norm & ~small)) | nan | ((u >> 24) & 0x80u);
}

/* n messages, message t at out + t * out_ld (bytes):
 *   [int32 t | 12 zero bytes | hidden e4m3 codes | scales]
 * from row t of x (bf16 bits, row t at x + t * x_ld elements, unit column stride); scales: hidden / 128
 * float32 (little-endian words), or with ue8m0 the hidden / 128 exponent bytes e (groups 4p .. 4p+3 form
 * int32 word p, little-endian, the packing of deepep_ascend.gemm.scales.pack_ue8m0_to_int). The caller has
 * checked hidden % 128 == 0 (% 512 with ue8m0, which needs round_scale) and out_ld >= the message size
 * 16 + hidden + hidden / 32 (float scales) or 16 + hidden + hidden / 128 (ue8m0). Returns 1 (nothing written)
 * when those do not hold, else 0. */
MULTIVERSION
int64_t deepep_ll_cast_messages(int64_t n, int64_t hidden, const uint16_t *x, int64_t x_ld, int64_t round_scale,
                                int64_t ue8m0, uint8_t *out, int64_t out_ld)
{
    const int64_t groups = hidden / GROUP;
    const int64_t mb = 16 + hidden + (ue8m0 ? groups : 4 * groups);
    if (n < 0 || hidden < 0 || hidden % GROUP || (ue8m0 && (hidden % 512 || !round_scale)) || out_ld < mb)
        return 1;
    const float floor_ = (float)1e-4;       /* torch's clamp_(min=1e-4) on float32 */
    const float inv448 = (float)(1.0 / 448.0);
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *row = x + t * x_ld;
        uint8_t *msg = out + t * out_ld;
        const int32_t token = (int32_t)t;
        memcpy(msg, &token, 4);
        memset(msg + 4, 0, 12);
        uint8_t *codes = msg + 16, *scales = msg + 16 + hidden;
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *a = row + g * GROUP;
            /* |x| of a bf16 orders as its 15 low bits (16-bit lanes); NaN (above 0x7f80) counts as 0 */
            int16_t most = 0;
            for (int i = 0; i < GROUP; i++) {
                const int16_t v = (int16_t)(a[i] & 0x7fff);
                const int16_t w = v > 0x7f80 ? 0 : v;
                most = w > most ? w : most;
            }
            float amax = bf16_to_f32((uint16_t)most);
            amax = amax < floor_ ? floor_ : amax;
            float scale, mult;
            uint32_t e = 0;
            if (round_scale) {
                const uint32_t r = f32_bits(amax * inv448);
                e = ((r >> 23) & 0xFFu) + ((r & 0x7FFFFFu) != 0);
                e = e < 1 ? 1 : (e > 254 ? 254 : e);
                scale = bits_f32(e << 23);
                mult = 1.0f / scale;
            } else {
                scale = amax * inv448;
                mult = 448.0f / amax;
            }
            uint8_t *c = codes + g * GROUP;
            uint32_t tmp[GROUP]; /* 32-bit codes, then one narrowing: the compiler packs once per vector */
            for (int i = 0; i < GROUP; i++)
                tmp[i] = e4m3_code(bf16_to_f32(a[i]) * mult);
            for (int i = 0; i < GROUP; i++)
                c[i] = (uint8_t)tmp[i];
            if (ue8m0)
                scales[g] = (uint8_t)e;
            else
                memcpy(scales + 4 * g, &scale, 4);
        }
    }
    return 0;
}
