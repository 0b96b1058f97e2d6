/*
 * kiln-cc — compile a kiln graph into an artifact with the builtin
 * compiler, locally.  Farm workers run it with --unsigned (the broker
 * signs); a developer runs it with --key.
 */
#include <stdarg.h>
#include <stdbool.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_fs.h"
#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"
#include "common/kiln_log.h"

static const char s_usage[] =
    "usage: kiln-cc MODEL.kgraph -o OUT.kar (--key KEY.pem | --unsigned)\n"
    "               [--compiler-args \"ARGS\"] [--json]\n"
    "\n"
    "Compile MODEL.kgraph with the builtin compiler and write the artifact\n"
    "OUT.kar; print its content hash (or, with --json, an object with the\n"
    "artifact, action_key, graph_digest, arena_bytes and naive_bytes).\n"
    "\n"
    "  -o OUT.kar               where to write the artifact\n"
    "  --key KEY.pem            sign with this Ed25519 private key\n"
    "  --unsigned               write an unsigned artifact (the broker signs)\n"
    "  --compiler-args \"ARGS\"   e.g. \"--optlevel 1\" (0..3, default 2)\n"
    "  --json                   print a JSON object instead of the hash\n"
    "  -h, --help               show this help\n";

__attribute__ ((format (printf, 1, 2))) static int
s_die (const char *fmt, ...)
{
    va_list ap;
    va_start (ap, fmt);
    fprintf (stderr, "kiln-cc: ");
    vfprintf (stderr, fmt, ap);
    fprintf (stderr, "\n");
    va_end (ap);
    return 1;
}

/* Append `s` as a JSON string to out[size]. */
static void
s_json_str (char *out, size_t size, const char *s)
{
    size_t n = strlen (out);
    if (n + 1 < size)
        out[n++] = '"';
    for (; *s && n + 8 < size; s++) {
        unsigned char c = (unsigned char) *s;
        if (c == '"' || c == '\\')
            n += (size_t) snprintf (out + n, size - n, "\\%c", c);
        else if (c < 0x20)
            n += (size_t) snprintf (out + n, size - n, "\\u%04x", c);
        else
            out[n++] = (char) c;
    }
    if (n + 1 < size)
        out[n++] = '"';
    out[n] = '\0';
}

/* Take the value of option `opt` at argv[*i] ("--opt V" or "--opt=V"). */
static const char *
s_value (int argc, char **argv, int *i, const char *opt)
{
    size_t n = strlen (opt);
    if (argv[*i][n] == '=')
        return argv[*i] + n + 1;
    if (*i + 1 >= argc)
        return NULL;
    return argv[++*i];
}

static bool
s_is (const char *arg, const char *opt)
{
    size_t n = strlen (opt);
    return strncmp (arg, opt, n) == 0 && (arg[n] == '\0' || arg[n] == '=');
}

int
main (int argc, char **argv)
{
    const char *model = NULL, *out = NULL, *key_path = NULL, *args = NULL;
    bool unsigned_ = false, json = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp (a, "-h") == 0 || strcmp (a, "--help") == 0) {
            fputs (s_usage, stdout);
            return 0;
        } else if (s_is (a, "-o") || s_is (a, "--output")) {
            if (!(out = s_value (argc, argv, &i, a[1] == 'o' ? "-o" : "--output")))
                return s_die ("%s needs a value", a);
        } else if (s_is (a, "--key")) {
            if (!(key_path = s_value (argc, argv, &i, "--key")))
                return s_die ("%s needs a value", a);
        } else if (s_is (a, "--compiler-args")) {
            if (!(args = s_value (argc, argv, &i, "--compiler-args")))
                return s_die ("%s needs a value", a);
        } else if (strcmp (a, "--unsigned") == 0) {
            unsigned_ = true;
        } else if (strcmp (a, "--json") == 0) {
            json = true;
        } else if (a[0] == '-' && a[1] != '\0') {
            fputs (s_usage, stderr);
            return s_die ("unknown option '%s'", a);
        } else if (!model) {
            model = a;
        } else {
            fputs (s_usage, stderr);
            return s_die ("unexpected argument '%s'", a);
        }
    }
    if (!model || !out) {
        fputs (s_usage, stderr);
        return s_die ("%s", !model ? "no model given" : "no output given (-o)");
    }
    if (!key_path == !unsigned_)
        return s_die ("give exactly one of --key KEY.pem and --unsigned");

    kiln_err_t err = { 0 };
    kiln_key_t *key = NULL;
    kiln_artifact_t *art = NULL;
    kiln_graph_t *g = NULL;
    kiln_cc_stats_t stats = { 0 };
    char digest[KILN_HEX_LEN];
    int status = 1;
    /* Load the key first: a bad key should not cost a compilation. */
    if (key_path && !(key = kiln_key_load_private (key_path, &err)))
        goto done;
    if (!(g = kiln_graph_load (model, &err)))
        goto done;
    /* weights.bin is spilled beside the output and mapped, not built in
     * memory: a model's weights are never whole in this process. */
    char spill[PATH_MAX];
    kiln_dirname (out, spill, sizeof spill);
    if (!(art = kiln_cc_compile_spill (g, args, &stats, spill, &err)))
        goto done;
    if (key) {
        char host[256] = "unknown", prov[600] = "{\"builder\":\"kiln-cc\",\"host\":";
        if (gethostname (host, sizeof host) != 0)
            snprintf (host, sizeof host, "unknown");
        host[sizeof host - 1] = '\0';
        s_json_str (prov, sizeof prov, host);
        strncat (prov, "}", sizeof prov - strlen (prov) - 1);
        if (kiln_artifact_sign (art, key, prov, &err))
            goto done;
    }
    if (kiln_artifact_write (art, out, &err)
        || kiln_artifact_digest (art, digest, &err))
        goto done;
    if (json) {
        const kiln_manifest_t *m = kiln_artifact_manifest (art);
        printf ("{\"artifact\":\"%s\",\"action_key\":\"%s\",\"graph_digest\":"
                "\"%s\",\"arena_bytes\":%llu,\"naive_bytes\":%llu}\n", digest,
                m->action_key, m->graph_digest,
                (unsigned long long) stats.arena_bytes,
                (unsigned long long) stats.naive_bytes);
    } else {
        printf ("%s\n", digest);
    }
    status = 0;
done:
    if (status)
        kiln_print_error ("kiln-cc", err.msg[0] ? err.msg : kiln_strerror (err.code));
    kiln_artifact_destroy (&art);
    kiln_graph_destroy (&g);
    kiln_key_destroy (&key);
    return status;
}
