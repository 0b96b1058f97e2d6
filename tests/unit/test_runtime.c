/*
 * Unit tests for runtime/ (with the builtin compiler in front of it):
 * graphs built in C are compiled, signed with a fresh key, loaded with
 * kiln_rt_load and run on random inputs, and every result is compared
 * with a straightforward reference computed here in double precision
 * (a direct 7-loop convolution, a naive matrix product, ...).  Also: the
 * refusals (wrong input shape or dtype, a tampered or unsigned artifact,
 * malformed programs under a valid signature), a mutation fuzz of the
 * program that must never crash the loader or the kernels, and the
 * weights mapped from the artifact file and shared by replicas.
 *
 * Every test gets a fresh temporary directory holding a key pair in
 * DIR/keys (which is also the keyring) and removes it afterwards.
 */
#include <check.h>

#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>


#include "artifact/kiln_artifact.h"
#include "common/kiln_fs.h"
#include "common/kiln_mem.h"
#include "common/kiln_program.h"
#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"
#include "runtime/kiln_artcache.h"
#include "runtime/kiln_rt.h"
#include "tests/unit/testlib.h"

#define RTOL 1e-5

static char *s_dir;             /* per-test temporary directory */
static char s_keys[PATH_MAX];   /* s_dir/keys: key pair and keyring */
static kiln_key_t *s_key;
static kiln_rt_t *s_rt;
static int s_files;             /* artifacts written by this test */

static void
setup (void)
{
    kiln_err_t err;
    s_dir = testlib_keydir ("kiln-test-runtime-", s_keys, &s_key);
    /* the suite's runtime maps artifacts (the mapping tests' subject);
     * KILN_RT_MMAP's default reads artifacts this small into memory */
    setenv ("KILN_RT_MMAP", "1", 1);
    s_rt = kiln_rt_new (&err);
    unsetenv ("KILN_RT_MMAP");
    ck_assert_msg (s_rt, "%s", err.msg);
    testlib_seed (12345);
    s_files = 0;
}

static void
teardown (void)
{
    kiln_rt_destroy (&s_rt);
    kiln_key_destroy (&s_key);
    testlib_rmdir (&s_dir);
}

/* --- helpers: numbers, shapes, graphs -------------------------------- */

/* An int64 constant (a Reshape's shape). */
static int
s_weight_i64 (kiln_graph_t *g, const char *name, const int64_t *v, int n)
{
    kiln_err_t err;
    kiln_shape_t shape = { .rank = 1, .dims = { n } };
    int t = kiln_graph_add_tensor (g, name, KILN_DT_INT64, &shape, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    uint8_t *data = malloc ((size_t) n * 8 + 1);
    memcpy (data, v, (size_t) n * 8);
    ck_assert_msg (kiln_graph_set_weight (g, t, &data, (uint64_t) n * 8, &err) == 0,
                   "%s", err.msg);
    return t;
}

/* The data of a constant. */
static const float *
s_wdata (const kiln_graph_t *g, int t)
{
    return (const float *) g->weights[g->tensors[t].weight].data;
}

static char *
s_path (const char *fmt, ...)
{
    static char buf[4][PATH_MAX];
    static int next;
    char name[128];
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (name, sizeof name, fmt, ap);
    va_end (ap);
    char *p = buf[next++ % 4];
    snprintf (p, PATH_MAX, "%s/%s", s_dir, name);
    return p;
}

/* Compile `g` with `args`, sign, write, and load it. */
static kiln_model_t *
s_build (kiln_graph_t *g, const char *args, kiln_cc_stats_t *stats)
{
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_cc_compile_ex (g, args, stats, &err);
    ck_assert_msg (art, "compile: %s", err.msg);
    char *path = s_path ("model-%d.kar", s_files++);
    testlib_sign_write (&art, s_key, path);
    kiln_model_t *m = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_msg (m, "load: %s", err.msg);
    return m;
}

/* Run a model with one input and one output; returns the output (caller
 * frees) and checks its shape against `want`. */
static float *
s_run1 (kiln_model_t *m, const float *x, kiln_shape_t want)
{
    const kiln_manifest_t *man = kiln_model_manifest (m);
    ck_assert_int_eq (man->n_inputs, 1);
    ck_assert_int_eq (man->n_outputs, 1);
    ck_assert_msg (kiln_shape_equal (&man->outputs[0].shape, &want),
                   "output shape differs from the reference's");
    kiln_rt_tensor_t in = { KILN_DT_FLOAT32, man->inputs[0].shape, (void *) x };
    float *y = malloc ((size_t) (testlib_numel (&want) ? testlib_numel (&want) : 1) * 4);
    kiln_rt_tensor_t out = { .data = y };
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_model_run (m, &in, 1, &out, 1, &err) == 0, "%s", err.msg);
    ck_assert (out.dtype == KILN_DT_FLOAT32);
    ck_assert (kiln_shape_equal (&out.shape, &want));
    return y;
}

static void
s_assert_close (const float *got, const double *want, int64_t n, const char *what)
{
    for (int64_t i = 0; i < n; i++) {
        double d = fabs ((double) got[i] - want[i]);
        ck_assert_msg (d <= RTOL * (1.0 + fabs (want[i])),
                       "%s: element %lld is %.8g, expected %.8g", what,
                       (long long) i, (double) got[i], want[i]);
    }
}

/* --- reference implementations ------------------------------------- */

typedef struct {
    int64_t n, c, h, w, m, kh, kw, sh, sw, dh, dw, pt, pl, pb, pr, group;
    bool bias;
    const char *auto_pad;       /* NULL: explicit pads */
} conv_case_t;

static int64_t
s_out (int64_t in, int64_t pb, int64_t pe, int64_t k, int64_t s, int64_t d,
       bool ceil_mode)
{
    int64_t span = in + pb + pe - ((k - 1) * d + 1);
    int64_t o = (ceil_mode ? span + s - 1 : span) / s + 1;
    if (ceil_mode && (o - 1) * s >= in + pb)
        o--;
    return o;
}

/* Direct convolution: for every output element, the sum over the input
 * channels of its group and the kernel window. */
static void
ref_conv (const conv_case_t *c, const float *x, const float *w, const float *b,
          int64_t oh, int64_t ow, double *y)
{
    int64_t cg = c->c / c->group, mg = c->m / c->group;
    for (int64_t n = 0; n < c->n; n++)
        for (int64_t m = 0; m < c->m; m++)
            for (int64_t r = 0; r < oh; r++)
                for (int64_t q = 0; q < ow; q++) {
                    double acc = c->bias ? b[m] : 0.0;
                    int64_t g = m / mg;
                    for (int64_t ci = 0; ci < cg; ci++)
                        for (int64_t i = 0; i < c->kh; i++)
                            for (int64_t j = 0; j < c->kw; j++) {
                                int64_t ih = r * c->sh - c->pt + i * c->dh;
                                int64_t iw = q * c->sw - c->pl + j * c->dw;
                                if (ih < 0 || ih >= c->h || iw < 0 || iw >= c->w)
                                    continue;
                                acc += (double) x[((n * c->c + g * cg + ci) * c->h + ih) * c->w + iw]
                                       * w[((m * cg + ci) * c->kh + i) * c->kw + j];
                            }
                    y[((n * c->m + m) * oh + r) * ow + q] = acc;
                }
}

/* numpy broadcasting: index of output element `i` (in shape `out`) in an
 * operand of shape `s`. */
static int64_t
s_bidx (const kiln_shape_t *out, const kiln_shape_t *s, int64_t i)
{
    int64_t idx = 0, stride = 1;
    for (int d = out->rank - 1, e = s->rank - 1; d >= 0; d--, e--) {
        int64_t coord = i % out->dims[d];
        i /= out->dims[d];
        if (e >= 0) {
            if (s->dims[e] != 1)
                idx += coord * stride;
            stride *= s->dims[e];
        }
    }
    return idx;
}

/* --- convolution ---------------------------------------------------- */

static void
s_check_conv (const conv_case_t *c, bool one_d)
{
    kiln_graph_t *g = kiln_graph_new ();
    kiln_shape_t xs = one_d ? SH (c->n, c->c, c->w) : SH (c->n, c->c, c->h, c->w);
    kiln_shape_t ws = one_d ? SH (c->m, c->c / c->group, c->kw)
                            : SH (c->m, c->c / c->group, c->kh, c->kw);
    int x = testlib_input (g, "x", xs);
    int w = testlib_weight (g, "w", ws);
    int b = c->bias ? testlib_weight (g, "b", SH (c->m)) : -1;
    int y = testlib_tensor (g, "y");
    int ins[3] = { x, w, b };
    int n = testlib_node (g, "Conv", "conv", ins, c->bias ? 3 : 2, y);
    testlib_output (g, y);
    conv_case_t cc = *c;
    if (c->auto_pad) {
        kiln_err_t err;
        ck_assert (kiln_node_set_string (g, n, "auto_pad", c->auto_pad, &err) == 0);
        /* SAME_UPPER: the extra padding goes at the end. */
        int64_t ins_[2] = { c->h, c->w }, k[2] = { c->kh, c->kw },
                s[2] = { c->sh, c->sw }, d[2] = { c->dh, c->dw }, pb[2], pe[2];
        for (int i = 0; i < 2; i++) {
            int64_t o = (ins_[i] + s[i] - 1) / s[i];
            int64_t tot = (o - 1) * s[i] + (k[i] - 1) * d[i] + 1 - ins_[i];
            if (tot < 0)
                tot = 0;
            pb[i] = tot / 2;
            pe[i] = tot - pb[i];
        }
        cc.pt = pb[0]; cc.pl = pb[1]; cc.pb = pe[0]; cc.pr = pe[1];
    } else if (one_d) {
        testlib_ints (g, n, "pads", 2, c->pl, c->pr);
    } else {
        testlib_ints (g, n, "pads", 4, c->pt, c->pl, c->pb, c->pr);
    }
    if (one_d) {
        testlib_ints (g, n, "strides", 1, c->sw);
        testlib_ints (g, n, "dilations", 1, c->dw);
        testlib_ints (g, n, "kernel_shape", 1, c->kw);
    } else {
        testlib_ints (g, n, "strides", 2, c->sh, c->sw);
        testlib_ints (g, n, "dilations", 2, c->dh, c->dw);
        testlib_ints (g, n, "kernel_shape", 2, c->kh, c->kw);
    }
    if (c->group != 1)
        testlib_int (g, n, "group", c->group);

    int64_t oh = s_out (cc.h, cc.pt, cc.pb, cc.kh, cc.sh, cc.dh, false);
    int64_t ow = s_out (cc.w, cc.pl, cc.pr, cc.kw, cc.sw, cc.dw, false);
    kiln_shape_t ys = one_d ? SH (c->n, c->m, ow) : SH (c->n, c->m, oh, ow);
    float *xv = testlib_rand (testlib_numel (&xs));
    double *ref = malloc ((size_t) testlib_numel (&ys) * sizeof *ref);
    ref_conv (&cc, xv, s_wdata (g, w), c->bias ? s_wdata (g, b) : NULL, oh, ow, ref);

    kiln_model_t *m = s_build (g, NULL, NULL);
    float *got = s_run1 (m, xv, ys);
    s_assert_close (got, ref, testlib_numel (&ys), "conv");
    free (got);
    free (ref);
    free (xv);
    kiln_model_destroy (&m);
    kiln_graph_destroy (&g);
}

START_TEST (test_conv2d_matches_direct_convolution)
{
    static const conv_case_t cases[] = {
        /* n c  h  w  m kh kw sh sw dh dw pt pl pb pr grp bias */
        { 1, 3, 8, 8, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, true, NULL },   /* same pad */
        { 2, 4, 9, 8, 6, 3, 3, 2, 1, 1, 2, 1, 2, 0, 1, 2, true, NULL },   /* all knobs */
        { 1, 6, 7, 7, 6, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 6, false, NULL },  /* depthwise */
        { 2, 8, 5, 6, 4, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1, true, NULL },   /* 1x1 direct */
        { 1, 4, 6, 6, 4, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, false, NULL },  /* 1x1 grouped */
        { 1, 2, 6, 5, 3, 1, 1, 2, 2, 1, 1, 0, 0, 0, 0, 1, true, NULL },   /* 1x1 strided */
        { 1, 3, 11, 10, 5, 5, 3, 3, 2, 2, 1, 2, 0, 1, 2, 1, true, NULL }, /* big, uneven */
        { 1, 1, 3, 3, 1, 3, 3, 1, 1, 1, 1, 0, 0, 0, 0, 1, true, NULL },   /* the seed's */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        s_check_conv (&cases[i], false);
    conv_case_t same = { 1, 3, 7, 9, 4, 3, 4, 2, 2, 1, 1, 0, 0, 0, 0, 1, true,
                         "SAME_UPPER" };
    s_check_conv (&same, false);
}
END_TEST

START_TEST (test_conv1d_matches_direct_convolution)
{
    static const conv_case_t cases[] = {
        /* n c  h  w  m kh kw sh sw dh dw pt pl pb pr grp bias */
        { 2, 4, 1, 20, 6, 1, 3, 1, 2, 1, 2, 0, 1, 0, 3, 2, true, NULL },
        { 1, 3, 1, 16, 5, 1, 5, 1, 1, 1, 1, 0, 2, 0, 2, 1, false, NULL },
        { 1, 4, 1, 9, 4, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 4, true, NULL },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        s_check_conv (&cases[i], true);
}
END_TEST

/* --- matrix products ------------------------------------------------ */

typedef struct {
    int64_t m, n, k;
    int ta, tb;
    double alpha, beta;
    int c;              /* 0: none, 1: [n], 2: [m, n], 3: [m, 1], 4: scalar [] */
} gemm_case_t;

START_TEST (test_gemm_matches_naive_product)
{
    static const gemm_case_t cases[] = {
        { 4, 10, 16, 0, 1, 1.0, 1.0, 1 },       /* nn.Linear: transB, bias */
        { 5, 7, 9, 1, 0, 0.5, 2.0, 2 },
        { 3, 6, 8, 1, 1, 1.5, -1.0, 3 },
        { 6, 4, 5, 0, 0, 1.0, 0.0, 2 },         /* beta 0 drops C */
        { 2, 3, 4, 0, 1, 1.0, 1.0, 0 },
        { 3, 3, 3, 0, 0, 2.0, 0.5, 4 },
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const gemm_case_t *c = &cases[ci];
        kiln_graph_t *g = kiln_graph_new ();
        int a = testlib_input (g, "a", c->ta ? SH (c->k, c->m) : SH (c->m, c->k));
        int b = testlib_weight (g, "b", c->tb ? SH (c->n, c->k) : SH (c->k, c->n));
        kiln_shape_t cs[] = { SH (1), SH (c->n), SH (c->m, c->n), SH (c->m, 1),
                              { .rank = 0 } };
        int cc = c->c ? testlib_weight (g, "c", cs[c->c]) : -1;
        int y = testlib_tensor (g, "y");
        int ins[3] = { a, b, cc };
        int n = testlib_node (g, "Gemm", "gemm", ins, c->c ? 3 : 2, y);
        testlib_output (g, y);
        testlib_int (g, n, "transA", c->ta);
        testlib_int (g, n, "transB", c->tb);
        kiln_err_t err;
        ck_assert (kiln_node_set_float (g, n, "alpha", c->alpha, &err) == 0);
        ck_assert (kiln_node_set_float (g, n, "beta", c->beta, &err) == 0);

        float *av = testlib_rand (c->m * c->k);
        const float *bv = s_wdata (g, b), *cv = c->c ? s_wdata (g, cc) : NULL;
        double *ref = malloc ((size_t) (c->m * c->n) * sizeof *ref);
        kiln_shape_t ys = SH (c->m, c->n);
        for (int64_t i = 0; i < c->m; i++)
            for (int64_t j = 0; j < c->n; j++) {
                double acc = 0;
                for (int64_t k = 0; k < c->k; k++)
                    acc += (double) (c->ta ? av[k * c->m + i] : av[i * c->k + k])
                           * (c->tb ? bv[j * c->k + k] : bv[k * c->n + j]);
                acc *= c->alpha;
                if (cv)
                    acc += c->beta * cv[s_bidx (&ys, &cs[c->c], i * c->n + j)];
                ref[i * c->n + j] = acc;
            }
        kiln_model_t *m = s_build (g, NULL, NULL);
        float *got = s_run1 (m, av, ys);
        s_assert_close (got, ref, c->m * c->n, "gemm");
        free (got);
        free (ref);
        free (av);
        kiln_model_destroy (&m);
        kiln_graph_destroy (&g);
    }
}
END_TEST

/* numpy.matmul, written out: promote 1-D operands, broadcast the batch. */
static void
ref_matmul (const float *a, kiln_shape_t sa, const float *b, kiln_shape_t sb,
            double *y, kiln_shape_t *ys)
{
    kiln_shape_t ma = sa, mb = sb;
    if (sa.rank == 1)
        ma = SH (1, sa.dims[0]);
    if (sb.rank == 1)
        mb = SH (sb.dims[0], 1);
    int64_t m = ma.dims[ma.rank - 2], k = ma.dims[ma.rank - 1];
    int64_t n = mb.dims[mb.rank - 1];
    kiln_shape_t ba = ma, bb = mb, batch = { 0 };
    ba.rank -= 2;
    bb.rank -= 2;
    batch.rank = ba.rank > bb.rank ? ba.rank : bb.rank;
    for (int i = 0; i < batch.rank; i++) {
        int ia = i - (batch.rank - ba.rank), ib = i - (batch.rank - bb.rank);
        int64_t da = ia >= 0 ? ba.dims[ia] : 1, db = ib >= 0 ? bb.dims[ib] : 1;
        batch.dims[i] = da > db ? da : db;
    }
    int64_t nb = testlib_numel (&batch);
    for (int64_t bi = 0; bi < nb; bi++) {
        int64_t oa = s_bidx (&batch, &ba, bi) * m * k;
        int64_t ob = s_bidx (&batch, &bb, bi) * k * n;
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                double acc = 0;
                for (int64_t q = 0; q < k; q++)
                    acc += (double) a[oa + i * k + q] * b[ob + q * n + j];
                y[(bi * m + i) * n + j] = acc;
            }
    }
    *ys = batch;
    if (sa.rank > 1)
        ys->dims[ys->rank++] = m;
    if (sb.rank > 1)
        ys->dims[ys->rank++] = n;
}

START_TEST (test_matmul_batched_and_broadcast_matches_naive_product)
{
    struct { kiln_shape_t a, b; } cases[] = {
        { SH (2, 3, 4, 5), SH (5, 6) },         /* shared B: one sgemm */
        { SH (2, 1, 4, 5), SH (3, 5, 6) },      /* both sides broadcast */
        { SH (3, 4, 5), SH (3, 5, 2) },         /* plain batch */
        { SH (7), SH (7, 3) },                  /* vector x matrix */
        { SH (2, 4, 7), SH (7) },               /* matrix x vector */
        { SH (6), SH (6) },                     /* dot product */
        { SH (1, 4, 5), SH (2, 3, 5, 4) },
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        kiln_graph_t *g = kiln_graph_new ();
        int a = testlib_input (g, "a", cases[ci].a);
        int b = testlib_weight (g, "b", cases[ci].b);
        int y = testlib_tensor (g, "y");
        int ins[2] = { a, b };
        testlib_node (g, "MatMul", "mm", ins, 2, y);
        testlib_output (g, y);
        float *av = testlib_rand (testlib_numel (&cases[ci].a));
        double *ref = malloc (4096 * sizeof *ref);
        kiln_shape_t ys;
        ref_matmul (av, cases[ci].a, s_wdata (g, b), cases[ci].b, ref, &ys);
        kiln_model_t *m = s_build (g, NULL, NULL);
        float *got = s_run1 (m, av, ys);
        s_assert_close (got, ref, testlib_numel (&ys), "matmul");
        free (got);
        free (ref);
        free (av);
        kiln_model_destroy (&m);
        kiln_graph_destroy (&g);
    }
}
END_TEST

/* --- elementwise ---------------------------------------------------- */

START_TEST (test_binary_ops_broadcast_like_numpy)
{
    struct { const char *op; kiln_shape_t a, b; bool b_input; } cases[] = {
        { "Add", SH (2, 3, 4, 5), SH (3, 1, 5), false },
        { "Mul", SH (4, 1), SH (1, 5), true },
        { "Sub", SH (2, 3, 4), { .rank = 0 }, false },     /* scalar */
        { "Div", SH (3, 4), SH (3, 4), true },
        { "Add", SH (1, 6, 1, 1), SH (2, 6, 3, 3), true },  /* bias-like */
        { "Mul", SH (5), SH (2, 1, 5), false },
        { "Add", SH (2, 1, 3, 1), SH (1, 4, 1, 5), true },
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        kiln_graph_t *g = kiln_graph_new ();
        int a = testlib_input (g, "a", cases[ci].a);
        int b = cases[ci].b_input ? testlib_input (g, "b", cases[ci].b)
                                  : testlib_weight (g, "b", cases[ci].b);
        int y = testlib_tensor (g, "y");
        int ins[2] = { a, b };
        testlib_node (g, cases[ci].op, "op", ins, 2, y);
        testlib_output (g, y);

        kiln_shape_t ys = { .rank = cases[ci].a.rank > cases[ci].b.rank
                                    ? cases[ci].a.rank : cases[ci].b.rank };
        for (int i = 0; i < ys.rank; i++) {
            int ia = i - (ys.rank - cases[ci].a.rank);
            int ib = i - (ys.rank - cases[ci].b.rank);
            int64_t da = ia >= 0 ? cases[ci].a.dims[ia] : 1;
            int64_t db = ib >= 0 ? cases[ci].b.dims[ib] : 1;
            ys.dims[i] = da > db ? da : db;
        }
        float *av = testlib_rand (testlib_numel (&cases[ci].a));
        float *bv = cases[ci].b_input ? testlib_rand (testlib_numel (&cases[ci].b)) : NULL;
        const float *bd = bv ? bv : s_wdata (g, b);
        if (strcmp (cases[ci].op, "Div") == 0)
            for (int64_t i = 0; bv && i < testlib_numel (&cases[ci].b); i++)
                bv[i] = bv[i] >= 0 ? bv[i] + 0.5f : bv[i] - 0.5f;
        int64_t n = testlib_numel (&ys);
        double *ref = malloc ((size_t) n * sizeof *ref);
        for (int64_t i = 0; i < n; i++) {
            double x0 = av[s_bidx (&ys, &cases[ci].a, i)];
            double x1 = bd[s_bidx (&ys, &cases[ci].b, i)];
            switch (cases[ci].op[0]) {
            case 'A': ref[i] = (float) (x0 + x1); break;
            case 'S': ref[i] = (float) (x0 - x1); break;
            case 'M': ref[i] = (float) (x0 * x1); break;
            default:  ref[i] = (float) (x0 / x1); break;
            }
        }
        kiln_model_t *m = s_build (g, NULL, NULL);
        const kiln_manifest_t *man = kiln_model_manifest (m);
        int n_in = man->n_inputs;
        kiln_rt_tensor_t in[2] = {
            { KILN_DT_FLOAT32, cases[ci].a, av },
            { KILN_DT_FLOAT32, cases[ci].b, bv },
        };
        float *got = malloc ((size_t) n * 4);
        kiln_rt_tensor_t out = { .data = got };
        kiln_err_t err = { 0 };
        ck_assert_msg (kiln_model_run (m, in, n_in, &out, 1, &err) == 0, "%s",
                       err.msg);
        ck_assert (kiln_shape_equal (&out.shape, &ys));
        s_assert_close (got, ref, n, cases[ci].op);
        free (got);
        free (ref);
        free (av);
        free (bv);
        kiln_model_destroy (&m);
        kiln_graph_destroy (&g);
    }
}
END_TEST

/* --- pooling -------------------------------------------------------- */

/* A 2×2 stride-2 average (densenet's transitions): every output the
 * double sum of its window in row order over 4, the same float as the
 * general loop's, on rows of 1 to 57 outputs. */
START_TEST (test_avgpool_2x2_stride_2_is_the_double_sum)
{
    const int64_t widths[] = { 2, 10, 32, 34, 66, 114 };
    for (size_t wi = 0; wi < sizeof widths / sizeof widths[0]; wi++) {
        int64_t c = 3, h = 6, w = widths[wi], oh = h / 2, ow = w / 2;
        kiln_graph_t *g = kiln_graph_new ();
        int x = testlib_input (g, "x", SH (1, c, h, w));
        int y = testlib_tensor (g, "y");
        int n = testlib_node (g, "AveragePool", "pool", &x, 1, y);
        testlib_output (g, y);
        testlib_ints (g, n, "kernel_shape", 2, 2, 2);
        testlib_ints (g, n, "strides", 2, 2, 2);
        float *xv = testlib_rand (c * h * w);
        kiln_model_t *m = s_build (g, NULL, NULL);
        float *got = s_run1 (m, xv, SH (1, c, oh, ow));
        for (int64_t p = 0; p < c; p++)
            for (int64_t r = 0; r < oh; r++)
                for (int64_t q = 0; q < ow; q++) {
                    const float *x0 = xv + (p * h + 2 * r) * w + 2 * q, *x1 = x0 + w;
                    float want = (float) (((((double) x0[0] + x0[1]) + x1[0]) + x1[1]) / 4.0);
                    float v = got[(p * oh + r) * ow + q];
                    ck_assert_msg (memcmp (&v, &want, sizeof v) == 0, "width %lld: "
                                   "output (%lld, %lld, %lld) is %.9g, want %.9g",
                                   (long long) w, (long long) p, (long long) r,
                                   (long long) q, (double) v, (double) want);
                }
        free (got);
        free (xv);
        kiln_model_destroy (&m);
        kiln_graph_destroy (&g);
    }
}
END_TEST

/* A pooling case: input, window, strides, pads, dilations, ceil_mode
 * and (AveragePool) count_include_pad. */
typedef struct {
    int64_t n, c, h, w, kh, kw, sh, sw, pt, pl, pb, pr, dh, dw;
    bool ceil, incl;
} pool_case_t;

/* A graph of one `op` (MaxPool or AveragePool) of case c; its output's
 * height and width in *oh, *ow. */
static kiln_graph_t *
s_pool_graph (const char *op, const pool_case_t *c, int64_t *oh, int64_t *ow)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = testlib_input (g, "x", SH (c->n, c->c, c->h, c->w));
    int y = testlib_tensor (g, "y");
    int n = testlib_node (g, op, "pool", &x, 1, y);
    testlib_output (g, y);
    testlib_ints (g, n, "kernel_shape", 2, c->kh, c->kw);
    testlib_ints (g, n, "strides", 2, c->sh, c->sw);
    testlib_ints (g, n, "pads", 4, c->pt, c->pl, c->pb, c->pr);
    testlib_ints (g, n, "dilations", 2, c->dh, c->dw);
    testlib_int (g, n, "ceil_mode", c->ceil);
    if (strcmp (op, "AveragePool") == 0) {
        testlib_int (g, n, "count_include_pad", c->incl);
        g->opset = 19;      /* (dilations on AveragePool) */
    }
    *oh = s_out (c->h, c->pt, c->pb, c->kh, c->sh, c->dh, c->ceil);
    *ow = s_out (c->w, c->pl, c->pr, c->kw, c->sw, c->dw, c->ceil);
    return g;
}

/* Every other average pool (s_avg_planes: column sums of the window's
 * rows, then the window's columns), against the window's mean computed
 * cell by cell in double: padded or not, counting the padding or not,
 * with ceil_mode (last windows past the padded plane), strides that leave
 * columns unread, dilations, long rows, 1-wide windows. */
START_TEST (test_avgpool_with_pads_strides_dilations_ceil_matches_naive)
{
    pool_case_t cases[] = {
        { 1, 3, 12, 12, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, true },     /* inception */
        { 1, 3, 12, 12, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, false },
        { 2, 2, 25, 25, 3, 3, 1, 1, 0, 0, 0, 0, 1, 1, false, false },    /* unpadded */
        { 1, 2, 7, 8, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1, true, false },       /* ceil_mode */
        { 1, 2, 7, 8, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1, true, true },
        { 1, 2, 9, 10, 2, 2, 3, 3, 0, 0, 0, 0, 1, 1, false, false },     /* columns unread */
        { 1, 2, 11, 13, 3, 3, 1, 2, 2, 1, 0, 2, 2, 2, false, true },     /* dilated, uneven */
        { 1, 2, 5, 70, 5, 5, 1, 1, 2, 2, 2, 2, 1, 1, false, true },      /* long rows */
        { 1, 2, 9, 9, 1, 7, 1, 1, 0, 3, 0, 3, 1, 1, false, true },       /* 1 x 7 */
        { 1, 2, 9, 9, 7, 1, 1, 1, 3, 0, 3, 0, 1, 1, false, false },      /* 7 x 1 */
        { 1, 2, 6, 6, 2, 2, 2, 2, 0, 0, 0, 0, 1, 1, false, false },      /* 2 x 2, 2 */
        { 2, 7, 5, 5, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, true },       /* rows of 5 */
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const pool_case_t *c = &cases[ci];
        int64_t oh, ow;
        kiln_graph_t *g = s_pool_graph ("AveragePool", c, &oh, &ow);
        kiln_shape_t ys = SH (c->n, c->c, oh, ow);
        float *xv = testlib_rand (c->n * c->c * c->h * c->w);
        double *ref = malloc ((size_t) testlib_numel (&ys) * sizeof *ref);
        for (int64_t p = 0; p < c->n * c->c; p++)
            for (int64_t r = 0; r < oh; r++)
                for (int64_t q = 0; q < ow; q++) {
                    double sum = 0.0;
                    int64_t cells = 0;
                    for (int64_t i = 0; i < c->kh; i++)
                        for (int64_t j = 0; j < c->kw; j++) {
                            int64_t ih = r * c->sh - c->pt + i * c->dh;
                            int64_t iw = q * c->sw - c->pl + j * c->dw;
                            bool in = ih >= 0 && ih < c->h && iw >= 0 && iw < c->w;
                            if (c->incl ? ih < c->h + c->pb && iw < c->w + c->pr : in)
                                cells++;
                            if (in)
                                sum += xv[(p * c->h + ih) * c->w + iw];
                        }
                    ref[(p * oh + r) * ow + q] = sum / (double) cells;
                }
        kiln_model_t *m = s_build (g, NULL, NULL);
        float *got = s_run1 (m, xv, ys);
        s_assert_close (got, ref, testlib_numel (&ys), "avgpool");
        free (got);
        free (ref);
        free (xv);
        kiln_model_destroy (&m);
        kiln_graph_destroy (&g);
    }
}
END_TEST

START_TEST (test_maxpool_with_pads_strides_dilations_ceil_matches_naive)
{
    pool_case_t cases[] = {
        { 1, 2, 8, 8, 2, 2, 2, 2, 0, 0, 0, 0, 1, 1, false, false },
        { 2, 3, 7, 9, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false, false },    /* ResNet stem */
        { 1, 2, 7, 7, 3, 2, 2, 3, 1, 0, 1, 1, 1, 1, true, false },     /* ceil_mode */
        { 1, 1, 9, 8, 2, 3, 1, 2, 0, 1, 0, 1, 2, 2, false, false },    /* dilations */
        { 1, 2, 6, 6, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, true, false },
        /* long rows (the vectorised column pass over whole output rows):
         * padded, with ceil_mode, unpadded; NaNs in the last, which must
         * come out in every window that holds one */
        { 1, 3, 9, 70, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false, false },
        { 1, 2, 8, 67, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, true, false },
        { 2, 2, 5, 64, 3, 3, 2, 2, 0, 0, 0, 0, 1, 1, false, false },
        /* three rows a pass (stride 1, rows 2 apart), the AVX-512
         * 3-wide stride-2 columns (17 outputs: a vector and one) */
        { 1, 2, 6, 21, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, false },
        { 1, 2, 11, 34, 3, 3, 2, 2, 1, 1, 1, 1, 2, 1, false, false },
        /* stride 1 along the rows on small planes (the AVX-512 planes:
         * googlenet's branch pools), 5 wide and dilated, rows of 5 */
        { 1, 5, 14, 14, 5, 5, 1, 1, 2, 2, 2, 2, 1, 2, false, false },
        { 2, 3, 5, 5, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, false, false },
        /* stride 2, rows of 16 outputs or fewer (2x2 with ceil_mode,
         * 3-wide dilated) */
        { 2, 3, 13, 13, 2, 2, 2, 2, 0, 0, 0, 0, 1, 1, true, false },
        { 1, 2, 12, 12, 3, 3, 2, 2, 1, 1, 1, 1, 1, 2, false, false },
        /* the last three with NaNs */
        { 1, 2, 7, 99, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, false, false },
        { 2, 7, 7, 7, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, true, false },
        { 1, 16, 14, 14, 2, 2, 2, 2, 0, 0, 0, 0, 1, 1, true, false },
    };
    size_t nan_case = sizeof cases / sizeof cases[0] - 3;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const pool_case_t *c = &cases[ci];
        int64_t oh, ow;
        kiln_graph_t *g = s_pool_graph ("MaxPool", c, &oh, &ow);
        kiln_shape_t ys = SH (c->n, c->c, oh, ow);
        float *xv = testlib_rand (c->n * c->c * c->h * c->w);
        for (int64_t i = 0; ci >= nan_case && i < c->n * c->c * c->h * c->w; i += 97 * 3)
            xv[i] = NAN;
        double *ref = malloc ((size_t) testlib_numel (&ys) * sizeof *ref);
        for (int64_t p = 0; p < c->n * c->c; p++)
            for (int64_t r = 0; r < oh; r++)
                for (int64_t q = 0; q < ow; q++) {
                    double best = -INFINITY;
                    for (int64_t i = 0; i < c->kh; i++)
                        for (int64_t j = 0; j < c->kw; j++) {
                            int64_t ih = r * c->sh - c->pt + i * c->dh;
                            int64_t iw = q * c->sw - c->pl + j * c->dw;
                            if (ih < 0 || ih >= c->h || iw < 0 || iw >= c->w)
                                continue;
                            float v = xv[(p * c->h + ih) * c->w + iw];
                            if (v != v || best != best)     /* a NaN window is NaN */
                                best = NAN;
                            else if (v > best)
                                best = v;
                        }
                    ref[(p * oh + r) * ow + q] = best;
                }
        kiln_model_t *m = s_build (g, NULL, NULL);
        float *got = s_run1 (m, xv, ys);
        int nans = 0;
        for (int64_t i = 0; i < testlib_numel (&ys); i++)
            if (ref[i] != ref[i]) {
                ck_assert_msg (got[i] != got[i], "maxpool case %zu: element %lld is %g, "
                               "its window holds a NaN", ci, (long long) i, (double) got[i]);
                got[i] = 0.0f;
                ref[i] = 0.0;
                nans++;
            }
        ck_assert (ci < nan_case || nans > 10);
        s_assert_close (got, ref, testlib_numel (&ys), "maxpool");
        free (got);
        free (ref);
        free (xv);
        kiln_model_destroy (&m);
        kiln_graph_destroy (&g);
    }
}
END_TEST

START_TEST (test_global_average_pool_matches_mean)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = testlib_input (g, "x", SH (2, 3, 5, 7));
    int y = testlib_tensor (g, "y");
    testlib_node (g, "GlobalAveragePool", "gap", &x, 1, y);
    testlib_output (g, y);
    float *xv = testlib_rand (2 * 3 * 5 * 7);
    double ref[6];
    for (int p = 0; p < 6; p++) {
        double s = 0;
        for (int i = 0; i < 35; i++)
            s += xv[p * 35 + i];
        ref[p] = s / 35;
    }
    kiln_model_t *m = s_build (g, NULL, NULL);
    float *got = s_run1 (m, xv, SH (2, 3, 1, 1));
    s_assert_close (got, ref, 6, "gap");
    free (got);
    free (xv);
    kiln_model_destroy (&m);
    kiln_graph_destroy (&g);
}
END_TEST

/* --- a whole model -------------------------------------------------- */

/* conv 3->8 (pad 1) -> relu -> maxpool 2 -> conv 8->16 (stride 2, pad 1)
 * -> relu -> global average pool -> flatten -> linear 16->10, the shape
 * of tests/integration/models.py's SmallCNN. */
static kiln_graph_t *
s_small_cnn (int *w1, int *b1, int *w2, int *b2, int *wl, int *bl)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = testlib_input (g, "image", SH (2, 3, 16, 16));
    *w1 = testlib_weight (g, "w1", SH (8, 3, 3, 3));
    *b1 = testlib_weight (g, "b1", SH (8));
    *w2 = testlib_weight (g, "w2", SH (16, 8, 3, 3));
    *b2 = testlib_weight (g, "b2", SH (16));
    *wl = testlib_weight (g, "wl", SH (10, 16));
    *bl = testlib_weight (g, "bl", SH (10));
    int t[8];
    testlib_tensors (g, t, 8);
    int logits = testlib_tensor (g, "logits");
    int n;
    n = testlib_node (g, "Conv", "conv1", (int[]) { x, *w1, *b1 }, 3, t[0]);
    testlib_ints (g, n, "pads", 4, 1, 1, 1, 1);
    testlib_ints (g, n, "kernel_shape", 2, 3, 3);
    testlib_node (g, "Relu", "relu1", &t[0], 1, t[1]);
    n = testlib_node (g, "MaxPool", "pool", &t[1], 1, t[2]);
    testlib_ints (g, n, "kernel_shape", 2, 2, 2);
    testlib_ints (g, n, "strides", 2, 2, 2);
    n = testlib_node (g, "Conv", "conv2", (int[]) { t[2], *w2, *b2 }, 3, t[3]);
    testlib_ints (g, n, "pads", 4, 1, 1, 1, 1);
    testlib_ints (g, n, "strides", 2, 2, 2);
    testlib_node (g, "Relu", "relu2", &t[3], 1, t[4]);
    testlib_node (g, "GlobalAveragePool", "gap", &t[4], 1, t[5]);
    n = testlib_node (g, "Flatten", "flatten", &t[5], 1, t[6]);
    testlib_int (g, n, "axis", 1);
    n = testlib_node (g, "Gemm", "fc", (int[]) { t[6], *wl, *bl }, 3, logits);
    testlib_int (g, n, "transB", 1);
    testlib_output (g, logits);
    return g;
}

static void
ref_small_cnn (const kiln_graph_t *g, const float *x, int w1, int b1, int w2,
               int b2, int wl, int bl, double *out)
{
    conv_case_t c1 = { 2, 3, 16, 16, 8, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, true, NULL };
    conv_case_t c2 = { 2, 8, 8, 8, 16, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, 1, true, NULL };
    double *a1 = malloc (2 * 8 * 16 * 16 * sizeof *a1);
    float *f1 = malloc (2 * 8 * 8 * 8 * sizeof *f1);
    double *a2 = malloc (2 * 16 * 4 * 4 * sizeof *a2);
    ref_conv (&c1, x, s_wdata (g, w1), s_wdata (g, b1), 16, 16, a1);
    for (int p = 0; p < 16; p++)                       /* relu + maxpool 2 */
        for (int r = 0; r < 8; r++)
            for (int q = 0; q < 8; q++) {
                double best = 0;
                for (int i = 0; i < 2; i++)
                    for (int j = 0; j < 2; j++)
                        best = fmax (best, a1[(p * 16 + 2 * r + i) * 16 + 2 * q + j]);
                f1[(p * 8 + r) * 8 + q] = (float) best;
            }
    ref_conv (&c2, f1, s_wdata (g, w2), s_wdata (g, b2), 4, 4, a2);
    const float *wv = s_wdata (g, wl), *bv = s_wdata (g, bl);
    for (int n = 0; n < 2; n++) {
        double feat[16];
        for (int c = 0; c < 16; c++) {
            double s = 0;
            for (int i = 0; i < 16; i++)
                s += fmax (0, a2[(n * 16 + c) * 16 + i]);
            feat[c] = s / 16;
        }
        for (int o = 0; o < 10; o++) {
            double acc = bv[o];
            for (int c = 0; c < 16; c++)
                acc += feat[c] * wv[o * 16 + c];
            out[n * 10 + o] = acc;
        }
    }
    free (a1);
    free (f1);
    free (a2);
}

START_TEST (test_small_cnn_matches_reference_and_reuses_memory)
{
    for (int opt = 0; opt <= 3; opt++) {
        int w1, b1, w2, b2, wl, bl;
        kiln_graph_t *g = s_small_cnn (&w1, &b1, &w2, &b2, &wl, &bl);
        float *xv = testlib_rand (2 * 3 * 16 * 16);
        double ref[20];
        ref_small_cnn (g, xv, w1, b1, w2, b2, wl, bl, ref);
        char args[32];
        snprintf (args, sizeof args, "--optlevel %d", opt);
        kiln_cc_stats_t st = { 0 };
        kiln_model_t *m = s_build (g, args, &st);
        float *got = s_run1 (m, xv, SH (2, 10));
        s_assert_close (got, ref, 20, "small cnn");
        /* Run again: the arena is reused, the answer must not change. */
        float *again = s_run1 (m, xv, SH (2, 10));
        ck_assert (memcmp (got, again, 20 * sizeof *got) == 0);
        if (opt == 0)
            ck_assert_uint_eq (st.arena_bytes, st.naive_bytes);
        else
            ck_assert_msg (st.arena_bytes < st.naive_bytes,
                           "-O%d: arena %llu is not smaller than naive %llu", opt,
                           (unsigned long long) st.arena_bytes,
                           (unsigned long long) st.naive_bytes);
        if (opt == 2)
            printf ("small cnn at -O2: %d ops, arena %llu bytes, naive %llu, "
                    "weights %llu\n", st.n_ops,
                    (unsigned long long) st.arena_bytes,
                    (unsigned long long) st.naive_bytes,
                    (unsigned long long) st.weights_bytes);
        free (got);
        free (again);
        free (xv);
        kiln_model_destroy (&m);
        kiln_graph_destroy (&g);
    }
}
END_TEST

/* Reshape, Flatten and Identity move no bytes from -O1 on (aliases) and
 * copy at -O0; both must give the same answer, including a view that is
 * itself a graph output and a view of a graph input and of a weight. */
START_TEST (test_views_alias_or_copy_with_same_result)
{
    for (int opt = 0; opt <= 2; opt += 2) {
        kiln_graph_t *g = kiln_graph_new ();
        int x = testlib_input (g, "x", SH (2, 3, 4));
        int64_t shp[2] = { 6, 4 };
        int sh = s_weight_i64 (g, "shape", shp, 2);
        int w = testlib_weight (g, "w", SH (4, 5));
        int r = testlib_tensor (g, "r"), f = testlib_tensor (g, "f");
        int y = testlib_tensor (g, "y");
        int wi = testlib_tensor (g, "wi"), id = testlib_tensor (g, "id");
        testlib_node (g, "Reshape", "reshape", (int[]) { x, sh }, 2, r);
        testlib_node (g, "Identity", "wid", &w, 1, wi);
        testlib_node (g, "MatMul", "mm", (int[]) { r, wi }, 2, y);
        int n = testlib_node (g, "Flatten", "flat", &x, 1, f);
        testlib_int (g, n, "axis", 2);
        testlib_node (g, "Identity", "ident", &y, 1, id);
        testlib_output (g, id);
        testlib_output (g, f);
        testlib_output (g, y);

        float *xv = testlib_rand (24);
        double ref[30];
        ref_matmul (xv, SH (6, 4), s_wdata (g, w), SH (4, 5), ref, &(kiln_shape_t) { 0 });
        double fref[24];
        for (int i = 0; i < 24; i++)
            fref[i] = xv[i];
        char args[32];
        snprintf (args, sizeof args, "--optlevel %d", opt);
        kiln_model_t *m = s_build (g, args, NULL);
        float yo[30], fo[24], io[30];
        kiln_rt_tensor_t in = { KILN_DT_FLOAT32, SH (2, 3, 4), xv };
        kiln_rt_tensor_t out[3] = { { .data = io }, { .data = fo }, { .data = yo } };
        kiln_err_t err = { 0 };
        ck_assert_msg (kiln_model_run (m, &in, 1, out, 3, &err) == 0, "%s", err.msg);
        kiln_shape_t fs = SH (6, 4);
        ck_assert (kiln_shape_equal (&out[1].shape, &fs));
        s_assert_close (io, ref, 30, "identity of matmul");
        s_assert_close (yo, ref, 30, "matmul");
        s_assert_close (fo, fref, 24, "flatten");
        free (xv);
        kiln_model_destroy (&m);
        kiln_graph_destroy (&g);
    }
}
END_TEST

/* Two inputs, one used twice and passed through to an output. */
START_TEST (test_seed_function_two_x_plus_y)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = testlib_input (g, "x", SH (3));
    int y = testlib_input (g, "y", SH (3));
    int t = testlib_tensor (g, "t"), z = testlib_tensor (g, "z");
    int xi = testlib_tensor (g, "x_out");
    testlib_node (g, "Add", "twice", (int[]) { x, x }, 2, t);
    testlib_node (g, "Add", "plus", (int[]) { t, y }, 2, z);
    testlib_node (g, "Identity", "pass", &x, 1, xi);
    testlib_output (g, z);
    testlib_output (g, xi);
    kiln_model_t *m = s_build (g, NULL, NULL);
    float xv[3] = { 1, 2, 3 }, yv[3] = { 0.5f, -1, 10 }, zo[3], xo[3];
    kiln_rt_tensor_t in[2] = { { KILN_DT_FLOAT32, SH (3), xv },
                               { KILN_DT_FLOAT32, SH (3), yv } };
    kiln_rt_tensor_t out[2] = { { .data = zo }, { .data = xo } };
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_model_run (m, in, 2, out, 2, &err) == 0, "%s", err.msg);
    ck_assert (zo[0] == 2.5f && zo[1] == 3.0f && zo[2] == 16.0f);
    ck_assert (memcmp (xo, xv, sizeof xv) == 0);
    kiln_model_destroy (&m);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_model_io_structure_is_the_manifests_or_null)
{
    const char *text = "{\"kind\":\"list\",\"items\":[{\"tensor\":0},{\"tensor\":1}]}";
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_graph_new ();
    int x = testlib_input (g, "x", SH (3));
    int y = testlib_tensor (g, "y"), z = testlib_tensor (g, "z");
    testlib_node (g, "Relu", "relu", &x, 1, y);
    testlib_node (g, "Identity", "pass", &x, 1, z);
    testlib_output (g, y);
    testlib_output (g, z);
    kiln_model_t *plain = s_build (g, NULL, NULL);
    ck_assert_ptr_null (kiln_model_io_structure (plain));
    ck_assert (kiln_graph_set_io_structure (g, text, &err) == 0);
    kiln_model_t *m = s_build (g, NULL, NULL);
    ck_assert_ptr_nonnull (kiln_model_io_structure (m));
    ck_assert_str_eq (kiln_model_io_structure (m), text);
    ck_assert_ptr_eq (kiln_model_io_structure (m), kiln_model_manifest (m)->io_structure);
    ck_assert_ptr_null (kiln_model_io_structure (NULL));
    kiln_model_destroy (&m);
    kiln_model_destroy (&plain);
    kiln_graph_destroy (&g);
}
END_TEST

/* Runs of one model from several threads are serialised on its arena:
 * every thread gets the answer a lone run gives. */
typedef struct {
    kiln_model_t *m;
    const float *x;
    const float *want;
    int bad;
} s_thread_arg_t;

static void *
s_runner (void *arg)
{
    s_thread_arg_t *a = arg;
    for (int i = 0; i < 25; i++) {
        float y[20];
        kiln_rt_tensor_t in = { KILN_DT_FLOAT32, SH (2, 3, 16, 16), (void *) a->x };
        kiln_rt_tensor_t out = { .data = y };
        kiln_err_t err = { 0 };
        if (kiln_model_run (a->m, &in, 1, &out, 1, &err) != 0
            || memcmp (y, a->want, sizeof y) != 0)
            a->bad++;
    }
    return NULL;
}

START_TEST (test_concurrent_runs_of_one_model_agree)
{
    int w1, b1, w2, b2, wl, bl;
    kiln_graph_t *g = s_small_cnn (&w1, &b1, &w2, &b2, &wl, &bl);
    kiln_model_t *m = s_build (g, NULL, NULL);
    float *xs[4], *want[4];
    for (int i = 0; i < 4; i++) {
        xs[i] = testlib_rand (2 * 3 * 16 * 16);
        want[i] = s_run1 (m, xs[i], SH (2, 10));
    }
    pthread_t th[4];
    s_thread_arg_t args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (s_thread_arg_t) { m, xs[i], want[i], 0 };
        ck_assert (pthread_create (&th[i], NULL, s_runner, &args[i]) == 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join (th[i], NULL);
        ck_assert_int_eq (args[i].bad, 0);
        free (xs[i]);
        free (want[i]);
    }
    kiln_model_destroy (&m);
    kiln_graph_destroy (&g);
}
END_TEST

/* --- weights mapped from the artifact ------------------------------ */

/* Find `needle` in `hay`; the offset or -1. */
static long
s_find (const uint8_t *hay, size_t n, const uint8_t *needle, size_t m)
{
    for (size_t i = 0; m <= n && i + m <= n; i++)
        if (memcmp (hay + i, needle, m) == 0)
            return (long) i;
    return -1;
}

/* Compile `g` at -O2, sign it (with `provenance` when not NULL) and write
 * it to `path`; the artifact's weights.bin is copied to *weights (caller
 * frees) when `weights` is not NULL. */
static void
s_write_model (kiln_graph_t *g, const char *path, const char *provenance,
               uint8_t **weights, size_t *wlen)
{
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_cc_compile (g, "--optlevel 2", &err);
    ck_assert_msg (art, "%s", err.msg);
    if (weights) {
        const uint8_t *w = kiln_artifact_member (art, KILN_WEIGHTS_MEMBER, wlen);
        ck_assert (w && *wlen >= 4096);
        *weights = malloc (*wlen);
        memcpy (*weights, w, *wlen);
    }
    ck_assert_msg (kiln_artifact_sign (art, s_key, provenance, &err) == 0, "%s", err.msg);
    ck_assert_msg (kiln_artifact_write (art, path, &err) == 0, "%s", err.msg);
    kiln_artifact_destroy (&art);
}

/* Where `w` (the weights, `wlen` bytes) lies in the file at `path`. */
static long
s_weights_offset (const char *path, const uint8_t *w, size_t wlen)
{
    uint8_t *file;
    size_t flen;
    kiln_err_t err;
    ck_assert (kiln_read_file (path, 1 << 26, &file, &flen, &err) == 0);
    long at = s_find (file, flen, w, wlen);
    free (file);
    ck_assert_msg (at >= 0, "weights.bin not found in %s", path);
    return at;
}

/* Copy the archive at `src` to `dst` member for member with libarchive's
 * own pax writer and nothing between the members: the layout kiln wrote
 * before it aligned them. */
static void
s_write_unaligned (const char *src, const char *dst)
{
    kiln_err_t err;
    uint8_t *data, *copy;
    size_t len, n;
    ck_assert_msg (kiln_read_file (src, 1ull << 30, &data, &len, &err) == 0, "%s", err.msg);
    copy = testlib_tar_copy (data, len, NULL, &n);
    ck_assert_msg (kiln_write_file_atomic (dst, copy, n, 0644, &err) == 0, "%s", err.msg);
    free (copy);
    free (data);
}

/* `path` loaded on a runtime of its own (*rt, caller destroys), its
 * weights mapped (KILN_RT_MMAP=1) or (=0) read into memory, as asked. */
static kiln_model_t *
s_load_own (const char *path, bool mapped, kiln_rt_t **rt)
{
    kiln_err_t err = { 0 };
    setenv ("KILN_RT_MMAP", mapped ? "1" : "0", 1);
    *rt = kiln_rt_new (&err);
    unsetenv ("KILN_RT_MMAP");
    ck_assert_msg (*rt, "%s", err.msg);
    kiln_model_t *m = kiln_rt_load (*rt, path, s_keys, &err);
    ck_assert_msg (m, "%s", err.msg);
    ck_assert_int_eq (kiln_model_weights_mapped (m), mapped);
    return m;
}

/* The small CNN's -O2 artifact read into memory, as every load did before
 * the weights were mapped: the outputs mapped replicas must reproduce. */
static float *
s_run_read_into_memory (const char *path, const float *x)
{
    kiln_rt_t *rt;
    kiln_model_t *m = s_load_own (path, false, &rt);
    float *y = s_run1 (m, x, SH (2, 10));
    kiln_model_destroy (&m);
    kiln_rt_destroy (&rt);
    return y;
}

START_TEST (test_replicas_share_one_mapping_of_the_weights_with_the_same_outputs)
{
    int w1, b1, w2, b2, wl, bl;
    kiln_graph_t *g = s_small_cnn (&w1, &b1, &w2, &b2, &wl, &bl);
    float *x = testlib_rand (2 * 3 * 16 * 16), *x2 = testlib_rand (2 * 3 * 16 * 16);
    double ref[20];
    ref_small_cnn (g, x, w1, b1, w2, b2, wl, bl, ref);
    const char *path = s_path ("cnn.kar");
    uint8_t *weights;
    size_t wlen;
    s_write_model (g, path, NULL, &weights, &wlen);
    ck_assert_int_eq (s_weights_offset (path, weights, wlen) % 4096, 0);
    float *want = s_run_read_into_memory (path, x);
    float *want2 = s_run_read_into_memory (path, x2);
    s_assert_close (want, ref, 20, "small cnn read into memory");

    kiln_err_t err = { 0 };
    kiln_model_t *a = kiln_rt_load_on (s_rt, path, s_keys, 0, &err);
    ck_assert_msg (a, "%s", err.msg);
    kiln_model_t *b = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_msg (b, "%s", err.msg);
    ck_assert_int_eq (kiln_model_weights_mapped (a), 1);
    ck_assert_int_eq (kiln_model_weights_mapped (b), 1);
    const uint8_t *pa = kiln_model_weights_ptr (a), *pb = kiln_model_weights_ptr (b);
    ck_assert_ptr_eq (pa, pb);
    ck_assert_uint_eq ((uintptr_t) pa % 4096, 0);
    ck_assert (memcmp (pa, weights, wlen) == 0);

    float *ya = s_run1 (a, x, SH (2, 10)), *yb = s_run1 (b, x, SH (2, 10));
    ck_assert (memcmp (ya, want, 20 * sizeof *ya) == 0);
    ck_assert (memcmp (yb, want, 20 * sizeof *yb) == 0);

    /* A batch of 4 split over both replicas, one chunk each. */
    float *x4 = malloc (2 * sizeof (float) * 2 * 3 * 16 * 16), y4[40];
    memcpy (x4, x, sizeof (float) * 2 * 3 * 16 * 16);
    memcpy (x4 + 2 * 3 * 16 * 16, x2, sizeof (float) * 2 * 3 * 16 * 16);
    kiln_model_t *reps[2] = { a, b };
    kiln_rt_tensor_t in = { KILN_DT_FLOAT32, SH (4, 3, 16, 16), x4 };
    kiln_rt_tensor_t out = { .data = y4 };
    ck_assert_msg (kiln_model_run_batched (reps, 2, &in, 1, &out, 1, &err) == 0,
                   "%s", err.msg);
    ck_assert (memcmp (y4, want, 20 * sizeof *y4) == 0);
    ck_assert (memcmp (y4 + 20, want2, 20 * sizeof *y4) == 0);

    /* The mapping lives while any replica holds it, and comes back. */
    kiln_model_destroy (&a);
    float *yb2 = s_run1 (b, x, SH (2, 10));
    ck_assert (memcmp (yb2, want, 20 * sizeof *yb2) == 0);
    kiln_model_destroy (&b);
    kiln_model_t *c = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_msg (c, "%s", err.msg);
    ck_assert_int_eq (kiln_model_weights_mapped (c), 1);
    float *yc = s_run1 (c, x, SH (2, 10));
    ck_assert (memcmp (yc, want, 20 * sizeof *yc) == 0);
    kiln_model_destroy (&c);

    /* Each load checks the signature against its own keyring, shared
     * weights or not. */
    kiln_model_t *d = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_msg (d, "%s", err.msg);
    char empty[PATH_MAX];
    snprintf (empty, sizeof empty, "%s/empty-ring", s_dir);
    ck_assert (mkdir (empty, 0700) == 0);
    ck_assert_ptr_null (kiln_rt_load (s_rt, path, empty, &err));
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "not in keyring"), "%s", err.msg);
    kiln_model_destroy (&d);

    free (ya);
    free (yb);
    free (yb2);
    free (yc);
    free (x4);
    free (want);
    free (want2);
    free (weights);
    free (x);
    free (x2);
    kiln_graph_destroy (&g);
}
END_TEST

/* Whether this kernel has transparent huge pages at all (their advice is
 * refused where it has none; "never" still records it). */
static bool
s_thp_kernel (void)
{
    return access ("/sys/kernel/mm/transparent_hugepage/enabled", F_OK) == 0;
}

/* x [n, k] · w [k, m] (w a random weight, its tensor in *w): with k × m
 * large, a model whose weights alone decide how its artifact is held. */
static kiln_graph_t *
s_matmul_graph (int64_t n, int64_t k, int64_t m, int *w)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = testlib_input (g, "x", SH (n, k));
    *w = testlib_weight (g, "w", SH (k, m));
    int y = testlib_tensor (g, "y");
    testlib_node (g, "MatMul", "mm", (int[]) { x, *w }, 2, y);
    testlib_output (g, y);
    return g;
}

/* Buffers of a MiB and more (arenas, workspaces, weights read into
 * memory) are 2 MiB aligned, whole 2 MiB, and advised as huge-page
 * memory; smaller ones are 64-byte aligned and ordinary.  A linear layer
 * of 2 MiB of weights, read into memory (KILN_RT_MMAP=0), computes with
 * weights on such a buffer and matches the double-precision product, as
 * the mapped load of the same file does. */
START_TEST (test_large_buffers_are_on_advised_huge_pages)
{
    bool thp = s_thp_kernel ();
    size_t sizes[] = { 1u << 20, 3u << 20, (5u << 20) + 12345 };
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        uint8_t *p = kiln_mem_alloc (sizes[i]);
        ck_assert_ptr_nonnull (p);
        ck_assert_uint_eq ((uintptr_t) p % KILN_MEM_HUGE, 0);
        memset (p, 0x5a, sizes[i]);     /* all of it is the caller's */
        ck_assert_int_eq (kiln_mem_advised_huge (p), thp);
        ck_assert_int_eq (kiln_mem_advised_huge (p + sizes[i] - 1), thp);
        free (p);
    }
    uint8_t *small = kiln_mem_alloc (1000);
    ck_assert_ptr_nonnull (small);
    ck_assert_uint_eq ((uintptr_t) small % 64, 0);
    memset (small, 0x5a, 1000);
    ck_assert (!kiln_mem_advised_huge (small));
    free (small);
    ck_assert_ptr_null (kiln_mem_alloc (SIZE_MAX - 100));

    enum { N = 3, K = 1024, M = 512 };
    int w;
    kiln_graph_t *g = s_matmul_graph (N, K, M, &w);
    const float *wv = s_wdata (g, w);
    float *xv = testlib_rand (N * K);
    double want[N * M];
    for (int i = 0; i < N; i++)
        for (int j = 0; j < M; j++) {
            double acc = 0.0;
            for (int k = 0; k < K; k++)
                acc += (double) xv[i * K + k] * wv[k * M + j];
            want[i * M + j] = acc;
        }
    const char *path = s_path ("huge.kar");
    s_write_model (g, path, NULL, NULL, NULL);
    for (int mapped = 0; mapped < 2; mapped++) {
        kiln_rt_t *rt;
        kiln_model_t *m = s_load_own (path, mapped, &rt);
        if (!mapped) {
            const uint8_t *wp = kiln_model_weights_ptr (m);
            ck_assert_uint_eq ((uintptr_t) wp % KILN_MEM_HUGE, 0);
            ck_assert_int_eq (kiln_mem_advised_huge (wp), thp);
        }
        float *got = s_run1 (m, xv, SH (N, M));
        s_assert_close (got, want, N * M, mapped ? "mapped weights" : "weights in memory");
        free (got);
        kiln_model_destroy (&m);
        kiln_rt_destroy (&rt);
    }
    free (xv);
    kiln_graph_destroy (&g);
}
END_TEST

/* KILN_RT_MMAP: "0" reads, "1" maps, unset or "auto" reads a file of up
 * to 1 GiB (an eighth of the host's memory when that is less) into
 * memory on advised huge pages and maps a larger one; anything else is
 * refused by the parser (the runtime then warns and takes auto).  Under
 * the default a model of 2 MiB of weights is read, onto huge pages, its
 * replicas share the one copy, and it computes what the mapped load
 * computes, bit for bit. */
START_TEST (test_default_reads_artifacts_up_to_a_bound_onto_huge_pages)
{
    ck_assert_int_eq (kiln_artcache_mode (NULL), KILN_ARTCACHE_AUTO);
    ck_assert_int_eq (kiln_artcache_mode ("auto"), KILN_ARTCACHE_AUTO);
    ck_assert_int_eq (kiln_artcache_mode (""), KILN_ARTCACHE_AUTO);
    ck_assert_int_eq (kiln_artcache_mode ("0"), KILN_ARTCACHE_READ);
    ck_assert_int_eq (kiln_artcache_mode ("1"), KILN_ARTCACHE_MAP);
    ck_assert_int_eq (kiln_artcache_mode ("yes"), -1);
    ck_assert_int_eq (kiln_artcache_mode ("10"), -1);
    uint64_t gib = 1ull << 30;
    ck_assert_uint_eq (kiln_artcache_read_max (0), gib);
    ck_assert_uint_eq (kiln_artcache_read_max (24 * gib), gib);
    ck_assert_uint_eq (kiln_artcache_read_max (4 * gib), gib / 2);
    ck_assert (!kiln_artcache_maps (KILN_ARTCACHE_AUTO, 400u << 20, 24 * gib));
    ck_assert (!kiln_artcache_maps (KILN_ARTCACHE_AUTO, gib, 24 * gib));
    ck_assert (kiln_artcache_maps (KILN_ARTCACHE_AUTO, gib + 1, 24 * gib));
    ck_assert (kiln_artcache_maps (KILN_ARTCACHE_AUTO, 3 * gib, 0));
    ck_assert (kiln_artcache_maps (KILN_ARTCACHE_AUTO, 600u << 20, 4 * gib));
    ck_assert (kiln_artcache_maps (KILN_ARTCACHE_MAP, 4096, 24 * gib));
    ck_assert (!kiln_artcache_maps (KILN_ARTCACHE_READ, 3 * gib, 24 * gib));

    enum { N = 2, K = 1024, M = 512 };
    int w;
    kiln_graph_t *g = s_matmul_graph (N, K, M, &w);
    float *xv = testlib_rand (N * K);
    const char *path = s_path ("auto.kar");
    s_write_model (g, path, NULL, NULL, NULL);
    kiln_rt_t *mapped_rt;
    kiln_model_t *mapped = s_load_own (path, true, &mapped_rt);
    float *want = s_run1 (mapped, xv, SH (N, M));

    unsetenv ("KILN_RT_MMAP");
    kiln_err_t err = { 0 };
    kiln_rt_t *rt = kiln_rt_new (&err);
    ck_assert_msg (rt, "%s", err.msg);
    kiln_model_t *a = kiln_rt_load (rt, path, s_keys, &err);
    ck_assert_msg (a, "%s", err.msg);
    kiln_model_t *b = kiln_rt_load (rt, path, s_keys, &err);
    ck_assert_msg (b, "%s", err.msg);
    ck_assert_int_eq (kiln_model_weights_mapped (a), 0);
    const uint8_t *wp = kiln_model_weights_ptr (a);
    ck_assert_ptr_eq (kiln_model_weights_ptr (b), wp);
    ck_assert_uint_eq ((uintptr_t) wp % KILN_MEM_HUGE, 0);
    ck_assert_int_eq (kiln_mem_advised_huge (wp), s_thp_kernel ());
    float *ga = s_run1 (a, xv, SH (N, M)), *gb = s_run1 (b, xv, SH (N, M));
    ck_assert (memcmp (ga, want, sizeof (float) * N * M) == 0);
    ck_assert (memcmp (gb, want, sizeof (float) * N * M) == 0);
    free (ga);
    free (gb);
    free (want);
    free (xv);
    kiln_model_destroy (&a);
    kiln_model_destroy (&b);
    kiln_rt_destroy (&rt);
    kiln_model_destroy (&mapped);
    kiln_rt_destroy (&mapped_rt);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_unaligned_artifact_is_read_shared_and_gives_the_same_outputs)
{
    int w1, b1, w2, b2, wl, bl;
    kiln_graph_t *g = s_small_cnn (&w1, &b1, &w2, &b2, &wl, &bl);
    float *x = testlib_rand (2 * 3 * 16 * 16);
    const char *path = s_path ("cnn.kar"), *old = s_path ("old.kar");
    uint8_t *weights;
    size_t wlen;
    /* A provenance of another length moves the old layout's weights by
     * blocks; one of the first few leaves them off a page boundary. */
    long at = 0;
    for (int i = 0; i < 8 && at % 4096 == 0; i++) {
        char prov[4096];
        snprintf (prov, sizeof prov, "{\"pad\":\"%0*d\"}", 1 + 500 * i, 0);
        s_write_model (g, path, prov, &weights, &wlen);
        s_write_unaligned (path, old);
        at = s_weights_offset (old, weights, wlen);
        if (at % 4096 == 0)
            free (weights);
    }
    ck_assert_msg (at % 4096 != 0, "no unaligned layout found");
    float *want = s_run_read_into_memory (path, x);

    kiln_err_t err = { 0 };
    kiln_model_t *a = kiln_rt_load (s_rt, old, s_keys, &err);
    ck_assert_msg (a, "%s", err.msg);
    kiln_model_t *b = kiln_rt_load (s_rt, old, s_keys, &err);
    ck_assert_msg (b, "%s", err.msg);
    ck_assert_int_eq (kiln_model_weights_mapped (a), 0);
    ck_assert_ptr_eq (kiln_model_weights_ptr (a), kiln_model_weights_ptr (b));
    float *ya = s_run1 (a, x, SH (2, 10)), *yb = s_run1 (b, x, SH (2, 10));
    ck_assert (memcmp (ya, want, 20 * sizeof *ya) == 0);
    ck_assert (memcmp (yb, want, 20 * sizeof *yb) == 0);
    kiln_model_destroy (&a);
    kiln_model_destroy (&b);

    /* A file that others may write is read too, not mapped. */
    ck_assert (chmod (path, 0664) == 0);
    a = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_msg (a, "%s", err.msg);
    ck_assert_int_eq (kiln_model_weights_mapped (a), 0);
    float *yg = s_run1 (a, x, SH (2, 10));
    ck_assert (memcmp (yg, want, 20 * sizeof *yg) == 0);
    kiln_model_destroy (&a);

    free (ya);
    free (yb);
    free (yg);
    free (want);
    free (weights);
    free (x);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_load_refuses_a_tampered_weights_byte_also_written_in_place)
{
    int w1, b1, w2, b2, wl, bl;
    kiln_graph_t *g = s_small_cnn (&w1, &b1, &w2, &b2, &wl, &bl);
    const char *path = s_path ("cnn.kar"), *bad = s_path ("bad.kar");
    uint8_t *weights;
    size_t wlen;
    s_write_model (g, path, NULL, &weights, &wlen);
    long at = s_weights_offset (path, weights, wlen) + (long) wlen / 2;

    uint8_t *file;
    size_t flen;
    kiln_err_t err = { 0 };
    ck_assert (kiln_read_file (path, 1 << 26, &file, &flen, &err) == 0);
    file[at] ^= 0x01;
    ck_assert (kiln_write_file_atomic (bad, file, flen, 0644, &err) == 0);
    free (file);
    ck_assert_ptr_null (kiln_rt_load (s_rt, bad, s_keys, &err));
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "member 'weights.bin': sha256 mismatch")
                   && strstr (err.msg, "bad.kar"), "%s", err.msg);

    /* Written in place while a model has it mapped: the next load reads
     * the file afresh and refuses it instead of sharing the mapping.  An
     * mtime in the past makes sure the write moves it, whatever the
     * grain of the file system's clock. */
    struct timespec past[2] = { { .tv_sec = time (NULL) - 3600 },
                                { .tv_sec = time (NULL) - 3600 } };
    ck_assert (utimensat (AT_FDCWD, path, past, 0) == 0);
    kiln_model_t *m = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_msg (m, "%s", err.msg);
    ck_assert_int_eq (kiln_model_weights_mapped (m), 1);
    const uint8_t *pm = kiln_model_weights_ptr (m);
    uint8_t flipped = (uint8_t) (weights[wlen / 2] ^ 0x01);
    int fd = open (path, O_WRONLY);
    ck_assert (fd >= 0);
    ck_assert (pwrite (fd, &flipped, 1, at) == 1);
    close (fd);
    ck_assert_ptr_null (kiln_rt_load (s_rt, path, s_keys, &err));
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    ck_assert_msg (strstr (err.msg, "member 'weights.bin': sha256 mismatch"), "%s", err.msg);
    /* What docs/artifact-format.md says kiln does not protect against:
     * the owner writing the file in place reaches the model already
     * loaded from it (its pages are the file's). */
    ck_assert_uint_eq (pm[wlen / 2], flipped);
    kiln_model_destroy (&m);
    free (weights);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_replaced_artifact_is_loaded_afresh_and_old_models_keep_theirs)
{
    int w1, b1, w2, b2, wl, bl;
    kiln_graph_t *g = s_small_cnn (&w1, &b1, &w2, &b2, &wl, &bl);
    testlib_seed (777);
    kiln_graph_t *h = s_small_cnn (&w1, &b1, &w2, &b2, &wl, &bl);
    float *x = testlib_rand (2 * 3 * 16 * 16);
    const char *path = s_path ("cnn.kar");
    s_write_model (g, path, NULL, NULL, NULL);
    kiln_err_t err = { 0 };
    kiln_model_t *old = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_msg (old, "%s", err.msg);
    float *y_old = s_run1 (old, x, SH (2, 10));

    /* Replaced the way kiln writes files (a new file renamed over it). */
    s_write_model (h, path, NULL, NULL, NULL);
    kiln_model_t *new = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_msg (new, "%s", err.msg);
    ck_assert_ptr_ne (kiln_model_weights_ptr (new), kiln_model_weights_ptr (old));
    float *y_new = s_run1 (new, x, SH (2, 10));
    float *y_again = s_run1 (old, x, SH (2, 10));
    ck_assert (memcmp (y_new, y_old, 20 * sizeof *y_new) != 0);
    ck_assert (memcmp (y_again, y_old, 20 * sizeof *y_old) == 0);
    kiln_model_destroy (&old);
    kiln_model_destroy (&new);
    free (y_old);
    free (y_new);
    free (y_again);
    free (x);
    kiln_graph_destroy (&g);
    kiln_graph_destroy (&h);
}
END_TEST

/* --- refusals ------------------------------------------------------- */

START_TEST (test_run_refuses_wrong_input_shape_and_dtype_naming_the_input)
{
    int w1, b1, w2, b2, wl, bl;
    kiln_graph_t *g = s_small_cnn (&w1, &b1, &w2, &b2, &wl, &bl);
    kiln_model_t *m = s_build (g, NULL, NULL);
    float *xv = testlib_rand (2 * 3 * 16 * 17);
    float yo[20];
    kiln_rt_tensor_t in = { KILN_DT_FLOAT32, SH (2, 3, 16, 17), xv };
    kiln_rt_tensor_t out = { .data = yo };
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_model_run (m, &in, 1, &out, 1, &err), -KILN_ESHAPE);
    ck_assert_msg (strstr (err.msg, "'image'"), "%s", err.msg);
    ck_assert_msg (strstr (err.msg, "expected float32 [2, 3, 16, 16]"), "%s", err.msg);
    ck_assert_msg (strstr (err.msg, "received float32 [2, 3, 16, 17]"), "%s", err.msg);

    in.shape = SH (2, 3, 16, 16);
    in.dtype = KILN_DT_FLOAT64;
    ck_assert_int_eq (kiln_model_run (m, &in, 1, &out, 1, &err), -KILN_ESHAPE);
    ck_assert_msg (strstr (err.msg, "'image'") && strstr (err.msg, "received float64"),
                   "%s", err.msg);

    in.dtype = KILN_DT_FLOAT32;
    ck_assert_int_eq (kiln_model_run (m, &in, 1, &out, 0, &err), -KILN_EINVAL);
    ck_assert_int_eq (kiln_model_run (m, &in, 1, &out, 1, &err), 0);
    free (xv);
    kiln_model_destroy (&m);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_load_refuses_tampered_program_naming_the_member)
{
    int w1, b1, w2, b2, wl, bl;
    kiln_graph_t *g = s_small_cnn (&w1, &b1, &w2, &b2, &wl, &bl);
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_cc_compile (g, NULL, &err);
    ck_assert_msg (art, "%s", err.msg);
    ck_assert (kiln_artifact_sign (art, s_key, NULL, &err) == 0);
    char *path = s_path ("tampered.kar");
    ck_assert (kiln_artifact_write (art, path, &err) == 0);
    size_t plen;
    const uint8_t *prog = kiln_artifact_member (art, KILN_PROGRAM_MEMBER, &plen);

    uint8_t *file;
    size_t flen;
    ck_assert (kiln_read_file (path, 1 << 26, &file, &flen, &err) == 0);
    long at = s_find (file, flen, prog, plen);
    ck_assert_msg (at >= 0, "program.kbin not found in the archive");
    file[at + (long) plen / 2] ^= 0x01;
    ck_assert (kiln_write_file_atomic (path, file, flen, 0644, &err) == 0);
    free (file);

    kiln_model_t *m = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert (m == NULL);
    ck_assert_msg (strstr (err.msg, "program.kbin"), "%s", err.msg);

    /* Unsigned: refused too, before the program is looked at. */
    kiln_artifact_t *u = kiln_cc_compile (g, NULL, &err);
    ck_assert (u);
    ck_assert (kiln_artifact_write (u, s_path ("unsigned.kar"), &err) == 0);
    ck_assert (kiln_rt_load (s_rt, s_path ("unsigned.kar"), s_keys, &err) == NULL);
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    /* Signed by a key that is not in the keyring: refused. */
    kiln_key_t *other = kiln_key_generate (&err);
    ck_assert (kiln_artifact_sign (u, other, NULL, &err) == 0);
    ck_assert (kiln_artifact_write (u, s_path ("other.kar"), &err) == 0);
    ck_assert (kiln_rt_load (s_rt, s_path ("other.kar"), s_keys, &err) == NULL);
    ck_assert_int_eq (err.code, KILN_EVERIFY);
    kiln_key_destroy (&other);
    kiln_artifact_destroy (&u);
    kiln_artifact_destroy (&art);
    kiln_graph_destroy (&g);
}
END_TEST

/* Rebuild `src` with `prog` as its program, signed with the test key, and
 * write it; returns the path. */
static char *
s_resign (kiln_artifact_t *src, const uint8_t *prog, size_t len)
{
    char *path = s_path ("resigned-%d.kar", s_files++);
    testlib_resign (src, prog, len, s_key, path);
    return path;
}

typedef void (*mutate_fn) (kiln_program_t *p);

static int
s_find_op (kiln_program_t *p, kiln_kernel_t k)
{
    for (int i = 0; i < p->n_ops; i++)
        if (p->ops[i].kernel == k)
            return i;
    ck_abort_msg ("no %s op", kiln_kernel_name (k));
    return -1;
}

static kiln_prog_param_t *
s_param (kiln_program_t *p, kiln_kernel_t k, const char *name)
{
    kiln_prog_op_t *op = &p->ops[s_find_op (p, k)];
    for (int i = 0; i < op->n_params; i++)
        if (strcmp (op->params[i].name, name) == 0)
            return &op->params[i];
    ck_abort_msg ("no parameter %s", name);
    return NULL;
}

static void m_offset_past_arena (kiln_program_t *p) { p->tensors[p->ops[0].outputs[0]].offset = p->arena_size; }
static void m_size_lies (kiln_program_t *p) { p->tensors[0].size += 4; }
static void m_bad_input_index (kiln_program_t *p) { p->ops[0].inputs[0] = p->n_tensors; }
static void m_conv_stride (kiln_program_t *p) { s_param (p, KILN_K_CONV2D, "strides")->ints[1] = 3; }
static void m_conv_group (kiln_program_t *p) { s_param (p, KILN_K_CONV2D, "group")->i = 0; }
static void m_gemm_k (kiln_program_t *p) { s_param (p, KILN_K_GEMM, "k")->i = 17; }
static void m_pool_kernel (kiln_program_t *p) { s_param (p, KILN_K_MAXPOOL2D, "kernel")->ints[0] = 1000000; }
static void m_no_scratch (kiln_program_t *p) { p->ops[s_find_op (p, KILN_K_CONV2D)].scratch = -1; }
static void m_write_weight (kiln_program_t *p)
{
    kiln_prog_op_t *op = &p->ops[s_find_op (p, KILN_K_CONV2D)];
    op->outputs[0] = op->inputs[1];
}
static void m_unknown_param (kiln_program_t *p)
{
    kiln_err_t err;
    ck_assert (kiln_prog_op_set_int (&p->ops[0], "fused_activation", 1, &err) == 0);
}
static void m_arena_huge (kiln_program_t *p) { p->arena_size = KILN_PROG_MAX_ARENA_BYTES + 64; }
static void m_arena_oversized (kiln_program_t *p) { p->arena_size += 1 << 20; }
static void m_input_shape (kiln_program_t *p) { p->tensors[p->inputs[0]].shape.dims[3] = 8;
                                                p->tensors[p->inputs[0]].size /= 2; }
static void m_weight_past_end (kiln_program_t *p)
{
    for (int i = 0; i < p->n_tensors; i++)
        if (p->tensors[i].kind == KILN_TK_WEIGHT) {
            p->tensors[i].offset += 1 << 20;
            return;
        }
}
static void m_kernel_swap (kiln_program_t *p) { p->ops[s_find_op (p, KILN_K_CONV2D)].kernel = KILN_K_GEMM; }
static void m_dim_broken (kiln_program_t *p) { p->tensors[p->ops[0].outputs[0]].shape.dims[0] = -1; }
static void m_output_list (kiln_program_t *p) { p->outputs[0] = -5; }

START_TEST (test_load_refuses_malformed_programs_under_a_valid_signature)
{
    struct { mutate_fn fn; const char *want; } cases[] = {
        { m_offset_past_arena, "outside the arena" },
        { m_size_lies, "does not match" },
        { m_bad_input_index, "names tensor" },
        { m_conv_stride, "does not follow from the window" },
        { m_conv_group, "group" },
        { m_gemm_k, "A holds 32 elements, expected 34" },
        { m_pool_kernel, "does not follow from the window" },
        { m_no_scratch, "scratch" },
        { m_write_weight, "writes weight" },
        { m_unknown_param, "unknown parameter 'fused_activation'" },
        { m_arena_huge, "arena size" },
        { m_arena_oversized, "larger than its tensors need" },
        { m_input_shape, "the manifest says" },
        { m_weight_past_end, "outside weights.bin" },
        { m_kernel_swap, "gemm" },
        { m_dim_broken, "dimension 0" },
        { m_output_list, "program output 0" },
    };
    int w1, b1, w2, b2, wl, bl;
    kiln_graph_t *g = s_small_cnn (&w1, &b1, &w2, &b2, &wl, &bl);
    kiln_err_t err = { 0 };
    /* -O1: the convolutions use im2col and its workspace (the packed
     * forms of -O2 have their own cases below). */
    kiln_artifact_t *art = kiln_cc_compile (g, "--optlevel 1", &err);
    ck_assert_msg (art, "%s", err.msg);
    size_t plen, wlen;
    const uint8_t *prog = kiln_artifact_member (art, KILN_PROGRAM_MEMBER, &plen);
    kiln_artifact_member (art, KILN_WEIGHTS_MEMBER, &wlen);

    /* The unmodified program, re-signed, loads: the harness is sound. */
    kiln_model_t *m = kiln_rt_load (s_rt, s_resign (art, prog, plen), s_keys, &err);
    ck_assert_msg (m, "%s", err.msg);
    kiln_model_destroy (&m);

    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_program_t *p = kiln_program_decode (prog, plen, wlen, &err);
        ck_assert_msg (p, "%s", err.msg);
        cases[i].fn (p);
        uint8_t *bytes;
        size_t len;
        ck_assert (kiln_program_encode (p, &bytes, &len, &err) == 0);
        kiln_program_destroy (&p);
        m = kiln_rt_load (s_rt, s_resign (art, bytes, len), s_keys, &err);
        free (bytes);
        ck_assert_msg (m == NULL, "case %zu (%s) was accepted", i, cases[i].want);
        ck_assert_msg (strstr (err.msg, cases[i].want) && strstr (err.msg, "program.kbin"),
                       "case %zu: '%s' lacks '%s'", i, err.msg, cases[i].want);
    }

    /* Raw bytes: truncated, trailing garbage, not msgpack at all. */
    m = kiln_rt_load (s_rt, s_resign (art, prog, plen - 7), s_keys, &err);
    ck_assert (m == NULL);
    uint8_t *longer = malloc (plen + 3);
    memcpy (longer, prog, plen);
    memcpy (longer + plen, "xyz", 3);
    m = kiln_rt_load (s_rt, s_resign (art, longer, plen + 3), s_keys, &err);
    ck_assert (m == NULL);
    ck_assert_msg (strstr (err.msg, "trailing"), "%s", err.msg);
    free (longer);
    m = kiln_rt_load (s_rt, s_resign (art, (const uint8_t *) "hello", 5), s_keys, &err);
    ck_assert (m == NULL);
    kiln_artifact_destroy (&art);
    kiln_graph_destroy (&g);
}
END_TEST

/* Random byte mutations of a valid program under a valid signature: each
 * is refused with an error or, if it still makes sense, runs; nothing
 * crashes (run under valgrind or ASan to see it). */
START_TEST (test_mutated_programs_never_crash_the_runtime)
{
    int w1, b1, w2, b2, wl, bl;
    kiln_graph_t *g = s_small_cnn (&w1, &b1, &w2, &b2, &wl, &bl);
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_cc_compile (g, NULL, &err);
    ck_assert_msg (art, "%s", err.msg);
    size_t plen;
    const uint8_t *prog = kiln_artifact_member (art, KILN_PROGRAM_MEMBER, &plen);
    uint8_t *mut = malloc (plen);
    float *xv = testlib_rand (2 * 3 * 16 * 16);
    float yo[20];
    int loaded = 0, refused = 0;
    const int rounds = getenv ("KILN_FUZZ_ROUNDS") ? atoi (getenv ("KILN_FUZZ_ROUNDS")) : 150;
    for (int r = 0; r < rounds; r++) {
        uint8_t *bytes = mut;
        size_t len = plen;
        if (r % 2 == 0) {
            /* Bytes: mostly breaks the structure or a field's type. */
            memcpy (mut, prog, plen);
            int flips = 1 + r % 3;
            for (int f = 0; f < flips; f++) {
                size_t at = (testlib_randu () >> 4) % plen;
                mut[at] = (uint8_t) (testlib_randu () >> 9);
            }
        } else {
            /* Values: a parameter or a shape changed to an unlucky number
             * while the format stays valid, which reaches the kernels'
             * own checks. */
            static const int64_t odd[] = { 0, 1, 2, 3, -1, 7, 64, 1 << 20,
                                           INT32_MAX, INT64_MAX };
            kiln_program_t *p = kiln_program_decode (prog, plen, UINT64_MAX, &err);
            ck_assert_msg (p, "%s", err.msg);
            int64_t v = odd[(testlib_randu () >> 7) % (sizeof odd / sizeof odd[0])];
            unsigned u = testlib_randu ();
            if (r % 4 == 1) {
                kiln_prog_op_t *op = &p->ops[(u >> 5) % (unsigned) p->n_ops];
                if (op->n_params) {
                    kiln_prog_param_t *pp = &op->params[(u >> 11) % (unsigned) op->n_params];
                    if (pp->kind == KILN_PP_INT)
                        pp->i = v;
                    else if (pp->kind == KILN_PP_INTS && pp->n)
                        pp->ints[(u >> 13) % (unsigned) pp->n] = v;
                    else
                        pp->f = (double) v;
                }
            } else {
                kiln_prog_tensor_t *t = &p->tensors[(u >> 5) % (unsigned) p->n_tensors];
                if (t->shape.rank && v >= 0 && v < 1 << 20) {
                    t->shape.dims[(u >> 11) % (unsigned) t->shape.rank] = v;
                    kiln_shape_bytes (&t->shape, t->dtype, "t", &t->size, &err);
                }
            }
            ck_assert (kiln_program_encode (p, &bytes, &len, &err) == 0);
            kiln_program_destroy (&p);
        }
        kiln_model_t *m = kiln_rt_load (s_rt, s_resign (art, bytes, len), s_keys, &err);
        if (bytes != mut)
            free (bytes);
        if (!m) {
            refused++;
            ck_assert (err.msg[0]);
            if (getenv ("KILN_FUZZ_VERBOSE"))
                printf ("refused: %s\n", strstr (err.msg, "program.kbin")
                                          ? strstr (err.msg, "program.kbin") : err.msg);
            continue;
        }
        loaded++;
        kiln_rt_tensor_t in = { KILN_DT_FLOAT32, SH (2, 3, 16, 16), xv };
        kiln_rt_tensor_t out = { .data = yo };
        const kiln_manifest_t *man = kiln_model_manifest (m);
        if (man->n_inputs == 1 && man->n_outputs == 1)
            kiln_model_run (m, &in, 1, &out, 1, &err);
        kiln_model_destroy (&m);
    }
    ck_assert (refused > 0);
    printf ("program mutations: %d refused, %d loaded and ran\n", refused, loaded);
    free (xv);
    free (mut);
    kiln_artifact_destroy (&art);
    kiln_graph_destroy (&g);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("runtime");
    TCase *tc = tcase_create ("runtime");
    tcase_set_timeout (tc, 120);
    tcase_add_checked_fixture (tc, setup, teardown);
    tcase_add_test (tc, test_conv2d_matches_direct_convolution);
    tcase_add_test (tc, test_conv1d_matches_direct_convolution);
    tcase_add_test (tc, test_gemm_matches_naive_product);
    tcase_add_test (tc, test_matmul_batched_and_broadcast_matches_naive_product);
    tcase_add_test (tc, test_binary_ops_broadcast_like_numpy);
    tcase_add_test (tc, test_maxpool_with_pads_strides_dilations_ceil_matches_naive);
    tcase_add_test (tc, test_avgpool_2x2_stride_2_is_the_double_sum);
    tcase_add_test (tc, test_avgpool_with_pads_strides_dilations_ceil_matches_naive);
    tcase_add_test (tc, test_global_average_pool_matches_mean);
    tcase_add_test (tc, test_small_cnn_matches_reference_and_reuses_memory);
    tcase_add_test (tc, test_views_alias_or_copy_with_same_result);
    tcase_add_test (tc, test_seed_function_two_x_plus_y);
    tcase_add_test (tc, test_model_io_structure_is_the_manifests_or_null);
    tcase_add_test (tc, test_concurrent_runs_of_one_model_agree);
    tcase_add_test (tc, test_replicas_share_one_mapping_of_the_weights_with_the_same_outputs);
    tcase_add_test (tc, test_large_buffers_are_on_advised_huge_pages);
    tcase_add_test (tc, test_default_reads_artifacts_up_to_a_bound_onto_huge_pages);
    tcase_add_test (tc, test_unaligned_artifact_is_read_shared_and_gives_the_same_outputs);
    tcase_add_test (tc, test_load_refuses_a_tampered_weights_byte_also_written_in_place);
    tcase_add_test (tc, test_replaced_artifact_is_loaded_afresh_and_old_models_keep_theirs);
    tcase_add_test (tc, test_run_refuses_wrong_input_shape_and_dtype_naming_the_input);
    tcase_add_test (tc, test_load_refuses_tampered_program_naming_the_member);
    tcase_add_test (tc, test_load_refuses_malformed_programs_under_a_valid_signature);
    tcase_add_test (tc, test_mutated_programs_never_crash_the_runtime);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run_in_tmpdir (s_suite (), "runtime");
}
