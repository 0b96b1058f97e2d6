/*
 * kiln_infer_math — shape inference for the math ops (see
 * kiln_infer_math.h).  Each function checks dtypes, ranks and attributes
 * and writes its outputs; errors name the node (through kiln_infer_fail)
 * and the input or attribute at fault.
 */
#include "graph/kiln_infer_math.h"

#include "common/kiln_program.h"
#include "graph/kiln_shape_ops.h"

#include <stdio.h>
#include <string.h>

/* --- dtype sets ------------------------------------------------------- */

#define S_M(dt) (1u << KILN_DT_##dt)
/* float16 and bfloat16 are stored in 2 bytes and computed in float32
 * (common/kiln_half.h), so they go wherever float32 does. */
#define S_HALF (S_M (FLOAT16) | S_M (BFLOAT16))
#define S_FLOATS (S_M (FLOAT32) | S_M (FLOAT64) | S_HALF)
#define S_INTS (S_M (INT8) | S_M (UINT8) | S_M (INT32) | S_M (INT64))
#define S_NUMERIC (S_FLOATS | S_INTS)
#define S_ANY (S_NUMERIC | S_M (BOOL))

/* "float32 or float64" for a set. */
static const char *
s_set_str (unsigned set, char *buf, size_t size)
{
    size_t used = 0;
    int n = 0, total = __builtin_popcount (set);
    buf[0] = '\0';
    for (int dt = 0; dt < 32 && used < size; dt++) {
        if (!(set & (1u << dt)))
            continue;
        n++;
        used += (size_t) snprintf (buf + used, size - used, "%s%s",
                                   n == 1 ? "" : n == total ? " or " : ", ",
                                   kiln_dtype_name ((kiln_dtype_t) dt));
    }
    return buf;
}

/* Input i (when present) must have a dtype in `set`. */
static int
s_want (kiln_infer_ctx_t *ctx, int i, unsigned set)
{
    const kiln_infer_type_t *t = kiln_infer_in (ctx, i);
    if (!t || ((1u << t->dtype) & set))
        return 0;
    char nb[KILN_INFER_NAME_MAX], sb[128];
    kiln_infer_in_name (ctx, i, nb, sizeof nb);
    s_set_str (set, sb, sizeof sb);
    return kiln_infer_fail (ctx, KILN_ESHAPE, "%s is %s, expected %s", nb,
                            kiln_dtype_name (t->dtype), sb);
}

/* Inputs i and j (when both present) must have the same dtype. */
static int
s_same (kiln_infer_ctx_t *ctx, int i, int j)
{
    const kiln_infer_type_t *a = kiln_infer_in (ctx, i), *b = kiln_infer_in (ctx, j);
    if (!a || !b || a->dtype == b->dtype)
        return 0;
    char na[KILN_INFER_NAME_MAX], nb[KILN_INFER_NAME_MAX];
    return kiln_infer_fail (ctx, KILN_ESHAPE, "%s is %s but %s is %s",
                            kiln_infer_in_name (ctx, i, na, sizeof na),
                            kiln_dtype_name (a->dtype),
                            kiln_infer_in_name (ctx, j, nb, sizeof nb),
                            kiln_dtype_name (b->dtype));
}

static void
s_set_out (kiln_infer_ctx_t *ctx, int i, kiln_dtype_t dt, const kiln_shape_t *shape)
{
    kiln_infer_out (ctx, i)->dtype = dt;
    kiln_infer_out (ctx, i)->shape = *shape;
}

/* Float attribute `name`, `fallback` when absent. */
static int
s_attr_f (kiln_infer_ctx_t *ctx, const char *name, double fallback, double *v)
{
    const kiln_attr_t *a;
    int rc = kiln_infer_attr (ctx, name, KILN_ATTR_FLOAT, &a);
    if (rc)
        return rc;
    *v = a ? a->f : fallback;
    return 0;
}

/* Input i must be a per-channel vector: shape [c]. */
static int
s_want_vector (kiln_infer_ctx_t *ctx, int i, int64_t c)
{
    const kiln_infer_type_t *t = kiln_infer_in (ctx, i);
    if (!t || (t->shape.rank == 1 && t->shape.dims[0] == c))
        return 0;
    char nb[KILN_INFER_NAME_MAX], sb[KILN_INFER_SHAPE_MAX];
    return kiln_infer_fail (ctx, KILN_ESHAPE, "%s has shape %s, expected [%lld] "
                            "(one value per channel)",
                            kiln_infer_in_name (ctx, i, nb, sizeof nb),
                            kiln_infer_shape_str (&t->shape, sb), (long long) c);
}

/* Input i must hold one element (a scalar bound). */
static int
s_want_scalar (kiln_infer_ctx_t *ctx, int i)
{
    const kiln_infer_type_t *t = kiln_infer_in (ctx, i);
    if (!t)
        return 0;
    int64_t n = 1;
    for (int k = 0; k < t->shape.rank; k++)
        n *= t->shape.dims[k];
    if (n == 1)
        return 0;
    char nb[KILN_INFER_NAME_MAX], sb[KILN_INFER_SHAPE_MAX];
    return kiln_infer_fail (ctx, KILN_ESHAPE, "%s has shape %s, expected a scalar",
                            kiln_infer_in_name (ctx, i, nb, sizeof nb),
                            kiln_infer_shape_str (&t->shape, sb));
}

/* Broadcast every present input from `from` to `to` (exclusive). */
static int
s_broadcast_all (kiln_infer_ctx_t *ctx, int from, int to, kiln_shape_t *out)
{
    int first = -1, rc;
    for (int i = from; i < to; i++) {
        const kiln_infer_type_t *t = kiln_infer_in (ctx, i);
        if (!t)
            continue;
        if (first < 0) {
            *out = t->shape;
            first = i;
            continue;
        }
        kiln_shape_t acc = *out;
        if ((rc = kiln_infer_broadcast (ctx, &acc, first, &t->shape, i, out)))
            return rc;
    }
    return 0;
}

static bool
s_op_is (kiln_infer_ctx_t *ctx, const char *op)
{
    return strcmp (ctx->node->op, op) == 0;
}

/* --- elementwise ------------------------------------------------------ */

int
kiln_infer_float_unary (kiln_infer_ctx_t *ctx)
{
    int rc = s_want (ctx, 0, S_FLOATS);
    if (rc)
        return rc;
    /* Every float attribute these ops have; the getter rejects a wrong
     * kind.  Values do not change shapes. */
    double v;
    if ((rc = s_attr_f (ctx, "alpha", 1.0, &v))
        || (rc = s_attr_f (ctx, "beta", 0.0, &v))
        || (rc = s_attr_f (ctx, "gamma", 1.0, &v)))
        return rc;
    if (s_op_is (ctx, "Celu")) {
        if ((rc = s_attr_f (ctx, "alpha", 1.0, &v)))
            return rc;
        if (v == 0)
            return kiln_infer_fail (ctx, KILN_EFORMAT, "attribute 'alpha' is 0");
    }
    *kiln_infer_out (ctx, 0) = *kiln_infer_in (ctx, 0);
    return 0;
}

int
kiln_infer_neg_abs (kiln_infer_ctx_t *ctx)
{
    unsigned set = s_op_is (ctx, "Neg") ? S_NUMERIC & ~S_M (UINT8) : S_NUMERIC;
    int rc = s_want (ctx, 0, set);
    if (rc)
        return rc;
    *kiln_infer_out (ctx, 0) = *kiln_infer_in (ctx, 0);
    return 0;
}

int
kiln_infer_not (kiln_infer_ctx_t *ctx)
{
    int rc = s_want (ctx, 0, S_M (BOOL));
    if (rc)
        return rc;
    *kiln_infer_out (ctx, 0) = *kiln_infer_in (ctx, 0);
    return 0;
}

int
kiln_math_clip_bounds (const kiln_graph_t *g, const kiln_node_t *node,
                       bool *has_min, double *min, bool *has_max, double *max,
                       int *min_input, int *max_input, kiln_err_t *err)
{
    *has_min = *has_max = false;
    *min = *max = 0;
    *min_input = *max_input = -1;
    if (g->opset < 11) {
        if (node->n_inputs > 1)
            return kiln_error (err, KILN_EINVAL, "before opset 11 Clip takes "
                               "one input and min/max attributes");
        const char *names[2] = { "min", "max" };
        bool *has[2] = { has_min, has_max };
        double *val[2] = { min, max };
        for (int b = 0; b < 2; b++) {
            const kiln_attr_t *a = kiln_node_attr (node, names[b]);
            if (!a)
                continue;
            if (a->kind != KILN_ATTR_FLOAT)
                return kiln_error (err, KILN_EFORMAT, "attribute '%s' is not a "
                                   "float", names[b]);
            *has[b] = true;
            *val[b] = a->f;
        }
        return 0;
    }
    if (node->n_inputs > 1)
        *min_input = node->inputs[1];
    if (node->n_inputs > 2)
        *max_input = node->inputs[2];
    return 0;
}

int
kiln_infer_clip (kiln_infer_ctx_t *ctx)
{
    bool has_min, has_max;
    double lo, hi;
    int lo_in, hi_in, rc;
    if ((rc = kiln_math_clip_bounds (ctx->g, ctx->node, &has_min, &lo, &has_max,
                                     &hi, &lo_in, &hi_in, ctx->err)))
        return kiln_error_prefix (ctx->err, "%s", ctx->label);
    if ((rc = s_want (ctx, 0, ctx->g->opset < 11 ? S_FLOATS : S_NUMERIC))
        || (rc = s_same (ctx, 0, 1)) || (rc = s_same (ctx, 0, 2))
        || (rc = s_want_scalar (ctx, 1)) || (rc = s_want_scalar (ctx, 2)))
        return rc;
    if (has_min && lo != lo)
        return kiln_infer_fail (ctx, KILN_EFORMAT, "attribute 'min' is NaN");
    if (has_max && hi != hi)
        return kiln_infer_fail (ctx, KILN_EFORMAT, "attribute 'max' is NaN");
    *kiln_infer_out (ctx, 0) = *kiln_infer_in (ctx, 0);
    return 0;
}

int
kiln_infer_cast (kiln_infer_ctx_t *ctx)
{
    int64_t to;
    int rc;
    if (s_op_is (ctx, "CastLike"))
        to = kiln_infer_in (ctx, 1)->dtype;
    else if ((rc = kiln_infer_attr_int (ctx, "to", -1, 0, 1000, &to)))
        return rc;
    if (to < 0)
        return kiln_infer_fail (ctx, KILN_EFORMAT, "attribute 'to' is required");
    if (!kiln_dtype_valid ((int) to))
        return kiln_infer_fail (ctx, KILN_EUNSUPPORTED, "attribute 'to' is ONNX "
                                "type %lld, which kiln does not support",
                                (long long) to);
    int64_t sat;
    if ((rc = kiln_infer_attr_int (ctx, "saturate", 1, 0, 1, &sat)))
        return rc;
    if ((rc = s_want (ctx, 0, S_ANY)))
        return rc;
    s_set_out (ctx, 0, (kiln_dtype_t) to, &kiln_infer_in (ctx, 0)->shape);
    return 0;
}

/* PRelu: the slope broadcasts to X (unidirectionally). */
int
kiln_infer_prelu (kiln_infer_ctx_t *ctx)
{
    kiln_shape_t y;
    int rc;
    if ((rc = s_want (ctx, 0, S_FLOATS)) || (rc = s_same (ctx, 0, 1))
        || (rc = s_broadcast_all (ctx, 0, 2, &y)))
        return rc;
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    if (!kiln_shape_equal (&y, &x->shape)) {
        char nb[KILN_INFER_NAME_MAX], s1[KILN_INFER_SHAPE_MAX], s2[KILN_INFER_SHAPE_MAX];
        return kiln_infer_fail (ctx, KILN_ESHAPE, "slope %s %s does not broadcast to "
                                "X's shape %s", kiln_infer_in_name (ctx, 1, nb, sizeof nb),
                                kiln_infer_shape_str (&kiln_infer_in (ctx, 1)->shape, s1),
                                kiln_infer_shape_str (&x->shape, s2));
    }
    *kiln_infer_out (ctx, 0) = *x;
    return 0;
}

int
kiln_infer_arith (kiln_infer_ctx_t *ctx)
{
    kiln_shape_t y;
    int rc;
    if ((rc = s_want (ctx, 0, S_NUMERIC)) || (rc = s_same (ctx, 0, 1))
        || (rc = s_broadcast_all (ctx, 0, 2, &y)))
        return rc;
    s_set_out (ctx, 0, kiln_infer_in (ctx, 0)->dtype, &y);
    return 0;
}

int
kiln_infer_pow (kiln_infer_ctx_t *ctx)
{
    kiln_shape_t y;
    int rc;
    unsigned base = S_FLOATS | S_M (INT32) | S_M (INT64);
    if ((rc = s_want (ctx, 0, base)) || (rc = s_want (ctx, 1, S_NUMERIC))
        || (rc = s_broadcast_all (ctx, 0, 2, &y)))
        return rc;
    if (ctx->g->opset < 12 && (rc = s_same (ctx, 0, 1)))
        return rc;
    s_set_out (ctx, 0, kiln_infer_in (ctx, 0)->dtype, &y);
    return 0;
}

int
kiln_infer_variadic (kiln_infer_ctx_t *ctx)
{
    int n = ctx->n_in, rc;
    unsigned set = s_op_is (ctx, "Mean") ? S_FLOATS : S_NUMERIC;
    if (n > KILN_PROG_MAX_OP_IO)
        return kiln_infer_fail (ctx, KILN_EUNSUPPORTED, "has %d inputs; kiln "
                                "takes at most %d", n, KILN_PROG_MAX_OP_IO);
    for (int i = 0; i < n; i++) {
        if (!kiln_infer_in (ctx, i))
            return kiln_infer_fail (ctx, KILN_EINVAL, "input %d is missing", i);
        if ((rc = s_want (ctx, i, set)) || (rc = s_same (ctx, 0, i)))
            return rc;
    }
    kiln_shape_t y;
    if ((rc = s_broadcast_all (ctx, 0, n, &y)))
        return rc;
    s_set_out (ctx, 0, kiln_infer_in (ctx, 0)->dtype, &y);
    return 0;
}

int
kiln_infer_compare (kiln_infer_ctx_t *ctx)
{
    kiln_shape_t y;
    int rc;
    if ((rc = s_want (ctx, 0, S_NUMERIC | S_M (BOOL))) || (rc = s_same (ctx, 0, 1))
        || (rc = s_broadcast_all (ctx, 0, 2, &y)))
        return rc;
    s_set_out (ctx, 0, KILN_DT_BOOL, &y);
    return 0;
}

int
kiln_infer_logical (kiln_infer_ctx_t *ctx)
{
    kiln_shape_t y;
    int rc;
    if ((rc = s_want (ctx, 0, S_M (BOOL))) || (rc = s_want (ctx, 1, S_M (BOOL)))
        || (rc = s_broadcast_all (ctx, 0, 2, &y)))
        return rc;
    s_set_out (ctx, 0, KILN_DT_BOOL, &y);
    return 0;
}

int
kiln_infer_where (kiln_infer_ctx_t *ctx)
{
    kiln_shape_t y;
    int rc;
    if ((rc = s_want (ctx, 0, S_M (BOOL))) || (rc = s_want (ctx, 1, S_ANY))
        || (rc = s_same (ctx, 1, 2)) || (rc = s_broadcast_all (ctx, 0, 3, &y)))
        return rc;
    s_set_out (ctx, 0, kiln_infer_in (ctx, 1)->dtype, &y);
    return 0;
}

/* --- softmax ---------------------------------------------------------- */

int
kiln_math_softmax_axis (const kiln_graph_t *g, const kiln_node_t *node,
                        int rank, int *axis, bool *flatten, kiln_err_t *err)
{
    *flatten = g->opset < 13;
    int64_t a = *flatten ? 1 : -1;
    const kiln_attr_t *at = kiln_node_attr (node, "axis");
    if (at) {
        if (at->kind != KILN_ATTR_INT)
            return kiln_error (err, KILN_EFORMAT, "attribute 'axis' is not an int");
        a = at->i;
    }
    if (rank == 0 || a < -rank || a > rank - 1)
        return kiln_error (err, KILN_EFORMAT, "attribute 'axis' is %lld, outside "
                           "%d..%d for a rank-%d input", (long long) a, -rank,
                           rank - 1, rank);
    *axis = (int) (a < 0 ? a + rank : a);
    return 0;
}

int
kiln_infer_softmax (kiln_infer_ctx_t *ctx)
{
    int rc = s_want (ctx, 0, S_FLOATS), axis;
    bool flatten;
    if (rc)
        return rc;
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    if ((rc = kiln_math_softmax_axis (ctx->g, ctx->node, x->shape.rank, &axis,
                                      &flatten, ctx->err)))
        return kiln_error_prefix (ctx->err, "%s", ctx->label);
    *kiln_infer_out (ctx, 0) = *x;
    return 0;
}

/* --- reductions -------------------------------------------------------- */

/* Little-endian int64 at p (weights are little-endian, as ONNX raw_data). */
static int64_t
s_le64 (const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return (int64_t) v;
}

int
kiln_math_reduce_axes (const kiln_graph_t *g, const kiln_node_t *node, int rank,
                       bool reduced[KILN_MAX_RANK], bool *keepdims, kiln_err_t *err)
{
    const char *op = node->op;
    bool from_input = g->opset >= 18 || (strcmp (op, "ReduceSum") == 0 && g->opset >= 13);
    const kiln_attr_t *a;
    int64_t axes[KILN_MAX_RANK];
    int n = 0;
    bool noop = false;

    a = kiln_node_attr (node, "keepdims");
    if (a && (a->kind != KILN_ATTR_INT || a->i < 0 || a->i > 1))
        return kiln_error (err, KILN_EFORMAT, "attribute 'keepdims' must be 0 or 1");
    *keepdims = a ? a->i != 0 : true;
    a = kiln_node_attr (node, "noop_with_empty_axes");
    if (a && (!from_input || a->kind != KILN_ATTR_INT || a->i < 0 || a->i > 1))
        return kiln_error (err, KILN_EFORMAT, "attribute 'noop_with_empty_axes' %s",
                           from_input ? "must be 0 or 1"
                                      : "exists only where axes is an input");
    noop = a && a->i == 1;

    if (from_input) {
        if (kiln_node_attr (node, "axes"))
            return kiln_error (err, KILN_EFORMAT, "in opset %d axes is an input, "
                               "not an attribute", g->opset);
        int t = node->n_inputs > 1 ? node->inputs[1] : -1;
        if (t >= 0) {
            const kiln_tensor_t *at = &g->tensors[t];
            const char *an = at->name && *at->name ? at->name : "(unnamed)";
            if (at->dtype != KILN_DT_INT64 || at->shape.rank != 1)
                return kiln_error (err, KILN_ESHAPE, "axes '%s' must be a 1-D "
                                   "int64 tensor", an);
            if (at->weight < 0)
                return kiln_error (err, KILN_EUNSUPPORTED, "axes '%s' is computed "
                                   "at run time; only constant axes are supported",
                                   an);
            const kiln_weight_t *w = &g->weights[at->weight];
            if (!w->data)
                return kiln_error (err, KILN_EINVAL, "axes '%s' has no weight data "
                                   "attached", an);
            if (at->shape.dims[0] > rank)
                return kiln_error (err, KILN_ESHAPE, "axes '%s' has %lld values for "
                                   "a rank-%d input", an,
                                   (long long) at->shape.dims[0], rank);
            n = (int) at->shape.dims[0];
            if (w->size != (uint64_t) n * 8)
                return kiln_error (err, KILN_EFORMAT, "axes '%s' holds %llu bytes",
                                   an, (unsigned long long) w->size);
            for (int i = 0; i < n; i++)
                axes[i] = s_le64 (w->data + 8 * i);
        }
    } else {
        if (node->n_inputs > 1)
            return kiln_error (err, KILN_EINVAL, "in opset %d axes is an attribute, "
                               "not an input", g->opset);
        a = kiln_node_attr (node, "axes");
        if (a) {
            if (a->kind != KILN_ATTR_INTS)
                return kiln_error (err, KILN_EFORMAT, "attribute 'axes' is not a "
                                   "list of ints");
            if (a->n > (size_t) rank)
                return kiln_error (err, KILN_ESHAPE, "attribute 'axes' has %zu values "
                                   "for a rank-%d input", a->n, rank);
            n = (int) a->n;
            memcpy (axes, a->ints, (size_t) n * sizeof *axes);
        }
    }
    for (int i = 0; i < rank; i++)
        reduced[i] = n == 0 && !noop;
    for (int i = 0; i < n; i++) {
        int64_t v = axes[i];
        if (v < -rank || v >= rank)
            return kiln_error (err, KILN_EFORMAT, "axis %lld is outside %d..%d",
                               (long long) v, -rank, rank - 1);
        if (v < 0)
            v += rank;
        if (reduced[v])
            return kiln_error (err, KILN_EFORMAT, "axis %lld appears twice",
                               (long long) axes[i]);
        reduced[v] = true;
    }
    return 0;
}

int
kiln_infer_reduce (kiln_infer_ctx_t *ctx)
{
    const char *op = ctx->node->op;
    bool ints_ok = strcmp (op, "ReduceSum") == 0 || strcmp (op, "ReduceMean") == 0
                   || strcmp (op, "ReduceMax") == 0 || strcmp (op, "ReduceMin") == 0
                   || strcmp (op, "ReduceProd") == 0;
    unsigned set = ints_ok ? S_FLOATS | S_M (INT32) | S_M (INT64) : S_FLOATS;
    int rc = s_want (ctx, 0, set);
    if (rc)
        return rc;
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    bool red[KILN_MAX_RANK], keep;
    if ((rc = kiln_math_reduce_axes (ctx->g, ctx->node, x->shape.rank, red, &keep,
                                     ctx->err)))
        return kiln_error_prefix (ctx->err, "%s", ctx->label);
    kiln_shape_t y = { .rank = 0 };
    for (int i = 0; i < x->shape.rank; i++) {
        if (!red[i])
            y.dims[y.rank++] = x->shape.dims[i];
        else if (keep)
            y.dims[y.rank++] = 1;
    }
    s_set_out (ctx, 0, x->dtype, &y);
    return 0;
}

int
kiln_infer_arg (kiln_infer_ctx_t *ctx)
{
    int rc = s_want (ctx, 0, S_NUMERIC);
    if (rc)
        return rc;
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    int r = x->shape.rank;
    int64_t axis, keep, last;
    if ((rc = kiln_infer_want_rank (ctx, 0, 1, KILN_MAX_RANK))
        || (rc = kiln_infer_attr_int (ctx, "axis", 0, -r, r - 1, &axis))
        || (rc = kiln_infer_attr_int (ctx, "keepdims", 1, 0, 1, &keep))
        || (rc = kiln_infer_attr_int (ctx, "select_last_index", 0, 0, 1, &last)))
        return rc;
    if (axis < 0)
        axis += r;
    if (x->shape.dims[axis] == 0)
        return kiln_infer_fail (ctx, KILN_ESHAPE, "axis %lld is empty: there is "
                                "no largest or smallest element", (long long) axis);
    kiln_shape_t y = { .rank = 0 };
    for (int i = 0; i < r; i++) {
        if (i != axis)
            y.dims[y.rank++] = x->shape.dims[i];
        else if (keep)
            y.dims[y.rank++] = 1;
    }
    s_set_out (ctx, 0, KILN_DT_INT64, &y);
    return 0;
}

/* --- normalisations --------------------------------------------------- */

int
kiln_infer_batch_norm (kiln_infer_ctx_t *ctx)
{
    int rc;
    int64_t training, spatial;
    double v;
    if ((rc = kiln_infer_attr_int (ctx, "training_mode", 0, 0, 1, &training))
        || (rc = kiln_infer_attr_int (ctx, "spatial", 1, 0, 1, &spatial))
        || (rc = s_attr_f (ctx, "epsilon", 1e-5, &v))
        || (rc = s_attr_f (ctx, "momentum", 0.9, &v)))
        return rc;
    if (training)
        return kiln_infer_fail (ctx, KILN_EUNSUPPORTED, "training_mode=1: kiln "
                                "compiles for inference");
    if (!spatial)
        return kiln_infer_fail (ctx, KILN_EUNSUPPORTED, "spatial=0 (one mean per "
                                "element rather than per channel)");
    if (ctx->node->n_outputs > 1)
        return kiln_infer_fail (ctx, KILN_EUNSUPPORTED, "has %d outputs; the "
                                "running statistics exist in training only",
                                ctx->node->n_outputs);
    if ((rc = s_want (ctx, 0, S_FLOATS))
        || (rc = kiln_infer_want_rank (ctx, 0, 2, KILN_MAX_RANK)))
        return rc;
    int64_t c = kiln_infer_in (ctx, 0)->shape.dims[1];
    for (int i = 1; i < 5; i++)
        if ((rc = s_same (ctx, 0, i)) || (rc = s_want_vector (ctx, i, c)))
            return rc;
    *kiln_infer_out (ctx, 0) = *kiln_infer_in (ctx, 0);
    return 0;
}

int
kiln_infer_instance_norm (kiln_infer_ctx_t *ctx)
{
    int rc;
    double v;
    if ((rc = s_attr_f (ctx, "epsilon", 1e-5, &v)) || (rc = s_want (ctx, 0, S_FLOATS))
        || (rc = kiln_infer_want_rank (ctx, 0, 2, KILN_MAX_RANK)))
        return rc;
    int64_t c = kiln_infer_in (ctx, 0)->shape.dims[1];
    for (int i = 1; i < 3; i++)
        if ((rc = s_same (ctx, 0, i)) || (rc = s_want_vector (ctx, i, c)))
            return rc;
    *kiln_infer_out (ctx, 0) = *kiln_infer_in (ctx, 0);
    return 0;
}

/* `s` without its leading 1s. */
static kiln_shape_t
s_strip_ones (const kiln_shape_t *s)
{
    kiln_shape_t o = { .rank = 0 };
    int i = 0;
    while (i < s->rank && s->dims[i] == 1)
        i++;
    for (; i < s->rank; i++)
        o.dims[o.rank++] = s->dims[i];
    return o;
}

int
kiln_infer_layer_norm (kiln_infer_ctx_t *ctx)
{
    int rc;
    double v;
    int64_t axis, stash;
    if ((rc = s_want (ctx, 0, S_FLOATS))
        || (rc = kiln_infer_want_rank (ctx, 0, 1, KILN_MAX_RANK)))
        return rc;
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    int r = x->shape.rank;
    if ((rc = s_attr_f (ctx, "epsilon", 1e-5, &v))
        || (rc = kiln_infer_attr_int (ctx, "axis", -1, -r, r - 1, &axis))
        || (rc = kiln_infer_attr_int (ctx, "stash_type", 1, 0, 1000, &stash)))
        return rc;
    if (stash != KILN_DT_FLOAT32)
        return kiln_infer_fail (ctx, KILN_EUNSUPPORTED, "stash_type %lld (only 1, "
                                "float32, is supported)", (long long) stash);
    if (axis < 0)
        axis += r;
    /* Scale and B must broadcast to X's normalised dims [axis, r): kiln
     * takes them whole (same dims, leading 1s aside) or a single value. */
    kiln_shape_t norm = { .rank = r - (int) axis };
    memcpy (norm.dims, x->shape.dims + axis, (size_t) norm.rank * sizeof *norm.dims);
    kiln_shape_t want = s_strip_ones (&norm);
    for (int i = 1; i < 3; i++) {
        const kiln_infer_type_t *t = kiln_infer_in (ctx, i);
        if (!t)
            continue;
        if ((rc = s_same (ctx, 0, i)))
            return rc;
        kiln_shape_t got = s_strip_ones (&t->shape);
        if (got.rank == 0 || kiln_shape_equal (&got, &want))
            continue;
        char nb[KILN_INFER_NAME_MAX], s1[KILN_INFER_SHAPE_MAX], s2[KILN_INFER_SHAPE_MAX];
        return kiln_infer_fail (ctx, KILN_ESHAPE, "%s has shape %s, expected the "
                                "normalised dimensions %s",
                                kiln_infer_in_name (ctx, i, nb, sizeof nb),
                                kiln_infer_shape_str (&t->shape, s1),
                                kiln_infer_shape_str (&norm, s2));
    }
    *kiln_infer_out (ctx, 0) = *x;
    kiln_shape_t stat = x->shape;
    for (int i = (int) axis; i < r; i++)
        stat.dims[i] = 1;
    for (int i = 1; i < ctx->node->n_outputs; i++)
        s_set_out (ctx, i, KILN_DT_FLOAT32, &stat);
    return 0;
}

int
kiln_infer_lrn (kiln_infer_ctx_t *ctx)
{
    int rc;
    double v;
    int64_t size;
    if ((rc = s_want (ctx, 0, S_FLOATS))
        || (rc = kiln_infer_want_rank (ctx, 0, 2, KILN_MAX_RANK))
        || (rc = kiln_infer_attr_int (ctx, "size", -1, -1, KILN_MAX_DIM, &size))
        || (rc = s_attr_f (ctx, "alpha", 1e-4, &v))
        || (rc = s_attr_f (ctx, "beta", 0.75, &v))
        || (rc = s_attr_f (ctx, "bias", 1.0, &v)))
        return rc;
    if (size < 1)
        return kiln_infer_fail (ctx, KILN_EFORMAT, "attribute 'size' is %s",
                                size < 0 ? "required" : "0, expected at least 1");
    *kiln_infer_out (ctx, 0) = *kiln_infer_in (ctx, 0);
    return 0;
}

/* --- Trilu, CumSum, GatherElements ------------------------------------ */

int
kiln_infer_trilu (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    int rc, n;
    int64_t k;
    if ((rc = kiln_infer_want_rank (ctx, 0, 2, KILN_MAX_RANK)))
        return rc;
    if (ctx->n_in > 1 && kiln_infer_in (ctx, 1)
        && (rc = kiln_infer_const_ints (ctx, 1, 1, &k, &n)))
        return rc;
    s_set_out (ctx, 0, x->dtype, &x->shape);
    return 0;
}

int
kiln_infer_cumsum (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    int rc, n;
    int64_t axis;
    if ((rc = s_want (ctx, 0, S_FLOATS | S_M (INT32) | S_M (INT64)))
        || (rc = kiln_infer_const_ints (ctx, 1, 1, &axis, &n)))
        return rc;
    if (n != 1 || axis < -x->shape.rank || axis >= x->shape.rank)
        return kiln_infer_fail (ctx, KILN_ESHAPE, "axis %lld is not an axis of a rank-%d input",
                                (long long) axis, x->shape.rank);
    s_set_out (ctx, 0, x->dtype, &x->shape);
    return 0;
}

int
kiln_infer_gather_elements (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0), *ind = kiln_infer_in (ctx, 1);
    int64_t axis;
    int rc;
    if ((rc = kiln_infer_attr_int (ctx, "axis", 0, -KILN_MAX_RANK, KILN_MAX_RANK - 1, &axis)))
        return rc;
    if (ind->dtype != KILN_DT_INT64 && ind->dtype != KILN_DT_INT32)
        return kiln_infer_fail (ctx, KILN_ESHAPE, "indices are %s, expected int64 or int32",
                                kiln_dtype_name (ind->dtype));
    if (ind->shape.rank != x->shape.rank || axis < -x->shape.rank || axis >= x->shape.rank)
        return kiln_infer_fail (ctx, KILN_ESHAPE, "indices must have the data's rank and "
                                "axis %lld be one of its axes", (long long) axis);
    s_set_out (ctx, 0, x->dtype, &ind->shape);
    return 0;
}

/* NegativeLogLikelihoodLoss (input, target[, weight]) and
 * SoftmaxCrossEntropyLoss (scores, labels[, weights]; a second output,
 * the log-probabilities): the loss per element (reduction "none") or one
 * value. */
int
kiln_infer_nll (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0), *t = kiln_infer_in (ctx, 1);
    int rc;
    if ((rc = kiln_infer_want_float (ctx, 0)) || (rc = kiln_infer_want_rank (ctx, 0, 2, KILN_MAX_RANK)))
        return rc;
    if (t->dtype != KILN_DT_INT64 && t->dtype != KILN_DT_INT32)
        return kiln_infer_fail (ctx, KILN_ESHAPE, "the target is %s, expected int64 or int32",
                                kiln_dtype_name (t->dtype));
    bool ok = t->shape.rank == x->shape.rank - 1 && t->shape.dims[0] == x->shape.dims[0];
    for (int i = 2; ok && i < x->shape.rank; i++)
        ok = t->shape.dims[i - 1] == x->shape.dims[i];
    if (!ok)
        return kiln_infer_fail (ctx, KILN_ESHAPE, "the target must be the input's shape "
                                "without its axis 1");
    if (ctx->n_in > 2 && kiln_infer_in (ctx, 2)) {
        const kiln_infer_type_t *w = kiln_infer_in (ctx, 2);
        if (w->dtype != x->dtype || w->shape.rank != 1 || w->shape.dims[0] != x->shape.dims[1])
            return kiln_infer_fail (ctx, KILN_ESHAPE, "the weight must be [C] of the "
                                    "input's type");
    }
    const char *red = kiln_node_attr_string (ctx->node, "reduction", "mean");
    if (strcmp (red, "none") && strcmp (red, "sum") && strcmp (red, "mean"))
        return kiln_infer_fail (ctx, KILN_EUNSUPPORTED, "reduction '%s' is not none, sum "
                                "or mean", red);
    kiln_shape_t scalar = { .rank = 0 };
    s_set_out (ctx, 0, x->dtype, strcmp (red, "none") ? &scalar : &t->shape);
    if (ctx->node->n_outputs > 1 && ctx->out[1])
        s_set_out (ctx, 1, x->dtype, &x->shape);
    return 0;
}

/* IsInf: bool of X's shape. */
int
kiln_infer_isinf (kiln_infer_ctx_t *ctx)
{
    int rc = s_want (ctx, 0, S_FLOATS);
    if (rc)
        return rc;
    s_set_out (ctx, 0, KILN_DT_BOOL, &kiln_infer_in (ctx, 0)->shape);
    return 0;
}

/* EyeLike: the input's shape (a matrix), of `dtype` or the input's type. */
int
kiln_infer_eyelike (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    int64_t dt;
    int rc;
    if ((rc = kiln_infer_want_rank (ctx, 0, 2, 2))
        || (rc = kiln_infer_attr_int (ctx, "dtype", x->dtype, 0, 1 << 20, &dt)))
        return rc;
    if (dt != KILN_DT_FLOAT32 && dt != KILN_DT_FLOAT64 && dt != KILN_DT_INT32
        && dt != KILN_DT_INT64 && dt != KILN_DT_INT8 && dt != KILN_DT_UINT8
        && dt != KILN_DT_BOOL)
        return kiln_infer_fail (ctx, KILN_EUNSUPPORTED, "dtype %lld is not one EyeLike "
                                "writes", (long long) dt);
    s_set_out (ctx, 0, (kiln_dtype_t) dt, &x->shape);
    return 0;
}

/* --- RNN, GRU, LSTM ------------------------------------------------------ */

int
kiln_infer_rnn (kiln_infer_ctx_t *ctx)
{
    const kiln_shape_t *ins[KILN_MAX_NODE_IO] = { 0 };
    kiln_rnn_t r;
    int rc;
    for (int i = 0; i < ctx->n_in && i < KILN_MAX_NODE_IO; i++) {
        const kiln_infer_type_t *t = kiln_infer_in (ctx, i);
        ins[i] = t ? &t->shape : NULL;
        if (t && i != 4 && t->dtype != KILN_DT_FLOAT32)
            return kiln_infer_fail (ctx, KILN_EUNSUPPORTED, "input %d is %s; kiln's "
                                    "recurrent ops compute in float32 only", i,
                                    kiln_dtype_name (t->dtype));
    }
    if ((rc = s_want (ctx, 4, S_M (INT32) | S_M (INT64))))
        return rc;
    if ((rc = kiln_rnn_params (ctx->node, ins, ctx->n_in, &r, ctx->err)))
        return kiln_error_prefix (ctx->err, "%s", ctx->label);
    int n_out = ctx->node->n_outputs;
    if (n_out > (r.cell == KILN_RNN_CELL_LSTM ? 3 : 2))
        return kiln_infer_fail (ctx, KILN_EFORMAT, "has %d outputs", n_out);
    for (int k = 0; k < n_out; k++)
        s_set_out (ctx, k, KILN_DT_FLOAT32, k ? &r.yh : &r.y);
    return 0;
}

/* --- ScatterND, ScatterElements, GatherND, TopK ------------------------- */

static int
s_want_indices (kiln_infer_ctx_t *ctx, int i)
{
    return s_want (ctx, i, S_M (INT32) | S_M (INT64));
}

int
kiln_infer_scatter (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0), *ind = kiln_infer_in (ctx, 1);
    const kiln_infer_type_t *u = kiln_infer_in (ctx, 2);
    int rc, red, axis;
    if ((rc = s_want_indices (ctx, 1)) || (rc = s_same (ctx, 0, 2)))
        return rc;
    if ((rc = kiln_scatter_params (ctx->node, !strcmp (ctx->node->op, "ScatterND"), &x->shape,
                                   &ind->shape, &u->shape, &red, &axis, ctx->err)))
        return kiln_error_prefix (ctx->err, "%s", ctx->label);
    if (red != 0 && (rc = s_want (ctx, 0, S_M (FLOAT32) | S_M (FLOAT64) | S_M (INT32)
                                             | S_M (INT64))))
        return rc;
    s_set_out (ctx, 0, x->dtype, &x->shape);
    return 0;
}

int
kiln_infer_gather_nd (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0), *ind = kiln_infer_in (ctx, 1);
    kiln_shape_t y;
    int rc, bd;
    if ((rc = s_want_indices (ctx, 1)))
        return rc;
    if ((rc = kiln_gather_nd_params (ctx->node, &x->shape, &ind->shape, &bd, &y, ctx->err)))
        return kiln_error_prefix (ctx->err, "%s", ctx->label);
    s_set_out (ctx, 0, x->dtype, &y);
    return 0;
}

int
kiln_infer_topk (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    kiln_shape_t y;
    int rc, axis;
    int64_t k;
    bool largest;
    if ((rc = s_want (ctx, 0, S_M (FLOAT32) | S_M (FLOAT64) | S_M (INT32) | S_M (INT64))))
        return rc;
    if ((rc = kiln_topk_params (ctx->g, ctx->node, &x->shape, &axis, &k, &largest, &y,
                                ctx->err)))
        return kiln_error_prefix (ctx->err, "%s", ctx->label);
    s_set_out (ctx, 0, x->dtype, &y);
    if (ctx->node->n_outputs > 1)
        s_set_out (ctx, 1, KILN_DT_INT64, &y);
    return 0;
}

int
kiln_infer_grid_sample (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0), *g = kiln_infer_in (ctx, 1);
    kiln_shape_t y;
    int rc, mode, pad;
    bool align;
    if ((rc = s_want (ctx, 0, S_M (FLOAT32))) || (rc = s_want (ctx, 1, S_M (FLOAT32))))
        return rc;
    if ((rc = kiln_grid_sample_params (ctx->node, &x->shape, &g->shape, &mode, &pad, &align,
                                       &y, ctx->err)))
        return kiln_error_prefix (ctx->err, "%s", ctx->label);
    s_set_out (ctx, 0, x->dtype, &y);
    return 0;
}
