/*
 * kiln_gemm_avx2 — the matrix engine's AVX2 + FMA micro-kernels and
 * its 8 × 8-transpose A panels (kiln_gemm_priv.h).  Built for any
 * x86-64 CPU: each function carries its target attribute, and
 * kiln_gemm.c picks them at run time.
 */
#include "runtime/kiln_gemm_priv.h"

#if defined(__x86_64__)

/* Rows r0..r0+3, columns h..h+15 of the tile: 8 accumulators, which is
 * what sixteen ymm registers allow next to the operands. */
__attribute__ ((target ("avx2,fma"))) static void
s_ukr_avx2_4x16 (int64_t kc, const float *a, const float *b, int64_t ldb,
                 float *c, int64_t ldc, bool accumulate)
{
    __m256 c00 = _mm256_setzero_ps (), c01 = _mm256_setzero_ps ();
    __m256 c10 = _mm256_setzero_ps (), c11 = _mm256_setzero_ps ();
    __m256 c20 = _mm256_setzero_ps (), c21 = _mm256_setzero_ps ();
    __m256 c30 = _mm256_setzero_ps (), c31 = _mm256_setzero_ps ();
#define S_ROW(r)                                                  \
    do {                                                          \
        __m256 ar = _mm256_broadcast_ss (a + (r));                \
        c##r##0 = _mm256_fmadd_ps (ar, b0, c##r##0);              \
        c##r##1 = _mm256_fmadd_ps (ar, b1, c##r##1);              \
    } while (0)
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; k++) {
        __m256 b0 = _mm256_loadu_ps (b), b1 = _mm256_loadu_ps (b + 8);
        S_ROW (0); S_ROW (1); S_ROW (2); S_ROW (3);
        a += MR;
        b += ldb;
    }
#undef S_ROW
#define S_STORE(r)                                                            \
    do {                                                                      \
        float *cr = c + (r) * ldc;                                            \
        if (accumulate) {                                                     \
            c##r##0 = _mm256_add_ps (c##r##0, _mm256_loadu_ps (cr));          \
            c##r##1 = _mm256_add_ps (c##r##1, _mm256_loadu_ps (cr + 8));      \
        }                                                                     \
        _mm256_storeu_ps (cr, c##r##0);                                       \
        _mm256_storeu_ps (cr + 8, c##r##1);                                   \
    } while (0)
    S_STORE (0); S_STORE (1); S_STORE (2); S_STORE (3);
#undef S_STORE
}

void
kiln_gukr_avx2 (int64_t kc, const float *a, const float *b, int64_t ldb, float *c,
            int64_t ldc, bool accumulate)
{
    for (int r = 0; r < MR; r += 4)
        for (int h = 0; h < NR; h += 16)
            s_ukr_avx2_4x16 (kc, a + r, b + h, ldb, c + r * ldc + h, ldc,
                             accumulate);
}

void
kiln_gukr_avx2_16 (int64_t kc, const float *a, const float *b, int64_t ldb,
               float *c, int64_t ldc, bool accumulate)
{
    for (int r = 0; r < MR; r += 4)
        s_ukr_avx2_4x16 (kc, a + r, b, ldb, c + r * ldc, ldc, accumulate);
}


/* kiln_gpanel_rows_c by 8 × 8 transposes: the same values. */
__attribute__ ((target ("avx2"))) void
kiln_gpanel_rows_avx2 (float *panel, const float *p0, const float *p1, int sign,
                   int64_t rows, int64_t kc, int64_t rs)
{
    int64_t kk = 0;
    for (; kk + 8 <= kc; kk += 8) {
        __m256 v[8];
        for (int r = 0; r < MR; r++) {
            if (r >= rows) {
                v[r] = _mm256_setzero_ps ();
                continue;
            }
            v[r] = _mm256_loadu_ps (p0 + r * rs + kk);
            if (sign > 0)
                v[r] = _mm256_add_ps (v[r], _mm256_loadu_ps (p1 + r * rs + kk));
            else if (sign < 0)
                v[r] = _mm256_sub_ps (v[r], _mm256_loadu_ps (p1 + r * rs + kk));
        }
        kiln_gtranspose8 (v);
        for (int t = 0; t < 8; t++)
            _mm256_storeu_ps (panel + (kk + t) * MR, v[t]);
    }
    if (kk < kc)
        kiln_gpanel_rows_c (panel + kk * MR, p0 + kk, p1 ? p1 + kk : NULL, sign, rows,
                        kc - kk, rs);
}

/* kiln_gcols_fn: eight steps of eight columns at a time, transposed in
 * registers (the columns' runs read in order), where the portable loop
 * stores one float at a time 128 bytes apart. */
__attribute__ ((target ("avx2"))) void
kiln_gpanel_cols_avx2 (float *panel, const float *src, int64_t cols, int64_t kc,
                       int64_t cs)
{
    int64_t kk = 0;
    for (; kk + 8 <= kc; kk += 8) {
        __m256 v[8];
        for (int c = 0; c < 8; c++)
            v[c] = c < cols ? _mm256_loadu_ps (src + c * cs + kk) : _mm256_setzero_ps ();
        kiln_gtranspose8 (v);
        for (int t = 0; t < 8; t++)
            _mm256_storeu_ps (panel + (kk + t) * NR, v[t]);
    }
    if (kk < kc)
        kiln_gpanel_cols_c (panel + kk * NR, src + kk, cols, kc - kk, cs);
}

#endif
