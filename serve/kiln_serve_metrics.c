#include "serve/kiln_serve_metrics.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/kiln_hash.h"
#include "common/kiln_limits.h"
#include "serve/kiln_serve_buf.h"

/* Latency buckets, seconds (Prometheus's `le`). */
static const double s_latency_le[] = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
};
#define S_N_LATENCY (sizeof s_latency_le / sizeof s_latency_le[0])

/* Requests-per-run buckets. */
static const int s_batch_le[] = { 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024 };
#define S_N_BATCH (sizeof s_batch_le / sizeof s_batch_le[0])

/* The statuses kiln-serve sends; anything else is counted as "other". */
static const int s_statuses[] = { 200, 400, 404, 405, 413, 500, 503 };
#define S_N_STATUS (sizeof s_statuses / sizeof s_statuses[0])

struct kiln_serve_model_metrics {
    char name[KILN_MAX_MODEL_NAME + 1];
    _Atomic uint64_t requests;                      /* inference requests */
    _Atomic uint64_t failures[KILN_SERVE_FAILURE_COUNT];
    _Atomic uint64_t latency[S_N_LATENCY + 1];      /* per bucket, not cumulative */
    _Atomic uint64_t latency_ns;                    /* sum */
    _Atomic int64_t queue;                          /* requests waiting */
    _Atomic uint64_t batch[S_N_BATCH + 1];          /* runs per requests-per-run bucket */
    _Atomic uint64_t batch_requests;                /* sum of requests over runs */
    _Atomic uint64_t batch_rows;                    /* sum of rows over runs */
    _Atomic uint64_t refusals[KILN_SERVE_REFUSAL_COUNT];
    _Atomic uint64_t loads;                         /* versions swapped in */
    pthread_mutex_t lock;                           /* digest and seq */
    bool loaded;                                    /* a version is serving */
    char digest[KILN_HEX_LEN];                      /* its artifact */
    uint64_t seq;                                   /* its release seq */
};

/* A core's busy time: the union of the intervals runs used it. */
typedef struct {
    pthread_mutex_t lock;                           /* all three */
    int active;                                     /* runs using it now */
    uint64_t since_ns;                              /* when active went 0 -> 1 */
    uint64_t busy_ns;                               /* closed intervals */
} s_core_t;

struct kiln_serve_metrics {
    pthread_mutex_t lock;                           /* models, n_models */
    kiln_serve_model_metrics_t *models[KILN_SERVE_MAX_MODELS];
    int n_models;
    const char *const *endpoints;                   /* labels, static */
    int n_endpoints;
    _Atomic uint64_t *http;                         /* [endpoint + 1][status + 1] */
    int n_cores;
    int *cpus;                                      /* CPU of each core */
    s_core_t *cores;                                /* busy time per core */
    double started;                                 /* process start, epoch seconds */
};

const char *
kiln_serve_refusal_label (kiln_serve_refusal_t why)
{
    static const char *const labels[] = {
#define S_LABEL(name, label, text) label,
        KILN_SERVE_REFUSALS (S_LABEL)
#undef S_LABEL
    };
    return (int) why >= 0 && why < KILN_SERVE_REFUSAL_COUNT ? labels[why] : "unknown";
}

const char *
kiln_serve_failure_label (kiln_serve_failure_t why)
{
    static const char *const labels[] = {
#define S_LABEL(name, label, status, text) label,
        KILN_SERVE_FAILURES (S_LABEL)
#undef S_LABEL
    };
    return (int) why >= 0 && why < KILN_SERVE_FAILURE_COUNT ? labels[why] : "unknown";
}

int
kiln_serve_failure_status (kiln_serve_failure_t why)
{
    static const int statuses[] = {
#define S_STATUS(name, label, status, text) status,
        KILN_SERVE_FAILURES (S_STATUS)
#undef S_STATUS
    };
    return (int) why >= 0 && why < KILN_SERVE_FAILURE_COUNT ? statuses[why] : 500;
}

kiln_serve_metrics_t *
kiln_serve_metrics_new (const char *const *endpoints, int n_endpoints, int n_cores,
                        const int *cpus, kiln_err_t *err)
{
    kiln_serve_metrics_t *self = calloc (1, sizeof *self);
    if (!self || n_endpoints < 0 || n_cores < 0) {
        free (self);
        kiln_error (err, self ? KILN_EINVAL : KILN_ENOMEM, "cannot create the metrics");
        return NULL;
    }
    pthread_mutex_init (&self->lock, NULL);
    self->endpoints = endpoints;
    self->n_endpoints = n_endpoints;
    self->n_cores = n_cores;
    self->http = calloc ((size_t) (n_endpoints + 1) * (S_N_STATUS + 1), sizeof *self->http);
    self->cpus = calloc ((size_t) n_cores + 1, sizeof *self->cpus);
    self->cores = calloc ((size_t) n_cores + 1, sizeof *self->cores);
    if (!self->http || !self->cpus || !self->cores) {
        kiln_serve_metrics_destroy (&self);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    for (int c = 0; c < n_cores; c++) {
        self->cpus[c] = cpus ? cpus[c] : c;
        pthread_mutex_init (&self->cores[c].lock, NULL);
    }
    struct timespec ts;
    clock_gettime (CLOCK_REALTIME, &ts);
    self->started = (double) ts.tv_sec + (double) ts.tv_nsec / 1e9;
    return self;
}

void
kiln_serve_metrics_destroy (kiln_serve_metrics_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_serve_metrics_t *self = *self_p;
    for (int i = 0; i < self->n_models; i++) {
        pthread_mutex_destroy (&self->models[i]->lock);
        free (self->models[i]);
    }
    pthread_mutex_destroy (&self->lock);
    for (int c = 0; self->cores && c < self->n_cores; c++)
        pthread_mutex_destroy (&self->cores[c].lock);
    free (self->http);
    free (self->cpus);
    free (self->cores);
    free (self);
    *self_p = NULL;
}

kiln_serve_model_metrics_t *
kiln_serve_metrics_model (kiln_serve_metrics_t *self, const char *model)
{
    kiln_serve_model_metrics_t *mm = NULL;
    if (!self || !model || strlen (model) > KILN_MAX_MODEL_NAME)
        return NULL;
    pthread_mutex_lock (&self->lock);
    for (int i = 0; i < self->n_models && !mm; i++)
        if (strcmp (self->models[i]->name, model) == 0)
            mm = self->models[i];
    if (!mm && self->n_models < KILN_SERVE_MAX_MODELS
        && (mm = calloc (1, sizeof *mm)) != NULL) {
        snprintf (mm->name, sizeof mm->name, "%s", model);
        pthread_mutex_init (&mm->lock, NULL);
        self->models[self->n_models++] = mm;
    }
    pthread_mutex_unlock (&self->lock);
    return mm;
}

void
kiln_serve_metrics_http (kiln_serve_metrics_t *self, int endpoint, int status)
{
    if (!self)
        return;
    size_t e = endpoint >= 0 && endpoint < self->n_endpoints ? (size_t) endpoint
                                                              : (size_t) self->n_endpoints;
    size_t s = S_N_STATUS;
    for (size_t i = 0; i < S_N_STATUS; i++)
        if (s_statuses[i] == status)
            s = i;
    atomic_fetch_add (&self->http[e * (S_N_STATUS + 1) + s], 1);
}

void
kiln_serve_metrics_core_enter (kiln_serve_metrics_t *self, int core)
{
    if (!self || core < 0 || core >= self->n_cores)
        return;
    s_core_t *c = &self->cores[core];
    pthread_mutex_lock (&c->lock);
    if (c->active++ == 0)
        c->since_ns = kiln_serve_now_ns ();
    pthread_mutex_unlock (&c->lock);
}

void
kiln_serve_metrics_core_leave (kiln_serve_metrics_t *self, int core)
{
    if (!self || core < 0 || core >= self->n_cores)
        return;
    s_core_t *c = &self->cores[core];
    pthread_mutex_lock (&c->lock);
    if (c->active > 0 && --c->active == 0)
        c->busy_ns += kiln_serve_now_ns () - c->since_ns;
    pthread_mutex_unlock (&c->lock);
}

/* Busy time of core `core` so far, the open interval included. */
static uint64_t
s_core_busy (kiln_serve_metrics_t *self, int core)
{
    s_core_t *c = &self->cores[core];
    pthread_mutex_lock (&c->lock);
    uint64_t ns = c->busy_ns + (c->active ? kiln_serve_now_ns () - c->since_ns : 0);
    pthread_mutex_unlock (&c->lock);
    return ns;
}

void
kiln_serve_metrics_request (kiln_serve_model_metrics_t *mm)
{
    if (mm)
        atomic_fetch_add (&mm->requests, 1);
}

void
kiln_serve_metrics_failure (kiln_serve_model_metrics_t *mm, kiln_serve_failure_t why)
{
    if (mm && (int) why >= 0 && why < KILN_SERVE_FAILURE_COUNT)
        atomic_fetch_add (&mm->failures[why], 1);
}

void
kiln_serve_metrics_latency (kiln_serve_model_metrics_t *mm, uint64_t ns)
{
    if (!mm)
        return;
    double s = (double) ns / 1e9;
    size_t b = 0;
    while (b < S_N_LATENCY && s > s_latency_le[b])
        b++;
    atomic_fetch_add (&mm->latency[b], 1);
    atomic_fetch_add (&mm->latency_ns, ns);
}

void
kiln_serve_metrics_queue (kiln_serve_model_metrics_t *mm, int delta)
{
    if (mm)
        atomic_fetch_add (&mm->queue, delta);
}

void
kiln_serve_metrics_batch (kiln_serve_model_metrics_t *mm, int requests, int64_t rows)
{
    if (!mm || requests < 1 || rows < 0)
        return;
    size_t b = 0;
    while (b < S_N_BATCH && requests > s_batch_le[b])
        b++;
    atomic_fetch_add (&mm->batch[b], 1);
    atomic_fetch_add (&mm->batch_requests, (uint64_t) requests);
    atomic_fetch_add (&mm->batch_rows, (uint64_t) rows);
}

void
kiln_serve_metrics_refusal (kiln_serve_model_metrics_t *mm, kiln_serve_refusal_t why)
{
    if (mm && (int) why >= 0 && why < KILN_SERVE_REFUSAL_COUNT)
        atomic_fetch_add (&mm->refusals[why], 1);
}

void
kiln_serve_metrics_loaded (kiln_serve_model_metrics_t *mm, const char *digest,
                           uint64_t seq, int swapped)
{
    if (!mm)
        return;
    pthread_mutex_lock (&mm->lock);
    mm->loaded = digest != NULL;
    snprintf (mm->digest, sizeof mm->digest, "%s", digest ? digest : "");
    mm->seq = digest ? seq : 0;
    pthread_mutex_unlock (&mm->lock);
    if (swapped)
        atomic_fetch_add (&mm->loads, 1);
}

/* --- the page ------------------------------------------------------- */

static void
s_family (kiln_serve_buf_t *b, const char *name, const char *type, const char *help)
{
    kiln_serve_buf_printf (b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void
s_render_http (kiln_serve_metrics_t *self, kiln_serve_buf_t *b)
{
    s_family (b, "kiln_serve_http_requests_total", "counter",
              "HTTP requests answered, by endpoint and status code.");
    for (int e = 0; e <= self->n_endpoints; e++)
        for (size_t s = 0; s <= S_N_STATUS; s++) {
            uint64_t v = atomic_load (&self->http[(size_t) e * (S_N_STATUS + 1) + s]);
            if (!v)
                continue;
            char code[16];
            if (s < S_N_STATUS)
                snprintf (code, sizeof code, "%d", s_statuses[s]);
            else
                snprintf (code, sizeof code, "other");
            kiln_serve_buf_printf (b, "kiln_serve_http_requests_total{endpoint=\"%s\","
                                   "code=\"%s\"} %llu\n",
                                   e < self->n_endpoints ? self->endpoints[e] : "unknown",
                                   code, (unsigned long long) v);
        }
    s_family (b, "kiln_serve_core_busy_seconds_total", "counter",
              "Wall time during which each execution core was running a model.");
    for (int c = 0; c < self->n_cores; c++)
        kiln_serve_buf_printf (b, "kiln_serve_core_busy_seconds_total{core=\"%d\",cpu=\"%d\"} "
                               "%.6f\n", c, self->cpus[c],
                               (double) s_core_busy (self, c) / 1e9);
    s_family (b, "kiln_serve_start_time_seconds", "gauge",
              "When kiln-serve started, seconds since the epoch.");
    kiln_serve_buf_printf (b, "kiln_serve_start_time_seconds %.3f\n", self->started);
}

/* One family over every model: `value` prints the model's samples. */
typedef void (s_model_fn) (kiln_serve_buf_t *b, kiln_serve_model_metrics_t *mm);

static void
s_render_models (kiln_serve_buf_t *b, kiln_serve_model_metrics_t **models, int n,
                 const char *name, const char *type, const char *help, s_model_fn *fn)
{
    s_family (b, name, type, help);
    for (int i = 0; i < n; i++)
        fn (b, models[i]);
}

static void
s_requests (kiln_serve_buf_t *b, kiln_serve_model_metrics_t *mm)
{
    kiln_serve_buf_printf (b, "kiln_serve_inference_requests_total{model=\"%s\"} %llu\n",
                           mm->name, (unsigned long long) atomic_load (&mm->requests));
}

static void
s_failures (kiln_serve_buf_t *b, kiln_serve_model_metrics_t *mm)
{
    for (int f = 0; f < KILN_SERVE_FAILURE_COUNT; f++)
        kiln_serve_buf_printf (b, "kiln_serve_inference_failures_total{model=\"%s\","
                               "reason=\"%s\"} %llu\n", mm->name,
                               kiln_serve_failure_label ((kiln_serve_failure_t) f),
                               (unsigned long long) atomic_load (&mm->failures[f]));
}

static void
s_latency (kiln_serve_buf_t *b, kiln_serve_model_metrics_t *mm)
{
    uint64_t cum = 0;
    for (size_t i = 0; i <= S_N_LATENCY; i++) {
        cum += atomic_load (&mm->latency[i]);
        if (i < S_N_LATENCY)
            kiln_serve_buf_printf (b, "kiln_serve_inference_latency_seconds_bucket{model=\"%s\","
                                   "le=\"%g\"} %llu\n", mm->name, s_latency_le[i],
                                   (unsigned long long) cum);
        else
            kiln_serve_buf_printf (b, "kiln_serve_inference_latency_seconds_bucket{model=\"%s\","
                                   "le=\"+Inf\"} %llu\n", mm->name, (unsigned long long) cum);
    }
    kiln_serve_buf_printf (b, "kiln_serve_inference_latency_seconds_sum{model=\"%s\"} %.9f\n"
                           "kiln_serve_inference_latency_seconds_count{model=\"%s\"} %llu\n",
                           mm->name, (double) atomic_load (&mm->latency_ns) / 1e9, mm->name,
                           (unsigned long long) cum);
}

static void
s_queue (kiln_serve_buf_t *b, kiln_serve_model_metrics_t *mm)
{
    kiln_serve_buf_printf (b, "kiln_serve_queue_depth{model=\"%s\"} %lld\n", mm->name,
                           (long long) atomic_load (&mm->queue));
}

static void
s_batch (kiln_serve_buf_t *b, kiln_serve_model_metrics_t *mm)
{
    uint64_t cum = 0;
    for (size_t i = 0; i <= S_N_BATCH; i++) {
        cum += atomic_load (&mm->batch[i]);
        if (i < S_N_BATCH)
            kiln_serve_buf_printf (b, "kiln_serve_batch_requests_bucket{model=\"%s\",le=\"%d\"} "
                                   "%llu\n", mm->name, s_batch_le[i], (unsigned long long) cum);
        else
            kiln_serve_buf_printf (b, "kiln_serve_batch_requests_bucket{model=\"%s\",le=\"+Inf\"} "
                                   "%llu\n", mm->name, (unsigned long long) cum);
    }
    kiln_serve_buf_printf (b, "kiln_serve_batch_requests_sum{model=\"%s\"} %llu\n"
                           "kiln_serve_batch_requests_count{model=\"%s\"} %llu\n", mm->name,
                           (unsigned long long) atomic_load (&mm->batch_requests), mm->name,
                           (unsigned long long) cum);
}

static void
s_rows (kiln_serve_buf_t *b, kiln_serve_model_metrics_t *mm)
{
    kiln_serve_buf_printf (b, "kiln_serve_batch_rows_total{model=\"%s\"} %llu\n", mm->name,
                           (unsigned long long) atomic_load (&mm->batch_rows));
}

static void
s_loaded (kiln_serve_buf_t *b, kiln_serve_model_metrics_t *mm)
{
    pthread_mutex_lock (&mm->lock);
    bool loaded = mm->loaded;
    char digest[KILN_HEX_LEN];
    memcpy (digest, mm->digest, sizeof digest);
    uint64_t seq = mm->seq;
    pthread_mutex_unlock (&mm->lock);
    if (loaded)
        kiln_serve_buf_printf (b, "kiln_serve_model_loaded_info{model=\"%s\",digest=\"%s\","
                               "seq=\"%llu\"} 1\n", mm->name, digest,
                               (unsigned long long) seq);
}

static void
s_ready (kiln_serve_buf_t *b, kiln_serve_model_metrics_t *mm)
{
    pthread_mutex_lock (&mm->lock);
    bool loaded = mm->loaded;
    pthread_mutex_unlock (&mm->lock);
    kiln_serve_buf_printf (b, "kiln_serve_model_ready{model=\"%s\"} %d\n", mm->name,
                           loaded ? 1 : 0);
}

static void
s_loads (kiln_serve_buf_t *b, kiln_serve_model_metrics_t *mm)
{
    kiln_serve_buf_printf (b, "kiln_serve_model_loads_total{model=\"%s\"} %llu\n", mm->name,
                           (unsigned long long) atomic_load (&mm->loads));
}

static void
s_refusals (kiln_serve_buf_t *b, kiln_serve_model_metrics_t *mm)
{
    for (int r = 0; r < KILN_SERVE_REFUSAL_COUNT; r++)
        kiln_serve_buf_printf (b, "kiln_serve_release_refusals_total{model=\"%s\","
                               "reason=\"%s\"} %llu\n", mm->name,
                               kiln_serve_refusal_label ((kiln_serve_refusal_t) r),
                               (unsigned long long) atomic_load (&mm->refusals[r]));
}

int
kiln_serve_metrics_render (kiln_serve_metrics_t *self, char **out, size_t *len,
                           kiln_err_t *err)
{
    kiln_serve_model_metrics_t *models[KILN_SERVE_MAX_MODELS];
    pthread_mutex_lock (&self->lock);
    int n = self->n_models;
    memcpy (models, self->models, (size_t) n * sizeof *models);
    pthread_mutex_unlock (&self->lock);

    kiln_serve_buf_t b;
    kiln_serve_buf_init (&b, KILN_SERVE_MAX_METRICS_BYTES, "the metrics page");
    s_render_http (self, &b);
    static const struct {
        const char *name, *type, *help;
        s_model_fn *fn;
    } families[] = {
        { "kiln_serve_inference_requests_total", "counter",
          "Inference requests received for the model.", s_requests },
        { "kiln_serve_inference_failures_total", "counter",
          "Inference requests for the model that failed, by reason.", s_failures },
        { "kiln_serve_inference_latency_seconds", "histogram",
          "Successful inference requests, from arrival to response.", s_latency },
        { "kiln_serve_queue_depth", "gauge",
          "Inference requests waiting for a batch worker.", s_queue },
        { "kiln_serve_batch_requests", "histogram",
          "Model runs by the number of requests batched into them.", s_batch },
        { "kiln_serve_batch_rows_total", "counter",
          "Rows (dimension 0) run, over all batches.", s_rows },
        { "kiln_serve_model_ready", "gauge",
          "1 while a version of the model is loaded.", s_ready },
        { "kiln_serve_model_loaded_info", "gauge",
          "The version serving: its artifact digest and release seq.", s_loaded },
        { "kiln_serve_model_loads_total", "counter",
          "Versions of the model loaded and swapped in.", s_loads },
        { "kiln_serve_release_refusals_total", "counter",
          "Releases of the model refused, by reason.", s_refusals },
    };
    for (size_t f = 0; f < sizeof families / sizeof families[0]; f++)
        s_render_models (&b, models, n, families[f].name, families[f].type,
                         families[f].help, families[f].fn);
    int rc = kiln_serve_buf_check (&b, err);
    if (rc == 0)
        *out = kiln_serve_buf_take (&b, len);
    kiln_serve_buf_release (&b);
    return rc;
}
