/* An exact greedy argmax of a float32 output layer through a cheap int8 pass (`native/screen.py`):
 * the int8 copy of the layer's packed weights, and the candidates the cheap pass leaves per row. */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "layout.h"
#include "pool.h"

/* An int8 copy of f32 packed weights (layout.h: [blocks][in][NB]) in the i8 kernels' layout with `quads`
 * ([blocks][in4 / 4][NB][4], in4 = in rounded up to 4, the padding zero), else in w8's ([blocks][in][NB], the
 * f32 layout's indices): each output column's scale = max(max_i |w_i| / 127, tiny), q_i =
 * round-half-even(w_i / scale) clamped to +-127 (quantize.py's rule, so
 * |w_i - scale q_i| <= scale / 2 up to the quotient's rounding), and w1 = sum_i |w_i| (in double: the bound
 * on what the rows' own int8 rounding moves a logit, `native/screen.py`). `scale` and `w1` get blocks * NB
 * values (padding columns: zero weights, scale `tiny`). Read straight from the packed layer: no [out, in]
 * float copy of a 890 MiB output layer. */
void specula_screen_pack(const float *wp, int8_t *qp, float *scale, double *w1, int in, int out, float tiny,
                         int quads, int threads) {
    int blocks = (out + NB - 1) / NB, in4 = quads ? (in + 3) / 4 * 4 : in;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int bk = 0; bk < blocks; bk++) {
        const float *src = wp + (size_t)bk * in * NB;
        int8_t *dst = qp + (size_t)bk * in4 * NB;
        float most[NB], s[NB];
        double sum[NB];
        for (int c = 0; c < NB; c++) most[c] = 0.0f, sum[c] = 0.0;
        for (int i = 0; i < in; i++)
            for (int c = 0; c < NB; c++) {
                float a = fabsf(src[(size_t)i * NB + c]);
                most[c] = a > most[c] ? a : most[c];
                sum[c] += a;
            }
        for (int c = 0; c < NB; c++) {
            s[c] = most[c] / 127.0f;
            s[c] = s[c] < tiny ? tiny : s[c];
            scale[(size_t)bk * NB + c] = s[c];
            w1[(size_t)bk * NB + c] = sum[c];
        }
        for (int i = 0; i < in4; i++)
            for (int c = 0; c < NB; c++) {
                size_t at = quads ? ((size_t)(i >> 2) * NB + c) * 4 + (i & 3) : (size_t)i * NB + c;
                if (i >= in) {
                    dst[at] = 0;
                    continue;
                }
                float v = nearbyintf(src[(size_t)i * NB + c] / s[c]);
                dst[at] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
            }
    }
}

/* The ids where row r's exact maximum can be, for each of n rows of approx [n, vocab] (the int8 pass's
 * logits): with bound_v = slack[v] * l1[r] + hw1[v] * xs[r] + 2^-20 |approx[r, v]| the most approx[r, v] can
 * differ from the exact logit (`native/screen.py`), every v whose upper end approx + bound reaches the
 * largest lower end approx - bound. The exact maximum (every id holding it) is among them. With `allowed`
 * ([n][vocab] 0 / 1, a grammar's mask) only allowed ids count, as lower ends and as candidates: the masked maximum's.
 * They go ascending to ids[r * cap ...]; counts[r] = how many (past cap: only counted), or -1 where
 * a value or a bound is not finite, or nothing is allowed (the caller computes that row's logits
 * whole). Rows are spread over the pool from 4 rows on. */
struct candidate_args {
    const float *approx, *slack, *l1, *hw1, *xs;
    const uint8_t *allowed;  /* [n][vocab] 0 / 1, or NULL: every id */
    int vocab, cap;
    int32_t *ids, *counts;
};

/* Lanes v .. v + 7 of a row's `allowed` as a float mask (all ones where allowed), or all ones. */
static inline __m256 allowed8(const uint8_t *allowed, int v) {
    if (!allowed) return _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(allowed + v)));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(bytes, _mm256_setzero_si256()));
}

/* The bound of lanes v .. v + 7 of a row: slack * l1 + hw1 * xs + 2^-20 |a|. */
static inline __m256 bound8(const float *a, const float *slack, __m256 l1, const float *hw1, __m256 xs) {
    __m256 mag = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(a));
    __m256 b = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(slack), l1), _mm256_mul_ps(_mm256_loadu_ps(hw1), xs));
    return _mm256_add_ps(b, _mm256_mul_ps(mag, _mm256_set1_ps(0x1p-20f)));
}

static inline float bound1(float a, float slack, float l1, float hw1, float xs) {
    return slack * l1 + hw1 * xs + fabsf(a) * 0x1p-20f;
}

static void candidate_rows(const void *args, int r0, int r1) {
    const struct candidate_args *p = args;
    int vocab = p->vocab, whole = vocab / 8 * 8;
    for (int r = r0; r < r1; r++) {
        const float *a = p->approx + (size_t)r * vocab;
        const uint8_t *ok = p->allowed ? p->allowed + (size_t)r * vocab : NULL;
        float scale = p->l1[r], xs = p->xs[r];
        __m256 xs8 = _mm256_set1_ps(xs), s8 = _mm256_set1_ps(scale);
        __m256 low8 = _mm256_set1_ps(-FLT_MAX), big8 = _mm256_setzero_ps();
        __m256 sign = _mm256_set1_ps(-0.0f);
        for (int v = 0; v < whole; v += 8) {
            __m256 x = _mm256_loadu_ps(a + v), b = bound8(a + v, p->slack + v, s8, p->hw1 + v, xs8);
            __m256 low = _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), _mm256_sub_ps(x, b), allowed8(ok, v));
            low8 = _mm256_max_ps(low8, low);  /* a NaN is caught by `big` below */
            big8 = _mm256_max_ps(big8, _mm256_max_ps(_mm256_andnot_ps(sign, x), b));
            big8 = _mm256_or_ps(big8, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  /* NaN lanes -> all ones (a NaN) */
        }
        float lows[8], bigs[8], lower = -FLT_MAX, big = 0.0f;
        _mm256_storeu_ps(lows, low8);
        _mm256_storeu_ps(bigs, big8);
        int finite = isfinite(scale) && isfinite(xs);
        for (int i = 0; i < 8; i++) {
            lower = lows[i] > lower ? lows[i] : lower;
            if (!(bigs[i] <= 1e30f)) finite = 0;
        }
        for (int v = whole; v < vocab; v++) {
            float b = bound1(a[v], p->slack[v], scale, p->hw1[v], xs), low = a[v] - b;
            if (!ok || ok[v]) lower = low > lower ? low : lower;
            if (!(fabsf(a[v]) <= 1e30f) || !(b <= 1e30f)) finite = 0;
        }
        if (!finite || !(lower > -FLT_MAX) || !isfinite(lower)) {  /* -FLT_MAX: nothing allowed */
            p->counts[r] = -1;
            continue;
        }
        int k = 0, cap = p->cap;
        int32_t *out = p->ids + (size_t)r * cap;
        __m256 lower8 = _mm256_set1_ps(lower);
        for (int v = 0; v < whole; v += 8) {
            __m256 b = bound8(a + v, p->slack + v, s8, p->hw1 + v, xs8), up = _mm256_add_ps(_mm256_loadu_ps(a + v), b);
            unsigned mask = (unsigned)_mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(up, lower8, _CMP_GE_OQ),
                                                                       allowed8(ok, v)));
            while (mask) {
                int bit = __builtin_ctz(mask);
                if (k < cap) out[k] = v + bit;
                k++;
                mask &= mask - 1;
            }
        }
        for (int v = whole; v < vocab; v++) {
            if ((!ok || ok[v]) && a[v] + bound1(a[v], p->slack[v], scale, p->hw1[v], xs) >= lower) {
                if (k < cap) out[k] = v;
                k++;
            }
        }
        p->counts[r] = k;
    }
}

void specula_screen_candidates(const float *approx, const float *slack, const float *l1, const float *hw1,
                               const float *xs, const uint8_t *allowed, int n, int vocab, int32_t *ids, int cap,
                               int32_t *counts, int threads) {
    struct candidate_args args = {approx, slack, l1, hw1, xs, allowed, vocab, cap, ids, counts};
    if (threads < 2 || n < 4)
        candidate_rows(&args, 0, n);
    else
        specula_parallel_rows(threads, n, (n + 1) / 2, candidate_rows, &args);
}

void specula_quantize_rows(const float *x, int8_t *xq, float *xs, int32_t *xsum, int M, int in, int in4, int offset,
                           int threads);  /* linear.c */

/* The i8 screen's rows and terms of rows x [n][in] (`native/screen.py`'s `screen_rows`), in one call where torch
 * took a dozen small ops a step: `both` [2n][in] gets each row and then each row's residual d = x - xs q (q, xs:
 * `specula_quantize_rows`'s codes and scale of the row, in float32: the product rounded, then the difference,
 * as torch computes `x - xs * q`); `xs` [n] the scales; `step` [n] xs' = max_j |d_j| / 127 + xs 2^-21 (float32;
 * a NaN in d gives a NaN); `l1` [n] L = (sum_j |x_j| + in xs' half_room) (1 + 2^-20) in double, then rounded
 * to float32 (not finite where the row is not). Returns -1 where the codes' buffer could not be allocated. */
int specula_screen_rows(const float *x, float *both, float *xs, float *l1, float *step, int n, int in,
                        double half_room) {
    int in4 = (in + 3) / 4 * 4;
    int8_t *q = malloc((size_t)n * in4);
    if (!q) return -1;
    specula_quantize_rows(x, q, xs, NULL, n, in, in4, 0, 1);
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * in;
        const int8_t *qr = q + (size_t)r * in4;
        float *own = both + (size_t)r * in, *d = both + (size_t)(n + r) * in, s = xs[r], most = 0.0f;
        double sum = 0.0;
        for (int j = 0; j < in; j++) {
            float code = s * (float)qr[j];
            d[j] = xr[j] - code;
            own[j] = xr[j];
            float a = fabsf(d[j]);
            if (most == most && !(a <= most)) most = a;  /* a NaN stays */
            sum += fabs((double)xr[j]);
        }
        step[r] = most / 127.0f + s * 0x1p-21f;
        l1[r] = (float)((sum + (double)in * (double)step[r] * half_room) * (1.0 + 0x1p-20));
    }
    free(q);
    return 0;
}

/* y[r] += y[n + r] for rows r < n of y [2n][vocab]: the i8 screen's two rows' logits added in C (torch's add of a
 * SmolLM2 row woke OpenMP's sleeping workers: 0.29 ms a step, `docs/native.md`). */
struct halves_args {
    float *y;
    int n, vocab;
};

static void add_halves(const void *args, int r0, int r1) {
    const struct halves_args *a = args;
    for (int r = r0; r < r1; r++) {
        float *y = a->y + (size_t)r * a->vocab;
        const float *z = a->y + (size_t)(a->n + r) * a->vocab;
        for (int v = 0; v < a->vocab; v++) y[v] += z[v];
    }
}

void specula_screen_add_halves(float *y, int n, int vocab, int threads) {
    struct halves_args args = {y, n, vocab};
    if (threads < 2 || n < 4)
        add_halves(&args, 0, n);
    else
        specula_parallel_rows(threads, n, (n + 1) / 2, add_halves, &args);
}

float specula_kth_largest(const float *row, int v, int k, float *vals, int64_t *ids);  /* draft.c */

void specula_screen_exact(const float *packed, const float *x, const int32_t *ids, const int32_t *counts, int n,
                          int cap, int in, float *y);

/* Each row's exact argmax (`OutputScreen._decide`) in one call, where its torch glue took 0.15 ms of a SmolLM2
 * step: the candidates (`specula_screen_candidates`); a row's lone candidate is its argmax; of 2 .. cap, the
 * first maximal of their float32 logits (`specula_screen_exact`'s sums; ids ascending, so torch's argmax: a NaN
 * counts as the maximum, the first one taken); -1 for a row the screen cannot decide (a value or bound not finite,
 * nothing allowed, more than cap candidates), which the caller computes whole. x [n][in] the rows' states, packed
 * the float32 layer. Returns how many rows had their candidates' float32 logits computed (a lone candidate needs
 * none), -1 where its scratch could not be allocated. */
int specula_screen_decide(const float *approx, const float *slack, const float *l1, const float *hw1, const float *xs,
                          const uint8_t *allowed, int n, int vocab, int cap, const float *packed, const float *x,
                          int in, int64_t *out, int threads) {
    int32_t *ids = malloc((size_t)n * cap * sizeof(int32_t)), *counts = malloc((size_t)n * sizeof(int32_t));
    float *y = malloc((size_t)cap * sizeof(float));
    if (!ids || !counts || !y) {
        free(ids);
        free(counts);
        free(y);
        return -1;
    }
    specula_screen_candidates(approx, slack, l1, hw1, xs, allowed, n, vocab, ids, cap, counts, threads);
    int computed = 0;
    for (int r = 0; r < n; r++) {
        const int32_t *rid = ids + (size_t)r * cap;
        int k = counts[r], best = 0;
        if (k < 1 || k > cap) {
            out[r] = -1;
            continue;
        }
        if (k > 1) {
            specula_screen_exact(packed, x + (size_t)r * in, rid, counts + r, 1, cap, in, y);
            computed++;
            for (int c = 1; c < k && y[best] == y[best]; c++)
                if (y[c] != y[c] || y[c] > y[best]) best = c;
        }
        out[r] = rid[best];
    }
    free(ids);
    free(counts);
    free(y);
    return computed;
}


/* The ids a truncated sample of one row can keep, as `OutputScreen.edited_top` finds them with no change to the
 * row (`native/screen.py`; each step in its float32 arithmetic and order, so the ids, values and bounds are the
 * same): for each id v the interval approx[v] -+ bound_v, bound_v = (slack[v] * l1 + hw1[v] * xs) + |approx[v]|
 * 2^-18 (l1, xs: the row's terms, already rounded up), both ends -inf where `allowed` (0 / 1 [vocab], or NULL)
 * masks v; the floor max(k-th largest lower end (0 < top_k < vocab, else -inf), largest lower end - within),
 * rounded to float32 as torch compares it; the candidates, every id whose upper end reaches the floor and is not
 * -inf, ascending into ids [cap]. lower and upper [vocab] keep the other ids' ends, -inf at the candidates (what
 * top-p over every id bounds the rest with). kth_vals [top_k], kth_ids [top_k]: scratch for the k-th largest.
 * Returns how many candidates (past cap: only counted), or -1 where an end is not finite (or past 1e30) or every
 * id is masked: the caller computes the row whole. */
int specula_screen_top(const float *approx, const float *slack, const float *hw1, float l1, float xs,
                       const uint8_t *allowed, int vocab, int top_k, double within, int32_t *ids, int cap,
                       float *lower, float *upper, float *kth_vals, int64_t *kth_ids) {
    const float room = 0x1p-18f;
    float best = -INFINITY;
    for (int v = 0; v < vocab; v++) {
        float a = approx[v], b = (slack[v] * l1 + hw1[v] * xs) + fabsf(a) * room;
        if (!(fabsf(a) <= 1e30f) || !(b <= 1e30f)) return -1;  /* NaN fails both */
        float lo = a - b, hi = a + b;
        if (allowed && !allowed[v]) lo = hi = -INFINITY;
        lower[v] = lo;
        upper[v] = hi;
        best = lo > best ? lo : best;
    }
    if (best == -INFINITY) return -1;  /* every id masked */
    double floor = (double)best - within;
    if (top_k > 0 && top_k < vocab) {
        double kth = (double)specula_kth_largest(lower, vocab, top_k, kth_vals, kth_ids);
        floor = kth > floor ? kth : floor;
    }
    float cut = (float)floor;
    int k = 0;
    for (int v = 0; v < vocab; v++) {
        float hi = upper[v];
        if (hi >= cut && hi > -INFINITY) {
            if (k < cap) ids[k] = v;
            k++;
            lower[v] = upper[v] = -INFINITY;
        }
    }
    return k;
}

/* Each screened row's candidates' float32 logits, bit for bit the f32 kernels' outputs: for row r and
 * c < counts[r], y[r * cap + c] = the FMA chain over i = 0, 1, ... from +0 of w[v][i] x[r][i], v = ids[r * cap
 * + c], as every f32 item computes each output (layout.h's f32 layout [blocks][in][NB]: w[v][i] at
 * packed[(v / NB) * in * NB + i * NB + v % NB]; the output layer has no bias). A row with counts[r] < 1 (-1:
 * computed whole) is left as it is. What `OutputScreen` reads instead of cutting the candidates' rows out
 * into a layer of their own (its `_decide` on SmolLM2's tree passes, about 18 ids: 0.53 -> 0.20 ms). */
#define EXACT_CHAINS 8  /* candidates whose FMA chains run side by side (each one's own order kept) */
void specula_screen_exact(const float *packed, const float *x, const int32_t *ids, const int32_t *counts, int n,
                          int cap, int in, float *y) {
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * in;
        const int32_t *rid = ids + (size_t)r * cap;
        int k = counts[r] < cap ? counts[r] : cap, c = 0;
        for (; c + EXACT_CHAINS <= k; c += EXACT_CHAINS) {  /* chains side by side: latency hidden */
            const float *w[EXACT_CHAINS];
            float acc[EXACT_CHAINS];
            for (int j = 0; j < EXACT_CHAINS; j++) {
                w[j] = packed + (size_t)(rid[c + j] / NB) * in * NB + rid[c + j] % NB;
                acc[j] = 0.0f;
            }
            for (int i = 0; i < in; i++)
                for (int j = 0; j < EXACT_CHAINS; j++) acc[j] = fmaf(w[j][(size_t)i * NB], xr[i], acc[j]);
            for (int j = 0; j < EXACT_CHAINS; j++) y[(size_t)r * cap + c + j] = acc[j];
        }
        for (; c < k; c++) {
            const float *w = packed + (size_t)(rid[c] / NB) * in * NB + rid[c] % NB;
            float acc = 0.0f;
            for (int i = 0; i < in; i++) acc = fmaf(w[(size_t)i * NB], xr[i], acc);
            y[(size_t)r * cap + c] = acc;
        }
    }
}
