/* The packed weight layout shared by pack.c (which writes it, once per model: prepared entries
 * keep its output, keyed by a hash of pack.c and this file) and linear.c (which reads it). */
#ifndef SPECULA_LAYOUT_H
#define SPECULA_LAYOUT_H

#define NB 16  /* outputs per column block */
#define I4_GROUP 64  /* i4: inputs per scale group (linear_i4.c) */

#endif
