/*
 * kiln_blobcache — a worker's local cache of weight blobs, so that a
 * model's weights cross the network to a worker once, not once per job.
 *
 *   DIR/ab/abcdef...   a blob, named by the SHA-256 of its bytes
 *   DIR/tmp/           blobs being received; emptied at start
 *
 * A blob is written to DIR/tmp as its chunks arrive (hashed on the way),
 * checked against its digest, and renamed into place; so the cache holds
 * only whole, verified blobs, and what it finds at start it trusts (it
 * wrote it).  Past a size cap the least recently used blobs go first;
 * blobs a running job needs are pinned.  The broker learns which blobs a
 * worker holds from READY (the most recently used first) and from the
 * jobs it gave it, and prefers that worker for jobs that need them.
 */
#ifndef KILN_BLOBCACHE_H
#define KILN_BLOBCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kiln_error.h"
#include "common/kiln_hash.h"

typedef struct kiln_blobcache kiln_blobcache_t;
typedef struct kiln_blobcache_writer kiln_blobcache_writer_t;

/* Open (creating) the cache in `dir` with a cap of `max_bytes`.  Caller
 * owns it. */
kiln_blobcache_t *kiln_blobcache_new (const char *dir, uint64_t max_bytes,
                                      kiln_err_t *err);
void kiln_blobcache_destroy (kiln_blobcache_t **self_p);

/* True when the blob is cached; marks it used. */
bool kiln_blobcache_has (kiln_blobcache_t *self, const uint8_t digest[KILN_DIGEST_LEN]);
/* Path of a cached blob into buf. */
int kiln_blobcache_path (const kiln_blobcache_t *self,
                         const uint8_t digest[KILN_DIGEST_LEN], char *buf,
                         size_t size, kiln_err_t *err);
void kiln_blobcache_pin (kiln_blobcache_t *self, const uint8_t digest[KILN_DIGEST_LEN]);
void kiln_blobcache_unpin (kiln_blobcache_t *self, const uint8_t digest[KILN_DIGEST_LEN]);

/* Store a small blob whole (checked against its digest). */
int kiln_blobcache_put (kiln_blobcache_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                        const void *data, size_t len, kiln_err_t *err);

/* Receive a blob of `size` bytes chunk by chunk.  Caller owns the writer:
 * finish or abort it. */
kiln_blobcache_writer_t *kiln_blobcache_begin (kiln_blobcache_t *self,
                                               const uint8_t digest[KILN_DIGEST_LEN],
                                               uint64_t size, kiln_err_t *err);
/* Write the chunk at `offset` (chunks come in order). */
int kiln_blobcache_write (kiln_blobcache_writer_t *w, uint64_t offset,
                          const void *data, size_t len, kiln_err_t *err);
uint64_t kiln_blobcache_received (const kiln_blobcache_writer_t *w);
/* Check the digest and move the blob into the cache; consumes *w_p. */
int kiln_blobcache_finish (kiln_blobcache_t *self, kiln_blobcache_writer_t **w_p,
                           kiln_err_t *err);
void kiln_blobcache_abort (kiln_blobcache_writer_t **w_p);

/* Up to `max` cached blobs, most recently used first: digests into
 * digests[], sizes into sizes[]; returns how many. */
size_t kiln_blobcache_list (const kiln_blobcache_t *self, uint8_t (*digests)[KILN_DIGEST_LEN],
                            uint64_t *sizes, size_t max);
/* Blobs and bytes cached. */
size_t kiln_blobcache_count (const kiln_blobcache_t *self);
uint64_t kiln_blobcache_bytes (const kiln_blobcache_t *self);

#endif
