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

/* The engine runs AVX-512 (not forced narrower by KILN_RT_ISA). */
static bool
s_avx512 (void)
{
#if defined(__x86_64__)
    return kiln_gemm_avx512 ();
#else
    return false;
#endif
}

bool
kiln_dw16_fits (const kiln_dw_geo_t *g)
{
    return (s_padded (g) || g->sw == 2) && g->ow >= 8 && g->oh >= 1 && s_avx512 ();
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

/* --- sixteen planes at once, for small planes ----------------------- */

void
kiln_dw_extent (const kiln_dw_geo_t *g, int64_t *hp, int64_t *wp)
{
    int64_t need_h = (g->oh - 1) * g->sh + (g->kh - 1) * g->dh + 1;
    int64_t need_w = (g->ow - 1) * g->sw + (g->kw - 1) * g->dw + 1;
    *hp = g->h + g->pt > need_h ? g->h + g->pt : need_h;
    *wp = g->w + g->pl > need_w ? g->w + g->pl : need_w;
}

int64_t
kiln_dwc16_ws_floats (const kiln_dw_geo_t *g)
{
    int64_t hp, wp;
    kiln_dw_extent (g, &hp, &wp);
    /* lanes, weights, bias, a tail of 16 x 16, a spare output plane, and
     * alignment */
    return (hp * wp + g->kh * g->kw + 1) * 16 + 256 + g->oh * g->ow + 16;
}

bool
kiln_dwc16_fits (const kiln_dw_geo_t *g)
{
    int64_t hp, wp;
    kiln_dw_extent (g, &hp, &wp);
    return g->oh * g->ow <= KILN_DWC16_MAX_OUT && hp * wp <= 4 * KILN_DWC16_MAX_OUT
           && s_avx512 ();
}

#if defined(__x86_64__)

/* r[i][j] = r[j][i]: a 16 x 16 block of floats, one row a register. */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_tr16 (__m512 r[16])
{
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps (r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps (r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd (t[4 * i]), b = _mm512_castps_pd (t[4 * i + 2]);
        __m512d c = _mm512_castps_pd (t[4 * i + 1]), d = _mm512_castps_pd (t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps (_mm512_unpacklo_pd (a, b));
        r[4 * i + 1] = _mm512_castpd_ps (_mm512_unpackhi_pd (a, b));
        r[4 * i + 2] = _mm512_castpd_ps (_mm512_unpacklo_pd (c, d));
        r[4 * i + 3] = _mm512_castpd_ps (_mm512_unpackhi_pd (c, d));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4 (r[i], r[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4 (r[i], r[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_f32x4 (r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4 (r[8 + i], r[12 + i], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4 (t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4 (t[i], t[8 + i], 0xdd);
        r[4 + i] = _mm512_shuffle_f32x4 (t[4 + i], t[12 + i], 0x88);
        r[12 + i] = _mm512_shuffle_f32x4 (t[4 + i], t[12 + i], 0xdd);
    }
}

/* Sixteen outputs from position q0 on (n of them; the others are not
 * used), each lane's taps in row-major order.  The taps are the outer
 * loop: sixteen independent sums, so that the multiply-adds never wait
 * on each other.  KH and KW constant when inlined with constants. */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_c16_outputs (const kiln_dw_geo_t *g, const float *t, int64_t wp, const float *wv,
               __m512 bv, int64_t q0, int n, int64_t KH, int64_t KW, __m512 acc[16])
{
    const float *base[16];
    int64_t r = q0 / g->ow, c = q0 % g->ow;
    for (int j = 0; j < 16; j++) {
        base[j] = j < n ? t + (r * g->sh * wp + c * g->sw) * 16 : t;
        if (++c == g->ow) {
            c = 0;
            r++;
        }
        acc[j] = bv;
    }
#pragma GCC unroll 7
    for (int64_t i = 0; i < KH; i++)
#pragma GCC unroll 7
        for (int64_t k = 0; k < KW; k++) {
            __m512 w = _mm512_load_ps (wv + (i * KW + k) * 16);
            int64_t off = (i * g->dh * wp + k * g->dw) * 16;
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++)
                acc[j] = _mm512_fmadd_ps (w, _mm512_load_ps (base[j] + off), acc[j]);
        }
}

/* Lane l's sixteen outputs from `at` (acc[l] after the transpose): the
 * residual, the simple activations (NaN kept: max and min return their
 * second operand when either is NaN), stored where `keep` says.  RES and
 * ACT constant when inlined with constants. */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_c16_store (__m512 acc[16], float *const y[16], const float *const res[16], int64_t at,
             __mmask16 keep, bool RES, kiln_act_t ACT, __m512 lo, __m512 hi)
{
#pragma GCC unroll 16
    for (int l = 0; l < 16; l++) {
        __m512 v = acc[l];
        if (RES)
            v = _mm512_add_ps (v, _mm512_loadu_ps (res[l] + at));
        if (ACT == KILN_ACT_RELU)
            v = _mm512_max_ps (_mm512_setzero_ps (), v);
        else if (ACT == KILN_ACT_CLIP)
            v = _mm512_min_ps (hi, _mm512_max_ps (lo, v));
        _mm512_mask_storeu_ps (y[l] + at, keep, v);
    }
}

__attribute__ ((target ("avx512f"))) void
kiln_dwc16_planes (const kiln_dw_geo_t *g, int nl, const float *const x_[16],
                   const float *const w_[16], const float bias[16],
                   const float *const res_[16], float *const y_[16], kiln_act_t act,
                   float act_a, float act_b, float *ws)
{
    int64_t hp, wp, taps = g->kh * g->kw, hw = g->h * g->w, ohw = g->oh * g->ow;
    kiln_dw_extent (g, &hp, &wp);
    float *t = (float *) (((uintptr_t) ws + 63) & ~(uintptr_t) 63);
    float *wv = t + hp * wp * 16, *tail = wv + (taps + 1) * 16, *spare = tail + 256;
    /* Lanes past nl repeat lane 0's input and write to `spare` (or, for
     * a plane under 16, to `tail`): every loop runs over all sixteen. */
    const float *x[16], *w[16], *res[16];
    float *y[16];
    for (int l = 0; l < 16; l++) {
        bool in = l < nl;
        x[l] = x_[in ? l : 0];
        w[l] = w_[in ? l : 0];
        res[l] = res_ ? res_[in ? l : 0] : NULL;
        y[l] = in ? y_[l] : spare;
    }
    memset (t, 0, (size_t) (hp * wp * 16) * sizeof *t);
    for (int64_t k = 0; k < taps; k++)
        for (int l = 0; l < 16; l++)
            wv[k * 16 + l] = w[l][k];
    for (int l = 0; l < 16; l++)
        wv[taps * 16 + l] = l < nl ? bias[l] : 0.0f;
    /* the input, 16 positions of the 16 planes at a time, transposed into
     * [row][column][lane]; the last 16 of a plane read where the previous
     * ones ended or before (whole vectors in the plane: masked loads
     * with most lanes off are slow on this CPU), a plane under 16 from a
     * copy */
    __m512 r[16];
    for (int64_t p0 = 0; p0 < hw; p0 += 16) {
        int64_t at = hw >= 16 && p0 + 16 > hw ? hw - 16 : p0;
        if (hw >= 16) {
#pragma GCC unroll 16
            for (int l = 0; l < 16; l++)
                r[l] = _mm512_loadu_ps (x[l] + at);
        } else {
            for (int l = 0; l < 16; l++) {
                memset (tail, 0, 16 * sizeof *tail);
                memcpy (tail, x[l], (size_t) hw * sizeof *tail);
                r[l] = _mm512_load_ps (tail);
            }
        }
        s_tr16 (r);
        int n = hw < 16 ? (int) hw : 16;
        int64_t ih = at / g->w, iw = at % g->w;
        for (int j = 0; j < n; j++) {
            _mm512_store_ps (t + ((ih + g->pt) * wp + iw + g->pl) * 16, r[j]);
            if (++iw == g->w) {
                iw = 0;
                ih++;
            }
        }
    }
    __m512 bv = _mm512_load_ps (wv + taps * 16);
    __m512 lo = _mm512_set1_ps (act_a), hi = _mm512_set1_ps (act_b);
    kiln_act_t inl = act == KILN_ACT_RELU || act == KILN_ACT_CLIP ? act : KILN_ACT_NONE;
    for (int64_t q0 = 0; q0 < ohw; q0 += 16) {
        /* the last 16 of a plane end where it ends; only the outputs not
         * stored yet are (the residual may be read where Y is written) */
        int64_t at = ohw >= 16 && q0 + 16 > ohw ? ohw - 16 : q0;
        int n = ohw < 16 ? (int) ohw : 16;
        __mmask16 keep = (__mmask16) (0xffffu << (q0 - at));
        __m512 acc[16];
        if (g->kh == 3 && g->kw == 3)
            s_c16_outputs (g, t, wp, wv, bv, at, n, 3, 3, acc);
        else if (g->kh == 5 && g->kw == 5)
            s_c16_outputs (g, t, wp, wv, bv, at, n, 5, 5, acc);
        else
            s_c16_outputs (g, t, wp, wv, bv, at, n, g->kh, g->kw, acc);
        s_tr16 (acc);
        if (n < 16) {
            /* a plane under 16 outputs: by way of `tail` */
            for (int l = 0; l < nl; l++) {
                _mm512_store_ps (tail, acc[l]);
                for (int j = 0; j < n; j++) {
                    float o = tail[j] + (res[l] ? res[l][j] : 0.0f);
                    if (inl == KILN_ACT_RELU)
                        o = o < 0.0f ? 0.0f : o;
                    else if (inl == KILN_ACT_CLIP)
                        o = o < act_a ? act_a : o > act_b ? act_b : o;
                    y[l][j] = o;
                }
            }
            continue;
        }
        bool rs = res[0] != NULL;
        if (inl == KILN_ACT_RELU)
            rs ? s_c16_store (acc, y, res, at, keep, true, KILN_ACT_RELU, lo, hi)
               : s_c16_store (acc, y, res, at, keep, false, KILN_ACT_RELU, lo, hi);
        else if (inl == KILN_ACT_CLIP)
            rs ? s_c16_store (acc, y, res, at, keep, true, KILN_ACT_CLIP, lo, hi)
               : s_c16_store (acc, y, res, at, keep, false, KILN_ACT_CLIP, lo, hi);
        else
            rs ? s_c16_store (acc, y, res, at, keep, true, KILN_ACT_NONE, lo, hi)
               : s_c16_store (acc, y, res, at, keep, false, KILN_ACT_NONE, lo, hi);
    }
    if (inl != act)
        for (int l = 0; l < nl; l++)
            kiln_act_apply (y[l], ohw, act, act_a, act_b);
}

#else

void
kiln_dwc16_planes (const kiln_dw_geo_t *g, int nl, const float *const x[16],
                   const float *const w[16], const float bias[16],
                   const float *const res[16], float *const y[16], kiln_act_t act,
                   float act_a, float act_b, float *ws)
{
    (void) g, (void) nl, (void) x, (void) w, (void) bias, (void) res, (void) y;
    (void) act, (void) act_a, (void) act_b, (void) ws;
}

#endif
