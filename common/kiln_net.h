/*
 * kiln_net — the address an HTTP listener takes from the command line
 * (kiln-serve --listen, kiln-broker --metrics).
 */
#ifndef KILN_NET_H
#define KILN_NET_H

#include <stdarg.h>
#include <sys/socket.h>

#include "common/kiln_error.h"

/* "HOST:PORT", ":PORT" (every address) or "[V6]:PORT" to a socket address
 * to bind; port 0 lets the system pick one.  `what` names the option in
 * errors ("--listen"). */
int kiln_resolve_listen (const char *what, const char *listen, struct sockaddr_storage *addr,
                         socklen_t *addr_len, int *family, kiln_err_t *err);

/* An HTTP library's error logger (libmicrohttpd's
 * MHD_OPTION_EXTERNAL_LOGGER): one warning "PREFIX: message", trailing
 * line ends cut; `prefix` is a const char *. */
void kiln_net_log (void *prefix, const char *fmt, va_list ap)
    __attribute__ ((format (printf, 2, 0)));

#endif
