/*
 * kiln_worker — a farm worker: one DEALER socket to the broker, one zloop,
 * and a child process per running job.
 *
 * The worker registers with READY (its name, slots, compiler id, version
 * and target).  For each JOB it writes the graph (structure + blobs, each
 * blob checked against its digest) to WORKDIR/model.kgraph in a fresh
 * private temp directory, and runs the compiler in a child process:
 *     kiln-cc WORKDIR/model.kgraph -o WORKDIR/out.kar --unsigned
 *             [--compiler-args ARGS]
 * with stdin from /dev/null, stdout and stderr captured into the job's log
 * (at most KILN_MAX_LOG_BYTES kept), in its own process group, killed when
 * it outlives the timeout or the worker.  It answers DONE with the
 * unsigned artifact, or with the failure and the log, and removes the
 * workdir.
 *
 * Liveness: the worker sends HEARTBEAT every heartbeat_ms; when nothing has
 * come from the broker for liveness_ms it drops its running jobs (the
 * broker will have requeued them), opens a new socket and registers again,
 * so that a restarted broker gets its workers back.  An ERROR "unknown
 * worker" (ENOTFOUND) from the broker makes it register again at once, and
 * so does a message from the broker that it cannot read (it may have been a
 * JOB the broker now waits for): registering again makes the broker requeue
 * whatever it thinks this worker holds.
 */
#ifndef KILN_WORKER_H
#define KILN_WORKER_H

#include "common/kiln_error.h"

typedef struct kiln_worker kiln_worker_t;

typedef struct kiln_worker_config {
    const char *endpoint;        /* --broker tcp://127.0.0.1:PORT */
    const char *name;            /* --name; NULL = hostname:pid */
    int slots;                   /* --slots; 0 = 1 */
    const char *cc_path;         /* --cc; NULL = kiln-cc next to this program */
    int timeout_s;               /* --timeout per compile; 0 = 600 */
    int heartbeat_ms;            /* 0 = 1000 */
    int liveness_ms;             /* 0 = 5000 */
} kiln_worker_config_t;

/* Check the configuration and find the compiler.  Caller owns the worker. */
kiln_worker_t *kiln_worker_new (const kiln_worker_config_t *cfg, kiln_err_t *err);
/* Kill running children, remove their workdirs, free; *self_p = NULL. */
void kiln_worker_destroy (kiln_worker_t **self_p);

/* Serve until SIGINT/SIGTERM; then tell the broker (DISCONNECT) so that
 * it requeues this worker's jobs at once.  Returns 0 on an orderly stop. */
int kiln_worker_run (kiln_worker_t *self);

#endif
