/* AVX-512 attention scores for items of many queries (a prompt's rows; `ops.c`'s `attention_item`),
 * chosen at run time (`specula_isa`). `ops.c`'s `dot` adds a score as eight lanes, lane l a chain of
 * fused multiply-adds over dims l, l + 8, l + 16, ... from zero, then the lanes as ((l0 + l1) + (l2 +
 * l3)) + ((l4 + l5) + (l6 + l7)). Here each zmm holds 16 keys' partial sums of one lane: a block of 16
 * keys is transposed once into `kt` (dim-major), and for each query the dims run in the same order,
 * lane by lane, into eight accumulators, which are added in the same tree. So every score is `dot`'s,
 * bit for bit, with no horizontal sums and each key load shared by three queries (`dot_block` shares
 * it by three too, but ends every score in a horizontal sum). */

#include <immintrin.h>
#include <stdint.h>

#include "layout.h"
#include "linear.h"

#define KEYS 16 /* keys a block: one zmm of scores a query */

/* The scores of queries q[0 .. NQ - 1] against the transposed block kt [d][KEYS] into out[k] + j0. */
#define SCORES_BODY(NQ)                                                                              \
    do {                                                                                             \
        __m512 acc[NQ][8];                                                                           \
        for (int k = 0; k < NQ; k++)                                                                 \
            for (int l = 0; l < 8; l++) acc[k][l] = _mm512_setzero_ps();                             \
        for (int i0 = 0; i0 < d; i0 += 8) {                                                          \
            for (int l = 0; l < 8; l++) {                                                            \
                __m512 kv = _mm512_load_ps(kt + (size_t)(i0 + l) * KEYS);                            \
                __asm__("" : "+v"(kv)); /* in a register: not loaded again as each FMA's operand */       \
                for (int k = 0; k < NQ; k++)                                                         \
                    acc[k][l] = _mm512_fmadd_ps(_mm512_set1_ps(q[k][i0 + l]), kv, acc[k][l]);         \
            }                                                                                        \
        }                                                                                            \
        for (int k = 0; k < NQ; k++) {                                                               \
            __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[k][0], acc[k][1]),              \
                                                   _mm512_add_ps(acc[k][2], acc[k][3])),             \
                                     _mm512_add_ps(_mm512_add_ps(acc[k][4], acc[k][5]),              \
                                                   _mm512_add_ps(acc[k][6], acc[k][7])));            \
            _mm512_storeu_ps(out[k] + j0, s);                                                        \
        }                                                                                            \
    } while (0)

__attribute__((target("avx512f"))) static void scores3(const float *const *q, const float *kt, int d, float *const *out,
                                                       int j0) {
    SCORES_BODY(3);
}
__attribute__((target("avx512f"))) static void scores2(const float *const *q, const float *kt, int d, float *const *out,
                                                       int j0) {
    SCORES_BODY(2);
}
__attribute__((target("avx512f"))) static void scores1(const float *const *q, const float *kt, int d, float *const *out,
                                                       int j0) {
    SCORES_BODY(1);
}

/* ps[t][j] = q[t] . k_j (`dot`'s arithmetic) for the nq queries and the keys k_j = k + j * d of every
 * whole block of KEYS below `slots`, a query's blocks only up to the one holding slot limits[t] - 1
 * (it reads no score past its limit). d: a multiple of 8, at most SPECULA_SCORES_MAX_D. Returns the
 * slot the blocks end at (slots rounded down to KEYS): the caller computes the rest. */
__attribute__((target("avx512f"))) int specula_scores_avx512(const float *const *qs, int nq, const float *k, int d,
                                                             int slots, const int *limits, float *const *ps) {
    float kt[SPECULA_SCORES_MAX_D * KEYS] __attribute__((aligned(64)));
    int end = slots / KEYS * KEYS;
    for (int j0 = 0; j0 < end; j0 += KEYS) {
        for (int s = 0; s < KEYS; s++) {
            const float *row = k + (size_t)(j0 + s) * d;
            for (int i = 0; i < d; i++) kt[(size_t)i * KEYS + s] = row[i];
        }
        for (int t = 0; t < nq;) {
            int m = nq - t < 3 ? nq - t : 3, reach = 0; /* the group's furthest limit */
            for (int u = 0; u < m; u++) reach = limits[t + u] > reach ? limits[t + u] : reach;
            if (j0 < reach) {
                if (m == 3) scores3(qs + t, kt, d, ps + t, j0);
                else if (m == 2) scores2(qs + t, kt, d, ps + t, j0);
                else scores1(qs + t, kt, d, ps + t, j0);
            }
            t += m;
        }
    }
    return end;
}
