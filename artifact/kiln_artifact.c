/*
 * kiln_artifact — the signed artifact archive: members, signing, the pax
 * tar writer and the bounded reader, verification against a keyring.
 *
 * What is signed is the manifest.json bytes; the payload is bound to them
 * by the SHA-256 and size of each member listed in the manifest.  The
 * reader checks every member against the manifest before it returns, and
 * verification re-encodes the manifest from what the artifact holds now,
 * so that an artifact changed after it was read or signed cannot pass.
 */
#include "artifact/kiln_artifact_priv.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <archive.h>
#include <archive_entry.h>
#include <jansson.h>

#include "common/kiln_fs.h"
#include "common/kiln_map.h"
#include "common/kiln_mem.h"

#define S_WRITE_CHUNK (1u << 20)        /* bytes handed to libarchive at once */
#define S_TAR_BLOCK   512u              /* tar's unit: headers, data padding */
#define S_USTAR_MAX_SIZE 077777777777ULL  /* the most ustar's size field holds */
#define S_READ_BLOCK  (64u << 10)       /* libarchive read block size */
#define S_TAR_RECORD  10240u            /* what tar pads an archive to (20 blocks) */
#define S_MEMBER_PERM 0644              /* every member's mode, owner "kiln" 0:0, mtime 0 */
#define S_MEMBER_OWNER "kiln"
#define S_ALG_MAX     32                /* signature.json "algorithm" */
#define S_SIGNS_MAX   64                /* signature.json "signs" */

struct kiln_artifact {
    kiln_manifest_t manifest;                  /* filled by the caller or read */
    kiln_member_t members[KILN_MAX_MEMBERS];   /* payload, sorted by name */
    int n_members;
    bool is_signed;                            /* manifest.sig + signature.json */
    char *signed_manifest;                     /* the manifest.json bytes signed */
    size_t signed_manifest_len;
    uint8_t manifest_sig[KILN_SIG_LEN];        /* manifest.sig */
    char *signature_json;                      /* signature.json bytes */
    size_t signature_json_len;
    char sig_algorithm[S_ALG_MAX];             /* from signature.json */
    char signer[KILN_KEY_ID_LEN];              /* key id, "" when unsigned */
    char sig_signs[S_SIGNS_MAX];               /* which member it signs */
    char *provenance;                          /* provenance.json, or NULL */
    size_t provenance_len;
    uint8_t provenance_sig[KILN_SIG_LEN];      /* provenance.sig */
};

/* --- lifecycle and members ------------------------------------------- */

kiln_artifact_t *
kiln_artifact_new (void)
{
    kiln_artifact_t *self = calloc (1, sizeof *self);
    if (!self)
        return NULL;
    self->manifest.format_version = KILN_ARTIFACT_FORMAT_VERSION;
    self->manifest.runtime_abi = KILN_RUNTIME_ABI_VERSION;
    return self;
}

static void
s_clear_signature (kiln_artifact_t *self)
{
    free (self->signed_manifest);
    free (self->signature_json);
    free (self->provenance);
    self->signed_manifest = self->signature_json = self->provenance = NULL;
    self->signed_manifest_len = self->signature_json_len = self->provenance_len = 0;
    self->is_signed = false;
    self->sig_algorithm[0] = self->signer[0] = self->sig_signs[0] = '\0';
    memset (self->manifest_sig, 0, sizeof self->manifest_sig);
    memset (self->provenance_sig, 0, sizeof self->provenance_sig);
}

/* Give back a member's bytes, mapped or malloc'd, and NULL them. */
static void
s_member_release (kiln_member_t *m)
{
    if (m->mapped && m->data)
        munmap (m->data, m->len);
    else
        free (m->data);
    m->data = NULL;
    m->mapped = false;
}

void
kiln_artifact_destroy (kiln_artifact_t **self_p)
{
    if (self_p && *self_p) {
        kiln_artifact_t *self = *self_p;
        kiln_manifest_release (&self->manifest);
        for (int i = 0; i < self->n_members; i++)
            s_member_release (&self->members[i]);
        s_clear_signature (self);
        free (self);
        *self_p = NULL;
    }
}

kiln_manifest_t *
kiln_artifact_manifest (kiln_artifact_t *self)
{
    return &self->manifest;
}

static int
s_find (const kiln_artifact_t *self, const char *name)
{
    for (int i = 0; i < self->n_members; i++)
        if (strcmp (self->members[i].name, name) == 0)
            return i;
    return -1;
}

/* Check that `name` may be added; the error names it. */
static int
s_check_new_member (const kiln_artifact_t *self, const char *name, size_t len,
                    kiln_err_t *err)
{
    if (!name)
        return kiln_error (err, KILN_EINVAL, "member name is NULL");
    if (kiln_member_name_reserved (name))
        return kiln_error (err, KILN_EINVAL, "member name '%s' is reserved", name);
    if (!kiln_member_name_ok (name))
        return kiln_error (err, KILN_EINVAL,
                           "member name '%.80s' is not valid (want [A-Za-z0-9._-]{1,%d})",
                           name, KILN_MAX_MEMBER_NAME);
    if (s_find (self, name) >= 0)
        return kiln_error (err, KILN_EINVAL, "member '%s' already exists", name);
    if (self->n_members == KILN_MAX_MEMBERS)
        return kiln_error (err, KILN_ELIMIT, "member '%s': the artifact already has %d members",
                           name, KILN_MAX_MEMBERS);
    if (len > KILN_MAX_MEMBER_BYTES)
        return kiln_error (err, KILN_ELIMIT, "member '%s' is %zu bytes, more than the limit of %llu",
                           name, len, (unsigned long long) KILN_MAX_MEMBER_BYTES);
    return 0;
}

/* Insert a checked member in name order, taking `data` (pages mapped by
 * kiln_map_range when `mapped`, hashed with their pages given back). */
static void
s_insert (kiln_artifact_t *self, const char *name, uint8_t *data, size_t len, bool mapped)
{
    int at = 0;
    while (at < self->n_members && strcmp (self->members[at].name, name) < 0)
        at++;
    memmove (&self->members[at + 1], &self->members[at],
             (size_t) (self->n_members - at) * sizeof self->members[0]);
    kiln_member_t *m = &self->members[at];
    memset (m, 0, sizeof *m);
    snprintf (m->name, sizeof m->name, "%s", name);
    m->data = data;
    m->len = len;
    m->mapped = mapped;
    uint8_t digest[KILN_DIGEST_LEN];
    if (mapped)
        kiln_sha256_mapped (data, len, digest);
    else
        kiln_sha256 (data, len, digest);
    kiln_hex (digest, KILN_DIGEST_LEN, m->sha256);
    self->n_members++;
}

int
kiln_artifact_add_member (kiln_artifact_t *self, const char *name,
                          const void *data, size_t len, kiln_err_t *err)
{
    int rc = s_check_new_member (self, name, len, err);
    if (rc)
        return rc;
    if (len > 0 && !data)
        return kiln_error (err, KILN_EINVAL, "member '%s': %zu bytes but no data", name, len);
    uint8_t *copy = malloc (len ? len : 1);
    if (!copy)
        return kiln_error (err, KILN_ENOMEM, "out of memory copying member '%s'", name);
    if (len)
        memcpy (copy, data, len);
    s_insert (self, name, copy, len, false);
    return 0;
}

int
kiln_artifact_take_member (kiln_artifact_t *self, const char *name,
                           uint8_t **data, size_t len, kiln_err_t *err)
{
    uint8_t *buf = *data;
    *data = NULL;
    int rc = s_check_new_member (self, name, len, err);
    if (rc == 0 && len > 0 && !buf)
        rc = kiln_error (err, KILN_EINVAL, "member '%s': %zu bytes but no data", name, len);
    if (rc == 0 && !buf && !(buf = malloc (1)))
        rc = kiln_error (err, KILN_ENOMEM, "out of memory");
    if (rc) {
        free (buf);
        return rc;
    }
    s_insert (self, name, buf, len, false);
    return 0;
}

int
kiln_artifact_map_member (kiln_artifact_t *self, const char *name, int fd,
                          uint64_t offset, uint64_t len, kiln_err_t *err)
{
    int rc = s_check_new_member (self, name, (size_t) len, err);
    if (rc)
        return rc;
    if (len < KILN_ARTIFACT_ALIGN || offset % KILN_ARTIFACT_ALIGN) {
        //  Too small to be worth a mapping, or not where pages start: read it.
        uint8_t *buf = kiln_mem_alloc (len ? (size_t) len : 1);
        if (!buf)
            return kiln_error (err, KILN_ENOMEM, "out of memory reading member '%s'", name);
        for (uint64_t got = 0; got < len; ) {
            ssize_t n = pread (fd, buf + got, (size_t) (len - got), (off_t) (offset + got));
            if (n <= 0) {
                free (buf);
                return kiln_error (err, KILN_EIO, "member '%s': could not read its file: %s",
                                   name, n < 0 ? strerror (errno) : "it is short");
            }
            got += (uint64_t) n;
        }
        s_insert (self, name, buf, (size_t) len, false);
        return 0;
    }
    kiln_map_t map;
    const uint8_t *data;
    if ((rc = kiln_map_range (fd, offset, len, name, &map, &data, err)))
        return rc;
    //  The member owns the mapping: data is its start (offset is page aligned).
    s_insert (self, name, (uint8_t *) data, (size_t) len, true);
    return 0;
}

bool
kiln_artifact_member_mapped (const kiln_artifact_t *self, const char *name)
{
    int i = s_find (self, name);
    return i >= 0 && self->members[i].mapped;
}

const uint8_t *
kiln_artifact_member (const kiln_artifact_t *self, const char *name, size_t *len)
{
    int i = s_find (self, name);
    if (i < 0) {
        if (len)
            *len = 0;
        return NULL;
    }
    if (len)
        *len = self->members[i].len;
    return self->members[i].data;
}

int
kiln_artifact_member_count (const kiln_artifact_t *self)
{
    return self->n_members;
}

const char *
kiln_artifact_member_name (const kiln_artifact_t *self, int i)
{
    return i >= 0 && i < self->n_members ? self->members[i].name : NULL;
}

int
kiln_artifact_member_span (const kiln_artifact_t *self, int i, uint64_t *offset,
                           uint64_t *len, char sha256[KILN_HEX_LEN])
{
    if (!self || i < 0 || i >= self->n_members || self->members[i].file_offset == 0)
        return -KILN_EINVAL;
    *offset = self->members[i].file_offset;
    *len = self->members[i].len;
    memcpy (sha256, self->members[i].sha256, KILN_HEX_LEN);
    return 0;
}

/* --- manifest and content hash --------------------------------------- */

int
kiln_artifact_manifest_json (kiln_artifact_t *self, char **out, size_t *len,
                             kiln_err_t *err)
{
    return kiln_manifest_encode (&self->manifest, self->members, self->n_members,
                                 out, len, err);
}

int
kiln_artifact_digest (kiln_artifact_t *self, char out[KILN_HEX_LEN],
                      kiln_err_t *err)
{
    char *json;
    size_t len;
    int rc = kiln_artifact_manifest_json (self, &json, &len, err);
    if (rc)
        return rc;
    uint8_t digest[KILN_DIGEST_LEN];
    kiln_sha256 (json, len, digest);
    kiln_hex (digest, KILN_DIGEST_LEN, out);
    free (json);
    return 0;
}

/* --- signing --------------------------------------------------------- */

/* `text` re-encoded into *out as compact JSON with sorted keys; it must
 * be an object.  Caller owns *out (free()). */
static int
s_canonical_object (const char *what, const char *text, size_t len, size_t max,
                    int code, char **out, kiln_err_t *err)
{
    *out = NULL;
    if (len > max)
        return kiln_error (err, KILN_ELIMIT, "%s is %zu bytes, more than the limit of %zu",
                           what, len, max);
    json_error_t jerr;
    json_t *root = json_loadb (text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return kiln_error (err, code, "%s is not valid JSON: %s", what, jerr.text);
    if (!json_is_object (root)) {
        json_decref (root);
        return kiln_error (err, code, "%s is not a JSON object", what);
    }
    *out = json_dumps (root, JSON_SORT_KEYS | JSON_COMPACT);
    json_decref (root);
    if (!*out)
        return kiln_error (err, KILN_ENOMEM, "out of memory encoding %s", what);
    return 0;
}

static char *
s_signature_json (const char *key_id, kiln_err_t *err)
{
    json_t *root = json_pack ("{s:s, s:s, s:s}", "algorithm", KILN_SIG_ALGORITHM,
                              "key_id", key_id, "signs", KILN_MEMBER_MANIFEST);
    char *out = root ? json_dumps (root, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    json_decref (root);
    if (!out)
        kiln_error (err, KILN_ENOMEM, "out of memory encoding signature.json");
    return out;
}

int
kiln_artifact_sign (kiln_artifact_t *self, const kiln_key_t *key,
                    const char *provenance_json, kiln_err_t *err)
{
    if (!key)
        return kiln_error (err, KILN_EINVAL, "no key to sign with");
    if (!kiln_key_has_private (key))
        return kiln_error (err, KILN_EINVAL, "key %s has no private part; cannot sign",
                           kiln_key_id (key));
    char *manifest = NULL, *signature = NULL, *provenance = NULL;
    size_t manifest_len;
    uint8_t msig[KILN_SIG_LEN], psig[KILN_SIG_LEN];
    int rc = kiln_artifact_manifest_json (self, &manifest, &manifest_len, err);
    if (rc)
        goto err;
    if (provenance_json) {
        if ((rc = s_canonical_object ("provenance", provenance_json,
                                      strlen (provenance_json), KILN_MAX_PROVENANCE_BYTES,
                                      KILN_EINVAL, &provenance, err))
            || (rc = kiln_key_sign (key, provenance, strlen (provenance), psig, err)))
            goto err;
    }
    if ((rc = kiln_key_sign (key, manifest, manifest_len, msig, err)))
        goto err;
    if (!(signature = s_signature_json (kiln_key_id (key), err))) {
        rc = -KILN_ENOMEM;
        goto err;
    }

    s_clear_signature (self);
    self->is_signed = true;
    self->signed_manifest = manifest;
    self->signed_manifest_len = manifest_len;
    memcpy (self->manifest_sig, msig, KILN_SIG_LEN);
    self->signature_json = signature;
    self->signature_json_len = strlen (signature);
    snprintf (self->sig_algorithm, sizeof self->sig_algorithm, "%s", KILN_SIG_ALGORITHM);
    snprintf (self->signer, sizeof self->signer, "%s", kiln_key_id (key));
    snprintf (self->sig_signs, sizeof self->sig_signs, "%s", KILN_MEMBER_MANIFEST);
    if (provenance) {
        self->provenance = provenance;
        self->provenance_len = strlen (provenance);
        memcpy (self->provenance_sig, psig, KILN_SIG_LEN);
    }
    return 0;
err:
    free (manifest);
    free (signature);
    free (provenance);
    return rc;
}

bool
kiln_artifact_is_signed (const kiln_artifact_t *self)
{
    return self->is_signed;
}

const char *
kiln_artifact_signer (const kiln_artifact_t *self)
{
    return self->signer;
}

const char *
kiln_artifact_provenance (const kiln_artifact_t *self)
{
    return self->provenance;
}

/* --- writing --------------------------------------------------------- */

/* Where the archive goes: a growing buffer, or a file descriptor
 * (fd >= 0) written as libarchive hands bytes over.  `len` counts the
 * bytes emitted either way: the writer is unblocked, so it is where the
 * next byte goes. */
typedef struct {
    uint8_t *data;
    size_t len, cap;
    bool over_limit;
    int fd;
} s_membuf_t;

static la_ssize_t
s_membuf_write (struct archive *a, void *ctx, const void *buf, size_t n)
{
    s_membuf_t *mb = ctx;
    if (n > KILN_MAX_ARTIFACT_BYTES - mb->len) {
        mb->over_limit = true;
        archive_set_error (a, EFBIG, "artifact larger than %llu bytes",
                           (unsigned long long) KILN_MAX_ARTIFACT_BYTES);
        return -1;
    }
    if (mb->fd >= 0) {
        if (kiln_write_all (mb->fd, buf, n) != 0) {
            archive_set_error (a, errno, "%s", strerror (errno));
            return -1;
        }
        mb->len += n;
        return (la_ssize_t) n;
    }
    if (mb->len + n > mb->cap) {
        size_t cap = mb->cap ? mb->cap : 64 << 10;
        while (cap < mb->len + n)
            cap *= 2;
        uint8_t *data = realloc (mb->data, cap);
        if (!data) {
            archive_set_error (a, ENOMEM, "out of memory");
            return -1;
        }
        mb->data = data;
        mb->cap = cap;
    }
    memcpy (mb->data + mb->len, buf, n);
    mb->len += n;
    return (la_ssize_t) n;
}

/* A member's header with the fixed fields that make the bytes depend on
 * the content only; NULL when out of memory. */
static struct archive_entry *
s_entry_new (const char *name, size_t len)
{
    struct archive_entry *e = archive_entry_new ();
    if (!e)
        return NULL;
    archive_entry_set_pathname (e, name);
    archive_entry_set_size (e, (la_int64_t) len);
    archive_entry_set_filetype (e, AE_IFREG);
    archive_entry_set_perm (e, S_MEMBER_PERM);
    archive_entry_set_mtime (e, 0, 0);
    archive_entry_set_uid (e, 0);
    archive_entry_set_gid (e, 0);
    archive_entry_set_uname (e, S_MEMBER_OWNER);
    archive_entry_set_gname (e, S_MEMBER_OWNER);
    return e;
}

/* One member, header and data; the pages of a `mapped` member are given
 * back as they are written (kiln_map_drop). */
static int
s_write_entry (struct archive *a, const char *name, const void *data,
               size_t len, bool mapped, kiln_err_t *err)
{
    struct archive_entry *e = s_entry_new (name, len);
    if (!e)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    int rc = 0;
    if (archive_write_header (a, e) != ARCHIVE_OK)
        rc = kiln_error (err, KILN_EIO, "could not write member '%s': %s", name,
                         archive_error_string (a));
    const uint8_t *p = data;
    size_t done = 0;
    while (rc == 0 && done < len) {
        size_t n = len - done < S_WRITE_CHUNK ? len - done : S_WRITE_CHUNK;
        la_ssize_t w = archive_write_data (a, p + done, n);
        if (mapped && w > 0)
            kiln_map_drop (p + done, (size_t) w);
        if (w <= 0)
            rc = kiln_error (err, KILN_EIO, "could not write member '%s': %s", name,
                             archive_error_string (a) ? archive_error_string (a) : "short write");
        else
            done += (size_t) w;
    }
    archive_entry_free (e);
    return rc;
}

static la_ssize_t
s_count_write (struct archive *a, void *ctx, const void *buf, size_t n)
{
    *(uint64_t *) ctx += n;
    return (la_ssize_t) n;
}

/* The bytes libarchive writes as the header of member `name` of `len`
 * bytes: one ustar block for kiln's names and sizes, more when the entry
 * needs pax records of its own (a member of 8 GiB, past ustar's size
 * field).  Measured by writing the header to a counter rather than
 * assumed, so that the padding before the member stays right whatever
 * libarchive decides. */
static int
s_header_bytes (const char *name, size_t len, uint64_t *bytes, kiln_err_t *err)
{
    //  The size changes the header only where ustar's 11 octal digits
    //  cannot hold it, so a smaller member is measured as an empty one:
    //  closing the archive then writes no data to count.
    size_t probe = len > S_USTAR_MAX_SIZE ? len : 0;
    uint64_t count = 0;
    *bytes = 0;
    struct archive *a = archive_write_new ();
    struct archive_entry *e = s_entry_new (name, probe);
    int rc = 0;
    if (!a || !e)
        rc = kiln_error (err, KILN_ENOMEM, "out of memory");
    else if (archive_write_set_format_pax_restricted (a) != ARCHIVE_OK
             || archive_write_set_bytes_per_block (a, 0) != ARCHIVE_OK
             || archive_write_open2 (a, &count, NULL, s_count_write, NULL, NULL) != ARCHIVE_OK
             || archive_write_header (a, e) != ARCHIVE_OK)
        rc = kiln_error (err, KILN_EIO, "could not write member '%s': %s", name,
                         archive_error_string (a));
    *bytes = count;
    archive_write_free (a);
    archive_entry_free (e);
    return rc;
}

/* Write the pax extended header of exactly `total` bytes (a multiple of
 * 512, at least 1024) that goes before member `name` to move its data to
 * a multiple of KILN_ARTIFACT_ALIGN: a ustar block of type 'x' whose data
 * is one "comment" record, which every pax reader ignores (POSIX), and
 * whose fields are as fixed as the members' own. */
static int
s_write_pad (struct archive *a, s_membuf_t *mb, const char *name, size_t total,
             kiln_err_t *err)
{
    static const char text[] = "kiln: aligns the next member's data to 4096 bytes";
    uint8_t head[S_TAR_BLOCK] = { 0 };
    size_t rec = total - S_TAR_BLOCK;     /* the record fills the blocks */
    snprintf ((char *) head, 100, "PaxHeader/%s", name);
    memcpy (head + 100, "0000644", 8);                      /* mode */
    memcpy (head + 108, "0000000", 8);                      /* uid */
    memcpy (head + 116, "0000000", 8);                      /* gid */
    snprintf ((char *) head + 124, 12, "%011o", (unsigned) rec);  /* <= 4096 */
    memcpy (head + 136, "00000000000", 12);                 /* mtime */
    head[156] = 'x';                                        /* typeflag */
    memcpy (head + 257, "ustar", 6);                        /* magic */
    memcpy (head + 263, "00", 2);                           /* version */
    memcpy (head + 265, "kiln", 4);                         /* uname */
    memcpy (head + 297, "kiln", 4);                         /* gname */
    memcpy (head + 329, "0000000", 8);                      /* devmajor */
    memcpy (head + 337, "0000000", 8);                      /* devminor */
    unsigned sum = 0;
    for (size_t i = 0; i < S_TAR_BLOCK; i++)
        sum += i >= 148 && i < 156 ? ' ' : head[i];
    snprintf ((char *) head + 148, 8, "%06o", sum);
    head[155] = ' ';

    //  "<len> comment=<text><spaces>\n", where <len> counts the whole
    //  record, its own digits too: 512..4096 bytes, so 3 or 4 digits.
    uint8_t *body = malloc (rec);
    if (!body)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    int n = snprintf ((char *) body, rec, "%zu comment=%s", rec, text);
    memset (body + n, ' ', rec - (size_t) n - 1);
    body[rec - 1] = '\n';
    int rc = 0;
    if (s_membuf_write (a, mb, head, sizeof head) < 0
        || s_membuf_write (a, mb, body, rec) < 0)
        rc = kiln_error (err, KILN_EIO, "could not write the padding before member '%s': %s",
                         name, archive_error_string (a));
    free (body);
    return rc;
}

/* Before a member of at least KILN_ARTIFACT_ALIGN bytes: finish the
 * previous entry (its data padding goes out), then pad so that the
 * member's data, after its header, starts at a multiple of
 * KILN_ARTIFACT_ALIGN.  The archive is written unblocked, so mb->len is
 * where the next byte goes. */
static int
s_align_member (struct archive *a, s_membuf_t *mb, const char *name, size_t len,
                kiln_err_t *err)
{
    uint64_t header;
    int rc = s_header_bytes (name, len, &header, err);
    if (rc)
        return rc;
    if (archive_write_finish_entry (a) != ARCHIVE_OK)
        return kiln_error (err, KILN_EIO, "could not write the member before '%s': %s",
                           name, archive_error_string (a));
    uint64_t at = mb->len;
    if (at % S_TAR_BLOCK || header % S_TAR_BLOCK)
        return kiln_error (err, KILN_EIO, "member '%s': the archive is not in %u-byte blocks",
                           name, S_TAR_BLOCK);
    uint64_t pad = (KILN_ARTIFACT_ALIGN - (at + header) % KILN_ARTIFACT_ALIGN)
                   % KILN_ARTIFACT_ALIGN;
    //  A pad header needs a block for itself and one for its record.
    if (pad == S_TAR_BLOCK)
        pad += KILN_ARTIFACT_ALIGN;
    return pad ? s_write_pad (a, mb, name, (size_t) pad, err) : 0;
}

/* Write the archive into `mb` (a buffer or a file). */
static int
s_write_archive (kiln_artifact_t *self, s_membuf_t *mb, kiln_err_t *err)
{
    char *manifest = NULL;
    size_t manifest_len;
    int rc = kiln_artifact_manifest_json (self, &manifest, &manifest_len, err);
    if (rc)
        return rc;
    if (self->is_signed
        && (manifest_len != self->signed_manifest_len
            || memcmp (manifest, self->signed_manifest, manifest_len) != 0)) {
        free (manifest);
        return kiln_error (err, KILN_EINVAL,
                           "the artifact changed after it was signed; sign it again");
    }
    uint64_t payload = 0;
    for (int i = 0; i < self->n_members; i++)
        payload += self->members[i].len;
    if (payload > KILN_MAX_ARTIFACT_BYTES) {
        free (manifest);
        return kiln_error (err, KILN_ELIMIT, "members hold %llu bytes, more than the limit of %llu",
                           (unsigned long long) payload,
                           (unsigned long long) KILN_MAX_ARTIFACT_BYTES);
    }

    struct archive *a = archive_write_new ();
    if (!a) {
        free (manifest);
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    //  Unblocked, so that what libarchive writes reaches the buffer at
    //  once and the padding before a large member goes in between.
    if (archive_write_set_format_pax_restricted (a) != ARCHIVE_OK
        || archive_write_set_bytes_per_block (a, 0) != ARCHIVE_OK
        || archive_write_open2 (a, mb, NULL, s_membuf_write, NULL, NULL) != ARCHIVE_OK) {
        rc = kiln_error (err, KILN_EIO, "could not start the archive: %s",
                         archive_error_string (a));
        goto done;
    }
    if ((rc = s_write_entry (a, KILN_MEMBER_MANIFEST, manifest, manifest_len, false, err)))
        goto done;
    if (self->is_signed) {
        if ((rc = s_write_entry (a, KILN_MEMBER_MANIFEST_SIG, self->manifest_sig,
                                 KILN_SIG_LEN, false, err))
            || (rc = s_write_entry (a, KILN_MEMBER_SIGNATURE, self->signature_json,
                                    self->signature_json_len, false, err)))
            goto done;
        if (self->provenance
            && ((rc = s_write_entry (a, KILN_MEMBER_PROVENANCE, self->provenance,
                                     self->provenance_len, false, err))
                || (rc = s_write_entry (a, KILN_MEMBER_PROVENANCE_SIG,
                                        self->provenance_sig, KILN_SIG_LEN, false, err))))
            goto done;
    }
    for (int i = 0; i < self->n_members; i++) {
        const kiln_member_t *m = &self->members[i];
        if ((m->len >= KILN_ARTIFACT_ALIGN
             && (rc = s_align_member (a, mb, m->name, m->len, err)))
            || (rc = s_write_entry (a, m->name, m->data, m->len, m->mapped, err)))
            goto done;
    }
    if (archive_write_close (a) != ARCHIVE_OK)
        rc = kiln_error (err, KILN_EIO, "could not finish the archive: %s",
                         archive_error_string (a));
done:
    if (rc && mb->over_limit)
        rc = kiln_error (err, KILN_ELIMIT, "the archive would be larger than %llu bytes",
                         (unsigned long long) KILN_MAX_ARTIFACT_BYTES);
    archive_write_free (a);
    free (manifest);
    return rc;
}

int
kiln_artifact_write_mem (kiln_artifact_t *self, uint8_t **out, size_t *len,
                         kiln_err_t *err)
{
    *out = NULL;
    *len = 0;
    s_membuf_t mb = { .fd = -1 };
    int rc = s_write_archive (self, &mb, err);
    if (rc) {
        free (mb.data);
        return rc;
    }
    *out = mb.data;
    *len = mb.len;
    return 0;
}

int
kiln_artifact_write_fd (kiln_artifact_t *self, int fd, uint64_t *len, kiln_err_t *err)
{
    s_membuf_t mb = { .fd = fd };
    int rc = s_write_archive (self, &mb, err);
    if (len)
        *len = rc ? 0 : mb.len;
    return rc;
}

int
kiln_artifact_write (kiln_artifact_t *self, const char *path, kiln_err_t *err)
{
    char tmp[PATH_MAX];
    int fd = kiln_tmp_beside (path, tmp, sizeof tmp, 0644, err);
    if (fd < 0)
        return fd;
    int rc = kiln_artifact_write_fd (self, fd, NULL, err);
    if (rc) {
        close (fd);
        unlink (tmp);
        return kiln_error_prefix (err, "writing '%s'", path);
    }
    return kiln_tmp_commit (fd, tmp, path, err);
}

/* --- reading --------------------------------------------------------- */

/* The reserved members' slots while reading. */
enum { S_MANIFEST, S_MANIFEST_SIG, S_SIGNATURE, S_PROVENANCE, S_PROVENANCE_SIG };

static const char *const s_reserved_names[KILN_N_RESERVED_MEMBERS] = {
    KILN_MEMBER_MANIFEST, KILN_MEMBER_MANIFEST_SIG, KILN_MEMBER_SIGNATURE,
    KILN_MEMBER_PROVENANCE, KILN_MEMBER_PROVENANCE_SIG,
};

/* Upper bound on each reserved member's size; signatures must be exact. */
static const uint64_t s_reserved_max[KILN_N_RESERVED_MEMBERS] = {
    KILN_MAX_MANIFEST_BYTES, KILN_SIG_LEN, KILN_MAX_SIGNATURE_JSON,
    KILN_MAX_PROVENANCE_BYTES, KILN_SIG_LEN,
};

typedef struct {
    uint8_t *data[KILN_N_RESERVED_MEMBERS];     /* reserved members read */
    size_t len[KILN_N_RESERVED_MEMBERS];
    kiln_member_t expected[KILN_MAX_MEMBERS];   /* from the manifest */
    int n_expected;
    kiln_member_t got[KILN_MAX_MEMBERS];        /* payload read, manifest order */
    bool seen[KILN_MAX_MEMBERS];
    const uint8_t *mem;                         /* the input in memory, or NULL */
    int src_fd;                                 /* else the input file */
    int fd;                                     /* the file to map from, or -1 */
    uint64_t page;                              /* its page size, when fd >= 0 */
    bool mapped;                                /* a member was mapped */
    bool skim;                                  /* payload data skipped, not hashed */
} s_reader_t;

static void
s_reader_release (s_reader_t *r)
{
    for (int i = 0; i < KILN_N_RESERVED_MEMBERS; i++)
        free (r->data[i]);
    for (int i = 0; i < r->n_expected; i++)
        s_member_release (&r->got[i]);
}

static int
s_reserved_slot (const char *name)
{
    for (int i = 0; i < KILN_N_RESERVED_MEMBERS; i++)
        if (strcmp (name, s_reserved_names[i]) == 0)
            return i;
    return -1;
}

/* A plain member name: the payload character set, so no '/', no "..",
 * nothing a shell or a terminal would interpret. */
static bool
s_plain_name (const char *name)
{
    return s_reserved_slot (name) >= 0 || kiln_member_name_ok (name);
}

/* Read exactly `size` bytes of the current entry into a new buffer
 * (NUL-terminated one past the end). */
static int
s_read_data (struct archive *a, const char *name, uint64_t size, uint8_t **out,
             kiln_err_t *err)
{
    *out = NULL;
    /* (weights read into memory go on huge pages: common/kiln_mem.h) */
    uint8_t *buf = kiln_mem_alloc ((size_t) size + 1);
    if (!buf)
        return kiln_error (err, KILN_ENOMEM, "out of memory reading member '%s' (%llu bytes)",
                           name, (unsigned long long) size);
    uint64_t got = 0;
    while (got < size) {
        uint64_t want = size - got < S_WRITE_CHUNK ? size - got : S_WRITE_CHUNK;
        la_ssize_t n = archive_read_data (a, buf + got, (size_t) want);
        if (n <= 0) {
            free (buf);
            if (n == 0)
                return kiln_error (err, KILN_EFORMAT, "member '%s' is truncated", name);
            return kiln_error (err, KILN_EFORMAT, "member '%s': %s", name,
                               archive_error_string (a) ? archive_error_string (a)
                                                        : "read error");
        }
        got += (uint64_t) n;
    }
    buf[size] = '\0';
    *out = buf;
    return 0;
}

/* Map the current entry's data, `size` bytes at file offset `at`, into
 * m->data and skip it in the archive; the caller hashes the mapped pages.
 * 1 when it cannot be mapped (the caller reads it instead), before
 * anything of the entry has been consumed. */
static int
s_map_data (struct archive *a, s_reader_t *r, const char *name, uint64_t at,
            uint64_t size, uint64_t input_size, kiln_member_t *m, kiln_err_t *err)
{
    //  A header may claim any size; never map past the end of the file
    //  (touching such a page would be SIGBUS).
    if (at > input_size || size > input_size - at)
        return kiln_error (err, KILN_EFORMAT, "member '%s' is truncated", name);
    if (size > SIZE_MAX || at > (uint64_t) INT64_MAX)
        return 1;
    void *p = mmap (NULL, (size_t) size, PROT_READ, MAP_SHARED, r->fd, (off_t) at);
    if (p == MAP_FAILED)
        return 1;
    if (archive_read_data_skip (a) != ARCHIVE_OK) {
        munmap (p, (size_t) size);
        return kiln_error (err, KILN_EFORMAT, "member '%s': %s", name,
                           archive_error_string (a) ? archive_error_string (a)
                                                    : "read error");
    }
    m->data = p;
    m->mapped = true;
    r->mapped = true;
    return 0;
}

/* Parse signature.json strictly into the artifact's fields. */
static int
s_parse_signature (kiln_artifact_t *self, const uint8_t *data, size_t len,
                   kiln_err_t *err)
{
    json_error_t jerr;
    json_t *root = json_loadb ((const char *) data, len, JSON_REJECT_DUPLICATES, &jerr);
    int rc = 0;
    if (!root || !json_is_object (root) || json_object_size (root) != 3) {
        rc = kiln_error (err, KILN_EFORMAT,
                         "signature.json is not an object with algorithm, key_id and signs");
        goto done;
    }
    const json_t *alg = json_object_get (root, "algorithm");
    const json_t *kid = json_object_get (root, "key_id");
    const json_t *signs = json_object_get (root, "signs");
    if (!json_is_string (alg) || !json_is_string (kid) || !json_is_string (signs)
        || json_string_length (alg) >= sizeof self->sig_algorithm
        || json_string_length (signs) >= sizeof self->sig_signs) {
        rc = kiln_error (err, KILN_EFORMAT,
                         "signature.json: algorithm, key_id and signs must be short strings");
        goto done;
    }
    const char *id = json_string_value (kid);
    bool id_ok = json_string_length (kid) == KILN_KEY_ID_LEN - 1;
    for (size_t i = 0; id_ok && i < KILN_KEY_ID_LEN - 1; i++)
        id_ok = (id[i] >= '0' && id[i] <= '9') || (id[i] >= 'a' && id[i] <= 'f');
    if (!id_ok) {
        rc = kiln_error (err, KILN_EFORMAT,
                         "signature.json: key_id is not %d lower-case hex characters",
                         KILN_KEY_ID_LEN - 1);
        goto done;
    }
    snprintf (self->sig_algorithm, sizeof self->sig_algorithm, "%s", json_string_value (alg));
    snprintf (self->signer, sizeof self->signer, "%s", id);
    snprintf (self->sig_signs, sizeof self->sig_signs, "%s", json_string_value (signs));
done:
    json_decref (root);
    return rc;
}

/* `len` bytes of the input at `at` (within it) into buf. */
static int
s_input_bytes (const s_reader_t *r, uint64_t at, uint8_t *buf, size_t len, kiln_err_t *err)
{
    if (r->mem) {
        memcpy (buf, r->mem + at, len);
        return 0;
    }
    ssize_t n = pread (r->src_fd, buf, len, (off_t) at);
    if (n != (ssize_t) len)
        return kiln_error (err, KILN_EIO, "could not read %zu bytes of the archive at "
                           "offset %llu: %s", len, (unsigned long long) at,
                           n < 0 ? strerror (errno) : "short read");
    return 0;
}

static bool
s_all_zero (const uint8_t *p, size_t len)
{
    for (size_t i = 0; i < len; i++)
        if (p[i])
            return false;
    return true;
}

/* The archive ends where tar's end marker (two zero blocks) ends, `end`
 * bytes in, and nothing follows it but the zeros that pad an archive to
 * tar's 10240-byte record (GNU tar and Python's tarfile write them; kiln
 * does not): bytes appended to an artifact are refused, not ignored. */
static int
s_check_end (const s_reader_t *r, uint64_t end, uint64_t input_size, kiln_err_t *err)
{
    uint8_t buf[S_TAR_RECORD];
    if (end < 2 * S_TAR_BLOCK || end > input_size)
        return kiln_error (err, KILN_EFORMAT, "the archive has no end marker (two zero blocks)");
    int rc = s_input_bytes (r, end - 2 * S_TAR_BLOCK, buf, 2 * S_TAR_BLOCK, err);
    if (rc)
        return rc;
    if (!s_all_zero (buf, 2 * S_TAR_BLOCK))
        return kiln_error (err, KILN_EFORMAT, "the archive has no end marker (two zero blocks)");
    uint64_t tail = input_size - end;
    uint64_t pad = (S_TAR_RECORD - end % S_TAR_RECORD) % S_TAR_RECORD;
    if (tail > pad)
        return kiln_error (err, KILN_EFORMAT, "%llu bytes follow the archive's end marker",
                           (unsigned long long) tail);
    if (tail && ((rc = s_input_bytes (r, end, buf, (size_t) tail, err))
                 || !s_all_zero (buf, (size_t) tail)))
        return rc ? rc : kiln_error (err, KILN_EFORMAT, "%llu bytes follow the archive's end "
                                     "marker, not all of them zero", (unsigned long long) tail);
    return 0;
}

/* tar pads each member's data with zeros to its 512-byte block; kiln
 * refuses anything else there, so that no byte of an accepted artifact
 * lies outside what its checks cover but tar's own structure (the data
 * is hashed; headers are checked field by field). */
static int
s_check_padding (const s_reader_t *r, const char *name, int64_t data_at, uint64_t size,
                 uint64_t input_size, kiln_err_t *err)
{
    uint64_t pad = (S_TAR_BLOCK - size % S_TAR_BLOCK) % S_TAR_BLOCK;
    if (!pad || data_at < 0)
        return 0;
    uint64_t at = (uint64_t) data_at + size;
    if (at > input_size || pad > input_size - at)
        return kiln_error (err, KILN_EFORMAT, "member '%s' is truncated", name);
    uint8_t buf[S_TAR_BLOCK];
    int rc = s_input_bytes (r, at, buf, (size_t) pad, err);
    if (rc)
        return rc;
    if (!s_all_zero (buf, (size_t) pad))
        return kiln_error (err, KILN_EFORMAT, "the %llu bytes that pad member '%s' to "
                           "tar's 512-byte block are not all zero",
                           (unsigned long long) pad, name);
    return 0;
}

/* What a header may say besides name and size: exactly what kiln writes
 * (mode 0644, owner and group 0 or "kiln", mtime 0), and nothing more (no
 * extended attributes, ACLs or file flags).  So `tar xf` run as root on
 * an artifact that kiln accepted makes plain files owned by root, never
 * a setuid, group-writable, device or special file. */
static int
s_check_metadata (struct archive_entry *e, const char *name, kiln_err_t *err)
{
    const char *u = archive_entry_uname (e), *g = archive_entry_gname (e);
    unsigned long set = 0, clear = 0;
    archive_entry_fflags (e, &set, &clear);
    unsigned mode = (unsigned) archive_entry_mode (e) & 07777;
    if (mode != S_MEMBER_PERM || archive_entry_uid (e) != 0 || archive_entry_gid (e) != 0
        || (u && *u && strcmp (u, S_MEMBER_OWNER) != 0)
        || (g && *g && strcmp (g, S_MEMBER_OWNER) != 0)
        || (archive_entry_mtime_is_set (e) && archive_entry_mtime (e) != 0))
        return kiln_error (err, KILN_EFORMAT, "member '%s' has mode %04o, owner %lld:%lld "
                           "(%s:%s), mtime %lld; an artifact's members have mode %04o, "
                           "owner 0:0 (%s) and mtime 0", name, mode,
                           (long long) archive_entry_uid (e), (long long) archive_entry_gid (e),
                           u ? u : "", g ? g : "", (long long) archive_entry_mtime (e),
                           S_MEMBER_PERM, S_MEMBER_OWNER);
    if (archive_entry_xattr_count (e) > 0 || set || clear
        || archive_entry_acl_count (e, ARCHIVE_ENTRY_ACL_TYPE_ACCESS
                                       | ARCHIVE_ENTRY_ACL_TYPE_DEFAULT
                                       | ARCHIVE_ENTRY_ACL_TYPE_NFS4) > 0)
        return kiln_error (err, KILN_EFORMAT, "member '%s' carries extended attributes, "
                           "ACLs or file flags", name);
    return 0;
}

/* Walk the entries: bounds and names from each header before anything is
 * allocated, the manifest (which must come first) parsed as soon as it is
 * read so that every payload entry is checked against it. */
static int
s_read_entries (struct archive *a, uint64_t input_size, kiln_artifact_t *self,
                s_reader_t *r, kiln_err_t *err)
{
    uint64_t declared = 0;
    int entries = 0;
    struct archive_entry *e;
    for (;;) {
        int ar = archive_read_next_header (a, &e);
        if (ar == ARCHIVE_EOF) {
            int64_t end = archive_filter_bytes (a, 0);
            int rc;
            if (entries > 0 && (rc = s_check_end (r, end < 0 ? 0 : (uint64_t) end,
                                                  input_size, err)))
                return rc;
            break;
        }
        if (ar != ARCHIVE_OK)
            return kiln_error (err, KILN_EFORMAT, "not a valid tar archive: %s",
                               archive_error_string (a) ? archive_error_string (a)
                                                        : "read error");
        if (++entries > KILN_MAX_MEMBERS + KILN_N_RESERVED_MEMBERS)
            return kiln_error (err, KILN_ELIMIT, "more than %d members",
                               KILN_MAX_MEMBERS + KILN_N_RESERVED_MEMBERS);
        const char *name = archive_entry_pathname (e);
        if (!name || !s_plain_name (name))
            return kiln_error (err, KILN_EFORMAT,
                               "member %d has a name that is not plain (want [A-Za-z0-9._-]{1,%d}, not '.' or '..')",
                               entries, KILN_MAX_MEMBER_NAME);
        if (archive_entry_filetype (e) != AE_IFREG || archive_entry_hardlink (e)
            || archive_entry_symlink (e) || archive_entry_sparse_count (e) > 0)
            return kiln_error (err, KILN_EFORMAT, "member '%s' is not a regular file", name);
        int mrc = s_check_metadata (e, name, err);
        if (mrc)
            return mrc;
        if (!archive_entry_size_is_set (e) || archive_entry_size (e) < 0)
            return kiln_error (err, KILN_EFORMAT, "member '%s' has no size", name);
        uint64_t size = (uint64_t) archive_entry_size (e);
        int slot = s_reserved_slot (name);
        uint64_t max = slot >= 0 ? s_reserved_max[slot] : KILN_MAX_MEMBER_BYTES;
        if (size > max)
            return kiln_error (err, KILN_ELIMIT, "member '%s' is %llu bytes, more than the limit of %llu",
                               name, (unsigned long long) size, (unsigned long long) max);
        if (slot == S_MANIFEST_SIG || slot == S_PROVENANCE_SIG) {
            if (size != KILN_SIG_LEN)
                return kiln_error (err, KILN_EFORMAT, "member '%s' is %llu bytes, not %d",
                                   name, (unsigned long long) size, KILN_SIG_LEN);
        }
        //  A header may claim any size; never believe more than the input.
        declared += size;
        if (declared > input_size)
            return kiln_error (err, KILN_EFORMAT,
                               "member '%s' claims %llu bytes, more than the archive holds",
                               name, (unsigned long long) size);
        if (entries == 1 && slot != S_MANIFEST)
            return kiln_error (err, KILN_EFORMAT,
                               "first member is '%s', not manifest.json: not a kiln artifact",
                               name);

        int rc;
        //  Where the header left the archive is where the data starts.
        int64_t data_at = archive_filter_bytes (a, 0);
        if ((rc = s_check_padding (r, name, data_at, size, input_size, err)))
            return rc;
        if (slot >= 0) {
            if (r->data[slot])
                return kiln_error (err, KILN_EFORMAT, "member '%s' appears twice", name);
            if ((rc = s_read_data (a, name, size, &r->data[slot], err)))
                return rc;
            r->len[slot] = (size_t) size;
            if (slot == S_MANIFEST
                && (rc = kiln_manifest_decode ((const char *) r->data[slot], r->len[slot],
                                               &self->manifest, r->expected,
                                               &r->n_expected, err)))
                return rc;
            continue;
        }
        int at = -1;
        for (int i = 0; i < r->n_expected; i++)
            if (strcmp (r->expected[i].name, name) == 0)
                at = i;
        if (at < 0)
            return kiln_error (err, KILN_EFORMAT, "member '%s' is not listed in the manifest",
                               name);
        if (r->seen[at])
            return kiln_error (err, KILN_EFORMAT, "member '%s' appears twice", name);
        r->seen[at] = true;
        if (size != r->expected[at].len)
            return kiln_error (err, KILN_EVERIFY,
                               "member '%s': size %llu does not match the manifest (%zu)",
                               name, (unsigned long long) size, r->expected[at].len);
        kiln_member_t *m = &r->got[at];
        snprintf (m->name, sizeof m->name, "%s", name);
        //  A wrong data offset could only map bytes whose digest then fails.
        m->file_offset = data_at > 0 && r->src_fd >= 0 ? (uint64_t) data_at : 0;
        if (r->skim) {
            //  KILN_ARTIFACT_SKIM: the size is checked, the bytes are not.
            if (archive_read_data_skip (a) != ARCHIVE_OK)
                return kiln_error (err, KILN_EFORMAT, "member '%s': %s", name,
                                   archive_error_string (a) ? archive_error_string (a)
                                                            : "read error");
            m->len = (size_t) size;
            memcpy (m->sha256, r->expected[at].sha256, KILN_HEX_LEN);
            continue;
        }
        rc = 1;
        if (r->fd >= 0 && size >= KILN_ARTIFACT_ALIGN && data_at >= 0
            && (uint64_t) data_at % r->page == 0)
            rc = s_map_data (a, r, name, (uint64_t) data_at, size, input_size, m, err);
        if (rc == 1)
            rc = s_read_data (a, name, size, &m->data, err);
        if (rc)
            return rc;
        m->len = (size_t) size;
        uint8_t digest[KILN_DIGEST_LEN];
        if (m->mapped)
            kiln_sha256_mapped (m->data, m->len, digest);
        else
            kiln_sha256 (m->data, m->len, digest);
        kiln_hex (digest, KILN_DIGEST_LEN, m->sha256);
        if (strcmp (m->sha256, r->expected[at].sha256) != 0)
            return kiln_error (err, KILN_EVERIFY, "member '%s': sha256 mismatch", name);
    }
    if (entries == 0)
        return kiln_error (err, KILN_EFORMAT, "empty archive: not a kiln artifact");
    for (int i = 0; i < r->n_expected; i++)
        if (!r->seen[i])
            return kiln_error (err, KILN_EFORMAT,
                               "member '%s' is listed in the manifest but missing",
                               r->expected[i].name);
    return 0;
}

/* Move what the reader collected into the artifact, checking that the
 * signature members come in their pairs. */
static int
s_adopt (kiln_artifact_t *self, s_reader_t *r, kiln_err_t *err)
{
    bool msig = r->data[S_MANIFEST_SIG], sig = r->data[S_SIGNATURE];
    bool prov = r->data[S_PROVENANCE], psig = r->data[S_PROVENANCE_SIG];
    if (msig != sig)
        return kiln_error (err, KILN_EFORMAT, "member '%s' is present without '%s'",
                           msig ? KILN_MEMBER_MANIFEST_SIG : KILN_MEMBER_SIGNATURE,
                           msig ? KILN_MEMBER_SIGNATURE : KILN_MEMBER_MANIFEST_SIG);
    if (prov != psig)
        return kiln_error (err, KILN_EFORMAT, "member '%s' is present without '%s'",
                           prov ? KILN_MEMBER_PROVENANCE : KILN_MEMBER_PROVENANCE_SIG,
                           prov ? KILN_MEMBER_PROVENANCE_SIG : KILN_MEMBER_PROVENANCE);
    if (prov && !sig)
        return kiln_error (err, KILN_EFORMAT, "provenance is present but the manifest is not signed");
    int rc;
    if (sig && (rc = s_parse_signature (self, r->data[S_SIGNATURE], r->len[S_SIGNATURE], err)))
        return rc;
    if (prov) {
        char *check;
        rc = s_canonical_object ("provenance.json", (const char *) r->data[S_PROVENANCE],
                                 r->len[S_PROVENANCE], KILN_MAX_PROVENANCE_BYTES,
                                 KILN_EFORMAT, &check, err);
        free (check);
        if (rc)
            return rc;
    }

    for (int i = 0; i < r->n_expected; i++) {
        self->members[i] = r->got[i];
        r->got[i].data = NULL;
    }
    self->n_members = r->n_expected;
    self->signed_manifest = (char *) r->data[S_MANIFEST];
    self->signed_manifest_len = r->len[S_MANIFEST];
    r->data[S_MANIFEST] = NULL;
    if (sig) {
        self->is_signed = true;
        memcpy (self->manifest_sig, r->data[S_MANIFEST_SIG], KILN_SIG_LEN);
        self->signature_json = (char *) r->data[S_SIGNATURE];
        self->signature_json_len = r->len[S_SIGNATURE];
        r->data[S_SIGNATURE] = NULL;
    }
    else {
        //  An unsigned artifact has nothing that signed these bytes.
        free (self->signed_manifest);
        self->signed_manifest = NULL;
        self->signed_manifest_len = 0;
    }
    if (prov) {
        self->provenance = (char *) r->data[S_PROVENANCE];
        self->provenance_len = r->len[S_PROVENANCE];
        r->data[S_PROVENANCE] = NULL;
        memcpy (self->provenance_sig, r->data[S_PROVENANCE_SIG], KILN_SIG_LEN);
    }
    return 0;
}

/* Read an opened archive of `input_size` bytes into a new artifact,
 * mapping large members from `map_fd` when it is not -1.  *mapped says
 * whether anything was.  The input is `mem` or, when that is NULL, the
 * file `src_fd` (for the check of its end). */
static kiln_artifact_t *
s_read_archive (struct archive *a, const uint8_t *mem, int src_fd, uint64_t input_size,
                int map_fd, bool skim, bool *mapped, kiln_err_t *err)
{
    kiln_artifact_t *self = kiln_artifact_new ();
    s_reader_t *r = calloc (1, sizeof *r);
    *mapped = false;
    if (!self || !r) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto err;
    }
    r->mem = mem;
    r->src_fd = src_fd;
    r->fd = map_fd;
    r->skim = skim;
    long page = sysconf (_SC_PAGESIZE);
    r->page = page > 0 ? (uint64_t) page : KILN_ARTIFACT_ALIGN;
    if (s_read_entries (a, input_size, self, r, err) || s_adopt (self, r, err))
        goto err;
    *mapped = r->mapped;
    s_reader_release (r);
    free (r);
    return self;
err:
    if (r)
        s_reader_release (r);
    free (r);
    kiln_artifact_destroy (&self);
    return NULL;
}

static struct archive *
s_reader_new (kiln_err_t *err)
{
    struct archive *a = archive_read_new ();
    //  tar only, and no decompression filters: no bombs, no surprises.
    if (!a || archive_read_support_format_tar (a) != ARCHIVE_OK) {
        archive_read_free (a);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    return a;
}

kiln_artifact_t *
kiln_artifact_read_mem (const uint8_t *data, size_t len, kiln_err_t *err)
{
    if (len > KILN_MAX_ARTIFACT_BYTES) {
        kiln_error (err, KILN_ELIMIT, "artifact is %zu bytes, more than the limit of %llu",
                    len, (unsigned long long) KILN_MAX_ARTIFACT_BYTES);
        return NULL;
    }
    struct archive *a = s_reader_new (err);
    if (!a)
        return NULL;
    kiln_artifact_t *self = NULL;
    bool mapped;
    if (archive_read_open_memory (a, data, len) != ARCHIVE_OK)
        kiln_error (err, KILN_EFORMAT, "not a valid tar archive: %s",
                    archive_error_string (a) ? archive_error_string (a) : "read error");
    else
        self = s_read_archive (a, data, -1, len, -1, false, &mapped, err);
    archive_read_free (a);
    return self;
}

/* True when nobody but this process's effective user and root can change
 * the file: mapping it is then as safe as holding a copy, short of those
 * two writing it in place (docs/artifact-format.md). */
static bool
s_file_private (int fd, const struct stat *st)
{
    if (st->st_uid != geteuid () && st->st_uid != 0)
        return false;
    if (st->st_mode & (S_IWGRP | S_IWOTH))
        return false;
    //  An access ACL may grant write to others whatever the mode says.
    if (fgetxattr (fd, "system.posix_acl_access", NULL, 0) >= 0)
        return false;
    return errno == ENODATA || errno == ENOTSUP;
}

kiln_artifact_t *
kiln_artifact_read_fd (int fd, const char *path, unsigned flags, kiln_err_t *err)
{
    struct stat st;
    if (fstat (fd, &st) != 0 || !S_ISREG (st.st_mode)
        || lseek (fd, 0, SEEK_SET) != 0) {
        kiln_error (err, KILN_EIO, "artifact '%s' is not a regular file", path);
        return NULL;
    }
    if ((uint64_t) st.st_size > KILN_MAX_ARTIFACT_BYTES) {
        kiln_error (err, KILN_ELIMIT, "artifact '%s' is %lld bytes, more than the limit of %llu",
                    path, (long long) st.st_size, (unsigned long long) KILN_MAX_ARTIFACT_BYTES);
        return NULL;
    }
    int map_fd = (flags & KILN_ARTIFACT_MAP) && s_file_private (fd, &st) ? fd : -1;
    kiln_artifact_t *self = NULL;
    bool mapped = false;
    struct archive *a = s_reader_new (err);
    if (a) {
        if (archive_read_open_fd (a, fd, S_READ_BLOCK) != ARCHIVE_OK)
            kiln_error (err, KILN_EFORMAT, "not a valid tar archive: %s",
                        archive_error_string (a) ? archive_error_string (a) : "read error");
        else
            self = s_read_archive (a, NULL, fd, (uint64_t) st.st_size, map_fd,
                                   (flags & KILN_ARTIFACT_SKIM) != 0, &mapped, err);
        archive_read_free (a);
    }
    //  The digests were taken from the mapped pages; a write to the file
    //  since it was opened may have changed them after they were hashed.
    struct stat after;
    if (self && mapped && (fstat (fd, &after) != 0 || !kiln_file_unchanged (&st, &after))) {
        kiln_artifact_destroy (&self);
        kiln_error (err, KILN_EVERIFY, "the file changed while it was being read");
    }
    if (!self)
        kiln_error_prefix (err, "artifact '%s'", path);
    return self;
}

kiln_artifact_t *
kiln_artifact_read (const char *path, kiln_err_t *err)
{
    int fd = kiln_open_regular (path, "artifact", 0, NULL, err);
    if (fd < 0)
        return NULL;
    kiln_artifact_t *self = kiln_artifact_read_fd (fd, path, 0, err);
    close (fd);
    return self;
}

/* --- verification ---------------------------------------------------- */

/* The checks that need neither the keyring nor any crypto. */
static int
s_verify_precheck (const kiln_artifact_t *self, kiln_err_t *err)
{
    if (!self->is_signed)
        return kiln_error (err, KILN_EVERIFY, "artifact is not signed");
    if (strcmp (self->sig_algorithm, KILN_SIG_ALGORITHM) != 0)
        return kiln_error (err, KILN_EVERIFY,
                           "signature algorithm '%s' is not supported (want %s)",
                           self->sig_algorithm, KILN_SIG_ALGORITHM);
    if (strcmp (self->sig_signs, KILN_MEMBER_MANIFEST) != 0)
        return kiln_error (err, KILN_EVERIFY, "signature.json signs '%s', not %s",
                           self->sig_signs, KILN_MEMBER_MANIFEST);
    return 0;
}

int
kiln_artifact_verify_keyring (const kiln_artifact_t *self,
                              const kiln_keyring_t *ring, kiln_err_t *err)
{
    int rc = s_verify_precheck (self, err);
    if (rc)
        return rc;
    const kiln_key_t *key = kiln_keyring_find (ring, self->signer);
    if (!key)
        return kiln_error (err, KILN_EVERIFY, "signed by key %s which is not in keyring '%s'",
                           self->signer, kiln_keyring_dir (ring));
    //  What is checked is the manifest of what the artifact holds now, so
    //  that a member added or a field changed since it was read fails here.
    char *manifest;
    size_t manifest_len;
    if ((rc = kiln_manifest_encode (&self->manifest, self->members, self->n_members,
                                    &manifest, &manifest_len, err)))
        return rc;
    bool ok = kiln_key_verify (key, manifest, manifest_len, self->manifest_sig);
    free (manifest);
    if (!ok)
        return kiln_error (err, KILN_EVERIFY, "bad signature on manifest.json (key %s)",
                           self->signer);
    if (self->provenance
        && !kiln_key_verify (key, self->provenance, self->provenance_len,
                             self->provenance_sig))
        return kiln_error (err, KILN_EVERIFY, "bad signature on provenance.json (key %s)",
                           self->signer);
    return 0;
}

int
kiln_artifact_verify (const kiln_artifact_t *self, const char *keyring_dir,
                      kiln_err_t *err)
{
    int rc = s_verify_precheck (self, err);
    if (rc)
        return rc;
    kiln_err_t local;
    kiln_keyring_t *ring = kiln_keyring_load (keyring_dir, err ? err : &local);
    if (!ring)
        return -(err ? err : &local)->code;
    rc = kiln_artifact_verify_keyring (self, ring, err);
    kiln_keyring_destroy (&ring);
    return rc;
}

kiln_artifact_t *
kiln_artifact_open_verified (const char *path, const char *keyring_dir,
                             kiln_err_t *err)
{
    kiln_artifact_t *self = kiln_artifact_read (path, err);
    if (self && kiln_artifact_verify (self, keyring_dir, err)) {
        kiln_error_prefix (err, "artifact '%s'", path);
        kiln_artifact_destroy (&self);
    }
    return self;
}

kiln_artifact_t *
kiln_artifact_open_verified_mem (const uint8_t *data, size_t len,
                                 const char *keyring_dir, kiln_err_t *err)
{
    kiln_artifact_t *self = kiln_artifact_read_mem (data, len, err);
    if (self && kiln_artifact_verify (self, keyring_dir, err))
        kiln_artifact_destroy (&self);
    return self;
}
