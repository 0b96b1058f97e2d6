/* Unit tests of the broker's downloads (GET answered in PARTs): a client
 * gets exactly the chunks it granted, in order, then the rest as it gives
 * credit back, the last part naming the SHA-256 of the whole file; what
 * the store lacks is not found; a GET without credit, and more downloads
 * than a client may have, are refused; cancelled, abandoned and idle
 * downloads are dropped.  Over an inproc ROUTER/DEALER pair, no broker. */
#include <check.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <czmq.h>

#include "artifact/kiln_artifact.h"
#include "broker/kiln_download.h"
#include "broker/kiln_store.h"
#include "common/kiln_fs.h"
#include "common/kiln_hash.h"
#include "common/kiln_proto.h"
#include "tests/unit/testlib.h"

#define WAIT_MS 2000

static char *s_dir;
static kiln_key_t *s_key;
static kiln_store_t *s_store;
static zsock_t *s_router, *s_dealer;
static zframe_t *s_rid;                  /* the dealer, as the router knows it */
static char *s_peer;                     /* s_rid in hex */

static void
s_setup (void)
{
    char keys[PATH_MAX];
    s_dir = testlib_keydir ("kiln-test-download-", keys, &s_key);
    kiln_err_t err = { 0 };
    s_store = kiln_store_new (s_dir, 0, &err);
    ck_assert_msg (s_store != NULL, "%s", err.msg);
    char endpoint[64];
    snprintf (endpoint, sizeof endpoint, "inproc://download-%d", (int) getpid ());
    s_router = zsock_new (ZMQ_ROUTER);
    zsock_set_router_mandatory (s_router, 1);
    zsock_set_sndtimeo (s_router, 0);
    ck_assert_int_eq (zsock_bind (s_router, "%s", endpoint), 0);
    s_dealer = zsock_new (ZMQ_DEALER);
    zsock_set_rcvtimeo (s_dealer, WAIT_MS);
    ck_assert_int_eq (zsock_connect (s_dealer, "%s", endpoint), 0);
    /* the router learns the dealer's routing id from a first message */
    zstr_send (s_dealer, "hello");
    zsock_set_rcvtimeo (s_router, WAIT_MS);
    zmsg_t *hello = zmsg_recv (s_router);
    ck_assert_ptr_nonnull (hello);
    s_rid = zmsg_pop (hello);
    zmsg_destroy (&hello);
    s_peer = zframe_strhex (s_rid);
}

static void
s_teardown (void)
{
    zstr_free (&s_peer);
    zframe_destroy (&s_rid);
    zsock_destroy (&s_dealer);
    zsock_destroy (&s_router);
    kiln_store_destroy (&s_store);
    kiln_key_destroy (&s_key);
    testlib_rmdir (&s_dir);
}

/* Store a signed artifact with a payload of `size` bytes; its bytes and
 * content hash come back (caller frees the bytes). */
static uint8_t *
s_stored (size_t size, char digest[KILN_HEX_LEN], size_t *len)
{
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_artifact_new ();
    kiln_manifest_t *m = kiln_artifact_manifest (art);
    m->format_version = KILN_ARTIFACT_FORMAT_VERSION;
    memset (m->graph_digest, 'b', 64);
    memset (m->action_key, 'c', 64);
    snprintf (m->compiler_id, sizeof m->compiler_id, "test");
    snprintf (m->compiler_version, sizeof m->compiler_version, "1");
    snprintf (m->target, sizeof m->target, "t");
    m->runtime_abi = KILN_RUNTIME_ABI_VERSION;
    uint8_t *payload = malloc (size);
    for (size_t i = 0; i < size; i++)
        payload[i] = (uint8_t) (testlib_randu () >> 7);
    ck_assert_int_eq (kiln_artifact_add_member (art, "payload.bin", payload, size, &err), 0);
    free (payload);
    ck_assert_int_eq (kiln_artifact_sign (art, s_key, NULL, &err), 0);
    ck_assert_int_eq (kiln_artifact_digest (art, digest, &err), 0);
    uint8_t *bytes = NULL;
    ck_assert_int_eq (kiln_artifact_write_mem (art, &bytes, len, &err), 0);
    kiln_artifact_destroy (&art);
    ck_assert_int_eq (kiln_store_put_artifact (s_store, digest, bytes, *len, &err), 0);
    ck_assert_int_eq (kiln_store_commit (s_store, &err), 1);
    return bytes;
}

/* The next message for the dealer, or NULL when none comes in `ms`,
 * pumping `dl` (at most `max_chunks` a pump) whenever its fd says there is
 * sending to do, as the broker's loop does: the parts are read on the
 * downloads' reader thread, so they are ready only some time after the
 * credit that asks for them. */
static kiln_msg_t *
s_next (kiln_downloads_t *dl, int max_chunks, int ms)
{
    int64_t until = zclock_mono () + ms;
    kiln_err_t err = { 0 };
    zsock_set_rcvtimeo (s_dealer, 0);
    for (;;) {
        kiln_downloads_pump (dl, max_chunks);
        zmq_pollitem_t items[] = {
            { zsock_resolve (s_dealer), 0, ZMQ_POLLIN, 0 },
            { NULL, kiln_downloads_fd (dl), ZMQ_POLLIN, 0 },
        };
        int64_t left = until - zclock_mono ();
        if (left <= 0)
            return NULL;
        if (zmq_poll (items, 2, left > 50 ? 50 : left) < 0)
            return NULL;
        if (items[0].revents & ZMQ_POLLIN)
            return kiln_msg_recv (s_dealer, NULL, NULL, &err);
    }
}

/* Pump `dl` until it has no download in progress, at most WAIT_MS. */
static void
s_pump_until_idle (kiln_downloads_t *dl)
{
    kiln_downloads_stats_t st;
    for (int64_t until = zclock_mono () + WAIT_MS; zclock_mono () < until;) {
        kiln_downloads_pump (dl, 10);
        kiln_downloads_stats (dl, &st);
        if (st.in_progress == 0)
            return;
        zclock_sleep (5);
    }
}

START_TEST (test_a_client_gets_the_chunks_it_granted_then_the_rest_as_it_gives_credit)
{
    kiln_err_t err = { 0 };
    char digest[KILN_HEX_LEN];
    size_t len = 0;
    uint8_t *bytes = s_stored (3 * KILN_CHUNK_BYTES + 12345, digest, &len);
    size_t chunks = (len + KILN_CHUNK_BYTES - 1) / KILN_CHUNK_BYTES;
    ck_assert_uint_ge (chunks, 4);
    kiln_downloads_t *dl = kiln_downloads_new (s_store, s_router, 32, &err);
    ck_assert_ptr_nonnull (dl);
    ck_assert_int_eq (kiln_downloads_start (dl, s_peer, s_rid, 7, digest, 2, &err), 0);
    uint8_t *got = malloc (len);
    size_t at = 0;
    for (int i = 0; i < 2; i++) {
        kiln_msg_t *part = s_next (dl, 100, WAIT_MS);
        ck_assert_ptr_nonnull (part);
        ck_assert_int_eq (part->cmd, KILN_CMD_PART);
        ck_assert_uint_eq (part->req_id, 7);
        ck_assert_str_eq (part->artifact, digest);
        ck_assert_uint_eq (part->artifact_size, len);
        ck_assert_uint_eq (part->offset, at);
        ck_assert_str_eq (part->digest, "");
        zframe_t *f = kiln_msg_chunk_frame (part);
        memcpy (got + at, zframe_data (f), zframe_size (f));
        at += zframe_size (f);
        kiln_msg_destroy (&part);
    }
    /* nothing more without credit, however often the pump runs */
    ck_assert_ptr_null (s_next (dl, 100, 200));
    kiln_downloads_stats_t st;
    kiln_downloads_stats (dl, &st);
    ck_assert_uint_eq (st.in_progress, 1);
    /* credit beyond the window is cut to it; the rest arrives in order */
    ck_assert (kiln_downloads_credit (dl, s_peer, 7, 1000));
    for (int round = 0; round < 10 && at < len; round++) {
        kiln_msg_t *part;
        while (at < len && (part = s_next (dl, 100, WAIT_MS))) {
            ck_assert_uint_eq (part->offset, at);
            zframe_t *f = kiln_msg_chunk_frame (part);
            memcpy (got + at, zframe_data (f), zframe_size (f));
            at += zframe_size (f);
            if (at == len) {
                uint8_t sha[KILN_DIGEST_LEN];
                char hex[KILN_HEX_LEN];
                kiln_sha256 (bytes, len, sha);
                kiln_hex (sha, KILN_DIGEST_LEN, hex);
                ck_assert_str_eq (part->digest, hex);
            }
            kiln_msg_destroy (&part);
        }
    }
    ck_assert_uint_eq (at, len);
    ck_assert_mem_eq (got, bytes, len);
    kiln_downloads_stats (dl, &st);
    ck_assert_uint_eq (st.in_progress, 0);
    ck_assert_uint_eq (st.served, 1);
    ck_assert_uint_eq (st.bytes, len);
    /* credit for a finished download is not an error, just nothing */
    ck_assert (!kiln_downloads_credit (dl, s_peer, 7, 4));
    free (got);
    free (bytes);
    kiln_downloads_destroy (&dl);
    ck_assert_ptr_null (dl);
}
END_TEST

START_TEST (test_absent_artifacts_no_credit_and_too_many_downloads_are_refused)
{
    kiln_err_t err = { 0 };
    char digest[KILN_HEX_LEN];
    size_t len = 0;
    uint8_t *bytes = s_stored (2 * KILN_CHUNK_BYTES, digest, &len);
    kiln_downloads_t *dl = kiln_downloads_new (s_store, s_router, 4, &err);
    const char *absent = "efefefefefefefefefefefefefefefefefefefefefefefefefefefefefefefef";
    ck_assert_int_eq (kiln_downloads_start (dl, s_peer, s_rid, 1, absent, 4, &err),
                      -KILN_ENOTFOUND);
    ck_assert_ptr_nonnull (strstr (err.msg, absent));
    ck_assert_int_eq (kiln_downloads_start (dl, s_peer, s_rid, 2, digest, 0, &err),
                      -KILN_EPROTO);
    for (uint64_t req = 10; req < 10 + KILN_MAX_CLIENT_DOWNLOADS; req++)
        ck_assert_int_eq (kiln_downloads_start (dl, s_peer, s_rid, req, digest, 1, &err), 0);
    ck_assert_int_eq (kiln_downloads_start (dl, s_peer, s_rid, 99, digest, 1, &err),
                      -KILN_ELIMIT);
    ck_assert (kiln_downloads_has_peer (dl, s_peer));
    /* the same request again starts over instead of counting twice */
    ck_assert_int_eq (kiln_downloads_start (dl, s_peer, s_rid, 10, digest, 1, &err), 0);
    /* cancel one; then the client leaves and takes the rest along */
    ck_assert (kiln_downloads_cancel (dl, s_peer, 11));
    ck_assert (!kiln_downloads_cancel (dl, s_peer, 11));
    kiln_downloads_stats_t st;
    kiln_downloads_stats (dl, &st);
    ck_assert_uint_eq (st.in_progress, KILN_MAX_CLIENT_DOWNLOADS - 1);
    kiln_downloads_drop_peer (dl, s_peer);
    ck_assert (!kiln_downloads_has_peer (dl, s_peer));
    kiln_downloads_stats (dl, &st);
    ck_assert_uint_eq (st.in_progress, 0);
    free (bytes);
    kiln_downloads_destroy (&dl);
}
END_TEST

START_TEST (test_downloads_without_credit_for_long_are_dropped_and_gone_clients_too)
{
    kiln_err_t err = { 0 };
    char digest[KILN_HEX_LEN];
    size_t len = 0;
    uint8_t *bytes = s_stored (2 * KILN_CHUNK_BYTES, digest, &len);
    kiln_downloads_t *dl = kiln_downloads_new (s_store, s_router, 4, &err);
    ck_assert_int_eq (kiln_downloads_start (dl, s_peer, s_rid, 1, digest, 1, &err), 0);
    kiln_msg_t *part = s_next (dl, 10, WAIT_MS);
    ck_assert_ptr_nonnull (part);
    kiln_msg_destroy (&part);
    /* waiting for credit, but not for long yet: kept */
    kiln_downloads_expire (dl, zclock_mono () + 1000);
    kiln_downloads_stats_t st;
    kiln_downloads_stats (dl, &st);
    ck_assert_uint_eq (st.in_progress, 1);
    kiln_downloads_expire (dl, zclock_mono () + KILN_DOWNLOADS_IDLE_MS + 1000);
    kiln_downloads_stats (dl, &st);
    ck_assert_uint_eq (st.in_progress, 0);
    /* a client the router does not know (gone): its download ends at the
     * first send */
    zframe_t *ghost = zframe_new ("\0ghost", 6);
    ck_assert_int_eq (kiln_downloads_start (dl, "0067686f7374", ghost, 2, digest, 4, &err), 0);
    s_pump_until_idle (dl);
    kiln_downloads_stats (dl, &st);
    ck_assert_uint_eq (st.in_progress, 0);
    ck_assert_uint_eq (st.served, 0);
    zframe_destroy (&ghost);
    free (bytes);
    kiln_downloads_destroy (&dl);
}
END_TEST

int
main (void)
{
    Suite *s = suite_create ("download");
    TCase *tc = tcase_create ("download");
    tcase_set_timeout (tc, 60);
    tcase_add_checked_fixture (tc, s_setup, s_teardown);
    tcase_add_test (tc, test_a_client_gets_the_chunks_it_granted_then_the_rest_as_it_gives_credit);
    tcase_add_test (tc, test_absent_artifacts_no_credit_and_too_many_downloads_are_refused);
    tcase_add_test (tc, test_downloads_without_credit_for_long_are_dropped_and_gone_clients_too);
    suite_add_tcase (s, tc);
    return testlib_run (s);
}
