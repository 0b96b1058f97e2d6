/*
 * kiln_store_priv — what the store's files share and nobody else sees:
 * the index entry, a staged write, the store struct and the helpers for
 * paths, the index and eviction.  Not installed; the broker uses
 * kiln_store.h.
 *
 * Where each part lives:
 *   kiln_store.c         open and close, paths, the index (LRU, the size
 *                        cap, eviction), lookups of the action and failure
 *                        caches, reading blobs and artifacts, pins, stats
 *   kiln_store_commit.c  staged writes and group commit (the syncer thread)
 *   kiln_store_upload.c  blob writers: an upload hashed and written by two
 *                        threads of its own, then named and indexed
 *   kiln_store_check.c   the offline integrity check (kiln_store_check)
 *
 * Threads.  The index, the LRU list, the counts and `staged` belong to
 * the caller's thread (the broker's loop) alone: the syncer thread only
 * fsyncs and renames the files of the batches handed to it (its queues
 * under `mu`), a blob writer's threads only hash and write their own file
 * (their news goes to the loop under `news_mu`); indexing and evicting
 * happen on the caller's thread (kiln_store_commit_collect,
 * kiln_store_blob_finish).
 *
 * Invariants: `bytes` is the sum of the indexed entries' sizes,
 * `pinned_bytes` that of the indexed artifacts with an operator's pin,
 * `job_pinned_bytes` that of the indexed blobs with pins > 0, and
 * `reserved_bytes` that of the blob writers' announced sizes (`writers`
 * of them); bytes + reserved_bytes <= max_bytes unless what cannot be
 * evicted holds more;
 * every indexed entry is on the LRU list exactly once; a file is visible
 * under its name only whole and fsynced (written in STATE/tmp, renamed).
 */
#ifndef KILN_STORE_PRIV_H
#define KILN_STORE_PRIV_H

#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include <czmq.h>

#include "broker/kiln_store.h"

/* What an indexed entry is; its letter prefixes its key in the index. */
typedef enum { STORE_ART, STORE_BLOB, STORE_FAIL, STORE_ACTION } store_kind_t;

typedef struct store_entry {
    char key[KILN_HEX_LEN + 2];      /* "<letter><hex>" */
    store_kind_t kind;
    uint64_t size;                   /* bytes counted against the cap */
    uint32_t pins;                   /* jobs that need it (blobs) */
    bool pinned;                     /* an operator's pin (artifacts): never evicted */
    int64_t touched;                 /* time (s) its mtime was last set */
    struct store_entry *prev, *next; /* LRU list: head is the least recently used */
} store_entry_t;

typedef struct {
    store_kind_t kind;
    char hex[KILN_HEX_LEN];          /* name */
    char tmp[PATH_MAX];              /* written here */
    int fd;                          /* open until commit */
    uint64_t size;
} store_staged_t;

struct kiln_store {
    char *root;                      /* the state directory */
    char *keyring;                   /* STATE/keyring once a key is trusted, else NULL */
    uint64_t max_bytes;              /* the cap */
    uint64_t bytes;                  /* indexed bytes */
    uint64_t counts[3];              /* entries per kind (STORE_ART, STORE_BLOB, STORE_FAIL) */
    uint64_t evicted;
    zhashx_t *index;                 /* key -> store_entry_t (owns) */
    zhashx_t *pins;                  /* hex -> itself: pinned artifacts, as in STATE/pins */
    uint64_t pinned_bytes;           /* of the pinned artifacts the index holds */
    uint64_t pinned_count;
    uint64_t job_pinned_bytes;       /* of the indexed blobs with pins > 0 */
    uint64_t reserved_bytes;         /* announced sizes of the blob writers in progress */
    uint64_t writers;                /* blob writers in progress */
    bool full_logged;                /* "over the cap because of pins" was logged */
    store_entry_t *lru_head, *lru_tail;
    store_staged_t *staged;          /* owned, n_staged used */
    size_t n_staged, cap_staged;
    uint64_t tmp_seq;                /* names files in STATE/tmp */
    /* Commits made durable by the syncer thread (kiln_store_commit_async). */
    pthread_t syncer;
    bool syncer_started, stopping;
    pthread_mutex_t mu;
    pthread_cond_t work;
    struct store_batch *todo, *todo_tail; /* for the syncer, in ticket order */
    struct store_batch *done, *done_tail; /* for kiln_store_commit_collect */
    int efd;                         /* eventfd: a batch is durable */
    uint64_t next_ticket, durable;
    /* Blob writers with news for the caller's loop (kiln_store_upload_poll). */
    pthread_mutex_t news_mu;
    struct kiln_blob_writer *news, *news_tail;
    int upload_efd;                  /* eventfd: there is news */
};

/* Staged writes handed to the syncer. */
typedef struct store_batch {
    uint64_t ticket;
    store_staged_t *staged;          /* owned */
    size_t n;
    kiln_err_t err;                  /* the first failure */
    struct store_batch *next;
} store_batch_t;

/* --- paths, the index and eviction (kiln_store.c) ------------------------------ */

/* The path of entry `hex` of `kind` into out[size]; with `create_dir`,
 * its fan-out directory is created.  `hex` must be a SHA-256 in hex. */
int store_path (const kiln_store_t *self, store_kind_t kind, const char *hex, bool create_dir,
                char *out, size_t size, kiln_err_t *err);
/* fsync a directory (after a rename into it); errors are ignored. */
void store_fsync_dir (const char *path);
/* The directory part of `path` into buf. */
void store_dirname (const char *path, char *buf, size_t size);
/* The indexed entry, or NULL. */
store_entry_t *store_find (const kiln_store_t *self, store_kind_t kind, const char *hex);
/* Index an entry (or update its size), as the most recently used. */
void store_index (kiln_store_t *self, store_kind_t kind, const char *hex, uint64_t size,
                  int64_t touched);
/* Remove least recently used entries not pinned until within the cap. */
void store_evict (kiln_store_t *self);
/* Refuse (KILN_ELIMIT) `size` more bytes of blob `hex` when the pinned
 * artifacts leave no room for them under the cap. */
int store_room_beside_pins (const kiln_store_t *self, const char *hex, uint64_t size,
                            kiln_err_t *err);
/* Reserve `size` bytes under the cap for an upload of blob `hex`, evicting
 * what may be evicted; KILN_ELIMIT when what cannot be evicted leaves no
 * room, KILN_EBUSY when uploads in progress hold it.  Undone by
 * store_unreserve. */
int store_reserve (kiln_store_t *self, const char *hex, uint64_t size, kiln_err_t *err);
void store_unreserve (kiln_store_t *self, uint64_t size);

/* --- staged writes (kiln_store_commit.c) -------------------------------------- */

/* A fresh file in STATE/tmp, opened for writing; its name into `tmp`.
 * Returns the descriptor or an error. */
int store_tmp_file (kiln_store_t *self, char *tmp, size_t size, kiln_err_t *err);
/* Close and remove a staged file. */
void store_staged_drop (store_staged_t *s);

#endif
