/*
 * kiln_serve_buf — a growable byte buffer with a ceiling, for the text
 * kiln-serve writes (v2 JSON responses, the /metrics page).
 *
 * Every append either fits under the buffer's maximum or fails with
 * KILN_ELIMIT naming what was being written; once an append has failed
 * the buffer stays failed (later appends do nothing and report the first
 * error), so a writer may append a run of pieces and check once.  The
 * data is always NUL-terminated one byte past `len`.
 */
#ifndef KILN_SERVE_BUF_H
#define KILN_SERVE_BUF_H

#include <stddef.h>
#include <stdint.h>

#include "common/kiln_error.h"

typedef struct kiln_serve_buf {
    char *data;                     /* NUL-terminated one past len */
    size_t len;                     /* bytes written */
    size_t cap;                     /* bytes allocated, NUL included */
    size_t max;                     /* the ceiling on len */
    const char *what;               /* names the text in errors */
    kiln_err_t err;                 /* the first failure, code 0 when none */
} kiln_serve_buf_t;

/* Start an empty buffer of at most `max` bytes; `what` (a literal) names
 * it in errors ("the metrics page"). */
void kiln_serve_buf_init (kiln_serve_buf_t *self, size_t max, const char *what);
/* Free the data and zero the buffer. */
void kiln_serve_buf_release (kiln_serve_buf_t *self);

/* Make room for `extra` more bytes at once (one allocation for a known
 * size); fails like an append. */
int kiln_serve_buf_reserve (kiln_serve_buf_t *self, size_t extra);
int kiln_serve_buf_add (kiln_serve_buf_t *self, const void *data, size_t len);
int kiln_serve_buf_str (kiln_serve_buf_t *self, const char *text);
int kiln_serve_buf_printf (kiln_serve_buf_t *self, const char *fmt, ...)
    __attribute__ ((format (printf, 2, 3)));
/* A JSON string literal: quotes, and escapes for '"', '\\' and control
 * characters (bytes >= 0x80 are copied: the text is UTF-8 or the
 * caller's problem). */
int kiln_serve_buf_json_str (kiln_serve_buf_t *self, const char *text);

/* 0, or the first failure's code (negative) with its message in `err`. */
int kiln_serve_buf_check (const kiln_serve_buf_t *self, kiln_err_t *err);

/* Hand the data to the caller, who owns it (free()); the buffer is left
 * empty.  NULL when an append failed (see kiln_serve_buf_check). */
char *kiln_serve_buf_take (kiln_serve_buf_t *self, size_t *len);

#endif
