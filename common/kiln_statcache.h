/*
 * kiln_statcache — the SHA-256 of file ranges, remembered by the files'
 * identity, so that importing a model whose weight files did not change
 * does not hash them again (as make and git keep a stat cache).
 *
 * An entry says: the `length` bytes at `offset` of the file with this
 * device, inode, size, mtime and ctime (nanoseconds) hash to this digest.
 * A lookup answers only for a descriptor whose fstat gives all five
 * values back; any write, truncation, chmod, rename over or replacement
 * moves ctime (which no user can set), so a changed file never hits.
 *
 * Racily clean files (git's term): a file written within the timestamp
 * granularity of the moment it is hashed could be written again later
 * without its times moving.  kiln_statcache_remember therefore keeps an
 * entry only when the file's mtime and ctime are older than the moment
 * hashing began by KILN_STATCACHE_RACY_NS (2 s, covering file systems
 * with whole or 2-second times), and only when the file's fstat after
 * hashing is the one taken before (nothing wrote it meanwhile).  A model
 * written less than two seconds before its import is hashed again the
 * next time, that is all.
 *
 * The cache is a text file, one entry a line
 * ("dev ino size mtime_ns ctime_ns offset length sha256hex"), at most
 * KILN_STATCACHE_MAX entries (the oldest go first), written atomically
 * (temporary file, rename) with mode 0600 in a directory made 0700.
 * Lines that do not parse are dropped; a cache file that is not a
 * regular file owned by the user, or is larger than the bound, is
 * ignored (the import then hashes as if there were no cache).  Two kiln
 * processes saving at once: the last rename wins, the other's new
 * entries are simply missed next time.
 */
#ifndef KILN_STATCACHE_H
#define KILN_STATCACHE_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>

#include "common/kiln_error.h"
#include "common/kiln_hash.h"

#define KILN_STATCACHE_MAX      4096                 /* entries kept */
#define KILN_STATCACHE_RACY_NS  2000000000LL         /* see above */

typedef struct kiln_statcache kiln_statcache_t;

/* Load the cache file at `path` (missing: an empty cache).  Caller owns
 * the result (kiln_statcache_destroy); NULL only when out of memory. */
kiln_statcache_t *kiln_statcache_load (const char *path);

/* The cache of `kiln` imports: kiln_cache_dir()/import-digests, or NULL
 * when $KILN_IMPORT_CACHE is "0" or "off", or no cache directory is
 * known.  Caller owns the result. */
kiln_statcache_t *kiln_statcache_default (void);

/* Write it back if anything was remembered (atomically).  Failing to
 * write is not an error of the caller's work: it is logged and ignored. */
void kiln_statcache_save (kiln_statcache_t *self);

void kiln_statcache_destroy (kiln_statcache_t **self_p);

/* The digest of `length` bytes at `offset` of the file whose fstat is
 * `st`: true with out[] filled when an entry matches. */
bool kiln_statcache_lookup (kiln_statcache_t *self, const struct stat *st, uint64_t offset,
                            uint64_t length, uint8_t out[KILN_DIGEST_LEN]);

/* Remember that those bytes hash to `digest`, when `before` (fstat
 * before hashing) equals `after` (fstat after) and the file is not
 * racily clean against `hash_start_ns` (CLOCK_REALTIME when hashing
 * began).  Returns whether it was kept. */
bool kiln_statcache_remember (kiln_statcache_t *self, const struct stat *before,
                              const struct stat *after, int64_t hash_start_ns,
                              uint64_t offset, uint64_t length,
                              const uint8_t digest[KILN_DIGEST_LEN]);

/* How many lookups hit and missed since load (for `--json` and tests). */
void kiln_statcache_counts (const kiln_statcache_t *self, uint64_t *hits, uint64_t *misses);

/* CLOCK_REALTIME in nanoseconds. */
int64_t kiln_statcache_now_ns (void);

#endif
