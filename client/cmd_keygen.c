/* kiln keygen --out DIR */
#include <getopt.h>
#include <limits.h>
#include <stdio.h>

#include "artifact/kiln_artifact.h"
#include "client/kiln_cmds.h"

static const char *s_usage =
    "usage: kiln keygen --out DIR [--json]\n"
    "  Write a new Ed25519 key pair: DIR/kiln.key (private, mode 0600) and\n"
    "  DIR/kiln.pub (public), and print the key id and fingerprint.  Copy\n"
    "  kiln.pub alone into the keyring directory of every host that must\n"
    "  trust what this key signs; publish the fingerprint (kiln trust checks\n"
    "  it).  --json prints {\"key_id\", \"fingerprint\", \"private\", \"public\"}.\n";

int
cmd_keygen (int argc, char **argv)
{
    const char *out = NULL;
    int json = 0;
    static const struct option opts[] = {
        { "out", required_argument, NULL, 'o' },
        { "json", no_argument, NULL, 'j' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    optind = 1;
    while ((c = getopt_long (argc, argv, "o:h", opts, NULL)) != -1) {
        switch (c) {
        case 'o': out = optarg; break;
        case 'j': json = 1; break;
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
    char priv[PATH_MAX], pub[PATH_MAX];
    snprintf (priv, sizeof priv, "%s/kiln.key", out);
    snprintf (pub, sizeof pub, "%s/kiln.pub", out);
    if (json) {
        printf ("{\"key_id\":");
        kiln_cmd_json_str (kiln_key_id (key));
        printf (",\"fingerprint\":");
        kiln_cmd_json_str (kiln_key_fingerprint (key));
        printf (",\"private\":");
        kiln_cmd_json_str (priv);
        printf (",\"public\":");
        kiln_cmd_json_str (pub);
        printf ("}\n");
    }
    else
        printf ("key id %s\nfingerprint SHA256:%s\nprivate key %s (keep it here)\n"
                "public key  %s (copy it into the keyring of every host that trusts it)\n",
                kiln_key_id (key), kiln_key_fingerprint (key), priv, pub);
    kiln_key_destroy (&key);
    return 0;
}
