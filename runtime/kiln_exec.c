/*
 * kiln_exec — the op loop, per-kernel timing and the intra-op thread
 * pool.  See kiln_exec.h for the contract.
 */
#include "runtime/kiln_exec.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/kiln_cost.h"
#include "common/kiln_log.h"
#include "common/kiln_mem.h"
#include "runtime/kiln_gemm.h"

/* --- profile and workspace ----------------------------------------- */

struct kiln_exec {
    const kiln_program_t *p;
    const kiln_kplan_t *plans;
    int first, end;                 /* the ops it runs */
    char label[64];                 /* heads the report, or "" */
    float *ws;                      /* threads × ws_bytes, or NULL */
    size_t ws_bytes;                /* per worker, a multiple of 64 */
    uint64_t runs;                  /* runs timed */
    uint64_t *ns;                   /* per op, summed over the runs; NULL
                                     * when not profiling */
    bool warm;                      /* the first run was dropped */
    bool all_ops;                   /* KILN_RT_PROFILE=all: list every op */
};

/* The workspace of the run in progress on this thread. */
static _Thread_local float *tls_ws;
static _Thread_local size_t tls_ws_bytes;
/* The first fault of the op running on this thread (kiln_exec_fault). */
static _Thread_local bool tls_faulted;
static _Thread_local char tls_fault[256];

static uint64_t
s_now_ns (void)
{
    struct timespec ts;
    clock_gettime (CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000u + (uint64_t) ts.tv_nsec;
}

kiln_exec_t *
kiln_exec_new (const kiln_program_t *p, const kiln_kplan_t *plans,
               kiln_err_t *err)
{
    return kiln_exec_new_range (p, plans, 0, p->n_ops, NULL, err);
}

kiln_exec_t *
kiln_exec_new_range (const kiln_program_t *p, const kiln_kplan_t *plans,
                     int first, int end, const char *label, kiln_err_t *err)
{
    kiln_exec_t *self = calloc (1, sizeof *self);
    if (!self) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    self->p = p;
    self->plans = plans;
    self->first = first;
    self->end = end;
    snprintf (self->label, sizeof self->label, "%s", label ? label : "");
    size_t need = 0;
    for (int i = first; i < end; i++)
        if (plans[i].ws_bytes > need)
            need = plans[i].ws_bytes;
    if (need) {
        size_t per = (need + 63) & ~(size_t) 63, total;
        if (__builtin_mul_overflow (per, (size_t) kiln_exec_threads (), &total)
            || !(self->ws = kiln_mem_alloc (total))) {
            free (self);
            kiln_error (err, KILN_ENOMEM, "out of memory allocating %zu bytes of "
                        "kernel workspace for each of %d threads", per,
                        kiln_exec_threads ());
            return NULL;
        }
        self->ws_bytes = per;
    }
    const char *v = getenv ("KILN_RT_PROFILE");
    if (v && v[0] && strcmp (v, "0") != 0)
        self->ns = calloc ((size_t) p->n_ops + 1, sizeof *self->ns);
    self->all_ops = v && strcmp (v, "all") == 0;
    return self;
}

typedef struct {
    int key;                        /* kernel id or op index */
    uint64_t ns;
    int count;
} s_row_t;

static int
s_row_cmp (const void *a, const void *b)
{
    const s_row_t *x = a, *y = b;
    if (x->ns != y->ns)
        return x->ns < y->ns ? 1 : -1;
    return (x->key > y->key) - (x->key < y->key);
}

#define S_TOP_OPS 25

static void
s_report (const kiln_exec_t *self, FILE *out)
{
    const kiln_program_t *p = self->p;
    const kiln_kplan_t *plans = self->plans;
    int first = self->first, n_ops = self->end - self->first;
    double runs = (double) self->runs;
    uint64_t total = 0;
    s_row_t by_kernel[KILN_K_COUNT];
    for (int k = 0; k < KILN_K_COUNT; k++)
        by_kernel[k] = (s_row_t) { k, 0, 0 };
    kiln_cost_t model = { 0, 0 };
    for (int i = first; i < self->end; i++) {
        total += self->ns[i];
        by_kernel[plans[i].kernel].ns += self->ns[i];
        by_kernel[plans[i].kernel].count++;
        kiln_cost_t c = kiln_cost_op (p, i);
        model.flops += c.flops;
        model.bytes += c.bytes;
    }
    qsort (by_kernel, KILN_K_COUNT, sizeof *by_kernel, s_row_cmp);
    fprintf (out, "kiln profile%s%s: %llu runs, %.3f ms per run in %d ops "
             "(%d intra-op threads, %s micro-kernel)\n", self->label[0] ? ", " : "",
             self->label, (unsigned long long) self->runs,
             (double) total / runs / 1e6, n_ops, kiln_exec_threads (),
             kiln_gemm_isa ());
    fprintf (out, "  %-20s %10s %7s %5s\n", "kernel", "ms/run", "share", "ops");
    for (int k = 0; k < KILN_K_COUNT && by_kernel[k].count; k++)
        fprintf (out, "  %-20s %10.3f %6.1f%% %5d\n",
                 kiln_kernel_name ((kiln_kernel_t) by_kernel[k].key),
                 (double) by_kernel[k].ns / runs / 1e6,
                 total ? 100.0 * (double) by_kernel[k].ns / (double) total : 0.0,
                 by_kernel[k].count);
    if (model.flops > 0 && total > 0)
        fprintf (out, "  %.3f GFLOP per run (convolutions, matrix products): "
                 "%.1f GFLOP/s over the whole run\n", model.flops / 1e9,
                 model.flops / ((double) total / runs));
    fprintf (out, "  cost model (common/kiln_cost.h): %.3f GFLOP + %.1f MB moved = "
             "%.3f ms estimated per run, %.3f ms measured\n", model.flops / 1e9,
             model.bytes / 1e6, kiln_cost_ns (model) / 1e6,
             (double) total / runs / 1e6);
    s_row_t *ops = malloc ((size_t) n_ops * sizeof *ops + 1);
    if (!ops)
        return;
    for (int i = 0; i < n_ops; i++)
        ops[i] = (s_row_t) { first + i, self->ns[first + i], 1 };
    qsort (ops, (size_t) n_ops, sizeof *ops, s_row_cmp);
    fprintf (out, self->all_ops ? "  every op, slowest first:\n" : "  slowest ops:\n");
    for (int r = 0; r < n_ops && (self->all_ops || r < S_TOP_OPS); r++) {
        int i = ops[r].key;
        char shape[160];
        kiln_shape_str (&p->tensors[plans[i].out].shape, shape, sizeof shape);
        double ms = (double) ops[r].ns / runs / 1e6;
        double flops = kiln_cost_op (p, i).flops;
        char rate[32] = "";
        if (flops > 0 && ms > 0)
            snprintf (rate, sizeof rate, "%7.1f GFLOP/s", flops / ms / 1e6);
        fprintf (out, "  %5d %-18s %10.3f ms %s -> %s\n", i,
                 kiln_kernel_name (plans[i].kernel), ms, rate, shape);
    }
    free (ops);
}

void
kiln_exec_destroy (kiln_exec_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_exec_t *self = *self_p;
    if (self->ns && self->runs)
        s_report (self, stderr);
    free (self->ns);
    free (self->ws);
    free (self);
    *self_p = NULL;
}

float *
kiln_exec_ws (size_t *bytes)
{
    *bytes = tls_ws_bytes;
    return tls_ws;
}

void
kiln_exec_set_ws (float *ws, size_t bytes)
{
    tls_ws = ws;
    tls_ws_bytes = bytes;
}

void
kiln_exec_fault (const char *fmt, ...)
{
    if (tls_faulted)
        return;
    tls_faulted = true;
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (tls_fault, sizeof tls_fault, fmt, ap);
    va_end (ap);
}

int
kiln_exec_run (kiln_exec_t *self, void *const *data, kiln_err_t *err)
{
    int rc = 0;
    tls_ws = self->ws;
    tls_ws_bytes = self->ws_bytes;
    tls_faulted = false;
    /* The first run pays the page faults of the weights' mapping and of
     * the arena: once a second comes, the profile starts over without it
     * (ONNX Runtime's sessions pay theirs before their first run). */
    if (self->ns && self->runs == 1 && !self->warm) {
        memset (self->ns, 0, ((size_t) self->p->n_ops + 1) * sizeof *self->ns);
        self->runs = 0;
        self->warm = true;
    }
    for (int i = self->first; i < self->end; i++) {
        uint64_t t0 = self->ns ? s_now_ns () : 0;
        kiln_kernel_run (&self->plans[i], data);
        if (self->ns)
            self->ns[i] += s_now_ns () - t0;
        if (tls_faulted) {
            rc = kiln_error (err ? err : &(kiln_err_t) { 0 }, KILN_EINVAL, "op %d (%s): %s",
                             i, kiln_kernel_name (self->p->ops[i].kernel), tls_fault);
            tls_faulted = false;
            break;
        }
    }
    if (self->ns)
        self->runs++;
    tls_ws = NULL;
    tls_ws_bytes = 0;
    return rc;
}

/* --- the pool ------------------------------------------------------- */

/* One parallel section, on its caller's stack.  Worker w owns the
 * tasks [w·n/T, (w+1)·n/T) and runs them first, in order, then takes
 * what is left of the others' ranges.  So task t runs on the same
 * worker from one run to the next, and a kernel whose tasks split the
 * tensors the same way as the kernel before it finds its part in its
 * own core's cache: taken first come, first served, the tiles of a
 * product moved between the two cores' caches from run to run (a
 * pointwise convolution of 28 x 28 x 192 ran slower on two threads than
 * on one). */
typedef struct {
    _Alignas (64) _Atomic int next; /* next task of the range */
    int end;                        /* (a cache line each) */
} s_range_t;

typedef struct {
    kiln_exec_task_fn *fn;
    void *arg;
    int n_tasks;
    int n_ranges;                   /* workers that own a range */
    unsigned gen;                   /* which section this is */
    _Atomic int done;               /* tasks finished */
    s_range_t range[KILN_EXEC_MAX_THREADS];
} s_job_t;

static struct {
    pthread_once_t once;
    int n;                          /* threads per inference, caller included */
    int started;                    /* helpers running */
    int pid;                        /* process the helpers live in */
    _Atomic int busy;               /* a caller owns the pool */
    _Atomic(s_job_t *) current;     /* the section on offer, or NULL */
    _Atomic unsigned gen;           /* generation of the latest section */
    _Atomic int active;             /* helpers that may be looking at current */
    _Atomic int sleepers;           /* helpers waiting on cv */
    pthread_mutex_t mu;
    pthread_cond_t cv;
} s_pool = { .once = PTHREAD_ONCE_INIT, .n = 1,
             .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER };

/* True on the pool's helpers and on a caller inside its section. */
static _Thread_local bool tls_in_task;

/* Spins before a helper sleeps, and before a caller yields while waiting
 * for the helpers' last tasks: long enough to bridge the gap between two
 * kernels of one inference, short enough not to steal a CPU for long. */
#define S_SPIN 20000

static inline void
s_pause (void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause ();
#endif
}

static void
s_run_tasks (s_job_t *job, int worker)
{
    int n = job->n_ranges;
    int ran = 0;
    for (int i = 0; i < n; i++) {
        s_range_t *r = &job->range[(worker + i) % n];
        int t;
        while ((t = atomic_fetch_add (&r->next, 1)) < r->end) {
            job->fn (job->arg, t, worker);
            ran++;
        }
    }
    /* once, after the last: a count per task had the two cores trade the
     * job's line task by task (a section of 16 empty tasks took 1.6 µs
     * on 2 threads, 0.6 µs so; mobilenet_v2 and efficientnet_b0 0.995
     * of the time at 2 threads, paired in one process) */
    if (ran)
        atomic_fetch_add (&job->done, ran);
}

static void *
s_helper (void *arg)
{
    int worker = (int) (intptr_t) arg;
    unsigned seen = 0;              /* the last section looked at */
    tls_in_task = true;
    for (;;) {
        /* Wait for a new section: spin a while, then sleep. */
        int spins = 0;
        unsigned gen;
        while ((gen = atomic_load (&s_pool.gen)) == seen) {
            if (++spins < S_SPIN) {
                s_pause ();
                continue;
            }
            pthread_mutex_lock (&s_pool.mu);
            atomic_fetch_add (&s_pool.sleepers, 1);
            while (atomic_load (&s_pool.gen) == seen)
                pthread_cond_wait (&s_pool.cv, &s_pool.mu);
            atomic_fetch_sub (&s_pool.sleepers, 1);
            pthread_mutex_unlock (&s_pool.mu);
            spins = 0;
        }
        seen = gen;
        /* `active` is raised before `current` is read, so the caller,
         * which clears `current` and then waits for `active` to drop,
         * never frees a section a helper may still touch. */
        atomic_fetch_add (&s_pool.active, 1);
        s_job_t *job = atomic_load (&s_pool.current);
        if (job) {
            seen = job->gen;
            s_run_tasks (job, worker);
        }
        atomic_fetch_sub (&s_pool.active, 1);
    }
    return NULL;
}

static void
s_pool_init (void)
{
    const char *v = getenv ("KILN_RT_THREADS");
    int n = 1;
    if (v && v[0]) {
        char *end;
        long t = strtol (v, &end, 10);
        if (*end || t < 1 || t > KILN_EXEC_MAX_THREADS)
            kiln_log_warn ("KILN_RT_THREADS='%s' is not a number in 1..%d; "
                           "using 1", v, KILN_EXEC_MAX_THREADS);
        else
            n = (int) t;
    }
    s_pool.n = n;
    /* Helpers are started here, once, and live as long as the process
     * (like OpenBLAS's): they are blocked in a condition wait when idle.
     * Signals are for the host program's threads. */
    sigset_t all, old;
    sigfillset (&all);
    pthread_sigmask (SIG_SETMASK, &all, &old);
    int started = 0;
    for (int i = 1; i < n; i++) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init (&attr);
        pthread_attr_setdetachstate (&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create (&th, &attr, s_helper, (void *) (intptr_t) i);
        pthread_attr_destroy (&attr);
        if (rc != 0) {
            kiln_log_warn ("could not start intra-op thread %d; running with %d",
                           i, started + 1);
            break;
        }
        char name[16];               /* the kernel keeps 15 bytes of a name */
        snprintf (name, sizeof name, "kiln-intra-%u", (unsigned) i % 1000u);
        pthread_setname_np (th, name);
        started++;
    }
    pthread_sigmask (SIG_SETMASK, &old, NULL);
    s_pool.started = started;
    s_pool.n = started + 1;
    s_pool.pid = (int) getpid ();
}

int
kiln_exec_threads (void)
{
    pthread_once (&s_pool.once, s_pool_init);
    return s_pool.n;
}

void
kiln_exec_parallel (kiln_exec_task_fn *fn, void *arg, int n_tasks)
{
    if (n_tasks <= 0)
        return;
    int expected = 0;
    if (n_tasks == 1 || tls_in_task || kiln_exec_threads () == 1
        || s_pool.pid != (int) getpid ()
        || !atomic_compare_exchange_strong (&s_pool.busy, &expected, 1)) {
        for (int t = 0; t < n_tasks; t++)
            fn (arg, t, 0);
        return;
    }
    /* The pool is ours (busy): nobody else writes gen. */
    s_job_t job;                    /* (not zeroed: 16 KiB of ranges) */
    job.fn = fn;
    job.arg = arg;
    job.n_tasks = n_tasks;
    job.gen = atomic_load (&s_pool.gen) + 1;
    if (job.gen == 0)
        job.gen = 1;                /* 0 is what a helper has seen first */
    job.n_ranges = s_pool.n < n_tasks ? s_pool.n : n_tasks;
    for (int w = 0; w < job.n_ranges; w++) {
        atomic_init (&job.range[w].next,
                     (int) ((int64_t) w * n_tasks / job.n_ranges));
        job.range[w].end = (int) ((int64_t) (w + 1) * n_tasks / job.n_ranges);
    }
    atomic_init (&job.done, 0);
    atomic_store (&s_pool.current, &job);
    atomic_store (&s_pool.gen, job.gen);
    if (atomic_load (&s_pool.sleepers) > 0) {
        pthread_mutex_lock (&s_pool.mu);
        pthread_cond_broadcast (&s_pool.cv);
        pthread_mutex_unlock (&s_pool.mu);
    }
    tls_in_task = true;
    s_run_tasks (&job, 0);
    tls_in_task = false;
    for (int spins = 0; atomic_load (&job.done) < n_tasks; spins++) {
        if (spins < S_SPIN)
            s_pause ();
        else
            sched_yield ();
    }
    atomic_store (&s_pool.current, NULL);
    while (atomic_load (&s_pool.active) > 0)
        s_pause ();
    atomic_store (&s_pool.busy, 0);
}
