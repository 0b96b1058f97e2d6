#include "serve/kiln_serve_buf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void
kiln_serve_buf_init (kiln_serve_buf_t *self, size_t max, const char *what)
{
    memset (self, 0, sizeof *self);
    self->max = max;
    self->what = what ? what : "the text";
}

void
kiln_serve_buf_release (kiln_serve_buf_t *self)
{
    free (self->data);
    self->data = NULL;
    self->len = self->cap = 0;
}

int
kiln_serve_buf_reserve (kiln_serve_buf_t *self, size_t extra)
{
    if (self->err.code)
        return -self->err.code;
    if (extra > self->max || self->len > self->max - extra)
        return kiln_error (&self->err, KILN_ELIMIT, "%s would pass %zu bytes",
                           self->what, self->max);
    size_t need = self->len + extra + 1;
    if (need <= self->cap)
        return 0;
    size_t cap = self->cap ? self->cap : 4096;
    while (cap < need)
        cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    if (cap > self->max + 1)
        cap = self->max + 1;
    char *p = realloc (self->data, cap);
    if (!p)
        return kiln_error (&self->err, KILN_ENOMEM, "out of memory writing %s (%zu "
                           "bytes)", self->what, cap);
    self->data = p;
    self->cap = cap;
    return 0;
}

int
kiln_serve_buf_add (kiln_serve_buf_t *self, const void *data, size_t len)
{
    int rc = kiln_serve_buf_reserve (self, len);
    if (rc)
        return rc;
    if (len)
        memcpy (self->data + self->len, data, len);
    self->len += len;
    self->data[self->len] = '\0';
    return 0;
}

int
kiln_serve_buf_str (kiln_serve_buf_t *self, const char *text)
{
    return kiln_serve_buf_add (self, text, strlen (text));
}

int
kiln_serve_buf_printf (kiln_serve_buf_t *self, const char *fmt, ...)
{
    char small[256];
    va_list ap;
    va_start (ap, fmt);
    int n = vsnprintf (small, sizeof small, fmt, ap);
    va_end (ap);
    if (n < 0)
        return kiln_error (&self->err, KILN_EINVAL, "cannot format %s", self->what);
    if ((size_t) n < sizeof small)
        return kiln_serve_buf_add (self, small, (size_t) n);
    int rc = kiln_serve_buf_reserve (self, (size_t) n);
    if (rc)
        return rc;
    va_start (ap, fmt);
    vsnprintf (self->data + self->len, (size_t) n + 1, fmt, ap);
    va_end (ap);
    self->len += (size_t) n;
    return 0;
}

int
kiln_serve_buf_json_str (kiln_serve_buf_t *self, const char *text)
{
    kiln_serve_buf_add (self, "\"", 1);
    const char *run = text;
    for (const char *p = text; *p; p++) {
        unsigned char c = (unsigned char) *p;
        if (c != '"' && c != '\\' && c >= 0x20)
            continue;
        kiln_serve_buf_add (self, run, (size_t) (p - run));
        if (c == '"' || c == '\\') {
            char esc[2] = { '\\', (char) c };
            kiln_serve_buf_add (self, esc, 2);
        }
        else
            kiln_serve_buf_printf (self, "\\u%04x", c);
        run = p + 1;
    }
    kiln_serve_buf_str (self, run);
    return kiln_serve_buf_add (self, "\"", 1);
}

int
kiln_serve_buf_check (const kiln_serve_buf_t *self, kiln_err_t *err)
{
    if (!self->err.code)
        return 0;
    if (err)
        *err = self->err;
    return -self->err.code;
}

char *
kiln_serve_buf_take (kiln_serve_buf_t *self, size_t *len)
{
    if (self->err.code)
        return NULL;
    if (!self->data && kiln_serve_buf_reserve (self, 0))
        return NULL;
    char *out = self->data;
    if (len)
        *len = self->len;
    self->data = NULL;
    self->len = self->cap = 0;
    return out;
}
