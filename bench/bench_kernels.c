/*
 * bench_kernels — one convolution or matrix product through a kernel
 * library, for bench/bench_kernels.py, which times kiln's own kernels on
 * the same shapes and data beside it.  Not part of kiln.
 *
 *   bench_kernels LIB conv C H W O KH KW STRIDE PAD GROUPS DIR ITERS
 *   bench_kernels LIB gemm M K N DIR ITERS
 *
 * LIB is onednn, xnnpack (both: conv and gemm), onednn-nchw (conv, with
 * the activations in NCHW as kiln keeps them), blis or openblas (gemm).
 * DIR holds x.bin, w.bin and b.bin, float32: the input (NCHW, batch 1; or
 * M x K), the weights (O x C/GROUPS x KH x KW; or N x K, as a linear
 * layer holds them) and the bias (O or N).  Each library gets the data in
 * the layout it prefers (oneDNN picks its own blocked layouts, XNNPACK
 * wants NHWC), converted before the clock starts and back after it stops;
 * the output goes to DIR/LIB.out.bin in NCHW (or M x N), for the driver
 * to compare with torch.  Prints one JSON object: the median wall time
 * and the process CPU time per run, in ms, over ITERS runs after a
 * warm-up.  One thread: OMP_NUM_THREADS=1 for oneDNN, no thread pool for
 * XNNPACK, the serial builds of BLIS and OpenBLAS (the driver sets them).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>
#include <xnnpack.h>

#define S_MAX_ITERS 100000
#define S_MAX_DIM   (1 << 16)
#define S_MAX_ELEMS ((size_t) 1 << 28)

typedef struct {
    bool conv;
    long c, h, w, o, kh, kw, stride, pad, groups;   /* conv */
    long m, k, n;                                   /* gemm */
    long oh, ow;
    const char *dir;
    long iters;
} s_shape_t;

typedef struct {
    float *x, *w, *b, *y;
    size_t nx, nw, nb, ny;
} s_data_t;

static void
s_die (const char *msg, const char *what)
{
    fprintf (stderr, "bench_kernels: %s%s%s\n", msg, what ? ": " : "", what ? what : "");
    exit (1);
}

static float *
s_load (const char *dir, const char *name, size_t n)
{
    char path[4096];
    snprintf (path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen (path, "rb");
    if (!f)
        s_die (strerror (errno), path);
    float *p = aligned_alloc (64, (n * sizeof (float) + 63) / 64 * 64);
    if (!p || fread (p, sizeof (float), n, f) != n || fgetc (f) != EOF)
        s_die ("wrong size or out of memory", path);
    fclose (f);
    return p;
}

static void
s_save (const s_shape_t *s, const char *lib, const float *y, size_t n)
{
    char path[4096];
    snprintf (path, sizeof path, "%s/%s.out.bin", s->dir, lib);
    FILE *f = fopen (path, "wb");
    if (!f || fwrite (y, sizeof (float), n, f) != n || fclose (f) != 0)
        s_die ("could not write", path);
}

static double
s_now_ms (clockid_t clock)
{
    struct timespec ts;
    clock_gettime (clock, &ts);
    return (double) ts.tv_sec * 1e3 + (double) ts.tv_nsec / 1e6;
}

static int
s_cmp (const void *a, const void *b)
{
    double x = *(const double *) a, y = *(const double *) b;
    return x < y ? -1 : x > y;
}

/* Time `run` ITERS times after a warm-up; print the JSON line. */
static void
s_time (const s_shape_t *s, void (*run) (void *), void *ctx)
{
    long warm = s->iters / 10 < 2 ? 2 : s->iters / 10;
    for (long i = 0; i < warm; i++)
        run (ctx);
    double *t = malloc ((size_t) s->iters * sizeof *t);
    if (!t)
        s_die ("out of memory", NULL);
    double cpu0 = s_now_ms (CLOCK_PROCESS_CPUTIME_ID);
    for (long i = 0; i < s->iters; i++) {
        double t0 = s_now_ms (CLOCK_MONOTONIC);
        run (ctx);
        t[i] = s_now_ms (CLOCK_MONOTONIC) - t0;
    }
    double cpu = (s_now_ms (CLOCK_PROCESS_CPUTIME_ID) - cpu0) / (double) s->iters;
    qsort (t, (size_t) s->iters, sizeof *t, s_cmp);
    double sum = 0;
    for (long i = 0; i < s->iters; i++)
        sum += t[i];
    printf ("{\"median_ms\":%.5f,\"min_ms\":%.5f,\"mean_ms\":%.5f,\"cpu_ms\":%.5f}\n",
            t[s->iters / 2], t[0], sum / (double) s->iters, cpu);
    free (t);
}

/* ---- oneDNN ---------------------------------------------------------- */

typedef struct {
    dnnl_primitive_t prim;
    dnnl_stream_t stream;
    dnnl_exec_arg_t args[4];
    int nargs;
} s_dnnl_t;

static void
s_dnnl_check (dnnl_status_t st, const char *what)
{
    if (st != dnnl_success)
        s_die ("oneDNN failed", what);
}

static void
s_dnnl_run (void *ctx)
{
    s_dnnl_t *d = ctx;
    s_dnnl_check (dnnl_primitive_execute (d->prim, d->stream, d->nargs, d->args), "execute");
    s_dnnl_check (dnnl_stream_wait (d->stream), "wait");
}

/* A memory of layout `want` holding `data` given in layout `have`. */
static dnnl_memory_t
s_dnnl_in (dnnl_engine_t eng, dnnl_stream_t st, const dnnl_memory_desc_t *have,
           const dnnl_memory_desc_t *want, float *data)
{
    dnnl_memory_t user, mem;
    s_dnnl_check (dnnl_memory_create (&user, have, eng, data), "memory");
    s_dnnl_check (dnnl_memory_create (&mem, want, eng, DNNL_MEMORY_ALLOCATE), "memory");
    dnnl_primitive_desc_t rpd;
    dnnl_primitive_t r;
    s_dnnl_check (dnnl_reorder_primitive_desc_create (&rpd, have, eng, want, eng, NULL),
                  "reorder");
    s_dnnl_check (dnnl_primitive_create (&r, rpd), "reorder");
    dnnl_exec_arg_t a[2] = { { DNNL_ARG_FROM, user }, { DNNL_ARG_TO, mem } };
    s_dnnl_check (dnnl_primitive_execute (r, st, 2, a), "reorder");
    s_dnnl_check (dnnl_stream_wait (st), "reorder");
    dnnl_primitive_destroy (r);
    dnnl_primitive_desc_destroy (rpd);
    dnnl_memory_destroy (user);
    return mem;
}

static void
s_onednn (const s_shape_t *s, s_data_t *d, bool plain)
{
    dnnl_engine_t eng;
    s_dnnl_t r = { 0 };
    s_dnnl_check (dnnl_engine_create (&eng, dnnl_cpu, 0), "engine");
    s_dnnl_check (dnnl_stream_create (&r.stream, eng, dnnl_stream_default_flags), "stream");
    dnnl_memory_desc_t src_u, w_u, b_u, dst_u, src_a, w_a, dst_a;
    dnnl_primitive_desc_t pd;
    if (s->conv) {
        dnnl_dims_t src = { 1, s->c, s->h, s->w }, dst = { 1, s->o, s->oh, s->ow };
        dnnl_dims_t wg = { s->groups, s->o / s->groups, s->c / s->groups, s->kh, s->kw };
        dnnl_dims_t w1 = { s->o, s->c, s->kh, s->kw }, bias = { s->o };
        dnnl_dims_t strides = { s->stride, s->stride }, pad = { s->pad, s->pad };
        bool g = s->groups > 1;
        dnnl_memory_desc_init_by_tag (&src_u, 4, src, dnnl_f32, dnnl_nchw);
        dnnl_memory_desc_init_by_tag (&w_u, g ? 5 : 4, g ? wg : w1, dnnl_f32,
                                      g ? dnnl_goihw : dnnl_oihw);
        dnnl_memory_desc_init_by_tag (&b_u, 1, bias, dnnl_f32, dnnl_x);
        dnnl_memory_desc_init_by_tag (&dst_u, 4, dst, dnnl_f32, dnnl_nchw);
        //  onednn-nchw: the activations in NCHW, as kiln keeps them.
        dnnl_format_tag_t act = plain ? dnnl_nchw : dnnl_format_tag_any;
        dnnl_memory_desc_init_by_tag (&src_a, 4, src, dnnl_f32, act);
        dnnl_memory_desc_init_by_tag (&w_a, g ? 5 : 4, g ? wg : w1, dnnl_f32,
                                      dnnl_format_tag_any);
        dnnl_memory_desc_init_by_tag (&dst_a, 4, dst, dnnl_f32, act);
        dnnl_convolution_desc_t cd;
        s_dnnl_check (dnnl_convolution_forward_desc_init (&cd, dnnl_forward_inference,
                                                          dnnl_convolution_auto, &src_a,
                                                          &w_a, &b_u, &dst_a, strides,
                                                          pad, pad), "convolution");
        s_dnnl_check (dnnl_primitive_desc_create (&pd, &cd, NULL, eng, NULL), "convolution");
    }
    else {
        dnnl_dims_t src = { s->m, s->k }, w = { s->k, s->n }, bias = { 1, s->n };
        dnnl_dims_t dst = { s->m, s->n };
        dnnl_memory_desc_init_by_tag (&src_u, 2, src, dnnl_f32, dnnl_ab);
        //  The weights come as N x K: K x N in "ba" order is the same bytes.
        dnnl_memory_desc_init_by_tag (&w_u, 2, w, dnnl_f32, dnnl_ba);
        dnnl_memory_desc_init_by_tag (&b_u, 2, bias, dnnl_f32, dnnl_ab);
        dnnl_memory_desc_init_by_tag (&dst_u, 2, dst, dnnl_f32, dnnl_ab);
        src_a = src_u;
        dst_a = dst_u;
        dnnl_memory_desc_init_by_tag (&w_a, 2, w, dnnl_f32, dnnl_format_tag_any);
        dnnl_matmul_desc_t md;
        s_dnnl_check (dnnl_matmul_desc_init (&md, &src_a, &w_a, &b_u, &dst_a), "matmul");
        s_dnnl_check (dnnl_primitive_desc_create (&pd, &md, NULL, eng, NULL), "matmul");
    }
    const dnnl_memory_desc_t *src_p = dnnl_primitive_desc_query_md (pd, dnnl_query_src_md, 0);
    const dnnl_memory_desc_t *w_p = dnnl_primitive_desc_query_md (pd, dnnl_query_weights_md, 0);
    const dnnl_memory_desc_t *dst_p = dnnl_primitive_desc_query_md (pd, dnnl_query_dst_md, 0);
    dnnl_memory_t src_m = s_dnnl_in (eng, r.stream, &src_u, src_p, d->x);
    dnnl_memory_t w_m = s_dnnl_in (eng, r.stream, &w_u, w_p, d->w);
    dnnl_memory_t b_m, dst_m;
    s_dnnl_check (dnnl_memory_create (&b_m, &b_u, eng, d->b), "memory");
    s_dnnl_check (dnnl_memory_create (&dst_m, dst_p, eng, DNNL_MEMORY_ALLOCATE), "memory");
    s_dnnl_check (dnnl_primitive_create (&r.prim, pd), "primitive");
    r.args[0] = (dnnl_exec_arg_t) { DNNL_ARG_SRC, src_m };
    r.args[1] = (dnnl_exec_arg_t) { DNNL_ARG_WEIGHTS, w_m };
    r.args[2] = (dnnl_exec_arg_t) { DNNL_ARG_BIAS, b_m };
    r.args[3] = (dnnl_exec_arg_t) { DNNL_ARG_DST, dst_m };
    r.nargs = 4;
    s_time (s, s_dnnl_run, &r);
    //  The result back in plain layout, for the driver's check.
    dnnl_memory_t out;
    s_dnnl_check (dnnl_memory_create (&out, &dst_u, eng, d->y), "memory");
    dnnl_primitive_desc_t rpd;
    dnnl_primitive_t rp;
    s_dnnl_check (dnnl_reorder_primitive_desc_create (&rpd, dst_p, eng, &dst_u, eng, NULL),
                  "reorder");
    s_dnnl_check (dnnl_primitive_create (&rp, rpd), "reorder");
    dnnl_exec_arg_t a[2] = { { DNNL_ARG_FROM, dst_m }, { DNNL_ARG_TO, out } };
    s_dnnl_check (dnnl_primitive_execute (rp, r.stream, 2, a), "reorder");
    s_dnnl_check (dnnl_stream_wait (r.stream), "reorder");
}

/* ---- XNNPACK ---------------------------------------------------------- */

static void
s_xnn_run (void *ctx)
{
    if (xnn_run_operator ((xnn_operator_t) ctx, NULL) != xnn_status_success)
        s_die ("XNNPACK failed", "run");
}

static void
s_xnnpack (const s_shape_t *s, s_data_t *d)
{
    if (xnn_initialize (NULL) != xnn_status_success)
        s_die ("XNNPACK failed", "initialize");
    xnn_operator_t op = NULL;
    if (s->conv) {
        long g = s->groups, cg = s->c / g, og = s->o / g, hw = s->h * s->w;
        long ohw = s->oh * s->ow, taps = s->kh * s->kw;
        //  Input NCHW -> NHWC; weights O x CG x KH x KW -> O x KH x KW x CG.
        float *x = malloc ((size_t) (s->c * hw) * sizeof *x);
        float *w = malloc (d->nw * sizeof *w);
        float *y = malloc (d->ny * sizeof *y);
        if (!x || !w || !y)
            s_die ("out of memory", NULL);
        for (long c = 0; c < s->c; c++)
            for (long p = 0; p < hw; p++)
                x[p * s->c + c] = d->x[c * hw + p];
        for (long o = 0; o < s->o; o++)
            for (long c = 0; c < cg; c++)
                for (long t = 0; t < taps; t++)
                    w[(o * taps + t) * cg + c] = d->w[(o * cg + c) * taps + t];
        if (xnn_create_convolution2d_nhwc_f32 (
                (uint32_t) s->pad, (uint32_t) s->pad, (uint32_t) s->pad, (uint32_t) s->pad,
                (uint32_t) s->kh, (uint32_t) s->kw, (uint32_t) s->stride,
                (uint32_t) s->stride, 1, 1, (uint32_t) g, (size_t) cg, (size_t) og,
                (size_t) s->c, (size_t) s->o, w, d->b, -INFINITY, INFINITY, 0, &op)
                != xnn_status_success
            || xnn_setup_convolution2d_nhwc_f32 (op, 1, (size_t) s->h, (size_t) s->w, x, y,
                                                 NULL) != xnn_status_success)
            s_die ("XNNPACK failed", "convolution");
        s_time (s, s_xnn_run, op);
        for (long o = 0; o < s->o; o++)
            for (long p = 0; p < ohw; p++)
                d->y[o * ohw + p] = y[p * s->o + o];
    }
    else {
        if (xnn_create_fully_connected_nc_f32 ((size_t) s->k, (size_t) s->n, (size_t) s->k,
                                               (size_t) s->n, d->w, d->b, -INFINITY,
                                               INFINITY, 0, &op) != xnn_status_success
            || xnn_setup_fully_connected_nc_f32 (op, (size_t) s->m, d->x, d->y, NULL)
                   != xnn_status_success)
            s_die ("XNNPACK failed", "fully connected");
        s_time (s, s_xnn_run, op);
    }
}

/* ---- BLAS: OpenBLAS (linked) and BLIS (loaded on its own) -------------- */

typedef void (*s_sgemm_fn) (enum CBLAS_ORDER, enum CBLAS_TRANSPOSE, enum CBLAS_TRANSPOSE,
                            blasint, blasint, blasint, float, const float *, blasint,
                            const float *, blasint, float, float *, blasint);

typedef struct {
    s_sgemm_fn sgemm;
    const s_shape_t *s;
    s_data_t *d;
} s_blas_t;

static void
s_blas_run (void *ctx)
{
    s_blas_t *b = ctx;
    const s_shape_t *s = b->s;
    //  Bias first, then C += X W^T, as a BLAS user would write a linear layer.
    for (long i = 0; i < s->m; i++)
        memcpy (b->d->y + i * s->n, b->d->b, (size_t) s->n * sizeof (float));
    b->sgemm (CblasRowMajor, CblasNoTrans, CblasTrans, (blasint) s->m, (blasint) s->n,
              (blasint) s->k, 1.0f, b->d->x, (blasint) s->k, b->d->w, (blasint) s->k, 1.0f,
              b->d->y, (blasint) s->n);
}

static void
s_blas (const s_shape_t *s, s_data_t *d, const char *blis_path)
{
    s_blas_t b = { cblas_sgemm, s, d };
    if (blis_path) {
        void *h = dlopen (blis_path, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
        if (!h)
            s_die ("could not load BLIS", dlerror ());
        b.sgemm = (s_sgemm_fn) dlsym (h, "cblas_sgemm");
        if (!b.sgemm)
            s_die ("BLIS has no cblas_sgemm", blis_path);
    }
    s_time (s, s_blas_run, &b);
}

/* ---- main --------------------------------------------------------------- */

static long
s_arg (const char *a, long lo, long hi)
{
    char *end;
    errno = 0;
    long v = strtol (a, &end, 10);
    if (errno || *end || end == a || v < lo || v > hi)
        s_die ("argument out of range", a);
    return v;
}

int
main (int argc, char **argv)
{
    s_shape_t s = { 0 };
    if (argc == 14 && strcmp (argv[2], "conv") == 0) {
        s.conv = true;
        long *f[] = { &s.c, &s.h, &s.w, &s.o, &s.kh, &s.kw, &s.stride, &s.pad, &s.groups };
        for (int i = 0; i < 9; i++)
            *f[i] = s_arg (argv[3 + i], i == 7 ? 0 : 1, S_MAX_DIM);
        if (s.c % s.groups || s.o % s.groups)
            s_die ("channels not divisible by groups", NULL);
        s.oh = (s.h + 2 * s.pad - s.kh) / s.stride + 1;
        s.ow = (s.w + 2 * s.pad - s.kw) / s.stride + 1;
        if (s.h + 2 * s.pad < s.kh || s.w + 2 * s.pad < s.kw)
            s_die ("kernel larger than the padded input", NULL);
        s.dir = argv[12];
        s.iters = s_arg (argv[13], 1, S_MAX_ITERS);
    }
    else if (argc == 8 && strcmp (argv[2], "gemm") == 0) {
        s.m = s_arg (argv[3], 1, S_MAX_DIM);
        s.k = s_arg (argv[4], 1, S_MAX_DIM);
        s.n = s_arg (argv[5], 1, S_MAX_DIM);
        s.dir = argv[6];
        s.iters = s_arg (argv[7], 1, S_MAX_ITERS);
    }
    else {
        fprintf (stderr, "usage: bench_kernels LIB conv C H W O KH KW STRIDE PAD GROUPS DIR "
                 "ITERS\n       bench_kernels LIB gemm M K N DIR ITERS\n");
        return 2;
    }
    s_data_t d;
    if (s.conv) {
        d.nx = (size_t) (s.c * s.h * s.w);
        d.nw = (size_t) (s.o * (s.c / s.groups) * s.kh * s.kw);
        d.nb = (size_t) s.o;
        d.ny = (size_t) (s.o * s.oh * s.ow);
    }
    else {
        d.nx = (size_t) (s.m * s.k);
        d.nw = (size_t) (s.n * s.k);
        d.nb = (size_t) s.n;
        d.ny = (size_t) (s.m * s.n);
    }
    if (d.nx > S_MAX_ELEMS || d.nw > S_MAX_ELEMS || d.ny > S_MAX_ELEMS)
        s_die ("shape too large", NULL);
    d.x = s_load (s.dir, "x.bin", d.nx);
    d.w = s_load (s.dir, "w.bin", d.nw);
    d.b = s_load (s.dir, "b.bin", d.nb);
    d.y = calloc (d.ny, sizeof (float));
    if (!d.y)
        s_die ("out of memory", NULL);
    const char *lib = argv[1];
    if (strcmp (lib, "onednn") == 0 || (s.conv && strcmp (lib, "onednn-nchw") == 0))
        s_onednn (&s, &d, strcmp (lib, "onednn") != 0);
    else if (strcmp (lib, "xnnpack") == 0)
        s_xnnpack (&s, &d);
    else if (!s.conv && strcmp (lib, "openblas") == 0)
        s_blas (&s, &d, NULL);
    else if (!s.conv && strcmp (lib, "blis") == 0) {
        const char *p = getenv ("BENCH_BLIS_LIB");
        if (!p)
            s_die ("BENCH_BLIS_LIB names BLIS's libblis.so", NULL);
        s_blas (&s, &d, p);
    }
    else
        s_die ("unknown library for this op", lib);
    s_save (&s, lib, d.y, d.ny);
    return 0;
}
