/* A native decoder's layers in one call, for the few rows of a decoding step or a verified tree:
 * the same kernel calls, with the same operands in the same order, as `model.NativeDecoder._forward`
 * makes through `ops.CpuKernelOps` and `KernelLinear`, so every output is bit for bit the Python
 * path's (tests hold the two together). What it saves is the glue between the calls: a layer's ~10
 * kernel calls from Python cost 0.3-0.45 ms a layer in ctypes, tensor allocation and module calls,
 * 8-14 ms of a 33-45 ms one-token step of SmolLM2-135M or an int8 Qwen2.5-Coder-0.5B draft on the
 * 2-core machine (`scripts/pass_latency.py --breakdown`).
 *
 * Per layer (x the residual stream [n, E], delta the last sub-layer's output, not yet added):
 *   x += delta; h = rms_norm(x) * input_norm; qkv = h Wqkv; rotate q, k and write k, v at slots
 *   start..; a = attention(q); delta = a Wo; x += delta; h = rms_norm(x) * post_norm;
 *   delta = silu_mul(h Wgate_up) Wdown.
 * then out = rms_norm(x + delta) * final_norm. Taps (layer indices 0 .. L, L = the final states)
 * receive the residual stream entering each tapped layer, x + delta, in the order asked. A
 * sub-layer marked in `skip` is left out (a layer-skip self-draft, SWIFT), as the Python loop
 * leaves it out: its pending delta is the last sub-layer's that ran. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "refs.h"

/* One sequence's rows in the pass (fused.py's `SegmentRef`): rows row0 .. row0 + rows - 1, written at
 * slots start.. of its [L, G, cap, D] caches, seeing the slots `mask` [rows, start + rows] allows
 * (bytes; NULL: causally). */
struct segment_ref {
    float *k_cache, *v_cache;
    const uint8_t *mask;
    int32_t cap, start, row0, rows;
};

/* One decoder layer's weights (fused.py's `LayerRef`). */
struct layer_ref {
    const float *input_norm, *post_norm;
    struct linear_ref qkv, o, gate_up, down;
};

/* Rows of the residual stream entering a tapped layer: x, plus delta where one is pending. */
static void tap(const float *x, const float *delta, float *tapped, int slot, int ntaps, int n, int e) {
    for (int r = 0; r < n; r++) {
        float *dst = tapped + ((size_t)r * ntaps + slot) * e;
        const float *xr = x + (size_t)r * e;
        if (!delta) {
            memcpy(dst, xr, (size_t)e * sizeof(float));
            continue;
        }
        const float *dr = delta + (size_t)r * e;
        for (int i = 0; i < e; i++) dst[i] = xr[i] + dr[i];
    }
}

/* x [n, E]: the rows' embeddings, used as the residual stream (overwritten); out [n, E]: the
 * final-normed states. segs [nseg]: the sequences' rows (each its own cache; the linears run over
 * all n rows at once, attention per sequence in order). scores: scratch of the most
 * chunk * heads * (start + rows) floats of a segment, where a causal segment's (mask NULL: a prompt)
 * rows run in chunks of max(1, chunk_floats / (heads * (start + rows))) rows (`ops.CpuKernelOps.attend`'s
 * cut, so the bits are the Python loop's) and a masked one's in one call. taps [ntaps], tapped
 * [n, ntaps * E] (ntaps may be 0). skip [L][2] (attention, MLP; nonzero: skipped) or NULL. Returns 0,
 * or -1 when the work buffers could not be allocated (nothing is written then) or a linear could not
 * allocate its rows (x, out, tapped and the caches may then be partly written). */
int specula_decoder_pass(float *x, float *out, int n, int e, int layers, const struct layer_ref *w,
                         const float *final_norm, float eps, const float *cos_, const float *sin_,
                         const struct segment_ref *segs, int nseg, int heads, int kv_heads, int d, int inter,
                         float scale, float *scores, long chunk_floats, const int32_t *taps, int ntaps, float *tapped,
                         const uint8_t *skip, int threads) {
    if (n <= 0) return 0;  /* no rows: nothing to run */
    size_t qkv_w = (size_t)(heads + 2 * kv_heads) * d, att_w = (size_t)heads * d, half = (size_t)d / 2;
    size_t floats = (size_t)n * (2 * (size_t)e + qkv_w + 2 * att_w + 3 * (size_t)inter);
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return -1;
    int rc = -1;
    float *h = buf, *delta = h + (size_t)n * e, *qkv = delta + (size_t)n * e, *q = qkv + (size_t)n * qkv_w;
    float *att = q + (size_t)n * att_w, *gu = att + (size_t)n * att_w, *act = gu + (size_t)n * 2 * inter;
    int pending = 0; /* whether delta holds a sub-layer's output not yet added to x */
    for (int li = 0; li < layers; li++) {
        for (int t = 0; t < ntaps; t++)
            if (taps[t] == li) tap(x, pending ? delta : NULL, tapped, t, ntaps, n, e);
        const struct layer_ref *l = w + li;
        if (!(skip && skip[2 * li])) {
            specula_add_rms_norm(x, pending ? delta : NULL, l->input_norm, eps, h, n, e, threads);
            if (linear(&l->qkv, h, qkv, n, threads)) goto done;
            for (int si = 0; si < nseg; si++) {
                const struct segment_ref *sg = segs + si;
                size_t per_layer = (size_t)kv_heads * sg->cap * d, r0 = (size_t)sg->row0;
                float *kc = sg->k_cache + (size_t)li * per_layer, *vc = sg->v_cache + (size_t)li * per_layer;
                specula_rope_write(qkv + r0 * qkv_w, cos_ + r0 * half, sin_ + r0 * half, q + r0 * att_w, kc, vc,
                                   sg->rows, heads, kv_heads, d, sg->cap, sg->start, threads);
                /* causal rows in chunks whose scores fit chunk_floats, as `ops.CpuKernelOps.attend` cuts them */
                long span = (long)heads * (sg->start + sg->rows), fit = chunk_floats / span;
                int step = sg->mask ? sg->rows : fit < 1 ? 1 : fit < sg->rows ? (int)fit : sg->rows;
                for (int c0 = 0; c0 < sg->rows; c0 += step) {
                    int c1 = sg->rows - c0 < step ? sg->rows : c0 + step;
                    specula_attention(q + (r0 + c0) * att_w, kc, vc, sg->mask, att + (r0 + c0) * att_w, scores,
                                      c1 - c0, heads, kv_heads, d, sg->cap, sg->start + c1, sg->start + c0, scale,
                                      threads);
                }
            }
            if (linear(&l->o, att, delta, n, threads)) goto done;
            pending = 1;
        }
        if (!(skip && skip[2 * li + 1])) {
            specula_add_rms_norm(x, pending ? delta : NULL, l->post_norm, eps, h, n, e, threads);
            if (linear(&l->gate_up, h, gu, n, threads)) goto done;
            specula_silu_mul(gu, act, n, inter, threads);
            if (linear(&l->down, act, delta, n, threads)) goto done;
            pending = 1;
        }
    }
    specula_add_rms_norm(x, pending ? delta : NULL, final_norm, eps, out, n, e, threads);
    for (int t = 0; t < ntaps; t++)
        if (taps[t] == layers) tap(out, NULL, tapped, t, ntaps, n, e);
    rc = 0;
done:
    free(buf);
    return rc;
}
