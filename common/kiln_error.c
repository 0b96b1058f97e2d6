#include "common/kiln_error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

const char *
kiln_strerror (int code)
{
    if (code < 0)
        code = -code;
    switch (code) {
#define KILN_ERR_TEXT(name, num, text) case num: return text;
        KILN_ERRORS (KILN_ERR_TEXT)
#undef KILN_ERR_TEXT
    }
    return "unknown error";
}

const char *
kiln_errname (int code)
{
    if (code < 0)
        code = -code;
    switch (code) {
#define KILN_ERR_NAME(name, num, text) case num: return #name;
        KILN_ERRORS (KILN_ERR_NAME)
#undef KILN_ERR_NAME
    }
    return "EUNKNOWN";
}

int
kiln_error (kiln_err_t *err, int code, const char *fmt, ...)
{
    if (code < 0)
        code = -code;
    if (err) {
        va_list ap;
        va_start (ap, fmt);
        vsnprintf (err->msg, sizeof err->msg, fmt, ap);
        va_end (ap);
        err->code = code;
    }
    return -code;
}

int
kiln_error_prefix (kiln_err_t *err, const char *fmt, ...)
{
    if (!err)
        return -KILN_EINVAL;
    char prefix[KILN_ERR_MSG_MAX];
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (prefix, sizeof prefix, fmt, ap);
    va_end (ap);
    char old[KILN_ERR_MSG_MAX];
    memcpy (old, err->msg, sizeof old);
    size_t n = strlen (prefix);
    if (n > sizeof err->msg - 3)
        n = sizeof err->msg - 3;
    memcpy (err->msg, prefix, n);
    memcpy (err->msg + n, ": ", 2);
    size_t rest = sizeof err->msg - n - 3;
    size_t m = strnlen (old, rest);
    memcpy (err->msg + n + 2, old, m);
    err->msg[n + 2 + m] = '\0';
    if (err->code == 0)
        err->code = KILN_EINVAL;
    return -err->code;
}

void
kiln_err_clear (kiln_err_t *err)
{
    if (err) {
        err->code = 0;
        err->msg[0] = '\0';
    }
}
