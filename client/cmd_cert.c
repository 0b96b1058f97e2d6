/* kiln cert --name NAME --role client|worker|broker --out DIR */
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <czmq.h>

#include "client/kiln_cmds.h"
#include "common/kiln_fs.h"
#include "common/kiln_proto.h"

static const char *s_usage =
    "usage: kiln cert --name NAME --role client|worker|broker --out DIR\n"
    "  Write a CurveZMQ certificate for the farm: DIR/NAME.cert (public, with\n"
    "  the name and role as metadata) and DIR/NAME.cert_secret (mode 0600).\n"
    "  Copy a client's or worker's .cert into the broker's --trust directory\n"
    "  to let it in; the name in it is its identity for fair share, status and\n"
    "  provenance, and the role says whether it may act as a client or a worker.\n"
    "  Give the broker's .cert (not its secret) to clients and workers.\n";

int
cmd_cert (int argc, char **argv)
{
    const char *name = NULL, *role = NULL, *out = NULL;
    static const struct option opts[] = {
        { "name", required_argument, NULL, 'n' },
        { "role", required_argument, NULL, 'r' },
        { "out", required_argument, NULL, 'o' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    optind = 1;
    while ((c = getopt_long (argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'n': name = optarg; break;
        case 'r': role = optarg; break;
        case 'o': out = optarg; break;
        case 'h': fputs (s_usage, stdout); return 0;
        default: return kiln_cmd_usage (s_usage, NULL);
        }
    }
    if (optind != argc || !name || !role || !out)
        return kiln_cmd_usage (s_usage, "--name, --role and --out are required");
    if (!kiln_proto_name_ok (name))
        return kiln_cmd_usage (s_usage, "the name must be 1..%d characters of [A-Za-z0-9._:@-]",
                               KILN_PROTO_MAX_NAME);
    if (strcmp (role, "client") != 0 && strcmp (role, "worker") != 0
        && strcmp (role, "broker") != 0)
        return kiln_cmd_usage (s_usage, "--role is client, worker or broker, not '%s'", role);
    kiln_err_t err = { 0 };
    if (kiln_mkdir_p (out, 0755, &err) != 0)
        return kiln_cmd_fail ("cert", &err);
    char path[PATH_MAX], secret[PATH_MAX];
    if (snprintf (path, sizeof path, "%s/%s.cert", out, name) >= (int) sizeof path
        || snprintf (secret, sizeof secret, "%s_secret", path) >= (int) sizeof secret) {
        kiln_error (&err, KILN_ELIMIT, "path too long");
        return kiln_cmd_fail ("cert", &err);
    }
    if (kiln_file_exists (path) || kiln_file_exists (secret)) {
        kiln_error (&err, KILN_EINVAL, "'%s' exists; not overwriting a certificate", path);
        return kiln_cmd_fail ("cert", &err);
    }
    zcert_t *cert = zcert_new ();
    if (!cert) {
        kiln_error (&err, KILN_ECRYPTO, "could not make a key pair");
        return kiln_cmd_fail ("cert", &err);
    }
    zcert_set_meta (cert, "name", "%s", name);
    zcert_set_meta (cert, "role", "%s", role);
    mode_t old = umask (077);
    int rc = zcert_save_secret (cert, secret);
    umask (old);
    if (rc == 0)
        rc = zcert_save_public (cert, path);
    if (rc == 0)
        chmod (path, 0644);
    if (rc != 0) {
        zcert_destroy (&cert);
        kiln_error (&err, KILN_EIO, "could not write '%s'", path);
        return kiln_cmd_fail ("cert", &err);
    }
    printf ("%s %s\n", path, zcert_public_txt (cert));
    zcert_destroy (&cert);
    return 0;
}
