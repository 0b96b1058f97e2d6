#include "runtime/kiln_npy.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kiln_fs.h"

static const uint8_t s_magic[6] = { 0x93, 'N', 'U', 'M', 'P', 'Y' };

void
kiln_npy_init (kiln_npy_t *npy)
{
    memset (npy, 0, sizeof *npy);
}

void
kiln_npy_release (kiln_npy_t *npy)
{
    free (npy->data);
    kiln_npy_init (npy);
}

/* --- header parsing ------------------------------------------------- */

/* A cursor over the header text: a Python dict literal. */
typedef struct {
    const char *p, *end;
} s_cur_t;

static void
s_ws (s_cur_t *c)
{
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n'
                             || *c->p == '\r'))
        c->p++;
}

static bool
s_eat (s_cur_t *c, char ch)
{
    s_ws (c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return true;
    }
    return false;
}

/* A quoted string (no escapes: none of the values kiln reads has any). */
static bool
s_string (s_cur_t *c, char *out, size_t size)
{
    s_ws (c);
    if (c->p >= c->end || (*c->p != '\'' && *c->p != '"'))
        return false;
    char q = *c->p++;
    size_t n = 0;
    while (c->p < c->end && *c->p != q) {
        if (*c->p == '\\' || n + 1 >= size)
            return false;
        out[n++] = *c->p++;
    }
    if (c->p >= c->end)
        return false;
    c->p++;
    out[n] = '\0';
    return true;
}

static bool
s_word (s_cur_t *c, const char *w)
{
    s_ws (c);
    size_t n = strlen (w);
    if ((size_t) (c->end - c->p) >= n && memcmp (c->p, w, n) == 0) {
        c->p += n;
        return true;
    }
    return false;
}

static bool
s_int (s_cur_t *c, int64_t *out)
{
    s_ws (c);
    int64_t v = 0;
    const char *start = c->p;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
        v = v * 10 + (*c->p - '0');
        if (v > KILN_MAX_DIM)
            return false;
        c->p++;
    }
    if (c->p == start)
        return false;
    if (c->p < c->end && *c->p == 'L')     /* Python 2 longs */
        c->p++;
    *out = v;
    return true;
}

/* "(2, 3)", "(3,)", "()". */
static bool
s_shape (s_cur_t *c, kiln_shape_t *shape)
{
    shape->rank = 0;
    if (!s_eat (c, '('))
        return false;
    if (s_eat (c, ')'))
        return true;
    for (;;) {
        if (shape->rank >= KILN_MAX_RANK
            || !s_int (c, &shape->dims[shape->rank]))
            return false;
        shape->rank++;
        if (s_eat (c, ')'))
            return true;
        if (!s_eat (c, ','))
            return false;
        if (s_eat (c, ')'))
            return true;
    }
}

static int
s_parse_header (const char *h, size_t len, kiln_npy_t *npy, kiln_err_t *err)
{
    s_cur_t c = { h, h + len };
    char descr[32] = "";
    bool have_descr = false, have_order = false, have_shape = false, fortran = false;
    if (!s_eat (&c, '{'))
        return kiln_error (err, KILN_EFORMAT, "header is not a dict");
    while (!s_eat (&c, '}')) {
        char key[32];
        if (!s_string (&c, key, sizeof key) || !s_eat (&c, ':'))
            return kiln_error (err, KILN_EFORMAT, "malformed header");
        if (strcmp (key, "descr") == 0 && !have_descr) {
            if (!s_string (&c, descr, sizeof descr))
                return kiln_error (err, KILN_EFORMAT, "bad 'descr'");
            have_descr = true;
        } else if (strcmp (key, "fortran_order") == 0 && !have_order) {
            if (s_word (&c, "True"))
                fortran = true;
            else if (!s_word (&c, "False"))
                return kiln_error (err, KILN_EFORMAT, "bad 'fortran_order'");
            have_order = true;
        } else if (strcmp (key, "shape") == 0 && !have_shape) {
            if (!s_shape (&c, &npy->shape))
                return kiln_error (err, KILN_EFORMAT, "bad 'shape' (at most %d "
                                   "dimensions of at most %lld)", KILN_MAX_RANK,
                                   (long long) KILN_MAX_DIM);
            have_shape = true;
        } else {
            return kiln_error (err, KILN_EFORMAT, "unexpected header key '%s'",
                               key);
        }
        if (!s_eat (&c, ',')) {
            if (!s_eat (&c, '}'))
                return kiln_error (err, KILN_EFORMAT, "malformed header");
            break;
        }
    }
    s_ws (&c);
    if (c.p != c.end)
        return kiln_error (err, KILN_EFORMAT, "trailing bytes after the header "
                           "dict");
    if (!have_descr || !have_order || !have_shape)
        return kiln_error (err, KILN_EFORMAT, "header lacks 'descr', "
                           "'fortran_order' or 'shape'");
    if (fortran)
        return kiln_error (err, KILN_EUNSUPPORTED, "Fortran-order arrays are not "
                           "supported");
    npy->dtype = kiln_dtype_from_npy_descr (descr);
    if (npy->dtype == KILN_DT_UNDEFINED)
        return kiln_error (err, KILN_EUNSUPPORTED, "dtype '%s' is not supported "
                           "(little-endian kiln dtypes only)", descr);
    return 0;
}

int
kiln_npy_parse (const uint8_t *buf, size_t len, kiln_npy_t *npy,
                kiln_err_t *err)
{
    kiln_npy_init (npy);
    if (len < 10 || memcmp (buf, s_magic, sizeof s_magic) != 0)
        return kiln_error (err, KILN_EFORMAT, "not a .npy file");
    uint8_t major = buf[6], minor = buf[7];
    size_t hlen, start;
    if (major == 1 && minor == 0) {
        hlen = (size_t) buf[8] | (size_t) buf[9] << 8;
        start = 10;
    } else if ((major == 2 || major == 3) && minor == 0) {
        if (len < 12)
            return kiln_error (err, KILN_EFORMAT, "truncated header");
        hlen = (size_t) buf[8] | (size_t) buf[9] << 8 | (size_t) buf[10] << 16
               | (size_t) buf[11] << 24;
        start = 12;
    } else {
        return kiln_error (err, KILN_EUNSUPPORTED, ".npy version %u.%u is not "
                           "supported", major, minor);
    }
    if (hlen > KILN_NPY_MAX_HEADER)
        return kiln_error (err, KILN_ELIMIT, "header of %zu bytes is larger than "
                           "%u", hlen, KILN_NPY_MAX_HEADER);
    if (hlen > len - start)
        return kiln_error (err, KILN_EFORMAT, "truncated header");
    kiln_npy_t tmp;
    kiln_npy_init (&tmp);
    int rc = s_parse_header ((const char *) buf + start, hlen, &tmp, err);
    if (rc)
        return rc;
    uint64_t bytes;
    if ((rc = kiln_shape_bytes (&tmp.shape, tmp.dtype, "array", &bytes, err)))
        return rc;
    size_t have = len - start - hlen;
    if (bytes != have)
        return kiln_error (err, KILN_EFORMAT, "the header's %s %s needs %llu "
                           "bytes of data, the file has %zu",
                           kiln_dtype_name (tmp.dtype),
                           kiln_shape_str (&tmp.shape, (char[160]) { 0 }, 160),
                           (unsigned long long) bytes, have);
    tmp.data = malloc (have ? have : 1);
    if (!tmp.data)
        return kiln_error (err, KILN_ENOMEM, "out of memory for %zu bytes", have);
    memcpy (tmp.data, buf + start + hlen, have);
    tmp.size = have;
    *npy = tmp;
    return 0;
}

int
kiln_npy_read (const char *path, kiln_npy_t *npy, kiln_err_t *err)
{
    kiln_npy_init (npy);
    uint8_t *buf;
    size_t len;
    int rc = kiln_read_file (path, KILN_NPY_MAX_BYTES, &buf, &len, err);
    if (rc)
        return rc;
    rc = kiln_npy_parse (buf, len, npy, err);
    free (buf);
    if (rc)
        return kiln_error_prefix (err, "'%s'", path);
    return 0;
}

/* --- writing -------------------------------------------------------- */

int
kiln_npy_encode (kiln_dtype_t dtype, const kiln_shape_t *shape,
                 const void *data, uint8_t **out, size_t *len, kiln_err_t *err)
{
    const char *descr = kiln_dtype_npy_descr (dtype);
    if (!descr)
        return kiln_error (err, KILN_EINVAL, "unknown dtype %d", (int) dtype);
    uint64_t bytes;
    int rc = kiln_shape_bytes (shape, dtype, "array", &bytes, err);
    if (rc)
        return rc;
    char dict[512];
    size_t n = (size_t) snprintf (dict, sizeof dict,
                                  "{'descr': '%s', 'fortran_order': False, "
                                  "'shape': (", descr);
    for (int i = 0; i < shape->rank; i++)
        n += (size_t) snprintf (dict + n, sizeof dict - n, "%lld,%s",
                                (long long) shape->dims[i],
                                i + 1 < shape->rank ? " " : "");
    if (shape->rank > 1)
        n--;    /* numpy writes "(2, 3)" but "(3,)" */
    n += (size_t) snprintf (dict + n, sizeof dict - n, "), }");
    /* Pad with spaces and a newline so the data starts 64-byte aligned. */
    size_t total_header = 10 + n + 1;
    size_t pad = (64 - total_header % 64) % 64;
    size_t hlen = n + pad + 1;
    if (bytes > SIZE_MAX - 10 - hlen)
        return kiln_error (err, KILN_ELIMIT, "array too large");
    size_t size = 10 + hlen + (size_t) bytes;
    uint8_t *buf = malloc (size);
    if (!buf)
        return kiln_error (err, KILN_ENOMEM, "out of memory for %zu bytes", size);
    memcpy (buf, s_magic, sizeof s_magic);
    buf[6] = 1;
    buf[7] = 0;
    buf[8] = (uint8_t) (hlen & 0xff);
    buf[9] = (uint8_t) (hlen >> 8);
    memcpy (buf + 10, dict, n);
    memset (buf + 10 + n, ' ', pad);
    buf[10 + n + pad] = '\n';
    if (bytes)
        memcpy (buf + 10 + hlen, data, (size_t) bytes);
    *out = buf;
    *len = size;
    return 0;
}

int
kiln_npy_write (const char *path, kiln_dtype_t dtype, const kiln_shape_t *shape,
                const void *data, kiln_err_t *err)
{
    uint8_t *buf;
    size_t len;
    int rc = kiln_npy_encode (dtype, shape, data, &buf, &len, err);
    if (rc)
        return rc;
    rc = kiln_write_file_atomic (path, buf, len, 0644, err);
    free (buf);
    return rc;
}
