#include "common/kiln_log.h"

#include <stdbool.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char *s_program = "kiln";
static int s_level = LOG_NOTICE;

static int
s_level_from_name (const char *name, int fallback)
{
    static const struct { const char *name; int level; } table[] = {
        { "err", LOG_ERR }, { "error", LOG_ERR }, { "warning", LOG_WARNING },
        { "warn", LOG_WARNING }, { "notice", LOG_NOTICE }, { "info", LOG_INFO },
        { "debug", LOG_DEBUG },
    };
    for (size_t i = 0; name && i < sizeof table / sizeof table[0]; i++)
        if (strcmp (name, table[i].name) == 0)
            return table[i].level;
    return fallback;
}

void
kiln_log_init (const char *program, int level)
{
    if (program) {
        const char *slash = strrchr (program, '/');
        s_program = slash ? slash + 1 : program;
    }
    s_level = s_level_from_name (getenv ("KILN_LOG_LEVEL"), level);
}

/* Bytes of the valid UTF-8 sequence at p (1..4), or 0 when there is
 * none; C1 controls (U+0080..U+009F) count as none. */
static size_t
s_utf8_len (const unsigned char *p)
{
    unsigned c = p[0];
    size_t n = c >= 0xf0 && c <= 0xf4 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c < 0xe0 ? 2 : 0;
    if (c >= 0xf5)
        n = 0;
    for (size_t i = 1; i < n; i++)
        if ((p[i] & 0xc0) != 0x80)
            return 0;
    if (n == 2 && c == 0xc2 && p[1] < 0xa0)
        return 0;                                /* C1: U+0080..U+009F */
    if (n == 3 && ((c == 0xe0 && p[1] < 0xa0) || (c == 0xed && p[1] >= 0xa0)))
        return 0;                                /* overlong; surrogates */
    if (n == 4 && ((c == 0xf0 && p[1] < 0x90) || (c == 0xf4 && p[1] >= 0x90)))
        return 0;                                /* overlong; past U+10FFFF */
    return n;
}

char *
kiln_text_escape (const char *s, char *out, size_t size)
{
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    if (size == 0)
        return out;
    for (const unsigned char *p = (const unsigned char *) s; *p;) {
        size_t n = *p < 0x80 ? 1 : s_utf8_len (p);
        bool plain = n > 1 || (*p >= 0x20 && *p < 0x7f) || *p == '\n' || *p == '\t';
        size_t need = plain ? (n ? n : 1) : 4;
        if (o + need >= size)
            break;
        if (plain) {
            memcpy (out + o, p, need);
            o += need;
            p += need;
            continue;
        }
        out[o++] = '\\';
        out[o++] = 'x';
        out[o++] = hex[*p >> 4];
        out[o++] = hex[*p & 15];
        p++;
    }
    out[o] = '\0';
    return out;
}

void
kiln_fputs_escaped (const char *s, FILE *f)
{
    char buf[4096 + 8];
    size_t len = strlen (s);
    //  Escaped in pieces that end on a character boundary.
    while (*s) {
        size_t take = len < 1024 ? len : 1024;
        while (take < len && ((unsigned char) s[take] & 0xc0) == 0x80 && take > 1020)
            take--;
        char piece[1024 + 1];
        memcpy (piece, s, take);
        piece[take] = '\0';
        fputs (kiln_text_escape (piece, buf, sizeof buf), f);
        s += take;
        len -= take;
    }
}

void
kiln_print_error (const char *prefix, const char *msg)
{
    fprintf (stderr, "%s: ", prefix);
    kiln_fputs_escaped (msg, stderr);
    fputc ('\n', stderr);
}

void
kiln_log_write (int level, const char *fmt, ...)
{
    static const char *names[] = { "emerg", "alert", "crit", "err",
                                   "warning", "notice", "info", "debug" };
    if (level > s_level)
        return;
    char stamp[32];
    time_t now = time (NULL);
    struct tm tm;
    gmtime_r (&now, &tm);
    strftime (stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &tm);
    char line[4096];
    int n = snprintf (line, sizeof line, "%s %s[%d] %s: ", stamp, s_program,
                      (int) getpid (), names[level & 7]);
    va_list ap;
    va_start (ap, fmt);
    if (n > 0 && (size_t) n < sizeof line)
        vsnprintf (line + n, sizeof line - n, fmt, ap);
    va_end (ap);
    char safe[4 * sizeof line];
    fprintf (stderr, "%s\n", kiln_text_escape (line, safe, sizeof safe));
}
