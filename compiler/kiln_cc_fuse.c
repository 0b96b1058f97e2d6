#include "compiler/kiln_cc_fuse.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "graph/kiln_infer_math.h"
#include "graph/kiln_shape_ops.h"

typedef struct {
    int *uses;              /* per tensor: reads by live nodes */
    int *consumer;          /* per tensor: a live node reading it */
    uint8_t *is_output;     /* per tensor: a graph output */
} s_uses_t;

static bool
s_is (const kiln_node_t *n, const char *op)
{
    return n->op && strcmp (n->op, op) == 0;
}

static const kiln_tensor_t *
s_gt (const kiln_cc_ctx_t *cx, int t)
{
    return &cx->g->tensors[t];
}

static bool
s_f32 (const kiln_cc_ctx_t *cx, int t)
{
    return t >= 0 && s_gt (cx, t)->dtype == KILN_DT_FLOAT32
           && s_gt (cx, t)->shape.rank >= 0;
}

static int64_t
s_numel (const kiln_shape_t *s)
{
    int64_t n = 1;
    for (int i = 0; i < s->rank; i++)
        n *= s->dims[i];
    return n;
}

/* The node that alone reads `t`, when it is live and not yet taken. */
static int
s_sole_reader (const kiln_cc_ctx_t *cx, const s_uses_t *u, int t)
{
    if (t < 0 || u->uses[t] != 1 || u->is_output[t])
        return -1;
    int n = u->consumer[t];
    return n >= 0 && !cx->skip[n] ? n : -1;
}

/* Only the first output of `n` is used (BatchNormalization may declare
 * training outputs). */
static bool
s_only_first_output (const kiln_cc_ctx_t *cx, const s_uses_t *u,
                     const kiln_node_t *n)
{
    for (int i = 1; i < n->n_outputs; i++) {
        int t = n->outputs[i];
        if (t >= 0 && (u->uses[t] > 0 || u->is_output[t]))
            return false;
    }
    return n->n_outputs >= 1 && n->outputs[0] >= 0;
}

/* A BatchNormalization reading `cur`, foldable into conv node `p`. */
static int
s_bn (const kiln_cc_ctx_t *cx, const s_uses_t *u, const kiln_node_t *p, int cur)
{
    int b = s_sole_reader (cx, u, cur);
    if (b < 0)
        return -1;
    const kiln_node_t *bn = &cx->g->nodes[b];
    if (!s_is (bn, "BatchNormalization") || bn->n_inputs != 5
        || bn->inputs[0] != cur || !s_only_first_output (cx, u, bn)
        || kiln_node_attr_int (bn, "training_mode", 0) != 0
        || !s_f32 (cx, bn->outputs[0]))
        return -1;
    /* The weights and bias must be constants to fold into. */
    if (!kiln_cc_const_f32 (cx, p->inputs[1])
        || (p->n_inputs > 2 && p->inputs[2] >= 0
            && !kiln_cc_const_f32 (cx, p->inputs[2])))
        return -1;
    const kiln_shape_t *sy = &s_gt (cx, cur)->shape;
    if (sy->rank < 2)
        return -1;
    /* A Gemm's C must be one value per column (or one value): the fold
     * gives a bias per column. */
    if (s_is (p, "Gemm")) {
        if (sy->rank != 2 || !s_f32 (cx, p->inputs[0]) || !s_f32 (cx, p->inputs[1]))
            return -1;
        if (p->n_inputs > 2 && p->inputs[2] >= 0) {
            const kiln_shape_t *sc = &s_gt (cx, p->inputs[2])->shape;
            int64_t nc = s_numel (sc);
            if (nc != 1 && (nc != sy->dims[1] || sc->dims[sc->rank - 1] != nc))
                return -1;
        }
    }
    for (int i = 1; i < 5; i++) {
        int t = bn->inputs[i];
        if (t < 0 || !s_f32 (cx, t) || !kiln_cc_const_f32 (cx, t)
            || s_numel (&s_gt (cx, t)->shape) != sy->dims[1])
            return -1;
    }
    return b;
}

/* Add(cur, other) or Add(other, cur) reading `cur`: its index, with the
 * other operand in *other. */
static int
s_add (const kiln_cc_ctx_t *cx, const s_uses_t *u, int cur, int *other)
{
    int a = s_sole_reader (cx, u, cur);
    if (a < 0)
        return -1;
    const kiln_node_t *n = &cx->g->nodes[a];
    if (!s_is (n, "Add") || n->n_inputs != 2 || n->n_outputs != 1
        || !s_f32 (cx, n->inputs[0]) || !s_f32 (cx, n->inputs[1])
        || !s_f32 (cx, n->outputs[0]) || n->inputs[0] == n->inputs[1])
        return -1;
    /* The sum must have the product's shape: no broadcast of `cur`. */
    if (!kiln_shape_equal (&s_gt (cx, n->outputs[0])->shape,
                           &s_gt (cx, cur)->shape))
        return -1;
    *other = n->inputs[0] == cur ? n->inputs[1] : n->inputs[0];
    return a;
}

/* A constant that broadcasts as one value per column: [.., 1, n]. */
static bool
s_is_col_bias (const kiln_cc_ctx_t *cx, int t, const kiln_shape_t *y)
{
    if (!kiln_cc_const_f32 (cx, t) || y->rank < 1)
        return false;
    const kiln_shape_t *s = &s_gt (cx, t)->shape;
    int64_t n = y->dims[y->rank - 1];
    if (s->rank < 1 || s->rank > y->rank || s->dims[s->rank - 1] != n)
        return false;
    for (int i = 0; i < s->rank - 1; i++)
        if (s->dims[i] != 1)
            return false;
    return true;
}

static bool s_scalar (const kiln_cc_ctx_t *cx, int t, double *v);
static const kiln_node_t *s_next (const kiln_cc_ctx_t *cx, const s_uses_t *u,
                                  int t, const char *op, int *idx);
static int s_other (const kiln_node_t *n, int t);

/* The two live nodes after `from` that read `t` (read twice, not a graph
 * output): their indices in r[0], r[1], in graph order. */
static bool
s_two_readers (const kiln_cc_ctx_t *cx, const s_uses_t *u, int from, int t, int r[2])
{
    if (t < 0 || u->uses[t] != 2 || u->is_output[t])
        return false;
    int k = 0;
    for (int n = from + 1; n < cx->g->n_nodes && k < 2; n++) {
        const kiln_node_t *c = &cx->g->nodes[n];
        if (cx->skip[n])
            continue;
        for (int j = 0; j < c->n_inputs; j++)
            if (c->inputs[j] == t) {
                r[k++] = n;
                break;
            }
    }
    return k == 2;
}

/* A Mul of `a` and `b` (either order), of the shape of `a`. */
static bool
s_mul_of (const kiln_cc_ctx_t *cx, const kiln_node_t *m, int a, int b)
{
    return s_is (m, "Mul") && m->n_inputs == 2 && m->n_outputs == 1
           && ((m->inputs[0] == a && m->inputs[1] == b)
               || (m->inputs[0] == b && m->inputs[1] == a))
           && s_f32 (cx, m->outputs[0])
           && kiln_shape_equal (&s_gt (cx, m->outputs[0])->shape, &s_gt (cx, a)->shape);
}

/* SiLU (x · Sigmoid(x)) or the erf GELU as torch exports it
 * ((x · (Erf(x / √2) + 1)) · 0.5) after `cur`, which both read: the
 * last node's index, the others marked to skip. */
static int
s_act_pair (kiln_cc_ctx_t *cx, const s_uses_t *u, int cur, kiln_cc_fusion_t *f)
{
    int r[2], from = cx->g->n_nodes;
    for (int n = 0; n < cx->g->n_nodes; n++)
        for (int o = 0; o < cx->g->nodes[n].n_outputs; o++)
            if (cx->g->nodes[n].outputs[o] == cur)
                from = n;
    if (from == cx->g->n_nodes || !s_two_readers (cx, u, from, cur, r))
        return -1;
    const kiln_node_t *first = &cx->g->nodes[r[0]], *second = &cx->g->nodes[r[1]];
    if (first->n_inputs < 1 || first->inputs[0] != cur || first->n_outputs != 1
        || !s_f32 (cx, first->outputs[0]))
        return -1;
    if (s_is (first, "Sigmoid")) {
        if (s_sole_reader (cx, u, first->outputs[0]) != r[1]
            || !s_mul_of (cx, second, cur, first->outputs[0]))
            return -1;
        cx->skip[r[0]] = 1;
        f->act = KILN_ACT_SILU;
        return r[1];
    }
    double v;
    int idx[3];
    if (!s_is (first, "Div") || first->n_inputs != 2 || !s_scalar (cx, first->inputs[1], &v)
        || (float) v != 1.41421353816986083984375f)
        return -1;
    const kiln_node_t *erf = s_next (cx, u, first->outputs[0], "Erf", &idx[0]);
    const kiln_node_t *add = erf ? s_next (cx, u, erf->outputs[0], "Add", &idx[1]) : NULL;
    if (!add || !s_scalar (cx, s_other (add, erf->outputs[0]), &v) || v != 1.0
        || s_sole_reader (cx, u, add->outputs[0]) != r[1]
        || !s_mul_of (cx, second, cur, add->outputs[0]))
        return -1;
    const kiln_node_t *half = s_next (cx, u, second->outputs[0], "Mul", &idx[2]);
    if (!half || !s_scalar (cx, s_other (half, second->outputs[0]), &v) || v != 0.5
        || !kiln_shape_equal (&s_gt (cx, half->outputs[0])->shape, &s_gt (cx, cur)->shape))
        return -1;
    cx->skip[r[0]] = cx->skip[idx[0]] = cx->skip[idx[1]] = cx->skip[r[1]] = 1;
    f->act = KILN_ACT_GELU;
    return idx[2];
}

/* An activation node reading `cur`; fills the fusion's act fields. */
static int
s_act (kiln_cc_ctx_t *cx, const s_uses_t *u, int cur, kiln_cc_fusion_t *f)
{
    int a = s_sole_reader (cx, u, cur);
    if (a < 0)
        return s_act_pair (cx, u, cur, f);
    const kiln_node_t *n = &cx->g->nodes[a];
    if (n->n_outputs != 1 || n->n_inputs < 1 || n->inputs[0] != cur
        || !s_f32 (cx, n->outputs[0]))
        return -1;
    if (s_is (n, "Relu")) {
        f->act = KILN_ACT_RELU;
        return a;
    }
    if (s_is (n, "Sigmoid") || s_is (n, "Tanh") || s_is (n, "HardSwish")) {
        f->act = s_is (n, "Sigmoid") ? KILN_ACT_SIGMOID
                 : s_is (n, "Tanh") ? KILN_ACT_TANH : KILN_ACT_HARD_SWISH;
        return a;
    }
    if (s_is (n, "HardSigmoid")) {
        f->act = KILN_ACT_HARD_SIGMOID;
        f->act_a = kiln_node_attr_float (n, "alpha", 0.2);
        f->act_b = kiln_node_attr_float (n, "beta", 0.5);
        return a;
    }
    if (s_is (n, "LeakyRelu")) {
        f->act = KILN_ACT_LEAKY;
        f->act_a = kiln_node_attr_float (n, "alpha", 0.01);
        return a;
    }
    if (!s_is (n, "Clip"))
        return -1;
    bool has_min, has_max;
    double lo, hi;
    int lo_in, hi_in;
    kiln_err_t ignored;
    if (kiln_math_clip_bounds (cx->g, n, &has_min, &lo, &has_max, &hi, &lo_in,
                               &hi_in, &ignored))
        return -1;
    bool old = cx->g->opset < 11;
    if (!has_min)
        lo = old ? -FLT_MAX : -INFINITY;
    if (!has_max)
        hi = old ? FLT_MAX : INFINITY;
    int ins[2] = { lo_in, hi_in };
    double *vals[2] = { &lo, &hi };
    for (int i = 0; i < 2; i++) {
        if (ins[i] < 0)
            continue;
        const float *v = kiln_cc_const_f32 (cx, ins[i]);
        if (!v || s_numel (&s_gt (cx, ins[i])->shape) != 1)
            return -1;
        *vals[i] = v[0];
    }
    if (lo != lo || hi != hi)
        return -1;
    f->act = KILN_ACT_CLIP;
    f->act_a = lo;
    f->act_b = hi;
    return a;
}

/* A Transpose that only moves axes of size 1: the elements keep their
 * order (kiln_lower_shape makes it an alias). */
static bool
s_unit_transpose (const kiln_cc_ctx_t *cx, const kiln_node_t *n)
{
    const kiln_shape_t *xs = &s_gt (cx, n->inputs[0])->shape;
    int64_t perm[KILN_MAX_RANK];
    kiln_err_t ignored;
    if (xs->rank < 1 || kiln_transpose_perm (cx->g, n, xs->rank, perm, &ignored))
        return false;
    int64_t last = -1;
    for (int i = 0; i < xs->rank; i++) {
        if (xs->dims[perm[i]] == 1)
            continue;
        if (perm[i] < last)
            return false;
        last = perm[i];
    }
    return true;
}

/* A view (same elements in the same order) reading `cur` alone. */
static int
s_view (const kiln_cc_ctx_t *cx, const s_uses_t *u, int cur)
{
    int v = s_sole_reader (cx, u, cur);
    if (v < 0)
        return -1;
    const kiln_node_t *n = &cx->g->nodes[v];
    if (!(s_is (n, "Reshape") || s_is (n, "Flatten") || s_is (n, "Squeeze")
          || s_is (n, "Unsqueeze") || s_is (n, "Identity")
          || (s_is (n, "Transpose") && s_unit_transpose (cx, n)))
        || n->n_outputs != 1 || n->inputs[0] != cur || !s_f32 (cx, n->outputs[0])
        || s_numel (&s_gt (cx, n->outputs[0])->shape)
               != s_numel (&s_gt (cx, cur)->shape))
        return -1;
    for (int k = 1; k < n->n_inputs; k++)
        if (n->inputs[k] == cur)
            return -1;
    return v;
}

/* Take the views after `cur` when `then` accepts what follows them. */
static int
s_through_views (kiln_cc_ctx_t *cx, const s_uses_t *u, int cur, int *views,
                 int *n_views)
{
    int v;
    *n_views = 0;
    while (*n_views < 4 && (v = s_view (cx, u, cur)) >= 0) {
        views[(*n_views)++] = v;
        cur = cx->g->nodes[v].outputs[0];
    }
    return cur;
}

/* A strided view of a tensor: element (i0, i1, ...) at
 * off + sum of i_k·st[k]. */
typedef struct {
    int64_t off;
    kiln_shape_t shape;
    int64_t st[KILN_MAX_RANK];
} s_view_t;

/* The view `v` reshaped to `to` without moving an element, as numpy
 * does it: the old and the new axes are grouped by equal products, and
 * each old group must be one run of memory (stride of an axis = the next
 * one's stride times its size).  False when it is not. */
static bool
s_view_reshape (s_view_t *v, const kiln_shape_t *to)
{
    int64_t od[KILN_MAX_RANK], os[KILN_MAX_RANK], ns[KILN_MAX_RANK];
    int orank = 0;
    for (int d = 0; d < v->shape.rank; d++) {
        if (v->shape.dims[d] == 0)
            return false;
        if (v->shape.dims[d] != 1) {
            od[orank] = v->shape.dims[d];
            os[orank++] = v->st[d];
        }
    }
    const int64_t *nd = to->dims;
    int nrank = to->rank, oi = 0, oj = 1, ni = 0, nj = 1;
    for (int d = 0; d < nrank; d++)
        if (nd[d] <= 0)
            return false;
    while (ni < nrank && oi < orank) {
        int64_t np = nd[ni], op = od[oi];
        while (np != op) {
            if (np < op) {
                if (nj >= nrank)
                    return false;
                np *= nd[nj++];
            } else {
                if (oj >= orank)
                    return false;
                op *= od[oj++];
            }
        }
        for (int k = oi; k < oj - 1; k++)
            if (os[k] != od[k + 1] * os[k + 1])
                return false;
        ns[nj - 1] = os[oj - 1];
        for (int k = nj - 1; k > ni; k--)
            ns[k - 1] = ns[k] * nd[k];
        ni = nj++;
        oi = oj++;
    }
    if (oi < orank)
        return false;
    for (; ni < nrank; ni++) {
        if (nd[ni] != 1)
            return false;
        ns[ni] = 1;
    }
    v->shape = *to;
    memcpy (v->st, ns, (size_t) nrank * sizeof *ns);
    return true;
}

/* `v` (the view of node q's input) through q to its output `y`, a
 * view-like node or a scale: false when q is neither or its result is
 * not a strided view. */
static bool
s_view_step (const kiln_cc_ctx_t *cx, const kiln_node_t *q, int y, s_view_t *v)
{
    const kiln_shape_t *ys = &s_gt (cx, y)->shape;
    kiln_err_t ignored;
    if (s_is (q, "Mul") || s_is (q, "Div"))
        return true;
    if (s_is (q, "Split")) {
        /* output k: the run of sizes[k] along the axis after the others */
        int64_t sizes[KILN_MAX_NODE_IO];
        int axis;
        if (q->n_outputs > KILN_MAX_NODE_IO
            || kiln_split_sizes (cx->g, q, &v->shape, &axis, sizes, &ignored))
            return false;
        int64_t at = 0;
        for (int k = 0; k < q->n_outputs; k++) {
            if (q->outputs[k] == y) {
                v->off += at * v->st[axis];
                v->shape.dims[axis] = sizes[k];
                return kiln_shape_equal (&v->shape, ys);
            }
            at += sizes[k];
        }
        return false;
    }
    if (s_is (q, "Transpose")) {
        int64_t perm[KILN_MAX_RANK], st[KILN_MAX_RANK];
        if (kiln_transpose_perm (cx->g, q, v->shape.rank, perm, &ignored))
            return false;
        kiln_shape_t sh = v->shape;
        for (int d = 0; d < sh.rank; d++) {
            v->shape.dims[d] = sh.dims[perm[d]];
            st[d] = v->st[perm[d]];
        }
        memcpy (v->st, st, sizeof st);
        return true;
    }
    if (s_is (q, "Slice")) {
        int64_t start[KILN_MAX_RANK], step[KILN_MAX_RANK];
        kiln_shape_t out;
        if (kiln_slice_params (cx->g, q, &v->shape, start, step, &out, &ignored))
            return false;
        for (int d = 0; d < v->shape.rank; d++) {
            if (step[d] <= 0)
                return false;
            v->off += start[d] * v->st[d];
            v->st[d] *= step[d];
        }
        v->shape = out;
        return kiln_shape_equal (&out, ys);
    }
    if (s_is (q, "Reshape") || s_is (q, "Flatten") || s_is (q, "Squeeze")
        || s_is (q, "Unsqueeze") || s_is (q, "Identity"))
        return s_view_reshape (v, ys);
    return false;
}

/* Node q, which alone reads `t` (its first input), as one more step back
 * from a MatMul operand: a view-like node, or a Mul / Div by a constant
 * scalar (its factor into *scale). */
static bool
s_operand_step (const kiln_cc_ctx_t *cx, const kiln_node_t *q, int *x, double *scale)
{
    if ((q->n_outputs != 1 && !s_is (q, "Split")) || q->n_inputs < 1
        || !s_f32 (cx, q->outputs[0]))
        return false;
    *x = q->inputs[0];
    *scale = 1.0;
    if (s_is (q, "Mul") || s_is (q, "Div")) {
        double c;
        if (q->n_inputs != 2)
            return false;
        if (s_is (q, "Mul") && s_scalar (cx, q->inputs[0], &c))
            *x = q->inputs[1];
        else if (!s_scalar (cx, q->inputs[1], &c))
            return false;
        *scale = s_is (q, "Div") ? 1.0 / c : c;
        return isfinite (*scale) && s_f32 (cx, *x)
               && kiln_shape_equal (&s_gt (cx, *x)->shape,
                                    &s_gt (cx, q->outputs[0])->shape);
    }
    if (!(s_is (q, "Transpose") || s_is (q, "Slice") || s_is (q, "Reshape")
          || s_is (q, "Flatten") || s_is (q, "Squeeze") || s_is (q, "Unsqueeze")
          || s_is (q, "Identity") || s_is (q, "Split")))
        return false;
    /* the other inputs (shape, starts, ends...) must not be `x` */
    for (int k = 1; k < q->n_inputs; k++)
        if (q->inputs[k] == *x)
            return false;
    return s_f32 (cx, *x) && s_gt (cx, *x)->shape.rank <= KILN_MAX_RANK;
}

/* The chain of nodes that made tensor `t`, which node `reader` reads,
 * from `reader` back (each read by the next alone): views (Transpose,
 * Slice with positive steps, reshapes) and, when `scales`, Mul / Div by
 * a constant scalar.  The longest such chain whose result is a strided
 * view of the chain's input (with a contiguous last axis when
 * `last_unit`), and that saves a copy or a scale, is taken (its nodes
 * skipped): the view in *v, the tensor it reads in *root, the product
 * of the scales in *alpha.  False when none is. */
static bool
s_take_view (kiln_cc_ctx_t *cx, const s_uses_t *u, int reader, int t, bool scales,
             bool last_unit, s_view_t *out, int *root_out, double *alpha_out)
{
    int chain[8], n_chain = 0, root[8], outs[8];
    double scale[8];
    const kiln_shape_t *ts = &s_gt (cx, t)->shape;
    while (n_chain < 8) {
        int n = cx->producer[t], x;
        if (n < 0 || cx->skip[n] || u->uses[t] != 1 || u->is_output[t]
            || u->consumer[t] != reader
            || !s_operand_step (cx, &cx->g->nodes[n], &x, &scale[n_chain])
            || (!scales && (s_is (&cx->g->nodes[n], "Mul")
                            || s_is (&cx->g->nodes[n], "Div"))))
            break;
        root[n_chain] = x;
        outs[n_chain] = t;
        chain[n_chain++] = n;
        /* not past a Split: it runs on for its other outputs, and reads
         * what is before it */
        if (s_is (&cx->g->nodes[n], "Split"))
            break;
        reader = n;
        t = x;
    }
    for (int s = n_chain - 1; s >= 0; s--) {
        s_view_t v = { .off = 0, .shape = s_gt (cx, root[s])->shape };
        int64_t c = 1;
        for (int d = v.shape.rank - 1; d >= 0; d--) {
            v.st[d] = c;
            c *= v.shape.dims[d];
        }
        bool ok = true, saves = false;
        double alpha = 1.0;
        for (int j = s; j >= 0 && ok; j--) {
            const kiln_node_t *q = &cx->g->nodes[chain[j]];
            ok = s_view_step (cx, q, outs[j], &v);
            alpha *= scale[j];
            saves = saves || scale[j] != 1.0 || s_is (q, "Slice") || s_is (q, "Split")
                    || (s_is (q, "Transpose") && !s_unit_transpose (cx, q));
        }
        if (!ok || !saves || !kiln_shape_equal (&v.shape, ts)
            || (last_unit && v.st[ts->rank - 1] != 1 && ts->dims[ts->rank - 1] != 1))
            continue;
        /* (a Split runs on for its other outputs: this one it does not
         * write) */
        for (int j = 0; j <= s; j++) {
            if (s_is (&cx->g->nodes[chain[j]], "Split"))
                cx->viewed[outs[j]] = 1;
            else
                cx->skip[chain[j]] = 1;
        }
        *out = v;
        *root_out = root[s];
        *alpha_out = alpha;
        return true;
    }
    return false;
}

/* Operand `w` (0: A, 1: B) of MatMul `i` read through strides
 * (s_take_view) when its last axis is contiguous, so that OpenBLAS
 * still reads it without a copy, and scaled by alpha.  In attention:
 * Q's and V's slices of the QKV product and their head splits, and the
 * 1/sqrt(d) on Q.  K's transpose is left to a copy: OpenBLAS multiplies
 * by a transposed B at 80 GFLOP/s instead of 108. */
static void
s_plan_operand (kiln_cc_ctx_t *cx, const s_uses_t *u, int i, int w, bool scales,
                bool last_unit)
{
    const kiln_node_t *p = &cx->g->nodes[i];
    kiln_cc_fusion_t *f = &cx->fusion[i];
    int t = p->inputs[w], root;
    s_view_t v;
    double alpha;
    if (!s_f32 (cx, t) || s_gt (cx, t)->shape.rank < 2 || p->inputs[1 - w] == t
        || !s_take_view (cx, u, i, t, scales, last_unit, &v, &root, &alpha))
        return;
    f->alpha *= alpha;
    f->src[w] = root;
    f->src_off[w] = v.off;
    memcpy (f->src_st[w], v.st, sizeof v.st);
}

/* A Transpose (a strided copy) whose input is itself a slice or a
 * transpose of another tensor copies from that tensor directly: K's
 * slice of the QKV product before its transpose. */
static void
s_plan_transpose (kiln_cc_ctx_t *cx, const s_uses_t *u, int i)
{
    const kiln_node_t *p = &cx->g->nodes[i];
    kiln_cc_fusion_t *f = &cx->fusion[i];
    int t = p->n_inputs == 1 ? p->inputs[0] : -1, root;
    s_view_t v;
    double alpha;
    if (!s_is (p, "Transpose") || p->n_outputs != 1 || !s_f32 (cx, t)
        || s_unit_transpose (cx, p)
        || !s_take_view (cx, u, i, t, false, false, &v, &root, &alpha))
        return;
    f->src[0] = root;
    f->src_off[0] = v.off;
    memcpy (f->src_st[0], v.st, sizeof v.st);
}

/* After MatMul `i` whose result nothing else was fused with: a Transpose
 * alone reading it, keeping the last axis last, is taken: the product
 * writes its rows into the transposed tensor (the attention's merge of
 * the heads). */
static bool
s_plan_result (kiln_cc_ctx_t *cx, const s_uses_t *u, int i)
{
    const kiln_node_t *p = &cx->g->nodes[i];
    kiln_cc_fusion_t *f = &cx->fusion[i];
    int y = p->outputs[0], n = s_sole_reader (cx, u, y);
    if (n < 0)
        return false;
    const kiln_node_t *q = &cx->g->nodes[n];
    const kiln_shape_t *ys = &s_gt (cx, y)->shape;
    int64_t perm[KILN_MAX_RANK], tst[KILN_MAX_RANK], c = 1;
    kiln_err_t ignored;
    int r = ys->rank;
    if (!s_is (q, "Transpose") || q->n_outputs != 1 || q->inputs[0] != y || r < 2
        || s_gt (cx, p->inputs[0])->shape.rank < 2 || s_gt (cx, p->inputs[1])->shape.rank < 2
        || !s_f32 (cx, q->outputs[0]) || s_unit_transpose (cx, q)
        || kiln_transpose_perm (cx->g, q, r, perm, &ignored) || perm[r - 1] != r - 1)
        return false;
    for (int d = r - 1; d >= 0; d--) {
        tst[d] = c;
        c *= ys->dims[perm[d]];
    }
    for (int d = 0; d < r; d++)
        f->y_st[perm[d]] = tst[d];
    f->y_strided = true;
    f->out = q->outputs[0];
    cx->skip[n] = 1;
    return true;
}

/* The AveragePool that alone reads `cur`, the output of the 2-D Conv
 * node `i`, when the Conv is pointwise (1×1, stride 1, unpadded) and
 * every window of the pool is whole (no padding, no ceil_mode overhang):
 * then pooling the Conv's input first gives the same values (a mean of
 * linear maps, bias included, is the map of the mean) for a quarter of
 * the products under a 2×2 pool (densenet's transitions).  Else -1. */
static int
s_pool_after (kiln_cc_ctx_t *cx, const s_uses_t *u, int i, int cur, int *pad)
{
    const kiln_node_t *p = &cx->g->nodes[i];
    int n = s_sole_reader (cx, u, cur);
    if (n < 0 || p->inputs[0] < 0 || s_gt (cx, p->inputs[0])->shape.rank != 4)
        return -1;
    kiln_err_t ignored;
    /* torch exports an AveragePool after a Pad of nothing */
    *pad = -1;
    const kiln_node_t *q = &cx->g->nodes[n];
    int64_t pads[2 * KILN_MAX_RANK];
    kiln_pad_mode_t mode;
    double value;
    kiln_shape_t padded;
    if (s_is (q, "Pad") && q->n_outputs == 1 && q->inputs[0] == cur
        && !kiln_pad_params (cx->g, q, &s_gt (cx, cur)->shape, pads, &mode, &value,
                             &padded, &ignored)) {
        for (int d = 0; d < 2 * padded.rank; d++)
            if (pads[d] != 0)
                return -1;
        *pad = n;
        cur = q->outputs[0];
        if ((n = s_sole_reader (cx, u, cur)) < 0)
            return -1;
        q = &cx->g->nodes[n];
    }
    if (!s_is (q, "AveragePool") || q->n_inputs != 1 || q->n_outputs != 1
        || q->inputs[0] != cur || !s_f32 (cx, q->outputs[0]))
        return -1;
    kiln_window_t cw, pw;
    if (kiln_graph_window (cx->g, i, &cw, &ignored) || kiln_graph_window (cx->g, n, &pw, &ignored)
        || cw.n != 2 || pw.n != 2 || pw.ceil_mode)
        return -1;
    for (int d = 0; d < 2; d++)
        if (cw.kernel[d] != 1 || cw.strides[d] != 1 || cw.pads[d] != 0 || cw.pads[2 + d] != 0
            || pw.pads[d] != 0 || pw.pads[2 + d] != 0 || pw.dilations[d] != 1)
            return -1;
    return n;
}

/* The BatchNormalization (inference, constant statistics) that alone
 * makes `t` from a 4-D float32 input, when nothing else reads `t`: its
 * index, else -1. */
static int
s_bn_before (const kiln_cc_ctx_t *cx, const s_uses_t *u, int t)
{
    int b = t >= 0 && u->uses[t] == 1 && !u->is_output[t] ? cx->producer[t] : -1;
    if (b < 0 || cx->skip[b])
        return -1;
    const kiln_node_t *bn = &cx->g->nodes[b];
    if (!s_is (bn, "BatchNormalization") || bn->n_inputs != 5 || bn->inputs[0] < 0
        || bn->outputs[0] != t || !s_only_first_output (cx, u, bn)
        || kiln_node_attr_int (bn, "training_mode", 0) != 0
        || !s_f32 (cx, bn->inputs[0]) || s_gt (cx, bn->inputs[0])->shape.rank != 4)
        return -1;
    for (int i = 1; i < 5; i++)
        if (bn->inputs[i] < 0 || !s_f32 (cx, bn->inputs[i])
            || !kiln_cc_const_f32 (cx, bn->inputs[i])
            || s_numel (&s_gt (cx, bn->inputs[i])->shape)
                   != s_gt (cx, t)->shape.dims[1])
            return -1;
    return b;
}

/* A pre-activation block before Conv node i (DenseNet's BatchNormalization
 * and Relu over the concatenated features): when the Conv is pointwise
 * (1×1, stride 1, unpadded, one group, constant weights) and its X is
 * made, for it alone, by a BatchNormalization, or by a Relu of one, the
 * Conv reads the BatchNormalization's input and applies both per input
 * channel as its product packs X, so that the normalised tensor is
 * never written.  Not with a pool run first on X (the Relu is not
 * linear). */
static void
s_plan_prologue (kiln_cc_ctx_t *cx, const s_uses_t *u, int i)
{
    const kiln_node_t *p = &cx->g->nodes[i];
    kiln_cc_fusion_t *f = &cx->fusion[i];
    int x = p->inputs[0], wt = p->inputs[1];
    if (f->pool >= 0 || x < 0 || wt < 0 || !s_f32 (cx, x) || !kiln_cc_const_f32 (cx, wt))
        return;
    const kiln_shape_t *sx = &s_gt (cx, x)->shape, *sw = &s_gt (cx, wt)->shape;
    const char *pad = kiln_node_attr_string (p, "auto_pad", "NOTSET");
    const kiln_attr_t *pads = kiln_node_attr (p, "pads");
    const kiln_attr_t *st = kiln_node_attr (p, "strides");
    if (sx->rank != 4 || sw->rank != 4 || sw->dims[2] != 1 || sw->dims[3] != 1
        || sw->dims[1] != sx->dims[1] || kiln_node_attr_int (p, "group", 1) != 1
        || (strcmp (pad, "NOTSET") != 0 && strcmp (pad, "VALID") != 0))
        return;
    for (size_t k = 0; pads && k < pads->n; k++)
        if (pads->kind != KILN_ATTR_INTS || pads->ints[k] != 0)
            return;
    for (size_t k = 0; st && k < st->n; k++)
        if (st->kind != KILN_ATTR_INTS || st->ints[k] != 1)
            return;
    int relu = x >= 0 && u->uses[x] == 1 && !u->is_output[x] ? cx->producer[x] : -1;
    if (relu >= 0 && !cx->skip[relu] && s_is (&cx->g->nodes[relu], "Relu")
        && cx->g->nodes[relu].n_inputs == 1 && cx->g->nodes[relu].n_outputs == 1)
        x = cx->g->nodes[relu].inputs[0];
    else
        relu = -1;
    int b = s_bn_before (cx, u, x);
    if (b < 0)
        return;
    f->pre_bn = b;
    f->pre_relu = relu;
    cx->skip[b] = 1;
    if (relu >= 0)
        cx->skip[relu] = 1;
}

static void
s_plan_product (kiln_cc_ctx_t *cx, const s_uses_t *u, int i)
{
    const kiln_node_t *p = &cx->g->nodes[i];
    bool conv = s_is (p, "Conv"), matmul = s_is (p, "MatMul");
    if ((!conv && !matmul && !s_is (p, "Gemm")) || p->n_outputs < 1
        || p->n_inputs < 2 || !s_f32 (cx, p->outputs[0]))
        return;
    kiln_cc_fusion_t *f = &cx->fusion[i];
    int cur = p->outputs[0], n, other;
    if ((conv || s_is (p, "Gemm")) && (n = s_bn (cx, u, p, cur)) >= 0) {
        f->bn = n;
        cx->skip[n] = 1;
        cur = cx->g->nodes[n].outputs[0];
    }
    if (cx->opts.optlevel >= 2) {
        int pad;
        if (conv && (n = s_pool_after (cx, u, i, cur, &pad)) >= 0) {
            f->pool = n;
            cx->skip[n] = 1;
            if (pad >= 0)
                cx->skip[pad] = 1;
            cur = cx->g->nodes[n].outputs[0];
        }
        if (matmul && f->attn >= 0) {
            /* an attention (s_plan_attention): V's views, Y's transpose */
            s_plan_operand (cx, u, i, 1, false, true);
            s_plan_result (cx, u, i);
            return;
        }
        if (matmul) {
            s_plan_operand (cx, u, i, 0, true, true);
            s_plan_operand (cx, u, i, 1, true, true);
        }
        if (matmul && s_plan_result (cx, u, i))
            return;
        if (matmul && (n = s_add (cx, u, cur, &other)) >= 0
            && s_is_col_bias (cx, other, &s_gt (cx, cur)->shape)) {
            f->bias = other;
            cx->skip[n] = 1;
            cur = cx->g->nodes[n].outputs[0];
        }
        /* A reshape between the product and what follows changes no
         * element: the fused op writes the reshaped tensor. */
        int views[4], n_views, past = s_through_views (cx, u, cur, views, &n_views);
        if ((n = s_add (cx, u, past, &other)) >= 0
            && kiln_shape_equal (&s_gt (cx, other)->shape, &s_gt (cx, past)->shape)
            && kiln_cc_available (cx, other, i)) {
            for (int v = 0; v < n_views; v++)
                cx->skip[views[v]] = 1;
            f->residual = other;
            cx->skip[n] = 1;
            cur = cx->g->nodes[n].outputs[0];
        }
        past = s_through_views (cx, u, cur, views, &n_views);
        if ((n = s_act (cx, u, past, f)) >= 0) {
            for (int v = 0; v < n_views; v++)
                cx->skip[views[v]] = 1;
            cx->skip[n] = 1;
            cur = cx->g->nodes[n].outputs[0];
        }
        if (conv)
            s_plan_prologue (cx, u, i);
    }
    if (cur != p->outputs[0])
        f->out = cur;
}

/* Softmax node `i` between the two products of an attention:
 *   s = MatMul (q, kt) [· or / a constant scalar] [+ mask];
 *   p = Softmax (s) over the last axis;  y = MatMul (p, v)
 * each tensor between them read by the next node alone and not a graph
 * output, every operand a matrix or a batch of them, y's batch that of
 * the scores (q's, kt's, v's and the mask's broadcast to it).  The
 * second MatMul takes over the rest (kiln_cc_fusion_t.attn): the scores
 * of a block of queries go from the first product through the softmax
 * into the second without leaving the cache, and Kᵀ is read where the
 * keys lie (no copy of the transpose).  The first MatMul's operands are
 * taken through their views and scales (s_plan_operand; K's transpose
 * too, its last axis strided), V's through its views. */
static void
s_plan_attention (kiln_cc_ctx_t *cx, const s_uses_t *u, int i)
{
    const kiln_node_t *sm = &cx->g->nodes[i];
    if (!s_is (sm, "Softmax") || sm->n_inputs != 1 || sm->n_outputs != 1
        || sm->inputs[0] < 0 || !s_f32 (cx, sm->inputs[0]) || !s_f32 (cx, sm->outputs[0]))
        return;
    const kiln_shape_t *ss = &s_gt (cx, sm->inputs[0])->shape;
    int axis, r = ss->rank;
    bool flatten;
    kiln_err_t ignored;
    if (r < 2 || kiln_math_softmax_axis (cx->g, sm, r, &axis, &flatten, &ignored)
        || axis != r - 1)
        return;
    int i2 = s_sole_reader (cx, u, sm->outputs[0]);
    if (i2 < 0)
        return;
    const kiln_node_t *m2 = &cx->g->nodes[i2];
    if (!s_is (m2, "MatMul") || m2->n_inputs != 2 || m2->n_outputs != 1
        || m2->inputs[0] != sm->outputs[0] || m2->inputs[1] == sm->outputs[0]
        || m2->inputs[1] < 0 || !s_f32 (cx, m2->inputs[1]) || !s_f32 (cx, m2->outputs[0]))
        return;
    /* back from the softmax: [Add mask] [Mul / Div by a scalar] MatMul */
    int t = sm->inputs[0], reader = i, mask = -1, chain[2], n_chain = 0, i1 = -1;
    double scale = 1.0;
    while (i1 < 0) {
        int n = cx->producer[t];
        if (n < 0 || cx->skip[n] || u->uses[t] != 1 || u->is_output[t]
            || u->consumer[t] != reader)
            return;
        const kiln_node_t *q = &cx->g->nodes[n];
        int x = -1;
        double c = 1.0;
        if (s_is (q, "MatMul")) {
            i1 = n;
            break;
        }
        if (n_chain == 2 || q->n_outputs != 1 || q->outputs[0] != t)
            return;
        if (s_is (q, "Add") && n_chain == 0 && mask < 0) {
            /* the scores: the operand of the Add's shape that a MatMul or
             * a scale made; the other is the mask */
            for (int k = 0; k < 2 && x < 0 && q->n_inputs == 2; k++) {
                int sc = q->inputs[k], o = q->inputs[1 - k];
                int ps = sc >= 0 ? cx->producer[sc] : -1;
                if (ps < 0 || sc == o || !s_f32 (cx, sc)
                    || !kiln_shape_equal (&s_gt (cx, sc)->shape, ss)
                    || !(s_is (&cx->g->nodes[ps], "MatMul") || s_is (&cx->g->nodes[ps], "Mul")
                         || s_is (&cx->g->nodes[ps], "Div")))
                    continue;
                x = sc;
                mask = o;
            }
            if (x < 0 || mask < 0 || !s_f32 (cx, mask) || !kiln_cc_available (cx, mask, i))
                return;
            const kiln_shape_t *ms = &s_gt (cx, mask)->shape;
            if (ms->rank > r)
                return;
            for (int d = 0; d < ms->rank; d++) {
                int64_t want = ss->dims[r - ms->rank + d];
                if (ms->dims[d] != 1 && ms->dims[d] != want)
                    return;
            }
        } else if ((s_is (q, "Mul") || s_is (q, "Div")) && s_operand_step (cx, q, &x, &c)) {
            scale *= c;
        } else {
            return;
        }
        chain[n_chain++] = n;
        reader = n;
        t = x;
    }
    const kiln_node_t *m1 = &cx->g->nodes[i1];
    if (m1->n_inputs != 2 || m1->n_outputs != 1 || m1->outputs[0] != t
        || !kiln_shape_equal (&s_gt (cx, t)->shape, ss))
        return;
    int qt = m1->inputs[0], kt = m1->inputs[1], v = m2->inputs[1], y = m2->outputs[0];
    if (qt < 0 || kt < 0 || !s_f32 (cx, qt) || !s_f32 (cx, kt))
        return;
    const kiln_shape_t *qs = &s_gt (cx, qt)->shape, *ks = &s_gt (cx, kt)->shape,
                       *vs = &s_gt (cx, v)->shape, *ys = &s_gt (cx, y)->shape;
    if (qs->rank < 2 || qs->rank > r || ks->rank < 2 || ks->rank > r || vs->rank < 2
        || vs->rank > r || ys->rank != r || vs->dims[vs->rank - 2] != ss->dims[r - 1]
        || ys->dims[r - 2] != ss->dims[r - 2] || ys->dims[r - 1] != vs->dims[vs->rank - 1])
        return;
    for (int d = 0; d < r - 2; d++)
        if (ys->dims[d] != ss->dims[d])
            return;
    /* no empty product: those stay as they are */
    if (s_numel (ss) == 0 || s_numel (ys) == 0 || qs->dims[qs->rank - 1] == 0)
        return;
    for (int k = 0; k < n_chain; k++)
        cx->skip[chain[k]] = 1;
    cx->skip[i1] = 1;
    cx->skip[i] = 1;
    cx->fusion[i2].attn = i1;
    cx->fusion[i2].attn_mask = mask;
    cx->fusion[i1].alpha = scale;
    s_plan_operand (cx, u, i1, 0, true, true);
    s_plan_operand (cx, u, i1, 1, true, false);
}

/* A BatchNormalization left on its own (not folded into a product: a
 * pre-activation block's, as in DenseNet) takes the activation that reads
 * it, so that the two are one pass over the tensor. */
static void
s_plan_bn_act (kiln_cc_ctx_t *cx, const s_uses_t *u, int i)
{
    const kiln_node_t *bn = &cx->g->nodes[i];
    if (!s_is (bn, "BatchNormalization") || bn->n_outputs != 1 || bn->n_inputs != 5
        || bn->inputs[0] < 0 || !s_f32 (cx, bn->inputs[0]) || !s_f32 (cx, bn->outputs[0]))
        return;
    kiln_cc_fusion_t *f = &cx->fusion[i];
    int n = s_act (cx, u, bn->outputs[0], f);
    if (n < 0)
        return;
    cx->skip[n] = 1;
    f->out = cx->g->nodes[n].outputs[0];
}

/* A constant float32 holding one value. */
static bool
s_scalar (const kiln_cc_ctx_t *cx, int t, double *v)
{
    const float *d = kiln_cc_const_f32 (cx, t);
    if (!d || s_numel (&s_gt (cx, t)->shape) != 1)
        return false;
    *v = d[0];
    return true;
}

/* A ReduceMean over the last axes of its rank-r input, keeping them:
 * the first of those axes in *axis. */
static bool
s_mean_last (const kiln_cc_ctx_t *cx, const kiln_node_t *n, int *axis)
{
    if (!s_is (n, "ReduceMean") || n->n_outputs != 1 || !s_f32 (cx, n->inputs[0])
        || kiln_node_attr_int (n, "keepdims", 1) != 1)
        return false;
    int r = s_gt (cx, n->inputs[0])->shape.rank;
    const kiln_attr_t *a = kiln_node_attr (n, "axes");
    int64_t axes[KILN_MAX_RANK];
    int k = 0;
    if (a && a->kind == KILN_ATTR_INTS && a->n >= 1 && a->n <= (size_t) r
        && n->n_inputs == 1) {
        for (size_t i = 0; i < a->n; i++)
            axes[k++] = a->ints[i] < 0 ? a->ints[i] + r : a->ints[i];
    } else if (!a && n->n_inputs == 2 && n->inputs[1] >= 0) {
        const kiln_tensor_t *t = s_gt (cx, n->inputs[1]);
        if (t->dtype != KILN_DT_INT64 || t->weight < 0 || t->shape.rank != 1
            || t->shape.dims[0] < 1 || t->shape.dims[0] > r
            || !cx->g->weights[t->weight].data)
            return false;
        const int64_t *v = (const int64_t *) cx->g->weights[t->weight].data;
        for (int64_t i = 0; i < t->shape.dims[0]; i++)
            axes[k++] = v[i] < 0 ? v[i] + r : v[i];
    } else {
        return false;
    }
    /* exactly r-k .. r-1, in any order */
    uint32_t seen = 0;
    for (int i = 0; i < k; i++) {
        if (axes[i] < r - k || axes[i] >= r || (seen & (1u << axes[i])))
            return false;
        seen |= 1u << axes[i];
    }
    *axis = r - k;
    return true;
}

/* The node after `t` when it is `op` and reads `t` alone. */
static const kiln_node_t *
s_next (const kiln_cc_ctx_t *cx, const s_uses_t *u, int t, const char *op,
        int *idx)
{
    int n = s_sole_reader (cx, u, t);
    if (n < 0 || !s_is (&cx->g->nodes[n], op) || cx->g->nodes[n].n_outputs != 1
        || !s_f32 (cx, cx->g->nodes[n].outputs[0]))
        return NULL;
    *idx = n;
    return &cx->g->nodes[n];
}

/* The other operand of a two-input node reading `t`. */
static int
s_other (const kiln_node_t *n, int t)
{
    if (n->n_inputs != 2 || n->inputs[0] == n->inputs[1])
        return -1;
    return n->inputs[0] == t ? n->inputs[1] : n->inputs[1] == t ? n->inputs[0] : -1;
}

/* LayerNormalization as torch exports it before opset 17:
 *   m = ReduceMean(x); d = x - m; v = ReduceMean(d ^ 2); s = Sqrt(v + eps);
 *   y = d / s * scale + bias
 * starting at the first ReduceMean, node i. */
static void
s_plan_layer_norm (kiln_cc_ctx_t *cx, const s_uses_t *u, int i)
{
    const kiln_node_t *r1 = &cx->g->nodes[i];
    int axis, axis2, idx[8];
    double two, eps;
    if (!s_mean_last (cx, r1, &axis))
        return;
    int x = r1->inputs[0], m = r1->outputs[0];
    const kiln_node_t *sub = s_next (cx, u, m, "Sub", &idx[0]);
    if (!sub || sub->n_inputs != 2 || sub->inputs[0] != x || sub->inputs[1] != m)
        return;
    int d = sub->outputs[0];
    if (u->uses[d] != 2 || u->is_output[d]
        || !kiln_shape_equal (&s_gt (cx, d)->shape, &s_gt (cx, x)->shape))
        return;
    /* d feeds Pow and Div */
    const kiln_node_t *pw = NULL, *div = NULL;
    for (int n = i + 1; n < cx->g->n_nodes; n++) {
        const kiln_node_t *c = &cx->g->nodes[n];
        if (cx->skip[n] || c->n_inputs < 1 || c->inputs[0] != d)
            continue;
        if (s_is (c, "Pow") && !pw) {
            pw = c;
            idx[1] = n;
        } else if (s_is (c, "Div") && !div) {
            div = c;
            idx[2] = n;
        }
    }
    if (!pw || !div || pw->n_inputs != 2 || !s_scalar (cx, pw->inputs[1], &two)
        || two != 2.0 || !s_f32 (cx, pw->outputs[0]))
        return;
    const kiln_node_t *r2 = s_next (cx, u, pw->outputs[0], "ReduceMean", &idx[3]);
    if (!r2 || !s_mean_last (cx, r2, &axis2) || axis2 != axis)
        return;
    const kiln_node_t *add = s_next (cx, u, r2->outputs[0], "Add", &idx[4]);
    if (!add || !s_scalar (cx, s_other (add, r2->outputs[0]), &eps) || eps < 0)
        return;
    const kiln_node_t *sq = s_next (cx, u, add->outputs[0], "Sqrt", &idx[5]);
    if (!sq || s_sole_reader (cx, u, sq->outputs[0]) != idx[2]
        || div->n_inputs != 2 || div->inputs[1] != sq->outputs[0]
        || div->n_outputs != 1)
        return;
    const kiln_node_t *mul = s_next (cx, u, div->outputs[0], "Mul", &idx[6]);
    if (!mul)
        return;
    int scale = s_other (mul, div->outputs[0]);
    const kiln_node_t *badd = s_next (cx, u, mul->outputs[0], "Add", &idx[7]);
    if (!badd)
        return;
    int bias = s_other (badd, mul->outputs[0]);
    int64_t len = 1;
    const kiln_shape_t *sx = &s_gt (cx, x)->shape;
    for (int k = axis; k < sx->rank; k++)
        len *= sx->dims[k];
    int ends[2] = { scale, bias };
    for (int k = 0; k < 2; k++) {
        if (!kiln_cc_const_f32 (cx, ends[k]))
            return;
        /* the normalised dims exactly, right-aligned (or one value) */
        const kiln_shape_t *s = &s_gt (cx, ends[k])->shape;
        int64_t nn = s_numel (s);
        if (nn != 1 && nn != len)
            return;
        if (nn != 1)
            for (int j = 0; j < s->rank; j++)
                if (s->rank - j > sx->rank - axis ? s->dims[j] != 1
                    : s->dims[j] != sx->dims[sx->rank - (s->rank - j)])
                    return;
    }
    if (!kiln_shape_equal (&s_gt (cx, badd->outputs[0])->shape, sx))
        return;
    for (int k = 0; k < 8; k++)
        cx->skip[idx[k]] = 1;
    kiln_cc_fusion_t *f = &cx->fusion[i];
    f->ln_scale = scale;
    f->ln_bias = bias;
    f->ln_axis = axis;
    f->ln_eps = eps;
    f->out = badd->outputs[0];
}

/* An AveragePool `i` whose input is made by a Pad of zeros (constant
 * mode, value 0, pads not negative, on its spatial axes only) that nothing
 * else reads, the pool itself unpadded: the pool reads the Pad's input
 * with the Pad's pads as its own, counted in every window's size (which
 * is what a window over the padded tensor divided by).  torch exports
 * count_include_pad so; the Pad's copy of the tensor had taken as long as
 * the pool (inception_v3's nine). */
static void
s_plan_pad_pool (kiln_cc_ctx_t *cx, const s_uses_t *u, int i)
{
    const kiln_node_t *q = &cx->g->nodes[i];
    if (!s_is (q, "AveragePool") || q->n_inputs != 1 || q->n_outputs != 1 || q->inputs[0] < 0
        || !s_f32 (cx, q->outputs[0]))
        return;
    int t = q->inputs[0], p = cx->producer[t];
    if (p < 0 || cx->skip[p] || s_sole_reader (cx, u, t) != i)
        return;
    const kiln_node_t *pn = &cx->g->nodes[p];
    if (!s_is (pn, "Pad") || pn->n_outputs != 1 || pn->outputs[0] != t || pn->inputs[0] < 0)
        return;
    const kiln_shape_t *xs = &s_gt (cx, pn->inputs[0])->shape;
    kiln_err_t ignored;
    int64_t pads[2 * KILN_MAX_RANK];
    kiln_pad_mode_t mode;
    double value;
    kiln_shape_t padded;
    kiln_window_t w;
    if ((xs->rank != 3 && xs->rank != 4)
        || kiln_pad_params (cx->g, pn, xs, pads, &mode, &value, &padded, &ignored)
        || mode != KILN_PAD_CONSTANT || value != 0.0
        || kiln_graph_window (cx->g, i, &w, &ignored) || w.n != xs->rank - 2)
        return;
    for (int d = 0; d < xs->rank; d++)
        if (pads[d] < 0 || pads[xs->rank + d] < 0
            || (d < 2 && (pads[d] != 0 || pads[xs->rank + d] != 0)))
            return;
    for (int d = 0; d < 2 * w.n; d++)
        if (w.pads[d] != 0)
            return;
    for (int d = 0; d < w.n; d++) {
        cx->fusion[i].pad_lo[d] = pads[2 + d];
        cx->fusion[i].pad_hi[d] = pads[xs->rank + 2 + d];
    }
    cx->fusion[i].pad = p;
    cx->skip[p] = 1;
}

int
kiln_cc_fuse (kiln_cc_ctx_t *cx, kiln_err_t *err)
{
    kiln_graph_t *g = cx->g;
    for (int i = 0; i < g->n_nodes; i++) {
        cx->skip[i] = 0;
        cx->fusion[i] = (kiln_cc_fusion_t) { .bn = -1, .pool = -1, .pre_bn = -1,
                                             .pre_relu = -1, .bias = -1, .residual = -1,
                                             .act = KILN_ACT_NONE, .out = -1,
                                             .alpha = 1.0, .src = { -1, -1 },
                                             .ln_scale = -1, .ln_bias = -1,
                                             .attn = -1, .attn_mask = -1, .pad = -1 };
    }
    if (cx->opts.optlevel < 1)
        return 0;
    s_uses_t u;
    size_t nt = (size_t) g->n_tensors + 1;
    u.uses = calloc (nt, sizeof *u.uses);
    u.consumer = malloc (nt * sizeof *u.consumer);
    u.is_output = calloc (nt, 1);
    uint8_t *needed = calloc (nt, 1);
    if (!u.uses || !u.consumer || !u.is_output || !needed) {
        free (u.uses);
        free (u.consumer);
        free (u.is_output);
        free (needed);
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    for (int t = 0; t < g->n_tensors; t++)
        u.consumer[t] = -1;
    for (int i = 0; i < g->n_outputs; i++)
        if (g->outputs[i] >= 0 && g->outputs[i] < g->n_tensors)
            needed[g->outputs[i]] = u.is_output[g->outputs[i]] = 1;
    /* Dead nodes: walk back from the outputs. */
    for (int i = g->n_nodes - 1; i >= 0; i--) {
        const kiln_node_t *n = &g->nodes[i];
        bool live = false;
        for (int o = 0; o < n->n_outputs; o++)
            if (n->outputs[o] >= 0 && needed[n->outputs[o]])
                live = true;
        if (!live) {
            cx->skip[i] = 1;
            continue;
        }
        for (int k = 0; k < n->n_inputs; k++)
            if (n->inputs[k] >= 0) {
                needed[n->inputs[k]] = 1;
                u.uses[n->inputs[k]]++;
                u.consumer[n->inputs[k]] = i;
            }
    }
    if (cx->opts.optlevel >= 2)
        for (int i = 0; i < g->n_nodes; i++)
            if (!cx->skip[i])
                s_plan_attention (cx, &u, i);
    for (int i = 0; i < g->n_nodes; i++)
        if (!cx->skip[i])
            s_plan_product (cx, &u, i);
    if (cx->opts.optlevel >= 2)
        for (int i = g->n_nodes - 1; i >= 0; i--)
            if (!cx->skip[i])
                s_plan_transpose (cx, &u, i);
    if (cx->opts.optlevel >= 2)
        for (int i = 0; i < g->n_nodes; i++)
            if (!cx->skip[i]) {
                s_plan_layer_norm (cx, &u, i);
                s_plan_bn_act (cx, &u, i);
                s_plan_pad_pool (cx, &u, i);
            }
    free (u.uses);
    free (u.consumer);
    free (u.is_output);
    free (needed);
    return 0;
}
