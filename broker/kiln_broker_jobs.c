/*
 * kiln_broker_jobs — the job state machine and scheduling.  A job is the
 * broker's record of one action key being built: QUEUED (in the
 * scheduler) or RUNNING (on one worker); it leaves the broker's tables
 * ("gone") when it succeeds, fails or is canceled.
 *
 *   state    event                                     next     where
 *   -        COMPILE admitted, its blobs stored        QUEUED   broker_on_compile (admit.c)
 *   QUEUED   an idle worker offers its toolchain       RUNNING  broker_dispatch: JOB sent
 *   RUNNING  DONE ok, the artifact checks out          gone     s_job_succeed: RESULT to all
 *            (and the cross-check accepts it)
 *   RUNNING  DONE ok or ECOMPILE, another build is      QUEUED   broker_xcheck_result: for a
 *            wanted to check (or decide) it                     worker that did not build it
 *   RUNNING  DONE ok or ECOMPILE, the builds disagree   gone     ERROR EVERIFY naming them
 *            and no other worker can decide                     (kiln_broker_xcheck.c)
 *   RUNNING  DONE ok, the artifact does not check out  QUEUED   broker_job_requeue
 *   RUNNING  DONE failed with ECANCELED, ESYS, EIO,    QUEUED   broker_job_requeue
 *            ENOTFOUND, EVERIFY (it could not run it)
 *   RUNNING  DONE failed otherwise                     gone     broker_job_fail (ECOMPILE cached
 *                                                               when confirmed or unchecked)
 *   RUNNING  its worker lost (a death), READY again,   QUEUED   broker_job_requeue
 *            DISCONNECT
 *   RUNNING  timeout + liveness + grace passed         gone     CANCEL, ETIMEOUT (kiln_broker.c)
 *   RUNNING  requeued with max_deaths deaths or        gone     ERROR EREMOTE with the history
 *            max_dispatches dispatches
 *   any      its last waiter leaves                    gone     s_job_cancel (CANCEL if RUNNING)
 *
 * docs/protocol.md ("The job state machine") draws the same.  Invariants:
 * a RUNNING job has exactly one worker and counts in its busy; a QUEUED
 * job is in the scheduler exactly once; a job's blobs stay pinned in the
 * store while it exists.  A worker's messages about the job it runs
 * (DONE, LOG, FETCH) are handled here too.
 */
#include "broker/kiln_broker_priv.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <czmq.h>
#include <jansson.h>

#include "common/kiln_log.h"

const char *
broker_job_state_name (broker_job_state_t state)
{
    switch (state) {
#define BROKER_STATE_TEXT(name, text) case BROKER_JOB_##name: return text;
        BROKER_JOB_STATES (BROKER_STATE_TEXT)
#undef BROKER_STATE_TEXT
    }
    return "?";
}

/* Add a line to the job's history (bounded). */
void
broker_job_note (broker_job_t *job, const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (line, sizeof line, fmt, ap);
    va_end (ap);
    size_t have = job->history ? strlen (job->history) : 0;
    size_t add = strlen (line);
    if (have + add + 2 > BROKER_MAX_HISTORY)
        return;
    char *grown = realloc (job->history, have + add + 2);
    if (!grown)
        return;
    memcpy (grown + have, line, add);
    grown[have + add] = '\n';
    grown[have + add + 1] = '\0';
    job->history = grown;
}
/* --- lifetime ------------------------------------------------------------- */

void
broker_job_destroy (broker_job_t **self_p)
{
    if (!*self_p)
        return;
    broker_job_t *job = *self_p;
    broker_collect_release (&job->collect);
    free (job->args);
    free (job->structure);
    free (job->blobs);
    free (job->history);
    free (job->log);
    free (job->waiters);
    free (job);
    *self_p = NULL;
}
/* --- jobs ------------------------------------------------------------------ */

void
broker_job_unpin (kiln_broker_t *self, broker_job_t *job)
{
    for (uint32_t i = 0; i < job->n_blobs; i++)
        kiln_store_blob_unpin (self->store, job->blobs[i].digest);
}

/* Remove a finished job from the tables and free it. */
static void
s_job_remove (kiln_broker_t *self, broker_job_t *job)
{
    if (job->item)
        kiln_sched_remove (self->sched, &job->item);
    if (job->ticket == BROKER_THIS_BATCH) {
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
    broker_job_unpin (self, job);
    self->queued_bytes -= job->struct_len;
    zhashx_delete (self->jobs_by_id, job->id_key);
    zhashx_delete (self->jobs, job->action_key);      /* destroys the job */
}

/* The job's log for a failure report: its history, then the last output. */
char *
broker_job_report_log (const broker_job_t *job, const char *extra)
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
void
broker_job_fail (kiln_broker_t *self, broker_job_t *job, int code, const char *message,
                 const char *log, bool cache_it)
{
    kiln_log_err ("job %llu action %.*s: failed: %s", (unsigned long long) job->id,
                  BROKER_KEY_SHORT, job->action_key, message);
    if (cache_it) {
        kiln_err_t err = { 0 };
        if (kiln_store_put_failure (self->store, job->action_key, code, message, log, &err) != 0)
            kiln_log_err ("job %llu: could not record the failure: %s",
                          (unsigned long long) job->id, err.msg);
    }
    for (size_t i = 0; i < job->n_waiters; i++)
        broker_post_error (self, job->waiters[i].client->rid, job->waiters[i].req_id, job->id,
                           code, message, log);
    self->stats.failed++;
    s_job_remove (self, job);
}

/* Queue `job` (again): `front` when it already ran. */
int
broker_job_enqueue (kiln_broker_t *self, broker_job_t *job, bool front)
{
    job->state = BROKER_JOB_QUEUED;
    job->item = kiln_sched_push (self->sched, job->tenant, job->priority, front, job);
    return job->item ? 0 : -1;
}

/* Take a job back from its worker and queue it at the head, or fail it
 * when it has killed too many workers or been dispatched too often. */
void
broker_job_requeue (kiln_broker_t *self, broker_job_t *job, const char *reason, bool death)
{
    const char *worker = job->worker ? job->worker->name : "?";
    broker_job_note (job, "attempt %d on worker %s: %s", job->dispatches, worker, reason);
    broker_collect_release (&job->collect);
    if (job->worker) {
        job->worker->busy--;
        job->worker = NULL;
    }
    if (death)
        job->deaths++;
    /* A cross-checked job is built more than once: each completed build
     * has the dispatch it took on top of the limit. */
    int max_dispatches = self->cfg.max_dispatches + job->n_builds;
    if (job->deaths >= self->cfg.max_deaths || job->dispatches >= max_dispatches) {
        char message[KILN_ERR_MSG_MAX];
        if (job->deaths >= self->cfg.max_deaths)
            broker_fmt (message, sizeof message, "job %llu gave up: %d workers were lost while "
                        "running it (last: %s)", (unsigned long long) job->id, job->deaths, reason);
        else
            broker_fmt (message, sizeof message, "job %llu gave up after %d attempts: %s",
                        (unsigned long long) job->id, job->dispatches, reason);
        char *log = broker_job_report_log (job, NULL);
        broker_job_fail (self, job, KILN_EREMOTE, message, log, false);
        free (log);
        return;
    }
    free (job->log);
    job->log = NULL;
    job->log_len = 0;
    self->stats.requeued++;
    if (broker_job_enqueue (self, job, true) != 0) {
        broker_job_fail (self, job, KILN_ENOMEM, "out of memory requeueing the job", NULL, false);
        return;
    }
    kiln_log_notice ("job %llu action %.*s: back in the queue: %s",
                     (unsigned long long) job->id, BROKER_KEY_SHORT, job->action_key, reason);
}

/* Nobody waits for `job` any more: stop it. */
static void
s_job_cancel (kiln_broker_t *self, broker_job_t *job, const char *why)
{
    kiln_log_notice ("job %llu action %.*s: canceled (%s, was %s)", (unsigned long long) job->id,
                     BROKER_KEY_SHORT, job->action_key, why, broker_job_state_name (job->state));
    if (job->worker) {
        kiln_msg_t *cancel = kiln_msg_new (KILN_CMD_CANCEL);
        if (cancel) {
            cancel->job_id = job->id;
            broker_send_now (self, job->worker->rid, &cancel, job->worker->name);
        }
    }
    self->stats.canceled++;
    s_job_remove (self, job);
}

/* Remove the waiter (client, req_id) from `job`; cancel the job when it
 * was the last.  True when the waiter was there. */
bool
broker_job_drop_waiter (kiln_broker_t *self, broker_job_t *job, broker_client_t *c, uint64_t req_id,
                        bool any_req, const char *why)
{
    bool found = false;
    for (size_t i = 0; i < job->n_waiters;) {
        broker_waiter_t *w = &job->waiters[i];
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

bool
broker_worker_offers (const broker_worker_t *w, const kiln_toolchain_id_t *tc)
{
    for (uint32_t i = 0; i < w->n_toolchains; i++)
        if (strcmp (w->toolchains[i].id, tc->id) == 0
            && strcmp (w->toolchains[i].version, tc->version) == 0
            && strcmp (w->toolchains[i].target, tc->target) == 0)
            return true;
    return false;
}

bool
broker_worker_offers_any (kiln_broker_t *self, const kiln_toolchain_id_t *tc)
{
    for (broker_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers))
        if (broker_worker_offers (w, tc) && !broker_xcheck_quarantined (self, w->name))
            return true;
    return false;
}

typedef struct {
    broker_worker_t **idle;
    size_t n;
    uint64_t durable;                /* the store's durable ticket */
    const kiln_broker_t *broker;
} s_idle_t;

bool
broker_worker_may_build (const kiln_broker_t *self, const broker_job_t *job,
                         const broker_worker_t *w)
{
    return broker_worker_offers (w, &job->toolchain) && broker_xcheck_may_run (self, job, w)
           && w->max_memory >= job->min_memory;
}

static bool
s_can_run (void *job_, void *arg)
{
    const broker_job_t *job = job_;
    const s_idle_t *idle = arg;
    if (job->ticket > idle->durable)
        return false;                /* its inline blobs are not on disk yet */
    for (size_t i = 0; i < idle->n; i++)
        if (idle->idle[i]->busy < idle->idle[i]->slots
            && broker_worker_may_build (idle->broker, job, idle->idle[i]))
            return true;
    return false;
}

/* Bytes of the job's blobs that `w` holds. */
static uint64_t
s_held_bytes (const broker_worker_t *w, const broker_job_t *job)
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
static broker_worker_t *
s_pick_worker (const s_idle_t *idle, const broker_job_t *job)
{
    broker_worker_t *best = NULL;
    uint64_t best_held = 0;
    for (size_t i = 0; i < idle->n; i++) {
        broker_worker_t *w = idle->idle[i];
        if (w->busy >= w->slots || !broker_worker_may_build (idle->broker, job, w))
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
/* Send `job` to `w`: the structure and, inline, the small blobs `w` lacks.
 * Returns the kiln_msg_send result; on failure the job is as it was. */
static int
s_job_start (kiln_broker_t *self, broker_job_t *job, broker_worker_t *w)
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
    job->state = BROKER_JOB_RUNNING;
    job->worker = w;
    job->started = zclock_mono ();
    job->dispatches++;
    w->busy++;
    w->dispatched++;
    broker_metrics_job_started (self, job);
    kiln_log_notice ("job %llu action %.*s: sent to worker %s (attempt %d, waited %lld ms)",
                     (unsigned long long) job->id, BROKER_KEY_SHORT, job->action_key, w->name,
                     job->dispatches, (long long) (job->started - job->queued_at));
    return 0;
}

/* Hand queued jobs to idle workers, as the scheduler orders them. */
void
broker_dispatch (kiln_broker_t *self)
{
    if (kiln_sched_size (self->sched) == 0)
        return;
    broker_worker_t *list[BROKER_MAX_WORKERS];
    s_idle_t idle = { list, 0, kiln_store_durable (self->store), self };
    int free_slots = 0;
    for (broker_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers))
        if (w->busy < w->slots && idle.n < BROKER_MAX_WORKERS
            && !broker_xcheck_quarantined (self, w->name)) {
            list[idle.n++] = w;
            free_slots += w->slots - w->busy;
        }
    while (free_slots > 0) {
        broker_job_t *job = kiln_sched_pop (self->sched, s_can_run, &idle);
        if (!job)
            break;
        job->item = NULL;
        broker_worker_t *w = s_pick_worker (&idle, job);
        if (!w) {             /* cannot happen: s_can_run saw the same list */
            if (broker_job_enqueue (self, job, true) != 0)
                broker_job_fail (self, job, KILN_ENOMEM, "out of memory requeueing the job", NULL,
                                 false);
            break;
        }
        int rc = s_job_start (self, job, w);
        if (rc == 0) {
            free_slots--;
            continue;
        }
        if (rc != -KILN_ENOTFOUND && rc != -KILN_EIO) {
            broker_job_fail (self, job, -rc, "the broker could not send the job to a worker", NULL,
                             false);
            continue;
        }
        if (broker_job_enqueue (self, job, true) != 0) {
            broker_job_fail (self, job, KILN_ENOMEM, "out of memory requeueing the job", NULL,
                             false);
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
            broker_worker_drop (self, w, "its connection is closed", true);
    }
}
void
broker_expect_fill (const broker_job_t *job, broker_expect_t *x)
{
    memcpy (x->action_key, job->action_key, KILN_HEX_LEN);
    memcpy (x->graph_digest, job->graph_digest, KILN_HEX_LEN);
    x->toolchain = job->toolchain;
    snprintf (x->args, sizeof x->args, "%s", job->args ? job->args : "");
}

bool
broker_expect_check (const broker_expect_t *x, const kiln_manifest_t *m, const char *worker,
                     char *message, size_t size)
{
    if (strcmp (m->action_key, x->action_key) == 0
        && strcmp (m->graph_digest, x->graph_digest) == 0
        && strcmp (m->compiler_id, x->toolchain.id) == 0
        && strcmp (m->compiler_version, x->toolchain.version) == 0
        && strcmp (m->target, x->toolchain.target) == 0
        && strcmp (m->compiler_args, x->args) == 0)
        return true;
    broker_fmt (message, size,
                "worker %s returned an artifact for action %.*s / graph %.*s built by "
                "%s %s for %s, not the job's action %.*s / graph %.*s for %s %s %s", worker,
                BROKER_KEY_SHORT, m->action_key, BROKER_KEY_SHORT, m->graph_digest,
                m->compiler_id, m->compiler_version, m->target, BROKER_KEY_SHORT,
                x->action_key, BROKER_KEY_SHORT, x->graph_digest, x->toolchain.id,
                x->toolchain.version, x->toolchain.target);
    return false;
}

char *
broker_provenance (kiln_broker_t *self, const broker_worker_t *w, const broker_job_t *job)
{
    char stamp[32];
    time_t now = time (NULL);
    struct tm tm;
    gmtime_r (&now, &tm);
    strftime (stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &tm);
    json_t *obj = json_pack ("{s:s, s:s, s:s, s:s, s:b}", "builder", w->name, "broker",
                             self->name, "built_at", stamp, "client", job->tenant,
                             "authenticated", self->curve);
    if (obj)
        broker_xcheck_provenance (self, job, w, obj);
    char *text = obj ? json_dumps (obj, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    json_decref (obj);
    return text;
}

void
broker_job_succeed (kiln_broker_t *self, broker_job_t *job, broker_worker_t *w,
                    const char *digest, uint8_t **bytes, uint64_t len, int *fd_p,
                    const char *tmp)
{
    kiln_err_t err = { 0 };
    /* A store failure loses the cache entry, not the build: the clients
     * still get their artifact (a large one only while it is staged). */
    int rc = bytes && *bytes
             ? kiln_store_put_artifact (self->store, digest, *bytes, (size_t) len, &err)
             : kiln_store_put_artifact_file (self->store, digest, tmp, fd_p, len, &err);
    /* A disputed build (its workers disagreed, a third decided) reaches
     * its waiting clients, by content hash, but never the action cache:
     * the next request builds it again. */
    if (rc != 0 || (!job->disputed
                    && kiln_store_put_action (self->store, job->action_key, digest, &err) != 0))
        kiln_log_err ("job %llu action %.*s: could not store the artifact: %s",
                      (unsigned long long) job->id, BROKER_KEY_SHORT, job->action_key, err.msg);
    if (!job->disputed)
        kiln_store_forget_failure (self->store, job->action_key);
    const char *builder = broker_xcheck_confirmer (job);    /* as the provenance says */
    kiln_log_notice ("job %llu action %.*s: built by %s%s%s in %lld ms, artifact %.*s "
                     "(%llu bytes), %zu client%s", (unsigned long long) job->id,
                     BROKER_KEY_SHORT, job->action_key, builder ? builder : w->name,
                     builder ? ", checked by " : "", builder ? w->name : "",
                     (long long) (zclock_mono () - job->started), BROKER_KEY_SHORT, digest,
                     (unsigned long long) len, job->n_waiters, job->n_waiters == 1 ? "" : "s");
    const uint8_t *data = bytes ? *bytes : NULL;
    if (!builder)
        builder = w->name;
    for (size_t i = 0; i < job->n_waiters; i++)
        broker_post_result (self, job->waiters[i].client->rid, job->waiters[i].req_id, digest,
                            job->action_key, job->graph_digest, false, builder, data, len);
    /* Until the store has it on disk, the same action is served from here. */
    broker_pending_t *pending = job->disputed ? NULL : calloc (1, sizeof *pending);
    if (pending) {
        memcpy (pending->action_key, job->action_key, KILN_HEX_LEN);
        memcpy (pending->artifact, digest, KILN_HEX_LEN);
        memcpy (pending->graph_digest, job->graph_digest, KILN_HEX_LEN);
        snprintf (pending->worker, sizeof pending->worker, "%s", builder);
        pending->bytes = bytes ? *bytes : NULL;
        pending->len = len;
        pending->ticket = BROKER_THIS_BATCH;
        if (bytes)
            *bytes = NULL;
        zhashx_update (self->pending, pending->action_key, pending);
    }
    for (uint32_t i = 0; i < job->n_blobs; i++)
        broker_worker_holds (w, job->blobs[i].digest);
    w->done++;
    self->stats.done++;
    if (job->n_builds == 0)
        self->stats.unchecked++;              /* also a large one, signed on a thread */
    broker_metrics_job_built (self, job);
    broker_progress_job_built (self, job);
    s_job_remove (self, job);
}

/* Check the worker's unsigned artifact (inline in DONE) against the job,
 * sign it, store it and answer every waiting client. */
static void
s_job_succeed (kiln_broker_t *self, broker_job_t *job, broker_worker_t *w, kiln_msg_t *msg)
{
    kiln_err_t err = { 0 };
    uint8_t *bytes = NULL, *signed_bytes = NULL;
    size_t len = 0, signed_len = 0;
    char *provenance = NULL;
    char digest[KILN_HEX_LEN];
    char message[KILN_ERR_MSG_MAX];
    kiln_artifact_t *art = NULL;
    broker_expect_t expect;
    broker_expect_fill (job, &expect);

    if (kiln_msg_part (msg, 0, &bytes, &len, &err) != 0
        || !(art = kiln_artifact_read_mem (bytes, len, &err))) {
        broker_fmt (message, sizeof message, "worker %s returned an unreadable artifact: %s",
                    w->name, err.msg);
        kiln_log_err ("job %llu: %s", (unsigned long long) job->id, message);
        w->failed++;
        broker_job_requeue (self, job, message, false);
        goto done;
    }
    if (!broker_expect_check (&expect, kiln_artifact_manifest (art), w->name, message,
                              sizeof message)) {
        kiln_log_err ("job %llu: %s", (unsigned long long) job->id, message);
        w->failed++;
        broker_job_requeue (self, job, message, false);
        goto done;
    }
    /* The content hash does not depend on the signature: it is what two
     * builds of the same action must agree on. */
    if (kiln_artifact_digest (art, digest, &err) != 0) {
        broker_fmt (message, sizeof message, "worker %s returned an artifact whose manifest "
                    "cannot be written: %s", w->name, err.msg);
        w->failed++;
        broker_job_requeue (self, job, message, false);
        goto done;
    }
    if (broker_xcheck_result (self, job, w, digest, 0, NULL, NULL) != BROKER_XCHECK_ACCEPT)
        goto done;
    provenance = broker_provenance (self, w, job);
    if (!provenance || kiln_artifact_sign (art, self->key, provenance, &err) != 0
        || kiln_artifact_digest (art, digest, &err) != 0
        || kiln_artifact_write_mem (art, &signed_bytes, &signed_len, &err) != 0) {
        broker_fmt (message, sizeof message, "could not sign the artifact: %s",
                    provenance ? err.msg : "out of memory");
        broker_job_fail (self, job, err.code ? err.code : KILN_ENOMEM, message, NULL, false);
        goto done;
    }
    broker_job_succeed (self, job, w, digest, &signed_bytes, signed_len, NULL, NULL);
done:
    kiln_artifact_destroy (&art);
    free (bytes);
    free (signed_bytes);
    free (provenance);
}

broker_job_t *
broker_worker_job (kiln_broker_t *self, broker_worker_t *w, uint64_t job_id, const char *what)
{
    char id_key[24];
    snprintf (id_key, sizeof id_key, "%llu", (unsigned long long) job_id);
    broker_job_t *job = zhashx_lookup (self->jobs_by_id, id_key);
    if (!job || job->worker != w) {
        kiln_log_info ("worker %s: %s for job %llu, which it does not hold; ignored", w->name,
                       what, (unsigned long long) job_id);
        return NULL;
    }
    return job;
}

void
broker_on_done (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    broker_worker_t *w = from->worker;
    broker_job_t *job = broker_worker_job (self, w, msg->job_id, "DONE");
    if (!job)
        return;
    if (msg->ok && msg->artifact_apart) {
        broker_collect_start (self, job, w, msg->artifact_apart);
        return;
    }
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
        broker_fmt (reason, sizeof reason, "worker %s gave it back: %s", w->name, text);
        broker_job_requeue (self, job, reason, false);
        return;
    }
    /* A compile stopped at its worker's memory limit is tried once more on
     * a worker that gives compiles more, when one is connected. */
    if (code == KILN_ELIMIT && msg->out_of_memory && job->min_memory == 0) {
        broker_worker_t *big = NULL;
        job->min_memory = w->max_memory + 1;
        for (broker_worker_t *o = zhashx_first (self->workers); o && !big;
             o = zhashx_next (self->workers))
            if (o != w && broker_worker_may_build (self, job, o))
                big = o;
        if (big) {
            char reason[KILN_ERR_MSG_MAX];
            broker_fmt (reason, sizeof reason, "worker %s: %s; trying a worker that gives "
                        "compiles more memory", w->name, text);
            broker_job_requeue (self, job, reason, false);
            return;
        }
        job->min_memory = 0;
    }
    /* Only a compile error is a property of the job, and only one that
     * another worker confirms (or nobody can) is cached: a timeout, a
     * signal or a limit is the host's, never cached nor cross-checked. */
    if (code == KILN_ECOMPILE
        && broker_xcheck_result (self, job, w, NULL, code, text, msg->log)
           != BROKER_XCHECK_ACCEPT)
        return;
    char message[KILN_ERR_MSG_MAX], also[KILN_PROTO_MAX_NAME + 32] = "";
    const char *confirmer = code == KILN_ECOMPILE ? broker_xcheck_confirmer (job) : NULL;
    if (confirmer)
        broker_fmt (also, sizeof also, " (the same on worker %s)", confirmer);
    broker_fmt (message, sizeof message, "compile %s on worker %s%s: %s",
                code == KILN_ETIMEOUT ? "timed out" : "failed", w->name, also, text);
    broker_job_fail (self, job, code, message, msg->log,
                     code == KILN_ECOMPILE && !job->disputed);
}

void
broker_on_log (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    broker_worker_t *w = from->worker;
    broker_job_t *job = broker_worker_job (self, w, msg->job_id, "LOG");
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
void
broker_on_fetch (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    broker_worker_t *w = from->worker;
    broker_job_t *job = broker_worker_job (self, w, msg->job_id, "FETCH");
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
        broker_fmt (text, sizeof text, "FETCH of blob %.*s at offset %llu: not a chunk of this "
                    "job's blobs", BROKER_KEY_SHORT, msg->digest, (unsigned long long) msg->offset);
        kiln_log_warn ("worker %s: %s", w->name, text);
        broker_post_error (self, w->rid, 0, job->id, KILN_EPROTO, text, NULL);
        return;
    }
    uint64_t size = 0;
    int fd = kiln_store_blob_open (self->store, ref->digest, &size, &err);
    if (fd < 0 || size != ref->size) {
        if (fd >= 0)
            close (fd);
        char text[KILN_ERR_MSG_MAX];
        broker_fmt (text, sizeof text, "the broker lost blob %s: %s", msg->digest,
                    fd < 0 ? err.msg : "wrong size");
        broker_job_fail (self, job, KILN_ENOTFOUND, text, NULL, false);
        return;
    }
    uint8_t *buf = malloc (KILN_CHUNK_BYTES);
    uint64_t offset = msg->offset;
    for (uint64_t i = 0; buf && i < msg->count; i++) {
        uint64_t n = size - offset < KILN_CHUNK_BYTES ? size - offset : KILN_CHUNK_BYTES;
        kiln_msg_t *chunk = kiln_msg_new (KILN_CMD_CHUNK);
        if (!chunk || pread (fd, buf, n, (off_t) offset) != (ssize_t) n) {
            kiln_msg_destroy (&chunk);
            kiln_log_err ("blob %.*s: read failed at offset %llu", BROKER_KEY_SHORT, msg->digest,
                          (unsigned long long) offset);
            break;
        }
        chunk->job_id = job->id;
        memcpy (chunk->digest, msg->digest, KILN_HEX_LEN);
        chunk->blob_size = size;
        chunk->offset = offset;
        if (kiln_msg_put_chunk (chunk, buf, n, &err) != 0
            || broker_send_now (self, w->rid, &chunk, w->name) != 0) {
            kiln_msg_destroy (&chunk);
            break;
        }
        self->stats.fetched_bytes += n;
        offset += n;
        if (offset >= size) {
            broker_worker_holds (w, ref->digest);
            break;
        }
    }
    free (buf);
    close (fd);
}
