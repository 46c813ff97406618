/* exp(x) for x <= 0, shared by the package's C loops (softmax, GELU's erf): x = n ln2 + r with |r| <= ln2 / 2;
   exp(r) by its degree-7 polynomial (relative error ~1e-7), 2^n by the exponent bits. Below -87 it returns
   exp(-87) ~ 1.6e-38, not 0: harmless where it is used (a weight or a tail next to 1). Two forms with the same
   steps: a scalar one that loops vectorise (`omp declare simd`), and one on 16 lanes for the explicit vector
   code of attention.c. */
#ifndef MOEMBED_EXPNEG_H
#define MOEMBED_EXPNEG_H

#include <math.h>
#include <stdint.h>

#define EXPNEG_POLY(p, r, zero)                                                                                   \
    p = zero + 1.9875691500e-4f;                                                                                 \
    p = p * r + 1.3981999507e-3f;                                                                                \
    p = p * r + 8.3334519073e-3f;                                                                                \
    p = p * r + 4.1665795894e-2f;                                                                                \
    p = p * r + 1.6666665459e-1f;                                                                                \
    p = p * r + 5.0000001201e-1f;                                                                                \
    p = p * r * r + r + 1.0f;

#pragma omp declare simd notinbranch
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = nearbyintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  /* ln2 in two parts: r exact to float */
    float p;
    EXPNEG_POLY(p, r, 0.0f)
    union { float f; int32_t i; } u = { .f = p };
    u.i += (int32_t)n << 23;
    return u.f;
}

typedef float expneg_f16 __attribute__((vector_size(64)));
typedef int32_t expneg_i16 __attribute__((vector_size(64)));

static inline expneg_f16 exp_nonpositive16(expneg_f16 x) {
    const expneg_f16 zero = {0}, low = zero - 87.0f, magic = zero + 12582912.0f;
    const expneg_i16 clamp = x < low;
    x = (expneg_f16)(((expneg_i16)x & ~clamp) | ((expneg_i16)low & clamp));
    const expneg_f16 n = (x * 1.44269504088896341f + magic) - magic;  /* + 1.5 * 2^23 rounds to nearest even */
    const expneg_f16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    expneg_f16 p;
    EXPNEG_POLY(p, r, zero)
    return (expneg_f16)((expneg_i16)p + (__builtin_convertvector(n, expneg_i16) << 23));
}

#endif
