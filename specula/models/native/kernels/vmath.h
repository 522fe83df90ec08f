/* Vector math shared by the kernels (AVX2 + FMA). */
#ifndef SPECULA_VMATH_H
#define SPECULA_VMATH_H
#include <immintrin.h>
#include <math.h>

/* out = x * rsqrt(mean(x^2) + eps) * w for one row of e floats (the squares summed in 8 lanes,
 * the lanes added in order, the tail after them). */
static inline void rms_norm_row(const float *x, const float *w, float eps, float *out, int e) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= e; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float ss = 0.0f;
    for (int k = 0; k < 8; k++) ss += lanes[k];
    for (; i < e; i++) ss += x[i] * x[i];
    float scale = 1.0f / sqrtf(ss / (float)e + eps);
    for (int j = 0; j < e; j++) out[j] = x[j] * scale * w[j];
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

#endif
