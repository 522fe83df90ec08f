/* GGUF blocks to float32 for `models install`'s conversion (`kernels.dequantize_gguf`): the same
 * bits as gguf-py's numpy (`gguf.quants.<type>.dequantize_blocks`), one pass per block where numpy
 * made a dozen array passes (Q4_K/Q6_K of the 1.5B: 24 s on the 2-core machine); and the same blocks
 * as the c8 layers' exact codes (`specula_gguf_codes`). Every product and sum is the numpy
 * expression's, in its order, rounded to float32 each (FLAGS' -ffp-contract=off: no fused
 * multiply-add). Block layouts: ggml-common.h. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "layout.h"

/* IEEE half to float (exact, as numpy's astype(np.float32)). */
static float half(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    float out;
    if (exp == 0) {
        out = (float)man * 5.9604644775390625e-08f; /* man * 2^-24: exact */
        memcpy(&bits, &out, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 112) << 23 | man << 13;
    }
    memcpy(&out, &bits, 4);
    return out;
}

/* One block of ggml type `type` as codes: each value y = (a * q) + b, two float32 roundings, q[values]
 * int8, and a, b per run of 16 values (values / 16 of each). Types without an offset get b = -0, which
 * adds nothing to any float, so (a * q) + b is numpy's expression's bits for every type: the dequantised
 * blocks (`specula_gguf_dequantize`) and the c8 layers' codes (linear_codes.c, `native/codes.py`) are
 * read here alone. Block layouts: ggml-common.h. */
static void codes_block(const uint8_t *blk, int type, int8_t *q, float *a, float *b) {
    const float nz = -0.0f;
    if (type == 8) { /* Q8_0: (float)q * d */
        float d = half(blk);
        for (int i = 0; i < 32; i++) q[i] = (int8_t)blk[2 + i];
        a[0] = a[1] = d;
        b[0] = b[1] = nz;
    } else if (type == 6) { /* Q5_0: d * (q - 16) */
        float d = half(blk);
        uint32_t qh = (uint32_t)blk[2] | (uint32_t)blk[3] << 8 | (uint32_t)blk[4] << 16 | (uint32_t)blk[5] << 24;
        const uint8_t *qs = blk + 6;
        for (int i = 0; i < 32; i++) {
            int lo = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
            q[i] = (int8_t)((lo | (int)((qh >> i) & 1u) << 4) - 16);
        }
        a[0] = a[1] = d;
        b[0] = b[1] = nz;
    } else if (type == 3) { /* Q4_1: (d * q) + m */
        float d = half(blk), m = half(blk + 2);
        const uint8_t *qs = blk + 4;
        for (int i = 0; i < 32; i++) q[i] = (int8_t)(i < 16 ? qs[i] & 15 : qs[i - 16] >> 4);
        a[0] = a[1] = d;
        b[0] = b[1] = m;
    } else if (type == 12) { /* Q4_K: (d * sc) * q - dmin * min */
        float d = half(blk), dmin = half(blk + 2);
        const uint8_t *s = blk + 4, *qs = blk + 16;
        for (int j = 0; j < 8; j++) {
            int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 2) & 48);
            int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 2) & 48);
            float ds = d * (float)sc, dm = dmin * (float)mn;
            const uint8_t *qq = qs + 32 * (j / 2);
            int shift = 4 * (j & 1);
            for (int l = 0; l < 32; l++) q[32 * j + l] = (int8_t)((qq[l] >> shift) & 15);
            a[2 * j] = a[2 * j + 1] = ds;
            b[2 * j] = b[2 * j + 1] = -dm;
        }
    } else { /* 14, Q6_K (`find` knows no other type): (d * scale[e / 16]) * (q - 32) */
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        float d = half(blk + 208);
        for (int e = 0; e < 256; e++) {
            int h = e / 128, lo = (ql[64 * h + e % 64] >> (4 * ((e / 64) % 2))) & 15;
            int hi = (qh[32 * h + e % 32] >> (2 * ((e / 32) % 4))) & 3;
            q[e] = (int8_t)((lo | hi << 4) - 32);
        }
        for (int g = 0; g < 16; g++) {
            a[g] = d * (float)sc[g];
            b[g] = nz;
        }
    }
}


/* The ggml types (gguf.GGMLQuantizationType ids) this file knows: block bytes, values. */
static const struct {
    int type, bytes, values;
} TYPES[] = {
    {3, 20, 32},    /* Q4_1 */
    {6, 22, 32},    /* Q5_0 */
    {8, 34, 32},    /* Q8_0 */
    {12, 144, 256}, /* Q4_K */
    {14, 210, 256}, /* Q6_K */
};

static int find(int type) {
    for (int i = 0; i < (int)(sizeof TYPES / sizeof TYPES[0]); i++)
        if (TYPES[i].type == type) return i;
    return -1;
}

/* Block bytes of ggml type `type`, or 0 where this file does not dequantise it. */
int specula_gguf_block_bytes(int type) {
    int i = find(type);
    return i < 0 ? 0 : TYPES[i].bytes;
}

/* Values per block of ggml type `type` (0 where unknown). */
int specula_gguf_block_values(int type) {
    int i = find(type);
    return i < 0 ? 0 : TYPES[i].values;
}

/* Dequantise `blocks` blocks of ggml type `type` at `src` into `dst` (blocks * values floats).
 * Returns 0, or -1 for a type this file does not know. */
int specula_gguf_dequantize(const uint8_t *src, float *dst, int64_t blocks, int type, int threads) {
    int k = find(type);
    if (k < 0) return -1;
    int bytes = TYPES[k].bytes, values = TYPES[k].values;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < blocks; i++) {
        int8_t q[256];
        float a[16], b[16], *y = dst + i * values;
        codes_block(src + i * bytes, type, q, a, b);
        for (int e = 0; e < values; e++) y[e] = c8_weight(a[e / 16], q[e], b[e / 16]);
    }
    return 0;
}

int specula_gguf_codes(const uint8_t *src, int8_t *q, float *a, float *b, int64_t blocks, int type, int threads) {
    int k = find(type);
    if (k < 0) return -1;
    int bytes = TYPES[k].bytes, values = TYPES[k].values;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < blocks; i++)
        codes_block(src + i * bytes, type, q + i * values, a + i * (values / 16), b + i * (values / 16));
    return 0;
}
