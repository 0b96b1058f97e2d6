#include "serve/kiln_serve_batch.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/kiln_log.h"

typedef struct s_worker s_worker_t;

struct kiln_serve_batch {
    const kiln_serve_iface_t *iface;    /* borrowed */
    kiln_serve_batch_config_t cfg;      /* model points at `model` */
    char model[KILN_MAX_MODEL_NAME + 1];
    int n_replicas;
    pthread_mutex_t lock;               /* everything below */
    pthread_cond_t cv;                  /* queue changed, or stopping */
    kiln_serve_job_t *head, *tail;      /* FIFO */
    int queued;                         /* jobs in it */
    int64_t queued_rows;                /* their rows */
    bool stopping;
    s_worker_t *workers;                /* n_replicas */
};

struct s_worker {
    kiln_serve_batch_t *batch;
    pthread_t thread;
    bool started;
    kiln_model_t *replicas[KILN_SERVE_MAX_REPLICAS];  /* rotated: this worker's first */
    kiln_rt_tensor_t *ins, *outs;       /* descriptors, n_inputs / n_outputs */
    uint8_t **gather_in, **gather_out;  /* several jobs' rows, contiguous */
    int64_t gather_rows;                /* rows those hold */
    kiln_err_t err;
};

/* --- the interface ---------------------------------------------------- */

static int
s_io_init (kiln_serve_io_t *io, const kiln_model_t *m, int output, int i, int64_t batch,
           kiln_err_t *err)
{
    const char *name;
    int dtype;
    int64_t dims[KILN_MAX_RANK];
    int rank = kiln_model_io (m, output, i, &name, &dtype, dims, err);
    if (rank < 0)
        return rank;
    snprintf (io->name, sizeof io->name, "%s", name);
    io->dtype = (kiln_dtype_t) dtype;
    io->shape.rank = rank;
    memcpy (io->shape.dims, dims, sizeof dims);
    uint64_t bytes;
    int64_t numel;
    int rc = kiln_shape_numel (&io->shape, io->name, &numel, err);
    if (rc || (rc = kiln_shape_bytes (&io->shape, io->dtype, io->name, &bytes, err)))
        return rc;
    io->row_elems = batch > 0 ? numel / batch : numel;
    io->row_bytes = batch > 0 ? bytes / (uint64_t) batch : bytes;
    return 0;
}

int
kiln_serve_iface_init (kiln_serve_iface_t *self, const kiln_model_t *m, int64_t max_batch,
                       kiln_err_t *err)
{
    memset (self, 0, sizeof *self);
    kiln_err_t why = { 0 };
    int64_t b = kiln_model_batch_size (m, &why);
    self->compiled_batch = b > 0 ? b : 0;
    self->max_rows = b > 0 ? (max_batch > 0 ? max_batch : b) : 1;
    if (self->max_rows > KILN_SERVE_MAX_BATCH)
        self->max_rows = KILN_SERVE_MAX_BATCH;
    self->n_inputs = kiln_model_io_count (m, 0);
    self->n_outputs = kiln_model_io_count (m, 1);
    self->inputs = calloc ((size_t) self->n_inputs + 1, sizeof *self->inputs);
    self->outputs = calloc ((size_t) self->n_outputs + 1, sizeof *self->outputs);
    if (!self->inputs || !self->outputs) {
        kiln_serve_iface_release (self);
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    for (int o = 0; o < 2; o++)
        for (int i = 0; i < (o ? self->n_outputs : self->n_inputs); i++) {
            int rc = s_io_init (o ? &self->outputs[i] : &self->inputs[i], m, o, i,
                                self->compiled_batch, err);
            if (rc) {
                kiln_serve_iface_release (self);
                return rc;
            }
        }
    return 0;
}

void
kiln_serve_iface_release (kiln_serve_iface_t *self)
{
    free (self->inputs);
    free (self->outputs);
    memset (self, 0, sizeof *self);
}

/* --- jobs ------------------------------------------------------------- */

/* `rows` rows of each of `n` tensors, zeroed; NULL on overflow or OOM. */
static uint8_t **
s_buffers (const kiln_serve_io_t *ios, int n, int64_t rows, kiln_err_t *err)
{
    uint8_t **bufs = calloc ((size_t) n + 1, sizeof *bufs);
    if (!bufs) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        uint64_t bytes;
        if (__builtin_mul_overflow (ios[i].row_bytes, (uint64_t) rows, &bytes)
            || bytes > SIZE_MAX - 1) {
            kiln_error (err, KILN_ELIMIT, "'%s': %lld rows are too large", ios[i].name,
                        (long long) rows);
            goto fail;
        }
        if (!(bufs[i] = calloc (1, bytes ? (size_t) bytes : 1))) {
            kiln_error (err, KILN_ENOMEM, "out of memory for %llu bytes of '%s'",
                        (unsigned long long) bytes, ios[i].name);
            goto fail;
        }
    }
    return bufs;
fail:
    for (int i = 0; i < n; i++)
        free (bufs[i]);
    free (bufs);
    return NULL;
}

static void
s_buffers_free (uint8_t **bufs, int n)
{
    for (int i = 0; bufs && i < n; i++)
        free (bufs[i]);
    free (bufs);
}

kiln_serve_job_t *
kiln_serve_job_new (const kiln_serve_iface_t *iface, int64_t rows, kiln_err_t *err)
{
    if (rows < 1 || rows > iface->max_rows) {
        kiln_error (err, KILN_ELIMIT, "a job of %lld rows: the model takes 1..%lld",
                    (long long) rows, (long long) iface->max_rows);
        return NULL;
    }
    kiln_serve_job_t *self = calloc (1, sizeof *self);
    if (!self) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    self->rows = rows;
    self->n_inputs = iface->n_inputs;
    self->n_outputs = iface->n_outputs;
    sem_init (&self->done, 0, 0);
    if (!(self->inputs = s_buffers (iface->inputs, iface->n_inputs, rows, err))
        || !(self->outputs = s_buffers (iface->outputs, iface->n_outputs, rows, err)))
        kiln_serve_job_destroy (&self);
    return self;
}

void
kiln_serve_job_destroy (kiln_serve_job_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_serve_job_t *self = *self_p;
    s_buffers_free (self->inputs, self->n_inputs);
    s_buffers_free (self->outputs, self->n_outputs);
    sem_destroy (&self->done);
    free (self);
    *self_p = NULL;
}

/* --- running a batch -------------------------------------------------- */

/* Tensor descriptors for `rows` rows at `bufs`. */
static void
s_describe (kiln_rt_tensor_t *ts, const kiln_serve_io_t *ios, int n, uint8_t **bufs,
            int64_t rows, bool batched)
{
    for (int i = 0; i < n; i++) {
        ts[i].dtype = ios[i].dtype;
        ts[i].shape = ios[i].shape;
        if (batched)
            ts[i].shape.dims[0] = rows;
        ts[i].data = bufs[i];
    }
}

/* Room for `rows` rows of several jobs in the worker's gather buffers. */
static int
s_gather_room (s_worker_t *w, int64_t rows, kiln_err_t *err)
{
    const kiln_serve_iface_t *iface = w->batch->iface;
    if (w->gather_rows >= rows)
        return 0;
    s_buffers_free (w->gather_in, iface->n_inputs);
    s_buffers_free (w->gather_out, iface->n_outputs);
    w->gather_out = NULL;
    w->gather_rows = 0;
    if (!(w->gather_in = s_buffers (iface->inputs, iface->n_inputs, rows, err))
        || !(w->gather_out = s_buffers (iface->outputs, iface->n_outputs, rows, err)))
        return -(err ? err->code : KILN_ENOMEM);
    w->gather_rows = rows;
    return 0;
}

static void
s_run (s_worker_t *w, kiln_serve_job_t **jobs, int k, int64_t rows)
{
    kiln_serve_batch_t *self = w->batch;
    const kiln_serve_iface_t *iface = self->iface;
    bool batched = iface->compiled_batch > 0;
    uint8_t **in = jobs[0]->inputs, **out = jobs[0]->outputs;
    kiln_err_t err = { 0 };
    int rc = 0;
    if (k > 1) {
        if ((rc = s_gather_room (w, rows, &err)) != 0)
            goto done;
        in = w->gather_in;
        out = w->gather_out;
        for (int i = 0; i < iface->n_inputs; i++) {
            uint64_t off = 0, row = iface->inputs[i].row_bytes;
            for (int j = 0; j < k; j++) {
                memcpy (in[i] + off, jobs[j]->inputs[i], (size_t) (row * (uint64_t) jobs[j]->rows));
                off += row * (uint64_t) jobs[j]->rows;
            }
        }
    }
    s_describe (w->ins, iface->inputs, iface->n_inputs, in, rows, batched);
    s_describe (w->outs, iface->outputs, iface->n_outputs, out, rows, batched);
    /* The chunks run on the first replicas of this worker's order, all at
     * once: each of their cores is busy for the run. */
    int64_t chunks = batched ? (rows + iface->compiled_batch - 1) / iface->compiled_batch : 1;
    int used = chunks < self->n_replicas ? (int) chunks : self->n_replicas;
    for (int r = 0; r < used; r++)
        kiln_serve_metrics_core_enter (self->cfg.metrics, kiln_model_core (w->replicas[r]));
    rc = batched ? kiln_model_run_batched (w->replicas, self->n_replicas, w->ins,
                                           iface->n_inputs, w->outs, iface->n_outputs, &err)
                 : kiln_model_run (w->replicas[0], w->ins, iface->n_inputs, w->outs,
                                   iface->n_outputs, &err);
    for (int r = 0; r < used; r++)
        kiln_serve_metrics_core_leave (self->cfg.metrics, kiln_model_core (w->replicas[r]));
    kiln_serve_metrics_batch (self->cfg.model_metrics, k, rows);
    if (rc == 0 && k > 1)
        for (int i = 0; i < iface->n_outputs; i++) {
            uint64_t off = 0, row = iface->outputs[i].row_bytes;
            for (int j = 0; j < k; j++) {
                memcpy (jobs[j]->outputs[i], out[i] + off, (size_t) (row * (uint64_t) jobs[j]->rows));
                off += row * (uint64_t) jobs[j]->rows;
            }
        }
done:
    if (rc)
        kiln_log_err ("model '%s': a run of %d requests (%lld rows) failed: %s",
                      self->model, k, (long long) rows, err.msg);
    for (int j = 0; j < k; j++) {
        jobs[j]->rc = rc;
        if (rc)
            jobs[j]->err = err;
        /* After this post the job is its submitter's again. */
        sem_post (&jobs[j]->done);
    }
}

static void
s_deadline (struct timespec *ts, uint64_t ns)
{
    ts->tv_sec = (time_t) (ns / 1000000000ull);
    ts->tv_nsec = (long) (ns % 1000000000ull);
}

static void *
s_worker (void *arg)
{
    s_worker_t *w = arg;
    kiln_serve_batch_t *self = w->batch;
    const int64_t max_rows = self->iface->max_rows;
    kiln_serve_job_t *jobs[KILN_SERVE_MAX_BATCH];
    pthread_mutex_lock (&self->lock);
    for (;;) {
        while (!self->head && !self->stopping)
            pthread_cond_wait (&self->cv, &self->lock);
        if (!self->head)
            break;                  /* stopping, and nothing left to run */
        /* Wait, from the first job's arrival, for the batch to fill. */
        while (self->head && self->queued_rows < max_rows && self->cfg.delay_us > 0
               && max_rows > 1 && !self->stopping) {
            uint64_t deadline = self->head->enqueued_ns + (uint64_t) self->cfg.delay_us * 1000;
            if (kiln_serve_now_ns () >= deadline)
                break;
            struct timespec ts;
            s_deadline (&ts, deadline);
            pthread_cond_timedwait (&self->cv, &self->lock, &ts);
        }
        if (!self->head)
            continue;               /* another worker took them */
        int k = 0;
        int64_t rows = 0;
        while (self->head && k < KILN_SERVE_MAX_BATCH
               && (k == 0 || rows + self->head->rows <= max_rows)) {
            kiln_serve_job_t *job = self->head;
            self->head = job->next;
            if (!self->head)
                self->tail = NULL;
            job->next = NULL;
            jobs[k++] = job;
            rows += job->rows;
        }
        self->queued -= k;
        self->queued_rows -= rows;
        kiln_serve_metrics_queue (self->cfg.model_metrics, -k);
        pthread_mutex_unlock (&self->lock);
        s_run (w, jobs, k, rows);
        pthread_mutex_lock (&self->lock);
    }
    pthread_mutex_unlock (&self->lock);
    return NULL;
}

/* --- the batcher ------------------------------------------------------ */

kiln_serve_batch_t *
kiln_serve_batch_new (kiln_model_t *const *replicas, int n, const kiln_serve_iface_t *iface,
                      const kiln_serve_batch_config_t *cfg, kiln_err_t *err)
{
    if (!replicas || n < 1 || n > KILN_SERVE_MAX_REPLICAS || !iface || !cfg
        || cfg->max_queue < 1) {
        kiln_error (err, KILN_EINVAL, "a batcher needs 1..%d replicas, an interface "
                    "and a queue of at least 1", KILN_SERVE_MAX_REPLICAS);
        return NULL;
    }
    kiln_serve_batch_t *self = calloc (1, sizeof *self);
    if (!self) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    self->iface = iface;
    self->cfg = *cfg;
    snprintf (self->model, sizeof self->model, "%s", cfg->model ? cfg->model : "?");
    self->cfg.model = self->model;
    self->n_replicas = n;
    pthread_mutex_init (&self->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init (&ca);
    pthread_condattr_setclock (&ca, CLOCK_MONOTONIC);
    pthread_cond_init (&self->cv, &ca);
    pthread_condattr_destroy (&ca);
    self->workers = calloc ((size_t) n, sizeof *self->workers);
    if (!self->workers) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        kiln_serve_batch_destroy (&self);
        return NULL;
    }
    for (int w = 0; w < n; w++) {
        s_worker_t *wk = &self->workers[w];
        wk->batch = self;
        for (int r = 0; r < n; r++)
            wk->replicas[r] = replicas[(w + r) % n];
        wk->ins = calloc ((size_t) iface->n_inputs + 1, sizeof *wk->ins);
        wk->outs = calloc ((size_t) iface->n_outputs + 1, sizeof *wk->outs);
        if (!wk->ins || !wk->outs) {
            kiln_error (err, KILN_ENOMEM, "out of memory");
            kiln_serve_batch_destroy (&self);
            return NULL;
        }
        int rc = pthread_create (&wk->thread, NULL, s_worker, wk);
        if (rc) {
            kiln_error (err, KILN_ESYS, "cannot start a batch worker for model '%s': %s",
                        self->model, strerror (rc));
            kiln_serve_batch_destroy (&self);
            return NULL;
        }
        wk->started = true;
    }
    return self;
}

void
kiln_serve_batch_destroy (kiln_serve_batch_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_serve_batch_t *self = *self_p;
    pthread_mutex_lock (&self->lock);
    self->stopping = true;
    pthread_cond_broadcast (&self->cv);
    pthread_mutex_unlock (&self->lock);
    for (int w = 0; self->workers && w < self->n_replicas; w++) {
        s_worker_t *wk = &self->workers[w];
        if (wk->started)
            pthread_join (wk->thread, NULL);
        free (wk->ins);
        free (wk->outs);
        s_buffers_free (wk->gather_in, self->iface->n_inputs);
        s_buffers_free (wk->gather_out, self->iface->n_outputs);
    }
    free (self->workers);
    pthread_cond_destroy (&self->cv);
    pthread_mutex_destroy (&self->lock);
    free (self);
    *self_p = NULL;
}

int
kiln_serve_batch_submit (kiln_serve_batch_t *self, kiln_serve_job_t *job, kiln_err_t *err)
{
    int rc = 0;
    pthread_mutex_lock (&self->lock);
    if (self->stopping)
        rc = kiln_error (err, KILN_ECANCELED, "model '%s': this version is being unloaded",
                         self->model);
    else if (self->queued >= self->cfg.max_queue)
        rc = kiln_error (err, KILN_ELIMIT, "model '%s' is overloaded: %d requests are "
                         "waiting (--max-queue %d)", self->model, self->queued,
                         self->cfg.max_queue);
    else {
        job->next = NULL;
        job->enqueued_ns = kiln_serve_now_ns ();
        if (self->tail)
            self->tail->next = job;
        else
            self->head = job;
        self->tail = job;
        self->queued++;
        self->queued_rows += job->rows;
        kiln_serve_metrics_queue (self->cfg.model_metrics, 1);
        /* Every waiting worker looks: one may be gathering a batch that
         * this job completes. */
        pthread_cond_broadcast (&self->cv);
    }
    pthread_mutex_unlock (&self->lock);
    return rc;
}

void
kiln_serve_batch_wait (kiln_serve_job_t *job)
{
    while (sem_wait (&job->done) != 0 && errno == EINTR)
        ;
}

int
kiln_serve_batch_warm_up (kiln_model_t *const *replicas, int n,
                          const kiln_serve_iface_t *iface, double *ms, kiln_err_t *err)
{
    /* The compiled shapes exactly: one run per replica, on its core. */
    int64_t rows = iface->compiled_batch > 0 ? iface->compiled_batch : 1;
    uint8_t **in = s_buffers (iface->inputs, iface->n_inputs, rows, err);
    uint8_t **out = in ? s_buffers (iface->outputs, iface->n_outputs, rows, err) : NULL;
    kiln_rt_tensor_t *ins = calloc ((size_t) iface->n_inputs + 1, sizeof *ins);
    kiln_rt_tensor_t *outs = calloc ((size_t) iface->n_outputs + 1, sizeof *outs);
    int rc = 0;
    uint64_t t0 = kiln_serve_now_ns ();
    if (!in || !out || !ins || !outs)
        rc = in && out ? kiln_error (err, KILN_ENOMEM, "out of memory") : -KILN_ENOMEM;
    for (int r = 0; rc == 0 && r < n; r++) {
        s_describe (ins, iface->inputs, iface->n_inputs, in, rows, false);
        s_describe (outs, iface->outputs, iface->n_outputs, out, rows, false);
        if ((rc = kiln_model_run (replicas[r], ins, iface->n_inputs, outs, iface->n_outputs,
                                  err)) != 0)
            kiln_error_prefix (err, "warm-up run on replica %d", r);
    }
    if (ms)
        *ms = (double) (kiln_serve_now_ns () - t0) / 1e6;
    s_buffers_free (in, iface->n_inputs);
    s_buffers_free (out, iface->n_outputs);
    free (ins);
    free (outs);
    return rc;
}
