/*
 * kiln_store_upload — the store's blob writers: a blob upload received
 * chunk by chunk, hashed and written by two threads of its own, checked
 * against its digest, fsynced, then named and indexed on the caller's
 * thread (kiln_store_blob_finish).  The writers tell the caller's loop of
 * their progress through one eventfd (kiln_store_upload_fd,
 * kiln_store_upload_poll).
 */
#include "broker/kiln_store_priv.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <czmq.h>
#include <pthread.h>

#include "common/kiln_limits.h"

#define S_SYNC_EVERY      (8u << 20)      /* push a growing blob to disk this often */

/* A blob being received.  The broker's loop hands it the chunks (their
 * frames, no copy) and goes on at once: two threads of the writer's own
 * take them from there.  The hasher reads each chunk once, in pieces
 * small enough to stay in the CPU's cache: it hashes a piece, then copies
 * it, still hot, into the next of a few aligned slots, and lets the frame
 * go; the file writer writes the slots filled (several at once when they
 * follow each other) while the hasher goes on.  A frame goes as soon as
 * it is hashed and copied; that is when the loop may grant its credit
 * again, so the memory an upload holds stays within the credit window
 * (`cap` chunks) plus its slots.  When the last chunk is handed over the
 * threads finish on their own (digest checked, file truncated and
 * fsynced) and the loop hears of it through the store's upload eventfd,
 * so a 1 GiB upload never holds up the broker's loop.  The file is
 * written with O_DIRECT where the file system allows it (no copy into the
 * page cache, the slowest step on small VMs), else through the page cache
 * with early writeback. */
#define S_DEFAULT_CHUNKS 16          /* chunks in flight when the caller sets none */
#define S_ALIGN 4096
#define S_SLOTS 4                    /* aligned chunk slots an upload writes from, at most */
#define S_PIECE (64u << 10)          /* hashed, then copied while in the cache */
#define S_NEWS_EVERY 4               /* chunks let go of between two wakes of the loop */
#define S_MAX_NEWS_PER_POLL 4096     /* writers handled per kiln_store_upload_poll */

struct kiln_blob_writer {
    kiln_store_t *store;
    void *tag;                       /* the caller's, given back by upload_poll */
    uint8_t digest[KILN_DIGEST_LEN];
    uint64_t size;                   /* announced */
    uint64_t received;               /* bytes handed over (the caller's) */
    bool reserved;                   /* `size` is reserved under the store's cap */
    int fd;
    bool direct;                     /* fd has O_DIRECT */
    char tmp[PATH_MAX];
    /* shared with the threads, under mu */
    pthread_t hasher, writer;
    bool hasher_started, writer_started;
    pthread_mutex_t mu;
    pthread_cond_t work;             /* threads wait for chunks, slots or the end */
    pthread_cond_t room;             /* the caller waits for room or done */
    zframe_t **ring;                 /* chunk i at ring[i % cap] */
    size_t cap;
    uint64_t pushed, hashed;         /* chunks handed over; hashed, copied and let go */
    uint64_t told;                   /* `hashed` when the loop was last woken for it */
    uint64_t written;                /* slots written (chunk i went to slot i % n_slots) */
    bool closing;                    /* no more chunks: finish */
    bool abort;                      /* stop at once */
    bool hash_done, done;
    int error;                       /* KILN_E*, 0 = none */
    char errmsg[PATH_MAX + 128];
    uint8_t got[KILN_DIGEST_LEN];    /* the digest of what came, once hash_done */
    /* the slots: n_slots of KILN_CHUNK_BYTES (one of the blob's size when
     * it is smaller), S_ALIGN-aligned, one after the other; slot_len[i]
     * bytes of slot i are filled (by the hasher, then the writer's) */
    uint8_t *slots;
    size_t slot_bytes, n_slots;
    size_t slot_len[S_SLOTS];
    /* the hasher's own */
    kiln_sha256_t *sha;
    /* the writer thread's own */
    uint64_t bytes_written, synced;
    /* on the store's news list, under the store's news_mu */
    bool in_news;
    struct kiln_blob_writer *news_next;
};

/* Write `len` bytes from `data` (inside the slots) at the end of what is
 * written; O_DIRECT needs an aligned length, so the last write of a blob
 * is padded with zeros (the file is cut to its size at the end; the
 * slots have room for the padding). */
static int
s_writer_put (kiln_blob_writer_t *w, uint8_t *data, size_t len)
{
    size_t n = len;
    if (w->direct) {
        n = (len + S_ALIGN - 1) / S_ALIGN * S_ALIGN;
        memset (data + len, 0, n - len);
    }
    size_t done = 0;
    while (done < n) {
        ssize_t k = pwrite (w->fd, data + done, n - done, (off_t) (w->bytes_written + done));
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        done += (size_t) k;
    }
    w->bytes_written += len;
    if (!w->direct && w->bytes_written - w->synced >= S_SYNC_EVERY) {
        sync_file_range (w->fd, (off_t) w->synced, (off_t) (w->bytes_written - w->synced),
                         SYNC_FILE_RANGE_WRITE);
        w->synced = w->bytes_written;
    }
    return 0;
}

/* Tell the store's loop that w has news (chunks released, or done).
 * Called with w->mu held; the lock order is w->mu, then news_mu. */
static void
s_news (kiln_blob_writer_t *w)
{
    kiln_store_t *store = w->store;
    bool wake = false;
    pthread_mutex_lock (&store->news_mu);
    if (!w->in_news) {
        w->in_news = true;
        w->news_next = NULL;
        if (store->news_tail)
            store->news_tail->news_next = w;
        else
            store->news = w;
        store->news_tail = w;
        wake = true;
    }
    pthread_mutex_unlock (&store->news_mu);
    if (wake) {
        uint64_t one = 1;
        ssize_t ignored = write (store->upload_efd, &one, sizeof one);
        (void) ignored;
    }
}

static void
s_writer_fail (kiln_blob_writer_t *w, int code, const char *fmt, ...)
{
    if (w->error)
        return;                      /* the first failure is the one told */
    w->error = code;
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (w->errmsg, sizeof w->errmsg, fmt, ap);
    va_end (ap);
}

/* The next chunk for the hasher, once there is one and a slot is free to
 * copy it into; NULL after the last chunk or on abort.  Under w->mu. */
static zframe_t *
s_wait_chunk (kiln_blob_writer_t *w)
{
    while (!w->abort && ((w->hashed == w->pushed && !w->closing)
                         || (w->hashed < w->pushed && w->hashed - w->written >= w->n_slots)))
        pthread_cond_wait (&w->work, &w->mu);
    return w->abort || w->hashed == w->pushed ? NULL : w->ring[w->hashed % w->cap];
}

static void *
s_hasher_thread (void *arg)
{
    kiln_blob_writer_t *w = arg;
    pthread_mutex_lock (&w->mu);
    zframe_t *frame;
    while ((frame = s_wait_chunk (w))) {
        size_t slot = (size_t) (w->hashed % w->n_slots);
        const uint8_t *data = zframe_data (frame);
        size_t len = zframe_size (frame);
        uint8_t *to = w->slots + slot * w->slot_bytes;     /* len <= slot_bytes (take) */
        pthread_mutex_unlock (&w->mu);
        for (size_t off = 0; off < len; off += S_PIECE) {
            size_t n = len - off < S_PIECE ? len - off : S_PIECE;
            kiln_sha256_update (w->sha, data + off, n);
            memcpy (to + off, data + off, n);
        }
        pthread_mutex_lock (&w->mu);
        w->slot_len[slot] = len;
        zframe_destroy (&w->ring[w->hashed % w->cap]);
        w->hashed++;
        pthread_cond_signal (&w->room);
        pthread_cond_broadcast (&w->work);      /* the writer waits for a filled slot */
        /* The loop hears of released chunks a few at a time (each wake
         * costs it, and the client, a message), and at once when the
         * hasher has caught up: the client may be out of credit then. */
        if (w->hashed - w->told >= S_NEWS_EVERY || w->hashed == w->pushed) {
            w->told = w->hashed;
            s_news (w);
        }
    }
    if (!w->abort)
        kiln_sha256_final (&w->sha, w->got);
    w->hash_done = true;
    pthread_cond_broadcast (&w->work);      /* the writer thread may wait for it */
    pthread_mutex_unlock (&w->mu);
    return NULL;
}

/* Everything is written and hashed: check the digest, cut the padding of
 * the last O_DIRECT write and the preallocation, fsync.  Under w->mu. */
static void
s_writer_seal (kiln_blob_writer_t *w)
{
    char hex[KILN_HEX_LEN];
    kiln_hex (w->digest, KILN_DIGEST_LEN, hex);
    if (w->error)
        return;
    if (w->received != w->size || w->bytes_written != w->size) {
        s_writer_fail (w, KILN_EPROTO, "blob %s: %llu of %llu bytes received", hex,
                       (unsigned long long) w->received, (unsigned long long) w->size);
        return;
    }
    if (memcmp (w->got, w->digest, KILN_DIGEST_LEN) != 0) {
        char got_hex[KILN_HEX_LEN];
        kiln_hex (w->got, KILN_DIGEST_LEN, got_hex);
        s_writer_fail (w, KILN_EVERIFY, "blob %s: the bytes sent hash to %s", hex, got_hex);
        return;
    }
    pthread_mutex_unlock (&w->mu);
    int rc = ftruncate (w->fd, (off_t) w->size) == 0 && fsync (w->fd) == 0 ? 0 : errno;
    pthread_mutex_lock (&w->mu);
    if (rc)
        s_writer_fail (w, KILN_EIO, "could not write '%s': %s", w->tmp, strerror (rc));
}

/* The file writer: the slots the hasher filled, in order, the ones that
 * follow each other in memory in one write (whole chunks only, so that
 * what is written stays aligned), until the hasher is through. */
static void *
s_writer_thread (void *arg)
{
    kiln_blob_writer_t *w = arg;
    pthread_mutex_lock (&w->mu);
    for (;;) {
        while (!w->abort && w->written == w->hashed && !w->hash_done)
            pthread_cond_wait (&w->work, &w->mu);
        if (w->abort || w->written == w->hashed)
            break;
        size_t first = (size_t) (w->written % w->n_slots);
        size_t k = 0, len = 0;
        while (w->written + k < w->hashed && first + k < w->n_slots) {
            len += w->slot_len[first + k];
            k++;
            if (w->slot_len[first + k - 1] != w->slot_bytes)
                break;               /* a short chunk ends a write */
        }
        bool failed = w->error != 0;
        pthread_mutex_unlock (&w->mu);
        int rc = failed ? 0 : s_writer_put (w, w->slots + first * w->slot_bytes, len);
        int e = errno;
        pthread_mutex_lock (&w->mu);
        if (rc != 0)
            s_writer_fail (w, KILN_EIO, "could not write '%s': %s", w->tmp, strerror (e));
        w->written += k;
        pthread_cond_broadcast (&w->work);      /* the hasher may wait for a slot */
    }
    if (!w->abort) {
        s_writer_seal (w);
        w->done = true;
        pthread_cond_broadcast (&w->room);
        s_news (w);
    }
    pthread_mutex_unlock (&w->mu);
    return NULL;
}

kiln_blob_writer_t *
kiln_store_blob_begin (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                       uint64_t size, size_t max_chunks, void *tag, kiln_err_t *err)
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    if (size > self->max_bytes || size > KILN_MAX_BLOB_BYTES) {
        kiln_error (err, KILN_ELIMIT, "blob %s is %llu bytes, more than the store holds "
                    "(%llu)", hex, (unsigned long long) size,
                    (unsigned long long) (self->max_bytes < KILN_MAX_BLOB_BYTES
                                          ? self->max_bytes : KILN_MAX_BLOB_BYTES));
        return NULL;
    }
    if (store_room_beside_pins (self, hex, size, err) != 0
        || store_reserve (self, hex, size, err) != 0)
        return NULL;
    size_t cap = max_chunks ? max_chunks : S_DEFAULT_CHUNKS;
    kiln_blob_writer_t *w = calloc (1, sizeof *w);
    /* Slots for as many chunks as the blob has, up to S_SLOTS, each with
     * room for the padding of an O_DIRECT write. */
    uint64_t chunks = (size + KILN_CHUNK_BYTES - 1) / KILN_CHUNK_BYTES;
    size_t n_slots = chunks < S_SLOTS ? (size_t) (chunks ? chunks : 1) : S_SLOTS;
    size_t slot_bytes = size < KILN_CHUNK_BYTES ? (size_t) (size + S_ALIGN - 1) / S_ALIGN * S_ALIGN
                                                : KILN_CHUNK_BYTES;
    if (slot_bytes == 0)
        slot_bytes = S_ALIGN;
    if (w && (!(w->sha = kiln_sha256_new ()) || !(w->ring = calloc (cap, sizeof *w->ring))
              || posix_memalign ((void **) &w->slots, S_ALIGN, n_slots * slot_bytes) != 0))
        w->slots = NULL;
    if (!w || !w->slots) {
        if (w) {
            kiln_sha256_destroy (&w->sha);
            free (w->ring);
        }
        free (w);
        store_unreserve (self, size);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    w->n_slots = n_slots;
    w->slot_bytes = slot_bytes;
    w->store = self;
    w->reserved = true;
    w->tag = tag;
    w->cap = cap;
    w->fd = -1;
    memcpy (w->digest, digest, KILN_DIGEST_LEN);
    w->size = size;
    pthread_mutex_init (&w->mu, NULL);
    pthread_cond_init (&w->work, NULL);
    pthread_cond_init (&w->room, NULL);
    w->fd = store_tmp_file (self, w->tmp, sizeof w->tmp, err);
    if (w->fd < 0) {
        kiln_blob_writer_abort (&w);
        return NULL;
    }
    /* Preallocated, the file grows without the file system allocating
     * block by block, and a full disk shows now rather than after the
     * upload. */
    if (size > 0 && posix_fallocate (w->fd, 0, (off_t) ((size + S_ALIGN - 1) / S_ALIGN * S_ALIGN))
                        != 0) {
        kiln_error (err, KILN_EIO, "blob %s: no room for %llu bytes in '%s'", hex,
                    (unsigned long long) size, self->root);
        kiln_blob_writer_abort (&w);
        return NULL;
    }
    int flags = fcntl (w->fd, F_GETFL);
    w->direct = size >= KILN_CHUNK_BYTES && flags >= 0
                && fcntl (w->fd, F_SETFL, flags | O_DIRECT) == 0;
    w->hasher_started = pthread_create (&w->hasher, NULL, s_hasher_thread, w) == 0;
    w->writer_started = w->hasher_started
                        && pthread_create (&w->writer, NULL, s_writer_thread, w) == 0;
    if (!w->writer_started) {
        kiln_error (err, KILN_ESYS, "could not start the threads of an upload");
        kiln_blob_writer_abort (&w);
        return NULL;
    }
    return w;
}

int
kiln_blob_writer_take (kiln_blob_writer_t *self, zframe_t **frame_p, kiln_err_t *err)
{
    zframe_t *frame = *frame_p;
    *frame_p = NULL;
    size_t len = frame ? zframe_size (frame) : 0;
    if (len > self->size - self->received) {
        zframe_destroy (&frame);
        return kiln_error (err, KILN_EPROTO, "blob upload: %zu more bytes would overrun "
                           "the announced %llu", len, (unsigned long long) self->size);
    }
    if (len > KILN_CHUNK_BYTES) {
        zframe_destroy (&frame);
        return kiln_error (err, KILN_EPROTO, "blob upload: a chunk of %zu bytes, more than "
                           "%u", len, KILN_CHUNK_BYTES);
    }
    if (len == 0) {
        zframe_destroy (&frame);
        return 0;
    }
    pthread_mutex_lock (&self->mu);
    while (!self->error && !self->closing
           && self->pushed - self->hashed >= self->cap)
        pthread_cond_wait (&self->room, &self->mu);
    int rc = 0;
    if (self->error || self->closing) {
        rc = self->error ? kiln_error (err, self->error, "%s", self->errmsg)
                         : kiln_error (err, KILN_EPROTO, "blob upload: a chunk after the end");
        zframe_destroy (&frame);
    }
    else {
        self->ring[self->pushed % self->cap] = frame;
        self->pushed++;
        self->received += len;
        pthread_cond_broadcast (&self->work);
    }
    pthread_mutex_unlock (&self->mu);
    return rc;
}

int
kiln_blob_writer_write (kiln_blob_writer_t *self, const void *data, size_t len,
                        kiln_err_t *err)
{
    if (len > self->size - self->received)
        return kiln_error (err, KILN_EPROTO, "blob upload: %zu more bytes would overrun "
                           "the announced %llu", len, (unsigned long long) self->size);
    const uint8_t *p = data;
    for (size_t off = 0; off < len; off += KILN_CHUNK_BYTES) {
        size_t n = len - off < KILN_CHUNK_BYTES ? len - off : KILN_CHUNK_BYTES;
        zframe_t *frame = zframe_new (p + off, n);
        if (!frame)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        int rc = kiln_blob_writer_take (self, &frame, err);
        if (rc)
            return rc;
    }
    return 0;
}

uint64_t
kiln_blob_writer_received (const kiln_blob_writer_t *self)
{
    return self->received;
}

uint64_t
kiln_blob_writer_size (const kiln_blob_writer_t *self)
{
    return self->size;
}

uint64_t
kiln_blob_writer_released (kiln_blob_writer_t *self)
{
    pthread_mutex_lock (&self->mu);
    uint64_t n = self->hashed;
    pthread_mutex_unlock (&self->mu);
    return n;
}

void
kiln_blob_writer_close (kiln_blob_writer_t *self)
{
    pthread_mutex_lock (&self->mu);
    self->closing = true;
    pthread_cond_broadcast (&self->work);
    pthread_mutex_unlock (&self->mu);
}

bool
kiln_blob_writer_done (kiln_blob_writer_t *self)
{
    pthread_mutex_lock (&self->mu);
    bool done = self->done;
    pthread_mutex_unlock (&self->mu);
    return done;
}

/* Give back the writer's reservation under the store's cap (once). */
static void
s_writer_unreserve (kiln_blob_writer_t *w)
{
    if (w->reserved)
        store_unreserve (w->store, w->size);
    w->reserved = false;
}

/* Stop and join the threads: at once (abort) or once done. */
static void
s_writer_join (kiln_blob_writer_t *w, bool abort)
{
    pthread_mutex_lock (&w->mu);
    w->closing = true;
    if (abort)
        w->abort = true;
    pthread_cond_broadcast (&w->work);
    pthread_mutex_unlock (&w->mu);
    if (w->hasher_started)
        pthread_join (w->hasher, NULL);
    if (w->writer_started)
        pthread_join (w->writer, NULL);
    w->hasher_started = w->writer_started = false;
}

void
kiln_blob_writer_abort (kiln_blob_writer_t **writer_p)
{
    kiln_blob_writer_t *w = writer_p ? *writer_p : NULL;
    if (!w)
        return;
    s_writer_join (w, true);
    s_writer_unreserve (w);
    /* chunks the hasher did not let go of */
    for (uint64_t i = w->hashed; i < w->pushed; i++)
        zframe_destroy (&w->ring[i % w->cap]);
    kiln_store_t *store = w->store;
    pthread_mutex_lock (&store->news_mu);
    if (w->in_news) {
        kiln_blob_writer_t **p = &store->news;
        kiln_blob_writer_t *prev = NULL;
        while (*p && *p != w) {
            prev = *p;
            p = &(*p)->news_next;
        }
        if (*p) {
            *p = w->news_next;
            if (store->news_tail == w)
                store->news_tail = prev;
        }
    }
    pthread_mutex_unlock (&store->news_mu);
    if (w->fd >= 0)
        close (w->fd);
    if (w->tmp[0])
        unlink (w->tmp);
    kiln_sha256_destroy (&w->sha);
    pthread_mutex_destroy (&w->mu);
    pthread_cond_destroy (&w->work);
    pthread_cond_destroy (&w->room);
    free (w->ring);
    free (w->slots);
    free (w);
    *writer_p = NULL;
}

int
kiln_store_blob_finish (kiln_store_t *self, kiln_blob_writer_t **writer_p, kiln_err_t *err)
{
    kiln_blob_writer_t *w = *writer_p;
    char hex[KILN_HEX_LEN], path[PATH_MAX];
    kiln_hex (w->digest, KILN_DIGEST_LEN, hex);
    int rc = 0;
    s_writer_join (w, false);       /* at once when kiln_blob_writer_done said so */
    if (w->error) {
        rc = kiln_error (err, w->error, "%s", w->errmsg);
        goto done;
    }
    if (!w->done) {
        rc = kiln_error (err, KILN_EIO, "blob %s: the upload's threads stopped early", hex);
        goto done;
    }
    /* Naming it, indexing it and evicting for it stay on the caller's
     * thread: the index is the caller's alone. */
    if (store_path (self, STORE_BLOB, hex, true, path, sizeof path, err) != 0) {
        rc = -err->code;
        goto done;
    }
    if (rename (w->tmp, path) != 0) {
        rc = kiln_error (err, KILN_EIO, "could not rename onto '%s': %s", path,
                         strerror (errno));
        goto done;
    }
    w->tmp[0] = '\0';
    char dir[PATH_MAX];
    store_dirname (path, dir, sizeof dir);
    store_fsync_dir (dir);
    s_writer_unreserve (w);          /* its bytes are the index's now */
    store_index (self, STORE_BLOB, hex, w->size, (int64_t) time (NULL));
    store_evict (self);
done:
    kiln_blob_writer_abort (writer_p);
    return rc;
}

int
kiln_store_upload_fd (const kiln_store_t *self)
{
    return self->upload_efd;
}

void
kiln_store_upload_poll (kiln_store_t *self, kiln_store_upload_fn *fn, void *arg)
{
    uint64_t count;
    ssize_t ignored = read (self->upload_efd, &count, sizeof count);
    (void) ignored;
    for (int i = 0; i < S_MAX_NEWS_PER_POLL; i++) {
        pthread_mutex_lock (&self->news_mu);
        kiln_blob_writer_t *w = self->news;
        if (w) {
            self->news = w->news_next;
            if (!self->news)
                self->news_tail = NULL;
            w->in_news = false;
        }
        pthread_mutex_unlock (&self->news_mu);
        if (!w)
            return;
        fn (w, w->tag, arg);         /* may finish or abort w */
    }
    /* more news than one call handles: come back through the loop */
    uint64_t one = 1;
    ignored = write (self->upload_efd, &one, sizeof one);
}

