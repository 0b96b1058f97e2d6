/*
 * kiln_vmath — vectorised transcendental loops; see kiln_vmath.h.
 *
 * exp: x = n·ln2 + r with |r| <= ln2/2 (n by the round-to-nearest magic
 * constant, r by Cody and Waite's two-part ln2), e^r by Cephes' degree-6
 * polynomial, then scaled by 2^n as two exact multiplications by powers
 * of two so that results down into the subnormals are right.
 */
#include "runtime/kiln_vmath.h"

#include "runtime/kiln_gemm.h"

#include <math.h>
#include <string.h>

#define S_CLONES KILN_VCLONES

static inline float
s_bits_to_float (int32_t i)
{
    float f;
    memcpy (&f, &i, sizeof f);
    return f;
}

/* e^x for finite x in [-104, 89]; the callers handle the rest (a NaN
 * is computed as 0 here, so that no conversion or shift below is
 * undefined, and replaced by the caller). */
static inline float
s_exp_core (float x)
{
    x = x != x ? 0.0f : x;
    const float magic = 12582912.0f;            /* 1.5 · 2^23 */
    float n = (x * 1.44269504088896341f + magic) - magic;
    float r = x - n * 0.693359375f;             /* ln2, high part (exact) */
    r = r - n * -2.12194440e-4f;                /* ln2, low part */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t j = (int32_t) n;                    /* -150 .. 128 */
    int32_t j1 = j / 2, j2 = j - j1;            /* each in -75 .. 64 */
    float s1 = s_bits_to_float ((int32_t) ((uint32_t) (j1 + 127) << 23));
    float s2 = s_bits_to_float ((int32_t) ((uint32_t) (j2 + 127) << 23));
    return p * s1 * s2;
}

static inline float
s_exp (float x)
{
    float c = x < -104.0f ? -104.0f : x;
    c = c > 89.0f ? 89.0f : c;
    float e = s_exp_core (c);
    e = x > 88.7228394f ? INFINITY : e;
    e = x < -103.972694f ? 0.0f : e;
    return x != x ? x : e;
}

S_CLONES void
kiln_vexp (const float *restrict x, float *restrict y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = s_exp (x[i]);
}

/* 1 / (1 + e^-x); e^-x overflows to infinity below -88.7, giving 0. */
S_CLONES void
kiln_vsigmoid (const float *restrict x, float *restrict y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        y[i] = 1.0f / (1.0f + s_exp (-v));
    }
}

/* tanh: an odd polynomial near 0 (where 1 - 2/(e^2x + 1) would lose the
 * relative accuracy), that formula elsewhere, ±1 beyond 9. */
S_CLONES void
kiln_vtanh (const float *restrict x, float *restrict y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float v = x[i], a = fabsf (v);
        float z = v * v;
        /* Cephes tanhf, |x| < 0.625 */
        float p = -5.70498872745e-3f;
        p = p * z + 2.06390887954e-2f;
        p = p * z - 5.37397155531e-2f;
        p = p * z + 1.33314422036e-1f;
        p = p * z - 3.33332819422e-1f;
        float small = v + v * z * p;
        float c = a > 9.0f ? 9.0f : a;
        float big = 1.0f - 2.0f / (s_exp_core (2.0f * c) + 1.0f);
        big = v < 0.0f ? -big : big;
        float r = a < 0.625f ? small : big;
        y[i] = v != v ? v : r;
    }
}

/* erf: for |x| < 0.84375 fdlibm's x + x·P(x²)/Q(x²) (relative accuracy
 * near 0); up to 2.5 a rational 1 - Q(|x|-1) ... (fdlibm's erx + P/Q);
 * beyond, 1 - e^(-x²)·R(1/x²)/|x| with the exponential split exactly as
 * fdlibm does (e^(-z²-0.5625) e^((z-x)(z+x)+R/S)); ±1 from 4 on. */
S_CLONES void
kiln_verf (const float *restrict x, float *restrict y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float v = x[i], a = fabsf (v);
        /* |x| < 0.84375 */
        float z = v * v;
        float pp = -2.3763017452e-05f;
        pp = pp * z - 5.7702702470e-03f;
        pp = pp * z - 2.8481749818e-02f;
        pp = pp * z - 3.2504209876e-01f;
        pp = pp * z + 1.2837916613e-01f;
        float qq = -3.9602282413e-06f;
        qq = qq * z + 1.3249473704e-04f;
        qq = qq * z + 5.0813062117e-03f;
        qq = qq * z + 6.5022252500e-02f;
        qq = qq * z + 3.9791721106e-01f;
        qq = qq * z + 1.0f;
        float r0 = v + v * (pp / qq);
        /* 0.84375 <= |x| < 1.25 */
        float s = a - 1.0f;
        float P = -2.1663755178e-03f;
        P = P * s + 3.5478305072e-02f;
        P = P * s - 1.1089469492e-01f;
        P = P * s + 3.1834661961e-01f;
        P = P * s - 3.7220788002e-01f;
        P = P * s + 4.1485610604e-01f;
        P = P * s - 2.3621185683e-03f;
        float Q = 1.1984500103e-02f;
        Q = Q * s + 1.3637083583e-02f;
        Q = Q * s + 1.2617121637e-01f;
        Q = Q * s + 7.1828655899e-02f;
        Q = Q * s + 5.4039794207e-01f;
        Q = Q * s + 1.0642088205e-01f;
        Q = Q * s + 1.0f;
        float r1 = 8.4506291151e-01f + P / Q;
        /* 1.25 <= |x| < 4: 1 - exp(-x^2 - 0.5625 + R/S) / |x| */
        float ca = a < 1.25f ? 1.25f : a > 4.0f ? 4.0f : a;
        float t = 1.0f / (ca * ca);
        float R, S;
        {
            /* 1.25 <= |x| < 1/0.35 */
            float Ra = -9.8143291473e+00f;
            Ra = Ra * t - 8.1287437439e+01f;
            Ra = Ra * t - 1.8460508728e+02f;
            Ra = Ra * t - 1.6239666748e+02f;
            Ra = Ra * t - 6.2375331879e+01f;
            Ra = Ra * t - 1.0558626175e+01f;
            Ra = Ra * t - 6.9385856390e-01f;
            Ra = Ra * t - 9.8649440333e-03f;
            float Sa = -6.0424413532e-02f;
            Sa = Sa * t + 6.5702495575e+00f;
            Sa = Sa * t + 1.0863500214e+02f;
            Sa = Sa * t + 4.2900814819e+02f;
            Sa = Sa * t + 6.4538726807e+02f;
            Sa = Sa * t + 4.3456588745e+02f;
            Sa = Sa * t + 1.3765776062e+02f;
            Sa = Sa * t + 1.9651271820e+01f;
            Sa = Sa * t + 1.0f;
            /* 1/0.35 <= |x| < 6 */
            float Rb = -4.8351919556e+02f;
            Rb = Rb * t - 1.0250950928e+03f;
            Rb = Rb * t - 6.3756646729e+02f;
            Rb = Rb * t - 1.6063638306e+02f;
            Rb = Rb * t - 1.7757955551e+01f;
            Rb = Rb * t - 7.9928326607e-01f;
            Rb = Rb * t - 9.8649431020e-03f;
            float Sb = -2.2440952301e+01f;
            Sb = Sb * t + 4.7452853394e+02f;
            Sb = Sb * t + 2.5530502930e+03f;
            Sb = Sb * t + 3.1998581543e+03f;
            Sb = Sb * t + 1.5367296143e+03f;
            Sb = Sb * t + 3.2579251099e+02f;
            Sb = Sb * t + 3.0338060379e+01f;
            Sb = Sb * t + 1.0f;
            bool lo = ca < 2.85714293f;
            R = lo ? Ra : Rb;
            S = lo ? Sa : Sb;
        }
        /* z = ca with its low 12 bits cleared, as fdlibm does, so that
         * e^(-z²) is exact in its argument */
        int32_t zb;
        memcpy (&zb, &ca, sizeof zb);
        float zt = s_bits_to_float (zb & (int32_t) 0xfffff000);
        float e = s_exp_core (-zt * zt - 0.5625f)
                  * s_exp_core ((zt - ca) * (zt + ca) + R / S);
        float r2 = 1.0f - e / ca;
        float hi = a < 4.0f ? r2 : 1.0f;
        hi = a < 1.25f ? r1 : hi;
        hi = copysignf (hi, v);
        float r = a < 0.84375f ? r0 : hi;
        y[i] = v != v ? v : r;
    }
}

/* Lanes of the partial maxima and sums: wide enough for any vector
 * unit, and a fixed order of summation whatever the build. */
#define S_LANES 16

/* The sum of S_LANES partial sums as a tree (lanes j and j + 8, then
 * j + 4, j + 2, j + 1), the order the AVX-512 softmax reduces its
 * register in: four roundings deep instead of fifteen. */
static inline float
s_sum_lanes (float *v)
{
    for (int h = S_LANES / 2; h > 0; h /= 2)
        for (int j = 0; j < h; j++)
            v[j] += v[j + h];
    return v[0];
}

/* e^x for x <= 0 (not NaN): what softmax needs. */
static inline float
s_exp_nonpos (float x)
{
    float c = x < -104.0f ? -104.0f : x;
    float e = s_exp_core (c);
    return x < -103.972694f ? 0.0f : e;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define S_SOFTMAX_AVX512 1

/* kiln_vsoftmax_row's softmax (not the log form) written out for
 * AVX-512: the maximum (exact in any order), the exponentials by
 * s_exp_nonpos16, their float sums in the portable loop's sixteen lanes
 * reduced in its order; the last n mod 16 floats as one masked vector
 * (their scalar exponentials had been a third of a vit_b_16 softmax's
 * 197-float rows).  A transformer's attention rows (128 floats):
 * 83 ns a row with the sums in double and the C's exponential, against
 * 99 for the compiled C; 66 ns with the float sums and their tree
 * reduction (s_sum_lanes); 54 ns with the FMAs (the four softmaxes
 * 0.34 ms -> 0.27 -> 0.22). */
__attribute__ ((target ("avx512f"))) static void
s_softmax_row_avx512 (const float *restrict x, float *restrict y, int64_t n)
{
    int64_t body = n / S_LANES * S_LANES;
    __m512 m0 = _mm512_set1_ps (x[0]), m1 = m0, m2 = m0, m3 = m0;
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 4 * S_LANES <= body; i += 4 * S_LANES) {
        __m512 v0 = _mm512_loadu_ps (x + i), v1 = _mm512_loadu_ps (x + i + 16);
        __m512 v2 = _mm512_loadu_ps (x + i + 32), v3 = _mm512_loadu_ps (x + i + 48);
        nan |= _mm512_cmp_ps_mask (v0, v1, _CMP_UNORD_Q)
               | _mm512_cmp_ps_mask (v2, v3, _CMP_UNORD_Q);
        m0 = _mm512_max_ps (v0, m0);
        m1 = _mm512_max_ps (v1, m1);
        m2 = _mm512_max_ps (v2, m2);
        m3 = _mm512_max_ps (v3, m3);
    }
    for (; i < body; i += S_LANES) {
        __m512 v = _mm512_loadu_ps (x + i);
        nan |= _mm512_cmp_ps_mask (v, v, _CMP_UNORD_Q);
        m0 = _mm512_max_ps (v, m0);
    }
    /* the last n - body floats: one masked vector, the other lanes x[0] */
    __mmask16 tm = (__mmask16) ((1u << (n - body)) - 1u);
    if (tm) {
        __m512 v = _mm512_mask_loadu_ps (_mm512_set1_ps (x[0]), tm, x + body);
        nan |= _mm512_mask_cmp_ps_mask (tm, v, v, _CMP_UNORD_Q);
        m1 = _mm512_max_ps (v, m1);
    }
    float m = _mm512_reduce_max_ps (_mm512_max_ps (_mm512_max_ps (m0, m1),
                                                   _mm512_max_ps (m2, m3)));
    if (nan) {
        for (i = 0; i < n; i++)
            y[i] = NAN;
        return;
    }
    __m512 vm = _mm512_set1_ps (m);
    __m512 s = _mm512_setzero_ps ();
    for (i = 0; i + 4 * S_LANES <= body; i += 4 * S_LANES) {
        __m512 e[4];
        for (int u = 0; u < 4; u++)
            e[u] = kiln_exp_nonpos16 (_mm512_sub_ps (_mm512_loadu_ps (x + i + 16 * u), vm));
        for (int u = 0; u < 4; u++) {
            _mm512_storeu_ps (y + i + 16 * u, e[u]);
            s = _mm512_add_ps (s, e[u]);
        }
    }
    for (; i < body; i += S_LANES) {
        __m512 e = kiln_exp_nonpos16 (_mm512_sub_ps (_mm512_loadu_ps (x + i), vm));
        _mm512_storeu_ps (y + i, e);
        s = _mm512_add_ps (s, e);
    }
    if (tm) {
        /* the other lanes x = m: e^0, neither stored nor summed */
        __m512 v = _mm512_mask_loadu_ps (vm, tm, x + body);
        _mm512_mask_storeu_ps (y + body, tm, kiln_exp_nonpos16 (_mm512_sub_ps (v, vm)));
    }
    /* s_sum_lanes's tree: lanes j + 8, then j + 4, j + 2, j + 1. */
    __m256 s8 = _mm256_add_ps (_mm512_castps512_ps256 (s),
                               _mm256_castpd_ps (_mm512_extractf64x4_pd (_mm512_castps_pd (s), 1)));
    __m128 s4 = _mm_add_ps (_mm256_castps256_ps128 (s8), _mm256_extractf128_ps (s8, 1));
    __m128 s2 = _mm_add_ps (s4, _mm_movehl_ps (s4, s4));
    float sum = _mm_cvtss_f32 (_mm_add_ss (s2, _mm_shuffle_ps (s2, s2, 1)));
    for (i = body; i < n; i++)
        sum += y[i];
    float inv = 1.0f / sum;
    __m512 vinv = _mm512_set1_ps (inv);
    for (i = 0; i < body; i += S_LANES)
        _mm512_storeu_ps (y + i, _mm512_mul_ps (_mm512_loadu_ps (y + i), vinv));
    if (tm)
        _mm512_mask_storeu_ps (y + body, tm,
                               _mm512_mul_ps (_mm512_maskz_loadu_ps (tm, y + body), vinv));
}

#endif

/* The portable row, built for each vector unit. */
S_CLONES static void
s_softmax_row (const float *restrict x, float *restrict y, int64_t n,
               bool log_form)
{
    if (n <= 0)
        return;
    float mv[S_LANES];
    int nan = 0;
    for (int j = 0; j < S_LANES; j++)
        mv[j] = x[0];
    int64_t body = n / S_LANES * S_LANES;
    for (int64_t i = 0; i < body; i += S_LANES)
        for (int j = 0; j < S_LANES; j++) {
            float v = x[i + j];
            mv[j] = v > mv[j] ? v : mv[j];
            nan |= v != v;
        }
    float m = x[0];
    for (int j = 0; j < S_LANES; j++)
        m = mv[j] > m ? mv[j] : m;
    for (int64_t i = body; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        nan |= x[i] != x[i];
    }
    if (nan) {
        for (int64_t i = 0; i < n; i++)
            y[i] = NAN;
        return;
    }
    for (int64_t i = 0; i < n; i++)
        y[i] = s_exp_nonpos (x[i] - m);
    if (log_form) {
        /* The log form keeps its sum in double: log(sum) has no
         * division to hide a float sum's rounding in a small result. */
        double sv[S_LANES] = { 0 };
        for (int64_t i = 0; i < body; i += S_LANES)
            for (int j = 0; j < S_LANES; j++)
                sv[j] += (double) y[i + j];
        double sum = 0.0;
        for (int j = 0; j < S_LANES; j++)
            sum += sv[j];
        for (int64_t i = body; i < n; i++)
            sum += (double) y[i];
        float ls = (float) log (sum);
        for (int64_t i = 0; i < n; i++)
            y[i] = x[i] - m - ls;
        return;
    }
    float sv[S_LANES] = { 0 };
    for (int64_t i = 0; i < body; i += S_LANES)
        for (int j = 0; j < S_LANES; j++)
            sv[j] += y[i + j];
    float sum = s_sum_lanes (sv);
    for (int64_t i = body; i < n; i++)
        sum += y[i];
    float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; i++)
        y[i] *= inv;
}

#if defined(S_SOFTMAX_AVX512)
/* 1 when the AVX-512 row is used: the CPU has it and KILN_RT_ISA did not
 * ask for less (the engine's choice, kiln_gemm_isa), so that
 * KILN_RT_ISA=avx2 runs and tests the portable row; -1 before the first
 * row (the race to set it is benign: every thread finds the same). */
static int s_softmax_avx512 = -1;

static bool
s_use_softmax_avx512 (void)
{
    int v = __atomic_load_n (&s_softmax_avx512, __ATOMIC_RELAXED);
    if (v < 0) {
        v = __builtin_cpu_supports ("avx512f")
            && kiln_gemm_avx512 ();
        __atomic_store_n (&s_softmax_avx512, v, __ATOMIC_RELAXED);
    }
    return v;
}
#endif

void
kiln_vsoftmax_row (const float *restrict x, float *restrict y, int64_t n,
                   bool log_form)
{
#if defined(S_SOFTMAX_AVX512)
    if (!log_form && n > 0 && s_use_softmax_avx512 ()) {
        s_softmax_row_avx512 (x, y, n);
        return;
    }
#endif
    s_softmax_row (x, y, n, log_form);
}

#if defined(S_SOFTMAX_AVX512)
/* kiln_vlayer_norm_row for a contiguous scale and bias on AVX-512: the
 * same double sums with four registers of eight lanes each (32 partial
 * sums, against the C's 16 added one after the other: the C is bound by
 * the latency of its two chains of sums), the deviations' squares by
 * FMA, the last pass in float as the C.  The sums' order differs from
 * the C's, in double: the mean and 1/sqrt(var + eps) agree with it to
 * the double's last bits, the outputs almost always bit for bit. */
__attribute__ ((target ("avx512f"))) static void
s_layer_norm_row_avx512 (const float *x, float *y, int64_t n, const float *sc,
                         const float *bias, double eps, double *mean_out,
                         double *inv_out)
{
    int64_t body = n / 32 * 32, i;
    __m512d a0 = _mm512_setzero_pd (), a1 = a0, a2 = a0, a3 = a0;
    for (i = 0; i < body; i += 32) {
        a0 = _mm512_add_pd (a0, _mm512_cvtps_pd (_mm256_loadu_ps (x + i)));
        a1 = _mm512_add_pd (a1, _mm512_cvtps_pd (_mm256_loadu_ps (x + i + 8)));
        a2 = _mm512_add_pd (a2, _mm512_cvtps_pd (_mm256_loadu_ps (x + i + 16)));
        a3 = _mm512_add_pd (a3, _mm512_cvtps_pd (_mm256_loadu_ps (x + i + 24)));
    }
    double s = _mm512_reduce_add_pd (_mm512_add_pd (_mm512_add_pd (a0, a1),
                                                    _mm512_add_pd (a2, a3)));
    for (; i < n; i++)
        s += (double) x[i];
    double mean = s / (double) n;
    __m512d vm = _mm512_set1_pd (mean);
    a0 = a1 = a2 = a3 = _mm512_setzero_pd ();
    for (i = 0; i < body; i += 32) {
        __m512d d0 = _mm512_sub_pd (_mm512_cvtps_pd (_mm256_loadu_ps (x + i)), vm);
        __m512d d1 = _mm512_sub_pd (_mm512_cvtps_pd (_mm256_loadu_ps (x + i + 8)), vm);
        __m512d d2 = _mm512_sub_pd (_mm512_cvtps_pd (_mm256_loadu_ps (x + i + 16)), vm);
        __m512d d3 = _mm512_sub_pd (_mm512_cvtps_pd (_mm256_loadu_ps (x + i + 24)), vm);
        a0 = _mm512_fmadd_pd (d0, d0, a0);
        a1 = _mm512_fmadd_pd (d1, d1, a1);
        a2 = _mm512_fmadd_pd (d2, d2, a2);
        a3 = _mm512_fmadd_pd (d3, d3, a3);
    }
    double q = _mm512_reduce_add_pd (_mm512_add_pd (_mm512_add_pd (a0, a1),
                                                    _mm512_add_pd (a2, a3)));
    for (; i < n; i++) {
        double d = (double) x[i] - mean;
        q += d * d;
    }
    double inv = 1.0 / sqrt (q / (double) n + eps);
    float fm = (float) mean, fi = (float) inv;
    __m512 vfm = _mm512_set1_ps (fm), vfi = _mm512_set1_ps (fi);
    int64_t body16 = n / 16 * 16;
    for (i = 0; i < body16; i += 16) {
        __m512 v = _mm512_mul_ps (_mm512_sub_ps (_mm512_loadu_ps (x + i), vfm), vfi);
        v = _mm512_add_ps (_mm512_mul_ps (v, _mm512_loadu_ps (sc + i)),
                           _mm512_loadu_ps (bias + i));
        _mm512_storeu_ps (y + i, v);
    }
    for (; i < n; i++)
        y[i] = (x[i] - fm) * fi * sc[i] + bias[i];
    *mean_out = mean;
    *inv_out = inv;
}
#endif

/* The portable row, built for each vector unit. */
S_CLONES static void
s_layer_norm_row (const float *x, float *y, int64_t n, const float *sc,
                  int64_t sc_st, const float *bias, int64_t b_st, double eps,
                  double *mean_out, double *inv_out)
{
    int64_t body = n / S_LANES * S_LANES;
    double sv[S_LANES] = { 0 }, s = 0.0;
    for (int64_t i = 0; i < body; i += S_LANES)
        for (int j = 0; j < S_LANES; j++)
            sv[j] += (double) x[i + j];
    for (int j = 0; j < S_LANES; j++)
        s += sv[j];
    for (int64_t i = body; i < n; i++)
        s += (double) x[i];
    double mean = n ? s / (double) n : 0.0, q = 0.0;
    for (int j = 0; j < S_LANES; j++)
        sv[j] = 0.0;
    for (int64_t i = 0; i < body; i += S_LANES)
        for (int j = 0; j < S_LANES; j++) {
            double d = (double) x[i + j] - mean;
            sv[j] += d * d;
        }
    for (int j = 0; j < S_LANES; j++)
        q += sv[j];
    for (int64_t i = body; i < n; i++) {
        double d = (double) x[i] - mean;
        q += d * d;
    }
    double inv = 1.0 / sqrt ((n ? q / (double) n : 0.0) + eps);
    float fm = (float) mean, fi = (float) inv;
    if (sc_st == 1 && bias && b_st == 1)
        for (int64_t i = 0; i < n; i++)
            y[i] = (x[i] - fm) * fi * sc[i] + bias[i];
    else
        for (int64_t i = 0; i < n; i++)
            y[i] = (x[i] - fm) * fi * sc[i * sc_st] + (bias ? bias[i * b_st] : 0.0f);
    *mean_out = mean;
    *inv_out = inv;
}

void
kiln_vlayer_norm_row (const float *x, float *y, int64_t n, const float *sc,
                      int64_t sc_st, const float *bias, int64_t b_st, double eps,
                      double *mean_out, double *inv_out)
{
#if defined(S_SOFTMAX_AVX512)
    if (n > 0 && sc_st == 1 && bias && b_st == 1 && s_use_softmax_avx512 ()) {
        s_layer_norm_row_avx512 (x, y, n, sc, bias, eps, mean_out, inv_out);
        return;
    }
#endif
    s_layer_norm_row (x, y, n, sc, sc_st, bias, b_st, eps, mean_out, inv_out);
}
