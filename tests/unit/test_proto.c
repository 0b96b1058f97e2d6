/* Unit tests of the wire protocol: every command survives an encode/decode
 * round trip with its fields and payload, and malformed headers, sizes and
 * layouts are refused with an error that says what is wrong. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "common/kiln_fs.h"
#include "common/kiln_mpk.h"
#include "common/kiln_proto.h"

static const char *HEX_A = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
static const char *HEX_B = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/* Encode then decode `msg`; fails the test when either step fails. */
static kiln_msg_t *
s_round_trip (kiln_msg_t *msg)
{
    kiln_err_t err = { 0 };
    zmsg_t *raw = kiln_msg_encode (&msg, &err);
    ck_assert_msg (raw != NULL, "encode: %s", err.msg);
    ck_assert_ptr_null (msg);
    uint64_t req = 99;
    kiln_msg_t *back = kiln_msg_decode (&raw, &req, &err);
    ck_assert_msg (back != NULL, "decode: %s", err.msg);
    ck_assert_ptr_null (raw);
    return back;
}

/* Decode a raw message made of `hdr` (msgpack bytes) and `n` payload
 * frames of the given sizes; returns the error code (0 on success). */
static int
s_decode_raw (const void *hdr, size_t len, const size_t *sizes, size_t n,
              kiln_err_t *err, uint64_t *req)
{
    zmsg_t *raw = zmsg_new ();
    zmsg_addmem (raw, hdr, len);
    for (size_t i = 0; i < n; i++) {
        uint8_t *buf = calloc (1, sizes[i] ? sizes[i] : 1);
        zmsg_addmem (raw, buf, sizes[i]);
        free (buf);
    }
    kiln_err_clear (err);
    kiln_msg_t *msg = kiln_msg_decode (&raw, req, err);
    int code = msg ? 0 : err->code;
    ck_assert_msg (msg || err->msg[0], "an error without a message");
    kiln_msg_destroy (&msg);
    return code;
}

/* A header map packed by hand: "v", "cmd", "frames" and extra pairs. */
typedef struct {
    msgpack_sbuffer sbuf;
    msgpack_packer pk;
} s_hdr_t;

static void
s_hdr_begin (s_hdr_t *h, uint32_t entries)
{
    msgpack_sbuffer_init (&h->sbuf);
    msgpack_packer_init (&h->pk, &h->sbuf, msgpack_sbuffer_write);
    msgpack_pack_map (&h->pk, entries);
}

static void
s_hdr_end (s_hdr_t *h)
{
    msgpack_sbuffer_destroy (&h->sbuf);
}

START_TEST (test_compile_round_trips_with_structure_and_chunked_blobs)
{
    kiln_err_t err = { 0 };
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_COMPILE);
    m->req_id = 7;
    strcpy (m->graph_digest, HEX_A);
    strcpy (m->action_key, HEX_B);
    kiln_msg_set_str (&m->compiler_args, "--optlevel 1");
    kiln_msg_set_str (&m->compiler_id, "kiln-builtin");
    kiln_msg_set_str (&m->compiler_version, "0.1.0");
    kiln_msg_set_str (&m->target, "cpu-x86_64");
    const char structure[] = "structure bytes";
    ck_assert_int_eq (kiln_msg_put_structure (m, structure, sizeof structure, &err), 0);
    /* one blob larger than a chunk, one small, one empty */
    size_t big = KILN_CHUNK_BYTES + 12345;
    uint8_t *b1 = malloc (big);
    for (size_t i = 0; i < big; i++)
        b1[i] = (uint8_t) (i * 7);
    uint8_t d1[KILN_DIGEST_LEN], d2[KILN_DIGEST_LEN], d3[KILN_DIGEST_LEN];
    kiln_sha256 (b1, big, d1);
    kiln_sha256 ("xy", 2, d2);
    kiln_sha256 ("", 0, d3);
    ck_assert_int_eq (kiln_msg_put_blob (m, d1, b1, big, &err), 0);
    ck_assert_int_eq (kiln_msg_put_blob (m, d2, "xy", 2, &err), 0);
    ck_assert_int_eq (kiln_msg_put_blob (m, d3, "", 0, &err), 0);
    ck_assert_uint_eq (m->n_frames, 1 + 2 + 1);

    kiln_msg_t *b = s_round_trip (m);
    ck_assert_int_eq (b->cmd, KILN_CMD_COMPILE);
    ck_assert_uint_eq (b->req_id, 7);
    ck_assert_str_eq (b->graph_digest, HEX_A);
    ck_assert_str_eq (b->action_key, HEX_B);
    ck_assert_str_eq (b->compiler_args, "--optlevel 1");
    ck_assert_str_eq (b->compiler_id, "kiln-builtin");
    ck_assert_str_eq (b->compiler_version, "0.1.0");
    ck_assert_str_eq (b->target, "cpu-x86_64");
    ck_assert_uint_eq (b->struct_size, sizeof structure);
    ck_assert_uint_eq (b->n_blobs, 3);
    ck_assert_mem_eq (b->blobs[0].digest, d1, KILN_DIGEST_LEN);
    ck_assert_uint_eq (b->blobs[0].size, big);
    ck_assert_uint_eq (b->blobs[2].size, 0);

    uint8_t *data;
    size_t len;
    ck_assert_int_eq (kiln_msg_part (b, 0, &data, &len, &err), 0);
    ck_assert_uint_eq (len, sizeof structure);
    ck_assert_mem_eq (data, structure, len);
    free (data);
    ck_assert_int_eq (kiln_msg_part (b, 1, &data, &len, &err), 0);
    ck_assert_uint_eq (len, big);
    ck_assert_mem_eq (data, b1, big);
    free (data);
    ck_assert_int_eq (kiln_msg_part (b, 2, &data, &len, &err), 0);
    ck_assert_mem_eq (data, "xy", 2);
    free (data);
    ck_assert_int_eq (kiln_msg_part (b, 3, &data, &len, &err), 0);
    ck_assert_uint_eq (len, 0);
    free (data);
    ck_assert_int_lt (kiln_msg_part (b, 4, &data, &len, &err), 0);
    free (b1);
    kiln_msg_destroy (&b);
    ck_assert_ptr_null (b);
}
END_TEST

START_TEST (test_result_and_done_round_trip_with_artifact_bytes)
{
    kiln_err_t err = { 0 };
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_RESULT);
    m->req_id = 3;
    strcpy (m->artifact, HEX_A);
    strcpy (m->action_key, HEX_B);
    strcpy (m->graph_digest, HEX_B);
    m->cached = true;
    ck_assert_int_eq (kiln_msg_put_artifact (m, "ARCHIVE", 7, &err), 0);
    kiln_msg_t *b = s_round_trip (m);
    ck_assert_int_eq (b->cmd, KILN_CMD_RESULT);
    ck_assert (b->cached);
    ck_assert_ptr_null (b->worker);     /* optional and absent */
    ck_assert_uint_eq (b->artifact_size, 7);
    uint8_t *data;
    size_t len;
    ck_assert_int_eq (kiln_msg_part (b, 0, &data, &len, &err), 0);
    ck_assert_mem_eq (data, "ARCHIVE", 7);
    free (data);
    kiln_msg_destroy (&b);

    m = kiln_msg_new (KILN_CMD_DONE);
    m->job_id = 41;
    m->ok = false;
    m->code = KILN_ECOMPILE;
    kiln_msg_set_str (&m->message, "kiln-cc exited with status 1");
    kiln_msg_set_str (&m->log, "error: node 'x' (Conv): bad shape\n");
    b = s_round_trip (m);
    ck_assert_int_eq (b->cmd, KILN_CMD_DONE);
    ck_assert_uint_eq (b->job_id, 41);
    ck_assert (!b->ok);
    ck_assert_int_eq (b->code, KILN_ECOMPILE);
    ck_assert_str_eq (b->log, "error: node 'x' (Conv): bad shape\n");
    ck_assert_uint_eq (b->artifact_size, 0);
    ck_assert_uint_eq (b->n_frames, 0);
    kiln_msg_destroy (&b);

    m = kiln_msg_new (KILN_CMD_DONE);
    m->job_id = 42;
    m->ok = true;
    ck_assert_int_eq (kiln_msg_put_artifact (m, "tar", 3, &err), 0);
    b = s_round_trip (m);
    ck_assert (b->ok);
    ck_assert_uint_eq (b->artifact_size, 3);
    kiln_msg_destroy (&b);
}
END_TEST

START_TEST (test_small_commands_round_trip)
{
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_READY);
    kiln_msg_set_str (&m->name, "host-1:123");
    m->slots = 4;
    kiln_msg_add_strs (&m->toolchains, &m->n_toolchains, "kiln-builtin 0.1.0 cpu-x86_64");
    kiln_msg_add_strs (&m->toolchains, &m->n_toolchains, "neuronx-cc 2.1 trn1");
    kiln_msg_t *b = s_round_trip (m);
    ck_assert_int_eq (b->cmd, KILN_CMD_READY);
    ck_assert_str_eq (b->name, "host-1:123");
    ck_assert_uint_eq (b->slots, 4);
    ck_assert_uint_eq (b->n_toolchains, 2);
    ck_assert_str_eq (b->toolchains[1], "neuronx-cc 2.1 trn1");
    ck_assert_uint_eq (b->n_blobs, 0);
    kiln_msg_destroy (&b);

    m = kiln_msg_new (KILN_CMD_ERROR);
    m->req_id = 5;
    kiln_msg_set_error (m, -KILN_EPROTO, "unknown command 'X'", NULL);
    b = s_round_trip (m);
    ck_assert_int_eq (b->cmd, KILN_CMD_ERROR);
    ck_assert_uint_eq (b->req_id, 5);
    ck_assert_int_eq (b->code, KILN_EPROTO);
    ck_assert_str_eq (b->message, "unknown command 'X'");
    ck_assert_ptr_null (b->log);
    kiln_msg_destroy (&b);

    m = kiln_msg_new (KILN_CMD_PING);
    m->req_id = 1;
    b = s_round_trip (m);
    ck_assert_int_eq (b->cmd, KILN_CMD_PING);
    kiln_msg_destroy (&b);

    m = kiln_msg_new (KILN_CMD_PONG);
    m->req_id = 1;
    kiln_msg_set_str (&m->broker, "b");
    m->workers = 2;
    m->idle_slots = 2;
    b = s_round_trip (m);
    ck_assert_uint_eq (b->workers, 2);
    ck_assert_uint_eq (b->queued, 0);
    kiln_msg_destroy (&b);

    kiln_cmd_t bare[] = { KILN_CMD_HEARTBEAT, KILN_CMD_DISCONNECT };
    for (size_t i = 0; i < 2; i++) {
        b = s_round_trip (kiln_msg_new (bare[i]));
        ck_assert_int_eq (b->cmd, bare[i]);
        kiln_msg_destroy (&b);
    }

    kiln_err_t err = { 0 };
    m = kiln_msg_new (KILN_CMD_JOB);
    m->job_id = 9;
    strcpy (m->action_key, HEX_A);
    strcpy (m->graph_digest, HEX_B);
    kiln_msg_set_str (&m->compiler_id, "kiln-builtin");
    kiln_msg_set_str (&m->compiler_version, "0.1.0");
    kiln_msg_set_str (&m->target, "cpu-x86_64");
    ck_assert_int_eq (kiln_msg_put_structure (m, "s", 1, &err), 0);
    b = s_round_trip (m);
    ck_assert_int_eq (b->cmd, KILN_CMD_JOB);
    ck_assert_uint_eq (b->job_id, 9);
    ck_assert_ptr_null (b->compiler_args);
    ck_assert_uint_eq (b->n_blobs, 0);
    kiln_msg_destroy (&b);
}
END_TEST

START_TEST (test_encoder_refuses_missing_and_oversize_fields)
{
    kiln_err_t err = { 0 };
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_READY);
    m->slots = 1;     /* no name, no compiler */
    ck_assert_ptr_null (kiln_msg_encode (&m, &err));
    ck_assert_ptr_null (m);
    ck_assert_int_eq (err.code, KILN_EPROTO);
    ck_assert_ptr_nonnull (strstr (err.msg, "name"));

    m = kiln_msg_new (KILN_CMD_READY);
    kiln_msg_set_str (&m->name, "w");
    kiln_msg_set_str (&m->compiler_id, "c");
    kiln_msg_set_str (&m->compiler_version, "v");
    kiln_msg_set_str (&m->target, "t");
    m->slots = KILN_PROTO_MAX_SLOTS + 1;
    ck_assert_ptr_null (kiln_msg_encode (&m, &err));
    ck_assert_int_eq (err.code, KILN_ELIMIT);
    ck_assert_ptr_nonnull (strstr (err.msg, "slots"));

    m = kiln_msg_new (KILN_CMD_RESULT);
    m->req_id = 1;
    strcpy (m->artifact, "not-hex");
    strcpy (m->action_key, HEX_A);
    strcpy (m->graph_digest, HEX_A);
    ck_assert_ptr_null (kiln_msg_encode (&m, &err));
    ck_assert_ptr_nonnull (strstr (err.msg, "artifact"));

    /* the structure must come first */
    m = kiln_msg_new (KILN_CMD_COMPILE);
    uint8_t d[KILN_DIGEST_LEN] = { 0 };
    ck_assert_int_eq (kiln_msg_put_blob (m, d, "x", 1, &err), 0);
    ck_assert_int_lt (kiln_msg_put_structure (m, "s", 1, &err), 0);
    kiln_msg_destroy (&m);
    /* no artifact on a PING */
    m = kiln_msg_new (KILN_CMD_PING);
    ck_assert_int_lt (kiln_msg_put_artifact (m, "x", 1, &err), 0);
    kiln_msg_destroy (&m);
}
END_TEST

START_TEST (test_truncated_headers_are_refused_at_every_length)
{
    kiln_err_t err = { 0 };
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_COMPILE);
    m->req_id = 12;
    strcpy (m->graph_digest, HEX_A);
    strcpy (m->action_key, HEX_B);
    kiln_msg_set_str (&m->compiler_id, "kiln-builtin");
    kiln_msg_set_str (&m->compiler_version, "0.1.0");
    kiln_msg_set_str (&m->target, "cpu-x86_64");
    uint8_t d[KILN_DIGEST_LEN] = { 1 };
    kiln_msg_put_structure (m, "s", 1, &err);
    kiln_msg_put_blob (m, d, "b", 1, &err);
    zmsg_t *raw = kiln_msg_encode (&m, &err);
    ck_assert_ptr_nonnull (raw);
    zframe_t *hdr = zmsg_first (raw);
    size_t len = zframe_size (hdr);
    uint8_t *bytes = malloc (len);
    memcpy (bytes, zframe_data (hdr), len);
    zmsg_destroy (&raw);

    size_t sizes[] = { 1, 1 };
    for (size_t cut = 0; cut < len; cut++) {
        int code = s_decode_raw (bytes, cut, sizes, 2, &err, NULL);
        ck_assert_msg (code == KILN_EFORMAT, "cut at %zu gave %d (%s)", cut, code, err.msg);
    }
    ck_assert_int_eq (s_decode_raw (bytes, len, sizes, 2, &err, NULL), 0);
    /* trailing garbage after a whole header */
    uint8_t *longer = malloc (len + 1);
    memcpy (longer, bytes, len);
    longer[len] = 0x00;
    ck_assert_int_eq (s_decode_raw (longer, len + 1, sizes, 2, &err, NULL), KILN_EFORMAT);
    free (longer);
    free (bytes);
}
END_TEST

START_TEST (test_garbage_and_lying_containers_are_refused_without_allocating)
{
    kiln_err_t err = { 0 };
    /* random garbage */
    uint8_t junk[64];
    for (size_t i = 0; i < sizeof junk; i++)
        junk[i] = (uint8_t) (i * 37 + 11);
    ck_assert_int_ne (s_decode_raw (junk, sizeof junk, NULL, 0, &err, NULL), 0);
    /* an array that claims 4 billion elements in 5 bytes */
    const uint8_t huge_array[] = { 0xdd, 0xff, 0xff, 0xff, 0xff };
    ck_assert_int_eq (s_decode_raw (huge_array, sizeof huge_array, NULL, 0, &err, NULL),
                      KILN_EFORMAT);
    /* a map that claims 65535 pairs */
    const uint8_t huge_map[] = { 0xde, 0xff, 0xff, 0x01, 0x02 };
    ck_assert_int_eq (s_decode_raw (huge_map, sizeof huge_map, NULL, 0, &err, NULL),
                      KILN_EFORMAT);
    /* a string that claims more bytes than there are */
    const uint8_t long_str[] = { 0xdb, 0x7f, 0xff, 0xff, 0xff, 'a' };
    ck_assert_int_eq (s_decode_raw (long_str, sizeof long_str, NULL, 0, &err, NULL),
                      KILN_EFORMAT);
    /* deep nesting */
    uint8_t deep[40];
    memset (deep, 0x91, sizeof deep - 1);
    deep[sizeof deep - 1] = 0x01;
    ck_assert_int_eq (s_decode_raw (deep, sizeof deep, NULL, 0, &err, NULL), KILN_EFORMAT);
    /* an extension type */
    const uint8_t ext[] = { 0xd4, 0x01, 0x02 };
    ck_assert_int_eq (s_decode_raw (ext, sizeof ext, NULL, 0, &err, NULL), KILN_EFORMAT);
    /* not a map */
    const uint8_t arr[] = { 0x92, 0x01, 0x02 };
    ck_assert_int_eq (s_decode_raw (arr, sizeof arr, NULL, 0, &err, NULL), KILN_EFORMAT);
    /* no frames at all */
    zmsg_t *empty = zmsg_new ();
    ck_assert_ptr_null (kiln_msg_decode (&empty, NULL, &err));
    ck_assert_int_eq (err.code, KILN_EPROTO);
}
END_TEST

START_TEST (test_wrong_version_is_refused_naming_both_versions)
{
    s_hdr_t h;
    s_hdr_begin (&h, 4);
    kiln_mpk_pack_kv_i64 (&h.pk, "v", KILN_PROTO_VERSION + 1);
    kiln_mpk_pack_kv_str (&h.pk, "cmd", "PING");
    kiln_mpk_pack_kv_i64 (&h.pk, "frames", 0);
    kiln_mpk_pack_kv_i64 (&h.pk, "req_id", 77);
    kiln_err_t err;
    uint64_t req = 0;
    ck_assert_int_eq (s_decode_raw (h.sbuf.data, h.sbuf.size, NULL, 0, &err, &req),
                      KILN_EPROTO);
    ck_assert_ptr_nonnull (strstr (err.msg, "version 3"));
    ck_assert_uint_eq (req, 77);    /* the reply can still name the request */
    s_hdr_end (&h);

    s_hdr_begin (&h, 2);
    kiln_mpk_pack_kv_str (&h.pk, "cmd", "PING");
    kiln_mpk_pack_kv_i64 (&h.pk, "req_id", 1);
    ck_assert_int_eq (s_decode_raw (h.sbuf.data, h.sbuf.size, NULL, 0, &err, NULL),
                      KILN_EPROTO);
    ck_assert_ptr_nonnull (strstr (err.msg, "'v'"));
    s_hdr_end (&h);
}
END_TEST

START_TEST (test_unknown_command_is_refused_by_name)
{
    s_hdr_t h;
    s_hdr_begin (&h, 3);
    kiln_mpk_pack_kv_i64 (&h.pk, "v", KILN_PROTO_VERSION);
    kiln_mpk_pack_kv_str (&h.pk, "cmd", "LAUNCH\x01");
    kiln_mpk_pack_kv_i64 (&h.pk, "frames", 0);
    kiln_err_t err;
    ck_assert_int_eq (s_decode_raw (h.sbuf.data, h.sbuf.size, NULL, 0, &err, NULL),
                      KILN_EPROTO);
    ck_assert_str_eq (err.msg, "unknown command 'LAUNCH?'");
    s_hdr_end (&h);
}
END_TEST

START_TEST (test_missing_and_mistyped_fields_are_named)
{
    kiln_err_t err;
    s_hdr_t h;
    /* PING without req_id */
    s_hdr_begin (&h, 3);
    kiln_mpk_pack_kv_i64 (&h.pk, "v", KILN_PROTO_VERSION);
    kiln_mpk_pack_kv_str (&h.pk, "cmd", "PING");
    kiln_mpk_pack_kv_i64 (&h.pk, "frames", 0);
    ck_assert_int_eq (s_decode_raw (h.sbuf.data, h.sbuf.size, NULL, 0, &err, NULL),
                      KILN_EPROTO);
    ck_assert_str_eq (err.msg, "PING: missing field 'req_id'");
    s_hdr_end (&h);
    /* READY with a string where slots should be */
    s_hdr_begin (&h, 8);
    kiln_mpk_pack_kv_i64 (&h.pk, "v", KILN_PROTO_VERSION);
    kiln_mpk_pack_kv_str (&h.pk, "cmd", "READY");
    kiln_mpk_pack_kv_i64 (&h.pk, "frames", 0);
    kiln_mpk_pack_kv_str (&h.pk, "name", "w");
    kiln_mpk_pack_kv_str (&h.pk, "slots", "many");
    kiln_mpk_pack_kv_str (&h.pk, "compiler_id", "c");
    kiln_mpk_pack_kv_str (&h.pk, "compiler_version", "v");
    kiln_mpk_pack_kv_str (&h.pk, "target", "t");
    ck_assert_int_eq (s_decode_raw (h.sbuf.data, h.sbuf.size, NULL, 0, &err, NULL),
                      KILN_EPROTO);
    ck_assert_ptr_nonnull (strstr (err.msg, "'slots'"));
    s_hdr_end (&h);
    /* a name longer than its bound */
    char name[KILN_PROTO_MAX_NAME + 2];
    memset (name, 'n', sizeof name - 1);
    name[sizeof name - 1] = '\0';
    s_hdr_begin (&h, 8);
    kiln_mpk_pack_kv_i64 (&h.pk, "v", KILN_PROTO_VERSION);
    kiln_mpk_pack_kv_str (&h.pk, "cmd", "READY");
    kiln_mpk_pack_kv_i64 (&h.pk, "frames", 0);
    kiln_mpk_pack_kv_str (&h.pk, "name", name);
    kiln_mpk_pack_kv_i64 (&h.pk, "slots", 1);
    kiln_mpk_pack_kv_str (&h.pk, "compiler_id", "c");
    kiln_mpk_pack_kv_str (&h.pk, "compiler_version", "v");
    kiln_mpk_pack_kv_str (&h.pk, "target", "t");
    ck_assert_int_eq (s_decode_raw (h.sbuf.data, h.sbuf.size, NULL, 0, &err, NULL),
                      KILN_ELIMIT);
    ck_assert_ptr_nonnull (strstr (err.msg, "'name'"));
    s_hdr_end (&h);
}
END_TEST

/* A COMPILE header with one inline blob of `blob_size` declared and `frames`. */
static void
s_compile_header (s_hdr_t *h, uint64_t struct_size, uint64_t blob_size, uint64_t frames)
{
    s_hdr_begin (h, 11);
    kiln_mpk_pack_kv_i64 (&h->pk, "v", KILN_PROTO_VERSION);
    kiln_mpk_pack_kv_str (&h->pk, "cmd", "COMPILE");
    kiln_mpk_pack_kv_i64 (&h->pk, "frames", (int64_t) frames);
    kiln_mpk_pack_kv_i64 (&h->pk, "req_id", 4);
    kiln_mpk_pack_kv_str (&h->pk, "graph_digest", HEX_A);
    kiln_mpk_pack_kv_str (&h->pk, "action_key", HEX_A);
    kiln_mpk_pack_kv_str (&h->pk, "compiler_id", "c");
    kiln_mpk_pack_kv_str (&h->pk, "compiler_version", "v");
    kiln_mpk_pack_kv_str (&h->pk, "target", "t");
    kiln_mpk_pack_kv_i64 (&h->pk, "struct_size", (int64_t) struct_size);
    kiln_mpk_pack_cstr (&h->pk, "blobs");
    msgpack_pack_array (&h->pk, 1);
    msgpack_pack_map (&h->pk, 3);
    kiln_mpk_pack_kv_str (&h->pk, "digest", HEX_B);
    kiln_mpk_pack_kv_i64 (&h->pk, "size", (int64_t) blob_size);
    kiln_mpk_pack_kv_bool (&h->pk, "inline", true);
}

START_TEST (test_payload_that_does_not_match_the_header_is_refused)
{
    kiln_err_t err;
    s_hdr_t h;
    /* good: structure 10 bytes, blob 5 bytes */
    s_compile_header (&h, 10, 5, 2);
    size_t good[] = { 10, 5 };
    ck_assert_int_eq (s_decode_raw (h.sbuf.data, h.sbuf.size, good, 2, &err, NULL), 0);
    /* a frame count that differs from the frames sent */
    size_t three[] = { 10, 5, 1 };
    ck_assert_int_eq (s_decode_raw (h.sbuf.data, h.sbuf.size, three, 3, &err, NULL),
                      KILN_EPROTO);
    ck_assert_ptr_nonnull (strstr (err.msg, "announces"));
    s_hdr_end (&h);
    /* sizes that lie: the blob claims 4 GiB but one 5-byte frame came */
    s_compile_header (&h, 10, 4ULL << 30, 2);
    ck_assert_int_eq (s_decode_raw (h.sbuf.data, h.sbuf.size, good, 2, &err, NULL),
                      KILN_EPROTO);
    s_hdr_end (&h);
    /* a payload frame above the chunk size */
    s_compile_header (&h, KILN_CHUNK_BYTES + 1, 5, 2);
    size_t big[] = { KILN_CHUNK_BYTES + 1, 5 };
    ck_assert_int_eq (s_decode_raw (h.sbuf.data, h.sbuf.size, big, 2, &err, NULL),
                      KILN_ELIMIT);
    ck_assert_ptr_nonnull (strstr (err.msg, "chunk"));
    s_hdr_end (&h);
    /* more frames announced than allowed */
    s_compile_header (&h, 10, 5, KILN_MAX_FRAMES + 1);
    ck_assert_int_eq (s_decode_raw (h.sbuf.data, h.sbuf.size, good, 2, &err, NULL),
                      KILN_ELIMIT);
    s_hdr_end (&h);
}
END_TEST

START_TEST (test_oversize_header_frame_is_refused)
{
    size_t len = KILN_PROTO_MAX_HEADER_BYTES + 1;
    uint8_t *hdr = calloc (1, len);
    kiln_err_t err;
    ck_assert_int_eq (s_decode_raw (hdr, len, NULL, 0, &err, NULL), KILN_ELIMIT);
    free (hdr);
}
END_TEST

START_TEST (test_messages_cross_a_socket_pair_and_too_many_frames_are_drained)
{
    zsock_t *router = zsock_new_router ("inproc://test-proto");
    zsock_t *dealer = zsock_new_dealer ("inproc://test-proto");
    ck_assert_ptr_nonnull (router);
    ck_assert_ptr_nonnull (dealer);
    zsock_set_rcvtimeo (router, 5000);
    zsock_set_rcvtimeo (dealer, 5000);
    kiln_err_t err = { 0 };

    kiln_msg_t *m = kiln_msg_new (KILN_CMD_PING);
    m->req_id = 17;
    ck_assert_int_eq (kiln_msg_send (&m, dealer, NULL, &err), 0);
    zframe_t *rid = NULL;
    uint64_t req = 0;
    kiln_msg_t *got = kiln_msg_recv (router, &rid, &req, &err);
    ck_assert_msg (got != NULL, "%s", err.msg);
    ck_assert_ptr_nonnull (rid);
    ck_assert_uint_eq (got->req_id, 17);
    kiln_msg_destroy (&got);

    /* a reply through the routing id */
    m = kiln_msg_new (KILN_CMD_ERROR);
    m->req_id = 17;
    kiln_msg_set_error (m, KILN_EPROTO, "x", NULL);
    ck_assert_int_eq (kiln_msg_send (&m, router, rid, &err), 0);
    got = kiln_msg_recv (dealer, NULL, NULL, &err);
    ck_assert_ptr_nonnull (got);
    ck_assert_int_eq (got->cmd, KILN_CMD_ERROR);
    kiln_msg_destroy (&got);
    zframe_destroy (&rid);

    /* KILN_MAX_FRAMES + 2 frames: refused, then the socket still works */
    zmsg_t *flood = zmsg_new ();
    for (int i = 0; i < KILN_MAX_FRAMES + 2; i++)
        zmsg_addmem (flood, "x", 1);
    ck_assert_int_eq (zmsg_send (&flood, dealer), 0);
    got = kiln_msg_recv (router, &rid, &req, &err);
    ck_assert_ptr_null (got);
    ck_assert_int_eq (err.code, KILN_ELIMIT);
    ck_assert_ptr_nonnull (rid);
    zframe_destroy (&rid);
    m = kiln_msg_new (KILN_CMD_PING);
    m->req_id = 18;
    ck_assert_int_eq (kiln_msg_send (&m, dealer, NULL, &err), 0);
    got = kiln_msg_recv (router, &rid, &req, &err);
    ck_assert_ptr_nonnull (got);
    ck_assert_uint_eq (got->req_id, 18);
    kiln_msg_destroy (&got);
    zframe_destroy (&rid);

    /* a payload frame over the chunk size is refused as it arrives, and
     * the error still names the request */
    zmsg_t *fat = zmsg_new ();
    s_hdr_t h;
    s_hdr_begin (&h, 4);
    kiln_mpk_pack_kv_i64 (&h.pk, "v", KILN_PROTO_VERSION);
    kiln_mpk_pack_kv_str (&h.pk, "cmd", "PING");
    kiln_mpk_pack_kv_i64 (&h.pk, "frames", 1);
    kiln_mpk_pack_kv_i64 (&h.pk, "req_id", 19);
    zmsg_addmem (fat, h.sbuf.data, h.sbuf.size);
    s_hdr_end (&h);
    uint8_t *big = calloc (1, KILN_CHUNK_BYTES + 1);
    zmsg_addmem (fat, big, KILN_CHUNK_BYTES + 1);
    free (big);
    ck_assert_int_eq (zmsg_send (&fat, dealer), 0);
    req = 0;
    got = kiln_msg_recv (router, &rid, &req, &err);
    ck_assert_ptr_null (got);
    ck_assert_int_eq (err.code, KILN_ELIMIT);
    ck_assert_ptr_nonnull (strstr (err.msg, "chunk size"));
    ck_assert_uint_eq (req, 19);
    zframe_destroy (&rid);

    zsock_destroy (&dealer);
    zsock_destroy (&router);
}
END_TEST

START_TEST (test_only_loopback_endpoints_count_as_local)
{
    ck_assert (kiln_proto_endpoint_is_local ("tcp://127.0.0.1:5555"));
    ck_assert (kiln_proto_endpoint_is_local ("tcp://127.1.2.3:5555"));
    ck_assert (kiln_proto_endpoint_is_local ("tcp://localhost:5555"));
    ck_assert (kiln_proto_endpoint_is_local ("tcp://[::1]:5555"));
    ck_assert (kiln_proto_endpoint_is_local ("ipc:///tmp/kiln.sock"));
    ck_assert (!kiln_proto_endpoint_is_local ("tcp://*:5555"));
    ck_assert (!kiln_proto_endpoint_is_local ("tcp://0.0.0.0:5555"));
    ck_assert (!kiln_proto_endpoint_is_local ("tcp://10.0.0.1:5555"));
    ck_assert (!kiln_proto_endpoint_is_local ("tcp://eth0:5555"));
    ck_assert (!kiln_proto_endpoint_is_local ("tcp://127.0.0.1"));
    ck_assert (!kiln_proto_endpoint_is_local ("tcp://10.0.0.1;127.0.0.1:5555"));
    ck_assert (!kiln_proto_endpoint_is_local ("udp://127.0.0.1:5555"));
    ck_assert (!kiln_proto_endpoint_is_local (NULL));
    ck_assert (kiln_proto_name_ok ("worker-1"));
    ck_assert (kiln_proto_name_ok ("host.example:1234"));
    ck_assert (!kiln_proto_name_ok (""));
    ck_assert (!kiln_proto_name_ok ("a b"));
    ck_assert (!kiln_proto_name_ok ("a\"b"));
}
END_TEST

START_TEST (test_docs_hold_the_tables_generated_from_the_x_macro)
{
    const char *src = getenv ("KILN_SRC");
    char path[4096];
    snprintf (path, sizeof path, "%s/docs/protocol.md", src ? src : ".");
    kiln_err_t err = { 0 };
    uint8_t *doc;
    size_t len;
    ck_assert_msg (kiln_read_file (path, 1 << 20, &doc, &len, &err) == 0, "%s", err.msg);
    char *gen = NULL;
    size_t gen_len = 0;
    FILE *out = open_memstream (&gen, &gen_len);
    kiln_proto_write_doc (out);
    fclose (out);
    ck_assert_msg (strstr ((char *) doc, gen) != NULL,
                   "docs/protocol.md is out of date: regenerate its tables with "
                   "`kiln-broker --protocol-doc`");
    free (gen);
    free (doc);
}
END_TEST

START_TEST (test_blob_refs_and_inline_blobs_mix_in_one_graph_payload)
{
    kiln_err_t err = { 0 };
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_COMPILE);
    m->req_id = 8;
    strcpy (m->graph_digest, HEX_A);
    strcpy (m->action_key, HEX_B);
    kiln_msg_set_str (&m->compiler_id, "kiln-builtin");
    kiln_msg_set_str (&m->compiler_version, "0.1.0");
    kiln_msg_set_str (&m->target, "cpu-x86_64");
    m->priority = -7;
    m->timeout_ms = 1500;
    m->retry_failed = true;
    kiln_msg_set_str (&m->client, "alice@laptop");
    uint8_t d1[KILN_DIGEST_LEN], d2[KILN_DIGEST_LEN], d3[KILN_DIGEST_LEN];
    kiln_sha256 ("a", 1, d1);
    kiln_sha256 ("bb", 2, d2);
    kiln_sha256 ("ccc", 3, d3);
    ck_assert_int_eq (kiln_msg_put_structure (m, "S", 1, &err), 0);
    ck_assert_int_eq (kiln_msg_add_blob_ref (m, d1, 3ULL << 30, &err), 0);   /* by reference */
    ck_assert_int_eq (kiln_msg_put_blob (m, d2, "bb", 2, &err), 0);
    ck_assert_int_eq (kiln_msg_add_blob_ref (m, d3, 3, &err), 0);
    kiln_msg_t *b = s_round_trip (m);
    ck_assert_uint_eq (b->n_blobs, 3);
    ck_assert (!b->blobs[0].in_msg && b->blobs[1].in_msg && !b->blobs[2].in_msg);
    ck_assert_uint_eq (b->blobs[0].size, 3ULL << 30);
    ck_assert_int_eq (b->priority, -7);
    ck_assert_uint_eq (b->timeout_ms, 1500);
    ck_assert (b->retry_failed);
    ck_assert_str_eq (b->client, "alice@laptop");
    uint8_t *data;
    size_t len;
    ck_assert_int_eq (kiln_msg_blob_part (b, 1, &data, &len, &err), 0);
    ck_assert_uint_eq (len, 2);
    ck_assert_mem_eq (data, "bb", 2);
    free (data);
    ck_assert_int_eq (kiln_msg_blob_part (b, 0, &data, &len, &err), -KILN_EINVAL);
    ck_assert_ptr_null (data);
    kiln_msg_destroy (&b);

    /* a priority beyond the bound is refused by the encoder */
    m = kiln_msg_new (KILN_CMD_COMPILE);
    m->req_id = 9;
    strcpy (m->graph_digest, HEX_A);
    strcpy (m->action_key, HEX_B);
    kiln_msg_set_str (&m->compiler_id, "c");
    kiln_msg_set_str (&m->compiler_version, "v");
    kiln_msg_set_str (&m->target, "t");
    kiln_msg_put_structure (m, "S", 1, &err);
    m->priority = -(KILN_PROTO_MAX_PRIORITY + 1);
    ck_assert_ptr_null (kiln_msg_encode (&m, &err));
    ck_assert_int_eq (err.code, KILN_ELIMIT);
    ck_assert_ptr_nonnull (strstr (err.msg, "priority"));
}
END_TEST

static int s_freed;

static void
s_count_free (void *data, void *hint)
{
    s_freed++;
}

START_TEST (test_chunks_round_trip_and_must_sit_on_chunk_boundaries)
{
    kiln_err_t err = { 0 };
    uint64_t size = 2 * (uint64_t) KILN_CHUNK_BYTES + 5;
    uint8_t *blob = calloc (1, KILN_CHUNK_BYTES);
    blob[0] = 42;
    /* the last chunk: 5 bytes */
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_CHUNK);
    strcpy (m->digest, HEX_A);
    m->blob_size = size;
    m->offset = 2 * (uint64_t) KILN_CHUNK_BYTES;
    ck_assert_int_lt (kiln_msg_put_chunk (m, blob, KILN_CHUNK_BYTES, &err), 0);
    ck_assert_int_eq (kiln_msg_put_chunk (m, blob, 5, &err), 0);
    kiln_msg_t *b = s_round_trip (m);
    ck_assert_int_eq (b->cmd, KILN_CMD_CHUNK);
    ck_assert_uint_eq (b->offset, 2 * (uint64_t) KILN_CHUNK_BYTES);
    ck_assert_uint_eq (zframe_size (kiln_msg_chunk_frame (b)), 5);
    ck_assert_int_eq (zframe_data (kiln_msg_chunk_frame (b))[0], 42);
    kiln_msg_destroy (&b);

    /* a full chunk by reference: the buffer is released once, after use */
    s_freed = 0;
    m = kiln_msg_new (KILN_CMD_CHUNK);
    strcpy (m->digest, HEX_A);
    m->blob_size = size;
    m->offset = 0;
    m->job_id = 4;
    ck_assert_int_eq (kiln_msg_put_chunk_ref (m, blob, KILN_CHUNK_BYTES, s_count_free, NULL,
                                              &err), 0);
    b = s_round_trip (m);
    ck_assert_int_eq (s_freed, 1);
    ck_assert_uint_eq (zframe_size (kiln_msg_chunk_frame (b)), KILN_CHUNK_BYTES);
    ck_assert_uint_eq (b->job_id, 4);
    kiln_msg_destroy (&b);
    s_freed = 0;
    m = kiln_msg_new (KILN_CMD_CHUNK);
    strcpy (m->digest, HEX_A);
    m->blob_size = size;
    ck_assert_int_eq (kiln_msg_put_chunk_ref (m, blob, KILN_CHUNK_BYTES, s_count_free, NULL,
                                              &err), 0);
    kiln_msg_destroy (&m);             /* never sent: still released */
    ck_assert_int_eq (s_freed, 1);

    /* offsets off a boundary, or past the end, are refused */
    uint64_t bad[] = { 1, KILN_CHUNK_BYTES + 1, 3 * (uint64_t) KILN_CHUNK_BYTES };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        s_hdr_t h;
        s_hdr_begin (&h, 6);
        kiln_mpk_pack_kv_i64 (&h.pk, "v", KILN_PROTO_VERSION);
        kiln_mpk_pack_kv_str (&h.pk, "cmd", "CHUNK");
        kiln_mpk_pack_kv_i64 (&h.pk, "frames", 1);
        kiln_mpk_pack_kv_str (&h.pk, "digest", HEX_A);
        kiln_mpk_pack_kv_i64 (&h.pk, "blob_size", (int64_t) size);
        kiln_mpk_pack_kv_i64 (&h.pk, "offset", (int64_t) bad[i]);
        size_t one = 5;
        ck_assert_int_eq (s_decode_raw (h.sbuf.data, h.sbuf.size, &one, 1, &err, NULL),
                          KILN_EPROTO);
        ck_assert_ptr_nonnull (strstr (err.msg, "offset"));
        s_hdr_end (&h);
    }
    free (blob);
}
END_TEST

START_TEST (test_artifact_parts_round_trip_past_4_gib_and_get_and_pin_carry_their_fields)
{
    kiln_err_t err = { 0 };
    /* a part deep into an artifact bigger than any blob may be */
    uint64_t size = 5ULL << 30;
    uint8_t *buf = calloc (1, KILN_CHUNK_BYTES);
    buf[0] = 7;
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_PART);
    m->req_id = 3;
    strcpy (m->artifact, HEX_A);
    m->artifact_size = size;
    m->offset = size - 5;
    ck_assert_int_lt (kiln_msg_put_chunk (m, buf, KILN_CHUNK_BYTES, &err), 0);   /* off a boundary */
    m->offset = (size / KILN_CHUNK_BYTES - 1) * KILN_CHUNK_BYTES;
    ck_assert_int_eq (kiln_msg_put_chunk (m, buf, KILN_CHUNK_BYTES, &err), 0);
    strcpy (m->digest, HEX_B);
    kiln_msg_t *b = s_round_trip (m);
    ck_assert_int_eq (b->cmd, KILN_CMD_PART);
    ck_assert_uint_eq (b->artifact_size, size);
    ck_assert_uint_eq (b->offset, size - KILN_CHUNK_BYTES);
    ck_assert_str_eq (b->digest, HEX_B);
    ck_assert_uint_eq (zframe_size (kiln_msg_chunk_frame (b)), KILN_CHUNK_BYTES);
    ck_assert_int_eq (zframe_data (kiln_msg_chunk_frame (b))[0], 7);
    kiln_msg_destroy (&b);
    /* the last, short part of a small artifact */
    m = kiln_msg_new (KILN_CMD_PART);
    m->req_id = 3;
    strcpy (m->artifact, HEX_A);
    m->artifact_size = KILN_CHUNK_BYTES + 10;
    m->offset = KILN_CHUNK_BYTES;
    ck_assert_int_eq (kiln_msg_put_chunk (m, buf, 10, &err), 0);
    b = s_round_trip (m);
    ck_assert_uint_eq (zframe_size (kiln_msg_chunk_frame (b)), 10);
    kiln_msg_destroy (&b);
    /* a part past the end of its artifact, or of the wrong size: refused */
    uint64_t bad_offsets[] = { KILN_CHUNK_BYTES * 2, 3 };
    for (size_t i = 0; i < 2; i++) {
        s_hdr_t h;
        s_hdr_begin (&h, 7);
        kiln_mpk_pack_kv_i64 (&h.pk, "v", KILN_PROTO_VERSION);
        kiln_mpk_pack_kv_str (&h.pk, "cmd", "PART");
        kiln_mpk_pack_kv_i64 (&h.pk, "frames", 1);
        kiln_mpk_pack_kv_i64 (&h.pk, "req_id", 3);
        kiln_mpk_pack_kv_str (&h.pk, "artifact", HEX_A);
        kiln_mpk_pack_kv_i64 (&h.pk, "artifact_size", KILN_CHUNK_BYTES + 10);
        kiln_mpk_pack_kv_i64 (&h.pk, "offset", (int64_t) bad_offsets[i]);
        size_t ten = 10;
        ck_assert_int_eq (s_decode_raw (h.sbuf.data, h.sbuf.size, &ten, 1, &err, NULL),
                          KILN_EPROTO);
        ck_assert_ptr_nonnull (strstr (err.msg, "offset"));
        s_hdr_end (&h);
    }
    free (buf);
    /* GET, CREDIT with a req_id, PIN and its answer */
    m = kiln_msg_new (KILN_CMD_GET);
    m->req_id = 4;
    strcpy (m->artifact, HEX_B);
    m->credit = 32;
    b = s_round_trip (m);
    ck_assert_int_eq (b->cmd, KILN_CMD_GET);
    ck_assert_str_eq (b->artifact, HEX_B);
    ck_assert_uint_eq (b->credit, 32);
    kiln_msg_destroy (&b);
    m = kiln_msg_new (KILN_CMD_GET);
    m->req_id = 4;
    strcpy (m->artifact, HEX_B);
    m->credit = KILN_PROTO_MAX_CREDIT + 1;
    ck_assert_ptr_null (kiln_msg_encode (&m, &err));
    ck_assert_int_eq (err.code, KILN_ELIMIT);
    m = kiln_msg_new (KILN_CMD_CREDIT);
    m->req_id = 4;
    m->credit = 8;
    b = s_round_trip (m);
    ck_assert_uint_eq (b->req_id, 4);
    ck_assert_uint_eq (b->credit, 8);
    ck_assert (kiln_cmd_senders (KILN_CMD_CREDIT) & KILN_PEER_CLIENT);
    ck_assert (kiln_cmd_receivers (KILN_CMD_CREDIT) & KILN_PEER_BROKER);
    kiln_msg_destroy (&b);
    m = kiln_msg_new (KILN_CMD_PINNED);
    m->req_id = 5;
    strcpy (m->artifact, HEX_A);
    m->pinned = false;
    m->changed = true;
    b = s_round_trip (m);
    ck_assert (!b->pinned && b->changed);
    kiln_msg_destroy (&b);
    ck_assert_int_eq (kiln_cmd_senders (KILN_CMD_PIN), KILN_PEER_CLIENT);
    ck_assert_int_eq (kiln_cmd_senders (KILN_CMD_PART), KILN_PEER_BROKER);
}
END_TEST

START_TEST (test_string_lists_are_bounded_and_toolchains_parse)
{
    kiln_err_t err = { 0 };
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_READY);
    kiln_msg_set_str (&m->name, "w");
    m->slots = 1;
    char big[KILN_PROTO_MAX_TOOLCHAIN + 2];
    memset (big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    kiln_msg_add_strs (&m->toolchains, &m->n_toolchains, big);
    ck_assert_ptr_null (kiln_msg_encode (&m, &err));
    ck_assert_int_eq (err.code, KILN_ELIMIT);

    m = kiln_msg_new (KILN_CMD_READY);
    kiln_msg_set_str (&m->name, "w");
    m->slots = 1;
    for (int i = 0; i <= KILN_PROTO_MAX_TOOLCHAINS; i++)
        kiln_msg_add_strs (&m->toolchains, &m->n_toolchains, "a b c");
    ck_assert_ptr_null (kiln_msg_encode (&m, &err));
    ck_assert_int_eq (err.code, KILN_ELIMIT);
    ck_assert_ptr_nonnull (strstr (err.msg, "toolchains"));

    kiln_toolchain_id_t tc;
    ck_assert_int_eq (kiln_toolchain_parse ("neuronx-cc 2.14.1 trn1", &tc, &err), 0);
    ck_assert_str_eq (tc.id, "neuronx-cc");
    ck_assert_str_eq (tc.version, "2.14.1");
    ck_assert_str_eq (tc.target, "trn1");
    char buf[KILN_PROTO_MAX_TOOLCHAIN + 1];
    ck_assert_str_eq (kiln_toolchain_format (&tc, buf, sizeof buf), "neuronx-cc 2.14.1 trn1");
    const char *bad[] = { "", "a b", "a b c d", "a  b c", "a b c ", "a/b 1 t", "a b\tc" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        ck_assert_msg (kiln_toolchain_parse (bad[i], &tc, &err) == -KILN_EPROTO,
                       "'%s' was accepted", bad[i]);
}
END_TEST

int
main (void)
{
    Suite *s = suite_create ("proto");
    TCase *tc = tcase_create ("proto");
    tcase_set_timeout (tc, 60);
    tcase_add_test (tc, test_compile_round_trips_with_structure_and_chunked_blobs);
    tcase_add_test (tc, test_result_and_done_round_trip_with_artifact_bytes);
    tcase_add_test (tc, test_small_commands_round_trip);
    tcase_add_test (tc, test_encoder_refuses_missing_and_oversize_fields);
    tcase_add_test (tc, test_truncated_headers_are_refused_at_every_length);
    tcase_add_test (tc, test_garbage_and_lying_containers_are_refused_without_allocating);
    tcase_add_test (tc, test_wrong_version_is_refused_naming_both_versions);
    tcase_add_test (tc, test_unknown_command_is_refused_by_name);
    tcase_add_test (tc, test_missing_and_mistyped_fields_are_named);
    tcase_add_test (tc, test_payload_that_does_not_match_the_header_is_refused);
    tcase_add_test (tc, test_oversize_header_frame_is_refused);
    tcase_add_test (tc, test_messages_cross_a_socket_pair_and_too_many_frames_are_drained);
    tcase_add_test (tc, test_only_loopback_endpoints_count_as_local);
    tcase_add_test (tc, test_docs_hold_the_tables_generated_from_the_x_macro);
    tcase_add_test (tc, test_blob_refs_and_inline_blobs_mix_in_one_graph_payload);
    tcase_add_test (tc, test_chunks_round_trip_and_must_sit_on_chunk_boundaries);
    tcase_add_test (tc, test_artifact_parts_round_trip_past_4_gib_and_get_and_pin_carry_their_fields);
    tcase_add_test (tc, test_string_lists_are_bounded_and_toolchains_parse);
    suite_add_tcase (s, tc);
    SRunner *sr = srunner_create (s);
    srunner_run_all (sr, CK_NORMAL);
    int failed = srunner_ntests_failed (sr);
    srunner_free (sr);
    return failed ? 1 : 0;
}
