/*
 * kiln_broker — the broker's event loop: it owns the socket, reads
 * messages in batches, routes each through the command table to its
 * handler (the other kiln_broker_*.c files; kiln_broker_priv.h lists
 * them), holds the replies until the store's commit, and keeps peers
 * alive with heartbeats.  kiln_broker_new, kiln_broker_destroy and
 * kiln_broker_run are here.
 *
 * The loop reads a batch of messages (at most BROKER_BATCH) and hands what
 * they staged in the store to its syncer thread as one commit; the
 * replies of the batch wait in the "outbox" until that commit is on disk
 * (the syncer signals an eventfd the loop watches), and go out in order.
 * So a client never hears of an artifact, a failure record or a blob
 * before it is on disk, the cost of fsync is shared by the whole batch,
 * and the loop keeps serving while the disk works.
 */
#include "broker/kiln_broker_priv.h"

#include <sys/eventfd.h>

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <czmq.h>
#include <openssl/rand.h>

#include "common/kiln_fs.h"
#include "common/kiln_log.h"

/* snprintf that cuts long messages quietly: error messages quote other
 * messages, and a cut one is better than none. */
void
broker_fmt (char *buf, size_t size, const char *fmt, ...)
{
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (buf, size, fmt, ap);
    va_end (ap);
}

/* --- lifetimes of the loop's records ---------------------------------------- */

static void
s_pending_destroy (broker_pending_t **self_p)
{
    if (!*self_p)
        return;
    free ((*self_p)->bytes);
    free (*self_p);
    *self_p = NULL;
}

static void
s_outgoing_destroy (broker_outgoing_t **self_p)
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
int
broker_send_now (kiln_broker_t *self, zframe_t *rid, kiln_msg_t **msg, const char *to)
{
    kiln_err_t err = { 0 };
    int rc = kiln_msg_send (msg, self->router, rid, &err);
    if (rc != 0)
        kiln_log_warn ("could not send to %s: %s", to, err.msg);
    return rc;
}

/* Queue `msg` for `rid` until the batch's commit.  Consumes *msg. */
void
broker_post (kiln_broker_t *self, zframe_t *rid, kiln_msg_t **msg)
{
    broker_outgoing_t *out = calloc (1, sizeof *out);
    if (!out || !(out->rid = zframe_dup (rid))) {
        free (out);
        kiln_msg_destroy (msg);
        kiln_log_err ("out of memory queueing a reply");
        return;
    }
    out->msg = *msg;
    out->msg->epoch = self->epoch;      /* sent only with the commands that carry it */
    out->ticket = BROKER_THIS_BATCH;
    *msg = NULL;
    zlistx_add_end (self->outbox, out);
}

void
broker_post_error (kiln_broker_t *self, zframe_t *rid, uint64_t req_id, uint64_t job_id,
                   int code, const char *message, const char *log)
{
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_ERROR);
    if (!msg)
        return;
    msg->req_id = req_id;
    msg->job_id = job_id;
    /* a message that would not fit is cut, never dropped */
    char text[KILN_ERR_MSG_MAX];
    broker_fmt (text, sizeof text, "%s", message ? message : kiln_strerror (code));
    const char *cut_log = log && strlen (log) <= KILN_MAX_LOG_BYTES ? log : NULL;
    if (kiln_msg_set_error (msg, code, text, cut_log) != 0) {
        kiln_msg_destroy (&msg);
        return;
    }
    broker_post (self, rid, &msg);
}

void
broker_post_result (kiln_broker_t *self, zframe_t *rid, uint64_t req_id, const char *artifact,
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
    if (!data)
        msg->artifact_apart = len;    /* large: the client GETs it by its content hash */
    if (kiln_msg_set_str (&msg->worker, worker) != 0
        || (data && kiln_msg_put_artifact (msg, data, len, &err) != 0)) {
        kiln_msg_destroy (&msg);
        kiln_log_err ("action %.*s: cannot send the artifact: %s", BROKER_KEY_SHORT, action_key,
                      err.msg);
        broker_post_error (self, rid, req_id, 0, err.code ? err.code : KILN_ENOMEM, err.msg, NULL);
        return;
    }
    broker_post (self, rid, &msg);
}

/* --- the command table ---------------------------------------------------- */

/* Every command the broker takes, from which kind of peer, and who handles
 * it.  common/kiln_proto.h says who may send a command at all; this table
 * says what the broker does with it.  A command a peer may send that has
 * no row here is ignored; a NULL handler takes it and does nothing (a
 * worker's HEARTBEAT: its last_seen is enough). */
typedef struct {
    kiln_cmd_t cmd;
    int from;                            /* KILN_PEER_WORKER or KILN_PEER_CLIENT */
    broker_handler_fn *handler;          /* in kiln_broker_*.c (kiln_broker_priv.h) */
} s_route_t;

static const s_route_t s_routes[] = {
    /* command               from               handler */
    { KILN_CMD_READY,        KILN_PEER_WORKER,  broker_on_ready },               /* peers */
    { KILN_CMD_HEARTBEAT,    KILN_PEER_WORKER,  NULL },
    { KILN_CMD_DONE,         KILN_PEER_WORKER,  broker_on_done },                /* jobs */
    { KILN_CMD_FETCH,        KILN_PEER_WORKER,  broker_on_fetch },               /* jobs */
    { KILN_CMD_LOG,          KILN_PEER_WORKER,  broker_on_log },                 /* jobs */
    { KILN_CMD_SLICE,        KILN_PEER_WORKER,  broker_on_slice },               /* collect */
    { KILN_CMD_DISCONNECT,   KILN_PEER_WORKER,  broker_on_worker_disconnect },   /* peers */
    { KILN_CMD_COMPILE,      KILN_PEER_CLIENT,  broker_on_compile },             /* admit */
    { KILN_CMD_CANCEL,       KILN_PEER_CLIENT,  broker_on_cancel },              /* admit */
    { KILN_CMD_FIND,         KILN_PEER_CLIENT,  broker_on_find },                /* upload */
    { KILN_CMD_CHUNK,        KILN_PEER_CLIENT,  broker_on_chunk },               /* upload */
    { KILN_CMD_GET,          KILN_PEER_CLIENT,  broker_on_get },                 /* artifacts */
    { KILN_CMD_CREDIT,       KILN_PEER_CLIENT,  broker_on_client_credit },       /* artifacts */
    { KILN_CMD_PIN,          KILN_PEER_CLIENT,  broker_on_pin },                 /* artifacts */
    { KILN_CMD_UNPIN,        KILN_PEER_CLIENT,  broker_on_pin },                 /* artifacts */
    { KILN_CMD_PING,         KILN_PEER_CLIENT,  broker_on_ping },                /* status */
    { KILN_CMD_STATUS,       KILN_PEER_CLIENT,  broker_on_status },              /* status */
    { KILN_CMD_KEY,          KILN_PEER_CLIENT,  broker_on_key },                 /* status */
    { KILN_CMD_WHERE,        KILN_PEER_CLIENT,  broker_on_where },               /* progress */
    { KILN_CMD_HEARTBEAT,    KILN_PEER_CLIENT,  broker_on_client_heartbeat },    /* peers */
    { KILN_CMD_DISCONNECT,   KILN_PEER_CLIENT,  broker_on_client_disconnect },   /* peers */
};

/* Hand `msg` to the handler of its row for peers of kind `from`. */
static void
s_route (kiln_broker_t *self, const broker_from_t *sender, int from, kiln_msg_t *msg)
{
    for (size_t i = 0; i < sizeof s_routes / sizeof s_routes[0]; i++)
        if (s_routes[i].cmd == msg->cmd && s_routes[i].from == from) {
            if (s_routes[i].handler)
                s_routes[i].handler (self, sender, msg);
            return;
        }
}

/* --- the loop -------------------------------------------------------------- */

/* The peer kinds a message may come from, as this broker sees them. */
static int
s_peer_kind (kiln_broker_t *self, const kiln_peer_t *peer, broker_worker_t *w)
{
    if (!self->curve)
        return w ? KILN_PEER_WORKER : KILN_PEER_CLIENT | KILN_PEER_WORKER;
    if (strcmp (peer->role, "worker") == 0)
        return KILN_PEER_WORKER;
    return KILN_PEER_CLIENT;     /* a certificate without a role is a client's */
}

/* Check who sent `msg` and route it: a worker's traffic to the worker
 * rows of the table (READY first), a client's to the client rows. */
static void
s_handle (kiln_broker_t *self, zframe_t *rid, const char *key, const kiln_peer_t *peer,
          kiln_msg_t *msg)
{
    if (self->curve && (broker_trust_revoked (self, peer)
                        || (!zhashx_lookup (self->workers, key)
                            && !zhashx_lookup (self->clients, key)
                            && !broker_trust_admit (self, peer)))) {
        /* Cut off (kiln_broker_trust.c): its connection stays open, but
         * nothing it sends is taken any more. */
        char why[256];
        broker_trust_why (peer, why, sizeof why);
        kiln_log_info ("peer %s: %s %s refused: %s", key, peer->name, kiln_cmd_name (msg->cmd),
                       why);
        broker_post_error (self, rid, msg->req_id, msg->job_id, KILN_EVERIFY, why, NULL);
        return;
    }
    broker_worker_t *w = zhashx_lookup (self->workers, key);
    if (w)
        w->last_seen = zclock_mono ();
    int senders = kiln_cmd_senders (msg->cmd);
    int kind = s_peer_kind (self, peer, w);
    if (!(kiln_cmd_receivers (msg->cmd) & KILN_PEER_BROKER) || !(senders & kind)) {
        char text[160];
        broker_fmt (text, sizeof text, "%s is not a command the broker takes from a %s",
                    kiln_cmd_name (msg->cmd), kind == KILN_PEER_WORKER ? "worker" : "client");
        kiln_log_warn ("peer %s%s%s: %s", key, peer->name[0] ? " " : "", peer->name, text);
        broker_post_error (self, rid, msg->req_id, 0, KILN_EPROTO, text, NULL);
        return;
    }
    if (msg->cmd == KILN_CMD_ERROR) {
        kiln_log_warn ("%s %s sent ERROR %s: %s", w ? "worker" : "peer", w ? w->name : key,
                       kiln_errname ((int) msg->code), msg->message);
        return;
    }
    broker_from_t from = { rid, key, peer, w, NULL };
    /* Worker traffic. */
    bool from_worker = w || msg->cmd == KILN_CMD_READY
                       || (senders & KILN_PEER_WORKER && !(senders & KILN_PEER_CLIENT))
                       || (msg->cmd == KILN_CMD_HEARTBEAT && msg->name);
    if (from_worker && (kind & KILN_PEER_WORKER)) {
        if (!w && msg->cmd != KILN_CMD_READY) {
            if (msg->cmd != KILN_CMD_DISCONNECT) {
                kiln_log_info ("peer %s sent %s before READY", key, kiln_cmd_name (msg->cmd));
                broker_post_error (self, rid, 0, msg->job_id, KILN_ENOTFOUND,
                                   "unknown worker: send READY first", NULL);
            }
            return;
        }
        s_route (self, &from, KILN_PEER_WORKER, msg);
        return;
    }
    /* Client traffic. */
    from.client = broker_client_get (self, rid, key, peer,
                                     msg->cmd == KILN_CMD_COMPILE ? msg->client : NULL);
    if (!from.client) {
        broker_post_error (self, rid, msg->req_id, 0, KILN_ELIMIT, "the broker has all the "
                           "clients it can take", NULL);
        return;
    }
    s_route (self, &from, KILN_PEER_CLIENT, msg);
}

/* Commit what the batch staged, send the replies that waited for it,
 * and dispatch. */
/* Send the replies whose store commit is durable, in order: a reply
 * waits for its own batch's commit, and for every earlier one. */
static void
s_flush_outbox (kiln_broker_t *self)
{
    uint64_t durable = kiln_store_durable (self->store);
    broker_outgoing_t *o;
    while ((o = zlistx_first (self->outbox)) && o->ticket <= durable) {
        o = zlistx_detach (self->outbox, NULL);
        if (o->msg && broker_send_now (self, o->rid, &o->msg, "client") == -KILN_ENOTFOUND) {
            char *key = zframe_strhex (o->rid);
            broker_client_t *c = key ? zhashx_lookup (self->clients, key) : NULL;
            if (c)
                broker_client_drop (self, c, "its connection is closed");
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
    for (broker_outgoing_t *o = zlistx_last (self->outbox); o && o->ticket == BROKER_THIS_BATCH;
         o = zlistx_prev (self->outbox))
        o->ticket = ticket;
    for (broker_pending_t *p = zhashx_first (self->pending); p; p = zhashx_next (self->pending))
        if (p->ticket == BROKER_THIS_BATCH)
            p->ticket = ticket;
    for (broker_job_t *job = zlistx_first (self->fresh); job; job = zlistx_next (self->fresh))
        job->ticket = ticket;
    zlistx_purge (self->fresh);
    s_flush_outbox (self);
    broker_dispatch (self);
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
    for (broker_pending_t *p = zhashx_first (self->pending); done && p;
         p = zhashx_next (self->pending))
        if (p->ticket <= durable)
            zlistx_add_end (done, p->action_key);
    for (const char *key = done ? zlistx_first (done) : NULL; key; key = zlistx_next (done))
        zhashx_delete (self->pending, key);
    zlistx_destroy (&done);
    s_flush_outbox (self);
    broker_dispatch (self);
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
            broker_post_error (self, rid, req_id, 0, err.code, err.msg, NULL);
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
    for (int i = 0; i < BROKER_BATCH; i++) {
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
    for (broker_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers)) {
        if (now - w->last_seen > self->cfg.liveness_ms) {
            zlistx_add_end (gone, w);
            continue;
        }
        kiln_msg_t *hb = kiln_msg_new (KILN_CMD_HEARTBEAT);
        if (hb && broker_send_now (self, w->rid, &hb, w->name) == -KILN_ENOTFOUND)
            zlistx_add_end (gone, w);
    }
    for (broker_worker_t *w = zlistx_first (gone); w; w = zlistx_next (gone)) {
        char reason[64];
        if (now - w->last_seen > self->cfg.liveness_ms)
            broker_fmt (reason, sizeof reason, "silent for %lld ms",
                        (long long) (now - w->last_seen));
        else
            broker_fmt (reason, sizeof reason, "its connection is closed");
        broker_worker_drop (self, w, reason, true);
    }
    zlistx_purge (gone);
    for (broker_client_t *c = zhashx_first (self->clients); c; c = zhashx_next (self->clients))
        if (now - c->last_seen > self->cfg.liveness_ms)
            zlistx_add_end (gone, c);
    for (broker_client_t *c = zlistx_first (gone); c; c = zlistx_next (gone)) {
        char reason[64];
        broker_fmt (reason, sizeof reason, "silent for %lld ms", (long long) (now - c->last_seen));
        broker_client_drop (self, c, reason);
    }
    zlistx_purge (gone);
    for (broker_client_t *c = zhashx_first (self->clients); c; c = zhashx_next (self->clients)) {
        for (broker_upload_t *up = zhashx_first (c->uploads); up; up = zhashx_next (c->uploads))
            if (!up->closed && now - up->last_chunk > BROKER_UPLOAD_IDLE_MS)
                zlistx_add_end (gone, up);
        for (broker_upload_t *up = zlistx_first (gone); up; up = zlistx_next (gone)) {
            kiln_log_warn ("client %s: upload of blob %.*s idle; dropped", c->tenant,
                           BROKER_KEY_SHORT, up->hex);
            zhashx_delete (c->uploads, up->hex);
            self->uploads--;
        }
        zlistx_purge (gone);
    }
    kiln_downloads_expire (self->downloads, now);
    broker_trust_check (self);
    for (broker_job_t *job = zhashx_first (self->jobs); job; job = zhashx_next (self->jobs))
        if (job->state == BROKER_JOB_RUNNING
            && now - job->started
                   > (int64_t) job->timeout_ms + self->cfg.liveness_ms + BROKER_GRACE_MS)
            zlistx_add_end (gone, job);
    for (broker_job_t *job = zlistx_first (gone); job; job = zlistx_next (gone)) {
        char message[256];
        broker_fmt (message, sizeof message, "worker %s did not finish within the %llu ms timeout",
                    job->worker ? job->worker->name : "?", (unsigned long long) job->timeout_ms);
        if (job->worker) {
            kiln_msg_t *cancel = kiln_msg_new (KILN_CMD_CANCEL);
            if (cancel) {
                cancel->job_id = job->id;
                broker_send_now (self, job->worker->rid, &cancel, job->worker->name);
            }
        }
        char *log = broker_job_report_log (job, NULL);
        broker_job_fail (self, job, KILN_ETIMEOUT, message, log, false);
        free (log);
    }
    zlistx_destroy (&gone);
    broker_xcheck_sweep (self);
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
    if (broker_trust_start (self, cfg->trust_dir, err) != 0) {
        zcert_destroy (&cert);
        return -err->code;
    }
    /* The certificate names the broker (as it names workers and clients),
     * unless --name says otherwise. */
    const char *cert_name = zcert_meta (cert, "name");
    if (!cfg->name && cert_name && kiln_proto_name_ok (cert_name))
        snprintf (self->name, sizeof self->name, "%s", cert_name);
    snprintf (self->curve_public, sizeof self->curve_public, "%s", zcert_public_txt (cert));
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
    if (self->cfg.max_uploads <= 0)
        self->cfg.max_uploads = 16;
    if (self->cfg.max_uploads > KILN_BROKER_MAX_UPLOADS)
        self->cfg.max_uploads = KILN_BROKER_MAX_UPLOADS;
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
    self->signing = zlistx_new ();
    self->sign_efd = eventfd (0, EFD_NONBLOCK | EFD_CLOEXEC);
    self->loop = zloop_new ();
    if (!self->sched || !self->workers || !self->clients || !self->jobs || !self->jobs_by_id
        || !self->outbox || !self->pending || !self->fresh || !self->signing
        || self->sign_efd < 0 || !self->loop || broker_xcheck_init (self) != 0) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    zhashx_set_destructor (self->workers, (zhashx_destructor_fn *) broker_worker_destroy);
    zhashx_set_destructor (self->clients, (zhashx_destructor_fn *) broker_client_destroy);
    zhashx_set_destructor (self->jobs, (zhashx_destructor_fn *) broker_job_destroy);
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
    if (!(self->downloads = kiln_downloads_new (self->store, self->router,
                                                self->cfg.credit_window, err)))
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
    if (cfg->metrics_listen) {
        if (!(self->metrics = broker_metrics_new (cfg->metrics_listen, err))
            || zloop_timer (self->loop, BROKER_METRICS_MS, 0, broker_metrics_on_timer,
                            self) < 0) {
            if (self->metrics)
                kiln_error (err, KILN_ESYS, "could not set up the event loop");
            goto fail;
        }
    }
    zmq_pollitem_t commit = { NULL, kiln_store_commit_fd (self->store), ZMQ_POLLIN, 0 };
    zmq_pollitem_t uploads = { NULL, kiln_store_upload_fd (self->store), ZMQ_POLLIN, 0 };
    zmq_pollitem_t downloads = { NULL, kiln_downloads_fd (self->downloads), ZMQ_POLLIN, 0 };
    zmq_pollitem_t signed_ = { NULL, self->sign_efd, ZMQ_POLLIN, 0 };
    if (zloop_poller (self->loop, &commit, s_on_commit, self) != 0
        || zloop_poller (self->loop, &uploads, broker_on_uploads, self) != 0
        || zloop_poller (self->loop, &downloads, broker_on_downloads, self) != 0
        || zloop_poller (self->loop, &signed_, broker_on_signed, self) != 0) {
        kiln_error (err, KILN_ESYS, "could not set up the event loop");
        goto fail;
    }
    if (self->monitor
        && zloop_reader (self->loop, zactor_sock (self->monitor), s_on_monitor, self) != 0) {
        kiln_error (err, KILN_ESYS, "could not set up the event loop");
        goto fail;
    }
    self->started = zclock_mono ();
    self->history = broker_history_new ();
    broker_metrics_render (self);
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
    broker_metrics_destroy (&self->metrics);    /* its threads read nothing of ours */
    broker_history_destroy (&self->history);
    zactor_destroy (&self->monitor);
    zsock_destroy (&self->router);
    /* after the socket: it waits for ZeroMQ to let go of its chunks */
    kiln_downloads_destroy (&self->downloads);
    zactor_destroy (&self->auth);
    broker_trust_stop (self);
    zlistx_destroy (&self->outbox);
    zlistx_destroy (&self->fresh);
    zhashx_destroy (&self->pending);
    /* jobs unpin their blobs through the store, so they go first */
    if (self->jobs && self->store)
        for (broker_job_t *job = zhashx_first (self->jobs); job; job = zhashx_next (self->jobs)) {
            if (job->item)
                kiln_sched_remove (self->sched, &job->item);
            broker_job_unpin (self, job);
        }
    zhashx_destroy (&self->jobs_by_id);
    zhashx_destroy (&self->jobs);
    /* after the jobs, which let go of what their threads sign */
    broker_collect_shutdown (self);
    zlistx_destroy (&self->signing);
    if (self->sign_efd > 0)
        close (self->sign_efd);
    zhashx_destroy (&self->clients);
    zhashx_destroy (&self->workers);
    broker_xcheck_release (self);
    kiln_sched_destroy (&self->sched);
    kiln_store_destroy (&self->store);
    kiln_key_destroy (&self->key);
    free (self->endpoint);
    free (self);
    *self_p = NULL;
}

int
kiln_broker_metrics_port (const kiln_broker_t *self)
{
    return broker_metrics_port (self->metrics);
}

int
kiln_broker_run (kiln_broker_t *self)
{
    kiln_log_notice ("listening on %s as %s%s, signing with key %s (fingerprint SHA256:%s)",
                     self->endpoint, self->name, self->curve ? " (CurveZMQ)" : "",
                     kiln_key_id (self->key), kiln_key_fingerprint (self->key));
    zloop_start (self->loop);
    size_t waiting = zhashx_size (self->jobs);
    kiln_log_notice ("stopping (%zu job%s not finished)", waiting, waiting == 1 ? "" : "s");
    return 0;
}
