/*
 * kiln_release — release records: encoding, strict decoding, signing,
 * verification, and the rollback state a host keeps.
 *
 * The record is parsed only after its signature has been checked, so
 * that the JSON parser sees nothing a release key did not sign; the
 * envelope around it, which is not signed, holds four short strings and
 * is bounded before it is parsed.  Base64 is strict (no whitespace, the
 * one canonical spelling) for the same reason the record must be
 * canonical: one record, one set of bytes.
 */
#include "artifact/kiln_release.h"

#include "artifact/kiln_artifact_priv.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "common/kiln_fs.h"

#define S_FORMAT_NAME       "kiln-release"
#define S_STATE_FORMAT_NAME "kiln-release-state"
#define S_STATE_VERSION     1
#define S_MAX_TIME          253402300799LL   /* 9999-12-31T23:59:59Z */
#define S_SIG_B64_LEN       88               /* base64 of 64 bytes */
#define S_ALG_MAX           32               /* envelope "algorithm" */

/* --- names, times, durations ------------------------------------------ */

static bool
s_is_alnum (char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}

bool
kiln_release_model_ok (const char *name)
{
    size_t n = strnlen (name, KILN_MAX_MODEL_NAME + 1);
    if (n == 0 || n > KILN_MAX_MODEL_NAME || !s_is_alnum (name[0]))
        return false;
    for (size_t i = 1; i < n; i++)
        if (!s_is_alnum (name[i]) && name[i] != '.' && name[i] != '_' && name[i] != '-')
            return false;
    return true;
}

static bool
s_key_id_ok (const char *id)
{
    if (strnlen (id, KILN_KEY_ID_LEN) != KILN_KEY_ID_LEN - 1)
        return false;
    for (int i = 0; i < KILN_KEY_ID_LEN - 1; i++)
        if (!((id[i] >= '0' && id[i] <= '9') || (id[i] >= 'a' && id[i] <= 'f')))
            return false;
    return true;
}

int
kiln_release_parse_duration (const char *text, int64_t *seconds, kiln_err_t *err)
{
    static const struct { char unit; int64_t seconds; } units[] = {
        { 's', 1 }, { 'm', 60 }, { 'h', 3600 }, { 'd', 86400 },
    };
    size_t digits = strspn (text, "0123456789");
    int64_t scale = 0;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
        if (digits > 0 && text[digits] == units[i].unit && text[digits + 1] == '\0')
            scale = units[i].seconds;
    if (!scale || text[0] == '0')
        return kiln_error (err, KILN_EINVAL,
                           "duration '%.40s' is not a whole number followed by s, m, h or d "
                           "(e.g. 3600s, 90m, 12h, 30d)", text);
    //  More than 12 digits is over the bound whatever the unit, and
    //  leaving them out keeps the product from overflowing.
    int64_t v = digits <= 12 ? strtoll (text, NULL, 10) * scale : INT64_MAX;
    if (v > KILN_MAX_RELEASE_SECONDS)
        return kiln_error (err, KILN_ELIMIT,
                           "duration '%.40s' is longer than the limit of %lldd", text,
                           KILN_MAX_RELEASE_SECONDS / 86400);
    *seconds = v;
    return 0;
}

void
kiln_release_format_time (int64_t t, char out[KILN_RELEASE_TIME_LEN])
{
    struct tm tm;
    time_t tt = (time_t) t;
    if (t < 0 || t > S_MAX_TIME || !gmtime_r (&tt, &tm)
        || strftime (out, KILN_RELEASE_TIME_LEN, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0)
        snprintf (out, KILN_RELEASE_TIME_LEN, "(invalid time)");
}

int
kiln_release_parse_time (const char *text, int64_t *t)
{
    //  Exactly "DDDD-DD-DDTDD:DD:DDZ"; the round trip below refuses
    //  values out of range (month 13, February 30, second 60).
    static const char pattern[] = "DDDD-DD-DDTDD:DD:DDZ";
    if (strnlen (text, sizeof pattern) != sizeof pattern - 1)
        return -KILN_EFORMAT;
    for (size_t i = 0; i < sizeof pattern - 1; i++) {
        bool ok = pattern[i] == 'D' ? text[i] >= '0' && text[i] <= '9' : text[i] == pattern[i];
        if (!ok)
            return -KILN_EFORMAT;
    }
    struct tm tm = { 0 };
    tm.tm_year = atoi (text) - 1900;
    tm.tm_mon = atoi (text + 5) - 1;
    tm.tm_mday = atoi (text + 8);
    tm.tm_hour = atoi (text + 11);
    tm.tm_min = atoi (text + 14);
    tm.tm_sec = atoi (text + 17);
    time_t v = timegm (&tm);
    char back[KILN_RELEASE_TIME_LEN];
    kiln_release_format_time ((int64_t) v, back);
    if (v < 0 || strcmp (back, text) != 0)
        return -KILN_EFORMAT;
    *t = (int64_t) v;
    return 0;
}

/* --- checking --------------------------------------------------------- */

/* Every field's bounds; the key id only when `need_key` (a record is
 * made without one and signed later). */
static int
s_check (const kiln_release_t *self, bool need_key, kiln_err_t *err)
{
    if (self->format_version != KILN_RELEASE_FORMAT_VERSION)
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "unsupported release record format version %d (this kiln handles version %d)",
                           self->format_version, KILN_RELEASE_FORMAT_VERSION);
    if (!kiln_release_model_ok (self->model))
        return kiln_error (err, KILN_EFORMAT,
                           "release record: model name '%.80s' is not allowed (1..%d of "
                           "[A-Za-z0-9._-], starting with a letter or digit)",
                           self->model, KILN_MAX_MODEL_NAME);
    if (!kiln_is_digest_hex (self->artifact))
        return kiln_error (err, KILN_EFORMAT,
                           "release record: field 'artifact' is not 64 lower-case hex characters");
    if (self->seq < 1 || self->seq > (uint64_t) KILN_RELEASE_MAX_SEQ)
        return kiln_error (err, KILN_ELIMIT, "release record: seq %llu is outside 1..%lld",
                           (unsigned long long) self->seq, (long long) KILN_RELEASE_MAX_SEQ);
    size_t tlen = strnlen (self->target, sizeof self->target);
    if (tlen == 0 || tlen >= sizeof self->target)
        return kiln_error (err, tlen ? KILN_ELIMIT : KILN_EFORMAT,
                           "release record: field 'target' is %s", tlen ? "longer than 63 bytes"
                                                                        : "empty");
    if (self->runtime_abi < 1)
        return kiln_error (err, KILN_EFORMAT, "release record: runtime_abi %d is not positive",
                           self->runtime_abi);
    if (self->issued_at < 0 || self->issued_at > S_MAX_TIME
        || self->expires_at < 0 || self->expires_at > S_MAX_TIME)
        return kiln_error (err, KILN_EFORMAT,
                           "release record: issued_at or expires_at is outside 1970..9999");
    if (self->expires_at <= self->issued_at)
        return kiln_error (err, KILN_EFORMAT,
                           "release record: expires_at is not after issued_at");
    if (self->expires_at - self->issued_at > KILN_MAX_RELEASE_SECONDS)
        return kiln_error (err, KILN_ELIMIT,
                           "release record: lifetime of %lld s is longer than the limit of %lld s",
                           (long long) (self->expires_at - self->issued_at),
                           (long long) KILN_MAX_RELEASE_SECONDS);
    if (need_key && !s_key_id_ok (self->key_id))
        return kiln_error (err, KILN_EFORMAT,
                           "release record: key_id is not %d lower-case hex characters",
                           KILN_KEY_ID_LEN - 1);
    return 0;
}

int
kiln_release_check (const kiln_release_t *self, kiln_err_t *err)
{
    return s_check (self, true, err);
}

int
kiln_release_init (kiln_release_t *self, kiln_artifact_t *art, const char *model,
                   uint64_t seq, int64_t issued_at, int64_t lifetime, kiln_err_t *err)
{
    memset (self, 0, sizeof *self);
    if (!kiln_release_model_ok (model))
        return kiln_error (err, KILN_EINVAL,
                           "model name '%.80s' is not allowed (1..%d of [A-Za-z0-9._-], "
                           "starting with a letter or digit)", model, KILN_MAX_MODEL_NAME);
    if (lifetime < 1 || lifetime > KILN_MAX_RELEASE_SECONDS)
        return kiln_error (err, KILN_ELIMIT, "release lifetime %lld s is outside 1..%lld s",
                           (long long) lifetime, (long long) KILN_MAX_RELEASE_SECONDS);
    int rc = kiln_artifact_digest (art, self->artifact, err);
    if (rc)
        return rc;
    const kiln_manifest_t *m = kiln_artifact_manifest (art);
    self->format_version = KILN_RELEASE_FORMAT_VERSION;
    snprintf (self->model, sizeof self->model, "%s", model);
    snprintf (self->target, sizeof self->target, "%s", m->target);
    self->runtime_abi = m->runtime_abi;
    self->seq = seq;
    self->issued_at = issued_at;
    self->expires_at = issued_at + lifetime;
    return s_check (self, false, err);
}

/* --- encoding --------------------------------------------------------- */

/* Dump `root` compact with sorted keys, plus a newline when asked, into
 * a malloc'd string bounded by KILN_MAX_RELEASE_BYTES.  Takes `root`. */
static int
s_dump (json_t *root, const char *what, bool newline, char **out, size_t *len,
        kiln_err_t *err)
{
    char *text = root ? json_dumps (root, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    json_decref (root);
    if (!text)
        return kiln_error (err, KILN_ENOMEM, "out of memory encoding %s", what);
    size_t n = strlen (text);
    if (n + 1 > KILN_MAX_RELEASE_BYTES) {
        free (text);
        return kiln_error (err, KILN_ELIMIT, "%s would be more than %u bytes", what,
                           KILN_MAX_RELEASE_BYTES);
    }
    if (newline) {
        char *grown = realloc (text, n + 2);
        if (!grown) {
            free (text);
            return kiln_error (err, KILN_ENOMEM, "out of memory encoding %s", what);
        }
        text = grown;
        text[n++] = '\n';
        text[n] = '\0';
    }
    *out = text;
    *len = n;
    return 0;
}

int
kiln_release_encode (const kiln_release_t *self, char **out, size_t *len,
                     kiln_err_t *err)
{
    *out = NULL;
    *len = 0;
    int rc = s_check (self, true, err);
    if (rc)
        return rc;
    char issued[KILN_RELEASE_TIME_LEN], expires[KILN_RELEASE_TIME_LEN];
    kiln_release_format_time (self->issued_at, issued);
    kiln_release_format_time (self->expires_at, expires);
    json_error_t jerr;
    json_t *root = json_pack_ex (&jerr, 0, "{s:s, s:s, s:s, s:i, s:s, s:s, s:s, s:i, s:I, s:s}",
                                 "artifact", self->artifact,
                                 "expires_at", expires,
                                 "format", S_FORMAT_NAME,
                                 "format_version", self->format_version,
                                 "issued_at", issued,
                                 "key_id", self->key_id,
                                 "model", self->model,
                                 "runtime_abi", self->runtime_abi,
                                 "seq", (json_int_t) self->seq,
                                 "target", self->target);
    //  Every field but the target is ASCII by construction.
    if (!root)
        return kiln_error (err, KILN_EFORMAT, "release record: target '%.63s' is not valid UTF-8",
                           self->target);
    return s_dump (root, "release record", false, out, len, err);
}

/* --- strict decoding -------------------------------------------------- */

/* Fail unless every key of `obj` is one of `keys` (NULL-terminated). */
static int
s_only_keys (const json_t *obj, const char *what, const char *const *keys,
             kiln_err_t *err)
{
    const char *key;
    json_t *val;
    json_object_foreach ((json_t *) obj, key, val) {
        (void) val;
        bool known = false;
        for (int i = 0; keys[i] && !known; i++)
            known = strcmp (key, keys[i]) == 0;
        if (!known)
            return kiln_error (err, KILN_EFORMAT, "%s: unknown field '%.64s'", what, key);
    }
    return 0;
}

/* The string field `key` of `obj` into buf[cap]; an error names it. */
static int
s_get_str (const json_t *obj, const char *what, const char *key, char *buf,
           size_t cap, kiln_err_t *err)
{
    const json_t *v = json_object_get (obj, key);
    if (!v)
        return kiln_error (err, KILN_EFORMAT, "%s: missing field '%s'", what, key);
    if (!json_is_string (v))
        return kiln_error (err, KILN_EFORMAT, "%s: field '%s' is not a string", what, key);
    size_t n = json_string_length (v);
    if (n >= cap)
        return kiln_error (err, KILN_ELIMIT, "%s: field '%s' is longer than %zu bytes",
                           what, key, cap - 1);
    memcpy (buf, json_string_value (v), n);
    buf[n] = '\0';
    return 0;
}

/* The integer field `key` of `obj`, in lo..hi. */
static int
s_get_int (const json_t *obj, const char *what, const char *key, long long lo,
           long long hi, long long *out, kiln_err_t *err)
{
    const json_t *v = json_object_get (obj, key);
    if (!v)
        return kiln_error (err, KILN_EFORMAT, "%s: missing field '%s'", what, key);
    if (!json_is_integer (v))
        return kiln_error (err, KILN_EFORMAT, "%s: field '%s' is not an integer", what, key);
    long long x = (long long) json_integer_value (v);
    if (x < lo || x > hi)
        return kiln_error (err, KILN_ELIMIT, "%s: field '%s' is %lld, outside %lld..%lld",
                           what, key, x, lo, hi);
    *out = x;
    return 0;
}

/* Parse bounded JSON text that must be an object.  Caller owns *root. */
static int
s_load_object (const char *text, size_t len, const char *what, json_t **root,
               kiln_err_t *err)
{
    *root = NULL;
    if (len > KILN_MAX_RELEASE_BYTES)
        return kiln_error (err, KILN_ELIMIT, "%s is %zu bytes, more than the limit of %u",
                           what, len, KILN_MAX_RELEASE_BYTES);
    json_error_t jerr;
    *root = json_loadb (text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!*root)
        return kiln_error (err, KILN_EFORMAT, "%s is not valid JSON: %s (line %d, column %d)",
                           what, jerr.text, jerr.line, jerr.column);
    if (!json_is_object (*root)) {
        json_decref (*root);
        *root = NULL;
        return kiln_error (err, KILN_EFORMAT, "%s is not a JSON object", what);
    }
    return 0;
}

/* The "format" and "format_version" fields, checked before any other so
 * that a newer format is refused as such rather than field by field. */
static int
s_get_format (const json_t *root, const char *what, const char *format, int version,
              kiln_err_t *err)
{
    char name[32];
    long long v;
    int rc;
    if ((rc = s_get_str (root, what, "format", name, sizeof name, err)))
        return rc;
    if (strcmp (name, format) != 0)
        return kiln_error (err, KILN_EFORMAT, "%s: format is '%s', not '%s'", what, name, format);
    if ((rc = s_get_int (root, what, "format_version", 0, INT_MAX, &v, err)))
        return rc;
    if (v != version)
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "unsupported %s format version %lld (this kiln reads version %d)",
                           what, v, version);
    return 0;
}

static int
s_get_time (const json_t *root, const char *key, int64_t *t, kiln_err_t *err)
{
    char text[KILN_RELEASE_TIME_LEN];
    int rc = s_get_str (root, "release record", key, text, sizeof text, err);
    if (rc)
        return rc;
    if (kiln_release_parse_time (text, t) != 0)
        return kiln_error (err, KILN_EFORMAT,
                           "release record: field '%s' is '%s', not a UTC time like "
                           "2026-11-20T10:00:00Z", key, text);
    return 0;
}

int
kiln_release_decode (const char *json, size_t len, kiln_release_t *out,
                     kiln_err_t *err)
{
    static const char *const keys[] = {
        "artifact", "expires_at", "format", "format_version", "issued_at", "key_id",
        "model", "runtime_abi", "seq", "target", NULL,
    };
    const char *what = "release record";
    memset (out, 0, sizeof *out);
    json_t *root;
    int rc = s_load_object (json, len, what, &root, err);
    if (rc)
        return rc;
    long long seq = 0, abi = 0;
    kiln_release_t r = { .format_version = KILN_RELEASE_FORMAT_VERSION };
    if ((rc = s_get_format (root, what, S_FORMAT_NAME, KILN_RELEASE_FORMAT_VERSION, err))
        || (rc = s_only_keys (root, what, keys, err))
        || (rc = s_get_str (root, what, "model", r.model, sizeof r.model, err))
        || (rc = s_get_str (root, what, "artifact", r.artifact, sizeof r.artifact, err))
        || (rc = s_get_int (root, what, "seq", 1, KILN_RELEASE_MAX_SEQ, &seq, err))
        || (rc = s_get_str (root, what, "target", r.target, sizeof r.target, err))
        || (rc = s_get_int (root, what, "runtime_abi", 1, INT_MAX, &abi, err))
        || (rc = s_get_time (root, "issued_at", &r.issued_at, err))
        || (rc = s_get_time (root, "expires_at", &r.expires_at, err))
        || (rc = s_get_str (root, what, "key_id", r.key_id, sizeof r.key_id, err)))
        goto done;
    r.seq = (uint64_t) seq;
    r.runtime_abi = (int) abi;
    if ((rc = s_check (&r, true, err)))
        goto done;
    //  One record, one spelling: the bytes must be what encoding the
    //  parsed record gives back.
    char *canon;
    size_t canon_len;
    if ((rc = kiln_release_encode (&r, &canon, &canon_len, err)))
        goto done;
    if (canon_len != len || memcmp (canon, json, len) != 0)
        rc = kiln_error (err, KILN_EFORMAT,
                         "release record is not in canonical form (compact JSON, sorted keys, "
                         "no newline)");
    free (canon);
    if (!rc)
        *out = r;
done:
    json_decref (root);
    return rc;
}

/* --- base64 ----------------------------------------------------------- */

/* Base64 of `len` bytes; caller owns the string. */
static char *
s_base64 (const uint8_t *data, size_t len)
{
    char *out = malloc (4 * ((len + 2) / 3) + 1);
    if (out)
        EVP_EncodeBlock ((unsigned char *) out, data, (int) len);
    return out;
}

/* Decode strict base64 (standard alphabet, padded, no whitespace: the
 * one spelling s_base64 writes) of at most `cap` bytes into `out`.
 * -KILN_EFORMAT or -KILN_ELIMIT. */
static int
s_unbase64 (const char *text, size_t n, uint8_t *out, size_t cap, size_t *len)
{
    if (n == 0 || n % 4 != 0)
        return -KILN_EFORMAT;
    if (n / 4 * 3 > cap + 2)
        return -KILN_ELIMIT;
    uint8_t *buf = malloc (n / 4 * 3);
    if (!buf)
        return -KILN_ENOMEM;
    int got = EVP_DecodeBlock (buf, (const unsigned char *) text, (int) n);
    size_t pad = (size_t) (text[n - 1] == '=') + (size_t) (text[n - 2] == '=');
    int rc = 0;
    if (got < 0 || (size_t) got < pad)
        rc = -KILN_EFORMAT;
    else if ((size_t) got - pad > cap)
        rc = -KILN_ELIMIT;
    else {
        size_t m = (size_t) got - pad;
        char *back = s_base64 (buf, m);
        if (!back)
            rc = -KILN_ENOMEM;
        else if (strlen (back) != n || memcmp (back, text, n) != 0)
            rc = -KILN_EFORMAT;
        else {
            memcpy (out, buf, m);
            *len = m;
        }
        free (back);
    }
    free (buf);
    return rc;
}

/* --- signing ---------------------------------------------------------- */

int
kiln_release_sign (kiln_release_t *self, const kiln_key_t *key, char **out,
                   size_t *len, kiln_err_t *err)
{
    *out = NULL;
    *len = 0;
    snprintf (self->key_id, sizeof self->key_id, "%s", kiln_key_id (key));
    char *record;
    size_t record_len;
    int rc = kiln_release_encode (self, &record, &record_len, err);
    if (rc)
        return rc;
    uint8_t sig[KILN_SIG_LEN];
    if ((rc = kiln_key_sign (key, record, record_len, sig, err))) {
        free (record);
        return rc;
    }
    char *record_b64 = s_base64 ((const uint8_t *) record, record_len);
    char *sig_b64 = s_base64 (sig, sizeof sig);
    free (record);
    json_t *root = record_b64 && sig_b64
                   ? json_pack ("{s:s, s:s, s:s, s:s}", "algorithm", KILN_SIG_ALGORITHM,
                                "key_id", self->key_id, "record", record_b64,
                                "signature", sig_b64)
                   : NULL;
    free (record_b64);
    free (sig_b64);
    return s_dump (root, "release envelope", true, out, len, err);
}

/* --- verifying -------------------------------------------------------- */

/* The envelope's fields, bounded. */
typedef struct {
    char algorithm[S_ALG_MAX];              /* "ed25519" */
    char key_id[KILN_KEY_ID_LEN];           /* who signed */
    uint8_t record[KILN_MAX_RELEASE_BYTES]; /* the signed bytes */
    size_t record_len;
    uint8_t sig[KILN_SIG_LEN];              /* raw Ed25519 */
} s_envelope_t;

static int
s_envelope_decode (const uint8_t *data, size_t len, s_envelope_t *env,
                   kiln_err_t *err)
{
    static const char *const keys[] = { "algorithm", "key_id", "record", "signature", NULL };
    const char *what = "release envelope";
    json_t *root;
    int rc = s_load_object ((const char *) data, len, what, &root, err);
    if (rc)
        return rc;
    char sig_b64[S_SIG_B64_LEN + 1];
    //  The record's base64 can be no longer than the envelope.
    char *record_b64 = malloc (len + 1);
    size_t sig_len = 0;
    if (!record_b64) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory reading %s", what);
        goto done;
    }
    if ((rc = s_only_keys (root, what, keys, err))
        || (rc = s_get_str (root, what, "algorithm", env->algorithm, sizeof env->algorithm, err))
        || (rc = s_get_str (root, what, "key_id", env->key_id, sizeof env->key_id, err))
        || (rc = s_get_str (root, what, "signature", sig_b64, sizeof sig_b64, err))
        || (rc = s_get_str (root, what, "record", record_b64, len + 1, err)))
        goto done;
    if (!s_key_id_ok (env->key_id)) {
        rc = kiln_error (err, KILN_EFORMAT, "%s: key_id is not %d lower-case hex characters",
                         what, KILN_KEY_ID_LEN - 1);
        goto done;
    }
    if (s_unbase64 (sig_b64, strlen (sig_b64), env->sig, sizeof env->sig, &sig_len) != 0
        || sig_len != KILN_SIG_LEN) {
        rc = kiln_error (err, KILN_EFORMAT,
                         "%s: signature is not the base64 of %d bytes", what, KILN_SIG_LEN);
        goto done;
    }
    rc = s_unbase64 (record_b64, strlen (record_b64), env->record, sizeof env->record,
                     &env->record_len);
    if (rc == -KILN_ELIMIT)
        rc = kiln_error (err, KILN_ELIMIT, "%s: record is more than %u bytes", what,
                         KILN_MAX_RELEASE_BYTES);
    else if (rc)
        rc = kiln_error (err, rc == -KILN_ENOMEM ? KILN_ENOMEM : KILN_EFORMAT,
                         "%s: record is not strict base64", what);
done:
    free (record_b64);
    json_decref (root);
    return rc;
}

int
kiln_release_open (const uint8_t *data, size_t len, const kiln_keyring_t *ring,
                   kiln_release_t *out, kiln_err_t *err)
{
    memset (out, 0, sizeof *out);
    s_envelope_t *env = calloc (1, sizeof *env);
    if (!env)
        return kiln_error (err, KILN_ENOMEM, "out of memory reading a release record");
    int rc = s_envelope_decode (data, len, env, err);
    if (rc)
        goto done;
    //  Algorithm and key first, as signify and minisign do: nothing
    //  unknown reaches the cryptography or the record's parser.
    if (strcmp (env->algorithm, KILN_SIG_ALGORITHM) != 0) {
        rc = kiln_error (err, KILN_EVERIFY, "signature algorithm '%s' is not supported (want %s)",
                         env->algorithm, KILN_SIG_ALGORITHM);
        goto done;
    }
    const kiln_key_t *key = kiln_keyring_find (ring, env->key_id);
    if (!key) {
        rc = kiln_error (err, KILN_EVERIFY,
                         "signed by key %s which is not in release keyring '%s'",
                         env->key_id, kiln_keyring_dir (ring));
        goto done;
    }
    if (!kiln_key_verify (key, env->record, env->record_len, env->sig)) {
        rc = kiln_error (err, KILN_EVERIFY, "bad signature on the release record (key %s)",
                         env->key_id);
        goto done;
    }
    kiln_release_t rec;
    if ((rc = kiln_release_decode ((const char *) env->record, env->record_len, &rec, err)))
        goto done;
    //  The envelope's key id is not signed; the record's is.
    if (strcmp (rec.key_id, env->key_id) != 0) {
        rc = kiln_error (err, KILN_EVERIFY,
                         "release record names key %s but was signed by key %s",
                         rec.key_id, env->key_id);
        goto done;
    }
    *out = rec;
done:
    OPENSSL_cleanse (env, sizeof *env);
    free (env);
    return rc;
}

int
kiln_release_read (const char *path, const kiln_keyring_t *ring,
                   kiln_release_t *out, kiln_err_t *err)
{
    uint8_t *data;
    size_t len;
    int rc = kiln_read_file (path, KILN_MAX_RELEASE_BYTES, &data, &len, err);
    if (rc)
        return rc;
    rc = kiln_release_open (data, len, ring, out, err);
    free (data);
    if (rc)
        kiln_error_prefix (err, "release record '%s'", path);
    return rc;
}

int
kiln_release_check_expiry (const kiln_release_t *self, int64_t now, kiln_err_t *err)
{
    if (now < self->expires_at)
        return 0;
    char expired[KILN_RELEASE_TIME_LEN], at[KILN_RELEASE_TIME_LEN];
    kiln_release_format_time (self->expires_at, expired);
    kiln_release_format_time (now, at);
    return kiln_error (err, KILN_EVERIFY,
                       "release seq %llu of model '%s' expired at %s (it is now %s)",
                       (unsigned long long) self->seq, self->model, expired, at);
}

int
kiln_release_check_artifact (const kiln_release_t *self, kiln_artifact_t *art,
                             kiln_err_t *err)
{
    char digest[KILN_HEX_LEN];
    int rc = kiln_artifact_digest (art, digest, err);
    if (rc)
        return rc;
    if (strcmp (digest, self->artifact) != 0)
        return kiln_error (err, KILN_EVERIFY,
                           "artifact %s is not the one release seq %llu of model '%s' names (%s)",
                           digest, (unsigned long long) self->seq, self->model, self->artifact);
    //  The content hash covers the manifest, so these agree whenever the
    //  digests do; checked anyway so that the record's copy is never
    //  trusted alone.
    const kiln_manifest_t *m = kiln_artifact_manifest (art);
    if (strcmp (m->target, self->target) != 0 || m->runtime_abi != self->runtime_abi)
        return kiln_error (err, KILN_EVERIFY,
                           "artifact %s is for target %s, runtime ABI %d; the release names "
                           "target %s, runtime ABI %d", digest, m->target, m->runtime_abi,
                           self->target, self->runtime_abi);
    return 0;
}

/* --- rollback state --------------------------------------------------- */

/* How a record relates to the release already accepted for its model. */
typedef enum {
    S_FIRST,        /* nothing accepted yet for the model */
    S_NEWER,        /* a higher seq */
    S_SAME,         /* the same seq and artifact (re-signed, e.g. a new expiry) */
    S_CONFLICT,     /* the same seq, another artifact */
    S_OLDER,        /* a lower seq: a rollback */
} s_relation_t;

/* What is done for each relation: the rollback rules in one place. */
static const struct {
    s_relation_t relation;
    bool accept;            /* the record may be used */
    bool record;            /* the state moves to the record */
    const char *refusal;    /* why, when refused */
} s_rules[] = {
    { S_FIRST,    true,  true,  NULL },
    { S_NEWER,    true,  true,  NULL },
    { S_SAME,     true,  false, NULL },
    { S_CONFLICT, false, false, "names another artifact than the one already accepted at "
                                "that seq" },
    { S_OLDER,    false, false, "is lower than the seq already accepted: refusing a rollback" },
};

/* What the state holds for a model. */
typedef struct {
    uint64_t seq;
    char artifact[KILN_HEX_LEN];
} s_state_t;

static int
s_state_path (const char *dir, const char *model, char path[PATH_MAX], kiln_err_t *err)
{
    if (!kiln_release_model_ok (model))
        return kiln_error (err, KILN_EINVAL, "model name '%.80s' is not allowed", model);
    if (snprintf (path, PATH_MAX, "%s/%s.json", dir, model) >= PATH_MAX)
        return kiln_error (err, KILN_ELIMIT, "release state path too long: '%s'", dir);
    return 0;
}

/* Read the model's state; *found is false when there is none. */
static int
s_state_read (const char *path, const char *model, s_state_t *state, bool *found,
              kiln_err_t *err)
{
    static const char *const keys[] = {
        "artifact", "format", "format_version", "model", "seq", NULL,
    };
    *found = false;
    uint8_t *data;
    size_t len;
    kiln_err_t local;
    int rc = kiln_read_file (path, KILN_MAX_RELEASE_BYTES, &data, &len, &local);
    if (rc == -KILN_ENOTFOUND)
        return 0;
    if (rc) {
        if (err)
            *err = local;
        return rc;
    }
    char what[PATH_MAX + 32];
    snprintf (what, sizeof what, "release state '%s'", path);
    json_t *root;
    rc = s_load_object ((const char *) data, len, what, &root, err);
    free (data);
    if (rc)
        return rc;
    char name[KILN_MAX_MODEL_NAME + 1];
    long long seq;
    if ((rc = s_get_format (root, what, S_STATE_FORMAT_NAME, S_STATE_VERSION, err))
        || (rc = s_only_keys (root, what, keys, err))
        || (rc = s_get_str (root, what, "model", name, sizeof name, err))
        || (rc = s_get_int (root, what, "seq", 1, KILN_RELEASE_MAX_SEQ, &seq, err))
        || (rc = s_get_str (root, what, "artifact", state->artifact, sizeof state->artifact,
                            err)))
        goto done;
    if (strcmp (name, model) != 0 || !kiln_is_digest_hex (state->artifact)) {
        rc = kiln_error (err, KILN_EFORMAT, "%s: holds model '%s' and artifact '%.64s', "
                         "not a model '%s' and a content hash", what, name,
                         state->artifact, model);
        goto done;
    }
    state->seq = (uint64_t) seq;
    *found = true;
done:
    json_decref (root);
    return rc;
}

static int
s_state_write (const char *path, const kiln_release_t *self, kiln_err_t *err)
{
    json_t *root = json_pack ("{s:s, s:s, s:i, s:s, s:I}", "artifact", self->artifact,
                              "format", S_STATE_FORMAT_NAME, "format_version", S_STATE_VERSION,
                              "model", self->model, "seq", (json_int_t) self->seq);
    char *text;
    size_t len;
    int rc = s_dump (root, "release state", true, &text, &len, err);
    if (rc)
        return rc;
    rc = kiln_write_file_atomic (path, text, len, 0644, err);
    free (text);
    return rc;
}

/* Relate the record to the state at `path` and apply the rules: 0 when
 * accepted (*rule set), KILN_EVERIFY naming the reason when refused. */
static int
s_judge (const kiln_release_t *self, const char *dir, const char *path, int *rule,
         kiln_err_t *err)
{
    s_state_t state = { 0 };
    bool found;
    int rc = s_state_read (path, self->model, &state, &found, err);
    if (rc)
        return kiln_error_prefix (err, "cannot check release seq %llu of model '%s' for "
                                  "rollback (fix or remove the state file)",
                                  (unsigned long long) self->seq, self->model);
    s_relation_t rel = !found                                ? S_FIRST
                       : self->seq > state.seq               ? S_NEWER
                       : self->seq < state.seq               ? S_OLDER
                       : strcmp (self->artifact, state.artifact) == 0 ? S_SAME
                                                                       : S_CONFLICT;
    for (int i = 0; i < (int) (sizeof s_rules / sizeof s_rules[0]); i++) {
        if (s_rules[i].relation != rel)
            continue;
        *rule = i;
        if (s_rules[i].accept)
            return 0;
        return kiln_error (err, KILN_EVERIFY,
                           "release seq %llu of model '%s' %s (state '%s' holds seq "
                           "%llu, artifact %s)", (unsigned long long) self->seq, self->model,
                           s_rules[i].refusal, dir, (unsigned long long) state.seq,
                           state.artifact);
    }
    return kiln_error (err, KILN_EINVAL, "no rollback rule for relation %d", (int) rel);
}

int
kiln_release_check_newer (const kiln_release_t *self, const char *state_dir,
                          kiln_err_t *err)
{
    char path[PATH_MAX];
    int rule;
    int rc = s_state_path (state_dir, self->model, path, err);
    return rc ? rc : s_judge (self, state_dir, path, &rule, err);
}

int
kiln_release_accept (const kiln_release_t *self, const char *state_dir,
                     bool *recorded, kiln_err_t *err)
{
    if (recorded)
        *recorded = false;
    char path[PATH_MAX];
    int rc = s_state_path (state_dir, self->model, path, err);
    if (rc || (rc = kiln_mkdir_p (state_dir, 0700, err)))
        return rc;
    //  Read, judge and write under one lock, so that two processes
    //  accepting releases of a model at once cannot both move its state,
    //  one of them backwards.
    int fd = open (state_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return kiln_error (err, KILN_EIO, "could not open release state '%s': %s", state_dir,
                           strerror (errno));
    while (flock (fd, LOCK_EX) != 0) {
        if (errno != EINTR) {
            rc = kiln_error (err, KILN_EIO, "could not lock release state '%s': %s",
                             state_dir, strerror (errno));
            close (fd);
            return rc;
        }
    }
    int rule;
    rc = s_judge (self, state_dir, path, &rule, err);
    if (!rc && s_rules[rule].record) {
        rc = s_state_write (path, self, err);
        if (!rc && recorded)
            *recorded = true;
    }
    close (fd);     //  releases the lock
    return rc;
}
