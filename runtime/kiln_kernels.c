/*
 * kiln_kernels — the table of the runtime's kernels (one entry per
 * KILN_KERNELS id: prepare and run), and the checks and parameters the
 * kernels of several kinds share (kiln_kernels_priv.h).  The kernels
 * themselves live in a file per kind: kiln_kernels_elementwise.c,
 * _matmul.c, _conv.c, _pool.c, _math.c, _shape.c, _index.c, _rnn.c,
 * _pool3d.c, _convtr3d.c.
 */
#include "runtime/kiln_kernels_math_priv.h"

#include <string.h>

#include "runtime/kiln_exec.h"
#include "runtime/kiln_gemm.h"

typedef int (*s_prepare_fn) (kiln_program_t *p, kiln_prog_op_t *op,
                             kiln_kplan_t *plan, kiln_err_t *err);
typedef void (*s_run_fn) (const kiln_kplan_t *plan, void *const *data);

/* --- checks shared by the prepare functions ------------------------- */

int
kiln_kneed_f32 (const kiln_program_t *p, const kiln_kplan_t *plan, kiln_err_t *err)
{
    for (int i = 0; i < plan->n_in; i++)
        if (kiln_ktensor (p, plan->in[i])->dtype != KILN_DT_FLOAT32)
            return kiln_error (err, KILN_EFORMAT, "input %d is %s, not float32",
                               i, kiln_dtype_name (kiln_ktensor (p, plan->in[i])->dtype));
    if (kiln_ktensor (p, plan->out)->dtype != KILN_DT_FLOAT32)
        return kiln_error (err, KILN_EFORMAT, "output is %s, not float32",
                           kiln_dtype_name (kiln_ktensor (p, plan->out)->dtype));
    return 0;
}

int
kiln_kneed_numel (const kiln_program_t *p, int t, int64_t want, const char *what,
                  kiln_err_t *err)
{
    if (kiln_ktensor_numel (kiln_ktensor (p, t)) != want)
        return kiln_error (err, KILN_EFORMAT, "%s holds %lld elements, "
                           "expected %lld", what,
                           (long long) kiln_ktensor_numel (kiln_ktensor (p, t)),
                           (long long) want);
    return 0;
}

/* --- the fused epilogue --------------------------------------------- */

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
            if ((rc = kiln_kneed_numel (p, plan->in[plan->n_in - 1],
                                        kiln_ktensor_numel (kiln_ktensor (p, plan->out)),
                                        "the residual", err)))
                return rc;
        }
    }
    return 0;
}

/* The epilogue over a whole output, after a BLAS product. */
void
kiln_kepilogue_after (const kiln_kplan_t *plan, void *const *data, float *y,
                      int64_t n)
{
    if (plan->epi.residual >= 0) {
        const float *r = data[plan->in[plan->epi.residual]];
        for (int64_t i = 0; i < n; i++)
            y[i] += r[i];
    }
    kiln_act_apply (y, n, plan->epi.act, plan->epi.a, plan->epi.b);
}

int
kiln_kget_packed (kiln_prog_op_t *op, const char *name, bool *out, kiln_err_t *err)
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

/* --- windows -------------------------------------------------------- */

int
kiln_kget_window (kiln_prog_op_t *op, kiln_kwin_t *w, kiln_err_t *err)
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


/* --- kernels that pick their run at prepare --------------------------
 * The rows of common/kiln_ops_arith.h (each names its prepare), and
 * those of kiln_kernels_math.c, _shape.c, _rnn.c, _index.c, _pool3d.c
 * and _convtr3d.c: their prepare sets plan->run, which kiln_kernel_run
 * calls, so the table's run is never reached.  (The kernels of the other
 * kind files, kiln_kernels_priv.h's KILN_KOWN_KERNELS, define
 * kiln_kprepare_<id> and kiln_krun_<id> themselves.) */
#define S_DELEGATED(prepare, id)                                              \
    static int                                                                \
    kiln_kprepare_##id (kiln_program_t *p, kiln_prog_op_t *op,                \
                        kiln_kplan_t *plan, kiln_err_t *err)                  \
    {                                                                         \
        return prepare (p, op, plan, err);                                    \
    }                                                                         \
    static void                                                               \
    kiln_krun_##id (const kiln_kplan_t *plan, void *const *data)              \
    {                                                                         \
        plan->run (plan, data);                                               \
    }
#define S_ARITH_KERNEL(X_, id, name, onnx, lo, nhi, khi, inf, low, ex, prep) \
    S_DELEGATED (prep, id)
#define S_MATH_KERNEL(id) S_DELEGATED (kiln_kmath_prepare, id)
#define S_SHAPE_KERNEL(id) S_DELEGATED (kiln_kshape_prepare, id)
#define S_RNN_KERNEL(id) S_DELEGATED (kiln_krnn_prepare, id)
#define S_INDEX_KERNEL(id) S_DELEGATED (kiln_kindex_prepare, id)
#define S_POOL3D_KERNEL(id) S_DELEGATED (kiln_kpool3d_prepare, id)
#define S_CONVTR3D_KERNEL(id) S_DELEGATED (kiln_kconvtr3d_prepare, id)
KILN_ARITH_OPS (S_ARITH_KERNEL, _)
KILN_KMATH_KERNELS (S_MATH_KERNEL)
KILN_KSHAPE_KERNELS (S_SHAPE_KERNEL)
KILN_KRNN_KERNELS (S_RNN_KERNEL)
KILN_KINDEX_KERNELS (S_INDEX_KERNEL)
KILN_KPOOL3D_KERNELS (S_POOL3D_KERNEL)
KILN_KCONVTR3D_KERNELS (S_CONVTR3D_KERNEL)
#undef S_ARITH_KERNEL
#undef S_MATH_KERNEL
#undef S_SHAPE_KERNEL
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
    [KILN_K_##id] = { kiln_kprepare_##id, kiln_krun_##id },
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


/* --- rows over the pool (softmax, layer norm) ----------------------- */

typedef struct {
    kiln_krows_fn *fn;
    void *arg;
    int64_t rows, per;
} s_rows_t;

static void
s_rows_task (void *arg, int task, int worker)
{
    (void) worker;
    const s_rows_t *d = arg;
    int64_t first = (int64_t) task * d->per;
    d->fn (d->arg, first, first + d->per > d->rows ? d->rows - first : d->per);
}

void
kiln_krows_run (kiln_krows_fn *fn, void *arg, int64_t rows, int64_t min)
{
    if (rows <= 0)
        return;
    int64_t tasks = 4 * (int64_t) kiln_exec_threads ();
    if (min < 1)
        min = 1;
    if (tasks > rows / min)
        tasks = rows / min;
    if (tasks <= 1) {
        fn (arg, 0, rows);
        return;
    }
    s_rows_t d = { fn, arg, rows, (rows + tasks - 1) / tasks };
    kiln_exec_parallel (s_rows_task, &d, (int) ((rows + d.per - 1) / d.per));
}

/* --- planes over the pool (depthwise convolution, max pooling) ------ */

typedef struct {
    kiln_kplanes_fn *fn;
    const kiln_kplan_t *plan;
    void *const *data;
    int64_t planes, per;
    float *ws;
    size_t ws_stride;               /* floats per worker */
} s_planes_t;

static void
s_planes_task (void *arg, int task, int worker)
{
    const s_planes_t *d = arg;
    int64_t first = (int64_t) task * d->per;
    int64_t count = first + d->per > d->planes ? d->planes - first : d->per;
    d->fn (d->plan, d->data, first, count, d->ws + (size_t) worker * d->ws_stride);
}

void
kiln_kplanes_run (kiln_kplanes_fn *fn, const kiln_kplan_t *plan, void *const *data,
                  int64_t planes, int64_t align)
{
    if (planes <= 0)
        return;
    int64_t tasks = 8 * (int64_t) kiln_exec_threads ();
    if (tasks > planes)
        tasks = planes;
    int64_t per = (planes + tasks - 1) / tasks;
    per = (per + align - 1) / align * align;
    size_t bytes;
    s_planes_t d = { fn, plan, data, planes, per, kiln_exec_ws (&bytes), 0 };
    d.ws_stride = bytes / sizeof (float);
    kiln_exec_parallel (s_planes_task, &d, (int) ((planes + per - 1) / per));
}
