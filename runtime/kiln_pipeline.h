/*
 * kiln_pipeline — running a pipelined program (compiled with
 * --pipeline-cores N) as N stages on N execution cores.  Internal to
 * libkilnrt; kiln_rt.c makes one for a model whose program has stages,
 * kiln_batch.c sends runs to it.
 *
 * Each stage runs its ops (program.kbin "stages") on its own core's
 * executor, in an arena of its own: the weights its ops read are touched
 * by that core only, and the stages of several inputs run at once.
 * Between stages an input's live bytes travel in a slot: stage s copies
 * what stage s+1 receives (its handoff ranges) out of its arena into the
 * slot, stage s+1 copies them into its own at the same offsets.  The
 * pipeline has 2·N slots: at most that many inputs are in flight, and a
 * caller waits for a free slot before its input enters (the queues
 * between stages are bounded by the slots).  Every stage runs the same
 * kernels on the same offsets as the unpipelined program would, so one
 * input gives the same bits.
 *
 * Scheduling: a stage with queued slots has one job on its core that
 * takes slots until its queue is empty; a slot it finishes goes to the
 * next stage's queue (starting that stage's job when it has none), or,
 * after the last stage, its outputs are copied out and its caller woken.
 * Cores stay shared with other models: a stage job is one job on the
 * core's FIFO, like any run.
 *
 * Invariants:
 *   - a slot is in at most one place: the free list, one stage's queue,
 *     or being run by that stage's job;
 *   - a stage has at most one job queued or running (`active`), so its
 *     arena is used by one run at a time; a run from a thread that cannot
 *     wait for the cores (an executor of a stage's core, a forked child)
 *     runs the stages in that thread, each under its stage's lock;
 *   - kiln_pipeline_destroy waits until every job has returned.
 */
#ifndef KILN_PIPELINE_H
#define KILN_PIPELINE_H

#include <stdbool.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_program.h"
#include "runtime/kiln_cores.h"
#include "runtime/kiln_kernels.h"

typedef struct kiln_pipeline kiln_pipeline_t;

/* One input of a run: the data of each program input (manifest order)
 * and the buffer of each output, both checked by the caller. */
typedef struct kiln_pipe_req {
    void *const *in;
    void *const *out;
    bool done;                      /* the pipeline's business */
    int rc;                         /* 0, or the first stage's fault */
    kiln_err_t err;                 /* (kiln_exec_run) and its message */
} kiln_pipe_req_t;

/* A pipeline for the stages of `p` (p->n_stages > 0) on the cores
 * stage_cores[p->n_stages] of `cores`; `weights` is weights.bin.  `p`,
 * `plans` (one per op, prepared), `weights` and `cores` must outlive it.
 * Caller owns the result. */
kiln_pipeline_t *kiln_pipeline_new (const kiln_program_t *p, const kiln_kplan_t *plans,
                                    const uint8_t *weights, kiln_cores_t *cores,
                                    const int *stage_cores, kiln_err_t *err);
/* Wait for the stage jobs still returning, print the stages' profiles
 * (KILN_RT_PROFILE) and free. */
void kiln_pipeline_destroy (kiln_pipeline_t **self_p);

/* Send one input into the pipeline: waits for a free slot, queues it at
 * stage 0 and returns; `req` must stay alive until kiln_pipeline_wait
 * has returned for it.  Any number of threads may submit at once: their
 * inputs share the pipeline.  From a thread that cannot wait for the
 * stages' cores (kiln_pipeline.h, above) the input runs to the end
 * before this returns. */
void kiln_pipeline_submit (kiln_pipeline_t *self, kiln_pipe_req_t *req);
/* Wait until `req` has left the last stage (its outputs written). */
void kiln_pipeline_wait (kiln_pipeline_t *self, kiln_pipe_req_t *req);
/* Submit reqs[n] one after another and wait for them all. */
void kiln_pipeline_run (kiln_pipeline_t *self, kiln_pipe_req_t *reqs, int n);

/* KILN_RT_PIPELINE_SHARE=1: a pipelined model may be loaded on fewer
 * cores than it has stages, its stages sharing them round-robin. */
bool kiln_pipeline_may_share (void);

/* The manifest's record of the stages (docs/artifact-format.md) must be
 * the program's: as many stages, starting at the same ops.  An error
 * names what differs. */
int kiln_pipeline_check_manifest (const kiln_manifest_t *man,
                                  const kiln_program_t *p, kiln_err_t *err);

/* The number of stages, and the core of stage s (-1 when out of range). */
int kiln_pipeline_stages (const kiln_pipeline_t *self);
int kiln_pipeline_core (const kiln_pipeline_t *self, int stage);

#endif
