/* What linear.c shares with its AVX-512 variants (linear_avx512.c): one call's operands and the
 * item functions `specula_parallel` runs per column block. Not part of the packed layout
 * (layout.h), so prepared entries do not depend on it. */
#ifndef SPECULA_LINEAR_H
#define SPECULA_LINEAR_H

#include <stddef.h>
#include <stdint.h>

#define MRZ 16  /* rows per group of the AVX-512 f32 / w8 items (linear_avx512.c) */

typedef void (*specula_item_fn)(void *ctx, int item);

/* One call's operands, shared by the items (column blocks) `specula_parallel` hands out. */
struct linear_job {
    const float *xp;       /* f32 / w8: x packed per group of MR rows */
    const int8_t *xq;      /* i8: x quantized per row, in4 wide (AVX-512: offset by 128, as uint8) */
    const float *xs;       /* i8: the rows' scales */
    const void *wp;
    const float *scale;    /* w8 / i8: per output column */
    const float *b;
    float *y;
    int M, in, out, groups, quads, in4;
};

/* 1 when the AVX-512 variants run (the CPU has AVX-512 F/BW/VNNI and `specula_set_isa` did not
 * ask for AVX2), else 0. */
int specula_isa(void);

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

/* linear_avx512.c: f32 / w8 over one column block, rows packed per group of MRZ. */
void specula_f32_block_avx512(void *job, int bk);
void specula_w8_block_avx512(void *job, int bk);

/* linear_avx512.c: i8 over one column block with VNNI (`vpdpbusd`), every row group of the call;
 * needs j->xq offset by 128 (`specula_offset_rows`). */
void specula_i8_block_vnni(void *job, int bk);
void specula_offset_rows(int8_t *xq, long n);

#endif
