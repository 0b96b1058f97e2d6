/*
 * kiln_client_store — the farm's store and state from a client: fetch an
 * artifact by its content hash (GET), pin and unpin one (PIN, UNPIN), ask
 * for the broker's state (STATUS).
 *
 * A GET is answered by PARTs, 1 MiB each, in order, under the credit this
 * client grants (docs/protocol.md): it grants a window of chunks, writes
 * each chunk to a temporary file beside the target as it comes (a thread
 * of the call's own hashes the chunks beside the writes, so that the
 * file's digest costs no time of its own), and gives the credit back a
 * quarter window at a time.  Only when
 * the whole file is there, hashes to what the broker says it sent, opens
 * as an archive whose members all match its manifest and has the content
 * hash asked for, is it renamed into place.  A broker that goes silent,
 * restarts or stops sending is asked again, from the start, a bounded
 * number of times.
 */
#include "client/kiln_client.h"
#include "client/kiln_client_priv.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "artifact/kiln_artifact.h"
#include "client/kiln_member_cache.h"
#include "common/kiln_fs.h"
#include "common/kiln_hash.h"
#include "common/kiln_limits.h"
#include "common/kiln_log.h"

#define S_GET_WINDOW     32           /* chunks granted to the broker at once */
#define S_GET_ATTEMPTS   5            /* GETs sent for one call (the first and resends) */
#define S_HASH_RING      10           /* chunks waiting for the hasher, at most */
#define S_FILL_STEP      16           /* chunks copied from the member cache per turn */

/* --- one request, one reply ---------------------------------------------------- */

/* Send `msg` (its req_id set here) and wait for the reply to it: a
 * message of command `want` or an ERROR (returned as the error).  Caller
 * owns *reply. */
static int
s_request (kiln_client_t *self, kiln_msg_t **msg, kiln_cmd_t want, int wait_ms,
           kiln_msg_t **reply, kiln_err_t *err)
{
    *reply = NULL;
    int wait = wait_ms > 0 ? wait_ms : 10000;
    if (!self->dealer && kiln_client_connect (self, err) != 0) {
        kiln_msg_destroy (msg);
        return -err->code;
    }
    const char *name = kiln_cmd_name ((*msg)->cmd);
    uint64_t req_id = self->next_req++;
    (*msg)->req_id = req_id;
    int ready = kiln_client_writable (self, wait, err);
    if (ready != 0) {
        kiln_msg_destroy (msg);
        return ready;
    }
    if (kiln_client_send (self, msg, wait, err) != 0)
        return -err->code;
    int64_t deadline = zclock_mono () + wait;
    while (true) {
        int64_t left = deadline - zclock_mono ();
        if (left <= 0)
            return kiln_error (err, KILN_EUNREACHABLE, "no answer from the broker at %s "
                               "within %g s", self->endpoint, wait / 1000.0);
        if (zsys_interrupted)
            return kiln_error (err, KILN_ECANCELED, "interrupted");
        zmq_pollitem_t items[2] = {
            { zsock_resolve (self->dealer), 0, ZMQ_POLLIN, 0 },
            { self->monitor ? zsock_resolve (self->monitor) : NULL, 0, ZMQ_POLLIN, 0 },
        };
        int n = zmq_poll (items, self->monitor ? 2 : 1,
                          (long) (left < KILN_CLIENT_MAX_POLL_MS ? left
                                                                 : KILN_CLIENT_MAX_POLL_MS));
        if (n <= 0)
            continue;
        if (self->monitor && (items[1].revents & ZMQ_POLLIN) && kiln_client_refused (self, err))
            return -err->code;
        if (!(items[0].revents & ZMQ_POLLIN))
            continue;
        kiln_err_t rerr = { 0 };
        kiln_msg_t *got = kiln_msg_recv (self->dealer, NULL, NULL, &rerr);
        if (!got || got->req_id != req_id) {
            kiln_msg_destroy (&got);
            continue;
        }
        if (got->cmd == want) {
            *reply = got;
            return 0;
        }
        int rc;
        if (got->cmd == KILN_CMD_ERROR) {
            kiln_client_remote_error (got, err);
            rc = -err->code;
        }
        else
            rc = kiln_error (err, KILN_EPROTO, "the broker answered %s with %s", name,
                             kiln_cmd_name (got->cmd));
        kiln_msg_destroy (&got);
        return rc;
    }
}

int
kiln_client_status (kiln_client_t *self, int wait_ms, char **json, kiln_err_t *err)
{
    *json = NULL;
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_STATUS), *reply = NULL;
    if (!msg)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    int rc = s_request (self, &msg, KILN_CMD_REPORT, wait_ms, &reply, err);
    if (rc != 0)
        return rc;
    *json = reply->report;
    reply->report = NULL;
    kiln_msg_destroy (&reply);
    return 0;
}

int
kiln_client_ping (kiln_client_t *self, int wait_ms, kiln_err_t *err)
{
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_PING), *reply = NULL;
    if (!msg)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    int rc = s_request (self, &msg, KILN_CMD_PONG, wait_ms, &reply, err);
    kiln_msg_destroy (&reply);
    return rc;
}

int
kiln_client_farm_key (kiln_client_t *self, int wait_ms, char **pem,
                      char key_id[KILN_KEY_ID_LEN], char curve_public[41], kiln_err_t *err)
{
    *pem = NULL;
    key_id[0] = curve_public[0] = '\0';
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_KEY), *reply = NULL;
    if (!msg)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    int rc = s_request (self, &msg, KILN_CMD_PUBKEY, wait_ms, &reply, err);
    if (rc != 0)
        return rc;
    snprintf (key_id, KILN_KEY_ID_LEN, "%s", reply->key_id);
    snprintf (curve_public, 41, "%s", reply->curve_public ? reply->curve_public : "");
    *pem = reply->public_key;
    reply->public_key = NULL;
    kiln_msg_destroy (&reply);
    return 0;
}

int
kiln_client_pin (kiln_client_t *self, const char *digest_hex, bool pin, int wait_ms,
                 bool *changed, kiln_err_t *err)
{
    if (changed)
        *changed = false;
    if (!digest_hex || !kiln_is_digest_hex (digest_hex))
        return kiln_error (err, KILN_EINVAL, "'%.80s' is not an artifact's content hash "
                           "(64 hex characters)", digest_hex ? digest_hex : "");
    kiln_msg_t *msg = kiln_msg_new (pin ? KILN_CMD_PIN : KILN_CMD_UNPIN), *reply = NULL;
    if (!msg)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    memcpy (msg->artifact, digest_hex, KILN_HEX_LEN);
    int rc = s_request (self, &msg, KILN_CMD_PINNED, wait_ms, &reply, err);
    if (rc == -KILN_ENOTFOUND)
        return kiln_error (err, KILN_ENOTFOUND, "the farm at %s holds no artifact %s",
                           self->endpoint, digest_hex);
    if (rc != 0)
        return rc;
    if (strcmp (reply->artifact, digest_hex) != 0 || reply->pinned != pin) {
        kiln_msg_destroy (&reply);
        return kiln_error (err, KILN_EPROTO, "the broker answered %s of artifact %.12s for "
                           "another artifact or state", pin ? "PIN" : "UNPIN", digest_hex);
    }
    if (changed)
        *changed = reply->changed;
    kiln_msg_destroy (&reply);
    return 0;
}

/* --- GET ----------------------------------------------------------------------- */

/* The file's digest, taken on a thread beside the writes: the receiving
 * loop hands each chunk's frame over once written (no copy) and goes on;
 * it waits only when S_HASH_RING chunks are waiting. */
typedef struct {
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t work, room;
    zframe_t *ring[S_HASH_RING];     /* chunk i at ring[i % S_HASH_RING], under mu */
    uint64_t pushed, popped;         /* under mu */
    bool closing, abort;             /* under mu */
    kiln_sha256_t *sha;              /* the thread's while it runs */
} s_hasher_t;

static void *
s_hasher_main (void *arg)
{
    s_hasher_t *h = arg;
    while (true) {
        pthread_mutex_lock (&h->mu);
        while (h->popped == h->pushed && !h->closing && !h->abort)
            pthread_cond_wait (&h->work, &h->mu);
        if (h->abort || h->popped == h->pushed) {
            pthread_mutex_unlock (&h->mu);
            break;
        }
        zframe_t *frame = h->ring[h->popped % S_HASH_RING];
        pthread_mutex_unlock (&h->mu);
        kiln_sha256_update (h->sha, zframe_data (frame), zframe_size (frame));
        pthread_mutex_lock (&h->mu);
        zframe_destroy (&h->ring[h->popped % S_HASH_RING]);
        h->popped++;
        pthread_cond_signal (&h->room);
        pthread_mutex_unlock (&h->mu);
    }
    return NULL;
}

/* Stop the hasher: once it has hashed everything handed over, or at
 * once (`abort`); the frames it did not take are freed. */
static void
s_hasher_stop (s_hasher_t *h, bool abort)
{
    if (!h->started)
        return;
    pthread_mutex_lock (&h->mu);
    h->closing = true;
    h->abort = h->abort || abort;
    pthread_cond_signal (&h->work);
    pthread_mutex_unlock (&h->mu);
    pthread_join (h->thread, NULL);
    h->started = false;
    while (h->popped < h->pushed)
        zframe_destroy (&h->ring[h->popped++ % S_HASH_RING]);
}

/* A new digest from the first byte, on a new thread. */
static int
s_hasher_start (s_hasher_t *h, kiln_err_t *err)
{
    s_hasher_stop (h, true);
    kiln_sha256_destroy (&h->sha);
    h->pushed = h->popped = 0;
    h->closing = h->abort = false;
    if (!(h->sha = kiln_sha256_new ()))
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    if (pthread_create (&h->thread, NULL, s_hasher_main, h) != 0)
        return kiln_error (err, KILN_ESYS, "could not start a thread to hash the artifact");
    h->started = true;
    return 0;
}

/* Hand a written chunk over (the hasher owns it then). */
static void
s_hasher_push (s_hasher_t *h, zframe_t **frame_p)
{
    pthread_mutex_lock (&h->mu);
    while (h->pushed - h->popped >= S_HASH_RING)
        pthread_cond_wait (&h->room, &h->mu);
    h->ring[h->pushed++ % S_HASH_RING] = *frame_p;
    *frame_p = NULL;
    pthread_cond_signal (&h->work);
    pthread_mutex_unlock (&h->mu);
}

/* One call of kiln_client_get. */
typedef struct {
    kiln_client_t *self;
    char digest[KILN_HEX_LEN];       /* the content hash asked for */
    char tmp[PATH_MAX];              /* the file being written */
    int fd;
    uint64_t req_id;                 /* of the GET now in flight */
    int attempts;                    /* GETs sent */
    bool have_size;                  /* a PART said how big it is */
    uint64_t size;                   /* the archive's bytes */
    uint64_t received;               /* bytes written, all in order */
    uint32_t owed;                   /* chunks taken, credit not given back yet */
    s_hasher_t hash;                 /* of the bytes written */
    char file_sha[KILN_HEX_LEN];     /* its digest, once complete ("" when members
                                        came from the cache: not taken) */
    bool no_digest;                  /* a cached member is in: no file digest */
    bool complete;
    int64_t progress;                /* zclock_mono of the GET or the last PART */
    /* the member cache (NULL: off), what this call says it holds */
    kiln_mcache_t *cache;
    bool use_cache;                  /* send `have` (false after a cached member failed) */
    kiln_blob_ref_t have[KILN_PROTO_MAX_HAVE];
    size_t n_have;
    char used[KILN_MAX_MEMBERS][KILN_HEX_LEN];   /* entries taken this attempt */
    size_t n_used;
    int fill_fd;                     /* >= 0: copying a cached member into place */
    uint64_t fill_start, fill_end;   /* its range of the file */
    uint64_t wire;                   /* bytes received in PARTs, all attempts */
    uint64_t reused;                 /* bytes taken from the cache, this attempt */
    bool refetched;
} s_get_t;

/* Send GET from the start: a new request id (PARTs of an older one are
 * ignored), the file emptied. */
static int
s_get_send (s_get_t *g, const char *why, kiln_err_t *err)
{
    kiln_client_t *self = g->self;
    if (g->attempts >= S_GET_ATTEMPTS)
        return kiln_error (err, KILN_EREMOTE, "gave up fetching artifact %s from %s after %d "
                           "attempts (%s)", g->digest, self->endpoint, S_GET_ATTEMPTS, why);
    if (g->attempts > 0) {
        kiln_log_info ("GET of artifact %.12s: asking again from the start: %s", g->digest,
                       why);
        self->stats.resent++;
    }
    g->attempts++;
    g->have_size = g->complete = false;
    g->size = g->received = 0;
    g->owed = 0;
    g->n_used = 0;
    g->reused = 0;
    g->no_digest = false;
    g->file_sha[0] = '\0';
    if (g->fill_fd >= 0)
        close (g->fill_fd);
    g->fill_fd = -1;
    if (s_hasher_start (&g->hash, err) != 0)
        return -err->code;
    if (ftruncate (g->fd, 0) != 0)
        return kiln_error (err, KILN_EIO, "could not truncate '%s': %s", g->tmp,
                           strerror (errno));
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_GET);
    if (!msg)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    g->req_id = self->next_req++;
    msg->req_id = g->req_id;
    memcpy (msg->artifact, g->digest, KILN_HEX_LEN);
    msg->credit = S_GET_WINDOW;
    if (g->use_cache && g->n_have) {
        if (!(msg->have = malloc (g->n_have * sizeof *msg->have))) {
            kiln_msg_destroy (&msg);
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        }
        memcpy (msg->have, g->have, g->n_have * sizeof *msg->have);
        msg->n_have = (uint32_t) g->n_have;
    }
    g->progress = zclock_mono ();
    int rc = kiln_client_writable (self, (int) self->broker_timeout_ms, err);
    if (rc != 0) {
        kiln_msg_destroy (&msg);
        return rc;
    }
    if (kiln_client_send (self, &msg, (int) self->broker_timeout_ms, err) != 0)
        return -err->code;
    self->stats.requests++;
    return 0;
}

/* Give the broker its credit back. */
static void
s_get_credit (s_get_t *g)
{
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_CREDIT);
    kiln_err_t err = { 0 };
    if (!msg)
        return;
    msg->req_id = g->req_id;
    msg->credit = g->owed;
    g->owed = 0;
    if (kiln_client_send (g->self, &msg, 0, &err) != 0)
        kiln_log_warn ("%s", err.msg);        /* the stall is noticed and the GET resent */
}

static void
s_get_progress (s_get_t *g)
{
    g->progress = zclock_mono ();
    if (g->self->progress) {
        kiln_progress_event_t ev = { .index = SIZE_MAX, .phase = KILN_PHASE_DOWNLOAD,
                                     .sent_bytes = g->received, .total_bytes = g->size,
                                     .reused_bytes = g->reused };
        g->self->progress (&ev, g->self->progress_arg);
    }
}

/* Write `frame` at g->received and hand it to the hasher. */
static int
s_get_write (s_get_t *g, zframe_t **frame_p, kiln_err_t *err)
{
    zframe_t *frame = *frame_p;
    const uint8_t *data = frame ? zframe_data (frame) : NULL;
    size_t len = frame ? zframe_size (frame) : 0;
    for (size_t done = 0; done < len;) {
        ssize_t n = pwrite (g->fd, data + done, len - done, (off_t) (g->received + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            int e = errno;
            zframe_destroy (frame_p);
            return kiln_error (err, KILN_EIO, "could not write '%s': %s", g->tmp,
                               n < 0 ? strerror (e) : "short write");
        }
        done += (size_t) n;
    }
    if (frame && !g->no_digest)
        s_hasher_push (&g->hash, frame_p);
    zframe_destroy (frame_p);
    g->received += len;
    return 0;
}

/* A failure that a cached member may have caused: the caller asks again
 * without the cache. */
#define S_CACHE_FAULT (-1000)

/* A PART naming a member we hold: copy it from the cache into place
 * (s_get_fill, a few chunks a turn, the socket left alone meanwhile). */
static int
s_get_member (s_get_t *g, kiln_msg_t *msg, kiln_err_t *err)
{
    uint8_t want[KILN_DIGEST_LEN];
    kiln_unhex (msg->member, want, KILN_DIGEST_LEN);
    bool asked = false;
    for (size_t i = 0; g->use_cache && i < g->n_have && !asked; i++)
        asked = memcmp (g->have[i].digest, want, KILN_DIGEST_LEN) == 0
                && g->have[i].size == msg->length;
    if (!asked)
        return kiln_error (err, KILN_EPROTO, "the broker named member %.12s (%llu bytes) of "
                           "artifact %.12s, which this GET did not say it holds", msg->member,
                           (unsigned long long) msg->length, g->digest);
    int fd = kiln_mcache_open_member (g->cache, msg->member, msg->length);
    if (fd < 0 || g->n_used >= KILN_MAX_MEMBERS) {
        if (fd >= 0)
            close (fd);
        kiln_error (err, KILN_ENOTFOUND, "member %.12s left the cache", msg->member);
        return S_CACHE_FAULT;
    }
    memcpy (g->used[g->n_used++], msg->member, KILN_HEX_LEN);
    /* No file digest for this attempt (the broker sends none when members
     * are held): the artifact check after the transfer hashes every
     * member, the cached ones included, against the manifest. */
    g->no_digest = true;
    s_hasher_stop (&g->hash, true);
    g->fill_fd = fd;
    g->fill_start = g->received;
    g->fill_end = g->received + msg->length;
    return 0;
}

/* Copy the next chunks of the cached member into place. */
static int
s_get_fill (s_get_t *g, kiln_err_t *err)
{
    for (int k = 0; k < S_FILL_STEP && g->received < g->fill_end; k++) {
        uint64_t n = g->fill_end - g->received;
        if (n > KILN_CHUNK_BYTES)
            n = KILN_CHUNK_BYTES;
        zframe_t *frame = zframe_new (NULL, (size_t) n);
        if (!frame)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        if (kiln_pread_all (g->fill_fd, zframe_data (frame), n,
                            g->received - g->fill_start) != (int64_t) n) {
            zframe_destroy (&frame);
            kiln_error (err, KILN_EIO, "a cached member of artifact %.12s could not be "
                        "read", g->digest);
            return S_CACHE_FAULT;
        }
        int rc = s_get_write (g, &frame, err);
        if (rc != 0)
            return rc;
        g->reused += n;
    }
    if (g->received == g->fill_end) {
        close (g->fill_fd);
        g->fill_fd = -1;
        if (++g->owed >= S_GET_WINDOW / 4)
            s_get_credit (g);
    }
    s_get_progress (g);
    return 0;
}

/* Take one PART: in order, the size it announced, written and hashed. */
static int
s_get_part (s_get_t *g, kiln_msg_t *msg, kiln_err_t *err)
{
    if (strcmp (msg->artifact, g->digest) != 0)
        return kiln_error (err, KILN_EPROTO, "the broker sent a part of artifact %.12s, not "
                           "of %.12s", msg->artifact, g->digest);
    if (!g->have_size) {
        g->size = msg->artifact_size;
        g->have_size = true;
    }
    if (msg->artifact_size != g->size || msg->offset != g->received)
        return kiln_error (err, KILN_EPROTO, "the broker sent bytes %llu.. of a %llu-byte "
                           "artifact, expected bytes %llu.. of %llu",
                           (unsigned long long) msg->offset,
                           (unsigned long long) msg->artifact_size,
                           (unsigned long long) g->received, (unsigned long long) g->size);
    if (msg->member[0])
        return s_get_member (g, msg, err);   /* credit given back once copied */
    zframe_t *frame = kiln_msg_take_chunk (msg);
    size_t len = frame ? zframe_size (frame) : 0;     /* the decoder checked it */
    int wrc = s_get_write (g, &frame, err);
    if (wrc != 0)
        return wrc;
    g->wire += len;
    g->self->stats.downloaded_bytes += len;
    s_get_progress (g);
    if (g->received < g->size) {
        if (++g->owed >= S_GET_WINDOW / 4)
            s_get_credit (g);
        return 0;
    }
    /* The last part: the broker's digest of what it read is ours of
     * what we wrote (with cached members in, the artifact check does it). */
    if (g->no_digest) {
        g->complete = true;
        return 0;
    }
    uint8_t digest[KILN_DIGEST_LEN];
    s_hasher_stop (&g->hash, false);
    kiln_sha256_final (&g->hash.sha, digest);
    kiln_hex (digest, KILN_DIGEST_LEN, g->file_sha);
    if (strcmp (msg->digest, g->file_sha) != 0) {
        kiln_error (err, KILN_EVERIFY, "artifact %.12s arrived damaged: its %llu bytes "
                    "hash to %s, the broker sent bytes hashing to %s", g->digest,
                    (unsigned long long) g->size, g->file_sha,
                    msg->digest[0] ? msg->digest : "(none given)");
        return -KILN_EVERIFY;           /* no cached member is in (no_digest) */
    }
    g->complete = true;
    return 0;
}

/* A cached member failed (it did not hash to what the broker sent, or
 * left the cache): drop the entries this attempt took and ask again
 * without the cache.  `err` says what failed. */
static void
s_get_forget (s_get_t *g, kiln_err_t *err)
{
    kiln_log_warn ("GET of artifact %.12s: %s; a cached member was at fault: fetching it "
                   "again without the member cache", g->digest, err->msg);
    for (size_t i = 0; i < g->n_used; i++)
        kiln_mcache_drop (g->cache, g->used[i]);
    g->use_cache = false;
    g->refetched = true;
    memset (err, 0, sizeof *err);
}

static int
s_get_refetch (s_get_t *g, kiln_err_t *err)
{
    s_get_forget (g, err);
    return s_get_send (g, "a cached member did not check", err);
}

/* Receive until the artifact is in the file, or fail. */
static int
s_get_receive (s_get_t *g, int wait_ms, kiln_err_t *err)
{
    kiln_client_t *self = g->self;
    int64_t start = zclock_mono ();
    int64_t deadline = wait_ms > 0 ? start + wait_ms : INT64_MAX;
    int64_t heard = start, hb_at = start + self->heartbeat_ms;
    /* a broker that answers heartbeats but sends nothing has dropped the
     * GET (its client looked idle, it restarted): ask again */
    int64_t stall_ms = 2 * (int64_t) self->liveness_ms;
    int rc = s_get_send (g, "", err);
    while (rc == 0 && !g->complete) {
        int64_t now = zclock_mono ();
        if (zsys_interrupted)
            return kiln_error (err, KILN_ECANCELED, "interrupted");
        if (now >= deadline)
            return kiln_error (err, KILN_ETIMEOUT, "gave up fetching artifact %s from %s "
                               "after %g s (%llu of %llu bytes arrived)", g->digest,
                               self->endpoint, wait_ms / 1000.0,
                               (unsigned long long) g->received, (unsigned long long) g->size);
        if (now - heard > self->broker_timeout_ms)
            return kiln_error (err, KILN_EUNREACHABLE, "no answer from the broker at %s for "
                               "%g s", self->endpoint, self->broker_timeout_ms / 1000.0);
        if (now - heard > self->liveness_ms) {
            /* silent: a new connection, and the GET again */
            kiln_client_disconnect (self);
            self->stats.reconnects++;
            heard = now;
            if ((rc = kiln_client_connect (self, err)) != 0
                || (rc = s_get_send (g, "the broker went silent", err)) != 0)
                break;
        }
        else if (now - g->progress > stall_ms
                 && (rc = s_get_send (g, "the broker stopped sending", err)) != 0)
            break;
        if (now >= hb_at) {
            kiln_msg_t *hb = kiln_msg_new (KILN_CMD_HEARTBEAT);
            kiln_err_t herr = { 0 };
            if (hb)
                kiln_client_send (self, &hb, 0, &herr);
            hb_at = now + self->heartbeat_ms;
        }
        if (g->fill_fd >= 0) {
            /* our own work: the broker is not silent meanwhile */
            rc = s_get_fill (g, err);
            heard = g->progress;
            if (rc == S_CACHE_FAULT)
                rc = s_get_refetch (g, err);
            if (rc != 0)
                break;
        }
        int64_t wait = hb_at - now;
        if (wait > KILN_CLIENT_MAX_POLL_MS)
            wait = KILN_CLIENT_MAX_POLL_MS;
        if (wait < 0 || g->fill_fd >= 0)
            wait = 0;
        zmq_pollitem_t items[2] = {
            { zsock_resolve (self->dealer), 0, ZMQ_POLLIN, 0 },
            { self->monitor ? zsock_resolve (self->monitor) : NULL, 0, ZMQ_POLLIN, 0 },
        };
        int got = zmq_poll (items, self->monitor ? 2 : 1, (long) wait);
        if (got < 0 && zmq_errno () != EINTR)
            return kiln_error (err, KILN_EIO, "waiting for the broker: %s",
                               zmq_strerror (zmq_errno ()));
        if (got > 0 && self->monitor && (items[1].revents & ZMQ_POLLIN)
            && kiln_client_refused (self, err))
            return -err->code;
        for (int k = 0; rc == 0 && got > 0 && k < 1024 && !g->complete && g->fill_fd < 0;
             k++) {
            if (!(zsock_events (self->dealer) & ZMQ_POLLIN))
                break;
            kiln_err_t rerr = { 0 };
            uint64_t req_id = 0;
            kiln_msg_t *msg = kiln_msg_recv (self->dealer, NULL, &req_id, &rerr);
            heard = zclock_mono ();
            if (!msg) {
                if (req_id == g->req_id)
                    return kiln_error (err, rerr.code, "reply from the broker: %s", rerr.msg);
                continue;
            }
            /* Another broker instance: ours restarted and forgot the GET. */
            bool restarted = msg->epoch && self->epoch && msg->epoch != self->epoch;
            if (msg->epoch)
                self->epoch = msg->epoch;
            if (restarted)
                rc = s_get_send (g, "the broker restarted", err);
            else if (msg->req_id != g->req_id)
                ;                          /* a heartbeat, or an answer to an older GET */
            else if (msg->cmd == KILN_CMD_ERROR) {
                kiln_client_remote_error (msg, err);
                rc = -err->code;
                if (rc == -KILN_ENOTFOUND)
                    kiln_error (err, KILN_ENOTFOUND, "the farm at %s holds no artifact %s",
                                self->endpoint, g->digest);
            }
            else if (msg->cmd == KILN_CMD_PART
                     && (rc = s_get_part (g, msg, err)) == S_CACHE_FAULT)
                rc = s_get_refetch (g, err);
            kiln_msg_destroy (&msg);
        }
    }
    return rc;
}

int
kiln_client_get (kiln_client_t *self, const char *digest_hex, const char *out_path,
                 const char *keyring_dir, int wait_ms, kiln_get_result_t *res,
                 kiln_err_t *err)
{
    if (res)
        memset (res, 0, sizeof *res);
    if (!self || !out_path || !*out_path)
        return kiln_error (err, KILN_EINVAL, "kiln_client_get needs a client and an output "
                           "path");
    if (!digest_hex || !kiln_is_digest_hex (digest_hex))
        return kiln_error (err, KILN_EINVAL, "'%.80s' is not an artifact's content hash "
                           "(64 lower-case hex characters)", digest_hex ? digest_hex : "");
    s_get_t g = { .self = self, .fd = -1, .fill_fd = -1 };
    memcpy (g.digest, digest_hex, KILN_HEX_LEN);
    pthread_mutex_init (&g.hash.mu, NULL);
    pthread_cond_init (&g.hash.work, NULL);
    pthread_cond_init (&g.hash.room, NULL);
    kiln_artifact_t *art = NULL;
    int rc = 0;
    /* The temporary file goes beside the target, so that the rename is
     * atomic (same file system). */
    const char *slash = strrchr (out_path, '/');
    int dir_len = slash ? (int) (slash - out_path) : 1;
    const char *dir = slash ? out_path : ".";
    if (slash == out_path)
        dir_len = 1;                       /* "/name" */
    if (snprintf (g.tmp, sizeof g.tmp, "%.*s/.%s.kiln-get-XXXXXX", dir_len, dir,
                  slash ? slash + 1 : out_path) >= (int) sizeof g.tmp)
        return kiln_error (err, KILN_ELIMIT, "output path '%s' is too long", out_path);
    g.fd = mkostemp (g.tmp, O_CLOEXEC);
    if (g.fd < 0)
        return kiln_error (err, KILN_EIO, "could not create a file beside '%s': %s", out_path,
                           strerror (errno));
    fchmod (g.fd, 0644);
    if ((g.cache = kiln_mcache_default ())) {
        g.n_have = kiln_mcache_recent (g.cache, g.have, KILN_PROTO_MAX_HAVE);
        g.use_cache = true;
    }
    if (!self->dealer && (rc = kiln_client_connect (self, err)) != 0)
        goto done;
    while (true) {
        if ((rc = s_get_receive (&g, wait_ms, err)) != 0)
            goto done;
        if (fsync (g.fd) != 0) {
            rc = kiln_error (err, KILN_EIO, "could not write '%s': %s", g.tmp,
                             strerror (errno));
            goto done;
        }
        /* What arrived must be the artifact asked for: every member as its
         * manifest says, the manifest with that content hash, and (when a
         * keyring is given) signed by a key in it.  Mapped, not read: every
         * member is hashed with its pages given back, so that checking a
         * 10 GB artifact costs no more memory than a small one.  With
         * members from the cache (no file digest was taken), this is the
         * check of their bytes: a failure asks again without the cache. */
        char got[KILN_HEX_LEN];
        int vfd = open (g.tmp, O_RDONLY | O_CLOEXEC);
        art = vfd >= 0 ? kiln_artifact_read_fd (vfd, g.tmp, KILN_ARTIFACT_MAP, err) : NULL;
        if (vfd < 0)
            kiln_error (err, KILN_EIO, "could not open '%s': %s", g.tmp, strerror (errno));
        else
            close (vfd);
        if (!art)
            rc = kiln_error_prefix (err, "artifact %.12s from the farm", g.digest);
        else if ((rc = kiln_artifact_digest (art, got, err)) == 0 && strcmp (got, g.digest) != 0)
            rc = kiln_error (err, KILN_EVERIFY, "the farm at %s sent an artifact with content "
                             "hash %s for %s", self->endpoint, got, g.digest);
        if (rc == 0)
            break;
        if (!g.no_digest || rc == -KILN_ENOMEM)
            goto done;
        kiln_artifact_destroy (&art);
        s_get_forget (&g, err);
    }
    close (g.fd);
    g.fd = -1;
    if (keyring_dir && (rc = kiln_artifact_verify (art, keyring_dir, err)) != 0) {
        kiln_error_prefix (err, "artifact %.12s from the farm", g.digest);
        goto done;
    }
    /* Keep its large members for the next fetch (the bytes just checked). */
    for (int i = 0; g.cache && i < kiln_artifact_member_count (art); i++) {
        uint64_t off, len;
        char hex[KILN_HEX_LEN];
        int cfd = kiln_artifact_member_span (art, i, &off, &len, hex) == 0
                  && len >= KILN_MCACHE_MIN_BYTES ? open (g.tmp, O_RDONLY | O_CLOEXEC) : -1;
        if (cfd >= 0) {
            kiln_mcache_put (g.cache, cfd, off, len, hex);
            close (cfd);
        }
    }
    kiln_artifact_destroy (&art);
    if (rename (g.tmp, out_path) != 0) {
        rc = kiln_error (err, KILN_EIO, "could not rename onto '%s': %s", out_path,
                         strerror (errno));
        goto done;
    }
    g.tmp[0] = '\0';
    char dirbuf[PATH_MAX];
    snprintf (dirbuf, sizeof dirbuf, "%.*s", dir_len, dir);
    int dfd = open (dirbuf, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync (dfd);
        close (dfd);
    }
    if (res) {
        res->bytes = g.size;
        memcpy (res->sha256, g.file_sha, KILN_HEX_LEN);
        res->received_bytes = g.wire;
        res->reused_bytes = g.reused;
        res->refetched = g.refetched;
    }
    self->stats.reused_bytes += g.reused;
done:
    if (rc != 0 && self->dealer && g.req_id && !g.complete) {
        /* the broker may stop sending now */
        kiln_msg_t *cancel = kiln_msg_new (KILN_CMD_CANCEL);
        kiln_err_t cerr = { 0 };
        if (cancel) {
            cancel->req_id = g.req_id;
            kiln_client_send (self, &cancel, 0, &cerr);
        }
    }
    kiln_artifact_destroy (&art);
    s_hasher_stop (&g.hash, true);
    kiln_sha256_destroy (&g.hash.sha);
    pthread_mutex_destroy (&g.hash.mu);
    pthread_cond_destroy (&g.hash.work);
    pthread_cond_destroy (&g.hash.room);
    if (g.fd >= 0)
        close (g.fd);
    if (g.fill_fd >= 0)
        close (g.fill_fd);
    kiln_mcache_destroy (&g.cache);
    if (g.tmp[0])
        unlink (g.tmp);
    return rc;
}
