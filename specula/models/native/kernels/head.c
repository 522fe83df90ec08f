/* An EAGLE / EAGLE-3 head's drafting pass in one call: the rows of one drafting level (or of a
 * catch-up over newly committed pairs), one sequence's or a packed batch's, from token ids to logits
 * over the draft vocabulary. It makes the kernel calls `kernel_pass.KernelHeadPass` made one by one
 * from Python, plus what ran as torch ops around them (the embedding lookups, eagle3's feature
 * fusion, the copy hints' term, RoPE's angles, the output layer); between ctypes calls, each small
 * torch op waited for the core the pool's helper still polled (`pool.c`), and a SmolLM2 head pass
 * cost 1.6-1.8 ms where its kernels need a third of that. A draft needs no exactness: tests hold
 * this pass to the module's forward (`heads.eagle.EagleHead`) within float tolerance.
 *
 * The pass (x the residual stream [n, E]):
 *   emb = table[ids] (or given rows); feat = fuse(raw) (eagle3's layer inputs; or given features);
 *   x = fc([norm(emb) * embed_norm ; norm(feat) * feature_norm])   (eagle: no norms)
 *   x += copy_proj(c) + copy_gain[len] * c + copy_len[len], c = norm(table[hint]) * embed_norm,
 *        zero where len = 0                                       (heads with copy hints)
 *   qkv = x Wqkv; rotate q, k (rotate-half layout) and write k, v at slots at..; a = attention(q)
 *   over slots lo .. at + n - 1 (mask [n, at - lo + n] bytes, or causal);
 *   x += a Wo; h = norm(x) * post_norm; x += silu_mul(h Wgate_up) Wdown;
 *   states = norm(x) * final_norm (eagle: x itself); logits = states Wlm (when lm is given).
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "refs.h"
#include "vmath.h"

void specula_head_input(const float *emb, const float *feat, const float *w_emb, const float *w_feat, float eps,
                        float *out, int n, int e);

/* A head's weights (kernel_pass.py's `HeadRef`); a linear whose `packed` is NULL is absent. */
struct head_ref {
    struct linear_ref fc, qkv, o, gate_up, down, fuse, copy_proj, lm;
    const float *embed_norm, *feature_norm, *post_norm, *final_norm; /* eagle: only post_norm */
    const float *copy_gain, *copy_len; /* [N + 1, E] each (copy hints of up to N tokens) */
    const float *inv_freq;             /* [D / 2] */
    const float *table;                /* [V_target, E]: the target's input embeddings, or NULL */
    int32_t e, heads, kv_heads, d, inter, table_rows; /* table_rows: V_target (0: no table) */
    float eps, scale;
    int32_t max_hint, unused; /* max_hint: the longest copy hint copy_gain has a row for (N) */
};

/* n rows of E floats: table[ids[r]] where ids are given, else a copy of rows. */
static void gather(const float *table, const int64_t *ids, const float *rows, float *out, int n, int e) {
    for (int r = 0; r < n; r++)
        memcpy(out + (size_t)r * e, ids ? table + (size_t)ids[r] * e : rows + (size_t)r * e, (size_t)e * sizeof(float));
}

/* One sequence's rows of a pass over several (`specula_head_pass_seqs`): rows r0 .. r0 + rows - 1 of
 * the call, written at slots at .. of its own caches [G, cap, D], seeing slots lo .. through mask
 * [rows, at - lo + rows] bytes (NULL: causal); logits of its rows logits_from .. rows - 1. */
struct head_seq {
    const uint8_t *mask;
    float *k_cache, *v_cache;
    int32_t cap, at, lo, rows, logits_from, unused;
};

/* ids / emb [n] / [n, E]: the rows' tokens (looked up in w->table) or embeddings; raw [n, k E] (eagle3's
 * layer inputs, fused here) or feat [n, E]; hint_ids / hint_emb with hint_len [n] (int64; NULL: no
 * hints); positions [n]; seqs [nseq]: the sequences the n rows belong to, in row order (their rows sum
 * to n), each with its caches, slots and mask; scores: scratch of max over seqs of rows * H * (at - lo +
 * rows) floats. The linears and the output layer run over all n rows at once (a packed batch's drafting
 * level: one pass over the head's weights for every session), RoPE's writes and the attention per
 * sequence, each into its own cache. Writes out [n, E] (the residual stream: the next level's
 * feature), states [n, E] (what the output layer reads) and, with w->lm, logits [sum of rows -
 * logits_from, V_draft]: each sequence's rows logits_from .. rows - 1, in order. Returns 0; -1 when
 * its work buffers, or a linear's rows, could not be allocated (the outputs and the cache slots may
 * then be partly written); before anything is written, -2 for a token id (or hint id) outside the
 * table's rows (or ids without a table) and -3 for a hint length outside 0 .. max_hint. */
int specula_head_pass_seqs(const struct head_ref *w, const int64_t *ids, const float *emb, const float *raw,
                           const float *feat, const int64_t *hint_ids, const float *hint_emb, const int64_t *hint_len,
                           const int64_t *positions, int nseq, const struct head_seq *seqs, float *scores, float *out,
                           float *states, float *logits, int n, int threads) {
    if (n <= 0) return 0;  /* no rows: nothing to run */
    for (int r = 0; r < n; r++) {
        if ((ids && (!w->table || ids[r] < 0 || ids[r] >= w->table_rows)) ||
            (hint_len && hint_ids && (!w->table || hint_ids[r] < 0 || hint_ids[r] >= w->table_rows)))
            return -2;
        if (hint_len && (hint_len[r] < 0 || hint_len[r] > w->max_hint)) return -3;
    }
    int e = w->e, h = w->heads, g = w->kv_heads, d = w->d, inter = w->inter, half = d / 2;
    size_t qkv_w = (size_t)(h + 2 * g) * d, att_w = (size_t)h * d;
    size_t floats = (size_t)n * (4 * (size_t)e + qkv_w + 2 * att_w + 3 * (size_t)inter + 2 * (size_t)half);
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return -1;
    int rc = -1;
    float *joined = buf, *t1 = joined + (size_t)n * 2 * e, *t2 = t1 + (size_t)n * e, *qkv = t2 + (size_t)n * e;
    float *q = qkv + (size_t)n * qkv_w, *att = q + (size_t)n * att_w, *gu = att + (size_t)n * att_w;
    float *act = gu + (size_t)n * 2 * inter, *cs = act + (size_t)n * inter, *sn = cs + (size_t)n * half;
    gather(w->table, ids, emb, t1, n, e); /* t1: the embeddings */
    const float *f = feat;
    if (raw) {
        if (linear(&w->fuse, raw, t2, n, threads)) goto done; /* t2: the fused features */
        f = t2;
    }
    specula_head_input(t1, f, w->embed_norm, w->feature_norm, w->eps, joined, n, e);
    if (linear(&w->fc, joined, out, n, threads)) goto done; /* out: x */
    if (hint_len) {
        gather(w->table, hint_ids, hint_emb, t1, n, e); /* t1: the hints' embeddings, normed in place */
        for (int r = 0; r < n; r++) {
            float *c = t1 + (size_t)r * e;
            if (hint_len[r] == 0)
                memset(c, 0, (size_t)e * sizeof(float));
            else if (w->embed_norm)
                rms_norm_row(c, w->embed_norm, w->eps, c, e);
        }
        if (linear(&w->copy_proj, t1, t2, n, threads)) goto done;
        for (int r = 0; r < n; r++) {
            const float *c = t1 + (size_t)r * e, *p = t2 + (size_t)r * e;
            const float *gain = w->copy_gain + (size_t)hint_len[r] * e, *bias = w->copy_len + (size_t)hint_len[r] * e;
            float *x = out + (size_t)r * e;
            for (int i = 0; i < e; i++) x[i] += (p[i] + gain[i] * c[i]) + bias[i];
        }
    }
    if (linear(&w->qkv, out, qkv, n, threads)) goto done;
    for (int r = 0; r < n; r++)
        for (int j = 0; j < half; j++) {
            float angle = (float)positions[r] * w->inv_freq[j];
            cs[(size_t)r * half + j] = cosf(angle);
            sn[(size_t)r * half + j] = sinf(angle);
        }
    for (int s = 0, r0 = 0; s < nseq; r0 += seqs[s].rows, s++) {
        const struct head_seq *sq = &seqs[s];
        int m = sq->rows, seen = sq->at - sq->lo;
        specula_rope_write_half(qkv + (size_t)r0 * qkv_w, cs + (size_t)r0 * half, sn + (size_t)r0 * half,
                                q + (size_t)r0 * att_w, sq->k_cache, sq->v_cache, m, h, g, d, sq->cap, sq->at, threads);
        specula_attention(q + (size_t)r0 * att_w, sq->k_cache + (size_t)sq->lo * d, sq->v_cache + (size_t)sq->lo * d,
                          sq->mask, att + (size_t)r0 * att_w, scores, m, h, g, d, sq->cap, seen + m, seen, w->scale,
                          threads);
    }
    if (linear(&w->o, att, t2, n, threads)) goto done;
    specula_add_rms_norm(out, t2, w->post_norm, w->eps, t1, n, e, threads); /* x += o; t1 = norm(x) */
    if (linear(&w->gate_up, t1, gu, n, threads)) goto done;
    specula_silu_mul(gu, act, n, inter, threads);
    if (linear(&w->down, act, t2, n, threads)) goto done;
    if (w->final_norm) {
        specula_add_rms_norm(out, t2, w->final_norm, w->eps, states, n, e, threads);
    } else {
        for (size_t i = 0; i < (size_t)n * e; i++) out[i] += t2[i];
        memcpy(states, out, (size_t)n * e * sizeof(float));
    }
    if (w->lm.packed && logits) {
        /* the rows that want logits: states itself where every sequence wants all of its rows, else
         * those rows gathered into t1 (free now) */
        int all = 1, k = 0;
        for (int s = 0; s < nseq; s++) all = all && seqs[s].logits_from <= 0;
        const float *rows = all ? states : t1;
        for (int s = 0, r0 = 0; s < nseq && !all; r0 += seqs[s].rows, s++) {
            int from = seqs[s].logits_from, m = seqs[s].rows - from;
            if (m <= 0) continue;
            memcpy(t1 + (size_t)k * e, states + (size_t)(r0 + from) * e, (size_t)m * e * sizeof(float));
            k += m;
        }
        if (all) k = n;
        if (k > 0 && linear(&w->lm, rows, logits, k, threads)) goto done;
    }
    rc = 0;
done:
    free(buf);
    return rc;
}
