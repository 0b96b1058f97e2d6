/*
 * kiln_broker_priv — what the broker's files share and nobody else sees:
 * its bounds, the records of workers, clients, jobs and uploads, the
 * broker struct, and the functions one file calls in another.  Not
 * installed; programs use kiln_broker.h.
 *
 * Where each part lives (docs/protocol.md, "Where the broker's code
 * lives", has the same list):
 *   kiln_broker.c            the loop: new/destroy/run, receiving a batch,
 *                            the command table and its routing, the
 *                            outbox held until the store's commit,
 *                            heartbeats and liveness, CurveZMQ
 *   kiln_broker_jobs.c       the job state machine (QUEUED, RUNNING, and
 *                            out: succeeded, failed, canceled), scheduling
 *                            jobs onto workers, DONE, LOG, FETCH
 *   kiln_broker_admit.c      admission: COMPILE checked, answered from the
 *                            caches, joined to a job or queued; CANCEL
 *   kiln_broker_upload.c     the upload path: FIND, CHUNK under credit,
 *                            the store's blob writers' news
 *   kiln_broker_peers.c      workers (READY, drop) and clients (get, drop)
 *   kiln_broker_trust.c      revocation: peers whose certificate left --trust
 *   kiln_broker_artifacts.c  artifacts by content hash: GET (kiln_download),
 *                            a GET's CREDIT, PIN, UNPIN
 *   kiln_broker_status.c     PING, STATUS and KEY
 *   kiln_broker_metrics.c    GET /metrics for Prometheus (--metrics)
 *   kiln_broker_progress.c   WHERE (a job's progress) and the build-time history
 *
 * Names: the public API is kiln_broker_*; what the files share here is
 * broker_* (BROKER_* for constants); what one file keeps to itself is
 * static and s_*.  Every handler in the command table has the type
 * broker_handler_fn.
 *
 * Everything here is touched only from the broker's loop thread.  The
 * invariants (kiln_broker.h has them too): a RUNNING job has exactly one
 * worker and counts in that worker's busy; a QUEUED job is in the
 * scheduler exactly once (job->item); busy <= slots; a client's `pending`
 * is the number of waiters it has in jobs; `uploads` is the sum of the
 * clients' uploads; a reply posted in a batch (broker_post) leaves only
 * once the store's commit of that batch is durable, in order.
 */
#ifndef KILN_BROKER_PRIV_H
#define KILN_BROKER_PRIV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <czmq.h>

#include "artifact/kiln_artifact.h"
#include "broker/kiln_broker.h"
#include "broker/kiln_download.h"
#include "broker/kiln_sched.h"
#include "broker/kiln_store.h"
#include "common/kiln_hash.h"
#include "common/kiln_proto.h"

/* The broker's bounds. */
#define BROKER_MAX_WORKERS      1024        /* registered workers */
#define BROKER_MAX_CLIENTS      4096        /* connected clients */
#define BROKER_MAX_JOBS         65536       /* jobs queued or running */
#define BROKER_MAX_WAITERS      256         /* clients waiting for one job */
#define BROKER_MAX_UPLOADS      8           /* blob uploads in progress per client (all
                                               clients: --max-uploads) */
#define BROKER_MAX_REFUSED      256         /* blobs remembered per client as refused busy */
#define BROKER_MAX_REVOKED      4096        /* revoked keys remembered (CurveZMQ) */
#define BROKER_MAX_WORKER_BLOBS 65536       /* blobs remembered per worker (affinity) */
#define BROKER_MAX_HISTORY      (64u << 10) /* a job's attempt history */
#define BROKER_BATCH            256         /* messages handled before a commit */
#define BROKER_KEY_SHORT        12          /* hex chars of an action key in log lines */
#define BROKER_UPLOAD_IDLE_MS   60000       /* an upload with no chunk for this long is dropped */
#define BROKER_UPLOAD_STALL_MS  2000        /* ... or this long, when others wait for room */
#define BROKER_GRACE_MS         5000        /* beyond a job's timeout before the broker gives up */
#define BROKER_THIS_BATCH       UINT64_MAX  /* ticket of the batch not yet handed to the store */
#define BROKER_PUMP_CHUNKS      8           /* download chunks sent before the loop looks around */

/* The states of a job; a finished job leaves the broker's tables.  The
 * transitions are in kiln_broker_jobs.c and docs/protocol.md. */
#define BROKER_JOB_STATES(X)     \
    X (QUEUED,  "queued")        \
    X (RUNNING, "running")

typedef enum {
#define BROKER_STATE_ENUM(name, text) BROKER_JOB_##name,
    BROKER_JOB_STATES (BROKER_STATE_ENUM)
#undef BROKER_STATE_ENUM
} broker_job_state_t;

typedef struct broker_worker broker_worker_t;
typedef struct broker_client broker_client_t;

typedef struct {
    broker_client_t *client;   /* who waits; its record outlives the waiter */
    uint64_t req_id;           /* its request id, echoed in the reply */
} broker_waiter_t;

typedef struct broker_collect broker_collect_t;

/* One build of a job that is cross-checked: who built it and what came
 * out (kiln_broker_xcheck.c). */
#define BROKER_MAX_BUILDS 3                  /* the build, its check, a third to decide */
typedef struct {
    char worker[KILN_PROTO_MAX_NAME + 1];
    char digest[KILN_HEX_LEN];               /* the artifact's content hash, or for a
                                                failure the SHA-256 of its code, message
                                                and log */
    int code;                                /* 0: an artifact; else the failure's code */
} broker_build_t;

typedef struct {
    uint64_t id;                         /* unique in this broker's life */
    char id_key[24];                     /* id in decimal, key in jobs_by_id */
    broker_job_state_t state;
    char action_key[KILN_HEX_LEN];       /* recomputed by the broker */
    char graph_digest[KILN_HEX_LEN];     /* recomputed by the broker */
    char *args;                          /* normalised compiler args, owned */
    kiln_toolchain_id_t toolchain;       /* what must build it */
    uint8_t *structure;                  /* encoded graph structure, owned */
    size_t struct_len;
    kiln_blob_ref_t *blobs;              /* owned; pinned in the store */
    uint32_t n_blobs;
    char tenant[KILN_PROTO_MAX_NAME + 1];   /* whose queue it is in */
    int priority;                        /* lowest of its waiters' */
    uint64_t timeout_ms;                 /* longest of its waiters' */
    kiln_sched_item_t *item;             /* QUEUED: its queue entry */
    broker_worker_t *worker;             /* RUNNING: who has it */
    int64_t started;                     /* RUNNING: zclock_mono at dispatch */
    int dispatches;                      /* times sent to a worker */
    int deaths;                          /* workers lost while running it */
    uint64_t min_memory;                 /* after a build ran out of memory: only workers
                                            giving compiles at least this much; 0: any */
    int64_t queued_at;                   /* zclock_mono at first queueing */
    char *history;                       /* what happened to each attempt, owned */
    char *log;                           /* LOG of the current attempt, owned */
    size_t log_len;
    broker_waiter_t *waiters;            /* owned, n_waiters used */
    size_t n_waiters;
    uint64_t ticket;                     /* store commit its blobs wait for; 0 = none */
    broker_collect_t *collect;           /* RUNNING, its DONE came with the artifact
                                            apart: being collected and signed, owned
                                            (kiln_broker_collect.c) */
    /* the cross-check (kiln_broker_xcheck.c) */
    int check;                           /* 0 undecided, 1 its first build is checked,
                                            -1 it is not (`unchecked` says why) */
    const char *unchecked;               /* static text: why it is not checked */
    broker_build_t builds[BROKER_MAX_BUILDS];   /* results so far, in order */
    int n_builds;
    bool disputed;                       /* the builds disagreed: never cached */
} broker_job_t;

/* What a job's artifact must say of itself: a copy, so that a thread can
 * check it while the loop goes on. */
typedef struct {
    char action_key[KILN_HEX_LEN];
    char graph_digest[KILN_HEX_LEN];
    kiln_toolchain_id_t toolchain;
    char args[KILN_MAX_ARGS_BYTES];
} broker_expect_t;

/* An artifact built and staged, until its store commit is durable: a
 * request for the same action in between is answered from here. */
typedef struct {
    char action_key[KILN_HEX_LEN];
    char artifact[KILN_HEX_LEN];
    char graph_digest[KILN_HEX_LEN];
    char worker[KILN_PROTO_MAX_NAME + 1];
    uint8_t *bytes;                      /* the signed archive, owned; NULL when it is
                                            large (sent apart: the client GETs it) */
    size_t len;                          /* its bytes */
    uint64_t ticket;
} broker_pending_t;

struct broker_worker {
    char *key;                           /* routing id in hex, owned */
    zframe_t *rid;                       /* routing id, owned */
    char name[KILN_PROTO_MAX_NAME + 1];  /* identity: certificate name or READY name */
    bool authenticated;
    char curve_key[48];                  /* its certificate's public key (Z85); "" without */
    kiln_toolchain_id_t *toolchains;     /* owned */
    uint32_t n_toolchains;
    int slots;                           /* jobs it runs at once */
    uint64_t max_memory;                 /* address space per compile (READY); 0: unsaid */
    int busy;                            /* RUNNING jobs it holds */
    int64_t last_seen;                   /* zclock_mono of its last message */
    int64_t since;                       /* zclock_mono of its READY */
    uint64_t session;                    /* its READY's session, echoed in JOBs */
    uint64_t dispatched, done, failed;
    zhashx_t *blobs;                     /* hex digest -> itself: blobs it holds */
};

typedef struct {
    kiln_blob_writer_t *writer;          /* owned */
    broker_client_t *client;             /* whose upload */
    int64_t last_chunk;                  /* zclock_mono */
    uint64_t pushed;                     /* chunks handed to the writer */
    uint64_t credited;                   /* of those, released and credited again */
    bool closed;                         /* all bytes in: the writer is finishing */
    char hex[KILN_HEX_LEN];
} broker_upload_t;

struct broker_client {
    char *key;                           /* routing id in hex, owned */
    zframe_t *rid;                       /* routing id, owned */
    char tenant[KILN_PROTO_MAX_NAME + 1];   /* identity for fair share */
    bool authenticated;
    char curve_key[48];                  /* its certificate's public key (Z85); "" without */
    int64_t last_seen;
    uint64_t pending;                    /* waiters it has in jobs */
    uint32_t credit_out;                 /* chunks it may still send */
    uint32_t credit_owed;                /* chunks taken, credit not yet returned */
    zhashx_t *uploads;                   /* hex digest -> broker_upload_t (owns) */
    zhashx_t *refused;                   /* hex digest -> itself: uploads refused busy (EBUSY),
                                            whose later chunks are dropped quietly */
};

/* A reply held until the store has committed the batch it belongs to. */
typedef struct {
    zframe_t *rid;                       /* owned */
    kiln_msg_t *msg;                     /* owned */
    uint64_t ticket;                     /* sent once this store commit is durable */
} broker_outgoing_t;

struct kiln_broker {
    kiln_broker_config_t cfg;            /* with defaults filled in */
    char *endpoint;                      /* owned copy */
    char name[KILN_PROTO_MAX_NAME + 1];  /* provenance "broker" */
    bool curve;                          /* clients and workers authenticate */
    char curve_public[41];               /* with curve: our public key (Z85), else "" */
    zactor_t *auth;                      /* zauth, with curve */
    zactor_t *monitor;                   /* refused handshakes, with curve */
    char *trust_dir;                     /* with curve: --trust, owned */
    zcertstore_t *trust;                 /* with curve: what it holds (kiln_broker_trust.c) */
    uint64_t trust_sig;                  /* its fingerprint when last read */
    zhashx_t *revoked;                   /* public key -> broker: peers cut off (owned) */
    zsock_t *router;
    zloop_t *loop;
    kiln_key_t *key;                     /* the farm's signing key */
    kiln_store_t *store;
    kiln_downloads_t *downloads;         /* GETs being answered */
    kiln_sched_t *sched;
    zhashx_t *workers;                   /* hex routing id -> broker_worker_t (owns) */
    zhashx_t *clients;                   /* hex routing id -> broker_client_t (owns) */
    zhashx_t *jobs;                      /* action key -> broker_job_t (owns) */
    zhashx_t *jobs_by_id;                /* decimal id -> broker_job_t */
    zlistx_t *outbox;                    /* broker_outgoing_t, in order */
    zhashx_t *pending;                   /* action key -> broker_pending_t (owns) */
    zlistx_t *fresh;                     /* jobs of this batch whose blobs await a commit */
    zlistx_t *signing;                   /* broker_collect_t being checked and signed on
                                            threads of their own (owns) */
    int sign_efd;                        /* eventfd: a signing thread is through */
    uint64_t epoch;                      /* this instance, random; in replies to clients */
    uint64_t next_job_id;                /* starts at a random point: a stale DONE from a
                                            worker of an earlier instance names no job */
    uint64_t queued_bytes;               /* structures held for jobs */
    uint64_t uploads;                    /* uploads in progress */
    struct broker_metrics *metrics;      /* --metrics: /metrics server, or NULL */
    struct broker_history *history;      /* build times, for estimates (progress) */
    zhashx_t *quarantine;                /* worker name -> why (owned text): no more jobs */
    zhashx_t *confirmed;                 /* worker name -> builds another worker confirmed
                                            (uintptr_t), for --cross-check new-workers */
    int64_t started;                     /* zclock_mono at start */
    struct {
        uint64_t lookups, hits, failure_hits, submitted, done, failed, canceled,
            requeued, joined, uploaded_bytes, uploaded_blobs, fetched_bytes;
        uint64_t checked, agreed, disagreed, unchecked;   /* cross-checks */
    } stats;
};

/* --- the loop and sending (kiln_broker.c) ----------------------------------- */

/* snprintf that cuts long messages quietly: error messages quote other
 * messages, and a cut one is better than none. */
void broker_fmt (char *buf, size_t size, const char *fmt, ...)
    __attribute__ ((format (printf, 3, 4)));
/* Send `msg` to `rid` now; a failure is logged here, once.  Returns the
 * kiln_msg_send result (-KILN_ENOTFOUND: the peer is gone). */
int broker_send_now (kiln_broker_t *self, zframe_t *rid, kiln_msg_t **msg, const char *to);
/* Queue `msg` for `rid` until the batch's commit.  Consumes *msg. */
void broker_post (kiln_broker_t *self, zframe_t *rid, kiln_msg_t **msg);
/* Post an ERROR (`message` NULL: the code's own text; a log too long for
 * the message is left out). */
void broker_post_error (kiln_broker_t *self, zframe_t *rid, uint64_t req_id, uint64_t job_id,
                        int code, const char *message, const char *log);
/* Post a RESULT carrying the artifact's bytes (copied), or, with `data`
 * NULL, saying that its `len` bytes are sent apart (the client GETs them);
 * or an ERROR when they cannot be sent. */
void broker_post_result (kiln_broker_t *self, zframe_t *rid, uint64_t req_id,
                         const char *artifact, const char *action_key,
                         const char *graph_digest, bool cached, const char *worker,
                         const uint8_t *data, size_t len);

/* --- the command table (kiln_broker.c) ------------------------------------ */

/* Who sent the message being handled.  `worker` is set for a registered
 * worker (NULL for a READY from a new one); `client` for a client. */
typedef struct {
    zframe_t *rid;                       /* routing id */
    const char *key;                     /* routing id in hex */
    const kiln_peer_t *peer;             /* what the transport says of it */
    broker_worker_t *worker;
    broker_client_t *client;
} broker_from_t;

/* A command's handler: one row of the table in kiln_broker.c. */
typedef void (broker_handler_fn) (kiln_broker_t *self, const broker_from_t *from,
                                  kiln_msg_t *msg);

/* --- jobs (kiln_broker_jobs.c) --------------------------------------------- */

const char *broker_job_state_name (broker_job_state_t state);
void broker_job_destroy (broker_job_t **self_p);
/* Undo the job's pins of its blobs in the store. */
void broker_job_unpin (kiln_broker_t *self, broker_job_t *job);
/* The job's log for a failure report: its history, then the last output.
 * Caller frees; NULL when out of memory. */
char *broker_job_report_log (const broker_job_t *job, const char *extra);
/* Tell every waiting client that the job failed, then remove it (freed).
 * A compile error (`cache_it`) is also recorded in the failure cache. */
void broker_job_fail (kiln_broker_t *self, broker_job_t *job, int code, const char *message,
                      const char *log, bool cache_it);
/* Queue `job` (again): `front` when it already ran. */
int broker_job_enqueue (kiln_broker_t *self, broker_job_t *job, bool front);
/* Take a job back from its worker and queue it at the head, or fail it
 * when it has killed too many workers or been dispatched too often. */
void broker_job_requeue (kiln_broker_t *self, broker_job_t *job, const char *reason,
                         bool death);
/* Remove the waiter (client, req_id) from `job`; cancel the job when it
 * was the last.  True when the waiter was there. */
bool broker_job_drop_waiter (kiln_broker_t *self, broker_job_t *job, broker_client_t *c,
                             uint64_t req_id, bool any_req, const char *why);
/* True when some registered worker, not quarantined, offers toolchain
 * `tc`; when `w` does. */
bool broker_worker_offers_any (kiln_broker_t *self, const kiln_toolchain_id_t *tc);
bool broker_worker_offers (const broker_worker_t *w, const kiln_toolchain_id_t *tc);
/* Whether `w` may build `job`: it offers the toolchain, the cross-check
 * allows it (broker_xcheck_may_run) and it gives compiles the memory the
 * job was found to need. */
bool broker_worker_may_build (const kiln_broker_t *self, const broker_job_t *job,
                              const broker_worker_t *w);
/* Add a line to the job's history (bounded). */
void broker_job_note (broker_job_t *job, const char *fmt, ...)
    __attribute__ ((format (printf, 2, 3)));
/* Hand queued jobs to idle workers, as the scheduler orders them. */
void broker_dispatch (kiln_broker_t *self);
broker_handler_fn broker_on_done, broker_on_log, broker_on_fetch;
/* The running job `w` holds with id `job_id`, or NULL (logged, naming
 * `what` the worker sent about it). */
broker_job_t *broker_worker_job (kiln_broker_t *self, broker_worker_t *w, uint64_t job_id,
                                 const char *what);
/* The job's expectations of its artifact, and whether manifest `m` meets
 * them (else `message` says how it does not, naming `worker`).  Both
 * touch nothing of the broker's: a thread may check. */
void broker_expect_fill (const broker_job_t *job, broker_expect_t *x);
bool broker_expect_check (const broker_expect_t *x, const kiln_manifest_t *m,
                          const char *worker, char *message, size_t size);
/* Provenance of a farm build of `job` by `w` (JSON).  Caller frees. */
char *broker_provenance (kiln_broker_t *self, const broker_worker_t *w,
                         const broker_job_t *job);
/* The job's artifact was checked and signed: store it (from *bytes, taken,
 * or the file `tmp` open on *fd_p, taken), answer every waiter, remove
 * the job. */
void broker_job_succeed (kiln_broker_t *self, broker_job_t *job, broker_worker_t *w,
                         const char *digest, uint8_t **bytes, uint64_t len, int *fd_p,
                         const char *tmp);

/* --- the cross-check (kiln_broker_xcheck.c) ----------------------------------- */

/* What to do with a build the worker returned and the broker checked. */
typedef enum {
    BROKER_XCHECK_ACCEPT,        /* sign it (an artifact) or report it (a failure) now */
    BROKER_XCHECK_HANDLED,       /* the job was requeued for another build, or failed */
} broker_xcheck_t;

/* Set up and free the broker's cross-check state. */
int broker_xcheck_init (kiln_broker_t *self);
void broker_xcheck_release (kiln_broker_t *self);
/* Decide (once per job) whether the build `w` is running is to be checked
 * by another worker.  True: it is, or it is itself a check. */
bool broker_xcheck_wanted (kiln_broker_t *self, broker_job_t *job, const broker_worker_t *w);
/* `w` built `job`: an artifact with content hash `digest` (code 0), or a
 * failure with `code`, `message` and `log`.  Records it and decides. */
broker_xcheck_t broker_xcheck_result (kiln_broker_t *self, broker_job_t *job,
                                      broker_worker_t *w, const char *digest, int code,
                                      const char *message, const char *log);
/* The worker of an earlier build that agrees with the job's last, or NULL. */
const char *broker_xcheck_confirmer (const broker_job_t *job);
/* Whether `w` may run `job`: not quarantined, and not one of its builders. */
bool broker_xcheck_may_run (const kiln_broker_t *self, const broker_job_t *job,
                            const broker_worker_t *w);
bool broker_xcheck_quarantined (const kiln_broker_t *self, const char *name);
/* Queued jobs waiting for a check no connected worker can give: build
 * again from the start, or fail a disagreement nobody can decide. */
void broker_xcheck_sweep (kiln_broker_t *self);
/* The cross-check's part of a job's provenance (adds to `obj`). */
void broker_xcheck_provenance (kiln_broker_t *self, const broker_job_t *job,
                               const broker_worker_t *w, void *obj);
/* The policy as text ("always", "sample:10", ...), for status and logs. */
const char *broker_xcheck_policy (const kiln_broker_t *self, char *buf, size_t size);

/* --- large artifacts collected from workers (kiln_broker_collect.c) ----------- */

/* DONE with `size` bytes of artifact apart: collect it from `w` (COLLECT,
 * SLICEs to a file), then check and sign it on a thread. */
void broker_collect_start (kiln_broker_t *self, broker_job_t *job, broker_worker_t *w,
                           uint64_t size);
/* The job lets go of its collection (requeued, failed, removed): its files
 * go, or, when a thread still signs it, its result will be dropped.
 * *self_p becomes NULL. */
void broker_collect_release (broker_collect_t **self_p);
broker_handler_fn broker_on_slice;
/* zloop poller on sign_efd: signing threads that are through. */
int broker_on_signed (zloop_t *loop, zmq_pollitem_t *item, void *arg);
/* Wait for every signing thread and drop what they made (shutdown). */
void broker_collect_shutdown (kiln_broker_t *self);

/* --- workers and clients (kiln_broker_peers.c) ------------------------------ */

void broker_worker_destroy (broker_worker_t **self_p);
void broker_client_destroy (broker_client_t **self_p);
/* Forget a worker: its jobs go back to the queue (`dead` counts the loss
 * against each of them). */
void broker_worker_drop (kiln_broker_t *self, broker_worker_t *w, const char *why, bool dead);
/* Remember that `w` holds a blob (for affinity), within a bound. */
void broker_worker_holds (broker_worker_t *w, const uint8_t digest[KILN_DIGEST_LEN]);
/* The client record for `key`, created on first contact (NULL when the
 * broker holds all the clients it can and none can be forgotten). */
broker_client_t *broker_client_get (kiln_broker_t *self, zframe_t *rid, const char *key,
                                    const kiln_peer_t *peer, const char *declared);
/* Forget a client: release its requests (cancelling jobs nobody else
 * waits for) and abort its uploads. */
void broker_client_drop (kiln_broker_t *self, broker_client_t *c, const char *why);
broker_handler_fn broker_on_ready, broker_on_worker_disconnect, broker_on_client_heartbeat,
    broker_on_client_disconnect;

/* --- revocation (kiln_broker_trust.c) ------------------------------------------ */

/* Read the trust directory (with curve). */
int broker_trust_start (kiln_broker_t *self, const char *trust_dir, kiln_err_t *err);
void broker_trust_stop (kiln_broker_t *self);
/* Every heartbeat: when the trust directory changed, cut off the workers
 * and clients whose certificate has gone. */
void broker_trust_check (kiln_broker_t *self);
/* The peer was cut off and its certificate has not come back. */
bool broker_trust_revoked (kiln_broker_t *self, const kiln_peer_t *peer);
/* A peer the broker has no record of: true when its certificate is in the
 * trust directory now (or without curve); else it is remembered as
 * revoked. */
bool broker_trust_admit (kiln_broker_t *self, const kiln_peer_t *peer);
/* Why a revoked peer is refused, into buf. */
void broker_trust_why (const kiln_peer_t *peer, char *buf, size_t size);

/* --- admission (kiln_broker_admit.c) ------------------------------------------ */

broker_handler_fn broker_on_compile, broker_on_cancel;

/* --- the upload path (kiln_broker_upload.c) ------------------------------------ */

void broker_upload_destroy (broker_upload_t **self_p);
broker_handler_fn broker_on_find, broker_on_chunk;
/* zloop poller on the store's upload eventfd: the blob writers' news. */
int broker_on_uploads (zloop_t *loop, zmq_pollitem_t *item, void *arg);

/* --- artifacts by content hash (kiln_broker_artifacts.c) ----------------------- */

broker_handler_fn broker_on_get, broker_on_client_credit, broker_on_pin;
/* zloop poller on the downloads' eventfd: send a few more chunks. */
int broker_on_downloads (zloop_t *loop, zmq_pollitem_t *item, void *arg);

/* --- status (kiln_broker_status.c) --------------------------------------------- */

broker_handler_fn broker_on_ping, broker_on_status, broker_on_key;

/* --- progress (kiln_broker_progress.c) ------------------------------------------- */

typedef struct broker_history broker_history_t;
/* Build times by graph and size, in memory.  NULL when out of memory (the
 * broker then gives no estimates). */
broker_history_t *broker_history_new (void);
void broker_history_destroy (broker_history_t **self_p);
/* A job was built: remember how long it took. */
void broker_progress_job_built (kiln_broker_t *self, const broker_job_t *job);
broker_handler_fn broker_on_where;

/* --- Prometheus metrics (kiln_broker_metrics.c) --------------------------------- */

#define BROKER_METRICS_MS       500         /* how often the /metrics page is rendered */

typedef struct broker_metrics broker_metrics_t;
/* Serve GET /metrics at `listen` ("HOST:PORT", port 0 picks one) from a
 * thread of libmicrohttpd's.  Caller owns it. */
broker_metrics_t *broker_metrics_new (const char *listen, kiln_err_t *err);
void broker_metrics_destroy (broker_metrics_t **self_p);
/* The port it listens on. */
int broker_metrics_port (const broker_metrics_t *self);
/* Render the page from the broker's state (loop thread); scrapes get the
 * last one rendered. */
void broker_metrics_render (kiln_broker_t *self);
/* zloop timer (every BROKER_METRICS_MS): broker_metrics_render. */
int broker_metrics_on_timer (zloop_t *loop, int timer_id, void *arg);
/* A job went to a worker (its queue wait), or was built (its build time);
 * nothing without --metrics. */
void broker_metrics_job_started (kiln_broker_t *self, const broker_job_t *job);
void broker_metrics_job_built (kiln_broker_t *self, const broker_job_t *job);

#endif
