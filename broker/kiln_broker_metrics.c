/*
 * kiln_broker_metrics — the broker's state for Prometheus: `kiln-broker
 * --metrics HOST:PORT` serves GET /metrics in the text exposition format
 * (docs/operations.md, "Metrics").
 *
 * The broker's state belongs to its loop thread, and the HTTP server
 * (libmicrohttpd, as in kiln-serve) runs threads of its own: so the loop
 * renders the whole page on a timer (every BROKER_METRICS_MS) into a
 * buffer, and the server hands out the last page, taken under a mutex.
 * A scrape sees the state of at most BROKER_METRICS_MS ago, and never
 * touches a job, a worker or a client.  The histograms (how long jobs
 * wait in the queue and how long they build) are filled by the loop as
 * jobs start and finish.
 */
#include "broker/kiln_broker_priv.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <microhttpd.h>

#include "common/kiln_log.h"
#include "common/kiln_net.h"

#define S_MAX_PAGE     (8u << 20)   /* a rendered page; past it the page says so */
#define S_CONNECTIONS  16           /* scrapers at once */

/* Bucket bounds in seconds, shared by both histograms: from a cache-warm
 * no-op to an hour-long compile. */
static const double s_bounds[] = { 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
                                   300, 600, 1800, 3600 };
#define S_BUCKETS (sizeof s_bounds / sizeof s_bounds[0])

typedef struct {
    uint64_t counts[S_BUCKETS + 1];      /* the last is +Inf */
    uint64_t n;
    double sum;
} s_histogram_t;

struct broker_metrics {
    struct MHD_Daemon *daemon;
    int port;
    pthread_mutex_t lock;                /* guards page and page_len */
    char *page;                          /* owned; the last rendered page */
    size_t page_len;
    uint64_t scrapes;                    /* under lock */
    s_histogram_t queue_wait;            /* loop thread only */
    s_histogram_t build_time;            /* loop thread only */
};

/* --- HTTP ------------------------------------------------------------------ */

static enum MHD_Result
s_reply (struct MHD_Connection *conn, unsigned status, const char *type, char *body,
         size_t len)
{
    struct MHD_Response *resp = MHD_create_response_from_buffer (len, body,
                                                                 MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free (body);
        return MHD_NO;
    }
    MHD_add_response_header (resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    enum MHD_Result r = MHD_queue_response (conn, status, resp);
    MHD_destroy_response (resp);
    return r;
}

static enum MHD_Result
s_access (void *cls, struct MHD_Connection *conn, const char *url, const char *method,
          const char *version, const char *upload_data, size_t *upload_data_size,
          void **con_cls)
{
    broker_metrics_t *self = cls;
    if (*upload_data_size) {
        *upload_data_size = 0;       /* a scrape has no body: ignore one */
        return MHD_YES;
    }
    if (strcmp (method, "GET") != 0 && strcmp (method, "HEAD") != 0)
        return s_reply (conn, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain",
                        strdup ("only GET /metrics\n"), strlen ("only GET /metrics\n"));
    if (strcmp (url, "/metrics") != 0)
        return s_reply (conn, MHD_HTTP_NOT_FOUND, "text/plain", strdup ("try /metrics\n"),
                        strlen ("try /metrics\n"));
    pthread_mutex_lock (&self->lock);
    char *copy = self->page ? malloc (self->page_len + 1) : NULL;
    size_t len = copy ? self->page_len : 0;
    if (copy)
        memcpy (copy, self->page, len + 1);
    self->scrapes++;
    pthread_mutex_unlock (&self->lock);
    if (!copy)
        return s_reply (conn, MHD_HTTP_SERVICE_UNAVAILABLE, "text/plain",
                        strdup ("no page yet\n"), strlen ("no page yet\n"));
    return s_reply (conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", copy, len);
}


broker_metrics_t *
broker_metrics_new (const char *listen, kiln_err_t *err)
{
    struct sockaddr_storage addr;
    socklen_t addr_len = 0;
    int family = AF_INET;
    if (kiln_resolve_listen ("--metrics", listen, &addr, &addr_len, &family, err) != 0)
        return NULL;
    broker_metrics_t *self = calloc (1, sizeof *self);
    if (!self) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    pthread_mutex_init (&self->lock, NULL);
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL | MHD_USE_ERROR_LOG
                     | (family == AF_INET6 ? MHD_USE_IPv6 : 0);
    self->daemon = MHD_start_daemon (
        flags, 0, NULL, NULL, s_access, self,
        MHD_OPTION_EXTERNAL_LOGGER, kiln_net_log, (void *) "metrics",
        MHD_OPTION_SOCK_ADDR, (struct sockaddr *) &addr,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned) S_CONNECTIONS,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned) 10,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t) (64 << 10),
        MHD_OPTION_END);
    if (!self->daemon) {
        kiln_error (err, KILN_ESYS, "--metrics: cannot listen on '%s' (address in use, or "
                    "not this host's?)", listen);
        broker_metrics_destroy (&self);
        return NULL;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info (self->daemon,
                                                            MHD_DAEMON_INFO_BIND_PORT);
    self->port = info ? (int) info->port : 0;
    return self;
}

void
broker_metrics_destroy (broker_metrics_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    broker_metrics_t *self = *self_p;
    if (self->daemon)
        MHD_stop_daemon (self->daemon);
    pthread_mutex_destroy (&self->lock);
    free (self->page);
    free (self);
    *self_p = NULL;
}

int
broker_metrics_port (const broker_metrics_t *self)
{
    return self ? self->port : 0;
}

/* --- observations (loop thread) ----------------------------------------------- */

static void
s_observe (s_histogram_t *h, double seconds)
{
    if (seconds < 0)
        seconds = 0;
    size_t i = 0;
    while (i < S_BUCKETS && seconds > s_bounds[i])
        i++;
    h->counts[i]++;
    h->n++;
    h->sum += seconds;
}

void
broker_metrics_job_started (kiln_broker_t *self, const broker_job_t *job)
{
    if (self->metrics)
        s_observe (&self->metrics->queue_wait, (double) (job->started - job->queued_at) / 1e3);
}

void
broker_metrics_job_built (kiln_broker_t *self, const broker_job_t *job)
{
    if (self->metrics)
        s_observe (&self->metrics->build_time, (double) (zclock_mono () - job->started) / 1e3);
}

/* --- rendering (loop thread) ----------------------------------------------------- */

/* A metric's HELP and TYPE lines. */
static void
s_head (FILE *out, const char *name, const char *type, const char *help)
{
    fprintf (out, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void
s_value (FILE *out, const char *name, const char *type, const char *help, double v)
{
    s_head (out, name, type, help);
    fprintf (out, "%s %.17g\n", name, v);
}

/* A label value, escaped as the exposition format wants (names here are
 * [A-Za-z0-9._:@-] already; this keeps the page valid whatever they are). */
static void
s_label (FILE *out, const char *v)
{
    for (; *v; v++) {
        if (*v == '\\' || *v == '"')
            fputc ('\\', out);
        if (*v == '\n')
            fputs ("\\n", out);
        else
            fputc (*v, out);
    }
}

static void
s_histogram (FILE *out, const char *name, const char *help, const s_histogram_t *h)
{
    s_head (out, name, "histogram", help);
    uint64_t cum = 0;
    for (size_t i = 0; i < S_BUCKETS; i++) {
        cum += h->counts[i];
        fprintf (out, "%s_bucket{le=\"%g\"} %llu\n", name, s_bounds[i], (unsigned long long) cum);
    }
    cum += h->counts[S_BUCKETS];
    fprintf (out, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.17g\n%s_count %llu\n", name,
             (unsigned long long) cum, name, h->sum, name, (unsigned long long) h->n);
}

typedef struct {
    FILE *out;
    kiln_broker_t *broker;
} s_tenant_arg_t;

static void
s_tenant_queued (const char *tenant, size_t queued, uint64_t served, void *arg)
{
    FILE *out = ((s_tenant_arg_t *) arg)->out;
    fputs ("kiln_broker_client_queued_jobs{client=\"", out);
    s_label (out, tenant);
    fprintf (out, "\"} %zu\n", queued);
}

/* The page, written to `out`. */
static void
s_render (kiln_broker_t *self, FILE *out)
{
    broker_metrics_t *m = self->metrics;
    int64_t now = zclock_mono ();
    size_t queued = kiln_sched_size (self->sched);
    size_t running = zhashx_size (self->jobs) - queued;
    uint64_t slots = 0, busy = 0;
    for (broker_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers)) {
        slots += (uint64_t) w->slots;
        busy += (uint64_t) w->busy;
    }
    s_head (out, "kiln_broker_info", "gauge", "the broker: its name and protocol version");
    fputs ("kiln_broker_info{broker=\"", out);
    s_label (out, self->name);
    fprintf (out, "\",protocol=\"%d\"} 1\n", KILN_PROTO_VERSION);
    s_value (out, "kiln_broker_uptime_seconds", "gauge", "seconds since the broker started",
             (double) (now - self->started) / 1e3);

    s_value (out, "kiln_broker_queued_jobs", "gauge", "jobs waiting for a worker",
             (double) queued);
    s_value (out, "kiln_broker_running_jobs", "gauge", "jobs on a worker", (double) running);
    s_head (out, "kiln_broker_client_queued_jobs", "gauge", "jobs waiting, per client");
    s_tenant_arg_t targ = { out, self };
    kiln_sched_each_tenant (self->sched, s_tenant_queued, &targ);

    s_value (out, "kiln_broker_workers", "gauge", "workers registered",
             (double) zhashx_size (self->workers));
    s_value (out, "kiln_broker_slots", "gauge", "job slots over all workers", (double) slots);
    s_value (out, "kiln_broker_busy_slots", "gauge", "slots running a job", (double) busy);
    s_head (out, "kiln_broker_worker_slots", "gauge", "a worker's job slots");
    for (broker_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers)) {
        fputs ("kiln_broker_worker_slots{worker=\"", out);
        s_label (out, w->name);
        fprintf (out, "\"} %d\n", w->slots);
    }
    s_head (out, "kiln_broker_worker_busy_slots", "gauge", "a worker's slots running a job");
    for (broker_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers)) {
        fputs ("kiln_broker_worker_busy_slots{worker=\"", out);
        s_label (out, w->name);
        fprintf (out, "\"} %d\n", w->busy);
    }

    s_value (out, "kiln_broker_jobs_submitted_total", "counter", "jobs queued",
             (double) self->stats.submitted);
    s_value (out, "kiln_broker_jobs_done_total", "counter", "jobs built and signed",
             (double) self->stats.done);
    s_value (out, "kiln_broker_jobs_failed_total", "counter", "jobs that failed",
             (double) self->stats.failed);
    s_value (out, "kiln_broker_jobs_canceled_total", "counter", "jobs nobody waited for any more",
             (double) self->stats.canceled);
    s_value (out, "kiln_broker_jobs_requeued_total", "counter",
             "jobs taken back from a worker and queued again", (double) self->stats.requeued);
    s_value (out, "kiln_broker_jobs_joined_total", "counter",
             "requests that joined a job already building the same action",
             (double) self->stats.joined);

    s_value (out, "kiln_broker_cross_checks_total", "counter",
             "builds checked by a second worker", (double) self->stats.checked);
    s_value (out, "kiln_broker_cross_check_disagreements_total", "counter",
             "cross-checks whose two builds differed", (double) self->stats.disagreed);
    s_value (out, "kiln_broker_unchecked_builds_total", "counter",
             "builds accepted without a cross-check (policy, or one worker)",
             (double) self->stats.unchecked);
    s_value (out, "kiln_broker_quarantined_workers", "gauge",
             "workers given no more jobs: a third build disagreed with them",
             (double) zhashx_size (self->quarantine));

    s_value (out, "kiln_broker_cache_lookups_total", "counter", "action cache lookups",
             (double) self->stats.lookups);
    s_value (out, "kiln_broker_cache_hits_total", "counter",
             "requests answered from the action cache", (double) self->stats.hits);
    s_value (out, "kiln_broker_cache_failure_hits_total", "counter",
             "requests answered from the failure cache", (double) self->stats.failure_hits);
    s_value (out, "kiln_broker_cache_hit_ratio", "gauge", "cache hits / lookups (0 before any)",
             self->stats.lookups ? (double) self->stats.hits / (double) self->stats.lookups : 0);

    kiln_downloads_stats_t dl;
    kiln_downloads_stats (self->downloads, &dl);
    s_value (out, "kiln_broker_upload_bytes_total", "counter",
             "weight bytes clients uploaded", (double) self->stats.uploaded_bytes);
    s_value (out, "kiln_broker_uploaded_blobs_total", "counter", "weight blobs stored from uploads",
             (double) self->stats.uploaded_blobs);
    s_value (out, "kiln_broker_uploads_in_progress", "gauge", "blob uploads under way",
             (double) self->uploads);
    s_value (out, "kiln_broker_fetch_bytes_total", "counter", "blob bytes sent to workers",
             (double) self->stats.fetched_bytes);
    s_value (out, "kiln_broker_download_bytes_total", "counter",
             "artifact bytes sent to clients (kiln get)", (double) dl.bytes);
    s_value (out, "kiln_broker_downloads_total", "counter", "artifacts sent whole (kiln get)",
             (double) dl.served);
    s_value (out, "kiln_broker_downloads_in_progress", "gauge", "kiln get under way",
             (double) dl.in_progress);

    kiln_store_stats_t st;
    kiln_store_stats (self->store, &st);
    s_value (out, "kiln_broker_store_bytes", "gauge", "bytes in the store", (double) st.bytes);
    s_value (out, "kiln_broker_upload_reserved_bytes", "gauge",
             "bytes announced by uploads under way, reserved under the cap",
             (double) st.reserved_bytes);
    s_value (out, "kiln_broker_store_max_bytes", "gauge", "the store's cap",
             (double) st.max_bytes);
    s_value (out, "kiln_broker_store_artifacts", "gauge", "artifacts in the store",
             (double) st.artifacts);
    s_value (out, "kiln_broker_store_blobs", "gauge", "weight blobs in the store",
             (double) st.blobs);
    s_value (out, "kiln_broker_store_pinned_bytes", "gauge", "bytes of pinned artifacts",
             (double) st.pinned_bytes);
    s_value (out, "kiln_broker_store_evictions_total", "counter",
             "entries evicted to stay under the cap", (double) st.evicted);

    s_histogram (out, "kiln_broker_job_queue_seconds",
                 "how long a job waited in the queue before a worker took it", &m->queue_wait);
    s_histogram (out, "kiln_broker_job_build_seconds",
                 "how long a worker took to build a job that succeeded", &m->build_time);
    uint64_t scrapes;
    pthread_mutex_lock (&m->lock);
    scrapes = m->scrapes;
    pthread_mutex_unlock (&m->lock);
    s_value (out, "kiln_broker_metrics_scrapes_total", "counter", "GET /metrics answered",
             (double) scrapes);
}

/* Render the page now and make it the one scrapes get. */
void
broker_metrics_render (kiln_broker_t *self)
{
    broker_metrics_t *m = self->metrics;
    if (!m)
        return;
    char *page = NULL;
    size_t len = 0;
    FILE *out = open_memstream (&page, &len);
    if (!out)
        return;
    s_render (self, out);
    if (fclose (out) != 0) {
        free (page);
        return;
    }
    if (len > S_MAX_PAGE) {
        kiln_log_warn ("metrics: the page is %zu bytes, more than %u; scrapes keep the last "
                       "one", len, S_MAX_PAGE);
        free (page);
        return;
    }
    pthread_mutex_lock (&m->lock);
    free (m->page);
    m->page = page;
    m->page_len = len;
    pthread_mutex_unlock (&m->lock);
}

int
broker_metrics_on_timer (zloop_t *loop, int timer_id, void *arg)
{
    broker_metrics_render (arg);
    return 0;
}
