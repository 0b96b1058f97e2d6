/*
 * Unit tests for the compile sandbox and limits (worker/kiln_sandbox.c):
 * how a failed compile is explained (which limit, which signal, or the
 * compiler's own failure), that a child runs under the limits, and, where
 * bubblewrap works, that it runs in the sandbox with its process limit
 * and without root.  The farm-level behaviour (hostile toolchains on a
 * real worker) is tests/integration/test_worker_sandbox.py.
 */
#include <check.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/kiln_fs.h"
#include "worker/kiln_sandbox.h"
#include "tests/unit/testlib.h"

static kiln_sandbox_t *
s_none (uint64_t max_memory)
{
    kiln_sandbox_config_t cfg = { .kind = KILN_SANDBOX_NONE, .max_memory = max_memory,
                                  .slots = 1 };
    kiln_err_t err = { 0 };
    kiln_sandbox_t *sb = kiln_sandbox_new (&cfg, &err);
    ck_assert_msg (sb != NULL, "%s", err.msg);
    return sb;
}

/* Run `argv` as the worker would (fork, kiln_sandbox_exec) in `dir`;
 * returns its output (caller frees) and its wait status. */
static char *
s_run (kiln_sandbox_t *sb, const char *dir, char **argv, int *status)
{
    kiln_sandbox_cmd_t cmd;
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_sandbox_prepare (sb, 0, dir, argv, NULL, 0, 10000, &cmd, &err) == 0,
                   "%s", err.msg);
    int fds[2];
    ck_assert_int_eq (pipe (fds), 0);
    pid_t pid = fork ();
    ck_assert_int_ge (pid, 0);
    if (pid == 0) {
        int devnull = open ("/dev/null", O_RDONLY);
        dup2 (devnull, 0);
        dup2 (fds[1], 1);
        dup2 (fds[1], 2);
        close (fds[0]);
        kiln_sandbox_exec (&cmd);
    }
    close (fds[1]);
    size_t cap = 1 << 16, len = 0;
    char *out = malloc (cap + 1);
    ssize_t n;
    while (len < cap && (n = read (fds[0], out + len, cap - len)) > 0)
        len += (size_t) n;
    out[len] = '\0';
    close (fds[0]);
    ck_assert_int_eq (waitpid (pid, status, 0), pid);
    kiln_sandbox_cmd_release (&cmd);
    return out;
}

START_TEST (test_sandbox_explains_running_out_of_memory_naming_the_limit_and_option)
{
    kiln_sandbox_t *sb = s_none (512ULL << 20);
    char text[512];
    static const char *const logs[] = {
        "Traceback (most recent call last):\nMemoryError\n",
        "terminate called after throwing an instance of 'std::bad_alloc'\n",
        "kiln-cc: out of memory folding 1048576 elements\n",
    };
    for (size_t i = 0; i < sizeof logs / sizeof logs[0]; i++) {
        int code = kiln_sandbox_explain (sb, 1 << 8, logs[i], text, sizeof text);
        ck_assert_int_eq (code, KILN_ELIMIT);
        ck_assert_msg (strstr (text, "ran out of its 512 MiB memory limit (--max-memory)"),
                       "%s", text);
    }
    kiln_sandbox_destroy (&sb);
}
END_TEST

START_TEST (test_sandbox_tells_limits_and_signals_from_compile_failures)
{
    kiln_sandbox_t *sb = s_none (1ULL << 30);
    char text[512];
    /* A signal is named, and is not a compile failure. */
    ck_assert_int_eq (kiln_sandbox_explain (sb, SIGSEGV, "", text, sizeof text), KILN_EREMOTE);
    ck_assert_msg (strstr (text, "signal 11 (SIGSEGV)"), "%s", text);
    /* The CPU and file size limits have signals of their own. */
    ck_assert_int_eq (kiln_sandbox_explain (sb, SIGXCPU, "", text, sizeof text), KILN_ELIMIT);
    ck_assert_msg (strstr (text, "CPU time limit"), "%s", text);
    ck_assert_int_eq (kiln_sandbox_explain (sb, 1 << 8, "write: File too large", text,
                                            sizeof text), KILN_ELIMIT);
    ck_assert_msg (strstr (text, "16 GiB limit per file"), "%s", text);
    /* Only an ordinary non-zero exit is the compiler's own failure. */
    ck_assert_int_eq (kiln_sandbox_explain (sb, 2 << 8, "error: unsupported op 'Foo'", text,
                                            sizeof text), KILN_ECOMPILE);
    ck_assert_msg (strstr (text, "exited with status 2"), "%s", text);
    kiln_sandbox_destroy (&sb);
}
END_TEST

START_TEST (test_sandbox_child_runs_under_its_memory_core_and_file_limits)
{
    kiln_sandbox_t *sb = s_none (512ULL << 20);
    char *dir = testlib_keydir ("kiln-sandbox-test-", NULL, NULL);
    char *argv[] = { "cat", "/proc/self/limits", NULL };
    int status;
    char *out = s_run (sb, dir, argv, &status);
    ck_assert_msg (WIFEXITED (status) && WEXITSTATUS (status) == 0, "%s", out);
#if !defined(__SANITIZE_ADDRESS__)     /* an ASan worker sets none (kiln_sandbox_exec) */
    ck_assert_msg (strstr (out, "Max address space         536870912            536870912"),
                   "%s", out);
#endif
    ck_assert_msg (strstr (out, "Max core file size        0                    0"), "%s", out);
    ck_assert_msg (strstr (out, "Max file size             17179869184          17179869184"),
                   "%s", out);
    free (out);
    testlib_rmdir (&dir);
    kiln_sandbox_destroy (&sb);
}
END_TEST

START_TEST (test_sandbox_runs_the_compile_without_root_network_or_more_processes_than_its_limit)
{
    const char *bin = getenv ("KILN_BIN");
    char helper[PATH_MAX];
    snprintf (helper, sizeof helper, "%s/kiln-worker", bin ? bin : "build/bin");
    if (access ("/usr/bin/bwrap", X_OK) != 0 || access (helper, X_OK) != 0) {
        fprintf (stderr, "skipped: no bwrap or no %s\n", helper);
        return;
    }
    char *dir = testlib_keydir ("kiln-sandbox-test-", NULL, NULL);
    kiln_sandbox_config_t cfg = { .kind = KILN_SANDBOX_BWRAP, .max_memory = 1ULL << 30,
                                  .max_procs = 64, .slots = 1, .helper = helper };
    kiln_err_t err = { 0 };
    kiln_sandbox_t *sb = kiln_sandbox_new (&cfg, &err);
    ck_assert_msg (sb != NULL, "%s", err.msg);
    char *argv[] = { "sh", "-c", "id -u; grep 'Max processes' /proc/self/limits; "
                     "cat /proc/net/dev | grep -c :; echo inside > here", NULL };
    int status;
    char *out = s_run (sb, dir, argv, &status);
    ck_assert_msg (WIFEXITED (status) && WEXITSTATUS (status) == 0, "%s", out);
    ck_assert_msg (strncmp (out, "0\n", 2) != 0, "ran as root: %s", out);
    ck_assert_msg (strstr (out, "Max processes             64                   64"), "%s", out);
    /* Only its own loopback. */
    ck_assert_msg (strstr (out, "\n1\n"), "%s", out);
    char here[PATH_MAX];
    snprintf (here, sizeof here, "%s/here", dir);
    ck_assert (kiln_file_exists (here));
    free (out);
    /* A signal comes back as bwrap's 128 + N and is named as such. */
    char text[256];
    ck_assert_int_eq (kiln_sandbox_explain (sb, (128 + SIGKILL) << 8, "", text, sizeof text),
                      KILN_EREMOTE);
    ck_assert_msg (strstr (text, "SIGKILL") && strstr (text, "out of memory"), "%s", text);
    testlib_rmdir (&dir);
    kiln_sandbox_destroy (&sb);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("sandbox");
    TCase *tc = tcase_create ("sandbox");
    tcase_set_timeout (tc, 60);
    tcase_add_test (tc, test_sandbox_explains_running_out_of_memory_naming_the_limit_and_option);
    tcase_add_test (tc, test_sandbox_tells_limits_and_signals_from_compile_failures);
    tcase_add_test (tc, test_sandbox_child_runs_under_its_memory_core_and_file_limits);
    tcase_add_test (tc,
        test_sandbox_runs_the_compile_without_root_network_or_more_processes_than_its_limit);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run (s_suite ());
}
