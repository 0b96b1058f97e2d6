/*
 * kiln_kernels_pool — the pooling kernels maxpool2d and global_avgpool.
 * Internal to libkilnrt.
 */
#include "runtime/kiln_kernels_priv.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "runtime/kiln_exec.h"
#include "runtime/kiln_gemm.h"
#include "runtime/kiln_vmath.h"

static int64_t s_pool_row_floats (const kiln_kplan_t *plan);

int
kiln_kprepare_MAXPOOL2D (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                     kiln_err_t *err)
{
    int rc = kiln_kneed_f32 (p, plan, err);
    if (rc)
        return rc;
    kiln_kwin_t w;
    int64_t ceil_mode;
    if ((rc = kiln_kget_window (op, &w, err))
        || (rc = kiln_prog_op_int (op, "ceil_mode", &ceil_mode, err)))
        return rc;
    const kiln_prog_tensor_t *tx = kiln_ktensor (p, plan->in[0]), *ty = kiln_ktensor (p, plan->out);
    int64_t x[4], y[4];         /* a rank-3 (1-D) pool reads as height 1 */
    if (!kiln_knchw (tx, x) || !kiln_knchw (ty, y) || tx->shape.rank != ty->shape.rank)
        return kiln_error (err, KILN_EFORMAT, "X and Y must both have rank 3 or both rank 4");
    if (x[0] != y[0] || x[1] != y[1])
        return kiln_error (err, KILN_EFORMAT, "X and Y differ in N or C");
    /* With ceil_mode, frameworks differ on whether a last window that
     * starts in the end padding counts; accept both, clamp every window. */
    for (int i = 0; i < 2; i++) {
        int64_t lo = kiln_kout_size (&w, i, x[2 + i], false);
        int64_t hi = kiln_kout_size (&w, i, x[2 + i], ceil_mode != 0);
        if (lo < 0 || y[2 + i] < lo || y[2 + i] > hi)
            return kiln_error (err, KILN_EFORMAT, "output size %lld along axis "
                               "%d does not follow from the window",
                               (long long) y[2 + i], i);
    }
    plan->u.pool.planes = x[0] * x[1];
    plan->u.pool.h = x[2];
    plan->u.pool.w = x[3];
    plan->u.pool.oh = y[2];
    plan->u.pool.ow = y[3];
    plan->u.pool.kh = w.k[0];
    plan->u.pool.kw = w.k[1];
    plan->u.pool.sh = w.s[0];
    plan->u.pool.sw = w.s[1];
    plan->u.pool.dh = w.d[0];
    plan->u.pool.dw = w.d[1];
    plan->u.pool.pt = w.p[0];
    plan->u.pool.pl = w.p[1];
    /* (+ 48: the AVX-512 column loop reads whole vectors past the row) */
    plan->ws_bytes = (size_t) (s_pool_row_floats (plan) + 48) * sizeof (float);
    return 0;
}

/* max that keeps the first NaN it meets: a NaN window gives NaN */
static inline float
s_max_nan (float best, float v)
{
    return v != v ? v : (v > best ? v : best);
}

/* The row of column maxima with -inf around it: pl before, and after the
 * row up to the last column a window reaches. */
static int64_t
s_pool_row_floats (const kiln_kplan_t *plan)
{
    int64_t reach = (plan->u.pool.ow - 1) * plan->u.pool.sw
                    + (plan->u.pool.kw - 1) * plan->u.pool.dw + 1;
    int64_t row = plan->u.pool.pl + plan->u.pool.w;
    return reach > row ? reach : row;
}

/* y[q] = max (y[q], cm[q·sw]) for q < n, NaN kept; sw a constant where
 * inlined, so that the loop vectorises. */
static inline __attribute__ ((always_inline)) void
s_max_cols (float *y, const float *cm, int64_t n, int64_t sw)
{
    for (int64_t q = 0; q < n; q++)
        y[q] = s_max_nan (y[q], cm[q * sw]);
}

#if defined(__x86_64__)
/* s_max_nan on sixteen lanes: v where v is NaN, else max (best, v) (a
 * NaN best kept), so that the lanes are the scalar loop's, bit for bit */
__attribute__ ((target ("avx512f"))) static inline __m512
s_max_nan16 (__m512 best, __m512 v)
{
    return _mm512_mask_mov_ps (_mm512_max_ps (v, best),
                               _mm512_cmp_ps_mask (v, v, _CMP_UNORD_Q), v);
}

/* The columns of a 3-wide window at stride 2 (the 3×3 stride-2 pools of
 * resnet's and densenet's stems): y[q] = max (cm[2q], cm[2q + 1],
 * cm[2q + 2]) in that order, sixteen outputs from two loads and two
 * more one pair later, their even and odd columns taken apart in
 * registers where the portable loop reads every other float three
 * times.  `cm` holds 2·ow + 1 floats and may be read 32 past them
 * (lanes past ow are computed and dropped). */
__attribute__ ((target ("avx512f"))) static void
s_max_cols_3s2_avx512 (float *y, const float *cm, int64_t ow)
{
    const __m512i even = _mm512_setr_epi32 (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                            24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32 (even, _mm512_set1_epi32 (1));
    int64_t q = 0;
    for (; q < ow; q += 16) {
        const float *c = cm + 2 * q;
        __m512 a = _mm512_loadu_ps (c), b = _mm512_loadu_ps (c + 16);
        __m512 a2 = _mm512_loadu_ps (c + 2), b2 = _mm512_loadu_ps (c + 18);
        __m512 m = _mm512_permutex2var_ps (a, even, b);
        m = s_max_nan16 (m, _mm512_permutex2var_ps (a, odd, b));
        m = s_max_nan16 (m, _mm512_permutex2var_ps (a2, even, b2));
        if (ow - q >= 16)
            _mm512_storeu_ps (y + q, m);
        else
            _mm512_mask_storeu_ps (y + q, (__mmask16) ((1u << (ow - q)) - 1), m);
    }
}
#endif

/* Whether index i of a run of n, padded by lo before it and hi after,
 * is a cell an average pool's window counts: in the run, or (`incl`,
 * count_include_pad) in the padded run. */
static inline bool
s_counted (int64_t i, int64_t n, int64_t lo, int64_t hi, bool incl)
{
    return incl ? i >= -lo && i < n + hi : i >= 0 && i < n;
}

#if defined(__x86_64__)
/* X's rows that output row r's window reads (rows ih = r·sh - pt + i·dh
 * inside [0, h)), in the window's order, into xr: their number.  With
 * `counted`, the window's rows an average pool divides by: those in X, or
 * with `incl` those in the padded plane (up to h + pb). */
static inline int
s_window_rows (const float *xp, int64_t h, int64_t w, int64_t r, int64_t sh, int64_t pt,
               int64_t pb, int64_t kh, int64_t dh, bool incl, const float **xr, int *counted)
{
    int nr = 0, rows = 0;
    for (int64_t i = 0; i < kh; i++) {
        int64_t ih = r * sh - pt + i * dh;
        rows += s_counted (ih, h, pt, pb, incl);
        if (ih >= 0 && ih < h)
            xr[nr++] = xp + ih * w;
    }
    if (counted)
        *counted = rows;
    return nr;
}

/* Lanes s ... s + 15 of the 32 of v0 then v1 (0 <= s <= 16). */
__attribute__ ((target ("avx512f"))) static inline __m512
s_shift16 (__m512 v0, __m512 v1, int64_t s)
{
    const __m512i iota = _mm512_setr_epi32 (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                            14, 15);
    return _mm512_permutex2var_ps (v0, _mm512_add_epi32 (iota, _mm512_set1_epi32 ((int) s)), v1);
}

/* Outputs q ... q + 15 of row r of a plane of oh rows of ow: a whole
 * vector where its lanes past the row fall on later rows of the plane
 * (which overwrite them), else under a mask: never past the plane, whose
 * next may be another thread's, or past Y. */
__attribute__ ((target ("avx512f"))) static inline void
s_store_row16 (float *yr, int64_t q, int64_t ow, int64_t r, int64_t oh, __m512 v)
{
    if (ow - q >= 16 || r * ow + q + 16 <= oh * ow)
        _mm512_storeu_ps (yr + q, v);
    else
        _mm512_mask_storeu_ps (yr + q, (__mmask16) ((1u << (ow - q)) - 1), v);
}

/* window rows s_max_plane_avx512 takes */
#define S_MAX_ROWS_MAX 16

/* Sixteen padded columns' maxima over the window's rows in X, in the
 * rows' order (lane l: X's column a + l of each row; -inf outside the
 * row, whose masked-off lanes are not read). */
__attribute__ ((target ("avx512f"))) static inline __m512
s_max_rows16 (const float *const *xr, int nr, int64_t a, int64_t w)
{
    __mmask16 m = kiln_lanes16 (a, w);
    __m512 ninf = _mm512_set1_ps (-INFINITY);
    __m512 v = _mm512_mask_loadu_ps (ninf, m, kiln_at (xr[0], a));
    for (int i = 1; i < nr; i++)
        v = s_max_nan16 (v, _mm512_mask_loadu_ps (ninf, m, kiln_at (xr[i], a)));
    return v;
}

/* One plane of a max pool at stride 1 along the rows, its window at most
 * 17 columns wide, or at stride 2 with rows of 16 outputs or fewer
 * (AVX-512), S_MAX_ROWS_MAX rows high at most: the loops' maxima in the
 * loops' order (rows, then the window's columns, NaN kept: the same
 * bytes), sixteen outputs at a time; at stride 1 from the column maxima
 * of their padded columns and of the sixteen after, each column of the
 * window a permute of the two, at stride 2 each column of the window the
 * even lanes of the 32 column maxima from its first.  On 14 × 14 and
 * 7 × 7 planes the vector loops had run their scalar remainders
 * (googlenet's 3×3 stride-1 branch pools, 512 planes of 14 × 14: 2.6
 * GFLOP/s; its 2×2 stride-2 pool of 832 planes to 7 × 7 0.35 -> 0.23 ms).
 * Whole-vector stores only where the lanes past the row fall on later
 * rows of the plane. */
__attribute__ ((target ("avx512f"))) static void
s_max_plane_avx512 (const kiln_kplan_t *plan, const float *xp, float *yp)
{
    int64_t h = plan->u.pool.h, w = plan->u.pool.w, oh = plan->u.pool.oh;
    int64_t ow = plan->u.pool.ow, kh = plan->u.pool.kh, kw = plan->u.pool.kw;
    int64_t sh = plan->u.pool.sh, dh = plan->u.pool.dh, dw = plan->u.pool.dw;
    int64_t pt = plan->u.pool.pt, pl = plan->u.pool.pl, sw = plan->u.pool.sw;
    __m512 ninf = _mm512_set1_ps (-INFINITY);
    const __m512i even = _mm512_setr_epi32 (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                            24, 26, 28, 30);
    for (int64_t r = 0; r < oh; r++) {
        const float *xr[S_MAX_ROWS_MAX];
        int nr = s_window_rows (xp, h, w, r, sh, pt, 0, kh, dh, false, xr, NULL);
        float *yr = yp + r * ow;
        if (sw == 2) {
            /* (one step a row: window column j of the outputs is the even
             * lanes of the 32 column maxima from padded column j·dw) */
            __m512 a = ninf;
            for (int64_t j = 0; nr && j < kw; j++) {
                int64_t c = j * dw - pl;
                a = s_max_nan16 (a, _mm512_permutex2var_ps (s_max_rows16 (xr, nr, c, w), even,
                                                            s_max_rows16 (xr, nr, c + 16, w)));
            }
            s_store_row16 (yr, 0, ow, r, oh, a);
            continue;
        }
        __m512 v0 = nr ? s_max_rows16 (xr, nr, -pl, w) : ninf;
        for (int64_t q = 0; q < ow; q += 16) {
            __m512 v1 = nr ? s_max_rows16 (xr, nr, q + 16 - pl, w) : ninf;
            __m512 a = ninf;
            for (int64_t j = 0; j < kw; j++)
                a = s_max_nan16 (a, s_shift16 (v0, v1, j * dw));
            s_store_row16 (yr, q, ow, r, oh, a);
            v0 = v1;
        }
    }
}
#endif

/* Planes whose rows are 32 floats or fewer, at most S_SMALL_ROWS of
 * them, are held in registers a plane at a time (s_max_small_avx512,
 * s_avg_small_avx512): row i of X as the lanes of its columns, two
 * vectors.  s_small_lanes gives, for outputs 16q ... 16q + 15 of a row
 * and column j of the window, the lane of those 32 that each output
 * reads (ix) and whether it lies in X (mk): X's column
 * (16q + l)·sw + j·dw - pl. */
#define S_SMALL_ROWS 32

#if defined(__x86_64__)
static void
s_small_lanes (int64_t sw, int64_t kw, int64_t dw, int64_t pl, int64_t w,
               int32_t ix[2][17][16], uint16_t mk[2][17])
{
    for (int q = 0; q < 2; q++)
        for (int64_t j = 0; j < kw; j++) {
            mk[q][j] = 0;
            for (int l = 0; l < 16; l++) {
                int64_t c = (16 * q + l) * sw + j * dw - pl;
                bool in = c >= 0 && c < w;
                ix[q][j][l] = (int32_t) (in ? c : 0);
                mk[q][j] |= (uint16_t) (in << l);
            }
        }
}

/* Whether a pool's planes take that path: rows of 32 or fewer, outputs
 * of a row in two vectors at most, windows up to 17 wide. */
static bool
s_small_plane (int64_t h, int64_t w, int64_t oh, int64_t ow, int64_t kh, int64_t kw)
{
    return w <= 32 && ow <= 32 && h <= S_SMALL_ROWS && oh <= S_SMALL_ROWS && kh <= 16
           && kw <= 17;
}

/* A small plane into registers: X's rows as lo (columns 0-15) and hi
 * (16-31, with `two`), `fill` past the row, and the lane tables of
 * s_small_lanes as index vectors; the number of 16-output blocks a row. */
__attribute__ ((target ("avx512f"), always_inline)) static inline int
s_small_load (const float *xp, int64_t h, int64_t w, int64_t ow, int64_t kw, __m512 fill,
              const bool two, const int32_t (*ix)[17][16], __m512 *lo, __m512 *hi,
              __m512i (*idx)[17])
{
    __mmask16 m0 = kiln_lanes16 (0, w), m1 = kiln_lanes16 (16, w);
    for (int64_t i = 0; i < h; i++) {
        lo[i] = _mm512_mask_loadu_ps (fill, m0, xp + i * w);
        hi[i] = two ? _mm512_mask_loadu_ps (fill, m1, kiln_at (xp + i * w, 16)) : fill;
    }
    int nq = ow > 16 ? 2 : 1;
    for (int q = 0; q < nq; q++)
        for (int64_t j = 0; j < kw; j++)
            idx[q][j] = _mm512_loadu_si512 (ix[q][j]);
    return nq;
}

/* A max pool's plane held in registers (above): each output row's
 * window rows' maxima in the window's order, then its columns' in order
 * from -inf, each column a permute of the row maxima (lanes outside X
 * -inf): the loops' operations in the loops' order, NaN kept, the same
 * bytes; at stride 1 or 2.  A 3×3 stride-2 pool of 288 planes of
 * 25 × 25 (inception_v3's) had gone through a row of column maxima in
 * memory, a row at a time. */
__attribute__ ((target ("avx512f"))) static void
s_max_small_avx512 (const kiln_kplan_t *plan, const float *xp, float *yp,
                    const int32_t (*ix)[17][16], const uint16_t (*mk)[17])
{
    int64_t h = plan->u.pool.h, w = plan->u.pool.w, oh = plan->u.pool.oh;
    int64_t ow = plan->u.pool.ow, kh = plan->u.pool.kh, kw = plan->u.pool.kw;
    int64_t sh = plan->u.pool.sh, dh = plan->u.pool.dh, pt = plan->u.pool.pt;
    __m512 ninf = _mm512_set1_ps (-INFINITY);
    __m512 lo[S_SMALL_ROWS], hi[S_SMALL_ROWS];
    __m512i idx[2][17];
    int nq = s_small_load (xp, h, w, ow, kw, ninf, true, ix, lo, hi, idx);
    for (int64_t r = 0; r < oh; r++) {
        __m512 v0 = ninf, v1 = ninf;
        bool any = false;
        for (int64_t i = 0; i < kh; i++) {
            int64_t ih = r * sh - pt + i * dh;
            if (ih < 0 || ih >= h)
                continue;
            v0 = any ? s_max_nan16 (v0, lo[ih]) : lo[ih];
            v1 = any ? s_max_nan16 (v1, hi[ih]) : hi[ih];
            any = true;
        }
        for (int q = 0; q < nq; q++) {
            __m512 a = ninf;
            for (int64_t j = 0; any && j < kw; j++)
                a = s_max_nan16 (a, _mm512_mask_mov_ps (ninf, mk[q][j],
                                                        _mm512_permutex2var_ps (v0, idx[q][j],
                                                                                v1)));
            s_store_row16 (yp + r * ow, 16 * q, ow, r, oh, a);
        }
    }
}
#endif

/* Output planes [first, first + count): for each output row, the maximum
 * over the window's input rows first (contiguous, vectorised) into
 * `colmax` (-inf in the padding), then over the window's columns, one
 * column of the window at a time over the whole output row. */
KILN_VCLONES static void
s_pool_planes (const kiln_kplan_t *plan, void *const *data, int64_t first,
               int64_t count, float *ws)
{
    const float *x = data[plan->in[0]];
    float *y = data[plan->out];
    int64_t h = plan->u.pool.h, w = plan->u.pool.w;
    int64_t oh = plan->u.pool.oh, ow = plan->u.pool.ow;
    int64_t kh = plan->u.pool.kh, kw = plan->u.pool.kw;
    int64_t sw = plan->u.pool.sw, dw = plan->u.pool.dw, padl = plan->u.pool.pl;
    int64_t wp = s_pool_row_floats (plan);
    float *colmax = ws + padl;
#if defined(__x86_64__)
    bool fast = kw == 3 && sw == 2 && dw == 1 && kiln_gemm_avx512 ();
    /* (at stride 2 only rows of one step, and not where the 3-wide
     * columns above do better: 3×3 from 28 × 28 0.29 against 0.46 ms) */
    bool fast1 = ((sw == 1 && (kw - 1) * dw <= 16) || (sw == 2 && ow <= 16 && !fast))
                 && kh <= S_MAX_ROWS_MAX && kiln_gemm_avx512 ();
#endif
    for (int64_t t = 0; t < padl; t++)
        ws[t] = -INFINITY;
    for (int64_t t = padl + w; t < wp; t++)
        ws[t] = -INFINITY;
#if defined(__x86_64__)
    bool small = (sw == 1 || (sw == 2 && ow <= 16)) && kiln_gemm_avx512 ()
                 && s_small_plane (h, w, oh, ow, kh, kw);
    int32_t ix[2][17][16];
    uint16_t mk[2][17];
    if (small)
        s_small_lanes (sw, kw, dw, padl, w, ix, mk);
#endif
    for (int64_t pl = first; pl < first + count; pl++) {
        const float *xp = x + pl * h * w;
        float *yp = y + pl * oh * ow;
#if defined(__x86_64__)
        if (small) {
            s_max_small_avx512 (plan, xp, yp, ix, mk);
            continue;
        }
        if (fast1) {
            s_max_plane_avx512 (plan, xp, yp);
            continue;
        }
#endif
        for (int64_t r = 0; r < oh; r++) {
            float *yr = yp + r * ow;
            int64_t h0 = r * plan->u.pool.sh - plan->u.pool.pt;
            bool any = false;
            int64_t i = 0;
            /* three rows in one pass (a 3-high window inside the plane:
             * one store an element, not three), in the loop's order */
            if (kh == 3 && h0 >= 0 && h0 + 2 * plan->u.pool.dh < h) {
                const float *r0 = xp + h0 * w, *r1 = r0 + plan->u.pool.dh * w,
                            *r2 = r1 + plan->u.pool.dh * w;
                for (int64_t t = 0; t < w; t++)
                    colmax[t] = s_max_nan (s_max_nan (r0[t], r1[t]), r2[t]);
                any = true;
                i = kh;
            }
            for (; i < kh; i++) {
                int64_t ih = h0 + i * plan->u.pool.dh;
                if (ih < 0 || ih >= h)
                    continue;
                const float *xr = xp + ih * w;
                if (!any)
                    memcpy (colmax, xr, (size_t) w * sizeof *colmax);
                else
                    for (int64_t t = 0; t < w; t++)
                        colmax[t] = s_max_nan (colmax[t], xr[t]);
                any = true;
            }
#if defined(__x86_64__)
            if (fast && any) {
                s_max_cols_3s2_avx512 (yr, ws, ow);
                continue;
            }
#endif
            for (int64_t q = 0; q < ow; q++)
                yr[q] = -INFINITY;
            for (int64_t j = 0; any && j < kw; j++) {
                const float *cm = ws + j * dw;
                if (sw == 1)
                    s_max_cols (yr, cm, ow, 1);
                else if (sw == 2)
                    s_max_cols (yr, cm, ow, 2);
                else
                    s_max_cols (yr, cm, ow, sw);
            }
        }
    }
}

void
kiln_krun_MAXPOOL2D (const kiln_kplan_t *plan, void *const *data)
{
    int64_t planes = plan->u.pool.planes;
    if (planes == 0 || plan->u.pool.oh == 0 || plan->u.pool.ow == 0)
        return;
    kiln_kplanes_run (s_pool_planes, plan, data, planes, 1);
}

/* A channels-last pool over more positions than this sums each block of
 * them apart (a task a block, every channel; then the blocks' sums in
 * block order, so the result does not depend on the thread count), so
 * that each thread reads the rows it wrote in the convolution before:
 * split by channels, at 2 threads a pool read half of its input from
 * the other core's cache and took longer than on one thread
 * (efficientnet_b0's first, 32 channels at 112×112, 0.086 ms against
 * 0.071; now 0.037 at 2 threads, 0.073 at 1). */
#define S_GAP_ROWS 256

int
kiln_kprepare_GLOBAL_AVGPOOL (kiln_program_t *p, kiln_prog_op_t *op,
                          kiln_kplan_t *plan, kiln_err_t *err)
{
    int rc = kiln_kneed_f32 (p, plan, err);
    if (rc)
        return rc;
    const kiln_prog_tensor_t *tx = kiln_ktensor (p, plan->in[0]), *ty = kiln_ktensor (p, plan->out);
    int64_t layout = 0;
    if (kiln_prog_op_has (op, "layout")
        && (rc = kiln_prog_op_int (op, "layout", &layout, err)))
        return rc;
    if (layout != 0 && !(layout == 1 && tx->shape.rank == 4))
        return kiln_error (err, KILN_EFORMAT, "layout must be 0, or 1 (X "
                           "channels-last, [N, H, W, C]) with X of rank 4");
    if (tx->shape.rank < 3 || ty->shape.rank != tx->shape.rank)
        return kiln_error (err, KILN_EFORMAT, "X must have rank >= 3 and Y the "
                           "same rank");
    int64_t c = tx->shape.dims[layout ? 3 : 1];
    for (int i = 0; i < ty->shape.rank; i++)
        if (ty->shape.dims[i] != (i == 0 ? tx->shape.dims[0] : i == 1 ? c : 1))
            return kiln_error (err, KILN_EFORMAT, "Y must be [N, C, 1, ...]");
    plan->u.gap.planes = tx->shape.dims[0] * c;
    plan->u.gap.spatial = plan->u.gap.planes
                          ? kiln_ktensor_numel (tx) / plan->u.gap.planes : 0;
    plan->u.gap.c = layout ? c : 0;
    /* channels-last over more than one block of positions: each block's
     * partial sums (doubles, every channel) in the workspace, which the
     * threads share */
    plan->u.gap.chunks = 1;
    if (layout && plan->u.gap.spatial > S_GAP_ROWS) {
        int64_t chunks = (plan->u.gap.spatial + S_GAP_ROWS - 1) / S_GAP_ROWS, bytes;
        if (!kiln_kmul3 (chunks, plan->u.gap.planes, (int64_t) sizeof (double), &bytes)
            || bytes > ((int64_t) 1 << 34))
            return kiln_error (err, KILN_EFORMAT, "global average pool too large");
        int threads = kiln_exec_threads ();
        plan->u.gap.chunks = chunks;
        plan->ws_bytes = (size_t) ((bytes + threads - 1) / threads + 64);
    }
    return 0;
}

/* The mean of each plane: sums in double, eight lanes (element i in
 * lane i mod 8), the lanes added in a fixed order and the tail last, so
 * the loop vectorises and the result does not depend on the CPU or the
 * thread count.  A plane's serial double sum had been bound by the add's
 * latency (efficientnet_b0's 17 pools, 9 % of its time). */
typedef struct {
    const float *x;
    float *y;
    int64_t s, planes, per;
    int64_t c;                  /* channels-last: the channels; else 0 */
} s_gap_t;

KILN_VCLONES static void
s_gap_planes (const float *x, float *y, int64_t s, int64_t first, int64_t count)
{
    for (int64_t pl = first; pl < first + count; pl++) {
        const float *xp = x + pl * s;
        double l[8] = { 0 };
        int64_t i = 0;
        for (; i + 8 <= s; i += 8)
            for (int j = 0; j < 8; j++)
                l[j] += xp[i + j];
        double sum = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
        for (; i < s; i++)
            sum += xp[i];
        y[pl] = s ? (float) (sum / (double) s) : NAN;
    }
}

/* Channels-last: block `blk` of S_GAP_CL channels of one image (the
 * image's rows of c, summed in double in row order). */
#define S_GAP_CL 64
KILN_VCLONES static void
s_gap_cl (const float *x, float *y, int64_t s, int64_t c, int64_t blk)
{
    int64_t blocks = (c + S_GAP_CL - 1) / S_GAP_CL;
    int64_t ni = blk / blocks, c0 = blk % blocks * S_GAP_CL;
    int64_t nc = c - c0 < S_GAP_CL ? c - c0 : S_GAP_CL;
    const float *xn = x + ni * s * c + c0;
    double acc[S_GAP_CL] = { 0 };
    for (int64_t i = 0; i < s; i++)
        for (int64_t k = 0; k < nc; k++)
            acc[k] += xn[i * c + k];
    for (int64_t k = 0; k < nc; k++)
        y[ni * c + c0 + k] = s ? (float) (acc[k] / (double) s) : NAN;
}

/* Block of positions `task` (of image task / chunks): its rows of c,
 * summed in double in row order into its partial sums. */
KILN_VCLONES static void
s_gap_rows (const float *x, double *part, int64_t s, int64_t c, int64_t chunks,
            int64_t task)
{
    int64_t ni = task / chunks, i0 = task % chunks * S_GAP_ROWS;
    int64_t i1 = i0 + S_GAP_ROWS < s ? i0 + S_GAP_ROWS : s;
    double *acc = part + task * c;
    const float *xn = x + ni * s * c;
    for (int64_t k = 0; k < c; k++)
        acc[k] = 0.0;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t k = 0; k < c; k++)
            acc[k] += xn[i * c + k];
}

typedef struct {
    const float *x;
    float *y;
    double *part;
    int64_t s, c, chunks;
} s_gap_rows_t;

static void
s_gap_rows_task (void *arg, int task, int worker)
{
    (void) worker;
    const s_gap_rows_t *d = arg;
    s_gap_rows (d->x, d->part, d->s, d->c, d->chunks, task);
}

/* Channels [64·task, 64·task + 64) of every image: the blocks' sums
 * added in block order. */
static void
s_gap_join_task (void *arg, int task, int worker)
{
    (void) worker;
    const s_gap_rows_t *d = arg;
    int64_t blocks = (d->c + S_GAP_CL - 1) / S_GAP_CL;
    int64_t ni = task / blocks, c0 = task % blocks * S_GAP_CL;
    int64_t c1 = c0 + S_GAP_CL < d->c ? c0 + S_GAP_CL : d->c;
    for (int64_t k = c0; k < c1; k++) {
        double sum = 0.0;
        for (int64_t b = 0; b < d->chunks; b++)
            sum += d->part[(ni * d->chunks + b) * d->c + k];
        d->y[ni * d->c + k] = (float) (sum / (double) d->s);
    }
}

static void
s_gap_task (void *arg, int task, int worker)
{
    const s_gap_t *d = arg;
    int64_t first = (int64_t) task * d->per;
    int64_t count = first + d->per > d->planes ? d->planes - first : d->per;
    if (d->c) {
        for (int64_t b = first; b < first + count; b++)
            s_gap_cl (d->x, d->y, d->s, d->c, b);
        return;
    }
    s_gap_planes (d->x, d->y, d->s, first, count);
}

void
kiln_krun_GLOBAL_AVGPOOL (const kiln_kplan_t *plan, void *const *data)
{
    const float *x = data[plan->in[0]];
    float *y = data[plan->out];
    int64_t s = plan->u.gap.spatial;
    if (plan->u.gap.c && plan->u.gap.chunks > 1) {
        /* tasks: blocks of positions, then blocks of channels */
        int64_t c = plan->u.gap.c, n = plan->u.gap.planes / c;
        size_t bytes;
        s_gap_rows_t d = { x, y, (double *) kiln_exec_ws (&bytes), s, c,
                           plan->u.gap.chunks };
        if (n > 0) {
            kiln_exec_parallel (s_gap_rows_task, &d, (int) (n * d.chunks));
            kiln_exec_parallel (s_gap_join_task, &d,
                                (int) (n * ((c + S_GAP_CL - 1) / S_GAP_CL)));
        }
        return;
    }
    if (plan->u.gap.c) {
        /* tasks: blocks of channels */
        int64_t c = plan->u.gap.c, n = plan->u.gap.planes / c;
        s_gap_t d = { x, y, s, n * ((c + S_GAP_CL - 1) / S_GAP_CL), 1, c };
        if (d.planes > 0)
            kiln_exec_parallel (s_gap_task, &d, (int) d.planes);
        return;
    }
    s_gap_t d = { x, y, s, plan->u.gap.planes, 0, 0 };
    int tasks = plan->u.gap.planes * s >= 65536 ? 4 * kiln_exec_threads () : 1;
    if (tasks > plan->u.gap.planes)
        tasks = (int) plan->u.gap.planes;
    if (tasks < 1)
        return;
    d.per = (plan->u.gap.planes + tasks - 1) / tasks;
    kiln_exec_parallel (s_gap_task, &d, (int) ((plan->u.gap.planes + d.per - 1) / d.per));
}


/* --- avgpool2d, global_maxpool (their plan: kiln_kshape_plan_t) -------- */


/* Planes [first, first + count) of a 2×2 average pool of stride 2 whose
 * windows lie inside X (densenet's transitions, which pool before their
 * 1×1 convolutions): each output the double sum of its window in row
 * order over 4, unrolled so that it vectorises. */
KILN_VCLONES static void
s_avg_2x2 (const kiln_kshape_plan_t *sp, const float *x, float *y, int64_t first,
           int64_t count)
{
    int64_t h = sp->h, w = sp->w, oh = sp->oh, ow = sp->ow;
    for (int64_t pl = first; pl < first + count; pl++)
        for (int64_t r = 0; r < oh; r++) {
            const float *x0 = x + pl * h * w + r * sp->sh * w, *x1 = x0 + w;
            float *yr = y + (pl * oh + r) * ow;
            for (int64_t q = 0; q < ow; q++)
                yr[q] = (float) (((((double) x0[2 * q] + x0[2 * q + 1]) + x1[2 * q])
                                  + x1[2 * q + 1]) / 4.0);
        }
}

typedef struct {
    const kiln_kshape_plan_t *sp;
    const float *x;
    float *y;
    int64_t per;
} s_avg_t;

static void
s_avg_task (void *arg, int task, int worker)
{
    const s_avg_t *d = arg;
    int64_t first = (int64_t) task * d->per;
    int64_t count = first + d->per > d->sp->planes ? d->sp->planes - first : d->per;
    s_avg_2x2 (d->sp, d->x, d->y, first, count);
}

/* window rows s_avg_plane_avx512 takes */
#define S_AVG_ROWS_MAX 16

#if defined(__x86_64__)
/* Sixteen padded columns' sums over the window's rows in X: lane l is
 * X's column a + l of each row (zero outside the row; masked-off lanes
 * are not read, and their addresses may lie outside it). */
__attribute__ ((target ("avx512f"))) static inline __m512
s_avg_cols16 (const float *const *xr, int nr, int64_t a, int64_t w)
{
    __mmask16 m = kiln_lanes16 (a, w);
    __m512 v = _mm512_setzero_ps ();
    for (int i = 0; i < nr; i++)
        v = _mm512_add_ps (v, _mm512_maskz_loadu_ps (m, kiln_at (xr[i], a)));
    return v;
}

/* One plane of s_avg_planes at stride 1 along the rows (AVX-512), its
 * window at most 17 columns wide and S_AVG_ROWS_MAX rows high: sixteen
 * outputs at a time from the column sums of their padded columns and of
 * the sixteen after, each column of the window a permute of the two (the
 * padding zero from the loads' masks), so that nothing goes through
 * memory between the two passes and a row of 12 or 25 outputs is one or
 * two steps (inception_v3's pools of 768 planes of 12 × 12).  A row's
 * last step stores a whole vector where its lanes past the row fall on
 * later rows of the plane, which overwrite them; else under a mask
 * (never past the plane: the next may be another thread's, or past Y). */
__attribute__ ((target ("avx512f"))) static void
s_avg_plane_avx512 (const kiln_kshape_plan_t *sp, const float *xp, float *yp,
                    const float *rcells)
{
    int64_t h = sp->h, w = sp->w, oh = sp->oh, ow = sp->ow, kh = sp->kh, kw = sp->kw;
    int64_t sh = sp->sh, dh = sp->dh, dw = sp->dw, pt = sp->pt, pl = sp->pl;
    for (int64_t r = 0; r < oh; r++) {
        const float *xr[S_AVG_ROWS_MAX];
        int rows;
        int nr = s_window_rows (xp, h, w, r, sh, pt, sp->pb, kh, dh, sp->include_pad, xr, &rows);
        /* times the reciprocals of the rows and of the columns counted,
         * not a division, which held every step (768 planes of 12 × 12
         * padded by 1: 0.29 -> 0.165 ms); rows or columns of none give
         * 0 · inf, NaN */
        __m512 fr = _mm512_set1_ps (1.0f / (float) rows);
        float *yr = yp + r * ow;
        __m512 v0 = s_avg_cols16 (xr, nr, -pl, w);
        for (int64_t q = 0; q < ow; q += 16) {
            __m512 v1 = s_avg_cols16 (xr, nr, q + 16 - pl, w);
            __m512 a = v0;
            for (int64_t j = 1; j < kw; j++)
                a = _mm512_add_ps (a, s_shift16 (v0, v1, j * dw));
            /* (a window with no cell counted: NaN, as 0 / 0 gives) */
            s_store_row16 (yr, q, ow, r, oh,
                           _mm512_mul_ps (a, _mm512_mul_ps (fr, _mm512_loadu_ps (rcells + q))));
            v0 = v1;
        }
    }
}

/* s_avg_plane_avx512 for a plane whose rows are 32 floats or fewer
 * (inception_v3's 25 × 25, 12 × 12 and 5 × 5 branch pools): each row of
 * X loaded once, under masks, as the lanes of its columns (two vectors);
 * an output row's window rows summed in order from zero, then for each
 * sixteen outputs column j of the window a permute of those sums (lanes
 * outside X zero), added in the window's order, and scaled by its row's
 * and columns' reciprocal counts: the same sums in the same order as
 * s_avg_plane_avx512, without its per-row bookkeeping, which had been
 * most of a small plane's time (768 planes of 12 × 12: 0.133 -> 0.058
 * ms).  fr[r]: output row r's reciprocal count of rows; ix[q][j],
 * mk[q][j]: the lanes of window column j for outputs 16q ... 16q + 15. */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_avg_small_body (const kiln_kshape_plan_t *sp, const float *xp, float *yp,
                  const float *rcells, const float *fr, const int32_t (*ix)[17][16],
                  const uint16_t (*mk)[17], const bool two)
{
    int64_t h = sp->h, w = sp->w, oh = sp->oh, ow = sp->ow, kh = sp->kh, kw = sp->kw;
    int64_t sh = sp->sh, dh = sp->dh, pt = sp->pt;
    __m512 lo[S_SMALL_ROWS], hi[S_SMALL_ROWS];
    __m512i idx[2][17];
    int nq = s_small_load (xp, h, w, ow, kw, _mm512_setzero_ps (), two, ix, lo, hi, idx);
    for (int64_t r = 0; r < oh; r++) {
        __m512 v0 = _mm512_setzero_ps (), v1 = _mm512_setzero_ps ();
        for (int64_t i = 0; i < kh; i++) {
            int64_t ih = r * sh - pt + i * dh;
            if (ih >= 0 && ih < h) {
                v0 = _mm512_add_ps (v0, lo[ih]);
                if (two)
                    v1 = _mm512_add_ps (v1, hi[ih]);
            }
        }
        __m512 f = _mm512_set1_ps (fr[r]);
        for (int q = 0; q < nq; q++) {
#define S_COL(j)                                                               \
    (two ? _mm512_maskz_permutex2var_ps (mk[q][j], v0, idx[q][j], v1)          \
         : _mm512_maskz_permutexvar_ps (mk[q][j], idx[q][j], v0))
            __m512 a = S_COL (0);
            for (int64_t j = 1; j < kw; j++)
                a = _mm512_add_ps (a, S_COL (j));
#undef S_COL
            s_store_row16 (yp + r * ow, 16 * q, ow, r, oh,
                           _mm512_mul_ps (a, _mm512_mul_ps (f, _mm512_loadu_ps (rcells + 16 * q))));
        }
    }
}

/* rows of 16 or fewer: one vector a row (lanes past 15 of ix and mk,
 * which a row of 16 cannot reach, are masked off) */
__attribute__ ((target ("avx512f"))) static void
s_avg_small_avx512 (const kiln_kshape_plan_t *sp, const float *xp, float *yp,
                    const float *rcells, const float *fr, const int32_t (*ix)[17][16],
                    const uint16_t (*mk)[17])
{
    if (sp->w <= 16 && sp->ow <= 16)
        s_avg_small_body (sp, xp, yp, rcells, fr, ix, mk, false);
    else
        s_avg_small_body (sp, xp, yp, rcells, fr, ix, mk, true);
}
#endif

/* Floats of s_avg_planes's workspace: the padded columns the windows
 * reach (column sums, zero in the padding), an output row's sums, its
 * windows' cell counts and their reciprocals (each 16 past the row, for
 * whole vectors), and 15 for the alignment. */
static int64_t
s_avg_ws_floats (const kiln_kshape_plan_t *sp)
{
    return (sp->ow - 1) * sp->sw + (sp->kw - 1) * sp->dw + 1 + 3 * sp->ow + 64;
}

/* acc[q] = the sum over the window's columns j of cs[q·sw + j·dw], one
 * column at a time for every output; inlined, so that at sw a constant 1
 * the loops vectorise (as s_max_cols). */
static inline __attribute__ ((always_inline)) void
s_avg_cols (float *acc, const float *cs, int64_t ow, int64_t kw, int64_t dw, int64_t sw)
{
    for (int64_t q = 0; q < ow; q++)
        acc[q] = cs[q * sw];
    for (int64_t j = 1; j < kw; j++)
        for (int64_t q = 0; q < ow; q++)
            acc[q] += cs[q * sw + j * dw];
}

/* Planes [first, first + count) of any average pool, separably: for each
 * output row the sums of the window's rows that lie in X, column by
 * column, then the window's columns over those sums, one column of the
 * window at a time for every output of the row; the cells counted (in X,
 * or in the padded plane with count_include_pad) are the window's rows in
 * reach times its columns in reach.  Every pass is a run of floats the
 * compiler vectorises, where the general loop (one window at a time,
 * its bounds tested cell by cell, in double) ran at about 1 GFLOP/s and
 * took 15 % of inception_v3.  Float sums, as ONNX Runtime's and torch's
 * (a window's 9 or 49 inputs: well within the outputs' tolerance). */
KILN_VCLONES static void
s_avg_planes (const kiln_kplan_t *plan, void *const *data, int64_t first, int64_t count,
              float *ws)
{
    const kiln_kshape_plan_t *sp = &plan->u.shape;
    const float *x = data[plan->in[0]];
    float *y = data[plan->out];
    int64_t h = sp->h, w = sp->w, oh = sp->oh, ow = sp->ow, kh = sp->kh, kw = sp->kw;
    int64_t sh = sp->sh, sw = sp->sw, dh = sp->dh, dw = sp->dw, pt = sp->pt, pl = sp->pl;
    int64_t span = (ow - 1) * sw + (kw - 1) * dw + 1;
    float *cs = (float *) (((uintptr_t) ws + 63) & ~(uintptr_t) 63);
    float *acc = cs + span, *cells = acc + ow;
    /* X's columns the windows reach: padded columns [c0, c1) */
    int64_t c0 = pl < span ? pl : span, c1 = pl + w < span ? pl + w : span;
    for (int64_t q = 0; q < ow; q++) {
        int64_t n = 0;
        for (int64_t j = 0; j < kw; j++) {
            int64_t iw = q * sw - pl + j * dw;
            n += s_counted (iw, w, pl, sp->pr, sp->include_pad);
        }
        cells[q] = (float) n;
    }
    for (int64_t q = ow; q < ow + 16; q++)
        cells[q] = 1.0f;        /* (lanes past the row, computed and dropped) */
    float *rcells = cells + ow + 16;
    for (int64_t q = 0; q < ow + 16; q++)
        rcells[q] = 1.0f / cells[q];
    for (int64_t i = 0; i < span; i++)
        cs[i] = 0.0f;
#if defined(__x86_64__)
    bool fast = sw == 1 && kh <= S_AVG_ROWS_MAX && (kw - 1) * dw <= 16 && kiln_gemm_avx512 ();
    /* rows of 32 or fewer, read once a plane (s_avg_small_avx512) */
    bool small = fast && s_small_plane (h, w, oh, ow, kh, kw);
    float rfr[S_SMALL_ROWS];
    int32_t ix[2][17][16];
    uint16_t mk[2][17];
    if (small) {
        for (int64_t r = 0; r < oh; r++) {
            const float *xr[S_AVG_ROWS_MAX];
            int rows;
            s_window_rows (x, h, w, r, sh, pt, sp->pb, kh, dh, sp->include_pad, xr, &rows);
            rfr[r] = 1.0f / (float) rows;
        }
        s_small_lanes (1, kw, dw, pl, w, ix, mk);
    }
#endif
    for (int64_t p = first; p < first + count; p++) {
#if defined(__x86_64__)
        if (small) {
            s_avg_small_avx512 (sp, x + p * h * w, y + p * oh * ow, rcells, rfr, ix, mk);
            continue;
        }
        if (fast) {
            s_avg_plane_avx512 (sp, x + p * h * w, y + p * oh * ow, rcells);
            continue;
        }
#endif
        for (int64_t r = 0; r < oh; r++) {
            int64_t rows = 0;
            bool seen = false;
            for (int64_t i = 0; i < kh; i++) {
                int64_t ih = r * sh - pt + i * dh;
                rows += s_counted (ih, h, pt, sp->pb, sp->include_pad);
                if (ih < 0 || ih >= h)
                    continue;
                const float *xr = x + (p * h + ih) * w;       /* X's column c - pl */
                if (!seen)
                    for (int64_t c = c0; c < c1; c++)
                        cs[c] = xr[c - pl];
                else
                    for (int64_t c = c0; c < c1; c++)
                        cs[c] += xr[c - pl];
                seen = true;
            }
            if (!seen)
                for (int64_t c = c0; c < c1; c++)
                    cs[c] = 0.0f;
            if (sw == 1)
                s_avg_cols (acc, cs, ow, kw, dw, 1);
            else
                s_avg_cols (acc, cs, ow, kw, dw, sw);
            float fr = (float) rows, *yr = y + (p * oh + r) * ow;
            for (int64_t q = 0; q < ow; q++) {
                float n = fr * cells[q];
                yr[q] = n > 0.0f ? acc[q] / n : NAN;
            }
        }
    }
}

void
kiln_krun_AVGPOOL2D (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kshape_plan_t *sp = &plan->u.shape;
    const float *x = data[plan->in[0]];
    float *y = data[plan->out];
    int64_t h = sp->h, w = sp->w, oh = sp->oh, ow = sp->ow;
    if (sp->kh == 2 && sp->kw == 2 && sp->sw == 2 && sp->dh == 1 && sp->dw == 1
        && sp->pt == 0 && sp->pl == 0 && oh > 0 && ow > 0
        && (oh - 1) * sp->sh + 1 < h && (ow - 1) * 2 + 1 < w) {
        s_avg_t d = { sp, x, y, 0 };
        int tasks = sp->planes * h * w >= 65536 ? 4 * kiln_exec_threads () : 1;
        if (tasks > sp->planes)
            tasks = (int) sp->planes;
        if (tasks < 1)
            return;
        d.per = (sp->planes + tasks - 1) / tasks;
        kiln_exec_parallel (s_avg_task, &d, (int) ((sp->planes + d.per - 1) / d.per));
        return;
    }
    if (sp->planes > 0 && oh > 0 && ow > 0)
        kiln_kplanes_run (s_avg_planes, plan, data, sp->planes, 1);
}

int
kiln_kprepare_AVGPOOL2D (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan, kiln_err_t *err)
{
    kiln_kshape_plan_t *sp = &plan->u.shape;
    kiln_kwin_t w;
    int64_t ceil_mode, include, x[4], y[4];
    int rc;
    if ((rc = kiln_kneed_f32 (p, plan, err)) || (rc = kiln_kget_window (op, &w, err))
        || (rc = kiln_prog_op_int (op, "ceil_mode", &ceil_mode, err))
        || (rc = kiln_prog_op_int (op, "count_include_pad", &include, err)))
        return rc;
    const kiln_prog_tensor_t *tx = kiln_ktensor (p, plan->in[0]), *ty = kiln_ktensor (p, plan->out);
    if (!kiln_knchw (tx, x) || !kiln_knchw (ty, y) || tx->shape.rank != ty->shape.rank)
        return kiln_error (err, KILN_EFORMAT, "X and Y must both have rank 3 or both rank 4");
    if (x[0] != y[0] || x[1] != y[1])
        return kiln_error (err, KILN_EFORMAT, "X and Y differ in N or C");
    /* With ceil_mode, frameworks differ on whether a last window that
     * starts in the end padding counts; accept both, as maxpool2d does. */
    for (int i = 0; i < 2; i++) {
        int64_t lo = kiln_kout_size (&w, i, x[2 + i], false);
        int64_t hi = kiln_kout_size (&w, i, x[2 + i], ceil_mode != 0);
        if (lo < 0 || y[2 + i] < lo || y[2 + i] > hi)
            return kiln_error (err, KILN_EFORMAT, "output size %lld along axis %d does not follow from the window",
                               (long long) y[2 + i], i);
    }
    sp->planes = x[0] * x[1];
    sp->h = x[2];
    sp->w = x[3];
    sp->oh = y[2];
    sp->ow = y[3];
    sp->kh = w.k[0];
    sp->kw = w.k[1];
    sp->sh = w.s[0];
    sp->sw = w.s[1];
    sp->dh = w.d[0];
    sp->dw = w.d[1];
    sp->pt = w.p[0];
    sp->pl = w.p[1];
    sp->pb = w.p[2];
    sp->pr = w.p[3];
    sp->include_pad = include != 0;
    plan->ws_bytes = (size_t) s_avg_ws_floats (sp) * sizeof (float);
    plan->run = kiln_krun_AVGPOOL2D;
    return 0;
}

void
kiln_krun_GLOBAL_MAXPOOL (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_kshape_plan_t *sp = &plan->u.shape;
    const float *x = data[plan->in[0]];
    float *y = data[plan->out];
    int64_t s = sp->spatial;
    for (int64_t pl = 0; pl < sp->planes; pl++) {
        float best = -INFINITY;
        for (int64_t i = 0; i < s; i++) {
            float v = x[pl * s + i];
            if (v > best || v != v)
                best = v;
            if (best != best)
                break;
        }
        y[pl] = best;
    }
}

int
kiln_kprepare_GLOBAL_MAXPOOL (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                       kiln_err_t *err)
{
    kiln_kshape_plan_t *sp = &plan->u.shape;
    int rc = kiln_kneed_f32 (p, plan, err);
    if (rc)
        return rc;
    const kiln_prog_tensor_t *tx = kiln_ktensor (p, plan->in[0]), *ty = kiln_ktensor (p, plan->out);
    if (tx->shape.rank < 3 || ty->shape.rank != tx->shape.rank)
        return kiln_error (err, KILN_EFORMAT, "X must have rank >= 3 and Y the same rank");
    for (int i = 0; i < ty->shape.rank; i++)
        if (ty->shape.dims[i] != (i < 2 ? tx->shape.dims[i] : 1))
            return kiln_error (err, KILN_EFORMAT, "Y must be [N, C, 1, ...]");
    sp->planes = tx->shape.dims[0] * tx->shape.dims[1];
    sp->spatial = sp->planes ? kiln_ktensor_numel (tx) / sp->planes : 0;
    plan->run = kiln_krun_GLOBAL_MAXPOOL;
    return 0;
}
