/* kiln get DIGEST -o FILE [--broker EP] [--keyring DIR] [--json] */
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
    "                            received_bytes (over the wire), reused_bytes (from\n"
    "                            the member cache), refetched, sha256 (of the\n"
    "                            file; null when members came from the cache:\n"
    "                            not taken, every member was checked), broker\n";

/* What `kiln get` takes beside the farm options. */
typedef struct {
    const char *out;      /* -o FILE */
    const char *keyring;  /* --keyring DIR, or NULL */
} s_get_opts_t;

enum { OPT_KEYRING = 512 };

static int
s_get_option (int opt, const char *arg, void *ctx)
{
    s_get_opts_t *g = ctx;
    if (opt == 'o')
        g->out = arg;
    else if (opt == OPT_KEYRING)
        g->keyring = arg;
    return -1;
}

int
cmd_get (int argc, char **argv)
{
    static const struct option own_opts[] = {
        { "output", required_argument, NULL, 'o' },
        { "keyring", required_argument, NULL, OPT_KEYRING },
        { NULL, 0, NULL, 0 },
    };
    s_get_opts_t g = { 0 };
    const kiln_cmd_own_opts_t own = { own_opts, "o:", s_get_option, &g };
    /* No --wait: as long as the broker answers; at most a week. */
    kiln_farm_opts_t fo = { .wait_s = 0, .wait_max_s = 7 * 24 * 3600 };
    int rc = kiln_cmd_farm_opts (argc, argv, s_usage, &own, &fo);
    if (rc >= 0)
        return rc;
    const char *out = g.out, *keyring = g.keyring, *broker = fo.broker;
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
    fo.ccfg.endpoint = broker;
    kiln_client_t *client = kiln_client_new_config (&fo.ccfg, &err);
    if (client)
        kiln_client_catch_signals ();
    rc = client ? kiln_client_get (client, digest, out, keyring, (int) fo.wait_s * 1000, &res,
                                   &err)
                : -err.code;
    kiln_client_destroy (&client);
    if (rc != 0)
        return kiln_cmd_fail ("get", &err);
    if (fo.json) {
        printf ("{\"artifact\":");
        kiln_cmd_json_str (digest);
        printf (",\"output\":");
        kiln_cmd_json_str (out);
        printf (",\"bytes\":%llu,\"received_bytes\":%llu,\"reused_bytes\":%llu,"
                "\"refetched\":%s,\"sha256\":", (unsigned long long) res.bytes,
                (unsigned long long) res.received_bytes, (unsigned long long) res.reused_bytes,
                res.refetched ? "true" : "false");
        if (res.sha256[0])
            kiln_cmd_json_str (res.sha256);
        else
            printf ("null");
        printf (",\"broker\":");
        kiln_cmd_json_str (broker);
        printf ("}\n");
    }
    else
        printf ("%s %s (%llu bytes, %llu of them from the member cache)\n", digest, out,
                (unsigned long long) res.bytes, (unsigned long long) res.reused_bytes);
    return 0;
}
