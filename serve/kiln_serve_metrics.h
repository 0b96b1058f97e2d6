/*
 * kiln_serve_metrics — kiln-serve's counters, gauges and histograms, and
 * their Prometheus text exposition (format 0.0.4) for GET /metrics.
 *
 * Every number is a C11 atomic, updated without a lock by request
 * threads, batch workers and the loader; a scrape reads each once, so it
 * sees every value as it was at some instant during the scrape, which is
 * all Prometheus asks.  Per-model values live in slots created on first
 * use and never removed before the metrics are destroyed (at most
 * KILN_SERVE_MAX_MODELS; a model's name is bounded by
 * KILN_MAX_MODEL_NAME), so a pointer to a slot stays valid while the
 * metrics live.  A slot's loaded digest and seq change together under the
 * slot's lock.  Only names of models in the repository become labels:
 * what a client puts in a URL never does.
 *
 * The refusal reasons and the inference failure kinds are the tables
 * below; their labels are the metric label values and what docs/
 * serving.md lists.
 */
#ifndef KILN_SERVE_METRICS_H
#define KILN_SERVE_METRICS_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "common/kiln_error.h"

/* Nanoseconds on CLOCK_MONOTONIC: what every duration kiln-serve measures
 * (latency, busy time, batch delays) is taken with. */
static inline uint64_t
kiln_serve_now_ns (void)
{
    struct timespec ts;
    clock_gettime (CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

/* Why a release was not loaded.  name, label, what it means. */
#define KILN_SERVE_REFUSALS(X)                                                    \
    X (UNREADABLE,       "unreadable",       "release.json cannot be read (missing, too large, I/O)") \
    X (MALFORMED,        "malformed",        "release.json is not a well-formed release record")      \
    X (SIGNATURE,        "signature",        "the record is not signed by a key in --release-keyring") \
    X (MODEL,            "model",            "the record is for another model than its directory")    \
    X (EXPIRED,          "expired",          "the record's expires_at has passed")                    \
    X (TARGET,           "target",           "the record is for another target than this host's")     \
    X (ABI,              "abi",              "the record needs another runtime ABI than this runtime's") \
    X (ROLLBACK,         "rollback",         "a lower seq than the highest accepted (--state), or the same seq naming another artifact") \
    X (MISSING_ARTIFACT, "missing_artifact", "DIR/<model>/<sha256>.kar named by the record is not there") \
    X (ARTIFACT,         "artifact",         "the artifact fails verification against --keyring, or is not the one the record names") \
    X (LOAD,             "load",             "the runtime cannot load the artifact or its warm-up run fails") \
    X (STATE,            "state",            "the state directory cannot record the release")

typedef enum {
#define KILN_SERVE_REFUSAL_ENUM(name, label, text) KILN_SERVE_REFUSED_##name,
    KILN_SERVE_REFUSALS (KILN_SERVE_REFUSAL_ENUM)
#undef KILN_SERVE_REFUSAL_ENUM
    KILN_SERVE_REFUSAL_COUNT
} kiln_serve_refusal_t;

/* Why an inference request for a known model failed.  name, label, HTTP
 * status, what it means. */
#define KILN_SERVE_FAILURES(X)                                                    \
    X (BAD_REQUEST, "bad_request", 400, "malformed, or does not fit the model's interface") \
    X (TOO_LARGE,   "too_large",   413, "the body is over --max-body")                     \
    X (UNAVAILABLE, "unavailable", 503, "no version of the model is loaded")               \
    X (OVERLOADED,  "overloaded",  503, "the model's queue holds --max-queue requests")     \
    X (ERROR,       "error",       500, "the run failed")

typedef enum {
#define KILN_SERVE_FAILURE_ENUM(name, label, status, text) KILN_SERVE_FAILED_##name,
    KILN_SERVE_FAILURES (KILN_SERVE_FAILURE_ENUM)
#undef KILN_SERVE_FAILURE_ENUM
    KILN_SERVE_FAILURE_COUNT
} kiln_serve_failure_t;

/* The label of a refusal reason ("rollback") and of a failure kind
 * ("overloaded"); "unknown" out of range. */
const char *kiln_serve_refusal_label (kiln_serve_refusal_t why);
const char *kiln_serve_failure_label (kiln_serve_failure_t why);
int kiln_serve_failure_status (kiln_serve_failure_t why);

typedef struct kiln_serve_metrics kiln_serve_metrics_t;
typedef struct kiln_serve_model_metrics kiln_serve_model_metrics_t;

/* Metrics for a server whose HTTP endpoints are `endpoints` (labels, kept
 * by pointer: static strings) and whose runtime has `n_cores` cores on the
 * CPUs `cpus` (copied).  Caller owns the result. */
kiln_serve_metrics_t *kiln_serve_metrics_new (const char *const *endpoints,
                                              int n_endpoints, int n_cores,
                                              const int *cpus, kiln_err_t *err);
void kiln_serve_metrics_destroy (kiln_serve_metrics_t **self_p);

/* The slot of `model`, created on first use; owned by the metrics.  NULL
 * when KILN_SERVE_MAX_MODELS slots exist already. */
kiln_serve_model_metrics_t *kiln_serve_metrics_model (kiln_serve_metrics_t *self,
                                                      const char *model);

/* One HTTP response with `status` from endpoint `endpoint` (an index into
 * the endpoints given to _new; out of range counts as "unknown"). */
void kiln_serve_metrics_http (kiln_serve_metrics_t *self, int endpoint, int status);
/* A run that uses core `core` starts, or ends.  A core is busy while at
 * least one run uses it: overlapping runs (two batches whose chunks share
 * a core) count its time once, so busy time never passes wall time. */
void kiln_serve_metrics_core_enter (kiln_serve_metrics_t *self, int core);
void kiln_serve_metrics_core_leave (kiln_serve_metrics_t *self, int core);

/* Per model; every function accepts a NULL slot and does nothing. */
void kiln_serve_metrics_request (kiln_serve_model_metrics_t *mm);
void kiln_serve_metrics_failure (kiln_serve_model_metrics_t *mm, kiln_serve_failure_t why);
/* A successful inference took `ns` from its request's arrival to its
 * response. */
void kiln_serve_metrics_latency (kiln_serve_model_metrics_t *mm, uint64_t ns);
/* Requests waiting in the model's queues (all its loaded versions). */
void kiln_serve_metrics_queue (kiln_serve_model_metrics_t *mm, int delta);
/* One run of `requests` requests holding `rows` rows in dimension 0. */
void kiln_serve_metrics_batch (kiln_serve_model_metrics_t *mm, int requests, int64_t rows);
void kiln_serve_metrics_refusal (kiln_serve_model_metrics_t *mm, kiln_serve_refusal_t why);
/* The version now serving (digest NULL: none), and one more load when
 * `swapped`. */
void kiln_serve_metrics_loaded (kiln_serve_model_metrics_t *mm, const char *digest,
                                uint64_t seq, int swapped);

/* The page, Prometheus text format 0.0.4.  Caller owns *out (free()). */
int kiln_serve_metrics_render (kiln_serve_metrics_t *self, char **out, size_t *len,
                               kiln_err_t *err);

#endif
