/* kiln release sign ARTIFACT.kar ... | kiln release verify FILE ... */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "artifact/kiln_artifact.h"
#include "artifact/kiln_release.h"
#include "client/kiln_cmds.h"
#include "common/kiln_fs.h"
#include "common/kiln_log.h"

static const char *s_usage =
    "usage: kiln release sign ARTIFACT.kar --model NAME --seq N --key RELEASE_KEY -o FILE\n"
    "       kiln release verify FILE --keyring DIR [--artifact F] [--state DIR]\n"
    "  A release record names the artifact a model runs, with a sequence number\n"
    "  and an expiry, signed by a release key (not the farm key).\n"
    "  'kiln release sign -h' and 'kiln release verify -h' show the options;\n"
    "  docs/release-format.md the record.\n";

static const char *s_sign_usage =
    "usage: kiln release sign ARTIFACT.kar --model NAME --seq N --key RELEASE_KEY\n"
    "                         -o FILE [--expires DURATION] [--farm-keyring DIR] [--json]\n"
    "  Write a release record for the artifact, signed by the release key.\n"
    "  The artifact is read and its members checked against its manifest; its\n"
    "  signature is checked against a farm keyring only with --farm-keyring.\n"
    "options:\n"
    "  --model NAME          the model this releases: 1..64 of [A-Za-z0-9._-],\n"
    "                        starting with a letter or digit\n"
    "  --seq N               release number, 1..2^63-1; hosts refuse a lower one\n"
    "                        than they have accepted for the model\n"
    "  --expires DURATION    lifetime: Ns, Nm, Nh or Nd, at most 365d (default 30d)\n"
    "  --key RELEASE_KEY     the release key's private PEM (from kiln keygen); it\n"
    "                        must not be the key that signed the artifact\n"
    "  -o, --output FILE     where to write the record (atomically)\n"
    "  --farm-keyring DIR    also check the artifact's signature against DIR\n"
    "  --json                print one JSON line: the record's fields and output\n";

static const char *s_verify_usage =
    "usage: kiln release verify FILE --keyring DIR [--artifact F] [--state DIR] [--json]\n"
    "  Exit 0 only when the record is well-formed, signed by a release key in\n"
    "  DIR and not expired; otherwise print the reason and exit 1.\n"
    "options:\n"
    "  --keyring DIR         the release keyring (release keys only, not farm keys)\n"
    "  --artifact F          also check that F is intact and is the artifact the\n"
    "                        record names\n"
    "  --state DIR           refuse a rollback: a seq lower than the highest\n"
    "                        accepted for the model in DIR, or the same seq naming\n"
    "                        another artifact; on success record the seq in\n"
    "                        DIR/<model>.json\n"
    "  --json                print one JSON line on success\n";

/* A whole number 1..KILN_RELEASE_MAX_SEQ written in plain digits, or 0. */
static uint64_t
s_parse_seq (const char *text)
{
    if (!*text || strspn (text, "0123456789") != strlen (text) || text[0] == '0')
        return 0;
    errno = 0;
    unsigned long long v = strtoull (text, NULL, 10);
    return errno || v > (unsigned long long) KILN_RELEASE_MAX_SEQ ? 0 : (uint64_t) v;
}

/* The record's fields as a JSON object.  Caller owns it. */
static json_t *
s_record_json (const kiln_release_t *rec)
{
    char issued[KILN_RELEASE_TIME_LEN], expires[KILN_RELEASE_TIME_LEN];
    kiln_release_format_time (rec->issued_at, issued);
    kiln_release_format_time (rec->expires_at, expires);
    return json_pack ("{s:s, s:s, s:s, s:s, s:s, s:i, s:I, s:s}",
                      "artifact", rec->artifact, "expires_at", expires,
                      "issued_at", issued, "key_id", rec->key_id, "model", rec->model,
                      "runtime_abi", rec->runtime_abi, "seq", (json_int_t) rec->seq,
                      "target", rec->target);
}

/* Print `obj` as one line of compact JSON with sorted keys; takes it. */
static void
s_print_json (json_t *obj)
{
    char *text = obj ? json_dumps (obj, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    puts (text ? text : "{}");
    free (text);
    json_decref (obj);
}

static int
s_sign (int argc, char **argv)
{
    const char *model = NULL, *seq_text = NULL, *key_path = NULL, *out = NULL;
    const char *expires = "30d", *farm_keyring = NULL;
    int json = 0;
    enum { OPT_MODEL = 256, OPT_SEQ, OPT_EXPIRES, OPT_KEY, OPT_FARM, OPT_JSON };
    static const struct option opts[] = {
        { "model", required_argument, NULL, OPT_MODEL },
        { "seq", required_argument, NULL, OPT_SEQ },
        { "expires", required_argument, NULL, OPT_EXPIRES },
        { "key", required_argument, NULL, OPT_KEY },
        { "output", required_argument, NULL, 'o' },
        { "farm-keyring", required_argument, NULL, OPT_FARM },
        { "json", no_argument, NULL, OPT_JSON },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    optind = 1;
    while ((c = getopt_long (argc, argv, "o:h", opts, NULL)) != -1) {
        switch (c) {
        case OPT_MODEL: model = optarg; break;
        case OPT_SEQ: seq_text = optarg; break;
        case OPT_EXPIRES: expires = optarg; break;
        case OPT_KEY: key_path = optarg; break;
        case 'o': out = optarg; break;
        case OPT_FARM: farm_keyring = optarg; break;
        case OPT_JSON: json = 1; break;
        case 'h': fputs (s_sign_usage, stdout); return 0;
        default: return kiln_cmd_usage (s_sign_usage, NULL);
        }
    }
    if (optind != argc - 1)
        return kiln_cmd_usage (s_sign_usage, "release sign takes one artifact");
    if (!model || !seq_text || !key_path || !out)
        return kiln_cmd_usage (s_sign_usage, "release sign needs --model, --seq, --key and -o");
    if (!kiln_release_model_ok (model))
        return kiln_cmd_usage (s_sign_usage,
                               "--model '%.80s' is not allowed: 1..%d of [A-Za-z0-9._-], "
                               "starting with a letter or digit", model, KILN_MAX_MODEL_NAME);
    uint64_t seq = s_parse_seq (seq_text);
    if (!seq)
        return kiln_cmd_usage (s_sign_usage, "--seq wants a whole number 1..%lld, got '%.40s'",
                               (long long) KILN_RELEASE_MAX_SEQ, seq_text);
    kiln_err_t err = { 0 };
    int64_t lifetime;
    if (kiln_release_parse_duration (expires, &lifetime, &err) != 0)
        return kiln_cmd_usage (s_sign_usage, "--expires: %s", err.msg);

    const char *path = argv[optind];
    kiln_artifact_t *art = NULL;
    kiln_key_t *key = NULL;
    char *envelope = NULL;
    size_t len;
    kiln_release_t rec;
    int status = 1;
    //  Reading checks every member against the manifest, so the content
    //  hash below names an intact artifact.
    if (!(art = kiln_artifact_read (path, &err)))
        goto fail;
    if (!kiln_artifact_is_signed (art)) {
        kiln_error (&err, KILN_EVERIFY, "artifact '%s' is not signed; release only what "
                    "the farm signed", path);
        goto fail;
    }
    if (farm_keyring && kiln_artifact_verify (art, farm_keyring, &err) != 0) {
        kiln_error_prefix (&err, "artifact '%s'", path);
        goto fail;
    }
    if (!(key = kiln_key_load_private (key_path, &err)))
        goto fail;
    if (strcmp (kiln_key_id (key), kiln_artifact_signer (art)) == 0) {
        kiln_error (&err, KILN_EINVAL,
                    "key %s signed the artifact '%s' and cannot also release it: who "
                    "builds and who releases must be different keys", kiln_key_id (key), path);
        goto fail;
    }
    if (kiln_release_init (&rec, art, model, seq, (int64_t) time (NULL), lifetime, &err) != 0
        || kiln_release_sign (&rec, key, &envelope, &len, &err) != 0
        || kiln_write_file_atomic (out, envelope, len, 0644, &err) != 0)
        goto fail;
    if (json) {
        json_t *obj = s_record_json (&rec);
        json_object_set_new (obj, "output", json_string (out));
        s_print_json (obj);
    }
    else {
        char expiry[KILN_RELEASE_TIME_LEN];
        kiln_release_format_time (rec.expires_at, expiry);
        printf ("%s: release seq %llu of model '%s', artifact %s, expires %s, signed by "
                "release key %s\n", out, (unsigned long long) rec.seq, rec.model,
                rec.artifact, expiry, rec.key_id);
    }
    status = 0;
fail:
    if (status)
        status = kiln_cmd_fail ("release sign", &err);
    free (envelope);
    kiln_key_destroy (&key);
    kiln_artifact_destroy (&art);
    return status;
}

static int
s_verify (int argc, char **argv)
{
    const char *keyring = NULL, *artifact = NULL, *state = NULL;
    int json = 0;
    enum { OPT_KEYRING = 256, OPT_ARTIFACT, OPT_STATE, OPT_JSON };
    static const struct option opts[] = {
        { "keyring", required_argument, NULL, OPT_KEYRING },
        { "artifact", required_argument, NULL, OPT_ARTIFACT },
        { "state", required_argument, NULL, OPT_STATE },
        { "json", no_argument, NULL, OPT_JSON },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    optind = 1;
    while ((c = getopt_long (argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case OPT_KEYRING: keyring = optarg; break;
        case OPT_ARTIFACT: artifact = optarg; break;
        case OPT_STATE: state = optarg; break;
        case OPT_JSON: json = 1; break;
        case 'h': fputs (s_verify_usage, stdout); return 0;
        default: return kiln_cmd_usage (s_verify_usage, NULL);
        }
    }
    if (optind != argc - 1)
        return kiln_cmd_usage (s_verify_usage, "release verify takes one record file");
    if (!keyring)
        return kiln_cmd_usage (s_verify_usage, "missing --keyring DIR (the release keyring)");

    const char *path = argv[optind];
    kiln_err_t err = { 0 };
    kiln_keyring_t *ring = NULL;
    kiln_artifact_t *art = NULL;
    kiln_release_t rec;
    bool recorded = false;
    int status = 1;
    if (!(ring = kiln_keyring_load (keyring, &err))
        || kiln_release_read (path, ring, &rec, &err) != 0)
        goto fail;
    //  In the order a host applies them: the cheap checks on the record,
    //  then the artifact, and the state last because it is written.
    if (kiln_release_check_expiry (&rec, (int64_t) time (NULL), &err) != 0)
        goto fail_named;
    if (artifact) {
        if (!(art = kiln_artifact_read (artifact, &err)))
            goto fail;
        if (kiln_release_check_artifact (&rec, art, &err) != 0)
            goto fail_named;
    }
    if (state && kiln_release_accept (&rec, state, &recorded, &err) != 0)
        goto fail_named;
    if (json) {
        json_t *obj = s_record_json (&rec);
        json_object_set_new (obj, "ok", json_true ());
        json_object_set_new (obj, "artifact_checked", json_boolean (artifact != NULL));
        json_object_set_new (obj, "state", !state ? json_null ()
                                           : json_string (recorded ? "recorded" : "unchanged"));
        s_print_json (obj);
    }
    else {
        char expiry[KILN_RELEASE_TIME_LEN];
        kiln_release_format_time (rec.expires_at, expiry);
        printf ("%s: ok, release seq %llu of model '%s', artifact %s%s, expires %s, signed "
                "by release key %s\n", path, (unsigned long long) rec.seq, rec.model,
                rec.artifact, artifact ? " (checked)" : "", expiry, rec.key_id);
    }
    status = 0;
    goto done;
fail_named:
    kiln_error_prefix (&err, "release record '%s'", path);
fail:
    kiln_print_error ("kiln release verify: refused",
                      err.msg[0] ? err.msg : kiln_strerror (err.code));
    status = err.code == KILN_EIO || err.code == KILN_ENOMEM || err.code == KILN_ENOTFOUND
                 ? KILN_EXIT_FAIL : KILN_EXIT_VERIFY;
done:
    kiln_artifact_destroy (&art);
    kiln_keyring_destroy (&ring);
    return status;
}

/* The release subcommands, dispatched like kiln's own. */
static const struct {
    const char *name;
    int (*fn) (int argc, char **argv);
} s_subcommands[] = {
    { "sign", s_sign },
    { "verify", s_verify },
};

int
cmd_release (int argc, char **argv)
{
    if (argc < 2)
        return kiln_cmd_usage (s_usage, "release needs 'sign' or 'verify'");
    if (strcmp (argv[1], "-h") == 0 || strcmp (argv[1], "--help") == 0) {
        fputs (s_usage, stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof s_subcommands / sizeof s_subcommands[0]; i++)
        if (strcmp (argv[1], s_subcommands[i].name) == 0)
            return s_subcommands[i].fn (argc - 1, argv + 1);
    return kiln_cmd_usage (s_usage, "'%.40s' is not a release command", argv[1]);
}
