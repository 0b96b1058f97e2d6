/*
 * kiln-serve's pieces without HTTP: the v2 codec (serve/kiln_serve_v2.c)
 * against a real model's interface, the batcher (serve/kiln_serve_batch.c)
 * gathering jobs and splitting the rows back, and the metrics page
 * (serve/kiln_serve_metrics.c).  The model is y = relu(x) on float32 [2, 4]:
 * compiled, signed, loaded twice (two replicas).  The HTTP server, the
 * repository and the releases are tested with real processes in
 * tests/integration/test_serve.py.
 */
#include <check.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"
#include "runtime/kiln_rt.h"
#include "serve/kiln_serve_batch.h"
#include "serve/kiln_serve_metrics.h"
#include "serve/kiln_serve_v2.h"
#include "tests/unit/testlib.h"

static char *s_dir;
static char s_keys[PATH_MAX];
static kiln_key_t *s_key;
static kiln_rt_t *s_rt;
static kiln_model_t *s_models[2];
static kiln_serve_iface_t s_iface;

static void
setup (void)
{
    s_dir = testlib_keydir ("kiln-test-serve-", s_keys, &s_key);
    kiln_err_t err = { 0 };
    s_rt = kiln_rt_new (&err);
    ck_assert_msg (s_rt, "%s", err.msg);
    kiln_graph_t *g = kiln_graph_new ();
    int x = testlib_input (g, "x", SH (2, 4));
    int y = testlib_tensor (g, "y");
    testlib_node (g, "Relu", "relu", &x, 1, y);
    testlib_output (g, y);
    kiln_artifact_t *art = kiln_cc_compile (g, "", &err);
    ck_assert_msg (art, "%s", err.msg);
    kiln_graph_destroy (&g);
    char path[PATH_MAX];
    snprintf (path, sizeof path, "%s/relu.kar", s_dir);
    testlib_sign_write (&art, s_key, path);
    for (int r = 0; r < 2; r++) {
        s_models[r] = kiln_rt_load (s_rt, path, s_keys, &err);
        ck_assert_msg (s_models[r], "%s", err.msg);
    }
    ck_assert_int_eq (kiln_serve_iface_init (&s_iface, s_models[0], 8, &err), 0);
}

static void
teardown (void)
{
    kiln_serve_iface_release (&s_iface);
    for (int r = 0; r < 2; r++)
        kiln_model_destroy (&s_models[r]);
    kiln_rt_destroy (&s_rt);
    kiln_key_destroy (&s_key);
    testlib_rmdir (&s_dir);
}

static int
s_decode (const char *json, kiln_serve_v2_request_t *req, kiln_err_t *err)
{
    return kiln_serve_v2_decode_infer (&s_iface, (const uint8_t *) json, strlen (json),
                                       strlen (json), req, err);
}

START_TEST (test_serve_iface_reads_the_compiled_batch_and_rows)
{
    ck_assert_int_eq (s_iface.n_inputs, 1);
    ck_assert_int_eq (s_iface.n_outputs, 1);
    ck_assert_str_eq (s_iface.inputs[0].name, "x");
    ck_assert_int_eq (s_iface.compiled_batch, 2);
    ck_assert_int_eq (s_iface.max_rows, 8);
    ck_assert_int_eq (s_iface.inputs[0].row_elems, 4);
    ck_assert_int_eq ((int) s_iface.outputs[0].row_bytes, 16);
}
END_TEST

START_TEST (test_serve_v2_decodes_flat_and_nested_data_into_a_job)
{
    static const char *bodies[] = {
        "{\"id\":\"r1\",\"inputs\":[{\"name\":\"x\",\"shape\":[3,4],\"datatype\":\"FP32\","
        "\"data\":[0,1,2,3,4,5,6,7,8,9,10,11]}]}",
        "{\"id\":\"r1\",\"inputs\":[{\"name\":\"x\",\"shape\":[3,4],\"datatype\":\"FP32\","
        "\"data\":[[0,1,2,3],[4,5,6,7],[8,9,10,11.0]]}]}",
    };
    for (int b = 0; b < 2; b++) {
        kiln_serve_v2_request_t req;
        kiln_err_t err = { 0 };
        ck_assert_msg (s_decode (bodies[b], &req, &err) == 0, "%s", err.msg);
        ck_assert (req.has_id);
        ck_assert_str_eq (req.id, "r1");
        ck_assert_int_eq (req.job->rows, 3);
        const float *x = (const float *) req.job->inputs[0];
        for (int i = 0; i < 12; i++)
            ck_assert_float_eq (x[i], (float) i);
        ck_assert (req.want[0] && !req.binary[0]);
        kiln_serve_v2_request_release (&req);
    }
}
END_TEST

START_TEST (test_serve_v2_refuses_bad_requests_naming_what_is_wrong)
{
    static const struct {
        const char *body;
        int code;
        const char *text;
    } cases[] = {
        { "{", KILN_EFORMAT, "malformed JSON" },
        { "{\"inputs\":[{\"name\":\"x\",\"shape\":[2,5],\"datatype\":\"FP32\",\"data\":[]}]}",
          KILN_ESHAPE, "input 'x': shape [2, 5], the model takes [N, 4] with N 1..8" },
        { "{\"inputs\":[{\"name\":\"x\",\"shape\":[9,4],\"datatype\":\"FP32\",\"data\":[]}]}",
          KILN_ESHAPE, "N 1..8" },
        { "{\"inputs\":[{\"name\":\"x\",\"shape\":[1,4],\"datatype\":\"INT8\",\"data\":[1]}]}",
          KILN_ESHAPE, "datatype INT8, the model takes FP32" },
        { "{\"inputs\":[{\"name\":\"x\",\"shape\":[1,4],\"datatype\":\"FP32\",\"data\":[1,2]}]}",
          KILN_ESHAPE, "holds 2 elements, its shape 4" },
        { "{\"inputs\":[{\"name\":\"x\",\"shape\":[1,4],\"datatype\":\"FP32\","
          "\"data\":[1,2,3,4,5]}]}", KILN_ESHAPE, "more than the 4 elements" },
        { "{\"inputs\":[{\"name\":\"x\",\"shape\":[1,4],\"datatype\":\"FP32\","
          "\"data\":[1,true,3,4]}]}", KILN_EFORMAT, "element 1 is not a number" },
        { "{\"inputs\":[{\"name\":\"y\",\"shape\":[1,4],\"datatype\":\"FP32\",\"data\":[]}]}",
          KILN_EFORMAT, "no input 'y' (its inputs: 'x')" },
        { "{\"inputs\":[]}", KILN_EFORMAT, "input 'x' is missing" },
        { "{\"inputs\":[],\"extra\":1}", KILN_EFORMAT, "unknown field 'extra'" },
        { "{\"inputs\":[{\"name\":\"x\",\"shape\":[1,4],\"datatype\":\"FP32\","
          "\"data\":[[[[[[[[[1]]]]]]]]]}]}", KILN_EFORMAT, "nests deeper" },
        { "{\"inputs\":[{\"name\":\"x\",\"shape\":[1,4],\"datatype\":\"FP32\","
          "\"data\":[1,2,3,4]}],\"outputs\":[{\"name\":\"z\"}]}", KILN_EFORMAT,
          "no output 'z'" },
        { "{\"inputs\":[{\"name\":\"x\",\"shape\":[1,4],\"datatype\":\"FP32\","
          "\"data\":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,"
          "28,29,30,31,32,33,34,35,36,37,38,39,40]}]}", KILN_ESHAPE, "more than the 4" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_serve_v2_request_t req;
        kiln_err_t err = { 0 };
        int rc = s_decode (cases[i].body, &req, &err);
        ck_assert_msg (rc == -cases[i].code, "case %zu: rc %d (%s)", i, rc, err.msg);
        ck_assert_msg (strstr (err.msg, cases[i].text), "case %zu: '%s' lacks '%s'", i,
                       err.msg, cases[i].text);
        ck_assert_ptr_null (req.job);
        kiln_serve_v2_request_release (&req);
    }
}
END_TEST

START_TEST (test_serve_v2_bounds_the_json_values_before_parsing)
{
    /* 8 rows of 4 values is the most the interface takes: a body with
     * many more commas is refused before jansson sees it. */
    size_t n = 200000;
    char *body = malloc (n * 2 + 64);
    size_t len = (size_t) sprintf (body, "{\"inputs\":[");
    for (size_t i = 0; i < n; i++)
        len += (size_t) sprintf (body + len, "0,");
    len += (size_t) sprintf (body + len, "0]}");
    kiln_serve_v2_request_t req;
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_serve_v2_decode_infer (&s_iface, (uint8_t *) body, len, len, &req,
                                                  &err), -KILN_ELIMIT);
    ck_assert_msg (strstr (err.msg, "more than the model's inputs take"), "%s", err.msg);
    kiln_serve_v2_request_release (&req);
    free (body);
}
END_TEST

START_TEST (test_serve_v2_binary_tensors_go_both_ways)
{
    const char *header = "{\"inputs\":[{\"name\":\"x\",\"shape\":[1,4],\"datatype\":\"FP32\","
                         "\"parameters\":{\"binary_data_size\":16}}],"
                         "\"outputs\":[{\"name\":\"y\",\"parameters\":{\"binary_data\":true}}]}";
    float x[4] = { -1, 2, -3, 4 };
    size_t hlen = strlen (header);
    uint8_t *body = malloc (hlen + sizeof x);
    memcpy (body, header, hlen);
    memcpy (body + hlen, x, sizeof x);
    kiln_serve_v2_request_t req;
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_serve_v2_decode_infer (&s_iface, body, hlen + sizeof x, hlen, &req,
                                               &err) == 0, "%s", err.msg);
    ck_assert (memcmp (req.job->inputs[0], x, sizeof x) == 0);
    ck_assert (req.binary[0]);
    /* Stand in for a run: the output is the input. */
    memcpy (req.job->outputs[0], x, sizeof x);
    uint8_t *out;
    size_t len, json_len;
    ck_assert_int_eq (kiln_serve_v2_encode_infer (&s_iface, &req, "relu", 3, &out, &len,
                                                  &json_len, &err), 0);
    ck_assert_uint_eq (len, json_len + sizeof x);
    ck_assert (memcmp (out + json_len, x, sizeof x) == 0);
    ck_assert_msg (strstr ((char *) out, "\"shape\":[1,4],\"parameters\":{\"binary_data_size\":16}"),
                   "%.*s", (int) json_len, out);
    ck_assert (strstr ((char *) out, "\"model_version\":\"3\""));
    free (out);
    kiln_serve_v2_request_release (&req);
    /* A size that is not the shape's, and bytes nobody claims. */
    ck_assert_int_eq (kiln_serve_v2_decode_infer (&s_iface, body, hlen + sizeof x - 4, hlen,
                                                  &req, &err), -KILN_EFORMAT);
    kiln_serve_v2_request_release (&req);
    free (body);
}
END_TEST

/* A job of `rows` rows whose input k-th value is base + k. */
static kiln_serve_job_t *
s_job (int64_t rows, float base)
{
    kiln_err_t err = { 0 };
    kiln_serve_job_t *job = kiln_serve_job_new (&s_iface, rows, &err);
    ck_assert_msg (job, "%s", err.msg);
    float *x = (float *) job->inputs[0];
    for (int64_t k = 0; k < rows * 4; k++)
        x[k] = base + (float) k * ((k % 2) ? 1.0f : -1.0f);
    return job;
}

START_TEST (test_serve_batch_gathers_jobs_and_splits_the_rows_back)
{
    kiln_err_t err = { 0 };
    kiln_serve_metrics_t *metrics = kiln_serve_metrics_new (NULL, 0, 1, NULL, &err);
    kiln_serve_model_metrics_t *mm = kiln_serve_metrics_model (metrics, "relu");
    kiln_serve_batch_config_t cfg = { .delay_us = 200000, .max_queue = 16, .model = "relu",
                                      .metrics = metrics, .model_metrics = mm };
    kiln_serve_batch_t *batch = kiln_serve_batch_new (s_models, 2, &s_iface, &cfg, &err);
    ck_assert_msg (batch, "%s", err.msg);
    /* 1 + 3 + 2 + 2 rows: the first eight rows fill one batch. */
    int64_t rows[] = { 1, 3, 2, 2, 1 };
    kiln_serve_job_t *jobs[5];
    for (int j = 0; j < 5; j++) {
        jobs[j] = s_job (rows[j], (float) (10 * j));
        ck_assert_int_eq (kiln_serve_batch_submit (batch, jobs[j], &err), 0);
    }
    for (int j = 0; j < 5; j++) {
        kiln_serve_batch_wait (jobs[j]);
        ck_assert_msg (jobs[j]->rc == 0, "%s", jobs[j]->err.msg);
        const float *x = (const float *) jobs[j]->inputs[0];
        const float *y = (const float *) jobs[j]->outputs[0];
        for (int64_t k = 0; k < rows[j] * 4; k++)
            ck_assert_float_eq (y[k], x[k] > 0 ? x[k] : 0);
        kiln_serve_job_destroy (&jobs[j]);
    }
    kiln_serve_batch_destroy (&batch);
    char *page;
    size_t len;
    ck_assert_int_eq (kiln_serve_metrics_render (metrics, &page, &len, &err), 0);
    ck_assert_msg (strstr (page, "kiln_serve_batch_requests_sum{model=\"relu\"} 5\n"), "%s", page);
    ck_assert_msg (strstr (page, "kiln_serve_batch_requests_count{model=\"relu\"} 2\n"), "%s", page);
    ck_assert_msg (strstr (page, "kiln_serve_batch_rows_total{model=\"relu\"} 9\n"), "%s", page);
    ck_assert_msg (strstr (page, "kiln_serve_queue_depth{model=\"relu\"} 0\n"), "%s", page);
    free (page);
    kiln_serve_metrics_destroy (&metrics);
}
END_TEST

START_TEST (test_serve_batch_refuses_a_job_past_max_queue)
{
    kiln_err_t err = { 0 };
    /* The worker waits (long) for a batch to fill, so the first job stays
     * queued and the second finds the queue full. */
    kiln_serve_batch_config_t cfg = { .delay_us = 10000000, .max_queue = 1, .model = "relu" };
    kiln_serve_batch_t *batch = kiln_serve_batch_new (s_models, 1, &s_iface, &cfg, &err);
    kiln_serve_job_t *a = s_job (1, 1), *b = s_job (1, 2);
    ck_assert_int_eq (kiln_serve_batch_submit (batch, a, &err), 0);
    ck_assert_int_eq (kiln_serve_batch_submit (batch, b, &err), -KILN_ELIMIT);
    ck_assert_msg (strstr (err.msg, "overloaded"), "%s", err.msg);
    /* Destroying runs what is queued. */
    kiln_serve_batch_destroy (&batch);
    kiln_serve_batch_wait (a);
    ck_assert_int_eq (a->rc, 0);
    ck_assert_float_eq (((float *) a->outputs[0])[0], 1);     /* relu (1) */
    kiln_serve_job_destroy (&a);
    kiln_serve_job_destroy (&b);
}
END_TEST

START_TEST (test_serve_v2_names_every_kiln_dtype_it_carries)
{
    ck_assert_str_eq (kiln_serve_v2_dtype_name (KILN_DT_FLOAT32), "FP32");
    ck_assert_int_eq (kiln_serve_v2_dtype_parse ("INT64"), KILN_DT_INT64);
    ck_assert_int_eq (kiln_serve_v2_dtype_parse ("BF16"), KILN_DT_BFLOAT16);
    ck_assert_str_eq (kiln_serve_v2_dtype_name (KILN_DT_FLOAT16), "FP16");
    ck_assert_int_eq (kiln_serve_v2_dtype_parse ("fp32"), KILN_DT_UNDEFINED);
    ck_assert_int_eq (kiln_serve_v2_dtype_parse ("BYTES"), KILN_DT_UNDEFINED);
    ck_assert_str_eq (kiln_serve_refusal_label (KILN_SERVE_REFUSED_ROLLBACK), "rollback");
    ck_assert_int_eq (kiln_serve_failure_status (KILN_SERVE_FAILED_OVERLOADED), 503);
}
END_TEST

int
main (void)
{
    Suite *s = suite_create ("serve");
    TCase *tc = tcase_create ("serve");
    tcase_add_checked_fixture (tc, setup, teardown);
    tcase_set_timeout (tc, 60);
    tcase_add_test (tc, test_serve_iface_reads_the_compiled_batch_and_rows);
    tcase_add_test (tc, test_serve_v2_decodes_flat_and_nested_data_into_a_job);
    tcase_add_test (tc, test_serve_v2_refuses_bad_requests_naming_what_is_wrong);
    tcase_add_test (tc, test_serve_v2_bounds_the_json_values_before_parsing);
    tcase_add_test (tc, test_serve_v2_binary_tensors_go_both_ways);
    tcase_add_test (tc, test_serve_batch_gathers_jobs_and_splits_the_rows_back);
    tcase_add_test (tc, test_serve_batch_refuses_a_job_past_max_queue);
    tcase_add_test (tc, test_serve_v2_names_every_kiln_dtype_it_carries);
    suite_add_tcase (s, tc);
    return testlib_run (s);
}
