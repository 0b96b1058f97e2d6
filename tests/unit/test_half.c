/*
 * Unit tests for half precision (float16 and bfloat16): the conversions
 * to and from float32 (common/kiln_half.h, the vectorised rows of
 * runtime/kiln_convert.c) against a reference computed here from the
 * formats' definitions, in double; the matrix engine's half weights
 * (runtime/kiln_gemm.c) against a double product; and half graphs
 * through the compiler and the runtime: weights stored and shipped in 2
 * bytes, a product's half weight packed as it is, every op's half
 * result rounded as torch rounds it.
 *
 * Tests that pick a micro-kernel (KILN_RT_ISA) set it before the first
 * use in their own process (Check forks per test), as test_engine.c's
 * do: each ISA this CPU has is checked, AVX-512 and AVX2 both.  Under
 * CK_FORK=no they run with whatever the process picked first, which
 * still checks the results.
 */
#include <check.h>

#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kiln_half.h"
#include "common/kiln_pack.h"
#include "common/kiln_program.h"
#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"
#include "runtime/kiln_convert.h"
#include "runtime/kiln_exec.h"
#include "runtime/kiln_gemm.h"
#include "runtime/kiln_rt.h"
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
    s_dir = testlib_keydir ("kiln-test-half-", s_keys, &s_key);
    s_rt = kiln_rt_new (&err);
    ck_assert_msg (s_rt, "%s", err.msg);
    testlib_seed (1616);
    s_files = 0;
}

static void
teardown (void)
{
    kiln_rt_destroy (&s_rt);
    kiln_key_destroy (&s_key);
    testlib_rmdir (&s_dir);
}

/* --- the reference: the formats by their definitions, in double -------- */

/* One 2-byte float format: exponent bits and fraction bits. */
typedef struct {
    kiln_dtype_t dt;
    const char *name;
    int ebits, mbits;
} s_fmt_t;

static const s_fmt_t s_f16 = { KILN_DT_FLOAT16, "float16", 5, 10 };
static const s_fmt_t s_bf16 = { KILN_DT_BFLOAT16, "bfloat16", 8, 7 };

static uint16_t
s_inf_bits (const s_fmt_t *f)
{
    return (uint16_t) (((1u << f->ebits) - 1) << f->mbits);
}

/* The value of positive pattern p; the infinity pattern and beyond as if
 * the exponent went on (the value that rounding to infinity is measured
 * against). */
static double
s_ref_value (const s_fmt_t *f, uint32_t p)
{
    int bias = (1 << (f->ebits - 1)) - 1;
    uint32_t e = p >> f->mbits, m = p & ((1u << f->mbits) - 1);
    if (e == 0)
        return ldexp ((double) m, 1 - bias - f->mbits);
    return ldexp ((double) ((1u << f->mbits) + m), (int) e - bias - f->mbits);
}

/* Bits to double: NaN and infinities by the pattern. */
static double
s_ref_widen (const s_fmt_t *f, uint16_t h)
{
    uint16_t mag = h & 0x7fffu, inf = s_inf_bits (f);
    double v = mag > inf ? NAN : mag == inf ? INFINITY : s_ref_value (f, mag);
    return h & 0x8000u ? -v : v;
}

/* A non-NaN float to the nearest pattern, ties to the even one, found by
 * bisection over the positive patterns (their values grow with them). */
static uint16_t
s_ref_narrow (const s_fmt_t *f, float x)
{
    uint16_t sign = signbit (x) ? 0x8000u : 0;
    double a = fabs ((double) x);
    uint32_t inf = s_inf_bits (f);
    if (isinf (x))
        return (uint16_t) (sign | inf);
    uint32_t lo = 0, hi = inf;          /* value(lo) <= a < value(hi) */
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (s_ref_value (f, mid) <= a)
            lo = mid;
        else
            hi = mid;
    }
    double d0 = a - s_ref_value (f, lo), d1 = s_ref_value (f, lo + 1) - a;
    uint32_t p = d0 < d1 ? lo : d1 < d0 ? lo + 1 : (lo & 1u) ? lo + 1 : lo;
    return (uint16_t) (sign | (p > inf ? inf : p));
}

/* The quiet bit of a NaN pattern. */
static uint16_t
s_quiet_bit (const s_fmt_t *f)
{
    return (uint16_t) (1u << (f->mbits - 1));
}

static float
s_bits_f (uint32_t b)
{
    float f;
    memcpy (&f, &b, sizeof f);
    return f;
}

static uint32_t
s_f_bits (float f)
{
    uint32_t b;
    memcpy (&b, &f, sizeof b);
    return b;
}

/* --- conversions ------------------------------------------------------- */

/* Floats that matter to rounding: zeros, subnormals of float32 (which
 * AVX512_BF16 would flush), the ties and near-ties around half values,
 * the edges of float16's range, infinities, NaNs of both signs and both
 * kinds; then random bit patterns. */
static float *
s_probe_floats (int64_t *n_out)
{
    static const uint32_t special[] = {
        0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u, 0x00008000u,
        0x00018000u, 0x00007fffu, 0x007fffffu, 0x807fffffu, 0x00800000u,
        0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f80ffffu, 0x7f7fffffu,
        0xff7fffffu, 0x7f7f8000u, 0x7f7f7fffu, 0x477fe000u, 0x477fefffu,
        0x477ff000u, 0x477fffffu, 0x47800000u, 0x387fc000u, 0x38800000u,
        0x33000000u, 0x33000001u, 0x32ffffffu, 0x33800000u, 0x33c00000u,
        0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u,
        0xff800001u, 0x7fa00000u, 0x7fffffffu, 0x3f800000u, 0xbf800000u,
    };
    int64_t ns = (int64_t) (sizeof special / sizeof special[0]);
    int64_t n = ns + 2 * 65536 + 200000;
    float *x = malloc ((size_t) n * sizeof *x);
    int64_t k = 0;
    for (int64_t i = 0; i < ns; i++)
        x[k++] = s_bits_f (special[i]);
    /* every float16 value and the midpoint above it: ties in float16,
     * and (the midpoints being off bfloat16's grid) rounding in both */
    for (uint32_t h = 0; h < 65536; h++) {
        float v = kiln_f16_to_f32 ((uint16_t) h);
        x[k++] = v;
        x[k++] = isfinite (v) ? (float) (s_ref_widen (&s_f16, (uint16_t) h)
                                         + ldexp (1.0, -25)) : v;
    }
    while (k < n)
        x[k++] = s_bits_f (testlib_randu ());
    *n_out = n;
    return x;
}

/* The conversions of kiln_convert.h on `fmt`, in chunks of 1 to 37
 * elements at shifting offsets (every vector body and tail), against the
 * reference. */
static void
s_check_conversions (const s_fmt_t *f)
{
    int64_t n;
    float *x = s_probe_floats (&n);
    uint16_t *h = malloc ((size_t) n * sizeof *h);
    float *r = malloc ((size_t) n * sizeof *r);
    for (int64_t at = 0, len = 1; at < n; at += len, len = len % 37 + 1) {
        int64_t m = at + len <= n ? len : n - at;
        kiln_convert_narrow (f->dt, x + at, h + at, m);
        kiln_convert_round (f->dt, x + at, r + at, m);
    }
    for (int64_t i = 0; i < n; i++) {
        if (isnan (x[i])) {
            uint16_t inf = s_inf_bits (f);
            ck_assert_msg ((h[i] & 0x7fffu) > inf && (h[i] & s_quiet_bit (f))
                           && (h[i] >> 15) == (s_f_bits (x[i]) >> 31),
                           "%s: NaN %08x narrowed to %04x", f->name, s_f_bits (x[i]),
                           h[i]);
            ck_assert_msg (isnan (r[i]), "%s: NaN %08x rounded to %08x", f->name,
                           s_f_bits (x[i]), s_f_bits (r[i]));
            continue;
        }
        uint16_t want = s_ref_narrow (f, x[i]);
        ck_assert_msg (h[i] == want, "%s on %s: %08x (%.9g) narrowed to %04x, expected "
                       "%04x", kiln_convert_isa (), f->name, s_f_bits (x[i]),
                       (double) x[i], h[i], want);
        float wr = (float) s_ref_widen (f, want);
        ck_assert_msg (s_f_bits (r[i]) == s_f_bits (wr), "%s on %s: %08x rounded to "
                       "%08x, expected %08x", kiln_convert_isa (), f->name,
                       s_f_bits (x[i]), s_f_bits (r[i]), s_f_bits (wr));
    }
    /* every pattern widened: exact, a NaN stays NaN of its sign */
    uint16_t *all = malloc (65536 * sizeof *all);
    float *w = malloc (65536 * sizeof *w);
    for (uint32_t i = 0; i < 65536; i++)
        all[i] = (uint16_t) i;
    for (int64_t at = 0, len = 1; at < 65536; at += len, len = len % 37 + 1)
        kiln_convert_widen (f->dt, all + at, w + at, at + len <= 65536 ? len : 65536 - at);
    for (uint32_t i = 0; i < 65536; i++) {
        double want = s_ref_widen (f, (uint16_t) i);
        if (isnan (want))
            ck_assert_msg (isnan (w[i]) && (signbit (w[i]) != 0) == (i >> 15 != 0),
                           "%s: NaN %04x widened to %08x", f->name, i, s_f_bits (w[i]));
        else
            ck_assert_msg (s_f_bits (w[i]) == s_f_bits ((float) want),
                           "%s on %s: %04x widened to %08x (%.9g), expected %.9g",
                           kiln_convert_isa (), f->name, i, s_f_bits (w[i]),
                           (double) w[i], want);
    }
    /* the scalar conversions every other file uses give the same bits */
    for (int64_t i = 0; i < n; i++) {
        uint16_t s = f->dt == KILN_DT_FLOAT16 ? kiln_f32_to_f16 (x[i])
                                               : kiln_f32_to_bf16 (x[i]);
        ck_assert_msg (s == h[i], "%s: scalar %04x, vector %04x for %08x", f->name, s,
                       h[i], s_f_bits (x[i]));
    }
    free (x); free (h); free (r); free (all); free (w);
}

static void
s_check_isa (const char *isa)
{
    setenv ("KILN_RT_ISA", isa, 1);
    /* the loops asked for run when the CPU has them; a CPU without them
     * falls back to narrower ones, which are checked all the same */
    __builtin_cpu_init ();
    bool has = strcmp (isa, "generic") == 0
               || (strcmp (isa, "avx2") == 0 && __builtin_cpu_supports ("avx2")
                   && __builtin_cpu_supports ("fma") && __builtin_cpu_supports ("f16c"))
               || (strcmp (isa, "avx512") == 0 && __builtin_cpu_supports ("avx512f"));
    const char *fork = getenv ("CK_FORK");
    if (has && !(fork && strcmp (fork, "no") == 0))
        ck_assert_str_eq (kiln_convert_isa (), isa);
    s_check_conversions (&s_f16);
    s_check_conversions (&s_bf16);
}

START_TEST (test_half_conversions_match_the_reference_generic)
{
    s_check_isa ("generic");
}
END_TEST

START_TEST (test_half_conversions_match_the_reference_avx2)
{
    s_check_isa ("avx2");
}
END_TEST

START_TEST (test_half_conversions_match_the_reference_avx512)
{
    s_check_isa ("avx512");
}
END_TEST

/* --- the engine's half weights ---------------------------------------- */

/* C = relu(A·B + bias) with B a half weight packed as it is, A read in
 * place (a transformer's activations: the weight's panels widened one at
 * a time) or pre-packed (the whole block widened per tile), against the
 * product of the widened values in double. */
static void
s_check_half_product (const s_fmt_t *f, int64_t m, int64_t n, int64_t k)
{
    float *a = testlib_rand (m * k), *bias = testlib_rand (n);
    uint16_t *b = malloc ((size_t) (k * n + 1) * sizeof *b);
    for (int64_t i = 0; i < k * n; i++)
        b[i] = s_ref_narrow (f, testlib_randf ());
    int64_t ae, be;
    ck_assert (kiln_pack_a_elems (m, k, &ae) && kiln_pack_b_elems (k, n, &be));
    float *ap = calloc ((size_t) ae + 1, sizeof *ap);
    uint16_t *bp = calloc ((size_t) be + 1, sizeof *bp);
    kiln_pack_a (a, m, k, k, 1, ap);
    kiln_pack_b_u16 (b, k, n, n, 1, bp);
    float *c = malloc ((size_t) (m * n + 1) * sizeof *c);
    for (int form = 0; form < 2; form++) {
        kiln_gemm_t g = { .m = m, .n = n, .k = k, .c = c, .ldc = n, .alpha = 1.0f,
                          .b_half = f->dt, .act = KILN_ACT_RELU };
        g.a = form == 0 ? (kiln_gsrc_t) { KILN_GSRC_STRIDED, a, k, 1, NULL }
                        : (kiln_gsrc_t) { KILN_GSRC_PACKED, ap, 0, 0, NULL };
        g.b = (kiln_gsrc_t) { KILN_GSRC_PACKED, (const float *) (const void *) bp, 0, 0,
                              NULL };
        g.add[g.n_add++] = (kiln_gadd_t) { bias, 0, 1, 1.0f };
        for (int64_t i = 0; i < m * n; i++)
            c[i] = NAN;             /* every element must be written */
        testlib_gemm (&g);
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                double sum = bias[j], mag = fabs (bias[j]);
                for (int64_t q = 0; q < k; q++) {
                    double v = (double) a[i * k + q] * s_ref_widen (f, b[q * n + j]);
                    sum += v;
                    mag += fabs (v);
                }
                sum = sum < 0 ? 0 : sum;
                ck_assert_msg (fabs (c[i * n + j] - sum) <= 1e-5 * (mag + 4.0),
                               "%s, %s B, A %s, %lldx%lldx%lld: C[%lld, %lld] = %.8g, "
                               "expected %.8g", kiln_gemm_isa (), f->name,
                               form ? "packed" : "in place", (long long) m, (long long) n,
                               (long long) k, (long long) i, (long long) j,
                               (double) c[i * n + j], sum);
            }
    }
    free (a); free (bias); free (b); free (ap); free (bp); free (c);
}

static void
s_check_half_engine (const char *isa)
{
    setenv ("KILN_RT_ISA", isa, 1);
    static const int64_t shapes[][3] = {
        { 1, 1, 1 }, { 7, 33, 5 }, { 8, 32, 256 }, { 13, 70, 300 },
        { 40, 17, 1100 },   /* k blocks */
        { 64, 520, 256 },   /* the shape Strassen takes for float32 */
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        s_check_half_product (&s_bf16, shapes[i][0], shapes[i][1], shapes[i][2]);
        s_check_half_product (&s_f16, shapes[i][0], shapes[i][1], shapes[i][2]);
    }
}

START_TEST (test_half_weight_products_match_double_generic)
{
    s_check_half_engine ("generic");
}
END_TEST

START_TEST (test_half_weight_products_match_double_avx2)
{
    s_check_half_engine ("avx2");
}
END_TEST

START_TEST (test_half_weight_products_match_double_avx512)
{
    s_check_half_engine ("avx512");
}
END_TEST

/* --- half graphs through the compiler and the runtime ------------------ */

/* A constant of `f`'s type holding random values in [-scale, scale),
 * rounded; its bits in *bits when not NULL (caller frees). */
static int
s_half_const (kiln_graph_t *g, const s_fmt_t *f, const char *name, kiln_shape_t shape,
              float scale, uint16_t **bits)
{
    kiln_err_t err;
    int t = kiln_graph_add_tensor (g, name, f->dt, &shape, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    int64_t n = testlib_numel (&shape);
    uint16_t *d = malloc ((size_t) (n ? n : 1) * 2);
    for (int64_t i = 0; i < n; i++)
        d[i] = s_ref_narrow (f, scale * testlib_randf ());
    if (bits) {
        *bits = malloc ((size_t) (n ? n : 1) * 2);
        memcpy (*bits, d, (size_t) n * 2);
    }
    uint8_t *data = (uint8_t *) d;
    ck_assert_msg (kiln_graph_set_weight (g, t, &data, (uint64_t) n * 2, &err) == 0,
                   "%s", err.msg);
    return t;
}

/* Compile at `args`, sign, write and load; the program too (caller
 * destroys it) and weights.bin's size. */
static kiln_model_t *
s_build (kiln_graph_t *g, const char *args, kiln_program_t **prog, size_t *weights)
{
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_cc_compile (g, args, &err);
    ck_assert_msg (art, "compile %s: %s", args, err.msg);
    if (prog)
        *prog = testlib_program_of (art);
    if (weights)
        ck_assert (kiln_artifact_member (art, KILN_WEIGHTS_MEMBER, weights));
    char path[PATH_MAX];
    snprintf (path, sizeof path, "%s/m%d.kar", s_dir, s_files++);
    testlib_sign_write (&art, s_key, path);
    kiln_model_t *m = kiln_rt_load (s_rt, path, s_keys, &err);
    ck_assert_msg (m, "load %s: %s", args, err.msg);
    return m;
}

/* The largest number of elements of a float32 tensor of the program. */
static int64_t
s_largest_f32 (const kiln_program_t *p)
{
    int64_t most = 0;
    for (int i = 0; i < p->n_tensors; i++)
        if (p->tensors[i].dtype == KILN_DT_FLOAT32
            && testlib_numel (&p->tensors[i].shape) > most)
            most = testlib_numel (&p->tensors[i].shape);
    return most;
}

/* An MLP as torch exports one in bfloat16 or float16: x [m, k] → MatMul
 * with w1 [k, h] → Add b1 → Relu → Gemm with w2ᵀ ([o, h], transB) and
 * b2 → y, every tensor of `f`'s type.  The reference computes each node
 * in double and rounds its result to the type, as torch does. */
static void
s_check_mlp (const s_fmt_t *f)
{
    enum { M = 6, K = 96, H = 160, O = 40 };
    kiln_graph_t *g = kiln_graph_new ();
    uint16_t *w1, *b1, *w2, *b2;
    int x = testlib_input_dt (g, "x", f->dt, SH (M, K));
    int tw1 = s_half_const (g, f, "w1", SH (K, H), 0.1f, &w1);
    int tb1 = s_half_const (g, f, "b1", SH (H), 0.5f, &b1);
    int tw2 = s_half_const (g, f, "w2", SH (O, H), 0.1f, &w2);
    int tb2 = s_half_const (g, f, "b2", SH (O), 0.5f, &b2);
    int t[4];
    testlib_tensors (g, t, 3);
    int y = testlib_tensor (g, "y");
    testlib_node (g, "MatMul", "mm", (int[]) { x, tw1 }, 2, t[0]);
    testlib_node (g, "Add", "bias", (int[]) { t[0], tb1 }, 2, t[1]);
    testlib_node (g, "Relu", "relu", &t[1], 1, t[2]);
    int gemm = testlib_node (g, "Gemm", "fc", (int[]) { t[2], tw2, tb2 }, 3, y);
    testlib_int (g, gemm, "transB", 1);
    testlib_output (g, y);

    uint16_t xb[M * K], want[M * O];
    for (int i = 0; i < M * K; i++)
        xb[i] = s_ref_narrow (f, testlib_randf ());
    double big = 0;
    for (int i = 0; i < M; i++) {
        double hid[H];
        for (int j = 0; j < H; j++) {
            double s = 0;
            for (int q = 0; q < K; q++)
                s += s_ref_widen (f, xb[i * K + q]) * s_ref_widen (f, w1[q * H + j]);
            double v = s_ref_widen (f, s_ref_narrow (f, (float) s));
            v = s_ref_widen (f, s_ref_narrow (f, (float) (v + s_ref_widen (f, b1[j]))));
            hid[j] = v < 0 ? 0 : v;
        }
        for (int j = 0; j < O; j++) {
            double s = s_ref_widen (f, b2[j]);
            for (int q = 0; q < H; q++)
                s += hid[q] * s_ref_widen (f, w2[j * H + q]);
            want[i * O + j] = s_ref_narrow (f, (float) s);
            big = fmax (big, fabs (s_ref_widen (f, want[i * O + j])));
        }
    }

    /* the same MLP in float32, for the size of its weights */
    kiln_graph_t *g32 = kiln_graph_new ();
    int x32 = testlib_input (g32, "x", SH (M, K));
    int v32[4] = { testlib_weight (g32, "w1", SH (K, H)), testlib_weight (g32, "b1", SH (H)),
                   testlib_weight (g32, "w2", SH (O, H)), testlib_weight (g32, "b2", SH (O)) };
    int u[3], y32 = testlib_tensor (g32, "y");
    testlib_tensors (g32, u, 3);
    testlib_node (g32, "MatMul", "mm", (int[]) { x32, v32[0] }, 2, u[0]);
    testlib_node (g32, "Add", "bias", (int[]) { u[0], v32[1] }, 2, u[1]);
    testlib_node (g32, "Relu", "relu", &u[1], 1, u[2]);
    testlib_int (g32, testlib_node (g32, "Gemm", "fc", (int[]) { u[2], v32[2], v32[3] }, 3,
                                    y32), "transB", 1);
    testlib_output (g32, y32);
    size_t w32_bytes;
    kiln_model_t *m32 = s_build (g32, "--optlevel 2", NULL, &w32_bytes);
    kiln_model_destroy (&m32);
    kiln_graph_destroy (&g32);

    const char *levels[] = { "--optlevel 0", "--optlevel 1", "--optlevel 2" };
    for (int l = 0; l < 3; l++) {
        kiln_program_t *p;
        size_t wbytes;
        kiln_model_t *m = s_build (g, levels[l], &p, &wbytes);
        /* the manifest says what the model takes and gives */
        const kiln_manifest_t *man = kiln_model_manifest (m);
        ck_assert_int_eq (man->inputs[0].dtype, f->dt);
        ck_assert_int_eq (man->outputs[0].dtype, f->dt);
        /* the weights are stored in 2 bytes: about half of float32's */
        ck_assert_msg (wbytes * 10 < w32_bytes * 6, "%s %s: weights.bin %zu bytes, "
                       "float32's %zu", f->name, levels[l], wbytes, w32_bytes);
        if (l == 2) {
            /* both products read their half weight packed as it is, and
             * no float32 copy of a weight is made in the arena */
            int packed = 0;
            for (int i = 0; i < p->n_ops; i++) {
                const kiln_prog_op_t *op = &p->ops[i];
                if (op->kernel != KILN_K_MATMUL && op->kernel != KILN_K_GEMM)
                    continue;
                ck_assert_int_eq (p->tensors[op->inputs[1]].dtype, f->dt);
                ck_assert_int_eq (p->tensors[op->inputs[1]].kind, KILN_TK_WEIGHT);
                packed++;
            }
            ck_assert_int_eq (packed, 2);
            ck_assert_int_lt (s_largest_f32 (p), H * O);
        }
        uint16_t got[M * O];
        kiln_rt_tensor_t in = { f->dt, man->inputs[0].shape, xb };
        kiln_rt_tensor_t out = { f->dt, man->outputs[0].shape, got };
        kiln_err_t err = { 0 };
        ck_assert_msg (kiln_model_run (m, &in, 1, &out, 1, &err) == 0, "%s", err.msg);
        /* The engine sums in float32, the reference in double: where a
         * sum lies within float32's error of a rounding boundary of the
         * half type the two round apart, by one unit of the half type,
         * which the next product carries on.  So: a few elements may
         * differ, none by more than two units at the output's largest
         * magnitude (2^-7 of it for bfloat16, 2^-10 for float16). */
        int same = 0;
        double worst = 0, unit = ldexp (big, -f->mbits);
        for (int i = 0; i < M * O; i++) {
            same += got[i] == want[i];
            worst = fmax (worst, fabs (s_ref_widen (f, got[i]) - s_ref_widen (f, want[i])));
        }
        ck_assert_msg (worst <= 2 * unit, "%s %s: max error %.4g, %.3g units", f->name,
                       levels[l], worst, worst / unit);
        ck_assert_msg (same * 10 >= M * O * 9, "%s %s: %d of %d elements as the "
                       "reference", f->name, levels[l], same, M * O);
        kiln_program_destroy (&p);
        kiln_model_destroy (&m);
    }
    free (w1); free (b1); free (w2); free (b2);
    kiln_graph_destroy (&g);
}

START_TEST (test_half_mlp_stores_two_byte_weights_and_rounds_every_op_bfloat16)
{
    s_check_mlp (&s_bf16);
}
END_TEST

START_TEST (test_half_mlp_stores_two_byte_weights_and_rounds_every_op_float16)
{
    s_check_mlp (&s_f16);
}
END_TEST

START_TEST (test_half_embedding_is_gathered_as_stored)
{
    /* a bfloat16 table gathered by int64 ids: the rows come out exact,
     * and the table is never widened in the arena */
    enum { V = 1000, D = 64, N = 5 };
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err;
    uint16_t *table;
    int tab = s_half_const (g, &s_bf16, "table", SH (V, D), 3.0f, &table);
    int ids = testlib_input_dt (g, "ids", KILN_DT_INT64, SH (N));
    int y = testlib_tensor (g, "y");
    testlib_node (g, "Gather", "embed", (int[]) { tab, ids }, 2, y);
    testlib_output (g, y);
    kiln_program_t *p;
    size_t wbytes;
    kiln_model_t *m = s_build (g, NULL, &p, &wbytes);
    ck_assert_uint_lt (wbytes, (size_t) V * D * 2 + 4096);
    ck_assert_int_lt (s_largest_f32 (p), V * D);
    int64_t idv[N] = { 0, 999, 17, -1, 500 };
    uint16_t got[N * D];
    const kiln_manifest_t *man = kiln_model_manifest (m);
    kiln_rt_tensor_t in = { KILN_DT_INT64, man->inputs[0].shape, idv };
    kiln_rt_tensor_t out = { KILN_DT_BFLOAT16, man->outputs[0].shape, got };
    ck_assert_msg (kiln_model_run (m, &in, 1, &out, 1, &err) == 0, "%s", err.msg);
    for (int i = 0; i < N; i++) {
        int64_t row = idv[i] < 0 ? idv[i] + V : idv[i];
        ck_assert_msg (memcmp (got + i * D, table + row * D, D * 2) == 0,
                       "row %lld differs", (long long) idv[i]);
    }
    kiln_program_destroy (&p);
    kiln_model_destroy (&m);
    free (table);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_half_casts_round_once_to_nearest_even)
{
    /* float32 → bfloat16 → float32 and float32 → float16 → bfloat16 →
     * float32: each cast to a half type rounds once, each one from it is
     * exact, as the reference says */
    enum { N = 4096 };
    kiln_graph_t *g = kiln_graph_new ();
    int x = testlib_input (g, "x", SH (N));
    int t[5];
    testlib_tensors (g, t, 5);
    int cast[5][3] = { { x, t[0], KILN_DT_BFLOAT16 }, { t[0], t[1], KILN_DT_FLOAT32 },
                       { x, t[2], KILN_DT_FLOAT16 }, { t[2], t[3], KILN_DT_BFLOAT16 },
                       { t[3], t[4], KILN_DT_FLOAT32 } };
    for (int i = 0; i < 5; i++) {
        char name[16];
        snprintf (name, sizeof name, "cast%d", i);
        testlib_int (g, testlib_node (g, "Cast", name, &cast[i][0], 1, cast[i][1]), "to",
                     cast[i][2]);
    }
    testlib_output (g, t[1]);
    testlib_output (g, t[4]);
    testlib_output (g, t[0]);
    kiln_model_t *m = s_build (g, NULL, NULL, NULL);
    float xv[N], a[N], b[N];
    uint16_t c[N];
    for (int i = 0; i < N; i++)
        xv[i] = i < 64 ? s_bits_f (0x3f808000u + (uint32_t) i * 0x4000u)  /* ties */
                       : s_bits_f (testlib_randu ());
    const kiln_manifest_t *man = kiln_model_manifest (m);
    kiln_rt_tensor_t in = { KILN_DT_FLOAT32, man->inputs[0].shape, xv };
    kiln_rt_tensor_t out[3] = { { KILN_DT_FLOAT32, man->outputs[0].shape, a },
                                { KILN_DT_FLOAT32, man->outputs[1].shape, b },
                                { KILN_DT_BFLOAT16, man->outputs[2].shape, c } };
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_model_run (m, &in, 1, out, 3, &err) == 0, "%s", err.msg);
    for (int i = 0; i < N; i++) {
        if (isnan (xv[i])) {
            ck_assert (isnan (a[i]) && isnan (b[i]));
            continue;
        }
        uint16_t bf = s_ref_narrow (&s_bf16, xv[i]);
        float via = (float) s_ref_widen (&s_f16, s_ref_narrow (&s_f16, xv[i]));
        float want_b = (float) s_ref_widen (&s_bf16, s_ref_narrow (&s_bf16, via));
        ck_assert_msg (c[i] == bf, "%08x cast to bfloat16 %04x, expected %04x",
                       s_f_bits (xv[i]), c[i], bf);
        ck_assert_msg (s_f_bits (a[i]) == s_f_bits ((float) s_ref_widen (&s_bf16, bf)),
                       "%08x through bfloat16: %08x", s_f_bits (xv[i]), s_f_bits (a[i]));
        ck_assert_msg (s_f_bits (b[i]) == s_f_bits (want_b), "%08x through float16 and "
                       "bfloat16: %08x, expected %08x", s_f_bits (xv[i]), s_f_bits (b[i]),
                       s_f_bits (want_b));
    }
    kiln_model_destroy (&m);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_half_weight_reaches_float32_ops_only_through_a_cast)
{
    /* A bfloat16 graph whose every value is half: the program's kernels
     * see float32 (the runtime refuses a half operand anywhere but a
     * packed B), and a half graph output comes out as bfloat16 bits. */
    kiln_graph_t *g = kiln_graph_new ();
    int x = testlib_input_dt (g, "x", KILN_DT_BFLOAT16, SH (3, 8));
    int s = s_half_const (g, &s_bf16, "scale", SH (8), 1.0f, NULL);
    int t = testlib_tensor (g, "t"), y = testlib_tensor (g, "y");
    testlib_node (g, "Mul", "mul", (int[]) { x, s }, 2, t);
    testlib_node (g, "Softmax", "softmax", &t, 1, y);
    testlib_output (g, y);
    kiln_program_t *p;
    kiln_model_t *m = s_build (g, NULL, &p, NULL);
    for (int i = 0; i < p->n_ops; i++) {
        const kiln_prog_op_t *op = &p->ops[i];
        if (op->kernel == KILN_K_CAST)
            continue;
        for (int j = 0; j < op->n_inputs; j++)
            ck_assert_int_eq (p->tensors[op->inputs[j]].dtype, KILN_DT_FLOAT32);
        ck_assert_int_eq (p->tensors[op->outputs[0]].dtype, KILN_DT_FLOAT32);
    }
    int rounds = 0;
    for (int i = 0; i < p->n_ops; i++)
        rounds += p->ops[i].kernel == KILN_K_ROUND_HALF;
    ck_assert_int_eq (rounds, 2);       /* after the Mul and the Softmax */
    kiln_program_destroy (&p);
    kiln_model_destroy (&m);
    kiln_graph_destroy (&g);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("half");
    TCase *tc = tcase_create ("core");
    tcase_add_checked_fixture (tc, setup, teardown);
    tcase_set_timeout (tc, 120);
    tcase_add_test (tc, test_half_conversions_match_the_reference_generic);
    tcase_add_test (tc, test_half_conversions_match_the_reference_avx2);
    tcase_add_test (tc, test_half_conversions_match_the_reference_avx512);
    tcase_add_test (tc, test_half_weight_products_match_double_generic);
    tcase_add_test (tc, test_half_weight_products_match_double_avx2);
    tcase_add_test (tc, test_half_weight_products_match_double_avx512);
    tcase_add_test (tc, test_half_mlp_stores_two_byte_weights_and_rounds_every_op_bfloat16);
    tcase_add_test (tc, test_half_mlp_stores_two_byte_weights_and_rounds_every_op_float16);
    tcase_add_test (tc, test_half_embedding_is_gathered_as_stored);
    tcase_add_test (tc, test_half_casts_round_once_to_nearest_even);
    tcase_add_test (tc, test_half_weight_reaches_float32_ops_only_through_a_cast);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run_in_tmpdir (s_suite (), "test_half");
}
