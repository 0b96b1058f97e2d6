/*
 * kiln_kernels_dwconv — depthwise convolution (one input channel per
 * group) by direct loops over the input's stride phases (on AVX-512, most shapes
 * by kiln_kernels_dwconv_avx512.c), for conv2d
 * (kiln_kernels_conv.c prepares it and calls kiln_kdw_run).  Internal to
 * libkilnrt.
 */
#include "runtime/kiln_kernels_priv.h"

#include <math.h>
#include <string.h>

#include "runtime/kiln_exec.h"
#include "runtime/kiln_kernels_dwconv_avx512.h"
#include "runtime/kiln_vmath.h"

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

static kiln_dw_geo_t s_dw_geo16 (const kiln_kplan_t *plan);

static void
s_dw_geometry (const kiln_kplan_t *plan, s_dw_geo_t *g)
{
    int64_t sh = plan->u.conv.sh, sw = plan->u.conv.sw;
    kiln_dw_geo_t geo = s_dw_geo16 (plan);
    kiln_dw_extent (&geo, &g->hp, &g->wp);
    g->hq = (g->hp + sh - 1) / sh;
    g->wq = (g->wp + sw - 1) / sw;
    g->phase = g->hq * g->wq;
    g->acc = plan->u.conv.oh * g->wq;
    g->slack = (plan->u.conv.kw - 1) * plan->u.conv.dw / sw + 1;
}

static bool s_dw_lanes (const kiln_kplan_t *plan);
static size_t s_dw_lanes_ws_floats (const kiln_kplan_t *plan);

static kiln_dw_geo_t
s_dw_geo16 (const kiln_kplan_t *plan)
{
    return (kiln_dw_geo_t) {
        plan->u.conv.h, plan->u.conv.w, plan->u.conv.oh, plan->u.conv.ow,
        plan->u.conv.kh, plan->u.conv.kw, plan->u.conv.sh, plan->u.conv.sw,
        plan->u.conv.dh, plan->u.conv.dw, plan->u.conv.pt, plan->u.conv.pl };
}

size_t
kiln_kdw_ws_floats (const kiln_kplan_t *plan)
{
    /* room for every path the plane may take: the ISA is chosen when the
     * model runs */
    if (plan->u.conv.x_cl)
        return 0;               /* channels-last: in place */
    kiln_dw_geo_t geo = s_dw_geo16 (plan);
    size_t need;
    if (s_dw_lanes (plan)) {
        need = s_dw_lanes_ws_floats (plan);
    } else {
        s_dw_geo_t g;
        s_dw_geometry (plan, &g);
        need = (size_t) (plan->u.conv.sh * plan->u.conv.sw * g.phase + g.slack + g.acc);
        size_t wide = (size_t) kiln_dw16_ws_floats (&geo);
        if (wide > need)
            need = wide;
    }
    size_t c16 = (size_t) kiln_dwc16_ws_floats (&geo);
    return kiln_dwc16_fits (&geo) && c16 > need ? c16 : need;
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

/* Output plane pi (image pi / m, channel pi % m) of a depthwise
 * convolution: its input plane (output channel o reads input channel
 * o / mg, one per group), weights, bias, residual (or NULL) and output. */
typedef struct {
    const float *x, *w, *res;
    float bias, *y;
} s_dw_plane_t;

static s_dw_plane_t
s_dw_plane (const kiln_kplan_t *plan, const kiln_dw_geo_t *geo, void *const *data,
            int64_t pi)
{
    const float *bias = plan->u.conv.bias ? data[plan->in[2]] : NULL;
    const float *res = plan->epi.residual >= 0 ? data[plan->in[plan->epi.residual]]
                                               : NULL;
    int64_t ohw = geo->oh * geo->ow, m = plan->u.conv.m, mg = m / plan->u.conv.group;
    int64_t ni = pi / m, o = pi % m;
    return (s_dw_plane_t) {
        (const float *) data[plan->in[0]] + (ni * plan->u.conv.c + o / mg) * geo->h * geo->w,
        (const float *) data[plan->in[1]] + o * geo->kh * geo->kw,
        res ? res + pi * ohw : NULL, bias ? bias[o] : 0.0f,
        (float *) data[plan->out] + pi * ohw };
}

/* The planes on AVX-512 (kiln_kernels_dwconv_avx512.h). */
static void
s_dw16_planes (const kiln_kplan_t *plan, const kiln_dw_geo_t *geo, void *const *data,
               int64_t first, int64_t count, float *ws)
{
    for (int64_t pi = first; pi < first + count; pi++) {
        s_dw_plane_t p = s_dw_plane (plan, geo, data, pi);
        kiln_dw16_plane (geo, p.x, p.w, p.bias, p.res, p.y, ws);
        kiln_act_apply (p.y, geo->oh * geo->ow, plan->epi.act, plan->epi.a, plan->epi.b);
    }
}

/* Small planes on AVX-512, sixteen at a time (kiln_dwc16_planes). */
static void
s_dwc16_planes (const kiln_kplan_t *plan, const kiln_dw_geo_t *geo, void *const *data,
                int64_t first, int64_t count, float *ws)
{
    for (int64_t p0 = first; p0 < first + count; p0 += 16) {
        int nl = first + count - p0 < 16 ? (int) (first + count - p0) : 16;
        const float *xs[16], *wl[16], *rs[16];
        float *ys[16], bs[16];
        for (int l = 0; l < nl; l++) {
            s_dw_plane_t p = s_dw_plane (plan, geo, data, p0 + l);
            xs[l] = p.x;
            wl[l] = p.w;
            bs[l] = p.bias;
            rs[l] = p.res;
            ys[l] = p.y;
        }
        kiln_dwc16_planes (geo, nl, xs, wl, bs, plan->epi.residual >= 0 ? rs : NULL, ys,
                           plan->epi.act, plan->epi.a, plan->epi.b, ws);
    }
}

/* Output planes [first, first + count) of a depthwise convolution, with
 * `ws` (kiln_kdw_ws_floats) to work in. */
KILN_VCLONES static void
s_dw_planes (const kiln_kplan_t *plan, void *const *data, int64_t first,
             int64_t count, float *ws)
{
    kiln_dw_geo_t g16 = s_dw_geo16 (plan);
    if (kiln_dwc16_fits (&g16)) {
        s_dwc16_planes (plan, &g16, data, first, count, ws);
        return;
    }
    if (s_dw_lanes (plan)) {
        s_dw_planes_lanes (plan, data, first, count, ws);
        return;
    }
    kiln_dw_geo_t geo = s_dw_geo16 (plan);
    if (kiln_dw16_fits (&geo)) {
        s_dw16_planes (plan, &geo, data, first, count, ws);
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

/* --- channels-last ---------------------------------------------------
 * X [N, H, W, C], W tap-major [kh, kw, C], Y (and the residual) [N, OH,
 * OW, C]: the channels lie along the vectors, so every tap of sixteen
 * outputs is one multiply-add of an input vector and a weight vector,
 * with no transposes and no padded copies (the window's reach is tested
 * per output column at the borders only).  Eight output columns are
 * summed at once where their windows lie inside the row, each tap's
 * weights loaded once for the eight.  A task is one output row of one
 * block of S_CL_CHUNK channels. */
#define S_CL_CHUNK 128

/* The taps t of a window row or column starting at `at` (t·dil apart)
 * that land inside 0 .. n - 1: lo .. hi - 1. */
static inline void
s_reach (int64_t at, int64_t k, int64_t dil, int64_t n, int64_t *lo, int64_t *hi)
{
    int64_t l = 0, h = k;
    while (l < h && at + l * dil < 0)
        l++;
    while (h > l && at + (h - 1) * dil >= n)
        h--;
    *lo = l;
    *hi = h;
}

typedef float s_v16 __attribute__ ((vector_size (64), aligned (4)));
typedef float s_v8 __attribute__ ((vector_size (32), aligned (4)));
typedef float s_v1 __attribute__ ((vector_size (4), aligned (4)));

/* A direct convolution's operands and geometry, from its plan: the
 * channels-last depthwise loops and the few-channel loops below.  k is
 * the taps of one output channel (c·kh·kw). */
typedef struct {
    const float *x, *w, *bias, *res;
    float *y;
    int64_t c, m, h, w_in, oh, ow, kh, kw, sh, sw, dh, dw, pt, pl, k;
} s_cl_t;

static s_cl_t
s_cl_of (const kiln_kplan_t *plan, void *const *data)
{
    return (s_cl_t) {
        data[plan->in[0]], data[plan->in[1]],
        plan->u.conv.bias ? data[plan->in[2]] : NULL,
        plan->epi.residual >= 0 ? data[plan->in[plan->epi.residual]] : NULL,
        data[plan->out], plan->u.conv.c, plan->u.conv.m, plan->u.conv.h, plan->u.conv.w,
        plan->u.conv.oh, plan->u.conv.ow, plan->u.conv.kh, plan->u.conv.kw,
        plan->u.conv.sh, plan->u.conv.sw, plan->u.conv.dh, plan->u.conv.dw,
        plan->u.conv.pt, plan->u.conv.pl,
        plan->u.conv.c * plan->u.conv.kh * plan->u.conv.kw };
}

/* One output column q of output row r, channels ch .. ch + lanes of V -
 * 1: window rows ilo .. ihi - 1 and columns jlo .. jhi - 1 in reach. */
#define S_CL_ONE_FN(name, V)                                                   \
    static inline __attribute__ ((always_inline)) void                        \
    name (const s_cl_t *d, const float *xn, int64_t r, int64_t ilo, int64_t ihi, \
          int64_t q, int64_t jlo, int64_t jhi, int64_t ch, float *yr, const float *rr) \
    {                                                                          \
        V acc = { 0 };                                                         \
        if (d->bias)                                                           \
            acc = *(const V *) (d->bias + ch);                                 \
        for (int64_t i = ilo; i < ihi; i++) {                                  \
            const float *xr = xn + ((r * d->sh - d->pt + i * d->dh) * d->w_in  \
                                    + q * d->sw - d->pl) * d->c + ch;          \
            const float *wr = d->w + i * d->kw * d->c + ch;                    \
            for (int64_t j = jlo; j < jhi; j++)                                \
                acc += *(const V *) (xr + j * d->dw * d->c) * *(const V *) (wr + j * d->c); \
        }                                                                      \
        if (rr)                                                                \
            acc += *(const V *) (rr + q * d->c + ch);                          \
        *(V *) (yr + q * d->c + ch) = acc;                                     \
    }
/* Eight output columns q .. q + 7 whose windows lie inside the row: eight
 * sums at once, each tap's weights loaded once for the eight. */
#define S_CL_EIGHT_FN(name, V)                                                 \
    static inline __attribute__ ((always_inline)) void                        \
    name (const s_cl_t *d, const float *xn, int64_t r, int64_t ilo, int64_t ihi, \
          int64_t q, int64_t ch, float *yr, const float *rr)                   \
    {                                                                          \
        V b = { 0 };                                                           \
        if (d->bias)                                                           \
            b = *(const V *) (d->bias + ch);                                   \
        V a0 = b, a1 = b, a2 = b, a3 = b, a4 = b, a5 = b, a6 = b, a7 = b;      \
        int64_t st = d->sw * d->c;                                             \
        for (int64_t i = ilo; i < ihi; i++) {                                  \
            const float *xr = xn + ((r * d->sh - d->pt + i * d->dh) * d->w_in  \
                                    + q * d->sw - d->pl) * d->c + ch;          \
            const float *wr = d->w + i * d->kw * d->c + ch;                    \
            for (int64_t j = 0; j < d->kw; j++) {                              \
                V wv = *(const V *) (wr + j * d->c);                           \
                const float *xp = xr + j * d->dw * d->c;                       \
                a0 += *(const V *) (xp) * wv;                                  \
                a1 += *(const V *) (xp + st) * wv;                             \
                a2 += *(const V *) (xp + 2 * st) * wv;                         \
                a3 += *(const V *) (xp + 3 * st) * wv;                         \
                a4 += *(const V *) (xp + 4 * st) * wv;                         \
                a5 += *(const V *) (xp + 5 * st) * wv;                         \
                a6 += *(const V *) (xp + 6 * st) * wv;                         \
                a7 += *(const V *) (xp + 7 * st) * wv;                         \
            }                                                                  \
        }                                                                      \
        float *y = yr + q * d->c + ch;                                         \
        if (rr) {                                                              \
            const float *rp = rr + q * d->c + ch;                              \
            a0 += *(const V *) (rp);                                           \
            a1 += *(const V *) (rp + d->c);                                    \
            a2 += *(const V *) (rp + 2 * d->c);                                \
            a3 += *(const V *) (rp + 3 * d->c);                                \
            a4 += *(const V *) (rp + 4 * d->c);                                \
            a5 += *(const V *) (rp + 5 * d->c);                                \
            a6 += *(const V *) (rp + 6 * d->c);                                \
            a7 += *(const V *) (rp + 7 * d->c);                                \
        }                                                                      \
        *(V *) (y) = a0;                                                       \
        *(V *) (y + d->c) = a1;                                                \
        *(V *) (y + 2 * d->c) = a2;                                            \
        *(V *) (y + 3 * d->c) = a3;                                            \
        *(V *) (y + 4 * d->c) = a4;                                            \
        *(V *) (y + 5 * d->c) = a5;                                            \
        *(V *) (y + 6 * d->c) = a6;                                            \
        *(V *) (y + 7 * d->c) = a7;                                            \
    }
S_CL_ONE_FN (s_cl_one16, s_v16)
S_CL_ONE_FN (s_cl_one8, s_v8)
S_CL_ONE_FN (s_cl_one1, s_v1)
S_CL_EIGHT_FN (s_cl_eight16, s_v16)
S_CL_EIGHT_FN (s_cl_eight8, s_v8)

KILN_VCLONES KILN_FP_CONTRACT static void
s_cl_rows (const kiln_kplan_t *plan, void *const *data, int64_t first,
           int64_t count, float *ws)
{
    (void) ws;
    const s_cl_t d = s_cl_of (plan, data);
    int64_t chunks = (d.c + S_CL_CHUNK - 1) / S_CL_CHUNK;
    for (int64_t t = first; t < first + count; t++) {
        int64_t row = t / chunks, c0 = t % chunks * S_CL_CHUNK;
        int64_t c1 = c0 + S_CL_CHUNK < d.c ? c0 + S_CL_CHUNK : d.c;
        int64_t ni = row / d.oh, r = row % d.oh;
        const float *xn = d.x + ni * d.h * d.w_in * d.c;
        float *yr = d.y + row * d.ow * d.c;
        const float *rr = d.res ? d.res + row * d.ow * d.c : NULL;
        int64_t ilo, ihi;           /* the window rows in reach */
        s_reach (r * d.sh - d.pt, d.kh, d.dh, d.h, &ilo, &ihi);
        for (int64_t q = 0; q < d.ow;) {
            int64_t jlo, jhi;       /* the window columns in reach */
            s_reach (q * d.sw - d.pl, d.kw, d.dw, d.w_in, &jlo, &jhi);
            bool eight = jlo == 0 && jhi == d.kw && q + 8 <= d.ow
                         && (q + 7) * d.sw - d.pl + (d.kw - 1) * d.dw < d.w_in;
            int64_t ch = c0;
            if (eight) {
                for (; ch + 16 <= c1; ch += 16)
                    s_cl_eight16 (&d, xn, r, ilo, ihi, q, ch, yr, rr);
                for (; ch + 8 <= c1; ch += 8)
                    s_cl_eight8 (&d, xn, r, ilo, ihi, q, ch, yr, rr);
                for (; ch < c1; ch++)
                    for (int64_t k = 0; k < 8; k++)
                        s_cl_one1 (&d, xn, r, ilo, ihi, q + k, 0, d.kw, ch, yr, rr);
                q += 8;
                continue;
            }
            for (; ch + 16 <= c1; ch += 16)
                s_cl_one16 (&d, xn, r, ilo, ihi, q, jlo, jhi, ch, yr, rr);
            for (; ch + 8 <= c1; ch += 8)
                s_cl_one8 (&d, xn, r, ilo, ihi, q, jlo, jhi, ch, yr, rr);
            for (; ch < c1; ch++)
                s_cl_one1 (&d, xn, r, ilo, ihi, q, jlo, jhi, ch, yr, rr);
            q++;
        }
        if (plan->epi.act != KILN_ACT_NONE && chunks == 1)
            kiln_act_apply (yr, d.ow * d.c, plan->epi.act, plan->epi.a, plan->epi.b);
        else if (plan->epi.act != KILN_ACT_NONE)     /* (one call, not one a column:
                                                     * mobilenet_v2 0.988 of the time) */
            kiln_act_apply_rows (yr + c0, d.ow, c1 - c0, d.c, plan->epi.act, plan->epi.a,
                                 plan->epi.b);
    }
}

/* --- a few input channels to channels-last ----------------------------
 * A network's first convolution (3 channels in, 3×3 stride 2) writing a
 * channels-last Y: as a product its k is 27, too short for the tiles to
 * pay for gathering their rows.  Here each output position sums its taps
 * straight from X's planes, one broadcast input value times a vector of
 * 16 output channels' weights (the packed-T panels: tap-major, 32
 * channels a panel), four output columns at once. */
#define S_FEW_COLS 4

/* Store (plus the residual) the sums v0, v1 of output column q, channels
 * of panel p (o0 .. o0 + no - 1). */
static inline __attribute__ ((always_inline)) void
s_few_store (const s_cl_t *d, float *yr, const float *rr, int64_t q, int64_t o0,
             int64_t no, const s_v16 *pv0, const s_v16 *pv1)
{
    s_v16 v0 = *pv0, v1 = *pv1;
    float *yo = yr + q * d->m + o0;
    const float *ro = rr ? rr + q * d->m + o0 : NULL;
    if (no == KILN_PACK_NR) {
        if (ro) {
            v0 += *(const s_v16 *) ro;
            v1 += *(const s_v16 *) (ro + 16);
        }
        *(s_v16 *) yo = v0;
        *(s_v16 *) (yo + 16) = v1;
        return;
    }
    if (no >= 16) {
        if (ro)
            v0 += *(const s_v16 *) ro;
        *(s_v16 *) yo = v0;
        v0 = v1;
        yo += 16;
        ro = ro ? ro + 16 : NULL;
        no -= 16;
    }
    float t[16];
    memcpy (t, &v0, sizeof t);
    for (int64_t o = 0; o < no; o++)
        yo[o] = ro ? t[o] + ro[o] : t[o];
}

/* Output column q of output row r (window rows ilo .. ihi - 1, columns
 * jlo .. jhi - 1 in reach), the channels of panel p. */
static inline __attribute__ ((always_inline)) void
s_few_one (const s_cl_t *d, const float *xn, int64_t r, int64_t ilo, int64_t ihi,
           int64_t q, int64_t jlo, int64_t jhi, int64_t p, const float *b, float *yr,
           const float *rr)
{
    enum { NR = KILN_PACK_NR };
    const float *panel = d->w + p * d->k * NR;
    s_v16 a0 = *(const s_v16 *) b, a1 = *(const s_v16 *) (b + 16);
    for (int64_t i = ilo; i < ihi; i++) {
        int64_t ih = r * d->sh - d->pt + i * d->dh;
        for (int64_t j = jlo; j < jhi; j++) {
            int64_t iw = q * d->sw - d->pl + j * d->dw;
            for (int64_t ci = 0; ci < d->c; ci++) {
                const float *wk = panel + ((i * d->kw + j) * d->c + ci) * NR;
                float xv = xn[(ci * d->h + ih) * d->w_in + iw];
                a0 += *(const s_v16 *) wk * xv;
                a1 += *(const s_v16 *) (wk + 16) * xv;
            }
        }
    }
    int64_t o0 = p * NR;
    s_few_store (d, yr, rr, q, o0, d->m - o0 < NR ? d->m - o0 : NR, &a0, &a1);
}

/* Output columns q .. q + 3 (or, `narrow`, q .. q + 7), their windows
 * inside the row: their sums at once, each tap's weights loaded once for
 * all of them.  Eight sums either way (the same registers): four columns
 * of two vectors, or, where the panel has 16 channels or fewer (the first
 * convolution of mobilenet_v3, 3 → 16), eight columns of one vector,
 * where four of two were half zeros (0.82 of the time for that
 * convolution).  Sum i is column i / 2's vector i % 2, or column i. */
static inline __attribute__ ((always_inline)) void
s_few_block (const s_cl_t *d, const float *xn, int64_t r, int64_t ilo, int64_t ihi,
             int64_t q, int64_t p, const float *b, float *yr, const float *rr,
             const bool narrow)
{
    enum { NR = KILN_PACK_NR };
    const float *panel = d->w + p * d->k * NR;
    s_v16 b0 = *(const s_v16 *) b, b1 = narrow ? b0 : *(const s_v16 *) (b + 16);
    s_v16 a0 = b0, a1 = b1, a2 = b0, a3 = b1, a4 = b0, a5 = b1, a6 = b0, a7 = b1;
    if (narrow)
        a1 = a3 = a5 = a7 = b0;
    int64_t st = d->sw;
#define S_SUM(i) \
    a##i += (narrow || (i) % 2 == 0 ? w0 : w1) * xc[(narrow ? (i) : (i) / 2) * st]
    for (int64_t i = ilo; i < ihi; i++) {
        int64_t ih = r * d->sh - d->pt + i * d->dh;
        for (int64_t j = 0; j < d->kw; j++) {
            const float *wk = panel + (i * d->kw + j) * d->c * NR;
            const float *xr = xn + ih * d->w_in + q * d->sw - d->pl + j * d->dw;
            for (int64_t ci = 0; ci < d->c; ci++) {
                s_v16 w0 = *(const s_v16 *) (wk + ci * NR);
                s_v16 w1 = narrow ? w0 : *(const s_v16 *) (wk + ci * NR + 16);
                const float *xc = xr + ci * d->h * d->w_in;
                S_SUM (0); S_SUM (1); S_SUM (2); S_SUM (3);
                S_SUM (4); S_SUM (5); S_SUM (6); S_SUM (7);
            }
        }
    }
#undef S_SUM
    int64_t o0 = p * NR, no = d->m - o0 < NR ? d->m - o0 : NR;
    if (narrow) {
        s_v16 zero = b0 - b0;
        s_few_store (d, yr, rr, q, o0, no, &a0, &zero);
        s_few_store (d, yr, rr, q + 1, o0, no, &a1, &zero);
        s_few_store (d, yr, rr, q + 2, o0, no, &a2, &zero);
        s_few_store (d, yr, rr, q + 3, o0, no, &a3, &zero);
        s_few_store (d, yr, rr, q + 4, o0, no, &a4, &zero);
        s_few_store (d, yr, rr, q + 5, o0, no, &a5, &zero);
        s_few_store (d, yr, rr, q + 6, o0, no, &a6, &zero);
        s_few_store (d, yr, rr, q + 7, o0, no, &a7, &zero);
    } else {
        s_few_store (d, yr, rr, q, o0, no, &a0, &a1);
        s_few_store (d, yr, rr, q + 1, o0, no, &a2, &a3);
        s_few_store (d, yr, rr, q + 2, o0, no, &a4, &a5);
        s_few_store (d, yr, rr, q + 3, o0, no, &a6, &a7);
    }
}

KILN_VCLONES KILN_FP_CONTRACT static void
s_few_rows (const kiln_kplan_t *plan, void *const *data, int64_t first, int64_t count,
            float *ws)
{
    (void) ws;
    const s_cl_t d = s_cl_of (plan, data);
    int64_t panels = (d.m + KILN_PACK_NR - 1) / KILN_PACK_NR;
    for (int64_t row = first; row < first + count; row++) {
        int64_t ni = row / d.oh, r = row % d.oh;
        const float *xn = d.x + ni * d.c * d.h * d.w_in;
        float *yr = d.y + row * d.ow * d.m;
        const float *rr = d.res ? d.res + row * d.ow * d.m : NULL;
        int64_t ilo, ihi;           /* the window rows in reach */
        s_reach (r * d.sh - d.pt, d.kh, d.dh, d.h, &ilo, &ihi);
        for (int64_t p = 0; p < panels; p++) {
            float b[KILN_PACK_NR] = { 0 };
            int64_t o0 = p * KILN_PACK_NR;
            if (d.bias)
                memcpy (b, d.bias + o0, (size_t) (d.m - o0 < KILN_PACK_NR ? d.m - o0
                                                  : KILN_PACK_NR) * sizeof *b);
            /* a panel of 16 channels or fewer: eight columns at once */
            int64_t cols = d.m - o0 <= 16 ? 2 * S_FEW_COLS : S_FEW_COLS;
            for (int64_t q = 0; q < d.ow;) {
                int64_t jlo, jhi;   /* the window columns in reach */
                s_reach (q * d.sw - d.pl, d.kw, d.dw, d.w_in, &jlo, &jhi);
                if (cols > S_FEW_COLS && jlo == 0 && jhi == d.kw && q + cols <= d.ow
                    && (q + cols - 1) * d.sw - d.pl + (d.kw - 1) * d.dw < d.w_in) {
                    s_few_block (&d, xn, r, ilo, ihi, q, p, b, yr, rr, true);
                    q += cols;
                } else if (jlo == 0 && jhi == d.kw && q + S_FEW_COLS <= d.ow
                    && (q + S_FEW_COLS - 1) * d.sw - d.pl + (d.kw - 1) * d.dw < d.w_in) {
                    s_few_block (&d, xn, r, ilo, ihi, q, p, b, yr, rr, false);
                    q += S_FEW_COLS;
                } else {
                    s_few_one (&d, xn, r, ilo, ihi, q, jlo, jhi, p, b, yr, rr);
                    q++;
                }
            }
        }
        if (plan->epi.act != KILN_ACT_NONE)
            kiln_act_apply (yr, d.ow * d.m, plan->epi.act, plan->epi.a, plan->epi.b);
    }
}

bool
kiln_kfew_fits (const kiln_kplan_t *plan)
{
    return plan->u.conv.packed && plan->u.conv.trans && plan->u.conv.y_cl
           && !plan->u.conv.x_cl && plan->u.conv.group == 1
           && plan->u.conv.c <= KILN_KFEW_MAX_C;
}

void
kiln_kfew_run (const kiln_kplan_t *plan, void *const *data)
{
    kiln_kplanes_run (s_few_rows, plan, data, plan->u.conv.n * plan->u.conv.oh, 1);
}

/* Run depthwise convolution `plan` on the pool, whole groups of lanes to
 * a task when the planes go 16 at a time. */
void
kiln_kdw_run (const kiln_kplan_t *plan, void *const *data)
{
    if (plan->u.conv.x_cl) {
        int64_t chunks = (plan->u.conv.c + S_CL_CHUNK - 1) / S_CL_CHUNK;
        kiln_kplanes_run (s_cl_rows, plan, data,
                          plan->u.conv.n * plan->u.conv.oh * chunks, 1);
        return;
    }
    int64_t planes = plan->u.conv.n * plan->u.conv.m;
    kiln_dw_geo_t g16 = s_dw_geo16 (plan);
    bool lanes = s_dw_lanes (plan) || kiln_dwc16_fits (&g16);
    kiln_kplanes_run (s_dw_planes, plan, data, planes, lanes ? S_DW_LANES : 1);
}
