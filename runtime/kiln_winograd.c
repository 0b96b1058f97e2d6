/*
 * kiln_winograd — Winograd F(2x2, 3x3) and F(4x4, 3x3) convolution; see
 * kiln_winograd.h.  The transform matrices (Lavin and Gray):
 *
 *   F(2x2, 3x3)  Bᵀ = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0],
 *                      [0, 1, 0, -1]]
 *                Aᵀ = [[1, 1, 1, 0], [0, 1, -1, -1]]
 *   F(4x4, 3x3)  Bᵀ = [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0],
 *                      [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
 *                      [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]]
 *                Aᵀ = [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0],
 *                      [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]
 *   (G, for the weights, is in common/kiln_pack.c.)
 *
 * A task is one image, one block of tiles (nb of them, in row-major tile
 * order) and one chunk of output channels.  For each block of input
 * channels it transforms the input under its tiles into V[ξ][c][tile]
 * (one B panel per point ξ), multiplies each point's weights by it into
 * M[ξ][m][tile] (accumulating over the channel blocks), and finally turns
 * M back into t x t output blocks, applying the epilogue as it writes.
 * Every loop over the tiles of a block is a plain vector loop.
 */
#include "runtime/kiln_winograd.h"

#include <string.h>

#include "common/kiln_pack.h"
#include "runtime/kiln_exec.h"
#include "runtime/kiln_gemm.h"
#include "runtime/kiln_vmath.h"

#define S_CLONES KILN_VCLONES

#define S_ALPHA_MAX 6
#define S_TILE_MAX 4
#define S_NB_MAX 64         /* tiles of a block: 32 (16), or up to 56 (T) */
/* Floats of V[ξ][c][tile] and of M[ξ][m][tile] a task holds at most
 * (1 MiB each).  Each point's panels are used at once (V by every row
 * panel of the point, M accumulated in place), so these need not fit in
 * L2; larger blocks mean fewer passes of the input transform and longer
 * runs of the micro-kernel. */
#define S_V_FLOATS (256 * 1024)
#define S_MO_FLOATS (256 * 1024)
/* A shared V (every block of tiles, transformed once) at most: 32 MiB */
#define S_SHARED_V_FLOATS (8 * 1024 * 1024)
/* a segment's input row: tile·nb + 2 columns, rounded for vector reads */
#define S_ROW_MAX (S_TILE_MAX * S_NB_MAX + 64)

typedef float s_v16 __attribute__ ((vector_size (64)));
typedef float s_v8 __attribute__ ((vector_size (32)));
typedef float s_v4 __attribute__ ((vector_size (16)));
typedef float s_v2 __attribute__ ((vector_size (8)));

/* The even and the odd lanes of two 16-lane vectors, as the constant
 * lane lists of __builtin_shufflevector (which both gcc >= 12 and clang
 * have; gcc's __builtin_shuffle is gcc's alone). */
#define S_EVEN16 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define S_ODD16  1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31

/* Even and odd elements of p[0..31]. */
static inline __attribute__ ((always_inline)) void
s_deinterleave (const float *p, s_v16 *even, s_v16 *odd)
{
    s_v16 lo, hi;
    memcpy (&lo, p, sizeof lo);
    memcpy (&hi, p + 16, sizeof hi);
    *even = __builtin_shufflevector (lo, hi, S_EVEN16);
    *odd = __builtin_shufflevector (lo, hi, S_ODD16);
}

static int64_t
s_min (int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* n floats rounded up to whole 64-byte lines */
static int64_t
s_round16 (int64_t n)
{
    return (n + 15) / 16 * 16;
}

void
kiln_wino_plan (kiln_wino_t *wp, int tile, bool trans, int64_t n, int64_t c,
                int64_t h, int64_t w, int64_t m, int64_t oh, int64_t ow,
                int64_t pt, int64_t pl, int threads)
{
    memset (wp, 0, sizeof *wp);
    wp->trans = trans;
    wp->tile = tile == 4 ? 4 : 2;
    wp->alpha = wp->tile + 2;
    wp->points = wp->alpha * wp->alpha;
    wp->n = n;
    wp->c = c;
    wp->h = h;
    wp->w = w;
    wp->m = m;
    wp->oh = oh;
    wp->ow = ow;
    wp->pt = pt;
    wp->pl = pl;
    wp->th = (oh + wp->tile - 1) / wp->tile;
    wp->tw = (ow + wp->tile - 1) / wp->tile;
    wp->tiles = wp->th * wp->tw;
    wp->nb = wp->tiles >= KILN_PACK_NR ? KILN_PACK_NR : KILN_PACK_NR / 2;
    if (trans) {
        /* blocks of whole tile panels, seven at most (49 or 56 tiles) */
        wp->rp = (wp->tiles + 6) / 7 * 7 < (wp->tiles + 7) / 8 * 8 ? 7 : 8;
        int64_t all = (wp->tiles + wp->rp - 1) / wp->rp * wp->rp;
        wp->nb = all < 7 * wp->rp ? all : 7 * wp->rp;
        /* Fewer blocks of tiles times 32-channel panels than threads (a
         * DenseNet layer's 32 output channels at 28 × 28: one task): blocks
         * of fewer panels, so that every thread has one. */
        int64_t mpan = (m + KILN_PACK_NR - 1) / KILN_PACK_NR;
        int64_t blocks = (wp->tiles + wp->nb - 1) / wp->nb;
        if (threads > 1 && n * blocks * mpan < threads) {
            int64_t need = (threads + n * mpan - 1) / (n * mpan);
            int64_t panels = all / wp->rp;
            wp->nb = (panels + need - 1) / need * wp->rp;
        }
    }
    int64_t kc_max = S_V_FLOATS / (wp->points * wp->nb);
    wp->nkb = (c + kc_max - 1) / kc_max;
    wp->kc = wp->nkb ? (c + wp->nkb - 1) / wp->nkb : 0;
    wp->tbs = (wp->tiles + wp->nb - 1) / wp->nb;
    /* chunks of output channels: whole A panels of the weights, or (T)
     * whole 32-column B panels */
    int64_t unit = trans ? KILN_PACK_NR : KILN_PACK_MR;
    int64_t mu = (m + unit - 1) / unit * unit;
    int64_t cap = S_MO_FLOATS / (wp->points * wp->nb) / unit * unit;
    if (cap < unit)
        cap = unit;
    wp->mchunk = mu < cap ? mu : cap;
    /* Enough tasks for the threads: smaller chunks of channels (each
     * task transforms its input again, which is cheap next to the
     * products while a chunk has 32 channels or more). */
    while (threads > 1 && wp->mchunk > 4 * KILN_PACK_MR && wp->mchunk > unit
           && n * wp->tbs * ((m + wp->mchunk - 1) / wp->mchunk) < 4 * threads)
        wp->mchunk = (wp->mchunk / 2 + unit - 1) / unit * unit;
    /* and smaller than 32 while there are fewer tasks than threads (a
     * DenseNet layer's 32 output channels on one block of 16 tiles ran on
     * one thread): the input is then transformed once, shared (below) */
    while (threads > 1 && wp->mchunk > unit
           && n * wp->tbs * ((m + wp->mchunk - 1) / wp->mchunk) < threads)
        wp->mchunk = (wp->mchunk / 2 + unit - 1) / unit * unit;
    wp->mcs = (m + wp->mchunk - 1) / wp->mchunk;
    /* A worker's V (one block of tiles, kc channels), M (its chunk of
     * output channels) and (T) an A panel, in whole cache lines. */
    int64_t vfl = wp->points * wp->kc * wp->nb;
    int64_t mfl = s_round16 (wp->points * wp->mchunk * wp->nb
                             + (trans ? wp->kc * KILN_PACK_MR : 0));
    wp->own_floats = wp->w_floats = s_round16 (vfl) + mfl;
    /* Tasks share a block of tiles when there are not enough blocks for
     * the threads: each would transform the input under it again (mcs
     * times in all), which at 14 × 14 costs more than the second thread
     * gains.  Then the input is transformed once, into a V for every
     * block that the product tasks read. */
    int64_t blocks = n * wp->tbs * wp->nkb;
    if (threads > 1 && wp->mcs > 1 && blocks * vfl <= S_SHARED_V_FLOATS) {
        wp->shared = true;
        int64_t per_block = (4 * threads + blocks - 1) / blocks;
        wp->vpiece = (wp->kc + per_block - 1) / per_block;
        if (wp->vpiece < 8)
            wp->vpiece = wp->kc < 8 ? wp->kc : 8;
        wp->vpieces = (wp->kc + wp->vpiece - 1) / wp->vpiece;
        wp->v_floats = blocks * s_round16 (vfl);
        wp->own_floats = mfl;
        wp->w_floats = mfl + s_round16 ((wp->v_floats + threads - 1) / threads);
    }
    int64_t per;
    if (trans)
        kiln_pack_b_elems (c, m, &per);
    else
        kiln_pack_a_elems (m, c, &per);
    wp->u_stride = per;
}

size_t
kiln_wino_ws_bytes (const kiln_wino_t *wp)
{
    return (size_t) wp->w_floats * sizeof (float);
}

typedef struct {
    int col;                /* first column of the block */
    int len;                /* tiles */
    int64_t ty, tx;         /* tile coordinates of the first */
} s_seg_t;

/* The runs of tiles of block [t0, t0 + cnt) that lie in one tile row. */
static int
s_segments (const kiln_wino_t *wp, int64_t t0, int64_t cnt, s_seg_t *seg)
{
    int n = 0;
    for (int64_t t = 0; t < cnt;) {
        int64_t ty = (t0 + t) / wp->tw, tx = (t0 + t) % wp->tw;
        int64_t len = s_min (cnt - t, wp->tw - tx);
        seg[n++] = (s_seg_t) { (int) t, (int) len, ty, tx };
        t += len;
    }
    return n;
}

/* Row transforms d·B for the tiles of one segment: from the alpha input
 * rows buf[r] (zero outside X), R[r][j][t] for patch row r, point column
 * j, tile t. */
static inline __attribute__ ((always_inline)) void
s_rows2 (const float *const *buf, const bool *zero, int len,
         float rr[][S_ALPHA_MAX][S_NB_MAX])
{
    for (int r = 0; r < 4; r++) {
        if (zero[r]) {
            for (int j = 0; j < 4; j++)
                memset (rr[r][j], 0, sizeof rr[r][j]);
            continue;
        }
        for (int t0 = 0; t0 < len; t0 += 16) {
            s_v16 e0, o0, e1, o1;
            s_deinterleave (buf[r] + 2 * t0, &e0, &o0);
            s_deinterleave (buf[r] + 2 * t0 + 2, &e1, &o1);
            s_v16 r0 = e0 - e1, r1 = o0 + e1, r2 = e1 - o0, r3 = o0 - o1;
            memcpy (rr[r][0] + t0, &r0, sizeof r0);
            memcpy (rr[r][1] + t0, &r1, sizeof r1);
            memcpy (rr[r][2] + t0, &r2, sizeof r2);
            memcpy (rr[r][3] + t0, &r3, sizeof r3);
        }
    }
}

/* Elements 0, 4, 8, ... (d0) through 3, 7, 11, ... (d3) of p[0..63]. */
static inline __attribute__ ((always_inline)) void
s_deinterleave4 (const float *p, s_v16 *d0, s_v16 *d1, s_v16 *d2, s_v16 *d3)
{
    s_v16 e01, o01, e23, o23;
    s_deinterleave (p, &e01, &o01);
    s_deinterleave (p + 32, &e23, &o23);
    *d0 = __builtin_shufflevector (e01, e23, S_EVEN16);
    *d2 = __builtin_shufflevector (e01, e23, S_ODD16);
    *d1 = __builtin_shufflevector (o01, o23, S_EVEN16);
    *d3 = __builtin_shufflevector (o01, o23, S_ODD16);
}

/* F(4x4)'s row transforms, 16 tiles at a time: tile t reads b[4t ..
 * 4t + 5], four deinterleaved vectors and two of them again one tile on.
 * The rows must hold 4 · ((len - 1) / 16 · 16) + 68 floats. */
static inline __attribute__ ((always_inline)) void
s_rows4 (const float *const *buf, const bool *zero, int len,
         float rr[][S_ALPHA_MAX][S_NB_MAX])
{
    for (int r = 0; r < 6; r++) {
        if (zero[r]) {
            for (int j = 0; j < 6; j++)
                memset (rr[r][j], 0, sizeof rr[r][j]);
            continue;
        }
        const float *b = buf[r];
        for (int t0 = 0; t0 < len; t0 += 16) {
            s_v16 d0, d1, d2, d3, d4, d5, x2, x3;
            s_deinterleave4 (b + 4 * t0, &d0, &d1, &d2, &d3);
            s_deinterleave4 (b + 4 * t0 + 4, &d4, &d5, &x2, &x3);
            s_v16 q0 = 4.0f * d0 - 5.0f * d2 + d4;
            s_v16 q1 = -4.0f * (d1 + d2) + d3 + d4;
            s_v16 q2 = 4.0f * (d1 - d2) - d3 + d4;
            s_v16 q3 = 2.0f * (d3 - d1) - d2 + d4;
            s_v16 q4 = 2.0f * (d1 - d3) - d2 + d4;
            s_v16 q5 = 4.0f * d1 - 5.0f * d3 + d5;
            memcpy (rr[r][0] + t0, &q0, sizeof q0);
            memcpy (rr[r][1] + t0, &q1, sizeof q1);
            memcpy (rr[r][2] + t0, &q2, sizeof q2);
            memcpy (rr[r][3] + t0, &q3, sizeof q3);
            memcpy (rr[r][4] + t0, &q4, sizeof q4);
            memcpy (rr[r][5] + t0, &q5, sizeof q5);
        }
    }
}

/* Store the first n lanes of v at d (all 16 when n >= 16): copies of
 * constant size, 8, 4, 2 and 1 lanes, which compile to single moves.
 * Always inlined, so how a 64-byte vector argument would be passed
 * without AVX-512 never matters: clang's -Wpsabi, which warns at every
 * call below, is off from here on. */
#pragma GCC diagnostic ignored "-Wpsabi"
static inline __attribute__ ((always_inline)) void
s_put (float *d, s_v16 v, int n)
{
    if (n >= 16) {
        memcpy (d, &v, sizeof v);
        return;
    }
    /* Halves taken in registers: the vector written to the stack and
     * read back in pieces stalled on every piece (a store forwarded to a
     * narrower load at an offset), and those tails were a fifth of a
     * DenseNet 3×3's time (rows of 14 or 7 tiles). */
    s_v8 h8 = __builtin_shufflevector (v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    if (n & 8) {
        memcpy (d, &h8, sizeof h8);
        d += 8;
        h8 = __builtin_shufflevector (v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    }
    s_v4 h4 = __builtin_shufflevector (h8, h8, 0, 1, 2, 3);
    if (n & 4) {
        memcpy (d, &h4, sizeof h4);
        d += 4;
        h4 = __builtin_shufflevector (h8, h8, 4, 5, 6, 7);
    }
    s_v2 h2 = __builtin_shufflevector (h4, h4, 0, 1);
    if (n & 2) {
        memcpy (d, &h2, sizeof h2);
        d += 2;
        h2 = __builtin_shufflevector (h4, h4, 2, 3);
    }
    if (n & 1)
        d[0] = h2[0];
}

/* Column transforms of one point column into the panels of its points
 * (distinct panels: the pointers never overlap), 16 tiles at a time: the
 * row transforms wrote whole vectors, the panels get `len` tiles. */
static inline __attribute__ ((always_inline)) void
s_cols2 (const float *restrict p0, const float *restrict p1,
         const float *restrict p2, const float *restrict p3, float *restrict d0,
         float *restrict d1, float *restrict d2, float *restrict d3, int len)
{
    for (int t = 0; t < len; t += 16) {
        s_v16 a0, a1, a2, a3;
        memcpy (&a0, p0 + t, sizeof a0);
        memcpy (&a1, p1 + t, sizeof a1);
        memcpy (&a2, p2 + t, sizeof a2);
        memcpy (&a3, p3 + t, sizeof a3);
        int n = len - t;
        s_put (d0 + t, a0 - a2, n);
        s_put (d1 + t, a1 + a2, n);
        s_put (d2 + t, a2 - a1, n);
        s_put (d3 + t, a1 - a3, n);
    }
}

static inline __attribute__ ((always_inline)) void
s_cols4 (const float *restrict p0, const float *restrict p1,
         const float *restrict p2, const float *restrict p3,
         const float *restrict p4, const float *restrict p5, float *restrict d0,
         float *restrict d1, float *restrict d2, float *restrict d3,
         float *restrict d4, float *restrict d5, int len)
{
    for (int t = 0; t < len; t += 16) {
        s_v16 a0, a1, a2, a3, a4, a5;
        memcpy (&a0, p0 + t, sizeof a0);
        memcpy (&a1, p1 + t, sizeof a1);
        memcpy (&a2, p2 + t, sizeof a2);
        memcpy (&a3, p3 + t, sizeof a3);
        memcpy (&a4, p4 + t, sizeof a4);
        memcpy (&a5, p5 + t, sizeof a5);
        int n = len - t;
        s_put (d0 + t, 4.0f * a0 - 5.0f * a2 + a4, n);
        s_put (d1 + t, -4.0f * (a1 + a2) + a3 + a4, n);
        s_put (d2 + t, 4.0f * (a1 - a2) - a3 + a4, n);
        s_put (d3 + t, 2.0f * (a3 - a1) - a2 + a4, n);
        s_put (d4 + t, 2.0f * (a1 - a3) - a2 + a4, n);
        s_put (d5 + t, 4.0f * a1 - 5.0f * a3 + a5, n);
    }
}

/* V for channels [c0, c0 + kc) of image `x` (c planes). */
static inline __attribute__ ((always_inline)) void
s_input_transform (const kiln_wino_t *wp, const float *x, int64_t c0,
                   int64_t kc, const s_seg_t *seg, int nseg, float *v)
{
    int64_t nb = wp->nb, h = wp->h, w = wp->w;
    int a = wp->alpha, tile = wp->tile;
    int64_t pstride = wp->kc * nb;              /* floats per point */
    for (int si = 0; si < nseg; si++) {
        const s_seg_t *sg = &seg[si];
        int len = sg->len, width = tile * len + 2;
        /* what the row transforms read: whole vectors of 16 tiles */
        int need = tile == 2 ? 2 * ((len - 1) / 16 * 16) + 34
                             : 4 * ((len - 1) / 16 * 16) + 68;
        int64_t iw0 = tile * sg->tx - wp->pl;
        bool inside = iw0 >= 0 && iw0 + width <= w;
        int64_t ih0 = tile * sg->ty - wp->pt;
        for (int64_t cc = 0; cc < kc; cc++) {
            const float *plane = x + (c0 + cc) * h * w;
            /* The segment's input rows, zero outside X, copied first and
             * read afterwards (reading a copy at once would stall on
             * store forwarding); a row inside X whose whole vectors end
             * within the image is read where it lies (the lanes past the
             * segment's tiles are computed and never stored): a 3×3
             * 64 -> 64 at 56 × 56 0.973 of the time with the Relu below,
             * 128 -> 128 at 28 × 28 0.982. */
            float buf[S_ALPHA_MAX][S_ROW_MAX];
            const float *rowp[S_ALPHA_MAX];
            bool zero[S_ALPHA_MAX];
            for (int r = 0; r < a; r++) {
                int64_t ih = ih0 + r;
                zero[r] = ih < 0 || ih >= h;
                rowp[r] = buf[r];
                if (zero[r])
                    continue;
                const float *row = plane + ih * w + iw0;
                if (inside && row + need <= x + wp->c * h * w) {
                    rowp[r] = row;
                    continue;
                }
                int64_t lo = 0, hi = width;
                if (!inside) {
                    lo = iw0 < 0 ? -iw0 : 0;
                    hi = iw0 + width > w ? w - iw0 : width;
                    if (hi < lo)
                        hi = lo;
                    if (lo > 0)
                        memset (buf[r], 0, (size_t) lo * sizeof **buf);
                }
                if (hi > lo)
                    memcpy (buf[r] + lo, row + lo, (size_t) (hi - lo) * sizeof **buf);
                if (need > hi)
                    memset (buf[r] + hi, 0, (size_t) (need - hi) * sizeof **buf);
            }
            float rr[S_ALPHA_MAX][S_ALPHA_MAX][S_NB_MAX];
            if (tile == 2)
                s_rows2 (rowp, zero, len, rr);
            else
                s_rows4 (rowp, zero, len, rr);
            /* columns: V[i][j] = Σ_r Bᵀ[i][r] R[r][j], into the panels */
            float *dst = v + cc * nb + sg->col;
            for (int j = 0; j < a; j++) {
                float *dj = dst + j * pstride;
                int64_t ps = a * pstride;           /* from point (i, j) to (i+1, j) */
                if (tile == 2)
                    s_cols2 (rr[0][j], rr[1][j], rr[2][j], rr[3][j], dj, dj + ps,
                             dj + 2 * ps, dj + 3 * ps, len);
                else
                    s_cols4 (rr[0][j], rr[1][j], rr[2][j], rr[3][j], rr[4][j],
                             rr[5][j], dj, dj + ps, dj + 2 * ps, dj + 3 * ps,
                             dj + 4 * ps, dj + 5 * ps, len);
            }
        }
    }
}

/* Output rows of one segment for output channel m: out[dy][tile·t + dx]
 * = Aᵀ S A for each tile t, S[ξ] = mm[ξ·pstride + t], plus `bias`. */
static inline __attribute__ ((always_inline)) void
s_output_tiles (const kiln_wino_t *wp, const float *mm, int64_t pstride,
                int len, float bias, float out[][S_TILE_MAX * S_NB_MAX])
{
    int a = wp->alpha;
    /* columns first: c[k][j][t] = Σ_i Aᵀ[k][i] S[i][j] */
    float cj[S_TILE_MAX][S_ALPHA_MAX][S_NB_MAX];
    for (int j = 0; j < a; j++) {
        const float *s0 = mm + (0 * a + j) * pstride, *s1 = mm + (1 * a + j) * pstride;
        const float *s2 = mm + (2 * a + j) * pstride, *s3 = mm + (3 * a + j) * pstride;
        if (wp->tile == 2) {
            for (int t = 0; t < len; t++) {
                cj[0][j][t] = s0[t] + s1[t] + s2[t];
                cj[1][j][t] = s1[t] - s2[t] - s3[t];
            }
        } else {
            const float *s4 = mm + (4 * a + j) * pstride, *s5 = mm + (5 * a + j) * pstride;
            for (int t = 0; t < len; t++) {
                float p12 = s1[t] + s2[t], m12 = s1[t] - s2[t];
                float p34 = s3[t] + s4[t], m34 = s3[t] - s4[t];
                cj[0][j][t] = s0[t] + p12 + p34;
                cj[1][j][t] = m12 + 2.0f * m34;
                cj[2][j][t] = p12 + 4.0f * p34;
                cj[3][j][t] = m12 + 8.0f * m34 + s5[t];
            }
        }
    }
    /* then rows, interleaving the tiles' columns */
    for (int k = 0; k < wp->tile; k++) {
        float *o = out[k];
        if (wp->tile == 2) {
            const float *c0 = cj[k][0], *c1 = cj[k][1], *c2 = cj[k][2], *c3 = cj[k][3];
            for (int t = 0; t < len; t++) {
                o[2 * t] = c0[t] + c1[t] + c2[t] + bias;
                o[2 * t + 1] = c1[t] - c2[t] - c3[t] + bias;
            }
        } else {
            const float *c0 = cj[k][0], *c1 = cj[k][1], *c2 = cj[k][2];
            const float *c3 = cj[k][3], *c4 = cj[k][4], *c5 = cj[k][5];
            for (int t = 0; t < len; t++) {
                float p12 = c1[t] + c2[t], m12 = c1[t] - c2[t];
                float p34 = c3[t] + c4[t], m34 = c3[t] - c4[t];
                o[4 * t] = c0[t] + p12 + p34 + bias;
                o[4 * t + 1] = m12 + 2.0f * m34 + bias;
                o[4 * t + 2] = p12 + 4.0f * p34 + bias;
                o[4 * t + 3] = m12 + 8.0f * m34 + c5[t] + bias;
            }
        }
    }
}

#if defined(__x86_64__)
/* s_output_tiles for F(4x4) on AVX-512: sixteen tiles at a time, those
 * past `len` masked off (never read), the same operations in the same
 * order (bit for bit the portable loops' results); each output row's
 * four columns a tile interleaved by two rounds of permutes, where the
 * loops had been compiled to a tile at a time. */
__attribute__ ((target ("avx512f"))) static void
s_output_tiles4_avx512 (const float *mm, int64_t pstride, int len, float bias,
                        float out[][S_TILE_MAX * S_NB_MAX])
{
    const __m512i pair_lo = _mm512_setr_epi32 (0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                                               6, 22, 7, 23);
    const __m512i pair_hi = _mm512_setr_epi32 (8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13,
                                               29, 14, 30, 15, 31);
    const __m512i quad_lo = _mm512_setr_epi32 (0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21,
                                               6, 7, 22, 23);
    const __m512i quad_hi = _mm512_setr_epi32 (8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28,
                                               29, 14, 15, 30, 31);
    const __m512 two = _mm512_set1_ps (2.0f), four = _mm512_set1_ps (4.0f);
    const __m512 eight = _mm512_set1_ps (8.0f), vb = _mm512_set1_ps (bias);
    for (int t0 = 0; t0 < len; t0 += 16) {
        int n = len - t0 < 16 ? len - t0 : 16;
        __mmask16 m = (__mmask16) (n == 16 ? 0xffffu : (1u << n) - 1u);
        /* columns first: c[k][j] = Σ_i Aᵀ[k][i] S[i][j] */
        __m512 cj[4][6];
        for (int j = 0; j < 6; j++) {
            __m512 s[6];
            for (int i = 0; i < 6; i++)
                s[i] = _mm512_maskz_loadu_ps (m, mm + (i * 6 + j) * pstride + t0);
            __m512 p12 = _mm512_add_ps (s[1], s[2]), m12 = _mm512_sub_ps (s[1], s[2]);
            __m512 p34 = _mm512_add_ps (s[3], s[4]), m34 = _mm512_sub_ps (s[3], s[4]);
            cj[0][j] = _mm512_add_ps (_mm512_add_ps (s[0], p12), p34);
            cj[1][j] = _mm512_add_ps (m12, _mm512_mul_ps (two, m34));
            cj[2][j] = _mm512_add_ps (p12, _mm512_mul_ps (four, p34));
            cj[3][j] = _mm512_add_ps (_mm512_add_ps (m12, _mm512_mul_ps (eight, m34)), s[5]);
        }
        /* then rows, each tile's four columns side by side */
        for (int k = 0; k < 4; k++) {
            const __m512 *c = cj[k];
            __m512 p12 = _mm512_add_ps (c[1], c[2]), m12 = _mm512_sub_ps (c[1], c[2]);
            __m512 p34 = _mm512_add_ps (c[3], c[4]), m34 = _mm512_sub_ps (c[3], c[4]);
            __m512 o0 = _mm512_add_ps (_mm512_add_ps (_mm512_add_ps (c[0], p12), p34), vb);
            __m512 o1 = _mm512_add_ps (_mm512_add_ps (m12, _mm512_mul_ps (two, m34)), vb);
            __m512 o2 = _mm512_add_ps (_mm512_add_ps (p12, _mm512_mul_ps (four, p34)), vb);
            __m512 o3 = _mm512_add_ps (_mm512_add_ps (_mm512_add_ps (m12, _mm512_mul_ps (eight, m34)),
                                                      c[5]), vb);
            __m512 a = _mm512_permutex2var_ps (o0, pair_lo, o1);
            __m512 b = _mm512_permutex2var_ps (o0, pair_hi, o1);
            __m512 e = _mm512_permutex2var_ps (o2, pair_lo, o3);
            __m512 f = _mm512_permutex2var_ps (o2, pair_hi, o3);
            __m512 r[4] = { _mm512_permutex2var_ps (a, quad_lo, e),
                            _mm512_permutex2var_ps (a, quad_hi, e),
                            _mm512_permutex2var_ps (b, quad_lo, f),
                            _mm512_permutex2var_ps (b, quad_hi, f) };
            float *o = out[k] + 4 * t0;
            for (int q = 0; q < 4 && 4 * q < n; q++) {
                int lanes = 4 * (n - 4 * q);
                __mmask16 st = (__mmask16) (lanes >= 16 ? 0xffffu : (1u << lanes) - 1u);
                _mm512_mask_storeu_ps (o + 16 * q, st, r[q]);
            }
        }
    }
}
#endif

typedef struct {
    const kiln_wino_t *wp;
    const float *x, *u, *bias, *res;
    float *y;
    kiln_act_t act;
    float act_a, act_b;
    float *ws;
    size_t ws_stride;       /* floats per worker */
    bool avx512;            /* the output transform's AVX-512 form */
} s_run_t;

/* Worker `worker`'s own part of the workspace: after the shared V. */
static float *
s_own (const s_run_t *r, int worker)
{
    const kiln_wino_t *wp = r->wp;
    if (wp->shared)
        return r->ws + wp->v_floats + (size_t) worker * (size_t) wp->own_floats;
    return r->ws + (size_t) worker * r->ws_stride;
}

/* Block `blk` (image, block of tiles, block of channels) of a shared V. */
static float *
s_vblock (const s_run_t *r, int64_t blk)
{
    const kiln_wino_t *wp = r->wp;
    return r->ws + blk * s_round16 (wp->points * wp->kc * wp->nb);
}

/* Transform task of a shared V: vpiece channels of one block. */
S_CLONES static void
s_vtask (void *arg, int task, int worker)
{
    (void) worker;
    const s_run_t *r = arg;
    const kiln_wino_t *wp = r->wp;
    int64_t piece = task % wp->vpieces, blk = task / wp->vpieces;
    int64_t kb = blk % wp->nkb, rest = blk / wp->nkb;
    int64_t tb = rest % wp->tbs, ni = rest / wp->tbs;
    int64_t nb = wp->nb, t0 = tb * nb, cnt = s_min (nb, wp->tiles - t0);
    int64_t c0 = kb * wp->kc + piece * wp->vpiece;
    int64_t kc = s_min (wp->vpiece, s_min (wp->c, (kb + 1) * wp->kc) - c0);
    if (kc <= 0)
        return;
    float *v = s_vblock (r, blk) + piece * wp->vpiece * nb;
    if (cnt < nb)                       /* columns past the tiles: zero */
        for (int64_t p = 0; p < wp->points; p++)
            for (int64_t cc = 0; cc < kc; cc++)
                memset (v + (p * wp->kc + cc) * nb + cnt, 0,
                        (size_t) (nb - cnt) * sizeof *v);
    s_seg_t seg[S_NB_MAX];
    int nseg = s_segments (wp, t0, cnt, seg);
    s_input_transform (wp, r->x + ni * wp->c * wp->h * wp->w, c0, kc, seg, nseg, v);
}

S_CLONES static void
s_task (void *arg, int task, int worker)
{
    const s_run_t *r = arg;
    const kiln_wino_t *wp = r->wp;
    int64_t mi = task % wp->mcs, rest = task / wp->mcs;
    int64_t tb = rest % wp->tbs, ni = rest / wp->tbs;
    int64_t t0 = tb * wp->nb, cnt = s_min (wp->nb, wp->tiles - t0);
    int64_t m0 = mi * wp->mchunk, m1 = s_min (wp->m, m0 + wp->mchunk);
    int64_t nb = wp->nb, points = wp->points;
    float *own = s_own (r, worker), *v = own;
    float *mo = own + (wp->shared ? 0 : s_round16 (points * wp->kc * nb));
    s_seg_t seg[S_NB_MAX];
    int nseg = s_segments (wp, t0, cnt, seg);
    const float *x = r->x + ni * wp->c * wp->h * wp->w;
    if (cnt < nb && !wp->shared)        /* columns past the tiles: zero */
        for (int64_t p = 0; p < points * wp->kc; p++)
            memset (v + p * nb + cnt, 0, (size_t) (nb - cnt) * sizeof *v);
    for (int64_t kb = 0; kb < wp->nkb; kb++) {
        int64_t c0 = kb * wp->kc, kc = s_min (wp->kc, wp->c - c0);
        if (wp->shared)
            v = s_vblock (r, (ni * wp->tbs + tb) * wp->nkb + kb);
        else
            s_input_transform (wp, x, c0, kc, seg, nseg, v);
        if (wp->trans) {
            /* Each point's product with the tiles as rows: a panel of rp
             * tiles (packed once, the eighth row zero for 7) times the
             * 32-column panels of U[ξ]ᵀ, stored back transposed into M. */
            float *ap = mo + points * wp->mchunk * nb;
            int64_t rp = wp->rp;
            /* U[ξ + 1]'s panels, streamed from memory when the weights
             * are not in cache, are fetched while U[ξ]'s are used: each
             * row panel of tiles its share of each column panel's lines */
            int64_t slices = (cnt + rp - 1) / rp;
            int64_t lines = kc * KILN_PACK_NR * (int64_t) sizeof (float) / 64;
            int64_t share = (lines + slices - 1) / slices;
            for (int64_t xi = 0; xi < points; xi++) {
                const float *vb = v + xi * wp->kc * nb;
                const float *u = r->u + xi * wp->u_stride + c0 * KILN_PACK_NR;
                const char *un = xi + 1 < points ? (const char *) (u + wp->u_stride) : NULL;
                for (int64_t i = 0; i < cnt; i += rp) {
                    int64_t first = i / rp * share;
                    int64_t pf_n = un && first < lines ? s_min (share, lines - first) : 0;
                    /* the panel: rp tiles a channel, MR floats a step.
                     * A whole row's worth of floats is one fixed-size copy
                     * (a vector move), not a call to memcpy per channel,
                     * which made this packing, repeated by every task of
                     * a chunk of channels, the larger part of the time on
                     * 2 threads (resnet50's 128 → 128 at 28 × 28 gained
                     * nothing from the second thread). */
                    if (i + KILN_PACK_MR <= nb) {
                        for (int64_t cc = 0; cc < kc; cc++) {
                            float *d = ap + cc * KILN_PACK_MR;
                            memcpy (d, vb + cc * nb + i, KILN_PACK_MR * sizeof *ap);
                            if (rp < KILN_PACK_MR)
                                d[rp] = 0.0f;
                        }
                    } else {
                        for (int64_t cc = 0; cc < kc; cc++)
                            for (int64_t q = 0; q < KILN_PACK_MR; q++)
                                ap[cc * KILN_PACK_MR + q] = q < rp ? vb[cc * nb + i + q] : 0.0f;
                    }
                    for (int64_t j = m0; j < m1; j += KILN_PACK_NR)
                        kiln_gemm_ukr_t ((int) rp, kc, ap, u + j * wp->c, KILN_PACK_NR,
                                         mo + (xi * wp->mchunk + (j - m0)) * nb + i,
                                         nb, s_min (rp, cnt - i),
                                         s_min (KILN_PACK_NR, m1 - j), kb > 0,
                                         pf_n ? un + (j * wp->c * (int64_t) sizeof (float)
                                                      + first * 64) : NULL,
                                         pf_n);
                }
            }
            continue;
        }
        /* each A panel of U is used once here: the next one (of this
         * point or the next) is fetched while this one is used, in case
         * the weights come from memory */
        int64_t lines = kc * KILN_PACK_MR * (int64_t) sizeof (float) / 64;
        for (int64_t xi = 0; xi < points; xi++) {
            const float *u = r->u + xi * wp->u_stride + c0 * KILN_PACK_MR;
            const float *b = v + xi * wp->kc * nb;
            for (int64_t i = m0; i < m1; i += KILN_PACK_MR) {
                const float *next = i + KILN_PACK_MR < m1 ? u + (i + KILN_PACK_MR) * wp->c
                                    : xi + 1 < points ? u + wp->u_stride + m0 * wp->c
                                    : NULL;
                kiln_gemm_ukr ((int) nb, kc, u + i * wp->c, b, nb,
                               mo + (xi * wp->mchunk + (i - m0)) * nb, nb, kb > 0,
                               next, lines);
            }
        }
    }
    if (wp->nkb == 0)
        memset (mo, 0, (size_t) (points * wp->mchunk * nb) * sizeof *mo);
    /* Output transform, then the epilogue over the rows written. */
    int64_t ohw = wp->oh * wp->ow, pstride = wp->mchunk * nb;
    int tile = wp->tile;
    for (int64_t m = m0; m < m1; m++) {
        const float *mm = mo + (m - m0) * nb;
        float bv = r->bias ? r->bias[m] : 0.0f;
        float *yp = r->y + (ni * wp->m + m) * ohw;
        const float *rp = r->res ? r->res + (ni * wp->m + m) * ohw : NULL;
        for (int si = 0; si < nseg; si++) {
            const s_seg_t *sg = &seg[si];
            float out[S_TILE_MAX][S_TILE_MAX * S_NB_MAX];
#if defined(__x86_64__)
            if (tile == 4 && r->avx512)
                s_output_tiles4_avx512 (mm + sg->col, pstride, sg->len, bv, out);
            else
#endif
                s_output_tiles (wp, mm + sg->col, pstride, sg->len, bv, out);
            int64_t oy = tile * sg->ty, ox = tile * sg->tx;
            int64_t cols = s_min (tile * (int64_t) sg->len, wp->ow - ox);
            for (int dy = 0; dy < tile && oy + dy < wp->oh; dy++) {
                float *yr = yp + (oy + dy) * wp->ow + ox;
                const float *o = out[dy];
                const float *rr = rp ? rp + (oy + dy) * wp->ow + ox : NULL;
                if (r->act == KILN_ACT_RELU) {
                    /* kiln_act_apply's Relu in the same pass */
                    if (rr) {
                        for (int64_t q = 0; q < cols; q++) {
                            float s = o[q] + rr[q];
                            yr[q] = s < 0.0f ? 0.0f : s;
                        }
                    } else {
                        for (int64_t q = 0; q < cols; q++)
                            yr[q] = o[q] < 0.0f ? 0.0f : o[q];
                    }
                    continue;
                }
                if (rr) {
                    for (int64_t q = 0; q < cols; q++)
                        yr[q] = o[q] + rr[q];
                } else {
                    memcpy (yr, o, (size_t) cols * sizeof *yr);
                }
                kiln_act_apply (yr, cols, r->act, r->act_a, r->act_b);
            }
        }
    }
}

void
kiln_wino_run (const kiln_wino_t *wp, const float *x, const float *u,
               const float *bias, const float *res, float *y, kiln_act_t act,
               float act_a, float act_b)
{
    if (wp->n == 0 || wp->m == 0 || wp->tiles == 0)
        return;
    size_t bytes;
    s_run_t r = { wp, x, u, bias, res, y, act, act_a, act_b,
                  kiln_exec_ws (&bytes), 0, kiln_gemm_avx512 () };
    r.ws_stride = bytes / sizeof (float);
    if (wp->shared)
        kiln_exec_parallel (s_vtask, &r, (int) (wp->n * wp->tbs * wp->nkb * wp->vpieces));
    int64_t tasks = wp->n * wp->tbs * wp->mcs;
    kiln_exec_parallel (s_task, &r, (int) tasks);
}
