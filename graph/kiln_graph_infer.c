/*
 * kiln_graph_infer — validation, topological sort and shape inference.
 *
 * kiln_graph_validate works in four steps: structural checks (indices,
 * bounds, who produces what), a stable topological sort, shape inference
 * node by node in that order, and only then a commit that reorders the
 * nodes and stores the inferred types.  Inference writes into a scratch
 * array of types, so a graph that fails validation is left untouched.
 *
 * Ops are data: s_ops below maps an op name to its input/output counts and
 * an infer function.  Adding an op is one row and one function; the
 * function reads its inputs' types through s_in, its attributes through
 * the s_attr_* getters (which reject an attribute of the wrong kind), and
 * writes its outputs through s_out.  Semantics follow the ONNX operator
 * specification.
 */
#include "common/kiln_ops_arith.h"
#include "common/kiln_ops_binary.h"
#include "common/kiln_ops_reduce.h"
#include "common/kiln_ops_shape.h"
#include "common/kiln_ops_unary.h"
#include "graph/kiln_graph.h"
#include "graph/kiln_infer.h"
#include "graph/kiln_infer_math.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Room for "node '<name>' (<op>)" and similar labels. */
#define S_LABEL_MAX (KILN_MAX_NAME + KILN_MAX_OP_NAME + 32)
#define S_SHAPE_MAX KILN_INFER_SHAPE_MAX

/* The types are kiln_infer.h's, so that infer functions in other files
 * of graph/ can sit in the op table. */
typedef kiln_infer_type_t s_type_t;
typedef kiln_infer_ctx_t s_ctx_t;
typedef kiln_infer_fn s_infer_fn;

typedef struct {
    const char *op;             /* ONNX op type */
    int min_in, max_in;         /* inputs, counting absent optional ones */
    int min_out, max_out;
    s_infer_fn infer;
} s_op_t;

/* --- helpers for infer functions ----------------------------------- */

/* Fail with "<node label>: <message>". */
static int s_fail (s_ctx_t *ctx, int code, const char *fmt, ...)
    __attribute__ ((format (printf, 3, 4)));

static int
s_fail (s_ctx_t *ctx, int code, const char *fmt, ...)
{
    char msg[KILN_ERR_MSG_MAX];
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (msg, sizeof msg, fmt, ap);
    va_end (ap);
    return kiln_error (ctx->err, code, "%s: %s", ctx->label, msg);
}

/* Type of input i, or NULL when the node has no such input or it is an
 * absent optional input. */
static const s_type_t *
s_in (s_ctx_t *ctx, int i)
{
    return i < ctx->n_in ? ctx->in[i] : NULL;
}

static s_type_t *
s_out (s_ctx_t *ctx, int i)
{
    return ctx->out[i];
}

/* How messages name input i: "input 'x'" (or "input #12" unnamed). */
static const char *
s_in_name (s_ctx_t *ctx, int i, char *buf, size_t size)
{
    int t = ctx->node->inputs[i];
    const char *name = ctx->g->tensors[t].name;
    if (name && *name)
        snprintf (buf, size, "input '%s'", name);
    else
        snprintf (buf, size, "input #%d", t);
    return buf;
}

static const char *
s_shape (const kiln_shape_t *shape, char *buf)
{
    return kiln_shape_str (shape, buf, S_SHAPE_MAX);
}

/* Input i must be float32, or float16 or bfloat16 (stored in 2 bytes,
 * computed in float32): kiln's compute ops work in float32 only.  The
 * inputs after the first must have the first one's dtype, as ONNX's
 * type constraints say. */
static int
s_want_float (s_ctx_t *ctx, int i)
{
    const s_type_t *t = s_in (ctx, i), *t0 = s_in (ctx, 0);
    char nb[KILN_MAX_NAME + 16], n0[KILN_MAX_NAME + 16];
    if (t && t->dtype != KILN_DT_FLOAT32 && !kiln_dtype_is_half (t->dtype))
        return s_fail (ctx, KILN_ESHAPE, "%s is %s, expected float32, float16 or "
                       "bfloat16", s_in_name (ctx, i, nb, sizeof nb),
                       kiln_dtype_name (t->dtype));
    if (t && i > 0 && t0 && t->dtype != t0->dtype)
        return s_fail (ctx, KILN_ESHAPE, "%s is %s but %s is %s",
                       s_in_name (ctx, i, nb, sizeof nb), kiln_dtype_name (t->dtype),
                       s_in_name (ctx, 0, n0, sizeof n0), kiln_dtype_name (t0->dtype));
    return 0;
}

/* Input i must have rank in lo..hi. */
static int
s_want_rank (s_ctx_t *ctx, int i, int lo, int hi)
{
    const s_type_t *t = s_in (ctx, i);
    if (t->shape.rank >= lo && t->shape.rank <= hi)
        return 0;
    char nb[KILN_MAX_NAME + 16];
    s_in_name (ctx, i, nb, sizeof nb);
    if (lo == hi)
        return s_fail (ctx, KILN_ESHAPE, "%s has rank %d, expected %d", nb, t->shape.rank, lo);
    if (hi >= KILN_MAX_RANK)
        return s_fail (ctx, KILN_ESHAPE, "%s has rank %d, expected at least %d", nb,
                       t->shape.rank, lo);
    return s_fail (ctx, KILN_ESHAPE, "%s has rank %d, expected %d to %d", nb,
                   t->shape.rank, lo, hi);
}

static const char *
s_kind_name (kiln_attr_kind_t kind)
{
    switch (kind) {
    case KILN_ATTR_INT: return "an int";
    case KILN_ATTR_FLOAT: return "a float";
    case KILN_ATTR_STRING: return "a string";
    case KILN_ATTR_INTS: return "a list of ints";
    case KILN_ATTR_FLOATS: return "a list of floats";
    }
    return "of unknown kind";
}

/* The attribute `name` when present, checked to be of `kind`. */
static int
s_attr (s_ctx_t *ctx, const char *name, kiln_attr_kind_t kind,
        const kiln_attr_t **out)
{
    *out = kiln_node_attr (ctx->node, name);
    if (*out && (*out)->kind != kind)
        return s_fail (ctx, KILN_EFORMAT, "attribute '%s' is %s, expected %s", name,
                       s_kind_name ((*out)->kind), s_kind_name (kind));
    return 0;
}

/* Integer attribute within lo..hi, `fallback` when absent. */
static int
s_attr_int (s_ctx_t *ctx, const char *name, int64_t fallback, int64_t lo,
            int64_t hi, int64_t *v)
{
    const kiln_attr_t *a;
    int rc = s_attr (ctx, name, KILN_ATTR_INT, &a);
    if (rc)
        return rc;
    *v = a ? a->i : fallback;
    if (*v < lo || *v > hi)
        return s_fail (ctx, KILN_EFORMAT, "attribute '%s' is %lld, outside %lld..%lld", name,
                       (long long) *v, (long long) lo, (long long) hi);
    return 0;
}

/* Float attribute (only its kind is checked; no op here needs its value
 * for shapes). */
static int
s_attr_float (s_ctx_t *ctx, const char *name)
{
    const kiln_attr_t *a;
    return s_attr (ctx, name, KILN_ATTR_FLOAT, &a);
}

/* List-of-ints attribute of exactly `count` elements each within lo..hi,
 * into v[count]; *present says whether it was there (v untouched if not). */
static int
s_attr_ints (s_ctx_t *ctx, const char *name, int count, int64_t lo, int64_t hi,
             int64_t *v, bool *present)
{
    const kiln_attr_t *a;
    int rc = s_attr (ctx, name, KILN_ATTR_INTS, &a);
    if (rc)
        return rc;
    *present = a != NULL;
    if (!a)
        return 0;
    if (a->n != (size_t) count)
        return s_fail (ctx, KILN_EFORMAT, "attribute '%s' has %zu values, expected %d",
                       name, a->n, count);
    for (int i = 0; i < count; i++) {
        if (a->ints[i] < lo || a->ints[i] > hi)
            return s_fail (ctx, KILN_EFORMAT, "attribute '%s'[%d] is %lld, outside %lld..%lld",
                           name, i, (long long) a->ints[i], (long long) lo, (long long) hi);
        v[i] = a->ints[i];
    }
    return 0;
}

/* Product of dims[from..to) into *out, failing when it passes
 * KILN_MAX_DIM (dims are each at most KILN_MAX_DIM, so the check before
 * every multiplication keeps it from overflowing). */
static int
s_dim_product (s_ctx_t *ctx, const int64_t *dims, int from, int to, int64_t *out)
{
    int64_t p = 1;
    for (int i = from; i < to; i++) {
        if (dims[i] == 0) {
            p = 0;
            break;
        }
        if (p > KILN_MAX_DIM / dims[i])
            return s_fail (ctx, KILN_ELIMIT, "a dimension would be larger than %lld",
                           (long long) KILN_MAX_DIM);
        p *= dims[i];
    }
    *out = p;
    return 0;
}

/* numpy (multidirectional) broadcasting of inputs ia and ib's shapes `a`
 * and `b` into `out`. */
static int
s_broadcast (s_ctx_t *ctx, const kiln_shape_t *a, int ia, const kiln_shape_t *b,
             int ib, kiln_shape_t *out)
{
    int r = a->rank > b->rank ? a->rank : b->rank;
    kiln_shape_t o = { .rank = r };
    for (int i = 0; i < r; i++) {
        int ka = i - (r - a->rank), kb = i - (r - b->rank);
        int64_t da = ka >= 0 ? a->dims[ka] : 1;
        int64_t db = kb >= 0 ? b->dims[kb] : 1;
        if (da == db || db == 1)
            o.dims[i] = da;
        else if (da == 1)
            o.dims[i] = db;
        else {
            char na[KILN_MAX_NAME + 16], nb[KILN_MAX_NAME + 16];
            char sa[S_SHAPE_MAX], sb[S_SHAPE_MAX];
            return s_fail (ctx, KILN_ESHAPE, "cannot broadcast %s %s with %s %s",
                           s_in_name (ctx, ia, na, sizeof na), s_shape (a, sa),
                           s_in_name (ctx, ib, nb, sizeof nb), s_shape (b, sb));
        }
    }
    *out = o;
    return 0;
}

/* --- the same helpers for other files (kiln_infer.h) ---------------- */

int
kiln_infer_fail (kiln_infer_ctx_t *ctx, int code, const char *fmt, ...)
{
    char msg[KILN_ERR_MSG_MAX];
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (msg, sizeof msg, fmt, ap);
    va_end (ap);
    return kiln_error (ctx->err, code, "%s: %s", ctx->label, msg);
}

const kiln_infer_type_t *
kiln_infer_in (kiln_infer_ctx_t *ctx, int i)
{
    return s_in (ctx, i);
}

kiln_infer_type_t *
kiln_infer_out (kiln_infer_ctx_t *ctx, int i)
{
    return s_out (ctx, i);
}

const char *
kiln_infer_in_name (kiln_infer_ctx_t *ctx, int i, char *buf, size_t size)
{
    return s_in_name (ctx, i, buf, size);
}

const char *
kiln_infer_shape_str (const kiln_shape_t *shape, char *buf)
{
    return s_shape (shape, buf);
}

int
kiln_infer_want_float (kiln_infer_ctx_t *ctx, int i)
{
    return s_want_float (ctx, i);
}

int
kiln_infer_want_rank (kiln_infer_ctx_t *ctx, int i, int lo, int hi)
{
    return s_want_rank (ctx, i, lo, hi);
}

int
kiln_infer_attr (kiln_infer_ctx_t *ctx, const char *name, kiln_attr_kind_t kind,
                 const kiln_attr_t **out)
{
    return s_attr (ctx, name, kind, out);
}

int
kiln_infer_attr_int (kiln_infer_ctx_t *ctx, const char *name, int64_t fallback,
                     int64_t lo, int64_t hi, int64_t *v)
{
    return s_attr_int (ctx, name, fallback, lo, hi, v);
}

int
kiln_infer_attr_ints (kiln_infer_ctx_t *ctx, const char *name, int count,
                      int64_t lo, int64_t hi, int64_t *v, bool *present)
{
    return s_attr_ints (ctx, name, count, lo, hi, v, present);
}

int
kiln_infer_broadcast (kiln_infer_ctx_t *ctx, const kiln_shape_t *a, int ia,
                      const kiln_shape_t *b, int ib, kiln_shape_t *out)
{
    return s_broadcast (ctx, a, ia, b, ib, out);
}

int
kiln_infer_dim_product (kiln_infer_ctx_t *ctx, const int64_t *dims, int from,
                        int to, int64_t *out)
{
    return s_dim_product (ctx, dims, from, to, out);
}

/* --- elementwise --------------------------------------------------- */

static int
s_infer_relu (s_ctx_t *ctx)
{
    int rc = s_want_float (ctx, 0);
    if (rc)
        return rc;
    *s_out (ctx, 0) = *s_in (ctx, 0);
    return 0;
}

static int
s_infer_identity (s_ctx_t *ctx)
{
    *s_out (ctx, 0) = *s_in (ctx, 0);
    return 0;
}

/* --- matrix products ----------------------------------------------- */

/* MatMul: numpy.matmul semantics -- a 1-D first operand is a row vector
 * and a 1-D second operand a column vector, each dropped from the result;
 * leading (batch) dimensions broadcast. */
static int
s_infer_matmul (s_ctx_t *ctx)
{
    const s_type_t *a = s_in (ctx, 0), *b = s_in (ctx, 1);
    int rc;
    if ((rc = s_want_float (ctx, 0)) || (rc = s_want_float (ctx, 1))
        || (rc = s_want_rank (ctx, 0, 1, KILN_MAX_RANK))
        || (rc = s_want_rank (ctx, 1, 1, KILN_MAX_RANK)))
        return rc;
    int ra = a->shape.rank, rb = b->shape.rank;
    int64_t ka = a->shape.dims[ra - 1];
    int64_t kb = rb >= 2 ? b->shape.dims[rb - 2] : b->shape.dims[0];
    if (ka != kb) {
        char na[KILN_MAX_NAME + 16], nb[KILN_MAX_NAME + 16];
        char sa[S_SHAPE_MAX], sb[S_SHAPE_MAX];
        return s_fail (ctx, KILN_ESHAPE, "inner dimensions differ: %s %s has %lld, %s %s has %lld",
                       s_in_name (ctx, 0, na, sizeof na), s_shape (&a->shape, sa), (long long) ka,
                       s_in_name (ctx, 1, nb, sizeof nb), s_shape (&b->shape, sb), (long long) kb);
    }
    kiln_shape_t ba = { .rank = ra > 2 ? ra - 2 : 0 };
    kiln_shape_t bb = { .rank = rb > 2 ? rb - 2 : 0 };
    memcpy (ba.dims, a->shape.dims, (size_t) ba.rank * sizeof (int64_t));
    memcpy (bb.dims, b->shape.dims, (size_t) bb.rank * sizeof (int64_t));
    kiln_shape_t out;
    if ((rc = s_broadcast (ctx, &ba, 0, &bb, 1, &out)))
        return rc;
    if (ra >= 2)
        out.dims[out.rank++] = a->shape.dims[ra - 2];
    if (rb >= 2)
        out.dims[out.rank++] = b->shape.dims[rb - 1];
    s_out (ctx, 0)->dtype = s_in (ctx, 0)->dtype;
    s_out (ctx, 0)->shape = out;
    return 0;
}

/* Gemm: Y = alpha * op(A) op(B) + beta * C, with A and B 2-D and C
 * unidirectionally broadcastable to [M, N]. */
static int
s_infer_gemm (s_ctx_t *ctx)
{
    int rc;
    int64_t trans_a, trans_b;
    if ((rc = s_want_float (ctx, 0)) || (rc = s_want_float (ctx, 1))
        || (rc = s_want_float (ctx, 2)) || (rc = s_want_rank (ctx, 0, 2, 2))
        || (rc = s_want_rank (ctx, 1, 2, 2))
        || (rc = s_attr_int (ctx, "transA", 0, 0, 1, &trans_a))
        || (rc = s_attr_int (ctx, "transB", 0, 0, 1, &trans_b))
        || (rc = s_attr_float (ctx, "alpha")) || (rc = s_attr_float (ctx, "beta")))
        return rc;
    const kiln_shape_t *a = &s_in (ctx, 0)->shape, *b = &s_in (ctx, 1)->shape;
    int64_t m = trans_a ? a->dims[1] : a->dims[0];
    int64_t k = trans_a ? a->dims[0] : a->dims[1];
    int64_t kb = trans_b ? b->dims[1] : b->dims[0];
    int64_t n = trans_b ? b->dims[0] : b->dims[1];
    if (k != kb) {
        char na[KILN_MAX_NAME + 16], nb[KILN_MAX_NAME + 16];
        char sa[S_SHAPE_MAX], sb[S_SHAPE_MAX];
        return s_fail (ctx, KILN_ESHAPE,
                       "inner dimensions differ: %s %s (transA=%lld) has K=%lld, %s %s (transB=%lld) has K=%lld",
                       s_in_name (ctx, 0, na, sizeof na), s_shape (a, sa), (long long) trans_a,
                       (long long) k, s_in_name (ctx, 1, nb, sizeof nb), s_shape (b, sb),
                       (long long) trans_b, (long long) kb);
    }
    kiln_shape_t y = { .rank = 2, .dims = { m, n } };
    const s_type_t *c = s_in (ctx, 2);
    if (c) {
        bool ok = c->shape.rank <= 2;
        for (int i = 0; ok && i < c->shape.rank; i++) {
            int64_t want = y.dims[2 - c->shape.rank + i];
            ok = c->shape.dims[i] == want || c->shape.dims[i] == 1;
        }
        if (!ok) {
            char nc[KILN_MAX_NAME + 16], sc[S_SHAPE_MAX], sy[S_SHAPE_MAX];
            return s_fail (ctx, KILN_ESHAPE, "%s %s does not broadcast to %s",
                           s_in_name (ctx, 2, nc, sizeof nc), s_shape (&c->shape, sc),
                           s_shape (&y, sy));
        }
    }
    s_out (ctx, 0)->dtype = s_in (ctx, 0)->dtype;
    s_out (ctx, 0)->shape = y;
    return 0;
}

/* --- sliding windows (Conv, MaxPool) ------------------------------- */

typedef enum { S_PAD_NOTSET, S_PAD_SAME_UPPER, S_PAD_SAME_LOWER, S_PAD_VALID } s_auto_pad_t;

/* Read strides, dilations, pads, auto_pad and (for pools) ceil_mode into
 * `w`, whose n and kernel are already set; resolve auto_pad against the
 * input's spatial dims and compute the output's spatial dims into out[]. */
static int
s_window (s_ctx_t *ctx, const kiln_shape_t *x, kiln_window_t *w, bool pool,
          int64_t *out)
{
    int n = w->n, rc;
    bool present;
    for (int i = 0; i < n; i++) {
        w->strides[i] = 1;
        w->dilations[i] = 1;
        w->pads[i] = w->pads[n + i] = 0;
    }
    if ((rc = s_attr_ints (ctx, "strides", n, 1, KILN_MAX_DIM, w->strides, &present))
        || (rc = s_attr_ints (ctx, "dilations", n, 1, KILN_MAX_DIM, w->dilations, &present))
        || (rc = s_attr_ints (ctx, "pads", 2 * n, 0, KILN_MAX_DIM, w->pads, &present)))
        return rc;
    int64_t ceil_mode = 0;
    if (pool && (rc = s_attr_int (ctx, "ceil_mode", 0, 0, 1, &ceil_mode)))
        return rc;
    w->ceil_mode = ceil_mode != 0;

    const kiln_attr_t *a;
    if ((rc = s_attr (ctx, "auto_pad", KILN_ATTR_STRING, &a)))
        return rc;
    const char *ap = a && a->s ? a->s : "NOTSET";
    s_auto_pad_t mode;
    if (strcmp (ap, "NOTSET") == 0 || *ap == '\0')
        mode = S_PAD_NOTSET;
    else if (strcmp (ap, "SAME_UPPER") == 0)
        mode = S_PAD_SAME_UPPER;
    else if (strcmp (ap, "SAME_LOWER") == 0)
        mode = S_PAD_SAME_LOWER;
    else if (strcmp (ap, "VALID") == 0)
        mode = S_PAD_VALID;
    else
        return s_fail (ctx, KILN_EFORMAT,
                       "attribute 'auto_pad' is '%s', expected NOTSET, SAME_UPPER, SAME_LOWER or VALID",
                       ap);
    if (mode != S_PAD_NOTSET)
        for (int i = 0; i < 2 * n; i++)
            if (w->pads[i] != 0)
                return s_fail (ctx, KILN_EFORMAT, "attribute 'pads' cannot be used with auto_pad %s", ap);

    for (int i = 0; i < n; i++) {
        /* Every term is at most KILN_MAX_DIM (2^31), so none of the sums
         * and products below can overflow int64. */
        int64_t in = x->dims[2 + i], s = w->strides[i];
        int64_t ek = (w->kernel[i] - 1) * w->dilations[i] + 1;
        if (mode == S_PAD_SAME_UPPER || mode == S_PAD_SAME_LOWER) {
            out[i] = (in + s - 1) / s;
            int64_t total = (out[i] - 1) * s + ek - in;
            if (total < 0)
                total = 0;
            int64_t small = total / 2, big = total - small;
            w->pads[i] = mode == S_PAD_SAME_UPPER ? small : big;
            w->pads[n + i] = mode == S_PAD_SAME_UPPER ? big : small;
            continue;
        }
        int64_t span = in + w->pads[i] + w->pads[n + i] - ek;
        if (span < 0)
            return s_fail (ctx, KILN_ESHAPE,
                           "spatial axis %d: the kernel spans %lld (size %lld, dilation %lld) but the padded input is only %lld",
                           i, (long long) ek, (long long) w->kernel[i],
                           (long long) w->dilations[i],
                           (long long) (in + w->pads[i] + w->pads[n + i]));
        out[i] = (w->ceil_mode ? (span + s - 1) / s : span / s) + 1;
        /* As in PyTorch (and later ONNX releases): with ceil_mode the last
         * window must start inside the input or its begin padding, not in
         * the end padding only. */
        if (w->ceil_mode && (out[i] - 1) * s >= in + w->pads[i])
            out[i]--;
    }
    return 0;
}

/* Conv: X [N, C, D1..Dn], W [M, C/group, k1..kn], optional B [M]. */
static int
s_conv_window (s_ctx_t *ctx, kiln_window_t *w, kiln_shape_t *y)
{
    int rc;
    if ((rc = s_want_float (ctx, 0)) || (rc = s_want_float (ctx, 1))
        || (rc = s_want_float (ctx, 2)) || (rc = s_want_rank (ctx, 0, 3, KILN_MAX_RANK)))
        return rc;
    const kiln_shape_t *x = &s_in (ctx, 0)->shape, *k = &s_in (ctx, 1)->shape;
    int r = x->rank;
    if ((rc = s_want_rank (ctx, 1, r, r)))
        return rc;
    int64_t group;
    if ((rc = s_attr_int (ctx, "group", 1, 1, KILN_MAX_DIM, &group)))
        return rc;
    int64_t c = x->dims[1], m = k->dims[0];
    char nx[KILN_MAX_NAME + 16], nw[KILN_MAX_NAME + 16];
    char sx[S_SHAPE_MAX], sw[S_SHAPE_MAX];
    s_in_name (ctx, 0, nx, sizeof nx);
    s_in_name (ctx, 1, nw, sizeof nw);
    if (c % group != 0 || k->dims[1] * group != c)
        return s_fail (ctx, KILN_ESHAPE,
                       "%s %s has %lld input channels per group, but %s %s has %lld channels and group is %lld",
                       nw, s_shape (k, sw), (long long) k->dims[1], nx, s_shape (x, sx),
                       (long long) c, (long long) group);
    if (m % group != 0)
        return s_fail (ctx, KILN_ESHAPE, "%s %s: %lld output channels do not divide into %lld groups",
                       nw, s_shape (k, sw), (long long) m, (long long) group);
    w->n = r - 2;
    for (int i = 0; i < w->n; i++)
        w->kernel[i] = k->dims[2 + i];
    int64_t ks[KILN_MAX_RANK];
    bool present;
    if ((rc = s_attr_ints (ctx, "kernel_shape", w->n, 1, KILN_MAX_DIM, ks, &present)))
        return rc;
    for (int i = 0; present && i < w->n; i++)
        if (ks[i] != w->kernel[i])
            return s_fail (ctx, KILN_ESHAPE, "attribute 'kernel_shape'[%d] is %lld but %s %s has %lld",
                           i, (long long) ks[i], nw, s_shape (k, sw), (long long) w->kernel[i]);
    for (int i = 0; i < w->n; i++)
        if (w->kernel[i] < 1)
            return s_fail (ctx, KILN_ESHAPE, "%s %s has an empty kernel", nw, s_shape (k, sw));
    const s_type_t *b = s_in (ctx, 2);
    if (b && (b->shape.rank != 1 || b->shape.dims[0] != m)) {
        char nb[KILN_MAX_NAME + 16], sb[S_SHAPE_MAX];
        return s_fail (ctx, KILN_ESHAPE, "%s %s is not [%lld], one bias per output channel",
                       s_in_name (ctx, 2, nb, sizeof nb), s_shape (&b->shape, sb), (long long) m);
    }
    y->rank = r;
    y->dims[0] = x->dims[0];
    y->dims[1] = m;
    return s_window (ctx, x, w, false, y->dims + 2);
}

static int
s_infer_conv (s_ctx_t *ctx)
{
    kiln_window_t w;
    kiln_shape_t y;
    int rc = s_conv_window (ctx, &w, &y);
    if (rc)
        return rc;
    s_out (ctx, 0)->dtype = s_in (ctx, 0)->dtype;
    s_out (ctx, 0)->shape = y;
    return 0;
}

/* MaxPool: X [N, C, D1..Dn], kernel_shape required; only the values
 * output (the optional Indices output is not supported). */
static int
s_pool_window (s_ctx_t *ctx, kiln_window_t *w, kiln_shape_t *y)
{
    int rc;
    if ((rc = s_want_float (ctx, 0)) || (rc = s_want_rank (ctx, 0, 3, KILN_MAX_RANK)))
        return rc;
    const kiln_shape_t *x = &s_in (ctx, 0)->shape;
    w->n = x->rank - 2;
    bool present;
    if ((rc = s_attr_ints (ctx, "kernel_shape", w->n, 1, KILN_MAX_DIM, w->kernel, &present)))
        return rc;
    if (!present)
        return s_fail (ctx, KILN_EFORMAT, "attribute 'kernel_shape' is required");
    y->rank = x->rank;
    y->dims[0] = x->dims[0];
    y->dims[1] = x->dims[1];
    if ((rc = s_window (ctx, x, w, true, y->dims + 2)))
        return rc;
    /* A pad as wide as the kernel lets a window lie in the padding alone:
     * MaxPool would output -inf there and AveragePool divide by nothing.
     * ONNX Runtime refuses such pads when they are given; so does kiln
     * (pads that auto_pad works out are never that wide, dilation aside). */
    bool given = kiln_node_attr (ctx->node, "pads") != NULL;
    for (int i = 0; given && i < 2 * w->n; i++)
        if (w->pads[i] >= w->kernel[i % w->n])
            return s_fail (ctx, KILN_EFORMAT, "attribute 'pads'[%d] is %lld, not smaller than "
                           "the kernel (%lld on spatial axis %d): a window could hold "
                           "padding only", i, (long long) w->pads[i],
                           (long long) w->kernel[i % w->n], i % w->n);
    return 0;
}

static int
s_infer_maxpool (s_ctx_t *ctx)
{
    if (ctx->node->n_outputs > 1)
        return s_fail (ctx, KILN_EUNSUPPORTED,
                       "the second output (Indices) is not supported, only the pooled values");
    kiln_window_t w;
    kiln_shape_t y;
    int rc = s_pool_window (ctx, &w, &y);
    if (rc)
        return rc;
    s_out (ctx, 0)->dtype = s_in (ctx, 0)->dtype;
    s_out (ctx, 0)->shape = y;
    return 0;
}

static int
s_infer_global_pool (s_ctx_t *ctx)
{
    int rc;
    if ((rc = s_want_float (ctx, 0)) || (rc = s_want_rank (ctx, 0, 3, KILN_MAX_RANK)))
        return rc;
    kiln_shape_t y = s_in (ctx, 0)->shape;
    for (int i = 2; i < y.rank; i++)
        y.dims[i] = 1;
    s_out (ctx, 0)->dtype = s_in (ctx, 0)->dtype;
    s_out (ctx, 0)->shape = y;
    return 0;
}

/* --- shape ops ----------------------------------------------------- */

/* Flatten: [d0 * .. * d(axis-1), d(axis) * .. * d(r-1)]; axis in -r..r. */
static int
s_infer_flatten (s_ctx_t *ctx)
{
    const s_type_t *x = s_in (ctx, 0);
    int r = x->shape.rank;
    int64_t axis;
    int rc = s_attr_int (ctx, "axis", 1, -r, r, &axis);
    if (rc)
        return rc;
    if (axis < 0)
        axis += r;
    kiln_shape_t y = { .rank = 2 };
    if ((rc = s_dim_product (ctx, x->shape.dims, 0, (int) axis, &y.dims[0]))
        || (rc = s_dim_product (ctx, x->shape.dims, (int) axis, r, &y.dims[1])))
        return rc;
    s_out (ctx, 0)->dtype = x->dtype;
    s_out (ctx, 0)->shape = y;
    return 0;
}

/* Little-endian int64 at p (weights are stored little-endian, as ONNX
 * raw_data is, whatever the host). */
static int64_t
s_le64 (const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return (int64_t) v;
}

/* Reshape: the target shape is the data of the second input, which must
 * be a constant int64 1-D weight; 0 copies the input's dimension at that
 * index (unless allowzero=1), one -1 is inferred. */
static int
s_infer_reshape (s_ctx_t *ctx)
{
    const s_type_t *x = s_in (ctx, 0), *s = s_in (ctx, 1);
    const kiln_tensor_t *st = &ctx->g->tensors[ctx->node->inputs[1]];
    char ns[KILN_MAX_NAME + 16], sx[S_SHAPE_MAX], sy[S_SHAPE_MAX];
    s_in_name (ctx, 1, ns, sizeof ns);
    int rc;
    if ((rc = s_want_rank (ctx, 1, 1, 1)))
        return rc;
    if (s->dtype != KILN_DT_INT64)
        return s_fail (ctx, KILN_ESHAPE, "shape %s is %s, expected int64", ns,
                       kiln_dtype_name (s->dtype));
    if (st->weight < 0)
        return s_fail (ctx, KILN_EUNSUPPORTED,
                       "shape %s is computed at run time; only a constant (weight) shape is supported",
                       ns);
    const kiln_weight_t *w = &ctx->g->weights[st->weight];
    if (!w->data)
        return s_fail (ctx, KILN_EINVAL, "shape %s has no weight data attached", ns);
    int64_t count = s->shape.dims[0];
    if (count > KILN_MAX_RANK)
        return s_fail (ctx, KILN_ELIMIT, "shape %s has %lld elements, more than rank %d",
                       ns, (long long) count, KILN_MAX_RANK);
    if (w->size != (uint64_t) count * 8)
        return s_fail (ctx, KILN_EFORMAT, "shape %s holds %llu bytes, expected %lld", ns,
                       (unsigned long long) w->size, (long long) count * 8);
    int64_t allowzero;
    if ((rc = s_attr_int (ctx, "allowzero", 0, 0, 1, &allowzero)))
        return rc;

    int64_t in_numel;
    if ((rc = kiln_shape_numel (&x->shape, "reshape input", &in_numel, ctx->err)))
        return kiln_error_prefix (ctx->err, "%s", ctx->label);
    kiln_shape_t y = { .rank = (int) count };
    int infer = -1;
    bool has_zero = false;
    int64_t known = 1;          /* product of the dims other than -1 */
    for (int i = 0; i < y.rank; i++) {
        int64_t v = s_le64 (w->data + 8 * i);
        if (v == -1) {
            if (infer >= 0)
                return s_fail (ctx, KILN_ESHAPE, "shape %s has more than one -1", ns);
            infer = i;
            continue;
        }
        if (v < -1 || v > KILN_MAX_DIM)
            return s_fail (ctx, KILN_ESHAPE, "shape %s: element %d is %lld", ns, i, (long long) v);
        if (v == 0 && !allowzero) {
            if (i >= x->shape.rank)
                return s_fail (ctx, KILN_ESHAPE,
                               "shape %s: element %d is 0 (copy the input's dimension) but the input %s has rank %d",
                               ns, i, s_shape (&x->shape, sx), x->shape.rank);
            v = x->shape.dims[i];
        }
        has_zero |= v == 0;
        y.dims[i] = v;
        /* known stays <= KILN_MAX_TENSOR_ELEMS before each step, and v <=
         * KILN_MAX_DIM, so the product fits in int64. */
        known *= v;
        if (known > KILN_MAX_TENSOR_ELEMS)
            return s_fail (ctx, KILN_ESHAPE, "cannot reshape %s (%lld elements) to shape %s",
                           s_shape (&x->shape, sx), (long long) in_numel, ns);
    }
    if (infer >= 0) {
        if (allowzero && has_zero)
            return s_fail (ctx, KILN_ESHAPE, "shape %s has both -1 and 0 with allowzero=1", ns);
        if (known == 0 || in_numel % known != 0) {
            y.dims[infer] = -1;
            return s_fail (ctx, KILN_ESHAPE, "cannot reshape %s (%lld elements) to %s", s_shape (&x->shape, sx),
                           (long long) in_numel, s_shape (&y, sy));
        }
        y.dims[infer] = in_numel / known;
        known = in_numel;
    }
    if (known != in_numel)
        return s_fail (ctx, KILN_ESHAPE, "cannot reshape %s (%lld elements) to %s (%lld elements)",
                       s_shape (&x->shape, sx), (long long) in_numel, s_shape (&y, sy),
                       (long long) known);
    s_out (ctx, 0)->dtype = x->dtype;
    s_out (ctx, 0)->shape = y;
    return 0;
}

/* --- the op table -------------------------------------------------- */

/* Sorted by op name (strcmp order) for bsearch; s_op_find checks it.
 * Constant is deliberately absent: the ONNX importer turns Constant nodes
 * into weights. */
static const s_op_t s_ops[] = {
    /* op                   in      out   infer */
    { "Abs",               1, 1,   1, 1, kiln_infer_neg_abs },
    { "AveragePool",        1, 1,   1, 1, s_infer_maxpool },
    { "BatchNormalization", 5, 5,   1, 5, kiln_infer_batch_norm },
    { "Cast",              1, 1,   1, 1, kiln_infer_cast },
    { "CastLike",          2, 2,   1, 1, kiln_infer_cast },
    { "Ceil",              1, 1,   1, 1, kiln_infer_float_unary },
    { "Celu",              1, 1,   1, 1, kiln_infer_float_unary },
    { "Clip",              1, 3,   1, 1, kiln_infer_clip },
    { "Conv",               2, 3,   1, 1, s_infer_conv },
    { "ConvTranspose",      2, 3,   1, 1, kiln_infer_conv_transpose },
    { "CumSum",             2, 2,   1, 1, kiln_infer_cumsum },
    { "Einsum",             1, KILN_MAX_NODE_IO, 1, 1, kiln_infer_einsum },
    { "Elu",               1, 1,   1, 1, kiln_infer_float_unary },
    { "Erf",               1, 1,   1, 1, kiln_infer_float_unary },
    { "Exp",               1, 1,   1, 1, kiln_infer_float_unary },
    { "Floor",             1, 1,   1, 1, kiln_infer_float_unary },
    { "GRU",                3, 6,   1, 2, kiln_infer_rnn },
    { "Gemm",               2, 3,   1, 1, s_infer_gemm },
    { "GlobalAveragePool",  1, 1,   1, 1, s_infer_global_pool },
    { "GlobalMaxPool",      1, 1,   1, 1, s_infer_global_pool },
    { "GridSample",         2, 2,   1, 1, kiln_infer_grid_sample },
    { "HardSigmoid",       1, 1,   1, 1, kiln_infer_float_unary },
    { "HardSwish",         1, 1,   1, 1, kiln_infer_float_unary },
    { "Hardmax",           1, 1,   1, 1, kiln_infer_softmax },
    { "InstanceNormalization", 3, 3,   1, 1, kiln_infer_instance_norm },
    { "IsInf",             1, 1,   1, 1, kiln_infer_isinf },
    { "LRN",               1, 1,   1, 1, kiln_infer_lrn },
    { "LSTM",               3, 8,   1, 3, kiln_infer_rnn },
    { "LayerNormalization", 2, 3,   1, 3, kiln_infer_layer_norm },
    { "LeakyRelu",         1, 1,   1, 1, kiln_infer_float_unary },
    { "Log",               1, 1,   1, 1, kiln_infer_float_unary },
    { "LogSoftmax",        1, 1,   1, 1, kiln_infer_softmax },
    { "MatMul",             2, 2,   1, 1, s_infer_matmul },
    { "MaxPool",            1, 1,   1, 2, s_infer_maxpool },
    { "Neg",               1, 1,   1, 1, kiln_infer_neg_abs },
    { "NegativeLogLikelihoodLoss", 2, 3, 1, 1, kiln_infer_nll },
    { "Not",               1, 1,   1, 1, kiln_infer_not },
    { "RNN",                3, 6,   1, 2, kiln_infer_rnn },
    { "Reciprocal",        1, 1,   1, 1, kiln_infer_float_unary },
    { "ReduceLogSumExp",   1, 2,   1, 1, kiln_infer_reduce },
    { "Relu",               1, 1,   1, 1, s_infer_relu },
    { "Resize",             1, 4,   1, 1, kiln_infer_resize },
    { "Scatter",            3, 3,   1, 1, kiln_infer_scatter },
    { "ScatterElements",    3, 3,   1, 1, kiln_infer_scatter },
    { "ScatterND",          3, 3,   1, 1, kiln_infer_scatter },
    { "Selu",              1, 1,   1, 1, kiln_infer_float_unary },
    { "Sigmoid",           1, 1,   1, 1, kiln_infer_float_unary },
    { "Softmax",           1, 1,   1, 1, kiln_infer_softmax },
    { "SoftmaxCrossEntropyLoss", 2, 3, 1, 2, kiln_infer_nll },
    { "Softplus",          1, 1,   1, 1, kiln_infer_float_unary },
    { "Softsign",          1, 1,   1, 1, kiln_infer_float_unary },
    { "Sqrt",              1, 1,   1, 1, kiln_infer_float_unary },
    { "Tanh",              1, 1,   1, 1, kiln_infer_float_unary },
    { "TopK",               1, 2,   1, 2, kiln_infer_topk },
    { "Where",             3, 3,   1, 1, kiln_infer_where },
};
#define S_N_OPS ((int) (sizeof s_ops / sizeof s_ops[0]))

/* The data-movement ops of common/kiln_ops_shape.h, sorted there too. */
static const s_op_t s_shape_ops[] = {
#define S_ROW(X_, onnx, ilo, ihi, olo, ohi, infer, lower, kernel, exact) \
    { onnx, ilo, ihi, olo, ohi, infer },
    KILN_SHAPE_OPS (S_ROW, _)
#undef S_ROW
};
#define S_N_SHAPE_OPS ((int) (sizeof s_shape_ops / sizeof s_shape_ops[0]))

static int
s_op_cmp (const void *key, const void *elem)
{
    return strcmp ((const char *) key, ((const s_op_t *) elem)->op);
}

/* The ops of common/kiln_ops_unary.h, _binary.h, _reduce.h and
 * _arith.h, one row each there. */
static const s_op_t s_row_ops[] = {
#define S_ROW(X_, id, name, onnx, an, ad, bn, bd, expr) \
    { onnx, 1, 1, 1, 1, kiln_infer_float_unary },
    KILN_UNARY_OPS (S_ROW, _)
#undef S_ROW
#define S_ROW(X_, id, name, onnx, kind, expr) { onnx, 2, 2, 1, 1, kiln_infer_##kind },
    KILN_BINARY_OPS (S_ROW, _)
#undef S_ROW
#define S_ROW(X_, id, name, onnx, ex, i0, s0, f0, ints, i1, s1, f1) \
    { onnx, 1, 2, 1, 1, kiln_infer_reduce },
    KILN_REDUCE_OPS (S_ROW, _)
#undef S_ROW
#define S_ROW(X_, id, name, onnx, lo, nhi, khi, inf, low, ex, prep) \
    { onnx, lo, nhi, 1, 1, kiln_infer_##inf },
    KILN_ARITH_OPS (S_ROW, _)
#undef S_ROW
};

static const s_op_t *
s_op_find (const char *op)
{
    if (!op)
        return NULL;
    const s_op_t *o = bsearch (op, s_ops, S_N_OPS, sizeof s_ops[0], s_op_cmp);
    if (!o)
        o = bsearch (op, s_shape_ops, S_N_SHAPE_OPS, sizeof s_shape_ops[0], s_op_cmp);
    for (size_t i = 0; !o && i < sizeof s_row_ops / sizeof s_row_ops[0]; i++)
        if (strcmp (op, s_row_ops[i].op) == 0)
            o = &s_row_ops[i];
    return o;
}

bool
kiln_graph_op_supported (const char *op)
{
    /* Ops the folding pass evaluates (Shape, Range, ...) are known too:
     * they never reach inference unless their inputs are not constant. */
    return s_op_find (op) != NULL || kiln_fold_op_known (op);
}

/* --- validation ---------------------------------------------------- */

static const char *
s_tensor_name (const kiln_graph_t *g, int t, char *buf, size_t size)
{
    const char *name = g->tensors[t].name;
    if (name && *name)
        snprintf (buf, size, "'%s'", name);
    else
        snprintf (buf, size, "#%d", t);
    return buf;
}

/* Indices, bounds and weight sizes: the invariants kiln_graph.h lists
 * that do not depend on who produces what. */
static int
s_check_structure (const kiln_graph_t *g, kiln_err_t *err)
{
    /* Names are formatted only on the error paths: this runs over every
     * tensor and node of graphs with millions of them. */
    char tn[KILN_MAX_NAME + 8], label[S_LABEL_MAX];
#define S_TN s_tensor_name (g, t, tn, sizeof tn)
#define S_NL kiln_graph_node_label (g, n, label, sizeof label)
    if (g->n_tensors < 0 || g->n_tensors > KILN_MAX_TENSORS || g->n_nodes < 0
        || g->n_nodes > KILN_MAX_NODES || g->n_weights < 0 || g->n_weights > KILN_MAX_TENSORS
        || g->n_inputs < 0 || g->n_inputs > KILN_MAX_GRAPH_IO || g->n_outputs < 0
        || g->n_outputs > KILN_MAX_GRAPH_IO)
        return kiln_error (err, KILN_ELIMIT, "graph counts out of range");
    for (int t = 0; t < g->n_tensors; t++) {
        const kiln_tensor_t *tensor = &g->tensors[t];
        if (tensor->dtype != KILN_DT_UNDEFINED && !kiln_dtype_valid ((int) tensor->dtype))
            return kiln_error (err, KILN_EINVAL, "tensor %s has unknown dtype %d", S_TN,
                               (int) tensor->dtype);
        if (tensor->shape.rank >= 0) {
            int64_t numel;
            int rc = kiln_shape_numel (&tensor->shape, tensor->name, &numel, err);
            if (rc)
                return rc;
        }
        int w = tensor->weight;
        if (w < -1 || w >= g->n_weights)
            return kiln_error (err, KILN_EINVAL, "tensor %s: weight index %d out of range", S_TN, w);
        if (w >= 0) {
            uint64_t bytes;
            if (!kiln_dtype_valid ((int) tensor->dtype) || tensor->shape.rank < 0)
                return kiln_error (err, KILN_EINVAL, "weight tensor %s has no dtype or shape", S_TN);
            int rc = kiln_shape_bytes (&tensor->shape, tensor->dtype, tensor->name, &bytes, err);
            if (rc)
                return rc;
            if (bytes != g->weights[w].size)
                return kiln_error (err, KILN_ESHAPE, "weight tensor %s: %llu bytes, its dtype and shape need %llu",
                                   S_TN, (unsigned long long) g->weights[w].size,
                                   (unsigned long long) bytes);
        }
    }
    for (int n = 0; n < g->n_nodes; n++) {
        const kiln_node_t *node = &g->nodes[n];
        if (!node->op || !*node->op)
            return kiln_error (err, KILN_EINVAL, "%s has no op type", S_NL);
        if (node->n_inputs < 0 || node->n_inputs > KILN_MAX_NODE_IO || node->n_outputs < 0
            || node->n_outputs > KILN_MAX_NODE_IO || node->n_attrs < 0
            || node->n_attrs > KILN_MAX_ATTRS)
            return kiln_error (err, KILN_ELIMIT, "%s: input, output or attribute count out of range",
                               S_NL);
        for (int i = 0; i < node->n_inputs; i++)
            if (node->inputs[i] < -1 || node->inputs[i] >= g->n_tensors)
                return kiln_error (err, KILN_EINVAL, "%s: input %d is tensor index %d, out of range",
                                   S_NL, i, node->inputs[i]);
        for (int i = 0; i < node->n_outputs; i++)
            if (node->outputs[i] < 0 || node->outputs[i] >= g->n_tensors)
                return kiln_error (err, KILN_EINVAL, "%s: output %d is tensor index %d, out of range",
                                   S_NL, i, node->outputs[i]);
    }
    for (int i = 0; i < g->n_inputs; i++)
        if (g->inputs[i] < 0 || g->inputs[i] >= g->n_tensors)
            return kiln_error (err, KILN_EINVAL, "graph input %d is tensor index %d, out of range",
                               i, g->inputs[i]);
    for (int i = 0; i < g->n_outputs; i++)
        if (g->outputs[i] < 0 || g->outputs[i] >= g->n_tensors)
            return kiln_error (err, KILN_EINVAL, "graph output %d is tensor index %d, out of range",
                               i, g->outputs[i]);
#undef S_TN
#undef S_NL
    return 0;
}

/* Graph inputs and outputs are the model's interface, bound by name at
 * run time: each needs a name, unique within its list. */
static int
s_check_io_names (const kiln_graph_t *g, const int *list, int n, const char *what,
                  kiln_err_t *err)
{
    for (int i = 0; i < n; i++) {
        const char *name = g->tensors[list[i]].name;
        if (!name || !*name)
            return kiln_error (err, KILN_EINVAL, "graph %s %d (tensor #%d) has no name",
                               what, i, list[i]);
        for (int j = 0; j < i; j++)
            if (strcmp (name, g->tensors[list[j]].name) == 0)
                return kiln_error (err, KILN_EINVAL, "graph %s '%s' appears twice", what, name);
    }
    return 0;
}

enum { S_ROLE_INPUT = 1, S_ROLE_OUTPUT = 2 };

/* Who produces each tensor (producer[t] = node or -1), and the checks
 * that need it: one producer per tensor, none for inputs and weights,
 * one for every graph output, and every node input available. */
static int
s_check_producers (const kiln_graph_t *g, int *producer, uint8_t *role,
                   kiln_err_t *err)
{
    char tn[KILN_MAX_NAME + 8], l1[S_LABEL_MAX], l2[S_LABEL_MAX];
    for (int t = 0; t < g->n_tensors; t++)
        producer[t] = -1;
    for (int i = 0; i < g->n_inputs; i++)
        role[g->inputs[i]] |= S_ROLE_INPUT;
    for (int i = 0; i < g->n_outputs; i++)
        role[g->outputs[i]] |= S_ROLE_OUTPUT;
    for (int n = 0; n < g->n_nodes; n++) {
        const kiln_node_t *node = &g->nodes[n];
        for (int i = 0; i < node->n_outputs; i++) {
            int t = node->outputs[i];
            if (producer[t] >= 0)
                return kiln_error (err, KILN_EINVAL, "tensor %s is produced twice: by %s and by %s",
                                   s_tensor_name (g, t, tn, sizeof tn),
                                   kiln_graph_node_label (g, producer[t], l2, sizeof l2),
                                   kiln_graph_node_label (g, n, l1, sizeof l1));
            if (g->tensors[t].weight >= 0 || (role[t] & S_ROLE_INPUT))
                return kiln_error (err, KILN_EINVAL, "%s: output %s is a %s",
                                   kiln_graph_node_label (g, n, l1, sizeof l1),
                                   s_tensor_name (g, t, tn, sizeof tn),
                                   g->tensors[t].weight >= 0 ? "weight" : "graph input");
            producer[t] = n;
        }
    }
    for (int i = 0; i < g->n_inputs; i++) {
        int t = g->inputs[i];
        const kiln_tensor_t *tensor = &g->tensors[t];
        s_tensor_name (g, t, tn, sizeof tn);
        if (tensor->weight >= 0)
            return kiln_error (err, KILN_EINVAL, "graph input %s is a weight", tn);
        if (!kiln_dtype_valid ((int) tensor->dtype))
            return kiln_error (err, KILN_EINVAL, "graph input %s has no dtype", tn);
        if (tensor->shape.rank < 0)
            return kiln_error (err, KILN_EINVAL, "graph input %s has an unknown shape", tn);
    }
    for (int i = 0; i < g->n_outputs; i++)
        /* A graph output may be a constant: folding can make it one. */
        if (producer[g->outputs[i]] < 0 && g->tensors[g->outputs[i]].weight < 0)
            return kiln_error (err, KILN_EINVAL, "graph output %s is not produced by any node",
                               s_tensor_name (g, g->outputs[i], tn, sizeof tn));
    for (int n = 0; n < g->n_nodes; n++) {
        const kiln_node_t *node = &g->nodes[n];
        for (int i = 0; i < node->n_inputs; i++) {
            int t = node->inputs[i];
            if (t >= 0 && producer[t] < 0 && g->tensors[t].weight < 0
                && !(role[t] & S_ROLE_INPUT))
                return kiln_error (err, KILN_EINVAL,
                                   "%s: input %s is not a graph input, a weight or any node's output",
                                   kiln_graph_node_label (g, n, l1, sizeof l1),
                                   s_tensor_name (g, t, tn, sizeof tn));
        }
    }
    int rc = s_check_io_names (g, g->inputs, g->n_inputs, "input", err);
    if (rc)
        return rc;
    return s_check_io_names (g, g->outputs, g->n_outputs, "output", err);
}

/* A binary min-heap of node indices: Kahn's algorithm that always takes
 * the lowest-numbered ready node keeps the original order wherever it is
 * already topological. */
static void
s_heap_push (int *heap, int *n, int v)
{
    int i = (*n)++;
    while (i > 0 && heap[(i - 1) / 2] > v) {
        heap[i] = heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap[i] = v;
}

static int
s_heap_pop (int *heap, int *n)
{
    int top = heap[0], v = heap[--(*n)], i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && heap[c + 1] < heap[c])
            c++;
        if (heap[c] >= v)
            break;
        heap[i] = heap[c];
        i = c;
    }
    if (*n > 0)
        heap[i] = v;
    return top;
}

/* Report a cycle among the nodes `done` does not mark: walk from one of
 * them to the producer of an input that is also not done (there always is
 * one, or the node would have been ready) until a node repeats. */
static int
s_report_cycle (const kiln_graph_t *g, const int *producer, const bool *done,
                int *seen, int *path, kiln_err_t *err)
{
    int u = 0;
    while (done[u])
        u++;
    for (int n = 0; n < g->n_nodes; n++)
        seen[n] = -1;
    int len = 0;
    while (seen[u] < 0) {
        seen[u] = len;
        path[len++] = u;
        const kiln_node_t *node = &g->nodes[u];
        int next = -1;
        for (int i = 0; i < node->n_inputs && next < 0; i++) {
            int t = node->inputs[i];
            if (t >= 0 && producer[t] >= 0 && !done[producer[t]])
                next = producer[t];
        }
        if (next < 0)
            break;              /* cannot happen; stop rather than loop */
        u = next;
    }
    /* path[seen[u]..len) is the cycle, walked against the data flow. */
    char msg[KILN_ERR_MSG_MAX], label[S_LABEL_MAX];
    size_t used = (size_t) snprintf (msg, sizeof msg, "graph has a cycle:");
    int shown = 0;
    for (int k = len - 1; k >= seen[u] && used < sizeof msg; k--, shown++) {
        if (shown == 6) {
            used += (size_t) snprintf (msg + used, sizeof msg - used, " -> ...");
            break;
        }
        used += (size_t) snprintf (msg + used, sizeof msg - used, "%s %s",
                                   shown ? " ->" : "",
                                   kiln_graph_node_label (g, path[k], label, sizeof label));
    }
    if (used < sizeof msg && shown < 6)
        snprintf (msg + used, sizeof msg - used, " -> %s",
                  kiln_graph_node_label (g, path[len - 1], label, sizeof label));
    return kiln_error (err, KILN_EINVAL, "%s", msg);
}

/* Stable topological order of the nodes into order[n_nodes]. */
static int
s_toposort (const kiln_graph_t *g, const int *producer, int *order, kiln_err_t *err)
{
    int rc = 0;
    size_t nn = (size_t) g->n_nodes + 1, nt = (size_t) g->n_tensors + 1;
    int *indeg = calloc (nn, sizeof *indeg);
    int *heap = malloc (nn * sizeof *heap);
    int *start = calloc (nt + 1, sizeof *start);   /* consumers of t: cons[start[t]..start[t+1]) */
    int *cons = NULL;
    bool *done = calloc (nn, sizeof *done);
    if (!indeg || !heap || !start || !done)
        goto nomem;
    size_t n_edges = 0;
    for (int n = 0; n < g->n_nodes; n++)
        for (int i = 0; i < g->nodes[n].n_inputs; i++) {
            int t = g->nodes[n].inputs[i];
            if (t >= 0 && producer[t] >= 0) {
                indeg[n]++;
                start[t + 1]++;
                n_edges++;
            }
        }
    for (int t = 0; t < g->n_tensors; t++)
        start[t + 1] += start[t];
    cons = malloc ((n_edges + 1) * sizeof *cons);
    if (!cons)
        goto nomem;
    /* Fill consumer lists; `pos` walks each tensor's slice. */
    int *pos = malloc (nt * sizeof *pos);
    if (!pos)
        goto nomem;
    memcpy (pos, start, (size_t) g->n_tensors * sizeof *pos);
    for (int n = 0; n < g->n_nodes; n++)
        for (int i = 0; i < g->nodes[n].n_inputs; i++) {
            int t = g->nodes[n].inputs[i];
            if (t >= 0 && producer[t] >= 0)
                cons[pos[t]++] = n;
        }
    free (pos);

    int n_heap = 0, n_done = 0;
    for (int n = 0; n < g->n_nodes; n++)
        if (indeg[n] == 0)
            s_heap_push (heap, &n_heap, n);
    while (n_heap > 0) {
        int n = s_heap_pop (heap, &n_heap);
        done[n] = true;
        order[n_done++] = n;
        const kiln_node_t *node = &g->nodes[n];
        for (int i = 0; i < node->n_outputs; i++) {
            int t = node->outputs[i];
            for (int e = start[t]; e < start[t + 1]; e++)
                if (--indeg[cons[e]] == 0)
                    s_heap_push (heap, &n_heap, cons[e]);
        }
    }
    if (n_done < g->n_nodes)
        /* indeg and heap are free to reuse as scratch now */
        rc = s_report_cycle (g, producer, done, indeg, heap, err);
    goto out;
nomem:
    rc = kiln_error (err, KILN_ENOMEM, "out of memory sorting %d nodes", g->n_nodes);
out:
    free (indeg);
    free (heap);
    free (start);
    free (cons);
    free (done);
    return rc;
}

/* "2" or "2 to 3". */
static const char *
s_count_range (int lo, int hi, char *buf, size_t size)
{
    if (lo == hi)
        snprintf (buf, size, "%d", lo);
    else
        snprintf (buf, size, "%d to %d", lo, hi);
    return buf;
}

/* Check node n's input and output counts against its op, then infer. */
static int
s_infer_node (const kiln_graph_t *g, int n, s_type_t *types,
              const s_type_t **in, s_type_t **out, kiln_err_t *err)
{
    const kiln_node_t *node = &g->nodes[n];
    char label[S_LABEL_MAX];
    kiln_graph_node_label (g, n, label, sizeof label);
    for (int i = 0; i < node->n_inputs; i++)
        in[i] = node->inputs[i] >= 0 ? &types[node->inputs[i]] : NULL;
    for (int i = 0; i < node->n_outputs; i++)
        out[i] = &types[node->outputs[i]];
    s_ctx_t ctx = { .g = g, .node = node, .label = label, .in = in,
                    .n_in = node->n_inputs, .out = out, .err = err };
    char range[32];
    const s_op_t *op = s_op_find (node->op);
    if (!op && kiln_fold_op_known (node->op))
        return kiln_fold_refuse (g, n, label, err);
    if (!op)
        return kiln_error (err, KILN_EUNSUPPORTED, "%s: unsupported op '%s'", label, node->op);
    if (node->n_inputs < op->min_in || node->n_inputs > op->max_in)
        return s_fail (&ctx, KILN_EINVAL, "has %d input%s, expected %s", node->n_inputs,
                       node->n_inputs == 1 ? "" : "s",
                       s_count_range (op->min_in, op->max_in, range, sizeof range));
    for (int i = 0; i < op->min_in; i++)
        if (node->inputs[i] < 0)
            return s_fail (&ctx, KILN_EINVAL, "required input %d is missing", i);
    if (node->n_outputs < op->min_out || node->n_outputs > op->max_out)
        return s_fail (&ctx, KILN_EINVAL, "has %d output%s, expected %s", node->n_outputs,
                       node->n_outputs == 1 ? "" : "s",
                       s_count_range (op->min_out, op->max_out, range, sizeof range));
    for (int i = 0; i < node->n_inputs; i++) {
        int t = node->inputs[i];
        /* Producers come first in topological order and graph inputs and
         * weights were checked, so this only guards the invariant. */
        if (t >= 0 && (!kiln_dtype_valid ((int) types[t].dtype) || types[t].shape.rank < 0)) {
            char nb[KILN_MAX_NAME + 16];
            return s_fail (&ctx, KILN_EINVAL, "%s has no known dtype and shape",
                           s_in_name (&ctx, i, nb, sizeof nb));
        }
    }
    int rc = op->infer (&ctx);
    if (rc)
        return rc;
    for (int i = 0; i < node->n_outputs; i++) {
        int t = node->outputs[i];
        const s_type_t *got = &types[t];
        const kiln_tensor_t *declared = &g->tensors[t];
        char tn[KILN_MAX_NAME + 8], s1[S_SHAPE_MAX], s2[S_SHAPE_MAX];
        if (!kiln_dtype_valid ((int) got->dtype) || got->shape.rank < 0)
            return s_fail (&ctx, KILN_EINVAL, "internal error: output %s was not inferred",
                           s_tensor_name (g, t, tn, sizeof tn));
        int64_t numel;
        if ((rc = kiln_shape_numel (&got->shape, declared->name, &numel, err)))
            return kiln_error_prefix (err, "%s", label);
        if ((declared->dtype != KILN_DT_UNDEFINED && declared->dtype != got->dtype)
            || (declared->shape.rank >= 0 && !kiln_shape_equal (&declared->shape, &got->shape)))
            return s_fail (&ctx, KILN_ESHAPE, "output %s is declared %s %s but inferred %s %s",
                           s_tensor_name (g, t, tn, sizeof tn), kiln_dtype_name (declared->dtype), s_shape (&declared->shape, s1),
                           kiln_dtype_name (got->dtype), s_shape (&got->shape, s2));
    }
    return 0;
}

int
kiln_graph_validate (kiln_graph_t *g, kiln_err_t *err)
{
    int *producer = NULL, *order = NULL;
    uint8_t *role = NULL;
    s_type_t *types = NULL, **outs = NULL;
    const s_type_t **ins = NULL;
    kiln_node_t *sorted = NULL;
    int rc;
    for (int i = 1; i < S_N_OPS; i++)
        if (strcmp (s_ops[i - 1].op, s_ops[i].op) >= 0)
            return kiln_error (err, KILN_EINVAL, "internal error: op table not sorted at '%s'",
                               s_ops[i].op);
    for (int i = 1; i < S_N_SHAPE_OPS; i++)
        if (strcmp (s_shape_ops[i - 1].op, s_shape_ops[i].op) >= 0)
            return kiln_error (err, KILN_EINVAL, "internal error: KILN_SHAPE_OPS not "
                               "sorted at '%s'", s_shape_ops[i].op);
    if ((rc = s_check_structure (g, err)))
        return rc;
    size_t nt = (size_t) g->n_tensors + 1, nn = (size_t) g->n_nodes + 1;
    producer = malloc (nt * sizeof *producer);
    role = calloc (nt, sizeof *role);
    order = malloc (nn * sizeof *order);
    types = malloc (nt * sizeof *types);
    sorted = malloc (nn * sizeof *sorted);
    ins = malloc (KILN_MAX_NODE_IO * sizeof *ins);
    outs = malloc (KILN_MAX_NODE_IO * sizeof *outs);
    if (!producer || !role || !order || !types || !sorted || !ins || !outs) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory validating the graph");
        goto out;
    }
    if ((rc = s_check_producers (g, producer, role, err)))
        goto out;
    if ((rc = s_toposort (g, producer, order, err)))
        goto out;
    for (int t = 0; t < g->n_tensors; t++) {
        types[t].dtype = producer[t] >= 0 ? KILN_DT_UNDEFINED : g->tensors[t].dtype;
        types[t].shape = g->tensors[t].shape;
        if (producer[t] >= 0)
            types[t].shape.rank = -1;
    }
    for (int k = 0; k < g->n_nodes; k++)
        if ((rc = s_infer_node (g, order[k], types, ins, outs, err)))
            goto out;

    /* Commit: everything past this point cannot fail. */
    for (int k = 0; k < g->n_nodes; k++)
        sorted[k] = g->nodes[order[k]];
    if (g->n_nodes > 0)
        memcpy (g->nodes, sorted, (size_t) g->n_nodes * sizeof *sorted);
    for (int t = 0; t < g->n_tensors; t++)
        if (producer[t] >= 0) {
            g->tensors[t].dtype = types[t].dtype;
            g->tensors[t].shape = types[t].shape;
        }
out:
    free (producer);
    free (role);
    free (order);
    free (types);
    free (sorted);
    free (ins);
    free (outs);
    return rc;
}

int
kiln_graph_window (const kiln_graph_t *g, int n, kiln_window_t *w, kiln_err_t *err)
{
    if (n < 0 || n >= g->n_nodes)
        return kiln_error (err, KILN_EINVAL, "no node with index %d", n);
    const kiln_node_t *node = &g->nodes[n];
    char label[S_LABEL_MAX];
    kiln_graph_node_label (g, n, label, sizeof label);
    bool conv = node->op && strcmp (node->op, "Conv") == 0;
    bool pool = node->op && (strcmp (node->op, "MaxPool") == 0
                             || strcmp (node->op, "AveragePool") == 0);
    if (!conv && !pool)
        return kiln_error (err, KILN_EINVAL, "%s has no sliding window", label);
    /* Run the inference code itself on copies of the input types, so
     * that the window is exactly the one validation used. */
    int need = conv ? 2 : 1, n_in = node->n_inputs < 3 ? node->n_inputs : 3;
    s_type_t types[3];
    const s_type_t *in[3] = { NULL, NULL, NULL };
    for (int i = 0; i < n_in; i++) {
        int t = node->inputs[i];
        if (t < -1 || t >= g->n_tensors)
            return kiln_error (err, KILN_EINVAL, "%s: input %d is out of range", label, i);
        if (t < 0)
            continue;
        types[i].dtype = g->tensors[t].dtype;
        types[i].shape = g->tensors[t].shape;
        if (types[i].shape.rank < 0 || !kiln_dtype_valid ((int) types[i].dtype))
            return kiln_error (err, KILN_EINVAL, "%s: input %d has no known shape (validate the graph first)",
                               label, i);
        in[i] = &types[i];
    }
    for (int i = 0; i < need; i++)
        if (!in[i])
            return kiln_error (err, KILN_EINVAL, "%s: required input %d is missing", label, i);
    s_ctx_t ctx = { .g = g, .node = node, .label = label, .in = in, .n_in = n_in,
                    .out = NULL, .err = err };
    kiln_shape_t y;
    return conv ? s_conv_window (&ctx, w, &y) : s_pool_window (&ctx, w, &y);
}

/* --- node by node, for the folding pass (kiln_infer.h) -------------- */

int
kiln_infer_order (const kiln_graph_t *g, int *order, kiln_err_t *err)
{
    int rc = s_check_structure (g, err);
    if (rc)
        return rc;
    size_t nt = (size_t) g->n_tensors + 1;
    int *producer = malloc (nt * sizeof *producer);
    uint8_t *role = calloc (nt, sizeof *role);
    if (!producer || !role)
        rc = kiln_error (err, KILN_ENOMEM, "out of memory sorting the graph");
    else if (!(rc = s_check_producers (g, producer, role, err)))
        rc = s_toposort (g, producer, order, err);
    free (producer);
    free (role);
    return rc;
}

int
kiln_infer_node (const kiln_graph_t *g, int n, kiln_infer_type_t *types,
                 kiln_err_t *err)
{
    const s_type_t **ins = malloc (KILN_MAX_NODE_IO * sizeof *ins);
    s_type_t **outs = malloc (KILN_MAX_NODE_IO * sizeof *outs);
    int rc = ins && outs ? s_infer_node (g, n, types, ins, outs, err)
                         : kiln_error (err, KILN_ENOMEM, "out of memory inferring shapes");
    free (ins);
    free (outs);
    return rc;
}
