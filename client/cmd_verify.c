/* kiln verify ARTIFACT.kar --keyring DIR */
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <unistd.h>

#include "artifact/kiln_artifact.h"
#include "client/kiln_cmds.h"
#include "common/kiln_fs.h"
#include "common/kiln_log.h"

static const char *s_usage =
    "usage: kiln verify ARTIFACT.kar --keyring DIR\n"
    "  Exit 0 only when every member matches the manifest and the manifest\n"
    "  is signed by a key in DIR; otherwise print the reason and exit 1.\n";

int
cmd_verify (int argc, char **argv)
{
    const char *keyring = NULL;
    static const struct option opts[] = {
        { "keyring", required_argument, NULL, 'k' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    optind = 1;
    while ((c = getopt_long (argc, argv, "k:h", opts, NULL)) != -1) {
        switch (c) {
        case 'k': keyring = optarg; break;
        case 'h': fputs (s_usage, stdout); return 0;
        default: return kiln_cmd_usage (s_usage, NULL);
        }
    }
    if (optind != argc - 1)
        return kiln_cmd_usage (s_usage, "verify takes one artifact");
    if (!keyring)
        return kiln_cmd_usage (s_usage, "missing --keyring DIR");

    kiln_err_t err = { 0 };
    char digest[KILN_HEX_LEN];
    /* Large members are mapped and hashed with their pages given back, so
     * that checking a 10 GB artifact costs no more memory than a small one
     * (artifact/kiln_artifact.h, KILN_ARTIFACT_MAP). */
    int fd = kiln_open_regular (argv[optind], "artifact", 0, NULL, &err);
    kiln_artifact_t *art = fd >= 0 ? kiln_artifact_read_fd (fd, argv[optind],
                                                            KILN_ARTIFACT_MAP, &err) : NULL;
    if (fd >= 0)
        close (fd);
    if (art && kiln_artifact_verify (art, keyring, &err) != 0) {
        kiln_error_prefix (&err, "artifact '%s'", argv[optind]);
        kiln_artifact_destroy (&art);
    }
    if (!art || kiln_artifact_digest (art, digest, &err) != 0) {
        kiln_artifact_destroy (&art);
        char what[PATH_MAX + 32];
        snprintf (what, sizeof what, "kiln verify: '%s' refused", argv[optind]);
        kiln_print_error (what, err.msg);
        /* Anything wrong with the artifact itself is a failed verification;
         * a file that cannot be read, or no memory, is not. */
        return err.code == KILN_EIO || err.code == KILN_ENOMEM || err.code == KILN_ENOTFOUND
                   ? KILN_EXIT_FAIL : KILN_EXIT_VERIFY;
    }
    printf ("%s: ok, artifact %s signed by key %s\n", argv[optind], digest,
            kiln_artifact_signer (art));
    kiln_artifact_destroy (&art);
    return 0;
}
