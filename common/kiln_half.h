/*
 * kiln_half — the two 2-byte float types kiln stores, and their
 * conversions to and from float32, written once for the importer's
 * folding, the compiler and the runtime (whose vectorised rows,
 * runtime/kiln_convert.c, give the same bits).
 *
 *   float16   IEEE binary16: 1 sign, 5 exponent, 10 fraction bits
 *   bfloat16  the top 16 bits of a float32: 1 sign, 8 exponent, 7 fraction
 *
 * Widening to float32 is exact.  Narrowing rounds to nearest, ties to
 * even, as torch does (c10::Half, c10::BFloat16): subnormal results are
 * kept, not flushed (AVX512_BF16's VCVTNEPS2BF16 flushes them, so kiln
 * does not use it); a value past the largest finite one rounds to
 * infinity (bfloat16 shares float32's exponent range, so only values
 * within half an ulp of FLT_MAX do); a NaN stays a quiet NaN of the same
 * sign, the top bits of its payload kept.
 *
 * kiln computes in float32: a half tensor is widened where an op reads
 * it and an op's half result is rounded to the type (docs/engine.md).
 */
#ifndef KILN_HALF_H
#define KILN_HALF_H

#include <stdint.h>
#include <string.h>

/* float16 bits to float32, exactly (a signalling NaN comes out quiet). */
static inline float
kiln_f16_to_f32 (uint16_t h)
{
    uint32_t sign = (uint32_t) (h & 0x8000u) << 16;
    uint32_t ex = (h >> 10) & 0x1fu, man = h & 0x3ffu, x;
    float f;
    if (ex == 0) {
        /* zero or subnormal: man · 2^-24, exact in float32 */
        f = (float) man * 0x1p-24f;
        return sign ? -f : f;
    }
    if (ex == 0x1fu)            /* infinity, or a NaN made quiet (as F16C does) */
        x = sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0);
    else
        x = sign | ((ex + 112u) << 23) | (man << 13);
    memcpy (&f, &x, sizeof f);
    return f;
}

/* float32 to float16 bits, to nearest even. */
static inline uint16_t
kiln_f32_to_f16 (float f)
{
    uint32_t x;
    memcpy (&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u, ex = (x >> 23) & 0xffu;
    uint32_t man = x & 0x7fffffu;
    if (ex == 0xffu)
        return (uint16_t) (sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0));
    int e = (int) ex - 127 + 15;
    if (e >= 31)
        return (uint16_t) (sign | 0x7c00u);
    if (e <= 0) {
        /* a subnormal result (or zero): units of 2^-24 */
        if (e < -10)
            return (uint16_t) sign;
        man |= 0x800000u;
        int shift = 14 - e;
        uint32_t h = man >> shift, rem = man & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (h & 1u)))
            h++;
        return (uint16_t) (sign | h);
    }
    uint32_t h = sign | ((uint32_t) e << 10) | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
        h++;                    /* a carry into the exponent is right */
    return (uint16_t) h;
}

/* bfloat16 bits to float32, exactly. */
static inline float
kiln_bf16_to_f32 (uint16_t b)
{
    uint32_t x = (uint32_t) b << 16;
    float f;
    memcpy (&f, &x, sizeof f);
    return f;
}

/* float32 to bfloat16 bits, to nearest even: add 0x7fff plus the kept
 * part's lowest bit, then drop the low half (a carry into the exponent
 * is right).  Cannot overflow 32 bits: the largest non-NaN pattern is
 * -infinity, 0xff800000. */
static inline uint16_t
kiln_f32_to_bf16 (float f)
{
    uint32_t x;
    memcpy (&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t) ((x >> 16) | 0x0040u);
    return (uint16_t) ((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

#endif
