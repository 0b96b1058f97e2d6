/*
 * kiln_shape_ops — parameters of the shape, data-movement and window ops,
 * shared by inference, folding and lowering (see kiln_shape_ops.h).
 *
 * Semantics follow the ONNX operator specification (opsets 11 to 18);
 * where a rule is subtle the comment quotes or paraphrases it.
 */
#include "graph/kiln_shape_ops.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "common/kiln_half.h"

#define S_SHAPE_MAX 160

/* --- helpers --------------------------------------------------------- */

static bool
s_has (const kiln_node_t *node, int i)
{
    return i < node->n_inputs && node->inputs[i] >= 0;
}

static const char *
s_tname (const kiln_graph_t *g, int t)
{
    const char *n = g->tensors[t].name;
    return n && *n ? n : "(unnamed)";
}

static const char *
s_shape (const kiln_shape_t *s, char *buf)
{
    return kiln_shape_str (s, buf, S_SHAPE_MAX);
}

/* The attribute `name` of `kind`, or NULL when absent; an attribute of
 * another kind is an error. */
static int
s_attr (const kiln_node_t *node, const char *name, kiln_attr_kind_t kind,
        const kiln_attr_t **out, kiln_err_t *err)
{
    *out = kiln_node_attr (node, name);
    if (*out && (*out)->kind != kind)
        return kiln_error (err, KILN_EFORMAT, "attribute '%s' has the wrong kind", name);
    return 0;
}

static int
s_attr_int (const kiln_node_t *node, const char *name, int64_t fallback,
            int64_t lo, int64_t hi, int64_t *v, kiln_err_t *err)
{
    const kiln_attr_t *a;
    int rc = s_attr (node, name, KILN_ATTR_INT, &a, err);
    if (rc)
        return rc;
    *v = a ? a->i : fallback;
    if (*v < lo || *v > hi)
        return kiln_error (err, KILN_EFORMAT, "attribute '%s' is %lld, outside %lld..%lld",
                           name, (long long) *v, (long long) lo, (long long) hi);
    return 0;
}

/* String attribute or `fallback`. */
static int
s_attr_str (const kiln_node_t *node, const char *name, const char *fallback,
            const char **v, kiln_err_t *err)
{
    const kiln_attr_t *a;
    int rc = s_attr (node, name, KILN_ATTR_STRING, &a, err);
    if (rc)
        return rc;
    *v = a && a->s ? a->s : fallback;
    return 0;
}

/* An INTS attribute of at most `max` values into v[]; *n = -1 when absent. */
static int
s_attr_list (const kiln_node_t *node, const char *name, int max, int64_t *v,
             int *n, kiln_err_t *err)
{
    const kiln_attr_t *a;
    int rc = s_attr (node, name, KILN_ATTR_INTS, &a, err);
    if (rc)
        return rc;
    *n = -1;
    if (!a)
        return 0;
    if (a->n > (size_t) max)
        return kiln_error (err, KILN_ELIMIT, "attribute '%s' has %zu values, more than %d",
                           name, a->n, max);
    memcpy (v, a->ints, a->n * sizeof *v);
    *n = (int) a->n;
    return 0;
}

/* Normalise axis `a` of a rank-`rank` tensor into 0..rank-1. */
static int
s_axis (int64_t a, int rank, const char *what, int *out, kiln_err_t *err)
{
    if (a < -rank || a >= rank)
        return kiln_error (err, KILN_EFORMAT, "%s %lld is outside %d..%d", what,
                           (long long) a, -rank, rank - 1);
    *out = (int) (a < 0 ? a + rank : a);
    return 0;
}

/* Normalise n axes in place, refusing repeats. */
static int
s_axes_norm (int64_t *axes, int n, int rank, const char *what, kiln_err_t *err)
{
    for (int i = 0; i < n; i++) {
        int a = 0;
        int rc = s_axis (axes[i], rank, what, &a, err);
        if (rc)
            return rc;
        axes[i] = a;
        for (int j = 0; j < i; j++)
            if (axes[j] == a)
                return kiln_error (err, KILN_EFORMAT, "%s %d is listed twice", what, a);
    }
    return 0;
}

/* A parameter that is input `i` from some opset on and attribute `name`
 * before: the input when the node has it, else the attribute; *n = -1
 * when neither is there. */
static int
s_ints_param (const kiln_graph_t *g, const kiln_node_t *node, int i,
              const char *name, int max, int64_t *v, int *n, kiln_err_t *err)
{
    if (s_has (node, i))
        return kiln_const_ints (g, node, i, name, max, v, n, err);
    return s_attr_list (node, name, max, v, n, err);
}

static int
s_dim_ok (int64_t d, const char *what, kiln_err_t *err)
{
    if (d < 0 || d > KILN_MAX_DIM)
        return kiln_error (err, KILN_ELIMIT, "%s would be %lld, outside 0..%lld", what,
                           (long long) d, (long long) KILN_MAX_DIM);
    return 0;
}

/* --- constants ------------------------------------------------------- */

bool
kiln_const_input (const kiln_graph_t *g, const kiln_node_t *node, int i)
{
    if (!s_has (node, i))
        return false;
    const kiln_tensor_t *t = &g->tensors[node->inputs[i]];
    return t->weight >= 0 && t->weight < g->n_weights && g->weights[t->weight].data;
}

/* The constant tensor of input i with at most `max` elements, checked. */
static int
s_const (const kiln_graph_t *g, const kiln_node_t *node, int i, const char *what,
         int max, const kiln_tensor_t **out, const uint8_t **data, int *n,
         kiln_err_t *err)
{
    if (!s_has (node, i))
        return kiln_error (err, KILN_EINVAL, "%s (input %d) is missing", what, i);
    int t = node->inputs[i];
    const kiln_tensor_t *tensor = &g->tensors[t];
    if (tensor->weight < 0)
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "%s '%s' is computed at run time; kiln needs it as a constant "
                           "because shapes are fixed at compile time", what, s_tname (g, t));
    if (!g->weights[tensor->weight].data)
        return kiln_error (err, KILN_EINVAL, "%s '%s' has no weight data attached", what,
                           s_tname (g, t));
    if (tensor->shape.rank > 1)
        return kiln_error (err, KILN_ESHAPE, "%s '%s' has rank %d, expected 0 or 1", what,
                           s_tname (g, t), tensor->shape.rank);
    int64_t count = tensor->shape.rank == 0 ? 1 : tensor->shape.dims[0];
    if (count > max)
        return kiln_error (err, KILN_ELIMIT, "%s '%s' has %lld values, more than %d", what,
                           s_tname (g, t), (long long) count, max);
    *out = tensor;
    *data = g->weights[tensor->weight].data;
    *n = (int) count;
    return 0;
}

int
kiln_const_ints (const kiln_graph_t *g, const kiln_node_t *node, int i,
                 const char *what, int max, int64_t *v, int *n, kiln_err_t *err)
{
    const kiln_tensor_t *t;
    const uint8_t *data;
    int rc = s_const (g, node, i, what, max, &t, &data, n, err);
    if (rc)
        return rc;
    for (int k = 0; k < *n; k++) {
        /* Weights are little-endian, as the host is (kiln_onnx.c checks). */
        if (t->dtype == KILN_DT_INT64)
            memcpy (&v[k], data + 8 * k, 8);
        else if (t->dtype == KILN_DT_INT32) {
            int32_t x;
            memcpy (&x, data + 4 * k, 4);
            v[k] = x;
        }
        else
            return kiln_error (err, KILN_ESHAPE, "%s '%s' is %s, expected int64", what,
                               s_tname (g, node->inputs[i]), kiln_dtype_name (t->dtype));
    }
    return 0;
}

int
kiln_const_floats (const kiln_graph_t *g, const kiln_node_t *node, int i,
                   const char *what, int max, double *v, int *n, kiln_err_t *err)
{
    const kiln_tensor_t *t;
    const uint8_t *data;
    int rc = s_const (g, node, i, what, max, &t, &data, n, err);
    if (rc)
        return rc;
    for (int k = 0; k < *n; k++) {
        switch (t->dtype) {
        case KILN_DT_FLOAT32: { float x; memcpy (&x, data + 4 * k, 4); v[k] = x; break; }
        case KILN_DT_FLOAT64: memcpy (&v[k], data + 8 * k, 8); break;
        case KILN_DT_FLOAT16: { uint16_t x; memcpy (&x, data + 2 * k, 2); v[k] = kiln_f16_to_f32 (x); break; }
        case KILN_DT_BFLOAT16: { uint16_t x; memcpy (&x, data + 2 * k, 2); v[k] = kiln_bf16_to_f32 (x); break; }
        case KILN_DT_INT64: { int64_t x; memcpy (&x, data + 8 * k, 8); v[k] = (double) x; break; }
        case KILN_DT_INT32: { int32_t x; memcpy (&x, data + 4 * k, 4); v[k] = x; break; }
        case KILN_DT_INT8: v[k] = (int8_t) data[k]; break;
        case KILN_DT_UINT8: case KILN_DT_BOOL: v[k] = data[k]; break;
        default:
            return kiln_error (err, KILN_EUNSUPPORTED, "%s '%s' is %s, which is not supported here",
                               what, s_tname (g, node->inputs[i]), kiln_dtype_name (t->dtype));
        }
    }
    return 0;
}

/* --- reshaping ----------------------------------------------------- */

int
kiln_transpose_perm (const kiln_graph_t *g, const kiln_node_t *node, int rank,
                     int64_t *perm, kiln_err_t *err)
{
    int n, rc = s_attr_list (node, "perm", KILN_MAX_RANK, perm, &n, err);
    if (rc)
        return rc;
    if (n < 0) {
        for (int i = 0; i < rank; i++)
            perm[i] = rank - 1 - i;
        return 0;
    }
    if (n != rank)
        return kiln_error (err, KILN_EFORMAT, "attribute 'perm' has %d values for an input of rank %d",
                           n, rank);
    bool seen[KILN_MAX_RANK] = { false };
    for (int i = 0; i < n; i++) {
        if (perm[i] < 0 || perm[i] >= rank || seen[perm[i]])
            return kiln_error (err, KILN_EFORMAT, "attribute 'perm' is not a permutation of 0..%d",
                               rank - 1);
        seen[perm[i]] = true;
    }
    return 0;
}

int
kiln_squeeze_shape (const kiln_graph_t *g, const kiln_node_t *node,
                    const kiln_shape_t *in, kiln_shape_t *out, kiln_err_t *err)
{
    int64_t axes[KILN_MAX_RANK];
    int n, rc;
    if ((rc = s_ints_param (g, node, 1, "axes", KILN_MAX_RANK, axes, &n, err))
        || (rc = s_axes_norm (axes, n < 0 ? 0 : n, in->rank, "axis", err)))
        return rc;
    bool drop[KILN_MAX_RANK] = { false };
    char sb[S_SHAPE_MAX];
    for (int i = 0; i < n; i++) {
        if (in->dims[axes[i]] != 1)
            return kiln_error (err, KILN_ESHAPE, "cannot squeeze axis %lld of %s: its size is %lld",
                               (long long) axes[i], s_shape (in, sb),
                               (long long) in->dims[axes[i]]);
        drop[axes[i]] = true;
    }
    out->rank = 0;
    for (int i = 0; i < in->rank; i++)
        if (!(n < 0 ? in->dims[i] == 1 : drop[i]))
            out->dims[out->rank++] = in->dims[i];
    return 0;
}

int
kiln_unsqueeze_shape (const kiln_graph_t *g, const kiln_node_t *node,
                      const kiln_shape_t *in, kiln_shape_t *out, kiln_err_t *err)
{
    int64_t axes[KILN_MAX_RANK];
    int n, rc;
    if ((rc = s_ints_param (g, node, 1, "axes", KILN_MAX_RANK, axes, &n, err)))
        return rc;
    if (n < 0)
        return kiln_error (err, KILN_EFORMAT, "needs axes (an input from opset 13, an attribute before)");
    int r = in->rank + n;
    if (r > KILN_MAX_RANK)
        return kiln_error (err, KILN_ELIMIT, "the output would have rank %d, more than %d", r,
                           KILN_MAX_RANK);
    if ((rc = s_axes_norm (axes, n, r, "axis", err)))
        return rc;
    bool one[KILN_MAX_RANK] = { false };
    for (int i = 0; i < n; i++)
        one[axes[i]] = true;
    out->rank = r;
    for (int i = 0, k = 0; i < r; i++)
        out->dims[i] = one[i] ? 1 : in->dims[k++];
    return 0;
}

int
kiln_shape_range (const kiln_node_t *node, int rank, int *start, int *end,
                  kiln_err_t *err)
{
    int64_t s, e;
    int rc;
    if ((rc = s_attr_int (node, "start", 0, INT64_MIN, INT64_MAX, &s, err))
        || (rc = s_attr_int (node, "end", rank, INT64_MIN, INT64_MAX, &e, err)))
        return rc;
    if (s < 0)
        s += rank;
    if (e < 0)
        e += rank;
    s = s < 0 ? 0 : s > rank ? rank : s;
    e = e < 0 ? 0 : e > rank ? rank : e;
    *start = (int) s;
    *end = (int) (e < s ? s : e);
    return 0;
}

int
kiln_d2s_params (const kiln_node_t *node, bool depth, const kiln_shape_t *in,
                 int64_t *block, bool *crd, kiln_shape_t *out, kiln_err_t *err)
{
    const kiln_attr_t *a;
    const char *mode;
    char sb[S_SHAPE_MAX];
    int rc;
    if ((rc = s_attr (node, "blocksize", KILN_ATTR_INT, &a, err))
        || (rc = s_attr_str (node, "mode", "DCR", &mode, err)))
        return rc;
    if (!a)
        return kiln_error (err, KILN_EFORMAT, "attribute 'blocksize' is required");
    if (a->i < 1 || a->i > 65536)
        return kiln_error (err, KILN_EFORMAT, "attribute 'blocksize' is %lld, outside 1..65536",
                           (long long) a->i);
    int64_t b = a->i;
    *block = b;
    *crd = false;
    if (depth) {
        if (strcmp (mode, "CRD") == 0)
            *crd = true;
        else if (strcmp (mode, "DCR") != 0)
            return kiln_error (err, KILN_EFORMAT, "attribute 'mode' is '%s', expected DCR or CRD",
                               mode);
    }
    if (in->rank != 4)
        return kiln_error (err, KILN_ESHAPE, "input %s has rank %d, expected 4",
                           s_shape (in, sb), in->rank);
    *out = *in;
    if (depth) {
        if (in->dims[1] % (b * b) != 0)
            return kiln_error (err, KILN_ESHAPE, "input %s: %lld channels do not divide by blocksize^2 = %lld",
                               s_shape (in, sb), (long long) in->dims[1], (long long) (b * b));
        out->dims[1] = in->dims[1] / (b * b);
        out->dims[2] = in->dims[2] * b;
        out->dims[3] = in->dims[3] * b;
    }
    else {
        if (in->dims[2] % b != 0 || in->dims[3] % b != 0)
            return kiln_error (err, KILN_ESHAPE, "input %s: height and width must divide by blocksize %lld",
                               s_shape (in, sb), (long long) b);
        out->dims[1] = in->dims[1] * b * b;
        out->dims[2] = in->dims[2] / b;
        out->dims[3] = in->dims[3] / b;
    }
    for (int i = 1; i < 4; i++)
        if ((rc = s_dim_ok (out->dims[i], "an output dimension", err)))
            return rc;
    return 0;
}

/* --- selecting and joining ------------------------------------------ */

int
kiln_concat_params (const kiln_node_t *node, const kiln_shape_t *const *ins, int n,
                    int *axis, kiln_shape_t *out, kiln_err_t *err)
{
    const kiln_attr_t *a;
    char s1[S_SHAPE_MAX], s2[S_SHAPE_MAX];
    int rc = s_attr (node, "axis", KILN_ATTR_INT, &a, err);
    if (rc)
        return rc;
    if (!a)
        return kiln_error (err, KILN_EFORMAT, "attribute 'axis' is required");
    if (n < 1)
        return kiln_error (err, KILN_EINVAL, "needs at least one input");
    int r = ins[0]->rank;
    if (r < 1)
        return kiln_error (err, KILN_ESHAPE, "cannot concatenate scalars");
    if ((rc = s_axis (a->i, r, "attribute 'axis'", axis, err)))
        return rc;
    *out = *ins[0];
    for (int i = 1; i < n; i++) {
        const kiln_shape_t *s = ins[i];
        bool ok = s->rank == r;
        for (int k = 0; ok && k < r; k++)
            ok = k == *axis || s->dims[k] == ins[0]->dims[k];
        if (!ok)
            return kiln_error (err, KILN_ESHAPE, "input %d %s does not match input 0 %s except along axis %d",
                               i, s_shape (s, s1), s_shape (ins[0], s2), *axis);
        out->dims[*axis] += s->dims[*axis];
        if ((rc = s_dim_ok (out->dims[*axis], "the concatenated dimension", err)))
            return rc;
    }
    return 0;
}

int
kiln_split_sizes (const kiln_graph_t *g, const kiln_node_t *node,
                  const kiln_shape_t *in, int *axis, int64_t *sizes, kiln_err_t *err)
{
    int64_t a;
    int rc, n_out = node->n_outputs, n;
    char sb[S_SHAPE_MAX];
    if ((rc = s_attr_int (node, "axis", 0, INT64_MIN, INT64_MAX, &a, err))
        || (rc = s_axis (a, in->rank, "attribute 'axis'", axis, err)))
        return rc;
    int64_t d = in->dims[*axis];
    if ((rc = s_ints_param (g, node, 1, "split", KILN_MAX_NODE_IO, sizes, &n, err)))
        return rc;
    if (n < 0) {
        const kiln_attr_t *no;
        if ((rc = s_attr (node, "num_outputs", KILN_ATTR_INT, &no, err)))
            return rc;
        if (no && no->i != n_out)
            return kiln_error (err, KILN_EFORMAT, "attribute 'num_outputs' is %lld but the node has %d outputs",
                               (long long) no->i, n_out);
        /* Opset 18: "If the tensor is not evenly splittable the last chunk
         * will be smaller"; before, it had to split evenly. */
        int64_t chunk = (d + n_out - 1) / n_out;
        if (!no && d % n_out != 0)
            return kiln_error (err, KILN_ESHAPE, "axis %d of %s (%lld) does not split evenly into %d outputs",
                               *axis, s_shape (in, sb), (long long) d, n_out);
        for (int i = 0; i < n_out; i++)
            sizes[i] = i < n_out - 1 ? chunk : d - chunk * (n_out - 1);
        if (sizes[n_out - 1] < 0)
            return kiln_error (err, KILN_ESHAPE, "axis %d of %s (%lld) cannot be split into %d chunks of %lld",
                               *axis, s_shape (in, sb), (long long) d, n_out, (long long) chunk);
        return 0;
    }
    if (n != n_out)
        return kiln_error (err, KILN_EFORMAT, "split has %d values but the node has %d outputs",
                           n, n_out);
    int64_t sum = 0;
    for (int i = 0; i < n; i++) {
        if (sizes[i] < 0 || sizes[i] > KILN_MAX_DIM)
            return kiln_error (err, KILN_EFORMAT, "split[%d] is %lld", i, (long long) sizes[i]);
        sum += sizes[i];
    }
    if (sum != d)
        return kiln_error (err, KILN_ESHAPE, "split sums to %lld but axis %d of %s is %lld",
                           (long long) sum, *axis, s_shape (in, sb), (long long) d);
    return 0;
}

int
kiln_slice_params (const kiln_graph_t *g, const kiln_node_t *node,
                   const kiln_shape_t *in, int64_t *start, int64_t *step,
                   kiln_shape_t *out, kiln_err_t *err)
{
    int64_t starts[KILN_MAX_RANK], ends[KILN_MAX_RANK], axes[KILN_MAX_RANK],
        steps[KILN_MAX_RANK];
    int ns, ne, na = -1, nst = -1, rc, r = in->rank;
    /* Opset 10 moved starts, ends and axes from attributes to inputs and
     * added steps. */
    if (s_has (node, 1)) {
        if ((rc = kiln_const_ints (g, node, 1, "starts", KILN_MAX_RANK, starts, &ns, err))
            || (rc = kiln_const_ints (g, node, 2, "ends", KILN_MAX_RANK, ends, &ne, err))
            || (s_has (node, 3)
                && (rc = kiln_const_ints (g, node, 3, "axes", KILN_MAX_RANK, axes, &na, err)))
            || (s_has (node, 4)
                && (rc = kiln_const_ints (g, node, 4, "steps", KILN_MAX_RANK, steps, &nst, err))))
            return rc;
    }
    else if ((rc = s_attr_list (node, "starts", KILN_MAX_RANK, starts, &ns, err))
             || (rc = s_attr_list (node, "ends", KILN_MAX_RANK, ends, &ne, err))
             || (rc = s_attr_list (node, "axes", KILN_MAX_RANK, axes, &na, err)))
        return rc;
    if (ns < 0 || ne < 0)
        return kiln_error (err, KILN_EFORMAT, "needs starts and ends");
    if (ns != ne || (na >= 0 && na != ns) || (nst >= 0 && nst != ns))
        return kiln_error (err, KILN_EFORMAT, "starts, ends, axes and steps differ in length");
    if (ns > r)
        return kiln_error (err, KILN_EFORMAT, "slices %d axes of a rank-%d input", ns, r);
    if (na < 0)
        for (int i = 0; i < ns; i++)
            axes[i] = i;
    if ((rc = s_axes_norm (axes, ns, r, "axis", err)))
        return rc;
    *out = *in;
    for (int i = 0; i < r; i++) {
        start[i] = 0;
        step[i] = 1;
    }
    for (int k = 0; k < ns; k++) {
        int a = (int) axes[k];
        int64_t d = in->dims[a], s = nst >= 0 ? steps[k] : 1;
        int64_t st = starts[k], en = ends[k], cnt;
        if (s == 0)
            return kiln_error (err, KILN_EFORMAT, "step for axis %d is 0", a);
        /* d <= 2^31, so adding it to any int64 below 0 cannot overflow. */
        if (st < 0)
            st += d;
        if (en < 0)
            en += d;
        if (s > 0) {
            st = st < 0 ? 0 : st > d ? d : st;
            en = en < 0 ? 0 : en > d ? d : en;
            cnt = en > st ? (en - st - 1) / s + 1 : 0;
        }
        else {
            st = st < 0 ? 0 : st > d - 1 ? d - 1 : st;
            en = en < -1 ? -1 : en > d - 1 ? d - 1 : en;
            cnt = st > en ? (st - en - 1) / -s + 1 : 0;
        }
        start[a] = cnt > 0 ? st : 0;
        /* One element or none: the step never moves, so keep it small. */
        step[a] = cnt > 1 ? s : 1;
        out->dims[a] = cnt;
    }
    return 0;
}

int
kiln_gather_params (const kiln_node_t *node, const kiln_shape_t *data,
                    const kiln_shape_t *indices, int *axis, kiln_shape_t *out,
                    kiln_err_t *err)
{
    int64_t a;
    int rc;
    if (data->rank < 1)
        return kiln_error (err, KILN_ESHAPE, "cannot gather from a scalar");
    if ((rc = s_attr_int (node, "axis", 0, INT64_MIN, INT64_MAX, &a, err))
        || (rc = s_axis (a, data->rank, "attribute 'axis'", axis, err)))
        return rc;
    int r = data->rank - 1 + indices->rank;
    if (r > KILN_MAX_RANK)
        return kiln_error (err, KILN_ELIMIT, "the output would have rank %d, more than %d", r,
                           KILN_MAX_RANK);
    out->rank = 0;
    for (int i = 0; i < *axis; i++)
        out->dims[out->rank++] = data->dims[i];
    for (int i = 0; i < indices->rank; i++)
        out->dims[out->rank++] = indices->dims[i];
    for (int i = *axis + 1; i < data->rank; i++)
        out->dims[out->rank++] = data->dims[i];
    return 0;
}

/* --- growing --------------------------------------------------------- */

int
kiln_pad_params (const kiln_graph_t *g, const kiln_node_t *node,
                 const kiln_shape_t *in, int64_t *pads, kiln_pad_mode_t *mode,
                 double *value, kiln_shape_t *out, kiln_err_t *err)
{
    const char *m;
    int r = in->rank, n, rc;
    char sb[S_SHAPE_MAX];
    if ((rc = s_attr_str (node, "mode", "constant", &m, err)))
        return rc;
    if (strcmp (m, "constant") == 0)
        *mode = KILN_PAD_CONSTANT;
    else if (strcmp (m, "reflect") == 0)
        *mode = KILN_PAD_REFLECT;
    else if (strcmp (m, "edge") == 0)
        *mode = KILN_PAD_EDGE;
    else
        return kiln_error (err, KILN_EUNSUPPORTED, "mode '%s' (constant, reflect and edge are supported)",
                           m);
    int64_t raw[2 * KILN_MAX_RANK], axes[KILN_MAX_RANK];
    if ((rc = s_ints_param (g, node, 1, "pads", 2 * KILN_MAX_RANK, raw, &n, err)))
        return rc;
    if (n < 0)
        return kiln_error (err, KILN_EFORMAT, "needs pads (an input from opset 11, an attribute before)");
    int na = r;
    for (int i = 0; i < r; i++)
        axes[i] = i;
    if (s_has (node, 3)) {
        /* Opset 18: pads for the listed axes only. */
        if ((rc = kiln_const_ints (g, node, 3, "axes", KILN_MAX_RANK, axes, &na, err))
            || (rc = s_axes_norm (axes, na, r, "axis", err)))
            return rc;
    }
    if (n != 2 * na)
        return kiln_error (err, KILN_EFORMAT, "pads has %d values, expected %d for %s", n,
                           2 * na, s_shape (in, sb));
    for (int i = 0; i < 2 * r; i++)
        pads[i] = 0;
    for (int i = 0; i < na; i++) {
        pads[axes[i]] = raw[i];
        pads[r + axes[i]] = raw[na + i];
    }
    *value = 0.0;
    if (s_has (node, 2)) {
        double v[1];
        int nv;
        if ((rc = kiln_const_floats (g, node, 2, "constant_value", 1, v, &nv, err)))
            return rc;
        if (nv == 1)
            *value = v[0];
    }
    else {
        const kiln_attr_t *va;
        if ((rc = s_attr (node, "value", KILN_ATTR_FLOAT, &va, err)))
            return rc;
        if (va)
            *value = va->f;
    }
    *out = *in;
    for (int i = 0; i < r; i++) {
        if (pads[i] < -KILN_MAX_DIM || pads[i] > KILN_MAX_DIM || pads[r + i] < -KILN_MAX_DIM
            || pads[r + i] > KILN_MAX_DIM)
            return kiln_error (err, KILN_ELIMIT, "pads for axis %d are out of range", i);
        int64_t d = in->dims[i] + pads[i] + pads[r + i];
        /* Negative pads crop first (as onnxruntime does); what is left
         * is padded. */
        int64_t kept = in->dims[i] + (pads[i] < 0 ? pads[i] : 0) + (pads[r + i] < 0 ? pads[r + i] : 0);
        if (d < 0 || kept < 0)
            return kiln_error (err, KILN_ESHAPE, "pads %lld and %lld crop axis %d of %s below zero",
                               (long long) pads[i], (long long) pads[r + i], i, s_shape (in, sb));
        if ((rc = s_dim_ok (d, "a padded dimension", err)))
            return rc;
        if (*mode != KILN_PAD_CONSTANT && kept == 0 && d > 0)
            return kiln_error (err, KILN_ESHAPE, "cannot %s-pad axis %d of %s: it is empty", m, i,
                               s_shape (in, sb));
        out->dims[i] = d;
    }
    return 0;
}

int
kiln_tile_shape (const kiln_graph_t *g, const kiln_node_t *node,
                 const kiln_shape_t *in, kiln_shape_t *out, kiln_err_t *err)
{
    int64_t rep[KILN_MAX_RANK];
    int n, rc;
    char sb[S_SHAPE_MAX];
    if ((rc = kiln_const_ints (g, node, 1, "repeats", KILN_MAX_RANK, rep, &n, err)))
        return rc;
    if (n != in->rank)
        return kiln_error (err, KILN_ESHAPE, "repeats has %d values for input %s", n,
                           s_shape (in, sb));
    *out = *in;
    for (int i = 0; i < n; i++) {
        if (rep[i] < 0 || rep[i] > KILN_MAX_DIM)
            return kiln_error (err, KILN_EFORMAT, "repeats[%d] is %lld", i, (long long) rep[i]);
        if (in->dims[i] != 0 && rep[i] > KILN_MAX_DIM / in->dims[i])
            return kiln_error (err, KILN_ELIMIT, "tiling axis %d of %s %lld times is too large",
                               i, s_shape (in, sb), (long long) rep[i]);
        out->dims[i] = in->dims[i] * rep[i];
    }
    return 0;
}

int
kiln_expand_shape (const kiln_graph_t *g, const kiln_node_t *node,
                   const kiln_shape_t *in, kiln_shape_t *out, kiln_err_t *err)
{
    int64_t sh[KILN_MAX_RANK];
    int n, rc;
    char s1[S_SHAPE_MAX], s2[S_SHAPE_MAX];
    if ((rc = kiln_const_ints (g, node, 1, "shape", KILN_MAX_RANK, sh, &n, err)))
        return rc;
    kiln_shape_t want = { .rank = n };
    for (int i = 0; i < n; i++) {
        if (sh[i] < 0 || sh[i] > KILN_MAX_DIM)
            return kiln_error (err, KILN_EFORMAT, "shape[%d] is %lld", i, (long long) sh[i]);
        want.dims[i] = sh[i];
    }
    int r = in->rank > n ? in->rank : n;
    out->rank = r;
    for (int i = 0; i < r; i++) {
        int ia = i - (r - in->rank), ib = i - (r - n);
        int64_t da = ia >= 0 ? in->dims[ia] : 1, db = ib >= 0 ? want.dims[ib] : 1;
        if (da != db && da != 1 && db != 1)
            return kiln_error (err, KILN_ESHAPE, "cannot expand %s to %s", s_shape (in, s1),
                               s_shape (&want, s2));
        out->dims[i] = da == 1 ? db : da;
    }
    return 0;
}

/* --- Resize ---------------------------------------------------------- */

int
kiln_resize_params (const kiln_graph_t *g, const kiln_node_t *node,
                    const kiln_shape_t *in, kiln_resize_t *rp, kiln_shape_t *out,
                    kiln_err_t *err)
{
    int r = in->rank, rc;
    char sb[S_SHAPE_MAX];
    const char *mode, *coord, *nearest, *policy;
    int64_t exclude, antialias;
    /* Resize-10 takes (X, scales) and maps coordinates asymmetrically;
     * from 11 it is (X, roi, scales, sizes) with a choice of mappings. */
    bool v10 = g->opset > 0 && g->opset < 11;
    if ((rc = s_attr_str (node, "mode", "nearest", &mode, err))
        || (rc = s_attr_str (node, "coordinate_transformation_mode",
                             v10 ? "asymmetric" : "half_pixel", &coord, err))
        || (rc = s_attr_str (node, "nearest_mode", "round_prefer_floor", &nearest, err))
        || (rc = s_attr_str (node, "keep_aspect_ratio_policy", "stretch", &policy, err))
        || (rc = s_attr_int (node, "exclude_outside", 0, 0, 1, &exclude, err))
        || (rc = s_attr_int (node, "antialias", 0, 0, 1, &antialias, err)))
        return rc;
    if (strcmp (mode, "nearest") == 0)
        rp->mode = KILN_RESIZE_NEAREST;
    else if (strcmp (mode, "linear") == 0)
        rp->mode = KILN_RESIZE_LINEAR;
    else
        return kiln_error (err, KILN_EUNSUPPORTED, "mode '%s' (nearest and linear are supported)", mode);
    if (strcmp (coord, "half_pixel") == 0)
        rp->coord = KILN_COORD_HALF_PIXEL;
    else if (strcmp (coord, "asymmetric") == 0)
        rp->coord = KILN_COORD_ASYMMETRIC;
    else if (strcmp (coord, "align_corners") == 0)
        rp->coord = KILN_COORD_ALIGN_CORNERS;
    else if (strcmp (coord, "pytorch_half_pixel") == 0)
        rp->coord = KILN_COORD_PYTORCH_HALF_PIXEL;
    else
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "coordinate_transformation_mode '%s' (half_pixel, asymmetric, "
                           "align_corners and pytorch_half_pixel are supported)", coord);
    if (strcmp (nearest, "round_prefer_floor") == 0)
        rp->nearest = KILN_NEAREST_ROUND_PREFER_FLOOR;
    else if (strcmp (nearest, "round_prefer_ceil") == 0)
        rp->nearest = KILN_NEAREST_ROUND_PREFER_CEIL;
    else if (strcmp (nearest, "floor") == 0)
        rp->nearest = KILN_NEAREST_FLOOR;
    else if (strcmp (nearest, "ceil") == 0)
        rp->nearest = KILN_NEAREST_CEIL;
    else
        return kiln_error (err, KILN_EFORMAT, "nearest_mode '%s' is not an ONNX mode", nearest);
    if (strcmp (policy, "stretch") != 0)
        return kiln_error (err, KILN_EUNSUPPORTED, "keep_aspect_ratio_policy '%s' (only stretch)",
                           policy);
    if (exclude || antialias)
        return kiln_error (err, KILN_EUNSUPPORTED, "%s", exclude ? "exclude_outside=1" : "antialias=1");

    int64_t axes[KILN_MAX_RANK];
    int na, is = v10 ? 1 : 2, iz = v10 ? -1 : 3;
    if ((rc = s_attr_list (node, "axes", KILN_MAX_RANK, axes, &na, err)))
        return rc;
    if (na < 0) {
        na = r;
        for (int i = 0; i < r; i++)
            axes[i] = i;
    }
    else if ((rc = s_axes_norm (axes, na, r, "axis", err)))
        return rc;
    /* Exporters write an absent input as an empty constant. */
    bool has_scales = false, has_sizes = false;
    double scales[KILN_MAX_RANK];
    int64_t sizes[KILN_MAX_RANK];
    int n;
    if (s_has (node, is)) {
        if ((rc = kiln_const_floats (g, node, is, "scales", KILN_MAX_RANK, scales, &n, err)))
            return rc;
        if (n > 0 && g->tensors[node->inputs[is]].shape.rank == 1) {
            if (n != na)
                return kiln_error (err, KILN_ESHAPE, "scales has %d values, expected %d", n, na);
            has_scales = true;
        }
    }
    if (iz >= 0 && s_has (node, iz)) {
        if ((rc = kiln_const_ints (g, node, iz, "sizes", KILN_MAX_RANK, sizes, &n, err)))
            return rc;
        if (n > 0) {
            if (n != na)
                return kiln_error (err, KILN_ESHAPE, "sizes has %d values, expected %d", n, na);
            has_sizes = true;
        }
    }
    if (has_scales == has_sizes)
        return kiln_error (err, KILN_EFORMAT, "needs exactly one of scales and sizes");
    *out = *in;
    for (int i = 0; i < r; i++)
        rp->scales[i] = 1.0f;
    for (int k = 0; k < na; k++) {
        int a = (int) axes[k];
        if (has_sizes) {
            if ((rc = s_dim_ok (sizes[k], "an output size", err)))
                return rc;
            out->dims[a] = sizes[k];
            rp->scales[a] = 0.0f;
            continue;
        }
        float s = (float) scales[k];
        if (!(s > 0.0f) || !isfinite (s))
            return kiln_error (err, KILN_EFORMAT, "scales[%d] is %g, expected a positive number", k,
                               scales[k]);
        double d = floor ((double) in->dims[a] * (double) s);
        if (d > (double) KILN_MAX_DIM)
            return kiln_error (err, KILN_ELIMIT, "resizing axis %d of %s by %g is too large", a,
                               s_shape (in, sb), (double) s);
        out->dims[a] = (int64_t) d;
        rp->scales[a] = s;
    }
    return 0;
}

/* --- ConvTranspose ------------------------------------------------- */

int
kiln_convtr_params (const kiln_node_t *node, const kiln_shape_t *x,
                    const kiln_shape_t *w, kiln_window_t *win, int64_t *out_pad,
                    int64_t *group, kiln_shape_t *out, kiln_err_t *err)
{
    char s1[S_SHAPE_MAX], s2[S_SHAPE_MAX];
    int r = x->rank, ns = r - 2, rc;
    if (r < 3)
        return kiln_error (err, KILN_ESHAPE, "input X %s has rank %d, expected at least 3",
                           s_shape (x, s1), r);
    if (w->rank != r)
        return kiln_error (err, KILN_ESHAPE, "weights %s have rank %d but X %s rank %d",
                           s_shape (w, s1), w->rank, s_shape (x, s2), r);
    if ((rc = s_attr_int (node, "group", 1, 1, KILN_MAX_DIM, group, err)))
        return rc;
    int64_t c = x->dims[1];
    if (w->dims[0] != c || c % *group != 0)
        return kiln_error (err, KILN_ESHAPE, "weights %s do not fit X %s with %lld groups",
                           s_shape (w, s1), s_shape (x, s2), (long long) *group);
    int64_t m = w->dims[1] * *group;
    if ((rc = s_dim_ok (m, "the output channel count", err)))
        return rc;
    int64_t ks[KILN_MAX_RANK], v[2 * KILN_MAX_RANK + 2];
    int n;
    win->n = ns;
    win->ceil_mode = false;
    for (int i = 0; i < ns; i++) {
        win->kernel[i] = w->dims[2 + i];
        win->strides[i] = win->dilations[i] = 1;
        win->pads[i] = win->pads[ns + i] = 0;
        out_pad[i] = 0;
    }
    if ((rc = s_attr_list (node, "kernel_shape", KILN_MAX_RANK, ks, &n, err)))
        return rc;
    for (int i = 0; i < n; i++)
        if (n != ns || ks[i] != win->kernel[i])
            return kiln_error (err, KILN_ESHAPE, "attribute 'kernel_shape' does not match weights %s",
                               s_shape (w, s1));
    static const char *const lists[] = { "strides", "dilations", "output_padding", "pads" };
    int64_t *dst[] = { win->strides, win->dilations, out_pad, win->pads };
    for (int l = 0; l < 4; l++) {
        int want = l == 3 ? 2 * ns : ns;
        if ((rc = s_attr_list (node, lists[l], 2 * KILN_MAX_RANK, v, &n, err)))
            return rc;
        if (n < 0)
            continue;
        if (n != want)
            return kiln_error (err, KILN_EFORMAT, "attribute '%s' has %d values, expected %d",
                               lists[l], n, want);
        for (int i = 0; i < n; i++) {
            int64_t lo = l < 2 ? 1 : 0;
            if (v[i] < lo || v[i] > KILN_MAX_DIM)
                return kiln_error (err, KILN_EFORMAT, "attribute '%s'[%d] is %lld", lists[l], i,
                                   (long long) v[i]);
            dst[l][i] = v[i];
        }
    }
    const char *ap;
    if ((rc = s_attr_str (node, "auto_pad", "NOTSET", &ap, err)))
        return rc;
    bool upper = strcmp (ap, "SAME_UPPER") == 0, lower = strcmp (ap, "SAME_LOWER") == 0;
    bool valid = strcmp (ap, "VALID") == 0;
    if (!upper && !lower && !valid && strcmp (ap, "NOTSET") != 0 && *ap)
        return kiln_error (err, KILN_EFORMAT, "attribute 'auto_pad' is '%s'", ap);
    /* output_shape may list the spatial dims or all of them. */
    int64_t oshape[KILN_MAX_RANK + 2];
    int no;
    if ((rc = s_attr_list (node, "output_shape", KILN_MAX_RANK + 2, oshape, &no, err)))
        return rc;
    if (no >= 0 && no != ns && no != r)
        return kiln_error (err, KILN_EFORMAT, "attribute 'output_shape' has %d values, expected %d",
                           no, ns);
    out->rank = r;
    out->dims[0] = x->dims[0];
    out->dims[1] = m;
    for (int i = 0; i < ns; i++) {
        int64_t in = x->dims[2 + i], s = win->strides[i];
        int64_t ek = (win->kernel[i] - 1) * win->dilations[i] + 1;
        if (out_pad[i] >= (s > win->dilations[i] ? s : win->dilations[i]))
            return kiln_error (err, KILN_EFORMAT, "output_padding[%d] = %lld is not less than the stride or dilation",
                               i, (long long) out_pad[i]);
        /* Every term is at most 2^31, so the sums fit int64. */
        int64_t full = s * (in > 0 ? in - 1 : 0) + out_pad[i] + ek, o;
        if (no >= 0 || upper || lower) {
            o = no >= 0 ? oshape[no == r ? 2 + i : i] : in * s;
            int64_t total = full - o;
            if (total < 0) {
                /* An output larger than the transposed convolution covers
                 * (ONNX's formula would give negative pads): the extra
                 * elements at the end hold only the bias, as onnxruntime
                 * computes it; it is more output padding. */
                out_pad[i] -= total;
                full = o;
                total = 0;
            }
            /* The ONNX formula puts the odd unit at the end for
             * SAME_UPPER, at the start otherwise. */
            win->pads[i] = upper ? total / 2 : total - total / 2;
            win->pads[ns + i] = total - win->pads[i];
        }
        else {
            if (valid)
                win->pads[i] = win->pads[ns + i] = 0;
            o = full - win->pads[i] - win->pads[ns + i];
        }
        if (o < 0 || (rc = s_dim_ok (o, "an output size", err)))
            return rc ? rc : kiln_error (err, KILN_ESHAPE,
                                         "spatial axis %d: pads %lld + %lld are larger than the output %lld",
                                         i, (long long) win->pads[i], (long long) win->pads[ns + i],
                                         (long long) full);
        out->dims[2 + i] = o;
    }
    return 0;
}

/* --- Einsum ---------------------------------------------------------- */

static bool
s_letter (char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

/* Parse one term (labels up to ',' '-' or the end) into buf. */
static int
s_term (const char **p, char *buf, kiln_err_t *err)
{
    int n = 0;
    while (**p && **p != ',' && **p != '-') {
        char c = *(*p)++;
        if (c == ' ')
            continue;
        if (c == '.')
            return kiln_error (err, KILN_EUNSUPPORTED, "an ellipsis ('...') in the equation");
        if (!s_letter (c))
            return kiln_error (err, KILN_EFORMAT, "character '%c' in the equation", c);
        if (n == KILN_MAX_RANK)
            return kiln_error (err, KILN_ELIMIT, "a term with more than %d labels", KILN_MAX_RANK);
        if (memchr (buf, c, (size_t) n))
            return kiln_error (err, KILN_EUNSUPPORTED,
                               "label '%c' repeated within one term (a diagonal)", c);
        buf[n++] = c;
    }
    buf[n] = '\0';
    return 0;
}

int
kiln_einsum_params (const kiln_node_t *node, const kiln_shape_t *const *ins, int n,
                    kiln_einsum_t *e, kiln_shape_t *out, kiln_err_t *err)
{
    const char *eq;
    int rc = s_attr_str (node, "equation", NULL, &eq, err);
    if (rc)
        return rc;
    if (!eq)
        return kiln_error (err, KILN_EFORMAT, "attribute 'equation' is required");
    if (n < 1 || n > 2)
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "Einsum of %d operands (one or two are supported)", n);
    memset (e, 0, sizeof *e);
    e->n_in = n;
    const char *p = eq;
    for (int i = 0; i < n; i++) {
        if ((rc = s_term (&p, e->in[i], err)))
            return rc;
        if (i < n - 1 && *p++ != ',')
            return kiln_error (err, KILN_EFORMAT, "equation '%s' has fewer terms than the %d inputs",
                               eq, n);
    }
    if (*p == ',')
        return kiln_error (err, KILN_EFORMAT, "equation '%s' has more terms than the %d inputs", eq, n);
    int64_t dim[128] = { 0 };
    int count[128] = { 0 };
    for (int i = 0; i < n; i++) {
        if ((int) strlen (e->in[i]) != ins[i]->rank)
            return kiln_error (err, KILN_ESHAPE, "term '%s' has %zu labels but input %d has rank %d",
                               e->in[i], strlen (e->in[i]), i, ins[i]->rank);
        for (int k = 0; e->in[i][k]; k++) {
            unsigned char c = (unsigned char) e->in[i][k];
            if (count[c] && dim[c] != ins[i]->dims[k])
                return kiln_error (err, KILN_ESHAPE, "label '%c' has size %lld and %lld", c,
                                   (long long) dim[c], (long long) ins[i]->dims[k]);
            dim[c] = ins[i]->dims[k];
            count[c]++;
        }
    }
    if (*p == '-') {
        if (p[1] != '>')
            return kiln_error (err, KILN_EFORMAT, "equation '%s': expected '->'", eq);
        p += 2;
        if ((rc = s_term (&p, e->out, err)))
            return rc;
        if (*p)
            return kiln_error (err, KILN_EFORMAT, "equation '%s' has something after the output", eq);
        for (int k = 0; e->out[k]; k++)
            if (!count[(unsigned char) e->out[k]])
                return kiln_error (err, KILN_EFORMAT, "output label '%c' is in no input", e->out[k]);
    }
    else {
        /* Implicit output: the labels used once, in alphabetical order. */
        int k = 0;
        for (int c = 'A'; c <= 'z'; c++) {
            if (count[c] != 1)
                continue;
            if (k == KILN_MAX_RANK)
                return kiln_error (err, KILN_ELIMIT, "equation '%s' has an output of more than %d labels",
                                   eq, KILN_MAX_RANK);
            e->out[k++] = (char) c;
        }
        e->out[k] = '\0';
    }
    for (int c = 'A'; c <= 'z'; c++) {
        if (!count[c] || strchr (e->out, c))
            continue;
        /* Summed away: a contraction needs the label in both operands. */
        if (n == 1 || !strchr (e->in[0], c) || !strchr (e->in[1], c))
            return kiln_error (err, KILN_EUNSUPPORTED,
                               "equation '%s' sums over label '%c' within one operand "
                               "(only transpositions and batched matrix products are supported)",
                               eq, c);
    }
    out->rank = (int) strlen (e->out);
    for (int k = 0; k < out->rank; k++)
        out->dims[k] = dim[(unsigned char) e->out[k]];
    return 0;
}

/* --- recurrent ops ------------------------------------------------------- */

static const struct {
    const char *name;
    int act;
} s_rnn_acts[] = {
#define S_ROW(id, num, name) { name, num },
    KILN_RNN_ACTS (S_ROW)
#undef S_ROW
};

static void
s_rnn_act_defaults (int act, int *n_ab, float *a, float *b)
{
    *n_ab = 0;
    *a = *b = 0;
    switch (act) {
    case KILN_RNN_ACT_HARD_SIGMOID: *n_ab = 2; *a = 0.2f; *b = 0.5f; break;
    case KILN_RNN_ACT_LEAKY_RELU: *n_ab = 1; *a = 0.01f; break;
    case KILN_RNN_ACT_AFFINE: *n_ab = 2; *a = 1.0f; *b = 0.0f; break;
    case KILN_RNN_ACT_SCALED_TANH: *n_ab = 2; *a = 1.0f; *b = 1.0f; break;
    case KILN_RNN_ACT_THRESHOLDED_RELU: *n_ab = 1; *a = 1.0f; break;
    case KILN_RNN_ACT_ELU: *n_ab = 1; *a = 1.0f; break;
    default: break;
    }
}

/* Shape `s` must be `want` (rank and dims). */
static int
s_rnn_want (const kiln_shape_t *s, const char *what, int rank, const int64_t *want,
            kiln_err_t *err)
{
    bool ok = s->rank == rank;
    for (int k = 0; ok && k < rank; k++)
        ok = s->dims[k] == want[k];
    if (ok)
        return 0;
    char got[160], exp[160];
    kiln_shape_t w = { .rank = rank };
    memcpy (w.dims, want, (size_t) rank * sizeof *want);
    kiln_shape_str (s, got, sizeof got);
    kiln_shape_str (&w, exp, sizeof exp);
    return kiln_error (err, KILN_ESHAPE, "%s has shape %s, expected %s", what, got, exp);
}

int
kiln_rnn_params (const kiln_node_t *node, const kiln_shape_t *const *ins, int n,
                 kiln_rnn_t *r, kiln_err_t *err)
{
    memset (r, 0, sizeof *r);
    const char *op = node->op;
    r->cell = !strcmp (op, "LSTM") ? KILN_RNN_CELL_LSTM
              : !strcmp (op, "GRU") ? KILN_RNN_CELL_GRU : KILN_RNN_CELL_RNN;
    r->g = r->cell == KILN_RNN_CELL_LSTM ? 4 : r->cell == KILN_RNN_CELL_GRU ? 3 : 1;
    r->n_act = r->cell == KILN_RNN_CELL_LSTM ? 3 : r->cell == KILN_RNN_CELL_GRU ? 2 : 1;
    const char *dir = kiln_node_attr_string (node, "direction", "forward");
    if (!strcmp (dir, "forward"))
        r->direction = 0;
    else if (!strcmp (dir, "reverse"))
        r->direction = 1;
    else if (!strcmp (dir, "bidirectional"))
        r->direction = 2;
    else
        return kiln_error (err, KILN_EUNSUPPORTED, "direction '%s' is not forward, reverse "
                           "or bidirectional", dir);
    r->d = r->direction == 2 ? 2 : 1;
    int64_t layout = kiln_node_attr_int (node, "layout", 0);
    if (layout != 0 && layout != 1)
        return kiln_error (err, KILN_EUNSUPPORTED, "layout %lld is not 0 or 1",
                           (long long) layout);
    r->layout = (int) layout;
    if (n < 3 || !ins[0] || !ins[1] || !ins[2])
        return kiln_error (err, KILN_EFORMAT, "needs X, W and R");
    if (ins[0]->rank != 3)
        return kiln_error (err, KILN_ESHAPE, "X has rank %d, expected 3", ins[0]->rank);
    r->t = ins[0]->dims[layout ? 1 : 0];
    r->b = ins[0]->dims[layout ? 0 : 1];
    r->i = ins[0]->dims[2];
    if (r->t < 1 || r->b < 1 || r->i < 1)
        return kiln_error (err, KILN_EUNSUPPORTED, "X has an empty axis");
    if (ins[1]->rank != 3 || ins[1]->dims[1] % r->g || ins[1]->dims[1] < r->g)
        return kiln_error (err, KILN_ESHAPE, "W must be [directions, %lld·hidden_size, "
                           "input_size]", (long long) r->g);
    r->h = ins[1]->dims[1] / r->g;
    int64_t hs = kiln_node_attr_int (node, "hidden_size", r->h);
    if (hs != r->h)
        return kiln_error (err, KILN_ESHAPE, "hidden_size is %lld but W has %lld rows "
                           "(%lld gates)", (long long) hs, (long long) ins[1]->dims[1],
                           (long long) r->g);
    int64_t D = r->d, G = r->g, H = r->h, B = r->b, T = r->t;
    int rc;
    int64_t w[3] = { D, G * H, r->i }, rr[3] = { D, G * H, H }, bb[2] = { D, 2 * G * H };
    int64_t hh[3] = { D, B, H }, hl[3] = { B, D, H }, p[2] = { D, 3 * H }, sl[1] = { B };
    if ((rc = s_rnn_want (ins[1], "W", 3, w, err)) || (rc = s_rnn_want (ins[2], "R", 3, rr, err))
        || (n > 3 && ins[3] && (rc = s_rnn_want (ins[3], "B", 2, bb, err)))
        || (n > 4 && ins[4] && (rc = s_rnn_want (ins[4], "sequence_lens", 1, sl, err)))
        || (n > 5 && ins[5] && (rc = s_rnn_want (ins[5], "initial_h", 3, layout ? hl : hh, err)))
        || (n > 6 && ins[6] && (rc = s_rnn_want (ins[6], "initial_c", 3, layout ? hl : hh, err)))
        || (n > 7 && ins[7] && (rc = s_rnn_want (ins[7], "P", 2, p, err))))
        return rc;
    if (r->cell != KILN_RNN_CELL_LSTM && n > 6)
        return kiln_error (err, KILN_EFORMAT, "%s takes at most 6 inputs", op);
    r->clip = kiln_node_attr_float (node, "clip", 0);
    if (kiln_node_attr (node, "clip") && !(r->clip > 0))
        return kiln_error (err, KILN_EINVAL, "clip %g is not positive", r->clip);
    r->input_forget = kiln_node_attr_int (node, "input_forget", 0) != 0;
    r->lbr = kiln_node_attr_int (node, "linear_before_reset", 0) != 0;

    /* activations */
    const char *acts = kiln_node_attr_string (node, "activations", NULL);
    const kiln_attr_t *al = kiln_node_attr (node, "activation_alpha");
    const kiln_attr_t *be = kiln_node_attr (node, "activation_beta");
    int n_act = (int) (D * r->n_act);
    size_t ia = 0, ib = 0;
    if ((al && al->kind != KILN_ATTR_FLOATS) || (be && be->kind != KILN_ATTR_FLOATS))
        return kiln_error (err, KILN_EFORMAT, "activation_alpha and activation_beta are "
                           "lists of floats");
    for (int k = 0; k < n_act; k++) {
        int act = r->cell == KILN_RNN_CELL_RNN ? KILN_RNN_ACT_TANH
                  : k % r->n_act == 0 ? KILN_RNN_ACT_SIGMOID : KILN_RNN_ACT_TANH;
        if (acts) {
            /* the k-th of the comma-joined names (kiln_onnx.c) */
            const char *at = acts;
            for (int q = 0; q < k && at; q++)
                at = strchr (at, ',') ? strchr (at, ',') + 1 : NULL;
            size_t len = at ? strcspn (at, ",") : 0;
            if (!at || (k == n_act - 1 && at[len]))
                return kiln_error (err, KILN_EFORMAT, "activations '%s' does not name %d "
                                   "functions", acts, n_act);
            act = -1;
            for (size_t q = 0; q < sizeof s_rnn_acts / sizeof s_rnn_acts[0]; q++)
                if (strlen (s_rnn_acts[q].name) == len
                    && !strncasecmp (at, s_rnn_acts[q].name, len))
                    act = s_rnn_acts[q].act;
            if (act < 0)
                return kiln_error (err, KILN_EUNSUPPORTED, "activation '%.*s' is not one kiln "
                                   "has (Sigmoid, Tanh, Relu, HardSigmoid, LeakyRelu, Affine, "
                                   "ScaledTanh, ThresholdedRelu, Elu, Softsign, Softplus)",
                                   (int) len, at);
        }
        int n_ab;
        s_rnn_act_defaults (act, &n_ab, &r->aa[k], &r->ab[k]);
        if (n_ab >= 1 && al && ia < al->n)
            r->aa[k] = (float) al->floats[ia++];
        if (n_ab >= 2 && be && ib < be->n)
            r->ab[k] = (float) be->floats[ib++];
        r->act[k] = act;
    }
    r->y = layout ? (kiln_shape_t) { .rank = 4, .dims = { B, T, D, H } }
                  : (kiln_shape_t) { .rank = 4, .dims = { T, D, B, H } };
    r->yh = layout ? (kiln_shape_t) { .rank = 3, .dims = { B, D, H } }
                   : (kiln_shape_t) { .rank = 3, .dims = { D, B, H } };
    return 0;
}

/* --- scatters, GatherND, TopK ----------------------------------------- */

int
kiln_scatter_params (const kiln_node_t *node, bool nd, const kiln_shape_t *data,
                     const kiln_shape_t *indices, const kiln_shape_t *updates,
                     int *reduction, int *axis, kiln_err_t *err)
{
    static const char *const names[] = { "none", "add", "mul", "max", "min" };
    const char *red = kiln_node_attr_string (node, "reduction", "none");
    *reduction = -1;
    for (int i = 0; i < 5; i++)
        if (!strcmp (red, names[i]))
            *reduction = i;
    if (*reduction < 0)
        return kiln_error (err, KILN_EUNSUPPORTED, "reduction '%s' is not none, add, mul, "
                           "max or min", red);
    int r = data->rank, q = indices->rank;
    char sd[160], si[160], su[160];
    kiln_shape_str (data, sd, sizeof sd);
    kiln_shape_str (indices, si, sizeof si);
    kiln_shape_str (updates, su, sizeof su);
    if (nd) {
        int64_t k = q >= 1 ? indices->dims[q - 1] : -1;
        bool ok = r >= 1 && q >= 1 && k >= 1 && k <= r && updates->rank == q - 1 + r - k;
        for (int i = 0; ok && i < q - 1; i++)
            ok = updates->dims[i] == indices->dims[i];
        for (int i = (int) k; ok && i < r; i++)
            ok = updates->dims[q - 1 + i - k] == data->dims[i];
        if (!ok)
            return kiln_error (err, KILN_ESHAPE, "data %s, indices %s and updates %s: updates "
                               "must be indices[:-1] + data[k:] with k = indices[-1] in "
                               "1..rank(data)", sd, si, su);
        *axis = 0;
        return 0;
    }
    int64_t a = kiln_node_attr_int (node, "axis", 0);
    if (r < 1 || a < -r || a >= r)
        return kiln_error (err, KILN_ESHAPE, "axis %lld is not an axis of data %s",
                           (long long) a, sd);
    *axis = (int) (a < 0 ? a + r : a);
    bool ok = q == r && kiln_shape_equal (indices, updates);
    for (int i = 0; ok && i < r; i++)
        ok = i == *axis || indices->dims[i] <= data->dims[i];
    if (!ok)
        return kiln_error (err, KILN_ESHAPE, "indices %s and updates %s must have one shape, "
                           "of data %s's rank and no longer than it but on the axis", si, su,
                           sd);
    return 0;
}

int
kiln_gather_nd_params (const kiln_node_t *node, const kiln_shape_t *data,
                       const kiln_shape_t *indices, int *batch_dims, kiln_shape_t *out,
                       kiln_err_t *err)
{
    int r = data->rank, q = indices->rank;
    int64_t b = kiln_node_attr_int (node, "batch_dims", 0);
    int64_t k = q >= 1 ? indices->dims[q - 1] : -1;
    bool ok = q >= 1 && b >= 0 && b < q && b < r && k >= 1 && k <= r - b
              && q - 1 + r - b - k <= KILN_MAX_RANK;
    for (int i = 0; ok && i < b; i++)
        ok = indices->dims[i] == data->dims[i];
    if (!ok) {
        char sd[160], si[160];
        kiln_shape_str (data, sd, sizeof sd);
        kiln_shape_str (indices, si, sizeof si);
        return kiln_error (err, KILN_ESHAPE, "data %s and indices %s with batch_dims %lld: "
                           "indices[-1] must be in 1..rank(data) - batch_dims and the batch "
                           "axes equal", sd, si, (long long) b);
    }
    *batch_dims = (int) b;
    out->rank = (int) (q - 1 + r - b - k);
    for (int i = 0; i < q - 1; i++)
        out->dims[i] = indices->dims[i];
    for (int i = (int) (b + k); i < r; i++)
        out->dims[q - 1 + i - b - k] = data->dims[i];
    return 0;
}

int
kiln_topk_params (const kiln_graph_t *g, const kiln_node_t *node, const kiln_shape_t *x,
                  int *axis, int64_t *k, bool *largest, kiln_shape_t *out, kiln_err_t *err)
{
    int r = x->rank, n = 0, rc;
    int64_t a = kiln_node_attr_int (node, "axis", -1);
    if (r < 1 || a < -r || a >= r)
        return kiln_error (err, KILN_ESHAPE, "axis %lld is not an axis of a rank-%d X",
                           (long long) a, r);
    *axis = (int) (a < 0 ? a + r : a);
    if (node->n_inputs > 1 && node->inputs[1] >= 0) {
        if ((rc = kiln_const_ints (g, node, 1, "K", 1, k, &n, err)))
            return rc;
    }
    else {
        *k = kiln_node_attr_int (node, "k", -1);
        n = kiln_node_attr (node, "k") ? 1 : 0;
    }
    if (n != 1 || *k < 0 || *k > x->dims[*axis])
        return kiln_error (err, KILN_ESHAPE, "K must be one value in 0..%lld (the axis' "
                           "length)", (long long) x->dims[*axis]);
    *largest = kiln_node_attr_int (node, "largest", 1) != 0;
    *out = *x;
    out->dims[*axis] = *k;
    return 0;
}

int
kiln_grid_sample_params (const kiln_node_t *node, const kiln_shape_t *x,
                         const kiln_shape_t *grid, int *mode, int *pad, bool *align,
                         kiln_shape_t *out, kiln_err_t *err)
{
    const char *m = kiln_node_attr_string (node, "mode", "bilinear");
    const char *pm = kiln_node_attr_string (node, "padding_mode", "zeros");
    if (!strcmp (m, "bilinear") || !strcmp (m, "linear"))
        *mode = 0;
    else if (!strcmp (m, "nearest"))
        *mode = 1;
    else if (!strcmp (m, "bicubic") || !strcmp (m, "cubic"))
        *mode = 2;
    else
        return kiln_error (err, KILN_EUNSUPPORTED, "mode '%s' (kiln samples bilinear, "
                           "nearest and bicubic)", m);
    if (!strcmp (pm, "zeros"))
        *pad = 0;
    else if (!strcmp (pm, "border"))
        *pad = 1;
    else if (!strcmp (pm, "reflection"))
        *pad = 2;
    else
        return kiln_error (err, KILN_EUNSUPPORTED, "padding_mode '%s'", pm);
    *align = kiln_node_attr_int (node, "align_corners", 0) != 0;
    if (x->rank != 4 || grid->rank != 4 || grid->dims[0] != x->dims[0] || grid->dims[3] != 2) {
        char sx[160], sg[160];
        kiln_shape_str (x, sx, sizeof sx);
        kiln_shape_str (grid, sg, sizeof sg);
        return kiln_error (err, KILN_EUNSUPPORTED, "X %s and grid %s: kiln samples X [N, C, "
                           "H, W] at a grid [N, oh, ow, 2] (2-D only, not 1-D or 3-D)", sx, sg);
    }
    *out = (kiln_shape_t) { .rank = 4, .dims = { x->dims[0], x->dims[1], grid->dims[1],
                                                 grid->dims[2] } };
    return 0;
}
