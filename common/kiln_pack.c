#include "common/kiln_pack.h"

#include <string.h>

static bool
s_panels (int64_t rows, int64_t width, int64_t k, int64_t *out)
{
    if (rows < 0 || k < 0)
        return false;
    int64_t panels = rows / width + (rows % width != 0), r;
    if (__builtin_mul_overflow (panels, width, &r)
        || __builtin_mul_overflow (r, k, out))
        return false;
    return true;
}

bool
kiln_pack_a_elems (int64_t m, int64_t k, int64_t *out)
{
    return s_panels (m, KILN_PACK_MR, k, out);
}

bool
kiln_pack_b_elems (int64_t k, int64_t n, int64_t *out)
{
    return s_panels (n, KILN_PACK_NR, k, out);
}

bool
kiln_pack_conv_elems (int64_t m, int64_t cg, int64_t kh, int64_t kw,
                      int64_t group, int64_t *out)
{
    int64_t k, per;
    if (group < 1 || m % group != 0 || __builtin_mul_overflow (cg, kh, &k)
        || __builtin_mul_overflow (k, kw, &k)
        || !kiln_pack_a_elems (m / group, k, &per))
        return false;
    return !__builtin_mul_overflow (per, group, out);
}

void
kiln_pack_a (const float *a, int64_t m, int64_t k, int64_t rs, int64_t cs,
             float *out)
{
    for (int64_t p = 0; p * KILN_PACK_MR < m; p++) {
        float *panel = out + p * KILN_PACK_MR * k;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t r = 0; r < KILN_PACK_MR; r++) {
                int64_t i = p * KILN_PACK_MR + r;
                panel[kk * KILN_PACK_MR + r] = i < m ? a[i * rs + kk * cs] : 0.0f;
            }
    }
}

void
kiln_pack_b (const float *b, int64_t k, int64_t n, int64_t rs, int64_t cs,
             float *out)
{
    for (int64_t q = 0; q * KILN_PACK_NR < n; q++) {
        float *panel = out + q * KILN_PACK_NR * k;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t c = 0; c < KILN_PACK_NR; c++) {
                int64_t j = q * KILN_PACK_NR + c;
                panel[kk * KILN_PACK_NR + c] = j < n ? b[kk * rs + j * cs] : 0.0f;
            }
    }
}

void
kiln_pack_conv (const float *w, int64_t m, int64_t cg, int64_t kh, int64_t kw,
                int64_t group, float *out)
{
    int64_t mg = m / group, taps = kh * kw, k = cg * taps, per;
    kiln_pack_a_elems (mg, k, &per);
    for (int64_t g = 0; g < group; g++) {
        float *dst = out + g * per;
        const float *wg = w + g * mg * k;
        /* Row i of this group's A is output channel g·mg + i; element
         * kk = tap·cg + c is W[.., c, tap] = wg[i·k + c·taps + tap]. */
        for (int64_t p = 0; p * KILN_PACK_MR < mg; p++) {
            float *panel = dst + p * KILN_PACK_MR * k;
            for (int64_t t = 0; t < taps; t++)
                for (int64_t c = 0; c < cg; c++) {
                    int64_t kk = t * cg + c;
                    for (int64_t r = 0; r < KILN_PACK_MR; r++) {
                        int64_t i = p * KILN_PACK_MR + r;
                        panel[kk * KILN_PACK_MR + r] =
                            i < mg ? wg[i * k + c * taps + t] : 0.0f;
                    }
                }
        }
    }
}
