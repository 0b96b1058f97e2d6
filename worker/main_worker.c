/* kiln-worker --broker tcp://127.0.0.1:PORT [--name NAME] [--slots N] [-v] */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kiln_log.h"
#include "worker/kiln_worker.h"

static const char *s_usage =
    "usage: kiln-worker --broker ENDPOINT [options]\n"
    "  A farm worker: takes jobs from the broker and runs the compiler on them\n"
    "  in child processes.\n"
    "options:\n"
    "  --broker tcp://HOST:PORT   the broker to serve\n"
    "  --name NAME                name in logs and provenance (default: host:pid)\n"
    "  --slots N                  jobs to run at once (default 1, at most 256)\n"
    "  --timeout SECONDS          kill a compile that runs longer (default 600)\n"
    "  --cc PATH                  the compiler program (default: kiln-cc next to\n"
    "                             kiln-worker)\n"
    "  -v, --verbose              log more (twice: debug)\n";

/* A whole number in [lo, hi], or -1. */
static long
s_number (const char *text, long lo, long hi)
{
    char *end;
    long v = strtol (text, &end, 10);
    return (*text && !*end && v >= lo && v <= hi) ? v : -1;
}

int
main (int argc, char **argv)
{
    kiln_worker_config_t cfg;
    memset (&cfg, 0, sizeof cfg);
    int verbose = 0;
    enum { OPT_BROKER = 256, OPT_NAME, OPT_SLOTS, OPT_TIMEOUT, OPT_CC };
    static const struct option opts[] = {
        { "broker", required_argument, NULL, OPT_BROKER },
        { "name", required_argument, NULL, OPT_NAME },
        { "slots", required_argument, NULL, OPT_SLOTS },
        { "timeout", required_argument, NULL, OPT_TIMEOUT },
        { "cc", required_argument, NULL, OPT_CC },
        { "verbose", no_argument, NULL, 'v' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    while ((c = getopt_long (argc, argv, "vh", opts, NULL)) != -1) {
        switch (c) {
        case OPT_BROKER: cfg.endpoint = optarg; break;
        case OPT_NAME: cfg.name = optarg; break;
        case OPT_CC: cfg.cc_path = optarg; break;
        case OPT_SLOTS:
            if ((cfg.slots = (int) s_number (optarg, 1, 256)) < 0) {
                fprintf (stderr, "kiln-worker: --slots wants 1..256, got '%s'\n", optarg);
                return 2;
            }
            break;
        case OPT_TIMEOUT:
            if ((cfg.timeout_s = (int) s_number (optarg, 1, 7 * 24 * 3600)) < 0) {
                fprintf (stderr, "kiln-worker: --timeout wants whole seconds, got '%s'\n",
                         optarg);
                return 2;
            }
            break;
        case 'v': verbose++; break;
        case 'h': fputs (s_usage, stdout); return 0;
        default: fputs (s_usage, stderr); return 2;
        }
    }
    if (optind != argc || !cfg.endpoint) {
        fprintf (stderr, "kiln-worker: %s\n%s", optind != argc ? "unexpected argument"
                 : "--broker is required", s_usage);
        return 2;
    }
    kiln_log_init (argv[0], verbose >= 2 ? LOG_DEBUG : verbose ? LOG_INFO : LOG_NOTICE);

    kiln_err_t err = { 0 };
    kiln_worker_t *worker = kiln_worker_new (&cfg, &err);
    if (!worker) {
        kiln_log_err ("%s", err.msg);
        return 1;
    }
    int rc = kiln_worker_run (worker);
    kiln_worker_destroy (&worker);
    return rc == 0 ? 0 : 1;
}
