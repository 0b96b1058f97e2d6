/*
 * kiln_proto — the farm's wire protocol, written once as data.
 *
 * A message is a ZeroMQ multipart message:
 *   frame 0      the header: a msgpack map {"v": 2, "cmd": "COMPILE",
 *                "frames": N, <the command's fields>...}
 *   frames 1..N  the payload: binary parts, each cut into chunks of at
 *                most KILN_CHUNK_BYTES.  Which parts a command carries is
 *                its payload kind (below); their sizes are header fields,
 *                so the receiver checks the frame layout before it
 *                allocates anything for a part.
 * A ROUTER peer sees the sender's routing id in front of frame 0.
 *
 * The two tables below are the whole protocol: KILN_PROTO_FIELDS lists
 * every field with its kind and bound, KILN_PROTO_COMMANDS every command
 * with its sender, receiver, payload and fields (REQ = required, OPT =
 * optional).  The encoder, the decoder, the struct kiln_msg_t and the
 * tables in docs/protocol.md are all generated from them, so they cannot
 * drift apart.  Adding a field or a command is one line here.
 *
 * Invariants: a kiln_msg_t that came out of kiln_msg_decode has every
 * required field of its command, every string within its bound and free
 * of NUL bytes, every hex field a 64-char lower-case SHA-256, and a
 * payload whose frames match the part sizes in its header exactly.
 * Unknown header keys are ignored (so a minor addition does not break an
 * older peer); a different "v" is refused.
 */
#ifndef KILN_PROTO_H
#define KILN_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <czmq.h>

#include "common/kiln_error.h"
#include "common/kiln_hash.h"
#include "common/kiln_limits.h"

#define KILN_PROTO_VERSION          2
#define KILN_PROTO_MAX_HEADER_BYTES (2u << 20)   /* frame 0 */
#define KILN_PROTO_MAX_DEPTH        4            /* msgpack nesting in a header */
#define KILN_PROTO_MAX_OBJECTS      (1u << 16)   /* msgpack objects in a header */
#define KILN_PROTO_MAX_NAME         127          /* worker, client and broker names */
#define KILN_PROTO_MAX_ID           63           /* compiler id/version, target */
#define KILN_PROTO_MAX_SLOTS        256          /* jobs one worker runs at once */
#define KILN_PROTO_MAX_BLOBS        KILN_MAX_FRAMES   /* blob refs in one message */
#define KILN_PROTO_MAX_TOOLCHAINS   64           /* toolchains one worker offers */
#define KILN_PROTO_MAX_TOOLCHAIN    191          /* "ID VERSION TARGET" */
#define KILN_PROTO_MAX_PRIORITY     1000         /* |priority| */
#define KILN_PROTO_MAX_TIMEOUT_MS   (7ULL * 24 * 3600 * 1000)   /* a compile: a week */
#define KILN_PROTO_MAX_CREDIT       256          /* chunks in flight on one connection */
#define KILN_PROTO_MAX_REPORT       (1u << 20)   /* the STATUS report (JSON) */
#define KILN_PROTO_MAX_PUBKEY       1024         /* a public key's PEM text */
#define KILN_PROTO_MAX_HAVE         64           /* member digests one GET says it holds */
/* A blob travels inside COMPILE / JOB ("inline") when it is at most
 * KILN_PROTO_INLINE_BLOB bytes and the message's inline blobs stay within
 * KILN_PROTO_INLINE_TOTAL; bigger ones move as CHUNKs with credit. */
#define KILN_PROTO_INLINE_BLOB      (64u << 10)
#define KILN_PROTO_INLINE_TOTAL     (1u << 20)

/* Peers, as bits so that a command can name several. */
#define KILN_PEER_CLIENT 1
#define KILN_PEER_BROKER 2
#define KILN_PEER_WORKER 4
#define KILN_PEER_ANY    7

/* What follows the header.
 *   NONE      no payload frames
 *   GRAPH     the graph structure (struct_size bytes), then the bytes of
 *             each blob of the blob list marked "inline", in list order
 *   ARTIFACT  the artifact archive (artifact_size bytes; 0 = no frames)
 *   CHUNK     bytes offset .. offset + min(KILN_CHUNK_BYTES, blob_size -
 *             offset) of the blob `digest` (one frame; none for a blob of
 *             0 bytes); offset is a multiple of KILN_CHUNK_BYTES
 *   PART      the same for the artifact archive of artifact_size bytes
 *             that a GET asked for; a PART with `length` covers offset ..
 *             offset + length instead (any offset: the answer to a GET
 *             with `have`), and one with `member` too carries no frame */
#define KILN_PAYLOADS(X)                                                   \
    X (NONE,     "none")                                                   \
    X (GRAPH,    "graph structure, then each blob marked inline")          \
    X (ARTIFACT, "artifact archive (artifact_size bytes)")                 \
    X (CHUNK,    "one chunk of a blob: offset .. offset + 1 MiB")          \
    X (PART,     "one chunk of an artifact: offset .. offset + 1 MiB")

typedef enum {
#define KILN_PAYLOAD_ENUM(name, doc) KILN_PAYLOAD_##name,
    KILN_PAYLOADS (KILN_PAYLOAD_ENUM)
#undef KILN_PAYLOAD_ENUM
} kiln_payload_t;

/* Field kinds and their msgpack form:
 *   U64    positive integer, at most `max`
 *   I64    integer, 0..max
 *   SINT   integer, -max..max
 *   BOOL   boolean
 *   STR    string of at most `max` bytes, no NUL
 *   HEX    string of 64 lower-case hex chars (a SHA-256)
 *   BLOBS  array of at most `max` maps {"digest": HEX, "size": U64,
 *          "inline": BOOL (optional)}
 *   STRS   array of at most `max` strings of at most
 *          KILN_PROTO_MAX_TOOLCHAIN bytes each */

/*  name              kind   max                         meaning */
#define KILN_PROTO_FIELDS(X)                                                        \
    X (req_id,           U64,   UINT64_MAX,                 "client's request id, echoed in the reply")        \
    X (job_id,           U64,   UINT64_MAX,                 "broker's job id")                                  \
    X (name,             STR,   KILN_PROTO_MAX_NAME,        "worker name ([A-Za-z0-9._:@-])")                   \
    X (slots,            U64,   KILN_PROTO_MAX_SLOTS,       "jobs the worker runs at once (1..256)")            \
    X (max_memory,       U64,   UINT64_MAX,                 "bytes of address space one compile may use on the worker (its --max-memory)") \
    X (out_of_memory,    BOOL,  1,                          "the compile stopped at the worker's memory limit") \
    X (toolchains,       STRS,  KILN_PROTO_MAX_TOOLCHAINS,  "toolchains a worker runs, each \"ID VERSION TARGET\"") \
    X (compiler_id,      STR,   KILN_PROTO_MAX_ID,          "toolchain id, e.g. kiln-builtin")                  \
    X (compiler_version, STR,   KILN_PROTO_MAX_ID,          "toolchain version")                                \
    X (target,           STR,   KILN_PROTO_MAX_ID,          "compile target, e.g. cpu-x86_64")                  \
    X (compiler_args,    STR,   KILN_MAX_ARGS_BYTES - 1,    "compiler argument string (normalised by the broker)") \
    X (graph_digest,     HEX,   64,                         "SHA-256 of the graph's canonical encoding")        \
    X (action_key,       HEX,   64,                         "key of the compilation (kiln_action_key)")         \
    X (artifact,         HEX,   64,                         "artifact content hash (SHA-256 of manifest.json)") \
    X (struct_size,      U64,   KILN_MAX_STRUCT_BYTES,      "bytes of the graph structure part")                \
    X (blobs,            BLOBS, KILN_PROTO_MAX_BLOBS,       "weight blobs by digest and size")                  \
    X (priority,         SINT,  KILN_PROTO_MAX_PRIORITY,    "lower runs sooner, like nice(1); default 0")       \
    X (timeout_ms,       U64,   KILN_PROTO_MAX_TIMEOUT_MS,  "compile timeout; 0 = the farm's default")          \
    X (retry_failed,     BOOL,  1,                          "build again even if this action failed before")    \
    X (client,           STR,   KILN_PROTO_MAX_NAME,        "client's name for fair share (when not authenticated)") \
    X (digest,           HEX,   64,                         "SHA-256 of one blob (in a GET's last PART: of the whole archive file)") \
    X (blob_size,        U64,   KILN_MAX_BLOB_BYTES,        "bytes of that blob")                               \
    X (offset,           U64,   KILN_MAX_ARTIFACT_BYTES,    "byte offset of a chunk in its blob or artifact")   \
    X (count,            U64,   KILN_PROTO_MAX_CREDIT,      "chunks asked for")                                 \
    X (credit,           U64,   KILN_PROTO_MAX_CREDIT,      "more chunks the peer may send")                    \
    X (artifact_size,    U64,   KILN_MAX_ARTIFACT_BYTES,    "bytes of the artifact archive")                    \
    X (artifact_apart,   U64,   KILN_MAX_ARTIFACT_BYTES,    "bytes of an artifact sent apart from this message (DONE: COLLECTed in SLICEs; RESULT: fetched with GET)") \
    X (cached,           BOOL,  1,                          "served from the action (or failure) cache")        \
    X (worker,           STR,   KILN_PROTO_MAX_NAME,        "name of the worker that built it")                 \
    X (ok,               BOOL,  1,                          "the compile succeeded")                            \
    X (code,             I64,   KILN_ERR_MAX - 1,           "a KILN_E* error code (common/kiln_error.h)")       \
    X (message,          STR,   KILN_ERR_MSG_MAX - 1,       "human-readable error message")                     \
    X (log,              STR,   KILN_MAX_LOG_BYTES,         "compiler output (stdout and stderr)")              \
    X (pending,          U64,   UINT64_MAX,                 "requests the broker holds for this connection")    \
    X (have,             BLOBS, KILN_PROTO_MAX_HAVE,        "archive members the client holds by digest (GET): {digest, size}") \
    X (member,           HEX,   64,                         "a PART without bytes: its `length` bytes are the data of the member with this SHA-256, which the client holds") \
    X (length,           U64,   KILN_MAX_ARTIFACT_BYTES,    "bytes a PART covers when not the rest of its 1 MiB (a GET with `have`)") \
    X (epoch,            U64,   UINT64_MAX,                 "the broker's instance (random at start): a change means it restarted") \
    X (session,          U64,   UINT64_MAX,                 "a worker's registration: JOBs of an older one are dropped") \
    X (report,           STR,   KILN_PROTO_MAX_REPORT,      "the broker's state as JSON (docs/operations.md)")  \
    X (broker,           STR,   KILN_PROTO_MAX_NAME,        "broker name")                                      \
    X (workers,          U64,   UINT64_MAX,                 "workers registered")                               \
    X (idle_slots,       U64,   UINT64_MAX,                 "free job slots over all workers")                  \
    X (queued,           U64,   UINT64_MAX,                 "jobs waiting for a worker")                        \
    X (running,          U64,   UINT64_MAX,                 "jobs on a worker")                                 \
    X (pinned,           BOOL,  1,                          "the artifact is pinned: eviction never removes it") \
    X (changed,          BOOL,  1,                          "the request changed the pin (false: it was so already)") \
    X (public_key,       STR,   KILN_PROTO_MAX_PUBKEY,      "the farm's artifact-signing public key (PEM, SubjectPublicKeyInfo)") \
    X (key_id,           STR,   16,                         "its key id (16 hex characters)")                   \
    X (curve_public,     STR,   40,                         "the broker's CurveZMQ public key (Z85), when it has one") \
    X (state,            STR,   15,                         "a job's state: \"queued\" or \"running\"")         \
    X (position,         U64,   UINT64_MAX,                 "a queued job's place in its client's queue (1: next)") \
    X (elapsed_ms,       U64,   UINT64_MAX,                 "how long the job has been in its state")           \
    X (estimate_ms,      U64,   UINT64_MAX,                 "the build time the farm expects (0: no idea yet)") \
    X (eta_ms,           U64,   UINT64_MAX,                 "the time the farm expects until the result (0: no idea yet)")

/*  name        from               to                  payload    meaning \
 *              fields */
#define KILN_PROTO_COMMANDS(C, REQ, OPT)                                              \
    C (COMPILE, KILN_PEER_CLIENT, KILN_PEER_BROKER, GRAPH,                            \
       "compile a graph; answered by RESULT, ERROR, MISSING or ACCEPTED",             \
       REQ (req_id) REQ (graph_digest) REQ (action_key) OPT (compiler_args)           \
       REQ (compiler_id) REQ (compiler_version) REQ (target) REQ (struct_size)        \
       REQ (blobs) OPT (priority) OPT (timeout_ms) OPT (retry_failed) OPT (client))   \
    C (FIND,    KILN_PEER_CLIENT, KILN_PEER_BROKER, NONE,                             \
       "which of these blobs does the broker lack? answered by MISSING",              \
       REQ (req_id) REQ (blobs))                                                      \
    C (MISSING, KILN_PEER_BROKER, KILN_PEER_CLIENT, NONE,                             \
       "the broker lacks these blobs: send them as CHUNKs (then COMPILE again)",      \
       REQ (req_id) REQ (blobs) REQ (credit) OPT (epoch))                             \
    C (ACCEPTED, KILN_PEER_BROKER, KILN_PEER_CLIENT, NONE,                            \
       "the request waits for job job_id (queued, running or shared); RESULT or ERROR follows", \
       REQ (req_id) REQ (job_id) OPT (epoch))                                         \
    C (CHUNK,   KILN_PEER_CLIENT | KILN_PEER_BROKER,                                  \
       KILN_PEER_BROKER | KILN_PEER_WORKER, CHUNK,                                    \
       "one chunk of a blob (client upload, or broker answer to FETCH)",              \
       OPT (job_id) REQ (digest) REQ (blob_size) REQ (offset))                        \
    C (CREDIT,  KILN_PEER_BROKER | KILN_PEER_CLIENT,                                  \
       KILN_PEER_CLIENT | KILN_PEER_BROKER, NONE,                                     \
       "the peer may send `credit` more chunks: broker to client for uploads (`digest`: that blob is stored), client to broker for the GET `req_id`", \
       REQ (credit) OPT (req_id) OPT (digest) OPT (epoch))                            \
    C (RESULT,  KILN_PEER_BROKER, KILN_PEER_CLIENT, ARTIFACT,                         \
       "the signed artifact for a COMPILE (a large one apart: GET it by its content hash)", \
       REQ (req_id) REQ (artifact) REQ (action_key) REQ (graph_digest) REQ (cached)   \
       OPT (worker) REQ (artifact_size) OPT (artifact_apart))                         \
    C (ERROR,   KILN_PEER_ANY,    KILN_PEER_ANY,    NONE,                             \
       "a request failed or a message was refused",                                   \
       OPT (req_id) OPT (job_id) REQ (code) REQ (message) OPT (log) OPT (cached)      \
       OPT (digest) OPT (epoch))                                                      \
    C (CANCEL,  KILN_PEER_CLIENT | KILN_PEER_BROKER,                                  \
       KILN_PEER_BROKER | KILN_PEER_WORKER, NONE,                                     \
       "client: forget request req_id (a COMPILE or a GET); broker: stop job job_id (no DONE follows)", \
       OPT (req_id) OPT (job_id))                                                     \
    C (PING,    KILN_PEER_CLIENT, KILN_PEER_BROKER, NONE,                             \
       "ask the broker how it is; answered by PONG",                                  \
       REQ (req_id))                                                                  \
    C (PONG,    KILN_PEER_BROKER, KILN_PEER_CLIENT, NONE,                             \
       "the broker's state",                                                          \
       REQ (req_id) REQ (broker) REQ (workers) REQ (idle_slots) REQ (queued)          \
       REQ (running))                                                                 \
    C (STATUS,  KILN_PEER_CLIENT, KILN_PEER_BROKER, NONE,                             \
       "ask for the broker's full state; answered by REPORT",                         \
       REQ (req_id))                                                                  \
    C (REPORT,  KILN_PEER_BROKER, KILN_PEER_CLIENT, NONE,                             \
       "workers, queues per client, cache and job counters as JSON",                  \
       REQ (req_id) REQ (report))                                                     \
    C (WHERE,   KILN_PEER_CLIENT, KILN_PEER_BROKER, NONE,                             \
       "how is the job of request req_id (ACCEPTED's job_id) doing? answered by PROGRESS, nothing when it just finished", \
       REQ (req_id) REQ (job_id))                                                     \
    C (PROGRESS, KILN_PEER_BROKER, KILN_PEER_CLIENT, NONE,                            \
       "a job's state, queue position or worker, and the time the farm expects it to take; `queued`, `running`: all of this client's jobs", \
       REQ (req_id) REQ (job_id) REQ (state) OPT (position) OPT (queued) OPT (running) \
       OPT (worker) OPT (elapsed_ms) OPT (estimate_ms) OPT (eta_ms))                  \
    C (KEY,     KILN_PEER_CLIENT, KILN_PEER_BROKER, NONE,                             \
       "ask for the key the farm signs artifacts with (kiln trust); answered by PUBKEY", \
       REQ (req_id))                                                                  \
    C (PUBKEY,  KILN_PEER_BROKER, KILN_PEER_CLIENT, NONE,                             \
       "the farm's public signing key, its id, and the broker's CurveZMQ public key", \
       REQ (req_id) REQ (public_key) REQ (key_id) OPT (curve_public))                 \
    C (GET,     KILN_PEER_CLIENT, KILN_PEER_BROKER, NONE,                             \
       "fetch a stored artifact by its content hash; answered by PARTs, `credit` at a time, or ERROR ENOTFOUND", \
       REQ (req_id) REQ (artifact) REQ (credit) OPT (have))                           \
    C (PART,    KILN_PEER_BROKER, KILN_PEER_CLIENT, PART,                             \
       "one chunk of the artifact a GET asked for, in order; the last carries `digest` "  \
       "(not when the GET held members)",                                               \
       REQ (req_id) REQ (artifact) REQ (artifact_size) REQ (offset) OPT (digest)      \
       OPT (length) OPT (member))                                                     \
    C (PIN,     KILN_PEER_CLIENT, KILN_PEER_BROKER, NONE,                             \
       "keep a stored artifact: eviction never removes it; answered by PINNED",       \
       REQ (req_id) REQ (artifact))                                                   \
    C (UNPIN,   KILN_PEER_CLIENT, KILN_PEER_BROKER, NONE,                             \
       "let eviction remove a pinned artifact again; answered by PINNED",             \
       REQ (req_id) REQ (artifact))                                                   \
    C (PINNED,  KILN_PEER_BROKER, KILN_PEER_CLIENT, NONE,                             \
       "whether the artifact is pinned now, and whether the request changed that",    \
       REQ (req_id) REQ (artifact) REQ (pinned) REQ (changed))                        \
    C (READY,   KILN_PEER_WORKER, KILN_PEER_BROKER, NONE,                             \
       "a worker registers (again) with all its slots free and the blobs it holds",   \
       REQ (name) REQ (slots) REQ (toolchains) OPT (blobs) OPT (session)            \
       OPT (max_memory))             \
    C (HEARTBEAT, KILN_PEER_ANY, KILN_PEER_ANY, NONE,                                 \
       "liveness, every second both ways; a worker names itself, a client hears `pending`", \
       OPT (pending) OPT (name) OPT (epoch))                                                                 \
    C (JOB,     KILN_PEER_BROKER, KILN_PEER_WORKER, GRAPH,                            \
       "compile this graph with this toolchain; FETCH what is not inline; answered by DONE", \
       REQ (job_id) REQ (action_key) REQ (graph_digest) OPT (compiler_args)           \
       REQ (compiler_id) REQ (compiler_version) REQ (target) OPT (timeout_ms)         \
       REQ (struct_size) REQ (blobs) OPT (session))                                   \
    C (FETCH,   KILN_PEER_WORKER, KILN_PEER_BROKER, NONE,                             \
       "send `count` chunks of a blob from `offset`; answered by CHUNKs",             \
       REQ (job_id) REQ (digest) REQ (offset) REQ (count))                            \
    C (LOG,     KILN_PEER_WORKER, KILN_PEER_BROKER, NONE,                             \
       "more output of a running compile (kept for the job's failure report)",        \
       REQ (job_id) REQ (log))                                                        \
    C (DONE,    KILN_PEER_WORKER, KILN_PEER_BROKER, ARTIFACT,                         \
       "a job finished: the unsigned artifact (a large one apart: COLLECTed), or a failure with its log", \
       REQ (job_id) REQ (ok) OPT (code) OPT (message) OPT (log) OPT (artifact_size)   \
       OPT (artifact_apart) OPT (out_of_memory))                                                          \
    C (COLLECT, KILN_PEER_BROKER, KILN_PEER_WORKER, NONE,                             \
       "send `count` SLICEs of job job_id's artifact (sent apart) from `offset`",     \
       REQ (job_id) REQ (offset) REQ (count))                                         \
    C (SLICE,   KILN_PEER_WORKER, KILN_PEER_BROKER, PART,                             \
       "one chunk of a job's artifact a COLLECT asked for: offset .. offset + 1 MiB", \
       REQ (job_id) REQ (artifact_size) REQ (offset))                                 \
    C (DISCONNECT, KILN_PEER_CLIENT | KILN_PEER_WORKER, KILN_PEER_BROKER, NONE,       \
       "a peer leaves: a worker's jobs are requeued, a client's requests dropped", )

typedef enum {
#define KILN_CMD_ENUM(name, from, to, payload, doc, fields) KILN_CMD_##name,
    KILN_PROTO_COMMANDS (KILN_CMD_ENUM, , )
#undef KILN_CMD_ENUM
    KILN_CMD_COUNT
} kiln_cmd_t;

typedef enum {
#define KILN_FIELD_ENUM(name, kind, max, doc) KILN_F_##name,
    KILN_PROTO_FIELDS (KILN_FIELD_ENUM)
#undef KILN_FIELD_ENUM
    KILN_F_COUNT
} kiln_field_t;

typedef struct kiln_blob_ref {
    uint8_t digest[KILN_DIGEST_LEN];   /* SHA-256 the blob's bytes must have */
    uint64_t size;                     /* bytes */
    bool in_msg;                       /* "inline": its bytes are a payload part */
} kiln_blob_ref_t;

/* One struct member per field, typed by its kind. */
#define KILN_FIELD_DECL_U64(name)   uint64_t name;
#define KILN_FIELD_DECL_I64(name)   int64_t name;
#define KILN_FIELD_DECL_SINT(name)  int64_t name;
#define KILN_FIELD_DECL_BOOL(name)  bool name;
#define KILN_FIELD_DECL_STR(name)   char *name;
#define KILN_FIELD_DECL_HEX(name)   char name[KILN_HEX_LEN];
#define KILN_FIELD_DECL_BLOBS(name) kiln_blob_ref_t *name; uint32_t n_##name;
#define KILN_FIELD_DECL_STRS(name)  char **name; uint32_t n_##name;

/* A decoded (or to be encoded) message.  Transparent: read and set the
 * numeric and hex fields directly; set strings with kiln_msg_set_str
 * (the message owns them, NULL = absent), string lists with
 * kiln_msg_add_strs, and payload with kiln_msg_put_*.  Only the fields of
 * `cmd` go on the wire. */
typedef struct kiln_msg {
    kiln_cmd_t cmd;
#define KILN_FIELD_DECL(name, kind, max, doc) KILN_FIELD_DECL_##kind (name)
    KILN_PROTO_FIELDS (KILN_FIELD_DECL)
#undef KILN_FIELD_DECL
    zframe_t **frames;       /* payload frames, owned */
    size_t n_frames;
    size_t cap_frames;
    const void *ref_data;    /* a CHUNK sent by reference (kiln_msg_put_chunk_ref) */
    size_t ref_len;
    zmq_free_fn *ref_free;
    void *ref_hint;
} kiln_msg_t;

/* Who sent a message, as the transport authenticated it (CurveZMQ with
 * a ZAP handler that passes the certificate's metadata).  Empty strings
 * when the connection is not authenticated. */
typedef struct kiln_peer {
    char key[48];                          /* the peer's public key, Z85 */
    char name[KILN_PROTO_MAX_NAME + 1];    /* certificate metadata "name" */
    char role[16];                         /* certificate metadata "role" */
} kiln_peer_t;

/* --- the table ------------------------------------------------------ */

/* "COMPILE"; "?" for a value out of range. */
const char *kiln_cmd_name (kiln_cmd_t cmd);
/* The command named `name` (length `len`), or -1. */
int kiln_cmd_lookup (const char *name, size_t len);
/* KILN_PEER_* bits of who may send / receive `cmd`. */
int kiln_cmd_senders (kiln_cmd_t cmd);
int kiln_cmd_receivers (kiln_cmd_t cmd);
kiln_payload_t kiln_cmd_payload (kiln_cmd_t cmd);

/* Write the field and command tables of docs/protocol.md as markdown. */
void kiln_proto_write_doc (FILE *out);

/* --- messages ------------------------------------------------------- */

/* Create an empty message of `cmd`.  Caller owns it.  NULL only when out
 * of memory. */
kiln_msg_t *kiln_msg_new (kiln_cmd_t cmd);
/* Free the message, its strings and frames; *self_p becomes NULL. */
void kiln_msg_destroy (kiln_msg_t **self_p);

/* Replace the string in *field (a STR member of a message) by a copy of
 * `value` (NULL clears it).  -KILN_ENOMEM on failure. */
int kiln_msg_set_str (char **field, const char *value);
/* Append a copy of `value` to a STRS member (`list`, `count`). */
int kiln_msg_add_strs (char ***list, uint32_t *count, const char *value);
/* Set an ERROR message's code, message and (optional) log in one call. */
int kiln_msg_set_error (kiln_msg_t *self, int code, const char *message,
                        const char *log);

/* Payload.  GRAPH: put the structure first, then list blobs in order:
 * kiln_msg_add_blob_ref lists one by reference only, kiln_msg_put_blob
 * lists one and carries its bytes ("inline").  ARTIFACT: put the artifact
 * once.  CHUNK: put the chunk once, after setting digest, blob_size and
 * offset (PART: artifact_size and offset).  The bytes are copied into
 * frames of at most KILN_CHUNK_BYTES. */
int kiln_msg_put_structure (kiln_msg_t *self, const void *data, size_t len,
                            kiln_err_t *err);
int kiln_msg_add_blob_ref (kiln_msg_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                           uint64_t size, kiln_err_t *err);
int kiln_msg_put_blob (kiln_msg_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                       const void *data, uint64_t size, kiln_err_t *err);
int kiln_msg_put_artifact (kiln_msg_t *self, const void *data, size_t len,
                           kiln_err_t *err);
int kiln_msg_put_chunk (kiln_msg_t *self, const void *data, size_t len,
                        kiln_err_t *err);
/* Like kiln_msg_put_chunk, but the frame points at `data` without a copy:
 * `data` must stay valid and unchanged until the message has been sent
 * and ZeroMQ has let go of it (it calls `free_fn (data, hint)` then; NULL
 * for memory that outlives the socket). */
int kiln_msg_put_chunk_ref (kiln_msg_t *self, const void *data, size_t len,
                            zmq_free_fn *free_fn, void *hint, kiln_err_t *err);

/* Join payload part `part` into one buffer.  GRAPH: 0 = structure, then
 * the inline blobs in list order (kiln_msg_blob_part finds a blob's);
 * ARTIFACT and CHUNK: 0.  Caller owns *data (free()); for an empty part
 * *data is a 1-byte allocation and *len 0. */
int kiln_msg_part (const kiln_msg_t *self, size_t part, uint8_t **data,
                   size_t *len, kiln_err_t *err);
/* The bytes of inline blob `index` (an index into blobs[]).  KILN_EINVAL
 * when that blob is not inline. */
int kiln_msg_blob_part (const kiln_msg_t *self, uint32_t index, uint8_t **data,
                        size_t *len, kiln_err_t *err);
/* The single frame of a CHUNK or a PART (NULL for an empty blob); owned
 * by the message. */
zframe_t *kiln_msg_chunk_frame (const kiln_msg_t *self);
/* The same, taken out of the message: caller owns it (NULL for an empty
 * blob, or when taken already). */
zframe_t *kiln_msg_take_chunk (kiln_msg_t *self);

/* Encode into a multipart message (header + payload frames), checking
 * every field against the table as the decoder will.  Consumes *self_p
 * (also on failure).  Caller owns the returned zmsg. */
zmsg_t *kiln_msg_encode (kiln_msg_t **self_p, kiln_err_t *err);

/* Decode a multipart message (header + payload, no routing id), checking
 * the version, the command, every field and the payload layout.  Consumes
 * *raw_p.  On failure returns NULL with `err` set; *req_id (may be NULL)
 * gets the header's req_id whenever it could be read, else 0, so that the
 * error reply can name the request.  Caller owns the result. */
kiln_msg_t *kiln_msg_decode (zmsg_t **raw_p, uint64_t *req_id, kiln_err_t *err);

/* --- sockets -------------------------------------------------------- */

/* Receive one multipart message from `sock`, without waiting longer than
 * the socket's own receive timeout.  On a ROUTER pass `routing_id`: it
 * gets the sender's id (caller destroys it), also when decoding fails, so
 * that the caller can reply.  `peer` (may be NULL) gets what the
 * transport authenticated about the sender.  Frames past KILN_MAX_FRAMES
 * are drained and the message refused.  Caller owns the result. */
kiln_msg_t *kiln_msg_recv (zsock_t *sock, zframe_t **routing_id,
                           uint64_t *req_id, kiln_err_t *err);
kiln_msg_t *kiln_msg_recv_peer (zsock_t *sock, zframe_t **routing_id,
                                kiln_peer_t *peer, uint64_t *req_id,
                                kiln_err_t *err);

/* Encode and send, to `routing_id` on a ROUTER (NULL on a DEALER).
 * Consumes *self_p.  Does not block on a ROUTER with router_mandatory and
 * sndtimeo 0: a gone peer is an error (KILN_ENOTFOUND), a full one too
 * (KILN_EIO). */
int kiln_msg_send (kiln_msg_t **self_p, zsock_t *sock, zframe_t *routing_id,
                   kiln_err_t *err);

/* Set the socket options every kiln socket uses: linger 0, a receive
 * limit of KILN_MAX_FRAME_BYTES per frame (the transport drops a peer
 * that sends more). */
void kiln_proto_socket_defaults (zsock_t *sock);

/* True when `endpoint` is on this host only (tcp on 127.0.0.0/8, ::1 or
 * localhost; ipc; inproc).  Without CurveZMQ the farm listens on nothing
 * else. */
bool kiln_proto_endpoint_is_local (const char *endpoint);

/* True when `name` is 1..KILN_PROTO_MAX_NAME chars of [A-Za-z0-9._:@-]. */
bool kiln_proto_name_ok (const char *name);

/* --- toolchains ------------------------------------------------------ */

/* A toolchain as workers advertise it and jobs ask for it. */
typedef struct kiln_toolchain_id {
    char id[KILN_PROTO_MAX_ID + 1];        /* "kiln-builtin", "neuronx-cc" */
    char version[KILN_PROTO_MAX_ID + 1];   /* "0.1.0" */
    char target[KILN_PROTO_MAX_ID + 1];    /* "cpu-x86_64" */
} kiln_toolchain_id_t;

/* True when `s` is 1..KILN_PROTO_MAX_ID chars of [A-Za-z0-9._+-]: the
 * form of a toolchain id, version and target. */
bool kiln_toolchain_word_ok (const char *s);
/* Parse "ID VERSION TARGET" (one space between words). */
int kiln_toolchain_parse (const char *text, kiln_toolchain_id_t *out,
                          kiln_err_t *err);
/* Write "ID VERSION TARGET" into buf[size]; returns buf. */
char *kiln_toolchain_format (const kiln_toolchain_id_t *tc, char *buf,
                             size_t size);

/* --- CurveZMQ -------------------------------------------------------- */

/* Make `sock` a CurveZMQ client of the broker whose public certificate
 * is at `broker_cert`, presenting the secret certificate at `cert`
 * (zcert format: `cert` holds the public part, `cert`_secret the
 * secret one, as `kiln cert` writes them).  Call before connecting. */
int kiln_proto_curve_client (zsock_t *sock, const char *cert,
                             const char *broker_cert, kiln_err_t *err);

#endif
