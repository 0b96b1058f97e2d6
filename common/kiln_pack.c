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

bool
kiln_pack_conv_t_elems (int64_t m, int64_t cg, int64_t kh, int64_t kw,
                        int64_t group, int64_t *out)
{
    int64_t k, per;
    if (group < 1 || m % group != 0 || __builtin_mul_overflow (cg, kh, &k)
        || __builtin_mul_overflow (k, kw, &k)
        || !kiln_pack_b_elems (k, m / group, &per))
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
kiln_pack_b_u16 (const uint16_t *b, int64_t k, int64_t n, int64_t rs, int64_t cs,
                 uint16_t *out)
{
    for (int64_t q = 0; q * KILN_PACK_NR < n; q++) {
        uint16_t *panel = out + q * KILN_PACK_NR * k;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t c = 0; c < KILN_PACK_NR; c++) {
                int64_t j = q * KILN_PACK_NR + c;
                panel[kk * KILN_PACK_NR + c] = j < n ? b[kk * rs + j * cs] : 0;
            }
    }
}

/* The conv weight W[m, cg, kh, kw] in `group` groups of panels `width`
 * output channels wide: row (or column) i of group g's matrix is output
 * channel g·mg + i, and its element kk = tap·cg + c is W[.., c, tap] =
 * wg[i·k + c·taps + tap].  `per` is one group's packed size. */
static void
s_pack_conv (const float *w, int64_t m, int64_t cg, int64_t taps, int64_t group,
             int64_t width, int64_t per, float *out)
{
    int64_t mg = m / group, k = cg * taps;
    for (int64_t g = 0; g < group; g++) {
        float *dst = out + g * per;
        const float *wg = w + g * mg * k;
        for (int64_t p = 0; p * width < mg; p++) {
            float *panel = dst + p * width * k;
            for (int64_t t = 0; t < taps; t++)
                for (int64_t c = 0; c < cg; c++) {
                    int64_t kk = t * cg + c;
                    for (int64_t r = 0; r < width; r++) {
                        int64_t i = p * width + r;
                        panel[kk * width + r] = i < mg ? wg[i * k + c * taps + t] : 0.0f;
                    }
                }
        }
    }
}

void
kiln_pack_conv (const float *w, int64_t m, int64_t cg, int64_t kh, int64_t kw,
                int64_t group, float *out)
{
    int64_t per;
    kiln_pack_a_elems (m / group, cg * kh * kw, &per);
    s_pack_conv (w, m, cg, kh * kw, group, KILN_PACK_MR, per, out);
}

void
kiln_pack_conv_t (const float *w, int64_t m, int64_t cg, int64_t kh, int64_t kw,
                  int64_t group, float *out)
{
    int64_t per;
    kiln_pack_b_elems (cg * kh * kw, m / group, &per);
    s_pack_conv (w, m, cg, kh * kw, group, KILN_PACK_NR, per, out);
}

int64_t
kiln_pack_padded_extent (int64_t out, int64_t k, int64_t s, int64_t d, int64_t pad_begin,
                         int64_t in)
{
    int64_t reach = (out - 1) * s + (k - 1) * d + 1;
    return reach > pad_begin + in ? reach : pad_begin + in;
}

bool
kiln_pack_conv_inplace (int64_t cg, int64_t kh, int64_t kw, int64_t wp, int64_t ow)
{
    if (cg < 1 || kh < 1 || kw < 1 || wp < 1 || ow < 1 || kh * kw < 2
        || kh * kw > KILN_PACK_INPLACE_TAPS || (ow % KILN_PACK_MR != 0 && ow % 7 != 0)
        || wp > KILN_PACK_INPLACE_BYTES || cg > KILN_PACK_INPLACE_BYTES)
        return false;
    return kh * cg * wp * (int64_t) sizeof (float) <= KILN_PACK_INPLACE_BYTES;
}

bool
kiln_pack_wino_elems (int64_t m, int64_t c, int tile, int64_t *out)
{
    int64_t per;
    return (tile == 2 || tile == 4) && kiln_pack_a_elems (m, c, &per)
           && !__builtin_mul_overflow (per, KILN_PACK_WINO_POINTS (tile), out);
}

bool
kiln_pack_wino_t_elems (int64_t m, int64_t c, int tile, int64_t *out)
{
    int64_t per;
    return (tile == 2 || tile == 4) && kiln_pack_b_elems (c, m, &per)
           && !__builtin_mul_overflow (per, KILN_PACK_WINO_POINTS (tile), out);
}

static void s_pack_wino_as (const float *w, int64_t m, int64_t c, int tile,
                            bool trans, float *out);

void
kiln_pack_wino (const float *w, int64_t m, int64_t c, int tile, float *out)
{
    s_pack_wino_as (w, m, c, tile, false, out);
}

void
kiln_pack_wino_t (const float *w, int64_t m, int64_t c, int tile, float *out)
{
    s_pack_wino_as (w, m, c, tile, true, out);
}

/* U = G·g·Gᵀ per (m, c), in double, stored A-packed [M, C] per point, or
 * B-packed [C, M] (`trans`). */
static void
s_pack_wino_as (const float *w, int64_t m, int64_t c, int tile, bool trans,
                float *out)
{
    static const double G2[4][3] = {
        { 1, 0, 0 }, { 0.5, 0.5, 0.5 }, { 0.5, -0.5, 0.5 }, { 0, 0, 1 } };
    static const double G4[6][3] = {
        { 1.0 / 4, 0, 0 }, { -1.0 / 6, -1.0 / 6, -1.0 / 6 },
        { -1.0 / 6, 1.0 / 6, -1.0 / 6 }, { 1.0 / 24, 1.0 / 12, 1.0 / 6 },
        { 1.0 / 24, -1.0 / 12, 1.0 / 6 }, { 0, 0, 1 } };
    int a = tile + 2;
    const double (*G)[3] = tile == 4 ? G4 : G2;
    int64_t per;
    if (trans)
        kiln_pack_b_elems (c, m, &per);
    else
        kiln_pack_a_elems (m, c, &per);
    /* G g Gᵀ in double, one (m, c) at a time */
    for (int64_t o = 0; o < m; o++)
        for (int64_t ci = 0; ci < c; ci++) {
            const float *g = w + (o * c + ci) * 9;
            double t[6][3], u[6][6];
            for (int i = 0; i < a; i++)
                for (int j = 0; j < 3; j++)
                    t[i][j] = G[i][0] * g[0 * 3 + j] + G[i][1] * g[1 * 3 + j]
                              + G[i][2] * g[2 * 3 + j];
            for (int i = 0; i < a; i++)
                for (int j = 0; j < a; j++)
                    u[i][j] = t[i][0] * G[j][0] + t[i][1] * G[j][1]
                              + t[i][2] * G[j][2];
            int64_t width = trans ? KILN_PACK_NR : KILN_PACK_MR;
            int64_t p = o / width, r = o % width;
            for (int x = 0; x < a * a; x++)
                out[x * per + p * width * c + ci * width + r] = (float) u[x / a][x % a];
        }
    /* rows (columns) past m in the last panel stay as the caller zeroed them */
}
