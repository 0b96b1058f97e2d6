/*
 * kiln_kernels_convtr3d — ConvTranspose over three spatial axes (see
 * kiln_kernels_convtr3d.h).  Per image and group, one product makes the
 * columns, col[M/g · kd·kh·kw, D·H·W] = W_gᵀ · X_g, and col2im adds each
 * column entry to the output position it lands on; the bias comes last.
 * Prepare checks the output size against the window, so every position
 * col2im skips is outside Y and every one it writes is inside.
 */
#include "runtime/kiln_kernels.h"

#include <limits.h>
#include <string.h>

#include <cblas.h>

/* Add column plane `cr` (the input grid) to Y plane `ym` for tap (a, b, c). */
static void
s_col2im_tap (const kiln_kconvtr3d_plan_t *cp, const float *cr, float *ym, int64_t a,
              int64_t b, int64_t c)
{
    for (int64_t iz = 0; iz < cp->in[0]; iz++) {
        int64_t oz = iz * cp->s[0] - cp->pb[0] + a * cp->d[0];
        if (oz < 0 || oz >= cp->out[0])
            continue;
        for (int64_t iy = 0; iy < cp->in[1]; iy++) {
            int64_t oy = iy * cp->s[1] - cp->pb[1] + b * cp->d[1];
            if (oy < 0 || oy >= cp->out[1])
                continue;
            const float *src = cr + (iz * cp->in[1] + iy) * cp->in[2];
            float *dst = ym + (oz * cp->out[1] + oy) * cp->out[2];
            for (int64_t ix = 0; ix < cp->in[2]; ix++) {
                int64_t ox = ix * cp->s[2] - cp->pb[2] + c * cp->d[2];
                if (ox >= 0 && ox < cp->out[2])
                    dst[ox] += src[ix];
            }
        }
    }
}

static void
s_run_convtr3d (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kconvtr3d_plan_t *cp = &plan->u.convtr3d;
    const float *x = data[plan->in[0]], *wt = data[plan->in[1]];
    const float *bias = cp->bias ? data[plan->in[2]] : NULL;
    float *y = data[plan->out], *col = data[plan->scratch];
    int64_t g = cp->group, cg = cp->c / g, mg = cp->m / g;
    int64_t vol = cp->in[0] * cp->in[1] * cp->in[2];
    int64_t ovol = cp->out[0] * cp->out[1] * cp->out[2];
    int64_t kk = cp->k[0] * cp->k[1] * cp->k[2], rows = mg * kk;
    memset (y, 0, (size_t) (cp->n * cp->m * ovol) * sizeof *y);
    for (int64_t n = 0; n < cp->n; n++)
        for (int64_t gi = 0; gi < g; gi++) {
            const float *xg = x + (n * cp->c + gi * cg) * vol;
            const float *wg = wt + gi * cg * rows;
            float *yg = y + (n * cp->m + gi * mg) * ovol;
            if (rows > 0 && vol > 0 && cg > 0) {
                cblas_sgemm (CblasRowMajor, CblasTrans, CblasNoTrans, (int) rows, (int) vol,
                             (int) cg, 1.0f, wg, (int) rows, xg, (int) vol, 0.0f, col,
                             (int) vol);
                for (int64_t m = 0; m < mg; m++)
                    for (int64_t a = 0; a < cp->k[0]; a++)
                        for (int64_t b = 0; b < cp->k[1]; b++)
                            for (int64_t c = 0; c < cp->k[2]; c++)
                                s_col2im_tap (cp, col + (((m * cp->k[0] + a) * cp->k[1] + b)
                                                         * cp->k[2] + c) * vol,
                                              yg + m * ovol, a, b, c);
            }
            if (bias)
                for (int64_t m = 0; m < mg; m++) {
                    float bv = bias[gi * mg + m], *row = yg + m * ovol;
                    for (int64_t i = 0; i < ovol; i++)
                        row[i] += bv;
                }
        }
}

int
kiln_kconvtr3d_prepare (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                        kiln_err_t *err)
{
    kiln_kconvtr3d_plan_t *cp = &plan->u.convtr3d;
    int64_t k[3], st[3], dl[3], pads[6], opad[3], group;
    int rc;
    if ((rc = kiln_prog_op_ints (op, "kernel", 3, k, err))
        || (rc = kiln_prog_op_ints (op, "strides", 3, st, err))
        || (rc = kiln_prog_op_ints (op, "dilations", 3, dl, err))
        || (rc = kiln_prog_op_ints (op, "pads", 6, pads, err))
        || (rc = kiln_prog_op_ints (op, "output_padding", 3, opad, err))
        || (rc = kiln_prog_op_int (op, "group", &group, err)))
        return rc;
    const kiln_prog_tensor_t *x = &p->tensors[plan->in[0]], *w = &p->tensors[plan->in[1]];
    const kiln_prog_tensor_t *y = &p->tensors[plan->out];
    if (x->dtype != KILN_DT_FLOAT32 || w->dtype != KILN_DT_FLOAT32
        || y->dtype != KILN_DT_FLOAT32 || x->shape.rank != 5 || w->shape.rank != 5
        || y->shape.rank != 5)
        return kiln_error (err, KILN_EFORMAT, "X, W and Y must be float32 of rank 5");
    const int64_t *xd = x->shape.dims, *wd = w->shape.dims, *yd = y->shape.dims;
    if (group < 1 || group > KILN_MAX_DIM || xd[1] % group != 0 || wd[0] != xd[1]
        || wd[1] * group != yd[1] || yd[0] != xd[0] || wd[2] != k[0] || wd[3] != k[1]
        || wd[4] != k[2])
        return kiln_error (err, KILN_EFORMAT, "W [%lld, %lld, %lld, %lld, %lld] does not fit "
                           "X, Y, the kernel and group %lld", (long long) wd[0],
                           (long long) wd[1], (long long) wd[2], (long long) wd[3],
                           (long long) wd[4], (long long) group);
    for (int a = 0; a < 3; a++) {
        if (k[a] < 1 || st[a] < 1 || dl[a] < 1 || pads[a] < 0 || pads[3 + a] < 0
            || opad[a] < 0 || k[a] > KILN_MAX_DIM || st[a] > KILN_MAX_DIM
            || dl[a] > KILN_MAX_DIM || pads[a] > KILN_MAX_DIM || pads[3 + a] > KILN_MAX_DIM
            || opad[a] > KILN_MAX_DIM || xd[2 + a] < 1)
            return kiln_error (err, KILN_EFORMAT, "window axis %d out of range", a);
        /* Every term is below 2^31, so this fits int64. */
        int64_t want = st[a] * (xd[2 + a] - 1) + opad[a] + (k[a] - 1) * dl[a] + 1 - pads[a]
                       - pads[3 + a];
        if (want != yd[2 + a])
            return kiln_error (err, KILN_EFORMAT, "output size %lld along axis %d does not "
                               "follow from the window (%lld)", (long long) yd[2 + a], a,
                               (long long) want);
        cp->in[a] = xd[2 + a];
        cp->out[a] = yd[2 + a];
        cp->k[a] = k[a];
        cp->s[a] = st[a];
        cp->d[a] = dl[a];
        cp->pb[a] = pads[a];
    }
    int64_t rows, vol, need;
    if (__builtin_mul_overflow (wd[1], k[0] * k[1] * k[2], &rows)
        || __builtin_mul_overflow (xd[2] * xd[3], xd[4], &vol)
        || __builtin_mul_overflow (rows, vol, &need) || rows > INT_MAX || vol > INT_MAX
        || xd[1] / group > INT_MAX)
        return kiln_error (err, KILN_EFORMAT, "transposed convolution too large for BLAS");
    if (plan->scratch < 0 || kiln_ktensor_numel (&p->tensors[plan->scratch]) < need)
        return kiln_error (err, KILN_EFORMAT, "needs a scratch tensor of %lld elements",
                           (long long) need);
    cp->bias = plan->n_in == 3;
    if (cp->bias && kiln_ktensor_numel (&p->tensors[plan->in[2]]) != yd[1])
        return kiln_error (err, KILN_EFORMAT, "bias holds %lld elements, expected %lld",
                           (long long) kiln_ktensor_numel (&p->tensors[plan->in[2]]),
                           (long long) yd[1]);
    cp->n = xd[0];
    cp->c = xd[1];
    cp->m = yd[1];
    cp->group = group;
    plan->run = s_run_convtr3d;
    return 0;
}
