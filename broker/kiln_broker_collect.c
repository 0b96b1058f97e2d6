/*
 * kiln_broker_collect — a large artifact a worker built, collected in
 * chunks and checked and signed off the loop.
 *
 * A worker whose artifact does not fit in one message says so in DONE
 * (artifact_apart: its size) and keeps the file.  The broker then pulls
 * it: COLLECT asks for BROKER_COLLECT_AHEAD chunks, each SLICE is handed
 * (its frame, no copy) to a writer thread of the collection's own that
 * writes it to a file in STATE/tmp, and more are asked for when half are
 * written (pull with credit, as a worker fetches blobs), so that the
 * broker holds at most that many chunks of it whatever its size, and a
 * disk that stalls under dirty-page throttling stalls the writer, not the
 * loop (the loop only stops asking).  When the last
 * byte is in, a thread of its own reads the archive (members mapped,
 * hashed with their pages given back), checks its manifest against the
 * job, signs it and writes the signed archive to another file in
 * STATE/tmp, streaming; the loop then stages that file into the store and
 * answers the clients, who GET it in chunks.  A 10 GB artifact therefore
 * costs the broker a few MiB of memory and never blocks its loop for
 * longer than handing over a frame.
 *
 * A build that is cross-checked (kiln_broker_xcheck.c) is first only
 * checked and hashed on its thread; when the cross-check accepts it, a
 * second pass on a thread signs it, so that nothing is signed before two
 * workers agree.
 *
 * The job stays RUNNING on its worker until then: a worker lost meanwhile
 * requeues it as usual, and a thread that finishes for a job that is gone
 * (requeued, canceled, failed) has its files removed and its result
 * dropped.
 *
 *   collecting ──last SLICE──▶ signing ──thread through──▶ job succeeds
 *       │                         │                        (or requeued: the
 *       └── job requeued/gone ────┴──▶ dropped              artifact does not
 *                                                            check out)
 */
#include "broker/kiln_broker_priv.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/kiln_log.h"

#define BROKER_COLLECT_AHEAD 16      /* chunks asked for ahead of what is written */
#define S_RING (BROKER_COLLECT_AHEAD + 2) /* frames waiting for the writer, at most */

struct broker_collect {
    uint64_t job_id;
    char worker[KILN_PROTO_MAX_NAME + 1];
    char in_tmp[PATH_MAX];           /* the unsigned archive, written as SLICEs come */
    int in_fd;
    uint64_t size, got, asked;       /* bytes: announced, received, asked for */
    /* the writer thread (writes the SLICEs received to in_fd, in order) */
    pthread_t writer;
    bool writer_started;
    pthread_mutex_t mu;
    pthread_cond_t work;
    zframe_t *ring[S_RING];          /* chunk i at ring[i % S_RING], under mu */
    uint64_t pushed, popped;         /* chunks, under mu */
    bool closing;                    /* no more chunks (or stop at once: abort) */
    bool abort;
    atomic_uint_least64_t written;   /* bytes in the file */
    atomic_bool wake;                /* the loop holds back asks until more is written */
    atomic_int werr;                 /* errno of a failed write, 0 = none */
    /* signing (the thread reads these, writes the results) */
    bool signing;                    /* handed to a thread: `signing` list owns it */
    bool sign;                       /* sign it; false: check it and take its content
                                        hash only (a build that is cross-checked) */
    bool orphan;                     /* its job let go: drop the result */
    broker_expect_t expect;
    char *provenance;                /* owned */
    const kiln_key_t *key;           /* the broker's */
    char out_tmp[PATH_MAX];          /* the signed archive */
    int out_fd;
    pthread_t thread;
    atomic_bool through;             /* set by the thread as it ends */
    int efd;                         /* written by the thread as it ends */
    bool rejected;                   /* the artifact does not check out: requeue */
    int code;                        /* 0, or why signing failed */
    char message[KILN_ERR_MSG_MAX];
    char digest[KILN_HEX_LEN];       /* content hash of the signed artifact */
    uint64_t signed_size;
};

/* Stop the writer (at once with `abort`, else once it wrote everything
 * handed to it) and wait for it. */
static void
s_writer_stop (broker_collect_t *c, bool abort)
{
    if (!c->writer_started)
        return;
    pthread_mutex_lock (&c->mu);
    c->closing = true;
    c->abort = c->abort || abort;
    pthread_cond_signal (&c->work);
    pthread_mutex_unlock (&c->mu);
    pthread_join (c->writer, NULL);
    c->writer_started = false;
}

static void
s_collect_free (broker_collect_t *c)
{
    s_writer_stop (c, true);
    while (c->popped < c->pushed)
        zframe_destroy (&c->ring[c->popped++ % S_RING]);
    pthread_mutex_destroy (&c->mu);
    pthread_cond_destroy (&c->work);
    if (c->in_fd >= 0)
        close (c->in_fd);
    if (c->in_tmp[0])
        unlink (c->in_tmp);
    if (c->out_fd >= 0)
        close (c->out_fd);
    if (c->out_tmp[0])
        unlink (c->out_tmp);
    free (c->provenance);
    free (c);
}

void
broker_collect_release (broker_collect_t **self_p)
{
    broker_collect_t *c = *self_p;
    if (!c)
        return;
    *self_p = NULL;
    if (c->signing)
        c->orphan = true;            /* the signing list frees it when the thread ends */
    else
        s_collect_free (c);
}

/* The writer thread: the chunks the loop hands over, written in order;
 * it wakes the loop (sign_efd) when the loop waits for room to ask. */
static void *
s_writer_main (void *arg)
{
    broker_collect_t *c = arg;
    uint64_t at = 0;
    while (true) {
        pthread_mutex_lock (&c->mu);
        while (c->popped == c->pushed && !c->closing)
            pthread_cond_wait (&c->work, &c->mu);
        bool stop = c->abort || (c->popped == c->pushed && c->closing);
        zframe_t *frame = stop ? NULL : c->ring[c->popped % S_RING];
        pthread_mutex_unlock (&c->mu);
        if (stop)
            break;
        const uint8_t *data = zframe_data (frame);
        size_t n = zframe_size (frame), done = 0;
        while (done < n && !atomic_load (&c->werr)) {
            ssize_t k = pwrite (c->in_fd, data + done, n - done, (off_t) (at + done));
            if (k < 0 && errno == EINTR)
                continue;
            if (k <= 0)
                atomic_store (&c->werr, k < 0 ? errno : EIO);
            else
                done += (size_t) k;
        }
        at += done;
        pthread_mutex_lock (&c->mu);
        zframe_destroy (&c->ring[c->popped % S_RING]);
        c->popped++;
        pthread_mutex_unlock (&c->mu);
        atomic_store (&c->written, at);
        if (atomic_exchange (&c->wake, false) || atomic_load (&c->werr)) {
            uint64_t one = 1;
            ssize_t ignored = write (c->efd, &one, sizeof one);
            (void) ignored;
        }
        if (atomic_load (&c->werr))
            break;
    }
    return NULL;
}

/* Ask the worker for more chunks, keeping BROKER_COLLECT_AHEAD in flight
 * beyond what is written: when the disk lags, the loop asks for nothing
 * and the writer wakes it once half the window is written. */
static void
s_ask (kiln_broker_t *self, broker_job_t *job, broker_worker_t *w)
{
    broker_collect_t *c = job->collect;
    uint64_t ahead = (uint64_t) BROKER_COLLECT_AHEAD * KILN_CHUNK_BYTES;
    if (c->asked >= c->size)
        return;
    atomic_store (&c->wake, true);
    uint64_t written = atomic_load (&c->written);
    if (c->asked - written > ahead / 2)
        return;                      /* the writer wakes us (it may have already) */
    atomic_store (&c->wake, false);
    uint64_t want = (written + ahead - c->asked + KILN_CHUNK_BYTES - 1) / KILN_CHUNK_BYTES;
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_COLLECT);
    if (!msg)
        return;
    msg->job_id = job->id;
    msg->offset = c->asked;
    msg->count = want;
    c->asked += want * KILN_CHUNK_BYTES;
    if (c->asked > c->size)
        c->asked = c->size;
    broker_send_now (self, w->rid, &msg, w->name);
}

void
broker_collect_start (kiln_broker_t *self, broker_job_t *job, broker_worker_t *w,
                      uint64_t size)
{
    kiln_err_t err = { 0 };
    char message[KILN_ERR_MSG_MAX];
    broker_collect_release (&job->collect);
    broker_collect_t *c = calloc (1, sizeof *c);
    if (!c) {
        broker_job_requeue (self, job, "out of memory collecting its artifact", false);
        return;
    }
    c->in_fd = c->out_fd = -1;
    c->job_id = job->id;
    c->size = size;
    c->efd = self->sign_efd;
    pthread_mutex_init (&c->mu, NULL);
    pthread_cond_init (&c->work, NULL);
    atomic_init (&c->written, 0);
    atomic_init (&c->wake, false);
    atomic_init (&c->werr, 0);
    snprintf (c->worker, sizeof c->worker, "%s", w->name);
    if ((c->in_fd = kiln_store_tmp_open (self->store, c->in_tmp, sizeof c->in_tmp, &err)) < 0
        || pthread_create (&c->writer, NULL, s_writer_main, c) != 0) {
        if (c->in_fd < 0)
            c->in_tmp[0] = '\0';
        else
            kiln_error (&err, KILN_ESYS, "could not start a thread to write it");
        s_collect_free (c);
        broker_fmt (message, sizeof message, "could not collect its artifact: %s", err.msg);
        broker_job_requeue (self, job, message, false);
        return;
    }
    c->writer_started = true;
    job->collect = c;
    kiln_log_info ("job %llu action %.*s: collecting its artifact (%llu bytes) from %s",
                   (unsigned long long) job->id, BROKER_KEY_SHORT, job->action_key,
                   (unsigned long long) size, w->name);
    s_ask (self, job, w);
}

/* The signing thread: read (members mapped, hashed with their pages given
 * back), check, sign, write the signed archive, streaming. */
static void *
s_sign_main (void *arg)
{
    broker_collect_t *c = arg;
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = NULL;
    /* Everything received is handed to the writer: wait until it is in
     * the file. */
    s_writer_stop (c, false);
    int werr = atomic_load (&c->werr);
    close (c->in_fd);
    c->in_fd = -1;
    int fd = werr ? -1 : open (c->in_tmp, O_RDONLY | O_CLOEXEC);
    if (werr) {
        c->code = KILN_EIO;
        broker_fmt (c->message, sizeof c->message, "could not write its artifact: %s",
                    strerror (werr));
    }
    else if (fd < 0 || !(art = kiln_artifact_read_fd (fd, c->in_tmp, KILN_ARTIFACT_MAP, &err))) {
        c->rejected = true;
        broker_fmt (c->message, sizeof c->message, "worker %s returned an unreadable "
                    "artifact: %s", c->worker, fd < 0 ? strerror (errno) : err.msg);
    }
    else if (!broker_expect_check (&c->expect, kiln_artifact_manifest (art), c->worker,
                                   c->message, sizeof c->message))
        c->rejected = true;
    else if (kiln_artifact_digest (art, c->digest, &err) != 0
             || (c->sign
                 && (kiln_artifact_sign (art, c->key, c->provenance, &err) != 0
                     || kiln_artifact_write_fd (art, c->out_fd, &c->signed_size, &err) != 0))) {
        c->code = err.code ? err.code : KILN_EIO;
        broker_fmt (c->message, sizeof c->message, "could not sign the artifact: %s", err.msg);
    }
    kiln_artifact_destroy (&art);
    if (fd >= 0)
        close (fd);
    atomic_store (&c->through, true);
    uint64_t one = 1;
    ssize_t ignored = write (c->efd, &one, sizeof one);
    (void) ignored;
    return NULL;
}

/* Hand the collected archive to a thread: to be checked and signed, or,
 * for a build that is cross-checked, checked for its content hash only
 * (s_signed then signs it in a second pass when the check agrees). */
static void
s_sign_start (kiln_broker_t *self, broker_job_t *job, broker_worker_t *w)
{
    broker_collect_t *c = job->collect;
    kiln_err_t err = { 0 };
    char message[KILN_ERR_MSG_MAX];
    atomic_store (&c->through, false);
    free (c->provenance);
    c->provenance = broker_provenance (self, w, job);
    if (!c->provenance) {
        broker_job_fail (self, job, KILN_ENOMEM, "out of memory signing the artifact", NULL,
                         false);
        return;
    }
    if (c->sign && (c->out_fd = kiln_store_tmp_open (self->store, c->out_tmp,
                                                     sizeof c->out_tmp, &err)) < 0) {
        c->out_tmp[0] = '\0';
        broker_fmt (message, sizeof message, "could not sign the artifact: %s", err.msg);
        broker_job_fail (self, job, KILN_EIO, message, NULL, false);
        return;
    }
    c->signing = true;
    if (!zlistx_add_end (self->signing, c)
        || pthread_create (&c->thread, NULL, s_sign_main, c) != 0) {
        void *handle = zlistx_find (self->signing, c);
        if (handle)
            zlistx_detach (self->signing, handle);
        c->signing = false;
        broker_job_fail (self, job, KILN_ESYS, "could not start a thread to sign the artifact",
                         NULL, false);
    }
}

/* The last byte is in: check (and sign) it on a thread. */
static void
s_sign (kiln_broker_t *self, broker_job_t *job, broker_worker_t *w)
{
    broker_collect_t *c = job->collect;
    broker_expect_fill (job, &c->expect);
    c->key = self->key;
    c->sign = !broker_xcheck_wanted (self, job, w);
    s_sign_start (self, job, w);
}

/* SLICE: a chunk of the artifact a job's worker sends apart. */
void
broker_on_slice (kiln_broker_t *self, const broker_from_t *from, kiln_msg_t *msg)
{
    broker_worker_t *w = from->worker;
    broker_job_t *job = broker_worker_job (self, w, msg->job_id, "SLICE");
    if (!job)
        return;
    broker_collect_t *c = job->collect;
    char message[KILN_ERR_MSG_MAX];
    if (!c || c->signing || msg->artifact_size != c->size || msg->offset != c->got) {
        broker_fmt (message, sizeof message, "worker %s sent a SLICE of job %llu at offset "
                    "%llu of %llu bytes, expected offset %llu of %llu", w->name,
                    (unsigned long long) job->id, (unsigned long long) msg->offset,
                    (unsigned long long) msg->artifact_size,
                    (unsigned long long) (c ? c->got : 0), (unsigned long long) (c ? c->size : 0));
        kiln_log_warn ("%s", message);
        w->failed++;
        broker_job_requeue (self, job, message, false);
        return;
    }
    int e = atomic_load (&c->werr);
    zframe_t *frame = kiln_msg_take_chunk (msg);
    size_t n = frame ? zframe_size (frame) : 0;
    /* The ask window keeps what is handed over within the ring; a worker
     * that sends more than it was asked for is refused. */
    pthread_mutex_lock (&c->mu);
    bool full = c->pushed - c->popped >= S_RING - 1;
    pthread_mutex_unlock (&c->mu);
    if (!e && (c->got + n > c->asked || full))
        e = EOVERFLOW;
    if (e) {
        zframe_destroy (&frame);
        broker_fmt (message, sizeof message, "could not write its artifact: %s",
                    e == EOVERFLOW ? "more chunks came than were asked for" : strerror (e));
        kiln_log_err ("job %llu: %s", (unsigned long long) job->id, message);
        broker_job_requeue (self, job, message, false);
        return;
    }
    if (n) {
        pthread_mutex_lock (&c->mu);
        c->ring[c->pushed++ % S_RING] = frame;
        pthread_cond_signal (&c->work);
        pthread_mutex_unlock (&c->mu);
    }
    else
        zframe_destroy (&frame);
    c->got += n;
    if (c->got < c->size)
        s_ask (self, job, w);
    else
        s_sign (self, job, w);
}

/* One signing thread is through: finish its job, or drop its result. */
static void
s_signed (kiln_broker_t *self, broker_collect_t *c)
{
    pthread_join (c->thread, NULL);
    c->signing = false;
    char id_key[24];
    snprintf (id_key, sizeof id_key, "%llu", (unsigned long long) c->job_id);
    broker_job_t *job = c->orphan ? NULL : zhashx_lookup (self->jobs_by_id, id_key);
    if (!job || job->collect != c || job->state != BROKER_JOB_RUNNING || !job->worker) {
        s_collect_free (c);
        return;
    }
    broker_worker_t *w = job->worker;
    if (c->rejected) {
        kiln_log_err ("job %llu: %s", (unsigned long long) job->id, c->message);
        w->failed++;
        broker_job_requeue (self, job, c->message, false);       /* frees c */
        return;
    }
    if (c->code) {
        broker_job_fail (self, job, c->code, c->message, NULL, false);
        return;
    }
    if (!c->sign) {
        /* Checked, not signed: its content hash goes to the cross-check,
         * which requeues or fails the job (freeing c), or accepts it. */
        if (broker_xcheck_result (self, job, w, c->digest, 0, NULL, NULL)
            != BROKER_XCHECK_ACCEPT)
            return;
        c->sign = true;
        s_sign_start (self, job, w);
        return;
    }
    /* The signed file goes to the store; the collection is done with. */
    job->collect = NULL;
    unlink (c->in_tmp);
    c->in_tmp[0] = '\0';
    broker_job_succeed (self, job, w, c->digest, NULL, c->signed_size, &c->out_fd, c->out_tmp);
    c->out_tmp[0] = '\0';             /* the store has it (or removed it) */
    s_collect_free (c);
}

int
broker_on_signed (zloop_t *loop, zmq_pollitem_t *item, void *arg)
{
    kiln_broker_t *self = arg;
    uint64_t n;
    ssize_t ignored = read (self->sign_efd, &n, sizeof n);
    (void) ignored;
    /* Writers that made room: ask their workers for more (a write that
     * failed is seen by the next SLICE, or here when none is coming). */
    for (broker_job_t *job = zhashx_first (self->jobs_by_id); job;
         job = zhashx_next (self->jobs_by_id)) {
        broker_collect_t *wc = job->collect;
        if (!wc || wc->signing || !job->worker)
            continue;
        if (atomic_load (&wc->werr) && wc->got == wc->asked) {
            broker_job_requeue (self, job, "could not write its artifact", false);
            break;                   /* the table changed: the next wake sees the rest */
        }
        s_ask (self, job, job->worker);
    }
    broker_collect_t *c = zlistx_first (self->signing);
    while (c) {
        broker_collect_t *next = zlistx_next (self->signing);
        if (atomic_load (&c->through)) {
            void *handle = zlistx_find (self->signing, c);
            if (handle)
                zlistx_detach (self->signing, handle);
            s_signed (self, c);
            /* the list may have changed under s_signed: start again */
            c = zlistx_first (self->signing);
            continue;
        }
        c = next;
    }
    return 0;
}

void
broker_collect_shutdown (kiln_broker_t *self)
{
    if (!self->signing)
        return;
    broker_collect_t *c;
    while ((c = zlistx_detach (self->signing, NULL))) {
        pthread_join (c->thread, NULL);
        s_collect_free (c);
    }
}
