/*
 * kiln_store — the broker's content-addressed store: opening it (the
 * index rebuilt from the files, leftovers removed), paths, the index with
 * its LRU order and size cap, lookups of the action and failure caches,
 * reading blobs and artifacts, pins, and stats.  Writing is elsewhere:
 * kiln_store_commit.c stages and commits small entries, kiln_store_upload.c
 * receives blobs, kiln_store_check.c checks a stopped store
 * (kiln_store_priv.h).
 */
#include "broker/kiln_store_priv.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
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
#define S_TOUCH_EVERY_S   60              /* persist "last used" at most this often */
#define S_MAX_FAIL_BYTES  (KILN_MAX_LOG_BYTES * 7 + 65536)   /* JSON-escaped log and all */

static const char s_kind_letter[] = { 'a', 'b', 'f', 'c' };
static const char *s_kind_dir[] = { "cas/sha256", "blobs/sha256", "fail", "ac" };
static const char *s_kind_name[] = { "artifact", "blob", "failure record", "action record" };

/* zhashx destructor: frees the entry and clears the table's slot. */
static void
s_entry_free (void **item)
{
    free (*item);
    *item = NULL;
}

/* --- paths ------------------------------------------------------------------- */

int
store_path (const kiln_store_t *self, store_kind_t kind, const char *hex, bool create_dir,
            char *out, size_t size, kiln_err_t *err)
{
    if (!kiln_is_digest_hex (hex))
        return kiln_error (err, KILN_EINVAL, "'%.80s' is not a SHA-256 in hex", hex);
    bool fanout = kind == STORE_ART || kind == STORE_BLOB;
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

void
store_fsync_dir (const char *path)
{
    int fd = open (path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync (fd);
        close (fd);
    }
}

/* The directory part of `path` into buf. */
void
store_dirname (const char *path, char *buf, size_t size)
{
    snprintf (buf, size, "%s", path);
    char *slash = strrchr (buf, '/');
    if (slash)
        *slash = '\0';
}

/* --- the index ---------------------------------------------------------------- */

static void
s_lru_unlink (kiln_store_t *self, store_entry_t *e)
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
s_lru_append (kiln_store_t *self, store_entry_t *e)
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
s_key (store_kind_t kind, const char *hex, char key[KILN_HEX_LEN + 2])
{
    key[0] = s_kind_letter[kind];
    memcpy (key + 1, hex, KILN_HEX_LEN);
}

store_entry_t *
store_find (const kiln_store_t *self, store_kind_t kind, const char *hex)
{
    char key[KILN_HEX_LEN + 2];
    s_key (kind, hex, key);
    return zhashx_lookup (self->index, key);
}

/* Index an entry (or update its size), as the most recently used. */
void
store_index (kiln_store_t *self, store_kind_t kind, const char *hex, uint64_t size, int64_t touched)
{
    store_entry_t *e = store_find (self, kind, hex);
    if (e) {
        self->bytes -= e->size;
        if (e->pinned)
            self->pinned_bytes -= e->size;
        if (e->pins)
            self->job_pinned_bytes -= e->size;
        s_lru_unlink (self, e);
    }
    else {
        if (!(e = calloc (1, sizeof *e)))
            return;          /* unindexed: never evicted, still served */
        s_key (kind, hex, e->key);
        e->kind = kind;
        zhashx_insert (self->index, e->key, e);
        self->counts[kind]++;
        /* an artifact pinned before (stored again after it went missing) */
        if (kind == STORE_ART && zhashx_lookup (self->pins, hex)) {
            e->pinned = true;
            self->pinned_count++;
        }
    }
    e->size = size;
    e->touched = touched;
    self->bytes += size;
    if (e->pinned)
        self->pinned_bytes += size;
    if (e->pins)
        self->job_pinned_bytes += size;
    s_lru_append (self, e);
}

static void
s_unindex (kiln_store_t *self, store_entry_t *e)
{
    if (e->pinned) {
        /* the pin stays (STATE/pins): it applies again if the artifact
         * is stored again */
        self->pinned_bytes -= e->size;
        self->pinned_count--;
    }
    if (e->pins)
        self->job_pinned_bytes -= e->size;
    self->bytes -= e->size;
    self->counts[e->kind]--;
    s_lru_unlink (self, e);
    zhashx_delete (self->index, e->key);      /* frees e */
}

/* Mark an entry used: the tail of the LRU list, and now and then its
 * mtime, so that the order survives a restart. */
static void
s_touch (kiln_store_t *self, store_entry_t *e, const char *path)
{
    s_lru_unlink (self, e);
    s_lru_append (self, e);
    int64_t now = (int64_t) time (NULL);
    if (path && now - e->touched >= S_TOUCH_EVERY_S) {
        utimensat (AT_FDCWD, path, NULL, 0);
        e->touched = now;
    }
}

/* Remove least recently used entries, skipping those pinned by jobs or
 * by an operator, until the store is within its cap.  When pins keep it
 * above, say so once (an error: the operator must unpin or raise the
 * cap), and again when it is back under. */
void
store_evict (kiln_store_t *self)
{
    store_entry_t *e = self->lru_head;
    while (e && (self->bytes + self->reserved_bytes > self->max_bytes
                 || zhashx_size (self->index) > S_MAX_ENTRIES)) {
        store_entry_t *next = e->next;
        if (e->pins == 0 && !e->pinned) {
            char path[PATH_MAX];
            if (store_path (self, e->kind, e->key + 1, false, path, sizeof path, NULL) == 0) {
                kiln_log_info ("store: evicting %s %.12s (%llu bytes)", s_kind_name[e->kind],
                               e->key + 1, (unsigned long long) e->size);
                unlink (path);
            }
            self->evicted++;
            s_unindex (self, e);
        }
        e = next;
    }
    if (self->bytes > self->max_bytes && self->pinned_bytes > 0) {
        if (!self->full_logged)
            kiln_log_err ("store: %llu bytes held, more than the cap of %llu, and nothing "
                          "left to evict: %llu bytes are pinned artifacts (%llu), the rest "
                          "blobs of queued jobs; uploads that do not fit beside the pinned "
                          "artifacts are refused.  Unpin the artifacts no release names any "
                          "more (kiln unpin DIGEST; STATE/pins lists them) or raise "
                          "--store-max-bytes", (unsigned long long) self->bytes,
                          (unsigned long long) self->max_bytes,
                          (unsigned long long) self->pinned_bytes,
                          (unsigned long long) self->pinned_count);
        self->full_logged = true;
    }
    else if (self->bytes > self->max_bytes)
        kiln_log_warn ("store: %llu bytes held, more than the cap of %llu: the rest is "
                       "pinned by jobs", (unsigned long long) self->bytes,
                       (unsigned long long) self->max_bytes);
    else if (self->full_logged) {
        kiln_log_notice ("store: back under its cap (%llu of %llu bytes, %llu pinned)",
                         (unsigned long long) self->bytes, (unsigned long long) self->max_bytes,
                         (unsigned long long) self->pinned_bytes);
        self->full_logged = false;
    }
}

/* Refuse to take `size` more bytes of an upload when the pinned
 * artifacts leave no room for them under the cap: eviction would have
 * to remove a pinned artifact, and never does. */
int
store_room_beside_pins (const kiln_store_t *self, const char *hex, uint64_t size, kiln_err_t *err)
{
    if (self->pinned_bytes + size <= self->max_bytes)
        return 0;
    return kiln_error (err, KILN_ELIMIT, "the store is full of pinned artifacts: %llu of its "
                       "%llu bytes are %llu pinned artifact%s, no room for blob %.12s "
                       "(%llu bytes); the farm's operator must unpin artifacts no release "
                       "names any more (kiln unpin) or raise --store-max-bytes",
                       (unsigned long long) self->pinned_bytes,
                       (unsigned long long) self->max_bytes,
                       (unsigned long long) self->pinned_count,
                       self->pinned_count == 1 ? "" : "s", hex, (unsigned long long) size);
}

int
store_reserve (kiln_store_t *self, const char *hex, uint64_t size, kiln_err_t *err)
{
    uint64_t held = self->pinned_bytes + self->job_pinned_bytes;
    if (held + size > self->max_bytes)
        return kiln_error (err, KILN_ELIMIT, "no room under the store's cap "
                           "(--store-max-bytes %llu) for blob %.12s (%llu bytes): %llu bytes "
                           "are pinned artifacts and blobs of queued jobs, which are not "
                           "evicted", (unsigned long long) self->max_bytes, hex,
                           (unsigned long long) size, (unsigned long long) held);
    if (held + self->reserved_bytes + size > self->max_bytes)
        return kiln_error (err, KILN_EBUSY, "no room under the store's cap "
                           "(--store-max-bytes %llu) for blob %.12s (%llu bytes) while %llu "
                           "uploads in progress hold %llu bytes of it; try again",
                           (unsigned long long) self->max_bytes, hex, (unsigned long long) size,
                           (unsigned long long) self->writers,
                           (unsigned long long) self->reserved_bytes);
    self->reserved_bytes += size;
    self->writers++;
    store_evict (self);
    return 0;
}

void
store_unreserve (kiln_store_t *self, uint64_t size)
{
    self->reserved_bytes -= size < self->reserved_bytes ? size : self->reserved_bytes;
    if (self->writers)
        self->writers--;
}

/* Index one kind's directory (with its two-hex-digit fan-out or flat). */
typedef struct {
    char hex[KILN_HEX_LEN];
    uint64_t size;
    int64_t mtime;
    store_kind_t kind;
} s_scan_t;

static int
s_scan_cmp (const void *a, const void *b)
{
    const s_scan_t *x = a, *y = b;
    return x->mtime < y->mtime ? -1 : x->mtime > y->mtime;
}

/* Collect the entries of one directory of names into *list. */
static void
s_scan_dir (const char *dir, store_kind_t kind, s_scan_t **list, size_t *n, size_t *cap)
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
    for (int kind = STORE_ART; kind <= STORE_FAIL; kind++) {
        char dir[PATH_MAX];
        snprintf (dir, sizeof dir, "%s/%s", self->root, s_kind_dir[kind]);
        if (kind == STORE_FAIL) {
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
                s_scan_dir (sub, (store_kind_t) kind, &list, &n, &cap);
        }
        closedir (d);
    }
    if (n)
        qsort (list, n, sizeof *list, s_scan_cmp);
    for (size_t i = 0; i < n; i++)
        store_index (self, list[i].kind, list[i].hex, list[i].size, list[i].mtime);
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

/* Read STATE/pins: one empty file per pinned artifact, named by its
 * content hash. */
static void
s_load_pins (kiln_store_t *self)
{
    char dir[PATH_MAX];
    snprintf (dir, sizeof dir, "%s/pins", self->root);
    DIR *d = opendir (dir);
    if (!d)
        return;
    struct dirent *de;
    while ((de = readdir (d))) {
        if (!kiln_is_digest_hex (de->d_name))
            continue;
        if (zhashx_size (self->pins) >= KILN_MAX_PINS) {
            kiln_log_err ("store: more than %d pins in '%s'; the rest are ignored", KILN_MAX_PINS,
                          dir);
            break;
        }
        zhashx_insert (self->pins, de->d_name, self);
        store_entry_t *e = store_find (self, STORE_ART, de->d_name);
        if (!e) {
            kiln_log_warn ("store: artifact %s is pinned but not stored; `kiln unpin` "
                           "removes the pin", de->d_name);
            continue;
        }
        e->pinned = true;
        self->pinned_count++;
        self->pinned_bytes += e->size;
    }
    closedir (d);
}

/* --- lifetime ----------------------------------------------------------------- */

kiln_store_t *
kiln_store_new (const char *state_dir, uint64_t max_bytes, kiln_err_t *err)
{
    char path[PATH_MAX];
    static const char *dirs[] = { "cas/sha256", "blobs/sha256", "ac", "fail", "pins", "tmp" };
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
        if (snprintf (path, sizeof path, "%s/%s", state_dir, dirs[i]) >= (int) sizeof path) {
            kiln_error (err, KILN_ELIMIT, "state directory path too long: '%s'", state_dir);
            return NULL;
        }
        if (kiln_mkdir_p (path, 0755, err) != 0)
            return NULL;
    }
    kiln_store_t *self = calloc (1, sizeof *self);
    if (!self || !(self->root = strdup (state_dir)) || !(self->index = zhashx_new ())
        || !(self->pins = zhashx_new ())) {
        if (self) {
            free (self->root);
            zhashx_destroy (&self->index);
        }
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
    s_load_pins (self);
    store_evict (self);
    return self;
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
        store_staged_drop (&self->staged[i]);
    free (self->staged);
    zhashx_destroy (&self->index);
    zhashx_destroy (&self->pins);
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

/* --- lookups ------------------------------------------------------------------ */

/* A hit on an artifact too large to read on the loop: its manifest,
 * signature and member sizes are checked (KILN_ARTIFACT_SKIM), its bytes
 * are not: whoever downloads it checks every member (kiln_client_get), and
 * kiln_store_check hashes everything.  *len gets its size, no bytes. */
static int
s_lookup_large (kiln_store_t *self, const char *action_key, const char *record,
                const char *hex, const char *cas, store_entry_t *e,
                char artifact_hex[KILN_HEX_LEN], size_t *len, kiln_err_t *err)
{
    int fd = open (cas, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno != ENOENT)
            return kiln_error (err, KILN_EIO, "stored artifact '%s': %s", cas, strerror (errno));
        unlink (record);               /* evicted: a plain miss */
        if (e)
            s_unindex (self, e);
        return -KILN_ENOTFOUND;
    }
    struct stat st;
    kiln_artifact_t *art = NULL;
    char actual[KILN_HEX_LEN] = "";
    int rc = 0;
    if (fstat (fd, &st) != 0)
        rc = kiln_error (err, KILN_EIO, "stored artifact '%s': %s", cas, strerror (errno));
    else if (!(art = kiln_artifact_read_fd (fd, cas, KILN_ARTIFACT_SKIM, err))
             || kiln_artifact_digest (art, actual, err) != 0
             || (self->keyring && kiln_artifact_verify (art, self->keyring, err) != 0))
        rc = kiln_error_prefix (err, "stored artifact '%s'", cas);
    else if (strcmp (actual, hex) != 0)
        rc = kiln_error (err, KILN_EVERIFY, "stored artifact '%s' has content hash %s", cas,
                         actual);
    kiln_artifact_destroy (&art);
    close (fd);
    if (rc)
        return rc;
    if (e)
        s_touch (self, e, cas);
    memcpy (artifact_hex, hex, KILN_HEX_LEN);
    *len = (size_t) st.st_size;
    (void) action_key;
    return 0;
}

int
kiln_store_lookup (kiln_store_t *self, const char *action_key,
                   char artifact_hex[KILN_HEX_LEN], uint8_t **data, size_t *len,
                   kiln_err_t *err)
{
    *data = NULL;
    *len = 0;
    artifact_hex[0] = '\0';
    char path[PATH_MAX];
    if (store_path (self, STORE_ACTION, action_key, false, path, sizeof path, err) != 0)
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
    if (store_path (self, STORE_ART, hex, false, cas, sizeof cas, err) != 0)
        return -err->code;
    store_entry_t *e = store_find (self, STORE_ART, hex);
    struct stat st;
    if (stat (cas, &st) == 0 && (uint64_t) st.st_size > KILN_STORE_INLINE_MAX)
        return s_lookup_large (self, action_key, path, hex, cas, e, artifact_hex, len, err);
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
    store_entry_t *e = store_find (self, STORE_FAIL, action_key);
    if (!e)
        return -KILN_ENOTFOUND;
    char path[PATH_MAX];
    if (store_path (self, STORE_FAIL, action_key, false, path, sizeof path, err) != 0)
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
    store_entry_t *e = store_find (self, STORE_FAIL, action_key);
    if (!e)
        return;
    char path[PATH_MAX];
    if (store_path (self, STORE_FAIL, action_key, false, path, sizeof path, NULL) == 0)
        unlink (path);
    s_unindex (self, e);
}

/* --- blobs ----------------------------------------------------------------------- */

bool
kiln_store_has_blob (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN])
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    return store_find (self, STORE_BLOB, hex) != NULL;
}

int
kiln_store_blob_open (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                      uint64_t *size, kiln_err_t *err)
{
    char hex[KILN_HEX_LEN], path[PATH_MAX];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    if (store_path (self, STORE_BLOB, hex, false, path, sizeof path, err) != 0)
        return -err->code;
    int fd = open (path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        store_entry_t *gone = store_find (self, STORE_BLOB, hex);
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
    store_entry_t *e = store_find (self, STORE_BLOB, hex);
    if (e)
        s_touch (self, e, path);
    return fd;
}

void
kiln_store_blob_pin (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN])
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    store_entry_t *e = store_find (self, STORE_BLOB, hex);
    if (e && e->pins++ == 0)
        self->job_pinned_bytes += e->size;
}

void
kiln_store_blob_unpin (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN])
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    store_entry_t *e = store_find (self, STORE_BLOB, hex);
    if (e && e->pins > 0 && --e->pins == 0)
        self->job_pinned_bytes -= e->size;
}

void
kiln_store_blob_remove (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN])
{
    char hex[KILN_HEX_LEN], path[PATH_MAX];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    if (store_path (self, STORE_BLOB, hex, false, path, sizeof path, NULL) == 0)
        unlink (path);
    store_entry_t *e = store_find (self, STORE_BLOB, hex);
    if (e)
        s_unindex (self, e);
}

/* --- artifacts by content hash, and pins --------------------------------------- */

int
kiln_store_artifact_open (kiln_store_t *self, const char *digest_hex, uint64_t *size,
                          kiln_err_t *err)
{
    *size = 0;
    char path[PATH_MAX];
    if (store_path (self, STORE_ART, digest_hex, false, path, sizeof path, err) != 0)
        return -err->code;
    store_entry_t *e = store_find (self, STORE_ART, digest_hex);
    if (!e)
        return kiln_error (err, KILN_ENOTFOUND, "the store holds no artifact %s", digest_hex);
    int fd = open (path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        int e2 = errno;
        if (e2 == ENOENT) {
            s_unindex (self, e);       /* gone from under us: a miss from now on */
            return kiln_error (err, KILN_ENOTFOUND, "the store holds no artifact %s",
                               digest_hex);
        }
        return kiln_error (err, KILN_EIO, "artifact %s: %s", digest_hex, strerror (e2));
    }
    struct stat st;
    if (fstat (fd, &st) != 0 || !S_ISREG (st.st_mode)) {
        close (fd);
        return kiln_error (err, KILN_EIO, "artifact %s: not a readable file", digest_hex);
    }
    *size = (uint64_t) st.st_size;
    s_touch (self, e, path);
    return fd;
}

/* STATE/pins/<hex> into buf. */
static int
s_pin_path (const kiln_store_t *self, const char *hex, char *buf, size_t size, kiln_err_t *err)
{
    if (!kiln_is_digest_hex (hex))
        return kiln_error (err, KILN_EINVAL, "'%.80s' is not a SHA-256 in hex", hex);
    if (snprintf (buf, size, "%s/pins/%s", self->root, hex) >= (int) size)
        return kiln_error (err, KILN_ELIMIT, "store path too long");
    return 0;
}

int
kiln_store_pin (kiln_store_t *self, const char *digest_hex, bool *changed, kiln_err_t *err)
{
    if (changed)
        *changed = false;
    char path[PATH_MAX], dir[PATH_MAX];
    if (s_pin_path (self, digest_hex, path, sizeof path, err) != 0)
        return -err->code;
    store_entry_t *e = store_find (self, STORE_ART, digest_hex);
    if (!e)
        return kiln_error (err, KILN_ENOTFOUND, "the store holds no artifact %s", digest_hex);
    if (e->pinned)
        return 0;
    if (zhashx_size (self->pins) >= KILN_MAX_PINS && !zhashx_lookup (self->pins, digest_hex))
        return kiln_error (err, KILN_ELIMIT, "%d artifacts are pinned already: unpin some "
                           "first", KILN_MAX_PINS);
    /* Durable before it counts: a pin that a crash forgets would let
     * eviction take the artifact after a restart. */
    int fd = open (path, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0 || fsync (fd) != 0) {
        int e2 = errno;
        if (fd >= 0)
            close (fd);
        return kiln_error (err, KILN_EIO, "could not write '%s': %s", path, strerror (e2));
    }
    close (fd);
    store_dirname (path, dir, sizeof dir);
    store_fsync_dir (dir);
    zhashx_update (self->pins, digest_hex, self);
    e->pinned = true;
    self->pinned_count++;
    self->pinned_bytes += e->size;
    if (changed)
        *changed = true;
    return 0;
}

int
kiln_store_unpin (kiln_store_t *self, const char *digest_hex, bool *changed, kiln_err_t *err)
{
    if (changed)
        *changed = false;
    char path[PATH_MAX], dir[PATH_MAX];
    if (s_pin_path (self, digest_hex, path, sizeof path, err) != 0)
        return -err->code;
    bool was = zhashx_lookup (self->pins, digest_hex) != NULL;
    if (unlink (path) != 0 && errno != ENOENT)
        return kiln_error (err, KILN_EIO, "could not remove '%s': %s", path, strerror (errno));
    store_dirname (path, dir, sizeof dir);
    store_fsync_dir (dir);
    zhashx_delete (self->pins, digest_hex);
    store_entry_t *e = store_find (self, STORE_ART, digest_hex);
    if (e && e->pinned) {
        e->pinned = false;
        self->pinned_count--;
        self->pinned_bytes -= e->size;
    }
    if (!was)
        return 0;
    if (changed)
        *changed = true;
    /* what the pin held over the cap may go now */
    store_evict (self);
    return 0;
}

bool
kiln_store_is_pinned (const kiln_store_t *self, const char *digest_hex)
{
    return kiln_is_digest_hex (digest_hex) && zhashx_lookup (self->pins, digest_hex) != NULL;
}

void
kiln_store_stats (const kiln_store_t *self, kiln_store_stats_t *out)
{
    memset (out, 0, sizeof *out);
    out->bytes = self->bytes;
    out->max_bytes = self->max_bytes;
    out->artifacts = self->counts[STORE_ART];
    out->blobs = self->counts[STORE_BLOB];
    out->failures = self->counts[STORE_FAIL];
    out->evicted = self->evicted;
    out->pinned = self->pinned_count;
    out->pinned_bytes = self->pinned_bytes;
    out->job_pinned_bytes = self->job_pinned_bytes;
    out->reserved_bytes = self->reserved_bytes;
    out->uploads = self->writers;
}
