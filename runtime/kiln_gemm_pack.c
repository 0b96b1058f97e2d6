/*
 * kiln_gemm_pack — the matrix engine's packing at run time: strided A
 * and B, a convolution's im2col panels, a half B widened
 * (kiln_gemm_priv.h; common/kiln_pack.h for the layouts).
 */
#include "runtime/kiln_gemm_priv.h"

#include <string.h>

#include "runtime/kiln_convert.h"
#include "runtime/kiln_vmath.h"

/* An operand's prologue (kiln_gpro_t) at step k of n floats: from src
 * into d (the same, or apart).  Inlined in the callers' clones, so that
 * it vectorises for each; a constant n (a panel's MR, 7 or NR) is one
 * or two vectors. */
static inline __attribute__ ((always_inline)) void
s_pro_run (const kiln_gpro_t *pro, int64_t k, float *d, const float *src, int64_t n)
{
    float sc = pro->s[k], sh = pro->b[k];
    if (pro->relu)
        for (int64_t j = 0; j < n; j++) {
            float v = src[j] * sc + sh;
            d[j] = v < 0.0f ? 0.0f : v;
        }
    else
        for (int64_t j = 0; j < n; j++)
            d[j] = src[j] * sc + sh;
}

/* The prologue in place on the `used` first of the `width` floats of
 * each of the kc steps (k0..) of a packed panel. */
static inline __attribute__ ((always_inline)) void
s_prologue (const kiln_gpro_t *pro, float *panel, int64_t width, int64_t used, int64_t k0,
            int64_t kc)
{
    for (int64_t kk = 0; kk < kc; kk++) {
        float *d = panel + kk * width;
        if (used == NR)
            s_pro_run (pro, k0 + kk, d, d, NR);
        else
            s_pro_run (pro, k0 + kk, d, d, used);
    }
}

/* Rows m0..m0+mr-1, k0..k0+kc-1 of a strided A into panels of kc × MR,
 * `rp` rows (MR or 7) to a panel; the rest of a panel is zero. */
KILN_VCLONES void
kiln_gpack_a_strided (const kiln_gsrc_t *s, const kiln_gpro_t *pro, int64_t m0,
                      int64_t mr, int64_t k0, int64_t kc, float *dst, int64_t rp)
{
    for (int64_t p = 0; p * rp < mr; p++) {
        float *panel = dst + p * kc * MR;
        int64_t rows = s_min (rp, mr - p * rp);
        if (rows < MR)
            memset (panel, 0, (size_t) (kc * MR) * sizeof *panel);
        if (s->rs == 1) {
            /* Rows are adjacent (a matrix read transposed, a convolution's
             * positions): a run of `rows` floats per step of k. */
            const float *src = s->p + m0 + p * rp + k0 * s->cs;
            if (pro && pro->s && rows == MR)
                for (int64_t kk = 0; kk < kc; kk++)
                    s_pro_run (pro, k0 + kk, panel + kk * MR, src + kk * s->cs, MR);
            else if (pro && pro->s && rows == 7)
                for (int64_t kk = 0; kk < kc; kk++)
                    s_pro_run (pro, k0 + kk, panel + kk * MR, src + kk * s->cs, 7);
            else if (pro && pro->s)
                for (int64_t kk = 0; kk < kc; kk++)
                    s_pro_run (pro, k0 + kk, panel + kk * MR, src + kk * s->cs, rows);
            else if (rows == MR)
                for (int64_t kk = 0; kk < kc; kk++)
                    memcpy (panel + kk * MR, src + kk * s->cs, MR * sizeof *panel);
            else if (rows == 7)
                for (int64_t kk = 0; kk < kc; kk++)
                    memcpy (panel + kk * MR, src + kk * s->cs, 7 * sizeof *panel);
            else
                for (int64_t kk = 0; kk < kc; kk++)
                    memcpy (panel + kk * MR, src + kk * s->cs,
                            (size_t) rows * sizeof *panel);
            continue;
        }
        if (s->cs == 1) {
            /* rows along k: a panel is a transpose of rows × kc */
            kiln_gisa.panel_rows (panel, s->p + (m0 + p * rp) * s->rs + k0, NULL, 0, rows,
                          kc, s->rs);
            if (pro && pro->s)
                s_prologue (pro, panel, MR, rows, k0, kc);
            continue;
        }
        for (int64_t r = 0; r < rows; r++) {
            const float *src = s->p + (m0 + p * rp + r) * s->rs + k0 * s->cs;
            if (s->cs == 1)
                for (int64_t kk = 0; kk < kc; kk++)
                    panel[kk * MR + r] = src[kk];
            else
                for (int64_t kk = 0; kk < kc; kk++)
                    panel[kk * MR + r] = src[kk * s->cs];
        }
        if (pro && pro->s)
            s_prologue (pro, panel, MR, rows, k0, kc);
    }
}

/* Columns n0..n0+nw-1, k0..k0+kc-1 of a strided B into panels of kc × NR. */
KILN_VCLONES void
kiln_gpack_b_strided (const kiln_gsrc_t *s, const kiln_gpro_t *pro, int64_t k0,
                      int64_t kc, int64_t n0, int64_t nw, float *dst)
{
    for (int64_t q = 0; q * NR < nw; q++) {
        float *panel = dst + q * kc * NR;
        int64_t j0 = n0 + q * NR, cols = s_min (NR, nw - q * NR);
        if (s->cs == 1 && cols == NR && pro && pro->s) {
            for (int64_t kk = 0; kk < kc; kk++)
                s_pro_run (pro, k0 + kk, panel + kk * NR, s->p + (k0 + kk) * s->rs + j0, NR);
            continue;
        }
        if (s->cs == 1 && cols == NR) {
            /* a constant size: the copy is two vector moves */
            for (int64_t kk = 0; kk < kc; kk++)
                memcpy (panel + kk * NR, s->p + (k0 + kk) * s->rs + j0,
                        NR * sizeof *panel);
        } else if (s->cs == 1) {
            for (int64_t kk = 0; kk < kc; kk++) {
                const float *src = s->p + (k0 + kk) * s->rs + j0;
                float *d = panel + kk * NR;
                memcpy (d, src, (size_t) cols * sizeof *d);
                if (cols < NR)
                    memset (d + cols, 0, (size_t) (NR - cols) * sizeof *d);
            }
        } else if (s->rs == 1) {
            /* columns along k (a matrix read transposed: attention's
             * keys): eight at a time */
            for (int64_t c0 = 0; c0 < NR; c0 += 8) {
                int64_t n = s_min (8, cols - c0);
                kiln_gisa.panel_cols (panel + c0, n > 0 ? s->p + k0 + (j0 + c0) * s->cs : s->p,
                                      n > 0 ? n : 0, kc, s->cs);
            }
        } else {
            /* Column by column: each reads its run of k in order. */
            if (cols < NR)
                memset (panel, 0, (size_t) (kc * NR) * sizeof *panel);
            for (int64_t j = 0; j < cols; j++) {
                const float *src = s->p + k0 * s->rs + (j0 + j) * s->cs;
                for (int64_t kk = 0; kk < kc; kk++)
                    panel[kk * NR + j] = src[kk * s->rs];
            }
        }
        if (pro && pro->s)
            s_prologue (pro, panel, NR, cols, k0, kc);
    }
}

typedef struct {
    int off, len;           /* columns of the panel */
    int64_t oh, ow;         /* output position of the first */
} s_seg_t;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__)
#include <immintrin.h>
#define S_MASKED_RUNS 1

/* n channels' runs of len <= 16 floats, rows `width` apart in d, planes
 * hw apart in src: elements tlo..thi - 1 copied, the others zero (the
 * input's border).  One masked load and store a channel; the lanes
 * masked off are never read, so a run may start before the plane. */
__attribute__ ((target ("avx512f"))) static void
s_runs16 (float *d, const float *src, int64_t hw, int64_t width, int64_t n, int64_t tlo,
          int64_t thi, int64_t len)
{
    __mmask16 ld = (__mmask16) (((1u << thi) - 1u) & ~((1u << tlo) - 1u));
    __mmask16 st = (__mmask16) ((1u << len) - 1u);
    for (int64_t c = 0; c < n; c++, src += hw, d += width)
        _mm512_mask_storeu_ps (d, st, _mm512_maskz_loadu_ps (ld, src));
}
#else
#define S_MASKED_RUNS 0
#endif

/* Columns n0..n0+nw-1 (output positions), k0..k0+kc-1 (tap-major) of the
 * im2col matrix of a convolution input, into panels of kc × `width`, `used`
 * of them filled: B panels (width and used NR), or A panels of the
 * transposed product (width MR, used MR or 7: the positions as rows).
 * For one tap and a run of output positions in one output row, every
 * input channel is read at the same offset in its plane: the loop over
 * channels is innermost.  The runs are a few floats long (7 at a 14 × 14
 * plane's border), so their copies and zeros stay loops: as memset and
 * memcpy calls, one a channel, they took a third of a 3×3
 * convolution's time at 14 × 14 (KILN_NO_LIBCALLS). */
KILN_VCLONES KILN_NO_LIBCALLS void
kiln_gpack_conv (const kiln_gsrc_t *s, int64_t k0, int64_t kc, int64_t n0,
             int64_t nw, float *dst, int64_t width, int64_t used)
{
    const kiln_gconv_t *cv = s->conv;
    int64_t hw = cv->h * cv->w;
    for (int64_t q = 0; q * used < nw; q++) {
        float *panel = dst + q * kc * width;
        int64_t j0 = n0 + q * used, cols = s_min (used, nw - q * used);
        s_seg_t seg[NR];
        int nseg = 0;
        for (int64_t j = 0; j < cols;) {
            int64_t oh = (j0 + j) / cv->ow, ow = (j0 + j) % cv->ow;
            int64_t len = s_min (cols - j, cv->ow - ow);
            seg[nseg++] = (s_seg_t) { (int) j, (int) len, oh, ow };
            j += len;
        }
        if (cols < width)       /* (a panel of 7 rows has one such) */
            for (int64_t kk = 0; kk < kc; kk++)
                for (int64_t j = cols; j < width; j++)
                    panel[kk * width + j] = 0.0f;
        for (int64_t k = k0; k < k0 + kc;) {
            int64_t tap = k / cv->c, c0 = k % cv->c;
            int64_t c1 = s_min (cv->c, c0 + (k0 + kc - k));
            int64_t ki = tap / cv->kw, kj = tap % cv->kw;
            float *rows = panel + (k - k0) * width;
            for (int si = 0; si < nseg; si++) {
                const s_seg_t *sg = &seg[si];
                int64_t ih = sg->oh * cv->sh - cv->pt + ki * cv->dh;
                int64_t len = sg->len;
                if (ih < 0 || ih >= cv->h) {
                    for (int64_t c = c0; c < c1; c++)
                        for (int64_t t = 0; t < len; t++)
                            rows[(c - c0) * width + sg->off + t] = 0.0f;
                    continue;
                }
                /* Valid t: 0 <= iw0 + t·sw < w. */
                int64_t iw0 = sg->ow * cv->sw - cv->pl + kj * cv->dw;
                int64_t tlo = iw0 >= 0 ? 0 : (-iw0 + cv->sw - 1) / cv->sw;
                int64_t thi = iw0 >= cv->w ? 0 : (cv->w - 1 - iw0) / cv->sw + 1;
                if (tlo > len)
                    tlo = len;
                if (thi > len)
                    thi = len;
                if (thi < tlo)
                    thi = tlo;
                const float *src = s->p + c0 * hw + ih * cv->w + iw0;
                float *d = rows + sg->off;
#if S_MASKED_RUNS
                if (cv->sw == 1 && len <= 16 && kiln_gisa.fin_avx512) {
                    s_runs16 (d, src, hw, width, c1 - c0, tlo, thi, len);
                    continue;
                }
#endif
                if (tlo == 0 && thi == len && cv->sw <= 2) {
                    /* The common runs (a panel of 7 or 8 positions, a
                     * whole row of 32) at a constant length. */
#define S_RUNS(L, S)                                                  \
    for (int64_t c = c0; c < c1; c++, src += hw, d += width)          \
        for (int64_t t = 0; t < (L); t++)                             \
            d[t] = src[(S) * t]
                    if (cv->sw == 1 && len == 7)
                        S_RUNS (7, 1);
                    else if (cv->sw == 1 && len == 8)
                        S_RUNS (8, 1);
                    else if (cv->sw == 1 && len == NR)
                        S_RUNS (NR, 1);
                    else if (cv->sw == 1)
                        S_RUNS (len, 1);
                    else if (len == 7)
                        S_RUNS (7, 2);
                    else if (len == 8)
                        S_RUNS (8, 2);
                    else if (len == NR)
                        S_RUNS (NR, 2);
                    else
                        S_RUNS (len, 2);
#undef S_RUNS
                    continue;
                }
                for (int64_t c = c0; c < c1; c++, src += hw, d += width) {
                    for (int64_t t = 0; t < tlo; t++)
                        d[t] = 0.0f;
                    if (cv->sw == 1)
                        for (int64_t t = tlo; t < thi; t++)
                            d[t] = src[t];
                    else if (cv->sw == 2)       /* a constant stride vectorises */
                        for (int64_t t = tlo; t < thi; t++)
                            d[t] = src[2 * t];
                    else
                        for (int64_t t = tlo; t < thi; t++)
                            d[t] = src[t * cv->sw];
                    for (int64_t t = thi; t < len; t++)
                        d[t] = 0.0f;
                }
            }
            k += c1 - c0;
        }
    }
}

/* Panel j (its first column) of a half B, its steps k0..k0+kc-1, widened
 * into dst (kc × NR floats): a packed panel is k-major, so its k block
 * is one run of kc × NR elements. */
void
kiln_gwiden_panel (const kiln_gemm_t *g, int64_t j, int64_t k0, int64_t kc, float *dst)
{
    const uint16_t *src = (const uint16_t *) (const void *) g->b.p
                          + (j / NR) * g->k * NR + k0 * NR;
    kiln_convert_widen (g->b_half, src, dst, kc * NR);
}
