/*
 * kiln_cmds — the `kiln` CLI's subcommands, one file each (cmd_*.c),
 * dispatched from the table in main_kiln.c.  Each returns the process
 * exit status, one of KILN_EXIT_* (message already printed).  The
 * numbers are published (docs/ci.md, `kiln --help`): they never change.
 */
#ifndef KILN_CMDS_H
#define KILN_CMDS_H

#include <getopt.h>
#include <stdbool.h>

#include "client/kiln_client.h"
#include "common/kiln_error.h"
#include "common/kiln_hash.h"
#include "graph/kiln_graph.h"

/* Exit statuses of every kiln command: number, name, meaning. */
#define KILN_EXITS(X)                                                                   \
    X (0, OK,          "success")                                                       \
    X (1, FAIL,        "failed: a compile error, a file that cannot be read, a refusal") \
    X (2, USAGE,       "usage error: unknown command or option, missing argument")      \
    X (3, UNREACHABLE, "the farm could not be reached (no answer, handshake refused)")   \
    X (4, JOBS,        "kiln batch: some jobs failed (the others succeeded)")           \
    X (5, VERIFY,      "verification failed: signature, key, digest, fingerprint")

enum {
#define KILN_EXIT_ENUM(num, name, text) KILN_EXIT_##name = num,
    KILN_EXITS (KILN_EXIT_ENUM)
#undef KILN_EXIT_ENUM
};

/* The exit status for a library error code: EUNREACHABLE is 3, EVERIFY
 * 5, anything else 1. */
int kiln_cmd_exit_status (int code);

int cmd_import (int argc, char **argv);
int cmd_compile (int argc, char **argv);
int cmd_verify (int argc, char **argv);
int cmd_keygen (int argc, char **argv);
int cmd_inspect (int argc, char **argv);
int cmd_status (int argc, char **argv);
int cmd_batch (int argc, char **argv);
int cmd_cert (int argc, char **argv);
int cmd_release (int argc, char **argv);
int cmd_get (int argc, char **argv);
int cmd_pin (int argc, char **argv);
int cmd_unpin (int argc, char **argv);
int cmd_trust (int argc, char **argv);

/* Print "kiln <cmd>: <message>" to stderr; returns
 * kiln_cmd_exit_status (err->code). */
int kiln_cmd_fail (const char *cmd, const kiln_err_t *err);
/* Print a usage error and the usage string; returns 2. */
int kiln_cmd_usage (const char *usage, const char *fmt, ...)
    __attribute__ ((format (printf, 2, 3)));

/* The options of the commands that talk to the farm (get, pin, unpin,
 * status, trust): --broker EP, --cert FILE, --broker-cert FILE,
 * --wait SECONDS, --json, -h/--help. */
typedef struct {
    const char *broker;         /* --broker, else $KILN_BROKER; NULL when neither */
    kiln_client_config_t ccfg;  /* .cert and .broker_cert from --cert, --broker-cert */
    long wait_s;                /* --wait; holds the command's default until given */
    long wait_max_s;            /* --wait's bound, the command's (1..wait_max_s) */
    bool json;                  /* --json */
} kiln_farm_opts_t;

/* A command's own options, parsed beside the farm's: `options` ends with
 * a zeroed entry (at most 10; their values letters or 512 and up, clear
 * of the farm options' 256..260), `shorts` their getopt letters.
 * `on_option` gets each one found (`arg` NULL without an argument) and
 * returns -1 to go on, or an exit status to stop with (having printed
 * why). */
typedef struct {
    const struct option *options;
    const char *shorts;
    int (*on_option) (int opt, const char *arg, void *ctx);
    void *ctx;
} kiln_cmd_own_opts_t;

/* Parse argv's options: the farm's into `fo` (whose wait_s and
 * wait_max_s the caller sets first), the command's own (`own`, may be
 * NULL) through its callback.  Returns -1 when all went through (optind
 * is then the first operand), else the exit status to return: 0 after
 * --help (usage printed to stdout), 2 after a usage error (printed with
 * `usage`), or what on_option returned. */
int kiln_cmd_farm_opts (int argc, char **argv, const char *usage, const kiln_cmd_own_opts_t *own,
                        kiln_farm_opts_t *fo);

/* Load a model: .onnx files through the ONNX importer, anything else as a
 * .kgraph.  External-data weights whose files did not change since an
 * earlier import take their digests from the user's import cache
 * (kiln_statcache_default) instead of being hashed again.  Caller owns
 * the graph. */
kiln_graph_t *kiln_cmd_load_model (const char *path, kiln_err_t *err);
/* The same, saying how many weight ranges the import cache knew (*hits)
 * and had to hash (*misses); both NULL or both set. */
kiln_graph_t *kiln_cmd_load_model_counted (const char *path, uint64_t *hits,
                                           uint64_t *misses, kiln_err_t *err);

/* An artifact's content hash from the command line: 64 hex characters,
 * either case, written lower-case into `out`.  -1 when `arg` is not one. */
int kiln_cmd_digest_arg (const char *arg, char out[KILN_HEX_LEN]);

/* Write `s` as a JSON string literal (quoted, escaped) to stdout. */
void kiln_cmd_json_str (const char *s);

#endif
