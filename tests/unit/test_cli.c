/* Unit tests of the CLI's helpers (issue 16): the JUnit report's escaping
 * and bounds, the progress line's units, and the listen-address parser
 * kiln-serve and kiln-broker --metrics share. */
#include <check.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/kiln_junit.h"
#include "client/kiln_progress.h"
#include "common/kiln_net.h"
#include "tests/unit/testlib.h"

START_TEST (test_junit_escapes_markup_and_control_characters)
{
    kiln_junit_t *j = kiln_junit_new ("suite <&>");
    ck_assert_ptr_nonnull (j);
    kiln_err_t err = { 0 };
    kiln_junit_case_t ok = { .name = "models/a&b.onnx", .seconds = 1.5, .cached = true,
                             .artifact = "ab12", .worker = "w\"1" };
    kiln_junit_case_t bad = { .name = "m.onnx", .seconds = 0.25, .error_code = "ECOMPILE",
                              .error = "compile failed: <boom>\n--- compile log ---\n"
                                       "bell\a and esc\033[1m 'x'" };
    ck_assert_int_eq (kiln_junit_add (j, &ok, &err), 0);
    ck_assert_int_eq (kiln_junit_add (j, &bad, &err), 0);
    char *xml = kiln_junit_xml (j, 2.0);
    ck_assert_ptr_nonnull (xml);
    ck_assert_ptr_nonnull (strstr (xml, "name=\"suite &lt;&amp;&gt;\" tests=\"2\" failures=\"1\""));
    ck_assert_ptr_nonnull (strstr (xml, "name=\"models/a&amp;b.onnx\" time=\"1.500\""));
    ck_assert_ptr_nonnull (strstr (xml, "name=\"cached\" value=\"true\""));
    ck_assert_ptr_nonnull (strstr (xml, "value=\"w&quot;1\""));
    /* the message is the first line; the text all of it, control bytes as '?' */
    ck_assert_ptr_nonnull (strstr (xml, "type=\"ECOMPILE\" message=\"compile failed: "
                                        "&lt;boom&gt;\">"));
    ck_assert_ptr_nonnull (strstr (xml, "bell? and esc?[1m &apos;x&apos;</failure>"));
    for (const char *p = xml; *p; p++)
        ck_assert (*p == '\n' || (unsigned char) *p >= 0x20);
    free (xml);
    kiln_junit_destroy (&j);
    ck_assert_ptr_null (j);
}
END_TEST

START_TEST (test_junit_cuts_long_text_on_a_character_boundary)
{
    kiln_junit_t *j = kiln_junit_new (NULL);
    size_t n = KILN_JUNIT_MAX_TEXT + 100;
    char *big = malloc (n + 1);
    /* "é" (2 bytes) repeated: any cut at an odd offset would split one */
    for (size_t i = 0; i + 1 < n; i += 2) {
        big[i] = (char) 0xC3;
        big[i + 1] = (char) 0xA9;
    }
    big[n - 1] = 'x';
    big[n] = '\0';
    kiln_err_t err = { 0 };
    kiln_junit_case_t c = { .name = "m", .error = big };
    ck_assert_int_eq (kiln_junit_add (j, &c, &err), 0);
    char *xml = kiln_junit_xml (j, 0);
    char *cut = strstr (xml, " [cut]</failure>");
    ck_assert_ptr_nonnull (cut);
    ck_assert_uint_eq ((unsigned char) cut[-1], 0xA9);      /* a whole "é" before it */
    free (xml);
    free (big);
    kiln_junit_destroy (&j);
}
END_TEST

START_TEST (test_junit_written_atomically_where_asked)
{
    char dir[] = "/tmp/kiln-junit-XXXXXX";
    ck_assert_ptr_nonnull (mkdtemp (dir));
    char path[256], bad[300];
    snprintf (path, sizeof path, "%s/r.xml", dir);
    snprintf (bad, sizeof bad, "%s/no/such/dir/r.xml", dir);
    kiln_junit_t *j = kiln_junit_new ("s");
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_junit_write (j, path, 1.0, &err), 0);
    FILE *f = fopen (path, "r");
    ck_assert_ptr_nonnull (f);
    char head[64] = "";
    ck_assert_ptr_nonnull (fgets (head, sizeof head, f));
    fclose (f);
    ck_assert_str_eq (head, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    ck_assert_int_ne (kiln_junit_write (j, bad, 1.0, &err), 0);
    ck_assert_ptr_nonnull (strstr (err.msg, "JUnit report"));
    kiln_junit_destroy (&j);
    unlink (path);
    rmdir (dir);
}
END_TEST

START_TEST (test_progress_units_read_as_people_write_them)
{
    char buf[32];
    ck_assert_str_eq (kiln_progress_bytes (buf, sizeof buf, 512), "512 B");
    ck_assert_str_eq (kiln_progress_bytes (buf, sizeof buf, 1536), "1.5 KiB");
    ck_assert_str_eq (kiln_progress_bytes (buf, sizeof buf, 64.0 * (1 << 20)), "64.0 MiB");
    ck_assert_str_eq (kiln_progress_duration (buf, sizeof buf, 0.4), "0 s");
    ck_assert_str_eq (kiln_progress_duration (buf, sizeof buf, 45), "45 s");
    ck_assert_str_eq (kiln_progress_duration (buf, sizeof buf, 185), "3m05s");
    ck_assert_str_eq (kiln_progress_duration (buf, sizeof buf, 7800), "2h10m");
    /* not a terminal: no display at all */
    int fds[2];
    ck_assert_int_eq (pipe (fds), 0);
    ck_assert_ptr_null (kiln_progress_new (fds[1], 1));
    close (fds[0]);
    close (fds[1]);
}
END_TEST

START_TEST (test_listen_addresses_parse_or_say_what_is_wrong)
{
    struct sockaddr_storage addr;
    socklen_t len;
    int family;
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_resolve_listen ("--metrics", "127.0.0.1:9400", &addr, &len,
                                           &family, &err), 0);
    ck_assert_int_eq (family, AF_INET);
    ck_assert_int_eq (ntohs (((struct sockaddr_in *) &addr)->sin_port), 9400);
    ck_assert_int_eq (kiln_resolve_listen ("--listen", "[::1]:0", &addr, &len, &family, &err),
                      0);
    ck_assert_int_eq (family, AF_INET6);
    ck_assert_int_ne (kiln_resolve_listen ("--metrics", "nonsense", &addr, &len, &family,
                                           &err), 0);
    ck_assert_str_eq (err.msg, "--metrics 'nonsense' is not HOST:PORT");
    ck_assert_int_ne (kiln_resolve_listen ("--metrics", "h:65536", &addr, &len, &family, &err),
                      0);
    ck_assert_str_eq (err.msg, "--metrics 'h:65536': '65536' is not a port");
    ck_assert_int_ne (kiln_resolve_listen ("--listen", "h:-1", &addr, &len, &family, &err), 0);
}
END_TEST

int
main (void)
{
    Suite *s = suite_create ("cli");
    TCase *tc = tcase_create ("cli");
    tcase_add_test (tc, test_junit_escapes_markup_and_control_characters);
    tcase_add_test (tc, test_junit_cuts_long_text_on_a_character_boundary);
    tcase_add_test (tc, test_junit_written_atomically_where_asked);
    tcase_add_test (tc, test_progress_units_read_as_people_write_them);
    tcase_add_test (tc, test_listen_addresses_parse_or_say_what_is_wrong);
    suite_add_tcase (s, tc);
    return testlib_run (s);
}
