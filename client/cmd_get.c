/* kiln get DIGEST -o FILE [--broker EP] [--keyring DIR] [--json] */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/kiln_client.h"
#include "client/kiln_cmds.h"

static const char *s_usage =
    "usage: kiln get DIGEST -o FILE [--broker tcp://HOST:PORT] [options]\n"
    "  Fetch the artifact whose content hash is DIGEST (the \"artifact\" that\n"
    "  `kiln compile --json` prints) from the farm's store.  It arrives in\n"
    "  chunks into a file beside FILE and becomes FILE only once it checks\n"
    "  out: every member against its manifest, the manifest against DIGEST\n"
    "  (and the signature against --keyring, when given).\n"
    "options:\n"
    "  -o, --output FILE         where to write the artifact\n"
    "  --broker tcp://HOST:PORT  the farm (default: $KILN_BROKER)\n"
    "  --keyring DIR             also require a signature by a key in DIR\n"
    "  --cert FILE               CurveZMQ: your certificate (default: $KILN_CERT)\n"
    "  --broker-cert FILE        CurveZMQ: the broker's (default: $KILN_BROKER_CERT)\n"
    "  --wait SECONDS            give up after this long (default: as long as the\n"
    "                            broker answers)\n"
    "  --json                    print one JSON object: artifact, output, bytes,\n"
    "                            sha256 (of the file), broker\n";

int
cmd_get (int argc, char **argv)
{
    const char *out = NULL, *broker = getenv ("KILN_BROKER"), *keyring = NULL;
    kiln_client_config_t ccfg = { 0 };
    int json = 0;
    long wait_s = 0;
    enum { OPT_BROKER = 256, OPT_KEYRING, OPT_CERT, OPT_BROKER_CERT, OPT_WAIT, OPT_JSON };
    static const struct option opts[] = {
        { "output", required_argument, NULL, 'o' },
        { "broker", required_argument, NULL, OPT_BROKER },
        { "keyring", required_argument, NULL, OPT_KEYRING },
        { "cert", required_argument, NULL, OPT_CERT },
        { "broker-cert", required_argument, NULL, OPT_BROKER_CERT },
        { "wait", required_argument, NULL, OPT_WAIT },
        { "json", no_argument, NULL, OPT_JSON },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    optind = 1;
    while ((c = getopt_long (argc, argv, "o:h", opts, NULL)) != -1) {
        switch (c) {
        case 'o': out = optarg; break;
        case OPT_BROKER: broker = optarg; break;
        case OPT_KEYRING: keyring = optarg; break;
        case OPT_CERT: ccfg.cert = optarg; break;
        case OPT_BROKER_CERT: ccfg.broker_cert = optarg; break;
        case OPT_JSON: json = 1; break;
        case OPT_WAIT: {
            char *end;
            wait_s = strtol (optarg, &end, 10);
            if (!*optarg || *end || wait_s <= 0 || wait_s > 7 * 24 * 3600)
                return kiln_cmd_usage (s_usage, "--wait wants whole seconds, got '%s'", optarg);
            break;
        }
        case 'h': fputs (s_usage, stdout); return 0;
        default: return kiln_cmd_usage (s_usage, NULL);
        }
    }
    if (optind != argc - 1)
        return kiln_cmd_usage (s_usage, "get takes one DIGEST");
    char digest[KILN_HEX_LEN];
    if (kiln_cmd_digest_arg (argv[optind], digest) != 0)
        return kiln_cmd_usage (s_usage, "'%.80s' is not an artifact's content hash (64 hex "
                               "characters)", argv[optind]);
    if (!out || !*out)
        return kiln_cmd_usage (s_usage, "missing -o FILE");
    if (!broker || !*broker)
        return kiln_cmd_usage (s_usage, "which farm? give --broker or set $KILN_BROKER");

    kiln_err_t err = { 0 };
    kiln_get_result_t res;
    ccfg.endpoint = broker;
    kiln_client_t *client = kiln_client_new_config (&ccfg, &err);
    if (client)
        kiln_client_catch_signals ();
    int rc = client ? kiln_client_get (client, digest, out, keyring, (int) wait_s * 1000, &res,
                                       &err)
                    : -err.code;
    kiln_client_destroy (&client);
    if (rc != 0)
        return kiln_cmd_fail ("get", &err);
    if (json) {
        printf ("{\"artifact\":");
        kiln_cmd_json_str (digest);
        printf (",\"output\":");
        kiln_cmd_json_str (out);
        printf (",\"bytes\":%llu,\"sha256\":", (unsigned long long) res.bytes);
        kiln_cmd_json_str (res.sha256);
        printf (",\"broker\":");
        kiln_cmd_json_str (broker);
        printf ("}\n");
    }
    else
        printf ("%s %s (%llu bytes)\n", digest, out, (unsigned long long) res.bytes);
    return 0;
}
