/*
 * kiln_local — compile in-process with the builtin compiler, the embedded
 * default when no broker is configured.  The artifact is signed with the
 * user's own key, created on first use under the config directory.
 */
#include "client/kiln_client.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_fs.h"
#include "common/kiln_log.h"
#include "compiler/kiln_compiler.h"

int
kiln_user_keyring (char *buf, size_t size, kiln_err_t *err)
{
    if (kiln_config_dir (buf, size, err) != 0)
        return -err->code;
    size_t n = strlen (buf);
    if (n + sizeof "/keyring" > size)
        return kiln_error (err, KILN_ELIMIT, "config directory path too long: '%s'", buf);
    memcpy (buf + n, "/keyring", sizeof "/keyring");
    return 0;
}

int
kiln_keyring_add (const char *dir, const kiln_key_t *key, const char *name, kiln_err_t *err)
{
    char path[PATH_MAX];
    if (snprintf (path, sizeof path, "%s/%s.pub", dir, name) >= (int) sizeof path)
        return kiln_error (err, KILN_ELIMIT, "keyring path too long: '%s'", dir);
    if (kiln_mkdir_p (dir, 0755, err) != 0)
        return -err->code;
    return kiln_key_write_public (key, path, err);
}

/* Put the user's own public key in their keyring (CONFIG/keyring) when it
 * is not there yet, so that kiln.load and kiln verify trust local builds
 * without copying by hand.  A failure is logged, not fatal: the build
 * itself does not depend on it. */
static void
s_trust_own (const kiln_key_t *key)
{
    char dir[PATH_MAX - 64], name[64], path[PATH_MAX];
    kiln_err_t err = { 0 };
    if (kiln_user_keyring (dir, sizeof dir, &err) != 0)
        return;
    snprintf (name, sizeof name, "own-%s", kiln_key_id (key));
    if (snprintf (path, sizeof path, "%s/%s.pub", dir, name) >= (int) sizeof path
        || kiln_file_exists (path))
        return;
    if (kiln_keyring_add (dir, key, name, &err) != 0)
        kiln_log_warn ("could not add your key %s to your keyring '%s': %s", kiln_key_id (key),
                       dir, err.msg);
}

/* Load the key at `key_path`, or the user's default key, creating the
 * default pair when it does not exist yet (and putting its public half
 * in the user's keyring).  Caller owns the key. */
static kiln_key_t *
s_user_key (const char *key_path, kiln_err_t *err)
{
    if (key_path)
        return kiln_key_load_private (key_path, err);

    char dir[PATH_MAX - 16];
    if (kiln_config_dir (dir, sizeof dir - 5, err) != 0)
        return NULL;
    strcat (dir, "/keys");
    char path[PATH_MAX];
    snprintf (path, sizeof path, "%s/kiln.key", dir);
    kiln_key_t *key;
    if (kiln_file_exists (path)) {
        if ((key = kiln_key_load_private (path, err)))
            s_trust_own (key);
        return key;
    }

    key = kiln_key_generate (err);
    if (!key)
        return NULL;
    if (kiln_key_write_pair (key, dir, err) != 0) {
        kiln_key_destroy (&key);
        return NULL;
    }
    s_trust_own (key);
    kiln_log_notice ("created signing key %s in '%s' (your keyring trusts it); add "
                     "'%s/kiln.pub' to the keyring of other hosts that run your artifacts",
                     kiln_key_id (key), dir, dir);
    return key;
}

/* Provenance of a local build: who and where, not part of the content
 * hash; for a fallback, which farm could not be reached.  Caller owns
 * the string (free()). */
static char *
s_local_provenance (const char *fallback_from)
{
    char host[256] = "unknown";
    gethostname (host, sizeof host - 1);
    char stamp[32];
    time_t now = time (NULL);
    struct tm tm;
    gmtime_r (&now, &tm);
    strftime (stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &tm);
    json_t *obj = json_pack ("{s:s, s:s, s:s}", "builder", "local",
                             "host", host, "built_at", stamp);
    if (obj && fallback_from) {
        json_object_set_new (obj, "fallback", json_true ());
        json_object_set_new (obj, "unreachable_broker", json_string (fallback_from));
    }
    char *text = obj ? json_dumps (obj, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    json_decref (obj);
    return text;
}

int
kiln_compile_local (kiln_graph_t *g, const kiln_compile_opts_t *opts,
                    const char *key_path, const char *out_path,
                    kiln_compile_result_t *res, kiln_err_t *err)
{
    return kiln_compile_local_fallback (g, opts, key_path, out_path, NULL, res, err);
}

int
kiln_compile_local_fallback (kiln_graph_t *g, const kiln_compile_opts_t *opts,
                             const char *key_path, const char *out_path,
                             const char *fallback_from, kiln_compile_result_t *res,
                             kiln_err_t *err)
{
    int rc = -KILN_EINVAL;
    kiln_key_t *key = NULL;
    kiln_artifact_t *art = NULL;
    char *provenance = NULL;
    memset (res, 0, sizeof *res);

    key = s_user_key (key_path, err);
    if (!key) {
        rc = -err->code;
        goto done;
    }
    art = kiln_cc_compile (g, opts ? opts->compiler_args : NULL, err);
    if (!art) {
        rc = -err->code;
        goto done;
    }
    provenance = s_local_provenance (fallback_from);
    if ((rc = kiln_artifact_sign (art, key, provenance, err)) != 0
        || (rc = kiln_artifact_write (art, out_path, err)) != 0
        || (rc = kiln_artifact_digest (art, res->artifact, err)) != 0)
        goto done;

    kiln_manifest_t *m = kiln_artifact_manifest (art);
    snprintf (res->action_key, sizeof res->action_key, "%s", m->action_key);
    snprintf (res->graph_digest, sizeof res->graph_digest, "%s", m->graph_digest);
    res->cached = false;
    res->worker[0] = '\0';
    snprintf (res->signer, sizeof res->signer, "%s", kiln_key_id (key));
    rc = 0;
done:
    free (provenance);
    kiln_artifact_destroy (&art);
    kiln_key_destroy (&key);
    return rc;
}
