/*
 * kiln_kernels_elementwise — the first elementwise kernels: copy, relu and
 * add/sub/mul/div on float32 with broadcasting (other dtypes and every
 * other elementwise op: kiln_kernels_math.c).  Internal to libkilnrt.
 */
#include "runtime/kiln_kernels_priv.h"

#include <math.h>
#include <string.h>

#include "runtime/kiln_vmath.h"

/* --- copy ----------------------------------------------------------- */

int
kiln_kprepare_COPY (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                kiln_err_t *err)
{
    const kiln_prog_tensor_t *x = kiln_ktensor (p, plan->in[0]), *y = kiln_ktensor (p, plan->out);
    if (x->size != y->size || x->dtype != y->dtype)
        return kiln_error (err, KILN_EFORMAT, "copies %llu bytes of %s into "
                           "%llu bytes of %s", (unsigned long long) x->size,
                           kiln_dtype_name (x->dtype),
                           (unsigned long long) y->size,
                           kiln_dtype_name (y->dtype));
    plan->u.flat.n = (int64_t) x->size;
    return 0;
}

void
kiln_krun_COPY (const kiln_kplan_t *plan, void *const *data)
{
    if (data[plan->out] != data[plan->in[0]])
        memmove (data[plan->out], data[plan->in[0]], (size_t) plan->u.flat.n);
}

/* --- elementwise with broadcasting ---------------------------------- */

static int
s_prepare_binary (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                  kiln_err_t *err)
{
    /* Other dtypes have their loops in kiln_kernels_binary.c. */
    if (kiln_ktensor (p, plan->out)->dtype != KILN_DT_FLOAT32)
        return kiln_kmath_prepare_arith (p, op, plan, err);
    int rc = kiln_kneed_f32 (p, plan, err);
    if (rc)
        return rc;
    const kiln_prog_tensor_t *y = kiln_ktensor (p, plan->out);
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
    if (!kiln_kprod (da, r, &na) || !kiln_kprod (db, r, &nb))
        return kiln_error (err, KILN_EFORMAT, "bad operand shapes");
    if ((rc = kiln_kneed_numel (p, plan->in[0], na, "A", err))
        || (rc = kiln_kneed_numel (p, plan->in[1], nb, "B", err)))
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
 * common stride patterns (both contiguous, one side a scalar).  The
 * outer rows are shared by the pool, at least S_BIN_MIN elements a task
 * (each element computed as alone: the results do not depend on the
 * thread count).  On one thread a squeeze-and-excitation's scaling Mul
 * after a depthwise convolution that both threads computed read half
 * its input from the other core: at 2 threads mobilenet_v3_large's took
 * 0.03-0.04 ms against 0.015-0.025 at 1. */
#define S_BIN_MIN 8192

typedef struct {
    const kiln_kplan_t *plan;
    const float *a, *b;
    float *y;
} s_bin_t;

#define S_BINARY_KERNEL(NAME, EXPR)                                           \
    KILN_VCLONES static void                                                  \
    s_rows_##NAME (void *arg, int64_t first, int64_t count)                   \
    {                                                                         \
        const s_bin_t *d = arg;                                               \
        const kiln_kplan_t *plan = d->plan;                                   \
        const float *a = d->a, *b = d->b;                                     \
        float *y = d->y;                                                      \
        int r = plan->u.bin.rank;                                             \
        int64_t n = plan->u.bin.dims[r - 1];                                  \
        int64_t ia = plan->u.bin.sa[r - 1], ib = plan->u.bin.sb[r - 1];      \
        int64_t idx[KILN_MAX_RANK] = { 0 }, oa = 0, ob = 0, rest = first;     \
        for (int i = r - 2; i >= 0; i--) {                                    \
            idx[i] = rest % plan->u.bin.dims[i];                              \
            rest /= plan->u.bin.dims[i];                                      \
            oa += idx[i] * plan->u.bin.sa[i];                                 \
            ob += idx[i] * plan->u.bin.sb[i];                                 \
        }                                                                     \
        for (int64_t o = first; o < first + count; o++) {                     \
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
    }                                                                         \
    static void                                                               \
    s_run_##NAME (const kiln_kplan_t *plan, void *const *data)                \
    {                                                                         \
        s_bin_t d = { plan, data[plan->in[0]], data[plan->in[1]],             \
                      data[plan->out] };                                      \
        int r = plan->u.bin.rank;                                             \
        int64_t n = plan->u.bin.dims[r - 1], outer = 1;                       \
        for (int i = 0; i < r - 1; i++)                                       \
            outer *= plan->u.bin.dims[i];                                     \
        kiln_krows_run (s_rows_##NAME, &d, outer, S_BIN_MIN / n + 1);         \
    }

S_BINARY_KERNEL (ADD, x0 + x1)
S_BINARY_KERNEL (SUB, x0 - x1)
S_BINARY_KERNEL (MUL, x0 * x1)
S_BINARY_KERNEL (DIV, x0 / x1)

/* (A table, not a switch: gcc 12 warns of a dangling pointer when a
 * function stores the address of a static target_clones function.) */
static const struct {
    kiln_kernel_t kernel;
    void (*run) (const kiln_kplan_t *plan, void *const *data);
} s_arith_runs[] = {
    { KILN_K_ADD, s_run_ADD }, { KILN_K_SUB, s_run_SUB },
    { KILN_K_MUL, s_run_MUL }, { KILN_K_DIV, s_run_DIV },
};

int
kiln_kprepare_arith (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                     kiln_err_t *err)
{
    int rc = s_prepare_binary (p, op, plan, err);
    if (rc || plan->run)            /* not float32: kiln_kmath_prepare_arith's */
        return rc;
    for (size_t i = 0; i < sizeof s_arith_runs / sizeof s_arith_runs[0]; i++)
        if (s_arith_runs[i].kernel == plan->kernel) {
            plan->run = s_arith_runs[i].run;
            return 0;
        }
    return kiln_error (err, KILN_EINVAL, "kernel %s is not add, sub, mul or div",
                       kiln_kernel_name (plan->kernel));
}

int
kiln_kprepare_RELU (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                kiln_err_t *err)
{
    int rc = kiln_kneed_f32 (p, plan, err);
    if (rc)
        return rc;
    int64_t n = kiln_ktensor_numel (kiln_ktensor (p, plan->in[0]));
    if ((rc = kiln_kneed_numel (p, plan->out, n, "the output", err)))
        return rc;
    plan->u.flat.n = n;
    return 0;
}

KILN_VCLONES void
kiln_krun_RELU (const kiln_kplan_t *plan, void *const *data)
{
    const float *x = data[plan->in[0]];
    float *y = data[plan->out];
    /* x < 0 is false for NaN, which passes through. */
    for (int64_t i = 0; i < plan->u.flat.n; i++)
        y[i] = x[i] < 0.0f ? 0.0f : x[i];
}
