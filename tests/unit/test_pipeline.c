/*
 * Unit tests for pipelining (--pipeline-cores N): the compiler's cut
 * (compiler/kiln_cc_pipeline.c), the program's and the manifest's record
 * of the stages (common/kiln_program.c, artifact/kiln_manifest.c), and
 * libkilnrt's stages on their cores (runtime/kiln_pipeline.c).  A chain
 * of convolutions whose input is read again at the end (so that a graph
 * input is handed through every stage) is compiled whole and in 2 and 3
 * stages; the pipelined runs must give the bytes of the whole one.
 */
#include <check.h>

#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_program.h"
#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"
#include "runtime/kiln_rt.h"
#include "tests/unit/testlib.h"

#define S_B 2           /* the compiled batch */
#define S_C 8
#define S_HW 12
#define S_LAYERS 6

static char *s_dir;
static char s_keys[PATH_MAX];
static kiln_key_t *s_key;

static void
setup (void)
{
    s_dir = testlib_keydir ("kiln-test-pipeline-", s_keys, &s_key);
    testlib_seed (4242);
    unsetenv ("KILN_RT_NUM_CORES");
    unsetenv ("KILN_RT_VISIBLE_CORES");
    unsetenv ("KILN_RT_PIPELINE_SHARE");
}

static void
teardown (void)
{
    kiln_key_destroy (&s_key);
    testlib_rmdir (&s_dir);
}

/* x -> (Conv 3x3 + Relu) x S_LAYERS -> + x -> y, all [S_B, S_C, S_HW, S_HW]. */
static kiln_graph_t *
s_graph (void)
{
    testlib_seed (7);       /* the same weights every time */
    kiln_graph_t *g = kiln_graph_new ();
    int x = testlib_input (g, "x", SH (S_B, S_C, S_HW, S_HW));
    int h = x;
    for (int l = 0; l < S_LAYERS; l++) {
        char name[32];
        snprintf (name, sizeof name, "w%d", l);
        int w = testlib_const (g, name, SH (S_C, S_C, 3, 3), 0.3f, 0.0f);
        snprintf (name, sizeof name, "c%d", l);
        int c = testlib_tensor (g, name);
        int n = testlib_node (g, "Conv", name, (int[]) { h, w }, 2, c);
        testlib_ints (g, n, "pads", 4, 1, 1, 1, 1);
        snprintf (name, sizeof name, "r%d", l);
        int r = testlib_tensor (g, name);
        testlib_node (g, "Relu", name, (int[]) { c }, 1, r);
        h = r;
    }
    int y = testlib_tensor (g, "y");
    testlib_node (g, "Add", "residual", (int[]) { h, x }, 2, y);
    testlib_output (g, y);
    return g;
}

static kiln_artifact_t *
s_compile (const char *args)
{
    kiln_graph_t *g = s_graph ();
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_cc_compile (g, args, &err);
    ck_assert_msg (art, "compile '%s': %s", args ? args : "", err.msg);
    kiln_graph_destroy (&g);
    return art;
}

static char *
s_write (const char *args, const char *name)
{
    static char path[4][PATH_MAX];
    static int next;
    char *p = path[next++ % 4];
    snprintf (p, PATH_MAX, "%s/%s", s_dir, name);
    kiln_artifact_t *art = s_compile (args);
    testlib_sign_write (&art, s_key, p);
    return p;
}

static kiln_model_t *
s_load (kiln_rt_t *rt, const char *path)
{
    kiln_err_t err = { 0 };
    kiln_model_t *m = kiln_rt_load (rt, path, s_keys, &err);
    ck_assert_msg (m, "load %s: %s", path, err.msg);
    return m;
}

#define S_NUMEL ((int64_t) S_B * S_C * S_HW * S_HW)

/* Run `m` on `rows` rows of x (batched when rows is not S_B). */
static float *
s_run (kiln_model_t *m, const float *x, int64_t rows)
{
    float *y = calloc ((size_t) (S_NUMEL / S_B * rows), sizeof *y);
    kiln_rt_tensor_t in = { KILN_DT_FLOAT32, SH (rows, S_C, S_HW, S_HW), (void *) x };
    kiln_rt_tensor_t out = { .data = y };
    kiln_err_t err = { 0 };
    int rc = rows == S_B ? kiln_model_run (m, &in, 1, &out, 1, &err)
                         : kiln_model_run_batched (&m, 1, &in, 1, &out, 1, &err);
    ck_assert_msg (rc == 0, "%s", err.msg);
    return y;
}

START_TEST (test_compiler_cuts_even_stages_recorded_in_program_and_manifest)
{
    kiln_artifact_t *art = s_compile ("--pipeline-cores 3");
    kiln_program_t *p = testlib_program_of (art);
    const kiln_manifest_t *man = kiln_artifact_manifest (art);
    ck_assert_int_eq (p->n_stages, 3);
    ck_assert_int_eq (man->n_stages, 3);
    uint64_t lo = UINT64_MAX, hi = 0;
    for (int s = 0; s < 3; s++) {
        ck_assert_int_eq (man->stages[s].first_op, p->stages[s].first_op);
        ck_assert_int_ge (man->stages[s].n_ops, 1);
        lo = man->stages[s].cost_ns < lo ? man->stages[s].cost_ns : lo;
        hi = man->stages[s].cost_ns > hi ? man->stages[s].cost_ns : hi;
        /* Six equal layers in three stages: two each, so each stage reads
         * two layers' weights and receives the input it adds at the end. */
        ck_assert_uint_eq (man->stages[s].weights_bytes,
                           (uint64_t) 2 * S_C * S_C * 9 * 4);
        if (s > 0) {
            ck_assert_int_ge (p->stages[s].n_handoff, 1);
            ck_assert_uint_ge (man->stages[s].handoff_bytes, (uint64_t) S_NUMEL * 4 * 2);
        }
    }
    ck_assert_uint_eq (p->stages[0].n_handoff, 0);
    ck_assert_msg (hi < lo * 3 / 2, "stages of %llu..%llu ns are not even",
                   (unsigned long long) lo, (unsigned long long) hi);
    /* The encoding keeps the stages, and only a pipelined program has
     * them: the same graph compiled whole has none. */
    uint8_t *bytes = NULL;
    size_t len = 0;
    kiln_err_t err = { 0 };
    ck_assert (kiln_program_encode (p, &bytes, &len, &err) == 0);
    kiln_program_t *back = kiln_program_decode (bytes, len, UINT64_MAX, &err);
    ck_assert_msg (back, "%s", err.msg);
    ck_assert_int_eq (back->n_stages, 3);
    ck_assert_int_eq (back->stages[2].first_op, p->stages[2].first_op);
    ck_assert_int_eq (back->stages[2].n_handoff, p->stages[2].n_handoff);
    kiln_program_destroy (&back);
    free (bytes);
    kiln_artifact_t *whole = s_compile (NULL);
    ck_assert_int_eq (kiln_artifact_manifest (whole)->n_stages, 0);
    kiln_program_t *wp = testlib_program_of (whole);
    ck_assert_int_eq (wp->n_stages, 0);
    ck_assert_int_eq (wp->n_ops, p->n_ops);
    kiln_program_destroy (&wp);
    kiln_artifact_destroy (&whole);
    kiln_program_destroy (&p);
    kiln_artifact_destroy (&art);
}
END_TEST

START_TEST (test_decoder_refuses_stages_that_break_the_rules)
{
    kiln_artifact_t *art = s_compile ("--pipeline-cores 2");
    kiln_err_t err = { 0 };
    const char *why[] = { "first op", "handoff range", "stage 0 has a handoff" };
    for (int k = 0; k < 3; k++) {
        kiln_program_t *p = testlib_program_of (art);
        if (k == 0)
            p->stages[1].first_op = 0;
        else if (k == 1)
            p->stages[1].handoff[0].size = p->arena_size + 64;
        else {
            p->stages[0].handoff = p->stages[1].handoff;
            p->stages[0].n_handoff = p->stages[1].n_handoff;
            p->stages[1].handoff = NULL;
            p->stages[1].n_handoff = 0;
        }
        uint8_t *bytes = NULL;
        size_t len = 0;
        ck_assert (kiln_program_encode (p, &bytes, &len, &err) == 0);
        kiln_program_t *back = kiln_program_decode (bytes, len, UINT64_MAX, &err);
        ck_assert_msg (!back, "case %d decoded", k);
        ck_assert_msg (strstr (err.msg, why[k]), "case %d: %s", k, err.msg);
        free (bytes);
        kiln_program_destroy (&p);
    }
    /* The manifest's record must be in order too. */
    kiln_manifest_t m = { 0 };
    kiln_stage_info_t st[2] = { { .first_op = 0, .n_ops = 3 }, { .first_op = 4, .n_ops = 1 } };
    ck_assert (kiln_manifest_set_pipeline (&m, st, 2, &err) != 0);
    ck_assert_msg (strstr (err.msg, "expected op 3"), "%s", err.msg);
    ck_assert (kiln_manifest_set_pipeline (&m, st, 1, &err) != 0);
    kiln_artifact_destroy (&art);
    /* More stages than ops is refused, naming the flag. */
    kiln_graph_t *g = s_graph ();
    ck_assert (!kiln_cc_compile (g, "--pipeline-cores 32", &err));
    ck_assert_msg (strstr (err.msg, "--pipeline-cores 32: the program has"), "%s", err.msg);
    ck_assert (!kiln_cc_compile (g, "--pipeline-cores 33", &err));
    kiln_graph_destroy (&g);
}
END_TEST

/* Concurrent callers of one pipelined model. */
typedef struct {
    kiln_model_t *m;
    const float *x;
    float *y;
} s_call_t;

static void *
s_call (void *arg)
{
    s_call_t *c = arg;
    c->y = s_run (c->m, c->x, S_B);
    return NULL;
}

START_TEST (test_stages_on_their_cores_give_the_bytes_of_the_whole_program)
{
    kiln_err_t err = { 0 };
    kiln_rt_t *rt = kiln_rt_new (&err);
    ck_assert_msg (rt, "%s", err.msg);
    if (kiln_rt_num_cores (rt) < 2) {
        kiln_rt_destroy (&rt);
        return;     /* one CPU: the sharing test below covers it */
    }
    kiln_model_t *whole = s_load (rt, s_write (NULL, "whole.kar"));
    kiln_model_t *piped = s_load (rt, s_write ("--pipeline-cores 2", "p2.kar"));
    ck_assert_int_eq (kiln_model_stage_count (whole), 1);
    ck_assert_int_eq (kiln_model_stage_count (piped), 2);
    int c0 = kiln_model_stage_core (piped, 0), c1 = kiln_model_stage_core (piped, 1);
    ck_assert_int_eq (c1, (c0 + 1) % kiln_rt_num_cores (rt));
    ck_assert_int_eq (kiln_model_stage_core (piped, 2), -1);

    /* One input at a time. */
    testlib_seed (99);
    float *x = testlib_rand (S_NUMEL * 4);
    for (int k = 0; k < 3; k++) {
        float *a = s_run (whole, x + k * S_NUMEL, S_B);
        float *b = s_run (piped, x + k * S_NUMEL, S_B);
        ck_assert_msg (memcmp (a, b, (size_t) S_NUMEL * 4) == 0, "run %d differs", k);
        free (a);
        free (b);
    }
    /* A stream: 7 rows in 4 chunks of 2 (the last padded), all in flight. */
    float *a = s_run (whole, x, 7);
    float *b = s_run (piped, x, 7);
    ck_assert (memcmp (a, b, (size_t) (S_NUMEL / S_B * 7) * 4) == 0);
    free (a);
    free (b);
    /* Concurrent callers. */
    s_call_t calls[6];
    pthread_t th[6];
    for (int k = 0; k < 6; k++) {
        calls[k] = (s_call_t) { piped, x + (k % 4) * S_NUMEL, NULL };
        ck_assert (pthread_create (&th[k], NULL, s_call, &calls[k]) == 0);
    }
    for (int k = 0; k < 6; k++) {
        pthread_join (th[k], NULL);
        float *want = s_run (whole, x + (k % 4) * S_NUMEL, S_B);
        ck_assert_msg (memcmp (want, calls[k].y, (size_t) S_NUMEL * 4) == 0,
                       "concurrent call %d differs", k);
        free (want);
        free (calls[k].y);
    }
    free (x);
    kiln_model_destroy (&piped);
    kiln_model_destroy (&whole);
    kiln_rt_destroy (&rt);
}
END_TEST

START_TEST (test_fewer_cores_than_stages_is_refused_unless_shared)
{
    char *whole_path = s_write (NULL, "whole.kar");
    char *path = s_write ("--pipeline-cores 3", "p3.kar");
    setenv ("KILN_RT_NUM_CORES", "1", 1);
    kiln_err_t err = { 0 };
    kiln_rt_t *rt = kiln_rt_new (&err);
    ck_assert_msg (rt, "%s", err.msg);
    ck_assert (!kiln_rt_load (rt, path, s_keys, &err));
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "pipelined over 3 cores (compiled with "
                           "--pipeline-cores 3) but this runtime has 1"), "%s", err.msg);
    ck_assert_msg (strstr (err.msg, "KILN_RT_PIPELINE_SHARE=1"), "%s", err.msg);
    setenv ("KILN_RT_PIPELINE_SHARE", "1", 1);
    kiln_model_t *piped = s_load (rt, path);
    kiln_model_t *whole = s_load (rt, whole_path);
    for (int s = 0; s < 3; s++)
        ck_assert_int_eq (kiln_model_stage_core (piped, s), 0);
    testlib_seed (99);
    float *x = testlib_rand (S_NUMEL * 3);     /* 6 rows */
    float *a = s_run (whole, x, S_B), *b = s_run (piped, x, S_B);
    ck_assert (memcmp (a, b, (size_t) S_NUMEL * 4) == 0);
    free (a);
    free (b);
    a = s_run (whole, x, 5);
    b = s_run (piped, x, 5);
    ck_assert (memcmp (a, b, (size_t) (S_NUMEL / S_B * 5) * 4) == 0);
    free (a);
    free (b);
    free (x);
    kiln_model_destroy (&piped);
    kiln_model_destroy (&whole);
    kiln_rt_destroy (&rt);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("pipeline");
    TCase *tc = tcase_create ("pipeline");
    tcase_add_checked_fixture (tc, setup, teardown);
    tcase_set_timeout (tc, 120);
    tcase_add_test (tc, test_compiler_cuts_even_stages_recorded_in_program_and_manifest);
    tcase_add_test (tc, test_decoder_refuses_stages_that_break_the_rules);
    tcase_add_test (tc, test_stages_on_their_cores_give_the_bytes_of_the_whole_program);
    tcase_add_test (tc, test_fewer_cores_than_stages_is_refused_unless_shared);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run_in_tmpdir (s_suite (), "test_pipeline");
}
