/* specula's CPU linear kernels: y[M, out] = x[M, in] @ W^T (+ b) for the few rows (M = 1..64)
 * decoding and tree verification pass, streaming the weight once per group of MR = 6 rows.
 *
 * Weights are packed in column blocks of NB = 16 outputs, wp[block][i][16], so each block is one
 * contiguous stream (out is padded up to a multiple of 16 with zero columns); the rows of x are
 * packed per group of 6 as xp[group][i][6], so one cache line feeds every row of a step of i. A
 * thread owns whole blocks; for each group it runs over i in order with up to 6 x 2 AVX2
 * accumulators, so every output element is the same chain of fused multiply-adds over
 * i = 0, 1, ... whatever M is and whichever rows run beside it: the result of a row is bitwise
 * independent of the other rows in the call (batch invariant), which is what lossless tree
 * verification needs.
 *
 * f32: float weights.  w8: int8 weights with one float scale per output column (weight-only
 * quantization: activations stay float; y = scale * sum_i x_i * q_i, the same order again).
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define NB 16
#define MR 6

int specula_block(void) { return NB; }

void specula_pack_f32(const float *w, float *wp, int in, int out) {
    int blocks = (out + NB - 1) / NB;
    for (int bk = 0; bk < blocks; bk++)
        for (int i = 0; i < in; i++)
            for (int c = 0; c < NB; c++) {
                int o = bk * NB + c;
                wp[((size_t)bk * in + i) * NB + c] = o < out ? w[(size_t)o * in + i] : 0.0f;
            }
}

void specula_pack_w8(const int8_t *w, int8_t *wp, int in, int out) {
    int blocks = (out + NB - 1) / NB;
    for (int bk = 0; bk < blocks; bk++)
        for (int i = 0; i < in; i++)
            for (int c = 0; c < NB; c++) {
                int o = bk * NB + c;
                wp[((size_t)bk * in + i) * NB + c] = o < out ? w[(size_t)o * in + i] : 0;
            }
}

/* x [M, in] -> [groups][in][MR] (zero rows pad the last group); free() the result. */
static float *pack_rows(const float *x, int M, int in) {
    int groups = (M + MR - 1) / MR;
    float *xp = malloc((size_t)groups * in * MR * sizeof(float));
    for (int gr = 0; gr < groups; gr++)
        for (int i = 0; i < in; i++)
            for (int m = 0; m < MR; m++) {
                int r = gr * MR + m;
                xp[((size_t)gr * in + i) * MR + m] = r < M ? x[(size_t)r * in + i] : 0.0f;
            }
    return xp;
}

static inline void store_rows(__m256 a[MR][2], float *y, const float *scale, const float *b, int m0, int mb,
                              int o0, int nc, int out) {
    for (int m = 0; m < mb; m++) {
        float tmp[NB];
        _mm256_storeu_ps(tmp, a[m][0]);
        _mm256_storeu_ps(tmp + 8, a[m][1]);
        float *ym = y + (size_t)(m0 + m) * out + o0;
        for (int c = 0; c < nc; c++) {
            float v = scale ? tmp[c] * scale[o0 + c] : tmp[c];
            ym[c] = b ? v + b[o0 + c] : v;
        }
    }
}

/* One block of 16 columns for the MB rows of a group; MB is a compile-time constant at every use
 * (the switches below), so the accumulators stay in registers. LOAD(i) yields w0, w1. */
#define BLOCK_BODY(MB, LOAD, SCALE)                                                                  \
    do {                                                                                             \
        __m256 a[MR][2];                                                                             \
        for (int m = 0; m < MB; m++) a[m][0] = a[m][1] = _mm256_setzero_ps();                        \
        for (int i = 0; i < in; i++) {                                                               \
            __m256 w0, w1;                                                                           \
            LOAD(i);                                                                                 \
            const float *xi = xg + (size_t)i * MR;                                                   \
            for (int m = 0; m < MB; m++) {                                                           \
                __m256 xv = _mm256_broadcast_ss(xi + m);                                             \
                a[m][0] = _mm256_fmadd_ps(w0, xv, a[m][0]);                                          \
                a[m][1] = _mm256_fmadd_ps(w1, xv, a[m][1]);                                          \
            }                                                                                        \
        }                                                                                            \
        store_rows(a, y, SCALE, b, m0, MB, o0, nc, out);                                             \
    } while (0)

#define SWITCH_ROWS(LOAD, SCALE)                                                                     \
    switch (M - m0 < MR ? M - m0 : MR) {                                                             \
        case 1: BLOCK_BODY(1, LOAD, SCALE); break;                                                   \
        case 2: BLOCK_BODY(2, LOAD, SCALE); break;                                                   \
        case 3: BLOCK_BODY(3, LOAD, SCALE); break;                                                   \
        case 4: BLOCK_BODY(4, LOAD, SCALE); break;                                                   \
        case 5: BLOCK_BODY(5, LOAD, SCALE); break;                                                   \
        default: BLOCK_BODY(6, LOAD, SCALE); break;                                                  \
    }

#define LOAD_F32(i)                                                                                  \
    w0 = _mm256_loadu_ps(wb + (size_t)(i) * NB);                                                     \
    w1 = _mm256_loadu_ps(wb + (size_t)(i) * NB + 8)

#define LOAD_W8(i)                                                                                   \
    __m128i q = _mm_loadu_si128((const __m128i *)(wb + (size_t)(i) * NB));                           \
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));                                                \
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))

void specula_linear_f32(const float *x, const float *wp, const float *b, float *y, int M, int in, int out,
                        int threads) {
    int blocks = (out + NB - 1) / NB, groups = (M + MR - 1) / MR;
    float *xp = pack_rows(x, M, in);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int bk = 0; bk < blocks; bk++) {
        const float *wb = wp + (size_t)bk * in * NB;
        int o0 = bk * NB, nc = out - o0 < NB ? out - o0 : NB;
        for (int gr = 0; gr < groups; gr++) {
            int m0 = gr * MR;
            const float *xg = xp + (size_t)gr * in * MR;
            SWITCH_ROWS(LOAD_F32, NULL)
        }
    }
    free(xp);
}

void specula_linear_w8(const float *x, const int8_t *wp, const float *scale, const float *b, float *y, int M, int in,
                       int out, int threads) {
    int blocks = (out + NB - 1) / NB, groups = (M + MR - 1) / MR;
    float *xp = pack_rows(x, M, in);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int bk = 0; bk < blocks; bk++) {
        const int8_t *wb = wp + (size_t)bk * in * NB;
        int o0 = bk * NB, nc = out - o0 < NB ? out - o0 : NB;
        for (int gr = 0; gr < groups; gr++) {
            int m0 = gr * MR;
            const float *xg = xp + (size_t)gr * in * MR;
            SWITCH_ROWS(LOAD_W8, scale)
        }
    }
    free(xp);
}
