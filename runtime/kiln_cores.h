/*
 * kiln_cores — the runtime's execution cores: a set of CPUs, one executor
 * thread per core pinned to its CPU, and a FIFO of jobs per core.  This is
 * what seed 001 calls NeuronCores: each loaded model is placed on one core
 * (round-robin, kiln_rt.c), and all of a model's runs execute on that
 * core's thread, so models on different cores run concurrently and models
 * on one core take turns.  Internal to libkilnrt.
 *
 * Which CPUs: KILN_RT_VISIBLE_CORES lists them ("0-3", "0,2,5-7"),
 * KILN_RT_NUM_CORES keeps the first N of them; by default every CPU the
 * process may run on (sched_getaffinity).  Core i is the i-th CPU of that
 * list, in increasing order; a listed CPU the process may not run on is
 * an error, so that a model is never silently placed on a core that does
 * not exist.
 *
 * Invariants:
 *   - jobs of one core run on its thread, one at a time, in submission
 *     order; a job's latch is counted down after the job has returned, and
 *     the core never touches the job again after that;
 *   - a core's thread starts on first use (a process that loads models but
 *     never runs one starts none) and is joined by kiln_cores_destroy,
 *     which must not race with submissions;
 *   - each executor runs OpenBLAS single-threaded, so N cores busy means N
 *     threads of compute and no oversubscription (OpenBLAS's thread count
 *     is process-wide: a host program that also uses OpenBLAS, such as
 *     PyTorch, gets one BLAS thread too once a core has started);
 *   - in a child forked after a core's thread started, that thread does
 *     not exist: jobs for it run in the calling thread instead (unpinned),
 *     so a fork never deadlocks.
 */
#ifndef KILN_CORES_H
#define KILN_CORES_H

#include <pthread.h>

#include "common/kiln_error.h"

#define KILN_CORES_MAX        1024    /* CPUs (CPU_SETSIZE) */
#define KILN_CORES_SPEC_MAX   4096    /* bytes of a KILN_RT_VISIBLE_CORES value */

typedef struct kiln_cores kiln_cores_t;

/* Counts jobs down to zero; whoever waits owns it. */
typedef struct kiln_core_latch {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int pending;                    /* jobs not finished yet */
} kiln_core_latch_t;

typedef void (kiln_core_fn) (void *arg);

/* A job, owned by the submitter (typically on its stack) until its latch
 * has been counted down. */
typedef struct kiln_core_job {
    kiln_core_fn *fn;
    void *arg;
    kiln_core_latch_t *latch;       /* counted down when fn returned */
    struct kiln_core_job *next;     /* queue link, the core's business */
} kiln_core_job_t;

/* Parse a CPU list ("0-3,6") into cpus[max], increasing and without
 * duplicates.  `what` names the setting in errors.  Returns the count
 * (>= 1) or a negative error. */
int kiln_cores_parse (const char *spec, const char *what, int *cpus, int max,
                      kiln_err_t *err);

/* A core set from the values of KILN_RT_VISIBLE_CORES and
 * KILN_RT_NUM_CORES (either may be NULL or empty: unset).  Caller owns the
 * result. */
kiln_cores_t *kiln_cores_new (const char *visible, const char *num,
                              kiln_err_t *err);
/* Join every started executor; *self_p becomes NULL. */
void kiln_cores_destroy (kiln_cores_t **self_p);

/* Number of cores, and the CPU of core i (-1 when out of range). */
int kiln_cores_count (const kiln_cores_t *self);
int kiln_cores_cpu (const kiln_cores_t *self, int core);

void kiln_core_latch_init (kiln_core_latch_t *l, int pending);
void kiln_core_latch_release (kiln_core_latch_t *l);
/* Count one job done (the cores do this for jobs they ran). */
void kiln_core_latch_done (kiln_core_latch_t *l);
/* Count `n` more jobs (one submitted after the latch was made). */
void kiln_core_latch_add (kiln_core_latch_t *l, int n);
/* Wait until every job counted in the latch has finished. */
void kiln_core_latch_wait (kiln_core_latch_t *l);

/* Queue `job` on core `core` (starting its thread when needed).  On
 * error the job is not queued and its latch not touched. */
int kiln_cores_submit (kiln_cores_t *self, int core, kiln_core_job_t *job,
                       kiln_err_t *err);

/* Run fn(arg) on core `core` and wait for it.  Runs it directly when the
 * caller already is that core's executor. */
int kiln_cores_call (kiln_cores_t *self, int core, kiln_core_fn *fn,
                     void *arg, kiln_err_t *err);

/* The core the calling thread executes for, or -1 when it is not an
 * executor of `self`. */
int kiln_cores_current (const kiln_cores_t *self);

#endif
