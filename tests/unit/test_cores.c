/*
 * Execution cores, placement and dynamic batching (runtime/kiln_cores.c,
 * runtime/kiln_batch.c): CPU lists and the environment, executors pinned
 * to their CPU, round-robin placement, batched runs against single runs,
 * and the errors a batch of the wrong shape gets.
 */
#include <check.h>
#include <limits.h>
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_fs.h"
#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"
#include "runtime/kiln_cores.h"
#include "runtime/kiln_rt.h"
#include "tests/unit/testlib.h"

static char *s_dir;
static char s_keys[PATH_MAX];
static kiln_rt_t *s_rt;

/* CPUs this process may run on. */
static int
s_allowed (void)
{
    cpu_set_t set;
    CPU_ZERO (&set);
    ck_assert (sched_getaffinity (0, sizeof set, &set) == 0);
    return CPU_COUNT (&set);
}

static void
setup (void)
{
    s_dir = testlib_keydir ("kiln-test-cores-", s_keys, NULL);
    unsetenv ("KILN_RT_VISIBLE_CORES");
    unsetenv ("KILN_RT_NUM_CORES");
    s_rt = NULL;
}

static void
teardown (void)
{
    kiln_rt_destroy (&s_rt);
    testlib_rmdir (&s_dir);
}

/* --- a small model: y = relu (x @ W) + z, x [B, 4], z [B, 3] --------- */

static const float s_w[12] = {
    0.5f, -1.0f, 0.25f,   1.0f, 0.5f, -0.5f,
    -0.25f, 2.0f, 1.0f,   0.75f, -0.5f, 0.5f,
};

/* Build, compile, sign and write the model for batch `b`; returns the
 * artifact path (static buffer). */
static const char *
s_make_model (int64_t b)
{
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_graph_new ();
    kiln_shape_t xs = { 2, { b, 4 } }, zs = { 2, { b, 3 } }, ws = { 2, { 4, 3 } };
    int x = kiln_graph_add_tensor (g, "x", KILN_DT_FLOAT32, &xs, &err);
    int z = kiln_graph_add_tensor (g, "z", KILN_DT_FLOAT32, &zs, &err);
    int w = kiln_graph_add_tensor (g, "w", KILN_DT_FLOAT32, &ws, &err);
    int xw = kiln_graph_add_tensor (g, "xw", KILN_DT_UNDEFINED, NULL, &err);
    int r = kiln_graph_add_tensor (g, "r", KILN_DT_UNDEFINED, NULL, &err);
    int y = kiln_graph_add_tensor (g, "y", KILN_DT_UNDEFINED, NULL, &err);
    ck_assert_msg (x >= 0 && z >= 0 && w >= 0 && xw >= 0 && r >= 0 && y >= 0, "%s",
                   err.msg);
    uint8_t *wdata = malloc (sizeof s_w);
    memcpy (wdata, s_w, sizeof s_w);
    ck_assert_msg (kiln_graph_set_weight (g, w, &wdata, sizeof s_w, &err) == 0, "%s",
                   err.msg);
    ck_assert (kiln_graph_add_input (g, x, &err) == 0);
    ck_assert (kiln_graph_add_input (g, z, &err) == 0);
    int in1[2] = { x, w }, in2[1] = { xw }, in3[2] = { r, z };
    ck_assert_msg (kiln_graph_add_node (g, "MatMul", "mm", in1, 2, &xw, 1, &err) >= 0,
                   "%s", err.msg);
    ck_assert_msg (kiln_graph_add_node (g, "Relu", "relu", in2, 1, &r, 1, &err) >= 0,
                   "%s", err.msg);
    ck_assert_msg (kiln_graph_add_node (g, "Add", "add", in3, 2, &y, 1, &err) >= 0,
                   "%s", err.msg);
    ck_assert (kiln_graph_add_output (g, y, &err) == 0);

    kiln_artifact_t *art = kiln_cc_compile (g, NULL, &err);
    ck_assert_msg (art, "compile: %s", err.msg);
    kiln_key_t *key = NULL;
    char keyfile[PATH_MAX + 16];
    snprintf (keyfile, sizeof keyfile, "%s/kiln.key", s_keys);
    if (kiln_file_exists (keyfile))
        key = kiln_key_load_private (keyfile, &err);
    else {
        key = kiln_key_generate (&err);
        ck_assert_msg (key && kiln_key_write_pair (key, s_keys, &err) == 0, "%s",
                       err.msg);
    }
    ck_assert_msg (key, "%s", err.msg);
    static char path[PATH_MAX];
    snprintf (path, sizeof path, "%s/model-b%lld.kar", s_dir, (long long) b);
    testlib_sign_write (&art, key, path);
    kiln_key_destroy (&key);
    kiln_graph_destroy (&g);
    return path;
}

/* The reference, row by row, in double. */
static void
s_reference (const float *x, const float *z, int64_t rows, double *y)
{
    for (int64_t i = 0; i < rows; i++)
        for (int j = 0; j < 3; j++) {
            double acc = 0;
            for (int k = 0; k < 4; k++)
                acc += (double) x[i * 4 + k] * s_w[k * 3 + j];
            y[i * 3 + j] = (acc > 0 ? acc : 0) + z[i * 3 + j];
        }
}

static void
s_fill (float *v, int64_t n, unsigned seed)
{
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        v[i] = (float) ((seed >> 8) % 2001) / 1000.0f - 1.0f;
    }
}

/* --- CPU lists ------------------------------------------------------ */

START_TEST (test_cores_parse_accepts_ranges_and_lists)
{
    kiln_err_t err = { 0 };
    int cpus[16];
    ck_assert_int_eq (kiln_cores_parse ("0-3", "X", cpus, 16, &err), 4);
    ck_assert (cpus[0] == 0 && cpus[3] == 3);
    ck_assert_int_eq (kiln_cores_parse ("5, 0,2-3", "X", cpus, 16, &err), 4);
    ck_assert (cpus[0] == 0 && cpus[1] == 2 && cpus[2] == 3 && cpus[3] == 5);
    ck_assert_int_eq (kiln_cores_parse ("7", "X", cpus, 16, &err), 1);
    ck_assert_int_eq (cpus[0], 7);
}
END_TEST

START_TEST (test_cores_parse_refuses_bad_lists_naming_them)
{
    static const char *bad[] = { "", "a", "3-1", "0,,1", "1-", "0-2,1", "99999",
                                 "0;1", "-1" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kiln_err_t err = { 0 };
        int cpus[16];
        ck_assert_msg (kiln_cores_parse (bad[i], "KILN_RT_VISIBLE_CORES", cpus, 16,
                                         &err) < 0, "'%s' was accepted", bad[i]);
        ck_assert_msg (strstr (err.msg, "KILN_RT_VISIBLE_CORES"), "%s", err.msg);
    }
    kiln_err_t err = { 0 };
    int cpus[2];
    ck_assert (kiln_cores_parse ("0-5", "X", cpus, 2, &err) == -KILN_ELIMIT);
}
END_TEST

START_TEST (test_runtime_cores_default_to_every_allowed_cpu)
{
    kiln_err_t err = { 0 };
    s_rt = kiln_rt_new (&err);
    ck_assert_msg (s_rt, "%s", err.msg);
    ck_assert_int_eq (kiln_rt_num_cores (s_rt), s_allowed ());
    ck_assert_int_eq (kiln_rt_core_cpu (s_rt, kiln_rt_num_cores (s_rt)), -1);
}
END_TEST

START_TEST (test_runtime_cores_follow_the_environment)
{
    kiln_err_t err = { 0 };
    setenv ("KILN_RT_VISIBLE_CORES", "0", 1);
    s_rt = kiln_rt_new (&err);
    ck_assert_msg (s_rt, "%s", err.msg);
    ck_assert_int_eq (kiln_rt_num_cores (s_rt), 1);
    ck_assert_int_eq (kiln_rt_core_cpu (s_rt, 0), 0);
    kiln_rt_destroy (&s_rt);

    unsetenv ("KILN_RT_VISIBLE_CORES");
    setenv ("KILN_RT_NUM_CORES", "1", 1);
    s_rt = kiln_rt_new (&err);
    ck_assert_msg (s_rt, "%s", err.msg);
    ck_assert_int_eq (kiln_rt_num_cores (s_rt), 1);
    kiln_rt_destroy (&s_rt);

    char many[32];
    snprintf (many, sizeof many, "%d", s_allowed () + 1);
    setenv ("KILN_RT_NUM_CORES", many, 1);
    ck_assert (kiln_rt_new (&err) == NULL);
    ck_assert_msg (strstr (err.msg, "KILN_RT_NUM_CORES"), "%s", err.msg);
    setenv ("KILN_RT_NUM_CORES", "two", 1);
    ck_assert (kiln_rt_new (&err) == NULL);
    ck_assert_msg (strstr (err.msg, "'two'"), "%s", err.msg);
    unsetenv ("KILN_RT_NUM_CORES");

    setenv ("KILN_RT_VISIBLE_CORES", "1023", 1);
    ck_assert (kiln_rt_new (&err) == NULL);
    ck_assert_msg (strstr (err.msg, "CPU 1023 is not available"), "%s", err.msg);
}
END_TEST

/* --- executors ------------------------------------------------------ */

typedef struct {
    int cpu;                        /* where the job ran */
    int core;                       /* kiln_cores_current there */
    const kiln_cores_t *cores;
} s_where_t;

static void
s_where_job (void *arg)
{
    s_where_t *w = arg;
    w->cpu = sched_getcpu ();
    w->core = kiln_cores_current (w->cores);
}

START_TEST (test_cores_run_jobs_on_their_pinned_cpu)
{
    kiln_err_t err = { 0 };
    kiln_cores_t *cores = kiln_cores_new (NULL, NULL, &err);
    ck_assert_msg (cores, "%s", err.msg);
    ck_assert_int_eq (kiln_cores_current (cores), -1);
    for (int c = 0; c < kiln_cores_count (cores); c++)
        for (int rep = 0; rep < 3; rep++) {
            s_where_t w = { -1, -1, cores };
            ck_assert_msg (kiln_cores_call (cores, c, s_where_job, &w, &err) == 0, "%s",
                           err.msg);
            ck_assert_int_eq (w.cpu, kiln_cores_cpu (cores, c));
            ck_assert_int_eq (w.core, c);
        }
    s_where_t w = { 0, 0, cores };
    ck_assert (kiln_cores_call (cores, kiln_cores_count (cores), s_where_job, &w,
                                &err) == -KILN_EINVAL);
    kiln_cores_destroy (&cores);
    ck_assert (cores == NULL);
}
END_TEST

/* Jobs on two cores overlap in time: each waits, bounded, for the other
 * to have started. */
typedef struct {
    _Atomic int *started;
    int saw_other;
} s_meet_t;

static void
s_meet_job (void *arg)
{
    s_meet_t *m = arg;
    atomic_fetch_add (m->started, 1);
    for (int i = 0; i < 5000 && atomic_load (m->started) < 2; i++) {
        struct timespec ts = { 0, 1000000 };
        nanosleep (&ts, NULL);
    }
    m->saw_other = atomic_load (m->started) >= 2;
}

START_TEST (test_cores_run_jobs_of_two_cores_concurrently)
{
    if (s_allowed () < 2)
        return;
    kiln_err_t err = { 0 };
    kiln_cores_t *cores = kiln_cores_new (NULL, "2", &err);
    ck_assert_msg (cores, "%s", err.msg);
    _Atomic int started;
    atomic_init (&started, 0);
    s_meet_t a = { &started, 0 }, b = { &started, 0 };
    kiln_core_latch_t latch;
    kiln_core_latch_init (&latch, 2);
    kiln_core_job_t ja = { .fn = s_meet_job, .arg = &a, .latch = &latch };
    kiln_core_job_t jb = { .fn = s_meet_job, .arg = &b, .latch = &latch };
    ck_assert (kiln_cores_submit (cores, 0, &ja, &err) == 0);
    ck_assert (kiln_cores_submit (cores, 1, &jb, &err) == 0);
    kiln_core_latch_wait (&latch);
    kiln_core_latch_release (&latch);
    ck_assert (a.saw_other && b.saw_other);
    kiln_cores_destroy (&cores);
}
END_TEST

/* --- placement and batching ---------------------------------------- */

START_TEST (test_models_are_placed_round_robin)
{
    kiln_err_t err = { 0 };
    const char *path = s_make_model (2);
    s_rt = kiln_rt_new (&err);
    ck_assert_msg (s_rt, "%s", err.msg);
    int n = kiln_rt_num_cores (s_rt);
    kiln_model_t *m[5];
    for (int i = 0; i < 5; i++) {
        m[i] = kiln_rt_load (s_rt, path, s_keys, &err);
        ck_assert_msg (m[i], "%s", err.msg);
        ck_assert_int_eq (kiln_model_core (m[i]), i % n);
    }
    /* An explicit core takes no turn; a core that does not exist is an
     * error naming it. */
    kiln_model_t *pinned = kiln_rt_load_on (s_rt, path, s_keys, n - 1, &err);
    ck_assert_msg (pinned, "%s", err.msg);
    ck_assert_int_eq (kiln_model_core (pinned), n - 1);
    kiln_model_destroy (&pinned);
    ck_assert (kiln_rt_load_on (s_rt, path, s_keys, n, &err) == NULL);
    ck_assert_msg (strstr (err.msg, "no core"), "%s", err.msg);
    kiln_model_t *next = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_int_eq (kiln_model_core (next), 5 % n);
    kiln_model_destroy (&next);
    /* The runtime may go first: models keep it alive. */
    kiln_rt_destroy (&s_rt);
    for (int i = 0; i < 5; i++) {
        float x[8] = { 1, 2, 3, 4, -1, -2, -3, -4 }, z[6] = { 0 }, y[6];
        double want[6];
        kiln_rt_tensor_t in[2] = { { KILN_DT_FLOAT32, { 2, { 2, 4 } }, x },
                                   { KILN_DT_FLOAT32, { 2, { 2, 3 } }, z } };
        kiln_rt_tensor_t out = { .data = y };
        ck_assert_msg (kiln_model_run (m[i], in, 2, &out, 1, &err) == 0, "%s", err.msg);
        s_reference (x, z, 2, want);
        for (int k = 0; k < 6; k++)
            ck_assert_msg (fabs (y[k] - want[k]) < 1e-5, "y[%d]=%g want %g", k, y[k],
                           want[k]);
        kiln_model_destroy (&m[i]);
    }
}
END_TEST

/* Batches smaller, equal and larger than the compiled one, not
 * multiples of it, over one and several replicas. */
START_TEST (test_batched_run_splits_pads_joins_and_trims)
{
    kiln_err_t err = { 0 };
    const char *path = s_make_model (3);
    s_rt = kiln_rt_new (&err);
    ck_assert_msg (s_rt, "%s", err.msg);
    kiln_model_t *reps[3];
    for (int r = 0; r < 3; r++) {
        reps[r] = kiln_rt_load (s_rt, path, s_keys, &err);
        ck_assert_msg (reps[r], "%s", err.msg);
    }
    ck_assert_int_eq (kiln_model_batch_size (reps[0], &err), 3);
    static const int64_t batches[] = { 1, 2, 3, 4, 7, 9, 10, 31 };
    for (size_t bi = 0; bi < sizeof batches / sizeof batches[0]; bi++)
        for (int n_rep = 1; n_rep <= 3; n_rep++) {
            int64_t n = batches[bi];
            float *x = malloc ((size_t) n * 4 * sizeof *x);
            float *z = malloc ((size_t) n * 3 * sizeof *z);
            float *y = malloc ((size_t) n * 3 * sizeof *y);
            double *want = malloc ((size_t) n * 3 * sizeof *want);
            s_fill (x, n * 4, (unsigned) (n * 7 + n_rep));
            s_fill (z, n * 3, (unsigned) (n * 13 + n_rep));
            for (int64_t k = 0; k < n * 3; k++)
                y[k] = NAN;
            s_reference (x, z, n, want);
            kiln_rt_tensor_t in[2] = { { KILN_DT_FLOAT32, { 2, { n, 4 } }, x },
                                       { KILN_DT_FLOAT32, { 2, { n, 3 } }, z } };
            kiln_rt_tensor_t out = { .data = y };
            ck_assert_msg (kiln_model_run_batched (reps, n_rep, in, 2, &out, 1, &err) == 0,
                           "batch %lld: %s", (long long) n, err.msg);
            ck_assert_int_eq (out.shape.rank, 2);
            ck_assert_int_eq (out.shape.dims[0], n);
            ck_assert_int_eq (out.shape.dims[1], 3);
            for (int64_t k = 0; k < n * 3; k++)
                ck_assert_msg (fabs (y[k] - want[k]) < 1e-5, "batch %lld, %d replicas: "
                               "y[%lld]=%g want %g", (long long) n, n_rep, (long long) k,
                               y[k], want[k]);
            free (x);
            free (z);
            free (y);
            free (want);
        }
    for (int r = 0; r < 3; r++)
        kiln_model_destroy (&reps[r]);
}
END_TEST

START_TEST (test_batched_run_refuses_other_dims_and_differing_batches)
{
    kiln_err_t err = { 0 };
    const char *path = s_make_model (1);
    s_rt = kiln_rt_new (&err);
    kiln_model_t *m = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_msg (m, "%s", err.msg);
    float x[40] = { 0 }, z[40] = { 0 }, y[40];
    kiln_rt_tensor_t out = { .data = y };

    kiln_rt_tensor_t wide[2] = { { KILN_DT_FLOAT32, { 2, { 4, 5 } }, x },
                                 { KILN_DT_FLOAT32, { 2, { 4, 3 } }, z } };
    ck_assert (kiln_model_run_batched (&m, 1, wide, 2, &out, 1, &err) == -KILN_ESHAPE);
    ck_assert_msg (strstr (err.msg, "input 'x': expected float32 [N, 4]")
                   && strstr (err.msg, "received float32 [4, 5]"), "%s", err.msg);

    kiln_rt_tensor_t differ[2] = { { KILN_DT_FLOAT32, { 2, { 4, 4 } }, x },
                                   { KILN_DT_FLOAT32, { 2, { 3, 3 } }, z } };
    ck_assert (kiln_model_run_batched (&m, 1, differ, 2, &out, 1, &err) == -KILN_ESHAPE);
    ck_assert_msg (strstr (err.msg, "'x' has 4, 'z' has 3"), "%s", err.msg);

    kiln_rt_tensor_t dtype[2] = { { KILN_DT_FLOAT64, { 2, { 2, 4 } }, x },
                                  { KILN_DT_FLOAT32, { 2, { 2, 3 } }, z } };
    ck_assert (kiln_model_run_batched (&m, 1, dtype, 2, &out, 1, &err) == -KILN_ESHAPE);
    ck_assert_msg (strstr (err.msg, "received float64"), "%s", err.msg);

    /* A single run still wants the compiled shape exactly. */
    kiln_rt_tensor_t two[2] = { { KILN_DT_FLOAT32, { 2, { 2, 4 } }, x },
                                { KILN_DT_FLOAT32, { 2, { 2, 3 } }, z } };
    ck_assert (kiln_model_run (m, two, 2, &out, 1, &err) == -KILN_ESHAPE);
    ck_assert_msg (strstr (err.msg, "input 'x': expected float32 [1, 4], received "
                           "float32 [2, 4]"), "%s", err.msg);

    /* A batch of zero rows is an empty result, not an error. */
    kiln_rt_tensor_t none[2] = { { KILN_DT_FLOAT32, { 2, { 0, 4 } }, x },
                                 { KILN_DT_FLOAT32, { 2, { 0, 3 } }, z } };
    ck_assert_msg (kiln_model_run_batched (&m, 1, none, 2, &out, 1, &err) == 0, "%s",
                   err.msg);
    ck_assert_int_eq (out.shape.dims[0], 0);

    /* Replicas must be one model. */
    const char *other = s_make_model (2);
    kiln_model_t *o = kiln_rt_load (s_rt, other, s_keys, &err);
    ck_assert_msg (o, "%s", err.msg);
    kiln_model_t *mixed[2] = { m, o };
    ck_assert (kiln_model_run_batched (mixed, 2, two, 2, &out, 1, &err) == -KILN_EINVAL);
    ck_assert_msg (strstr (err.msg, "replica 1 is another model"), "%s", err.msg);
    kiln_model_destroy (&o);
    kiln_model_destroy (&m);
}
END_TEST

START_TEST (test_io_accessors_describe_the_interface)
{
    kiln_err_t err = { 0 };
    const char *path = s_make_model (2);
    s_rt = kiln_rt_new (&err);
    kiln_model_t *m = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_msg (m, "%s", err.msg);
    ck_assert_int_eq (kiln_model_io_count (m, 0), 2);
    ck_assert_int_eq (kiln_model_io_count (m, 1), 1);
    const char *name = NULL;
    int dtype = 0;
    int64_t dims[KILN_MAX_RANK];
    ck_assert_int_eq (kiln_model_io (m, 0, 1, &name, &dtype, dims, &err), 2);
    ck_assert_str_eq (name, "z");
    ck_assert_int_eq (dtype, KILN_DT_FLOAT32);
    ck_assert (dims[0] == 2 && dims[1] == 3);
    ck_assert (kiln_model_io (m, 1, 1, &name, &dtype, dims, &err) < 0);
    ck_assert_uint_eq (kiln_rt_tensor_sizeof (), sizeof (kiln_rt_tensor_t));
    kiln_model_destroy (&m);
}
END_TEST

/* Every binding in a process shares one runtime: its placement goes on
 * from one binding's models to the next's, and no caller can end it.
 * A model reports its artifact's content hash. */
START_TEST (test_shared_runtime_is_one_per_process_and_survives_destroy)
{
    kiln_err_t err = { 0 };
    const char *path = s_make_model (2);
    /* A failed creation is reported, and the next call tries again. */
    setenv ("KILN_RT_NUM_CORES", "two", 1);
    ck_assert (kiln_rt_shared (&err) == NULL);
    ck_assert_msg (strstr (err.msg, "'two'"), "%s", err.msg);
    unsetenv ("KILN_RT_NUM_CORES");

    kiln_rt_t *a = kiln_rt_shared (&err);
    ck_assert_msg (a, "%s", err.msg);
    kiln_rt_t *b = kiln_rt_shared (&err);
    ck_assert (a == b);
    int n = kiln_rt_num_cores (a);
    kiln_model_t *m0 = kiln_rt_load (a, path, s_keys, &err);
    ck_assert_msg (m0, "%s", err.msg);
    kiln_rt_destroy (&a);
    ck_assert (a == NULL);
    kiln_model_destroy (&m0);
    /* Destroying it, and its last model, left it whole. */
    kiln_model_t *m1 = kiln_rt_load (b, path, s_keys, &err);
    ck_assert_msg (m1, "%s", err.msg);
    ck_assert_int_eq (kiln_model_core (m1), 1 % n);
    ck_assert (kiln_rt_shared (&err) == b);
    /* A model names the artifact it runs by its content hash. */
    char got[KILN_HEX_LEN], want[KILN_HEX_LEN];
    ck_assert_msg (kiln_model_digest (m1, got, &err) == 0, "%s", err.msg);
    kiln_artifact_t *art = kiln_artifact_read (path, &err);
    ck_assert_msg (art && kiln_artifact_digest (art, want, &err) == 0, "%s", err.msg);
    ck_assert_str_eq (got, want);
    kiln_artifact_destroy (&art);
    kiln_model_destroy (&m1);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("cores");
    TCase *tc = tcase_create ("cores");
    tcase_add_checked_fixture (tc, setup, teardown);
    tcase_set_timeout (tc, 60);
    tcase_add_test (tc, test_cores_parse_accepts_ranges_and_lists);
    tcase_add_test (tc, test_cores_parse_refuses_bad_lists_naming_them);
    tcase_add_test (tc, test_runtime_cores_default_to_every_allowed_cpu);
    tcase_add_test (tc, test_runtime_cores_follow_the_environment);
    tcase_add_test (tc, test_cores_run_jobs_on_their_pinned_cpu);
    tcase_add_test (tc, test_cores_run_jobs_of_two_cores_concurrently);
    tcase_add_test (tc, test_models_are_placed_round_robin);
    tcase_add_test (tc, test_shared_runtime_is_one_per_process_and_survives_destroy);
    tcase_add_test (tc, test_batched_run_splits_pads_joins_and_trims);
    tcase_add_test (tc, test_batched_run_refuses_other_dims_and_differing_batches);
    tcase_add_test (tc, test_io_accessors_describe_the_interface);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run (s_suite ());
}
