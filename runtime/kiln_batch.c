/*
 * kiln_batch — running models on their cores: kiln_model_run sends a run
 * to the model's core, kiln_model_run_batched splits a batch of any size
 * into chunks of the compiled batch and runs them across replicas on
 * several cores (dynamic batching, seed 001).  Also the small interface
 * accessors that ctypes bindings use instead of kiln_manifest_t.
 *
 * A chunk that lies wholly inside the caller's batch is run straight from
 * and into the caller's buffers (dimension 0 is the outermost, so a chunk
 * is contiguous); only the last, partial chunk is copied into a
 * zero-padded buffer, and only its first rows are copied back out.
 * Replicas take chunks from a shared counter rather than a fixed share,
 * so a core slowed down by other work takes fewer of them.
 */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/kiln_cores.h"
#include "runtime/kiln_pipeline.h"
#include "runtime/kiln_rt.h"
#include "runtime/kiln_rt_priv.h"

#define S_MAX_REPLICAS KILN_CORES_MAX

/* --- one run on the model's core ------------------------------------- */

typedef struct {
    kiln_model_t *m;
    const kiln_rt_tensor_t *inputs;
    int n_inputs;
    kiln_rt_tensor_t *outputs;
    int n_outputs;
    kiln_err_t *err;
    int rc;
} s_run_t;

static void
s_run_job (void *arg)
{
    s_run_t *r = arg;
    r->rc = kiln_model_run_here (r->m, r->inputs, r->n_inputs, r->outputs,
                                 r->n_outputs, r->err);
}

int
kiln_model_run (kiln_model_t *m, const kiln_rt_tensor_t *inputs, int n_inputs,
                kiln_rt_tensor_t *outputs, int n_outputs, kiln_err_t *err)
{
    if (!m || (n_inputs > 0 && !inputs) || (n_outputs > 0 && !outputs))
        return kiln_error (err, KILN_EINVAL, "kiln_model_run needs a model, its "
                           "inputs and its outputs");
    /* A pipelined model's stages are on their own cores: the caller
     * feeds them and waits, so that concurrent callers fill the
     * pipeline. */
    if (kiln_model_pipeline (m))
        return kiln_model_run_here (m, inputs, n_inputs, outputs, n_outputs, err);
    s_run_t r = { m, inputs, n_inputs, outputs, n_outputs, err, 0 };
    int rc = kiln_cores_call (kiln_model_cores (m), kiln_model_core (m), s_run_job,
                              &r, err);
    return rc ? rc : r.rc;
}

/* --- pipelined models ------------------------------------------------ */

int
kiln_model_run_pipelined (kiln_model_t *m, const kiln_rt_tensor_t *const *ins,
                          kiln_rt_tensor_t *const *outs, int n, kiln_err_t *err)
{
    kiln_pipeline_t *pipe = kiln_model_pipeline (m);
    const kiln_manifest_t *man = kiln_model_manifest (m);
    int n_in = man->n_inputs, n_out = man->n_outputs;
    kiln_pipe_req_t *reqs = calloc ((size_t) n + 1, sizeof *reqs);
    void **ptrs = calloc ((size_t) n * (size_t) (n_in + n_out) + 1, sizeof *ptrs);
    if (!reqs || !ptrs) {
        free (reqs);
        free (ptrs);
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    for (int r = 0; r < n; r++) {
        void **in = ptrs + (size_t) r * (size_t) (n_in + n_out), **out = in + n_in;
        for (int i = 0; i < n_in; i++)
            in[i] = ins[r][i].data;
        for (int i = 0; i < n_out; i++)
            out[i] = outs[r][i].data;
        reqs[r] = (kiln_pipe_req_t) { .in = in, .out = out };
    }
    kiln_pipeline_run (pipe, reqs, n);
    int rc = 0;
    for (int r = 0; r < n; r++) {
        if (reqs[r].rc && !rc) {
            *err = reqs[r].err;
            rc = reqs[r].rc;
        }
        for (int i = 0; i < n_out; i++) {
            outs[r][i].dtype = man->outputs[i].dtype;
            outs[r][i].shape = man->outputs[i].shape;
        }
    }
    free (reqs);
    free (ptrs);
    return rc;
}

/* --- the interface -------------------------------------------------- */

static char *
s_io_str (kiln_dtype_t dt, const kiln_shape_t *shape, bool any_batch, char *buf,
          size_t size)
{
    char sh[200];
    kiln_shape_str (shape, sh, sizeof sh);
    if (any_batch && shape->rank >= 1) {
        /* "[1, 3]" -> "[N, 3]" */
        const char *rest = strpbrk (sh, ",]");
        snprintf (buf, size, "%s [N%s", kiln_dtype_name (dt), rest ? rest : "]");
    }
    else
        snprintf (buf, size, "%s %s", kiln_dtype_name (dt), sh);
    return buf;
}

int64_t
kiln_model_batch_size (const kiln_model_t *m, kiln_err_t *err)
{
    if (!m)
        return kiln_error (err, KILN_EINVAL, "no model");
    const kiln_manifest_t *man = kiln_model_manifest (m);
    if (man->n_inputs < 1)
        return kiln_error (err, KILN_EUNSUPPORTED, "the model has no input to "
                           "batch");
    int64_t b = -1;
    const char *first = NULL;
    for (int i = 0; i < man->n_inputs; i++) {
        const kiln_io_t *io = &man->inputs[i];
        if (io->shape.rank < 1)
            return kiln_error (err, KILN_EUNSUPPORTED, "input '%s' is a scalar: "
                               "dynamic batching splits dimension 0", io->name);
        if (b < 0) {
            b = io->shape.dims[0];
            first = io->name;
        }
        else if (io->shape.dims[0] != b)
            return kiln_error (err, KILN_EUNSUPPORTED, "input '%s' has %lld in "
                               "dimension 0, input '%s' %lld: dynamic batching "
                               "needs the same batch in every input", io->name,
                               (long long) io->shape.dims[0], first, (long long) b);
    }
    if (b < 1)
        return kiln_error (err, KILN_EUNSUPPORTED, "input '%s' has an empty "
                           "dimension 0", first);
    for (int i = 0; i < man->n_outputs; i++) {
        const kiln_io_t *io = &man->outputs[i];
        if (io->shape.rank < 1 || io->shape.dims[0] != b) {
            char s[240];
            return kiln_error (err, KILN_EUNSUPPORTED, "output '%s' is %s: its "
                               "dimension 0 is not the batch (%lld), so it cannot "
                               "be joined along it", io->name,
                               s_io_str (io->dtype, &io->shape, false, s, sizeof s),
                               (long long) b);
        }
    }
    return b;
}

int
kiln_model_io_count (const kiln_model_t *m, int output)
{
    if (!m)
        return 0;
    const kiln_manifest_t *man = kiln_model_manifest (m);
    return output ? man->n_outputs : man->n_inputs;
}

int
kiln_model_io (const kiln_model_t *m, int output, int i, const char **name,
               int *dtype, int64_t dims[KILN_MAX_RANK], kiln_err_t *err)
{
    if (!m || i < 0 || i >= kiln_model_io_count (m, output))
        return kiln_error (err, KILN_EINVAL, "the model has no %s %d",
                           output ? "output" : "input", i);
    const kiln_manifest_t *man = kiln_model_manifest (m);
    const kiln_io_t *io = output ? &man->outputs[i] : &man->inputs[i];
    if (name)
        *name = io->name;
    if (dtype)
        *dtype = (int) io->dtype;
    for (int d = 0; dims && d < KILN_MAX_RANK; d++)
        dims[d] = d < io->shape.rank ? io->shape.dims[d] : 0;
    return io->shape.rank;
}

const char *
kiln_model_io_structure (const kiln_model_t *m)
{
    return m ? kiln_model_manifest (m)->io_structure : NULL;
}

size_t
kiln_rt_tensor_sizeof (void)
{
    return sizeof (kiln_rt_tensor_t);
}

size_t
kiln_rt_err_sizeof (void)
{
    return sizeof (kiln_err_t);
}

/* --- dynamic batching ----------------------------------------------- */

/* What a batched run shares between its tasks; read-only once built. */
typedef struct {
    const kiln_manifest_t *man;
    int64_t b;                      /* compiled batch */
    int64_t n;                      /* the caller's batch */
    int64_t chunks;                 /* ceil (n / b) */
    const kiln_rt_tensor_t *inputs; /* the caller's */
    kiln_rt_tensor_t *outputs;      /* the caller's */
    uint64_t *in_row, *out_row;     /* bytes per row of dimension 0 */
    uint8_t **pad_in, **pad_out;    /* the partial last chunk, or NULL */
    _Atomic int64_t next;           /* the next chunk nobody has taken */
} s_batch_t;

/* One replica's work: chunks from the shared counter until none is left
 * or one has failed. */
typedef struct {
    s_batch_t *batch;
    kiln_model_t *model;
    kiln_rt_tensor_t *ins, *outs;   /* scratch descriptors */
    kiln_core_job_t job;
    kiln_err_t err;
    int rc;
    int64_t failed_chunk;           /* chunk of the first error, or -1 */
    bool here;                      /* runs in the calling thread */
} s_task_t;

static void
s_task_run (void *arg)
{
    s_task_t *t = arg;
    s_batch_t *bt = t->batch;
    const kiln_manifest_t *man = bt->man;
    for (;;) {
        int64_t c = atomic_fetch_add (&bt->next, 1);
        if (c >= bt->chunks)
            break;
        bool partial = (c + 1) * bt->b > bt->n;
        for (int i = 0; i < man->n_inputs; i++) {
            t->ins[i].dtype = man->inputs[i].dtype;
            t->ins[i].shape = man->inputs[i].shape;
            t->ins[i].data = partial ? (void *) bt->pad_in[i]
                                     : (uint8_t *) bt->inputs[i].data
                                       + (uint64_t) (c * bt->b) * bt->in_row[i];
        }
        for (int i = 0; i < man->n_outputs; i++)
            t->outs[i].data = partial ? (void *) bt->pad_out[i]
                                      : (uint8_t *) bt->outputs[i].data
                                        + (uint64_t) (c * bt->b) * bt->out_row[i];
        t->rc = kiln_model_run_here (t->model, t->ins, man->n_inputs, t->outs,
                                     man->n_outputs, &t->err);
        if (t->rc) {
            kiln_error_prefix (&t->err, "chunk %lld (rows %lld..%lld)", (long long) c,
                               (long long) (c * bt->b),
                               (long long) ((c + 1) * bt->b - 1));
            t->failed_chunk = c;
            /* The others stop at their next chunk. */
            atomic_store (&bt->next, bt->chunks);
            return;
        }
    }
}

/* Every replica must be the model replicas[0] is. */
static int
s_check_replicas (kiln_model_t *const *replicas, int n, kiln_err_t *err)
{
    if (!replicas || n < 1 || n > S_MAX_REPLICAS)
        return kiln_error (err, KILN_EINVAL, "dynamic batching needs 1..%d replicas, "
                           "got %d", S_MAX_REPLICAS, replicas ? n : 0);
    for (int r = 0; r < n; r++)
        if (!replicas[r])
            return kiln_error (err, KILN_EINVAL, "replica %d is missing", r);
    const kiln_manifest_t *m0 = kiln_model_manifest (replicas[0]);
    for (int r = 1; r < n; r++) {
        const kiln_manifest_t *m = kiln_model_manifest (replicas[r]);
        if (strcmp (m->action_key, m0->action_key) != 0)
            return kiln_error (err, KILN_EINVAL, "replica %d is another model "
                               "(action %.12s, replica 0 is %.12s)", r,
                               m->action_key, m0->action_key);
    }
    return 0;
}

/* The caller's inputs against the compiled ones, all but dimension 0;
 * sets *n to their common dimension 0. */
static int
s_check_inputs (const kiln_manifest_t *man, const kiln_rt_tensor_t *inputs,
                int n_inputs, int64_t *n, kiln_err_t *err)
{
    if (n_inputs != man->n_inputs)
        return kiln_error (err, KILN_EINVAL, "the model takes %d inputs, got %d",
                           man->n_inputs, n_inputs);
    *n = -1;
    const char *first = NULL;
    for (int i = 0; i < n_inputs; i++) {
        const kiln_io_t *io = &man->inputs[i];
        const kiln_rt_tensor_t *t = &inputs[i];
        bool ok = t->dtype == io->dtype && t->shape.rank == io->shape.rank;
        for (int d = 1; ok && d < io->shape.rank; d++)
            ok = t->shape.dims[d] == io->shape.dims[d];
        if (ok && (t->shape.dims[0] < 0 || t->shape.dims[0] > KILN_MAX_DIM))
            ok = false;
        if (!ok) {
            char a[240], b[240];
            kiln_shape_t got = t->shape;
            if (got.rank < 0 || got.rank > KILN_MAX_RANK)
                got.rank = -1;
            return kiln_error (err, KILN_ESHAPE, "input '%s': expected %s with any N, "
                               "received %s; dynamic batching only changes "
                               "dimension 0", io->name,
                               s_io_str (io->dtype, &io->shape, true, a, sizeof a),
                               s_io_str (t->dtype, &got, false, b, sizeof b));
        }
        if (*n < 0) {
            *n = t->shape.dims[0];
            first = io->name;
        }
        else if (t->shape.dims[0] != *n)
            return kiln_error (err, KILN_ESHAPE, "inputs differ in dimension 0: "
                               "'%s' has %lld, '%s' has %lld; dynamic batching needs "
                               "the same batch in every input", first,
                               (long long) *n, io->name,
                               (long long) t->shape.dims[0]);
    }
    return 0;
}

/* Every chunk of a batch of pipelined replicas in flight at once (as
 * far as their slots allow), chunk c through replica c mod n: the chunks
 * are the stream that fills the pipelines. */
static int
s_batch_pipelined (s_batch_t *bt, kiln_model_t *const *replicas, int n_replicas,
                   kiln_err_t *err)
{
    const kiln_manifest_t *man = bt->man;
    int n_in = man->n_inputs, n_out = man->n_outputs;
    int64_t chunks = bt->chunks;
    kiln_pipe_req_t *reqs = calloc ((size_t) chunks + 1, sizeof *reqs);
    void **ptrs = calloc ((size_t) chunks * (size_t) (n_in + n_out) + 1, sizeof *ptrs);
    if (!reqs || !ptrs) {
        free (reqs);
        free (ptrs);
        return kiln_error (err, KILN_ENOMEM, "out of memory for %lld chunks",
                           (long long) chunks);
    }
    for (int64_t c = 0; c < chunks; c++) {
        bool partial = (c + 1) * bt->b > bt->n;
        void **in = ptrs + (size_t) c * (size_t) (n_in + n_out), **out = in + n_in;
        for (int i = 0; i < n_in; i++)
            in[i] = partial ? (void *) bt->pad_in[i]
                            : (uint8_t *) bt->inputs[i].data
                              + (uint64_t) (c * bt->b) * bt->in_row[i];
        for (int i = 0; i < n_out; i++)
            out[i] = partial ? (void *) bt->pad_out[i]
                             : (uint8_t *) bt->outputs[i].data
                               + (uint64_t) (c * bt->b) * bt->out_row[i];
        reqs[c] = (kiln_pipe_req_t) { .in = in, .out = out };
        kiln_pipeline_submit (kiln_model_pipeline (replicas[c % n_replicas]), &reqs[c]);
    }
    int rc = 0;
    for (int64_t c = 0; c < chunks; c++) {
        kiln_pipeline_wait (kiln_model_pipeline (replicas[c % n_replicas]), &reqs[c]);
        if (reqs[c].rc && !rc) {
            *err = reqs[c].err;
            rc = reqs[c].rc;
        }
    }
    free (reqs);
    free (ptrs);
    return rc;
}

static void
s_batch_release (s_batch_t *bt, int n_in, int n_out)
{
    for (int i = 0; bt->pad_in && i < n_in; i++)
        free (bt->pad_in[i]);
    for (int i = 0; bt->pad_out && i < n_out; i++)
        free (bt->pad_out[i]);
    free (bt->pad_in);
    free (bt->pad_out);
    free (bt->in_row);
    free (bt->out_row);
}

/* Row sizes, buffer checks and the padded last chunk. */
static int
s_batch_prepare (s_batch_t *bt, kiln_err_t *err)
{
    const kiln_manifest_t *man = bt->man;
    int n_in = man->n_inputs, n_out = man->n_outputs;
    bt->in_row = calloc ((size_t) n_in + 1, sizeof *bt->in_row);
    bt->out_row = calloc ((size_t) n_out + 1, sizeof *bt->out_row);
    bt->pad_in = calloc ((size_t) n_in + 1, sizeof *bt->pad_in);
    bt->pad_out = calloc ((size_t) n_out + 1, sizeof *bt->pad_out);
    if (!bt->in_row || !bt->out_row || !bt->pad_in || !bt->pad_out)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    bool partial = bt->n % bt->b != 0;
    for (int o = 0; o < 2; o++) {
        const kiln_io_t *ios = o ? man->outputs : man->inputs;
        int count = o ? n_out : n_in;
        for (int i = 0; i < count; i++) {
            uint64_t bytes, total;
            int rc = kiln_shape_bytes (&ios[i].shape, ios[i].dtype, ios[i].name,
                                       &bytes, err);
            if (rc)
                return rc;
            uint64_t row = bytes / (uint64_t) bt->b;
            if (__builtin_mul_overflow (row, (uint64_t) bt->n, &total)
                || total > SIZE_MAX)
                return kiln_error (err, KILN_ELIMIT, "%s '%s': a batch of %lld is "
                                   "too large", o ? "output" : "input", ios[i].name,
                                   (long long) bt->n);
            const void *data = o ? bt->outputs[i].data : bt->inputs[i].data;
            if (!data && total > 0)
                return kiln_error (err, KILN_EINVAL, "%s '%s': no %s", o ? "output"
                                   : "input", ios[i].name, o ? "buffer" : "data");
            (o ? bt->out_row : bt->in_row)[i] = row;
            if (!partial)
                continue;
            uint8_t *pad = calloc (1, bytes ? (size_t) bytes : 1);
            if (!pad)
                return kiln_error (err, KILN_ENOMEM, "out of memory padding %s '%s'",
                                   o ? "output" : "input", ios[i].name);
            (o ? bt->pad_out : bt->pad_in)[i] = pad;
            if (!o) {
                uint64_t rows = (uint64_t) (bt->n - (bt->chunks - 1) * bt->b);
                memcpy (pad, (const uint8_t *) data
                             + (uint64_t) ((bt->chunks - 1) * bt->b) * row,
                        (size_t) (rows * row));
            }
        }
    }
    return 0;
}

int
kiln_model_run_batched (kiln_model_t *const *replicas, int n_replicas,
                        const kiln_rt_tensor_t *inputs, int n_inputs,
                        kiln_rt_tensor_t *outputs, int n_outputs, kiln_err_t *err)
{
    int rc = s_check_replicas (replicas, n_replicas, err);
    if (rc)
        return rc;
    s_batch_t bt = { .man = kiln_model_manifest (replicas[0]),
                     .inputs = inputs, .outputs = outputs };
    const kiln_manifest_t *man = bt.man;
    if ((n_inputs > 0 && !inputs) || (n_outputs > 0 && !outputs))
        return kiln_error (err, KILN_EINVAL, "kiln_model_run_batched needs inputs "
                           "and outputs");
    if (n_outputs != man->n_outputs)
        return kiln_error (err, KILN_EINVAL, "the model has %d outputs, got %d",
                           man->n_outputs, n_outputs);
    if ((bt.b = kiln_model_batch_size (replicas[0], err)) < 0)
        return (int) bt.b;
    if ((rc = s_check_inputs (man, inputs, n_inputs, &bt.n, err)))
        return rc;
    bt.chunks = (bt.n + bt.b - 1) / bt.b;
    atomic_init (&bt.next, 0);

    s_task_t *tasks = NULL;
    int n_tasks = (int) (bt.chunks < n_replicas ? bt.chunks : n_replicas);
    if ((rc = s_batch_prepare (&bt, err)))
        goto done;
    if (kiln_model_pipeline (replicas[0])) {
        n_tasks = 0;
        if ((rc = s_batch_pipelined (&bt, replicas, n_replicas, err)))
            goto done;
        goto joined;
    }
    if (n_tasks > 0) {
        tasks = calloc ((size_t) n_tasks, sizeof *tasks);
        if (!tasks) {
            rc = kiln_error (err, KILN_ENOMEM, "out of memory");
            goto done;
        }
    }
    for (int t = 0; t < n_tasks; t++) {
        s_task_t *task = &tasks[t];
        task->batch = &bt;
        task->model = replicas[t];
        task->failed_chunk = -1;
        task->ins = calloc ((size_t) man->n_inputs + 1, sizeof *task->ins);
        task->outs = calloc ((size_t) man->n_outputs + 1, sizeof *task->outs);
        if (!task->ins || !task->outs) {
            rc = kiln_error (err, KILN_ENOMEM, "out of memory");
            goto done;
        }
    }

    /* Each task goes to its replica's core; one whose core is the calling
     * thread's own (a run from inside a job), or that cannot be queued,
     * runs here, after the others are on their way. */
    kiln_core_latch_t latch;
    kiln_core_latch_init (&latch, n_tasks);
    for (int t = 0; t < n_tasks; t++) {
        s_task_t *task = &tasks[t];
        kiln_cores_t *cores = kiln_model_cores (task->model);
        int core = kiln_model_core (task->model);
        task->job = (kiln_core_job_t) { .fn = s_task_run, .arg = task, .latch = &latch };
        task->here = kiln_cores_current (cores) == core
                     || kiln_cores_submit (cores, core, &task->job, NULL) != 0;
    }
    for (int t = 0; t < n_tasks; t++)
        if (tasks[t].here) {
            s_task_run (&tasks[t]);
            kiln_core_latch_done (&latch);
        }
    kiln_core_latch_wait (&latch);
    kiln_core_latch_release (&latch);

    /* The first error in chunk order is the one reported. */
    s_task_t *failed = NULL;
    for (int t = 0; t < n_tasks; t++)
        if (tasks[t].rc && (!failed || tasks[t].failed_chunk < failed->failed_chunk))
            failed = &tasks[t];
    if (failed) {
        rc = failed->rc;
        if (err)
            *err = failed->err;
        goto done;
    }
joined:
    if (bt.n % bt.b != 0) {
        uint64_t rows = (uint64_t) (bt.n - (bt.chunks - 1) * bt.b);
        for (int i = 0; i < n_outputs; i++)
            memcpy ((uint8_t *) outputs[i].data
                    + (uint64_t) ((bt.chunks - 1) * bt.b) * bt.out_row[i],
                    bt.pad_out[i], (size_t) (rows * bt.out_row[i]));
    }
    for (int i = 0; i < n_outputs; i++) {
        outputs[i].dtype = man->outputs[i].dtype;
        outputs[i].shape = man->outputs[i].shape;
        outputs[i].shape.dims[0] = bt.n;
    }
    rc = 0;
done:
    for (int t = 0; tasks && t < n_tasks; t++) {
        free (tasks[t].ins);
        free (tasks[t].outs);
    }
    free (tasks);
    s_batch_release (&bt, man->n_inputs, man->n_outputs);
    return rc;
}
