/* kiln_cmd_farm_opts: the options every subcommand that talks to the farm
 * takes (--broker, --cert, --broker-cert, --wait, --json, --help), parsed
 * in one place for kiln get, pin, unpin, status and trust, beside each
 * command's own options.  Not a subcommand itself: it lives with them
 * because only the `kiln` program uses it. */
#include <assert.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/kiln_cmds.h"

enum { OPT_BROKER = 256, OPT_CERT, OPT_BROKER_CERT, OPT_WAIT, OPT_JSON };

static const struct option s_farm_opts[] = {
    { "broker", required_argument, NULL, OPT_BROKER },
    { "cert", required_argument, NULL, OPT_CERT },
    { "broker-cert", required_argument, NULL, OPT_BROKER_CERT },
    { "wait", required_argument, NULL, OPT_WAIT },
    { "json", no_argument, NULL, OPT_JSON },
    { "help", no_argument, NULL, 'h' },
};

#define S_FARM_N (sizeof s_farm_opts / sizeof s_farm_opts[0])
/* Room for the command's own options: a handful each, so a fixed table. */
#define S_OWN_MAX 10

int
kiln_cmd_farm_opts (int argc, char **argv, const char *usage, const kiln_cmd_own_opts_t *own,
                    kiln_farm_opts_t *fo)
{
    struct option opts[S_FARM_N + S_OWN_MAX + 1];
    char shorts[32] = "h";
    size_t n = S_FARM_N;
    memcpy (opts, s_farm_opts, sizeof s_farm_opts);
    if (own) {
        for (const struct option *o = own->options; o && o->name; o++) {
            /* The tables are the program's own: more is a programmer error. */
            assert (n < S_FARM_N + S_OWN_MAX);
            opts[n++] = *o;
        }
        if (own->shorts) {
            assert (strlen (own->shorts) + 2 <= sizeof shorts);
            strcat (shorts, own->shorts);
        }
    }
    memset (&opts[n], 0, sizeof opts[n]);

    fo->broker = getenv ("KILN_BROKER");
    int c;
    optind = 1;
    while ((c = getopt_long (argc, argv, shorts, opts, NULL)) != -1) {
        switch (c) {
        case OPT_BROKER: fo->broker = optarg; break;
        case OPT_CERT: fo->ccfg.cert = optarg; break;
        case OPT_BROKER_CERT: fo->ccfg.broker_cert = optarg; break;
        case OPT_JSON: fo->json = true; break;
        case OPT_WAIT: {
            char *end;
            long v = strtol (optarg, &end, 10);
            if (!*optarg || *end || v <= 0 || v > fo->wait_max_s)
                return kiln_cmd_usage (usage, "--wait wants 1..%ld seconds, got '%s'",
                                       fo->wait_max_s, optarg);
            fo->wait_s = v;
            break;
        }
        case 'h': fputs (usage, stdout); return KILN_EXIT_OK;
        case '?': return kiln_cmd_usage (usage, NULL);
        default: {
            int rc = own && own->on_option ? own->on_option (c, optarg, own->ctx) : -1;
            if (rc >= 0)
                return rc;
            break;
        }
        }
    }
    return -1;
}
