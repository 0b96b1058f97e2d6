/*
 * kiln — the command line of the build farm.  Each subcommand lives in
 * its own cmd_*.c file and is dispatched from the table below.
 */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "client/kiln_cmds.h"
#include "common/kiln_log.h"
#include "graph/kiln_onnx.h"

static const struct {
    const char *name;
    int (*fn) (int argc, char **argv);
    const char *summary;
} s_commands[] = {
    { "compile", cmd_compile, "compile a model (.onnx or .kgraph) into a signed artifact" },
    { "import",  cmd_import,  "import an ONNX model into a kiln graph (.kgraph)" },
    { "verify",  cmd_verify,  "check an artifact's signature and members against a keyring" },
    { "inspect", cmd_inspect, "show an artifact's manifest or a graph's interface" },
    { "keygen",  cmd_keygen,  "write a new Ed25519 key pair" },
    { "batch",   cmd_batch,   "compile many models on the farm at once" },
    { "status",  cmd_status,  "show the farm: workers, queues, cache, jobs" },
    { "cert",    cmd_cert,    "write a CurveZMQ certificate for a farm client, worker or broker" },
    { "release", cmd_release, "sign a release record (model, artifact, seq, expiry) or verify one" },
    { "get",     cmd_get,     "fetch an artifact from the farm's store by its content hash" },
    { "pin",     cmd_pin,     "keep an artifact in the farm's store: never evicted" },
    { "unpin",   cmd_unpin,   "let the farm's store evict an artifact again" },
    { "trust",   cmd_trust,   "pin the key a farm signs with in your keyring (shows its fingerprint)" },
};

static void
s_usage (FILE *out)
{
    fprintf (out, "usage: kiln <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof s_commands / sizeof s_commands[0]; i++)
        fprintf (out, "  %-9s %s\n", s_commands[i].name, s_commands[i].summary);
    fprintf (out, "\n'kiln <command> -h' shows a command's options.\n"
                  "KILN_BROKER=tcp://HOST:PORT makes `kiln compile` use a farm.\n"
                  "\nexit status (every command; docs/ci.md):\n");
#define S_EXIT_LINE(num, name, text) fprintf (out, "  %d  %s\n", num, text);
    KILN_EXITS (S_EXIT_LINE)
#undef S_EXIT_LINE
}

int
kiln_cmd_exit_status (int code)
{
    return code == KILN_EUNREACHABLE ? KILN_EXIT_UNREACHABLE
         : code == KILN_EVERIFY      ? KILN_EXIT_VERIFY
                                     : KILN_EXIT_FAIL;
}

int
kiln_cmd_fail (const char *cmd, const kiln_err_t *err)
{
    char prefix[64];
    snprintf (prefix, sizeof prefix, "kiln %s", cmd);
    kiln_print_error (prefix, err->msg[0] ? err->msg : kiln_strerror (err->code));
    return kiln_cmd_exit_status (err->code);
}

int
kiln_cmd_usage (const char *usage, const char *fmt, ...)
{
    if (fmt) {
        va_list ap;
        va_start (ap, fmt);
        fprintf (stderr, "kiln: ");
        vfprintf (stderr, fmt, ap);
        fprintf (stderr, "\n");
        va_end (ap);
    }
    fprintf (stderr, "%s", usage);
    return KILN_EXIT_USAGE;
}

kiln_graph_t *
kiln_cmd_load_model (const char *path, kiln_err_t *err)
{
    return kiln_cmd_load_model_counted (path, NULL, NULL, err);
}

kiln_graph_t *
kiln_cmd_load_model_counted (const char *path, uint64_t *hits, uint64_t *misses,
                             kiln_err_t *err)
{
    size_t n = strlen (path);
    if (!(n > 5 && strcmp (path + n - 5, ".onnx") == 0)) {
        if (hits)
            *hits = *misses = 0;
        return kiln_graph_load (path, err);
    }
    /* Weight files not changed since an earlier import are not hashed
     * again (common/kiln_statcache.h). */
    kiln_statcache_t *cache = kiln_statcache_default ();
    kiln_graph_t *g = kiln_onnx_import_cached (path, cache, err);
    if (g)
        kiln_statcache_save (cache);
    if (hits)
        kiln_statcache_counts (cache, hits, misses);
    kiln_statcache_destroy (&cache);
    return g;
}

int
kiln_cmd_digest_arg (const char *arg, char out[KILN_HEX_LEN])
{
    if (!arg || strlen (arg) != KILN_HEX_LEN - 1)
        return -1;
    for (size_t i = 0; i < KILN_HEX_LEN - 1; i++) {
        if (!isxdigit ((unsigned char) arg[i]))
            return -1;
        out[i] = (char) tolower ((unsigned char) arg[i]);
    }
    out[KILN_HEX_LEN - 1] = '\0';
    return 0;
}

void
kiln_cmd_json_str (const char *s)
{
    json_t *str = json_string (s ? s : "");
    char *text = str ? json_dumps (str, JSON_ENCODE_ANY) : NULL;
    fputs (text ? text : "\"\"", stdout);
    free (text);
    json_decref (str);
}

/* Edit distance between two short words (insert, delete, substitute,
 * and swap of neighbours, as git's "did you mean" counts them); words
 * longer than 31 bytes count as far from everything. */
static int
s_distance (const char *a, const char *b)
{
    size_t n = strlen (a), m = strlen (b);
    if (n > 31 || m > 31)
        return 99;
    int d[32][32];
    for (size_t i = 0; i <= n; i++)
        d[i][0] = (int) i;
    for (size_t j = 0; j <= m; j++)
        d[0][j] = (int) j;
    for (size_t i = 1; i <= n; i++)
        for (size_t j = 1; j <= m; j++) {
            int best = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
            if (d[i - 1][j] + 1 < best)
                best = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < best)
                best = d[i][j - 1] + 1;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]
                && d[i - 2][j - 2] + 1 < best)
                best = d[i - 2][j - 2] + 1;
            d[i][j] = best;
        }
    return d[n][m];
}

/* The command nearest to `word`, or NULL when none is near: within two
 * edits (one for words of up to four letters), or the only command that
 * starts with it. */
static const char *
s_suggest (const char *word)
{
    const char *best = NULL, *prefixed = NULL;
    int best_d = strlen (word) <= 4 ? 2 : 3, n_prefixed = 0;
    for (size_t i = 0; i < sizeof s_commands / sizeof s_commands[0]; i++) {
        int d = s_distance (word, s_commands[i].name);
        if (d < best_d) {
            best_d = d;
            best = s_commands[i].name;
        }
        if (*word && strncmp (s_commands[i].name, word, strlen (word)) == 0) {
            prefixed = s_commands[i].name;
            n_prefixed++;
        }
    }
    return best ? best : n_prefixed == 1 ? prefixed : NULL;
}

int
main (int argc, char **argv)
{
    kiln_log_init ("kiln", LOG_NOTICE);
    if (argc < 2) {
        s_usage (stderr);
        return KILN_EXIT_USAGE;
    }
    if (strcmp (argv[1], "-h") == 0 || strcmp (argv[1], "--help") == 0
        || strcmp (argv[1], "help") == 0) {
        s_usage (stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof s_commands / sizeof s_commands[0]; i++)
        if (strcmp (argv[1], s_commands[i].name) == 0)
            return s_commands[i].fn (argc - 1, argv + 1);
    const char *near = s_suggest (argv[1]);
    if (near) {
        fprintf (stderr, "kiln: '%s' is not a kiln command; did you mean '%s'?\n"
                 "(kiln --help lists the commands)\n", argv[1], near);
        return KILN_EXIT_USAGE;
    }
    fprintf (stderr, "kiln: '%s' is not a kiln command\n", argv[1]);
    s_usage (stderr);
    return KILN_EXIT_USAGE;
}
