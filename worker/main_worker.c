/* kiln-worker --broker ENDPOINT [--name NAME] [--slots N] [--toolchain NAME=CMD]... */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kiln_fs.h"
#include "common/kiln_log.h"
#include "worker/kiln_sandbox.h"
#include "worker/kiln_toolchain.h"
#include "worker/kiln_worker.h"

static const char *s_usage =
    "usage: kiln-worker --broker ENDPOINT [options]\n"
    "  A farm worker: takes jobs from the broker and runs a toolchain on them\n"
    "  in child processes.\n"
    "options:\n"
    "  --broker tcp://HOST:PORT      the broker to serve\n"
    "  --name NAME                   name in logs, status and provenance (default:\n"
    "                                host:pid; with --cert the certificate's name wins)\n"
    "  --slots N                     jobs to run at once (default 1, at most 256)\n"
    "  --timeout SECONDS             longest compile this worker runs (default 600)\n"
    "  --toolchain NAME[@VER]=CMD    also run an external toolchain: CMD with {input},\n"
    "                                {output}, {workdir} and {args} replaced (see\n"
    "                                docs/operations.md); repeatable\n"
    "  --target TARGET               the target of the external toolchains (default:\n"
    "                                the builtin compiler's, e.g. cpu-x86_64)\n"
    "  --no-builtin                  do not offer the builtin compiler\n"
    "  --cc PATH                     the builtin compiler program (default: kiln-cc next\n"
    "                                to kiln-worker)\n"
    "  --cache DIR                   keep weight blobs here between jobs and restarts\n"
    "                                (default: a private directory removed at exit)\n"
    "  --cache-max-bytes N[KMG]      cap on the blob cache (default 16G)\n"
    "  --sandbox bwrap|none          run each compile in a bubblewrap sandbox (default:\n"
    "                                bwrap; the worker refuses to start when it does not\n"
    "                                work) or, with none, as a plain child process\n"
    "  --max-memory N[KMG]           address space of one compile (default: 3/4 of the\n"
    "                                RAM divided by --slots, at least 1G)\n"
    "  --max-procs N                 processes and threads of one compile (default 512;\n"
    "                                bwrap only)\n"
    "  --sandbox-uid UID             as root: compiles run as uid/gid UID + slot (default\n"
    "                                65536; give each worker on a host its own range)\n"
    "  --cert FILE                   CurveZMQ: this worker's certificate (kiln cert)\n"
    "  --broker-cert FILE            CurveZMQ: the broker's public certificate\n"
    "  --heartbeat-ms MS             heartbeat interval (default 1000)\n"
    "  --liveness-ms MS              reconnect when the broker is silent this long\n"
    "                                (default 5000)\n"
    "  -v, --verbose                 log more (twice: debug)\n";

int
main (int argc, char **argv)
{
    /* The job wrapper for external toolchains (see kiln_toolchain.h). */
    if (argc > 1 && strcmp (argv[1], "--wrap") == 0)
        return kiln_toolchain_wrap_main (argc, argv);
    /* The first process of a job inside the sandbox (kiln_sandbox.h). */
    if (argc > 1 && strcmp (argv[1], "--sandbox-exec") == 0)
        return kiln_sandbox_exec_main (argc, argv);

    kiln_worker_config_t cfg;
    memset (&cfg, 0, sizeof cfg);
    int verbose = 0;
    enum { OPT_BROKER = 256, OPT_NAME, OPT_SLOTS, OPT_TIMEOUT, OPT_CC, OPT_TOOLCHAIN,
           OPT_TARGET, OPT_NO_BUILTIN, OPT_CACHE, OPT_CACHE_MAX, OPT_CERT, OPT_BROKER_CERT,
           OPT_HEARTBEAT, OPT_LIVENESS, OPT_SANDBOX, OPT_MAX_MEMORY, OPT_MAX_PROCS,
           OPT_SANDBOX_UID };
    static const struct option opts[] = {
        { "broker", required_argument, NULL, OPT_BROKER },
        { "name", required_argument, NULL, OPT_NAME },
        { "slots", required_argument, NULL, OPT_SLOTS },
        { "timeout", required_argument, NULL, OPT_TIMEOUT },
        { "cc", required_argument, NULL, OPT_CC },
        { "toolchain", required_argument, NULL, OPT_TOOLCHAIN },
        { "target", required_argument, NULL, OPT_TARGET },
        { "no-builtin", no_argument, NULL, OPT_NO_BUILTIN },
        { "cache", required_argument, NULL, OPT_CACHE },
        { "cache-max-bytes", required_argument, NULL, OPT_CACHE_MAX },
        { "cert", required_argument, NULL, OPT_CERT },
        { "broker-cert", required_argument, NULL, OPT_BROKER_CERT },
        { "heartbeat-ms", required_argument, NULL, OPT_HEARTBEAT },
        { "liveness-ms", required_argument, NULL, OPT_LIVENESS },
        { "sandbox", required_argument, NULL, OPT_SANDBOX },
        { "max-memory", required_argument, NULL, OPT_MAX_MEMORY },
        { "max-procs", required_argument, NULL, OPT_MAX_PROCS },
        { "sandbox-uid", required_argument, NULL, OPT_SANDBOX_UID },
        { "verbose", no_argument, NULL, 'v' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    long long v;
    while ((c = getopt_long (argc, argv, "vh", opts, NULL)) != -1) {
        switch (c) {
        case OPT_BROKER: cfg.endpoint = optarg; break;
        case OPT_NAME: cfg.name = optarg; break;
        case OPT_CC: cfg.cc_path = optarg; break;
        case OPT_TARGET: cfg.target = optarg; break;
        case OPT_NO_BUILTIN: cfg.no_builtin = 1; break;
        case OPT_CACHE: cfg.cache_dir = optarg; break;
        case OPT_CERT: cfg.cert_path = optarg; break;
        case OPT_BROKER_CERT: cfg.broker_cert = optarg; break;
        case OPT_TOOLCHAIN:
            if (cfg.n_toolchains >= KILN_WORKER_MAX_TOOLCHAINS) {
                fprintf (stderr, "kiln-worker: at most %d --toolchain options\n",
                         KILN_WORKER_MAX_TOOLCHAINS);
                return 2;
            }
            cfg.toolchains[cfg.n_toolchains++] = optarg;
            break;
        case OPT_SLOTS:
            if ((v = kiln_parse_number (optarg, 1, 256)) < 0)
                goto bad_number;
            cfg.slots = (int) v;
            break;
        case OPT_TIMEOUT:
            if ((v = kiln_parse_number (optarg, 1, 7 * 24 * 3600)) < 0)
                goto bad_number;
            cfg.timeout_s = (int) v;
            break;
        case OPT_CACHE_MAX:
            if ((v = kiln_parse_number (optarg, 1 << 20, 1LL << 50)) < 0)
                goto bad_number;
            cfg.cache_max_bytes = (uint64_t) v;
            break;
        case OPT_HEARTBEAT:
            if ((v = kiln_parse_number (optarg, 10, 60000)) < 0)
                goto bad_number;
            cfg.heartbeat_ms = (int) v;
            break;
        case OPT_LIVENESS:
            if ((v = kiln_parse_number (optarg, 100, 3600000)) < 0)
                goto bad_number;
            cfg.liveness_ms = (int) v;
            break;
        case OPT_SANDBOX:
            if (strcmp (optarg, "bwrap") == 0)
                cfg.sandbox = KILN_SANDBOX_BWRAP;
            else if (strcmp (optarg, "none") == 0)
                cfg.sandbox = KILN_SANDBOX_NONE;
            else {
                fprintf (stderr, "kiln-worker: --sandbox is 'bwrap' or 'none', not '%s'\n%s",
                         optarg, s_usage);
                return 2;
            }
            break;
        case OPT_MAX_MEMORY:
            if ((v = kiln_parse_number (optarg, KILN_SANDBOX_MIN_MEMORY, 1LL << 50)) < 0)
                goto bad_number;
            cfg.max_memory = (uint64_t) v;
            break;
        case OPT_MAX_PROCS:
            if ((v = kiln_parse_number (optarg, 8, KILN_SANDBOX_MAX_PROCS)) < 0)
                goto bad_number;
            cfg.max_procs = (int) v;
            break;
        case OPT_SANDBOX_UID:
            if ((v = kiln_parse_number (optarg, 1, 0x7fff0000LL)) < 0)
                goto bad_number;
            cfg.sandbox_uid = (unsigned) v;
            break;
        case 'v': verbose++; break;
        case 'h': fputs (s_usage, stdout); return 0;
        default: fputs (s_usage, stderr); return 2;
        }
        continue;
bad_number:
        fprintf (stderr, "kiln-worker: '%s' is not a valid number for this option\n%s",
                 optarg, s_usage);
        return 2;
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
