#include "serve/kiln_serve_repo.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "common/kiln_log.h"

#define S_RELEASE_FILE "release.json"

struct kiln_serve_version {
    _Atomic int refs;               /* the repository's while current, plus requests' */
    char model[KILN_MAX_MODEL_NAME + 1];
    kiln_release_t record;          /* under the repository's lock once shared */
    _Atomic uint64_t seq;           /* record.seq, for readers without the lock */
    int64_t loaded_at;              /* when swapped in */
    kiln_model_t *replicas[KILN_SERVE_MAX_REPLICAS];
    int n_replicas;
    kiln_serve_iface_t iface;       /* read from replica 0 */
    kiln_serve_batch_t *batch;      /* its workers run the replicas */
    kiln_serve_model_metrics_t *mm; /* the model's slot, owned by the metrics */
};

typedef struct {
    char name[KILN_MAX_MODEL_NAME + 1];
    kiln_serve_version_t *current;  /* serving, NULL when none; one reference */
    bool has_refusal;
    kiln_serve_refusal_info_t refusal;  /* the last one */
    uint64_t refusals;              /* all of them */
    kiln_serve_model_metrics_t *mm; /* owned by the metrics */
} s_model_t;

struct kiln_serve_repo {
    kiln_serve_repo_config_t cfg;   /* strings point into the copies below */
    char *repo_dir, *keyring_dir, *release_keyring_dir, *state_dir, *target;
    kiln_rt_t *rt;                  /* borrowed */
    kiln_serve_metrics_t *metrics;  /* borrowed */
    pthread_mutex_t load_lock;      /* one scan or load at a time */
    pthread_mutex_t lock;           /* models, n_models, each model's fields,
                                       versions' records, scanned */
    s_model_t *models[KILN_SERVE_MAX_MODELS];
    int n_models;
    bool scanned;
};

/* --- versions --------------------------------------------------------- */

static void
s_version_free (kiln_serve_version_t *v)
{
    /* Every request holding the version is done (it held a reference),
     * so the batcher's queue is empty: destroying it only joins. */
    kiln_serve_batch_destroy (&v->batch);
    for (int r = 0; r < v->n_replicas; r++)
        kiln_model_destroy (&v->replicas[r]);
    kiln_serve_iface_release (&v->iface);
    free (v);
}

void
kiln_serve_version_put (kiln_serve_version_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_serve_version_t *v = *self_p;
    *self_p = NULL;
    if (atomic_fetch_sub (&v->refs, 1) == 1) {
        if (v->loaded_at)
            kiln_log_info ("model '%s': unloaded release seq %llu (artifact %s)", v->model,
                           (unsigned long long) v->record.seq, v->record.artifact);
        s_version_free (v);
    }
}

const kiln_serve_iface_t *
kiln_serve_version_iface (const kiln_serve_version_t *v)
{
    return &v->iface;
}

kiln_serve_batch_t *
kiln_serve_version_batch (kiln_serve_version_t *v)
{
    return v->batch;
}

kiln_serve_model_metrics_t *
kiln_serve_version_metrics (kiln_serve_version_t *v)
{
    return v->mm;
}

const char *
kiln_serve_version_model (const kiln_serve_version_t *v)
{
    return v->model;
}

uint64_t
kiln_serve_version_seq (kiln_serve_version_t *v)
{
    return atomic_load (&v->seq);
}

/* --- the repository --------------------------------------------------- */

static char *
s_dup (const char *s)
{
    return s ? strdup (s) : NULL;
}

kiln_serve_repo_t *
kiln_serve_repo_new (const kiln_serve_repo_config_t *cfg, kiln_rt_t *rt,
                     kiln_serve_metrics_t *metrics, kiln_err_t *err)
{
    if (!cfg || !cfg->repo_dir || !cfg->keyring_dir || !cfg->release_keyring_dir
        || !cfg->state_dir || !cfg->target || !rt) {
        kiln_error (err, KILN_EINVAL, "a repository needs a directory, two keyrings, a "
                    "state directory, a target and a runtime");
        return NULL;
    }
    if (cfg->replicas < 1 || cfg->replicas > KILN_SERVE_MAX_REPLICAS || cfg->max_queue < 1
        || cfg->max_batch < 0 || cfg->max_batch > KILN_SERVE_MAX_BATCH
        || cfg->batch_delay_us < 0) {
        kiln_error (err, KILN_EINVAL, "replicas 1..%d, a queue of at least 1 and a batch "
                    "of 0..%d", KILN_SERVE_MAX_REPLICAS, KILN_SERVE_MAX_BATCH);
        return NULL;
    }
    kiln_serve_repo_t *self = calloc (1, sizeof *self);
    if (!self) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    self->cfg = *cfg;
    self->cfg.repo_dir = self->repo_dir = s_dup (cfg->repo_dir);
    self->cfg.keyring_dir = self->keyring_dir = s_dup (cfg->keyring_dir);
    self->cfg.release_keyring_dir = self->release_keyring_dir = s_dup (cfg->release_keyring_dir);
    self->cfg.state_dir = self->state_dir = s_dup (cfg->state_dir);
    self->cfg.target = self->target = s_dup (cfg->target);
    self->rt = rt;
    self->metrics = metrics;
    pthread_mutex_init (&self->load_lock, NULL);
    pthread_mutex_init (&self->lock, NULL);
    if (!self->repo_dir || !self->keyring_dir || !self->release_keyring_dir
        || !self->state_dir || !self->target) {
        kiln_serve_repo_destroy (&self);
        kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    return self;
}

void
kiln_serve_repo_destroy (kiln_serve_repo_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_serve_repo_t *self = *self_p;
    for (int i = 0; i < self->n_models; i++) {
        kiln_serve_version_put (&self->models[i]->current);
        free (self->models[i]);
    }
    pthread_mutex_destroy (&self->lock);
    pthread_mutex_destroy (&self->load_lock);
    free (self->repo_dir);
    free (self->keyring_dir);
    free (self->release_keyring_dir);
    free (self->state_dir);
    free (self->target);
    free (self);
    *self_p = NULL;
}

/* The model called `name`, under self->lock; NULL when there is none. */
static s_model_t *
s_find (kiln_serve_repo_t *self, const char *name)
{
    for (int i = 0; i < self->n_models; i++)
        if (strcmp (self->models[i]->name, name) == 0)
            return self->models[i];
    return NULL;
}

/* The model called `name`, added to the table when new. */
static s_model_t *
s_find_or_add (kiln_serve_repo_t *self, const char *name, kiln_err_t *err)
{
    pthread_mutex_lock (&self->lock);
    s_model_t *m = s_find (self, name);
    if (!m && self->n_models >= KILN_SERVE_MAX_MODELS)
        kiln_error (err, KILN_ELIMIT, "model '%s': the repository holds %d models already, "
                    "the most kiln-serve serves", name, KILN_SERVE_MAX_MODELS);
    else if (!m && !(m = calloc (1, sizeof *m)))
        kiln_error (err, KILN_ENOMEM, "out of memory");
    else if (!m->name[0]) {
        snprintf (m->name, sizeof m->name, "%s", name);
        m->mm = kiln_serve_metrics_model (self->metrics, name);
        self->models[self->n_models++] = m;
    }
    pthread_mutex_unlock (&self->lock);
    return m;
}

/* DIR/<model>/<file> into buf; false when it does not fit. */
static bool
s_path (const kiln_serve_repo_t *self, const char *model, const char *file,
        char buf[PATH_MAX])
{
    int n = snprintf (buf, PATH_MAX, "%s/%s/%s", self->repo_dir, model, file);
    return n > 0 && n < PATH_MAX;
}

static bool
s_is_file (const char *path)
{
    struct stat st;
    return stat (path, &st) == 0 && S_ISREG (st.st_mode);
}

/* Record a refusal of `rec` (NULL when it could not be read) for `m`:
 * kept for the metadata, counted, logged once.  Returns the error. */
static int
s_refuse (kiln_serve_repo_t *self, s_model_t *m, kiln_serve_refusal_t why,
          const kiln_release_t *rec, kiln_serve_refusal_t *why_out, kiln_err_t *err)
{
    if (!err->code)
        kiln_error (err, KILN_EVERIFY, "refused");
    kiln_serve_refusal_info_t info = { .reason = why, .at = (int64_t) time (NULL) };
    snprintf (info.message, sizeof info.message, "%s", err->msg);
    if (rec) {
        info.seq = rec->seq;
        snprintf (info.artifact, sizeof info.artifact, "%s", rec->artifact);
    }
    uint64_t serving = 0;
    pthread_mutex_lock (&self->lock);
    m->has_refusal = true;
    m->refusal = info;
    m->refusals++;
    if (m->current)
        serving = m->current->record.seq;
    pthread_mutex_unlock (&self->lock);
    kiln_serve_metrics_refusal (m->mm, why);
    char still[64];
    if (serving)
        snprintf (still, sizeof still, "still serving seq %llu", (unsigned long long) serving);
    else
        snprintf (still, sizeof still, "no version loaded");
    if (rec)
        kiln_log_warn ("model '%s': refused release seq %llu (artifact %s) [%s]: %s; %s",
                       m->name, (unsigned long long) rec->seq, rec->artifact,
                       kiln_serve_refusal_label (why), err->msg, still);
    else
        kiln_log_warn ("model '%s': refused its release [%s]: %s; %s", m->name,
                       kiln_serve_refusal_label (why), err->msg, still);
    if (why_out)
        *why_out = why;
    return -err->code;
}

/* Why kiln_rt_load_on refused an artifact. */
static kiln_serve_refusal_t
s_load_refusal (int code)
{
    switch (code) {
    case KILN_EVERIFY: case KILN_EFORMAT: case KILN_ELIMIT: case KILN_EIO:
    case KILN_ENOTFOUND:
        return KILN_SERVE_REFUSED_ARTIFACT;
    default:
        return KILN_SERVE_REFUSED_LOAD;
    }
}

/* Load `n` replicas of the artifact at `path`, check that each is what
 * `rec` names, warm them up and start their batcher.  On failure *why
 * says which check refused it. */
static kiln_serve_version_t *
s_version_load (kiln_serve_repo_t *self, s_model_t *m, const kiln_release_t *rec,
                const char *path, kiln_serve_refusal_t *why, double *warm_ms,
                kiln_err_t *err)
{
    kiln_serve_version_t *v = calloc (1, sizeof *v);
    if (!v) {
        *why = KILN_SERVE_REFUSED_LOAD;
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    atomic_init (&v->refs, 1);
    snprintf (v->model, sizeof v->model, "%s", m->name);
    v->record = *rec;
    atomic_init (&v->seq, rec->seq);
    v->mm = m->mm;
    for (int r = 0; r < self->cfg.replicas; r++) {
        /* Each replica is read and verified on its own, so each is
         * checked against the record: the file may change between two. */
        kiln_model_t *model = kiln_rt_load_on (self->rt, path, self->keyring_dir, -1, err);
        if (!model) {
            *why = s_load_refusal (err->code);
            goto fail;
        }
        v->replicas[v->n_replicas++] = model;
        char digest[KILN_HEX_LEN];
        if (kiln_model_digest (model, digest, err) != 0) {
            *why = KILN_SERVE_REFUSED_ARTIFACT;
            goto fail;
        }
        const kiln_manifest_t *man = kiln_model_manifest (model);
        if (strcmp (digest, rec->artifact) != 0) {
            *why = KILN_SERVE_REFUSED_ARTIFACT;
            kiln_error (err, KILN_EVERIFY, "artifact '%s' is %s, not the artifact %s that "
                        "release seq %llu names", path, digest, rec->artifact,
                        (unsigned long long) rec->seq);
            goto fail;
        }
        if (strcmp (man->target, rec->target) != 0 || man->runtime_abi != rec->runtime_abi) {
            *why = KILN_SERVE_REFUSED_ARTIFACT;
            kiln_error (err, KILN_EVERIFY, "artifact '%s' is for target '%s' ABI %d, "
                        "release seq %llu says '%s' ABI %d", path, man->target,
                        man->runtime_abi, (unsigned long long) rec->seq, rec->target,
                        rec->runtime_abi);
            goto fail;
        }
    }
    *why = KILN_SERVE_REFUSED_LOAD;
    if (kiln_serve_iface_init (&v->iface, v->replicas[0], self->cfg.max_batch, err) != 0
        || kiln_serve_batch_warm_up (v->replicas, v->n_replicas, &v->iface, warm_ms, err) != 0)
        goto fail;
    kiln_serve_batch_config_t bc = {
        .delay_us = self->cfg.batch_delay_us, .max_queue = self->cfg.max_queue,
        .model = m->name, .metrics = self->metrics, .model_metrics = m->mm,
    };
    if (!(v->batch = kiln_serve_batch_new (v->replicas, v->n_replicas, &v->iface, &bc, err)))
        goto fail;
    return v;
fail:
    s_version_free (v);
    return NULL;
}

/* Put `v` in place of model m's current version and drop the old one
 * (which unloads once its last request is done). */
static void
s_swap (kiln_serve_repo_t *self, s_model_t *m, kiln_serve_version_t *v, double warm_ms)
{
    v->loaded_at = (int64_t) time (NULL);
    pthread_mutex_lock (&self->lock);
    kiln_serve_version_t *old = m->current;
    m->current = v;
    pthread_mutex_unlock (&self->lock);
    kiln_serve_metrics_loaded (m->mm, v->record.artifact, v->record.seq, 1);
    char cores[256] = "";
    size_t used = 0;
    for (int r = 0; r < v->n_replicas && used < sizeof cores; r++)
        used += (size_t) snprintf (cores + used, sizeof cores - used, "%s%d", r ? "," : "",
                                   kiln_model_core (v->replicas[r]));
    char was[64] = "";
    if (old)
        snprintf (was, sizeof was, ", was seq %llu", (unsigned long long) old->record.seq);
    kiln_log_notice ("model '%s': serving release seq %llu (artifact %s) on cores %s, "
                     "warm-up %.1f ms%s", m->name, (unsigned long long) v->record.seq,
                     v->record.artifact, cores, warm_ms, was);
    kiln_serve_version_put (&old);
}

/* The checks of the header, in order, for model `m`; under load_lock. */
static int
s_load_locked (kiln_serve_repo_t *self, s_model_t *m, kiln_serve_refusal_t *why,
               kiln_err_t *err)
{
    char path[PATH_MAX];
    kiln_release_t rec;
    kiln_serve_refusal_t reason;
    if (!s_path (self, m->name, S_RELEASE_FILE, path)) {
        kiln_error (err, KILN_ELIMIT, "the path of model '%s''s release is too long", m->name);
        return s_refuse (self, m, KILN_SERVE_REFUSED_UNREADABLE, NULL, why, err);
    }
    /* The keyring is read for every load, so that adding or removing a
     * release key takes effect with the next SIGHUP. */
    kiln_keyring_t *ring = kiln_keyring_load (self->release_keyring_dir, err);
    if (!ring) {
        kiln_error_prefix (err, "release keyring");
        return s_refuse (self, m, KILN_SERVE_REFUSED_SIGNATURE, NULL, why, err);
    }
    int rc = kiln_release_read (path, ring, &rec, err);
    kiln_keyring_destroy (&ring);
    if (rc) {
        reason = err->code == KILN_EVERIFY ? KILN_SERVE_REFUSED_SIGNATURE
                 : err->code == KILN_EFORMAT || err->code == KILN_ELIMIT
                     ? KILN_SERVE_REFUSED_MALFORMED
                     : KILN_SERVE_REFUSED_UNREADABLE;
        return s_refuse (self, m, reason, NULL, why, err);
    }
    if (strcmp (rec.model, m->name) != 0) {
        kiln_error (err, KILN_EVERIFY, "'%s' is a release of model '%s', not of '%s'", path,
                    rec.model, m->name);
        return s_refuse (self, m, KILN_SERVE_REFUSED_MODEL, &rec, why, err);
    }

    /* Only loads change `current`, and this thread holds the load lock:
     * it may read the version without a reference. */
    pthread_mutex_lock (&self->lock);
    kiln_serve_version_t *cur = m->current;
    bool same_artifact = cur && strcmp (cur->record.artifact, rec.artifact) == 0;
    bool unchanged = same_artifact && cur->record.seq == rec.seq;
    if (unchanged && rec.expires_at > cur->record.expires_at)
        cur->record = rec;          /* re-signed with a later expiry */
    pthread_mutex_unlock (&self->lock);
    if (unchanged)
        return 0;

    if (kiln_release_check_expiry (&rec, (int64_t) time (NULL), err) != 0)
        return s_refuse (self, m, KILN_SERVE_REFUSED_EXPIRED, &rec, why, err);
    if (strcmp (rec.target, self->target) != 0) {
        kiln_error (err, KILN_EVERIFY, "release seq %llu of model '%s' is for target '%s', "
                    "this host is '%s'", (unsigned long long) rec.seq, rec.model, rec.target,
                    self->target);
        return s_refuse (self, m, KILN_SERVE_REFUSED_TARGET, &rec, why, err);
    }
    if (rec.runtime_abi != KILN_RUNTIME_ABI_VERSION) {
        kiln_error (err, KILN_EVERIFY, "release seq %llu of model '%s' needs runtime ABI %d, "
                    "this runtime provides %d", (unsigned long long) rec.seq, rec.model,
                    rec.runtime_abi, KILN_RUNTIME_ABI_VERSION);
        return s_refuse (self, m, KILN_SERVE_REFUSED_ABI, &rec, why, err);
    }
    if (kiln_release_check_newer (&rec, self->state_dir, err) != 0)
        return s_refuse (self, m, err->code == KILN_EVERIFY ? KILN_SERVE_REFUSED_ROLLBACK
                                                            : KILN_SERVE_REFUSED_STATE,
                         &rec, why, err);

    if (same_artifact) {
        /* A higher seq for the artifact already serving: nothing to load. */
        if (kiln_release_accept (&rec, self->state_dir, NULL, err) != 0)
            return s_refuse (self, m, err->code == KILN_EVERIFY ? KILN_SERVE_REFUSED_ROLLBACK
                                                                : KILN_SERVE_REFUSED_STATE,
                             &rec, why, err);
        pthread_mutex_lock (&self->lock);
        cur->record = rec;
        atomic_store (&cur->seq, rec.seq);
        pthread_mutex_unlock (&self->lock);
        kiln_serve_metrics_loaded (m->mm, rec.artifact, rec.seq, 0);
        kiln_log_notice ("model '%s': release seq %llu names the artifact already serving "
                         "(%s)", m->name, (unsigned long long) rec.seq, rec.artifact);
        return 0;
    }

    char file[KILN_HEX_LEN + 8];
    snprintf (file, sizeof file, "%s.kar", rec.artifact);
    if (!s_path (self, m->name, file, path) || !s_is_file (path)) {
        kiln_error (err, KILN_ENOTFOUND, "release seq %llu of model '%s' names artifact %s, "
                    "and '%s/%s/%s' is not there", (unsigned long long) rec.seq, rec.model,
                    rec.artifact, self->repo_dir, m->name, file);
        return s_refuse (self, m, KILN_SERVE_REFUSED_MISSING_ARTIFACT, &rec, why, err);
    }
    double warm_ms = 0;
    kiln_serve_version_t *v = s_version_load (self, m, &rec, path, &reason, &warm_ms, err);
    if (!v)
        return s_refuse (self, m, reason, &rec, why, err);
    if (kiln_release_accept (&rec, self->state_dir, NULL, err) != 0) {
        kiln_serve_version_put (&v);
        return s_refuse (self, m, err->code == KILN_EVERIFY ? KILN_SERVE_REFUSED_ROLLBACK
                                                            : KILN_SERVE_REFUSED_STATE,
                         &rec, why, err);
    }
    s_swap (self, m, v, warm_ms);
    return 0;
}

/* True when DIR/<name>/release.json exists for a valid model name. */
static bool
s_has_release (const kiln_serve_repo_t *self, const char *name)
{
    char path[PATH_MAX];
    return kiln_release_model_ok (name) && s_path (self, name, S_RELEASE_FILE, path)
           && s_is_file (path);
}

int
kiln_serve_repo_load (kiln_serve_repo_t *self, const char *name, kiln_serve_refusal_t *why,
                      kiln_err_t *err)
{
    if (!name || !s_has_release (self, name))
        return kiln_error (err, KILN_ENOTFOUND, "no model '%.80s' in repository '%s' (no "
                           "%s)", name ? name : "", self->repo_dir, S_RELEASE_FILE);
    pthread_mutex_lock (&self->load_lock);
    s_model_t *m = s_find_or_add (self, name, err);
    int rc = m ? s_load_locked (self, m, why, err) : -err->code;
    pthread_mutex_unlock (&self->load_lock);
    return rc;
}

int
kiln_serve_repo_unload (kiln_serve_repo_t *self, const char *name, kiln_err_t *err)
{
    pthread_mutex_lock (&self->load_lock);
    pthread_mutex_lock (&self->lock);
    s_model_t *m = name ? s_find (self, name) : NULL;
    kiln_serve_version_t *old = m ? m->current : NULL;
    if (m)
        m->current = NULL;
    pthread_mutex_unlock (&self->lock);
    if (m) {
        kiln_serve_metrics_loaded (m->mm, NULL, 0, 0);
        if (old)
            kiln_log_notice ("model '%s': unloaded on request (release seq %llu)", m->name,
                             (unsigned long long) old->record.seq);
    }
    pthread_mutex_unlock (&self->load_lock);
    kiln_serve_version_put (&old);
    if (!m)
        return kiln_error (err, KILN_ENOTFOUND, "unknown model '%.80s'", name ? name : "");
    return 0;
}

static int
s_cmp_names (const void *a, const void *b)
{
    return strcmp (a, b);
}

int
kiln_serve_repo_scan (kiln_serve_repo_t *self, kiln_err_t *err)
{
    DIR *dir = opendir (self->repo_dir);
    if (!dir)
        return kiln_error (err, KILN_EIO, "cannot read repository '%s': %s", self->repo_dir,
                           strerror (errno));
    char (*names)[KILN_MAX_MODEL_NAME + 1] = calloc (KILN_SERVE_MAX_MODELS, sizeof *names);
    if (!names) {
        closedir (dir);
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    int n = 0, entries = 0;
    struct dirent *e;
    while ((e = readdir (dir)) != NULL) {
        if (++entries > KILN_SERVE_MAX_REPO_ENTRIES) {
            kiln_log_warn ("repository '%s': more than %d entries, the rest are not read",
                           self->repo_dir, KILN_SERVE_MAX_REPO_ENTRIES);
            break;
        }
        if (!s_has_release (self, e->d_name))
            continue;
        if (n == KILN_SERVE_MAX_MODELS) {
            kiln_log_warn ("repository '%s': more than %d models, '%s' and later ones are "
                           "not served", self->repo_dir, KILN_SERVE_MAX_MODELS, e->d_name);
            break;
        }
        snprintf (names[n++], sizeof names[0], "%.64s", e->d_name);
    }
    closedir (dir);
    qsort (names, (size_t) n, sizeof names[0], s_cmp_names);

    pthread_mutex_lock (&self->load_lock);
    int loaded = 0, refused = 0;
    for (int i = 0; i < n; i++) {
        kiln_err_t e2 = { 0 };
        s_model_t *m = s_find_or_add (self, names[i], &e2);
        if (!m)
            kiln_log_err ("%s", e2.msg);
        else if (s_load_locked (self, m, NULL, &e2) == 0)
            loaded++;
        else
            refused++;
    }
    pthread_mutex_lock (&self->lock);
    self->scanned = true;
    pthread_mutex_unlock (&self->lock);
    pthread_mutex_unlock (&self->load_lock);
    kiln_log_info ("repository '%s': %d models, %d up to date, %d releases refused",
                   self->repo_dir, n, loaded, refused);
    free (names);
    return 0;
}

bool
kiln_serve_repo_ready (kiln_serve_repo_t *self)
{
    pthread_mutex_lock (&self->lock);
    bool ready = self->scanned;
    for (int i = 0; ready && i < self->n_models; i++)
        ready = self->models[i]->current != NULL;
    pthread_mutex_unlock (&self->lock);
    return ready;
}

kiln_serve_version_t *
kiln_serve_repo_get (kiln_serve_repo_t *self, const char *name, kiln_err_t *err)
{
    kiln_serve_version_t *v = NULL;
    bool known = false;
    pthread_mutex_lock (&self->lock);
    s_model_t *m = name ? s_find (self, name) : NULL;
    if (m) {
        known = true;
        if ((v = m->current) != NULL)
            atomic_fetch_add (&v->refs, 1);
    }
    pthread_mutex_unlock (&self->lock);
    if (!v && !known)
        kiln_error (err, KILN_ENOTFOUND, "unknown model '%.80s'", name ? name : "");
    else if (!v)
        kiln_error (err, KILN_EUNSUPPORTED, "model '%s' has no version loaded", name);
    return v;
}

int
kiln_serve_repo_status (kiln_serve_repo_t *self, const char *name,
                        kiln_serve_model_status_t *st, kiln_err_t *err)
{
    memset (st, 0, sizeof *st);
    pthread_mutex_lock (&self->lock);
    s_model_t *m = name ? s_find (self, name) : NULL;
    if (m) {
        snprintf (st->name, sizeof st->name, "%s", m->name);
        kiln_serve_version_t *v = m->current;
        if (v) {
            atomic_fetch_add (&v->refs, 1);
            st->version = v;
            st->record = v->record;
            st->loaded_at = v->loaded_at;
            st->n_replicas = v->n_replicas;
            for (int r = 0; r < v->n_replicas; r++)
                st->cores[r] = kiln_model_core (v->replicas[r]);
        }
        st->has_refusal = m->has_refusal;
        st->refusal = m->refusal;
        st->refusals = m->refusals;
    }
    pthread_mutex_unlock (&self->lock);
    if (!m)
        return kiln_error (err, KILN_ENOTFOUND, "unknown model '%.80s'", name ? name : "");
    return 0;
}

void
kiln_serve_model_status_release (kiln_serve_model_status_t *st)
{
    kiln_serve_version_put (&st->version);
}

int
kiln_serve_repo_models (kiln_serve_repo_t *self, char (*names)[KILN_MAX_MODEL_NAME + 1],
                        int max)
{
    pthread_mutex_lock (&self->lock);
    int n = 0;
    for (int i = 0; i < self->n_models && n < max; i++)
        snprintf (names[n++], KILN_MAX_MODEL_NAME + 1, "%s", self->models[i]->name);
    pthread_mutex_unlock (&self->lock);
    qsort (names, (size_t) n, sizeof names[0], s_cmp_names);
    return n;
}
