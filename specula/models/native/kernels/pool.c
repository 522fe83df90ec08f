/* A parallel-for for the decoding kernels that a busy machine cannot stall.
 *
 * Why not OpenMP: an `omp parallel for` ends in a barrier every thread of the team must reach.
 * When another process holds a core, the team thread the scheduler put there runs only when that
 * core gives it a time slice, and every kernel call (a SmolLM2 step makes ~150) waits for it: on
 * the 2-core development machine, with one other CPU-bound process, a SmolLM2 step took 48 ms to
 * 1.2 s with two OpenMP threads against 31 ms with one (21.7 ms quiet, two threads).
 *
 * Here the calling thread works too and takes items (column blocks, attention rows) from a shared
 * counter, as do the pool's workers; the caller waits only for items a worker has *claimed*, never
 * for a worker to wake up. A worker that the scheduler keeps off the CPU claims nothing and costs
 * nothing; the caller then does every item itself (one thread's speed, not a stall).
 *
 * Which thread computes an item never changes its result: each item is computed by the same code
 * in the same order, so the kernels stay bitwise row invariant.
 *
 * Items are claimed in contiguous chunks (about 4 per thread: a few atomics per call, and weight
 * blocks streamed in order). Protocol: `next` packs (generation << 32 | next unclaimed item). A
 * job is published by writing its descriptor, then `next` = (gen, 0), then `posted` = gen (the
 * workers' futex word). A worker claims items k .. by a compare-exchange on `next` that succeeds
 * only while the generation is still gen and k < items, so it never takes an item of a later job,
 * and a job cannot end (nor its descriptor change) while a claimed item is unfinished. When every
 * item is done the caller closes the generation (next = (gen, UINT32_MAX)) before it writes
 * another descriptor, so a claim that succeeds was made while the descriptor the worker read
 * (after seeing `posted` = gen) was that job's, item count included. Calls from several threads at
 * once are not shared: a call that finds the pool busy runs alone (serially). After fork() the
 * child starts without workers (pthread_atfork).
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "pool.h"

#define MAX_WORKERS 63
#define WORKER_SPINS 20000   /* pause loops (~0.5 ms) a worker polls for the next call, then sleeps on the futex */
#define CALLER_SPINS 2000    /* pause loops before the caller yields its core while a claimed item runs */
#define CHUNKS_PER_THREAD 4  /* claims per thread and call (see chunk_size) */

static _Atomic uint64_t next_item;           /* (gen << 32) | next unclaimed item */
static _Atomic uint32_t posted;              /* the last generation published (futex word) */
static _Atomic int done_items;               /* items finished in the current generation */
static _Atomic int sleepers;                 /* workers blocked on the futex */
static _Atomic int busy;                     /* a call owns the pool */
static _Atomic(specula_item_fn) job_fn;
static _Atomic(void *) job_ctx;
static _Atomic int job_items;
static _Atomic int job_chunk;
static _Atomic int job_helpers;              /* workers 0 .. job_helpers - 1 take part */
static int workers;                          /* started (guarded by start_lock) */
static uint32_t generation;                  /* owned by the call holding `busy` */
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static int atfork_set;

static long futex(_Atomic uint32_t *word, int op, uint32_t value) {
    return syscall(SYS_futex, (uint32_t *)word, op, value, NULL, NULL, 0);
}

/* Claim the next `chunk` items (fewer at the end) of job `gen`: returns the first, or -1 when the
 * job is over or has none left; *count gets how many. */
static int claim(uint32_t gen, int items, int chunk, int *count) {
    uint64_t v = atomic_load_explicit(&next_item, memory_order_acquire);
    for (;;) {
        uint32_t k = (uint32_t)v;
        if ((uint32_t)(v >> 32) != gen || k >= (uint32_t)items) return -1;
        uint32_t n = (uint32_t)items - k < (uint32_t)chunk ? (uint32_t)items - k : (uint32_t)chunk;
        if (atomic_compare_exchange_weak_explicit(&next_item, &v, v + n, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            *count = (int)n;
            return (int)k;
        }
    }
}

/* Items per claim: contiguous runs (the weight blocks stream in order, as with a static split),
 * about CHUNKS_PER_THREAD per thread, so a call costs a handful of atomics, not one per block. */
static int chunk_size(int items, int threads) {
    int chunk = items / (threads * CHUNKS_PER_THREAD);
    return chunk > 0 ? chunk : 1;
}

static void run_items(uint32_t gen, specula_item_fn fn, void *ctx, int items, int chunk) {
    int first, count, n = 0;
    while ((first = claim(gen, items, chunk, &count)) >= 0) {
        for (int k = first; k < first + count; k++) fn(ctx, k);
        n += count;
    }
    if (n) atomic_fetch_add_explicit(&done_items, n, memory_order_release);
}

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&posted);
    for (;;) {
        uint32_t gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&posted, memory_order_acquire)) == seen) {
            if (++spins < WORKER_SPINS) {
                _mm_pause();
                continue;
            }
            atomic_fetch_add(&sleepers, 1);  /* seq_cst: pairs with the caller's posted store + sleepers load */
            if (atomic_load(&posted) == seen) futex(&posted, FUTEX_WAIT_PRIVATE, seen);
            atomic_fetch_sub(&sleepers, 1);
            spins = 0;
        }
        seen = gen;
        if (id >= atomic_load_explicit(&job_helpers, memory_order_relaxed)) continue;
        specula_item_fn fn = atomic_load_explicit(&job_fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&job_ctx, memory_order_relaxed);
        int items = atomic_load_explicit(&job_items, memory_order_relaxed);
        int chunk = atomic_load_explicit(&job_chunk, memory_order_relaxed);
        run_items(gen, fn, ctx, items, chunk);  /* claims nothing if the job `gen` is over */
    }
    return NULL;
}

static void reset_after_fork(void) {
    workers = 0;
    atomic_store(&busy, 0);
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&start_lock, NULL);
}

static int ensure_workers(int wanted) {
    if (wanted > MAX_WORKERS) wanted = MAX_WORKERS;
    if (workers >= wanted) return wanted;
    pthread_mutex_lock(&start_lock);
    if (!atfork_set) {
        pthread_atfork(NULL, NULL, reset_after_fork);
        atfork_set = 1;
    }
    while (workers < wanted) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)workers);
        pthread_attr_destroy(&attr);
        if (failed) break;
        workers++;
    }
    int have = workers;
    pthread_mutex_unlock(&start_lock);
    return have < wanted ? have : wanted;
}

/* fn(ctx, item) for item = 0 .. items - 1 on up to `threads` threads (the caller one of them). */
void specula_parallel(int threads, int items, specula_item_fn fn, void *ctx) {
    if (threads > 1 && items > 1 && !atomic_exchange(&busy, 1)) {
        int helpers = ensure_workers((threads < items ? threads : items) - 1);
        if (helpers > 0) {
            uint32_t gen = ++generation;
            atomic_store_explicit(&job_fn, fn, memory_order_relaxed);
            atomic_store_explicit(&job_ctx, ctx, memory_order_relaxed);
            atomic_store_explicit(&job_items, items, memory_order_relaxed);
            atomic_store_explicit(&job_helpers, helpers, memory_order_relaxed);
            int chunk = chunk_size(items, helpers + 1);
            atomic_store_explicit(&job_chunk, chunk, memory_order_relaxed);
            atomic_store_explicit(&done_items, 0, memory_order_relaxed);
            atomic_store_explicit(&next_item, (uint64_t)gen << 32, memory_order_release);
            atomic_store(&posted, gen);  /* seq_cst, then read sleepers (see worker_main) */
            if (atomic_load(&sleepers) > 0) futex(&posted, FUTEX_WAKE_PRIVATE, INT_MAX);
            run_items(gen, fn, ctx, items, chunk);
            int spins = 0;
            while (atomic_load_explicit(&done_items, memory_order_acquire) < items) {
                if (++spins < CALLER_SPINS) {
                    _mm_pause();
                } else {
                    sched_yield();  /* a worker holds an item and is off the CPU */
                    spins = 0;
                }
            }
            /* Close the generation before anything of the next job is written: a worker that read
             * this job's `posted` but not yet claimed can then claim nothing (see the header). */
            atomic_store_explicit(&next_item, ((uint64_t)gen << 32) | UINT32_MAX, memory_order_release);
            atomic_store(&busy, 0);
            return;
        }
        atomic_store(&busy, 0);
    }
    for (int k = 0; k < items; k++) fn(ctx, k);
}

struct rows_job {
    specula_rows_fn fn;
    const void *args;
    int n, per_item;
};

static void rows_item(void *arg, int item) {
    const struct rows_job *j = arg;
    int r0 = item * j->per_item, r1 = r0 + j->per_item < j->n ? r0 + j->per_item : j->n;
    j->fn(j->args, r0, r1);
}

/* pool.h. Its callers: the row-wise work of a prompt (ops.c's norms, RoPE and SiLU product;
 * linear.c's activation quantization), each row computed alike whichever thread runs it. */
void specula_parallel_rows(int threads, int n, int per_item, specula_rows_fn fn, const void *args) {
    struct rows_job job = {fn, args, n, per_item};
    specula_parallel(threads, (n + per_item - 1) / per_item, rows_item, &job);
}

/* Workers started so far (for tests). */
int specula_pool_workers(void) { return workers; }
