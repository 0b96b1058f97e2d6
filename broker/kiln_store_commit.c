/*
 * kiln_store_commit — the store's staged writes and group commit.  Small
 * entries (artifacts, action and failure records, inline blobs) are
 * written to STATE/tmp as they come and made durable together, a batch at
 * a time: by kiln_store_commit on the caller's thread, or by the syncer
 * thread (kiln_store_commit_async), which fsyncs and renames while the
 * caller's loop goes on; kiln_store_commit_collect then indexes what it
 * finished, on the caller's thread.
 *
 * Invariants: batches finish in ticket order; a staged entry is neither
 * visible nor indexed before its batch is durable; the syncer touches
 * files only, never the index.
 */
#include "broker/kiln_store_priv.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <pthread.h>

void
store_staged_drop (store_staged_t *s)
{
    if (s->fd >= 0)
        close (s->fd);
    s->fd = -1;
    unlink (s->tmp);
}

/* --- staged writes ---------------------------------------------------------- */

/* A fresh file in STATE/tmp; its name into `tmp`. */
int
store_tmp_file (kiln_store_t *self, char *tmp, size_t size, kiln_err_t *err)
{
    if (snprintf (tmp, size, "%s/tmp/%d-%llu", self->root, (int) getpid (),
                  (unsigned long long) ++self->tmp_seq) >= (int) size)
        return kiln_error (err, KILN_ELIMIT, "store path too long");
    int fd = open (tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0)
        return kiln_error (err, KILN_EIO, "could not create '%s': %s", tmp, strerror (errno));
    return fd;
}

static int
s_write_all (int fd, const void *data, size_t len)
{
    const uint8_t *p = data;
    while (len > 0) {
        ssize_t n = write (fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -1;
        p += n;
        len -= (size_t) n;
    }
    return 0;
}

/* Room for one more staged entry (not counted yet), zeroed; NULL when
 * the name is not a digest or memory is out. */
static store_staged_t *
s_stage_slot (kiln_store_t *self, const char *hex, int *rc, kiln_err_t *err)
{
    if (!kiln_is_digest_hex (hex)) {
        *rc = kiln_error (err, KILN_EINVAL, "'%.80s' is not a SHA-256 in hex", hex);
        return NULL;
    }
    if (self->n_staged == self->cap_staged) {
        size_t cap = self->cap_staged ? self->cap_staged * 2 : 64;
        store_staged_t *grown = realloc (self->staged, cap * sizeof *grown);
        if (!grown) {
            *rc = kiln_error (err, KILN_ENOMEM, "out of memory");
            return NULL;
        }
        self->staged = grown;
        self->cap_staged = cap;
    }
    store_staged_t *s = &self->staged[self->n_staged];
    memset (s, 0, sizeof *s);
    return s;
}

static int
s_stage (kiln_store_t *self, store_kind_t kind, const char *hex, const void *data, size_t len,
         kiln_err_t *err)
{
    int rc = 0;
    store_staged_t *s = s_stage_slot (self, hex, &rc, err);
    if (!s)
        return rc;
    s->kind = kind;
    memcpy (s->hex, hex, KILN_HEX_LEN);
    s->size = len;
    s->fd = store_tmp_file (self, s->tmp, sizeof s->tmp, err);
    if (s->fd < 0)
        return s->fd;
    if (s_write_all (s->fd, data, len) != 0) {
        int e = errno;
        store_staged_drop (s);
        return kiln_error (err, KILN_EIO, "could not write '%s': %s", s->tmp, strerror (e));
    }
    self->n_staged++;
    return 0;
}

int
kiln_store_put_artifact (kiln_store_t *self, const char *digest_hex,
                         const uint8_t *data, size_t len, kiln_err_t *err)
{
    return s_stage (self, STORE_ART, digest_hex, data, len, err);
}

int
kiln_store_tmp_open (kiln_store_t *self, char *path, size_t size, kiln_err_t *err)
{
    return store_tmp_file (self, path, size, err);
}

int
kiln_store_put_artifact_file (kiln_store_t *self, const char *digest_hex, const char *tmp,
                              int *fd_p, uint64_t size, kiln_err_t *err)
{
    int fd = *fd_p;
    *fd_p = -1;
    int rc = 0;
    store_staged_t *s = s_stage_slot (self, digest_hex, &rc, err);
    if (!s) {
        close (fd);
        unlink (tmp);
        return rc;
    }
    s->kind = STORE_ART;
    memcpy (s->hex, digest_hex, KILN_HEX_LEN);
    snprintf (s->tmp, sizeof s->tmp, "%s", tmp);
    s->fd = fd;
    s->size = size;
    self->n_staged++;
    return 0;
}

int
kiln_store_put_action (kiln_store_t *self, const char *action_key, const char *digest_hex,
                       kiln_err_t *err)
{
    if (!kiln_is_digest_hex (digest_hex))
        return kiln_error (err, KILN_EINVAL, "'%.80s' is not a SHA-256 in hex", digest_hex);
    char line[KILN_HEX_LEN + 1];
    snprintf (line, sizeof line, "%s\n", digest_hex);
    return s_stage (self, STORE_ACTION, action_key, line, KILN_HEX_LEN, err);
}

int
kiln_store_put_failure (kiln_store_t *self, const char *action_key, int code,
                        const char *message, const char *log, kiln_err_t *err)
{
    char stamp[32];
    time_t now = time (NULL);
    struct tm tm;
    gmtime_r (&now, &tm);
    strftime (stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &tm);
    json_t *obj = json_pack ("{s:i, s:s, s:s, s:s}", "code", code, "message",
                             message ? message : "", "log", log ? log : "",
                             "failed_at", stamp);
    char *text = obj ? json_dumps (obj, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    json_decref (obj);
    if (!text)
        return kiln_error (err, KILN_ENOMEM, "could not encode the failure record");
    int rc = s_stage (self, STORE_FAIL, action_key, text, strlen (text), err);
    free (text);
    return rc;
}

int
kiln_store_put_blob (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                     const uint8_t *data, size_t len, kiln_err_t *err)
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    uint8_t got[KILN_DIGEST_LEN];
    kiln_sha256 (data, len, got);
    if (memcmp (got, digest, KILN_DIGEST_LEN) != 0)
        return kiln_error (err, KILN_EVERIFY, "blob %s: its bytes do not hash to its digest", hex);
    if (store_find (self, STORE_BLOB, hex))
        return 0;
    for (size_t i = 0; i < self->n_staged; i++)
        if (self->staged[i].kind == STORE_BLOB && strcmp (self->staged[i].hex, hex) == 0)
            return 0;
    if (store_room_beside_pins (self, hex, len, err) != 0)
        return -err->code;
    return s_stage (self, STORE_BLOB, hex, data, len, err);
}

size_t
kiln_store_staged (const kiln_store_t *self)
{
    return self->n_staged;
}

/* Make staged files durable and visible: fsync each (writeback of all
 * started first, so the device sees the batch at once; with a journal,
 * the first fsync commits it all), rename each into place, fsync each
 * directory once.  Touches only files: safe on the syncer thread.  A
 * file that fails is dropped (fd -1). */
static void
s_make_durable (const kiln_store_t *self, store_staged_t *staged, size_t n, kiln_err_t *first)
{
    for (size_t i = 0; i < n; i++)
        sync_file_range (staged[i].fd, 0, 0, SYNC_FILE_RANGE_WRITE);
    for (size_t i = 0; i < n; i++) {
        store_staged_t *s = &staged[i];
        if (fsync (s->fd) != 0) {
            if (!first->code)
                kiln_error (first, KILN_EIO, "could not write '%s': %s", s->tmp,
                            strerror (errno));
            store_staged_drop (s);
        }
    }
    char (*dirs)[PATH_MAX] = malloc (64 * sizeof *dirs);
    size_t n_dirs = 0;
    for (size_t i = 0; i < n; i++) {
        store_staged_t *s = &staged[i];
        if (s->fd < 0)
            continue;
        char path[PATH_MAX];
        if (store_path (self, s->kind, s->hex, true, path, sizeof path, first) != 0
            || rename (s->tmp, path) != 0) {
            if (!first->code)
                kiln_error (first, KILN_EIO, "could not rename onto '%s': %s", path,
                            strerror (errno));
            store_staged_drop (s);
            continue;
        }
        close (s->fd);
        s->fd = -2;                  /* done, not failed */
        char dir[PATH_MAX];
        store_dirname (path, dir, sizeof dir);
        bool seen = false;
        for (size_t k = 0; dirs && k < n_dirs && !seen; k++)
            seen = strcmp (dirs[k], dir) == 0;
        if (!seen) {
            if (dirs && n_dirs < 64)
                memcpy (dirs[n_dirs++], dir, sizeof dir);
            else
                store_fsync_dir (dir);
        }
    }
    for (size_t k = 0; k < n_dirs; k++)
        store_fsync_dir (dirs[k]);
    free (dirs);
}

/* Index what a batch made durable; returns how many entries. */
static int
s_index_batch (kiln_store_t *self, store_staged_t *staged, size_t n)
{
    int done = 0;
    for (size_t i = 0; i < n; i++) {
        if (staged[i].fd != -2)
            continue;
        if (staged[i].kind != STORE_ACTION)
            store_index (self, staged[i].kind, staged[i].hex, staged[i].size,
                         (int64_t) time (NULL));
        done++;
    }
    return done;
}

int
kiln_store_commit (kiln_store_t *self, kiln_err_t *err)
{
    if (self->n_staged == 0)
        return 0;
    kiln_err_t first = { 0 };
    s_make_durable (self, self->staged, self->n_staged, &first);
    int done = s_index_batch (self, self->staged, self->n_staged);
    self->n_staged = 0;
    store_evict (self);
    if (first.code) {
        if (err)
            *err = first;
        return -first.code;
    }
    return done;
}

static void *
s_syncer (void *arg)
{
    kiln_store_t *self = arg;
    pthread_mutex_lock (&self->mu);
    while (true) {
        while (!self->todo && !self->stopping)
            pthread_cond_wait (&self->work, &self->mu);
        store_batch_t *b = self->todo;
        if (!b)
            break;                   /* stopping, and nothing left to do */
        self->todo = b->next;
        if (!self->todo)
            self->todo_tail = NULL;
        pthread_mutex_unlock (&self->mu);
        s_make_durable (self, b->staged, b->n, &b->err);
        pthread_mutex_lock (&self->mu);
        b->next = NULL;
        if (self->done_tail)
            self->done_tail->next = b;
        else
            self->done = b;
        self->done_tail = b;
        uint64_t one = 1;
        ssize_t ignored = write (self->efd, &one, sizeof one);
        (void) ignored;
    }
    pthread_mutex_unlock (&self->mu);
    return NULL;
}

uint64_t
kiln_store_commit_async (kiln_store_t *self, kiln_err_t *err)
{
    if (self->n_staged == 0)
        return 0;
    store_batch_t *b = calloc (1, sizeof *b);
    if (!b || (!self->syncer_started
               && pthread_create (&self->syncer, NULL, s_syncer, self) != 0)) {
        free (b);
        /* no thread: do it here */
        kiln_store_commit (self, err);
        self->durable = ++self->next_ticket;
        return self->durable;
    }
    self->syncer_started = true;
    b->ticket = ++self->next_ticket;
    b->staged = self->staged;
    b->n = self->n_staged;
    self->staged = NULL;
    self->n_staged = self->cap_staged = 0;
    pthread_mutex_lock (&self->mu);
    if (self->todo_tail)
        self->todo_tail->next = b;
    else
        self->todo = b;
    self->todo_tail = b;
    pthread_cond_signal (&self->work);
    pthread_mutex_unlock (&self->mu);
    return b->ticket;
}

int
kiln_store_commit_fd (const kiln_store_t *self)
{
    return self->efd;
}

uint64_t
kiln_store_commit_collect (kiln_store_t *self, kiln_err_t *err)
{
    uint64_t count;
    ssize_t ignored = read (self->efd, &count, sizeof count);
    (void) ignored;
    pthread_mutex_lock (&self->mu);
    store_batch_t *b = self->done;
    self->done = self->done_tail = NULL;
    pthread_mutex_unlock (&self->mu);
    bool reported = false;
    while (b) {
        store_batch_t *next = b->next;
        s_index_batch (self, b->staged, b->n);
        if (b->err.code && !reported && err) {
            *err = b->err;
            reported = true;
        }
        if (b->ticket > self->durable)
            self->durable = b->ticket;
        free (b->staged);
        free (b);
        b = next;
    }
    store_evict (self);
    return self->durable;
}

uint64_t
kiln_store_durable (const kiln_store_t *self)
{
    return self->durable;
}

uint64_t
kiln_store_last_ticket (const kiln_store_t *self)
{
    return self->next_ticket;
}
