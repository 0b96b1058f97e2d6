/* kiln compile MODEL.onnx|MODEL.kgraph -o OUT.kar [--broker EP] ... */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/kiln_client.h"
#include "client/kiln_cmds.h"

static const char *s_usage =
    "usage: kiln compile MODEL.onnx|MODEL.kgraph -o OUT.kar [options]\n"
    "  Compile a model into a signed artifact, on the farm when a broker is\n"
    "  configured, else locally with the builtin compiler.\n"
    "options:\n"
    "  -o, --output OUT.kar      where to write the artifact\n"
    "  --broker tcp://HOST:PORT  compile on this farm (default: $KILN_BROKER)\n"
    "  --local                   compile locally even when KILN_BROKER is set\n"
    "  --compiler-args \"ARGS\"    arguments for the compiler (e.g. \"--optlevel 1\")\n"
    "  --key KEY.pem             local builds: sign with this private key\n"
    "                            (default: your key in ~/.config/kiln/keys,\n"
    "                            created on first use)\n"
    "  --timeout SECONDS         give up waiting for the farm after this long\n"
    "  --json                    print one JSON object: artifact, cached,\n"
    "                            worker, action_key, graph_digest, output\n";

int
cmd_compile (int argc, char **argv)
{
    const char *out = NULL, *broker = getenv ("KILN_BROKER"), *key = NULL;
    const char *args = NULL;
    int json = 0, local = 0;
    long timeout_s = 0;
    enum { OPT_BROKER = 256, OPT_ARGS, OPT_KEY, OPT_TIMEOUT, OPT_JSON, OPT_LOCAL };
    static const struct option opts[] = {
        { "output", required_argument, NULL, 'o' },
        { "broker", required_argument, NULL, OPT_BROKER },
        { "compiler-args", required_argument, NULL, OPT_ARGS },
        { "key", required_argument, NULL, OPT_KEY },
        { "timeout", required_argument, NULL, OPT_TIMEOUT },
        { "json", no_argument, NULL, OPT_JSON },
        { "local", no_argument, NULL, OPT_LOCAL },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    optind = 1;
    while ((c = getopt_long (argc, argv, "o:h", opts, NULL)) != -1) {
        switch (c) {
        case 'o': out = optarg; break;
        case OPT_BROKER: broker = optarg; break;
        case OPT_ARGS: args = optarg; break;
        case OPT_KEY: key = optarg; break;
        case OPT_JSON: json = 1; break;
        case OPT_LOCAL: local = 1; break;
        case OPT_TIMEOUT: {
            char *end;
            timeout_s = strtol (optarg, &end, 10);
            if (*end || timeout_s <= 0 || timeout_s > 7 * 24 * 3600)
                return kiln_cmd_usage (s_usage, "--timeout wants whole seconds, got '%s'",
                                       optarg);
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
    kiln_compile_result_t res;
    memset (&res, 0, sizeof res);
    kiln_compile_opts_t copts = { .compiler_args = args,
                                  .timeout_ms = (int) (timeout_s * 1000) };
    kiln_graph_t *g = kiln_cmd_load_model (argv[optind], &err);
    if (!g)
        return kiln_cmd_fail ("compile", &err);

    int rc;
    if (broker) {
        kiln_client_t *client = kiln_client_new (broker, &err);
        rc = client ? kiln_client_compile (client, g, &copts, out, &res, &err)
                    : -err.code;
        kiln_client_destroy (&client);
    }
    else
        rc = kiln_compile_local (g, &copts, key, out, &res, &err);
    kiln_graph_destroy (&g);
    if (rc != 0)
        return kiln_cmd_fail ("compile", &err);

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
        printf (",\"output\":");
        kiln_cmd_json_str (out);
        printf ("}\n");
    }
    else
        printf ("%s %s%s%s\n", res.artifact, out, res.cached ? " (cached)" : "",
                res.worker[0] ? "" : "");
    return 0;
}
