/* kiln keygen --out DIR */
#include <getopt.h>
#include <stdio.h>

#include "artifact/kiln_artifact.h"
#include "client/kiln_cmds.h"

static const char *s_usage =
    "usage: kiln keygen --out DIR\n"
    "  Write a new Ed25519 key pair: DIR/kiln.key (private, mode 0600) and\n"
    "  DIR/kiln.pub (public).  Copy kiln.pub alone into the keyring\n"
    "  directory of every host that must trust what this key signs.\n";

int
cmd_keygen (int argc, char **argv)
{
    const char *out = NULL;
    static const struct option opts[] = {
        { "out", required_argument, NULL, 'o' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    optind = 1;
    while ((c = getopt_long (argc, argv, "o:h", opts, NULL)) != -1) {
        switch (c) {
        case 'o': out = optarg; break;
        case 'h': fputs (s_usage, stdout); return 0;
        default: return kiln_cmd_usage (s_usage, NULL);
        }
    }
    if (!out || optind != argc)
        return kiln_cmd_usage (s_usage, "keygen needs --out DIR and nothing else");
    kiln_err_t err = { 0 };
    kiln_key_t *key = kiln_key_generate (&err);
    if (!key || kiln_key_write_pair (key, out, &err) != 0) {
        kiln_key_destroy (&key);
        return kiln_cmd_fail ("keygen", &err);
    }
    printf ("%s\n", kiln_key_id (key));
    kiln_key_destroy (&key);
    return 0;
}
