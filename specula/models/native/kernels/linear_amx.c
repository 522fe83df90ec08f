/* i8 (int8 weights and activations) on AMX tiles, chosen at run time where the CPU has AMX-TILE and
 * AMX-INT8 and Linux lets the process use them (`specula_amx_request`), for calls of AMX_ROWS rows
 * or more whose inputs are a multiple of 64 (every projection of the embedded models).
 *
 * `tdpbssd` adds, for each output row m and column n of a 16 x 16 int32 tile, the 64 products
 * A[m][k] x B[k / 4][n][k % 4] of one 64-input step, exactly: the same int32 sum of q_x x q_w the
 * AVX2 and VNNI kernels compute, then the same float scaling (`store_int_rows`), so every output is
 * bit for bit theirs, whatever the row count and whichever kernel ran the other rows of the call.
 *
 * The i8 layout (layout.h: wp[block][in4 / 4][16 columns][4]) is AMX's B operand as it lies: 16
 * quads of one block are 16 tile rows of 64 bytes, one after another, so a weight tile is one
 * contiguous kilobyte and needs no repacking. The activations are quantized without linear.c's
 * VNNI offset (tdpbssd multiplies signed by signed) into rows padded to a multiple of 16 with zeros.
 *
 * Tiles: C[r][c] (tmm0-3) for two groups of 16 rows by two column blocks, A (tmm4, tmm5) for the
 * row groups, B (tmm6, tmm7) for the blocks; each step of 64 inputs loads two A and two B tiles
 * for four products. An item is a pair of column blocks (the last may be one) over a chunk of
 * AMX_CHUNK rows, the items of a chunk in a row (the pool hands a thread neighbouring items), so
 * the chunk's activations stay in the core's L2 while the weights stream past (the 0.5B's
 * prefill of 800 tokens, 2 threads, two runs each: its linears 0.86-0.89 s with every row in one
 * item, 0.78-0.82 s in chunks of 128; 1.51-1.54 s on VNNI). A thread configures the tiles at the
 * start of each item and releases them at its end (the pool's threads run other kernels between
 * items). */
#define _GNU_SOURCE
#include <cpuid.h>
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "layout.h"
#include "linear.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 when the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24, 25) and the kernel granted
 * this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+), else 0. */
int specula_amx_request(void) {
    static int granted = -1;
    if (granted >= 0) return granted;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return granted = 0;
    granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

__attribute__((target("amx-tile")))
static void configure_tiles(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* The finished tile `T` (int32 [16][16]) of rows m0 .. m0 + 16 (those below M) and block bk into y. */
#define STORE_TILE(T, m0, bk)                                                                        \
    do {                                                                                             \
        if ((m0) < M) {                                                                              \
            int32_t acc[16][NB] __attribute__((aligned(64)));                                        \
            int o0_ = (bk) * NB, nc_ = out - o0_ < NB ? out - o0_ : NB;                              \
            _tile_stored(T, acc, NB * 4);                                                            \
            store_int_rows(acc, y, xs, wscale, b, (m0), M - (m0) < 16 ? M - (m0) : 16, o0_, nc_, out); \
        }                                                                                            \
    } while (0)

__attribute__((target("amx-tile,amx-int8,avx512f")))
void specula_i8_block_amx(void *arg, int item) {
    const struct linear_job *j = arg;
    const float *b = j->b, *wscale = j->scale, *xs = j->xs;
    const int8_t *xq = j->xq;
    int M = j->M, out = j->out, quads = j->quads, in4 = j->in4, blocks = (out + NB - 1) / NB;
    int pairs = (blocks + 1) / 2, bk = item % pairs * 2, pair = bk + 1 < blocks;
    int r0 = item / pairs * AMX_CHUNK, r1 = r0 + AMX_CHUNK < j->groups * 16 ? r0 + AMX_CHUNK : j->groups * 16;
    size_t block_bytes = (size_t)quads * NB * 4;
    const int8_t *w0 = (const int8_t *)j->wp + (size_t)bk * block_bytes, *w1 = w0 + block_bytes;
    float *y = j->y;
    configure_tiles();
    for (int m0 = r0; m0 < r1; m0 += 32) {
        int two = m0 + 16 < r1;
        const int8_t *x0 = xq + (size_t)m0 * in4, *x1 = x0 + (size_t)16 * in4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int k = 0; k < in4; k += 64) {  /* 64 inputs: 16 quads of the layout */
            _tile_loadd(4, x0 + k, in4);
            _tile_loadd(6, w0 + (size_t)k * NB, NB * 4);
            _tile_dpbssd(0, 4, 6);
            if (pair) {
                _tile_loadd(7, w1 + (size_t)k * NB, NB * 4);
                _tile_dpbssd(1, 4, 7);
            }
            if (two) {
                _tile_loadd(5, x1 + k, in4);
                _tile_dpbssd(2, 5, 6);
                if (pair) _tile_dpbssd(3, 5, 7);
            }
        }
        STORE_TILE(0, m0, bk);
        if (pair) STORE_TILE(1, m0, bk + 1);
        if (two) {
            STORE_TILE(2, m0 + 16, bk);
            if (pair) STORE_TILE(3, m0 + 16, bk + 1);
        }
    }
    _tile_release();
}

/* Tile T's exact sums (rows m0 .. m0 + 16 of block k of the item) into the float sums f. */
#define I4_AMX_ADD(T, m0, k, sc)                                                                     \
    do {                                                                                             \
        _tile_stored(T, c, NB * 4);                                                                  \
        for (int m = 0; m < 16; m++) {                                                               \
            float *fm = f[(m0) - r0 + m][k];                                                         \
            __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)c[m]));                    \
            _mm512_store_ps(fm, _mm512_fmadd_ps(v, sc, _mm512_load_ps(fm)));                         \
        }                                                                                            \
    } while (0)

/* i4 (linear_i4.c) on AMX tiles, for calls of I4_AMX_ROWS rows or more: a group's 64 inputs are one
 * `tdpbssd` step, so each group's int32 sums come out of the tiles exact, then f = fma(float(sum),
 * gscale, f) group after group, and y = f x_scale (+ bias) (`i4_store`): the operations of the
 * VNNI and AVX2 items in their order, so every output is bit for bit theirs. A group's nibbles for
 * one block (512 bytes) are unpacked once per item into an i8 weight tile (the low nibbles of step
 * s are quad 2s, the high ones quad 2s + 1, each minus 8: signed, so no zero point), which serves
 * every row tile of the chunk. Float sums f[chunk rows][2 blocks][16] live on the stack (16 KB). */
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw")))
void specula_i4_block_amx(void *arg, int item) {
    const struct i4_job *j = arg;
    int M = j->M, groups = j->groups, in64 = j->in64, blocks = (j->out + NB - 1) / NB, padded = (M + 15) / 16 * 16;
    int pairs = (blocks + 1) / 2, bk = item % pairs * 2, nb = bk + 1 < blocks ? 2 : 1;
    int r0 = item / pairs * AMX_CHUNK, r1 = r0 + AMX_CHUNK < padded ? r0 + AMX_CHUNK : padded;
    size_t block_bytes = (size_t)in64 * NB / 2;
    const __m512i nib = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    int8_t wt[2][16][64] __attribute__((aligned(64)));  /* a group's weight tile per block */
    int32_t c[16][NB] __attribute__((aligned(64)));
    float f[AMX_CHUNK][2][NB] __attribute__((aligned(64)));
    memset(f, 0, sizeof f);
    configure_tiles();
    for (int g = 0; g < groups; g++) {
        for (int k = 0; k < nb; k++) {
            const uint8_t *src = j->wp + (size_t)(bk + k) * block_bytes + (size_t)g * (I4_GROUP / 8) * 64;
            for (int s = 0; s < 8; s++) {
                __m512i w = _mm512_loadu_si512((const void *)(src + s * 64));
                _mm512_store_si512((void *)wt[k][2 * s], _mm512_sub_epi8(_mm512_and_si512(w, nib), eight));
                _mm512_store_si512((void *)wt[k][2 * s + 1],
                                   _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(w, 4), nib), eight));
            }
        }
        _tile_loadd(6, wt[0], 64);
        if (nb == 2) _tile_loadd(7, wt[1], 64);
        __m512 sc0 = _mm512_loadu_ps(j->gscale + ((size_t)bk * groups + g) * NB);
        __m512 sc1 = nb == 2 ? _mm512_loadu_ps(j->gscale + ((size_t)(bk + 1) * groups + g) * NB) : sc0;
        for (int m0 = r0; m0 < r1; m0 += 32) {  /* C: tiles 0-3 = (row tile 0, 1) x (block 0, 1) */
            int two = m0 + 16 < r1;
            const int8_t *x0 = j->xq + (size_t)m0 * in64 + (size_t)g * I4_GROUP;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(4, x0, in64);
            _tile_dpbssd(0, 4, 6);
            if (nb == 2) _tile_dpbssd(1, 4, 7);
            if (two) {
                _tile_loadd(5, x0 + (size_t)16 * in64, in64);
                _tile_dpbssd(2, 5, 6);
                if (nb == 2) _tile_dpbssd(3, 5, 7);
            }
            I4_AMX_ADD(0, m0, 0, sc0);
            if (nb == 2) I4_AMX_ADD(1, m0, 1, sc1);
            if (two) {
                I4_AMX_ADD(2, m0 + 16, 0, sc0);
                if (nb == 2) I4_AMX_ADD(3, m0 + 16, 1, sc1);
            }
        }
    }
    _tile_release();
    int last = r1 < M ? r1 : M;
    for (int m = r0; m < last; m++)
        for (int k = 0; k < nb; k++) i4_store(&f[m - r0][k], j, m, 1, (bk + k) * NB);
}
