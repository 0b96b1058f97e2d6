/*
 * kiln_client — the remote half of libkilnclient: compile requests,
 * uploads, heartbeats and resubmission over one DEALER socket (fetching,
 * pinning and status are in kiln_client_store.c).
 *
 * Each compilation is a request with its own id and a small state
 * machine (docs/protocol.md, "The client's requests"):
 *
 *   NEW ──COMPILE──▶ SENT ──MISSING──▶ UPLOADING ──blobs stored──▶ NEW
 *                     │  ──ACCEPTED──▶ ACCEPTED ──RESULT/ERROR──▶ DONE
 *                     └──RESULT/ERROR──────────────────────────▶ DONE
 *   broker lost, or it holds fewer requests than we think: SENT,
 *   UPLOADING, ACCEPTED ──▶ NEW (sent again, same id)
 *   RESULT with the artifact apart (a large one) ──▶ FETCH: fetched with
 *   kiln_client_get (in chunks, checked) once the others are answered
 *
 * Blobs the broker lacks are uploaded in the order asked for, two at a
 * time, each chunk costing one unit of the credit the broker grants; a
 * blob several requests need is uploaded once.  Chunks point into the
 * caller's weight buffers (no copy); before a call returns it makes sure
 * ZeroMQ holds none of them any more.
 */
#include "client/kiln_client.h"
#include "client/kiln_client_priv.h"

#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <czmq.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_fs.h"
#include "common/kiln_limits.h"
#include "common/kiln_log.h"
#include "common/kiln_map.h"
#include "common/kiln_proto.h"
#include "compiler/kiln_compiler.h"

#define S_MAX_RESENDS      50         /* sends of one request after a lost broker */
#define S_MAX_BATCH        (1u << 20) /* jobs in one call */
#define S_UPLOADS_AT_ONCE  2          /* blobs whose chunks take turns */
#define S_DRAIN_MS         5000       /* wait for ZeroMQ to let go of our buffers */
#define S_REFUSAL_MS       1000       /* wait for the monitor after a send found no pipe */
#define S_BUSY_MIN_MS      200        /* first wait before an upload refused busy goes again */
#define S_BUSY_MAX_MS      3000       /* longest such wait */

typedef enum { R_NEW, R_SENT, R_UPLOADING, R_ACCEPTED, R_FETCH, R_DONE } s_state_t;

typedef struct s_upload s_upload_t;

/* A distinct blob of a request's graph. */
typedef struct {
    uint8_t digest[KILN_DIGEST_LEN];
    uint64_t size;
    const uint8_t *data;             /* the caller's weight bytes */
    bool mapped;                     /* mapped from a file: pages given back once sent */
} s_blob_t;

typedef struct {
    kiln_client_job_t *job;
    size_t index;
    uint64_t req_id;
    s_state_t state;
    char req_key[24];                /* req_id in decimal, key in requests */
    uint8_t *structure;              /* encoded once, owned */
    size_t struct_len;
    s_blob_t *blobs;                 /* distinct, owned */
    uint32_t n_blobs;
    char args[KILN_MAX_ARGS_BYTES];  /* normalised */
    kiln_toolchain_id_t toolchain;
    int waiting;                     /* uploads it waits for */
    bool upload_only;                /* FIND, not COMPILE: done when nothing is missing */
    int resends;
    uint64_t job_id;                 /* ACCEPTED's, for WHERE; 0 = none */
} s_req_t;

struct s_upload {
    char hex[KILN_HEX_LEN];
    const uint8_t *data;             /* the caller's bytes */
    bool mapped;                     /* mapped from a file (kiln_map.h) */
    uint64_t size;
    uint64_t sent;                   /* bytes sent so far */
    bool started;                    /* its first chunk went out */
    int64_t retry_at;                /* refused busy: not sent again before this (mono) */
    int busy;                        /* times refused busy */
    zlistx_t *reqs;                  /* s_req_t waiting for it */
};


/* --- connection ---------------------------------------------------------------- */

int
kiln_client_connect (kiln_client_t *self, kiln_err_t *err)
{
    self->dealer = zsock_new (ZMQ_DEALER);
    if (!self->dealer)
        return kiln_error (err, KILN_ESYS, "could not create a ZeroMQ socket");
    kiln_proto_socket_defaults (self->dealer);
    zsock_set_sndhwm (self->dealer, 100000);
    zsock_set_rcvhwm (self->dealer, 100000);
    if (strchr (self->endpoint, '['))
        zsock_set_ipv6 (self->dealer, 1);
    if (self->cert && kiln_proto_curve_client (self->dealer, self->cert, self->broker_cert,
                                               err) != 0) {
        zsock_destroy (&self->dealer);
        return -err->code;
    }
    /* A broker that refuses our credentials (or their absence) closes the
     * connection during the handshake, and would look like silence: the
     * monitor tells us why instead. */
    self->monitor = zactor_new (zmonitor, self->dealer);
    if (self->monitor) {
        zstr_sendx (self->monitor, "LISTEN", "HANDSHAKE_FAILED_NO_DETAIL",
                    "HANDSHAKE_FAILED_PROTOCOL", "HANDSHAKE_FAILED_AUTH", NULL);
        zstr_sendx (self->monitor, "START", NULL);
        zsock_wait (self->monitor);
    }
    if (zsock_connect (self->dealer, "%s", self->endpoint) != 0) {
        zsock_destroy (&self->dealer);
        return kiln_error (err, KILN_EINVAL, "could not connect to '%s': %s", self->endpoint,
                           zmq_strerror (zmq_errno ()));
    }
    self->credit = 0;
    self->epoch = 0;
    self->refusal = (kiln_err_t) { 0 };
    return 0;
}

/* Close the socket and wait until ZeroMQ has dropped every chunk that
 * points into the caller's buffers. */
void
kiln_client_disconnect (kiln_client_t *self)
{
    zactor_destroy (&self->monitor);
    zsock_destroy (&self->dealer);
    int64_t until = zclock_mono () + S_DRAIN_MS;
    while (atomic_load (&self->in_zmq) > 0 && zclock_mono () < until)
        zclock_sleep (1);
    if (atomic_load (&self->in_zmq) > 0)
        kiln_log_err ("ZeroMQ still holds %d chunks after %d ms",
                      atomic_load (&self->in_zmq), S_DRAIN_MS);
}

/* Read one monitor event; a refused handshake fills `err` and returns
 * true. */
bool
kiln_client_refused (kiln_client_t *self, kiln_err_t *err)
{
    zmsg_t *ev = zmsg_recv (self->monitor);
    char *name = ev ? zmsg_popstr (ev) : NULL;
    char *value = ev ? zmsg_popstr (ev) : NULL;
    bool refused = false;
    if (name && strcmp (name, "HANDSHAKE_FAILED_AUTH") == 0) {
        kiln_error (err, KILN_EVERIFY, "the broker at %s refused our CurveZMQ certificate "
                    "(ZAP status %s): is it in the broker's --trust directory?", self->endpoint,
                    value ? value : "?");
        refused = true;
    }
    else if (name && strncmp (name, "HANDSHAKE_FAILED", 16) == 0) {
        kiln_error (err, KILN_EPROTO, "the handshake with the broker at %s failed (%s): %s",
                    self->endpoint, name + 17,
                    self->cert ? "is it the broker whose certificate we were given?"
                               : "it may require CurveZMQ (set KILN_CERT and KILN_BROKER_CERT)");
        refused = true;
    }
    zstr_free (&name);
    zstr_free (&value);
    zmsg_destroy (&ev);
    if (refused)
        self->refusal = *err;
    return refused;
}

int
kiln_client_writable (kiln_client_t *self, int wait_ms, kiln_err_t *err)
{
    if (self->refusal.code) {
        *err = self->refusal;
        return -err->code;
    }
    int64_t deadline = zclock_mono () + wait_ms;
    while (!(zsock_events (self->dealer) & ZMQ_POLLOUT)) {
        int64_t left = deadline - zclock_mono ();
        if (left <= 0)
            return kiln_error (err, KILN_EUNREACHABLE, "no connection to the broker at %s "
                               "within %g s", self->endpoint, wait_ms / 1000.0);
        if (zsys_interrupted)
            return kiln_error (err, KILN_ECANCELED, "interrupted");
        zmq_pollitem_t items[2] = {
            { zsock_resolve (self->dealer), 0, ZMQ_POLLOUT, 0 },
            { self->monitor ? zsock_resolve (self->monitor) : NULL, 0, ZMQ_POLLIN, 0 },
        };
        int n = zmq_poll (items, self->monitor ? 2 : 1,
                          (long) (left < KILN_CLIENT_MAX_POLL_MS ? left
                                                                 : KILN_CLIENT_MAX_POLL_MS));
        if (n > 0 && self->monitor && (items[1].revents & ZMQ_POLLIN)
            && kiln_client_refused (self, err))
            return -err->code;
    }
    return 0;
}

int
kiln_client_send (kiln_client_t *self, kiln_msg_t **msg, int wait_ms, kiln_err_t *err)
{
    if (self->refusal.code) {
        kiln_msg_destroy (msg);
        *err = self->refusal;
        return -err->code;
    }
    zsock_set_sndtimeo (self->dealer, wait_ms);
    if (kiln_msg_send (msg, self->dealer, NULL, err) == 0)
        return 0;
    /* The monitor hears of a refusal on its own thread: give it a moment
     * when the caller was willing to wait at all. */
    int64_t until = zclock_mono () + (wait_ms > 0 ? S_REFUSAL_MS : 0);
    kiln_err_t why = { 0 };
    while (self->monitor && !self->refusal.code) {
        int64_t left = until - zclock_mono ();
        zmq_pollitem_t item = { zsock_resolve (self->monitor), 0, ZMQ_POLLIN, 0 };
        int n = zmq_poll (&item, 1, (long) (left > 0 ? left : 0));
        if (n > 0 && (item.revents & ZMQ_POLLIN))
            kiln_client_refused (self, &why);
        else if (left <= 0)
            break;
    }
    if (self->refusal.code) {
        *err = self->refusal;
        return -err->code;
    }
    return kiln_error_prefix (err, "broker %s", self->endpoint);
}

/* A chunk ZeroMQ holds: which bytes, and whose. */
typedef struct {
    kiln_client_t *self;
    size_t len;
    bool staged;                     /* data is a stage buffer (s_stage_get) */
    bool mapped;                     /* data is a mapped weight's (kiln_map.h) */
} s_zc_t;

/* A 1 MiB buffer to send a chunk of a weight in memory from: one given
 * back earlier when there is one.  The kernel copies a chunk into the
 * socket far faster from the same few hot pages than from each page of a
 * large weight in turn (on the development VM, 4 times: 3.3 s of system
 * time a GiB, against 0.75 s for the copy here and the send together),
 * so such chunks are copied here first, in user space, where that copy is
 * cheap.  A mapped weight's chunks are sent from the mapping: the kernel
 * reads those pages cheaply, and a copy would only add to it.  As many
 * buffers as chunks in flight, which the broker's credit bounds. */
static void *
s_stage_get (kiln_client_t *self)
{
    void *buf = NULL;
    pthread_mutex_lock (&self->stage_mu);
    if (self->n_stage_free > 0)
        buf = self->stage_free[--self->n_stage_free];
    pthread_mutex_unlock (&self->stage_mu);
    return buf ? buf : malloc (KILN_CHUNK_BYTES);
}

static void
s_stage_put (kiln_client_t *self, void *buf)
{
    pthread_mutex_lock (&self->stage_mu);
    if (self->n_stage_free < KILN_PROTO_MAX_CREDIT) {
        self->stage_free[self->n_stage_free++] = buf;
        buf = NULL;
    }
    pthread_mutex_unlock (&self->stage_mu);
    free (buf);
}

/* Free the stage buffers not in use: an upload's, once it is over. */
static void
s_stage_trim (kiln_client_t *self)
{
    pthread_mutex_lock (&self->stage_mu);
    for (int i = 0; i < self->n_stage_free; i++)
        free (self->stage_free[i]);
    self->n_stage_free = 0;
    pthread_mutex_unlock (&self->stage_mu);
}

/* ZeroMQ let go of a chunk (on its I/O thread): its stage buffer serves
 * the next one; the pages of a mapped weight go back to the kernel, so
 * that uploading 10 GB of weights keeps only the chunks in flight
 * resident. */
static void
s_zc_free (void *data, void *hint)
{
    s_zc_t *zc = hint;
    if (zc->staged)
        s_stage_put (zc->self, data);
    if (zc->mapped)
        kiln_map_drop (data, zc->len);
    atomic_fetch_sub (&zc->self->in_zmq, 1);
    free (zc);
}

/* user@host, in the characters a name may hold. */
static void
s_default_name (char *buf, size_t size)
{
    const char *env = getenv ("KILN_CLIENT_NAME");
    if (env && kiln_proto_name_ok (env)) {
        snprintf (buf, size, "%s", env);
        return;
    }
    char host[64] = "localhost";
    gethostname (host, sizeof host - 1);
    host[sizeof host - 1] = '\0';
    const char *user = getenv ("USER");
    snprintf (buf, size, "%s@%s", user && *user ? user : "user", host);
    for (char *p = buf; *p; p++)
        if (!isalnum ((unsigned char) *p) && !strchr ("._:@-", *p))
            *p = '_';
}

kiln_client_t *
kiln_client_new_config (const kiln_client_config_t *cfg, kiln_err_t *err)
{
    const char *endpoint = cfg->endpoint;
    if (!endpoint || (strncmp (endpoint, "tcp://", 6) != 0
                      && strncmp (endpoint, "ipc://", 6) != 0
                      && strncmp (endpoint, "inproc://", 9) != 0)) {
        kiln_error (err, KILN_EINVAL, "broker endpoint '%s' is not tcp://HOST:PORT or ipc://PATH",
                    endpoint ? endpoint : "");
        return NULL;
    }
    const char *cert = cfg->cert ? cfg->cert : getenv ("KILN_CERT");
    const char *broker_cert = cfg->broker_cert ? cfg->broker_cert : getenv ("KILN_BROKER_CERT");
    if (cert && !*cert)
        cert = NULL;
    if (broker_cert && !*broker_cert)
        broker_cert = NULL;
    if (!cert != !broker_cert) {
        kiln_error (err, KILN_EINVAL, "CurveZMQ needs both our certificate (KILN_CERT) and the "
                    "broker's (KILN_BROKER_CERT)");
        return NULL;
    }
    /* A library must not take over the host program's SIGINT/SIGTERM
     * (Python's KeyboardInterrupt, for one). */
    zsys_handler_set (NULL);
    kiln_client_t *self = calloc (1, sizeof *self);
    if (!self || !(self->endpoint = strdup (endpoint))
        || (cert && !(self->cert = strdup (cert)))
        || (broker_cert && !(self->broker_cert = strdup (broker_cert)))) {
        kiln_client_destroy (&self);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    if (cfg->name) {
        if (!kiln_proto_name_ok (cfg->name)) {
            kiln_error (err, KILN_EINVAL, "client name '%s' must be 1..%d characters of "
                        "[A-Za-z0-9._:@-]", cfg->name, KILN_PROTO_MAX_NAME);
            kiln_client_destroy (&self);
            return NULL;
        }
        snprintf (self->name, sizeof self->name, "%s", cfg->name);
    }
    else
        s_default_name (self->name, sizeof self->name);
    self->heartbeat_ms = cfg->heartbeat_ms > 0 ? cfg->heartbeat_ms : 1000;
    self->liveness_ms = cfg->liveness_ms > 0 ? cfg->liveness_ms : 5000;
    self->broker_timeout_ms = cfg->broker_timeout_ms > 0 ? cfg->broker_timeout_ms : 60000;
    self->next_req = 1;
    atomic_init (&self->in_zmq, 0);
    pthread_mutex_init (&self->stage_mu, NULL);
    if (kiln_client_connect (self, err) != 0) {
        kiln_client_destroy (&self);
        return NULL;
    }
    return self;
}

kiln_client_t *
kiln_client_new (const char *endpoint, kiln_err_t *err)
{
    kiln_client_config_t cfg = { .endpoint = endpoint };
    return kiln_client_new_config (&cfg, err);
}

void
kiln_client_destroy (kiln_client_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_client_t *self = *self_p;
    if (self->dealer) {
        kiln_err_t err = { 0 };
        kiln_msg_t *bye = kiln_msg_new (KILN_CMD_DISCONNECT);
        if (bye)
            kiln_client_send (self, &bye, 0, &err);
        zsock_set_linger (self->dealer, 100);     /* let DISCONNECT leave */
        kiln_client_disconnect (self);
    }
    s_stage_trim (self);             /* ZeroMQ holds none now */
    pthread_mutex_destroy (&self->stage_mu);
    free (self->endpoint);
    free (self->cert);
    free (self->broker_cert);
    free (self);
    *self_p = NULL;
}

static void
s_on_signal (int sig)
{
    zsys_interrupted = 1;
    zctx_interrupted = 1;
}

void
kiln_client_catch_signals (void)
{
    struct sigaction sa;
    memset (&sa, 0, sizeof sa);
    sa.sa_handler = s_on_signal;
    sigemptyset (&sa.sa_mask);
    sigaction (SIGINT, &sa, NULL);
    sigaction (SIGTERM, &sa, NULL);
}

void
kiln_client_set_progress (kiln_client_t *self, kiln_progress_fn *fn, void *arg, int interval_ms)
{
    self->progress = fn;
    self->progress_arg = arg;
    self->progress_ms = interval_ms > 0 ? interval_ms : 1000;
}

void
kiln_client_stats (const kiln_client_t *self, kiln_client_stats_t *out)
{
    *out = self->stats;
}

/* --- preparing requests --------------------------------------------------------- */

static int
s_blob_cmp (const void *a, const void *b)
{
    return memcmp (((const s_blob_t *) a)->digest, ((const s_blob_t *) b)->digest,
                   KILN_DIGEST_LEN);
}

/* Parse "ID" or "ID@VERSION" and the target into a toolchain id. */
static int
s_toolchain (const kiln_compile_opts_t *opts, kiln_toolchain_id_t *tc, kiln_err_t *err)
{
    memset (tc, 0, sizeof *tc);
    const char *target = opts && opts->target ? opts->target : kiln_cc_target ();
    if (!opts || !opts->toolchain || !*opts->toolchain
        || strcmp (opts->toolchain, KILN_COMPILER_ID) == 0) {
        snprintf (tc->id, sizeof tc->id, "%s", KILN_COMPILER_ID);
        snprintf (tc->version, sizeof tc->version, "%s", KILN_COMPILER_VERSION);
    }
    else {
        const char *at = strchr (opts->toolchain, '@');
        size_t n = at ? (size_t) (at - opts->toolchain) : strlen (opts->toolchain);
        if (n > KILN_PROTO_MAX_ID || (at && strlen (at + 1) > KILN_PROTO_MAX_ID))
            return kiln_error (err, KILN_EINVAL, "toolchain '%s' is too long", opts->toolchain);
        memcpy (tc->id, opts->toolchain, n);
        tc->id[n] = '\0';
        snprintf (tc->version, sizeof tc->version, "%s", at ? at + 1 : "0");
    }
    if (strlen (target) > KILN_PROTO_MAX_ID)
        return kiln_error (err, KILN_EINVAL, "target '%s' is too long", target);
    snprintf (tc->target, sizeof tc->target, "%s", target);
    if (!kiln_toolchain_word_ok (tc->id) || !kiln_toolchain_word_ok (tc->version)
        || !kiln_toolchain_word_ok (tc->target))
        return kiln_error (err, KILN_EINVAL, "toolchain '%s %s %s': each part must be 1..%d "
                           "characters of [A-Za-z0-9._+-]", tc->id, tc->version, tc->target,
                           KILN_PROTO_MAX_ID);
    return 0;
}

static void
s_req_destroy (s_req_t **self_p)
{
    if (!*self_p)
        return;
    free ((*self_p)->structure);
    free ((*self_p)->blobs);
    free (*self_p);
    *self_p = NULL;
}

/* Everything about a job that does not change between sends: the
 * structure, the distinct blobs, the keys. */
static s_req_t *
s_req_new (kiln_client_job_t *job, size_t index, kiln_err_t *err)
{
    const kiln_graph_t *g = job->graph;
    kiln_compile_result_t *res = &job->result;
    s_req_t *r = calloc (1, sizeof *r);
    if (!r) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    r->job = job;
    r->index = index;
    if (!g) {
        kiln_error (err, KILN_EINVAL, "no graph");
        goto fail;
    }
    if (job->opts.priority < -KILN_PROTO_MAX_PRIORITY || job->opts.priority > KILN_PROTO_MAX_PRIORITY) {
        kiln_error (err, KILN_EINVAL, "priority %d is outside -%d..%d", job->opts.priority,
                    KILN_PROTO_MAX_PRIORITY, KILN_PROTO_MAX_PRIORITY);
        goto fail;
    }
    if (job->opts.timeout_ms < 0) {
        kiln_error (err, KILN_EINVAL, "negative timeout");
        goto fail;
    }
    if (kiln_args_normalize (job->opts.compiler_args, r->args, sizeof r->args, err) != 0
        || s_toolchain (&job->opts, &r->toolchain, err) != 0)
        goto fail;
    if (!kiln_graph_complete (g)) {
        kiln_error (err, KILN_EINVAL, "the graph lacks the data of some weights");
        goto fail;
    }
    if (kiln_graph_digest (g, res->graph_digest, err) != 0
        || kiln_graph_encode (g, &r->structure, &r->struct_len, err) != 0)
        goto fail;
    kiln_action_key (res->graph_digest, r->args, r->toolchain.id, r->toolchain.version,
                     r->toolchain.target, res->action_key);
    r->blobs = calloc ((size_t) g->n_weights + 1, sizeof *r->blobs);
    if (!r->blobs) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    for (int i = 0; i < g->n_weights; i++) {
        memcpy (r->blobs[i].digest, g->weights[i].digest, KILN_DIGEST_LEN);
        r->blobs[i].size = g->weights[i].size;
        r->blobs[i].data = g->weights[i].data;
        r->blobs[i].mapped = g->weights[i].map.base != NULL;
    }
    qsort (r->blobs, (size_t) g->n_weights, sizeof *r->blobs, s_blob_cmp);
    for (int i = 0; i < g->n_weights; i++)
        if (r->n_blobs == 0 || memcmp (r->blobs[r->n_blobs - 1].digest, r->blobs[i].digest,
                                       KILN_DIGEST_LEN) != 0)
            r->blobs[r->n_blobs++] = r->blobs[i];
    if (r->n_blobs > KILN_PROTO_MAX_BLOBS) {
        kiln_error (err, KILN_ELIMIT, "the graph has %u distinct weight blobs, more than %d",
                    r->n_blobs, KILN_PROTO_MAX_BLOBS);
        goto fail;
    }
    return r;
fail:
    s_req_destroy (&r);
    return NULL;
}

/* --- the engine ----------------------------------------------------------------- */

typedef struct {
    kiln_client_t *self;
    kiln_client_job_t *jobs;
    s_req_t **reqs;                  /* one per job, NULL once finished or not started */
    size_t n;
    size_t left;                     /* jobs not finished */
    zhashx_t *by_id;                 /* req_key -> s_req_t */
    zhashx_t *uploads;               /* hex -> s_upload_t (owns) */
    zlistx_t *upload_order;          /* s_upload_t, first to send first */
    kiln_client_done_fn *done;
    void *arg;
    int64_t broker_seen;             /* zclock_mono of the broker's last message */
    int64_t broker_lost_since;       /* 0, or when it went silent past liveness */
    int64_t hb_at;                   /* next heartbeat */
    size_t fetching;                 /* of `left`, answered by RESULTs sent apart (R_FETCH) */
    bool heard;                      /* the broker answered something in this call */
    int64_t where_at;                /* next WHERE (with a progress callback) */
    uint64_t upload_total;           /* blob bytes queued for upload in this call */
    uint64_t upload_sent;            /* of those, sent */
} s_engine_t;

/* Tell the progress callback, if there is one. */
static void
s_progress (s_engine_t *e, kiln_progress_event_t *ev)
{
    if (e->self->progress)
        e->self->progress (ev, e->self->progress_arg);
}

static void
s_upload_destroy (s_upload_t **self_p)
{
    if (!*self_p)
        return;
    zlistx_destroy (&(*self_p)->reqs);
    free (*self_p);
    *self_p = NULL;
}

/* Finish job `r` (err may be NULL: success) and free its request. */
static void
s_finish (s_engine_t *e, s_req_t *r, const kiln_err_t *err, bool failure_cached)
{
    kiln_client_job_t *job = r->job;
    if (err) {
        job->err = *err;
        if (!job->err.code)
            job->err.code = KILN_EREMOTE;
    }
    else
        kiln_err_clear (&job->err);
    job->failure_cached = failure_cached;
    r->state = R_DONE;
    zhashx_delete (e->by_id, r->req_key);
    /* forget it in the uploads it waited for */
    for (s_upload_t *up = zhashx_first (e->uploads); up; up = zhashx_next (e->uploads)) {
        void *handle = zlistx_find (up->reqs, r);
        if (handle)
            zlistx_delete (up->reqs, handle);
    }
    e->reqs[r->index] = NULL;
    size_t index = r->index;
    s_req_destroy (&r);
    e->left--;
    kiln_progress_event_t ev = { .index = index, .phase = KILN_PHASE_DONE };
    s_progress (e, &ev);
    if (e->done)
        e->done (job, index, e->arg);
}

static void
s_fail (s_engine_t *e, s_req_t *r, int code, const char *fmt, ...)
    __attribute__ ((format (printf, 4, 5)));

static void
s_fail (s_engine_t *e, s_req_t *r, int code, const char *fmt, ...)
{
    kiln_err_t err = { .code = code };
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (err.msg, sizeof err.msg, fmt, ap);
    va_end (ap);
    s_finish (e, r, &err, false);
}

/* Send FIND for `r`: every blob by reference. */
static int
s_send_find (s_engine_t *e, s_req_t *r, kiln_err_t *err)
{
    kiln_client_t *self = e->self;
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_FIND);
    if (!msg)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    msg->req_id = r->req_id;
    int rc = 0;
    for (uint32_t i = 0; rc == 0 && i < r->n_blobs; i++) {
        /* FIND carries no payload: list the refs directly */
        kiln_blob_ref_t *grown = realloc (msg->blobs, (msg->n_blobs + 1) * sizeof *grown);
        if (!grown) {
            rc = kiln_error (err, KILN_ENOMEM, "out of memory");
            break;
        }
        msg->blobs = grown;
        memcpy (grown[msg->n_blobs].digest, r->blobs[i].digest, KILN_DIGEST_LEN);
        grown[msg->n_blobs].size = r->blobs[i].size;
        grown[msg->n_blobs++].in_msg = false;
    }
    if (rc == 0)
        rc = kiln_client_writable (self, (int) self->broker_timeout_ms, err);
    if (rc != 0) {
        kiln_msg_destroy (&msg);
        return rc;
    }
    if ((rc = kiln_client_send (self, &msg, (int) self->broker_timeout_ms, err)) != 0)
        return rc;
    r->state = R_SENT;
    return 0;
}

/* Send COMPILE for `r`: small blobs inline, the rest by reference. */
static int
s_send_compile (s_engine_t *e, s_req_t *r, kiln_err_t *err)
{
    kiln_client_t *self = e->self;
    if (r->upload_only)
        return s_send_find (e, r, err);
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_COMPILE);
    if (!msg)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    const kiln_compile_opts_t *o = &r->job->opts;
    msg->req_id = r->req_id;
    memcpy (msg->graph_digest, r->job->result.graph_digest, KILN_HEX_LEN);
    memcpy (msg->action_key, r->job->result.action_key, KILN_HEX_LEN);
    msg->priority = o->priority;
    msg->timeout_ms = (uint64_t) o->timeout_ms;
    msg->retry_failed = o->retry_failed;
    int rc = 0;
    if ((r->args[0] && kiln_msg_set_str (&msg->compiler_args, r->args) != 0)
        || kiln_msg_set_str (&msg->compiler_id, r->toolchain.id) != 0
        || kiln_msg_set_str (&msg->compiler_version, r->toolchain.version) != 0
        || kiln_msg_set_str (&msg->target, r->toolchain.target) != 0
        || kiln_msg_set_str (&msg->client, self->name) != 0) {
        kiln_msg_destroy (&msg);
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    rc = kiln_msg_put_structure (msg, r->structure, r->struct_len, err);
    uint64_t inline_total = 0;
    for (uint32_t i = 0; rc == 0 && i < r->n_blobs; i++) {
        const s_blob_t *b = &r->blobs[i];
        if (b->size <= KILN_PROTO_INLINE_BLOB
            && inline_total + b->size <= KILN_PROTO_INLINE_TOTAL) {
            rc = kiln_msg_put_blob (msg, b->digest, b->data, b->size, err);
            inline_total += b->size;
            self->stats.inline_bytes += b->size;
        }
        else
            rc = kiln_msg_add_blob_ref (msg, b->digest, b->size, err);
    }
    if (rc == 0)
        rc = kiln_client_writable (self, (int) self->broker_timeout_ms, err);
    if (rc != 0) {
        kiln_msg_destroy (&msg);
        return rc;
    }
    if ((rc = kiln_client_send (self, &msg, (int) self->broker_timeout_ms, err)) != 0)
        return rc;
    r->state = R_SENT;
    self->stats.requests++;
    return 0;
}

/* Send one chunk of `up`. */
static int
s_send_chunk (s_engine_t *e, s_upload_t *up, kiln_err_t *err)
{
    kiln_client_t *self = e->self;
    uint64_t n = up->size - up->sent < KILN_CHUNK_BYTES ? up->size - up->sent
                                                         : KILN_CHUNK_BYTES;
    kiln_msg_t *chunk = kiln_msg_new (KILN_CMD_CHUNK);
    if (!chunk)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    memcpy (chunk->digest, up->hex, KILN_HEX_LEN);
    chunk->blob_size = up->size;
    chunk->offset = up->sent;
    if (n > 0) {
        s_zc_t *zc = malloc (sizeof *zc);
        const uint8_t *src = up->data + up->sent;
        uint8_t *stage = zc && !up->mapped ? s_stage_get (self) : NULL;
        if (!zc || (!up->mapped && !stage)) {
            free (zc);
            kiln_msg_destroy (&chunk);
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        }
        if (stage)
            src = memcpy (stage, src, (size_t) n);
        else
            kiln_map_prefault (src, (size_t) n);
        *zc = (s_zc_t) { .self = self, .len = (size_t) n, .staged = stage != NULL,
                         .mapped = up->mapped };
        atomic_fetch_add (&self->in_zmq, 1);
        if (kiln_msg_put_chunk_ref (chunk, src, (size_t) n, s_zc_free, zc, err) != 0) {
            atomic_fetch_sub (&self->in_zmq, 1);
            if (stage)
                s_stage_put (self, stage);
            free (zc);
            kiln_msg_destroy (&chunk);
            return -err->code;
        }
    }
    if (kiln_client_send (self, &chunk, (int) self->broker_timeout_ms, err) != 0)
        return self->refusal.code ? -err->code
                                  : kiln_error_prefix (err, "uploading blob %.12s", up->hex);
    self->credit--;
    self->stats.uploaded_bytes += n;
    up->sent += n;
    up->started = true;
    e->upload_sent += n;
    kiln_progress_event_t ev = { .index = SIZE_MAX, .phase = KILN_PHASE_UPLOAD,
                                 .sent_bytes = e->upload_sent, .total_bytes = e->upload_total };
    s_progress (e, &ev);
    return 0;
}

/* Send what the credit allows of the uploads, first come first, the
 * first S_UPLOADS_AT_ONCE unsent ones taking turns chunk by chunk: the
 * broker checks each blob's SHA-256 on a thread of its own, so two blobs
 * in flight keep two of its cores hashing. */
static int
s_pump_uploads (s_engine_t *e, kiln_err_t *err)
{
    kiln_client_t *self = e->self;
    int64_t now = zclock_mono ();
    while (self->credit > 0) {
        s_upload_t *turn[S_UPLOADS_AT_ONCE];
        int n = 0;
        for (s_upload_t *up = zlistx_first (e->upload_order); up && n < S_UPLOADS_AT_ONCE;
             up = zlistx_next (e->upload_order))
            if ((!up->started || up->sent < up->size) && up->retry_at <= now)
                turn[n++] = up;
        if (n == 0)
            break;
        for (int i = 0; i < n && self->credit > 0; i++) {
            int rc = s_send_chunk (e, turn[i], err);
            if (rc)
                return rc;
        }
    }
    return 0;
}

/* The broker confirmed (or refused) blob `hex`. */
static void
s_upload_done (s_engine_t *e, const char *hex, const kiln_err_t *failure)
{
    s_upload_t *up = zhashx_lookup (e->uploads, hex);
    if (!up)
        return;
    zlistx_t *reqs = up->reqs;
    up->reqs = NULL;
    void *handle = zlistx_find (e->upload_order, up);
    if (handle)
        zlistx_detach (e->upload_order, handle);
    zhashx_delete (e->uploads, hex);
    if (!failure)
        e->self->stats.uploaded_blobs++;
    for (s_req_t *r = zlistx_first (reqs); r; r = zlistx_next (reqs)) {
        if (r->state != R_UPLOADING)
            continue;
        if (failure) {
            kiln_err_t f = *failure;
            kiln_error_prefix (&f, "uploading blob %.12s", hex);
            s_finish (e, r, &f, false);
        }
        else if (--r->waiting <= 0)
            r->state = R_NEW;        /* everything is there: COMPILE again */
    }
    zlistx_destroy (&reqs);
}

/* The broker refused blob `hex` for now (EBUSY: its uploads or its
 * store's room are taken): send it again from the start after a wait that
 * doubles each time.  The request's own deadline bounds the waiting. */
static void
s_upload_busy (s_engine_t *e, const char *hex, const char *why)
{
    s_upload_t *up = zhashx_lookup (e->uploads, hex);
    if (!up)
        return;
    int64_t wait = S_BUSY_MIN_MS;
    for (int i = 0; i < up->busy && wait < S_BUSY_MAX_MS; i++)
        wait *= 2;
    if (wait > S_BUSY_MAX_MS)
        wait = S_BUSY_MAX_MS;
    if (up->busy++ == 0)
        kiln_log_info ("blob %.12s: the broker is busy (%s); sending it again in %lld ms", hex,
                       why ? why : "", (long long) wait);
    e->upload_sent -= up->sent < e->upload_sent ? up->sent : e->upload_sent;
    up->sent = 0;
    up->started = false;
    up->retry_at = zclock_mono () + wait;
}

/* The broker lacks some of r's blobs: queue their uploads. */
static void
s_on_missing (s_engine_t *e, s_req_t *r, kiln_msg_t *msg)
{
    e->self->credit += (uint32_t) msg->credit;
    r->state = R_UPLOADING;
    r->waiting = 0;
    for (uint32_t i = 0; i < msg->n_blobs; i++) {
        s_blob_t key;
        memcpy (key.digest, msg->blobs[i].digest, KILN_DIGEST_LEN);
        s_blob_t *b = bsearch (&key, r->blobs, r->n_blobs, sizeof *r->blobs, s_blob_cmp);
        char hex[KILN_HEX_LEN];
        kiln_hex (msg->blobs[i].digest, KILN_DIGEST_LEN, hex);
        if (!b) {
            s_fail (e, r, KILN_EPROTO, "the broker asked for blob %s, which the graph does "
                    "not have", hex);
            return;
        }
        s_upload_t *up = zhashx_lookup (e->uploads, hex);
        if (!up) {
            up = calloc (1, sizeof *up);
            if (!up || !(up->reqs = zlistx_new ())) {
                free (up);
                s_fail (e, r, KILN_ENOMEM, "out of memory");
                return;
            }
            memcpy (up->hex, hex, KILN_HEX_LEN);
            up->data = b->data;
            up->mapped = b->mapped;
            up->size = b->size;
            e->upload_total += b->size;
            zhashx_insert (e->uploads, hex, up);
            zlistx_add_end (e->upload_order, up);
        }
        if (!zlistx_find (up->reqs, r)) {
            zlistx_add_end (up->reqs, r);
            r->waiting++;
        }
    }
    if (r->waiting == 0)
        r->state = R_NEW;
}

/* Check a RESULT against the request, then write its artifact. */
static int
s_take_result (const kiln_msg_t *msg, const char *out_path, kiln_compile_result_t *res,
               kiln_err_t *err)
{
    uint8_t *bytes = NULL;
    size_t len = 0;
    kiln_artifact_t *art = NULL;
    char digest[KILN_HEX_LEN];
    int rc;
    if (strcmp (msg->action_key, res->action_key) != 0
        || strcmp (msg->graph_digest, res->graph_digest) != 0) {
        rc = kiln_error (err, KILN_EVERIFY, "the broker answered for action %.12s, not %.12s",
                         msg->action_key, res->action_key);
        goto done;
    }
    if (msg->artifact_apart) {
        /* Large: it is fetched apart, in chunks, by its content hash. */
        memcpy (res->artifact, msg->artifact, KILN_HEX_LEN);
        res->cached = msg->cached;
        snprintf (res->worker, sizeof res->worker, "%s", msg->worker ? msg->worker : "");
        rc = 0;
        goto done;
    }
    if ((rc = kiln_msg_part (msg, 0, &bytes, &len, err)) != 0)
        goto done;
    if (!(art = kiln_artifact_read_mem (bytes, len, err))) {
        rc = kiln_error_prefix (err, "artifact from the broker");
        goto done;
    }
    if ((rc = kiln_artifact_digest (art, digest, err)) != 0)
        goto done;
    const kiln_manifest_t *m = kiln_artifact_manifest (art);
    if (strcmp (digest, msg->artifact) != 0 || strcmp (m->action_key, res->action_key) != 0) {
        rc = kiln_error (err, KILN_EVERIFY, "the artifact from the broker has content hash "
                         "%s and action %.12s; expected %s and %.12s", digest, m->action_key,
                         msg->artifact, res->action_key);
        goto done;
    }
    if (out_path && (rc = kiln_write_file_atomic (out_path, bytes, len, 0644, err)) != 0)
        goto done;
    memcpy (res->artifact, digest, KILN_HEX_LEN);
    res->cached = msg->cached;
    snprintf (res->worker, sizeof res->worker, "%s", msg->worker ? msg->worker : "");
done:
    kiln_artifact_destroy (&art);
    free (bytes);
    return rc;
}

/* The farm's ERROR as our error: its code, its message, and as much of the
 * end of the compile log as fits. */
void
kiln_client_remote_error (const kiln_msg_t *msg, kiln_err_t *err)
{
    int code = msg->code > 0 && msg->code < KILN_ERR_MAX ? (int) msg->code : KILN_EREMOTE;
    if (!msg->log || !*msg->log) {
        kiln_error (err, code, "%s", msg->message);
        return;
    }
    size_t room = KILN_ERR_MSG_MAX / 2;
    size_t n = strlen (msg->log);
    const char *tail = n > room ? msg->log + n - room : msg->log;
    kiln_error (err, code, "%s\n--- compile log%s ---\n%s", msg->message,
                n > room ? " (end)" : "", tail);
}

/* Requests not finished go back to NEW, to be sent again: all of them
 * after a new connection, else only those the broker accepted (it lost
 * some of them). */
static void
s_resend_all (s_engine_t *e, bool only_accepted, const char *why)
{
    size_t count = 0;
    for (size_t i = 0; i < e->n; i++) {
        s_req_t *r = e->reqs[i];
        if (!r || r->state == R_NEW || r->state == R_DONE || r->state == R_FETCH
            || (only_accepted && r->state != R_ACCEPTED))
            continue;
        if (++r->resends > S_MAX_RESENDS) {
            s_fail (e, r, KILN_EREMOTE, "gave up after sending the request %d times (%s)",
                    S_MAX_RESENDS, why);
            continue;
        }
        r->state = R_NEW;
        r->waiting = 0;
        count++;
    }
    if (!only_accepted) {
        zlistx_purge (e->upload_order);
        zhashx_purge (e->uploads);
    }
    e->self->stats.resent += count;
    if (count)
        kiln_log_info ("sending %zu request%s again: %s", count, count == 1 ? "" : "s", why);
}

static void
s_handle (s_engine_t *e, kiln_msg_t *msg)
{
    kiln_client_t *self = e->self;
    kiln_err_t err = { 0 };
    /* Another broker instance answers: the one we talked to restarted and
     * forgot our requests, uploads and credit.  What we sent it before it
     * knew us is answered as nonsense (chunks of uploads it never began):
     * those answers come before this point is passed for good, and find no
     * upload to fail. */
    if (msg->epoch && msg->epoch != self->epoch) {
        if (self->epoch) {
            self->credit = 0;
            s_resend_all (e, false, "the broker restarted");
        }
        self->epoch = msg->epoch;
    }
    if (msg->cmd == KILN_CMD_CREDIT) {
        self->credit += (uint32_t) msg->credit;
        if (msg->digest[0])
            s_upload_done (e, msg->digest, NULL);
        return;
    }
    if (msg->cmd == KILN_CMD_HEARTBEAT) {
        size_t accepted = 0;
        for (s_req_t *r = zhashx_first (e->by_id); r; r = zhashx_next (e->by_id))
            accepted += r->state == R_ACCEPTED;
        if (msg->pending < accepted) {
            char why[96];
            snprintf (why, sizeof why, "the broker holds %llu of our %zu accepted requests",
                      (unsigned long long) msg->pending, accepted);
            s_resend_all (e, true, why);
        }
        return;
    }
    if (msg->cmd == KILN_CMD_ERROR && !msg->req_id && msg->digest[0]
        && msg->code == KILN_EBUSY) {
        s_upload_busy (e, msg->digest, msg->message);
        return;
    }
    if (msg->cmd == KILN_CMD_ERROR && !msg->req_id && msg->digest[0]) {
        kiln_client_remote_error (msg, &err);
        s_upload_done (e, msg->digest, &err);
        return;
    }
    char key[24];
    snprintf (key, sizeof key, "%llu", (unsigned long long) msg->req_id);
    s_req_t *r = msg->req_id ? zhashx_lookup (e->by_id, key) : NULL;
    if (!r) {
        if (msg->cmd == KILN_CMD_RESULT || msg->cmd == KILN_CMD_ERROR) {
            if (msg->req_id)
                self->stats.duplicates++;
            else
                kiln_log_warn ("the broker says %s: %s", kiln_errname ((int) msg->code),
                               msg->message ? msg->message : "");
        }
        return;
    }
    switch (msg->cmd) {
    case KILN_CMD_ACCEPTED:
        if (r->state == R_SENT) {
            r->state = R_ACCEPTED;
            r->job_id = msg->job_id;
            e->where_at = 0;         /* ask where it is at once: it may be running */
            kiln_progress_event_t ev = { .index = r->index, .phase = KILN_PHASE_QUEUED };
            s_progress (e, &ev);
        }
        break;
    case KILN_CMD_PROGRESS: {
        bool running = msg->state && strcmp (msg->state, "running") == 0;
        kiln_progress_event_t ev = {
            .index = r->index, .phase = running ? KILN_PHASE_RUNNING : KILN_PHASE_QUEUED,
            .position = msg->position, .queued = msg->queued, .running = msg->running,
            .worker = msg->worker, .elapsed_ms = msg->elapsed_ms,
            .estimate_ms = msg->estimate_ms, .eta_ms = msg->eta_ms,
        };
        s_progress (e, &ev);
        break;
    }
    case KILN_CMD_MISSING:
        if (r->state == R_SENT && r->upload_only && msg->n_blobs == 0)
            s_finish (e, r, NULL, false);
        else if (r->state == R_SENT)
            s_on_missing (e, r, msg);
        break;
    case KILN_CMD_RESULT:
        if (s_take_result (msg, r->job->out_path, &r->job->result, &err) != 0)
            s_finish (e, r, &err, false);
        else if (msg->artifact_apart && r->job->out_path) {
            r->state = R_FETCH;          /* fetched when the others are answered */
            e->fetching++;
        }
        else
            s_finish (e, r, NULL, false);
        break;
    case KILN_CMD_ERROR:
        kiln_client_remote_error (msg, &err);
        s_finish (e, r, &err, msg->cached);
        break;
    default:
        break;
    }
}

/* With a progress callback: ask where the first accepted job is (the
 * answer also counts all our jobs on the farm), and for a call of a few
 * jobs, each of them. */
static void
s_send_where (s_engine_t *e)
{
    size_t asked = 0;
    for (size_t i = 0; i < e->n && asked < 4; i++) {
        s_req_t *r = e->reqs[i];
        if (!r || r->state != R_ACCEPTED || !r->job_id)
            continue;
        kiln_msg_t *where = kiln_msg_new (KILN_CMD_WHERE);
        kiln_err_t err = { 0 };
        if (!where)
            return;
        where->req_id = r->req_id;
        where->job_id = r->job_id;
        kiln_client_send (e->self, &where, 0, &err);
        asked++;
    }
}

/* Cancel what is left: tell the broker, fail each with `code`. */
static void
s_cancel_all (s_engine_t *e, int code, const char *why)
{
    kiln_err_t err = { 0 };
    for (size_t i = 0; i < e->n; i++) {
        s_req_t *r = e->reqs[i];
        if (!r)
            continue;
        if (r->state != R_NEW && e->self->dealer) {
            kiln_msg_t *cancel = kiln_msg_new (KILN_CMD_CANCEL);
            if (cancel) {
                cancel->req_id = r->req_id;
                kiln_client_send (e->self, &cancel, 0, &err);
            }
        }
        s_fail (e, r, code, "%s", why);
    }
}

static int
s_run (kiln_client_t *self, kiln_client_job_t *jobs, size_t n, int wait_ms,
       kiln_client_done_fn *done, void *arg, bool upload_only, kiln_err_t *err)
{
    if (!self || (!jobs && n))
        return kiln_error (err, KILN_EINVAL, "kiln_client_compile_batch needs a client and jobs");
    if (n > S_MAX_BATCH)
        return kiln_error (err, KILN_ELIMIT, "%zu jobs in one batch, more than %u", n,
                           S_MAX_BATCH);
    int rc = 0;
    s_engine_t e = { .self = self, .jobs = jobs, .n = n, .done = done, .arg = arg };
    e.reqs = calloc (n ? n : 1, sizeof *e.reqs);
    e.by_id = zhashx_new ();
    e.uploads = zhashx_new ();
    e.upload_order = zlistx_new ();
    if (!e.reqs || !e.by_id || !e.uploads || !e.upload_order) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory");
        goto done;
    }
    zhashx_set_destructor (e.uploads, (zhashx_destructor_fn *) s_upload_destroy);
    for (size_t i = 0; i < n; i++) {
        kiln_client_job_t *job = &jobs[i];
        memset (&job->result, 0, sizeof job->result);
        kiln_err_clear (&job->err);
        job->failure_cached = false;
        kiln_err_t jerr = { 0 };
        s_req_t *r = s_req_new (job, i, &jerr);
        e.left++;
        if (!r) {
            job->err = jerr;
            e.left--;
            if (done)
                done (job, i, arg);
            continue;
        }
        r->req_id = self->next_req++;
        r->upload_only = upload_only;
        snprintf (r->req_key, sizeof r->req_key, "%llu", (unsigned long long) r->req_id);
        zhashx_insert (e.by_id, r->req_key, r);
        e.reqs[i] = r;
    }
    if (!self->dealer && kiln_client_connect (self, err) != 0) {
        rc = -err->code;
        s_cancel_all (&e, err->code, err->msg);
        goto done;
    }
    int64_t start = zclock_mono ();
    int64_t deadline = wait_ms > 0 ? start + wait_ms : INT64_MAX;
    e.broker_seen = start;
    e.hb_at = start + self->heartbeat_ms;
    while (e.left > e.fetching) {
        int64_t now = zclock_mono ();
        if (zsys_interrupted) {
            s_cancel_all (&e, KILN_ECANCELED, "interrupted");
            rc = kiln_error (err, KILN_ECANCELED, "interrupted");
            break;
        }
        if (now >= deadline) {
            char why[160];
            if (e.heard)
                snprintf (why, sizeof why, "gave up waiting after %g s; the request was "
                          "canceled on the farm", wait_ms / 1000.0);
            else
                snprintf (why, sizeof why, "no answer from the broker at %s within %g s",
                          self->endpoint, wait_ms / 1000.0);
            s_cancel_all (&e, e.heard ? KILN_ETIMEOUT : KILN_EUNREACHABLE, why);
            break;
        }
        /* The broker is silent: open the socket again and resend; after
         * broker_timeout_ms of silence, give up. */
        if (now - e.broker_seen > self->broker_timeout_ms) {
            char why[160];
            snprintf (why, sizeof why, "no answer from the broker at %s for %g s",
                      self->endpoint, self->broker_timeout_ms / 1000.0);
            s_cancel_all (&e, KILN_EUNREACHABLE, why);
            rc = kiln_error (err, KILN_EUNREACHABLE, "%s", why);
            break;
        }
        if (now - e.broker_seen > self->liveness_ms
            && (!e.broker_lost_since || now - e.broker_lost_since > self->liveness_ms)) {
            e.broker_lost_since = now;
            kiln_client_disconnect (self);
            self->stats.reconnects++;
            if (kiln_client_connect (self, err) != 0) {
                rc = -err->code;
                s_cancel_all (&e, err->code, err->msg);
                break;
            }
            s_resend_all (&e, false, "the broker went silent");
        }
        /* Send what is new, then what the credit allows. */
        kiln_err_t serr = { 0 };
        for (size_t i = 0; i < n && serr.code == 0; i++)
            if (e.reqs[i] && e.reqs[i]->state == R_NEW)
                s_send_compile (&e, e.reqs[i], &serr);
        if (serr.code == 0)
            s_pump_uploads (&e, &serr);
        if (self->refusal.code) {
            *err = self->refusal;
            rc = -err->code;
            s_cancel_all (&e, err->code, err->msg);
            break;
        }
        if (serr.code != 0)
            kiln_log_warn ("%s", serr.msg);      /* the broker will be found silent */
        if (self->progress && now >= e.where_at) {
            s_send_where (&e);
            e.where_at = now + self->progress_ms;
        }
        if (now >= e.hb_at) {
            kiln_msg_t *hb = kiln_msg_new (KILN_CMD_HEARTBEAT);
            kiln_err_t herr = { 0 };
            if (hb)
                kiln_client_send (self, &hb, 0, &herr);
            e.hb_at = now + self->heartbeat_ms;
        }
        int64_t wait = e.hb_at - now;
        if (wait > KILN_CLIENT_MAX_POLL_MS)
            wait = KILN_CLIENT_MAX_POLL_MS;
        if (deadline - now < wait)
            wait = deadline - now;
        if (wait < 0)
            wait = 0;
        zmq_pollitem_t items[2] = {
            { zsock_resolve (self->dealer), 0, ZMQ_POLLIN, 0 },
            { self->monitor ? zsock_resolve (self->monitor) : NULL, 0, ZMQ_POLLIN, 0 },
        };
        int got = zmq_poll (items, self->monitor ? 2 : 1, (long) wait);
        if (got < 0 && zmq_errno () != EINTR) {
            rc = kiln_error (err, KILN_EIO, "waiting for the broker: %s",
                             zmq_strerror (zmq_errno ()));
            s_cancel_all (&e, KILN_EIO, err->msg);
            break;
        }
        if (got > 0 && self->monitor && (items[1].revents & ZMQ_POLLIN)
            && kiln_client_refused (self, err)) {
            rc = -err->code;
            s_cancel_all (&e, err->code, err->msg);
            break;
        }
        for (int k = 0; got > 0 && k < 1024 && e.left > e.fetching; k++) {
            if (!(zsock_events (self->dealer) & ZMQ_POLLIN))
                break;
            kiln_err_t rerr = { 0 };
            uint64_t got_req = 0;
            kiln_msg_t *msg = kiln_msg_recv (self->dealer, NULL, &got_req, &rerr);
            e.broker_seen = zclock_mono ();
            e.broker_lost_since = 0;
            e.heard = true;
            if (!msg) {
                char key[24];
                snprintf (key, sizeof key, "%llu", (unsigned long long) got_req);
                s_req_t *r = got_req ? zhashx_lookup (e.by_id, key) : NULL;
                if (r) {
                    kiln_error_prefix (&rerr, "reply from the broker");
                    s_finish (&e, r, &rerr, false);
                }
                else
                    kiln_log_warn ("unreadable message from the broker: %s", rerr.msg);
                continue;
            }
            s_handle (&e, msg);
            kiln_msg_destroy (&msg);
        }
    }
    /* The large artifacts, fetched one after the other in chunks. */
    for (size_t i = 0; i < n && e.reqs; i++) {
        s_req_t *r = e.reqs[i];
        if (!r || r->state != R_FETCH)
            continue;
        kiln_err_t gerr = { 0 };
        int64_t left = wait_ms > 0 ? deadline - zclock_mono () : 0;
        if (wait_ms > 0 && left <= 0)
            s_fail (&e, r, KILN_ETIMEOUT, "gave up waiting after %g s", wait_ms / 1000.0);
        else if (kiln_client_get (self, r->job->result.artifact, r->job->out_path, NULL,
                                  (int) left, NULL, &gerr) != 0)
            s_finish (&e, r, &gerr, false);
        else
            s_finish (&e, r, NULL, false);
    }
done:
    /* ZeroMQ may still hold chunks that point into the caller's buffers:
     * drop the connection so that it lets go of them before we return. */
    if (atomic_load (&self->in_zmq) > 0) {
        kiln_client_disconnect (self);
        self->stats.reconnects++;
    }
    s_stage_trim (self);
    for (size_t i = 0; e.reqs && i < n; i++)
        s_req_destroy (&e.reqs[i]);
    free (e.reqs);
    zhashx_destroy (&e.by_id);
    zhashx_destroy (&e.uploads);
    zlistx_destroy (&e.upload_order);
    return rc;
}

int
kiln_client_compile_batch (kiln_client_t *self, kiln_client_job_t *jobs, size_t n, int wait_ms,
                           kiln_client_done_fn *done, void *arg, kiln_err_t *err)
{
    return s_run (self, jobs, n, wait_ms, done, arg, false, err);
}

int
kiln_client_upload (kiln_client_t *self, const kiln_graph_t *g, int wait_ms, uint64_t *sent,
                    kiln_err_t *err)
{
    if (!self || !g)
        return kiln_error (err, KILN_EINVAL, "kiln_client_upload needs a client and a graph");
    kiln_client_job_t job;
    memset (&job, 0, sizeof job);
    job.graph = g;
    uint64_t before = self->stats.uploaded_bytes;
    int rc = s_run (self, &job, 1, wait_ms, NULL, NULL, true, err);
    if (sent)
        *sent = self->stats.uploaded_bytes - before;
    if (rc != 0)
        return rc;
    if (job.err.code) {
        if (err)
            *err = job.err;
        return -job.err.code;
    }
    return 0;
}

int
kiln_client_compile (kiln_client_t *self, const kiln_graph_t *g,
                     const kiln_compile_opts_t *opts, const char *out_path,
                     kiln_compile_result_t *res, kiln_err_t *err)
{
    memset (res, 0, sizeof *res);
    if (!self || !g || !out_path)
        return kiln_error (err, KILN_EINVAL, "kiln_client_compile needs a client, a graph "
                           "and an output path");
    kiln_client_job_t job;
    memset (&job, 0, sizeof job);
    job.graph = g;
    job.out_path = out_path;
    if (opts)
        job.opts = *opts;
    int rc = kiln_client_compile_batch (self, &job, 1, opts ? opts->wait_ms : 0, NULL, NULL,
                                        err);
    *res = job.result;
    if (rc != 0)
        return rc;
    if (job.err.code) {
        if (err)
            *err = job.err;
        return -job.err.code;
    }
    return 0;
}
