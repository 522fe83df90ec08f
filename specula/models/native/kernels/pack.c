/* Weight packing for linear.c's kernels (layout.h). Its own file because it alone decides the
 * bytes of a prepared entry (`models.prepared` hashes this file and layout.h into the entry's key),
 * so a change to the kernels that read the layout does not invalidate users' prepared models. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "layout.h"

int specula_block(void) { return NB; }

/* Pack w [out, in] into wp: [blocks][in][NB] (float32, `specula_pack_f32`), or for int8 with
 * `quads` [blocks][in4 / 4][NB][4] (in4 = in rounded up to 4); padding columns / inputs are zero. */
void specula_pack_f32(const float *w, float *wp, int in, int out, int threads) {
    int blocks = (out + NB - 1) / NB;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int bk = 0; bk < blocks; bk++) {
        float *dst = wp + (size_t)bk * in * NB;
        for (int c = 0; c < NB; c++) {
            int o = bk * NB + c;
            if (o >= out) {
                for (int i = 0; i < in; i++) dst[(size_t)i * NB + c] = 0.0f;
                continue;
            }
            const float *row = w + (size_t)o * in;
            for (int i = 0; i < in; i++) dst[(size_t)i * NB + c] = row[i];
        }
    }
}

void specula_pack_i8(const int8_t *w, int8_t *wp, int in, int out, int quads, int threads) {
    int blocks = (out + NB - 1) / NB, in4 = quads ? (in + 3) / 4 * 4 : in;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int bk = 0; bk < blocks; bk++) {
        int8_t *dst = wp + (size_t)bk * in4 * NB;
        for (int c = 0; c < NB; c++) {
            int o = bk * NB + c;
            const int8_t *row = w + (size_t)o * in;
            for (int i = 0; i < in4; i++) {
                size_t at = quads ? ((size_t)(i >> 2) * NB + c) * 4 + (i & 3) : (size_t)i * NB + c;
                dst[at] = (o < out && i < in) ? row[i] : 0;
            }
        }
    }
}


/* Pack q [out, in64] (4-bit weights -7..7 as int8, in64 a multiple of I4_GROUP) into wp:
 * [blocks][in64 / 8][NB][4] bytes, byte k of column c at step s = (q[c][8s + k] + 8) |
 * (q[c][8s + 4 + k] + 8) << 4 (linear_i4.c); padding columns hold 8 (a zero weight). */
void specula_pack_i4(const int8_t *q, uint8_t *wp, int in64, int out, int threads) {
    int blocks = (out + NB - 1) / NB, steps = in64 / 8;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int bk = 0; bk < blocks; bk++) {
        uint8_t *dst = wp + (size_t)bk * steps * NB * 4;
        for (int c = 0; c < NB; c++) {
            int o = bk * NB + c;
            const int8_t *row = q + (size_t)o * in64;
            for (int s = 0; s < steps; s++)
                for (int k = 0; k < 4; k++) {
                    int lo = o < out ? row[8 * s + k] + 8 : 8, hi = o < out ? row[8 * s + 4 + k] + 8 : 8;
                    dst[((size_t)s * NB + c) * 4 + k] = (uint8_t)(lo | hi << 4);
                }
        }
    }
}

/* Symmetric quantization in groups of inputs (quantize.py's `quantize_rows` with group = cols and
 * limit 127, `quantize_groups` with limit 7: the same bits): w [rows, cols] -> q [rows, padded]
 * (padded = cols rounded up to `group`; zero columns) and scale [rows, padded / group], each
 * group's scale = max(max_i |w_i| / limit, tiny) and q_i = round-half-even(w_i / scale) clamped to
 * +-limit. One pass per row where the torch expressions made six to eight over the whole matrix
 * (1.8 s of a head's int8 load; most of the 0.5B int4 draft's ~10 s of packing, 2-core machine). */
void specula_quantize_weight_groups(const float *w, int8_t *q, float *scale, int rows, int cols, int group,
                                    float limit, float tiny, int threads) {
    int padded = (cols + group - 1) / group * group, groups = padded / group;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        const float *row = w + (size_t)r * cols;
        int8_t *out = q + (size_t)r * padded;
        for (int g = 0; g < groups; g++) {
            int start = g * group, stop = start + group < cols ? start + group : cols;
            float most = 0.0f;
            for (int i = start; i < stop; i++) {
                float a = fabsf(row[i]);
                most = a > most ? a : most;
            }
            float s = most / limit;
            s = s < tiny ? tiny : s;
            scale[(size_t)r * groups + g] = s;
            for (int i = start; i < start + group; i++) {
                float v = i < stop ? nearbyintf(row[i] / s) : 0.0f;
                out[i] = (int8_t)(v > limit ? limit : v < -limit ? -limit : v);
            }
        }
    }
}

/* Pack c8 codes (linear_codes.c): q [out, in] int8 and per group of `group` inputs A, B [out, in / group]
 * float32 (w = (A * q) + B) into wp: block bk, group g at (bk * groups + g) * (2 NB floats + group NB
 * bytes): A[NB], B[NB], q[group][NB]; padding columns hold A = B = q = 0 (a zero weight). `in` must be a
 * multiple of `group`. */
void specula_pack_codes(const int8_t *q, const float *a, const float *b, uint8_t *wp, int in, int out, int group,
                        int threads) {
    int blocks = (out + NB - 1) / NB, groups = in / group;
    size_t gbytes = C8_GROUP_BYTES(group);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int bk = 0; bk < blocks; bk++)
        for (int g = 0; g < groups; g++) {
            uint8_t *dst = wp + ((size_t)bk * groups + g) * gbytes;
            float *da = (float *)dst, *db = da + NB;
            int8_t *dq = (int8_t *)(db + NB);
            for (int c = 0; c < NB; c++) {
                int o = bk * NB + c;
                da[c] = o < out ? a[(size_t)o * groups + g] : 0.0f;
                db[c] = o < out ? b[(size_t)o * groups + g] : 0.0f;
                for (int i = 0; i < group; i++) dq[i * NB + c] = o < out ? q[(size_t)o * in + g * group + i] : 0;
            }
        }
}
