/* The kernels' thread pool (pool.c), declared once for every file that runs work on it. */
#ifndef SPECULA_POOL_H
#define SPECULA_POOL_H

typedef void (*specula_item_fn)(void *ctx, int item);
typedef void (*specula_rows_fn)(const void *args, int r0, int r1);

/* fn(ctx, item) for items 0 .. items - 1, spread over up to `threads` threads. */
void specula_parallel(int threads, int items, specula_item_fn fn, void *ctx);

/* fn(args, r0, r1) over rows 0 .. n - 1 in items of `per_item` rows (the last may hold fewer). */
void specula_parallel_rows(int threads, int n, int per_item, specula_rows_fn fn, const void *args);

#endif
