/*
 * kiln_convert — rows of float16 or bfloat16 to and from float32,
 * vectorised for the CPU at hand (AVX-512: 16 lanes; AVX2 + F16C: 8;
 * portable C otherwise), following the matrix engine's choice
 * (kiln_gemm_isa, KILN_RT_ISA).  Internal to libkilnrt.
 *
 * Every path gives the bits of common/kiln_half.h's scalar conversions:
 * float16 by F16C's conversions (round to nearest even, subnormals
 * kept), bfloat16 by integer arithmetic on the float32's bits (not
 * AVX512_BF16's VCVTNEPS2BF16, which flushes subnormals), NaN kept as a
 * quiet NaN of the same sign.  The matrix engine widens a half weight's
 * panels with these; the cast and round_half kernels narrow and round
 * activations.
 */
#ifndef KILN_CONVERT_H
#define KILN_CONVERT_H

#include <stdint.h>

#include "common/kiln_dtype.h"

/* dst[i] = src[i] widened to float32, i < n; `dt` is KILN_DT_FLOAT16 or
 * KILN_DT_BFLOAT16 (any other: the bfloat16 rule). */
void kiln_convert_widen (kiln_dtype_t dt, const uint16_t *src, float *dst, int64_t n);

/* dst[i] = src[i] rounded to `dt`'s bits. */
void kiln_convert_narrow (kiln_dtype_t dt, const float *src, uint16_t *dst, int64_t n);

/* dst[i] = src[i] rounded to `dt` and widened back: the float32 value a
 * `dt` tensor holds.  dst may be src. */
void kiln_convert_round (kiln_dtype_t dt, const float *src, float *dst, int64_t n);

/* "avx512", "avx2" or "generic": the loops in use (the engine's ISA, or
 * generic when the CPU lacks F16C). */
const char *kiln_convert_isa (void);

#endif
