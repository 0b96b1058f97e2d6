/*
 * kiln_download — stored artifacts sent to clients in chunks, under the
 * client's credit and a memory budget, read from the file as they go.
 */
#include "broker/kiln_download.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_hash.h"
#include "common/kiln_limits.h"
#include "common/kiln_log.h"
#include "common/kiln_proto.h"

#define S_DRAIN_MS 5000              /* destroy: wait this long for ZeroMQ's buffers */

typedef struct {
    uint64_t offset, len;            /* a member's data in the archive file */
    char hex[KILN_HEX_LEN];          /* its SHA-256 */
} s_held_t;

typedef struct {
    char *peer;                      /* the client's routing id in hex, owned */
    zframe_t *rid;                   /* its routing id, owned */
    uint64_t req_id;                 /* its GET */
    char hex[KILN_HEX_LEN];          /* the artifact's content hash */
    int fd;                          /* the stored archive, open */
    uint64_t size;                   /* its bytes */
    uint64_t sent;                   /* bytes sent so far (all in order) */
    uint64_t credit;                 /* chunks it may send now, at most the window */
    kiln_sha256_t *sha;              /* of the bytes sent */
    int64_t last_credit;             /* zclock_mono of the GET or the last CREDIT */
    /* Members the client holds (kiln_downloads_hold): each sent as one
     * PART that names the member, its bytes neither read nor hashed; such
     * a GET's last PART carries no file digest. */
    s_held_t *held;                  /* owned, n_held, by offset */
    size_t n_held, next_held;        /* the next held range at or after `sent` */
} s_download_t;

struct kiln_downloads {
    kiln_store_t *store;             /* the caller's */
    zsock_t *router;                 /* the caller's */
    uint64_t window;                 /* most credit one download holds */
    s_download_t *all[KILN_MAX_DOWNLOADS];   /* owned, n used, in no order */
    size_t n;
    size_t turn;                     /* index of the download whose turn is next */
    atomic_int in_zmq;               /* chunk buffers ZeroMQ holds */
    int efd;                         /* eventfd: there is sending to do */
    uint64_t served, bytes;
    uint64_t held_bytes;             /* bytes named by digest instead of sent */
};

static void
s_kick (kiln_downloads_t *self)
{
    uint64_t one = 1;
    ssize_t ignored = write (self->efd, &one, sizeof one);
    (void) ignored;
}

/* ZeroMQ is done with a chunk (on its I/O thread): free it, and wake the
 * loop if the budget was what stopped the sending. */
static void
s_chunk_free (void *data, void *hint)
{
    kiln_downloads_t *self = hint;
    free (data);
    if (atomic_fetch_sub (&self->in_zmq, 1) == KILN_MAX_DOWNLOAD_CHUNKS)
        s_kick (self);
}

static void
s_download_destroy (s_download_t **self_p)
{
    s_download_t *d = *self_p;
    if (!d)
        return;
    if (d->fd >= 0)
        close (d->fd);
    kiln_sha256_destroy (&d->sha);
    free (d->held);
    zframe_destroy (&d->rid);
    free (d->peer);
    free (d);
    *self_p = NULL;
}

/* Remove download i (the last takes its place). */
static void
s_remove (kiln_downloads_t *self, size_t i)
{
    s_download_destroy (&self->all[i]);
    self->all[i] = self->all[--self->n];
    self->all[self->n] = NULL;
    if (self->turn >= self->n)
        self->turn = 0;
}

static s_download_t *
s_find (const kiln_downloads_t *self, const char *peer_key, uint64_t req_id, size_t *index)
{
    for (size_t i = 0; i < self->n; i++)
        if (self->all[i]->req_id == req_id && strcmp (self->all[i]->peer, peer_key) == 0) {
            if (index)
                *index = i;
            return self->all[i];
        }
    return NULL;
}

kiln_downloads_t *
kiln_downloads_new (kiln_store_t *store, zsock_t *router, int window, kiln_err_t *err)
{
    if (window < 1 || window > KILN_PROTO_MAX_CREDIT) {
        kiln_error (err, KILN_EINVAL, "download window %d is outside 1..%d", window,
                    KILN_PROTO_MAX_CREDIT);
        return NULL;
    }
    kiln_downloads_t *self = calloc (1, sizeof *self);
    if (!self) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    self->store = store;
    self->router = router;
    self->window = (uint64_t) window;
    atomic_init (&self->in_zmq, 0);
    self->efd = eventfd (0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->efd < 0) {
        kiln_error (err, KILN_ESYS, "eventfd: %s", strerror (errno));
        free (self);
        return NULL;
    }
    return self;
}

void
kiln_downloads_destroy (kiln_downloads_t **self_p)
{
    kiln_downloads_t *self = self_p ? *self_p : NULL;
    if (!self)
        return;
    while (self->n > 0)
        s_remove (self, self->n - 1);
    /* ZeroMQ calls s_chunk_free with `self` for every buffer it still
     * holds: wait for it to let go.  Should it hang on to some, leaking
     * this small struct beats freeing it under the I/O thread. */
    int64_t until = zclock_mono () + S_DRAIN_MS;
    while (atomic_load (&self->in_zmq) > 0 && zclock_mono () < until)
        zclock_sleep (1);
    if (atomic_load (&self->in_zmq) > 0) {
        kiln_log_err ("downloads: ZeroMQ still holds %d chunks after %d ms",
                      atomic_load (&self->in_zmq), S_DRAIN_MS);
        *self_p = NULL;
        return;
    }
    close (self->efd);
    free (self);
    *self_p = NULL;
}

int
kiln_downloads_start (kiln_downloads_t *self, const char *peer_key, zframe_t *rid,
                      uint64_t req_id, const char *digest_hex, uint64_t credit,
                      kiln_err_t *err)
{
    if (credit == 0)
        return kiln_error (err, KILN_EPROTO, "GET of artifact %.12s with no credit: the "
                           "broker could send nothing", digest_hex);
    size_t again = 0;
    if (s_find (self, peer_key, req_id, &again))
        s_remove (self, again);            /* the client asks again: start over */
    size_t mine = 0;
    for (size_t i = 0; i < self->n; i++)
        mine += strcmp (self->all[i]->peer, peer_key) == 0;
    if (mine >= KILN_MAX_CLIENT_DOWNLOADS)
        return kiln_error (err, KILN_ELIMIT, "%d downloads of this client are in progress "
                           "already", KILN_MAX_CLIENT_DOWNLOADS);
    if (self->n >= KILN_MAX_DOWNLOADS)
        return kiln_error (err, KILN_ELIMIT, "the broker is serving %d downloads, all it "
                           "takes at once; try again shortly", KILN_MAX_DOWNLOADS);
    uint64_t size = 0;
    int fd = kiln_store_artifact_open (self->store, digest_hex, &size, err);
    if (fd < 0)
        return fd;
    if (size > KILN_MAX_ARTIFACT_BYTES) {
        close (fd);
        return kiln_error (err, KILN_ELIMIT, "stored artifact %s is %llu bytes, more than "
                           "%llu", digest_hex, (unsigned long long) size,
                           KILN_MAX_ARTIFACT_BYTES);
    }
    s_download_t *d = calloc (1, sizeof *d);
    if (!d || !(d->peer = strdup (peer_key)) || !(d->rid = zframe_dup (rid))
        || !(d->sha = kiln_sha256_new ())) {
        if (d)
            d->fd = -1;
        s_download_destroy (&d);
        close (fd);
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    d->fd = fd;
    d->req_id = req_id;
    memcpy (d->hex, digest_hex, KILN_HEX_LEN);
    d->size = size;
    d->credit = credit < self->window ? credit : self->window;
    d->last_credit = zclock_mono ();
    self->all[self->n++] = d;
    kiln_log_info ("GET %llu: sending artifact %.12s (%llu bytes), %llu chunks at a time",
                   (unsigned long long) req_id, digest_hex, (unsigned long long) size,
                   (unsigned long long) d->credit);
    s_kick (self);
    return 0;
}

static int
s_held_cmp (const void *a, const void *b)
{
    const s_held_t *x = a, *y = b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

uint64_t
kiln_downloads_hold (kiln_downloads_t *self, const char *peer_key, uint64_t req_id,
                     const kiln_blob_ref_t *have, size_t n_have)
{
    s_download_t *d = s_find (self, peer_key, req_id, NULL);
    if (!d || n_have == 0 || d->sent > 0)
        return 0;
    /* the headers only (the store wrote and checked the bytes; the
     * client checks every byte it ends up with) */
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_artifact_read_fd (d->fd, d->hex, KILN_ARTIFACT_SKIM, &err);
    if (!art) {
        kiln_log_warn ("GET %llu: sending artifact %.12s whole: %s",
                       (unsigned long long) req_id, d->hex, err.msg);
        return 0;
    }
    int n = kiln_artifact_member_count (art);
    d->held = calloc ((size_t) (n > 0 ? n : 1), sizeof *d->held);
    uint64_t bytes = 0;
    for (int i = 0; d->held && i < n; i++) {
        s_held_t h;
        if (kiln_artifact_member_span (art, i, &h.offset, &h.len, h.hex) != 0 || h.len == 0
            || h.offset % 512 != 0 || h.offset >= d->size || h.len >= d->size - h.offset)
            continue;                      /* not a tar data range; the end is never one */
        uint8_t digest[KILN_DIGEST_LEN];
        kiln_unhex (h.hex, digest, KILN_DIGEST_LEN);
        for (size_t k = 0; k < n_have; k++)
            if (memcmp (have[k].digest, digest, KILN_DIGEST_LEN) == 0) {
                d->held[d->n_held++] = h;
                bytes += h.len;
                break;
            }
    }
    kiln_artifact_destroy (&art);
    qsort (d->held, d->n_held, sizeof *d->held, s_held_cmp);
    if (d->n_held)
        kiln_log_info ("GET %llu: the client holds %zu member%s of artifact %.12s (%llu "
                       "bytes): sent by digest", (unsigned long long) req_id, d->n_held,
                       d->n_held == 1 ? "" : "s", d->hex, (unsigned long long) bytes);
    return bytes;
}

bool
kiln_downloads_credit (kiln_downloads_t *self, const char *peer_key, uint64_t req_id,
                       uint64_t credit)
{
    s_download_t *d = s_find (self, peer_key, req_id, NULL);
    if (!d)
        return false;
    d->credit = credit >= self->window - d->credit ? self->window : d->credit + credit;
    d->last_credit = zclock_mono ();
    s_kick (self);
    return true;
}

bool
kiln_downloads_cancel (kiln_downloads_t *self, const char *peer_key, uint64_t req_id)
{
    size_t i = 0;
    if (!s_find (self, peer_key, req_id, &i))
        return false;
    kiln_log_info ("GET %llu: canceled by its client after %llu of %llu bytes",
                   (unsigned long long) req_id, (unsigned long long) self->all[i]->sent,
                   (unsigned long long) self->all[i]->size);
    s_remove (self, i);
    return true;
}

bool
kiln_downloads_has_peer (const kiln_downloads_t *self, const char *peer_key)
{
    for (size_t i = 0; i < self->n; i++)
        if (strcmp (self->all[i]->peer, peer_key) == 0)
            return true;
    return false;
}

void
kiln_downloads_drop_peer (kiln_downloads_t *self, const char *peer_key)
{
    for (size_t i = 0; i < self->n;)
        if (strcmp (self->all[i]->peer, peer_key) == 0)
            s_remove (self, i);
        else
            i++;
}

void
kiln_downloads_expire (kiln_downloads_t *self, int64_t now)
{
    for (size_t i = 0; i < self->n;) {
        s_download_t *d = self->all[i];
        if (d->credit == 0 && now - d->last_credit > KILN_DOWNLOADS_IDLE_MS) {
            kiln_log_warn ("GET %llu of artifact %.12s: no credit from its client for %d s; "
                           "dropped", (unsigned long long) d->req_id, d->hex,
                           KILN_DOWNLOADS_IDLE_MS / 1000);
            s_remove (self, i);
        }
        else
            i++;
    }
}

int
kiln_downloads_fd (const kiln_downloads_t *self)
{
    return self->efd;
}

/* Tell the client its download failed, now (it is not a reply the
 * store's commit could hold up). */
static void
s_fail (kiln_downloads_t *self, s_download_t *d, int code, const char *message)
{
    kiln_log_err ("GET %llu of artifact %.12s: %s", (unsigned long long) d->req_id, d->hex,
                  message);
    kiln_msg_t *e = kiln_msg_new (KILN_CMD_ERROR);
    kiln_err_t err = { 0 };
    if (e) {
        e->req_id = d->req_id;
        if (kiln_msg_set_error (e, code, message, NULL) == 0)
            kiln_msg_send (&e, self->router, d->rid, &err);
        kiln_msg_destroy (&e);
    }
}

/* Read n bytes at d->sent into buf; false (the client told) on failure. */
static bool
s_read_at (kiln_downloads_t *self, s_download_t *d, uint8_t *buf, uint64_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t k = pread (d->fd, buf + got, (size_t) n - got, (off_t) (d->sent + got));
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            char text[160];
            snprintf (text, sizeof text, "the broker could not read its stored copy at "
                      "offset %llu: %s", (unsigned long long) (d->sent + got),
                      k < 0 ? strerror (errno) : "the file is shorter than it was");
            s_fail (self, d, KILN_EIO, text);
            return false;
        }
        got += (size_t) k;
    }
    return true;
}

/* The PART of `d` at d->sent, or NULL (the client told). */
static kiln_msg_t *
s_part_new (kiln_downloads_t *self, s_download_t *d)
{
    kiln_msg_t *part = kiln_msg_new (KILN_CMD_PART);
    if (!part) {
        s_fail (self, d, KILN_ENOMEM, "the broker is out of memory");
        return NULL;
    }
    part->req_id = d->req_id;
    memcpy (part->artifact, d->hex, KILN_HEX_LEN);
    part->artifact_size = d->size;
    part->offset = d->sent;
    return part;
}

/* Send `part` to d's client.  A send fails only when the client is gone
 * or its queue holds 100000 messages: either way this download is over
 * (a client that is still there and hears nothing more asks again). */
static bool
s_part_send (kiln_downloads_t *self, s_download_t *d, kiln_msg_t **part)
{
    kiln_err_t err = { 0 };
    if (kiln_msg_send (part, self->router, d->rid, &err) != 0) {
        kiln_log_warn ("GET %llu of artifact %.12s: %s; dropped",
                       (unsigned long long) d->req_id, d->hex, err.msg);
        return false;
    }
    return true;
}

/* A held member: one PART that names it (one credit), and nothing of
 * its bytes: they are neither read nor sent.  True while the download
 * goes on. */
static bool
s_send_held (kiln_downloads_t *self, s_download_t *d)
{
    const s_held_t *h = &d->held[d->next_held];
    kiln_msg_t *part = s_part_new (self, d);
    if (!part)
        return false;
    part->length = h->len;
    memcpy (part->member, h->hex, KILN_HEX_LEN);
    if (!s_part_send (self, d, &part))
        return false;
    d->credit--;
    d->sent += h->len;
    d->next_held++;
    self->held_bytes += h->len;
    return true;
}

/* Send the next chunk of `d`.  True while the download goes on; false
 * when it is over (finished, or failed: the client was told when it
 * could be), and the caller removes it. */
static bool
s_send_next (kiln_downloads_t *self, s_download_t *d)
{
    kiln_err_t err = { 0 };
    if (d->next_held < d->n_held && d->held[d->next_held].offset == d->sent)
        return s_send_held (self, d);
    uint64_t n = d->size - d->sent < KILN_CHUNK_BYTES ? d->size - d->sent : KILN_CHUNK_BYTES;
    if (d->next_held < d->n_held && d->held[d->next_held].offset - d->sent < n)
        n = d->held[d->next_held].offset - d->sent;     /* up to the held member */
    uint8_t *buf = n ? malloc ((size_t) n) : NULL;
    if (n && !buf) {
        s_fail (self, d, KILN_ENOMEM, "the broker is out of memory");
        return false;
    }
    if (!s_read_at (self, d, buf, n)) {
        free (buf);
        return false;
    }
    kiln_msg_t *part = s_part_new (self, d);
    if (!part) {
        free (buf);
        return false;
    }
    if (d->n_held)
        part->length = n;                  /* offsets leave the 1 MiB grid */
    /* Hashed before it is sent: once sent, the buffer is ZeroMQ's.  A
     * GET that holds members gets no file digest (the held bytes are not
     * read): its client checks every member against the manifest. */
    if (!d->n_held)
        kiln_sha256_update (d->sha, buf, (size_t) n);
    bool last = d->sent + n == d->size;
    if (last && !d->n_held) {
        uint8_t digest[KILN_DIGEST_LEN];
        kiln_sha256_final (&d->sha, digest);
        kiln_hex (digest, KILN_DIGEST_LEN, part->digest);
    }
    if (n) {
        atomic_fetch_add (&self->in_zmq, 1);
        if (kiln_msg_put_chunk_ref (part, buf, (size_t) n, s_chunk_free, self, &err) != 0) {
            atomic_fetch_sub (&self->in_zmq, 1);
            free (buf);
            kiln_msg_destroy (&part);
            s_fail (self, d, err.code, err.msg);
            return false;
        }
    }
    /* The message (then ZeroMQ) owns buf now; s_chunk_free releases it. */
    if (!s_part_send (self, d, &part))
        return false;
    d->sent += n;
    d->credit--;
    self->bytes += n;
    if (last) {
        self->served++;
        kiln_log_info ("GET %llu: artifact %.12s sent (%llu bytes)",
                       (unsigned long long) d->req_id, d->hex, (unsigned long long) d->size);
        return false;
    }
    return true;
}

void
kiln_downloads_pump (kiln_downloads_t *self, int max_chunks)
{
    uint64_t count;
    ssize_t ignored = read (self->efd, &count, sizeof count);
    (void) ignored;
    for (int sent = 0; sent < max_chunks; sent++) {
        if (atomic_load (&self->in_zmq) >= KILN_MAX_DOWNLOAD_CHUNKS)
            return;                        /* s_chunk_free wakes us */
        /* the next download, from `turn` on, that has credit */
        size_t k = 0;
        while (k < self->n && self->all[(self->turn + k) % self->n]->credit == 0)
            k++;
        if (k == self->n)
            return;                        /* nothing may go: a CREDIT wakes us */
        size_t i = (self->turn + k) % self->n;
        if (s_send_next (self, self->all[i]))
            self->turn = (i + 1) % self->n;
        else
            s_remove (self, i);            /* the last took slot i: its turn is next */
    }
    /* stopped by `max_chunks`: come back after the loop's other work */
    for (size_t i = 0; i < self->n; i++)
        if (self->all[i]->credit > 0) {
            s_kick (self);
            break;
        }
}

void
kiln_downloads_stats (const kiln_downloads_t *self, kiln_downloads_stats_t *out)
{
    out->in_progress = self->n;
    out->served = self->served;
    out->bytes = self->bytes;
    out->held_bytes = self->held_bytes;
}
