/*
 * kiln_broker_xcheck — workers are not trusted with the truth of an
 * artifact: the reproducibility cross-check.
 *
 * kiln's compilers are deterministic: the same action gives the same
 * artifact, whose content hash (the SHA-256 of manifest.json, which binds
 * every payload member by its own SHA-256) does not depend on who built
 * it.  So the broker has a second, different worker build the same action
 * and signs and caches the result only when both content hashes are
 * equal.  A failure is treated alike: it is cached only when a second
 * worker reports the same failure (code, message and log).
 *
 *   builds  event                                   what happens
 *   0       first result, a check is wanted          recorded; requeued for a
 *           (policy, and another worker can check)   worker that did not build it
 *   0       first result, no check                   accepted (provenance says why
 *                                                    it was not checked)
 *   1       the check agrees                         accepted: signed, cached
 *   1       both failed, in different words          the failure is reported, not cached
 *   1       the check disagrees, a third worker      recorded; requeued for a worker
 *           can build it                             that built neither
 *   1       ... no third worker                      the job fails naming both
 *                                                    workers; nothing signed or cached
 *   2       the third agrees with one of them        the other is quarantined; the
 *                                                    majority's result goes to the
 *                                                    waiting clients, not to a cache
 *   2       the third agrees with neither            the job fails naming all three
 *
 * "Another worker can check" means a connected worker, not quarantined,
 * offering the job's toolchain, that has not built it yet.  A queued job
 * waiting for a check that no such worker is left to give is built again
 * from the start (broker_xcheck_sweep), or, waiting for a third build,
 * fails.  A quarantined worker stays connected but gets no more jobs, by
 * name, for the broker's life (kiln status shows it and why).  Failures
 * that are not a property of the job (timeouts, signals, limits: anything
 * but ECOMPILE) are never cached and never cross-checked.
 */
#include "broker/kiln_broker_priv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include <czmq.h>
#include <jansson.h>

#include "common/kiln_fs.h"
#include "common/kiln_log.h"

#define BROKER_XCHECK_NEW_DEFAULT 20         /* new-workers: confirmed builds to be trusted */
#define BROKER_XCHECK_MAX_N       1000000    /* bound on N of sample:N and new-workers:N */

/* --- the policy --------------------------------------------------------------- */

int
kiln_broker_parse_cross_check (const char *text, kiln_broker_config_t *cfg, kiln_err_t *err)
{
    long long n = 0;
    if (strcmp (text, "always") == 0)
        cfg->cross_check = KILN_XCHECK_ALWAYS;
    else if (strcmp (text, "off") == 0)
        cfg->cross_check = KILN_XCHECK_OFF;
    else if (strcmp (text, "new-workers") == 0) {
        cfg->cross_check = KILN_XCHECK_NEW_WORKERS;
        n = BROKER_XCHECK_NEW_DEFAULT;
    }
    else if (strncmp (text, "new-workers:", 12) == 0
             && (n = kiln_parse_number (text + 12, 1, BROKER_XCHECK_MAX_N)) > 0)
        cfg->cross_check = KILN_XCHECK_NEW_WORKERS;
    else if (strncmp (text, "sample:", 7) == 0
             && (n = kiln_parse_number (text + 7, 1, BROKER_XCHECK_MAX_N)) > 0)
        cfg->cross_check = KILN_XCHECK_SAMPLE;
    else
        return kiln_error (err, KILN_EINVAL, "--cross-check '%s': expected always, "
                           "new-workers[:N], sample:N or off (N 1..%d)", text,
                           BROKER_XCHECK_MAX_N);
    cfg->cross_check_n = (int) n;
    return 0;
}

const char *
broker_xcheck_policy (const kiln_broker_t *self, char *buf, size_t size)
{
    switch (self->cfg.cross_check) {
    case KILN_XCHECK_OFF: return "off";
    case KILN_XCHECK_SAMPLE:
        snprintf (buf, size, "sample:%d", self->cfg.cross_check_n);
        return buf;
    case KILN_XCHECK_NEW_WORKERS:
        snprintf (buf, size, "new-workers:%d", self->cfg.cross_check_n);
        return buf;
    default: return "always";
    }
}

int
broker_xcheck_init (kiln_broker_t *self)
{
    if (self->cfg.cross_check == KILN_XCHECK_NEW_WORKERS && self->cfg.cross_check_n <= 0)
        self->cfg.cross_check_n = BROKER_XCHECK_NEW_DEFAULT;
    if (self->cfg.cross_check == KILN_XCHECK_SAMPLE && self->cfg.cross_check_n <= 0)
        self->cfg.cross_check_n = 1;
    self->quarantine = zhashx_new ();
    self->confirmed = zhashx_new ();
    if (!self->quarantine || !self->confirmed)
        return -1;
    zhashx_set_destructor (self->quarantine, (zhashx_destructor_fn *) zstr_free);
    return 0;
}

void
broker_xcheck_release (kiln_broker_t *self)
{
    zhashx_destroy (&self->quarantine);
    zhashx_destroy (&self->confirmed);
}

/* --- who may build ------------------------------------------------------------- */

bool
broker_xcheck_quarantined (const kiln_broker_t *self, const char *name)
{
    return self->quarantine && zhashx_lookup (self->quarantine, name) != NULL;
}

static bool
s_built (const broker_job_t *job, const char *name)
{
    for (int i = 0; i < job->n_builds; i++)
        if (strcmp (job->builds[i].worker, name) == 0)
            return true;
    return false;
}

bool
broker_xcheck_may_run (const kiln_broker_t *self, const broker_job_t *job,
                       const broker_worker_t *w)
{
    return !broker_xcheck_quarantined (self, w->name) && !s_built (job, w->name);
}

/* A connected worker other than `w` that could build `job` next. */
static bool
s_other_worker (const kiln_broker_t *self, const broker_job_t *job, const broker_worker_t *w)
{
    for (broker_worker_t *o = zhashx_first (self->workers); o; o = zhashx_next (self->workers))
        if (o != w && (!w || strcmp (o->name, w->name) != 0)
            && broker_worker_may_build (self, job, o))
            return true;
    return false;
}

static uintptr_t
s_confirmed (const kiln_broker_t *self, const char *name)
{
    return (uintptr_t) zhashx_lookup (self->confirmed, name);
}

static void
s_confirm (kiln_broker_t *self, const char *name)
{
    if (zhashx_size (self->confirmed) >= BROKER_MAX_WORKERS * 4
        && !zhashx_lookup (self->confirmed, name))
        zhashx_purge (self->confirmed);          /* bounded: forget, which checks more */
    zhashx_update (self->confirmed, name, (void *) (s_confirmed (self, name) + 1));
}

/* True one time in n, drawn from the kernel's generator: a worker cannot
 * predict which of its builds are checked (random() unseeded would repeat
 * the same draws after every broker start). */
static bool
s_drawn (uint64_t n)
{
    uint64_t r = 0;
    if (getrandom (&r, sizeof r, 0) != (ssize_t) sizeof r)
        r = (uint64_t) random () ^ (uint64_t) zclock_mono ();
    return r % n == 0;
}

bool
broker_xcheck_wanted (kiln_broker_t *self, broker_job_t *job, const broker_worker_t *w)
{
    if (job->n_builds > 0)
        return true;                              /* it is itself a check */
    if (job->check == 0) {
        const char *why = NULL;
        switch (self->cfg.cross_check) {
        case KILN_XCHECK_OFF:
            why = "the farm's policy is --cross-check off";
            break;
        case KILN_XCHECK_SAMPLE:
            if (self->cfg.cross_check_n > 1 && !s_drawn ((uint64_t) self->cfg.cross_check_n))
                why = "not drawn in this farm's sample (--cross-check sample)";
            break;
        case KILN_XCHECK_NEW_WORKERS:
            if (s_confirmed (self, w->name) >= (uintptr_t) self->cfg.cross_check_n)
                why = "its builder has had enough builds confirmed (--cross-check new-workers)";
            break;
        default:
            break;
        }
        if (!why && !s_other_worker (self, job, w))
            why = "no other connected worker can build it (its toolchain, memory)";
        job->check = why ? -1 : 1;
        job->unchecked = why;
    }
    return job->check > 0;
}

/* --- results ------------------------------------------------------------------- */

static bool
s_same (const broker_build_t *a, const broker_build_t *b)
{
    return a->code == b->code && strcmp (a->digest, b->digest) == 0;
}

const char *
broker_xcheck_confirmer (const broker_job_t *job)
{
    for (int i = 0; i + 1 < job->n_builds; i++)
        if (s_same (&job->builds[i], &job->builds[job->n_builds - 1]))
            return job->builds[i].worker;
    return NULL;
}

/* What a build gave, for messages: "artifact 1a2b3c4d5e6f" or "failure
 * ECOMPILE 1a2b3c4d5e6f" (the hash of its code, message and log). */
static const char *
s_what (const broker_build_t *b, char *buf, size_t size)
{
    if (b->code == 0)
        snprintf (buf, size, "artifact %.*s", BROKER_KEY_SHORT, b->digest);
    else
        snprintf (buf, size, "failure %s (%.*s)", kiln_strerror (b->code), BROKER_KEY_SHORT,
                  b->digest);
    return buf;
}

/* The job's builds disagree and nobody can decide: fail it, naming them. */
static void
s_fail_disagreement (kiln_broker_t *self, broker_job_t *job)
{
    char message[KILN_ERR_MSG_MAX], what[3][64];
    const broker_build_t *b = job->builds;
    if (job->n_builds >= 3)
        broker_fmt (message, sizeof message, "cross-check failed: workers %s, %s and %s built "
                    "three different results for action %.*s (%s, %s, %s); nothing was "
                    "signed or cached", b[0].worker, b[1].worker, b[2].worker,
                    BROKER_KEY_SHORT, job->action_key, s_what (&b[0], what[0], 64),
                    s_what (&b[1], what[1], 64), s_what (&b[2], what[2], 64));
    else
        broker_fmt (message, sizeof message, "cross-check failed: workers %s and %s built "
                    "different results for action %.*s (%s: %s; %s: %s) and no third worker "
                    "is connected to decide; nothing was signed or cached", b[0].worker,
                    b[1].worker, BROKER_KEY_SHORT, job->action_key, b[0].worker,
                    s_what (&b[0], what[0], 64), b[1].worker, s_what (&b[1], what[1], 64));
    char *log = broker_job_report_log (job, NULL);
    broker_job_fail (self, job, KILN_EVERIFY, message, log, false);
    free (log);
}

/* No more jobs for worker `name`; the jobs it runs go back to the queue. */
static void
s_quarantine (kiln_broker_t *self, const char *name, const char *why)
{
    char *text = strdup (why);
    if (!text)
        return;
    zhashx_update (self->quarantine, name, text);
    kiln_log_err ("worker %s quarantined: %s", name, why);
    zlistx_t *held = zlistx_new ();
    if (!held)
        return;
    for (broker_job_t *job = zhashx_first (self->jobs); job; job = zhashx_next (self->jobs))
        if (job->worker && strcmp (job->worker->name, name) == 0)
            zlistx_add_end (held, job);
    for (broker_job_t *job = zlistx_first (held); job; job = zlistx_next (held)) {
        kiln_msg_t *cancel = kiln_msg_new (KILN_CMD_CANCEL);
        if (cancel) {
            cancel->job_id = job->id;
            broker_send_now (self, job->worker->rid, &cancel, job->worker->name);
        }
        broker_job_requeue (self, job, "its worker was quarantined", false);
    }
    zlistx_destroy (&held);
}

broker_xcheck_t
broker_xcheck_result (kiln_broker_t *self, broker_job_t *job, broker_worker_t *w,
                      const char *digest, int code, const char *message, const char *log)
{
    if (!broker_xcheck_wanted (self, job, w)) {
        if (code != 0)
            self->stats.unchecked++;          /* an artifact counts when it is stored */
        return BROKER_XCHECK_ACCEPT;
    }
    if (job->n_builds >= BROKER_MAX_BUILDS) {     /* cannot happen: a third build decides */
        s_fail_disagreement (self, job);
        return BROKER_XCHECK_HANDLED;
    }
    broker_build_t *b = &job->builds[job->n_builds++];
    snprintf (b->worker, sizeof b->worker, "%s", w->name);
    b->code = code;
    if (code == 0)
        snprintf (b->digest, sizeof b->digest, "%s", digest);
    else {
        /* A failure is its code, message and log: what would be cached. */
        kiln_sha256_t *h = kiln_sha256_new ();
        uint8_t raw[KILN_DIGEST_LEN];
        char text[16];
        int n = snprintf (text, sizeof text, "%d", code);
        if (!h) {
            job->n_builds--;
            broker_job_fail (self, job, KILN_ENOMEM, "out of memory cross-checking a failure",
                             NULL, false);
            return BROKER_XCHECK_HANDLED;
        }
        kiln_sha256_update (h, text, (size_t) n + 1);
        kiln_sha256_update (h, message ? message : "", (message ? strlen (message) : 0) + 1);
        kiln_sha256_update (h, log ? log : "", log ? strlen (log) : 0);
        kiln_sha256_final (&h, raw);
        kiln_hex (raw, KILN_DIGEST_LEN, b->digest);
    }
    /* A completed build shows the job does not kill its workers: the
     * workers lost count from here (--max-deaths is per build). */
    job->deaths = 0;
    char what[64], reason[KILN_ERR_MSG_MAX];
    if (job->n_builds == 1) {
        broker_fmt (reason, sizeof reason, "built %s; another worker checks it",
                    s_what (b, what, sizeof what));
        broker_job_requeue (self, job, reason, false);
        return BROKER_XCHECK_HANDLED;
    }
    if (job->n_builds == 2) {
        self->stats.checked++;
        if (s_same (&job->builds[0], b)) {
            self->stats.agreed++;
            s_confirm (self, job->builds[0].worker);
            s_confirm (self, b->worker);
            kiln_log_info ("job %llu action %.*s: workers %s and %s agree on %s",
                           (unsigned long long) job->id, BROKER_KEY_SHORT, job->action_key,
                           job->builds[0].worker, b->worker, s_what (b, what, sizeof what));
            return BROKER_XCHECK_ACCEPT;
        }
        job->disputed = true;
        char first[64];
        if (b->code != 0 && job->builds[0].code != 0) {
            /* Both failed, in different words (a path or a time in the
             * log): no artifact is at stake, so the client gets this
             * failure as it is; a failure in dispute is never cached. */
            kiln_log_notice ("job %llu action %.*s: workers %s and %s both failed, with "
                             "different messages or logs: not cached",
                             (unsigned long long) job->id, BROKER_KEY_SHORT, job->action_key,
                             job->builds[0].worker, b->worker);
            return BROKER_XCHECK_ACCEPT;
        }
        self->stats.disagreed++;
        kiln_log_err ("job %llu action %.*s: cross-check failed: worker %s built %s, worker %s "
                      "built %s", (unsigned long long) job->id, BROKER_KEY_SHORT,
                      job->action_key, job->builds[0].worker,
                      s_what (&job->builds[0], first, sizeof first), b->worker,
                      s_what (b, what, sizeof what));
        if (s_other_worker (self, job, w)) {
            broker_fmt (reason, sizeof reason, "built %s, but worker %s built %s; a third "
                        "worker decides", s_what (b, what, sizeof what), job->builds[0].worker,
                        s_what (&job->builds[0], first, sizeof first));
            broker_job_requeue (self, job, reason, false);
            return BROKER_XCHECK_HANDLED;
        }
        s_fail_disagreement (self, job);
        return BROKER_XCHECK_HANDLED;
    }
    /* The third build decides between the first two. */
    int agree = s_same (&job->builds[0], b) ? 0 : s_same (&job->builds[1], b) ? 1 : -1;
    if (agree < 0) {
        s_fail_disagreement (self, job);
        return BROKER_XCHECK_HANDLED;
    }
    const broker_build_t *odd = &job->builds[1 - agree];
    char why[KILN_ERR_MSG_MAX], theirs[64];
    broker_fmt (why, sizeof why, "for action %.*s it built %s, where workers %s and %s both "
                "built %s", BROKER_KEY_SHORT, job->action_key, s_what (odd, theirs, sizeof theirs),
                job->builds[agree].worker, b->worker, s_what (b, what, sizeof what));
    s_quarantine (self, odd->worker, why);
    return BROKER_XCHECK_ACCEPT;
}

void
broker_xcheck_sweep (kiln_broker_t *self)
{
    zlistx_t *stranded = NULL;
    for (broker_job_t *job = zhashx_first (self->jobs); job; job = zhashx_next (self->jobs))
        if (job->state == BROKER_JOB_QUEUED && job->n_builds > 0
            && !s_other_worker (self, job, NULL)) {
            if (!stranded && !(stranded = zlistx_new ()))
                return;
            zlistx_add_end (stranded, job);
        }
    if (!stranded)
        return;
    for (broker_job_t *job = zlistx_first (stranded); job; job = zlistx_next (stranded)) {
        if (job->n_builds >= 2) {
            s_fail_disagreement (self, job);
            continue;
        }
        broker_job_note (job, "no worker that could check the build of %s is connected any "
                         "more: built again", job->builds[0].worker);
        kiln_log_notice ("job %llu action %.*s: no worker left to check the build of %s; "
                         "building it again", (unsigned long long) job->id, BROKER_KEY_SHORT,
                         job->action_key, job->builds[0].worker);
        job->n_builds = 0;
        job->check = 0;
        job->unchecked = NULL;
    }
    zlistx_destroy (&stranded);
}

/* --- provenance ---------------------------------------------------------------- */

void
broker_xcheck_provenance (kiln_broker_t *self, const broker_job_t *job,
                          const broker_worker_t *w, void *obj_)
{
    json_t *obj = obj_;
    char policy[32];
    json_t *checked = json_array (), *odd = json_array ();
    const char *builder = w->name;
    const char *result;
    if (job->n_builds == 0)
        result = job->unchecked ? job->unchecked : "not checked";
    else {
        /* The builds that agree with the last, the one being signed. */
        const broker_build_t *last = &job->builds[job->n_builds - 1];
        builder = NULL;
        for (int i = 0; i < job->n_builds; i++) {
            const broker_build_t *b = &job->builds[i];
            if (!s_same (b, last))
                json_array_append_new (odd, json_string (b->worker));
            else if (!builder)
                builder = b->worker;
            else
                json_array_append_new (checked, json_string (b->worker));
        }
        result = job->n_builds == 2 ? "agreed" : "2 of 3 agreed";
    }
    json_object_set_new (obj, "builder", json_string (builder ? builder : w->name));
    json_object_set_new (obj, "checked_by", checked ? checked : json_array ());
    json_object_set_new (obj, "cross_check", json_pack ("{s:s, s:b, s:s}", "policy",
                                                         broker_xcheck_policy (self, policy,
                                                                               sizeof policy),
                                                         "checked", job->n_builds >= 2,
                                                         "result", result));
    if (odd && json_array_size (odd) > 0)
        json_object_set_new (obj, "disagreed", odd);
    else
        json_decref (odd);
}
