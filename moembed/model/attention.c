/* Encoder self-attention for CPU inference on short, right-padded sequences (moembed/model/attention.py).

   attention(q, kt, v, ...): for each sequence b and head h, with L = lengths[b] real tokens,
       out[b, i, h, :] = softmax_j<L(q[b, h, i, :] . kt[b, h, :, j] * scale) @ v[b, h, j<L, :]   for i < L
       out[b, i, h, :] = 0                                                                       for i >= L
   q and v (B, H, T, D) by strides (rows of D contiguous), kt = K transposed (B, H, D, T), out (B, T, H, D): the
   padded layout; or the packed one, sequence after sequence with no padding, straight from and to the layers'
   (N, 3 H D) and (N, H D) rows (q, v (N, H, D) in the projection, kt (H, D, N), out (N, H, D)), so that no gather
   pads them and none drops the padding again. Offsets per sequence and strides say which (`Layout`). All float32
   or all bfloat16 (widened on load); out float32.

   torch's CPU flash-attention kernel spends most of its time outside its matmuls at these shapes (12 heads of 32,
   T <= 128: 40-60 GFLOP/s on Zen 4 against ~180 for the linear layers). Here each (sequence, head) is one task:
   four query rows at a time against 32 keys (eight vector accumulators over the head dimension), the softmax of
   those four rows over the sequence's own L keys, then their product with V (four rows times D in accumulators).
   Padded keys are skipped rather than masked, so a row's result depends on its own sequence only. D is 32 or 64
   (specialised so that the accumulators stay in registers); the caller uses torch's kernel otherwise. */

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  /* unaligned loads and stores */
#define LOAD(p) (*(const v16u *)(p))
#define STORE(p, x) (*(v16u *)(p) = (x))

/* Where sequence b's values are, in elements: q[b, h, i, :] at q + q_base[b] + h q_h + i q_t, and v alike;
   key j's dimension d at kt + k_base[b] + h k_h + d k_d + j; out[b, i, h, :] at out + o_base[b] + (i H + h) D. */
typedef struct {
    const int64_t *q_base, *k_base, *v_base, *o_base;
    int64_t q_h, q_t, k_h, k_d, v_h, v_t;
} Layout;

#define RB 4      /* query rows per tile */
#define KB 32     /* keys per score tile: two vectors */
#define MAXT 1024 /* longest sequence (the caller checks) */

/* exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2 / 2; exp(r) by its degree-7 polynomial, 2^n by the exponent. */
#pragma omp declare simd notinbranch
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = nearbyintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  /* ln2 in two parts: r exact to float */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } u = { .f = p };
    u.i += (int32_t)n << 23;
    return u.f;
}

#define DEFINE_ATTENTION(NAME, D, E, SCALAR, VLOAD)                                                               \
static void NAME(const E *q, const E *kt, const E *v, int64_t B, int64_t H, int64_t T, const Layout *lay,        \
                 const int64_t *lengths, float scale, float *out) {                                              \
    enum { DV = D / 16 };                                                                                        \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                                             \
    for (int64_t bh = 0; bh < B * H; bh++) {                                                                     \
        const int64_t b = bh / H, h = bh % H, L = lengths[b], kld = lay->k_d;                                    \
        const E *qb = q + lay->q_base[b] + h * lay->q_h, *vb = v + lay->v_base[b] + h * lay->v_h;               \
        const E *kb = kt + lay->k_base[b] + h * lay->k_h;                                                        \
        float *ob = out + lay->o_base[b] + h * D;                                                                \
        float s[RB][MAXT + KB] __attribute__((aligned(64)));                                                     \
        float tail[D][KB] __attribute__((aligned(64)));  /* the last, partial tile of keys, zero-padded */       \
        const int64_t full = L / KB * KB;                                                                        \
        for (int d = 0; d < D; d++)                                                                              \
            for (int j = 0; j < KB; j++) tail[d][j] = full + j < L ? SCALAR(kb + d * kld + full + j) : 0.0f;      \
        for (int64_t i = L; i < T; i++) memset(ob + i * H * D, 0, D * sizeof(float));                            \
        for (int64_t i0 = 0; i0 < L; i0 += RB) {                                                                 \
            float qv[RB][D];                                                                                     \
            for (int r = 0; r < RB; r++) {  /* rows past L repeat the last one; they are not written */          \
                const E *qi = qb + (i0 + r < L ? i0 + r : L - 1) * lay->q_t;                                     \
                for (int d = 0; d < D; d++) qv[r][d] = SCALAR(qi + d) * scale;                                   \
            }                                                                                                    \
            for (int64_t j0 = 0; j0 < L; j0 += KB) {  /* scores: (RB, KB) tiles */                               \
                v16 a[RB][2];                                                                                    \
                for (int r = 0; r < RB; r++) a[r][0] = a[r][1] = (v16){0};                                       \
                for (int d = 0; d < D; d++) {                                                                    \
                    v16 k0, k1;                                                                                  \
                    if (j0 < full) { k0 = VLOAD(kb + d * kld + j0); k1 = VLOAD(kb + d * kld + j0 + 16); }        \
                    else { k0 = LOAD(&tail[d][0]); k1 = LOAD(&tail[d][16]); }                                    \
                    for (int r = 0; r < RB; r++) { a[r][0] += qv[r][d] * k0; a[r][1] += qv[r][d] * k1; }        \
                }                                                                                                \
                for (int r = 0; r < RB; r++) { STORE(&s[r][j0], a[r][0]); STORE(&s[r][j0 + 16], a[r][1]); }     \
            }                                                                                                    \
            float inv[RB];                                                                                       \
            for (int r = 0; r < RB; r++) {  /* softmax over the L real keys */                                   \
                float top = -INFINITY, sum = 0.0f;                                                               \
                _Pragma("omp simd reduction(max:top)")                                                           \
                for (int64_t j = 0; j < L; j++) top = s[r][j] > top ? s[r][j] : top;                             \
                _Pragma("omp simd reduction(+:sum)")                                                             \
                for (int64_t j = 0; j < L; j++) { s[r][j] = exp_nonpositive(s[r][j] - top); sum += s[r][j]; }    \
                inv[r] = 1.0f / sum;                                                                             \
            }                                                                                                    \
            v16 o[RB][DV];                                                                                       \
            for (int r = 0; r < RB; r++)                                                                         \
                for (int c = 0; c < DV; c++) o[r][c] = (v16){0};                                                 \
            for (int64_t j = 0; j < L; j++) {  /* (RB, L) @ (L, D) */                                            \
                const E *vj = vb + j * lay->v_t;                                                                 \
                for (int c = 0; c < DV; c++) {                                                                   \
                    const v16 x = VLOAD(vj + 16 * c);                                                            \
                    for (int r = 0; r < RB; r++) o[r][c] += s[r][j] * x;                                         \
                }                                                                                                \
            }                                                                                                    \
            for (int r = 0; r < RB && i0 + r < L; r++) {                                                         \
                float *dst = ob + (i0 + r) * H * D;                                                              \
                for (int c = 0; c < DV; c++) STORE(dst + 16 * c, o[r][c] * inv[r]);                              \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
}

/* bfloat16 inputs: the upper half of a float32, widened on load (the arithmetic stays float32) */
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
static inline float bf16_scalar(const uint16_t *p) {
    union { uint32_t i; float f; } u = { .i = (uint32_t)*p << 16 };
    return u.f;
}
static inline v16 bf16_vector(const uint16_t *p) {
    const u32x16 w = __builtin_convertvector(*(const u16x16 *)p, u32x16) << 16;
    return (v16)w;
}
#define F32_SCALAR(p) (*(p))

DEFINE_ATTENTION(attention32, 32, float, F32_SCALAR, LOAD)
DEFINE_ATTENTION(attention64, 64, float, F32_SCALAR, LOAD)
DEFINE_ATTENTION(attention32_bf16, 32, uint16_t, bf16_scalar, bf16_vector)
DEFINE_ATTENTION(attention64_bf16, 64, uint16_t, bf16_scalar, bf16_vector)

/* q, kt, v float32 (bf16 = 0) or bfloat16 (bf16 = 1); out float32. T: rows of out per sequence (rows from
   lengths[b] to T are zeroed; 0 for packed rows, nothing to zero). The offsets and strides of `Layout`, flattened.
   0 when done; 1 (nothing written) for a head size or length this file does not handle. */
int attention(const void *q, const void *kt, const void *v, int bf16, int64_t B, int64_t H, int64_t T, int64_t D,
              const int64_t *q_base, const int64_t *k_base, const int64_t *v_base, const int64_t *o_base,
              const int64_t *strides, const int64_t *lengths, float scale, float *out) {
    const Layout lay = { q_base, k_base, v_base, o_base, strides[0], strides[1], strides[2], strides[3], strides[4],
                         strides[5] };
    for (int64_t b = 0; b < B; b++)
        if (lengths[b] > MAXT) return 1;
    if (D == 32 && !bf16) attention32(q, kt, v, B, H, T, &lay, lengths, scale, out);
    else if (D == 64 && !bf16) attention64(q, kt, v, B, H, T, &lay, lengths, scale, out);
    else if (D == 32) attention32_bf16(q, kt, v, B, H, T, &lay, lengths, scale, out);
    else if (D == 64) attention64_bf16(q, kt, v, B, H, T, &lay, lengths, scale, out);
    else return 1;
    return 0;
}
