/*
 * kiln_broker_upload — the upload path: FIND (which blobs the store
 * lacks), blob CHUNKs from clients under credit flow control, and the
 * news of the store's blob writers (kiln_store_upload.c), which hash and
 * write each upload on threads of their own.
 *
 * Invariants: a client sends a CHUNK only with credit (credit_out), and
 * the credit comes back (credit_owed, then CREDIT) as the writer lets go
 * of the chunks, so an upload holds at most the credit window in memory;
 * a blob is visible and confirmed (CREDIT with its digest) only once
 * checked against its digest and on disk; `uploads` counts the uploads in
 * progress over all clients, at most --max-uploads (each has two threads
 * and a preallocated file, whose announced size the store reserves under
 * its cap).  An upload that finds no room (the broker-wide limit, or the
 * store's cap held by other uploads) takes the place of one that has
 * stalled (no chunk for BROKER_UPLOAD_STALL_MS), else it is refused EBUSY
 * and the client sends it again later; the chunks of a refused upload that
 * were already on their way are dropped quietly, with their credit.
 */
#include "broker/kiln_broker_priv.h"

#include <stdlib.h>
#include <string.h>

#include <czmq.h>

#include "common/kiln_log.h"

void
broker_upload_destroy (broker_upload_t **self_p)
{
    if (!*self_p)
        return;
    broker_upload_t *up = *self_p;
    /* chunks the writer still held: the client may send as many again */
    up->client->credit_owed += (uint32_t) (up->pushed - up->credited);
    kiln_blob_writer_abort (&up->writer);
    free (*self_p);
    *self_p = NULL;
}

/* FIND: which of these blobs are not stored (REAPI's FindMissingBlobs). */
void
broker_on_find (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    zframe_t *rid = from->rid;
    broker_client_t *c = from->client;
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
    broker_post (self, rid, &missing);
}

/* Return the credit this client has used, with the news of a stored blob.
 * Sent at once, not held for the batch's commit: credit is about memory,
 * not durability (a stored blob was fsynced already), and an upload
 * stalls while its credit waits. */
static void
s_post_credit (kiln_broker_t *self, broker_client_t *c, const char *stored_hex)
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
    broker_send_now (self, c->rid, &credit, c->tenant);
}

/* Return credit in batches of a quarter window, or at once when the
 * client has none left to send with. */
static void
s_post_credit_due (kiln_broker_t *self, broker_client_t *c)
{
    if (c->credit_owed > 0
        && (c->credit_owed >= (uint32_t) self->cfg.credit_window / 4 || c->credit_out == 0))
        s_post_credit (self, c, NULL);
}

static void s_upload_failed (kiln_broker_t *self, broker_client_t *c, const char *hex,
                             const kiln_err_t *err);

/* Remember that client c's upload of `hex` was refused busy: the chunks it
 * sent after the first are dropped without a word, until it starts over. */
static void
s_refuse (broker_client_t *c, const char *hex)
{
    if (zhashx_size (c->refused) >= BROKER_MAX_REFUSED)
        zhashx_purge (c->refused);
    zhashx_update (c->refused, hex, c);
}

/* Make room for a new upload by dropping the one that has stalled longest
 * (no chunk for BROKER_UPLOAD_STALL_MS), of any client: its client is told
 * EBUSY and may send it again.  False when none has stalled. */
static bool
s_preempt_stalled (kiln_broker_t *self)
{
    int64_t now = zclock_mono ();
    broker_upload_t *oldest = NULL;
    for (broker_client_t *o = zhashx_first (self->clients); o; o = zhashx_next (self->clients))
        for (broker_upload_t *up = zhashx_first (o->uploads); up; up = zhashx_next (o->uploads))
            if (!up->closed && now - up->last_chunk > BROKER_UPLOAD_STALL_MS
                && (!oldest || up->last_chunk < oldest->last_chunk))
                oldest = up;
    if (!oldest)
        return false;
    broker_client_t *c = oldest->client;
    char hex[KILN_HEX_LEN];
    memcpy (hex, oldest->hex, KILN_HEX_LEN);
    kiln_err_t err = { 0 };
    kiln_error (&err, KILN_EBUSY, "upload of blob %.12s dropped: no chunk for %lld ms while "
                "other uploads waited for room; send it again", hex,
                (long long) (now - oldest->last_chunk));
    zhashx_delete (c->uploads, hex);         /* frees it: aborts its writer, unreserves */
    self->uploads--;
    s_refuse (c, hex);
    s_upload_failed (self, c, hex, &err);
    return true;
}

/* A writer for a new upload, within the broker-wide limit and the store's
 * cap, taking a stalled upload's place when there is no room. */
static kiln_blob_writer_t *
s_begin (kiln_broker_t *self, broker_upload_t *up, const kiln_msg_t *msg, kiln_err_t *err)
{
    uint8_t digest[KILN_DIGEST_LEN];
    kiln_unhex (msg->digest, digest, KILN_DIGEST_LEN);
    if (self->uploads >= (uint64_t) self->cfg.max_uploads && !s_preempt_stalled (self)) {
        kiln_error (err, KILN_EBUSY, "the broker has %llu uploads in progress, its limit "
                    "(--max-uploads %d); send blob %.12s again later",
                    (unsigned long long) self->uploads, self->cfg.max_uploads, msg->digest);
        return NULL;
    }
    for (;;) {
        kiln_err_t e = { 0 };
        kiln_blob_writer_t *w = kiln_store_blob_begin (self->store, digest, msg->blob_size,
                                                       (size_t) self->cfg.credit_window, up,
                                                       &e);
        if (w || e.code != KILN_EBUSY || !s_preempt_stalled (self)) {
            *err = e;
            return w;
        }
    }
}

/* A chunk of a blob upload. */
void
broker_on_chunk (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    broker_client_t *c = from->client;
    kiln_err_t err = { 0 };
    if (c->credit_out == 0) {
        kiln_log_warn ("client %s: CHUNK of blob %.*s without credit; refused", c->tenant,
                       BROKER_KEY_SHORT, msg->digest);
        kiln_msg_t *e = kiln_msg_new (KILN_CMD_ERROR);
        if (e) {
            memcpy (e->digest, msg->digest, KILN_HEX_LEN);
            if (kiln_msg_set_error (e, KILN_EPROTO, "CHUNK sent without credit", NULL) == 0)
                broker_post (self, c->rid, &e);
            kiln_msg_destroy (&e);
        }
        return;
    }
    c->credit_out--;
    bool held = false;                   /* the writer holds the chunk */
    broker_upload_t *up = zhashx_lookup (c->uploads, msg->digest);
    if (up && msg->offset == 0) {
        /* The client starts this blob over (it resent its requests). */
        zhashx_delete (c->uploads, msg->digest);
        self->uploads--;
        up = NULL;
    }
    if (!up) {
        if (msg->offset != 0 && zhashx_lookup (c->refused, msg->digest)) {
            /* on its way before the client heard that its upload was refused */
            c->credit_owed++;
            s_post_credit_due (self, c);
            return;
        }
        zhashx_delete (c->refused, msg->digest);
        if (msg->offset != 0) {
            kiln_error (&err, KILN_EPROTO, "upload of blob %s: chunk at offset %llu without "
                        "the chunks before it", msg->digest, (unsigned long long) msg->offset);
            goto fail;
        }
        if (zhashx_size (c->uploads) >= BROKER_MAX_UPLOADS) {
            kiln_error (&err, KILN_EBUSY, "more than %d uploads at once from one client; "
                        "send blob %.12s again later", BROKER_MAX_UPLOADS, msg->digest);
            goto fail;
        }
        up = calloc (1, sizeof *up);
        if (up)
            up->client = c;
        if (!up || !(up->writer = s_begin (self, up, msg, &err))) {
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
    if (err.code == KILN_EBUSY)
        s_refuse (c, msg->digest);
    s_upload_failed (self, c, msg->digest, &err);
}

/* Tell the client its upload of blob `hex` failed, with its credit back. */
static void
s_upload_failed (kiln_broker_t *self, broker_client_t *c, const char *hex, const kiln_err_t *err)
{
    kiln_log_warn ("client %s: %s", c->tenant, err->msg);
    s_post_credit (self, c, NULL);
    kiln_msg_t *e = kiln_msg_new (KILN_CMD_ERROR);
    if (e) {
        memcpy (e->digest, hex, KILN_HEX_LEN);
        if (kiln_msg_set_error (e, err->code, err->msg, NULL) == 0)
            broker_post (self, c->rid, &e);
        kiln_msg_destroy (&e);
    }
}

/* A blob writer let go of chunks, or is through: credit the client again,
 * and once the blob is checked and on disk, make it visible and say so. */
static void
s_on_upload_news (kiln_blob_writer_t *writer, void *tag, void *arg)
{
    kiln_broker_t *self = arg;
    broker_upload_t *up = tag;
    broker_client_t *c = up->client;
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
        kiln_log_info ("client %s: blob %.*s stored (%llu bytes)", c->tenant, BROKER_KEY_SHORT,
                       hex, (unsigned long long) size);
        s_post_credit (self, c, hex);
        return;
    }
    s_post_credit_due (self, c);
}

int
broker_on_uploads (zloop_t *loop, zmq_pollitem_t *item, void *arg)
{
    kiln_broker_t *self = arg;
    kiln_store_upload_poll (self->store, s_on_upload_news, self);
    return 0;
}
