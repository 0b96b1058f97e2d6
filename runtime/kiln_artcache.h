/*
 * kiln_artcache — a runtime's verified artifacts, shared by every model
 * loaded from the same file (the replicas of dynamic batching,
 * DataParallel, kiln-serve --replicas).  Internal to libkilnrt.
 *
 * The first load of a file reads and checks it (kiln_artifact_read_fd:
 * every member's SHA-256 against the manifest, the large ones mapped
 * from the file when that is allowed) and keeps it here; a later load of
 * the same file takes a reference to the same artifact, so N replicas
 * hold the weights once — one mapping, or one copy — in RSS as in
 * memory, and the weights are hashed once.  "The same file" is the same
 * device and inode with the same size, mtime and ctime as when it was
 * read: the manifest's digests are then those of the bytes held, and any
 * write to the file since (which moves ctime) makes the next load read
 * and check it afresh, in an entry of its own.  Every load, shared or
 * not, checks the signature against its own keyring.
 *
 * Invariants: an entry holds only an artifact whose every member has
 * been checked against its manifest; it keeps its file open, so that its
 * inode cannot be given to another file while it exists; it is freed
 * with its last reference.  Shared artifacts are read-only.  All
 * functions are thread-safe.
 */
#ifndef KILN_ARTCACHE_H
#define KILN_ARTCACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_error.h"

typedef struct kiln_artcache kiln_artcache_t;

/* How a cache holds an artifact's large members (KILN_RT_MMAP). */
typedef enum {
    KILN_ARTCACHE_READ,     /* "0": always read into memory */
    KILN_ARTCACHE_MAP,      /* "1": mapped from the file (KILN_ARTIFACT_MAP) */
    KILN_ARTCACHE_AUTO      /* unset: read when the file is at most
                               kiln_artcache_read_max, else mapped */
} kiln_artcache_mode_t;

/* The mode KILN_RT_MMAP's value names (NULL or empty: unset, auto):
 * "0", "1" or "auto"; anything else is -1. */
int kiln_artcache_mode (const char *value);

/* The largest file that KILN_ARTCACHE_AUTO reads into memory on a host
 * of `phys` bytes of memory (0: unknown): 1 GiB, or an eighth of the
 * memory when that is less.  Read, the weights sit on advised huge
 * pages (kiln_mem_alloc); a file's pages mapped from the page cache are
 * as large as the way the file came into the cache made them, mostly
 * 4 KiB, and streaming weights through 4 KiB pages cost resnet50 up to
 * a sixth of its time on a virtual machine (docs/engine.md, "Huge
 * pages").  Larger files stay mapped: their pages are given back as they
 * stream and the host's memory need not hold a copy. */
uint64_t kiln_artcache_read_max (uint64_t phys);

/* Whether a cache in `mode` maps a file of `size` bytes on a host of
 * `phys` bytes of memory (0: unknown). */
bool kiln_artcache_maps (kiln_artcache_mode_t mode, uint64_t size, uint64_t phys);

/* An empty cache holding artifacts as `mode` says.  Caller owns it;
 * NULL when out of memory. */
kiln_artcache_t *kiln_artcache_new (kiln_artcache_mode_t mode);
/* Free the cache.  Every artifact must have been put back. */
void kiln_artcache_destroy (kiln_artcache_t **self_p);

/* The artifact at `path`, its members checked and its signature verified
 * against the keys in `keyring_dir`: read now, or shared with the loads
 * of the same unchanged file before.  The caller holds a reference to a
 * shared, read-only artifact and gives it back with kiln_artcache_put.
 * Errors name the path. */
kiln_artifact_t *kiln_artcache_get (kiln_artcache_t *self, const char *path,
                                    const char *keyring_dir, kiln_err_t *err);
/* Give back a reference from kiln_artcache_get and NULL *art_p; the last
 * reference frees the artifact (unmapping its members). */
void kiln_artcache_put (kiln_artcache_t *self, kiln_artifact_t **art_p);

#endif
