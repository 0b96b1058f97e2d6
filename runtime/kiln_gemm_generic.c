/*
 * kiln_gemm_generic — the matrix engine's portable micro-kernels and A
 * panel transpose (kiln_gemm_priv.h): plain C, for any CPU, and the
 * reference the vector forms must match.
 */
#include "runtime/kiln_gemm_priv.h"

#include <string.h>

static void
s_ukr_generic_w (int64_t kc, const float *a, const float *b, int64_t ldb,
                 float *c, int64_t ldc, bool accumulate, int width)
{
    float acc[MR][NR];
    memset (acc, 0, sizeof acc);
    for (int64_t k = 0; k < kc; k++, a += MR, b += ldb)
        for (int r = 0; r < MR; r++)
            for (int j = 0; j < width; j++)
                acc[r][j] += a[r] * b[j];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < width; j++)
            c[r * ldc + j] = accumulate ? c[r * ldc + j] + acc[r][j] : acc[r][j];
}

void
kiln_gukr_generic (int64_t kc, const float *a, const float *b, int64_t ldb,
               float *c, int64_t ldc, bool accumulate)
{
    s_ukr_generic_w (kc, a, b, ldb, c, ldc, accumulate, NR);
}

void
kiln_gukr_generic_16 (int64_t kc, const float *a, const float *b, int64_t ldb,
                  float *c, int64_t ldc, bool accumulate)
{
    s_ukr_generic_w (kc, a, b, ldb, c, ldc, accumulate, NR / 2);
}

void
kiln_gpanel_rows_c (float *panel, const float *p0, const float *p1, int sign,
                int64_t rows, int64_t kc, int64_t rs)
{
    for (int64_t kk = 0; kk < kc; kk++)
        for (int64_t r = 0; r < MR; r++) {
            float v = 0.0f;
            if (r < rows) {
                v = p0[r * rs + kk];
                if (sign > 0)
                    v = v + p1[r * rs + kk];
                else if (sign < 0)
                    v = v - p1[r * rs + kk];
            }
            panel[kk * MR + r] = v;
        }
}

void
kiln_gpanel_cols_c (float *panel, const float *src, int64_t cols, int64_t kc, int64_t cs)
{
    for (int64_t kk = 0; kk < kc; kk++)
        for (int64_t c = 0; c < 8; c++)
            panel[kk * NR + c] = c < cols ? src[c * cs + kk] : 0.0f;
}
