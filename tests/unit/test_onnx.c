/*
 * Unit tests for graph/kiln_onnx: importing ONNX models.
 *
 * Realistic models come from tests/data/onnx/, written by
 * tests/data/make_onnx_fixtures.py with torch.onnx.export and onnx.helper;
 * weights.txt there holds the SHA-256 of every weight's bytes as numpy
 * saw them.  Malformed and edge-case models are built here in C with the
 * protobuf-c structs, so that each test changes one thing.
 *
 * Fixtures are found under $KILN_SRC (set by `make unit-test`), else the
 * current directory.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/kiln_fs.h"
#include "common/kiln_hash.h"
#include "graph/kiln_graph.h"
#include "graph/kiln_onnx.h"
#include "onnx.pb-c.h"
#include "tests/unit/testlib.h"

/* --- helpers ---------------------------------------------------------- */

static const char *
s_fixture (const char *name, char *buf, size_t size)
{
    const char *src = getenv ("KILN_SRC");
    snprintf (buf, size, "%s/tests/data/onnx/%s", src && *src ? src : ".", name);
    return buf;
}

/* Import a fixture, failing the test with kiln's message if it does not. */
static kiln_graph_t *
s_import_ok (const char *name)
{
    char path[4096];
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_onnx_import (s_fixture (name, path, sizeof path), &err);
    ck_assert_msg (g != NULL, "%s: %s: %s", name, kiln_errname (err.code), err.msg);
    return g;
}

/* Import a fixture that must fail; returns the error. */
static kiln_err_t
s_import_fails (const char *name)
{
    char path[4096];
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_onnx_import (s_fixture (name, path, sizeof path), &err);
    ck_assert_msg (g == NULL, "%s imported but should not have", name);
    ck_assert_int_ne (err.code, 0);
    return err;
}

static void
s_assert_shape (const kiln_tensor_t *t, int rank, const int64_t *dims)
{
    char have[128];
    kiln_shape_str (&t->shape, have, sizeof have);
    ck_assert_msg (t->shape.rank == rank, "tensor '%s' has shape %s, expected rank %d",
                   t->name, have, rank);
    for (int i = 0; i < rank; i++)
        ck_assert_msg (t->shape.dims[i] == dims[i], "tensor '%s' has shape %s, dim %d should be %lld",
                       t->name, have, i, (long long) dims[i]);
}

static const kiln_tensor_t *
s_tensor (const kiln_graph_t *g, const char *name)
{
    int t = kiln_graph_find_tensor (g, name);
    ck_assert_msg (t >= 0, "no tensor named '%s'", name);
    return &g->tensors[t];
}

static const kiln_weight_t *
s_weight (const kiln_graph_t *g, const char *name)
{
    const kiln_tensor_t *t = s_tensor (g, name);
    ck_assert_msg (t->weight >= 0 && t->weight < g->n_weights, "tensor '%s' is not a weight", name);
    const kiln_weight_t *w = &g->weights[t->weight];
    ck_assert_ptr_nonnull (w->data);
    return w;
}

static int
s_count_op (const kiln_graph_t *g, const char *op)
{
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++)
        n += strcmp (g->nodes[i].op, op) == 0;
    return n;
}

/* The ops of the graph's nodes in order, space-separated. */
static const char *
s_ops (const kiln_graph_t *g, char *buf, size_t size)
{
    buf[0] = '\0';
    for (int i = 0; i < g->n_nodes; i++) {
        size_t len = strlen (buf);
        snprintf (buf + len, size - len, "%s%s", i ? " " : "", g->nodes[i].op);
    }
    return buf;
}

#define S_FLOAT32_OUT(g, i, rank, ...) do {                                  \
        const int64_t dims_[] = { __VA_ARGS__ };                             \
        const kiln_tensor_t *t_ = &(g)->tensors[(g)->outputs[i]];            \
        ck_assert_int_eq (t_->dtype, KILN_DT_FLOAT32);                       \
        s_assert_shape (t_, (rank), dims_);                                  \
    } while (0)


/* --- models traced by torch -------------------------------------------- */

START_TEST (test_onnx_imports_traced_add_mul_with_two_inputs_and_one_output)
{
    kiln_graph_t *g = s_import_ok ("add_mul.onnx");
    const int64_t dims[] = { 2, 3 };
    ck_assert_int_eq (g->opset, 13);
    ck_assert_int_eq (g->n_inputs, 2);
    ck_assert_str_eq (g->tensors[g->inputs[0]].name, "x");
    ck_assert_str_eq (g->tensors[g->inputs[1]].name, "y");
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq (g->tensors[g->inputs[i]].dtype, KILN_DT_FLOAT32);
        s_assert_shape (&g->tensors[g->inputs[i]], 2, dims);
    }
    ck_assert_int_eq (g->n_outputs, 1);
    ck_assert_str_eq (g->tensors[g->outputs[0]].name, "z");
    S_FLOAT32_OUT (g, 0, 2, 2, 3);
    /* torch writes the 2 as a Constant node: it must be a weight, not a node */
    char ops[256];
    ck_assert_str_eq (s_ops (g, ops, sizeof ops), "Mul Add");
    ck_assert_int_eq (g->n_weights, 1);
    /* found through Mul's input, not by name: torch picks the name */
    float two;
    const kiln_tensor_t *c = &g->tensors[g->nodes[0].inputs[1]];
    ck_assert_int_ge (c->weight, 0);
    const kiln_weight_t *w = &g->weights[c->weight];
    ck_assert_uint_eq (w->size, sizeof two);
    memcpy (&two, w->data, sizeof two);
    ck_assert_float_eq (two, 2.0f);
    kiln_graph_destroy (&g);
    ck_assert_ptr_null (g);
}
END_TEST

START_TEST (test_onnx_conv_module_imports_weight_and_bias_values)
{
    kiln_graph_t *g = s_import_ok ("conv.onnx");
    ck_assert_int_eq (g->n_nodes, 1);
    const kiln_node_t *conv = &g->nodes[0];
    ck_assert_str_eq (conv->op, "Conv");
    ck_assert_int_eq (conv->n_inputs, 3);
    const kiln_attr_t *ks = kiln_node_attr (conv, "kernel_shape");
    ck_assert_ptr_nonnull (ks);
    ck_assert_int_eq (ks->kind, KILN_ATTR_INTS);
    ck_assert_uint_eq (ks->n, 2);
    ck_assert_int_eq (ks->ints[0], 3);
    ck_assert_int_eq (kiln_node_attr_int (conv, "group", 0), 1);

    /* Conv weight and bias are constants, not graph inputs */
    ck_assert_int_eq (g->n_inputs, 1);
    ck_assert_int_eq (g->n_weights, 2);
    ck_assert_int_eq (conv->inputs[1], kiln_graph_find_tensor (g, "conv.weight"));
    ck_assert_int_eq (conv->inputs[2], kiln_graph_find_tensor (g, "conv.bias"));
    const int64_t wdims[] = { 1, 1, 3, 3 };
    s_assert_shape (s_tensor (g, "conv.weight"), 4, wdims);
    const kiln_weight_t *w = s_weight (g, "conv.weight");
    ck_assert_uint_eq (w->size, 9 * sizeof (float));
    for (int k = 0; k < 9; k++) {
        float v;
        memcpy (&v, w->data + 4 * k, sizeof v);
        ck_assert_float_eq (v, k / 8.0f);
    }
    float bias;
    const kiln_weight_t *b = s_weight (g, "conv.bias");
    ck_assert_uint_eq (b->size, sizeof bias);
    memcpy (&bias, b->data, sizeof bias);
    ck_assert_float_eq (bias, 0.5f);
    S_FLOAT32_OUT (g, 0, 4, 1, 1, 3, 3);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_onnx_mlp_imports_gemm_and_relu)
{
    kiln_graph_t *g = s_import_ok ("mlp.onnx");
    char ops[256];
    ck_assert_str_eq (s_ops (g, ops, sizeof ops), "Gemm Relu Gemm");
    ck_assert_int_eq (kiln_node_attr_int (&g->nodes[0], "transB", 0), 1);
    ck_assert_int_eq (g->n_inputs, 1);
    ck_assert_int_eq (g->n_weights, 4);
    S_FLOAT32_OUT (g, 0, 2, 3, 2);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_onnx_cnn_imports_conv_pool_flatten_gemm)
{
    kiln_graph_t *g = s_import_ok ("cnn.onnx");
    char ops[256];
    ck_assert_str_eq (s_ops (g, ops, sizeof ops),
                      "Conv Relu MaxPool GlobalAveragePool Flatten Gemm");
    const kiln_node_t *pool = &g->nodes[2];
    const kiln_attr_t *ks = kiln_node_attr (pool, "kernel_shape");
    ck_assert_ptr_nonnull (ks);
    ck_assert_uint_eq (ks->n, 2);
    ck_assert_int_eq (ks->ints[1], 2);
    ck_assert_int_eq (kiln_node_attr_int (&g->nodes[4], "axis", -1), 1);
    S_FLOAT32_OUT (g, 0, 2, 1, 3);
    /* every intermediate got its shape from inference */
    const int64_t pooled[] = { 1, 4, 4, 4 };
    s_assert_shape (&g->tensors[pool->outputs[0]], 4, pooled);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_onnx_initializers_listed_as_inputs_are_constants)
{
    kiln_graph_t *g = s_import_ok ("mlp_init_inputs.onnx");
    ck_assert_int_eq (g->n_inputs, 1);
    ck_assert_str_eq (g->tensors[g->inputs[0]].name, "x");
    ck_assert_int_eq (g->n_weights, 4);
    ck_assert_int_ge (s_tensor (g, "fc1.weight")->weight, 0);
    S_FLOAT32_OUT (g, 0, 2, 3, 2);
    kiln_graph_destroy (&g);
}
END_TEST


/* --- weights ------------------------------------------------------------ */

/* Every weight listed in weights.txt (by the generator, from numpy) is in
 * the imported graph with the same dtype, shape and bytes.  This covers
 * raw_data, every typed field, and Constant nodes in each form. */
START_TEST (test_onnx_weights_match_the_generator_bytes)
{
    char path[4096];
    uint8_t *text;
    size_t len;
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_read_file (s_fixture ("weights.txt", path, sizeof path), 1 << 20,
                                   &text, &len, &err) == 0, "%s", err.msg);
    char model[256] = "", name[256], dtype[32], dims[128], hex[KILN_HEX_LEN];
    kiln_graph_t *g = NULL;
    int checked = 0;
    char *save = NULL;
    for (char *line = strtok_r ((char *) text, "\n", &save); line;
         line = strtok_r (NULL, "\n", &save)) {
        if (line[0] == '#')
            continue;
        char file[256];
        ck_assert_int_eq (sscanf (line, "%255s %255s %31s %127s %64s", file, name, dtype,
                                  dims, hex), 5);
        if (strcmp (file, model) != 0) {
            kiln_graph_destroy (&g);
            g = s_import_ok (file);
            snprintf (model, sizeof model, "%s", file);
        }
        const kiln_tensor_t *t = s_tensor (g, name);
        ck_assert_msg (strcmp (kiln_dtype_name (t->dtype), dtype) == 0,
                       "%s %s: dtype %s, expected %s", file, name,
                       kiln_dtype_name (t->dtype), dtype);
        char have_dims[128] = "";
        if (t->shape.rank == 0)
            snprintf (have_dims, sizeof have_dims, "scalar");
        for (int i = 0; i < t->shape.rank; i++) {
            size_t n = strlen (have_dims);
            snprintf (have_dims + n, sizeof have_dims - n, "%s%lld", i ? "," : "",
                      (long long) t->shape.dims[i]);
        }
        ck_assert_msg (strcmp (have_dims, dims) == 0, "%s %s: dims %s, expected %s",
                       file, name, have_dims, dims);
        const kiln_weight_t *w = s_weight (g, name);
        uint8_t digest[KILN_DIGEST_LEN];
        char have_hex[KILN_HEX_LEN];
        kiln_sha256 (w->data, (size_t) w->size, digest);
        kiln_hex (digest, sizeof digest, have_hex);
        ck_assert_msg (strcmp (have_hex, hex) == 0, "%s %s: weight bytes differ from numpy's",
                       file, name);
        checked++;
    }
    kiln_graph_destroy (&g);
    free (text);
    /* the generator wrote 34 weights; fewer means the file was cut short */
    ck_assert_int_ge (checked, 34);
}
END_TEST

START_TEST (test_onnx_typed_fields_and_raw_data_give_identical_weights)
{
    kiln_graph_t *raw = s_import_ok ("typed_raw.onnx");
    kiln_graph_t *typed = s_import_ok ("typed_fields.onnx");
    ck_assert_int_eq (raw->n_weights, 8);
    ck_assert_int_eq (typed->n_weights, 8);
    const char *names[] = { "w_f32", "w_f64", "w_i64", "w_i32", "w_u8", "w_i8", "w_bool", "w_scalar" };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const kiln_weight_t *a = s_weight (raw, names[i]), *b = s_weight (typed, names[i]);
        ck_assert_uint_eq (a->size, b->size);
        ck_assert_msg (memcmp (a->data, b->data, (size_t) a->size) == 0, "%s differs", names[i]);
    }
    /* spot values that a width or sign mistake would change */
    int64_t i64;
    memcpy (&i64, s_weight (typed, "w_i64")->data + 8, sizeof i64);
    ck_assert_int_eq (i64, 1LL << 40);
    ck_assert_int_eq ((int8_t) s_weight (typed, "w_i8")->data[0], -128);
    ck_assert_uint_eq (s_weight (typed, "w_u8")->data[1], 200);
    ck_assert_int_eq (s_tensor (typed, "w_scalar")->shape.rank, 0);
    kiln_graph_destroy (&raw);
    kiln_graph_destroy (&typed);
}
END_TEST

START_TEST (test_onnx_constant_nodes_become_weights_not_nodes)
{
    kiln_graph_t *g = s_import_ok ("constants.onnx");
    char ops[256];
    ck_assert_str_eq (s_ops (g, ops, sizeof ops), "Reshape Mul Add Mul");
    ck_assert_int_eq (s_count_op (g, "Constant"), 0);
    ck_assert_int_eq (g->n_weights, 4);
    const int64_t one[] = { 2 };
    s_assert_shape (s_tensor (g, "shape"), 1, one);
    ck_assert_int_eq (s_tensor (g, "shape")->dtype, KILN_DT_INT64);
    ck_assert_int_eq (s_tensor (g, "two")->shape.rank, 0);
    S_FLOAT32_OUT (g, 0, 2, 3, 2);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_onnx_dropout_becomes_identity_with_one_input)
{
    kiln_graph_t *g = s_import_ok ("dropout.onnx");
    char ops[256];
    ck_assert_str_eq (s_ops (g, ops, sizeof ops), "Identity Relu");
    ck_assert_int_eq (g->nodes[0].n_inputs, 1);
    ck_assert_int_eq (g->nodes[0].n_outputs, 1);
    ck_assert_int_eq (g->nodes[0].n_attrs, 0);
    S_FLOAT32_OUT (g, 0, 2, 2, 3);
    kiln_graph_destroy (&g);
}
END_TEST


/* --- refusals from fixtures ------------------------------------------------ */

START_TEST (test_onnx_unsupported_ops_are_listed_in_one_error_with_counts)
{
    kiln_err_t err = s_import_fails ("unsupported_ops.onnx");
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    const char *nz = strstr (err.msg, "NonZero (2)");
    const char *un = strstr (err.msg, "Unique (1)");
    ck_assert_msg (nz && un, "message: %s", err.msg);
    ck_assert_msg (nz < un, "most used op should come first: %s", err.msg);
    ck_assert_msg (strstr (err.msg, "unsupported ops: ") != NULL, "message: %s", err.msg);
    ck_assert_msg (strstr (err.msg, "Relu") == NULL, "Relu is supported: %s", err.msg);
    /* the file variant names the file */
    ck_assert_msg (strstr (err.msg, "unsupported_ops.onnx") != NULL, "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_op_from_another_domain_is_unsupported_and_named_with_it)
{
    kiln_err_t err = s_import_fails ("custom_domain.onnx");
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "com.microsoft.FusedMatMul (1)") != NULL, "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_symbolic_input_dimension_is_refused_naming_input)
{
    kiln_err_t err = s_import_fails ("symbolic_batch.onnx");
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "input 'x'") && strstr (err.msg, "dimension 0")
                   && strstr (err.msg, "'batch'"), "message: %s", err.msg);
}
END_TEST

/* External data is read (tests/unit/test_onnx_external.c); this fixture,
 * written by onnx itself, names a file that is not there. */
START_TEST (test_onnx_external_data_in_a_missing_file_is_refused_naming_the_weight)
{
    kiln_err_t err = s_import_fails ("external_data.onnx");
    ck_assert_int_eq (err.code, KILN_ENOTFOUND);
    ck_assert_msg (strstr (err.msg, "weight 'big_weight'")
                   && strstr (err.msg, "'big_weight.bin' not found"), "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_opset_outside_range_is_refused)
{
    kiln_err_t err = s_import_fails ("opset6.onnx");
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "opset 6") != NULL && strstr (err.msg, "'Add'") != NULL,
                   "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_missing_file_is_not_found_naming_path)
{
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_onnx_import ("/nonexistent/kiln/model.onnx", &err);
    ck_assert_ptr_null (g);
    ck_assert_int_eq (err.code, KILN_ENOTFOUND);
    ck_assert_msg (strstr (err.msg, "/nonexistent/kiln/model.onnx") != NULL, "message: %s", err.msg);
}
END_TEST


/* --- malformed bytes -------------------------------------------------------- */

static uint8_t *
s_read_fixture (const char *name, size_t *len)
{
    char path[4096];
    uint8_t *data;
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_read_file (s_fixture (name, path, sizeof path), 1 << 20, &data, len,
                                   &err) == 0, "%s", err.msg);
    return data;
}

/* Every strict prefix of a valid model is refused: a cut inside a message
 * breaks the protobuf, and a cut between fields loses the graph or the
 * opset.  Under valgrind this also shows no prefix leaks or reads past
 * the end. */
START_TEST (test_onnx_every_truncation_of_a_model_is_refused)
{
    size_t len;
    uint8_t *data = s_read_fixture ("cnn.onnx", &len);
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_onnx_import_mem (data, len, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    kiln_graph_destroy (&g);
    for (size_t cut = 0; cut < len; cut++) {
        /* a copy of exactly `cut` bytes, so that valgrind sees any overread */
        uint8_t *part = malloc (cut ? cut : 1);
        memcpy (part, data, cut);
        kiln_err_clear (&err);
        g = kiln_onnx_import_mem (part, cut, &err);
        ck_assert_msg (g == NULL, "a %zu-byte prefix of %zu imported", cut, len);
        ck_assert_int_ne (err.code, 0);
        ck_assert_msg (err.msg[0] != '\0', "no message for a %zu-byte prefix", cut);
        free (part);
    }
    free (data);
}
END_TEST

START_TEST (test_onnx_truncated_file_is_a_format_error_naming_the_file)
{
    size_t len;
    uint8_t *data = s_read_fixture ("conv.onnx", &len);
    kiln_err_t err = { 0 };
    char *dir = kiln_mkdtemp ("kiln-test-onnx-", &err);
    ck_assert_msg (dir != NULL, "%s", err.msg);
    char path[4096];
    snprintf (path, sizeof path, "%s/half.onnx", dir);
    ck_assert_int_eq (kiln_write_file_atomic (path, data, len / 2, 0644, &err), 0);
    kiln_graph_t *g = kiln_onnx_import (path, &err);
    ck_assert_ptr_null (g);
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, path) && strstr (err.msg, "not a valid ONNX model"),
                   "message: %s", err.msg);
    kiln_rm_rf (dir);
    free (dir);
    free (data);
}
END_TEST

START_TEST (test_onnx_garbage_bytes_are_refused)
{
    kiln_err_t err = { 0 };
    const char *text = "this is not a protobuf, it is a sentence\n";
    ck_assert_ptr_null (kiln_onnx_import_mem ((const uint8_t *) text, strlen (text), &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);

    uint8_t zeros[64] = { 0 };
    kiln_err_clear (&err);
    ck_assert_ptr_null (kiln_onnx_import_mem (zeros, sizeof zeros, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);

    kiln_err_clear (&err);
    ck_assert_ptr_null (kiln_onnx_import_mem (zeros, 0, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);

    /* Random bytes, and a real model with random bytes flipped: some
     * decode as protobuf with unknown fields, but none may import or
     * crash.  A fixed seed keeps failures reproducible. */
    size_t len;
    uint8_t *model = s_read_fixture ("cnn.onnx", &len);
    uint8_t *buf = malloc (len);
    uint32_t seed = 12345;
    for (int round = 0; round < 400; round++) {
        for (size_t i = 0; i < len; i++) {
            seed = seed * 1103515245u + 12345u;
            uint8_t r = (uint8_t) (seed >> 16);
            if (round < 200)
                buf[i] = r;
            else
                buf[i] = (r % 64 == 0) ? (uint8_t) (model[i] ^ (seed >> 8)) : model[i];
        }
        kiln_err_clear (&err);
        kiln_graph_t *g = kiln_onnx_import_mem (buf, len, &err);
        if (round < 200) {
            ck_assert_msg (g == NULL, "random bytes imported (round %d)", round);
            ck_assert_int_ne (err.code, 0);
        }
        /* a flipped byte inside a weight still gives a valid model */
        ck_assert_msg (g != NULL || err.code != 0, "no error for round %d", round);
        kiln_graph_destroy (&g);
    }
    free (buf);
    free (model);
}
END_TEST

/* Prepend a length-delimited field (field number, wire type 2). */
static size_t
s_wrap (uint8_t *buf, size_t at, size_t len, unsigned field)
{
    uint8_t head[16];
    size_t h = 0;
    head[h++] = (uint8_t) (field << 3 | 2);
    for (size_t v = len; ; v >>= 7) {
        head[h++] = (uint8_t) ((v & 0x7f) | (v >= 0x80 ? 0x80 : 0));
        if (v < 0x80)
            break;
    }
    ck_assert_uint_ge (at, h);
    memcpy (buf + at - h, head, h);
    return at - h;
}

/* protobuf-c recurses once per nested message; a crafted file nesting
 * graph -> node -> attribute -> graph ... a hundred thousand deep would
 * overflow the stack if the importer did not refuse it first. */
START_TEST (test_onnx_deeply_nested_messages_are_refused_not_a_crash)
{
    size_t cap = 1 << 20;
    uint8_t *buf = malloc (cap);
    size_t at = cap, levels = 0;
    /* innermost first: AttributeProto.g (6) in NodeProto.attribute (5) in
     * GraphProto.node (1), repeated; ModelProto.graph (7) outermost */
    while (levels < 100000 && at > 64) {
        at = s_wrap (buf, at, cap - at, 6);
        at = s_wrap (buf, at, cap - at, 5);
        at = s_wrap (buf, at, cap - at, 1);
        levels++;
    }
    at = s_wrap (buf, at, cap - at, 7);
    ck_assert_uint_gt (levels, 1000);
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_onnx_import_mem (buf + at, cap - at, &err);
    ck_assert_ptr_null (g);
    ck_assert_int_eq (err.code, KILN_ELIMIT);
    ck_assert_msg (strstr (err.msg, "nested") != NULL, "message: %s", err.msg);
    free (buf);
}
END_TEST


/* --- models built in C ----------------------------------------------------- */

/* A one-node model: input x float [2, 3], node `op` (x [, w]) -> y, with
 * room for one initializer and one attribute.  Tests change one part and
 * import it with s_mini_import. */
typedef struct {
    Onnx__ModelProto model;
    Onnx__OperatorSetIdProto opset;
    Onnx__OperatorSetIdProto *opsets[1];
    Onnx__GraphProto graph;
    Onnx__ValueInfoProto in, out;
    Onnx__ValueInfoProto *ins[1], *outs[1];
    Onnx__TypeProto type;
    Onnx__TypeProto__Tensor tensor_type;
    Onnx__TensorShapeProto shape;
    Onnx__TensorShapeProto__Dimension dims[2];
    Onnx__TensorShapeProto__Dimension *dimp[2];
    Onnx__NodeProto node, node2;
    Onnx__NodeProto *nodes[2];
    char *node_in[3], *node_out[2], *node2_in[1], *node2_out[1];
    Onnx__TensorProto init;
    Onnx__TensorProto *inits[1];
    Onnx__AttributeProto attr;
    Onnx__AttributeProto *attrs[1];
} mini_t;

static void
s_mini_init (mini_t *m, const char *op)
{
    memset (m, 0, sizeof *m);
    m->model = (Onnx__ModelProto) ONNX__MODEL_PROTO__INIT;
    m->model.has_ir_version = 1;
    m->model.ir_version = 7;
    m->opset = (Onnx__OperatorSetIdProto) ONNX__OPERATOR_SET_ID_PROTO__INIT;
    m->opset.domain = "";
    m->opset.has_version = 1;
    m->opset.version = 13;
    m->opsets[0] = &m->opset;
    m->model.n_opset_import = 1;
    m->model.opset_import = m->opsets;

    m->dimp[0] = &m->dims[0];
    m->dimp[1] = &m->dims[1];
    for (int i = 0; i < 2; i++) {
        m->dims[i] = (Onnx__TensorShapeProto__Dimension) ONNX__TENSOR_SHAPE_PROTO__DIMENSION__INIT;
        m->dims[i].value_case = ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_VALUE;
        m->dims[i].dim_value = 2 + i;
    }
    m->shape = (Onnx__TensorShapeProto) ONNX__TENSOR_SHAPE_PROTO__INIT;
    m->shape.n_dim = 2;
    m->shape.dim = m->dimp;
    m->tensor_type = (Onnx__TypeProto__Tensor) ONNX__TYPE_PROTO__TENSOR__INIT;
    m->tensor_type.has_elem_type = 1;
    m->tensor_type.elem_type = ONNX__TENSOR_PROTO__DATA_TYPE__FLOAT;
    m->tensor_type.shape = &m->shape;
    m->type = (Onnx__TypeProto) ONNX__TYPE_PROTO__INIT;
    m->type.value_case = ONNX__TYPE_PROTO__VALUE_TENSOR_TYPE;
    m->type.tensor_type = &m->tensor_type;
    m->in = (Onnx__ValueInfoProto) ONNX__VALUE_INFO_PROTO__INIT;
    m->in.name = "x";
    m->in.type = &m->type;
    m->out = (Onnx__ValueInfoProto) ONNX__VALUE_INFO_PROTO__INIT;
    m->out.name = "y";
    m->ins[0] = &m->in;
    m->outs[0] = &m->out;

    m->node = (Onnx__NodeProto) ONNX__NODE_PROTO__INIT;
    m->node.op_type = (char *) op;
    m->node.name = "n";
    m->node_in[0] = "x";
    m->node.n_input = 1;
    m->node.input = m->node_in;
    m->node_out[0] = "y";
    m->node.n_output = 1;
    m->node.output = m->node_out;
    m->nodes[0] = &m->node;
    m->node2 = (Onnx__NodeProto) ONNX__NODE_PROTO__INIT;
    m->nodes[1] = &m->node2;
    m->init = (Onnx__TensorProto) ONNX__TENSOR_PROTO__INIT;
    m->inits[0] = &m->init;
    m->attr = (Onnx__AttributeProto) ONNX__ATTRIBUTE_PROTO__INIT;
    m->attrs[0] = &m->attr;

    m->graph = (Onnx__GraphProto) ONNX__GRAPH_PROTO__INIT;
    m->graph.name = "mini";
    m->graph.n_node = 1;
    m->graph.node = m->nodes;
    m->graph.n_input = 1;
    m->graph.input = m->ins;
    m->graph.n_output = 1;
    m->graph.output = m->outs;
    m->model.graph = &m->graph;
}

/* Use the initializer: a float tensor `name` of `dims`, fed to the node as
 * its second input. */
static void
s_mini_weight (mini_t *m, const char *name, const int64_t *dims, size_t n_dims)
{
    m->init.name = (char *) name;
    m->init.has_data_type = 1;
    m->init.data_type = ONNX__TENSOR_PROTO__DATA_TYPE__FLOAT;
    m->init.n_dims = n_dims;
    m->init.dims = (int64_t *) dims;
    m->graph.n_initializer = 1;
    m->graph.initializer = m->inits;
    m->node_in[1] = (char *) name;
    m->node.n_input = 2;
}

static kiln_graph_t *
s_mini_import (mini_t *m, kiln_err_t *err)
{
    size_t len = onnx__model_proto__get_packed_size (&m->model);
    uint8_t *buf = malloc (len ? len : 1);
    ck_assert_uint_eq (onnx__model_proto__pack (&m->model, buf), len);
    kiln_err_clear (err);
    kiln_graph_t *g = kiln_onnx_import_mem (buf, len, err);
    free (buf);
    return g;
}

START_TEST (test_onnx_mini_model_imports)
{
    mini_t m;
    s_mini_init (&m, "Relu");
    kiln_err_t err;
    kiln_graph_t *g = s_mini_import (&m, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    ck_assert_int_eq (g->n_nodes, 1);
    S_FLOAT32_OUT (g, 0, 2, 2, 3);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_onnx_raw_data_of_the_wrong_size_is_a_format_error)
{
    mini_t m;
    s_mini_init (&m, "Add");
    const int64_t dims[] = { 3 };
    s_mini_weight (&m, "w", dims, 1);
    uint8_t bytes[7] = { 0 };
    m.init.has_raw_data = 1;
    m.init.raw_data.len = sizeof bytes;
    m.init.raw_data.data = bytes;
    kiln_err_t err;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "'w'") && strstr (err.msg, "7 bytes"), "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_typed_values_that_do_not_fit_the_dtype_are_refused)
{
    mini_t m;
    s_mini_init (&m, "Add");
    const int64_t dims[] = { 2 };
    s_mini_weight (&m, "w8", dims, 1);
    m.init.data_type = ONNX__TENSOR_PROTO__DATA_TYPE__INT8;
    int32_t values[] = { 5, 300 };
    m.init.n_int32_data = 2;
    m.init.int32_data = values;
    kiln_err_t err;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "'w8'") && strstr (err.msg, "300"), "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_half_weights_and_io_import_as_two_byte_values)
{
    /* A bfloat16 Add: input, output and weight keep their type, and the
     * weight its 2-byte bits, from raw_data or widened in int32_data (as
     * the ONNX spec stores float16 and bfloat16 there). */
    const uint16_t bits[3] = { 0x3f80, 0xc049, 0x7f80 };   /* 1, -3.140625, inf */
    const int64_t dims[] = { 3 };
    for (int form = 0; form < 2; form++) {
        mini_t m;
        s_mini_init (&m, "Add");
        m.tensor_type.elem_type = ONNX__TENSOR_PROTO__DATA_TYPE__BFLOAT16;
        s_mini_weight (&m, "w", dims, 1);
        m.init.data_type = ONNX__TENSOR_PROTO__DATA_TYPE__BFLOAT16;
        int32_t wide[3] = { bits[0], bits[1], bits[2] };
        if (form == 0) {
            m.init.has_raw_data = 1;
            m.init.raw_data.len = sizeof bits;
            m.init.raw_data.data = (uint8_t *) bits;
        } else {
            m.init.n_int32_data = 3;
            m.init.int32_data = wide;
        }
        kiln_err_t err;
        kiln_graph_t *g = s_mini_import (&m, &err);
        ck_assert_msg (g != NULL, "%s", err.msg);
        ck_assert_int_eq (g->tensors[g->inputs[0]].dtype, KILN_DT_BFLOAT16);
        ck_assert_int_eq (g->tensors[g->outputs[0]].dtype, KILN_DT_BFLOAT16);
        int w = kiln_graph_find_tensor (g, "w");
        ck_assert_int_ge (w, 0);
        const kiln_weight_t *wt = &g->weights[g->tensors[w].weight];
        ck_assert_uint_eq (wt->size, 6);
        ck_assert_int_eq (memcmp (wt->data, bits, 6), 0);
        kiln_graph_destroy (&g);
    }
    /* a value that does not fit 16 bits is refused, naming the weight */
    mini_t m;
    s_mini_init (&m, "Add");
    m.tensor_type.elem_type = ONNX__TENSOR_PROTO__DATA_TYPE__BFLOAT16;
    s_mini_weight (&m, "w", dims, 1);
    m.init.data_type = ONNX__TENSOR_PROTO__DATA_TYPE__BFLOAT16;
    int32_t wide[3] = { 0x3f80, 70000, 0 };
    m.init.n_int32_data = 3;
    m.init.int32_data = wide;
    kiln_err_t err;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "'w'") && strstr (err.msg, "70000")
                   && strstr (err.msg, "bfloat16"), "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_typed_value_count_must_match_the_shape)
{
    mini_t m;
    s_mini_init (&m, "Add");
    const int64_t dims[] = { 3 };
    s_mini_weight (&m, "w", dims, 1);
    float values[] = { 1, 2 };
    m.init.n_float_data = 2;
    m.init.float_data = values;
    kiln_err_t err;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "float_data holds 2 values"), "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_string_weights_are_unsupported)
{
    mini_t m;
    s_mini_init (&m, "Add");
    const int64_t dims[] = { 1 };
    s_mini_weight (&m, "words", dims, 1);
    m.init.data_type = ONNX__TENSOR_PROTO__DATA_TYPE__STRING;
    kiln_err_t err;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "'words'") && strstr (err.msg, "STRING"), "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_unknown_node_input_is_named)
{
    mini_t m;
    s_mini_init (&m, "Relu");
    m.node_in[0] = "nope";
    kiln_err_t err;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "node 'n' (Relu)") && strstr (err.msg, "'nope'"),
                   "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_value_defined_twice_is_refused)
{
    mini_t m;
    s_mini_init (&m, "Relu");
    m.node_out[0] = "x";                          /* shadows the graph input */
    kiln_err_t err;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "'x'") && strstr (err.msg, "already defined"),
                   "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_unknown_graph_output_is_named)
{
    mini_t m;
    s_mini_init (&m, "Relu");
    m.out.name = "elsewhere";
    kiln_err_t err;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "graph output 'elsewhere'"), "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_unknown_input_dimension_is_refused)
{
    mini_t m;
    s_mini_init (&m, "Relu");
    m.dims[1].value_case = ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE__NOT_SET;
    kiln_err_t err;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "input 'x'") && strstr (err.msg, "dimension 1 is unknown"),
                   "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_input_without_shape_is_refused)
{
    mini_t m;
    s_mini_init (&m, "Relu");
    m.tensor_type.shape = NULL;
    kiln_err_t err;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "input 'x' has no shape"), "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_opsets_7_to_18_are_accepted_and_others_refused)
{
    /* Relu is the same from opset 1 to 7: opsets 1..6 import as 7 (an op
     * that changed by 7 is refused: test_onnx_opset_outside_range_is_refused) */
    const struct { int64_t version; int code; } cases[] = {
        { 0, KILN_EUNSUPPORTED }, { 1, 0 }, { 6, 0 }, { 7, 0 }, { 13, 0 }, { 17, 0 },
        { 18, 0 }, { 19, KILN_EUNSUPPORTED },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        mini_t m;
        s_mini_init (&m, "Relu");
        m.opset.version = cases[i].version;
        kiln_err_t err;
        kiln_graph_t *g = s_mini_import (&m, &err);
        ck_assert_msg (err.code == cases[i].code, "opset %lld: %s",
                       (long long) cases[i].version, err.msg);
        if (g)
            ck_assert_int_eq (g->opset, cases[i].version < 7 ? 7 : (int) cases[i].version);
        kiln_graph_destroy (&g);
    }
    /* the "ai.onnx" spelling of the default domain counts too; no default
     * domain at all is malformed */
    mini_t m;
    s_mini_init (&m, "Relu");
    m.opset.domain = "ai.onnx";
    kiln_err_t err;
    kiln_graph_t *g = s_mini_import (&m, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    kiln_graph_destroy (&g);
    m.opset.domain = "ai.onnx.ml";
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
}
END_TEST

START_TEST (test_onnx_graph_attribute_is_unsupported_naming_node)
{
    mini_t m;
    s_mini_init (&m, "Relu");
    Onnx__GraphProto body = ONNX__GRAPH_PROTO__INIT;
    m.attr.name = "body";
    m.attr.has_type = 1;
    m.attr.type = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__GRAPH;
    m.attr.g = &body;
    m.node.n_attribute = 1;
    m.node.attribute = m.attrs;
    kiln_err_t err;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "node 'n' (Relu)") && strstr (err.msg, "'body'")
                   && strstr (err.msg, "GRAPH"), "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_attributes_of_each_kind_are_copied)
{
    /* Relu ignores attributes, so the import shows what was copied */
    const struct { Onnx__AttributeProto__AttributeType type; kiln_attr_kind_t kind; } cases[] = {
        { ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INT, KILN_ATTR_INT },
        { ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOAT, KILN_ATTR_FLOAT },
        { ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__STRING, KILN_ATTR_STRING },
        { ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INTS, KILN_ATTR_INTS },
        { ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOATS, KILN_ATTR_FLOATS },
    };
    int64_t ints[] = { -1, 1LL << 40 };
    float floats[] = { 0.5f, -2.0f, 3.25f };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        mini_t m;
        s_mini_init (&m, "Relu");
        m.attr.name = "a";
        m.attr.has_type = 1;
        m.attr.type = cases[i].type;
        m.attr.has_i = 1;
        m.attr.i = -7;
        m.attr.has_f = 1;
        m.attr.f = 1.5f;
        m.attr.has_s = 1;
        m.attr.s.data = (uint8_t *) "SAME_UPPER";
        m.attr.s.len = 10;
        m.attr.n_ints = 2;
        m.attr.ints = ints;
        m.attr.n_floats = 3;
        m.attr.floats = floats;
        m.node.n_attribute = 1;
        m.node.attribute = m.attrs;
        kiln_err_t err;
        kiln_graph_t *g = s_mini_import (&m, &err);
        ck_assert_msg (g != NULL, "%s", err.msg);
        const kiln_attr_t *a = kiln_node_attr (&g->nodes[0], "a");
        ck_assert_ptr_nonnull (a);
        ck_assert_int_eq (a->kind, cases[i].kind);
        switch (a->kind) {
        case KILN_ATTR_INT: ck_assert_int_eq (a->i, -7); break;
        case KILN_ATTR_FLOAT: ck_assert_double_eq (a->f, 1.5); break;
        case KILN_ATTR_STRING: ck_assert_str_eq (a->s, "SAME_UPPER"); break;
        case KILN_ATTR_INTS:
            ck_assert_uint_eq (a->n, 2);
            ck_assert_int_eq (a->ints[1], 1LL << 40);
            break;
        case KILN_ATTR_FLOATS:
            ck_assert_uint_eq (a->n, 3);
            ck_assert_double_eq (a->floats[2], 3.25);
            break;
        }
        kiln_graph_destroy (&g);
    }
}
END_TEST

START_TEST (test_onnx_empty_optional_input_becomes_minus_one)
{
    /* Conv without bias, written as an empty third input */
    mini_t m;
    s_mini_init (&m, "Conv");
    static int64_t xdims[] = { 1, 1, 4, 4 };
    Onnx__TensorShapeProto__Dimension d[4];
    Onnx__TensorShapeProto__Dimension *dp[4];
    for (int i = 0; i < 4; i++) {
        d[i] = (Onnx__TensorShapeProto__Dimension) ONNX__TENSOR_SHAPE_PROTO__DIMENSION__INIT;
        d[i].value_case = ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_VALUE;
        d[i].dim_value = xdims[i];
        dp[i] = &d[i];
    }
    m.shape.n_dim = 4;
    m.shape.dim = dp;
    const int64_t wdims[] = { 1, 1, 3, 3 };
    s_mini_weight (&m, "w", wdims, 4);
    float w[9] = { 1, 0, 0, 0, 1, 0, 0, 0, 1 };
    m.init.n_float_data = 9;
    m.init.float_data = w;
    m.node_in[2] = "";
    m.node.n_input = 3;
    kiln_err_t err;
    kiln_graph_t *g = s_mini_import (&m, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    ck_assert_int_eq (g->nodes[0].n_inputs, 3);
    ck_assert_int_eq (g->nodes[0].inputs[2], -1);
    S_FLOAT32_OUT (g, 0, 4, 1, 1, 2, 2);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_onnx_nodes_out_of_order_are_sorted)
{
    /* y = Relu (h), h = Relu (x), listed consumer first */
    mini_t m;
    s_mini_init (&m, "Relu");
    m.node_in[0] = "h";
    m.node2.op_type = "Relu";
    m.node2.name = "first";
    m.node2_in[0] = "x";
    m.node2_out[0] = "h";
    m.node2.n_input = 1;
    m.node2.input = m.node2_in;
    m.node2.n_output = 1;
    m.node2.output = m.node2_out;
    m.graph.n_node = 2;
    kiln_err_t err;
    kiln_graph_t *g = s_mini_import (&m, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    ck_assert_str_eq (g->nodes[0].name, "first");
    S_FLOAT32_OUT (g, 0, 2, 2, 3);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_onnx_dropout_mask_output_is_unsupported)
{
    /* A mask nothing reads is left out... */
    mini_t m;
    s_mini_init (&m, "Dropout");
    m.node_out[1] = "mask";
    m.node.n_output = 2;
    kiln_err_t err;
    kiln_graph_t *g = s_mini_import (&m, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    ck_assert_int_eq (g->n_nodes, 1);
    ck_assert_int_eq (g->nodes[0].n_outputs, 1);
    ck_assert_int_lt (kiln_graph_find_tensor (g, "mask"), 0);
    kiln_graph_destroy (&g);
    /* ... a mask the graph reads (here: as its output) is refused. */
    s_mini_init (&m, "Dropout");
    m.node_out[0] = "y_unused";
    m.node_out[1] = m.out.name;
    m.node.n_output = 2;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "dropout mask") && strstr (err.msg, "read by the graph"),
                   "message: %s", err.msg);
}
END_TEST

START_TEST (test_onnx_long_names_are_refused)
{
    char name[KILN_MAX_NAME + 2];
    memset (name, 'a', sizeof name - 1);
    name[sizeof name - 1] = '\0';
    mini_t m;
    s_mini_init (&m, "Relu");
    m.node_out[0] = name;
    m.out.name = name;
    kiln_err_t err;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_ELIMIT);

    /* exactly KILN_MAX_NAME bytes is fine */
    name[KILN_MAX_NAME] = '\0';
    kiln_graph_t *g = s_mini_import (&m, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_onnx_many_unsupported_ops_still_give_a_bounded_message)
{
    enum { N = 300 };
    mini_t m;
    s_mini_init (&m, "Relu");
    Onnx__NodeProto nodes[N];
    Onnx__NodeProto *np[N];
    char ops[N][32];
    for (int i = 0; i < N; i++) {
        nodes[i] = (Onnx__NodeProto) ONNX__NODE_PROTO__INIT;
        snprintf (ops[i], sizeof ops[i], "MadeUpOperator%03d", i);
        nodes[i].op_type = ops[i];
        nodes[i].n_input = 1;
        nodes[i].input = m.node_in;
        np[i] = &nodes[i];
    }
    m.graph.n_node = N;
    m.graph.node = np;
    kiln_err_t err;
    ck_assert_ptr_null (s_mini_import (&m, &err));
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "MadeUpOperator000 (1)"), "message: %s", err.msg);
    ck_assert_msg (strstr (err.msg, " more"), "message: %s", err.msg);
    ck_assert_uint_lt (strlen (err.msg), KILN_ERR_MSG_MAX);
}
END_TEST


/* --- the I/O structure in metadata_props ----------------------------------- */

/* Append a varint to buf[*at]. */
static void
s_put_varint (uint8_t *buf, size_t *at, uint64_t v)
{
    do {
        buf[(*at)++] = (uint8_t) ((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
}

/* Import the mini model with one more metadata_props entry (ModelProto
 * field 14) written by hand after the rest, so that its value can hold
 * what protobuf-c would not pack: a NUL byte, invalid UTF-8. */
static kiln_graph_t *
s_mini_import_meta (mini_t *m, const char *key, const char *value, size_t value_len,
                    kiln_err_t *err)
{
    size_t key_len = strlen (key), at = 0;
    uint8_t *entry = malloc (key_len + value_len + 32);
    entry[at++] = (1 << 3) | 2;                 /* key */
    s_put_varint (entry, &at, key_len);
    memcpy (entry + at, key, key_len);
    at += key_len;
    entry[at++] = (2 << 3) | 2;                 /* value */
    s_put_varint (entry, &at, value_len);
    memcpy (entry + at, value, value_len);
    at += value_len;
    size_t len = onnx__model_proto__get_packed_size (&m->model);
    uint8_t *buf = malloc (len + at + 16);
    ck_assert_uint_eq (onnx__model_proto__pack (&m->model, buf), len);
    buf[len++] = (14 << 3) | 2;                 /* metadata_props */
    s_put_varint (buf, &len, at);
    memcpy (buf + len, entry, at);
    len += at;
    kiln_err_clear (err);
    kiln_graph_t *g = kiln_onnx_import_mem (buf, len, err);
    free (entry);
    free (buf);
    return g;
}

START_TEST (test_onnx_io_structure_metadata_is_kept_and_other_keys_ignored)
{
    const char *text = "{\"kind\":\"tuple\",\"items\":[{\"tensor\":0},{\"tensor\":1}]}";
    mini_t m;
    s_mini_init (&m, "Relu");
    Onnx__StringStringEntryProto e[2] = { ONNX__STRING_STRING_ENTRY_PROTO__INIT,
                                          ONNX__STRING_STRING_ENTRY_PROTO__INIT };
    Onnx__StringStringEntryProto *ep[2] = { &e[0], &e[1] };
    e[0].key = "producer.note";
    e[0].value = "\xff not even UTF-8";
    e[1].key = "kiln.io_structure";
    e[1].value = (char *) text;
    m.model.n_metadata_props = 2;
    m.model.metadata_props = ep;
    kiln_err_t err;
    kiln_graph_t *g = s_mini_import (&m, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    ck_assert_ptr_nonnull (g->io_structure);
    ck_assert_str_eq (g->io_structure, text);
    kiln_graph_destroy (&g);

    /* Only other keys, or none: no I/O structure. */
    m.model.n_metadata_props = 1;
    g = s_mini_import (&m, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    ck_assert_ptr_null (g->io_structure);
    kiln_graph_destroy (&g);
    m.model.n_metadata_props = 0;
    g = s_mini_import (&m, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    ck_assert_ptr_null (g->io_structure);
    kiln_graph_destroy (&g);

    /* Written by hand, at exactly the bound. */
    size_t max = KILN_MAX_IO_STRUCTURE_BYTES;
    char *big = malloc (max);
    memset (big, '7', max);
    g = s_mini_import_meta (&m, "kiln.io_structure", big, max, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    ck_assert_uint_eq (strlen (g->io_structure), max);
    kiln_graph_destroy (&g);
    free (big);
}
END_TEST

START_TEST (test_onnx_bad_io_structure_is_refused_naming_the_key)
{
    size_t max = KILN_MAX_IO_STRUCTURE_BYTES;
    char *big = malloc (max + 1);
    memset (big, '7', max + 1);
    struct { const char *value; size_t len; int code; const char *frag; } cases[] = {
        { big, max + 1, KILN_ELIMIT,
          "model metadata 'kiln.io_structure' is 65537 bytes, more than the limit of 65536" },
        { "[0,\0 1]", 7, KILN_EFORMAT, "model metadata 'kiln.io_structure' holds a NUL byte" },
        { "[\"\xc3\x28\"]", 6, KILN_EFORMAT,
          "model metadata 'kiln.io_structure': I/O structure is not valid UTF-8" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        mini_t m;
        s_mini_init (&m, "Relu");
        kiln_err_t err;
        kiln_graph_t *g = s_mini_import_meta (&m, "kiln.io_structure", cases[i].value,
                                              cases[i].len, &err);
        ck_assert_msg (g == NULL, "case %zu imported", i);
        ck_assert_msg (err.code == cases[i].code, "case %zu: %s: %s", i,
                       kiln_errname (err.code), err.msg);
        ck_assert_msg (strstr (err.msg, cases[i].frag), "case %zu: %s", i, err.msg);
    }
    /* The same oversized value under another key is none of kiln's business. */
    mini_t m;
    s_mini_init (&m, "Relu");
    kiln_err_t err;
    kiln_graph_t *g = s_mini_import_meta (&m, "other.key", big, max + 1, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    ck_assert_ptr_null (g->io_structure);
    kiln_graph_destroy (&g);

    /* The key twice is ambiguous. */
    Onnx__StringStringEntryProto e = ONNX__STRING_STRING_ENTRY_PROTO__INIT;
    Onnx__StringStringEntryProto *ep[1] = { &e };
    e.key = "kiln.io_structure";
    e.value = "[0]";
    m.model.n_metadata_props = 1;
    m.model.metadata_props = ep;
    g = s_mini_import_meta (&m, "kiln.io_structure", "[1]", 3, &err);
    ck_assert_ptr_null (g);
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "the key 'kiln.io_structure' twice"), "%s", err.msg);
    free (big);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("onnx");
    TCase *tc = tcase_create ("import");
    tcase_set_timeout (tc, 120);
    tcase_add_test (tc, test_onnx_imports_traced_add_mul_with_two_inputs_and_one_output);
    tcase_add_test (tc, test_onnx_conv_module_imports_weight_and_bias_values);
    tcase_add_test (tc, test_onnx_mlp_imports_gemm_and_relu);
    tcase_add_test (tc, test_onnx_cnn_imports_conv_pool_flatten_gemm);
    tcase_add_test (tc, test_onnx_initializers_listed_as_inputs_are_constants);
    tcase_add_test (tc, test_onnx_weights_match_the_generator_bytes);
    tcase_add_test (tc, test_onnx_typed_fields_and_raw_data_give_identical_weights);
    tcase_add_test (tc, test_onnx_constant_nodes_become_weights_not_nodes);
    tcase_add_test (tc, test_onnx_dropout_becomes_identity_with_one_input);
    tcase_add_test (tc, test_onnx_unsupported_ops_are_listed_in_one_error_with_counts);
    tcase_add_test (tc, test_onnx_op_from_another_domain_is_unsupported_and_named_with_it);
    tcase_add_test (tc, test_onnx_symbolic_input_dimension_is_refused_naming_input);
    tcase_add_test (tc, test_onnx_external_data_in_a_missing_file_is_refused_naming_the_weight);
    tcase_add_test (tc, test_onnx_opset_outside_range_is_refused);
    tcase_add_test (tc, test_onnx_missing_file_is_not_found_naming_path);
    suite_add_tcase (s, tc);

    tc = tcase_create ("malformed");
    tcase_set_timeout (tc, 300);
    tcase_add_test (tc, test_onnx_every_truncation_of_a_model_is_refused);
    tcase_add_test (tc, test_onnx_truncated_file_is_a_format_error_naming_the_file);
    tcase_add_test (tc, test_onnx_garbage_bytes_are_refused);
    tcase_add_test (tc, test_onnx_deeply_nested_messages_are_refused_not_a_crash);
    suite_add_tcase (s, tc);

    tc = tcase_create ("built");
    tcase_set_timeout (tc, 120);
    tcase_add_test (tc, test_onnx_mini_model_imports);
    tcase_add_test (tc, test_onnx_raw_data_of_the_wrong_size_is_a_format_error);
    tcase_add_test (tc, test_onnx_typed_values_that_do_not_fit_the_dtype_are_refused);
    tcase_add_test (tc, test_onnx_typed_value_count_must_match_the_shape);
    tcase_add_test (tc, test_onnx_string_weights_are_unsupported);
    tcase_add_test (tc, test_onnx_unknown_node_input_is_named);
    tcase_add_test (tc, test_onnx_value_defined_twice_is_refused);
    tcase_add_test (tc, test_onnx_unknown_graph_output_is_named);
    tcase_add_test (tc, test_onnx_unknown_input_dimension_is_refused);
    tcase_add_test (tc, test_onnx_input_without_shape_is_refused);
    tcase_add_test (tc, test_onnx_opsets_7_to_18_are_accepted_and_others_refused);
    tcase_add_test (tc, test_onnx_graph_attribute_is_unsupported_naming_node);
    tcase_add_test (tc, test_onnx_attributes_of_each_kind_are_copied);
    tcase_add_test (tc, test_onnx_empty_optional_input_becomes_minus_one);
    tcase_add_test (tc, test_onnx_nodes_out_of_order_are_sorted);
    tcase_add_test (tc, test_onnx_dropout_mask_output_is_unsupported);
    tcase_add_test (tc, test_onnx_long_names_are_refused);
    tcase_add_test (tc, test_onnx_many_unsupported_ops_still_give_a_bounded_message);
    tcase_add_test (tc, test_onnx_io_structure_metadata_is_kept_and_other_keys_ignored);
    tcase_add_test (tc, test_onnx_half_weights_and_io_import_as_two_byte_values);
    tcase_add_test (tc, test_onnx_bad_io_structure_is_refused_naming_the_key);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run (s_suite ());
}
