/*
 * Unit tests for the import cache (common/kiln_statcache.c): a digest is
 * given back only for the very file it was taken from, unchanged; files
 * written within the racy window are not remembered; a cache file that
 * is damaged or writable by others is not believed.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kiln_fs.h"
#include "common/kiln_statcache.h"
#include "tests/unit/testlib.h"

static char *s_dir;

static void
s_setup (void)
{
    s_dir = testlib_keydir ("statcache", NULL, NULL);
}

static void
s_teardown (void)
{
    testlib_rmdir (&s_dir);
}

/* Write `text` to DIR/name and fstat it into *st. */
static void
s_file (const char *name, const char *text, struct stat *st)
{
    kiln_err_t err = { 0 };
    const char *path = testlib_path (s_dir, name);
    ck_assert_int_eq (kiln_write_file_atomic (path, text, strlen (text), 0644, &err), 0);
    ck_assert_int_eq (stat (path, st), 0);
}

/* A time after the file's mtime and ctime by more than the racy window:
 * as if hashing began three seconds after the file was last written. */
static int64_t
s_later (const struct stat *st)
{
    return (int64_t) st->st_ctim.tv_sec * 1000000000LL + st->st_ctim.tv_nsec
           + KILN_STATCACHE_RACY_NS + 1000000000LL;
}

START_TEST (test_statcache_hits_only_the_unchanged_file_and_range)
{
    struct stat st, changed;
    uint8_t digest[KILN_DIGEST_LEN], got[KILN_DIGEST_LEN];
    memset (digest, 0xab, sizeof digest);
    s_file ("w.bin", "0123456789", &st);
    char cache_path[PATH_MAX];
    snprintf (cache_path, sizeof cache_path, "%s/cache/import-digests", s_dir);

    kiln_statcache_t *c = kiln_statcache_load (cache_path);
    ck_assert_ptr_nonnull (c);
    ck_assert (!kiln_statcache_lookup (c, &st, 0, 10, got));
    ck_assert (kiln_statcache_remember (c, &st, &st, s_later (&st), 0, 10, digest));
    kiln_statcache_save (c);
    kiln_statcache_destroy (&c);

    //  another process: loaded from the file
    struct stat cst;
    ck_assert_int_eq (stat (cache_path, &cst), 0);
    ck_assert_int_eq (cst.st_mode & 0777, 0600);
    c = kiln_statcache_load (cache_path);
    memset (got, 0, sizeof got);
    ck_assert (kiln_statcache_lookup (c, &st, 0, 10, got));
    ck_assert_mem_eq (got, digest, sizeof digest);
    ck_assert (!kiln_statcache_lookup (c, &st, 1, 9, got));    /* another range */

    //  the same size, new bytes (a new inode, as editors write): no hit
    s_file ("w.bin", "0123456780", &changed);
    ck_assert (!kiln_statcache_lookup (c, &changed, 0, 10, got));
    //  the entry is of the old identity, which fstat no longer gives
    ck_assert (kiln_statcache_lookup (c, &st, 0, 10, got));
    uint64_t hits, misses;
    kiln_statcache_counts (c, &hits, &misses);
    ck_assert_uint_eq (hits, 2);
    ck_assert_uint_eq (misses, 2);
    kiln_statcache_destroy (&c);
}
END_TEST

START_TEST (test_statcache_does_not_remember_racy_or_changing_files)
{
    struct stat st, other;
    uint8_t digest[KILN_DIGEST_LEN] = { 1 };
    s_file ("w.bin", "abc", &st);
    s_file ("v.bin", "abcd", &other);
    kiln_statcache_t *c = kiln_statcache_load (testlib_path (s_dir, "cache"));
    int64_t ctime_ns = (int64_t) st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec;
    //  hashing began right after the last write: racily clean
    ck_assert (!kiln_statcache_remember (c, &st, &st, ctime_ns + 1000, 0, 3, digest));
    ck_assert (!kiln_statcache_remember (c, &st, &st, ctime_ns + KILN_STATCACHE_RACY_NS, 0, 3,
                                         digest));
    //  the file moved between the fstat before hashing and the one after
    ck_assert (!kiln_statcache_remember (c, &st, &other, s_later (&st), 0, 3, digest));
    uint8_t got[KILN_DIGEST_LEN];
    ck_assert (!kiln_statcache_lookup (c, &st, 0, 3, got));
    kiln_statcache_save (c);                 /* nothing remembered: no file */
    ck_assert (!kiln_file_exists (testlib_path (s_dir, "cache")));
    kiln_statcache_destroy (&c);
}
END_TEST

START_TEST (test_statcache_ignores_damaged_lines_and_files_others_can_write)
{
    struct stat st;
    s_file ("w.bin", "abcdef", &st);
    char good[256];
    snprintf (good, sizeof good, "%llu %llu 6 %lld %lld 0 6 %064d\n",
              (unsigned long long) st.st_dev, (unsigned long long) st.st_ino,
              (long long) st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec,
              (long long) st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec, 7);
    char text[1024];
    snprintf (text, sizeof text, "garbage\n1 2 3\n%.*s 4 5 6 0 9 %064d\n%s",
              40, good, 1, good);   /* a cut line, a range past the end, then the good one */
    kiln_err_t err = { 0 };
    const char *path = testlib_path (s_dir, "digests");
    ck_assert_int_eq (kiln_write_file_atomic (path, text, strlen (text), 0600, &err), 0);
    kiln_statcache_t *c = kiln_statcache_load (path);
    uint8_t got[KILN_DIGEST_LEN];
    ck_assert (kiln_statcache_lookup (c, &st, 0, 6, got));
    ck_assert_uint_eq (got[KILN_DIGEST_LEN - 1], 0x07);
    kiln_statcache_destroy (&c);
    //  group-writable: not believed
    ck_assert_int_eq (chmod (path, 0664), 0);
    c = kiln_statcache_load (path);
    ck_assert (!kiln_statcache_lookup (c, &st, 0, 6, got));
    kiln_statcache_destroy (&c);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("statcache");
    TCase *tc = tcase_create ("statcache");
    tcase_add_checked_fixture (tc, s_setup, s_teardown);
    tcase_add_test (tc, test_statcache_hits_only_the_unchanged_file_and_range);
    tcase_add_test (tc, test_statcache_does_not_remember_racy_or_changing_files);
    tcase_add_test (tc, test_statcache_ignores_damaged_lines_and_files_others_can_write);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run_in_tmpdir (s_suite (), "test_statcache");
}
