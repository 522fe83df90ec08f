/* Ops of the drafting loop on CPU: an EAGLE head's input rows (its RoPE is `ops.c`'s rotate-half
 * variant), and the top-k children of a frontier's logits. A draft needs no exactness (the target
 * verifies every token), so nothing here is bound to the decoder's bitwise rules; what these save
 * is the glue between kernel calls: small torch ops after a kernel call wait for the core the
 * pool's helper still polls (`pool.c`), several hundred microseconds a level on the 2-core machine.
 *
 * Layouts (float32, row-major): emb, feat [n, E]; out [n, 2E]; qkv [n, (H + 2G) * D] with q and k
 * heads in rotate-half layout (dims j and j + D / 2 rotate together, as Llama's reference code);
 * caches [G, cap, D]; logits [n, V].
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "vmath.h"

/* rms_norm_row, or (w NULL) x copied unchanged. */
static void norm_row(const float *x, const float *w, float eps, float *out, int e) {
    if (!w) {
        for (int i = 0; i < e; i++) out[i] = x[i];
        return;
    }
    rms_norm_row(x, w, eps, out, e);
}

/* out [n, 2E] = [norm(emb) * w_emb ; norm(feat) * w_feat] row by row (EAGLE-3's input norms ahead
 * of fc); a NULL weight copies its half unnormed (EAGLE's plain concatenation). */
void specula_head_input(const float *emb, const float *feat, const float *w_emb, const float *w_feat, float eps,
                        float *out, int n, int e) {
    for (int r = 0; r < n; r++) {
        norm_row(emb + (size_t)r * e, w_emb, eps, out + (size_t)r * 2 * e, e);
        norm_row(feat + (size_t)r * e, w_feat, eps, out + (size_t)r * 2 * e + e, e);
    }
}

/* Insert (value, index) into the k best so far, best first (ties: the lower index first). */
static void insert_best(float *vals, int64_t *idx, int *have, int k, float v, int64_t j) {
    int pos = *have < k ? *have : k - 1;
    if (*have == k && !(v > vals[k - 1])) return;
    while (pos > 0 && v > vals[pos - 1]) {
        vals[pos] = vals[pos - 1];
        idx[pos] = idx[pos - 1];
        pos--;
    }
    vals[pos] = v;
    idx[pos] = j;
    if (*have < k) (*have)++;
}

/* One 8-lane vector of a row at offset j: its lanes above the k-th best so far (every lane while
 * fewer than k are held) go into the k best; NaN lanes never do. */
static inline void scan8(const float *row, int j, __m256 x, float *vals, int64_t *ids, int *have, int k) {
    int hits = *have < k ? 0xff : _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(vals[k - 1]), _CMP_GT_OQ));
    while (hits) {
        int lane = __builtin_ctz(hits);
        hits &= hits - 1;
        float val = row[j + lane];
        if (val == val) insert_best(vals, ids, have, k, val, j + lane);
    }
}

/* A row's k (<= v) largest values, best first (ties: the lower index first), into vals [k] and ids
 * [k] (-inf and 0 past the row's non-NaN values); returns the row's largest non-NaN value (-inf for
 * none). Four vectors at a time are checked against the k-th best before any lane is looked at: past
 * the first few hundred values almost none reach it. */
static float row_top_k(const float *row, int v, int k, float *vals, int64_t *ids) {
    int have = 0, j = 0;
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (; j + 32 <= v; j += 32) {
        __m256 x0 = _mm256_loadu_ps(row + j), x1 = _mm256_loadu_ps(row + j + 8);
        __m256 x2 = _mm256_loadu_ps(row + j + 16), x3 = _mm256_loadu_ps(row + j + 24);
        /* vmax second: _mm256_max_ps returns it where a lane of the first is NaN, so NaN never enters */
        vmax = _mm256_max_ps(x0, _mm256_max_ps(x1, _mm256_max_ps(x2, _mm256_max_ps(x3, vmax))));
        __m256 bar = _mm256_set1_ps(have < k ? -INFINITY : vals[k - 1]);
        __m256 a01 = _mm256_or_ps(_mm256_cmp_ps(x0, bar, _CMP_GT_OQ), _mm256_cmp_ps(x1, bar, _CMP_GT_OQ));
        __m256 a23 = _mm256_or_ps(_mm256_cmp_ps(x2, bar, _CMP_GT_OQ), _mm256_cmp_ps(x3, bar, _CMP_GT_OQ));
        __m256 above = _mm256_or_ps(a01, a23);
        if (have < k || _mm256_movemask_ps(above)) {
            scan8(row, j, x0, vals, ids, &have, k);
            scan8(row, j + 8, x1, vals, ids, &have, k);
            scan8(row, j + 16, x2, vals, ids, &have, k);
            scan8(row, j + 24, x3, vals, ids, &have, k);
        }
    }
    for (; j + 8 <= v; j += 8) {
        __m256 x = _mm256_loadu_ps(row + j);
        vmax = _mm256_max_ps(x, vmax);
        scan8(row, j, x, vals, ids, &have, k);
    }
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, vmax);
    for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    for (; j < v; j++) {
        float val = row[j];
        if (val == val) {
            top = val > top ? val : top;
            insert_best(vals, ids, &have, k, val, j);
        }
    }
    for (int l = have; l < k; l++) vals[l] = -INFINITY, ids[l] = 0;
    return top;
}

/* The k-th largest of row [v] (0 < k <= v; NaN values are never counted), through `row_top_k`'s scan: what
 * screen.c's `specula_screen_top` cuts a truncated sample's candidates at; -inf where the row holds fewer than k
 * values that are not NaN. vals [k], ids [k]: the caller's scratch. */
float specula_kth_largest(const float *row, int v, int k, float *vals, int64_t *ids) {
    row_top_k(row, v, k, vals, ids);
    return vals[k - 1];
}

/* One row's k (<= v) best ids as `specula_topk_ids` ranks them, written as int32 into out [k]: token recycling's
 * matrix row after a step that verified no draft, in one call from the row's own memory (`ScreenedLogits.
 * draft_top_k_into`: no tensors made). Returns -1 where its scratch could not be allocated. */
int specula_topk_ids_i32(const float *row, int v, int k, int32_t *out) {
    float vals_here[64];
    int64_t ids_here[64];
    float *vals = k <= 64 ? vals_here : malloc((size_t)k * sizeof(float));
    int64_t *ids = k <= 64 ? ids_here : malloc((size_t)k * sizeof(int64_t));
    if (!vals || !ids) {
        if (vals != vals_here) free(vals);
        if (ids != ids_here) free(ids);
        return -1;
    }
    row_top_k(row, v, k, vals, ids);
    for (int l = 0; l < k; l++) out[l] = (int32_t)ids[l];
    if (vals != vals_here) free(vals);
    if (ids != ids_here) free(ids);
    return 0;
}

/* For each row of logits [n, v]: its k (<= v) largest logits, best first (ties: the lower index
 * first), as indices idx [n, k] and the logits themselves vals [n, k] (NaN logits are never picked):
 * what a drafter learns from a verified pass (token recycling's matrix rows). */
void specula_topk_ids(const float *logits, int n, int v, int k, int64_t *idx, float *vals) {
    for (int r = 0; r < n; r++)
        row_top_k(logits + (size_t)r * v, v, k, vals + (size_t)r * k, idx + (size_t)r * k);
}

/* For each row of logits [n, v]: its k (<= v) largest logits, best first (ties: lower index first),
 * as indices idx [n, k] and softmax probabilities prob [n, k] (e^(l - logsumexp(row))). NaN logits
 * are never picked. */
void specula_topk_probs(const float *logits, int n, int v, int k, int64_t *idx, float *prob) {
    for (int r = 0; r < n; r++) {
        const float *row = logits + (size_t)r * v;
        float *vals = prob + (size_t)r * k;
        int64_t *ids = idx + (size_t)r * k;
        float top = row_top_k(row, v, k, vals, ids), lanes[8];
        int j;
        if (top == INFINITY) {  /* softmax's limit: the +inf logits share the mass (e^(inf - inf) is NaN) */
            int infs = 0;
            for (j = 0; j < v; j++) infs += row[j] == INFINITY;
            for (int l = 0; l < k; l++) vals[l] = vals[l] == INFINITY ? 1.0f / infs : 0.0f;
            continue;
        }
        /* the total: sum of e^(l - top) over the row, 8 lanes, the tail padded with -inf (e^-inf = 0) */
        __m256 shift = _mm256_set1_ps(top), acc = _mm256_setzero_ps();
        for (j = 0; j + 8 <= v; j += 8) {
            __m256 x = _mm256_loadu_ps(row + j);
            __m256 e = exp8(_mm256_sub_ps(x, shift));
            acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_cmp_ps(x, x, _CMP_ORD_Q)));  /* NaN lanes add 0 */
        }
        float total = 0.0f;
        _mm256_storeu_ps(lanes, acc);
        for (int l = 0; l < 8; l++) total += lanes[l];
        for (; j < v; j++) {
            float val = row[j];
            if (val == val) total += expf(val - top);
        }
        for (int l = 0; l < k; l++) vals[l] = vals[l] == -INFINITY ? 0.0f : expf(vals[l] - top) / total;
    }
}
