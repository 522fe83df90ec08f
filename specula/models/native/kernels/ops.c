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

static void attention_item(void *arg, int job) {
    const struct attention_job *a = arg;
    const float *q = a->q, *k_cache = a->k_cache, *v_cache = a->v_cache;
    const uint8_t *mask = a->mask;
    float *out = a->out, *scores = a->scores, scale = a->scale;
    int heads = a->heads, per = a->per, d = a->d, cap = a->cap, slots = a->slots, start = a->start;
    int r = job / heads, h = job % heads, g = h / per;
    float *sc = scores + (size_t)job * slots;
    const float *qr = q + ((size_t)r * heads + h) * d;
    const float *kg = k_cache + (size_t)g * cap * d, *vg = v_cache + (size_t)g * cap * d;
    const uint8_t *m = mask ? mask + (size_t)r * slots : NULL;
    int limit = mask ? slots : start + r + 1;
    float best = -INFINITY;
    for (int j = 0; j < limit; j++) {
        if (m && !m[j]) continue;
        sc[j] = dot(qr, kg + (size_t)j * d, d) * scale;
        if (sc[j] > best) best = sc[j];
    }
    float total = 0.0f;
    for (int j = 0; j < limit; j++) {
        if (m && !m[j]) continue;
        sc[j] = expf(sc[j] - best);
        total += sc[j];
    }
    float *o = out + ((size_t)r * heads + h) * d;
    __m256 acc[32];  /* D <= 256 */
    int vecs = d / 8;
    for (int i = 0; i < vecs; i++) acc[i] = _mm256_setzero_ps();
    for (int j = 0; j < limit; j++) {
        if (m && !m[j]) continue;
        __m256 p = _mm256_set1_ps(sc[j]);
        const float *vj = vg + (size_t)j * d;
        for (int i = 0; i < vecs; i++) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * i), acc[i]);
    }
    float inv = 1.0f / total;
    for (int i = 0; i < vecs; i++) _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(acc[i], _mm256_set1_ps(inv)));
}

void specula_attention(const float *q, const float *k_cache, const float *v_cache, const uint8_t *mask, float *out,
                       float *scores, int n, int heads, int kv_heads, int d, int cap, int slots, int start,
                       float scale, int threads) {
    struct attention_job job = {q, k_cache, v_cache, mask, out, scores, heads, heads / kv_heads, d, cap, slots,
                                start, scale};
    specula_parallel(threads, n * heads, attention_item, &job);
}

/* out [n, I] = silu(gate) * up for gu [n, 2I] = gate | up. */
void specula_silu_mul(const float *gu, float *out, int n, int inter) {
    for (int r = 0; r < n; r++) {
        const float *g = gu + (size_t)r * 2 * inter, *u = g + inter;
        float *o = out + (size_t)r * inter;
        for (int i = 0; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
