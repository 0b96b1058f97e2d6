/*
 * kiln_artcache — verified artifacts shared between the models loaded
 * from one file.  The table is a short list (one entry per distinct file
 * loaded, not per model) under one mutex; reading and hashing a new file
 * happen outside it, so that loading one large model does not hold up
 * loads of others, and two loads of a new file at once settle on one
 * entry when the second finishes.
 */
#include "runtime/kiln_artcache.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kiln_fs.h"

typedef struct s_entry {
    struct s_entry *next;
    int fd;                     /* the file, open while the entry lives */
    struct stat st;             /* its identity when it was read */
    kiln_artifact_t *art;       /* verified members, maybe mapped */
    int refs;                   /* models holding it */
} s_entry_t;

struct kiln_artcache {
    pthread_mutex_t lock;       /* guards entries and every refs */
    s_entry_t *entries;
    kiln_artcache_mode_t mode;
    uint64_t phys;              /* the host's memory, bytes (0: unknown) */
};

int
kiln_artcache_mode (const char *value)
{
    if (!value || !value[0] || strcmp (value, "auto") == 0)
        return KILN_ARTCACHE_AUTO;
    if (strcmp (value, "0") == 0)
        return KILN_ARTCACHE_READ;
    if (strcmp (value, "1") == 0)
        return KILN_ARTCACHE_MAP;
    return -1;
}

uint64_t
kiln_artcache_read_max (uint64_t phys)
{
    uint64_t max = 1ull << 30;
    return phys && phys / 8 < max ? phys / 8 : max;
}

bool
kiln_artcache_maps (kiln_artcache_mode_t mode, uint64_t size, uint64_t phys)
{
    if (mode == KILN_ARTCACHE_AUTO)
        return size > kiln_artcache_read_max (phys);
    return mode == KILN_ARTCACHE_MAP;
}

kiln_artcache_t *
kiln_artcache_new (kiln_artcache_mode_t mode)
{
    kiln_artcache_t *self = calloc (1, sizeof *self);
    if (!self)
        return NULL;
    pthread_mutex_init (&self->lock, NULL);
    self->mode = mode;
    long pages = sysconf (_SC_PHYS_PAGES), page = sysconf (_SC_PAGESIZE);
    self->phys = pages > 0 && page > 0 ? (uint64_t) pages * (uint64_t) page : 0;
    return self;
}

void
kiln_artcache_destroy (kiln_artcache_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_artcache_t *self = *self_p;
    //  Models hold the runtime that holds the cache: none is left here.
    while (self->entries) {
        s_entry_t *e = self->entries;
        self->entries = e->next;
        kiln_artifact_destroy (&e->art);
        close (e->fd);
        free (e);
    }
    pthread_mutex_destroy (&self->lock);
    free (self);
    *self_p = NULL;
}

/* The entry for the file `st` describes, referenced; NULL when there is
 * none.  Under the lock. */
static s_entry_t *
s_lookup (kiln_artcache_t *self, const struct stat *st)
{
    for (s_entry_t *e = self->entries; e; e = e->next)
        if (kiln_file_unchanged (&e->st, st)) {
            e->refs++;
            return e;
        }
    return NULL;
}

/* Read and check the file open on `fd`; the artifact and its new entry
 * (which the caller inserts), or NULL. */
static s_entry_t *
s_read (kiln_artcache_t *self, int fd, const struct stat *st, const char *path,
        kiln_err_t *err)
{
    s_entry_t *e = calloc (1, sizeof *e);
    if (!e) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    bool map = kiln_artcache_maps (self->mode, (uint64_t) st->st_size, self->phys);
    e->art = kiln_artifact_read_fd (fd, path, map ? KILN_ARTIFACT_MAP : 0, err);
    if (!e->art) {
        free (e);
        return NULL;
    }
    //  What was read must be what `st` names, or a later load that finds
    //  the file as `st` describes it would share other bytes.
    struct stat after;
    if (fstat (fd, &after) != 0 || !kiln_file_unchanged (st, &after)) {
        kiln_artifact_destroy (&e->art);
        free (e);
        kiln_error (err, KILN_EVERIFY, "artifact '%s': the file changed while it "
                    "was being read", path);
        return NULL;
    }
    e->fd = fd;
    e->st = *st;
    e->refs = 1;
    return e;
}

/* Drop one reference to `e`; the last one unlinks and frees it.  Under
 * the lock. */
static void
s_unref (kiln_artcache_t *self, s_entry_t *e)
{
    if (--e->refs > 0)
        return;
    for (s_entry_t **p = &self->entries; *p; p = &(*p)->next)
        if (*p == e) {
            *p = e->next;
            break;
        }
    kiln_artifact_destroy (&e->art);
    close (e->fd);
    free (e);
}

kiln_artifact_t *
kiln_artcache_get (kiln_artcache_t *self, const char *path,
                   const char *keyring_dir, kiln_err_t *err)
{
    struct stat st;
    int fd = kiln_open_regular (path, "artifact", 0, &st, err);
    if (fd < 0)
        return NULL;
    pthread_mutex_lock (&self->lock);
    s_entry_t *e = s_lookup (self, &st);
    pthread_mutex_unlock (&self->lock);
    if (e)
        close (fd);
    else {
        if (!(e = s_read (self, fd, &st, path, err))) {
            close (fd);
            return NULL;
        }
        pthread_mutex_lock (&self->lock);
        s_entry_t *other = s_lookup (self, &st);
        if (other) {
            //  Another load of the same file finished first: share its
            //  entry, so that the file is held once.
            kiln_artifact_destroy (&e->art);
            close (e->fd);
            free (e);
            e = other;
        }
        else {
            e->next = self->entries;
            self->entries = e;
        }
        pthread_mutex_unlock (&self->lock);
    }
    //  Each load trusts its own keyring: the signature is checked every
    //  time, against the manifest the artifact holds.
    if (kiln_artifact_verify (e->art, keyring_dir, err)) {
        kiln_error_prefix (err, "artifact '%s'", path);
        pthread_mutex_lock (&self->lock);
        s_unref (self, e);
        pthread_mutex_unlock (&self->lock);
        return NULL;
    }
    return e->art;
}

void
kiln_artcache_put (kiln_artcache_t *self, kiln_artifact_t **art_p)
{
    if (!self || !art_p || !*art_p)
        return;
    pthread_mutex_lock (&self->lock);
    for (s_entry_t *e = self->entries; e; e = e->next)
        if (e->art == *art_p) {
            s_unref (self, e);
            break;
        }
    pthread_mutex_unlock (&self->lock);
    *art_p = NULL;
}
