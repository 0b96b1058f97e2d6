/* kiln-broker --listen ENDPOINT --state DIR --key FARMKEY.pem [options] */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <malloc.h>
#include <stdbool.h>
#include <sys/file.h>
#include <unistd.h>
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
    "  --max-uploads N          blob uploads in progress at once, all clients together\n"
    "                           (default 16; each has two threads; more wait: EBUSY)\n"
    "  --metrics HOST:PORT      serve Prometheus metrics at http://HOST:PORT/metrics\n"
    "                           (docs/operations.md, \"Metrics\"; port 0 picks one)\n"
    "  --cross-check POLICY     how often a second, different worker builds the same\n"
    "                           action; only byte-identical results are signed and cached\n"
    "                           (docs/security.md, \"A hostile worker\"):\n"
    "                             always          every build (the default)\n"
    "                             new-workers[:N] until its builder has N builds confirmed\n"
    "                                             (default 20)\n"
    "                             sample:N        one build in N, at random\n"
    "                             off             never: each worker is taken at its word\n"
    "                           with one worker for a toolchain, builds are not checked\n"
    "                           (provenance says so) and are cached\n"
    "  --check-store            check every entry of the store at --state and exit:\n"
    "                           0 when nothing is damaged (run it with the broker stopped:\n"
    "                           it warns when one runs, and --repair refuses)\n"
    "  --repair                 with --check-store: remove damaged entries\n"
    "  -v, --verbose            log more (twice: debug)\n"
    "  --protocol-doc           print the protocol tables of docs/protocol.md\n";

/* Lock the state directory's broker.lock: exclusively for a broker (two
 * brokers on one store would corrupt it), shared for --check-store (which
 * then knows no broker is writing).  The lock lives as long as the
 * process.  Returns 0, 1 when another process holds it (its pid, as the
 * file says, in *holder), or -1 with `err` filled in. */
static int
s_lock_state (const char *dir, bool exclusive, long *holder, kiln_err_t *err)
{
    char path[PATH_MAX];
    *holder = 0;
    if (snprintf (path, sizeof path, "%s/broker.lock", dir) >= (int) sizeof path) {
        kiln_error (err, KILN_ELIMIT, "state directory path too long: '%s'", dir);
        return -1;
    }
    if (exclusive && kiln_mkdir_p (dir, 0755, err) != 0)
        return -1;
    int fd = open (path, (exclusive ? O_RDWR | O_CREAT : O_RDONLY) | O_CLOEXEC | O_NOFOLLOW,
                   0644);
    if (fd < 0) {
        if (!exclusive && errno == ENOENT)
            return 0;                /* no broker ever ran here */
        kiln_error (err, KILN_EIO, "could not open '%s': %s", path, strerror (errno));
        return -1;
    }
    if (flock (fd, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) != 0) {
        char text[32] = "";
        ssize_t n = pread (fd, text, sizeof text - 1, 0);
        *holder = n > 0 ? strtol (text, NULL, 10) : 0;
        close (fd);
        return 1;
    }
    if (exclusive) {
        char text[32];
        int n = snprintf (text, sizeof text, "%ld\n", (long) getpid ());
        if (ftruncate (fd, 0) != 0 || pwrite (fd, text, (size_t) n, 0) != n)
            kiln_log_warn ("could not write the pid into '%s'", path);
    }
    return 0;                        /* fd stays open: the lock with it */
}

int
main (int argc, char **argv)
{
    kiln_broker_config_t cfg;
    memset (&cfg, 0, sizeof cfg);
    int verbose = 0, check = 0, repair = 0;
    enum { OPT_LISTEN = 256, OPT_STATE, OPT_KEY, OPT_NAME, OPT_DOC, OPT_CERT, OPT_TRUST,
           OPT_STORE_MAX, OPT_TIMEOUT, OPT_HEARTBEAT, OPT_LIVENESS, OPT_DEATHS, OPT_WINDOW,
           OPT_MAX_UPLOADS, OPT_CHECK, OPT_REPAIR, OPT_METRICS, OPT_XCHECK };
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
        { "max-uploads", required_argument, NULL, OPT_MAX_UPLOADS },
        { "check-store", no_argument, NULL, OPT_CHECK },
        { "metrics", required_argument, NULL, OPT_METRICS },
        { "cross-check", required_argument, NULL, OPT_XCHECK },
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
        case OPT_XCHECK: {
            kiln_err_t xerr = { 0 };
            if (kiln_broker_parse_cross_check (optarg, &cfg, &xerr) != 0) {
                fprintf (stderr, "kiln-broker: %s\n%s", xerr.msg, s_usage);
                return 2;
            }
            break;
        }
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
        case OPT_MAX_UPLOADS:
            if ((v = kiln_parse_number (optarg, 1, KILN_BROKER_MAX_UPLOADS)) < 0)
                goto bad_number;
            cfg.max_uploads = (int) v;
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
        long holder;
        int locked = s_lock_state (cfg.state_dir, false, &holder, &err);
        if (locked < 0) {
            fprintf (stderr, "kiln-broker: %s\n", err.msg);
            return 1;
        }
        if (locked > 0 && repair) {
            fprintf (stderr, "kiln-broker: a broker (pid %ld) is running on '%s': stop it "
                     "before --repair, which would remove what it is writing\n", holder,
                     cfg.state_dir);
            return 2;
        }
        if (locked > 0)
            fprintf (stderr, "kiln-broker: warning: a broker (pid %ld) is running on '%s': "
                     "entries it is writing now may show as damaged; stop it for a "
                     "trustworthy check\n", holder, cfg.state_dir);
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
    long holder;
    int locked = s_lock_state (cfg.state_dir, true, &holder, &err);
    if (locked != 0) {
        if (locked > 0)
            kiln_error (&err, KILN_EINVAL, "another kiln-broker (pid %ld) uses the state "
                        "directory '%s'", holder, cfg.state_dir);
        kiln_log_err ("%s", err.msg);
        return 1;
    }
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
