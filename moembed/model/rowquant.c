/* The int8 path's element-wise work around oneDNN's quantised matmul, one pass each (moembed/model/rowquant.py;
   built by moembed/model/native.py).

   quantize_rows: x (N, k) float32 -> codes (N, k) uint8, m (N,), xo (N, o)
       m[i]       = max(max_j keep[j] * |x[i, j]|, 1e-12)       the row's range outside its outlier channels
       codes[i,j] = clamp(rne(fma(x[i, j] / m[i], inv_step, zero)), 0, 255)
       xo[i, t]   = x[i, outliers[t]] / m[i]                    the outlier channels, on the row's scale
   the same values as torch's abs, amax, div and quantize_per_tensor in a row (the division, and the fused
   multiply-add torch's quantiser rounds, so the codes are the same to the bit), in one pass over the row
   instead of five over the batch.

   rescale_rows: y (N, n) float32 in place, y[i, j] = y[i, j] * m[i] + bias[j], then exact GELU if asked.
   The rescale that undoes the row's range, the bias and GELU in one pass instead of three.

   Rows are independent (an embedding never depends on its batch); rows are shared among the OpenMP threads of the
   calling thread, the runtime torch itself runs on. */

#include <math.h>
#include <stdint.h>

#include "expneg.h"

void quantize_rows(const float *x, int64_t N, int64_t k, const float *keep, float inv_step, float zero,
                   uint8_t *codes, float *m, const int64_t *outliers, int64_t o, float *xo) {
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; i++) {
        const float *r = x + i * k;
        float top = 0.0f;
        #pragma omp simd reduction(max:top)
        for (int64_t j = 0; j < k; j++) {
            float a = fabsf(r[j]) * keep[j];
            top = a > top ? a : top;
        }
        const float mi = top > 1e-12f ? top : 1e-12f;
        m[i] = mi;
        uint8_t *c = codes + i * k;
        #pragma omp simd
        for (int64_t j = 0; j < k; j++) {
            float q = nearbyintf(fmaf(r[j] / mi, inv_step, zero));
            q = q < 0.0f ? 0.0f : (q > 255.0f ? 255.0f : q);
            c[j] = (uint8_t)(int32_t)q;
        }
        for (int64_t t = 0; t < o; t++) xo[i * o + t] = r[outliers[t]] / mi;
    }
}

/* erf by Abramowitz and Stegun 7.1.26: absolute error below 1.5e-7, the form torch's own vectorised erf takes. */
#pragma omp declare simd notinbranch
static inline float erf_as(float x) {
    const float a = fabsf(x);
    const float t = 1.0f / (1.0f + 0.3275911f * a);
    const float p = ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t
                     + 0.254829592f) * t;
    return copysignf(1.0f - p * exp_nonpositive(-a * a), x);
}

void rescale_rows(float *y, int64_t N, int64_t n, const float *m, const float *bias, int gelu) {
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; i++) {
        float *r = y + i * n;
        const float mi = m[i];
        if (gelu) {
            #pragma omp simd
            for (int64_t j = 0; j < n; j++) {
                const float v = r[j] * mi + bias[j];
                r[j] = 0.5f * v * (1.0f + erf_as(v * 0.70710678118654752f));
            }
        } else {
            #pragma omp simd
            for (int64_t j = 0; j < n; j++) r[j] = r[j] * mi + bias[j];
        }
    }
}
