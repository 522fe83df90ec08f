/* c8: float32 weights held exactly as 8-bit codes. A GGUF model's float32 weights are its blocks
 * dequantised (gguf.c): each is w = (A * q) + B, two float32 roundings, with q a small integer and A, B
 * float32 values shared by a run of `group` inputs of one output row (Q4_1: A = d, B = m; Q4_K: A = d *
 * scale, B = -(dmin * min); Q6_K, Q5_0, Q8_0: B = -0, which adds nothing). Packed so (pack.c,
 * `specula_pack_codes`), a weight costs 1 + 8 / group bytes instead of 4, and the kernels rebuild
 * every weight bit for bit (FLAGS' -ffp-contract=off keeps the product and the sum two roundings)
 * before the same chain of fused multiply-adds over i = 0, 1, ... as f32's: every output is f32's,
 * bit for bit, whatever the rows (tests hold the two together).
 *
 * Layout: layout.h's `C8_GROUP_BYTES`; the call itself is linear.c's `specula_linear_c8`.
 *
 * Calls of up to C8_MULTI_ROWS rows on AVX-512 rebuild each weight in registers right before its FMAs
 * (linear_avx512.c, `specula_c8_multi_avx512`): decoding reads a quarter of f32's bytes; calls of up to
 * PANEL_ROWS - 1 rebuild each chunk of inputs once for every row group (`specula_c8_chunked_avx512`).
 * Without AVX-512 (linear.c): calls of up to MR rows rebuild in registers
 * (`c8_rows_avx2`), calls of up to PANEL_ROWS - 1 rebuild each chunk once (`c8_chunked_avx2`). A
 * prompt's panels rebuild their item's blocks into a per-thread float32 scratch laid out as f32's
 * packing and run f32's own item over it (here): the rebuild is spread over the call's many rows. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"
#include "linear.h"

/* One thread's float32 scratch (pool threads live as long as the process), grown on demand; NULL
 * when memory could not be had. */
static __thread float *scratch;
static __thread size_t scratch_floats;

static float *scratch_of(size_t floats) {
    if (floats > scratch_floats) {
        free(scratch);
        scratch = malloc(floats * sizeof(float));
        scratch_floats = scratch ? floats : 0;
    }
    return scratch;
}

/* Blocks bk0 .. bk1 - 1 of codes `wp` -> float32 dst [bk1 - bk0][in][NB], f32's packing. */
static void rebuild(const uint8_t *wp, float *dst, int bk0, int bk1, int in, int group) {
    int groups = in / group;
    size_t gbytes = C8_GROUP_BYTES(group);
    for (int bk = bk0; bk < bk1; bk++) {
        float *out = dst + (size_t)(bk - bk0) * in * NB;
        for (int g = 0; g < groups; g++) {
            const uint8_t *gp = wp + ((size_t)bk * groups + g) * gbytes;
            float a[NB], b[NB];
            memcpy(a, gp, sizeof a);
            memcpy(b, gp + sizeof a, sizeof b);
            const int8_t *q = (const int8_t *)(gp + sizeof a + sizeof b);
            for (int i = 0; i < group; i++)
                for (int c = 0; c < NB; c++)
                    out[(size_t)(g * group + i) * NB + c] = c8_weight(a[c], q[i * NB + c], b[c]);
        }
    }
}

void specula_c8_rebuilt_item(void *arg, int item) {
    struct linear_job *j = arg;
    int blocks = (j->out + NB - 1) / NB, bk0 = item * j->panel;
    int bk1 = bk0 + j->panel < blocks ? bk0 + j->panel : blocks;
    float *s = scratch_of((size_t)(bk1 - bk0) * j->in * NB);
    if (!s) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    rebuild(j->codes, s, bk0, bk1, j->in, j->group);
    struct linear_job sub = *j;
    /* the f32 item reads block bk at wp + bk * in * NB: point wp so that bk0 lands on the scratch */
    sub.wp = (const void *)((uintptr_t)s - (uintptr_t)bk0 * j->in * NB * sizeof(float));
    j->inner(&sub, item);
}
