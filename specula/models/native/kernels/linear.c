/* specula's CPU linear kernels: y[M, out] = x[M, in] @ W^T (+ b) for the few rows (M = 1..64)
 * decoding and tree verification pass, in groups of up to MR = 6 rows.
 *
 * Weights are packed (by `kernels.packing.pack`, through pack.c) in column blocks of NB = 16 outputs,
 * wp[block][i][16], so each block is one contiguous stream (out is padded up to a multiple of 16
 * with zero columns); the rows of x are
 * packed per group of 6 as xp[group][i][6], so one cache line feeds every row of a step of i. A
 * thread owns whole blocks; a group runs over i in order with up to 6 x 2 AVX2 accumulators
 * (a call of 7-63 rows: its groups as even as can be, over each chunk of 128 inputs in turn,
 * `CHUNKED_ITEM`), so every output element is the same chain of fused multiply-adds over
 * i = 0, 1, ... whatever M is and whichever rows run beside it: the result of a row is bitwise
 * independent of the other rows in the call (batch invariant), which is what lossless tree
 * verification needs.
 *
 * f32: float weights.  w8: int8 weights with one float scale per output column (weight-only
 * quantization: activations stay float; y = scale * sum_i x_i * q_i, the same order again).
 * i8: int8 weights (per output column scale) and int8 activations (one scale per row, the row's
 * absolute maximum / 127): y = x_scale * w_scale * sum_i qx_i * qw_i, the sum exact in int32, so
 * every row is its own again; 4 input values per byte lane group (AVX2 maddubs), i.e. a quarter
 * of f32's weight bytes and about a third of w8's instructions.
 *
 * Threads: the column blocks of a call are the items of `specula_parallel` (pool.c), which a busy
 * machine cannot stall (f32 / w8 with many rows: panels of blocks, `panel_blocks` in linear.h);
 * packing (once, at load) uses OpenMP.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"
#include "linear.h"

#define MR 6

struct pack_rows_job {
    const float *x;
    float *xp;
    int M, in, mr, groups, even;
};

static void pack_rows_item(void *arg, int gr) {
    const struct pack_rows_job *j = arg;
    int in = j->in, mr = j->mr, m0 = gr * mr, mb = mr;
    if (j->even) even_group(gr, j->M, j->groups, &m0, &mb);
    else if (j->M - m0 < mb) mb = j->M - m0;
    float *xg = j->xp + (size_t)gr * in * mr;
    for (int i = 0; i < in; i++)
        for (int m = 0; m < mr; m++) xg[(size_t)i * mr + m] = m < mb ? j->x[(size_t)(m0 + m) * in + i] : 0.0f;
}

/* x [M, in] -> [groups][in][mr] (zero rows pad a group), a group an item on the pool (a prompt's
 * rows: serial, the copy was 2% of the 1.5B's prefill); with `even`, the M rows in
 * ceil(M / mr) groups as even as can be (`even_group`), else runs of mr rows. free() the result;
 * NULL when memory could not be had. */
static float *pack_rows(const float *x, int M, int in, int mr, int even, int threads) {
    int groups = (M + mr - 1) / mr;
    float *xp = malloc((size_t)groups * in * mr * sizeof(float));
    if (!xp) return NULL;
    struct pack_rows_job job = {x, xp, M, in, mr, groups, even};
    specula_parallel(threads, groups, pack_rows_item, &job);
    return xp;
}

/* One block of 16 columns for the MB rows of a group, over inputs C0 .. C1 - 1, its sums carried in
 * ACC (float [MR][NB], 32-byte aligned: read when C0 > 0, written after the loop, then stored to y
 * once C1 = in); MB is a compile-time constant at every use (the switches below), so the
 * accumulators stay in registers. LOAD(i) yields w0, w1; PREFETCH(i) is the step's prefetch of the
 * weight stream. With PAIRS the steps run two at a time and PREFETCH comes once a pair (the chunked
 * calls, whose groups each fetch a G-th of a chunk, G >= 2): half the loop's integer work, which at
 * 4-5 rows a group (8-10 FMAs a step) held the core near its 6 operations a cycle (a stack of
 * Qwen2.5-Coder-1.5B's shapes, 2 threads, an AVX2-only EPYC, pairs against single steps in turn in
 * one process: 16 / 20 / 24 rows 1.5-4% faster in two runs, 13 rows 4% faster in one and 2% slower
 * in the other, one L3-resident [1536, 1536] layer 2-7% faster; docs/native.md). Each accumulator
 * still takes its FMAs over i = 0, 1, ... in order, so the bits are unchanged. */
#define RUN_STEP(MB, LOAD, I)                                                                        \
    do {                                                                                             \
        __m256 w0, w1;                                                                               \
        LOAD(I);                                                                                     \
        const float *xi = xg + (size_t)(I) * MR;                                                     \
        for (int m = 0; m < MB; m++) {                                                               \
            __m256 xv = _mm256_broadcast_ss(xi + m);                                                 \
            a[m][0] = _mm256_fmadd_ps(w0, xv, a[m][0]);                                              \
            a[m][1] = _mm256_fmadd_ps(w1, xv, a[m][1]);                                              \
        }                                                                                            \
    } while (0)
#define RUN_BODY(MB, LOAD, SCALE, ACC, C0, C1, PREFETCH, PAIRS)                                      \
    do {                                                                                             \
        __m256 a[MR][2];                                                                             \
        float(*acc)[NB] = (ACC);                                                                     \
        int c0_ = (C0), c1_ = (C1), i = c0_;                                                         \
        for (int m = 0; m < MB; m++) {                                                               \
            a[m][0] = c0_ ? _mm256_load_ps(acc[m]) : _mm256_setzero_ps();                            \
            a[m][1] = c0_ ? _mm256_load_ps(acc[m] + 8) : _mm256_setzero_ps();                        \
        }                                                                                            \
        if (PAIRS)                                                                                   \
            for (; i + 1 < c1_; i += 2) {                                                            \
                PREFETCH(i);                                                                         \
                RUN_STEP(MB, LOAD, i);                                                               \
                RUN_STEP(MB, LOAD, i + 1);                                                           \
            }                                                                                        \
        for (; i < c1_; i++) {                                                                       \
            PREFETCH(i);                                                                             \
            RUN_STEP(MB, LOAD, i);                                                                   \
        }                                                                                            \
        for (int m = 0; m < MB; m++) {                                                               \
            _mm256_store_ps(acc[m], a[m][0]);                                                        \
            _mm256_store_ps(acc[m] + 8, a[m][1]);                                                    \
        }                                                                                            \
        if (c1_ == in) store_rows(acc, y, SCALE, b, m0, MB, o0, nc, out);                            \
    } while (0)

/* A whole block at once (calls of up to MR rows, and prompts), each step fetching the line
 * PREFETCH_BYTES ahead of it. */
#define BLOCK_PREFETCH(i) PREFETCH_W(wb, (size_t)(i) * NB * sizeof(*wb))
#define BLOCK_BODY(MB, LOAD, SCALE)                                                                  \
    do {                                                                                             \
        float block_acc[MR][NB] __attribute__((aligned(32)));                                        \
        RUN_BODY(MB, LOAD, SCALE, block_acc, 0, in, BLOCK_PREFETCH, 0);                              \
    } while (0)

/* BODY(MB, LOAD, SCALE) for the group's mb rows, MB a constant (also C8_REG_BODY(MB, G, KEEP)). */
#define SWITCH_ROWS(BODY, LOAD, SCALE)                                                               \
    switch (mb) {                                                                                    \
        case 1: BODY(1, LOAD, SCALE); break;                                                         \
        case 2: BODY(2, LOAD, SCALE); break;                                                         \
        case 3: BODY(3, LOAD, SCALE); break;                                                         \
        case 4: BODY(4, LOAD, SCALE); break;                                                         \
        case 5: BODY(5, LOAD, SCALE); break;                                                         \
        default: BODY(6, LOAD, SCALE); break;                                                        \
    }

#define LOAD_F32(i)                                                                                  \
    w0 = _mm256_loadu_ps(wb + (size_t)(i) * NB);                                                     \
    w1 = _mm256_loadu_ps(wb + (size_t)(i) * NB + 8)

#define LOAD_W8(i)                                                                                   \
    __m128i q = _mm_loadu_si128((const __m128i *)(wb + (size_t)(i) * NB));                           \
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));                                                \
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))


/* Calls of MR + 1 .. PANEL_ROWS - 1 rows (verification): each block in chunks of KC2 steps of i, every
 * row group over a chunk before the next chunk, the group's accumulators kept in `cacc` between
 * chunks. A chunk's weights (KC2 x NB floats, 8 KB) come from memory for the first group and stay in
 * L1 for the others, while the prefetch (`CHUNK_PREFETCH`: the chunk after next) keeps the memory
 * bus busy; one group after another over the whole block left it idle while the later groups re-read
 * the block from L2 (a stack of Qwen2.5-Coder-1.5B's shapes, 2 threads, an AVX2-only EPYC, the
 * time of a call over the time of a one-row call: 8 rows 1.27 -> 1.11, 12 rows 1.39 -> 1.15, 16
 * rows 1.62 -> 1.40; chunks of 64-128 inputs within noise, 192-256 slower; docs/native.md). Each
 * output is still the same chain of FMAs over i = 0, 1, ... (the accumulators are stored and
 * loaded exactly), so the bits are those of BLOCK_BODY. */
#define KC2 128
#define MAX_CHUNK_GROUPS ((PANEL_ROWS + MR - 2) / MR)

/* The chunks' prefetch: group gr of G, at step i of chunk c0, fetches step (gr KC2 + i - c0) / G of
 * the chunk after next (`per_group` = 65536 / G + 1 makes the division a multiply, exact for the
 * KC2 G < 65536 / G steps here), once a pair of steps (i even: 2 / G <= 1 line apart, so no line is
 * skipped), so the G groups' passes over a chunk request the chunk after next in order, a G-th of
 * it each, and the bus stays busy while the later groups work from L1. Each
 * step fetching the line one chunk ahead (before session 91) asked for all of the next chunk's 128
 * lines in the first group's pass, faster than memory serves them, and nothing new in the others'
 * (their fetches named the same lines), so the bus stood idle through them: the 1.5B's passes of
 * 8 / 12 / 13 / 16 tokens cost 1.07 / 1.20 / 1.39 / 1.42 one-token passes, and 0.99 / 1.10 / 1.33 /
 * 1.29 with this (pass by pass in turn through a scratch switch; a second run 1.02 / 1.03 / - / 1.49
 * against 0.92 / 0.99 / - / 1.32; docs/native.md). */
#define CHUNK_PREFETCH(i)                                                                            \
    _mm_prefetch((const char *)(wb + (size_t)(c0 + 2 * KC2 + (((gr * KC2 + (i) - c0) * per_group) >> 16)) * NB), \
                 _MM_HINT_T0)
#define CHUNK_BODY(MB, LOAD, SCALE) RUN_BODY(MB, LOAD, SCALE, cacc[gr], c0, c1, CHUNK_PREFETCH, 1)

#define CHUNKED_ITEM(NAME, WTYPE, LOAD, SCALE)                                                       \
    void NAME(void *arg, int item) {                                                                 \
        FLOAT_ITEM_OPERANDS                                                                          \
        float cacc[MAX_CHUNK_GROUPS][MR][NB] __attribute__((aligned(32)));                           \
        int per_group = 65536 / j->groups + 1;                                                       \
        for (int bk = bk0; bk < bk1; bk++) {                                                         \
            const WTYPE *wb = (const WTYPE *)j->wp + (size_t)bk * in * NB;                           \
            int o0 = bk * NB, nc = out - o0 < NB ? out - o0 : NB;                                    \
            for (int c0 = 0; c0 < in; c0 += KC2) {                                                   \
                int c1 = in - c0 < KC2 ? in : c0 + KC2;                                              \
                for (int gr = 0; gr < j->groups; gr++) {                                             \
                    int m0, mb;                                                                      \
                    even_group(gr, M, j->groups, &m0, &mb);                                          \
                    const float *xg = j->xp + (size_t)gr * in * MR;                                  \
                    SWITCH_ROWS(CHUNK_BODY, LOAD, SCALE)                                             \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }

static CHUNKED_ITEM(f32_chunked, float, LOAD_F32, NULL)
static CHUNKED_ITEM(w8_chunked, int8_t, LOAD_W8, scale)

/* Group gr of the rows packed per MR (`pack_rows`). */
#define PACKED_GROUP(gr)                                                                             \
    int m0 = (gr) * MR, mb = M - m0 < MR ? M - m0 : MR;                                              \
    const float *xg = j->xp + (size_t)(gr) * in * MR;

#define SWITCH_BLOCK(LOAD, SCALE) SWITCH_ROWS(BLOCK_BODY, LOAD, SCALE)
static FLOAT_BLOCK_ITEM(f32_block, float, PACKED_GROUP, SWITCH_BLOCK, LOAD_F32, NULL)
static FLOAT_BLOCK_ITEM(w8_block, int8_t, PACKED_GROUP, SWITCH_BLOCK, LOAD_W8, scale)

/* c8 (linear_codes.c) without AVX-512. A call of up to MR rows (a decoding step, a tree of up to 5 nodes):
 * each weight rebuilt in registers from its code right before its FMAs (w = (A * q) + B, two roundings:
 * FLAGS' -ffp-contract=off), so every accumulator takes f32's own chain of FMAs over i = 0, 1, ... on f32's
 * very weights (BLOCK_BODY's bits) while the call reads a quarter of f32's bytes. The steps of a group of G
 * inputs (a constant) share its A and B and run in pairs, one prefetch a pair: a step is about 26
 * instructions at four rows, near what the core issues, and the prefetch's address took three of them
 * (session 141, pairs against single steps, both builds' calls in turn in one process, medians of 15: the
 * SmolLM2-sized stack of 120 [1536, 576] linears 1-12 rows 0.99-1.16x, the 1.5B's shapes 1.02-1.24x at 1-8
 * rows; the same build against itself read 0.96-1.01x). The accumulators are copied into a fresh array `r`
 * for each group's loop and back after it: carried through both loops in one array, gcc stored every
 * accumulator to the stack on every step from three rows on (12 stores a step at six rows). */
#define C8_STEP_WEIGHTS(A, B, CODES)                                                                 \
    __m256 w0 = _mm256_add_ps(                                                                       \
        _mm256_mul_ps(_mm256_loadu_ps(A), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(                    \
                                              _mm_loadl_epi64((const __m128i *)(CODES))))),           \
        _mm256_loadu_ps(B));                                                                         \
    __m256 w1 = _mm256_add_ps(                                                                       \
        _mm256_mul_ps(_mm256_loadu_ps((A) + 8), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(              \
                                                    _mm_loadl_epi64((const __m128i *)((CODES) + 8))))), \
        _mm256_loadu_ps((B) + 8))
/* Step ii of a code group for MB rows: its 16 weights rebuilt from the group's codes (A, codes), KEEP(G, ii)
 * (NO_KEEP, or KEEP_CHUNK: kept for the later row groups, c8_chunked_avx2), then each row's two FMAs into r. */
#define C8_GROUP_STEP(MB, G, II, KEEP)                                                               \
    do {                                                                                             \
        C8_STEP_WEIGHTS(A, A + NB, codes + (size_t)(II) * NB);                                       \
        KEEP(G, II);                                                                                 \
        for (int m = 0; m < MB; m++) {                                                               \
            __m256 xv = _mm256_broadcast_ss(xi0 + (size_t)(II) * MR + m);                            \
            r[m][0] = _mm256_fmadd_ps(w0, xv, r[m][0]);                                              \
            r[m][1] = _mm256_fmadd_ps(w1, xv, r[m][1]);                                              \
        }                                                                                            \
    } while (0)
/* A code group's G steps (G even), two at a time with one prefetch a pair of the line PREFETCH_BYTES
 * ahead in the codes' stream (G steps span C8_GROUP_BYTES(G) bytes: 40-48 a pair, so no line is skipped). */
#define C8_GROUP_STEPS(MB, G, KEEP)                                                                  \
    for (int ii = 0; ii < (G); ii += 2) {                                                            \
        _mm_prefetch((const char *)gp + (size_t)ii * C8_GROUP_BYTES(G) / (G) + PREFETCH_BYTES, _MM_HINT_T0); \
        C8_GROUP_STEP(MB, G, ii, KEEP);                                                              \
        C8_GROUP_STEP(MB, G, ii + 1, KEEP);                                                          \
    }
#define NO_KEEP(G, II)
#define KEEP_CHUNK(G, II)                                                                            \
    _mm256_store_ps(chunk[g * (G) - c0 + (II)], w0);                                                 \
    _mm256_store_ps(chunk[g * (G) - c0 + (II)] + 8, w1)
/* MB rows (a constant) in registers over the code groups of inputs c0 .. c1 - 1 of the column block whose
 * codes start at cb: the sums start from cacc[0] (c0 > 0) or zero and end in cacc[0], stored to y once c1 = in;
 * KEEP(G, ii) keeps each rebuilt weight for later row groups (KEEP_CHUNK) or not (NO_KEEP). */
#define C8_REG_BODY(MB, G, KEEP)                                                                     \
    do {                                                                                             \
        __m256 a[MR][2];                                                                             \
        for (int m = 0; m < MB; m++) {                                                               \
            a[m][0] = c0 ? _mm256_load_ps(cacc[0][m]) : _mm256_setzero_ps();                         \
            a[m][1] = c0 ? _mm256_load_ps(cacc[0][m] + 8) : _mm256_setzero_ps();                     \
        }                                                                                            \
        for (int g = c0 / (G); g < c1 / (G); g++) {                                                  \
            const uint8_t *gp = cb + (size_t)g * gbytes, *codes = gp + 2 * NB * sizeof(float);       \
            const float *A = (const float *)gp, *xi0 = xg + (size_t)g * (G) * MR;                    \
            __m256 r[MR][2];                                                                         \
            for (int m = 0; m < MB; m++) r[m][0] = a[m][0], r[m][1] = a[m][1];                       \
            C8_GROUP_STEPS(MB, G, KEEP);                                                             \
            for (int m = 0; m < MB; m++) a[m][0] = r[m][0], a[m][1] = r[m][1];                       \
        }                                                                                            \
        for (int m = 0; m < MB; m++) {                                                               \
            _mm256_store_ps(cacc[0][m], a[m][0]);                                                    \
            _mm256_store_ps(cacc[0][m] + 8, a[m][1]);                                                \
        }                                                                                            \
        if (c1 == in) store_rows(cacc[0], y, NULL, b, m0, MB, o0, nc, out);                          \
    } while (0)

/* c8 calls of up to MR rows without AVX-512 (x packed as one group of MR, `pack_rows`): one column block an
 * item. */
static void c8_rows_avx2(void *arg, int bk) {
    const struct linear_job *j = arg;
    const float *b = j->b, *xg = j->xp;
    float *y = j->y;
    int mb = j->M, in = j->in, out = j->out, group = j->group, m0 = 0, c0 = 0, c1 = in;
    int o0 = bk * NB, nc = out - o0 < NB ? out - o0 : NB;
    size_t gbytes = C8_GROUP_BYTES(group);
    const uint8_t *cb = j->codes + (size_t)bk * (in / group) * gbytes;
    float cacc[1][MR][NB] __attribute__((aligned(32)));
    if (group == 32) {
        SWITCH_ROWS(C8_REG_BODY, 32, NO_KEEP)
    } else {
        SWITCH_ROWS(C8_REG_BODY, 16, NO_KEEP)
    }
}

/* c8 calls of MR + 1 .. PANEL_ROWS - 1 rows without AVX-512 (x packed in even groups, as f32_chunked):
 * each column block in chunks of KC2 inputs. The first row group runs over a chunk as c8_rows_avx2 runs
 * (`C8_REG_BODY`: each weight rebuilt in registers from its code right before its FMAs, the codes'
 * stream fetched PREFETCH_BYTES ahead) and keeps every rebuilt weight in `chunk` (8 KB, in L1); the other
 * groups run over `chunk` as f32_chunked runs over its weights. So a weight is rebuilt once a call, not
 * once a group, and the rebuild's conversions, adds and stores run beside the first group's FMAs: a chunk
 * rebuilt on its own before the groups ran (session 140) left the FMA units idle meanwhile, a quarter of
 * an 8-row call's time under `perf` (session 141, an AVX2-only EPYC, 2 threads, the two in turn, medians
 * of 15: 120 SmolLM2-sized [1536, 576] linears, 7 / 8 / 12 / 16 / 24 / 32 rows 1.15 / 1.11 / 1.07 / 1.06 /
 * 1.03 / 1.04x faster; the 1.5B's shapes 1.12 / 1.06 / 1.06 / 1.03x at 7 / 8 / 12 / 16; docs/native.md).
 * The same FMA chains over i = 0, 1, ... on the same weights: f32's bits. */
#define NO_PREFETCH(i)
#define C8_CHUNK_BODY(MB, LOAD, SCALE) RUN_BODY(MB, LOAD, SCALE, cacc[gr], c0, c1, NO_PREFETCH, 1)
static void c8_chunked_avx2(void *arg, int item) {
    FLOAT_ITEM_OPERANDS
    int group = j->group, ngroups = in / group;
    size_t gbytes = C8_GROUP_BYTES(group);
    float chunk[KC2][NB] __attribute__((aligned(32)));
    float cacc[MAX_CHUNK_GROUPS][MR][NB] __attribute__((aligned(32)));
    for (int bk = bk0; bk < bk1; bk++) {
        int o0 = bk * NB, nc = out - o0 < NB ? out - o0 : NB;
        const uint8_t *cb = j->codes + (size_t)bk * ngroups * gbytes;
        for (int c0 = 0; c0 < in; c0 += KC2) {
            int c1 = in - c0 < KC2 ? in : c0 + KC2;
            /* LOAD_F32 reads step i at wb + i * NB: point wb so that step c0 is the chunk's first row */
            const float *wb = (const float *)((uintptr_t)chunk - (uintptr_t)c0 * NB * sizeof(float));
            for (int gr = 0; gr < j->groups; gr++) {
                int m0, mb;
                even_group(gr, M, j->groups, &m0, &mb);
                const float *xg = j->xp + (size_t)gr * in * MR;
                if (gr == 0 && group == 32) {
                    SWITCH_ROWS(C8_REG_BODY, 32, KEEP_CHUNK)
                } else if (gr == 0) {
                    SWITCH_ROWS(C8_REG_BODY, 16, KEEP_CHUNK)
                } else {
                    SWITCH_ROWS(C8_CHUNK_BODY, LOAD_F32, NULL)
                }
            }
        }
    }
}

/* One f32 or w8 call. Where AVX-512 runs: an f32 or w8 call of up to MULTI_ROWS rows (a decoding step,
 * a tree of up to 13 nodes) takes items of several column blocks (`multi_blocks`, `MULTI_ITEM` in
 * linear_avx512.c; SmolLM2 passes after 256 tokens, the two in turn in one process, 1 / 9 / 12 / 14
 * tokens 23.4 / 34.9 / 37.0 / 38.9 ms -> 21.2 / 26.3 / 32.5 / 32.0, Qwen2.5-Coder-1.5B 203 / 226 / 289
 * / 307 -> 194 / 216 / 238 / 258; w8, the 1.5B's output screen [151936, 1536], 1 / 6 rows 7.4 / 11.2
 * ms -> 6.2 / 7.4, where it ran AVX2's one-block items); more rows run groups of MRZ rows, one zmm of
 * 16 columns per row; without AVX-512, the AVX2 items. AVX-512 reads the rows of a decoding or
 * verification call where they lie in x: packing them cost more than it saved (150 calls over
 * SmolLM2-sized [1536, 576] f32 weights, 2 threads, medians of two runs: 8 / 24 rows 27.1, 25.4 /
 * 39.8, 38.7 ms packed -> 25.2, 23.5 / 37.0, 35.3 read where they lie; 16 rows within noise); a
 * prompt's rows (PANEL_ROWS or more, panels of blocks) are packed per group, which its 16-row groups
 * read faster (256 rows: 294 ms packed, 320 where they lie; 269 packed and run in chunks of inputs,
 * `PANEL_ITEM`). Which rows are read how never changes a sum: every output is the same FMA chain over
 * i either way. y must not overlap x (no caller passes one over the other). Returns 0, or -1 when
 * memory for the packed rows could not be had (y then untouched). */
static int linear_float(const float *x, const void *wp, const float *scale, const float *b, float *y, int M, int in,
                         int out, int threads, specula_item_fn avx2_fn, specula_item_fn avx2_chunk_fn,
                         specula_item_fn avx512_block_fn, specula_item_fn avx512_panel_fn,
                         specula_item_fn avx512_multi_fn, const uint8_t *codes, int group) {
    if (avx512_multi_fn && M <= (codes ? C8_MULTI_ROWS : MULTI_ROWS) && specula_isa()) {  /* decoding, small trees */
        int kb = codes ? c8_multi_blocks(M, out, threads) : multi_blocks(M, out, threads);
        int blocks = (out + NB - 1) / NB;
        struct linear_job job = {.xp = x, .wp = wp, .scale = scale, .b = b, .y = y, .M = M, .in = in, .out = out,
                                 .groups = 1, .panel = kb, .codes = codes, .group = group};
        specula_parallel(threads, (blocks + kb - 1) / kb, codes ? specula_c8_multi_avx512 : avx512_multi_fn, &job);
        return 0;
    }
    int wide = M > MR && specula_isa(), mr = wide ? MRZ : MR;
    int c8_chunked = codes && wide && M < PANEL_ROWS;  /* c8's few-group calls: `specula_c8_chunked_avx512` */
    int direct = wide && M < PANEL_ROWS && !c8_chunked, chunked = !wide && M > MR && M < PANEL_ROWS;  /* even groups */
    float *packed = direct ? NULL : pack_rows(x, M, in, mr, chunked, threads);
    if (!direct && !packed) return -1;
    int panel = panel_blocks(M, out, threads), blocks = (out + NB - 1) / NB;
    struct linear_job job = {.xp = direct ? x : packed, .wp = wp, .scale = scale, .b = b, .y = y, .M = M, .in = in,
                             .out = out, .groups = direct ? direct_groups(M) : (M + mr - 1) / mr, .panel = panel,
                             .codes = codes, .group = group};
    specula_item_fn fn = chunked ? avx2_chunk_fn : !wide ? avx2_fn : direct ? avx512_block_fn : avx512_panel_fn;
    if (c8_chunked) {
        fn = specula_c8_chunked_avx512;
    } else if (codes && !wide && M < PANEL_ROWS) {  /* c8 without AVX-512: rebuilt in registers or per chunk */
        fn = chunked ? c8_chunked_avx2 : c8_rows_avx2;
    } else if (codes) {  /* c8: each item rebuilds its blocks, then runs fn over them */
        job.inner = fn;
        fn = specula_c8_rebuilt_item;
    }
    specula_parallel(threads, (blocks + panel - 1) / panel, fn, &job);
    free(packed);
    return job.failed ? -1 : 0;
}

/* The four kinds' calls: y [M, out] = x [M, in] through the packed weights (+ b); each returns 0, or
 * -1 when memory for its packed or quantized rows could not be had (y then untouched). */
int specula_linear_f32(const float *x, const float *wp, const float *b, float *y, int M, int in, int out,
                       int threads) {
    if (M <= 0 || out <= 0) return 0;  /* no rows: nothing to do (the row switches' default ran 16) */
    return linear_float(x, wp, NULL, b, y, M, in, out, threads, f32_block, f32_chunked, specula_f32_block_avx512,
                 specula_f32_panel_avx512, specula_f32_multi_avx512, NULL, 0);
}

/* c8 (linear_codes.c): f32's call, each weight rebuilt from its code (`group` inputs per a, b pair). */
int specula_linear_c8(const float *x, const uint8_t *wp, const float *b, float *y, int M, int in, int out, int group,
                      int threads) {
    if (M <= 0 || out <= 0) return 0;
    return linear_float(x, NULL, NULL, b, y, M, in, out, threads, f32_block, f32_chunked, specula_f32_block_avx512,
                        specula_f32_panel_avx512, specula_f32_multi_avx512, wp, group);
}

int specula_linear_w8(const float *x, const int8_t *wp, const float *scale, const float *b, float *y, int M, int in,
                      int out, int threads) {
    if (M <= 0 || out <= 0) return 0;
    return linear_float(x, wp, scale, b, y, M, in, out, threads, w8_block, w8_chunked, specula_w8_block_avx512,
                 specula_w8_panel_avx512, specula_w8_multi_avx512, NULL, 0);
}


/* ---------------------------------------------------------------------------------------------- i8 */
/* Weights packed as wp[block][i / 4][16 columns][4] (`kernels.packing.pack`): one 32-byte load holds
 * 8 columns x 4 inputs; `in` is padded up to a multiple of 4 with zeros (in4). */
/* Row r of x -> int8 xq[r][in4] (zero padded) and its scale xs[r] = max|x_r| / 127; with `offset`
 * (the VNNI kernel) each q is stored as q + 128, an unsigned byte (its sign bit flipped); with
 * xsum, 8 x each run of 64 q (i4's zero point, `I4_GROUP`) in xsum[r][in4 / 64].
 *
 * q = lrintf(x * (1 / scale)): `_mm256_cvtps_epi32` rounds as lrintf does (to nearest, ties to
 * even, MXCSR's default mode), and |x / scale| <= 127 plus a rounding, so the saturating packs
 * never clip: the bits of the scalar loop this replaced (which, with libm's lrintf and one
 * thread, took half of an int8 prompt's linears: the 0.5B's 800-token prompt spent about 0.4 s
 * quantizing rows). max(|x|, m) keeps m where x is NaN, as fmaxf does. */
static void quantize_row(const float *xr, int8_t *q, float *xs, int32_t *xsum, int in, int in4, uint8_t flip) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m8 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= in; i += 8) m8 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xr + i), abs_mask), m8);
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, m8);
    for (int l = 0; l < 8; l++) amax = fmaxf(amax, lanes[l]);
    for (; i < in; i++) amax = fmaxf(amax, fabsf(xr[i]));
    float scale = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / scale;
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), vflip = _mm256_set1_epi8((char)flip);
    for (i = 0; i + 32 <= in; i += 32) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + i + 8), vinv));
        __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + i + 16), vinv));
        __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + i + 24), vinv));
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
        bytes = _mm256_permutevar8x32_epi32(bytes, order);  /* the packs interleave 128-bit lanes */
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_xor_si256(bytes, vflip));
    }
    for (; i < in; i++) q[i] = (int8_t)((uint8_t)(int8_t)lrintf(xr[i] * inv) ^ flip);
    for (; i < in4; i++) q[i] = (int8_t)flip;
    *xs = scale;
    if (xsum) /* unsigned sums of q ^ 0x80 (sad against zero), less 128 a byte */
        for (int g = 0; g < in4 / 64; g++) {
            const __m256i sign = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
            __m256i lo = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + g * 64)), sign);
            __m256i hi = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + g * 64 + 32)), sign);
            __m256i s4 = _mm256_add_epi64(_mm256_sad_epu8(lo, zero), _mm256_sad_epu8(hi, zero));
            int64_t parts[4];
            _mm256_storeu_si256((__m256i *)parts, s4);
            xsum[g] = 8 * (int32_t)(parts[0] + parts[1] + parts[2] + parts[3] - 64 * 128);
        }
}

struct quantize_args {
    const float *x;
    int8_t *xq;
    float *xs;
    int32_t *xsum;
    int in, in4;
    uint8_t flip;
};

static void quantize_range(const void *args, int r0, int r1) {
    const struct quantize_args *a = args;
    for (int r = r0; r < r1; r++)
        quantize_row(a->x + (size_t)r * a->in, a->xq + (size_t)r * a->in4, a->xs + r,
                     a->xsum ? a->xsum + (size_t)r * (a->in4 / 64) : NULL, a->in, a->in4, a->flip);
}

void specula_quantize_rows(const float *x, int8_t *xq, float *xs, int32_t *xsum, int M, int in, int in4, int offset,
                           int threads) {
    struct quantize_args a = {.x = x, .xq = xq, .xs = xs, .xsum = xsum, .in = in, .in4 = in4,
                              .flip = offset ? 0x80u : 0u};
    specula_parallel_rows(threads, M, QUANTIZE_ITEM_ROWS, quantize_range, &a);
}

#define I8_BODY(MB)                                                                                  \
    do {                                                                                             \
        __m256i a[MR][2];                                                                            \
        for (int m = 0; m < MB; m++) a[m][0] = a[m][1] = _mm256_setzero_si256();                     \
        for (int iq = 0; iq < quads; iq++) {                                                         \
            PREFETCH_W(wb, (size_t)iq * NB * 4);                                                     \
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + (size_t)iq * NB * 4));            \
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + (size_t)iq * NB * 4 + 32));       \
            for (int m = 0; m < MB; m++) {                                                           \
                int32_t four;                                                                        \
                memcpy(&four, xq + (size_t)(m0 + m) * in4 + (size_t)iq * 4, 4);                      \
                __m256i xv = _mm256_set1_epi32(four), ax = _mm256_sign_epi8(xv, xv);                 \
                __m256i p0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xv));                     \
                __m256i p1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xv));                     \
                a[m][0] = _mm256_add_epi32(a[m][0], _mm256_madd_epi16(p0, ones));                    \
                a[m][1] = _mm256_add_epi32(a[m][1], _mm256_madd_epi16(p1, ones));                    \
            }                                                                                        \
        }                                                                                            \
        int32_t acc[MR][NB];                                                                         \
        for (int m = 0; m < MB; m++) {                                                               \
            _mm256_storeu_si256((__m256i *)acc[m], a[m][0]);                                         \
            _mm256_storeu_si256((__m256i *)(acc[m] + 8), a[m][1]);                                   \
        }                                                                                            \
        store_int_rows(acc, y, xs, wscale, b, m0, MB, o0, nc, out);                                  \
    } while (0)

#define I8_SWITCH(ROWS)                                                                              \
    switch (ROWS) {                                                                                  \
        case 1: I8_BODY(1); break;                                                                   \
        case 2: I8_BODY(2); break;                                                                   \
        case 3: I8_BODY(3); break;                                                                   \
        case 4: I8_BODY(4); break;                                                                   \
        case 5: I8_BODY(5); break;                                                                   \
        default: I8_BODY(6); break;                                                                  \
    }

static INT8_BLOCK_ITEM(i8_block, const __m256i ones = _mm256_set1_epi16(1), MR, I8_SWITCH)

static int several = -1;  /* `several_block_items`: -1 by the CPU's vendor, else 0 or 1 (A/B runs and tests) */
int several_block_items(void) {
    if (several < 0) {
        __builtin_cpu_init();
        several = !__builtin_cpu_is("amd");
    }
    return several;
}
int specula_set_several_block_items(int on) {
    several = on < 0 ? -1 : on > 0;
    return several_block_items();
}

int specula_linear_i8(const float *x, const int8_t *wp, const float *wscale, const float *b, float *y, int M, int in,
                      int out, int threads) {
    if (M <= 0 || out <= 0) return 0;
    int quads = (in + 3) / 4, in4 = quads * 4, level = specula_isa(), blocks = (out + NB - 1) / NB;
    int amx = level == 2 && M >= AMX_ROWS && in4 % 64 == 0;
    int rows = amx ? (M + 15) / 16 * 16 : M;  /* AMX: whole tiles of 16 rows, the padding zeros */
    int8_t *xq = malloc((size_t)rows * in4);
    float *xs = malloc((size_t)M * sizeof(float));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -1;
    }
    specula_quantize_rows(x, xq, xs, NULL, M, in, in4, level && !amx, threads);  /* VNNI's offset */
    if (rows > M) memset(xq + (size_t)M * in4, 0, (size_t)(rows - M) * in4);
    struct linear_job job = {.xq = xq, .xs = xs, .wp = wp, .scale = wscale, .b = b, .y = y, .M = M, .in = in,
                             .out = out, .quads = quads, .in4 = in4, .groups = rows / 16};
    if (amx) {
        specula_parallel(threads, (rows + AMX_CHUNK - 1) / AMX_CHUNK * ((blocks + 1) / 2), specula_i8_block_amx, &job);
    } else if (level && M <= VNNI_MULTI_ROWS) {
        job.panel = i8_multi_blocks(M, out, threads);
        specula_parallel(threads, (blocks + job.panel - 1) / job.panel, specula_i8_multi_vnni, &job);
    } else
        specula_parallel(threads, blocks, level ? specula_i8_block_vnni : i8_block, &job);
    free(xq);
    free(xs);
    return 0;
}
