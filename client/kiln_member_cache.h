/*
 * kiln_member_cache — large artifact members kept on the client by their
 * SHA-256, so that fetching an artifact whose weights the client already
 * holds does not download them again (docs/protocol.md, "Fetch by
 * content hash": a GET's `have`).
 *
 * One file per member, named by its digest in hex, in
 * kiln_cache_dir()/members (made 0700; files 0600).  Nothing read from
 * here is trusted: the bytes go into the artifact being fetched, whose
 * whole-file digest and every member's digest are checked as for bytes
 * from the wire, and an entry that fails is dropped.  A directory or an
 * entry that is not owned by this user, or that others may write, is
 * ignored.  The total size is bounded (least recently used entries go
 * first; using an entry moves its mtime): $KILN_MEMBER_CACHE_MAX bytes
 * (K, M, G suffixes; default KILN_MCACHE_DEFAULT_MAX), and
 * $KILN_MEMBER_CACHE=off (or 0, or a maximum of 0) turns it off.  Two
 * processes at once: entries are written to a temporary name and
 * renamed, so a reader sees a whole file or none; a temporary file left
 * by a process that died is removed after an hour.
 */
#ifndef KILN_MEMBER_CACHE_H
#define KILN_MEMBER_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kiln_hash.h"
#include "common/kiln_proto.h"

#define KILN_MCACHE_MIN_BYTES   (1u << 20)       /* smaller members are not kept */
#define KILN_MCACHE_DEFAULT_MAX (8ULL << 30)     /* bytes kept, by default */
#define KILN_MCACHE_MAX_SCAN    4096             /* entries looked at in the directory */

typedef struct kiln_mcache kiln_mcache_t;

/* The user's cache (above), or NULL when it is off or no cache directory
 * is known.  Caller owns it. */
kiln_mcache_t *kiln_mcache_default (void);

/* A cache in `dir` (created 0700 when missing) holding at most
 * `max_bytes`; NULL when the directory cannot be made or is not this
 * user's alone.  Caller owns it. */
kiln_mcache_t *kiln_mcache_open (const char *dir, uint64_t max_bytes);
void kiln_mcache_destroy (kiln_mcache_t **self_p);

/* Up to `max` entries, most recently used first, as {digest, size}: what
 * a GET says it holds.  Returns how many. */
size_t kiln_mcache_recent (kiln_mcache_t *self, kiln_blob_ref_t *out, size_t max);

/* The entry of digest `hex` open for reading when it is there, is this
 * user's alone and has `size` bytes (its mtime moved: used now); -1
 * otherwise. */
int kiln_mcache_open_member (kiln_mcache_t *self, const char *hex, uint64_t size);

/* Keep `len` bytes at `offset` of `src_fd` as the member of digest `hex`
 * (the caller checked them): copied (reflinked where the file system
 * can), older entries evicted to stay within the bound.  An entry that
 * is there already is only marked used.  True when it is kept. */
bool kiln_mcache_put (kiln_mcache_t *self, int src_fd, uint64_t offset, uint64_t len,
                      const char *hex);

/* Remove the entry of digest `hex` (its bytes did not check). */
void kiln_mcache_drop (kiln_mcache_t *self, const char *hex);

/* Bytes the entries take now (for tests). */
uint64_t kiln_mcache_bytes (kiln_mcache_t *self);

#endif
