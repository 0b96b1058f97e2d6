/* kiln compile MODEL.onnx|MODEL.kgraph -o OUT.kar [--broker EP] ... */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/kiln_client.h"
#include "client/kiln_cmds.h"
#include "client/kiln_progress.h"

static const char *s_usage =
    "usage: kiln compile MODEL.onnx|MODEL.kgraph -o OUT.kar [options]\n"
    "  Compile a model into a signed artifact, on the farm when a broker is\n"
    "  configured, else locally with the builtin compiler.\n"
    "options:\n"
    "  -o, --output OUT.kar      where to write the artifact\n"
    "  --broker tcp://HOST:PORT  compile on this farm (default: $KILN_BROKER)\n"
    "  --local                   compile locally even when KILN_BROKER is set\n"
    "  --compiler-args \"ARGS\"    arguments for the compiler (e.g. \"--optlevel 1\")\n"
    "  --toolchain ID[@VERSION]  build with this toolchain of the farm (default: the\n"
    "                            builtin compiler; version \"0\" when left out)\n"
    "  --target TARGET           build for this target (default: this host's)\n"
    "  --timeout SECONDS         kill the compile on the farm after this long and fail\n"
    "                            with a timeout error (default: the farm's, 600)\n"
    "  --wait SECONDS            give up (and cancel) after waiting this long in all\n"
    "                            (default: as long as the broker answers)\n"
    "  --priority N              -1000..1000, lower runs sooner (like nice); default 0\n"
    "  --retry-failed            build again even if this action failed before (the\n"
    "                            farm caches failures with their log)\n"
    "  --client-name NAME        who you are for fair share when the farm does not\n"
    "                            authenticate (default: $KILN_CLIENT_NAME or user@host)\n"
    "  --cert FILE               CurveZMQ: your certificate (default: $KILN_CERT)\n"
    "  --broker-cert FILE        CurveZMQ: the broker's (default: $KILN_BROKER_CERT)\n"
    "  --key KEY.pem             local builds: sign with this private key\n"
    "                            (default: your key in ~/.config/kiln/keys,\n"
    "                            created on first use)\n"
    "  --fallback local|none     when the farm cannot be reached, fail with exit\n"
    "                            status 3 (none, the default) or, if it does not\n"
    "                            answer within --fallback-after, compile here and\n"
    "                            sign with your key (local) (default: $KILN_FALLBACK)\n"
    "  --no-fallback             the same as --fallback none\n"
    "  --fallback-after SECONDS  with --fallback local: how long the farm has to\n"
    "                            answer (default 5)\n"
    "  -q, --quiet               no progress line (it is shown only on a terminal,\n"
    "                            on stderr, and never with --json)\n"
    "  --json                    print one JSON object: artifact, cached,\n"
    "                            worker, action_key, graph_digest, broker,\n"
    "                            fallback, import_cache (weight ranges whose\n"
    "                            digests the import cache knew: hits, misses),\n"
    "                            output\n"
    "exit status: 0 built, 1 failed, 2 usage, 3 farm unreachable (without\n"
    "--fallback local)\n";

/* Seconds in (0, max_s] as milliseconds (fractions allowed: "0.2"), or
 * -1. */
static long
s_millis (const char *text, double max_s)
{
    char *end;
    double v = strtod (text, &end);
    return *text && !*end && v >= 0.001 && v <= max_s ? (long) (v * 1000 + 0.5) : -1;
}

/* "local" (1), "none" (0), or -1. */
static int
s_fallback_arg (const char *text)
{
    return strcmp (text, "local") == 0 ? 1 : strcmp (text, "none") == 0 ? 0 : -1;
}

/* Compile on the farm; when it cannot be reached and `fallback` allows,
 * compile here instead.  *fell_back says which happened. */
static int
s_compile_remote (kiln_client_config_t *ccfg, kiln_graph_t *g, const kiln_compile_opts_t *copts,
                  const char *out, const char *key, bool fallback, long fallback_ms,
                  kiln_progress_t *prog, kiln_compile_result_t *res, bool *fell_back,
                  kiln_err_t *err)
{
    *fell_back = false;
    kiln_client_t *client = kiln_client_new_config (ccfg, err);
    if (!client)
        return -err->code;
    kiln_client_catch_signals ();
    if (prog) {
        kiln_client_set_progress (client, kiln_progress_event, prog, 1000);
        char text[300];
        snprintf (text, sizeof text, "sending the graph to the farm at %.200s", ccfg->endpoint);
        kiln_progress_phase (prog, text);
    }
    /* A farm that is down would otherwise cost the client's whole broker
     * timeout (a minute) before the fallback: ask it first, briefly. */
    int rc = fallback ? kiln_client_ping (client, (int) fallback_ms, err) : 0;
    if (rc == 0) {
        rc = kiln_client_compile (client, g, copts, out, res, err);
        kiln_client_stats_t st;
        kiln_client_stats (client, &st);
        res->received_bytes = st.downloaded_bytes;
        res->reused_bytes = st.reused_bytes;
    }
    kiln_client_destroy (&client);
    if (rc == 0 || !fallback || err->code != KILN_EUNREACHABLE)
        return rc;
    kiln_progress_clear (prog);
    fprintf (stderr, "kiln compile: %s; compiling locally instead (--fallback local), "
             "signed with your own key (hosts that trust only the farm's key will "
             "refuse it)\n", err->msg);
    kiln_err_clear (err);
    *fell_back = true;
    kiln_progress_phase (prog, "compiling locally");
    return kiln_compile_local_fallback (g, copts, key, out, ccfg->endpoint, res, err);
}

/* Whole seconds in 1..a week, or -1. */
static long
s_seconds (const char *text)
{
    char *end;
    long v = strtol (text, &end, 10);
    return *text && !*end && v > 0 && v <= 7 * 24 * 3600 ? v : -1;
}

int
cmd_compile (int argc, char **argv)
{
    const char *out = NULL, *broker = getenv ("KILN_BROKER"), *key = NULL;
    kiln_client_config_t ccfg = { 0 };
    kiln_compile_opts_t copts = { 0 };
    int json = 0, local = 0, quiet = 0;
    const char *env_fallback = getenv ("KILN_FALLBACK");
    /* Opt-in (issue 16): a local build is signed by your key, not the
     * farm's, so an unreachable farm fails unless asked otherwise. */
    int fallback = env_fallback && *env_fallback ? s_fallback_arg (env_fallback) : 0;
    long v, fallback_ms = 5000;
    if (fallback < 0) {
        fprintf (stderr, "kiln compile: KILN_FALLBACK is '%s'; it must be 'local' or 'none'\n",
                 env_fallback);
        return KILN_EXIT_USAGE;
    }
    enum { OPT_BROKER = 256, OPT_ARGS, OPT_KEY, OPT_TIMEOUT, OPT_JSON, OPT_LOCAL, OPT_WAIT,
           OPT_PRIORITY, OPT_RETRY, OPT_TOOLCHAIN, OPT_TARGET, OPT_NAME, OPT_CERT,
           OPT_BROKER_CERT, OPT_FALLBACK, OPT_NO_FALLBACK, OPT_FALLBACK_AFTER };
    static const struct option opts[] = {
        { "output", required_argument, NULL, 'o' },
        { "broker", required_argument, NULL, OPT_BROKER },
        { "compiler-args", required_argument, NULL, OPT_ARGS },
        { "key", required_argument, NULL, OPT_KEY },
        { "timeout", required_argument, NULL, OPT_TIMEOUT },
        { "wait", required_argument, NULL, OPT_WAIT },
        { "priority", required_argument, NULL, OPT_PRIORITY },
        { "retry-failed", no_argument, NULL, OPT_RETRY },
        { "toolchain", required_argument, NULL, OPT_TOOLCHAIN },
        { "target", required_argument, NULL, OPT_TARGET },
        { "client-name", required_argument, NULL, OPT_NAME },
        { "cert", required_argument, NULL, OPT_CERT },
        { "broker-cert", required_argument, NULL, OPT_BROKER_CERT },
        { "json", no_argument, NULL, OPT_JSON },
        { "quiet", no_argument, NULL, 'q' },
        { "local", no_argument, NULL, OPT_LOCAL },
        { "fallback", required_argument, NULL, OPT_FALLBACK },
        { "no-fallback", no_argument, NULL, OPT_NO_FALLBACK },
        { "fallback-after", required_argument, NULL, OPT_FALLBACK_AFTER },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    optind = 1;
    while ((c = getopt_long (argc, argv, "o:qh", opts, NULL)) != -1) {
        switch (c) {
        case 'o': out = optarg; break;
        case OPT_BROKER: broker = optarg; break;
        case OPT_ARGS: copts.compiler_args = optarg; break;
        case OPT_KEY: key = optarg; break;
        case OPT_JSON: json = 1; break;
        case 'q': quiet = 1; break;
        case OPT_LOCAL: local = 1; break;
        case OPT_RETRY: copts.retry_failed = true; break;
        case OPT_TOOLCHAIN: copts.toolchain = optarg; break;
        case OPT_TARGET: copts.target = optarg; break;
        case OPT_NAME: ccfg.name = optarg; break;
        case OPT_CERT: ccfg.cert = optarg; break;
        case OPT_BROKER_CERT: ccfg.broker_cert = optarg; break;
        case OPT_NO_FALLBACK: fallback = 0; break;
        case OPT_FALLBACK:
            if ((fallback = s_fallback_arg (optarg)) < 0)
                return kiln_cmd_usage (s_usage, "--fallback wants 'local' or 'none', got '%s'",
                                       optarg);
            break;
        case OPT_FALLBACK_AFTER:
            if ((fallback_ms = s_millis (optarg, 3600)) < 0)
                return kiln_cmd_usage (s_usage, "--fallback-after wants seconds in (0, 3600], "
                                       "got '%s'", optarg);
            break;
        case OPT_TIMEOUT:
            if ((v = s_seconds (optarg)) < 0)
                return kiln_cmd_usage (s_usage, "--timeout wants whole seconds, got '%s'",
                                       optarg);
            copts.timeout_ms = (int) (v * 1000);
            break;
        case OPT_WAIT:
            if ((v = s_millis (optarg, 7 * 24 * 3600)) < 0)
                return kiln_cmd_usage (s_usage, "--wait wants seconds (0.001 to a week), got "
                                       "'%s'", optarg);
            copts.wait_ms = (int) v;
            break;
        case OPT_PRIORITY: {
            char *end;
            v = strtol (optarg, &end, 10);
            if (!*optarg || *end || v < -1000 || v > 1000)
                return kiln_cmd_usage (s_usage, "--priority wants -1000..1000, got '%s'",
                                       optarg);
            copts.priority = (int) v;
            break;
        }
        case 'h': fputs (s_usage, stdout); return 0;
        default: return kiln_cmd_usage (s_usage, NULL);
        }
    }
    if (optind != argc - 1)
        return kiln_cmd_usage (s_usage, "compile takes one model file");
    if (!out)
        return kiln_cmd_usage (s_usage, "missing -o OUT.kar");
    if (local || (broker && !*broker))
        broker = NULL;

    kiln_err_t err = { 0 };
    kiln_compile_result_t res = { 0 };
    memset (&res, 0, sizeof res);
    kiln_progress_t *prog = json || quiet ? NULL : kiln_progress_new (STDERR_FILENO, 1);
    char text[300];
    snprintf (text, sizeof text, "importing and hashing %.200s", argv[optind]);
    kiln_progress_phase (prog, text);
    uint64_t cache_hits = 0, cache_misses = 0;
    kiln_graph_t *g = kiln_cmd_load_model_counted (argv[optind], &cache_hits, &cache_misses,
                                                   &err);
    if (!g) {
        kiln_progress_destroy (&prog);
        return kiln_cmd_fail ("compile", &err);
    }

    int rc;
    bool fell_back = false;
    if (broker) {
        ccfg.endpoint = broker;
        rc = s_compile_remote (&ccfg, g, &copts, out, key, fallback == 1, fallback_ms, prog,
                               &res, &fell_back, &err);
    }
    else {
        kiln_progress_phase (prog, "compiling locally");
        rc = kiln_compile_local (g, &copts, key, out, &res, &err);
    }
    kiln_progress_destroy (&prog);
    kiln_graph_destroy (&g);
    if (rc != 0) {
        int status = kiln_cmd_fail ("compile", &err);
        if (status == KILN_EXIT_UNREACHABLE)
            fprintf (stderr, "kiln compile: --fallback local (or KILN_FALLBACK=local) "
                     "builds here instead when the farm does not answer\n");
        return status;
    }

    if (json) {
        printf ("{\"artifact\":");
        kiln_cmd_json_str (res.artifact);
        printf (",\"cached\":%s,\"worker\":", res.cached ? "true" : "false");
        if (res.worker[0])
            kiln_cmd_json_str (res.worker);
        else
            printf ("null");
        printf (",\"action_key\":");
        kiln_cmd_json_str (res.action_key);
        printf (",\"graph_digest\":");
        kiln_cmd_json_str (res.graph_digest);
        printf (",\"broker\":");
        if (broker)
            kiln_cmd_json_str (broker);
        else
            printf ("null");
        printf (",\"fallback\":%s", fell_back ? "true" : "false");
        printf (",\"import_cache\":{\"hits\":%llu,\"misses\":%llu}",
                (unsigned long long) cache_hits, (unsigned long long) cache_misses);
        printf (",\"download\":{\"received_bytes\":%llu,\"reused_bytes\":%llu}",
                (unsigned long long) res.received_bytes, (unsigned long long) res.reused_bytes);
        if (res.signer[0]) {
            printf (",\"signer\":");
            kiln_cmd_json_str (res.signer);
        }
        printf (",\"output\":");
        kiln_cmd_json_str (out);
        printf ("}\n");
    }
    else
        printf ("%s %s%s\n", res.artifact, out,
                res.cached ? " (cached)" : fell_back ? " (built locally: the farm was "
                                                       "unreachable)" : "");
    return KILN_EXIT_OK;
}
