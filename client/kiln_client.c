/*
 * kiln_client — the remote half of libkilnclient: COMPILE to a broker,
 * wait for RESULT or ERROR, check and write the artifact.
 *
 * One request at a time per client.  Each request has its own id, and
 * replies with another id (left over from an earlier request that timed
 * out) are dropped, so a client can be reused after a failure.
 */
#include "client/kiln_client.h"

#include <stdlib.h>
#include <string.h>

#include <czmq.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_fs.h"
#include "common/kiln_limits.h"
#include "common/kiln_proto.h"
#include "compiler/kiln_compiler.h"

#define S_DEFAULT_TIMEOUT_MS (600 * 1000)
#define S_POLL_MS            1000     /* longest single wait, so signals are seen */

struct kiln_client {
    char *endpoint;          /* owned copy */
    zsock_t *dealer;         /* connected to the broker */
    uint64_t next_req;       /* id of the next request */
};

kiln_client_t *
kiln_client_new (const char *endpoint, kiln_err_t *err)
{
    if (!endpoint || (strncmp (endpoint, "tcp://", 6) != 0
                      && strncmp (endpoint, "ipc://", 6) != 0
                      && strncmp (endpoint, "inproc://", 9) != 0)) {
        kiln_error (err, KILN_EINVAL, "broker endpoint '%s' is not tcp://HOST:PORT or ipc://PATH",
                    endpoint ? endpoint : "");
        return NULL;
    }
    /* A library must not take over the host program's SIGINT/SIGTERM
     * (Python's KeyboardInterrupt, for one). */
    zsys_handler_set (NULL);
    kiln_client_t *self = calloc (1, sizeof *self);
    if (!self || !(self->endpoint = strdup (endpoint))) {
        free (self);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    self->next_req = 1;
    self->dealer = zsock_new (ZMQ_DEALER);
    if (!self->dealer) {
        kiln_error (err, KILN_ESYS, "could not create a ZeroMQ socket");
        kiln_client_destroy (&self);
        return NULL;
    }
    kiln_proto_socket_defaults (self->dealer);
    if (strstr (endpoint, "[::1]") || strchr (endpoint, '['))
        zsock_set_ipv6 (self->dealer, 1);
    if (zsock_connect (self->dealer, "%s", endpoint) != 0) {
        kiln_error (err, KILN_EINVAL, "could not connect to '%s': %s", endpoint,
                    zmq_strerror (zmq_errno ()));
        kiln_client_destroy (&self);
        return NULL;
    }
    return self;
}

void
kiln_client_destroy (kiln_client_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_client_t *self = *self_p;
    zsock_destroy (&self->dealer);
    free (self->endpoint);
    free (self);
    *self_p = NULL;
}

/* Order weight indices by digest, so that each distinct blob is sent once. */
static int
s_weight_cmp (const void *a, const void *b, void *arg)
{
    const kiln_graph_t *g = arg;
    const kiln_weight_t *wa = &g->weights[*(const int *) a];
    const kiln_weight_t *wb = &g->weights[*(const int *) b];
    return memcmp (wa->digest, wb->digest, KILN_DIGEST_LEN);
}

/* Build the COMPILE message for `g`.  Caller owns the result. */
static kiln_msg_t *
s_compile_msg (const kiln_graph_t *g, uint64_t req_id, const char *norm_args,
               const kiln_compile_result_t *res, kiln_err_t *err)
{
    uint8_t *structure = NULL;
    size_t len = 0;
    int *order = NULL;
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_COMPILE);
    if (!msg) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    msg->req_id = req_id;
    memcpy (msg->graph_digest, res->graph_digest, KILN_HEX_LEN);
    memcpy (msg->action_key, res->action_key, KILN_HEX_LEN);
    if ((norm_args[0] && kiln_msg_set_str (&msg->compiler_args, norm_args) != 0)
        || kiln_msg_set_str (&msg->compiler_id, KILN_COMPILER_ID) != 0
        || kiln_msg_set_str (&msg->compiler_version, KILN_COMPILER_VERSION) != 0
        || kiln_msg_set_str (&msg->target, kiln_cc_target ()) != 0) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    if (kiln_graph_encode (g, &structure, &len, err) != 0
        || kiln_msg_put_structure (msg, structure, len, err) != 0)
        goto fail;
    if (g->n_weights > 0) {
        order = malloc ((size_t) g->n_weights * sizeof *order);
        if (!order) {
            kiln_error (err, KILN_ENOMEM, "out of memory");
            goto fail;
        }
        for (int i = 0; i < g->n_weights; i++)
            order[i] = i;
        qsort_r (order, (size_t) g->n_weights, sizeof *order, s_weight_cmp, (void *) g);
    }
    for (int i = 0; i < g->n_weights; i++) {
        const kiln_weight_t *w = &g->weights[order[i]];
        if (i > 0 && memcmp (g->weights[order[i - 1]].digest, w->digest, KILN_DIGEST_LEN) == 0)
            continue;
        if (kiln_msg_put_blob (msg, w->digest, w->data, w->size, err) != 0)
            goto fail;
    }
    free (order);
    free (structure);
    return msg;
fail:
    free (order);
    free (structure);
    kiln_msg_destroy (&msg);
    return NULL;
}

/* The farm's ERROR as our error: its code, its message, and as much of the
 * end of the compile log as fits. */
static int
s_remote_error (const kiln_msg_t *msg, kiln_err_t *err)
{
    int code = msg->code > 0 && msg->code < KILN_ERR_MAX ? (int) msg->code : KILN_EREMOTE;
    if (!msg->log || !*msg->log)
        return kiln_error (err, code, "%s", msg->message);
    size_t room = KILN_ERR_MSG_MAX / 2;
    size_t n = strlen (msg->log);
    const char *tail = n > room ? msg->log + n - room : msg->log;
    return kiln_error (err, code, "%s\n--- compile log%s ---\n%s", msg->message,
                       n > room ? " (end)" : "", tail);
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
    if ((rc = kiln_write_file_atomic (out_path, bytes, len, 0644, err)) != 0)
        goto done;
    memcpy (res->artifact, digest, KILN_HEX_LEN);
    res->cached = msg->cached;
    snprintf (res->worker, sizeof res->worker, "%s", msg->worker ? msg->worker : "");
done:
    kiln_artifact_destroy (&art);
    free (bytes);
    return rc;
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
    int timeout_ms = opts && opts->timeout_ms > 0 ? opts->timeout_ms : S_DEFAULT_TIMEOUT_MS;
    int64_t deadline = zclock_mono () + timeout_ms;
    char norm[KILN_MAX_ARGS_BYTES];
    if (kiln_args_normalize (opts ? opts->compiler_args : NULL, norm, sizeof norm, err) != 0)
        return -err->code;
    if (!kiln_graph_complete (g))
        return kiln_error (err, KILN_EINVAL, "the graph lacks the data of some weights");
    if (kiln_graph_digest (g, res->graph_digest, err) != 0)
        return -err->code;
    kiln_action_key (res->graph_digest, norm, KILN_COMPILER_ID, KILN_COMPILER_VERSION,
                     kiln_cc_target (), res->action_key);

    uint64_t req_id = self->next_req++;
    kiln_msg_t *msg = s_compile_msg (g, req_id, norm, res, err);
    if (!msg)
        return -err->code;
    zsock_set_sndtimeo (self->dealer, timeout_ms);
    if (kiln_msg_send (&msg, self->dealer, NULL, err) != 0)
        return kiln_error_prefix (err, "broker %s", self->endpoint);

    void *handle = zsock_resolve (self->dealer);
    while (true) {
        int64_t left = deadline - zclock_mono ();
        if (left <= 0)
            return kiln_error (err, KILN_ETIMEOUT, "no answer from the broker at %s within "
                               "%d s", self->endpoint, (timeout_ms + 999) / 1000);
        zmq_pollitem_t item = { handle, 0, ZMQ_POLLIN, 0 };
        int n = zmq_poll (&item, 1, (long) (left < S_POLL_MS ? left : S_POLL_MS));
        if (n < 0 && zmq_errno () != EINTR)
            return kiln_error (err, KILN_EIO, "waiting for the broker: %s",
                               zmq_strerror (zmq_errno ()));
        if (zsys_interrupted)
            return kiln_error (err, KILN_ECANCELED, "interrupted");
        if (n <= 0 || !(item.revents & ZMQ_POLLIN))
            continue;
        uint64_t got_req = 0;
        kiln_msg_t *reply = kiln_msg_recv (self->dealer, NULL, &got_req, err);
        if (!reply) {
            if (got_req != req_id)
                continue;          /* a broken leftover: not ours to fail on */
            return kiln_error_prefix (err, "reply from the broker");
        }
        int rc = 1;
        if (reply->req_id != req_id)
            rc = 1;                /* left over from an earlier request */
        else if (reply->cmd == KILN_CMD_ERROR)
            rc = s_remote_error (reply, err);
        else if (reply->cmd == KILN_CMD_RESULT)
            rc = s_take_result (reply, out_path, res, err);
        kiln_msg_destroy (&reply);
        if (rc <= 0)
            return rc;
    }
}
