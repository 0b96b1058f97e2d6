/*
 * kiln_broker_peers — the broker's workers and clients: a worker's
 * registration (READY), what it holds and its departure; a client's record
 * (its identity for fair share, created on first contact) and its
 * departure, which releases its requests and uploads.
 *
 * Invariants: one record per routing id; a worker's name is registered at
 * most once (a READY under a new connection with a registered name is
 * refused, EBUSY, while the first's connection is open, and replaces it
 * once that is closed); a
 * dropped worker's jobs go back to the queue, a dropped client's requests
 * are released (broker_job_drop_waiter) before its record goes.
 */
#include "broker/kiln_broker_priv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <czmq.h>

#include "common/kiln_log.h"

/* --- lifetimes ------------------------------------------------------------ */

void
broker_worker_destroy (broker_worker_t **self_p)
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

void
broker_client_destroy (broker_client_t **self_p)
{
    if (!*self_p)
        return;
    free ((*self_p)->key);
    zframe_destroy (&(*self_p)->rid);
    zhashx_destroy (&(*self_p)->uploads);
    zhashx_destroy (&(*self_p)->refused);
    free (*self_p);
    *self_p = NULL;
}

/* --- workers --------------------------------------------------------------- */

/* Requeue every job `w` holds; `dead` counts it against each job. */
static void
s_worker_release_jobs (kiln_broker_t *self, broker_worker_t *w, const char *reason, bool dead)
{
    zlistx_t *held = zlistx_new ();
    if (!held)
        return;
    for (broker_job_t *job = zhashx_first (self->jobs); job; job = zhashx_next (self->jobs))
        if (job->worker == w)
            zlistx_add_end (held, job);
    for (broker_job_t *job = zlistx_first (held); job; job = zlistx_next (held))
        broker_job_requeue (self, job, reason, dead);
    zlistx_destroy (&held);
}

void
broker_worker_drop (kiln_broker_t *self, broker_worker_t *w, const char *why, bool dead)
{
    kiln_log_warn ("worker %s dropped: %s", w->name, why);
    char reason[256];
    broker_fmt (reason, sizeof reason, "worker %s lost: %s", w->name, why);
    s_worker_release_jobs (self, w, reason, dead);
    zhashx_delete (self->workers, w->key);
}

/* Remember that `w` holds a blob (for affinity), within a bound. */
void
broker_worker_holds (broker_worker_t *w, const uint8_t digest[KILN_DIGEST_LEN])
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    if (zhashx_size (w->blobs) >= BROKER_MAX_WORKER_BLOBS)
        zhashx_purge (w->blobs);
    zhashx_update (w->blobs, hex, w);
}

/* The registered worker named `name`, or NULL. */
static broker_worker_t *
s_worker_named (kiln_broker_t *self, const char *name)
{
    for (broker_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers))
        if (strcmp (w->name, name) == 0)
            return w;
    return NULL;
}

/* True when `w`'s connection is closed: ZeroMQ has dropped its routing id
 * (the router is ROUTER_MANDATORY), which it does as soon as the peer's
 * socket closes, well before the worker's liveness runs out.  The probe
 * is a HEARTBEAT, which a live worker takes as any other. */
static bool
s_worker_gone (kiln_broker_t *self, broker_worker_t *w)
{
    kiln_msg_t *hb = kiln_msg_new (KILN_CMD_HEARTBEAT);
    return hb && broker_send_now (self, w->rid, &hb, w->name) == -KILN_ENOTFOUND;
}

void
broker_on_ready (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    zframe_t *rid = from->rid;
    const char *key = from->key;
    broker_worker_t *w = from->worker;
    const kiln_peer_t *peer = from->peer;
    char text[512];
    const char *name = self->curve ? peer->name : msg->name;
    if (!kiln_proto_name_ok (name) || msg->slots < 1 || msg->n_toolchains < 1) {
        broker_fmt (text, sizeof text, "READY refused: the name ('%s') must be 1..%d characters of "
                    "[A-Za-z0-9._:@-], slots at least 1 and at least one toolchain", name,
                    KILN_PROTO_MAX_NAME);
        kiln_log_warn ("peer %s: %s", key, text);
        broker_post_error (self, rid, 0, 0, KILN_EPROTO, text, NULL);
        return;
    }
    kiln_toolchain_id_t *tcs = calloc (msg->n_toolchains, sizeof *tcs);
    if (!tcs)
        return;
    for (uint32_t i = 0; i < msg->n_toolchains; i++) {
        kiln_err_t err = { 0 };
        if (kiln_toolchain_parse (msg->toolchains[i], &tcs[i], &err) != 0) {
            kiln_log_warn ("worker %s: READY refused: %s", name, err.msg);
            broker_post_error (self, rid, 0, 0, KILN_EPROTO, err.msg, NULL);
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
        broker_worker_t *old = s_worker_named (self, name);
        if (old && !s_worker_gone (self, old)) {
            /* Two live workers under one name would take each other's
             * place at every heartbeat, and their jobs would fail as
             * deaths: the first keeps it, the second is told why and
             * tries again later (kiln_worker.c), which is also how a
             * restarted worker gets back in once the broker has found
             * its predecessor silent. */
            broker_fmt (text, sizeof text, "worker name '%s' is taken by a live worker "
                        "(registered %lld s ago, heard from %lld ms ago): give each worker "
                        "its own --name (or certificate); this one is refused until that "
                        "worker leaves", name,
                        (long long) ((zclock_mono () - old->since) / 1000),
                        (long long) (zclock_mono () - old->last_seen));
            kiln_log_warn ("peer %s: READY refused: %s", key, text);
            broker_post_error (self, rid, 0, 0, KILN_EBUSY, text, NULL);
            free (tcs);
            return;
        }
        /* The same worker under a new connection, the old one closed (a
         * worker process killed and started again, or reconnecting). */
        if (old)
            broker_worker_drop (self, old, "its connection closed and it registered again "
                                "from a new one", true);
        if (zhashx_size (self->workers) >= BROKER_MAX_WORKERS) {
            kiln_log_warn ("worker %s refused: %d workers already registered", name,
                           BROKER_MAX_WORKERS);
            broker_post_error (self, rid, 0, 0, KILN_ELIMIT, "the broker has all the workers it "
                               "can take", NULL);
            free (tcs);
            return;
        }
        w = calloc (1, sizeof *w);
        if (!w || !(w->key = strdup (key)) || !(w->rid = zframe_dup (rid))
            || !(w->blobs = zhashx_new ())) {
            broker_worker_destroy (&w);
            free (tcs);
            kiln_log_err ("out of memory registering worker %s", name);
            return;
        }
        zhashx_insert (self->workers, key, w);
    }
    snprintf (w->name, sizeof w->name, "%s", name);
    w->authenticated = self->curve;
    snprintf (w->curve_key, sizeof w->curve_key, "%s", self->curve ? peer->key : "");
    w->toolchains = tcs;
    w->n_toolchains = msg->n_toolchains;
    w->slots = (int) msg->slots;
    w->max_memory = msg->max_memory;
    w->session = msg->session;
    w->last_seen = w->since = zclock_mono ();
    for (uint32_t i = 0; i < msg->n_blobs; i++)
        broker_worker_holds (w, msg->blobs[i].digest);
    char tc[KILN_PROTO_MAX_TOOLCHAIN + 1];
    kiln_log_notice ("worker %s ready: %d slot%s, %s%s, %u blob%s cached", w->name, w->slots,
                     w->slots == 1 ? "" : "s", kiln_toolchain_format (&tcs[0], tc, sizeof tc),
                     w->n_toolchains > 1 ? " and more" : "", msg->n_blobs,
                     msg->n_blobs == 1 ? "" : "s");
}

/* --- clients --------------------------------------------------------------- */

broker_client_t *
broker_client_get (kiln_broker_t *self, zframe_t *rid, const char *key, const kiln_peer_t *peer,
                   const char *declared)
{
    broker_client_t *c = zhashx_lookup (self->clients, key);
    if (!c) {
        if (zhashx_size (self->clients) >= BROKER_MAX_CLIENTS) {
            /* forget the longest silent client without requests */
            broker_client_t *oldest = NULL;
            for (broker_client_t *o = zhashx_first (self->clients); o;
                 o = zhashx_next (self->clients))
                if (o->pending == 0 && zhashx_size (o->uploads) == 0
                    && !kiln_downloads_has_peer (self->downloads, o->key)
                    && (!oldest || o->last_seen < oldest->last_seen))
                    oldest = o;
            if (!oldest)
                return NULL;
            broker_client_drop (self, oldest, "too many clients");
        }
        c = calloc (1, sizeof *c);
        if (!c || !(c->key = strdup (key)) || !(c->rid = zframe_dup (rid))
            || !(c->uploads = zhashx_new ()) || !(c->refused = zhashx_new ())) {
            broker_client_destroy (&c);
            return NULL;
        }
        zhashx_set_destructor (c->uploads, (zhashx_destructor_fn *) broker_upload_destroy);
        zhashx_insert (self->clients, key, c);
        if (self->curve && peer->name[0])
            snprintf (c->tenant, sizeof c->tenant, "%s", peer->name);
        else if (self->curve)
            snprintf (c->tenant, sizeof c->tenant, "key:%.20s", peer->key);
        c->authenticated = self->curve;
        snprintf (c->curve_key, sizeof c->curve_key, "%s", self->curve ? peer->key : "");
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
void
broker_client_drop (kiln_broker_t *self, broker_client_t *c, const char *why)
{
    if (c->pending || zhashx_size (c->uploads))
        kiln_log_notice ("client %s (%s) dropped: %s; releasing %llu request%s", c->tenant,
                         c->key, why, (unsigned long long) c->pending,
                         c->pending == 1 ? "" : "s");
    if (c->pending) {
        zlistx_t *held = zlistx_new ();
        for (broker_job_t *job = zhashx_first (self->jobs); held && job;
             job = zhashx_next (self->jobs))
            for (size_t i = 0; i < job->n_waiters; i++)
                if (job->waiters[i].client == c) {
                    zlistx_add_end (held, job);
                    break;
                }
        for (broker_job_t *job = held ? zlistx_first (held) : NULL; job; job = zlistx_next (held))
            broker_job_drop_waiter (self, job, c, 0, true, "its client went away");
        zlistx_destroy (&held);
    }
    self->uploads -= zhashx_size (c->uploads);
    kiln_downloads_drop_peer (self->downloads, c->key);
    /* replies still in the outbox for it go nowhere; drop them */
    for (broker_outgoing_t *o = zlistx_first (self->outbox); o; o = zlistx_next (self->outbox))
        if (zframe_eq (o->rid, c->rid))
            kiln_msg_destroy (&o->msg);
    zhashx_delete (self->clients, c->key);
}

/* DISCONNECT from a worker: it is going; its jobs go back to the queue. */
void
broker_on_worker_disconnect (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    broker_worker_drop (self, from->worker, "disconnected", false);
}

/* HEARTBEAT from a client: answered with the number of requests the
 * broker holds for it, so that it resubmits what a restart lost. */
void
broker_on_client_heartbeat (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    kiln_msg_t *hb = kiln_msg_new (KILN_CMD_HEARTBEAT);
    if (hb) {
        hb->pending = from->client->pending;
        broker_post (self, from->rid, &hb);
    }
}

/* DISCONNECT from a client. */
void
broker_on_client_disconnect (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    broker_client_drop (self, from->client, "it disconnected");
}
