/*
 * Unit tests for artifact/: the archive round trip and its determinism,
 * the reader's bounds and integrity checks, signing and verification
 * against a keyring, key files, and interoperability with stock `tar`
 * and `openssl`.
 *
 * Every test gets a fresh temporary directory holding a key pair in
 * DIR/keys (which is also the keyring) and removes it afterwards.
 */
#include <check.h>

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <archive.h>
#include <archive_entry.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_fs.h"
#include "common/kiln_hash.h"
#include "graph/kiln_graph.h"
#include "tests/unit/testlib.h"

#define PROGRAM_MARKER "KILNPROGRAM-MARKER-0123456789"
#define WEIGHTS_MARKER "KILNWEIGHTS-MARKER-9876543210"
#define EXTRA_MARKER   "KILNEXTRA-MARKER-5555555555"
#define PROVENANCE     "{\"builder\": \"worker-1\", \"broker\": \"tcp://farm:5555\", \"built_at\": \"2026-11-20T10:00:00Z\"}"

static char *s_dir;           /* per-test temporary directory */
static char s_keys[PATH_MAX]; /* s_dir/keys: the signer's key pair, a keyring */
static kiln_key_t *s_key;     /* the signer */

static void
setup (void)
{
    s_dir = testlib_keydir ("kiln-test-artifact-", s_keys, &s_key);
}

static void
teardown (void)
{
    kiln_key_destroy (&s_key);
    testlib_rmdir (&s_dir);
}

/* --- helpers --------------------------------------------------------- */

static char *
s_path (const char *name)
{
    return testlib_path (s_dir, name);
}

static uint8_t *
s_program (size_t *len)
{
    *len = 1000;
    uint8_t *p = malloc (*len);
    for (size_t i = 0; i < *len; i++)
        p[i] = (uint8_t) (i * 13 + 5);
    memcpy (p + 100, PROGRAM_MARKER, strlen (PROGRAM_MARKER));
    return p;
}

static uint8_t *
s_weights (size_t *len)
{
    *len = 5000;
    uint8_t *p = malloc (*len);
    for (size_t i = 0; i < *len; i++)
        p[i] = (uint8_t) (i * 7 % 251);
    memcpy (p, WEIGHTS_MARKER, strlen (WEIGHTS_MARKER));
    return p;
}

/* A complete, unsigned artifact like the builtin compiler makes.
 * `reversed` adds the members in the other order. */
static kiln_artifact_t *
s_sample (bool reversed)
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
    snprintf (m->compiler_version, sizeof m->compiler_version, "0.1.0");
    snprintf (m->compiler_args, sizeof m->compiler_args, "--optlevel 2");
    snprintf (m->target, sizeof m->target, "cpu-x86_64");
    kiln_io_t in = { .name = "x", .dtype = KILN_DT_FLOAT32,
                     .shape = { 4, { 1, 3, 224, 224 } } };
    kiln_io_t outs[2] = {
        { .name = "logits", .dtype = KILN_DT_FLOAT32, .shape = { 2, { 1, 1000 } } },
        { .name = "argmax", .dtype = KILN_DT_INT64, .shape = { 1, { 1 } } },
    };
    ck_assert_msg (kiln_manifest_set_io (m, false, &in, 1, &err) == 0, "%s", err.msg);
    ck_assert_msg (kiln_manifest_set_io (m, true, outs, 2, &err) == 0, "%s", err.msg);

    size_t plen, wlen;
    uint8_t *program = s_program (&plen);
    uint8_t *weights = s_weights (&wlen);
    if (reversed) {
        ck_assert (kiln_artifact_take_member (a, "weights.bin", &weights, wlen, &err) == 0);
        ck_assert (kiln_artifact_add_member (a, "program.kbin", program, plen, &err) == 0);
        free (program);
    }
    else {
        ck_assert (kiln_artifact_add_member (a, "program.kbin", program, plen, &err) == 0);
        ck_assert (kiln_artifact_take_member (a, "weights.bin", &weights, wlen, &err) == 0);
        free (program);
    }
    ck_assert_ptr_null (weights);
    return a;
}

static kiln_artifact_t *
s_sample_signed (const kiln_key_t *key, const char *provenance)
{
    kiln_err_t err;
    kiln_artifact_t *a = s_sample (false);
    ck_assert_msg (kiln_artifact_sign (a, key, provenance, &err) == 0, "%s", err.msg);
    return a;
}

static void
s_write_signed (const char *path)
{
    kiln_err_t err;
    kiln_artifact_t *a = s_sample_signed (s_key, PROVENANCE);
    ck_assert_msg (kiln_artifact_write (a, path, &err) == 0, "%s", err.msg);
    kiln_artifact_destroy (&a);
}

static uint8_t *
s_slurp (const char *path, size_t *len)
{
    kiln_err_t err;
    uint8_t *data;
    ck_assert_msg (kiln_read_file (path, 1u << 30, &data, len, &err) == 0, "%s", err.msg);
    return data;
}

static void
s_spit (const char *path, const void *data, size_t len)
{
    kiln_err_t err;
    ck_assert_msg (kiln_write_file_atomic (path, data, len, 0644, &err) == 0, "%s", err.msg);
}

/* Offset of the first `needle` in `hay`, or -1. */
static long
s_find (const uint8_t *hay, size_t n, const char *needle)
{
    size_t m = strlen (needle);
    for (size_t i = 0; i + m <= n; i++)
        if (memcmp (hay + i, needle, m) == 0)
            return (long) i;
    return -1;
}

/* Replace the first `from` in the file with `to` (same length). */
static void
s_patch_file (const char *path, const char *from, const char *to)
{
    ck_assert_uint_eq (strlen (from), strlen (to));
    size_t len;
    uint8_t *data = s_slurp (path, &len);
    long at = s_find (data, len, from);
    ck_assert_msg (at >= 0, "'%s' not found in %s", from, path);
    memcpy (data + at, to, strlen (to));
    s_spit (path, data, len);
    free (data);
}

static int
s_system (const char *fmt, ...)
    __attribute__ ((format (printf, 1, 2)));

/* Run a shell command; its exit status, or -1. */
static int
s_system (const char *fmt, ...)
{
    char cmd[4 * PATH_MAX];
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (cmd, sizeof cmd, fmt, ap);
    va_end (ap);
    int st = system (cmd);
    return st != -1 && WIFEXITED (st) ? WEXITSTATUS (st) : -1;
}

typedef struct {
    const char *name;
    const void *data;
    size_t len;
    int type;            /* AE_IFREG, AE_IFDIR, AE_IFLNK */
} s_entry_t;

/* A tar made by hand, for archives kiln would never write. */
static uint8_t *
s_tar (const s_entry_t *entries, int n, size_t *len)
{
    size_t cap = 4 << 20;
    uint8_t *buf = malloc (cap);
    struct archive *a = archive_write_new ();
    ck_assert_int_eq (archive_write_set_format_pax_restricted (a), ARCHIVE_OK);
    ck_assert_int_eq (archive_write_open_memory (a, buf, cap, len), ARCHIVE_OK);
    for (int i = 0; i < n; i++) {
        struct archive_entry *e = archive_entry_new ();
        archive_entry_set_pathname (e, entries[i].name);
        archive_entry_set_filetype (e, entries[i].type ? (unsigned) entries[i].type : AE_IFREG);
        archive_entry_set_perm (e, 0644);
        if (entries[i].type == AE_IFLNK)
            archive_entry_set_symlink (e, "/etc/passwd");
        archive_entry_set_size (e, entries[i].type ? 0 : (la_int64_t) entries[i].len);
        ck_assert_int_eq (archive_write_header (a, e), ARCHIVE_OK);
        if (!entries[i].type && entries[i].len)
            ck_assert_int_eq (archive_write_data (a, entries[i].data, entries[i].len),
                              (la_ssize_t) entries[i].len);
        archive_entry_free (e);
    }
    ck_assert_int_eq (archive_write_close (a), ARCHIVE_OK);
    archive_write_free (a);
    return buf;
}

/* The sample's manifest.json with the first `from` replaced by `to`. */
static char *
s_manifest_with (const char *from, const char *to)
{
    kiln_err_t err;
    kiln_artifact_t *a = s_sample (false);
    char *json;
    size_t len;
    ck_assert_msg (kiln_artifact_manifest_json (a, &json, &len, &err) == 0, "%s", err.msg);
    kiln_artifact_destroy (&a);
    if (!from)
        return json;
    char *at = strstr (json, from);
    ck_assert_msg (at, "'%s' not in manifest", from);
    char *out = malloc (len + strlen (to) + 1);
    snprintf (out, len + strlen (to) + 1, "%.*s%s%s", (int) (at - json), json, to,
              at + strlen (from));
    free (json);
    return out;
}

/* Read an archive of the sample's payload with `manifest`; NULL expected,
 * with `code` and a message containing `needle`. */
static void
s_expect_manifest_refused (const char *manifest, int code, const char *needle)
{
    size_t plen, wlen, len;
    uint8_t *program = s_program (&plen);
    uint8_t *weights = s_weights (&wlen);
    s_entry_t entries[] = {
        { "manifest.json", manifest, strlen (manifest), 0 },
        { "program.kbin", program, plen, 0 },
        { "weights.bin", weights, wlen, 0 },
    };
    uint8_t *tar = s_tar (entries, 3, &len);
    kiln_err_t err = { 0 };
    kiln_artifact_t *a = kiln_artifact_read_mem (tar, len, &err);
    ck_assert_ptr_null (a);
    ck_assert_msg (err.code == code, "want %s, got %s: %s", kiln_errname (code),
                   kiln_errname (err.code), err.msg);
    ck_assert_msg (strstr (err.msg, needle), "'%s' not in '%s'", needle, err.msg);
    free (tar);
    free (program);
    free (weights);
}

/* --- round trip and determinism -------------------------------------- */

START_TEST (test_artifact_round_trips_manifest_and_members)
{
    kiln_err_t err;
    kiln_artifact_t *a = s_sample_signed (s_key, PROVENANCE);
    ck_assert_msg (kiln_artifact_write (a, s_path ("model.kar"), &err) == 0, "%s", err.msg);
    kiln_artifact_t *b = kiln_artifact_read (s_path ("model.kar"), &err);
    ck_assert_msg (b, "%s", err.msg);

    const kiln_manifest_t *ma = kiln_artifact_manifest (a);
    const kiln_manifest_t *mb = kiln_artifact_manifest (b);
    ck_assert_int_eq (mb->format_version, KILN_ARTIFACT_FORMAT_VERSION);
    ck_assert_int_eq (mb->runtime_abi, KILN_RUNTIME_ABI_VERSION);
    ck_assert_str_eq (mb->graph_digest, ma->graph_digest);
    ck_assert_str_eq (mb->action_key, ma->action_key);
    ck_assert_str_eq (mb->compiler_id, "kiln-builtin");
    ck_assert_str_eq (mb->compiler_version, "0.1.0");
    ck_assert_str_eq (mb->compiler_args, "--optlevel 2");
    ck_assert_str_eq (mb->target, "cpu-x86_64");
    ck_assert_int_eq (mb->n_inputs, 1);
    ck_assert_str_eq (mb->inputs[0].name, "x");
    ck_assert_int_eq (mb->inputs[0].dtype, KILN_DT_FLOAT32);
    ck_assert (kiln_shape_equal (&mb->inputs[0].shape, &ma->inputs[0].shape));
    ck_assert_int_eq (mb->n_outputs, 2);
    ck_assert_str_eq (mb->outputs[1].name, "argmax");
    ck_assert_int_eq (mb->outputs[1].dtype, KILN_DT_INT64);
    ck_assert_int_eq (mb->outputs[0].shape.rank, 2);
    ck_assert_int_eq (mb->outputs[0].shape.dims[1], 1000);

    ck_assert_int_eq (kiln_artifact_member_count (b), 2);
    ck_assert_str_eq (kiln_artifact_member_name (b, 0), "program.kbin");
    ck_assert_str_eq (kiln_artifact_member_name (b, 1), "weights.bin");
    const char *names[] = { "program.kbin", "weights.bin" };
    for (int i = 0; i < 2; i++) {
        size_t la, lb;
        const uint8_t *da = kiln_artifact_member (a, names[i], &la);
        const uint8_t *db = kiln_artifact_member (b, names[i], &lb);
        ck_assert_ptr_nonnull (db);
        ck_assert_uint_eq (la, lb);
        ck_assert (memcmp (da, db, la) == 0);
    }
    ck_assert_ptr_null (kiln_artifact_member (b, "absent.bin", NULL));

    ck_assert (kiln_artifact_is_signed (b));
    ck_assert_str_eq (kiln_artifact_signer (b), kiln_key_id (s_key));
    ck_assert_str_eq (kiln_artifact_provenance (b),
                      "{\"broker\":\"tcp://farm:5555\",\"builder\":\"worker-1\","
                      "\"built_at\":\"2026-11-20T10:00:00Z\"}");
    char da[KILN_HEX_LEN], db[KILN_HEX_LEN];
    ck_assert (kiln_artifact_digest (a, da, &err) == 0);
    ck_assert (kiln_artifact_digest (b, db, &err) == 0);
    ck_assert_str_eq (da, db);

    //  A copy of the manifest outlives the artifact.
    kiln_manifest_t copy;
    ck_assert (kiln_manifest_copy (&copy, mb, &err) == 0);
    kiln_artifact_destroy (&b);
    ck_assert_ptr_null (b);
    ck_assert_str_eq (copy.outputs[0].name, "logits");
    kiln_manifest_release (&copy);
    kiln_artifact_destroy (&a);
}
END_TEST

START_TEST (test_artifact_bytes_are_deterministic)
{
    kiln_err_t err;
    kiln_artifact_t *a = s_sample (false);
    kiln_artifact_t *b = s_sample (true);
    uint8_t *ba, *bb;
    size_t la, lb;
    ck_assert (kiln_artifact_write_mem (a, &ba, &la, &err) == 0);
    ck_assert (kiln_artifact_write_mem (b, &bb, &lb, &err) == 0);
    ck_assert_uint_eq (la, lb);
    ck_assert_msg (memcmp (ba, bb, la) == 0, "unsigned archives differ");
    free (ba);
    free (bb);

    //  Ed25519 is deterministic, so signed archives are too; and a file
    //  written twice is the same bytes.
    ck_assert (kiln_artifact_sign (a, s_key, PROVENANCE, &err) == 0);
    ck_assert (kiln_artifact_sign (b, s_key, PROVENANCE, &err) == 0);
    ck_assert (kiln_artifact_write (a, s_path ("a.kar"), &err) == 0);
    ck_assert (kiln_artifact_write (b, s_path ("b.kar"), &err) == 0);
    ba = s_slurp (s_path ("a.kar"), &la);
    bb = s_slurp (s_path ("b.kar"), &lb);
    ck_assert_uint_eq (la, lb);
    ck_assert_msg (memcmp (ba, bb, la) == 0, "signed archives differ");
    free (bb);

    //  Reading and writing again gives the same bytes back.
    kiln_artifact_t *c = kiln_artifact_read_mem (ba, la, &err);
    ck_assert_msg (c, "%s", err.msg);
    ck_assert (kiln_artifact_write_mem (c, &bb, &lb, &err) == 0);
    ck_assert_uint_eq (la, lb);
    ck_assert_msg (memcmp (ba, bb, la) == 0, "rewritten archive differs");
    free (ba);
    free (bb);
    kiln_artifact_destroy (&a);
    kiln_artifact_destroy (&b);
    kiln_artifact_destroy (&c);
}
END_TEST

START_TEST (test_artifact_digest_is_independent_of_provenance_and_signer)
{
    kiln_err_t err;
    kiln_key_t *other = kiln_key_generate (&err);
    ck_assert_ptr_nonnull (other);
    ck_assert_str_ne (kiln_key_id (other), kiln_key_id (s_key));

    kiln_artifact_t *a = s_sample (false);
    char d0[KILN_HEX_LEN], d1[KILN_HEX_LEN], d2[KILN_HEX_LEN], d3[KILN_HEX_LEN];
    ck_assert (kiln_artifact_digest (a, d0, &err) == 0);
    ck_assert (kiln_is_digest_hex (d0));

    ck_assert (kiln_artifact_sign (a, s_key, PROVENANCE, &err) == 0);
    ck_assert (kiln_artifact_digest (a, d1, &err) == 0);
    uint8_t *b1, *b2;
    size_t l1, l2;
    ck_assert (kiln_artifact_write_mem (a, &b1, &l1, &err) == 0);

    ck_assert (kiln_artifact_sign (a, other, "{\"builder\":\"laptop\"}", &err) == 0);
    ck_assert_str_eq (kiln_artifact_signer (a), kiln_key_id (other));
    ck_assert (kiln_artifact_digest (a, d2, &err) == 0);
    ck_assert (kiln_artifact_write_mem (a, &b2, &l2, &err) == 0);
    ck_assert_str_eq (d0, d1);
    ck_assert_str_eq (d0, d2);
    //  ...while the archives themselves do differ.
    ck_assert (l1 != l2 || memcmp (b1, b2, l1) != 0);

    //  The content hash is the SHA-256 of the manifest.json bytes.
    char *json;
    size_t len;
    ck_assert (kiln_artifact_manifest_json (a, &json, &len, &err) == 0);
    uint8_t raw[KILN_DIGEST_LEN];
    kiln_sha256 (json, len, raw);
    kiln_hex (raw, KILN_DIGEST_LEN, d3);
    ck_assert_str_eq (d0, d3);
    ck_assert_ptr_null (strstr (json, "\": "));
    ck_assert_ptr_null (strchr (json, '\n'));
    ck_assert_ptr_null (strstr (json, "worker-1"));
    free (json);

    //  Changing the payload changes it.
    ck_assert (kiln_artifact_add_member (a, "extra.bin", "x", 1, &err) == 0);
    ck_assert (kiln_artifact_digest (a, d3, &err) == 0);
    ck_assert_str_ne (d0, d3);

    free (b1);
    free (b2);
    kiln_artifact_destroy (&a);
    kiln_key_destroy (&other);
}
END_TEST

/* --- verification ---------------------------------------------------- */

START_TEST (test_artifact_verifies_with_signer_key_in_keyring)
{
    kiln_err_t err;
    s_write_signed (s_path ("model.kar"));
    kiln_artifact_t *a = kiln_artifact_open_verified (s_path ("model.kar"), s_keys, &err);
    ck_assert_msg (a, "%s", err.msg);
    ck_assert_str_eq (kiln_artifact_signer (a), kiln_key_id (s_key));
    ck_assert_int_eq (kiln_artifact_verify (a, s_keys, &err), 0);

    kiln_keyring_t *ring = kiln_keyring_load (s_keys, &err);
    ck_assert_msg (ring, "%s", err.msg);
    ck_assert_int_eq (kiln_keyring_count (ring), 1);
    ck_assert_ptr_nonnull (kiln_keyring_find (ring, kiln_key_id (s_key)));
    ck_assert_int_eq (kiln_artifact_verify_keyring (a, ring, &err), 0);

    //  Changing the artifact after it was read is caught by verify.
    ck_assert (kiln_artifact_add_member (a, "extra.bin", "x", 1, &err) == 0);
    ck_assert_int_eq (kiln_artifact_verify_keyring (a, ring, &err), -KILN_EVERIFY);
    ck_assert_ptr_nonnull (strstr (err.msg, "bad signature on manifest.json"));
    kiln_keyring_destroy (&ring);
    ck_assert_ptr_null (ring);
    kiln_artifact_destroy (&a);

    //  From memory too.
    size_t len;
    uint8_t *data = s_slurp (s_path ("model.kar"), &len);
    a = kiln_artifact_open_verified_mem (data, len, s_keys, &err);
    ck_assert_msg (a, "%s", err.msg);
    kiln_artifact_destroy (&a);
    free (data);
}
END_TEST

START_TEST (test_artifact_refuses_flipped_byte_in_program_member)
{
    kiln_err_t err;
    const char *path = s_path ("model.kar");
    s_write_signed (path);
    //  Flip one bit inside program.kbin's data region.
    size_t len;
    uint8_t *data = s_slurp (path, &len);
    long at = s_find (data, len, PROGRAM_MARKER);
    ck_assert (at > 0);
    data[at + 3] ^= 0x01;
    s_spit (path, data, len);

    kiln_artifact_t *a = kiln_artifact_read (path, &err);
    ck_assert_ptr_null (a);
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "member 'program.kbin': sha256 mismatch"), "%s", err.msg);

    a = kiln_artifact_open_verified (path, s_keys, &err);
    ck_assert_ptr_null (a);
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "member 'program.kbin': sha256 mismatch"), "%s", err.msg);
    ck_assert_msg (strstr (err.msg, path), "%s", err.msg);

    a = kiln_artifact_read_mem (data, len, &err);
    ck_assert_ptr_null (a);
    ck_assert_msg (strstr (err.msg, "member 'program.kbin'"), "%s", err.msg);
    free (data);

    //  And in the weights.
    s_write_signed (path);
    s_patch_file (path, "WEIGHTS-MARKER", "WEIGHTS-MARKEr");
    a = kiln_artifact_open_verified (path, s_keys, &err);
    ck_assert_ptr_null (a);
    ck_assert_msg (strstr (err.msg, "member 'weights.bin': sha256 mismatch"), "%s", err.msg);
}
END_TEST

START_TEST (test_artifact_refuses_tampered_manifest)
{
    kiln_err_t err;
    const char *path = s_path ("model.kar");
    s_write_signed (path);
    //  A change that keeps manifest.json valid and consistent with the
    //  payload: only the signature can catch it.
    s_patch_file (path, "\"target\":\"cpu-x86_64\"", "\"target\":\"cpu-x86_65\"");
    kiln_artifact_t *a = kiln_artifact_read (path, &err);
    ck_assert_msg (a, "%s", err.msg);
    ck_assert_str_eq (kiln_artifact_manifest (a)->target, "cpu-x86_65");
    ck_assert_int_eq (kiln_artifact_verify (a, s_keys, &err), -KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "bad signature on manifest.json"), "%s", err.msg);
    kiln_artifact_destroy (&a);
    a = kiln_artifact_open_verified (path, s_keys, &err);
    ck_assert_ptr_null (a);
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "bad signature on manifest.json"), "%s", err.msg);

    //  A flipped byte that breaks the JSON is refused at read.
    s_write_signed (path);
    s_patch_file (path, "{\"action_key\"", "[\"action_key\"");
    a = kiln_artifact_open_verified (path, s_keys, &err);
    ck_assert_ptr_null (a);
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "manifest.json"), "%s", err.msg);
}
END_TEST

START_TEST (test_artifact_refuses_tampered_provenance)
{
    kiln_err_t err;
    const char *path = s_path ("model.kar");
    s_write_signed (path);
    s_patch_file (path, "worker-1", "worker-2");
    kiln_artifact_t *a = kiln_artifact_open_verified (path, s_keys, &err);
    ck_assert_ptr_null (a);
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "bad signature on provenance.json"), "%s", err.msg);
}
END_TEST

START_TEST (test_artifact_refuses_signer_not_in_keyring)
{
    kiln_err_t err;
    kiln_key_t *stranger = kiln_key_generate (&err);
    ck_assert_ptr_nonnull (stranger);
    kiln_artifact_t *a = s_sample_signed (stranger, NULL);
    ck_assert_ptr_null (kiln_artifact_provenance (a));
    ck_assert (kiln_artifact_write (a, s_path ("model.kar"), &err) == 0);
    kiln_artifact_destroy (&a);

    a = kiln_artifact_open_verified (s_path ("model.kar"), s_keys, &err);
    ck_assert_ptr_null (a);
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    char want[PATH_MAX + 128];
    snprintf (want, sizeof want, "signed by key %s which is not in keyring '%s'",
              kiln_key_id (stranger), s_keys);
    ck_assert_msg (strstr (err.msg, want), "%s", err.msg);

    //  Once its public key is in the keyring, it verifies.
    char pub[2 * PATH_MAX];
    snprintf (pub, sizeof pub, "%s/stranger.pem", s_keys);
    ck_assert (kiln_key_write_public (stranger, pub, &err) == 0);
    a = kiln_artifact_open_verified (s_path ("model.kar"), s_keys, &err);
    ck_assert_msg (a, "%s", err.msg);
    kiln_artifact_destroy (&a);
    kiln_key_destroy (&stranger);
}
END_TEST

START_TEST (test_artifact_refuses_unsigned)
{
    kiln_err_t err;
    kiln_artifact_t *a = s_sample (false);
    ck_assert (!kiln_artifact_is_signed (a));
    ck_assert_str_eq (kiln_artifact_signer (a), "");
    ck_assert (kiln_artifact_write (a, s_path ("model.kar"), &err) == 0);
    kiln_artifact_destroy (&a);

    a = kiln_artifact_read (s_path ("model.kar"), &err);
    ck_assert_msg (a, "%s", err.msg);
    ck_assert (!kiln_artifact_is_signed (a));
    ck_assert_int_eq (kiln_artifact_verify (a, s_keys, &err), -KILN_EVERIFY);
    ck_assert_str_eq (err.msg, "artifact is not signed");
    kiln_artifact_destroy (&a);

    a = kiln_artifact_open_verified (s_path ("model.kar"), s_keys, &err);
    ck_assert_ptr_null (a);
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "artifact is not signed"), "%s", err.msg);
}
END_TEST

START_TEST (test_artifact_checks_algorithm_before_keyring_and_crypto)
{
    kiln_err_t err;
    const char *path = s_path ("model.kar");
    s_write_signed (path);
    s_patch_file (path, "\"algorithm\":\"ed25519\"", "\"algorithm\":\"rsa-pss\"");
    //  The keyring does not even exist: the algorithm is refused first.
    kiln_artifact_t *a = kiln_artifact_open_verified (path, s_path ("no-such-keyring"), &err);
    ck_assert_ptr_null (a);
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "signature algorithm 'rsa-pss' is not supported"),
                   "%s", err.msg);
}
END_TEST

START_TEST (test_artifact_write_refuses_changes_after_signing)
{
    kiln_err_t err;
    kiln_artifact_t *a = s_sample_signed (s_key, NULL);
    snprintf (kiln_artifact_manifest (a)->target, 64, "cpu-aarch64");
    uint8_t *out;
    size_t len;
    ck_assert_int_eq (kiln_artifact_write_mem (a, &out, &len, &err), -KILN_EINVAL);
    ck_assert_ptr_null (out);
    ck_assert_msg (strstr (err.msg, "changed after it was signed"), "%s", err.msg);
    ck_assert (kiln_artifact_sign (a, s_key, NULL, &err) == 0);
    ck_assert (kiln_artifact_write_mem (a, &out, &len, &err) == 0);
    free (out);
    kiln_artifact_destroy (&a);
}
END_TEST

/* --- keys ------------------------------------------------------------ */

START_TEST (test_keygen_writes_private_key_0600_and_refuses_to_overwrite)
{
    kiln_err_t err;
    char key_path[2 * PATH_MAX], pub_path[2 * PATH_MAX];
    snprintf (key_path, sizeof key_path, "%s/kiln.key", s_keys);
    snprintf (pub_path, sizeof pub_path, "%s/kiln.pub", s_keys);
    struct stat st;
    ck_assert (stat (key_path, &st) == 0);
    ck_assert_int_eq (st.st_mode & 0777, 0600);
    ck_assert (stat (pub_path, &st) == 0);
    ck_assert_int_eq (st.st_mode & 0777, 0644);

    size_t before_len, after_len;
    uint8_t *before = s_slurp (key_path, &before_len);
    ck_assert (s_find (before, before_len, "-----BEGIN PRIVATE KEY-----") == 0);
    kiln_key_t *other = kiln_key_generate (&err);
    ck_assert_int_eq (kiln_key_write_pair (other, s_keys, &err), -KILN_EIO);
    ck_assert_msg (strstr (err.msg, "already exists"), "%s", err.msg);
    uint8_t *after = s_slurp (key_path, &after_len);
    ck_assert_uint_eq (before_len, after_len);
    ck_assert (memcmp (before, after, before_len) == 0);
    free (before);
    free (after);

    //  A symlink planted where the private key goes is not followed.
    char trap_dir[PATH_MAX], trap_key[2 * PATH_MAX];
    snprintf (trap_dir, sizeof trap_dir, "%s/trap", s_dir);
    snprintf (trap_key, sizeof trap_key, "%s/kiln.key", trap_dir);
    ck_assert (mkdir (trap_dir, 0700) == 0);
    ck_assert (symlink (s_path ("elsewhere"), trap_key) == 0);
    ck_assert (kiln_key_write_pair (other, trap_dir, &err) != 0);
    ck_assert (!kiln_file_exists (s_path ("elsewhere")));
    kiln_key_destroy (&other);

    //  The files load back to the same key id.
    kiln_key_t *priv = kiln_key_load_private (key_path, &err);
    ck_assert_msg (priv, "%s", err.msg);
    ck_assert (kiln_key_has_private (priv));
    ck_assert_str_eq (kiln_key_id (priv), kiln_key_id (s_key));
    kiln_key_t *pub = kiln_key_load_public (pub_path, &err);
    ck_assert_msg (pub, "%s", err.msg);
    ck_assert (!kiln_key_has_private (pub));
    ck_assert_str_eq (kiln_key_id (pub), kiln_key_id (s_key));
    ck_assert_uint_eq (strlen (kiln_key_id (pub)), 16);

    //  A public key cannot sign; the wrong kind of file does not load.
    kiln_artifact_t *a = s_sample (false);
    ck_assert_int_eq (kiln_artifact_sign (a, pub, NULL, &err), -KILN_EINVAL);
    ck_assert (!kiln_artifact_is_signed (a));
    kiln_artifact_destroy (&a);
    ck_assert_ptr_null (kiln_key_load_public (key_path, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_ptr_null (kiln_key_load_private (pub_path, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_ptr_null (kiln_key_load_private (s_path ("absent.key"), &err));
    ck_assert_int_eq (err.code, KILN_ENOTFOUND);
    kiln_key_destroy (&priv);
    kiln_key_destroy (&pub);
    ck_assert_ptr_null (pub);
}
END_TEST

START_TEST (test_keyring_skips_private_keys_and_other_files)
{
    kiln_err_t err;
    //  A private key under a .pem name, junk, a directory: all skipped.
    char cmd_src[2 * PATH_MAX], dst[2 * PATH_MAX];
    snprintf (cmd_src, sizeof cmd_src, "%s/kiln.key", s_keys);
    snprintf (dst, sizeof dst, "%s/secret.pem", s_keys);
    size_t len;
    uint8_t *pem = s_slurp (cmd_src, &len);
    s_spit (dst, pem, len);
    free (pem);
    snprintf (dst, sizeof dst, "%s/junk.pub", s_keys);
    s_spit (dst, "not a key\n", 10);
    snprintf (dst, sizeof dst, "%s/dir.pem", s_keys);
    ck_assert (mkdir (dst, 0700) == 0);
    ck_assert_int_eq (s_system ("openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:1024 "
                                "2>/dev/null | openssl pkey -pubout -out '%s/rsa.pub' 2>/dev/null",
                                s_keys), 0);

    kiln_keyring_t *ring = kiln_keyring_load (s_keys, &err);
    ck_assert_msg (ring, "%s", err.msg);
    ck_assert_int_eq (kiln_keyring_count (ring), 1);
    ck_assert_str_eq (kiln_key_id (kiln_keyring_key (ring, 0)), kiln_key_id (s_key));
    ck_assert (!kiln_key_has_private (kiln_keyring_key (ring, 0)));
    ck_assert_ptr_null (kiln_keyring_find (ring, "0123456789abcdef"));
    ck_assert_str_eq (kiln_keyring_dir (ring), s_keys);
    kiln_keyring_destroy (&ring);

    ring = kiln_keyring_load (s_path ("missing"), &err);
    ck_assert_ptr_null (ring);
    ck_assert_int_eq (err.code, KILN_ENOTFOUND);
    ck_assert_msg (strstr (err.msg, "keyring"), "%s", err.msg);
    ck_assert_msg (strstr (err.msg, s_path ("missing")), "%s", err.msg);

    kiln_artifact_t *a = s_sample_signed (s_key, NULL);
    ck_assert_int_eq (kiln_artifact_verify (a, s_path ("missing"), &err), -KILN_ENOTFOUND);
    kiln_artifact_destroy (&a);
}
END_TEST

/* --- reader bounds and structure ------------------------------------- */

/* The signed sample (with provenance) as kiln writes it; caller frees. */
static uint8_t *
s_sample_bytes (size_t *len)
{
    kiln_err_t err;
    kiln_artifact_t *a = s_sample_signed (s_key, PROVENANCE);
    uint8_t *data;
    ck_assert_msg (kiln_artifact_write_mem (a, &data, len, &err) == 0, "%s", err.msg);
    kiln_artifact_destroy (&a);
    return data;
}


START_TEST (test_artifact_read_rejects_truncated_archives)
{
    kiln_err_t err;
    kiln_artifact_t *a;
    size_t len;
    uint8_t *data = s_sample_bytes (&len);
    long prog = s_find (data, len, PROGRAM_MARKER);
    long weights = s_find (data, len, WEIGHTS_MARKER);
    ck_assert (prog > 0 && weights > prog);
    size_t end = (size_t) weights + 5000;   // end of the last member's data
    size_t cuts[] = { 0, 1, 100, 511, 512, 513, 1024, 1500, 2048, 2560,
                      (size_t) prog, (size_t) prog + 10, (size_t) weights - 512,
                      (size_t) weights, (size_t) weights + 100, end - 1 };
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        kiln_err_t e = { 0 };
        a = kiln_artifact_read_mem (data, cuts[i], &e);
        ck_assert_msg (!a, "truncated at %zu but read", cuts[i]);
        ck_assert_msg (e.code != 0 && e.msg[0], "truncated at %zu: no error", cuts[i]);
        //  The same through a file.
        s_spit (s_path ("cut.kar"), data, cuts[i]);
        a = kiln_artifact_read (s_path ("cut.kar"), &e);
        ck_assert_msg (!a, "file truncated at %zu but read", cuts[i]);
        ck_assert_msg (strstr (e.msg, "cut.kar"), "%s", e.msg);
    }
    free (data);

    //  Not a tar at all.
    a = kiln_artifact_read_mem ((const uint8_t *) "hello, world", 12, &err);
    ck_assert_ptr_null (a);
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    a = kiln_artifact_read (s_path ("absent.kar"), &err);
    ck_assert_ptr_null (a);
    ck_assert_int_eq (err.code, KILN_ENOTFOUND);
}
END_TEST

START_TEST (test_artifact_read_rejects_unsafe_or_unlisted_members)
{
    char *manifest = s_manifest_with (NULL, NULL);
    size_t plen, wlen;
    uint8_t *program = s_program (&plen);
    uint8_t *weights = s_weights (&wlen);
    s_entry_t ok[] = {
        { "manifest.json", manifest, strlen (manifest), 0 },
        { "program.kbin", program, plen, 0 },
        { "weights.bin", weights, wlen, 0 },
    };
    struct {
        s_entry_t extra;      /* appended (or replacing, see below) */
        int drop;             /* index of ok[] to leave out, or -1 */
        bool first;           /* put extra first */
        int code;
        const char *needle;
    } cases[] = {
        { { "../evil", "x", 1, 0 }, -1, false, KILN_EFORMAT, "not plain" },
        { { "sub/evil", "x", 1, 0 }, -1, false, KILN_EFORMAT, "not plain" },
        { { "..", "x", 1, 0 }, -1, false, KILN_EFORMAT, "not plain" },
        { { "extra.bin", "x", 1, 0 }, -1, false, KILN_EFORMAT,
          "member 'extra.bin' is not listed in the manifest" },
        { { "program.kbin", program, plen, 0 }, -1, false, KILN_EFORMAT,
          "member 'program.kbin' appears twice" },
        { { "manifest.json", manifest, strlen (manifest), 0 }, -1, false, KILN_EFORMAT,
          "member 'manifest.json' appears twice" },
        { { "subdir", NULL, 0, AE_IFDIR }, -1, false, KILN_EFORMAT, "not plain" },
        { { "link.bin", NULL, 0, AE_IFLNK }, -1, false, KILN_EFORMAT, "not a regular file" },
        { { "manifest.sig", "short", 5, 0 }, -1, false, KILN_EFORMAT,
          "member 'manifest.sig' is 5 bytes, not 64" },
        { { "program.kbin", program, plen, 0 }, 1, true, KILN_EFORMAT,
          "first member is 'program.kbin', not manifest.json" },
        { { "program.kbin", program, plen - 1, 0 }, 1, false, KILN_EVERIFY,
          "member 'program.kbin': size 999 does not match the manifest (1000)" },
        { { NULL, NULL, 0, 0 }, 2, false, KILN_EFORMAT,
          "member 'weights.bin' is listed in the manifest but missing" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        s_entry_t entries[5];
        int n = 0;
        if (cases[c].first)
            entries[n++] = cases[c].extra;
        for (int i = 0; i < 3; i++)
            if (i != cases[c].drop)
                entries[n++] = ok[i];
        if (!cases[c].first && cases[c].extra.name)
            entries[n++] = cases[c].extra;
        size_t len;
        uint8_t *tar = s_tar (entries, n, &len);
        kiln_err_t err = { 0 };
        kiln_artifact_t *a = kiln_artifact_read_mem (tar, len, &err);
        ck_assert_msg (!a, "case %zu was read", c);
        ck_assert_msg (err.code == cases[c].code, "case %zu: %s: %s", c,
                       kiln_errname (err.code), err.msg);
        ck_assert_msg (strstr (err.msg, cases[c].needle), "case %zu: %s", c, err.msg);
        free (tar);
    }

    //  The well-formed archive itself is fine (unsigned).
    size_t len;
    uint8_t *tar = s_tar (ok, 3, &len);
    kiln_err_t err;
    kiln_artifact_t *a = kiln_artifact_read_mem (tar, len, &err);
    ck_assert_msg (a, "%s", err.msg);
    kiln_artifact_destroy (&a);
    free (tar);
    free (manifest);
    free (program);
    free (weights);
}
END_TEST

static void s_setuid (struct archive_entry *e) { archive_entry_set_perm (e, 04755); }
static void s_owner (struct archive_entry *e) { archive_entry_set_uid (e, 1000); }
static void s_uname (struct archive_entry *e) { archive_entry_set_uname (e, "root"); }
static void s_mtime (struct archive_entry *e) { archive_entry_set_mtime (e, 1700000000, 0); }
static void s_group_w (struct archive_entry *e) { archive_entry_set_perm (e, 0664); }
static void s_xattr (struct archive_entry *e)
{
    archive_entry_xattr_add_entry (e, "user.kiln", "x", 1);
}

START_TEST (test_artifact_read_refuses_bytes_after_the_end_marker)
{
    //  An artifact changed in any byte is refused (README): bytes appended
    //  after tar's end marker were ignored (issue 14, finding 9).
    kiln_err_t err;
    kiln_artifact_t *a;
    size_t len;
    uint8_t *data = s_sample_bytes (&len);
    uint8_t *more = calloc (1, len + 30000);
    memcpy (more, data, len);
    struct {
        size_t extra;
        uint8_t byte;
        bool ok;
        const char *needle;
    } cases[] = {
        { 1, 'x', false, "1 bytes follow the archive's end marker, not all of them zero" },
        { 512, 0, true, NULL },          /* zeros up to tar's record: as tar pads */
        { 30000, 0, false, "30000 bytes follow the archive's end marker" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        memset (more + len, 0, 30000);
        more[len + cases[c].extra - 1] = cases[c].byte;
        kiln_err_t e = { 0 };
        a = kiln_artifact_read_mem (more, len + cases[c].extra, &e);
        ck_assert_msg ((a != NULL) == cases[c].ok, "case %zu: %s", c, e.msg);
        if (!cases[c].ok)
            ck_assert_msg (e.code == KILN_EFORMAT && strstr (e.msg, cases[c].needle),
                           "case %zu: %s", c, e.msg);
        kiln_artifact_destroy (&a);
        //  The same through a file, as kiln verify and kiln-run read it.
        s_spit (s_path ("more.kar"), more, len + cases[c].extra);
        a = kiln_artifact_open_verified (s_path ("more.kar"), s_keys, &e);
        ck_assert_msg ((a != NULL) == cases[c].ok, "file case %zu: %s", c, e.msg);
        if (!cases[c].ok)
            ck_assert_msg (strstr (e.msg, cases[c].needle) && strstr (e.msg, "more.kar"),
                           "file case %zu: %s", c, e.msg);
        kiln_artifact_destroy (&a);
    }
    //  No end marker at all: cut right after the last member's data.
    a = kiln_artifact_read_mem (data, len - 1024, &err);
    ck_assert_ptr_null (a);
    ck_assert_msg (strstr (err.msg, "no end marker"), "%s", err.msg);
    free (more);
    free (data);
}
END_TEST

/* Offsets of the padding after each member's data in a ustar/pax
 * archive: walks the 512-byte headers (size in octal at 124, type at
 * 156) up to the end marker. */
static int
s_paddings (const uint8_t *tar, size_t len, size_t *at, size_t *n, char types[], int max)
{
    int count = 0;
    size_t pos = 0;
    while (pos + 512 <= len && tar[pos] && count < max) {
        char field[13] = { 0 };
        memcpy (field, tar + pos + 124, 12);
        size_t size = (size_t) strtoull (field, NULL, 8);
        size_t pad = (512 - size % 512) % 512;
        at[count] = pos + 512 + size;
        n[count] = pad;
        types[count] = (char) tar[pos + 156];
        count++;
        pos += 512 + size + pad;
    }
    return count;
}

START_TEST (test_artifact_read_refuses_nonzero_padding)
{
    //  The bytes that pad a member's data to tar's block were covered by
    //  no check: an artifact changed there was accepted (issue 11, noticed
    //  in review).  Every member's padding, payload and reserved alike.
    size_t len;
    uint8_t *data = s_sample_bytes (&len);
    size_t at[64], n[64];
    char types[64];
    int count = s_paddings (data, len, at, n, types, 64);
    int tried = 0;
    for (int i = 0; i < count; i++) {
        if (n[i] == 0 || types[i] == 'x' || types[i] == 'g')
            continue;           //  nothing to pad; pax records are libarchive's
        tried++;
        uint8_t keep = data[at[i] + n[i] - 1];
        data[at[i] + n[i] - 1] = 0x5a;
        kiln_err_t e = { 0 };
        kiln_artifact_t *a = kiln_artifact_read_mem (data, len, &e);
        ck_assert_msg (!a, "padding of entry %d accepted", i);
        ck_assert_msg (e.code == KILN_EFORMAT && strstr (e.msg, "to tar's 512-byte block "
                                                         "are not all zero"),
                       "entry %d: %s", i, e.msg);
        //  The same through a file, as kiln verify and kiln-run read it.
        s_spit (s_path ("pad.kar"), data, len);
        a = kiln_artifact_open_verified (s_path ("pad.kar"), s_keys, &e);
        ck_assert_msg (!a && strstr (e.msg, "are not all zero"), "file entry %d: %s", i,
                       e.msg);
        data[at[i] + n[i] - 1] = keep;
    }
    ck_assert_int_ge (tried, 3);
    //  Unchanged, it reads.
    kiln_err_t err;
    kiln_artifact_t *a = kiln_artifact_read_mem (data, len, &err);
    ck_assert_msg (a != NULL, "%s", err.msg);
    kiln_artifact_destroy (&a);
    free (data);
}
END_TEST

START_TEST (test_artifact_read_refuses_header_metadata_kiln_does_not_write)
{
    //  Mode, owner and mtime were accepted whatever they said, so an
    //  artifact could carry a setuid file for `tar xf` as root (issue 14,
    //  finding 9).
    kiln_err_t err;
    kiln_artifact_t *a;
    size_t len;
    uint8_t *data = s_sample_bytes (&len);
    struct {
        void (*edit) (struct archive_entry *);
        const char *needle;
    } cases[] = {
        { s_setuid, "mode 4755" },
        { s_group_w, "mode 0664" },
        { s_owner, "owner 1000:0" },
        { s_uname, "(root:kiln)" },
        { s_mtime, "mtime 1700000000" },
        { s_xattr, "extended attributes" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        size_t n;
        uint8_t *tar = testlib_tar_copy (data, len, cases[c].edit, &n);
        kiln_err_t e = { 0 };
        a = kiln_artifact_read_mem (tar, n, &e);
        ck_assert_msg (!a, "case %zu was read", c);
        ck_assert_msg (e.code == KILN_EFORMAT && strstr (e.msg, cases[c].needle)
                       && strstr (e.msg, "'manifest.json'"), "case %zu: %s", c, e.msg);
        free (tar);
    }
    //  Copied as it is by another tar writer (10240-byte records): fine.
    size_t n;
    uint8_t *tar = testlib_tar_copy (data, len, NULL, &n);
    ck_assert_uint_eq (n % 10240, 0);
    a = kiln_artifact_read_mem (tar, n, &err);
    ck_assert_msg (a, "%s", err.msg);
    ck_assert_int_eq (kiln_artifact_verify (a, s_keys, &err), 0);
    kiln_artifact_destroy (&a);
    free (tar);
    free (data);
}
END_TEST

START_TEST (test_keyring_skips_symlinks_and_files_of_two_pem_blocks)
{
    //  Another key, outside the keyring, signs an artifact.
    kiln_err_t err;
    char other_keys[PATH_MAX], src[2 * PATH_MAX], dst[2 * PATH_MAX];
    kiln_key_t *other = NULL;
    char *other_dir = testlib_keydir ("kiln-test-other-", other_keys, &other);
    kiln_artifact_t *a = s_sample_signed (other, NULL);
    ck_assert_int_eq (kiln_artifact_verify (a, s_keys, &err), -KILN_EVERIFY);

    //  A symbolic link in the keyring to its public key: followed before
    //  (issue 14, finding 10), skipped now.
    snprintf (src, sizeof src, "%s/kiln.pub", other_keys);
    snprintf (dst, sizeof dst, "%s/link.pub", s_keys);
    ck_assert_int_eq (symlink (src, dst), 0);
    ck_assert_int_eq (kiln_artifact_verify (a, s_keys, &err), -KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "not in keyring"), "%s", err.msg);
    ck_assert_int_eq (unlink (dst), 0);

    //  A .pub of two PEM blocks, the other key first: OpenSSL read the
    //  first and the keyring trusted it.  Refused now, and skipped.
    size_t la, lb;
    uint8_t *pa = s_slurp (src, &la);
    snprintf (src, sizeof src, "%s/kiln.pub", s_keys);
    uint8_t *pb = s_slurp (src, &lb);
    uint8_t *both = malloc (la + lb);
    memcpy (both, pa, la);
    memcpy (both + la, pb, lb);
    snprintf (dst, sizeof dst, "%s/two.pub", s_keys);
    s_spit (dst, both, la + lb);
    ck_assert_int_eq (kiln_artifact_verify (a, s_keys, &err), -KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "not in keyring"), "%s", err.msg);
    kiln_key_t *k = kiln_key_load_public (dst, &err);
    ck_assert_ptr_null (k);
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "2 PEM blocks") && strstr (err.msg, "two.pub"), "%s", err.msg);
    //  The keyring's own key still counts, once.
    kiln_keyring_t *ring = kiln_keyring_load (s_keys, &err);
    ck_assert_msg (ring, "%s", err.msg);
    ck_assert_int_eq (kiln_keyring_count (ring), 1);
    kiln_keyring_destroy (&ring);

    free (pa);
    free (pb);
    free (both);
    kiln_artifact_destroy (&a);
    kiln_key_destroy (&other);
    testlib_rmdir (&other_dir);
}
END_TEST

START_TEST (test_fifos_and_directories_are_refused_without_waiting)
{
    //  open(2) of a FIFO with no writer blocks; kiln verify, kiln-run,
    //  kiln import, kiln-cc and kiln inspect hung on one (issue 14,
    //  finding 10).  Check's timeout fails this test if anything waits.
    kiln_err_t err;
    const char *fifo = s_path ("pipe.kar");
    ck_assert_int_eq (mkfifo (fifo, 0600), 0);
    const char *paths[] = { fifo, s_dir };
    for (size_t i = 0; i < 2; i++) {
        kiln_artifact_t *a = kiln_artifact_read (paths[i], &err);
        ck_assert_ptr_null (a);
        ck_assert_msg (strstr (err.msg, "not a regular file") && strstr (err.msg, paths[i]),
                       "%s", err.msg);
        kiln_graph_t *g = kiln_graph_load (paths[i], &err);
        ck_assert_ptr_null (g);
        ck_assert_msg (strstr (err.msg, "not a regular file"), "%s", err.msg);
        uint8_t *data;
        size_t len;
        ck_assert_int_lt (kiln_read_file (paths[i], 1 << 20, &data, &len, &err), 0);
        ck_assert_msg (strstr (err.msg, "not a regular file"), "%s", err.msg);
        ck_assert_ptr_null (kiln_key_load_public (paths[i], &err));
        ck_assert_msg (strstr (err.msg, "not a regular file"), "%s", err.msg);
    }
}
END_TEST

START_TEST (test_manifest_parse_is_strict_and_bounded)
{
    struct {
        const char *from, *to;
        int code;
        const char *needle;
    } cases[] = {
        { "\"format_version\":1", "\"format_version\":2", KILN_EUNSUPPORTED,
          "unsupported artifact format version 2" },
        { "\"format\":\"kiln-artifact\"", "\"format\":\"other-thing\"", KILN_EFORMAT,
          "format is 'other-thing'" },
        { "\"dtype\":\"float32\"", "\"dtype\":\"float33\"", KILN_EFORMAT,
          "unknown dtype 'float33'" },
        { "[1,3,224,224]", "[1,1,1,1,1,1,1,1,1]", KILN_ELIMIT, "rank 9" },
        { "[1,3,224,224]", "[1,-3,224,224]", KILN_ELIMIT, "dimension 1 is -3" },
        { "[1,3,224,224]", "[1,3,224,2.5]", KILN_EFORMAT, "not an integer" },
        { "[1,3,224,224]", "[65536,65536,65536,1]", KILN_ELIMIT, "elements" },
        { "\"graph_digest\":\"", "\"graph_digest\":\"A", KILN_ELIMIT, "graph_digest" },
        { "\"target\":", "\"zarget\":", KILN_EFORMAT, "unknown field 'zarget'" },
        { "\"runtime_abi\":1", "\"runtime_abi\":0", KILN_ELIMIT, "runtime_abi" },
        { ",\"target\"", " ,\"target\"", KILN_EFORMAT, "not in canonical form" },
        { "\"name\":\"program.kbin\"", "\"name\":\"../program\"", KILN_EFORMAT,
          "reserved or not plain" },
        { "\"name\":\"program.kbin\"", "\"name\":\"zrogram.kbin\"", KILN_EFORMAT,
          "out of order" },
        { "\"runtime_abi\":1", "\"runtime_abi\":1,\"runtime_abi\":1", KILN_EFORMAT,
          "not valid JSON" },
        { "\"size\":1000", "\"size\":-1", KILN_ELIMIT, "size" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char *manifest = s_manifest_with (cases[c].from, cases[c].to);
        s_expect_manifest_refused (manifest, cases[c].code, cases[c].needle);
        free (manifest);
    }
    //  An uppercase digest of the right length.
    char *manifest = s_manifest_with (NULL, NULL);
    char *at = strstr (manifest, "\"sha256\":\"") + 10;
    for (int i = 0; i < 64; i++)
        if (at[i] >= 'a' && at[i] <= 'f')
            at[i] = (char) (at[i] - 'a' + 'A');
    s_expect_manifest_refused (manifest, KILN_EFORMAT, "sha256 is not 64 lower-case hex");
    free (manifest);
    //  Over the size bound.
    manifest = calloc (1, KILN_MAX_MANIFEST_BYTES + 2);
    memset (manifest, ' ', KILN_MAX_MANIFEST_BYTES + 1);
    s_expect_manifest_refused (manifest, KILN_ELIMIT, "more than the limit");
    free (manifest);
}
END_TEST

START_TEST (test_manifest_io_structure_is_optional_and_round_trips)
{
    kiln_err_t err = { 0 };
    const char *text = "{\"kind\":\"dict\",\"keys\":[\"caf\xc3\xa9\",\"a\\\"b\"],"
                       "\"items\":[{\"tensor\":0},{\"tensor\":1}]}\n";
    //  Without it, manifest.json has no such key.
    char *plain = s_manifest_with (NULL, NULL);
    ck_assert_ptr_null (strstr (plain, "io_structure"));

    kiln_artifact_t *a = s_sample (false);
    kiln_manifest_t *ma = kiln_artifact_manifest (a);
    ck_assert_ptr_null (ma->io_structure);
    ck_assert_msg (kiln_manifest_set_io_structure (ma, text, &err) == 0, "%s", err.msg);
    char *json;
    size_t len;
    ck_assert_msg (kiln_artifact_manifest_json (a, &json, &len, &err) == 0, "%s", err.msg);
    ck_assert_ptr_nonnull (strstr (json, "],\"io_structure\":\"{\\\"kind\\\":"));
    free (json);
    ck_assert_msg (kiln_artifact_sign (a, s_key, NULL, &err) == 0, "%s", err.msg);
    ck_assert_msg (kiln_artifact_write (a, s_path ("io.kar"), &err) == 0, "%s", err.msg);

    //  The strict reader takes it back, canonical, and signed.
    kiln_artifact_t *b = kiln_artifact_open_verified (s_path ("io.kar"), s_keys, &err);
    ck_assert_msg (b, "%s", err.msg);
    const kiln_manifest_t *mb = kiln_artifact_manifest (b);
    ck_assert_ptr_nonnull (mb->io_structure);
    ck_assert_str_eq (mb->io_structure, text);
    char da[KILN_HEX_LEN], db[KILN_HEX_LEN], dp[KILN_HEX_LEN];
    ck_assert (kiln_artifact_digest (a, da, &err) == 0);
    ck_assert (kiln_artifact_digest (b, db, &err) == 0);
    ck_assert_str_eq (da, db);

    //  A copy owns its own text.
    kiln_manifest_t copy;
    ck_assert (kiln_manifest_copy (&copy, mb, &err) == 0);
    kiln_artifact_destroy (&b);
    ck_assert_str_eq (copy.io_structure, text);
    kiln_manifest_release (&copy);
    ck_assert_ptr_null (copy.io_structure);

    //  Removing it gives back the manifest without it, byte for byte.
    kiln_artifact_t *p = s_sample (false);
    ck_assert (kiln_artifact_digest (p, dp, &err) == 0);
    ck_assert_str_ne (da, dp);
    ck_assert_int_eq (kiln_manifest_set_io_structure (ma, "", &err), 0);
    ck_assert_ptr_null (ma->io_structure);
    ck_assert (kiln_artifact_manifest_json (a, &json, &len, &err) == 0);
    ck_assert_str_eq (json, plain);
    free (json);
    kiln_artifact_destroy (&p);
    kiln_artifact_destroy (&a);
    free (plain);
}
END_TEST

START_TEST (test_manifest_io_structure_is_bounded_and_strict)
{
    kiln_err_t err = { 0 };
    size_t max = KILN_MAX_IO_STRUCTURE_BYTES;
    char *big = malloc (max + 2);
    memset (big, '7', max + 1);
    big[max + 1] = '\0';
    kiln_artifact_t *a = s_sample (false);
    kiln_manifest_t *m = kiln_artifact_manifest (a);
    ck_assert_int_eq (kiln_manifest_set_io_structure (m, "[0]", &err), 0);
    ck_assert_int_eq (kiln_manifest_set_io_structure (m, big, &err), -KILN_ELIMIT);
    ck_assert_msg (strstr (err.msg, "manifest field 'io_structure' is longer than 65536 bytes"),
                   "%s", err.msg);
    ck_assert_str_eq (m->io_structure, "[0]");
    //  At the bound it is written and read back.
    big[max] = '\0';
    ck_assert_msg (kiln_manifest_set_io_structure (m, big, &err) == 0, "%s", err.msg);
    uint8_t *kar;
    size_t len;
    ck_assert_msg (kiln_artifact_write_mem (a, &kar, &len, &err) == 0, "%s", err.msg);
    kiln_artifact_t *b = kiln_artifact_read_mem (kar, len, &err);
    ck_assert_msg (b, "%s", err.msg);
    ck_assert_uint_eq (strlen (kiln_artifact_manifest (b)->io_structure), max);
    kiln_artifact_destroy (&b);
    free (kar);
    //  An empty one set by hand cannot be written: absent is NULL.
    free (m->io_structure);
    m->io_structure = strdup ("");
    char *json;
    ck_assert_int_eq (kiln_artifact_manifest_json (a, &json, &len, &err), -KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "'io_structure' is empty"), "%s", err.msg);
    kiln_artifact_destroy (&a);

    //  What the reader refuses.
    big[max] = '7';
    char *huge = malloc (max + 64);
    snprintf (huge, max + 64, "\"io_structure\":\"%s\",\"members\":", big);
    struct {
        const char *to;
        int code;
        const char *needle;
    } cases[] = {
        { "\"io_structure\":5,\"members\":", KILN_EFORMAT, "field 'io_structure' is not a string" },
        { "\"io_structure\":\"\",\"members\":", KILN_EFORMAT, "field 'io_structure' is empty" },
        { "\"io_structure\":\"a\\u0000b\",\"members\":", KILN_EFORMAT, "not valid JSON" },
        { huge, KILN_ELIMIT, "field 'io_structure' is longer than 65536 bytes" },
        //  Keys are sorted: after "members" it is not canonical.
        { NULL, KILN_EFORMAT, "not in canonical form" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char *manifest = cases[c].to
                         ? s_manifest_with ("\"members\":", cases[c].to)
                         : s_manifest_with (",\"outputs\":", ",\"io_structure\":\"[0]\",\"outputs\":");
        s_expect_manifest_refused (manifest, cases[c].code, cases[c].needle);
        free (manifest);
    }
    free (huge);
    free (big);
}
END_TEST

START_TEST (test_artifact_add_member_rejects_bad_names)
{
    kiln_err_t err;
    kiln_artifact_t *a = kiln_artifact_new ();
    const char *bad[] = { "manifest.json", "provenance.sig", "a/b", "..", ".", "",
                          "sp ace", "x\n", "0123456789012345678901234567890123456789"
                          "01234567890123456789012345" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ck_assert_msg (kiln_artifact_add_member (a, bad[i], "x", 1, &err) == -KILN_EINVAL,
                       "'%s' accepted", bad[i]);
        //  take_member consumes the buffer even when it fails.
        uint8_t *buf = malloc (4);
        ck_assert (kiln_artifact_take_member (a, bad[i], &buf, 4, &err) == -KILN_EINVAL);
        ck_assert_ptr_null (buf);
    }
    ck_assert (kiln_artifact_add_member (a, "ok-1.bin", "x", 1, &err) == 0);
    ck_assert_int_eq (kiln_artifact_add_member (a, "ok-1.bin", "y", 1, &err), -KILN_EINVAL);
    ck_assert_msg (strstr (err.msg, "already exists"), "%s", err.msg);
    ck_assert (kiln_artifact_add_member (a, "empty", NULL, 0, &err) == 0);
    ck_assert_int_eq (kiln_artifact_member_count (a), 2);
    ck_assert_str_eq (kiln_artifact_member_name (a, 0), "empty");
    ck_assert_ptr_null (kiln_artifact_member_name (a, 2));

    //  An incomplete manifest cannot be serialised.
    char *json;
    size_t len;
    ck_assert_int_eq (kiln_artifact_manifest_json (a, &json, &len, &err), -KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "graph_digest"), "%s", err.msg);
    kiln_artifact_destroy (&a);
    ck_assert_ptr_null (a);
    kiln_artifact_destroy (&a);
}
END_TEST

/* --- page-aligned members and mapping ------------------------------ */

/* Run `cmd` and return its standard output (at most 64 KiB; caller frees)
 * after checking that it exited 0. */
static char *
s_output (const char *cmd)
{
    FILE *p = popen (cmd, "r");
    ck_assert_ptr_nonnull (p);
    size_t cap = 64 << 10, len = 0;
    char *out = malloc (cap);
    size_t n;
    while ((n = fread (out + len, 1, cap - 1 - len, p)) > 0)
        len += n;
    out[len] = '\0';
    int st = pclose (p);
    ck_assert_msg (WIFEXITED (st) && WEXITSTATUS (st) == 0, "'%s' failed", cmd);
    return out;
}

/* Every payload member of at least 4096 bytes starts its data at a
 * multiple of 4096 in the file, whatever the members before it hold, and
 * the archive stays one that stock tar lists and extracts member for
 * member.  An extra member of 512·k + 1 bytes moves what follows by k
 * blocks, so the loop meets every place the weights could land. */
START_TEST (test_artifact_large_members_start_page_aligned_and_tar_lists_them)
{
    kiln_err_t err;
    for (int k = 0; k < 9; k++) {
        kiln_artifact_t *a = s_sample (false);
        size_t xlen = 512 * (size_t) k + 1;
        uint8_t *extra = calloc (1, xlen + sizeof EXTRA_MARKER);
        memcpy (extra, EXTRA_MARKER, sizeof EXTRA_MARKER - 1);
        xlen = xlen < sizeof EXTRA_MARKER ? sizeof EXTRA_MARKER : xlen;
        ck_assert (kiln_artifact_take_member (a, "extra.bin", &extra, xlen, &err) == 0);
        ck_assert_msg (kiln_artifact_sign (a, s_key, k % 2 ? PROVENANCE : NULL, &err) == 0,
                       "%s", err.msg);
        const char *path = s_path ("aligned.kar");
        ck_assert_msg (kiln_artifact_write (a, path, &err) == 0, "%s", err.msg);
        kiln_artifact_destroy (&a);

        size_t len;
        uint8_t *data = s_slurp (path, &len);
        long w = s_find (data, len, WEIGHTS_MARKER);
        long x = s_find (data, len, EXTRA_MARKER);
        ck_assert_msg (w > 0 && w % KILN_ARTIFACT_ALIGN == 0,
                       "k %d: weights.bin's data is at %ld", k, w);
        if (xlen >= KILN_ARTIFACT_ALIGN)
            ck_assert_msg (x % KILN_ARTIFACT_ALIGN == 0,
                           "k %d: extra.bin (%zu bytes) is at %ld", k, xlen, x);
        //  The padding is not a member: kiln reads the same artifact back.
        a = kiln_artifact_read_mem (data, len, &err);
        ck_assert_msg (a, "%s", err.msg);
        size_t got;
        ck_assert (kiln_artifact_member (a, "weights.bin", &got) && got == 5000);
        ck_assert_int_eq (kiln_artifact_member_count (a), 3);
        kiln_artifact_destroy (&a);
        free (data);

        char cmd[PATH_MAX + 64];
        snprintf (cmd, sizeof cmd, "TZ=UTC tar tvf '%s' 2>&1", path);
        char *list = s_output (cmd);
        const char *names[] = { "manifest.json", "manifest.sig", "signature.json",
                                "extra.bin", "program.kbin", "weights.bin" };
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            ck_assert_msg (strstr (list, names[i]), "k %d: tar does not list %s:\n%s",
                           k, names[i], list);
        ck_assert_msg (!strstr (list, "PaxHeader") && !strstr (list, "comment"),
                       "k %d: tar shows the padding:\n%s", k, list);
        int lines = 0;
        for (const char *c = list; *c; c++)
            lines += *c == '\n';
        ck_assert_int_eq (lines, k % 2 ? 8 : 6);
        free (list);
    }
    //  Extracted by stock tar, weights.bin is exactly the member.
    const char *path = s_path ("aligned.kar");
    char x[PATH_MAX];
    snprintf (x, sizeof x, "%s/x", s_dir);
    ck_assert (mkdir (x, 0700) == 0);
    ck_assert_int_eq (s_system ("tar xf '%s' -C '%s'", path, x), 0);
    char wpath[PATH_MAX + 16];
    snprintf (wpath, sizeof wpath, "%s/weights.bin", x);
    size_t wlen, elen;
    uint8_t *want = s_weights (&wlen);
    uint8_t *got = s_slurp (wpath, &elen);
    ck_assert (elen == wlen && memcmp (want, got, wlen) == 0);
    /* the last one has no provenance: six members, no padding file */
    ck_assert_int_eq (s_system ("test \"$(ls -A '%s' | wc -l)\" = 6", x), 0);
    free (want);
    free (got);
}
END_TEST

/* kiln_artifact_read_fd for `path` with `flags`; the fd is closed before
 * returning, which the mappings do not need. */
static kiln_artifact_t *
s_read_fd (const char *path, unsigned flags, kiln_err_t *err)
{
    int fd = open (path, O_RDONLY | O_CLOEXEC);
    ck_assert (fd >= 0);
    kiln_artifact_t *a = kiln_artifact_read_fd (fd, path, flags, err);
    close (fd);
    return a;
}

START_TEST (test_artifact_read_fd_maps_aligned_members_and_hashes_the_mapped_pages)
{
    kiln_err_t err = { 0 };
    const char *path = s_path ("model.kar");
    s_write_signed (path);
    size_t wlen, got;
    uint8_t *want = s_weights (&wlen);

    kiln_artifact_t *a = s_read_fd (path, KILN_ARTIFACT_MAP, &err);
    ck_assert_msg (a, "%s", err.msg);
    ck_assert (kiln_artifact_member_mapped (a, "weights.bin"));
    ck_assert (!kiln_artifact_member_mapped (a, "program.kbin"));   /* 1000 bytes */
    ck_assert (!kiln_artifact_member_mapped (a, "absent.bin"));
    const uint8_t *w = kiln_artifact_member (a, "weights.bin", &got);
    ck_assert (got == wlen && memcmp (w, want, wlen) == 0);
    ck_assert_uint_eq ((uintptr_t) w % KILN_ARTIFACT_ALIGN, 0);
    ck_assert_msg (kiln_artifact_verify (a, s_keys, &err) == 0, "%s", err.msg);
    kiln_artifact_destroy (&a);

    //  Without the flag, the same bytes, read.
    a = s_read_fd (path, 0, &err);
    ck_assert_msg (a, "%s", err.msg);
    ck_assert (!kiln_artifact_member_mapped (a, "weights.bin"));
    w = kiln_artifact_member (a, "weights.bin", &got);
    ck_assert (got == wlen && memcmp (w, want, wlen) == 0);
    kiln_artifact_destroy (&a);

    //  A file others may write is read, not mapped.
    ck_assert (chmod (path, 0664) == 0);
    a = s_read_fd (path, KILN_ARTIFACT_MAP, &err);
    ck_assert_msg (a, "%s", err.msg);
    ck_assert (!kiln_artifact_member_mapped (a, "weights.bin"));
    kiln_artifact_destroy (&a);
    ck_assert (chmod (path, 0644) == 0);

    //  A flipped byte in the mapped member is refused, naming it.
    s_patch_file (path, "WEIGHTS-MARKER", "WEIGHTS-MARKEr");
    a = s_read_fd (path, KILN_ARTIFACT_MAP, &err);
    ck_assert_ptr_null (a);
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "member 'weights.bin': sha256 mismatch")
                   && strstr (err.msg, path), "%s", err.msg);

    //  Cut inside the member: refused, never mapped past the end.
    s_write_signed (path);
    size_t len;
    uint8_t *data = s_slurp (path, &len);
    long at = s_find (data, len, WEIGHTS_MARKER);
    s_spit (s_path ("cut.kar"), data, (size_t) at + 4000);
    a = s_read_fd (s_path ("cut.kar"), KILN_ARTIFACT_MAP, &err);
    ck_assert_ptr_null (a);
    ck_assert_msg (strstr (err.msg, "weights.bin"), "%s", err.msg);
    free (data);

    //  An archive whose members are not aligned (as kiln wrote them
    //  before) is read, with the same bytes.
    char *manifest = s_manifest_with (NULL, NULL);
    size_t plen;
    uint8_t *program = s_program (&plen);
    s_entry_t entries[] = {
        { "manifest.json", manifest, strlen (manifest), 0 },
        { "program.kbin", program, plen, 0 },
        { "weights.bin", want, wlen, 0 },
    };
    uint8_t *tar = s_tar (entries, 3, &len);
    at = s_find (tar, len, WEIGHTS_MARKER);
    ck_assert (at > 0 && at % KILN_ARTIFACT_ALIGN != 0);
    s_spit (s_path ("old.kar"), tar, len);
    a = s_read_fd (s_path ("old.kar"), KILN_ARTIFACT_MAP, &err);
    ck_assert_msg (a, "%s", err.msg);
    ck_assert (!kiln_artifact_member_mapped (a, "weights.bin"));
    w = kiln_artifact_member (a, "weights.bin", &got);
    ck_assert (got == wlen && memcmp (w, want, wlen) == 0);
    kiln_artifact_destroy (&a);
    free (tar);
    free (program);
    free (manifest);
    free (want);
}
END_TEST

/* --- stock tools ----------------------------------------------------- */

START_TEST (test_stock_tar_lists_members)
{
    const char *path = s_path ("model.kar");
    s_write_signed (path);
    char cmd[PATH_MAX + 32];
    snprintf (cmd, sizeof cmd, "tar tf '%s'", path);
    FILE *p = popen (cmd, "r");
    ck_assert_ptr_nonnull (p);
    const char *want[] = { "manifest.json", "manifest.sig", "signature.json",
                           "provenance.json", "provenance.sig", "program.kbin",
                           "weights.bin" };
    char line[256];
    size_t n = 0;
    while (fgets (line, sizeof line, p)) {
        line[strcspn (line, "\n")] = '\0';
        ck_assert_msg (n < 7, "unexpected extra member '%s'", line);
        ck_assert_str_eq (line, want[n]);
        n++;
    }
    int st = pclose (p);
    ck_assert (WIFEXITED (st) && WEXITSTATUS (st) == 0);
    ck_assert_uint_eq (n, 7);

    //  Owner, mode and time are fixed.
    ck_assert_int_eq (s_system ("TZ=UTC tar tvf '%s' | grep -v '^-rw-r--r-- kiln/kiln .* 1970-01-01 00:00 ' "
                                "| grep -q .", path), 1);
}
END_TEST

START_TEST (test_stock_openssl_verifies_manifest_signature)
{
    kiln_err_t err;
    const char *path = s_path ("model.kar");
    s_write_signed (path);
    char x[PATH_MAX];
    snprintf (x, sizeof x, "%s/x", s_dir);
    ck_assert (mkdir (x, 0700) == 0);
    ck_assert_int_eq (s_system ("tar xf '%s' -C '%s'", path, x), 0);

#define VERIFY "openssl pkeyutl -verify -pubin -inkey '%s/kiln.pub' -rawin " \
               "-in '%s/manifest.json' -sigfile '%s/manifest.sig' >/dev/null 2>&1"
    ck_assert_int_eq (s_system (VERIFY, s_keys, x, x), 0);

    //  sha256sum manifest.json is the content hash.
    char want[KILN_HEX_LEN], got[KILN_HEX_LEN], mpath[PATH_MAX + 16];
    kiln_artifact_t *a = kiln_artifact_read (path, &err);
    ck_assert_msg (a, "%s", err.msg);
    ck_assert (kiln_artifact_digest (a, want, &err) == 0);
    kiln_artifact_destroy (&a);
    snprintf (mpath, sizeof mpath, "%s/manifest.json", x);
    ck_assert (kiln_sha256_file_hex (mpath, got, &err) == 0);
    ck_assert_str_eq (want, got);

    //  provenance.sig checks the same way.
    ck_assert_int_eq (s_system ("openssl pkeyutl -verify -pubin -inkey '%s/kiln.pub' -rawin "
                                "-in '%s/provenance.json' -sigfile '%s/provenance.sig' "
                                ">/dev/null 2>&1", s_keys, x, x), 0);

    //  A tampered manifest fails.
    s_patch_file (mpath, "cpu-x86_64", "cpu-x86_65");
    ck_assert_int_ne (s_system (VERIFY, s_keys, x, x), 0);
#undef VERIFY
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("artifact");
    TCase *tc = tcase_create ("artifact");
    tcase_set_timeout (tc, 60);
    tcase_add_checked_fixture (tc, setup, teardown);
    tcase_add_test (tc, test_artifact_round_trips_manifest_and_members);
    tcase_add_test (tc, test_artifact_bytes_are_deterministic);
    tcase_add_test (tc, test_artifact_digest_is_independent_of_provenance_and_signer);
    tcase_add_test (tc, test_artifact_verifies_with_signer_key_in_keyring);
    tcase_add_test (tc, test_artifact_refuses_flipped_byte_in_program_member);
    tcase_add_test (tc, test_artifact_refuses_tampered_manifest);
    tcase_add_test (tc, test_artifact_refuses_tampered_provenance);
    tcase_add_test (tc, test_artifact_refuses_signer_not_in_keyring);
    tcase_add_test (tc, test_artifact_refuses_unsigned);
    tcase_add_test (tc, test_artifact_checks_algorithm_before_keyring_and_crypto);
    tcase_add_test (tc, test_artifact_write_refuses_changes_after_signing);
    tcase_add_test (tc, test_keygen_writes_private_key_0600_and_refuses_to_overwrite);
    tcase_add_test (tc, test_keyring_skips_private_keys_and_other_files);
    tcase_add_test (tc, test_artifact_read_rejects_truncated_archives);
    tcase_add_test (tc, test_artifact_read_rejects_unsafe_or_unlisted_members);
    tcase_add_test (tc, test_artifact_read_refuses_bytes_after_the_end_marker);
    tcase_add_test (tc, test_artifact_read_refuses_nonzero_padding);
    tcase_add_test (tc, test_artifact_read_refuses_header_metadata_kiln_does_not_write);
    tcase_add_test (tc, test_keyring_skips_symlinks_and_files_of_two_pem_blocks);
    tcase_add_test (tc, test_fifos_and_directories_are_refused_without_waiting);
    tcase_add_test (tc, test_manifest_parse_is_strict_and_bounded);
    tcase_add_test (tc, test_manifest_io_structure_is_optional_and_round_trips);
    tcase_add_test (tc, test_manifest_io_structure_is_bounded_and_strict);
    tcase_add_test (tc, test_artifact_add_member_rejects_bad_names);
    tcase_add_test (tc, test_artifact_large_members_start_page_aligned_and_tar_lists_them);
    tcase_add_test (tc, test_artifact_read_fd_maps_aligned_members_and_hashes_the_mapped_pages);
    tcase_add_test (tc, test_stock_tar_lists_members);
    tcase_add_test (tc, test_stock_openssl_verifies_manifest_signature);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run_in_tmpdir (s_suite (), "artifact");
}
