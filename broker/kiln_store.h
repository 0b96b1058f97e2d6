/*
 * kiln_store — the broker's state on disk: a content-addressed store of
 * artifacts and the action cache.
 *
 *   STATE/cas/sha256/ab/abcdef...   a signed artifact archive, named by its
 *                                   content hash (SHA-256 of manifest.json)
 *   STATE/ac/<action key>           the content hash (64 hex chars + "\n")
 *                                   of the artifact built for that action
 *
 * Every file is written with kiln_write_file_atomic, so after a crash an
 * entry is either whole or absent.  Names are checked to be 64 lower-case
 * hex characters before they become paths.  The store trusts nothing it
 * reads back: kiln_store_lookup parses the archive (every member's size
 * and SHA-256), checks that its content hash is the one asked for and,
 * once kiln_store_trust_key was called, that it is signed by that key; any
 * failure is reported and the caller builds again.
 *
 *   STATE/keyring/farm.pub          the public half of the signing key,
 *                                   rewritten at every start, so that
 *                                   entries signed by an older key are
 *                                   rebuilt rather than served
 */
#ifndef KILN_STORE_H
#define KILN_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_error.h"
#include "common/kiln_hash.h"

typedef struct kiln_store kiln_store_t;

/* Open (creating) the store under `state_dir`.  Caller owns the result. */
kiln_store_t *kiln_store_new (const char *state_dir, kiln_err_t *err);
void kiln_store_destroy (kiln_store_t **self_p);

/* Write `key`'s public half to STATE/keyring/farm.pub and from now on
 * serve only artifacts whose signature that keyring accepts. */
int kiln_store_trust_key (kiln_store_t *self, const kiln_key_t *key,
                          kiln_err_t *err);

/* Put an artifact archive under its content hash, replacing an existing
 * entry: the caller has just checked and signed these bytes, while the old
 * entry may be the damaged copy that made it build again. */
int kiln_store_put_artifact (kiln_store_t *self, const char *digest_hex,
                             const uint8_t *data, size_t len, kiln_err_t *err);

/* Record that `action_key` built the artifact `digest_hex`. */
int kiln_store_put_action (kiln_store_t *self, const char *action_key,
                           const char *digest_hex, kiln_err_t *err);

/* Look an action up: on a hit fill artifact_hex and return the archive
 * bytes in *data (caller frees) after checking that they parse, carry
 * that content hash and (see kiln_store_trust_key) a good signature.  Returns -KILN_ENOTFOUND on a miss; other errors
 * (a damaged entry) are returned too, and the caller treats them as a
 * miss after logging them. */
int kiln_store_lookup (kiln_store_t *self, const char *action_key,
                       char artifact_hex[KILN_HEX_LEN], uint8_t **data,
                       size_t *len, kiln_err_t *err);

#endif
