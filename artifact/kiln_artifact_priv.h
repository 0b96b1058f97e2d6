/*
 * kiln_artifact_priv — what the artifact sources share and nobody else
 * sees: the member record, the artifact struct, and the manifest codec and
 * Ed25519 primitives that kiln_artifact.c builds on.
 *
 * Invariant of kiln_member_t: `sha256` is the hex digest of `data[0..len)`,
 * computed once when the bytes enter the artifact (added or read), so that
 * serialising the manifest never hashes gigabytes of weights again.  The
 * bytes cannot change afterwards through kiln: the public API hands them
 * out const, and mapped members are mapped read-only (what another writer
 * of the file can do is in docs/artifact-format.md).
 */
#ifndef KILN_ARTIFACT_PRIV_H
#define KILN_ARTIFACT_PRIV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <openssl/evp.h>

#include "artifact/kiln_artifact.h"

/* Reserved archive members, in archive order (payload members follow). */
#define KILN_MEMBER_MANIFEST      "manifest.json"
#define KILN_MEMBER_MANIFEST_SIG  "manifest.sig"
#define KILN_MEMBER_SIGNATURE     "signature.json"
#define KILN_MEMBER_PROVENANCE    "provenance.json"
#define KILN_MEMBER_PROVENANCE_SIG "provenance.sig"
#define KILN_N_RESERVED_MEMBERS   5

#define KILN_SIG_ALGORITHM        "ed25519"
#define KILN_MAX_SIGNATURE_JSON   4096          /* signature.json */
#define KILN_MAX_PROVENANCE_BYTES KILN_MAX_MANIFEST_BYTES

typedef struct kiln_member {
    char name[KILN_MAX_MEMBER_NAME + 1];  /* [A-Za-z0-9._-]{1,64} */
    uint8_t *data;                        /* owned; NULL in a manifest's list */
    size_t len;                           /* bytes in data, or declared size */
    char sha256[KILN_HEX_LEN];            /* lower-case hex of the bytes */
    bool mapped;                          /* data is mmap'd (munmap), not malloc'd */
    uint64_t file_offset;                 /* read from a file: where its data starts
                                             there (0: not read from a file) */
} kiln_member_t;

struct kiln_key {
    EVP_PKEY *pkey;                 /* Ed25519, public or private */
    bool has_private;               /* true when pkey holds the secret */
    char id[KILN_KEY_ID_LEN];       /* 16 hex chars of SHA-256(DER SPKI) */
    char fingerprint[KILN_HEX_LEN]; /* all 64 of them */
};

/* --- manifest codec (kiln_manifest.c) -------------------------------- */

/* True for a valid payload member name that is not reserved. */
bool kiln_member_name_ok (const char *name);
/* True for one of the five reserved member names. */
bool kiln_member_name_reserved (const char *name);

/* Check every field of `m` against the bounds the parser enforces, so
 * that whatever is written can be read back.  The error names the field. */
int kiln_manifest_check (const kiln_manifest_t *m, kiln_err_t *err);

/* Serialise `m` with `members` (which must be sorted by name) into
 * compact JSON with sorted keys.  Caller owns *out (free()), which is
 * NUL-terminated one past *len. */
int kiln_manifest_encode (const kiln_manifest_t *m,
                          const kiln_member_t *members, int n_members,
                          char **out, size_t *len, kiln_err_t *err);

/* Parse manifest.json strictly into `m` (released first) and the member
 * list (names, sizes and digests; data NULL) into members[KILN_MAX_MEMBERS].
 * Rejects bytes that are not the canonical encoding of what they hold, so
 * that the content hash of an artifact has exactly one spelling. */
int kiln_manifest_decode (const char *json, size_t len, kiln_manifest_t *m,
                          kiln_member_t *members, int *n_members,
                          kiln_err_t *err);

/* --- Ed25519 (kiln_key.c) -------------------------------------------- */

/* Sign `len` bytes with the private key into sig[KILN_SIG_LEN]. */
int kiln_key_sign (const kiln_key_t *key, const void *data, size_t len,
                   uint8_t sig[KILN_SIG_LEN], kiln_err_t *err);
/* True when `sig` is a valid signature by `key` over the bytes. */
bool kiln_key_verify (const kiln_key_t *key, const void *data, size_t len,
                      const uint8_t sig[KILN_SIG_LEN]);

#endif
