/*
 * kiln_error — the one error type of kiln's libraries.
 *
 * Every library function that can fail takes a `kiln_err_t *err` last and
 * either returns 0 / a valid pointer, or a negative KILN_E* code / NULL
 * with `err` filled in.  The message names the thing at fault (the node,
 * the tensor, the file, the member) so that it can be shown to a user as
 * it is.  Codes never change once published; they and their descriptions
 * come from one list so that kiln_strerror cannot drift from the enum.
 */
#ifndef KILN_ERROR_H
#define KILN_ERROR_H

#include <stddef.h>

#define KILN_ERRORS(X)                                             \
    X (OK,          0,  "success")                                 \
    X (EINVAL,      1,  "invalid argument")                        \
    X (ENOMEM,      2,  "out of memory")                           \
    X (EIO,         3,  "input/output error")                      \
    X (EFORMAT,     4,  "malformed input")                         \
    X (ELIMIT,      5,  "size limit exceeded")                     \
    X (EUNSUPPORTED,6,  "unsupported")                             \
    X (ESHAPE,      7,  "shape or dtype mismatch")                 \
    X (EVERIFY,     8,  "verification failed")                     \
    X (ECRYPTO,     9,  "cryptographic operation failed")          \
    X (EPROTO,      10, "protocol error")                          \
    X (ETIMEOUT,    11, "timed out")                               \
    X (ECOMPILE,    12, "compilation failed")                      \
    X (ENOTFOUND,   13, "not found")                               \
    X (EREMOTE,     14, "remote error")                            \
    X (ESYS,        15, "system call failed")                      \
    X (ECANCELED,   16, "canceled")                                \
    X (EUNREACHABLE,17, "the farm could not be reached")          \
    X (EBUSY,       18, "busy, try again later")

enum {
#define KILN_ERR_ENUM(name, num, text) KILN_##name = num,
    KILN_ERRORS (KILN_ERR_ENUM)
#undef KILN_ERR_ENUM
    KILN_ERR_MAX
};

#define KILN_ERR_MSG_MAX 1024

typedef struct kiln_err {
    int code;                       /* a KILN_E* code, 0 when no error */
    char msg[KILN_ERR_MSG_MAX];     /* human message, lower-case, no full stop */
} kiln_err_t;

/* Description of a code ("malformed input"); never NULL. */
const char *kiln_strerror (int code);

/* Name of a code ("EFORMAT"); never NULL. */
const char *kiln_errname (int code);

/* Fill `err` (which may be NULL) with `code` and a printf-style message.
 * Returns -code so that callers can write `return kiln_error (err, ...)`. */
int kiln_error (kiln_err_t *err, int code, const char *fmt, ...)
    __attribute__ ((format (printf, 3, 4)));

/* Put "prefix: " in front of the message already in `err`, keeping the
 * code.  Returns -err->code.  Used to add context on the way up. */
int kiln_error_prefix (kiln_err_t *err, const char *fmt, ...)
    __attribute__ ((format (printf, 2, 3)));

/* Reset `err` to no error. */
void kiln_err_clear (kiln_err_t *err);

#endif
