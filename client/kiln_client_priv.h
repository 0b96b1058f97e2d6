/*
 * kiln_client_priv — what the pieces of libkilnclient share: the client
 * struct and its connection.  kiln_client.c sends compiles and uploads;
 * kiln_client_store.c fetches and pins artifacts and asks for the
 * broker's state.  Not installed: programs use kiln_client.h.
 *
 * Invariant: `dealer` is NULL or connected to `endpoint` (with CurveZMQ
 * when `cert` is set), and `monitor` watches it; no call returns while
 * ZeroMQ still holds a chunk that points into the caller's memory
 * (`in_zmq` is 0).
 */
#ifndef KILN_CLIENT_PRIV_H
#define KILN_CLIENT_PRIV_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <czmq.h>

#include "client/kiln_client.h"
#include "common/kiln_proto.h"

#define KILN_CLIENT_MAX_POLL_MS  100   /* longest single wait, so signals are seen */

struct kiln_client {
    char *endpoint;                  /* owned copy */
    char name[KILN_PROTO_MAX_NAME + 1];
    char *cert, *broker_cert;        /* owned, or NULL */
    int heartbeat_ms, liveness_ms, broker_timeout_ms;
    zsock_t *dealer;                 /* connected to the broker, or NULL */
    zactor_t *monitor;               /* zmonitor on dealer: refused handshakes */
    uint64_t next_req;               /* id of the next request */
    uint32_t credit;                 /* chunks the broker lets us send */
    uint64_t epoch;                  /* the broker instance we talk to, 0 = not known */
    atomic_int in_zmq;               /* chunk frames ZeroMQ still holds */
    /* Upload chunks are copied into these 1 MiB buffers, used again and
     * again, and sent from them (kiln_client.c, s_send_chunk): under
     * stage_mu, since ZeroMQ's I/O thread gives them back. */
    pthread_mutex_t stage_mu;
    void *stage_free[KILN_PROTO_MAX_CREDIT];     /* buffers not in use */
    int n_stage_free;
    kiln_progress_fn *progress;      /* or NULL */
    void *progress_arg;
    int progress_ms;                 /* WHERE interval */
    kiln_err_t refusal;              /* the broker refused our handshake (code 0: not);
                                        ZeroMQ does not retry such a connection */
    kiln_client_stats_t stats;
};

/* Open the socket to the broker (dealer and monitor). */
int kiln_client_connect (kiln_client_t *self, kiln_err_t *err);
/* Close it, waiting until ZeroMQ has dropped every chunk that points into
 * the caller's buffers. */
void kiln_client_disconnect (kiln_client_t *self);
/* Read one monitor event; a refused handshake fills `err` and returns
 * true. */
bool kiln_client_refused (kiln_client_t *self, kiln_err_t *err);
/* Wait at most wait_ms until the dealer can send without blocking.  A
 * broker that refuses our handshake drops the connection for good (no
 * reconnect), and a send would then block for the whole send timeout:
 * the monitor's refusal is reported instead.  0, or -code with `err`. */
int kiln_client_writable (kiln_client_t *self, int wait_ms, kiln_err_t *err);
/* Send `msg` on the dealer, waiting at most wait_ms for room (0: not at
 * all).  The dealer has a pipe from the moment it connects and loses it
 * only when the broker refuses the handshake, which can happen between
 * kiln_client_writable and this send: a send that cannot go out then
 * reports the monitor's refusal when there is one, and other failures
 * as the broker's ("broker ENDPOINT: ...").  0, or -code with `err`. */
int kiln_client_send (kiln_client_t *self, kiln_msg_t **msg, int wait_ms, kiln_err_t *err);
/* The farm's ERROR as our error: its code, its message, and as much of
 * the end of a compile log as fits. */
void kiln_client_remote_error (const kiln_msg_t *msg, kiln_err_t *err);

#endif
