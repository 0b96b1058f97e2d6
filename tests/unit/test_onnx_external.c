/*
 * Unit tests for graph/kiln_onnx_external: ONNX tensors whose bytes live
 * in external files, read through kiln_onnx_import and its in-memory
 * variants.
 *
 * Each test writes a small model, y = (x + a) * b, into a fresh temporary
 * directory: the .onnx file built here with the protobuf-c structs (so
 * that each test changes one external_data entry), and the weight file
 * beside it.  The refusals are one table, as curl writes its test cases:
 * the entries, what the directory holds, and the code and message
 * fragments that must come back.
 */
#include <check.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client/kiln_capi.h"
#include "common/kiln_fs.h"
#include "graph/kiln_graph.h"
#include "graph/kiln_onnx.h"
#include "onnx.pb-c.h"
#include "tests/unit/testlib.h"

/* --- the model ---------------------------------------------------------- */

/* The weight file's layout: a header kiln must skip, `a` (float [2, 3]),
 * a gap, then `b` (float [3]) to the end of the file. */
#define S_A_OFFSET 8
#define S_A_BYTES  24
#define S_B_OFFSET 40
#define S_B_BYTES  12
#define S_FILE_BYTES (S_B_OFFSET + S_B_BYTES)

static const float s_a[6] = { 1.5f, -2.0f, 3.25f, 0.5f, 8.0f, -0.125f };
static const float s_b[3] = { 2.0f, -1.0f, 0.25f };

/* y = (x + a) * b, x float [2, 3] an input, a and b initializers (or b
 * the output of a Constant node) with external data. */
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
    Onnx__NodeProto add, mul, constant;
    Onnx__NodeProto *nodes[3];
    char *add_in[2], *add_out[1], *mul_in[2], *mul_out[1], *const_out[1];
    Onnx__AttributeProto value;
    Onnx__AttributeProto *values[1];
    Onnx__TensorProto a, b;
    Onnx__TensorProto *inits[2];
    int64_t a_dims[2], b_dims[1];
    Onnx__StringStringEntryProto a_ext[4], b_ext[4];
    Onnx__StringStringEntryProto *a_extp[4], *b_extp[4];
} model_t;

/* Make `t` a float tensor `name` of `dims` whose bytes are external, with
 * the entries location, offset and length (NULL: absent). */
static void
s_external (Onnx__TensorProto *t, Onnx__StringStringEntryProto *e,
            Onnx__StringStringEntryProto **ep, const char *name, int64_t *dims,
            size_t n_dims, const char *location, const char *offset, const char *length)
{
    *t = (Onnx__TensorProto) ONNX__TENSOR_PROTO__INIT;
    t->name = (char *) name;
    t->has_data_type = 1;
    t->data_type = ONNX__TENSOR_PROTO__DATA_TYPE__FLOAT;
    t->n_dims = n_dims;
    t->dims = dims;
    t->has_data_location = 1;
    t->data_location = ONNX__TENSOR_PROTO__DATA_LOCATION__EXTERNAL;
    const char *keys[3] = { "location", "offset", "length" };
    const char *vals[3] = { location, offset, length };
    size_t n = 0;
    for (int i = 0; i < 3; i++) {
        if (!vals[i])
            continue;
        e[n] = (Onnx__StringStringEntryProto) ONNX__STRING_STRING_ENTRY_PROTO__INIT;
        e[n].key = (char *) keys[i];
        e[n].value = (char *) vals[i];
        ep[n] = &e[n];
        n++;
    }
    t->n_external_data = n;
    t->external_data = ep;
}

/* The model with `a` at `a_location`/`a_offset`/`a_length` and `b` in
 * "weights.bin" at S_B_OFFSET, to the end of the file. */
static void
s_model_init (model_t *m, const char *a_location, const char *a_offset,
              const char *a_length)
{
    memset (m, 0, sizeof *m);
    m->model = (Onnx__ModelProto) ONNX__MODEL_PROTO__INIT;
    m->model.has_ir_version = 1;
    m->model.ir_version = 8;
    m->opset = (Onnx__OperatorSetIdProto) ONNX__OPERATOR_SET_ID_PROTO__INIT;
    m->opset.domain = "";
    m->opset.has_version = 1;
    m->opset.version = 13;
    m->opsets[0] = &m->opset;
    m->model.n_opset_import = 1;
    m->model.opset_import = m->opsets;

    for (int i = 0; i < 2; i++) {
        m->dims[i] = (Onnx__TensorShapeProto__Dimension) ONNX__TENSOR_SHAPE_PROTO__DIMENSION__INIT;
        m->dims[i].value_case = ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_VALUE;
        m->dims[i].dim_value = 2 + i;
        m->dimp[i] = &m->dims[i];
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

    m->add = (Onnx__NodeProto) ONNX__NODE_PROTO__INIT;
    m->add.op_type = "Add";
    m->add.name = "add";
    m->add_in[0] = "x";
    m->add_in[1] = "a";
    m->add_out[0] = "t";
    m->add.n_input = 2;
    m->add.input = m->add_in;
    m->add.n_output = 1;
    m->add.output = m->add_out;
    m->mul = (Onnx__NodeProto) ONNX__NODE_PROTO__INIT;
    m->mul.op_type = "Mul";
    m->mul.name = "mul";
    m->mul_in[0] = "t";
    m->mul_in[1] = "b";
    m->mul_out[0] = "y";
    m->mul.n_input = 2;
    m->mul.input = m->mul_in;
    m->mul.n_output = 1;
    m->mul.output = m->mul_out;
    m->nodes[0] = &m->add;
    m->nodes[1] = &m->mul;

    m->a_dims[0] = 2;
    m->a_dims[1] = 3;
    m->b_dims[0] = 3;
    s_external (&m->a, m->a_ext, m->a_extp, "a", m->a_dims, 2, a_location, a_offset,
                a_length);
    static char b_offset[16];
    snprintf (b_offset, sizeof b_offset, "%d", S_B_OFFSET);
    s_external (&m->b, m->b_ext, m->b_extp, "b", m->b_dims, 1, "weights.bin", b_offset,
                NULL);
    m->inits[0] = &m->a;
    m->inits[1] = &m->b;

    m->graph = (Onnx__GraphProto) ONNX__GRAPH_PROTO__INIT;
    m->graph.name = "external";
    m->graph.n_node = 2;
    m->graph.node = m->nodes;
    m->graph.n_initializer = 2;
    m->graph.initializer = m->inits;
    m->graph.n_input = 1;
    m->graph.input = m->ins;
    m->graph.n_output = 1;
    m->graph.output = m->outs;
    m->model.graph = &m->graph;
}

/* Make `b` the output of a Constant node whose `value` tensor is the
 * external one, instead of an initializer. */
static void
s_model_b_constant (model_t *m)
{
    m->constant = (Onnx__NodeProto) ONNX__NODE_PROTO__INIT;
    m->constant.op_type = "Constant";
    m->constant.name = "b_const";
    m->const_out[0] = "b";
    m->constant.n_output = 1;
    m->constant.output = m->const_out;
    m->value = (Onnx__AttributeProto) ONNX__ATTRIBUTE_PROTO__INIT;
    m->value.name = "value";
    m->value.has_type = 1;
    m->value.type = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__TENSOR;
    m->value.t = &m->b;
    m->values[0] = &m->value;
    m->constant.n_attribute = 1;
    m->constant.attribute = m->values;
    m->nodes[2] = &m->constant;
    m->graph.n_node = 3;
    m->graph.n_initializer = 1;
}

/* The model's protobuf bytes; caller frees them. */
static uint8_t *
s_pack (const model_t *m, size_t *len)
{
    *len = onnx__model_proto__get_packed_size (&m->model);
    uint8_t *buf = malloc (*len);
    ck_assert_ptr_nonnull (buf);
    ck_assert_uint_eq (onnx__model_proto__pack (&m->model, buf), *len);
    return buf;
}

/* Write `len` bytes to dir/name. */
static void
s_write (const char *dir, const char *name, const void *data, size_t len)
{
    char path[PATH_MAX];
    snprintf (path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen (path, "wb");
    ck_assert_msg (f != NULL, "could not write %s", path);
    ck_assert_uint_eq (fwrite (data, 1, len, f), len);
    ck_assert_int_eq (fclose (f), 0);
}

/* The weight file's bytes: filler around a and b, so that reading the
 * wrong offset gives the wrong values. */
static void
s_weight_bytes (uint8_t *buf)
{
    for (int i = 0; i < S_FILE_BYTES; i++)
        buf[i] = (uint8_t) (0xA0 + i);
    memcpy (buf + S_A_OFFSET, s_a, S_A_BYTES);
    memcpy (buf + S_B_OFFSET, s_b, S_B_BYTES);
}

/* Write the model as dir/model.onnx and the weights as dir/weights.bin;
 * the model's path goes into path[PATH_MAX]. */
static const char *
s_write_model (const model_t *m, const char *dir, char *path)
{
    size_t len;
    uint8_t *bytes = s_pack (m, &len);
    s_write (dir, "model.onnx", bytes, len);
    free (bytes);
    uint8_t weights[S_FILE_BYTES];
    s_weight_bytes (weights);
    s_write (dir, "weights.bin", weights, sizeof weights);
    snprintf (path, PATH_MAX, "%s/model.onnx", dir);
    return path;
}

static const kiln_weight_t *
s_weight (const kiln_graph_t *g, const char *name)
{
    int t = kiln_graph_find_tensor (g, name);
    ck_assert_msg (t >= 0, "no tensor named '%s'", name);
    ck_assert_msg (g->tensors[t].weight >= 0, "tensor '%s' is not a weight", name);
    return &g->weights[g->tensors[t].weight];
}

/* Both weights hold exactly the bytes written for them. */
static void
s_assert_weights (const kiln_graph_t *g)
{
    const kiln_weight_t *a = s_weight (g, "a"), *b = s_weight (g, "b");
    ck_assert_uint_eq (a->size, S_A_BYTES);
    ck_assert_uint_eq (b->size, S_B_BYTES);
    ck_assert_msg (memcmp (a->data, s_a, S_A_BYTES) == 0, "a's bytes differ");
    ck_assert_msg (memcmp (b->data, s_b, S_B_BYTES) == 0, "b's bytes differ");
}

static char *s_dir;             /* this test's directory */

static void
s_setup (void)
{
    s_dir = testlib_keydir ("kiln-onnx-ext-", NULL, NULL);
}

static void
s_teardown (void)
{
    testlib_rmdir (&s_dir);
}


/* --- what is read ---------------------------------------------------------- */

START_TEST (test_onnx_external_two_initializers_in_one_file_import_with_their_bytes)
{
    model_t m;
    s_model_init (&m, "weights.bin", "8", "24");
    char path[PATH_MAX];
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_onnx_import (s_write_model (&m, s_dir, path), &err);
    ck_assert_msg (g != NULL, "%s: %s", kiln_errname (err.code), err.msg);
    s_assert_weights (g);
    ck_assert_int_eq (g->n_nodes, 2);
    ck_assert_int_eq (g->n_inputs, 1);

    /* The digest does not depend on where the bytes were kept: the same
     * model with raw_data has the same one. */
    char ext_digest[KILN_HEX_LEN], raw_digest[KILN_HEX_LEN];
    ck_assert_int_eq (kiln_graph_digest (g, ext_digest, &err), 0);
    kiln_graph_destroy (&g);
    m.a = (Onnx__TensorProto) ONNX__TENSOR_PROTO__INIT;
    m.a.name = "a";
    m.a.has_data_type = 1;
    m.a.data_type = ONNX__TENSOR_PROTO__DATA_TYPE__FLOAT;
    m.a.n_dims = 2;
    m.a.dims = m.a_dims;
    m.a.has_raw_data = 1;
    m.a.raw_data.len = S_A_BYTES;
    m.a.raw_data.data = (uint8_t *) s_a;
    m.b.has_data_location = 0;
    m.b.n_external_data = 0;
    m.b.has_raw_data = 1;
    m.b.raw_data.len = S_B_BYTES;
    m.b.raw_data.data = (uint8_t *) s_b;
    size_t len;
    uint8_t *bytes = s_pack (&m, &len);
    g = kiln_onnx_import_mem (bytes, len, &err);
    free (bytes);
    ck_assert_msg (g != NULL, "%s", err.msg);
    ck_assert_int_eq (kiln_graph_digest (g, raw_digest, &err), 0);
    ck_assert_str_eq (ext_digest, raw_digest);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_onnx_external_file_in_a_subdirectory_or_through_a_symlink_inside_is_read)
{
    model_t m;
    s_model_init (&m, "data/./weights.bin", "8", NULL);
    char path[PATH_MAX + 64], sub[PATH_MAX], target[PATH_MAX + 64];
    s_write_model (&m, s_dir, path);
    /* data/ is a symlink to real/, and data/weights.bin a copy holding a
     * only (so the default length, to the end, is a's size). */
    snprintf (sub, sizeof sub, "%s/real", s_dir);
    ck_assert_int_eq (mkdir (sub, 0700), 0);
    s_write (sub, "weights.bin", (uint8_t[8]) { 0 }, 8);
    snprintf (target, sizeof target, "%s/weights.bin", sub);
    FILE *f = fopen (target, "ab");
    ck_assert_ptr_nonnull (f);
    ck_assert_uint_eq (fwrite (s_a, 1, S_A_BYTES, f), S_A_BYTES);
    fclose (f);
    snprintf (target, sizeof target, "%s/data", s_dir);
    ck_assert_int_eq (symlink ("real", target), 0);

    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_onnx_import (path, &err);
    ck_assert_msg (g != NULL, "%s: %s", kiln_errname (err.code), err.msg);
    s_assert_weights (g);
    kiln_graph_destroy (&g);

    /* A model directory reached through a symlink is the same directory. */
    char link[PATH_MAX];
    snprintf (link, sizeof link, "%.*s-link", PATH_MAX - 64, s_dir);
    ck_assert_int_eq (symlink (s_dir, link), 0);
    snprintf (path, sizeof path, "%s/model.onnx", link);
    g = kiln_onnx_import (path, &err);
    unlink (link);
    ck_assert_msg (g != NULL, "%s: %s", kiln_errname (err.code), err.msg);
    s_assert_weights (g);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_onnx_external_constant_node_value_is_read_from_the_file)
{
    model_t m;
    s_model_init (&m, "weights.bin", "8", "24");
    s_model_b_constant (&m);
    char path[PATH_MAX];
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_onnx_import (s_write_model (&m, s_dir, path), &err);
    ck_assert_msg (g != NULL, "%s: %s", kiln_errname (err.code), err.msg);
    s_assert_weights (g);
    ck_assert_int_eq (g->n_nodes, 2);            /* the Constant is a weight, not a node */
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_onnx_external_data_from_memory_needs_a_directory)
{
    model_t m;
    s_model_init (&m, "weights.bin", "8", "24");
    char path[PATH_MAX];
    s_write_model (&m, s_dir, path);
    size_t len;
    uint8_t *bytes = s_pack (&m, &len);

    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_onnx_import_mem (bytes, len, &err);
    ck_assert_ptr_null (g);
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "weight 'a'") && strstr (err.msg, "'weights.bin'")
                   && strstr (err.msg, "from memory"), "message: %s", err.msg);

    /* The same bytes with their directory import, through the library
     * and through the flat API bindings use. */
    g = kiln_onnx_import_mem_dir (bytes, len, s_dir, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    s_assert_weights (g);
    kiln_graph_destroy (&g);
    g = kiln_capi_import_onnx_dir (bytes, len, s_dir, &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    s_assert_weights (g);
    kiln_capi_graph_free (g);
    g = kiln_capi_import_onnx_dir (bytes, len, "", &err);
    ck_assert_ptr_null (g);
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    free (bytes);
}
END_TEST


/* --- what is refused ------------------------------------------------------- */

/* What a refusal case puts in the directory besides model.onnx and
 * weights.bin. */
typedef enum {
    S_PLAIN,                 /* nothing more */
    S_OUTSIDE_LINK,          /* escape.bin -> ../<dir>-outside/secret.bin */
    S_OUTSIDE_DIR_LINK,      /* elsewhere -> ../<dir>-outside */
    S_SUBDIR,                /* sub/, a directory */
    S_FIFO,                  /* pipe, a FIFO */
    S_LOOP,                  /* loop -> loop */
} extra_t;

typedef struct {
    const char *location, *offset, *length;   /* a's entries; NULL: absent */
    extra_t extra;
    int code;
    const char *frag[3];     /* must all be in the message */
} refusal_t;

static const refusal_t s_refusals[] = {
    { "/etc/passwd", "0", "24", S_PLAIN, KILN_EFORMAT,
      { "'/etc/passwd'", "absolute path" } },
    { "../weights.bin", "8", "24", S_PLAIN, KILN_EFORMAT,
      { "'../weights.bin'", "'..' component" } },
    { "data/../weights.bin", "8", "24", S_PLAIN, KILN_EFORMAT,
      { "'data/../weights.bin'", "'..' component" } },
    { "escape.bin", "8", "24", S_OUTSIDE_LINK, KILN_EFORMAT,
      { "'escape.bin'", "outside the model's directory", "secret.bin" } },
    { "elsewhere/secret.bin", "8", "24", S_OUTSIDE_DIR_LINK, KILN_EFORMAT,
      { "'elsewhere/secret.bin'", "outside the model's directory" } },
    { "sub", "0", "24", S_SUBDIR, KILN_EFORMAT, { "'sub'", "not a regular file" } },
    { ".", "0", "24", S_PLAIN, KILN_EFORMAT, { "'.'", "not a regular file" } },
    { "pipe", "0", "24", S_FIFO, KILN_EFORMAT, { "'pipe'", "not a regular file" } },
    { "loop", "0", "24", S_LOOP, KILN_EIO, { "'loop'" } },
    { "missing.bin", "8", "24", S_PLAIN, KILN_ENOTFOUND,
      { "'missing.bin'", "not found" } },
    { "weights.bin", "40", "24", S_PLAIN, KILN_EFORMAT,
      { "offset 40, length 24", "past the end of 'weights.bin' (52 bytes)" } },
    { "weights.bin", "53", NULL, S_PLAIN, KILN_EFORMAT,
      { "offset 53 is past the end of 'weights.bin' (52 bytes)" } },
    { "weights.bin", "18446744073709551615", "24", S_PLAIN, KILN_EFORMAT,
      { "offset 18446744073709551615, length 24", "past the end" } },
    { "weights.bin", "18446744073709551616", "24", S_PLAIN, KILN_EFORMAT,
      { "offset '18446744073709551616'", "more than 2^64 - 1" } },
    { "weights.bin", "8", "99999999999999999999", S_PLAIN, KILN_EFORMAT,
      { "length '99999999999999999999'", "more than 2^64 - 1" } },
    { "weights.bin", "8", "20", S_PLAIN, KILN_EFORMAT,
      { "float32 [2, 3] (24 bytes)", "external data length is 20" } },
    { "weights.bin", "8", NULL, S_PLAIN, KILN_EFORMAT,
      { "(24 bytes)", "from offset 8 to the end of 'weights.bin', is 44 bytes" } },
    { "weights.bin", "-8", "24", S_PLAIN, KILN_EFORMAT,
      { "offset '-8'", "not a byte count" } },
    { "weights.bin", "8", "+24", S_PLAIN, KILN_EFORMAT,
      { "length '+24'", "not a byte count" } },
    { "weights.bin", "8k", "24", S_PLAIN, KILN_EFORMAT, { "offset '8k'", "not a byte count" } },
    { "weights.bin", "", "24", S_PLAIN, KILN_EFORMAT, { "offset ''", "not a byte count" } },
    { "", "8", "24", S_PLAIN, KILN_EFORMAT, { "location is empty" } },
    { NULL, "8", "24", S_PLAIN, KILN_EFORMAT, { "no 'location' entry" } },
};

/* Put case `c`'s extra files in s_dir; `outside` receives the directory
 * beside it that holds secret.bin (removed by the caller). */
static void
s_make_extra (const refusal_t *c, char *outside)
{
    char p[PATH_MAX];
    snprintf (outside, PATH_MAX, "%s-outside", s_dir);
    switch (c->extra) {
    case S_OUTSIDE_LINK:
    case S_OUTSIDE_DIR_LINK: {
        ck_assert_int_eq (mkdir (outside, 0700), 0);
        uint8_t secret[S_FILE_BYTES];
        s_weight_bytes (secret);                 /* the right size: only the place is wrong */
        s_write (outside, "secret.bin", secret, sizeof secret);
        if (c->extra == S_OUTSIDE_LINK) {
            char target[PATH_MAX + 64];
            snprintf (target, sizeof target, "%s/secret.bin", outside);
            snprintf (p, sizeof p, "%s/escape.bin", s_dir);
            ck_assert_int_eq (symlink (target, p), 0);
        }
        else {
            snprintf (p, sizeof p, "%s/elsewhere", s_dir);
            ck_assert_int_eq (symlink (outside, p), 0);
        }
        break;
    }
    case S_SUBDIR:
        snprintf (p, sizeof p, "%s/sub", s_dir);
        ck_assert_int_eq (mkdir (p, 0700), 0);
        break;
    case S_FIFO:
        snprintf (p, sizeof p, "%s/pipe", s_dir);
        ck_assert_int_eq (mkfifo (p, 0600), 0);
        break;
    case S_LOOP:
        snprintf (p, sizeof p, "%s/loop", s_dir);
        ck_assert_int_eq (symlink ("loop", p), 0);
        break;
    case S_PLAIN:
        break;
    }
}

START_TEST (test_onnx_external_refusals_name_the_tensor_and_the_location)
{
    const refusal_t *c = &s_refusals[_i];
    model_t m;
    s_model_init (&m, c->location, c->offset, c->length);
    char path[PATH_MAX], outside[PATH_MAX];
    s_write_model (&m, s_dir, path);
    s_make_extra (c, outside);

    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_onnx_import (path, &err);
    kiln_rm_rf (outside);
    ck_assert_msg (g == NULL, "case %d (location '%s') imported", _i, c->location);
    ck_assert_msg (err.code == c->code, "case %d: %s: %s", _i, kiln_errname (err.code),
                   err.msg);
    /* Every message says which file and which tensor. */
    ck_assert_msg (strstr (err.msg, path) && strstr (err.msg, "weight 'a'"),
                   "case %d: %s", _i, err.msg);
    for (int k = 0; k < 3 && c->frag[k]; k++)
        ck_assert_msg (strstr (err.msg, c->frag[k]), "case %d: '%s' not in: %s", _i,
                       c->frag[k], err.msg);
}
END_TEST

START_TEST (test_onnx_external_ambiguous_entries_are_refused)
{
    model_t m;
    s_model_init (&m, "weights.bin", "8", "24");
    char path[PATH_MAX];
    kiln_err_t err = { 0 };

    /* raw_data as well as external data: which bytes are meant? */
    m.a.has_raw_data = 1;
    m.a.raw_data.len = S_A_BYTES;
    m.a.raw_data.data = (uint8_t *) s_a;
    ck_assert_ptr_null (kiln_onnx_import (s_write_model (&m, s_dir, path), &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "weight 'a' has both external data and raw_data"),
                   "%s", err.msg);

    /* external_data entries while data_location is DEFAULT. */
    s_model_init (&m, "weights.bin", "8", "24");
    m.a.has_data_location = 0;
    ck_assert_ptr_null (kiln_onnx_import (s_write_model (&m, s_dir, path), &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "weight 'a'") && strstr (err.msg, "not EXTERNAL"),
                   "%s", err.msg);

    /* A key given twice. */
    s_model_init (&m, "weights.bin", "8", "24");
    m.a_ext[3] = m.a_ext[1];
    m.a_ext[3].value = "0";
    m.a_extp[3] = &m.a_ext[3];
    m.a.n_external_data = 4;
    ck_assert_ptr_null (kiln_onnx_import (s_write_model (&m, s_dir, path), &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "weight 'a'") && strstr (err.msg, "'offset' twice"),
                   "%s", err.msg);

    /* checksum and unknown keys are ignored. */
    s_model_init (&m, "weights.bin", "8", "24");
    m.a_ext[3] = (Onnx__StringStringEntryProto) ONNX__STRING_STRING_ENTRY_PROTO__INIT;
    m.a_ext[3].key = "checksum";
    m.a_ext[3].value = "not checked";
    m.a_extp[3] = &m.a_ext[3];
    m.a.n_external_data = 4;
    kiln_graph_t *g = kiln_onnx_import (s_write_model (&m, s_dir, path), &err);
    ck_assert_msg (g != NULL, "%s", err.msg);
    s_assert_weights (g);
    kiln_graph_destroy (&g);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("onnx_external");
    TCase *tc = tcase_create ("read");
    tcase_add_checked_fixture (tc, s_setup, s_teardown);
    tcase_set_timeout (tc, 60);
    tcase_add_test (tc, test_onnx_external_two_initializers_in_one_file_import_with_their_bytes);
    tcase_add_test (tc, test_onnx_external_file_in_a_subdirectory_or_through_a_symlink_inside_is_read);
    tcase_add_test (tc, test_onnx_external_constant_node_value_is_read_from_the_file);
    tcase_add_test (tc, test_onnx_external_data_from_memory_needs_a_directory);
    suite_add_tcase (s, tc);

    tc = tcase_create ("refuse");
    tcase_add_checked_fixture (tc, s_setup, s_teardown);
    tcase_set_timeout (tc, 60);
    tcase_add_loop_test (tc, test_onnx_external_refusals_name_the_tensor_and_the_location, 0,
                         (int) (sizeof s_refusals / sizeof s_refusals[0]));
    tcase_add_test (tc, test_onnx_external_ambiguous_entries_are_refused);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run_in_tmpdir (s_suite (), "onnx_external");
}
