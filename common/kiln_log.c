#include "common/kiln_log.h"

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
    fprintf (stderr, "%s\n", line);
}
