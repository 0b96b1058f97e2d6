/*
 * Unit tests for the graph IR: building, the msgpack codec, .kgraph
 * files, the canonical digest, validation and shape inference.
 *
 * Expected shapes are worked out by hand from the ONNX operator formulas;
 * each test says which formula it exercises.
 */
#include <check.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <msgpack.h>

#include "common/kiln_fs.h"
#include "graph/kiln_graph.h"
#include "tests/unit/testlib.h"

/* --- helpers ------------------------------------------------------- */

static kiln_shape_t
s_mkshape (int rank, const int64_t *dims)
{
    kiln_shape_t s = { .rank = rank };
    for (int i = 0; i < rank; i++)
        s.dims[i] = dims[i];
    return s;
}

#define SHAPE(...)                                                          \
    s_mkshape ((int) (sizeof ((int64_t[]) { __VA_ARGS__ }) / sizeof (int64_t)), \
               (int64_t[]) { __VA_ARGS__ })
#define IDX(...) (int[]) { __VA_ARGS__ }, (int) (sizeof ((int[]) { __VA_ARGS__ }) / sizeof (int))

static kiln_shape_t s_scalar = { .rank = 0 };

/* A float32 graph input. */
static int
s_input (kiln_graph_t *g, const char *name, kiln_shape_t shape)
{
    kiln_err_t err = { 0 };
    int t = kiln_graph_add_tensor (g, name, KILN_DT_FLOAT32, &shape, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    ck_assert_int_eq (kiln_graph_add_input (g, t, &err), 0);
    return t;
}

/* A tensor with unknown dtype and shape, for a node to produce. */
static int
s_value (kiln_graph_t *g, const char *name)
{
    kiln_err_t err = { 0 };
    int t = kiln_graph_add_tensor (g, name, KILN_DT_UNDEFINED, NULL, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    return t;
}

/* A weight of `dt` whose bytes are `seed`, `seed`+1, ... */
static int
s_weight (kiln_graph_t *g, const char *name, kiln_dtype_t dt, kiln_shape_t shape,
          uint8_t seed)
{
    kiln_err_t err = { 0 };
    int t = kiln_graph_add_tensor (g, name, dt, &shape, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    uint64_t bytes;
    ck_assert_int_eq (kiln_shape_bytes (&shape, dt, name, &bytes, &err), 0);
    uint8_t *data = malloc (bytes ? bytes : 1);
    ck_assert_ptr_nonnull (data);
    for (uint64_t i = 0; i < bytes; i++)
        data[i] = (uint8_t) (seed + i);
    ck_assert_msg (kiln_graph_set_weight (g, t, &data, bytes, &err) == 0, "%s", err.msg);
    ck_assert_ptr_null (data);
    return t;
}

/* An int64 weight holding `n` values (Reshape's shape input). */
static int
s_int64s (kiln_graph_t *g, const char *name, const int64_t *v, int n)
{
    kiln_err_t err = { 0 };
    kiln_shape_t shape = { .rank = 1, .dims = { n } };
    int t = kiln_graph_add_tensor (g, name, KILN_DT_INT64, &shape, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    uint8_t *data = malloc (8 * (size_t) n + 1);
    for (int i = 0; i < n; i++)
        for (int b = 0; b < 8; b++)
            data[8 * i + b] = (uint8_t) ((uint64_t) v[i] >> (8 * b));
    ck_assert_msg (kiln_graph_set_weight (g, t, &data, 8 * (uint64_t) n, &err) == 0, "%s",
                   err.msg);
    return t;
}

static int
s_node (kiln_graph_t *g, const char *op, const char *name, const int *in, int n_in,
        const int *out, int n_out)
{
    kiln_err_t err = { 0 };
    int n = kiln_graph_add_node (g, op, name, in, n_in, out, n_out, &err);
    ck_assert_msg (n >= 0, "%s", err.msg);
    return n;
}

static void
s_ints (kiln_graph_t *g, int n, const char *name, int count, ...)
{
    int64_t v[16];
    va_list ap;
    va_start (ap, count);
    for (int i = 0; i < count; i++)
        v[i] = va_arg (ap, int);
    va_end (ap);
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_node_set_ints (g, n, name, v, (size_t) count, &err), 0);
}

static void
s_int (kiln_graph_t *g, int n, const char *name, int64_t v)
{
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_node_set_int (g, n, name, v, &err), 0);
}

static void
s_str (kiln_graph_t *g, int n, const char *name, const char *v)
{
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_node_set_string (g, n, name, v, &err), 0);
}

static void
s_output (kiln_graph_t *g, int t)
{
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_graph_add_output (g, t, &err), 0);
}

static void
s_validate_ok (kiln_graph_t *g)
{
    kiln_err_t err = { 0 };
    int rc = kiln_graph_validate (g, &err);
    ck_assert_msg (rc == 0, "validate failed: %s", err.msg);
}

/* Validate expecting failure with `code` and a message containing each
 * of the NULL-terminated fragments. */
static void
s_validate_fails (kiln_graph_t *g, int code, ...)
{
    kiln_err_t err = { 0 };
    int rc = kiln_graph_validate (g, &err);
    ck_assert_msg (rc == -code, "expected %s, got %d (%s)", kiln_errname (code), rc, err.msg);
    ck_assert_int_eq (err.code, code);
    va_list ap;
    va_start (ap, code);
    for (const char *frag; (frag = va_arg (ap, const char *));)
        ck_assert_msg (strstr (err.msg, frag), "message '%s' lacks '%s'", err.msg, frag);
    va_end (ap);
}

static void
s_assert_shape (const kiln_graph_t *g, int t, kiln_shape_t want)
{
    char a[160], b[160];
    ck_assert_msg (kiln_shape_equal (&g->tensors[t].shape, &want), "tensor '%s' is %s, expected %s",
                   g->tensors[t].name, kiln_shape_str (&g->tensors[t].shape, a, sizeof a),
                   kiln_shape_str (&want, b, sizeof b));
}

/* Names used by s_cnn: the interface names stay fixed, the internal ones
 * come from `tag` so tests can rename them. */
typedef struct {
    const char *tag;            /* prefix of node and internal tensor names */
    uint8_t seed;               /* first byte of the conv weight */
    int64_t pool_stride;        /* MaxPool strides */
    bool reverse_attrs;         /* set Conv's attributes in the other order */
} s_cnn_opts_t;

/* x[1,3,8,8] -> Conv(w[4,3,3,3], b[4], pads 1) -> Relu -> MaxPool(2x2)
 * -> Flatten -> Gemm(fc.w[10,64], fc.b[10], transB) -> y */
static kiln_graph_t *
s_cnn (s_cnn_opts_t o)
{
    char nm[16][64];
    const char *base[] = { "conv.w", "conv.b", "conv.out", "relu.out", "pool.out",
                           "flat.out", "fc.w", "fc.b", "conv", "relu", "pool", "flat", "fc" };
    for (int i = 0; i < 13; i++)
        snprintf (nm[i], sizeof nm[i], "%s%s", o.tag, base[i]);
    kiln_graph_t *g = kiln_graph_new ();
    ck_assert_ptr_nonnull (g);
    g->opset = 13;
    int x = s_input (g, "x", SHAPE (1, 3, 8, 8));
    int w = s_weight (g, nm[0], KILN_DT_FLOAT32, SHAPE (4, 3, 3, 3), o.seed);
    int b = s_weight (g, nm[1], KILN_DT_FLOAT32, SHAPE (4), 7);
    int c = s_value (g, nm[2]);
    int r = s_value (g, nm[3]);
    int p = s_value (g, nm[4]);
    int f = s_value (g, nm[5]);
    int fw = s_weight (g, nm[6], KILN_DT_FLOAT32, SHAPE (10, 64), 9);
    int fb = s_weight (g, nm[7], KILN_DT_FLOAT32, SHAPE (10), 11);
    int y = s_value (g, "y");
    int n = s_node (g, "Conv", nm[8], IDX (x, w, b), IDX (c));
    if (o.reverse_attrs) {
        s_ints (g, n, "pads", 4, 1, 1, 1, 1);
        s_ints (g, n, "kernel_shape", 2, 3, 3);
    }
    else {
        s_ints (g, n, "kernel_shape", 2, 3, 3);
        s_ints (g, n, "pads", 4, 1, 1, 1, 1);
    }
    s_node (g, "Relu", nm[9], IDX (c), IDX (r));
    n = s_node (g, "MaxPool", nm[10], IDX (r), IDX (p));
    s_ints (g, n, "kernel_shape", 2, 2, 2);
    s_ints (g, n, "strides", 2, (int) o.pool_stride, (int) o.pool_stride);
    n = s_node (g, "Flatten", nm[11], IDX (p), IDX (f));
    s_int (g, n, "axis", 1);
    n = s_node (g, "Gemm", nm[12], IDX (f, fw, fb), IDX (y));
    s_int (g, n, "transB", 1);
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_node_set_float (g, n, "alpha", 1.0, &err), 0);
    s_output (g, y);
    return g;
}

static s_cnn_opts_t
s_cnn_default (void)
{
    return (s_cnn_opts_t) { .tag = "", .seed = 1, .pool_stride = 2 };
}

static void
s_digest (const kiln_graph_t *g, char out[KILN_HEX_LEN])
{
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_graph_digest (g, out, &err) == 0, "%s", err.msg);
    ck_assert (kiln_is_digest_hex (out));
}

static void
s_encode (const kiln_graph_t *g, uint8_t **out, size_t *len)
{
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_graph_encode (g, out, len, &err) == 0, "%s", err.msg);
}

/* A fresh temporary directory; the caller removes it with kiln_rm_rf. */
static char *
s_tmpdir (void)
{
    kiln_err_t err = { 0 };
    char *dir = kiln_mkdtemp ("kiln-test-graph-", &err);
    ck_assert_msg (dir != NULL, "%s", err.msg);
    return dir;
}

static void
s_write (const char *path, const uint8_t *data, size_t len)
{
    FILE *f = fopen (path, "wb");
    ck_assert_ptr_nonnull (f);
    ck_assert_uint_eq (fwrite (data, 1, len, f), len);
    ck_assert_int_eq (fclose (f), 0);
}

/* Offset of the first `needle` in data[0..len), or -1. */
static long
s_find_bytes (const uint8_t *data, size_t len, const char *needle)
{
    size_t n = strlen (needle);
    for (size_t i = 0; i + n <= len; i++)
        if (memcmp (data + i, needle, n) == 0)
            return (long) i;
    return -1;
}

/* --- building ------------------------------------------------------ */

START_TEST (test_set_weight_rejects_wrong_byte_count)
{
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err = { 0 };
    kiln_shape_t shape = SHAPE (2, 3);
    int t = kiln_graph_add_tensor (g, "w", KILN_DT_FLOAT32, &shape, &err);
    uint8_t *data = calloc (1, 20);
    ck_assert_int_eq (kiln_graph_set_weight (g, t, &data, 20, &err), -KILN_ESHAPE);
    ck_assert_ptr_null (data);          /* consumed even on failure */
    ck_assert_ptr_nonnull (strstr (err.msg, "'w'"));
    ck_assert_ptr_nonnull (strstr (err.msg, "24"));
    ck_assert_int_eq (g->tensors[t].weight, -1);
    ck_assert_int_eq (g->n_weights, 0);
    data = calloc (1, 24);
    ck_assert_int_eq (kiln_graph_set_weight (g, t, &data, 24, &err), 0);
    ck_assert_int_eq (g->tensors[t].weight, 0);
    uint8_t zeros[24] = { 0 }, d[KILN_DIGEST_LEN];
    kiln_sha256 (zeros, 24, d);
    ck_assert_mem_eq (g->weights[0].digest, d, KILN_DIGEST_LEN);
    /* Setting it again replaces the same slot rather than adding one. */
    data = calloc (1, 24);
    data[0] = 1;
    ck_assert_int_eq (kiln_graph_set_weight (g, t, &data, 24, &err), 0);
    ck_assert_int_eq (g->n_weights, 1);
    ck_assert_mem_ne (g->weights[0].digest, d, KILN_DIGEST_LEN);
    kiln_graph_destroy (&g);
    ck_assert_ptr_null (g);
}
END_TEST

START_TEST (test_node_set_replaces_attribute_of_same_name)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SHAPE (1));
    int y = s_value (g, "y");
    int n = s_node (g, "Relu", "r", IDX (x), IDX (y));
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_node_set_int (g, n, "k", 1, &err), 0);
    ck_assert_int_eq (kiln_node_set_string (g, n, "s", "hello", &err), 0);
    ck_assert_int_eq (kiln_node_set_float (g, n, "k", 2.5, &err), 0);
    ck_assert_int_eq (g->nodes[n].n_attrs, 2);
    const kiln_node_t *node = &g->nodes[n];
    ck_assert_int_eq (kiln_node_attr (node, "k")->kind, KILN_ATTR_FLOAT);
    ck_assert (kiln_node_attr_float (node, "k", 0) == 2.5);
    ck_assert_int_eq (kiln_node_attr_int (node, "k", 42), 42);   /* wrong kind: fallback */
    ck_assert_str_eq (kiln_node_attr_string (node, "s", "x"), "hello");
    ck_assert_str_eq (kiln_node_attr_string (node, "none", "x"), "x");
    ck_assert_ptr_null (kiln_node_attr (node, "none"));
    ck_assert_int_eq (kiln_graph_find_tensor (g, "y"), y);
    ck_assert_int_eq (kiln_graph_find_tensor (g, "nope"), -1);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_add_node_rejects_out_of_range_tensor)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SHAPE (1));
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_graph_add_node (g, "Relu", "r", IDX (x), IDX (7), &err), -KILN_EINVAL);
    ck_assert_ptr_nonnull (strstr (err.msg, "'r'"));
    ck_assert_int_eq (kiln_graph_add_node (g, "Relu", "r", IDX (-1), IDX (-1), &err), -KILN_EINVAL);
    ck_assert_int_eq (g->n_nodes, 0);
    kiln_graph_destroy (&g);
}
END_TEST

/* --- codec --------------------------------------------------------- */

START_TEST (test_encode_decode_round_trip_is_identical)
{
    kiln_graph_t *g = s_cnn (s_cnn_default ());
    kiln_err_t err = { 0 };
    /* Cover every attribute kind, including a NaN float. */
    int64_t ints[] = { -3, 0, 1LL << 40 };
    double floats[] = { 0.5, -1e30, 0.0 };
    ck_assert_int_eq (kiln_node_set_ints (g, 0, "many", ints, 3, &err), 0);
    ck_assert_int_eq (kiln_node_set_floats (g, 0, "fl", floats, 3, &err), 0);
    ck_assert_int_eq (kiln_node_set_ints (g, 0, "empty", NULL, 0, &err), 0);
    ck_assert_int_eq (kiln_node_set_string (g, 0, "auto_pad", "NOTSET", &err), 0);
    ck_assert_int_eq (kiln_node_set_float (g, 0, "nan", NAN, &err), 0);
    uint8_t *a, *b;
    size_t alen, blen;
    s_encode (g, &a, &alen);
    kiln_graph_t *d = kiln_graph_decode (a, alen, &err);
    ck_assert_msg (d != NULL, "%s", err.msg);
    s_encode (d, &b, &blen);
    ck_assert_uint_eq (alen, blen);
    ck_assert_mem_eq (a, b, alen);

    ck_assert_int_eq (d->opset, 13);
    ck_assert_int_eq (d->n_tensors, g->n_tensors);
    for (int t = 0; t < g->n_tensors; t++) {
        ck_assert_str_eq (d->tensors[t].name, g->tensors[t].name);
        ck_assert_int_eq (d->tensors[t].dtype, g->tensors[t].dtype);
        ck_assert (kiln_shape_equal (&d->tensors[t].shape, &g->tensors[t].shape));
        ck_assert_int_eq (d->tensors[t].weight, g->tensors[t].weight);
    }
    ck_assert_int_eq (d->n_weights, g->n_weights);
    for (int w = 0; w < g->n_weights; w++) {
        ck_assert_mem_eq (d->weights[w].digest, g->weights[w].digest, KILN_DIGEST_LEN);
        ck_assert_uint_eq (d->weights[w].size, g->weights[w].size);
        ck_assert_ptr_null (d->weights[w].data);
    }
    ck_assert (!kiln_graph_complete (d));
    ck_assert (kiln_graph_complete (g));
    ck_assert_int_eq (d->n_nodes, g->n_nodes);
    for (int n = 0; n < g->n_nodes; n++) {
        const kiln_node_t *x = &g->nodes[n], *y = &d->nodes[n];
        ck_assert_str_eq (x->name, y->name);
        ck_assert_str_eq (x->op, y->op);
        ck_assert_int_eq (x->n_inputs, y->n_inputs);
        ck_assert_int_eq (x->n_outputs, y->n_outputs);
        ck_assert_mem_eq (x->inputs, y->inputs, (size_t) x->n_inputs * sizeof (int));
        ck_assert_mem_eq (x->outputs, y->outputs, (size_t) x->n_outputs * sizeof (int));
        ck_assert_int_eq (x->n_attrs, y->n_attrs);
        for (int i = 0; i < x->n_attrs; i++) {
            const kiln_attr_t *p = &x->attrs[i], *q = &y->attrs[i];
            ck_assert_str_eq (p->name, q->name);
            ck_assert_int_eq (p->kind, q->kind);
            ck_assert_uint_eq (p->n, q->n);
            if (p->kind == KILN_ATTR_INT)
                ck_assert_int_eq (p->i, q->i);
            if (p->kind == KILN_ATTR_FLOAT)
                ck_assert (p->f == q->f || (isnan (p->f) && isnan (q->f)));
            if (p->kind == KILN_ATTR_STRING)
                ck_assert_str_eq (p->s, q->s);
            for (size_t k = 0; p->kind == KILN_ATTR_INTS && k < p->n; k++)
                ck_assert_int_eq (p->ints[k], q->ints[k]);
            for (size_t k = 0; p->kind == KILN_ATTR_FLOATS && k < p->n; k++)
                ck_assert (p->floats[k] == q->floats[k]);
        }
    }
    ck_assert_int_eq (d->n_inputs, 1);
    ck_assert_int_eq (d->inputs[0], g->inputs[0]);
    ck_assert_int_eq (d->n_outputs, 1);
    ck_assert_int_eq (d->outputs[0], g->outputs[0]);
    /* Floats are stored as float32 values. */
    ck_assert (kiln_node_attr (&d->nodes[0], "fl")->floats[1] == (double) (float) -1e30);

    /* Attaching the blobs completes it, and its digest is the original's. */
    for (int w = 0; w < g->n_weights; w++) {
        int took = kiln_graph_attach_blob (d, g->weights[w].digest, g->weights[w].data,
                                           g->weights[w].size, &err);
        ck_assert_msg (took == 1, "%d: %s", took, err.msg);
    }
    ck_assert (kiln_graph_complete (d));
    char h1[KILN_HEX_LEN], h2[KILN_HEX_LEN];
    s_digest (g, h1);
    s_digest (d, h2);
    ck_assert_str_eq (h1, h2);
    free (a);
    free (b);
    kiln_graph_destroy (&d);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_encoding_names_format_and_version)
{
    kiln_graph_t *g = s_cnn (s_cnn_default ());
    uint8_t *a;
    size_t alen;
    s_encode (g, &a, &alen);
    msgpack_unpacked up;
    msgpack_unpacked_init (&up);
    size_t off = 0;
    ck_assert_int_eq (msgpack_unpack_next (&up, (const char *) a, alen, &off),
                      MSGPACK_UNPACK_SUCCESS);
    const msgpack_object *root = &up.data;
    ck_assert_int_eq (root->type, MSGPACK_OBJECT_MAP);
    bool format = false, version = false;
    for (uint32_t i = 0; i < root->via.map.size; i++) {
        const msgpack_object_kv *kv = &root->via.map.ptr[i];
        if (kv->key.via.str.size == 6 && memcmp (kv->key.via.str.ptr, "format", 6) == 0)
            format = kv->val.type == MSGPACK_OBJECT_STR && kv->val.via.str.size == 10
                     && memcmp (kv->val.via.str.ptr, "kiln-graph", 10) == 0;
        if (kv->key.via.str.size == 7 && memcmp (kv->key.via.str.ptr, "version", 7) == 0)
            version = kv->val.type == MSGPACK_OBJECT_POSITIVE_INTEGER && kv->val.via.u64 == 1;
    }
    ck_assert (format);
    ck_assert (version);
    msgpack_unpacked_destroy (&up);
    free (a);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_decode_rejects_every_truncation)
{
    kiln_graph_t *g = s_cnn (s_cnn_default ());
    uint8_t *a;
    size_t alen;
    s_encode (g, &a, &alen);
    for (size_t len = 0; len < alen; len++) {
        /* A copy of exactly `len` bytes, so that valgrind and ASan see any
         * read past the end. */
        uint8_t *cut = malloc (len ? len : 1);
        memcpy (cut, a, len);
        kiln_err_t err = { 0 };
        kiln_graph_t *d = kiln_graph_decode (cut, len, &err);
        ck_assert_msg (d == NULL, "decode of %zu/%zu bytes succeeded", len, alen);
        ck_assert_int_eq (err.code, KILN_EFORMAT);
        ck_assert (err.msg[0] != '\0');
        free (cut);
    }
    free (a);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_decode_survives_random_byte_flips)
{
    kiln_graph_t *g = s_cnn (s_cnn_default ());
    uint8_t *a;
    size_t alen;
    s_encode (g, &a, &alen);
    uint8_t *copy = malloc (alen);
    unsigned seed = 12345;
    int rejected = 0;
    for (int iter = 0; iter < 3000; iter++) {
        memcpy (copy, a, alen);
        int flips = 1 + iter % 4;
        for (int k = 0; k < flips; k++) {
            seed = seed * 1103515245u + 12345u;
            size_t pos = (seed >> 8) % alen;
            seed = seed * 1103515245u + 12345u;
            copy[pos] ^= (uint8_t) (1 + ((seed >> 16) % 255));
        }
        kiln_err_t err = { 0 };
        kiln_graph_t *d = kiln_graph_decode (copy, alen, &err);
        if (!d) {
            rejected++;
            ck_assert (err.code == KILN_EFORMAT || err.code == KILN_ELIMIT
                       || err.code == KILN_EUNSUPPORTED);
            continue;
        }
        /* Whatever decoded must be consistent enough to encode, hash and
         * validate without crashing. */
        uint8_t *b;
        size_t blen;
        char hex[KILN_HEX_LEN];
        ck_assert_int_eq (kiln_graph_encode (d, &b, &blen, &err), 0);
        free (b);
        ck_assert_int_eq (kiln_graph_digest (d, hex, &err), 0);
        kiln_graph_validate (d, &err);
        kiln_graph_destroy (&d);
    }
    ck_assert_int_gt (rejected, 1000);
    free (copy);
    free (a);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_decode_rejects_random_garbage)
{
    unsigned seed = 777;
    uint8_t buf[300];
    for (int iter = 0; iter < 5000; iter++) {
        seed = seed * 1103515245u + 12345u;
        size_t len = 1 + (seed >> 8) % sizeof buf;
        for (size_t i = 0; i < len; i++) {
            seed = seed * 1103515245u + 12345u;
            buf[i] = (uint8_t) (seed >> 16);
        }
        /* Half the time start like a map, so that parsing gets further. */
        if (iter % 2)
            buf[0] = 0x88;
        uint8_t *copy = malloc (len);
        memcpy (copy, buf, len);
        kiln_err_t err = { 0 };
        kiln_graph_t *d = kiln_graph_decode (copy, len, &err);
        ck_assert_msg (d == NULL, "garbage %d decoded", iter);
        ck_assert (err.code == KILN_EFORMAT || err.code == KILN_ELIMIT);
        free (copy);
    }
}
END_TEST

/* Pack a minimal structure with one tensor and one Relu node, with the
 * given version, node input index and tensor weight index. */
static void
s_pack_minimal (msgpack_sbuffer *sb, int version, int node_input, int weight)
{
    msgpack_packer pk;
    msgpack_packer_init (&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_map (&pk, 8);
#define KEY(k) msgpack_pack_str (&pk, strlen (k)), msgpack_pack_str_body (&pk, k, strlen (k))
    KEY ("format"); KEY ("kiln-graph");
    KEY ("version"); msgpack_pack_int (&pk, version);
    KEY ("opset"); msgpack_pack_int (&pk, 13);
    KEY ("weights"); msgpack_pack_array (&pk, 0);
    KEY ("tensors"); msgpack_pack_array (&pk, 1);
    msgpack_pack_map (&pk, 4);
    KEY ("name"); KEY ("x");
    KEY ("dtype"); msgpack_pack_int (&pk, 1);
    KEY ("shape"); msgpack_pack_array (&pk, 1); msgpack_pack_int (&pk, 4);
    KEY ("weight"); msgpack_pack_int (&pk, weight);
    KEY ("nodes"); msgpack_pack_array (&pk, 1);
    msgpack_pack_map (&pk, 5);
    KEY ("name"); KEY ("r");
    KEY ("op"); KEY ("Relu");
    KEY ("inputs"); msgpack_pack_array (&pk, 1); msgpack_pack_int (&pk, node_input);
    KEY ("outputs"); msgpack_pack_array (&pk, 1); msgpack_pack_int (&pk, 0);
    KEY ("attrs"); msgpack_pack_array (&pk, 0);
    KEY ("inputs"); msgpack_pack_array (&pk, 0);
    KEY ("outputs"); msgpack_pack_array (&pk, 0);
#undef KEY
}

START_TEST (test_decode_rejects_out_of_range_indices_and_versions)
{
    struct { int version, input, weight, code; const char *frag; } cases[] = {
        { 1, 0, -1, 0, NULL },
        { 1, 1, -1, KILN_EFORMAT, "node 0" },
        { 1, -2, -1, KILN_EFORMAT, "outside -1..0" },
        { 1, 0, 0, KILN_EFORMAT, "tensor 0" },
        { 2, 0, -1, KILN_EUNSUPPORTED, "version 2" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        msgpack_sbuffer sb;
        msgpack_sbuffer_init (&sb);
        s_pack_minimal (&sb, cases[i].version, cases[i].input, cases[i].weight);
        kiln_err_t err = { 0 };
        kiln_graph_t *d = kiln_graph_decode ((uint8_t *) sb.data, sb.size, &err);
        if (cases[i].code == 0)
            ck_assert_msg (d != NULL, "case %zu: %s", i, err.msg);
        else {
            ck_assert_msg (d == NULL, "case %zu decoded", i);
            ck_assert_int_eq (err.code, cases[i].code);
            ck_assert_msg (strstr (err.msg, cases[i].frag), "case %zu: '%s'", i, err.msg);
        }
        kiln_graph_destroy (&d);
        msgpack_sbuffer_destroy (&sb);
    }
}
END_TEST

START_TEST (test_decode_rejects_huge_counts_without_allocating)
{
    /* A map whose first value claims 2^32-1 array elements in 5 bytes. */
    const uint8_t huge[] = { 0x81, 0xa6, 'f', 'o', 'r', 'm', 'a', 't',
                             0xdd, 0xff, 0xff, 0xff, 0xff, 0x00 };
    kiln_err_t err = { 0 };
    ck_assert_ptr_null (kiln_graph_decode (huge, sizeof huge, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_ptr_nonnull (strstr (err.msg, "claims"));
    /* Nesting deeper than any kiln record. */
    uint8_t deep[64];
    memset (deep, 0x91, sizeof deep);
    deep[63] = 0x00;
    ck_assert_ptr_null (kiln_graph_decode (deep, sizeof deep, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    /* Not a map at all, and trailing bytes after a valid structure. */
    const uint8_t one[] = { 0x01 };
    ck_assert_ptr_null (kiln_graph_decode (one, 1, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    msgpack_sbuffer sb;
    msgpack_sbuffer_init (&sb);
    s_pack_minimal (&sb, 1, 0, -1);
    msgpack_sbuffer_write (&sb, "\x00", 1);
    ck_assert_ptr_null (kiln_graph_decode ((uint8_t *) sb.data, sb.size, &err));
    ck_assert_ptr_nonnull (strstr (err.msg, "trailing"));
    msgpack_sbuffer_destroy (&sb);
}
END_TEST

START_TEST (test_attach_blob_checks_hash_and_size)
{
    kiln_graph_t *g = s_cnn (s_cnn_default ());
    uint8_t *a;
    size_t alen;
    s_encode (g, &a, &alen);
    kiln_err_t err = { 0 };
    kiln_graph_t *d = kiln_graph_decode (a, alen, &err);
    const kiln_weight_t *w = &g->weights[0];
    uint8_t *bad = malloc (w->size);
    memcpy (bad, w->data, w->size);
    bad[3] ^= 1;
    ck_assert_int_eq (kiln_graph_attach_blob (d, w->digest, bad, w->size, &err), -KILN_EVERIFY);
    ck_assert_int_eq (kiln_graph_attach_blob (d, w->digest, w->data, w->size - 1, &err),
                      -KILN_EFORMAT);
    ck_assert_ptr_nonnull (strstr (err.msg, "conv.w"));
    ck_assert_ptr_null (d->weights[0].data);
    uint8_t other[KILN_DIGEST_LEN] = { 0 };
    ck_assert_int_eq (kiln_graph_attach_blob (d, other, bad, 4, &err), 0);
    ck_assert_int_eq (kiln_graph_attach_blob (d, w->digest, w->data, w->size, &err), 1);
    ck_assert_mem_eq (d->weights[0].data, w->data, w->size);
    free (bad);
    free (a);
    kiln_graph_destroy (&d);
    kiln_graph_destroy (&g);
}
END_TEST

/* --- .kgraph files ------------------------------------------------- */

START_TEST (test_save_load_round_trip_keeps_weights)
{
    char *dir = s_tmpdir ();
    char path[512];
    snprintf (path, sizeof path, "%s/m.kgraph", dir);
    kiln_graph_t *g = s_cnn (s_cnn_default ());
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_graph_save (g, path, &err) == 0, "%s", err.msg);
    kiln_graph_t *h = kiln_graph_load (path, &err);
    ck_assert_msg (h != NULL, "%s", err.msg);
    ck_assert (kiln_graph_complete (h));
    ck_assert_int_eq (h->n_weights, g->n_weights);
    for (int w = 0; w < g->n_weights; w++) {
        ck_assert_uint_eq (h->weights[w].size, g->weights[w].size);
        ck_assert_mem_eq (h->weights[w].data, g->weights[w].data, g->weights[w].size);
    }
    uint8_t *a, *b;
    size_t alen, blen;
    s_encode (g, &a, &alen);
    s_encode (h, &b, &blen);
    ck_assert_uint_eq (alen, blen);
    ck_assert_mem_eq (a, b, alen);
    s_validate_ok (h);
    free (a);
    free (b);
    kiln_graph_destroy (&h);
    kiln_graph_destroy (&g);
    kiln_rm_rf (dir);
    free (dir);
}
END_TEST

START_TEST (test_save_writes_identical_blobs_once)
{
    char *dir = s_tmpdir ();
    char path[512];
    snprintf (path, sizeof path, "%s/dup.kgraph", dir);
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SHAPE (1024));
    int w1 = s_weight (g, "w1", KILN_DT_FLOAT32, SHAPE (1024), 5);
    int w2 = s_weight (g, "w2", KILN_DT_FLOAT32, SHAPE (1024), 5);
    int t = s_value (g, "t"), y = s_value (g, "y");
    s_node (g, "Add", "a1", IDX (x, w1), IDX (t));
    s_node (g, "Add", "a2", IDX (t, w2), IDX (y));
    s_output (g, y);
    ck_assert_int_eq (g->n_weights, 2);
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_graph_save (g, path, &err), 0);
    uint8_t *file;
    size_t flen;
    ck_assert_int_eq (kiln_read_file (path, 1 << 20, &file, &flen, &err), 0);
    /* One 4096-byte blob plus a small structure, not two blobs. */
    ck_assert_uint_gt (flen, 4096);
    ck_assert_uint_lt (flen, 4096 + 1024);
    free (file);
    kiln_graph_t *h = kiln_graph_load (path, &err);
    ck_assert_msg (h != NULL, "%s", err.msg);
    ck_assert (kiln_graph_complete (h));
    ck_assert_mem_eq (h->weights[1].data, g->weights[1].data, 4096);
    kiln_graph_destroy (&h);
    kiln_graph_destroy (&g);
    kiln_rm_rf (dir);
    free (dir);
}
END_TEST

START_TEST (test_blob_heads_align_data_and_parse_as_msgpack)
{
    uint8_t digest[KILN_DIGEST_LEN], head[KILN_GRAPH_BLOB_HEAD_MAX];
    for (int i = 0; i < KILN_DIGEST_LEN; i++)
        digest[i] = (uint8_t) (0xa0 + i);
    static const uint64_t sizes[] = { 0, 7, 255, 256, 65535, 65536, 1 << 20, 0xffffffffu };
    int eight = 0;
    for (uint64_t at = 0; at < 16; at++)
        for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
            size_t n = kiln_graph_blob_head (at, digest, sizes[k], head);
            ck_assert_uint_le (n, KILN_GRAPH_BLOB_HEAD_MAX);
            ck_assert_msg ((at + n) % 4 == 0, "at %llu size %llu: data at %llu",
                           (unsigned long long) at, (unsigned long long) sizes[k],
                           (unsigned long long) (at + n));
            eight += (at + n) % 8 == 0;
            ck_assert_int_eq (head[0] == 0x92 || head[0] == 0xdc || head[0] == 0xdd, 1);
            if (sizes[k] > (1 << 20))
                continue;
            /* A stock msgpack reader sees [bin digest, bin of `size`]. */
            size_t len = n + (size_t) sizes[k];
            char *entry = calloc (1, len);
            ck_assert_ptr_nonnull (entry);
            memcpy (entry, head, n);
            msgpack_unpacked up;
            msgpack_unpacked_init (&up);
            size_t off = 0;
            ck_assert_int_eq (msgpack_unpack_next (&up, entry, len, &off),
                              MSGPACK_UNPACK_SUCCESS);
            ck_assert_uint_eq (off, len);
            msgpack_object o = up.data;
            ck_assert_int_eq (o.type, MSGPACK_OBJECT_ARRAY);
            ck_assert_uint_eq (o.via.array.size, 2);
            ck_assert_int_eq (o.via.array.ptr[0].type, MSGPACK_OBJECT_BIN);
            ck_assert_uint_eq (o.via.array.ptr[0].via.bin.size, KILN_DIGEST_LEN);
            ck_assert_mem_eq (o.via.array.ptr[0].via.bin.ptr, digest, KILN_DIGEST_LEN);
            ck_assert_int_eq (o.via.array.ptr[1].type, MSGPACK_OBJECT_BIN);
            ck_assert_uint_eq (o.via.array.ptr[1].via.bin.size, sizes[k]);
            msgpack_unpacked_destroy (&up);
            free (entry);
        }
    /* 8 whenever the forms allow it: all but one residue of eight. */
    ck_assert_int_ge (eight, 16 * 8 * 7 / 8 - 8);
}
END_TEST

START_TEST (test_load_maps_large_blobs_aligned_for_their_type)
{
    char *dir = s_tmpdir ();
    char path[512];
    snprintf (path, sizeof path, "%s/a.kgraph", dir);
    kiln_graph_t *g = kiln_graph_new ();
    /* Sizes that leave every residue of 8 behind them in the file. */
    s_weight (g, "h0", KILN_DT_FLOAT16, SHAPE (1025), 1);
    s_weight (g, "f1", KILN_DT_FLOAT32, SHAPE ((1 << 18) + 1), 2);
    s_weight (g, "u2", KILN_DT_UINT8, SHAPE ((1 << 20) + 3), 3);
    s_weight (g, "i3", KILN_DT_INT64, SHAPE ((1 << 17) + 1), 4);
    s_weight (g, "h4", KILN_DT_FLOAT16, SHAPE ((1 << 19) + 1), 5);
    s_weight (g, "u5", KILN_DT_UINT8, SHAPE ((1 << 20) + 5), 6);
    s_weight (g, "d6", KILN_DT_FLOAT64, SHAPE ((1 << 17) + 3), 7);
    s_weight (g, "u7", KILN_DT_UINT8, SHAPE ((1 << 20) + 6), 8);
    s_weight (g, "f8", KILN_DT_FLOAT32, SHAPE ((1 << 18) + 7), 9);
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_graph_save (g, path, &err) == 0, "%s", err.msg);
    kiln_graph_t *h = kiln_graph_load (path, &err);
    ck_assert_msg (h != NULL, "%s", err.msg);
    for (int t = 0; t < h->n_tensors; t++) {
        const kiln_weight_t *w = &h->weights[h->tensors[t].weight];
        size_t es = kiln_dtype_size (h->tensors[t].dtype);
        ck_assert_mem_eq (w->data, g->weights[g->tensors[t].weight].data, w->size);
        ck_assert_msg ((uintptr_t) w->data % es == 0, "%s at %p", h->tensors[t].name,
                       (void *) w->data);
        if (w->size >= (1u << 20))
            ck_assert_msg (w->map.len > 0, "%s was read, not mapped", h->tensors[t].name);
    }
    kiln_graph_destroy (&h);
    kiln_graph_destroy (&g);
    kiln_rm_rf (dir);
    free (dir);
}
END_TEST

START_TEST (test_map_weight_reads_elements_at_an_unaligned_offset)
{
    char *dir = s_tmpdir ();
    char path[512];
    snprintf (path, sizeof path, "%s/ext.bin", dir);
    enum { N = (1 << 18) + 3 };
    uint8_t *file = malloc (N * 4 + 16);
    ck_assert_ptr_nonnull (file);
    for (size_t i = 0; i < N * 4 + 16; i++)
        file[i] = (uint8_t) (i * 7 + 1);
    s_write (path, file, N * 4 + 16);
    int fd = open (path, O_RDONLY | O_CLOEXEC);
    ck_assert_int_ge (fd, 0);
    for (uint64_t offset = 0; offset < 8; offset++) {
        kiln_graph_t *g = kiln_graph_new ();
        kiln_err_t err = { 0 };
        kiln_shape_t shape = SHAPE (N);
        int t = kiln_graph_add_tensor (g, "w", KILN_DT_FLOAT32, &shape, &err);
        ck_assert_int_ge (t, 0);
        ck_assert_msg (kiln_graph_map_weight (g, t, fd, offset, N * 4, NULL, &err) == 0,
                       "%s", err.msg);
        const kiln_weight_t *w = &g->weights[g->tensors[t].weight];
        ck_assert_uint_eq ((uintptr_t) w->data % 4, 0);
        ck_assert_mem_eq (w->data, file + offset, N * 4);
        ck_assert_int_eq (w->map.len > 0, offset % 4 == 0);
        kiln_graph_destroy (&g);
    }
    close (fd);
    free (file);
    kiln_rm_rf (dir);
    free (dir);
}
END_TEST

START_TEST (test_load_names_tensor_whose_blob_is_missing)
{
    char *dir = s_tmpdir ();
    char path[512];
    snprintf (path, sizeof path, "%s/noblob.kgraph", dir);
    kiln_graph_t *g = s_cnn (s_cnn_default ());
    uint8_t *a;
    size_t alen;
    s_encode (g, &a, &alen);
    /* A header with no blobs after it. */
    msgpack_sbuffer sb;
    msgpack_sbuffer_init (&sb);
    msgpack_packer pk;
    msgpack_packer_init (&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map (&pk, 3);
    msgpack_pack_str (&pk, 6); msgpack_pack_str_body (&pk, "format", 6);
    msgpack_pack_str (&pk, 10); msgpack_pack_str_body (&pk, "kiln-graph", 10);
    msgpack_pack_str (&pk, 7); msgpack_pack_str_body (&pk, "version", 7);
    msgpack_pack_int (&pk, 1);
    msgpack_pack_str (&pk, 5); msgpack_pack_str_body (&pk, "graph", 5);
    msgpack_pack_bin (&pk, alen); msgpack_pack_bin_body (&pk, a, alen);
    s_write (path, (uint8_t *) sb.data, sb.size);
    kiln_err_t err = { 0 };
    ck_assert_ptr_null (kiln_graph_load (path, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    ck_assert_msg (strstr (err.msg, "'conv.w'") && strstr (err.msg, "missing"), "%s", err.msg);
    msgpack_sbuffer_destroy (&sb);
    free (a);
    kiln_graph_destroy (&g);
    kiln_rm_rf (dir);
    free (dir);
}
END_TEST

START_TEST (test_load_rejects_corrupt_or_truncated_file)
{
    char *dir = s_tmpdir ();
    char path[512], bad[512];
    snprintf (path, sizeof path, "%s/m.kgraph", dir);
    snprintf (bad, sizeof bad, "%s/bad.kgraph", dir);
    kiln_graph_t *g = s_cnn (s_cnn_default ());
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_graph_save (g, path, &err), 0);
    uint8_t *file;
    size_t flen;
    ck_assert_int_eq (kiln_read_file (path, 1 << 20, &file, &flen, &err), 0);

    /* The last byte belongs to the last blob's data. */
    file[flen - 1] ^= 0x40;
    s_write (bad, file, flen);
    ck_assert_ptr_null (kiln_graph_load (bad, &err));
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    ck_assert_ptr_nonnull (strstr (err.msg, "does not match"));
    file[flen - 1] ^= 0x40;

    for (size_t len = 0; len < flen; len++) {
        s_write (bad, file, len);
        kiln_graph_t *h = kiln_graph_load (bad, &err);
        ck_assert_msg (h == NULL, "truncated to %zu/%zu bytes loaded", len, flen);
        ck_assert_msg (err.code == KILN_EFORMAT, "%zu: %s", len, err.msg);
    }
    const uint8_t garbage[] = "not a kiln graph at all";
    s_write (bad, garbage, sizeof garbage);
    ck_assert_ptr_null (kiln_graph_load (bad, &err));
    ck_assert_int_eq (err.code, KILN_EFORMAT);
    snprintf (bad, sizeof bad, "%s/absent.kgraph", dir);
    ck_assert_ptr_null (kiln_graph_load (bad, &err));
    ck_assert_int_eq (err.code, KILN_ENOTFOUND);
    free (file);
    kiln_graph_destroy (&g);
    kiln_rm_rf (dir);
    free (dir);
}
END_TEST

START_TEST (test_save_refuses_graph_without_weight_data)
{
    char *dir = s_tmpdir ();
    char path[512];
    snprintf (path, sizeof path, "%s/m.kgraph", dir);
    kiln_graph_t *g = s_cnn (s_cnn_default ());
    uint8_t *a;
    size_t alen;
    s_encode (g, &a, &alen);
    kiln_err_t err = { 0 };
    kiln_graph_t *d = kiln_graph_decode (a, alen, &err);
    ck_assert_int_eq (kiln_graph_save (d, path, &err), -KILN_EINVAL);
    ck_assert_ptr_nonnull (strstr (err.msg, "'conv.w'"));
    ck_assert (!kiln_file_exists (path));
    free (a);
    kiln_graph_destroy (&d);
    kiln_graph_destroy (&g);
    kiln_rm_rf (dir);
    free (dir);
}
END_TEST

/* --- digest -------------------------------------------------------- */

START_TEST (test_digest_same_for_graph_built_twice)
{
    kiln_graph_t *g = s_cnn (s_cnn_default ()), *h = s_cnn (s_cnn_default ());
    char a[KILN_HEX_LEN], b[KILN_HEX_LEN];
    s_digest (g, a);
    s_digest (h, b);
    ck_assert_str_eq (a, b);
    kiln_graph_destroy (&g);
    kiln_graph_destroy (&h);
}
END_TEST

START_TEST (test_digest_ignores_internal_names)
{
    s_cnn_opts_t o = s_cnn_default ();
    kiln_graph_t *g = s_cnn (o);
    o.tag = "model/renamed_";
    kiln_graph_t *h = s_cnn (o);
    ck_assert_str_ne (g->nodes[0].name, h->nodes[0].name);
    char a[KILN_HEX_LEN], b[KILN_HEX_LEN];
    s_digest (g, a);
    s_digest (h, b);
    ck_assert_str_eq (a, b);
    kiln_graph_destroy (&g);
    kiln_graph_destroy (&h);
}
END_TEST

START_TEST (test_digest_ignores_attribute_order_and_validation)
{
    s_cnn_opts_t o = s_cnn_default ();
    kiln_graph_t *g = s_cnn (o);
    o.reverse_attrs = true;
    kiln_graph_t *h = s_cnn (o);
    ck_assert_str_ne (g->nodes[0].attrs[0].name, h->nodes[0].attrs[0].name);
    char a[KILN_HEX_LEN], b[KILN_HEX_LEN], c[KILN_HEX_LEN];
    s_digest (g, a);
    s_digest (h, b);
    ck_assert_str_eq (a, b);
    /* Inferred shapes follow from the graph, so they do not change it. */
    s_validate_ok (h);
    s_digest (h, c);
    ck_assert_str_eq (a, c);
    kiln_graph_destroy (&g);
    kiln_graph_destroy (&h);
}
END_TEST

START_TEST (test_digest_changes_when_one_weight_byte_changes)
{
    s_cnn_opts_t o = s_cnn_default ();
    kiln_graph_t *g = s_cnn (o);
    o.seed = 2;                 /* every byte of conv.w shifts by one */
    kiln_graph_t *h = s_cnn (o);
    char a[KILN_HEX_LEN], b[KILN_HEX_LEN], c[KILN_HEX_LEN];
    s_digest (g, a);
    s_digest (h, b);
    ck_assert_str_ne (a, b);
    /* And one single byte, set through the API. */
    int t = kiln_graph_find_tensor (g, "fc.b");
    uint64_t size = g->weights[g->tensors[t].weight].size;
    uint8_t *data = malloc (size);
    memcpy (data, g->weights[g->tensors[t].weight].data, size);
    data[size - 1] ^= 1;
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_graph_set_weight (g, t, &data, size, &err), 0);
    s_digest (g, c);
    ck_assert_str_ne (a, c);
    kiln_graph_destroy (&g);
    kiln_graph_destroy (&h);
}
END_TEST

START_TEST (test_digest_changes_when_an_attribute_changes)
{
    s_cnn_opts_t o = s_cnn_default ();
    kiln_graph_t *g = s_cnn (o);
    o.pool_stride = 1;
    kiln_graph_t *h = s_cnn (o);
    char a[KILN_HEX_LEN], b[KILN_HEX_LEN], c[KILN_HEX_LEN];
    s_digest (g, a);
    s_digest (h, b);
    ck_assert_str_ne (a, b);
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_node_set_float (h, 4, "alpha", 2.0, &err), 0);
    s_digest (h, c);
    ck_assert_str_ne (b, c);
    kiln_graph_destroy (&g);
    kiln_graph_destroy (&h);
}
END_TEST

START_TEST (test_digest_keeps_interface_names)
{
    kiln_graph_t *g = s_cnn (s_cnn_default ()), *h = s_cnn (s_cnn_default ());
    char a[KILN_HEX_LEN], b[KILN_HEX_LEN];
    free (h->tensors[h->inputs[0]].name);
    h->tensors[h->inputs[0]].name = strdup ("image");
    s_digest (g, a);
    s_digest (h, b);
    ck_assert_str_ne (a, b);
    kiln_graph_destroy (&g);
    kiln_graph_destroy (&h);
}
END_TEST

/* --- I/O structure ------------------------------------------------- */

/* What kiln.trace writes: JSON with quotes, a backslash and non-ASCII. */
#define S_IO_STRUCTURE "{\"kind\":\"tuple\",\"items\":[{\"tensor\":0}," \
                       "{\"kind\":\"dict\",\"keys\":[\"caf\xc3\xa9\\\\n\"]}]}"

/* The digest of s_cnn (s_cnn_default ()) as kiln computed it before
 * graphs had an I/O structure: a graph without one must keep it. */
#define S_CNN_DIGEST "5c3f229f241f666344a40b7f7de7b7e1a9fb51eb87fd91eb930ab2a65d8f10af"

/* The minimal structure of s_pack_minimal with one more key,
 * "io_structure", holding a string of `len` bytes from `text`. */
static void
s_pack_minimal_io (msgpack_sbuffer *sb, const char *text, size_t len)
{
    s_pack_minimal (sb, 1, 0, -1);
    ck_assert_uint_eq ((uint8_t) sb->data[0], 0x88);    /* fixmap of 8 */
    sb->data[0] = (char) 0x89;
    msgpack_packer pk;
    msgpack_packer_init (&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_str (&pk, 12);
    msgpack_pack_str_body (&pk, "io_structure", 12);
    msgpack_pack_str (&pk, len);
    msgpack_pack_str_body (&pk, text, len);
}

START_TEST (test_io_structure_round_trips_through_the_codec)
{
    kiln_graph_t *g = s_cnn (s_cnn_default ());
    kiln_err_t err = { 0 };
    ck_assert_ptr_null (g->io_structure);
    ck_assert_msg (kiln_graph_set_io_structure (g, S_IO_STRUCTURE, &err) == 0, "%s", err.msg);
    ck_assert_str_eq (g->io_structure, S_IO_STRUCTURE);
    uint8_t *a, *b;
    size_t alen, blen;
    s_encode (g, &a, &alen);
    kiln_graph_t *d = kiln_graph_decode (a, alen, &err);
    ck_assert_msg (d != NULL, "%s", err.msg);
    ck_assert_ptr_nonnull (d->io_structure);
    ck_assert_str_eq (d->io_structure, S_IO_STRUCTURE);
    s_encode (d, &b, &blen);
    ck_assert_uint_eq (alen, blen);
    ck_assert_mem_eq (a, b, alen);

    /* Through a .kgraph file too, and the digest survives both. */
    char *dir = s_tmpdir ();
    char path[4096];
    snprintf (path, sizeof path, "%s/io.kgraph", dir);
    ck_assert_msg (kiln_graph_save (g, path, &err) == 0, "%s", err.msg);
    kiln_graph_t *l = kiln_graph_load (path, &err);
    ck_assert_msg (l != NULL, "%s", err.msg);
    ck_assert_str_eq (l->io_structure, S_IO_STRUCTURE);
    char h1[KILN_HEX_LEN], h2[KILN_HEX_LEN];
    s_digest (g, h1);
    s_digest (l, h2);
    ck_assert_str_eq (h1, h2);

    /* Setting NULL or "" removes it, and the encoding loses the key. */
    ck_assert_int_eq (kiln_graph_set_io_structure (d, "", &err), 0);
    ck_assert_ptr_null (d->io_structure);
    free (b);
    s_encode (d, &b, &blen);
    ck_assert_int_lt (s_find_bytes (b, blen, "io_structure"), 0);
    ck_assert_int_eq (kiln_graph_set_io_structure (l, NULL, &err), 0);
    ck_assert_ptr_null (l->io_structure);

    kiln_rm_rf (dir);
    free (dir);
    free (a);
    free (b);
    kiln_graph_destroy (&l);
    kiln_graph_destroy (&d);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_digest_counts_io_structure_only_when_present)
{
    kiln_graph_t *g = s_cnn (s_cnn_default ());
    kiln_err_t err = { 0 };
    char plain[KILN_HEX_LEN], with[KILN_HEX_LEN], other[KILN_HEX_LEN], again[KILN_HEX_LEN];
    s_digest (g, plain);
    ck_assert_str_eq (plain, S_CNN_DIGEST);
    /* Without it the structure has exactly the eight keys it always had. */
    uint8_t *a;
    size_t alen;
    s_encode (g, &a, &alen);
    ck_assert_uint_eq (a[0], 0x88);
    ck_assert_int_lt (s_find_bytes (a, alen, "io_structure"), 0);
    free (a);

    ck_assert_int_eq (kiln_graph_set_io_structure (g, "[0]", &err), 0);
    s_digest (g, with);
    ck_assert_str_ne (with, plain);
    ck_assert_int_eq (kiln_graph_set_io_structure (g, "[[0]]", &err), 0);
    s_digest (g, other);
    ck_assert_str_ne (other, with);
    ck_assert_str_ne (other, plain);
    ck_assert_int_eq (kiln_graph_set_io_structure (g, NULL, &err), 0);
    s_digest (g, again);
    ck_assert_str_eq (again, plain);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_io_structure_over_the_bound_or_not_utf8_is_refused)
{
    kiln_graph_t *g = s_cnn (s_cnn_default ());
    kiln_err_t err = { 0 };
    size_t max = KILN_MAX_IO_STRUCTURE_BYTES;
    char *big = malloc (max + 2);
    memset (big, '1', max + 1);
    big[max + 1] = '\0';
    ck_assert_int_eq (kiln_graph_set_io_structure (g, "[0]", &err), 0);
    ck_assert_int_eq (kiln_graph_set_io_structure (g, big, &err), -KILN_ELIMIT);
    ck_assert_msg (strstr (err.msg, "I/O structure is longer than 65536 bytes"), "%s", err.msg);
    ck_assert_str_eq (g->io_structure, "[0]");          /* the old value stays */
    const char *bad[] = { "\xff", "\xc3", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ck_assert_int_eq (kiln_graph_set_io_structure (g, bad[i], &err), -KILN_EFORMAT);
        ck_assert_msg (strstr (err.msg, "not valid UTF-8"), "%zu: %s", i, err.msg);
    }
    /* Exactly at the bound is fine. */
    big[max] = '\0';
    ck_assert_msg (kiln_graph_set_io_structure (g, big, &err) == 0, "%s", err.msg);

    /* The decoder holds encoded structures to the same rules. */
    struct { const char *text; size_t len; int code; const char *frag; } cases[] = {
        { big, max, 0, NULL },
        { big, max + 1, KILN_ELIMIT, "field 'io_structure' is 65537 bytes, more than 65536" },
        { "[\xff]", 3, KILN_EFORMAT, "field 'io_structure': I/O structure is not valid UTF-8" },
        { "[\0]", 3, KILN_EFORMAT, "field 'io_structure' contains a NUL byte" },
    };
    big[max] = '1';
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        msgpack_sbuffer sb;
        msgpack_sbuffer_init (&sb);
        s_pack_minimal_io (&sb, cases[i].text, cases[i].len);
        kiln_graph_t *d = kiln_graph_decode ((uint8_t *) sb.data, sb.size, &err);
        if (cases[i].code == 0) {
            ck_assert_msg (d != NULL, "case %zu: %s", i, err.msg);
            ck_assert_uint_eq (strlen (d->io_structure), max);
        }
        else {
            ck_assert_msg (d == NULL, "case %zu decoded", i);
            ck_assert_int_eq (err.code, cases[i].code);
            ck_assert_msg (strstr (err.msg, cases[i].frag), "case %zu: '%s'", i, err.msg);
        }
        kiln_graph_destroy (&d);
        msgpack_sbuffer_destroy (&sb);
    }
    /* A value that is not a string. */
    msgpack_sbuffer sb;
    msgpack_sbuffer_init (&sb);
    s_pack_minimal (&sb, 1, 0, -1);
    sb.data[0] = (char) 0x89;
    msgpack_packer pk;
    msgpack_packer_init (&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_str (&pk, 12);
    msgpack_pack_str_body (&pk, "io_structure", 12);
    msgpack_pack_int (&pk, 7);
    ck_assert_ptr_null (kiln_graph_decode ((uint8_t *) sb.data, sb.size, &err));
    ck_assert_msg (strstr (err.msg, "field 'io_structure' is not a string"), "%s", err.msg);
    msgpack_sbuffer_destroy (&sb);

    /* The encoder refuses a struct edited past the bound by hand. */
    free (g->io_structure);
    g->io_structure = big;
    uint8_t *out = NULL;
    size_t len = 0;
    ck_assert_int_eq (kiln_graph_encode (g, &out, &len, &err), -KILN_ELIMIT);
    ck_assert_ptr_null (out);
    kiln_graph_destroy (&g);
}
END_TEST

/* --- validation ---------------------------------------------------- */

START_TEST (test_validate_infers_cnn_and_keeps_order)
{
    kiln_graph_t *g = s_cnn (s_cnn_default ());
    s_validate_ok (g);
    /* conv: (8 + 1 + 1 - 3) / 1 + 1 = 8; pool: (8 - 2) / 2 + 1 = 4;
     * flatten: 4 * 4 * 4 = 64; gemm: [1, 64] x [10, 64]^T = [1, 10]. */
    s_assert_shape (g, kiln_graph_find_tensor (g, "conv.out"), SHAPE (1, 4, 8, 8));
    s_assert_shape (g, kiln_graph_find_tensor (g, "relu.out"), SHAPE (1, 4, 8, 8));
    s_assert_shape (g, kiln_graph_find_tensor (g, "pool.out"), SHAPE (1, 4, 4, 4));
    s_assert_shape (g, kiln_graph_find_tensor (g, "flat.out"), SHAPE (1, 64));
    s_assert_shape (g, kiln_graph_find_tensor (g, "y"), SHAPE (1, 10));
    ck_assert_int_eq (g->tensors[kiln_graph_find_tensor (g, "y")].dtype, KILN_DT_FLOAT32);
    const char *ops[] = { "Conv", "Relu", "MaxPool", "Flatten", "Gemm" };
    for (int n = 0; n < 5; n++)
        ck_assert_str_eq (g->nodes[n].op, ops[n]);
    /* Validating again is a no-op: declared shapes agree with inference. */
    s_validate_ok (g);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_validate_sorts_nodes_topologically)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SHAPE (2, 2));
    int a = s_value (g, "a"), b = s_value (g, "b"), c = s_value (g, "c"), d = s_value (g, "d");
    /* Listed consumers first: d = c + a, c = Relu(b), b = Relu(x), a = Relu(x). */
    s_node (g, "Add", "n0", IDX (c, a), IDX (d));
    s_node (g, "Relu", "n1", IDX (b), IDX (c));
    s_node (g, "Relu", "n2", IDX (x), IDX (b));
    s_node (g, "Relu", "n3", IDX (x), IDX (a));
    s_output (g, d);
    s_validate_ok (g);
    /* Ready nodes are taken lowest original index first. */
    const char *want[] = { "n2", "n1", "n3", "n0" };
    for (int n = 0; n < 4; n++)
        ck_assert_str_eq (g->nodes[n].name, want[n]);
    s_assert_shape (g, d, SHAPE (2, 2));
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_validate_rejects_unknown_op_naming_op_and_node)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SHAPE (2)), y = s_value (g, "y");
    s_node (g, "Foo", "mystery", IDX (x), IDX (y));
    s_output (g, y);
    s_validate_fails (g, KILN_EUNSUPPORTED, "unsupported op 'Foo'", "node 'mystery'", NULL);
    ck_assert (!kiln_graph_op_supported ("Foo"));
    ck_assert (!kiln_graph_op_supported ("Constant"));
    ck_assert (kiln_graph_op_supported ("Conv"));
    ck_assert (kiln_graph_op_supported ("GlobalAveragePool"));
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_validate_rejects_add_shape_mismatch)
{
    kiln_graph_t *g = kiln_graph_new ();
    int a = s_input (g, "a", SHAPE (2, 3)), b = s_input (g, "b", SHAPE (4)), y = s_value (g, "y");
    s_node (g, "Add", "add1", IDX (a, b), IDX (y));
    s_output (g, y);
    s_validate_fails (g, KILN_ESHAPE, "node 'add1' (Add)", "cannot broadcast", "[2, 3]", "[4]",
                      NULL);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_validate_rejects_add_of_float32_and_int64)
{
    kiln_graph_t *g = kiln_graph_new ();
    int a = s_input (g, "a", SHAPE (3));
    int b = s_weight (g, "b", KILN_DT_INT64, SHAPE (3), 0);
    int y = s_value (g, "y");
    s_node (g, "Add", "add1", IDX (a, b), IDX (y));
    s_output (g, y);
    s_validate_fails (g, KILN_ESHAPE, "node 'add1' (Add)", "float32", "int64", NULL);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_validate_rejects_conv_weight_of_wrong_rank)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SHAPE (1, 3, 8, 8));
    int w = s_weight (g, "w", KILN_DT_FLOAT32, SHAPE (4, 3, 3), 0);
    int y = s_value (g, "y");
    s_node (g, "Conv", "conv1", IDX (x, w), IDX (y));
    s_output (g, y);
    s_validate_fails (g, KILN_ESHAPE, "node 'conv1' (Conv): input 'w' has rank 3, expected 4",
                      NULL);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_validate_rejects_missing_inputs)
{
    /* Too few inputs for the op. */
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SHAPE (2)), y = s_value (g, "y");
    s_node (g, "Add", "add1", IDX (x), IDX (y));
    s_output (g, y);
    s_validate_fails (g, KILN_EINVAL, "node 'add1' (Add)", "1 input", "expected 2", NULL);
    kiln_graph_destroy (&g);

    /* An input nothing provides. */
    g = kiln_graph_new ();
    x = s_input (g, "x", SHAPE (2));
    int ghost = s_value (g, "ghost");
    y = s_value (g, "y");
    s_node (g, "Add", "add2", IDX (x, ghost), IDX (y));
    s_output (g, y);
    s_validate_fails (g, KILN_EINVAL, "node 'add2' (Add)", "'ghost'", NULL);
    kiln_graph_destroy (&g);

    /* A required input marked absent. */
    g = kiln_graph_new ();
    x = s_input (g, "x", SHAPE (1, 1, 4, 4));
    y = s_value (g, "y");
    s_node (g, "Conv", "conv1", IDX (x, -1), IDX (y));
    s_output (g, y);
    s_validate_fails (g, KILN_EINVAL, "node 'conv1' (Conv)", "required input 1", NULL);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_validate_rejects_cycle)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SHAPE (2));
    int a = s_value (g, "a"), b = s_value (g, "b"), y = s_value (g, "y");
    s_node (g, "Add", "first", IDX (x, b), IDX (a));
    s_node (g, "Relu", "second", IDX (a), IDX (b));
    s_node (g, "Relu", "out", IDX (b), IDX (y));
    s_output (g, y);
    s_validate_fails (g, KILN_EINVAL, "cycle", "node 'first' (Add)", "node 'second' (Relu)", NULL);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_validate_rejects_structural_errors)
{
    /* A graph output that no node produces. */
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SHAPE (2));
    int y = s_value (g, "y"), z = s_value (g, "z");
    s_node (g, "Relu", "r", IDX (x), IDX (y));
    s_output (g, z);
    s_validate_fails (g, KILN_EINVAL, "graph output 'z' is not produced", NULL);
    kiln_graph_destroy (&g);

    /* A tensor produced twice. */
    g = kiln_graph_new ();
    x = s_input (g, "x", SHAPE (2));
    y = s_value (g, "y");
    s_node (g, "Relu", "r1", IDX (x), IDX (y));
    s_node (g, "Relu", "r2", IDX (x), IDX (y));
    s_output (g, y);
    s_validate_fails (g, KILN_EINVAL, "'y' is produced twice", "node 'r1'", "node 'r2'", NULL);
    kiln_graph_destroy (&g);

    /* A graph input without a shape. */
    g = kiln_graph_new ();
    kiln_err_t err = { 0 };
    x = kiln_graph_add_tensor (g, "x", KILN_DT_FLOAT32, NULL, &err);
    kiln_graph_add_input (g, x, &err);
    y = s_value (g, "y");
    s_node (g, "Relu", "r", IDX (x), IDX (y));
    s_output (g, y);
    s_validate_fails (g, KILN_EINVAL, "graph input 'x'", "unknown shape", NULL);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_validate_leaves_graph_unchanged_on_failure)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SHAPE (2, 3));
    int b = s_input (g, "b", SHAPE (5));
    int r = s_value (g, "r"), y = s_value (g, "y");
    s_node (g, "Add", "bad", IDX (r, b), IDX (y));     /* fails: [2,3] + [5] */
    s_node (g, "Relu", "ok", IDX (x), IDX (r));
    s_output (g, y);
    uint8_t *before, *after;
    size_t blen, alen;
    s_encode (g, &before, &blen);
    s_validate_fails (g, KILN_ESHAPE, "node 'bad'", NULL);
    s_encode (g, &after, &alen);
    ck_assert_uint_eq (blen, alen);
    ck_assert_mem_eq (before, after, blen);
    ck_assert_int_eq (g->tensors[r].shape.rank, -1);
    ck_assert_str_eq (g->nodes[0].name, "bad");
    free (before);
    free (after);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_validate_rejects_output_that_contradicts_declaration)
{
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err = { 0 };
    int x = s_input (g, "x", SHAPE (2, 3));
    kiln_shape_t wrong = SHAPE (3, 2);
    int y = kiln_graph_add_tensor (g, "y", KILN_DT_FLOAT32, &wrong, &err);
    s_node (g, "Relu", "r", IDX (x), IDX (y));
    s_output (g, y);
    s_validate_fails (g, KILN_ESHAPE, "node 'r' (Relu)", "declared float32 [3, 2]",
                      "inferred float32 [2, 3]", NULL);
    kiln_graph_destroy (&g);
}
END_TEST

/* --- shape inference ----------------------------------------------- */

/* One Conv over x with weight shape w; attributes set by the caller via
 * the returned node index before s_validate_ok. */
static kiln_graph_t *
s_conv_graph (kiln_shape_t x, kiln_shape_t w, bool bias, int *node, int *out)
{
    kiln_graph_t *g = kiln_graph_new ();
    int xi = s_input (g, "x", x);
    int wi = s_weight (g, "w", KILN_DT_FLOAT32, w, 0);
    *out = s_value (g, "y");
    if (bias) {
        int bi = s_weight (g, "b", KILN_DT_FLOAT32, SHAPE (w.dims[0]), 0);
        *node = s_node (g, "Conv", "conv", IDX (xi, wi, bi), out, 1);
    }
    else
        *node = s_node (g, "Conv", "conv", IDX (xi, wi), out, 1);
    s_output (g, *out);
    return g;
}

START_TEST (test_infer_conv_shapes)
{
    int n, y;
    /* out = floor((in + pad_begin + pad_end - ((k - 1) * d + 1)) / s) + 1
     * H: (32 + 1 + 1 - 5) / 2 + 1 = 15;  W: d=2, ek=9: (32 + 2 + 2 - 9) / 2 + 1 = 14 */
    kiln_graph_t *g = s_conv_graph (SHAPE (1, 3, 32, 32), SHAPE (8, 3, 5, 5), true, &n, &y);
    s_ints (g, n, "strides", 2, 2, 2);
    s_ints (g, n, "pads", 4, 1, 2, 1, 2);
    s_ints (g, n, "dilations", 2, 1, 2);
    s_validate_ok (g);
    s_assert_shape (g, y, SHAPE (1, 8, 15, 14));
    kiln_graph_destroy (&g);

    /* group 3: W is [M, C/group, kh, kw] = [6, 2, 3, 3]; (10 - 3) / 1 + 1 = 8 */
    g = s_conv_graph (SHAPE (2, 6, 10, 10), SHAPE (6, 2, 3, 3), false, &n, &y);
    s_int (g, n, "group", 3);
    s_validate_ok (g);
    s_assert_shape (g, y, SHAPE (2, 6, 8, 8));
    kiln_graph_destroy (&g);

    /* 1-D: (50 + 3 + 3 - 7) / 3 + 1 = 17 */
    g = s_conv_graph (SHAPE (1, 4, 50), SHAPE (16, 4, 7), true, &n, &y);
    s_ints (g, n, "strides", 1, 3);
    s_ints (g, n, "pads", 2, 3, 3);
    s_ints (g, n, "kernel_shape", 1, 7);
    s_validate_ok (g);
    s_assert_shape (g, y, SHAPE (1, 16, 17));
    kiln_graph_destroy (&g);

    /* SAME_UPPER / SAME_LOWER: out = ceil(in / s) = ceil(8 / 2) = 4; total
     * pad = (4 - 1) * 2 + 3 - 8 = 1, the odd one at the end (UPPER) or the
     * start (LOWER).  VALID: (8 - 3) / 2 + 1 = 3. */
    const char *modes[] = { "SAME_UPPER", "SAME_LOWER", "VALID" };
    int64_t want[] = { 4, 4, 3 };
    int64_t pad_begin[] = { 0, 1, 0 }, pad_end[] = { 1, 0, 0 };
    for (int i = 0; i < 3; i++) {
        g = s_conv_graph (SHAPE (1, 1, 8, 8), SHAPE (2, 1, 3, 3), false, &n, &y);
        s_ints (g, n, "strides", 2, 2, 2);
        s_str (g, n, "auto_pad", modes[i]);
        s_validate_ok (g);
        s_assert_shape (g, y, SHAPE (1, 2, want[i], want[i]));
        kiln_window_t w;
        kiln_err_t err = { 0 };
        ck_assert_int_eq (kiln_graph_window (g, 0, &w, &err), 0);
        ck_assert_int_eq (w.n, 2);
        ck_assert_int_eq (w.kernel[0], 3);
        ck_assert_int_eq (w.strides[1], 2);
        ck_assert_int_eq (w.pads[0], pad_begin[i]);
        ck_assert_int_eq (w.pads[1], pad_begin[i]);
        ck_assert_int_eq (w.pads[2], pad_end[i]);
        ck_assert_int_eq (w.pads[3], pad_end[i]);
        kiln_graph_destroy (&g);
    }

    /* Errors: channel mismatch, bias of the wrong size, kernel too big. */
    g = s_conv_graph (SHAPE (1, 3, 8, 8), SHAPE (4, 2, 3, 3), false, &n, &y);
    s_validate_fails (g, KILN_ESHAPE, "node 'conv' (Conv)", "input channels", NULL);
    kiln_graph_destroy (&g);
    g = kiln_graph_new ();
    int x = s_input (g, "x", SHAPE (1, 3, 8, 8));
    int w = s_weight (g, "w", KILN_DT_FLOAT32, SHAPE (4, 3, 3, 3), 0);
    int b = s_weight (g, "b", KILN_DT_FLOAT32, SHAPE (5), 0);
    y = s_value (g, "y");
    s_node (g, "Conv", "conv", IDX (x, w, b), IDX (y));
    s_output (g, y);
    s_validate_fails (g, KILN_ESHAPE, "input 'b' [5]", NULL);
    kiln_graph_destroy (&g);
    g = s_conv_graph (SHAPE (1, 1, 2, 2), SHAPE (1, 1, 3, 3), false, &n, &y);
    s_validate_fails (g, KILN_ESHAPE, "spatial axis 0", NULL);
    kiln_graph_destroy (&g);
}
END_TEST

static kiln_graph_t *
s_pool_graph (kiln_shape_t x, int *node, int *out)
{
    kiln_graph_t *g = kiln_graph_new ();
    int xi = s_input (g, "x", x);
    *out = s_value (g, "y");
    *node = s_node (g, "MaxPool", "pool", &xi, 1, out, 1);
    s_output (g, *out);
    return g;
}

START_TEST (test_infer_maxpool_shapes)
{
    int n, y;
    /* floor((32 - 3) / 2) + 1 = 15 */
    kiln_graph_t *g = s_pool_graph (SHAPE (1, 3, 32, 32), &n, &y);
    s_ints (g, n, "kernel_shape", 2, 3, 3);
    s_ints (g, n, "strides", 2, 2, 2);
    s_validate_ok (g);
    s_assert_shape (g, y, SHAPE (1, 3, 15, 15));
    kiln_graph_destroy (&g);

    /* ceil_mode: ceil((32 - 3) / 2) + 1 = 16 */
    g = s_pool_graph (SHAPE (1, 3, 32, 32), &n, &y);
    s_ints (g, n, "kernel_shape", 2, 3, 3);
    s_ints (g, n, "strides", 2, 2, 2);
    s_int (g, n, "ceil_mode", 1);
    s_validate_ok (g);
    s_assert_shape (g, y, SHAPE (1, 3, 16, 16));
    kiln_graph_destroy (&g);

    /* ceil_mode whose last window would start in the end padding:
     * ceil((5 + 1 + 1 - 2) / 2) + 1 = 4, but (4 - 1) * 2 = 6 >= 5 + 1, so
     * 3 (as torch.nn.MaxPool1d(2, 2, 1, ceil_mode=True) gives). */
    g = s_pool_graph (SHAPE (1, 1, 5), &n, &y);
    s_ints (g, n, "kernel_shape", 1, 2);
    s_ints (g, n, "strides", 1, 2);
    s_ints (g, n, "pads", 2, 1, 1);
    s_int (g, n, "ceil_mode", 1);
    s_validate_ok (g);
    s_assert_shape (g, y, SHAPE (1, 1, 3));
    kiln_graph_destroy (&g);

    /* dilations 2 (ek = 5), asymmetric pads: H (10 + 0 + 1 - 5) / 1 + 1 = 7,
     * W (9 + 2 + 1 - 5) / 3 + 1 = 3 */
    g = s_pool_graph (SHAPE (2, 4, 10, 9), &n, &y);
    s_ints (g, n, "kernel_shape", 2, 3, 3);
    s_ints (g, n, "dilations", 2, 2, 2);
    s_ints (g, n, "strides", 2, 1, 3);
    s_ints (g, n, "pads", 4, 0, 2, 1, 1);
    s_validate_ok (g);
    s_assert_shape (g, y, SHAPE (2, 4, 7, 3));
    kiln_graph_destroy (&g);

    /* Pads as wide as the kernel: a window of padding alone, whose max
     * is -inf.  Refused, as ONNX Runtime does (issue 14, finding 10),
     * at the begin and at the end; one less is fine. */
    g = s_pool_graph (SHAPE (1, 1, 7, 7), &n, &y);
    s_ints (g, n, "kernel_shape", 2, 2, 2);
    s_ints (g, n, "pads", 4, 2, 0, 0, 0);
    s_validate_fails (g, KILN_EFORMAT, "'pads'[0] is 2, not smaller than the kernel", "'pool'", NULL);
    kiln_graph_destroy (&g);
    g = s_pool_graph (SHAPE (1, 1, 7, 7), &n, &y);
    s_ints (g, n, "kernel_shape", 2, 3, 3);
    s_ints (g, n, "pads", 4, 0, 0, 0, 5);
    s_validate_fails (g, KILN_EFORMAT, "'pads'[3] is 5", "spatial axis 1", NULL);
    kiln_graph_destroy (&g);
    g = s_pool_graph (SHAPE (1, 1, 7, 7), &n, &y);
    s_ints (g, n, "kernel_shape", 2, 3, 3);
    s_ints (g, n, "pads", 4, 2, 2, 2, 2);
    s_validate_ok (g);
    kiln_graph_destroy (&g);

    /* SAME_UPPER: ceil(7 / 2) = 4 */
    g = s_pool_graph (SHAPE (1, 1, 7, 7), &n, &y);
    s_ints (g, n, "kernel_shape", 2, 3, 3);
    s_ints (g, n, "strides", 2, 2, 2);
    s_str (g, n, "auto_pad", "SAME_UPPER");
    s_validate_ok (g);
    s_assert_shape (g, y, SHAPE (1, 1, 4, 4));
    kiln_graph_destroy (&g);

    /* kernel_shape is required. */
    g = s_pool_graph (SHAPE (1, 1, 7, 7), &n, &y);
    s_validate_fails (g, KILN_EFORMAT, "node 'pool' (MaxPool)", "kernel_shape", NULL);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_maxpool_rejects_indices_output)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SHAPE (1, 1, 4, 4));
    int y = s_value (g, "y"), idx = s_value (g, "idx");
    int n = s_node (g, "MaxPool", "pool7", IDX (x), IDX (y, idx));
    s_ints (g, n, "kernel_shape", 2, 2, 2);
    s_output (g, y);
    s_validate_fails (g, KILN_EUNSUPPORTED, "node 'pool7' (MaxPool)", "Indices", NULL);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_infer_gemm_shapes)
{
    struct {
        kiln_shape_t a, b, c;
        int ta, tb;
        kiln_shape_t want;      /* rank -1: expect a shape error */
    } cases[] = {
        /* M = A[0], K = A[1]; K = B[0], N = B[1] */
        { SHAPE (2, 3), SHAPE (3, 4), { .rank = -1 }, 0, 0, SHAPE (2, 4) },
        /* transA: A is [K, M] = [4, 3]; transB: B is [N, K] = [5, 4] */
        { SHAPE (4, 3), SHAPE (5, 4), SHAPE (5), 1, 1, SHAPE (3, 5) },
        { SHAPE (4, 3), SHAPE (4, 5), SHAPE (3, 1), 1, 0, SHAPE (3, 5) },
        { SHAPE (2, 3), SHAPE (3, 4), s_scalar, 0, 0, SHAPE (2, 4) },
        { SHAPE (2, 3), SHAPE (4, 3), { .rank = -1 }, 0, 0, { .rank = -1 } },
        { SHAPE (2, 3), SHAPE (3, 4), SHAPE (3, 4), 0, 0, { .rank = -1 } },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_graph_t *g = kiln_graph_new ();
        int a = s_input (g, "a", cases[i].a);
        int b = s_weight (g, "b", KILN_DT_FLOAT32, cases[i].b, 0);
        int y = s_value (g, "y"), n;
        if (cases[i].c.rank >= 0) {
            int c = s_weight (g, "c", KILN_DT_FLOAT32, cases[i].c, 0);
            n = s_node (g, "Gemm", "fc", IDX (a, b, c), IDX (y));
        }
        else
            n = s_node (g, "Gemm", "fc", IDX (a, b), IDX (y));
        s_int (g, n, "transA", cases[i].ta);
        s_int (g, n, "transB", cases[i].tb);
        s_output (g, y);
        if (cases[i].want.rank >= 0) {
            s_validate_ok (g);
            s_assert_shape (g, y, cases[i].want);
        }
        else
            s_validate_fails (g, KILN_ESHAPE, "node 'fc' (Gemm)", NULL);
        kiln_graph_destroy (&g);
    }
}
END_TEST

START_TEST (test_infer_matmul_shapes)
{
    struct { kiln_shape_t a, b, want; } cases[] = {
        { SHAPE (3), SHAPE (3), { .rank = 0 } },                /* dot product */
        { SHAPE (3), SHAPE (3, 4), SHAPE (4) },                 /* row vector */
        { SHAPE (2, 3), SHAPE (3), SHAPE (2) },                 /* column vector */
        { SHAPE (2, 3), SHAPE (3, 4), SHAPE (2, 4) },
        /* batch [2, 1] with [5] broadcasts to [2, 5] */
        { SHAPE (2, 1, 4, 3), SHAPE (5, 3, 6), SHAPE (2, 5, 4, 6) },
        { SHAPE (7, 2, 3), SHAPE (3), SHAPE (7, 2) },
        { SHAPE (2, 3), SHAPE (4, 5), { .rank = -1 } },         /* K differs */
        { SHAPE (2, 2, 3), SHAPE (3, 3, 4), { .rank = -1 } },   /* batch 2 vs 3 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_graph_t *g = kiln_graph_new ();
        int a = s_input (g, "a", cases[i].a), b = s_input (g, "b", cases[i].b);
        int y = s_value (g, "y");
        s_node (g, "MatMul", "mm", IDX (a, b), IDX (y));
        s_output (g, y);
        if (cases[i].want.rank >= 0) {
            s_validate_ok (g);
            s_assert_shape (g, y, cases[i].want);
        }
        else
            s_validate_fails (g, KILN_ESHAPE, "node 'mm' (MatMul)", NULL);
        kiln_graph_destroy (&g);
    }
}
END_TEST

START_TEST (test_infer_flatten_shapes)
{
    /* [prod(d[0..axis)), prod(d[axis..r))] for x = [2, 3, 4, 5] */
    struct { int64_t axis; kiln_shape_t want; } cases[] = {
        { 0, SHAPE (1, 120) }, { 1, SHAPE (2, 60) }, { 2, SHAPE (6, 20) },
        { 4, SHAPE (120, 1) }, { -1, SHAPE (24, 5) }, { -4, SHAPE (1, 120) },
        { 5, { .rank = -1 } }, { -5, { .rank = -1 } },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_graph_t *g = kiln_graph_new ();
        int x = s_input (g, "x", SHAPE (2, 3, 4, 5)), y = s_value (g, "y");
        int n = s_node (g, "Flatten", "flat", IDX (x), IDX (y));
        s_int (g, n, "axis", cases[i].axis);
        s_output (g, y);
        if (cases[i].want.rank >= 0) {
            s_validate_ok (g);
            s_assert_shape (g, y, cases[i].want);
        }
        else
            s_validate_fails (g, KILN_EFORMAT, "node 'flat' (Flatten)", "'axis'", NULL);
        kiln_graph_destroy (&g);
    }
}
END_TEST

START_TEST (test_infer_reshape_shapes)
{
    struct {
        kiln_shape_t x;
        int64_t shape[4];
        int n;
        int allowzero;
        kiln_shape_t want;      /* rank -1: expect an error */
    } cases[] = {
        { SHAPE (2, 3, 4), { 0, -1 }, 2, 0, SHAPE (2, 12) },        /* 0 copies d0 */
        { SHAPE (2, 3, 4), { 4, 0, -1 }, 3, 0, SHAPE (4, 3, 2) },   /* 0 copies d1 */
        { SHAPE (2, 3, 4), { -1 }, 1, 0, SHAPE (24) },
        { SHAPE (2, 3, 4), { 6, 4 }, 2, 0, SHAPE (6, 4) },
        { SHAPE (0, 3), { 3, 0 }, 2, 1, SHAPE (3, 0) },             /* literal 0 */
        { SHAPE (2, 3, 4), { 5, -1 }, 2, 0, { .rank = -1 } },       /* 24 % 5 */
        { SHAPE (2, 3, 4), { -1, -1 }, 2, 0, { .rank = -1 } },
        { SHAPE (2, 3, 4), { 6, 5 }, 2, 0, { .rank = -1 } },
        { SHAPE (2, 3), { 2, 3, 0 }, 3, 0, { .rank = -1 } },        /* 0 past rank */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_graph_t *g = kiln_graph_new ();
        int x = s_input (g, "x", cases[i].x);
        int s = s_int64s (g, "shape", cases[i].shape, cases[i].n);
        int y = s_value (g, "y");
        int n = s_node (g, "Reshape", "rs", IDX (x, s), IDX (y));
        if (cases[i].allowzero)
            s_int (g, n, "allowzero", 1);
        s_output (g, y);
        if (cases[i].want.rank >= 0) {
            s_validate_ok (g);
            s_assert_shape (g, y, cases[i].want);
        }
        else
            s_validate_fails (g, KILN_ESHAPE, "node 'rs' (Reshape)", NULL);
        kiln_graph_destroy (&g);
    }

    /* A shape computed at run time is not supported. */
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SHAPE (2, 3));
    kiln_err_t err = { 0 };
    kiln_shape_t one = SHAPE (2);
    int s = kiln_graph_add_tensor (g, "dyn", KILN_DT_INT64, &one, &err);
    kiln_graph_add_input (g, s, &err);
    int y = s_value (g, "y");
    s_node (g, "Reshape", "rs", IDX (x, s), IDX (y));
    s_output (g, y);
    s_validate_fails (g, KILN_EUNSUPPORTED, "node 'rs' (Reshape)", "'dyn'", NULL);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_infer_elementwise_and_pool_shapes)
{
    kiln_graph_t *g = kiln_graph_new ();
    int a = s_input (g, "a", SHAPE (8, 1, 6, 1)), b = s_input (g, "b", SHAPE (7, 1, 5));
    int p = s_value (g, "p"), q = s_value (g, "q"), r = s_value (g, "r"), s = s_value (g, "s");
    int gp = s_value (g, "gp"), id = s_value (g, "id");
    s_node (g, "Mul", "mul", IDX (a, b), IDX (p));      /* numpy: [8, 7, 6, 5] */
    s_node (g, "Sub", "sub", IDX (p, a), IDX (q));
    s_node (g, "Div", "div", IDX (q, q), IDX (r));
    s_node (g, "Relu", "relu", IDX (r), IDX (s));
    s_node (g, "GlobalAveragePool", "gap", IDX (s), IDX (gp));
    s_node (g, "Identity", "id", IDX (gp), IDX (id));
    s_output (g, id);
    s_validate_ok (g);
    s_assert_shape (g, p, SHAPE (8, 7, 6, 5));
    s_assert_shape (g, r, SHAPE (8, 7, 6, 5));
    s_assert_shape (g, gp, SHAPE (8, 7, 1, 1));
    s_assert_shape (g, id, SHAPE (8, 7, 1, 1));
    kiln_graph_destroy (&g);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("graph");
    TCase *tc = tcase_create ("core");
    tcase_set_timeout (tc, 120);
    tcase_add_test (tc, test_set_weight_rejects_wrong_byte_count);
    tcase_add_test (tc, test_node_set_replaces_attribute_of_same_name);
    tcase_add_test (tc, test_add_node_rejects_out_of_range_tensor);
    tcase_add_test (tc, test_encode_decode_round_trip_is_identical);
    tcase_add_test (tc, test_encoding_names_format_and_version);
    tcase_add_test (tc, test_decode_rejects_every_truncation);
    tcase_add_test (tc, test_decode_survives_random_byte_flips);
    tcase_add_test (tc, test_decode_rejects_random_garbage);
    tcase_add_test (tc, test_decode_rejects_out_of_range_indices_and_versions);
    tcase_add_test (tc, test_decode_rejects_huge_counts_without_allocating);
    tcase_add_test (tc, test_attach_blob_checks_hash_and_size);
    tcase_add_test (tc, test_save_load_round_trip_keeps_weights);
    tcase_add_test (tc, test_save_writes_identical_blobs_once);
    tcase_add_test (tc, test_blob_heads_align_data_and_parse_as_msgpack);
    tcase_add_test (tc, test_load_maps_large_blobs_aligned_for_their_type);
    tcase_add_test (tc, test_map_weight_reads_elements_at_an_unaligned_offset);
    tcase_add_test (tc, test_load_names_tensor_whose_blob_is_missing);
    tcase_add_test (tc, test_load_rejects_corrupt_or_truncated_file);
    tcase_add_test (tc, test_save_refuses_graph_without_weight_data);
    tcase_add_test (tc, test_digest_same_for_graph_built_twice);
    tcase_add_test (tc, test_digest_ignores_internal_names);
    tcase_add_test (tc, test_digest_ignores_attribute_order_and_validation);
    tcase_add_test (tc, test_digest_changes_when_one_weight_byte_changes);
    tcase_add_test (tc, test_digest_changes_when_an_attribute_changes);
    tcase_add_test (tc, test_digest_keeps_interface_names);
    tcase_add_test (tc, test_io_structure_round_trips_through_the_codec);
    tcase_add_test (tc, test_digest_counts_io_structure_only_when_present);
    tcase_add_test (tc, test_io_structure_over_the_bound_or_not_utf8_is_refused);
    tcase_add_test (tc, test_validate_infers_cnn_and_keeps_order);
    tcase_add_test (tc, test_validate_sorts_nodes_topologically);
    tcase_add_test (tc, test_validate_rejects_unknown_op_naming_op_and_node);
    tcase_add_test (tc, test_validate_rejects_add_shape_mismatch);
    tcase_add_test (tc, test_validate_rejects_add_of_float32_and_int64);
    tcase_add_test (tc, test_validate_rejects_conv_weight_of_wrong_rank);
    tcase_add_test (tc, test_validate_rejects_missing_inputs);
    tcase_add_test (tc, test_validate_rejects_cycle);
    tcase_add_test (tc, test_validate_rejects_structural_errors);
    tcase_add_test (tc, test_validate_leaves_graph_unchanged_on_failure);
    tcase_add_test (tc, test_validate_rejects_output_that_contradicts_declaration);
    tcase_add_test (tc, test_infer_conv_shapes);
    tcase_add_test (tc, test_infer_maxpool_shapes);
    tcase_add_test (tc, test_maxpool_rejects_indices_output);
    tcase_add_test (tc, test_infer_gemm_shapes);
    tcase_add_test (tc, test_infer_matmul_shapes);
    tcase_add_test (tc, test_infer_flatten_shapes);
    tcase_add_test (tc, test_infer_reshape_shapes);
    tcase_add_test (tc, test_infer_elementwise_and_pool_shapes);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run (s_suite ());
}
