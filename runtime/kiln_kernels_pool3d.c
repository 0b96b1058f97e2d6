/*
 * kiln_kernels_pool3d — MaxPool and AveragePool over three spatial axes
 * (see kiln_kernels_pool3d.h).  Each window is clamped to the input;
 * prepare proves that every window holds at least one input element.
 */
#include "runtime/kiln_kernels.h"

#include <math.h>
#include <string.h>

/* The taps of window o on axis a that fall inside the input: first
 * input index *lo, count *n (stride d). */
static void
s_taps (const kiln_kpool3d_plan_t *pp, int a, int64_t o, int64_t *lo, int64_t *n)
{
    int64_t start = o * pp->s[a] - pp->pb[a], d = pp->d[a];
    int64_t t0 = start < 0 ? (-start + d - 1) / d : 0;      /* first tap >= 0 */
    int64_t t1 = pp->k[a];                                  /* taps < in */
    if (start + (t1 - 1) * d >= pp->in[a])
        t1 = (pp->in[a] - 1 - start) / d + 1;
    *lo = start + t0 * d;
    *n = t1 > t0 ? t1 - t0 : 0;
}

/* Taps of window o on axis a within the padded input (count_include_pad):
 * the t in 0..k-1 with start + t·d < end, counted without a loop (the
 * kernel may be far longer than the axis). */
static int64_t
s_padded_taps (const kiln_kpool3d_plan_t *pp, int a, int64_t o)
{
    int64_t start = o * pp->s[a] - pp->pb[a], end = pp->in[a] + pp->pe[a];
    if (start >= end)
        return 0;
    int64_t n = (end - start + pp->d[a] - 1) / pp->d[a];
    return n < pp->k[a] ? n : pp->k[a];
}

static void
s_run_pool3d (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kpool3d_plan_t *pp = &plan->u.pool3d;
    const float *x = data[plan->in[0]];
    float *y = data[plan->out];
    int64_t in_plane = pp->in[0] * pp->in[1] * pp->in[2];
    int64_t out_plane = pp->out[0] * pp->out[1] * pp->out[2];
    for (int64_t pl = 0; pl < pp->planes; pl++) {
        const float *xp = x + pl * in_plane;
        float *yp = y + pl * out_plane;
        for (int64_t oz = 0; oz < pp->out[0]; oz++) {
            int64_t z0, nz;
            s_taps (pp, 0, oz, &z0, &nz);
            for (int64_t oy = 0; oy < pp->out[1]; oy++) {
                int64_t y0, ny;
                s_taps (pp, 1, oy, &y0, &ny);
                for (int64_t ox = 0; ox < pp->out[2]; ox++) {
                    int64_t x0, nx;
                    s_taps (pp, 2, ox, &x0, &nx);
                    double sum = 0;
                    float mx = -INFINITY;
                    for (int64_t a = 0; a < nz; a++)
                        for (int64_t b = 0; b < ny; b++) {
                            const float *row = xp + ((z0 + a * pp->d[0]) * pp->in[1]
                                                     + y0 + b * pp->d[1]) * pp->in[2];
                            for (int64_t c = 0; c < nx; c++) {
                                float v = row[x0 + c * pp->d[2]];
                                sum += v;
                                mx = v > mx || v != v ? v : mx;
                            }
                        }
                    double count = (double) (nz * ny * nx);
                    if (pp->include_pad)
                        count = (double) (s_padded_taps (pp, 0, oz) * s_padded_taps (pp, 1, oy)
                                          * s_padded_taps (pp, 2, ox));
                    yp[(oz * pp->out[1] + oy) * pp->out[2] + ox]
                        = pp->avg ? (float) (sum / count) : mx;
                }
            }
        }
    }
}

int
kiln_kpool3d_prepare (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                      kiln_err_t *err)
{
    kiln_kpool3d_plan_t *pp = &plan->u.pool3d;
    int64_t mode, include, k[3], st[3], dl[3], pads[6];
    int rc;
    if ((rc = kiln_prog_op_int (op, "mode", &mode, err))
        || (rc = kiln_prog_op_int (op, "count_include_pad", &include, err))
        || (rc = kiln_prog_op_ints (op, "kernel", 3, k, err))
        || (rc = kiln_prog_op_ints (op, "strides", 3, st, err))
        || (rc = kiln_prog_op_ints (op, "dilations", 3, dl, err))
        || (rc = kiln_prog_op_ints (op, "pads", 6, pads, err)))
        return rc;
    const kiln_prog_tensor_t *x = &p->tensors[plan->in[0]], *y = &p->tensors[plan->out];
    if (x->dtype != KILN_DT_FLOAT32 || y->dtype != KILN_DT_FLOAT32 || x->shape.rank != 5
        || y->shape.rank != 5 || y->shape.dims[0] != x->shape.dims[0]
        || y->shape.dims[1] != x->shape.dims[1] || (mode != 0 && mode != 1))
        return kiln_error (err, KILN_EFORMAT, "X and Y must be float32 [N, C, d, h, w] and "
                           "mode 0 (max) or 1 (average)");
    pp->avg = mode == 1;
    pp->include_pad = include != 0;
    pp->planes = x->shape.dims[0] * x->shape.dims[1];
    for (int a = 0; a < 3; a++) {
        pp->in[a] = x->shape.dims[2 + a];
        pp->out[a] = y->shape.dims[2 + a];
        pp->k[a] = k[a];
        pp->s[a] = st[a];
        pp->d[a] = dl[a];
        pp->pb[a] = pads[a];
        pp->pe[a] = pads[3 + a];
        if (k[a] < 1 || st[a] < 1 || dl[a] < 1 || pads[a] < 0 || pads[3 + a] < 0
            || k[a] > KILN_MAX_DIM || st[a] > KILN_MAX_DIM || dl[a] > KILN_MAX_DIM
            || pads[a] > KILN_MAX_DIM || pads[3 + a] > KILN_MAX_DIM || pp->in[a] < 1)
            return kiln_error (err, KILN_EFORMAT, "window axis %d out of range", a);
        /* every window holds an input element (then run stays inside X) */
        for (int64_t o = 0; o < pp->out[a]; o++) {
            int64_t lo, n;
            s_taps (pp, a, o, &lo, &n);
            if (n < 1 || lo < 0 || lo + (n - 1) * dl[a] >= pp->in[a])
                return kiln_error (err, KILN_EFORMAT, "window %lld of axis %d holds no "
                                   "input element", (long long) o, a);
        }
    }
    plan->run = s_run_pool3d;
    return 0;
}
