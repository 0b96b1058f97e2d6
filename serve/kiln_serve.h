/*
 * kiln_serve — the kiln-serve daemon: the runtime, the metrics, the model
 * repository and the HTTP server put together, and its signals.
 *
 * Start-up: the keyrings and the repository directory are checked (a
 * missing one is an error before anything listens), the HTTP server
 * binds (live from then on), the repository is scanned (ready once every
 * model found has a version).  SIGHUP rescans the repository; SIGTERM
 * and SIGINT stop accepting connections, let the requests in progress
 * finish and unload everything.  Signals are taken by sigwait in the
 * calling thread, never in a handler: every thread is started with them
 * blocked.
 */
#ifndef KILN_SERVE_H
#define KILN_SERVE_H

#include "common/kiln_error.h"
#include "serve/kiln_serve_http.h"
#include "serve/kiln_serve_repo.h"

typedef struct kiln_serve_config {
    kiln_serve_repo_config_t repo;  /* target NULL: this host's */
    kiln_serve_http_config_t http;
} kiln_serve_config_t;

/* The target this host runs, "cpu-" and the machine (uname), as the
 * builtin compiler names the artifacts it builds for it. */
const char *kiln_serve_host_target (void);

/* Run until SIGTERM or SIGINT; 0 after a clean stop, or the error that
 * kept the server from starting.  Call it from the process's first
 * thread before any other thread exists (it blocks the signals that the
 * threads it starts inherit). */
int kiln_serve_run (const kiln_serve_config_t *cfg, kiln_err_t *err);

#endif
