/*
 * kiln_log — one logging macro with syslog levels.
 *
 * Log an error once, where it is detected; a line about a job carries its
 * job id or action key in the message.  Lines go to stderr as
 * "2026-11-20T10:00:00Z kiln-broker[123] err: message".
 */
#ifndef KILN_LOG_H
#define KILN_LOG_H

#include <stddef.h>
#include <stdio.h>
#include <syslog.h>

/* Set the program name printed in each line (not copied: pass a literal
 * or argv[0]) and the most verbose level printed (LOG_DEBUG..LOG_ERR).
 * KILN_LOG_LEVEL in the environment (err, warning, notice, info, debug)
 * overrides `level`. */
void kiln_log_init (const char *program, int level);

void kiln_log_write (int level, const char *fmt, ...)
    __attribute__ ((format (printf, 2, 3)));

/* Text that came from someone else (a node name in a model, a compile
 * log from a worker, a broker's error message) may hold terminal escape
 * sequences: printed raw, they can retitle, recolour or rewrite what the
 * reader's terminal shows.  kiln_text_escape copies `s` into `out`
 * (`size` bytes, always NUL-terminated) with every control character
 * (C0 but '\n' and '\t', DEL, C1 whether raw or UTF-8 encoded) and every
 * byte that is not part of valid UTF-8 written as "\xNN", so a line shows
 * what was sent and nothing acts on it.  Returns `out`. */
char *kiln_text_escape (const char *s, char *out, size_t size);

/* Write `s` to `f` escaped as kiln_text_escape does (any length). */
void kiln_fputs_escaped (const char *s, FILE *f);

/* Print "PREFIX: MESSAGE\n" to stderr, the message escaped: how a program
 * reports an error whose text may quote someone else's. */
void kiln_print_error (const char *prefix, const char *msg);

/* Every log line is escaped so (kiln_log_write). */
#define KILN_LOG(level, ...) kiln_log_write ((level), __VA_ARGS__)
#define kiln_log_err(...)    KILN_LOG (LOG_ERR, __VA_ARGS__)
#define kiln_log_warn(...)   KILN_LOG (LOG_WARNING, __VA_ARGS__)
#define kiln_log_notice(...) KILN_LOG (LOG_NOTICE, __VA_ARGS__)
#define kiln_log_info(...)   KILN_LOG (LOG_INFO, __VA_ARGS__)
#define kiln_log_debug(...)  KILN_LOG (LOG_DEBUG, __VA_ARGS__)

#endif
