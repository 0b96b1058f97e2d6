/*
 * kiln_exec — running a prepared program: the op loop, per-kernel timing
 * and the intra-op thread pool.  Internal to libkilnrt.
 *
 * Per-kernel timing is switched on by KILN_RT_PROFILE=1 when a model is
 * loaded: every op of every run is timed, and when the model is destroyed
 * a report goes to stderr (time per run by kernel, then the slowest ops
 * with their output shapes and, for products, GFLOP/s; every op with
 * KILN_RT_PROFILE=all) and the estimate of common/kiln_cost.h beside the
 * time measured (the model the compiler cuts pipelines by).  Off, it
 * costs one pointer test per run.
 *
 * Intra-op threads (KILN_RT_THREADS, default 1: the execution cores are
 * the parallelism) let one inference use several CPUs: the heavy kernels
 * (convolution, matrix products, the big elementwise loops) split their
 * work into tasks with kiln_exec_parallel.  The pool is process-wide and
 * cooperative: the calling thread always takes part and takes tasks until
 * none is left, helpers take what they can, and a caller that finds the
 * pool busy (another model running on another core) runs all of its tasks
 * itself.  So a parallel section never waits for work that nobody has
 * started, and replicas on several cores (dynamic batching) degrade to
 * one thread each instead of oversubscribing the CPUs.
 */
#ifndef KILN_EXEC_H
#define KILN_EXEC_H

#include <stdio.h>

#include "common/kiln_program.h"
#include "runtime/kiln_kernels.h"

#define KILN_EXEC_MAX_THREADS 256   /* bound on KILN_RT_THREADS */

typedef struct kiln_exec kiln_exec_t;

/* What runs one loaded program: its kernels' workspace (the largest
 * plan's ws_bytes for each of kiln_exec_threads() workers, allocated
 * once here: nothing is allocated per run) and, when KILN_RT_PROFILE is
 * set (and not "0"), its profile.  `p` and `plans` must outlive it.
 * Caller owns the result. */
kiln_exec_t *kiln_exec_new (const kiln_program_t *p, const kiln_kplan_t *plans,
                            kiln_err_t *err);
/* The same for ops first..end-1 only (a pipeline stage): its workspace
 * is what those ops need, kiln_exec_run runs those ops, and the profile
 * report is headed by `label` (e.g. "stage 1 on core 1"; copied). */
kiln_exec_t *kiln_exec_new_range (const kiln_program_t *p, const kiln_kplan_t *plans,
                                  int first, int end, const char *label,
                                  kiln_err_t *err);
/* Print the profile report to stderr when there were timed runs, and
 * free. */
void kiln_exec_destroy (kiln_exec_t **self_p);

/* Run the ops (its range) in order on the tensors at data[t].  One run at
 * a time per kiln_exec_t (the model's lock).  Returns 0, or KILN_EINVAL
 * with `err` (may be NULL) naming the op when a kernel met a value from
 * the run's data that it cannot use (kiln_exec_fault: an index out of
 * range); the ops after that one do not run. */
int kiln_exec_run (kiln_exec_t *self, void *const *data, kiln_err_t *err);

/* For a kernel's run, in the thread that called kiln_exec_run (not in a
 * task of kiln_exec_parallel): the data it was given cannot be used (a
 * scatter index out of range, a sequence length past the sequence).  The
 * kernel returns without touching memory out of its operands; the first
 * fault of a run is what kiln_exec_run reports. */
void kiln_exec_fault (const char *fmt, ...) __attribute__ ((format (printf, 1, 2)));

/* The workspace of the kernel running on the calling thread: 64-byte
 * aligned, *bytes (a multiple of 64) for each worker, worker w's at
 * w · *bytes.  NULL outside kiln_exec_run. */
float *kiln_exec_ws (size_t *bytes);
/* Give the calling thread `ws` (64-byte aligned, `bytes` per worker for
 * kiln_exec_threads() workers) as the workspace of kernels it runs
 * outside kiln_exec_run: tests and benchmarks of single kernels. */
void kiln_exec_set_ws (float *ws, size_t bytes);

/* Threads one inference may use: KILN_RT_THREADS read once (1 when it is
 * unset or not a number in 1..KILN_EXEC_MAX_THREADS, with a warning). */
int kiln_exec_threads (void);

/* A task function: runs task `task` of `n_tasks` on worker `worker`
 * (0..kiln_exec_threads() - 1; a worker runs one task at a time, so
 * per-worker buffers need no lock). */
typedef void (kiln_exec_task_fn) (void *arg, int task, int worker);

/* Run fn(arg, t, w) for every t in 0..n_tasks-1, spread over the pool,
 * and return when all have finished.  With one thread, or a busy pool,
 * or when called from inside a task, everything runs in the caller. */
void kiln_exec_parallel (kiln_exec_task_fn *fn, void *arg, int n_tasks);

#endif
