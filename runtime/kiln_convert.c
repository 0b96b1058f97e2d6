/*
 * kiln_convert — float16 / bfloat16 rows to and from float32 (see
 * kiln_convert.h).  Each ISA converts whole vectors and leaves the tail
 * (fewer than a vector) to the scalar conversions of common/kiln_half.h,
 * which the vector code reproduces bit for bit.
 */
#include "runtime/kiln_convert.h"

#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "common/kiln_half.h"
#include "runtime/kiln_gemm.h"

typedef void (s_widen_fn) (bool bf, const uint16_t *src, float *dst, int64_t n);
typedef void (s_narrow_fn) (bool bf, const float *src, uint16_t *dst, int64_t n);
typedef void (s_round_fn) (bool bf, const float *src, float *dst, int64_t n);

/* --- portable C, and every tail ------------------------------------- */

static void
s_widen_c (bool bf, const uint16_t *src, float *dst, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = bf ? kiln_bf16_to_f32 (src[i]) : kiln_f16_to_f32 (src[i]);
}

static void
s_narrow_c (bool bf, const float *src, uint16_t *dst, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = bf ? kiln_f32_to_bf16 (src[i]) : kiln_f32_to_f16 (src[i]);
}

static void
s_round_c (bool bf, const float *src, float *dst, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = bf ? kiln_bf16_to_f32 (kiln_f32_to_bf16 (src[i]))
                    : kiln_f16_to_f32 (kiln_f32_to_f16 (src[i]));
}

#if defined(__x86_64__)

/* --- AVX-512: 16 lanes ---------------------------------------------- */

/* bfloat16's rounding on float32 bits, the lanes' low halves left for
 * the caller to drop: x + 0x7fff + bit 16 of x; a NaN becomes x with
 * the quiet bit set (bit 22, bit 6 of the bfloat16). */
__attribute__ ((target ("avx512f"))) static inline __m512i
s_bf_round_512 (__m512 v)
{
    __m512i x = _mm512_castps_si512 (v);
    __m512i lsb = _mm512_and_si512 (_mm512_srli_epi32 (x, 16), _mm512_set1_epi32 (1));
    __m512i r = _mm512_add_epi32 (_mm512_add_epi32 (x, _mm512_set1_epi32 (0x7fff)), lsb);
    __mmask16 nan = _mm512_cmp_ps_mask (v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32 (r, nan, x, _mm512_set1_epi32 (0x00400000));
}

__attribute__ ((target ("avx512f"))) static void
s_widen_avx512 (bool bf, const uint16_t *src, float *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256 ((const __m256i *) (src + i));
        __m512 v = bf ? _mm512_castsi512_ps (_mm512_slli_epi32 (_mm512_cvtepu16_epi32 (h), 16))
                      : _mm512_cvtph_ps (h);
        _mm512_storeu_ps (dst + i, v);
    }
    s_widen_c (bf, src + i, dst + i, n - i);
}

__attribute__ ((target ("avx512f"))) static void
s_narrow_avx512 (bool bf, const float *src, uint16_t *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps (src + i);
        __m256i h = bf ? _mm512_cvtepi32_epi16 (_mm512_srli_epi32 (s_bf_round_512 (v), 16))
                       : _mm512_cvtps_ph (v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_si256 ((__m256i *) (dst + i), h);
    }
    s_narrow_c (bf, src + i, dst + i, n - i);
}

__attribute__ ((target ("avx512f"))) static void
s_round_avx512 (bool bf, const float *src, float *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps (src + i);
        __m512 r = bf ? _mm512_castsi512_ps (_mm512_and_si512 (
                            s_bf_round_512 (v), _mm512_set1_epi32 ((int) 0xffff0000u)))
                      : _mm512_cvtph_ps (_mm512_cvtps_ph (
                            v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm512_storeu_ps (dst + i, r);
    }
    s_round_c (bf, src + i, dst + i, n - i);
}

/* --- AVX2 + F16C: 8 lanes ------------------------------------------- */

__attribute__ ((target ("avx2"))) static inline __m256i
s_bf_round_256 (__m256 v)
{
    __m256i x = _mm256_castps_si256 (v);
    __m256i lsb = _mm256_and_si256 (_mm256_srli_epi32 (x, 16), _mm256_set1_epi32 (1));
    __m256i r = _mm256_add_epi32 (_mm256_add_epi32 (x, _mm256_set1_epi32 (0x7fff)), lsb);
    __m256i quiet = _mm256_or_si256 (x, _mm256_set1_epi32 (0x00400000));
    __m256 nan = _mm256_cmp_ps (v, v, _CMP_UNORD_Q);
    return _mm256_castps_si256 (_mm256_blendv_ps (_mm256_castsi256_ps (r),
                                                  _mm256_castsi256_ps (quiet), nan));
}

__attribute__ ((target ("avx2,f16c"))) static void
s_widen_avx2 (bool bf, const uint16_t *src, float *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128 ((const __m128i *) (src + i));
        __m256 v = bf ? _mm256_castsi256_ps (_mm256_slli_epi32 (_mm256_cvtepu16_epi32 (h), 16))
                      : _mm256_cvtph_ps (h);
        _mm256_storeu_ps (dst + i, v);
    }
    s_widen_c (bf, src + i, dst + i, n - i);
}

__attribute__ ((target ("avx2,f16c"))) static void
s_narrow_avx2 (bool bf, const float *src, uint16_t *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps (src + i);
        __m128i h;
        if (bf) {
            /* the high halves, 0..0xffff: packus keeps them as they are */
            __m256i r = _mm256_srli_epi32 (s_bf_round_256 (v), 16);
            h = _mm_packus_epi32 (_mm256_castsi256_si128 (r),
                                  _mm256_extracti128_si256 (r, 1));
        } else {
            h = _mm256_cvtps_ph (v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        _mm_storeu_si128 ((__m128i *) (dst + i), h);
    }
    s_narrow_c (bf, src + i, dst + i, n - i);
}

__attribute__ ((target ("avx2,f16c"))) static void
s_round_avx2 (bool bf, const float *src, float *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps (src + i);
        __m256 r = bf ? _mm256_castsi256_ps (_mm256_and_si256 (
                            s_bf_round_256 (v), _mm256_set1_epi32 ((int) 0xffff0000u)))
                      : _mm256_cvtph_ps (_mm256_cvtps_ph (
                            v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm256_storeu_ps (dst + i, r);
    }
    s_round_c (bf, src + i, dst + i, n - i);
}

#endif

/* --- dispatch ------------------------------------------------------- */

static s_widen_fn *s_widen = s_widen_c;
static s_narrow_fn *s_narrow = s_narrow_c;
static s_round_fn *s_round = s_round_c;
static const char *s_isa = "generic";
static pthread_once_t s_once = PTHREAD_ONCE_INIT;

#if defined(__x86_64__)
/* CPUID leaf 1's F16C bit (clang's __builtin_cpu_supports does not know
 * "f16c"; <cpuid.h> is the same in gcc and clang). */
static bool
s_has_f16c (void)
{
    unsigned a, b, c, d;
    return __get_cpuid (1, &a, &b, &c, &d) && (c & bit_F16C);
}
#endif

/* The engine's ISA decides (KILN_RT_ISA included); F16C comes with
 * every AVX2 CPU kiln has met, but is checked. */
static void
s_init (void)
{
#if defined(__x86_64__)
    const char *isa = kiln_gemm_isa ();
    __builtin_cpu_init ();
    if (strcmp (isa, "avx512") == 0) {
        s_widen = s_widen_avx512;
        s_narrow = s_narrow_avx512;
        s_round = s_round_avx512;
        s_isa = "avx512";
    } else if (strcmp (isa, "avx2") == 0 && s_has_f16c ()) {
        s_widen = s_widen_avx2;
        s_narrow = s_narrow_avx2;
        s_round = s_round_avx2;
        s_isa = "avx2";
    }
#endif
}

void
kiln_convert_widen (kiln_dtype_t dt, const uint16_t *src, float *dst, int64_t n)
{
    pthread_once (&s_once, s_init);
    s_widen (dt != KILN_DT_FLOAT16, src, dst, n);
}

void
kiln_convert_narrow (kiln_dtype_t dt, const float *src, uint16_t *dst, int64_t n)
{
    pthread_once (&s_once, s_init);
    s_narrow (dt != KILN_DT_FLOAT16, src, dst, n);
}

void
kiln_convert_round (kiln_dtype_t dt, const float *src, float *dst, int64_t n)
{
    pthread_once (&s_once, s_init);
    s_round (dt != KILN_DT_FLOAT16, src, dst, n);
}

const char *
kiln_convert_isa (void)
{
    pthread_once (&s_once, s_init);
    return s_isa;
}
