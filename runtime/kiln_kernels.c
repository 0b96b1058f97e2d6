#include "runtime/kiln_kernels.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cblas.h>

#include "common/kiln_pack.h"
#include "runtime/kiln_exec.h"
#include "runtime/kiln_gemm.h"
#include "runtime/kiln_vmath.h"

typedef int (*s_prepare_fn) (kiln_program_t *p, kiln_prog_op_t *op,
                             kiln_kplan_t *plan, kiln_err_t *err);
typedef void (*s_run_fn) (const kiln_kplan_t *plan, void *const *data);

/* --- checks shared by the prepare functions ------------------------- */

static const kiln_prog_tensor_t *
s_t (const kiln_program_t *p, int t)
{
    return &p->tensors[t];
}


/* a * b * c ... into *out, false on overflow or a negative factor. */
static bool
s_prod (const int64_t *v, int n, int64_t *out)
{
    int64_t r = 1;
    for (int i = 0; i < n; i++)
        if (v[i] < 0 || __builtin_mul_overflow (r, v[i], &r))
            return false;
    *out = r;
    return true;
}

static bool
s_mul3 (int64_t a, int64_t b, int64_t c, int64_t *out)
{
    int64_t v[3] = { a, b, c };
    return s_prod (v, 3, out);
}

static int
s_need_f32 (const kiln_program_t *p, const kiln_kplan_t *plan, kiln_err_t *err)
{
    for (int i = 0; i < plan->n_in; i++)
        if (s_t (p, plan->in[i])->dtype != KILN_DT_FLOAT32)
            return kiln_error (err, KILN_EFORMAT, "input %d is %s, not float32",
                               i, kiln_dtype_name (s_t (p, plan->in[i])->dtype));
    if (s_t (p, plan->out)->dtype != KILN_DT_FLOAT32)
        return kiln_error (err, KILN_EFORMAT, "output is %s, not float32",
                           kiln_dtype_name (s_t (p, plan->out)->dtype));
    return 0;
}

/* Operand `what` must hold exactly `want` elements. */
static int
s_need_numel (const kiln_program_t *p, int t, int64_t want, const char *what,
              kiln_err_t *err)
{
    if (kiln_ktensor_numel (s_t (p, t)) != want)
        return kiln_error (err, KILN_EFORMAT, "%s holds %lld elements, the "
                           "parameters say %lld", what,
                           (long long) kiln_ktensor_numel (s_t (p, t)), (long long) want);
    return 0;
}

static bool
s_blas_ok (int64_t v)
{
    return v >= 0 && v <= INT_MAX;
}

/* --- copy ----------------------------------------------------------- */

static int
s_prepare_COPY (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                kiln_err_t *err)
{
    const kiln_prog_tensor_t *x = s_t (p, plan->in[0]), *y = s_t (p, plan->out);
    if (x->size != y->size || x->dtype != y->dtype)
        return kiln_error (err, KILN_EFORMAT, "copies %llu bytes of %s into "
                           "%llu bytes of %s", (unsigned long long) x->size,
                           kiln_dtype_name (x->dtype),
                           (unsigned long long) y->size,
                           kiln_dtype_name (y->dtype));
    plan->u.flat.n = (int64_t) x->size;
    return 0;
}

static void
s_run_COPY (const kiln_kplan_t *plan, void *const *data)
{
    if (data[plan->out] != data[plan->in[0]])
        memmove (data[plan->out], data[plan->in[0]], (size_t) plan->u.flat.n);
}

/* --- elementwise with broadcasting ---------------------------------- */

static int
s_prepare_binary (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                  kiln_err_t *err)
{
    /* Other dtypes have their loops in kiln_kernels_math.c. */
    if (s_t (p, plan->out)->dtype != KILN_DT_FLOAT32)
        return kiln_kmath_prepare_arith (p, op, plan, err);
    int rc = s_need_f32 (p, plan, err);
    if (rc)
        return rc;
    const kiln_prog_tensor_t *y = s_t (p, plan->out);
    int r = y->shape.rank;
    int64_t da[KILN_PROG_MAX_PARAM_INTS], db[KILN_PROG_MAX_PARAM_INTS];
    if ((rc = kiln_prog_op_ints (op, "shape_a", r, da, err))
        || (rc = kiln_prog_op_ints (op, "shape_b", r, db, err)))
        return rc;
    int64_t na, nb;
    for (int i = 0; i < r; i++) {
        int64_t d = y->shape.dims[i];
        if ((da[i] != d && da[i] != 1) || (db[i] != d && db[i] != 1))
            return kiln_error (err, KILN_EFORMAT, "dimension %d: %lld and %lld "
                               "do not broadcast to %lld", i, (long long) da[i],
                               (long long) db[i], (long long) d);
    }
    if (!s_prod (da, r, &na) || !s_prod (db, r, &nb))
        return kiln_error (err, KILN_EFORMAT, "bad operand shapes");
    if ((rc = s_need_numel (p, plan->in[0], na, "A", err))
        || (rc = s_need_numel (p, plan->in[1], nb, "B", err)))
        return rc;

    /* Strides in elements over the output's dimensions, 0 where an
     * operand is broadcast; then drop unit dimensions and merge the
     * neighbours that are contiguous in all three tensors, so that the
     * inner loop is as long as possible. */
    int64_t sa[KILN_MAX_RANK], sb[KILN_MAX_RANK], ca = 1, cb = 1;
    for (int i = r - 1; i >= 0; i--) {
        sa[i] = da[i] == 1 ? 0 : ca;
        sb[i] = db[i] == 1 ? 0 : cb;
        ca *= da[i];
        cb *= db[i];
    }
    int n = 0;
    for (int i = 0; i < r; i++) {
        int64_t d = y->shape.dims[i];
        if (d == 1)
            continue;
        if (n > 0 && plan->u.bin.sa[n - 1] == sa[i] * d
            && plan->u.bin.sb[n - 1] == sb[i] * d) {
            plan->u.bin.dims[n - 1] *= d;
            plan->u.bin.sa[n - 1] = sa[i];
            plan->u.bin.sb[n - 1] = sb[i];
            continue;
        }
        plan->u.bin.dims[n] = d;
        plan->u.bin.sa[n] = sa[i];
        plan->u.bin.sb[n] = sb[i];
        n++;
    }
    if (n == 0) {
        plan->u.bin.dims[0] = 1;
        plan->u.bin.sa[0] = plan->u.bin.sb[0] = 0;
        n = 1;
    }
    plan->u.bin.rank = n;
    return 0;
}

/* One binary kernel per operation; the inner loop is specialised for the
 * common stride patterns (both contiguous, one side a scalar). */
#define S_BINARY_KERNEL(NAME, EXPR)                                           \
    KILN_VCLONES static void                                                  \
    s_run_##NAME (const kiln_kplan_t *plan, void *const *data)                \
    {                                                                         \
        const float *a = data[plan->in[0]], *b = data[plan->in[1]];           \
        float *y = data[plan->out];                                           \
        int r = plan->u.bin.rank;                                             \
        int64_t n = plan->u.bin.dims[r - 1];                                  \
        int64_t ia = plan->u.bin.sa[r - 1], ib = plan->u.bin.sb[r - 1];      \
        int64_t outer = 1, idx[KILN_MAX_RANK] = { 0 };                        \
        for (int i = 0; i < r - 1; i++)                                       \
            outer *= plan->u.bin.dims[i];                                     \
        int64_t oa = 0, ob = 0;                                               \
        for (int64_t o = 0; o < outer; o++) {                                 \
            const float *pa = a + oa, *pb = b + ob;                           \
            float *py = y + o * n;                                            \
            if (ia == 1 && ib == 1)                                           \
                for (int64_t j = 0; j < n; j++) {                             \
                    float x0 = pa[j], x1 = pb[j];                             \
                    py[j] = (EXPR);                                           \
                }                                                             \
            else if (ia == 1 && ib == 0) {                                    \
                float x1 = pb[0];                                             \
                for (int64_t j = 0; j < n; j++) {                             \
                    float x0 = pa[j];                                         \
                    py[j] = (EXPR);                                           \
                }                                                             \
            } else if (ia == 0 && ib == 1) {                                  \
                float x0 = pa[0];                                             \
                for (int64_t j = 0; j < n; j++) {                             \
                    float x1 = pb[j];                                         \
                    py[j] = (EXPR);                                           \
                }                                                             \
            } else                                                            \
                for (int64_t j = 0; j < n; j++) {                             \
                    float x0 = pa[j * ia], x1 = pb[j * ib];                   \
                    py[j] = (EXPR);                                           \
                }                                                             \
            /* Advance the outer index like an odometer. */                   \
            for (int i = r - 2; i >= 0; i--) {                                \
                idx[i]++;                                                     \
                oa += plan->u.bin.sa[i];                                      \
                ob += plan->u.bin.sb[i];                                      \
                if (idx[i] < plan->u.bin.dims[i])                             \
                    break;                                                    \
                oa -= plan->u.bin.sa[i] * plan->u.bin.dims[i];                \
                ob -= plan->u.bin.sb[i] * plan->u.bin.dims[i];                \
                idx[i] = 0;                                                   \
            }                                                                 \
        }                                                                     \
    }

S_BINARY_KERNEL (ADD, x0 + x1)
S_BINARY_KERNEL (SUB, x0 - x1)
S_BINARY_KERNEL (MUL, x0 * x1)
S_BINARY_KERNEL (DIV, x0 / x1)

#define s_prepare_ADD s_prepare_binary
#define s_prepare_SUB s_prepare_binary
#define s_prepare_MUL s_prepare_binary
#define s_prepare_DIV s_prepare_binary

static int
s_prepare_RELU (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                kiln_err_t *err)
{
    int rc = s_need_f32 (p, plan, err);
    if (rc)
        return rc;
    int64_t n = kiln_ktensor_numel (s_t (p, plan->in[0]));
    if ((rc = s_need_numel (p, plan->out, n, "the output", err)))
        return rc;
    plan->u.flat.n = n;
    return 0;
}

KILN_VCLONES static void
s_run_RELU (const kiln_kplan_t *plan, void *const *data)
{
    const float *x = data[plan->in[0]];
    float *y = data[plan->out];
    /* x < 0 is false for NaN, which passes through. */
    for (int64_t i = 0; i < plan->u.flat.n; i++)
        y[i] = x[i] < 0.0f ? 0.0f : x[i];
}

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
    if (!s_blas_ok (*m) || !s_blas_ok (*n) || !s_blas_ok (*k))
        return kiln_error (err, KILN_EFORMAT, "m, n and k must be in 0..%d",
                           INT_MAX);
    return 0;
}

/* The fused epilogue of conv2d, gemm and matmul (and batch_norm's
 * activation): `activation` (with `act_alpha`, `act_beta`) applied last,
 * and `residual` (1: the last operand, shaped like the output, is added
 * before the activation). */
int
kiln_kernel_epilogue (const kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                kiln_err_t *err)
{
    int64_t v;
    int rc;
    plan->epi.act = KILN_ACT_NONE;
    plan->epi.residual = -1;
    if (kiln_prog_op_has (op, "activation")) {
        if ((rc = kiln_prog_op_int (op, "activation", &v, err)))
            return rc;
        if (v < 0 || v >= KILN_ACT_COUNT)
            return kiln_error (err, KILN_EFORMAT, "unknown activation %lld",
                               (long long) v);
        plan->epi.act = (kiln_act_t) v;
        double a = 0, b = 0;
        if ((v == KILN_ACT_CLIP || v == KILN_ACT_HARD_SIGMOID)
            && ((rc = kiln_prog_op_float (op, "act_alpha", &a, err))
                || (rc = kiln_prog_op_float (op, "act_beta", &b, err))))
            return rc;
        if (v == KILN_ACT_LEAKY
            && (rc = kiln_prog_op_float (op, "act_alpha", &a, err)))
            return rc;
        if (a != a || b != b)
            return kiln_error (err, KILN_EFORMAT, "activation bounds are NaN");
        plan->epi.a = (float) a;
        plan->epi.b = (float) b;
    }
    if (kiln_prog_op_has (op, "residual")) {
        if ((rc = kiln_prog_op_int (op, "residual", &v, err)))
            return rc;
        if (v != 0 && v != 1)
            return kiln_error (err, KILN_EFORMAT, "residual must be 0 or 1");
        if (v) {
            if (plan->n_in < 3)
                return kiln_error (err, KILN_EFORMAT, "residual needs an operand");
            plan->epi.residual = plan->n_in - 1;
            if ((rc = s_need_numel (p, plan->in[plan->n_in - 1],
                                    kiln_ktensor_numel (s_t (p, plan->out)), "the residual",
                                    err)))
                return rc;
        }
    }
    return 0;
}

static bool
s_has_epilogue (const kiln_kplan_t *plan)
{
    return plan->epi.act != KILN_ACT_NONE || plan->epi.residual >= 0;
}

/* The epilogue over a whole output, after a BLAS product. */
static void
s_epilogue_after (const kiln_kplan_t *plan, void *const *data, float *y,
                  int64_t n)
{
    if (plan->epi.residual >= 0) {
        const float *r = data[plan->in[plan->epi.residual]];
        for (int64_t i = 0; i < n; i++)
            y[i] += r[i];
    }
    kiln_act_apply (y, n, plan->epi.act, plan->epi.a, plan->epi.b);
}

/* A packed B (input 1) may be float16 or bfloat16, which the engine
 * widens a panel at a time; every other operand is float32.  The B's
 * dtype goes to *half (0: float32). */
static int
s_need_f32_packed_b (const kiln_program_t *p, const kiln_kplan_t *plan,
                     bool packed_b, kiln_dtype_t *half, kiln_err_t *err)
{
    kiln_dtype_t bt = s_t (p, plan->in[1])->dtype;
    *half = (kiln_dtype_t) 0;
    if (!packed_b || !kiln_dtype_is_half (bt))
        return s_need_f32 (p, plan, err);
    for (int i = 0; i < plan->n_in; i++)
        if (i != 1 && s_t (p, plan->in[i])->dtype != KILN_DT_FLOAT32)
            return kiln_error (err, KILN_EFORMAT, "input %d is %s, not float32",
                               i, kiln_dtype_name (s_t (p, plan->in[i])->dtype));
    if (s_t (p, plan->out)->dtype != KILN_DT_FLOAT32)
        return kiln_error (err, KILN_EFORMAT, "output is %s, not float32",
                           kiln_dtype_name (s_t (p, plan->out)->dtype));
    *half = bt;
    return 0;
}

/* `packed_b` (optional, 0/1) */
static int
s_get_packed (kiln_prog_op_t *op, const char *name, bool *out, kiln_err_t *err)
{
    int64_t v = 0;
    int rc;
    if (kiln_prog_op_has (op, name) && (rc = kiln_prog_op_int (op, name, &v, err)))
        return rc;
    if (v != 0 && v != 1)
        return kiln_error (err, KILN_EFORMAT, "%s must be 0 or 1", name);
    *out = v == 1;
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
        if (*off < 0 || *off >= kiln_ktensor_numel (s_t (p, t)))
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
    if (last >= kiln_ktensor_numel (s_t (p, t)))
        return kiln_error (err, KILN_EFORMAT, "%s reach element %lld of a tensor "
                           "of %lld", name, (long long) last,
                           (long long) kiln_ktensor_numel (s_t (p, t)));
    return 0;
}

/* OpenBLAS takes a row-major operand of rows × cols with strides (rs, cs)
 * when one of them is 1 and the other a legal leading dimension. */
static bool
s_blas_operand (int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                CBLAS_TRANSPOSE *trans, int *ld)
{
    int64_t l;
    if (cs == 1 && rs >= (cols > 1 ? cols : 1)) {
        *trans = CblasNoTrans;
        l = rs;
    } else if (rs == 1 && cs >= (rows > 1 ? rows : 1)) {
        *trans = CblasTrans;
        l = cs;
    } else {
        return false;
    }
    *ld = (int) l;
    return s_blas_ok (l);
}

static int
s_prepare_MATMUL (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                  kiln_err_t *err)
{
    int64_t m, n, k;
    int rc;
    if ((rc = s_get_mnk (op, &m, &n, &k, err))
        || (rc = kiln_kernel_epilogue (p, op, plan, err))
        || (rc = s_get_packed (op, "packed_b", &plan->u.mm.packed_b, err))
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
    if (!s_prod (batch, r, &nbatch) || !s_prod (ba, r, &na)
        || !s_prod (bb, r, &nb))
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
    if (!s_mul3 (na, m, k, &want))
        return kiln_error (err, KILN_EFORMAT, "A is too large");
    if ((rc = s_get_operand_strides (p, op, "a_strides", "a_offset", plan->in[0], r,
                                     da, sta, &plan->u.mm.aoff, &a_strided, err))
        || (!a_strided && (rc = s_need_numel (p, plan->in[0], want, "A", err))))
        return rc;
    if (plan->u.mm.packed_b) {
        if (nb != 1 || !kiln_pack_b_elems (k, n, &want))
            return kiln_error (err, KILN_EFORMAT, "a packed B must be one matrix");
        if ((rc = s_need_numel (p, plan->in[1], want, "packed B", err)))
            return rc;
        if (kiln_prog_op_has (op, "b_strides") || kiln_prog_op_has (op, "b_offset"))
            return kiln_error (err, KILN_EFORMAT, "a packed B has no strides");
        plan->u.mm.boff = 0;
    } else {
        if (!s_mul3 (nb, k, n, &want))
            return kiln_error (err, KILN_EFORMAT, "B is too large");
        if ((rc = s_get_operand_strides (p, op, "b_strides", "b_offset", plan->in[1],
                                         r, db, stb, &plan->u.mm.boff, &b_strided,
                                         err))
            || (!b_strided && (rc = s_need_numel (p, plan->in[1], want, "B", err))))
            return rc;
    }
    double alpha = 1.0;
    if (kiln_prog_op_has (op, "alpha")
        && (rc = kiln_prog_op_float (op, "alpha", &alpha, err)))
        return rc;
    if (!isfinite (alpha))
        return kiln_error (err, KILN_EFORMAT, "alpha is not finite");
    plan->u.mm.alpha = (float) alpha;
    if (!s_mul3 (nbatch, m, n, &want)
        || (rc = s_need_numel (p, plan->out, want, "the output", err)))
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
    if (y_strided && (kiln_prog_op_has (op, "residual") || !s_blas_ok (sty[r])
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
    if (extra && (rc = s_need_numel (p, plan->in[2], n, "the bias", err)))
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
                      && s_blas_ok (rows);
    CBLAS_TRANSPOSE tr;
    int ld;
    plan->u.mm.engine = plan->u.mm.packed_b || plan->u.mm.bias >= 0
                        || s_has_epilogue (plan)
                        || (a_strided && !s_blas_operand (m, k, plan->u.mm.ars,
                                                          plan->u.mm.acs, &tr, &ld))
                        || (b_strided && !s_blas_operand (k, n, plan->u.mm.brs,
                                                          plan->u.mm.bcs, &tr, &ld));
    if (plan->u.mm.engine) {
        int64_t rows_a = plan->u.mm.flat ? nbatch * m : m;
        plan->ws_bytes = kiln_gemm_ws_bytes (rows_a, n, k, false,
                                             plan->u.mm.packed_b);
    }
    return 0;
}

typedef struct {
    const kiln_kplan_t *plan;
    void *const *data;
} s_gctx_t;

/* Product `idx` of a matmul run by kiln_gemm: one per batch element, or
 * one over all rows when the batch is flat. */
static void
s_mm_get (const void *ctx_, int64_t idx, kiln_gemm_t *g)
{
    const s_gctx_t *ctx = ctx_;
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

static void
s_run_MATMUL (const kiln_kplan_t *plan, void *const *data)
{
    const float *a = data[plan->in[0]], *b = data[plan->in[1]];
    float *y = data[plan->out];
    int m = plan->u.mm.m, n = plan->u.mm.n, k = plan->u.mm.k, r = plan->u.mm.rank;
    if (plan->u.mm.nbatch == 0 || m == 0 || n == 0)
        return;
    if (plan->u.mm.engine) {
        s_gctx_t ctx = { plan, data };
        kiln_gemm_run (s_mm_get, &ctx, plan->u.mm.flat ? 1 : plan->u.mm.nbatch);
        return;
    }
    if (k == 0) {
        /* a strided Y is a permutation of the whole output */
        memset (y, 0, (size_t) (plan->u.mm.nbatch * m * n) * sizeof *y);
        return;
    }
    a += plan->u.mm.aoff;
    b += plan->u.mm.boff;
    /* Dense operands (k, m, n >= 1 here) and the strided ones the plan
     * left to OpenBLAS all pass. */
    CBLAS_TRANSPOSE ta = CblasNoTrans, tb = CblasNoTrans;
    int lda = k, ldb = n;
    s_blas_operand (m, k, plan->u.mm.ars, plan->u.mm.acs, &ta, &lda);
    s_blas_operand (k, n, plan->u.mm.brs, plan->u.mm.bcs, &tb, &ldb);
    if (plan->u.mm.flat) {
        cblas_sgemm (CblasRowMajor, CblasNoTrans, tb,
                     (int) (plan->u.mm.nbatch * m), n, k, plan->u.mm.alpha, a, k,
                     b, ldb, 0.0f, y, n);
        return;
    }
    int64_t idx[KILN_MAX_RANK] = { 0 }, oa = 0, ob = 0, oy = 0;
    for (int64_t bi = 0; bi < plan->u.mm.nbatch; bi++) {
        cblas_sgemm (CblasRowMajor, ta, tb, m, n, k, plan->u.mm.alpha,
                     a + oa, lda, b + ob, ldb, 0.0f, y + oy, (int) plan->u.mm.yrs);
        for (int i = r - 1; i >= 0; i--) {
            idx[i]++;
            oa += plan->u.mm.sa[i];
            ob += plan->u.mm.sb[i];
            oy += plan->u.mm.sy[i];
            if (idx[i] < plan->u.mm.batch[i])
                break;
            oa -= plan->u.mm.sa[i] * plan->u.mm.batch[i];
            ob -= plan->u.mm.sb[i] * plan->u.mm.batch[i];
            oy -= plan->u.mm.sy[i] * plan->u.mm.batch[i];
            idx[i] = 0;
        }
    }
}

static int
s_prepare_GEMM (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
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
        || (rc = s_get_packed (op, "packed_b", &plan->u.gemm.packed_b, err))
        || (rc = s_need_f32_packed_b (p, plan, plan->u.gemm.packed_b,
                                      &plan->u.gemm.b_half, err)))
        return rc;
    if ((ta != 0 && ta != 1) || (tb != 0 && tb != 1))
        return kiln_error (err, KILN_EFORMAT, "trans_a and trans_b must be 0 or 1");
    if (plan->u.gemm.packed_b && !kiln_pack_b_elems (k, n, &want))
        return kiln_error (err, KILN_EFORMAT, "packed B too large");
    if (!s_mul3 (m, k, 1, &want)
        || (rc = s_need_numel (p, plan->in[0], want, "A", err))
        || (!plan->u.gemm.packed_b && !s_mul3 (k, n, 1, &want))
        || (plan->u.gemm.packed_b && !kiln_pack_b_elems (k, n, &want))
        || (rc = s_need_numel (p, plan->in[1], want, "B", err))
        || !s_mul3 (m, n, 1, &want)
        || (rc = s_need_numel (p, plan->out, want, "the output", err)))
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
        if ((rc = s_need_numel (p, plan->in[2], c[0] * c[1], "C", err)))
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
    plan->u.gemm.engine = plan->u.gemm.packed_b || s_has_epilogue (plan);
    if (plan->u.gemm.engine)
        plan->ws_bytes = kiln_gemm_ws_bytes (m, n, k, false, plan->u.gemm.packed_b);
    return 0;
}

static void
s_gemm_get (const void *ctx_, int64_t idx, kiln_gemm_t *g)
{
    const s_gctx_t *ctx = ctx_;
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

static void
s_run_GEMM (const kiln_kplan_t *plan, void *const *data)
{
    const float *a = data[plan->in[0]], *b = data[plan->in[1]];
    float *y = data[plan->out];
    int m = plan->u.gemm.m, n = plan->u.gemm.n, k = plan->u.gemm.k;
    if (m == 0 || n == 0)
        return;
    if (plan->u.gemm.engine) {
        s_gctx_t ctx = { plan, data };
        kiln_gemm_run (s_gemm_get, &ctx, 1);
        return;
    }
    float beta = 0.0f;
    if (plan->u.gemm.has_c) {
        /* Y = beta * broadcast(C), then sgemm accumulates alpha * A B. */
        const float *c = data[plan->in[2]];
        int64_t c0 = plan->u.gemm.c0, c1 = plan->u.gemm.c1;
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++)
                y[i * n + j] = plan->u.gemm.beta
                               * c[(c0 == 1 ? 0 : i) * c1 + (c1 == 1 ? 0 : j)];
        beta = 1.0f;
    }
    if (k == 0) {
        if (!plan->u.gemm.has_c)
            memset (y, 0, (size_t) m * (size_t) n * sizeof *y);
        return;
    }
    cblas_sgemm (CblasRowMajor, plan->u.gemm.ta ? CblasTrans : CblasNoTrans,
                 plan->u.gemm.tb ? CblasTrans : CblasNoTrans, m, n, k,
                 plan->u.gemm.alpha, a, plan->u.gemm.ta ? m : k, b,
                 plan->u.gemm.tb ? k : n, beta, y, n);
}

/* --- windows -------------------------------------------------------- */

typedef struct {
    int64_t k[2], s[2], d[2], p[4];
} s_win_t;

static int
s_get_window (kiln_prog_op_t *op, s_win_t *w, kiln_err_t *err)
{
    int rc;
    if ((rc = kiln_prog_op_ints (op, "kernel", 2, w->k, err))
        || (rc = kiln_prog_op_ints (op, "strides", 2, w->s, err))
        || (rc = kiln_prog_op_ints (op, "dilations", 2, w->d, err))
        || (rc = kiln_prog_op_ints (op, "pads", 4, w->p, err)))
        return rc;
    for (int i = 0; i < 2; i++)
        if (w->k[i] < 1 || w->s[i] < 1 || w->d[i] < 1 || w->k[i] > KILN_MAX_DIM
            || w->s[i] > KILN_MAX_DIM || w->d[i] > KILN_MAX_DIM)
            return kiln_error (err, KILN_EFORMAT, "kernel, strides and "
                               "dilations must be in 1..%lld",
                               (long long) KILN_MAX_DIM);
    for (int i = 0; i < 4; i++)
        if (w->p[i] < 0 || w->p[i] > KILN_MAX_DIM)
            return kiln_error (err, KILN_EFORMAT, "pads must be in 0..%lld",
                               (long long) KILN_MAX_DIM);
    return 0;
}

/* Output size along axis `i` for input size `in`; -1 when the window does
 * not fit.  Every value is at most 2^31, so nothing here overflows. */
static int64_t
s_out_size (const s_win_t *w, int i, int64_t in, bool ceil_mode)
{
    int64_t eff = (w->k[i] - 1) * w->d[i] + 1;
    int64_t span = in + w->p[i] + w->p[2 + i] - eff;
    if (span < 0)
        return -1;
    return (ceil_mode ? span + w->s[i] - 1 : span) / w->s[i] + 1;
}

/* N, C, H, W of a rank-3 (H = 1) or rank-4 tensor. */
static bool
s_nchw (const kiln_prog_tensor_t *t, int64_t v[4])
{
    if (t->shape.rank == 4) {
        memcpy (v, t->shape.dims, 4 * sizeof *v);
        return true;
    }
    if (t->shape.rank == 3) {
        v[0] = t->shape.dims[0];
        v[1] = t->shape.dims[1];
        v[2] = 1;
        v[3] = t->shape.dims[2];
        return true;
    }
    return false;
}

static size_t s_dw_ws_floats (const kiln_kplan_t *plan);

static int
s_prepare_CONV2D (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                  kiln_err_t *err)
{
    int rc = s_need_f32 (p, plan, err);
    if (rc)
        return rc;
    s_win_t w;
    int64_t group, x[4], y[4], want, tile = 0;
    bool packed, trans;
    if ((rc = s_get_window (op, &w, err))
        || (rc = kiln_prog_op_int (op, "group", &group, err))
        || (rc = kiln_kernel_epilogue (p, op, plan, err))
        || (rc = s_get_packed (op, "packed", &packed, err))
        || (rc = s_get_packed (op, "transposed", &trans, err))
        || (kiln_prog_op_has (op, "winograd")
            && (rc = kiln_prog_op_int (op, "winograd", &tile, err))))
        return rc;
    if (trans && !packed && tile == 0)
        return kiln_error (err, KILN_EFORMAT, "transposed needs packed or "
                           "winograd weights");
    if (tile != 0 && tile != 2 && tile != 4)
        return kiln_error (err, KILN_EFORMAT, "winograd must be 2 or 4 (the "
                           "output tile), not %lld", (long long) tile);
    bool wino = tile != 0;
    if (wino && (packed || group != 1 || w.k[0] != 3 || w.k[1] != 3
                 || w.s[0] != 1 || w.s[1] != 1 || w.d[0] != 1 || w.d[1] != 1))
        return kiln_error (err, KILN_EFORMAT, "winograd needs an ungrouped 3x3 "
                           "convolution of stride and dilation 1");
    if (wino)
        packed = true;          /* the shape checks of packed weights */
    const kiln_prog_tensor_t *tx = s_t (p, plan->in[0]), *ty = s_t (p, plan->out);
    if (!s_nchw (tx, x) || !s_nchw (ty, y) || tx->shape.rank != ty->shape.rank
        || (!packed && s_t (p, plan->in[1])->shape.rank != tx->shape.rank))
        return kiln_error (err, KILN_EFORMAT, "X, W and Y must all have rank 3 "
                           "or all rank 4");
    if (group < 1 || x[1] % group != 0 || y[1] % group != 0 || y[0] != x[0])
        return kiln_error (err, KILN_EFORMAT, "group %lld does not divide %lld "
                           "input and %lld output channels", (long long) group,
                           (long long) x[1], (long long) y[1]);
    for (int i = 0; i < 2; i++)
        if (s_out_size (&w, i, x[2 + i], false) != y[2 + i])
            return kiln_error (err, KILN_EFORMAT, "output size %lld along axis "
                               "%d does not follow from the window",
                               (long long) y[2 + i], i);
    int64_t cg = x[1] / group, mg = y[1] / group;
    int64_t rows, cols;
    if (!s_mul3 (cg, w.k[0], w.k[1], &rows) || !s_mul3 (y[2], y[3], 1, &cols)
        || !s_mul3 (y[1], rows, 1, &want))
        return kiln_error (err, KILN_EFORMAT, "convolution too large");
    /* the weights' layout (kiln_pack.h): conv-packed, conv-packed-T,
     * Winograd, Winograd-T */
    if (packed && !wino
        && !(trans ? kiln_pack_conv_t_elems (y[1], cg, w.k[0], w.k[1], group, &want)
                   : kiln_pack_conv_elems (y[1], cg, w.k[0], w.k[1], group, &want)))
        return kiln_error (err, KILN_EFORMAT, "convolution too large");
    if (wino && !(trans ? kiln_pack_wino_t_elems (y[1], cg, (int) tile, &want)
                        : kiln_pack_wino_elems (y[1], cg, (int) tile, &want)))
        return kiln_error (err, KILN_EFORMAT, "convolution too large");
    if ((rc = s_need_numel (p, plan->in[1], want, packed ? "packed W" : "W", err)))
        return rc;
    if (!s_blas_ok (rows) || !s_blas_ok (cols) || !s_blas_ok (mg))
        return kiln_error (err, KILN_EFORMAT, "convolution too large for BLAS");
    int extra = plan->n_in - 2 - (plan->epi.residual >= 0);
    if (extra < 0 || extra > 1)
        return kiln_error (err, KILN_EFORMAT, "takes X, W, an optional bias and "
                           "an optional residual");
    plan->u.conv.bias = extra == 1;
    if (plan->u.conv.bias && (rc = s_need_numel (p, plan->in[2], y[1], "bias", err)))
        return rc;
    plan->u.conv.pointwise = w.k[0] == 1 && w.k[1] == 1 && w.s[0] == 1
                             && w.s[1] == 1 && w.p[0] == 0 && w.p[1] == 0
                             && w.p[2] == 0 && w.p[3] == 0;
    plan->u.conv.packed = packed;
    /* Without packed weights and without a workspace, one input channel
     * per group runs the direct depthwise loops; anything else unpacked
     * goes through im2col and sgemm. */
    plan->u.conv.depthwise = !packed && cg == 1 && plan->scratch < 0;
    plan->u.conv.im2col = !packed && !plan->u.conv.depthwise
                          && !plan->u.conv.pointwise;
    if (plan->u.conv.im2col) {
        int64_t need;
        if (!s_mul3 (rows, cols, 1, &need))
            return kiln_error (err, KILN_EFORMAT, "im2col too large");
        if (plan->scratch < 0 || kiln_ktensor_numel (s_t (p, plan->scratch)) < need)
            return kiln_error (err, KILN_EFORMAT, "needs a scratch tensor of %lld "
                               "elements", (long long) need);
    }
    plan->u.conv.n = x[0];
    plan->u.conv.c = x[1];
    plan->u.conv.h = x[2];
    plan->u.conv.w = x[3];
    plan->u.conv.m = y[1];
    plan->u.conv.oh = y[2];
    plan->u.conv.ow = y[3];
    plan->u.conv.kh = w.k[0];
    plan->u.conv.kw = w.k[1];
    plan->u.conv.sh = w.s[0];
    plan->u.conv.sw = w.s[1];
    plan->u.conv.dh = w.d[0];
    plan->u.conv.dw = w.d[1];
    plan->u.conv.pt = w.p[0];
    plan->u.conv.pl = w.p[1];
    plan->u.conv.group = group;
    if (plan->u.conv.depthwise) {
        /* the phases and accumulators: bounded by 4 planes of the input
         * and output, each under 2^32 floats */
        size_t f = s_dw_ws_floats (plan);
        if (f > ((size_t) 1 << 34))
            return kiln_error (err, KILN_EFORMAT, "depthwise convolution too "
                               "large");
        plan->ws_bytes = f * sizeof (float);
    }
    plan->u.conv.winograd = wino;
    if (wino) {
        plan->u.conv.packed = false;
        kiln_wino_plan (&plan->u.conv.wino, (int) tile, trans, x[0], x[1], x[2],
                        x[3], y[1], y[2], y[3], w.p[0], w.p[1], kiln_exec_threads ());
        plan->ws_bytes = kiln_wino_ws_bytes (&plan->u.conv.wino);
    } else if (trans) {
        /* Yᵀ = im2col(X)ᵀ · Wᵀ: positions as rows, C written transposed */
        plan->u.conv.trans = true;
        kiln_pack_conv_t_elems (mg, cg, w.k[0], w.k[1], 1, &plan->u.conv.wpg);
        plan->u.conv.geo = (kiln_gconv_t) {
            .c = cg, .h = x[2], .w = x[3], .oh = y[2], .ow = y[3],
            .kh = w.k[0], .kw = w.k[1], .sh = w.s[0], .sw = w.s[1],
            .dh = w.d[0], .dw = w.d[1], .pt = w.p[0], .pl = w.p[1] };
        plan->ws_bytes = kiln_gemm_ws_bytes (cols, mg, rows, false, true);
    } else if (packed) {
        kiln_pack_conv_elems (mg, cg, w.k[0], w.k[1], 1, &plan->u.conv.wpg);
        plan->u.conv.geo = (kiln_gconv_t) {
            .c = cg, .h = x[2], .w = x[3], .oh = y[2], .ow = y[3],
            .kh = w.k[0], .kw = w.k[1], .sh = w.s[0], .sw = w.s[1],
            .dh = w.d[0], .dw = w.d[1], .pt = w.p[0], .pl = w.p[1] };
        /* B is packed block by block, even a pointwise one read in place */
        plan->ws_bytes = kiln_gemm_ws_bytes (mg, cols, rows, true, false);
    }
    return 0;
}

/* Unfold one group's input (cg planes of h x w) into the columns of a
 * [cg*kh*kw, oh*ow] matrix; padding reads as zero. */
static void
s_im2col (const kiln_kplan_t *plan, const float *x, int64_t cg, float *col)
{
    int64_t h = plan->u.conv.h, w = plan->u.conv.w;
    int64_t oh = plan->u.conv.oh, ow = plan->u.conv.ow;
    int64_t kh = plan->u.conv.kh, kw = plan->u.conv.kw;
    for (int64_t c = 0; c < cg; c++)
        for (int64_t i = 0; i < kh; i++)
            for (int64_t j = 0; j < kw; j++) {
                float *dst = col + ((c * kh + i) * kw + j) * oh * ow;
                const float *plane = x + c * h * w;
                for (int64_t r = 0; r < oh; r++) {
                    int64_t ih = r * plan->u.conv.sh - plan->u.conv.pt
                                 + i * plan->u.conv.dh;
                    float *drow = dst + r * ow;
                    if (ih < 0 || ih >= h) {
                        memset (drow, 0, (size_t) ow * sizeof *drow);
                        continue;
                    }
                    const float *srow = plane + ih * w;
                    for (int64_t q = 0; q < ow; q++) {
                        int64_t iw = q * plan->u.conv.sw - plan->u.conv.pl
                                     + j * plan->u.conv.dw;
                        drow[q] = iw >= 0 && iw < w ? srow[iw] : 0.0f;
                    }
                }
            }
}

/* Product `idx` (batch element idx / group, group idx % group) of a
 * convolution with packed weights. */
static void
s_conv_get (const void *ctx_, int64_t idx, kiln_gemm_t *g)
{
    const s_gctx_t *ctx = ctx_;
    const kiln_kplan_t *plan = ctx->plan;
    void *const *data = ctx->data;
    int64_t groups = plan->u.conv.group, ni = idx / groups, gi = idx % groups;
    int64_t cg = plan->u.conv.c / groups, mg = plan->u.conv.m / groups;
    int64_t hw = plan->u.conv.h * plan->u.conv.w;
    int64_t ohw = plan->u.conv.oh * plan->u.conv.ow;
    const float *x = (const float *) data[plan->in[0]]
                     + (ni * plan->u.conv.c + gi * cg) * hw;
    int64_t yoff = (ni * plan->u.conv.m + gi * mg) * ohw;
    memset (g, 0, sizeof *g);
    g->k = cg * plan->u.conv.kh * plan->u.conv.kw;
    if (plan->u.conv.trans) {
        /* rows: output positions; columns: this group's output channels */
        g->m = ohw;
        g->n = mg;
        if (plan->u.conv.pointwise)
            g->a = (kiln_gsrc_t) { KILN_GSRC_STRIDED, x, 1, hw, NULL };
        else
            g->a = (kiln_gsrc_t) { KILN_GSRC_CONV, x, 0, 0, &plan->u.conv.geo };
        g->b = (kiln_gsrc_t) { KILN_GSRC_PACKED,
                               (const float *) data[plan->in[1]] + gi * plan->u.conv.wpg,
                               0, 0, NULL };
        g->c = (float *) data[plan->out] + yoff;
        g->ldc = ohw;
        g->c_trans = true;
        g->alpha = 1.0f;
        if (plan->u.conv.bias)
            g->add[g->n_add++] = (kiln_gadd_t) {
                (const float *) data[plan->in[2]] + gi * mg, 0, 1, 1.0f };
        if (plan->epi.residual >= 0)
            g->add[g->n_add++] = (kiln_gadd_t) {
                (const float *) data[plan->in[plan->epi.residual]] + yoff, 1, ohw,
                1.0f };
        g->act = plan->epi.act;
        g->act_a = plan->epi.a;
        g->act_b = plan->epi.b;
        return;
    }
    g->m = mg;
    g->n = ohw;
    g->a = (kiln_gsrc_t) { KILN_GSRC_PACKED,
                           (const float *) data[plan->in[1]] + gi * plan->u.conv.wpg,
                           0, 0, NULL };
    if (plan->u.conv.pointwise)
        g->b = (kiln_gsrc_t) { KILN_GSRC_STRIDED, x, hw, 1, NULL };
    else
        g->b = (kiln_gsrc_t) { KILN_GSRC_CONV, x, 0, 0, &plan->u.conv.geo };
    g->c = (float *) data[plan->out] + yoff;
    g->ldc = ohw;
    g->alpha = 1.0f;
    if (plan->u.conv.bias)
        g->add[g->n_add++] = (kiln_gadd_t) {
            (const float *) data[plan->in[2]] + gi * mg, 1, 0, 1.0f };
    if (plan->epi.residual >= 0)
        g->add[g->n_add++] = (kiln_gadd_t) {
            (const float *) data[plan->in[plan->epi.residual]] + yoff, ohw, 1, 1.0f };
    g->act = plan->epi.act;
    g->act_a = plan->epi.a;
    g->act_b = plan->epi.b;
}

/* The depthwise loops read the input through its phases: with strides
 * (sh, sw), phase (a, b) of the zero-padded plane holds its rows a, a +
 * sh, ... and columns b, b + sw, ..., so that every tap reads one phase
 * at a fixed offset and an output plane (computed over the phase's full
 * width, the extra columns thrown away) is a sum of shifted copies: one
 * long vector loop per tap whatever the plane's width. */
typedef struct {
    int64_t hp, wp;             /* padded plane */
    int64_t hq, wq;             /* one phase */
    int64_t phase;              /* floats per phase */
    int64_t acc;                /* oh × wq accumulators */
    int64_t slack;              /* reads past a phase's last row */
} s_dw_geo_t;

static void
s_dw_geometry (const kiln_kplan_t *plan, s_dw_geo_t *g)
{
    int64_t sh = plan->u.conv.sh, sw = plan->u.conv.sw;
    /* rows and columns the windows reach, from -pt / -pl */
    int64_t need_h = (plan->u.conv.oh - 1) * sh + (plan->u.conv.kh - 1) * plan->u.conv.dh + 1;
    int64_t need_w = (plan->u.conv.ow - 1) * sw + (plan->u.conv.kw - 1) * plan->u.conv.dw + 1;
    g->hp = plan->u.conv.h + plan->u.conv.pt;
    g->wp = plan->u.conv.w + plan->u.conv.pl;
    if (g->hp < need_h)
        g->hp = need_h;
    if (g->wp < need_w)
        g->wp = need_w;
    g->hq = (g->hp + sh - 1) / sh;
    g->wq = (g->wp + sw - 1) / sw;
    g->phase = g->hq * g->wq;
    g->acc = plan->u.conv.oh * g->wq;
    g->slack = (plan->u.conv.kw - 1) * plan->u.conv.dw / sw + 1;
}

static bool s_dw_lanes (const kiln_kplan_t *plan);
static size_t s_dw_lanes_ws_floats (const kiln_kplan_t *plan);

static size_t
s_dw_ws_floats (const kiln_kplan_t *plan)
{
    if (s_dw_lanes (plan))
        return s_dw_lanes_ws_floats (plan);
    s_dw_geo_t g;
    s_dw_geometry (plan, &g);
    return (size_t) (plan->u.conv.sh * plan->u.conv.sw * g.phase + g.slack + g.acc);
}

/* ac[k] = bv + Σ w[i]·t_i[k]: nine taps in one pass; the accumulators
 * never overlap the phases the taps read. */
static inline __attribute__ ((always_inline)) void
s_dw9 (float *restrict ac, int64_t n, float bv, const float *restrict w,
       const float *restrict t0, const float *restrict t1,
       const float *restrict t2, const float *restrict t3,
       const float *restrict t4, const float *restrict t5,
       const float *restrict t6, const float *restrict t7,
       const float *restrict t8)
{
    float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3], w4 = w[4];
    float w5 = w[5], w6 = w[6], w7 = w[7], w8 = w[8];
    for (int64_t k = 0; k < n; k++)
        ac[k] = bv + w0 * t0[k] + w1 * t1[k] + w2 * t2[k] + w3 * t3[k]
                + w4 * t4[k] + w5 * t5[k] + w6 * t6[k] + w7 * t7[k] + w8 * t8[k];
}

#define S_DW_ROW 7

/* ac[k] = (first ? bv : ac[k]) + Σ_j w[j]·t[j][k] over nt (1..7) taps,
 * added in order of j: one pass over the accumulators. */
static inline __attribute__ ((always_inline)) void
s_dw_row (float *restrict ac, int64_t n, bool first, float bv, const float *w,
          const float *const *t, int64_t nt)
{
    float w0 = w[0], w1 = nt > 1 ? w[1] : 0, w2 = nt > 2 ? w[2] : 0;
    float w3 = nt > 3 ? w[3] : 0, w4 = nt > 4 ? w[4] : 0, w5 = nt > 5 ? w[5] : 0;
    float w6 = nt > 6 ? w[6] : 0;
    const float *restrict t0 = t[0], *restrict t1 = t[nt > 1 ? 1 : 0];
    const float *restrict t2 = t[nt > 2 ? 2 : 0], *restrict t3 = t[nt > 3 ? 3 : 0];
    const float *restrict t4 = t[nt > 4 ? 4 : 0], *restrict t5 = t[nt > 5 ? 5 : 0];
    const float *restrict t6 = t[nt > 6 ? 6 : 0];
    if (first)
        for (int64_t k = 0; k < n; k++)
            ac[k] = bv;
    switch (nt) {
    case 7:
        for (int64_t k = 0; k < n; k++)
            ac[k] = ac[k] + w0 * t0[k] + w1 * t1[k] + w2 * t2[k] + w3 * t3[k]
                    + w4 * t4[k] + w5 * t5[k] + w6 * t6[k];
        break;
    case 5:
        for (int64_t k = 0; k < n; k++)
            ac[k] = ac[k] + w0 * t0[k] + w1 * t1[k] + w2 * t2[k] + w3 * t3[k]
                    + w4 * t4[k];
        break;
    case 3:
        for (int64_t k = 0; k < n; k++)
            ac[k] = ac[k] + w0 * t0[k] + w1 * t1[k] + w2 * t2[k];
        break;
    default:
        for (int64_t j = 0; j < nt; j++) {
            float wv = w[j];
            const float *restrict tj = t[j];
            for (int64_t k = 0; k < n; k++)
                ac[k] += wv * tj[k];
        }
        break;
    }
}

/* Small planes (the 14×14 and 7×7 of a mobile network's last stages)
 * leave most of a vector idle in the per-plane loops above, and their
 * fixed costs (phases, tap pointers) weigh on few outputs.  There (planes
 * of 7×7 measured 1.7-2.3 times faster this way; at 14×14 neither way
 * wins clearly, at 28×28 the per-plane loops win by a third) the
 * planes go S_DW_LANES at a time, interleaved: the padded inputs as
 * [row][column][lane], the weights as [tap][lane], so that every tap of
 * every output is one full-width multiply-add over the lanes.  Each lane
 * adds its taps in the order the per-plane loops do. */
#define S_DW_LANES 16
/* one value per lane: a vector register, or two or four where they are
 * narrower (gcc's generic vectors); the workspace's lanes are aligned */
typedef float s_dw_vec_t __attribute__ ((vector_size (S_DW_LANES * sizeof (float))));
#define S_DW_LANES_MAX_OUT 100          /* output planes up to 10×10 */

static bool
s_dw_lanes (const kiln_kplan_t *plan)
{
    s_dw_geo_t g;
    s_dw_geometry (plan, &g);
    return plan->u.conv.oh * plan->u.conv.ow <= S_DW_LANES_MAX_OUT
           && g.hp * g.wp <= 4 * S_DW_LANES_MAX_OUT;
}

static size_t
s_dw_lanes_ws_floats (const kiln_kplan_t *plan)
{
    s_dw_geo_t g;
    s_dw_geometry (plan, &g);
    return (size_t) ((g.hp * g.wp + plan->u.conv.kh * plan->u.conv.kw + 1) * S_DW_LANES);
}

KILN_VCLONES static void
s_dw_planes_lanes (const kiln_kplan_t *plan, void *const *data, int64_t first,
                   int64_t count, float *ws)
{
    const float *x = data[plan->in[0]], *wt = data[plan->in[1]];
    const float *bias = plan->u.conv.bias ? data[plan->in[2]] : NULL;
    const float *res = plan->epi.residual >= 0 ? data[plan->in[plan->epi.residual]]
                                               : NULL;
    float *y = data[plan->out];
    int64_t h = plan->u.conv.h, w = plan->u.conv.w;
    int64_t oh = plan->u.conv.oh, ow = plan->u.conv.ow, ohw = oh * ow;
    int64_t kh = plan->u.conv.kh, kw = plan->u.conv.kw, taps = kh * kw;
    int64_t sh = plan->u.conv.sh, sw = plan->u.conv.sw;
    int64_t dh = plan->u.conv.dh, dw = plan->u.conv.dw;
    int64_t pt = plan->u.conv.pt, pl = plan->u.conv.pl;
    int64_t m = plan->u.conv.m, mg = m / plan->u.conv.group;
    s_dw_geo_t g;
    s_dw_geometry (plan, &g);
    enum { L = S_DW_LANES };
    float *restrict in = ws, *restrict wv = ws + g.hp * g.wp * L;
    float *restrict bv = wv + taps * L;
    for (int64_t p0 = first; p0 < first + count; p0 += L) {
        int64_t nl = first + count - p0 < L ? first + count - p0 : L;
        memset (in, 0, (size_t) (g.hp * g.wp * L) * sizeof *in);
        memset (wv, 0, (size_t) (taps * L) * sizeof *wv);
        for (int64_t l = 0; l < nl; l++) {
            int64_t pi = p0 + l, ni = pi / m, o = pi % m;
            /* Output channel o reads input channel o / mg (one per group). */
            const float *xp = x + (ni * plan->u.conv.c + o / mg) * h * w;
            for (int64_t ih = 0; ih < h && ih + pt < g.hp; ih++)
                for (int64_t iw = 0; iw < w && iw + pl < g.wp; iw++)
                    in[((ih + pt) * g.wp + iw + pl) * L + l] = xp[ih * w + iw];
            for (int64_t t = 0; t < taps; t++)
                wv[t * L + l] = wt[o * taps + t];
            bv[l] = bias ? bias[o] : 0.0f;
        }
        for (int64_t r = 0; r < oh; r++)
            for (int64_t q = 0; q < ow; q++) {
                s_dw_vec_t v = *(const s_dw_vec_t *) bv;
                for (int64_t i = 0; i < kh; i++) {
                    const float *row = in + ((r * sh + i * dh) * g.wp + q * sw) * L;
                    const float *wr = wv + i * kw * L;
                    for (int64_t j = 0; j < kw; j++)
                        v = v + *(const s_dw_vec_t *) (wr + j * L)
                                * *(const s_dw_vec_t *) (row + j * dw * L);
                }
                float acc[L];
                memcpy (acc, &v, sizeof acc);
                int64_t at = r * ow + q;
                for (int64_t l = 0; l < nl; l++)
                    y[(p0 + l) * ohw + at] = res ? acc[l] + res[(p0 + l) * ohw + at]
                                                 : acc[l];
            }
        for (int64_t l = 0; l < nl; l++)
            kiln_act_apply (y + (p0 + l) * ohw, ohw, plan->epi.act, plan->epi.a,
                            plan->epi.b);
    }
}

/* Output planes [first, first + count) of a depthwise convolution, with
 * `ws` (s_dw_ws_floats) to work in. */
KILN_VCLONES static void
s_dw_planes (const kiln_kplan_t *plan, void *const *data, int64_t first,
             int64_t count, float *ws)
{
    if (s_dw_lanes (plan)) {
        s_dw_planes_lanes (plan, data, first, count, ws);
        return;
    }
    const float *x = data[plan->in[0]], *wt = data[plan->in[1]];
    const float *bias = plan->u.conv.bias ? data[plan->in[2]] : NULL;
    const float *res = plan->epi.residual >= 0 ? data[plan->in[plan->epi.residual]]
                                               : NULL;
    float *y = data[plan->out];
    int64_t h = plan->u.conv.h, w = plan->u.conv.w;
    int64_t oh = plan->u.conv.oh, ow = plan->u.conv.ow;
    int64_t kh = plan->u.conv.kh, kw = plan->u.conv.kw;
    int64_t sh = plan->u.conv.sh, sw = plan->u.conv.sw;
    int64_t pt = plan->u.conv.pt, pl = plan->u.conv.pl;
    int64_t mg = plan->u.conv.m / plan->u.conv.group;
    s_dw_geo_t g;
    s_dw_geometry (plan, &g);
    int64_t nph = sh * sw;
    float *phases = ws, *acc = ws + nph * g.phase + g.slack;
    memset (phases + nph * g.phase, 0, (size_t) g.slack * sizeof *phases);
    for (int64_t pl_i = first; pl_i < first + count; pl_i++) {
        int64_t ni = pl_i / plan->u.conv.m, o = pl_i % plan->u.conv.m;
        /* Output channel o reads input channel o / mg (one per group). */
        const float *xp = x + (ni * plan->u.conv.c + o / mg) * h * w;
        const float *wp = wt + o * kh * kw;
        /* the phases of the zero-padded plane */
        for (int64_t a = 0; a < sh; a++)
            for (int64_t b = 0; b < sw; b++) {
                float *ph = phases + (a * sw + b) * g.phase;
                for (int64_t u = 0; u < g.hq; u++) {
                    float *dst = ph + u * g.wq;
                    int64_t ih = u * sh + a - pt;
                    if (ih < 0 || ih >= h) {
                        memset (dst, 0, (size_t) g.wq * sizeof *dst);
                        continue;
                    }
                    const float *src = xp + ih * w;
                    if (sw == 1) {
                        /* columns -pl .. wp - pl - 1 of the row */
                        int64_t lo = pl, hi = pl + w > g.wq ? g.wq : pl + w;
                        memset (dst, 0, (size_t) (lo < g.wq ? lo : g.wq) * sizeof *dst);
                        if (hi > lo)
                            memcpy (dst + lo, src, (size_t) (hi - lo) * sizeof *dst);
                        if (hi < g.wq)
                            memset (dst + (hi > lo ? hi : lo), 0,
                                    (size_t) (g.wq - (hi > lo ? hi : lo)) * sizeof *dst);
                    } else {
                        /* v with 0 <= v·sw + b - pl < w; zeros around */
                        int64_t off = b - pl;
                        int64_t vlo = off >= 0 ? 0 : (-off + sw - 1) / sw;
                        int64_t vhi = off > w - 1 ? 0 : (w - 1 - off) / sw + 1;
                        if (vhi > g.wq)
                            vhi = g.wq;
                        if (vlo > vhi)
                            vlo = vhi;
                        for (int64_t v = 0; v < vlo; v++)
                            dst[v] = 0.0f;
                        const float *sp = src + off;
                        if (sw == 2)            /* a constant stride vectorises */
                            for (int64_t v = vlo; v < vhi; v++)
                                dst[v] = sp[2 * v];
                        else
                            for (int64_t v = vlo; v < vhi; v++)
                                dst[v] = sp[v * sw];
                        for (int64_t v = vhi; v < g.wq; v++)
                            dst[v] = 0.0f;
                    }
                }
            }
        float bv = bias ? bias[o] : 0.0f;
        const float *tap[9];
        if (kh * kw == 9) {
            /* 3x3: all nine taps in one pass over the accumulators */
            for (int64_t i = 0; i < 3; i++)
                for (int64_t j = 0; j < 3; j++) {
                    int64_t ri = i * plan->u.conv.dh, cj = j * plan->u.conv.dw;
                    tap[i * 3 + j] = phases + ((ri % sh) * sw + cj % sw) * g.phase
                                     + (ri / sh) * g.wq + cj / sw;
                }
            s_dw9 (acc, g.acc, bv, wp, tap[0], tap[1], tap[2], tap[3], tap[4],
                   tap[5], tap[6], tap[7], tap[8]);
        } else {
            /* a row of taps (up to S_DW_ROW) in one pass over the
             * accumulators: 5×5 and 7×7 kernels make 5 or 7 passes, not
             * 25 or 49 (each a load, an add and a store of every
             * accumulator) */
            for (int64_t i = 0; i < kh; i++)
                for (int64_t j0 = 0; j0 < kw; j0 += S_DW_ROW) {
                    int64_t nt = kw - j0 < S_DW_ROW ? kw - j0 : S_DW_ROW;
                    const float *t[S_DW_ROW];
                    for (int64_t j = 0; j < nt; j++) {
                        int64_t ri = i * plan->u.conv.dh, cj = (j0 + j) * plan->u.conv.dw;
                        t[j] = phases + ((ri % sh) * sw + cj % sw) * g.phase
                               + (ri / sh) * g.wq + cj / sw;
                    }
                    s_dw_row (acc, g.acc, i == 0 && j0 == 0, bv, wp + i * kw + j0, t, nt);
                }
        }
        float *yp = y + pl_i * oh * ow;
        for (int64_t r = 0; r < oh; r++) {
            float *yr = yp + r * ow;
            const float *ar = acc + r * g.wq;
            if (res) {
                const float *rr = res + pl_i * oh * ow + r * ow;
                for (int64_t q = 0; q < ow; q++)
                    yr[q] = ar[q] + rr[q];
            } else {
                memcpy (yr, ar, (size_t) ow * sizeof *yr);
            }
        }
        /* over the whole plane: rows of 7 or 14 would leave the
         * vectorised loops of the heavy activations mostly in their tails */
        kiln_act_apply (yp, oh * ow, plan->epi.act, plan->epi.a, plan->epi.b);
    }
}

typedef struct {
    const kiln_kplan_t *plan;
    void *const *data;
    int64_t planes, per;
    float *ws;
    size_t ws_stride;               /* floats per worker */
} s_dw_t;

static void
s_dw_task (void *arg, int task, int worker)
{
    const s_dw_t *d = arg;
    int64_t first = (int64_t) task * d->per;
    int64_t count = first + d->per > d->planes ? d->planes - first : d->per;
    s_dw_planes (d->plan, d->data, first, count,
                 d->ws + (size_t) worker * d->ws_stride);
}

static void
s_run_CONV2D (const kiln_kplan_t *plan, void *const *data)
{
    int64_t g = plan->u.conv.group;
    int64_t ohw = plan->u.conv.oh * plan->u.conv.ow;
    if (ohw == 0 || plan->u.conv.m == 0 || plan->u.conv.n == 0)
        return;
    if (plan->u.conv.winograd) {
        kiln_wino_run (&plan->u.conv.wino, data[plan->in[0]], data[plan->in[1]],
                       plan->u.conv.bias ? data[plan->in[2]] : NULL,
                       plan->epi.residual >= 0 ? data[plan->in[plan->epi.residual]]
                                               : NULL,
                       data[plan->out], plan->epi.act, plan->epi.a, plan->epi.b);
        return;
    }
    if (plan->u.conv.packed) {
        s_gctx_t ctx = { plan, data };
        kiln_gemm_run (s_conv_get, &ctx, plan->u.conv.n * g);
        return;
    }
    if (plan->u.conv.depthwise) {
        int64_t planes = plan->u.conv.n * plan->u.conv.m;
        int64_t tasks = 8 * (int64_t) kiln_exec_threads ();
        if (tasks > planes)
            tasks = planes;
        size_t bytes;
        int64_t per = (planes + tasks - 1) / tasks;
        if (s_dw_lanes (plan))          /* whole groups of lanes */
            per = (per + S_DW_LANES - 1) / S_DW_LANES * S_DW_LANES;
        s_dw_t d = { plan, data, planes, per, kiln_exec_ws (&bytes), 0 };
        d.ws_stride = bytes / sizeof (float);
        kiln_exec_parallel (s_dw_task, &d, (int) ((planes + d.per - 1) / d.per));
        return;
    }
    const float *x = data[plan->in[0]], *wt = data[plan->in[1]];
    const float *bias = plan->u.conv.bias ? data[plan->in[2]] : NULL;
    float *y = data[plan->out];
    float *col = plan->u.conv.im2col ? data[plan->scratch] : NULL;
    int64_t cg = plan->u.conv.c / g, mg = plan->u.conv.m / g;
    int64_t hw = plan->u.conv.h * plan->u.conv.w;
    int64_t rows = cg * plan->u.conv.kh * plan->u.conv.kw;
    for (int64_t n = 0; n < plan->u.conv.n; n++)
        for (int64_t gi = 0; gi < g; gi++) {
            const float *xg = x + (n * plan->u.conv.c + gi * cg) * hw;
            float *yg = y + (n * plan->u.conv.m + gi * mg) * ohw;
            const float *wg = wt + gi * mg * rows;
            const float *bmat = xg;
            if (col) {
                s_im2col (plan, xg, cg, col);
                bmat = col;
            }
            if (rows == 0 || mg == 0)
                memset (yg, 0, (size_t) (mg * ohw) * sizeof *yg);
            else
                cblas_sgemm (CblasRowMajor, CblasNoTrans, CblasNoTrans, (int) mg,
                             (int) ohw, (int) rows, 1.0f, wg, (int) rows, bmat,
                             (int) ohw, 0.0f, yg, (int) ohw);
            if (bias)
                for (int64_t m = 0; m < mg; m++) {
                    float bv = bias[gi * mg + m];
                    float *row = yg + m * ohw;
                    for (int64_t i = 0; i < ohw; i++)
                        row[i] += bv;
                }
        }
    if (s_has_epilogue (plan))
        s_epilogue_after (plan, data, y, plan->u.conv.n * plan->u.conv.m * ohw);
}

static int
s_prepare_MAXPOOL2D (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                     kiln_err_t *err)
{
    int rc = s_need_f32 (p, plan, err);
    if (rc)
        return rc;
    s_win_t w;
    int64_t ceil_mode;
    if ((rc = s_get_window (op, &w, err))
        || (rc = kiln_prog_op_int (op, "ceil_mode", &ceil_mode, err)))
        return rc;
    const kiln_prog_tensor_t *tx = s_t (p, plan->in[0]), *ty = s_t (p, plan->out);
    int64_t x[4], y[4];         /* a rank-3 (1-D) pool reads as height 1 */
    if (!s_nchw (tx, x) || !s_nchw (ty, y) || tx->shape.rank != ty->shape.rank)
        return kiln_error (err, KILN_EFORMAT, "X and Y must both have rank 3 or both rank 4");
    if (x[0] != y[0] || x[1] != y[1])
        return kiln_error (err, KILN_EFORMAT, "X and Y differ in N or C");
    /* With ceil_mode, frameworks differ on whether a last window that
     * starts in the end padding counts; accept both, clamp every window. */
    for (int i = 0; i < 2; i++) {
        int64_t lo = s_out_size (&w, i, x[2 + i], false);
        int64_t hi = s_out_size (&w, i, x[2 + i], ceil_mode != 0);
        if (lo < 0 || y[2 + i] < lo || y[2 + i] > hi)
            return kiln_error (err, KILN_EFORMAT, "output size %lld along axis "
                               "%d does not follow from the window",
                               (long long) y[2 + i], i);
    }
    plan->u.pool.planes = x[0] * x[1];
    plan->u.pool.h = x[2];
    plan->u.pool.w = x[3];
    plan->u.pool.oh = y[2];
    plan->u.pool.ow = y[3];
    plan->u.pool.kh = w.k[0];
    plan->u.pool.kw = w.k[1];
    plan->u.pool.sh = w.s[0];
    plan->u.pool.sw = w.s[1];
    plan->u.pool.dh = w.d[0];
    plan->u.pool.dw = w.d[1];
    plan->u.pool.pt = w.p[0];
    plan->u.pool.pl = w.p[1];
    plan->ws_bytes = (size_t) x[3] * sizeof (float);    /* one row's maxima */
    return 0;
}

/* max that keeps the first NaN it meets: a NaN window gives NaN */
static inline float
s_max_nan (float best, float v)
{
    return v != v ? v : (v > best ? v : best);
}

/* Output planes [first, first + count): for each output row, the maximum
 * over the window's input rows first (contiguous, vectorised) into
 * `colmax`, then over the window's columns. */
KILN_VCLONES static void
s_pool_planes (const kiln_kplan_t *plan, void *const *data, int64_t first,
               int64_t count, float *colmax)
{
    const float *x = data[plan->in[0]];
    float *y = data[plan->out];
    int64_t h = plan->u.pool.h, w = plan->u.pool.w;
    int64_t oh = plan->u.pool.oh, ow = plan->u.pool.ow;
    int64_t kh = plan->u.pool.kh, kw = plan->u.pool.kw;
    for (int64_t pl = first; pl < first + count; pl++) {
        const float *xp = x + pl * h * w;
        float *yp = y + pl * oh * ow;
        for (int64_t r = 0; r < oh; r++) {
            float *yr = yp + r * ow;
            int64_t h0 = r * plan->u.pool.sh - plan->u.pool.pt;
            bool any = false;
            for (int64_t i = 0; i < kh; i++) {
                int64_t ih = h0 + i * plan->u.pool.dh;
                if (ih < 0 || ih >= h)
                    continue;
                const float *xr = xp + ih * w;
                if (!any)
                    memcpy (colmax, xr, (size_t) w * sizeof *colmax);
                else
                    for (int64_t t = 0; t < w; t++)
                        colmax[t] = s_max_nan (colmax[t], xr[t]);
                any = true;
            }
            for (int64_t q = 0; q < ow; q++) {
                float best = -INFINITY;
                int64_t w0 = q * plan->u.pool.sw - plan->u.pool.pl;
                for (int64_t j = 0; any && j < kw; j++) {
                    int64_t iw = w0 + j * plan->u.pool.dw;
                    if (iw >= 0 && iw < w)
                        best = s_max_nan (best, colmax[iw]);
                }
                yr[q] = best;
            }
        }
    }
}

typedef struct {
    const kiln_kplan_t *plan;
    void *const *data;
    int64_t planes, per;
    float *ws;
    size_t ws_stride;               /* floats per worker */
} s_planes_t;

static void
s_pool_task (void *arg, int task, int worker)
{
    const s_planes_t *d = arg;
    int64_t first = (int64_t) task * d->per;
    int64_t count = first + d->per > d->planes ? d->planes - first : d->per;
    s_pool_planes (d->plan, d->data, first, count,
                   d->ws + (size_t) worker * d->ws_stride);
}

static void
s_run_MAXPOOL2D (const kiln_kplan_t *plan, void *const *data)
{
    int64_t planes = plan->u.pool.planes;
    if (planes == 0 || plan->u.pool.oh == 0 || plan->u.pool.ow == 0)
        return;
    int64_t tasks = 8 * (int64_t) kiln_exec_threads ();
    if (tasks > planes)
        tasks = planes;
    size_t bytes;
    s_planes_t d = { plan, data, planes, (planes + tasks - 1) / tasks,
                     kiln_exec_ws (&bytes), 0 };
    d.ws_stride = bytes / sizeof (float);
    kiln_exec_parallel (s_pool_task, &d, (int) ((planes + d.per - 1) / d.per));
}

static int
s_prepare_GLOBAL_AVGPOOL (kiln_program_t *p, kiln_prog_op_t *op,
                          kiln_kplan_t *plan, kiln_err_t *err)
{
    int rc = s_need_f32 (p, plan, err);
    if (rc)
        return rc;
    const kiln_prog_tensor_t *tx = s_t (p, plan->in[0]), *ty = s_t (p, plan->out);
    if (tx->shape.rank < 3 || ty->shape.rank != tx->shape.rank)
        return kiln_error (err, KILN_EFORMAT, "X must have rank >= 3 and Y the "
                           "same rank");
    for (int i = 0; i < ty->shape.rank; i++)
        if (ty->shape.dims[i] != (i < 2 ? tx->shape.dims[i] : 1))
            return kiln_error (err, KILN_EFORMAT, "Y must be [N, C, 1, ...]");
    plan->u.gap.planes = tx->shape.dims[0] * tx->shape.dims[1];
    plan->u.gap.spatial = plan->u.gap.planes
                          ? kiln_ktensor_numel (tx) / plan->u.gap.planes : 0;
    return 0;
}

/* The mean of each plane: sums in double, eight lanes (element i in
 * lane i mod 8), the lanes added in a fixed order and the tail last, so
 * the loop vectorises and the result does not depend on the CPU or the
 * thread count.  A plane's serial double sum had been bound by the add's
 * latency (efficientnet_b0's 17 pools, 9 % of its time). */
typedef struct {
    const float *x;
    float *y;
    int64_t s, planes, per;
} s_gap_t;

KILN_VCLONES static void
s_gap_planes (const float *x, float *y, int64_t s, int64_t first, int64_t count)
{
    for (int64_t pl = first; pl < first + count; pl++) {
        const float *xp = x + pl * s;
        double l[8] = { 0 };
        int64_t i = 0;
        for (; i + 8 <= s; i += 8)
            for (int j = 0; j < 8; j++)
                l[j] += xp[i + j];
        double sum = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
        for (; i < s; i++)
            sum += xp[i];
        y[pl] = s ? (float) (sum / (double) s) : NAN;
    }
}

static void
s_gap_task (void *arg, int task, int worker)
{
    const s_gap_t *d = arg;
    int64_t first = (int64_t) task * d->per;
    int64_t count = first + d->per > d->planes ? d->planes - first : d->per;
    s_gap_planes (d->x, d->y, d->s, first, count);
}

static void
s_run_GLOBAL_AVGPOOL (const kiln_kplan_t *plan, void *const *data)
{
    const float *x = data[plan->in[0]];
    float *y = data[plan->out];
    int64_t s = plan->u.gap.spatial;
    s_gap_t d = { x, y, s, plan->u.gap.planes, 0 };
    int tasks = plan->u.gap.planes * s >= 65536 ? 4 * kiln_exec_threads () : 1;
    if (tasks > plan->u.gap.planes)
        tasks = (int) plan->u.gap.planes;
    if (tasks < 1)
        return;
    d.per = (plan->u.gap.planes + tasks - 1) / tasks;
    kiln_exec_parallel (s_gap_task, &d, (int) ((plan->u.gap.planes + d.per - 1) / d.per));
}

/* --- conv3d: im2col of one group into the scratch, then the engine --- */

static int
s_prepare_CONV3D (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                  kiln_err_t *err)
{
    int rc = s_need_f32 (p, plan, err);
    if (rc)
        return rc;
    int64_t k[3], st[3], dl[3], pads[6], group;
    if ((rc = kiln_prog_op_ints (op, "kernel", 3, k, err))
        || (rc = kiln_prog_op_ints (op, "strides", 3, st, err))
        || (rc = kiln_prog_op_ints (op, "dilations", 3, dl, err))
        || (rc = kiln_prog_op_ints (op, "pads", 6, pads, err))
        || (rc = kiln_prog_op_int (op, "group", &group, err))
        || (rc = kiln_kernel_epilogue (p, op, plan, err)))
        return rc;
    const kiln_prog_tensor_t *tx = s_t (p, plan->in[0]), *tw = s_t (p, plan->in[1]);
    const kiln_prog_tensor_t *ty = s_t (p, plan->out);
    if (tx->shape.rank != 5 || tw->shape.rank != 5 || ty->shape.rank != 5)
        return kiln_error (err, KILN_EFORMAT, "X, W and Y must have rank 5");
    int64_t n = tx->shape.dims[0], c = tx->shape.dims[1], m = tw->shape.dims[0];
    if (group < 1 || c % group || m % group || tw->shape.dims[1] * group != c
        || ty->shape.dims[0] != n || ty->shape.dims[1] != m)
        return kiln_error (err, KILN_EFORMAT, "group %lld, X, W and Y disagree on channels",
                           (long long) group);
    int64_t rows = c / group, cols = 1;
    for (int i = 0; i < 3; i++) {
        int64_t in = tx->shape.dims[2 + i], out = ty->shape.dims[2 + i];
        if (k[i] < 1 || st[i] < 1 || dl[i] < 1 || pads[i] < 0 || pads[3 + i] < 0
            || k[i] != tw->shape.dims[2 + i] || k[i] > KILN_MAX_DIM || st[i] > KILN_MAX_DIM
            || dl[i] > KILN_MAX_DIM || pads[i] > KILN_MAX_DIM || pads[3 + i] > KILN_MAX_DIM)
            return kiln_error (err, KILN_EFORMAT, "window axis %d out of range", i);
        int64_t span = in + pads[i] + pads[3 + i] - (k[i] - 1) * dl[i] - 1;
        if (span < 0 || out != span / st[i] + 1)
            return kiln_error (err, KILN_EFORMAT, "Y's axis %d must be %lld", 2 + i,
                               (long long) (span < 0 ? 0 : span / st[i] + 1));
        plan->u.conv3.in[i] = in;
        plan->u.conv3.out[i] = out;
        plan->u.conv3.k[i] = k[i];
        plan->u.conv3.s[i] = st[i];
        plan->u.conv3.d[i] = dl[i];
        plan->u.conv3.p[i] = pads[i];
        rows *= k[i];
        cols *= out;
    }
    plan->u.conv3.n = n;
    plan->u.conv3.c = c;
    plan->u.conv3.m = m;
    plan->u.conv3.group = group;
    plan->u.conv3.rows = rows;
    plan->u.conv3.cols = cols;
    int extra = plan->n_in - 2 - (plan->epi.residual >= 0);
    if (extra < 0 || extra > 1)
        return kiln_error (err, KILN_EFORMAT, "takes X, W, an optional bias and an optional "
                           "residual");
    plan->u.conv3.bias = extra == 1;
    if (plan->u.conv3.bias && (rc = s_need_numel (p, plan->in[2], m, "the bias", err)))
        return rc;
    bool pw = true;
    for (int i = 0; i < 3; i++)
        pw = pw && k[i] == 1 && st[i] == 1 && pads[i] == 0 && pads[3 + i] == 0;
    plan->u.conv3.pointwise = pw;
    int64_t col_elems;
    if (__builtin_mul_overflow (rows, cols, &col_elems))
        return kiln_error (err, KILN_ELIMIT, "the im2col of %lld x %lld overflows",
                           (long long) rows, (long long) cols);
    if (!pw && (plan->scratch < 0 || s_t (p, plan->scratch)->dtype != KILN_DT_FLOAT32
                || kiln_ktensor_numel (s_t (p, plan->scratch)) < col_elems))
        return kiln_error (err, KILN_EFORMAT, "needs a float32 scratch tensor of %lld "
                           "elements", (long long) (rows * cols));
    plan->ws_bytes = kiln_gemm_ws_bytes (m / group, cols, rows, false, false);
    return 0;
}

/* col[r, q] for group gi of batch ni: r = ((ci·kd + a)·kh + b)·kw + e,
 * q = (z·oh + y)·ow + x; zero where the tap falls in the padding. */
static void
s_im2col3 (const kiln_kplan_t *plan, const float *x, float *col)
{
    const int64_t *in = plan->u.conv3.in, *out = plan->u.conv3.out, *k = plan->u.conv3.k;
    const int64_t *st = plan->u.conv3.s, *dl = plan->u.conv3.d, *pd = plan->u.conv3.p;
    int64_t cg = plan->u.conv3.c / plan->u.conv3.group, plane = in[0] * in[1] * in[2];
    float *q = col;
    for (int64_t ci = 0; ci < cg; ci++)
        for (int64_t a = 0; a < k[0]; a++)
            for (int64_t b = 0; b < k[1]; b++)
                for (int64_t e = 0; e < k[2]; e++)
                    for (int64_t z = 0; z < out[0]; z++) {
                        int64_t iz = z * st[0] - pd[0] + a * dl[0];
                        for (int64_t y = 0; y < out[1]; y++, q += out[2]) {
                            int64_t iy = y * st[1] - pd[1] + b * dl[1];
                            if (iz < 0 || iz >= in[0] || iy < 0 || iy >= in[1]) {
                                memset (q, 0, (size_t) out[2] * sizeof *q);
                                continue;
                            }
                            const float *row = x + ci * plane + (iz * in[1] + iy) * in[2];
                            for (int64_t xx = 0; xx < out[2]; xx++) {
                                int64_t ix = xx * st[2] - pd[2] + e * dl[2];
                                q[xx] = ix >= 0 && ix < in[2] ? row[ix] : 0.0f;
                            }
                        }
                    }
}

typedef struct {
    const kiln_kplan_t *plan;
    void *const *data;
    const float *b;             /* this product's B: the im2col or X */
    int64_t ni, gi;
} s_c3ctx_t;

static void
s_conv3_get (const void *ctx_, int64_t idx, kiln_gemm_t *g)
{
    const s_c3ctx_t *ctx = ctx_;
    const kiln_kplan_t *plan = ctx->plan;
    int64_t mg = plan->u.conv3.m / plan->u.conv3.group, rows = plan->u.conv3.rows;
    int64_t cols = plan->u.conv3.cols;
    int64_t yoff = (ctx->ni * plan->u.conv3.m + ctx->gi * mg) * cols;
    (void) idx;
    memset (g, 0, sizeof *g);
    g->m = mg;
    g->n = cols;
    g->k = rows;
    g->a = (kiln_gsrc_t) { KILN_GSRC_STRIDED,
                           (const float *) ctx->data[plan->in[1]] + ctx->gi * mg * rows,
                           rows, 1, NULL };
    g->b = (kiln_gsrc_t) { KILN_GSRC_STRIDED, ctx->b, cols, 1, NULL };
    g->c = (float *) ctx->data[plan->out] + yoff;
    g->ldc = cols;
    g->alpha = 1.0f;
    if (plan->u.conv3.bias)
        g->add[g->n_add++] = (kiln_gadd_t) {
            (const float *) ctx->data[plan->in[2]] + ctx->gi * mg, 1, 0, 1.0f };
    if (plan->epi.residual >= 0)
        g->add[g->n_add++] = (kiln_gadd_t) {
            (const float *) ctx->data[plan->in[plan->epi.residual]] + yoff, cols, 1, 1.0f };
    g->act = plan->epi.act;
    g->act_a = plan->epi.a;
    g->act_b = plan->epi.b;
}

static void
s_run_CONV3D (const kiln_kplan_t *plan, void *const *data)
{
    int64_t groups = plan->u.conv3.group, cg = plan->u.conv3.c / groups;
    int64_t plane = plan->u.conv3.in[0] * plan->u.conv3.in[1] * plan->u.conv3.in[2];
    if (plan->u.conv3.cols == 0 || plan->u.conv3.m == 0)
        return;
    for (int64_t ni = 0; ni < plan->u.conv3.n; ni++)
        for (int64_t gi = 0; gi < groups; gi++) {
            const float *x = (const float *) data[plan->in[0]]
                             + (ni * plan->u.conv3.c + gi * cg) * plane;
            s_c3ctx_t ctx = { plan, data, x, ni, gi };
            if (!plan->u.conv3.pointwise) {
                s_im2col3 (plan, x, data[plan->scratch]);
                ctx.b = data[plan->scratch];
            }
            kiln_gemm_run (s_conv3_get, &ctx, 1);
        }
}

/* --- kernels of kiln_kernels_math.c ----------------------------------- */

/* Their prepare sets plan->run, so the table's run is never reached. */
#define S_MATH_KERNEL(id)                                                     \
    static int                                                                \
    s_prepare_##id (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, \
                    kiln_err_t *err)                                          \
    {                                                                         \
        return kiln_kmath_prepare (p, op, plan, err);                         \
    }                                                                         \
    static void                                                               \
    s_run_##id (const kiln_kplan_t *plan, void *const *data)                  \
    {                                                                         \
        plan->run (plan, data);                                               \
    }
KILN_KMATH_KERNELS (S_MATH_KERNEL)
#undef S_MATH_KERNEL

/* --- kernels of kiln_kernels_shape.c ---------------------------------- */

/* Their prepare sets plan->run too. */
#define S_SHAPE_KERNEL(id)                                                    \
    static int                                                                \
    s_prepare_##id (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, \
                    kiln_err_t *err)                                          \
    {                                                                         \
        return kiln_kshape_prepare (p, op, plan, err);                        \
    }                                                                         \
    static void                                                               \
    s_run_##id (const kiln_kplan_t *plan, void *const *data)                  \
    {                                                                         \
        plan->run (plan, data);                                               \
    }
KILN_KSHAPE_KERNELS (S_SHAPE_KERNEL)
#undef S_SHAPE_KERNEL




/* --- kernels of kiln_kernels_rnn.c, _index.c, _pool3d.c, _convtr3d.c ----- */

/* Their prepare sets plan->run too. */
#define S_DELEGATED(prepare, id)                                              \
    static int                                                                \
    s_prepare_##id (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, \
                    kiln_err_t *err)                                          \
    {                                                                         \
        return prepare (p, op, plan, err);                                    \
    }                                                                         \
    static void                                                               \
    s_run_##id (const kiln_kplan_t *plan, void *const *data)                  \
    {                                                                         \
        plan->run (plan, data);                                               \
    }
#define S_RNN_KERNEL(id) S_DELEGATED (kiln_krnn_prepare, id)
#define S_INDEX_KERNEL(id) S_DELEGATED (kiln_kindex_prepare, id)
#define S_POOL3D_KERNEL(id) S_DELEGATED (kiln_kpool3d_prepare, id)
#define S_CONVTR3D_KERNEL(id) S_DELEGATED (kiln_kconvtr3d_prepare, id)
KILN_KRNN_KERNELS (S_RNN_KERNEL)
KILN_KINDEX_KERNELS (S_INDEX_KERNEL)
KILN_KPOOL3D_KERNELS (S_POOL3D_KERNEL)
KILN_KCONVTR3D_KERNELS (S_CONVTR3D_KERNEL)
#undef S_RNN_KERNEL
#undef S_INDEX_KERNEL
#undef S_POOL3D_KERNEL
#undef S_CONVTR3D_KERNEL
#undef S_DELEGATED

/* --- the table ------------------------------------------------------ */

static const struct {
    s_prepare_fn prepare;
    s_run_fn run;
} s_table[KILN_K_COUNT] = {
#define X(id, name, min_in, max_in, n_out) \
    [KILN_K_##id] = { s_prepare_##id, s_run_##id },
    KILN_KERNELS (X)
#undef X
};

int
kiln_kernel_prepare (kiln_program_t *p, int i, kiln_kplan_t *plan,
                     kiln_err_t *err)
{
    kiln_prog_op_t *op = &p->ops[i];
    memset (plan, 0, sizeof *plan);
    plan->kernel = op->kernel;
    plan->n_in = op->n_inputs;
    memcpy (plan->in, op->inputs, sizeof plan->in);
    plan->out = op->outputs[0];
    plan->scratch = op->scratch;
    plan->epi.residual = -1;
    op->params_used = 0;
    int rc = s_table[op->kernel].prepare (p, op, plan, err);
    if (rc == 0)
        rc = kiln_prog_op_all_used (op, err);
    if (rc)
        return kiln_error_prefix (err, "op %d (%s)", i,
                                  kiln_kernel_name (op->kernel));
    return 0;
}

void
kiln_kernel_run (const kiln_kplan_t *plan, void *const *data)
{
    if (plan->run)
        plan->run (plan, data);
    else
        s_table[plan->kernel].run (plan, data);
}
