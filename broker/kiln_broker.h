/*
 * kiln_broker — the farm's broker: one ROUTER socket, one zloop.
 *
 * Clients send COMPILE; the broker checks the graph (decodes the
 * structure, hashes every blob, recomputes the graph digest and the action
 * key rather than trusting the client's), answers from the action cache
 * when it can, and otherwise queues a job and hands it to an idle worker
 * with a matching compiler.  When the worker sends DONE, the broker checks
 * the artifact against the job, signs it with the farm key and provenance,
 * stores it, records the action, and sends RESULT to every client waiting
 * for that action key.  docs/protocol.md has the messages and the job
 * state machine.
 *
 * State, all owned by the broker and touched only from its loop:
 *   workers   by routing id: name, compiler, slots, busy count, last seen
 *   jobs      by action key (one job per action, however many clients wait)
 *             and by job id; each job has an id, a state (QUEUED,
 *             RUNNING), attempts, its graph bytes and its waiters
 *   queue     QUEUED jobs, oldest first
 * Invariants: a RUNNING job has exactly one worker and counts in that
 * worker's busy; a QUEUED job is in the queue exactly once; busy <= slots.
 * Workers heartbeat every heartbeat_ms; one silent for liveness_ms is
 * dropped and its jobs go back to the head of the queue, up to
 * max_attempts dispatches per job.
 */
#ifndef KILN_BROKER_H
#define KILN_BROKER_H

#include <stdint.h>

#include "common/kiln_error.h"

typedef struct kiln_broker kiln_broker_t;

typedef struct kiln_broker_config {
    const char *endpoint;        /* --listen: a loopback endpoint */
    const char *state_dir;       /* --state: CAS and action cache */
    const char *key_path;        /* --key: the farm's private key (PEM) */
    const char *name;            /* provenance "broker"; NULL = hostname */
    int heartbeat_ms;            /* 0 = 1000 */
    int liveness_ms;             /* 0 = 5000 */
    int max_attempts;            /* dispatches per job; 0 = 3 */
    uint64_t max_queued_bytes;   /* graph bytes held for jobs; 0 = 4 GiB */
} kiln_broker_config_t;

/* Load the key, open the store, bind the socket.  Refuses a non-loopback
 * endpoint (no CurveZMQ yet).  Caller owns the broker. */
kiln_broker_t *kiln_broker_new (const kiln_broker_config_t *cfg, kiln_err_t *err);
void kiln_broker_destroy (kiln_broker_t **self_p);

/* Serve until SIGINT/SIGTERM.  Returns 0 on an orderly stop. */
int kiln_broker_run (kiln_broker_t *self);

#endif
