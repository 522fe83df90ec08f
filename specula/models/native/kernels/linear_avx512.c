/* AVX-512 variants of linear.c's kernels, chosen at run time (`specula_isa`): the CPU flags are
 * read when the library loads, and `specula_set_isa(0)` keeps the AVX2 code (tests compare the two).
 *
 * f32 / w8: one zmm holds a column block (16 outputs). Calls of up to MULTI_ROWS rows (decoding,
 * small trees) run items of 2-4 blocks, every row over all of them at once (`MULTI_ITEM`: more weight
 * streams in flight, one broadcast per row and step for all the blocks); larger calls run even groups
 * of up to MRZ = 16 rows (17 as one), one accumulator per row in the 32 registers, where
 * AVX2 runs groups of at most 6 (8 rows as 4 + 4, over chunks of 128 inputs). Every output is
 * the same chain of fused multiply-adds over i = 0, 1, ... as in linear.c (a lane of a zmm rounds
 * as a lane of a ymm), so the bits do not depend on the variant.
 *
 * i8 with VNNI: `vpdpbusd` multiplies unsigned by signed bytes and adds each group of 4 into an
 * int32 lane, exactly (no int16 saturation step as in AVX2's maddubs). The activations are
 * offset to u = q + 128 (0..255) and the weights' column sums are accumulated beside the rows
 * (`vpdpbusd` by ones), so sum_i q_i w_i = sum_i u_i w_i - 128 sum_i w_i: the same int32 as the
 * AVX2 kernel, then the same float scaling, so every output is bit for bit what linear.c
 * computes. One 64-byte load holds 16 columns x 4 inputs (the i8 layout, layout.h); a group of
 * up to 16 rows shares it (32 zmm registers: 16 row sums, the column sums, the weights). */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "layout.h"
#include "linear.h"

#define MRV 16

static int isa = -1;  /* -1: not decided yet; 0: AVX2; 1: AVX-512 F/BW/VNNI; 2: that and AMX-INT8 */

static int cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}

/* level 0: AVX2 only; 1: AVX-512 where the CPU has it; 2: AVX-512 and, for i8 calls of many rows,
 * AMX where the CPU and the OS allow it (linear_amx.c). Returns the level in force. */
int specula_set_isa(int level) {
    isa = level > 0 && cpu_has_avx512();
    if (isa && level > 1 && specula_amx_request()) isa = 2;
    return isa;
}

int specula_isa(void) {
    if (isa < 0) specula_set_isa(2);
    return isa;
}

/* f32 / w8: rows m0 .. m0 + MB of a decoding or verification call over KB adjacent column blocks
 * from wb (o0 the first's first output), the rows read where they lie in x (the group's first at
 * xg, `in` apart: no packed copy, see linear_float). LOAD(dst, base, i) yields step i of the block
 * at base. Each step of i loads KB weight vectors from KB streams and broadcasts each row's x_i
 * once for KB FMAs, so a core keeps KB lines in flight where one block kept one (`MULTI_ITEM`, f32
 * calls of up to MULTI_ROWS rows): a stack of SmolLM2-sized [1536, 576] f32 weights, 2 threads (Zen
 * 4, a C harness), 1 / 4 / 9 / 12 rows 17.0-17.6 / 17.7-17.9 / 22.6-22.8 / 23.6-24.2 ms one block at
 * a time, 15.9-16.2 / 17.2 (4 blocks) / 19.1-19.2 / 20.4-20.6 ms (2 blocks). KB x MB accumulators,
 * KB weights and the broadcast fit the 32 registers (4 x 6, 3 x 9, 2 x 14, 1 x 16). Every output is
 * the one FMA chain over i = 0, 1, ..., whatever KB, so the bits are those of the other items. */
/* The rows' FMAs of one step over KB blocks' weights w[KB] (the rows' x at X[m * in]), and the KB x MB
 * accumulators' stores: what ZMM_MULTI_BODY and c8's C8_MULTI_BODY share. */
#define ZMM_ROWS_FMA(KB, MB, X)                                                                      \
    for (int m = 0; m < MB; m++) {                                                                   \
        __m512 xm = _mm512_set1_ps((X)[(size_t)m * in]);                                             \
        for (int k = 0; k < KB; k++) a[k][m] = _mm512_fmadd_ps(w[k], xm, a[k][m]);                   \
    }
#define ZMM_STORE_BLOCKS(KB, MB, SCALE)                                                              \
    for (int k = 0; k < KB; k++) {                                                                   \
        float acc[MB][NB];                                                                           \
        int ok = o0 + k * NB, nk = out - ok < NB ? out - ok : NB;                                    \
        for (int m = 0; m < MB; m++) _mm512_storeu_ps(acc[m], a[k][m]);                              \
        store_rows(acc, y, SCALE, b, m0, MB, ok, nk, out);                                           \
    }
#define ZMM_MULTI_BODY(KB, MB, LOAD, SCALE)                                                          \
    do {                                                                                             \
        __m512 a[KB][MB];                                                                            \
        for (int k = 0; k < KB; k++)                                                                 \
            for (int m = 0; m < MB; m++) a[k][m] = _mm512_setzero_ps();                              \
        for (int i = 0; i < in; i++) {                                                               \
            __m512 w[KB];                                                                            \
            for (int k = 0; k < KB; k++) {                                                           \
                PREFETCH_W(wb + (size_t)k * in * NB, (size_t)(i) * NB * sizeof(*wb));                \
                LOAD(w[k], wb + (size_t)k * in * NB, i);                                             \
            }                                                                                        \
            ZMM_ROWS_FMA(KB, MB, xg + i)                                                             \
        }                                                                                            \
        ZMM_STORE_BLOCKS(KB, MB, SCALE)                                                              \
    } while (0)
#define ZMM_BODY(MB, LOAD, SCALE) ZMM_MULTI_BODY(1, MB, LOAD, SCALE)

#define ZMM_LOAD_F32(dst, base, i) dst = _mm512_loadu_ps((base) + (size_t)(i) * NB)
#define ZMM_LOAD_W8(dst, base, i) \
    dst = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((base) + (size_t)(i) * NB))))

/* The group's row count (ROWS, at most MRZ) as a constant for BODY(MB, LOAD, SCALE), so its
 * accumulators stay in registers: ZMM_BODY for rows where they lie, ZMM_CHUNK_BODY for panels. */
#define ZMM_CASE(BODY, MB, LOAD, SCALE) case MB: BODY(MB, LOAD, SCALE); break;
#define ZMM_ROWS_SWITCH(BODY, LOAD, SCALE) ZMM_ROWS_SWITCH_N(BODY, M - m0 < MRZ ? M - m0 : MRZ, LOAD, SCALE)
#define ZMM_ROWS_SWITCH_N(BODY, ROWS, LOAD, SCALE)                                                   \
    switch (ROWS) {                                                                                  \
        ZMM_CASE(BODY, 1, LOAD, SCALE) ZMM_CASE(BODY, 2, LOAD, SCALE) ZMM_CASE(BODY, 3, LOAD, SCALE) \
        ZMM_CASE(BODY, 4, LOAD, SCALE) ZMM_CASE(BODY, 5, LOAD, SCALE) ZMM_CASE(BODY, 6, LOAD, SCALE) \
        ZMM_CASE(BODY, 7, LOAD, SCALE) ZMM_CASE(BODY, 8, LOAD, SCALE) ZMM_CASE(BODY, 9, LOAD, SCALE) \
        ZMM_CASE(BODY, 10, LOAD, SCALE) ZMM_CASE(BODY, 11, LOAD, SCALE)                              \
        ZMM_CASE(BODY, 12, LOAD, SCALE) ZMM_CASE(BODY, 13, LOAD, SCALE)                              \
        ZMM_CASE(BODY, 14, LOAD, SCALE) ZMM_CASE(BODY, 15, LOAD, SCALE)                              \
        default: BODY(16, LOAD, SCALE); break;                                                       \
    }

/* Rows where they lie (calls of MULTI_ROWS + 1 .. PANEL_ROWS - 1 rows, and a lone block's item of a
 * smaller call): the call's rows in `groups` runs as even as can be (`even_group`), each run over the
 * block; up to DIRECT_ONE_GROUP = 17 rows (a 16-node tree and its root) run as one (`direct_groups`).
 * Runs of MRZ and a remainder left a run of a few rows on the FMA latency: one layer of Qwen2.5-Coder-1.5B's shapes
 * (its four projections, 2 threads, `runs/s74/kbench.py`) took 4.1 ms for 16 rows and 5.4 for 17 or
 * 18 as 16 + 1 and 16 + 2; now 3.8-4.1 for 17 in one run, 4.9 for 18 as 9 + 9, 5.3 for 20 against
 * 5.6 (24-48 rows within 4% either way). A run of 18 or more kept 1.5-2.5 times slower: the compiler
 * spilled its accumulators. Each row is still its own accumulator over i = 0, 1, ..., so which rows
 * share a run changes no bit. */

/* Group gr of the call's rows as they lie in x, the groups as even as can be. */
#define EVEN_GROUP(gr)                                                                               \
    int m0, mb;                                                                                      \
    even_group((gr), M, j->groups, &m0, &mb);                                                        \
    const float *xg = j->xp + (size_t)m0 * in;

#define ZMM_DIRECT_SWITCH(LOAD, SCALE)                                                               \
    switch (mb) {                                                                                    \
        ZMM_CASE(ZMM_BODY, DIRECT_ONE_GROUP, LOAD, SCALE)                                            \
        default: ZMM_ROWS_SWITCH_N(ZMM_BODY, mb, LOAD, SCALE)                                        \
    }

__attribute__((target("avx512f,avx512bw")))
FLOAT_BLOCK_ITEM(specula_f32_block_avx512, float, EVEN_GROUP, ZMM_DIRECT_SWITCH, ZMM_LOAD_F32, NULL)
__attribute__((target("avx512f,avx512bw")))
FLOAT_BLOCK_ITEM(specula_w8_block_avx512, int8_t, EVEN_GROUP, ZMM_DIRECT_SWITCH, ZMM_LOAD_W8, scale)

#define MC(KB, MB, LOAD, SCALE) case MB: ZMM_MULTI_BODY(KB, MB, LOAD, SCALE); break;
#define MULTI_SWITCH6(KB, LOAD, SCALE) \
    MC(KB, 1, LOAD, SCALE) MC(KB, 2, LOAD, SCALE) MC(KB, 3, LOAD, SCALE) MC(KB, 4, LOAD, SCALE) \
    MC(KB, 5, LOAD, SCALE) MC(KB, 6, LOAD, SCALE)
#define MULTI_SWITCH9(KB, LOAD, SCALE) \
    MULTI_SWITCH6(KB, LOAD, SCALE) MC(KB, 7, LOAD, SCALE) MC(KB, 8, LOAD, SCALE) MC(KB, 9, LOAD, SCALE)
#define MULTI_SWITCH14(KB, LOAD, SCALE) \
    MULTI_SWITCH9(KB, LOAD, SCALE) MC(KB, 10, LOAD, SCALE) MC(KB, 11, LOAD, SCALE) MC(KB, 12, LOAD, SCALE) \
    MC(KB, 13, LOAD, SCALE) MC(KB, 14, LOAD, SCALE)

/* f32 and w8 calls of up to MULTI_ROWS rows (decoding, small trees): one item is blocks bk0 .. bk1 (KB =
 * `multi_blocks` of them, fewer at the end), all M rows at once. A lone block at the end runs the
 * one-block item. */
#define MULTI_ITEM(NAME, WTYPE, LOAD, BLOCK_FN, SCALE)                                               \
    void NAME(void *arg, int item) {                                                                 \
        FLOAT_ITEM_OPERANDS                                                                          \
        const float *xg = j->xp;                                                                     \
        const WTYPE *wb = (const WTYPE *)j->wp + (size_t)bk0 * in * NB;                              \
        int o0 = bk0 * NB, m0 = 0;                                                                   \
        switch (bk1 - bk0) {                                                                         \
            case 4: switch (M) { MULTI_SWITCH6(4, LOAD, SCALE) } break;                              \
            case 3: switch (M) { MULTI_SWITCH9(3, LOAD, SCALE) } break;                              \
            case 2: switch (M) { MULTI_SWITCH14(2, LOAD, SCALE) } break;                             \
            default: {                                                                               \
                struct linear_job one = *j;                                                          \
                one.panel = 1;                                                                       \
                BLOCK_FN(&one, bk0);                                                                 \
            }                                                                                        \
        }                                                                                            \
    }

__attribute__((target("avx512f,avx512bw")))
MULTI_ITEM(specula_f32_multi_avx512, float, ZMM_LOAD_F32, specula_f32_block_avx512, NULL)
__attribute__((target("avx512f,avx512bw")))
MULTI_ITEM(specula_w8_multi_avx512, int8_t, ZMM_LOAD_W8, specula_w8_block_avx512, scale)

/* A prompt's panels: each group of rows runs over the panel's blocks in chunks of KC inputs, so the
 * group's packed chunk (xg[i][MRZ] for KC inputs i, 8 KB) stays in L1 while the panel's blocks
 * stream past it, where a whole group (36-573 KB) came back from L2 for every block. Between
 * chunks a block's accumulators wait in `acc` (stored and reloaded exactly), so every output is
 * still the one FMA chain over i = 0, 1, ... of the other items. */
#define KC 128
#define ZMM_CHUNK_BODY(MB, LOAD, SCALE)                                                              \
    do {                                                                                             \
        __m512 a[MB];                                                                                \
        for (int m = 0; m < MB; m++) a[m] = c0 ? _mm512_load_ps(acc[m]) : _mm512_setzero_ps();       \
        for (int i = c0; i < c1; i++) {                                                              \
            __m512 w;                                                                                \
            PREFETCH_W(wb, (size_t)(i) * NB * sizeof(*wb));                                          \
            LOAD(w, wb, i);                                                                          \
            for (int m = 0; m < MB; m++) a[m] = _mm512_fmadd_ps(w, _mm512_set1_ps(xg[(size_t)i * MRZ + m]), a[m]); \
        }                                                                                            \
        for (int m = 0; m < MB; m++) _mm512_store_ps(acc[m], a[m]);                                  \
        if (c1 == in) store_rows(acc, y, SCALE, b, m0, MB, o0, nc, out);                             \
    } while (0)

#define PANEL_ITEM(NAME, WTYPE, LOAD, SCALE)                                                         \
    void NAME(void *arg, int item) {                                                                 \
        FLOAT_ITEM_OPERANDS                                                                          \
        float panel_acc[PANEL][MRZ][NB] __attribute__((aligned(64)));                                \
        for (int gr = 0; gr < j->groups; gr++) {                                                     \
            int m0 = gr * MRZ;                                                                       \
            const float *xg = j->xp + (size_t)gr * in * MRZ;                                         \
            for (int c0 = 0; c0 < in; c0 += KC) {                                                    \
                int c1 = in - c0 < KC ? in : c0 + KC;                                                \
                for (int bk = bk0; bk < bk1; bk++) {                                                 \
                    const WTYPE *wb = (const WTYPE *)j->wp + (size_t)bk * in * NB;                   \
                    int o0 = bk * NB, nc = out - o0 < NB ? out - o0 : NB;                            \
                    float(*acc)[NB] = panel_acc[bk - bk0];                                           \
                    ZMM_ROWS_SWITCH(ZMM_CHUNK_BODY, LOAD, SCALE)                                     \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }

__attribute__((target("avx512f,avx512bw")))
PANEL_ITEM(specula_f32_panel_avx512, float, ZMM_LOAD_F32, NULL)
__attribute__((target("avx512f,avx512bw")))
PANEL_ITEM(specula_w8_panel_avx512, int8_t, ZMM_LOAD_W8, scale)

/* i8 with VNNI: rows m0 .. m0 + MB over KB adjacent column blocks from wb (o0 the first's first
 * output; u = q + 128, minus 128 x each block's column sums), every row over all KB at once. Calls
 * of up to VNNI_MULTI_ROWS rows (one-token drafting passes, a head's frontier) run items of KB =
 * `i8_multi_blocks` blocks (4 up to 4 rows, 3 up to 6, else 2; fewer at the end; one on AMD,
 * `several_block_items`), so a core keeps KB weight streams in flight where one block kept one (as
 * f32's `MULTI_ITEM`); larger calls run one block an item (VNNI_BODY). Each output is the same
 * exact int32 sum whatever KB, then the same `store_int_rows`: the bits do not depend on KB. */
#define VNNI_MULTI_BODY(KB, MB)                                                                      \
    do {                                                                                             \
        __m512i a[KB][MB], colsum[KB];                                                               \
        for (int k = 0; k < KB; k++) {                                                               \
            colsum[k] = _mm512_setzero_si512();                                                      \
            for (int m = 0; m < MB; m++) a[k][m] = _mm512_setzero_si512();                           \
        }                                                                                            \
        for (int iq = 0; iq < quads; iq++) {                                                         \
            __m512i w[KB];                                                                           \
            for (int k = 0; k < KB; k++) {                                                           \
                const int8_t *wk = wb + (size_t)k * quads * NB * 4;                                  \
                PREFETCH_W(wk, (size_t)iq * NB * 4);                                                 \
                w[k] = _mm512_loadu_si512((const void *)(wk + (size_t)iq * NB * 4));                 \
                colsum[k] = _mm512_dpbusd_epi32(colsum[k], ones, w[k]);                              \
            }                                                                                        \
            for (int m = 0; m < MB; m++) {                                                           \
                int32_t four;                                                                        \
                memcpy(&four, xq + (size_t)(m0 + m) * in4 + (size_t)iq * 4, 4);                      \
                __m512i xv = _mm512_set1_epi32(four);                                                \
                for (int k = 0; k < KB; k++) a[k][m] = _mm512_dpbusd_epi32(a[k][m], xv, w[k]);       \
            }                                                                                        \
        }                                                                                            \
        for (int k = 0; k < KB; k++) {                                                               \
            __m512i offset = _mm512_slli_epi32(colsum[k], 7);                                        \
            int32_t acc[MB][NB];                                                                     \
            int ok = o0 + k * NB, nk = out - ok < NB ? out - ok : NB;                                \
            for (int m = 0; m < MB; m++) _mm512_storeu_si512((void *)acc[m], _mm512_sub_epi32(a[k][m], offset)); \
            store_int_rows(acc, y, xs, wscale, b, m0, MB, ok, nk, out);                              \
        }                                                                                            \
    } while (0)
#define VNNI_BODY(MB) VNNI_MULTI_BODY(1, MB)

#define VNNI_CASE(MB) case MB: VNNI_BODY(MB); break;

#define VNNI_SWITCH(ROWS)                                                                            \
    switch (ROWS) {                                                                                  \
        VNNI_CASE(1) VNNI_CASE(2) VNNI_CASE(3) VNNI_CASE(4) VNNI_CASE(5) VNNI_CASE(6) VNNI_CASE(7)   \
        VNNI_CASE(8) VNNI_CASE(9) VNNI_CASE(10) VNNI_CASE(11) VNNI_CASE(12) VNNI_CASE(13)            \
        VNNI_CASE(14) VNNI_CASE(15) default: VNNI_BODY(16); break;                                   \
    }

__attribute__((target("avx512f,avx512bw,avx512vnni")))
INT8_BLOCK_ITEM(specula_i8_block_vnni, const __m512i ones = _mm512_set1_epi8(1), MRV, VNNI_SWITCH)

#define VNNI_MULTI_SWITCH(KB) SWITCH_ROWS_8(VNNI_MULTI_BODY, KB, M)

__attribute__((target("avx512f,avx512bw,avx512vnni")))
void specula_i8_multi_vnni(void *arg, int item) {
    const struct linear_job *j = arg;
    const __m512i ones = _mm512_set1_epi8(1);
    const float *b = j->b, *wscale = j->scale, *xs = j->xs;
    const int8_t *xq = j->xq;
    float *y = j->y;
    int M = j->M, out = j->out, quads = j->quads, in4 = j->in4, blocks = (out + NB - 1) / NB;
    int bk0 = item * j->panel, bk1 = bk0 + j->panel < blocks ? bk0 + j->panel : blocks, o0 = bk0 * NB, m0 = 0;
    const int8_t *wb = (const int8_t *)j->wp + (size_t)bk0 * quads * NB * 4;
    switch (bk1 - bk0) {
        case 4: VNNI_MULTI_SWITCH(4) break;
        case 3: VNNI_MULTI_SWITCH(3) break;
        case 2: VNNI_MULTI_SWITCH(2) break;
        default: VNNI_MULTI_SWITCH(1) break;
    }
}

/* c8 (linear_codes.c): the NB weights of step ii of the group at gp, layout.h's `c8_weight` in a zmm. */
__attribute__((target("avx512f,avx512bw")))
static inline __m512 c8_weights(__m512 a, const uint8_t *gp, int ii, __m512 b) {
    __m128i q = _mm_loadu_si128((const __m128i *)(gp + 2 * NB * sizeof(float) + (size_t)ii * NB));
    return _mm512_add_ps(_mm512_mul_ps(a, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))), b);
}

/* c8 (linear_codes.c) calls of up to C8_MULTI_ROWS rows: rows m0 .. m0 + MB over KB adjacent column
 * blocks, each weight rebuilt in registers from its code right before its FMAs, w = (A * q) + B as
 * two roundings (FLAGS' -ffp-contract=off), so each FMA chain over i = 0, 1, ... takes f32's very
 * weights: every output is f32's, bit for bit. A group's A and B are read once for its `group` steps. */
#define C8_MULTI_BODY(KB, MB, G)                                                                     \
    do {                                                                                             \
        __m512 a[KB][MB];                                                                            \
        for (int k = 0; k < KB; k++)                                                                 \
            for (int m = 0; m < MB; m++) a[k][m] = _mm512_setzero_ps();                              \
        for (int g = 0; g < groups; g++) {                                                           \
            const uint8_t *gp[KB];                                                                   \
            __m512 av[KB], bv[KB];                                                                   \
            for (int k = 0; k < KB; k++) {                                                           \
                gp[k] = wb + ((size_t)k * groups + g) * gbytes;                                      \
                for (size_t at = 0; at < gbytes; at += 64)                                           \
                    _mm_prefetch((const char *)gp[k] + at + PREFETCH_BYTES, _MM_HINT_T0);            \
                av[k] = _mm512_loadu_ps((const float *)gp[k]);                                       \
                bv[k] = _mm512_loadu_ps((const float *)gp[k] + NB);                                  \
            }                                                                                        \
            const float *xi0 = xg + (size_t)g * (G);                                                 \
            for (int ii = 0; ii < (G); ii++) {                                                       \
                __m512 w[KB];                                                                        \
                for (int k = 0; k < KB; k++) {                                                       \
                    w[k] = c8_weights(av[k], gp[k], ii, bv[k]);                                      \
                }                                                                                    \
                ZMM_ROWS_FMA(KB, MB, xi0 + ii)                                                       \
            }                                                                                        \
        }                                                                                            \
        ZMM_STORE_BLOCKS(KB, MB, NULL)                                                               \
    } while (0)

#define C8_CASE(KB, MB, G) case MB: C8_MULTI_BODY(KB, MB, G); break;
#define C8_SWITCH(KB, G)                                                                             \
    switch (M) {                                                                                     \
        C8_CASE(KB, 1, G) C8_CASE(KB, 2, G) C8_CASE(KB, 3, G) C8_CASE(KB, 4, G) C8_CASE(KB, 5, G)    \
        C8_CASE(KB, 6, G) C8_CASE(KB, 7, G) C8_CASE(KB, 8, G) C8_CASE(KB, 9, G) C8_CASE(KB, 10, G)   \
        C8_CASE(KB, 11, G) C8_CASE(KB, 12, G) C8_CASE(KB, 13, G) C8_CASE(KB, 14, G) C8_CASE(KB, 15, G) \
        C8_CASE(KB, 16, G) default: C8_MULTI_BODY(KB, 17, G); break;                                 \
    }
/* The item's blocks for group size G (a constant: its steps unroll): KB = 4 up to 3 rows, 2 up to 6
 * (`c8_multi_blocks`), else (and on AMD, `several_block_items`) one block at a time. */
#define C8_ITEM(G)                                                                                   \
    do {                                                                                             \
        if (bk1 - bk0 == 4 && M <= 3) {                                                              \
            switch (M) { C8_CASE(4, 1, G) C8_CASE(4, 2, G) default: C8_MULTI_BODY(4, 3, G); break; } \
            return;                                                                                  \
        }                                                                                            \
        if (bk1 - bk0 == 2 && M <= 6) {                                                              \
            switch (M) { C8_CASE(2, 1, G) C8_CASE(2, 2, G) C8_CASE(2, 3, G) C8_CASE(2, 4, G)         \
                         C8_CASE(2, 5, G) default: C8_MULTI_BODY(2, 6, G); break; }                  \
            return;                                                                                  \
        }                                                                                            \
        for (int bk = bk0; bk < bk1; bk++, o0 += NB, wb += (size_t)groups * gbytes) C8_SWITCH(1, G)  \
    } while (0)

__attribute__((target("avx512f,avx512bw")))
void specula_c8_multi_avx512(void *arg, int item) {
    const struct linear_job *j = arg;
    const float *b = j->b, *xg = j->xp;
    float *y = j->y;
    int M = j->M, in = j->in, out = j->out, group = j->group, groups = in / group, blocks = (out + NB - 1) / NB;
    int bk0 = item * j->panel, bk1 = bk0 + j->panel < blocks ? bk0 + j->panel : blocks, o0 = bk0 * NB, m0 = 0;
    size_t gbytes = C8_GROUP_BYTES(group);
    const uint8_t *wb = j->codes + (size_t)bk0 * groups * gbytes;
    if (group == 32) C8_ITEM(32);
    else C8_ITEM(16);
}

/* c8 calls of C8_MULTI_ROWS + 1 .. PANEL_ROWS - 1 rows (larger trees, a batch's packed rows), packed per
 * group of MRZ: each column block in chunks of KC inputs, a chunk's weights rebuilt once into `chunk`
 * (8 KB, in L1) and every row group run over it (ZMM_CHUNK_BODY, its sums kept in `cacc` between
 * chunks), so a weight is rebuilt once a call, not once a group. The same FMA chains over i = 0, 1, ...
 * on the same weights: f32's bits. */
#define C8_CHUNK_GROUPS ((PANEL_ROWS + MRZ - 1) / MRZ)
__attribute__((target("avx512f,avx512bw")))
void specula_c8_chunked_avx512(void *arg, int item) {
    FLOAT_ITEM_OPERANDS
    int group = j->group, ngroups = in / group;
    size_t gbytes = C8_GROUP_BYTES(group);
    float chunk[KC][NB] __attribute__((aligned(64)));
    float cacc[C8_CHUNK_GROUPS][MRZ][NB] __attribute__((aligned(64)));
    for (int bk = bk0; bk < bk1; bk++) {
        int o0 = bk * NB, nc = out - o0 < NB ? out - o0 : NB;
        const uint8_t *cb = j->codes + (size_t)bk * ngroups * gbytes;
        for (int c0 = 0; c0 < in; c0 += KC) {
            int c1 = in - c0 < KC ? in : c0 + KC;
            for (int g = c0 / group; g < c1 / group; g++) {
                const uint8_t *gp = cb + (size_t)g * gbytes;
                for (size_t at = 0; at < gbytes; at += 64)
                    _mm_prefetch((const char *)gp + at + PREFETCH_BYTES, _MM_HINT_T0);
                __m512 av = _mm512_loadu_ps((const float *)gp), bv = _mm512_loadu_ps((const float *)gp + NB);
                for (int ii = 0; ii < group; ii++) {
                    _mm512_store_ps(chunk[g * group + ii - c0], c8_weights(av, gp, ii, bv));
                }
            }
            /* ZMM_CHUNK_BODY reads step i at wb + i * NB: point wb so that step c0 is the chunk's first row */
            const float *wb = (const float *)((uintptr_t)chunk - (uintptr_t)c0 * NB * sizeof(float));
            for (int gr = 0; gr < j->groups; gr++) {
                int m0 = gr * MRZ;
                const float *xg = j->xp + (size_t)gr * in * MRZ;
                float(*acc)[NB] = cacc[gr];
                ZMM_ROWS_SWITCH(ZMM_CHUNK_BODY, ZMM_LOAD_F32, NULL)
            }
        }
    }
}
