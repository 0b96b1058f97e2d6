#include "common/kiln_hash.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <stdlib.h>
#include <unistd.h>

#include <openssl/evp.h>

struct kiln_sha256 {
    EVP_MD_CTX *ctx;
};

void
kiln_sha256 (const void *data, size_t len, uint8_t out[KILN_DIGEST_LEN])
{
    unsigned int n = KILN_DIGEST_LEN;
    EVP_Digest (data, len, out, &n, EVP_sha256 (), NULL);
}

kiln_sha256_t *
kiln_sha256_new (void)
{
    kiln_sha256_t *self = calloc (1, sizeof *self);
    if (!self)
        return NULL;
    self->ctx = EVP_MD_CTX_new ();
    if (!self->ctx || EVP_DigestInit_ex (self->ctx, EVP_sha256 (), NULL) != 1) {
        kiln_sha256_destroy (&self);
        return NULL;
    }
    return self;
}

void
kiln_sha256_update (kiln_sha256_t *self, const void *data, size_t len)
{
    EVP_DigestUpdate (self->ctx, data, len);
}

void
kiln_sha256_final (kiln_sha256_t **self_p, uint8_t out[KILN_DIGEST_LEN])
{
    unsigned int n = KILN_DIGEST_LEN;
    EVP_DigestFinal_ex ((*self_p)->ctx, out, &n);
    kiln_sha256_destroy (self_p);
}

void
kiln_sha256_destroy (kiln_sha256_t **self_p)
{
    if (self_p && *self_p) {
        EVP_MD_CTX_free ((*self_p)->ctx);
        free (*self_p);
        *self_p = NULL;
    }
}

void
kiln_hex (const uint8_t *in, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[in[i] >> 4];
        out[2 * i + 1] = digits[in[i] & 15];
    }
    out[2 * n] = '\0';
}

static int
s_nibble (char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int
kiln_unhex (const char *hex, uint8_t *out, size_t n)
{
    if (!hex || strlen (hex) != 2 * n)
        return -KILN_EFORMAT;
    for (size_t i = 0; i < n; i++) {
        int hi = s_nibble (hex[2 * i]), lo = s_nibble (hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return -KILN_EFORMAT;
        out[i] = (uint8_t) (hi << 4 | lo);
    }
    return 0;
}

bool
kiln_is_digest_hex (const char *s)
{
    if (!s || strlen (s) != 2 * KILN_DIGEST_LEN)
        return false;
    for (const char *p = s; *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f')))
            return false;
    return true;
}

int
kiln_sha256_file_hex (const char *path, char out[KILN_HEX_LEN], kiln_err_t *err)
{
    int fd = open (path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kiln_error (err, KILN_EIO, "could not open '%s': %s", path,
                           strerror (errno));
    kiln_sha256_t *ctx = kiln_sha256_new ();
    if (!ctx) {
        close (fd);
        return kiln_error (err, KILN_ENOMEM, "out of memory hashing '%s'", path);
    }
    uint8_t buf[1 << 16];
    for (;;) {
        ssize_t n = read (fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            int e = errno;
            kiln_sha256_destroy (&ctx);
            close (fd);
            return kiln_error (err, KILN_EIO, "could not read '%s': %s", path,
                               strerror (e));
        }
        if (n == 0)
            break;
        kiln_sha256_update (ctx, buf, (size_t) n);
    }
    close (fd);
    uint8_t digest[KILN_DIGEST_LEN];
    kiln_sha256_final (&ctx, digest);
    kiln_hex (digest, sizeof digest, out);
    return 0;
}

static void
s_update_field (kiln_sha256_t *ctx, const char *s)
{
    /* Length-prefix every field so that no two field lists hash alike. */
    uint64_t n = s ? strlen (s) : 0;
    uint8_t len[8];
    for (int i = 0; i < 8; i++)
        len[i] = (uint8_t) (n >> (56 - 8 * i));
    kiln_sha256_update (ctx, len, sizeof len);
    if (n)
        kiln_sha256_update (ctx, s, n);
}

void
kiln_action_key (const char *graph_digest_hex, const char *norm_args,
                 const char *compiler_id, const char *compiler_version,
                 const char *target, char out[KILN_HEX_LEN])
{
    uint8_t digest[KILN_DIGEST_LEN];
    kiln_sha256_t *ctx = kiln_sha256_new ();
    if (!ctx)
        abort ();
    s_update_field (ctx, "kiln-action-v1");
    s_update_field (ctx, graph_digest_hex);
    s_update_field (ctx, norm_args);
    s_update_field (ctx, compiler_id);
    s_update_field (ctx, compiler_version);
    s_update_field (ctx, target);
    kiln_sha256_final (&ctx, digest);
    kiln_hex (digest, sizeof digest, out);
}

int
kiln_args_normalize (const char *args, char *out, size_t size, kiln_err_t *err)
{
    size_t used = 0;
    const char *p = args ? args : "";
    out[0] = '\0';
    while (*p) {
        while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
            p++;
        const char *start = p;
        while (*p && *p != ' ' && *p != '\t' && *p != '\n' && *p != '\r')
            p++;
        size_t n = (size_t) (p - start);
        if (n == 0)
            break;
        if (used + (used ? 1 : 0) + n + 1 > size)
            return kiln_error (err, KILN_ELIMIT,
                               "compiler arguments longer than %zu bytes", size - 1);
        if (used)
            out[used++] = ' ';
        memcpy (out + used, start, n);
        used += n;
        out[used] = '\0';
    }
    return 0;
}
