/*
 * kiln_store — the broker's state on disk: a content-addressed store of
 * artifacts and weight blobs, the action cache and the failure cache.
 *
 *   STATE/cas/sha256/ab/abcdef...    a signed artifact archive, named by its
 *                                    content hash (SHA-256 of manifest.json)
 *   STATE/blobs/sha256/ab/abcdef...  a weight blob, named by the SHA-256 of
 *                                    its bytes
 *   STATE/ac/<action key>            the content hash (64 hex chars + "\n")
 *                                    of the artifact built for that action
 *   STATE/fail/<action key>          a failed build: JSON {"code", "message",
 *                                    "log", "failed_at"}
 *   STATE/pins/<content hash>        an empty file: that artifact is pinned
 *   STATE/keyring/farm.pub           the public half of the signing key,
 *                                    rewritten at every start, so that
 *                                    entries signed by an older key are
 *                                    rebuilt rather than served
 *   STATE/tmp/                       files being written; emptied at start
 *
 * Durability.  Every entry is written to STATE/tmp, fsynced, renamed into
 * place and its directory fsynced, so that after a crash (of the broker
 * or of the host) an entry is either whole or absent.  Small entries
 * (artifacts, action and failure records, inline blobs) are *staged* and
 * made durable together, a batch at a time (group commit): by
 * kiln_store_commit, or by the store's syncer thread
 * (kiln_store_commit_async), which lets the broker's loop go on while the
 * disk works; the broker answers clients only after their batch is
 * durable.  A blob upload is written as it arrives (by a writer thread,
 * beside the hashing), checked against its digest, fsynced and renamed
 * when complete.
 *
 * Trust.  Names are checked to be 64 lower-case hex characters before
 * they become paths.  The store trusts nothing it reads back: a cache hit
 * parses the archive (every member's size and SHA-256), checks its
 * content hash and, once kiln_store_trust_key was called, its signature;
 * a blob's bytes are hashed as they are uploaded, and kiln_store_check
 * hashes every stored file.
 *
 * Capacity.  Artifacts, blobs and failure records count against a size
 * cap; past it the least recently used entries go first.  Blobs a queued
 * or running job needs are pinned and never evicted; so are artifacts an
 * operator pinned (kiln_store_pin: those a release may still name).  An
 * upload that does not fit beside the pinned artifacts under the cap is
 * refused (KILN_ELIMIT), and a store held over its cap by pins logs an
 * error once: eviction never takes a pinned entry to make room.  An
 * action record whose artifact was evicted is removed when it is next
 * looked up.
 *
 * The code: kiln_store.c (the index, lookups, pins), kiln_store_commit.c
 * (staged writes, group commit), kiln_store_upload.c (blob writers),
 * kiln_store_check.c (the integrity check); kiln_store_priv.h holds what
 * they share.
 */
#ifndef KILN_STORE_H
#define KILN_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <czmq.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_error.h"
#include "common/kiln_hash.h"

typedef struct kiln_store kiln_store_t;
typedef struct kiln_blob_writer kiln_blob_writer_t;

#define KILN_STORE_DEFAULT_MAX_BYTES (64ULL << 30)

/* Open (creating) the store under `state_dir` with a size cap of
 * `max_bytes` (0 = KILN_STORE_DEFAULT_MAX_BYTES), index what it holds and
 * remove leftovers of interrupted writes.  Caller owns the result. */
kiln_store_t *kiln_store_new (const char *state_dir, uint64_t max_bytes,
                              kiln_err_t *err);
/* Close; staged writes that were not committed are dropped. */
void kiln_store_destroy (kiln_store_t **self_p);

/* Write `key`'s public half to STATE/keyring/farm.pub and from now on
 * serve only artifacts whose signature that keyring accepts. */
int kiln_store_trust_key (kiln_store_t *self, const kiln_key_t *key,
                          kiln_err_t *err);

/* --- staged writes (group commit) ---------------------------------- */

/* Stage an artifact archive under its content hash (replacing an
 * existing entry: the caller has just checked and signed these bytes),
 * an action record, a failure record, or a small blob (its bytes are
 * hashed here and refused unless they match `digest`; refused with
 * KILN_ELIMIT when it does not fit beside the pinned artifacts).  Nothing is
 * visible or durable before kiln_store_commit. */
int kiln_store_put_artifact (kiln_store_t *self, const char *digest_hex,
                             const uint8_t *data, size_t len, kiln_err_t *err);
/* A new file in STATE/tmp, open for writing and reading, its path into
 * path[size]: for an artifact written off the loop (then staged with
 * kiln_store_put_artifact_file) or collected from a worker.  Returns the
 * descriptor; the caller closes and unlinks it when it does not stage it.
 * Everything in STATE/tmp is removed at the next start. */
int kiln_store_tmp_open (kiln_store_t *self, char *path, size_t size, kiln_err_t *err);
/* Stage the artifact archive already written to `tmp` (from
 * kiln_store_tmp_open; `size` bytes) under its content hash, taking its
 * descriptor *fd_p (-1 afterwards, also on failure, when the file is
 * removed): kiln_store_commit makes it durable and visible like
 * kiln_store_put_artifact. */
int kiln_store_put_artifact_file (kiln_store_t *self, const char *digest_hex, const char *tmp,
                                  int *fd_p, uint64_t size, kiln_err_t *err);
int kiln_store_put_action (kiln_store_t *self, const char *action_key,
                           const char *digest_hex, kiln_err_t *err);
int kiln_store_put_failure (kiln_store_t *self, const char *action_key, int code,
                            const char *message, const char *log, kiln_err_t *err);
int kiln_store_put_blob (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                         const uint8_t *data, size_t len, kiln_err_t *err);
/* Make every staged write durable and visible (fsync, rename, fsync the
 * directories), then evict past the cap.  Returns the number of entries
 * committed, or an error (the entries that failed are dropped). */
int kiln_store_commit (kiln_store_t *self, kiln_err_t *err);
/* Staged writes waiting for a commit. */
size_t kiln_store_staged (const kiln_store_t *self);

/* The same commit on the store's syncer thread, so that the caller's loop
 * goes on while the disk works.  Returns the batch's ticket (tickets grow
 * by one per batch), 0 when nothing was staged.  When the batch is
 * durable the eventfd kiln_store_commit_fd becomes readable; then
 * kiln_store_commit_collect indexes what finished and returns the highest
 * durable ticket.  Until then the batch's entries are not visible.
 * Batches finish in ticket order.  Do not mix with kiln_store_commit. */
uint64_t kiln_store_commit_async (kiln_store_t *self, kiln_err_t *err);
int kiln_store_commit_fd (const kiln_store_t *self);
uint64_t kiln_store_commit_collect (kiln_store_t *self, kiln_err_t *err);
/* The highest durable ticket, and the last one handed out. */
uint64_t kiln_store_durable (const kiln_store_t *self);
uint64_t kiln_store_last_ticket (const kiln_store_t *self);

/* --- lookups ---------------------------------------------------------- */

#define KILN_STORE_INLINE_MAX (1u << 20)   /* hits this big or smaller come as bytes */

/* Look an action up: on a hit fill artifact_hex and return the archive
 * bytes in *data (caller frees) after checking that they parse, carry
 * that content hash and (see kiln_store_trust_key) a good signature.
 * An archive larger than KILN_STORE_INLINE_MAX is not read: *data is
 * NULL, *len its size, and only its manifest, signature and member sizes
 * are checked (its bytes are checked by whoever downloads it, and by
 * kiln_store_check).
 * Returns -KILN_ENOTFOUND on a miss (also when the artifact was evicted);
 * other errors (a damaged entry) are returned too, and the caller treats
 * them as a miss after logging them. */
int kiln_store_lookup (kiln_store_t *self, const char *action_key,
                       char artifact_hex[KILN_HEX_LEN], uint8_t **data,
                       size_t *len, kiln_err_t *err);

/* Look a failed build up.  On a hit *code, message[KILN_ERR_MSG_MAX] and
 * *log (caller frees; may be NULL) are filled.  -KILN_ENOTFOUND on a
 * miss. */
int kiln_store_lookup_failure (kiln_store_t *self, const char *action_key,
                               int *code, char *message, char **log,
                               kiln_err_t *err);
/* Forget a failure (after a successful rebuild). */
void kiln_store_forget_failure (kiln_store_t *self, const char *action_key);

/* --- artifacts by content hash, and pins ------------------------------- */

/* Open the stored artifact with content hash `digest_hex` for reading: a
 * file descriptor the caller closes, its size in *size.  Marks it used
 * (LRU).  -KILN_ENOTFOUND when the store does not hold it.  The bytes are
 * not checked here (that would read the whole file on the caller's
 * thread): whoever reads them checks them (kiln_artifact_read), and
 * kiln_store_check finds damage. */
int kiln_store_artifact_open (kiln_store_t *self, const char *digest_hex,
                              uint64_t *size, kiln_err_t *err);

/* Pin a stored artifact, so that eviction never removes it, until
 * kiln_store_unpin.  The pin is the file STATE/pins/<digest>, fsynced
 * before this returns, so it survives a crash; an artifact stored again
 * after it went missing is pinned again.  *changed (may be NULL) is true
 * when it was not pinned before.  -KILN_ENOTFOUND when the store does not
 * hold the artifact; KILN_ELIMIT past 65536 pins. */
int kiln_store_pin (kiln_store_t *self, const char *digest_hex, bool *changed,
                    kiln_err_t *err);
/* Remove a pin (whether or not the artifact is stored); *changed is true
 * when there was one.  Evicts what the pin held above the cap. */
int kiln_store_unpin (kiln_store_t *self, const char *digest_hex, bool *changed,
                      kiln_err_t *err);
bool kiln_store_is_pinned (const kiln_store_t *self, const char *digest_hex);

/* --- blobs -------------------------------------------------------------- */

/* True when the blob is stored (committed). */
bool kiln_store_has_blob (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN]);
/* Open a stored blob for reading: a file descriptor the caller closes,
 * its size in *size.  Marks it used (LRU). */
int kiln_store_blob_open (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                          uint64_t *size, kiln_err_t *err);
/* Pin a stored blob so that eviction skips it; unpin undoes one pin. */
void kiln_store_blob_pin (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN]);
void kiln_store_blob_unpin (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN]);
/* Forget a stored blob found damaged (kiln_store_check, a worker's report). */
void kiln_store_blob_remove (kiln_store_t *self, const uint8_t digest[KILN_DIGEST_LEN]);

/* Start receiving a blob of `size` bytes: a preallocated file in
 * STATE/tmp, and two threads of its own that hash and write what it is
 * handed.  At most `max_chunks` chunks are held at once (0: a default);
 * `tag` is given back by kiln_store_upload_poll.  Its announced size is
 * reserved under the cap until it is finished or aborted, evicting what
 * may be evicted to make room: the store's indexed bytes plus the
 * reservations stay within the cap.  Refused (KILN_ELIMIT) when the blob
 * does not fit beside what cannot be evicted (pinned artifacts, blobs of
 * queued jobs), and (KILN_EBUSY, try again) when it would fit but other
 * uploads hold the room.  Caller owns the writer: finish or abort it. */
kiln_blob_writer_t *kiln_store_blob_begin (kiln_store_t *self,
                                           const uint8_t digest[KILN_DIGEST_LEN],
                                           uint64_t size, size_t max_chunks, void *tag,
                                           kiln_err_t *err);
/* Append the next chunk: its frame is taken (*frame_p becomes NULL, also
 * on failure) and hashed and written by the writer's threads.  Waits only
 * when `max_chunks` chunks are held.  A write error shows here or at
 * finish. */
int kiln_blob_writer_take (kiln_blob_writer_t *self, zframe_t **frame_p, kiln_err_t *err);
/* Append the next `len` bytes (copied). */
int kiln_blob_writer_write (kiln_blob_writer_t *self, const void *data, size_t len,
                            kiln_err_t *err);
/* Bytes handed over so far, and the blob's size. */
uint64_t kiln_blob_writer_received (const kiln_blob_writer_t *self);
uint64_t kiln_blob_writer_size (const kiln_blob_writer_t *self);
/* Chunks hashed and let go of so far (copied for the file writer). */
uint64_t kiln_blob_writer_released (kiln_blob_writer_t *self);
/* No more chunks: the threads check the digest and make the file durable
 * on their own; kiln_blob_writer_done turns true when they are through. */
void kiln_blob_writer_close (kiln_blob_writer_t *self);
bool kiln_blob_writer_done (kiln_blob_writer_t *self);
/* All bytes handed over: wait for the threads (at once after
 * kiln_blob_writer_done), then make the blob visible.  Consumes *writer_p
 * (also on failure, KILN_EVERIFY for a wrong digest). */
int kiln_store_blob_finish (kiln_store_t *self, kiln_blob_writer_t **writer_p,
                            kiln_err_t *err);
/* Readable when some writer has news (chunks released, or done): then
 * call kiln_store_upload_poll, which calls `fn` once for each such writer
 * with its tag, on the caller's thread; `fn` may finish or abort it. */
int kiln_store_upload_fd (const kiln_store_t *self);
typedef void (kiln_store_upload_fn) (kiln_blob_writer_t *writer, void *tag, void *arg);
void kiln_store_upload_poll (kiln_store_t *self, kiln_store_upload_fn *fn, void *arg);
/* Drop an unfinished upload and its file; *writer_p becomes NULL. */
void kiln_blob_writer_abort (kiln_blob_writer_t **writer_p);

/* --- accounting and checks -------------------------------------------- */

typedef struct kiln_store_stats {
    uint64_t bytes;          /* counted against the cap */
    uint64_t max_bytes;      /* the cap */
    uint64_t artifacts;      /* entries of each kind */
    uint64_t blobs;
    uint64_t failures;
    uint64_t evicted;        /* entries evicted since start */
    uint64_t pinned;         /* pinned artifacts the store holds */
    uint64_t pinned_bytes;   /* their bytes (never evicted) */
    uint64_t job_pinned_bytes;  /* blobs pinned by jobs (not evicted while they are) */
    uint64_t reserved_bytes; /* announced by uploads in progress (preallocated) */
    uint64_t uploads;        /* blob writers in progress */
} kiln_store_stats_t;

void kiln_store_stats (const kiln_store_t *self, kiln_store_stats_t *out);

/* What kiln_store_check found. */
typedef struct kiln_store_report {
    uint64_t artifacts, blobs, actions, failures;      /* entries checked */
    uint64_t bad;            /* damaged or inconsistent entries */
    uint64_t dangling;       /* action records whose artifact is gone (not damage) */
    uint64_t removed;        /* entries removed (with repair) */
} kiln_store_report_t;

/* Check every entry of the store at `state_dir` (which must not be in use
 * by a broker): each blob hashes to its name; each artifact parses (every
 * member's size and digest), has the content hash it is named by and a
 * signature that STATE/keyring accepts; each action record names a stored
 * artifact built for that action; each failure record parses.  Each
 * problem is printed to `out` (may be NULL).  With `repair`, damaged
 * entries and dangling records are removed.  Returns 0 when nothing was
 * damaged (dangling records are not damage: eviction leaves them). */
int kiln_store_check (const char *state_dir, bool repair, FILE *out,
                      kiln_store_report_t *report, kiln_err_t *err);

#endif
