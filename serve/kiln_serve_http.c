#include "serve/kiln_serve_http.h"

#include <microhttpd.h>
#include <netdb.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "common/kiln_log.h"
#include "common/kiln_net.h"
#include "serve/kiln_serve_v2.h"

#define S_MAX_SEGMENTS 8            /* path segments a route may have */
#define S_JSON "application/json"
#define S_HEADER_LEN "Inference-Header-Content-Length"

struct kiln_serve_http {
    kiln_serve_http_config_t cfg;
    kiln_serve_repo_t *repo;        /* borrowed */
    kiln_serve_metrics_t *metrics;  /* borrowed */
    struct MHD_Daemon *daemon;
    int port;
};

/* One request, from its first header to its response. */
typedef struct {
    uint64_t start_ns;              /* arrival, CLOCK_MONOTONIC */
    uint8_t *body;                  /* what was received, when within max_body */
    size_t len, cap;
    size_t expect;                  /* Content-Length, 0 when not given */
    bool too_large;                 /* past max_body: the rest is discarded */
    const char *model;              /* {model} of the route, into `path` */
    const char *version;            /* {version}, or NULL */
    char path[1024];                /* the URL, split into segments */
    struct MHD_Connection *conn;
} s_req_t;

/* What a handler answers. */
typedef struct {
    int status;
    char *body;                     /* malloc'd, sent and freed by the server */
    size_t len;
    const char *type;               /* Content-Type */
    long long header_len;           /* Inference-Header-Content-Length, or -1 */
    const char *allow;              /* Allow, for 405 */
} s_reply_t;

typedef void (s_handler_t) (kiln_serve_http_t *self, s_req_t *req, s_reply_t *rep);

static s_handler_t s_live, s_ready, s_server, s_model, s_model_ready, s_infer, s_index,
    s_load, s_unload, s_metrics;

/* The routes: method, path ({model} and {version} match one segment),
 * metric label, handler. */
#define S_ROUTES(X)                                                                        \
    X ("GET",  "/v2/health/live",                              "health_live",  s_live)        \
    X ("GET",  "/v2/health/ready",                             "health_ready", s_ready)       \
    X ("GET",  "/v2",                                          "server_metadata", s_server)   \
    X ("GET",  "/v2/models/{model}",                           "model_metadata", s_model)     \
    X ("GET",  "/v2/models/{model}/versions/{version}",        "model_metadata", s_model)     \
    X ("GET",  "/v2/models/{model}/ready",                     "model_ready",  s_model_ready) \
    X ("GET",  "/v2/models/{model}/versions/{version}/ready",  "model_ready",  s_model_ready) \
    X ("POST", "/v2/models/{model}/infer",                     "infer",        s_infer)       \
    X ("POST", "/v2/models/{model}/versions/{version}/infer",  "infer",        s_infer)       \
    X ("POST", "/v2/repository/index",                         "repository_index", s_index)   \
    X ("POST", "/v2/repository/models/{model}/load",           "repository_load", s_load)     \
    X ("POST", "/v2/repository/models/{model}/unload",         "repository_unload", s_unload) \
    X ("GET",  "/metrics",                                     "metrics",      s_metrics)

typedef struct {
    const char *method, *pattern, *label;
    s_handler_t *handler;
} s_route_t;

static const s_route_t s_routes[] = {
#define S_ROUTE(method, pattern, label, handler) { method, pattern, label, handler },
    S_ROUTES (S_ROUTE)
#undef S_ROUTE
};
#define S_N_ROUTES ((int) (sizeof s_routes / sizeof s_routes[0]))

static const char *s_labels[] = {
#define S_LABEL(method, pattern, label, handler) label,
    S_ROUTES (S_LABEL)
#undef S_LABEL
};

const char *const *
kiln_serve_http_endpoints (int *n)
{
    *n = S_N_ROUTES;
    return s_labels;
}

/* --- replies ---------------------------------------------------------- */

static void
s_reply_json (s_reply_t *rep, int status, char *body, size_t len)
{
    rep->status = status;
    rep->body = body;
    rep->len = len;
    rep->type = S_JSON;
}

static void
s_reply_error (s_reply_t *rep, int status, const char *msg)
{
    size_t len = 0;
    char *body = kiln_serve_v2_error (msg, &len);
    s_reply_json (rep, status, body, body ? len : 0);
}

static void
s_reply_text (s_reply_t *rep, int status, const char *text)
{
    char *body = strdup (text);
    s_reply_json (rep, status, body, body ? strlen (body) : 0);
}

/* --- routing ---------------------------------------------------------- */

static int
s_split (char *path, char **segs)
{
    int n = 0;
    for (char *p = path; *p;) {
        while (*p == '/')
            *p++ = '\0';
        if (!*p)
            break;
        if (n == S_MAX_SEGMENTS)
            return -1;
        segs[n++] = p;
        while (*p && *p != '/')
            p++;
    }
    return n;
}

/* Does `pattern` match the segments?  Fills model and version. */
static bool
s_match (const char *pattern, char **segs, int n, const char **model, const char **version)
{
    char pat[256], *psegs[S_MAX_SEGMENTS];
    snprintf (pat, sizeof pat, "%s", pattern);
    int pn = s_split (pat, psegs);
    if (pn != n)
        return false;
    const char *m = NULL, *v = NULL;
    for (int i = 0; i < n; i++) {
        if (strcmp (psegs[i], "{model}") == 0)
            m = segs[i];
        else if (strcmp (psegs[i], "{version}") == 0)
            v = segs[i];
        else if (strcmp (psegs[i], segs[i]) != 0)
            return false;
    }
    *model = m;
    *version = v;
    return true;
}

/* A whole decimal number 0..max, nothing else; -1 otherwise. */
static long long
s_decimal (const char *text, long long max)
{
    long long v = 0;
    if (!text || !*text)
        return -1;
    for (const char *p = text; *p; p++) {
        if (*p < '0' || *p > '9' || v > (max - (*p - '0')) / 10)
            return -1;
        v = v * 10 + (*p - '0');
    }
    return v;
}

/* --- the handlers ----------------------------------------------------- */

static void
s_live (kiln_serve_http_t *self, s_req_t *req, s_reply_t *rep)
{
    s_reply_text (rep, 200, "{\"live\":true}");
}

/* v2: a 200 status means ready, a 4xx status not. */
static void
s_ready (kiln_serve_http_t *self, s_req_t *req, s_reply_t *rep)
{
    bool ready = kiln_serve_repo_ready (self->repo);
    s_reply_text (rep, ready ? 200 : 400, ready ? "{\"ready\":true}" : "{\"ready\":false}");
}

static void
s_server (kiln_serve_http_t *self, s_req_t *req, s_reply_t *rep)
{
    char *body;
    size_t len;
    kiln_err_t err = { 0 };
    if (kiln_serve_v2_server_metadata (&body, &len, &err) != 0)
        s_reply_error (rep, 500, err.msg);
    else
        s_reply_json (rep, 200, body, len);
}

/* The status of {model}, checked against {version} when the URL has
 * one; false with the reply set when there is no such model or version. */
static bool
s_status (kiln_serve_http_t *self, s_req_t *req, s_reply_t *rep, kiln_serve_model_status_t *st)
{
    kiln_err_t err = { 0 };
    if (kiln_serve_repo_status (self->repo, req->model, st, &err) != 0) {
        s_reply_error (rep, 404, err.msg);
        return false;
    }
    char seq[32];
    snprintf (seq, sizeof seq, "%llu", (unsigned long long) st->record.seq);
    if (req->version && (!st->version || strcmp (req->version, seq) != 0)) {
        char msg[256];
        snprintf (msg, sizeof msg, "model '%s' has no version '%.32s'%s%s", st->name,
                  req->version, st->version ? ": it serves version " : "",
                  st->version ? seq : "");
        s_reply_error (rep, 404, msg);
        kiln_serve_model_status_release (st);
        return false;
    }
    return true;
}

static void
s_model (kiln_serve_http_t *self, s_req_t *req, s_reply_t *rep)
{
    kiln_serve_model_status_t st;
    if (!s_status (self, req, rep, &st))
        return;
    char *body;
    size_t len;
    kiln_err_t err = { 0 };
    if (kiln_serve_v2_model_metadata (&st, &body, &len, &err) != 0)
        s_reply_error (rep, 500, err.msg);
    else
        s_reply_json (rep, 200, body, len);
    kiln_serve_model_status_release (&st);
}

static void
s_model_ready (kiln_serve_http_t *self, s_req_t *req, s_reply_t *rep)
{
    kiln_serve_model_status_t st;
    if (!s_status (self, req, rep, &st))
        return;
    bool ready = st.version != NULL;
    s_reply_text (rep, ready ? 200 : 400, ready ? "{\"ready\":true}" : "{\"ready\":false}");
    kiln_serve_model_status_release (&st);
}

/* A failed inference for a known model: counted, answered. */
static void
s_infer_fail (s_reply_t *rep, kiln_serve_model_metrics_t *mm, kiln_serve_failure_t why,
              const char *msg)
{
    kiln_serve_metrics_failure (mm, why);
    s_reply_error (rep, kiln_serve_failure_status (why), msg);
}

/* The JSON header's length under the binary tensor extension, or the
 * whole body; -1 when the header is not a number within the body. */
static long long
s_json_len (s_req_t *req)
{
    const char *h = MHD_lookup_connection_value (req->conn, MHD_HEADER_KIND, S_HEADER_LEN);
    if (!h)
        return (long long) req->len;
    long long n = s_decimal (h, (long long) req->len);
    return n >= 1 ? n : -1;
}

static void
s_infer (kiln_serve_http_t *self, s_req_t *req, s_reply_t *rep)
{
    kiln_err_t err = { 0 };
    kiln_serve_version_t *v = kiln_serve_repo_get (self->repo, req->model, &err);
    if (!v) {
        if (err.code == KILN_ENOTFOUND)
            s_reply_error (rep, 404, err.msg);
        else
            s_infer_fail (rep, kiln_serve_metrics_model (self->metrics, req->model),
                          KILN_SERVE_FAILED_UNAVAILABLE, err.msg);
        return;
    }
    kiln_serve_model_metrics_t *mm = kiln_serve_version_metrics (v);
    const kiln_serve_iface_t *iface = kiln_serve_version_iface (v);
    uint64_t seq = kiln_serve_version_seq (v);
    kiln_serve_v2_request_t vr = { 0 };
    char msg[KILN_ERR_MSG_MAX + 128];
    kiln_serve_metrics_request (mm);
    char seq_text[32];
    snprintf (seq_text, sizeof seq_text, "%llu", (unsigned long long) seq);
    long long json_len = s_json_len (req);
    if (req->too_large) {
        snprintf (msg, sizeof msg, "the request body is larger than %zu bytes (--max-body)",
                  self->cfg.max_body);
        s_infer_fail (rep, mm, KILN_SERVE_FAILED_TOO_LARGE, msg);
    }
    else if (req->version && strcmp (req->version, seq_text) != 0) {
        snprintf (msg, sizeof msg, "model '%s' has no version '%.32s': it serves version %s",
                  req->model, req->version, seq_text);
        s_reply_error (rep, 404, msg);
    }
    else if (json_len < 0) {
        snprintf (msg, sizeof msg, "%s must be the length of the JSON part of the %zu-byte "
                  "body", S_HEADER_LEN, req->len);
        s_infer_fail (rep, mm, KILN_SERVE_FAILED_BAD_REQUEST, msg);
    }
    else if (kiln_serve_v2_decode_infer (iface, req->body, req->len, (size_t) json_len, &vr,
                                         &err) != 0) {
        snprintf (msg, sizeof msg, "model '%s': %s", req->model, err.msg);
        s_infer_fail (rep, mm, KILN_SERVE_FAILED_BAD_REQUEST, msg);
    }
    else if (kiln_serve_batch_submit (kiln_serve_version_batch (v), vr.job, &err) != 0)
        s_infer_fail (rep, mm, err.code == KILN_ELIMIT ? KILN_SERVE_FAILED_OVERLOADED
                                                       : KILN_SERVE_FAILED_UNAVAILABLE,
                      err.msg);
    else {
        kiln_serve_batch_wait (vr.job);
        uint8_t *body;
        size_t len, hlen;
        if (vr.job->rc) {
            snprintf (msg, sizeof msg, "model '%s': %s", req->model, vr.job->err.msg);
            s_infer_fail (rep, mm, KILN_SERVE_FAILED_ERROR, msg);
        }
        else if (kiln_serve_v2_encode_infer (iface, &vr, req->model, seq, &body, &len, &hlen,
                                             &err) != 0)
            s_infer_fail (rep, mm, KILN_SERVE_FAILED_ERROR, err.msg);
        else {
            s_reply_json (rep, 200, (char *) body, len);
            if (hlen != len) {
                rep->type = "application/octet-stream";
                rep->header_len = (long long) hlen;
            }
            kiln_serve_metrics_latency (mm, kiln_serve_now_ns () - req->start_ns);
        }
    }
    kiln_serve_v2_request_release (&vr);
    kiln_serve_version_put (&v);
}

static void
s_index (kiln_serve_http_t *self, s_req_t *req, s_reply_t *rep)
{
    char *body;
    size_t len;
    kiln_err_t err = { 0 };
    if (kiln_serve_v2_repository_index (self->repo, &body, &len, &err) != 0)
        s_reply_error (rep, 500, err.msg);
    else
        s_reply_json (rep, 200, body, len);
}

static void
s_load (kiln_serve_http_t *self, s_req_t *req, s_reply_t *rep)
{
    kiln_err_t err = { 0 };
    kiln_serve_refusal_t why = KILN_SERVE_REFUSAL_COUNT;    /* set by a refusal */
    int rc = kiln_serve_repo_load (self->repo, req->model, &why, &err);
    if (rc == 0)
        s_reply_text (rep, 200, "{}");
    else if (why == KILN_SERVE_REFUSAL_COUNT)
        s_reply_error (rep, err.code == KILN_ENOTFOUND ? 404 : 500, err.msg);
    else {
        char msg[KILN_ERR_MSG_MAX + 128];
        snprintf (msg, sizeof msg, "the release of model '%s' was refused (%s): %s",
                  req->model, kiln_serve_refusal_label (why), err.msg);
        s_reply_error (rep, 400, msg);
    }
}

static void
s_unload (kiln_serve_http_t *self, s_req_t *req, s_reply_t *rep)
{
    kiln_err_t err = { 0 };
    if (kiln_serve_repo_unload (self->repo, req->model, &err) != 0)
        s_reply_error (rep, 404, err.msg);
    else
        s_reply_text (rep, 200, "{}");
}

static void
s_metrics (kiln_serve_http_t *self, s_req_t *req, s_reply_t *rep)
{
    char *body;
    size_t len;
    kiln_err_t err = { 0 };
    if (kiln_serve_metrics_render (self->metrics, &body, &len, &err) != 0)
        s_reply_error (rep, 500, err.msg);
    else {
        s_reply_json (rep, 200, body, len);
        rep->type = "text/plain; version=0.0.4; charset=utf-8";
    }
}

/* --- libmicrohttpd ---------------------------------------------------- */

static enum MHD_Result
s_send (kiln_serve_http_t *self, s_req_t *req, int endpoint, s_reply_t *rep)
{
    if (!rep->body) {
        /* Out of memory: an empty 500 needs no allocation of ours. */
        rep->status = 500;
        rep->len = 0;
    }
    struct MHD_Response *resp = MHD_create_response_from_buffer (rep->len, rep->body,
                                                                 MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free (rep->body);
        return MHD_NO;
    }
    if (rep->type)
        MHD_add_response_header (resp, MHD_HTTP_HEADER_CONTENT_TYPE, rep->type);
    if (rep->allow)
        MHD_add_response_header (resp, MHD_HTTP_HEADER_ALLOW, rep->allow);
    if (rep->status == 503)             /* overloaded or not loaded: try again */
        MHD_add_response_header (resp, MHD_HTTP_HEADER_RETRY_AFTER, "1");
    if (rep->header_len >= 0) {
        char n[32];
        snprintf (n, sizeof n, "%lld", rep->header_len);
        MHD_add_response_header (resp, S_HEADER_LEN, n);
    }
    enum MHD_Result r = MHD_queue_response (req->conn, (unsigned) rep->status, resp);
    MHD_destroy_response (resp);
    kiln_serve_metrics_http (self->metrics, endpoint, rep->status);
    return r;
}

static enum MHD_Result
s_dispatch (kiln_serve_http_t *self, s_req_t *req, const char *url, const char *method)
{
    s_reply_t rep = { .header_len = -1 };
    snprintf (req->path, sizeof req->path, "%s", url);
    char *segs[S_MAX_SEGMENTS];
    int n = strlen (url) < sizeof req->path ? s_split (req->path, segs) : -1;
    int endpoint = -1;
    char allow[64] = "";
    for (int r = 0; n >= 0 && r < S_N_ROUTES && endpoint < 0; r++) {
        const char *model, *version;
        if (!s_match (s_routes[r].pattern, segs, n, &model, &version))
            continue;
        if (strcmp (s_routes[r].method, method) != 0) {
            snprintf (allow, sizeof allow, "%s", s_routes[r].method);
            continue;
        }
        endpoint = r;
        req->model = model;
        req->version = version;
    }
    if (endpoint < 0 && allow[0]) {
        char msg[128];
        snprintf (msg, sizeof msg, "method %.16s is not allowed here (allowed: %s)", method,
                  allow);
        s_reply_error (&rep, 405, msg);
        rep.allow = allow;
    }
    else if (endpoint < 0) {
        char msg[128];
        snprintf (msg, sizeof msg, "no endpoint %.64s %.48s", method, url);
        s_reply_error (&rep, 404, msg);
    }
    else if (req->too_large && s_routes[endpoint].handler != s_infer) {
        char msg[128];
        snprintf (msg, sizeof msg, "the request body is larger than %zu bytes (--max-body)",
                  self->cfg.max_body);
        s_reply_error (&rep, 413, msg);
    }
    else
        s_routes[endpoint].handler (self, req, &rep);
    return s_send (self, req, endpoint, &rep);
}

/* Keep the body, up to max_body; past it, read and drop the rest so that
 * the client gets its 413 rather than a reset connection. */
static void
s_receive (kiln_serve_http_t *self, s_req_t *req, const char *data, size_t size)
{
    if (req->too_large)
        return;
    if (size > self->cfg.max_body - req->len) {
        req->too_large = true;
        free (req->body);
        req->body = NULL;
        req->len = req->cap = 0;
        return;
    }
    if (req->len + size > req->cap) {
        /* The whole declared body at once when it arrives (memory is
         * taken as bytes come, not for a header alone); else doubling. */
        size_t cap = req->expect >= req->len + size ? req->expect
                                                    : req->cap ? req->cap : 64 << 10;
        while (cap < req->len + size)
            cap *= 2;
        if (cap > self->cfg.max_body)
            cap = self->cfg.max_body;
        uint8_t *p = realloc (req->body, cap);
        if (!p) {
            req->too_large = true;  /* answered 413 rather than dropped */
            free (req->body);
            req->body = NULL;
            req->len = req->cap = 0;
            return;
        }
        req->body = p;
        req->cap = cap;
    }
    memcpy (req->body + req->len, data, size);
    req->len += size;
}

static enum MHD_Result
s_access (void *cls, struct MHD_Connection *conn, const char *url, const char *method,
          const char *http_version, const char *upload_data, size_t *upload_data_size,
          void **con_cls)
{
    kiln_serve_http_t *self = cls;
    s_req_t *req = *con_cls;
    if (!req) {
        if (!(req = calloc (1, sizeof *req)))
            return MHD_NO;
        req->start_ns = kiln_serve_now_ns ();
        req->conn = conn;
        *con_cls = req;
        const char *cl = MHD_lookup_connection_value (conn, MHD_HEADER_KIND,
                                                      MHD_HTTP_HEADER_CONTENT_LENGTH);
        long long n = cl ? s_decimal (cl, (long long) KILN_SERVE_MAX_BODY * 4) : 0;
        if (cl && (n < 0 || (unsigned long long) n > self->cfg.max_body))
            req->too_large = true;
        else
            req->expect = (size_t) n;
        return MHD_YES;
    }
    if (*upload_data_size) {
        s_receive (self, req, upload_data, *upload_data_size);
        *upload_data_size = 0;
        return MHD_YES;
    }
    return s_dispatch (self, req, url, method);
}

static void
s_completed (void *cls, struct MHD_Connection *conn, void **con_cls,
             enum MHD_RequestTerminationCode toe)
{
    s_req_t *req = *con_cls;
    if (req) {
        free (req->body);
        free (req);
        *con_cls = NULL;
    }
}


kiln_serve_http_t *
kiln_serve_http_new (const kiln_serve_http_config_t *cfg, kiln_serve_repo_t *repo,
                     kiln_serve_metrics_t *metrics, kiln_err_t *err)
{
    struct sockaddr_storage addr;
    socklen_t addr_len = 0;
    int family = AF_INET;
    if (!cfg || !cfg->listen || !repo || cfg->max_body < 1 || cfg->max_connections < 1) {
        kiln_error (err, KILN_EINVAL, "the HTTP server needs an address, a repository, a body "
                    "limit and a connection limit");
        return NULL;
    }
    if (kiln_resolve_listen ("--listen", cfg->listen, &addr, &addr_len, &family, err) != 0)
        return NULL;
    kiln_serve_http_t *self = calloc (1, sizeof *self);
    if (!self) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    self->cfg = *cfg;
    self->repo = repo;
    self->metrics = metrics;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION
                     | MHD_USE_POLL | MHD_USE_ERROR_LOG
                     | (family == AF_INET6 ? MHD_USE_IPv6 : 0);
    self->daemon = MHD_start_daemon (
        flags, 0, NULL, NULL, s_access, self,
        MHD_OPTION_EXTERNAL_LOGGER, kiln_net_log, (void *) "http",
        MHD_OPTION_SOCK_ADDR, (struct sockaddr *) &addr,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned) cfg->max_connections,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned) (cfg->timeout_s > 0 ? cfg->timeout_s : 0),
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t) (256 << 10),
        MHD_OPTION_LISTEN_BACKLOG_SIZE, (unsigned) 128,
        MHD_OPTION_NOTIFY_COMPLETED, s_completed, self,
        MHD_OPTION_END);
    if (!self->daemon) {
        kiln_error (err, KILN_ESYS, "cannot listen on '%s' (address in use, or not this "
                    "host's?)", cfg->listen);
        free (self);
        return NULL;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info (self->daemon,
                                                            MHD_DAEMON_INFO_BIND_PORT);
    self->port = info ? (int) info->port : 0;
    return self;
}

int
kiln_serve_http_port (const kiln_serve_http_t *self)
{
    return self->port;
}

void
kiln_serve_http_destroy (kiln_serve_http_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_serve_http_t *self = *self_p;
    MHD_stop_daemon (self->daemon);
    free (self);
    *self_p = NULL;
}
