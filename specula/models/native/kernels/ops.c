/* The other per-layer ops of the native decoder on CPU, for the few rows a decoding step or a tree
 * verification passes: residual add + RMSNorm, RoPE + KV-cache write, attention over the cache,
 * SiLU-gated product. Every row is computed alone, by the same loops in the same order whatever
 * the number of rows (no reduction crosses rows), so with `linear.c` a tree row is bitwise the
 * one-token step of the same tokens.
 *
 * Layouts (float32, row-major): x [n, E]; qkv [n, (H + 2G) * D] with q and k heads in RoPE pair
 * layout (dims 2j, 2j + 1 rotate together); caches [G, cap, D] per layer; q [n, H, D].
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "layout.h"
#include "linear.h"
#include "pool.h"
#include "vmath.h"

/* The row-wise ops (norm, RoPE, SiLU product) run ROWS_PER_ITEM rows an item on the pool from
 * 2 x ROWS_PER_ITEM rows on (a prompt's: alone they were a fifth of the 0.5B's 800-token prefill,
 * its second core idle); fewer run on the caller (a step's few rows cost less than waking a
 * worker). Each row is computed by the same code either way. */
#define ROWS_PER_ITEM 16

/* fn(args, r0, r1) over rows 0 .. n - 1, in items of ROWS_PER_ITEM where there are enough. */
static void for_rows(int n, int threads, specula_rows_fn fn, const void *args) {
    if (threads < 2 || n < 2 * ROWS_PER_ITEM)
        fn(args, 0, n);
    else
        specula_parallel_rows(threads, n, ROWS_PER_ITEM, fn, args);
}

struct norm_args {
    float *x;
    const float *delta, *w;
    float eps;
    float *out;
    int e;
};

static void add_rms_norm_rows(const void *args, int r0, int r1) {
    const struct norm_args *a = args;
    for (int r = r0; r < r1; r++) {
        float *xr = a->x + (size_t)r * a->e;
        if (a->delta) {
            const float *dr = a->delta + (size_t)r * a->e;
            for (int i = 0; i < a->e; i++) xr[i] += dr[i];
        }
        rms_norm_row(xr, a->w, a->eps, a->out + (size_t)r * a->e, a->e);
    }
}

/* x += delta (when given), then out = x * rsqrt(mean(x^2) + eps) * w, row by row. */
void specula_add_rms_norm(float *x, const float *delta, const float *w, float eps, float *out, int n, int e,
                          int threads) {
    struct norm_args a = {x, delta, w, eps, out, e};
    for_rows(n, threads, add_rms_norm_rows, &a);
}

struct rope_args {
    const float *qkv, *cos_, *sin_;
    float *q_out, *k_cache, *v_cache;
    int heads, kv_heads, d, cap, start, halves;
};

/* Rotate the q and k heads of rows r0 .. r1 - 1 by (cos, sin) [n, D / 2] of the row's position, write
 * q to q_out [n, H, D], and k, v to slots start + r of the layer's caches [G, cap, D]. Pair j is dims
 * (2j, 2j + 1) (the decoder's pair layout) or, `halves`, (j, j + D / 2) (rotate-half layout). */
static void rope_write_rows(const void *args, int r0, int r1) {
    const struct rope_args *a = args;
    const float *qkv = a->qkv, *cos_ = a->cos_, *sin_ = a->sin_;
    float *q_out = a->q_out, *k_cache = a->k_cache, *v_cache = a->v_cache;
    int heads = a->heads, kv_heads = a->kv_heads, d = a->d, cap = a->cap, start = a->start, halves = a->halves;
    int half = d / 2, width = (heads + 2 * kv_heads) * d;
    for (int r = r0; r < r1; r++) {
        const float *row = qkv + (size_t)r * width;
        const float *c = cos_ + (size_t)r * half, *s = sin_ + (size_t)r * half;
        for (int h = 0; h < heads + kv_heads; h++) {
            const float *src = row + (size_t)h * d;
            float *dst = h < heads ? q_out + ((size_t)r * heads + h) * d
                                   : k_cache + ((size_t)(h - heads) * cap + start + r) * d;
            for (int j = 0; j < half; j++) {
                int i0 = halves ? j : 2 * j, i1 = halves ? j + half : 2 * j + 1;
                float a = src[i0], b = src[i1];
                dst[i0] = a * c[j] - b * s[j];
                dst[i1] = a * s[j] + b * c[j];
            }
        }
        for (int g = 0; g < kv_heads; g++) {
            const float *src = row + (size_t)(heads + kv_heads + g) * d;
            float *dst = v_cache + ((size_t)g * cap + start + r) * d;
            for (int j = 0; j < d; j++) dst[j] = src[j];
        }
    }
}

/* The decoder's RoPE + cache write (pair layout). */
void specula_rope_write(const float *qkv, const float *cos_, const float *sin_, float *q_out, float *k_cache,
                        float *v_cache, int n, int heads, int kv_heads, int d, int cap, int start, int threads) {
    struct rope_args a = {qkv, cos_, sin_, q_out, k_cache, v_cache, heads, kv_heads, d, cap, start, 0};
    for_rows(n, threads, rope_write_rows, &a);
}

/* The same in rotate-half layout (an EAGLE head's q and k, as Llama's reference code lays them out). */
void specula_rope_write_half(const float *qkv, const float *cos_, const float *sin_, float *q_out, float *k_cache,
                             float *v_cache, int n, int heads, int kv_heads, int d, int cap, int start, int threads) {
    struct rope_args a = {qkv, cos_, sin_, q_out, k_cache, v_cache, heads, kv_heads, d, cap, start, 1};
    for_rows(n, threads, rope_write_rows, &a);
}

static inline float dot(const float *a, const float *b, int d) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float l[8];
    _mm256_storeu_ps(l, acc);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* v[j] = e^(v[j] - shift) for j < n (the last partial 8 through a padded copy). */
static inline void exp_shifted(float *v, int n, float shift) {
    __m256 s = _mm256_set1_ps(shift);
    int j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(v + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(v + j), s)));
    if (j < n) {
        float tail[8];
        for (int k = 0; k < 8; k++) tail[k] = j + k < n ? v[j + k] : shift;
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), s)));
        for (int k = 0; j + k < n; k++) v[j + k] = tail[k];
    }
}

/* The 8 sums of the lanes of 8 accumulators, each added as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
 * (l6 + l7)), exactly as `dot` adds its lanes: a score does not depend on the scores computed beside
 * it. */
static inline __m256 hsum8(const __m256 acc[8]) {
    __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
    __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* out[4k + s] = q[k] . b_s for nq <= 3 queries and the 4 keys b_s = b + s * d (d a multiple of 8):
 * the queries share each key load, 12 accumulators in flight; every score is `dot`'s arithmetic
 * exactly, so it does not depend on the queries or keys computed beside it. */
static inline __attribute__((always_inline)) void dot_block(const float *const *q, int nq, const float *b, int d,
                                                            float *out) {
    __m256 acc[16], qv[3];
    for (int k = 0; k < 16; k++) acc[k] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
        for (int k = 0; k < nq; k++) qv[k] = _mm256_loadu_ps(q[k] + i);
        for (int s = 0; s < 4; s++) {
            __m256 kv = _mm256_loadu_ps(b + (size_t)s * d + i);
            for (int k = 0; k < nq; k++) acc[4 * k + s] = _mm256_fmadd_ps(qv[k], kv, acc[4 * k + s]);
        }
    }
    _mm256_storeu_ps(out, hsum8(acc));
    if (nq == 3) _mm256_storeu_ps(out + 8, hsum8(acc + 8));
}

/* o[k][i .. i + 8w - 1] += sum over slots j0 .. j1 - 1 of p[k][j] * v_j[i .. i + 8w - 1] for nq <= 3
 * queries and w <= 4 vectors of dims (value rows v_j = v + j * d), the queries sharing each value
 * load; each query's sum runs over the slots in increasing order, whatever is computed beside it. */
static inline __attribute__((always_inline)) void weigh_block(const float *const *p, float *const *o, int nq, int w,
                                                              int i, const float *v, int d, int j0, int j1) {
    __m256 acc[3][4], vv[4];
    for (int k = 0; k < nq; k++)
        for (int c = 0; c < w; c++) acc[k][c] = _mm256_loadu_ps(o[k] + i + 8 * c);
    for (int j = j0; j < j1; j++) {
        const float *vj = v + (size_t)j * d + i;
        for (int c = 0; c < w; c++) vv[c] = _mm256_loadu_ps(vj + 8 * c);
        for (int k = 0; k < nq; k++) {
            __m256 pk = _mm256_set1_ps(p[k][j]);
            for (int c = 0; c < w; c++) acc[k][c] = _mm256_fmadd_ps(pk, vv[c], acc[k][c]);
        }
    }
    for (int k = 0; k < nq; k++)
        for (int c = 0; c < w; c++) _mm256_storeu_ps(o[k] + i + 8 * c, acc[k][c]);
}

/* weigh_block over every dim (32 at a time, then 8 at a time) for nq <= 3 queries. */
static void weigh(const float *const *p, float *const *o, int nq, const float *v, int d, int j0, int j1) {
    for (int i = 0; i + 32 <= d; i += 32) {
        if (nq == 3) weigh_block(p, o, 3, 4, i, v, d, j0, j1);
        else if (nq == 2) weigh_block(p, o, 2, 4, i, v, d, j0, j1);
        else weigh_block(p, o, 1, 4, i, v, d, j0, j1);
    }
    for (int i = d / 32 * 32; i < d; i += 8) weigh_block(p, o, nq, 1, i, v, d, j0, j1);
}

/* The number of leading slots a mask row shows (all of them below `limit` without a mask). */
static inline int visible_prefix(const uint8_t *m, int limit) {
    if (!m) return limit;
    int j = 0;
    for (; j + 32 <= limit; j += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(m + j));
        unsigned hidden = (unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_setzero_si256()));
        if (hidden) return j + __builtin_ctz(hidden);
    }
    while (j < limit && m[j]) j++;
    return j;
}

/* One query's softmax weights in place over sc[0 .. limit): scaled, shifted by the visible maximum,
 * exponentiated. Returns their total over the visible slots (slots 0 .. prefix - 1, then those of
 * prefix .. limit - 1 that m shows), added as a function of the visible values in visible order
 * alone: the v-th visible value goes to lane v % 8 of an 8-lane sum, the lanes are added 0..7. So a
 * tree row, whose ancestors sit in scattered slots, adds the same numbers in the same order as the
 * one-token step of the same tokens. */
static float softmax_weights(float *sc, const uint8_t *m, int limit, int prefix, float scale) {
    const __m256 sv = _mm256_set1_ps(scale);
    int j = 0;
    for (; j + 8 <= limit; j += 8) _mm256_storeu_ps(sc + j, _mm256_mul_ps(_mm256_loadu_ps(sc + j), sv));
    for (; j < limit; j++) sc[j] *= scale;
    __m256 best8 = _mm256_set1_ps(-INFINITY);
    for (j = 0; j + 8 <= prefix; j += 8) best8 = _mm256_max_ps(best8, _mm256_loadu_ps(sc + j));
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, best8);
    for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    for (int k = j; k < limit; k++)
        if ((k < prefix || m[k]) && sc[k] > best) best = sc[k];
    exp_shifted(sc, limit, best);
    __m256 acc = _mm256_setzero_ps();
    for (j = 0; j + 8 <= prefix; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(sc + j));
    float stage[8];
    int lane = 0;
    for (; j < limit; j++) {
        if (j >= prefix && !m[j]) continue;
        stage[lane++] = sc[j];
        if (lane == 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(stage)), lane = 0;
    }
    if (lane) {
        for (int l = lane; l < 8; l++) stage[l] = 0.0f;
        acc = _mm256_add_ps(acc, _mm256_loadu_ps(stage));
    }
    _mm256_storeu_ps(lanes, acc);
    float total = 0.0f;
    for (int l = 0; l < 8; l++) total += lanes[l];
    return total;
}

/* out [n, H, D]: for row r and head h (KV group h / (H / G)), softmax over the slots the row may see
 * of q . k * scale, times v. Visible slots: mask [n, slots] (nonzero = visible) or, without a
 * mask, slots 0 .. start + r (causal). scores: scratch [n * H, slots]. Items of `specula_parallel`:
 * a KV group and `rows` consecutive rows each. */
struct attention_job {
    const float *q, *k_cache, *v_cache;
    const uint8_t *mask;
    float *out, *scores;
    int n, heads, per, d, cap, slots, start, rows;
    float scale;
};

#define MAX_QUERIES 256  /* query heads of one item (rows x H / G; `rows` is kept within it) */
#define SLOT_BLOCK 32    /* value rows that stay in L1 while every query of the item reads them */

/* One item: KV group g and rows r0 .. r1 - 1, i.e. the `per` query heads of the group in each row,
 * which read each block of keys and values once between them (three queries share each load
 * in registers). Every query's arithmetic is what it is alone: each score by `dot`'s arithmetic, its
 * own softmax and total (`softmax_weights`), and its value sum over its visible slots in
 * increasing order (accumulators kept in `out` between blocks); so the bits do not change with
 * the grouping, the rows beside it or the slots its visible values sit in. */
static void attention_item(void *arg, int item) {
    const struct attention_job *a = arg;
    const int heads = a->heads, per = a->per, d = a->d, slots = a->slots, start = a->start;
    const int kv_heads = heads / per, g = item % kv_heads, r0 = (item / kv_heads) * a->rows;
    const int r1 = r0 + a->rows < a->n ? r0 + a->rows : a->n, nq = (r1 - r0) * per;
    const float *kg = a->k_cache + (size_t)g * a->cap * d, *vg = a->v_cache + (size_t)g * a->cap * d;
    const float *qs[MAX_QUERIES];
    float *ps[MAX_QUERIES], *os[MAX_QUERIES];
    const uint8_t *ms[MAX_QUERIES];
    int limits[MAX_QUERIES], prefixes[MAX_QUERIES], lmax = 0, pmin = slots;
    for (int t = 0; t < nq; t++) {
        int r = r0 + t / per, h = g * per + t % per;
        qs[t] = a->q + ((size_t)r * heads + h) * d;
        ps[t] = a->scores + ((size_t)r * heads + h) * slots;
        os[t] = a->out + ((size_t)r * heads + h) * d;
        ms[t] = a->mask ? a->mask + (size_t)r * slots : NULL;
        limits[t] = a->mask ? slots : start + r + 1;
        prefixes[t] = t % per ? prefixes[t - 1] : visible_prefix(ms[t], limits[t]);
        lmax = limits[t] > lmax ? limits[t] : lmax;
        pmin = prefixes[t] < pmin ? prefixes[t] : pmin;
    }
    /* scores for slots 0 .. lmax - 1 (those a query does not see may be computed and are never read; every
     * slot below start + n holds a key of this call or an earlier one): a prompt's many queries on AVX-512 a
     * block of 16 keys at a time (the same bits), then the rest, or everything, 4 keys at a time */
    int j = 0;
    if (nq >= SPECULA_SCORES_MIN_QUERIES && d % 8 == 0 && d <= SPECULA_SCORES_MAX_D && specula_isa())
        j = specula_scores_avx512(qs, nq, kg, d, lmax, limits, ps);
    for (; j + 4 <= lmax; j += 4) {
        const float *kb = kg + (size_t)j * d;
        for (int t = 0; t < nq; t += 3) {
            float s[16];
            int m = nq - t < 3 ? nq - t : 3;
            if (m == 3) dot_block(qs + t, 3, kb, d, s);
            else if (m == 2) dot_block(qs + t, 2, kb, d, s);
            else dot_block(qs + t, 1, kb, d, s);
            for (int k = 0; k < m; k++)
                for (int c = 0; c < 4; c++) ps[t + k][j + c] = s[4 * k + c];
        }
    }
    for (; j < lmax; j++)
        for (int t = 0; t < nq; t++) ps[t][j] = dot(qs[t], kg + (size_t)j * d, d);
    float totals[MAX_QUERIES];
    for (int t = 0; t < nq; t++) {
        totals[t] = softmax_weights(ps[t], ms[t], limits[t], prefixes[t], a->scale);
        for (int i = 0; i < d; i++) os[t][i] = 0.0f;
    }
    /* slots every query sees (0 .. pmin - 1), a block at a time, three queries per value load */
    for (int j0 = 0; j0 < pmin; j0 += SLOT_BLOCK) {
        int j1 = j0 + SLOT_BLOCK < pmin ? j0 + SLOT_BLOCK : pmin;
        for (int t = 0; t < nq; t += 3)
            weigh((const float *const *)ps + t, os + t, nq - t < 3 ? nq - t : 3, vg, d, j0, j1);
    }
    /* then each query's own visible slots from pmin on, in increasing order, a run of them a call */
    for (int t = 0; t < nq; t++) {
        for (j = pmin; j < limits[t];) {
            int e = j;
            while (e < limits[t] && (e < prefixes[t] || ms[t][e])) e++;
            if (e > j) weigh((const float *const *)ps + t, os + t, 1, vg, d, j, e);
            j = e + 1;  /* past the hidden slot that ended the run */
        }
        __m256 inv = _mm256_set1_ps(1.0f / totals[t]);
        for (int i = 0; i < d; i += 8) _mm256_storeu_ps(os[t] + i, _mm256_mul_ps(_mm256_loadu_ps(os[t] + i), inv));
    }
}

void specula_attention(const float *q, const float *k_cache, const float *v_cache, const uint8_t *mask, float *out,
                       float *scores, int n, int heads, int kv_heads, int d, int cap, int slots, int start,
                       float scale, int threads) {
    if (n <= 0) return;  /* no query rows (chunks would be 0: a division by zero) */
    int per = heads / kv_heads, chunks = (2 * threads + kv_heads - 1) / kv_heads;
    if (chunks > n) chunks = n;
    int rows = (n + chunks - 1) / chunks;
    if (rows * per > MAX_QUERIES) rows = MAX_QUERIES / per;
    struct attention_job job = {q, k_cache, v_cache, mask, out, scores, n, heads, per, d, cap, slots, start, rows,
                                scale};
    specula_parallel(threads, kv_heads * ((n + rows - 1) / rows), attention_item, &job);
}

struct silu_args {
    const float *gu;
    float *out;
    int inter;
};

static void silu_mul_rows(const void *args, int r0, int r1) {
    const struct silu_args *a = args;
    const float *gu = a->gu;
    float *out = a->out;
    int inter = a->inter;
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int r = r0; r < r1; r++) {
        const float *g = gu + (size_t)r * 2 * inter, *u = g + inter;
        float *o = out + (size_t)r * inter;
        for (int i = 0; i < inter; i += 8) {
            __m256 gv, uv;
            float gt[8], ut[8], ot[8];
            int full = i + 8 <= inter;
            if (full) {
                gv = _mm256_loadu_ps(g + i);
                uv = _mm256_loadu_ps(u + i);
            } else {
                for (int k = 0; k < 8; k++) gt[k] = i + k < inter ? g[i + k] : 0.0f, ut[k] = i + k < inter ? u[i + k] : 0.0f;
                gv = _mm256_loadu_ps(gt);
                uv = _mm256_loadu_ps(ut);
            }
            __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            __m256 ov = _mm256_mul_ps(sig, uv);
            if (full) {
                _mm256_storeu_ps(o + i, ov);
            } else {
                _mm256_storeu_ps(ot, ov);
                for (int k = 0; i + k < inter; k++) o[i + k] = ot[k];
            }
        }
    }
}

/* out [n, I] = silu(gate) * up for gu [n, 2I] = gate | up (e^-g by `exp8`, element by element). */
void specula_silu_mul(const float *gu, float *out, int n, int inter, int threads) {
    struct silu_args a = {gu, out, inter};
    for_rows(n, threads, silu_mul_rows, &a);
}
