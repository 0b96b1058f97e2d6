/*
 * kiln_store — content-addressed artifacts and blobs, the action cache
 * and the failure cache on disk, with group commit and an LRU size cap.
 */
#include "broker/kiln_store.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <czmq.h>
#include <jansson.h>
#include <pthread.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_fs.h"
#include "common/kiln_limits.h"
#include "common/kiln_log.h"

#define S_MAX_ENTRIES     (4u << 20)      /* indexed entries, whatever their size */
#define S_SYNC_EVERY      (8u << 20)      /* push a growing blob to disk this often */
#define S_TOUCH_EVERY_S   60              /* persist "last used" at most this often */
#define S_MAX_FAIL_BYTES  (KILN_MAX_LOG_BYTES * 7 + 65536)   /* JSON-escaped log and all */

/* What an indexed entry is; its letter prefixes its key in the index. */
typedef enum { S_ART, S_BLOB, S_FAIL, S_ACTION } s_kind_t;
static const char s_kind_letter[] = { 'a', 'b', 'f', 'c' };
static const char *s_kind_dir[] = { "cas/sha256", "blobs/sha256", "fail", "ac" };
static const char *s_kind_name[] = { "artifact", "blob", "failure record", "action record" };

typedef struct s_entry {
    char key[KILN_HEX_LEN + 2];      /* "<letter><hex>" */
    s_kind_t kind;
    uint64_t size;                   /* bytes counted against the cap */
    uint32_t pins;                   /* jobs that need it (blobs) */
    int64_t touched;                 /* time (s) its mtime was last set */
    struct s_entry *prev, *next;     /* LRU list: head is the least recently used */
} s_entry_t;

typedef struct {
    s_kind_t kind;
    char hex[KILN_HEX_LEN];          /* name */
    char tmp[PATH_MAX];              /* written here */
    int fd;                          /* open until commit */
    uint64_t size;
} s_staged_t;

struct kiln_store {
    char *root;                      /* the state directory */
    char *keyring;                   /* STATE/keyring once a key is trusted, else NULL */
    uint64_t max_bytes;              /* the cap */
    uint64_t bytes;                  /* indexed bytes */
    uint64_t counts[3];              /* entries per kind (S_ART, S_BLOB, S_FAIL) */
    uint64_t evicted;
    zhashx_t *index;                 /* key -> s_entry_t (owns) */
    s_entry_t *lru_head, *lru_tail;
    s_staged_t *staged;              /* owned, n_staged used */
    size_t n_staged, cap_staged;
    uint64_t tmp_seq;                /* names files in STATE/tmp */
    /* Commits made durable by the syncer thread (kiln_store_commit_async). */
    pthread_t syncer;
    bool syncer_started, stopping;
    pthread_mutex_t mu;
    pthread_cond_t work;
    struct s_batch *todo, *todo_tail;   /* for the syncer, in ticket order */
    struct s_batch *done, *done_tail;   /* for kiln_store_commit_collect */
    int efd;                         /* eventfd: a batch is durable */
    uint64_t next_ticket, durable;
    /* Blob writers with news for the caller's loop (kiln_store_upload_poll). */
    pthread_mutex_t news_mu;
    struct kiln_blob_writer *news, *news_tail;
    int upload_efd;                  /* eventfd: there is news */
};

/* Staged writes handed to the syncer. */
typedef struct s_batch {
    uint64_t ticket;
    s_staged_t *staged;              /* owned */
    size_t n;
    kiln_err_t err;                  /* the first failure */
    struct s_batch *next;
} s_batch_t;

/* A blob being received.  The broker's loop hands it the chunks (their
 * frames, no copy) and goes on at once: two threads of the writer's own
 * take each chunk, one hashing it and one writing it, side by side.  A
 * chunk's frame goes once both are done with it; that is when the loop
 * may grant its credit again, so the memory an upload holds stays within
 * the credit window (`cap` chunks).  When the last chunk is handed over
 * the threads finish on their own (digest checked, file truncated and
 * fsynced) and the loop hears of it through the store's upload eventfd,
 * so a 1 GiB upload never holds up the broker's loop.  The file is
 * written with O_DIRECT where the file system allows it (no copy into the
 * page cache, the slowest step on small VMs), else through the page cache
 * with early writeback. */
#define S_DEFAULT_CHUNKS 16          /* chunks in flight when the caller sets none */
#define S_ALIGN 4096
#define S_MAX_NEWS_PER_POLL 4096     /* writers handled per kiln_store_upload_poll */

struct kiln_blob_writer {
    kiln_store_t *store;
    void *tag;                       /* the caller's, given back by upload_poll */
    uint8_t digest[KILN_DIGEST_LEN];
    uint64_t size;                   /* announced */
    uint64_t received;               /* bytes handed over (the caller's) */
    int fd;
    bool direct;                     /* fd has O_DIRECT */
    char tmp[PATH_MAX];
    /* shared with the threads, under mu */
    pthread_t hasher, writer;
    bool hasher_started, writer_started;
    pthread_mutex_t mu;
    pthread_cond_t work;             /* threads wait for chunks or the end */
    pthread_cond_t room;             /* the caller waits for room or done */
    zframe_t **ring;                 /* chunk i at ring[i % cap] */
    size_t cap;
    uint64_t pushed, hashed, written;   /* chunks */
    bool closing;                    /* no more chunks: finish */
    bool abort;                      /* stop at once */
    bool hash_done, done;
    int error;                       /* KILN_E*, 0 = none */
    char errmsg[PATH_MAX + 128];
    uint8_t got[KILN_DIGEST_LEN];    /* the digest of what came, once hash_done */
    /* the hasher's own */
    kiln_sha256_t *sha;
    /* the writer thread's own */
    uint8_t *bounce;                 /* S_ALIGN-aligned, for O_DIRECT */
    uint64_t bytes_written, synced;
    /* on the store's news list, under the store's news_mu */
    bool in_news;
    struct kiln_blob_writer *news_next;
};

/* zhashx destructor: frees the entry and clears the table's slot. */
static void
s_entry_free (void **item)
{
    free (*item);
    *item = NULL;
}

/* --- paths ------------------------------------------------------------------- */

static int
s_path (const kiln_store_t *self, s_kind_t kind, const char *hex, bool create_dir,
        char *out, size_t size, kiln_err_t *err)
{
    if (!kiln_is_digest_hex (hex))
        return kiln_error (err, KILN_EINVAL, "'%.80s' is not a SHA-256 in hex", hex);
    bool fanout = kind == S_ART || kind == S_BLOB;
    int n = fanout ? snprintf (out, size, "%s/%s/%.2s", self->root, s_kind_dir[kind], hex)
                   : snprintf (out, size, "%s/%s", self->root, s_kind_dir[kind]);
    if (n < 0 || (size_t) n >= size)
        return kiln_error (err, KILN_ELIMIT, "store path too long");
    if (create_dir && fanout && kiln_mkdir_p (out, 0755, err) != 0)
        return -err->code;
    n = snprintf (out + n, size - (size_t) n, "/%s", hex);
    if (n < 0 || (size_t) n >= size)
        return kiln_error (err, KILN_ELIMIT, "store path too long");
    return 0;
}

static void
s_fsync_dir (const char *path)
{
    int fd = open (path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync (fd);
        close (fd);
    }
}

/* The directory part of `path` into buf. */
static void
s_dirname (const char *path, char *buf, size_t size)
{
    snprintf (buf, size, "%s", path);
    char *slash = strrchr (buf, '/');
    if (slash)
        *slash = '\0';
}

/* --- the index ---------------------------------------------------------------- */

static void
s_lru_unlink (kiln_store_t *self, s_entry_t *e)
{
    if (e->prev)
        e->prev->next = e->next;
    else
        self->lru_head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        self->lru_tail = e->prev;
    e->prev = e->next = NULL;
}

static void
s_lru_append (kiln_store_t *self, s_entry_t *e)
{
    e->prev = self->lru_tail;
    e->next = NULL;
    if (self->lru_tail)
        self->lru_tail->next = e;
    else
        self->lru_head = e;
    self->lru_tail = e;
}

static void
s_key (s_kind_t kind, const char *hex, char key[KILN_HEX_LEN + 2])
{
    key[0] = s_kind_letter[kind];
    memcpy (key + 1, hex, KILN_HEX_LEN);
}

static s_entry_t *
s_find (const kiln_store_t *self, s_kind_t kind, const char *hex)
{
    char key[KILN_HEX_LEN + 2];
    s_key (kind, hex, key);
    return zhashx_lookup (self->index, key);
}

/* Index an entry (or update its size), as the most recently used. */
static void
s_index (kiln_store_t *self, s_kind_t kind, const char *hex, uint64_t size, int64_t touched)
{
    s_entry_t *e = s_find (self, kind, hex);
    if (e) {
        self->bytes -= e->size;
        s_lru_unlink (self, e);
    }
    else {
        if (!(e = calloc (1, sizeof *e)))
            return;          /* unindexed: never evicted, still served */
        s_key (kind, hex, e->key);
        e->kind = kind;
        zhashx_insert (self->index, e->key, e);
        self->counts[kind]++;
    }
    e->size = size;
    e->touched = touched;
    self->bytes += size;
    s_lru_append (self, e);
}

static void
s_unindex (kiln_store_t *self, s_entry_t *e)
{
    self->bytes -= e->size;
    self->counts[e->kind]--;
    s_lru_unlink (self, e);
    zhashx_delete (self->index, e->key);      /* frees e */
}

/* Mark an entry used: the tail of the LRU list, and now and then its
 * mtime, so that the order survives a restart. */
static void
s_touch (kiln_store_t *self, s_entry_t *e, const char *path)
{
    s_lru_unlink (self, e);
    s_lru_append (self, e);
    int64_t now = (int64_t) time (NULL);
    if (path && now - e->touched >= S_TOUCH_EVERY_S) {
        utimensat (AT_FDCWD, path, NULL, 0);
        e->touched = now;
    }
}

/* Remove least recently used entries, skipping pinned ones, until the
 * store is within its cap. */
static void
s_evict (kiln_store_t *self)
{
    s_entry_t *e = self->lru_head;
    while (e && (self->bytes > self->max_bytes || zhashx_size (self->index) > S_MAX_ENTRIES)) {
        s_entry_t *next = e->next;
        if (e->pins == 0) {
            char path[PATH_MAX];
            if (s_path (self, e->kind, e->key + 1, false, path, sizeof path, NULL) == 0) {
                kiln_log_info ("store: evicting %s %.12s (%llu bytes)", s_kind_name[e->kind],
                               e->key + 1, (unsigned long long) e->size);
                unlink (path);
            }
            self->evicted++;
            s_unindex (self, e);
        }
        e = next;
    }
    if (self->bytes > self->max_bytes)
        kiln_log_warn ("store: %llu bytes held, more than the cap of %llu: the rest is "
                       "pinned by jobs", (unsigned long long) self->bytes,
                       (unsigned long long) self->max_bytes);
}

/* Index one kind's directory (with its two-hex-digit fan-out or flat). */
typedef struct {
    char hex[KILN_HEX_LEN];
    uint64_t size;
    int64_t mtime;
    s_kind_t kind;
} s_scan_t;

static int
s_scan_cmp (const void *a, const void *b)
{
    const s_scan_t *x = a, *y = b;
    return x->mtime < y->mtime ? -1 : x->mtime > y->mtime;
}

/* Collect the entries of one directory of names into *list. */
static void
s_scan_dir (const char *dir, s_kind_t kind, s_scan_t **list, size_t *n, size_t *cap)
{
    DIR *d = opendir (dir);
    if (!d)
        return;
    struct dirent *de;
    while ((de = readdir (d))) {
        if (!kiln_is_digest_hex (de->d_name))
            continue;
        char path[PATH_MAX];
        struct stat st;
        if (snprintf (path, sizeof path, "%s/%s", dir, de->d_name) >= (int) sizeof path
            || stat (path, &st) != 0 || !S_ISREG (st.st_mode))
            continue;
        if (*n == *cap) {
            size_t c = *cap ? *cap * 2 : 1024;
            s_scan_t *grown = realloc (*list, c * sizeof *grown);
            if (!grown)
                break;
            *list = grown;
            *cap = c;
        }
        s_scan_t *s = &(*list)[(*n)++];
        memcpy (s->hex, de->d_name, KILN_HEX_LEN);
        s->size = (uint64_t) st.st_size;
        s->mtime = (int64_t) st.st_mtime;
        s->kind = kind;
    }
    closedir (d);
}

static void
s_scan (kiln_store_t *self)
{
    s_scan_t *list = NULL;
    size_t n = 0, cap = 0;
    for (int kind = S_ART; kind <= S_FAIL; kind++) {
        char dir[PATH_MAX];
        snprintf (dir, sizeof dir, "%s/%s", self->root, s_kind_dir[kind]);
        if (kind == S_FAIL) {
            s_scan_dir (dir, kind, &list, &n, &cap);
            continue;
        }
        DIR *d = opendir (dir);
        if (!d)
            continue;
        struct dirent *de;
        while ((de = readdir (d))) {
            if (strlen (de->d_name) != 2 || !isxdigit ((unsigned char) de->d_name[0])
                || !isxdigit ((unsigned char) de->d_name[1]))
                continue;
            char sub[PATH_MAX];
            if (snprintf (sub, sizeof sub, "%s/%s", dir, de->d_name) < (int) sizeof sub)
                s_scan_dir (sub, (s_kind_t) kind, &list, &n, &cap);
        }
        closedir (d);
    }
    if (n)
        qsort (list, n, sizeof *list, s_scan_cmp);
    for (size_t i = 0; i < n; i++)
        s_index (self, list[i].kind, list[i].hex, list[i].size, list[i].mtime);
    free (list);
}

/* Remove what interrupted writes left in STATE/tmp. */
static void
s_clean_tmp (const char *dir)
{
    DIR *d = opendir (dir);
    if (!d)
        return;
    struct dirent *de;
    while ((de = readdir (d))) {
        if (de->d_name[0] == '.')
            continue;
        char path[PATH_MAX];
        if (snprintf (path, sizeof path, "%s/%s", dir, de->d_name) < (int) sizeof path)
            unlink (path);
    }
    closedir (d);
}

/* --- lifetime ----------------------------------------------------------------- */

kiln_store_t *
kiln_store_new (const char *state_dir, uint64_t max_bytes, kiln_err_t *err)
{
    char path[PATH_MAX];
    static const char *dirs[] = { "cas/sha256", "blobs/sha256", "ac", "fail", "tmp" };
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
        if (snprintf (path, sizeof path, "%s/%s", state_dir, dirs[i]) >= (int) sizeof path) {
            kiln_error (err, KILN_ELIMIT, "state directory path too long: '%s'", state_dir);
            return NULL;
        }
        if (kiln_mkdir_p (path, 0755, err) != 0)
            return NULL;
    }
    kiln_store_t *self = calloc (1, sizeof *self);
    if (!self || !(self->root = strdup (state_dir)) || !(self->index = zhashx_new ())) {
        if (self)
            free (self->root);
        free (self);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    zhashx_set_destructor (self->index, s_entry_free);
    self->max_bytes = max_bytes ? max_bytes : KILN_STORE_DEFAULT_MAX_BYTES;
    pthread_mutex_init (&self->mu, NULL);
    pthread_cond_init (&self->work, NULL);
    pthread_mutex_init (&self->news_mu, NULL);
    self->efd = eventfd (0, EFD_NONBLOCK | EFD_CLOEXEC);
    self->upload_efd = eventfd (0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->efd < 0 || self->upload_efd < 0) {
        kiln_error (err, KILN_ESYS, "eventfd: %s", strerror (errno));
        kiln_store_destroy (&self);
        return NULL;
    }
    snprintf (path, sizeof path, "%s/tmp", state_dir);
    s_clean_tmp (path);
    s_scan (self);
    s_evict (self);
    return self;
}

static void
s_staged_drop (s_staged_t *s)
{
    if (s->fd >= 0)
        close (s->fd);
    s->fd = -1;
    unlink (s->tmp);
}

void
kiln_store_destroy (kiln_store_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_store_t *self = *self_p;
    /* Batches handed over are finished, not dropped: their replies may be
     * out already. */
    if (self->syncer_started) {
        pthread_mutex_lock (&self->mu);
        self->stopping = true;
        pthread_cond_signal (&self->work);
        pthread_mutex_unlock (&self->mu);
        pthread_join (self->syncer, NULL);
    }
    if (self->efd > 0) {
        kiln_store_commit_collect (self, NULL);
        close (self->efd);
    }
    if (self->upload_efd > 0)
        close (self->upload_efd);
    pthread_mutex_destroy (&self->news_mu);
    pthread_mutex_destroy (&self->mu);
    pthread_cond_destroy (&self->work);
    for (size_t i = 0; i < self->n_staged; i++)
        s_staged_drop (&self->staged[i]);
    free (self->staged);
    zhashx_destroy (&self->index);
    free (self->root);
    free (self->keyring);
    free (self);
    *self_p = NULL;
}

int
kiln_store_trust_key (kiln_store_t *self, const kiln_key_t *key, kiln_err_t *err)
{
    char dir[PATH_MAX], path[PATH_MAX];
    if (snprintf (dir, sizeof dir, "%s/keyring", self->root) >= (int) sizeof dir
        || snprintf (path, sizeof path, "%s/farm.pub", dir) >= (int) sizeof path)
        return kiln_error (err, KILN_ELIMIT, "state directory path too long");
    if (kiln_mkdir_p (dir, 0755, err) != 0 || kiln_key_write_public (key, path, err) != 0)
        return -err->code;
    free (self->keyring);
    if (!(self->keyring = strdup (dir)))
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    return 0;
}

/* --- staged writes ---------------------------------------------------------- */

/* A fresh file in STATE/tmp; its name into `tmp`. */
static int
s_tmp_file (kiln_store_t *self, char *tmp, size_t size, kiln_err_t *err)
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

static int
s_stage (kiln_store_t *self, s_kind_t kind, const char *hex, const void *data, size_t len,
         kiln_err_t *err)
{
    if (!kiln_is_digest_hex (hex))
        return kiln_error (err, KILN_EINVAL, "'%.80s' is not a SHA-256 in hex", hex);
    if (self->n_staged == self->cap_staged) {
        size_t cap = self->cap_staged ? self->cap_staged * 2 : 64;
        s_staged_t *grown = realloc (self->staged, cap * sizeof *grown);
        if (!grown)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        self->staged = grown;
        self->cap_staged = cap;
    }
    s_staged_t *s = &self->staged[self->n_staged];
    memset (s, 0, sizeof *s);
    s->kind = kind;
    memcpy (s->hex, hex, KILN_HEX_LEN);
    s->size = len;
    s->fd = s_tmp_file (self, s->tmp, sizeof s->tmp, err);
    if (s->fd < 0)
        return s->fd;
    if (s_write_all (s->fd, data, len) != 0) {
        int e = errno;
        s_staged_drop (s);
        return kiln_error (err, KILN_EIO, "could not write '%s': %s", s->tmp, strerror (e));
    }
    self->n_staged++;
    return 0;
}

int
kiln_store_put_artifact (kiln_store_t *self, const char *digest_hex,
                         const uint8_t *data, size_t len, kiln_err_t *err)
{
    return s_stage (self, S_ART, digest_hex, data, len, err);
}

int
kiln_store_put_action (kiln_store_t *self, const char *action_key, const char *digest_hex,
                       kiln_err_t *err)
{
    if (!kiln_is_digest_hex (digest_hex))
        return kiln_error (err, KILN_EINVAL, "'%.80s' is not a SHA-256 in hex", digest_hex);
    char line[KILN_HEX_LEN + 1];
    snprintf (line, sizeof line, "%s\n", digest_hex);
    return s_stage (self, S_ACTION, action_key, line, KILN_HEX_LEN, err);
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
    int rc = s_stage (self, S_FAIL, action_key, text, strlen (text), err);
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
    if (s_find (self, S_BLOB, hex))
        return 0;
    for (size_t i = 0; i < self->n_staged; i++)
        if (self->staged[i].kind == S_BLOB && strcmp (self->staged[i].hex, hex) == 0)
            return 0;
    return s_stage (self, S_BLOB, hex, data, len, err);
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
s_make_durable (const kiln_store_t *self, s_staged_t *staged, size_t n, kiln_err_t *first)
{
    for (size_t i = 0; i < n; i++)
        sync_file_range (staged[i].fd, 0, 0, SYNC_FILE_RANGE_WRITE);
    for (size_t i = 0; i < n; i++) {
        s_staged_t *s = &staged[i];
        if (fsync (s->fd) != 0) {
            if (!first->code)
                kiln_error (first, KILN_EIO, "could not write '%s': %s", s->tmp,
                            strerror (errno));
            s_staged_drop (s);
        }
    }
    char (*dirs)[PATH_MAX] = malloc (64 * sizeof *dirs);
    size_t n_dirs = 0;
    for (size_t i = 0; i < n; i++) {
        s_staged_t *s = &staged[i];
        if (s->fd < 0)
            continue;
        char path[PATH_MAX];
        if (s_path (self, s->kind, s->hex, true, path, sizeof path, first) != 0
            || rename (s->tmp, path) != 0) {
            if (!first->code)
                kiln_error (first, KILN_EIO, "could not rename onto '%s': %s", path,
                            strerror (errno));
            s_staged_drop (s);
            continue;
        }
        close (s->fd);
        s->fd = -2;                  /* done, not failed */
        char dir[PATH_MAX];
        s_dirname (path, dir, sizeof dir);
        bool seen = false;
        for (size_t k = 0; dirs && k < n_dirs && !seen; k++)
            seen = strcmp (dirs[k], dir) == 0;
        if (!seen) {
            if (dirs && n_dirs < 64)
                memcpy (dirs[n_dirs++], dir, sizeof dir);
            else
                s_fsync_dir (dir);
        }
    }
    for (size_t k = 0; k < n_dirs; k++)
        s_fsync_dir (dirs[k]);
    free (dirs);
}

/* Index what a batch made durable; returns how many entries. */
static int
s_index_batch (kiln_store_t *self, s_staged_t *staged, size_t n)
{
    int done = 0;
    for (size_t i = 0; i < n; i++) {
        if (staged[i].fd != -2)
            continue;
        if (staged[i].kind != S_ACTION)
            s_index (self, staged[i].kind, staged[i].hex, staged[i].size,
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
    s_evict (self);
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
        s_batch_t *b = self->todo;
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
    s_batch_t *b = calloc (1, sizeof *b);
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
    s_batch_t *b = self->done;
    self->done = self->done_tail = NULL;
    pthread_mutex_unlock (&self->mu);
    bool reported = false;
    while (b) {
        s_batch_t *next = b->next;
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
    s_evict (self);
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

/* --- lookups ------------------------------------------------------------------ */

int
kiln_store_lookup (kiln_store_t *self, const char *action_key,
                   char artifact_hex[KILN_HEX_LEN], uint8_t **data, size_t *len,
                   kiln_err_t *err)
{
    *data = NULL;
    *len = 0;
    artifact_hex[0] = '\0';
    char path[PATH_MAX];
    if (s_path (self, S_ACTION, action_key, false, path, sizeof path, err) != 0)
        return -err->code;
    uint8_t *entry = NULL;
    size_t entry_len = 0;
    kiln_err_t rerr = { 0 };
    int rc = kiln_read_file (path, KILN_HEX_LEN + 8, &entry, &entry_len, &rerr);
    if (rc == -KILN_ENOTFOUND)
        return -KILN_ENOTFOUND;
    if (rc != 0) {
        if (err)
            *err = rerr;
        return rc;
    }
    char hex[KILN_HEX_LEN];
    size_t n = entry_len;
    while (n > 0 && (entry[n - 1] == '\n' || entry[n - 1] == '\r'))
        n--;
    bool ok = n == KILN_HEX_LEN - 1;
    if (ok) {
        memcpy (hex, entry, n);
        hex[n] = '\0';
        ok = kiln_is_digest_hex (hex);
    }
    free (entry);
    if (!ok)
        return kiln_error (err, KILN_EFORMAT, "action cache entry '%s' is damaged", path);

    char cas[PATH_MAX];
    if (s_path (self, S_ART, hex, false, cas, sizeof cas, err) != 0)
        return -err->code;
    s_entry_t *e = s_find (self, S_ART, hex);
    uint8_t *bytes = NULL;
    size_t bytes_len = 0;
    rc = kiln_read_file (cas, KILN_MAX_ARTIFACT_BYTES, &bytes, &bytes_len, &rerr);
    if (rc == -KILN_ENOTFOUND) {
        /* Evicted: the record goes too, and this is a plain miss. */
        unlink (path);
        if (e)
            s_unindex (self, e);
        return -KILN_ENOTFOUND;
    }
    if (rc != 0) {
        if (err)
            *err = rerr;
        return kiln_error_prefix (err, "action %.12s", action_key);
    }
    kiln_artifact_t *art = kiln_artifact_read_mem (bytes, bytes_len, err);
    char actual[KILN_HEX_LEN] = "";
    if (!art || kiln_artifact_digest (art, actual, err) != 0
        || (self->keyring && kiln_artifact_verify (art, self->keyring, err) != 0)) {
        kiln_artifact_destroy (&art);
        free (bytes);
        return kiln_error_prefix (err, "stored artifact '%s'", cas);
    }
    kiln_artifact_destroy (&art);
    if (strcmp (actual, hex) != 0) {
        free (bytes);
        return kiln_error (err, KILN_EVERIFY, "stored artifact '%s' has content hash %s",
                           cas, actual);
    }
    if (e)
        s_touch (self, e, cas);
    memcpy (artifact_hex, hex, KILN_HEX_LEN);
    *data = bytes;
    *len = bytes_len;
    return 0;
}

int
kiln_store_lookup_failure (kiln_store_t *self, const char *action_key, int *code,
                           char *message, char **log, kiln_err_t *err)
{
    *code = 0;
    message[0] = '\0';
    *log = NULL;
    s_entry_t *e = s_find (self, S_FAIL, action_key);
    if (!e)
        return -KILN_ENOTFOUND;
    char path[PATH_MAX];
    if (s_path (self, S_FAIL, action_key, false, path, sizeof path, err) != 0)
        return -err->code;
    uint8_t *text = NULL;
    size_t len = 0;
    int rc = kiln_read_file (path, S_MAX_FAIL_BYTES, &text, &len, err);
    if (rc == -KILN_ENOTFOUND) {
        s_unindex (self, e);
        return rc;
    }
    if (rc != 0)
        return rc;
    json_error_t jerr;
    json_t *obj = json_loadb ((const char *) text, len, 0, &jerr);
    free (text);
    json_int_t c = 0;
    const char *m = NULL, *l = NULL;
    if (!obj || json_unpack (obj, "{s:I, s:s, s?s}", "code", &c, "message", &m, "log", &l) != 0
        || c <= 0 || c >= KILN_ERR_MAX) {
        json_decref (obj);
        return kiln_error (err, KILN_EFORMAT, "failure record '%s' is damaged", path);
    }
    *code = (int) c;
    snprintf (message, KILN_ERR_MSG_MAX, "%s", m);
    if (l && *l && !(*log = strdup (l))) {
        json_decref (obj);
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    json_decref (obj);
    s_touch (self, e, path);
    return 0;
}

void
kiln_store_forget_failure (kiln_store_t *self, const char *action_key)
{
    s_entry_t *e = s_find (self, S_FAIL, action_key);
    if (!e)
        return;
    char path[PATH_MAX];
    if (s_path (self, S_FAIL, action_key, false, path, sizeof path, NULL) == 0)
        unlink (path);
    s_unindex (self, e);
}

/* --- blobs ----------------------------------------------------------------------- */

bool
kiln_store_has_blob (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN])
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    return s_find (self, S_BLOB, hex) != NULL;
}

int
kiln_store_blob_open (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                      uint64_t *size, kiln_err_t *err)
{
    char hex[KILN_HEX_LEN], path[PATH_MAX];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    if (s_path (self, S_BLOB, hex, false, path, sizeof path, err) != 0)
        return -err->code;
    int fd = open (path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        s_entry_t *gone = s_find (self, S_BLOB, hex);
        if (gone && e == ENOENT && gone->pins == 0)
            s_unindex (self, gone);
        return kiln_error (err, e == ENOENT ? KILN_ENOTFOUND : KILN_EIO,
                           "blob %s: %s", hex, strerror (e));
    }
    struct stat st;
    if (fstat (fd, &st) != 0) {
        close (fd);
        return kiln_error (err, KILN_EIO, "blob %s: %s", hex, strerror (errno));
    }
    *size = (uint64_t) st.st_size;
    s_entry_t *e = s_find (self, S_BLOB, hex);
    if (e)
        s_touch (self, e, path);
    return fd;
}

void
kiln_store_blob_pin (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN])
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    s_entry_t *e = s_find (self, S_BLOB, hex);
    if (e)
        e->pins++;
}

void
kiln_store_blob_unpin (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN])
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    s_entry_t *e = s_find (self, S_BLOB, hex);
    if (e && e->pins > 0)
        e->pins--;
}

void
kiln_store_blob_remove (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN])
{
    char hex[KILN_HEX_LEN], path[PATH_MAX];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    if (s_path (self, S_BLOB, hex, false, path, sizeof path, NULL) == 0)
        unlink (path);
    s_entry_t *e = s_find (self, S_BLOB, hex);
    if (e)
        s_unindex (self, e);
}

/* Write `len` bytes at the end of what is written; O_DIRECT needs an
 * aligned buffer and length, so the chunk goes through the bounce buffer,
 * padded with zeros (the file is cut to its size at the end). */
static int
s_writer_put (kiln_blob_writer_t *w, const uint8_t *data, size_t len)
{
    const uint8_t *src = data;
    size_t n = len;
    if (w->direct) {
        memcpy (w->bounce, data, len);
        n = (len + S_ALIGN - 1) / S_ALIGN * S_ALIGN;
        memset (w->bounce + len, 0, n - len);
        src = w->bounce;
    }
    size_t done = 0;
    while (done < n) {
        ssize_t k = pwrite (w->fd, src + done, n - done, (off_t) (w->bytes_written + done));
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

/* One thread is done with chunk `(*mine)`; the frame goes when the other
 * is done with it too.  Under w->mu. */
static void
s_chunk_done (kiln_blob_writer_t *w, uint64_t *mine, uint64_t other)
{
    uint64_t i = (*mine)++;
    if (other > i) {
        zframe_destroy (&w->ring[i % w->cap]);
        pthread_cond_signal (&w->room);
        s_news (w);
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

/* The chunk a thread at `pos` takes next, once there is one; NULL after
 * the last chunk or on abort.  Under w->mu. */
static zframe_t *
s_wait_chunk (kiln_blob_writer_t *w, const uint64_t *pos)
{
    while (*pos == w->pushed && !w->closing && !w->abort)
        pthread_cond_wait (&w->work, &w->mu);
    return w->abort || *pos == w->pushed ? NULL : w->ring[*pos % w->cap];
}

static void *
s_hasher_thread (void *arg)
{
    kiln_blob_writer_t *w = arg;
    pthread_mutex_lock (&w->mu);
    zframe_t *frame;
    while ((frame = s_wait_chunk (w, &w->hashed))) {
        pthread_mutex_unlock (&w->mu);
        kiln_sha256_update (w->sha, zframe_data (frame), zframe_size (frame));
        pthread_mutex_lock (&w->mu);
        s_chunk_done (w, &w->hashed, w->written);
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

static void *
s_writer_thread (void *arg)
{
    kiln_blob_writer_t *w = arg;
    pthread_mutex_lock (&w->mu);
    zframe_t *frame;
    while ((frame = s_wait_chunk (w, &w->written))) {
        bool failed = w->error != 0;
        pthread_mutex_unlock (&w->mu);
        int rc = failed ? 0 : s_writer_put (w, zframe_data (frame), zframe_size (frame));
        int e = errno;
        pthread_mutex_lock (&w->mu);
        if (rc != 0)
            s_writer_fail (w, KILN_EIO, "could not write '%s': %s", w->tmp, strerror (e));
        s_chunk_done (w, &w->written, w->hashed);
    }
    while (!w->hash_done && !w->abort)
        pthread_cond_wait (&w->work, &w->mu);
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
    size_t cap = max_chunks ? max_chunks : S_DEFAULT_CHUNKS;
    kiln_blob_writer_t *w = calloc (1, sizeof *w);
    if (!w || !(w->sha = kiln_sha256_new ()) || !(w->ring = calloc (cap, sizeof *w->ring))
        || posix_memalign ((void **) &w->bounce, S_ALIGN, KILN_CHUNK_BYTES + S_ALIGN) != 0) {
        if (w) {
            kiln_sha256_destroy (&w->sha);
            free (w->ring);
        }
        free (w);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    w->store = self;
    w->tag = tag;
    w->cap = cap;
    w->fd = -1;
    memcpy (w->digest, digest, KILN_DIGEST_LEN);
    w->size = size;
    pthread_mutex_init (&w->mu, NULL);
    pthread_cond_init (&w->work, NULL);
    pthread_cond_init (&w->room, NULL);
    w->fd = s_tmp_file (self, w->tmp, sizeof w->tmp, err);
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
    if (len == 0) {
        zframe_destroy (&frame);
        return 0;
    }
    pthread_mutex_lock (&self->mu);
    while (!self->error && !self->closing
           && self->pushed - (self->hashed < self->written ? self->hashed : self->written)
                  >= self->cap)
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
    uint64_t n = self->hashed < self->written ? self->hashed : self->written;
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
    /* chunks not yet released by both threads */
    uint64_t first = w->hashed < w->written ? w->hashed : w->written;
    for (uint64_t i = first; i < w->pushed; i++)
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
    free (w->bounce);
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
    if (s_path (self, S_BLOB, hex, true, path, sizeof path, err) != 0) {
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
    s_dirname (path, dir, sizeof dir);
    s_fsync_dir (dir);
    s_index (self, S_BLOB, hex, w->size, (int64_t) time (NULL));
    s_evict (self);
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

void
kiln_store_stats (const kiln_store_t *self, kiln_store_stats_t *out)
{
    memset (out, 0, sizeof *out);
    out->bytes = self->bytes;
    out->max_bytes = self->max_bytes;
    out->artifacts = self->counts[S_ART];
    out->blobs = self->counts[S_BLOB];
    out->failures = self->counts[S_FAIL];
    out->evicted = self->evicted;
}

/* --- the integrity check -------------------------------------------------------- */

typedef struct {
    const char *root;
    const char *keyring;
    bool repair;
    FILE *out;
    kiln_store_report_t *rep;
} s_check_t;

static void s_report (s_check_t *c, const char *path, const char *fmt, ...)
    __attribute__ ((format (printf, 3, 4)));

static void
s_report (s_check_t *c, const char *path, const char *fmt, ...)
{
    if (c->out) {
        va_list ap;
        va_start (ap, fmt);
        fprintf (c->out, "%s: ", path);
        vfprintf (c->out, fmt, ap);
        fprintf (c->out, "%s\n", c->repair ? " (removed)" : "");
        va_end (ap);
    }
    if (c->repair && unlink (path) == 0)
        c->rep->removed++;
}

static int
s_check_blob (s_check_t *c, const char *path, const char *hex)
{
    c->rep->blobs++;
    char got[KILN_HEX_LEN];
    kiln_err_t err = { 0 };
    if (kiln_sha256_file_hex (path, got, &err) != 0) {
        c->rep->bad++;
        s_report (c, path, "unreadable blob: %s", err.msg);
        return 0;
    }
    if (strcmp (got, hex) != 0) {
        c->rep->bad++;
        s_report (c, path, "blob hashes to %s", got);
    }
    return 0;
}

static int
s_check_artifact (s_check_t *c, const char *path, const char *hex)
{
    c->rep->artifacts++;
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_artifact_read (path, &err);
    char actual[KILN_HEX_LEN] = "";
    if (!art || kiln_artifact_digest (art, actual, &err) != 0
        || kiln_artifact_verify (art, c->keyring, &err) != 0) {
        c->rep->bad++;
        s_report (c, path, "damaged artifact: %s", err.msg);
    }
    else if (strcmp (actual, hex) != 0) {
        c->rep->bad++;
        s_report (c, path, "artifact has content hash %s", actual);
    }
    kiln_artifact_destroy (&art);
    return 0;
}

static void
s_check_fanout (s_check_t *c, const char *kind_dir, int (*fn) (s_check_t *, const char *,
                                                              const char *))
{
    char dir[PATH_MAX];
    snprintf (dir, sizeof dir, "%s/%s", c->root, kind_dir);
    DIR *d = opendir (dir);
    if (!d)
        return;
    struct dirent *de;
    while ((de = readdir (d))) {
        if (de->d_name[0] == '.')
            continue;
        char sub[PATH_MAX];
        if (snprintf (sub, sizeof sub, "%s/%s", dir, de->d_name) >= (int) sizeof sub)
            continue;
        DIR *s = opendir (sub);
        if (!s)
            continue;
        struct dirent *fe;
        while ((fe = readdir (s))) {
            if (fe->d_name[0] == '.')
                continue;
            char path[PATH_MAX];
            if (snprintf (path, sizeof path, "%s/%s", sub, fe->d_name) >= (int) sizeof path)
                continue;
            if (!kiln_is_digest_hex (fe->d_name) || strncmp (fe->d_name, de->d_name, 2) != 0) {
                c->rep->bad++;
                s_report (c, path, "stray file in the store");
                continue;
            }
            fn (c, path, fe->d_name);
        }
        closedir (s);
    }
    closedir (d);
}

/* Call fn on every entry of the flat directory STATE/kind_dir. */
static void
s_check_flat (s_check_t *c, const char *kind_dir, void (*fn) (s_check_t *, const char *,
                                                              const char *))
{
    char dir[PATH_MAX];
    snprintf (dir, sizeof dir, "%s/%s", c->root, kind_dir);
    DIR *d = opendir (dir);
    if (!d)
        return;
    struct dirent *de;
    while ((de = readdir (d))) {
        if (de->d_name[0] == '.')
            continue;
        char path[PATH_MAX];
        if (snprintf (path, sizeof path, "%s/%s", dir, de->d_name) >= (int) sizeof path)
            continue;
        fn (c, path, de->d_name);
    }
    closedir (d);
}

/* STATE/ac/<action key>: names an artifact built for that action. */
static void
s_check_action (s_check_t *c, const char *path, const char *name)
{
    c->rep->actions++;
    uint8_t *text = NULL;
    size_t len = 0;
    kiln_err_t err = { 0 };
    char cas[PATH_MAX];
    bool ok = kiln_is_digest_hex (name)
              && kiln_read_file (path, KILN_HEX_LEN + 8, &text, &len, &err) == 0
              && len == KILN_HEX_LEN && text[KILN_HEX_LEN - 1] == '\n';
    if (ok) {
        text[KILN_HEX_LEN - 1] = '\0';
        ok = kiln_is_digest_hex ((char *) text)
             && snprintf (cas, sizeof cas, "%s/cas/sha256/%.2s/%s", c->root, text,
                          (char *) text) < (int) sizeof cas;
    }
    if (!ok) {
        c->rep->bad++;
        s_report (c, path, "damaged action record");
        free (text);
        return;
    }
    kiln_artifact_t *art = kiln_artifact_read (cas, &err);
    if (!art && err.code == KILN_ENOTFOUND) {
        c->rep->dangling++;
        if (c->repair && unlink (path) == 0)
            c->rep->removed++;
    }
    else if (art && strcmp (kiln_artifact_manifest (art)->action_key, name) != 0) {
        c->rep->bad++;
        s_report (c, path, "names artifact %.12s, built for action %.12s", text,
                  kiln_artifact_manifest (art)->action_key);
    }
    /* a damaged artifact is reported by the artifact pass */
    kiln_artifact_destroy (&art);
    free (text);
}

/* STATE/fail/<action key>: a JSON record with the code and message. */
static void
s_check_failure (s_check_t *c, const char *path, const char *name)
{
    c->rep->failures++;
    json_error_t jerr;
    json_t *obj = kiln_is_digest_hex (name) ? json_load_file (path, 0, &jerr) : NULL;
    json_int_t code = 0;
    const char *m = NULL;
    if (!obj || json_unpack (obj, "{s:I, s:s}", "code", &code, "message", &m) != 0) {
        c->rep->bad++;
        s_report (c, path, "damaged failure record");
    }
    json_decref (obj);
}

int
kiln_store_check (const char *state_dir, bool repair, FILE *out,
                  kiln_store_report_t *report, kiln_err_t *err)
{
    memset (report, 0, sizeof *report);
    char keyring[PATH_MAX];
    if (snprintf (keyring, sizeof keyring, "%s/keyring", state_dir) >= (int) sizeof keyring)
        return kiln_error (err, KILN_ELIMIT, "state directory path too long");
    if (!kiln_file_exists (keyring))
        return kiln_error (err, KILN_ENOTFOUND, "'%s' holds no broker state (no keyring/)",
                           state_dir);
    s_check_t c = { state_dir, keyring, repair, out, report };
    s_check_fanout (&c, "blobs/sha256", s_check_blob);
    s_check_fanout (&c, "cas/sha256", s_check_artifact);
    s_check_flat (&c, "ac", s_check_action);
    s_check_flat (&c, "fail", s_check_failure);
    if (report->bad)
        return kiln_error (err, KILN_EVERIFY, "%llu damaged entr%s in '%s'",
                           (unsigned long long) report->bad, report->bad == 1 ? "y" : "ies",
                           state_dir);
    return 0;
}
