/*
 * kiln_serve_batch — server-side dynamic batching for one loaded version
 * of a model: requests ("jobs") wait in a bounded FIFO; one worker thread
 * per replica takes as many as fit in one run (up to the interface's
 * max_rows rows in dimension 0), waiting up to delay_us from the first
 * one's arrival for more, as Triton's dynamic batcher does; it runs them
 * as one batch with kiln_model_run_batched (chunks of the compiled batch
 * spread over the replicas, the last one padded) and splits the outputs
 * back per job.
 *
 * Worker w hands the replicas to the runtime starting from replica w, so
 * that while batches of one chunk are the rule (a model traced at batch 1
 * and no --max-batch) each worker's runs land on its own replica's core,
 * and a batch of several chunks still spreads over every core.
 *
 * Invariants: a job is in at most one queue; once submitted it is the
 * batcher's until its `done` is posted, after which the batcher never
 * touches it again; the queue never holds more than max_queue jobs;
 * kiln_serve_batch_destroy runs every job already queued before it joins
 * the workers.  The replicas and the interface are borrowed: they must
 * outlive the batcher.
 */
#ifndef KILN_SERVE_BATCH_H
#define KILN_SERVE_BATCH_H

#include <semaphore.h>
#include <stdint.h>

#include "common/kiln_dtype.h"
#include "common/kiln_error.h"
#include "common/kiln_limits.h"
#include "runtime/kiln_rt.h"
#include "serve/kiln_serve_metrics.h"

/* One input or output of the model as kiln-serve accepts it. */
typedef struct kiln_serve_io {
    char name[KILN_MAX_NAME + 1];
    kiln_dtype_t dtype;
    kiln_shape_t shape;             /* as compiled */
    int64_t row_elems;              /* elements of one row of dimension 0, or of
                                       the whole tensor when unbatched */
    uint64_t row_bytes;             /* the same in bytes */
} kiln_serve_io_t;

/* A model's interface, read from a loaded replica. */
typedef struct kiln_serve_iface {
    int n_inputs, n_outputs;
    kiln_serve_io_t *inputs;        /* owned */
    kiln_serve_io_t *outputs;       /* owned */
    int64_t compiled_batch;         /* dimension 0 of every input and output;
                                       0 when the model cannot be batched along it */
    int64_t max_rows;               /* rows one request or one run may carry:
                                       --max-batch, else the compiled batch; 1 for
                                       an unbatched model (a row is then a whole
                                       set of tensors, of exactly the compiled
                                       shapes) */
} kiln_serve_iface_t;

/* Read the interface of `m`; `max_batch` is --max-batch (0: the compiled
 * batch).  Release with kiln_serve_iface_release. */
int kiln_serve_iface_init (kiln_serve_iface_t *self, const kiln_model_t *m,
                           int64_t max_batch, kiln_err_t *err);
void kiln_serve_iface_release (kiln_serve_iface_t *self);

/* One inference request's tensors and outcome. */
typedef struct kiln_serve_job {
    int64_t rows;                   /* dimension 0 of every input (1 unbatched) */
    int n_inputs, n_outputs;
    uint8_t **inputs;               /* rows x row_bytes each, filled by the caller */
    uint8_t **outputs;              /* rows x row_bytes each, filled by the run */
    int rc;                         /* once done: 0, or the run's error code */
    kiln_err_t err;                 /* once done with rc != 0: why */
    /* The batcher's. */
    struct kiln_serve_job *next;    /* queue link */
    uint64_t enqueued_ns;           /* CLOCK_MONOTONIC */
    sem_t done;                     /* posted when rc and outputs are final */
} kiln_serve_job_t;

/* A job of `rows` rows (1..iface->max_rows) with its buffers allocated
 * (inputs zeroed).  Caller owns it. */
kiln_serve_job_t *kiln_serve_job_new (const kiln_serve_iface_t *iface, int64_t rows,
                                      kiln_err_t *err);
void kiln_serve_job_destroy (kiln_serve_job_t **self_p);

typedef struct kiln_serve_batch_config {
    int64_t delay_us;               /* wait this long for a batch to fill */
    int max_queue;                  /* jobs waiting, at most */
    const char *model;              /* name, for logs (copied) */
    kiln_serve_metrics_t *metrics;  /* core busy time; may be NULL */
    kiln_serve_model_metrics_t *model_metrics;  /* queue, batches; may be NULL */
} kiln_serve_batch_config_t;

typedef struct kiln_serve_batch kiln_serve_batch_t;

/* A batcher over `n` replicas (1..KILN_SERVE_MAX_REPLICAS) of one model
 * whose interface is `iface`, with one worker thread per replica, started
 * here.  Borrows replicas, iface and the metrics.  Caller owns it. */
kiln_serve_batch_t *kiln_serve_batch_new (kiln_model_t *const *replicas, int n,
                                          const kiln_serve_iface_t *iface,
                                          const kiln_serve_batch_config_t *cfg,
                                          kiln_err_t *err);
/* Run what is queued, stop and join the workers; *self_p becomes NULL. */
void kiln_serve_batch_destroy (kiln_serve_batch_t **self_p);

/* Queue `job`.  KILN_ELIMIT when max_queue jobs are waiting already (the
 * server answers 503); the job is then not queued and still the
 * caller's. */
int kiln_serve_batch_submit (kiln_serve_batch_t *self, kiln_serve_job_t *job,
                             kiln_err_t *err);
/* Wait until a submitted job is done; its rc, err and outputs are then
 * final and it is the caller's again. */
void kiln_serve_batch_wait (kiln_serve_job_t *job);

/* One run of zeros on each replica (each on its core), so that the cores
 * have started and the weights are touched before the version takes
 * traffic; *ms (may be NULL) is the time taken. */
int kiln_serve_batch_warm_up (kiln_model_t *const *replicas, int n,
                              const kiln_serve_iface_t *iface, double *ms,
                              kiln_err_t *err);

#endif
