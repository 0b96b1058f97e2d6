/*
 * kiln_download — the broker's side of GET: stored artifacts sent to
 * clients by content hash, one 1 MiB PART at a time, read from the
 * store's file as they go (never whole in memory), under flow control.
 *
 * Flow control is the upload's credit turned around (docs/protocol.md):
 * the client's GET grants `credit` chunks, the broker sends that many
 * and then waits for the client's CREDIT, which it sends as it writes
 * what came.  A download never has more than the broker's credit window
 * granted at once, whatever the client claims.  Besides, chunk buffers
 * are handed to ZeroMQ without a copy and counted until ZeroMQ lets go
 * of them: at most KILN_MAX_DOWNLOAD_CHUNKS are held over all downloads, so slow or
 * hostile readers cost the broker a bounded amount of memory, however
 * many there are.  Downloads take turns one chunk at a time, and a pump
 * sends at most a few chunks before it returns to the event loop.
 *
 * The broker hashes what it sends; the last PART carries the SHA-256 of
 * the whole file, so that the client can check that it wrote what the
 * broker read.  The archive itself is checked by the client (every
 * member against the manifest, the manifest against the content hash).
 *
 * Everything here runs on the broker's loop thread, except the release
 * of chunk buffers, which ZeroMQ's I/O thread reports (an atomic counter
 * and the eventfd).
 */
#ifndef KILN_DOWNLOAD_H
#define KILN_DOWNLOAD_H

#include <stdbool.h>
#include <stdint.h>

#include <czmq.h>

#include "broker/kiln_store.h"
#include "common/kiln_error.h"
#include "common/kiln_limits.h"
#include "common/kiln_proto.h"

typedef struct kiln_downloads kiln_downloads_t;

/* Bounds: KILN_MAX_DOWNLOADS, KILN_MAX_CLIENT_DOWNLOADS and
 * KILN_MAX_DOWNLOAD_CHUNKS (the budget) in common/kiln_limits.h. */
#define KILN_DOWNLOADS_IDLE_MS      60000 /* a download without credit this long is dropped */

typedef struct kiln_downloads_stats {
    uint64_t in_progress;    /* downloads now */
    uint64_t served;         /* downloads completed since start */
    uint64_t bytes;          /* artifact bytes sent since start */
    uint64_t held_bytes;     /* bytes of members the clients held, named instead */
} kiln_downloads_stats_t;

/* Serve downloads from `store` through `router` (both the caller's, and
 * outliving the result), granting each at most `window` chunks at once
 * (1..KILN_PROTO_MAX_CREDIT).  Caller owns the result. */
kiln_downloads_t *kiln_downloads_new (kiln_store_t *store, zsock_t *router, int window,
                                      kiln_err_t *err);
/* Drop every download and free; waits (a few seconds at most) for ZeroMQ
 * to release the chunk buffers it still holds, so destroy the socket
 * first.  *self_p becomes NULL. */
void kiln_downloads_destroy (kiln_downloads_t **self_p);

/* Start sending artifact `digest_hex` to the client with routing id
 * `rid` (copied; `peer_key` is its hex form) for its request `req_id`,
 * with `credit` chunks granted.  A download of the same peer and request
 * is started over.  -KILN_ENOTFOUND when the store does not hold the
 * artifact (err says so, naming it), KILN_ELIMIT when too many downloads
 * are in progress, KILN_EPROTO for a GET without credit.  On an error no
 * message was sent: the caller answers. */
/* The client of download (peer_key, req_id), just started, holds the
 * archive members with these digests (its GET's `have`): each payload
 * member of the stored archive listed there goes as one PART naming it
 * (offset, length, member) instead of its bytes, which the broker still
 * reads and hashes for the last PART's digest of the whole file; the
 * bytes around them go as PARTs with `length`.  Reads the archive's
 * headers (not its payload).  Returns the bytes so held (0: sent whole,
 * as when the headers cannot be read). */
uint64_t kiln_downloads_hold (kiln_downloads_t *self, const char *peer_key, uint64_t req_id,
                              const kiln_blob_ref_t *have, size_t n_have);

int kiln_downloads_start (kiln_downloads_t *self, const char *peer_key, zframe_t *rid,
                          uint64_t req_id, const char *digest_hex, uint64_t credit,
                          kiln_err_t *err);
/* The client lets download `req_id` have `credit` more chunks.  False
 * when there is no such download (it finished, or was dropped). */
bool kiln_downloads_credit (kiln_downloads_t *self, const char *peer_key, uint64_t req_id,
                            uint64_t credit);
/* Forget a download (the client canceled it).  False when there was none. */
bool kiln_downloads_cancel (kiln_downloads_t *self, const char *peer_key, uint64_t req_id);
/* True when the client has downloads in progress. */
bool kiln_downloads_has_peer (const kiln_downloads_t *self, const char *peer_key);
/* Forget every download of a client that left. */
void kiln_downloads_drop_peer (kiln_downloads_t *self, const char *peer_key);
/* Drop downloads that have waited for credit longer than
 * KILN_DOWNLOADS_IDLE_MS at `now` (zclock_mono). */
void kiln_downloads_expire (kiln_downloads_t *self, int64_t now);

/* Readable when there is sending to do: then call kiln_downloads_pump. */
int kiln_downloads_fd (const kiln_downloads_t *self);
/* Send what credit and the budget allow, at most `max_chunks` chunks,
 * the downloads taking turns; a download whose client is gone or whose
 * file fails is dropped (the client hears ERROR when it can).  Makes the
 * fd readable again when more could be sent at once. */
void kiln_downloads_pump (kiln_downloads_t *self, int max_chunks);

void kiln_downloads_stats (const kiln_downloads_t *self, kiln_downloads_stats_t *out);

#endif
