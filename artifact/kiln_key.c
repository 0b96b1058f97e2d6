/*
 * kiln_key — Ed25519 keys through OpenSSL's EVP API, PEM files, keyrings.
 *
 * Private key bytes only ever sit in buffers that are wiped with
 * OPENSSL_cleanse before they are freed: the PEM text read from a key
 * file and the PEM text written to one.  Key files are read with a bound
 * (KILN_MAX_KEY_BYTES) and the private key is created O_EXCL|O_NOFOLLOW
 * with mode 0600, so that keygen never overwrites or follows a link.
 */
#include "artifact/kiln_artifact_priv.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "common/kiln_fs.h"
#include "common/kiln_log.h"

/* OpenSSL's reason for the last failure, and an empty error queue. */
static const char *
s_ossl_reason (char *buf, size_t size)
{
    unsigned long e = ERR_peek_last_error ();
    if (e)
        ERR_error_string_n (e, buf, size);
    else
        snprintf (buf, size, "unknown reason");
    ERR_clear_error ();
    return buf;
}

/* Never prompt on a terminal for a passphrase: kiln keys are not
 * encrypted, and a daemon has no one to ask. */
static int
s_no_passphrase (char *buf, int size, int rwflag, void *u)
{
    (void) buf; (void) size; (void) rwflag; (void) u;
    return -1;
}

/* Take ownership of *pkey_p (NULLs it) into a new key. */
static kiln_key_t *
s_key_wrap (EVP_PKEY **pkey_p, bool has_private, const char *what,
            kiln_err_t *err)
{
    EVP_PKEY *pkey = *pkey_p;
    *pkey_p = NULL;
    if (!EVP_PKEY_is_a (pkey, "ED25519")) {
        kiln_error (err, KILN_EUNSUPPORTED, "%s is a %s key, not Ed25519", what,
                    EVP_PKEY_get0_type_name (pkey) ? EVP_PKEY_get0_type_name (pkey) : "unknown");
        EVP_PKEY_free (pkey);
        return NULL;
    }
    unsigned char *der = NULL;
    int n = i2d_PUBKEY (pkey, &der);
    if (n <= 0) {
        char why[256];
        kiln_error (err, KILN_ECRYPTO, "could not encode the public key of %s: %s", what,
                    s_ossl_reason (why, sizeof why));
        EVP_PKEY_free (pkey);
        return NULL;
    }
    kiln_key_t *self = calloc (1, sizeof *self);
    if (!self) {
        OPENSSL_free (der);
        EVP_PKEY_free (pkey);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    uint8_t digest[KILN_DIGEST_LEN];
    kiln_sha256 (der, (size_t) n, digest);
    OPENSSL_free (der);
    kiln_hex (digest, (KILN_KEY_ID_LEN - 1) / 2, self->id);
    kiln_hex (digest, KILN_DIGEST_LEN, self->fingerprint);
    self->pkey = pkey;
    self->has_private = has_private;
    return self;
}

kiln_key_t *
kiln_key_generate (kiln_err_t *err)
{
    EVP_PKEY *pkey = EVP_PKEY_Q_keygen (NULL, NULL, "ED25519");
    if (!pkey) {
        char why[256];
        kiln_error (err, KILN_ECRYPTO, "could not generate an Ed25519 key: %s",
                    s_ossl_reason (why, sizeof why));
        return NULL;
    }
    return s_key_wrap (&pkey, true, "the generated key", err);
}

/* PEM blocks in `data`: the lines that open one. */
static int
s_pem_blocks (const uint8_t *data, size_t len)
{
    static const char begin[] = "-----BEGIN ";
    int n = 0;
    for (const uint8_t *p = data, *end = data + len;
         (p = memmem (p, (size_t) (end - p), begin, sizeof begin - 1)); p++)
        n++;
    return n;
}

/* Parse PEM text; `private_key` chooses PKCS#8 or SPKI; `what` names it
 * in errors ("'PATH'").  Text of more than one PEM block is refused
 * (KILN_EVERIFY): OpenSSL would take the first and ignore the rest, so
 * what a reader of the file sees need not be the key that is trusted. */
static kiln_key_t *
s_key_parse (const void *data, size_t len, bool private_key, const char *what,
             kiln_err_t *err)
{
    if (len > KILN_MAX_KEY_BYTES) {
        kiln_error (err, KILN_ELIMIT, "%s is longer than %u bytes", what, KILN_MAX_KEY_BYTES);
        return NULL;
    }
    int blocks = s_pem_blocks (data, len);
    if (blocks > 1) {
        kiln_error (err, KILN_EVERIFY, "%s holds %d PEM blocks; a key file holds exactly one",
                    what, blocks);
        return NULL;
    }
    EVP_PKEY *pkey = NULL;
    BIO *bio = BIO_new_mem_buf (data, (int) len);
    if (bio) {
        pkey = private_key
               ? PEM_read_bio_PrivateKey (bio, NULL, s_no_passphrase, NULL)
               : PEM_read_bio_PUBKEY (bio, NULL, s_no_passphrase, NULL);
        BIO_free (bio);
    }
    //  OpenSSL's decoders leave entries behind even on success, and its
    //  reason on failure ("no start line") says less than ours.
    ERR_clear_error ();
    if (!pkey) {
        kiln_error (err, KILN_EFORMAT, "%s is not a PEM %s", what,
                    private_key ? "private key (PKCS#8, unencrypted)"
                                : "public key (SubjectPublicKeyInfo)");
        return NULL;
    }
    return s_key_wrap (&pkey, private_key, what, err);
}

kiln_key_t *
kiln_key_parse_public (const char *pem, size_t len, const char *what, kiln_err_t *err)
{
    return s_key_parse (pem, len, false, what, err);
}

const char *
kiln_key_fingerprint (const kiln_key_t *self)
{
    return self->fingerprint;
}

int
kiln_key_public_pem (const kiln_key_t *self, char **pem, kiln_err_t *err)
{
    *pem = NULL;
    BIO *bio = BIO_new (BIO_s_mem ());
    if (!bio || PEM_write_bio_PUBKEY (bio, self->pkey) != 1) {
        char why[256];
        BIO_free (bio);
        return kiln_error (err, KILN_ECRYPTO, "could not encode public key %s: %s",
                           self->id, s_ossl_reason (why, sizeof why));
    }
    char *text;
    long len = BIO_get_mem_data (bio, &text);
    *pem = len > 0 ? strndup (text, (size_t) len) : NULL;
    BIO_free (bio);
    return *pem ? 0 : kiln_error (err, KILN_ENOMEM, "out of memory");
}

/* Load a PEM key file (opened with `flags` too); `private_key` chooses
 * PKCS#8 or SPKI.  The file bytes are wiped before they are freed
 * whichever it holds. */
static kiln_key_t *
s_key_load (const char *path, bool private_key, int flags, kiln_err_t *err)
{
    uint8_t *data;
    size_t len;
    if (kiln_read_file_flags (path, flags, KILN_MAX_KEY_BYTES, &data, &len, err))
        return NULL;
    char what[PATH_MAX + 16];
    snprintf (what, sizeof what, "'%s'", path);
    kiln_key_t *key = s_key_parse (data, len, private_key, what, err);
    OPENSSL_cleanse (data, len);
    free (data);
    return key;
}

kiln_key_t *
kiln_key_load_private (const char *path, kiln_err_t *err)
{
    return s_key_load (path, true, 0, err);
}

kiln_key_t *
kiln_key_load_public (const char *path, kiln_err_t *err)
{
    return s_key_load (path, false, 0, err);
}

void
kiln_key_destroy (kiln_key_t **self_p)
{
    if (self_p && *self_p) {
        //  EVP_PKEY_free wipes the key material it holds.
        EVP_PKEY_free ((*self_p)->pkey);
        free (*self_p);
        *self_p = NULL;
    }
}

const char *
kiln_key_id (const kiln_key_t *self)
{
    return self->id;
}

bool
kiln_key_has_private (const kiln_key_t *self)
{
    return self && self->has_private;
}

int
kiln_key_write_public (const kiln_key_t *self, const char *path,
                       kiln_err_t *err)
{
    char *pem;
    int rc = kiln_key_public_pem (self, &pem, err);
    if (rc == 0)
        rc = kiln_write_file_atomic (path, pem, strlen (pem), 0644, err);
    free (pem);
    return rc;
}

int
kiln_key_write_pair (const kiln_key_t *self, const char *dir, kiln_err_t *err)
{
    if (!self->has_private)
        return kiln_error (err, KILN_EINVAL, "key %s has no private part to write",
                           self->id);
    char key_path[PATH_MAX], pub_path[PATH_MAX];
    if (snprintf (key_path, sizeof key_path, "%s/kiln.key", dir) >= (int) sizeof key_path
        || snprintf (pub_path, sizeof pub_path, "%s/kiln.pub", dir) >= (int) sizeof pub_path)
        return kiln_error (err, KILN_ELIMIT, "key directory path too long: '%s'", dir);
    int rc = kiln_mkdir_p (dir, 0700, err);
    if (rc)
        return rc;
    //  O_EXCL below is what makes this safe; the check gives the message.
    struct stat st;
    if (lstat (key_path, &st) == 0)
        return kiln_error (err, KILN_EIO,
                           "private key '%s' already exists; refusing to overwrite it",
                           key_path);

    //  A secure-heap BIO where OpenSSL has one; wiped by hand either way.
    BIO *bio = BIO_new (BIO_s_secmem ());
    if (!bio || PEM_write_bio_PKCS8PrivateKey (bio, self->pkey, NULL, NULL, 0,
                                               NULL, NULL) != 1) {
        char why[256];
        BIO_free (bio);
        return kiln_error (err, KILN_ECRYPTO, "could not encode private key %s: %s",
                           self->id, s_ossl_reason (why, sizeof why));
    }
    char *pem;
    long len = BIO_get_mem_data (bio, &pem);
    rc = kiln_write_file_excl (key_path, pem, (size_t) len, 0600, err);
    OPENSSL_cleanse (pem, (size_t) len);
    BIO_free (bio);
    if (rc)
        return rc;
    return kiln_key_write_public (self, pub_path, err);
}

int
kiln_key_sign (const kiln_key_t *key, const void *data, size_t len,
               uint8_t sig[KILN_SIG_LEN], kiln_err_t *err)
{
    if (!key->has_private)
        return kiln_error (err, KILN_EINVAL, "key %s has no private part; cannot sign",
                           key->id);
    EVP_MD_CTX *ctx = EVP_MD_CTX_new ();
    size_t sig_len = KILN_SIG_LEN;
    //  Ed25519 is one-shot: no digest (NULL md), the whole message at once.
    bool ok = ctx
              && EVP_DigestSignInit (ctx, NULL, NULL, NULL, key->pkey) == 1
              && EVP_DigestSign (ctx, sig, &sig_len, data, len) == 1
              && sig_len == KILN_SIG_LEN;
    EVP_MD_CTX_free (ctx);
    if (!ok) {
        char why[256];
        return kiln_error (err, KILN_ECRYPTO, "could not sign with key %s: %s",
                           key->id, s_ossl_reason (why, sizeof why));
    }
    return 0;
}

bool
kiln_key_verify (const kiln_key_t *key, const void *data, size_t len,
                 const uint8_t sig[KILN_SIG_LEN])
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new ();
    bool ok = ctx
              && EVP_DigestVerifyInit (ctx, NULL, NULL, NULL, key->pkey) == 1
              && EVP_DigestVerify (ctx, sig, KILN_SIG_LEN, data, len) == 1;
    EVP_MD_CTX_free (ctx);
    ERR_clear_error ();
    return ok;
}

/* --- keyring --------------------------------------------------------- */

struct kiln_keyring {
    char *dir;                 /* the directory it was loaded from */
    kiln_key_t **keys;         /* sorted by id */
    int n_keys;
};

static bool
s_has_key_suffix (const char *name)
{
    size_t n = strlen (name);
    return n > 4 && (strcmp (name + n - 4, ".pub") == 0
                     || strcmp (name + n - 4, ".pem") == 0);
}

static int
s_key_cmp (const void *a, const void *b)
{
    const kiln_key_t *ka = *(const kiln_key_t *const *) a;
    const kiln_key_t *kb = *(const kiln_key_t *const *) b;
    return strcmp (ka->id, kb->id);
}

/* Parse `path` as an Ed25519 public key, or NULL for anything else (a
 * private key, another algorithm, not PEM, too big, not a regular file):
 * such files are skipped, not errors.  A symbolic link is skipped however
 * good the key it leads to, and so is a file of more than one PEM block,
 * both with a warning: whoever can change where a link points, or adds a
 * second key below the first, would otherwise choose what is trusted
 * without changing what the keyring directory seems to hold. */
static kiln_key_t *
s_keyring_try (const char *path)
{
    struct stat st;
    if (lstat (path, &st) != 0)
        return NULL;
    if (S_ISLNK (st.st_mode)) {
        kiln_log_warn ("keyring: skipping %s: a symbolic link (keys in a keyring must be "
                       "regular files)", path);
        return NULL;
    }
    if (!S_ISREG (st.st_mode) || (uint64_t) st.st_size > KILN_MAX_KEY_BYTES)
        return NULL;
    kiln_err_t err;
    kiln_key_t *key = s_key_load (path, false, O_NOFOLLOW, &err);
    if (!key)
        KILN_LOG (err.code == KILN_EVERIFY ? LOG_WARNING : LOG_DEBUG,
                  "keyring: skipping %s: %s", path, err.msg);
    return key;
}

kiln_keyring_t *
kiln_keyring_load (const char *dir, kiln_err_t *err)
{
    DIR *d = opendir (dir);
    if (!d) {
        kiln_error (err, errno == ENOENT ? KILN_ENOTFOUND : KILN_EIO,
                    "could not open keyring '%s': %s", dir, strerror (errno));
        return NULL;
    }
    kiln_keyring_t *self = calloc (1, sizeof *self);
    if (!self || !(self->dir = strdup (dir))) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto err;
    }
    int cap = 0;
    for (;;) {
        errno = 0;
        struct dirent *ent = readdir (d);
        if (!ent) {
            if (errno) {
                kiln_error (err, KILN_EIO, "could not read keyring '%s': %s", dir,
                            strerror (errno));
                goto err;
            }
            break;
        }
        if (!s_has_key_suffix (ent->d_name))
            continue;
        char path[PATH_MAX];
        if (snprintf (path, sizeof path, "%s/%s", dir, ent->d_name) >= (int) sizeof path)
            continue;
        kiln_key_t *key = s_keyring_try (path);
        if (!key)
            continue;
        if (self->n_keys == KILN_MAX_KEYRING_KEYS) {
            kiln_key_destroy (&key);
            kiln_error (err, KILN_ELIMIT, "keyring '%s' holds more than %d keys", dir,
                        KILN_MAX_KEYRING_KEYS);
            goto err;
        }
        if (self->n_keys == cap) {
            int new_cap = cap ? 2 * cap : 8;
            kiln_key_t **keys = realloc (self->keys, (size_t) new_cap * sizeof *keys);
            if (!keys) {
                kiln_key_destroy (&key);
                kiln_error (err, KILN_ENOMEM, "out of memory loading keyring '%s'", dir);
                goto err;
            }
            self->keys = keys;
            cap = new_cap;
        }
        self->keys[self->n_keys++] = key;
    }
    closedir (d);
    if (self->n_keys > 1)
        qsort (self->keys, (size_t) self->n_keys, sizeof *self->keys, s_key_cmp);
    return self;
err:
    closedir (d);
    kiln_keyring_destroy (&self);
    return NULL;
}

void
kiln_keyring_destroy (kiln_keyring_t **self_p)
{
    if (self_p && *self_p) {
        kiln_keyring_t *self = *self_p;
        for (int i = 0; i < self->n_keys; i++)
            kiln_key_destroy (&self->keys[i]);
        free (self->keys);
        free (self->dir);
        free (self);
        *self_p = NULL;
    }
}

int
kiln_keyring_count (const kiln_keyring_t *self)
{
    return self->n_keys;
}

const kiln_key_t *
kiln_keyring_key (const kiln_keyring_t *self, int i)
{
    return i >= 0 && i < self->n_keys ? self->keys[i] : NULL;
}

const kiln_key_t *
kiln_keyring_find (const kiln_keyring_t *self, const char *key_id)
{
    for (int i = 0; i < self->n_keys; i++)
        if (strcmp (self->keys[i]->id, key_id) == 0)
            return self->keys[i];
    return NULL;
}

const char *
kiln_keyring_dir (const kiln_keyring_t *self)
{
    return self->dir;
}
