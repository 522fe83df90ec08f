/* The packed weight layout shared by pack.c (which writes it, once per model: prepared entries
 * keep its output, keyed by a hash of pack.c and this file) and linear.c (which reads it). */
#ifndef SPECULA_LAYOUT_H
#define SPECULA_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#define NB 16  /* outputs per column block */
#define I4_GROUP 64  /* i4: inputs per scale group (linear_i4.c) */

/* c8 (linear_codes.c): bytes of one column block's group of `group` inputs: a[NB], b[NB] float32, then
 * q[group][NB] int8; block bk, group g at (bk * (in / group) + g) * C8_GROUP_BYTES(group). */
#define C8_GROUP_BYTES(group) ((size_t)2 * NB * sizeof(float) + (size_t)(group) * NB)

/* c8's weight from its code: (a * q) + b, two float32 roundings (FLAGS' -ffp-contract=off), the bits a
 * GGUF block dequantises to (gguf.c). */
static inline float c8_weight(float a, int8_t q, float b) {
    float p = a * (float)q;
    return p + b;
}

#endif
