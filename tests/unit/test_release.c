/*
 * Unit tests for artifact/kiln_release: the release record's round trip,
 * its strict and bounded parsing, the signature and the release keyring,
 * expiry, the artifact it names, and the rollback state.
 *
 * Every test gets a fresh temporary directory holding a farm key pair in
 * DIR/keys (the farm keyring) and a release key pair in DIR/release (the
 * release keyring), and removes it afterwards.
 */
#include <check.h>

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>
#include <openssl/evp.h>

#include "artifact/kiln_artifact_priv.h"
#include "artifact/kiln_release.h"
#include "common/kiln_fs.h"
#include "tests/unit/testlib.h"

#define T0 1795000000LL     /* 2026-11-18T11:06:40Z: "now" in these tests */
#define DAY 86400LL

static char *s_dir;                 /* per-test temporary directory */
static char s_farm_ring[PATH_MAX];  /* s_dir/keys: the farm key, a keyring */
static char s_rel_ring[PATH_MAX];   /* s_dir/release: the release key, a keyring */
static char s_state[PATH_MAX];      /* s_dir/state: rollback state */
static kiln_key_t *s_farm;          /* signs artifacts */
static kiln_key_t *s_rel;           /* signs releases */
static kiln_keyring_t *s_ring;      /* the release keyring, loaded */

static void
setup (void)
{
    kiln_err_t err;
    s_dir = testlib_keydir ("kiln-test-release-", s_farm_ring, &s_farm);
    snprintf (s_rel_ring, sizeof s_rel_ring, "%s/release", s_dir);
    snprintf (s_state, sizeof s_state, "%s/state", s_dir);
    s_rel = kiln_key_generate (&err);
    ck_assert_msg (s_rel, "%s", err.msg);
    ck_assert_msg (kiln_key_write_pair (s_rel, s_rel_ring, &err) == 0, "%s", err.msg);
    s_ring = kiln_keyring_load (s_rel_ring, &err);
    ck_assert_msg (s_ring, "%s", err.msg);
}

static void
teardown (void)
{
    kiln_keyring_destroy (&s_ring);
    kiln_key_destroy (&s_rel);
    kiln_key_destroy (&s_farm);
    testlib_rmdir (&s_dir);
}

/* --- helpers --------------------------------------------------------- */

/* A small artifact signed by the farm key; `variant` changes its program
 * and so its content hash. */
static kiln_artifact_t *
s_artifact (int variant)
{
    kiln_err_t err;
    kiln_artifact_t *a = kiln_artifact_new ();
    ck_assert_ptr_nonnull (a);
    kiln_manifest_t *m = kiln_artifact_manifest (a);
    uint8_t d[KILN_DIGEST_LEN];
    kiln_sha256 ("graph", 5, d);
    kiln_hex (d, KILN_DIGEST_LEN, m->graph_digest);
    kiln_sha256 ("action", 6, d);
    kiln_hex (d, KILN_DIGEST_LEN, m->action_key);
    snprintf (m->compiler_id, sizeof m->compiler_id, "kiln-builtin");
    snprintf (m->target, sizeof m->target, "cpu-x86_64");
    kiln_io_t io = { .name = "x", .dtype = KILN_DT_FLOAT32, .shape = { 2, { 1, 4 } } };
    ck_assert (kiln_manifest_set_io (m, false, &io, 1, &err) == 0);
    ck_assert (kiln_manifest_set_io (m, true, &io, 1, &err) == 0);
    char program[32];
    snprintf (program, sizeof program, "program variant %d", variant);
    ck_assert (kiln_artifact_add_member (a, "program.kbin", program, strlen (program), &err) == 0);
    ck_assert_msg (kiln_artifact_sign (a, s_farm, NULL, &err) == 0, "%s", err.msg);
    return a;
}

/* A release of `model` at `seq` for artifact variant `variant`, issued at
 * T0 for 30 days, not yet signed. */
static kiln_release_t
s_record (const char *model, uint64_t seq, int variant)
{
    kiln_err_t err;
    kiln_release_t rec;
    kiln_artifact_t *a = s_artifact (variant);
    ck_assert_msg (kiln_release_init (&rec, a, model, seq, T0, 30 * DAY, &err) == 0, "%s",
                   err.msg);
    kiln_artifact_destroy (&a);
    return rec;
}

/* The envelope of `rec` signed by `key`.  Caller frees it. */
static char *
s_signed (kiln_release_t *rec, const kiln_key_t *key, size_t *len)
{
    kiln_err_t err;
    char *env;
    ck_assert_msg (kiln_release_sign (rec, key, &env, len, &err) == 0, "%s", err.msg);
    return env;
}

static char *
s_b64 (const void *data, size_t len)
{
    char *out = malloc (4 * ((len + 2) / 3) + 1);
    ck_assert_ptr_nonnull (out);
    EVP_EncodeBlock ((unsigned char *) out, data, (int) len);
    return out;
}

/* An envelope around arbitrary record bytes, signed by `key`, claiming
 * `algorithm` and `key_id`: what a forger or a broken signer could write.
 * Caller frees it. */
static char *
s_seal (const char *record, const kiln_key_t *key, const char *algorithm,
        const char *key_id)
{
    kiln_err_t err;
    uint8_t sig[KILN_SIG_LEN];
    ck_assert_msg (kiln_key_sign (key, record, strlen (record), sig, &err) == 0, "%s", err.msg);
    char *rb = s_b64 (record, strlen (record)), *sb = s_b64 (sig, sizeof sig);
    json_t *root = json_pack ("{s:s, s:s, s:s, s:s}", "algorithm", algorithm, "key_id", key_id,
                              "record", rb, "signature", sb);
    char *text = json_dumps (root, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref (root);
    free (rb);
    free (sb);
    ck_assert_ptr_nonnull (text);
    return text;
}

/* The record's canonical bytes.  Caller frees them. */
static char *
s_encoded (const kiln_release_t *rec)
{
    kiln_err_t err;
    char *text;
    size_t len;
    ck_assert_msg (kiln_release_encode (rec, &text, &len, &err) == 0, "%s", err.msg);
    return text;
}

/* A copy of `s` with the first `from` replaced by `to`. */
static char *
s_replace (const char *s, const char *from, const char *to)
{
    const char *at = strstr (s, from);
    ck_assert_msg (at, "'%s' not in '%s'", from, s);
    size_t n = strlen (s) - strlen (from) + strlen (to);
    char *out = malloc (n + 1);
    ck_assert_ptr_nonnull (out);
    size_t head = (size_t) (at - s);
    memcpy (out, s, head);
    strcpy (out + head, to);
    strcat (out, at + strlen (from));
    return out;
}

/* A copy of envelope `env` with the string field `key` set to `value`. */
static char *
s_with_field (const char *env, const char *key, const char *value)
{
    json_t *root = json_loads (env, 0, NULL);
    ck_assert_ptr_nonnull (root);
    ck_assert (json_object_set_new (root, key, json_string (value)) == 0);
    char *text = json_dumps (root, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref (root);
    ck_assert_ptr_nonnull (text);
    return text;
}

/* Open `env` against the release keyring, expecting failure with `code`
 * and `want` in the message. */
static void
s_open_fails (const char *env, int code, const char *want)
{
    kiln_err_t err = { 0 };
    kiln_release_t rec;
    int rc = kiln_release_open ((const uint8_t *) env, strlen (env), s_ring, &rec, &err);
    ck_assert_msg (rc != 0, "opened, but wanted '%s'", want);
    ck_assert_msg (err.code == code, "code %s, want %s: %s", kiln_errname (err.code),
                   kiln_errname (code), err.msg);
    ck_assert_msg (strstr (err.msg, want), "'%s' does not say '%s'", err.msg, want);
}

/* Decode `json`, expecting failure with `code` and `want` in the message. */
static void
s_decode_fails (const char *json, int code, const char *want)
{
    kiln_err_t err = { 0 };
    kiln_release_t rec;
    ck_assert_msg (kiln_release_decode (json, strlen (json), &rec, &err) != 0,
                   "decoded '%s', but wanted '%s'", json, want);
    ck_assert_msg (err.code == code, "code %s, want %s: %s", kiln_errname (err.code),
                   kiln_errname (code), err.msg);
    ck_assert_msg (strstr (err.msg, want), "'%s' does not say '%s'", err.msg, want);
}

static char *
s_path (const char *name)
{
    return testlib_path (s_dir, name);
}

/* --- the record ------------------------------------------------------ */

START_TEST (test_release_round_trips_through_sign_and_open)
{
    kiln_err_t err;
    kiln_artifact_t *a = s_artifact (1);
    char digest[KILN_HEX_LEN];
    ck_assert (kiln_artifact_digest (a, digest, &err) == 0);
    kiln_artifact_destroy (&a);

    kiln_release_t rec = s_record ("resnet18", 7, 1);
    size_t len;
    char *env = s_signed (&rec, s_rel, &len);
    ck_assert_str_eq (rec.key_id, kiln_key_id (s_rel));
    //  One line, ending in a newline, bounded.
    ck_assert_uint_eq (strlen (env), len);
    ck_assert_ptr_eq (strchr (env, '\n'), env + len - 1);
    ck_assert_uint_le (len, KILN_MAX_RELEASE_BYTES);

    kiln_release_t got;
    ck_assert_msg (kiln_release_open ((uint8_t *) env, len, s_ring, &got, &err) == 0, "%s",
                   err.msg);
    ck_assert_int_eq (got.format_version, 1);
    ck_assert_str_eq (got.model, "resnet18");
    ck_assert_str_eq (got.artifact, digest);
    ck_assert_uint_eq (got.seq, 7);
    ck_assert_str_eq (got.target, "cpu-x86_64");
    ck_assert_int_eq (got.runtime_abi, KILN_RUNTIME_ABI_VERSION);
    ck_assert_int_eq (got.issued_at, T0);
    ck_assert_int_eq (got.expires_at, T0 + 30 * DAY);
    ck_assert_str_eq (got.key_id, kiln_key_id (s_rel));

    //  The record inside is the canonical encoding, with the times in
    //  RFC 3339 UTC seconds; and the same record signs to the same bytes.
    char *json = s_encoded (&got);
    ck_assert_msg (strstr (json, "\"issued_at\":\"2026-11-18T11:06:40Z\""), "%s", json);
    ck_assert_msg (strstr (json, "\"expires_at\":\"2026-12-18T11:06:40Z\""), "%s", json);
    ck_assert_msg (strncmp (json, "{\"artifact\":", 12) == 0, "%s", json);
    size_t len2;
    char *env2 = s_signed (&got, s_rel, &len2);
    ck_assert_str_eq (env, env2);

    //  Through a file, as `kiln release verify` reads it.
    ck_assert (kiln_write_file_atomic (s_path ("release.json"), env, len, 0644, &err) == 0);
    ck_assert_msg (kiln_release_read (s_path ("release.json"), s_ring, &got, &err) == 0, "%s",
                   err.msg);
    ck_assert_uint_eq (got.seq, 7);
    free (env);
    free (env2);
    free (json);
}
END_TEST

START_TEST (test_release_refuses_a_record_with_one_byte_changed)
{
    kiln_release_t rec = s_record ("resnet18", 3, 1);
    size_t len;
    char *env = s_signed (&rec, s_rel, &len);

    //  The signed record, changed and base64'd again: a well-formed
    //  envelope whose signature no longer matches.
    char *record = s_encoded (&rec);
    char *forged = s_replace (record, "\"seq\":3", "\"seq\":4");
    char *rb = s_b64 (record, strlen (record)), *fb = s_b64 (forged, strlen (forged));
    char *tampered = s_replace (env, rb, fb);
    s_open_fails (tampered, KILN_EVERIFY, "bad signature on the release record");

    //  Any one bit of the envelope file flipped is refused, whichever
    //  check catches it.
    for (size_t i = 0; i < len; i++) {
        char *copy = strdup (env);
        copy[i] ^= 0x01;
        kiln_err_t err;
        kiln_release_t got;
        ck_assert_msg (kiln_release_open ((uint8_t *) copy, len, s_ring, &got, &err) != 0,
                       "byte %zu flipped was accepted", i);
        free (copy);
    }
    free (env);
    free (record);
    free (forged);
    free (rb);
    free (fb);
    free (tampered);
}
END_TEST

START_TEST (test_release_refuses_a_key_not_in_the_release_keyring)
{
    //  The farm key is a perfectly good key, but not a release key.
    kiln_release_t rec = s_record ("resnet18", 3, 1);
    size_t len;
    char *env = s_signed (&rec, s_farm, &len);
    char want[PATH_MAX + 128];
    snprintf (want, sizeof want, "signed by key %s which is not in release keyring '%s'",
              kiln_key_id (s_farm), s_rel_ring);
    s_open_fails (env, KILN_EVERIFY, want);
    free (env);

    //  A record whose signed key id is not the key that signed it.
    rec = s_record ("resnet18", 3, 1);
    snprintf (rec.key_id, sizeof rec.key_id, "%s", kiln_key_id (s_farm));
    char *record = s_encoded (&rec);
    env = s_seal (record, s_rel, "ed25519", kiln_key_id (s_rel));
    s_open_fails (env, KILN_EVERIFY, "names key");
    free (env);
    free (record);
}
END_TEST

START_TEST (test_release_checks_algorithm_and_key_before_the_signature)
{
    kiln_release_t rec = s_record ("resnet18", 3, 1);
    snprintf (rec.key_id, sizeof rec.key_id, "%s", kiln_key_id (s_rel));
    char *record = s_encoded (&rec);
    //  An unknown algorithm is refused as such, even from an unknown key
    //  and with a signature that would not verify.
    char *env = s_seal (record, s_farm, "rsa-pss", "0123456789abcdef");
    s_open_fails (env, KILN_EVERIFY, "signature algorithm 'rsa-pss' is not supported");
    free (env);
    //  An unknown key is refused as such before the (bad) signature.
    env = s_seal (record, s_farm, "ed25519", "0123456789abcdef");
    s_open_fails (env, KILN_EVERIFY, "key 0123456789abcdef which is not in release keyring");
    free (env);
    free (record);
}
END_TEST

START_TEST (test_release_refuses_an_expired_record)
{
    kiln_err_t err = { 0 };
    kiln_release_t rec = s_record ("resnet18", 3, 1);
    ck_assert (kiln_release_check_expiry (&rec, T0, &err) == 0);
    ck_assert (kiln_release_check_expiry (&rec, T0 + 30 * DAY - 1, &err) == 0);
    ck_assert (kiln_release_check_expiry (&rec, T0 + 30 * DAY, &err) == -KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "release seq 3 of model 'resnet18' expired at "
                                    "2026-12-18T11:06:40Z"), "%s", err.msg);
    ck_assert (kiln_release_check_expiry (&rec, T0 + 365 * DAY, &err) == -KILN_EVERIFY);

    //  A lifetime of one second.
    kiln_artifact_t *a = s_artifact (1);
    ck_assert (kiln_release_init (&rec, a, "resnet18", 3, T0, 1, &err) == 0);
    ck_assert (kiln_release_check_expiry (&rec, T0, &err) == 0);
    ck_assert (kiln_release_check_expiry (&rec, T0 + 1, &err) == -KILN_EVERIFY);
    //  Lifetimes outside 1 s..365 d are refused when the record is made.
    ck_assert (kiln_release_init (&rec, a, "resnet18", 3, T0, 0, &err) == -KILN_ELIMIT);
    ck_assert (kiln_release_init (&rec, a, "resnet18", 3, T0, 366 * DAY, &err) == -KILN_ELIMIT);
    kiln_artifact_destroy (&a);
}
END_TEST

START_TEST (test_release_refuses_an_artifact_with_another_digest)
{
    kiln_err_t err = { 0 };
    kiln_release_t rec = s_record ("resnet18", 3, 1);
    kiln_artifact_t *same = s_artifact (1), *other = s_artifact (2);
    ck_assert_msg (kiln_release_check_artifact (&rec, same, &err) == 0, "%s", err.msg);
    char digest[KILN_HEX_LEN];
    ck_assert (kiln_artifact_digest (other, digest, &err) == 0);
    ck_assert (kiln_release_check_artifact (&rec, other, &err) == -KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, digest), "%s", err.msg);
    ck_assert_msg (strstr (err.msg, "is not the one release seq 3 of model 'resnet18' names"),
                   "%s", err.msg);
    //  The same artifact read back from disk is still the one named.
    ck_assert (kiln_artifact_write (same, s_path ("m.kar"), &err) == 0);
    kiln_artifact_t *read = kiln_artifact_read (s_path ("m.kar"), &err);
    ck_assert_msg (read, "%s", err.msg);
    ck_assert_msg (kiln_release_check_artifact (&rec, read, &err) == 0, "%s", err.msg);
    kiln_artifact_destroy (&read);
    kiln_artifact_destroy (&same);
    kiln_artifact_destroy (&other);
}
END_TEST

/* --- rollback state -------------------------------------------------- */

START_TEST (test_release_state_refuses_rollback_and_conflicting_digest)
{
    kiln_err_t err = { 0 };
    bool recorded;
    kiln_release_t r5 = s_record ("resnet18", 5, 1);
    snprintf (r5.key_id, sizeof r5.key_id, "%s", kiln_key_id (s_rel));

    //  No state yet: accepted, and the directory is made.
    ck_assert (kiln_release_check_newer (&r5, s_state, &err) == 0);
    ck_assert (!kiln_file_exists (s_state));
    ck_assert_msg (kiln_release_accept (&r5, s_state, &recorded, &err) == 0, "%s", err.msg);
    ck_assert (recorded);
    char path[PATH_MAX + 32];
    snprintf (path, sizeof path, "%s/resnet18.json", s_state);
    ck_assert (kiln_file_exists (path));

    //  A lower seq is a rollback, whatever artifact it names.
    kiln_release_t r4 = s_record ("resnet18", 4, 1);
    ck_assert (kiln_release_check_newer (&r4, s_state, &err) == -KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "release seq 4 of model 'resnet18' is lower than the seq "
                                    "already accepted"), "%s", err.msg);
    ck_assert_msg (strstr (err.msg, "holds seq 5"), "%s", err.msg);
    ck_assert (kiln_release_accept (&r4, s_state, &recorded, &err) == -KILN_EVERIFY);
    ck_assert (!recorded);

    //  The same seq and artifact again (a record re-signed with a new
    //  expiry, say) passes and changes nothing.
    kiln_release_t again = s_record ("resnet18", 5, 1);
    again.expires_at += DAY;
    ck_assert_msg (kiln_release_accept (&again, s_state, &recorded, &err) == 0, "%s", err.msg);
    ck_assert (!recorded);

    //  The same seq naming another artifact is refused.
    kiln_release_t other = s_record ("resnet18", 5, 2);
    ck_assert (kiln_release_accept (&other, s_state, &recorded, &err) == -KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "names another artifact"), "%s", err.msg);

    //  Another model has its own sequence.
    kiln_release_t m1 = s_record ("bert", 1, 2);
    ck_assert_msg (kiln_release_check_newer (&m1, s_state, &err) == 0, "%s", err.msg);

    //  A higher seq moves the state; the old one is now a rollback.
    kiln_release_t r6 = s_record ("resnet18", 6, 2);
    ck_assert (kiln_release_check_newer (&r6, s_state, &err) == 0);
    ck_assert_msg (kiln_release_accept (&r6, s_state, &recorded, &err) == 0, "%s", err.msg);
    ck_assert (recorded);
    ck_assert (kiln_release_check_newer (&r5, s_state, &err) == -KILN_EVERIFY);
}
END_TEST

START_TEST (test_release_state_that_is_damaged_refuses_rather_than_resets)
{
    kiln_err_t err = { 0 };
    kiln_release_t r = s_record ("resnet18", 5, 1);
    ck_assert (kiln_release_accept (&r, s_state, NULL, &err) == 0);
    char path[PATH_MAX + 32];
    snprintf (path, sizeof path, "%s/resnet18.json", s_state);
    static const char *const damaged[] = {
        "",
        "{\"seq\":",
        "{\"artifact\":\"00\",\"format\":\"kiln-release-state\",\"format_version\":1,"
        "\"model\":\"resnet18\",\"seq\":5}",
        "{\"artifact\":\"0000000000000000000000000000000000000000000000000000000000000000\","
        "\"format\":\"kiln-release-state\",\"format_version\":1,\"model\":\"bert\",\"seq\":5}",
        "{\"format\":\"kiln-release-state\",\"format_version\":2}",
    };
    for (size_t i = 0; i < sizeof damaged / sizeof damaged[0]; i++) {
        ck_assert (kiln_write_file_atomic (path, damaged[i], strlen (damaged[i]), 0644, &err) == 0);
        ck_assert_msg (kiln_release_check_newer (&r, s_state, &err) != 0, "accepted %s",
                       damaged[i]);
        ck_assert_msg (strstr (err.msg, "fix or remove the state file"), "%s", err.msg);
        ck_assert (kiln_release_accept (&r, s_state, NULL, &err) != 0);
    }
}
END_TEST

/* --- strict, bounded parsing ------------------------------------------ */

START_TEST (test_release_decode_refuses_malformed_records_with_clear_errors)
{
    kiln_release_t rec = s_record ("resnet18", 3, 1);
    snprintf (rec.key_id, sizeof rec.key_id, "%s", kiln_key_id (s_rel));
    char *good = s_encoded (&rec);
    kiln_err_t err;
    kiln_release_t got;
    ck_assert_msg (kiln_release_decode (good, strlen (good), &got, &err) == 0, "%s", err.msg);

    static const struct {
        const char *from, *to;      /* applied to the good record */
        int code;
        const char *want;
    } cases[] = {
        { "\"seq\":3", "\"seq\":0", KILN_ELIMIT, "field 'seq' is 0, outside 1.." },
        { "\"seq\":3", "\"seq\":-1", KILN_ELIMIT, "field 'seq' is -1" },
        { "\"seq\":3", "\"seq\":99999999999999999999", KILN_EFORMAT, "not valid JSON" },
        { "\"seq\":3", "\"seq\":\"3\"", KILN_EFORMAT, "field 'seq' is not an integer" },
        { "\"seq\":3", "\"seq\":3.0", KILN_EFORMAT, "field 'seq' is not an integer" },
        { "\"seq\":3", "\"seq\":3,\"seq\":3", KILN_EFORMAT, "duplicate" },
        { "\"target\"", "\"comment\":\"hi\",\"target\"", KILN_EFORMAT, "unknown field 'comment'" },
        { "\"model\":\"resnet18\",", "", KILN_EFORMAT, "missing field 'model'" },
        { "\"resnet18\"", "\"../etc/passwd\"", KILN_EFORMAT, "model name '../etc/passwd' is not allowed" },
        { "\"resnet18\"", "\".hidden\"", KILN_EFORMAT, "is not allowed" },
        { "\"resnet18\"",
          "\"m0123456789012345678901234567890123456789012345678901234567890123\"",
          KILN_ELIMIT, "field 'model' is longer than 64 bytes" },
        { "\"cpu-x86_64\"",
          "\"t012345678901234567890123456789012345678901234567890123456789012\"",
          KILN_ELIMIT, "field 'target' is longer than 63 bytes" },
        { "\"cpu-x86_64\"", "\"\"", KILN_EFORMAT, "field 'target' is empty" },
        { "\"runtime_abi\":1", "\"runtime_abi\":0", KILN_ELIMIT, "field 'runtime_abi' is 0" },
        { "\"format_version\":1", "\"format_version\":2", KILN_EUNSUPPORTED,
          "unsupported release record format version 2" },
        { "\"kiln-release\"", "\"kiln-artifact\"", KILN_EFORMAT, "format is 'kiln-artifact'" },
        { "\"issued_at\":\"2026-11-18T11:06:40Z\"", "\"issued_at\":\"2026-02-30T11:06:40Z\"",
          KILN_EFORMAT, "field 'issued_at' is '2026-02-30T11:06:40Z', not a UTC time" },
        { "\"issued_at\":\"2026-11-18T11:06:40Z\"", "\"issued_at\":\"2026-11-18 11:06:40Z\"",
          KILN_EFORMAT, "not a UTC time" },
        { "\"issued_at\":\"2026-11-18T11:06:40Z\"", "\"issued_at\":\"2026-11-18T11:06:40+00:00\"",
          KILN_ELIMIT, "field 'issued_at' is longer than 20 bytes" },
        { "\"issued_at\":\"2026-11-18T11:06:40Z\"", "\"issued_at\":\"2026-12-19T11:06:40Z\"",
          KILN_EFORMAT, "expires_at is not after issued_at" },
        { "\"expires_at\":\"2026-12-18T11:06:40Z\"", "\"expires_at\":\"2028-12-18T11:06:40Z\"",
          KILN_ELIMIT, "longer than the limit" },
        { "\"artifact\":\"", "\"artifact\":\"A", KILN_ELIMIT, "field 'artifact' is longer" },
        { ",\"seq\"", ", \"seq\"", KILN_EFORMAT, "not in canonical form" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *bad = s_replace (good, cases[i].from, cases[i].to);
        s_decode_fails (bad, cases[i].code, cases[i].want);
        free (bad);
    }
    s_decode_fails ("not json", KILN_EFORMAT, "release record is not valid JSON");
    s_decode_fails ("[1,2]", KILN_EFORMAT, "release record is not a JSON object");
    s_decode_fails ("{}", KILN_EFORMAT, "missing field 'format'");

    //  Oversized input is refused before it is parsed.
    char *big = malloc (KILN_MAX_RELEASE_BYTES + 2);
    memset (big, ' ', KILN_MAX_RELEASE_BYTES + 1);
    big[KILN_MAX_RELEASE_BYTES + 1] = '\0';
    s_decode_fails (big, KILN_ELIMIT, "more than the limit of 4096");
    free (big);

    //  A malformed record that a release key did sign is refused too.
    char *bad = s_replace (good, "\"resnet18\"", "\"a/b\"");
    char *env = s_seal (bad, s_rel, "ed25519", kiln_key_id (s_rel));
    s_open_fails (env, KILN_EFORMAT, "model name 'a/b' is not allowed");
    free (env);
    free (bad);
    free (good);
}
END_TEST

START_TEST (test_release_open_refuses_malformed_envelopes)
{
    kiln_release_t rec = s_record ("resnet18", 3, 1);
    size_t len;
    char *env = s_signed (&rec, s_rel, &len);

    s_open_fails ("not json\n", KILN_EFORMAT, "release envelope is not valid JSON");
    char *bad = s_replace (env, "{", "{\"comment\":\"x\",");
    s_open_fails (bad, KILN_EFORMAT, "release envelope: unknown field 'comment'");
    free (bad);
    bad = s_replace (env, "\"algorithm\":\"ed25519\",", "");
    s_open_fails (bad, KILN_EFORMAT, "missing field 'algorithm'");
    free (bad);
    bad = s_replace (env, kiln_key_id (s_rel), "NOT-HEX-AT-ALL!!");
    s_open_fails (bad, KILN_EFORMAT, "key_id is not 16 lower-case hex characters");
    free (bad);
    //  A signature of 63 bytes, or one with whitespace in its base64.
    uint8_t short_sig[63] = { 0 };
    char *sb = s_b64 (short_sig, sizeof short_sig);
    bad = s_with_field (env, "signature", sb);
    s_open_fails (bad, KILN_EFORMAT, "signature is not the base64 of 64 bytes");
    free (bad);
    free (sb);
    bad = s_replace (env, "\"record\":\"eyJ", "\"record\":\"\\neyJ");
    s_open_fails (bad, KILN_EFORMAT, "record is not strict base64");
    free (bad);

    //  A file over the bound is refused before it is read, naming it.
    kiln_err_t err = { 0 };
    char *big = calloc (1, KILN_MAX_RELEASE_BYTES + 1);
    memset (big, ' ', KILN_MAX_RELEASE_BYTES + 1);
    ck_assert (kiln_write_file_atomic (s_path ("big.json"), big, KILN_MAX_RELEASE_BYTES + 1,
                                       0644, &err) == 0);
    kiln_release_t got;
    ck_assert (kiln_release_read (s_path ("big.json"), s_ring, &got, &err) == -KILN_ELIMIT);
    ck_assert_msg (strstr (err.msg, "big.json"), "%s", err.msg);
    free (big);
    free (env);
}
END_TEST

/* --- names, times, durations ------------------------------------------ */

START_TEST (test_release_durations_take_units_and_are_bounded)
{
    static const struct { const char *text; int64_t seconds; } ok[] = {
        { "3600s", 3600 }, { "90m", 5400 }, { "12h", 43200 }, { "30d", 30 * DAY },
        { "1s", 1 }, { "365d", 365 * DAY },
    };
    kiln_err_t err;
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        int64_t v = 0;
        ck_assert_msg (kiln_release_parse_duration (ok[i].text, &v, &err) == 0, "%s", err.msg);
        ck_assert_int_eq (v, ok[i].seconds);
    }
    static const char *const bad[] = {
        "", "30", "d", "0s", "030d", "-1d", "+1d", "1w", "1.5h", "1d ", " 1d", "1dd",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int64_t v;
        ck_assert_msg (kiln_release_parse_duration (bad[i], &v, &err) == -KILN_EINVAL,
                       "accepted '%s'", bad[i]);
        ck_assert_msg (strstr (err.msg, "is not a whole number followed by s, m, h or d"),
                       "%s", err.msg);
    }
    int64_t v;
    ck_assert (kiln_release_parse_duration ("366d", &v, &err) == -KILN_ELIMIT);
    ck_assert (kiln_release_parse_duration ("99999999999s", &v, &err) == -KILN_ELIMIT);
    ck_assert (kiln_release_parse_duration ("9999999999999d", &v, &err) == -KILN_ELIMIT);
    ck_assert_msg (strstr (err.msg, "longer than the limit of 365d"), "%s", err.msg);
}
END_TEST

START_TEST (test_release_times_are_rfc3339_utc_seconds)
{
    char text[KILN_RELEASE_TIME_LEN];
    kiln_release_format_time (0, text);
    ck_assert_str_eq (text, "1970-01-01T00:00:00Z");
    kiln_release_format_time (T0, text);
    ck_assert_str_eq (text, "2026-11-18T11:06:40Z");
    int64_t t;
    ck_assert (kiln_release_parse_time ("2026-11-18T11:06:40Z", &t) == 0);
    ck_assert_int_eq (t, T0);
    ck_assert (kiln_release_parse_time ("2028-02-29T00:00:00Z", &t) == 0);
    static const char *const bad[] = {
        "2027-02-29T00:00:00Z", "2026-13-01T00:00:00Z", "2026-11-18T24:00:00Z",
        "2026-11-18T10:13:60Z", "2026-11-18T11:06:40z", "2026-11-18T11:06:40",
        "2026-11-18T11:06:40.5Z", "1969-12-31T23:59:59Z", "", "now",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        ck_assert_msg (kiln_release_parse_time (bad[i], &t) == -KILN_EFORMAT, "accepted '%s'",
                       bad[i]);
}
END_TEST

START_TEST (test_release_model_names_are_safe_file_names)
{
    static const char *const ok[] = { "resnet18", "a", "Bert-base_v2.1", "0model" };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        ck_assert_msg (kiln_release_model_ok (ok[i]), "refused '%s'", ok[i]);
    static const char *const bad[] = {
        "", ".", "..", ".hidden", "-flag", "_x", "a/b", "a b", "a\nb", "é",
        "m0123456789012345678901234567890123456789012345678901234567890123",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        ck_assert_msg (!kiln_release_model_ok (bad[i]), "accepted '%s'", bad[i]);
    //  And kiln_release_init refuses them with the reason.
    kiln_err_t err;
    kiln_release_t rec;
    kiln_artifact_t *a = s_artifact (1);
    ck_assert (kiln_release_init (&rec, a, "../x", 1, T0, DAY, &err) == -KILN_EINVAL);
    ck_assert_msg (strstr (err.msg, "model name '../x' is not allowed"), "%s", err.msg);
    ck_assert (kiln_release_init (&rec, a, "m", 0, T0, DAY, &err) == -KILN_ELIMIT);
    ck_assert_msg (strstr (err.msg, "seq 0 is outside 1.."), "%s", err.msg);
    kiln_artifact_destroy (&a);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("release");
    TCase *tc = tcase_create ("release");
    tcase_set_timeout (tc, 60);
    tcase_add_checked_fixture (tc, setup, teardown);
    tcase_add_test (tc, test_release_round_trips_through_sign_and_open);
    tcase_add_test (tc, test_release_refuses_a_record_with_one_byte_changed);
    tcase_add_test (tc, test_release_refuses_a_key_not_in_the_release_keyring);
    tcase_add_test (tc, test_release_checks_algorithm_and_key_before_the_signature);
    tcase_add_test (tc, test_release_refuses_an_expired_record);
    tcase_add_test (tc, test_release_refuses_an_artifact_with_another_digest);
    tcase_add_test (tc, test_release_state_refuses_rollback_and_conflicting_digest);
    tcase_add_test (tc, test_release_state_that_is_damaged_refuses_rather_than_resets);
    tcase_add_test (tc, test_release_decode_refuses_malformed_records_with_clear_errors);
    tcase_add_test (tc, test_release_open_refuses_malformed_envelopes);
    tcase_add_test (tc, test_release_durations_take_units_and_are_bounded);
    tcase_add_test (tc, test_release_times_are_rfc3339_utc_seconds);
    tcase_add_test (tc, test_release_model_names_are_safe_file_names);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run_in_tmpdir (s_suite (), "release");
}
