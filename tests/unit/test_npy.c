/*
 * Unit tests for runtime/kiln_npy: round trips, the bytes numpy itself
 * writes (versions 1, 2 and 3), and the refusal of every malformed or
 * unsupported file with an error, never a crash or a large allocation.
 */
#include <check.h>

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kiln_fs.h"
#include "runtime/kiln_npy.h"
#include "tests/unit/testlib.h"

/* What numpy 1.24's np.save writes for np.arange(6, dtype=np.float32)
 * .reshape(2, 3): the header padded to 128 bytes, then the data. */
static uint8_t *
s_numpy_file (int version, const char *dict, const void *data, size_t dlen,
              size_t *len)
{
    size_t pre = version == 1 ? 10 : 12;
    size_t n = strlen (dict);
    size_t hlen = ((pre + n + 1 + 63) / 64) * 64 - pre;
    *len = pre + hlen + dlen;
    uint8_t *b = malloc (*len);
    memcpy (b, "\x93NUMPY", 6);
    b[6] = (uint8_t) version;
    b[7] = 0;
    b[8] = (uint8_t) (hlen & 0xff);
    b[9] = (uint8_t) (hlen >> 8);
    if (version != 1) {
        b[10] = 0;
        b[11] = 0;
    }
    memset (b + pre, ' ', hlen);
    memcpy (b + pre, dict, n);
    b[pre + hlen - 1] = '\n';
    if (dlen)
        memcpy (b + pre + hlen, data, dlen);
    return b;
}

START_TEST (test_npy_reads_what_numpy_writes_in_versions_1_2_3)
{
    float v[6] = { 0, 1, 2, 3, 4, 5 };
    for (int version = 1; version <= 3; version++) {
        size_t len;
        uint8_t *b = s_numpy_file (version, "{'descr': '<f4', 'fortran_order': "
                                   "False, 'shape': (2, 3), }", v, sizeof v, &len);
        kiln_npy_t npy;
        kiln_err_t err = { 0 };
        ck_assert_msg (kiln_npy_parse (b, len, &npy, &err) == 0, "v%d: %s",
                       version, err.msg);
        ck_assert_int_eq (npy.dtype, KILN_DT_FLOAT32);
        ck_assert_int_eq (npy.shape.rank, 2);
        ck_assert_int_eq (npy.shape.dims[0], 2);
        ck_assert_int_eq (npy.shape.dims[1], 3);
        ck_assert_uint_eq (npy.size, sizeof v);
        ck_assert (memcmp (npy.data, v, sizeof v) == 0);
        kiln_npy_release (&npy);
        free (b);
    }
    /* Scalars, one-element tuples, byte types, python-2 longs, double quotes. */
    struct { const char *dict; kiln_dtype_t dt; int rank; size_t bytes; } cases[] = {
        { "{'descr': '<f4', 'fortran_order': False, 'shape': (), }", KILN_DT_FLOAT32, 0, 4 },
        { "{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }", KILN_DT_INT64, 1, 24 },
        { "{'descr': '|u1', 'fortran_order': False, 'shape': (2, 2)}", KILN_DT_UINT8, 2, 4 },
        { "{\"shape\": (2L, 1L), \"fortran_order\": False, \"descr\": \"<f8\"}", KILN_DT_FLOAT64, 2, 16 },
        { "{'descr': '|b1', 'fortran_order': False, 'shape': (0, 5), }", KILN_DT_BOOL, 2, 0 },
    };
    uint8_t zeros[64] = { 0 };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t len;
        uint8_t *b = s_numpy_file (1, cases[i].dict, zeros, cases[i].bytes, &len);
        kiln_npy_t npy;
        kiln_err_t err = { 0 };
        ck_assert_msg (kiln_npy_parse (b, len, &npy, &err) == 0, "%s: %s",
                       cases[i].dict, err.msg);
        ck_assert_int_eq (npy.dtype, cases[i].dt);
        ck_assert_int_eq (npy.shape.rank, cases[i].rank);
        ck_assert_uint_eq (npy.size, cases[i].bytes);
        kiln_npy_release (&npy);
        free (b);
    }
}
END_TEST

START_TEST (test_npy_round_trips_through_encode_and_files)
{
    kiln_err_t err = { 0 };
    char *dir = kiln_mkdtemp ("kiln-test-npy-", &err);
    ck_assert (dir);
    float v[24];
    for (int i = 0; i < 24; i++)
        v[i] = (float) i * 0.25f - 3.0f;
    kiln_shape_t shapes[] = { { .rank = 0 }, { .rank = 1, .dims = { 24 } },
                              { .rank = 3, .dims = { 2, 3, 4 } },
                              { .rank = 4, .dims = { 1, 2, 3, 4 } },
                              { .rank = 2, .dims = { 0, 7 } } };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        uint8_t *b;
        size_t len;
        ck_assert (kiln_npy_encode (KILN_DT_FLOAT32, &shapes[i], v, &b, &len, &err) == 0);
        /* numpy's layout: data 64-byte aligned, header ends in a newline. */
        size_t hlen = (size_t) b[8] | (size_t) b[9] << 8;
        ck_assert_uint_eq ((10 + hlen) % 64, 0);
        ck_assert_int_eq (b[10 + hlen - 1], '\n');
        kiln_npy_t npy;
        ck_assert_msg (kiln_npy_parse (b, len, &npy, &err) == 0, "%s", err.msg);
        ck_assert (kiln_shape_equal (&npy.shape, &shapes[i]));
        ck_assert (npy.size == 0 || memcmp (npy.data, v, npy.size) == 0);
        kiln_npy_release (&npy);
        free (b);

        char path[PATH_MAX];
        snprintf (path, sizeof path, "%s/a%zu.npy", dir, i);
        ck_assert (kiln_npy_write (path, KILN_DT_FLOAT32, &shapes[i], v, &err) == 0);
        ck_assert_msg (kiln_npy_read (path, &npy, &err) == 0, "%s", err.msg);
        ck_assert (kiln_shape_equal (&npy.shape, &shapes[i]));
        kiln_npy_release (&npy);
    }
    int64_t iv[3] = { -1, 0, 1LL << 40 };
    kiln_shape_t s3 = { .rank = 1, .dims = { 3 } };
    uint8_t *b;
    size_t len;
    kiln_npy_t npy;
    ck_assert (kiln_npy_encode (KILN_DT_INT64, &s3, iv, &b, &len, &err) == 0);
    ck_assert (memmem (b, len, "'<i8'", 5) != NULL);
    ck_assert (kiln_npy_parse (b, len, &npy, &err) == 0);
    ck_assert (memcmp (npy.data, iv, sizeof iv) == 0);
    kiln_npy_release (&npy);
    free (b);

    char path[PATH_MAX];
    snprintf (path, sizeof path, "%s/missing.npy", dir);
    ck_assert (kiln_npy_read (path, &npy, &err) != 0);
    ck_assert_msg (strstr (err.msg, "missing.npy"), "%s", err.msg);
    kiln_rm_rf (dir);
    free (dir);
}
END_TEST

START_TEST (test_npy_refuses_malformed_and_unsupported_files)
{
    float v[6] = { 0 };
    struct { int version; const char *dict; size_t dlen; const char *want; } cases[] = {
        { 1, "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", 24, "'>f4'" },
        { 1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", 24, "Fortran" },
        { 1, "{'descr': '<c8', 'fortran_order': False, 'shape': (3,), }", 24, "'<c8'" },
        { 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 20, "needs 24 bytes" },
        { 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 28, "needs 24 bytes" },
        { 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,1), }", 4, "shape" },
        { 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999,), }", 4, "shape" },
        { 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", 4, "shape" },
        { 1, "{'descr': '<f4', 'fortran_order': False, }", 4, "lacks" },
        { 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}", 4, "'x'" },
        { 1, "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (1,)}", 4, "'descr'" },
        { 1, "['descr', '<f4']", 4, "not a dict" },
        { 1, "{'descr': '<f4' 'fortran_order': False, 'shape': (1,)}", 4, "malformed" },
        { 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,)} junk", 4, "trailing" },
        { 1, "{'descr': 'f4\\'', 'fortran_order': False, 'shape': (1,)}", 4, "descr" },
        { 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,", 4, "shape" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t len;
        uint8_t *b = s_numpy_file (cases[i].version, cases[i].dict, v,
                                   cases[i].dlen > sizeof v ? sizeof v : cases[i].dlen, &len);
        if (cases[i].dlen > sizeof v) {
            b = realloc (b, len + cases[i].dlen - sizeof v);
            memset (b + len, 0, cases[i].dlen - sizeof v);
            len += cases[i].dlen - sizeof v;
        }
        kiln_npy_t npy;
        kiln_err_t err = { 0 };
        ck_assert_msg (kiln_npy_parse (b, len, &npy, &err) != 0, "case %zu accepted", i);
        ck_assert_msg (strstr (err.msg, cases[i].want), "case %zu: '%s' lacks '%s'",
                       i, err.msg, cases[i].want);
        ck_assert (npy.data == NULL);
        free (b);
    }
    /* Broken preambles. */
    kiln_npy_t npy;
    kiln_err_t err = { 0 };
    ck_assert (kiln_npy_parse ((const uint8_t *) "\x93NUMPX\x01\x00\x00\x00", 10, &npy, &err) != 0);
    ck_assert (strstr (err.msg, "not a .npy"));
    ck_assert (kiln_npy_parse ((const uint8_t *) "\x93NUMPY\x04\x00\x00\x00", 10, &npy, &err) != 0);
    ck_assert (strstr (err.msg, "version 4.0"));
    ck_assert (kiln_npy_parse ((const uint8_t *) "\x93NUMPY\x01\x00\xff\x00{}", 12, &npy, &err) != 0);
    ck_assert (strstr (err.msg, "truncated"));
    ck_assert (kiln_npy_parse ((const uint8_t *) "\x93NUMPY\x02\x00\xff\xff\xff\x7f", 12, &npy, &err) != 0);
    ck_assert (strstr (err.msg, "header of"));
    ck_assert (kiln_npy_parse ((const uint8_t *) "\x93NUMPY", 6, &npy, &err) != 0);

    /* Every truncation of a valid file is refused. */
    size_t len;
    uint8_t *b = s_numpy_file (1, "{'descr': '<f4', 'fortran_order': False, "
                               "'shape': (2, 3), }", v, sizeof v, &len);
    for (size_t cut = 0; cut < len; cut++)
        ck_assert_msg (kiln_npy_parse (b, cut, &npy, &err) != 0, "cut %zu", cut);
    free (b);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("npy");
    TCase *tc = tcase_create ("npy");
    tcase_add_test (tc, test_npy_reads_what_numpy_writes_in_versions_1_2_3);
    tcase_add_test (tc, test_npy_round_trips_through_encode_and_files);
    tcase_add_test (tc, test_npy_refuses_malformed_and_unsupported_files);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run (s_suite ());
}
