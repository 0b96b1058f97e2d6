/*
 * kiln_outgoing — artifacts a worker built that wait for the broker to
 * collect them.
 *
 * An artifact larger than fits in one message (KILN_PROTO_INLINE_TOTAL)
 * does not travel inside DONE: DONE says its size (artifact_apart), and
 * the broker pulls it with COLLECT, `count` 1 MiB SLICEs at a time, as it
 * writes them to disk (docs/protocol.md, "A large artifact").  So neither
 * side ever holds more of it than the chunks in flight.  The worker keeps
 * the archive's file open here (its job's directory is gone by then) until
 * the last slice has gone out, the broker cancels the job, the broker is
 * lost, or nobody has asked for it for KILN_OUTGOING_IDLE_MS.
 *
 * Bounds: at most KILN_OUTGOING_MAX artifacts wait (the oldest is dropped
 * for a new one: its job is requeued by the broker when it finds nothing
 * to collect), and a COLLECT asks for at most KILN_PROTO_MAX_CREDIT chunks.
 */
#ifndef KILN_OUTGOING_H
#define KILN_OUTGOING_H

#include <stdint.h>

#include <czmq.h>

#include "common/kiln_error.h"

#define KILN_OUTGOING_MAX      64        /* artifacts waiting at once */
#define KILN_OUTGOING_IDLE_MS  300000    /* dropped when not collected for this long */

typedef struct kiln_outgoing kiln_outgoing_t;

/* Caller owns the result.  NULL when out of memory. */
kiln_outgoing_t *kiln_outgoing_new (void);
/* Close every file; *self_p becomes NULL. */
void kiln_outgoing_destroy (kiln_outgoing_t **self_p);

/* Keep the open file *fd_p (taken: *fd_p becomes -1) of `size` bytes,
 * the artifact of job `job_id`, until it is collected. */
void kiln_outgoing_add (kiln_outgoing_t *self, uint64_t job_id, int *fd_p, uint64_t size);

/* COLLECT: send `count` SLICEs of job `job_id`'s artifact from `offset`
 * (a multiple of KILN_CHUNK_BYTES) on `dealer`; the artifact is forgotten
 * once its last byte went out.  An error (no such artifact, a bad offset,
 * a read error) names the job; the caller tells the broker. */
int kiln_outgoing_collect (kiln_outgoing_t *self, zsock_t *dealer, uint64_t job_id,
                           uint64_t offset, uint64_t count, kiln_err_t *err);

/* Forget job `job_id`'s artifact (CANCEL), or all of them (the broker is
 * lost), or those idle since before `now` - KILN_OUTGOING_IDLE_MS. */
void kiln_outgoing_drop (kiln_outgoing_t *self, uint64_t job_id);
void kiln_outgoing_purge (kiln_outgoing_t *self);
void kiln_outgoing_expire (kiln_outgoing_t *self, int64_t now);

#endif
