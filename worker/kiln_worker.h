/*
 * kiln_worker — a farm worker: one DEALER socket to the broker, one zloop,
 * a local blob cache, and a child process per running job.
 *
 * The worker registers with READY: its name, slots, the toolchains it
 * runs (kiln_toolchain: the builtin compiler and any `--toolchain
 * NAME=COMMAND`), and the blobs its cache holds.  For each JOB it takes
 * the blobs that came inline, FETCHes the others it does not hold from
 * the broker in 1 MiB chunks (at most `window` in flight, asking for more
 * as they arrive), checking each blob against its digest, then writes
 * WORKDIR/model.kgraph in a fresh private directory and runs the
 * toolchain in a child process, in the compile sandbox and under the
 * job's resource limits (kiln_sandbox.h): stdin from /dev/null, stdout and stderr
 * captured into the job's log (at most KILN_MAX_LOG_BYTES kept; new
 * output goes to the broker as LOG every second, so a job that takes
 * the worker down still leaves its output), in its own process group,
 * killed when it outlives the job's timeout (at most the worker's own),
 * when the broker CANCELs it, or with the worker.  It answers DONE with
 * the unsigned artifact, or with the failure and the log, and removes
 * the workdir.
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

#include <stdint.h>

#include "common/kiln_error.h"
#include "worker/kiln_sandbox.h"

#define KILN_WORKER_MAX_TOOLCHAINS 63          /* --toolchain options */

typedef struct kiln_worker kiln_worker_t;

typedef struct kiln_worker_config {
    const char *endpoint;        /* --broker tcp://HOST:PORT */
    const char *name;            /* --name; NULL = hostname:pid */
    int slots;                   /* --slots; 0 = 1 */
    const char *cc_path;         /* --cc; NULL = kiln-cc next to this program */
    int timeout_s;               /* --timeout: longest compile; 0 = 600 */
    int heartbeat_ms;            /* 0 = 1000 */
    int liveness_ms;             /* 0 = 5000 */
    const char *target;          /* --target of external toolchains; NULL = the builtin's */
    const char *toolchains[KILN_WORKER_MAX_TOOLCHAINS];   /* --toolchain NAME=COMMAND */
    int n_toolchains;
    int no_builtin;              /* --no-builtin: offer only the external toolchains */
    const char *cache_dir;       /* --cache; NULL = a private directory removed at exit */
    uint64_t cache_max_bytes;    /* --cache-max-bytes; 0 = 16 GiB */
    int window;                  /* FETCH chunks in flight; 0 = 16 */
    const char *cert_path;       /* CurveZMQ: this worker's certificate */
    const char *broker_cert;     /* CurveZMQ: the broker's public certificate */
    kiln_sandbox_kind_t sandbox; /* --sandbox bwrap (default) | none */
    uint64_t max_memory;         /* --max-memory per compile; 0 = 3/4 of RAM / slots */
    int max_procs;               /* --max-procs per compile; 0 = 512 */
    unsigned sandbox_uid;        /* --sandbox-uid: a root worker's first compile uid; 0 = 65536 */
} kiln_worker_config_t;

/* Check the configuration, find the compiler, open the cache.  Caller
 * owns the worker. */
kiln_worker_t *kiln_worker_new (const kiln_worker_config_t *cfg, kiln_err_t *err);
/* Kill running children, remove their workdirs, free; *self_p = NULL. */
void kiln_worker_destroy (kiln_worker_t **self_p);

/* Serve until SIGINT/SIGTERM; then tell the broker (DISCONNECT) so that
 * it requeues this worker's jobs at once.  Returns 0 on an orderly stop. */
int kiln_worker_run (kiln_worker_t *self);

#endif
