/*
 * kiln_blobcache — verified blobs on the worker's disk, LRU under a cap.
 */
#include "worker/kiln_blobcache.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <czmq.h>

#include "common/kiln_fs.h"
#include "common/kiln_limits.h"
#include "common/kiln_log.h"

#define S_SYNC_EVERY (8u << 20)     /* start writeback of a growing blob this often */

typedef struct s_entry {
    char hex[KILN_HEX_LEN];
    uint64_t size;
    uint32_t pins;
    struct s_entry *prev, *next;     /* LRU: head least recently used */
} s_entry_t;

struct kiln_blobcache {
    char *dir;
    uint64_t max_bytes, bytes;
    zhashx_t *index;                 /* hex -> s_entry_t (owns) */
    s_entry_t *head, *tail;
    uint64_t seq;                    /* names temporary files */
};

struct kiln_blobcache_writer {
    uint8_t digest[KILN_DIGEST_LEN];
    uint64_t size, received, synced;
    kiln_sha256_t *sha;
    int fd;
    char tmp[PATH_MAX];
};

/* zhashx destructor: frees the entry and clears the table's slot. */
static void
s_entry_free (void **item)
{
    free (*item);
    *item = NULL;
}

static void
s_unlink_lru (kiln_blobcache_t *self, s_entry_t *e)
{
    if (e->prev)
        e->prev->next = e->next;
    else
        self->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        self->tail = e->prev;
    e->prev = e->next = NULL;
}

static void
s_append_lru (kiln_blobcache_t *self, s_entry_t *e)
{
    e->prev = self->tail;
    e->next = NULL;
    if (self->tail)
        self->tail->next = e;
    else
        self->head = e;
    self->tail = e;
}

static int
s_path (const kiln_blobcache_t *self, const char *hex, bool create, char *buf, size_t size,
        kiln_err_t *err)
{
    int n = snprintf (buf, size, "%s/%.2s", self->dir, hex);
    if (n < 0 || (size_t) n >= size)
        return kiln_error (err, KILN_ELIMIT, "cache path too long");
    if (create && kiln_mkdir_p (buf, 0700, err) != 0)
        return -err->code;
    if (snprintf (buf + n, size - (size_t) n, "/%s", hex) >= (int) (size - (size_t) n))
        return kiln_error (err, KILN_ELIMIT, "cache path too long");
    return 0;
}

static void
s_evict (kiln_blobcache_t *self)
{
    s_entry_t *e = self->head;
    while (e && self->bytes > self->max_bytes) {
        s_entry_t *next = e->next;
        if (e->pins == 0) {
            char path[PATH_MAX];
            if (s_path (self, e->hex, false, path, sizeof path, NULL) == 0)
                unlink (path);
            kiln_log_info ("blob cache: evicted %.12s (%llu bytes)", e->hex,
                           (unsigned long long) e->size);
            self->bytes -= e->size;
            s_unlink_lru (self, e);
            zhashx_delete (self->index, e->hex);
        }
        e = next;
    }
}

static void
s_add (kiln_blobcache_t *self, const char *hex, uint64_t size)
{
    s_entry_t *e = zhashx_lookup (self->index, hex);
    if (e) {
        s_unlink_lru (self, e);
        s_append_lru (self, e);
        return;
    }
    if (!(e = calloc (1, sizeof *e)))
        return;
    memcpy (e->hex, hex, KILN_HEX_LEN);
    e->size = size;
    zhashx_insert (self->index, e->hex, e);
    s_append_lru (self, e);
    self->bytes += size;
}

kiln_blobcache_t *
kiln_blobcache_new (const char *dir, uint64_t max_bytes, kiln_err_t *err)
{
    char tmp[PATH_MAX];
    if (snprintf (tmp, sizeof tmp, "%s/tmp", dir) >= (int) sizeof tmp) {
        kiln_error (err, KILN_ELIMIT, "cache path too long: '%s'", dir);
        return NULL;
    }
    if (kiln_mkdir_p (tmp, 0700, err) != 0)
        return NULL;
    kiln_blobcache_t *self = calloc (1, sizeof *self);
    if (!self || !(self->dir = strdup (dir)) || !(self->index = zhashx_new ())) {
        if (self)
            free (self->dir);
        free (self);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    zhashx_set_destructor (self->index, s_entry_free);
    self->max_bytes = max_bytes;
    /* Leftovers of interrupted downloads go; whole blobs are indexed. */
    DIR *d = opendir (tmp);
    struct dirent *de;
    while (d && (de = readdir (d))) {
        char path[PATH_MAX];
        if (de->d_name[0] != '.'
            && snprintf (path, sizeof path, "%s/%s", tmp, de->d_name) < (int) sizeof path)
            unlink (path);
    }
    if (d)
        closedir (d);
    d = opendir (dir);
    while (d && (de = readdir (d))) {
        if (strlen (de->d_name) != 2 || !isxdigit ((unsigned char) de->d_name[0]))
            continue;
        char sub[PATH_MAX];
        if (snprintf (sub, sizeof sub, "%s/%s", dir, de->d_name) >= (int) sizeof sub)
            continue;
        DIR *s = opendir (sub);
        struct dirent *fe;
        while (s && (fe = readdir (s))) {
            char path[PATH_MAX];
            struct stat st;
            if (kiln_is_digest_hex (fe->d_name)
                && snprintf (path, sizeof path, "%s/%s", sub, fe->d_name) < (int) sizeof path
                && stat (path, &st) == 0 && S_ISREG (st.st_mode))
                s_add (self, fe->d_name, (uint64_t) st.st_size);
        }
        if (s)
            closedir (s);
    }
    if (d)
        closedir (d);
    s_evict (self);
    return self;
}

void
kiln_blobcache_destroy (kiln_blobcache_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    zhashx_destroy (&(*self_p)->index);
    free ((*self_p)->dir);
    free (*self_p);
    *self_p = NULL;
}

bool
kiln_blobcache_has (kiln_blobcache_t *self, const uint8_t digest[KILN_DIGEST_LEN])
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    s_entry_t *e = zhashx_lookup (self->index, hex);
    if (!e)
        return false;
    s_unlink_lru (self, e);
    s_append_lru (self, e);
    return true;
}

int
kiln_blobcache_path (const kiln_blobcache_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                     char *buf, size_t size, kiln_err_t *err)
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    return s_path (self, hex, false, buf, size, err);
}

void
kiln_blobcache_pin (kiln_blobcache_t *self, const uint8_t digest[KILN_DIGEST_LEN])
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    s_entry_t *e = zhashx_lookup (self->index, hex);
    if (e)
        e->pins++;
}

void
kiln_blobcache_unpin (kiln_blobcache_t *self, const uint8_t digest[KILN_DIGEST_LEN])
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    s_entry_t *e = zhashx_lookup (self->index, hex);
    if (e && e->pins)
        e->pins--;
}

kiln_blobcache_writer_t *
kiln_blobcache_begin (kiln_blobcache_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                      uint64_t size, kiln_err_t *err)
{
    if (size > KILN_MAX_BLOB_BYTES) {
        kiln_error (err, KILN_ELIMIT, "blob of %llu bytes is over the limit of %llu",
                    (unsigned long long) size, KILN_MAX_BLOB_BYTES);
        return NULL;
    }
    kiln_blobcache_writer_t *w = calloc (1, sizeof *w);
    if (!w || !(w->sha = kiln_sha256_new ())) {
        free (w);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    memcpy (w->digest, digest, KILN_DIGEST_LEN);
    w->size = size;
    snprintf (w->tmp, sizeof w->tmp, "%s/tmp/%d-%llu", self->dir, (int) getpid (),
              (unsigned long long) ++self->seq);
    w->fd = open (w->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (w->fd < 0) {
        kiln_error (err, KILN_EIO, "could not create '%s': %s", w->tmp, strerror (errno));
        kiln_sha256_destroy (&w->sha);
        free (w);
        return NULL;
    }
    if (size > 0 && posix_fallocate (w->fd, 0, (off_t) size) != 0) {
        kiln_error (err, KILN_EIO, "no room for a %llu-byte blob in '%s'",
                    (unsigned long long) size, self->dir);
        kiln_blobcache_abort (&w);
        return NULL;
    }
    return w;
}

int
kiln_blobcache_write (kiln_blobcache_writer_t *w, uint64_t offset, const void *data,
                      size_t len, kiln_err_t *err)
{
    if (offset != w->received || len > w->size - w->received)
        return kiln_error (err, KILN_EPROTO, "blob chunk at offset %llu (%zu bytes) does not "
                           "follow the %llu bytes received of %llu",
                           (unsigned long long) offset, len, (unsigned long long) w->received,
                           (unsigned long long) w->size);
    const uint8_t *p = data;
    size_t left = len;
    while (left > 0) {
        ssize_t n = write (w->fd, p, left);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return kiln_error (err, KILN_EIO, "could not write '%s': %s", w->tmp,
                               strerror (errno));
        p += n;
        left -= (size_t) n;
    }
    kiln_sha256_update (w->sha, data, len);
    w->received += len;
    if (w->received - w->synced >= S_SYNC_EVERY) {
        sync_file_range (w->fd, (off_t) w->synced, (off_t) (w->received - w->synced),
                         SYNC_FILE_RANGE_WRITE);
        w->synced = w->received;
    }
    return 0;
}

uint64_t
kiln_blobcache_received (const kiln_blobcache_writer_t *w)
{
    return w->received;
}

void
kiln_blobcache_abort (kiln_blobcache_writer_t **w_p)
{
    kiln_blobcache_writer_t *w = w_p ? *w_p : NULL;
    if (!w)
        return;
    if (w->fd >= 0)
        close (w->fd);
    unlink (w->tmp);
    kiln_sha256_destroy (&w->sha);
    free (w);
    *w_p = NULL;
}

int
kiln_blobcache_finish (kiln_blobcache_t *self, kiln_blobcache_writer_t **w_p, kiln_err_t *err)
{
    kiln_blobcache_writer_t *w = *w_p;
    char hex[KILN_HEX_LEN], path[PATH_MAX];
    kiln_hex (w->digest, KILN_DIGEST_LEN, hex);
    int rc = 0;
    uint8_t got[KILN_DIGEST_LEN];
    if (w->received != w->size) {
        rc = kiln_error (err, KILN_EPROTO, "blob %s: %llu of %llu bytes received", hex,
                         (unsigned long long) w->received, (unsigned long long) w->size);
        goto done;
    }
    kiln_sha256_final (&w->sha, got);
    if (memcmp (got, w->digest, KILN_DIGEST_LEN) != 0) {
        rc = kiln_error (err, KILN_EVERIFY, "blob %s from the broker does not match its digest",
                         hex);
        goto done;
    }
    /* On disk before it has its name: after a power cut a file named by
     * its digest must hold those bytes, since a blob found in the cache is
     * not hashed again and a damaged one would be compiled into an
     * artifact, not refused.  Writeback started as the chunks came, so
     * this mostly waits for the tail. */
    if (fsync (w->fd) != 0) {
        rc = kiln_error (err, KILN_EIO, "could not write '%s': %s", w->tmp, strerror (errno));
        goto done;
    }
    if ((rc = s_path (self, hex, true, path, sizeof path, err)) != 0)
        goto done;
    if (rename (w->tmp, path) != 0) {
        rc = kiln_error (err, KILN_EIO, "could not rename onto '%s': %s", path,
                         strerror (errno));
        goto done;
    }
    s_add (self, hex, w->size);
    s_evict (self);
done:
    kiln_blobcache_abort (w_p);
    return rc;
}

int
kiln_blobcache_put (kiln_blobcache_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                    const void *data, size_t len, kiln_err_t *err)
{
    if (kiln_blobcache_has (self, digest))
        return 0;
    kiln_blobcache_writer_t *w = kiln_blobcache_begin (self, digest, len, err);
    if (!w)
        return -err->code;
    if (kiln_blobcache_write (w, 0, data, len, err) != 0) {
        kiln_blobcache_abort (&w);
        return -err->code;
    }
    return kiln_blobcache_finish (self, &w, err);
}

size_t
kiln_blobcache_list (const kiln_blobcache_t *self, uint8_t (*digests)[KILN_DIGEST_LEN],
                     uint64_t *sizes, size_t max)
{
    size_t n = 0;
    for (s_entry_t *e = self->tail; e && n < max; e = e->prev) {
        kiln_unhex (e->hex, digests[n], KILN_DIGEST_LEN);
        sizes[n++] = e->size;
    }
    return n;
}

size_t
kiln_blobcache_count (const kiln_blobcache_t *self)
{
    return zhashx_size (self->index);
}

uint64_t
kiln_blobcache_bytes (const kiln_blobcache_t *self)
{
    return self->bytes;
}
