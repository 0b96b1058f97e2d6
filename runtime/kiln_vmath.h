/*
 * kiln_vmath — vectorised float32 loops for the transcendental kernels:
 * exp, tanh, sigmoid and erf, and a softmax row; and the AVX-512 lanes
 * of a masked load over a run.  Internal to libkilnrt.
 *
 * libm's expf and friends are scalar calls; these are polynomial
 * approximations written so that the compiler vectorises the loops, built
 * for AVX-512, AVX2 and the x86-64 baseline (picked at load time by the
 * dynamic linker, target_clones) from the same C.  The arithmetic is the
 * same in every build (no contraction into FMA), so results do not depend
 * on the CPU.  Accuracy, measured over the whole float range by
 * tests/unit/test_vmath.c against libm in double: exp and sigmoid within 4
 * ulp, tanh and erf within 4 ulp or 1e-7 absolute where the result is
 * near 0; well inside the ONNX conformance tolerance (rtol 1e-3).  NaN in
 * gives NaN out; infinities and the ends of the range give what libm
 * gives.
 */
#ifndef KILN_VMATH_H
#define KILN_VMATH_H

#include <stdbool.h>
#include <stdint.h>

/* Build a function for AVX-512, AVX2 and the x86-64 baseline and let the
 * dynamic linker pick one at load time (gcc's target_clones): for the
 * loops the compiler vectorises on its own.  Not under the sanitizers,
 * whose runtime does not follow ifunc resolvers everywhere. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) \
    && !defined(__SANITIZE_ADDRESS__)
#define KILN_VCLONES __attribute__ ((target_clones ("avx512f", "avx2", "default")))
#else
#define KILN_VCLONES
#endif

/* Let gcc fuse a function's multiplies and adds into multiply-adds, which
 * the ISO C mode (-std=c11) otherwise keeps apart: for loops written with
 * vector types.  clang (the fuzzers' build) has no such attribute and
 * keeps them apart. */
#if defined(__GNUC__) && !defined(__clang__)
#define KILN_FP_CONTRACT __attribute__ ((optimize ("fp-contract=fast")))
#else
#define KILN_FP_CONTRACT
#endif

/* Keep a function's short loops of copies and zeros as loops: gcc turns
 * them into memcpy and memset calls, which cost more than runs of a few
 * floats (gcc only: clang's builds do without). */
#if defined(__GNUC__) && !defined(__clang__)
#define KILN_NO_LIBCALLS __attribute__ ((optimize ("no-tree-loop-distribute-patterns")))
#else
#define KILN_NO_LIBCALLS
#endif

/* y[i] = f (x[i]); x and y are the same buffer or do not overlap. */
void kiln_vexp (const float *x, float *y, int64_t n);
void kiln_vtanh (const float *x, float *y, int64_t n);
void kiln_vsigmoid (const float *x, float *y, int64_t n);
void kiln_verf (const float *x, float *y, int64_t n);

/* Softmax (or log-softmax) of the n contiguous floats at x into y: the
 * exponentials of x - max, summed in a fixed order (sixteen lanes, then a
 * tree, then the tail), in float for the softmax (as ONNX Runtime does:
 * within (n / 16 + 4 + n % 16) * 2^-24 relative, on top of the
 * exponential's few ulp) and in double for the log form.  On AVX-512
 * (unless KILN_RT_ISA asks for less) the softmax's exponentials are fused
 * multiply-adds, within an ulp of the portable loop's.  x and y do not
 * overlap. */
void kiln_vsoftmax_row (const float *x, float *y, int64_t n, bool log_form);

/* Layer normalisation of the n contiguous floats at x into y (x and y
 * the same or apart): mean and variance in double (sums in a fixed
 * order: 16 lanes in the portable loop, 32 on AVX-512 with a contiguous
 * scale and bias), then y = (x - mean) / sqrt(var + eps) * scale + bias in float,
 * scale[i * sc_st], bias[i * b_st] (bias may be NULL).  *mean and *inv
 * get the mean and 1 / sqrt(var + eps). */
void kiln_vlayer_norm_row (const float *x, float *y, int64_t n, const float *sc,
                           int64_t sc_st, const float *bias, int64_t b_st,
                           double eps, double *mean, double *inv);

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* The exponentials' reduction: x = n·ln 2 + r, n = round (x·log2 e),
 * r by ln 2 in two parts; r is returned, n goes to *n. */
__attribute__ ((target ("avx512f"), always_inline)) static inline __m512
kiln_exp_reduce16 (__m512 x, __m512 *n)
{
    *n = _mm512_roundscale_ps (_mm512_mul_ps (x, _mm512_set1_ps (1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps (*n, _mm512_set1_ps (0.693359375f), x);
    return _mm512_fnmadd_ps (*n, _mm512_set1_ps (-2.12194440e-4f), r);
}

/* e^x on sixteen lanes for x <= 0 (not NaN), as kiln_vmath.c's s_exp_nonpos
 * computes it but with the polynomial's multiplies and adds fused: n = round-to-
 * nearest-even (x·log2 e) by roundscale (what adding and subtracting
 * 1.5·2^23 does), r = x - n·ln 2 in two parts and Cephes' polynomial by
 * FMA, then p·2^n by one scalef (correctly rounded, subnormals
 * included; 0 below -103.97).  Each FMA rounds once where the C rounds
 * twice, so the values are no longer the portable loop's bit for bit
 * (within an ulp of them; tests/unit/test_engine.c checks both against
 * double), for a fifth of the softmax's time. */
/* The same without the last step's mask: below -103.97 the result is 0
 * or a subnormal under 2^-149 rather than 0 (for callers to whom that
 * difference is nothing). */
__attribute__ ((target ("avx512f"), always_inline)) static inline __m512
kiln_exp_nonpos16_raw (__m512 x)
{
    __m512 n, r = kiln_exp_reduce16 (_mm512_max_ps (x, _mm512_set1_ps (-104.0f)), &n);
    __m512 p = _mm512_set1_ps (1.9875691500e-4f);
    p = _mm512_fmadd_ps (p, r, _mm512_set1_ps (1.3981999507e-3f));
    p = _mm512_fmadd_ps (p, r, _mm512_set1_ps (8.3334519073e-3f));
    p = _mm512_fmadd_ps (p, r, _mm512_set1_ps (4.1665795894e-2f));
    p = _mm512_fmadd_ps (p, r, _mm512_set1_ps (1.6666665459e-1f));
    p = _mm512_fmadd_ps (p, r, _mm512_set1_ps (5.0000001201e-1f));
    p = _mm512_add_ps (_mm512_fmadd_ps (_mm512_mul_ps (p, r), r, r), _mm512_set1_ps (1.0f));
    return _mm512_scalef_ps (p, n);
}

__attribute__ ((target ("avx512f"), always_inline)) static inline __m512
kiln_exp_nonpos16 (__m512 x)
{
    __m512 e = kiln_exp_nonpos16_raw (x);
    __mmask16 tiny = _mm512_cmp_ps_mask (x, _mm512_set1_ps (-103.972694f), _CMP_LT_OQ);
    return _mm512_mask_mov_ps (e, tiny, _mm512_setzero_ps ());
}

/* e^x on sixteen lanes for x <= 0 to within 1.6e-7 (relative), for the
 * activations, whose results need less than softmax's (GELU and SiLU:
 * docs/engine.md): the same reduction as kiln_exp_nonpos16_raw,
 * then 1 + r + r²·(c2 + c3·r + c4·r² + c5·r³) on [-ln 2 / 2, ln 2 / 2],
 * the c's fitted to the relative error (1.05e-7 in double), by five
 * FMAs; no clamp (x must be at least -1024 and not NaN: scalef takes
 * 2^-1477 to 0). */
__attribute__ ((target ("avx512f"), always_inline)) static inline __m512
kiln_exp_deg5_16 (__m512 x)
{
    __m512 n, r = kiln_exp_reduce16 (x, &n);
    __m512 one = _mm512_set1_ps (1.0f);
    __m512 p = _mm512_fmadd_ps (_mm512_set1_ps (8.3128195256e-03f), r,
                                _mm512_set1_ps (4.1890215129e-02f));
    p = _mm512_fmadd_ps (p, r, _mm512_set1_ps (1.6667111218e-01f));
    p = _mm512_fmadd_ps (p, r, _mm512_set1_ps (4.9999231100e-01f));
    p = _mm512_fmadd_ps (p, r, one);
    p = _mm512_fmadd_ps (p, r, one);
    return _mm512_scalef_ps (p, n);
}

/* SiLU on sixteen lanes, v · σ(v) with σ as kiln_act16 computes it (e =
 * e^-|v|, 1 / (1 + e), times e for v < 0) but without the masks SiLU
 * does not need: a NaN v gives NaN through the last product whatever σ
 * is, and e^-|v| below 2^-149 (|v| over 103.97) times v is a subnormal
 * or 0 either way.  -|v| is v with its sign bit set.  Seven operations of
 * the 26 a vector fewer, where SiLU was a fifth of efficientnet_b0's
 * time; and e^-|v| by kiln_exp_deg5_16 (an error δ in it moves σ by at
 * most δ relatively), three fewer again: within 1.5e-7 of double. */
__attribute__ ((target ("avx512f"), always_inline)) static inline __m512
kiln_silu16 (__m512 v)
{
    __m512 one = _mm512_set1_ps (1.0f);
    __m512 nav = _mm512_castsi512_ps (_mm512_or_epi32 (_mm512_castps_si512 (v),
                                                       _mm512_set1_epi32 (INT32_MIN)));
    __m512 e = kiln_exp_deg5_16 (_mm512_max_ps (nav, _mm512_set1_ps (-104.0f)));
    __m512 s = _mm512_div_ps (one, _mm512_add_ps (one, e));
    s = _mm512_mask_mul_ps (s, _mm512_cmp_ps_mask (v, _mm512_setzero_ps (), _CMP_LT_OQ), s, e);
    return _mm512_mul_ps (v, s);
}

/* The heavy epilogue activations (kiln_act_heavy) that have an AVX-512
 * form, on sixteen lanes: sigmoid as 1 / (1 + e^-|v|), times e^-|v| for
 * v < 0, with the exponential above (so no overflow and no cancellation);
 * SiLU as v times that (kiln_silu16); hard swish and hard sigmoid as the C computes
 * them.  Within a few ulp of the portable loops (tests/unit/test_engine.c
 * checks both against double); GELU by kiln_gelu16 below.  Tanh is not
 * here (false). */
static inline bool
kiln_act16_has (int act)
{
    return act == 4 || act == 5 || act == 6 || act == 7 || act == 8;
}

/* GELU on sixteen lanes: v · Φ(v), with Φ(v) = 1 - erfc(x) / 2 (x =
 * v / √2 >= 0) or erfc(|x|) / 2 (x < 0) and erfc by Abramowitz and
 * Stegun's 7.1.26 (erf within 1.5e-7 of the truth everywhere, and
 * erfc's error shrinking with it past x = 3): t = 1 / (1 + p·|x|),
 * erfc = t·(a1 + t·(a2 + t·(a3 + t·(a4 + t·a5))))·e^(-x²), the a's
 * halved here.  One exponential a vector, in registers, where the
 * portable erf (kiln_verf, fdlibm's) took 18 % of convnext_tiny; no
 * division (t the 14-bit reciprocal and one Newton step).  The
 * exponential needs less than the softmax's: an error δ in erfc moves
 * GELU by at most |v|·erfc(|x|)/2·δ < 0.17·δ, so a polynomial of degree
 * 5 (within 1.6e-7, kiln_exp_deg5_16) does, and no clamp (e^-1024 by
 * scalef is 0).  A NaN v comes out of the last product (|x| is taken
 * at most 32, so nothing before it is NaN).  28 operations a vector
 * where the first form took 38 (0.68 -> 0.50 ns an element alone, on
 * this project's Sapphire Rapids VM); GELU within 4e-7 of double
 * (absolute, relative above 1; tests/unit/test_engine.c), where the
 * Chebyshev fit of Numerical Recipes' erfcc (ten terms, within 1.2e-7
 * relative) and two divisions took 1.5 times as long a vector. */
__attribute__ ((target ("avx512f"), always_inline)) static inline __m512
kiln_gelu16 (__m512 v)
{
    __m512 one = _mm512_set1_ps (1.0f);
    __m512 x = _mm512_mul_ps (v, _mm512_set1_ps (0.707106781186547524f));
    /* (|x| at most 32: erfc is 0 from 10.1 on, the reciprocal's Newton
     * step of an infinite d would be inf · 0, and a NaN v gives 32 here) */
    __m512 z = _mm512_min_ps (_mm512_abs_ps (x), _mm512_set1_ps (32.0f));
    __m512 d = _mm512_fmadd_ps (_mm512_set1_ps (0.3275911f), z, one);
    __m512 t = _mm512_rcp14_ps (d);
    t = _mm512_fmadd_ps (t, _mm512_fnmadd_ps (d, t, one), t);
    __m512 p = _mm512_fmadd_ps (_mm512_set1_ps (0.5f * 1.061405429f), t,
                                _mm512_set1_ps (0.5f * -1.453152027f));
    p = _mm512_fmadd_ps (p, t, _mm512_set1_ps (0.5f * 1.421413741f));
    p = _mm512_fmadd_ps (p, t, _mm512_set1_ps (0.5f * -0.284496736f));
    p = _mm512_fmadd_ps (p, t, _mm512_set1_ps (0.5f * 0.254829592f));
    __m512 e = kiln_exp_deg5_16 (_mm512_fnmadd_ps (z, z, _mm512_setzero_ps ()));
    __m512 h = _mm512_mul_ps (_mm512_mul_ps (p, t), e);       /* erfc(|x|) / 2 */
    __mmask16 neg = _mm512_cmp_ps_mask (x, _mm512_setzero_ps (), _CMP_LT_OQ);
    return _mm512_mul_ps (v, _mm512_mask_mov_ps (_mm512_sub_ps (one, h), neg, h));
}

__attribute__ ((target ("avx512f"), always_inline)) static inline __m512
kiln_act16 (__m512 v, int act, __m512 a, __m512 b)
{
    __m512 zero = _mm512_setzero_ps (), one = _mm512_set1_ps (1.0f);
    if (act == 6)
        return kiln_gelu16 (v);
    if (act == 5)
        return kiln_silu16 (v);
    if (act == 7 || act == 8) {
        /* hard swish's x / 6 as ONNX's alpha · x, alpha the float 1/6:
         * a multiply where a division held the divider 10-16 cycles a
         * vector */
        __m512 h = act == 7 ? _mm512_add_ps (_mm512_mul_ps (v, _mm512_set1_ps (1.0f / 6.0f)),
                                             _mm512_set1_ps (0.5f))
                            : _mm512_add_ps (_mm512_mul_ps (a, v), b);
        /* h < 0 ? 0 : h, then h > 1 ? 1 : h: NaN kept */
        h = _mm512_mask_mov_ps (h, _mm512_cmp_ps_mask (h, zero, _CMP_LT_OQ), zero);
        h = _mm512_mask_mov_ps (h, _mm512_cmp_ps_mask (h, one, _CMP_GT_OQ), one);
        return act == 7 ? _mm512_mul_ps (v, h) : h;
    }
    /* e^-|v|; a NaN v gives a NaN through the comparisons below */
    __m512 av = _mm512_abs_ps (v);
    __mmask16 nan = _mm512_cmp_ps_mask (v, v, _CMP_UNORD_Q);
    __m512 e = kiln_exp_nonpos16 (_mm512_mask_mov_ps (_mm512_sub_ps (zero, av), nan, zero));
    __m512 s = _mm512_div_ps (one, _mm512_add_ps (one, e));
    s = _mm512_mask_mul_ps (s, _mm512_cmp_ps_mask (v, zero, _CMP_LT_OQ), s, e);
    s = _mm512_mask_mov_ps (s, nan, v);
    return act == 5 ? _mm512_mul_ps (v, s) : s;
}

/* For masked loads over a run of w floats: the lanes l of sixteen whose
 * element a + l lies in it (0 ... w - 1), and the address of element a,
 * which may lie before the run (its lanes masked off are not read), where
 * pointer arithmetic could not go. */
__attribute__ ((target ("avx512f"), always_inline)) static inline __mmask16
kiln_lanes16 (int64_t a, int64_t w)
{
    int64_t lo = a < 0 ? -a : 0, hi = w - a < 16 ? w - a : 16;
    return hi <= lo ? 0 : (__mmask16) (((1u << hi) - 1) & ~((1u << lo) - 1));
}

static inline const void *
kiln_at (const float *p, int64_t a)
{
    return (const void *) ((uintptr_t) p + (uintptr_t) (a * (int64_t) sizeof *p));
}
#endif

#endif
