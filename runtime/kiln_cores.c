/*
 * kiln_cores — execution cores: CPU lists, pinned executor threads, job
 * queues.  See kiln_cores.h for the contract.
 */
#include "runtime/kiln_cores.h"

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cblas.h>

#include "common/kiln_log.h"

typedef struct s_core {
    kiln_cores_t *owner;
    int index;                      /* position in the core set */
    int cpu;                        /* the CPU its thread is pinned to */
    pthread_mutex_t mu;             /* guards everything below */
    pthread_cond_t cv;              /* signalled on a new job or stop */
    pthread_t thread;
    bool started;                   /* thread created (in process `pid`) */
    bool stop;                      /* destroy asked the thread to finish */
    kiln_core_job_t *head, *tail;   /* FIFO of queued jobs */
    _Atomic int pid;                /* process the thread lives in, 0 = none */
} s_core_t;

struct kiln_cores {
    s_core_t *cores;                /* n of them */
    int n;
};

/* The core the calling thread serves, for kiln_cores_current. */
static _Thread_local const s_core_t *tls_core;

/* --- CPU lists ------------------------------------------------------ */

/* "0-3,6" for an increasing list of CPUs. */
static void
s_format_cpus (const int *cpus, int n, char *buf, size_t size)
{
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && used < size; ) {
        int j = i;
        while (j + 1 < n && cpus[j + 1] == cpus[j] + 1)
            j++;
        int w = j > i ? snprintf (buf + used, size - used, "%s%d-%d", i ? "," : "",
                                  cpus[i], cpus[j])
                      : snprintf (buf + used, size - used, "%s%d", i ? "," : "", cpus[i]);
        if (w < 0)
            break;
        used += (size_t) w;
        i = j + 1;
    }
}

/* A decimal CPU number at *p, advancing it. */
static int
s_parse_cpu (const char **p, const char *spec, const char *what, kiln_err_t *err)
{
    const char *s = *p;
    long v = 0;
    if (*s < '0' || *s > '9')
        return kiln_error (err, KILN_EINVAL, "%s='%s': expected a CPU number at "
                           "'%s'", what, spec, s);
    while (*s >= '0' && *s <= '9') {
        v = v * 10 + (*s - '0');
        if (v >= KILN_CORES_MAX)
            return kiln_error (err, KILN_EINVAL, "%s='%s': CPU numbers go up to %d",
                               what, spec, KILN_CORES_MAX - 1);
        s++;
    }
    *p = s;
    return (int) v;
}

int
kiln_cores_parse (const char *spec, const char *what, int *cpus, int max,
                  kiln_err_t *err)
{
    if (!spec || !*spec)
        return kiln_error (err, KILN_EINVAL, "%s is empty", what);
    if (strlen (spec) > KILN_CORES_SPEC_MAX)
        return kiln_error (err, KILN_ELIMIT, "%s is longer than %d bytes", what,
                           KILN_CORES_SPEC_MAX);
    bool seen[KILN_CORES_MAX] = { false };
    const char *p = spec;
    while (*p == ' ')
        p++;
    for (;;) {
        int lo = s_parse_cpu (&p, spec, what, err);
        if (lo < 0)
            return lo;
        int hi = lo;
        if (*p == '-') {
            p++;
            if ((hi = s_parse_cpu (&p, spec, what, err)) < 0)
                return hi;
            if (hi < lo)
                return kiln_error (err, KILN_EINVAL, "%s='%s': the range %d-%d is "
                                   "backwards", what, spec, lo, hi);
        }
        for (int c = lo; c <= hi; c++) {
            if (seen[c])
                return kiln_error (err, KILN_EINVAL, "%s='%s': CPU %d is listed "
                                   "twice", what, spec, c);
            seen[c] = true;
        }
        while (*p == ' ')
            p++;
        if (*p == '\0')
            break;
        if (*p != ',')
            return kiln_error (err, KILN_EINVAL, "%s='%s': unexpected '%c' (write "
                               "a list such as 0-3 or 0,2)", what, spec, *p);
        p++;
        while (*p == ' ')
            p++;
    }
    int n = 0;
    for (int c = 0; c < KILN_CORES_MAX; c++) {
        if (!seen[c])
            continue;
        if (n >= max)
            return kiln_error (err, KILN_ELIMIT, "%s='%s': more than %d CPUs", what,
                               spec, max);
        cpus[n++] = c;
    }
    return n;
}

/* The CPUs this process may run on, increasing. */
static int
s_allowed_cpus (int *cpus, int max, kiln_err_t *err)
{
    cpu_set_t set;
    CPU_ZERO (&set);
    if (sched_getaffinity (0, sizeof set, &set) != 0)
        return kiln_error (err, KILN_ESYS, "sched_getaffinity: %s", strerror (errno));
    int n = 0;
    for (int c = 0; c < CPU_SETSIZE && c < KILN_CORES_MAX && n < max; c++)
        if (CPU_ISSET (c, &set))
            cpus[n++] = c;
    if (n == 0)
        return kiln_error (err, KILN_ESYS, "this process may run on no CPU");
    return n;
}

/* --- the set -------------------------------------------------------- */

kiln_cores_t *
kiln_cores_new (const char *visible, const char *num, kiln_err_t *err)
{
    int allowed[KILN_CORES_MAX], cpus[KILN_CORES_MAX];
    kiln_cores_t *self = NULL;
    char have[256];
    int n_allowed = s_allowed_cpus (allowed, KILN_CORES_MAX, err);
    if (n_allowed < 0)
        goto done;
    s_format_cpus (allowed, n_allowed, have, sizeof have);
    int n = n_allowed;
    if (visible && *visible) {
        n = kiln_cores_parse (visible, "KILN_RT_VISIBLE_CORES", cpus, KILN_CORES_MAX, err);
        if (n < 0)
            goto done;
        for (int i = 0, j = 0; i < n; i++) {
            while (j < n_allowed && allowed[j] < cpus[i])
                j++;
            if (j == n_allowed || allowed[j] != cpus[i]) {
                kiln_error (err, KILN_EINVAL, "KILN_RT_VISIBLE_CORES='%s': CPU %d is "
                            "not available to this process (it may run on %s)",
                            visible, cpus[i], have);
                goto done;
            }
        }
    }
    else
        memcpy (cpus, allowed, (size_t) n * sizeof *cpus);
    if (num && *num) {
        char *end;
        errno = 0;
        long want = strtol (num, &end, 10);
        if (errno || *end || end == num || want < 1 || want > KILN_CORES_MAX) {
            kiln_error (err, KILN_EINVAL, "KILN_RT_NUM_CORES='%s' is not a number of "
                        "cores (1..%d)", num, KILN_CORES_MAX);
            goto done;
        }
        if (want > n) {
            char vis[256];
            s_format_cpus (cpus, n, vis, sizeof vis);
            kiln_error (err, KILN_EINVAL, "KILN_RT_NUM_CORES=%ld, but only %d cores "
                        "are visible (%s)", want, n, vis);
            goto done;
        }
        n = (int) want;
    }
    self = calloc (1, sizeof *self);
    if (self)
        self->cores = calloc ((size_t) n, sizeof *self->cores);
    if (!self || !self->cores) {
        free (self);
        self = NULL;
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto done;
    }
    self->n = n;
    for (int i = 0; i < n; i++) {
        s_core_t *c = &self->cores[i];
        c->owner = self;
        c->index = i;
        c->cpu = cpus[i];
        pthread_mutex_init (&c->mu, NULL);
        pthread_cond_init (&c->cv, NULL);
        atomic_init (&c->pid, 0);
    }
done:
    return self;
}

void
kiln_cores_destroy (kiln_cores_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_cores_t *self = *self_p;
    int me = (int) getpid ();
    for (int i = 0; i < self->n; i++) {
        s_core_t *c = &self->cores[i];
        int pid = atomic_load (&c->pid);
        if (pid != 0 && pid != me)
            continue;       /* a thread of the parent: not ours to join */
        if (c->started) {
            pthread_mutex_lock (&c->mu);
            c->stop = true;
            pthread_cond_signal (&c->cv);
            pthread_mutex_unlock (&c->mu);
            pthread_join (c->thread, NULL);
        }
        pthread_cond_destroy (&c->cv);
        pthread_mutex_destroy (&c->mu);
    }
    free (self->cores);
    free (self);
    *self_p = NULL;
}

int
kiln_cores_count (const kiln_cores_t *self)
{
    return self ? self->n : 0;
}

int
kiln_cores_cpu (const kiln_cores_t *self, int core)
{
    if (!self || core < 0 || core >= self->n)
        return -1;
    return self->cores[core].cpu;
}

int
kiln_cores_current (const kiln_cores_t *self)
{
    const s_core_t *c = tls_core;
    return c && self && c->owner == self ? c->index : -1;
}

/* --- latches -------------------------------------------------------- */

void
kiln_core_latch_init (kiln_core_latch_t *l, int pending)
{
    pthread_mutex_init (&l->mu, NULL);
    pthread_cond_init (&l->cv, NULL);
    l->pending = pending;
}

void
kiln_core_latch_release (kiln_core_latch_t *l)
{
    pthread_cond_destroy (&l->cv);
    pthread_mutex_destroy (&l->mu);
}

void
kiln_core_latch_add (kiln_core_latch_t *l, int n)
{
    pthread_mutex_lock (&l->mu);
    l->pending += n;
    pthread_mutex_unlock (&l->mu);
}

void
kiln_core_latch_wait (kiln_core_latch_t *l)
{
    pthread_mutex_lock (&l->mu);
    while (l->pending > 0)
        pthread_cond_wait (&l->cv, &l->mu);
    pthread_mutex_unlock (&l->mu);
}

/* The waiter may free the latch as soon as the count reaches zero, so
 * nothing is touched after the unlock. */
void
kiln_core_latch_done (kiln_core_latch_t *l)
{
    pthread_mutex_lock (&l->mu);
    if (--l->pending == 0)
        pthread_cond_broadcast (&l->cv);
    pthread_mutex_unlock (&l->mu);
}

/* --- executors ------------------------------------------------------ */

/* OpenBLAS's thread count is process-wide: set once. */
static pthread_once_t s_blas_once = PTHREAD_ONCE_INIT;

static void
s_blas_single (void)
{
    openblas_set_num_threads (1);
}

static void *
s_executor (void *arg)
{
    s_core_t *c = arg;
    tls_core = c;
    cpu_set_t set;
    CPU_ZERO (&set);
    CPU_SET (c->cpu, &set);
    int rc = pthread_setaffinity_np (pthread_self (), sizeof set, &set);
    if (rc != 0)
        kiln_log_warn ("core %d: could not pin its thread to CPU %d: %s; it runs "
                       "unpinned", c->index, c->cpu, strerror (rc));
    /* One BLAS thread per executor: the cores are the parallelism. */
    pthread_once (&s_blas_once, s_blas_single);

    pthread_mutex_lock (&c->mu);
    for (;;) {
        while (!c->head && !c->stop)
            pthread_cond_wait (&c->cv, &c->mu);
        kiln_core_job_t *job = c->head;
        if (!job)
            break;          /* stop, and the queue is drained */
        c->head = job->next;
        if (!c->head)
            c->tail = NULL;
        pthread_mutex_unlock (&c->mu);
        kiln_core_latch_t *latch = job->latch;
        job->fn (job->arg);
        kiln_core_latch_done (latch);     /* the job may be gone after this */
        pthread_mutex_lock (&c->mu);
    }
    pthread_mutex_unlock (&c->mu);
    return NULL;
}

/* Start core c's thread with every signal blocked: signals are for the
 * host program's threads, not the runtime's.  Called with c->mu held. */
static int
s_start (s_core_t *c, kiln_err_t *err)
{
    sigset_t all, old;
    sigfillset (&all);
    pthread_sigmask (SIG_SETMASK, &all, &old);
    int rc = pthread_create (&c->thread, NULL, s_executor, c);
    pthread_sigmask (SIG_SETMASK, &old, NULL);
    if (rc != 0)
        return kiln_error (err, KILN_ESYS, "core %d: could not start its thread: %s",
                           c->index, strerror (rc));
    char name[16];
    snprintf (name, sizeof name, "kiln-core-%d", c->index);
    pthread_setname_np (c->thread, name);
    c->started = true;
    atomic_store (&c->pid, (int) getpid ());
    return 0;
}

int
kiln_cores_submit (kiln_cores_t *self, int core, kiln_core_job_t *job,
                   kiln_err_t *err)
{
    if (!self || core < 0 || core >= self->n || !job || !job->fn || !job->latch)
        return kiln_error (err, KILN_EINVAL, "no core %d (the runtime has %d)", core,
                           self ? self->n : 0);
    s_core_t *c = &self->cores[core];
    int pid = atomic_load (&c->pid);
    if (pid != 0 && pid != (int) getpid ()) {
        /* Forked after this core's thread started: the thread (and maybe
         * the state of its lock) belongs to the parent. */
        job->fn (job->arg);
        kiln_core_latch_done (job->latch);
        return 0;
    }
    pthread_mutex_lock (&c->mu);
    if (!c->started) {
        int rc = s_start (c, err);
        if (rc) {
            pthread_mutex_unlock (&c->mu);
            return rc;
        }
    }
    job->next = NULL;
    if (c->tail)
        c->tail->next = job;
    else
        c->head = job;
    c->tail = job;
    pthread_cond_signal (&c->cv);
    pthread_mutex_unlock (&c->mu);
    return 0;
}

int
kiln_cores_call (kiln_cores_t *self, int core, kiln_core_fn *fn, void *arg,
                 kiln_err_t *err)
{
    if (self && core >= 0 && kiln_cores_current (self) == core) {
        fn (arg);
        return 0;
    }
    kiln_core_latch_t latch;
    kiln_core_latch_init (&latch, 1);
    kiln_core_job_t job = { .fn = fn, .arg = arg, .latch = &latch };
    int rc = kiln_cores_submit (self, core, &job, err);
    if (rc == 0)
        kiln_core_latch_wait (&latch);
    kiln_core_latch_release (&latch);
    return rc;
}
