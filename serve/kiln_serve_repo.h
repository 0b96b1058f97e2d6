/*
 * kiln_serve_repo — kiln-serve's model repository: which version of each
 * model serves, and the release checks that decide it.
 *
 * Layout: DIR/<model>/release.json is the model's current release record
 * (what `kiln release sign -o` writes) and DIR/<model>/<sha256>.kar the
 * artifacts it may name.  Loading a model's release runs, in order (the
 * first failure refuses the release, with the reason in brackets):
 *
 *   1. read and verify the record against --release-keyring
 *      (kiln_release_read)                     [unreadable/malformed/signature]
 *   2. the record is for this directory's model                   [model]
 *   3. the same seq and artifact as the version serving: nothing to load
 *   4. not expired by this host's clock                            [expired]
 *   5. this host's target and runtime ABI                        [target/abi]
 *   6. no rollback against --state (kiln_release_check_newer)      [rollback]
 *   7. DIR/<model>/<artifact>.kar exists                  [missing_artifact]
 *   8. each replica loaded with kiln_rt_load_on, which verifies the
 *      artifact against --keyring, and is the artifact the record names,
 *      with its target and ABI                                     [artifact]
 *   9. a warm-up run on every replica                                  [load]
 *  10. recorded in --state (kiln_release_accept)                      [state]
 *  11. swapped in: new requests go to the new version at once; requests
 *      already holding the old one finish on it, and the last of them
 *      unloads it.
 *
 * A refusal leaves the version serving as it was; it is logged once with
 * its reason, kept as the model's last refusal (metadata) and counted
 * (kiln_serve_metrics).  A record naming the artifact already serving
 * under a higher seq is accepted without reloading.
 *
 * Versions are reference counted: the repository holds one on each
 * model's current version, kiln_serve_repo_get hands out more, and the
 * last kiln_serve_version_put unloads (stops the batcher, frees the
 * replicas).  Loads and scans are serialised (one at a time, they may
 * take seconds); get, status and ready take only a short lock and never
 * wait for a load.  Models are never removed from the table once found
 * (at most KILN_SERVE_MAX_MODELS).
 */
#ifndef KILN_SERVE_REPO_H
#define KILN_SERVE_REPO_H

#include <stdbool.h>
#include <stdint.h>

#include "artifact/kiln_release.h"
#include "common/kiln_error.h"
#include "runtime/kiln_rt.h"
#include "serve/kiln_serve_batch.h"
#include "serve/kiln_serve_metrics.h"

typedef struct kiln_serve_repo_config {
    const char *repo_dir;           /* DIR/<model>/{release.json,<sha256>.kar} */
    const char *keyring_dir;        /* farm keys: artifacts */
    const char *release_keyring_dir;/* release keys: release records */
    const char *state_dir;          /* highest accepted seq per model */
    const char *target;             /* this host's, e.g. "cpu-x86_64" */
    int replicas;                   /* per model, 1..KILN_SERVE_MAX_REPLICAS */
    int64_t max_batch;              /* rows per run; 0: the compiled batch */
    int64_t batch_delay_us;         /* wait for a batch to fill */
    int max_queue;                  /* requests waiting per model version */
} kiln_serve_repo_config_t;

typedef struct kiln_serve_repo kiln_serve_repo_t;
typedef struct kiln_serve_version kiln_serve_version_t;

/* A repository over `cfg` (strings copied) loading into `rt` and counting
 * into `metrics` (both borrowed).  Nothing is loaded until the first
 * scan.  Caller owns it. */
kiln_serve_repo_t *kiln_serve_repo_new (const kiln_serve_repo_config_t *cfg, kiln_rt_t *rt,
                                        kiln_serve_metrics_t *metrics, kiln_err_t *err);
/* Drop the repository's versions (each unloads when its last request is
 * done) and free it.  No get may run concurrently. */
void kiln_serve_repo_destroy (kiln_serve_repo_t **self_p);

/* Find every model directory (a valid model name holding release.json)
 * and load each one's release where it changed.  Refusals are not
 * errors here: they are logged and recorded per model.  Fails only when
 * the repository directory cannot be read. */
int kiln_serve_repo_scan (kiln_serve_repo_t *self, kiln_err_t *err);

/* Load the release of one model now.  0 when it is loaded or was
 * already; KILN_ENOTFOUND when DIR/<name>/release.json does not exist;
 * otherwise the refusal, its reason in *why (may be NULL) and `err`. */
int kiln_serve_repo_load (kiln_serve_repo_t *self, const char *name,
                          kiln_serve_refusal_t *why, kiln_err_t *err);

/* Stop serving model `name`: its version is dropped (requests holding it
 * finish on it) and the model stays unavailable until its next load.
 * The rollback state is left as it is.  KILN_ENOTFOUND for a model the
 * repository does not have; unloading a model with no version is not an
 * error. */
int kiln_serve_repo_unload (kiln_serve_repo_t *self, const char *name, kiln_err_t *err);

/* True once a scan has run and every model found has a version loaded. */
bool kiln_serve_repo_ready (kiln_serve_repo_t *self);

/* The version of model `name` serving now, with a reference the caller
 * drops with kiln_serve_version_put.  NULL with KILN_ENOTFOUND for a
 * model the repository does not have, KILN_EUNSUPPORTED when it has no
 * version loaded. */
kiln_serve_version_t *kiln_serve_repo_get (kiln_serve_repo_t *self, const char *name,
                                           kiln_err_t *err);
void kiln_serve_version_put (kiln_serve_version_t **self_p);

/* What a version serves; owned by it, valid while the caller holds it. */
const kiln_serve_iface_t *kiln_serve_version_iface (const kiln_serve_version_t *v);
kiln_serve_batch_t *kiln_serve_version_batch (kiln_serve_version_t *v);
kiln_serve_model_metrics_t *kiln_serve_version_metrics (kiln_serve_version_t *v);
const char *kiln_serve_version_model (const kiln_serve_version_t *v);
/* The seq of the release it serves (a higher seq may name the same
 * artifact: the version then stays and its seq moves up). */
uint64_t kiln_serve_version_seq (kiln_serve_version_t *v);

/* A refusal as the metadata shows it. */
typedef struct kiln_serve_refusal_info {
    kiln_serve_refusal_t reason;
    char message[KILN_ERR_MSG_MAX];
    uint64_t seq;                   /* the refused record's, 0 when unread */
    char artifact[KILN_HEX_LEN];    /* the artifact it named, "" when unread */
    int64_t at;                     /* when, seconds since the epoch */
} kiln_serve_refusal_info_t;

/* A snapshot of one model for the metadata endpoints. */
typedef struct kiln_serve_model_status {
    char name[KILN_MAX_MODEL_NAME + 1];
    kiln_serve_version_t *version;  /* a reference (put it), NULL when none loaded */
    kiln_release_t record;          /* the version's release record */
    int64_t loaded_at;              /* when it was swapped in */
    int n_replicas;
    int cores[KILN_SERVE_MAX_REPLICAS];
    bool has_refusal;
    kiln_serve_refusal_info_t refusal;  /* the last one */
    uint64_t refusals;              /* how many, all reasons */
} kiln_serve_model_status_t;

/* Fill `st` for model `name` (KILN_ENOTFOUND when there is none); release
 * it with kiln_serve_model_status_release. */
int kiln_serve_repo_status (kiln_serve_repo_t *self, const char *name,
                            kiln_serve_model_status_t *st, kiln_err_t *err);
void kiln_serve_model_status_release (kiln_serve_model_status_t *st);

/* The names of the models found so far, sorted, into names[max]; returns
 * how many. */
int kiln_serve_repo_models (kiln_serve_repo_t *self,
                            char (*names)[KILN_MAX_MODEL_NAME + 1], int max);

#endif
