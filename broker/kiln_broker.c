/*
 * kiln_broker — the broker's event loop, clients, workers and jobs.
 *
 * The loop reads a batch of messages (at most S_BATCH) and hands what
 * they staged in the store to its syncer thread as one commit; the
 * replies of the batch wait in the "outbox" until that commit is on disk
 * (the syncer signals an eventfd the loop watches), and go out in order.
 * So a client never hears of an artifact, a failure record or a blob
 * before it is on disk, the cost of fsync is shared by the whole batch,
 * and the loop keeps serving while the disk works.
 */
#include "broker/kiln_broker.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <czmq.h>
#include <jansson.h>
#include <openssl/rand.h>

#include "artifact/kiln_artifact.h"
#include "broker/kiln_sched.h"
#include "broker/kiln_store.h"
#include "common/kiln_fs.h"
#include "common/kiln_hash.h"
#include "common/kiln_log.h"
#include "common/kiln_proto.h"
#include "graph/kiln_graph.h"

#define S_MAX_WORKERS       1024      /* registered workers */
#define S_MAX_CLIENTS       4096      /* connected clients */
#define S_MAX_JOBS          65536     /* jobs queued or running */
#define S_MAX_WAITERS       256       /* clients waiting for one job */
#define S_MAX_UPLOADS       64        /* blob uploads in progress per client */
#define S_MAX_WORKER_BLOBS  65536     /* blobs remembered per worker (affinity) */
#define S_MAX_HISTORY       (64u << 10)   /* a job's attempt history */
#define S_BATCH             256       /* messages handled before a commit */
#define S_KEY_SHORT         12        /* hex chars of an action key in log lines */
#define S_UPLOAD_IDLE_MS    60000     /* an upload with no chunk for this long is dropped */
#define S_GRACE_MS          5000      /* beyond a job's timeout before the broker gives up */
#define S_THIS_BATCH        UINT64_MAX   /* ticket of the batch not yet handed to the store */

/* The states of a job; a finished job leaves the broker's tables. */
#define S_JOB_STATES(X)          \
    X (QUEUED,  "queued")        \
    X (RUNNING, "running")

typedef enum {
#define S_STATE_ENUM(name, text) S_JOB_##name,
    S_JOB_STATES (S_STATE_ENUM)
#undef S_STATE_ENUM
} s_job_state_t;

typedef struct s_worker s_worker_t;
typedef struct s_client s_client_t;

typedef struct {
    s_client_t *client;        /* who waits; its record outlives the waiter */
    uint64_t req_id;           /* its request id, echoed in the reply */
} s_waiter_t;

typedef struct {
    uint64_t id;                         /* unique in this broker's life */
    char id_key[24];                     /* id in decimal, key in jobs_by_id */
    s_job_state_t state;
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
    s_worker_t *worker;                  /* RUNNING: who has it */
    int64_t started;                     /* RUNNING: zclock_mono at dispatch */
    int dispatches;                      /* times sent to a worker */
    int deaths;                          /* workers lost while running it */
    int64_t queued_at;                   /* zclock_mono at first queueing */
    char *history;                       /* what happened to each attempt, owned */
    char *log;                           /* LOG of the current attempt, owned */
    size_t log_len;
    s_waiter_t *waiters;                 /* owned, n_waiters used */
    size_t n_waiters;
    uint64_t ticket;                     /* store commit its blobs wait for; 0 = none */
} s_job_t;

/* An artifact built and staged, until its store commit is durable: a
 * request for the same action in between is answered from here. */
typedef struct {
    char action_key[KILN_HEX_LEN];
    char artifact[KILN_HEX_LEN];
    char graph_digest[KILN_HEX_LEN];
    char worker[KILN_PROTO_MAX_NAME + 1];
    uint8_t *bytes;                      /* the signed archive, owned */
    size_t len;
    uint64_t ticket;
} s_pending_t;

struct s_worker {
    char *key;                           /* routing id in hex, owned */
    zframe_t *rid;                       /* routing id, owned */
    char name[KILN_PROTO_MAX_NAME + 1];  /* identity: certificate name or READY name */
    bool authenticated;
    kiln_toolchain_id_t *toolchains;     /* owned */
    uint32_t n_toolchains;
    int slots;                           /* jobs it runs at once */
    int busy;                            /* RUNNING jobs it holds */
    int64_t last_seen;                   /* zclock_mono of its last message */
    int64_t since;                       /* zclock_mono of its READY */
    uint64_t session;                    /* its READY's session, echoed in JOBs */
    uint64_t dispatched, done, failed;
    zhashx_t *blobs;                     /* hex digest -> itself: blobs it holds */
};

typedef struct {
    kiln_blob_writer_t *writer;          /* owned */
    s_client_t *client;                  /* whose upload */
    int64_t last_chunk;                  /* zclock_mono */
    uint64_t pushed;                     /* chunks handed to the writer */
    uint64_t credited;                   /* of those, released and credited again */
    bool closed;                         /* all bytes in: the writer is finishing */
    char hex[KILN_HEX_LEN];
} s_upload_t;

struct s_client {
    char *key;                           /* routing id in hex, owned */
    zframe_t *rid;                       /* routing id, owned */
    char tenant[KILN_PROTO_MAX_NAME + 1];   /* identity for fair share */
    bool authenticated;
    int64_t last_seen;
    uint64_t pending;                    /* waiters it has in jobs */
    uint32_t credit_out;                 /* chunks it may still send */
    uint32_t credit_owed;                /* chunks taken, credit not yet returned */
    zhashx_t *uploads;                   /* hex digest -> s_upload_t (owns) */
};

/* A reply held until the store has committed the batch it belongs to. */
typedef struct {
    zframe_t *rid;                       /* owned */
    kiln_msg_t *msg;                     /* owned */
    uint64_t ticket;                     /* sent once this store commit is durable */
} s_outgoing_t;

struct kiln_broker {
    kiln_broker_config_t cfg;            /* with defaults filled in */
    char *endpoint;                      /* owned copy */
    char name[KILN_PROTO_MAX_NAME + 1];  /* provenance "broker" */
    bool curve;                          /* clients and workers authenticate */
    zactor_t *auth;                      /* zauth, with curve */
    zactor_t *monitor;                   /* refused handshakes, with curve */
    zsock_t *router;
    zloop_t *loop;
    kiln_key_t *key;                     /* the farm's signing key */
    kiln_store_t *store;
    kiln_sched_t *sched;
    zhashx_t *workers;                   /* hex routing id -> s_worker_t (owns) */
    zhashx_t *clients;                   /* hex routing id -> s_client_t (owns) */
    zhashx_t *jobs;                      /* action key -> s_job_t (owns) */
    zhashx_t *jobs_by_id;                /* decimal id -> s_job_t */
    zlistx_t *outbox;                    /* s_outgoing_t, in order */
    zhashx_t *pending;                   /* action key -> s_pending_t (owns) */
    zlistx_t *fresh;                     /* jobs of this batch whose blobs await a commit */
    uint64_t epoch;                      /* this instance, random; in replies to clients */
    uint64_t next_job_id;                /* starts at a random point: a stale DONE from a
                                            worker of an earlier instance names no job */
    uint64_t queued_bytes;               /* structures held for jobs */
    uint64_t uploads;                    /* uploads in progress */
    int64_t started;                     /* zclock_mono at start */
    struct {
        uint64_t lookups, hits, failure_hits, submitted, done, failed, canceled,
            requeued, joined, uploaded_bytes, uploaded_blobs, fetched_bytes;
    } stats;
};

static const char *
s_state_name (s_job_state_t state)
{
    switch (state) {
#define S_STATE_TEXT(name, text) case S_JOB_##name: return text;
        S_JOB_STATES (S_STATE_TEXT)
#undef S_STATE_TEXT
    }
    return "?";
}

/* snprintf that cuts long messages quietly: error messages quote other
 * messages, and a cut one is better than none. */
static void s_fmt (char *buf, size_t size, const char *fmt, ...)
    __attribute__ ((format (printf, 3, 4)));

static void
s_fmt (char *buf, size_t size, const char *fmt, ...)
{
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (buf, size, fmt, ap);
    va_end (ap);
}

/* Append a line to a bounded, owned text (the job history). */
static void s_append (char **text, size_t max, const char *fmt, ...)
    __attribute__ ((format (printf, 3, 4)));

static void
s_append (char **text, size_t max, const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (line, sizeof line, fmt, ap);
    va_end (ap);
    size_t have = *text ? strlen (*text) : 0;
    size_t add = strlen (line);
    if (have + add + 2 > max)
        return;
    char *grown = realloc (*text, have + add + 2);
    if (!grown)
        return;
    memcpy (grown + have, line, add);
    grown[have + add] = '\n';
    grown[have + add + 1] = '\0';
    *text = grown;
}

/* --- lifetimes ------------------------------------------------------------ */

static void
s_job_destroy (s_job_t **self_p)
{
    if (!*self_p)
        return;
    s_job_t *job = *self_p;
    free (job->args);
    free (job->structure);
    free (job->blobs);
    free (job->history);
    free (job->log);
    free (job->waiters);
    free (job);
    *self_p = NULL;
}

static void
s_worker_destroy (s_worker_t **self_p)
{
    if (!*self_p)
        return;
    free ((*self_p)->key);
    free ((*self_p)->toolchains);
    zframe_destroy (&(*self_p)->rid);
    zhashx_destroy (&(*self_p)->blobs);
    free (*self_p);
    *self_p = NULL;
}

static void
s_upload_destroy (s_upload_t **self_p)
{
    if (!*self_p)
        return;
    s_upload_t *up = *self_p;
    /* chunks the writer still held: the client may send as many again */
    up->client->credit_owed += (uint32_t) (up->pushed - up->credited);
    kiln_blob_writer_abort (&up->writer);
    free (*self_p);
    *self_p = NULL;
}

static void
s_client_destroy (s_client_t **self_p)
{
    if (!*self_p)
        return;
    free ((*self_p)->key);
    zframe_destroy (&(*self_p)->rid);
    zhashx_destroy (&(*self_p)->uploads);
    free (*self_p);
    *self_p = NULL;
}

static void
s_pending_destroy (s_pending_t **self_p)
{
    if (!*self_p)
        return;
    free ((*self_p)->bytes);
    free (*self_p);
    *self_p = NULL;
}

static void
s_outgoing_destroy (s_outgoing_t **self_p)
{
    if (!*self_p)
        return;
    zframe_destroy (&(*self_p)->rid);
    kiln_msg_destroy (&(*self_p)->msg);
    free (*self_p);
    *self_p = NULL;
}

/* --- sending --------------------------------------------------------------- */

/* Send `msg` to `rid` now; a failure is logged here, once.  Returns the
 * kiln_msg_send result (-KILN_ENOTFOUND: the peer is gone). */
static int
s_send_now (kiln_broker_t *self, zframe_t *rid, kiln_msg_t **msg, const char *to)
{
    kiln_err_t err = { 0 };
    int rc = kiln_msg_send (msg, self->router, rid, &err);
    if (rc != 0)
        kiln_log_warn ("could not send to %s: %s", to, err.msg);
    return rc;
}

/* Queue `msg` for `rid` until the batch's commit.  Consumes *msg. */
static void
s_post (kiln_broker_t *self, zframe_t *rid, kiln_msg_t **msg)
{
    s_outgoing_t *out = calloc (1, sizeof *out);
    if (!out || !(out->rid = zframe_dup (rid))) {
        free (out);
        kiln_msg_destroy (msg);
        kiln_log_err ("out of memory queueing a reply");
        return;
    }
    out->msg = *msg;
    out->msg->epoch = self->epoch;      /* sent only with the commands that carry it */
    out->ticket = S_THIS_BATCH;
    *msg = NULL;
    zlistx_add_end (self->outbox, out);
}

static void
s_post_error (kiln_broker_t *self, zframe_t *rid, uint64_t req_id, uint64_t job_id,
              int code, const char *message, const char *log)
{
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_ERROR);
    if (!msg)
        return;
    msg->req_id = req_id;
    msg->job_id = job_id;
    /* a message that would not fit is cut, never dropped */
    char text[KILN_ERR_MSG_MAX];
    s_fmt (text, sizeof text, "%s", message ? message : kiln_strerror (code));
    const char *cut_log = log && strlen (log) <= KILN_MAX_LOG_BYTES ? log : NULL;
    if (kiln_msg_set_error (msg, code, text, cut_log) != 0) {
        kiln_msg_destroy (&msg);
        return;
    }
    s_post (self, rid, &msg);
}

static void
s_post_result (kiln_broker_t *self, zframe_t *rid, uint64_t req_id, const char *artifact,
               const char *action_key, const char *graph_digest, bool cached,
               const char *worker, const uint8_t *data, size_t len)
{
    kiln_err_t err = { 0 };
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_RESULT);
    if (!msg)
        return;
    msg->req_id = req_id;
    memcpy (msg->artifact, artifact, KILN_HEX_LEN);
    memcpy (msg->action_key, action_key, KILN_HEX_LEN);
    memcpy (msg->graph_digest, graph_digest, KILN_HEX_LEN);
    msg->cached = cached;
    if (kiln_msg_set_str (&msg->worker, worker) != 0
        || kiln_msg_put_artifact (msg, data, len, &err) != 0) {
        kiln_msg_destroy (&msg);
        kiln_log_err ("action %.*s: cannot send the artifact: %s", S_KEY_SHORT, action_key,
                      err.msg);
        s_post_error (self, rid, req_id, 0, err.code ? err.code : KILN_ENOMEM, err.msg, NULL);
        return;
    }
    s_post (self, rid, &msg);
}

/* --- clients ---------------------------------------------------------------- */

static s_client_t *s_client_get (kiln_broker_t *self, zframe_t *rid, const char *key,
                                 const kiln_peer_t *peer, const char *declared);
static void s_client_drop (kiln_broker_t *self, s_client_t *c, const char *why);

/* --- jobs ------------------------------------------------------------------ */

static void
s_job_unpin (kiln_broker_t *self, s_job_t *job)
{
    for (uint32_t i = 0; i < job->n_blobs; i++)
        kiln_store_blob_unpin (self->store, job->blobs[i].digest);
}

/* Remove a finished job from the tables and free it. */
static void
s_job_remove (kiln_broker_t *self, s_job_t *job)
{
    if (job->item)
        kiln_sched_remove (self->sched, &job->item);
    if (job->ticket == S_THIS_BATCH) {
        void *handle = zlistx_find (self->fresh, job);
        if (handle)
            zlistx_delete (self->fresh, handle);
    }
    if (job->worker) {
        job->worker->busy--;
        job->worker = NULL;
    }
    for (size_t i = 0; i < job->n_waiters; i++)
        if (job->waiters[i].client->pending > 0)
            job->waiters[i].client->pending--;
    job->n_waiters = 0;
    s_job_unpin (self, job);
    self->queued_bytes -= job->struct_len;
    zhashx_delete (self->jobs_by_id, job->id_key);
    zhashx_delete (self->jobs, job->action_key);      /* destroys the job */
}

/* The job's log for a failure report: its history, then the last output. */
static char *
s_job_report_log (const s_job_t *job, const char *extra)
{
    size_t n = (job->history ? strlen (job->history) : 0) + job->log_len
               + (extra ? strlen (extra) : 0) + 64;
    if (n > KILN_MAX_LOG_BYTES)
        n = KILN_MAX_LOG_BYTES;
    char *text = malloc (n + 1);
    if (!text)
        return NULL;
    size_t len = 0;
    const char *parts[] = { job->history, job->log_len ? "--- output of the last attempt ---\n"
                                                       : NULL,
                            job->log_len ? job->log : NULL, extra };
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        if (!parts[i])
            continue;
        size_t add = strlen (parts[i]);
        if (add > n - len)
            add = n - len;
        memcpy (text + len, parts[i], add);
        len += add;
    }
    text[len] = '\0';
    return text;
}

/* Tell every waiting client that the job failed, then remove it.  A
 * compile error is also recorded in the failure cache. */
static void
s_job_fail (kiln_broker_t *self, s_job_t *job, int code, const char *message,
            const char *log, bool cache_it)
{
    kiln_log_err ("job %llu action %.*s: failed: %s", (unsigned long long) job->id,
                  S_KEY_SHORT, job->action_key, message);
    if (cache_it) {
        kiln_err_t err = { 0 };
        if (kiln_store_put_failure (self->store, job->action_key, code, message, log, &err) != 0)
            kiln_log_err ("job %llu: could not record the failure: %s",
                          (unsigned long long) job->id, err.msg);
    }
    for (size_t i = 0; i < job->n_waiters; i++)
        s_post_error (self, job->waiters[i].client->rid, job->waiters[i].req_id, job->id,
                      code, message, log);
    self->stats.failed++;
    s_job_remove (self, job);
}

/* Queue `job` (again): `front` when it already ran. */
static int
s_job_enqueue (kiln_broker_t *self, s_job_t *job, bool front)
{
    job->state = S_JOB_QUEUED;
    job->item = kiln_sched_push (self->sched, job->tenant, job->priority, front, job);
    return job->item ? 0 : -1;
}

/* Take a job back from its worker and queue it at the head, or fail it
 * when it has killed too many workers or been dispatched too often. */
static void
s_job_requeue (kiln_broker_t *self, s_job_t *job, const char *reason, bool death)
{
    const char *worker = job->worker ? job->worker->name : "?";
    s_append (&job->history, S_MAX_HISTORY, "attempt %d on worker %s: %s", job->dispatches,
              worker, reason);
    if (job->worker) {
        job->worker->busy--;
        job->worker = NULL;
    }
    if (death)
        job->deaths++;
    if (job->deaths >= self->cfg.max_deaths || job->dispatches >= self->cfg.max_dispatches) {
        char message[KILN_ERR_MSG_MAX];
        if (job->deaths >= self->cfg.max_deaths)
            s_fmt (message, sizeof message, "job %llu gave up: %d workers were lost while "
                   "running it (last: %s)", (unsigned long long) job->id, job->deaths, reason);
        else
            s_fmt (message, sizeof message, "job %llu gave up after %d attempts: %s",
                   (unsigned long long) job->id, job->dispatches, reason);
        char *log = s_job_report_log (job, NULL);
        s_job_fail (self, job, KILN_EREMOTE, message, log, false);
        free (log);
        return;
    }
    free (job->log);
    job->log = NULL;
    job->log_len = 0;
    self->stats.requeued++;
    if (s_job_enqueue (self, job, true) != 0) {
        s_job_fail (self, job, KILN_ENOMEM, "out of memory requeueing the job", NULL, false);
        return;
    }
    kiln_log_notice ("job %llu action %.*s: back in the queue: %s",
                     (unsigned long long) job->id, S_KEY_SHORT, job->action_key, reason);
}

/* Nobody waits for `job` any more: stop it. */
static void
s_job_cancel (kiln_broker_t *self, s_job_t *job, const char *why)
{
    kiln_log_notice ("job %llu action %.*s: canceled (%s, was %s)", (unsigned long long) job->id,
                     S_KEY_SHORT, job->action_key, why, s_state_name (job->state));
    if (job->worker) {
        kiln_msg_t *cancel = kiln_msg_new (KILN_CMD_CANCEL);
        if (cancel) {
            cancel->job_id = job->id;
            s_send_now (self, job->worker->rid, &cancel, job->worker->name);
        }
    }
    self->stats.canceled++;
    s_job_remove (self, job);
}

/* Remove the waiter (client, req_id) from `job`; cancel the job when it
 * was the last.  True when the waiter was there. */
static bool
s_job_drop_waiter (kiln_broker_t *self, s_job_t *job, s_client_t *c, uint64_t req_id,
                   bool any_req, const char *why)
{
    bool found = false;
    for (size_t i = 0; i < job->n_waiters;) {
        s_waiter_t *w = &job->waiters[i];
        if (w->client == c && (any_req || w->req_id == req_id)) {
            found = true;
            if (c->pending > 0)
                c->pending--;
            job->waiters[i] = job->waiters[--job->n_waiters];
        }
        else
            i++;
    }
    if (found && job->n_waiters == 0)
        s_job_cancel (self, job, why);
    return found;
}

/* --- scheduling ------------------------------------------------------------ */

static bool
s_worker_offers (const s_worker_t *w, const kiln_toolchain_id_t *tc)
{
    for (uint32_t i = 0; i < w->n_toolchains; i++)
        if (strcmp (w->toolchains[i].id, tc->id) == 0
            && strcmp (w->toolchains[i].version, tc->version) == 0
            && strcmp (w->toolchains[i].target, tc->target) == 0)
            return true;
    return false;
}

static bool
s_worker_offers_any (kiln_broker_t *self, const kiln_toolchain_id_t *tc)
{
    for (s_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers))
        if (s_worker_offers (w, tc))
            return true;
    return false;
}

typedef struct {
    s_worker_t **idle;
    size_t n;
    uint64_t durable;                /* the store's durable ticket */
} s_idle_t;

static bool
s_can_run (void *job_, void *arg)
{
    const s_job_t *job = job_;
    const s_idle_t *idle = arg;
    if (job->ticket > idle->durable)
        return false;                /* its inline blobs are not on disk yet */
    for (size_t i = 0; i < idle->n; i++)
        if (idle->idle[i]->busy < idle->idle[i]->slots
            && s_worker_offers (idle->idle[i], &job->toolchain))
            return true;
    return false;
}

/* Bytes of the job's blobs that `w` holds. */
static uint64_t
s_held_bytes (const s_worker_t *w, const s_job_t *job)
{
    uint64_t held = 0;
    for (uint32_t i = 0; i < job->n_blobs; i++) {
        char hex[KILN_HEX_LEN];
        kiln_hex (job->blobs[i].digest, KILN_DIGEST_LEN, hex);
        if (zhashx_lookup (w->blobs, hex))
            held += job->blobs[i].size;
    }
    return held;
}

/* The idle worker for `job`: one offering its toolchain that holds most
 * of its blob bytes, then the one with most free slots, then the one given
 * fewer jobs. */
static s_worker_t *
s_pick_worker (const s_idle_t *idle, const s_job_t *job)
{
    s_worker_t *best = NULL;
    uint64_t best_held = 0;
    for (size_t i = 0; i < idle->n; i++) {
        s_worker_t *w = idle->idle[i];
        if (w->busy >= w->slots || !s_worker_offers (w, &job->toolchain))
            continue;
        uint64_t held = s_held_bytes (w, job);
        int free_ = w->slots - w->busy, best_free = best ? best->slots - best->busy : 0;
        if (!best || held > best_held
            || (held == best_held && (free_ > best_free
                                      || (free_ == best_free
                                          && w->dispatched < best->dispatched)))) {
            best = w;
            best_held = held;
        }
    }
    return best;
}

static void s_worker_drop (kiln_broker_t *self, s_worker_t *w, const char *why, bool dead);

/* Send `job` to `w`: the structure and, inline, the small blobs `w` lacks.
 * Returns the kiln_msg_send result; on failure the job is as it was. */
static int
s_job_start (kiln_broker_t *self, s_job_t *job, s_worker_t *w)
{
    kiln_err_t err = { 0 };
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_JOB);
    if (!msg)
        return -KILN_ENOMEM;
    msg->job_id = job->id;
    memcpy (msg->action_key, job->action_key, KILN_HEX_LEN);
    memcpy (msg->graph_digest, job->graph_digest, KILN_HEX_LEN);
    msg->timeout_ms = job->timeout_ms;
    msg->session = w->session;
    int rc = job->args[0] ? kiln_msg_set_str (&msg->compiler_args, job->args) : 0;
    if (rc == 0)
        rc = kiln_msg_set_str (&msg->compiler_id, job->toolchain.id);
    if (rc == 0)
        rc = kiln_msg_set_str (&msg->compiler_version, job->toolchain.version);
    if (rc == 0)
        rc = kiln_msg_set_str (&msg->target, job->toolchain.target);
    if (rc == 0)
        rc = kiln_msg_put_structure (msg, job->structure, job->struct_len, &err);
    uint64_t inline_total = 0;
    for (uint32_t i = 0; rc == 0 && i < job->n_blobs; i++) {
        const kiln_blob_ref_t *b = &job->blobs[i];
        char hex[KILN_HEX_LEN];
        kiln_hex (b->digest, KILN_DIGEST_LEN, hex);
        bool small = b->size <= KILN_PROTO_INLINE_BLOB
                     && inline_total + b->size <= KILN_PROTO_INLINE_TOTAL;
        if (!small || zhashx_lookup (w->blobs, hex)) {
            rc = kiln_msg_add_blob_ref (msg, b->digest, b->size, &err);
            continue;
        }
        uint64_t size = 0;
        int fd = kiln_store_blob_open (self->store, b->digest, &size, &err);
        uint8_t *data = fd >= 0 && size == b->size ? malloc (size ? size : 1) : NULL;
        if (!data || pread (fd, data, size, 0) != (ssize_t) size) {
            /* the worker will FETCH it, and fail the job if it is gone */
            rc = kiln_msg_add_blob_ref (msg, b->digest, b->size, &err);
        }
        else {
            rc = kiln_msg_put_blob (msg, b->digest, data, size, &err);
            inline_total += size;
        }
        free (data);
        if (fd >= 0)
            close (fd);
    }
    if (rc != 0) {
        kiln_msg_destroy (&msg);
        kiln_log_err ("job %llu: cannot build the JOB message: %s",
                      (unsigned long long) job->id, err.msg[0] ? err.msg : "out of memory");
        return rc;
    }
    rc = kiln_msg_send (&msg, self->router, w->rid, &err);
    if (rc != 0) {
        kiln_log_warn ("job %llu: could not send to worker %s: %s",
                       (unsigned long long) job->id, w->name, err.msg);
        return rc;
    }
    job->state = S_JOB_RUNNING;
    job->worker = w;
    job->started = zclock_mono ();
    job->dispatches++;
    w->busy++;
    w->dispatched++;
    kiln_log_notice ("job %llu action %.*s: sent to worker %s (attempt %d, waited %lld ms)",
                     (unsigned long long) job->id, S_KEY_SHORT, job->action_key, w->name,
                     job->dispatches, (long long) (job->started - job->queued_at));
    return 0;
}

/* Hand queued jobs to idle workers, as the scheduler orders them. */
static void
s_dispatch (kiln_broker_t *self)
{
    if (kiln_sched_size (self->sched) == 0)
        return;
    s_worker_t *list[S_MAX_WORKERS];
    s_idle_t idle = { list, 0, kiln_store_durable (self->store) };
    int free_slots = 0;
    for (s_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers))
        if (w->busy < w->slots && idle.n < S_MAX_WORKERS) {
            list[idle.n++] = w;
            free_slots += w->slots - w->busy;
        }
    while (free_slots > 0) {
        s_job_t *job = kiln_sched_pop (self->sched, s_can_run, &idle);
        if (!job)
            break;
        job->item = NULL;
        s_worker_t *w = s_pick_worker (&idle, job);
        if (!w) {             /* cannot happen: s_can_run saw the same list */
            if (s_job_enqueue (self, job, true) != 0)
                s_job_fail (self, job, KILN_ENOMEM, "out of memory requeueing the job", NULL,
                            false);
            break;
        }
        int rc = s_job_start (self, job, w);
        if (rc == 0) {
            free_slots--;
            continue;
        }
        if (rc != -KILN_ENOTFOUND && rc != -KILN_EIO) {
            s_job_fail (self, job, -rc, "the broker could not send the job to a worker", NULL,
                        false);
            continue;
        }
        if (s_job_enqueue (self, job, true) != 0) {
            s_job_fail (self, job, KILN_ENOMEM, "out of memory requeueing the job", NULL, false);
            continue;
        }
        /* The worker is gone or cannot take more now: not this round. */
        for (size_t i = 0; i < idle.n; i++)
            if (idle.idle[i] == w) {
                idle.idle[i] = idle.idle[--idle.n];
                break;
            }
        free_slots -= w->slots - w->busy;
        if (rc == -KILN_ENOTFOUND)
            s_worker_drop (self, w, "its connection is closed", true);
    }
}

/* --- workers --------------------------------------------------------------- */

/* Requeue every job `w` holds; `dead` counts it against each job. */
static void
s_worker_release_jobs (kiln_broker_t *self, s_worker_t *w, const char *reason, bool dead)
{
    zlistx_t *held = zlistx_new ();
    if (!held)
        return;
    for (s_job_t *job = zhashx_first (self->jobs); job; job = zhashx_next (self->jobs))
        if (job->worker == w)
            zlistx_add_end (held, job);
    for (s_job_t *job = zlistx_first (held); job; job = zlistx_next (held))
        s_job_requeue (self, job, reason, dead);
    zlistx_destroy (&held);
}

static void
s_worker_drop (kiln_broker_t *self, s_worker_t *w, const char *why, bool dead)
{
    kiln_log_warn ("worker %s dropped: %s", w->name, why);
    char reason[256];
    s_fmt (reason, sizeof reason, "worker %s lost: %s", w->name, why);
    s_worker_release_jobs (self, w, reason, dead);
    zhashx_delete (self->workers, w->key);
}

/* Remember that `w` holds a blob (for affinity), within a bound. */
static void
s_worker_holds (s_worker_t *w, const uint8_t digest[KILN_DIGEST_LEN])
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    if (zhashx_size (w->blobs) >= S_MAX_WORKER_BLOBS)
        zhashx_purge (w->blobs);
    zhashx_update (w->blobs, hex, w);
}

static void
s_on_ready (kiln_broker_t *self, zframe_t *rid, const char *key, s_worker_t *w,
            const kiln_peer_t *peer, kiln_msg_t *msg)
{
    char text[512];
    const char *name = self->curve ? peer->name : msg->name;
    if (!kiln_proto_name_ok (name) || msg->slots < 1 || msg->n_toolchains < 1) {
        s_fmt (text, sizeof text, "READY refused: the name ('%s') must be 1..%d characters of "
               "[A-Za-z0-9._:@-], slots at least 1 and at least one toolchain", name,
               KILN_PROTO_MAX_NAME);
        kiln_log_warn ("peer %s: %s", key, text);
        s_post_error (self, rid, 0, 0, KILN_EPROTO, text, NULL);
        return;
    }
    kiln_toolchain_id_t *tcs = calloc (msg->n_toolchains, sizeof *tcs);
    if (!tcs)
        return;
    for (uint32_t i = 0; i < msg->n_toolchains; i++) {
        kiln_err_t err = { 0 };
        if (kiln_toolchain_parse (msg->toolchains[i], &tcs[i], &err) != 0) {
            kiln_log_warn ("worker %s: READY refused: %s", name, err.msg);
            s_post_error (self, rid, 0, 0, KILN_EPROTO, err.msg, NULL);
            free (tcs);
            return;
        }
    }
    if (w) {
        kiln_log_notice ("worker %s registered again", w->name);
        s_worker_release_jobs (self, w, "its worker registered again", false);
        free (w->toolchains);
        zhashx_purge (w->blobs);
    }
    else {
        /* The same worker under a new connection: the old one is dead (a
         * worker process killed and started again). */
        for (s_worker_t *old = zhashx_first (self->workers); old;
             old = zhashx_next (self->workers))
            if (strcmp (old->name, name) == 0) {
                s_worker_drop (self, old, "it registered again from a new connection", true);
                break;
            }
        if (zhashx_size (self->workers) >= S_MAX_WORKERS) {
            kiln_log_warn ("worker %s refused: %d workers already registered", name,
                           S_MAX_WORKERS);
            s_post_error (self, rid, 0, 0, KILN_ELIMIT, "the broker has all the workers it "
                          "can take", NULL);
            free (tcs);
            return;
        }
        w = calloc (1, sizeof *w);
        if (!w || !(w->key = strdup (key)) || !(w->rid = zframe_dup (rid))
            || !(w->blobs = zhashx_new ())) {
            s_worker_destroy (&w);
            free (tcs);
            kiln_log_err ("out of memory registering worker %s", name);
            return;
        }
        zhashx_insert (self->workers, key, w);
    }
    snprintf (w->name, sizeof w->name, "%s", name);
    w->authenticated = self->curve;
    w->toolchains = tcs;
    w->n_toolchains = msg->n_toolchains;
    w->slots = (int) msg->slots;
    w->session = msg->session;
    w->last_seen = w->since = zclock_mono ();
    for (uint32_t i = 0; i < msg->n_blobs; i++)
        s_worker_holds (w, msg->blobs[i].digest);
    char tc[KILN_PROTO_MAX_TOOLCHAIN + 1];
    kiln_log_notice ("worker %s ready: %d slot%s, %s%s, %u blob%s cached", w->name, w->slots,
                     w->slots == 1 ? "" : "s", kiln_toolchain_format (&tcs[0], tc, sizeof tc),
                     w->n_toolchains > 1 ? " and more" : "", msg->n_blobs,
                     msg->n_blobs == 1 ? "" : "s");
}

/* Provenance of a farm build.  Caller frees. */
static char *
s_provenance (kiln_broker_t *self, const s_worker_t *w, const s_job_t *job)
{
    char stamp[32];
    time_t now = time (NULL);
    struct tm tm;
    gmtime_r (&now, &tm);
    strftime (stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &tm);
    json_t *obj = json_pack ("{s:s, s:s, s:s, s:s, s:b}", "builder", w->name, "broker",
                             self->name, "built_at", stamp, "client", job->tenant,
                             "authenticated", self->curve);
    char *text = obj ? json_dumps (obj, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    json_decref (obj);
    return text;
}

/* Check the worker's unsigned artifact against the job, sign it, store it
 * and answer every waiting client. */
static void
s_job_succeed (kiln_broker_t *self, s_job_t *job, s_worker_t *w, kiln_msg_t *msg)
{
    kiln_err_t err = { 0 };
    uint8_t *bytes = NULL, *signed_bytes = NULL;
    size_t len = 0, signed_len = 0;
    char *provenance = NULL;
    char digest[KILN_HEX_LEN];
    char message[KILN_ERR_MSG_MAX];
    kiln_artifact_t *art = NULL;

    if (kiln_msg_part (msg, 0, &bytes, &len, &err) != 0
        || !(art = kiln_artifact_read_mem (bytes, len, &err))) {
        s_fmt (message, sizeof message, "worker %s returned an unreadable artifact: %s",
               w->name, err.msg);
        kiln_log_err ("job %llu: %s", (unsigned long long) job->id, message);
        w->failed++;
        s_job_requeue (self, job, message, false);
        goto done;
    }
    const kiln_manifest_t *m = kiln_artifact_manifest (art);
    if (strcmp (m->action_key, job->action_key) != 0
        || strcmp (m->graph_digest, job->graph_digest) != 0
        || strcmp (m->compiler_id, job->toolchain.id) != 0
        || strcmp (m->compiler_version, job->toolchain.version) != 0
        || strcmp (m->target, job->toolchain.target) != 0
        || strcmp (m->compiler_args, job->args) != 0) {
        s_fmt (message, sizeof message,
               "worker %s returned an artifact for action %.*s / graph %.*s built by "
               "%s %s for %s, not the job's action %.*s / graph %.*s for %s %s %s", w->name,
               S_KEY_SHORT, m->action_key, S_KEY_SHORT, m->graph_digest, m->compiler_id,
               m->compiler_version, m->target, S_KEY_SHORT, job->action_key, S_KEY_SHORT,
               job->graph_digest, job->toolchain.id, job->toolchain.version,
               job->toolchain.target);
        kiln_log_err ("job %llu: %s", (unsigned long long) job->id, message);
        w->failed++;
        s_job_requeue (self, job, message, false);
        goto done;
    }
    provenance = s_provenance (self, w, job);
    if (!provenance || kiln_artifact_sign (art, self->key, provenance, &err) != 0
        || kiln_artifact_digest (art, digest, &err) != 0
        || kiln_artifact_write_mem (art, &signed_bytes, &signed_len, &err) != 0) {
        s_fmt (message, sizeof message, "could not sign the artifact: %s",
               provenance ? err.msg : "out of memory");
        s_job_fail (self, job, err.code ? err.code : KILN_ENOMEM, message, NULL, false);
        goto done;
    }
    /* A store failure loses the cache entry, not the build: the clients
     * still get their artifact. */
    if (kiln_store_put_artifact (self->store, digest, signed_bytes, signed_len, &err) != 0
        || kiln_store_put_action (self->store, job->action_key, digest, &err) != 0)
        kiln_log_err ("job %llu action %.*s: could not store the artifact: %s",
                      (unsigned long long) job->id, S_KEY_SHORT, job->action_key, err.msg);
    kiln_store_forget_failure (self->store, job->action_key);
    kiln_log_notice ("job %llu action %.*s: built by %s in %lld ms, artifact %.*s, "
                     "%zu client%s", (unsigned long long) job->id, S_KEY_SHORT,
                     job->action_key, w->name, (long long) (zclock_mono () - job->started),
                     S_KEY_SHORT, digest, job->n_waiters, job->n_waiters == 1 ? "" : "s");
    for (size_t i = 0; i < job->n_waiters; i++)
        s_post_result (self, job->waiters[i].client->rid, job->waiters[i].req_id, digest,
                       job->action_key, job->graph_digest, false, w->name, signed_bytes,
                       signed_len);
    /* Until the store has it on disk, the same action is served from here. */
    s_pending_t *pending = calloc (1, sizeof *pending);
    if (pending) {
        memcpy (pending->action_key, job->action_key, KILN_HEX_LEN);
        memcpy (pending->artifact, digest, KILN_HEX_LEN);
        memcpy (pending->graph_digest, job->graph_digest, KILN_HEX_LEN);
        snprintf (pending->worker, sizeof pending->worker, "%s", w->name);
        pending->bytes = signed_bytes;
        pending->len = signed_len;
        pending->ticket = S_THIS_BATCH;
        signed_bytes = NULL;
        zhashx_update (self->pending, pending->action_key, pending);
    }
    for (uint32_t i = 0; i < job->n_blobs; i++)
        s_worker_holds (w, job->blobs[i].digest);
    w->done++;
    self->stats.done++;
    s_job_remove (self, job);
done:
    kiln_artifact_destroy (&art);
    free (bytes);
    free (signed_bytes);
    free (provenance);
}

/* The running job `w` holds with id `job_id`, or NULL (logged). */
static s_job_t *
s_worker_job (kiln_broker_t *self, s_worker_t *w, uint64_t job_id, const char *what)
{
    char id_key[24];
    snprintf (id_key, sizeof id_key, "%llu", (unsigned long long) job_id);
    s_job_t *job = zhashx_lookup (self->jobs_by_id, id_key);
    if (!job || job->worker != w) {
        kiln_log_info ("worker %s: %s for job %llu, which it does not hold; ignored", w->name,
                       what, (unsigned long long) job_id);
        return NULL;
    }
    return job;
}

static void
s_on_done (kiln_broker_t *self, s_worker_t *w, kiln_msg_t *msg)
{
    s_job_t *job = s_worker_job (self, w, msg->job_id, "DONE");
    if (!job)
        return;
    if (msg->ok) {
        s_job_succeed (self, job, w, msg);
        return;
    }
    int code = msg->code ? (int) msg->code : KILN_ECOMPILE;
    const char *text = msg->message ? msg->message : kiln_strerror (code);
    w->failed++;
    /* The worker could not run the job (full, shutting down, no workdir,
     * a blob it could not get): another worker may.  A compile error and
     * a timeout are final. */
    if (code == KILN_ECANCELED || code == KILN_ESYS || code == KILN_ENOTFOUND
        || code == KILN_EVERIFY || code == KILN_EIO) {
        char reason[KILN_ERR_MSG_MAX];
        s_fmt (reason, sizeof reason, "worker %s gave it back: %s", w->name, text);
        s_job_requeue (self, job, reason, false);
        return;
    }
    char message[KILN_ERR_MSG_MAX];
    s_fmt (message, sizeof message, "compile %s on worker %s: %s",
           code == KILN_ETIMEOUT ? "timed out" : "failed", w->name, text);
    s_job_fail (self, job, code, message, msg->log, code == KILN_ECOMPILE);
}

static void
s_on_log (kiln_broker_t *self, s_worker_t *w, kiln_msg_t *msg)
{
    s_job_t *job = s_worker_job (self, w, msg->job_id, "LOG");
    if (!job || !msg->log)
        return;
    size_t add = strlen (msg->log);
    if (add > KILN_MAX_LOG_BYTES - job->log_len)
        add = KILN_MAX_LOG_BYTES - job->log_len;       /* keep the beginning */
    if (add == 0)
        return;
    char *grown = realloc (job->log, job->log_len + add + 1);
    if (!grown)
        return;
    memcpy (grown + job->log_len, msg->log, add);
    job->log_len += add;
    grown[job->log_len] = '\0';
    job->log = grown;
}

/* FETCH: send `count` chunks of one of the job's blobs. */
static void
s_on_fetch (kiln_broker_t *self, s_worker_t *w, kiln_msg_t *msg)
{
    s_job_t *job = s_worker_job (self, w, msg->job_id, "FETCH");
    if (!job)
        return;
    const kiln_blob_ref_t *ref = NULL;
    for (uint32_t i = 0; i < job->n_blobs && !ref; i++) {
        char hex[KILN_HEX_LEN];
        kiln_hex (job->blobs[i].digest, KILN_DIGEST_LEN, hex);
        if (strcmp (hex, msg->digest) == 0)
            ref = &job->blobs[i];
    }
    kiln_err_t err = { 0 };
    if (!ref || msg->offset % KILN_CHUNK_BYTES != 0
        || (msg->offset >= ref->size && ref->size > 0)) {
        char text[256];
        s_fmt (text, sizeof text, "FETCH of blob %.*s at offset %llu: not a chunk of this "
               "job's blobs", S_KEY_SHORT, msg->digest, (unsigned long long) msg->offset);
        kiln_log_warn ("worker %s: %s", w->name, text);
        s_post_error (self, w->rid, 0, job->id, KILN_EPROTO, text, NULL);
        return;
    }
    uint64_t size = 0;
    int fd = kiln_store_blob_open (self->store, ref->digest, &size, &err);
    if (fd < 0 || size != ref->size) {
        if (fd >= 0)
            close (fd);
        char text[KILN_ERR_MSG_MAX];
        s_fmt (text, sizeof text, "the broker lost blob %s: %s", msg->digest,
               fd < 0 ? err.msg : "wrong size");
        s_job_fail (self, job, KILN_ENOTFOUND, text, NULL, false);
        return;
    }
    uint8_t *buf = malloc (KILN_CHUNK_BYTES);
    uint64_t offset = msg->offset;
    for (uint64_t i = 0; buf && i < msg->count; i++) {
        uint64_t n = size - offset < KILN_CHUNK_BYTES ? size - offset : KILN_CHUNK_BYTES;
        kiln_msg_t *chunk = kiln_msg_new (KILN_CMD_CHUNK);
        if (!chunk || pread (fd, buf, n, (off_t) offset) != (ssize_t) n) {
            kiln_msg_destroy (&chunk);
            kiln_log_err ("blob %.*s: read failed at offset %llu", S_KEY_SHORT, msg->digest,
                          (unsigned long long) offset);
            break;
        }
        chunk->job_id = job->id;
        memcpy (chunk->digest, msg->digest, KILN_HEX_LEN);
        chunk->blob_size = size;
        chunk->offset = offset;
        if (kiln_msg_put_chunk (chunk, buf, n, &err) != 0
            || s_send_now (self, w->rid, &chunk, w->name) != 0) {
            kiln_msg_destroy (&chunk);
            break;
        }
        self->stats.fetched_bytes += n;
        offset += n;
        if (offset >= size) {
            s_worker_holds (w, ref->digest);
            break;
        }
    }
    free (buf);
    close (fd);
}

/* --- clients (continued) ---------------------------------------------------- */

static s_client_t *
s_client_get (kiln_broker_t *self, zframe_t *rid, const char *key, const kiln_peer_t *peer,
              const char *declared)
{
    s_client_t *c = zhashx_lookup (self->clients, key);
    if (!c) {
        if (zhashx_size (self->clients) >= S_MAX_CLIENTS) {
            /* forget the longest silent client without requests */
            s_client_t *oldest = NULL;
            for (s_client_t *o = zhashx_first (self->clients); o;
                 o = zhashx_next (self->clients))
                if (o->pending == 0 && zhashx_size (o->uploads) == 0
                    && (!oldest || o->last_seen < oldest->last_seen))
                    oldest = o;
            if (!oldest)
                return NULL;
            s_client_drop (self, oldest, "too many clients");
        }
        c = calloc (1, sizeof *c);
        if (!c || !(c->key = strdup (key)) || !(c->rid = zframe_dup (rid))
            || !(c->uploads = zhashx_new ())) {
            s_client_destroy (&c);
            return NULL;
        }
        zhashx_set_destructor (c->uploads, (zhashx_destructor_fn *) s_upload_destroy);
        zhashx_insert (self->clients, key, c);
        if (self->curve && peer->name[0])
            snprintf (c->tenant, sizeof c->tenant, "%s", peer->name);
        else if (self->curve)
            snprintf (c->tenant, sizeof c->tenant, "key:%.20s", peer->key);
        c->authenticated = self->curve;
    }
    /* Without authentication the client names itself (user@host by
     * default); with it, the certificate does and the declared name is
     * ignored. */
    if (!self->curve && declared && kiln_proto_name_ok (declared))
        snprintf (c->tenant, sizeof c->tenant, "%s", declared);
    if (!c->tenant[0])
        snprintf (c->tenant, sizeof c->tenant, "anonymous");
    c->last_seen = zclock_mono ();
    return c;
}

/* Forget a client: release its requests (cancelling jobs nobody else
 * waits for) and abort its uploads. */
static void
s_client_drop (kiln_broker_t *self, s_client_t *c, const char *why)
{
    if (c->pending || zhashx_size (c->uploads))
        kiln_log_notice ("client %s (%s) dropped: %s; releasing %llu request%s", c->tenant,
                         c->key, why, (unsigned long long) c->pending,
                         c->pending == 1 ? "" : "s");
    if (c->pending) {
        zlistx_t *held = zlistx_new ();
        for (s_job_t *job = zhashx_first (self->jobs); held && job;
             job = zhashx_next (self->jobs))
            for (size_t i = 0; i < job->n_waiters; i++)
                if (job->waiters[i].client == c) {
                    zlistx_add_end (held, job);
                    break;
                }
        for (s_job_t *job = held ? zlistx_first (held) : NULL; job; job = zlistx_next (held))
            s_job_drop_waiter (self, job, c, 0, true, "its client went away");
        zlistx_destroy (&held);
    }
    self->uploads -= zhashx_size (c->uploads);
    /* replies still in the outbox for it go nowhere; drop them */
    for (s_outgoing_t *o = zlistx_first (self->outbox); o; o = zlistx_next (self->outbox))
        if (zframe_eq (o->rid, c->rid))
            kiln_msg_destroy (&o->msg);
    zhashx_delete (self->clients, c->key);
}

static int
s_digest_cmp (const void *a, const void *b)
{
    return memcmp (a, b, KILN_DIGEST_LEN);
}

/* Answer from the action cache.  True when answered. */
static bool
s_serve_cached (kiln_broker_t *self, zframe_t *rid, uint64_t req_id, const char *action_key,
                const char *graph_digest)
{
    kiln_err_t err = { 0 };
    char artifact[KILN_HEX_LEN];
    uint8_t *data = NULL;
    size_t len = 0;
    self->stats.lookups++;
    s_pending_t *pending = zhashx_lookup (self->pending, action_key);
    if (pending) {
        self->stats.hits++;
        s_post_result (self, rid, req_id, pending->artifact, action_key, graph_digest, true,
                       NULL, pending->bytes, pending->len);
        return true;
    }
    int rc = kiln_store_lookup (self->store, action_key, artifact, &data, &len, &err);
    if (rc == -KILN_ENOTFOUND)
        return false;
    if (rc != 0) {
        kiln_log_warn ("action %.*s: cache entry unusable, building again: %s", S_KEY_SHORT,
                       action_key, err.msg);
        return false;
    }
    self->stats.hits++;
    kiln_log_info ("action %.*s: served from the action cache (artifact %.*s)", S_KEY_SHORT,
                   action_key, S_KEY_SHORT, artifact);
    s_post_result (self, rid, req_id, artifact, action_key, graph_digest, true, NULL, data, len);
    free (data);
    return true;
}

/* Answer from the failure cache.  True when answered. */
static bool
s_serve_failure (kiln_broker_t *self, zframe_t *rid, uint64_t req_id, const char *action_key)
{
    kiln_err_t err = { 0 };
    int code = 0;
    char message[KILN_ERR_MSG_MAX];
    char *log = NULL;
    int rc = kiln_store_lookup_failure (self->store, action_key, &code, message, &log, &err);
    if (rc == -KILN_ENOTFOUND)
        return false;
    if (rc != 0) {
        kiln_log_warn ("action %.*s: failure record unusable, building again: %s",
                       S_KEY_SHORT, action_key, err.msg);
        kiln_store_forget_failure (self->store, action_key);
        return false;
    }
    self->stats.failure_hits++;
    kiln_log_info ("action %.*s: served a cached failure", S_KEY_SHORT, action_key);
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_ERROR);
    char text[KILN_ERR_MSG_MAX];
    s_fmt (text, sizeof text, "%s (a cached failure: this action failed before; "
           "--retry-failed builds it again)", message);
    if (msg) {
        msg->req_id = req_id;
        msg->cached = true;
        if (kiln_msg_set_error (msg, code, text, log) == 0)
            s_post (self, rid, &msg);
        kiln_msg_destroy (&msg);
    }
    free (log);
    return true;
}

/* Check a COMPILE: decode the structure, check the blob list against the
 * graph's weights, recompute the graph digest and action key, and stage
 * the inline blobs.  Fills the job's graph fields.  Returns 0 or an error
 * in `err`. */
static int
s_check_compile (kiln_broker_t *self, kiln_msg_t *msg, s_job_t *job, kiln_err_t *err)
{
    int rc = -KILN_EPROTO;
    kiln_graph_t *g = NULL;
    kiln_blob_ref_t *sorted = NULL;

    if (kiln_args_normalize (msg->compiler_args, job->args, KILN_MAX_ARGS_BYTES, err) != 0)
        return -err->code;
    if (!kiln_toolchain_word_ok (msg->compiler_id)
        || !kiln_toolchain_word_ok (msg->compiler_version)
        || !kiln_toolchain_word_ok (msg->target))
        return kiln_error (err, KILN_EPROTO, "toolchain '%.64s %.64s %.64s' is not three "
                           "words of [A-Za-z0-9._+-]", msg->compiler_id,
                           msg->compiler_version, msg->target);
    snprintf (job->toolchain.id, sizeof job->toolchain.id, "%s", msg->compiler_id);
    snprintf (job->toolchain.version, sizeof job->toolchain.version, "%s",
              msg->compiler_version);
    snprintf (job->toolchain.target, sizeof job->toolchain.target, "%s", msg->target);

    if (kiln_msg_part (msg, 0, &job->structure, &job->struct_len, err) != 0)
        return -err->code;
    if (!(g = kiln_graph_decode (job->structure, job->struct_len, err))) {
        rc = kiln_error_prefix (err, "graph structure");
        goto done;
    }
    /* The blob list must be exactly the graph's distinct weight blobs. */
    sorted = malloc ((msg->n_blobs ? msg->n_blobs : 1) * sizeof *sorted);
    if (!sorted) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory");
        goto done;
    }
    memcpy (sorted, msg->blobs, msg->n_blobs * sizeof *sorted);
    for (uint32_t i = 0; i < msg->n_blobs; i++)
        sorted[i].in_msg = false;       /* from here on: "used by a weight" */
    qsort (sorted, msg->n_blobs, sizeof *sorted, s_digest_cmp);
    for (uint32_t i = 1; i < msg->n_blobs; i++)
        if (memcmp (sorted[i - 1].digest, sorted[i].digest, KILN_DIGEST_LEN) == 0) {
            char hex[KILN_HEX_LEN];
            kiln_hex (sorted[i].digest, KILN_DIGEST_LEN, hex);
            rc = kiln_error (err, KILN_EPROTO, "blob %s is listed twice", hex);
            goto done;
        }
    uint32_t used = 0;
    for (int i = 0; i < g->n_weights; i++) {
        const kiln_weight_t *wt = &g->weights[i];
        kiln_blob_ref_t *ref = bsearch (wt->digest, sorted, msg->n_blobs, sizeof *sorted,
                                        s_digest_cmp);
        char hex[KILN_HEX_LEN];
        kiln_hex (wt->digest, KILN_DIGEST_LEN, hex);
        if (!ref) {
            rc = kiln_error (err, KILN_EPROTO, "the graph needs blob %s, which is not listed",
                             hex);
            goto done;
        }
        if (ref->size != wt->size) {
            rc = kiln_error (err, KILN_EPROTO, "blob %s is listed with %llu bytes, the graph's "
                             "weight has %llu", hex, (unsigned long long) ref->size,
                             (unsigned long long) wt->size);
            goto done;
        }
        if (!ref->in_msg) {         /* mark used, once */
            ref->in_msg = true;
            used++;
        }
    }
    if (used != msg->n_blobs) {
        for (uint32_t i = 0; i < msg->n_blobs; i++)
            if (!sorted[i].in_msg) {
                char hex[KILN_HEX_LEN];
                kiln_hex (sorted[i].digest, KILN_DIGEST_LEN, hex);
                rc = kiln_error (err, KILN_EPROTO, "blob %s is not used by the graph", hex);
                goto done;
            }
    }
    if (kiln_graph_digest (g, job->graph_digest, err) != 0) {
        rc = kiln_error_prefix (err, "graph digest");
        goto done;
    }
    if (strcmp (job->graph_digest, msg->graph_digest) != 0) {
        rc = kiln_error (err, KILN_EVERIFY, "graph digest mismatch: the request says %s, the "
                         "graph sent hashes to %s", msg->graph_digest, job->graph_digest);
        goto done;
    }
    kiln_action_key (job->graph_digest, job->args, job->toolchain.id, job->toolchain.version,
                     job->toolchain.target, job->action_key);
    if (strcmp (job->action_key, msg->action_key) != 0) {
        rc = kiln_error (err, KILN_EVERIFY, "action key mismatch: the request says %s, its "
                         "graph, arguments and toolchain give %s", msg->action_key,
                         job->action_key);
        goto done;
    }
    job->blobs = calloc (msg->n_blobs ? msg->n_blobs : 1, sizeof *job->blobs);
    if (!job->blobs) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory");
        goto done;
    }
    uint64_t inline_total = 0;
    for (uint32_t i = 0; i < msg->n_blobs; i++) {
        job->blobs[i] = msg->blobs[i];
        job->blobs[i].in_msg = false;
        if (!msg->blobs[i].in_msg)
            continue;
        char hex[KILN_HEX_LEN];
        kiln_hex (msg->blobs[i].digest, KILN_DIGEST_LEN, hex);
        inline_total += msg->blobs[i].size;
        if (inline_total > KILN_PROTO_INLINE_TOTAL) {
            rc = kiln_error (err, KILN_ELIMIT, "more than %u bytes of blobs inline; send "
                             "blob %s as CHUNKs", KILN_PROTO_INLINE_TOTAL, hex);
            goto done;
        }
        uint8_t *data = NULL;
        size_t len = 0;
        if (kiln_msg_blob_part (msg, i, &data, &len, err) != 0) {
            rc = -err->code;
            goto done;
        }
        rc = kiln_store_put_blob (self->store, msg->blobs[i].digest, data, len, err);
        free (data);
        if (rc != 0)
            goto done;
    }
    job->n_blobs = msg->n_blobs;
    rc = 0;
done:
    free (sorted);
    kiln_graph_destroy (&g);
    return rc;
}

/* The job's blobs the store lacks (not counting those this batch staged:
 * they commit before any reply goes out). */
static kiln_msg_t *
s_missing (kiln_broker_t *self, const kiln_msg_t *request, const s_job_t *job)
{
    kiln_msg_t *missing = NULL;
    for (uint32_t i = 0; i < job->n_blobs; i++) {
        if (request->blobs[i].in_msg || kiln_store_has_blob (self->store, job->blobs[i].digest))
            continue;
        if (!missing && !(missing = kiln_msg_new (KILN_CMD_MISSING)))
            return NULL;
        kiln_blob_ref_t *grown = realloc (missing->blobs,
                                          (missing->n_blobs + 1) * sizeof *grown);
        if (!grown) {
            kiln_msg_destroy (&missing);
            return NULL;
        }
        missing->blobs = grown;
        missing->blobs[missing->n_blobs] = job->blobs[i];
        missing->blobs[missing->n_blobs].in_msg = false;
        missing->n_blobs++;
    }
    return missing;
}

static void
s_on_compile (kiln_broker_t *self, zframe_t *rid, s_client_t *c, kiln_msg_t *msg)
{
    kiln_err_t err = { 0 };
    if (zhashx_size (self->jobs) >= S_MAX_JOBS
        || self->queued_bytes + msg->struct_size > self->cfg.max_queued_bytes) {
        kiln_error (&err, KILN_ELIMIT, "the broker is full (%zu jobs, %llu bytes of graphs "
                    "held); try again later", zhashx_size (self->jobs),
                    (unsigned long long) self->queued_bytes);
        goto refuse;
    }
    s_job_t *job = calloc (1, sizeof *job);
    if (!job || !(job->args = malloc (KILN_MAX_ARGS_BYTES))) {
        free (job);
        kiln_error (&err, KILN_ENOMEM, "out of memory");
        goto refuse;
    }
    if (s_check_compile (self, msg, job, &err) != 0) {
        s_job_destroy (&job);
        goto refuse;
    }
    if (s_serve_cached (self, rid, msg->req_id, job->action_key, job->graph_digest)
        || (!msg->retry_failed && s_serve_failure (self, rid, msg->req_id, job->action_key))) {
        s_job_destroy (&job);
        return;
    }
    if (msg->retry_failed)
        kiln_store_forget_failure (self->store, job->action_key);
    uint64_t timeout = msg->timeout_ms ? msg->timeout_ms : self->cfg.default_timeout_ms;
    s_job_t *running = zhashx_lookup (self->jobs, job->action_key);
    if (running) {
        s_job_destroy (&job);
        /* The same request again (a resubmission after a lost reply): it
         * already waits. */
        bool again = false;
        for (size_t i = 0; i < running->n_waiters && !again; i++)
            again = running->waiters[i].client == c && running->waiters[i].req_id == msg->req_id;
        if (!again) {
            if (running->n_waiters >= S_MAX_WAITERS) {
                kiln_error (&err, KILN_ELIMIT, "%d clients already wait for this action",
                            S_MAX_WAITERS);
                goto refuse;
            }
            s_waiter_t *waiters = realloc (running->waiters,
                                           (running->n_waiters + 1) * sizeof *waiters);
            if (!waiters) {
                kiln_error (&err, KILN_ENOMEM, "out of memory");
                goto refuse;
            }
            running->waiters = waiters;
            waiters[running->n_waiters++] = (s_waiter_t) { c, msg->req_id };
            c->pending++;
            self->stats.joined++;
            if (timeout > running->timeout_ms)
                running->timeout_ms = timeout;
            if (msg->priority < running->priority && running->item) {
                running->priority = (int) msg->priority;
                kiln_sched_set_priority (self->sched, running->item, running->priority);
            }
            kiln_log_info ("job %llu action %.*s: one more client waits (%zu, job %s)",
                           (unsigned long long) running->id, S_KEY_SHORT,
                           running->action_key, running->n_waiters,
                           s_state_name (running->state));
        }
        kiln_msg_t *ack = kiln_msg_new (KILN_CMD_ACCEPTED);
        if (ack) {
            ack->req_id = msg->req_id;
            ack->job_id = running->id;
            s_post (self, rid, &ack);
        }
        return;
    }
    kiln_msg_t *missing = s_missing (self, msg, job);
    if (missing) {
        missing->req_id = msg->req_id;
        uint32_t window = (uint32_t) self->cfg.credit_window;
        missing->credit = c->credit_out < window ? window - c->credit_out : 0;
        c->credit_out += (uint32_t) missing->credit;
        kiln_log_info ("COMPILE %llu from %s: %u blob%s missing", (unsigned long long) msg->req_id,
                       c->tenant, missing->n_blobs, missing->n_blobs == 1 ? "" : "s");
        s_post (self, rid, &missing);
        s_job_destroy (&job);
        return;
    }
    if (!s_worker_offers_any (self, &job->toolchain) && zhashx_size (self->workers) > 0) {
        char tc[KILN_PROTO_MAX_TOOLCHAIN + 1];
        kiln_log_notice ("job for action %.*s waits for a worker with %s: none is registered",
                         S_KEY_SHORT, job->action_key,
                         kiln_toolchain_format (&job->toolchain, tc, sizeof tc));
    }
    job->waiters = calloc (1, sizeof *job->waiters);
    if (!job->waiters) {
        s_job_destroy (&job);
        kiln_error (&err, KILN_ENOMEM, "out of memory");
        goto refuse;
    }
    job->waiters[0] = (s_waiter_t) { c, msg->req_id };
    job->n_waiters = 1;
    job->id = ++self->next_job_id;
    snprintf (job->id_key, sizeof job->id_key, "%llu", (unsigned long long) job->id);
    snprintf (job->tenant, sizeof job->tenant, "%s", c->tenant);
    job->priority = (int) msg->priority;
    job->timeout_ms = timeout;
    job->queued_at = zclock_mono ();
    if (s_job_enqueue (self, job, false) != 0) {
        s_job_destroy (&job);
        kiln_error (&err, KILN_ENOMEM, "out of memory");
        goto refuse;
    }
    c->pending++;
    for (uint32_t i = 0; i < job->n_blobs; i++) {
        if (!kiln_store_has_blob (self->store, job->blobs[i].digest))
            job->ticket = S_THIS_BATCH;        /* staged now, or in a batch on its way */
        kiln_store_blob_pin (self->store, job->blobs[i].digest);
    }
    if (job->ticket)
        zlistx_add_end (self->fresh, job);
    zhashx_insert (self->jobs, job->action_key, job);
    zhashx_insert (self->jobs_by_id, job->id_key, job);
    self->queued_bytes += job->struct_len;
    self->stats.submitted++;
    char tc[KILN_PROTO_MAX_TOOLCHAIN + 1];
    kiln_log_notice ("job %llu action %.*s: queued for %s (graph %.*s, %zu bytes, %u blob%s, "
                     "%s, args '%s', priority %d)", (unsigned long long) job->id, S_KEY_SHORT,
                     job->action_key, job->tenant, S_KEY_SHORT, job->graph_digest,
                     job->struct_len, job->n_blobs, job->n_blobs == 1 ? "" : "s",
                     kiln_toolchain_format (&job->toolchain, tc, sizeof tc), job->args,
                     job->priority);
    kiln_msg_t *ack = kiln_msg_new (KILN_CMD_ACCEPTED);
    if (ack) {
        ack->req_id = msg->req_id;
        ack->job_id = job->id;
        s_post (self, rid, &ack);
    }
    return;
refuse:
    kiln_log_warn ("COMPILE %llu from %s refused: %s", (unsigned long long) msg->req_id,
                   c->tenant, err.msg);
    s_post_error (self, rid, msg->req_id, 0, err.code, err.msg, NULL);
}

/* FIND: which of these blobs are not stored (REAPI's FindMissingBlobs). */
static void
s_on_find (kiln_broker_t *self, zframe_t *rid, s_client_t *c, kiln_msg_t *msg)
{
    kiln_msg_t *missing = kiln_msg_new (KILN_CMD_MISSING);
    if (!missing)
        return;
    missing->req_id = msg->req_id;
    missing->blobs = calloc (msg->n_blobs ? msg->n_blobs : 1, sizeof *missing->blobs);
    if (!missing->blobs) {
        kiln_msg_destroy (&missing);
        return;
    }
    for (uint32_t i = 0; i < msg->n_blobs; i++)
        if (!kiln_store_has_blob (self->store, msg->blobs[i].digest)) {
            missing->blobs[missing->n_blobs] = msg->blobs[i];
            missing->blobs[missing->n_blobs++].in_msg = false;
        }
    if (missing->n_blobs) {
        uint32_t window = (uint32_t) self->cfg.credit_window;
        missing->credit = c->credit_out < window ? window - c->credit_out : 0;
        c->credit_out += (uint32_t) missing->credit;
    }
    s_post (self, rid, &missing);
}

/* Return the credit this client has used, with the news of a stored blob.
 * Sent at once, not held for the batch's commit: credit is about memory,
 * not durability (a stored blob was fsynced already), and an upload
 * stalls while its credit waits. */
static void
s_post_credit (kiln_broker_t *self, s_client_t *c, const char *stored_hex)
{
    kiln_msg_t *credit = kiln_msg_new (KILN_CMD_CREDIT);
    if (!credit)
        return;
    credit->credit = c->credit_owed;
    credit->epoch = self->epoch;
    c->credit_out += c->credit_owed;
    c->credit_owed = 0;
    if (stored_hex)
        memcpy (credit->digest, stored_hex, KILN_HEX_LEN);
    s_send_now (self, c->rid, &credit, c->tenant);
}

/* Return credit in batches of a quarter window, or at once when the
 * client has none left to send with. */
static void
s_post_credit_due (kiln_broker_t *self, s_client_t *c)
{
    if (c->credit_owed > 0
        && (c->credit_owed >= (uint32_t) self->cfg.credit_window / 4 || c->credit_out == 0))
        s_post_credit (self, c, NULL);
}

static void s_upload_failed (kiln_broker_t *self, s_client_t *c, const char *hex,
                             const kiln_err_t *err);

/* A chunk of a blob upload. */
static void
s_on_chunk (kiln_broker_t *self, s_client_t *c, kiln_msg_t *msg)
{
    kiln_err_t err = { 0 };
    if (c->credit_out == 0) {
        kiln_log_warn ("client %s: CHUNK of blob %.*s without credit; refused", c->tenant,
                       S_KEY_SHORT, msg->digest);
        kiln_msg_t *e = kiln_msg_new (KILN_CMD_ERROR);
        if (e) {
            memcpy (e->digest, msg->digest, KILN_HEX_LEN);
            if (kiln_msg_set_error (e, KILN_EPROTO, "CHUNK sent without credit", NULL) == 0)
                s_post (self, c->rid, &e);
            kiln_msg_destroy (&e);
        }
        return;
    }
    c->credit_out--;
    bool held = false;                   /* the writer holds the chunk */
    s_upload_t *up = zhashx_lookup (c->uploads, msg->digest);
    if (up && msg->offset == 0) {
        /* The client starts this blob over (it resent its requests). */
        zhashx_delete (c->uploads, msg->digest);
        self->uploads--;
        up = NULL;
    }
    if (!up) {
        uint8_t digest[KILN_DIGEST_LEN];
        kiln_unhex (msg->digest, digest, KILN_DIGEST_LEN);
        if (msg->offset != 0) {
            kiln_error (&err, KILN_EPROTO, "upload of blob %s: chunk at offset %llu without "
                        "the chunks before it", msg->digest, (unsigned long long) msg->offset);
            goto fail;
        }
        if (zhashx_size (c->uploads) >= S_MAX_UPLOADS) {
            kiln_error (&err, KILN_ELIMIT, "more than %d uploads at once", S_MAX_UPLOADS);
            goto fail;
        }
        up = calloc (1, sizeof *up);
        if (up)
            up->client = c;
        if (!up || !(up->writer = kiln_store_blob_begin (self->store, digest, msg->blob_size,
                                                          (size_t) self->cfg.credit_window,
                                                          up, &err))) {
            free (up);
            if (!err.code)
                kiln_error (&err, KILN_ENOMEM, "out of memory");
            goto fail;
        }
        memcpy (up->hex, msg->digest, KILN_HEX_LEN);
        zhashx_insert (c->uploads, up->hex, up);
        self->uploads++;
    }
    up->last_chunk = zclock_mono ();
    if (msg->blob_size != kiln_blob_writer_size (up->writer)
        || msg->offset != kiln_blob_writer_received (up->writer)) {
        kiln_error (&err, KILN_EPROTO, "upload of blob %s: chunk at offset %llu of %llu bytes, "
                    "expected offset %llu of %llu", msg->digest,
                    (unsigned long long) msg->offset, (unsigned long long) msg->blob_size,
                    (unsigned long long) kiln_blob_writer_received (up->writer),
                    (unsigned long long) kiln_blob_writer_size (up->writer));
        goto fail;
    }
    zframe_t *frame = kiln_msg_take_chunk (msg);
    size_t chunk_len = frame ? zframe_size (frame) : 0;
    if (chunk_len > 0) {
        /* Taken without waiting: the client's credit bounds what the
         * writer holds, and the credit comes back as it lets go. */
        if (kiln_blob_writer_take (up->writer, &frame, &err) != 0)
            goto fail;
        up->pushed++;
        held = true;
    }
    zframe_destroy (&frame);
    self->stats.uploaded_bytes += chunk_len;
    if (!held)
        c->credit_owed++;
    if (kiln_blob_writer_received (up->writer) == kiln_blob_writer_size (up->writer)) {
        /* the writer's threads check and seal it; s_on_upload_news ends it */
        kiln_blob_writer_close (up->writer);
        up->closed = true;
    }
    s_post_credit_due (self, c);
    return;
fail:
    if (!held)
        c->credit_owed++;
    if (zhashx_lookup (c->uploads, msg->digest)) {
        zhashx_delete (c->uploads, msg->digest);
        self->uploads--;
    }
    s_upload_failed (self, c, msg->digest, &err);
}

/* Tell the client its upload of blob `hex` failed, with its credit back. */
static void
s_upload_failed (kiln_broker_t *self, s_client_t *c, const char *hex, const kiln_err_t *err)
{
    kiln_log_warn ("client %s: %s", c->tenant, err->msg);
    s_post_credit (self, c, NULL);
    kiln_msg_t *e = kiln_msg_new (KILN_CMD_ERROR);
    if (e) {
        memcpy (e->digest, hex, KILN_HEX_LEN);
        if (kiln_msg_set_error (e, err->code, err->msg, NULL) == 0)
            s_post (self, c->rid, &e);
        kiln_msg_destroy (&e);
    }
}

/* A blob writer let go of chunks, or is through: credit the client again,
 * and once the blob is checked and on disk, make it visible and say so. */
static void
s_on_upload_news (kiln_blob_writer_t *writer, void *tag, void *arg)
{
    kiln_broker_t *self = arg;
    s_upload_t *up = tag;
    s_client_t *c = up->client;
    uint64_t released = kiln_blob_writer_released (writer);
    if (released > up->credited) {
        c->credit_owed += (uint32_t) (released - up->credited);
        up->credited = released;
    }
    if (up->closed && kiln_blob_writer_done (writer)) {
        char hex[KILN_HEX_LEN];
        memcpy (hex, up->hex, KILN_HEX_LEN);
        uint64_t size = kiln_blob_writer_size (writer);
        up->writer = NULL;
        zhashx_delete (c->uploads, hex);     /* frees up */
        self->uploads--;
        kiln_err_t err = { 0 };
        if (kiln_store_blob_finish (self->store, &writer, &err) != 0) {
            s_upload_failed (self, c, hex, &err);
            return;
        }
        self->stats.uploaded_blobs++;
        kiln_log_info ("client %s: blob %.*s stored (%llu bytes)", c->tenant, S_KEY_SHORT,
                       hex, (unsigned long long) size);
        s_post_credit (self, c, hex);
        return;
    }
    s_post_credit_due (self, c);
}

static int
s_on_uploads (zloop_t *loop, zmq_pollitem_t *item, void *arg)
{
    kiln_broker_t *self = arg;
    kiln_store_upload_poll (self->store, s_on_upload_news, self);
    return 0;
}

static void
s_on_cancel (kiln_broker_t *self, s_client_t *c, kiln_msg_t *msg)
{
    for (s_job_t *job = zhashx_first (self->jobs); job; job = zhashx_next (self->jobs)) {
        for (size_t i = 0; i < job->n_waiters; i++)
            if (job->waiters[i].client == c && job->waiters[i].req_id == msg->req_id) {
                kiln_log_info ("client %s canceled request %llu (job %llu)", c->tenant,
                               (unsigned long long) msg->req_id, (unsigned long long) job->id);
                s_job_drop_waiter (self, job, c, msg->req_id, false, "its client canceled");
                return;      /* the hash may have changed: stop iterating */
            }
    }
}

static void
s_on_ping (kiln_broker_t *self, zframe_t *rid, kiln_msg_t *msg)
{
    kiln_msg_t *pong = kiln_msg_new (KILN_CMD_PONG);
    if (!pong)
        return;
    pong->req_id = msg->req_id;
    uint64_t idle = 0;
    for (s_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers))
        idle += (uint64_t) (w->slots - w->busy);
    pong->workers = zhashx_size (self->workers);
    pong->idle_slots = idle;
    pong->queued = kiln_sched_size (self->sched);
    pong->running = zhashx_size (self->jobs) - kiln_sched_size (self->sched);
    if (kiln_msg_set_str (&pong->broker, self->name) != 0) {
        kiln_msg_destroy (&pong);
        return;
    }
    s_post (self, rid, &pong);
}

/* --- status ------------------------------------------------------------------- */

static void
s_tenant_json (const char *tenant, size_t queued, uint64_t served, void *arg)
{
    json_t *obj = json_pack ("{s:s, s:I, s:I, s:I}", "client", tenant, "queued",
                             (json_int_t) queued, "running", (json_int_t) 0, "served",
                             (json_int_t) served);
    if (obj)
        json_array_append_new (arg, obj);
}

/* The broker's state as JSON (docs/operations.md).  Caller frees. */
static char *
s_status_json (kiln_broker_t *self)
{
    int64_t now = zclock_mono ();
    json_t *workers = json_array ();
    for (s_worker_t *w = zhashx_first (self->workers); workers && w;
         w = zhashx_next (self->workers)) {
        json_t *tcs = json_array ();
        for (uint32_t i = 0; tcs && i < w->n_toolchains; i++) {
            char tc[KILN_PROTO_MAX_TOOLCHAIN + 1];
            json_array_append_new (tcs, json_string (kiln_toolchain_format (&w->toolchains[i],
                                                                            tc, sizeof tc)));
        }
        json_array_append_new (
            workers, json_pack ("{s:s, s:b, s:i, s:i, s:o, s:I, s:I, s:I, s:I, s:I, s:I}",
                                "name", w->name, "authenticated", w->authenticated, "slots",
                                w->slots, "busy", w->busy, "toolchains", tcs ? tcs : json_null (),
                                "last_heartbeat_ms", (json_int_t) (now - w->last_seen),
                                "up_ms", (json_int_t) (now - w->since),
                                "dispatched", (json_int_t) w->dispatched,
                                "done", (json_int_t) w->done, "failed", (json_int_t) w->failed,
                                "blobs_held", (json_int_t) zhashx_size (w->blobs)));
    }
    json_t *clients = json_array ();
    if (clients)
        kiln_sched_each_tenant (self->sched, s_tenant_json, clients);
    /* running jobs per tenant */
    for (s_job_t *job = zhashx_first (self->jobs); clients && job;
         job = zhashx_next (self->jobs)) {
        if (job->state != S_JOB_RUNNING)
            continue;
        size_t i;
        json_t *entry;
        json_array_foreach (clients, i, entry) {
            if (strcmp (json_string_value (json_object_get (entry, "client")), job->tenant) == 0) {
                json_object_set_new (entry, "running",
                                     json_integer (json_integer_value (
                                         json_object_get (entry, "running")) + 1));
                break;
            }
        }
    }
    kiln_store_stats_t st;
    kiln_store_stats (self->store, &st);
    size_t queued = kiln_sched_size (self->sched);
    json_t *doc = json_pack (
        "{s:s, s:s, s:i, s:b, s:I, s:o, s:{s:I, s:I, s:o}, "
        "s:{s:I, s:I, s:f, s:I, s:I, s:I, s:I, s:I, s:I, s:I}, "
        "s:{s:I, s:I, s:I, s:I, s:I, s:I}, s:{s:I, s:I, s:I, s:I}}",
        "broker", self->name, "endpoint", self->endpoint, "protocol", KILN_PROTO_VERSION,
        "authenticated", self->curve, "up_ms", (json_int_t) (now - self->started),
        "workers", workers ? workers : json_array (),
        "queue", "queued", (json_int_t) queued, "running",
        (json_int_t) (zhashx_size (self->jobs) - queued), "clients",
        clients ? clients : json_array (),
        "cache", "lookups", (json_int_t) self->stats.lookups, "hits",
        (json_int_t) self->stats.hits, "hit_rate",
        self->stats.lookups ? (double) self->stats.hits / (double) self->stats.lookups : 0.0,
        "failure_hits", (json_int_t) self->stats.failure_hits, "artifacts",
        (json_int_t) st.artifacts, "blobs", (json_int_t) st.blobs, "failures",
        (json_int_t) st.failures, "bytes", (json_int_t) st.bytes, "max_bytes",
        (json_int_t) st.max_bytes, "evicted", (json_int_t) st.evicted,
        "jobs", "submitted", (json_int_t) self->stats.submitted, "done",
        (json_int_t) self->stats.done, "failed", (json_int_t) self->stats.failed, "canceled",
        (json_int_t) self->stats.canceled, "requeued", (json_int_t) self->stats.requeued,
        "joined", (json_int_t) self->stats.joined,
        "transfer", "uploaded_bytes", (json_int_t) self->stats.uploaded_bytes,
        "uploaded_blobs", (json_int_t) self->stats.uploaded_blobs, "uploads_in_progress",
        (json_int_t) self->uploads, "fetched_bytes", (json_int_t) self->stats.fetched_bytes);
    char *text = doc ? json_dumps (doc, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    json_decref (doc);
    return text;
}

static void
s_on_status (kiln_broker_t *self, zframe_t *rid, kiln_msg_t *msg)
{
    char *text = s_status_json (self);
    if (!text || strlen (text) > KILN_PROTO_MAX_REPORT) {
        free (text);
        s_post_error (self, rid, msg->req_id, 0, KILN_ELIMIT, "the status report is too big",
                      NULL);
        return;
    }
    kiln_msg_t *report = kiln_msg_new (KILN_CMD_REPORT);
    if (report) {
        report->req_id = msg->req_id;
        report->report = text;
        text = NULL;
        s_post (self, rid, &report);
    }
    free (text);
}

/* --- the loop -------------------------------------------------------------- */

/* The peer kinds a message may come from, as this broker sees them. */
static int
s_peer_kind (kiln_broker_t *self, const kiln_peer_t *peer, s_worker_t *w)
{
    if (!self->curve)
        return w ? KILN_PEER_WORKER : KILN_PEER_CLIENT | KILN_PEER_WORKER;
    if (strcmp (peer->role, "worker") == 0)
        return KILN_PEER_WORKER;
    return KILN_PEER_CLIENT;     /* a certificate without a role is a client's */
}

static void
s_handle (kiln_broker_t *self, zframe_t *rid, const char *key, const kiln_peer_t *peer,
          kiln_msg_t *msg)
{
    s_worker_t *w = zhashx_lookup (self->workers, key);
    if (w)
        w->last_seen = zclock_mono ();
    int senders = kiln_cmd_senders (msg->cmd);
    int kind = s_peer_kind (self, peer, w);
    if (!(kiln_cmd_receivers (msg->cmd) & KILN_PEER_BROKER) || !(senders & kind)) {
        char text[160];
        s_fmt (text, sizeof text, "%s is not a command the broker takes from a %s",
               kiln_cmd_name (msg->cmd), kind == KILN_PEER_WORKER ? "worker" : "client");
        kiln_log_warn ("peer %s%s%s: %s", key, peer->name[0] ? " " : "", peer->name, text);
        s_post_error (self, rid, msg->req_id, 0, KILN_EPROTO, text, NULL);
        return;
    }
    if (msg->cmd == KILN_CMD_ERROR) {
        kiln_log_warn ("%s %s sent ERROR %s: %s", w ? "worker" : "peer", w ? w->name : key,
                       kiln_errname ((int) msg->code), msg->message);
        return;
    }
    /* Worker traffic. */
    bool from_worker = w || msg->cmd == KILN_CMD_READY
                       || (senders & KILN_PEER_WORKER && !(senders & KILN_PEER_CLIENT))
                       || (msg->cmd == KILN_CMD_HEARTBEAT && msg->name);
    if (from_worker && (kind & KILN_PEER_WORKER)) {
        if (msg->cmd == KILN_CMD_READY) {
            s_on_ready (self, rid, key, w, peer, msg);
            return;
        }
        if (!w) {
            if (msg->cmd != KILN_CMD_DISCONNECT) {
                kiln_log_info ("peer %s sent %s before READY", key, kiln_cmd_name (msg->cmd));
                s_post_error (self, rid, 0, msg->job_id, KILN_ENOTFOUND,
                              "unknown worker: send READY first", NULL);
            }
            return;
        }
        switch (msg->cmd) {
        case KILN_CMD_DONE:       s_on_done (self, w, msg); break;
        case KILN_CMD_FETCH:      s_on_fetch (self, w, msg); break;
        case KILN_CMD_LOG:        s_on_log (self, w, msg); break;
        case KILN_CMD_DISCONNECT: s_worker_drop (self, w, "disconnected", false); break;
        default:                  break;      /* HEARTBEAT: last_seen is enough */
        }
        return;
    }
    /* Client traffic. */
    s_client_t *c = s_client_get (self, rid, key, peer,
                                  msg->cmd == KILN_CMD_COMPILE ? msg->client : NULL);
    if (!c) {
        s_post_error (self, rid, msg->req_id, 0, KILN_ELIMIT, "the broker has all the clients "
                      "it can take", NULL);
        return;
    }
    switch (msg->cmd) {
    case KILN_CMD_COMPILE:    s_on_compile (self, rid, c, msg); break;
    case KILN_CMD_CHUNK:      s_on_chunk (self, c, msg); break;
    case KILN_CMD_FIND:       s_on_find (self, rid, c, msg); break;
    case KILN_CMD_CANCEL:     s_on_cancel (self, c, msg); break;
    case KILN_CMD_PING:       s_on_ping (self, rid, msg); break;
    case KILN_CMD_STATUS:     s_on_status (self, rid, msg); break;
    case KILN_CMD_DISCONNECT: s_client_drop (self, c, "it disconnected"); break;
    case KILN_CMD_HEARTBEAT: {
        kiln_msg_t *hb = kiln_msg_new (KILN_CMD_HEARTBEAT);
        if (hb) {
            hb->pending = c->pending;
            s_post (self, rid, &hb);
        }
        break;
    }
    default:
        break;
    }
}

/* Commit what the batch staged, send the replies that waited for it,
 * and dispatch. */
/* Send the replies whose store commit is durable, in order: a reply
 * waits for its own batch's commit, and for every earlier one. */
static void
s_flush_outbox (kiln_broker_t *self)
{
    uint64_t durable = kiln_store_durable (self->store);
    s_outgoing_t *o;
    while ((o = zlistx_first (self->outbox)) && o->ticket <= durable) {
        o = zlistx_detach (self->outbox, NULL);
        if (o->msg && s_send_now (self, o->rid, &o->msg, "client") == -KILN_ENOTFOUND) {
            char *key = zframe_strhex (o->rid);
            s_client_t *c = key ? zhashx_lookup (self->clients, key) : NULL;
            if (c)
                s_client_drop (self, c, "its connection is closed");
            zstr_free (&key);
        }
        s_outgoing_destroy (&o);
    }
}

/* End of a batch of messages: hand what it staged to the store's syncer
 * (group commit, off the loop), tag the batch's replies, jobs and
 * pending artifacts with that commit, send what may go, dispatch. */
static void
s_finish_batch (kiln_broker_t *self)
{
    uint64_t ticket = 0;
    if (kiln_store_staged (self->store) > 0) {
        kiln_err_t err = { 0 };
        ticket = kiln_store_commit_async (self->store, &err);
        if (err.code)
            kiln_log_err ("store commit: %s", err.msg);
    }
    if (!ticket && kiln_store_last_ticket (self->store) > kiln_store_durable (self->store))
        ticket = kiln_store_last_ticket (self->store);    /* order behind what is on its way */
    for (s_outgoing_t *o = zlistx_last (self->outbox); o && o->ticket == S_THIS_BATCH;
         o = zlistx_prev (self->outbox))
        o->ticket = ticket;
    for (s_pending_t *p = zhashx_first (self->pending); p; p = zhashx_next (self->pending))
        if (p->ticket == S_THIS_BATCH)
            p->ticket = ticket;
    for (s_job_t *job = zlistx_first (self->fresh); job; job = zlistx_next (self->fresh))
        job->ticket = ticket;
    zlistx_purge (self->fresh);
    s_flush_outbox (self);
    s_dispatch (self);
}

/* A store commit is durable: index it, release what waited for it. */
static int
s_on_commit (zloop_t *loop, zmq_pollitem_t *item, void *arg)
{
    kiln_broker_t *self = arg;
    kiln_err_t err = { 0 };
    uint64_t durable = kiln_store_commit_collect (self->store, &err);
    if (err.code)
        kiln_log_err ("store commit: %s", err.msg);
    zlistx_t *done = zlistx_new ();
    for (s_pending_t *p = zhashx_first (self->pending); done && p; p = zhashx_next (self->pending))
        if (p->ticket <= durable)
            zlistx_add_end (done, p->action_key);
    for (const char *key = done ? zlistx_first (done) : NULL; key; key = zlistx_next (done))
        zhashx_delete (self->pending, key);
    zlistx_destroy (&done);
    s_flush_outbox (self);
    s_dispatch (self);
    return 0;
}

static void
s_receive_one (kiln_broker_t *self)
{
    kiln_err_t err = { 0 };
    zframe_t *rid = NULL;
    uint64_t req_id = 0;
    kiln_peer_t peer;
    kiln_msg_t *msg = kiln_msg_recv_peer (self->router, &rid, &peer, &req_id, &err);
    char *key = rid ? zframe_strhex (rid) : NULL;
    if (!msg) {
        if (rid && key) {
            kiln_log_warn ("refused a message from peer %s: %s", key, err.msg);
            s_post_error (self, rid, req_id, 0, err.code, err.msg, NULL);
        }
        else if (err.code != KILN_ECANCELED)
            kiln_log_warn ("receive failed: %s", err.msg);
    }
    else if (key)
        s_handle (self, rid, key, &peer, msg);
    zstr_free (&key);
    zframe_destroy (&rid);
    kiln_msg_destroy (&msg);
}

static int
s_on_message (zloop_t *loop, zsock_t *sock, void *arg)
{
    kiln_broker_t *self = arg;
    for (int i = 0; i < S_BATCH; i++) {
        s_receive_one (self);
        if (!(zsock_events (sock) & ZMQ_POLLIN))
            break;
    }
    s_finish_batch (self);
    return 0;
}

/* Every heartbeat: drop silent workers and clients, heartbeat workers,
 * give up on jobs far past their timeout, drop idle uploads. */
static int
s_on_heartbeat (zloop_t *loop, int timer_id, void *arg)
{
    kiln_broker_t *self = arg;
    int64_t now = zclock_mono ();
    zlistx_t *gone = zlistx_new ();
    if (!gone)
        return 0;
    for (s_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers)) {
        if (now - w->last_seen > self->cfg.liveness_ms) {
            zlistx_add_end (gone, w);
            continue;
        }
        kiln_msg_t *hb = kiln_msg_new (KILN_CMD_HEARTBEAT);
        if (hb && s_send_now (self, w->rid, &hb, w->name) == -KILN_ENOTFOUND)
            zlistx_add_end (gone, w);
    }
    for (s_worker_t *w = zlistx_first (gone); w; w = zlistx_next (gone)) {
        char reason[64];
        if (now - w->last_seen > self->cfg.liveness_ms)
            s_fmt (reason, sizeof reason, "silent for %lld ms", (long long) (now - w->last_seen));
        else
            s_fmt (reason, sizeof reason, "its connection is closed");
        s_worker_drop (self, w, reason, true);
    }
    zlistx_purge (gone);
    for (s_client_t *c = zhashx_first (self->clients); c; c = zhashx_next (self->clients))
        if (now - c->last_seen > self->cfg.liveness_ms)
            zlistx_add_end (gone, c);
    for (s_client_t *c = zlistx_first (gone); c; c = zlistx_next (gone)) {
        char reason[64];
        s_fmt (reason, sizeof reason, "silent for %lld ms", (long long) (now - c->last_seen));
        s_client_drop (self, c, reason);
    }
    zlistx_purge (gone);
    for (s_client_t *c = zhashx_first (self->clients); c; c = zhashx_next (self->clients)) {
        for (s_upload_t *up = zhashx_first (c->uploads); up; up = zhashx_next (c->uploads))
            if (!up->closed && now - up->last_chunk > S_UPLOAD_IDLE_MS)
                zlistx_add_end (gone, up);
        for (s_upload_t *up = zlistx_first (gone); up; up = zlistx_next (gone)) {
            kiln_log_warn ("client %s: upload of blob %.*s idle; dropped", c->tenant,
                           S_KEY_SHORT, up->hex);
            zhashx_delete (c->uploads, up->hex);
            self->uploads--;
        }
        zlistx_purge (gone);
    }
    for (s_job_t *job = zhashx_first (self->jobs); job; job = zhashx_next (self->jobs))
        if (job->state == S_JOB_RUNNING
            && now - job->started > (int64_t) job->timeout_ms + self->cfg.liveness_ms + S_GRACE_MS)
            zlistx_add_end (gone, job);
    for (s_job_t *job = zlistx_first (gone); job; job = zlistx_next (gone)) {
        char message[256];
        s_fmt (message, sizeof message, "worker %s did not finish within the %llu ms timeout",
               job->worker ? job->worker->name : "?", (unsigned long long) job->timeout_ms);
        if (job->worker) {
            kiln_msg_t *cancel = kiln_msg_new (KILN_CMD_CANCEL);
            if (cancel) {
                cancel->job_id = job->id;
                s_send_now (self, job->worker->rid, &cancel, job->worker->name);
            }
        }
        char *log = s_job_report_log (job, NULL);
        s_job_fail (self, job, KILN_ETIMEOUT, message, log, false);
        free (log);
    }
    zlistx_destroy (&gone);
    s_finish_batch (self);
    return 0;
}

/* A handshake the transport refused: log it (who it was, the transport
 * does not say; the ZAP status and the reason it does). */
static int
s_on_monitor (zloop_t *loop, zsock_t *sock, void *arg)
{
    zmsg_t *ev = zmsg_recv (sock);
    char *name = ev ? zmsg_popstr (ev) : NULL;
    char *value = ev ? zmsg_popstr (ev) : NULL;
    if (name && strcmp (name, "HANDSHAKE_FAILED_AUTH") == 0)
        kiln_log_warn ("refused a connection: its CurveZMQ certificate is not trusted "
                       "(ZAP status %s)", value ? value : "?");
    else if (name)
        kiln_log_warn ("refused a connection: %s (a peer without CurveZMQ, or with another "
                       "broker's key)", name);
    zstr_free (&name);
    zstr_free (&value);
    zmsg_destroy (&ev);
    return 0;
}

/* Turn on CurveZMQ: the broker's certificate, and zauth checking every
 * client and worker against the certificates in trust_dir. */
static int
s_setup_curve (kiln_broker_t *self, const kiln_broker_config_t *cfg, kiln_err_t *err)
{
    if (!zsys_has_curve ())
        return kiln_error (err, KILN_EUNSUPPORTED, "this libzmq has no CurveZMQ");
    if (!kiln_file_exists (cfg->trust_dir))
        return kiln_error (err, KILN_ENOTFOUND, "trusted certificate directory '%s' does not "
                           "exist", cfg->trust_dir);
    zcert_t *cert = zcert_load (cfg->cert_path);
    if (!cert)
        return kiln_error (err, KILN_EIO, "could not load the broker certificate '%s' (and "
                           "'%s_secret')", cfg->cert_path, cfg->cert_path);
    self->auth = zactor_new (zauth, NULL);
    if (!self->auth) {
        zcert_destroy (&cert);
        return kiln_error (err, KILN_ESYS, "could not start the ZAP authenticator");
    }
    zstr_sendx (self->auth, "CURVE", cfg->trust_dir, NULL);
    zsock_wait (self->auth);
    zcert_apply (cert, self->router);
    zcert_destroy (&cert);
    zsock_set_curve_server (self->router, 1);
    zsock_set_zap_domain (self->router, "kiln");
    self->curve = true;
    self->monitor = zactor_new (zmonitor, self->router);
    if (self->monitor) {
        zstr_sendx (self->monitor, "LISTEN", "HANDSHAKE_FAILED_NO_DETAIL",
                    "HANDSHAKE_FAILED_PROTOCOL", "HANDSHAKE_FAILED_AUTH", NULL);
        zstr_sendx (self->monitor, "START", NULL);
        zsock_wait (self->monitor);
    }
    return 0;
}

kiln_broker_t *
kiln_broker_new (const kiln_broker_config_t *cfg, kiln_err_t *err)
{
    if (!cfg->endpoint || !cfg->state_dir || !cfg->key_path) {
        kiln_error (err, KILN_EINVAL, "the broker needs an endpoint, a state directory and a key");
        return NULL;
    }
    if (!cfg->cert_path != !cfg->trust_dir) {
        kiln_error (err, KILN_EINVAL, "CurveZMQ needs both the broker's certificate (--cert) "
                    "and the directory of trusted certificates (--trust)");
        return NULL;
    }
    if (!cfg->cert_path && !kiln_proto_endpoint_is_local (cfg->endpoint)) {
        kiln_error (err, KILN_EUNSUPPORTED,
                    "refusing to listen on '%s' without authentication: give --cert and "
                    "--trust for CurveZMQ, or listen on loopback only "
                    "(tcp://127.0.0.1:PORT, tcp://[::1]:PORT, ipc://PATH)", cfg->endpoint);
        return NULL;
    }
    kiln_broker_t *self = calloc (1, sizeof *self);
    if (!self) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    self->cfg = *cfg;
    if (self->cfg.heartbeat_ms <= 0)
        self->cfg.heartbeat_ms = 1000;
    if (self->cfg.liveness_ms <= 0)
        self->cfg.liveness_ms = 5000;
    if (self->cfg.max_deaths <= 0)
        self->cfg.max_deaths = 3;
    if (self->cfg.max_dispatches <= 0)
        self->cfg.max_dispatches = 10;
    if (self->cfg.max_queued_bytes == 0)
        self->cfg.max_queued_bytes = 4ULL << 30;
    if (self->cfg.default_timeout_ms == 0)
        self->cfg.default_timeout_ms = 600 * 1000;
    if (self->cfg.default_timeout_ms > KILN_PROTO_MAX_TIMEOUT_MS)
        self->cfg.default_timeout_ms = KILN_PROTO_MAX_TIMEOUT_MS;
    if (self->cfg.credit_window <= 0)
        self->cfg.credit_window = 32;
    if (self->cfg.credit_window > KILN_PROTO_MAX_CREDIT)
        self->cfg.credit_window = KILN_PROTO_MAX_CREDIT;
    if (cfg->name)
        snprintf (self->name, sizeof self->name, "%s", cfg->name);
    else if (gethostname (self->name, sizeof self->name - 1) != 0)
        snprintf (self->name, sizeof self->name, "kiln-broker");
    if (!kiln_proto_name_ok (self->name)) {
        kiln_error (err, KILN_EINVAL, "broker name '%s' must be 1..%d characters of "
                    "[A-Za-z0-9._:@-]", self->name, KILN_PROTO_MAX_NAME);
        goto fail;
    }
    if (!(self->endpoint = strdup (cfg->endpoint))) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    self->cfg.endpoint = self->endpoint;
    self->cfg.state_dir = NULL;      /* only used here */
    self->cfg.key_path = NULL;
    self->cfg.name = NULL;
    self->cfg.cert_path = NULL;
    self->cfg.trust_dir = NULL;
    if (!(self->key = kiln_key_load_private (cfg->key_path, err))) {
        kiln_error_prefix (err, "farm key");
        goto fail;
    }
    if (!(self->store = kiln_store_new (cfg->state_dir, cfg->store_max_bytes, err))
        || kiln_store_trust_key (self->store, self->key, err) != 0)
        goto fail;
    self->sched = kiln_sched_new ();
    self->workers = zhashx_new ();
    self->clients = zhashx_new ();
    self->jobs = zhashx_new ();
    self->jobs_by_id = zhashx_new ();
    self->outbox = zlistx_new ();
    self->pending = zhashx_new ();
    self->fresh = zlistx_new ();
    self->loop = zloop_new ();
    if (!self->sched || !self->workers || !self->clients || !self->jobs || !self->jobs_by_id
        || !self->outbox || !self->pending || !self->fresh || !self->loop) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    zhashx_set_destructor (self->workers, (zhashx_destructor_fn *) s_worker_destroy);
    zhashx_set_destructor (self->clients, (zhashx_destructor_fn *) s_client_destroy);
    zhashx_set_destructor (self->jobs, (zhashx_destructor_fn *) s_job_destroy);
    zlistx_set_destructor (self->outbox, (zlistx_destructor_fn *) s_outgoing_destroy);
    zhashx_set_destructor (self->pending, (zhashx_destructor_fn *) s_pending_destroy);

    self->router = zsock_new (ZMQ_ROUTER);
    if (!self->router) {
        kiln_error (err, KILN_ESYS, "could not create a ZeroMQ socket");
        goto fail;
    }
    kiln_proto_socket_defaults (self->router);
    zsock_set_router_mandatory (self->router, 1);
    zsock_set_sndtimeo (self->router, 0);
    zsock_set_sndhwm (self->router, 100000);
    zsock_set_rcvhwm (self->router, 100000);
    if (strstr (cfg->endpoint, "[") || strstr (cfg->endpoint, "::"))
        zsock_set_ipv6 (self->router, 1);
    if (cfg->cert_path && s_setup_curve (self, cfg, err) != 0)
        goto fail;
    if (zsock_bind (self->router, "%s", cfg->endpoint) < 0) {
        kiln_error (err, KILN_EIO, "could not listen on '%s': %s", cfg->endpoint,
                    zmq_strerror (zmq_errno ()));
        goto fail;
    }
    if (zloop_reader (self->loop, self->router, s_on_message, self) != 0
        || zloop_timer (self->loop, (size_t) self->cfg.heartbeat_ms, 0, s_on_heartbeat,
                        self) < 0) {
        kiln_error (err, KILN_ESYS, "could not set up the event loop");
        goto fail;
    }
    zloop_reader_set_tolerant (self->loop, self->router);
    zmq_pollitem_t commit = { NULL, kiln_store_commit_fd (self->store), ZMQ_POLLIN, 0 };
    zmq_pollitem_t uploads = { NULL, kiln_store_upload_fd (self->store), ZMQ_POLLIN, 0 };
    if (zloop_poller (self->loop, &commit, s_on_commit, self) != 0
        || zloop_poller (self->loop, &uploads, s_on_uploads, self) != 0) {
        kiln_error (err, KILN_ESYS, "could not set up the event loop");
        goto fail;
    }
    if (self->monitor
        && zloop_reader (self->loop, zactor_sock (self->monitor), s_on_monitor, self) != 0) {
        kiln_error (err, KILN_ESYS, "could not set up the event loop");
        goto fail;
    }
    self->started = zclock_mono ();
    uint8_t random[16];
    if (RAND_bytes (random, sizeof random) != 1) {
        kiln_error (err, KILN_ECRYPTO, "no random bytes for the broker's epoch");
        goto fail;
    }
    memcpy (&self->epoch, random, 8);
    memcpy (&self->next_job_id, random + 8, 8);
    self->epoch |= 1;
    self->next_job_id = (self->next_job_id >> 16) + 1;    /* room for 2^16 restarts' worth */
    return self;
fail:
    kiln_broker_destroy (&self);
    return NULL;
}

void
kiln_broker_destroy (kiln_broker_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_broker_t *self = *self_p;
    zloop_destroy (&self->loop);
    zactor_destroy (&self->monitor);
    zsock_destroy (&self->router);
    zactor_destroy (&self->auth);
    zlistx_destroy (&self->outbox);
    zlistx_destroy (&self->fresh);
    zhashx_destroy (&self->pending);
    /* jobs unpin their blobs through the store, so they go first */
    if (self->jobs && self->store)
        for (s_job_t *job = zhashx_first (self->jobs); job; job = zhashx_next (self->jobs)) {
            if (job->item)
                kiln_sched_remove (self->sched, &job->item);
            s_job_unpin (self, job);
        }
    zhashx_destroy (&self->jobs_by_id);
    zhashx_destroy (&self->jobs);
    zhashx_destroy (&self->clients);
    zhashx_destroy (&self->workers);
    kiln_sched_destroy (&self->sched);
    kiln_store_destroy (&self->store);
    kiln_key_destroy (&self->key);
    free (self->endpoint);
    free (self);
    *self_p = NULL;
}

int
kiln_broker_run (kiln_broker_t *self)
{
    kiln_log_notice ("listening on %s as %s%s, signing with key %s", self->endpoint,
                     self->name, self->curve ? " (CurveZMQ)" : "", kiln_key_id (self->key));
    zloop_start (self->loop);
    size_t waiting = zhashx_size (self->jobs);
    kiln_log_notice ("stopping (%zu job%s not finished)", waiting, waiting == 1 ? "" : "s");
    return 0;
}
