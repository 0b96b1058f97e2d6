/*
 * testlib — helpers shared by the unit tests; see testlib.h.
 */
#include "tests/unit/testlib.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <archive.h>
#include <archive_entry.h>

#include "common/kiln_fs.h"
#include "runtime/kiln_exec.h"

/* --- temporary directories and keys --------------------------------- */

char *
testlib_keydir (const char *prefix, char *keys, kiln_key_t **key_p)
{
    kiln_err_t err = { 0 };
    char *dir = kiln_mkdtemp (prefix, &err);
    ck_assert_msg (dir, "%s", err.msg);
    if (keys)
        snprintf (keys, PATH_MAX, "%s/keys", dir);
    if (key_p) {
        ck_assert_msg (keys, "a key needs a directory to go in");
        *key_p = kiln_key_generate (&err);
        ck_assert_msg (*key_p, "%s", err.msg);
        ck_assert_msg (kiln_key_write_pair (*key_p, keys, &err) == 0, "%s", err.msg);
    }
    return dir;
}

char *
testlib_path (const char *dir, const char *name)
{
    static char buf[4][PATH_MAX];
    static int next;
    char *p = buf[next++ % 4];
    snprintf (p, PATH_MAX, "%s/%s", dir, name);
    return p;
}

void
testlib_rmdir (char **dir_p)
{
    if (!*dir_p)
        return;
    kiln_rm_rf (*dir_p);
    free (*dir_p);
    *dir_p = NULL;
}

/* --- random numbers --------------------------------------------------- */

static unsigned s_seed;         /* the stream's state */

void
testlib_seed (unsigned seed)
{
    s_seed = seed;
}

unsigned
testlib_randu (void)
{
    s_seed = s_seed * 1103515245u + 12345u;
    return s_seed;
}

float
testlib_randf (void)
{
    return (float) ((testlib_randu () >> 8) & 0xffff) / 32768.0f - 1.0f;
}

float *
testlib_rand (int64_t n)
{
    float *v = malloc ((size_t) (n ? n : 1) * sizeof *v);
    ck_assert_ptr_nonnull (v);
    for (int64_t i = 0; i < n; i++)
        v[i] = testlib_randf ();
    return v;
}

/* --- shapes and graphs ------------------------------------------------ */

kiln_shape_t
testlib_shape (const int64_t *dims, int rank)
{
    kiln_shape_t s = { .rank = rank };
    memcpy (s.dims, dims, (size_t) rank * sizeof *dims);
    return s;
}

int64_t
testlib_numel (const kiln_shape_t *s)
{
    int64_t n = 1;
    for (int i = 0; i < s->rank; i++)
        n *= s->dims[i];
    return n;
}

int
testlib_input_dt (kiln_graph_t *g, const char *name, kiln_dtype_t dt,
                  kiln_shape_t shape)
{
    kiln_err_t err;
    int t = kiln_graph_add_tensor (g, name, dt, &shape, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    ck_assert_msg (kiln_graph_add_input (g, t, &err) == 0, "%s", err.msg);
    return t;
}

int
testlib_input (kiln_graph_t *g, const char *name, kiln_shape_t shape)
{
    return testlib_input_dt (g, name, KILN_DT_FLOAT32, shape);
}

int
testlib_const (kiln_graph_t *g, const char *name, kiln_shape_t shape, float scale,
               float offset)
{
    kiln_err_t err;
    int t = kiln_graph_add_tensor (g, name, KILN_DT_FLOAT32, &shape, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    int64_t n = testlib_numel (&shape);
    float *v = testlib_rand (n);
    for (int64_t i = 0; i < n; i++)
        v[i] = v[i] * scale + offset;
    uint8_t *data = (uint8_t *) v;
    ck_assert_msg (kiln_graph_set_weight (g, t, &data, (uint64_t) n * 4, &err) == 0,
                   "%s", err.msg);
    return t;
}

int
testlib_weight (kiln_graph_t *g, const char *name, kiln_shape_t shape)
{
    kiln_err_t err;
    int t = kiln_graph_add_tensor (g, name, KILN_DT_FLOAT32, &shape, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    int64_t n = testlib_numel (&shape);
    uint8_t *data = (uint8_t *) testlib_rand (n);
    ck_assert_msg (kiln_graph_set_weight (g, t, &data, (uint64_t) n * 4, &err) == 0,
                   "%s", err.msg);
    return t;
}

int
testlib_tensor (kiln_graph_t *g, const char *name)
{
    kiln_err_t err;
    int t = kiln_graph_add_tensor (g, name, KILN_DT_UNDEFINED, NULL, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    return t;
}

void
testlib_tensors (kiln_graph_t *g, int *t, int n)
{
    for (int i = 0; i < n; i++) {
        char name[16];
        snprintf (name, sizeof name, "t%d", i);
        t[i] = testlib_tensor (g, name);
    }
}

int
testlib_node (kiln_graph_t *g, const char *op, const char *name, const int *ins,
              int n_in, int out)
{
    kiln_err_t err;
    int n = kiln_graph_add_node (g, op, name, ins, n_in, &out, 1, &err);
    ck_assert_msg (n >= 0, "%s", err.msg);
    return n;
}

void
testlib_ints_ (kiln_graph_t *g, int n, const char *name, const int64_t *v, int count)
{
    kiln_err_t err;
    ck_assert_msg (kiln_node_set_ints (g, n, name, v, (size_t) count, &err) == 0,
                   "%s", err.msg);
}

void
testlib_int (kiln_graph_t *g, int n, const char *name, int64_t v)
{
    kiln_err_t err;
    ck_assert_msg (kiln_node_set_int (g, n, name, v, &err) == 0, "%s", err.msg);
}

void
testlib_float (kiln_graph_t *g, int n, const char *name, double v)
{
    kiln_err_t err;
    ck_assert_msg (kiln_node_set_float (g, n, name, v, &err) == 0, "%s", err.msg);
}

void
testlib_output (kiln_graph_t *g, int t)
{
    kiln_err_t err;
    ck_assert_msg (kiln_graph_add_output (g, t, &err) == 0, "%s", err.msg);
}

/* --- artifacts -------------------------------------------------------- */

kiln_program_t *
testlib_program_of (const kiln_artifact_t *art)
{
    size_t plen, wlen;
    const uint8_t *prog = kiln_artifact_member (art, KILN_PROGRAM_MEMBER, &plen);
    ck_assert (prog && kiln_artifact_member (art, KILN_WEIGHTS_MEMBER, &wlen));
    kiln_err_t err = { 0 };
    kiln_program_t *p = kiln_program_decode (prog, plen, wlen, &err);
    ck_assert_msg (p, "%s", err.msg);
    return p;
}

void
testlib_sign_write (kiln_artifact_t **art_p, const kiln_key_t *key, const char *path)
{
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_artifact_sign (*art_p, key, NULL, &err) == 0, "%s", err.msg);
    ck_assert_msg (kiln_artifact_write (*art_p, path, &err) == 0, "%s", err.msg);
    kiln_artifact_destroy (art_p);
}

void
testlib_resign (kiln_artifact_t *src, const uint8_t *prog, size_t len,
                const kiln_key_t *key, const char *path)
{
    kiln_err_t err = { 0 };
    kiln_artifact_t *a = kiln_artifact_new ();
    kiln_manifest_t *sm = kiln_artifact_manifest (src), *dm = kiln_artifact_manifest (a);
    dm->format_version = sm->format_version;
    memcpy (dm->graph_digest, sm->graph_digest, sizeof dm->graph_digest);
    memcpy (dm->action_key, sm->action_key, sizeof dm->action_key);
    memcpy (dm->compiler_id, sm->compiler_id, sizeof dm->compiler_id);
    memcpy (dm->compiler_version, sm->compiler_version, sizeof dm->compiler_version);
    memcpy (dm->compiler_args, sm->compiler_args, sizeof dm->compiler_args);
    memcpy (dm->target, sm->target, sizeof dm->target);
    dm->runtime_abi = sm->runtime_abi;
    ck_assert (kiln_manifest_set_io (dm, false, sm->inputs, sm->n_inputs, &err) == 0);
    ck_assert (kiln_manifest_set_io (dm, true, sm->outputs, sm->n_outputs, &err) == 0);
    ck_assert (kiln_manifest_set_io_structure (dm, sm->io_structure, &err) == 0);
    size_t wlen;
    const uint8_t *w = kiln_artifact_member (src, KILN_WEIGHTS_MEMBER, &wlen);
    ck_assert (kiln_artifact_add_member (a, KILN_WEIGHTS_MEMBER, w, wlen, &err) == 0);
    ck_assert (kiln_artifact_add_member (a, KILN_PROGRAM_MEMBER, prog, len, &err) == 0);
    ck_assert (kiln_artifact_sign (a, key, NULL, &err) == 0);
    ck_assert_msg (kiln_artifact_write (a, path, &err) == 0, "%s", err.msg);
    kiln_artifact_destroy (&a);
}

/* --- running -------------------------------------------------------- */

int
testlib_run (Suite *suite)
{
    SRunner *sr = srunner_create (suite);
    srunner_run_all (sr, CK_NORMAL);
    int failed = srunner_ntests_failed (sr);
    srunner_free (sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

int
testlib_run_in_tmpdir (Suite *suite, const char *name)
{
    kiln_err_t err = { 0 };
    char prefix[64];
    snprintf (prefix, sizeof prefix, "kiln-test-%s-", name);
    char *root = kiln_mkdtemp (prefix, &err);
    if (!root) {
        /* Check has no public way to free a suite that never ran; the
         * process is about to exit. */
        fprintf (stderr, "test_%s: %s\n", name, err.msg);
        return EXIT_FAILURE;
    }
    setenv ("TMPDIR", root, 1);
    int status = testlib_run (suite);
    testlib_rmdir (&root);
    return status;
}

uint8_t *
testlib_tar_copy (const uint8_t *data, size_t len, void (*edit) (struct archive_entry *),
                  size_t *out_len)
{
    size_t cap = len + (64 << 10);
    uint8_t *buf = malloc (cap);
    struct archive *in = archive_read_new (), *out = archive_write_new ();
    ck_assert_int_eq (archive_read_support_format_tar (in), ARCHIVE_OK);
    ck_assert_int_eq (archive_read_open_memory (in, data, len), ARCHIVE_OK);
    ck_assert_int_eq (archive_write_set_format_pax_restricted (out), ARCHIVE_OK);
    ck_assert_int_eq (archive_write_set_bytes_in_last_block (out, 10240), ARCHIVE_OK);
    ck_assert_int_eq (archive_write_open_memory (out, buf, cap, out_len), ARCHIVE_OK);
    struct archive_entry *e;
    static char chunk[1 << 16];
    while (archive_read_next_header (in, &e) == ARCHIVE_OK) {
        if (edit)
            edit (e);
        ck_assert_int_eq (archive_write_header (out, e), ARCHIVE_OK);
        la_ssize_t n;
        while ((n = archive_read_data (in, chunk, sizeof chunk)) > 0)
            ck_assert_int_eq (archive_write_data (out, chunk, (size_t) n), n);
    }
    ck_assert_int_eq (archive_write_close (out), ARCHIVE_OK);
    archive_write_free (out);
    archive_read_free (in);
    return buf;
}

typedef struct {
    kiln_gemm_t g;
} s_one_t;

static void
s_get_one (const void *ctx, int64_t idx, kiln_gemm_t *g)
{
    *g = ((const s_one_t *) ctx)->g;
}

void
testlib_gemm (const kiln_gemm_t *g)
{
    size_t bytes = kiln_gemm_ws_bytes (g->m, g->n, g->k,
                                       g->a.kind == KILN_GSRC_PACKED,
                                       g->b.kind == KILN_GSRC_PACKED);
    bytes = (bytes + 63) & ~(size_t) 63;
    float *ws = aligned_alloc (64, bytes * (size_t) kiln_exec_threads ());
    ck_assert_ptr_nonnull (ws);
    kiln_exec_set_ws (ws, bytes);
    s_one_t one = { *g };
    kiln_gemm_run (s_get_one, &one, 1);
    kiln_exec_set_ws (NULL, 0);
    free (ws);
}
