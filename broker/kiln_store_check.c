/*
 * kiln_store_check — the offline integrity check of a store no broker is
 * using (`kiln-broker --check-store`): every blob hashes to its name,
 * every artifact parses, carries its content hash and a signature the
 * store's keyring accepts, every record parses and names what it should.
 * With repair it removes what is damaged.  It reads the files only; it
 * never opens the store (kiln_store_new) nor touches its index.
 */
#include "broker/kiln_store.h"

#include <dirent.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_fs.h"

typedef struct {
    const char *root;
    const char *keyring;
    bool repair;
    FILE *out;
    kiln_store_report_t *rep;
} s_check_t;

static void s_report (s_check_t *c, const char *path, const char *fmt, ...)
    __attribute__ ((format (printf, 3, 4)));

static void
s_report (s_check_t *c, const char *path, const char *fmt, ...)
{
    if (c->out) {
        va_list ap;
        va_start (ap, fmt);
        fprintf (c->out, "%s: ", path);
        vfprintf (c->out, fmt, ap);
        fprintf (c->out, "%s\n", c->repair ? " (removed)" : "");
        va_end (ap);
    }
    if (c->repair && unlink (path) == 0)
        c->rep->removed++;
}

static int
s_check_blob (s_check_t *c, const char *path, const char *hex)
{
    c->rep->blobs++;
    char got[KILN_HEX_LEN];
    kiln_err_t err = { 0 };
    if (kiln_sha256_file_hex (path, got, &err) != 0) {
        c->rep->bad++;
        s_report (c, path, "unreadable blob: %s", err.msg);
        return 0;
    }
    if (strcmp (got, hex) != 0) {
        c->rep->bad++;
        s_report (c, path, "blob hashes to %s", got);
    }
    return 0;
}

static int
s_check_artifact (s_check_t *c, const char *path, const char *hex)
{
    c->rep->artifacts++;
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_artifact_read (path, &err);
    char actual[KILN_HEX_LEN] = "";
    if (!art || kiln_artifact_digest (art, actual, &err) != 0
        || kiln_artifact_verify (art, c->keyring, &err) != 0) {
        c->rep->bad++;
        s_report (c, path, "damaged artifact: %s", err.msg);
    }
    else if (strcmp (actual, hex) != 0) {
        c->rep->bad++;
        s_report (c, path, "artifact has content hash %s", actual);
    }
    kiln_artifact_destroy (&art);
    return 0;
}

static void
s_check_fanout (s_check_t *c, const char *kind_dir, int (*fn) (s_check_t *, const char *,
                                                              const char *))
{
    char dir[PATH_MAX];
    snprintf (dir, sizeof dir, "%s/%s", c->root, kind_dir);
    DIR *d = opendir (dir);
    if (!d)
        return;
    struct dirent *de;
    while ((de = readdir (d))) {
        if (de->d_name[0] == '.')
            continue;
        char sub[PATH_MAX];
        if (snprintf (sub, sizeof sub, "%s/%s", dir, de->d_name) >= (int) sizeof sub)
            continue;
        DIR *s = opendir (sub);
        if (!s)
            continue;
        struct dirent *fe;
        while ((fe = readdir (s))) {
            if (fe->d_name[0] == '.')
                continue;
            char path[PATH_MAX];
            if (snprintf (path, sizeof path, "%s/%s", sub, fe->d_name) >= (int) sizeof path)
                continue;
            if (!kiln_is_digest_hex (fe->d_name) || strncmp (fe->d_name, de->d_name, 2) != 0) {
                c->rep->bad++;
                s_report (c, path, "stray file in the store");
                continue;
            }
            fn (c, path, fe->d_name);
        }
        closedir (s);
    }
    closedir (d);
}

/* Call fn on every entry of the flat directory STATE/kind_dir. */
static void
s_check_flat (s_check_t *c, const char *kind_dir, void (*fn) (s_check_t *, const char *,
                                                              const char *))
{
    char dir[PATH_MAX];
    snprintf (dir, sizeof dir, "%s/%s", c->root, kind_dir);
    DIR *d = opendir (dir);
    if (!d)
        return;
    struct dirent *de;
    while ((de = readdir (d))) {
        if (de->d_name[0] == '.')
            continue;
        char path[PATH_MAX];
        if (snprintf (path, sizeof path, "%s/%s", dir, de->d_name) >= (int) sizeof path)
            continue;
        fn (c, path, de->d_name);
    }
    closedir (d);
}

/* STATE/ac/<action key>: names an artifact built for that action. */
static void
s_check_action (s_check_t *c, const char *path, const char *name)
{
    c->rep->actions++;
    uint8_t *text = NULL;
    size_t len = 0;
    kiln_err_t err = { 0 };
    char cas[PATH_MAX];
    bool ok = kiln_is_digest_hex (name)
              && kiln_read_file (path, KILN_HEX_LEN + 8, &text, &len, &err) == 0
              && len == KILN_HEX_LEN && text[KILN_HEX_LEN - 1] == '\n';
    if (ok) {
        text[KILN_HEX_LEN - 1] = '\0';
        ok = kiln_is_digest_hex ((char *) text)
             && snprintf (cas, sizeof cas, "%s/cas/sha256/%.2s/%s", c->root, text,
                          (char *) text) < (int) sizeof cas;
    }
    if (!ok) {
        c->rep->bad++;
        s_report (c, path, "damaged action record");
        free (text);
        return;
    }
    kiln_artifact_t *art = kiln_artifact_read (cas, &err);
    if (!art && err.code == KILN_ENOTFOUND) {
        c->rep->dangling++;
        if (c->repair && unlink (path) == 0)
            c->rep->removed++;
    }
    else if (art && strcmp (kiln_artifact_manifest (art)->action_key, name) != 0) {
        c->rep->bad++;
        s_report (c, path, "names artifact %.12s, built for action %.12s", text,
                  kiln_artifact_manifest (art)->action_key);
    }
    /* a damaged artifact is reported by the artifact pass */
    kiln_artifact_destroy (&art);
    free (text);
}

/* STATE/fail/<action key>: a JSON record with the code and message. */
static void
s_check_failure (s_check_t *c, const char *path, const char *name)
{
    c->rep->failures++;
    json_error_t jerr;
    json_t *obj = kiln_is_digest_hex (name) ? json_load_file (path, 0, &jerr) : NULL;
    json_int_t code = 0;
    const char *m = NULL;
    if (!obj || json_unpack (obj, "{s:I, s:s}", "code", &code, "message", &m) != 0) {
        c->rep->bad++;
        s_report (c, path, "damaged failure record");
    }
    json_decref (obj);
}

int
kiln_store_check (const char *state_dir, bool repair, FILE *out,
                  kiln_store_report_t *report, kiln_err_t *err)
{
    memset (report, 0, sizeof *report);
    char keyring[PATH_MAX];
    if (snprintf (keyring, sizeof keyring, "%s/keyring", state_dir) >= (int) sizeof keyring)
        return kiln_error (err, KILN_ELIMIT, "state directory path too long");
    if (!kiln_file_exists (keyring))
        return kiln_error (err, KILN_ENOTFOUND, "'%s' holds no broker state (no keyring/)",
                           state_dir);
    s_check_t c = { state_dir, keyring, repair, out, report };
    s_check_fanout (&c, "blobs/sha256", s_check_blob);
    s_check_fanout (&c, "cas/sha256", s_check_artifact);
    s_check_flat (&c, "ac", s_check_action);
    s_check_flat (&c, "fail", s_check_failure);
    if (report->bad)
        return kiln_error (err, KILN_EVERIFY, "%llu damaged entr%s in '%s'",
                           (unsigned long long) report->bad, report->bad == 1 ? "y" : "ies",
                           state_dir);
    return 0;
}
