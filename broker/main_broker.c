/* kiln-broker --listen tcp://127.0.0.1:PORT --state DIR --key FARMKEY.pem [-v] */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker/kiln_broker.h"
#include "common/kiln_log.h"
#include "common/kiln_proto.h"

static const char *s_usage =
    "usage: kiln-broker --listen ENDPOINT --state DIR --key FARMKEY.pem [options]\n"
    "  The farm's broker: takes COMPILE requests from clients, answers from its\n"
    "  action cache or hands the job to a worker, signs what workers build.\n"
    "options:\n"
    "  --listen tcp://127.0.0.1:PORT  where clients and workers connect (loopback\n"
    "                                 or ipc:// only until CurveZMQ is supported)\n"
    "  --state DIR                    artifact store and action cache\n"
    "  --key FARMKEY.pem              the farm's Ed25519 private key (kiln keygen)\n"
    "  --name NAME                    the broker's name in provenance (default: host name)\n"
    "  -v, --verbose                  log more (twice: debug)\n"
    "  --protocol-doc                 print the protocol tables of docs/protocol.md\n";

int
main (int argc, char **argv)
{
    kiln_broker_config_t cfg;
    memset (&cfg, 0, sizeof cfg);
    int verbose = 0;
    enum { OPT_LISTEN = 256, OPT_STATE, OPT_KEY, OPT_NAME, OPT_DOC };
    static const struct option opts[] = {
        { "listen", required_argument, NULL, OPT_LISTEN },
        { "state", required_argument, NULL, OPT_STATE },
        { "key", required_argument, NULL, OPT_KEY },
        { "name", required_argument, NULL, OPT_NAME },
        { "verbose", no_argument, NULL, 'v' },
        { "protocol-doc", no_argument, NULL, OPT_DOC },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    while ((c = getopt_long (argc, argv, "vh", opts, NULL)) != -1) {
        switch (c) {
        case OPT_LISTEN: cfg.endpoint = optarg; break;
        case OPT_STATE: cfg.state_dir = optarg; break;
        case OPT_KEY: cfg.key_path = optarg; break;
        case OPT_NAME: cfg.name = optarg; break;
        case 'v': verbose++; break;
        case OPT_DOC: kiln_proto_write_doc (stdout); return 0;
        case 'h': fputs (s_usage, stdout); return 0;
        default: fputs (s_usage, stderr); return 2;
        }
    }
    if (optind != argc || !cfg.endpoint || !cfg.state_dir || !cfg.key_path) {
        fprintf (stderr, "kiln-broker: %s\n%s", optind != argc ? "unexpected argument"
                 : "--listen, --state and --key are required", s_usage);
        return 2;
    }
    kiln_log_init (argv[0], verbose >= 2 ? LOG_DEBUG : verbose ? LOG_INFO : LOG_NOTICE);

    kiln_err_t err = { 0 };
    kiln_broker_t *broker = kiln_broker_new (&cfg, &err);
    if (!broker) {
        kiln_log_err ("%s", err.msg);
        return 1;
    }
    int rc = kiln_broker_run (broker);
    kiln_broker_destroy (&broker);
    return rc == 0 ? 0 : 1;
}
