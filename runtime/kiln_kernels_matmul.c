/*
 * kiln_kernels_matmul — the matrix-product kernels, matmul and gemm, on
 * the matrix engine (kiln_gemm.h) whatever their operands: packed
 * weights, activations by activations (attention's scores and their
 * product with V), strided views.  Internal to libkilnrt.
 */
#include "runtime/kiln_kernels_priv.h"

#include <limits.h>
#include <math.h>
#include <string.h>

#include "runtime/kiln_exec.h"
#include "runtime/kiln_vmath.h"

/* --- matrix products ------------------------------------------------ */

static int
s_get_mnk (kiln_prog_op_t *op, int64_t *m, int64_t *n, int64_t *k,
           kiln_err_t *err)
{
    int rc;
    if ((rc = kiln_prog_op_int (op, "m", m, err))
        || (rc = kiln_prog_op_int (op, "n", n, err))
        || (rc = kiln_prog_op_int (op, "k", k, err)))
        return rc;
    if (!kiln_kblas_ok (*m) || !kiln_kblas_ok (*n) || !kiln_kblas_ok (*k))
        return kiln_error (err, KILN_EFORMAT, "m, n and k must be in 0..%d",
                           INT_MAX);
    return 0;
}

/* A packed B (input 1) may be float16 or bfloat16, which the engine
 * widens a panel at a time; every other operand is float32.  The B's
 * dtype goes to *half (0: float32). */
static int
s_need_f32_packed_b (const kiln_program_t *p, const kiln_kplan_t *plan,
                     bool packed_b, kiln_dtype_t *half, kiln_err_t *err)
{
    kiln_dtype_t bt = kiln_ktensor (p, plan->in[1])->dtype;
    *half = (kiln_dtype_t) 0;
    if (!packed_b || !kiln_dtype_is_half (bt))
        return kiln_kneed_f32 (p, plan, err);
    for (int i = 0; i < plan->n_in; i++)
        if (i != 1 && kiln_ktensor (p, plan->in[i])->dtype != KILN_DT_FLOAT32)
            return kiln_error (err, KILN_EFORMAT, "input %d is %s, not float32",
                               i, kiln_dtype_name (kiln_ktensor (p, plan->in[i])->dtype));
    if (kiln_ktensor (p, plan->out)->dtype != KILN_DT_FLOAT32)
        return kiln_error (err, KILN_EFORMAT, "output is %s, not float32",
                           kiln_dtype_name (kiln_ktensor (p, plan->out)->dtype));
    *half = bt;
    return 0;
}


/* A matmul operand's or result's optional strides `name` (`a_strides`,
 * `b_strides`, `y_strides`: r + 2 ints, one per batch dimension then the
 * row and column strides, in elements) into st[], and the operand's
 * first element `off_name` (`a_offset`, `b_offset`; optional, 0) into
 * *off: the operand is then a strided view of its tensor (the compiler
 * folded the slices and transposes that made it into the product), the
 * result one of the tensor it writes, and every element they reach
 * must lie inside it.  Without strides the operand is dense: `dims`
 * (its batch dims, then rows and columns) in order. */
static int
s_get_operand_strides (const kiln_program_t *p, kiln_prog_op_t *op,
                       const char *name, const char *off_name, int t, int r,
                       const int64_t *dims, int64_t *st, int64_t *off,
                       bool *strided, kiln_err_t *err)
{
    int rc;
    *off = 0;
    *strided = kiln_prog_op_has (op, name);
    if (off_name && kiln_prog_op_has (op, off_name)) {
        if (!*strided)
            return kiln_error (err, KILN_EFORMAT, "%s without %s", off_name, name);
        if ((rc = kiln_prog_op_int (op, off_name, off, err)))
            return rc;
        if (*off < 0 || *off >= kiln_ktensor_numel (kiln_ktensor (p, t)))
            return kiln_error (err, KILN_EFORMAT, "%s %lld is outside the tensor",
                               off_name, (long long) *off);
    }
    if (!*strided) {
        int64_t c = 1;
        for (int i = r + 1; i >= 0; i--) {
            st[i] = dims[i] == 1 && i < r ? 0 : c;
            c *= dims[i];
        }
        return 0;
    }
    if ((rc = kiln_prog_op_ints (op, name, r + 2, st, err)))
        return rc;
    int64_t last = *off;
    for (int i = 0; i < r + 2; i++) {
        if (st[i] < 0 || st[i] > KILN_MAX_TENSOR_ELEMS)
            return kiln_error (err, KILN_EFORMAT, "%s: stride %d is %lld", name, i,
                               (long long) st[i]);
        if (dims[i] == 0)
            return 0;
        if (i < r && dims[i] == 1)
            st[i] = 0;
        int64_t reach;
        if (__builtin_mul_overflow (dims[i] - 1, st[i], &reach)
            || __builtin_add_overflow (last, reach, &last))
            return kiln_error (err, KILN_EFORMAT, "%s: offsets overflow", name);
    }
    if (last >= kiln_ktensor_numel (kiln_ktensor (p, t)))
        return kiln_error (err, KILN_EFORMAT, "%s reach element %lld of a tensor "
                           "of %lld", name, (long long) last,
                           (long long) kiln_ktensor_numel (kiln_ktensor (p, t)));
    return 0;
}

/* The optional `alpha` (default 1), which must be finite. */
static int
s_get_alpha (kiln_prog_op_t *op, float *alpha, kiln_err_t *err)
{
    double v = 1.0;
    int rc;
    if (kiln_prog_op_has (op, "alpha") && (rc = kiln_prog_op_float (op, "alpha", &v, err)))
        return rc;
    if (!isfinite (v))
        return kiln_error (err, KILN_EFORMAT, "alpha is not finite");
    *alpha = (float) v;
    return 0;
}

int
kiln_kprepare_MATMUL (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                  kiln_err_t *err)
{
    int64_t m, n, k;
    int rc;
    if ((rc = s_get_mnk (op, &m, &n, &k, err))
        || (rc = kiln_kernel_epilogue (p, op, plan, err))
        || (rc = kiln_kget_packed (op, "packed_b", &plan->u.mm.packed_b, err))
        || (rc = s_need_f32_packed_b (p, plan, plan->u.mm.packed_b,
                                      &plan->u.mm.b_half, err)))
        return rc;
    int64_t batch[KILN_PROG_MAX_PARAM_INTS], ba[KILN_PROG_MAX_PARAM_INTS],
        bb[KILN_PROG_MAX_PARAM_INTS];
    int r;
    if ((rc = kiln_prog_op_ints_any (op, "batch", batch, &r, err)))
        return rc;
    if (r > KILN_MAX_RANK)
        return kiln_error (err, KILN_EFORMAT, "batch rank %d", r);
    if ((rc = kiln_prog_op_ints (op, "batch_a", r, ba, err))
        || (rc = kiln_prog_op_ints (op, "batch_b", r, bb, err)))
        return rc;
    for (int i = 0; i < r; i++)
        if (batch[i] < 0 || (ba[i] != batch[i] && ba[i] != 1)
            || (bb[i] != batch[i] && bb[i] != 1))
            return kiln_error (err, KILN_EFORMAT, "batch dimension %d: %lld and "
                               "%lld do not broadcast to %lld", i,
                               (long long) ba[i], (long long) bb[i],
                               (long long) batch[i]);
    int64_t nbatch, na, nb, want;
    if (!kiln_kprod (batch, r, &nbatch) || !kiln_kprod (ba, r, &na)
        || !kiln_kprod (bb, r, &nb))
        return kiln_error (err, KILN_EFORMAT, "bad batch shape");
    int64_t da[KILN_MAX_RANK + 2], db[KILN_MAX_RANK + 2];
    int64_t sta[KILN_MAX_RANK + 2], stb[KILN_MAX_RANK + 2];
    bool a_strided, b_strided = false;
    memcpy (da, ba, (size_t) r * sizeof *da);
    memcpy (db, bb, (size_t) r * sizeof *db);
    da[r] = m;
    da[r + 1] = k;
    db[r] = k;
    db[r + 1] = n;
    if (!kiln_kmul3 (na, m, k, &want))
        return kiln_error (err, KILN_EFORMAT, "A is too large");
    if ((rc = s_get_operand_strides (p, op, "a_strides", "a_offset", plan->in[0], r,
                                     da, sta, &plan->u.mm.aoff, &a_strided, err))
        || (!a_strided && (rc = kiln_kneed_numel (p, plan->in[0], want, "A", err))))
        return rc;
    if (plan->u.mm.packed_b) {
        if (nb != 1 || !kiln_pack_b_elems (k, n, &want))
            return kiln_error (err, KILN_EFORMAT, "a packed B must be one matrix");
        if ((rc = kiln_kneed_numel (p, plan->in[1], want, "packed B", err)))
            return rc;
        if (kiln_prog_op_has (op, "b_strides") || kiln_prog_op_has (op, "b_offset"))
            return kiln_error (err, KILN_EFORMAT, "a packed B has no strides");
        plan->u.mm.boff = 0;
    } else {
        if (!kiln_kmul3 (nb, k, n, &want))
            return kiln_error (err, KILN_EFORMAT, "B is too large");
        if ((rc = s_get_operand_strides (p, op, "b_strides", "b_offset", plan->in[1],
                                         r, db, stb, &plan->u.mm.boff, &b_strided,
                                         err))
            || (!b_strided && (rc = kiln_kneed_numel (p, plan->in[1], want, "B", err))))
            return rc;
    }
    float alpha;
    if ((rc = s_get_alpha (op, &alpha, err)))
        return rc;
    plan->u.mm.alpha = alpha;
    if (!kiln_kmul3 (nbatch, m, n, &want)
        || (rc = kiln_kneed_numel (p, plan->out, want, "the output", err)))
        return rc ? rc : kiln_error (err, KILN_EFORMAT, "output is too large");
    int64_t dy[KILN_MAX_RANK + 2], sty[KILN_MAX_RANK + 2], yoff;
    bool y_strided;
    memcpy (dy, batch, (size_t) r * sizeof *dy);
    dy[r] = m;
    dy[r + 1] = n;
    if ((rc = s_get_operand_strides (p, op, "y_strides", NULL, plan->out, r, dy, sty,
                                     &yoff, &y_strided, err)))
        return rc;
    if (y_strided && sty[r + 1] != 1 && n > 1)
        return kiln_error (err, KILN_EFORMAT, "y_strides: the columns must be "
                           "contiguous");
    if (y_strided && (kiln_prog_op_has (op, "residual") || !kiln_kblas_ok (sty[r])
                      || sty[r] < n))
        return kiln_error (err, KILN_EFORMAT, "y_strides: rows %lld apart for %lld "
                           "columns, or with a residual", (long long) sty[r],
                           (long long) n);
    /* A, B, then the bias of n (broadcast over rows), then the residual. */
    int extra = plan->n_in - 2 - (plan->epi.residual >= 0);
    if (extra < 0 || extra > 1)
        return kiln_error (err, KILN_EFORMAT, "takes A, B, an optional bias and "
                           "an optional residual");
    plan->u.mm.bias = extra ? 2 : -1;
    if (extra && (rc = kiln_kneed_numel (p, plan->in[2], n, "the bias", err)))
        return rc;

    plan->u.mm.m = (int) m;
    plan->u.mm.n = (int) n;
    plan->u.mm.k = (int) k;
    plan->u.mm.rank = r;
    plan->u.mm.nbatch = nbatch;
    for (int i = r - 1; i >= 0; i--) {
        plan->u.mm.batch[i] = batch[i];
        plan->u.mm.sa[i] = ba[i] == 1 ? 0 : sta[i];
        plan->u.mm.sb[i] = bb[i] == 1 || plan->u.mm.packed_b ? 0 : stb[i];
        plan->u.mm.sy[i] = sty[i];
    }
    plan->u.mm.yrs = y_strided ? sty[r] : n;
    plan->u.mm.ars = sta[r];
    plan->u.mm.acs = sta[r + 1];
    plan->u.mm.brs = plan->u.mm.packed_b ? n : stb[r];
    plan->u.mm.bcs = plan->u.mm.packed_b ? 1 : stb[r + 1];
    /* B shared by every batch and A dense, not broadcast: the batch is
     * just more rows of one product. */
    int64_t rows;
    plan->u.mm.flat = nb == 1 && na == nbatch && !a_strided && !y_strided
                      && !__builtin_mul_overflow (nbatch, m, &rows)
                      && kiln_kblas_ok (rows);
    /* Every product runs on the engine, k = 0 too (its epilogue of
     * zeros).  (OpenBLAS ran the products of activations until the
     * engine was measured beside it on a Sapphire Rapids vCPU:
     * attention's per-head products at 22 GFLOP/s there against the
     * engine's 115.) */
    plan->ws_bytes = kiln_gemm_ws_bytes (plan->u.mm.flat ? nbatch * m : m, n, k, false,
                                         plan->u.mm.packed_b);
    return 0;
}

/* Product `idx` of a matmul run by kiln_gemm: one per batch element, or
 * one over all rows when the batch is flat. */
static void
s_mm_get (const void *ctx_, int64_t idx, kiln_gemm_t *g)
{
    const kiln_kgctx_t *ctx = ctx_;
    const kiln_kplan_t *plan = ctx->plan;
    void *const *data = ctx->data;
    int64_t m = plan->u.mm.m, n = plan->u.mm.n, k = plan->u.mm.k;
    int64_t oa = plan->u.mm.aoff, ob = plan->u.mm.boff, oy = 0, rows = m;
    if (plan->u.mm.flat) {
        rows = plan->u.mm.nbatch * m;
    } else {
        int64_t rest = idx;
        for (int i = plan->u.mm.rank - 1; i >= 0; i--) {
            int64_t ii = rest % plan->u.mm.batch[i];
            rest /= plan->u.mm.batch[i];
            oa += ii * plan->u.mm.sa[i];
            ob += ii * plan->u.mm.sb[i];
            oy += ii * plan->u.mm.sy[i];
        }
    }
    float *y = (float *) data[plan->out] + oy;
    memset (g, 0, sizeof *g);
    g->m = rows;
    g->n = n;
    g->k = k;
    g->a = (kiln_gsrc_t) { KILN_GSRC_STRIDED, (const float *) data[plan->in[0]] + oa,
                           plan->u.mm.ars, plan->u.mm.acs, NULL };
    if (plan->u.mm.packed_b)
        g->b = (kiln_gsrc_t) { KILN_GSRC_PACKED, data[plan->in[1]], 0, 0, NULL };
    else
        g->b = (kiln_gsrc_t) { KILN_GSRC_STRIDED,
                               (const float *) data[plan->in[1]] + ob,
                               plan->u.mm.brs, plan->u.mm.bcs, NULL };
    g->b_half = plan->u.mm.packed_b ? plan->u.mm.b_half : (kiln_dtype_t) 0;
    g->c = y;
    g->ldc = plan->u.mm.yrs;
    g->alpha = plan->u.mm.alpha;
    if (plan->u.mm.bias >= 0)
        g->add[g->n_add++] = (kiln_gadd_t) { data[plan->in[plan->u.mm.bias]],
                                             0, 1, 1.0f };
    if (plan->epi.residual >= 0)
        g->add[g->n_add++] = (kiln_gadd_t) {
            (const float *) data[plan->in[plan->epi.residual]] + idx * m * n,
            n, 1, 1.0f };
    g->act = plan->epi.act;
    g->act_a = plan->epi.a;
    g->act_b = plan->epi.b;
}

void
kiln_krun_MATMUL (const kiln_kplan_t *plan, void *const *data)
{
    if (plan->u.mm.nbatch == 0 || plan->u.mm.m == 0 || plan->u.mm.n == 0)
        return;
    kiln_kgctx_t ctx = { plan, data };
    kiln_gemm_run (s_mm_get, &ctx, plan->u.mm.flat ? 1 : plan->u.mm.nbatch);
}

int
kiln_kprepare_GEMM (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                kiln_err_t *err)
{
    int64_t m, n, k, ta, tb, want;
    double alpha, beta = 0.0;
    int rc;
    if ((rc = s_get_mnk (op, &m, &n, &k, err))
        || (rc = kiln_prog_op_int (op, "trans_a", &ta, err))
        || (rc = kiln_prog_op_int (op, "trans_b", &tb, err))
        || (rc = kiln_prog_op_float (op, "alpha", &alpha, err))
        || (rc = kiln_kernel_epilogue (p, op, plan, err))
        || (rc = kiln_kget_packed (op, "packed_b", &plan->u.gemm.packed_b, err))
        || (rc = s_need_f32_packed_b (p, plan, plan->u.gemm.packed_b,
                                      &plan->u.gemm.b_half, err)))
        return rc;
    if ((ta != 0 && ta != 1) || (tb != 0 && tb != 1))
        return kiln_error (err, KILN_EFORMAT, "trans_a and trans_b must be 0 or 1");
    if (plan->u.gemm.packed_b && !kiln_pack_b_elems (k, n, &want))
        return kiln_error (err, KILN_EFORMAT, "packed B too large");
    if (!kiln_kmul3 (m, k, 1, &want)
        || (rc = kiln_kneed_numel (p, plan->in[0], want, "A", err))
        || (!plan->u.gemm.packed_b && !kiln_kmul3 (k, n, 1, &want))
        || (plan->u.gemm.packed_b && !kiln_pack_b_elems (k, n, &want))
        || (rc = kiln_kneed_numel (p, plan->in[1], want, "B", err))
        || !kiln_kmul3 (m, n, 1, &want)
        || (rc = kiln_kneed_numel (p, plan->out, want, "the output", err)))
        return rc ? rc : kiln_error (err, KILN_EFORMAT, "operands too large");
    int extra = plan->n_in - 2 - (plan->epi.residual >= 0);
    if (extra < 0 || extra > 1)
        return kiln_error (err, KILN_EFORMAT, "takes A, B, an optional C and an "
                           "optional residual");
    plan->u.gemm.has_c = extra == 1;
    if (plan->u.gemm.has_c) {
        int64_t c[2];
        if ((rc = kiln_prog_op_float (op, "beta", &beta, err))
            || (rc = kiln_prog_op_ints (op, "shape_c", 2, c, err)))
            return rc;
        if ((c[0] != 1 && c[0] != m) || (c[1] != 1 && c[1] != n))
            return kiln_error (err, KILN_EFORMAT, "C of [%lld, %lld] does not "
                               "broadcast to [%lld, %lld]", (long long) c[0],
                               (long long) c[1], (long long) m, (long long) n);
        if ((rc = kiln_kneed_numel (p, plan->in[2], c[0] * c[1], "C", err)))
            return rc;
        plan->u.gemm.c0 = c[0];
        plan->u.gemm.c1 = c[1];
    }
    plan->u.gemm.m = (int) m;
    plan->u.gemm.n = (int) n;
    plan->u.gemm.k = (int) k;
    plan->u.gemm.ta = ta;
    plan->u.gemm.tb = tb;
    plan->u.gemm.alpha = (float) alpha;
    plan->u.gemm.beta = (float) beta;
    plan->ws_bytes = kiln_gemm_ws_bytes (m, n, k, false, plan->u.gemm.packed_b);
    return 0;
}

static void
s_gemm_get (const void *ctx_, int64_t idx, kiln_gemm_t *g)
{
    const kiln_kgctx_t *ctx = ctx_;
    const kiln_kplan_t *plan = ctx->plan;
    void *const *data = ctx->data;
    int64_t m = plan->u.gemm.m, n = plan->u.gemm.n, k = plan->u.gemm.k;
    memset (g, 0, sizeof *g);
    g->m = m;
    g->n = n;
    g->k = k;
    g->a = plan->u.gemm.ta
           ? (kiln_gsrc_t) { KILN_GSRC_STRIDED, data[plan->in[0]], 1, m, NULL }
           : (kiln_gsrc_t) { KILN_GSRC_STRIDED, data[plan->in[0]], k, 1, NULL };
    if (plan->u.gemm.packed_b)
        g->b = (kiln_gsrc_t) { KILN_GSRC_PACKED, data[plan->in[1]], 0, 0, NULL };
    else if (plan->u.gemm.tb)
        g->b = (kiln_gsrc_t) { KILN_GSRC_STRIDED, data[plan->in[1]], 1, k, NULL };
    else
        g->b = (kiln_gsrc_t) { KILN_GSRC_STRIDED, data[plan->in[1]], n, 1, NULL };
    g->b_half = plan->u.gemm.packed_b ? plan->u.gemm.b_half : (kiln_dtype_t) 0;
    g->c = data[plan->out];
    g->ldc = n;
    g->alpha = plan->u.gemm.alpha;
    if (plan->u.gemm.has_c)
        g->add[g->n_add++] = (kiln_gadd_t) {
            data[plan->in[2]], plan->u.gemm.c0 == 1 ? 0 : plan->u.gemm.c1,
            plan->u.gemm.c1 == 1 ? 0 : 1, plan->u.gemm.beta };
    if (plan->epi.residual >= 0)
        g->add[g->n_add++] = (kiln_gadd_t) { data[plan->in[plan->epi.residual]],
                                             n, 1, 1.0f };
    g->act = plan->epi.act;
    g->act_a = plan->epi.a;
    g->act_b = plan->epi.b;
}

void
kiln_krun_GEMM (const kiln_kplan_t *plan, void *const *data)
{
    if (plan->u.gemm.m == 0 || plan->u.gemm.n == 0)
        return;
    kiln_kgctx_t ctx = { plan, data };
    kiln_gemm_run (s_gemm_get, &ctx, 1);
}

/* --- attention ------------------------------------------------------ */

/* Scores a task holds at most (its block of queries against every key),
 * in L2 while they go from the first product through the softmax into
 * the second, and the tasks a product is cut into at least, when its
 * queries allow: both functions of the shape alone, so that the sums do
 * not depend on the thread count. */
#define S_ATTN_FLOATS (48 * 1024)
#define S_ATTN_TASKS  8

/* Y = softmax (alpha · Q · Kᵀ + mask) · V over the last axis, for each
 * batch element: Q [m, k], Kᵀ [k, n] (the keys as columns), V [n, nv],
 * the mask [m, n] (strides of 0 broadcast it), Y [m, nv]; each operand
 * a strided view of its tensor, as matmul's (`q_strides`, `kt_strides`,
 * `v_strides`, `mask_strides`, `y_strides`: the batch dimensions, then
 * the rows and columns; `*_offset` the first element).  The scores
 * never leave the task's workspace. */
int
kiln_kprepare_ATTENTION (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                         kiln_err_t *err)
{
    int64_t m, n, k, nv;
    int rc;
    if ((rc = s_get_mnk (op, &m, &n, &k, err))
        || (rc = kiln_prog_op_int (op, "nv", &nv, err))
        || (rc = kiln_kneed_f32 (p, plan, err)))
        return rc;
    if (!kiln_kblas_ok (nv))
        return kiln_error (err, KILN_EFORMAT, "nv must be in 0..%d", INT_MAX);
    int64_t batch[KILN_PROG_MAX_PARAM_INTS];
    int r;
    if ((rc = kiln_prog_op_ints_any (op, "batch", batch, &r, err)))
        return rc;
    if (r > KILN_MAX_RANK)
        return kiln_error (err, KILN_EFORMAT, "batch rank %d", r);
    for (int i = 0; i < r; i++)
        if (batch[i] < 0)
            return kiln_error (err, KILN_EFORMAT, "batch dimension %d is %lld", i,
                               (long long) batch[i]);
    bool mask = plan->n_in == 4;
    int64_t nbatch, want;
    if (!kiln_kprod (batch, r, &nbatch) || !kiln_kmul3 (nbatch, m, nv, &want))
        return kiln_error (err, KILN_EFORMAT, "bad batch shape");
    if ((rc = kiln_kneed_numel (p, plan->out, want, "the output", err)))
        return rc;
    /* each operand's strides (its dims: the batch, its rows and columns;
     * an operand broadcast along a batch dimension has a stride of 0
     * there); Y's may be left out (dense, its size checked above) */
    int64_t st[5][KILN_MAX_RANK + 2], off[5];
    const int64_t rows[5] = { m, k, n, m, m }, cols[5] = { k, n, nv, n, nv };
    static const char *const sname[5] = { "q_strides", "kt_strides", "v_strides",
                                          "mask_strides", "y_strides" };
    static const char *const oname[5] = { "q_offset", "kt_offset", "v_offset",
                                          "mask_offset", NULL };
    static const char *const what[5] = { "Q", "Kᵀ", "V", "the mask", "the output" };
    for (int w = 0; w < 5; w++) {
        if (w == 3 && !mask)
            continue;
        int t = w == 4 ? plan->out : plan->in[w];
        bool strided;
        int64_t d[KILN_MAX_RANK + 2];
        memcpy (d, batch, (size_t) r * sizeof *d);
        d[r] = rows[w];
        d[r + 1] = cols[w];
        if ((rc = s_get_operand_strides (p, op, sname[w], oname[w], t, r, d, st[w],
                                         &off[w], &strided, err)))
            return rc;
        if (!strided && w < 4)
            return kiln_error (err, KILN_EFORMAT, "%s without %s", what[w], sname[w]);
    }
    if (st[4][r + 1] != 1 && nv > 1)
        return kiln_error (err, KILN_EFORMAT, "y_strides: the columns must be "
                           "contiguous");
    if (!kiln_kblas_ok (st[4][r]) || (st[4][r] < nv && m > 1))
        return kiln_error (err, KILN_EFORMAT, "y_strides: rows %lld apart for %lld "
                           "columns", (long long) st[4][r], (long long) nv);
    float alpha;
    if ((rc = s_get_alpha (op, &alpha, err)))
        return rc;

    kiln_kattn_plan_t *a = &plan->u.attn;
    a->m = m;
    a->n = n;
    a->k = k;
    a->nv = nv;
    a->rank = r;
    a->nbatch = nbatch;
    a->mask = mask;
    a->alpha = alpha;
    for (int i = 0; i < r; i++) {
        a->batch[i] = batch[i];
        a->sq[i] = st[0][i];
        a->sk[i] = st[1][i];
        a->sv[i] = st[2][i];
        a->sm[i] = mask ? st[3][i] : 0;
        a->sy[i] = st[4][i];
    }
    a->qoff = off[0];
    a->koff = off[1];
    a->voff = off[2];
    a->moff = mask ? off[3] : 0;
    a->qrs = st[0][r];
    a->qcs = st[0][r + 1];
    a->krs = st[1][r];
    a->kcs = st[1][r + 1];
    a->vrs = st[2][r];
    a->vcs = st[2][r + 1];
    a->mrs = mask ? st[3][r] : 0;
    a->mcs = mask ? st[3][r + 1] : 0;
    a->yrs = st[4][r];
    /* the scores' rows 64 bytes apart; as many queries a task as fit in
     * S_ATTN_FLOATS, fewer while the product makes fewer than
     * S_ATTN_TASKS tasks and each keeps two row panels */
    a->ldp = (n + 15) / 16 * 16;
    int64_t qb = S_ATTN_FLOATS / (a->ldp ? a->ldp : 16) / KILN_PACK_MR * KILN_PACK_MR;
    if (qb < KILN_PACK_MR)
        qb = KILN_PACK_MR;
    if (qb > m)
        qb = m ? m : 1;
    while (nbatch < S_ATTN_TASKS && nbatch * ((m + qb - 1) / qb) < S_ATTN_TASKS
           && qb >= 4 * KILN_PACK_MR)
        qb = (qb / 2 + KILN_PACK_MR - 1) / KILN_PACK_MR * KILN_PACK_MR;
    a->qb = qb;
    size_t g1 = kiln_gemm_ws_bytes (qb, n, k, false, false);
    size_t g2 = kiln_gemm_ws_bytes (qb, nv, n, false, false);
    plan->ws_bytes = (size_t) (qb + 1) * (size_t) a->ldp * sizeof (float)
                     + (g1 > g2 ? g1 : g2) + 128;
    return 0;
}

typedef struct {
    const kiln_kplan_t *plan;
    void *const *data;
    float *ws;
    size_t ws_stride;       /* floats per worker */
    int64_t nqb;            /* blocks of queries a batch element */
    int64_t first;          /* task 0 of this section */
} s_attn_run_t;

static void
s_attn_task (void *arg, int task, int worker)
{
    const s_attn_run_t *r = arg;
    const kiln_kplan_t *plan = r->plan;
    const kiln_kattn_plan_t *a = &plan->u.attn;
    void *const *data = r->data;
    int64_t t = r->first + task, b = t / r->nqb, i0 = t % r->nqb * a->qb;
    int64_t rows = a->m - i0 < a->qb ? a->m - i0 : a->qb;
    int64_t oq = a->qoff, ok = a->koff, ov = a->voff, om = a->moff, oy = 0;
    for (int i = a->rank - 1; i >= 0; i--) {
        int64_t ii = b % a->batch[i];
        b /= a->batch[i];
        oq += ii * a->sq[i];
        ok += ii * a->sk[i];
        ov += ii * a->sv[i];
        om += ii * a->sm[i];
        oy += ii * a->sy[i];
    }
    float *s = r->ws + (size_t) worker * r->ws_stride;
    float *gws = s + (a->qb + 1) * a->ldp;
    kiln_gemm_t g;
    memset (&g, 0, sizeof g);
    g.m = rows;
    g.n = a->n;
    g.k = a->k;
    g.a = (kiln_gsrc_t) { KILN_GSRC_STRIDED,
                          (const float *) data[plan->in[0]] + oq + i0 * a->qrs,
                          a->qrs, a->qcs, NULL };
    g.b = (kiln_gsrc_t) { KILN_GSRC_STRIDED, (const float *) data[plan->in[1]] + ok,
                          a->krs, a->kcs, NULL };
    g.c = s + a->ldp;
    g.ldc = a->ldp;
    g.alpha = a->alpha;
    if (a->mask)
        g.add[g.n_add++] = (kiln_gadd_t) {
            (const float *) data[plan->in[3]] + om + i0 * a->mrs, a->mrs, a->mcs, 1.0f };
    kiln_gemm_here (&g, gws);
    /* the scores lie a row down (row i at s + (i + 1)·ldp): each row's
     * probabilities go a row up, where the row before it was read, so
     * that softmax's input and output never overlap and nothing is copied */
    for (int64_t i = 0; a->n > 0 && i < rows; i++)
        kiln_vsoftmax_row (s + (i + 1) * a->ldp, s + i * a->ldp, a->n, false);
    memset (&g, 0, sizeof g);
    g.m = rows;
    g.n = a->nv;
    g.k = a->n;
    g.a = (kiln_gsrc_t) { KILN_GSRC_STRIDED, s, a->ldp, 1, NULL };
    g.b = (kiln_gsrc_t) { KILN_GSRC_STRIDED, (const float *) data[plan->in[2]] + ov,
                          a->vrs, a->vcs, NULL };
    g.c = (float *) data[plan->out] + oy + i0 * a->yrs;
    g.ldc = a->yrs;
    g.alpha = 1.0f;
    kiln_gemm_here (&g, gws);
}

void
kiln_krun_ATTENTION (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kattn_plan_t *a = &plan->u.attn;
    if (a->nbatch == 0 || a->m == 0 || a->nv == 0)
        return;
    size_t bytes;
    float *ws = kiln_exec_ws (&bytes);
    s_attn_run_t r = { plan, data, ws, bytes / sizeof (float), (a->m + a->qb - 1) / a->qb,
                       0 };
    int64_t tasks = a->nbatch * r.nqb;
    for (int64_t first = 0; first < tasks; first += 1 << 30) {
        r.first = first;
        kiln_exec_parallel (s_attn_task, &r, (int) (tasks - first < 1 << 30
                                                    ? tasks - first : 1 << 30));
    }
}
