/*
 * kiln_junit — the JUnit XML report of `kiln batch --junit FILE`.
 */
#include "client/kiln_junit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/kiln_fs.h"

typedef struct {
    char *name, *artifact, *worker, *error_code, *error;   /* owned, may be NULL */
    double seconds;
    bool cached;
} s_case_t;

struct kiln_junit {
    char *name;                  /* owned */
    s_case_t *cases;             /* owned, n used, cap allocated */
    size_t n, cap;
    char stamp[32];              /* ISO 8601, when the report was begun */
};

kiln_junit_t *
kiln_junit_new (const char *name)
{
    kiln_junit_t *self = calloc (1, sizeof *self);
    if (!self || !(self->name = strdup (name ? name : "kiln batch"))) {
        free (self);
        return NULL;
    }
    time_t now = time (NULL);
    struct tm tm;
    gmtime_r (&now, &tm);
    strftime (self->stamp, sizeof self->stamp, "%Y-%m-%dT%H:%M:%S", &tm);
    return self;
}

static void
s_case_release (s_case_t *c)
{
    free (c->name);
    free (c->artifact);
    free (c->worker);
    free (c->error_code);
    free (c->error);
}

void
kiln_junit_destroy (kiln_junit_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_junit_t *self = *self_p;
    for (size_t i = 0; i < self->n; i++)
        s_case_release (&self->cases[i]);
    free (self->cases);
    free (self->name);
    free (self);
    *self_p = NULL;
}

/* A copy of `s` (NULL stays NULL); *oom set when the copy fails. */
static char *
s_dup (const char *s, bool *oom)
{
    if (!s)
        return NULL;
    char *copy = strdup (s);
    if (!copy)
        *oom = true;
    return copy;
}

int
kiln_junit_add (kiln_junit_t *self, const kiln_junit_case_t *c, kiln_err_t *err)
{
    if (self->n >= KILN_JUNIT_MAX_CASES)
        return kiln_error (err, KILN_ELIMIT, "more than %d cases in the JUnit report",
                           KILN_JUNIT_MAX_CASES);
    if (self->n == self->cap) {
        size_t cap = self->cap ? self->cap * 2 : 16;
        s_case_t *grown = realloc (self->cases, cap * sizeof *grown);
        if (!grown)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        self->cases = grown;
        self->cap = cap;
    }
    bool oom = false;
    s_case_t *d = &self->cases[self->n];
    memset (d, 0, sizeof *d);
    d->name = s_dup (c->name ? c->name : "?", &oom);
    d->artifact = s_dup (c->artifact, &oom);
    d->worker = s_dup (c->worker, &oom);
    d->error_code = s_dup (c->error_code, &oom);
    d->error = s_dup (c->error, &oom);
    d->seconds = c->seconds >= 0 ? c->seconds : 0;
    d->cached = c->cached;
    if (oom) {
        s_case_release (d);
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    self->n++;
    return 0;
}

/* Write the first `n` bytes of `s` (at most `max` of them, the cut
 * marked) escaped for XML text and attribute values; bytes XML 1.0
 * cannot hold (control characters other than tab, newline and return)
 * become '?'.  UTF-8 passes through. */
static void
s_escape_n (FILE *out, const char *s, size_t n, size_t max)
{
    bool cut = n > max;
    if (cut) {
        n = max;
        while (n > 0 && ((unsigned char) s[n] & 0xC0) == 0x80)
            n--;                     /* not inside a UTF-8 sequence */
    }
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char) s[i];
        switch (ch) {
        case '<': fputs ("&lt;", out); break;
        case '>': fputs ("&gt;", out); break;
        case '&': fputs ("&amp;", out); break;
        case '"': fputs ("&quot;", out); break;
        case '\'': fputs ("&apos;", out); break;
        case '\t': case '\n': case '\r': fputc (ch, out); break;
        default: fputc (ch < 0x20 || ch == 0x7f ? '?' : ch, out); break;
        }
    }
    if (cut)
        fputs (" [cut]", out);
}

/* s_escape_n of the whole string. */
static void
s_escape (FILE *out, const char *s, size_t max)
{
    s_escape_n (out, s, strlen (s), max);
}

static void
s_property (FILE *out, const char *name, const char *value)
{
    fprintf (out, "      <property name=\"%s\" value=\"", name);
    s_escape (out, value, KILN_JUNIT_MAX_TEXT);
    fputs ("\"/>\n", out);
}

char *
kiln_junit_xml (const kiln_junit_t *self, double total_seconds)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *out = open_memstream (&buf, &len);
    if (!out)
        return NULL;
    size_t failures = 0;
    for (size_t i = 0; i < self->n; i++)
        failures += self->cases[i].error != NULL;
    fputs ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites>\n", out);
    fputs ("  <testsuite name=\"", out);
    s_escape (out, self->name, KILN_JUNIT_MAX_TEXT);
    fprintf (out, "\" tests=\"%zu\" failures=\"%zu\" errors=\"0\" skipped=\"0\" "
             "time=\"%.3f\" timestamp=\"%s\">\n", self->n, failures, total_seconds,
             self->stamp);
    for (size_t i = 0; i < self->n; i++) {
        const s_case_t *c = &self->cases[i];
        fputs ("    <testcase classname=\"kiln.batch\" name=\"", out);
        s_escape (out, c->name, KILN_JUNIT_MAX_TEXT);
        fprintf (out, "\" time=\"%.3f\">\n    <properties>\n", c->seconds);
        s_property (out, "cached", c->cached ? "true" : "false");
        if (c->artifact && *c->artifact)
            s_property (out, "artifact", c->artifact);
        if (c->worker && *c->worker)
            s_property (out, "worker", c->worker);
        fputs ("    </properties>\n", out);
        if (c->error) {
            /* The message attribute is the first line; the text is all of
             * it, the compiler's log tail included. */
            size_t first = strcspn (c->error, "\n");
            fputs ("      <failure type=\"", out);
            s_escape (out, c->error_code ? c->error_code : "EREMOTE", 64);
            fputs ("\" message=\"", out);
            s_escape_n (out, c->error, first, KILN_JUNIT_MAX_TEXT);
            fputs ("\">", out);
            s_escape (out, c->error, KILN_JUNIT_MAX_TEXT);
            fputs ("</failure>\n", out);
        }
        fputs ("    </testcase>\n", out);
    }
    fputs ("  </testsuite>\n</testsuites>\n", out);
    if (fclose (out) != 0) {
        free (buf);
        return NULL;
    }
    return buf;
}

int
kiln_junit_write (const kiln_junit_t *self, const char *path, double total_seconds,
                  kiln_err_t *err)
{
    char *xml = kiln_junit_xml (self, total_seconds);
    if (!xml)
        return kiln_error (err, KILN_ENOMEM, "out of memory writing the JUnit report");
    int rc = kiln_write_file_atomic (path, xml, strlen (xml), 0644, err);
    free (xml);
    if (rc != 0)
        kiln_error_prefix (err, "JUnit report");
    return rc;
}
