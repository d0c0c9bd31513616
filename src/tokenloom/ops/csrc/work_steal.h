/* Contiguous runs of work items, one per OpenMP thread, which a thread done with its own run
 * takes over from the back of another's.
 *
 * Why: the kernels split their items up front (a contiguous run each, so that a thread's next
 * item is the one after, whose data it prefetches), and the split cannot see how fast each
 * thread will run. On the small shared VMs this project runs on, it is not the same: in a batch-64
 * decode step the master thread finished its share of the attention items last in most calls,
 * while the other waited at the barrier (another process on the host, interrupts, a thread woken
 * late; benchmarks/CHANGELOG.md). Taking items from the back of the slower thread's
 * run keeps both busy to the end, and both runs stay contiguous: the owner walks forward, a
 * thief backward, each still prefetching the item it will most likely take next.
 *
 * Each item is taken exactly once (the (next, end) pair of a run changes by compare-and-swap);
 * which thread takes it changes nothing in its result, so the outputs are bit for bit those of
 * the static split. */
#ifndef TL_WORK_STEAL_H
#define TL_WORK_STEAL_H
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>

#define TL_STEAL_MAX_THREADS 64

/* One thread's run [next, end) as one word (each half below 2^32 items), on its own line. */
typedef struct {
    _Alignas(64) _Atomic uint64_t w;
} tl_run;

static inline uint64_t tl_run_pack(int64_t next, int64_t end) {
    return ((uint64_t)(uint32_t)end << 32) | (uint32_t)next;
}

/* runs[t] = [bounds[t], bounds[t + 1]) for t < nt. */
static inline void tl_runs_init(tl_run *runs, const int64_t *bounds, int nt) {
    for (int t = 0; t < nt; t++) atomic_store(&runs[t].w, tl_run_pack(bounds[t], bounds[t + 1]));
}

/* The first item of run r (its owner's next), or -1 when it is empty. */
static inline int64_t tl_run_front(tl_run *r) {
    uint64_t v = atomic_load(&r->w);
    for (;;) {
        const int64_t n = (uint32_t)v, e = v >> 32;
        if (n >= e) return -1;
        if (atomic_compare_exchange_weak(&r->w, &v, tl_run_pack(n + 1, e))) return n;
    }
}

/* The last item of run r (a thief's), or -1 when it is empty. */
static inline int64_t tl_run_back(tl_run *r) {
    uint64_t v = atomic_load(&r->w);
    for (;;) {
        const int64_t n = (uint32_t)v, e = v >> 32;
        if (n >= e) return -1;
        if (atomic_compare_exchange_weak(&r->w, &v, tl_run_pack(n, e - 1))) return e - 1;
    }
}

/* Thread t's next item: from the front of its own run, else from the back of the run with the
 * most items left; -1 when all are taken. *guess is set to the item t will most likely take
 * after this one (for prefetching; -1 for none). */
static inline int64_t tl_runs_next(tl_run *runs, int t, int nt, int64_t *guess) {
    int64_t it = tl_run_front(&runs[t]);
    if (it >= 0) {
        const uint64_t v = atomic_load(&runs[t].w);
        *guess = (int64_t)(uint32_t)v < (int64_t)(v >> 32) ? it + 1 : -1;
        return it;
    }
    for (;;) {
        int victim = -1;
        int64_t most = 0;
        for (int u = 0; u < nt; u++) {
            const uint64_t v = atomic_load(&runs[u].w);
            const int64_t left = (int64_t)(v >> 32) - (int64_t)(uint32_t)v;
            if (left > most) most = left, victim = u;
        }
        if (victim < 0) {
            *guess = -1;
            return -1;
        }
        it = tl_run_back(&runs[victim]);
        if (it >= 0) {
            *guess = most > 1 ? it - 1 : -1;
            return it;
        }
    }
}
/* runs[t] = thread t's even share by count of `items`, [items t / nt, items (t + 1) / nt). */
static inline void tl_runs_init_even(tl_run *runs, int64_t items, int nt) {
    for (int t = 0; t < nt; t++)
        atomic_store(&runs[t].w, tl_run_pack(items * t / nt, items * (t + 1) / nt));
}

/* The kernels' loop head: thread t's next item, by tl_runs_next when `steal` (runs set up), else
 * the next of its own run [*k, i1) (*k advanced); -1 when there is none. *guess as
 * tl_runs_next's. Use: for (int64_t k = i0, it, nx; (it = tl_next_item(...&k, i1, &nx)) >= 0;) */
static inline int64_t tl_next_item(tl_run *runs, int steal, int t, int nt, int64_t *k, int64_t i1,
                                   int64_t *guess) {
    if (steal) return tl_runs_next(runs, t, nt, guess);
    if (*k >= i1) return -1;
    const int64_t it = (*k)++;
    *guess = it + 1 < i1 ? it + 1 : -1;
    return it;
}

/* One thread's walk over `items` split evenly across the team, taking over from a slower
 * thread's run at the end; the static split when the team is too large for the runs. The loop
 * head of the kernels that split their items evenly; tl_items_start is called by every thread of
 * the parallel region (it holds an `omp single`, whose barrier publishes the runs):
 *     tl_items walk = tl_items_start(runs, items);
 *     for (int64_t it, nx; (it = tl_items_next(&walk, &nx)) >= 0;) ...  (nx: the likely next) */
typedef struct {
    tl_run *runs;
    int steal, t, nt;
    int64_t k, end; /* the static split's own run [k, end), without stealing */
} tl_items;

static inline tl_items tl_items_start(tl_run *runs, int64_t items) {
    tl_items w;
    w.runs = runs;
    w.nt = omp_get_num_threads();
    w.t = omp_get_thread_num();
    w.steal = w.nt <= TL_STEAL_MAX_THREADS;
    w.k = items * w.t / w.nt;
    w.end = items * (w.t + 1) / w.nt;
    if (w.steal) {
#pragma omp single
        tl_runs_init_even(runs, items, w.nt);
    }
    return w;
}

static inline int64_t tl_items_next(tl_items *w, int64_t *guess) {
    return tl_next_item(w->runs, w->steal, w->t, w->nt, &w->k, w->end, guess);
}
#endif
