/*
 * kiln_store — content-addressed artifacts and the action cache on disk.
 */
#include "broker/kiln_store.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_fs.h"
#include "common/kiln_limits.h"

struct kiln_store {
    char *root;             /* the state directory */
    char *keyring;          /* STATE/keyring once a key is trusted, else NULL */
};

kiln_store_t *
kiln_store_new (const char *state_dir, kiln_err_t *err)
{
    char path[PATH_MAX];
    if (snprintf (path, sizeof path, "%s/cas/sha256", state_dir) >= (int) sizeof path) {
        kiln_error (err, KILN_ELIMIT, "state directory path too long: '%s'", state_dir);
        return NULL;
    }
    if (kiln_mkdir_p (path, 0755, err) != 0)
        return NULL;
    snprintf (path, sizeof path, "%s/ac", state_dir);
    if (kiln_mkdir_p (path, 0755, err) != 0)
        return NULL;
    kiln_store_t *self = calloc (1, sizeof *self);
    if (!self || !(self->root = strdup (state_dir))) {
        free (self);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    return self;
}

void
kiln_store_destroy (kiln_store_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    free ((*self_p)->root);
    free ((*self_p)->keyring);
    free (*self_p);
    *self_p = NULL;
}

int
kiln_store_trust_key (kiln_store_t *self, const kiln_key_t *key, kiln_err_t *err)
{
    char dir[PATH_MAX], path[PATH_MAX];
    if (snprintf (dir, sizeof dir, "%s/keyring", self->root) >= (int) sizeof dir
        || snprintf (path, sizeof path, "%s/farm.pub", dir) >= (int) sizeof path)
        return kiln_error (err, KILN_ELIMIT, "state directory path too long");
    if (kiln_mkdir_p (dir, 0755, err) != 0 || kiln_key_write_public (key, path, err) != 0)
        return -err->code;
    free (self->keyring);
    if (!(self->keyring = strdup (dir)))
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    return 0;
}

/* STATE/cas/sha256/ab/<hex>, creating the fan-out directory when asked. */
static int
s_cas_path (kiln_store_t *self, const char *hex, bool create, char *out, size_t size,
            kiln_err_t *err)
{
    if (!kiln_is_digest_hex (hex))
        return kiln_error (err, KILN_EINVAL, "'%.80s' is not a SHA-256 in hex", hex);
    if (snprintf (out, size, "%s/cas/sha256/%.2s", self->root, hex) >= (int) size)
        return kiln_error (err, KILN_ELIMIT, "store path too long");
    if (create && kiln_mkdir_p (out, 0755, err) != 0)
        return -err->code;
    if (snprintf (out, size, "%s/cas/sha256/%.2s/%s", self->root, hex, hex) >= (int) size)
        return kiln_error (err, KILN_ELIMIT, "store path too long");
    return 0;
}

static int
s_ac_path (kiln_store_t *self, const char *action_key, char *out, size_t size,
           kiln_err_t *err)
{
    if (!kiln_is_digest_hex (action_key))
        return kiln_error (err, KILN_EINVAL, "'%.80s' is not an action key", action_key);
    if (snprintf (out, size, "%s/ac/%s", self->root, action_key) >= (int) size)
        return kiln_error (err, KILN_ELIMIT, "store path too long");
    return 0;
}

int
kiln_store_put_artifact (kiln_store_t *self, const char *digest_hex,
                         const uint8_t *data, size_t len, kiln_err_t *err)
{
    char path[PATH_MAX];
    if (s_cas_path (self, digest_hex, true, path, sizeof path, err) != 0)
        return -err->code;
    return kiln_write_file_atomic (path, data, len, 0644, err);
}

int
kiln_store_put_action (kiln_store_t *self, const char *action_key,
                       const char *digest_hex, kiln_err_t *err)
{
    char path[PATH_MAX];
    if (s_ac_path (self, action_key, path, sizeof path, err) != 0)
        return -err->code;
    if (!kiln_is_digest_hex (digest_hex))
        return kiln_error (err, KILN_EINVAL, "'%.80s' is not a SHA-256 in hex", digest_hex);
    char line[KILN_HEX_LEN + 1];
    snprintf (line, sizeof line, "%s\n", digest_hex);
    return kiln_write_file_atomic (path, line, KILN_HEX_LEN, 0644, err);
}

int
kiln_store_lookup (kiln_store_t *self, const char *action_key,
                   char artifact_hex[KILN_HEX_LEN], uint8_t **data, size_t *len,
                   kiln_err_t *err)
{
    *data = NULL;
    *len = 0;
    artifact_hex[0] = '\0';
    char path[PATH_MAX];
    if (s_ac_path (self, action_key, path, sizeof path, err) != 0)
        return -err->code;
    if (!kiln_file_exists (path))
        return -KILN_ENOTFOUND;

    uint8_t *entry = NULL;
    size_t entry_len = 0;
    if (kiln_read_file (path, KILN_HEX_LEN + 8, &entry, &entry_len, err) != 0)
        return -err->code;
    char hex[KILN_HEX_LEN];
    size_t n = entry_len;
    while (n > 0 && (entry[n - 1] == '\n' || entry[n - 1] == '\r'))
        n--;
    bool ok = n == KILN_HEX_LEN - 1;
    if (ok) {
        memcpy (hex, entry, n);
        hex[n] = '\0';
        ok = kiln_is_digest_hex (hex);
    }
    free (entry);
    if (!ok)
        return kiln_error (err, KILN_EFORMAT, "action cache entry '%s' is damaged", path);

    char cas[PATH_MAX];
    if (s_cas_path (self, hex, false, cas, sizeof cas, err) != 0)
        return -err->code;
    uint8_t *bytes = NULL;
    size_t bytes_len = 0;
    if (kiln_read_file (cas, KILN_MAX_ARTIFACT_BYTES, &bytes, &bytes_len, err) != 0)
        return kiln_error_prefix (err, "action %.12s points at a missing artifact", action_key);
    kiln_artifact_t *art = kiln_artifact_read_mem (bytes, bytes_len, err);
    char actual[KILN_HEX_LEN] = "";
    if (!art || kiln_artifact_digest (art, actual, err) != 0
        || (self->keyring && kiln_artifact_verify (art, self->keyring, err) != 0)) {
        kiln_artifact_destroy (&art);
        free (bytes);
        return kiln_error_prefix (err, "stored artifact '%s'", cas);
    }
    kiln_artifact_destroy (&art);
    if (strcmp (actual, hex) != 0) {
        free (bytes);
        return kiln_error (err, KILN_EVERIFY, "stored artifact '%s' has content hash %s",
                           cas, actual);
    }
    memcpy (artifact_hex, hex, KILN_HEX_LEN);
    *data = bytes;
    *len = bytes_len;
    return 0;
}
