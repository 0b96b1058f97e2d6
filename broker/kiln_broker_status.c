/*
 * kiln_broker_status — what the broker tells about itself: PONG (counts)
 * for a PING, for a STATUS its whole state as JSON (the fields are in
 * docs/operations.md, "kiln status"), and for a KEY the public half of
 * the farm's signing key (kiln trust).  Nothing here changes a job, a
 * worker or a client.
 */
#include "broker/kiln_broker_priv.h"

#include <stdlib.h>
#include <string.h>

#include <czmq.h>
#include <jansson.h>

/* PING: PONG with the number of workers, free slots, queued and running
 * jobs. */
void
broker_on_ping (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    zframe_t *rid = from->rid;
    kiln_msg_t *pong = kiln_msg_new (KILN_CMD_PONG);
    if (!pong)
        return;
    pong->req_id = msg->req_id;
    uint64_t idle = 0;
    for (broker_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers))
        idle += (uint64_t) (w->slots - w->busy);
    pong->workers = zhashx_size (self->workers);
    pong->idle_slots = idle;
    pong->queued = kiln_sched_size (self->sched);
    pong->running = zhashx_size (self->jobs) - kiln_sched_size (self->sched);
    if (kiln_msg_set_str (&pong->broker, self->name) != 0) {
        kiln_msg_destroy (&pong);
        return;
    }
    broker_post (self, rid, &pong);
}

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
    for (broker_worker_t *w = zhashx_first (self->workers); workers && w;
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
        const char *why = zhashx_lookup (self->quarantine, w->name);
        json_t *wj = json_array_get (workers, json_array_size (workers) - 1);
        json_object_set_new (wj, "quarantined", why ? json_string (why) : json_null ());
        json_object_set_new (wj, "max_memory", w->max_memory
                                               ? json_integer ((json_int_t) w->max_memory)
                                               : json_null ());
    }
    json_t *clients = json_array ();
    if (clients)
        kiln_sched_each_tenant (self->sched, s_tenant_json, clients);
    /* running jobs per tenant */
    for (broker_job_t *job = zhashx_first (self->jobs); clients && job;
         job = zhashx_next (self->jobs)) {
        if (job->state != BROKER_JOB_RUNNING)
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
    kiln_downloads_stats_t dl;
    kiln_downloads_stats (self->downloads, &dl);
    size_t queued = kiln_sched_size (self->sched);
    json_t *doc = json_pack (
        "{s:s, s:s, s:i, s:b, s:I, s:o, s:{s:I, s:I, s:o}, "
        "s:{s:I, s:I, s:f, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}, "
        "s:{s:I, s:I, s:I, s:I, s:I, s:I}, s:{s:I, s:I, s:I, s:i, s:I, s:I, s:I, s:I, s:I, s:I}}",
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
        (json_int_t) st.max_bytes, "evicted", (json_int_t) st.evicted, "pinned",
        (json_int_t) st.pinned, "pinned_bytes", (json_int_t) st.pinned_bytes,
        "jobs", "submitted", (json_int_t) self->stats.submitted, "done",
        (json_int_t) self->stats.done, "failed", (json_int_t) self->stats.failed, "canceled",
        (json_int_t) self->stats.canceled, "requeued", (json_int_t) self->stats.requeued,
        "joined", (json_int_t) self->stats.joined,
        "transfer", "uploaded_bytes", (json_int_t) self->stats.uploaded_bytes,
        "uploaded_blobs", (json_int_t) self->stats.uploaded_blobs, "uploads_in_progress",
        (json_int_t) self->uploads, "max_uploads", self->cfg.max_uploads,
        "upload_reserved_bytes", (json_int_t) st.reserved_bytes, "fetched_bytes", (json_int_t) self->stats.fetched_bytes,
        "downloads_in_progress", (json_int_t) dl.in_progress, "downloaded_artifacts",
        (json_int_t) dl.served, "downloaded_bytes", (json_int_t) dl.bytes,
        "held_bytes", (json_int_t) dl.held_bytes);
    if (doc) {
        /* The cross-check (docs/operations.md): its policy, its counts, and
         * every worker quarantined in this broker's life, connected or not. */
        char policy[32];
        json_t *quarantined = json_object ();
        for (const char *why = zhashx_first (self->quarantine); quarantined && why;
             why = zhashx_next (self->quarantine))
            json_object_set_new (quarantined, zhashx_cursor (self->quarantine),
                                 json_string (why));
        json_object_set_new (doc, "cross_check",
                             json_pack ("{s:s, s:I, s:I, s:I, s:I, s:o}", "policy",
                                        broker_xcheck_policy (self, policy, sizeof policy),
                                        "checked", (json_int_t) self->stats.checked, "agreed",
                                        (json_int_t) self->stats.agreed, "disagreed",
                                        (json_int_t) self->stats.disagreed, "unchecked",
                                        (json_int_t) self->stats.unchecked, "quarantined",
                                        quarantined ? quarantined : json_object ()));
    }
    char *text = doc ? json_dumps (doc, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    json_decref (doc);
    return text;
}

/* STATUS: REPORT with the broker's state as JSON, or ELIMIT when it is too
 * big for one message. */
void
broker_on_status (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    zframe_t *rid = from->rid;
    char *text = s_status_json (self);
    if (!text || strlen (text) > KILN_PROTO_MAX_REPORT) {
        free (text);
        broker_post_error (self, rid, msg->req_id, 0, KILN_ELIMIT, "the status report is too big",
                           NULL);
        return;
    }
    kiln_msg_t *report = kiln_msg_new (KILN_CMD_REPORT);
    if (report) {
        report->req_id = msg->req_id;
        report->report = text;
        text = NULL;
        broker_post (self, rid, &report);
    }
    free (text);
}

/* KEY: PUBKEY with the farm's public signing key as PEM, its id, and our
 * CurveZMQ public key when we have one.  Public material only: the
 * client decides whether to trust it (kiln trust shows the fingerprint). */
void
broker_on_key (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    kiln_err_t err = { 0 };
    char *pem = NULL;
    if (kiln_key_public_pem (self->key, &pem, &err) != 0) {
        broker_post_error (self, from->rid, msg->req_id, 0, err.code, err.msg, NULL);
        return;
    }
    kiln_msg_t *reply = kiln_msg_new (KILN_CMD_PUBKEY);
    if (!reply || kiln_msg_set_str (&reply->key_id, kiln_key_id (self->key)) != 0
        || (self->curve_public[0]
            && kiln_msg_set_str (&reply->curve_public, self->curve_public) != 0)) {
        kiln_msg_destroy (&reply);
        free (pem);
        return;
    }
    reply->req_id = msg->req_id;
    reply->public_key = pem;
    broker_post (self, from->rid, &reply);
}
