/*
 * kiln_lower_shape — lowering of the shape, data-movement and window ops
 * (see kiln_lower_shape.h).
 */
#include "compiler/kiln_lower_shape.h"

#include <stdio.h>
#include <string.h>

#include "common/kiln_pack.h"
#include "compiler/kiln_cc_plan.h"
#include "graph/kiln_shape_ops.h"

/* --- helpers ---------------------------------------------------------- */

static const kiln_tensor_t *
s_gt (const kiln_cc_ctx_t *cx, int gt)
{
    return &cx->g->tensors[gt];
}

static int
s_in (const kiln_node_t *node, int i)
{
    return i < node->n_inputs ? node->inputs[i] : -1;
}

static bool
s_op_is (const kiln_node_t *node, const char *op)
{
    return strcmp (node->op, op) == 0;
}

/* Put the node in front of an error a kiln_shape_ops function left. */
static int
s_prefixed (kiln_cc_ctx_t *cx, int rc, kiln_err_t *err)
{
    return rc ? kiln_cc_fail (cx, err->code, err, "%s", err->msg) : 0;
}

static int
s_set_ints (kiln_cc_ctx_t *cx, int op, const char *name, const int64_t *v, int n,
            kiln_err_t *err)
{
    return kiln_prog_op_set_ints (&cx->prog->ops[op], name, v, n, err);
}

static int
s_set_int (kiln_cc_ctx_t *cx, int op, const char *name, int64_t v, kiln_err_t *err)
{
    return kiln_prog_op_set_int (&cx->prog->ops[op], name, v, err);
}

/* The node's input i as an operand, which must exist. */
static int
s_operand (kiln_cc_ctx_t *cx, const kiln_node_t *node, int i, kiln_err_t *err)
{
    int gt = s_in (node, i);
    if (gt < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "input %d is missing", i);
    return kiln_cc_operand (cx, gt, err);
}

/* Graph output k of the node, checked against `want`, as a new result. */
static int
s_result (kiln_cc_ctx_t *cx, const kiln_node_t *node, int k, const kiln_shape_t *want,
          kiln_err_t *err)
{
    if (k >= node->n_outputs)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "output %d is missing", k);
    int rc = kiln_cc_expect_shape (cx, node->outputs[k], want, err);
    if (rc)
        return rc;
    return kiln_cc_result (cx, node->outputs[k], err);
}

static int
s_need_f32 (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_err_t *err)
{
    for (int i = 0; i < node->n_inputs; i++) {
        int gt = node->inputs[i];
        if (gt >= 0 && kiln_cc_dtype (cx, gt) != KILN_DT_FLOAT32)
            return kiln_cc_fail (cx, KILN_EUNSUPPORTED, err, "tensor '%s' is %s; this op "
                                 "computes in float32 only (float16 and bfloat16 "
                                 "through float32)", kiln_cc_tname (cx, gt),
                                 kiln_dtype_name (s_gt (cx, gt)->dtype));
    }
    return 0;
}

/* Emit Y = strided read of X: a loop nest over dims[r] reading X at
 * offset + sum of i_k * st[k] (elements). */
static int
s_emit_strided (kiln_cc_ctx_t *cx, int px, int py, int r, const int64_t *dims,
                const int64_t *st, int64_t offset, kiln_err_t *err)
{
    if (r > KILN_PROG_MAX_PARAM_INTS)
        return kiln_cc_fail (cx, KILN_ELIMIT, err, "a loop nest of %d levels, more than %d", r,
                             KILN_PROG_MAX_PARAM_INTS);
    int op = kiln_cc_emit (cx, KILN_K_STRIDED, &px, 1, &py, 1, err);
    if (op < 0)
        return op;
    int rc;
    if ((rc = s_set_ints (cx, op, "dims", dims, r, err))
        || (rc = s_set_ints (cx, op, "strides", st, r, err))
        || (rc = s_set_int (cx, op, "offset", offset, err)))
        return rc;
    return 0;
}

/* A permutation `perm` of X (shape xs) into program tensor py. */
static int
s_emit_permute (kiln_cc_ctx_t *cx, int px, const kiln_shape_t *xs, const int64_t *perm,
                int py, kiln_err_t *err)
{
    int64_t xst[KILN_MAX_RANK], dims[KILN_MAX_RANK], st[KILN_MAX_RANK];
    kiln_shape_strides (xs, xst);
    for (int i = 0; i < xs->rank; i++) {
        dims[i] = xs->dims[perm[i]];
        st[i] = xst[perm[i]];
    }
    return s_emit_strided (cx, px, py, xs->rank, dims, st, 0, err);
}

/* --- strided family ---------------------------------------------------- */

int
kiln_lower_shape_strided (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                          kiln_err_t *err)
{
    int x = s_in (node, 0);
    if (x < 0 || node->n_outputs < 1)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs an input and an output");
    const kiln_shape_t *xs = &s_gt (cx, x)->shape;
    int64_t xst[KILN_MAX_RANK], dims[KILN_PROG_MAX_PARAM_INTS], st[KILN_PROG_MAX_PARAM_INTS];
    int64_t offset = 0;
    int r = 0, rc = 0;
    kiln_shape_t y;
    kiln_shape_strides (xs, xst);
    const kiln_cc_fusion_t *f = &cx->fusion[cx->node];
    /* X held channels-last ([N, H, W, C] in the program, kiln_cc_layout.h) */
    bool x_cl = cx->cl[x] && xs->rank == 4;
    if (x_cl) {
        xst[1] = 1;
        xst[3] = xs->dims[1];
        xst[2] = xs->dims[3] * xst[3];
        xst[0] = xs->dims[2] * xst[2];
    }
    if (s_op_is (node, "Transpose")) {
        int64_t perm[KILN_MAX_RANK];
        if ((rc = kiln_transpose_perm (cx->g, node, xs->rank, perm, err)))
            return s_prefixed (cx, rc, err);
        /* The fusion pass may have found X to be a strided view of
         * another tensor (kiln_cc_fuse.h): read that one. */
        if (f->src[0] >= 0) {
            memcpy (xst, f->src_st[0], (size_t) xs->rank * sizeof *xst);
            offset = f->src_off[0];
        }
        y.rank = r = xs->rank;
        for (int i = 0; i < r; i++) {
            y.dims[i] = dims[i] = xs->dims[perm[i]];
            st[i] = xst[perm[i]];
        }
    }
    else if (s_op_is (node, "Slice")) {
        int64_t start[KILN_MAX_RANK], step[KILN_MAX_RANK];
        if ((rc = kiln_slice_params (cx->g, node, xs, start, step, &y, err)))
            return s_prefixed (cx, rc, err);
        r = y.rank;
        for (int i = 0; i < r; i++) {
            dims[i] = y.dims[i];
            st[i] = xst[i] * step[i];
            offset += start[i] * xst[i];
        }
    }
    else if (s_op_is (node, "Expand")) {
        if ((rc = kiln_expand_shape (cx->g, node, xs, &y, err)))
            return s_prefixed (cx, rc, err);
        r = y.rank;
        for (int i = 0; i < r; i++) {
            int j = i - (r - xs->rank);
            dims[i] = y.dims[i];
            st[i] = j < 0 || xs->dims[j] == 1 ? 0 : xst[j];
        }
    }
    else if (s_op_is (node, "Tile")) {
        /* Axis i of Y is [repeats, X's size] with the repeat at stride 0. */
        if ((rc = kiln_tile_shape (cx->g, node, xs, &y, err)))
            return s_prefixed (cx, rc, err);
        for (int i = 0; i < xs->rank; i++) {
            dims[r] = xs->dims[i] ? y.dims[i] / xs->dims[i] : 0;
            st[r++] = 0;
            dims[r] = xs->dims[i];
            st[r++] = xst[i];
        }
    }
    else if (s_op_is (node, "DepthToSpace") || s_op_is (node, "SpaceToDepth")) {
        bool depth = s_op_is (node, "DepthToSpace"), crd;
        int64_t b;
        if ((rc = kiln_d2s_params (node, depth, xs, &b, &crd, &y, err)))
            return s_prefixed (cx, rc, err);
        int64_t n = xs->dims[0], c = xs->dims[1], h = xs->dims[2], w = xs->dims[3];
        int64_t hw = h * w, chw = c * hw;
        r = 6;
        if (depth) {
            /* Y[n, c', h*b + i, w*b + j] = X[n, ch (c', i, j), h, w] with
             * ch = (i*b + j)*C' + c' (DCR) or c'*b*b + i*b + j (CRD). */
            int64_t cp = c / (b * b);
            int64_t d[6] = { n, cp, h, b, w, b };
            int64_t s_dcr[6] = { chw, hw, w, b * cp * hw, 1, cp * hw };
            int64_t s_crd[6] = { chw, b * b * hw, w, b * hw, 1, hw };
            memcpy (dims, d, sizeof d);
            memcpy (st, crd ? s_crd : s_dcr, sizeof s_dcr);
        }
        else {
            /* Y[n, (i*b + j)*C + c, h', w'] = X[n, c, h'*b + i, w'*b + j]. */
            int64_t d[6] = { n, b, b, c, h / b, w / b };
            int64_t s6[6] = { chw, w, 1, hw, b * w, b };
            memcpy (dims, d, sizeof d);
            memcpy (st, s6, sizeof s6);
        }
    }
    else
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "no strided lowering for this op");
    if (x_cl && !s_op_is (node, "Transpose"))
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "a channels-last input");
    if (cx->cl[node->outputs[0]] && r == 4) {
        /* Y written channels-last: its elements in the order (n, h, w, c) */
        int64_t d1 = dims[1], s1 = st[1];
        dims[1] = dims[2], st[1] = st[2];
        dims[2] = dims[3], st[2] = st[3];
        dims[3] = d1, st[3] = s1;
    }
    /* A nest that reads every element of X once, in order (a transpose
     * that only moves unit axes, a full slice), is a view from -O1 on. */
    if (cx->opts.optlevel >= 1 && offset == 0 && f->src[0] < 0) {
        int64_t want = 1, total = 1;
        bool in_order = true;
        for (int i = r - 1; i >= 0; i--) {
            if (dims[i] == 1)
                continue;
            in_order = in_order && st[i] == want;
            want *= dims[i];
        }
        for (int i = 0; i < xs->rank; i++)
            total *= xs->dims[i];
        if (in_order && want == total && node->n_outputs == 1)
            return kiln_cc_lower_view (cx, node, k, err);
    }
    int px = kiln_cc_operand (cx, f->src[0] >= 0 ? f->src[0] : x, err);
    if (px < 0)
        return px;
    int py = s_result (cx, node, 0, &y, err);
    if (py < 0)
        return py;
    return s_emit_strided (cx, px, py, r, dims, st, offset, err);
}

int
kiln_lower_shape_split (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                        kiln_err_t *err)
{
    int x = s_in (node, 0);
    if (x < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs an input");
    const kiln_shape_t *xs = &s_gt (cx, x)->shape;
    int64_t sizes[KILN_MAX_NODE_IO], xst[KILN_MAX_RANK];
    int axis, rc = kiln_split_sizes (cx->g, node, xs, &axis, sizes, err);
    if (rc)
        return s_prefixed (cx, rc, err);
    int px = kiln_cc_operand (cx, x, err);
    if (px < 0)
        return px;
    kiln_shape_strides (xs, xst);
    int64_t at = 0;
    for (int i = 0; i < node->n_outputs; i++) {
        kiln_shape_t y = *xs;
        y.dims[axis] = sizes[i];
        /* an output its reader takes as a view of X (kiln_cc_fuse.c) */
        if (node->outputs[i] >= 0 && cx->viewed[node->outputs[i]]) {
            at += sizes[i];
            continue;
        }
        int py = s_result (cx, node, i, &y, err);
        if (py < 0)
            return py;
        if ((rc = s_emit_strided (cx, px, py, y.rank, y.dims, xst, at * xst[axis], err)))
            return rc;
        at += sizes[i];
    }
    return 0;
}

/* --- concat, gather, pad, resize -------------------------------------- */

int
kiln_lower_shape_concat (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                         kiln_err_t *err)
{
    int n = node->n_inputs, axis, rc;
    const kiln_shape_t *shapes[KILN_MAX_NODE_IO];
    for (int i = 0; i < n; i++) {
        if (node->inputs[i] < 0)
            return kiln_cc_fail (cx, KILN_ECOMPILE, err, "input %d is missing", i);
        shapes[i] = &s_gt (cx, node->inputs[i])->shape;
    }
    kiln_shape_t y;
    if ((rc = kiln_concat_params (node, shapes, n, &axis, &y, err)))
        return s_prefixed (cx, rc, err);
    if ((rc = kiln_cc_expect_shape (cx, node->outputs[0], &y, err)))
        return rc;
    if ((rc = kiln_cc_plan_concat (cx, node, axis, err)))
        return rc < 0 ? rc : 0;
    kiln_dtype_t dt = kiln_cc_dtype (cx, node->inputs[0]);
    /* At most KILN_PROG_MAX_OP_IO operands per op: each op after the first
     * takes the previous partial result and the next inputs. */
    int done = 0, prev = -1;
    kiln_shape_t part = *shapes[0];
    part.dims[axis] = 0;
    while (done < n) {
        int ins[KILN_PROG_MAX_OP_IO], m = 0;
        if (prev >= 0)
            ins[m++] = prev;
        while (m < KILN_PROG_MAX_OP_IO && done < n) {
            if ((ins[m] = kiln_cc_operand (cx, node->inputs[done], err)) < 0)
                return ins[m];
            part.dims[axis] += shapes[done]->dims[axis];
            m++;
            done++;
        }
        int py = done == n ? kiln_cc_result (cx, node->outputs[0], err)
                           : kiln_cc_temp (cx, dt, &part, err);
        if (py < 0)
            return py;
        int op = kiln_cc_emit (cx, KILN_K_CONCAT, ins, m, &py, 1, err);
        if (op < 0)
            return op;
        if ((rc = s_set_int (cx, op, "axis", axis, err)))
            return rc;
        prev = py;
    }
    return 0;
}

int
kiln_lower_shape_gather (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                         kiln_err_t *err)
{
    int x = s_in (node, 0), ind = s_in (node, 1), axis, rc;
    if (x < 0 || ind < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs data and indices");
    kiln_shape_t y;
    if ((rc = kiln_gather_params (node, &s_gt (cx, x)->shape, &s_gt (cx, ind)->shape, &axis, &y,
                                  err)))
        return s_prefixed (cx, rc, err);
    /* A half table that is stored (an embedding's weight, a graph input)
     * is gathered as it is and only the rows taken are widened: the
     * table is never float32 in the arena. */
    int ins[2];
    if ((ins[0] = kiln_cc_stored (cx, x, err)) < 0)
        return ins[0];
    if ((ins[1] = kiln_cc_operand (cx, ind, err)) < 0)
        return ins[1];
    kiln_dtype_t dt = cx->prog->tensors[ins[0]].dtype;
    int py = s_result (cx, node, 0, &y, err);
    int pg = py >= 0 && kiln_dtype_is_half (dt) ? kiln_cc_temp (cx, dt, &y, err) : py;
    if (pg < 0)
        return pg;
    int op = kiln_cc_emit (cx, KILN_K_GATHER, ins, 2, &pg, 1, err);
    if (op < 0 || (rc = s_set_int (cx, op, "axis", axis, err)))
        return op < 0 ? op : rc;
    if (pg != py && (op = kiln_cc_emit (cx, KILN_K_CAST, &pg, 1, &py, 1, err)) < 0)
        return op;
    return 0;
}

int
kiln_lower_shape_pad (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                      kiln_err_t *err)
{
    int x = s_in (node, 0), rc;
    if (x < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs an input");
    const kiln_shape_t *xs = &s_gt (cx, x)->shape;
    int64_t pads[2 * KILN_MAX_RANK];
    kiln_pad_mode_t mode;
    double value;
    kiln_shape_t y;
    if ((rc = kiln_pad_params (cx->g, node, xs, pads, &mode, &value, &y, err)))
        return s_prefixed (cx, rc, err);
    bool none = true;       /* (torch exports one before an AveragePool) */
    for (int d = 0; d < 2 * xs->rank; d++)
        none = none && pads[d] == 0;
    if (none)
        return kiln_cc_lower_view (cx, node, k, err);
    int px = kiln_cc_operand (cx, x, err);
    if (px < 0)
        return px;
    int py = s_result (cx, node, 0, &y, err);
    if (py < 0)
        return py;
    int op = kiln_cc_emit (cx, KILN_K_PAD, &px, 1, &py, 1, err);
    if (op < 0)
        return op;
    /* The program's mode numbers are kiln_pad_mode_t's. */
    if ((rc = s_set_ints (cx, op, "pads", pads, 2 * xs->rank, err))
        || (rc = s_set_int (cx, op, "mode", mode, err))
        || (rc = kiln_prog_op_set_float (&cx->prog->ops[op], "value", value, err)))
        return rc;
    return 0;
}

int
kiln_lower_shape_resize (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                         kiln_err_t *err)
{
    int x = s_in (node, 0), rc;
    if (x < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs an input");
    const kiln_shape_t *xs = &s_gt (cx, x)->shape;
    kiln_resize_t rp;
    kiln_shape_t y;
    if (kiln_cc_dtype (cx, x) != KILN_DT_FLOAT32)
        return kiln_cc_fail (cx, KILN_EUNSUPPORTED, err, "tensor '%s' is %s; Resize computes "
                             "in float32 only", kiln_cc_tname (cx, x),
                             kiln_dtype_name (s_gt (cx, x)->dtype));
    if ((rc = kiln_resize_params (cx->g, node, xs, &rp, &y, err)))
        return s_prefixed (cx, rc, err);
    if (xs->rank < 1)
        return kiln_cc_fail (cx, KILN_EUNSUPPORTED, err, "resizing a scalar");
    int px = kiln_cc_operand (cx, x, err);
    if (px < 0)
        return px;
    int py = s_result (cx, node, 0, &y, err);
    if (py < 0)
        return py;
    int op = kiln_cc_emit (cx, KILN_K_RESIZE, &px, 1, &py, 1, err);
    if (op < 0)
        return op;
    /* Scales travel as float32 bit patterns (0: output / input), so the
     * runtime maps coordinates with exactly the scale the model gave. */
    int64_t bits[KILN_MAX_RANK];
    for (int i = 0; i < xs->rank; i++) {
        uint32_t b;
        memcpy (&b, &rp.scales[i], 4);
        bits[i] = b;
    }
    if ((rc = s_set_int (cx, op, "mode", rp.mode, err))
        || (rc = s_set_int (cx, op, "coord", rp.coord, err))
        || (rc = s_set_int (cx, op, "nearest", rp.nearest, err))
        || (rc = s_set_ints (cx, op, "scales", bits, xs->rank, err)))
        return rc;
    return 0;
}

/* --- Einsum ----------------------------------------------------------- */

/* Position of label c in s, or -1. */
static int
s_pos (const char *s, char c)
{
    const char *p = strchr (s, c);
    return p && c ? (int) (p - s) : -1;
}

int
kiln_lower_shape_einsum (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                         kiln_err_t *err)
{
    int n = node->n_inputs, rc;
    const kiln_shape_t *shapes[2];
    if ((rc = s_need_f32 (cx, node, err)))
        return rc;
    if (n < 1 || n > 2)
        return kiln_cc_fail (cx, KILN_EUNSUPPORTED, err, "Einsum of %d operands", n);
    for (int i = 0; i < n; i++) {
        if (node->inputs[i] < 0)
            return kiln_cc_fail (cx, KILN_ECOMPILE, err, "input %d is missing", i);
        shapes[i] = &s_gt (cx, node->inputs[i])->shape;
    }
    kiln_einsum_t e;
    kiln_shape_t y;
    if ((rc = kiln_einsum_params (node, shapes, n, &e, &y, err)))
        return s_prefixed (cx, rc, err);
    if ((rc = kiln_cc_expect_shape (cx, node->outputs[0], &y, err)))
        return rc;
    int pa = s_operand (cx, node, 0, err);
    if (pa < 0)
        return pa;
    if (n == 1) {
        /* A transposition: every label is kept. */
        int64_t perm[KILN_MAX_RANK];
        for (int i = 0; i < y.rank; i++)
            perm[i] = s_pos (e.in[0], e.out[i]);
        int py = kiln_cc_result (cx, node->outputs[0], err);
        return py < 0 ? py : s_emit_permute (cx, pa, shapes[0], perm, py, err);
    }
    int pb = s_operand (cx, node, 1, err);
    if (pb < 0)
        return pb;
    /* Labels by role: batch (both operands and the output), free in A or
     * in B (one operand and the output), contracted (both operands only). */
    char batch[KILN_MAX_RANK + 1] = "", fa[KILN_MAX_RANK + 1] = "", fb[KILN_MAX_RANK + 1] = "";
    char con[KILN_MAX_RANK + 1] = "";
    int nb = 0, nfa = 0, nfb = 0, nc = 0;
    for (int i = 0; e.out[i]; i++) {
        char c = e.out[i];
        bool in_a = s_pos (e.in[0], c) >= 0, in_b = s_pos (e.in[1], c) >= 0;
        if (in_a && in_b)
            batch[nb++] = c;
        else if (in_a)
            fa[nfa++] = c;
        else
            fb[nfb++] = c;
    }
    for (int i = 0; e.in[0][i]; i++)
        if (s_pos (e.out, e.in[0][i]) < 0)
            con[nc++] = e.in[0][i];
    batch[nb] = fa[nfa] = fb[nfb] = con[nc] = '\0';
    /* A' = [batch, free A, contracted], B' = [batch, contracted, free B].
     * Each is one operand's labels, so at most KILN_MAX_RANK; the room for
     * three whole label strings is for gcc, which cannot see that (and
     * fails -Werror=format-truncation at -O1, the sanitizer build). */
    char la[3 * KILN_MAX_RANK + 1], lb[3 * KILN_MAX_RANK + 1], lr[3 * KILN_MAX_RANK + 1];
    snprintf (la, sizeof la, "%s%s%s", batch, fa, con);
    snprintf (lb, sizeof lb, "%s%s%s", batch, con, fb);
    snprintf (lr, sizeof lr, "%s%s%s", batch, fa, fb);
    int64_t m = 1, kk = 1, nn = 1, bdims[KILN_MAX_RANK];
    for (int i = 0; i < nb; i++)
        bdims[i] = shapes[0]->dims[s_pos (e.in[0], batch[i])];
    for (int i = 0; i < nfa; i++)
        m *= shapes[0]->dims[s_pos (e.in[0], fa[i])];
    for (int i = 0; i < nc; i++)
        kk *= shapes[0]->dims[s_pos (e.in[0], con[i])];
    for (int i = 0; i < nfb; i++)
        nn *= shapes[1]->dims[s_pos (e.in[1], fb[i])];
    int ops[2] = { pa, pb };
    const char *want[2] = { la, lb };
    for (int o = 0; o < 2; o++) {
        if (strcmp (want[o], e.in[o]) == 0)
            continue;
        int64_t perm[KILN_MAX_RANK];
        kiln_shape_t ts = { .rank = shapes[o]->rank };
        for (int i = 0; i < ts.rank; i++) {
            perm[i] = s_pos (e.in[o], want[o][i]);
            ts.dims[i] = shapes[o]->dims[perm[i]];
        }
        int pt = kiln_cc_temp (cx, KILN_DT_FLOAT32, &ts, err);
        if (pt < 0)
            return pt;
        if ((rc = s_emit_permute (cx, ops[o], shapes[o], perm, pt, err)))
            return rc;
        ops[o] = pt;
    }
    bool direct = strcmp (lr, e.out) == 0;
    kiln_shape_t rs = { .rank = y.rank };
    for (int i = 0; i < rs.rank; i++)
        rs.dims[i] = y.dims[s_pos (e.out, lr[i])];
    int pr = direct ? kiln_cc_result (cx, node->outputs[0], err)
                    : kiln_cc_temp (cx, KILN_DT_FLOAT32, &rs, err);
    if (pr < 0)
        return pr;
    int op = kiln_cc_emit (cx, KILN_K_MATMUL, ops, 2, &pr, 1, err);
    if (op < 0)
        return op;
    if ((rc = s_set_int (cx, op, "m", m, err)) || (rc = s_set_int (cx, op, "k", kk, err))
        || (rc = s_set_int (cx, op, "n", nn, err))
        || (rc = s_set_ints (cx, op, "batch", bdims, nb, err))
        || (rc = s_set_ints (cx, op, "batch_a", bdims, nb, err))
        || (rc = s_set_ints (cx, op, "batch_b", bdims, nb, err)))
        return rc;
    if (direct)
        return 0;
    int64_t perm[KILN_MAX_RANK];
    for (int i = 0; i < y.rank; i++)
        perm[i] = s_pos (lr, e.out[i]);
    int py = kiln_cc_result (cx, node->outputs[0], err);
    return py < 0 ? py : s_emit_permute (cx, pr, &rs, perm, py, err);
}

/* --- windows ---------------------------------------------------------- */

/* Window parameters as the 2-D kernels take them: a 1-D window is a 2-D
 * one of height 1. */
static int
s_set_window (kiln_cc_ctx_t *cx, int op, const kiln_window_t *w, kiln_err_t *err)
{
    int64_t kr[2], s[2], d[2], p[4];
    if (w->n == 1) {
        kr[0] = 1; kr[1] = w->kernel[0];
        s[0] = 1; s[1] = w->strides[0];
        d[0] = 1; d[1] = w->dilations[0];
        p[0] = 0; p[1] = w->pads[0]; p[2] = 0; p[3] = w->pads[1];
    }
    else {
        memcpy (kr, w->kernel, sizeof kr);
        memcpy (s, w->strides, sizeof s);
        memcpy (d, w->dilations, sizeof d);
        memcpy (p, w->pads, sizeof p);
    }
    int rc;
    if ((rc = s_set_ints (cx, op, "kernel", kr, 2, err))
        || (rc = s_set_ints (cx, op, "strides", s, 2, err))
        || (rc = s_set_ints (cx, op, "dilations", d, 2, err))
        || (rc = s_set_ints (cx, op, "pads", p, 4, err)))
        return rc;
    return 0;
}

int
kiln_lower_shape_conv_transpose (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                                 kiln_kernel_t k, kiln_err_t *err)
{
    int x = s_in (node, 0), wt = s_in (node, 1), rc;
    if (x < 0 || wt < 0 || node->n_outputs < 1)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs X, W and an output");
    if ((rc = s_need_f32 (cx, node, err)))
        return rc;
    const kiln_shape_t *xs = &s_gt (cx, x)->shape, *ws = &s_gt (cx, wt)->shape;
    if (xs->rank < 3 || xs->rank > 5)
        return kiln_cc_fail (cx, KILN_EUNSUPPORTED, err, "%d-D transposed convolution (only "
                             "1-D, 2-D and 3-D are supported)", xs->rank - 2);
    kiln_window_t w;
    int64_t opad[KILN_MAX_RANK], group;
    kiln_shape_t y;
    if ((rc = kiln_convtr_params (node, xs, ws, &w, opad, &group, &y, err)))
        return s_prefixed (cx, rc, err);
    if ((rc = kiln_cc_expect_shape (cx, node->outputs[0], &y, err)))
        return rc;
    bool d3 = w.n == 3;
    int64_t per = ws->dims[0];          /* weights per output channel (as W is laid out) */
    for (int i = 0; i < w.n; i++)
        per *= w.kernel[i];
    per = per / group;
    int op = kiln_cc_emit_conv (cx, node, NULL, d3 ? KILN_K_CONV_TRANSPOSE3D
                                : KILN_K_CONV_TRANSPOSE2D, -1, NULL, NULL, y.dims[1], per, err);
    if (op < 0)
        return op;
    if (d3) {
        if ((rc = s_set_ints (cx, op, "kernel", w.kernel, 3, err))
            || (rc = s_set_ints (cx, op, "strides", w.strides, 3, err))
            || (rc = s_set_ints (cx, op, "dilations", w.dilations, 3, err))
            || (rc = s_set_ints (cx, op, "pads", w.pads, 6, err))
            || (rc = s_set_ints (cx, op, "output_padding", opad, 3, err))
            || (rc = s_set_int (cx, op, "group", group, err)))
            return rc;
    } else {
        int64_t op2[2] = { w.n == 1 ? 0 : opad[0], w.n == 1 ? opad[0] : opad[1] };
        if ((rc = s_set_window (cx, op, &w, err))
            || (rc = s_set_ints (cx, op, "output_padding", op2, 2, err))
            || (rc = s_set_int (cx, op, "group", group, err)))
            return rc;
    }
    /* Workspace: one group's columns, [M/group * kernel, H * W]. */
    uint64_t elems = (uint64_t) (ws->dims[1]);
    for (int i = 0; i < w.n; i++)
        elems *= (uint64_t) w.kernel[i] * (uint64_t) xs->dims[2 + i];
    if (elems > (uint64_t) KILN_MAX_TENSOR_ELEMS)
        return kiln_cc_fail (cx, KILN_ELIMIT, err, "col2im workspace of %llu elements is too large",
                             (unsigned long long) elems);
    return kiln_cc_scratch (cx, op, elems ? elems : 1, err);
}

int
kiln_lower_shape_avgpool (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                          kiln_err_t *err)
{
    int x = s_in (node, 0), rc;
    if (x < 0 || node->n_outputs < 1)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs an input and an output");
    if ((rc = s_need_f32 (cx, node, err)))
        return rc;
    /* a Pad of zeros before it, taken as its padding (kiln_cc_fuse) */
    int pad = cx->fusion[cx->node].pad;
    if (pad >= 0)
        x = cx->g->nodes[pad].inputs[0];
    const kiln_shape_t *xs = &s_gt (cx, x)->shape;
    if (xs->rank == 5)
        return kiln_lower_shape_pool3d (cx, node, KILN_K_POOL3D, err);
    if (xs->rank != 3 && xs->rank != 4)
        return kiln_cc_fail (cx, KILN_EUNSUPPORTED, err, "%d-D pooling (only 1-D, 2-D and "
                             "3-D are supported)", xs->rank - 2);
    int px = kiln_cc_operand (cx, x, err);
    if (px < 0)
        return px;
    /* The output shape is the one inference computed with the window. */
    int py = kiln_cc_result (cx, node->outputs[0], err);
    if (py < 0)
        return py;
    return kiln_lower_avgpool_op (cx, cx->node, px, py, err);
}

int
kiln_lower_avgpool_op (kiln_cc_ctx_t *cx, int pool, int px, int py, kiln_err_t *err)
{
    kiln_window_t w;
    int rc = kiln_graph_window (cx->g, pool, &w, err);
    if (rc)
        return rc;
    int64_t include = kiln_node_attr_int (&cx->g->nodes[pool], "count_include_pad", 0);
    const kiln_cc_fusion_t *f = &cx->fusion[pool];
    if (f->pad >= 0) {
        /* the Pad's pads on the spatial axes (the pool's own are 0),
         * counted in every window, as a window over the padded tensor
         * was */
        for (int d = 0; d < w.n; d++) {
            w.pads[d] += f->pad_lo[d];
            w.pads[w.n + d] += f->pad_hi[d];
        }
        include = 1;
    }
    int op = kiln_cc_emit (cx, KILN_K_AVGPOOL2D, &px, 1, &py, 1, err);
    if (op < 0)
        return op;
    if ((rc = s_set_window (cx, op, &w, err))
        || (rc = s_set_int (cx, op, "ceil_mode", w.ceil_mode, err))
        || (rc = s_set_int (cx, op, "count_include_pad", include != 0, err)))
        return rc;
    return 0;
}

int
kiln_lower_shape_global_pool (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                              kiln_err_t *err)
{
    int x = s_in (node, 0), rc;
    if (x < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs an input");
    if ((rc = s_need_f32 (cx, node, err)))
        return rc;
    kiln_shape_t y = s_gt (cx, x)->shape;
    if (y.rank < 3)
        return kiln_cc_fail (cx, KILN_ESHAPE, err, "input must have rank >= 3");
    for (int i = 2; i < y.rank; i++)
        y.dims[i] = 1;
    int px = kiln_cc_operand (cx, x, err);
    if (px < 0)
        return px;
    int py = s_result (cx, node, 0, &y, err);
    if (py < 0)
        return py;
    int op = kiln_cc_emit (cx, k, &px, 1, &py, 1, err);
    return op < 0 ? op : 0;
}

/* --- Trilu, CumSum, GatherElements ------------------------------------ */

int
kiln_lower_shape_trilu (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                        kiln_err_t *err)
{
    int x = s_in (node, 0), rc, n = 0;
    int64_t kv = 0;
    if (x < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs an input");
    if (node->n_inputs > 1 && node->inputs[1] >= 0
        && (rc = kiln_const_ints (cx->g, node, 1, "k", 1, &kv, &n, err)))
        return s_prefixed (cx, rc, err);
    int px = kiln_cc_operand (cx, x, err);
    if (px < 0)
        return px;
    int py = s_result (cx, node, 0, &s_gt (cx, x)->shape, err);
    if (py < 0)
        return py;
    int op = kiln_cc_emit (cx, k, &px, 1, &py, 1, err);
    if (op < 0)
        return op;
    if ((rc = s_set_int (cx, op, "upper", kiln_node_attr_int (node, "upper", 1) != 0, err))
        || (rc = s_set_int (cx, op, "k", kv, err)))
        return rc;
    return 0;
}

int
kiln_lower_shape_cumsum (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                         kiln_err_t *err)
{
    int x = s_in (node, 0), rc, n = 0;
    int64_t axis = 0;
    if (x < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs an input");
    if ((rc = kiln_const_ints (cx->g, node, 1, "axis", 1, &axis, &n, err)))
        return s_prefixed (cx, rc, err);
    const kiln_shape_t *xs = &s_gt (cx, x)->shape;
    if (n != 1 || axis < -xs->rank || axis >= xs->rank)
        return kiln_cc_fail (cx, KILN_ESHAPE, err, "axis is not one of the input's");
    int px = kiln_cc_operand (cx, x, err);
    if (px < 0)
        return px;
    int py = s_result (cx, node, 0, xs, err);
    if (py < 0)
        return py;
    int op = kiln_cc_emit (cx, k, &px, 1, &py, 1, err);
    if (op < 0)
        return op;
    if ((rc = s_set_int (cx, op, "axis", axis < 0 ? axis + xs->rank : axis, err))
        || (rc = s_set_int (cx, op, "exclusive", kiln_node_attr_int (node, "exclusive", 0) != 0,
                            err))
        || (rc = s_set_int (cx, op, "reverse", kiln_node_attr_int (node, "reverse", 0) != 0,
                            err)))
        return rc;
    return 0;
}

int
kiln_lower_shape_gather_elements (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                                  kiln_kernel_t k, kiln_err_t *err)
{
    int x = s_in (node, 0), ind = s_in (node, 1), rc;
    if (x < 0 || ind < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs data and indices");
    int r = s_gt (cx, x)->shape.rank;
    int64_t axis = kiln_node_attr_int (node, "axis", 0);
    if (axis < -r || axis >= r)
        return kiln_cc_fail (cx, KILN_ESHAPE, err, "axis is not one of the data's");
    int ins[2];
    if ((ins[0] = kiln_cc_operand (cx, x, err)) < 0)
        return ins[0];
    if ((ins[1] = kiln_cc_operand (cx, ind, err)) < 0)
        return ins[1];
    int py = s_result (cx, node, 0, &s_gt (cx, ind)->shape, err);
    if (py < 0)
        return py;
    int op = kiln_cc_emit (cx, k, ins, 2, &py, 1, err);
    if (op < 0 || (rc = s_set_int (cx, op, "axis", axis < 0 ? axis + r : axis, err)))
        return op < 0 ? op : rc;
    return 0;
}

int
kiln_lower_shape_eyelike (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                          kiln_err_t *err)
{
    int x = s_in (node, 0), rc;
    if (x < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs an input");
    int px = kiln_cc_operand (cx, x, err);
    if (px < 0)
        return px;
    int py = s_result (cx, node, 0, &s_gt (cx, x)->shape, err);
    if (py < 0)
        return py;
    int op = kiln_cc_emit (cx, k, &px, 1, &py, 1, err);
    if (op < 0 || (rc = s_set_int (cx, op, "k", kiln_node_attr_int (node, "k", 0), err)))
        return op < 0 ? op : rc;
    return 0;
}

/* --- RNN, GRU, LSTM ------------------------------------------------------ */

/* One rnn kernel writes S [T + n_state, D, B, H] (kiln_kernels_rnn.h);
 * Y, Y_h and Y_c are strided copies out of it in the node's layout. */
int
kiln_lower_shape_rnn (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                      kiln_err_t *err)
{
    const kiln_shape_t *ins[KILN_MAX_NODE_IO] = { 0 };
    int n_in = node->n_inputs < KILN_MAX_NODE_IO ? node->n_inputs : KILN_MAX_NODE_IO;
    for (int i = 0; i < n_in; i++)
        if (node->inputs[i] >= 0) {
            ins[i] = &s_gt (cx, node->inputs[i])->shape;
            if (i != 4 && s_gt (cx, node->inputs[i])->dtype != KILN_DT_FLOAT32)
                return kiln_cc_fail (cx, KILN_EUNSUPPORTED, err, "input %d is not float32", i);
        }
    kiln_rnn_t r;
    int rc = kiln_rnn_params (node, ins, n_in, &r, err);
    if (rc)
        return s_prefixed (cx, rc, err);
    int ops[KILN_PROG_MAX_OP_IO], n = 0;
    int64_t has[5] = { 0 };
    for (int i = 0; i < n_in && i < 8; i++) {
        if (node->inputs[i] < 0)
            continue;
        if ((ops[n] = kiln_cc_operand (cx, node->inputs[i], err)) < 0)
            return ops[n];
        n++;
        if (i >= 3)
            has[i - 3] = 1;
    }
    int64_t T = r.t, B = r.b, H = r.h, D = r.d, n_state = r.cell == KILN_RNN_CELL_LSTM ? 2 : 1;
    kiln_shape_t ss = { .rank = 4, .dims = { T + n_state, D, B, H } };
    int ps = kiln_cc_temp (cx, KILN_DT_FLOAT32, &ss, err);
    if (ps < 0)
        return ps;
    int op = kiln_cc_emit (cx, k, ops, n, &ps, 1, err);
    if (op < 0)
        return op;
    int64_t acts[KILN_RNN_MAX_ACTS], ab[2 * KILN_RNN_MAX_ACTS];
    int n_act = (int) (D * r.n_act);
    for (int a = 0; a < n_act; a++) {
        uint32_t bits[2];
        memcpy (&bits[0], &r.aa[a], 4);
        memcpy (&bits[1], &r.ab[a], 4);
        acts[a] = r.act[a];
        ab[2 * a] = bits[0];
        ab[2 * a + 1] = bits[1];
    }
    if ((rc = s_set_int (cx, op, "cell", r.cell, err))
        || (rc = s_set_int (cx, op, "direction", r.direction, err))
        || (rc = s_set_int (cx, op, "layout", r.layout, err))
        || (rc = s_set_ints (cx, op, "has", has, 5, err))
        || (rc = kiln_prog_op_set_float (&cx->prog->ops[op], "clip", r.clip, err))
        || (rc = s_set_int (cx, op, "input_forget", r.input_forget, err))
        || (rc = s_set_int (cx, op, "linear_before_reset", r.lbr, err))
        || (rc = s_set_ints (cx, op, "acts", acts, n_act, err))
        || (rc = s_set_ints (cx, op, "act_params", ab, 2 * n_act, err)))
        return rc;
    /* the runtime's scratch (kiln_kernels_rnn.h): Rᵀ packed, then the rest */
    bool two = r.cell == KILN_RNN_CELL_GRU && !r.lbr;
    int64_t p1, p2;
    if (!kiln_pack_b_elems (H, two ? 2 * H : r.g * H, &p1)
        || !kiln_pack_b_elems (H, two ? H : 0, &p2))
        return kiln_cc_fail (cx, KILN_ELIMIT, err, "R packed is too large");
    if ((rc = kiln_cc_scratch (cx, op, (uint64_t) (p1 + p2 + T * B * r.g * H + B * r.g * H
                                                   + 3 * B * H), err)))
        return rc;
    /* S's strides: t D·B·H, d B·H, b H, j 1 */
    int64_t st_t = D * B * H, st_d = B * H;
    for (int o = 0; o < node->n_outputs && o < 3; o++) {
        const kiln_shape_t *want = o ? &r.yh : &r.y;
        int py = s_result (cx, node, o, want, err);
        if (py < 0)
            return py;
        int64_t off = o ? (T + o - 1) * st_t : 0;
        if (o == 0 && r.layout) {
            int64_t dims[4] = { B, T, D, H }, st[4] = { H, st_t, st_d, 1 };
            rc = s_emit_strided (cx, ps, py, 4, dims, st, off, err);
        }
        else if (o > 0 && r.layout) {
            int64_t dims[3] = { B, D, H }, st[3] = { H, st_d, 1 };
            rc = s_emit_strided (cx, ps, py, 3, dims, st, off, err);
        }
        else {
            int64_t dims[1] = { o ? st_t : T * st_t }, st[1] = { 1 };
            rc = s_emit_strided (cx, ps, py, 1, dims, st, off, err);
        }
        if (rc)
            return rc;
    }
    return 0;
}

/* --- ScatterND, ScatterElements, GatherND, TopK ------------------------- */

/* Emit kernel k reading the node's inputs 0..n-1 and writing its output 0
 * (of shape ys); returns the op. */
static int
s_emit_inputs (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k, int n,
               const kiln_shape_t *ys, kiln_err_t *err)
{
    int ins[KILN_PROG_MAX_OP_IO];
    for (int i = 0; i < n; i++)
        if ((ins[i] = s_operand (cx, node, i, err)) < 0)
            return ins[i];
    int py = s_result (cx, node, 0, ys, err);
    if (py < 0)
        return py;
    return kiln_cc_emit (cx, k, ins, n, &py, 1, err);
}

int
kiln_lower_shape_scatter (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                          kiln_err_t *err)
{
    int x = s_in (node, 0), ind = s_in (node, 1), upd = s_in (node, 2), red, axis, rc;
    if (x < 0 || ind < 0 || upd < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs data, indices and updates");
    const kiln_shape_t *xs = &s_gt (cx, x)->shape;
    if ((rc = kiln_scatter_params (node, k == KILN_K_SCATTER_ND, xs, &s_gt (cx, ind)->shape,
                                   &s_gt (cx, upd)->shape, &red, &axis, err)))
        return s_prefixed (cx, rc, err);
    int op = s_emit_inputs (cx, node, k, 3, xs, err);
    if (op < 0)
        return op;
    if ((rc = s_set_int (cx, op, "reduction", red, err))
        || (k == KILN_K_SCATTER_ELEMENTS && (rc = s_set_int (cx, op, "axis", axis, err))))
        return rc;
    return 0;
}

int
kiln_lower_shape_gather_nd (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                            kiln_err_t *err)
{
    int x = s_in (node, 0), ind = s_in (node, 1), bd, rc;
    if (x < 0 || ind < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs data and indices");
    kiln_shape_t ys;
    if ((rc = kiln_gather_nd_params (node, &s_gt (cx, x)->shape, &s_gt (cx, ind)->shape, &bd,
                                     &ys, err)))
        return s_prefixed (cx, rc, err);
    int op = s_emit_inputs (cx, node, k, 2, &ys, err);
    if (op < 0 || (rc = s_set_int (cx, op, "batch_dims", bd, err)))
        return op < 0 ? op : rc;
    return 0;
}

/* TopK: the topk kernel writes the indices; the values are a
 * gather_elements of X by them. */
int
kiln_lower_shape_topk (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                       kiln_err_t *err)
{
    int x = s_in (node, 0), axis, rc;
    int64_t kv;
    bool largest;
    kiln_shape_t ys;
    if (x < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs X");
    if ((rc = kiln_topk_params (cx->g, node, &s_gt (cx, x)->shape, &axis, &kv, &largest, &ys,
                                err)))
        return s_prefixed (cx, rc, err);
    int px = kiln_cc_operand (cx, x, err);
    if (px < 0)
        return px;
    int pi = node->n_outputs > 1 ? s_result (cx, node, 1, &ys, err)
                                 : kiln_cc_temp (cx, KILN_DT_INT64, &ys, err);
    if (pi < 0)
        return pi;
    int op = kiln_cc_emit (cx, k, &px, 1, &pi, 1, err);
    if (op < 0)
        return op;
    if ((rc = s_set_int (cx, op, "axis", axis, err)) || (rc = s_set_int (cx, op, "k", kv, err))
        || (rc = s_set_int (cx, op, "largest", largest, err)))
        return rc;
    int ins[2] = { px, pi };
    int pv = s_result (cx, node, 0, &ys, err);
    if (pv < 0)
        return pv;
    op = kiln_cc_emit (cx, KILN_K_GATHER_ELEMENTS, ins, 2, &pv, 1, err);
    if (op < 0 || (rc = s_set_int (cx, op, "axis", axis, err)))
        return op < 0 ? op : rc;
    return 0;
}

/* --- 3-D MaxPool and AveragePool ---------------------------------------- */

int
kiln_lower_shape_pool3d (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                         kiln_err_t *err)
{
    int x = s_in (node, 0), rc;
    bool avg = s_op_is (node, "AveragePool");
    if (x < 0 || node->n_outputs < 1)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs an input and an output");
    if (!avg && node->n_outputs > 1)
        return kiln_cc_fail (cx, KILN_EUNSUPPORTED, err, "the Indices output");
    if ((rc = s_need_f32 (cx, node, err)))
        return rc;
    if (!avg && kiln_node_attr_int (node, "storage_order", 0) != 0)
        return kiln_cc_fail (cx, KILN_EUNSUPPORTED, err, "storage_order 1");
    kiln_window_t w;
    if ((rc = kiln_graph_window (cx->g, cx->node, &w, err)))
        return rc;
    if (w.n != 3)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "a %d-D window on a 3-D pool", w.n);
    int px = kiln_cc_operand (cx, x, err);
    if (px < 0)
        return px;
    /* The output shape is the one inference computed with the window. */
    int py = kiln_cc_result (cx, node->outputs[0], err);
    if (py < 0)
        return py;
    int op = kiln_cc_emit (cx, k, &px, 1, &py, 1, err);
    if (op < 0)
        return op;
    if ((rc = s_set_int (cx, op, "mode", avg, err))
        || (rc = s_set_int (cx, op, "count_include_pad",
                            avg && kiln_node_attr_int (node, "count_include_pad", 0) != 0, err))
        || (rc = s_set_ints (cx, op, "kernel", w.kernel, 3, err))
        || (rc = s_set_ints (cx, op, "strides", w.strides, 3, err))
        || (rc = s_set_ints (cx, op, "dilations", w.dilations, 3, err))
        || (rc = s_set_ints (cx, op, "pads", w.pads, 6, err)))
        return rc;
    return 0;
}

/* --- GridSample ------------------------------------------------------------- */

int
kiln_lower_shape_grid_sample (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                              kiln_err_t *err)
{
    int x = s_in (node, 0), g = s_in (node, 1), mode, pad, rc;
    bool align;
    kiln_shape_t ys;
    if (x < 0 || g < 0)
        return kiln_cc_fail (cx, KILN_ECOMPILE, err, "needs X and grid");
    if ((rc = s_need_f32 (cx, node, err)))
        return rc;
    if ((rc = kiln_grid_sample_params (node, &s_gt (cx, x)->shape, &s_gt (cx, g)->shape, &mode,
                                       &pad, &align, &ys, err)))
        return s_prefixed (cx, rc, err);
    int op = s_emit_inputs (cx, node, k, 2, &ys, err);
    if (op < 0)
        return op;
    if ((rc = s_set_int (cx, op, "mode", mode, err))
        || (rc = s_set_int (cx, op, "padding_mode", pad, err))
        || (rc = s_set_int (cx, op, "align_corners", align, err)))
        return rc;
    return 0;
}
