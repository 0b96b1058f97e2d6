/* The real kiln-broker (from $KILN_BIN) against bad input: truncated
 * msgpack, unknown commands, wrong versions, oversize frames, lying digests.
 * Each gets an ERROR saying what is wrong, and the broker keeps serving.
 * Every test starts its own broker on a free loopback port and stops it,
 * also when the test fails (the broker dies with the test process). */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <msgpack.h>

#include "artifact/kiln_artifact.h"
#include "broker/kiln_broker.h"
#include "common/kiln_fs.h"
#include "common/kiln_mpk.h"
#include "common/kiln_proto.h"
#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"
#include "tests/unit/testlib.h"

#define REPLY_TIMEOUT_MS 5000

static pid_t s_broker = -1;
static char *s_dir;
static char s_endpoint[64];

static const char *
s_bin (void)
{
    const char *bin = getenv ("KILN_BIN");
    return bin && *bin ? bin : "build/bin";
}

static int
s_free_port (void)
{
    int fd = socket (AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = 0,
                             .sin_addr.s_addr = htonl (INADDR_LOOPBACK) };
    socklen_t len = sizeof a;
    ck_assert_int_eq (bind (fd, (struct sockaddr *) &a, sizeof a), 0);
    ck_assert_int_eq (getsockname (fd, (struct sockaddr *) &a, &len), 0);
    close (fd);
    return ntohs (a.sin_port);
}

/* Start kiln-broker with `listen` and its state in DIR/`state_name`
 * (one broker per state directory: it is locked); its output goes to
 * DIR/`state_name`.log. */
static pid_t
s_spawn_broker (const char *listen, const char *state_name)
{
    char exe[PATH_MAX], state[PATH_MAX], key[PATH_MAX], log[PATH_MAX];
    snprintf (exe, sizeof exe, "%s/kiln-broker", s_bin ());
    snprintf (state, sizeof state, "%s/%s", s_dir, state_name);
    snprintf (key, sizeof key, "%s/key/kiln.key", s_dir);
    snprintf (log, sizeof log, "%s/%s.log", s_dir, state_name);
    pid_t parent = getpid ();
    pid_t pid = fork ();
    ck_assert_int_ge (pid, 0);
    if (pid == 0) {
        prctl (PR_SET_PDEATHSIG, SIGKILL);
        if (getppid () != parent)
            _exit (127);
        int fd = open (log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2 (fd, 1);
            dup2 (fd, 2);
        }
        execl (exe, exe, "--listen", listen, "--state", state, "--key", key, "-v",
               (char *) NULL);
        _exit (127);
    }
    return pid;
}

/* Send a raw multipart message and wait for one reply. */
static kiln_msg_t *
s_exchange (zsock_t *dealer, zmsg_t **raw, int timeout_ms, kiln_err_t *err)
{
    ck_assert_int_eq (zmsg_send (raw, dealer), 0);
    zsock_set_rcvtimeo (dealer, timeout_ms);
    return kiln_msg_recv (dealer, NULL, NULL, err);
}

static zsock_t *
s_dealer (void)
{
    zsock_t *d = zsock_new_dealer (s_endpoint);
    ck_assert_ptr_nonnull (d);
    kiln_proto_socket_defaults (d);
    return d;
}

/* PING the broker; true when PONG came back within `timeout_ms`. */
static bool
s_ping (zsock_t *dealer, uint64_t req_id, int timeout_ms)
{
    kiln_err_t err = { 0 };
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_PING);
    m->req_id = req_id;
    zmsg_t *raw = kiln_msg_encode (&m, &err);
    kiln_msg_t *reply = s_exchange (dealer, &raw, timeout_ms, &err);
    /* PINGs sent while the broker was still starting were queued by the
     * dealer and are answered first, in order: skip their PONGs. */
    for (int i = 0; i < 64 && reply && reply->cmd == KILN_CMD_PONG && reply->req_id != req_id;
         i++) {
        kiln_msg_destroy (&reply);
        reply = kiln_msg_recv (dealer, NULL, NULL, &err);
    }
    bool ok = reply && reply->cmd == KILN_CMD_PONG && reply->req_id == req_id;
    kiln_msg_destroy (&reply);
    return ok;
}

static void
s_setup (void)
{
    kiln_err_t err = { 0 };
    s_dir = kiln_mkdtemp ("kiln-test-broker-", &err);
    ck_assert_msg (s_dir != NULL, "%s", err.msg);
    char keydir[PATH_MAX];
    snprintf (keydir, sizeof keydir, "%s/key", s_dir);
    kiln_key_t *key = kiln_key_generate (&err);
    ck_assert_msg (key && kiln_key_write_pair (key, keydir, &err) == 0, "%s", err.msg);
    kiln_key_destroy (&key);
    snprintf (s_endpoint, sizeof s_endpoint, "tcp://127.0.0.1:%d", s_free_port ());
    s_broker = s_spawn_broker (s_endpoint, "state");
    /* Wait, bounded, until it answers. */
    zsock_t *d = s_dealer ();
    bool up = false;
    for (int i = 0; i < 40 && !up; i++)
        up = s_ping (d, 1000 + (uint64_t) i, 250);
    zsock_destroy (&d);
    ck_assert_msg (up, "kiln-broker did not answer PING within 10 s (see %s/state.log)",
                   s_dir);
}

static void
s_teardown (void)
{
    if (s_broker > 0) {
        kill (s_broker, SIGTERM);
        int status;
        bool gone = false;
        for (int i = 0; i < 100 && !gone; i++) {
            gone = waitpid (s_broker, &status, WNOHANG) == s_broker;
            if (!gone)
                usleep (50 * 1000);
        }
        if (!gone) {
            kill (s_broker, SIGKILL);
            waitpid (s_broker, &status, 0);
        }
        s_broker = -1;
    }
    if (s_dir) {
        kiln_rm_rf (s_dir);
        free (s_dir);
        s_dir = NULL;
    }
}

/* A header map packed by hand. */
typedef struct {
    msgpack_sbuffer sbuf;
    msgpack_packer pk;
} s_hdr_t;

static void
s_hdr (s_hdr_t *h, uint32_t entries, int version, const char *cmd, int frames)
{
    msgpack_sbuffer_init (&h->sbuf);
    msgpack_packer_init (&h->pk, &h->sbuf, msgpack_sbuffer_write);
    msgpack_pack_map (&h->pk, entries);
    kiln_mpk_pack_kv_i64 (&h->pk, "v", version);
    kiln_mpk_pack_kv_str (&h->pk, "cmd", cmd);
    kiln_mpk_pack_kv_i64 (&h->pk, "frames", frames);
}

static zmsg_t *
s_hdr_msg (s_hdr_t *h)
{
    zmsg_t *raw = zmsg_new ();
    zmsg_addmem (raw, h->sbuf.data, h->sbuf.size);
    msgpack_sbuffer_destroy (&h->sbuf);
    return raw;
}

/* Expect an ERROR with `code` whose message contains `text`. */
static void
s_expect_error (kiln_msg_t *reply, int code, const char *text)
{
    ck_assert_msg (reply != NULL, "no reply from the broker");
    ck_assert_msg (reply->cmd == KILN_CMD_ERROR, "got %s, not ERROR",
                   kiln_cmd_name (reply->cmd));
    ck_assert_msg (reply->code == code, "code %lld (%s), expected %d", (long long) reply->code,
                   reply->message, code);
    ck_assert_msg (strstr (reply->message, text) != NULL, "message '%s' lacks '%s'",
                   reply->message, text);
}

START_TEST (test_broker_answers_ping_with_its_state)
{
    zsock_t *d = s_dealer ();
    kiln_err_t err = { 0 };
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_PING);
    m->req_id = 5;
    zmsg_t *raw = kiln_msg_encode (&m, &err);
    kiln_msg_t *r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    ck_assert_msg (r != NULL, "%s", err.msg);
    ck_assert_int_eq (r->cmd, KILN_CMD_PONG);
    ck_assert_uint_eq (r->req_id, 5);
    ck_assert_uint_eq (r->workers, 0);
    ck_assert_uint_eq (r->queued, 0);
    ck_assert_ptr_nonnull (r->broker);
    kiln_msg_destroy (&r);
    zsock_destroy (&d);
}
END_TEST

START_TEST (test_broker_refuses_truncated_msgpack_and_keeps_serving)
{
    zsock_t *d = s_dealer ();
    kiln_err_t err = { 0 };
    s_hdr_t h;
    s_hdr (&h, 4, KILN_PROTO_VERSION, "PING", 0);
    kiln_mpk_pack_kv_i64 (&h.pk, "req_id", 9);
    zmsg_t *raw = zmsg_new ();
    zmsg_addmem (raw, h.sbuf.data, h.sbuf.size - 3);   /* cut the end off */
    msgpack_sbuffer_destroy (&h.sbuf);
    kiln_msg_t *r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    s_expect_error (r, KILN_EFORMAT, "msgpack");
    kiln_msg_destroy (&r);
    /* plain garbage too */
    raw = zmsg_new ();
    zmsg_addstr (raw, "\xc1\xc1 this is not msgpack");
    r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    s_expect_error (r, KILN_EFORMAT, "msgpack");
    kiln_msg_destroy (&r);
    ck_assert (s_ping (d, 10, REPLY_TIMEOUT_MS));
    zsock_destroy (&d);
}
END_TEST

START_TEST (test_broker_refuses_unknown_command_and_keeps_serving)
{
    zsock_t *d = s_dealer ();
    kiln_err_t err = { 0 };
    s_hdr_t h;
    s_hdr (&h, 4, KILN_PROTO_VERSION, "SELF_DESTRUCT", 0);
    kiln_mpk_pack_kv_i64 (&h.pk, "req_id", 11);
    zmsg_t *raw = s_hdr_msg (&h);
    kiln_msg_t *r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    s_expect_error (r, KILN_EPROTO, "unknown command 'SELF_DESTRUCT'");
    ck_assert_uint_eq (r->req_id, 11);
    kiln_msg_destroy (&r);
    ck_assert (s_ping (d, 12, REPLY_TIMEOUT_MS));
    zsock_destroy (&d);
}
END_TEST

START_TEST (test_broker_refuses_wrong_version_and_keeps_serving)
{
    zsock_t *d = s_dealer ();
    kiln_err_t err = { 0 };
    s_hdr_t h;
    s_hdr (&h, 4, KILN_PROTO_VERSION + 1, "PING", 0);
    kiln_mpk_pack_kv_i64 (&h.pk, "req_id", 13);
    zmsg_t *raw = s_hdr_msg (&h);
    kiln_msg_t *r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    s_expect_error (r, KILN_EPROTO, "protocol version 3");
    ck_assert_uint_eq (r->req_id, 13);
    kiln_msg_destroy (&r);
    ck_assert (s_ping (d, 14, REPLY_TIMEOUT_MS));
    zsock_destroy (&d);
}
END_TEST

START_TEST (test_broker_refuses_missing_fields_and_results_sent_to_it)
{
    zsock_t *d = s_dealer ();
    kiln_err_t err = { 0 };
    s_hdr_t h;
    s_hdr (&h, 4, KILN_PROTO_VERSION, "COMPILE", 0);
    kiln_mpk_pack_kv_i64 (&h.pk, "req_id", 15);
    zmsg_t *raw = s_hdr_msg (&h);
    kiln_msg_t *r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    s_expect_error (r, KILN_EPROTO, "missing field");
    kiln_msg_destroy (&r);

    kiln_msg_t *m = kiln_msg_new (KILN_CMD_PONG);
    m->req_id = 16;
    kiln_msg_set_str (&m->broker, "me");
    raw = kiln_msg_encode (&m, &err);
    r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    s_expect_error (r, KILN_EPROTO, "not a command the broker takes");
    kiln_msg_destroy (&r);
    ck_assert (s_ping (d, 17, REPLY_TIMEOUT_MS));
    zsock_destroy (&d);
}
END_TEST

START_TEST (test_broker_refuses_worker_messages_before_ready)
{
    zsock_t *d = s_dealer ();
    kiln_err_t err = { 0 };
    /* A worker's heartbeat names the worker. */
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_HEARTBEAT);
    kiln_msg_set_str (&m->name, "ghost");
    zmsg_t *raw = kiln_msg_encode (&m, &err);
    kiln_msg_t *r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    s_expect_error (r, KILN_ENOTFOUND, "READY");
    kiln_msg_destroy (&r);
    m = kiln_msg_new (KILN_CMD_DONE);
    m->job_id = 3;
    raw = kiln_msg_encode (&m, &err);
    r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    s_expect_error (r, KILN_ENOTFOUND, "READY");
    kiln_msg_destroy (&r);
    zsock_destroy (&d);
}
END_TEST

START_TEST (test_broker_refuses_oversize_frames_and_keeps_serving)
{
    zsock_t *d = s_dealer ();
    kiln_err_t err = { 0 };
    /* a payload frame over the chunk size */
    s_hdr_t h;
    s_hdr (&h, 4, KILN_PROTO_VERSION, "PING", 1);
    kiln_mpk_pack_kv_i64 (&h.pk, "req_id", 18);
    zmsg_t *raw = s_hdr_msg (&h);
    size_t big = KILN_CHUNK_BYTES * 2;
    uint8_t *buf = calloc (1, big);
    zmsg_addmem (raw, buf, big);
    free (buf);
    kiln_msg_t *r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    s_expect_error (r, KILN_ELIMIT, "chunk size");
    ck_assert_uint_eq (r->req_id, 18);
    kiln_msg_destroy (&r);
    /* a header frame over its bound */
    raw = zmsg_new ();
    buf = calloc (1, KILN_PROTO_MAX_HEADER_BYTES + 1);
    zmsg_addmem (raw, buf, KILN_PROTO_MAX_HEADER_BYTES + 1);
    free (buf);
    r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    s_expect_error (r, KILN_ELIMIT, "header frame");
    kiln_msg_destroy (&r);
    /* too many frames */
    raw = zmsg_new ();
    for (int i = 0; i < KILN_MAX_FRAMES + 10; i++)
        zmsg_addmem (raw, "x", 1);
    r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    s_expect_error (r, KILN_ELIMIT, "frames");
    kiln_msg_destroy (&r);
    ck_assert (s_ping (d, 19, REPLY_TIMEOUT_MS));
    zsock_destroy (&d);
}
END_TEST

START_TEST (test_broker_drops_a_peer_past_the_transport_limit_and_keeps_serving)
{
    /* A frame over KILN_MAX_FRAME_BYTES never reaches the broker's code:
     * the transport disconnects the sender.  Others are served. */
    zsock_t *d = s_dealer ();
    zmsg_t *raw = zmsg_new ();
    size_t huge = (size_t) KILN_MAX_FRAME_BYTES + 1;
    uint8_t *buf = calloc (1, huge);
    ck_assert_ptr_nonnull (buf);
    zmsg_addmem (raw, buf, huge);
    free (buf);
    ck_assert_int_eq (zmsg_send (&raw, d), 0);
    zsock_set_rcvtimeo (d, 1000);
    kiln_err_t err = { 0 };
    kiln_msg_t *r = kiln_msg_recv (d, NULL, NULL, &err);
    ck_assert_ptr_null (r);         /* no reply: the connection was cut */
    zsock_t *other = s_dealer ();
    ck_assert (s_ping (other, 20, REPLY_TIMEOUT_MS));
    zsock_destroy (&other);
    zsock_destroy (&d);
}
END_TEST

/* y = x + w with w = {1, 2}: a two-element graph with one weight blob. */
static kiln_graph_t *
s_tiny_graph (void)
{
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_graph_new ();
    kiln_shape_t shape = { .rank = 1, .dims = { 2 } };
    int x = kiln_graph_add_tensor (g, "x", KILN_DT_FLOAT32, &shape, &err);
    int w = kiln_graph_add_tensor (g, "w", KILN_DT_FLOAT32, &shape, &err);
    int y = kiln_graph_add_tensor (g, "y", KILN_DT_FLOAT32, &shape, &err);
    ck_assert_msg (x >= 0 && w >= 0 && y >= 0, "%s", err.msg);
    float values[2] = { 1.0f, 2.0f };
    uint8_t *data = malloc (sizeof values);
    memcpy (data, values, sizeof values);
    ck_assert_int_eq (kiln_graph_set_weight (g, w, &data, sizeof values, &err), 0);
    int in[2] = { x, w };
    ck_assert_int_ge (kiln_graph_add_node (g, "Add", "add", in, 2, &y, 1, &err), 0);
    ck_assert_int_eq (kiln_graph_add_input (g, x, &err), 0);
    ck_assert_int_eq (kiln_graph_add_output (g, y, &err), 0);
    return g;
}

/* A COMPILE of `g`: honest, or with the graph digest or the blob bytes
 * changed. */
static zmsg_t *
s_compile (kiln_graph_t *g, bool lie_digest, bool lie_blob)
{
    kiln_err_t err = { 0 };
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_COMPILE);
    m->req_id = 21;
    ck_assert_int_eq (kiln_graph_digest (g, m->graph_digest, &err), 0);
    if (lie_digest)
        m->graph_digest[0] = m->graph_digest[0] == 'a' ? 'b' : 'a';
    kiln_action_key (m->graph_digest, "", KILN_COMPILER_ID, KILN_COMPILER_VERSION,
                     kiln_cc_target (), m->action_key);
    kiln_msg_set_str (&m->compiler_id, KILN_COMPILER_ID);
    kiln_msg_set_str (&m->compiler_version, KILN_COMPILER_VERSION);
    kiln_msg_set_str (&m->target, kiln_cc_target ());
    uint8_t *structure;
    size_t len;
    ck_assert_int_eq (kiln_graph_encode (g, &structure, &len, &err), 0);
    ck_assert_int_eq (kiln_msg_put_structure (m, structure, len, &err), 0);
    free (structure);
    kiln_weight_t *w = &g->weights[0];
    uint8_t bytes[64];
    memcpy (bytes, w->data, w->size);
    if (lie_blob)
        bytes[0] ^= 1;
    ck_assert_int_eq (kiln_msg_put_blob (m, w->digest, bytes, w->size, &err), 0);
    zmsg_t *raw = kiln_msg_encode (&m, &err);
    ck_assert_msg (raw != NULL, "%s", err.msg);
    return raw;
}

START_TEST (test_broker_recomputes_digests_instead_of_trusting_the_client)
{
    zsock_t *d = s_dealer ();
    kiln_err_t err = { 0 };
    kiln_graph_t *g = s_tiny_graph ();

    zmsg_t *raw = s_compile (g, true, false);
    kiln_msg_t *r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    s_expect_error (r, KILN_EVERIFY, "graph digest mismatch");
    ck_assert_uint_eq (r->req_id, 21);
    kiln_msg_destroy (&r);

    raw = s_compile (g, false, true);
    r = s_exchange (d, &raw, REPLY_TIMEOUT_MS, &err);
    ck_assert_msg (r && r->cmd == KILN_CMD_ERROR, "a blob that does not hash to its digest "
                   "was accepted");
    ck_assert_msg (strstr (r->message, "blob") != NULL, "message '%s'", r->message);
    kiln_msg_destroy (&r);

    /* The honest request is queued (no worker: no reply yet), and the
     * broker reports it. */
    raw = s_compile (g, false, false);
    ck_assert_int_eq (zmsg_send (&raw, d), 0);
    zsock_t *other = s_dealer ();
    kiln_msg_t *m = kiln_msg_new (KILN_CMD_PING);
    m->req_id = 22;
    raw = kiln_msg_encode (&m, &err);
    bool queued = false;
    for (int i = 0; i < 20 && !queued; i++) {
        zmsg_t *copy = zmsg_dup (raw);
        r = s_exchange (other, &copy, REPLY_TIMEOUT_MS, &err);
        queued = r && r->cmd == KILN_CMD_PONG && r->queued == 1;
        kiln_msg_destroy (&r);
        if (!queued)
            usleep (50 * 1000);
    }
    zmsg_destroy (&raw);
    ck_assert_msg (queued, "the honest COMPILE was not queued");
    zsock_destroy (&other);
    kiln_graph_destroy (&g);
    zsock_destroy (&d);
}
END_TEST

START_TEST (test_broker_refuses_to_listen_beyond_loopback)
{
    char listen[64];
    snprintf (listen, sizeof listen, "tcp://0.0.0.0:%d", s_free_port ());
    pid_t pid = s_spawn_broker (listen, "state-wide");
    int status = 0;
    bool gone = false;
    for (int i = 0; i < 100 && !gone; i++) {
        gone = waitpid (pid, &status, WNOHANG) == pid;
        if (!gone)
            usleep (50 * 1000);
    }
    if (!gone) {
        kill (pid, SIGKILL);
        waitpid (pid, &status, 0);
    }
    ck_assert_msg (gone, "kiln-broker kept running on 0.0.0.0");
    ck_assert (WIFEXITED (status) && WEXITSTATUS (status) != 0);
    char log[PATH_MAX];
    snprintf (log, sizeof log, "%s/state-wide.log", s_dir);
    uint8_t *text;
    size_t len;
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_read_file (log, 1 << 20, &text, &len, &err), 0);
    ck_assert_msg (strstr ((char *) text, "loopback") != NULL, "log: %s", text);
    free (text);
}
END_TEST

START_TEST (test_broker_parses_its_cross_check_policies_and_refuses_others)
{
    static const struct { const char *text; int policy, n; } good[] = {
        { "always", KILN_XCHECK_ALWAYS, 0 },         { "off", KILN_XCHECK_OFF, 0 },
        { "new-workers", KILN_XCHECK_NEW_WORKERS, 20 },
        { "new-workers:3", KILN_XCHECK_NEW_WORKERS, 3 },
        { "sample:10", KILN_XCHECK_SAMPLE, 10 },     { "sample:1", KILN_XCHECK_SAMPLE, 1 },
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        kiln_broker_config_t cfg = { 0 };
        kiln_err_t err = { 0 };
        ck_assert_msg (kiln_broker_parse_cross_check (good[i].text, &cfg, &err) == 0, "%s: %s",
                       good[i].text, err.msg);
        ck_assert_int_eq (cfg.cross_check, good[i].policy);
        ck_assert_int_eq (cfg.cross_check_n, good[i].n);
    }
    static const char *const bad[] = { "", "sometimes", "sample", "sample:0", "sample:-1",
                                       "sample:10x", "new-workers:", "new-workers:0",
                                       "sample:99999999999", "ALWAYS" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kiln_broker_config_t cfg = { 0 };
        kiln_err_t err = { 0 };
        ck_assert_msg (kiln_broker_parse_cross_check (bad[i], &cfg, &err) != 0, "'%s' accepted",
                       bad[i]);
        ck_assert_msg (strstr (err.msg, "--cross-check") != NULL, "%s", err.msg);
    }
}
END_TEST

int
main (void)
{
    Suite *s = suite_create ("broker_garbage");
    TCase *tc = tcase_create ("broker");
    tcase_set_timeout (tc, 60);
    tcase_add_checked_fixture (tc, s_setup, s_teardown);
    tcase_add_test (tc, test_broker_answers_ping_with_its_state);
    tcase_add_test (tc, test_broker_refuses_truncated_msgpack_and_keeps_serving);
    tcase_add_test (tc, test_broker_refuses_unknown_command_and_keeps_serving);
    tcase_add_test (tc, test_broker_refuses_wrong_version_and_keeps_serving);
    tcase_add_test (tc, test_broker_refuses_missing_fields_and_results_sent_to_it);
    tcase_add_test (tc, test_broker_refuses_worker_messages_before_ready);
    tcase_add_test (tc, test_broker_refuses_oversize_frames_and_keeps_serving);
    tcase_add_test (tc, test_broker_drops_a_peer_past_the_transport_limit_and_keeps_serving);
    tcase_add_test (tc, test_broker_recomputes_digests_instead_of_trusting_the_client);
    tcase_add_test (tc, test_broker_refuses_to_listen_beyond_loopback);
    tcase_add_test (tc, test_broker_parses_its_cross_check_policies_and_refuses_others);
    suite_add_tcase (s, tc);
    return testlib_run (s);
}
