/*
 * kiln_vmath — vectorised float32 loops for the transcendental kernels:
 * exp, tanh, sigmoid and erf, and a softmax row.  Internal to libkilnrt.
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

#endif
