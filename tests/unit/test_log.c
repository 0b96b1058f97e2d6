/*
 * Unit tests for printing text that came from someone else
 * (common/kiln_log.c: kiln_text_escape, kiln_fputs_escaped and every log
 * line): terminal escapes in node names, compile logs and a broker's
 * messages are shown, never acted on (issue 14, finding 8).
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/kiln_log.h"
#include "tests/unit/testlib.h"

START_TEST (test_control_characters_and_bad_utf8_are_escaped)
{
    struct {
        const char *in, *out;
    } cases[] = {
        { "node 'conv1' (Conv)", "node 'conv1' (Conv)" },
        { "title \x1b]0;pwned\x07 red \x1b[31m", "title \\x1b]0;pwned\\x07 red \\x1b[31m" },
        { "line\nnext\ttab\rback", "line\nnext\ttab\\x0dback" },
        { "del \x7f c1 \xc2\x9b raw \x9b", "del \\x7f c1 \\xc2\\x9b raw \\x9b" },
        { "caf\xc3\xa9 \xe2\x9c\x93 \xf0\x9f\x94\xa5", "caf\xc3\xa9 \xe2\x9c\x93 \xf0\x9f\x94\xa5" },
        { "cut \xe2\x9c", "cut \\xe2\\x9c" },
        { "overlong \xc0\xaf \xe0\x80\xaf", "overlong \\xc0\\xaf \\xe0\\x80\\xaf" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char out[256];
        ck_assert_str_eq (kiln_text_escape (cases[i].in, out, sizeof out), cases[i].out);
    }
    //  A small buffer: cut on a whole escape, always terminated.
    char small[8];
    ck_assert_str_eq (kiln_text_escape ("ab\x1b\x1b", small, sizeof small), "ab\\x1b");
}
END_TEST

START_TEST (test_log_lines_and_long_text_are_escaped)
{
    //  stderr to a file: a log line with an escape in what it quotes.
    char path[] = "/tmp/kiln-test-log-XXXXXX";
    int fd = mkstemp (path);
    ck_assert_int_ge (fd, 0);
    fflush (stderr);
    int saved = dup (2);
    ck_assert_int_ge (dup2 (fd, 2), 0);
    kiln_log_init ("test", LOG_INFO);
    kiln_log_warn ("worker '%s' says hi", "w\x1b[2J");
    size_t n = 10000;
    char *big = malloc (n + 1);
    for (size_t i = 0; i < n; i++)
        big[i] = i % 100 == 99 ? '\x1b' : 'a';
    big[n] = '\0';
    kiln_print_error ("kiln compile", big);
    fflush (stderr);
    dup2 (saved, 2);
    close (saved);
    FILE *f = fdopen (fd, "r");
    fseek (f, 0, SEEK_SET);
    char *text = calloc (1, 64 << 10);
    size_t got = fread (text, 1, (64 << 10) - 1, f);
    fclose (f);
    unlink (path);
    ck_assert (got > n);
    ck_assert_ptr_null (memchr (text, '\x1b', got));
    ck_assert_ptr_nonnull (strstr (text, "worker 'w\\x1b[2J' says hi"));
    ck_assert_ptr_nonnull (strstr (text, "kiln compile: aaa"));
    //  Every one of the 100 escapes is there, written out.
    int k = 0;
    for (const char *p = text; (p = strstr (p, "\\x1b")); p++)
        k++;
    ck_assert_int_eq (k, 1 + 100);
    free (text);
    free (big);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("log");
    TCase *tc = tcase_create ("log");
    tcase_add_test (tc, test_control_characters_and_bad_utf8_are_escaped);
    tcase_add_test (tc, test_log_lines_and_long_text_are_escaped);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run (s_suite ());
}
