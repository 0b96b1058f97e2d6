/*
 * kiln_broker — the farm's broker: one ROUTER socket, one zloop.
 *
 * Clients send COMPILE with the graph structure and the blob list.  The
 * broker checks the graph (decodes the structure, recomputes the graph
 * digest and the action key rather than trusting the client's), answers
 * from the action cache or the failure cache when it can, joins a job
 * already building the same action, asks for the blobs it lacks
 * (MISSING; the client uploads them as CHUNKs under credit flow control),
 * and otherwise queues a job.  A GET fetches a stored artifact by its
 * content hash (kiln_download); PIN and UNPIN keep one from eviction.
 * The scheduler (kiln_sched) hands queued jobs to idle workers offering
 * the job's toolchain, fairly across clients, preferring a worker that
 * already holds the job's blobs.  A worker FETCHes the blobs it lacks,
 * compiles, and sends DONE; the broker checks the artifact against the
 * job, signs it with the farm key and provenance, stores it, records the
 * action, and sends RESULT to every client waiting for that action key.  docs/protocol.md has the messages
 * and the job state machine; docs/operations.md how to run it.
 *
 * State, all owned by the broker and touched only from its loop:
 *   workers   by routing id: identity, toolchains, slots, busy, blobs held,
 *             last seen
 *   clients   by routing id: identity (tenant), last seen, requests held,
 *             upload credit, uploads in progress
 *   jobs      by action key (one job per action, however many clients
 *             wait) and by job id: state (QUEUED, RUNNING), the graph
 *             structure, blob refs (pinned in the store), waiters,
 *             dispatches, workers lost while running it, a log
 *   queue     QUEUED jobs, per client (kiln_sched)
 *   downloads GETs being answered, stored artifacts sent in PARTs under
 *             the client's credit (kiln_download)
 * Invariants: a RUNNING job has exactly one worker and counts in that
 * worker's busy; a QUEUED job is in the scheduler exactly once; busy <=
 * slots; a client's `pending` is the number of waiters it has.
 *
 * Liveness follows the Paranoid Pirate pattern: broker and workers
 * heartbeat each other every heartbeat_ms, clients heartbeat the broker
 * while they wait; a peer silent for liveness_ms (or whose connection the
 * transport closed) is dropped.  A dropped worker's jobs are requeued at
 * the head of their queue; a job that was running on max_deaths workers
 * that died fails with its history and log.  A dropped client's requests
 * are released, and a job nobody waits for any more is cancelled.
 *
 * Persistence: the store (kiln_store) survives a crash; jobs do not.
 * Clients resubmit what the broker no longer holds (their heartbeat tells
 * them how many requests it holds for them), so after a restart every
 * waiting client gets its artifact: from the cache if the build had
 * finished, from a new build otherwise.
 *
 * The code: kiln_broker.c is the loop and the command table (command,
 * peer kind, handler); the handlers live in kiln_broker_jobs.c (the job
 * state machine, scheduling), kiln_broker_admit.c (COMPILE),
 * kiln_broker_upload.c (FIND, CHUNK), kiln_broker_peers.c (workers and
 * clients), kiln_broker_artifacts.c (GET, PIN) and kiln_broker_status.c;
 * kiln_broker_priv.h holds what they share.
 */
#ifndef KILN_BROKER_H
#define KILN_BROKER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kiln_error.h"

typedef struct kiln_broker kiln_broker_t;

#define KILN_BROKER_MAX_UPLOADS 1024     /* --max-uploads at most (two threads each) */

typedef struct kiln_broker_config {
    const char *endpoint;        /* --listen */
    const char *state_dir;       /* --state: store, action and failure cache */
    const char *key_path;        /* --key: the farm's private key (PEM) */
    const char *name;            /* provenance "broker"; NULL = hostname */
    int heartbeat_ms;            /* 0 = 1000 */
    int liveness_ms;             /* workers and clients; 0 = 5000 */
    int max_deaths;              /* workers lost with a job before it fails; 0 = 3 */
    int max_dispatches;          /* dispatches of one job in all; 0 = 10 */
    uint64_t max_queued_bytes;   /* graph structures held for jobs; 0 = 4 GiB */
    uint64_t store_max_bytes;    /* store size cap; 0 = KILN_STORE_DEFAULT_MAX_BYTES */
    uint64_t default_timeout_ms; /* compile timeout when a request names none; 0 = 600 s */
    int credit_window;           /* upload chunks in flight per client; 0 = 32 */
    int max_uploads;             /* blob uploads in progress, all clients; 0 = 16 */
    const char *cert_path;       /* CurveZMQ: the broker's certificate (with _secret) */
    const char *trust_dir;       /* CurveZMQ: certificates of clients and workers allowed */
    const char *metrics_listen;  /* --metrics HOST:PORT: Prometheus /metrics; NULL = none */
    int cross_check;             /* --cross-check: a kiln_xcheck_policy_t (0 = always) */
    int cross_check_n;           /* its N for sample:N and new-workers:N */
} kiln_broker_config_t;

/* How often a build is cross-checked by a second, different worker
 * (--cross-check; docs/security.md, "A hostile worker"). */
typedef enum {
    KILN_XCHECK_ALWAYS = 0,      /* every build, when another worker can check it */
    KILN_XCHECK_NEW_WORKERS,     /* until its builder has N builds confirmed (default 20) */
    KILN_XCHECK_SAMPLE,          /* one build in N, at random */
    KILN_XCHECK_OFF,             /* never: a worker's word is taken */
} kiln_xcheck_policy_t;

/* Parse a --cross-check value ("always", "new-workers[:N]", "sample:N",
 * "off") into cfg->cross_check and cfg->cross_check_n. */
int kiln_broker_parse_cross_check (const char *text, kiln_broker_config_t *cfg,
                                   kiln_err_t *err);

/* Load the key, open the store, bind the socket.  Without cert_path and
 * trust_dir only a loopback endpoint is accepted.  Caller owns the
 * broker. */
kiln_broker_t *kiln_broker_new (const kiln_broker_config_t *cfg, kiln_err_t *err);
void kiln_broker_destroy (kiln_broker_t **self_p);

/* The port /metrics listens on (with metrics_listen), else 0. */
int kiln_broker_metrics_port (const kiln_broker_t *self);

/* Serve until SIGINT/SIGTERM.  Returns 0 on an orderly stop. */
int kiln_broker_run (kiln_broker_t *self);

#endif
