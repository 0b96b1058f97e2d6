/*
 * Unit tests for external toolchains' command templates and outputs
 * (worker/kiln_toolchain.c): the compiler arguments a job may pass
 * ({args:ALLOWED}) and how the worker creates and reads {output}
 * (issue 14, finding 6).
 */
#include <check.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kiln_fs.h"
#include "tests/unit/testlib.h"
#include "worker/kiln_toolchain.h"

static char *s_dir;

static void
setup (void)
{
    s_dir = testlib_keydir ("kiln-test-toolchain-", NULL, NULL);
}

static void
teardown (void)
{
    testlib_rmdir (&s_dir);
}

static char *
s_path (const char *name)
{
    return testlib_path (s_dir, name);
}

/* The argv of `spec` for a job with `args`; NULL (err set) when refused. */
static char **
s_argv (const char *spec, const char *args, kiln_err_t *err)
{
    kiln_toolchain_t tc;
    ck_assert_msg (kiln_toolchain_parse_spec (spec, "cpu-x86_64", &tc, err) == 0, "%s",
                   err->msg);
    char **argv = kiln_toolchain_argv (&tc, "/w/model.kgraph", "/w/toolchain.out", "/w",
                                       args, err);
    kiln_toolchain_release (&tc);
    return argv;
}

static int
s_argc (char **argv)
{
    int n = 0;
    while (argv[n])
        n++;
    return n;
}

START_TEST (test_only_the_arguments_the_worker_allows_reach_the_command)
{
    kiln_err_t err;
    const char *spec = "mycc@1=mycc {input} -o {output} {args:-O1,-O2,--level=*}";
    char **argv = s_argv (spec, "-O2 --level=3", &err);
    ck_assert_msg (argv, "%s", err.msg);
    ck_assert_int_eq (s_argc (argv), 6);
    ck_assert_str_eq (argv[3], "/w/toolchain.out");
    ck_assert_str_eq (argv[4], "-O2");
    ck_assert_str_eq (argv[5], "--level=3");
    kiln_toolchain_argv_free (argv);

    //  cp {input} {output} {args} with "-t DIR" wrote the client's graph
    //  into a directory of its choice.  Each refused argument is named.
    const char *bad[][2] = {
        { "-t /etc", "'-t'" },
        { "-O2 -t", "'-t'" },
        { "--level=../../etc", "'--level=../../etc'" },
        { "--level=", "'--level='" },
        { "--level=a/b", "'--level=a/b'" },
        { "-O3", "'-O3'" },
        { "'-O1 -t'", "'-O1 -t'" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kiln_err_t e = { 0 };
        argv = s_argv (spec, bad[i][0], &e);
        ck_assert_msg (!argv, "'%s' was passed", bad[i][0]);
        ck_assert_int_eq (e.code, KILN_EINVAL);
        ck_assert_msg (strstr (e.msg, bad[i][1]) && strstr (e.msg, "'mycc'"), "%s", e.msg);
    }

    //  Plain {args}: no argument at all; none given is fine.
    argv = s_argv ("cp@1=cp {input} {output} {args}", "-t /tmp", &err);
    ck_assert_ptr_null (argv);
    ck_assert_msg (strstr (err.msg, "'-t'"), "%s", err.msg);
    argv = s_argv ("cp@1=cp {input} {output} {args}", "", &err);
    ck_assert_msg (argv && s_argc (argv) == 3, "%s", err.msg);
    kiln_toolchain_argv_free (argv);
}
END_TEST

START_TEST (test_args_placeholder_must_be_a_word_of_its_own)
{
    kiln_toolchain_t tc;
    kiln_err_t err;
    const char *bad[] = {
        "a@1=sh -c 'mycc {args}'",
        "a@1=mycc --flags={args}",
        "a@1=mycc {args} {args:-O1}",
        "a@1=mycc {args:-O1,*x}",
        "a@1=mycc {args:-O1,,}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kiln_err_t e = { 0 };
        ck_assert_msg (kiln_toolchain_parse_spec (bad[i], "cpu-x86_64", &tc, &e) < 0,
                       "'%s' was accepted", bad[i]);
        ck_assert_msg (strstr (e.msg, "toolchain 'a'") && strstr (e.msg, "args"), "%s", e.msg);
    }
    ck_assert_int_eq (kiln_toolchain_parse_spec ("a@1=mycc {args:-O1,--x=*}", "cpu-x86_64",
                                                 &tc, &err), 0);
    ck_assert_int_eq (tc.n_allow, 2);
    ck_assert_str_eq (tc.words[1], "{args}");
    kiln_toolchain_release (&tc);
}
END_TEST

START_TEST (test_output_is_created_exclusively_and_read_only_as_a_regular_file)
{
    kiln_err_t err;
    uint8_t *data;
    size_t len;
    uint64_t size;
    char out[PATH_MAX];
    snprintf (out, sizeof out, "%s", s_path ("toolchain.out"));
    ck_assert_int_eq (kiln_toolchain_create_output (out, &err), 0);
    //  A second time (a file already there) is an error, and so is a link.
    ck_assert_int_lt (kiln_toolchain_create_output (out, &err), 0);
    ck_assert_int_eq (symlink ("/etc/hostname", s_path ("link.out")), 0);
    ck_assert_int_lt (kiln_toolchain_create_output (s_path ("link.out"), &err), 0);
    ck_assert_msg (access ("/etc/hostname", F_OK) != 0 || strstr (err.msg, "link.out"),
                   "%s", err.msg);

    ck_assert_int_eq (kiln_write_file_atomic (out, "compiled", 8, 0644, &err), 0);
    ck_assert_int_eq (kiln_toolchain_read_output (out, 100, &data, &len, &size, &err), 0);
    ck_assert_uint_eq (len, 8);
    ck_assert_mem_eq (data, "compiled", 8);
    free (data);
    ck_assert_int_eq (kiln_toolchain_read_output (out, 4, &data, &len, &size, &err),
                      -KILN_ELIMIT);
    ck_assert_uint_eq (size, 8);

    //  The worker shipped /etc/hostname when {output} was a link to it.
    ck_assert_int_eq (kiln_toolchain_read_output (s_path ("link.out"), 100, &data, &len,
                                                  &size, &err), -KILN_EIO);
    ck_assert_msg (strstr (err.msg, "symbolic link"), "%s", err.msg);
    ck_assert_ptr_null (data);
    //  A hard link the command made to a file it could only read.
    ck_assert_int_eq (link (out, s_path ("hard.out")), 0);
    ck_assert_int_eq (kiln_toolchain_read_output (out, 100, &data, &len, &size, &err),
                      -KILN_EIO);
    ck_assert_msg (strstr (err.msg, "2 links"), "%s", err.msg);
    //  A FIFO: refused at once, not waited on.
    ck_assert_int_eq (mkfifo (s_path ("fifo.out"), 0600), 0);
    ck_assert_int_lt (kiln_toolchain_read_output (s_path ("fifo.out"), 100, &data, &len,
                                                  &size, &err), 0);
    ck_assert_msg (strstr (err.msg, "not a regular file"), "%s", err.msg);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("toolchain");
    TCase *tc = tcase_create ("toolchain");
    tcase_add_checked_fixture (tc, setup, teardown);
    tcase_add_test (tc, test_only_the_arguments_the_worker_allows_reach_the_command);
    tcase_add_test (tc, test_args_placeholder_must_be_a_word_of_its_own);
    tcase_add_test (tc, test_output_is_created_exclusively_and_read_only_as_a_regular_file);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run (s_suite ());
}
