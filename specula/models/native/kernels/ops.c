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

void specula_parallel(int threads, int items, void (*fn)(void *ctx, int item), void *ctx);  /* pool.c */

/* x += delta (when given), then out = x * rsqrt(mean(x^2) + eps) * w, row by row. */
void specula_add_rms_norm(float *x, const float *delta, const float *w, float eps, float *out, int n, int e) {
    for (int r = 0; r < n; r++) {
        float *xr = x + (size_t)r * e;
        if (delta) {
            const float *dr = delta + (size_t)r * e;
            for (int i = 0; i < e; i++) xr[i] += dr[i];
        }
        __m256 acc = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= e; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        float ss = 0.0f;
        for (int k = 0; k < 8; k++) ss += lanes[k];
        for (; i < e; i++) ss += xr[i] * xr[i];
        float scale = 1.0f / sqrtf(ss / (float)e + eps);
        float *orow = out + (size_t)r * e;
        for (int j = 0; j < e; j++) orow[j] = xr[j] * scale * w[j];
    }
}

/* Rotate the q and k heads of each row by (cos, sin) [n, D / 2] of the row's position, write q to
 * q_out [n, H, D], and k, v to slots start + r of the layer's caches [G, cap, D]. */
void specula_rope_write(const float *qkv, const float *cos_, const float *sin_, float *q_out, float *k_cache,
                        float *v_cache, int n, int heads, int kv_heads, int d, int cap, int start) {
    int half = d / 2, width = (heads + 2 * kv_heads) * d;
    for (int r = 0; r < n; r++) {
        const float *row = qkv + (size_t)r * width;
        const float *c = cos_ + (size_t)r * half, *s = sin_ + (size_t)r * half;
        for (int h = 0; h < heads + kv_heads; h++) {
            const float *src = row + (size_t)h * d;
            float *dst = h < heads ? q_out + ((size_t)r * heads + h) * d
                                   : k_cache + ((size_t)(h - heads) * cap + start + r) * d;
            for (int j = 0; j < half; j++) {
                float a = src[2 * j], b = src[2 * j + 1];
                dst[2 * j] = a * c[j] - b * s[j];
                dst[2 * j + 1] = a * s[j] + b * c[j];
            }
        }
        for (int g = 0; g < kv_heads; g++) {
            const float *src = row + (size_t)(heads + kv_heads + g) * d;
            float *dst = v_cache + ((size_t)g * cap + start + r) * d;
            for (int j = 0; j < d; j++) dst[j] = src[j];
        }
    }
}

static inline float dot(const float *a, const float *b, int d) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float s = 0.0f;
    for (int k = 0; k < 8; k++) s += lanes[k];
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

/* e^x in each lane (Cephes' expf: range reduction by ln 2 in two parts, a degree-5 polynomial, the
 * exponent added as bits; within 2 ulp for x in [-87, 88], clamped outside). One vector function for
 * every element (tails are padded, never computed by other code), so a value's bits depend on the
 * value alone, not on its position or its neighbours: rows stay bitwise one-token steps. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
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

/* out[k] = dot(a, b + k * d, d) for the 8 rows b .. b + 7d (d a multiple of 8), each computed with
 * `dot`'s arithmetic exactly (the same 8-lane FMA chain over i, then lanes 0..7 added in order), so a
 * slot's score does not depend on which slots are computed beside it. */
static inline void dot8(const float *a, const float *b, int d, float *out) {
    __m256 acc[8];
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
        __m256 av = _mm256_loadu_ps(a + i);
        for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(av, _mm256_loadu_ps(b + (size_t)k * d + i), acc[k]);
    }
    /* transpose: lanes[l] holds lane l of every slot's accumulator */
    __m256 t0 = _mm256_unpacklo_ps(acc[0], acc[1]), t1 = _mm256_unpackhi_ps(acc[0], acc[1]);
    __m256 t2 = _mm256_unpacklo_ps(acc[2], acc[3]), t3 = _mm256_unpackhi_ps(acc[2], acc[3]);
    __m256 t4 = _mm256_unpacklo_ps(acc[4], acc[5]), t5 = _mm256_unpackhi_ps(acc[4], acc[5]);
    __m256 t6 = _mm256_unpacklo_ps(acc[6], acc[7]), t7 = _mm256_unpackhi_ps(acc[6], acc[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    __m256 lanes[8] = {
        _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
        _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
        _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
        _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
    __m256 s = _mm256_setzero_ps();
    for (int l = 0; l < 8; l++) s = _mm256_add_ps(s, lanes[l]);
    _mm256_storeu_ps(out, s);
}

/* out [n, H, D]: for row r and head h (KV group h / (H / G)), softmax over the slots the row may see
 * of q . k * scale, times v. Visible slots: mask [n, slots] (nonzero = visible) or, without a
 * mask, slots 0 .. start + r (causal). scores: scratch [n * H, slots]. Items of `specula_parallel`:
 * one (row, head) each. */
struct attention_job {
    const float *q, *k_cache, *v_cache;
    const uint8_t *mask;
    float *out, *scores;
    int heads, per, d, cap, slots, start;
    float scale;
};

#define SLOT_BLOCK 32  /* slots whose values stay in L1 while every head of the group reads them */

/* One row r and KV group g: the `per` query heads of the group read each block of keys and values
 * once between them (from L1), where one head an item read the group's whole cache `per` times.
 * Each head's arithmetic is what it was alone: dot8 / dot per slot, its own exp and total, and its
 * value sum over the visible slots in increasing order (the accumulators kept in `out` between
 * blocks), so the bits do not change with the grouping. */
static void attention_item(void *arg, int job) {
    const struct attention_job *a = arg;
    const float *q = a->q, *k_cache = a->k_cache, *v_cache = a->v_cache;
    const uint8_t *mask = a->mask;
    float *out = a->out, *scores = a->scores, scale = a->scale;
    int heads = a->heads, per = a->per, d = a->d, cap = a->cap, slots = a->slots, start = a->start;
    int kv_heads = heads / per, r = job / kv_heads, g = job % kv_heads, h0 = g * per;
    const float *kg = k_cache + (size_t)g * cap * d, *vg = v_cache + (size_t)g * cap * d;
    const uint8_t *m = mask ? mask + (size_t)r * slots : NULL;
    int limit = mask ? slots : start + r + 1, j = 0, vecs = d / 8;
    /* scores [per][slots] of this row's heads h0 .. h0 + per - 1 */
    float *sc0 = scores + ((size_t)r * heads + h0) * slots;
    const float *q0 = q + ((size_t)r * heads + h0) * d;
    /* q . k for every slot below limit, 8 at a time (masked slots too: their scores are never read);
     * d is a multiple of 8 (checked where the kernels are configured, `models.native.configure`) */
    for (; j + 8 <= limit; j += 8)
        for (int hh = 0; hh < per; hh++) dot8(q0 + (size_t)hh * d, kg + (size_t)j * d, d, sc0 + (size_t)hh * slots + j);
    for (; j < limit; j++)
        for (int hh = 0; hh < per; hh++) sc0[(size_t)hh * slots + j] = dot(q0 + (size_t)hh * d, kg + (size_t)j * d, d);
    float totals[64];  /* per <= 64 */
    for (int hh = 0; hh < per; hh++) {
        float *sc = sc0 + (size_t)hh * slots, best = -INFINITY, total = 0.0f;
        for (j = 0; j < limit; j++) {
            if (m && !m[j]) continue;
            sc[j] *= scale;
            if (sc[j] > best) best = sc[j];
        }
        exp_shifted(sc, limit, best);
        for (j = 0; j < limit; j++)
            if (!m || m[j]) total += sc[j];
        totals[hh] = total;
        float *o = out + ((size_t)r * heads + h0 + hh) * d;
        for (int i = 0; i < d; i++) o[i] = 0.0f;
    }
    for (int j0 = 0; j0 < limit; j0 += SLOT_BLOCK) {
        int j1 = j0 + SLOT_BLOCK < limit ? j0 + SLOT_BLOCK : limit;
        for (int hh = 0; hh < per; hh++) {
            const float *sc = sc0 + (size_t)hh * slots;
            float *o = out + ((size_t)r * heads + h0 + hh) * d;
            __m256 acc[32];  /* D <= 256 */
            for (int i = 0; i < vecs; i++) acc[i] = _mm256_loadu_ps(o + 8 * i);
            for (j = j0; j < j1; j++) {
                if (m && !m[j]) continue;
                __m256 p = _mm256_set1_ps(sc[j]);
                const float *vj = vg + (size_t)j * d;
                for (int i = 0; i < vecs; i++) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * i), acc[i]);
            }
            for (int i = 0; i < vecs; i++) _mm256_storeu_ps(o + 8 * i, acc[i]);
        }
    }
    for (int hh = 0; hh < per; hh++) {
        float *o = out + ((size_t)r * heads + h0 + hh) * d;
        __m256 inv = _mm256_set1_ps(1.0f / totals[hh]);
        for (int i = 0; i < vecs; i++) _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(o + 8 * i), inv));
    }
}

void specula_attention(const float *q, const float *k_cache, const float *v_cache, const uint8_t *mask, float *out,
                       float *scores, int n, int heads, int kv_heads, int d, int cap, int slots, int start,
                       float scale, int threads) {
    struct attention_job job = {q, k_cache, v_cache, mask, out, scores, heads, heads / kv_heads, d, cap, slots,
                                start, scale};
    specula_parallel(threads, n * kv_heads, attention_item, &job);
}

/* out [n, I] = silu(gate) * up for gu [n, 2I] = gate | up (e^-g by `exp8`, element by element). */
void specula_silu_mul(const float *gu, float *out, int n, int inter) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int r = 0; r < n; r++) {
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
