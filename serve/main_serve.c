/* kiln-serve --repo DIR --listen HOST:PORT --keyring DIR --release-keyring DIR
 *            --state DIR [options] */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "common/kiln_fs.h"
#include "common/kiln_log.h"
#include "serve/kiln_serve.h"

static const char *s_usage =
    "usage: kiln-serve --repo DIR --listen HOST:PORT --keyring DIR --release-keyring DIR\n"
    "                  --state DIR [options]\n"
    "  The inference host's daemon: serves the models of a repository over the KServe v2\n"
    "  (Open Inference Protocol) HTTP/REST API, each at the release its signed release\n"
    "  record names (docs/serving.md).  SIGHUP rescans the repository.\n"
    "required:\n"
    "  --repo DIR               DIR/<model>/release.json and DIR/<model>/<sha256>.kar\n"
    "  --listen HOST:PORT       where to listen (127.0.0.1:8000, [::1]:8000; port 0 picks one)\n"
    "  --keyring DIR            farm public keys: the artifacts are checked against them\n"
    "  --release-keyring DIR    release public keys: the release records are checked\n"
    "  --state DIR              the highest release accepted per model (rollback protection)\n"
    "options:\n"
    "  --replicas N             copies of each model, on cores round-robin (default 1)\n"
    "  --max-batch N            rows per request and per server-side batch (default: the\n"
    "                           batch the model was traced at)\n"
    "  --batch-delay-us U       how long to wait for a batch to fill (default 0: batch only\n"
    "                           the requests already waiting)\n"
    "  --max-queue N            requests waiting per model before 503 (default 64)\n"
    "  --max-body BYTES[KMG]    request body limit, larger ones get 413 (default 64M)\n"
    "  --max-connections N      open connections, one thread each (default 256)\n"
    "  --idle-timeout S         close a connection idle this long (default 60)\n"
    "  -v, --verbose            log more (twice: debug)\n"
    "environment: KILN_RT_VISIBLE_CORES, KILN_RT_NUM_CORES (the cores), KILN_LOG_LEVEL\n";

int
main (int argc, char **argv)
{
    kiln_serve_config_t cfg;
    memset (&cfg, 0, sizeof cfg);
    cfg.repo.replicas = 1;
    cfg.repo.max_queue = 64;
    cfg.http.max_body = 64u << 20;
    cfg.http.max_connections = 256;
    cfg.http.timeout_s = 60;
    int verbose = 0;
    enum { OPT_REPO = 256, OPT_LISTEN, OPT_KEYRING, OPT_RELEASE_KEYRING, OPT_STATE,
           OPT_REPLICAS, OPT_MAX_BATCH, OPT_DELAY, OPT_MAX_QUEUE, OPT_MAX_BODY, OPT_MAX_CONN,
           OPT_TIMEOUT };
    static const struct option opts[] = {
        { "repo", required_argument, NULL, OPT_REPO },
        { "listen", required_argument, NULL, OPT_LISTEN },
        { "keyring", required_argument, NULL, OPT_KEYRING },
        { "release-keyring", required_argument, NULL, OPT_RELEASE_KEYRING },
        { "state", required_argument, NULL, OPT_STATE },
        { "replicas", required_argument, NULL, OPT_REPLICAS },
        { "max-batch", required_argument, NULL, OPT_MAX_BATCH },
        { "batch-delay-us", required_argument, NULL, OPT_DELAY },
        { "max-queue", required_argument, NULL, OPT_MAX_QUEUE },
        { "max-body", required_argument, NULL, OPT_MAX_BODY },
        { "max-connections", required_argument, NULL, OPT_MAX_CONN },
        { "idle-timeout", required_argument, NULL, OPT_TIMEOUT },
        { "verbose", no_argument, NULL, 'v' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    long long v;
    while ((c = getopt_long (argc, argv, "vh", opts, NULL)) != -1) {
        switch (c) {
        case OPT_REPO: cfg.repo.repo_dir = optarg; break;
        case OPT_LISTEN: cfg.http.listen = optarg; break;
        case OPT_KEYRING: cfg.repo.keyring_dir = optarg; break;
        case OPT_RELEASE_KEYRING: cfg.repo.release_keyring_dir = optarg; break;
        case OPT_STATE: cfg.repo.state_dir = optarg; break;
        case OPT_REPLICAS:
            if ((v = kiln_parse_number (optarg, 1, KILN_SERVE_MAX_REPLICAS)) < 0)
                goto bad_number;
            cfg.repo.replicas = (int) v;
            break;
        case OPT_MAX_BATCH:
            if ((v = kiln_parse_number (optarg, 1, KILN_SERVE_MAX_BATCH)) < 0)
                goto bad_number;
            cfg.repo.max_batch = v;
            break;
        case OPT_DELAY:
            if ((v = kiln_parse_number (optarg, 0, 10000000)) < 0)
                goto bad_number;
            cfg.repo.batch_delay_us = v;
            break;
        case OPT_MAX_QUEUE:
            if ((v = kiln_parse_number (optarg, 1, KILN_SERVE_MAX_QUEUE)) < 0)
                goto bad_number;
            cfg.repo.max_queue = (int) v;
            break;
        case OPT_MAX_BODY:
            if ((v = kiln_parse_number (optarg, 1024, (long long) KILN_SERVE_MAX_BODY)) < 0)
                goto bad_number;
            cfg.http.max_body = (size_t) v;
            break;
        case OPT_MAX_CONN:
            if ((v = kiln_parse_number (optarg, 1, KILN_SERVE_MAX_CONNECTIONS)) < 0)
                goto bad_number;
            cfg.http.max_connections = (int) v;
            break;
        case OPT_TIMEOUT:
            if ((v = kiln_parse_number (optarg, 1, 86400)) < 0)
                goto bad_number;
            cfg.http.timeout_s = (int) v;
            break;
        case 'v': verbose++; break;
        case 'h': fputs (s_usage, stdout); return 0;
        default: fputs (s_usage, stderr); return 2;
        }
        continue;
bad_number:
        fprintf (stderr, "kiln-serve: '%s' is not a valid number for --%s\n%s", optarg,
                 opts[c - OPT_REPO].name, s_usage);
        return 2;
    }
    if (optind != argc || !cfg.repo.repo_dir || !cfg.http.listen || !cfg.repo.keyring_dir
        || !cfg.repo.release_keyring_dir || !cfg.repo.state_dir) {
        fprintf (stderr, "kiln-serve: --repo, --listen, --keyring, --release-keyring and "
                 "--state are required\n%s", s_usage);
        return 2;
    }
    kiln_log_init ("kiln-serve", verbose >= 2 ? LOG_DEBUG : verbose ? LOG_INFO : LOG_NOTICE);
    kiln_err_t err = { 0 };
    if (kiln_serve_run (&cfg, &err) != 0) {
        kiln_log_err ("%s", err.msg);
        return 1;
    }
    return 0;
}
