/* kiln trust [tcp://HOST:PORT] [--fingerprint HEX | --yes] [--keyring DIR] [--json]
 *
 * Trust on first use, as ssh does with host keys: ask the broker for the
 * key the farm signs artifacts with, show its id and fingerprint, and
 * pin it in the user's keyring after confirmation.  The pin is the file
 * KEYRING/farm-<endpoint>.pub: once it is there, a broker at that
 * endpoint presenting another key is refused (exit 5) until the user
 * removes the file. */
#include <ctype.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "artifact/kiln_artifact.h"
#include "client/kiln_client.h"
#include "client/kiln_cmds.h"
#include "common/kiln_fs.h"

static const char *s_usage =
    "usage: kiln trust [tcp://HOST:PORT] [options]\n"
    "  Fetch the public key the farm signs artifacts with, show its key id and\n"
    "  fingerprint, and add it to your keyring after you confirm (trust on first\n"
    "  use, as ssh does).  Compare the fingerprint with what the farm's operator\n"
    "  publishes (`kiln keygen` and kiln-broker print it).  Once pinned, a broker\n"
    "  at that address presenting another key is refused.\n"
    "options:\n"
    "  ENDPOINT, --broker EP     the broker (default: $KILN_BROKER)\n"
    "  --fingerprint HEX         the fingerprint you expect (64 hex characters, or\n"
    "                            at least the first 16): no prompt; refused when\n"
    "                            the broker's key differs\n"
    "  -y, --yes                 trust without asking (scripts)\n"
    "  --keyring DIR             where to pin it (default: $KILN_KEYRING, else\n"
    "                            ~/.config/kiln/keyring, which kiln.load uses)\n"
    "  --wait SECONDS            how long the broker has to answer (default 10)\n"
    "  --cert FILE, --broker-cert FILE   CurveZMQ, as for `kiln compile`\n"
    "  --json                    print {\"key_id\", \"fingerprint\", \"path\", \"added\"}\n"
    "exit status: 0 trusted (or already), 1 failed, 2 usage or not confirmed,\n"
    "3 the farm could not be reached, 5 the key differs from the pinned or given one\n";

/* The pin file's name for `endpoint`: farm-<endpoint with anything but
 * [A-Za-z0-9.-] as '_'>, at most 100 characters of it. */
static void
s_pin_name (const char *endpoint, char *buf, size_t size)
{
    const char *p = strstr (endpoint, "://");
    p = p ? p + 3 : endpoint;
    size_t n = (size_t) snprintf (buf, size, "farm-%.100s", p);
    for (size_t i = 5; i < n && i < size; i++)
        if (!isalnum ((unsigned char) buf[i]) && buf[i] != '.' && buf[i] != '-')
            buf[i] = '_';
}

/* A fingerprint from the command line, lower-case, "SHA256:" allowed in
 * front: 16..64 hex characters.  -1 when it is not one. */
static int
s_fingerprint_arg (const char *arg, char *out, size_t size)
{
    if (strncasecmp (arg, "SHA256:", 7) == 0)
        arg += 7;
    size_t n = strlen (arg);
    if (n < 16 || n > 64 || n >= size)
        return -1;
    for (size_t i = 0; i < n; i++) {
        if (!isxdigit ((unsigned char) arg[i]))
            return -1;
        out[i] = (char) tolower ((unsigned char) arg[i]);
    }
    out[n] = '\0';
    return 0;
}

/* Ask on the terminal; true for y/yes. */
static bool
s_confirm (const char *endpoint)
{
    fprintf (stderr, "Trust this key for artifacts built by the farm at %s? [y/N] ", endpoint);
    fflush (stderr);
    char line[16];
    if (!fgets (line, sizeof line, stdin))
        return false;
    return strcasecmp (line, "y\n") == 0 || strcasecmp (line, "yes\n") == 0;
}

static void
s_print (bool json, const kiln_key_t *key, const char *path, bool added, const char *curve)
{
    if (json) {
        printf ("{\"key_id\":");
        kiln_cmd_json_str (kiln_key_id (key));
        printf (",\"fingerprint\":");
        kiln_cmd_json_str (kiln_key_fingerprint (key));
        printf (",\"curve_public\":");
        if (curve[0])
            kiln_cmd_json_str (curve);
        else
            printf ("null");
        printf (",\"path\":");
        kiln_cmd_json_str (path);
        printf (",\"added\":%s}\n", added ? "true" : "false");
    }
    else if (added)
        printf ("trusted key %s: added '%s'\n", kiln_key_id (key), path);
    else
        printf ("key %s is already trusted ('%s')\n", kiln_key_id (key), path);
}

/* What `kiln trust` takes beside the farm options. */
typedef struct {
    const char *expect_arg;  /* --fingerprint HEX, or NULL */
    const char *keyring;     /* --keyring DIR, else $KILN_KEYRING */
    bool yes;                /* -y, --yes */
} s_trust_opts_t;

enum { OPT_FINGERPRINT = 512, OPT_KEYRING };

static int
s_trust_option (int opt, const char *arg, void *ctx)
{
    s_trust_opts_t *t = ctx;
    if (opt == OPT_FINGERPRINT)
        t->expect_arg = arg;
    else if (opt == OPT_KEYRING)
        t->keyring = arg;
    else if (opt == 'y')
        t->yes = true;
    return -1;
}

int
cmd_trust (int argc, char **argv)
{
    static const struct option own_opts[] = {
        { "fingerprint", required_argument, NULL, OPT_FINGERPRINT },
        { "yes", no_argument, NULL, 'y' },
        { "keyring", required_argument, NULL, OPT_KEYRING },
        { NULL, 0, NULL, 0 },
    };
    s_trust_opts_t to = { .keyring = getenv ("KILN_KEYRING") };
    const kiln_cmd_own_opts_t own = { own_opts, "y", s_trust_option, &to };
    kiln_farm_opts_t fo = { .wait_s = 10, .wait_max_s = 3600 };
    int rc = kiln_cmd_farm_opts (argc, argv, s_usage, &own, &fo);
    if (rc >= 0)
        return rc;
    const char *endpoint = fo.broker, *keyring = to.keyring, *expect_arg = to.expect_arg;
    bool yes = to.yes, json = fo.json;
    long wait_ms = fo.wait_s * 1000;
    if (optind < argc)
        endpoint = argv[optind++];
    if (optind != argc)
        return kiln_cmd_usage (s_usage, "trust takes one broker endpoint");
    if (!endpoint || !*endpoint)
        return kiln_cmd_usage (s_usage, "which farm? give tcp://HOST:PORT or set KILN_BROKER");
    char expect[KILN_HEX_LEN];
    if (expect_arg && s_fingerprint_arg (expect_arg, expect, sizeof expect) != 0)
        return kiln_cmd_usage (s_usage, "--fingerprint wants 16 to 64 hex characters, got "
                               "'%s'", expect_arg);

    kiln_err_t err = { 0 };
    char dir[PATH_MAX - 128];
    if (keyring && *keyring)
        snprintf (dir, sizeof dir, "%s", keyring);
    else if (kiln_user_keyring (dir, sizeof dir, &err) != 0)
        return kiln_cmd_fail ("trust", &err);

    fo.ccfg.endpoint = endpoint;
    kiln_client_t *client = kiln_client_new_config (&fo.ccfg, &err);
    char *pem = NULL, key_id[KILN_KEY_ID_LEN], curve[41];
    rc = client ? kiln_client_farm_key (client, (int) wait_ms, &pem, key_id, curve, &err)
                    : -err.code;
    kiln_client_destroy (&client);
    if (rc != 0)
        return kiln_cmd_fail ("trust", &err);
    char what[300];
    snprintf (what, sizeof what, "the key from the broker at %.200s", endpoint);
    kiln_key_t *key = kiln_key_parse_public (pem, strlen (pem), what, &err);
    free (pem);
    if (!key)
        return kiln_cmd_fail ("trust", &err);
    int status = KILN_EXIT_FAIL;
    if (strcmp (kiln_key_id (key), key_id) != 0) {
        kiln_error (&err, KILN_EVERIFY, "the broker at %s calls its key %s, but the key it "
                    "sent has id %s", endpoint, key_id, kiln_key_id (key));
        status = kiln_cmd_fail ("trust", &err);
        goto done;
    }

    char name[128], path[PATH_MAX];
    s_pin_name (endpoint, name, sizeof name);
    if (snprintf (path, sizeof path, "%s/%s.pub", dir, name) >= (int) sizeof path) {
        kiln_error (&err, KILN_ELIMIT, "keyring path too long: '%s'", dir);
        status = kiln_cmd_fail ("trust", &err);
        goto done;
    }
    if (kiln_file_exists (path)) {
        kiln_key_t *pinned = kiln_key_load_public (path, &err);
        if (!pinned) {
            status = kiln_cmd_fail ("trust", &err);
            goto done;
        }
        bool same = strcmp (kiln_key_fingerprint (pinned), kiln_key_fingerprint (key)) == 0;
        if (!same)
            fprintf (stderr,
                     "kiln trust: WARNING: THE FARM'S KEY HAS CHANGED\n"
                     "  the broker at %s presents key %s\n"
                     "    fingerprint SHA256:%s\n"
                     "  but key %s is pinned for it in '%s'\n"
                     "    fingerprint SHA256:%s\n"
                     "  Someone may be impersonating the farm, or its key was replaced.  Ask\n"
                     "  its operator; to trust the new key, remove '%s' and run kiln trust\n"
                     "  again.\n",
                     endpoint, kiln_key_id (key), kiln_key_fingerprint (key),
                     kiln_key_id (pinned), path, kiln_key_fingerprint (pinned), path);
        kiln_key_destroy (&pinned);
        if (!same) {
            status = KILN_EXIT_VERIFY;
            goto done;
        }
        s_print (json, key, path, false, curve);
        status = KILN_EXIT_OK;
        goto done;
    }

    fprintf (stderr, "The farm at %s signs artifacts with key %s\n"
             "  fingerprint SHA256:%s\n", endpoint, kiln_key_id (key), kiln_key_fingerprint (key));
    if (curve[0])
        fprintf (stderr, "  CurveZMQ public key of the broker: %s\n", curve);
    if (expect_arg) {
        if (strncmp (kiln_key_fingerprint (key), expect, strlen (expect)) != 0) {
            fprintf (stderr, "kiln trust: refused: the key's fingerprint is not the one given "
                     "(%s)\n", expect);
            status = KILN_EXIT_VERIFY;
            goto done;
        }
    }
    else if (!yes) {
        if (!isatty (STDIN_FILENO)) {
            fprintf (stderr, "kiln trust: not confirmed: stdin is not a terminal; compare the "
                     "fingerprint, then pass --fingerprint %s (or --yes)\n",
                     kiln_key_fingerprint (key));
            status = KILN_EXIT_USAGE;
            goto done;
        }
        if (!s_confirm (endpoint)) {
            fprintf (stderr, "kiln trust: not confirmed; nothing changed\n");
            status = KILN_EXIT_USAGE;
            goto done;
        }
    }
    if (kiln_keyring_add (dir, key, name, &err) != 0) {
        status = kiln_cmd_fail ("trust", &err);
        goto done;
    }
    s_print (json, key, path, true, curve);
    status = KILN_EXIT_OK;
done:
    kiln_key_destroy (&key);
    return status;
}
