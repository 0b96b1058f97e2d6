/*
 * kiln_statcache — SHA-256 of file ranges by file identity (see the
 * header for what makes a hit safe).
 */
#include "common/kiln_statcache.h"

#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/kiln_fs.h"
#include "common/kiln_log.h"

#define S_LINE_MAX  200                                /* bytes of one entry's line */
#define S_FILE_MAX  ((uint64_t) KILN_STATCACHE_MAX * S_LINE_MAX)

typedef struct {
    uint64_t dev, ino, size;
    int64_t mtime_ns, ctime_ns;
    uint64_t offset, length;
    uint8_t digest[KILN_DIGEST_LEN];
} s_entry_t;

struct kiln_statcache {
    char *path;                      /* the cache file, owned */
    s_entry_t *entries;              /* oldest first */
    size_t n;
    bool dirty;                      /* something to save */
    uint64_t hits, misses;
};

static int64_t
s_ns (const struct timespec *ts)
{
    return (int64_t) ts->tv_sec * 1000000000LL + ts->tv_nsec;
}

int64_t
kiln_statcache_now_ns (void)
{
    struct timespec ts;
    clock_gettime (CLOCK_REALTIME, &ts);
    return s_ns (&ts);
}

/* The entry of `st`'s file as a key (digest left out). */
static s_entry_t
s_key (const struct stat *st, uint64_t offset, uint64_t length)
{
    return (s_entry_t) { .dev = (uint64_t) st->st_dev, .ino = (uint64_t) st->st_ino,
                         .size = (uint64_t) st->st_size, .mtime_ns = s_ns (&st->st_mtim),
                         .ctime_ns = s_ns (&st->st_ctim), .offset = offset,
                         .length = length };
}

static bool
s_same_identity (const s_entry_t *a, const s_entry_t *b)
{
    return a->dev == b->dev && a->ino == b->ino && a->size == b->size
           && a->mtime_ns == b->mtime_ns && a->ctime_ns == b->ctime_ns
           && a->offset == b->offset && a->length == b->length;
}

/* Parse the lines of the cache file; a line that does not parse is
 * dropped, whatever follows it is still read. */
static void
s_parse (kiln_statcache_t *self, char *text)
{
    for (char *line = text, *next; line && *line && self->n < KILN_STATCACHE_MAX;
         line = next) {
        next = strchr (line, '\n');
        if (next)
            *next++ = '\0';
        s_entry_t e;
        char hex[KILN_HEX_LEN + 1];
        int used = 0;
        if (sscanf (line, "%" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNd64 " %" SCNd64
                    " %" SCNu64 " %" SCNu64 " %64s%n", &e.dev, &e.ino, &e.size, &e.mtime_ns,
                    &e.ctime_ns, &e.offset, &e.length, hex, &used) != 8
            || line[used] != '\0' || strlen (hex) != KILN_HEX_LEN - 1
            || kiln_unhex (hex, e.digest, KILN_DIGEST_LEN) != 0
            || e.offset > e.size || e.length > e.size - e.offset)
            continue;
        self->entries[self->n++] = e;
    }
}

kiln_statcache_t *
kiln_statcache_load (const char *path)
{
    kiln_statcache_t *self = calloc (1, sizeof *self);
    if (!self || !(self->path = strdup (path))
        || !(self->entries = calloc (KILN_STATCACHE_MAX, sizeof *self->entries))) {
        kiln_statcache_destroy (&self);
        return NULL;
    }
    /* Only the user's own regular file: a cache someone else can write
     * could name any digest for our weights. */
    struct stat st;
    if (lstat (path, &st) != 0)
        return self;
    if (!S_ISREG (st.st_mode) || !kiln_stat_private (&st)) {
        kiln_log_warn ("ignoring the import cache '%s': not a regular file of ours that "
                       "only we can write", path);
        return self;
    }
    uint8_t *data = NULL;
    size_t len = 0;
    kiln_err_t err = { 0 };
    if (kiln_read_file_flags (path, O_NOFOLLOW, S_FILE_MAX, &data, &len, &err) != 0) {
        kiln_log_warn ("ignoring the import cache: %s", err.msg);
        return self;
    }
    s_parse (self, (char *) data);
    free (data);
    return self;
}

kiln_statcache_t *
kiln_statcache_default (void)
{
    const char *env = getenv ("KILN_IMPORT_CACHE");
    if (env && (strcmp (env, "0") == 0 || strcmp (env, "off") == 0))
        return NULL;
    char dir[PATH_MAX], path[PATH_MAX + 32];
    kiln_err_t err = { 0 };
    if (kiln_cache_dir (dir, sizeof dir, &err) != 0)
        return NULL;
    snprintf (path, sizeof path, "%s/import-digests", dir);
    return kiln_statcache_load (path);
}

void
kiln_statcache_save (kiln_statcache_t *self)
{
    if (!self || !self->dirty)
        return;
    kiln_err_t err = { 0 };
    char dir[PATH_MAX];
    kiln_dirname (self->path, dir, sizeof dir);
    char *text = malloc (self->n * S_LINE_MAX + 1);
    size_t len = 0;
    if (!text) {
        kiln_log_warn ("could not save the import cache '%s': out of memory", self->path);
        return;
    }
    for (size_t i = 0; i < self->n; i++) {
        const s_entry_t *e = &self->entries[i];
        char hex[KILN_HEX_LEN];
        kiln_hex (e->digest, KILN_DIGEST_LEN, hex);
        len += (size_t) snprintf (text + len, S_LINE_MAX, "%" PRIu64 " %" PRIu64 " %" PRIu64
                                  " %" PRId64 " %" PRId64 " %" PRIu64 " %" PRIu64 " %s\n",
                                  e->dev, e->ino, e->size, e->mtime_ns, e->ctime_ns,
                                  e->offset, e->length, hex);
    }
    if (kiln_mkdir_p (dir, 0700, &err) != 0
        || kiln_write_file_atomic (self->path, text, len, 0600, &err) != 0)
        kiln_log_warn ("could not save the import cache: %s", err.msg);
    else
        self->dirty = false;
    free (text);
}

void
kiln_statcache_destroy (kiln_statcache_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    free ((*self_p)->path);
    free ((*self_p)->entries);
    free (*self_p);
    *self_p = NULL;
}

bool
kiln_statcache_lookup (kiln_statcache_t *self, const struct stat *st, uint64_t offset,
                       uint64_t length, uint8_t out[KILN_DIGEST_LEN])
{
    if (!self)
        return false;
    s_entry_t key = s_key (st, offset, length);
    for (size_t i = 0; i < self->n; i++)
        if (s_same_identity (&self->entries[i], &key)) {
            memcpy (out, self->entries[i].digest, KILN_DIGEST_LEN);
            self->hits++;
            return true;
        }
    self->misses++;
    return false;
}

bool
kiln_statcache_remember (kiln_statcache_t *self, const struct stat *before,
                         const struct stat *after, int64_t hash_start_ns, uint64_t offset,
                         uint64_t length, const uint8_t digest[KILN_DIGEST_LEN])
{
    if (!self || !kiln_file_unchanged (before, after))
        return false;
    s_entry_t e = s_key (before, offset, length);
    int64_t bound = hash_start_ns - KILN_STATCACHE_RACY_NS;
    if (e.mtime_ns >= bound || e.ctime_ns >= bound)
        return false;                        /* racily clean: hash it again next time */
    memcpy (e.digest, digest, KILN_DIGEST_LEN);
    /* The same range of the same inode replaces its older entry; when
     * full, the oldest entry goes. */
    size_t i = 0;
    while (i < self->n && !(self->entries[i].dev == e.dev && self->entries[i].ino == e.ino
                            && self->entries[i].offset == e.offset
                            && self->entries[i].length == e.length))
        i++;
    if (i == self->n && self->n == KILN_STATCACHE_MAX)
        i = 0;
    if (i < self->n) {
        memmove (&self->entries[i], &self->entries[i + 1],
                 (self->n - i - 1) * sizeof *self->entries);
        self->n--;
    }
    self->entries[self->n++] = e;
    self->dirty = true;
    return true;
}

void
kiln_statcache_counts (const kiln_statcache_t *self, uint64_t *hits, uint64_t *misses)
{
    *hits = self ? self->hits : 0;
    *misses = self ? self->misses : 0;
}
