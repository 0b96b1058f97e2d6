/*
 * kiln_broker_artifacts — artifacts by content hash: GET (sent in PARTs
 * under the client's credit by kiln_download), a GET's CREDIT, and PIN and
 * UNPIN, which keep an artifact from eviction (docs/operations.md).
 */
#include "broker/kiln_broker_priv.h"

#include <string.h>

#include <czmq.h>

#include "common/kiln_log.h"

/* GET: send a stored artifact in PARTs (kiln_download), or say why not. */
void
broker_on_get (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    zframe_t *rid = from->rid;
    broker_client_t *c = from->client;
    kiln_err_t err = { 0 };
    if (kiln_downloads_start (self->downloads, c->key, rid, msg->req_id, msg->artifact,
                              msg->credit, &err) == 0) {
        kiln_downloads_hold (self->downloads, c->key, msg->req_id, msg->have, msg->n_have);
        return;
    }
    char text[KILN_ERR_MSG_MAX];
    if (err.code == KILN_ENOTFOUND) {
        broker_fmt (text, sizeof text, "the farm holds no artifact %s", msg->artifact);
        kiln_log_info ("GET %llu from %s: %s", (unsigned long long) msg->req_id, c->tenant,
                       text);
    }
    else {
        broker_fmt (text, sizeof text, "%s", err.msg);
        kiln_log_warn ("GET %llu from %s refused: %s", (unsigned long long) msg->req_id,
                       c->tenant, text);
    }
    broker_post_error (self, rid, msg->req_id, 0, err.code, text, NULL);
}

/* CREDIT from a client: more chunks of one of its GETs. */
void
broker_on_client_credit (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    broker_client_t *c = from->client;
    if (!kiln_downloads_credit (self->downloads, c->key, msg->req_id, msg->credit))
        kiln_log_debug ("client %s: CREDIT for GET %llu, which is over; ignored", c->tenant,
                        (unsigned long long) msg->req_id);
}

/* PIN, UNPIN: keep an artifact from eviction (docs/operations.md), or
 * stop.  Answered by PINNED with the pin as it is now. */
void
broker_on_pin (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    zframe_t *rid = from->rid;
    broker_client_t *c = from->client;
    bool pin = msg->cmd == KILN_CMD_PIN, changed = false;
    kiln_err_t err = { 0 };
    int rc = pin ? kiln_store_pin (self->store, msg->artifact, &changed, &err)
                 : kiln_store_unpin (self->store, msg->artifact, &changed, &err);
    if (rc != 0) {
        char text[KILN_ERR_MSG_MAX];
        broker_fmt (text, sizeof text, "%s", err.msg);
        if (rc == -KILN_ENOTFOUND)
            broker_fmt (text, sizeof text, "the farm holds no artifact %s", msg->artifact);
        kiln_log_warn ("client %s: %s of artifact %.*s refused: %s", c->tenant,
                       kiln_cmd_name (msg->cmd), BROKER_KEY_SHORT, msg->artifact, text);
        broker_post_error (self, rid, msg->req_id, 0, -rc, text, NULL);
        return;
    }
    if (changed) {
        kiln_store_stats_t st;
        kiln_store_stats (self->store, &st);
        kiln_log_notice ("client %s %s artifact %s (%llu pinned, %llu of %llu bytes)",
                         c->tenant, pin ? "pinned" : "unpinned", msg->artifact,
                         (unsigned long long) st.pinned, (unsigned long long) st.pinned_bytes,
                         (unsigned long long) st.max_bytes);
    }
    kiln_msg_t *reply = kiln_msg_new (KILN_CMD_PINNED);
    if (!reply)
        return;
    reply->req_id = msg->req_id;
    memcpy (reply->artifact, msg->artifact, KILN_HEX_LEN);
    reply->pinned = pin;
    reply->changed = changed;
    broker_post (self, rid, &reply);
}

/* The downloads have sending to do: a few chunks, then the loop goes on. */
int
broker_on_downloads (zloop_t *loop, zmq_pollitem_t *item, void *arg)
{
    kiln_broker_t *self = arg;
    kiln_downloads_pump (self->downloads, BROKER_PUMP_CHUNKS);
    return 0;
}
