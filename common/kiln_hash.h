/*
 * kiln_hash — SHA-256 content addressing, hex forms and the action key.
 *
 * Everything kiln stores or ships is named by the SHA-256 of its bytes:
 * weight blobs, graphs (over their canonical encoding), artifacts (over
 * their manifest).  The action key names a compilation: the same graph,
 * normalised arguments, compiler version and target give the same key, so
 * a cache keyed by it never serves a build made from different inputs.
 */
#ifndef KILN_HASH_H
#define KILN_HASH_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "common/kiln_error.h"

#define KILN_DIGEST_LEN 32                 /* bytes in a SHA-256 digest */
#define KILN_HEX_LEN    (2 * KILN_DIGEST_LEN + 1)   /* hex plus NUL */

typedef struct kiln_sha256 kiln_sha256_t;

/* One-shot SHA-256 of `len` bytes. */
void kiln_sha256 (const void *data, size_t len, uint8_t out[KILN_DIGEST_LEN]);

/* Streaming SHA-256.  Caller owns the returned context and must finish it
 * with kiln_sha256_final or free it with kiln_sha256_destroy.  NULL only
 * when out of memory. */
kiln_sha256_t *kiln_sha256_new (void);
void kiln_sha256_update (kiln_sha256_t *self, const void *data, size_t len);
/* Write the digest and destroy the context; *self_p becomes NULL. */
void kiln_sha256_final (kiln_sha256_t **self_p, uint8_t out[KILN_DIGEST_LEN]);
void kiln_sha256_destroy (kiln_sha256_t **self_p);

/* Lower-case hex of `n` bytes into `out`, which holds 2n+1 chars. */
void kiln_hex (const uint8_t *in, size_t n, char *out);
/* Parse exactly 2n hex chars into `n` bytes; -KILN_EFORMAT if not hex. */
int kiln_unhex (const char *hex, uint8_t *out, size_t n);
/* True when `s` is 64 lower-case hex characters. */
bool kiln_is_digest_hex (const char *s);

/* SHA-256 of a file, streamed, as hex into out[KILN_HEX_LEN]. */
int kiln_sha256_file_hex (const char *path, char out[KILN_HEX_LEN],
                          kiln_err_t *err);

/* The action key of a compilation, as hex:
 * SHA-256 over a length-prefixed encoding of ("kiln-action-v1",
 * graph digest hex, normalised compiler args, compiler id,
 * compiler version, target). */
void kiln_action_key (const char *graph_digest_hex, const char *norm_args,
                      const char *compiler_id, const char *compiler_version,
                      const char *target, char out[KILN_HEX_LEN]);


/* Normalise a compiler argument string for the action key: split on
 * whitespace and join the words with one space, so that "  -O3\t--x  "
 * and "-O3 --x" name the same compilation.  Fails with KILN_ELIMIT when
 * the result does not fit in `size`. */
int kiln_args_normalize (const char *args, char *out, size_t size,
                         kiln_err_t *err);

#endif
