/*
 * kiln_winograd — Winograd F(2x2, 3x3) convolution; see kiln_winograd.h.
 *
 *   Bᵀ = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
 *   Aᵀ = [[1, 1, 1, 0], [0, 1, -1, -1]]
 *
 * A task is one image, one block of tiles (nb of them, in row-major tile
 * order) and one chunk of output channels.  For each block of input
 * channels it transforms the input under its tiles into V[ξ][c][tile]
 * (one B panel per point ξ), multiplies each point's weights by it into
 * M[ξ][m][tile] (accumulating over the channel blocks), and finally turns
 * M back into 2x2 output blocks.
 */
#include "runtime/kiln_winograd.h"

#include <string.h>

#include "common/kiln_pack.h"
#include "runtime/kiln_exec.h"
#include "runtime/kiln_gemm.h"
#include "runtime/kiln_vmath.h"

/* The transforms are plain loops over the tiles of a block: built for
 * AVX-512, AVX2 and the baseline, picked at load time. */
#define S_CLONES KILN_VCLONES

#define S_POINTS KILN_PACK_WINO_POINTS
#define S_NB_MAX KILN_PACK_NR
#define S_KC 256
/* M[ξ][m][tile] of a task holds at most this many floats (512 KiB) */
#define S_MO_FLOATS (128 * 1024)

typedef float s_v16 __attribute__ ((vector_size (64)));
typedef int32_t s_i16 __attribute__ ((vector_size (64)));

/* Even and odd elements of p[0..31]. */
static inline __attribute__ ((always_inline)) void
s_deinterleave (const float *p, s_v16 *even, s_v16 *odd)
{
    s_v16 lo, hi;
    memcpy (&lo, p, sizeof lo);
    memcpy (&hi, p + 16, sizeof hi);
    *even = __builtin_shuffle (lo, hi, (s_i16) { 0, 2, 4, 6, 8, 10, 12, 14, 16,
                                                 18, 20, 22, 24, 26, 28, 30 });
    *odd = __builtin_shuffle (lo, hi, (s_i16) { 1, 3, 5, 7, 9, 11, 13, 15, 17,
                                                19, 21, 23, 25, 27, 29, 31 });
}

static int64_t
s_min (int64_t a, int64_t b)
{
    return a < b ? a : b;
}

void
kiln_wino_plan (kiln_wino_t *wp, int64_t n, int64_t c, int64_t h, int64_t w,
                int64_t m, int64_t oh, int64_t ow, int64_t pt, int64_t pl,
                int threads)
{
    memset (wp, 0, sizeof *wp);
    wp->n = n;
    wp->c = c;
    wp->h = h;
    wp->w = w;
    wp->m = m;
    wp->oh = oh;
    wp->ow = ow;
    wp->pt = pt;
    wp->pl = pl;
    wp->th = (oh + 1) / 2;
    wp->tw = (ow + 1) / 2;
    wp->tiles = wp->th * wp->tw;
    wp->nb = wp->tiles >= S_NB_MAX ? S_NB_MAX : S_NB_MAX / 2;
    wp->nkb = (c + S_KC - 1) / S_KC;
    wp->kc = wp->nkb ? (c + wp->nkb - 1) / wp->nkb : 0;
    wp->tbs = (wp->tiles + wp->nb - 1) / wp->nb;
    int64_t m8 = (m + KILN_PACK_MR - 1) / KILN_PACK_MR * KILN_PACK_MR;
    int64_t cap = S_MO_FLOATS / (S_POINTS * wp->nb) / KILN_PACK_MR * KILN_PACK_MR;
    wp->mchunk = m8 < cap ? m8 : cap;
    /* Enough tasks for the threads: smaller chunks of channels (each
     * task transforms its input again, which is cheap next to the
     * products while a chunk has 32 channels or more). */
    while (threads > 1 && wp->mchunk > 4 * KILN_PACK_MR
           && n * wp->tbs * ((m + wp->mchunk - 1) / wp->mchunk) < 4 * threads)
        wp->mchunk = (wp->mchunk / 2 + KILN_PACK_MR - 1) / KILN_PACK_MR * KILN_PACK_MR;
    if (wp->mchunk < KILN_PACK_MR)
        wp->mchunk = KILN_PACK_MR;
    wp->mcs = (m + wp->mchunk - 1) / wp->mchunk;
    int64_t per;
    kiln_pack_a_elems (m, c, &per);
    wp->u_stride = per;
}

size_t
kiln_wino_ws_bytes (const kiln_wino_t *wp)
{
    /* V: points × kc × nb; M: points × mchunk × nb */
    return (size_t) (S_POINTS * (wp->kc + wp->mchunk) * wp->nb) * sizeof (float);
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

/* V for channels [c0, c0 + kc) of image plane block `x` (c planes).
 * Every loop over the tiles of a segment is a plain vector loop. */
static inline __attribute__ ((always_inline)) void
s_input_transform (const kiln_wino_t *wp, const float *x, int64_t c0,
                   int64_t kc, const s_seg_t *seg, int nseg, float *v)
{
    int64_t nb = wp->nb, h = wp->h, w = wp->w;
    int64_t pstride = wp->kc * nb;              /* floats per point */
    for (int si = 0; si < nseg; si++) {
        const s_seg_t *sg = &seg[si];
        int len = sg->len;
        int64_t iw0 = 2 * sg->tx - wp->pl;
        bool inside = iw0 >= 0 && iw0 + 2 * len + 1 < w;
        int64_t ih0 = 2 * sg->ty - wp->pt;
        for (int64_t cc = 0; cc < kc; cc++) {
            const float *plane = x + (c0 + cc) * h * w;
            /* The segment's four input rows, zero outside X, copied first
             * and read afterwards (reading a copy at once would stall on
             * store forwarding). */
            float buf[4][2 * S_NB_MAX + 2];
            bool zero_row[4];
            for (int r = 0; r < 4; r++) {
                int64_t ih = ih0 + r;
                zero_row[r] = ih < 0 || ih >= h;
                if (zero_row[r])
                    continue;
                const float *row = plane + ih * w + iw0;
                if (inside) {
                    memcpy (buf[r], row, (size_t) (2 * len + 2) * sizeof **buf);
                    memset (buf[r] + 2 * len + 2, 0,
                            (size_t) (2 * S_NB_MAX - 2 * len) * sizeof **buf);
                } else {
                    int64_t lo = iw0 < 0 ? -iw0 : 0;
                    int64_t hi = iw0 + 2 * len + 2 > w ? w - iw0 : 2 * len + 2;
                    memset (buf[r], 0, sizeof buf[r]);
                    if (hi > lo)
                        memcpy (buf[r] + lo, row + lo, (size_t) (hi - lo) * sizeof **buf);
                }
            }
            /* rows: R[r][j][t] from patch row r of each tile, whose columns
             * are 2t .. 2t + 3 of the segment's input row */
            float rr[4][4][S_NB_MAX];
            for (int r = 0; r < 4; r++) {
                if (zero_row[r]) {
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
            float *dst = v + cc * nb + sg->col;
            for (int j = 0; j < 4; j++) {
                /* four different points' panels: never overlapping */
                float *restrict d0 = dst + (0 * 4 + j) * pstride;
                float *restrict d1 = dst + (1 * 4 + j) * pstride;
                float *restrict d2 = dst + (2 * 4 + j) * pstride;
                float *restrict d3 = dst + (3 * 4 + j) * pstride;
                const float *q0 = rr[0][j], *q1 = rr[1][j], *q2 = rr[2][j], *q3 = rr[3][j];
                for (int t = 0; t < len; t++) {
                    d0[t] = q0[t] - q2[t];
                    d1[t] = q1[t] + q2[t];
                    d2[t] = q2[t] - q1[t];
                    d3[t] = q1[t] - q3[t];
                }
            }
        }
    }
}

typedef struct {
    const kiln_wino_t *wp;
    const float *x, *u, *bias, *res;
    float *y;
    kiln_act_t act;
    float act_a, act_b;
    float *ws;
    size_t ws_stride;       /* floats per worker */
} s_run_t;

S_CLONES static void
s_task (void *arg, int task, int worker)
{
    const s_run_t *r = arg;
    const kiln_wino_t *wp = r->wp;
    int64_t mi = task % wp->mcs, rest = task / wp->mcs;
    int64_t tb = rest % wp->tbs, ni = rest / wp->tbs;
    int64_t t0 = tb * wp->nb, cnt = s_min (wp->nb, wp->tiles - t0);
    int64_t m0 = mi * wp->mchunk, m1 = s_min (wp->m, m0 + wp->mchunk);
    int64_t nb = wp->nb;
    float *v = r->ws + (size_t) worker * r->ws_stride;
    float *mo = v + S_POINTS * wp->kc * nb;
    s_seg_t seg[S_NB_MAX];
    int nseg = s_segments (wp, t0, cnt, seg);
    const float *x = r->x + ni * wp->c * wp->h * wp->w;
    if (cnt < nb)                       /* columns past the tiles: zero */
        for (int64_t p = 0; p < S_POINTS * wp->kc; p++)
            memset (v + p * nb + cnt, 0, (size_t) (nb - cnt) * sizeof *v);
    for (int64_t kb = 0; kb < wp->nkb; kb++) {
        int64_t c0 = kb * wp->kc, kc = s_min (wp->kc, wp->c - c0);
        s_input_transform (wp, x, c0, kc, seg, nseg, v);
        for (int xi = 0; xi < S_POINTS; xi++) {
            const float *u = r->u + xi * wp->u_stride + c0 * KILN_PACK_MR;
            const float *b = v + xi * wp->kc * nb;
            for (int64_t i = m0; i < m1; i += KILN_PACK_MR)
                kiln_gemm_ukr ((int) nb, kc, u + i * wp->c, b, nb,
                               mo + (xi * wp->mchunk + (i - m0)) * nb, nb, kb > 0);
        }
    }
    if (wp->nkb == 0)
        memset (mo, 0, (size_t) (S_POINTS * wp->mchunk * nb) * sizeof *mo);
    /* Output transform, then the epilogue over the rows written. */
    int64_t ohw = wp->oh * wp->ow, pstride = wp->mchunk * nb;
    for (int64_t m = m0; m < m1; m++) {
        const float *mm = mo + (m - m0) * nb;
        float bv = r->bias ? r->bias[m] : 0.0f;
        float *yp = r->y + (ni * wp->m + m) * ohw;
        const float *rp = r->res ? r->res + (ni * wp->m + m) * ohw : NULL;
        for (int si = 0; si < nseg; si++) {
            const s_seg_t *sg = &seg[si];
            int len = sg->len;
            const float *s0 = mm + sg->col;
            /* Aᵀ S per column j: a0 = S0 + S1 + S2, a1 = S1 - S2 - S3 */
            float a0[4][S_NB_MAX], a1[4][S_NB_MAX];
            for (int j = 0; j < 4; j++) {
                const float *p0 = s0 + (0 * 4 + j) * pstride, *p1 = s0 + (1 * 4 + j) * pstride;
                const float *p2 = s0 + (2 * 4 + j) * pstride, *p3 = s0 + (3 * 4 + j) * pstride;
                for (int t = 0; t < len; t++) {
                    a0[j][t] = p0[t] + p1[t] + p2[t];
                    a1[j][t] = p1[t] - p2[t] - p3[t];
                }
            }
            int64_t oy = 2 * sg->ty, ox = 2 * sg->tx;
            /* the two output rows of the tiles, interleaved columns */
            float out[2][2 * S_NB_MAX];
            for (int dy = 0; dy < 2; dy++) {
                float (*a)[S_NB_MAX] = dy ? a1 : a0;
                for (int t = 0; t < len; t++) {
                    out[dy][2 * t] = a[0][t] + a[1][t] + a[2][t] + bv;
                    out[dy][2 * t + 1] = a[1][t] - a[2][t] - a[3][t] + bv;
                }
            }
            int64_t cols = 2 * len;
            if (ox + cols > wp->ow)
                cols = wp->ow - ox;
            for (int dy = 0; dy < 2 && oy + dy < wp->oh; dy++) {
                float *yr = yp + (oy + dy) * wp->ow + ox;
                const float *o2 = out[dy];
                if (rp) {
                    const float *rr = rp + (oy + dy) * wp->ow + ox;
                    for (int64_t q = 0; q < cols; q++)
                        yr[q] = o2[q] + rr[q];
                } else {
                    memcpy (yr, o2, (size_t) cols * sizeof *yr);
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
                  kiln_exec_ws (&bytes), 0 };
    r.ws_stride = bytes / sizeof (float);
    int64_t tasks = wp->n * wp->tbs * wp->mcs;
    kiln_exec_parallel (s_task, &r, (int) tasks);
}
