/*
 * kiln_net — the address an HTTP listener takes from the command line.
 */
#include "common/kiln_net.h"

#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kiln_log.h"

int
kiln_resolve_listen (const char *what, const char *listen, struct sockaddr_storage *addr,
                     socklen_t *addr_len, int *family, kiln_err_t *err)
{
    char host[256];
    const char *port;
    if (listen[0] == '[') {
        const char *end = strchr (listen, ']');
        if (!end || end[1] != ':' || (size_t) (end - listen - 1) >= sizeof host)
            return kiln_error (err, KILN_EINVAL, "%s '%s' is not [ADDRESS]:PORT", what, listen);
        memcpy (host, listen + 1, (size_t) (end - listen - 1));
        host[end - listen - 1] = '\0';
        port = end + 2;
    }
    else {
        const char *colon = strrchr (listen, ':');
        if (!colon || (size_t) (colon - listen) >= sizeof host)
            return kiln_error (err, KILN_EINVAL, "%s '%s' is not HOST:PORT", what, listen);
        memcpy (host, listen, (size_t) (colon - listen));
        host[colon - listen] = '\0';
        port = colon + 1;
    }
    size_t digits = strspn (port, "0123456789");
    if (digits == 0 || digits > 5 || port[digits] || strtol (port, NULL, 10) > 65535)
        return kiln_error (err, KILN_EINVAL, "%s '%s': '%s' is not a port", what, listen, port);
    struct addrinfo hints = { .ai_socktype = SOCK_STREAM,
                              .ai_flags = AI_NUMERICSERV | AI_PASSIVE };
    struct addrinfo *res = NULL;
    int rc = getaddrinfo (host[0] ? host : NULL, port, &hints, &res);
    if (rc != 0 || !res)
        return kiln_error (err, KILN_EINVAL, "%s '%s': %s", what, listen, gai_strerror (rc));
    memcpy (addr, res->ai_addr, res->ai_addrlen);
    *addr_len = res->ai_addrlen;
    *family = res->ai_family;
    freeaddrinfo (res);
    return 0;
}


void
kiln_net_log (void *prefix, const char *fmt, va_list ap)
{
    char line[512];
    vsnprintf (line, sizeof line, fmt, ap);
    size_t n = strlen (line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r'))
        line[--n] = '\0';
    kiln_log_warn ("%s: %s", (const char *) prefix, line);
}
