/*
 * kiln_broker_progress — what a waiting client is told about its job
 * (WHERE, answered by PROGRESS: docs/protocol.md, "Progress"): queued at
 * which place or running on which worker for how long, and how long the
 * farm expects it to take, from the history of its builds.
 *
 * The history is in memory only (a restarted broker starts without
 * estimates): the last build times of each graph (any compiler
 * arguments, as an exponentially weighted mean), of each size class (the
 * graph structure and its weights, in powers of two), and of all builds.
 * An estimate is the graph's if it was built before, else its size
 * class's, else none (0).  Nothing here changes a job.
 */
#include "broker/kiln_broker_priv.h"

#include <stdlib.h>
#include <string.h>

#define S_MAX_GRAPHS     4096        /* graphs remembered; then forgotten all at once */
#define S_SIZE_CLASSES   64          /* log2 of a job's bytes */
#define S_MAX_POSITION   100000      /* queue places counted */

/* An exponentially weighted mean of build times (ms); n = 0: none yet. */
typedef struct {
    double mean_ms;
    uint64_t n;
} s_mean_t;

struct broker_history {
    zhashx_t *graphs;                /* graph digest -> s_mean_t (owned) */
    s_mean_t sizes[S_SIZE_CLASSES];
    s_mean_t all;
};

static void
s_note (s_mean_t *m, double ms)
{
    /* New builds count a third: a farm that got faster shows it soon. */
    m->mean_ms = m->n ? m->mean_ms + (ms - m->mean_ms) / 3 : ms;
    m->n++;
}

/* The size class of a job: log2 of its structure and weights. */
static int
s_size_class (const broker_job_t *job)
{
    uint64_t bytes = job->struct_len;
    for (uint32_t i = 0; i < job->n_blobs; i++)
        bytes += job->blobs[i].size;
    int c = 0;
    while (bytes > 1 && c < S_SIZE_CLASSES - 1) {
        bytes >>= 1;
        c++;
    }
    return c;
}

broker_history_t *
broker_history_new (void)
{
    broker_history_t *self = calloc (1, sizeof *self);
    if (self && !(self->graphs = zhashx_new ())) {
        free (self);
        return NULL;
    }
    if (self)
        zhashx_set_destructor (self->graphs, (zhashx_destructor_fn *) zstr_free);
    return self;
}

void
broker_history_destroy (broker_history_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    zhashx_destroy (&(*self_p)->graphs);
    free (*self_p);
    *self_p = NULL;
}

void
broker_progress_job_built (kiln_broker_t *self, const broker_job_t *job)
{
    broker_history_t *h = self->history;
    if (!h)
        return;
    double ms = (double) (zclock_mono () - job->started);
    s_mean_t *m = zhashx_lookup (h->graphs, job->graph_digest);
    if (!m) {
        if (zhashx_size (h->graphs) >= S_MAX_GRAPHS)
            zhashx_purge (h->graphs);
        /* zstr_free frees with free(): the entry is a plain malloc'd block */
        m = calloc (1, sizeof *m);
        if (m && zhashx_insert (h->graphs, job->graph_digest, m) != 0) {
            free (m);
            m = NULL;
        }
    }
    if (m)
        s_note (m, ms);
    s_note (&h->sizes[s_size_class (job)], ms);
    s_note (&h->all, ms);
}

/* The build time expected for `job` in ms; 0 when there is no history. */
static uint64_t
s_estimate (const broker_history_t *h, const broker_job_t *job)
{
    if (!h)
        return 0;
    const s_mean_t *m = zhashx_lookup (h->graphs, job->graph_digest);
    if (m && m->n)
        return (uint64_t) m->mean_ms;
    m = &h->sizes[s_size_class (job)];
    return m->n ? (uint64_t) m->mean_ms : 0;
}

/* kiln_sched_each_tenant: count the tenants with jobs waiting. */
static void
s_count_waiting (const char *tenant, size_t queued, uint64_t served, void *arg)
{
    if (queued)
        (*(size_t *) arg)++;
}

/* WHERE: PROGRESS for the job of one of this client's requests. */
void
broker_on_where (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    char key[24];
    snprintf (key, sizeof key, "%llu", (unsigned long long) msg->job_id);
    broker_job_t *job = zhashx_lookup (self->jobs_by_id, key);
    bool waits = false;
    for (size_t i = 0; job && i < job->n_waiters; i++)
        waits |= job->waiters[i].client == from->client
                 && job->waiters[i].req_id == msg->req_id;
    if (!waits)
        return;                      /* finished: its RESULT or ERROR is on the way */
    kiln_msg_t *reply = kiln_msg_new (KILN_CMD_PROGRESS);
    if (!reply)
        return;
    int64_t now = zclock_mono ();
    const char *tenant = from->client->tenant;
    uint64_t running = 0, slots = 0;
    for (broker_job_t *j = zhashx_first (self->jobs); j; j = zhashx_next (self->jobs))
        running += j->state == BROKER_JOB_RUNNING && strcmp (j->tenant, tenant) == 0;
    for (broker_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers))
        slots += (uint64_t) w->slots;
    reply->req_id = msg->req_id;
    reply->job_id = job->id;
    reply->queued = kiln_sched_tenant_size (self->sched, tenant);
    reply->running = running;
    reply->estimate_ms = s_estimate (self->history, job);
    const char *state = broker_job_state_name (job->state);
    int rc = kiln_msg_set_str (&reply->state, state);
    if (job->state == BROKER_JOB_RUNNING) {
        reply->elapsed_ms = (uint64_t) (now - job->started);
        reply->eta_ms = reply->estimate_ms > reply->elapsed_ms
                            ? reply->estimate_ms - reply->elapsed_ms : 0;
        if (rc == 0 && job->worker)
            rc = kiln_msg_set_str (&reply->worker, job->worker->name);
    }
    else {
        reply->elapsed_ms = (uint64_t) (now - job->queued_at);
        reply->position = job->item ? kiln_sched_position (job->item, S_MAX_POSITION) : 0;
        /* Roughly: the jobs ahead of it share the slots with the other
         * clients' (fair share), each taking the farm's mean build time. */
        size_t tenants = 0;
        kiln_sched_each_tenant (self->sched, s_count_waiting, &tenants);
        double mean = self->history && self->history->all.n ? self->history->all.mean_ms : 0;
        if (reply->estimate_ms && mean > 0)
            reply->eta_ms = reply->estimate_ms
                            + (uint64_t) ((double) (reply->position - 1) * (double) tenants * mean
                                          / (double) (slots ? slots : 1));
    }
    if (rc != 0) {
        kiln_msg_destroy (&reply);
        return;
    }
    broker_send_now (self, from->rid, &reply, "client");
}

