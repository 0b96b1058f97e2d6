/*
 * kiln_client — libkilnclient: compile kiln graphs on the farm or
 * locally and get signed artifacts.
 *
 * kiln_client_compile talks to a kiln-broker (docs/protocol.md): it sends
 * the graph structure with the blob list (small blobs inline), uploads
 * the blobs the broker says it lacks in 1 MiB chunks under the broker's
 * credit, waits for the signed artifact and writes it to a file.
 * kiln_client_compile_batch does the same for many graphs at once over
 * one connection.  kiln_compile_local compiles in-process with the
 * builtin compiler, signing with the user's own key.  kiln_client_get
 * fetches a stored artifact by its content hash, in chunks, checking it
 * before it appears at its path; kiln_client_pin keeps one from the
 * store's eviction.
 *
 * While it waits, the client heartbeats the broker (Paranoid Pirate): a
 * broker silent for a few heartbeats is considered lost, the connection
 * is opened again and every request that was not answered is sent again
 * by its action key; the broker's heartbeat says how many requests it
 * holds for this client, so requests lost in a broker restart are sent
 * again too.  So a client waiting when the broker died gets its artifact
 * once the broker is back.  A call that gives up (wait_ms, an interrupt)
 * cancels its requests on the farm.
 *
 * Identity: with CurveZMQ (`cert` and `broker_cert`, or $KILN_CERT and
 * $KILN_BROKER_CERT) the broker knows the client by its certificate;
 * without, by the name it gives ($KILN_CLIENT_NAME, else user@host).  Fair
 * share is per identity.
 */
#ifndef KILN_CLIENT_H
#define KILN_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kiln_error.h"
#include "common/kiln_hash.h"
#include "graph/kiln_graph.h"

typedef struct kiln_client kiln_client_t;

/* Options of one compilation.  Zero is the default of every field, so
 * `kiln_compile_opts_t opts = { .timeout_ms = 5000 };` is complete.
 * (Fields were added after compiler_args and timeout_ms: bindings that
 * mirror this struct must declare them all.) */
typedef struct kiln_compile_opts {
    const char *compiler_args;   /* raw argument string, may be NULL */
    int timeout_ms;              /* compile timeout on the farm: a compile that runs
                                    longer is killed and the call fails with
                                    KILN_ETIMEOUT; 0 = the farm's default (600 s) */
    int wait_ms;                 /* longest the call waits in all (queue, upload,
                                    compile); then it cancels and fails with
                                    KILN_ETIMEOUT.  0 = no limit while the broker
                                    answers */
    int priority;                /* -1000..1000; lower runs sooner, like nice(1) */
    bool retry_failed;           /* build again even if this action failed before */
    const char *toolchain;       /* "ID" or "ID@VERSION" (version "0" when left out);
                                    NULL = the builtin compiler */
    const char *target;          /* NULL = this host's (e.g. cpu-x86_64) */
} kiln_compile_opts_t;

typedef struct kiln_compile_result {
    char artifact[KILN_HEX_LEN];     /* content hash (SHA-256 of manifest) */
    char action_key[KILN_HEX_LEN];
    char graph_digest[KILN_HEX_LEN];
    bool cached;                     /* served from the action cache */
    char worker[128];                /* who built it; "" when cached or local */
    char signer[17];                 /* local builds: the key id that signed it */
    uint64_t received_bytes;         /* artifact bytes fetched in PARTs (a large one) */
    uint64_t reused_bytes;           /* of its bytes, taken from the member cache */
} kiln_compile_result_t;

/* How to reach the broker.  Zero fields take the defaults. */
typedef struct kiln_client_config {
    const char *endpoint;        /* "tcp://host:port" */
    const char *name;            /* fair-share name without CurveZMQ; NULL =
                                    $KILN_CLIENT_NAME, else user@host */
    const char *cert;            /* CurveZMQ: our certificate; NULL = $KILN_CERT */
    const char *broker_cert;     /* CurveZMQ: the broker's; NULL = $KILN_BROKER_CERT */
    int heartbeat_ms;            /* 0 = 1000 */
    int liveness_ms;             /* broker silent this long: reconnect and resend;
                                    0 = 5000 */
    int broker_timeout_ms;       /* broker silent this long: give up; 0 = 60000 */
} kiln_client_config_t;

/* Connect to the broker at `endpoint` ("tcp://host:port"), with the
 * defaults and the environment above.  Caller owns the client. */
kiln_client_t *kiln_client_new (const char *endpoint, kiln_err_t *err);
kiln_client_t *kiln_client_new_config (const kiln_client_config_t *cfg, kiln_err_t *err);
/* Tell the broker we leave (it releases anything still held for us) and
 * free the client; *self_p becomes NULL. */
void kiln_client_destroy (kiln_client_t **self_p);

/* Compile `g` (with all weight data) on the farm and write the signed
 * artifact atomically to `out_path`.  Errors from the farm (a compile
 * error with its log, a timeout, a refusal) come back with their code
 * and message.  Blocks; SIGINT (zsys_interrupted) cancels. */
int kiln_client_compile (kiln_client_t *self, const kiln_graph_t *g,
                         const kiln_compile_opts_t *opts, const char *out_path,
                         kiln_compile_result_t *res, kiln_err_t *err);

/* One compilation of a batch. */
typedef struct kiln_client_job {
    const kiln_graph_t *graph;       /* in: with all its weight data */
    const char *out_path;            /* in: where the artifact goes; NULL = not written */
    kiln_compile_opts_t opts;        /* in (its wait_ms is not used) */
    kiln_compile_result_t result;    /* out */
    kiln_err_t err;                  /* out: code 0 when it succeeded */
    bool failure_cached;             /* out: the error is a cached failure */
} kiln_client_job_t;

/* Called once per job as it finishes (err.code tells how). */
typedef void (kiln_client_done_fn) (kiln_client_job_t *job, size_t index, void *arg);

/* Compile n graphs concurrently over this client's connection; `done`
 * (may be NULL) is called as each finishes.  `wait_ms` bounds the whole
 * call (0 = no limit while the broker answers); what is left then is
 * cancelled and fails with KILN_ETIMEOUT.  Returns 0 when every job was
 * attempted (see each job's err), or an error that stopped them all (the
 * broker was lost for broker_timeout_ms, an interrupt). */
int kiln_client_compile_batch (kiln_client_t *self, kiln_client_job_t *jobs, size_t n,
                               int wait_ms, kiln_client_done_fn *done, void *arg,
                               kiln_err_t *err);

/* Make sure the broker holds every weight blob of `g`: ask which it lacks
 * (FIND) and upload those.  Returns when the broker has stored and checked
 * them all; *sent (may be NULL) gets the bytes sent.  What it uploads
 * stays in the broker's store like any blob (a later compile of `g` sends
 * none of them). */
int kiln_client_upload (kiln_client_t *self, const kiln_graph_t *g, int wait_ms,
                        uint64_t *sent, kiln_err_t *err);

/* The broker's state as JSON (docs/operations.md, "kiln status").  Caller
 * frees *json. */
int kiln_client_status (kiln_client_t *self, int wait_ms, char **json, kiln_err_t *err);

/* What kiln_client_get fetched. */
typedef struct kiln_get_result {
    uint64_t bytes;                  /* the archive's size */
    char sha256[KILN_HEX_LEN];       /* SHA-256 of the archive file (not its content
                                        hash, which is the manifest's); "" when
                                        members came from the member cache (not
                                        taken: every member was checked instead) */
    uint64_t received_bytes;         /* artifact bytes that came over the wire (all
                                        attempts) */
    uint64_t reused_bytes;           /* bytes taken from the member cache instead */
    bool refetched;                  /* a cached member did not check: fetched again
                                        without the cache */
} kiln_get_result_t;

/* Fetch the artifact whose content hash is `digest_hex` (64 lower-case
 * hex characters) from the farm's store and write it to `out_path`.  It
 * arrives in chunks under flow control into a temporary file beside
 * `out_path`, hashed as it comes; it is renamed into place only when the
 * file hashes to what the broker sent, opens as an archive whose every
 * member matches its manifest (kiln_artifact_read), has that content
 * hash, and, when `keyring_dir` is not NULL, is signed by a key in it.
 * Nothing is left at `out_path` or beside it on failure.  Errors:
 * KILN_ENOTFOUND "the farm at EP holds no artifact D"; KILN_EVERIFY when
 * what arrived is not that artifact; KILN_ETIMEOUT after `wait_ms` (0: as
 * long as the broker answers) or when the broker is silent for
 * broker_timeout_ms.  Blocks; SIGINT (zsys_interrupted) cancels.  `res`
 * may be NULL.  Members the user's member cache holds
 * (client/kiln_member_cache.h) are asked for by digest and copied from
 * it into place, hashed with the rest; a cached member that does not
 * check is dropped and the artifact fetched again without the cache.
 * Large members of a fetched artifact are kept there. */
int kiln_client_get (kiln_client_t *self, const char *digest_hex, const char *out_path,
                     const char *keyring_dir, int wait_ms, kiln_get_result_t *res,
                     kiln_err_t *err);

/* Ask the broker for the farm's public signing key (kiln trust): *pem
 * gets its PEM text (caller frees), key_id the id the broker gives it,
 * curve_public the broker's CurveZMQ public key (Z85) or "".  Nothing
 * here is trusted yet: the caller checks the id against the key and
 * shows the fingerprint. */
int kiln_client_farm_key (kiln_client_t *self, int wait_ms, char **pem, char key_id[17],
                          char curve_public[41], kiln_err_t *err);

/* Pin (`pin` true) or unpin the artifact `digest_hex` in the farm's
 * store: a pinned artifact is never evicted (docs/operations.md,
 * "Pinning").  *changed (may be NULL) says whether the pin changed: pin
 * and unpin are idempotent.  KILN_ENOTFOUND when pinning an artifact the
 * farm does not hold. */
int kiln_client_pin (kiln_client_t *self, const char *digest_hex, bool pin, int wait_ms,
                     bool *changed, kiln_err_t *err);

/* What a running compile is doing, for a progress display
 * (client/kiln_progress.h draws one on a terminal). */
typedef enum {
    KILN_PHASE_UPLOAD,           /* weights going to the broker: sent_bytes of total_bytes */
    KILN_PHASE_QUEUED,           /* waiting for a worker: position in our queue (0: not
                                    known yet) */
    KILN_PHASE_RUNNING,          /* on `worker` for elapsed_ms */
    KILN_PHASE_DONE,             /* finished (job->err tells how; `done` is called too) */
    KILN_PHASE_DOWNLOAD,         /* a large artifact coming apart (kiln_client_get):
                                    sent_bytes of total_bytes received */
} kiln_phase_t;

typedef struct kiln_progress_event {
    size_t index;                /* the job in the batch (SIZE_MAX: the upload of all) */
    kiln_phase_t phase;
    uint64_t sent_bytes, total_bytes;   /* UPLOAD: this call's blob bytes; DOWNLOAD: the
                                           artifact's bytes received, and its size */
    uint64_t reused_bytes;       /* DOWNLOAD: of sent_bytes, taken from the member cache */
    uint64_t position;           /* QUEUED */
    uint64_t queued, running;    /* QUEUED, RUNNING: all our jobs on the farm */
    const char *worker;          /* RUNNING: who builds it (the event's, not to keep) */
    uint64_t elapsed_ms;         /* QUEUED, RUNNING: in that state so far */
    uint64_t estimate_ms;        /* the build time the farm expects; 0: no idea */
    uint64_t eta_ms;             /* time left the farm expects; 0: no idea */
} kiln_progress_event_t;

typedef void (kiln_progress_fn) (const kiln_progress_event_t *ev, void *arg);

/* Report progress of this client's compiles to `fn` (NULL: stop), and
 * ask the broker where its jobs are (WHERE) every `interval_ms` (0 =
 * 1000) while they wait. */
void kiln_client_set_progress (kiln_client_t *self, kiln_progress_fn *fn, void *arg,
                               int interval_ms);

/* For programs (not libraries): make SIGINT and SIGTERM cancel a running
 * call (it sends CANCEL for its requests and fails with KILN_ECANCELED)
 * instead of killing the process. */
void kiln_client_catch_signals (void);

/* What the client did on the wire, for tests and benchmarks. */
typedef struct kiln_client_stats {
    uint64_t requests;           /* COMPILE messages sent, resends included */
    uint64_t resent;             /* requests sent again after a lost broker */
    uint64_t duplicates;         /* answers for requests already answered (ignored) */
    uint64_t uploaded_bytes;     /* blob bytes sent as CHUNKs */
    uint64_t uploaded_blobs;     /* blobs the broker confirmed */
    uint64_t inline_bytes;       /* blob bytes sent inside COMPILE */
    uint64_t reconnects;         /* sockets opened again */
    uint64_t downloaded_bytes;   /* artifact bytes received in PARTs (kiln_client_get) */
    uint64_t reused_bytes;       /* artifact bytes taken from the member cache instead */
} kiln_client_stats_t;
void kiln_client_stats (const kiln_client_t *self, kiln_client_stats_t *out);

/* Compile `g` in-process and sign with the private key at `key_path`
 * (NULL: the user's key in kiln_config_dir()/keys, created on first
 * use).  Writes the artifact atomically to `out_path`. */
int kiln_compile_local (kiln_graph_t *g, const kiln_compile_opts_t *opts,
                        const char *key_path, const char *out_path,
                        kiln_compile_result_t *res, kiln_err_t *err);
/* The same for a build that falls back to this host because the farm at
 * `fallback_from` could not be reached: its provenance says so
 * ("fallback": true, "unreachable_broker": fallback_from). */
int kiln_compile_local_fallback (kiln_graph_t *g, const kiln_compile_opts_t *opts,
                                 const char *key_path, const char *out_path,
                                 const char *fallback_from, kiln_compile_result_t *res,
                                 kiln_err_t *err);

/* The user's keyring: kiln_config_dir()/keyring, written into buf.  It
 * holds the user's own public key (added when kiln makes or uses it) and
 * the farms `kiln trust` pinned. */
int kiln_user_keyring (char *buf, size_t size, kiln_err_t *err);

/* Write `key`'s public half into keyring `dir` as NAME.pub (atomic,
 * 0644), creating the directory. */
struct kiln_key;
int kiln_keyring_add (const char *dir, const struct kiln_key *key, const char *name,
                      kiln_err_t *err);

/* Ask the broker whether it is there (PING, answered by PONG) within
 * wait_ms: 0, or KILN_EUNREACHABLE "no answer from the broker at EP
 * within S s" (or why the handshake was refused). */
int kiln_client_ping (kiln_client_t *self, int wait_ms, kiln_err_t *err);

#endif
