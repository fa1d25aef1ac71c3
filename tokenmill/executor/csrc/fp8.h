/* The two 8-bit floats of the fp8 KV cache, exact both ways in portable C: e4m3 (OCP's E4M3FN: bias 7, no
 * infinities, largest 448) and e5m2 (bias 15, largest 57344). Float to fp8 rounds to nearest even, as torch's
 * .to(torch.float8_*) does, for values already clamped to the largest finite one (the cache's write clamps). */
#ifndef TOKENMILL_FP8_H
#define TOKENMILL_FP8_H
#include <math.h>
#include <stdint.h>

#include "half.h"

/* mantissa bits and exponent bias of each format, by e5m2 (0 or 1) */
#define TM_FP8_MBITS(e5m2) ((e5m2) ? 2 : 3)
#define TM_FP8_BIAS(e5m2) ((e5m2) ? 15 : 7)
#define TM_FP8_MAX(e5m2) ((e5m2) ? 57344.f : 448.f)

static inline uint8_t tm_f32_to_fp8(float f, int e5m2) {
    const int mb = TM_FP8_MBITS(e5m2), bias = TM_FP8_BIAS(e5m2);
    uint32_t x = tm_bits_f32(f);
    const uint8_t sign = (uint8_t)((x >> 24) & 0x80u);
    x &= 0x7fffffffu;
    if (x < (uint32_t)(128 - bias) << 23)    /* below the smallest normal: a count of the smallest subnormal */
        return sign | (uint8_t)lrintf(tm_f32_bits(x) * ldexpf(1.f, bias - 1 + mb));
    x += (1u << (22 - mb)) - 1 + ((x >> (23 - mb)) & 1u);   /* round at the last kept mantissa bit, ties even */
    return sign | (uint8_t)((x >> (23 - mb)) - ((uint32_t)(127 - bias) << mb));
}

static inline float tm_fp8_to_f32(uint8_t c, int e5m2) {
    const int mb = TM_FP8_MBITS(e5m2), bias = TM_FP8_BIAS(e5m2);
    const uint32_t e = (c & 0x7fu) >> mb, m = c & ((1u << mb) - 1);
    const float a = e ? tm_f32_bits(((e + 127 - bias) << 23) | (m << (23 - mb))) : (float)m * ldexpf(1.f, 1 - bias - mb);
    return c & 0x80u ? -a : a;
}
#endif
