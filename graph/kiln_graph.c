/*
 * kiln_graph — building the IR, its msgpack codec, .kgraph files, and the
 * canonical encoding behind the graph digest.
 *
 * Validation and shape inference live in kiln_graph_infer.c.  The format
 * written here is described field by field in docs/graph-format.md; keep
 * the two in step.
 *
 * Everything that decodes input (kiln_graph_decode, kiln_graph_load) treats
 * the bytes as hostile: each count, string and dimension is checked against
 * kiln_limits.h before memory is allocated for it, and every index is
 * range-checked before it is stored, so that a malformed structure is an
 * error and never a crash.
 */
#include "graph/kiln_graph.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <msgpack.h>

#include "common/kiln_fs.h"
#include "common/kiln_mpk.h"

#define S_FORMAT          "kiln-graph"
#define S_CANON_FORMAT    "kiln-graph-canonical"
/* A string attribute is at most this many bytes (kiln_limits.h has no
 * bound of its own for it; ONNX string attributes are short words such as
 * "SAME_UPPER"). */
#define S_MAX_ATTR_STRING KILN_MAX_ATTR_ELEMS
/* Nesting allowed in a msgpack structure; the deepest kiln record (an
 * attribute's int list) is at depth 6. */
#define S_MAX_DEPTH       16
/* Fields in a .kgraph header map, and the longest key or format string. */
#define S_MAX_HEADER_KEYS 16
#define S_MAX_HEADER_STR  64

/* --- small helpers ------------------------------------------------- */

/* Copy `s` (NULL reads as "") into a fresh heap string of at most `max`
 * bytes; `what` names the string in the error. */
static int
s_strdup_max (const char *s, size_t max, const char *what, char **out,
              kiln_err_t *err)
{
    if (!s)
        s = "";
    size_t n = strnlen (s, max + 1);
    if (n > max)
        return kiln_error (err, KILN_ELIMIT, "%s '%.32s...' is longer than %zu bytes",
                           what, s, max);
    *out = malloc (n + 1);
    if (!*out)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    memcpy (*out, s, n);
    (*out)[n] = '\0';
    return 0;
}

/* Make room for `need` elements of `elem` bytes in *arr (capacity *cap),
 * doubling so that appends stay amortised O(1).  More than `max` elements
 * is a KILN_ELIMIT error naming `what`. */
static int
s_reserve (void **arr, int *cap, int need, size_t elem, int max,
           const char *what, kiln_err_t *err)
{
    if (need > max)
        return kiln_error (err, KILN_ELIMIT, "graph has more than %d %s", max, what);
    if (need <= *cap)
        return 0;
    int64_t ncap = *cap < 16 ? 16 : 2 * (int64_t) *cap;
    if (ncap < need)
        ncap = need;
    if (ncap > max)
        ncap = max;
    void *p = realloc (*arr, (size_t) ncap * elem);
    if (!p)
        return kiln_error (err, KILN_ENOMEM, "out of memory for %d %s", need, what);
    *arr = p;
    *cap = (int) ncap;
    return 0;
}

static void
s_attr_release (kiln_attr_t *a)
{
    free (a->name);
    free (a->s);
    free (a->ints);
    free (a->floats);
    memset (a, 0, sizeof *a);
}

static void
s_node_release (kiln_node_t *node)
{
    free (node->name);
    free (node->op);
    free (node->inputs);
    free (node->outputs);
    for (int i = 0; i < node->n_attrs; i++)
        s_attr_release (&node->attrs[i]);
    free (node->attrs);
    memset (node, 0, sizeof *node);
}

/* How messages name tensor `t`: 'x', or #12 when it has no name. */
static const char *
s_tensor_label (const kiln_graph_t *g, int t, char *buf, size_t size)
{
    const char *name = g->tensors[t].name;
    if (name && *name)
        snprintf (buf, size, "'%s'", name);
    else
        snprintf (buf, size, "#%d", t);
    return buf;
}

/* The first tensor backed by weight `w`, or -1 when none is. */
static int
s_weight_tensor (const kiln_graph_t *g, int w)
{
    for (int t = 0; t < g->n_tensors; t++)
        if (g->tensors[t].weight == w)
            return t;
    return -1;
}

/* Check that every index the struct holds is in range.  The functions
 * here keep this invariant, but the struct is transparent, so the encoders
 * check it before they follow any index. */
static int
s_check_indices (const kiln_graph_t *g, kiln_err_t *err)
{
    for (int t = 0; t < g->n_tensors; t++) {
        int w = g->tensors[t].weight;
        if (w < -1 || w >= g->n_weights)
            return kiln_error (err, KILN_EINVAL, "tensor #%d: weight index %d out of range",
                               t, w);
    }
    for (int n = 0; n < g->n_nodes; n++) {
        const kiln_node_t *node = &g->nodes[n];
        for (int i = 0; i < node->n_inputs; i++)
            if (node->inputs[i] < -1 || node->inputs[i] >= g->n_tensors)
                return kiln_error (err, KILN_EINVAL, "node #%d: input %d is tensor index %d, out of range",
                                   n, i, node->inputs[i]);
        for (int i = 0; i < node->n_outputs; i++)
            if (node->outputs[i] < 0 || node->outputs[i] >= g->n_tensors)
                return kiln_error (err, KILN_EINVAL, "node #%d: output %d is tensor index %d, out of range",
                                   n, i, node->outputs[i]);
    }
    for (int i = 0; i < g->n_inputs; i++)
        if (g->inputs[i] < 0 || g->inputs[i] >= g->n_tensors)
            return kiln_error (err, KILN_EINVAL, "graph input %d is tensor index %d, out of range",
                               i, g->inputs[i]);
    for (int i = 0; i < g->n_outputs; i++)
        if (g->outputs[i] < 0 || g->outputs[i] >= g->n_tensors)
            return kiln_error (err, KILN_EINVAL, "graph output %d is tensor index %d, out of range",
                               i, g->outputs[i]);
    return 0;
}

/* --- a bounded output buffer for msgpack_packer -------------------- */

/* msgpack_sbuffer grows without bound and its errors are easy to lose in
 * a long run of pack calls; this buffer remembers the first failure so
 * that the encoders check once at the end, and refuses to grow past
 * `max` (the size the matching decoder accepts). */
typedef struct {
    uint8_t *data;          /* owned */
    size_t len;             /* bytes written */
    size_t cap;             /* bytes allocated */
    size_t max;             /* never grow past this */
    int failed;             /* 0, or -KILN_ENOMEM / -KILN_ELIMIT */
} s_buf_t;

static int
s_buf_write (void *data, const char *buf, size_t len)
{
    s_buf_t *b = data;
    if (b->failed)
        return -1;
    if (len > b->max - b->len) {
        b->failed = -KILN_ELIMIT;
        return -1;
    }
    if (len > b->cap - b->len) {
        size_t ncap = b->cap ? b->cap : 4096;
        while (ncap - b->len < len)
            ncap = ncap > b->max / 2 ? b->max : ncap * 2;
        uint8_t *p = realloc (b->data, ncap);
        if (!p) {
            b->failed = -KILN_ENOMEM;
            return -1;
        }
        b->data = p;
        b->cap = ncap;
    }
    memcpy (b->data + b->len, buf, len);
    b->len += len;
    return 0;
}

/* Hand the buffer's bytes to the caller, or report why packing failed. */
static int
s_buf_finish (s_buf_t *b, const char *what, uint8_t **out, size_t *len,
              kiln_err_t *err)
{
    if (b->failed) {
        free (b->data);
        b->data = NULL;
        if (b->failed == -KILN_ELIMIT)
            return kiln_error (err, KILN_ELIMIT, "%s is larger than %zu bytes", what, b->max);
        return kiln_error (err, KILN_ENOMEM, "out of memory encoding %s", what);
    }
    *out = b->data;
    *len = b->len;
    b->data = NULL;
    return 0;
}

/* --- building ------------------------------------------------------ */

kiln_graph_t *
kiln_graph_new (void)
{
    return calloc (1, sizeof (kiln_graph_t));
}

void
kiln_graph_destroy (kiln_graph_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_graph_t *g = *self_p;
    for (int t = 0; t < g->n_tensors; t++)
        free (g->tensors[t].name);
    free (g->tensors);
    for (int n = 0; n < g->n_nodes; n++)
        s_node_release (&g->nodes[n]);
    free (g->nodes);
    for (int w = 0; w < g->n_weights; w++)
        kiln_weight_release (&g->weights[w]);
    free (g->weights);
    free (g->inputs);
    free (g->outputs);
    free (g->io_structure);
    free (g);
    *self_p = NULL;
}

int
kiln_graph_add_tensor (kiln_graph_t *g, const char *name, kiln_dtype_t dt,
                       const kiln_shape_t *shape, kiln_err_t *err)
{
    if (dt != KILN_DT_UNDEFINED && !kiln_dtype_valid ((int) dt))
        return kiln_error (err, KILN_EINVAL, "tensor '%s': unknown dtype %d",
                           name ? name : "", (int) dt);
    kiln_shape_t sh = { .rank = -1 };
    if (shape && shape->rank >= 0) {
        int64_t numel;
        int rc = kiln_shape_numel (shape, name ? name : "", &numel, err);
        if (rc)
            return rc;
        sh = *shape;
    }
    int rc = s_reserve ((void **) &g->tensors, &g->cap_tensors, g->n_tensors + 1,
                        sizeof *g->tensors, KILN_MAX_TENSORS, "tensors", err);
    if (rc)
        return rc;
    kiln_tensor_t *t = &g->tensors[g->n_tensors];
    memset (t, 0, sizeof *t);
    rc = s_strdup_max (name, KILN_MAX_NAME, "tensor name", &t->name, err);
    if (rc)
        return rc;
    t->dtype = dt;
    t->shape = sh;
    t->weight = -1;
    return g->n_tensors++;
}

void
kiln_weight_release (kiln_weight_t *w)
{
    if (w->map.base)
        kiln_map_release (&w->map);
    else
        free (w->data);
    w->data = NULL;
}

/* kiln_graph_set_weight for bytes that are malloc'd (`map` NULL) or
 * mapped (*map, taken); `digest` NULL: hashed here. */
static int
s_set_weight (kiln_graph_t *g, int t, uint8_t *bytes, kiln_map_t *map,
              const uint8_t *digest, uint64_t size, kiln_err_t *err)
{
    int rc = 0;
    if (t < 0 || t >= g->n_tensors) {
        rc = kiln_error (err, KILN_EINVAL, "no tensor with index %d", t);
        goto err;
    }
    kiln_tensor_t *tensor = &g->tensors[t];
    char label[KILN_MAX_NAME + 8];
    s_tensor_label (g, t, label, sizeof label);
    if (!bytes && size > 0) {
        rc = kiln_error (err, KILN_EINVAL, "tensor %s: weight data is NULL", label);
        goto err;
    }
    if (!kiln_dtype_valid ((int) tensor->dtype) || tensor->shape.rank < 0) {
        rc = kiln_error (err, KILN_EINVAL, "tensor %s: a weight needs a known dtype and shape",
                         label);
        goto err;
    }
    uint64_t want;
    rc = kiln_shape_bytes (&tensor->shape, tensor->dtype, tensor->name, &want, err);
    if (rc)
        goto err;
    if (want > KILN_MAX_BLOB_BYTES) {
        rc = kiln_error (err, KILN_ELIMIT, "tensor %s: weight of %llu bytes is larger than %llu",
                         label, (unsigned long long) want,
                         (unsigned long long) KILN_MAX_BLOB_BYTES);
        goto err;
    }
    if (size != want) {
        char sbuf[160];
        rc = kiln_error (err, KILN_ESHAPE, "tensor %s: weight has %llu bytes, %s %s needs %llu",
                         label, (unsigned long long) size, kiln_dtype_name (tensor->dtype),
                         kiln_shape_str (&tensor->shape, sbuf, sizeof sbuf),
                         (unsigned long long) want);
        goto err;
    }
    if (!bytes) {
        /* An empty tensor still gets a buffer: data == NULL means "blob
         * not attached" everywhere else. */
        bytes = malloc (1);
        if (!bytes) {
            rc = kiln_error (err, KILN_ENOMEM, "out of memory");
            goto err;
        }
    }
    /* Reuse the tensor's slot when no other tensor shares it, so that a
     * pass that rewrites a constant does not leave orphan weights behind. */
    int w = tensor->weight;
    if (w >= 0 && w < g->n_weights) {
        for (int o = 0; o < g->n_tensors; o++)
            if (o != t && g->tensors[o].weight == w) {
                w = -1;
                break;
            }
    }
    else
        w = -1;
    if (w < 0) {
        rc = s_reserve ((void **) &g->weights, &g->cap_weights, g->n_weights + 1,
                        sizeof *g->weights, KILN_MAX_TENSORS, "weights", err);
        if (rc)
            goto err;
        w = g->n_weights++;
        memset (&g->weights[w], 0, sizeof g->weights[w]);
    }
    kiln_weight_t *weight = &g->weights[w];
    kiln_weight_release (weight);
    if (digest)
        memcpy (weight->digest, digest, KILN_DIGEST_LEN);
    else if (map)
        kiln_sha256_mapped (bytes, (size_t) size, weight->digest);
    else
        kiln_sha256 (bytes, (size_t) size, weight->digest);
    weight->data = bytes;
    weight->size = size;
    if (map) {
        weight->map = *map;
        memset (map, 0, sizeof *map);
    }
    tensor->weight = w;
    return 0;
err:
    if (map && map->base)
        kiln_map_release (map);
    else
        free (bytes);
    return rc;
}

int
kiln_graph_set_weight (kiln_graph_t *g, int t, uint8_t **data, uint64_t size,
                       kiln_err_t *err)
{
    uint8_t *bytes = data ? *data : NULL;
    if (data)
        *data = NULL;
    return s_set_weight (g, t, bytes, NULL, NULL, size, err);
}

int
kiln_graph_map_weight (kiln_graph_t *g, int t, int fd, uint64_t offset, uint64_t size,
                       const uint8_t *digest, kiln_err_t *err)
{
    if (size > KILN_MAX_BLOB_BYTES)
        return kiln_error (err, KILN_ELIMIT, "a weight of %llu bytes is larger than %llu",
                           (unsigned long long) size,
                           (unsigned long long) KILN_MAX_BLOB_BYTES);
    if (size == 0) {
        uint8_t *none = NULL;
        return kiln_graph_set_weight (g, t, &none, 0, err);
    }
    kiln_map_t map;
    const uint8_t *data;
    char what[KILN_MAX_NAME + 16];
    snprintf (what, sizeof what, "weight '%s'",
              t >= 0 && t < g->n_tensors && g->tensors[t].name ? g->tensors[t].name : "?");
    size_t es = t >= 0 && t < g->n_tensors ? kiln_dtype_size (g->tensors[t].dtype) : 1;
    if (es > 1 && offset % es != 0) {
        /* Mapped, the elements would sit at addresses that are not a
         * multiple of their size: read them into memory instead. */
        uint8_t *bytes = malloc ((size_t) size);
        if (!bytes)
            return kiln_error (err, KILN_ENOMEM, "out of memory for %s (%llu bytes)", what,
                               (unsigned long long) size);
        int64_t n = kiln_pread_all (fd, bytes, size, offset);
        if (n < 0 || (uint64_t) n < size) {
            free (bytes);
            return kiln_error (err, KILN_EIO, "could not read %s: %s", what,
                               n < 0 ? strerror (errno) : "the file is shorter than it was");
        }
        return s_set_weight (g, t, bytes, NULL, digest, size, err);
    }
    int rc = kiln_map_range (fd, offset, size, what, &map, &data, err);
    if (rc)
        return rc;
    return s_set_weight (g, t, (uint8_t *) data, &map, digest, size, err);
}

int
kiln_graph_add_node (kiln_graph_t *g, const char *op, const char *name,
                     const int *inputs, int n_inputs, const int *outputs,
                     int n_outputs, kiln_err_t *err)
{
    if (!op || !*op)
        return kiln_error (err, KILN_EINVAL, "node '%s': empty op type", name ? name : "");
    if (strnlen (op, KILN_MAX_OP_NAME + 1) > KILN_MAX_OP_NAME)
        return kiln_error (err, KILN_ELIMIT, "op type '%.32s...' is longer than %d bytes",
                           op, KILN_MAX_OP_NAME);
    if (n_inputs < 0 || n_inputs > KILN_MAX_NODE_IO || n_outputs < 0
        || n_outputs > KILN_MAX_NODE_IO)
        return kiln_error (err, KILN_ELIMIT, "node '%s' (%s): %d inputs and %d outputs, at most %d each",
                           name ? name : "", op, n_inputs, n_outputs, KILN_MAX_NODE_IO);
    if ((n_inputs > 0 && !inputs) || (n_outputs > 0 && !outputs))
        return kiln_error (err, KILN_EINVAL, "node '%s' (%s): NULL input or output list",
                           name ? name : "", op);
    for (int i = 0; i < n_inputs; i++)
        if (inputs[i] < -1 || inputs[i] >= g->n_tensors)
            return kiln_error (err, KILN_EINVAL, "node '%s' (%s): input %d is tensor index %d, out of range",
                               name ? name : "", op, i, inputs[i]);
    for (int i = 0; i < n_outputs; i++)
        if (outputs[i] < 0 || outputs[i] >= g->n_tensors)
            return kiln_error (err, KILN_EINVAL, "node '%s' (%s): output %d is tensor index %d, out of range",
                               name ? name : "", op, i, outputs[i]);

    int rc = s_reserve ((void **) &g->nodes, &g->cap_nodes, g->n_nodes + 1,
                        sizeof *g->nodes, KILN_MAX_NODES, "nodes", err);
    if (rc)
        return rc;
    kiln_node_t node = { 0 };
    rc = s_strdup_max (name, KILN_MAX_NAME, "node name", &node.name, err);
    if (rc)
        goto err;
    rc = s_strdup_max (op, KILN_MAX_OP_NAME, "op type", &node.op, err);
    if (rc)
        goto err;
    if (n_inputs > 0) {
        node.inputs = malloc ((size_t) n_inputs * sizeof (int));
        if (!node.inputs)
            goto nomem;
        memcpy (node.inputs, inputs, (size_t) n_inputs * sizeof (int));
    }
    if (n_outputs > 0) {
        node.outputs = malloc ((size_t) n_outputs * sizeof (int));
        if (!node.outputs)
            goto nomem;
        memcpy (node.outputs, outputs, (size_t) n_outputs * sizeof (int));
    }
    node.n_inputs = n_inputs;
    node.n_outputs = n_outputs;
    g->nodes[g->n_nodes] = node;
    return g->n_nodes++;
nomem:
    rc = kiln_error (err, KILN_ENOMEM, "out of memory");
err:
    s_node_release (&node);
    return rc;
}

/* Put the attribute `a` (whose value it owns) on node `n` under `name`,
 * replacing one of the same name.  Consumes `a`'s value in every case. */
static int
s_set_attr (kiln_graph_t *g, int n, const char *name, kiln_attr_t *a,
            kiln_err_t *err)
{
    int rc = 0;
    if (n < 0 || n >= g->n_nodes) {
        rc = kiln_error (err, KILN_EINVAL, "no node with index %d", n);
        goto err;
    }
    if (!name || !*name) {
        rc = kiln_error (err, KILN_EINVAL, "empty attribute name");
        goto err;
    }
    kiln_node_t *node = &g->nodes[n];
    for (int i = 0; i < node->n_attrs; i++) {
        kiln_attr_t *old = &node->attrs[i];
        if (strcmp (old->name, name) == 0) {
            a->name = old->name;
            old->name = NULL;
            s_attr_release (old);
            *old = *a;
            return 0;
        }
    }
    if (node->n_attrs >= KILN_MAX_ATTRS) {
        char label[KILN_MAX_NAME + KILN_MAX_OP_NAME + 32];
        rc = kiln_error (err, KILN_ELIMIT, "%s: more than %d attributes",
                         kiln_graph_node_label (g, n, label, sizeof label), KILN_MAX_ATTRS);
        goto err;
    }
    rc = s_strdup_max (name, KILN_MAX_NAME, "attribute name", &a->name, err);
    if (rc)
        goto err;
    kiln_attr_t *attrs = realloc (node->attrs, (size_t) (node->n_attrs + 1) * sizeof *attrs);
    if (!attrs) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory");
        goto err;
    }
    node->attrs = attrs;
    node->attrs[node->n_attrs++] = *a;
    return 0;
err:
    s_attr_release (a);
    return rc;
}

int
kiln_node_set_int (kiln_graph_t *g, int n, const char *name, int64_t v,
                   kiln_err_t *err)
{
    kiln_attr_t a = { .kind = KILN_ATTR_INT, .i = v };
    return s_set_attr (g, n, name, &a, err);
}

int
kiln_node_set_float (kiln_graph_t *g, int n, const char *name, double v,
                     kiln_err_t *err)
{
    /* Attributes are float32 in ONNX; rounding here keeps the encoding,
     * which writes float32, an exact round trip. */
    kiln_attr_t a = { .kind = KILN_ATTR_FLOAT, .f = (double) (float) v };
    return s_set_attr (g, n, name, &a, err);
}

int
kiln_node_set_string (kiln_graph_t *g, int n, const char *name, const char *v,
                      kiln_err_t *err)
{
    kiln_attr_t a = { .kind = KILN_ATTR_STRING };
    int rc = s_strdup_max (v, S_MAX_ATTR_STRING, "string attribute", &a.s, err);
    if (rc)
        return rc;
    return s_set_attr (g, n, name, &a, err);
}

int
kiln_node_set_ints (kiln_graph_t *g, int n, const char *name, const int64_t *v,
                    size_t count, kiln_err_t *err)
{
    if (count > KILN_MAX_ATTR_ELEMS)
        return kiln_error (err, KILN_ELIMIT, "attribute '%s': %zu elements, at most %d",
                           name ? name : "", count, KILN_MAX_ATTR_ELEMS);
    if (count > 0 && !v)
        return kiln_error (err, KILN_EINVAL, "attribute '%s': NULL values", name ? name : "");
    kiln_attr_t a = { .kind = KILN_ATTR_INTS, .n = count };
    a.ints = malloc (count ? count * sizeof *a.ints : 1);
    if (!a.ints)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    if (count)
        memcpy (a.ints, v, count * sizeof *a.ints);
    return s_set_attr (g, n, name, &a, err);
}

int
kiln_node_set_floats (kiln_graph_t *g, int n, const char *name, const double *v,
                      size_t count, kiln_err_t *err)
{
    if (count > KILN_MAX_ATTR_ELEMS)
        return kiln_error (err, KILN_ELIMIT, "attribute '%s': %zu elements, at most %d",
                           name ? name : "", count, KILN_MAX_ATTR_ELEMS);
    if (count > 0 && !v)
        return kiln_error (err, KILN_EINVAL, "attribute '%s': NULL values", name ? name : "");
    kiln_attr_t a = { .kind = KILN_ATTR_FLOATS, .n = count };
    a.floats = malloc (count ? count * sizeof *a.floats : 1);
    if (!a.floats)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    for (size_t i = 0; i < count; i++)
        a.floats[i] = (double) (float) v[i];
    return s_set_attr (g, n, name, &a, err);
}

/* Append tensor `t` to a graph input or output list. */
static int
s_add_io (kiln_graph_t *g, int **list, int *n, int t, const char *what,
          kiln_err_t *err)
{
    if (t < 0 || t >= g->n_tensors)
        return kiln_error (err, KILN_EINVAL, "graph %s: no tensor with index %d", what, t);
    if (*n >= KILN_MAX_GRAPH_IO)
        return kiln_error (err, KILN_ELIMIT, "graph has more than %d %ss",
                           KILN_MAX_GRAPH_IO, what);
    int *p = realloc (*list, (size_t) (*n + 1) * sizeof *p);
    if (!p)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    p[*n] = t;
    *list = p;
    (*n)++;
    return 0;
}

int
kiln_graph_add_input (kiln_graph_t *g, int t, kiln_err_t *err)
{
    return s_add_io (g, &g->inputs, &g->n_inputs, t, "input", err);
}

int
kiln_graph_add_output (kiln_graph_t *g, int t, kiln_err_t *err)
{
    return s_add_io (g, &g->outputs, &g->n_outputs, t, "output", err);
}

/* True when s[0..n) is well-formed UTF-8: no overlong forms, no UTF-16
 * surrogates, nothing above U+10FFFF -- what jansson accepts, so that the
 * text can go into manifest.json as it is. */
static bool
s_utf8_valid (const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *) s, *end = p + n;
    while (p < end) {
        unsigned c = *p++;
        int more;
        unsigned min;
        if (c < 0x80)
            continue;
        else if (c >= 0xc2 && c <= 0xdf) { more = 1; min = 0x80; c &= 0x1f; }
        else if (c >= 0xe0 && c <= 0xef) { more = 2; min = 0x800; c &= 0x0f; }
        else if (c >= 0xf0 && c <= 0xf4) { more = 3; min = 0x10000; c &= 0x07; }
        else
            return false;
        if (end - p < more)
            return false;
        for (int k = 0; k < more; k++) {
            if ((p[k] & 0xc0) != 0x80)
                return false;
            c = (c << 6) | (p[k] & 0x3f);
        }
        p += more;
        if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff))
            return false;
    }
    return true;
}

/* Fail unless `text` may be a graph's I/O structure (see the header). */
static int
s_check_io_structure (const char *text, kiln_err_t *err)
{
    size_t n = strnlen (text, KILN_MAX_IO_STRUCTURE_BYTES + 1);
    if (n > KILN_MAX_IO_STRUCTURE_BYTES)
        return kiln_error (err, KILN_ELIMIT, "I/O structure is longer than %u bytes",
                           KILN_MAX_IO_STRUCTURE_BYTES);
    if (!s_utf8_valid (text, n))
        return kiln_error (err, KILN_EFORMAT, "I/O structure is not valid UTF-8");
    return 0;
}

int
kiln_graph_set_io_structure (kiln_graph_t *g, const char *text, kiln_err_t *err)
{
    char *copy = NULL;
    if (text && *text) {
        int rc = s_check_io_structure (text, err);
        if (rc)
            return rc;
        if (!(copy = strdup (text)))
            return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    free (g->io_structure);
    g->io_structure = copy;
    return 0;
}

int
kiln_graph_find_tensor (const kiln_graph_t *g, const char *name)
{
    if (!name)
        return -1;
    for (int t = 0; t < g->n_tensors; t++)
        if (g->tensors[t].name && strcmp (g->tensors[t].name, name) == 0)
            return t;
    return -1;
}

char *
kiln_graph_node_label (const kiln_graph_t *g, int n, char *buf, size_t size)
{
    if (n < 0 || n >= g->n_nodes) {
        snprintf (buf, size, "node #%d", n);
        return buf;
    }
    const kiln_node_t *node = &g->nodes[n];
    const char *op = node->op ? node->op : "";
    if (node->name && *node->name)
        snprintf (buf, size, "node '%s' (%s)", node->name, op);
    else
        snprintf (buf, size, "node #%d (%s)", n, op);
    return buf;
}

/* --- attributes ---------------------------------------------------- */

const kiln_attr_t *
kiln_node_attr (const kiln_node_t *node, const char *name)
{
    for (int i = 0; i < node->n_attrs; i++)
        if (node->attrs[i].name && strcmp (node->attrs[i].name, name) == 0)
            return &node->attrs[i];
    return NULL;
}

int64_t
kiln_node_attr_int (const kiln_node_t *node, const char *name, int64_t fallback)
{
    const kiln_attr_t *a = kiln_node_attr (node, name);
    return a && a->kind == KILN_ATTR_INT ? a->i : fallback;
}

double
kiln_node_attr_float (const kiln_node_t *node, const char *name, double fallback)
{
    const kiln_attr_t *a = kiln_node_attr (node, name);
    return a && a->kind == KILN_ATTR_FLOAT ? a->f : fallback;
}

const char *
kiln_node_attr_string (const kiln_node_t *node, const char *name,
                       const char *fallback)
{
    const kiln_attr_t *a = kiln_node_attr (node, name);
    return a && a->kind == KILN_ATTR_STRING && a->s ? a->s : fallback;
}

/* --- encoding ------------------------------------------------------ */

static const char *
s_attr_kind_name (kiln_attr_kind_t kind)
{
    switch (kind) {
    case KILN_ATTR_INT: return "int";
    case KILN_ATTR_FLOAT: return "float";
    case KILN_ATTR_STRING: return "string";
    case KILN_ATTR_INTS: return "ints";
    case KILN_ATTR_FLOATS: return "floats";
    }
    return NULL;
}

/* The float32 value written for an attribute float.  The canonical form
 * folds every NaN into one bit pattern, because NaN payloads carry no
 * meaning and would otherwise make equal graphs hash differently. */
static float
s_float_value (double v, bool canonical)
{
    float f = (float) v;
    if (canonical && isnan (f))
        f = NAN;
    return f;
}

/* Pack an attribute's value (the same in both encodings). */
static int
s_pack_attr_value (msgpack_packer *pk, const kiln_attr_t *a, bool canonical)
{
    switch (a->kind) {
    case KILN_ATTR_INT:
        msgpack_pack_int64 (pk, a->i);
        return 0;
    case KILN_ATTR_FLOAT:
        msgpack_pack_float (pk, s_float_value (a->f, canonical));
        return 0;
    case KILN_ATTR_STRING:
        kiln_mpk_pack_cstr (pk, a->s);
        return 0;
    case KILN_ATTR_INTS:
        msgpack_pack_array (pk, (size_t) a->n);
        for (size_t k = 0; k < a->n; k++)
            msgpack_pack_int64 (pk, a->ints[k]);
        return 0;
    case KILN_ATTR_FLOATS:
        msgpack_pack_array (pk, (size_t) a->n);
        for (size_t k = 0; k < a->n; k++)
            msgpack_pack_float (pk, s_float_value (a->floats[k], canonical));
        return 0;
    }
    return -1;
}

static void
s_pack_shape (msgpack_packer *pk, const kiln_shape_t *shape)
{
    if (shape->rank < 0) {
        msgpack_pack_nil (pk);
        return;
    }
    msgpack_pack_array (pk, (size_t) shape->rank);
    for (int d = 0; d < shape->rank; d++)
        msgpack_pack_int64 (pk, shape->dims[d]);
}

static void
s_pack_int_list (msgpack_packer *pk, const int *v, int n)
{
    msgpack_pack_array (pk, (size_t) n);
    for (int i = 0; i < n; i++)
        msgpack_pack_int (pk, v[i]);
}

/* Check the parts of the struct the encoders rely on beyond indices:
 * shapes within bounds and attribute kinds known. */
static int
s_check_encodable (const kiln_graph_t *g, kiln_err_t *err)
{
    int rc = s_check_indices (g, err);
    if (rc)
        return rc;
    for (int t = 0; t < g->n_tensors; t++)
        if (g->tensors[t].shape.rank > KILN_MAX_RANK)
            return kiln_error (err, KILN_EINVAL, "tensor #%d: rank %d is more than %d",
                               t, g->tensors[t].shape.rank, KILN_MAX_RANK);
    for (int n = 0; n < g->n_nodes; n++)
        for (int i = 0; i < g->nodes[n].n_attrs; i++)
            if (!s_attr_kind_name (g->nodes[n].attrs[i].kind))
                return kiln_error (err, KILN_EINVAL, "node #%d: attribute %d has unknown kind %d",
                                   n, i, (int) g->nodes[n].attrs[i].kind);
    if (g->io_structure && (rc = s_check_io_structure (g->io_structure, err)))
        return rc;
    return 0;
}

int
kiln_graph_encode (const kiln_graph_t *g, uint8_t **out, size_t *len,
                   kiln_err_t *err)
{
    int rc = s_check_encodable (g, err);
    if (rc)
        return rc;
    s_buf_t buf = { .max = KILN_MAX_STRUCT_BYTES };
    msgpack_packer pk;
    msgpack_packer_init (&pk, &buf, s_buf_write);

    /* io_structure is written only when there is one, so that a graph
     * without it encodes as it did before the field existed. */
    bool has_io_structure = g->io_structure && *g->io_structure;
    msgpack_pack_map (&pk, has_io_structure ? 9 : 8);
    kiln_mpk_pack_kv_str (&pk, "format", S_FORMAT);
    kiln_mpk_pack_kv_i64 (&pk, "version", KILN_GRAPH_FORMAT_VERSION);
    kiln_mpk_pack_kv_i64 (&pk, "opset", g->opset);

    kiln_mpk_pack_cstr (&pk, "tensors");
    msgpack_pack_array (&pk, (size_t) g->n_tensors);
    for (int t = 0; t < g->n_tensors && !buf.failed; t++) {
        const kiln_tensor_t *tensor = &g->tensors[t];
        msgpack_pack_map (&pk, 4);
        kiln_mpk_pack_kv_str (&pk, "name", tensor->name);
        kiln_mpk_pack_kv_i64 (&pk, "dtype", (int64_t) tensor->dtype);
        kiln_mpk_pack_cstr (&pk, "shape");
        s_pack_shape (&pk, &tensor->shape);
        kiln_mpk_pack_kv_i64 (&pk, "weight", tensor->weight);
    }

    kiln_mpk_pack_cstr (&pk, "weights");
    msgpack_pack_array (&pk, (size_t) g->n_weights);
    for (int w = 0; w < g->n_weights && !buf.failed; w++) {
        msgpack_pack_map (&pk, 2);
        kiln_mpk_pack_kv_bin (&pk, "digest", g->weights[w].digest, KILN_DIGEST_LEN);
        kiln_mpk_pack_cstr (&pk, "size");
        msgpack_pack_uint64 (&pk, g->weights[w].size);
    }

    kiln_mpk_pack_cstr (&pk, "nodes");
    msgpack_pack_array (&pk, (size_t) g->n_nodes);
    for (int n = 0; n < g->n_nodes && !buf.failed; n++) {
        const kiln_node_t *node = &g->nodes[n];
        msgpack_pack_map (&pk, 5);
        kiln_mpk_pack_kv_str (&pk, "name", node->name);
        kiln_mpk_pack_kv_str (&pk, "op", node->op);
        kiln_mpk_pack_cstr (&pk, "inputs");
        s_pack_int_list (&pk, node->inputs, node->n_inputs);
        kiln_mpk_pack_cstr (&pk, "outputs");
        s_pack_int_list (&pk, node->outputs, node->n_outputs);
        kiln_mpk_pack_cstr (&pk, "attrs");
        msgpack_pack_array (&pk, (size_t) node->n_attrs);
        for (int i = 0; i < node->n_attrs; i++) {
            const kiln_attr_t *a = &node->attrs[i];
            msgpack_pack_map (&pk, 3);
            kiln_mpk_pack_kv_str (&pk, "name", a->name);
            kiln_mpk_pack_kv_str (&pk, "type", s_attr_kind_name (a->kind));
            kiln_mpk_pack_cstr (&pk, "value");
            s_pack_attr_value (&pk, a, false);
        }
    }

    kiln_mpk_pack_cstr (&pk, "inputs");
    s_pack_int_list (&pk, g->inputs, g->n_inputs);
    kiln_mpk_pack_cstr (&pk, "outputs");
    s_pack_int_list (&pk, g->outputs, g->n_outputs);
    if (has_io_structure)
        kiln_mpk_pack_kv_str (&pk, "io_structure", g->io_structure);
    return s_buf_finish (&buf, "graph structure", out, len, err);
}

/* --- decoding ------------------------------------------------------ */

/* Read `n` big-endian bytes at p. */
static uint64_t
s_be (const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}


/* An integer field within lo..hi. */
static int
s_get_int_range (const msgpack_object *map, const char *key, int64_t lo,
                 int64_t hi, int64_t *out, kiln_err_t *err)
{
    int rc = kiln_mpk_get_i64 (map, key, out, err);
    if (rc)
        return rc;
    if (*out < lo || *out > hi)
        return kiln_error (err, KILN_EFORMAT, "field '%s' is %lld, outside %lld..%lld",
                           key, (long long) *out, (long long) lo, (long long) hi);
    return 0;
}

/* An array of ints each within lo..hi into v[max]. */
static int
s_get_int_list (const msgpack_object *map, const char *key, size_t max,
                int64_t lo, int64_t hi, int *v, int *n, kiln_err_t *err)
{
    const msgpack_object_array *arr;
    int rc = kiln_mpk_get_array (map, key, max, &arr, err);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < arr->size; i++) {
        int64_t x;
        if (kiln_mpk_as_i64 (&arr->ptr[i], &x) != 0)
            return kiln_error (err, KILN_EFORMAT, "field '%s': element %u is not an integer",
                               key, i);
        if (x < lo || x > hi)
            return kiln_error (err, KILN_EFORMAT, "field '%s': element %u is %lld, outside %lld..%lld",
                               key, i, (long long) x, (long long) lo, (long long) hi);
        v[i] = (int) x;
    }
    *n = (int) arr->size;
    return 0;
}

static bool
s_is_float (const msgpack_object *o)
{
    return o->type == MSGPACK_OBJECT_FLOAT32 || o->type == MSGPACK_OBJECT_FLOAT64;
}

static int
s_decode_attr (kiln_graph_t *g, int n, const msgpack_object *obj, kiln_err_t *err)
{
    char name[KILN_MAX_NAME + 1];
    char type[16];
    if (obj->type != MSGPACK_OBJECT_MAP)
        return kiln_error (err, KILN_EFORMAT, "not a map");
    int rc = kiln_mpk_get_strbuf (obj, "name", name, sizeof name, err);
    if (rc)
        return rc;
    if (!*name)
        return kiln_error (err, KILN_EFORMAT, "empty attribute name");
    if (kiln_node_attr (&g->nodes[n], name))
        return kiln_error (err, KILN_EFORMAT, "attribute '%s' appears twice", name);
    rc = kiln_mpk_get_strbuf (obj, "type", type, sizeof type, err);
    if (rc)
        return kiln_error_prefix (err, "attribute '%s'", name);
    const msgpack_object *v = kiln_mpk_get (obj, "value");
    if (!v)
        return kiln_error (err, KILN_EFORMAT, "attribute '%s': missing field 'value'", name);

    if (strcmp (type, "int") == 0) {
        int64_t i;
        if (kiln_mpk_as_i64 (v, &i) != 0)
            return kiln_error (err, KILN_EFORMAT, "attribute '%s': value is not an integer", name);
        return kiln_node_set_int (g, n, name, i, err);
    }
    if (strcmp (type, "float") == 0) {
        if (!s_is_float (v))
            return kiln_error (err, KILN_EFORMAT, "attribute '%s': value is not a float", name);
        return kiln_node_set_float (g, n, name, v->via.f64, err);
    }
    if (strcmp (type, "string") == 0) {
        char *s = NULL;
        rc = kiln_mpk_get_strdup (obj, "value", S_MAX_ATTR_STRING, &s, err);
        if (rc)
            return kiln_error_prefix (err, "attribute '%s'", name);
        rc = kiln_node_set_string (g, n, name, s, err);
        free (s);
        return rc;
    }
    bool ints = strcmp (type, "ints") == 0;
    if (!ints && strcmp (type, "floats") != 0)
        return kiln_error (err, KILN_EFORMAT, "attribute '%s': unknown type '%s'", name, type);
    if (v->type != MSGPACK_OBJECT_ARRAY)
        return kiln_error (err, KILN_EFORMAT, "attribute '%s': value is not an array", name);
    uint32_t count = v->via.array.size;
    if (count > KILN_MAX_ATTR_ELEMS)
        return kiln_error (err, KILN_ELIMIT, "attribute '%s': %u elements, at most %d",
                           name, count, KILN_MAX_ATTR_ELEMS);
    size_t elem = ints ? sizeof (int64_t) : sizeof (double);
    void *vals = malloc (count ? count * elem : 1);
    if (!vals)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    for (uint32_t k = 0; k < count; k++) {
        const msgpack_object *e = &v->via.array.ptr[k];
        if (ints ? kiln_mpk_as_i64 (e, &((int64_t *) vals)[k]) != 0 : !s_is_float (e)) {
            free (vals);
            return kiln_error (err, KILN_EFORMAT, "attribute '%s': element %u is not %s",
                               name, k, ints ? "an integer" : "a float");
        }
        if (!ints)
            ((double *) vals)[k] = e->via.f64;
    }
    rc = ints ? kiln_node_set_ints (g, n, name, vals, count, err)
              : kiln_node_set_floats (g, n, name, vals, count, err);
    free (vals);
    return rc;
}

static int
s_decode_tensor (kiln_graph_t *g, const msgpack_object *obj, kiln_err_t *err)
{
    char name[KILN_MAX_NAME + 1];
    if (obj->type != MSGPACK_OBJECT_MAP)
        return kiln_error (err, KILN_EFORMAT, "not a map");
    int rc = kiln_mpk_get_strbuf (obj, "name", name, sizeof name, err);
    if (rc)
        return rc;
    int64_t dt;
    rc = s_get_int_range (obj, "dtype", 0, 255, &dt, err);
    if (rc)
        return rc;
    if (dt != KILN_DT_UNDEFINED && !kiln_dtype_valid ((int) dt))
        return kiln_error (err, KILN_EFORMAT, "unknown dtype %lld", (long long) dt);
    kiln_shape_t shape = { .rank = -1 };
    const msgpack_object *s = kiln_mpk_get (obj, "shape");
    if (!s)
        return kiln_error (err, KILN_EFORMAT, "missing field 'shape'");
    if (s->type != MSGPACK_OBJECT_NIL) {
        const msgpack_object_array *arr;
        rc = kiln_mpk_get_array (obj, "shape", KILN_MAX_RANK, &arr, err);
        if (rc)
            return rc;
        shape.rank = (int) arr->size;
        for (uint32_t d = 0; d < arr->size; d++)
            if (kiln_mpk_as_i64 (&arr->ptr[d], &shape.dims[d]) != 0)
                return kiln_error (err, KILN_EFORMAT, "dimension %u is not an integer", d);
        int64_t numel;
        rc = kiln_shape_numel (&shape, name, &numel, err);
        if (rc)
            return rc;
    }
    int64_t w;
    rc = s_get_int_range (obj, "weight", -1, g->n_weights - 1, &w, err);
    if (rc)
        return rc;
    if (w >= 0) {
        uint64_t bytes;
        if (!kiln_dtype_valid ((int) dt) || shape.rank < 0)
            return kiln_error (err, KILN_EFORMAT, "weight tensor has no dtype or shape");
        rc = kiln_shape_bytes (&shape, (kiln_dtype_t) dt, name, &bytes, err);
        if (rc)
            return rc;
        if (bytes != g->weights[w].size)
            return kiln_error (err, KILN_EFORMAT, "weight %lld is %llu bytes, the tensor needs %llu",
                               (long long) w, (unsigned long long) g->weights[w].size,
                               (unsigned long long) bytes);
    }
    rc = kiln_graph_add_tensor (g, name, (kiln_dtype_t) dt, &shape, err);
    if (rc < 0)
        return rc;
    g->tensors[rc].weight = (int) w;
    return 0;
}

static int
s_decode_weight (kiln_graph_t *g, const msgpack_object *obj, kiln_err_t *err)
{
    if (obj->type != MSGPACK_OBJECT_MAP)
        return kiln_error (err, KILN_EFORMAT, "not a map");
    const uint8_t *digest;
    size_t dlen;
    int rc = kiln_mpk_get_bin (obj, "digest", KILN_DIGEST_LEN, &digest, &dlen, err);
    if (rc)
        return rc;
    if (dlen != KILN_DIGEST_LEN)
        return kiln_error (err, KILN_EFORMAT, "digest is %zu bytes, expected %d",
                           dlen, KILN_DIGEST_LEN);
    int64_t size;
    rc = s_get_int_range (obj, "size", 0, (int64_t) KILN_MAX_BLOB_BYTES, &size, err);
    if (rc)
        return rc;
    kiln_weight_t *w = &g->weights[g->n_weights++];
    memset (w, 0, sizeof *w);
    memcpy (w->digest, digest, KILN_DIGEST_LEN);
    w->size = (uint64_t) size;
    return 0;
}

static int
s_decode_node (kiln_graph_t *g, const msgpack_object *obj, int *ins, int *outs,
               kiln_err_t *err)
{
    char name[KILN_MAX_NAME + 1];
    char op[KILN_MAX_OP_NAME + 1];
    if (obj->type != MSGPACK_OBJECT_MAP)
        return kiln_error (err, KILN_EFORMAT, "not a map");
    int rc = kiln_mpk_get_strbuf (obj, "name", name, sizeof name, err);
    if (rc)
        return rc;
    rc = kiln_mpk_get_strbuf (obj, "op", op, sizeof op, err);
    if (rc)
        return rc;
    if (!*op)
        return kiln_error (err, KILN_EFORMAT, "empty op type");
    int n_ins, n_outs;
    rc = s_get_int_list (obj, "inputs", KILN_MAX_NODE_IO, -1, g->n_tensors - 1,
                         ins, &n_ins, err);
    if (rc)
        return rc;
    rc = s_get_int_list (obj, "outputs", KILN_MAX_NODE_IO, 0, g->n_tensors - 1,
                         outs, &n_outs, err);
    if (rc)
        return rc;
    const msgpack_object_array *attrs;
    rc = kiln_mpk_get_array (obj, "attrs", KILN_MAX_ATTRS, &attrs, err);
    if (rc)
        return rc;
    int n = kiln_graph_add_node (g, op, name, ins, n_ins, outs, n_outs, err);
    if (n < 0)
        return n;
    for (uint32_t i = 0; i < attrs->size; i++) {
        rc = s_decode_attr (g, n, &attrs->ptr[i], err);
        if (rc)
            return kiln_error_prefix (err, "attribute %u", i);
    }
    return 0;
}

/* Decode the root map of a structure into the empty graph `g`. */
static int
s_decode_root (kiln_graph_t *g, const msgpack_object *root, kiln_err_t *err)
{
    char format[S_MAX_HEADER_STR];
    int64_t version, opset;
    if (root->type != MSGPACK_OBJECT_MAP)
        return kiln_error (err, KILN_EFORMAT, "graph structure is not a map");
    int rc = kiln_mpk_get_strbuf (root, "format", format, sizeof format, err);
    if (rc)
        return rc;
    if (strcmp (format, S_FORMAT) != 0)
        return kiln_error (err, KILN_EFORMAT, "format is '%s', expected '%s'", format, S_FORMAT);
    rc = kiln_mpk_get_i64 (root, "version", &version, err);
    if (rc)
        return rc;
    if (version != KILN_GRAPH_FORMAT_VERSION)
        return kiln_error (err, KILN_EUNSUPPORTED, "kiln-graph version %lld is not supported (expected %d)",
                           (long long) version, KILN_GRAPH_FORMAT_VERSION);
    rc = s_get_int_range (root, "opset", 0, INT32_MAX, &opset, err);
    if (rc)
        return rc;
    g->opset = (int) opset;

    /* Weights come before tensors so that a tensor's weight index can be
     * range-checked as it is read. */
    const msgpack_object_array *arr;
    rc = kiln_mpk_get_array (root, "weights", KILN_MAX_TENSORS, &arr, err);
    if (rc)
        return rc;
    rc = s_reserve ((void **) &g->weights, &g->cap_weights, (int) arr->size,
                    sizeof *g->weights, KILN_MAX_TENSORS, "weights", err);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < arr->size; i++)
        if ((rc = s_decode_weight (g, &arr->ptr[i], err)))
            return kiln_error_prefix (err, "weight %u", i);

    rc = kiln_mpk_get_array (root, "tensors", KILN_MAX_TENSORS, &arr, err);
    if (rc)
        return rc;
    rc = s_reserve ((void **) &g->tensors, &g->cap_tensors, (int) arr->size,
                    sizeof *g->tensors, KILN_MAX_TENSORS, "tensors", err);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < arr->size; i++)
        if ((rc = s_decode_tensor (g, &arr->ptr[i], err)))
            return kiln_error_prefix (err, "tensor %u", i);

    rc = kiln_mpk_get_array (root, "nodes", KILN_MAX_NODES, &arr, err);
    if (rc)
        return rc;
    rc = s_reserve ((void **) &g->nodes, &g->cap_nodes, (int) arr->size,
                    sizeof *g->nodes, KILN_MAX_NODES, "nodes", err);
    if (rc)
        return rc;
    int *ins = malloc (2 * KILN_MAX_NODE_IO * sizeof (int));
    if (!ins)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    for (uint32_t i = 0; i < arr->size && rc == 0; i++)
        if ((rc = s_decode_node (g, &arr->ptr[i], ins, ins + KILN_MAX_NODE_IO, err)))
            kiln_error_prefix (err, "node %u", i);
    if (rc == 0) {
        int n;
        rc = s_get_int_list (root, "inputs", KILN_MAX_GRAPH_IO, 0, g->n_tensors - 1,
                             ins, &n, err);
        for (int i = 0; i < n && rc == 0; i++)
            rc = kiln_graph_add_input (g, ins[i], err);
    }
    if (rc == 0) {
        int n;
        rc = s_get_int_list (root, "outputs", KILN_MAX_GRAPH_IO, 0, g->n_tensors - 1,
                             ins, &n, err);
        for (int i = 0; i < n && rc == 0; i++)
            rc = kiln_graph_add_output (g, ins[i], err);
    }
    free (ins);
    if (rc == 0 && kiln_mpk_get (root, "io_structure")) {
        char *text = NULL;
        rc = kiln_mpk_get_strdup (root, "io_structure", KILN_MAX_IO_STRUCTURE_BYTES,
                                  &text, err);
        if (rc == 0 && (rc = kiln_graph_set_io_structure (g, text, err)))
            kiln_error_prefix (err, "field 'io_structure'");
        free (text);
    }
    return rc;
}

kiln_graph_t *
kiln_graph_decode (const uint8_t *data, size_t len, kiln_err_t *err)
{
    kiln_graph_t *g = NULL;
    msgpack_unpacked up;
    msgpack_unpacked_init (&up);
    if (!data || len == 0) {
        kiln_error (err, KILN_EFORMAT, "empty graph structure");
        goto err;
    }
    if (len > KILN_MAX_STRUCT_BYTES) {
        kiln_error (err, KILN_ELIMIT, "graph structure is %zu bytes, more than %u",
                    len, KILN_MAX_STRUCT_BYTES);
        goto err;
    }
    size_t used = 0;
    if (kiln_mpk_check (data, len, S_MAX_DEPTH, len, "graph structure", &used, err) != 0)
        goto err;
    if (used != len) {
        kiln_error (err, KILN_EFORMAT, "%zu trailing bytes after the graph structure",
                    len - used);
        goto err;
    }
    size_t off = 0;
    msgpack_unpack_return ret = msgpack_unpack_next (&up, (const char *) data, len, &off);
    if (ret != MSGPACK_UNPACK_SUCCESS) {
        kiln_error (err, ret == MSGPACK_UNPACK_NOMEM_ERROR ? KILN_ENOMEM : KILN_EFORMAT,
                    "could not parse graph structure (msgpack error %d)", (int) ret);
        goto err;
    }
    g = kiln_graph_new ();
    if (!g) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto err;
    }
    if (s_decode_root (g, &up.data, err) != 0) {
        kiln_error_prefix (err, "graph structure");
        goto err;
    }
    msgpack_unpacked_destroy (&up);
    return g;
err:
    kiln_graph_destroy (&g);
    msgpack_unpacked_destroy (&up);
    return NULL;
}

/* --- blobs --------------------------------------------------------- */


/* Hand the blob to weight `w`: it takes *data while the caller still owns
 * it (NULLing *data and pointing *src at it), else gets a copy of *src. */
static int
s_give_blob (kiln_weight_t *w, uint8_t **data, const uint8_t **src,
             uint64_t size, kiln_err_t *err)
{
    if (*data) {
        w->data = *data;
        *src = *data;
        *data = NULL;
        return 0;
    }
    w->data = malloc (size ? (size_t) size : 1);
    if (!w->data)
        return kiln_error (err, KILN_ENOMEM, "out of memory for a blob of %llu bytes",
                           (unsigned long long) size);
    if (size)
        memcpy (w->data, *src, (size_t) size);
    return 0;
}

/* The message part naming weight `w` by its tensor: "tensor 'fc.weight'". */
static const char *
s_weight_label (const kiln_graph_t *g, int w, char *buf, size_t size)
{
    int t = s_weight_tensor (g, w);
    char tl[KILN_MAX_NAME + 8];
    if (t < 0)
        snprintf (buf, size, "weight #%d (used by no tensor)", w);
    else
        snprintf (buf, size, "tensor %s", s_tensor_label (g, t, tl, sizeof tl));
    return buf;
}

int
kiln_graph_attach_blob (kiln_graph_t *g, const uint8_t digest[KILN_DIGEST_LEN],
                        const uint8_t *data, uint64_t size, kiln_err_t *err)
{
    char hex[KILN_HEX_LEN];
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    if (!data && size > 0)
        return kiln_error (err, KILN_EINVAL, "blob %s: NULL data", hex);
    if (size > KILN_MAX_BLOB_BYTES)
        return kiln_error (err, KILN_ELIMIT, "blob %s is %llu bytes, more than %llu", hex,
                           (unsigned long long) size, (unsigned long long) KILN_MAX_BLOB_BYTES);
    int count = 0;
    for (int w = 0; w < g->n_weights; w++) {
        if (memcmp (g->weights[w].digest, digest, KILN_DIGEST_LEN) != 0)
            continue;
        count++;
        if (g->weights[w].size != size) {
            char wl[KILN_MAX_NAME + 40];
            return kiln_error (err, KILN_EFORMAT, "blob %s is %llu bytes but %s expects %llu",
                               hex, (unsigned long long) size,
                               s_weight_label (g, w, wl, sizeof wl),
                               (unsigned long long) g->weights[w].size);
        }
    }
    if (count == 0)
        return 0;
    uint8_t got[KILN_DIGEST_LEN];
    kiln_sha256 (data ? data : (const uint8_t *) "", (size_t) size, got);
    if (memcmp (got, digest, KILN_DIGEST_LEN) != 0)
        return kiln_error (err, KILN_EVERIFY, "blob does not match its digest %s", hex);
    const uint8_t *src = data ? data : (const uint8_t *) "";
    uint8_t *none = NULL;       /* the caller keeps `data`: every weight copies */
    for (int w = 0; w < g->n_weights; w++) {
        kiln_weight_t *weight = &g->weights[w];
        if (weight->data || memcmp (weight->digest, digest, KILN_DIGEST_LEN) != 0)
            continue;
        int rc = s_give_blob (weight, &none, &src, size, err);
        if (rc)
            return rc;
    }
    return count;
}

bool
kiln_graph_complete (const kiln_graph_t *g)
{
    for (int w = 0; w < g->n_weights; w++)
        if (!g->weights[w].data)
            return false;
    return true;
}

/* Weights sorted by digest, then index: finds blobs in O(log n) and puts
 * the lowest-indexed weight first in each run of equal digests. */
typedef struct {
    const uint8_t *digest;
    int w;
} s_wref_t;

static int
s_wref_cmp (const void *a, const void *b)
{
    const s_wref_t *x = a, *y = b;
    int c = memcmp (x->digest, y->digest, KILN_DIGEST_LEN);
    return c ? c : (x->w > y->w) - (x->w < y->w);
}

/* Caller owns the result (free()); NULL with err set when out of memory. */
static s_wref_t *
s_weights_by_digest (const kiln_graph_t *g, kiln_err_t *err)
{
    s_wref_t *refs = malloc ((size_t) (g->n_weights ? g->n_weights : 1) * sizeof *refs);
    if (!refs) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    for (int w = 0; w < g->n_weights; w++)
        refs[w] = (s_wref_t) { g->weights[w].digest, w };
    qsort (refs, (size_t) g->n_weights, sizeof *refs, s_wref_cmp);
    return refs;
}

/* Index of the first ref with `digest`, or -1. */
static int
s_find_digest (const s_wref_t *refs, int n, const uint8_t *digest)
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (memcmp (refs[mid].digest, digest, KILN_DIGEST_LEN) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && memcmp (refs[lo].digest, digest, KILN_DIGEST_LEN) == 0 ? lo : -1;
}

/* --- .kgraph files ------------------------------------------------- */

int
kiln_graph_save (const kiln_graph_t *g, const char *path, kiln_err_t *err)
{
    uint8_t *structure = NULL;
    size_t slen = 0;
    s_wref_t *refs = NULL;
    bool *emit = NULL;
    s_buf_t buf = { 0 };
    int rc = 0;

    for (int w = 0; w < g->n_weights; w++)
        if (!g->weights[w].data) {
            char wl[KILN_MAX_NAME + 40];
            rc = kiln_error (err, KILN_EINVAL, "cannot save '%s': %s has no weight data attached",
                             path, s_weight_label (g, w, wl, sizeof wl));
            goto err;
        }
    rc = kiln_graph_encode (g, &structure, &slen, err);
    if (rc)
        goto err;
    refs = s_weights_by_digest (g, err);
    emit = calloc ((size_t) g->n_weights + 1, sizeof *emit);
    if (!refs || !emit) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory");
        goto err;
    }
    /* Identical blobs (same digest) are written once, at the position of
     * the first weight that holds them, so the file order follows the
     * structure's weight order. */
    uint64_t total = 64 + (uint64_t) slen;
    for (int i = 0; i < g->n_weights; i++)
        if (i == 0 || memcmp (refs[i].digest, refs[i - 1].digest, KILN_DIGEST_LEN) != 0) {
            emit[refs[i].w] = true;
            total += 48 + g->weights[refs[i].w].size;
        }
    if (total > KILN_MAX_MODEL_BYTES) {
        rc = kiln_error (err, KILN_ELIMIT, "cannot save '%s': %llu bytes, more than %llu",
                         path, (unsigned long long) total,
                         (unsigned long long) KILN_MAX_MODEL_BYTES);
        goto err;
    }
    /* The header is built in memory; the blobs go from where they are
     * (mapped files, for large models) to the file a chunk at a time, so
     * saving never holds the model twice. */
    buf.max = (size_t) slen + 256;
    msgpack_packer pk;
    msgpack_packer_init (&pk, &buf, s_buf_write);
    msgpack_pack_map (&pk, 3);
    kiln_mpk_pack_kv_str (&pk, "format", S_FORMAT);
    kiln_mpk_pack_kv_i64 (&pk, "version", KILN_GRAPH_FORMAT_VERSION);
    kiln_mpk_pack_kv_bin (&pk, "graph", structure, slen);
    if (buf.failed) {
        rc = kiln_error (err, -buf.failed, "out of memory saving '%s'", path);
        goto err;
    }
    char tmp[PATH_MAX];
    int fd = kiln_tmp_beside (path, tmp, sizeof tmp, 0644, err);
    if (fd < 0) {
        rc = fd;
        goto err;
    }
    uint64_t at = buf.len;
    bool ok = kiln_write_all (fd, buf.data, buf.len) == 0;
    for (int w = 0; ok && w < g->n_weights; w++) {
        if (!emit[w])
            continue;
        const kiln_weight_t *wt = &g->weights[w];
        uint8_t head[KILN_GRAPH_BLOB_HEAD_MAX];
        size_t hlen = kiln_graph_blob_head (at, wt->digest, wt->size, head);
        ok = kiln_write_all (fd, head, hlen) == 0;
        for (uint64_t done = 0; ok && done < wt->size; done += KILN_CHUNK_BYTES) {
            size_t n = wt->size - done < KILN_CHUNK_BYTES ? (size_t) (wt->size - done)
                                                          : KILN_CHUNK_BYTES;
            ok = kiln_write_all (fd, wt->data + done, n) == 0;
            if (wt->map.base)
                kiln_map_drop (wt->data + done, n);
        }
        at += hlen + wt->size;
    }
    if (!ok) {
        rc = kiln_error (err, KILN_EIO, "could not write '%s': %s", tmp, strerror (errno));
        close (fd);
        unlink (tmp);
        goto err;
    }
    rc = kiln_tmp_commit (fd, tmp, path, err);
err:
    free (buf.data);
    free (structure);
    free (refs);
    free (emit);
    return rc;
}

/* One msgpack head in form 0, 1 or 2 (an 8-, 16- or 32-bit length for a
 * bin; a fixarray, array 16 or array 32 for an array).  Its length. */
static size_t
s_put_head (uint8_t *out, bool array, int form, uint64_t v)
{
    if (array && form == 0) {
        out[0] = (uint8_t) (0x90 | v);
        return 1;
    }
    int bytes = 1 << form;          /* array: 2 or 4; bin: 1, 2 or 4 */
    out[0] = (uint8_t) (array ? 0xdb + form : 0xc4 + form);
    for (int i = 0; i < bytes; i++)
        out[1 + i] = (uint8_t) (v >> (8 * (bytes - 1 - i)));
    return 1 + (size_t) bytes;
}

/* The head of one `[digest, data]` entry starting at file offset `at`.
 * msgpack lets a head take a longer form than it needs; of the forms, the
 * shortest is chosen that starts the data on a multiple of 8 (else of 4:
 * one of them always is), so that a reader mapping the blob from the file
 * finds it aligned for its element type.  Every form is standard msgpack. */
size_t
kiln_graph_blob_head (uint64_t at, const uint8_t digest[KILN_DIGEST_LEN], uint64_t size,
                      uint8_t out[KILN_GRAPH_BLOB_HEAD_MAX])
{
    static const size_t s_array_len[] = { 1, 3, 5 }, s_bin_len[] = { 2, 3, 5 };
    int min_h = size > 0xffff ? 2 : size > 0xff ? 1 : 0;
    int fa = 0, fd = 0, fh = min_h;
    size_t best = 0;
    for (uint64_t want = 8; want >= 4 && best == 0; want /= 2)
        for (int a = 0; a < 3; a++)
            for (int d = 0; d < 3; d++)
                for (int h = min_h; h < 3; h++) {
                    size_t len = s_array_len[a] + s_bin_len[d] + KILN_DIGEST_LEN
                                 + s_bin_len[h];
                    if ((at + len) % want == 0 && (best == 0 || len < best))
                        fa = a, fd = d, fh = h, best = len;
                }
    size_t n = s_put_head (out, true, fa, 2);
    n += s_put_head (out + n, false, fd, KILN_DIGEST_LEN);
    memcpy (out + n, digest, KILN_DIGEST_LEN);
    n += KILN_DIGEST_LEN;
    return n + s_put_head (out + n, false, fh, size);
}

/* A sequential reader over a .kgraph file.  `left` counts the bytes the
 * file still holds, so that no length read from it is trusted beyond what
 * is actually there: a header claiming a 4 GiB blob in a small file is
 * reported as truncated before anything is allocated. */
typedef struct {
    FILE *f;
    const char *path;
    uint64_t left;
    uint8_t *align;         /* per weight: the largest element size of a tensor using it */
} s_reader_t;

typedef enum {
    S_MP_NIL, S_MP_BOOL, S_MP_INT, S_MP_FLOAT, S_MP_STR, S_MP_BIN, S_MP_EXT,
    S_MP_ARRAY, S_MP_MAP
} s_mp_kind_t;

static int
s_rd (s_reader_t *r, void *out, uint64_t n, kiln_err_t *err)
{
    if (n > r->left)
        return kiln_error (err, KILN_EFORMAT, "'%s' is truncated", r->path);
    if (n > 0 && fread (out, 1, (size_t) n, r->f) != (size_t) n)
        return kiln_error (err, ferror (r->f) ? KILN_EIO : KILN_EFORMAT,
                           "could not read '%s': %s", r->path,
                           ferror (r->f) ? strerror (errno) : "file shrank while reading");
    r->left -= n;
    return 0;
}

static int
s_rd_skip (s_reader_t *r, uint64_t n, kiln_err_t *err)
{
    if (n > r->left)
        return kiln_error (err, KILN_EFORMAT, "'%s' is truncated", r->path);
    if (fseeko (r->f, (off_t) n, SEEK_CUR) != 0)
        return kiln_error (err, KILN_EIO, "could not seek in '%s': %s", r->path,
                           strerror (errno));
    r->left -= n;
    return 0;
}

/* Read one msgpack head: its kind and the value it carries (length of a
 * str/bin/ext payload, element count of an array/map, an integer's value
 * as two's complement; floats are read and dropped). */
static int
s_rd_head (s_reader_t *r, s_mp_kind_t *kind, uint64_t *val, kiln_err_t *err)
{
    uint8_t b, p[8];
    int rc = s_rd (r, &b, 1, err);
    if (rc)
        return rc;
    int n = 0;
    *val = 0;
    if (b <= 0x7f) { *kind = S_MP_INT; *val = b; return 0; }
    if (b >= 0xe0) { *kind = S_MP_INT; *val = (uint64_t) (int64_t) (int8_t) b; return 0; }
    if (b <= 0x8f) { *kind = S_MP_MAP; *val = b & 0x0f; return 0; }
    if (b <= 0x9f) { *kind = S_MP_ARRAY; *val = b & 0x0f; return 0; }
    if (b <= 0xbf) { *kind = S_MP_STR; *val = b & 0x1f; return 0; }
    switch (b) {
    case 0xc0: *kind = S_MP_NIL; return 0;
    case 0xc2: case 0xc3: *kind = S_MP_BOOL; *val = b == 0xc3; return 0;
    case 0xc4: case 0xc5: case 0xc6: *kind = S_MP_BIN; n = 1 << (b - 0xc4); break;
    case 0xc7: case 0xc8: case 0xc9: *kind = S_MP_EXT; n = 1 << (b - 0xc7); break;
    case 0xca: *kind = S_MP_FLOAT; return s_rd (r, p, 4, err);
    case 0xcb: *kind = S_MP_FLOAT; return s_rd (r, p, 8, err);
    case 0xcc: case 0xcd: case 0xce: case 0xcf:
        *kind = S_MP_INT;
        n = 1 << (b - 0xcc);
        if ((rc = s_rd (r, p, (uint64_t) n, err)))
            return rc;
        *val = s_be (p, n);
        return 0;
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        *kind = S_MP_INT;
        n = 1 << (b - 0xd0);
        if ((rc = s_rd (r, p, (uint64_t) n, err)))
            return rc;
        uint64_t u = s_be (p, n);
        int shift = 64 - 8 * n;
        /* sign-extend the n-byte value */
        *val = shift ? (uint64_t) ((int64_t) (u << shift) >> shift) : u;
        return 0;
    }
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8:
        *kind = S_MP_EXT;
        *val = 1 + (1u << (b - 0xd4));
        return 0;
    case 0xd9: case 0xda: case 0xdb: *kind = S_MP_STR; n = 1 << (b - 0xd9); break;
    case 0xdc: case 0xdd: *kind = S_MP_ARRAY; n = 2 << (b - 0xdc); break;
    case 0xde: case 0xdf: *kind = S_MP_MAP; n = 2 << (b - 0xde); break;
    default:
        return kiln_error (err, KILN_EFORMAT, "'%s': invalid msgpack type byte 0x%02x",
                           r->path, b);
    }
    if ((rc = s_rd (r, p, (uint64_t) n, err)))
        return rc;
    *val = s_be (p, n);
    if (*kind == S_MP_EXT)
        *val += 1;              /* the ext type byte */
    return 0;
}

/* Read a head that must be of `kind`; `what` names it in the error. */
static int
s_rd_expect (s_reader_t *r, s_mp_kind_t kind, uint64_t *val, const char *what,
             kiln_err_t *err)
{
    s_mp_kind_t got;
    int rc = s_rd_head (r, &got, val, err);
    if (rc)
        return rc;
    if (got != kind)
        return kiln_error (err, KILN_EFORMAT, "'%s': %s has the wrong msgpack type",
                           r->path, what);
    return 0;
}

/* Read the header map; *structure gets the graph structure (caller frees). */
static int
s_rd_header (s_reader_t *r, uint8_t **structure, size_t *slen, kiln_err_t *err)
{
    uint64_t nkeys, v;
    int64_t version = -1;
    bool have_format = false;
    int rc = s_rd_expect (r, S_MP_MAP, &nkeys, "the header", err);
    if (rc)
        return rc;
    if (nkeys > S_MAX_HEADER_KEYS)
        return kiln_error (err, KILN_EFORMAT, "'%s': header has %llu fields, at most %d",
                           r->path, (unsigned long long) nkeys, S_MAX_HEADER_KEYS);
    for (uint64_t i = 0; i < nkeys; i++) {
        char key[S_MAX_HEADER_STR + 1];
        rc = s_rd_expect (r, S_MP_STR, &v, "a header key", err);
        if (rc)
            return rc;
        if (v > S_MAX_HEADER_STR)
            return kiln_error (err, KILN_EFORMAT, "'%s': header key of %llu bytes",
                               r->path, (unsigned long long) v);
        if ((rc = s_rd (r, key, v, err)))
            return rc;
        key[v] = '\0';
        s_mp_kind_t kind;
        if ((rc = s_rd_head (r, &kind, &v, err)))
            return rc;
        if (strcmp (key, "format") == 0) {
            char format[S_MAX_HEADER_STR + 1];
            if (kind != S_MP_STR || v > S_MAX_HEADER_STR)
                return kiln_error (err, KILN_EFORMAT, "'%s': header field 'format' is not a short string",
                                   r->path);
            if ((rc = s_rd (r, format, v, err)))
                return rc;
            format[v] = '\0';
            if (strcmp (format, S_FORMAT) != 0)
                return kiln_error (err, KILN_EFORMAT, "'%s' is not a kiln graph (format '%s')",
                                   r->path, format);
            have_format = true;
        }
        else if (strcmp (key, "version") == 0) {
            if (kind != S_MP_INT)
                return kiln_error (err, KILN_EFORMAT, "'%s': header field 'version' is not an integer",
                                   r->path);
            version = (int64_t) v;
        }
        else if (strcmp (key, "graph") == 0) {
            if (kind != S_MP_BIN || *structure)
                return kiln_error (err, KILN_EFORMAT, "'%s': header field 'graph' is not one bin",
                                   r->path);
            if (v > KILN_MAX_STRUCT_BYTES)
                return kiln_error (err, KILN_ELIMIT, "'%s': graph structure is %llu bytes, more than %u",
                                   r->path, (unsigned long long) v, KILN_MAX_STRUCT_BYTES);
            if (v > r->left)
                return kiln_error (err, KILN_EFORMAT, "'%s' is truncated", r->path);
            *structure = malloc (v ? (size_t) v : 1);
            if (!*structure)
                return kiln_error (err, KILN_ENOMEM, "out of memory");
            *slen = (size_t) v;
            if ((rc = s_rd (r, *structure, v, err)))
                return rc;
        }
        else if (kind == S_MP_STR || kind == S_MP_BIN || kind == S_MP_EXT) {
            /* Unknown scalar fields are skipped so that a later writer can
             * add information without breaking version-1 readers. */
            if ((rc = s_rd_skip (r, v, err)))
                return rc;
        }
        else if (kind == S_MP_ARRAY || kind == S_MP_MAP)
            return kiln_error (err, KILN_EFORMAT, "'%s': unknown header field '%s' holds a container",
                               r->path, key);
    }
    if (!have_format)
        return kiln_error (err, KILN_EFORMAT, "'%s': header has no 'format'", r->path);
    if (version != KILN_GRAPH_FORMAT_VERSION)
        return kiln_error (err, KILN_EUNSUPPORTED, "'%s': kiln-graph version %lld is not supported (expected %d)",
                           r->path, (long long) version, KILN_GRAPH_FORMAT_VERSION);
    if (!*structure)
        return kiln_error (err, KILN_EFORMAT, "'%s': header has no 'graph'", r->path);
    return 0;
}

#define S_MAP_BLOB_BYTES (1u << 20)   /* blobs at least this big are mapped */

/* The data of blob `digest` (`size` bytes) starts at the reader's
 * position: map it for each weight that uses it (after checking it once
 * against its digest), and move past it. */
static int
s_rd_blob_mapped (s_reader_t *r, kiln_graph_t *g, const s_wref_t *refs, int first,
                  const uint8_t digest[KILN_DIGEST_LEN], uint64_t size, const char *wl,
                  kiln_err_t *err)
{
    off_t at = ftello (r->f);
    if (at < 0)
        return kiln_error (err, KILN_EIO, "could not read '%s': %s", r->path, strerror (errno));
    int fd = fileno (r->f);
    int rc = 0;
    uint8_t got[KILN_DIGEST_LEN];
    kiln_map_t map;
    const uint8_t *data;
    if ((rc = kiln_map_range (fd, (uint64_t) at, size, wl, &map, &data, err)))
        return rc;
    kiln_sha256_mapped (data, (size_t) size, got);
    kiln_map_release (&map);
    if (memcmp (got, digest, KILN_DIGEST_LEN) != 0) {
        char hex[KILN_HEX_LEN];
        kiln_hex (digest, KILN_DIGEST_LEN, hex);
        return kiln_error (err, KILN_EVERIFY, "'%s': blob %s (%s) does not match its digest",
                           r->path, hex, wl);
    }
    for (int i = first; rc == 0 && i < g->n_weights
                        && memcmp (refs[i].digest, digest, KILN_DIGEST_LEN) == 0; i++) {
        kiln_weight_t *w = &g->weights[refs[i].w];
        if ((rc = kiln_map_range (fd, (uint64_t) at, size, wl, &w->map, &data, err)) == 0)
            w->data = (uint8_t *) data;
    }
    if (rc == 0)
        rc = s_rd_skip (r, size, err);
    return rc;
}

/* Read one [digest, data] pair and give it to the weights that use it. */
static int
s_rd_blob (s_reader_t *r, kiln_graph_t *g, const s_wref_t *refs, int index,
           kiln_err_t *err)
{
    uint64_t v, size;
    uint8_t digest[KILN_DIGEST_LEN], got[KILN_DIGEST_LEN];
    char hex[KILN_HEX_LEN], wl[KILN_MAX_NAME + 40];
    uint8_t *data = NULL;
    int rc = s_rd_expect (r, S_MP_ARRAY, &v, "a blob entry", err);
    if (rc)
        goto err;
    if (v != 2) {
        rc = kiln_error (err, KILN_EFORMAT, "'%s': blob %d is not a [digest, data] pair",
                         r->path, index);
        goto err;
    }
    if ((rc = s_rd_expect (r, S_MP_BIN, &v, "a blob digest", err)))
        goto err;
    if (v != KILN_DIGEST_LEN) {
        rc = kiln_error (err, KILN_EFORMAT, "'%s': blob %d has a digest of %llu bytes",
                         r->path, index, (unsigned long long) v);
        goto err;
    }
    if ((rc = s_rd (r, digest, KILN_DIGEST_LEN, err)))
        goto err;
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    if ((rc = s_rd_expect (r, S_MP_BIN, &size, "blob data", err)))
        goto err;
    int first = s_find_digest (refs, g->n_weights, digest);
    if (first < 0) {
        rc = kiln_error (err, KILN_EFORMAT, "'%s': blob %s is not used by any weight",
                         r->path, hex);
        goto err;
    }
    int w0 = refs[first].w;
    s_weight_label (g, w0, wl, sizeof wl);
    if (g->weights[w0].data) {
        rc = kiln_error (err, KILN_EFORMAT, "'%s': blob %s (%s) appears twice", r->path, hex, wl);
        goto err;
    }
    for (int i = first; i < g->n_weights
                        && memcmp (refs[i].digest, digest, KILN_DIGEST_LEN) == 0; i++)
        if (g->weights[refs[i].w].size != size) {
            rc = kiln_error (err, KILN_EFORMAT, "'%s': blob %s is %llu bytes but %s expects %llu",
                             r->path, hex, (unsigned long long) size, wl,
                             (unsigned long long) g->weights[refs[i].w].size);
            goto err;
        }
    if (size > r->left) {
        rc = kiln_error (err, KILN_EFORMAT, "'%s' is truncated in blob %s (%s)", r->path, hex, wl);
        goto err;
    }
    off_t at = ftello (r->f);
    unsigned need = 1;
    for (int i = first; r->align && i < g->n_weights
                        && memcmp (refs[i].digest, digest, KILN_DIGEST_LEN) == 0; i++)
        need = r->align[refs[i].w] > need ? r->align[refs[i].w] : need;
    if (size >= S_MAP_BLOB_BYTES && at >= 0 && (uint64_t) at % need == 0) {
        /* A large blob is mapped from the file, not read: hashed with its
         * pages given back, then each weight that uses it maps it.  Only
         * where the file puts it aligned for its elements (kiln's writers
         * always do); elsewhere it is read into memory. */
        rc = s_rd_blob_mapped (r, g, refs, first, digest, size, wl, err);
        goto err;
    }
    data = malloc (size ? (size_t) size : 1);
    if (!data) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory for blob %s (%llu bytes)", hex,
                         (unsigned long long) size);
        goto err;
    }
    if ((rc = s_rd (r, data, size, err)))
        goto err;
    kiln_sha256 (data, (size_t) size, got);
    if (memcmp (got, digest, KILN_DIGEST_LEN) != 0) {
        rc = kiln_error (err, KILN_EVERIFY, "'%s': blob %s (%s) does not match its digest",
                         r->path, hex, wl);
        goto err;
    }
    const uint8_t *src = NULL;
    for (int i = first; i < g->n_weights
                        && memcmp (refs[i].digest, digest, KILN_DIGEST_LEN) == 0; i++)
        if ((rc = s_give_blob (&g->weights[refs[i].w], &data, &src, size, err)))
            goto err;
err:
    free (data);
    return rc;
}

/* Read a .kgraph of `size` bytes from `r->f` (named r->path in errors). */
static kiln_graph_t *
s_load (s_reader_t *r, uint64_t size, kiln_err_t *err)
{
    kiln_graph_t *g = NULL;
    uint8_t *structure = NULL;
    size_t slen = 0;
    s_wref_t *refs = NULL;
    const char *path = r->path;
    if (size > KILN_MAX_MODEL_BYTES) {
        kiln_error (err, KILN_ELIMIT, "'%s' is %llu bytes, more than the limit of %llu",
                    path, (unsigned long long) size, (unsigned long long) KILN_MAX_MODEL_BYTES);
        goto err;
    }
    r->left = size;
    if (s_rd_header (r, &structure, &slen, err) != 0)
        goto err;
    g = kiln_graph_decode (structure, slen, err);
    if (!g) {
        kiln_error_prefix (err, "'%s'", path);
        goto err;
    }
    refs = s_weights_by_digest (g, err);
    if (!refs)
        goto err;
    if (!(r->align = calloc ((size_t) g->n_weights + 1, 1))) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto err;
    }
    for (int t = 0; t < g->n_tensors; t++) {
        int w = g->tensors[t].weight;
        size_t es = kiln_dtype_size (g->tensors[t].dtype);
        if (w >= 0 && w < g->n_weights && es <= 8 && es > r->align[w])
            r->align[w] = (uint8_t) es;
    }
    for (int i = 0; r->left > 0; i++)
        if (s_rd_blob (r, g, refs, i, err) != 0)
            goto err;
    for (int w = 0; w < g->n_weights; w++)
        if (!g->weights[w].data) {
            char hex[KILN_HEX_LEN], wl[KILN_MAX_NAME + 40];
            kiln_hex (g->weights[w].digest, KILN_DIGEST_LEN, hex);
            kiln_error (err, KILN_EFORMAT, "'%s': the blob of %s (%s) is missing",
                        path, s_weight_label (g, w, wl, sizeof wl), hex);
            goto err;
        }
    free (structure);
    free (refs);
    free (r->align);
    r->align = NULL;
    return g;
err:
    free (structure);
    free (refs);
    free (r->align);
    r->align = NULL;
    kiln_graph_destroy (&g);
    return NULL;
}

kiln_graph_t *
kiln_graph_load (const char *path, kiln_err_t *err)
{
    struct stat st;
    int fd = kiln_open_regular (path, NULL, 0, &st, err);
    if (fd < 0)
        return NULL;
    s_reader_t r = { .path = path, .f = fdopen (fd, "rb") };
    if (!r.f) {
        kiln_error (err, KILN_EIO, "could not open '%s': %s", path, strerror (errno));
        close (fd);
        return NULL;
    }
    kiln_graph_t *g = s_load (&r, (uint64_t) st.st_size, err);
    fclose (r.f);
    return g;
}

kiln_graph_t *
kiln_graph_load_mem (const uint8_t *data, size_t len, const char *name, kiln_err_t *err)
{
    s_reader_t r = { .path = name };
    if (len == 0) {
        kiln_error (err, KILN_EFORMAT, "'%s' is empty", name);
        return NULL;
    }
    if (!(r.f = fmemopen ((void *) data, len, "rb"))) {
        kiln_error (err, KILN_ENOMEM, "out of memory reading '%s'", name);
        return NULL;
    }
    kiln_graph_t *g = s_load (&r, len, err);
    fclose (r.f);
    return g;
}

/* --- canonical form and digest ------------------------------------- */

/* Sort attribute indices by name (insertion sort: at most KILN_MAX_ATTRS). */
static void
s_sort_attrs (const kiln_node_t *node, int *idx)
{
    for (int i = 0; i < node->n_attrs; i++) {
        int k = i;
        idx[i] = i;
        while (k > 0 && strcmp (node->attrs[idx[k - 1]].name, node->attrs[i].name) > 0) {
            idx[k] = idx[k - 1];
            k--;
        }
        idx[k] = i;
    }
}

int
kiln_graph_canonical (const kiln_graph_t *g, uint8_t **out, size_t *len,
                      kiln_err_t *err)
{
    int *cid = NULL, *order = NULL;
    bool *produced = NULL;
    s_buf_t buf = { .max = KILN_MAX_STRUCT_BYTES };
    int rc = s_check_encodable (g, err);
    if (rc)
        return rc;
    for (int n = 0; n < g->n_nodes; n++) {
        if (g->nodes[n].n_attrs > KILN_MAX_ATTRS)
            return kiln_error (err, KILN_EINVAL, "node #%d: more than %d attributes",
                               n, KILN_MAX_ATTRS);
        for (int i = 0; i < g->nodes[n].n_attrs; i++)
            if (!g->nodes[n].attrs[i].name)
                return kiln_error (err, KILN_EINVAL, "node #%d: attribute %d has no name", n, i);
    }
    size_t nt = (size_t) g->n_tensors + 1;
    cid = malloc (nt * sizeof *cid);
    order = malloc (nt * sizeof *order);
    produced = calloc (nt, sizeof *produced);
    if (!cid || !order || !produced) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory");
        goto err;
    }
    /* Number tensors by first use: graph inputs, then each node's inputs
     * and outputs in node order, then graph outputs.  Tensors nothing
     * uses do not appear at all. */
    for (int t = 0; t < g->n_tensors; t++)
        cid[t] = -1;
    int nc = 0;
#define S_VISIT(t) do { int t_ = (t); if (t_ >= 0 && cid[t_] < 0) { cid[t_] = nc; order[nc++] = t_; } } while (0)
    for (int i = 0; i < g->n_inputs; i++)
        S_VISIT (g->inputs[i]);
    for (int n = 0; n < g->n_nodes; n++) {
        const kiln_node_t *node = &g->nodes[n];
        for (int i = 0; i < node->n_inputs; i++)
            S_VISIT (node->inputs[i]);
        for (int i = 0; i < node->n_outputs; i++) {
            S_VISIT (node->outputs[i]);
            produced[node->outputs[i]] = true;
        }
    }
    for (int i = 0; i < g->n_outputs; i++)
        S_VISIT (g->outputs[i]);
#undef S_VISIT

    /* The I/O structure is part of the interface, but only a graph that
     * has one gets the eighth element: every digest taken before the
     * field existed stays what it was. */
    bool has_io_structure = g->io_structure && *g->io_structure;
    msgpack_packer pk;
    msgpack_packer_init (&pk, &buf, s_buf_write);
    msgpack_pack_array (&pk, has_io_structure ? 8 : 7);
    kiln_mpk_pack_cstr (&pk, S_CANON_FORMAT);
    msgpack_pack_int (&pk, KILN_GRAPH_FORMAT_VERSION);
    msgpack_pack_int (&pk, g->opset);

    /* A tensor a node produces is entered without dtype or shape: those
     * follow from the node's inputs, so leaving them out makes the digest
     * the same before and after shape inference. */
    msgpack_pack_array (&pk, (size_t) nc);
    for (int k = 0; k < nc && !buf.failed; k++) {
        const kiln_tensor_t *tensor = &g->tensors[order[k]];
        msgpack_pack_array (&pk, 3);
        if (produced[order[k]]) {
            msgpack_pack_int (&pk, KILN_DT_UNDEFINED);
            msgpack_pack_nil (&pk);
            msgpack_pack_nil (&pk);
            continue;
        }
        msgpack_pack_int (&pk, (int) tensor->dtype);
        s_pack_shape (&pk, &tensor->shape);
        if (tensor->weight >= 0) {
            msgpack_pack_bin (&pk, KILN_DIGEST_LEN);
            msgpack_pack_bin_body (&pk, g->weights[tensor->weight].digest, KILN_DIGEST_LEN);
        }
        else
            msgpack_pack_nil (&pk);
    }

    msgpack_pack_array (&pk, (size_t) g->n_nodes);
    for (int n = 0; n < g->n_nodes && !buf.failed; n++) {
        const kiln_node_t *node = &g->nodes[n];
        /* Absent optional inputs at the end mean the same as no input. */
        int n_in = node->n_inputs;
        while (n_in > 0 && node->inputs[n_in - 1] < 0)
            n_in--;
        msgpack_pack_array (&pk, 4);
        kiln_mpk_pack_cstr (&pk, node->op);
        msgpack_pack_array (&pk, (size_t) n_in);
        for (int i = 0; i < n_in; i++)
            msgpack_pack_int (&pk, node->inputs[i] < 0 ? -1 : cid[node->inputs[i]]);
        msgpack_pack_array (&pk, (size_t) node->n_outputs);
        for (int i = 0; i < node->n_outputs; i++)
            msgpack_pack_int (&pk, cid[node->outputs[i]]);
        int idx[KILN_MAX_ATTRS];
        s_sort_attrs (node, idx);
        msgpack_pack_array (&pk, (size_t) node->n_attrs);
        for (int i = 0; i < node->n_attrs; i++) {
            const kiln_attr_t *a = &node->attrs[idx[i]];
            msgpack_pack_array (&pk, 3);
            kiln_mpk_pack_cstr (&pk, a->name);
            msgpack_pack_int (&pk, (int) a->kind);
            s_pack_attr_value (&pk, a, true);
        }
    }

    msgpack_pack_array (&pk, (size_t) g->n_inputs);
    for (int i = 0; i < g->n_inputs; i++) {
        msgpack_pack_array (&pk, 2);
        msgpack_pack_int (&pk, cid[g->inputs[i]]);
        kiln_mpk_pack_cstr (&pk, g->tensors[g->inputs[i]].name);
    }
    msgpack_pack_array (&pk, (size_t) g->n_outputs);
    for (int i = 0; i < g->n_outputs; i++) {
        msgpack_pack_array (&pk, 2);
        msgpack_pack_int (&pk, cid[g->outputs[i]]);
        kiln_mpk_pack_cstr (&pk, g->tensors[g->outputs[i]].name);
    }
    if (has_io_structure)
        kiln_mpk_pack_cstr (&pk, g->io_structure);
    rc = s_buf_finish (&buf, "canonical graph", out, len, err);
err:
    free (buf.data);
    free (cid);
    free (order);
    free (produced);
    return rc;
}

int
kiln_graph_digest (const kiln_graph_t *g, char out[KILN_HEX_LEN], kiln_err_t *err)
{
    uint8_t *bytes = NULL;
    size_t len = 0;
    int rc = kiln_graph_canonical (g, &bytes, &len, err);
    if (rc)
        return rc;
    uint8_t digest[KILN_DIGEST_LEN];
    kiln_sha256 (bytes, len, digest);
    kiln_hex (digest, KILN_DIGEST_LEN, out);
    free (bytes);
    return 0;
}
