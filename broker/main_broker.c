/* kiln-broker --listen ENDPOINT --state DIR --key FARMKEY.pem [options] */
#include <getopt.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kiln_fs.h"
#include "broker/kiln_broker.h"
#include "broker/kiln_store.h"
#include "common/kiln_log.h"
#include "common/kiln_proto.h"

static const char *s_usage =
    "usage: kiln-broker --listen ENDPOINT --state DIR --key FARMKEY.pem [options]\n"
    "       kiln-broker --check-store --state DIR [--repair]\n"
    "  The farm's broker: takes COMPILE requests from clients, answers from its\n"
    "  action cache or hands the job to a worker, signs what workers build.\n"
    "options:\n"
    "  --listen ENDPOINT        where clients and workers connect: tcp://127.0.0.1:PORT\n"
    "                           (loopback or ipc:// only, unless --cert and --trust)\n"
    "  --state DIR              artifact and blob store, action and failure cache\n"
    "  --key FARMKEY.pem        the farm's Ed25519 private key (kiln keygen)\n"
    "  --name NAME              the broker's name in provenance (default: host name)\n"
    "  --cert FILE              CurveZMQ: the broker's certificate (kiln cert; FILE_secret\n"
    "                           holds the secret part)\n"
    "  --trust DIR              CurveZMQ: certificates of the clients and workers allowed\n"
    "                           (role and name come from each certificate)\n"
    "  --store-max-bytes N[KMG] cap on the store; least recently used entries go first\n"
    "                           (default 64G)\n"
    "  --timeout SECONDS        compile timeout for requests that give none (default 600)\n"
    "  --heartbeat-ms MS        heartbeat interval (default 1000)\n"
    "  --liveness-ms MS         drop a worker or client silent this long (default 5000)\n"
    "  --max-deaths N           fail a job after N workers died running it (default 3)\n"
    "  --credit-window N        upload chunks (1 MiB) in flight per client (default 32)\n"
    "  --metrics HOST:PORT      serve Prometheus metrics at http://HOST:PORT/metrics\n"
    "                           (docs/operations.md, \"Metrics\"; port 0 picks one)\n"
    "  --check-store            check every entry of the store at --state and exit:\n"
    "                           0 when nothing is damaged (run it with the broker stopped)\n"
    "  --repair                 with --check-store: remove damaged entries\n"
    "  -v, --verbose            log more (twice: debug)\n"
    "  --protocol-doc           print the protocol tables of docs/protocol.md\n";

int
main (int argc, char **argv)
{
    kiln_broker_config_t cfg;
    memset (&cfg, 0, sizeof cfg);
    int verbose = 0, check = 0, repair = 0;
    enum { OPT_LISTEN = 256, OPT_STATE, OPT_KEY, OPT_NAME, OPT_DOC, OPT_CERT, OPT_TRUST,
           OPT_STORE_MAX, OPT_TIMEOUT, OPT_HEARTBEAT, OPT_LIVENESS, OPT_DEATHS, OPT_WINDOW,
           OPT_CHECK, OPT_REPAIR, OPT_METRICS };
    static const struct option opts[] = {
        { "listen", required_argument, NULL, OPT_LISTEN },
        { "state", required_argument, NULL, OPT_STATE },
        { "key", required_argument, NULL, OPT_KEY },
        { "name", required_argument, NULL, OPT_NAME },
        { "cert", required_argument, NULL, OPT_CERT },
        { "trust", required_argument, NULL, OPT_TRUST },
        { "store-max-bytes", required_argument, NULL, OPT_STORE_MAX },
        { "timeout", required_argument, NULL, OPT_TIMEOUT },
        { "heartbeat-ms", required_argument, NULL, OPT_HEARTBEAT },
        { "liveness-ms", required_argument, NULL, OPT_LIVENESS },
        { "max-deaths", required_argument, NULL, OPT_DEATHS },
        { "credit-window", required_argument, NULL, OPT_WINDOW },
        { "check-store", no_argument, NULL, OPT_CHECK },
        { "metrics", required_argument, NULL, OPT_METRICS },
        { "repair", no_argument, NULL, OPT_REPAIR },
        { "verbose", no_argument, NULL, 'v' },
        { "protocol-doc", no_argument, NULL, OPT_DOC },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    long long v;
    while ((c = getopt_long (argc, argv, "vh", opts, NULL)) != -1) {
        switch (c) {
        case OPT_LISTEN: cfg.endpoint = optarg; break;
        case OPT_STATE: cfg.state_dir = optarg; break;
        case OPT_KEY: cfg.key_path = optarg; break;
        case OPT_NAME: cfg.name = optarg; break;
        case OPT_CERT: cfg.cert_path = optarg; break;
        case OPT_TRUST: cfg.trust_dir = optarg; break;
        case OPT_METRICS: cfg.metrics_listen = optarg; break;
        case OPT_CHECK: check = 1; break;
        case OPT_REPAIR: repair = 1; break;
        case OPT_STORE_MAX:
            if ((v = kiln_parse_number (optarg, 1 << 20, 1LL << 50)) < 0)
                goto bad_number;
            cfg.store_max_bytes = (uint64_t) v;
            break;
        case OPT_TIMEOUT:
            if ((v = kiln_parse_number (optarg, 1, 7 * 24 * 3600)) < 0)
                goto bad_number;
            cfg.default_timeout_ms = (uint64_t) v * 1000;
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
        case OPT_DEATHS:
            if ((v = kiln_parse_number (optarg, 1, 100)) < 0)
                goto bad_number;
            cfg.max_deaths = (int) v;
            break;
        case OPT_WINDOW:
            if ((v = kiln_parse_number (optarg, 1, KILN_PROTO_MAX_CREDIT)) < 0)
                goto bad_number;
            cfg.credit_window = (int) v;
            break;
        case 'v': verbose++; break;
        case OPT_DOC: kiln_proto_write_doc (stdout); return 0;
        case 'h': fputs (s_usage, stdout); return 0;
        default: fputs (s_usage, stderr); return 2;
        }
        continue;
bad_number:
        fprintf (stderr, "kiln-broker: '%s' is not a valid number for this option\n%s",
                 optarg, s_usage);
        return 2;
    }
    kiln_log_init (argv[0], verbose >= 2 ? LOG_DEBUG : verbose ? LOG_INFO : LOG_NOTICE);
    kiln_err_t err = { 0 };
    if (check) {
        if (optind != argc || !cfg.state_dir) {
            fprintf (stderr, "kiln-broker: --check-store needs --state DIR\n%s", s_usage);
            return 2;
        }
        kiln_store_report_t rep;
        int rc = kiln_store_check (cfg.state_dir, repair, stdout, &rep, &err);
        printf ("store %s: %llu artifacts, %llu blobs, %llu action records (%llu dangling), "
                "%llu failure records; %llu damaged%s\n", cfg.state_dir,
                (unsigned long long) rep.artifacts, (unsigned long long) rep.blobs,
                (unsigned long long) rep.actions, (unsigned long long) rep.dangling,
                (unsigned long long) rep.failures, (unsigned long long) rep.bad,
                repair ? ", repaired" : "");
        if (rc != 0 && !rep.bad)
            fprintf (stderr, "kiln-broker: %s\n", err.msg);
        return rc == 0 ? 0 : 1;
    }
    if (optind != argc || !cfg.endpoint || !cfg.state_dir || !cfg.key_path) {
        fprintf (stderr, "kiln-broker: %s\n%s", optind != argc ? "unexpected argument"
                 : "--listen, --state and --key are required", s_usage);
        return 2;
    }
    /* Upload chunks arrive as 1 MiB messages.  Above glibc's mmap
     * threshold each would be a fresh mapping, zeroed page by page by the
     * kernel and unmapped again; kept on the heap, the same few buffers
     * serve the whole upload. */
    mallopt (M_MMAP_THRESHOLD, 8 << 20);
    mallopt (M_TRIM_THRESHOLD, 64 << 20);
    kiln_broker_t *broker = kiln_broker_new (&cfg, &err);
    if (!broker) {
        kiln_log_err ("%s", err.msg);
        return 1;
    }
    if (cfg.metrics_listen)
        kiln_log_notice ("metrics at http://%s/metrics (port %d)", cfg.metrics_listen,
                         kiln_broker_metrics_port (broker));
    int rc = kiln_broker_run (broker);
    kiln_broker_destroy (&broker);
    return rc == 0 ? 0 : 1;
}
