/* Unit tests of the broker's store: staged writes appear only at commit,
 * cache hits are checked, failures are remembered and forgotten, blob
 * uploads are checked against their digest, the size cap evicts the least
 * recently used unpinned entries, uploads in progress count against it
 * from their start, artifacts open by content hash, pinned
 * artifacts are never evicted and uploads that do not fit beside them are
 * refused, and the integrity check finds damage. */
#include <check.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "artifact/kiln_artifact.h"
#include "broker/kiln_store.h"
#include "common/kiln_fs.h"
#include "common/kiln_hash.h"
#include "tests/unit/testlib.h"

static char *s_dir;
static kiln_key_t *s_key;

static void
s_setup (void)
{
    kiln_err_t err = { 0 };
    s_dir = kiln_mkdtemp ("kiln-test-store-", &err);
    ck_assert_msg (s_dir != NULL, "%s", err.msg);
    s_key = kiln_key_generate (&err);
    ck_assert_ptr_nonnull (s_key);
}

static void
s_teardown (void)
{
    kiln_key_destroy (&s_key);
    kiln_rm_rf (s_dir);
    free (s_dir);
    s_dir = NULL;
}

/* A signed artifact for `action_key`; its content hash into digest. */
static uint8_t *
s_artifact (const char *action_key, const char *payload, char digest[KILN_HEX_LEN], size_t *len)
{
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_artifact_new ();
    kiln_manifest_t *m = kiln_artifact_manifest (art);
    m->format_version = KILN_ARTIFACT_FORMAT_VERSION;
    memset (m->graph_digest, 'b', 64);
    m->graph_digest[64] = '\0';
    snprintf (m->action_key, sizeof m->action_key, "%s", action_key);
    snprintf (m->compiler_id, sizeof m->compiler_id, "test");
    snprintf (m->compiler_version, sizeof m->compiler_version, "1");
    snprintf (m->target, sizeof m->target, "t");
    m->runtime_abi = KILN_RUNTIME_ABI_VERSION;
    ck_assert_int_eq (kiln_artifact_add_member (art, "payload.bin", payload, strlen (payload),
                                                &err), 0);
    ck_assert_msg (kiln_artifact_sign (art, s_key, "{\"builder\":\"t\"}", &err) == 0, "%s",
                   err.msg);
    ck_assert_int_eq (kiln_artifact_digest (art, digest, &err), 0);
    uint8_t *bytes = NULL;
    ck_assert_int_eq (kiln_artifact_write_mem (art, &bytes, len, &err), 0);
    kiln_artifact_destroy (&art);
    return bytes;
}

static const char *KEY1 = "1111111111111111111111111111111111111111111111111111111111111111";
static const char *KEY2 = "2222222222222222222222222222222222222222222222222222222222222222";

START_TEST (test_staged_entries_appear_at_commit_and_hits_are_checked)
{
    kiln_err_t err = { 0 };
    kiln_store_t *st = kiln_store_new (s_dir, 0, &err);
    ck_assert_ptr_nonnull (st);
    ck_assert_int_eq (kiln_store_trust_key (st, s_key, &err), 0);
    char digest[KILN_HEX_LEN], got[KILN_HEX_LEN];
    size_t len = 0, got_len = 0;
    uint8_t *bytes = s_artifact (KEY1, "hello", digest, &len), *data = NULL;
    ck_assert_int_eq (kiln_store_put_artifact (st, digest, bytes, len, &err), 0);
    ck_assert_int_eq (kiln_store_put_action (st, KEY1, digest, &err), 0);
    ck_assert_uint_eq (kiln_store_staged (st), 2);
    /* not before the commit */
    ck_assert_int_eq (kiln_store_lookup (st, KEY1, got, &data, &got_len, &err), -KILN_ENOTFOUND);
    ck_assert_int_eq (kiln_store_commit (st, &err), 2);
    ck_assert_uint_eq (kiln_store_staged (st), 0);
    ck_assert_int_eq (kiln_store_lookup (st, KEY1, got, &data, &got_len, &err), 0);
    ck_assert_str_eq (got, digest);
    ck_assert_uint_eq (got_len, len);
    ck_assert_mem_eq (data, bytes, len);
    free (data);
    /* nothing was left in STATE/tmp */
    char tmp[PATH_MAX];
    snprintf (tmp, sizeof tmp, "%s/tmp", s_dir);
    ck_assert_int_eq (rmdir (tmp), 0);
    ck_assert_int_eq (mkdir (tmp, 0755), 0);
    /* a damaged artifact is not served */
    char path[PATH_MAX];
    snprintf (path, sizeof path, "%s/cas/sha256/%.2s/%s", s_dir, digest, digest);
    uint8_t *hello = memmem (bytes, len, "hello", 5);
    ck_assert_ptr_nonnull (hello);
    hello[0] ^= 1;
    ck_assert_int_eq (kiln_write_file_atomic (path, bytes, len, 0644, &err), 0);
    ck_assert_int_lt (kiln_store_lookup (st, KEY1, got, &data, &got_len, &err), 0);
    ck_assert_int_ne (err.code, KILN_ENOTFOUND);
    ck_assert_ptr_null (data);
    /* an evicted (deleted) artifact is a plain miss, and its record goes */
    unlink (path);
    ck_assert_int_eq (kiln_store_lookup (st, KEY1, got, &data, &got_len, &err), -KILN_ENOTFOUND);
    snprintf (path, sizeof path, "%s/ac/%s", s_dir, KEY1);
    ck_assert (!kiln_file_exists (path));
    free (bytes);
    kiln_store_destroy (&st);
    ck_assert_ptr_null (st);
}
END_TEST

START_TEST (test_failures_are_remembered_with_their_log_and_forgotten)
{
    kiln_err_t err = { 0 };
    kiln_store_t *st = kiln_store_new (s_dir, 0, &err);
    int code = 0;
    char message[KILN_ERR_MSG_MAX];
    char *log = NULL;
    ck_assert_int_eq (kiln_store_lookup_failure (st, KEY2, &code, message, &log, &err),
                      -KILN_ENOTFOUND);
    ck_assert_int_eq (kiln_store_put_failure (st, KEY2, KILN_ECOMPILE, "it broke",
                                              "line 1\n\"quoted\"\n", &err), 0);
    ck_assert_int_eq (kiln_store_commit (st, &err), 1);
    kiln_store_destroy (&st);
    /* across a restart */
    st = kiln_store_new (s_dir, 0, &err);
    ck_assert_int_eq (kiln_store_lookup_failure (st, KEY2, &code, message, &log, &err), 0);
    ck_assert_int_eq (code, KILN_ECOMPILE);
    ck_assert_str_eq (message, "it broke");
    ck_assert_str_eq (log, "line 1\n\"quoted\"\n");
    free (log);
    kiln_store_forget_failure (st, KEY2);
    ck_assert_int_eq (kiln_store_lookup_failure (st, KEY2, &code, message, &log, &err),
                      -KILN_ENOTFOUND);
    kiln_store_stats_t stats;
    kiln_store_stats (st, &stats);
    ck_assert_uint_eq (stats.failures, 0);
    kiln_store_destroy (&st);
}
END_TEST

START_TEST (test_uploaded_blobs_are_checked_against_their_digest)
{
    kiln_err_t err = { 0 };
    kiln_store_t *st = kiln_store_new (s_dir, 0, &err);
    size_t size = 3 * 1000 * 1000 + 7;
    uint8_t *data = malloc (size);
    for (size_t i = 0; i < size; i++)
        data[i] = (uint8_t) (i * 31 + 7);
    uint8_t digest[KILN_DIGEST_LEN], wrong[KILN_DIGEST_LEN];
    kiln_sha256 (data, size, digest);
    memcpy (wrong, digest, sizeof wrong);
    wrong[0] ^= 1;
    /* wrong digest: refused, nothing stored */
    kiln_blob_writer_t *w = kiln_store_blob_begin (st, wrong, size, 0, NULL, &err);
    ck_assert_ptr_nonnull (w);
    ck_assert_int_eq (kiln_blob_writer_write (w, data, size, &err), 0);
    ck_assert_int_eq (kiln_store_blob_finish (st, &w, &err), -KILN_EVERIFY);
    ck_assert_ptr_null (w);
    ck_assert (!kiln_store_has_blob (st, wrong));
    /* more bytes than announced: refused */
    w = kiln_store_blob_begin (st, digest, 10, 0, NULL, &err);
    ck_assert_int_eq (kiln_blob_writer_write (w, data, 11, &err), -KILN_EPROTO);
    kiln_blob_writer_abort (&w);
    /* the right bytes in pieces */
    w = kiln_store_blob_begin (st, digest, size, 0, NULL, &err);
    for (size_t off = 0; off < size; off += 1 << 20) {
        size_t n = size - off < (1u << 20) ? size - off : (1u << 20);
        ck_assert_int_eq (kiln_blob_writer_write (w, data + off, n, &err), 0);
    }
    ck_assert_uint_eq (kiln_blob_writer_received (w), size);
    ck_assert_int_eq (kiln_store_blob_finish (st, &w, &err), 0);
    ck_assert (kiln_store_has_blob (st, digest));
    uint64_t got = 0;
    int fd = kiln_store_blob_open (st, digest, &got, &err);
    ck_assert_int_ge (fd, 0);
    ck_assert_uint_eq (got, size);
    close (fd);
    /* a small blob put whole must match too */
    ck_assert_int_eq (kiln_store_put_blob (st, wrong, data, 100, &err), -KILN_EVERIFY);
    /* a blob bigger than the cap is refused up front */
    kiln_store_destroy (&st);
    st = kiln_store_new (s_dir, 1 << 20, &err);
    ck_assert_ptr_null (kiln_store_blob_begin (st, wrong, 2 << 20, 0, NULL, &err));
    ck_assert_int_eq (err.code, KILN_ELIMIT);
    free (data);
    kiln_store_destroy (&st);
}
END_TEST

/* What the loop's callback saw. */
typedef struct {
    kiln_store_t *st;
    kiln_blob_writer_t **writers;    /* by tag index */
    int finished[2], rc[2];
    uint64_t released[2];
} s_news_t;

static void
s_on_news (kiln_blob_writer_t *w, void *tag, void *arg)
{
    s_news_t *n = arg;
    int i = (int) (intptr_t) tag;
    ck_assert_ptr_eq (n->writers[i], w);
    n->released[i] = kiln_blob_writer_released (w);
    if (kiln_blob_writer_done (w)) {
        kiln_err_t err = { 0 };
        n->rc[i] = kiln_store_blob_finish (n->st, &n->writers[i], &err);
        n->finished[i]++;
    }
}

/* The broker's way: chunks handed over without waiting, news through the
 * upload eventfd, two uploads side by side, one of them wrong. */
START_TEST (test_uploads_finish_on_their_own_threads_and_report_through_the_fd)
{
    kiln_err_t err = { 0 };
    kiln_store_t *st = kiln_store_new (s_dir, 0, &err);
    size_t size = 5 * (1u << 20) + 123;
    uint8_t *data = malloc (size);
    for (size_t i = 0; i < size; i++)
        data[i] = (uint8_t) (i * 131 + 3);
    uint8_t digest[KILN_DIGEST_LEN], wrong[KILN_DIGEST_LEN];
    kiln_sha256 (data, size, digest);
    memcpy (wrong, digest, sizeof wrong);
    wrong[31] ^= 0x80;
    kiln_blob_writer_t *writers[2];
    s_news_t n = { .st = st, .writers = writers };
    writers[0] = kiln_store_blob_begin (st, digest, size, 8, (void *) (intptr_t) 0, &err);
    writers[1] = kiln_store_blob_begin (st, wrong, size, 8, (void *) (intptr_t) 1, &err);
    ck_assert_ptr_nonnull (writers[0]);
    ck_assert_ptr_nonnull (writers[1]);
    for (size_t off = 0; off < size; off += 1u << 20) {
        size_t len = size - off < (1u << 20) ? size - off : (1u << 20);
        for (int i = 0; i < 2; i++) {
            zframe_t *f = zframe_new (data + off, len);
            ck_assert_int_eq (kiln_blob_writer_take (writers[i], &f, &err), 0);
            ck_assert_ptr_null (f);
        }
    }
    kiln_blob_writer_close (writers[0]);
    kiln_blob_writer_close (writers[1]);
    /* a chunk after the end is refused */
    zframe_t *late = zframe_new (data, 1);
    ck_assert_int_eq (kiln_blob_writer_take (writers[0], &late, &err), -KILN_EPROTO);
    struct pollfd pfd = { .fd = kiln_store_upload_fd (st), .events = POLLIN };
    for (int round = 0; round < 500 && (!n.finished[0] || !n.finished[1]); round++)
        if (poll (&pfd, 1, 20) > 0)
            kiln_store_upload_poll (st, s_on_news, &n);
    ck_assert_int_eq (n.finished[0], 1);
    ck_assert_int_eq (n.finished[1], 1);
    ck_assert_uint_eq (n.released[0], 6);
    ck_assert_int_eq (n.rc[0], 0);
    ck_assert_int_eq (n.rc[1], -KILN_EVERIFY);
    ck_assert (kiln_store_has_blob (st, digest));
    ck_assert (!kiln_store_has_blob (st, wrong));
    /* aborted with chunks still held: nothing stored, no news left */
    kiln_blob_writer_t *w = kiln_store_blob_begin (st, wrong, size, 8, NULL, &err);
    for (int i = 0; i < 3; i++) {
        zframe_t *f = zframe_new (data, 1u << 20);
        ck_assert_int_eq (kiln_blob_writer_take (w, &f, &err), 0);
    }
    kiln_blob_writer_abort (&w);
    ck_assert_ptr_null (w);
    n.finished[0] = n.finished[1] = 0;
    kiln_store_upload_poll (st, s_on_news, &n);
    ck_assert_int_eq (n.finished[0] + n.finished[1], 0);
    free (data);
    kiln_store_destroy (&st);
}
END_TEST

/* Stage and commit a blob of `size` bytes filled with `fill`. */
static void
s_blob (kiln_store_t *st, uint8_t fill, size_t size, uint8_t digest[KILN_DIGEST_LEN])
{
    kiln_err_t err = { 0 };
    uint8_t *data = malloc (size);
    memset (data, fill, size);
    kiln_sha256 (data, size, digest);
    ck_assert_int_eq (kiln_store_put_blob (st, digest, data, size, &err), 0);
    ck_assert_int_ge (kiln_store_commit (st, &err), 0);
    free (data);
}

START_TEST (test_the_cap_evicts_least_recently_used_unpinned_entries)
{
    kiln_err_t err = { 0 };
    kiln_store_t *st = kiln_store_new (s_dir, 1 << 20, &err);
    uint8_t a[KILN_DIGEST_LEN], b[KILN_DIGEST_LEN], c[KILN_DIGEST_LEN], d[KILN_DIGEST_LEN];
    s_blob (st, 'a', 400 << 10, a);
    s_blob (st, 'b', 400 << 10, b);
    kiln_store_blob_pin (st, a);                /* a job needs a */
    s_blob (st, 'c', 400 << 10, c);             /* over the cap: b goes, not a */
    ck_assert (kiln_store_has_blob (st, a));
    ck_assert (!kiln_store_has_blob (st, b));
    ck_assert (kiln_store_has_blob (st, c));
    kiln_store_blob_unpin (st, a);
    uint64_t size;
    int fd = kiln_store_blob_open (st, a, &size, &err);     /* a used: c is older now */
    close (fd);
    s_blob (st, 'd', 400 << 10, d);
    ck_assert (kiln_store_has_blob (st, a));
    ck_assert (!kiln_store_has_blob (st, c));
    kiln_store_stats_t stats;
    kiln_store_stats (st, &stats);
    ck_assert_uint_le (stats.bytes, 1 << 20);
    ck_assert_uint_eq (stats.evicted, 2);
    kiln_store_destroy (&st);
    /* the index is rebuilt from disk */
    st = kiln_store_new (s_dir, 1 << 20, &err);
    ck_assert (kiln_store_has_blob (st, a) && kiln_store_has_blob (st, d));
    kiln_store_stats (st, &stats);
    ck_assert_uint_eq (stats.blobs, 2);
    kiln_store_destroy (&st);
}
END_TEST

/* An upload reserves its announced size under the cap from its start,
 * evicting what may be evicted; one that would fit but for other uploads
 * is told EBUSY, one that cannot fit beside what may not be evicted
 * ELIMIT, each naming the cap (issue 14, finding 3). */
START_TEST (test_uploads_in_progress_count_against_the_cap)
{
    kiln_err_t err = { 0 };
    kiln_store_t *st = kiln_store_new (s_dir, 1 << 20, &err);
    uint8_t a[KILN_DIGEST_LEN], b[KILN_DIGEST_LEN];
    s_blob (st, 'a', 400 << 10, a);
    s_blob (st, 'b', 300 << 10, b);
    kiln_store_blob_pin (st, b);                /* a queued job needs b */
    size_t size = 300 << 10;
    uint8_t *data = malloc (size);
    memset (data, 'x', size);
    uint8_t x[KILN_DIGEST_LEN], y[KILN_DIGEST_LEN], z[KILN_DIGEST_LEN];
    kiln_sha256 (data, size, x);
    memset (y, 'y', sizeof y);
    memset (z, 'z', sizeof z);
    /* 500 KiB announced: a is evicted for it, b (pinned) stays */
    kiln_blob_writer_t *w1 = kiln_store_blob_begin (st, y, 500 << 10, 0, NULL, &err);
    ck_assert_msg (w1 != NULL, "%s", err.msg);
    ck_assert (!kiln_store_has_blob (st, a) && kiln_store_has_blob (st, b));
    kiln_store_stats_t stats;
    kiln_store_stats (st, &stats);
    ck_assert_uint_eq (stats.reserved_bytes, 500 << 10);
    ck_assert_uint_eq (stats.uploads, 1);
    ck_assert_uint_eq (stats.job_pinned_bytes, 300 << 10);
    ck_assert_uint_le (stats.bytes + stats.reserved_bytes, stats.max_bytes);
    /* 300 more: would fit but for the upload in progress */
    ck_assert_ptr_null (kiln_store_blob_begin (st, x, size, 0, NULL, &err));
    ck_assert_int_eq (err.code, KILN_EBUSY);
    ck_assert_msg (strstr (err.msg, "--store-max-bytes 1048576") != NULL, "%s", err.msg);
    /* 800 KiB beside the pinned 300: never */
    ck_assert_ptr_null (kiln_store_blob_begin (st, z, 800 << 10, 0, NULL, &err));
    ck_assert_int_eq (err.code, KILN_ELIMIT);
    ck_assert_msg (strstr (err.msg, "--store-max-bytes 1048576") != NULL, "%s", err.msg);
    /* the first given up: its room is free again */
    kiln_blob_writer_abort (&w1);
    kiln_store_stats (st, &stats);
    ck_assert_uint_eq (stats.reserved_bytes, 0);
    ck_assert_uint_eq (stats.uploads, 0);
    kiln_blob_writer_t *w2 = kiln_store_blob_begin (st, x, size, 0, NULL, &err);
    ck_assert_msg (w2 != NULL, "%s", err.msg);
    ck_assert_int_eq (kiln_blob_writer_write (w2, data, size, &err), 0);
    ck_assert_int_eq (kiln_store_blob_finish (st, &w2, &err), 0);
    kiln_store_stats (st, &stats);
    ck_assert_uint_eq (stats.reserved_bytes, 0);
    ck_assert_uint_eq (stats.bytes, 600 << 10);
    kiln_store_blob_unpin (st, b);
    kiln_store_stats (st, &stats);
    ck_assert_uint_eq (stats.job_pinned_bytes, 0);
    free (data);
    kiln_store_destroy (&st);
}
END_TEST

/* A payload of `size` bytes of text that `fill` makes distinct; caller frees. */
static char *
s_payload (size_t size, char fill)
{
    char *text = malloc (size + 1);
    for (size_t i = 0; i < size; i++)
        text[i] = (char) (fill + (char) (i % 7));
    text[size] = '\0';
    return text;
}

/* Stage and commit a signed artifact with a payload of `size` bytes. */
static size_t
s_stored_artifact (kiln_store_t *st, const char *action_key, size_t size, char fill,
                   char digest[KILN_HEX_LEN])
{
    kiln_err_t err = { 0 };
    char *payload = s_payload (size, fill);
    size_t len = 0;
    uint8_t *bytes = s_artifact (action_key, payload, digest, &len);
    ck_assert_int_eq (kiln_store_put_artifact (st, digest, bytes, len, &err), 0);
    ck_assert_int_eq (kiln_store_commit (st, &err), 1);
    free (bytes);
    free (payload);
    return len;
}

START_TEST (test_stored_artifacts_open_by_content_hash_and_absent_ones_are_not_found)
{
    kiln_err_t err = { 0 };
    kiln_store_t *st = kiln_store_new (s_dir, 0, &err);
    char digest[KILN_HEX_LEN];
    size_t len = 0;
    uint8_t *bytes = s_artifact (KEY1, "served by hash", digest, &len);
    ck_assert_int_eq (kiln_store_put_artifact (st, digest, bytes, len, &err), 0);
    uint64_t size = 0;
    /* staged is not stored */
    ck_assert_int_eq (kiln_store_artifact_open (st, digest, &size, &err), -KILN_ENOTFOUND);
    ck_assert_int_eq (kiln_store_commit (st, &err), 1);
    int fd = kiln_store_artifact_open (st, digest, &size, &err);
    ck_assert_msg (fd >= 0, "%s", err.msg);
    ck_assert_uint_eq (size, len);
    uint8_t *back = malloc (len);
    ck_assert_int_eq (pread (fd, back, len, 0), (ssize_t) len);
    ck_assert_mem_eq (back, bytes, len);
    close (fd);
    free (back);
    /* absent: not found, naming it; not a digest: refused */
    const char *absent = "abababababababababababababababababababababababababababababababab";
    ck_assert_int_eq (kiln_store_artifact_open (st, absent, &size, &err), -KILN_ENOTFOUND);
    ck_assert_ptr_nonnull (strstr (err.msg, absent));
    ck_assert_int_eq (kiln_store_artifact_open (st, "../../etc/passwd", &size, &err),
                      -KILN_EINVAL);
    /* gone from under the store: a miss, and no longer counted */
    char path[PATH_MAX];
    snprintf (path, sizeof path, "%s/cas/sha256/%.2s/%s", s_dir, digest, digest);
    ck_assert_int_eq (unlink (path), 0);
    ck_assert_int_eq (kiln_store_artifact_open (st, digest, &size, &err), -KILN_ENOTFOUND);
    kiln_store_stats_t stats;
    kiln_store_stats (st, &stats);
    ck_assert_uint_eq (stats.artifacts, 0);
    ck_assert_uint_eq (stats.bytes, 0);
    free (bytes);
    kiln_store_destroy (&st);
}
END_TEST

START_TEST (test_pinned_artifacts_are_never_evicted_and_pins_survive_a_restart)
{
    kiln_err_t err = { 0 };
    kiln_store_t *st = kiln_store_new (s_dir, 1 << 20, &err);
    char a[KILN_HEX_LEN], b[KILN_HEX_LEN];
    size_t len_a = s_stored_artifact (st, KEY1, 300 << 10, 'a', a);
    s_stored_artifact (st, KEY2, 300 << 10, 'b', b);
    bool changed = false;
    ck_assert_int_eq (kiln_store_pin (st, a, &changed, &err), 0);
    ck_assert (changed);
    ck_assert_int_eq (kiln_store_pin (st, a, &changed, &err), 0);    /* twice: no change */
    ck_assert (!changed);
    ck_assert (kiln_store_is_pinned (st, a));
    ck_assert (!kiln_store_is_pinned (st, b));
    kiln_store_stats_t stats;
    kiln_store_stats (st, &stats);
    ck_assert_uint_eq (stats.pinned, 1);
    ck_assert_uint_eq (stats.pinned_bytes, len_a);
    /* what is not stored cannot be pinned */
    const char *absent = "cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd";
    ck_assert_int_eq (kiln_store_pin (st, absent, &changed, &err), -KILN_ENOTFOUND);
    ck_assert (!kiln_store_is_pinned (st, absent));
    /* pressure: a is the least recently used, yet b goes, then the blobs */
    uint8_t c[KILN_DIGEST_LEN], d[KILN_DIGEST_LEN];
    s_blob (st, 'c', 300 << 10, c);
    s_blob (st, 'd', 300 << 10, d);
    uint64_t size = 0;
    int fd = kiln_store_artifact_open (st, a, &size, &err);
    ck_assert_msg (fd >= 0, "%s", err.msg);
    close (fd);
    ck_assert_int_eq (kiln_store_artifact_open (st, b, &size, &err), -KILN_ENOTFOUND);
    kiln_store_stats (st, &stats);
    ck_assert_uint_le (stats.bytes, 1 << 20);
    ck_assert_uint_ge (stats.evicted, 1);
    kiln_store_destroy (&st);
    /* the pin is on disk, and holds after a restart */
    char path[PATH_MAX];
    snprintf (path, sizeof path, "%s/pins/%s", s_dir, a);
    ck_assert (kiln_file_exists (path));
    st = kiln_store_new (s_dir, 1 << 20, &err);
    ck_assert (kiln_store_is_pinned (st, a));
    kiln_store_stats (st, &stats);
    ck_assert_uint_eq (stats.pinned, 1);
    ck_assert_uint_eq (stats.pinned_bytes, len_a);
    /* unpinned, it is an ordinary entry: eviction may take it */
    ck_assert_int_eq (kiln_store_unpin (st, a, &changed, &err), 0);
    ck_assert (changed);
    ck_assert_int_eq (kiln_store_unpin (st, a, &changed, &err), 0);
    ck_assert (!changed);
    ck_assert (!kiln_file_exists (path));
    kiln_store_stats (st, &stats);
    ck_assert_uint_eq (stats.pinned, 0);
    ck_assert_uint_eq (stats.pinned_bytes, 0);
    uint8_t e[KILN_DIGEST_LEN], f[KILN_DIGEST_LEN];
    s_blob (st, 'e', 400 << 10, e);
    s_blob (st, 'f', 400 << 10, f);
    ck_assert_int_eq (kiln_store_artifact_open (st, a, &size, &err), -KILN_ENOTFOUND);
    kiln_store_destroy (&st);
}
END_TEST

START_TEST (test_uploads_that_do_not_fit_beside_the_pins_are_refused)
{
    kiln_err_t err = { 0 };
    kiln_store_t *st = kiln_store_new (s_dir, 1 << 20, &err);
    char a[KILN_HEX_LEN];
    size_t len_a = s_stored_artifact (st, KEY1, 600 << 10, 'a', a);
    ck_assert_int_eq (kiln_store_pin (st, a, NULL, &err), 0);
    size_t size = 500 << 10;
    uint8_t *data = calloc (1, size);
    uint8_t digest[KILN_DIGEST_LEN];
    kiln_sha256 (data, size, digest);
    /* 600 KiB pinned + 500 KiB > 1 MiB: refused, whichever way it comes */
    ck_assert_ptr_null (kiln_store_blob_begin (st, digest, size, 0, NULL, &err));
    ck_assert_int_eq (err.code, KILN_ELIMIT);
    ck_assert_ptr_nonnull (strstr (err.msg, "pinned"));
    ck_assert_ptr_nonnull (strstr (err.msg, "kiln unpin"));
    ck_assert_int_eq (kiln_store_put_blob (st, digest, data, size, &err), -KILN_ELIMIT);
    ck_assert_uint_eq (kiln_store_staged (st), 0);
    /* what fits beside the pin is taken */
    uint8_t small[KILN_DIGEST_LEN];
    s_blob (st, 's', 300 << 10, small);
    ck_assert (kiln_store_has_blob (st, small));
    /* a cap lowered below the pins: the pinned artifact stays, over the cap */
    kiln_store_destroy (&st);
    st = kiln_store_new (s_dir, 1 << 19, &err);
    uint64_t got = 0;
    int fd = kiln_store_artifact_open (st, a, &got, &err);
    ck_assert_msg (fd >= 0, "%s", err.msg);
    close (fd);
    kiln_store_stats_t stats;
    kiln_store_stats (st, &stats);
    ck_assert_uint_eq (stats.pinned_bytes, len_a);
    ck_assert_uint_eq (stats.bytes, len_a);        /* everything else evicted */
    ck_assert_uint_gt (stats.bytes, stats.max_bytes);
    ck_assert (!kiln_store_has_blob (st, small));
    kiln_store_destroy (&st);
    /* unpinned, there is room again */
    st = kiln_store_new (s_dir, 1 << 20, &err);
    ck_assert_int_eq (kiln_store_unpin (st, a, NULL, &err), 0);
    kiln_blob_writer_t *w = kiln_store_blob_begin (st, digest, size, 0, NULL, &err);
    ck_assert_msg (w != NULL, "%s", err.msg);
    ck_assert_int_eq (kiln_blob_writer_write (w, data, size, &err), 0);
    ck_assert_int_eq (kiln_store_blob_finish (st, &w, &err), 0);
    ck_assert (kiln_store_has_blob (st, digest));
    free (data);
    kiln_store_destroy (&st);
}
END_TEST

START_TEST (test_the_integrity_check_finds_and_repairs_damage)
{
    kiln_err_t err = { 0 };
    kiln_store_t *st = kiln_store_new (s_dir, 0, &err);
    ck_assert_int_eq (kiln_store_trust_key (st, s_key, &err), 0);
    char digest[KILN_HEX_LEN];
    size_t len = 0;
    uint8_t *bytes = s_artifact (KEY1, "payload", digest, &len);
    kiln_store_put_artifact (st, digest, bytes, len, &err);
    kiln_store_put_action (st, KEY1, digest, &err);
    uint8_t blob[KILN_DIGEST_LEN];
    s_blob (st, 'x', 5000, blob);
    ck_assert_int_ge (kiln_store_commit (st, &err), 0);
    kiln_store_destroy (&st);
    kiln_store_report_t rep;
    ck_assert_msg (kiln_store_check (s_dir, false, NULL, &rep, &err) == 0, "%s", err.msg);
    ck_assert_uint_eq (rep.artifacts, 1);
    ck_assert_uint_eq (rep.blobs, 1);
    ck_assert_uint_eq (rep.actions, 1);
    ck_assert_uint_eq (rep.bad, 0);
    /* flip a byte of the blob */
    char hex[KILN_HEX_LEN], path[PATH_MAX];
    kiln_hex (blob, KILN_DIGEST_LEN, hex);
    snprintf (path, sizeof path, "%s/blobs/sha256/%.2s/%s", s_dir, hex, hex);
    uint8_t *data;
    size_t n;
    ck_assert_int_eq (kiln_read_file (path, 1 << 20, &data, &n, &err), 0);
    data[17] ^= 0x40;
    ck_assert_int_eq (kiln_write_file_atomic (path, data, n, 0644, &err), 0);
    free (data);
    /* and an action record that points elsewhere */
    snprintf (path, sizeof path, "%s/ac/%s", s_dir, KEY2);
    char line[KILN_HEX_LEN + 1];
    snprintf (line, sizeof line, "%s\n", digest);
    ck_assert_int_eq (kiln_write_file_atomic (path, line, KILN_HEX_LEN, 0644, &err), 0);
    ck_assert_int_eq (kiln_store_check (s_dir, false, NULL, &rep, &err), -KILN_EVERIFY);
    ck_assert_uint_eq (rep.bad, 2);
    ck_assert_int_eq (kiln_store_check (s_dir, true, NULL, &rep, &err), -KILN_EVERIFY);
    ck_assert_uint_eq (rep.removed, 2);
    ck_assert_int_eq (kiln_store_check (s_dir, false, NULL, &rep, &err), 0);
    ck_assert_uint_eq (rep.blobs, 0);
    free (bytes);
}
END_TEST

int
main (void)
{
    Suite *s = suite_create ("store");
    TCase *tc = tcase_create ("store");
    tcase_set_timeout (tc, 60);
    tcase_add_checked_fixture (tc, s_setup, s_teardown);
    tcase_add_test (tc, test_staged_entries_appear_at_commit_and_hits_are_checked);
    tcase_add_test (tc, test_failures_are_remembered_with_their_log_and_forgotten);
    tcase_add_test (tc, test_uploaded_blobs_are_checked_against_their_digest);
    tcase_add_test (tc, test_uploads_finish_on_their_own_threads_and_report_through_the_fd);
    tcase_add_test (tc, test_the_cap_evicts_least_recently_used_unpinned_entries);
    tcase_add_test (tc, test_uploads_in_progress_count_against_the_cap);
    tcase_add_test (tc, test_stored_artifacts_open_by_content_hash_and_absent_ones_are_not_found);
    tcase_add_test (tc, test_pinned_artifacts_are_never_evicted_and_pins_survive_a_restart);
    tcase_add_test (tc, test_uploads_that_do_not_fit_beside_the_pins_are_refused);
    tcase_add_test (tc, test_the_integrity_check_finds_and_repairs_damage);
    suite_add_tcase (s, tc);
    return testlib_run (s);
}
