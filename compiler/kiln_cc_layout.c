#include "compiler/kiln_cc_layout.h"

#include <stdlib.h>
#include <string.h>

#include "graph/kiln_shape_ops.h"

/* What a Conv node can do with channels-last tensors. */
typedef struct {
    bool ok;                /* 2-D, float32, constant weights, nothing pooled in */
    bool dw;                /* one channel per group and per output: both ways */
    bool pointwise;         /* 1×1, ungrouped, stride 1, unpadded: X either way */
    bool writes;            /* Y channels-last (dw from channels-last X) */
} s_conv_t;

static bool
s_is (const kiln_node_t *n, const char *op)
{
    return n->op && strcmp (n->op, op) == 0;
}

static bool
s_arith (const kiln_node_t *n)
{
    return s_is (n, "Add") || s_is (n, "Sub") || s_is (n, "Mul") || s_is (n, "Div");
}

static const kiln_tensor_t *
s_gt (const kiln_cc_ctx_t *cx, int t)
{
    return t >= 0 && t < cx->g->n_tensors ? &cx->g->tensors[t] : NULL;
}

/* A float32 tensor of rank 4. */
static bool
s_f32_4d (const kiln_cc_ctx_t *cx, int t)
{
    const kiln_tensor_t *gt = s_gt (cx, t);
    return gt && gt->dtype == KILN_DT_FLOAT32 && gt->shape.rank == 4;
}

/* Every element of attribute `name` (when present) is `v`. */
static bool
s_ints_all (const kiln_node_t *n, const char *name, int64_t v)
{
    const kiln_attr_t *a = kiln_node_attr (n, name);
    if (!a)
        return true;
    if (a->kind != KILN_ATTR_INTS)
        return false;
    for (size_t i = 0; i < a->n; i++)
        if (a->ints[i] != v)
            return false;
    return true;
}

static s_conv_t
s_conv (const kiln_cc_ctx_t *cx, int i)
{
    s_conv_t c = { 0 };
    const kiln_node_t *n = &cx->g->nodes[i];
    const kiln_cc_fusion_t *f = &cx->fusion[i];
    if (n->n_inputs < 2 || n->n_outputs < 1 || f->pool >= 0 || f->pre_bn >= 0
        || !s_f32_4d (cx, n->inputs[0]) || !s_f32_4d (cx, n->inputs[1])
        || !s_f32_4d (cx, n->outputs[0]) || !kiln_cc_const_f32 (cx, n->inputs[1])
        || (n->n_inputs > 2 && n->inputs[2] >= 0 && !kiln_cc_const_f32 (cx, n->inputs[2])))
        return c;
    const kiln_shape_t *sx = &s_gt (cx, n->inputs[0])->shape;
    const kiln_shape_t *sw = &s_gt (cx, n->inputs[1])->shape;
    int64_t group = kiln_node_attr_int (n, "group", 1);
    int64_t ch = sx->dims[1], m = sw->dims[0];
    if (group < 1 || ch % group != 0 || sw->dims[1] * group != ch)
        return c;
    c.ok = true;
    c.dw = sw->dims[1] == 1 && group == ch && m == ch;
    const char *pad = kiln_node_attr_string (n, "auto_pad", "NOTSET");
    bool unpadded = s_ints_all (n, "pads", 0)
                    && (strcmp (pad, "NOTSET") == 0 || strcmp (pad, "VALID") == 0);
    bool k1 = sw->dims[2] == 1 && sw->dims[3] == 1;
    c.pointwise = group == 1 && ch > 1 && k1 && unpadded && s_ints_all (n, "strides", 1);
    /* packed (more than one input channel), and not 3×3 of stride 1,
     * which may run by Winograd */
    bool wino = sw->dims[2] == 3 && sw->dims[3] == 3 && s_ints_all (n, "strides", 1)
                && s_ints_all (n, "dilations", 1);
    c.writes = c.dw || (group == 1 && ch > 1 && !wino);
    return c;
}

/* Whether node i is a Transpose of a 4-D float32 tensor by `want` (0, 2,
 * 3, 1: channels to the end; 0, 3, 1, 2: back) that reads its input as
 * it is (no view of another tensor taken by the fusion pass). */
static bool
s_transpose (const kiln_cc_ctx_t *cx, int i, const int64_t *want)
{
    const kiln_node_t *n = &cx->g->nodes[i];
    int64_t perm[KILN_MAX_RANK];
    kiln_err_t ignored;
    if (!s_is (n, "Transpose") || n->n_inputs != 1 || n->n_outputs != 1
        || cx->fusion[i].src[0] >= 0 || !s_f32_4d (cx, n->inputs[0])
        || !s_f32_4d (cx, n->outputs[0])
        || kiln_transpose_perm (cx->g, n, 4, perm, &ignored))
        return false;
    for (int d = 0; d < 4; d++)
        if (perm[d] != want[d])
            return false;
    return true;
}

static const int64_t s_to_last[4] = { 0, 2, 3, 1 }, s_to_first[4] = { 0, 3, 1, 2 };

/* The tensor node i's op writes: a fused chain's last, else its output. */
static int
s_written (const kiln_cc_ctx_t *cx, int i)
{
    const kiln_node_t *n = &cx->g->nodes[i];
    if ((s_is (n, "Conv") || s_is (n, "Gemm") || s_is (n, "MatMul"))
        && cx->fusion[i].out >= 0)
        return cx->fusion[i].out;
    return n->n_outputs > 0 ? n->outputs[0] : -1;
}

/* One value per channel, or a scalar: its layout is both layouts (the
 * dimensions the permutation moves are 1). */
static bool
s_per_channel (const kiln_cc_ctx_t *cx, int t)
{
    const kiln_tensor_t *gt = s_gt (cx, t);
    if (!gt || gt->dtype != KILN_DT_FLOAT32 || gt->shape.rank < 0 || gt->shape.rank > 4)
        return false;
    int r = gt->shape.rank;
    for (int k = 2; k < 4; k++) {
        int at = k - (4 - r);
        if (at >= 0 && gt->shape.dims[at] != 1)
            return false;
    }
    return true;
}

/* The other operand of arith node n than input slot `slot`. */
static int
s_other_in (const kiln_node_t *n, int slot)
{
    return n->n_inputs == 2 ? n->inputs[1 - slot] : -1;
}

/* Whether node i (not skipped) reads tensor t, in input slot `slot` (-1:
 * as its fused residual), in a way that takes t channels-last. */
static bool
s_reader_takes (const kiln_cc_ctx_t *cx, const uint8_t *cl, int i, int slot)
{
    const kiln_node_t *n = &cx->g->nodes[i];
    int y = s_written (cx, i);
    if (s_is (n, "Conv")) {
        s_conv_t c = s_conv (cx, i);
        if (!c.ok)
            return false;
        if (slot < 0)
            return y >= 0 && cl[y];
        if (slot != 0)
            return false;
        return c.pointwise || (c.dw && y >= 0 && cl[y]);
    }
    if (s_is (n, "GlobalAveragePool"))
        return slot == 0;
    /* [N, C, H, W] to [N, H, W, C] (convnext's blocks around their
     * LayerNorm and Linear layers): channels-last, X's bytes are Y's */
    if (s_transpose (cx, i, s_to_last))
        return slot == 0;
    if (s_arith (n) && slot >= 0) {
        int o = s_other_in (n, slot);
        return y >= 0 && cl[y] && o >= 0 && (cl[o] || s_per_channel (cx, o));
    }
    return false;
}

/* Whether t's writer can write it channels-last given the others. */
static bool
s_writer_can (const kiln_cc_ctx_t *cx, const uint8_t *cl, int i)
{
    const kiln_node_t *n = &cx->g->nodes[i];
    if (s_is (n, "Conv")) {
        s_conv_t c = s_conv (cx, i);
        int r = cx->fusion[i].residual;
        if (!c.ok || !c.writes || (c.dw && !cl[n->inputs[0]]) || (r >= 0 && !cl[r]))
            return false;
        return true;
    }
    if (s_arith (n) && n->n_inputs == 2) {
        int a = n->inputs[0], b = n->inputs[1];
        if (a < 0 || b < 0 || (!cl[a] && !cl[b]))
            return false;
        return (cl[a] || s_per_channel (cx, a)) && (cl[b] || s_per_channel (cx, b));
    }
    /* and back: Y channels-last is X's bytes */
    return s_transpose (cx, i, s_to_first);
}

static int
s_find (int *up, int t)
{
    while (up[t] != t)
        t = up[t] = up[up[t]];
    return t;
}

static void
s_union (int *up, int a, int b)
{
    a = s_find (up, a);
    b = s_find (up, b);
    if (a != b)
        up[a] = b;
}

int
kiln_cc_layout (kiln_cc_ctx_t *cx, kiln_err_t *err)
{
    const kiln_graph_t *g = cx->g;
    int nt = g->n_tensors;
    memset (cx->cl, 0, (size_t) nt + 1);
    if (cx->opts.optlevel < 2 || nt == 0)
        return 0;
    int *writer = malloc ((size_t) nt * sizeof *writer);
    int *skipped = calloc ((size_t) nt, sizeof *skipped);
    int *resid = calloc ((size_t) nt, sizeof *resid);
    int *up = malloc ((size_t) nt * sizeof *up);
    uint8_t *keep = calloc ((size_t) nt, 1);
    int *first = calloc ((size_t) nt + 1, sizeof *first);
    int *fill = calloc ((size_t) nt, sizeof *fill);
    int *rnode = NULL, *rslot = NULL;
    int rc = 0;
    if (!writer || !skipped || !resid || !up || !keep || !first || !fill) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory choosing layouts");
        goto done;
    }
    for (int t = 0; t < nt; t++)
        writer[t] = -1;
    /* readers of each tensor (ops that run: not skipped), slot -1 for a
     * fused residual: rnode / rslot [first[t], first[t + 1]) */
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < g->n_nodes; i++) {
            const kiln_node_t *n = &g->nodes[i];
            if (cx->skip[i])
                continue;
            for (int k = -1; k < n->n_inputs; k++) {
                int t = k < 0 ? (s_is (n, "Conv") ? cx->fusion[i].residual : -1)
                              : n->inputs[k];
                /* a Conv with a prologue reads its BatchNormalization's
                 * input as X (kiln_cc_fuse.h) */
                if (k == 0 && s_is (n, "Conv") && cx->fusion[i].pre_bn >= 0)
                    t = g->nodes[cx->fusion[i].pre_bn].inputs[0];
                if (t < 0 || t >= nt)
                    continue;
                if (pass == 0) {
                    first[t + 1]++;
                    continue;
                }
                rnode[first[t] + fill[t]] = i;
                rslot[first[t] + fill[t]++] = k;
            }
        }
        if (pass == 0) {
            for (int t = 0; t < nt; t++)
                first[t + 1] += first[t];
            rnode = malloc ((size_t) first[nt] * sizeof *rnode + 1);
            rslot = malloc ((size_t) first[nt] * sizeof *rslot + 1);
            if (!rnode || !rslot) {
                rc = kiln_error (err, KILN_ENOMEM, "out of memory choosing layouts");
                goto done;
            }
        }
    }
    for (int i = 0; i < g->n_nodes; i++) {
        const kiln_node_t *n = &g->nodes[i];
        if (cx->skip[i]) {
            for (int k = 0; k < n->n_inputs; k++)
                if (n->inputs[k] >= 0 && n->inputs[k] < nt)
                    skipped[n->inputs[k]]++;
            continue;
        }
        int y = s_written (cx, i);
        if (y >= 0 && y < nt)
            writer[y] = i;
        if (s_is (n, "Conv") && cx->fusion[i].residual >= 0)
            resid[cx->fusion[i].residual]++;
    }
    /* Candidates: float32 4-D tensors a Conv or an arith op writes, that
     * no skipped node reads but as a fused residual. */
    for (int t = 0; t < nt; t++) {
        int w = writer[t];
        cx->cl[t] = w >= 0 && s_f32_4d (cx, t) && skipped[t] <= resid[t]
                    && (s_is (&g->nodes[w], "Conv") || s_arith (&g->nodes[w])
                        || s_transpose (cx, w, s_to_first));
    }
    for (int k = 0; k < g->n_outputs; k++)
        if (g->outputs[k] >= 0 && g->outputs[k] < nt)
            cx->cl[g->outputs[k]] = 0;
    /* Drop every candidate an op cannot take or write, until none is:
     * each round only clears flags, so at most nt + 1 rounds. */
    for (bool changed = true; changed;) {
        changed = false;
        for (int t = 0; t < nt; t++) {
            if (!cx->cl[t])
                continue;
            bool ok = s_writer_can (cx, cx->cl, writer[t]);
            for (int r = first[t]; ok && r < first[t + 1]; r++)
                ok = s_reader_takes (cx, cx->cl, rnode[r], rslot[r]);
            if (!ok) {
                cx->cl[t] = 0;
                changed = true;
            }
        }
    }
    /* The groups of tensors the ops tie together; keep those with a
     * depthwise convolution in them, or a tensor a Transpose to
     * [N, H, W, C] reads (a copy saved: a patchify stem's output). */
    for (int t = 0; t < nt; t++)
        up[t] = t;
    for (int i = 0; i < g->n_nodes; i++) {
        const kiln_node_t *n = &g->nodes[i];
        int y = s_written (cx, i);
        if (cx->skip[i] || y < 0 || !cx->cl[y])
            continue;
        for (int k = 0; k < n->n_inputs; k++)
            if (n->inputs[k] >= 0 && cx->cl[n->inputs[k]])
                s_union (up, n->inputs[k], y);
        if (s_is (n, "Conv") && cx->fusion[i].residual >= 0)
            s_union (up, cx->fusion[i].residual, y);
    }
    for (int i = 0; i < g->n_nodes; i++) {
        int y = s_written (cx, i);
        if (!cx->skip[i] && s_is (&g->nodes[i], "Conv") && y >= 0 && cx->cl[y]
            && s_conv (cx, i).dw)
            keep[s_find (up, y)] = 1;
    }
    for (int t = 0; t < nt; t++)
        for (int r = first[t]; cx->cl[t] && r < first[t + 1]; r++)
            if (s_transpose (cx, rnode[r], s_to_last))
                keep[s_find (up, t)] = 1;
    for (int t = 0; t < nt; t++)
        if (cx->cl[t] && !keep[s_find (up, t)])
            cx->cl[t] = 0;
done:
    free (writer);
    free (skipped);
    free (resid);
    free (up);
    free (keep);
    free (first);
    free (fill);
    free (rnode);
    free (rslot);
    return rc;
}
