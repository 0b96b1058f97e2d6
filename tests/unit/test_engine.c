/*
 * Unit tests for the engine: the packed matrix-product engine
 * (runtime/kiln_gemm.c) on every operand form, epilogue and micro-kernel,
 * the vectorised transcendentals (runtime/kiln_vmath.c) against libm in
 * double, and the compiler's optimisations (compiler/kiln_cc_fuse.c,
 * packing, Winograd, the depthwise loops, batch-norm folding, the
 * layer-norm pattern) checked the way the issue asks: the optimised
 * program against the same graph at --optlevel 0, on random inputs.
 * Also the intra-op pool (runtime/kiln_exec.c) and the refusals of
 * malformed packed programs.
 *
 * Tests that pick a micro-kernel (KILN_RT_ISA) or a thread count
 * (KILN_RT_THREADS) set them before the first use in their own process
 * (Check forks per test); under CK_FORK=no they run with whatever the
 * process has, which still checks the results.
 */
#include <check.h>

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_fs.h"
#include "common/kiln_pack.h"
#include "common/kiln_program.h"
#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"
#include "runtime/kiln_exec.h"
#include "runtime/kiln_gemm.h"
#include "runtime/kiln_rt.h"
#include "runtime/kiln_vmath.h"
#include "tests/unit/testlib.h"

static char *s_dir;             /* per-test temporary directory */
static char s_keys[PATH_MAX];   /* s_dir/keys: key pair and keyring */
static kiln_key_t *s_key;
static kiln_rt_t *s_rt;
static int s_files;

static void
setup (void)
{
    kiln_err_t err;
    s_dir = testlib_keydir ("kiln-test-engine-", s_keys, &s_key);
    s_rt = kiln_rt_new (&err);
    ck_assert_msg (s_rt, "%s", err.msg);
    testlib_seed (4242);
    s_files = 0;
}

static void
teardown (void)
{
    kiln_rt_destroy (&s_rt);
    kiln_key_destroy (&s_key);
    testlib_rmdir (&s_dir);
}

/* --- helpers ---------------------------------------------------------- */

/* The helpers shared with the other unit tests (tests/unit/testlib.h),
 * under the short names this file's tests use. */
#define s_randf testlib_randf
#define s_rand testlib_rand
#define s_numel testlib_numel
#define s_input testlib_input
#define s_const testlib_const
#define s_weight testlib_weight
#define s_tensor testlib_tensor
#define s_node testlib_node
#define s_ints testlib_ints
#define s_int testlib_int
#define s_float testlib_float
#define s_output testlib_output

/* Compile `g` at `optlevel`; the program too when `prog` is not NULL
 * (caller destroys it).  Signs, writes and loads the artifact. */
static kiln_model_t *
s_build (kiln_graph_t *g, int optlevel, kiln_program_t **prog)
{
    kiln_err_t err = { 0 };
    char args[32];
    snprintf (args, sizeof args, "--optlevel %d", optlevel);
    kiln_artifact_t *art = kiln_cc_compile (g, args, &err);
    ck_assert_msg (art, "compile -O%d: %s", optlevel, err.msg);
    if (prog)
        *prog = testlib_program_of (art);
    char path[PATH_MAX];
    snprintf (path, sizeof path, "%s/m%d.kar", s_dir, s_files++);
    testlib_sign_write (&art, s_key, path);
    kiln_model_t *m = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_msg (m, "load -O%d: %s", optlevel, err.msg);
    return m;
}

/* Run a one-input, one-output model; caller frees the result. */
static float *
s_run1 (kiln_model_t *m, const float *x, int64_t *n_out)
{
    const kiln_manifest_t *man = kiln_model_manifest (m);
    kiln_rt_tensor_t in = { KILN_DT_FLOAT32, man->inputs[0].shape, (void *) x };
    int64_t n = s_numel (&man->outputs[0].shape);
    float *y = malloc ((size_t) (n ? n : 1) * sizeof *y);
    kiln_rt_tensor_t out = { .data = y };
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_model_run (m, &in, 1, &out, 1, &err) == 0, "%s", err.msg);
    *n_out = n;
    return y;
}

/* Run `g` at -O0 and at `optlevel` on the same random input and check
 * that the results agree within `tol` of the reference's largest
 * magnitude (the tolerance the issue sets for whole models).  Returns the
 * optimised program (caller destroys it) for checks on its ops. */
static kiln_program_t *
s_check_against_o0 (kiln_graph_t *g, int optlevel, double tol, const char *what)
{
    kiln_model_t *ref = s_build (g, 0, NULL);
    kiln_program_t *prog = NULL;
    kiln_model_t *opt = s_build (g, optlevel, &prog);
    const kiln_manifest_t *man = kiln_model_manifest (ref);
    int64_t nx = s_numel (&man->inputs[0].shape), n0, n1;
    float *x = s_rand (nx);
    float *y0 = s_run1 (ref, x, &n0), *y1 = s_run1 (opt, x, &n1);
    ck_assert_int_eq (n0, n1);
    double big = 0, worst = 0;
    for (int64_t i = 0; i < n0; i++) {
        big = fmax (big, fabs ((double) y0[i]));
        worst = fmax (worst, fabs ((double) y0[i] - (double) y1[i]));
    }
    ck_assert_msg (big > 0, "%s: the reference output is all zeros", what);
    ck_assert_msg (worst <= tol * big, "%s at -O%d: max error %.3g of max "
                   "magnitude %.3g", what, optlevel, worst, big);
    free (x);
    free (y0);
    free (y1);
    kiln_model_destroy (&ref);
    kiln_model_destroy (&opt);
    return prog;
}

static int
s_count_ops (const kiln_program_t *p, kiln_kernel_t k)
{
    int n = 0;
    for (int i = 0; i < p->n_ops; i++)
        n += p->ops[i].kernel == k;
    return n;
}

static const kiln_prog_param_t *
s_param (const kiln_program_t *p, kiln_kernel_t k, const char *name)
{
    for (int i = 0; i < p->n_ops; i++) {
        if (p->ops[i].kernel != k)
            continue;
        for (int j = 0; j < p->ops[i].n_params; j++)
            if (strcmp (p->ops[i].params[j].name, name) == 0)
                return &p->ops[i].params[j];
    }
    return NULL;
}

/* --- the matrix-product engine ----------------------------------------- */

static double
s_act_ref (double v, kiln_act_t act, double a, double b)
{
    double sg = 1.0 / (1.0 + exp (-v)), h;
    switch (act) {
    case KILN_ACT_RELU: return v < 0 ? 0 : v;
    case KILN_ACT_CLIP: return v < a ? a : v > b ? b : v;
    case KILN_ACT_LEAKY: return v < 0 ? a * v : v;
    case KILN_ACT_SIGMOID: return sg;
    case KILN_ACT_SILU: return v * sg;
    case KILN_ACT_GELU: return v * (erf (v / sqrt (2.0)) + 1.0) * 0.5;
    case KILN_ACT_TANH: return tanh (v);
    case KILN_ACT_HARD_SWISH:
        h = v / 6.0 + 0.5;
        return v * (h < 0 ? 0 : h > 1 ? 1 : h);
    case KILN_ACT_HARD_SIGMOID:
        h = a * v + b;
        return h < 0 ? 0 : h > 1 ? 1 : h;
    default: return v;
    }
}

/* C of the product g (C transposed or not) against double: A's rows
 * lda apart, B row-major. */
static void
s_expect_product (const kiln_gemm_t *g, const float *a, int64_t lda,
                  const float *b, const char *what, int form)
{
    for (int64_t i = 0; i < g->m; i++)
        for (int64_t j = 0; j < g->n; j++) {
            double sum = 0, mag = 0;
            for (int64_t q = 0; q < g->k; q++) {
                sum += (double) a[i * lda + q] * b[q * g->n + j];
                mag += fabs ((double) a[i * lda + q] * b[q * g->n + j]);
            }
            sum *= g->alpha;
            for (int ad = 0; ad < g->n_add; ad++)
                sum += g->add[ad].scale
                       * g->add[ad].p[i * g->add[ad].rs + j * g->add[ad].cs];
            sum = s_act_ref (sum, g->act, g->act_a, g->act_b);
            double got = g->c_trans ? g->c[j * g->ldc + i] : g->c[i * g->ldc + j];
            ck_assert_msg (fabs (got - sum) <= 1e-5 * (mag + 4.0),
                           "%s: %s %lldx%lldx%lld form %d: C[%lld, %lld] = %.8g, "
                           "expected %.8g", kiln_gemm_isa (), what, (long long) g->m,
                           (long long) g->n, (long long) g->k, form, (long long) i,
                           (long long) j, got, sum);
        }
}

/* Every operand form and epilogue for one shape, against double. */
static void
s_check_shape (int64_t m, int64_t n, int64_t k)
{
    float *a = s_rand (m * k), *b = s_rand (k * n);
    float *bias_m = s_rand (m), *bias_n = s_rand (n), *res = s_rand (m * n);
    int64_t ae, be;
    ck_assert (kiln_pack_a_elems (m, k, &ae) && kiln_pack_b_elems (k, n, &be));
    float *ap = calloc ((size_t) ae + 1, sizeof *ap);
    float *bp = calloc ((size_t) be + 1, sizeof *bp);
    kiln_pack_a (a, m, k, k, 1, ap);
    kiln_pack_b (b, k, n, n, 1, bp);
    /* transposed copies: A as [k, m], B as [n, k] */
    float *at = malloc ((size_t) (m * k + 1) * sizeof *at);
    float *bt = malloc ((size_t) (k * n + 1) * sizeof *bt);
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < k; j++)
            at[j * m + i] = a[i * k + j];
    for (int64_t i = 0; i < k; i++)
        for (int64_t j = 0; j < n; j++)
            bt[j * k + i] = b[i * n + j];
    float *c = malloc ((size_t) (m * n + 1) * sizeof *c);
    for (int form = 0; form < 6; form++) {
        kiln_gemm_t g = { .m = m, .n = n, .k = k, .c = c, .ldc = n, .alpha = 1.0f };
        switch (form % 3) {
        case 0: g.a = (kiln_gsrc_t) { KILN_GSRC_PACKED, ap, 0, 0, NULL }; break;
        case 1: g.a = (kiln_gsrc_t) { KILN_GSRC_STRIDED, a, k, 1, NULL }; break;
        default: g.a = (kiln_gsrc_t) { KILN_GSRC_STRIDED, at, 1, m, NULL }; break;
        }
        switch (form / 2 % 3) {
        case 0: g.b = (kiln_gsrc_t) { KILN_GSRC_PACKED, bp, 0, 0, NULL }; break;
        case 1: g.b = (kiln_gsrc_t) { KILN_GSRC_STRIDED, b, n, 1, NULL }; break;
        default: g.b = (kiln_gsrc_t) { KILN_GSRC_STRIDED, bt, 1, k, NULL }; break;
        }
        /* a different epilogue per form */
        kiln_act_t acts[6] = { KILN_ACT_NONE, KILN_ACT_RELU, KILN_ACT_CLIP,
                               KILN_ACT_LEAKY, KILN_ACT_SILU, KILN_ACT_GELU };
        g.act = acts[form];
        g.act_a = g.act == KILN_ACT_CLIP ? -0.5f : 0.1f;
        g.act_b = 0.75f;
        g.alpha = form == 5 ? 0.5f : 1.0f;
        if (form % 2)
            g.add[g.n_add++] = (kiln_gadd_t) { bias_m, 1, 0, 1.0f };
        else
            g.add[g.n_add++] = (kiln_gadd_t) { bias_n, 0, 1, form == 4 ? 2.0f : 1.0f };
        if (form >= 3)
            g.add[g.n_add++] = (kiln_gadd_t) { res, n, 1, 1.0f };
        for (int64_t i = 0; i < m * n; i++)
            c[i] = NAN;                 /* every element must be written */
        testlib_gemm (&g);
        s_expect_product (&g, a, k, b, "product", form);
    }
    free (a); free (b); free (ap); free (bp); free (at); free (bt);
    free (bias_m); free (bias_n); free (res); free (c);
}

/* C written transposed (c[j·m + i]): A read with adjacent rows (as a
 * convolution's positions are) or not, addends adjacent along the
 * written runs (the vector finish) or strided (the portable one), every
 * activation, against double. */
static void
s_check_trans (int64_t m, int64_t n, int64_t k)
{
    float *a = s_rand (m * k), *b = s_rand (k * n);
    float *bias_n = s_rand (n), *res = s_rand (m * n);
    float *at = malloc ((size_t) (m * k + 1) * sizeof *at);
    for (int64_t i = 0; i < m; i++)
        for (int64_t q = 0; q < k; q++)
            at[q * m + i] = a[i * k + q];
    int64_t be;
    ck_assert (kiln_pack_b_elems (k, n, &be));
    float *bp = calloc ((size_t) be + 1, sizeof *bp);
    kiln_pack_b (b, k, n, n, 1, bp);
    float *c = malloc ((size_t) (m * n + 1) * sizeof *c);
    /* forms 3 and 4: a bias and a residual laid out like C under Leaky
     * Relu and under Tanh (a heavy activation with no vector form, run
     * once over the finished tile), scaled residual and alpha in 4 */
    static const kiln_act_t acts[] = { KILN_ACT_SILU, KILN_ACT_CLIP, KILN_ACT_TANH,
                                       KILN_ACT_LEAKY, KILN_ACT_TANH };
    for (int form = 0; form < 5; form++) {
        kiln_gemm_t g = { .m = m, .n = n, .k = k, .c = c, .ldc = m, .c_trans = true,
                          .alpha = form == 1 || form == 4 ? 0.5f : 1.0f };
        g.a = form == 1 ? (kiln_gsrc_t) { KILN_GSRC_STRIDED, a, k, 1, NULL }
                        : (kiln_gsrc_t) { KILN_GSRC_STRIDED, at, 1, m, NULL };
        g.b = (kiln_gsrc_t) { KILN_GSRC_PACKED, bp, 0, 0, NULL };
        if (form != 2)
            g.add[g.n_add++] = (kiln_gadd_t) { bias_n, 0, 1, 1.0f };
        if (form == 1 || form >= 3)     /* a residual laid out like C */
            g.add[g.n_add++] = (kiln_gadd_t) { res, 1, m, form == 4 ? -1.5f : 1.0f };
        if (form == 2)          /* one laid out like the product: strided */
            g.add[g.n_add++] = (kiln_gadd_t) { res, n, 1, 2.0f };
        g.act = acts[form];
        g.act_a = g.act == KILN_ACT_CLIP ? -0.5f : 0.1f;
        g.act_b = 0.75f;
        for (int64_t i = 0; i < m * n; i++)
            c[i] = NAN;
        testlib_gemm (&g);
        s_expect_product (&g, a, k, b, "transposed", form);
    }
    free (a); free (b); free (at); free (bp); free (bias_n); free (res); free (c);
}

/* A product's operands for the tests of A read where it lies: A [m, k]
 * with rows lda apart, B [k, n] row-major and packed, a bias per row and
 * per column, a residual [m, n], and C. */
typedef struct {
    float *a, *b, *bp, *bias_m, *bias_n, *res, *c;
} s_opnds_t;

static s_opnds_t
s_opnds (int64_t m, int64_t n, int64_t k, int64_t lda)
{
    s_opnds_t o = { s_rand (m * lda), s_rand (k * n), NULL, s_rand (m), s_rand (n),
                    s_rand (m * n), malloc ((size_t) (m * n + 1) * sizeof (float)) };
    int64_t be;
    ck_assert (kiln_pack_b_elems (k, n, &be));
    o.bp = calloc ((size_t) be + 1, sizeof *o.bp);
    kiln_pack_b (o.b, k, n, n, 1, o.bp);
    return o;
}

static void
s_opnds_free (s_opnds_t *o)
{
    free (o->a); free (o->b); free (o->bp); free (o->bias_m); free (o->bias_n);
    free (o->res); free (o->c);
}

/* A's rows read where they lie (lda apart, more than k) against a packed
 * weight: on AVX-512 in panels of seven rows when those cover fewer rows
 * than panels of eight (49 positions: seven panels, not 56 rows), with
 * each epilogue the seven-row tile applies itself, masked last columns
 * (40, and 16 or fewer in half the multiply-adds), two k blocks, and a
 * last panel of fewer rows; against double. */
static void
s_check_rows_in_place (int64_t m, int64_t n, int64_t k)
{
    int64_t lda = k + 3;
    s_opnds_t o = s_opnds (m, n, k, lda);
    kiln_act_t acts[5] = { KILN_ACT_NONE, KILN_ACT_RELU, KILN_ACT_SILU, KILN_ACT_GELU,
                           KILN_ACT_LEAKY };
    for (int form = 0; form < 5; form++) {
        kiln_gemm_t g = { .m = m, .n = n, .k = k, .c = o.c, .ldc = n,
                          .alpha = form == 3 ? 0.5f : 1.0f, .act = acts[form],
                          .act_a = 0.1f, .act_b = 0.75f };
        g.a = (kiln_gsrc_t) { KILN_GSRC_STRIDED, o.a, lda, 1, NULL };
        g.b = (kiln_gsrc_t) { KILN_GSRC_PACKED, o.bp, 0, 0, NULL };
        if (form == 1 || form == 3)
            g.add[g.n_add++] = (kiln_gadd_t) { o.bias_n, 0, 1, 1.0f };
        if (form == 2)
            g.add[g.n_add++] = (kiln_gadd_t) { o.bias_m, 1, 0, 1.0f };
        if (form >= 2)          /* a residual, once scaled */
            g.add[g.n_add++] = (kiln_gadd_t) { o.res, n, 1, form == 4 ? 2.0f : 1.0f };
        for (int64_t i = 0; i < m * n; i++)
            o.c[i] = NAN;
        testlib_gemm (&g);
        s_expect_product (&g, o.a, lda, o.b, "rows in place", form);
    }
    s_opnds_free (&o);
}

/* The im2col operand, never built, against one built here; with `trans`
 * the transposed product (positions as rows, conv-packed-T weights). */
static void
s_check_conv_as (bool trans, int64_t c, int64_t h, int64_t w, int64_t m,
                 int64_t kh, int64_t kw, int64_t s, int64_t d, int64_t pt,
                 int64_t pl, int64_t pb, int64_t pr)
{
    int64_t oh = (h + pt + pb - d * (kh - 1) - 1) / s + 1;
    int64_t ow = (w + pl + pr - d * (kw - 1) - 1) / s + 1;
    int64_t k = c * kh * kw, n = oh * ow, pe;
    float *x = s_rand (c * h * w), *wt = s_rand (m * k), *bias = s_rand (m);
    ck_assert (trans ? kiln_pack_conv_t_elems (m, c, kh, kw, 1, &pe)
                     : kiln_pack_conv_elems (m, c, kh, kw, 1, &pe));
    float *wp = calloc ((size_t) pe + 1, sizeof *wp);
    if (trans)
        kiln_pack_conv_t (wt, m, c, kh, kw, 1, wp);
    else
        kiln_pack_conv (wt, m, c, kh, kw, 1, wp);
    float *y = malloc ((size_t) (m * n + 1) * sizeof *y);
    kiln_gconv_t geo = { .c = c, .h = h, .w = w, .oh = oh, .ow = ow, .kh = kh,
                         .kw = kw, .sh = s, .sw = s, .dh = d, .dw = d, .pt = pt,
                         .pl = pl };
    kiln_gemm_t g = { .m = m, .n = n, .k = k, .c = y, .ldc = n, .alpha = 1.0f,
                      .act = KILN_ACT_RELU };
    if (trans) {
        g.m = n;
        g.n = m;
        g.c_trans = true;
        g.a = (kiln_gsrc_t) { KILN_GSRC_CONV, x, 0, 0, &geo };
        g.b = (kiln_gsrc_t) { KILN_GSRC_PACKED, wp, 0, 0, NULL };
        g.add[g.n_add++] = (kiln_gadd_t) { bias, 0, 1, 1.0f };
    } else {
        g.a = (kiln_gsrc_t) { KILN_GSRC_PACKED, wp, 0, 0, NULL };
        g.b = (kiln_gsrc_t) { KILN_GSRC_CONV, x, 0, 0, &geo };
        g.add[g.n_add++] = (kiln_gadd_t) { bias, 1, 0, 1.0f };
    }
    for (int64_t i = 0; i < m * n; i++)
        y[i] = NAN;
    testlib_gemm (&g);
    for (int64_t o = 0; o < m; o++)
        for (int64_t r = 0; r < oh; r++)
            for (int64_t q = 0; q < ow; q++) {
                double sum = bias[o], mag = fabs (bias[o]);
                for (int64_t ci = 0; ci < c; ci++)
                    for (int64_t i = 0; i < kh; i++)
                        for (int64_t j = 0; j < kw; j++) {
                            int64_t ih = r * s - pt + i * d, iw = q * s - pl + j * d;
                            if (ih < 0 || ih >= h || iw < 0 || iw >= w)
                                continue;
                            double v = (double) wt[((o * c + ci) * kh + i) * kw + j]
                                       * x[(ci * h + ih) * w + iw];
                            sum += v;
                            mag += fabs (v);
                        }
                sum = sum < 0 ? 0 : sum;
                double got = y[(o * oh + r) * ow + q];
                ck_assert_msg (fabs (got - sum) <= 1e-5 * (mag + 4.0),
                               "conv%s c%lld %lldx%lld m%lld k%lldx%lld s%lld "
                               "d%lld: y[%lld, %lld, %lld] = %.8g, expected %.8g",
                               trans ? " (transposed)" : "",
                               (long long) c, (long long) h, (long long) w,
                               (long long) m, (long long) kh, (long long) kw,
                               (long long) s, (long long) d, (long long) o,
                               (long long) r, (long long) q, got, sum);
            }
    free (x); free (wt); free (bias); free (wp); free (y);
}

static void
s_check_conv (int64_t c, int64_t h, int64_t w, int64_t m, int64_t kh, int64_t kw,
              int64_t s, int64_t d, int64_t pt, int64_t pl, int64_t pb, int64_t pr)
{
    s_check_conv_as (false, c, h, w, m, kh, kw, s, d, pt, pl, pb, pr);
    s_check_conv_as (true, c, h, w, m, kh, kw, s, d, pt, pl, pb, pr);
}

static void
s_check_engine (void)
{
    static const int64_t shapes[][3] = {
        { 1, 1, 1 }, { 7, 33, 5 }, { 8, 32, 256 }, { 13, 70, 300 },
        { 64, 49, 600 }, { 3, 100, 0 }, { 40, 17, 257 }, { 129, 65, 33 },
        /* two blocks of rows over a weight between L1 and L2 (s_tile's
         * row panels outermost when A's rows are read in place) */
        { 300, 100, 90 },
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        s_check_shape (shapes[i][0], shapes[i][1], shapes[i][2]);
        s_check_trans (shapes[i][0], shapes[i][1], shapes[i][2]);
    }
    /* transposed, panels of 7 rows, three k blocks of partial sums */
    s_check_trans (49, 40, 1100);
    static const int64_t in_place[][3] = {
        { 49, 320, 96 }, { 49, 40, 1100 }, { 98, 16, 70 }, { 13, 64, 33 },
        { 7, 100, 5 }, { 300, 96, 64 }, { 1, 33, 17 },
    };
    for (size_t i = 0; i < sizeof in_place / sizeof in_place[0]; i++)
        s_check_rows_in_place (in_place[i][0], in_place[i][1], in_place[i][2]);
    /* c, h, w, m, kh, kw, stride, dilation, pads t l b r */
    s_check_conv (3, 11, 13, 10, 3, 3, 1, 1, 1, 1, 1, 1);
    s_check_conv (5, 9, 9, 16, 3, 3, 2, 1, 1, 1, 1, 1);
    s_check_conv (4, 10, 7, 9, 1, 1, 2, 1, 0, 0, 0, 0);
    s_check_conv (3, 16, 16, 8, 7, 7, 2, 1, 3, 3, 3, 3);
    s_check_conv (6, 12, 12, 12, 5, 5, 1, 2, 3, 1, 2, 4);
    s_check_conv (40, 5, 40, 33, 3, 3, 1, 1, 0, 2, 1, 0);
    s_check_conv (20, 14, 14, 40, 3, 3, 2, 1, 1, 1, 1, 1);     /* 7 × 7 out */
    s_check_conv (64, 14, 14, 40, 3, 3, 2, 1, 1, 1, 1, 1);     /* and 2 k blocks */
}

/* The ISA test: when the CPU has it, the micro-kernel asked for runs. */
static void
s_check_isa (const char *isa)
{
    setenv ("KILN_RT_ISA", isa, 1);
    const char *got = kiln_gemm_isa ();
    if (strcmp (got, isa) != 0 && strcmp (isa, "generic") == 0)
        ck_abort_msg ("asked for the generic micro-kernel, got %s", got);
    s_check_engine ();
}

START_TEST (test_gemm_engine_generic_kernel_matches_double)
{
    s_check_isa ("generic");
}
END_TEST

START_TEST (test_gemm_engine_avx2_kernel_matches_double)
{
    s_check_isa ("avx2");
}
END_TEST

START_TEST (test_gemm_engine_native_kernel_matches_double)
{
    s_check_isa ("avx512");
}
END_TEST

/* Strassen's one level (kiln_gemm.c) on the shapes it takes, over two
 * workers (A's sums formed by the caller, read by both), every kind of
 * epilogue it finishes with, A's rows further apart than k: against
 * double, as s_check. */
START_TEST (test_strassen_products_match_double)
{
    setenv ("KILN_RT_THREADS", "2", 1);
    static const int64_t shapes[][3] = { { 64, 512, 256 }, { 128, 1024, 512 },
                                         { 96, 768, 384 } };
    for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++) {
        int64_t m = shapes[sh][0], n = shapes[sh][1], k = shapes[sh][2], lda = k + 24;
        s_opnds_t o = s_opnds (m, n, k, lda);
        float *a = o.a, *b = o.b, *bp = o.bp, *bias_m = o.bias_m, *bias_n = o.bias_n;
        float *res = o.res, *c = o.c;
        for (int form = 0; form < 4; form++) {
            kiln_gemm_t g = { .m = m, .n = n, .k = k, .c = c, .ldc = n, .alpha = 1.0f };
            g.a = (kiln_gsrc_t) { KILN_GSRC_STRIDED, a, lda, 1, NULL };
            g.b = (kiln_gsrc_t) { KILN_GSRC_PACKED, bp, 0, 0, NULL };
            if (form == 0) {            /* an FFN's first product */
                g.add[g.n_add++] = (kiln_gadd_t) { bias_n, 0, 1, 1.0f };
                g.act = KILN_ACT_RELU;
            } else if (form == 1) {     /* a value per row, a residual, clip */
                g.add[g.n_add++] = (kiln_gadd_t) { bias_m, 1, 0, 1.0f };
                g.add[g.n_add++] = (kiln_gadd_t) { res, n, 1, 1.0f };
                g.act = KILN_ACT_CLIP;
                g.act_a = -0.5f;
                g.act_b = 0.75f;
            } else if (form == 2) {     /* alpha, a scaled bias, leaky relu */
                g.alpha = 0.5f;
                g.add[g.n_add++] = (kiln_gadd_t) { bias_n, 0, 1, 2.0f };
                g.act = KILN_ACT_LEAKY;
                g.act_a = 0.1f;
            }                           /* 3: the product alone */
            if (strcmp (kiln_gemm_isa (), "avx512") == 0)
                ck_assert_msg (kiln_gemm_strassen (&g), "%lldx%lldx%lld form %d does "
                               "not run by Strassen", (long long) m, (long long) n,
                               (long long) k, form);
            for (int64_t i = 0; i < m * n; i++)
                c[i] = NAN;
            testlib_gemm (&g);
            s_expect_product (&g, a, lda, b, "Strassen", form);
        }
        s_opnds_free (&o);
    }
    /* and not on shapes it does not take: halves of partial tiles, a
     * short k, few columns, an A packed, C transposed */
    kiln_gemm_t g = { .m = 60, .n = 512, .k = 256, .alpha = 1.0f };
    g.a = (kiln_gsrc_t) { KILN_GSRC_STRIDED, NULL, 256, 1, NULL };
    g.b = (kiln_gsrc_t) { KILN_GSRC_PACKED, NULL, 0, 0, NULL };
    ck_assert (!kiln_gemm_strassen (&g));
    g.m = 64;
    g.k = 128;
    ck_assert (!kiln_gemm_strassen (&g));
    g.k = 256;
    g.n = 256;
    ck_assert (!kiln_gemm_strassen (&g));
    g.n = 512;
    g.c_trans = true;
    ck_assert (!kiln_gemm_strassen (&g));
    g.c_trans = false;
    g.a.kind = KILN_GSRC_PACKED;
    ck_assert (!kiln_gemm_strassen (&g));
}
END_TEST

/* --- the vectorised transcendentals ------------------------------------ */

static double
s_ulp (float v)
{
    return (double) nextafterf (fabsf (v), INFINITY) - (double) fabsf (v);
}

typedef void (s_vfn) (const float *, float *, int64_t);

/* got within `ulps` ulp of want, or within `abs` absolutely. */
static void
s_check_vfn (s_vfn *fn, double (*ref) (double), const char *name, double ulps,
             double abs_tol)
{
    enum { N = 200000 };
    float *x = malloc (N * sizeof *x), *y = malloc (N * sizeof *y);
    int n = 0;
    /* uniform over [-110, 110], dense near 0, and the special values */
    for (; n < N / 2; n++)
        x[n] = (float) (((double) n / (N / 2)) * 220.0 - 110.0);
    for (int i = 0; n < N - 16; n++, i++)
        x[n] = (float) ((i % 2 ? -1 : 1) * pow (10.0, -20.0 + 22.0 * i / (N / 2.0)));
    float specials[] = { 0.0f, -0.0f, INFINITY, -INFINITY, NAN, FLT_MIN,
                         -FLT_MIN, 1e-40f, FLT_MAX, -FLT_MAX, 88.72f, -87.33f,
                         -103.9f, 0.625f, 0.84375f, 1.25f };
    for (int i = 0; i < 16; i++)
        x[n++] = specials[i];
    fn (x, y, n);
    for (int i = 0; i < n; i++) {
        double want = ref ((double) x[i]);
        if (isnan (want)) {
            ck_assert_msg (isnan (y[i]), "%s(%.9g) = %.9g, expected NaN", name,
                           (double) x[i], (double) y[i]);
            continue;
        }
        float wf = (float) want;
        if (isinf (wf)) {
            ck_assert_msg (y[i] == wf, "%s(%.9g) = %.9g, expected %g", name,
                           (double) x[i], (double) y[i], (double) wf);
            continue;
        }
        double err = fabs ((double) y[i] - want);
        ck_assert_msg (err <= ulps * s_ulp (wf) || err <= abs_tol,
                       "%s(%.9g) = %.9g, expected %.9g (%.2f ulp)", name,
                       (double) x[i], (double) y[i], want, err / s_ulp (wf));
    }
    free (x);
    free (y);
}

static double s_sigmoid_ref (double v) { return 1.0 / (1.0 + exp (-v)); }

START_TEST (test_vectorised_transcendentals_are_within_a_few_ulp)
{
    s_check_vfn (kiln_vexp, exp, "exp", 4, 0);
    s_check_vfn (kiln_vsigmoid, s_sigmoid_ref, "sigmoid", 4, 1e-30);
    s_check_vfn (kiln_vtanh, tanh, "tanh", 4, 1e-30);
    s_check_vfn (kiln_verf, erf, "erf", 4, 1e-30);
}
END_TEST

/* The fused epilogue's heavy activations (kiln_act_apply) against double,
 * on the ISA that KILN_RT_ISA picks (AVX-512's kiln_act16 or the portable
 * loops), over [-30, 30], runs of every length up to 70 (the tails), and
 * NaN, the infinities and the zeros. */
static void
s_check_heavy_acts (const char *isa)
{
    setenv ("KILN_RT_ISA", isa, 1);
    float buf[70];
    for (int act = KILN_ACT_SIGMOID; act < KILN_ACT_COUNT; act++) {
        ck_assert (kiln_act_heavy ((kiln_act_t) act));
        for (int rep = 0; rep < 3000; rep++) {
            int n = 1 + rep % 70;
            for (int i = 0; i < n; i++)
                buf[i] = (float) ((double) (testlib_randu () % 60001) / 1000.0 - 30.0);
            if (rep == 0) {
                buf[0] = NAN;
            } else if (rep == 69) {
                buf[0] = INFINITY; buf[1] = -INFINITY; buf[2] = 0.0f; buf[3] = -0.0f;
            }
            float in[70];
            memcpy (in, buf, sizeof in);
            kiln_act_apply (buf, n, (kiln_act_t) act, 0.2f, 0.5f);
            for (int i = 0; i < n; i++) {
                double want = s_act_ref (in[i], (kiln_act_t) act, 0.2f, 0.5f);
                if (in[i] != in[i]) {
                    ck_assert_msg (buf[i] != buf[i], "act %d of NaN is %g on %s", act,
                                   buf[i], isa);
                    continue;
                }
                if (isinf (in[i]) && (act == KILN_ACT_SILU || act == KILN_ACT_GELU
                                      || act == KILN_ACT_HARD_SWISH) && in[i] < 0)
                    continue;       /* -inf · 0: what the ONNX graph gives too */
                double tol = 4e-7 * (fabs (want) > 1 ? fabs (want) : 1);
                ck_assert_msg (isinf (want) ? buf[i] == want : fabs (buf[i] - want) <= tol,
                               "act %d of %.9g on %s: %.9g, want %.9g", act, in[i], isa,
                               buf[i], want);
            }
        }
    }
}

START_TEST (test_heavy_activations_match_double_native)
{
    s_check_heavy_acts ("avx512");
}
END_TEST

START_TEST (test_heavy_activations_match_double_portable)
{
    s_check_heavy_acts ("generic");
}
END_TEST

START_TEST (test_vectorised_softmax_and_layer_norm_rows_match_double)
{
    for (int n = 1; n < 300; n += 37) {
        float *x = s_rand (n), *y = malloc ((size_t) n * sizeof *y);
        for (int i = 0; i < n; i++)
            x[i] *= 30.0f;
        for (int logf_ = 0; logf_ < 2; logf_++) {
            kiln_vsoftmax_row (x, y, n, logf_);
            double mx = -INFINITY, s = 0;
            for (int i = 0; i < n; i++)
                mx = fmax (mx, x[i]);
            for (int i = 0; i < n; i++)
                s += exp ((double) x[i] - mx);
            for (int i = 0; i < n; i++) {
                double want = logf_ ? x[i] - mx - log (s) : exp (x[i] - mx) / s;
                /* the softmax's sum is in float (see below), the log
                 * form's in double */
                double tol = logf_ ? 1e-6 : 1e-6 + (n / 16 + 4 + n % 16) * 0x1p-24;
                ck_assert_msg (fabs (y[i] - want) <= tol * (fabs (want) + 1e-3),
                               "softmax n=%d log=%d [%d] = %.9g, expected %.9g",
                               n, logf_, i, (double) y[i], want);
            }
        }
        float *sc = s_rand (n), *bi = s_rand (n);
        double mean, inv;
        kiln_vlayer_norm_row (x, y, n, sc, 1, bi, 1, 1e-5, &mean, &inv);
        double m = 0, v = 0;
        for (int i = 0; i < n; i++)
            m += x[i];
        m /= n;
        for (int i = 0; i < n; i++)
            v += (x[i] - m) * (x[i] - m);
        v /= n;
        for (int i = 0; i < n; i++) {
            double want = (x[i] - m) / sqrt (v + 1e-5) * sc[i] + bi[i];
            ck_assert_msg (fabs (y[i] - want) <= 1e-5 * (fabs (want) + 1),
                           "layer norm n=%d [%d] = %.9g, expected %.9g", n, i,
                           (double) y[i], want);
        }
        free (x); free (y); free (sc); free (bi);
    }
    /* a NaN anywhere in a row makes the whole softmax row NaN */
    float x[5] = { 1, 2, NAN, 3, 4 }, y[5];
    kiln_vsoftmax_row (x, y, 5, false);
    for (int i = 0; i < 5; i++)
        ck_assert (isnan (y[i]));
}
END_TEST

/* The softmax row (on AVX-512 its own code, a shorter exponential)
 * against double: whole vectors and a tail, wide ranges that send
 * exponentials into the subnormals and to 0, -inf; a NaN spoils its row.
 * The sum of exponentials is accumulated in float, in sixteen lanes
 * reduced as a tree, then the tail: n / 16 + 4 + n % 16 roundings of at
 * most 2^-24 of the sum each, on top of the exponential's and the
 * normalisation's few ulp (on AVX-512 the exponential's polynomial is
 * fused multiply-adds, within an ulp of the portable one). */
START_TEST (test_softmax_rows_match_double_into_the_subnormals)
{
    static const int ns[] = { 16, 48, 128, 40 };
    for (size_t t = 0; t < sizeof ns / sizeof ns[0]; t++) {
        int n = ns[t], rows = 7;
        float *x = s_rand (rows * n), *y = malloc ((size_t) (rows * n) * sizeof *y);
        for (int i = 0; i < rows * n; i++)
            x[i] *= (float) (i / n + 1) * 25.0f;       /* row r: ±12.5·(r+1) */
        x[2 * n + 5] = NAN;
        x[3 * n + 1] = -INFINITY;
        for (int r = 0; r < rows; r++)
            kiln_vsoftmax_row (x + r * n, y + r * n, n, false);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * n, *yr = y + r * n;
            if (r == 2) {
                for (int i = 0; i < n; i++)
                    ck_assert (isnan (yr[i]));
                continue;
            }
            double mx = -INFINITY, s = 0;
            for (int i = 0; i < n; i++)
                mx = fmax (mx, xr[i]);
            for (int i = 0; i < n; i++)
                s += exp ((double) xr[i] - mx);
            for (int i = 0; i < n; i++) {
                double want = exp ((double) xr[i] - mx) / s;
                double tol = 1e-6 + (n / 16 + 4 + n % 16) * 0x1p-24;
                ck_assert_msg (fabs (yr[i] - want) <= tol * (fabs (want) + 1e-30),
                               "softmax n=%d row %d [%d] = %.9g, expected %.9g", n,
                               r, i, (double) yr[i], want);
            }
        }
        free (x); free (y);
    }
}
END_TEST

/* --- the compiler's optimisations against -O0 ---------------------------- */

/* Whether a convolution op runs transposed, and its kernel's height. */
static bool
s_op_transposed (const kiln_prog_op_t *op, int64_t *kh)
{
    bool trans = false;
    *kh = 0;
    for (int j = 0; j < op->n_params; j++) {
        const kiln_prog_param_t *pp = &op->params[j];
        if (strcmp (pp->name, "transposed") == 0)
            trans = pp->i == 1;
        if (strcmp (pp->name, "kernel") == 0)
            *kh = pp->ints[0];
    }
    return trans;
}

/* Conv (3x3, pads `p`) of `c` -> `m` channels on h x w, + bias, + a
 * residual of the same shape (a 1x1 conv of the input, when p is 1), Relu. */
static kiln_graph_t *
s_conv_block (int64_t c, int64_t m, int64_t h, int64_t w, int64_t p,
              int64_t stride, int64_t group)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SH (1, c, h, w));
    int w1 = s_weight (g, "w1", SH (m, c / group, 3, 3));
    int b1 = s_weight (g, "b1", SH (m));
    int w2 = s_weight (g, "w2", SH (m, c, 1, 1));
    int t0 = s_tensor (g, "t0"), t1 = s_tensor (g, "t1");
    int t2 = s_tensor (g, "t2"), y = s_tensor (g, "y");
    int n = s_node (g, "Conv", "c1", (int[]) { x, w1, b1 }, 3, t0);
    s_ints (g, n, "pads", 4, p, p, p, p);
    s_ints (g, n, "strides", 2, stride, stride);
    s_int (g, n, "group", group);
    if (p == 1) {
        n = s_node (g, "Conv", "c2", (int[]) { x, w2 }, 2, t1);
        s_ints (g, n, "strides", 2, stride, stride);
        s_node (g, "Add", "add", (int[]) { t0, t1 }, 2, t2);
        s_node (g, "Relu", "relu", &t2, 1, y);
    } else {
        s_node (g, "Relu", "relu", &t0, 1, y);
    }
    s_output (g, y);
    return g;
}

START_TEST (test_fused_packed_convolution_matches_o0)
{
    kiln_graph_t *g = s_conv_block (12, 20, 9, 11, 1, 1, 1);
    kiln_program_t *p = s_check_against_o0 (g, 2, 1e-5, "conv + bias + residual + relu");
    /* one conv with packed weights and the residual and relu fused (the
     * 1x1 conv computed first, as the residual), nothing else */
    ck_assert_int_eq (p->n_ops, 2);
    ck_assert_int_eq (s_count_ops (p, KILN_K_CONV2D), 2);
    ck_assert_int_eq (s_count_ops (p, KILN_K_ADD) + s_count_ops (p, KILN_K_RELU), 0);
    const kiln_prog_param_t *act = s_param (p, KILN_K_CONV2D, "activation");
    ck_assert (act && act->i == KILN_ACT_RELU);
    ck_assert (s_param (p, KILN_K_CONV2D, "residual"));
    ck_assert (s_param (p, KILN_K_CONV2D, "packed"));
    kiln_program_destroy (&p);
    kiln_graph_destroy (&g);

    g = s_conv_block (8, 16, 10, 10, 1, 2, 4);      /* grouped, strided */
    p = s_check_against_o0 (g, 2, 1e-5, "grouped strided conv block");
    kiln_program_destroy (&p);
    kiln_graph_destroy (&g);

    /* 7×7 outputs: the 3x3 product (k = 24 · 9 = 216 sums an output)
     * runs transposed (conv-packed-T weights, `transposed`), with the
     * residual and relu fused; the 1x1 one (k = 24) does not: too few
     * products an output to pay for the transposed store.  With 160
     * input channels both do. */
    for (int wide = 0; wide < 2; wide++) {
        g = s_conv_block (wide ? 160 : 24, 64, 14, 14, 1, 2, 1);
        p = s_check_against_o0 (g, 2, 1e-5, "conv block with 7x7 outputs");
        ck_assert_int_eq (p->n_ops, 2);
        for (int i = 0; i < p->n_ops; i++) {
            int64_t kh;
            bool trans = s_op_transposed (&p->ops[i], &kh);
            ck_assert_msg (trans == (wide || kh == 3), "op %d (%dx%d, %s): transposed %d",
                           i, (int) kh, (int) kh,
                           wide ? "160 channels in" : "24 channels in", trans);
        }
        kiln_program_destroy (&p);
        kiln_graph_destroy (&g);
    }
}
END_TEST

/* A 3x3 stride-1 block of c -> m channels on h x w, compiled at -O3 and
 * checked against -O0: its convolution runs by Winograd exactly when
 * `want`. */
static void
s_check_winograd_pick (int64_t c, int64_t m, int64_t h, int64_t w, bool want)
{
    kiln_graph_t *g = s_conv_block (c, m, h, w, 1, 1, 1);
    kiln_program_t *p = s_check_against_o0 (g, 3, 1e-5, "3x3 conv block");
    const kiln_prog_param_t *wino = s_param (p, KILN_K_CONV2D, "winograd");
    ck_assert_msg ((wino != NULL) == want, "%lld -> %lld at %lld x %lld: %s",
                   (long long) c, (long long) m, (long long) h, (long long) w,
                   wino ? "winograd" : "direct");
    kiln_program_destroy (&p);
    kiln_graph_destroy (&g);
}

START_TEST (test_winograd_skips_few_output_channels)
{
    /* DenseNet's 3x3 layers, 128 channels to 32: on one block of 16
     * tiles (14 x 14 by F(4x4), 7 x 7 by F(2x2)) the input's transform
     * outweighs what it saves, so they run direct; at 28 x 28 (49 tiles)
     * by Winograd. */
    s_check_winograd_pick (128, 32, 14, 14, false);
    s_check_winograd_pick (128, 32, 7, 7, false);
    s_check_winograd_pick (128, 32, 28, 28, true);
}
END_TEST

START_TEST (test_winograd_skips_few_input_channels)
{
    /* The input channels are the k of Winograd's point products: under
     * 32 always direct, under 64 from 56 x 56 on, under 80 from 28 x 28
     * on; F(2x2) on one block of 16 tiles (7 x 7) from 128.  Each case
     * on one side of a bound. */
    int64_t cases[][5] = { { 16, 64, 55, 55, 0 }, { 16, 16, 112, 112, 0 },
                           { 32, 32, 40, 40, 0 }, { 32, 32, 56, 56, 1 },
                           { 48, 96, 28, 28, 0 }, { 64, 64, 27, 27, 0 },
                           { 64, 64, 28, 28, 1 }, { 80, 160, 14, 14, 1 },
                           { 96, 96, 7, 7, 0 }, { 128, 64, 7, 7, 1 } };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        s_check_winograd_pick (cases[i][0], cases[i][1], cases[i][2], cases[i][3],
                               cases[i][4] == 1);
}
END_TEST

/* The Winograd tile of a 3x3 256 -> 256 convolution on 14 x 14, compiled
 * at -O3 (the "winograd" parameter), with the model's weights `big` past
 * the 64 MiB from which a run streams them from memory (a MatMul of the
 * block's flattened output by 67 MB of weights beside it) or not. */
static int64_t
s_winograd_tile_of (bool big)
{
    kiln_graph_t *g = s_conv_block (256, 256, 14, 14, 1, 1, 1);
    if (big) {
        int y = g->outputs[0];
        int wb = s_weight (g, "wbig", SH (256 * 14 * 14, 336));
        int flat = s_tensor (g, "flat"), z = s_tensor (g, "z");
        int n = s_node (g, "Flatten", "flatten", &y, 1, flat);
        s_int (g, n, "axis", 1);
        s_node (g, "MatMul", "head", (int[]) { flat, wb }, 2, z);
        s_output (g, z);
    }
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_cc_compile (g, "--optlevel 3", &err);
    ck_assert_msg (art, "%s", err.msg);
    kiln_program_t *p = testlib_program_of (art);
    const kiln_prog_param_t *wino = s_param (p, KILN_K_CONV2D, "winograd");
    ck_assert_msg (wino, "the 3x3 convolution does not run by Winograd");
    int64_t tile = wino->i;
    kiln_program_destroy (&p);
    kiln_artifact_destroy (&art);
    kiln_graph_destroy (&g);
    return tile;
}

START_TEST (test_winograd_tile_counts_streamed_weights)
{
    /* F(4x4): 16 tiles of 36 points; F(2x2): 49 tiles (64 computed) of
     * 16 points, 16/36 of the weights: the larger tile computes less, the
     * smaller streams less, which decides once the weights cannot stay
     * in the caches between runs (resnet50's third stage). */
    ck_assert_int_eq (s_winograd_tile_of (false), 4);
    ck_assert_int_eq (s_winograd_tile_of (true), 2);
}
END_TEST

/* The 3x3 product runs transposed only where the padding it saves pays
 * for gathering its rows element by element (S_TRANS_GATHER in
 * compiler/kiln_cc_lower.c), or where the runtime reads its rows in place
 * and gathers nothing (kiln_pack_conv_inplace: output rows of 7 or 8
 * positions, the input rows a tile reads within 32 KiB): from 128
 * channels at 14x14 and 7x7 to 32 or 64 (DenseNet's layers, in place);
 * from 256 at 14x14 (48 KiB of rows a tile) to 128, whose padding pays
 * for the gather, not to 32; from 128 at 13x13 (rows of 13) not to 32.
 * Each against -O0, so the in-place tiles run (with 1 thread and the
 * pool's); `kernel` tells the 3x3 op from the residual's 1x1. */
START_TEST (test_transposed_conv_pays_for_its_gather)
{
    int64_t cases[][4] = { { 128, 32, 14, 1 }, { 128, 64, 14, 1 }, { 128, 32, 7, 1 },
                           { 128, 64, 7, 1 }, { 256, 32, 14, 0 }, { 256, 128, 14, 1 },
                           { 128, 32, 13, 0 } };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_graph_t *g = s_conv_block (cases[i][0], cases[i][1], cases[i][2], cases[i][2],
                                        1, 1, 1);
        kiln_program_t *p = s_check_against_o0 (g, 2, 1e-5, "3x3 conv block");
        int seen = 0;
        for (int o = 0; o < p->n_ops; o++) {
            int64_t kh;
            bool trans = s_op_transposed (&p->ops[o], &kh);
            if (kh != 3)
                continue;
            seen++;
            ck_assert_msg (trans == (cases[i][3] == 1), "%lld -> %lld at %lld x %lld: %s",
                           (long long) cases[i][0], (long long) cases[i][1],
                           (long long) cases[i][2], (long long) cases[i][2],
                           trans ? "transposed" : "not transposed");
        }
        ck_assert_int_eq (seen, 1);
        kiln_program_destroy (&p);
        kiln_graph_destroy (&g);
    }
}
END_TEST

START_TEST (test_winograd_convolution_matches_o0)
{
    /* c, m, h, w, pad, the output tile the compiler should pick, and
     * whether the product runs transposed (Winograd-T): odd sizes (a
     * partial last tile), no padding, enough channels for two or more
     * channel blocks of the transform, F(4x4) where the tiles fill its
     * blocks better and F(2x2) where they do not; transposed, tile panels
     * of 7 (49 tiles) and of 8 (40, the last tiles partial).  (One block
     * of 16 tiles or fewer needs more than 32 output channels, and few
     * input channels need a large plane: fewer run direct,
     * test_winograd_skips_few_output_channels and _input_channels.) */
    int64_t cases[][7] = { { 80, 40, 9, 13, 1, 4, 0 }, { 80, 48, 14, 14, 1, 4, 0 },
                           { 300, 40, 7, 7, 1, 2, 0 }, { 129, 40, 12, 5, 0, 2, 0 },
                           { 2000, 16, 28, 30, 1, 4, 0 },
                           { 600, 64, 28, 28, 1, 4, 1 }, { 128, 64, 20, 31, 1, 4, 1 } };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_graph_t *g = s_conv_block (cases[i][0], cases[i][1], cases[i][2],
                                        cases[i][3], cases[i][4], 1, 1);
        kiln_program_t *p = s_check_against_o0 (g, 3, 1e-5, "winograd conv block");
        const kiln_prog_param_t *wino = s_param (p, KILN_K_CONV2D, "winograd");
        ck_assert_msg (wino, "case %zu: no winograd convolution at -O3", i);
        ck_assert_msg (wino->i == cases[i][5], "case %zu: F(%lldx%lld), expected "
                       "F(%lldx%lld)", i, (long long) wino->i, (long long) wino->i,
                       (long long) cases[i][5], (long long) cases[i][5]);
        const kiln_prog_param_t *tr = s_param (p, KILN_K_CONV2D, "transposed");
        ck_assert_msg ((tr && tr->i == 1) == (cases[i][6] == 1), "case %zu: %s",
                       i, tr ? "transposed" : "not transposed");
        kiln_program_destroy (&p);
        kiln_graph_destroy (&g);
    }
}
END_TEST

START_TEST (test_depthwise_convolution_matches_o0)
{
    /* channels, multiplier, h, w, kernel, stride, dilation, pad */
    int64_t cases[][8] = { { 8, 1, 13, 11, 3, 1, 1, 1 }, { 6, 1, 14, 14, 3, 2, 1, 1 },
                           { 4, 2, 9, 10, 5, 1, 2, 4 }, { 5, 1, 7, 7, 3, 2, 1, 0 },
                           { 3, 3, 8, 9, 3, 3, 1, 2 },
                           /* 40 planes of 9×9 (two full groups of the
                            * interleaved loops and a part), dilated */
                           { 20, 1, 9, 9, 5, 1, 2, 4 }, { 17, 2, 16, 15, 3, 2, 1, 1 } };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t c = cases[i][0], mul = cases[i][1], k = cases[i][4];
        kiln_graph_t *g = kiln_graph_new ();
        int x = s_input (g, "x", SH (2, c, cases[i][2], cases[i][3]));
        int w = s_weight (g, "w", SH (c * mul, 1, k, k));
        int b = s_weight (g, "b", SH (c * mul));
        int t = s_tensor (g, "t"), y = s_tensor (g, "y");
        int n = s_node (g, "Conv", "dw", (int[]) { x, w, b }, 3, t);
        s_int (g, n, "group", c);
        s_ints (g, n, "strides", 2, cases[i][5], cases[i][5]);
        s_ints (g, n, "dilations", 2, cases[i][6], cases[i][6]);
        s_ints (g, n, "pads", 4, cases[i][7], cases[i][7], cases[i][7], cases[i][7]);
        /* ReLU6, as MobileNet exports it (opset 11+: bounds as inputs) */
        int lo = s_const (g, "lo", SH (1), 0, 0), hi = s_const (g, "hi", SH (1), 0, 6);
        s_node (g, "Clip", "relu6", (int[]) { t, lo, hi }, 3, y);
        s_output (g, y);
        g->opset = 13;
        kiln_program_t *p = s_check_against_o0 (g, 2, 1e-5, "depthwise conv");
        ck_assert_int_eq (p->n_ops, 1);     /* the clip is fused */
        ck_assert (p->ops[0].scratch < 0);
        kiln_program_destroy (&p);
        kiln_graph_destroy (&g);
    }
}
END_TEST

START_TEST (test_batch_norm_folds_into_the_convolution)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SH (1, 6, 8, 8));
    int w = s_weight (g, "w", SH (10, 6, 3, 3));
    int sc = s_const (g, "scale", SH (10), 0.5f, 1.0f);
    int bb = s_weight (g, "bias", SH (10));
    int mean = s_weight (g, "mean", SH (10));
    int var = s_const (g, "var", SH (10), 0.4f, 0.6f);
    int t = s_tensor (g, "t"), u = s_tensor (g, "u"), y = s_tensor (g, "y");
    int n = s_node (g, "Conv", "conv", (int[]) { x, w }, 2, t);
    s_ints (g, n, "pads", 4, 1, 1, 1, 1);
    n = s_node (g, "BatchNormalization", "bn", (int[]) { t, sc, bb, mean, var }, 5, u);
    s_float (g, n, "epsilon", 1e-3);
    s_node (g, "Relu", "relu", &u, 1, y);
    s_output (g, y);
    for (int opt = 1; opt <= 3; opt++) {
        kiln_program_t *p = s_check_against_o0 (g, opt, 1e-5, "conv + batch norm");
        ck_assert_int_eq (s_count_ops (p, KILN_K_BATCH_NORM), 0);
        ck_assert_int_eq (s_count_ops (p, KILN_K_CONV2D), 1);
        ck_assert_int_eq (p->n_ops, opt == 1 ? 2 : 1);
        kiln_program_destroy (&p);
    }
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_batch_norm_folds_into_a_gemm)
{
    /* Linear + BatchNorm1d + Relu, transB as torch exports it, with and
     * without a C, with alpha and beta */
    for (int variant = 0; variant < 3; variant++) {
        kiln_graph_t *g = kiln_graph_new ();
        int x = s_input (g, "x", SH (5, 12));
        int w = s_weight (g, "w", SH (9, 12));
        int c = s_weight (g, "c", variant == 2 ? SH (1) : SH (9));
        int sc = s_const (g, "scale", SH (9), 0.5f, 1.0f);
        int bb = s_weight (g, "bias", SH (9));
        int mean = s_weight (g, "mean", SH (9));
        int var = s_const (g, "var", SH (9), 0.4f, 0.6f);
        int t = s_tensor (g, "t"), u = s_tensor (g, "u"), y = s_tensor (g, "y");
        int n = s_node (g, "Gemm", "fc", (int[]) { x, w, c }, variant == 1 ? 2 : 3, t);
        s_int (g, n, "transB", 1);
        if (variant == 2) {
            s_float (g, n, "alpha", 0.5);
            s_float (g, n, "beta", 2.0);
        }
        s_node (g, "BatchNormalization", "bn", (int[]) { t, sc, bb, mean, var }, 5, u);
        s_node (g, "Relu", "relu", &u, 1, y);
        s_output (g, y);
        for (int opt = 1; opt <= 2; opt++) {
            kiln_program_t *p = s_check_against_o0 (g, opt, 1e-5, "gemm + batch norm");
            ck_assert_int_eq (s_count_ops (p, KILN_K_BATCH_NORM), 0);
            ck_assert_int_eq (p->n_ops, opt == 1 ? 2 : 1);
            kiln_program_destroy (&p);
        }
        kiln_graph_destroy (&g);
    }
}
END_TEST

START_TEST (test_decomposed_layer_norm_and_linear_fuse)
{
    /* y = LayerNorm(x) as torch exports it before opset 17, then
     * Relu(x @ W + b) + x: a transformer's feed-forward shape */
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SH (1, 12, 40));
    int two = s_const (g, "two", SH (1), 0, 2);
    int eps = s_const (g, "eps", SH (1), 0, 1e-5f);
    int gamma = s_const (g, "gamma", SH (40), 0.5f, 1.0f);
    int beta = s_weight (g, "beta", SH (40));
    int wm = s_weight (g, "wm", SH (40, 40));
    int bm = s_weight (g, "bm", SH (40));
    int t[12];
    testlib_tensors (g, t, 12);
    int n = s_node (g, "ReduceMean", "m1", &x, 1, t[0]);
    s_ints (g, n, "axes", 1, -1);
    s_node (g, "Sub", "sub", (int[]) { x, t[0] }, 2, t[1]);
    s_node (g, "Pow", "pow", (int[]) { t[1], two }, 2, t[2]);
    n = s_node (g, "ReduceMean", "m2", &t[2], 1, t[3]);
    s_ints (g, n, "axes", 1, -1);
    s_node (g, "Add", "addeps", (int[]) { t[3], eps }, 2, t[4]);
    s_node (g, "Sqrt", "sqrt", &t[4], 1, t[5]);
    s_node (g, "Div", "div", (int[]) { t[1], t[5] }, 2, t[6]);
    s_node (g, "Mul", "mul", (int[]) { t[6], gamma }, 2, t[7]);
    s_node (g, "Add", "addb", (int[]) { t[7], beta }, 2, t[8]);
    s_node (g, "MatMul", "mm", (int[]) { t[8], wm }, 2, t[9]);
    s_node (g, "Add", "bias", (int[]) { bm, t[9] }, 2, t[10]);
    s_node (g, "Relu", "relu", &t[10], 1, t[11]);
    int y = s_tensor (g, "y");
    s_node (g, "Add", "res", (int[]) { t[11], x }, 2, y);
    s_output (g, y);
    kiln_program_t *p = s_check_against_o0 (g, 2, 1e-5, "layer norm + linear");
    /* a layer_norm, and a matmul with bias and relu; the residual comes
     * after the relu, so it stays an add */
    ck_assert_int_eq (s_count_ops (p, KILN_K_LAYER_NORM), 1);
    ck_assert_int_eq (s_count_ops (p, KILN_K_MATMUL), 1);
    ck_assert_int_eq (p->n_ops, 3);
    ck_assert (s_param (p, KILN_K_MATMUL, "packed_b"));
    kiln_program_destroy (&p);
    kiln_graph_destroy (&g);
}
END_TEST

/* Attention's shape without the slices: x [6, 2, 4] split into heads
 * for Q (scaled by 1/2), K (transposed) and V, the heads merged after
 * P·V.  Caller destroys the graph. */
static kiln_graph_t *
s_attention_graph (void)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SH (6, 2, 4));
    int two = s_const (g, "two", SH (1), 0, 2);
    int t[7];
    testlib_tensors (g, t, 7);
    int n = s_node (g, "Transpose", "q", &x, 1, t[0]);
    s_ints (g, n, "perm", 3, 1, 0, 2);
    s_node (g, "Div", "scale", (int[]) { t[0], two }, 2, t[1]);
    n = s_node (g, "Transpose", "k", &x, 1, t[2]);
    s_ints (g, n, "perm", 3, 1, 2, 0);
    n = s_node (g, "Transpose", "v", &x, 1, t[3]);
    s_ints (g, n, "perm", 3, 1, 0, 2);
    s_node (g, "MatMul", "qk", (int[]) { t[1], t[2] }, 2, t[4]);
    s_node (g, "MatMul", "pv", (int[]) { t[4], t[3] }, 2, t[5]);
    int y = s_tensor (g, "y");
    n = s_node (g, "Transpose", "merge", &t[5], 1, y);
    s_ints (g, n, "perm", 3, 1, 0, 2);
    s_output (g, y);
    return g;
}

START_TEST (test_attention_products_read_their_heads_through_strides)
{
    kiln_graph_t *g = s_attention_graph ();
    kiln_program_t *p = s_check_against_o0 (g, 2, 1e-5, "attention");
    /* Q's split and scale, V's split and the merge are the products'
     * strides and alpha; K's transpose (its last axis not contiguous)
     * stays a copy */
    ck_assert_int_eq (s_count_ops (p, KILN_K_MATMUL), 2);
    ck_assert_int_eq (s_count_ops (p, KILN_K_STRIDED), 1);
    ck_assert_int_eq (p->n_ops, 3);
    ck_assert (s_param (p, KILN_K_MATMUL, "a_strides"));
    ck_assert (s_param (p, KILN_K_MATMUL, "b_strides"));
    ck_assert (s_param (p, KILN_K_MATMUL, "y_strides"));
    const kiln_prog_param_t *alpha = s_param (p, KILN_K_MATMUL, "alpha");
    ck_assert (alpha);
    kiln_program_destroy (&p);
    kiln_graph_destroy (&g);
}
END_TEST

/* The same heads with the Softmax between the products, as attention
 * has it: the scores scaled after their product (Div by 2), a [6, 6]
 * mask added when `mask`; when `twice`, the probabilities multiply V
 * in two products, added.  Caller destroys the graph. */
static kiln_graph_t *
s_attention_softmax_graph (bool mask, bool twice)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SH (6, 2, 4));
    int two = s_const (g, "two", SH (1), 0, 2);
    int mk = s_weight (g, "mask", SH (6, 6));
    int t[10];
    testlib_tensors (g, t, 10);
    int n = s_node (g, "Transpose", "q", &x, 1, t[0]);
    s_ints (g, n, "perm", 3, 1, 0, 2);
    n = s_node (g, "Transpose", "k", &x, 1, t[1]);
    s_ints (g, n, "perm", 3, 1, 2, 0);
    n = s_node (g, "Transpose", "v", &x, 1, t[2]);
    s_ints (g, n, "perm", 3, 1, 0, 2);
    s_node (g, "MatMul", "qk", (int[]) { t[0], t[1] }, 2, t[3]);
    s_node (g, "Div", "scale", (int[]) { t[3], two }, 2, t[4]);
    int scores = t[4];
    if (mask) {
        s_node (g, "Add", "mask", (int[]) { mk, t[4] }, 2, t[5]);
        scores = t[5];
    }
    n = s_node (g, "Softmax", "softmax", &scores, 1, t[6]);
    s_int (g, n, "axis", -1);
    s_node (g, "MatMul", "pv", (int[]) { t[6], t[2] }, 2, t[7]);
    int heads = t[7];
    if (twice) {
        s_node (g, "MatMul", "pv2", (int[]) { t[6], t[2] }, 2, t[8]);
        s_node (g, "Add", "both", (int[]) { t[7], t[8] }, 2, t[9]);
        heads = t[9];
    }
    int y = s_tensor (g, "y");
    n = s_node (g, "Transpose", "merge", &heads, 1, y);
    s_ints (g, n, "perm", 3, 1, 0, 2);
    s_output (g, y);
    return g;
}

START_TEST (test_attention_is_one_op)
{
    /* both products, the scale, the mask and the softmax: one attention
     * op reading Q, K (its transpose too) and V through strides and
     * writing the merged heads; without the mask the same; the
     * probabilities read by two products: no attention op */
    for (int c = 0; c < 3; c++) {
        kiln_graph_t *g = s_attention_softmax_graph (c != 1, c == 2);
        kiln_program_t *p = s_check_against_o0 (g, 2, 1e-5, "attention + softmax");
        ck_assert_int_eq (s_count_ops (p, KILN_K_ATTENTION), c == 2 ? 0 : 1);
        ck_assert_int_eq (s_count_ops (p, KILN_K_SOFTMAX), c == 2 ? 1 : 0);
        if (c != 2) {
            ck_assert_int_eq (p->n_ops, 1);
            ck_assert (s_param (p, KILN_K_ATTENTION, "kt_strides"));
            ck_assert (s_param (p, KILN_K_ATTENTION, "y_strides"));
            ck_assert (s_param (p, KILN_K_ATTENTION, "alpha"));
            ck_assert ((s_param (p, KILN_K_ATTENTION, "mask_strides") != NULL) == (c == 0));
        }
        kiln_program_destroy (&p);
        kiln_graph_destroy (&g);
    }
}
END_TEST

START_TEST (test_dead_nodes_are_dropped)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = s_input (g, "x", SH (4, 8));
    int a = s_tensor (g, "a"), b = s_tensor (g, "b"), y = s_tensor (g, "y");
    s_node (g, "Relu", "used", &x, 1, y);
    s_node (g, "Exp", "dead1", &x, 1, a);
    s_node (g, "Sigmoid", "dead2", &a, 1, b);
    s_output (g, y);
    kiln_program_t *p = s_check_against_o0 (g, 1, 0, "dead nodes");
    ck_assert_int_eq (p->n_ops, 1);
    kiln_program_destroy (&p);
    kiln_graph_destroy (&g);
}
END_TEST

/* --- the intra-op pool --------------------------------------------------- */

typedef struct {
    int *hits;
    int *worker_of;
} s_pool_t;

static void
s_mark (void *arg, int task, int worker)
{
    s_pool_t *pt = arg;
    __atomic_fetch_add (&pt->hits[task], 1, __ATOMIC_RELAXED);
    pt->worker_of[task] = worker;
}

START_TEST (test_intra_op_threads_run_every_task_once_and_agree)
{
    setenv ("KILN_RT_THREADS", "3", 1);
    int threads = kiln_exec_threads ();
    ck_assert_int_ge (threads, 1);
    enum { N = 5000 };
    s_pool_t pt = { calloc (N, sizeof (int)), calloc (N, sizeof (int)) };
    for (int round = 0; round < 20; round++) {
        memset (pt.hits, 0, N * sizeof (int));
        kiln_exec_parallel (s_mark, &pt, N);
        for (int i = 0; i < N; i++) {
            ck_assert_int_eq (pt.hits[i], 1);
            ck_assert (pt.worker_of[i] >= 0 && pt.worker_of[i] < threads);
        }
    }
    free (pt.hits);
    free (pt.worker_of);
    /* a model over threads agrees with -O0 on one */
    kiln_graph_t *g = s_conv_block (24, 40, 20, 20, 1, 1, 1);
    for (int opt = 2; opt <= 3; opt++) {
        kiln_program_t *p = s_check_against_o0 (g, opt, 1e-5, "threads");
        kiln_program_destroy (&p);
    }
    kiln_graph_destroy (&g);
}
END_TEST

/* --- refusals -------------------------------------------------------------- */

/* Rebuild `src` with `prog` as its program, signed with the test key, and
 * write it; returns the path (static storage). */
static char *
s_resign (kiln_artifact_t *src, const uint8_t *prog, size_t len)
{
    static char path[PATH_MAX];
    snprintf (path, sizeof path, "%s/resigned-%d.kar", s_dir, s_files++);
    testlib_resign (src, prog, len, s_key, path);
    return path;
}

/* Encode the edited program `*p_p` (consumed) into `art`, re-signed, and
 * check that loading it is refused with an error that names `want`. */
static void
s_expect_refused (kiln_artifact_t *art, kiln_program_t **p_p, int c, const char *want)
{
    kiln_err_t err = { 0 };
    uint8_t *bytes;
    size_t len;
    ck_assert (kiln_program_encode (*p_p, &bytes, &len, &err) == 0);
    kiln_program_destroy (p_p);
    char *path = s_resign (art, bytes, len);
    free (bytes);
    kiln_model_t *m = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_msg (m == NULL, "case %d (%s) was accepted", c, want);
    ck_assert_msg (strstr (err.msg, want), "case %d: '%s' lacks '%s'", c, err.msg, want);
}

START_TEST (test_malformed_packed_programs_are_refused)
{
    kiln_graph_t *g = s_conv_block (8, 16, 8, 8, 1, 1, 1);
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_cc_compile (g, "--optlevel 2", &err);
    ck_assert_msg (art, "%s", err.msg);
    size_t plen, wlen;
    const uint8_t *prog = kiln_artifact_member (art, KILN_PROGRAM_MEMBER, &plen);
    kiln_artifact_member (art, KILN_WEIGHTS_MEMBER, &wlen);
    /* then an unknown weight layout, and the transposed layout declared
     * for weights of the other one (a different size); last, an unknown
     * prologue and a prologue on the 3x3 convolution (its bias, the
     * operand after W, read as the prologue's) */
    const char *want[] = { "unknown activation", "residual", "packed W", "winograd",
                           "packed must be 0 or 1", "packed W", "prologue must be",
                           "a prologue only on a packed, ungrouped pointwise" };
    for (int c = 0; c < 8; c++) {
        kiln_program_t *p = kiln_program_decode (prog, plen, wlen, &err);
        ck_assert_msg (p, "%s", err.msg);
        int op = -1;            /* the conv the residual and relu went into */
        for (int i = 0; i < p->n_ops; i++)
            for (int j = 0; j < p->ops[i].n_params; j++)
                if (strcmp (p->ops[i].params[j].name, "residual") == 0)
                    op = i;
        ck_assert_int_ge (op, 0);
        kiln_prog_op_t *o = &p->ops[op];
        if (c == 0)
            ck_assert (kiln_prog_op_set_int (o, "activation", KILN_ACT_COUNT, &err) == 0);
        else if (c == 1)
            ck_assert (kiln_prog_op_set_int (o, "residual", 3, &err) == 0);
        else if (c == 2) {
            kiln_prog_tensor_t *t = &p->tensors[o->inputs[1]];
            t->shape.dims[0] -= KILN_PACK_MR;
            t->size -= KILN_PACK_MR * 4;
        } else if (c == 3) {
            ck_assert (kiln_prog_op_set_int (o, "winograd", 1, &err) == 0);
        } else if (c >= 6) {
            for (int i = 0; c == 7 && i < p->n_ops; i++)
                if (p->ops[i].kernel == KILN_K_CONV2D && i != op)
                    o = &p->ops[i];
            ck_assert (c == 6 || o != &p->ops[op]);
            ck_assert (kiln_prog_op_set_int (o, "prologue", c == 6 ? 3 : 2, &err) == 0);
        } else {
            ck_assert (kiln_prog_op_set_int (o, c == 4 ? "packed" : "transposed",
                                             c == 4 ? 3 : 1, &err) == 0);
        }
        s_expect_refused (art, &p, c, want[c]);
    }
    kiln_artifact_destroy (&art);
    kiln_graph_destroy (&g);
}
END_TEST

/* A matmul whose strides or offset reach past its operand is refused
 * when the model loads. */
START_TEST (test_matmul_strides_outside_the_operand_are_refused)
{
    kiln_graph_t *g = s_attention_graph ();
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_cc_compile (g, "--optlevel 2", &err);
    ck_assert_msg (art, "%s", err.msg);
    size_t plen, wlen;
    const uint8_t *prog = kiln_artifact_member (art, KILN_PROGRAM_MEMBER, &plen);
    kiln_artifact_member (art, KILN_WEIGHTS_MEMBER, &wlen);
    const char *want[] = { "a_offset", "a_strides reach", "y_strides reach",
                           "a_offset without a_strides" };
    for (int c = 0; c < 4; c++) {
        kiln_program_t *p = kiln_program_decode (prog, plen, wlen, &err);
        ck_assert_msg (p, "%s", err.msg);
        int op = -1;            /* the product reading Q through strides */
        for (int i = 0; i < p->n_ops; i++)
            for (int j = 0; j < p->ops[i].n_params; j++)
                if (strcmp (p->ops[i].params[j].name, "a_strides") == 0)
                    op = i;
        ck_assert_int_ge (op, 0);
        kiln_prog_op_t *o = &p->ops[op];
        if (c == 0) {
            ck_assert (kiln_prog_op_set_int (o, "a_offset", 48, &err) == 0);
        } else if (c == 1) {
            /* heads 4 apart, rows 8, columns 1: [0, 4] + 5·8 + 3 in 48 */
            ck_assert (kiln_prog_op_set_ints (o, "a_strides", (int64_t[]) { 4, 9, 1 },
                                              3, &err) == 0);
        } else if (c == 2) {
            ck_assert (kiln_prog_op_set_ints (o, "y_strides", (int64_t[]) { 36, 7, 1 },
                                              3, &err) == 0);
        } else {
            /* the first product without strides for A, but an offset */
            int first = -1;
            for (int i = 0; i < p->n_ops && first < 0; i++)
                if (p->ops[i].kernel == KILN_K_MATMUL && i != op)
                    first = i;
            ck_assert_int_ge (first, 0);
            o = &p->ops[first];
            for (int j = 0; j < o->n_params; j++)
                ck_assert (strcmp (o->params[j].name, "a_strides") != 0);
            ck_assert (kiln_prog_op_set_int (o, "a_offset", 1, &err) == 0);
        }
        s_expect_refused (art, &p, c, want[c]);
    }
    kiln_artifact_destroy (&art);
    kiln_graph_destroy (&g);
}
END_TEST

/* An attention op whose strides reach past an operand or whose output
 * rows overlap is refused when the model loads. */
START_TEST (test_attention_strides_outside_the_operand_are_refused)
{
    kiln_graph_t *g = s_attention_softmax_graph (true, false);
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_cc_compile (g, "--optlevel 2", &err);
    ck_assert_msg (art, "%s", err.msg);
    size_t plen, wlen;
    const uint8_t *prog = kiln_artifact_member (art, KILN_PROGRAM_MEMBER, &plen);
    kiln_artifact_member (art, KILN_WEIGHTS_MEMBER, &wlen);
    const char *want[] = { "kt_strides reach", "mask_strides reach", "y_strides: rows",
                           "q_strides reach", "v_offset", "nv must be" };
    for (int c = 0; c < 6; c++) {
        kiln_program_t *p = kiln_program_decode (prog, plen, wlen, &err);
        ck_assert_msg (p, "%s", err.msg);
        int op = -1;
        for (int i = 0; i < p->n_ops; i++)
            if (p->ops[i].kernel == KILN_K_ATTENTION)
                op = i;
        ck_assert_int_ge (op, 0);
        kiln_prog_op_t *o = &p->ops[op];
        if (c == 0)         /* keys 9 apart: [1] 4 + 5·9 + 3 in 48 */
            ck_assert (kiln_prog_op_set_ints (o, "kt_strides", (int64_t[]) { 4, 1, 9 },
                                              3, &err) == 0);
        else if (c == 1)    /* a mask of 36 read in rows 7 apart: 5·7 + 5 */
            ck_assert (kiln_prog_op_set_ints (o, "mask_strides", (int64_t[]) { 0, 7, 1 },
                                              3, &err) == 0);
        else if (c == 2)    /* rows of 4 floats 3 apart */
            ck_assert (kiln_prog_op_set_ints (o, "y_strides", (int64_t[]) { 4, 3, 1 },
                                              3, &err) == 0);
        else if (c == 3)    /* heads 100 apart */
            ck_assert (kiln_prog_op_set_ints (o, "q_strides", (int64_t[]) { 100, 8, 1 },
                                              3, &err) == 0);
        else if (c == 4)
            ck_assert (kiln_prog_op_set_int (o, "v_offset", 48, &err) == 0);
        else
            ck_assert (kiln_prog_op_set_int (o, "nv", -1, &err) == 0);
        s_expect_refused (art, &p, c, want[c]);
    }
    kiln_artifact_destroy (&art);
    kiln_graph_destroy (&g);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("engine");
    TCase *tc = tcase_create ("engine");
    tcase_add_checked_fixture (tc, setup, teardown);
    tcase_set_timeout (tc, 120);
    tcase_add_test (tc, test_gemm_engine_generic_kernel_matches_double);
    tcase_add_test (tc, test_gemm_engine_avx2_kernel_matches_double);
    tcase_add_test (tc, test_gemm_engine_native_kernel_matches_double);
    tcase_add_test (tc, test_strassen_products_match_double);
    tcase_add_test (tc, test_vectorised_transcendentals_are_within_a_few_ulp);
    tcase_add_test (tc, test_vectorised_softmax_and_layer_norm_rows_match_double);
    tcase_add_test (tc, test_heavy_activations_match_double_native);
    tcase_add_test (tc, test_heavy_activations_match_double_portable);
    tcase_add_test (tc, test_softmax_rows_match_double_into_the_subnormals);
    tcase_add_test (tc, test_fused_packed_convolution_matches_o0);
    tcase_add_test (tc, test_attention_is_one_op);
    tcase_add_test (tc, test_attention_strides_outside_the_operand_are_refused);
    tcase_add_test (tc, test_winograd_convolution_matches_o0);
    tcase_add_test (tc, test_winograd_skips_few_output_channels);
    tcase_add_test (tc, test_winograd_skips_few_input_channels);
    tcase_add_test (tc, test_winograd_tile_counts_streamed_weights);
    tcase_add_test (tc, test_transposed_conv_pays_for_its_gather);
    tcase_add_test (tc, test_depthwise_convolution_matches_o0);
    tcase_add_test (tc, test_batch_norm_folds_into_the_convolution);
    tcase_add_test (tc, test_batch_norm_folds_into_a_gemm);
    tcase_add_test (tc, test_decomposed_layer_norm_and_linear_fuse);
    tcase_add_test (tc, test_dead_nodes_are_dropped);
    tcase_add_test (tc, test_attention_products_read_their_heads_through_strides);
    tcase_add_test (tc, test_matmul_strides_outside_the_operand_are_refused);
    tcase_add_test (tc, test_intra_op_threads_run_every_task_once_and_agree);
    tcase_add_test (tc, test_malformed_packed_programs_are_refused);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run (s_suite ());
}
