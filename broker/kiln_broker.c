/*
 * kiln_broker — the broker's event loop, job queue and scheduler.
 */
#include "broker/kiln_broker.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <czmq.h>
#include <jansson.h>

#include "artifact/kiln_artifact.h"
#include "broker/kiln_store.h"
#include "common/kiln_hash.h"
#include "common/kiln_log.h"
#include "common/kiln_proto.h"
#include "graph/kiln_graph.h"

#define S_MAX_WORKERS   1024    /* registered workers */
#define S_MAX_JOBS      1024    /* jobs queued or running */
#define S_MAX_WAITERS   256     /* clients waiting for one job */
#define S_KEY_SHORT     12      /* hex chars of an action key in log lines */

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

typedef struct {
    zframe_t *client;          /* the client's routing id, owned */
    uint64_t req_id;           /* its request id, echoed in the reply */
} s_waiter_t;

typedef struct {
    uint8_t digest[KILN_DIGEST_LEN];   /* checked against the bytes */
    uint8_t *data;                     /* owned */
    size_t size;
} s_blob_t;

typedef struct {
    uint64_t id;                         /* unique in this broker's life */
    char id_key[24];                     /* id in decimal, key in jobs_by_id */
    s_job_state_t state;
    char action_key[KILN_HEX_LEN];       /* recomputed by the broker */
    char graph_digest[KILN_HEX_LEN];     /* recomputed by the broker */
    char *args;                          /* normalised compiler args, owned */
    char compiler_id[KILN_PROTO_MAX_ID + 1];
    char compiler_version[KILN_PROTO_MAX_ID + 1];
    char target[KILN_PROTO_MAX_ID + 1];
    uint8_t *structure;                  /* encoded graph structure, owned */
    size_t struct_len;
    s_blob_t *blobs;                     /* owned */
    uint32_t n_blobs;
    uint64_t bytes;                      /* structure + blobs */
    s_worker_t *worker;                  /* RUNNING: who has it */
    int attempts;                        /* dispatches so far */
    int64_t queued_at;                   /* zclock_mono at first queueing */
    s_waiter_t *waiters;                 /* owned, n_waiters used */
    size_t n_waiters;
} s_job_t;

struct s_worker {
    char *key;                           /* routing id in hex, owned */
    zframe_t *rid;                       /* routing id, owned */
    char name[KILN_PROTO_MAX_NAME + 1];
    char compiler_id[KILN_PROTO_MAX_ID + 1];
    char compiler_version[KILN_PROTO_MAX_ID + 1];
    char target[KILN_PROTO_MAX_ID + 1];
    int slots;                           /* jobs it runs at once */
    int busy;                            /* RUNNING jobs it holds */
    int64_t last_seen;                   /* zclock_mono of its last message */
    uint64_t dispatched;                 /* jobs given, to spread the load */
};

struct kiln_broker {
    kiln_broker_config_t cfg;            /* with defaults filled in */
    char *endpoint;                      /* owned copy */
    char name[KILN_PROTO_MAX_NAME + 1];  /* provenance "broker" */
    zsock_t *router;
    zloop_t *loop;
    kiln_key_t *key;                     /* the farm's signing key */
    kiln_store_t *store;
    zhashx_t *workers;                   /* hex routing id -> s_worker_t (owns) */
    zhashx_t *jobs;                      /* action key -> s_job_t (owns) */
    zhashx_t *jobs_by_id;                /* decimal id -> s_job_t */
    zlistx_t *queue;                     /* QUEUED jobs, oldest first */
    uint64_t next_job_id;
    uint64_t queued_bytes;               /* sum of jobs' bytes */
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

/* --- lifetimes ------------------------------------------------------------ */

static void
s_job_destroy (s_job_t **self_p)
{
    if (!*self_p)
        return;
    s_job_t *job = *self_p;
    free (job->args);
    free (job->structure);
    for (uint32_t i = 0; i < job->n_blobs; i++)
        free (job->blobs[i].data);
    free (job->blobs);
    for (size_t i = 0; i < job->n_waiters; i++)
        zframe_destroy (&job->waiters[i].client);
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
    zframe_destroy (&(*self_p)->rid);
    free (*self_p);
    *self_p = NULL;
}

static void
s_copy_id (char *dst, const char *src)
{
    snprintf (dst, KILN_PROTO_MAX_ID + 1, "%s", src ? src : "");
}

/* --- sending --------------------------------------------------------------- */

/* Send `msg` to `rid`; a failure is logged here, once. */
static int
s_send (kiln_broker_t *self, zframe_t *rid, kiln_msg_t **msg, const char *to)
{
    kiln_err_t err = { 0 };
    if (kiln_msg_send (msg, self->router, rid, &err) != 0) {
        kiln_log_warn ("could not reply to %s: %s", to, err.msg);
        return -1;
    }
    return 0;
}

static void
s_send_error (kiln_broker_t *self, zframe_t *rid, uint64_t req_id, uint64_t job_id,
              int code, const char *message, const char *log, const char *to)
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
    s_send (self, rid, &msg, to);
}

static void
s_send_result (kiln_broker_t *self, zframe_t *rid, uint64_t req_id, const char *artifact,
               const char *action_key, const char *graph_digest, bool cached,
               const char *worker, const uint8_t *data, size_t len, const char *to)
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
        kiln_log_err ("action %.*s: cannot send the artifact to %s: %s", S_KEY_SHORT,
                      action_key, to, err.msg);
        s_send_error (self, rid, req_id, 0, err.code ? err.code : KILN_ENOMEM, err.msg,
                      NULL, to);
        return;
    }
    s_send (self, rid, &msg, to);
}

/* --- jobs ------------------------------------------------------------------ */

/* Remove a finished job from the tables and free it. */
static void
s_job_remove (kiln_broker_t *self, s_job_t *job)
{
    self->queued_bytes -= job->bytes;
    zhashx_delete (self->jobs_by_id, job->id_key);
    zhashx_delete (self->jobs, job->action_key);      /* destroys the job */
}

/* Tell every waiting client that the job failed, then remove it. */
static void
s_job_fail (kiln_broker_t *self, s_job_t *job, int code, const char *message,
            const char *log)
{
    kiln_log_err ("job %llu action %.*s: failed: %s", (unsigned long long) job->id,
                  S_KEY_SHORT, job->action_key, message);
    for (size_t i = 0; i < job->n_waiters; i++)
        s_send_error (self, job->waiters[i].client, job->waiters[i].req_id, 0, code,
                      message, log, "client");
    s_job_remove (self, job);
}

/* Take a RUNNING job back from its worker and queue it at the head, or
 * fail it when it has used all its attempts. */
static void
s_job_requeue (kiln_broker_t *self, s_job_t *job, const char *reason)
{
    if (job->worker) {
        job->worker->busy--;
        job->worker = NULL;
    }
    if (job->attempts >= self->cfg.max_attempts) {
        char message[KILN_ERR_MSG_MAX];
        s_fmt (message, sizeof message, "job %llu gave up after %d attempts: %s",
                  (unsigned long long) job->id, job->attempts, reason);
        s_job_fail (self, job, KILN_EREMOTE, message, NULL);
        return;
    }
    job->state = S_JOB_QUEUED;
    zlistx_add_start (self->queue, job);
    kiln_log_notice ("job %llu action %.*s: back in the queue: %s",
                     (unsigned long long) job->id, S_KEY_SHORT, job->action_key, reason);
}

/* The idle worker with a matching compiler and the most free slots (the
 * one given fewer jobs when tied), or NULL. */
static s_worker_t *
s_pick_worker (kiln_broker_t *self, const s_job_t *job)
{
    s_worker_t *best = NULL;
    for (s_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers)) {
        if (w->busy >= w->slots || strcmp (w->compiler_id, job->compiler_id) != 0
            || strcmp (w->compiler_version, job->compiler_version) != 0
            || strcmp (w->target, job->target) != 0)
            continue;
        if (!best || w->slots - w->busy > best->slots - best->busy
            || (w->slots - w->busy == best->slots - best->busy
                && w->dispatched < best->dispatched))
            best = w;
    }
    return best;
}

/* Send `job` to `w`.  On failure the job stays as it was. */
static int
s_job_start (kiln_broker_t *self, s_job_t *job, s_worker_t *w)
{
    kiln_err_t err = { 0 };
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_JOB);
    if (!msg)
        return -1;
    msg->job_id = job->id;
    memcpy (msg->action_key, job->action_key, KILN_HEX_LEN);
    memcpy (msg->graph_digest, job->graph_digest, KILN_HEX_LEN);
    int rc = job->args[0] ? kiln_msg_set_str (&msg->compiler_args, job->args) : 0;
    if (rc == 0)
        rc = kiln_msg_put_structure (msg, job->structure, job->struct_len, &err);
    for (uint32_t i = 0; rc == 0 && i < job->n_blobs; i++)
        rc = kiln_msg_put_blob (msg, job->blobs[i].digest, job->blobs[i].data,
                                job->blobs[i].size, &err);
    if (rc != 0) {
        kiln_msg_destroy (&msg);
        kiln_log_err ("job %llu: cannot build the JOB message: %s",
                      (unsigned long long) job->id, err.msg);
        return -1;
    }
    if (kiln_msg_send (&msg, self->router, w->rid, &err) != 0) {
        kiln_log_warn ("job %llu: could not send to worker %s: %s",
                       (unsigned long long) job->id, w->name, err.msg);
        return -1;
    }
    job->state = S_JOB_RUNNING;
    job->worker = w;
    job->attempts++;
    w->busy++;
    w->dispatched++;
    kiln_log_notice ("job %llu action %.*s: sent to worker %s (attempt %d, waited %lld ms)",
                     (unsigned long long) job->id, S_KEY_SHORT, job->action_key, w->name,
                     job->attempts, (long long) (zclock_mono () - job->queued_at));
    return 0;
}

/* Hand queued jobs, oldest first, to idle workers.  Each queued job is
 * looked at once per call. */
static void
s_dispatch (kiln_broker_t *self)
{
    size_t n = zlistx_size (self->queue);
    for (size_t i = 0; i < n; i++) {
        s_job_t *job = zlistx_detach (self->queue, NULL);
        if (!job)
            break;
        s_worker_t *w = s_pick_worker (self, job);
        if (!w || s_job_start (self, job, w) != 0)
            zlistx_add_end (self->queue, job);
    }
}

/* --- workers --------------------------------------------------------------- */

/* Requeue every job `w` holds. */
static void
s_worker_release_jobs (kiln_broker_t *self, s_worker_t *w, const char *reason)
{
    zlistx_t *held = zlistx_new ();
    if (!held)
        return;
    for (s_job_t *job = zhashx_first (self->jobs); job; job = zhashx_next (self->jobs))
        if (job->worker == w)
            zlistx_add_end (held, job);
    for (s_job_t *job = zlistx_first (held); job; job = zlistx_next (held))
        s_job_requeue (self, job, reason);
    zlistx_destroy (&held);
}

static void
s_worker_drop (kiln_broker_t *self, s_worker_t *w, const char *reason)
{
    kiln_log_notice ("worker %s dropped: %s (%d job%s requeued)", w->name, reason,
                     w->busy, w->busy == 1 ? "" : "s");
    char why[KILN_PROTO_MAX_NAME + 64];
    s_fmt (why, sizeof why, "worker %s %s", w->name, reason);
    s_worker_release_jobs (self, w, why);
    zhashx_delete (self->workers, w->key);
}

static void
s_on_ready (kiln_broker_t *self, zframe_t *rid, const char *key, s_worker_t *w,
            kiln_msg_t *msg)
{
    if (!kiln_proto_name_ok (msg->name) || msg->slots < 1) {
        char text[256];
        s_fmt (text, sizeof text, "READY refused: the name must be 1..%d characters of "
                  "[A-Za-z0-9._:@-] and slots at least 1", KILN_PROTO_MAX_NAME);
        kiln_log_warn ("peer %s: %s", key, text);
        s_send_error (self, rid, 0, 0, KILN_EPROTO, text, NULL, "worker");
        return;
    }
    if (w) {
        kiln_log_notice ("worker %s registered again", w->name);
        s_worker_release_jobs (self, w, "its worker registered again");
    }
    else {
        if (zhashx_size (self->workers) >= S_MAX_WORKERS) {
            kiln_log_warn ("worker %s refused: %d workers already registered", msg->name,
                           S_MAX_WORKERS);
            s_send_error (self, rid, 0, 0, KILN_ELIMIT, "the broker has all the workers it "
                          "can take", NULL, "worker");
            return;
        }
        w = calloc (1, sizeof *w);
        if (!w || !(w->key = strdup (key)) || !(w->rid = zframe_dup (rid))) {
            s_worker_destroy (&w);
            kiln_log_err ("out of memory registering worker %s", msg->name);
            return;
        }
        zhashx_insert (self->workers, key, w);
    }
    snprintf (w->name, sizeof w->name, "%s", msg->name);
    s_copy_id (w->compiler_id, msg->compiler_id);
    s_copy_id (w->compiler_version, msg->compiler_version);
    s_copy_id (w->target, msg->target);
    w->slots = (int) msg->slots;
    w->last_seen = zclock_mono ();
    kiln_log_notice ("worker %s ready: %d slot%s, %s %s for %s", w->name, w->slots,
                     w->slots == 1 ? "" : "s", w->compiler_id, w->compiler_version,
                     w->target);
}

/* Provenance of a farm build.  Caller frees. */
static char *
s_provenance (kiln_broker_t *self, const s_worker_t *w)
{
    char stamp[32];
    time_t now = time (NULL);
    struct tm tm;
    gmtime_r (&now, &tm);
    strftime (stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &tm);
    json_t *obj = json_pack ("{s:s, s:s, s:s}", "builder", w->name, "broker", self->name,
                             "built_at", stamp);
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
        s_job_fail (self, job, KILN_EVERIFY, message, NULL);
        goto done;
    }
    const kiln_manifest_t *m = kiln_artifact_manifest (art);
    if (strcmp (m->action_key, job->action_key) != 0
        || strcmp (m->graph_digest, job->graph_digest) != 0) {
        s_fmt (message, sizeof message,
                  "worker %s returned an artifact for action %.*s / graph %.*s, "
                  "not the job's action %.*s / graph %.*s", w->name,
                  S_KEY_SHORT, m->action_key, S_KEY_SHORT, m->graph_digest,
                  S_KEY_SHORT, job->action_key, S_KEY_SHORT, job->graph_digest);
        s_job_fail (self, job, KILN_EVERIFY, message, NULL);
        goto done;
    }
    provenance = s_provenance (self, w);
    if (!provenance || kiln_artifact_sign (art, self->key, provenance, &err) != 0
        || kiln_artifact_digest (art, digest, &err) != 0
        || kiln_artifact_write_mem (art, &signed_bytes, &signed_len, &err) != 0) {
        s_fmt (message, sizeof message, "could not sign the artifact: %s",
                  provenance ? err.msg : "out of memory");
        s_job_fail (self, job, err.code ? err.code : KILN_ENOMEM, message, NULL);
        goto done;
    }
    /* A store failure loses the cache entry, not the build: the clients
     * still get their artifact. */
    if (kiln_store_put_artifact (self->store, digest, signed_bytes, signed_len, &err) != 0
        || kiln_store_put_action (self->store, job->action_key, digest, &err) != 0)
        kiln_log_err ("job %llu action %.*s: could not store the artifact: %s",
                      (unsigned long long) job->id, S_KEY_SHORT, job->action_key, err.msg);
    kiln_log_notice ("job %llu action %.*s: built by %s in %lld ms, artifact %.*s, "
                     "%zu client%s", (unsigned long long) job->id, S_KEY_SHORT,
                     job->action_key, w->name, (long long) (zclock_mono () - job->queued_at),
                     S_KEY_SHORT, digest, job->n_waiters, job->n_waiters == 1 ? "" : "s");
    for (size_t i = 0; i < job->n_waiters; i++)
        s_send_result (self, job->waiters[i].client, job->waiters[i].req_id, digest,
                       job->action_key, job->graph_digest, false, w->name, signed_bytes,
                       signed_len, "client");
    s_job_remove (self, job);
done:
    kiln_artifact_destroy (&art);
    free (bytes);
    free (signed_bytes);
    free (provenance);
}

static void
s_on_done (kiln_broker_t *self, s_worker_t *w, kiln_msg_t *msg)
{
    char id_key[24];
    snprintf (id_key, sizeof id_key, "%llu", (unsigned long long) msg->job_id);
    s_job_t *job = zhashx_lookup (self->jobs_by_id, id_key);
    if (!job || job->worker != w) {
        kiln_log_warn ("worker %s: DONE for job %llu, which it does not hold; ignored",
                       w->name, (unsigned long long) msg->job_id);
        return;
    }
    w->busy--;
    job->worker = NULL;
    if (msg->ok) {
        s_job_succeed (self, job, w, msg);
        return;
    }
    /* The worker could not run the job (full, shutting down, no
     * workdir): another worker may.  A compile error is final. */
    int code = msg->code ? (int) msg->code : KILN_ECOMPILE;
    if (code == KILN_ECANCELED || code == KILN_ESYS) {
        char reason[KILN_ERR_MSG_MAX];
        s_fmt (reason, sizeof reason, "worker %s gave it back: %s", w->name,
                  msg->message ? msg->message : kiln_strerror (code));
        job->state = S_JOB_QUEUED;
        s_job_requeue (self, job, reason);
        return;
    }
    char message[KILN_ERR_MSG_MAX];
    s_fmt (message, sizeof message, "compile failed on worker %s: %s", w->name,
              msg->message ? msg->message : kiln_strerror (code));
    s_job_fail (self, job, code, message, msg->log);
}

/* --- clients --------------------------------------------------------------- */

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
    int rc = kiln_store_lookup (self->store, action_key, artifact, &data, &len, &err);
    if (rc == -KILN_ENOTFOUND)
        return false;
    if (rc != 0) {
        kiln_log_warn ("action %.*s: cache entry unusable, building again: %s", S_KEY_SHORT,
                       action_key, err.msg);
        return false;
    }
    kiln_log_info ("action %.*s: served from the action cache (artifact %.*s)", S_KEY_SHORT,
                   action_key, S_KEY_SHORT, artifact);
    s_send_result (self, rid, req_id, artifact, action_key, graph_digest, true, NULL, data,
                   len, "client");
    free (data);
    return true;
}

/* Check a COMPILE: decode the structure, hash every blob, recompute the
 * graph digest and action key.  Fills the job's graph fields and takes the
 * payload's bytes.  Returns 0 or an error in `err`. */
static int
s_check_compile (kiln_broker_t *self, kiln_msg_t *msg, s_job_t *job, kiln_err_t *err)
{
    int rc = -KILN_EPROTO;
    kiln_graph_t *g = NULL;
    uint8_t (*sorted)[KILN_DIGEST_LEN] = NULL;

    if (kiln_args_normalize (msg->compiler_args, job->args, KILN_MAX_ARGS_BYTES, err) != 0)
        return -err->code;
    s_copy_id (job->compiler_id, msg->compiler_id);
    s_copy_id (job->compiler_version, msg->compiler_version);
    s_copy_id (job->target, msg->target);

    if (msg->n_blobs > 0) {
        sorted = malloc (msg->n_blobs * sizeof *sorted);
        if (!sorted)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        for (uint32_t i = 0; i < msg->n_blobs; i++)
            memcpy (sorted[i], msg->blobs[i].digest, KILN_DIGEST_LEN);
        qsort (sorted, msg->n_blobs, sizeof *sorted, s_digest_cmp);
        for (uint32_t i = 1; i < msg->n_blobs; i++)
            if (memcmp (sorted[i - 1], sorted[i], KILN_DIGEST_LEN) == 0) {
                char hex[KILN_HEX_LEN];
                kiln_hex (sorted[i], KILN_DIGEST_LEN, hex);
                rc = kiln_error (err, KILN_EPROTO, "blob %s is listed twice", hex);
                goto done;
            }
    }
    if (kiln_msg_part (msg, 0, &job->structure, &job->struct_len, err) != 0) {
        rc = -err->code;
        goto done;
    }
    if (!(g = kiln_graph_decode (job->structure, job->struct_len, err))) {
        rc = kiln_error_prefix (err, "graph structure");
        goto done;
    }
    job->blobs = calloc (msg->n_blobs ? msg->n_blobs : 1, sizeof *job->blobs);
    if (!job->blobs) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory");
        goto done;
    }
    job->bytes = job->struct_len;
    for (uint32_t i = 0; i < msg->n_blobs; i++) {
        s_blob_t *b = &job->blobs[job->n_blobs];
        memcpy (b->digest, msg->blobs[i].digest, KILN_DIGEST_LEN);
        if (kiln_msg_part (msg, 1 + i, &b->data, &b->size, err) != 0) {
            rc = -err->code;
            goto done;
        }
        job->n_blobs++;
        job->bytes += b->size;
        char hex[KILN_HEX_LEN];
        kiln_hex (b->digest, KILN_DIGEST_LEN, hex);
        int used = kiln_graph_attach_blob (g, b->digest, b->data, b->size, err);
        if (used < 0) {
            rc = kiln_error_prefix (err, "blob %s", hex);
            goto done;
        }
        if (used == 0) {
            rc = kiln_error (err, KILN_EPROTO, "blob %s is not used by the graph", hex);
            goto done;
        }
    }
    if (!kiln_graph_complete (g)) {
        for (int i = 0; i < g->n_weights; i++)
            if (!g->weights[i].data && g->weights[i].size > 0) {
                char hex[KILN_HEX_LEN];
                kiln_hex (g->weights[i].digest, KILN_DIGEST_LEN, hex);
                rc = kiln_error (err, KILN_EPROTO, "the graph needs blob %s, which was not sent",
                                 hex);
                goto done;
            }
        rc = kiln_error (err, KILN_EPROTO, "the graph is missing weight data");
        goto done;
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
    kiln_action_key (job->graph_digest, job->args, job->compiler_id, job->compiler_version,
                     job->target, job->action_key);
    if (strcmp (job->action_key, msg->action_key) != 0) {
        rc = kiln_error (err, KILN_EVERIFY, "action key mismatch: the request says %s, its "
                         "graph, arguments and compiler give %s", msg->action_key,
                         job->action_key);
        goto done;
    }
    rc = 0;
done:
    free (sorted);
    kiln_graph_destroy (&g);
    return rc;
}

static void
s_on_compile (kiln_broker_t *self, zframe_t *rid, const char *peer, kiln_msg_t *msg)
{
    kiln_err_t err = { 0 };
    uint64_t incoming = msg->struct_size;
    for (uint32_t i = 0; i < msg->n_blobs; i++)
        incoming += msg->blobs[i].size;
    if (zhashx_size (self->jobs) >= S_MAX_JOBS
        || self->queued_bytes + incoming > self->cfg.max_queued_bytes) {
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
    if (s_serve_cached (self, rid, msg->req_id, job->action_key, job->graph_digest)) {
        s_job_destroy (&job);
        return;
    }
    s_job_t *running = zhashx_lookup (self->jobs, job->action_key);
    s_job_t *target = running ? running : job;
    if (target->n_waiters >= S_MAX_WAITERS) {
        s_job_destroy (&job);
        kiln_error (&err, KILN_ELIMIT, "%d clients already wait for this action",
                    S_MAX_WAITERS);
        goto refuse;
    }
    s_waiter_t *waiters = realloc (target->waiters,
                                   (target->n_waiters + 1) * sizeof *waiters);
    zframe_t *client = zframe_dup (rid);
    if (!waiters || !client) {
        if (waiters)
            target->waiters = waiters;
        zframe_destroy (&client);
        s_job_destroy (&job);
        kiln_error (&err, KILN_ENOMEM, "out of memory");
        goto refuse;
    }
    target->waiters = waiters;
    waiters[target->n_waiters].client = client;
    waiters[target->n_waiters].req_id = msg->req_id;
    target->n_waiters++;
    if (running) {
        kiln_log_info ("job %llu action %.*s: one more client waits (%zu, job %s)",
                       (unsigned long long) running->id, S_KEY_SHORT, running->action_key,
                       running->n_waiters, s_state_name (running->state));
        s_job_destroy (&job);
        return;
    }
    job->id = ++self->next_job_id;
    snprintf (job->id_key, sizeof job->id_key, "%llu", (unsigned long long) job->id);
    job->state = S_JOB_QUEUED;
    job->queued_at = zclock_mono ();
    zhashx_insert (self->jobs, job->action_key, job);
    zhashx_insert (self->jobs_by_id, job->id_key, job);
    zlistx_add_end (self->queue, job);
    self->queued_bytes += job->bytes;
    kiln_log_notice ("job %llu action %.*s: queued (graph %.*s, %zu bytes, %u blob%s, "
                     "args '%s')", (unsigned long long) job->id, S_KEY_SHORT,
                     job->action_key, S_KEY_SHORT, job->graph_digest, (size_t) job->bytes,
                     job->n_blobs, job->n_blobs == 1 ? "" : "s", job->args);
    s_dispatch (self);
    return;
refuse:
    kiln_log_warn ("COMPILE %llu from %s refused: %s", (unsigned long long) msg->req_id,
                   peer, err.msg);
    s_send_error (self, rid, msg->req_id, 0, err.code, err.msg, NULL, "client");
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
    pong->queued = zlistx_size (self->queue);
    pong->running = zhashx_size (self->jobs) - zlistx_size (self->queue);
    if (kiln_msg_set_str (&pong->broker, self->name) != 0) {
        kiln_msg_destroy (&pong);
        return;
    }
    s_send (self, rid, &pong, "client");
}

/* --- the loop -------------------------------------------------------------- */

static int
s_on_message (zloop_t *loop, zsock_t *sock, void *arg)
{
    kiln_broker_t *self = arg;
    kiln_err_t err = { 0 };
    zframe_t *rid = NULL;
    uint64_t req_id = 0;
    kiln_msg_t *msg = kiln_msg_recv (sock, &rid, &req_id, &err);
    char *key = rid ? zframe_strhex (rid) : NULL;
    if (!msg) {
        if (rid && key) {
            kiln_log_warn ("refused a message from peer %s: %s", key, err.msg);
            s_send_error (self, rid, req_id, 0, err.code, err.msg, NULL, "peer");
        }
        else if (err.code != KILN_ECANCELED)
            kiln_log_warn ("receive failed: %s", err.msg);
        goto done;
    }
    if (!key)
        goto done;
    s_worker_t *w = zhashx_lookup (self->workers, key);
    if (w)
        w->last_seen = zclock_mono ();
    int senders = kiln_cmd_senders (msg->cmd);
    if (!(kiln_cmd_receivers (msg->cmd) & KILN_PEER_BROKER)) {
        char text[128];
        s_fmt (text, sizeof text, "%s is not a command the broker takes",
                  kiln_cmd_name (msg->cmd));
        kiln_log_warn ("peer %s: %s", key, text);
        s_send_error (self, rid, req_id, 0, KILN_EPROTO, text, NULL, "peer");
        goto done;
    }
    if (msg->cmd == KILN_CMD_ERROR) {
        kiln_log_warn ("%s %s sent ERROR %s: %s", w ? "worker" : "peer", w ? w->name : key,
                       kiln_errname ((int) msg->code), msg->message);
        goto done;
    }
    if (senders == KILN_PEER_WORKER || msg->cmd == KILN_CMD_HEARTBEAT) {
        if (msg->cmd == KILN_CMD_READY) {
            s_on_ready (self, rid, key, w, msg);
            s_dispatch (self);
            goto done;
        }
        if (!w) {
            if (msg->cmd != KILN_CMD_DISCONNECT) {
                kiln_log_info ("peer %s sent %s before READY", key, kiln_cmd_name (msg->cmd));
                s_send_error (self, rid, 0, msg->job_id, KILN_ENOTFOUND,
                              "unknown worker: send READY first", NULL, "peer");
            }
            goto done;
        }
        switch (msg->cmd) {
        case KILN_CMD_DONE:
            s_on_done (self, w, msg);
            s_dispatch (self);
            break;
        case KILN_CMD_DISCONNECT:
            s_worker_drop (self, w, "disconnected");
            s_dispatch (self);
            break;
        default:        /* HEARTBEAT: last_seen is enough */
            break;
        }
        goto done;
    }
    switch (msg->cmd) {
    case KILN_CMD_COMPILE:
        s_on_compile (self, rid, key, msg);
        break;
    case KILN_CMD_PING:
        s_on_ping (self, rid, msg);
        break;
    default:
        break;
    }
done:
    zstr_free (&key);
    zframe_destroy (&rid);
    kiln_msg_destroy (&msg);
    return 0;
}

/* Every heartbeat: drop silent workers, heartbeat the others, dispatch. */
static int
s_on_heartbeat (zloop_t *loop, int timer_id, void *arg)
{
    kiln_broker_t *self = arg;
    int64_t now = zclock_mono ();
    zlistx_t *silent = zlistx_new ();
    if (!silent)
        return 0;
    for (s_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers)) {
        if (now - w->last_seen > self->cfg.liveness_ms) {
            zlistx_add_end (silent, w);
            continue;
        }
        kiln_msg_t *hb = kiln_msg_new (KILN_CMD_HEARTBEAT);
        if (hb)
            s_send (self, w->rid, &hb, w->name);
    }
    for (s_worker_t *w = zlistx_first (silent); w; w = zlistx_next (silent)) {
        char reason[64];
        s_fmt (reason, sizeof reason, "silent for %lld ms",
                  (long long) (now - w->last_seen));
        s_worker_drop (self, w, reason);
    }
    zlistx_destroy (&silent);
    s_dispatch (self);
    return 0;
}

kiln_broker_t *
kiln_broker_new (const kiln_broker_config_t *cfg, kiln_err_t *err)
{
    if (!cfg->endpoint || !cfg->state_dir || !cfg->key_path) {
        kiln_error (err, KILN_EINVAL, "the broker needs an endpoint, a state directory and a key");
        return NULL;
    }
    if (!kiln_proto_endpoint_is_local (cfg->endpoint)) {
        kiln_error (err, KILN_EUNSUPPORTED,
                    "refusing to listen on '%s': the farm has no transport security yet "
                    "(CurveZMQ is planned), so the broker listens on loopback only "
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
    if (self->cfg.max_attempts <= 0)
        self->cfg.max_attempts = 3;
    if (self->cfg.max_queued_bytes == 0)
        self->cfg.max_queued_bytes = 4ULL << 30;
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
    if (!(self->key = kiln_key_load_private (cfg->key_path, err))) {
        kiln_error_prefix (err, "farm key");
        goto fail;
    }
    if (!(self->store = kiln_store_new (cfg->state_dir, err))
        || kiln_store_trust_key (self->store, self->key, err) != 0)
        goto fail;
    self->workers = zhashx_new ();
    self->jobs = zhashx_new ();
    self->jobs_by_id = zhashx_new ();
    self->queue = zlistx_new ();
    self->loop = zloop_new ();
    if (!self->workers || !self->jobs || !self->jobs_by_id || !self->queue || !self->loop) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    zhashx_set_destructor (self->workers, (zhashx_destructor_fn *) s_worker_destroy);
    zhashx_set_destructor (self->jobs, (zhashx_destructor_fn *) s_job_destroy);

    self->router = zsock_new (ZMQ_ROUTER);
    if (!self->router) {
        kiln_error (err, KILN_ESYS, "could not create a ZeroMQ socket");
        goto fail;
    }
    kiln_proto_socket_defaults (self->router);
    zsock_set_router_mandatory (self->router, 1);
    zsock_set_sndtimeo (self->router, 0);
    if (strstr (cfg->endpoint, "[::1]"))
        zsock_set_ipv6 (self->router, 1);
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
    zsock_destroy (&self->router);
    zlistx_destroy (&self->queue);
    zhashx_destroy (&self->jobs_by_id);
    zhashx_destroy (&self->jobs);
    zhashx_destroy (&self->workers);
    kiln_store_destroy (&self->store);
    kiln_key_destroy (&self->key);
    free (self->endpoint);
    free (self);
    *self_p = NULL;
}

int
kiln_broker_run (kiln_broker_t *self)
{
    kiln_log_notice ("listening on %s as %s, signing with key %s", self->endpoint,
                     self->name, kiln_key_id (self->key));
    zloop_start (self->loop);
    size_t waiting = zhashx_size (self->jobs);
    kiln_log_notice ("stopping (%zu job%s not finished)", waiting, waiting == 1 ? "" : "s");
    return 0;
}
