/*
 * kiln_fold — compile-time folding: every node whose value is known
 * before the model runs becomes a weight.
 *
 * Exported transformers compute their reshape targets from the model's
 * own shapes (Shape -> Gather -> Unsqueeze -> Concat -> Reshape).  kiln
 * compiles for fixed shapes, so all of that is known at compile time:
 * the pass walks the nodes once in topological order, inferring each
 * node's output types as kiln_graph_validate does, and evaluates a node
 * instead when it can:
 *   - Shape and Size as soon as their input's shape is known;
 *   - any node of an op this file evaluates (the table s_fold_ops) whose
 *     inputs are all constants with their data, when each output holds
 *     at most KILN_FOLD_MAX_ELEMS elements and the pass's budget (below)
 *     has room for them.
 * An evaluated node's outputs become weights at once, so the nodes after
 * it (a Reshape reading the folded shape, a Shape of a folded tensor) see
 * constants.  Folded nodes are then removed, so are nodes nothing uses
 * (dead code), and weights no remaining node reads; the graph is
 * validated at the end.
 *
 * Every folded output stays in memory until the end of the pass, so the
 * pass counts the bytes it materialises against KILN_MAX_FOLD_BYTES
 * (kiln_fold.h): a hostile chain of ConstantOfShape and Adds would
 * otherwise take 4 MiB per node, gigabytes in all.  Past the budget,
 * nodes are left to run; shape arithmetic keeps a reserve.
 *
 * The evaluator here is small and exact for what shape arithmetic needs:
 * integer and float elementwise ops with numpy broadcasting, comparisons,
 * Where, Cast, Range, ConstantOfShape, reductions, NonZero, and the data
 * movement ops (Gather, Concat, Slice, Split, Transpose, Expand, Tile,
 * Reshape and friends) on any dtype.  It does not link the runtime: the
 * compiler must not (ARCHITECTURE.md), and import needs it too.  Float32
 * arithmetic is done in double and rounded once, which gives the same
 * bits as float32 arithmetic for + - * / and sqrt.
 */
#include "graph/kiln_fold.h"
#include "common/kiln_half.h"
#include "graph/kiln_infer.h"
#include "graph/kiln_shape_ops.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define S_MAX_OUT 64            /* outputs of a node the evaluator folds */

enum {
    S_NOT_FOLDED = 0,           /* leave the node to inference */
    S_FOLDED = 1,               /* outputs are weights now */
    S_INFERRED = 2,             /* not folded, but already inferred */
};

/* A value: a tensor's dtype, shape and bytes (little-endian). */
typedef struct {
    kiln_dtype_t dt;
    kiln_shape_t shape;
    int64_t n;                  /* elements */
    const uint8_t *data;        /* NULL for a Shape/Size input */
} s_val_t;

/* One node being evaluated. */
typedef struct {
    kiln_graph_t *g;
    int node_index;
    const kiln_node_t *node;
    const char *label;
    s_val_t *in;                /* [n_in], absent inputs have dt 0 */
    int n_in;
    kiln_infer_type_t *types;   /* per tensor */
    kiln_dtype_t out_dt[S_MAX_OUT];
    kiln_shape_t out_shape[S_MAX_OUT];
    uint8_t *out[S_MAX_OUT];    /* owned until handed to the graph */
    int n_out;
    uint64_t pending;           /* bytes of out[] allocated so far */
    uint64_t *spent;            /* bytes the pass has materialised before this node */
    kiln_err_t *err;
} s_fold_t;

typedef int (*s_eval_fn) (s_fold_t *f);

typedef struct {
    const char *op;
    s_eval_fn eval;             /* NULL: known but never evaluated */
    bool typed_by_table;        /* output types come from the op table */
    bool shape_only;            /* needs its input's shape, not its data */
    const char *refusal;        /* why it cannot stay in a compiled graph */
} s_fold_op_t;

static const s_fold_op_t *s_fold_find (const char *op);

static int
s_fail (s_fold_t *f, int code, const char *fmt, ...)
    __attribute__ ((format (printf, 3, 4)));

static int
s_fail (s_fold_t *f, int code, const char *fmt, ...)
{
    char msg[KILN_ERR_MSG_MAX];
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (msg, sizeof msg, fmt, ap);
    va_end (ap);
    return kiln_error (f->err, code, "%s: %s", f->label, msg);
}

static int
s_prefixed (s_fold_t *f, int rc)
{
    return rc ? kiln_error_prefix (f->err, "%s", f->label) : 0;
}

/* --- elements ------------------------------------------------------- */

static bool
s_is_float (kiln_dtype_t dt)
{
    return dt == KILN_DT_FLOAT32 || dt == KILN_DT_FLOAT64 || kiln_dtype_is_half (dt);
}

static size_t
s_esz (kiln_dtype_t dt)
{
    return kiln_dtype_size (dt);
}

static double
s_getf (const s_val_t *v, int64_t i)
{
    const uint8_t *p = v->data + (size_t) i * s_esz (v->dt);
    switch (v->dt) {
    case KILN_DT_FLOAT32: { float x; memcpy (&x, p, 4); return x; }
    case KILN_DT_FLOAT64: { double x; memcpy (&x, p, 8); return x; }
    case KILN_DT_FLOAT16: { uint16_t x; memcpy (&x, p, 2); return kiln_f16_to_f32 (x); }
    case KILN_DT_BFLOAT16: { uint16_t x; memcpy (&x, p, 2); return kiln_bf16_to_f32 (x); }
    case KILN_DT_INT64: { int64_t x; memcpy (&x, p, 8); return (double) x; }
    case KILN_DT_INT32: { int32_t x; memcpy (&x, p, 4); return x; }
    case KILN_DT_INT8: return (int8_t) *p;
    case KILN_DT_UINT8: case KILN_DT_BOOL: return *p;
    default: return 0.0;
    }
}

static int64_t
s_geti (const s_val_t *v, int64_t i)
{
    const uint8_t *p = v->data + (size_t) i * s_esz (v->dt);
    switch (v->dt) {
    case KILN_DT_INT64: { int64_t x; memcpy (&x, p, 8); return x; }
    case KILN_DT_INT32: { int32_t x; memcpy (&x, p, 4); return x; }
    case KILN_DT_INT8: return (int8_t) *p;
    case KILN_DT_UINT8: case KILN_DT_BOOL: return *p;
    default: {
        /* A float read as an integer truncates toward zero, saturating. */
        double x = s_getf (v, i);
        if (isnan (x))
            return 0;
        if (x >= 9.2233720368547758e18)
            return INT64_MAX;
        if (x <= -9.2233720368547758e18)
            return INT64_MIN;
        return (int64_t) x;
    }
    }
}

static void
s_setf (kiln_dtype_t dt, uint8_t *base, int64_t i, double x)
{
    uint8_t *p = base + (size_t) i * s_esz (dt);
    switch (dt) {
    case KILN_DT_FLOAT32: { float y = (float) x; memcpy (p, &y, 4); break; }
    case KILN_DT_FLOAT64: memcpy (p, &x, 8); break;
    case KILN_DT_FLOAT16: { uint16_t y = kiln_f32_to_f16 ((float) x); memcpy (p, &y, 2); break; }
    case KILN_DT_BFLOAT16: { uint16_t y = kiln_f32_to_bf16 ((float) x); memcpy (p, &y, 2); break; }
    case KILN_DT_BOOL: *p = x != 0.0; break;
    default: {
        s_val_t tmp = { .dt = KILN_DT_FLOAT64, .data = (const uint8_t *) &x };
        int64_t v = s_geti (&tmp, 0);
        switch (dt) {
        case KILN_DT_INT64: memcpy (p, &v, 8); break;
        case KILN_DT_INT32: { int32_t y = (int32_t) (uint32_t) (uint64_t) v; memcpy (p, &y, 4); break; }
        default: *p = (uint8_t) (uint64_t) v; break;
        }
    }
    }
}

static void
s_seti (kiln_dtype_t dt, uint8_t *base, int64_t i, int64_t v)
{
    uint8_t *p = base + (size_t) i * s_esz (dt);
    switch (dt) {
    case KILN_DT_INT64: memcpy (p, &v, 8); break;
    case KILN_DT_INT32: { int32_t y = (int32_t) (uint32_t) (uint64_t) v; memcpy (p, &y, 4); break; }
    case KILN_DT_INT8: case KILN_DT_UINT8: *p = (uint8_t) (uint64_t) v; break;
    case KILN_DT_BOOL: *p = v != 0; break;
    default: s_setf (dt, base, i, (double) v); break;
    }
}

/* Allocate output k of `dt` and `shape`; refuses past the fold limit
 * or the pass's budget with S_NOT_FOLDED, except for an op only folding
 * knows, which cannot be left to run: that is an error naming the
 * budget. */
static int
s_out (s_fold_t *f, int k, kiln_dtype_t dt, const kiln_shape_t *shape)
{
    int64_t n;
    int rc = kiln_shape_numel (shape, "folded output", &n, f->err);
    if (rc)
        return s_prefixed (f, rc);
    if (n > KILN_FOLD_MAX_ELEMS)
        return S_NOT_FOLDED;
    uint64_t bytes = (uint64_t) n * s_esz (dt);
    uint64_t budget = bytes <= KILN_FOLD_SMALL_BYTES ? KILN_MAX_FOLD_BYTES
                      : KILN_MAX_FOLD_BYTES - KILN_FOLD_RESERVE_BYTES;
    if (*f->spent + f->pending + bytes > budget) {
        const s_fold_op_t *fo = s_fold_find (f->node->op);
        if (fo && fo->refusal)
            return s_fail (f, KILN_ELIMIT, "its %llu-byte result does not fit in what is left "
                           "of constant folding's budget (%u MiB per graph, "
                           "KILN_MAX_FOLD_BYTES: %llu bytes already folded), and %s is "
                           "evaluated at compile time only", (unsigned long long) bytes,
                           KILN_MAX_FOLD_BYTES >> 20, (unsigned long long) *f->spent,
                           f->node->op);
        return S_NOT_FOLDED;
    }
    f->pending += bytes;
    f->out_dt[k] = dt;
    f->out_shape[k] = *shape;
    f->out[k] = calloc ((size_t) n * s_esz (dt) + 1, 1);
    if (!f->out[k])
        return s_fail (f, KILN_ENOMEM, "out of memory folding %lld elements", (long long) n);
    if (k >= f->n_out)
        f->n_out = k + 1;
    return S_FOLDED;
}

/* Output k with the type the op table inferred. */
static int
s_out_typed (s_fold_t *f, int k)
{
    const kiln_infer_type_t *t = &f->types[f->node->outputs[k]];
    return s_out (f, k, t->dtype, &t->shape);
}

/* Flat index into `in` (broadcast to `out`'s rank, numpy style) of the
 * element at flat index i of `out`. */
static int64_t
s_bcast_index (const kiln_shape_t *out, const kiln_shape_t *in, int64_t i)
{
    int64_t idx = 0, mul = 1;
    for (int d = out->rank - 1, e = in->rank - 1; d >= 0; d--, e--) {
        int64_t c = i % out->dims[d];
        i /= out->dims[d];
        if (e >= 0) {
            if (in->dims[e] != 1)
                idx += c * mul;
            mul *= in->dims[e];
        }
    }
    return idx;
}

static int
s_broadcast (s_fold_t *f, const s_val_t *const *v, int n, kiln_shape_t *out)
{
    int r = 0;
    for (int k = 0; k < n; k++)
        if (v[k]->shape.rank > r)
            r = v[k]->shape.rank;
    out->rank = r;
    for (int i = 0; i < r; i++) {
        int64_t d = 1;
        for (int k = 0; k < n; k++) {
            int j = i - (r - v[k]->shape.rank);
            int64_t dk = j >= 0 ? v[k]->shape.dims[j] : 1;
            if (dk == d || dk == 1)
                continue;
            if (d != 1) {
                char s1[160], s2[160];
                return s_fail (f, KILN_ESHAPE, "cannot broadcast %s with %s",
                               kiln_shape_str (&v[0]->shape, s1, sizeof s1),
                               kiln_shape_str (&v[k]->shape, s2, sizeof s2));
            }
            d = dk;
        }
        out->dims[i] = d;
    }
    return 0;
}

/* --- shape queries --------------------------------------------------- */

static int
s_eval_shape (s_fold_t *f)
{
    const kiln_shape_t *x = &f->in[0].shape;
    int start, end, rc;
    if ((rc = kiln_shape_range (f->node, x->rank, &start, &end, f->err)))
        return s_prefixed (f, rc);
    kiln_shape_t s = { .rank = 1, .dims = { end - start } };
    if ((rc = s_out (f, 0, KILN_DT_INT64, &s)) != S_FOLDED)
        return rc;
    for (int i = start; i < end; i++)
        s_seti (KILN_DT_INT64, f->out[0], i - start, x->dims[i]);
    return S_FOLDED;
}

static int
s_eval_size (s_fold_t *f)
{
    kiln_shape_t s = { .rank = 0 };
    int rc = s_out (f, 0, KILN_DT_INT64, &s);
    if (rc != S_FOLDED)
        return rc;
    s_seti (KILN_DT_INT64, f->out[0], 0, kiln_shape_count (&f->in[0].shape));
    return S_FOLDED;
}

/* --- data movement (types from the op table) ------------------------ */

/* Y = X byte for byte (Identity, Reshape, Flatten, Squeeze, Unsqueeze). */
static int
s_eval_view (s_fold_t *f)
{
    int rc = s_out_typed (f, 0);
    if (rc != S_FOLDED)
        return rc;
    memcpy (f->out[0], f->in[0].data, (size_t) f->in[0].n * s_esz (f->in[0].dt));
    return S_FOLDED;
}

/* Y[i] = X[offset + sum of i_k * st_k] over Y's shape `loop`. */
static void
s_gather_strided (const s_val_t *x, uint8_t *y, const kiln_shape_t *loop,
                  int64_t offset, const int64_t *st)
{
    size_t es = s_esz (x->dt);
    int64_t n = kiln_shape_count (loop);
    for (int64_t i = 0; i < n; i++) {
        int64_t rem = i, src = offset;
        for (int d = loop->rank - 1; d >= 0; d--) {
            src += (rem % loop->dims[d]) * st[d];
            rem /= loop->dims[d];
        }
        memcpy (y + (size_t) i * es, x->data + (size_t) src * es, es);
    }
}

static int
s_eval_transpose (s_fold_t *f)
{
    const s_val_t *x = &f->in[0];
    int64_t perm[KILN_MAX_RANK], st[KILN_MAX_RANK], pst[KILN_MAX_RANK];
    int rc = kiln_transpose_perm (f->g, f->node, x->shape.rank, perm, f->err);
    if (rc)
        return s_prefixed (f, rc);
    if ((rc = s_out_typed (f, 0)) != S_FOLDED)
        return rc;
    kiln_shape_strides (&x->shape, st);
    for (int i = 0; i < x->shape.rank; i++)
        pst[i] = st[perm[i]];
    s_gather_strided (x, f->out[0], &f->out_shape[0], 0, pst);
    return S_FOLDED;
}

static int
s_eval_slice (s_fold_t *f)
{
    const s_val_t *x = &f->in[0];
    int64_t start[KILN_MAX_RANK], step[KILN_MAX_RANK], st[KILN_MAX_RANK];
    kiln_shape_t y;
    int rc = kiln_slice_params (f->g, f->node, &x->shape, start, step, &y, f->err);
    if (rc)
        return s_prefixed (f, rc);
    if ((rc = s_out_typed (f, 0)) != S_FOLDED)
        return rc;
    kiln_shape_strides (&x->shape, st);
    int64_t offset = 0;
    for (int i = 0; i < x->shape.rank; i++) {
        offset += start[i] * st[i];
        st[i] *= step[i];
    }
    s_gather_strided (x, f->out[0], &y, offset, st);
    return S_FOLDED;
}

static int
s_eval_split (s_fold_t *f)
{
    const s_val_t *x = &f->in[0];
    int64_t sizes[KILN_MAX_NODE_IO], st[KILN_MAX_RANK];
    int axis, rc;
    if (f->node->n_outputs > S_MAX_OUT)
        return S_NOT_FOLDED;
    if ((rc = kiln_split_sizes (f->g, f->node, &x->shape, &axis, sizes, f->err)))
        return s_prefixed (f, rc);
    kiln_shape_strides (&x->shape, st);
    int64_t at = 0;
    for (int k = 0; k < f->node->n_outputs; k++) {
        if ((rc = s_out_typed (f, k)) != S_FOLDED)
            return rc;
        s_gather_strided (x, f->out[k], &f->out_shape[k], at * st[axis], st);
        at += sizes[k];
    }
    return S_FOLDED;
}

static int
s_eval_concat (s_fold_t *f)
{
    int rc = s_out_typed (f, 0);
    if (rc != S_FOLDED)
        return rc;
    const kiln_shape_t *y = &f->out_shape[0];
    int64_t axis = kiln_node_attr_int (f->node, "axis", 0);
    if (axis < 0)
        axis += y->rank;
    int64_t outer = 1, inner = 1;
    for (int i = 0; i < axis; i++)
        outer *= y->dims[i];
    for (int i = (int) axis + 1; i < y->rank; i++)
        inner *= y->dims[i];
    size_t es = s_esz (f->out_dt[0]);
    uint8_t *p = f->out[0];
    for (int64_t o = 0; o < outer; o++)
        for (int k = 0; k < f->n_in; k++) {
            size_t chunk = (size_t) (f->in[k].shape.dims[axis] * inner) * es;
            memcpy (p, f->in[k].data + (size_t) o * chunk, chunk);
            p += chunk;
        }
    return S_FOLDED;
}

static int
s_eval_gather (s_fold_t *f)
{
    const s_val_t *x = &f->in[0], *ind = &f->in[1];
    int rc = s_out_typed (f, 0);
    if (rc != S_FOLDED)
        return rc;
    int64_t axis = kiln_node_attr_int (f->node, "axis", 0);
    if (axis < 0)
        axis += x->shape.rank;
    int64_t outer = 1, inner = 1, d = x->shape.dims[axis];
    for (int i = 0; i < axis; i++)
        outer *= x->shape.dims[i];
    for (int i = (int) axis + 1; i < x->shape.rank; i++)
        inner *= x->shape.dims[i];
    size_t es = s_esz (x->dt), chunk = (size_t) inner * es;
    uint8_t *p = f->out[0];
    for (int64_t o = 0; o < outer; o++)
        for (int64_t j = 0; j < ind->n; j++) {
            int64_t k = s_geti (ind, j);
            if (k < -d || k >= d)
                return s_fail (f, KILN_EINVAL, "index %lld is out of range for axis %lld of size %lld",
                               (long long) k, (long long) axis, (long long) d);
            if (k < 0)
                k += d;
            memcpy (p, x->data + (size_t) ((o * d + k) * inner) * es, chunk);
            p += chunk;
        }
    return S_FOLDED;
}

/* Expand and Tile: Y[i] = X[j] where each coordinate of j is i's, 0 on a
 * broadcast axis (Expand) or i's modulo X's size (Tile). */
static int
s_eval_expand_tile (s_fold_t *f)
{
    const s_val_t *x = &f->in[0];
    bool tile = strcmp (f->node->op, "Tile") == 0;
    int rc = s_out_typed (f, 0);
    if (rc != S_FOLDED)
        return rc;
    const kiln_shape_t *y = &f->out_shape[0];
    size_t es = s_esz (x->dt);
    int64_t n = kiln_shape_count (y), st[KILN_MAX_RANK];
    kiln_shape_strides (&x->shape, st);
    for (int64_t i = 0; i < n; i++) {
        int64_t rem = i, src = 0;
        for (int dd = y->rank - 1, e = x->shape.rank - 1; dd >= 0; dd--, e--) {
            int64_t c = rem % y->dims[dd];
            rem /= y->dims[dd];
            if (e < 0)
                continue;
            int64_t xd = x->shape.dims[e];
            src += (tile ? c % xd : xd == 1 ? 0 : c) * st[e];
        }
        memcpy (f->out[0] + (size_t) i * es, x->data + (size_t) src * es, es);
    }
    return S_FOLDED;
}

/* --- constants from nothing ------------------------------------------ */

static int
s_eval_constant_of_shape (s_fold_t *f)
{
    int64_t dims[KILN_MAX_RANK];
    int n;
    int rc = kiln_const_ints (f->g, f->node, 0, "shape", KILN_MAX_RANK, dims, &n, f->err);
    if (rc)
        return s_prefixed (f, rc);
    kiln_shape_t s = { .rank = n };
    for (int i = 0; i < n; i++) {
        if (dims[i] < 0 || dims[i] > KILN_MAX_DIM)
            return s_fail (f, KILN_ESHAPE, "shape[%d] is %lld", i, (long long) dims[i]);
        s.dims[i] = dims[i];
    }
    /* The importer turns the TENSOR attribute `value` into value_dtype
     * and an int or float `value` (docs/graph-format.md). */
    kiln_dtype_t dt = (kiln_dtype_t) kiln_node_attr_int (f->node, "value_dtype", KILN_DT_FLOAT32);
    if (!kiln_dtype_valid ((int) dt))
        return s_fail (f, KILN_EFORMAT, "attribute 'value_dtype' is %d, not a kiln dtype", (int) dt);
    const kiln_attr_t *v = kiln_node_attr (f->node, "value");
    if ((rc = s_out (f, 0, dt, &s)) != S_FOLDED)
        return rc == S_NOT_FOLDED
               ? s_fail (f, KILN_ELIMIT, "the constant would have more than %d elements",
                         KILN_FOLD_MAX_ELEMS)
               : rc;
    int64_t count = kiln_shape_count (&s);
    for (int64_t i = 0; i < count; i++) {
        if (v && v->kind == KILN_ATTR_INT)
            s_seti (dt, f->out[0], i, v->i);
        else
            s_setf (dt, f->out[0], i, v && v->kind == KILN_ATTR_FLOAT ? v->f : 0.0);
    }
    return S_FOLDED;
}

static int
s_eval_range (s_fold_t *f)
{
    for (int k = 0; k < 3; k++)
        if (f->in[k].n != 1)
            return s_fail (f, KILN_ESHAPE, "input %d must be a scalar", k);
    kiln_dtype_t dt = f->in[0].dt;
    int64_t count;
    if (s_is_float (dt)) {
        double a = s_getf (&f->in[0], 0), b = s_getf (&f->in[1], 0), d = s_getf (&f->in[2], 0);
        if (d == 0.0 || !isfinite (a) || !isfinite (b) || !isfinite (d))
            return s_fail (f, KILN_EINVAL, "start, limit and delta must be finite, delta not 0");
        double c = ceil ((b - a) / d);
        if (c > (double) KILN_FOLD_MAX_ELEMS)
            return s_fail (f, KILN_ELIMIT, "the range would have more than %d elements",
                           KILN_FOLD_MAX_ELEMS);
        count = c > 0 ? (int64_t) c : 0;
    }
    else {
        int64_t a = s_geti (&f->in[0], 0), b = s_geti (&f->in[1], 0), d = s_geti (&f->in[2], 0);
        if (d == 0)
            return s_fail (f, KILN_EINVAL, "delta is 0");
        /* In double to keep clear of overflow; only the bound matters. */
        double c = ceil (((double) b - (double) a) / (double) d);
        if (c > (double) KILN_FOLD_MAX_ELEMS)
            return s_fail (f, KILN_ELIMIT, "the range would have more than %d elements",
                           KILN_FOLD_MAX_ELEMS);
        /* Differences in unsigned arithmetic: exact, as they are below
         * 2^64, where the signed ones could overflow. */
        count = 0;
        if (d > 0 && b > a)
            count = (int64_t) (((uint64_t) b - (uint64_t) a - 1) / (uint64_t) d + 1);
        else if (d < 0 && a > b)
            count = (int64_t) (((uint64_t) a - (uint64_t) b - 1) / (0 - (uint64_t) d) + 1);
    }
    kiln_shape_t s = { .rank = 1, .dims = { count } };
    int rc = s_out (f, 0, dt, &s);
    if (rc != S_FOLDED)
        return rc;
    for (int64_t i = 0; i < count; i++) {
        if (s_is_float (dt))
            s_setf (dt, f->out[0], i, s_getf (&f->in[0], 0) + (double) i * s_getf (&f->in[2], 0));
        else
            s_seti (dt, f->out[0], i,
                    (int64_t) ((uint64_t) s_geti (&f->in[0], 0)
                               + (uint64_t) i * (uint64_t) s_geti (&f->in[2], 0)));
    }
    return S_FOLDED;
}

/* --- elementwise ----------------------------------------------------- */

typedef enum {
    S_ADD, S_SUB, S_MUL, S_DIV, S_MOD, S_POW, S_MIN, S_MAX, S_SUM, S_MEAN,
    S_EQ, S_LT, S_GT, S_LE, S_GE, S_AND, S_OR, S_XOR,
    S_NEG, S_ABS, S_SQRT, S_RECIP, S_FLOOR, S_CEIL, S_ROUND, S_NOT, S_RELU,
    S_EXP, S_LOG, S_SIGN,
} s_ew_t;

static const struct {
    const char *op;
    s_ew_t kind;
    int arity;                  /* 1, 2, or 0 for variadic */
} s_ew_ops[] = {
    { "Add", S_ADD, 2 }, { "Sub", S_SUB, 2 }, { "Mul", S_MUL, 2 }, { "Div", S_DIV, 2 },
    { "Mod", S_MOD, 2 }, { "Pow", S_POW, 2 }, { "Min", S_MIN, 0 }, { "Max", S_MAX, 0 },
    { "Sum", S_SUM, 0 }, { "Mean", S_MEAN, 0 },
    { "Equal", S_EQ, 2 }, { "Less", S_LT, 2 }, { "Greater", S_GT, 2 },
    { "LessOrEqual", S_LE, 2 }, { "GreaterOrEqual", S_GE, 2 },
    { "And", S_AND, 2 }, { "Or", S_OR, 2 }, { "Xor", S_XOR, 2 },
    { "Neg", S_NEG, 1 }, { "Abs", S_ABS, 1 }, { "Sqrt", S_SQRT, 1 },
    { "Reciprocal", S_RECIP, 1 }, { "Floor", S_FLOOR, 1 }, { "Ceil", S_CEIL, 1 },
    { "Round", S_ROUND, 1 }, { "Not", S_NOT, 1 }, { "Relu", S_RELU, 1 },
    { "Exp", S_EXP, 1 }, { "Log", S_LOG, 1 }, { "Sign", S_SIGN, 1 },
};

/* Why an integer op could not be folded. */
typedef enum { S_INT_OK, S_INT_DIV_ZERO, S_INT_OVERFLOW } s_int_why_t;

/* Integer a op b; *why says when it has no value: a division by zero, or
 * INT64_MIN / -1 (and % -1), whose quotient int64 cannot hold. */
static int64_t
s_int_op (s_ew_t k, int64_t a, int64_t b, bool fmod_mode, s_int_why_t *why)
{
    /* Wrapping arithmetic, as the runtime's integer kernels do. */
    uint64_t ua = (uint64_t) a, ub = (uint64_t) b;
    switch (k) {
    case S_ADD: case S_SUM: return (int64_t) (ua + ub);
    case S_SUB: return (int64_t) (ua - ub);
    case S_MUL: return (int64_t) (ua * ub);
    case S_DIV:
    case S_MOD:
        if (b == 0 || (a == INT64_MIN && b == -1)) {
            *why = b == 0 ? S_INT_DIV_ZERO : S_INT_OVERFLOW;
            return 0;
        }
        if (k == S_DIV)
            return a / b;
        if (fmod_mode)
            return a % b;
        /* Mod with fmod=0: the sign of the divisor, as Python's %. */
        {
            int64_t r = a % b;
            return r != 0 && ((r < 0) != (b < 0)) ? r + b : r;
        }
    case S_POW: {
        /* By squaring, wrapping; a negative exponent truncates to 0
         * except for a base of 1 or -1. */
        if (b < 0)
            return a == 1 ? 1 : a == -1 ? ((b & 1) ? -1 : 1) : 0;
        uint64_t r = 1, base = ua, e = (uint64_t) b;
        while (e) {
            if (e & 1)
                r *= base;
            base *= base;
            e >>= 1;
        }
        return (int64_t) r;
    }
    case S_MIN: return a < b ? a : b;
    case S_MAX: return a > b ? a : b;
    default: return 0;
    }
}

static double
s_float_op (s_ew_t k, double a, double b, bool fmod_mode)
{
    switch (k) {
    case S_ADD: case S_SUM: return a + b;
    case S_SUB: return a - b;
    case S_MUL: return a * b;
    case S_DIV: return a / b;
    case S_MOD: {
        double r = fmod (a, b);
        if (!fmod_mode && r != 0.0 && ((r < 0) != (b < 0)))
            r += b;
        return r;
    }
    case S_POW: return pow (a, b);
    case S_MIN: return isnan (a) || isnan (b) ? NAN : a < b ? a : b;
    case S_MAX: return isnan (a) || isnan (b) ? NAN : a > b ? a : b;
    default: return 0.0;
    }
}

static bool
s_cmp (s_ew_t k, const s_val_t *a, int64_t ia, const s_val_t *b, int64_t ib)
{
    if (s_is_float (a->dt) || s_is_float (b->dt)) {
        double x = s_getf (a, ia), y = s_getf (b, ib);
        switch (k) {
        case S_EQ: return x == y;
        case S_LT: return x < y;
        case S_GT: return x > y;
        case S_LE: return x <= y;
        default: return x >= y;
        }
    }
    int64_t x = s_geti (a, ia), y = s_geti (b, ib);
    switch (k) {
    case S_EQ: return x == y;
    case S_LT: return x < y;
    case S_GT: return x > y;
    case S_LE: return x <= y;
    case S_AND: return x && y;
    case S_OR: return x || y;
    case S_XOR: return !x != !y;
    default: return x >= y;
    }
}

static double
s_unary_f (s_ew_t k, double x)
{
    switch (k) {
    case S_NEG: return -x;
    case S_ABS: return fabs (x);
    case S_SQRT: return sqrt (x);
    case S_RECIP: return 1.0 / x;
    case S_FLOOR: return floor (x);
    case S_CEIL: return ceil (x);
    case S_ROUND: return nearbyint (x);     /* half to even, the default mode */
    case S_RELU: return x > 0 ? x : (isnan (x) ? x : 0.0);
    case S_EXP: return exp (x);
    case S_LOG: return log (x);
    case S_SIGN: return x > 0 ? 1.0 : x < 0 ? -1.0 : x;
    default: return 0.0;
    }
}

static int64_t
s_unary_i (s_ew_t k, int64_t x)
{
    switch (k) {
    case S_NEG: return (int64_t) (0 - (uint64_t) x);
    case S_ABS: return x < 0 ? (int64_t) (0 - (uint64_t) x) : x;
    case S_RELU: return x > 0 ? x : 0;
    case S_SIGN: return x > 0 ? 1 : x < 0 ? -1 : 0;
    case S_NOT: return !x;
    default: return x;      /* Floor, Ceil, Round of an integer */
    }
}

static int
s_eval_elementwise (s_fold_t *f)
{
    int w = -1;
    for (size_t i = 0; i < sizeof s_ew_ops / sizeof s_ew_ops[0]; i++)
        if (strcmp (s_ew_ops[i].op, f->node->op) == 0)
            w = (int) i;
    s_ew_t k = s_ew_ops[w].kind;
    int n = f->n_in;
    if (n < 1 || (s_ew_ops[w].arity && n != s_ew_ops[w].arity) || n > KILN_MAX_NODE_IO)
        return s_fail (f, KILN_EINVAL, "has %d inputs", n);
    const s_val_t *v[KILN_MAX_NODE_IO];
    for (int i = 0; i < n; i++) {
        v[i] = &f->in[i];
        if (!v[i]->dt)
            return s_fail (f, KILN_EINVAL, "input %d is missing", i);
        if (k != S_POW && v[i]->dt != v[0]->dt)
            return s_fail (f, KILN_ESHAPE, "input %d is %s but input 0 is %s", i,
                           kiln_dtype_name (v[i]->dt), kiln_dtype_name (v[0]->dt));
    }
    kiln_shape_t y;
    int rc = s_broadcast (f, v, n, &y);
    if (rc)
        return rc;
    bool logic = k == S_AND || k == S_OR || k == S_XOR || k == S_NOT;
    bool cmp = k >= S_EQ && k <= S_XOR;
    kiln_dtype_t dt = cmp ? KILN_DT_BOOL : v[0]->dt;
    if (logic && v[0]->dt != KILN_DT_BOOL)
        return s_fail (f, KILN_ESHAPE, "inputs are %s, expected bool", kiln_dtype_name (v[0]->dt));
    if ((rc = s_out (f, 0, dt, &y)) != S_FOLDED)
        return rc;
    bool fmod_mode = kiln_node_attr_int (f->node, "fmod", 0) != 0;
    bool is_f = s_is_float (v[0]->dt);
    int64_t count = kiln_shape_count (&y);
    for (int64_t i = 0; i < count; i++) {
        int64_t i0 = s_bcast_index (&y, &v[0]->shape, i);
        if (cmp) {
            int64_t i1 = s_bcast_index (&y, &v[1]->shape, i);
            s_seti (dt, f->out[0], i, s_cmp (k, v[0], i0, v[1], i1));
        }
        else if (n == 1) {
            if (is_f)
                s_setf (dt, f->out[0], i, s_unary_f (k, s_getf (v[0], i0)));
            else if (k == S_SQRT || k == S_RECIP || k == S_EXP || k == S_LOG)
                s_setf (dt, f->out[0], i, s_unary_f (k, (double) s_geti (v[0], i0)));
            else
                s_seti (dt, f->out[0], i, s_unary_i (k, s_geti (v[0], i0)));
        }
        else if (is_f) {
            double acc = s_getf (v[0], i0);
            for (int j = 1; j < n; j++)
                acc = s_float_op (k == S_MEAN ? S_SUM : k, acc,
                                  s_getf (v[j], s_bcast_index (&y, &v[j]->shape, i)), fmod_mode);
            if (k == S_MEAN)
                acc /= n;
            s_setf (dt, f->out[0], i, acc);
        }
        else {
            if (k == S_POW && s_is_float (v[1]->dt)) {
                double e = s_getf (v[1], s_bcast_index (&y, &v[1]->shape, i));
                s_setf (dt, f->out[0], i, pow ((double) s_geti (v[0], i0), e));
                continue;
            }
            int64_t acc = s_geti (v[0], i0);
            s_int_why_t why = S_INT_OK;
            for (int j = 1; j < n && why == S_INT_OK; j++)
                acc = s_int_op (k == S_MEAN ? S_SUM : k, acc,
                                s_geti (v[j], s_bcast_index (&y, &v[j]->shape, i)), fmod_mode, &why);
            if (why == S_INT_DIV_ZERO)
                return s_fail (f, KILN_EINVAL, "integer division by zero in a constant");
            if (why == S_INT_OVERFLOW)
                return s_fail (f, KILN_EINVAL, "integer overflow in a constant: %lld / -1 "
                               "does not fit in int64", (long long) INT64_MIN);
            if (k == S_MEAN)
                acc /= n;
            s_seti (dt, f->out[0], i, acc);
        }
    }
    return S_FOLDED;
}

static int
s_eval_where (s_fold_t *f)
{
    const s_val_t *v[3] = { &f->in[0], &f->in[1], &f->in[2] };
    if (v[0]->dt != KILN_DT_BOOL)
        return s_fail (f, KILN_ESHAPE, "condition is %s, expected bool", kiln_dtype_name (v[0]->dt));
    if (v[1]->dt != v[2]->dt)
        return s_fail (f, KILN_ESHAPE, "X is %s but Y is %s", kiln_dtype_name (v[1]->dt),
                       kiln_dtype_name (v[2]->dt));
    kiln_shape_t y;
    int rc = s_broadcast (f, v, 3, &y);
    if (rc)
        return rc;
    if ((rc = s_out (f, 0, v[1]->dt, &y)) != S_FOLDED)
        return rc;
    size_t es = s_esz (v[1]->dt);
    int64_t count = kiln_shape_count (&y);
    for (int64_t i = 0; i < count; i++) {
        bool c = v[0]->data[s_bcast_index (&y, &v[0]->shape, i)] != 0;
        const s_val_t *src = c ? v[1] : v[2];
        memcpy (f->out[0] + (size_t) i * es,
                src->data + (size_t) s_bcast_index (&y, &src->shape, i) * es, es);
    }
    return S_FOLDED;
}

static int
s_eval_cast (s_fold_t *f)
{
    const s_val_t *x = &f->in[0];
    kiln_dtype_t to;
    if (strcmp (f->node->op, "CastLike") == 0)
        to = f->in[1].dt;
    else {
        const kiln_attr_t *a = kiln_node_attr (f->node, "to");
        if (!a || a->kind != KILN_ATTR_INT)
            return s_fail (f, KILN_EFORMAT, "attribute 'to' is required");
        to = (kiln_dtype_t) a->i;
    }
    if (!kiln_dtype_valid ((int) to))
        return s_fail (f, KILN_EUNSUPPORTED, "cast to ONNX data type %d", (int) to);
    int rc = s_out (f, 0, to, &x->shape);
    if (rc != S_FOLDED)
        return rc;
    for (int64_t i = 0; i < x->n; i++) {
        if (s_is_float (x->dt) || s_is_float (to))
            s_setf (to, f->out[0], i, s_getf (x, i));
        else
            s_seti (to, f->out[0], i, s_geti (x, i));
    }
    return S_FOLDED;
}

/* ReduceSum/Prod/Min/Max/Mean: axes from the attribute (or input 1 from
 * opset 13 for ReduceSum, 18 for the others), keepdims. */
static int
s_eval_reduce (s_fold_t *f)
{
    const s_val_t *x = &f->in[0];
    int r = x->shape.rank, n = -1, rc;
    int64_t axes[KILN_MAX_RANK];
    if (f->n_in > 1 && f->in[1].dt) {
        if ((rc = kiln_const_ints (f->g, f->node, 1, "axes", KILN_MAX_RANK, axes, &n, f->err)))
            return s_prefixed (f, rc);
    }
    else {
        const kiln_attr_t *a = kiln_node_attr (f->node, "axes");
        if (a && a->kind == KILN_ATTR_INTS && a->n <= KILN_MAX_RANK) {
            n = (int) a->n;
            memcpy (axes, a->ints, a->n * sizeof *axes);
        }
    }
    bool keep = kiln_node_attr_int (f->node, "keepdims", 1) != 0;
    bool noop = kiln_node_attr_int (f->node, "noop_with_empty_axes", 0) != 0;
    bool red[KILN_MAX_RANK] = { false };
    if (n <= 0) {
        if (n == 0 && noop)
            return s_eval_view (f);
        for (int i = 0; i < r; i++)
            red[i] = true;
    }
    for (int i = 0; i < n; i++) {
        int64_t a = axes[i] < 0 ? axes[i] + r : axes[i];
        if (a < 0 || a >= r)
            return s_fail (f, KILN_EFORMAT, "axis %lld is out of range", (long long) axes[i]);
        red[a] = true;
    }
    kiln_shape_t y = { .rank = 0 }, kept = { .rank = r };
    for (int i = 0; i < r; i++) {
        kept.dims[i] = red[i] ? 1 : x->shape.dims[i];
        if (!red[i] || keep)
            y.dims[y.rank++] = kept.dims[i];
    }
    const char *op = f->node->op;
    bool is_sum = strcmp (op, "ReduceSum") == 0, is_mean = strcmp (op, "ReduceMean") == 0;
    bool is_prod = strcmp (op, "ReduceProd") == 0, is_min = strcmp (op, "ReduceMin") == 0;
    if ((rc = s_out (f, 0, x->dt, &y)) != S_FOLDED)
        return rc;
    int64_t count = kiln_shape_count (&kept);
    double *acc = malloc ((size_t) (count + 1) * sizeof *acc);
    int64_t *cnt = calloc ((size_t) (count + 1), sizeof *cnt);
    if (!acc || !cnt) {
        free (acc);
        free (cnt);
        return s_fail (f, KILN_ENOMEM, "out of memory");
    }
    for (int64_t i = 0; i < x->n; i++) {
        int64_t j = s_bcast_index (&x->shape, &kept, i);
        double v = s_getf (x, i);
        if (cnt[j]++ == 0)
            acc[j] = v;
        else if (is_sum || is_mean)
            acc[j] += v;
        else if (is_prod)
            acc[j] *= v;
        else if (is_min)
            acc[j] = v < acc[j] ? v : acc[j];
        else
            acc[j] = v > acc[j] ? v : acc[j];
    }
    for (int64_t j = 0; j < count; j++) {
        double v = cnt[j] ? acc[j] : (is_prod ? 1.0 : 0.0);
        if (is_mean && cnt[j])
            v /= (double) cnt[j];
        s_setf (x->dt, f->out[0], j, v);
    }
    free (acc);
    free (cnt);
    return S_FOLDED;
}

/* Trilu: keep the elements of the last two axes with j - i >= k (upper)
 * or <= k (lower), zero the others; masks are built this way. */
static int
s_eval_trilu (s_fold_t *f)
{
    const s_val_t *x = &f->in[0];
    if (x->shape.rank < 2)
        return s_fail (f, KILN_ESHAPE, "input has rank %d, expected at least 2", x->shape.rank);
    int64_t k = 0;
    if (f->n_in > 1 && f->in[1].dt) {
        if (f->in[1].n != 1)
            return s_fail (f, KILN_ESHAPE, "k must be a scalar");
        k = s_geti (&f->in[1], 0);
    }
    bool upper = kiln_node_attr_int (f->node, "upper", 1) != 0;
    int rc = s_out (f, 0, x->dt, &x->shape);
    if (rc != S_FOLDED)
        return rc;
    int64_t rows = x->shape.dims[x->shape.rank - 2], cols = x->shape.dims[x->shape.rank - 1];
    size_t es = s_esz (x->dt);
    for (int64_t e = 0; e < x->n; e++) {
        int64_t j = e % cols, i = (e / cols) % rows;
        /* i, j < 2^31 and |k| is clamped, so j - i - k cannot overflow. */
        int64_t kk = k < -KILN_MAX_DIM ? -KILN_MAX_DIM - 1 : k > KILN_MAX_DIM ? KILN_MAX_DIM + 1 : k;
        bool keep = upper ? j - i >= kk : j - i <= kk;
        if (keep)
            memcpy (f->out[0] + (size_t) e * es, x->data + (size_t) e * es, es);
    }
    return S_FOLDED;
}

/* --- the table ------------------------------------------------------- */

#define S_DATA_DEPENDENT "its output shape depends on the values of its input, known only at run time; kiln compiles for fixed shapes"
#define S_COMPILE_TIME "it is evaluated at compile time only, from constant inputs"

/* Sorted by op name. */
static const s_fold_op_t s_fold_ops[] = {
    { "Abs",             s_eval_elementwise, false, false, NULL },
    { "Add",             s_eval_elementwise, false, false, NULL },
    { "And",             s_eval_elementwise, false, false, NULL },
    { "Cast",            s_eval_cast,        false, false, NULL },
    { "CastLike",        s_eval_cast,        false, false, NULL },
    { "Ceil",            s_eval_elementwise, false, false, NULL },
    { "Concat",          s_eval_concat,      true,  false, NULL },
    { "ConstantOfShape", s_eval_constant_of_shape, false, false, S_COMPILE_TIME },
    { "Div",             s_eval_elementwise, false, false, NULL },
    { "Equal",           s_eval_elementwise, false, false, NULL },
    { "Exp",             s_eval_elementwise, false, false, NULL },
    { "Expand",          s_eval_expand_tile, true,  false, NULL },
    { "Flatten",         s_eval_view,        true,  false, NULL },
    { "Floor",           s_eval_elementwise, false, false, NULL },
    { "Gather",          s_eval_gather,      true,  false, NULL },
    { "Greater",         s_eval_elementwise, false, false, NULL },
    { "GreaterOrEqual",  s_eval_elementwise, false, false, NULL },
    { "Identity",        s_eval_view,        true,  false, NULL },
    { "Less",            s_eval_elementwise, false, false, NULL },
    { "LessOrEqual",     s_eval_elementwise, false, false, NULL },
    { "Log",             s_eval_elementwise, false, false, NULL },
    { "Max",             s_eval_elementwise, false, false, NULL },
    { "Mean",            s_eval_elementwise, false, false, NULL },
    { "Min",             s_eval_elementwise, false, false, NULL },
    { "Mod",             s_eval_elementwise, false, false, NULL },
    { "Mul",             s_eval_elementwise, false, false, NULL },
    { "Neg",             s_eval_elementwise, false, false, NULL },
    { "NonMaxSuppression", NULL,             false, false, S_DATA_DEPENDENT },
    { "NonZero",         NULL,               false, false, S_DATA_DEPENDENT },
    { "Not",             s_eval_elementwise, false, false, NULL },
    { "Or",              s_eval_elementwise, false, false, NULL },
    { "Pow",             s_eval_elementwise, false, false, NULL },
    { "Range",           s_eval_range,       false, false, S_COMPILE_TIME },
    { "Reciprocal",      s_eval_elementwise, false, false, NULL },
    { "ReduceMax",       s_eval_reduce,      false, false, NULL },
    { "ReduceMean",      s_eval_reduce,      false, false, NULL },
    { "ReduceMin",       s_eval_reduce,      false, false, NULL },
    { "ReduceProd",      s_eval_reduce,      false, false, NULL },
    { "ReduceSum",       s_eval_reduce,      false, false, NULL },
    { "Relu",            s_eval_elementwise, false, false, NULL },
    { "Reshape",         s_eval_view,        true,  false, NULL },
    { "Round",           s_eval_elementwise, false, false, NULL },
    { "Shape",           s_eval_shape,       false, true,  S_COMPILE_TIME },
    { "Sign",            s_eval_elementwise, false, false, NULL },
    { "Size",            s_eval_size,        false, true,  S_COMPILE_TIME },
    { "Slice",           s_eval_slice,       true,  false, NULL },
    { "Split",           s_eval_split,       true,  false, NULL },
    { "Sqrt",            s_eval_elementwise, false, false, NULL },
    { "Squeeze",         s_eval_view,        true,  false, NULL },
    { "Sub",             s_eval_elementwise, false, false, NULL },
    { "Sum",             s_eval_elementwise, false, false, NULL },
    { "Tile",            s_eval_expand_tile, true,  false, NULL },
    { "Transpose",       s_eval_transpose,   true,  false, NULL },
    { "Trilu",           s_eval_trilu,       false, false, NULL },
    { "Unique",          NULL,               false, false, S_DATA_DEPENDENT },
    { "Unsqueeze",       s_eval_view,        true,  false, NULL },
    { "Where",           s_eval_where,       false, false, NULL },
    { "Xor",             s_eval_elementwise, false, false, NULL },
};
#define S_N_FOLD_OPS ((int) (sizeof s_fold_ops / sizeof s_fold_ops[0]))

static int
s_fold_cmp (const void *key, const void *elem)
{
    return strcmp ((const char *) key, ((const s_fold_op_t *) elem)->op);
}

static const s_fold_op_t *
s_fold_find (const char *op)
{
    return op ? bsearch (op, s_fold_ops, S_N_FOLD_OPS, sizeof s_fold_ops[0], s_fold_cmp) : NULL;
}

bool
kiln_fold_op_known (const char *op)
{
    const s_fold_op_t *fo = s_fold_find (op);
    /* Every op the evaluator knows: on constants it folds away, whether or
     * not the op table has it (Range, Mod, Sign...).  The data-dependent
     * ones are not known at all: the importer lists them among the
     * unsupported ops, saying why. */
    return fo && fo->eval;
}

bool
kiln_graph_op_data_dependent (const char *op)
{
    const s_fold_op_t *fo = s_fold_find (op);
    return fo && fo->refusal && strcmp (fo->refusal, S_DATA_DEPENDENT) == 0;
}

bool
kiln_graph_fold_evaluates (const char *op)
{
    const s_fold_op_t *fo = s_fold_find (op);
    return fo && fo->eval;
}

int
kiln_fold_refuse (const kiln_graph_t *g, int n, const char *label, kiln_err_t *err)
{
    const kiln_node_t *node = &g->nodes[n];
    const s_fold_op_t *fo = s_fold_find (node->op);
    if (fo && fo->refusal && strcmp (fo->refusal, S_DATA_DEPENDENT) == 0)
        return kiln_error (err, KILN_EUNSUPPORTED, "%s: %s", label, fo->refusal);
    for (int i = 0; i < node->n_inputs; i++) {
        int t = node->inputs[i];
        if (t >= 0 && !kiln_const_input (g, node, i))
            return kiln_error (err, KILN_EUNSUPPORTED,
                               "%s: input '%s' is computed at run time, but %s is evaluated at "
                               "compile time only, from constant inputs (kiln compiles for "
                               "fixed shapes)",
                               label, g->tensors[t].name && *g->tensors[t].name
                                      ? g->tensors[t].name : "(unnamed)", node->op);
    }
    return kiln_error (err, KILN_EUNSUPPORTED, "%s: could not be evaluated at compile time "
                       "(its result is larger than %d elements)", label, KILN_FOLD_MAX_ELEMS);
}

/* --- the pass -------------------------------------------------------- */

/* Output k must agree with what its tensor declares, if anything. */
static int
s_check_output (s_fold_t *f, int k)
{
    const kiln_tensor_t *tensor = &f->g->tensors[f->node->outputs[k]];
    char s1[160], s2[160];
    if ((tensor->dtype != KILN_DT_UNDEFINED && tensor->dtype != f->out_dt[k])
        || (tensor->shape.rank >= 0 && !kiln_shape_equal (&tensor->shape, &f->out_shape[k])))
        return s_fail (f, KILN_ESHAPE, "output '%s' is declared %s %s but computes %s %s",
                       tensor->name ? tensor->name : "", kiln_dtype_name (tensor->dtype),
                       kiln_shape_str (&tensor->shape, s1, sizeof s1),
                       kiln_dtype_name (f->out_dt[k]),
                       kiln_shape_str (&f->out_shape[k], s2, sizeof s2));
    return 0;
}

/* Turn output k of the node into a weight holding f->out[k]. */
static int
s_commit_output (s_fold_t *f, int k)
{
    kiln_graph_t *g = f->g;
    int t = f->node->outputs[k];
    kiln_tensor_t *tensor = &g->tensors[t];
    tensor->dtype = f->out_dt[k];
    tensor->shape = f->out_shape[k];
    uint64_t bytes = (uint64_t) kiln_shape_count (&f->out_shape[k]) * s_esz (f->out_dt[k]);
    int rc = kiln_graph_set_weight (g, t, &f->out[k], bytes, f->err);
    if (rc)
        return s_prefixed (f, rc);
    *f->spent += bytes;
    f->types[t].dtype = f->out_dt[k];
    f->types[t].shape = f->out_shape[k];
    return 0;
}

/* Fold node n when it can be: S_FOLDED, S_INFERRED, S_NOT_FOLDED or an
 * error. */
static int
s_fold_node (kiln_graph_t *g, int n, kiln_infer_type_t *types, uint64_t *spent,
             kiln_err_t *err)
{
    const kiln_node_t *node = &g->nodes[n];
    const s_fold_op_t *fo = s_fold_find (node->op);
    if (!fo || !fo->eval || node->n_outputs > S_MAX_OUT)
        return S_NOT_FOLDED;
    for (int i = 0; i < node->n_inputs; i++) {
        int t = node->inputs[i];
        if (t < 0)
            continue;
        if (fo->shape_only ? types[t].shape.rank < 0 : !kiln_const_input (g, node, i))
            return S_NOT_FOLDED;
    }
    char label[KILN_MAX_NAME + KILN_MAX_OP_NAME + 32];
    kiln_graph_node_label (g, n, label, sizeof label);
    s_fold_t f = { .g = g, .node_index = n, .node = node, .label = label,
                   .n_in = node->n_inputs, .types = types, .spent = spent, .err = err };
    f.in = calloc ((size_t) node->n_inputs + 1, sizeof *f.in);
    if (!f.in)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    for (int i = 0; i < node->n_inputs; i++) {
        int t = node->inputs[i];
        if (t < 0)
            continue;
        f.in[i].dt = types[t].dtype;
        f.in[i].shape = types[t].shape;
        f.in[i].n = kiln_shape_count (&types[t].shape);
        int w = g->tensors[t].weight;
        f.in[i].data = w >= 0 ? g->weights[w].data : NULL;
    }
    int rc = 0;
    /* Data movement: the op table says what the outputs are (and checks
     * the node), the evaluator only moves the bytes. */
    if (fo->typed_by_table && (rc = kiln_infer_node (g, n, types, err)))
        goto out;
    /* A view of a constant (Identity, Reshape, ...) shares its bytes. */
    if (fo->eval == s_eval_view && node->n_outputs == 1) {
        int t = node->outputs[0];
        f.out_dt[0] = types[t].dtype;
        f.out_shape[0] = types[t].shape;
        if ((rc = s_check_output (&f, 0)))
            goto out;
        g->tensors[t].dtype = types[t].dtype;
        g->tensors[t].shape = types[t].shape;
        g->tensors[t].weight = g->tensors[node->inputs[0]].weight;
        rc = S_FOLDED;
        goto out;
    }
    rc = fo->eval (&f);
    if (rc == S_FOLDED && f.n_out != node->n_outputs)
        rc = s_fail (&f, KILN_EINVAL, "internal error: %d of %d outputs folded", f.n_out,
                     node->n_outputs);
    /* Check every output before committing any, so that a node is folded
     * whole or not at all. */
    for (int k = 0; rc == S_FOLDED && k < f.n_out; k++)
        if (s_check_output (&f, k) < 0)
            rc = -err->code;
    for (int k = 0; rc == S_FOLDED && k < f.n_out; k++)
        if (s_commit_output (&f, k) < 0)
            rc = -err->code;
    if (rc == S_NOT_FOLDED && fo->typed_by_table)
        rc = S_INFERRED;
out:
    for (int k = 0; k < f.n_out; k++)
        free (f.out[k]);
    free (f.in);
    return rc;
}

static void
s_node_release (kiln_node_t *node)
{
    free (node->name);
    free (node->op);
    free (node->inputs);
    free (node->outputs);
    for (int i = 0; i < node->n_attrs; i++) {
        free (node->attrs[i].name);
        free (node->attrs[i].s);
        free (node->attrs[i].ints);
        free (node->attrs[i].floats);
    }
    free (node->attrs);
}

/* Keep the nodes order[0..n) that `drop` does not mark, in that order;
 * free the others. */
static void
s_keep_nodes (kiln_graph_t *g, const int *order, int n, const bool *drop)
{
    kiln_node_t *kept = malloc (((size_t) g->n_nodes + 1) * sizeof *kept);
    bool *seen = calloc ((size_t) g->n_nodes + 1, 1);
    if (!kept || !seen) {
        /* Out of memory: drop in place, keeping the current order. */
        int k = 0;
        for (int i = 0; i < g->n_nodes; i++) {
            if (drop[i])
                s_node_release (&g->nodes[i]);
            else
                g->nodes[k++] = g->nodes[i];
        }
        g->n_nodes = k;
        free (kept);
        free (seen);
        return;
    }
    int k = 0;
    for (int i = 0; i < n; i++) {
        seen[order[i]] = true;
        if (!drop[order[i]])
            kept[k++] = g->nodes[order[i]];
    }
    /* Nodes the order does not list (none after a full walk). */
    for (int i = 0; i < g->n_nodes; i++)
        if (!seen[i] && !drop[i])
            kept[k++] = g->nodes[i];
    for (int i = 0; i < g->n_nodes; i++)
        if (drop[i])
            s_node_release (&g->nodes[i]);
    if (k > 0)
        memcpy (g->nodes, kept, (size_t) k * sizeof *kept);
    g->n_nodes = k;
    free (kept);
    free (seen);
}

/* Remove the nodes no graph output depends on; returns how many. */
static int
s_dead_code (kiln_graph_t *g)
{
    bool *live = calloc ((size_t) g->n_tensors + 1, 1);
    bool *drop = calloc ((size_t) g->n_nodes + 1, 1);
    int *order = malloc (((size_t) g->n_nodes + 1) * sizeof *order);
    int removed = 0;
    if (!live || !drop || !order)
        goto out;
    for (int i = 0; i < g->n_outputs; i++)
        live[g->outputs[i]] = true;
    /* Nodes are in topological order here: walk them backwards. */
    for (int n = g->n_nodes - 1; n >= 0; n--) {
        const kiln_node_t *node = &g->nodes[n];
        bool used = false;
        for (int i = 0; i < node->n_outputs; i++)
            used |= live[node->outputs[i]];
        if (!used) {
            drop[n] = true;
            removed++;
            continue;
        }
        for (int i = 0; i < node->n_inputs; i++)
            if (node->inputs[i] >= 0)
                live[node->inputs[i]] = true;
    }
    for (int n = 0; n < g->n_nodes; n++)
        order[n] = n;
    if (removed)
        s_keep_nodes (g, order, g->n_nodes, drop);
out:
    free (live);
    free (drop);
    free (order);
    return removed;
}

/* Drop the weights folding created (created[]) that no node reads and
 * no graph output is.  The model's own initializers stay, used or not:
 * the canonical form ignores unused tensors anyway. */
static void
s_compact_weights (kiln_graph_t *g, const bool *created)
{
    bool *used_t = calloc ((size_t) g->n_tensors + 1, 1);
    int *map = malloc (((size_t) g->n_weights + 1) * sizeof *map);
    if (!used_t || !map)
        goto out;
    for (int n = 0; n < g->n_nodes; n++)
        for (int i = 0; i < g->nodes[n].n_inputs; i++)
            if (g->nodes[n].inputs[i] >= 0)
                used_t[g->nodes[n].inputs[i]] = true;
    for (int i = 0; i < g->n_outputs; i++)
        used_t[g->outputs[i]] = true;
    for (int w = 0; w < g->n_weights; w++)
        map[w] = -1;
    for (int t = 0; t < g->n_tensors; t++) {
        if (g->tensors[t].weight < 0)
            continue;
        if (used_t[t] || !created[t])
            map[g->tensors[t].weight] = 0;
        else
            g->tensors[t].weight = -1;
    }
    int k = 0;
    for (int w = 0; w < g->n_weights; w++) {
        if (map[w] < 0) {
            kiln_weight_release (&g->weights[w]);
            continue;
        }
        map[w] = k;
        g->weights[k++] = g->weights[w];
    }
    g->n_weights = k;
    for (int t = 0; t < g->n_tensors; t++)
        if (g->tensors[t].weight >= 0)
            g->tensors[t].weight = map[g->tensors[t].weight];
out:
    free (used_t);
    free (map);
}

int
kiln_graph_fold (kiln_graph_t *g, kiln_err_t *err)
{
    int rc, removed = 0;
    if (g->n_nodes < 0 || g->n_nodes > KILN_MAX_NODES || g->n_tensors < 0
        || g->n_tensors > KILN_MAX_TENSORS)
        return kiln_error (err, KILN_ELIMIT, "graph counts out of range");
    int *order = malloc (((size_t) g->n_nodes + 1) * sizeof *order);
    int *producer = malloc (((size_t) g->n_tensors + 1) * sizeof *producer);
    kiln_infer_type_t *types = malloc (((size_t) g->n_tensors + 1) * sizeof *types);
    bool *folded = calloc ((size_t) g->n_nodes + 1, 1);
    bool *created = calloc ((size_t) g->n_tensors + 1, 1);
    int walked = 0;
    uint64_t spent = 0;         /* bytes folded so far, against KILN_MAX_FOLD_BYTES */
    if (!order || !producer || !types || !folded || !created) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory folding the graph");
        goto out;
    }
    if ((rc = kiln_infer_order (g, order, err)))
        goto out;
    walked = g->n_nodes;
    for (int t = 0; t < g->n_tensors; t++)
        producer[t] = -1;
    for (int n = 0; n < g->n_nodes; n++)
        for (int i = 0; i < g->nodes[n].n_outputs; i++)
            producer[g->nodes[n].outputs[i]] = n;
    for (int t = 0; t < g->n_tensors; t++) {
        types[t].dtype = producer[t] >= 0 ? KILN_DT_UNDEFINED : g->tensors[t].dtype;
        types[t].shape = g->tensors[t].shape;
        if (producer[t] >= 0)
            types[t].shape.rank = -1;
    }
    for (int k = 0; k < g->n_nodes; k++) {
        int n = order[k];
        rc = s_fold_node (g, n, types, &spent, err);
        if (rc < 0)
            goto out;
        if (rc == S_FOLDED) {
            folded[n] = true;
            removed++;
            for (int i = 0; i < g->nodes[n].n_outputs; i++)
                created[g->nodes[n].outputs[i]] = true;
            continue;
        }
        if (rc == S_NOT_FOLDED && (rc = kiln_infer_node (g, n, types, err)))
            goto out;
    }
    rc = 0;
out:
    /* Folded nodes go even on failure: their outputs are weights now, and
     * a weight has no producer.  The graph computes what it did. */
    if (walked)
        s_keep_nodes (g, order, walked, folded);
    if (rc == 0) {
        removed += s_dead_code (g);
        s_compact_weights (g, created);
        rc = kiln_graph_validate (g, err);
    }
    free (order);
    free (producer);
    free (types);
    free (folded);
    free (created);
    return rc < 0 ? rc : removed;
}
