/*
 * kiln_kernels_conv — the convolution kernels: conv2d (the matrix
 * engine, Winograd, depthwise direct loops in kiln_kernels_dwconv.c, or
 * im2col + sgemm), conv3d (im2col of a group, then the engine) and
 * conv_transpose2d.  Internal to libkilnrt.
 */
#include "runtime/kiln_kernels_priv.h"

#include <limits.h>
#include <math.h>
#include <string.h>

#include <cblas.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "runtime/kiln_exec.h"
#include "runtime/kiln_gemm.h"
#include "runtime/kiln_vmath.h"


/* --- transposed convolutions read in place ----------------------------
 * A transposed product's rows are output positions; gathering them (an
 * output position's inputs lie a plane apart, tap by tap) took as long
 * as the products on DenseNet's 3×3 128 → 32 at 14×14.  Where
 * kiln_pack_conv_inplace allows, such a convolution instead copies its
 * input once into a zero-padded buffer ([rows][channels][columns], so
 * that a tap's steps of k, the channels, are `iwp` floats apart) and each
 * tile reads its positions there (kiln_gemm_taps: AVX-512 broadcasts
 * them where they lie, the other micro-kernels copy panels of them with
 * no bounds to test): a row panel is 7 or 8 positions of one output
 * row, so that its rows are a constant stride apart.  A task is a column
 * panel of the weights (in L2 while it serves every row of the task) and
 * a block of output rows. */
/* The copies below are the workspace's (an image's input, padded): at
 * most 64 MiB, so that a convolution too large for it keeps the gather,
 * whose workspace is a block, rather than fail to allocate. */
#define S_COPY_MAX ((int64_t) 1 << 24)

/* The rows and columns of X zero-padded that the windows read: every
 * input row and column, and the padding the outputs reach. */
static void
s_padded (const kiln_kplan_t *plan, int64_t *hp, int64_t *wp)
{
    *hp = kiln_pack_padded_extent (plan->u.conv.oh, plan->u.conv.kh, plan->u.conv.sh,
                                   plan->u.conv.dh, plan->u.conv.pt, plan->u.conv.h);
    *wp = kiln_pack_padded_extent (plan->u.conv.ow, plan->u.conv.kw, plan->u.conv.sw,
                                   plan->u.conv.dw, plan->u.conv.pl, plan->u.conv.w);
}

static void
s_inplace_plan (kiln_kplan_t *plan)
{
    plan->u.conv.inplace = false;
    int64_t ow = plan->u.conv.ow, oh = plan->u.conv.oh;
    int64_t kh = plan->u.conv.kh, kw = plan->u.conv.kw;
    if (plan->u.conv.few || plan->u.conv.pro >= 0 || plan->u.conv.x_cl
        || ow < 1 || oh < 1 || plan->u.conv.c < 1)
        return;
    int64_t hp, wp;
    s_padded (plan, &hp, &wp);
    if (!kiln_pack_conv_inplace (plan->u.conv.c / plan->u.conv.group, kh, kw, wp, ow))
        return;
    /* the copy and, past it, the slack the eighth row of a 7-row panel
     * reads; each thread's workspace holds its share */
    int64_t floats;
    if (!kiln_kmul3 (hp, wp, plan->u.conv.c, &floats) || floats > S_COPY_MAX)
        return;
    floats += KILN_PACK_MR * plan->u.conv.sw + 16;
    int threads = kiln_exec_threads ();
    size_t share = (size_t) ((floats + threads - 1) / threads + 16) * sizeof (float);
    if (share > plan->ws_bytes)
        plan->ws_bytes = share;
    plan->u.conv.inplace = true;
    plan->u.conv.irp = ow % KILN_PACK_MR == 0 ? KILN_PACK_MR : 7;
    plan->u.conv.ihp = hp;
    plan->u.conv.iwp = wp;
}

/* --- untransposed convolutions read from their input's phases ---------
 * The untransposed product's columns are output positions, 32 to a
 * tile; packing them (the im2col of each block of columns) took a
 * quarter of regnet_y_400mf's time (grouped 3×3 convolutions of 8
 * channels, whose gathered elements each serve 8 outputs) and a fifth
 * of resnet50's 7×7 stem.  Instead the input is copied once, zero-padded
 * and split into its stride's phases ([c][sh][sw][php][pwp]: element
 * (r, col) of the padded plane at phase (r mod sh, col mod sw), row
 * r / sh, column col / sw), so that for every tap the inputs of output
 * positions (oh, ow) lie at a fixed offset plus oh·pwp + ow: a tile's 32
 * positions, taken row-major from a grid pwp wide (columns ow and beyond
 * of each row computed and dropped), are one run of 32 floats for each
 * tap and channel, which the tile reads where it lies (kiln_gemm_taps_b).
 * Where those dropped columns stay under an eighth of the grid. */
#define S_PHASED_K_MIN 64
#define S_PHASED_K_MAX 256

static void
s_phased_plan (kiln_kplan_t *plan)
{
    plan->u.conv.phased = false;
    int64_t oh = plan->u.conv.oh, ow = plan->u.conv.ow;
    int64_t kh = plan->u.conv.kh, kw = plan->u.conv.kw;
    int64_t sh = plan->u.conv.sh, sw = plan->u.conv.sw;
    if (!plan->u.conv.packed || plan->u.conv.trans || plan->u.conv.pointwise
        || plan->u.conv.x_cl || plan->u.conv.y_cl || plan->u.conv.pro >= 0
        || kh * kw < 2 || kh * kw > KILN_PACK_INPLACE_TAPS || oh < 1 || ow < 1
        || plan->u.conv.c < 1)
        return;
    /* a tile's B (k rows of 32 floats) in L1 while every row panel reads
     * it, and enough of it to pay for the tile's store and finish */
    int64_t k = plan->u.conv.c / plan->u.conv.group * kh * kw;
    if (k < S_PHASED_K_MIN || k > S_PHASED_K_MAX)
        return;
    int64_t hp, wp;
    s_padded (plan, &hp, &wp);
    int64_t php = (hp + sh - 1) / sh, pwp = (wp + sw - 1) / sw;
    /* (or where they cost no tile of 32 more than the gathered product's:
     * a 7 × 7 output's grid of 7 × 9 is two tiles, as its 49 positions
     * are; regnet_x_400mf's grouped 3×3 layers at 7 × 7, 400 channels in
     * groups of 16, 0.87 of the time at 1 thread, 0.95 at 2) */
    if ((pwp - ow) * 8 > pwp
        && (oh * pwp + KILN_PACK_NR - 1) / KILN_PACK_NR
           > (oh * ow + KILN_PACK_NR - 1) / KILN_PACK_NR)
        return;
    int64_t floats;
    if (!kiln_kmul3 (php * pwp, sh * sw, plan->u.conv.c, &floats) || floats > S_COPY_MAX)
        return;
    floats += KILN_PACK_NR + pwp + 16;      /* the last tile reads past it */
    int threads = kiln_exec_threads ();
    size_t share = (size_t) ((floats + threads - 1) / threads + 16) * sizeof (float);
    if (share > plan->ws_bytes)
        plan->ws_bytes = share;
    plan->u.conv.phased = true;
    plan->u.conv.php = php;
    plan->u.conv.pwp = pwp;
}

int
kiln_kprepare_CONV2D (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                  kiln_err_t *err)
{
    int rc = kiln_kneed_f32 (p, plan, err);
    if (rc)
        return rc;
    kiln_kwin_t w;
    int64_t group, x[4], y[4], want, tile = 0, layout = 0, pro = 0;
    bool packed, trans;
    if ((kiln_prog_op_has (op, "layout")
         && (rc = kiln_prog_op_int (op, "layout", &layout, err)))
        || (kiln_prog_op_has (op, "prologue")
            && (rc = kiln_prog_op_int (op, "prologue", &pro, err)))
        || (rc = kiln_kget_window (op, &w, err))
        || (rc = kiln_prog_op_int (op, "group", &group, err))
        || (rc = kiln_kernel_epilogue (p, op, plan, err))
        || (rc = kiln_kget_packed (op, "packed", &packed, err))
        || (rc = kiln_kget_packed (op, "transposed", &trans, err))
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
    const kiln_prog_tensor_t *tx = kiln_ktensor (p, plan->in[0]), *ty = kiln_ktensor (p, plan->out);
    if (!kiln_knchw (tx, x) || !kiln_knchw (ty, y) || tx->shape.rank != ty->shape.rank
        || (!packed && !layout
            && kiln_ktensor (p, plan->in[1])->shape.rank != tx->shape.rank))
        return kiln_error (err, KILN_EFORMAT, "X, W and Y must all have rank 3 "
                           "or all rank 4");
    if (layout < 0 || layout > 3 || (layout && tx->shape.rank != 4))
        return kiln_error (err, KILN_EFORMAT, "layout must be 0..3, and only of "
                           "rank-4 operands");
    plan->u.conv.x_cl = layout & 1;
    plan->u.conv.y_cl = layout & 2;
    /* channels-last operands are [N, H, W, C]: read them as N, C, H, W */
    if (plan->u.conv.x_cl)
        kiln_kcl_dims (x);
    if (plan->u.conv.y_cl)
        kiln_kcl_dims (y);
    if (group < 1 || x[1] % group != 0 || y[1] % group != 0 || y[0] != x[0])
        return kiln_error (err, KILN_EFORMAT, "group %lld does not divide %lld "
                           "input and %lld output channels", (long long) group,
                           (long long) x[1], (long long) y[1]);
    for (int i = 0; i < 2; i++)
        if (kiln_kout_size (&w, i, x[2 + i], false) != y[2 + i])
            return kiln_error (err, KILN_EFORMAT, "output size %lld along axis "
                               "%d does not follow from the window",
                               (long long) y[2 + i], i);
    int64_t cg = x[1] / group, mg = y[1] / group;
    int64_t rows, cols;
    if (!kiln_kmul3 (cg, w.k[0], w.k[1], &rows) || !kiln_kmul3 (y[2], y[3], 1, &cols)
        || !kiln_kmul3 (y[1], rows, 1, &want))
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
    if ((rc = kiln_kneed_numel (p, plan->in[1], want, packed ? "packed W" : "W", err)))
        return rc;
    if (!kiln_kblas_ok (rows) || !kiln_kblas_ok (cols) || !kiln_kblas_ok (mg))
        return kiln_error (err, KILN_EFORMAT, "convolution too large for BLAS");
    if (pro < 0 || pro > 2)
        return kiln_error (err, KILN_EFORMAT, "prologue must be 0, 1 (scale and "
                           "shift) or 2 (and relu), not %lld", (long long) pro);
    int extra = plan->n_in - 2 - (plan->epi.residual >= 0) - (pro != 0);
    if (extra < 0 || extra > 1)
        return kiln_error (err, KILN_EFORMAT, "takes X, W, an optional bias, "
                           "the prologue when it has one and an optional residual");
    plan->u.conv.bias = extra == 1;
    if (plan->u.conv.bias && (rc = kiln_kneed_numel (p, plan->in[2], y[1], "bias", err)))
        return rc;
    plan->u.conv.pointwise = w.k[0] == 1 && w.k[1] == 1 && w.s[0] == 1
                             && w.s[1] == 1 && w.p[0] == 0 && w.p[1] == 0
                             && w.p[2] == 0 && w.p[3] == 0;
    /* X's prologue (scale, shift and relu per input channel, applied as
     * the engine packs X): a packed, ungrouped pointwise product from
     * NCHW only, whose X is always packed */
    plan->u.conv.pro = pro ? 2 + plan->u.conv.bias : -1;
    plan->u.conv.pro_relu = pro == 2;
    if (pro && (!packed || wino || group != 1 || !plan->u.conv.pointwise || layout & 1))
        return kiln_error (err, KILN_EFORMAT, "a prologue only on a packed, "
                           "ungrouped pointwise convolution from NCHW");
    if (pro && (rc = kiln_kneed_numel (p, plan->in[plan->u.conv.pro], 2 * x[1],
                                       "the prologue", err)))
        return rc;
    plan->u.conv.packed = packed;
    /* Without packed weights and without a workspace, one input channel
     * per group runs the direct depthwise loops; anything else unpacked
     * goes through im2col and sgemm. */
    plan->u.conv.depthwise = !packed && cg == 1 && plan->scratch < 0;
    plan->u.conv.im2col = !packed && !plan->u.conv.depthwise
                          && !plan->u.conv.pointwise;
    /* Channels-last: a depthwise convolution of one channel per group from
     * and to channels-last (W tap-major, [kh, kw, M]), or an ungrouped
     * product with packed-T weights from either layout to either (from
     * channels-last only when pointwise). */
    if (layout
        && !(plan->u.conv.depthwise && layout == 3 && mg == 1)
        && !(packed && trans && !wino && group == 1
             && (!plan->u.conv.x_cl || plan->u.conv.pointwise)))
        return kiln_error (err, KILN_EFORMAT, "layout %lld: channels-last only "
                           "for a depthwise convolution (both ways) or an "
                           "ungrouped packed-T product (X only when pointwise)",
                           (long long) layout);
    if (plan->u.conv.im2col) {
        int64_t need;
        if (!kiln_kmul3 (rows, cols, 1, &need))
            return kiln_error (err, KILN_EFORMAT, "im2col too large");
        if (plan->scratch < 0 || kiln_ktensor_numel (kiln_ktensor (p, plan->scratch)) < need)
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
        size_t f = kiln_kdw_ws_floats (plan);
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
        plan->u.conv.few = plan->u.conv.pro < 0 && kiln_kfew_fits (plan);
        s_inplace_plan (plan);
    } else if (packed) {
        kiln_pack_conv_elems (mg, cg, w.k[0], w.k[1], 1, &plan->u.conv.wpg);
        plan->u.conv.geo = (kiln_gconv_t) {
            .c = cg, .h = x[2], .w = x[3], .oh = y[2], .ow = y[3],
            .kh = w.k[0], .kw = w.k[1], .sh = w.s[0], .sw = w.s[1],
            .dh = w.d[0], .dw = w.d[1], .pt = w.p[0], .pl = w.p[1] };
        /* B is packed block by block, even a pointwise one read in place */
        plan->ws_bytes = kiln_gemm_ws_bytes (mg, cols, rows, true, false);
        s_phased_plan (plan);
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

/* X's prologue, when the plan has one, on the operand that reads X. */
static void
s_prologue_of (const kiln_kplan_t *plan, void *const *data, kiln_gpro_t *pro)
{
    if (plan->u.conv.pro < 0)
        return;
    pro->s = data[plan->in[plan->u.conv.pro]];
    pro->b = pro->s + plan->u.conv.c;
    pro->relu = plan->u.conv.pro_relu;
}

/* Product `idx` (batch element idx / group, group idx % group) of a
 * convolution with packed weights. */
static void
s_conv_get (const void *ctx_, int64_t idx, kiln_gemm_t *g)
{
    const kiln_kgctx_t *ctx = ctx_;
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
        if (plan->u.conv.x_cl)      /* ungrouped: X's rows are positions */
            g->a = (kiln_gsrc_t) { KILN_GSRC_STRIDED, x, plan->u.conv.c, 1, NULL };
        else if (plan->u.conv.pointwise)
            g->a = (kiln_gsrc_t) { KILN_GSRC_STRIDED, x, 1, hw, NULL };
        else
            g->a = (kiln_gsrc_t) { KILN_GSRC_CONV, x, 0, 0, &plan->u.conv.geo };
        g->b = (kiln_gsrc_t) { KILN_GSRC_PACKED,
                               (const float *) data[plan->in[1]] + gi * plan->u.conv.wpg,
                               0, 0, NULL };
        s_prologue_of (plan, data, &g->a_pro);
        /* channels-last Y: C as it is, rows of m (ungrouped) */
        bool ycl = plan->u.conv.y_cl;
        g->c = (float *) data[plan->out] + yoff;
        g->ldc = ycl ? plan->u.conv.m : ohw;
        g->c_trans = !ycl;
        g->alpha = 1.0f;
        if (plan->u.conv.bias)
            g->add[g->n_add++] = (kiln_gadd_t) {
                (const float *) data[plan->in[2]] + gi * mg, 0, 1, 1.0f };
        if (plan->epi.residual >= 0)
            g->add[g->n_add++] = (kiln_gadd_t) {
                (const float *) data[plan->in[plan->epi.residual]] + yoff,
                ycl ? plan->u.conv.m : 1, ycl ? 1 : ohw, 1.0f };
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
    s_prologue_of (plan, data, &g->b_pro);
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

typedef struct {
    const kiln_kplan_t *plan;
    void *const *data;
    float *pad;             /* image ni's X, padded: [ihp][c][iwp] */
    int64_t ni;
    int64_t panels;         /* column panels of a group's weights */
    int64_t rows, blocks;   /* output rows a task, blocks of them */
} s_inplace_t;

/* Padded row `task` of image ni's copy: every channel's. */
static void
s_inplace_pad (void *arg, int task, int worker)
{
    (void) worker;
    const s_inplace_t *r = arg;
    const kiln_kplan_t *plan = r->plan;
    int64_t c = plan->u.conv.c, h = plan->u.conv.h, w = plan->u.conv.w;
    int64_t wp = plan->u.conv.iwp, pl = plan->u.conv.pl;
    int64_t ih = task - plan->u.conv.pt;
    float *dst = r->pad + task * c * wp;
    const float *x = (const float *) r->data[plan->in[0]] + r->ni * c * h * w;
    for (int64_t ci = 0; ci < c; ci++, dst += wp) {
        if (ih < 0 || ih >= h) {
            memset (dst, 0, (size_t) wp * sizeof *dst);
            continue;
        }
        memset (dst, 0, (size_t) pl * sizeof *dst);
        memcpy (dst + pl, x + (ci * h + ih) * w, (size_t) w * sizeof *dst);
        memset (dst + pl + w, 0, (size_t) (wp - pl - w) * sizeof *dst);
    }
}

/* Column panel q of group gi, a block of output rows: every tile. */
static void
s_inplace_task (void *arg, int task, int worker)
{
    (void) worker;
    const s_inplace_t *r = arg;
    const kiln_kplan_t *plan = r->plan;
    int64_t groups = plan->u.conv.group, cg = plan->u.conv.c / groups;
    int64_t mg = plan->u.conv.m / groups;
    int64_t q = task % r->panels, rest = task / r->panels;
    int64_t blk = rest % r->blocks, gi = rest / r->blocks;
    int64_t oh0 = blk * r->rows, oh1 = oh0 + r->rows;
    if (oh1 > plan->u.conv.oh)
        oh1 = plan->u.conv.oh;
    kiln_kgctx_t ctx = { plan, r->data };
    kiln_gemm_t g;
    s_conv_get (&ctx, r->ni * groups + gi, &g);
    int64_t wp = plan->u.conv.iwp, pitch = plan->u.conv.c * wp;
    int64_t kw = plan->u.conv.kw, taps = plan->u.conv.kh * kw;
    int64_t off[KILN_PACK_INPLACE_TAPS];
    for (int64_t t = 0; t < taps; t++)
        off[t] = t / kw * plan->u.conv.dh * pitch + t % kw * plan->u.conv.dw;
    const float *b = (const float *) r->data[plan->in[1]] + gi * plan->u.conv.wpg
                     + q * cg * taps * KILN_PACK_NR;
    int64_t j = q * KILN_PACK_NR, nr = mg - j < KILN_PACK_NR ? mg - j : KILN_PACK_NR;
    int64_t ow = plan->u.conv.ow, rp = plan->u.conv.irp, sw = plan->u.conv.sw;
    for (int64_t oh = oh0; oh < oh1; oh++) {
        const float *a = r->pad + oh * plan->u.conv.sh * pitch + gi * cg * wp;
        for (int64_t ow0 = 0; ow0 < ow; ow0 += rp)
            kiln_gemm_taps (&g, a + ow0 * sw, off, (int) taps, cg, sw, wp, b,
                            oh * ow + ow0, j, rp, nr);
    }
}

static void
s_inplace_run (const kiln_kplan_t *plan, void *const *data)
{
    size_t bytes;
    float *ws = kiln_exec_ws (&bytes);
    s_inplace_t r = { .plan = plan, .data = data,
                      .pad = (float *) (((uintptr_t) ws + 63) & ~(uintptr_t) 63) };
    int64_t groups = plan->u.conv.group, mg = plan->u.conv.m / groups;
    int64_t oh = plan->u.conv.oh, threads = kiln_exec_threads ();
    r.panels = (mg + KILN_PACK_NR - 1) / KILN_PACK_NR;
    /* blocks of rows: one on one thread; else enough tasks for a few each */
    r.blocks = 1;
    if (threads > 1 && groups * r.panels < 4 * threads)
        r.blocks = (4 * threads + groups * r.panels - 1) / (groups * r.panels);
    if (r.blocks > oh)
        r.blocks = oh;
    r.rows = (oh + r.blocks - 1) / r.blocks;
    r.blocks = (oh + r.rows - 1) / r.rows;
    int64_t copy = plan->u.conv.ihp * plan->u.conv.c * plan->u.conv.iwp;
    memset (r.pad + copy, 0, (size_t) (KILN_PACK_MR * plan->u.conv.sw + 16) * sizeof (float));
    for (r.ni = 0; r.ni < plan->u.conv.n; r.ni++) {
        kiln_exec_parallel (s_inplace_pad, &r, (int) plan->u.conv.ihp);
        kiln_exec_parallel (s_inplace_task, &r, (int) (groups * r.blocks * r.panels));
    }
}

typedef struct {
    const kiln_kplan_t *plan;
    void *const *data;
    float *ph;              /* image ni's X in phases: [c][sh][sw][php][pwp] */
    int64_t ni;
    int64_t tiles, per, blocks;     /* tiles of 32 positions, a task's, blocks */
} s_phased_t;

#if defined(__x86_64__)
/* One input row into the two column phases of its padded row (stride 2,
 * AVX-512): element iw is column iw + pl of the padded row, which goes to
 * phase (iw + pl) mod 2 at (iw + pl) / 2.  Sixteen columns of each phase
 * from two masked loads (zero in the padding) and two permutes, every
 * column below pwp written. */
__attribute__ ((target ("avx512f"))) static void
s_phase_row2_avx512 (const float *src, int64_t w, int64_t pl, float *d0, float *d1,
                     int64_t pwp)
{
    const __m512i even = _mm512_setr_epi32 (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                            24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32 (even, _mm512_set1_epi32 (1));
    for (int64_t q0 = 0; q0 < pwp; q0 += 16) {
        /* padded columns 2·q0 ... 2·q0 + 31: input elements from i0 */
        int64_t i0 = 2 * q0 - pl;
        __m512 a = _mm512_maskz_loadu_ps (kiln_lanes16 (i0, w), kiln_at (src, i0));
        __m512 b = _mm512_maskz_loadu_ps (kiln_lanes16 (i0 + 16, w), kiln_at (src, i0 + 16));
        int64_t n = pwp - q0 < 16 ? pwp - q0 : 16;
        __mmask16 st = (__mmask16) ((1u << n) - 1);
        _mm512_mask_storeu_ps (d0 + q0, st, _mm512_permutex2var_ps (a, even, b));
        _mm512_mask_storeu_ps (d1 + q0, st, _mm512_permutex2var_ps (a, odd, b));
    }
}
#endif

/* Channel `task` of image ni, padded, into its phases, a row of the
 * padded plane at a time (its columns split among the phases of its
 * row).  On AVX-512 a stride-2 row is one call: phase row by phase row,
 * the copy had taken three quarters of a stride-2 grouped 3×3
 * convolution at 7 × 7 (regnet_x_400mf's 400 channels: 0.157 of 0.212
 * ms). */
KILN_VCLONES static void
s_phased_copy (void *arg, int task, int worker)
{
    (void) worker;
    const s_phased_t *r = arg;
    const kiln_kplan_t *plan = r->plan;
    int64_t h = plan->u.conv.h, w = plan->u.conv.w, sh = plan->u.conv.sh;
    int64_t sw = plan->u.conv.sw, php = plan->u.conv.php, pwp = plan->u.conv.pwp;
    int64_t pt = plan->u.conv.pt, pl = plan->u.conv.pl;
    const float *x = (const float *) r->data[plan->in[0]]
                     + (r->ni * plan->u.conv.c + task) * h * w;
    float *dst = r->ph + task * sh * sw * php * pwp;
#if defined(__x86_64__)
    bool fast = sw == 2 && kiln_gemm_avx512 ();
#endif
    for (int64_t rp = 0; rp < php * sh; rp++) {
        /* padded row rp: row rp / sh of the phases (rp mod sh, pc) */
        float *drow = dst + ((rp % sh) * sw * php + rp / sh) * pwp;
        int64_t ih = rp - pt;
        if (ih < 0 || ih >= h) {
            for (int64_t pc = 0; pc < sw; pc++)
                memset (drow + pc * php * pwp, 0, (size_t) pwp * sizeof *drow);
            continue;
        }
        const float *src = x + ih * w;
#if defined(__x86_64__)
        if (fast) {
            s_phase_row2_avx512 (src, w, pl, drow, drow + php * pwp, pwp);
            continue;
        }
#endif
        for (int64_t pc = 0; pc < sw; pc++) {
            /* columns q whose input column q·sw + pc - pl is in X */
            int64_t lo = pl - pc > 0 ? (pl - pc + sw - 1) / sw : 0;
            int64_t hi = (w + pl - pc + sw - 1) / sw;
            lo = lo < pwp ? lo : pwp;
            hi = hi < pwp ? hi : pwp;
            hi = hi > lo ? hi : lo;
            float *d = drow + pc * php * pwp;
            const float *sp = src + lo * sw + pc - pl;
            for (int64_t q = 0; q < lo; q++)
                d[q] = 0.0f;
            if (sw == 1)
                memcpy (d + lo, sp, (size_t) (hi - lo) * sizeof *d);
            else if (sw == 2)       /* a constant stride vectorises */
                for (int64_t q = 0; q < hi - lo; q++)
                    d[lo + q] = sp[2 * q];
            else
                for (int64_t q = 0; q < hi - lo; q++)
                    d[lo + q] = sp[q * sw];
            for (int64_t q = hi; q < pwp; q++)
                d[q] = 0.0f;
        }
    }
}

/* Group gi, a block of tiles of positions: every row panel of each. */
static void
s_phased_task (void *arg, int task, int worker)
{
    (void) worker;
    const s_phased_t *r = arg;
    const kiln_kplan_t *plan = r->plan;
    int64_t groups = plan->u.conv.group, cg = plan->u.conv.c / groups;
    int64_t mg = plan->u.conv.m / groups;
    int64_t blk = task % r->blocks, gi = task / r->blocks;
    int64_t t0 = blk * r->per, t1 = t0 + r->per < r->tiles ? t0 + r->per : r->tiles;
    kiln_kgctx_t ctx = { plan, r->data };
    kiln_gemm_t g;
    s_conv_get (&ctx, r->ni * groups + gi, &g);
    int64_t sh = plan->u.conv.sh, sw = plan->u.conv.sw;
    int64_t php = plan->u.conv.php, pwp = plan->u.conv.pwp;
    int64_t kw = plan->u.conv.kw, taps = plan->u.conv.kh * kw;
    int64_t off[KILN_PACK_INPLACE_TAPS];
    for (int64_t t = 0; t < taps; t++) {
        int64_t rr = t / kw * plan->u.conv.dh, cc = t % kw * plan->u.conv.dw;
        off[t] = ((rr % sh * sw + cc % sw) * php + rr / sh) * pwp + cc / sw;
    }
    int64_t bcs = sh * sw * php * pwp, k = cg * taps;
    const float *a = (const float *) r->data[plan->in[1]] + gi * plan->u.conv.wpg;
    const float *b = r->ph + gi * cg * bcs;
    int64_t ow = plan->u.conv.ow, vn = plan->u.conv.oh * pwp;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t i = 0; i < mg; i += KILN_PACK_MR)
            kiln_gemm_taps_b (&g, a + i * k, b + t * KILN_PACK_NR, off, (int) taps, cg,
                              bcs, i, mg - i < KILN_PACK_MR ? mg - i : KILN_PACK_MR,
                              t * KILN_PACK_NR, pwp, ow, vn);
}

/* Group `task`'s channels into their phases, then every tile of it:
 * where each group is one task, the thread that computes a group copies
 * its input (in its own cache, with no second parallel region; at 2
 * threads regnet_x_400mf 0.93 of the time, regnet_y_400mf 0.96, level
 * at 1). */
static void
s_phased_group (void *arg, int task, int worker)
{
    const s_phased_t *r = arg;
    int64_t cg = r->plan->u.conv.c / r->plan->u.conv.group;
    for (int64_t ch = task * cg; ch < (task + 1) * cg; ch++)
        s_phased_copy (arg, (int) ch, worker);
    s_phased_task (arg, task, worker);
}

static void
s_phased_run (const kiln_kplan_t *plan, void *const *data)
{
    size_t bytes;
    float *ws = kiln_exec_ws (&bytes);
    s_phased_t r = { .plan = plan, .data = data,
                     .ph = (float *) (((uintptr_t) ws + 63) & ~(uintptr_t) 63) };
    int64_t groups = plan->u.conv.group, threads = kiln_exec_threads ();
    r.tiles = (plan->u.conv.oh * plan->u.conv.pwp + KILN_PACK_NR - 1) / KILN_PACK_NR;
    r.blocks = 1;
    if (threads > 1 && groups < 4 * threads)
        r.blocks = (4 * threads + groups - 1) / groups;
    if (r.blocks > r.tiles)
        r.blocks = r.tiles;
    r.per = (r.tiles + r.blocks - 1) / r.blocks;
    r.blocks = (r.tiles + r.per - 1) / r.per;
    int64_t copy = plan->u.conv.c * plan->u.conv.sh * plan->u.conv.sw
                   * plan->u.conv.php * plan->u.conv.pwp;
    memset (r.ph + copy, 0, (size_t) (KILN_PACK_NR + plan->u.conv.pwp + 16) * sizeof (float));
    for (r.ni = 0; r.ni < plan->u.conv.n; r.ni++) {
        if (r.blocks == 1) {
            kiln_exec_parallel (s_phased_group, &r, (int) groups);
            continue;
        }
        kiln_exec_parallel (s_phased_copy, &r, (int) plan->u.conv.c);
        kiln_exec_parallel (s_phased_task, &r, (int) (groups * r.blocks));
    }
}

void
kiln_krun_CONV2D (const kiln_kplan_t *plan, void *const *data)
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
    if (plan->u.conv.few) {
        kiln_kfew_run (plan, data);
        return;
    }
    if (plan->u.conv.inplace) {
        s_inplace_run (plan, data);
        return;
    }
    if (plan->u.conv.phased) {
        s_phased_run (plan, data);
        return;
    }
    if (plan->u.conv.packed) {
        kiln_kgctx_t ctx = { plan, data };
        kiln_gemm_run (s_conv_get, &ctx, plan->u.conv.n * g);
        return;
    }
    if (plan->u.conv.depthwise) {
        kiln_kdw_run (plan, data);
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
    if (kiln_khas_epilogue (plan))
        kiln_kepilogue_after (plan, data, y, plan->u.conv.n * plan->u.conv.m * ohw);
}


/* --- conv3d: im2col of one group into the scratch, then the engine --- */

int
kiln_kprepare_CONV3D (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                  kiln_err_t *err)
{
    int rc = kiln_kneed_f32 (p, plan, err);
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
    const kiln_prog_tensor_t *tx = kiln_ktensor (p, plan->in[0]), *tw = kiln_ktensor (p, plan->in[1]);
    const kiln_prog_tensor_t *ty = kiln_ktensor (p, plan->out);
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
    if (plan->u.conv3.bias && (rc = kiln_kneed_numel (p, plan->in[2], m, "the bias", err)))
        return rc;
    bool pw = true;
    for (int i = 0; i < 3; i++)
        pw = pw && k[i] == 1 && st[i] == 1 && pads[i] == 0 && pads[3 + i] == 0;
    plan->u.conv3.pointwise = pw;
    int64_t col_elems;
    if (__builtin_mul_overflow (rows, cols, &col_elems))
        return kiln_error (err, KILN_ELIMIT, "the im2col of %lld x %lld overflows",
                           (long long) rows, (long long) cols);
    if (!pw && (plan->scratch < 0 || kiln_ktensor (p, plan->scratch)->dtype != KILN_DT_FLOAT32
                || kiln_ktensor_numel (kiln_ktensor (p, plan->scratch)) < col_elems))
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

void
kiln_krun_CONV3D (const kiln_kplan_t *plan, void *const *data)
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

/* --- conv_transpose2d (its plan: kiln_kshape_plan_t) -------------------- */

void
kiln_krun_CONV_TRANSPOSE2D (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kshape_plan_t *sp = &plan->u.shape;
    const float *x = data[plan->in[0]], *wt = data[plan->in[1]];
    const float *bias = sp->bias ? data[plan->in[2]] : NULL;
    float *y = data[plan->out], *col = data[plan->scratch];
    int64_t g = sp->group, cg = sp->c / g, mg = sp->m / g;
    int64_t hw = sp->h * sp->w, ohw = sp->oh * sp->ow, kk = sp->kh * sp->kw;
    int64_t rows = mg * kk;
    memset (y, 0, (size_t) (sp->n * sp->m * ohw) * sizeof *y);
    for (int64_t n = 0; n < sp->n; n++)
        for (int64_t gi = 0; gi < g; gi++) {
            const float *xg = x + (n * sp->c + gi * cg) * hw;
            const float *wg = wt + gi * cg * rows;
            float *yg = y + (n * sp->m + gi * mg) * ohw;
            if (rows == 0 || hw == 0)
                continue;
            if (cg == 0)
                memset (col, 0, (size_t) (rows * hw) * sizeof *col);
            else
                /* col[mg*kh*kw, h*w] = Wg^T [mg*kh*kw, cg] . Xg [cg, h*w] */
                cblas_sgemm (CblasRowMajor, CblasTrans, CblasNoTrans, (int) rows, (int) hw,
                             (int) cg, 1.0f, wg, (int) rows, xg, (int) hw, 0.0f, col, (int) hw);
            /* col2im: scatter every column entry to where it lands. */
            for (int64_t m = 0; m < mg; m++)
                for (int64_t i = 0; i < sp->kh; i++)
                    for (int64_t j = 0; j < sp->kw; j++) {
                        const float *cr = col + ((m * sp->kh + i) * sp->kw + j) * hw;
                        float *ym = yg + m * ohw;
                        for (int64_t ih = 0; ih < sp->h; ih++) {
                            int64_t oh = ih * sp->sh - sp->pt + i * sp->dh;
                            if (oh < 0 || oh >= sp->oh)
                                continue;
                            for (int64_t iw = 0; iw < sp->w; iw++) {
                                int64_t ow = iw * sp->sw - sp->pl + j * sp->dw;
                                if (ow >= 0 && ow < sp->ow)
                                    ym[oh * sp->ow + ow] += cr[ih * sp->w + iw];
                            }
                        }
                    }
            if (bias)
                for (int64_t m = 0; m < mg; m++) {
                    float b = bias[gi * mg + m], *row = yg + m * ohw;
                    for (int64_t i = 0; i < ohw; i++)
                        row[i] += b;
                }
        }
}

int
kiln_kprepare_CONV_TRANSPOSE2D (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                       kiln_err_t *err)
{
    kiln_kshape_plan_t *sp = &plan->u.shape;
    kiln_kwin_t w;
    int64_t group, opad[2], x[4], y[4], wd[4];
    int rc;
    if ((rc = kiln_kneed_f32 (p, plan, err)) || (rc = kiln_kget_window (op, &w, err))
        || (rc = kiln_prog_op_ints (op, "output_padding", 2, opad, err))
        || (rc = kiln_prog_op_int (op, "group", &group, err)))
        return rc;
    const kiln_prog_tensor_t *tx = kiln_ktensor (p, plan->in[0]), *tw = kiln_ktensor (p, plan->in[1]);
    const kiln_prog_tensor_t *ty = kiln_ktensor (p, plan->out);
    if (!kiln_knchw (tx, x) || !kiln_knchw (ty, y) || !kiln_knchw (tw, wd) || tx->shape.rank != ty->shape.rank
        || tw->shape.rank != tx->shape.rank)
        return kiln_error (err, KILN_EFORMAT, "X, W and Y must all have rank 3 or all rank 4");
    if (group < 1 || x[1] % group != 0 || wd[0] != x[1] || wd[1] * group != y[1] || y[0] != x[0]
        || wd[2] != w.k[0] || wd[3] != w.k[1])
        return kiln_error (err, KILN_EFORMAT, "W [%lld, %lld, %lld, %lld] does not fit X, Y and group %lld",
                           (long long) wd[0], (long long) wd[1], (long long) wd[2],
                           (long long) wd[3], (long long) group);
    for (int i = 0; i < 2; i++) {
        if (opad[i] < 0 || opad[i] > KILN_MAX_DIM)
            return kiln_error (err, KILN_EFORMAT, "output_padding[%d] is %lld", i, (long long) opad[i]);
        /* Every term is below 2^31, so this fits int64. */
        int64_t want = w.s[i] * (x[2 + i] - 1) + opad[i] + (w.k[i] - 1) * w.d[i] + 1 - w.p[i]
                       - w.p[2 + i];
        if (x[2 + i] == 0 || want != y[2 + i])
            return kiln_error (err, KILN_EFORMAT, "output size %lld along axis %d does not follow from the window",
                               (long long) y[2 + i], i);
    }
    int64_t rows, hw, need;
    if (__builtin_mul_overflow (wd[1], w.k[0] * w.k[1], &rows)
        || __builtin_mul_overflow (x[2], x[3], &hw) || __builtin_mul_overflow (rows, hw, &need)
        || rows > INT_MAX || hw > INT_MAX || x[1] / group > INT_MAX)
        return kiln_error (err, KILN_EFORMAT, "transposed convolution too large for BLAS");
    if (plan->scratch < 0 || kiln_ktensor_numel (kiln_ktensor (p, plan->scratch)) < need)
        return kiln_error (err, KILN_EFORMAT, "needs a scratch tensor of %lld elements", (long long) need);
    sp->bias = plan->n_in == 3;
    if (sp->bias && kiln_ktensor_numel (kiln_ktensor (p, plan->in[2])) != y[1])
        return kiln_error (err, KILN_EFORMAT, "bias holds %lld elements, expected %lld",
                           (long long) kiln_ktensor_numel (kiln_ktensor (p, plan->in[2])), (long long) y[1]);
    sp->n = x[0];
    sp->c = x[1];
    sp->h = x[2];
    sp->w = x[3];
    sp->m = y[1];
    sp->oh = y[2];
    sp->ow = y[3];
    sp->kh = w.k[0];
    sp->kw = w.k[1];
    sp->sh = w.s[0];
    sp->sw = w.s[1];
    sp->dh = w.d[0];
    sp->dw = w.d[1];
    sp->pt = w.p[0];
    sp->pl = w.p[1];
    sp->group = group;
    plan->run = kiln_krun_CONV_TRANSPOSE2D;
    return 0;
}
