/*
 * kiln_outgoing — artifacts waiting for the broker to collect them, sent
 * a chunk at a time from their files.
 */
#include "worker/kiln_outgoing.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/kiln_limits.h"
#include "common/kiln_log.h"
#include "common/kiln_proto.h"

typedef struct {
    uint64_t job_id;
    int fd;                  /* the archive, open for reading */
    uint64_t size;
    int64_t touched;         /* zclock_mono of the DONE or the last COLLECT */
} s_art_t;

struct kiln_outgoing {
    s_art_t all[KILN_OUTGOING_MAX];
    int n;
};

kiln_outgoing_t *
kiln_outgoing_new (void)
{
    return calloc (1, sizeof (kiln_outgoing_t));
}

static void
s_remove (kiln_outgoing_t *self, int i)
{
    close (self->all[i].fd);
    self->all[i] = self->all[--self->n];
}

void
kiln_outgoing_destroy (kiln_outgoing_t **self_p)
{
    if (!*self_p)
        return;
    kiln_outgoing_purge (*self_p);
    free (*self_p);
    *self_p = NULL;
}

void
kiln_outgoing_add (kiln_outgoing_t *self, uint64_t job_id, int *fd_p, uint64_t size)
{
    kiln_outgoing_drop (self, job_id);
    if (self->n == KILN_OUTGOING_MAX) {
        int oldest = 0;
        for (int i = 1; i < self->n; i++)
            if (self->all[i].touched < self->all[oldest].touched)
                oldest = i;
        kiln_log_warn ("job %llu: its artifact was never collected; dropped",
                       (unsigned long long) self->all[oldest].job_id);
        s_remove (self, oldest);
    }
    s_art_t *a = &self->all[self->n++];
    a->job_id = job_id;
    a->fd = *fd_p;
    a->size = size;
    a->touched = zclock_mono ();
    *fd_p = -1;
}

static int
s_find (const kiln_outgoing_t *self, uint64_t job_id)
{
    for (int i = 0; i < self->n; i++)
        if (self->all[i].job_id == job_id)
            return i;
    return -1;
}

int
kiln_outgoing_collect (kiln_outgoing_t *self, zsock_t *dealer, uint64_t job_id,
                       uint64_t offset, uint64_t count, kiln_err_t *err)
{
    int i = s_find (self, job_id);
    if (i < 0)
        return kiln_error (err, KILN_ENOTFOUND, "job %llu: no artifact waits to be collected",
                           (unsigned long long) job_id);
    s_art_t *a = &self->all[i];
    if (offset % KILN_CHUNK_BYTES || offset >= a->size || count > KILN_PROTO_MAX_CREDIT)
        return kiln_error (err, KILN_EPROTO, "job %llu: COLLECT of %llu chunks at offset %llu "
                           "of a %llu-byte artifact", (unsigned long long) job_id,
                           (unsigned long long) count, (unsigned long long) offset,
                           (unsigned long long) a->size);
    a->touched = zclock_mono ();
    uint8_t *buf = malloc (KILN_CHUNK_BYTES);
    if (!buf)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    int rc = 0;
    for (uint64_t k = 0; rc == 0 && k < count && offset < a->size; k++) {
        uint64_t n = a->size - offset < KILN_CHUNK_BYTES ? a->size - offset : KILN_CHUNK_BYTES;
        ssize_t got = pread (a->fd, buf, (size_t) n, (off_t) offset);
        if (got != (ssize_t) n) {
            rc = kiln_error (err, KILN_EIO, "job %llu: reading its artifact at %llu: %s",
                             (unsigned long long) job_id, (unsigned long long) offset,
                             got < 0 ? strerror (errno) : "it is short");
            break;
        }
        kiln_msg_t *slice = kiln_msg_new (KILN_CMD_SLICE);
        if (!slice) {
            rc = kiln_error (err, KILN_ENOMEM, "out of memory");
            break;
        }
        slice->job_id = job_id;
        slice->artifact_size = a->size;
        slice->offset = offset;
        if ((rc = kiln_msg_put_chunk (slice, buf, (size_t) n, err)) == 0)
            rc = kiln_msg_send (&slice, dealer, NULL, err);
        kiln_msg_destroy (&slice);
        offset += n;
    }
    free (buf);
    if (rc == 0 && offset >= a->size)
        s_remove (self, i);           /* all of it went out */
    return rc;
}

void
kiln_outgoing_drop (kiln_outgoing_t *self, uint64_t job_id)
{
    int i = s_find (self, job_id);
    if (i >= 0)
        s_remove (self, i);
}

void
kiln_outgoing_purge (kiln_outgoing_t *self)
{
    while (self->n > 0)
        s_remove (self, self->n - 1);
}

void
kiln_outgoing_expire (kiln_outgoing_t *self, int64_t now)
{
    for (int i = self->n - 1; i >= 0; i--)
        if (now - self->all[i].touched > KILN_OUTGOING_IDLE_MS) {
            kiln_log_warn ("job %llu: its artifact was not collected for %d s; dropped",
                           (unsigned long long) self->all[i].job_id,
                           KILN_OUTGOING_IDLE_MS / 1000);
            s_remove (self, i);
        }
}
