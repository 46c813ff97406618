/* The last step of an MoE block at CPU inference: each token's gate-weighted sum of its top-k expert outputs,
 * read where the experts wrote them.
 *
 *     out[n] = sum_j gates[n, j] * part[expert[n, j]][row[n, j]]  (+ bias)
 *
 * The experts run one after another on their own slices and each returns its own (rows, d) buffer. Combining with
 * torch ops needs them in one tensor first (a concatenation), then a gather of every token's k rows, then a
 * multiply and an add per choice: four passes over (N k, d) values. This reads each of those rows once, from the
 * buffer it is in, and writes each output row once (moembed.model.moe; BENCHMARKS.md, "One pass to combine the
 * experts' outputs").
 *
 * parts[e]: address of expert e's output, rows of d values, float32 or (bf16 != 0) bfloat16, widened as loaded;
 * sums in float32, in the order j = 0 .. k-1, as `y0 * g0`, then `+ y_j * g_j`, then `+ bias` (may be NULL).
 * A row's result depends on its own choices only, never on another token's.
 */
#include <stdint.h>
#include <string.h>

static inline float widen(const uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

void combine_rows(const int64_t *parts, const int64_t *expert, const int64_t *row, const float *gates, int64_t N,
                  int64_t k, int64_t d, int bf16, const float *bias, float *out) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float *o = out + n * d;
        for (int64_t j = 0; j < k; j++) {
            const int64_t a = n * k + j;
            const float g = gates[a];
            if (bf16) {
                const uint16_t *y = (const uint16_t *)(intptr_t)parts[expert[a]] + row[a] * d;
                if (j == 0) {
                    #pragma omp simd
                    for (int64_t c = 0; c < d; c++) o[c] = widen(y[c]) * g;
                } else {
                    #pragma omp simd
                    for (int64_t c = 0; c < d; c++) o[c] += widen(y[c]) * g;
                }
            } else {
                const float *y = (const float *)(intptr_t)parts[expert[a]] + row[a] * d;
                if (j == 0) {
                    #pragma omp simd
                    for (int64_t c = 0; c < d; c++) o[c] = y[c] * g;
                } else {
                    #pragma omp simd
                    for (int64_t c = 0; c < d; c++) o[c] += y[c] * g;
                }
            }
        }
        if (bias) {
            #pragma omp simd
            for (int64_t c = 0; c < d; c++) o[c] += bias[c];
        }
    }
}
