/* What the one-call passes share (layers.c: a decoder's layers; head.c: a drafting head's layer):
 * one `KernelLinear` as they see it and the call that runs it (fused.py's `LinearRef` mirrors the
 * struct), and the ops they chain. */
#ifndef SPECULA_REFS_H
#define SPECULA_REFS_H

#include <stdint.h>

int specula_linear_f32(const float *x, const float *wp, const float *b, float *y, int M, int in, int out,
                       int threads);
int specula_linear_w8(const float *x, const int8_t *wp, const float *scale, const float *b, float *y, int M, int in,
                      int out, int threads);
int specula_linear_i8(const float *x, const int8_t *wp, const float *wscale, const float *b, float *y, int M, int in,
                      int out, int threads);
int specula_linear_i4(const float *x, const uint8_t *wp, const float *gscale, const float *b, float *y, int M,
                      int in, int out, int threads);
int specula_linear_c8(const float *x, const uint8_t *wp, const float *b, float *y, int M, int in, int out, int group,
                      int threads);

/* ops.c's per-layer ops, as the one-call passes chain them. */
void specula_add_rms_norm(float *x, const float *delta, const float *w, float eps, float *out, int n, int e,
                          int threads);
void specula_rope_write(const float *qkv, const float *cos_, const float *sin_, float *q_out, float *k_cache,
                        float *v_cache, int n, int heads, int kv_heads, int d, int cap, int start, int threads);
void specula_rope_write_half(const float *qkv, const float *cos_, const float *sin_, float *q_out, float *k_cache,
                             float *v_cache, int n, int heads, int kv_heads, int d, int cap, int start, int threads);
void specula_attention(const float *q, const float *k_cache, const float *v_cache, const uint8_t *mask, float *out,
                       float *scores, int n, int heads, int kv_heads, int d, int cap, int slots, int start,
                       float scale, int threads);
void specula_silu_mul(const float *gu, float *out, int n, int inter, int threads);

/* kind 0 f32, 1 w8, 2 i8, 3 i4, 4 c8; packed NULL: no such layer. */
struct linear_ref {
    const void *packed;
    const float *scale; /* w8 / i8: per output column; i4: per block, group and column */
    const float *bias;  /* or NULL */
    int32_t kind, in, out, group; /* group: c8's inputs per code group (else 0) */
};

/* y [m, out] = x [m, in] through the layer; returns 0, or -1 when the kernel could not allocate
 * its rows (the passes then stop and return -1). */
static inline int linear(const struct linear_ref *l, const float *x, float *y, int m, int threads) {
    if (l->kind == 0) return specula_linear_f32(x, l->packed, l->bias, y, m, l->in, l->out, threads);
    if (l->kind == 1) return specula_linear_w8(x, l->packed, l->scale, l->bias, y, m, l->in, l->out, threads);
    if (l->kind == 2) return specula_linear_i8(x, l->packed, l->scale, l->bias, y, m, l->in, l->out, threads);
    if (l->kind == 4) return specula_linear_c8(x, l->packed, l->bias, y, m, l->in, l->out, l->group, threads);
    return specula_linear_i4(x, l->packed, l->scale, l->bias, y, m, l->in, l->out, threads);
}

#endif
