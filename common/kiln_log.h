/*
 * kiln_log — one logging macro with syslog levels.
 *
 * Log an error once, where it is detected; a line about a job carries its
 * job id or action key in the message.  Lines go to stderr as
 * "2026-11-20T10:00:00Z kiln-broker[123] err: message".
 */
#ifndef KILN_LOG_H
#define KILN_LOG_H

#include <syslog.h>

/* Set the program name printed in each line (not copied: pass a literal
 * or argv[0]) and the most verbose level printed (LOG_DEBUG..LOG_ERR).
 * KILN_LOG_LEVEL in the environment (err, warning, notice, info, debug)
 * overrides `level`. */
void kiln_log_init (const char *program, int level);

void kiln_log_write (int level, const char *fmt, ...)
    __attribute__ ((format (printf, 2, 3)));

#define KILN_LOG(level, ...) kiln_log_write ((level), __VA_ARGS__)
#define kiln_log_err(...)    KILN_LOG (LOG_ERR, __VA_ARGS__)
#define kiln_log_warn(...)   KILN_LOG (LOG_WARNING, __VA_ARGS__)
#define kiln_log_notice(...) KILN_LOG (LOG_NOTICE, __VA_ARGS__)
#define kiln_log_info(...)   KILN_LOG (LOG_INFO, __VA_ARGS__)
#define kiln_log_debug(...)  KILN_LOG (LOG_DEBUG, __VA_ARGS__)

#endif
