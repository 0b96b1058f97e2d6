/*
 * kiln_infer_shape — shape inference for the data-movement, shape and
 * window ops: Transpose, Squeeze, Unsqueeze, Concat, Split, Slice,
 * Gather, Pad, Tile, Expand, Resize, DepthToSpace, SpaceToDepth, Einsum,
 * ConvTranspose.  Registered in the op table of kiln_graph_infer.c.
 *
 * The parameters of each op (axes, pads, slices, scales, windows) are
 * worked out by kiln_shape_ops.c, which folding and lowering call too;
 * the functions here add the dtype checks and write the outputs.
 * Data-movement ops take any dtype; Resize, Einsum and ConvTranspose
 * compute, so they take float32.
 */
#include "graph/kiln_infer.h"
#include "graph/kiln_shape_ops.h"

#include <string.h>

/* Prefix the error the kiln_shape_ops function left with the node. */
static int
s_prefixed (kiln_infer_ctx_t *ctx, int rc)
{
    return rc ? kiln_error_prefix (ctx->err, "%s", ctx->label) : 0;
}

static void
s_set (kiln_infer_ctx_t *ctx, int i, kiln_dtype_t dt, const kiln_shape_t *shape)
{
    kiln_infer_out (ctx, i)->dtype = dt;
    kiln_infer_out (ctx, i)->shape = *shape;
}

/* Input i must be an int64 or int32 tensor (indices). */
static int
s_want_index (kiln_infer_ctx_t *ctx, int i)
{
    const kiln_infer_type_t *t = kiln_infer_in (ctx, i);
    if (t && t->dtype != KILN_DT_INT64 && t->dtype != KILN_DT_INT32) {
        char nb[KILN_INFER_NAME_MAX];
        return kiln_infer_fail (ctx, KILN_ESHAPE, "%s is %s, expected int64 or int32",
                                kiln_infer_in_name (ctx, i, nb, sizeof nb),
                                kiln_dtype_name (t->dtype));
    }
    return 0;
}

/* --- constant inputs (kiln_infer.h) ---------------------------------- */

int
kiln_infer_const_ints (kiln_infer_ctx_t *ctx, int i, int max, int64_t *v, int *n)
{
    char nb[KILN_INFER_NAME_MAX];
    kiln_infer_in_name (ctx, i, nb, sizeof nb);
    return s_prefixed (ctx, kiln_const_ints (ctx->g, ctx->node, i, nb, max, v, n, ctx->err));
}

bool
kiln_infer_is_const (kiln_infer_ctx_t *ctx, int i)
{
    return kiln_const_input (ctx->g, ctx->node, i);
}

/* --- the infer functions ------------------------------------------- */

int
kiln_infer_transpose (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    int64_t perm[KILN_MAX_RANK];
    int rc = kiln_transpose_perm (ctx->g, ctx->node, x->shape.rank, perm, ctx->err);
    if (rc)
        return s_prefixed (ctx, rc);
    kiln_shape_t y = { .rank = x->shape.rank };
    for (int i = 0; i < y.rank; i++)
        y.dims[i] = x->shape.dims[perm[i]];
    s_set (ctx, 0, x->dtype, &y);
    return 0;
}

int
kiln_infer_squeeze (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    kiln_shape_t y;
    int rc = kiln_squeeze_shape (ctx->g, ctx->node, &x->shape, &y, ctx->err);
    if (rc)
        return s_prefixed (ctx, rc);
    s_set (ctx, 0, x->dtype, &y);
    return 0;
}

int
kiln_infer_unsqueeze (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    kiln_shape_t y;
    int rc = kiln_unsqueeze_shape (ctx->g, ctx->node, &x->shape, &y, ctx->err);
    if (rc)
        return s_prefixed (ctx, rc);
    s_set (ctx, 0, x->dtype, &y);
    return 0;
}

int
kiln_infer_concat (kiln_infer_ctx_t *ctx)
{
    const kiln_shape_t *ins[KILN_MAX_NODE_IO];
    const kiln_infer_type_t *x0 = kiln_infer_in (ctx, 0);
    for (int i = 0; i < ctx->n_in; i++) {
        const kiln_infer_type_t *t = kiln_infer_in (ctx, i);
        if (!t)
            return kiln_infer_fail (ctx, KILN_EINVAL, "input %d is missing", i);
        if (t->dtype != x0->dtype) {
            char na[KILN_INFER_NAME_MAX], nb[KILN_INFER_NAME_MAX];
            return kiln_infer_fail (ctx, KILN_ESHAPE, "%s is %s but %s is %s",
                                    kiln_infer_in_name (ctx, i, na, sizeof na),
                                    kiln_dtype_name (t->dtype),
                                    kiln_infer_in_name (ctx, 0, nb, sizeof nb),
                                    kiln_dtype_name (x0->dtype));
        }
        ins[i] = &t->shape;
    }
    int axis;
    kiln_shape_t y;
    int rc = kiln_concat_params (ctx->node, ins, ctx->n_in, &axis, &y, ctx->err);
    if (rc)
        return s_prefixed (ctx, rc);
    s_set (ctx, 0, x0->dtype, &y);
    return 0;
}

int
kiln_infer_split (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    int64_t sizes[KILN_MAX_NODE_IO];
    int axis;
    if (x->shape.rank < 1)
        return kiln_infer_fail (ctx, KILN_ESHAPE, "cannot split a scalar");
    int rc = kiln_split_sizes (ctx->g, ctx->node, &x->shape, &axis, sizes, ctx->err);
    if (rc)
        return s_prefixed (ctx, rc);
    for (int i = 0; i < ctx->node->n_outputs; i++) {
        kiln_shape_t y = x->shape;
        y.dims[axis] = sizes[i];
        s_set (ctx, i, x->dtype, &y);
    }
    return 0;
}

int
kiln_infer_slice (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    int64_t start[KILN_MAX_RANK], step[KILN_MAX_RANK];
    kiln_shape_t y;
    int rc = kiln_slice_params (ctx->g, ctx->node, &x->shape, start, step, &y, ctx->err);
    if (rc)
        return s_prefixed (ctx, rc);
    s_set (ctx, 0, x->dtype, &y);
    return 0;
}

int
kiln_infer_gather (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0), *ind = kiln_infer_in (ctx, 1);
    int rc = s_want_index (ctx, 1);
    if (rc)
        return rc;
    int axis;
    kiln_shape_t y;
    if ((rc = kiln_gather_params (ctx->node, &x->shape, &ind->shape, &axis, &y, ctx->err)))
        return s_prefixed (ctx, rc);
    s_set (ctx, 0, x->dtype, &y);
    return 0;
}

int
kiln_infer_pad (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    int64_t pads[2 * KILN_MAX_RANK];
    kiln_pad_mode_t mode;
    double value;
    kiln_shape_t y;
    int rc = kiln_pad_params (ctx->g, ctx->node, &x->shape, pads, &mode, &value, &y, ctx->err);
    if (rc)
        return s_prefixed (ctx, rc);
    s_set (ctx, 0, x->dtype, &y);
    return 0;
}

int
kiln_infer_tile (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    kiln_shape_t y;
    int rc = kiln_tile_shape (ctx->g, ctx->node, &x->shape, &y, ctx->err);
    if (rc)
        return s_prefixed (ctx, rc);
    s_set (ctx, 0, x->dtype, &y);
    return 0;
}

int
kiln_infer_expand (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    kiln_shape_t y;
    int rc = kiln_expand_shape (ctx->g, ctx->node, &x->shape, &y, ctx->err);
    if (rc)
        return s_prefixed (ctx, rc);
    s_set (ctx, 0, x->dtype, &y);
    return 0;
}

int
kiln_infer_resize (kiln_infer_ctx_t *ctx)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    int rc = kiln_infer_want_float (ctx, 0);
    if (rc)
        return rc;
    kiln_resize_t rp;
    kiln_shape_t y;
    if ((rc = kiln_resize_params (ctx->g, ctx->node, &x->shape, &rp, &y, ctx->err)))
        return s_prefixed (ctx, rc);
    s_set (ctx, 0, x->dtype, &y);
    return 0;
}

static int
s_d2s (kiln_infer_ctx_t *ctx, bool depth)
{
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0);
    int64_t block;
    bool crd;
    kiln_shape_t y;
    int rc = kiln_d2s_params (ctx->node, depth, &x->shape, &block, &crd, &y, ctx->err);
    if (rc)
        return s_prefixed (ctx, rc);
    s_set (ctx, 0, x->dtype, &y);
    return 0;
}

int
kiln_infer_depth_to_space (kiln_infer_ctx_t *ctx)
{
    return s_d2s (ctx, true);
}

int
kiln_infer_space_to_depth (kiln_infer_ctx_t *ctx)
{
    return s_d2s (ctx, false);
}

int
kiln_infer_einsum (kiln_infer_ctx_t *ctx)
{
    const kiln_shape_t *ins[2];
    if (ctx->n_in > 2)
        return kiln_infer_fail (ctx, KILN_EUNSUPPORTED,
                                "Einsum of %d operands (one or two are supported)", ctx->n_in);
    for (int i = 0; i < ctx->n_in; i++) {
        int rc = kiln_infer_want_float (ctx, i);
        if (rc)
            return rc;
        if (!kiln_infer_in (ctx, i))
            return kiln_infer_fail (ctx, KILN_EINVAL, "input %d is missing", i);
        ins[i] = &kiln_infer_in (ctx, i)->shape;
    }
    kiln_einsum_t e;
    kiln_shape_t y;
    int rc = kiln_einsum_params (ctx->node, ins, ctx->n_in, &e, &y, ctx->err);
    if (rc)
        return s_prefixed (ctx, rc);
    s_set (ctx, 0, kiln_infer_in (ctx, 0)->dtype, &y);
    return 0;
}

int
kiln_infer_conv_transpose (kiln_infer_ctx_t *ctx)
{
    int rc;
    if ((rc = kiln_infer_want_float (ctx, 0)) || (rc = kiln_infer_want_float (ctx, 1))
        || (rc = kiln_infer_want_float (ctx, 2)))
        return rc;
    const kiln_infer_type_t *x = kiln_infer_in (ctx, 0), *w = kiln_infer_in (ctx, 1);
    const kiln_infer_type_t *b = kiln_infer_in (ctx, 2);
    kiln_window_t win;
    int64_t out_pad[KILN_MAX_RANK], group;
    kiln_shape_t y;
    if ((rc = kiln_convtr_params (ctx->node, &x->shape, &w->shape, &win, out_pad, &group, &y,
                                  ctx->err)))
        return s_prefixed (ctx, rc);
    if (b && (b->shape.rank != 1 || b->shape.dims[0] != y.dims[1])) {
        char nb[KILN_INFER_NAME_MAX], sb[KILN_INFER_SHAPE_MAX];
        return kiln_infer_fail (ctx, KILN_ESHAPE, "%s %s is not [%lld], one bias per output channel",
                                kiln_infer_in_name (ctx, 2, nb, sizeof nb),
                                kiln_infer_shape_str (&b->shape, sb), (long long) y.dims[1]);
    }
    s_set (ctx, 0, x->dtype, &y);
    return 0;
}
