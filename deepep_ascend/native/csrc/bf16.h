/* What the native kernels (sum_rows.c, moe_act.c) share: float32 bit views, torch's BF16 conversions,
 * and the build for any x86-64 (the loader picks the widest vector unit at run time). */
#ifndef DEEPEP_ASCEND_BF16_H
#define DEEPEP_ASCEND_BF16_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
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

#endif
