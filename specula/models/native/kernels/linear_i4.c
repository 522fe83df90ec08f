/* i4: 4-bit weights in groups of I4_GROUP inputs, one float scale per output column and group, and
 * int8 activations (one scale per row, as i8): a draft model's linears at a little over half of
 * i8's weight bytes. A draft needs no exactness, only agreement with the target, and one-row
 * drafting passes stream every weight once per token: on the 2-core machine a Qwen 0.5B draft's
 * int8 token took ~20 ms, the memory bus's speed for its 0.39 GB.
 *
 * Layout (`specula_pack_i4`, pack.c): wp[block][in64 / 8][16 columns][4] bytes, in64 = `in` rounded
 * up to I4_GROUP. Byte k of column c at step s holds w[c][8s + k] + 8 in its low nibble and
 * w[c][8s + 4 + k] + 8 in its high one (weights -7..7, stored 1..15; padding 8, a zero weight).
 * One 64-byte load is 16 columns x 8 inputs: its low nibbles are the i8 layout's quad 2s, its high
 * nibbles quad 2s + 1. Scales gscale[block][group][16].
 *
 * Per row and group, exactly in int32: sum_i (w_i + 8) x_i - 8 sum_i x_i = sum_i w_i x_i (VNNI's
 * `vpdpbusd` takes the unsigned nibbles beside the signed activations; AVX2's maddubs the same, no
 * saturation: 2 x 15 x 127 < 32767). Then, group after group, f = fma(float(sum), gscale, f), and
 * y = f * x_scale (+ bias): the same operations in the same order in every variant (AVX2 here, VNNI
 * in linear_i4_vnni.c, and AMX for calls of I4_AMX_ROWS rows or more: linear_amx.c), so they
 * compute the same bits, and each row is independent of the rows beside it. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"
#include "linear.h"

/* ------------------------------------------------------------------------------------------- AVX2 */
/* One block from wb over rows m0 .. m0 + MB: a 64-byte step as two ymm halves of 8 columns. */
#define I4_YMM_BODY(MB)                                                                              \
    do {                                                                                             \
        float f[MB][NB];                                                                             \
        memset(f, 0, sizeof f);                                                                      \
        for (int g = 0; g < groups; g++) {                                                           \
            __m256i a[MB][2];                                                                        \
            for (int m = 0; m < MB; m++) a[m][0] = a[m][1] = _mm256_setzero_si256();                 \
            for (int s = g * (I4_GROUP / 8); s < (g + 1) * (I4_GROUP / 8); s++) {                    \
                PREFETCH_W(wb, (size_t)s * 64);                                                      \
                __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + (size_t)s * 64));             \
                __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + (size_t)s * 64 + 32));        \
                __m256i l0 = _mm256_and_si256(w0, nib), h0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), nib); \
                __m256i l1 = _mm256_and_si256(w1, nib), h1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), nib); \
                for (int m = 0; m < MB; m++) {                                                       \
                    int32_t x0, x1;                                                                  \
                    const int8_t *xm = xq + (size_t)(m0 + m) * in64 + (size_t)s * 8;                 \
                    memcpy(&x0, xm, 4);                                                              \
                    memcpy(&x1, xm + 4, 4);                                                          \
                    __m256i b0 = _mm256_set1_epi32(x0), b1 = _mm256_set1_epi32(x1);                  \
                    __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(l0, b0), _mm256_maddubs_epi16(h0, b1)); \
                    __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(l1, b0), _mm256_maddubs_epi16(h1, b1)); \
                    a[m][0] = _mm256_add_epi32(a[m][0], _mm256_madd_epi16(p0, ones));                \
                    a[m][1] = _mm256_add_epi32(a[m][1], _mm256_madd_epi16(p1, ones));                \
                }                                                                                    \
            }                                                                                        \
            __m256 s0 = _mm256_loadu_ps(gs + (size_t)g * NB), s1 = _mm256_loadu_ps(gs + (size_t)g * NB + 8); \
            for (int m = 0; m < MB; m++) {                                                           \
                __m256i z = _mm256_set1_epi32(xsum[(size_t)(m0 + m) * groups + g]);                  \
                __m256 v0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(a[m][0], z));                        \
                __m256 v1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(a[m][1], z));                        \
                _mm256_storeu_ps(f[m], _mm256_fmadd_ps(v0, s0, _mm256_loadu_ps(f[m])));              \
                _mm256_storeu_ps(f[m] + 8, _mm256_fmadd_ps(v1, s1, _mm256_loadu_ps(f[m] + 8)));      \
            }                                                                                        \
        }                                                                                            \
        i4_store(f, j, m0, MB, o0);                                                                  \
    } while (0)

/* Item `bk`: one column block, every row, in chunks of up to 4 (8 int32 sums in the 16 ymm). */
static void i4_item_avx2(void *arg, int bk) {
    const struct i4_job *j = arg;
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int8_t *xq = j->xq;
    const int32_t *xsum = j->xsum;
    int groups = j->groups, in64 = j->in64, o0 = bk * NB;
    const uint8_t *wb = j->wp + (size_t)bk * in64 * NB / 2;
    const float *gs = j->gscale + (size_t)bk * groups * NB;
    for (int m0 = 0; m0 < j->M; m0 += 4) {
        switch (j->M - m0 < 4 ? j->M - m0 : 4) {
            case 1: I4_YMM_BODY(1); break;
            case 2: I4_YMM_BODY(2); break;
            case 3: I4_YMM_BODY(3); break;
            default: I4_YMM_BODY(4); break;
        }
    }
}

/* Column blocks per VNNI item: 4 for 1-2 rows, 3 for 3, 2 for 4, else 1 (the rows then run in
 * chunks of up to 8 over a block that stays in L1 / L2), fewer where a thread would get under four
 * items; one where `several_block_items` says so. */
static int i4_blocks_per_item(int M, int out, int threads) {
    return several_block_items() ? fewer_for_threads(M <= 2 ? 4 : M == 3 ? 3 : M == 4 ? 2 : 1, out, threads) : 1;
}

/* y [M, out] = x [M, in] through the i4 weights wp / gscale (+ b); returns 0, or -1 when memory
 * for the quantized rows could not be had (y then untouched). */
int specula_linear_i4(const float *x, const uint8_t *wp, const float *gscale, const float *b, float *y, int M,
                      int in, int out, int threads) {
    if (M <= 0 || out <= 0) return 0;
    int groups = (in + I4_GROUP - 1) / I4_GROUP, in64 = groups * I4_GROUP, blocks = (out + NB - 1) / NB;
    int level = specula_isa(), amx = level == 2 && M >= I4_AMX_ROWS;
    int rows = amx ? (M + 15) / 16 * 16 : M;  /* AMX: whole tiles of 16 rows, the padding zeros */
    int8_t *xq = malloc((size_t)rows * in64);
    float *xs = malloc((size_t)M * sizeof(float));
    int32_t *xsum = malloc((size_t)M * groups * sizeof(int32_t));
    if (!xq || !xs || !xsum) {
        free(xq);
        free(xs);
        free(xsum);
        return -1;
    }
    specula_quantize_rows(x, xq, xs, amx ? NULL : xsum, M, in, in64, 0, threads);  /* AMX needs no zero point */
    if (rows > M) memset(xq + (size_t)M * in64, 0, (size_t)(rows - M) * in64);
    struct i4_job job = {.xq = xq, .xs = xs, .xsum = xsum, .wp = wp, .gscale = gscale, .b = b, .y = y, .M = M,
                         .out = out, .in64 = in64, .groups = groups, .panel = 1};
    if (amx) {
        specula_parallel(threads, (rows + AMX_CHUNK - 1) / AMX_CHUNK * ((blocks + 1) / 2), specula_i4_block_amx, &job);
    } else if (level) {
        job.panel = i4_blocks_per_item(M, out, threads);
        specula_parallel(threads, (blocks + job.panel - 1) / job.panel, specula_i4_item_vnni, &job);
    } else
        specula_parallel(threads, blocks, i4_item_avx2, &job);
    free(xq);
    free(xs);
    free(xsum);
    return 0;
}
