/* IEEE half precision <-> float32, exact both ways (float to half rounds to nearest even, as torch's .half()),
 * portable C for every variant: GGUF's F16 blocks and scales, and the int4 KV cache's scales; and bfloat16. */
#ifndef TOKENMILL_HALF_H
#define TOKENMILL_HALF_H
#include <stdint.h>
#include <string.h>

static inline float tm_f32_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t tm_bits_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* normals by rescaling the exponent, subnormals through a float add */
static inline float tm_half_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normal = tm_f32_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float subnormal = tm_f32_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    return tm_f32_bits(sign | (two_w < (1u << 27) ? tm_bits_f32(subnormal) : tm_bits_f32(normal)));
}

/* to nearest even: NaN stays NaN, 65520 and up become infinity, results below 2^-14 subnormal (an add of 0.5
 * lines their bits up in the float's mantissa, rounding as the FPU does) */
static inline uint16_t tm_f32_to_half(float f) {
    uint32_t x = tm_bits_f32(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return sign | 0x7e00u;
    if (x >= 0x477ff000u) return sign | 0x7c00u;
    if (x < 0x38800000u) return sign | (uint16_t)(tm_bits_f32(tm_f32_bits(x) + 0.5f) - 0x3f000000u);
    x += 0xc8000fffu + ((x >> 13) & 1u);    /* exponent rebiased by -112, then rounded at bit 13 */
    return sign | (uint16_t)(x >> 13);
}

/* bfloat16 <-> float32: exact one way, to nearest even the other, as torch's .bfloat16() */
static inline float bf16_to_f32(uint16_t x) {
    return tm_f32_bits((uint32_t)x << 16);
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1);                                           /* round to nearest even */
    return (uint16_t)(u >> 16);
}
#endif
