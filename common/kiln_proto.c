/*
 * kiln_proto — encoder, decoder and documentation of the wire protocol,
 * all driven by the two tables in kiln_proto.h.
 */
#include "common/kiln_proto.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "common/kiln_mpk.h"

/* --- the tables as data ------------------------------------------------ */

typedef enum { FK_U64, FK_I64, FK_SINT, FK_BOOL, FK_STR, FK_HEX, FK_BLOBS, FK_STRS } s_kind_t;

typedef struct {
    const char *name;       /* key in the header map */
    s_kind_t kind;          /* how it is encoded and checked */
    uint64_t max;           /* bound: value, bytes or entries by kind */
    const char *doc;        /* one line for docs/protocol.md */
    size_t offset;          /* of the member in kiln_msg_t */
    size_t count_offset;    /* BLOBS, STRS: of the n_<name> member */
} s_field_t;

#define S_COUNT_OFFSET_U64(name)   0
#define S_COUNT_OFFSET_I64(name)   0
#define S_COUNT_OFFSET_SINT(name)  0
#define S_COUNT_OFFSET_BOOL(name)  0
#define S_COUNT_OFFSET_STR(name)   0
#define S_COUNT_OFFSET_HEX(name)   0
#define S_COUNT_OFFSET_BLOBS(name) offsetof (kiln_msg_t, n_##name)
#define S_COUNT_OFFSET_STRS(name)  offsetof (kiln_msg_t, n_##name)

static const s_field_t s_fields[KILN_F_COUNT] = {
#define S_FIELD(name, kind, max, doc) \
    { #name, FK_##kind, (uint64_t) (max), doc, offsetof (kiln_msg_t, name), \
      S_COUNT_OFFSET_##kind (name) },
    KILN_PROTO_FIELDS (S_FIELD)
#undef S_FIELD
};

typedef struct {
    kiln_field_t field;     /* index into s_fields */
    bool required;          /* REQ (true) or OPT (false) */
} s_spec_t;

typedef struct {
    const char *name;       /* "COMPILE" */
    int from;               /* KILN_PEER_* bits of senders */
    int to;                 /* KILN_PEER_* bits of receivers */
    kiln_payload_t payload; /* what follows the header */
    const char *doc;        /* one line for docs/protocol.md */
    const s_spec_t *spec;   /* its fields, in documentation order */
    size_t n_spec;
} s_cmd_t;

#define S_REQ(f) { KILN_F_##f, true },
#define S_OPT(f) { KILN_F_##f, false },
#define S_SPEC(name, from, to, payload, doc, fields) \
    static const s_spec_t s_spec_##name[] = { fields { KILN_F_COUNT, false } };
KILN_PROTO_COMMANDS (S_SPEC, S_REQ, S_OPT)
#undef S_SPEC

static const s_cmd_t s_cmds[KILN_CMD_COUNT] = {
#define S_CMD(name, from, to, payload, doc, fields)                        \
    { #name, (from), (to), KILN_PAYLOAD_##payload, doc, s_spec_##name,      \
      sizeof s_spec_##name / sizeof s_spec_##name[0] - 1 },
    KILN_PROTO_COMMANDS (S_CMD, S_REQ, S_OPT)
#undef S_CMD
};
#undef S_REQ
#undef S_OPT

static const char *s_payload_doc[] = {
#define S_PAYLOAD_DOC(name, doc) doc,
    KILN_PAYLOADS (S_PAYLOAD_DOC)
#undef S_PAYLOAD_DOC
};

const char *
kiln_cmd_name (kiln_cmd_t cmd)
{
    return (unsigned) cmd < KILN_CMD_COUNT ? s_cmds[cmd].name : "?";
}

int
kiln_cmd_lookup (const char *name, size_t len)
{
    for (int i = 0; i < KILN_CMD_COUNT; i++)
        if (strlen (s_cmds[i].name) == len && memcmp (s_cmds[i].name, name, len) == 0)
            return i;
    return -1;
}

int
kiln_cmd_senders (kiln_cmd_t cmd)
{
    return (unsigned) cmd < KILN_CMD_COUNT ? s_cmds[cmd].from : 0;
}

int
kiln_cmd_receivers (kiln_cmd_t cmd)
{
    return (unsigned) cmd < KILN_CMD_COUNT ? s_cmds[cmd].to : 0;
}

kiln_payload_t
kiln_cmd_payload (kiln_cmd_t cmd)
{
    return (unsigned) cmd < KILN_CMD_COUNT ? s_cmds[cmd].payload : KILN_PAYLOAD_NONE;
}

/* --- documentation ------------------------------------------------------ */

static const char *
s_kind_name (s_kind_t kind)
{
    static const char *names[] = { "uint", "int", "signed int", "bool", "string", "hex",
                                   "blob list", "string list" };
    return names[kind];
}

static void
s_peers (FILE *out, int peers)
{
    static const struct { int bit; const char *name; } names[] = {
        { KILN_PEER_CLIENT, "client" }, { KILN_PEER_BROKER, "broker" },
        { KILN_PEER_WORKER, "worker" },
    };
    if (peers == KILN_PEER_ANY) {
        fputs ("any", out);
        return;
    }
    const char *sep = "";
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (peers & names[i].bit) {
            fprintf (out, "%s%s", sep, names[i].name);
            sep = ", ";
        }
}

void
kiln_proto_write_doc (FILE *out)
{
    fprintf (out, "Protocol version: %d.\n\n", KILN_PROTO_VERSION);
    fprintf (out, "| command | from | to | payload | fields | meaning |\n");
    fprintf (out, "|---|---|---|---|---|---|\n");
    for (int c = 0; c < KILN_CMD_COUNT; c++) {
        const s_cmd_t *cmd = &s_cmds[c];
        fprintf (out, "| `%s` | ", cmd->name);
        s_peers (out, cmd->from);
        fputs (" | ", out);
        s_peers (out, cmd->to);
        fprintf (out, " | %s | ", s_payload_doc[cmd->payload]);
        if (cmd->n_spec == 0)
            fputs ("—", out);
        for (size_t i = 0; i < cmd->n_spec; i++)
            fprintf (out, "%s%s`%s`%s", i ? ", " : "", cmd->spec[i].required ? "" : "[",
                     s_fields[cmd->spec[i].field].name,
                     cmd->spec[i].required ? "" : "]");
        fprintf (out, " | %s |\n", cmd->doc);
    }
    fprintf (out, "\nFields in [brackets] are optional.  Every header also carries "
                  "`v` (uint, the protocol version), `cmd` (string) and `frames` "
                  "(uint, payload frames that follow, at most %d).\n\n",
             KILN_MAX_FRAMES);
    fprintf (out, "| field | kind | bound | meaning |\n");
    fprintf (out, "|---|---|---|---|\n");
    for (int f = 0; f < KILN_F_COUNT; f++) {
        const s_field_t *fd = &s_fields[f];
        fprintf (out, "| `%s` | %s | ", fd->name, s_kind_name (fd->kind));
        switch (fd->kind) {
        case FK_U64:
            if (fd->max == UINT64_MAX)
                fputs ("—", out);
            else
                fprintf (out, "≤ %llu", (unsigned long long) fd->max);
            break;
        case FK_I64:   fprintf (out, "0..%llu", (unsigned long long) fd->max); break;
        case FK_SINT:  fprintf (out, "-%llu..%llu", (unsigned long long) fd->max,
                                (unsigned long long) fd->max); break;
        case FK_BOOL:  fputs ("—", out); break;
        case FK_STR:   fprintf (out, "≤ %llu bytes", (unsigned long long) fd->max); break;
        case FK_HEX:   fputs ("64 hex chars", out); break;
        case FK_BLOBS: fprintf (out, "≤ %llu entries", (unsigned long long) fd->max); break;
        case FK_STRS:  fprintf (out, "≤ %llu strings of ≤ %d bytes", (unsigned long long) fd->max,
                                KILN_PROTO_MAX_TOOLCHAIN); break;
        }
        fprintf (out, " | %s |\n", fd->doc);
    }
}

/* --- messages ------------------------------------------------------------ */

kiln_msg_t *
kiln_msg_new (kiln_cmd_t cmd)
{
    kiln_msg_t *self = calloc (1, sizeof *self);
    if (self)
        self->cmd = cmd;
    return self;
}

void
kiln_msg_destroy (kiln_msg_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_msg_t *self = *self_p;
    for (int f = 0; f < KILN_F_COUNT; f++) {
        const s_field_t *fd = &s_fields[f];
        if (fd->kind == FK_STRS) {
            char **list = *(char ***) ((char *) self + fd->offset);
            uint32_t n = *(uint32_t *) ((char *) self + fd->count_offset);
            for (uint32_t i = 0; list && i < n; i++)
                free (list[i]);
        }
        if (fd->kind == FK_STR || fd->kind == FK_BLOBS || fd->kind == FK_STRS)
            free (*(void **) ((char *) self + fd->offset));
    }
    for (size_t i = 0; i < self->n_frames; i++)
        zframe_destroy (&self->frames[i]);
    free (self->frames);
    if (self->ref_data && self->ref_free)
        self->ref_free ((void *) self->ref_data, self->ref_hint);
    free (self);
    *self_p = NULL;
}

int
kiln_msg_set_str (char **field, const char *value)
{
    char *copy = NULL;
    if (value && !(copy = strdup (value)))
        return -KILN_ENOMEM;
    free (*field);
    *field = copy;
    return 0;
}

int
kiln_msg_set_error (kiln_msg_t *self, int code, const char *message,
                    const char *log)
{
    self->code = code < 0 ? -code : code;
    if (kiln_msg_set_str (&self->message, message ? message : kiln_strerror (code)))
        return -KILN_ENOMEM;
    return kiln_msg_set_str (&self->log, log);
}

int
kiln_msg_add_strs (char ***list, uint32_t *count, const char *value)
{
    char **grown = realloc (*list, (*count + 1) * sizeof *grown);
    if (!grown)
        return -KILN_ENOMEM;
    *list = grown;
    if (!(grown[*count] = strdup (value ? value : "")))
        return -KILN_ENOMEM;
    (*count)++;
    return 0;
}

/* Make room for `need` more frames. */
static int
s_reserve_frames (kiln_msg_t *self, uint64_t need, kiln_err_t *err)
{
    if (need > KILN_MAX_FRAMES || self->n_frames + need > KILN_MAX_FRAMES)
        return kiln_error (err, KILN_ELIMIT,
                           "%s message would need more than %d payload frames of %u bytes",
                           kiln_cmd_name (self->cmd), KILN_MAX_FRAMES, KILN_CHUNK_BYTES);
    if (self->n_frames + need > self->cap_frames) {
        size_t cap = self->n_frames + (size_t) need + 16;
        zframe_t **frames = realloc (self->frames, cap * sizeof *frames);
        if (!frames)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        self->frames = frames;
        self->cap_frames = cap;
    }
    return 0;
}

/* Append `len` bytes as frames of at most KILN_CHUNK_BYTES (none when
 * `len` is 0). */
static int
s_add_frames (kiln_msg_t *self, const void *data, uint64_t len, kiln_err_t *err)
{
    uint64_t need = (len + KILN_CHUNK_BYTES - 1) / KILN_CHUNK_BYTES;
    if (s_reserve_frames (self, need, err) != 0)
        return -err->code;
    const uint8_t *p = data;
    for (uint64_t off = 0; off < len; off += KILN_CHUNK_BYTES) {
        size_t n = (size_t) (len - off < KILN_CHUNK_BYTES ? len - off : KILN_CHUNK_BYTES);
        zframe_t *frame = zframe_new (p + off, n);
        if (!frame)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        self->frames[self->n_frames++] = frame;
    }
    return 0;
}

int
kiln_msg_put_structure (kiln_msg_t *self, const void *data, size_t len,
                        kiln_err_t *err)
{
    if (kiln_cmd_payload (self->cmd) != KILN_PAYLOAD_GRAPH || self->n_frames
        || self->n_blobs)
        return kiln_error (err, KILN_EINVAL, "%s: the structure goes first in a graph payload",
                           kiln_cmd_name (self->cmd));
    if (len > KILN_MAX_STRUCT_BYTES)
        return kiln_error (err, KILN_ELIMIT, "graph structure is %zu bytes, more than %u",
                           len, KILN_MAX_STRUCT_BYTES);
    self->struct_size = len;
    return s_add_frames (self, data, len, err);
}

/* Append a blob ref to the list. */
static int
s_add_ref (kiln_msg_t *self, const uint8_t digest[KILN_DIGEST_LEN], uint64_t size,
           bool in_msg, kiln_err_t *err)
{
    if (kiln_cmd_payload (self->cmd) != KILN_PAYLOAD_GRAPH)
        return kiln_error (err, KILN_EINVAL, "%s carries no blobs", kiln_cmd_name (self->cmd));
    if (self->n_blobs >= KILN_PROTO_MAX_BLOBS)
        return kiln_error (err, KILN_ELIMIT, "more than %d blobs in one message",
                           KILN_PROTO_MAX_BLOBS);
    if (size > KILN_MAX_BLOB_BYTES)
        return kiln_error (err, KILN_ELIMIT, "blob is %llu bytes, more than %llu",
                           (unsigned long long) size, KILN_MAX_BLOB_BYTES);
    kiln_blob_ref_t *blobs = realloc (self->blobs, (self->n_blobs + 1) * sizeof *blobs);
    if (!blobs)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    self->blobs = blobs;
    memcpy (blobs[self->n_blobs].digest, digest, KILN_DIGEST_LEN);
    blobs[self->n_blobs].size = size;
    blobs[self->n_blobs].in_msg = in_msg;
    self->n_blobs++;
    return 0;
}

int
kiln_msg_add_blob_ref (kiln_msg_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                       uint64_t size, kiln_err_t *err)
{
    return s_add_ref (self, digest, size, false, err);
}

int
kiln_msg_put_blob (kiln_msg_t *self, const uint8_t digest[KILN_DIGEST_LEN],
                   const void *data, uint64_t size, kiln_err_t *err)
{
    if (kiln_cmd_payload (self->cmd) != KILN_PAYLOAD_GRAPH)
        return kiln_error (err, KILN_EINVAL, "%s carries no blobs", kiln_cmd_name (self->cmd));
    int rc = s_add_frames (self, data, size, err);
    if (rc)
        return rc;
    return s_add_ref (self, digest, size, true, err);
}

int
kiln_msg_put_artifact (kiln_msg_t *self, const void *data, size_t len,
                       kiln_err_t *err)
{
    if (kiln_cmd_payload (self->cmd) != KILN_PAYLOAD_ARTIFACT || self->n_frames)
        return kiln_error (err, KILN_EINVAL, "%s: artifact payload set twice or not allowed",
                           kiln_cmd_name (self->cmd));
    if (len > KILN_MAX_ARTIFACT_BYTES)
        return kiln_error (err, KILN_ELIMIT, "artifact is %zu bytes, more than %llu",
                           len, KILN_MAX_ARTIFACT_BYTES);
    self->artifact_size = len;
    return s_add_frames (self, data, len, err);
}

/* True for the payloads that are one chunk of something bigger. */
static bool
s_is_chunk (kiln_payload_t payload)
{
    return payload == KILN_PAYLOAD_CHUNK || payload == KILN_PAYLOAD_PART;
}

/* The size of what a CHUNK (a blob, blob_size) or a PART (an artifact,
 * artifact_size) is a chunk of. */
static uint64_t
s_whole_size (const kiln_msg_t *self)
{
    return kiln_cmd_payload (self->cmd) == KILN_PAYLOAD_PART ? self->artifact_size
                                                             : self->blob_size;
}

/* The bytes a CHUNK or PART with this size and offset carries. */
static uint64_t
s_chunk_len (const kiln_msg_t *self)
{
    if (kiln_cmd_payload (self->cmd) == KILN_PAYLOAD_PART && self->length)
        return self->member[0] ? 0 : self->length;   /* a held member: no bytes */
    uint64_t whole = s_whole_size (self);
    if (self->offset >= whole)
        return 0;
    uint64_t left = whole - self->offset;
    return left < KILN_CHUNK_BYTES ? left : KILN_CHUNK_BYTES;
}

static int
s_check_chunk_put (kiln_msg_t *self, size_t len, kiln_err_t *err)
{
    if (!s_is_chunk (kiln_cmd_payload (self->cmd)) || self->n_frames)
        return kiln_error (err, KILN_EINVAL, "%s: chunk payload set twice or not allowed",
                           kiln_cmd_name (self->cmd));
    if (len != s_chunk_len (self))
        return kiln_error (err, KILN_EINVAL, "chunk at offset %llu of %llu bytes "
                           "must be %llu bytes, not %zu", (unsigned long long) self->offset,
                           (unsigned long long) s_whole_size (self),
                           (unsigned long long) s_chunk_len (self), len);
    return 0;
}

int
kiln_msg_put_chunk (kiln_msg_t *self, const void *data, size_t len, kiln_err_t *err)
{
    if (s_check_chunk_put (self, len, err) != 0)
        return -err->code;
    return s_add_frames (self, data, len, err);
}

int
kiln_msg_put_chunk_ref (kiln_msg_t *self, const void *data, size_t len,
                        zmq_free_fn *free_fn, void *hint, kiln_err_t *err)
{
    if (s_check_chunk_put (self, len, err) != 0)
        return -err->code;
    if (len == 0)
        return 0;
    self->ref_data = data;
    self->ref_len = len;
    self->ref_free = free_fn;
    self->ref_hint = hint;
    return 0;
}

/* The number of payload parts of `self`, and the size of part `part`. */
static size_t
s_part_count (const kiln_msg_t *self)
{
    switch (kiln_cmd_payload (self->cmd)) {
    case KILN_PAYLOAD_GRAPH: {
        size_t n = 1;
        for (uint32_t i = 0; i < self->n_blobs; i++)
            n += self->blobs[i].in_msg;
        return n;
    }
    case KILN_PAYLOAD_ARTIFACT:
    case KILN_PAYLOAD_CHUNK:
    case KILN_PAYLOAD_PART:
        return 1;
    default:
        return 0;
    }
}

static uint64_t
s_part_size (const kiln_msg_t *self, size_t part)
{
    switch (kiln_cmd_payload (self->cmd)) {
    case KILN_PAYLOAD_ARTIFACT: return self->artifact_size;
    case KILN_PAYLOAD_CHUNK:
    case KILN_PAYLOAD_PART:     return s_chunk_len (self);
    default:                    break;
    }
    if (part == 0)
        return self->struct_size;
    size_t seen = 0;
    for (uint32_t i = 0; i < self->n_blobs; i++)
        if (self->blobs[i].in_msg && ++seen == part)
            return self->blobs[i].size;
    return 0;
}

/* Check that the payload frames are exactly the parts cut into chunks:
 * every frame but the last of a part is KILN_CHUNK_BYTES, the last holds
 * the rest, and nothing is left over. */
static int
s_check_layout (const kiln_msg_t *self, kiln_err_t *err)
{
    if (self->ref_data)
        return self->n_frames == 0 && self->ref_len == s_part_size (self, 0) ? 0
               : kiln_error (err, KILN_EPROTO, "%s: the chunk does not match its header",
                             kiln_cmd_name (self->cmd));
    size_t frame = 0;
    size_t parts = s_part_count (self);
    for (size_t p = 0; p < parts; p++) {
        uint64_t left = s_part_size (self, p);
        while (left > 0) {
            if (frame >= self->n_frames)
                return kiln_error (err, KILN_EPROTO,
                                   "%s: payload part %zu needs more frames than the %zu sent",
                                   kiln_cmd_name (self->cmd), p, self->n_frames);
            uint64_t want = left < KILN_CHUNK_BYTES ? left : KILN_CHUNK_BYTES;
            size_t got = zframe_size (self->frames[frame]);
            if (got != want)
                return kiln_error (err, KILN_EPROTO,
                                   "%s: payload frame %zu is %zu bytes, expected %llu",
                                   kiln_cmd_name (self->cmd), frame, got,
                                   (unsigned long long) want);
            left -= want;
            frame++;
        }
    }
    if (frame != self->n_frames)
        return kiln_error (err, KILN_EPROTO, "%s: %zu payload frames sent, the header accounts for %zu",
                           kiln_cmd_name (self->cmd), self->n_frames, frame);
    return 0;
}

int
kiln_msg_part (const kiln_msg_t *self, size_t part, uint8_t **data, size_t *len,
               kiln_err_t *err)
{
    *data = NULL;
    *len = 0;
    size_t parts = s_part_count (self);
    if (part >= parts)
        return kiln_error (err, KILN_EINVAL, "%s has no payload part %zu",
                           kiln_cmd_name (self->cmd), part);
    size_t frame = 0;
    for (size_t p = 0; p < part; p++)
        frame += (size_t) ((s_part_size (self, p) + KILN_CHUNK_BYTES - 1) / KILN_CHUNK_BYTES);
    uint64_t size = s_part_size (self, part);
    uint64_t nframes = (size + KILN_CHUNK_BYTES - 1) / KILN_CHUNK_BYTES;
    if (frame + nframes > self->n_frames)
        return kiln_error (err, KILN_EPROTO, "%s: payload part %zu is missing frames",
                           kiln_cmd_name (self->cmd), part);
    uint8_t *buf = malloc (size ? (size_t) size : 1);
    if (!buf)
        return kiln_error (err, KILN_ENOMEM, "out of memory for a %llu-byte payload part",
                           (unsigned long long) size);
    uint64_t off = 0;
    for (uint64_t i = 0; i < nframes; i++) {
        zframe_t *f = self->frames[frame + i];
        size_t n = zframe_size (f);
        if (n > size - off) {
            free (buf);
            return kiln_error (err, KILN_EPROTO, "%s: payload part %zu overflows its size",
                               kiln_cmd_name (self->cmd), part);
        }
        memcpy (buf + off, zframe_data (f), n);
        off += n;
    }
    if (off != size) {
        free (buf);
        return kiln_error (err, KILN_EPROTO, "%s: payload part %zu is short",
                           kiln_cmd_name (self->cmd), part);
    }
    *data = buf;
    *len = (size_t) size;
    return 0;
}

int
kiln_msg_blob_part (const kiln_msg_t *self, uint32_t index, uint8_t **data,
                    size_t *len, kiln_err_t *err)
{
    *data = NULL;
    *len = 0;
    if (kiln_cmd_payload (self->cmd) != KILN_PAYLOAD_GRAPH || index >= self->n_blobs
        || !self->blobs[index].in_msg)
        return kiln_error (err, KILN_EINVAL, "%s: blob %u is not in the message",
                           kiln_cmd_name (self->cmd), index);
    size_t part = 1;
    for (uint32_t i = 0; i < index; i++)
        part += self->blobs[i].in_msg;
    return kiln_msg_part (self, part, data, len, err);
}

zframe_t *
kiln_msg_chunk_frame (const kiln_msg_t *self)
{
    if (!s_is_chunk (kiln_cmd_payload (self->cmd)) || self->n_frames != 1)
        return NULL;
    return self->frames[0];
}

zframe_t *
kiln_msg_take_chunk (kiln_msg_t *self)
{
    zframe_t *frame = kiln_msg_chunk_frame (self);
    if (frame) {
        self->frames[0] = NULL;
        self->n_frames = 0;
    }
    return frame;
}

/* --- encoding -------------------------------------------------------------- */

static void *
s_member (const kiln_msg_t *self, const s_field_t *fd)
{
    return (char *) self + fd->offset;
}

/* Is an optional field worth sending?  Zero, false, NULL and "" are the
 * values a decoder gives an absent field, so they are left out. */
static bool
s_field_present (const kiln_msg_t *self, const s_field_t *fd)
{
    const void *m = s_member (self, fd);
    switch (fd->kind) {
    case FK_U64:   return *(const uint64_t *) m != 0;
    case FK_I64:   return *(const int64_t *) m != 0;
    case FK_SINT:  return *(const int64_t *) m != 0;
    case FK_BOOL:  return *(const bool *) m;
    case FK_STR:   return *(char *const *) m != NULL;
    case FK_HEX:   return ((const char *) m)[0] != '\0';
    case FK_BLOBS:
    case FK_STRS:  return *(const uint32_t *) ((const char *) self + fd->count_offset) != 0;
    }
    return false;
}

/* Check a field's C value against the table, as the decoder will. */
static int
s_check_value (const kiln_msg_t *self, const s_field_t *fd, kiln_err_t *err)
{
    const void *m = s_member (self, fd);
    switch (fd->kind) {
    case FK_U64:
        if (*(const uint64_t *) m > fd->max)
            return kiln_error (err, KILN_ELIMIT, "field '%s' is %llu, more than %llu", fd->name,
                               (unsigned long long) *(const uint64_t *) m,
                               (unsigned long long) fd->max);
        return 0;
    case FK_I64: {
        int64_t v = *(const int64_t *) m;
        if (v < 0 || (uint64_t) v > fd->max)
            return kiln_error (err, KILN_EPROTO, "field '%s' is %lld, outside 0..%llu",
                               fd->name, (long long) v, (unsigned long long) fd->max);
        return 0;
    }
    case FK_SINT: {
        int64_t v = *(const int64_t *) m;
        if (v < -(int64_t) fd->max || v > (int64_t) fd->max)
            return kiln_error (err, KILN_ELIMIT, "field '%s' is %lld, outside -%llu..%llu",
                               fd->name, (long long) v, (unsigned long long) fd->max,
                               (unsigned long long) fd->max);
        return 0;
    }
    case FK_BOOL:
        return 0;
    case FK_STRS: {
        char *const *list = *(char **const *) m;
        uint32_t n = *(const uint32_t *) ((const char *) self + fd->count_offset);
        if (n > fd->max)
            return kiln_error (err, KILN_ELIMIT, "field '%s' has %u entries, more than %llu",
                               fd->name, n, (unsigned long long) fd->max);
        for (uint32_t i = 0; i < n; i++)
            if (!list[i] || strlen (list[i]) > KILN_PROTO_MAX_TOOLCHAIN)
                return kiln_error (err, KILN_ELIMIT, "field '%s'[%u] is missing or longer "
                                   "than %d bytes", fd->name, i, KILN_PROTO_MAX_TOOLCHAIN);
        return 0;
    }
    case FK_STR: {
        const char *s = *(char *const *) m;
        if (!s)
            return kiln_error (err, KILN_EPROTO, "missing field '%s'", fd->name);
        if (strlen (s) > fd->max)
            return kiln_error (err, KILN_ELIMIT, "field '%s' is %zu bytes, more than %llu",
                               fd->name, strlen (s), (unsigned long long) fd->max);
        return 0;
    }
    case FK_HEX:
        if (!kiln_is_digest_hex ((const char *) m))
            return kiln_error (err, KILN_EPROTO, "field '%s' is not a SHA-256 in hex",
                               fd->name);
        return 0;
    case FK_BLOBS: {
        uint32_t n = *(const uint32_t *) ((const char *) self + fd->count_offset);
        if (n > fd->max)
            return kiln_error (err, KILN_ELIMIT, "field '%s' has %u entries, more than %llu",
                               fd->name, n, (unsigned long long) fd->max);
        return 0;
    }
    }
    return 0;
}

static void
s_pack_value (msgpack_packer *pk, const kiln_msg_t *self, const s_field_t *fd)
{
    const void *m = s_member (self, fd);
    kiln_mpk_pack_cstr (pk, fd->name);
    switch (fd->kind) {
    case FK_U64:  msgpack_pack_uint64 (pk, *(const uint64_t *) m); break;
    case FK_I64:  msgpack_pack_int64 (pk, *(const int64_t *) m); break;
    case FK_SINT: msgpack_pack_int64 (pk, *(const int64_t *) m); break;
    case FK_STRS: {
        char *const *list = *(char **const *) m;
        uint32_t n = *(const uint32_t *) ((const char *) self + fd->count_offset);
        msgpack_pack_array (pk, n);
        for (uint32_t i = 0; i < n; i++)
            kiln_mpk_pack_cstr (pk, list[i]);
        break;
    }
    case FK_BOOL:
        if (*(const bool *) m)
            msgpack_pack_true (pk);
        else
            msgpack_pack_false (pk);
        break;
    case FK_STR:  kiln_mpk_pack_cstr (pk, *(char *const *) m); break;
    case FK_HEX:  kiln_mpk_pack_cstr (pk, (const char *) m); break;
    case FK_BLOBS: {
        const kiln_blob_ref_t *blobs = *(kiln_blob_ref_t *const *) m;
        uint32_t n = *(const uint32_t *) ((const char *) self + fd->count_offset);
        msgpack_pack_array (pk, n);
        for (uint32_t i = 0; i < n; i++) {
            char hex[KILN_HEX_LEN];
            kiln_hex (blobs[i].digest, KILN_DIGEST_LEN, hex);
            msgpack_pack_map (pk, blobs[i].in_msg ? 3 : 2);
            kiln_mpk_pack_kv_str (pk, "digest", hex);
            kiln_mpk_pack_cstr (pk, "size");
            msgpack_pack_uint64 (pk, blobs[i].size);
            if (blobs[i].in_msg)
                kiln_mpk_pack_kv_bool (pk, "inline", true);
        }
        break;
    }
    }
}

/* Encode; a by-reference chunk is left out of the frames (but counted in
 * the header) and handed to *ref (data, len, free_fn, hint) for the
 * caller to send. */
typedef struct {
    const void *data;
    size_t len;
    zmq_free_fn *free_fn;
    void *hint;
} s_ref_t;

static zmsg_t *
s_encode (kiln_msg_t **self_p, s_ref_t *ref, kiln_err_t *err)
{
    kiln_msg_t *self = *self_p;
    *self_p = NULL;
    memset (ref, 0, sizeof *ref);
    zmsg_t *out = NULL;
    msgpack_sbuffer sbuf;
    msgpack_sbuffer_init (&sbuf);
    if (!self || (unsigned) self->cmd >= KILN_CMD_COUNT) {
        kiln_error (err, KILN_EINVAL, "no message or unknown command");
        goto done;
    }
    const s_cmd_t *cmd = &s_cmds[self->cmd];
    uint32_t entries = 3;
    for (size_t i = 0; i < cmd->n_spec; i++) {
        const s_field_t *fd = &s_fields[cmd->spec[i].field];
        if (!cmd->spec[i].required && !s_field_present (self, fd))
            continue;
        if (s_check_value (self, fd, err) != 0) {
            kiln_error_prefix (err, "%s", cmd->name);
            goto done;
        }
        entries++;
    }
    if (s_check_layout (self, err) != 0)
        goto done;

    msgpack_packer pk;
    msgpack_packer_init (&pk, &sbuf, msgpack_sbuffer_write);
    msgpack_pack_map (&pk, entries);
    kiln_mpk_pack_kv_i64 (&pk, "v", KILN_PROTO_VERSION);
    kiln_mpk_pack_kv_str (&pk, "cmd", cmd->name);
    kiln_mpk_pack_kv_i64 (&pk, "frames", (int64_t) self->n_frames + (self->ref_data != NULL));
    for (size_t i = 0; i < cmd->n_spec; i++) {
        const s_field_t *fd = &s_fields[cmd->spec[i].field];
        if (cmd->spec[i].required || s_field_present (self, fd))
            s_pack_value (&pk, self, fd);
    }
    if (sbuf.size > KILN_PROTO_MAX_HEADER_BYTES) {
        kiln_error (err, KILN_ELIMIT, "%s header is %zu bytes, more than %u", cmd->name,
                    sbuf.size, KILN_PROTO_MAX_HEADER_BYTES);
        goto done;
    }
    out = zmsg_new ();
    if (!out || zmsg_addmem (out, sbuf.data, sbuf.size) != 0) {
        zmsg_destroy (&out);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < self->n_frames; i++) {
        zmsg_append (out, &self->frames[i]);
    }
    self->n_frames = 0;
    if (self->ref_data) {
        ref->data = self->ref_data;
        ref->len = self->ref_len;
        ref->free_fn = self->ref_free;
        ref->hint = self->ref_hint;
        self->ref_data = NULL;
    }
done:
    msgpack_sbuffer_destroy (&sbuf);
    kiln_msg_destroy (&self);
    return out;
}

zmsg_t *
kiln_msg_encode (kiln_msg_t **self_p, kiln_err_t *err)
{
    s_ref_t ref;
    zmsg_t *out = s_encode (self_p, &ref, err);
    if (out && ref.data) {
        if (zmsg_addmem (out, ref.data, ref.len) != 0) {
            zmsg_destroy (&out);
            kiln_error (err, KILN_ENOMEM, "out of memory");
        }
    }
    if (ref.data && ref.free_fn)
        ref.free_fn ((void *) ref.data, ref.hint);
    return out;
}

/* --- decoding -------------------------------------------------------------- */

/* Copy at most `size`-1 printable bytes of s[0..n) into buf, for quoting
 * a peer's string in an error message. */
static const char *
s_printable (const char *s, size_t n, char *buf, size_t size)
{
    size_t j = 0;
    for (size_t i = 0; i < n && j + 1 < size; i++)
        buf[j++] = isprint ((unsigned char) s[i]) ? s[i] : '?';
    buf[j] = '\0';
    return buf;
}

static int
s_decode_u64 (const msgpack_object *v, const char *name, uint64_t max, uint64_t *out,
              kiln_err_t *err)
{
    if (v->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return kiln_error (err, KILN_EPROTO, "field '%s' is not a non-negative integer", name);
    if (v->via.u64 > max)
        return kiln_error (err, KILN_ELIMIT, "field '%s' is %llu, more than %llu", name,
                           (unsigned long long) v->via.u64, (unsigned long long) max);
    *out = v->via.u64;
    return 0;
}

static int
s_decode_hex (const msgpack_object *v, const char *name, char out[KILN_HEX_LEN],
              kiln_err_t *err)
{
    if (v->type != MSGPACK_OBJECT_STR || v->via.str.size != KILN_HEX_LEN - 1)
        return kiln_error (err, KILN_EPROTO, "field '%s' is not a SHA-256 in hex", name);
    memcpy (out, v->via.str.ptr, KILN_HEX_LEN - 1);
    out[KILN_HEX_LEN - 1] = '\0';
    if (!kiln_is_digest_hex (out)) {
        out[0] = '\0';
        return kiln_error (err, KILN_EPROTO, "field '%s' is not a SHA-256 in hex", name);
    }
    return 0;
}

static int
s_decode_blobs (kiln_msg_t *self, const s_field_t *fd, const msgpack_object *v,
                kiln_err_t *err)
{
    if (v->type != MSGPACK_OBJECT_ARRAY)
        return kiln_error (err, KILN_EPROTO, "field '%s' is not an array", fd->name);
    uint32_t n = v->via.array.size;
    if (n > fd->max)
        return kiln_error (err, KILN_ELIMIT, "field '%s' has %u entries, more than %llu",
                           fd->name, n, (unsigned long long) fd->max);
    kiln_blob_ref_t *blobs = calloc (n ? n : 1, sizeof *blobs);
    if (!blobs)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    *(kiln_blob_ref_t **) s_member (self, fd) = blobs;
    *(uint32_t *) ((char *) self + fd->count_offset) = n;
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *e = &v->via.array.ptr[i];
        const msgpack_object *d = kiln_mpk_get (e, "digest");
        const msgpack_object *s = kiln_mpk_get (e, "size");
        char hex[KILN_HEX_LEN];
        if (!d || !s)
            return kiln_error (err, KILN_EPROTO, "%s[%u] needs 'digest' and 'size'",
                               fd->name, i);
        if (s_decode_hex (d, "digest", hex, err) != 0
            || s_decode_u64 (s, "size", fd->offset == offsetof (kiln_msg_t, have)
                                            ? KILN_MAX_MEMBER_BYTES : KILN_MAX_BLOB_BYTES,
                             &blobs[i].size, err) != 0)
            return kiln_error_prefix (err, "%s[%u]", fd->name, i);
        kiln_unhex (hex, blobs[i].digest, KILN_DIGEST_LEN);
        const msgpack_object *in = kiln_mpk_get (e, "inline");
        if (in && in->type != MSGPACK_OBJECT_NIL) {
            if (in->type != MSGPACK_OBJECT_BOOLEAN)
                return kiln_error (err, KILN_EPROTO, "%s[%u]: 'inline' is not a boolean",
                                   fd->name, i);
            blobs[i].in_msg = in->via.boolean;
        }
    }
    return 0;
}

static int
s_decode_strs (kiln_msg_t *self, const s_field_t *fd, const msgpack_object *v,
               kiln_err_t *err)
{
    if (v->type != MSGPACK_OBJECT_ARRAY)
        return kiln_error (err, KILN_EPROTO, "field '%s' is not an array", fd->name);
    uint32_t n = v->via.array.size;
    if (n > fd->max)
        return kiln_error (err, KILN_ELIMIT, "field '%s' has %u entries, more than %llu",
                           fd->name, n, (unsigned long long) fd->max);
    char **list = calloc (n ? n : 1, sizeof *list);
    if (!list)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    *(char ***) s_member (self, fd) = list;
    uint32_t *count = (uint32_t *) ((char *) self + fd->count_offset);
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *e = &v->via.array.ptr[i];
        if (e->type != MSGPACK_OBJECT_STR)
            return kiln_error (err, KILN_EPROTO, "%s[%u] is not a string", fd->name, i);
        size_t len = e->via.str.size;
        if (len > KILN_PROTO_MAX_TOOLCHAIN)
            return kiln_error (err, KILN_ELIMIT, "%s[%u] is %zu bytes, more than %d", fd->name,
                               i, len, KILN_PROTO_MAX_TOOLCHAIN);
        if (memchr (e->via.str.ptr, '\0', len))
            return kiln_error (err, KILN_EPROTO, "%s[%u] contains a NUL byte", fd->name, i);
        if (!(list[i] = malloc (len + 1)))
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        memcpy (list[i], e->via.str.ptr, len);
        list[i][len] = '\0';
        *count = i + 1;
    }
    return 0;
}

static int
s_decode_field (kiln_msg_t *self, const msgpack_object *hdr, const s_spec_t *spec,
                kiln_err_t *err)
{
    const s_field_t *fd = &s_fields[spec->field];
    const msgpack_object *v = kiln_mpk_get (hdr, fd->name);
    if (!v || v->type == MSGPACK_OBJECT_NIL) {
        if (spec->required)
            return kiln_error (err, KILN_EPROTO, "missing field '%s'", fd->name);
        return 0;
    }
    void *m = s_member (self, fd);
    switch (fd->kind) {
    case FK_U64:
        return s_decode_u64 (v, fd->name, fd->max, m, err);
    case FK_I64: {
        int64_t i;
        if (kiln_mpk_as_i64 (v, &i) != 0 || i < 0 || (uint64_t) i > fd->max)
            return kiln_error (err, KILN_EPROTO, "field '%s' is not an integer in 0..%llu",
                               fd->name, (unsigned long long) fd->max);
        *(int64_t *) m = i;
        return 0;
    }
    case FK_SINT: {
        int64_t i;
        if (kiln_mpk_as_i64 (v, &i) != 0 || i < -(int64_t) fd->max || i > (int64_t) fd->max)
            return kiln_error (err, KILN_EPROTO, "field '%s' is not an integer in -%llu..%llu",
                               fd->name, (unsigned long long) fd->max,
                               (unsigned long long) fd->max);
        *(int64_t *) m = i;
        return 0;
    }
    case FK_STRS:
        return s_decode_strs (self, fd, v, err);
    case FK_BOOL:
        if (v->type != MSGPACK_OBJECT_BOOLEAN)
            return kiln_error (err, KILN_EPROTO, "field '%s' is not a boolean", fd->name);
        *(bool *) m = v->via.boolean;
        return 0;
    case FK_STR: {
        if (v->type != MSGPACK_OBJECT_STR)
            return kiln_error (err, KILN_EPROTO, "field '%s' is not a string", fd->name);
        size_t n = v->via.str.size;
        if (n > fd->max)
            return kiln_error (err, KILN_ELIMIT, "field '%s' is %zu bytes, more than %llu",
                               fd->name, n, (unsigned long long) fd->max);
        if (memchr (v->via.str.ptr, '\0', n))
            return kiln_error (err, KILN_EPROTO, "field '%s' contains a NUL byte", fd->name);
        char *s = malloc (n + 1);
        if (!s)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        memcpy (s, v->via.str.ptr, n);
        s[n] = '\0';
        *(char **) m = s;
        return 0;
    }
    case FK_HEX:
        return s_decode_hex (v, fd->name, m, err);
    case FK_BLOBS:
        return s_decode_blobs (self, fd, v, err);
    }
    return 0;
}

kiln_msg_t *
kiln_msg_decode (zmsg_t **raw_p, uint64_t *req_id, kiln_err_t *err)
{
    zmsg_t *raw = raw_p ? *raw_p : NULL;
    if (raw_p)
        *raw_p = NULL;
    if (req_id)
        *req_id = 0;
    kiln_msg_t *msg = NULL;
    zframe_t *hdr = raw ? zmsg_pop (raw) : NULL;
    msgpack_unpacked up;
    msgpack_unpacked_init (&up);
    char quoted[80];

    if (!hdr) {
        kiln_error (err, KILN_EPROTO, "empty message");
        goto fail;
    }
    const uint8_t *data = zframe_data (hdr);
    size_t len = zframe_size (hdr);
    if (len > KILN_PROTO_MAX_HEADER_BYTES) {
        kiln_error (err, KILN_ELIMIT, "header frame is %zu bytes, more than %u", len,
                    KILN_PROTO_MAX_HEADER_BYTES);
        goto fail;
    }
    size_t pos = 0;
    if (len == 0 || kiln_mpk_check (data, len, KILN_PROTO_MAX_DEPTH, KILN_PROTO_MAX_OBJECTS, "header", &pos, NULL) != 0 || pos != len) {
        kiln_error (err, KILN_EFORMAT,
                    "header is not one well-formed msgpack object (%zu bytes)", len);
        goto fail;
    }
    size_t off = 0;
    if (msgpack_unpack_next (&up, (const char *) data, len, &off) != MSGPACK_UNPACK_SUCCESS
        || off != len) {
        kiln_error (err, KILN_EFORMAT, "header is not one well-formed msgpack object");
        goto fail;
    }
    const msgpack_object *h = &up.data;
    if (h->type != MSGPACK_OBJECT_MAP) {
        kiln_error (err, KILN_EFORMAT, "header is not a msgpack map");
        goto fail;
    }
    const msgpack_object *o = kiln_mpk_get (h, "req_id");
    if (req_id && o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        *req_id = o->via.u64;

    int64_t version;
    o = kiln_mpk_get (h, "v");
    if (!o || kiln_mpk_as_i64 (o, &version) != 0) {
        kiln_error (err, KILN_EPROTO, "missing protocol version 'v'");
        goto fail;
    }
    if (version != KILN_PROTO_VERSION) {
        kiln_error (err, KILN_EPROTO, "protocol version %lld is not supported (this peer speaks %d)",
                    (long long) version, KILN_PROTO_VERSION);
        goto fail;
    }
    o = kiln_mpk_get (h, "cmd");
    if (!o || o->type != MSGPACK_OBJECT_STR) {
        kiln_error (err, KILN_EPROTO, "missing command 'cmd'");
        goto fail;
    }
    int cmd = kiln_cmd_lookup (o->via.str.ptr, o->via.str.size);
    if (cmd < 0) {
        kiln_error (err, KILN_EPROTO, "unknown command '%s'",
                    s_printable (o->via.str.ptr, o->via.str.size, quoted, 65));
        goto fail;
    }
    const s_cmd_t *spec = &s_cmds[cmd];
    uint64_t frames = 0;
    o = kiln_mpk_get (h, "frames");
    if (!o) {
        kiln_error (err, KILN_EPROTO, "%s: missing field 'frames'", spec->name);
        goto fail;
    }
    if (s_decode_u64 (o, "frames", KILN_MAX_FRAMES, &frames, err) != 0) {
        kiln_error_prefix (err, "%s", spec->name);
        goto fail;
    }
    if (frames != zmsg_size (raw)) {
        kiln_error (err, KILN_EPROTO, "%s: header announces %llu payload frames, %zu arrived",
                    spec->name, (unsigned long long) frames, zmsg_size (raw));
        goto fail;
    }
    msg = kiln_msg_new ((kiln_cmd_t) cmd);
    if (!msg) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < spec->n_spec; i++)
        if (s_decode_field (msg, h, &spec->spec[i], err) != 0) {
            kiln_error_prefix (err, "%s", spec->name);
            goto fail;
        }
    if (frames) {
        msg->frames = calloc ((size_t) frames, sizeof *msg->frames);
        if (!msg->frames) {
            kiln_error (err, KILN_ENOMEM, "out of memory");
            goto fail;
        }
        msg->cap_frames = (size_t) frames;
    }
    for (size_t i = 0; i < frames; i++) {
        zframe_t *f = zmsg_pop (raw);
        if (zframe_size (f) > KILN_CHUNK_BYTES) {
            kiln_error (err, KILN_ELIMIT, "%s: payload frame %zu is %zu bytes, more than the "
                        "chunk size %u", spec->name, i, zframe_size (f), KILN_CHUNK_BYTES);
            zframe_destroy (&f);
            goto fail;
        }
        msg->frames[msg->n_frames++] = f;
    }
    if (spec->payload == KILN_PAYLOAD_PART && (msg->length || msg->member[0])) {
        /* a PART answering a GET with `have`: any range inside the
         * artifact, at most a chunk of bytes unless it is a held member */
        uint64_t whole = s_whole_size (msg);
        if (msg->length == 0 || msg->offset >= whole || msg->length > whole - msg->offset
            || (!msg->member[0] && msg->length > KILN_CHUNK_BYTES)) {
            kiln_error (err, KILN_EPROTO, "%s: bytes %llu + %llu are not a part of a "
                        "%llu-byte artifact", spec->name, (unsigned long long) msg->offset,
                        (unsigned long long) msg->length, (unsigned long long) whole);
            goto fail;
        }
    }
    else if (s_is_chunk (spec->payload)
        && (msg->offset % KILN_CHUNK_BYTES != 0
            || (msg->offset >= s_whole_size (msg)
                && !(msg->offset == 0 && s_whole_size (msg) == 0)))) {
        kiln_error (err, KILN_EPROTO, "%s: offset %llu is not a chunk boundary inside a "
                    "%llu-byte %s", spec->name, (unsigned long long) msg->offset,
                    (unsigned long long) s_whole_size (msg),
                    spec->payload == KILN_PAYLOAD_PART ? "artifact" : "blob");
        goto fail;
    }
    if (s_check_layout (msg, err) != 0)
        goto fail;
    msgpack_unpacked_destroy (&up);
    zframe_destroy (&hdr);
    zmsg_destroy (&raw);
    return msg;
fail:
    msgpack_unpacked_destroy (&up);
    zframe_destroy (&hdr);
    zmsg_destroy (&raw);
    kiln_msg_destroy (&msg);
    return NULL;
}

/* --- sockets ----------------------------------------------------------------- */

/* The req_id of a header that could not be decoded as a whole, or 0. */
static uint64_t
s_peek_req_id (zframe_t *hdr)
{
    const uint8_t *data = zframe_data (hdr);
    size_t len = zframe_size (hdr), pos = 0, off = 0;
    uint64_t id = 0;
    if (len == 0 || len > KILN_PROTO_MAX_HEADER_BYTES
        || kiln_mpk_check (data, len, KILN_PROTO_MAX_DEPTH, KILN_PROTO_MAX_OBJECTS, "header", &pos, NULL) != 0)
        return 0;
    msgpack_unpacked up;
    msgpack_unpacked_init (&up);
    if (msgpack_unpack_next (&up, (const char *) data, len, &off) == MSGPACK_UNPACK_SUCCESS) {
        const msgpack_object *o = kiln_mpk_get (&up.data, "req_id");
        if (o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
            id = o->via.u64;
    }
    msgpack_unpacked_destroy (&up);
    return id;
}

/* Copy a frame's metadata property into buf (empty when absent). */
static void
s_meta (zframe_t *frame, const char *property, char *buf, size_t size)
{
    const char *value = zframe_meta (frame, property);
    snprintf (buf, size, "%s", value ? value : "");
}

kiln_msg_t *
kiln_msg_recv (zsock_t *sock, zframe_t **routing_id, uint64_t *req_id, kiln_err_t *err)
{
    return kiln_msg_recv_peer (sock, routing_id, NULL, req_id, err);
}

kiln_msg_t *
kiln_msg_recv_peer (zsock_t *sock, zframe_t **routing_id, kiln_peer_t *peer,
                    uint64_t *req_id, kiln_err_t *err)
{
    if (req_id)
        *req_id = 0;
    if (peer)
        memset (peer, 0, sizeof *peer);
    if (routing_id)
        *routing_id = NULL;
    zmsg_t *raw = zmsg_new ();
    if (!raw) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    /* A multipart message arrives whole, so this loop ends after the
     * frames the peer sent.  Frames are checked against their bounds as
     * they come; after the first violation they are only counted, so that
     * a message cannot make the receiver hold more than one message's
     * worth of bounded frames. */
    kiln_err_t bad = { 0 };
    size_t count = 0;
    bool first = true;
    while (true) {
        zframe_t *f = zframe_recv (sock);
        if (!f) {
            if (first)
                kiln_error (err, zsys_interrupted ? KILN_ECANCELED : KILN_EIO,
                            "receive failed: %s", zmq_strerror (zmq_errno ()));
            else
                kiln_error (err, KILN_EIO, "message cut short: %s",
                            zmq_strerror (zmq_errno ()));
            zmsg_destroy (&raw);
            return NULL;
        }
        bool more = zframe_more (f);
        if (routing_id && first) {
            first = false;
            *routing_id = f;
            if (!more)
                break;
            continue;
        }
        first = false;
        size_t size = zframe_size (f);
        if (count == 0 && peer) {
            s_meta (f, "User-Id", peer->key, sizeof peer->key);
            if (peer->key[0]) {
                s_meta (f, "name", peer->name, sizeof peer->name);
                s_meta (f, "role", peer->role, sizeof peer->role);
            }
        }
        if (!bad.code) {
            if (count > KILN_MAX_FRAMES)
                kiln_error (&bad, KILN_ELIMIT, "message has more than %d frames",
                            KILN_MAX_FRAMES + 1);
            else if (count == 0 && size > KILN_PROTO_MAX_HEADER_BYTES)
                kiln_error (&bad, KILN_ELIMIT, "header frame is %zu bytes, more than %u",
                            size, KILN_PROTO_MAX_HEADER_BYTES);
            else if (count > 0 && size > KILN_CHUNK_BYTES)
                kiln_error (&bad, KILN_ELIMIT, "payload frame %zu is %zu bytes, more than the "
                            "chunk size %u", count - 1, size, KILN_CHUNK_BYTES);
        }
        if (!bad.code || count == 0)
            zmsg_append (raw, &f);
        else
            zframe_destroy (&f);
        count++;
        if (!more)
            break;
    }
    if (bad.code) {
        zframe_t *hdr = zmsg_first (raw);
        if (req_id && hdr)
            *req_id = s_peek_req_id (hdr);
        zmsg_destroy (&raw);
        if (err)
            *err = bad;
        return NULL;
    }
    return kiln_msg_decode (&raw, req_id, err);
}

int
kiln_msg_send (kiln_msg_t **self_p, zsock_t *sock, zframe_t *routing_id, kiln_err_t *err)
{
    const char *name = *self_p ? kiln_cmd_name ((*self_p)->cmd) : "?";
    s_ref_t ref;
    zmsg_t *m = s_encode (self_p, &ref, err);
    if (!m) {
        if (ref.data && ref.free_fn)
            ref.free_fn ((void *) ref.data, ref.hint);
        return -err->code;
    }
    void *handle = zsock_resolve (sock);
    int rc = 0;
    if (routing_id
        && zmq_send (handle, zframe_data (routing_id), zframe_size (routing_id),
                     ZMQ_SNDMORE) < 0)
        rc = -1;
    /* Frames are handed to ZeroMQ, not copied: a chunk made with
     * kiln_msg_put_chunk_ref goes out of its caller's buffer. */
    while (rc == 0 && zmsg_size (m) > 0) {
        zframe_t *f = zmsg_pop (m);
        if (zframe_send (&f, handle, zmsg_size (m) || ref.data ? ZFRAME_MORE : 0) != 0) {
            zframe_destroy (&f);
            rc = -1;
        }
    }
    if (ref.data) {
        zmq_msg_t part;
        if (rc == 0 && zmq_msg_init_data (&part, (void *) ref.data, ref.len, ref.free_fn,
                                          ref.hint) == 0) {
            if (zmq_msg_send (&part, handle, 0) < 0) {
                rc = -1;
                zmq_msg_close (&part);      /* releases the data through free_fn */
            }
        }
        else if (ref.free_fn)
            ref.free_fn ((void *) ref.data, ref.hint);
    }
    int e = zmq_errno ();
    zmsg_destroy (&m);
    if (rc != 0)
        return kiln_error (err, e == EHOSTUNREACH ? KILN_ENOTFOUND : KILN_EIO,
                           "could not send %s: %s", name,
                           e == EHOSTUNREACH ? "peer is gone" : zmq_strerror (e));
    return 0;
}

void
kiln_proto_socket_defaults (zsock_t *sock)
{
    zsock_set_linger (sock, 0);
    zsock_set_maxmsgsize (sock, (int) KILN_MAX_FRAME_BYTES);
}

bool
kiln_proto_endpoint_is_local (const char *endpoint)
{
    if (!endpoint)
        return false;
    if (strncmp (endpoint, "ipc://", 6) == 0 || strncmp (endpoint, "inproc://", 9) == 0)
        return true;
    if (strncmp (endpoint, "tcp://", 6) != 0)
        return false;
    const char *host = endpoint + 6;
    const char *colon = strrchr (host, ':');
    if (!colon || colon == host || strchr (host, ';'))
        return false;
    char buf[64];
    size_t n = (size_t) (colon - host);
    if (n >= sizeof buf)
        return false;
    memcpy (buf, host, n);
    buf[n] = '\0';
    if (strcmp (buf, "localhost") == 0 || strcmp (buf, "[::1]") == 0)
        return true;
    struct in_addr a;
    if (inet_pton (AF_INET, buf, &a) == 1)
        return (ntohl (a.s_addr) >> 24) == 127;
    return false;
}

bool
kiln_proto_name_ok (const char *name)
{
    size_t n = name ? strlen (name) : 0;
    if (n == 0 || n > KILN_PROTO_MAX_NAME)
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char) name[i];
        if (!isalnum (c) && !strchr ("._:@-", c))
            return false;
    }
    return true;
}

/* --- toolchains ------------------------------------------------------------------ */

bool
kiln_toolchain_word_ok (const char *s)
{
    size_t n = s ? strlen (s) : 0;
    if (n == 0 || n > KILN_PROTO_MAX_ID)
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char) s[i];
        if (!isalnum (c) && !strchr ("._+-", c))
            return false;
    }
    return true;
}

int
kiln_toolchain_parse (const char *text, kiln_toolchain_id_t *out, kiln_err_t *err)
{
    memset (out, 0, sizeof *out);
    char *fields[3] = { out->id, out->version, out->target };
    const char *p = text ? text : "";
    for (int i = 0; i < 3; i++) {
        const char *end = i < 2 ? strchr (p, ' ') : p + strlen (p);
        if (!end || (size_t) (end - p) > KILN_PROTO_MAX_ID)
            return kiln_error (err, KILN_EPROTO, "toolchain '%.200s' is not \"ID VERSION TARGET\"",
                               text ? text : "");
        memcpy (fields[i], p, (size_t) (end - p));
        fields[i][end - p] = '\0';
        if (!kiln_toolchain_word_ok (fields[i]))
            return kiln_error (err, KILN_EPROTO, "toolchain '%.200s': '%s' is not 1..%d characters "
                               "of [A-Za-z0-9._+-]", text ? text : "", fields[i],
                               KILN_PROTO_MAX_ID);
        p = end + (i < 2);
    }
    return 0;
}

char *
kiln_toolchain_format (const kiln_toolchain_id_t *tc, char *buf, size_t size)
{
    snprintf (buf, size, "%s %s %s", tc->id, tc->version, tc->target);
    return buf;
}

/* --- CurveZMQ ---------------------------------------------------------------------- */

int
kiln_proto_curve_client (zsock_t *sock, const char *cert, const char *broker_cert,
                         kiln_err_t *err)
{
    if (!zsys_has_curve ())
        return kiln_error (err, KILN_EUNSUPPORTED, "this libzmq has no CurveZMQ");
    zcert_t *mine = zcert_load (cert);
    if (!mine)
        return kiln_error (err, KILN_EIO, "could not load the certificate '%s' (and its "
                           "secret part '%s_secret')", cert, cert);
    zcert_t *server = zcert_load (broker_cert);
    if (!server) {
        zcert_destroy (&mine);
        return kiln_error (err, KILN_EIO, "could not load the broker's certificate '%s'",
                           broker_cert);
    }
    static const uint8_t zero[32] = { 0 };
    if (memcmp (zcert_secret_key (mine), zero, 32) == 0) {
        zcert_destroy (&mine);
        zcert_destroy (&server);
        return kiln_error (err, KILN_EINVAL, "certificate '%s' has no secret key (is "
                           "'%s_secret' there?)", cert, cert);
    }
    zcert_apply (mine, sock);
    zsock_set_curve_serverkey (sock, zcert_public_txt (server));
    zcert_destroy (&mine);
    zcert_destroy (&server);
    return 0;
}
