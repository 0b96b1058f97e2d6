/*
 * kiln_release — signed release records: which artifact a model runs.
 *
 * A release record says "model NAME runs artifact DIGEST, as release SEQ,
 * until EXPIRES".  It is signed by a release key, which is not the farm
 * key that signs artifacts: who may build and who may deploy are
 * different keys, and a host keeps them in different keyrings.  Both are
 * plain `kiln keygen` Ed25519 keys; what makes a key a release key is
 * only which keyring trusts it.
 *
 * The record is compact JSON with sorted keys (jansson JSON_COMPACT |
 * JSON_SORT_KEYS, no trailing newline), like manifest.json:
 *
 *   {"artifact":"<sha256 of manifest.json>","expires_at":"2026-12-20T10:00:00Z",
 *    "format":"kiln-release","format_version":1,"issued_at":"2026-11-20T10:00:00Z",
 *    "key_id":"<16 hex>","model":"resnet18","runtime_abi":1,"seq":7,
 *    "target":"cpu-x86_64"}
 *
 * On disk (what `kiln release sign -o` writes, one file so that replacing
 * it with rename is atomic) it travels in an envelope, itself one line of
 * compact JSON with sorted keys and a newline:
 *
 *   {"algorithm":"ed25519","key_id":"<16 hex>","record":"<base64 of the
 *    record's bytes>","signature":"<base64 of 64 raw Ed25519 bytes>"}
 *
 * The signature is pure Ed25519 over exactly the record's bytes, so that
 * stock `openssl pkeyutl -verify -rawin` checks it once both are base64-
 * decoded (docs/release-format.md has the commands).  The envelope's
 * algorithm and key id are read before any cryptography so that an
 * unknown algorithm or key is refused first; the record repeats the key
 * id under the signature, and the two must agree.
 *
 * Invariants: a kiln_release_t that kiln_release_open or kiln_release_read
 * filled in was signed by a key in the keyring, was in canonical form, and
 * has every field within its bounds.  Expiry, the artifact and rollback
 * are separate checks (kiln_release_check_*) so that a caller can tell
 * which of them refused a record, and so that a host can check them
 * against its own clock, artifact and state.
 *
 * Rollback protection: a state directory holds, per model, the highest
 * release accepted (DIR/<model>.json).  A record with a lower seq is a
 * rollback and is refused; one with the same seq must name the same
 * artifact.  The rules are one table in kiln_release.c.
 */
#ifndef KILN_RELEASE_H
#define KILN_RELEASE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_error.h"
#include "common/kiln_hash.h"
#include "common/kiln_limits.h"

#define KILN_RELEASE_FORMAT_VERSION 1
#define KILN_RELEASE_MAX_SEQ        INT64_MAX   /* JSON integers are int64 in jansson */
#define KILN_RELEASE_TIME_LEN       21          /* "YYYY-MM-DDTHH:MM:SSZ" + NUL */
#define KILN_RELEASE_DEFAULT_SECONDS (30LL * 86400)   /* --expires when left out */

typedef struct kiln_release {
    int format_version;                     /* KILN_RELEASE_FORMAT_VERSION */
    char model[KILN_MAX_MODEL_NAME + 1];    /* [A-Za-z0-9][A-Za-z0-9._-]{0,63} */
    char artifact[KILN_HEX_LEN];            /* the artifact's content hash */
    uint64_t seq;                           /* 1..KILN_RELEASE_MAX_SEQ */
    char target[64];                        /* from the artifact's manifest */
    int runtime_abi;                        /* from the artifact's manifest */
    int64_t issued_at;                      /* seconds since the epoch, UTC */
    int64_t expires_at;                     /* after issued_at, within
                                               KILN_MAX_RELEASE_SECONDS of it */
    char key_id[KILN_KEY_ID_LEN];           /* the release key's id */
} kiln_release_t;

/* --- names, times, durations ------------------------------------------ */

/* True when `name` is a model name a release may carry: 1..64 bytes of
 * [A-Za-z0-9._-], starting with a letter or digit (so that it is a safe
 * file name: no "/", no "..", not hidden). */
bool kiln_release_model_ok (const char *name);

/* Parse a lifetime "N" + one of s, m, h, d (3600s, 90m, 12h, 30d) into
 * seconds, 1..KILN_MAX_RELEASE_SECONDS.  The error quotes the text. */
int kiln_release_parse_duration (const char *text, int64_t *seconds,
                                 kiln_err_t *err);

/* Write `t` as RFC 3339 UTC with seconds ("2026-11-20T10:00:00Z"). */
void kiln_release_format_time (int64_t t, char out[KILN_RELEASE_TIME_LEN]);

/* Parse exactly that form (years 1970..9999); -KILN_EFORMAT otherwise. */
int kiln_release_parse_time (const char *text, int64_t *t);

/* --- making and signing ----------------------------------------------- */

/* Fill `self` for `model` at `seq` from the artifact: its content hash,
 * target and runtime ABI; issued at `issued_at`, expiring `lifetime`
 * seconds later.  The artifact is taken as it is (read and so checked
 * against its manifest, or built in memory); its signature is not looked
 * at here.  key_id stays empty until kiln_release_sign. */
int kiln_release_init (kiln_release_t *self, kiln_artifact_t *art,
                       const char *model, uint64_t seq, int64_t issued_at,
                       int64_t lifetime, kiln_err_t *err);

/* Check every field of a signed record against the bounds the parser
 * enforces, so that whatever is written can be read back; the error
 * names the field. */
int kiln_release_check (const kiln_release_t *self, kiln_err_t *err);

/* The record's canonical bytes.  Caller owns *out (free()), which is
 * NUL-terminated one past *len. */
int kiln_release_encode (const kiln_release_t *self, char **out, size_t *len,
                         kiln_err_t *err);

/* Parse a record's bytes strictly: version first, then no unknown,
 * missing or duplicate field, every field in bounds, and the bytes must
 * be the canonical encoding of what they hold.  The signature is not
 * checked: this is the parser kiln_release_open uses once it has been. */
int kiln_release_decode (const char *json, size_t len, kiln_release_t *out,
                         kiln_err_t *err);

/* Set self->key_id to `key`'s, sign the record and return the envelope
 * (one line, with a newline).  Caller owns *out (free()), NUL-terminated
 * one past *len. */
int kiln_release_sign (kiln_release_t *self, const kiln_key_t *key,
                       char **out, size_t *len, kiln_err_t *err);

/* --- verifying -------------------------------------------------------- */

/* Open an envelope: parse it strictly, refuse an algorithm other than
 * Ed25519 or a key id not in `ring` before any cryptography, check the
 * signature, then parse the record and check that it names the key that
 * signed it.  Errors are KILN_EFORMAT / KILN_ELIMIT for a malformed
 * envelope or record and KILN_EVERIFY for a refused one. */
int kiln_release_open (const uint8_t *data, size_t len,
                       const kiln_keyring_t *ring, kiln_release_t *out,
                       kiln_err_t *err);

/* kiln_release_open on the file at `path` (at most
 * KILN_MAX_RELEASE_BYTES); the error names the file. */
int kiln_release_read (const char *path, const kiln_keyring_t *ring,
                       kiln_release_t *out, kiln_err_t *err);

/* KILN_EVERIFY when the record has expired at `now` (now >= expires_at). */
int kiln_release_check_expiry (const kiln_release_t *self, int64_t now,
                               kiln_err_t *err);

/* KILN_EVERIFY unless `art`'s content hash is the record's artifact, and
 * its target and runtime ABI the record's. */
int kiln_release_check_artifact (const kiln_release_t *self,
                                 kiln_artifact_t *art, kiln_err_t *err);

/* --- rollback state --------------------------------------------------- */

/* Refuse (KILN_EVERIFY) a record that the state in `state_dir` says is a
 * rollback: a seq lower than the highest accepted for its model, or the
 * same seq naming another artifact.  No state for the model (or no
 * directory) accepts.  Reads only. */
int kiln_release_check_newer (const kiln_release_t *self, const char *state_dir,
                              kiln_err_t *err);

/* kiln_release_check_newer, then, when the record is newer than the
 * state, record it as the model's highest (DIR/<model>.json, written
 * atomically with rename, under an exclusive lock on the directory so
 * that two processes cannot both move it).  Creates `state_dir` (0700)
 * when it is missing.  *recorded (may be NULL) says whether the state
 * changed: false for the same seq and artifact again. */
int kiln_release_accept (const kiln_release_t *self, const char *state_dir,
                         bool *recorded, kiln_err_t *err);

#endif
