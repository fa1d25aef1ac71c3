/* The SIMD mapping: one float vector type and the few operations the kernels need, per instruction set, so a
 * kernel is written once over it (llama.cpp's simd-mappings.h is the model). The variant is whatever the build
 * flags enable (build.py compiles every file once per variant):
 *   AVX-512  vf = 16 floats     AVX2+FMA  vf = 8     NEON  vf = 4     generic  vf = 8 (the compiler's choice)
 * vf is a GCC/clang vector type in every case, so + - * and a scalar operand work as on floats; the
 * intrinsics below are only where the compiler's own code is slow or would regroup fused operations. */
#ifndef TOKENMILL_SIMD_H
#define TOKENMILL_SIMD_H
#include <stdint.h>
#include <string.h>

#define TM_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define VL 4
#else
#define VL 8
#endif

typedef float vf __attribute__((vector_size(VL * 4)));

TM_INLINE vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
TM_INLINE void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
TM_INLINE vf vset1(float x) { return (vf){0} + x; }

/* acc + a * b as one fused operation: -ffast-math may otherwise regroup two FMAs into mul + fma + add */
TM_INLINE vf vfma(vf a, vf b, vf acc) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif VL == 8 && defined(__AVX2__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#elif defined(__ARM_NEON)
    return (vf)vfmaq_f32((float32x4_t)acc, (float32x4_t)a, (float32x4_t)b);
#else
    return a * b + acc;
#endif
}

TM_INLINE float vhsum(vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#elif VL == 8 && defined(__AVX2__)
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
#elif defined(__ARM_NEON)
    return vaddvq_f32((float32x4_t)v);
#else
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
#endif
}

/* ---- one 32-weight block (llama.cpp's Q4_0/Q4_1/Q8_0 layout) as 32 / VL vectors in position order. q4: byte j
 * holds code j (low nibble) and code j + 16 (high); weight = d * code + m. q8: weight = d * code. The codes
 * alone (q4_codes, q8_codes) serve kernels that apply d and m once per block; q4_block and q8_block
 * dequantise, as llama.cpp's reference dequantiser does. The one spelling of this arithmetic for every variant. */
#define QK 32
#define QV (QK / VL)

TM_INLINE void q4_codes(const uint8_t *codes, vf *c) {
#if defined(__AVX512F__)
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    c[0] = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    c[1] = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
#elif VL == 8 && defined(__AVX2__)
    /* bytes widened first, nibbles split in 32-bit lanes: fewer shuffles than splitting bytes then widening */
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8)));
    const __m256i f = _mm256_set1_epi32(15);
    c[0] = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(a, f));
    c[1] = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(b, f));
    c[2] = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    c[3] = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
#elif defined(__ARM_NEON)
    const uint8x16_t raw = vld1q_u8(codes);
    const uint8x16_t half[2] = {vandq_u8(raw, vdupq_n_u8(15)), vshrq_n_u8(raw, 4)};
    for (int h = 0; h < 2; h++) {
        const uint16x8_t a = vmovl_u8(vget_low_u8(half[h])), b = vmovl_u8(vget_high_u8(half[h]));
        c[4 * h + 0] = (vf)vcvtq_f32_u32(vmovl_u16(vget_low_u16(a)));
        c[4 * h + 1] = (vf)vcvtq_f32_u32(vmovl_u16(vget_high_u16(a)));
        c[4 * h + 2] = (vf)vcvtq_f32_u32(vmovl_u16(vget_low_u16(b)));
        c[4 * h + 3] = (vf)vcvtq_f32_u32(vmovl_u16(vget_high_u16(b)));
    }
#else
    for (int j = 0; j < 16; j++) {
        c[j / VL][j % VL] = (float)(codes[j] & 15);
        c[(j + 16) / VL][j % VL] = (float)(codes[j] >> 4);
    }
#endif
}

TM_INLINE void q8_codes(const int8_t *codes, vf *c) {
#if defined(__AVX512F__)
    c[0] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes)));
    c[1] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16))));
#elif VL == 8 && defined(__AVX2__)
    for (int i = 0; i < 4; i++)
        c[i] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8 * i))));
#elif defined(__ARM_NEON)
    for (int h = 0; h < 2; h++) {
        const int8x16_t raw = vld1q_s8(codes + 16 * h);
        const int16x8_t a = vmovl_s8(vget_low_s8(raw)), b = vmovl_s8(vget_high_s8(raw));
        c[4 * h + 0] = (vf)vcvtq_f32_s32(vmovl_s16(vget_low_s16(a)));
        c[4 * h + 1] = (vf)vcvtq_f32_s32(vmovl_s16(vget_high_s16(a)));
        c[4 * h + 2] = (vf)vcvtq_f32_s32(vmovl_s16(vget_low_s16(b)));
        c[4 * h + 3] = (vf)vcvtq_f32_s32(vmovl_s16(vget_high_s16(b)));
    }
#else
    for (int j = 0; j < QK; j++) c[j / VL][j % VL] = (float)codes[j];
#endif
}

TM_INLINE void q4_block(const uint8_t *codes, float d, float m, vf *w) {
    q4_codes(codes, w);
    for (int v = 0; v < QV; v++) w[v] = vfma(w[v], vset1(d), vset1(m));
}

TM_INLINE void q8_block(const int8_t *codes, float d, vf *w) {
    q8_codes(codes, w);
    for (int v = 0; v < QV; v++) w[v] = w[v] * d;
}

#endif
