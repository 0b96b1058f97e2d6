/*
 * kiln_serve_http — kiln-serve's HTTP/REST front: the KServe v2 / Open
 * Inference Protocol endpoints, the repository extension and /metrics,
 * over libmicrohttpd.
 *
 * The routes are one table in kiln_serve_http.c (method, path pattern,
 * metric label, handler); docs/serving.md lists the same.  libmicrohttpd
 * runs a thread per connection (bounded by max_connections, idle ones
 * closed after timeout_s): an inference request's thread decodes the
 * body, queues the job with the model's batcher and waits for it, so
 * requests on different connections batch together while the HTTP
 * threads never run a model themselves.
 *
 * Bounds: a body over max_body is read to its end but not kept, and
 * answered 413; a malformed or mismatched request gets 400 with a v2
 * error body {"error": "..."}; an unknown model 404; a model without a
 * loaded version, or whose queue is full, 503.  Nothing a client sends
 * is an assertion or a crash.
 */
#ifndef KILN_SERVE_HTTP_H
#define KILN_SERVE_HTTP_H

#include <stddef.h>

#include "common/kiln_error.h"
#include "serve/kiln_serve_metrics.h"
#include "serve/kiln_serve_repo.h"

typedef struct kiln_serve_http_config {
    const char *listen;             /* "HOST:PORT" or "[V6]:PORT"; port 0 picks one */
    size_t max_body;                /* request body bytes, at most */
    int max_connections;            /* open connections (threads), at most */
    int timeout_s;                  /* an idle connection is closed after this */
} kiln_serve_http_config_t;

typedef struct kiln_serve_http kiln_serve_http_t;

/* The endpoints' metric labels, in route order, for kiln_serve_metrics_new;
 * static. */
const char *const *kiln_serve_http_endpoints (int *n);

/* Bind and start serving `repo`, counting into `metrics` (both borrowed,
 * and must outlive the server).  Caller owns it. */
kiln_serve_http_t *kiln_serve_http_new (const kiln_serve_http_config_t *cfg,
                                        kiln_serve_repo_t *repo,
                                        kiln_serve_metrics_t *metrics, kiln_err_t *err);
/* The port it listens on (the one picked, for port 0). */
int kiln_serve_http_port (const kiln_serve_http_t *self);
/* Stop accepting, let requests in progress finish, close; NULLs *self_p. */
void kiln_serve_http_destroy (kiln_serve_http_t **self_p);

#endif
