/* Unit tests of the client's member cache (client/kiln_member_cache.h):
 * entries are kept by digest and read back only at their size; the total
 * stays within the bound, the least recently used entries going first;
 * an entry others may write, a symbolic link and a member smaller than
 * the threshold are not used; a dropped entry is gone. */
#include <check.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "client/kiln_member_cache.h"
#include "common/kiln_fs.h"
#include "common/kiln_hash.h"
#include "tests/unit/testlib.h"

#define MiB (1u << 20)

static char *s_dir;
static int s_src = -1;                   /* 4 MiB of distinct bytes */
static char s_path[PATH_MAX];

static void
s_setup (void)
{
    kiln_err_t err = { 0 };
    s_dir = kiln_mkdtemp ("kiln-test-mcache-", &err);
    ck_assert_msg (s_dir != NULL, "%s", err.msg);
    snprintf (s_path, sizeof s_path, "%s/src", s_dir);
    s_src = open (s_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    ck_assert_int_ge (s_src, 0);
    uint8_t *buf = malloc (4 * MiB);
    uint64_t x = 88172645463325252ULL;      /* xorshift64: no period in 4 MiB */
    for (size_t i = 0; i < 4 * MiB; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        buf[i] = (uint8_t) x;
    }
    ck_assert_int_eq (kiln_write_all (s_src, buf, 4 * MiB), 0);
    free (buf);
}

static void
s_teardown (void)
{
    close (s_src);
    kiln_rm_rf (s_dir);
    free (s_dir);
}

/* The hex digest of len bytes at off of the source. */
static void
s_digest (uint64_t off, uint64_t len, char hex[KILN_HEX_LEN])
{
    uint8_t *buf = malloc (len), d[KILN_DIGEST_LEN];
    ck_assert_int_eq (kiln_pread_all (s_src, buf, len, off), (int64_t) len);
    kiln_sha256 (buf, len, d);
    kiln_hex (d, KILN_DIGEST_LEN, hex);
    free (buf);
}

/* Make entry `hex` look used `age` seconds ago. */
static void
s_age (const char *cache_dir, const char *hex, int age)
{
    char p[PATH_MAX + 80];
    snprintf (p, sizeof p, "%s/%s", cache_dir, hex);
    struct timespec t[2];
    clock_gettime (CLOCK_REALTIME, &t[0]);
    t[0].tv_sec -= age;
    t[1] = t[0];
    ck_assert_int_eq (utimensat (AT_FDCWD, p, t, 0), 0);
}

START_TEST (test_entries_stay_within_the_bound_least_recently_used_first)
{
    char dir[PATH_MAX + 16];
    snprintf (dir, sizeof dir, "%s/members", s_dir);
    kiln_mcache_t *c = kiln_mcache_open (dir, 2 * MiB + MiB / 2);   /* room for two */
    ck_assert_ptr_nonnull (c);
    char a[KILN_HEX_LEN], b[KILN_HEX_LEN], d[KILN_HEX_LEN], small[KILN_HEX_LEN];
    s_digest (0, MiB, a);
    s_digest (MiB, MiB, b);
    s_digest (2 * MiB, MiB, d);
    s_digest (3 * MiB, 1000, small);
    ck_assert (kiln_mcache_put (c, s_src, 0, MiB, a));
    ck_assert (kiln_mcache_put (c, s_src, MiB, MiB, b));
    ck_assert (!kiln_mcache_put (c, s_src, 3 * MiB, 1000, small));   /* below the threshold */
    ck_assert (!kiln_mcache_put (c, s_src, 0, 3 * MiB, a));          /* above the bound */
    s_age (dir, a, 20);
    s_age (dir, b, 30);
    /* using a makes it the most recent; b goes when d comes */
    int fd = kiln_mcache_open_member (c, a, MiB);
    ck_assert_int_ge (fd, 0);
    close (fd);
    ck_assert_int_eq (kiln_mcache_open_member (c, a, MiB + 1), -1);   /* wrong size */
    usleep (50000);                      /* past the file system's clock tick */
    ck_assert (kiln_mcache_put (c, s_src, 2 * MiB, MiB, d));
    ck_assert_uint_le (kiln_mcache_bytes (c), 2 * MiB + MiB / 2);
    ck_assert_int_eq (kiln_mcache_open_member (c, b, MiB), -1);
    kiln_blob_ref_t have[4];
    ck_assert_uint_eq (kiln_mcache_recent (c, have, 4), 2);
    char h0[KILN_HEX_LEN], h1[KILN_HEX_LEN];
    kiln_hex (have[0].digest, KILN_DIGEST_LEN, h0);
    kiln_hex (have[1].digest, KILN_DIGEST_LEN, h1);
    ck_assert_str_eq (h0, d);                /* newest first */
    ck_assert_str_eq (h1, a);
    ck_assert_uint_eq (have[0].size, MiB);
    ck_assert_uint_eq (kiln_mcache_recent (c, have, 1), 1);
    /* the bytes are the source's */
    fd = kiln_mcache_open_member (c, d, MiB);
    uint8_t *x = malloc (MiB), *y = malloc (MiB);
    ck_assert_int_eq (kiln_pread_all (fd, x, MiB, 0), MiB);
    ck_assert_int_eq (kiln_pread_all (s_src, y, MiB, 2 * MiB), MiB);
    ck_assert (memcmp (x, y, MiB) == 0);
    close (fd);
    free (x);
    free (y);
    /* dropped: gone */
    kiln_mcache_drop (c, d);
    ck_assert_int_eq (kiln_mcache_open_member (c, d, MiB), -1);
    kiln_mcache_destroy (&c);
}
END_TEST

START_TEST (test_entries_others_may_write_and_links_are_not_used)
{
    char dir[PATH_MAX + 16], p[PATH_MAX + 96], q[PATH_MAX + 96];
    snprintf (dir, sizeof dir, "%s/members", s_dir);
    kiln_mcache_t *c = kiln_mcache_open (dir, 8 * MiB);
    ck_assert_ptr_nonnull (c);
    char a[KILN_HEX_LEN], b[KILN_HEX_LEN];
    s_digest (0, MiB, a);
    s_digest (MiB, MiB, b);
    ck_assert (kiln_mcache_put (c, s_src, 0, MiB, a));
    snprintf (p, sizeof p, "%s/%s", dir, a);
    ck_assert_int_eq (chmod (p, 0622), 0);
    ck_assert_int_eq (kiln_mcache_open_member (c, a, MiB), -1);
    kiln_blob_ref_t have[4];
    ck_assert_uint_eq (kiln_mcache_recent (c, have, 4), 0);
    /* a link named like an entry, to a file of the right size */
    snprintf (q, sizeof q, "%s/%s", dir, b);
    ck_assert_int_eq (symlink (s_path, q), 0);
    ck_assert_int_eq (kiln_mcache_open_member (c, b, 4 * MiB), -1);
    ck_assert_uint_eq (kiln_mcache_recent (c, have, 4), 0);
    /* an unfinished copy of a process that died goes after an hour */
    snprintf (p, sizeof p, "%s/.tmp-old", dir);
    snprintf (q, sizeof q, "%s/.tmp-new", dir);
    close (open (p, O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
    close (open (q, O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
    s_age (dir, ".tmp-old", 7200);
    kiln_mcache_bytes (c);
    ck_assert (!kiln_file_exists (p));
    ck_assert (kiln_file_exists (q));
    kiln_mcache_destroy (&c);
    /* a cache directory others may write is not used at all */
    ck_assert_int_eq (chmod (dir, 0777), 0);
    ck_assert_ptr_null (kiln_mcache_open (dir, 8 * MiB));
    /* nor one of size 0 (off) */
    ck_assert_int_eq (chmod (dir, 0700), 0);
    ck_assert_ptr_null (kiln_mcache_open (dir, 0));
}
END_TEST

int
main (void)
{
    Suite *s = suite_create ("member_cache");
    TCase *tc = tcase_create ("member_cache");
    tcase_set_timeout (tc, 30);
    tcase_add_checked_fixture (tc, s_setup, s_teardown);
    tcase_add_test (tc, test_entries_stay_within_the_bound_least_recently_used_first);
    tcase_add_test (tc, test_entries_others_may_write_and_links_are_not_used);
    suite_add_tcase (s, tc);
    return testlib_run (s);
}
