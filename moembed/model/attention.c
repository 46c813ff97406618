/* Encoder self-attention for CPU inference on short, right-padded sequences (moembed/model/attention.py).

   attention(q, k, v, ...): for each sequence b and head h, with L = lengths[b] real tokens,
       out[b, i, h, :] = softmax_j<L(q[b, h, i, :] . k[b, h, j, :] * scale) @ v[b, h, j<L, :]    for i < L
       out[b, i, h, :] = 0                                                                       for i >= L
   q, k and v (B, H, T, D) by strides (rows of D contiguous), out (B, T, H, D): the padded layout; or the packed
   one, sequence after sequence with no padding, straight from and to the layers' (N, 3 H D) and (N, H D) rows
   (q, k, v (N, H, D) in the projection, out (N, H, D)), so that no gather pads them and none drops the padding
   again; `Layout` says which. All float32 or all bfloat16 (widened on load); out float32.

   torch's CPU flash-attention kernel spends most of its time outside its matmuls at these shapes (12 heads of 32,
   T <= 128), far below the linear layers' rate (BENCHMARKS.md). Here each (sequence, head) is one task:
   its keys transposed in 16 x 16 blocks (keys along the vector lanes), then eight query rows at a time against 32
   keys (sixteen vector accumulators), the softmax of those eight rows over the sequence's own L keys on whole
   vectors, then their product with V, 32 columns at a time (sixteen accumulators again): eight rows rather than
   four, and a vector softmax with its reductions by shuffles, were measured faster than four rows with a
   vectorised scalar softmax.
   Padded keys are skipped rather than masked, so a row's result depends on its own sequence only. D is 32 or 64
   (specialised so that the accumulators stay in registers); the caller uses torch's kernel otherwise. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "expneg.h"

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  /* unaligned loads and stores */
#define LOAD(p) (*(const v16u *)(p))
#define STORE(p, x) (*(v16u *)(p) = (x))

/* Where sequence b's values are, in elements (s = starts[b], 0 without starts): q[b, h, i, :] at
   q + b q_b + (s + i) q_t + h q_h, and k, v alike; out[b, i, h, :] at out + b o_b + ((s + i) H + h) D. */
typedef struct {
    const int64_t *starts;
    int64_t q_b, q_h, q_t, k_b, k_h, k_t, v_b, v_h, v_t, o_b;
} Layout;

/* The transpose of a 16 x 16 block held in 16 vectors, in four rounds of exchanges (1, 2, 4 then 8 apart). */
typedef int32_t i16 __attribute__((vector_size(64)));
static const i16 LO1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
static const i16 HI1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
static const i16 LO2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
static const i16 HI2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
static const i16 LO4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
static const i16 HI4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
static const i16 LO8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
static const i16 HI8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
#define EXCHANGE(W, LO, HI)                                                                                      \
    for (int i = 0; i < 16; i++)                                                                                 \
        if (!(i & W)) {                                                                                          \
            const v16 x = a[i], y = a[i | W];                                                                    \
            a[i] = __builtin_shuffle(x, y, LO);                                                                  \
            a[i | W] = __builtin_shuffle(x, y, HI);                                                              \
        }
static inline void transpose16(v16 a[16]) {
    EXCHANGE(1, LO1, HI1)
    EXCHANGE(2, LO2, HI2)
    EXCHANGE(4, LO4, HI4)
    EXCHANGE(8, LO8, HI8)
}


/* x with the lanes at positions j0 + lane >= L set to `fill`. */
static const i16 LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static inline v16 masked(v16 x, int64_t j0, int64_t L, float fill) {
    const i16 keep = (LANE + (int32_t)j0) < (int32_t)L;
    const v16 f = (v16){0} + fill;
    return (v16)(((i16)x & keep) | ((i16)f & ~keep));
}
static inline v16 vmax(v16 a, v16 b) {
    const i16 ge = a >= b;
    return (v16)(((i16)a & ge) | ((i16)b & ~ge));
}
/* Horizontal max and sum in four halving steps (a fixed order, so a row's sum depends on its own scores only). */
static const i16 H8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
static const i16 H4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
static const i16 H2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
static const i16 H1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
static inline float hmax(v16 x) {
    x = vmax(x, __builtin_shuffle(x, H8));
    x = vmax(x, __builtin_shuffle(x, H4));
    x = vmax(x, __builtin_shuffle(x, H2));
    return vmax(x, __builtin_shuffle(x, H1))[0];
}
static inline float hsum(v16 x) {
    x += __builtin_shuffle(x, H8);
    x += __builtin_shuffle(x, H4);
    x += __builtin_shuffle(x, H2);
    return (x + __builtin_shuffle(x, H1))[0];
}

#define RB 8      /* query rows per tile */
#define KB 32     /* keys per score tile: two vectors */
#define MAXT 1024 /* longest sequence (the caller checks) */

#define DEFINE_ATTENTION(NAME, D, E, VLOAD)                                                                     \
static void NAME(const E *q, const E *k, const E *v, int64_t B, int64_t H, int64_t T, const Layout *y,           \
                 const int64_t *lengths, float scale, float *out) {                                              \
    enum { DV = D / 16 };                                                                                        \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                                             \
    for (int64_t bh = 0; bh < B * H; bh++) {                                                                     \
        const int64_t b = bh / H, h = bh % H, L = lengths[b], st = y->starts ? y->starts[b] : 0;                 \
        const E *qb = q + b * y->q_b + st * y->q_t + h * y->q_h, *vb = v + b * y->v_b + st * y->v_t + h * y->v_h; \
        const E *kb = k + b * y->k_b + st * y->k_t + h * y->k_h;                                                 \
        float *ob = out + b * y->o_b + st * H * D + h * D;                                                       \
        float s[RB][MAXT + KB] __attribute__((aligned(64)));                                                     \
        const int64_t Lp = L > 0 ? (L + KB - 1) / KB * KB : KB;  /* whole tiles; keys past L are zero */         \
        float kt[D * Lp] __attribute__((aligned(64)));  /* K transposed: keys along the lanes */                 \
        for (int64_t j0 = 0; j0 < Lp; j0 += 16)                                                                  \
            for (int d0 = 0; d0 < D; d0 += 16) {                                                                 \
                v16 a[16];                                                                                       \
                for (int r = 0; r < 16; r++) a[r] = j0 + r < L ? VLOAD(kb + (j0 + r) * y->k_t + d0) : (v16){0};  \
                transpose16(a);                                                                                  \
                for (int c = 0; c < 16; c++) STORE(kt + (d0 + c) * Lp + j0, a[c]);                               \
            }                                                                                                    \
        for (int64_t i = L; i < T; i++) memset(ob + i * H * D, 0, D * sizeof(float));                            \
        for (int64_t i0 = 0; i0 < L; i0 += RB) {                                                                 \
            float qv[RB][D] __attribute__((aligned(64)));                                                        \
            for (int r = 0; r < RB; r++) {  /* rows past L repeat the last one; they are not written */          \
                const E *qi = qb + (i0 + r < L ? i0 + r : L - 1) * y->q_t;                                       \
                for (int c = 0; c < DV; c++) STORE(&qv[r][16 * c], VLOAD(qi + 16 * c) * scale);                  \
            }                                                                                                    \
            for (int64_t j0 = 0; j0 < L; j0 += KB) {  /* scores: (RB, KB) tiles, (RB, 16) for a short last one */ \
                if (L - j0 > 16) {                                                                               \
                    v16 a[RB][2];                                                                                \
                    for (int r = 0; r < RB; r++) a[r][0] = a[r][1] = (v16){0};                                   \
                    for (int d = 0; d < D; d++) {                                                                \
                        const v16 k0 = LOAD(kt + d * Lp + j0), k1 = LOAD(kt + d * Lp + j0 + 16);                 \
                        for (int r = 0; r < RB; r++) { a[r][0] += qv[r][d] * k0; a[r][1] += qv[r][d] * k1; }    \
                    }                                                                                            \
                    for (int r = 0; r < RB; r++) { STORE(&s[r][j0], a[r][0]); STORE(&s[r][j0 + 16], a[r][1]); } \
                } else {                                                                                         \
                    v16 a[RB];                                                                                   \
                    for (int r = 0; r < RB; r++) a[r] = (v16){0};                                                \
                    for (int d = 0; d < D; d++) {                                                                \
                        const v16 k0 = LOAD(kt + d * Lp + j0);                                                   \
                        for (int r = 0; r < RB; r++) a[r] += qv[r][d] * k0;                                      \
                    }                                                                                            \
                    for (int r = 0; r < RB; r++) STORE(&s[r][j0], a[r]);                                         \
                }                                                                                                \
            }                                                                                                    \
            float inv[RB];                                                                                       \
            for (int r = 0; r < RB; r++) {  /* softmax over the L real keys (lanes past L: -inf, then 0) */      \
                v16 top = (v16){0} - INFINITY;                                                                   \
                for (int64_t j0 = 0; j0 < L; j0 += 16) top = vmax(top, masked(LOAD(&s[r][j0]), j0, L, -INFINITY)); \
                const float m = hmax(top);                                                                       \
                v16 sum = {0};                                                                                   \
                for (int64_t j0 = 0; j0 < L; j0 += 16) {                                                         \
                    const v16 e = masked(exp_nonpositive16(LOAD(&s[r][j0]) - m), j0, L, 0.0f);                  \
                    STORE(&s[r][j0], e);                                                                         \
                    sum += e;                                                                                    \
                }                                                                                                \
                inv[r] = 1.0f / hsum(sum);                                                                       \
            }                                                                                                    \
            for (int c = 0; c < DV; c += 2) {  /* (RB, L) @ (L, 32 of the D columns) */                          \
                v16 o[RB][2];                                                                                    \
                for (int r = 0; r < RB; r++) o[r][0] = o[r][1] = (v16){0};                                       \
                for (int64_t j = 0; j < L; j++) {                                                                \
                    const E *vj = vb + j * y->v_t + 16 * c;                                                      \
                    const v16 x0 = VLOAD(vj), x1 = VLOAD(vj + 16);                                               \
                    for (int r = 0; r < RB; r++) { o[r][0] += s[r][j] * x0; o[r][1] += s[r][j] * x1; }           \
                }                                                                                                \
                for (int r = 0; r < RB && i0 + r < L; r++) {                                                     \
                    float *dst = ob + (i0 + r) * H * D + 16 * c;                                                 \
                    STORE(dst, o[r][0] * inv[r]);                                                                \
                    STORE(dst + 16, o[r][1] * inv[r]);                                                           \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
}

/* bfloat16 inputs: the upper half of a float32, widened on load (the arithmetic stays float32) */
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
static inline v16 bf16_vector(const uint16_t *p) {
    const u32x16 w = __builtin_convertvector(*(const u16x16 *)p, u32x16) << 16;
    return (v16)w;
}

DEFINE_ATTENTION(attention32, 32, float, LOAD)
DEFINE_ATTENTION(attention64, 64, float, LOAD)
DEFINE_ATTENTION(attention32_bf16, 32, uint16_t, bf16_vector)
DEFINE_ATTENTION(attention64_bf16, 64, uint16_t, bf16_vector)

/* q, k, v float32 (bf16 = 0) or bfloat16 (bf16 = 1); out float32. T: rows of out per sequence (rows from
   lengths[b] to T are zeroed; 0 for packed rows). starts: NULL for the padded layout. strides: q_b, q_h, q_t, k_b,
   k_h, k_t, v_b, v_h, v_t, o_b (`Layout`). 0 when done; 1 (nothing written) for a head size or length this file
   does not handle. */
int attention(const void *q, const void *k, const void *v, int bf16, int64_t B, int64_t H, int64_t T, int64_t D,
              const int64_t *starts, const int64_t *lengths, const int64_t *strides, float scale, float *out) {
    const int64_t *x = strides;
    const Layout y = { starts, x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8], x[9] };
    for (int64_t b = 0; b < B; b++)
        if (lengths[b] > MAXT) return 1;
    if (D == 32 && !bf16) attention32(q, k, v, B, H, T, &y, lengths, scale, out);
    else if (D == 64 && !bf16) attention64(q, k, v, B, H, T, &y, lengths, scale, out);
    else if (D == 32) attention32_bf16(q, k, v, B, H, T, &y, lengths, scale, out);
    else if (D == 64) attention64_bf16(q, k, v, B, H, T, &y, lengths, scale, out);
    else return 1;
    return 0;
}
