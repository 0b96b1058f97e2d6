/*
 * kiln_member_cache — large artifact members on the client by digest
 * (see the header).
 */
#include "client/kiln_member_cache.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/kiln_fs.h"
#include "common/kiln_limits.h"
#include "common/kiln_log.h"

#define S_STALE_TMP_S 3600           /* an unfinished copy older than this is removed */

struct kiln_mcache {
    char dir[PATH_MAX];
    uint64_t max_bytes;
};

typedef struct {
    char hex[KILN_HEX_LEN];
    uint64_t size;
    struct timespec mtime;
} s_entry_t;

/* This user's alone: owned by the effective user, nobody else may write. */
kiln_mcache_t *
kiln_mcache_open (const char *dir, uint64_t max_bytes)
{
    kiln_err_t err = { 0 };
    if (max_bytes == 0 || kiln_mkdir_p (dir, 0700, &err) != 0)
        return NULL;
    struct stat st;
    if (lstat (dir, &st) != 0 || !S_ISDIR (st.st_mode) || !kiln_stat_private (&st)) {
        kiln_log_warn ("ignoring the member cache '%s': not a directory of this user's "
                       "that only it may write", dir);
        return NULL;
    }
    kiln_mcache_t *self = calloc (1, sizeof *self);
    if (!self)
        return NULL;
    if (snprintf (self->dir, sizeof self->dir, "%s", dir) >= (int) sizeof self->dir) {
        free (self);
        return NULL;
    }
    self->max_bytes = max_bytes;
    return self;
}

kiln_mcache_t *
kiln_mcache_default (void)
{
    const char *env = getenv ("KILN_MEMBER_CACHE");
    if (env && (strcmp (env, "0") == 0 || strcmp (env, "off") == 0))
        return NULL;
    uint64_t max = KILN_MCACHE_DEFAULT_MAX;
    if ((env = getenv ("KILN_MEMBER_CACHE_MAX")) && *env) {
        long long v = kiln_parse_number (env, 0, (long long) (1ULL << 50));
        if (v < 0) {
            kiln_log_warn ("KILN_MEMBER_CACHE_MAX='%.40s' is not a size; the member cache "
                           "is off", env);
            return NULL;
        }
        max = (uint64_t) v;
    }
    char dir[PATH_MAX], path[PATH_MAX + 16];
    kiln_err_t err = { 0 };
    if (kiln_cache_dir (dir, sizeof dir, &err) != 0)
        return NULL;
    if (snprintf (path, sizeof path, "%s/members", dir) >= (int) sizeof path)
        return NULL;
    return kiln_mcache_open (path, max);
}

void
kiln_mcache_destroy (kiln_mcache_t **self_p)
{
    if (self_p && *self_p) {
        free (*self_p);
        *self_p = NULL;
    }
}

static bool
s_name_ok (const char *name)
{
    return strlen (name) == KILN_HEX_LEN - 1 && kiln_is_digest_hex (name);
}

/* Newest first. */
static int
s_by_mtime (const void *a, const void *b)
{
    const struct timespec *x = &((const s_entry_t *) a)->mtime;
    const struct timespec *y = &((const s_entry_t *) b)->mtime;
    if (x->tv_sec != y->tv_sec)
        return x->tv_sec < y->tv_sec ? 1 : -1;
    return x->tv_nsec < y->tv_nsec ? 1 : x->tv_nsec > y->tv_nsec ? -1 : 0;
}

/* The entries (at most KILN_MCACHE_MAX_SCAN), newest first; caller frees. */
static s_entry_t *
s_scan (kiln_mcache_t *self, size_t *n)
{
    *n = 0;
    DIR *d = opendir (self->dir);
    if (!d)
        return NULL;
    s_entry_t *all = calloc (KILN_MCACHE_MAX_SCAN, sizeof *all);
    struct dirent *de;
    time_t now = time (NULL);
    while (all && *n < KILN_MCACHE_MAX_SCAN && (de = readdir (d))) {
        struct stat st;
        /* a copy a process left unfinished (it died): gone after an hour */
        if (strncmp (de->d_name, ".tmp-", 5) == 0
            && fstatat (dirfd (d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0
            && S_ISREG (st.st_mode) && now - st.st_mtime > S_STALE_TMP_S) {
            unlinkat (dirfd (d), de->d_name, 0);
            continue;
        }
        if (!s_name_ok (de->d_name)
            || fstatat (dirfd (d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0
            || !S_ISREG (st.st_mode) || !kiln_stat_private (&st))
            continue;
        s_entry_t *e = &all[(*n)++];
        memcpy (e->hex, de->d_name, KILN_HEX_LEN);
        e->size = (uint64_t) st.st_size;
        e->mtime = st.st_mtim;
    }
    closedir (d);
    if (all)
        qsort (all, *n, sizeof *all, s_by_mtime);
    return all;
}

size_t
kiln_mcache_recent (kiln_mcache_t *self, kiln_blob_ref_t *out, size_t max)
{
    size_t n = 0, k = 0;
    s_entry_t *all = self ? s_scan (self, &n) : NULL;
    for (size_t i = 0; i < n && k < max; i++) {
        if (all[i].size < KILN_MCACHE_MIN_BYTES || all[i].size > KILN_MAX_MEMBER_BYTES)
            continue;
        kiln_unhex (all[i].hex, out[k].digest, KILN_DIGEST_LEN);
        out[k].size = all[i].size;
        out[k].in_msg = false;
        k++;
    }
    free (all);
    return k;
}

uint64_t
kiln_mcache_bytes (kiln_mcache_t *self)
{
    size_t n = 0;
    uint64_t total = 0;
    s_entry_t *all = s_scan (self, &n);
    for (size_t i = 0; i < n; i++)
        total += all[i].size;
    free (all);
    return total;
}

static int
s_path (const kiln_mcache_t *self, const char *hex, char *buf, size_t size)
{
    if (!kiln_is_digest_hex (hex))
        return -1;
    return snprintf (buf, size, "%s/%.64s", self->dir, hex) < (int) size ? 0 : -1;
}

int
kiln_mcache_open_member (kiln_mcache_t *self, const char *hex, uint64_t size)
{
    char path[PATH_MAX + 80];
    if (!self || s_path (self, hex, path, sizeof path) != 0)
        return -1;
    int fd = open (path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    if (fd < 0)
        return -1;
    if (fstat (fd, &st) != 0 || !S_ISREG (st.st_mode) || !kiln_stat_private (&st)
        || (uint64_t) st.st_size != size) {
        close (fd);
        return -1;
    }
    futimens (fd, NULL);                 /* used now (the LRU order) */
    return fd;
}

void
kiln_mcache_drop (kiln_mcache_t *self, const char *hex)
{
    char path[PATH_MAX + 80];
    if (self && s_path (self, hex, path, sizeof path) == 0)
        unlink (path);
}

/* Remove the least recently used entries until `incoming` more bytes fit. */
static void
s_evict (kiln_mcache_t *self, uint64_t incoming)
{
    size_t n = 0;
    s_entry_t *all = s_scan (self, &n);
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += all[i].size;
    for (size_t i = n; i-- > 0 && total + incoming > self->max_bytes;) {
        kiln_mcache_drop (self, all[i].hex);
        total -= all[i].size;
    }
    free (all);
}

/* Copy len bytes at offset of src into dst (at 0): copy_file_range
 * (which reflinks where it can), else read and write. */
static int
s_copy (int src, uint64_t offset, uint64_t len, int dst)
{
    loff_t in = (loff_t) offset, out = 0;
    uint64_t done = 0;
    while (done < len) {
        ssize_t k = copy_file_range (src, &in, dst, &out, (size_t) (len - done), 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            break;
        done += (uint64_t) k;
    }
    if (done == len)
        return 0;
    uint8_t *buf = malloc (KILN_CHUNK_BYTES);
    if (!buf)
        return -1;
    while (done < len) {
        uint64_t want = len - done < KILN_CHUNK_BYTES ? len - done : KILN_CHUNK_BYTES;
        int64_t k = kiln_pread_all (src, buf, want, offset + done);
        if (k != (int64_t) want || pwrite (dst, buf, (size_t) want, (off_t) done) != (ssize_t) want)
            break;
        done += want;
    }
    free (buf);
    return done == len ? 0 : -1;
}

bool
kiln_mcache_put (kiln_mcache_t *self, int src_fd, uint64_t offset, uint64_t len,
                 const char *hex)
{
    char path[PATH_MAX + 80], tmp[PATH_MAX + 96];
    if (!self || len < KILN_MCACHE_MIN_BYTES || len > self->max_bytes
        || s_path (self, hex, path, sizeof path) != 0)
        return false;
    int have = kiln_mcache_open_member (self, hex, len);
    if (have >= 0) {
        close (have);
        return true;
    }
    s_evict (self, len);
    snprintf (tmp, sizeof tmp, "%s/.tmp-XXXXXX", self->dir);
    int fd = mkostemp (tmp, O_CLOEXEC);
    if (fd < 0)
        return false;
    bool ok = fchmod (fd, 0600) == 0 && s_copy (src_fd, offset, len, fd) == 0;
    close (fd);
    if (ok && rename (tmp, path) == 0)
        return true;
    kiln_log_warn ("could not keep member %.12s in the cache '%s'", hex, self->dir);
    unlink (tmp);
    return false;
}
