/*
 * kiln_pipeline — a pipelined program's stages on their cores.  See
 * kiln_pipeline.h for the contract.
 */
#include "runtime/kiln_pipeline.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/kiln_exec.h"
#include "runtime/kiln_rt_priv.h"

#define S_SLOTS_PER_STAGE 2

typedef struct s_slot {
    uint8_t *buf;                   /* the bytes between two stages */
    kiln_pipe_req_t *req;           /* the input it carries */
    struct s_slot *next;            /* free list or queue link */
} s_slot_t;

typedef struct s_stage {
    struct kiln_pipeline *pipe;
    int index;
    int first, end;                 /* its ops */
    int core;
    const kiln_prog_stage_t *in;    /* what it receives (program.kbin) */
    kiln_exec_t *exec;              /* its ops, workspace and profile */
    uint8_t *arena;                 /* its own, arena_size bytes */
    void **data;                    /* tensor addresses: its arena, weights */
    pthread_mutex_t run_mu;         /* one run of the stage at a time */
    s_slot_t *head, *tail;          /* its queue (under pipe->mu) */
    bool active;                    /* a job is queued or running (pipe->mu) */
    kiln_core_job_t job;            /* that job; reused once it has returned */
} s_stage_t;

struct kiln_pipeline {
    const kiln_program_t *p;
    kiln_cores_t *cores;
    s_stage_t *stages;
    int n_stages;
    s_slot_t *slots;
    int n_slots;
    s_slot_t *free_slots;           /* under mu */
    uint64_t buf_bytes;             /* the largest handoff */
    pthread_mutex_t mu;             /* queues, free list, requests' done */
    pthread_cond_t cv;              /* a slot was freed or a request done */
    kiln_core_latch_t jobs;         /* stage jobs not yet returned */
    pthread_mutex_t inline_mu;      /* runs in the caller's thread */
    uint8_t *inline_buf;            /* their slot buffer */
    int pid;                        /* the process it was made in */
};

/* Run stage `st` on the input `req`, whose bytes from the stage before
 * are in `buf`; leaves in `buf` what the next stage receives, or copies
 * the outputs out after the last stage. */
static void
s_stage_run (s_stage_t *st, kiln_pipe_req_t *req, uint8_t *buf)
{
    const kiln_program_t *p = st->pipe->p;
    pthread_mutex_lock (&st->run_mu);
    if (st->index == 0) {
        for (int i = 0; i < p->n_inputs; i++) {
            int t = p->inputs[i];
            memcpy (st->data[t], req->in[i], (size_t) p->tensors[t].size);
        }
    } else {
        uint64_t at = 0;
        for (int r = 0; r < st->in->n_handoff; r++) {
            const kiln_prog_range_t *rg = &st->in->handoff[r];
            memcpy (st->arena + rg->offset, buf + at, (size_t) rg->size);
            at += rg->size;
        }
    }
    kiln_err_t fault;
    if (kiln_exec_run (st->exec, st->data, &fault) && !req->rc) {
        req->err = fault;
        req->rc = -fault.code;
    }
    if (st->index + 1 < st->pipe->n_stages) {
        const kiln_prog_stage_t *next = st[1].in;
        uint64_t at = 0;
        for (int r = 0; r < next->n_handoff; r++) {
            const kiln_prog_range_t *rg = &next->handoff[r];
            memcpy (buf + at, st->arena + rg->offset, (size_t) rg->size);
            at += rg->size;
        }
    } else {
        for (int i = 0; i < p->n_outputs; i++) {
            int t = p->outputs[i];
            memcpy (req->out[i], st->data[t], (size_t) p->tensors[t].size);
        }
    }
    pthread_mutex_unlock (&st->run_mu);
}

static void s_drain (void *arg);

/* Give stage `st` a job on its core (it is marked active by the caller,
 * under mu, which the caller does not hold now).  One that cannot be
 * queued runs here. */
static void
s_start (s_stage_t *st)
{
    kiln_pipeline_t *self = st->pipe;
    kiln_core_latch_add (&self->jobs, 1);
    st->job = (kiln_core_job_t) { .fn = s_drain, .arg = st, .latch = &self->jobs };
    if (kiln_cores_submit (self->cores, st->core, &st->job, NULL) != 0) {
        s_drain (st);
        kiln_core_latch_done (&self->jobs);
    }
}

/* A stage's job: take slots from its queue until it is empty. */
static void
s_drain (void *arg)
{
    s_stage_t *st = arg;
    kiln_pipeline_t *self = st->pipe;
    pthread_mutex_lock (&self->mu);
    for (;;) {
        s_slot_t *slot = st->head;
        if (!slot) {
            st->active = false;
            break;
        }
        st->head = slot->next;
        if (!st->head)
            st->tail = NULL;
        pthread_mutex_unlock (&self->mu);
        s_stage_run (st, slot->req, slot->buf);
        pthread_mutex_lock (&self->mu);
        if (st->index + 1 < self->n_stages) {
            s_stage_t *next = st + 1;
            slot->next = NULL;
            if (next->tail)
                next->tail->next = slot;
            else
                next->head = slot;
            next->tail = slot;
            if (!next->active) {
                next->active = true;
                pthread_mutex_unlock (&self->mu);
                s_start (next);
                pthread_mutex_lock (&self->mu);
            }
        } else {
            slot->req->done = true;
            slot->req = NULL;
            slot->next = self->free_slots;
            self->free_slots = slot;
            pthread_cond_broadcast (&self->cv);
        }
    }
    pthread_mutex_unlock (&self->mu);
}

kiln_pipeline_t *
kiln_pipeline_new (const kiln_program_t *p, const kiln_kplan_t *plans,
                   const uint8_t *weights, kiln_cores_t *cores,
                   const int *stage_cores, kiln_err_t *err)
{
    kiln_pipeline_t *self = calloc (1, sizeof *self);
    if (!self) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    self->p = p;
    self->cores = cores;
    self->pid = (int) getpid ();
    pthread_mutex_init (&self->mu, NULL);
    pthread_cond_init (&self->cv, NULL);
    pthread_mutex_init (&self->inline_mu, NULL);
    kiln_core_latch_init (&self->jobs, 0);
    int n = p->n_stages;
    self->stages = calloc ((size_t) n, sizeof *self->stages);
    if (!self->stages) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    for (int s = 0; s < n; s++) {
        s_stage_t *st = &self->stages[s];
        st->pipe = self;
        st->index = s;
        st->first = p->stages[s].first_op;
        st->end = s + 1 < n ? p->stages[s + 1].first_op : p->n_ops;
        st->core = stage_cores[s];
        st->in = &p->stages[s];
        pthread_mutex_init (&st->run_mu, NULL);
        self->n_stages++;
        uint64_t bytes = 0;
        for (int r = 0; r < st->in->n_handoff; r++)
            bytes += st->in->handoff[r].size;   /* disjoint, in the arena */
        if (bytes > self->buf_bytes)
            self->buf_bytes = bytes;
        char label[64];
        snprintf (label, sizeof label, "stage %d of %d (ops %d..%d) on core %d", s, n,
                  st->first, st->end - 1, st->core);
        st->arena = kiln_rt_aligned_zalloc (p->arena_size);
        st->data = calloc ((size_t) p->n_tensors + 1, sizeof *st->data);
        if (!st->arena || !st->data) {
            kiln_error (err, KILN_ENOMEM, "out of memory allocating stage %d's arena "
                        "of %llu bytes", s, (unsigned long long) p->arena_size);
            goto fail;
        }
        if (!(st->exec = kiln_exec_new_range (p, plans, st->first, st->end, label, err)))
            goto fail;
        for (int t = 0; t < p->n_tensors; t++) {
            const kiln_prog_tensor_t *pt = &p->tensors[t];
            st->data[t] = pt->kind == KILN_TK_WEIGHT ? (void *) (weights + pt->offset)
                                                     : (void *) (st->arena + pt->offset);
        }
    }
    self->n_slots = S_SLOTS_PER_STAGE * n;
    self->slots = calloc ((size_t) self->n_slots, sizeof *self->slots);
    self->inline_buf = kiln_rt_aligned_zalloc (self->buf_bytes);
    if (!self->slots || !self->inline_buf) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    for (int i = 0; i < self->n_slots; i++) {
        s_slot_t *slot = &self->slots[i];
        if (!(slot->buf = kiln_rt_aligned_zalloc (self->buf_bytes))) {
            kiln_error (err, KILN_ENOMEM, "out of memory allocating %d pipeline "
                        "slots of %llu bytes", self->n_slots,
                        (unsigned long long) self->buf_bytes);
            goto fail;
        }
        slot->next = self->free_slots;
        self->free_slots = slot;
    }
    return self;
fail:
    kiln_pipeline_destroy (&self);
    return NULL;
}

void
kiln_pipeline_destroy (kiln_pipeline_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_pipeline_t *self = *self_p;
    kiln_core_latch_wait (&self->jobs);
    kiln_core_latch_release (&self->jobs);
    for (int s = 0; s < self->n_stages; s++) {
        s_stage_t *st = &self->stages[s];
        kiln_exec_destroy (&st->exec);
        free (st->arena);
        free (st->data);
        pthread_mutex_destroy (&st->run_mu);
    }
    for (int i = 0; self->slots && i < self->n_slots; i++)
        free (self->slots[i].buf);
    free (self->slots);
    free (self->stages);
    free (self->inline_buf);
    pthread_mutex_destroy (&self->inline_mu);
    pthread_cond_destroy (&self->cv);
    pthread_mutex_destroy (&self->mu);
    free (self);
    *self_p = NULL;
}

int
kiln_pipeline_stages (const kiln_pipeline_t *self)
{
    return self ? self->n_stages : 0;
}

int
kiln_pipeline_core (const kiln_pipeline_t *self, int stage)
{
    if (!self || stage < 0 || stage >= self->n_stages)
        return -1;
    return self->stages[stage].core;
}

/* True when the calling thread must not wait for the stages' cores: it
 * is the executor of one of them (its own job would wait behind it), or
 * it runs in a child forked from the process that made the pipeline. */
static bool
s_run_here (const kiln_pipeline_t *self)
{
    if (self->pid != (int) getpid ())
        return true;
    int me = kiln_cores_current (self->cores);
    for (int s = 0; me >= 0 && s < self->n_stages; s++)
        if (self->stages[s].core == me)
            return true;
    return false;
}

void
kiln_pipeline_submit (kiln_pipeline_t *self, kiln_pipe_req_t *req)
{
    req->done = false;
    if (s_run_here (self)) {
        pthread_mutex_lock (&self->inline_mu);
        for (int s = 0; s < self->n_stages; s++)
            s_stage_run (&self->stages[s], req, self->inline_buf);
        pthread_mutex_unlock (&self->inline_mu);
        pthread_mutex_lock (&self->mu);
        req->done = true;
        pthread_mutex_unlock (&self->mu);
        return;
    }
    s_stage_t *first = &self->stages[0];
    pthread_mutex_lock (&self->mu);
    while (!self->free_slots)
        pthread_cond_wait (&self->cv, &self->mu);
    s_slot_t *slot = self->free_slots;
    self->free_slots = slot->next;
    slot->req = req;
    slot->next = NULL;
    if (first->tail)
        first->tail->next = slot;
    else
        first->head = slot;
    first->tail = slot;
    bool start = !first->active;
    first->active = true;
    pthread_mutex_unlock (&self->mu);
    if (start)
        s_start (first);
}

void
kiln_pipeline_wait (kiln_pipeline_t *self, kiln_pipe_req_t *req)
{
    pthread_mutex_lock (&self->mu);
    while (!req->done)
        pthread_cond_wait (&self->cv, &self->mu);
    pthread_mutex_unlock (&self->mu);
}

void
kiln_pipeline_run (kiln_pipeline_t *self, kiln_pipe_req_t *reqs, int n)
{
    for (int i = 0; i < n; i++)
        kiln_pipeline_submit (self, &reqs[i]);
    for (int i = 0; i < n; i++)
        kiln_pipeline_wait (self, &reqs[i]);
}

bool
kiln_pipeline_may_share (void)
{
    const char *v = getenv ("KILN_RT_PIPELINE_SHARE");
    return v && strcmp (v, "1") == 0;
}

int
kiln_pipeline_check_manifest (const kiln_manifest_t *man, const kiln_program_t *p,
                              kiln_err_t *err)
{
    if (man->n_stages != p->n_stages)
        return kiln_error (err, KILN_EFORMAT, "the manifest lists %d pipeline stages, "
                           "member '%s' %d", man->n_stages, KILN_PROGRAM_MEMBER,
                           p->n_stages);
    for (int s = 0; s < p->n_stages; s++) {
        int end = s + 1 < p->n_stages ? p->stages[s + 1].first_op : p->n_ops;
        const kiln_stage_info_t *st = &man->stages[s];
        if (st->first_op != p->stages[s].first_op
            || st->n_ops != end - p->stages[s].first_op)
            return kiln_error (err, KILN_EFORMAT, "pipeline stage %d: the manifest "
                               "says ops %d..%d, member '%s' %d..%d", s, st->first_op,
                               st->first_op + st->n_ops - 1, KILN_PROGRAM_MEMBER,
                               p->stages[s].first_op, end - 1);
    }
    return 0;
}
