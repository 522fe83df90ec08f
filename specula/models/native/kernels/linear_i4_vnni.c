/* The AVX-512 VNNI variant of linear_i4.c's kernel (its layout and arithmetic are described there):
 * an item of up to 4 column blocks over every row of the call, the rows in chunks. A file of its own
 * so that a CPU without AVX-512 compiles it without optimisation (`kernels.compile_plan`): it is never
 * run there, and at -O3 its row-count switches took most of linear_i4.c's 18-24 s build. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "layout.h"
#include "linear.h"

/* The rows per chunk of an item of `kb` column blocks (the registers: kb x rows int32 sums, as many
 * float sums, 2 kb unpacked weights and two broadcasts within the 32 zmm). */
static inline int i4_chunk(int kb) { return kb >= 4 ? 2 : kb == 3 ? 3 : kb == 2 ? 4 : 8; }

/* ------------------------------------------------------------------------------------- AVX-512 VNNI */
/* KB blocks from wb (o0 the first's first output) over rows m0 .. m0 + MB. */
#define I4_ZMM_BODY(KB, MB)                                                                          \
    do {                                                                                             \
        __m512 f[KB][MB];                                                                            \
        for (int k = 0; k < KB; k++)                                                                 \
            for (int m = 0; m < MB; m++) f[k][m] = _mm512_setzero_ps();                              \
        for (int g = 0; g < groups; g++) {                                                           \
            __m512i a[KB][MB];                                                                       \
            for (int k = 0; k < KB; k++)                                                             \
                for (int m = 0; m < MB; m++) a[k][m] = _mm512_setzero_si512();                       \
            for (int s = g * (I4_GROUP / 8); s < (g + 1) * (I4_GROUP / 8); s++) {                    \
                __m512i lo[KB], hi[KB];                                                              \
                for (int k = 0; k < KB; k++) {                                                       \
                    const uint8_t *wk = wb + (size_t)k * stride;                                     \
                    PREFETCH_W(wk, (size_t)s * 64);                                                  \
                    __m512i w = _mm512_loadu_si512((const void *)(wk + (size_t)s * 64));             \
                    lo[k] = _mm512_and_si512(w, nib);                                                \
                    hi[k] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);                          \
                }                                                                                    \
                for (int m = 0; m < MB; m++) {                                                       \
                    int32_t x0, x1;                                                                  \
                    const int8_t *xm = xq + (size_t)(m0 + m) * in64 + (size_t)s * 8;                 \
                    memcpy(&x0, xm, 4);                                                              \
                    memcpy(&x1, xm + 4, 4);                                                          \
                    __m512i b0 = _mm512_set1_epi32(x0), b1 = _mm512_set1_epi32(x1);                  \
                    for (int k = 0; k < KB; k++)                                                     \
                        a[k][m] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[k][m], lo[k], b0), hi[k], b1); \
                }                                                                                    \
            }                                                                                        \
            for (int k = 0; k < KB; k++) {                                                           \
                __m512 sc = _mm512_loadu_ps(gs + ((size_t)k * groups + g) * NB);                     \
                for (int m = 0; m < MB; m++) {                                                       \
                    __m512i z = _mm512_set1_epi32(xsum[(size_t)(m0 + m) * groups + g]);              \
                    f[k][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[k][m], z)), sc, f[k][m]); \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int k = 0; k < KB; k++) {                                                               \
            float acc[MB][NB];                                                                       \
            for (int m = 0; m < MB; m++) _mm512_storeu_ps(acc[m], f[k][m]);                          \
            i4_store(acc, j, m0, MB, o0 + k * NB);                                                   \
        }                                                                                            \
    } while (0)

#define I4_ZMM_ROWS(KB) SWITCH_ROWS_8(I4_ZMM_BODY, KB, mb)

/* Item `item`: j->panel adjacent column blocks (fewer for the last), every row, in chunks. */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void specula_i4_item_vnni(void *arg, int item) {
    const struct i4_job *j = arg;
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const int8_t *xq = j->xq;
    const int32_t *xsum = j->xsum;
    int groups = j->groups, in64 = j->in64, blocks = (j->out + NB - 1) / NB;
    int bk0 = item * j->panel, kb = bk0 + j->panel < blocks ? j->panel : blocks - bk0, o0 = bk0 * NB;
    size_t stride = (size_t)in64 * NB / 2;  /* bytes per block */
    const uint8_t *wb = j->wp + (size_t)bk0 * stride;
    const float *gs = j->gscale + (size_t)bk0 * groups * NB;
    int chunk = i4_chunk(kb);
    for (int m0 = 0; m0 < j->M; m0 += chunk) {
        int mb = j->M - m0 < chunk ? j->M - m0 : chunk;
        switch (kb) {
            case 4: I4_ZMM_ROWS(4) break;
            case 3: I4_ZMM_ROWS(3) break;
            case 2: I4_ZMM_ROWS(2) break;
            default: I4_ZMM_ROWS(1) break;
        }
    }
}
