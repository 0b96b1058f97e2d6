/*
 * kiln_broker_admit — admission of a COMPILE: the broker decodes the graph
 * structure, checks the blob list against its weights, recomputes the
 * graph digest and action key rather than trusting the client's, stages
 * inline blobs, and then answers from the action cache (or the artifact
 * built and not yet committed), from the failure cache, joins the job
 * already building the action, asks for the blobs it lacks (MISSING), or
 * queues a new job.  CANCEL takes a request back.
 *
 * Invariant: a request either gets exactly one reply now (RESULT, ERROR,
 * MISSING) or becomes a waiter of exactly one job, acknowledged by
 * ACCEPTED.
 */
#include "broker/kiln_broker_priv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <czmq.h>

#include "common/kiln_log.h"
#include "graph/kiln_graph.h"

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
    broker_pending_t *pending = zhashx_lookup (self->pending, action_key);
    if (pending) {
        self->stats.hits++;
        broker_post_result (self, rid, req_id, pending->artifact, action_key, graph_digest, true,
                            NULL, pending->bytes, pending->len);
        return true;
    }
    int rc = kiln_store_lookup (self->store, action_key, artifact, &data, &len, &err);
    if (rc == -KILN_ENOTFOUND)
        return false;
    if (rc != 0) {
        kiln_log_warn ("action %.*s: cache entry unusable, building again: %s", BROKER_KEY_SHORT,
                       action_key, err.msg);
        return false;
    }
    self->stats.hits++;
    kiln_log_info ("action %.*s: served from the action cache (artifact %.*s)", BROKER_KEY_SHORT,
                   action_key, BROKER_KEY_SHORT, artifact);
    broker_post_result (self, rid, req_id, artifact, action_key, graph_digest, true, NULL, data,
                        len);
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
                       BROKER_KEY_SHORT, action_key, err.msg);
        kiln_store_forget_failure (self->store, action_key);
        return false;
    }
    self->stats.failure_hits++;
    kiln_log_info ("action %.*s: served a cached failure", BROKER_KEY_SHORT, action_key);
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_ERROR);
    char text[KILN_ERR_MSG_MAX];
    broker_fmt (text, sizeof text, "%s (a cached failure: this action failed before; "
                "--retry-failed builds it again)", message);
    if (msg) {
        msg->req_id = req_id;
        msg->cached = true;
        if (kiln_msg_set_error (msg, code, text, log) == 0)
            broker_post (self, rid, &msg);
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
s_check_compile (kiln_broker_t *self, kiln_msg_t *msg, broker_job_t *job, kiln_err_t *err)
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
s_missing (kiln_broker_t *self, const kiln_msg_t *request, const broker_job_t *job)
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

void
broker_on_compile (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    zframe_t *rid = from->rid;
    broker_client_t *c = from->client;
    kiln_err_t err = { 0 };
    if (zhashx_size (self->jobs) >= BROKER_MAX_JOBS
        || self->queued_bytes + msg->struct_size > self->cfg.max_queued_bytes) {
        kiln_error (&err, KILN_ELIMIT, "the broker is full (%zu jobs, %llu bytes of graphs "
                    "held); try again later", zhashx_size (self->jobs),
                    (unsigned long long) self->queued_bytes);
        goto refuse;
    }
    broker_job_t *job = calloc (1, sizeof *job);
    if (!job || !(job->args = malloc (KILN_MAX_ARGS_BYTES))) {
        free (job);
        kiln_error (&err, KILN_ENOMEM, "out of memory");
        goto refuse;
    }
    if (s_check_compile (self, msg, job, &err) != 0) {
        broker_job_destroy (&job);
        goto refuse;
    }
    if (s_serve_cached (self, rid, msg->req_id, job->action_key, job->graph_digest)
        || (!msg->retry_failed && s_serve_failure (self, rid, msg->req_id, job->action_key))) {
        broker_job_destroy (&job);
        return;
    }
    if (msg->retry_failed)
        kiln_store_forget_failure (self->store, job->action_key);
    uint64_t timeout = msg->timeout_ms ? msg->timeout_ms : self->cfg.default_timeout_ms;
    broker_job_t *running = zhashx_lookup (self->jobs, job->action_key);
    if (running) {
        broker_job_destroy (&job);
        /* The same request again (a resubmission after a lost reply): it
         * already waits. */
        bool again = false;
        for (size_t i = 0; i < running->n_waiters && !again; i++)
            again = running->waiters[i].client == c && running->waiters[i].req_id == msg->req_id;
        if (!again) {
            if (running->n_waiters >= BROKER_MAX_WAITERS) {
                kiln_error (&err, KILN_ELIMIT, "%d clients already wait for this action",
                            BROKER_MAX_WAITERS);
                goto refuse;
            }
            broker_waiter_t *waiters = realloc (running->waiters,
                                                (running->n_waiters + 1) * sizeof *waiters);
            if (!waiters) {
                kiln_error (&err, KILN_ENOMEM, "out of memory");
                goto refuse;
            }
            running->waiters = waiters;
            waiters[running->n_waiters++] = (broker_waiter_t) { c, msg->req_id };
            c->pending++;
            self->stats.joined++;
            if (timeout > running->timeout_ms)
                running->timeout_ms = timeout;
            if (msg->priority < running->priority && running->item) {
                running->priority = (int) msg->priority;
                kiln_sched_set_priority (self->sched, running->item, running->priority);
            }
            kiln_log_info ("job %llu action %.*s: one more client waits (%zu, job %s)",
                           (unsigned long long) running->id, BROKER_KEY_SHORT,
                           running->action_key, running->n_waiters,
                           broker_job_state_name (running->state));
        }
        kiln_msg_t *ack = kiln_msg_new (KILN_CMD_ACCEPTED);
        if (ack) {
            ack->req_id = msg->req_id;
            ack->job_id = running->id;
            broker_post (self, rid, &ack);
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
        broker_post (self, rid, &missing);
        broker_job_destroy (&job);
        return;
    }
    if (!broker_worker_offers_any (self, &job->toolchain) && zhashx_size (self->workers) > 0) {
        char tc[KILN_PROTO_MAX_TOOLCHAIN + 1];
        kiln_log_notice ("job for action %.*s waits for a worker with %s: none is registered",
                         BROKER_KEY_SHORT, job->action_key,
                         kiln_toolchain_format (&job->toolchain, tc, sizeof tc));
    }
    job->waiters = calloc (1, sizeof *job->waiters);
    if (!job->waiters) {
        broker_job_destroy (&job);
        kiln_error (&err, KILN_ENOMEM, "out of memory");
        goto refuse;
    }
    job->waiters[0] = (broker_waiter_t) { c, msg->req_id };
    job->n_waiters = 1;
    job->id = ++self->next_job_id;
    snprintf (job->id_key, sizeof job->id_key, "%llu", (unsigned long long) job->id);
    snprintf (job->tenant, sizeof job->tenant, "%s", c->tenant);
    job->priority = (int) msg->priority;
    job->timeout_ms = timeout;
    job->queued_at = zclock_mono ();
    if (broker_job_enqueue (self, job, false) != 0) {
        broker_job_destroy (&job);
        kiln_error (&err, KILN_ENOMEM, "out of memory");
        goto refuse;
    }
    c->pending++;
    for (uint32_t i = 0; i < job->n_blobs; i++) {
        if (!kiln_store_has_blob (self->store, job->blobs[i].digest))
            job->ticket = BROKER_THIS_BATCH;        /* staged now, or in a batch on its way */
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
                     "%s, args '%s', priority %d)", (unsigned long long) job->id, BROKER_KEY_SHORT,
                     job->action_key, job->tenant, BROKER_KEY_SHORT, job->graph_digest,
                     job->struct_len, job->n_blobs, job->n_blobs == 1 ? "" : "s",
                     kiln_toolchain_format (&job->toolchain, tc, sizeof tc), job->args,
                     job->priority);
    kiln_msg_t *ack = kiln_msg_new (KILN_CMD_ACCEPTED);
    if (ack) {
        ack->req_id = msg->req_id;
        ack->job_id = job->id;
        broker_post (self, rid, &ack);
    }
    return;
refuse:
    kiln_log_warn ("COMPILE %llu from %s refused: %s", (unsigned long long) msg->req_id,
                   c->tenant, err.msg);
    broker_post_error (self, rid, msg->req_id, 0, err.code, err.msg, NULL);
}

/* CANCEL: the client takes a request back (a GET, or its wait for a job;
 * a job nobody waits for any more is canceled). */
void
broker_on_cancel (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    broker_client_t *c = from->client;
    if (kiln_downloads_cancel (self->downloads, c->key, msg->req_id))
        return;
    for (broker_job_t *job = zhashx_first (self->jobs); job; job = zhashx_next (self->jobs)) {
        for (size_t i = 0; i < job->n_waiters; i++)
            if (job->waiters[i].client == c && job->waiters[i].req_id == msg->req_id) {
                kiln_log_info ("client %s canceled request %llu (job %llu)", c->tenant,
                               (unsigned long long) msg->req_id, (unsigned long long) job->id);
                broker_job_drop_waiter (self, job, c, msg->req_id, false, "its client canceled");
                return;      /* the hash may have changed: stop iterating */
            }
    }
}
