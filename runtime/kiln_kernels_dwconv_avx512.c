/*
 * kiln_kernels_dwconv_avx512 — depthwise convolution planes on AVX-512.  See
 * kiln_kernels_dwconv_avx512.h.
 *
 * The portable loops (kiln_kernels_dwconv.c) sum shifted copies of the padded
 * plane, one long vector loop per tap: every tap loads and stores every
 * accumulator.  Here a vector holds sixteen output columns of one row and
 * eight rows are summed at once in eight registers, stored once when
 * their taps are done.  Stride 1 (kernels 3, 5 and 7 wide, no dilation)
 * reads a zero-bordered copy of the plane, each input row loaded once
 * for the eight output rows that use it; stride 2 reads the input itself,
 * thirty-two columns a tap with the even ones kept (one permute), the
 * padding in the loads' masks and a row of zeros.  AVX-512's masked loads
 * were measured slow on this machine's CPU where most lanes are masked,
 * hence the copy for stride 1.  Against the portable loops and the
 * kernel libraries: bench/bench_kernels.py, docs/engine.md.
 */
#include "runtime/kiln_kernels_dwconv_avx512.h"

#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "runtime/kiln_gemm.h"

#define S_ROWS 8                /* output rows summed at once */

/* Stride 1: the plane copied into a zero-bordered one, S_ROWS rows of
 * zeros more, each row a whole number of vectors plus kw - 1 columns. */
static int64_t
s_pad_w (const kiln_dw_geo_t *g)
{
    return (g->ow + 15) / 16 * 16 + g->kw - 1;
}

static int64_t
s_pad_h (const kiln_dw_geo_t *g)
{
    return (g->oh + S_ROWS - 1) / S_ROWS * S_ROWS + g->kh - 1;
}

static bool
s_padded (const kiln_dw_geo_t *g)
{
    return g->sh == 1 && g->sw == 1 && g->dh == 1 && g->dw == 1
           && (g->kw == 3 || g->kw == 5 || g->kw == 7);
}

int64_t
kiln_dw16_ws_floats (const kiln_dw_geo_t *g)
{
    return s_padded (g) ? s_pad_h (g) * s_pad_w (g) : g->w;
}

bool
kiln_dw16_fits (const kiln_dw_geo_t *g)
{
#if defined(__x86_64__)
    return (s_padded (g) || g->sw == 2) && g->ow >= 8 && g->oh >= 1
           && strcmp (kiln_gemm_isa (), "avx512") == 0;
#else
    (void) g;
    return false;
#endif
}

#if defined(__x86_64__)

/* The lanes l < n with 0 <= c0 + l < w, as a mask (n <= 32). */
static inline uint32_t
s_span (int64_t c0, int64_t n, int64_t w)
{
    int64_t lo = c0 < 0 ? -c0 : 0, hi = w - c0 < n ? w - c0 : n;
    if (hi <= lo)
        return 0;
    uint64_t upto = ((uint64_t) 1 << hi) - 1, below = ((uint64_t) 1 << lo) - 1;
    return (uint32_t) (upto & ~below);
}

/* Rows r0 .. r0 + nr - 1, columns q0 .. q0 + nq - 1 of the plane: the
 * sums (plus the residual).  Inlined, every index of acc is a constant,
 * so the sums stay in registers. */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_store_rows (const kiln_dw_geo_t *g, const __m512 acc[S_ROWS], int64_t r0, int64_t nr,
              int64_t q0, int64_t nq, const float *res, float *y)
{
    __mmask16 sm = (__mmask16) (((uint32_t) 1 << nq) - 1);
#pragma GCC unroll 8
    for (int k = 0; k < S_ROWS; k++) {
        if (k >= nr)
            break;
        int64_t at = (r0 + k) * g->ow + q0;
        __m512 o = acc[k];
        if (res)
            o = _mm512_add_ps (o, _mm512_maskz_loadu_ps (sm, res + at));
        _mm512_mask_storeu_ps (y + at, sm, o);
    }
}

/* Stride 1, kernel width KW: the padded plane `pp` (rows pw floats
 * apart; output (r, q) reads rows r .. r + kh - 1, columns q .. q + KW -
 * 1).  Each input row of a block of S_ROWS output rows is loaded once, KW
 * vectors, and added into every output row that reads it. */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_plane_s1 (const kiln_dw_geo_t *g, const float *pp, int64_t pw, const float *w,
            float bias, const float *res, float *y, const int KW)
{
    for (int64_t r0 = 0; r0 < g->oh; r0 += S_ROWS) {
        int64_t nr = g->oh - r0 < S_ROWS ? g->oh - r0 : S_ROWS;
        for (int64_t q0 = 0; q0 < g->ow; q0 += 16) {
            int64_t nq = g->ow - q0 < 16 ? g->ow - q0 : 16;
            __m512 acc[S_ROWS];
#pragma GCC unroll 8
            for (int k = 0; k < S_ROWS; k++)
                acc[k] = _mm512_set1_ps (bias);
            for (int64_t t = 0; t < S_ROWS + g->kh - 1; t++) {
                const float *src = pp + (r0 + t) * pw + q0;
                __m512 v[7];
#pragma GCC unroll 7
                for (int j = 0; j < KW; j++)
                    v[j] = _mm512_loadu_ps (src + j);
                /* output row k reads this row as its tap row t - k */
#pragma GCC unroll 8
                for (int k = 0; k < S_ROWS; k++) {
                    int64_t i = t - k;
                    if (i < 0 || i >= g->kh)
                        continue;
                    const float *wr = w + i * KW;
#pragma GCC unroll 7
                    for (int j = 0; j < KW; j++)
                        acc[k] = _mm512_fmadd_ps (_mm512_set1_ps (wr[j]), v[j], acc[k]);
                }
            }
            s_store_rows (g, acc, r0, nr, q0, nq, res, y);
        }
    }
}

/* Stride 2 (any dilation): thirty-two input columns a tap, the even ones
 * kept; the padding in the masks of the loads and, for rows, `zero`. */
__attribute__ ((target ("avx512f"))) static void
s_plane_s2 (const kiln_dw_geo_t *g, const float *x, const float *w, float bias,
            const float *res, float *y, const float *zero)
{
    const __m512i even = _mm512_setr_epi32 (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                            24, 26, 28, 30);
    for (int64_t r0 = 0; r0 < g->oh; r0 += S_ROWS) {
        int64_t nr = g->oh - r0 < S_ROWS ? g->oh - r0 : S_ROWS;
        for (int64_t q0 = 0; q0 < g->ow; q0 += 16) {
            int64_t nq = g->ow - q0 < 16 ? g->ow - q0 : 16;
            __m512 acc[S_ROWS];
#pragma GCC unroll 8
            for (int k = 0; k < S_ROWS; k++)
                acc[k] = _mm512_set1_ps (bias);
            for (int64_t i = 0; i < g->kh; i++) {
                /* the input row of tap row i for each output row, or zeros */
                const float *row[S_ROWS];
#pragma GCC unroll 8
                for (int k = 0; k < S_ROWS; k++) {
                    int64_t ih = (r0 + k) * g->sh - g->pt + i * g->dh;
                    row[k] = k < nr && ih >= 0 && ih < g->h ? x + ih * g->w : zero;
                }
                for (int64_t j = 0; j < g->kw; j++) {
                    __m512 wv = _mm512_set1_ps (w[i * g->kw + j]);
                    int64_t c0 = q0 * 2 - g->pl + j * g->dw;
                    uint32_t m = s_span (c0, 2 * nq - 1, g->w);
                    __mmask16 lo = (__mmask16) m, hi = (__mmask16) (m >> 16);
#pragma GCC unroll 8
                    for (int k = 0; k < S_ROWS; k++) {
                        __m512 a = _mm512_maskz_loadu_ps (lo, row[k] + c0);
                        __m512 b = _mm512_maskz_loadu_ps (hi, row[k] + c0 + 16);
                        acc[k] = _mm512_fmadd_ps (wv, _mm512_permutex2var_ps (a, even, b),
                                                  acc[k]);
                    }
                }
            }
            s_store_rows (g, acc, r0, nr, q0, nq, res, y);
        }
    }
}

__attribute__ ((target ("avx512f"))) void
kiln_dw16_plane (const kiln_dw_geo_t *g, const float *x, const float *w, float bias,
                 const float *res, float *y, float *ws)
{
    if (!s_padded (g)) {
        //  the row of zeros (ws_floats: the input's width)
        memset (ws, 0, (size_t) g->w * sizeof *ws);
        s_plane_s2 (g, x, w, bias, res, y, ws);
        return;
    }
    int64_t pw = s_pad_w (g), ph = s_pad_h (g);
    /* the plane at (pt, pl) of a zeroed one */
    for (int64_t r = 0; r < ph; r++) {
        float *dst = ws + r * pw;
        int64_t ih = r - g->pt;
        if (ih < 0 || ih >= g->h) {
            memset (dst, 0, (size_t) pw * sizeof *dst);
            continue;
        }
        int64_t lo = g->pl < pw ? g->pl : pw;
        int64_t n = g->w < pw - lo ? g->w : pw - lo;
        memset (dst, 0, (size_t) lo * sizeof *dst);
        memcpy (dst + lo, x + ih * g->w, (size_t) n * sizeof *dst);
        memset (dst + lo + n, 0, (size_t) (pw - lo - n) * sizeof *dst);
    }
    switch (g->kw) {
    case 3:
        s_plane_s1 (g, ws, pw, w, bias, res, y, 3);
        break;
    case 5:
        s_plane_s1 (g, ws, pw, w, bias, res, y, 5);
        break;
    default:
        s_plane_s1 (g, ws, pw, w, bias, res, y, 7);
        break;
    }
}

#else

void
kiln_dw16_plane (const kiln_dw_geo_t *g, const float *x, const float *w, float bias,
                 const float *res, float *y, float *ws)
{
    (void) g, (void) x, (void) w, (void) bias, (void) res, (void) y, (void) ws;
}

#endif
