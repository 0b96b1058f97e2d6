/*
 * kiln_lower_math — lowering of the math ops (see kiln_lower_math.h).
 */
#include "compiler/kiln_lower_math.h"

#include "graph/kiln_infer_math.h"

#include <float.h>
#include <string.h>

/* --- helpers ----------------------------------------------------------- */

static const kiln_tensor_t *
s_gt (const kiln_cc_ctx_t *cx, int gt)
{
    return &cx->g->tensors[gt];
}

static bool
s_op_is (const kiln_node_t *node, const char *op)
{
    return strcmp (node->op, op) == 0;
}

/* Float attribute `name` of the node, or `fallback`. */
static double
s_attr_f (const kiln_node_t *node, const char *name, double fallback)
{
    const kiln_attr_t *a = kiln_node_attr (node, name);
    return a && a->kind == KILN_ATTR_FLOAT ? a->f : fallback;
}

static int
s_set_f (kiln_cc_ctx_t *cx, int op, const char *name, double v, kiln_err_t *err)
{
    return kiln_prog_op_set_float (&cx->prog->ops[op], name, v, err);
}

static int
s_set_i (kiln_cc_ctx_t *cx, int op, const char *name, int64_t v, kiln_err_t *err)
{
    return kiln_prog_op_set_int (&cx->prog->ops[op], name, v, err);
}

/* Emit kernel k reading graph tensors gin[0..n_in) and writing the graph
 * tensors gout[0..n_out) (-1: a temporary of shape tmp_shape, float32,
 * for an output the graph does not use).  Returns the op's index. */
static int
s_emit (kiln_cc_ctx_t *cx, kiln_kernel_t k, const int *gin, int n_in,
        const int *gout, int n_out, const kiln_shape_t *tmp_shape,
        kiln_err_t *err)
{
    int ins[KILN_PROG_MAX_OP_IO], outs[KILN_PROG_MAX_OP_IO];
    if (n_in > KILN_PROG_MAX_OP_IO || n_out > KILN_PROG_MAX_OP_IO)
        return kiln_cc_fail (cx, KILN_EUNSUPPORTED, err, "more than %d inputs "
                             "or outputs", KILN_PROG_MAX_OP_IO);
    for (int i = 0; i < n_in; i++)
        if ((ins[i] = kiln_cc_operand (cx, gin[i], err)) < 0)
            return ins[i];
    for (int i = 0; i < n_out; i++) {
        outs[i] = gout[i] >= 0 ? kiln_cc_result (cx, gout[i], err)
                               : kiln_cc_temp (cx, KILN_DT_FLOAT32, tmp_shape, err);
        if (outs[i] < 0)
            return outs[i];
    }
    return kiln_cc_emit (cx, k, ins, n_in, outs, n_out, err);
}

/* The node's output 0, with its inferred shape checked against `want`. */
static int
s_output (kiln_cc_ctx_t *cx, const kiln_node_t *node, const kiln_shape_t *want,
          kiln_err_t *err)
{
    if (node->n_outputs < 1 || node->outputs[0] < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "has no output");
    int y = node->outputs[0];
    if (s_gt (cx, y)->shape.rank < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "output '%s' has no inferred "
                             "shape", kiln_cc_tname (cx, y));
    int rc = kiln_cc_expect_shape (cx, y, want, err);
    return rc < 0 ? rc : y;
}

/* Input i, which must be present. */
static int
s_input (kiln_cc_ctx_t *cx, const kiln_node_t *node, int i, kiln_err_t *err)
{
    if (i >= node->n_inputs || node->inputs[i] < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "input %d is missing", i);
    return node->inputs[i];
}

/* numpy broadcast of a and b into out; false when they do not. */
static bool
s_broadcast (const kiln_shape_t *a, const kiln_shape_t *b, kiln_shape_t *out)
{
    int r = a->rank > b->rank ? a->rank : b->rank;
    kiln_shape_t o = { .rank = r };
    for (int i = 0; i < r; i++) {
        int ia = i - (r - a->rank), ib = i - (r - b->rank);
        int64_t da = ia >= 0 ? a->dims[ia] : 1, db = ib >= 0 ? b->dims[ib] : 1;
        if (da != db && da != 1 && db != 1)
            return false;
        o.dims[i] = da == 1 ? db : da;
    }
    *out = o;
    return true;
}

/* A resolver's error, with the node named. */
static int
s_resolver_fail (kiln_cc_ctx_t *cx, int rc, kiln_err_t *err)
{
    char msg[KILN_ERR_MSG_MAX / 2];
    size_t n = strnlen (err->msg, sizeof msg - 1);
    memcpy (msg, err->msg, n);
    msg[n] = '\0';
    return kiln_cc_fail (cx, -rc, err, "%s", msg);
}

/* --- elementwise --------------------------------------------------------- */

int
kiln_lower_math_unary (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                       kiln_kernel_t k, kiln_err_t *err)
{
    int x = s_input (cx, node, 0, err);
    if (x < 0)
        return x;
    int y = s_output (cx, node, &s_gt (cx, x)->shape, err);
    if (y < 0)
        return y;
    int op = s_emit (cx, k, &x, 1, &y, 1, NULL, err);
    if (op < 0)
        return op;
    /* ONNX's defaults, as float32 values like the attributes. */
    int rc = 0;
    if (s_op_is (node, "LeakyRelu"))
        rc = s_set_f (cx, op, "alpha", s_attr_f (node, "alpha", (float) 0.01), err);
    else if (s_op_is (node, "Elu") || s_op_is (node, "Celu"))
        rc = s_set_f (cx, op, "alpha", s_attr_f (node, "alpha", 1.0), err);
    else if (s_op_is (node, "Selu")) {
        if (!(rc = s_set_f (cx, op, "alpha",
                            s_attr_f (node, "alpha", (float) 1.67326319217681884765625),
                            err)))
            rc = s_set_f (cx, op, "gamma",
                          s_attr_f (node, "gamma", (float) 1.05070102214813232421875),
                          err);
    } else if (s_op_is (node, "HardSigmoid")) {
        if (!(rc = s_set_f (cx, op, "alpha", s_attr_f (node, "alpha", (float) 0.2), err)))
            rc = s_set_f (cx, op, "beta", s_attr_f (node, "beta", 0.5), err);
    }
    /* the attributes of a row of common/kiln_ops_unary.h */
#define S_ROW(X_, id, name, onnx, an, ad, bn, bd, expr)                           \
    if (k == KILN_K_##id) {                                                       \
        const char *names[2] = { an, bn };                                        \
        double defs[2] = { ad, bd };                                              \
        for (int i = 0; i < 2 && !rc; i++)                                        \
            if (names[i])                                                         \
                rc = s_set_f (cx, op, names[i], s_attr_f (node, names[i], (float) defs[i]), \
                              err);                                               \
    }
    KILN_UNARY_OPS (S_ROW, _)
#undef S_ROW
    return rc < 0 ? rc : 0;
}

int
kiln_lower_math_cast (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                      kiln_kernel_t k, kiln_err_t *err)
{
    int x = s_input (cx, node, 0, err);
    if (x < 0)
        return x;
    int y = s_output (cx, node, &s_gt (cx, x)->shape, err);
    if (y < 0)
        return y;
    /* A cast to the same type is a view.  Half tensors are float32 in the
     * program (kiln_cc_lower.h): from a half type to float32 is a view
     * too (the values are exact), and to a half type from float32 or the
     * other half type one rounding; from any other type a cast to
     * float32, then that rounding. */
    kiln_dtype_t dx = s_gt (cx, x)->dtype, dy = s_gt (cx, y)->dtype;
    bool to_half = kiln_dtype_is_half (dy);
    if (dx == dy || (kiln_cc_dtype (cx, x) == kiln_cc_dtype (cx, y) && !to_half))
        return kiln_cc_lower_view (cx, node, KILN_K_COPY, err);
    if (kiln_cc_dtype (cx, x) == kiln_cc_dtype (cx, y)) {
        int px = kiln_cc_operand (cx, x, err);
        if (px < 0)
            return px;
        int py = kiln_cc_result (cx, y, err);
        if (py < 0)
            return py;
        int op = kiln_cc_round (cx, px, py, dy, err);
        return op < 0 ? op : 0;
    }
    int op = s_emit (cx, k, &x, 1, &y, 1, NULL, err);
    if (op < 0 || !to_half)
        return op < 0 ? op : 0;
    int py = cx->tmap[y];
    op = kiln_cc_round (cx, py, py, dy, err);
    return op < 0 ? op : 0;
}

int
kiln_lower_math_clip (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                      kiln_kernel_t k, kiln_err_t *err)
{
    bool has_min, has_max;
    double lo, hi;
    int lo_in, hi_in;
    int rc = kiln_math_clip_bounds (cx->g, node, &has_min, &lo, &has_max, &hi,
                                    &lo_in, &hi_in, err);
    if (rc)
        return s_resolver_fail (cx, rc, err);
    if (cx->g->opset < 11) {
        /* Clip-6's defaults are the float limits, not "no bound": they
         * turn an infinity into FLT_MAX. */
        lo = has_min ? lo : -FLT_MAX;
        hi = has_max ? hi : FLT_MAX;
        has_min = has_max = true;
    }
    int x = s_input (cx, node, 0, err);
    if (x < 0)
        return x;
    int y = s_output (cx, node, &s_gt (cx, x)->shape, err);
    if (y < 0)
        return y;
    int gin[3] = { x }, n_in = 1, lo_at = 0, hi_at = 0;
    if (lo_in >= 0) {
        lo_at = n_in;
        gin[n_in++] = lo_in;
    }
    if (hi_in >= 0) {
        hi_at = n_in;
        gin[n_in++] = hi_in;
    }
    int op = s_emit (cx, k, gin, n_in, &y, 1, NULL, err);
    if (op < 0)
        return op;
    if ((lo_at && (rc = s_set_i (cx, op, "min_input", lo_at, err)))
        || (hi_at && (rc = s_set_i (cx, op, "max_input", hi_at, err)))
        || (has_min && (rc = s_set_f (cx, op, "min", lo, err)))
        || (has_max && (rc = s_set_f (cx, op, "max", hi, err))))
        return rc;
    return 0;
}

int
kiln_lower_math_arith (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                       kiln_kernel_t k, kiln_err_t *err)
{
    int a = s_input (cx, node, 0, err), b = s_input (cx, node, 1, err);
    if (a < 0 || b < 0)
        return a < 0 ? a : b;
    const kiln_shape_t *sa = &s_gt (cx, a)->shape, *sb = &s_gt (cx, b)->shape;
    kiln_shape_t ys;
    if (!s_broadcast (sa, sb, &ys))
        return kiln_cc_fail (cx, KILN_ESHAPE, err, "inputs do not broadcast");
    int y = s_output (cx, node, &ys, err);
    if (y < 0)
        return y;
    int gin[2] = { a, b };
    int op = s_emit (cx, k, gin, 2, &y, 1, NULL, err);
    if (op < 0)
        return op;
    /* The float32 kernel takes each operand's shape right-aligned to the
     * output's rank. */
    const kiln_shape_t *s[2] = { sa, sb };
    const char *names[2] = { "shape_a", "shape_b" };
    for (int i = 0; i < 2; i++) {
        int64_t d[KILN_MAX_RANK];
        for (int j = 0; j < ys.rank; j++) {
            int m = j - (ys.rank - s[i]->rank);
            d[j] = m >= 0 ? s[i]->dims[m] : 1;
        }
        /* a channels-last Y (kiln_cc_layout.h): each operand is
         * channels-last, or one value per channel whose bytes read the
         * same either way */
        if (cx->cl[y]) {
            kiln_shape_t p = { .rank = 4 };
            memcpy (p.dims, d, sizeof p.dims[0] * 4);
            kiln_cc_cl_shape (&p);
            memcpy (d, p.dims, sizeof p.dims[0] * 4);
        }
        int rc = kiln_prog_op_set_ints (&cx->prog->ops[op], names[i], d, ys.rank, err);
        if (rc)
            return rc;
    }
    return 0;
}

int
kiln_lower_math_broadcast (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                           kiln_kernel_t k, kiln_err_t *err)
{
    int gin[KILN_PROG_MAX_OP_IO];
    if (node->n_inputs < 1 || node->n_inputs > KILN_PROG_MAX_OP_IO)
        return kiln_cc_fail (cx, KILN_EUNSUPPORTED, err, "has %d inputs; kiln "
                             "takes 1 to %d", node->n_inputs, KILN_PROG_MAX_OP_IO);
    kiln_shape_t ys;
    for (int i = 0; i < node->n_inputs; i++) {
        if ((gin[i] = s_input (cx, node, i, err)) < 0)
            return gin[i];
        const kiln_shape_t *s = &s_gt (cx, gin[i])->shape;
        kiln_shape_t acc = ys;
        if (i == 0)
            ys = *s;
        else if (!s_broadcast (&acc, s, &ys))
            return kiln_cc_fail (cx, KILN_ESHAPE, err, "inputs do not broadcast");
    }
    int y = s_output (cx, node, &ys, err);
    if (y < 0)
        return y;
    int op = s_emit (cx, k, gin, node->n_inputs, &y, 1, NULL, err);
    return op < 0 ? op : 0;
}

int
kiln_lower_math_mod (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                     kiln_err_t *err)
{
    int64_t fmod_attr = kiln_node_attr_int (node, "fmod", 0);
    if (fmod_attr != 0 && fmod_attr != 1)
        return kiln_cc_fail (cx, KILN_EINVAL, err, "fmod is %lld, not 0 or 1",
                             (long long) fmod_attr);
    return kiln_lower_math_broadcast (cx, node, fmod_attr ? KILN_K_FMOD : k, err);
}

/* --- softmax, reductions, arg* ------------------------------------------- */

int
kiln_lower_math_softmax (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                         kiln_kernel_t k, kiln_err_t *err)
{
    int x = s_input (cx, node, 0, err);
    if (x < 0)
        return x;
    int axis, rc;
    bool flatten;
    if ((rc = kiln_math_softmax_axis (cx->g, node, s_gt (cx, x)->shape.rank,
                                      &axis, &flatten, err)))
        return s_resolver_fail (cx, rc, err);
    int y = s_output (cx, node, &s_gt (cx, x)->shape, err);
    if (y < 0)
        return y;
    int op = s_emit (cx, k, &x, 1, &y, 1, NULL, err);
    if (op < 0)
        return op;
    if ((rc = s_set_i (cx, op, "axis", axis, err))
        || (rc = s_set_i (cx, op, "flatten", flatten, err)))
        return rc;
    return 0;
}

int
kiln_lower_math_reduce (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                        kiln_kernel_t k, kiln_err_t *err)
{
    int x = s_input (cx, node, 0, err);
    if (x < 0)
        return x;
    const kiln_shape_t *sx = &s_gt (cx, x)->shape;
    bool red[KILN_MAX_RANK], keep;
    int rc = kiln_math_reduce_axes (cx->g, node, sx->rank, red, &keep, err);
    if (rc)
        return s_resolver_fail (cx, rc, err);
    kiln_shape_t ys = { .rank = 0 };
    int64_t axes[KILN_MAX_RANK];
    int n = 0;
    for (int i = 0; i < sx->rank; i++) {
        if (red[i])
            axes[n++] = i;
        if (!red[i])
            ys.dims[ys.rank++] = sx->dims[i];
        else if (keep)
            ys.dims[ys.rank++] = 1;
    }
    int y = s_output (cx, node, &ys, err);
    if (y < 0)
        return y;
    /* The axes input, if any, was consumed here: only X is an operand. */
    int op = s_emit (cx, k, &x, 1, &y, 1, NULL, err);
    if (op < 0)
        return op;
    return kiln_prog_op_set_ints (&cx->prog->ops[op], "axes", axes, n, err);
}

int
kiln_lower_math_arg (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                     kiln_kernel_t k, kiln_err_t *err)
{
    int x = s_input (cx, node, 0, err);
    if (x < 0)
        return x;
    const kiln_shape_t *sx = &s_gt (cx, x)->shape;
    int r = sx->rank;
    int64_t axis = kiln_node_attr_int (node, "axis", 0);
    int64_t keep = kiln_node_attr_int (node, "keepdims", 1);
    int64_t last = kiln_node_attr_int (node, "select_last_index", 0);
    if (r < 1 || axis < -r || axis >= r)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "axis %lld is outside the "
                             "rank-%d input", (long long) axis, r);
    if (axis < 0)
        axis += r;
    kiln_shape_t ys = { .rank = 0 };
    for (int i = 0; i < r; i++) {
        if (i != axis)
            ys.dims[ys.rank++] = sx->dims[i];
        else if (keep)
            ys.dims[ys.rank++] = 1;
    }
    int y = s_output (cx, node, &ys, err);
    if (y < 0)
        return y;
    int op = s_emit (cx, k, &x, 1, &y, 1, NULL, err);
    if (op < 0)
        return op;
    int rc;
    if ((rc = s_set_i (cx, op, "axis", axis, err))
        || (rc = s_set_i (cx, op, "select_last", last != 0, err)))
        return rc;
    return 0;
}

/* --- normalisations ------------------------------------------------------ */

int
kiln_lower_math_norm (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                      kiln_kernel_t k, kiln_err_t *err)
{
    /* Optional inputs come last (LayerNormalization's B): drop absent
     * ones there; any other must be present. */
    int gin[5], n_in = node->n_inputs, rc;
    while (n_in > 0 && node->inputs[n_in - 1] < 0)
        n_in--;
    if (n_in < 1 || n_in > 5)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "has %d inputs", n_in);
    for (int i = 0; i < n_in; i++)
        if ((gin[i] = s_input (cx, node, i, err)) < 0)
            return gin[i];
    const kiln_shape_t *sx = &s_gt (cx, gin[0])->shape;
    int y = s_output (cx, node, sx, err);
    if (y < 0)
        return y;
    double eps = s_attr_f (node, "epsilon", (float) 1e-5);
    if (k == KILN_K_LAYER_NORM) {
        int r = sx->rank;
        int64_t axis = kiln_node_attr_int (node, "axis", -1);
        if (r < 1 || axis < -r || axis >= r)
            return kiln_cc_fail (cx, KILN_ECOMPILE, err, "axis %lld is outside the "
                                 "rank-%d input", (long long) axis, r);
        if (axis < 0)
            axis += r;
        int gout[3] = { y, -1, -1 }, n_out = 1;
        kiln_shape_t stat = *sx;
        for (int i = (int) axis; i < r; i++)
            stat.dims[i] = 1;
        if (node->n_outputs > 1) {
            k = KILN_K_LAYER_NORM_STATS;
            n_out = 3;
            for (int i = 1; i < node->n_outputs && i < 3; i++) {
                gout[i] = node->outputs[i];
                if ((rc = kiln_cc_expect_shape (cx, gout[i], &stat, err)))
                    return rc;
            }
        }
        int op = s_emit (cx, k, gin, n_in, gout, n_out, &stat, err);
        if (op < 0)
            return op;
        if ((rc = s_set_i (cx, op, "axis", axis, err))
            || (rc = s_set_f (cx, op, "epsilon", eps, err)))
            return rc;
        return 0;
    }
    if (node->n_outputs > 1)
        return kiln_cc_fail (cx, KILN_EUNSUPPORTED, err, "more than one output");
    /* A BatchNormalization may write the activation that read it
     * (kiln_cc_fuse.c): its output is then the activation's. */
    const kiln_cc_fusion_t *f = &cx->fusion[cx->node];
    if (k == KILN_K_BATCH_NORM && f->out >= 0
        && (rc = kiln_cc_expect_shape (cx, f->out, sx, err)))
        return rc;
    int yo = k == KILN_K_BATCH_NORM && f->out >= 0 ? f->out : y;
    int op = s_emit (cx, k, gin, n_in, &yo, 1, NULL, err);
    if (op < 0)
        return op;
    if (k == KILN_K_BATCH_NORM && (rc = kiln_cc_fused_params (cx, op, f, err)))
        return rc;
    if (k == KILN_K_LRN) {
        int64_t size = kiln_node_attr_int (node, "size", 0);
        if ((rc = s_set_i (cx, op, "size", size, err))
            || (rc = s_set_f (cx, op, "alpha", s_attr_f (node, "alpha", (float) 1e-4), err))
            || (rc = s_set_f (cx, op, "beta", s_attr_f (node, "beta", 0.75), err))
            || (rc = s_set_f (cx, op, "bias", s_attr_f (node, "bias", 1.0), err)))
            return rc;
        return 0;
    }
    return s_set_f (cx, op, "epsilon", eps, err);
}

/* --- losses ---------------------------------------------------------------- */

/* NegativeLogLikelihoodLoss as nll_loss; SoftmaxCrossEntropyLoss as
 * log_softmax over axis 1 (into its second output when the graph reads
 * it, else a temporary) and nll_loss of that. */
int
kiln_lower_math_nll (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                     kiln_err_t *err)
{
    int x = s_input (cx, node, 0, err), t = s_input (cx, node, 1, err), rc;
    if (x < 0 || t < 0)
        return x < 0 ? x : t;
    const char *red = kiln_node_attr_string (node, "reduction", "mean");
    int64_t reduction = strcmp (red, "none") == 0 ? 0 : strcmp (red, "sum") == 0 ? 1 : 2;
    bool has_ignore = kiln_node_attr (node, "ignore_index") != NULL;
    int64_t ignore = kiln_node_attr_int (node, "ignore_index", 0);
    int ins[3], n_in = node->n_inputs > 2 && node->inputs[2] >= 0 ? 3 : 2;
    for (int i = 0; i < n_in; i++)
        if ((ins[i] = kiln_cc_operand (cx, node->inputs[i], err)) < 0)
            return ins[i];
    if (s_op_is (node, "SoftmaxCrossEntropyLoss")) {
        const kiln_shape_t *xs = &s_gt (cx, x)->shape;
        int lp = node->n_outputs > 1 && node->outputs[1] >= 0
                 ? kiln_cc_result (cx, node->outputs[1], err)
                 : kiln_cc_temp (cx, cx->prog->tensors[ins[0]].dtype, xs, err);
        if (lp < 0)
            return lp;
        int op = kiln_cc_emit (cx, KILN_K_LOG_SOFTMAX, &ins[0], 1, &lp, 1, err);
        if (op < 0 || (rc = s_set_i (cx, op, "axis", 1, err))
            || (rc = s_set_i (cx, op, "flatten", 0, err)))
            return op < 0 ? op : rc;
        ins[0] = lp;
    }
    int y = kiln_cc_result (cx, node->outputs[0], err);
    if (y < 0)
        return y;
    int op = kiln_cc_emit (cx, k, ins, n_in, &y, 1, err);
    if (op < 0 || (rc = s_set_i (cx, op, "reduction", reduction, err))
        || (rc = s_set_i (cx, op, "has_ignore", has_ignore, err))
        || (rc = s_set_i (cx, op, "ignore_index", ignore, err)))
        return op < 0 ? op : rc;
    return 0;
}

/* IsInf (kernel is_inf) with its two flags. */
int
kiln_lower_math_isinf (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                       kiln_err_t *err)
{
    /* the unary op, then its flags */
    int rc = kiln_lower_math_unary (cx, node, k, err), op = cx->prog->n_ops - 1;
    if (rc < 0
        || (rc = s_set_i (cx, op, "detect_positive",
                          kiln_node_attr_int (node, "detect_positive", 1) != 0, err))
        || (rc = s_set_i (cx, op, "detect_negative",
                          kiln_node_attr_int (node, "detect_negative", 1) != 0, err)))
        return rc;
    return 0;
}
