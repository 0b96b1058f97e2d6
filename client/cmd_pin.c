/* kiln pin DIGEST [--broker EP] [--json]; kiln unpin DIGEST ...
 *
 * The two subcommands are one file: each is the other undone, with the
 * same options and output. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/kiln_client.h"
#include "client/kiln_cmds.h"

static const char *s_pin_usage =
    "usage: kiln pin DIGEST [--broker tcp://HOST:PORT] [--json]\n"
    "  Keep the artifact whose content hash is DIGEST in the farm's store:\n"
    "  the size cap (kiln-broker --store-max-bytes) never evicts a pinned\n"
    "  artifact, so `kiln get DIGEST` keeps working for a release that names\n"
    "  it.  Pinning twice is the same as once.  `kiln unpin` undoes it.\n"
    "options:\n"
    "  --broker tcp://HOST:PORT  the farm (default: $KILN_BROKER)\n"
    "  --cert FILE, --broker-cert FILE   CurveZMQ (default: $KILN_CERT, $KILN_BROKER_CERT)\n"
    "  --wait SECONDS            give up after this long (default 10)\n"
    "  --json                    print one JSON object: artifact, pinned, changed, broker\n";

static const char *s_unpin_usage =
    "usage: kiln unpin DIGEST [--broker tcp://HOST:PORT] [--json]\n"
    "  Let the farm's store evict the artifact DIGEST again when it needs\n"
    "  the room (least recently used first), once no release names it.\n"
    "  Unpinning what is not pinned changes nothing and succeeds.\n"
    "options:\n"
    "  --broker tcp://HOST:PORT  the farm (default: $KILN_BROKER)\n"
    "  --cert FILE, --broker-cert FILE   CurveZMQ (default: $KILN_CERT, $KILN_BROKER_CERT)\n"
    "  --wait SECONDS            give up after this long (default 10)\n"
    "  --json                    print one JSON object: artifact, pinned, changed, broker\n";

static int
s_pin (int argc, char **argv, bool pin)
{
    const char *usage = pin ? s_pin_usage : s_unpin_usage;
    const char *cmd = pin ? "pin" : "unpin";
    kiln_farm_opts_t fo = { .wait_s = 10, .wait_max_s = 3600 };
    int rc = kiln_cmd_farm_opts (argc, argv, usage, NULL, &fo);
    if (rc >= 0)
        return rc;
    if (optind != argc - 1)
        return kiln_cmd_usage (usage, "%s takes one DIGEST", cmd);
    char digest[KILN_HEX_LEN];
    if (kiln_cmd_digest_arg (argv[optind], digest) != 0)
        return kiln_cmd_usage (usage, "'%.80s' is not an artifact's content hash (64 hex "
                               "characters)", argv[optind]);
    if (!fo.broker || !*fo.broker)
        return kiln_cmd_usage (usage, "which farm? give --broker or set $KILN_BROKER");
    kiln_err_t err = { 0 };
    fo.ccfg.endpoint = fo.broker;
    bool changed = false;
    kiln_client_t *client = kiln_client_new_config (&fo.ccfg, &err);
    rc = client ? kiln_client_pin (client, digest, pin, (int) fo.wait_s * 1000, &changed, &err)
                : -err.code;
    kiln_client_destroy (&client);
    if (rc != 0)
        return kiln_cmd_fail (cmd, &err);
    if (fo.json) {
        printf ("{\"artifact\":");
        kiln_cmd_json_str (digest);
        printf (",\"pinned\":%s,\"changed\":%s,\"broker\":", pin ? "true" : "false",
                changed ? "true" : "false");
        kiln_cmd_json_str (fo.broker);
        printf ("}\n");
    }
    else
        printf ("%s %s%s\n", digest, pin ? "pinned" : "unpinned",
                changed ? "" : pin ? " (it was already)" : " (it was not pinned)");
    return 0;
}

int
cmd_pin (int argc, char **argv)
{
    return s_pin (argc, argv, true);
}

int
cmd_unpin (int argc, char **argv)
{
    return s_pin (argc, argv, false);
}
