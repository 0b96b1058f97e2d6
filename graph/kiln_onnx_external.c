/*
 * kiln_onnx_external — ONNX external data; see kiln_onnx_external.h.
 *
 * A location is checked in three steps, each refusing what the one
 * before cannot see: its text (empty, absolute, ".."), then where it
 * leads once realpath has resolved every symlink (inside the model
 * directory's realpath, a regular file), then the file actually opened
 * (O_NOFOLLOW, and the same device and inode that was checked, so a file
 * swapped between the check and the open is refused rather than read).
 * Someone who can rename directories inside the model's directory while
 * the import runs could still redirect an intermediate component between
 * realpath and open; such a person can change the model itself, so kiln
 * does not defend against it (docs/graph-format.md says so).
 */
#include "graph/kiln_onnx_external.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kiln_fs.h"
#include "common/kiln_limits.h"

/* Longest location accepted: a path the kernel could open at all. */
#define S_MAX_LOCATION PATH_MAX

/* How much of a value from the file an error message quotes. */
#define S_QUOTE 64

struct kiln_onnx_external {
    char *dir;               /* the model's directory as given; NULL: from memory */
    char *dir_real;          /* its realpath, resolved at the first external tensor */
    uint64_t total;          /* external bytes read so far, at most KILN_MAX_MODEL_BYTES */
};

/* The external_data entries kiln reads; NULL when absent. */
typedef struct {
    const char *location;
    const char *offset;
    const char *length;
} refs_t;


kiln_onnx_external_t *
kiln_onnx_external_new (const char *dir, kiln_err_t *err)
{
    kiln_onnx_external_t *self = calloc (1, sizeof *self);
    if (!self || (dir && *dir && !(self->dir = strdup (dir)))) {
        free (self);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    return self;
}

void
kiln_onnx_external_destroy (kiln_onnx_external_t **self_p)
{
    if (!*self_p)
        return;
    kiln_onnx_external_t *self = *self_p;
    free (self->dir);
    free (self->dir_real);
    free (self);
    *self_p = NULL;
}

/* Pick location, offset and length out of the entries; a key given twice
 * is refused, since which one counts would be a guess.  Other keys
 * (checksum, anything newer) are ignored. */
static int
s_refs (const char *name, Onnx__StringStringEntryProto *const *entries, size_t n,
        refs_t *refs, kiln_err_t *err)
{
    memset (refs, 0, sizeof *refs);
    for (size_t i = 0; i < n; i++) {
        const char *key = entries[i]->key ? entries[i]->key : "";
        const char *value = entries[i]->value ? entries[i]->value : "";
        const char **slot = strcmp (key, "location") == 0 ? &refs->location
                          : strcmp (key, "offset") == 0   ? &refs->offset
                          : strcmp (key, "length") == 0   ? &refs->length
                          : NULL;
        if (!slot)
            continue;
        if (*slot)
            return kiln_error (err, KILN_EFORMAT, "weight '%s': external data has the key "
                               "'%s' twice", name, key);
        *slot = value;
    }
    if (!refs->location)
        return kiln_error (err, KILN_EFORMAT, "weight '%s' keeps its data in an external "
                           "file but has no 'location' entry", name);
    return 0;
}

/* Parse the byte count `text` of entry `key`: decimal digits only, as
 * onnx writes them, so that "-1", "+4", " 4" and "4k" are refused rather
 * than read as strtoull would. */
static int
s_parse_count (const char *name, const char *key, const char *text, uint64_t *out,
               kiln_err_t *err)
{
    uint64_t v = 0;
    if (!*text || strspn (text, "0123456789") != strlen (text))
        return kiln_error (err, KILN_EFORMAT, "weight '%s': external data %s '%.*s' is "
                           "not a byte count (decimal digits, no sign)", name, key,
                           S_QUOTE, text);
    for (const char *p = text; *p; p++) {
        uint64_t d = (uint64_t) (*p - '0');
        if (v > (UINT64_MAX - d) / 10)
            return kiln_error (err, KILN_EFORMAT, "weight '%s': external data %s '%.*s' is "
                               "more than 2^64 - 1", name, key, S_QUOTE, text);
        v = v * 10 + d;
    }
    *out = v;
    return 0;
}

/* Refuse a location whose text already leaves the model's directory, as
 * the ONNX spec forbids: absolute, or with a ".." component. */
static int
s_check_location (const char *name, const char *loc, kiln_err_t *err)
{
    size_t len = strnlen (loc, S_MAX_LOCATION + 1);
    if (len == 0)
        return kiln_error (err, KILN_EFORMAT, "weight '%s': external data location is empty",
                           name);
    if (len > S_MAX_LOCATION)
        return kiln_error (err, KILN_ELIMIT, "weight '%s': external data location "
                           "'%.*s...' is longer than %d bytes", name, S_QUOTE, loc,
                           S_MAX_LOCATION);
    if (loc[0] == '/')
        return kiln_error (err, KILN_EFORMAT, "weight '%s': external data location '%s' is "
                           "an absolute path; it must be relative to the model's directory",
                           name, loc);
    for (const char *p = loc; *p; ) {
        size_t n = strcspn (p, "/");
        if (n == 2 && p[0] == '.' && p[1] == '.')
            return kiln_error (err, KILN_EFORMAT, "weight '%s': external data location '%s' "
                               "has a '..' component; it must stay inside the model's "
                               "directory", name, loc);
        p += n;
        p += *p == '/';
    }
    return 0;
}

/* Resolve the model directory once. */
static int
s_resolve_dir (kiln_onnx_external_t *self, kiln_err_t *err)
{
    if (self->dir_real)
        return 0;
    self->dir_real = realpath (self->dir, NULL);
    if (!self->dir_real)
        return kiln_error (err, errno == ENOENT ? KILN_ENOTFOUND : KILN_EIO,
                           "could not resolve the model's directory '%s': %s", self->dir,
                           strerror (errno));
    return 0;
}

/* Whether the resolved path `real` is the directory `dir` or below it. */
static bool
s_inside (const char *real, const char *dir)
{
    size_t n = strlen (dir);
    if (n == 1 && dir[0] == '/')
        return real[0] == '/';
    return strncmp (real, dir, n) == 0 && (real[n] == '\0' || real[n] == '/');
}

/* Open the file `loc` names, confined to the model's directory: *fd is
 * open for reading on a regular file inside it, whose size is *size. */
static int
s_open (kiln_onnx_external_t *self, const char *name, const char *loc, int *fd,
        uint64_t *size, kiln_err_t *err)
{
    int rc = 0;
    char *real = NULL;
    size_t dlen = strlen (self->dir_real), llen = strlen (loc);
    char *joined = malloc (dlen + llen + 2);
    if (!joined)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    snprintf (joined, dlen + llen + 2, "%s/%s", self->dir_real, loc);
    *fd = -1;
    if (!(real = realpath (joined, NULL))) {
        if (errno == ENOENT || errno == ENOTDIR)
            rc = kiln_error (err, KILN_ENOTFOUND, "weight '%s': external data file '%s' "
                             "not found in the model's directory '%s'", name, loc,
                             self->dir_real);
        else
            rc = kiln_error (err, KILN_EIO, "weight '%s': could not resolve external data "
                             "location '%s': %s", name, loc, strerror (errno));
        goto done;
    }
    if (!s_inside (real, self->dir_real)) {
        rc = kiln_error (err, KILN_EFORMAT, "weight '%s': external data location '%s' "
                         "resolves to '%s', outside the model's directory '%s'", name,
                         loc, real, self->dir_real);
        goto done;
    }
    /* stat before open, so that a FIFO or a device is never opened. */
    struct stat before, after;
    if (stat (real, &before) != 0) {
        rc = kiln_error (err, KILN_EIO, "weight '%s': could not stat external data file "
                         "'%s': %s", name, loc, strerror (errno));
        goto done;
    }
    if (!S_ISREG (before.st_mode)) {
        rc = kiln_error (err, KILN_EFORMAT, "weight '%s': external data location '%s' is "
                         "not a regular file", name, loc);
        goto done;
    }
    *fd = open (real, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (*fd < 0) {
        rc = kiln_error (err, KILN_EIO, "weight '%s': could not open external data file "
                         "'%s': %s", name, loc, strerror (errno));
        goto done;
    }
    if (fstat (*fd, &after) != 0 || !S_ISREG (after.st_mode)
        || after.st_dev != before.st_dev || after.st_ino != before.st_ino) {
        rc = kiln_error (err, KILN_EIO, "weight '%s': external data file '%s' changed "
                         "while it was opened", name, loc);
        goto done;
    }
    *size = (uint64_t) after.st_size;
done:
    if (rc && *fd >= 0) {
        close (*fd);
        *fd = -1;
    }
    free (real);
    free (joined);
    return rc;
}

/* Read `len` bytes at `offset` of `fd` into buf. */
static int
s_pread_all (int fd, uint8_t *buf, uint64_t len, uint64_t offset, const char *name,
             const char *loc, kiln_err_t *err)
{
    int64_t n = kiln_pread_all (fd, buf, len, offset);
    if (n < 0)
        return kiln_error (err, KILN_EIO, "weight '%s': could not read external data "
                           "file '%s': %s", name, loc, strerror (errno));
    if ((uint64_t) n < len)
        return kiln_error (err, KILN_EIO, "weight '%s': external data file '%s' ended "
                           "at byte %llu while being read (was it truncated?)", name,
                           loc, (unsigned long long) (offset + (uint64_t) n));
    return 0;
}

int
kiln_onnx_external_open (kiln_onnx_external_t *self, const char *name,
                         Onnx__StringStringEntryProto *const *entries, size_t n,
                         const char *what, uint64_t bytes, int *fd_out,
                         uint64_t *offset_out, kiln_err_t *err)
{
    refs_t refs;
    uint64_t offset = 0, length = 0, size = 0;
    int fd = -1;
    *fd_out = -1;
    *offset_out = 0;

    int rc = s_refs (name, entries, n, &refs, err);
    if (rc)
        return rc;
    if (!self->dir)
        return kiln_error (err, KILN_EUNSUPPORTED, "weight '%s' keeps its data in the "
                           "external file '%.*s', and a model imported from memory has no "
                           "directory to find it in; import the model from its file (or "
                           "give its directory)", name, S_QUOTE, refs.location);
    /* Everything the entries say on their own is checked before any file
     * is touched. */
    if ((rc = s_check_location (name, refs.location, err))
        || (refs.offset && (rc = s_parse_count (name, "offset", refs.offset, &offset, err)))
        || (refs.length && (rc = s_parse_count (name, "length", refs.length, &length, err))))
        return rc;
    if (refs.length && length != bytes)
        return kiln_error (err, KILN_EFORMAT, "weight '%s' is %s (%llu bytes) but its "
                           "external data length is %llu", name, what,
                           (unsigned long long) bytes, (unsigned long long) length);
    if (bytes > KILN_MAX_MODEL_BYTES - self->total)
        return kiln_error (err, KILN_ELIMIT, "weight '%s' brings the model's external data "
                           "to more than %llu bytes, the limit of a kiln graph", name,
                           (unsigned long long) KILN_MAX_MODEL_BYTES);

    if ((rc = s_resolve_dir (self, err))
        || (rc = s_open (self, name, refs.location, &fd, &size, err)))
        return rc;
    /* Written so that nothing wraps: offset + length may not fit 64 bits. */
    if (refs.length && (offset > size || length > size - offset)) {
        rc = kiln_error (err, KILN_EFORMAT, "weight '%s': external data at offset %llu, "
                         "length %llu, goes past the end of '%s' (%llu bytes)", name,
                         (unsigned long long) offset, (unsigned long long) length,
                         refs.location, (unsigned long long) size);
        goto done;
    }
    if (!refs.length && offset > size) {
        rc = kiln_error (err, KILN_EFORMAT, "weight '%s': external data offset %llu is "
                         "past the end of '%s' (%llu bytes)", name,
                         (unsigned long long) offset, refs.location,
                         (unsigned long long) size);
        goto done;
    }
    if (!refs.length)
        length = size - offset;
    if (length != bytes) {
        rc = kiln_error (err, KILN_EFORMAT, "weight '%s' is %s (%llu bytes) but its "
                         "external data, from offset %llu to the end of '%s', is %llu "
                         "bytes", name, what, (unsigned long long) bytes,
                         (unsigned long long) offset, refs.location,
                         (unsigned long long) length);
        goto done;
    }
    self->total += bytes;
    *fd_out = fd;
    *offset_out = offset;
    return 0;
done:
    close (fd);
    return rc;
}

int
kiln_onnx_external_read (kiln_onnx_external_t *self, const char *name,
                         Onnx__StringStringEntryProto *const *entries, size_t n,
                         const char *what, uint64_t bytes, uint8_t **data,
                         kiln_err_t *err)
{
    int fd;
    uint64_t offset;
    uint8_t *buf = NULL;
    *data = NULL;
    int rc = kiln_onnx_external_open (self, name, entries, n, what, bytes, &fd, &offset, err);
    if (rc)
        return rc;
    if (bytes >= SIZE_MAX || !(buf = malloc ((size_t) bytes + 1)))
        rc = kiln_error (err, KILN_ENOMEM, "out of memory for weight '%s' (%llu bytes)",
                         name, (unsigned long long) bytes);
    else if ((rc = s_pread_all (fd, buf, bytes, offset, name, "its external file", err)) == 0) {
        *data = buf;
        buf = NULL;
    }
    free (buf);
    close (fd);
    return rc;
}
