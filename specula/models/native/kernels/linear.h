/* What linear.c shares with its AVX-512 variants (linear_avx512.c): one call's operands and the
 * item functions `specula_parallel` runs per column block. Not part of the packed layout
 * (layout.h), so prepared entries do not depend on it. */
#ifndef SPECULA_LINEAR_H
#define SPECULA_LINEAR_H

#include <stddef.h>
#include <stdint.h>

#include "pool.h"

#define MRZ 16  /* rows per group of the AVX-512 f32 / w8 items (linear_avx512.c) */

/* One call's operands, shared by the items (column blocks) `specula_parallel` hands out. */
struct linear_job {
    const float *xp;       /* f32 / w8: x packed per group of MR rows, or x itself [M][in] (AVX-512 blocks) */
    const int8_t *xq;      /* i8: x quantized per row, in4 wide (AVX-512: offset by 128, as uint8) */
    const float *xs;       /* i8: the rows' scales */
    const void *wp;
    const float *scale;    /* w8 / i8: per output column */
    const float *b;
    float *y;
    int M, in, out, groups, quads, in4;
    int panel;             /* f32 / w8: column blocks per item (`panel_blocks`) */
    const uint8_t *codes;  /* c8 (linear_codes.c): the packed codes, which its items read instead of wp */
    int group;             /* c8: inputs per code group */
    int failed;            /* c8: set when an item could not have its scratch */
    void (*inner)(void *job, int item);  /* c8: the f32 item run over the rebuilt blocks */
};

/* 0 when the AVX2 code runs; 1 when the AVX-512 variants run (the CPU has AVX-512 F/BW/VNNI and
 * `specula_set_isa` did not ask for AVX2); 2 when, besides, i8 calls of AMX_ROWS rows or more run
 * on AMX tiles (linear_amx.c). */
int specula_isa(void);

/* attention_avx512.c: a prompt's attention scores with the keys transposed a block of 16 at a time, each score
 * `ops.c`'s `dot` bit for bit; d a multiple of 8, at most SPECULA_SCORES_MAX_D. Returns the slot the blocks end at. */
#define SPECULA_SCORES_MAX_D 256
#define SPECULA_SCORES_MIN_QUERIES 64 /* fewer queries an item: `dot_block` (a block's transpose would not pay) */
int specula_scores_avx512(const float *const *qs, int nq, const float *k, int d, int slots, const int *limits,
                          float *const *ps);

/* linear_amx.c: whether this process may run AMX-INT8 (asked of the OS once), and i8 on AMX tiles
 * over a pair of column blocks and a chunk of AMX_CHUNK rows (item: chunk x pairs + pair); needs
 * j->xq without the VNNI offset, its rows padded with zeros to j->groups x 16, and in4 a multiple
 * of 64. */
int specula_amx_request(void);
void specula_i8_block_amx(void *job, int item);
#define AMX_ROWS 10   /* from this many rows on (fewer: 0.8-1.0x VNNI's speed, 10-12 rows 1.1-1.3x, 16 rows 1.4-1.8x) */
#define AMX_CHUNK 128 /* rows per item (linear_amx.c), a multiple of 32 */

/* Rows m0 .. m0 + mb of the finished sums acc[m][NB] (times the column scales, plus the bias) into y.
 * The accumulators are copied to `acc` after the loop over i (never passed by address: that made
 * the compiler store all of them to the stack on every step of i, 12 stores per 12 FMAs). */
static inline void store_rows(float acc[][NB], float *y, const float *scale, const float *b, int m0, int mb, int o0,
                              int nc, int out) {
    for (int m = 0; m < mb; m++) {
        float *ym = y + (size_t)(m0 + m) * out + o0;
        for (int c = 0; c < nc; c++) {
            float v = scale ? acc[m][c] * scale[o0 + c] : acc[m][c];
            ym[c] = b ? v + b[o0 + c] : v;
        }
    }
}

/* The same for the exact int32 sums of i8 (row scale x column scale, plus the bias): one place, so
 * the AVX2 and VNNI kernels round alike. */
static inline void store_int_rows(int32_t acc[][NB], float *y, const float *xs, const float *wscale, const float *b,
                                  int m0, int mb, int o0, int nc, int out) {
    for (int m = 0; m < mb; m++) {
        float *ym = y + (size_t)(m0 + m) * out + o0;
        for (int c = 0; c < nc; c++) {
            float v = (float)acc[m][c] * xs[m0 + m] * wscale[o0 + c];
            ym[c] = b ? v + b[o0 + c] : v;
        }
    }
}

/* Software prefetch of the weight stream, PREFETCH_BYTES ahead of the step reading `at` (a byte
 * offset into the item's block), once per 64-byte line. A step reads one cache line (f32, i8) or a
 * quarter of one (w8) and, with several rows, runs up to 12-16 FMAs on it: the core then holds too
 * few loads in flight for the hardware prefetcher alone to keep the memory bus busy. Measured on a
 * 2-core Xeon (`scripts/kernel_isa.py`, a SmolLM2-sized stack of [1536, 576] f32 weights, 2
 * threads, AVX-512 variant): 1 / 2 / 6 / 16 rows 25.2 / 29.3 / 36.8 / 42.7 ms without, 21.1 / 22.7 /
 * 24.4 / 28.6 ms with 8 KB ahead (1-16 KB: within noise of each other from 4 KB). Prefetching never
 * changes a result, nor faults past the end of the weights. */
#define PREFETCH_BYTES 8192
#define PREFETCH_W(base, at)                                                                         \
    do {                                                                                             \
        if (((at) & 63) == 0) _mm_prefetch((const char *)(base) + (at) + PREFETCH_BYTES, _MM_HINT_T0); \
    } while (0)

/* Column blocks per item of a float-activation call: 1 for the few rows of decoding and
 * verification (every block its own item, the most parallel), more for a prompt's many rows, so a
 * group of rows (GROUP x in floats) is read from L2 for PANEL blocks in turn instead of coming back
 * from L3 for each block (a 1.5B target's prefill re-read its activations once per 16 outputs).
 * The blocks' weights (PANEL x in x NB) stay in L2 across the groups. Each output is still the same
 * chain of FMAs over i = 0, 1, ..., so the bits do not depend on the panel. */
#define PANEL_ROWS 64   /* from this many rows on, items take PANEL blocks */
#define MULTI_ROWS 14   /* up to this many rows, the AVX-512 f32 items take several blocks (multi_blocks) */

/* `kb` column blocks per item, or fewer where the call's `out` columns would otherwise leave a thread
 * under four items (a model's narrow projections): the several-block items of f32, i8 and i4. */
static inline int fewer_for_threads(int kb, int out, int threads) {
    int blocks = (out + NB - 1) / NB, least = 4 * (threads > 1 ? threads : 1);
    while (kb > 1 && (blocks + kb - 1) / kb < least) kb--;
    return kb;
}

/* Whether the few-row items of the kinds with work beyond an FMA per weight (c8's rebuild, VNNI's i8 and
 * i4) take several column blocks (several weight streams in flight a core) or one. Several paid on
 * session 82's 2-core Xeon (i8, 2-8 rows: 3-12%); on the 2-core AMD EPYC (Zen 4) one block an item is
 * 1.1-1.7x faster for all three at 1-8 rows and equal beyond (session 136, `docs/native.md`, "One column
 * block an item on AMD"). Decided by the CPU's vendor (AMD: one) unless `specula_set_several_block_items`
 * says otherwise. The bits never depend on it: each output is the same sum whatever the blocks an item.
 * f32 and w8 keep `multi_blocks` (f32's few rows are bound by memory, where several streams pay on Zen 4
 * too). */
int several_block_items(void);

/* Column blocks per item of an AVX-512 call of up to MULTI_ROWS rows: as many as the registers
 * hold beside the rows' accumulators (4 up to 6 rows, 3 up to 9, 2 up to 14), fewer where the call
 * would otherwise leave a thread under four items (`fewer_for_threads`). */
static inline int multi_blocks(int M, int out, int threads) {
    return fewer_for_threads(M <= 6 ? 4 : M <= 9 ? 3 : 2, out, threads);
}
#define PANEL 4
static inline int panel_blocks(int M, int out, int threads) {
    int blocks = (out + NB - 1) / NB;
    if (M < PANEL_ROWS || blocks < PANEL * (threads > 1 ? threads : 1)) return 1;
    return PANEL;
}

/* What a float-activation item (`arg`, `item`) reads of its job: the operands, and its column blocks
 * bk0 .. bk1 (a panel of them, or one). */
#define FLOAT_ITEM_OPERANDS                                                                          \
    const struct linear_job *j = arg;                                                                \
    const float *b = j->b, *scale = j->scale;                                                        \
    float *y = j->y;                                                                                 \
    int M = j->M, in = j->in, out = j->out, blocks = (out + NB - 1) / NB;                            \
    int bk0 = item * j->panel, bk1 = bk0 + j->panel < blocks ? bk0 + j->panel : blocks;              \
    (void)scale;

/* The item function of one float-activation weight kind (f32, w8): every row group of the call over
 * column block `bk`. PLACE(gr) declares group gr's first row m0, its row count mb and its rows' x
 * (xg); SWITCH(LOAD, SCALE) runs them (reads m0, mb, xg, in, wb, y, b, o0, nc, out). The AVX2 items
 * (linear.c: groups of MR packed rows) and AVX-512's blocks for rows where they lie (linear_avx512.c:
 * even groups; its prompt panels run in chunks of inputs, `PANEL_ITEM`). */
#define FLOAT_BLOCK_ITEM(NAME, WTYPE, PLACE, SWITCH, LOAD, SCALE)                                    \
    void NAME(void *arg, int item) {                                                                 \
        FLOAT_ITEM_OPERANDS                                                                          \
        for (int gr = 0; gr < j->groups; gr++) {                                                     \
            PLACE(gr)                                                                                \
            for (int bk = bk0; bk < bk1; bk++) {                                                     \
                const WTYPE *wb = (const WTYPE *)j->wp + (size_t)bk * in * NB;                       \
                int o0 = bk * NB, nc = out - o0 < NB ? out - o0 : NB;                                \
                SWITCH(LOAD, SCALE)                                                                  \
            }                                                                                        \
        }                                                                                            \
    }

/* Group `gr` of M rows split into `groups` runs as even as can be: its first row m0 and its mb rows
 * (runs of GROUP and a remainder left a run of a few rows, whose few accumulator chains wait on the
 * latency of their multiply-adds instead of filling the units' throughput). */
static inline void even_group(int gr, int M, int groups, int *m0, int *mb) {
    int lo = (int)((long)gr * M / groups), hi = (int)((long)(gr + 1) * M / groups);
    *m0 = lo;
    *mb = hi - lo;
}

/* Up to this many rows an AVX-512 f32 / w8 call whose rows are read where they lie runs them as one
 * group (a 16-node tree and its root: its accumulators, the weight and the broadcast fit the 32
 * registers; a group of 18 spilled them); more rows run in even groups of at most MRZ. */
#define DIRECT_ONE_GROUP 17
static inline int direct_groups(int M) { return M <= DIRECT_ONE_GROUP ? 1 : (M + MRZ - 1) / MRZ; }

/* The same for i8 (int8 weights and activations): ONES declares the constant its body needs,
 * SWITCH(ROWS) runs the group's ROWS rows (reads m0, quads, in4, xq, xs, wb, wscale, ones, y, b, o0,
 * nc, out); the call's rows run in even groups of at most GROUP (`even_group`). */
#define INT8_BLOCK_ITEM(NAME, ONES, GROUP, SWITCH)                                                   \
    void NAME(void *arg, int bk) {                                                                   \
        const struct linear_job *j = arg;                                                            \
        ONES;                                                                                        \
        const float *b = j->b, *wscale = j->scale, *xs = j->xs;                                      \
        const int8_t *xq = j->xq;                                                                    \
        int M = j->M, out = j->out, quads = j->quads, in4 = j->in4, o0 = bk * NB;                    \
        int nc = out - o0 < NB ? out - o0 : NB;                                                      \
        const int8_t *wb = (const int8_t *)j->wp + (size_t)bk * quads * NB * 4;                      \
        float *y = j->y;                                                                             \
        int groups = (M + GROUP - 1) / GROUP;                                                        \
        for (int gr = 0; gr < groups; gr++) {                                                        \
            int m0, mb;                                                                              \
            even_group(gr, M, groups, &m0, &mb);                                                     \
            SWITCH(mb)                                                                               \
        }                                                                                            \
    }

/* linear_avx512.c: f32 / w8 over one column block (item) with the rows where they lie in x (calls of
 * fewer than PANEL_ROWS rows), or over a panel of blocks with the rows packed per group of MRZ (in
 * chunks of inputs). */
void specula_f32_block_avx512(void *job, int bk);
void specula_w8_block_avx512(void *job, int bk);
void specula_f32_panel_avx512(void *job, int item);
/* linear_avx512.c: f32 and w8 calls of up to MULTI_ROWS rows, `multi_blocks` column blocks per item. */
void specula_f32_multi_avx512(void *job, int item);
void specula_w8_multi_avx512(void *job, int item);
void specula_w8_panel_avx512(void *job, int item);
/* linear_avx512.c: c8 calls of up to C8_MULTI_ROWS rows (a 16-node tree and its root: 17 accumulators,
 * a group's a and b, the weight and the broadcast fit the 32 registers), each weight rebuilt in registers
 * before its FMAs, `c8_multi_blocks` column blocks per item. */
void specula_c8_multi_avx512(void *job, int item);
#define C8_MULTI_ROWS 17
/* linear_avx512.c: c8 calls of C8_MULTI_ROWS + 1 .. PANEL_ROWS - 1 rows, packed per group of MRZ: each
 * block's chunks of inputs rebuilt once, every row group run over them. */
void specula_c8_chunked_avx512(void *job, int item);
static inline int c8_multi_blocks(int M, int out, int threads) {
    return several_block_items() ? fewer_for_threads(M <= 3 ? 4 : M <= 6 ? 2 : 1, out, threads) : 1;
}

/* linear_codes.c: f32's item `j->inner` over this item's c8 blocks rebuilt into the thread's scratch (a
 * prompt's panels, on any CPU; linear.c has AVX2's few-row c8 items). */
void specula_c8_rebuilt_item(void *job, int item);

/* linear.c: row r of x [M][in] -> int8 xq[r][in4] (zero padded) and its scale xs[r] = max|x_r| / 127;
 * with `offset` (the VNNI i8 kernel) each q is stored as q + 128, an unsigned byte; with xsum
 * (i4: in4 a multiple of 64), 8 x the sum of each run of 64 q in xsum[r][in4 / 64]. i8 and i4
 * quantize their activations alike; rows run QUANTIZE_ITEM_ROWS an item on the pool. */
void specula_quantize_rows(const float *x, int8_t *xq, float *xs, int32_t *xsum, int M, int in, int in4, int offset,
                           int threads);
#define QUANTIZE_ITEM_ROWS 8

/* linear_avx512.c: i8 over one column block with VNNI (`vpdpbusd`), every row group of the call;
 * needs j->xq offset by 128 (specula_quantize_rows with `offset`). */
void specula_i8_block_vnni(void *job, int bk);
/* linear_avx512.c: i8 calls of up to VNNI_MULTI_ROWS rows with VNNI, j->panel column blocks
 * (`i8_multi_blocks`) per item, the rows all at once; needs j->xq offset by 128, as
 * specula_i8_block_vnni. */
void specula_i8_multi_vnni(void *job, int item);
#define VNNI_MULTI_ROWS 8

/* Column blocks per item of a VNNI call of up to VNNI_MULTI_ROWS rows: as many as the 32 registers
 * hold beside the rows' sums and each block's column sums (4 up to 4 rows, 3 up to 6, 2 up to 8),
 * fewer where a thread would get under four items; one where `several_block_items` says so. */
static inline int i8_multi_blocks(int M, int out, int threads) {
    return several_block_items() ? fewer_for_threads(M <= 4 ? 4 : M <= 6 ? 3 : 2, out, threads) : 1;
}

/* switch (ROWS) running BODY(KB, MB) with MB a constant 1 .. 7, or 8 for any other count (its
 * accumulators then live in registers): the few-row items of VNNI's i8 and of i4. */
#define SWITCH_ROWS_8(BODY, KB, ROWS)                                                                \
    switch (ROWS) {                                                                                  \
        case 1: BODY(KB, 1); break;                                                                  \
        case 2: BODY(KB, 2); break;                                                                  \
        case 3: BODY(KB, 3); break;                                                                  \
        case 4: BODY(KB, 4); break;                                                                  \
        case 5: BODY(KB, 5); break;                                                                  \
        case 6: BODY(KB, 6); break;                                                                  \
        case 7: BODY(KB, 7); break;                                                                  \
        default: BODY(KB, 8); break;                                                                 \
    }

/* One i4 call's operands (linear_i4.c; AMX: linear_amx.c). */
struct i4_job {
    const int8_t *xq;     /* [M][in64] the rows quantized (no offset), zero padded */
    const float *xs;      /* [M] the rows' scales */
    const int32_t *xsum;  /* [M][groups] 8 x each group's sum of xq (the nibbles' zero point) */
    const uint8_t *wp;    /* the packed nibbles */
    const float *gscale;  /* [blocks][groups][NB] */
    const float *b;
    float *y;
    int M, out, in64, groups, panel;
};

/* The finished sums f[m][NB] of rows m0 .. m0 + mb, column block at o0, into y. */
static inline void i4_store(float f[][NB], const struct i4_job *j, int m0, int mb, int o0) {
    int nc = j->out - o0 < NB ? j->out - o0 : NB;
    for (int m = 0; m < mb; m++) {
        float *ym = j->y + (size_t)(m0 + m) * j->out + o0;
        for (int c = 0; c < nc; c++) {
            float v = f[m][c] * j->xs[m0 + m];
            ym[c] = j->b ? v + j->b[o0 + c] : v;
        }
    }
}

/* linear_i4_vnni.c: i4 over j->panel adjacent column blocks (item), every row, with VNNI. */
void specula_i4_item_vnni(void *job, int item);
/* linear_amx.c: i4 on AMX tiles over a pair of column blocks and a chunk of AMX_CHUNK rows (item:
 * chunk x pairs + pair); needs j->xq padded with zero rows to a multiple of 16. */
void specula_i4_block_amx(void *job, int item);
#define I4_AMX_ROWS 16 /* from this many rows on (`scripts/kernel_isa.py --kinds i4`, a SmolLM2-sized stack:
                        * 12 rows 0.88x VNNI's speed, 16 rows 1.01x, 32 rows 1.13x, 128 rows 1.23x) */

#endif
