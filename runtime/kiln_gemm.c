/*
 * kiln_gemm — packed matrix products with fused epilogues.  See
 * kiln_gemm.h for the contract and common/kiln_pack.h for the layouts.
 */
#include "runtime/kiln_gemm.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "runtime/kiln_convert.h"
#include "runtime/kiln_exec.h"
#include "runtime/kiln_vmath.h"

#define MR KILN_PACK_MR
#define NR KILN_PACK_NR

/* Blocking.  k runs in blocks of at most S_KC (the B block of a tile is
 * S_KC × S_NC floats, 256 KiB, in L2; an A panel, S_KC × MR, in L1).  A
 * block of A packed at run time holds at most S_MC rows. */
#define S_KC 256
#define S_NC 256
#define S_MC 256
#define S_A_FLOATS (128 * 1024)     /* an A block of a long k (s_kc) */
#define S_KC_LONG 512               /* and its k block at most: longer runs
                                       of sums in one accumulator lose
                                       accuracy (resnet50's error against
                                       torch: 4e-7 at 256, 5e-7 at 512,
                                       1.2e-6 unbounded) */
#define S_PART_FLOATS (256 * 1024)  /* partial sums of a transposed C */

static int64_t
s_min (int64_t a, int64_t b)
{
    return a < b ? a : b;
}

static int64_t
s_round_up (int64_t v, int64_t to)
{
    return (v + to - 1) / to * to;
}

/* --- micro-kernels ---------------------------------------------------
 * c[MR × NR] (row stride ldc) = (accumulate ? c : 0) + a-panel · b-panel
 * over kc steps; a holds MR floats per step, b NR floats per step at a
 * stride of ldb.  The narrow kernels do MR × NR/2. */
typedef void (s_ukr_fn) (int64_t kc, const float *a, const float *b,
                         int64_t ldb, float *c, int64_t ldc, bool accumulate);

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

static void
s_ukr_generic (int64_t kc, const float *a, const float *b, int64_t ldb,
               float *c, int64_t ldc, bool accumulate)
{
    s_ukr_generic_w (kc, a, b, ldb, c, ldc, accumulate, NR);
}

static void
s_ukr_generic_16 (int64_t kc, const float *a, const float *b, int64_t ldb,
                  float *c, int64_t ldc, bool accumulate)
{
    s_ukr_generic_w (kc, a, b, ldb, c, ldc, accumulate, NR / 2);
}

#if defined(__x86_64__)

/* C = A·B as it is: no scale, addend or activation. */
static inline bool
s_no_epilogue (const kiln_gemm_t *g)
{
    return g->alpha == 1.0f && g->n_add == 0 && g->act == KILN_ACT_NONE;
}

/* What the epilogue of one tile needs, set up once per tile for
 * s_ukr_avx512_xb, which applies it stage by stage to the tile's 16
 * vectors: an addend that is the same for every row of the tile (a bias
 * per column: rs 0) as its two vectors, scaled; any other as the
 * address of the tile's (0, 0) element and its row step; alpha and the
 * activation's constants.  Applied vector by vector, with the tests on
 * `g` (whose fields the compiler reloads after every store to C) for
 * each, a transformer FFN product's bias cost 2 % of the product
 * (128 × 256 × 2048: 1.200 ms against 1.176 without a bias); this way,
 * 1 % (1.189). */
typedef struct {
    __m512 same[2][2];
    const float *p[2];          /* other addends: (i0, j0), rows rs apart */
    int64_t rs[2];
    float scale[2];
    int kind[2];                /* 0 same, 1 a vector per row, 2 one value */
    int n_add;
    bool has_alpha;
    kiln_act_t act;
    __m512 alpha, lo, hi;
} s_epi_tile_t;

__attribute__ ((target ("avx512f"))) static inline __attribute__ ((always_inline)) void
s_epi_tile_init (const kiln_gemm_t *g, int64_t i, int64_t j, s_epi_tile_t *e)
{
    e->n_add = g->n_add;
    for (int a = 0; a < g->n_add && a < 2; a++) {
        const kiln_gadd_t *ad = &g->add[a];
        e->scale[a] = ad->scale;
        e->p[a] = ad->p + i * ad->rs + j * ad->cs;
        e->rs[a] = ad->rs;
        if (ad->rs == 0 && ad->cs == 1) {
            e->kind[a] = 0;
            for (int h = 0; h < 2; h++) {
                __m512 x = _mm512_loadu_ps (ad->p + j + 16 * h);
                if (ad->scale != 1.0f)
                    x = _mm512_mul_ps (_mm512_set1_ps (ad->scale), x);
                e->same[a][h] = x;
            }
        } else {
            e->kind[a] = ad->cs == 0 ? 2 : 1;
        }
    }
    e->has_alpha = g->alpha != 1.0f;
    e->act = g->act;
    e->alpha = _mm512_set1_ps (g->alpha);
    e->lo = _mm512_set1_ps (g->act_a);
    e->hi = _mm512_set1_ps (g->act_b);
}

/* The 8 × 32 AVX-512 kernel of s_ukr_avx512 with two things more, for
 * the tiles of the driver (s_tile):
 *  - A read where it lies: row r's element kk at a[r·ars + kk·acs], so
 *    that a packed panel (ars 1, acs MR) and eight rows of a row-major
 *    activation (ars its row stride, acs 1) are read by the same loop.
 *    The latter spares packing the activations of a transformer's
 *    products (8 × 8 transposes of every A block, 2 % of the model's
 *    time): each row's cache line serves 16 steps of k.
 *  - the epilogue (`epi`, not NULL: tile (i, j) of that product, the
 *    last k block) applied in registers before the single store, with
 *    the operations of s_finish_avx512 in the same order, instead of
 *    storing the tile to a buffer and loading it back for s_finish (3 %
 *    of the transformer's time).
 * The sums over k run in the order of s_ukr_avx512: results are the
 * same bits.  With `pf`, a line from pf on is fetched into the cache at
 * each step of k (s_ukr_avx512_xp, for s_tile). */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_ukr_avx512_xb (int64_t kc, const float *a, int64_t ars, int64_t acs,
                 const float *b, int64_t ldb, float *c, int64_t ldc,
                 bool accumulate, const kiln_gemm_t *epi, int64_t i, int64_t j,
                 const char *pf, const float *acc_src, int64_t acc_ld,
                 float *t2, int t2_sign, bool t2_first)
{
    __m512 c00 = _mm512_setzero_ps (), c01 = _mm512_setzero_ps ();
    __m512 c10 = _mm512_setzero_ps (), c11 = _mm512_setzero_ps ();
    __m512 c20 = _mm512_setzero_ps (), c21 = _mm512_setzero_ps ();
    __m512 c30 = _mm512_setzero_ps (), c31 = _mm512_setzero_ps ();
    __m512 c40 = _mm512_setzero_ps (), c41 = _mm512_setzero_ps ();
    __m512 c50 = _mm512_setzero_ps (), c51 = _mm512_setzero_ps ();
    __m512 c60 = _mm512_setzero_ps (), c61 = _mm512_setzero_ps ();
    __m512 c70 = _mm512_setzero_ps (), c71 = _mm512_setzero_ps ();
    /* one pointer stepping along k, the rows at fixed offsets from it */
    const int64_t o1 = ars, o2 = 2 * ars, o3 = 3 * ars, o4 = 4 * ars;
    const int64_t o5 = 5 * ars, o6 = 6 * ars, o7 = 7 * ars;
#define S_ROW(r, o)                                               \
    do {                                                          \
        __m512 ar = _mm512_set1_ps (a[o]);                        \
        c##r##0 = _mm512_fmadd_ps (ar, b0, c##r##0);              \
        c##r##1 = _mm512_fmadd_ps (ar, b1, c##r##1);              \
    } while (0)
#pragma GCC unroll 4
    for (int64_t kk = 0; kk < kc; kk++) {
        __m512 b0 = _mm512_loadu_ps (b), b1 = _mm512_loadu_ps (b + 16);
        S_ROW (0, 0); S_ROW (1, o1); S_ROW (2, o2); S_ROW (3, o3);
        S_ROW (4, o4); S_ROW (5, o5); S_ROW (6, o6); S_ROW (7, o7);
        if (pf) {
            __builtin_prefetch (pf, 0, 3);
            pf += 64;
        }
        a += acs;
        b += ldb;
    }
#undef S_ROW
    /* Then, stage by stage over the tile's 16 vectors (each decision
     * once per tile): the partial sum already in C, alpha, the addends
     * in order, the activation; the same operations in the same order
     * for each element as s_finish_avx512. */
#define S_ALL(OP)                                                               \
    do {                                                                        \
        OP (0, 0); OP (0, 1); OP (1, 0); OP (1, 1); OP (2, 0); OP (2, 1);       \
        OP (3, 0); OP (3, 1); OP (4, 0); OP (4, 1); OP (5, 0); OP (5, 1);       \
        OP (6, 0); OP (6, 1); OP (7, 0); OP (7, 1);                             \
    } while (0)
    /* a second destination, an MR × NR tile (row stride NR) that the
     * product is stored to, added to or subtracted from (s_strassen) */
#define S_T2(r, h) _mm512_store_ps (t2 + (r) * NR + 16 * (h), c##r##h)
#define S_T2A(r, h)                                                             \
    _mm512_store_ps (t2 + (r) * NR + 16 * (h),                                  \
                     _mm512_add_ps (_mm512_load_ps (t2 + (r) * NR + 16 * (h)), c##r##h))
#define S_T2S(r, h)                                                             \
    _mm512_store_ps (t2 + (r) * NR + 16 * (h),                                  \
                     _mm512_sub_ps (_mm512_load_ps (t2 + (r) * NR + 16 * (h)), c##r##h))
    if (t2 && t2_first)
        S_ALL (S_T2);
    else if (t2 && t2_sign > 0)
        S_ALL (S_T2A);
    else if (t2)
        S_ALL (S_T2S);
#undef S_T2
#undef S_T2A
#undef S_T2S
    /* the partial sum: in C itself, or elsewhere (acc_src, rows acc_ld
     * apart) */
    if (!acc_src) {
        acc_src = c;
        acc_ld = ldc;
    }
#define S_ACC(r, h) \
    c##r##h = _mm512_add_ps (c##r##h, _mm512_loadu_ps (acc_src + (r) * acc_ld + 16 * (h)))
    if (accumulate)
        S_ALL (S_ACC);
#undef S_ACC
    if (epi) {
        s_epi_tile_t et;
        s_epi_tile_init (epi, i, j, &et);
        __m512 zero = _mm512_setzero_ps ();
#define S_MUL(r, h) c##r##h = _mm512_mul_ps (c##r##h, et.alpha)
        if (et.has_alpha)
            S_ALL (S_MUL);
#undef S_MUL
        for (int q = 0; q < et.n_add && q < 2; q++) {
            const float *src = et.p[q];
            int64_t rs = et.rs[q];
            __m512 sc = _mm512_set1_ps (et.scale[q]);
#define S_SAME(r, h) c##r##h = _mm512_add_ps (c##r##h, et.same[q][h])
#define S_VEC(r, h) c##r##h = _mm512_add_ps (c##r##h, _mm512_loadu_ps (src + (r) * rs + 16 * (h)))
#define S_VECS(r, h) \
    c##r##h = _mm512_add_ps (c##r##h, _mm512_mul_ps (sc, _mm512_loadu_ps (src + (r) * rs + 16 * (h))))
#define S_ONE(r, h) c##r##h = _mm512_add_ps (c##r##h, _mm512_set1_ps (et.scale[q] * src[(r) * rs]))
            if (et.kind[q] == 0)
                S_ALL (S_SAME);
            else if (et.kind[q] == 2)
                S_ALL (S_ONE);
            else if (et.scale[q] == 1.0f)
                S_ALL (S_VEC);
            else
                S_ALL (S_VECS);
#undef S_SAME
#undef S_VEC
#undef S_VECS
#undef S_ONE
        }
        /* max (0, v) is (0 > v ? 0 : v): v < 0 ? 0 : v, NaN and -0 kept,
         * in one instruction where compare and blend take two */
#define S_RELU(r, h) c##r##h = _mm512_max_ps (zero, c##r##h)
#define S_CLIP(r, h) c##r##h = _mm512_min_ps (et.hi, _mm512_max_ps (et.lo, c##r##h))
#define S_LEAKY(r, h) \
    c##r##h = _mm512_mask_mul_ps (c##r##h, _mm512_cmp_ps_mask (c##r##h, zero, _CMP_LT_OQ), c##r##h, et.lo)
        switch (et.act) {
        case KILN_ACT_RELU:
            S_ALL (S_RELU);
            break;
        case KILN_ACT_CLIP:
            S_ALL (S_CLIP);
            break;
        case KILN_ACT_LEAKY:
            S_ALL (S_LEAKY);
            break;
        default:
#define S_ACT16(r, h) c##r##h = kiln_act16 (c##r##h, et.act, et.lo, et.hi)
            if (kiln_act16_has (et.act))
                S_ALL (S_ACT16);
#undef S_ACT16
            break;
        }
#undef S_RELU
#undef S_CLIP
#undef S_LEAKY
    }
#define S_ST(r, h) _mm512_storeu_ps (c + (r) * ldc + 16 * (h), c##r##h)
    S_ALL (S_ST);
#undef S_ST
#undef S_ALL
    if (epi && kiln_act_heavy (epi->act) && !kiln_act16_has (epi->act))
        for (int r = 0; r < MR; r++)
            kiln_act_apply (c + r * ldc, NR, epi->act, epi->act_a, epi->act_b);
}

/* The packed 8 × 32 tile: s_ukr_avx512_xb on an A panel (MR floats a
 * step of k), with nothing more. */
__attribute__ ((target ("avx512f"))) static void
s_ukr_avx512 (int64_t kc, const float *a, const float *b, int64_t ldb,
              float *c, int64_t ldc, bool accumulate)
{
    s_ukr_avx512_xb (kc, a, 1, MR, b, ldb, c, ldc, accumulate, NULL, 0, 0, NULL,
                     NULL, 0, NULL, 0, false);
}

/* 7 × NR, for panels of 7 rows (a 7 × 7 plane's 49 positions are seven
 * of them): the same per-row rate as 8 × NR, the eighth row written as
 * zeros.  Only ever writes a tile buffer (s_micro). */
__attribute__ ((target ("avx512f"))) static void
s_ukr_avx512_7 (int64_t kc, const float *a, const float *b, int64_t ldb,
                float *c, int64_t ldc, bool accumulate)
{
    __m512 c00 = _mm512_setzero_ps (), c01 = _mm512_setzero_ps ();
    __m512 c10 = _mm512_setzero_ps (), c11 = _mm512_setzero_ps ();
    __m512 c20 = _mm512_setzero_ps (), c21 = _mm512_setzero_ps ();
    __m512 c30 = _mm512_setzero_ps (), c31 = _mm512_setzero_ps ();
    __m512 c40 = _mm512_setzero_ps (), c41 = _mm512_setzero_ps ();
    __m512 c50 = _mm512_setzero_ps (), c51 = _mm512_setzero_ps ();
    __m512 c60 = _mm512_setzero_ps (), c61 = _mm512_setzero_ps ();
#define S_ROW(r)                                                  \
    do {                                                          \
        __m512 ar = _mm512_set1_ps (a[r]);                        \
        c##r##0 = _mm512_fmadd_ps (ar, b0, c##r##0);              \
        c##r##1 = _mm512_fmadd_ps (ar, b1, c##r##1);              \
    } while (0)
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; k++) {
        __m512 b0 = _mm512_loadu_ps (b), b1 = _mm512_loadu_ps (b + 16);
        S_ROW (0); S_ROW (1); S_ROW (2); S_ROW (3);
        S_ROW (4); S_ROW (5); S_ROW (6);
        a += MR;
        b += ldb;
    }
#undef S_ROW
#define S_STORE(r)                                                            \
    do {                                                                      \
        float *cr = c + (r) * ldc;                                            \
        if (accumulate) {                                                     \
            c##r##0 = _mm512_add_ps (c##r##0, _mm512_loadu_ps (cr));          \
            c##r##1 = _mm512_add_ps (c##r##1, _mm512_loadu_ps (cr + 16));     \
        }                                                                     \
        _mm512_storeu_ps (cr, c##r##0);                                       \
        _mm512_storeu_ps (cr + 16, c##r##1);                                  \
    } while (0)
    S_STORE (0); S_STORE (1); S_STORE (2); S_STORE (3);
    S_STORE (4); S_STORE (5); S_STORE (6);
#undef S_STORE
    if (!accumulate) {
        _mm512_storeu_ps (c + 7 * ldc, _mm512_setzero_ps ());
        _mm512_storeu_ps (c + 7 * ldc + 16, _mm512_setzero_ps ());
    }
}

/* MR × 16: eight accumulators, enough to hide the FMA latency on CPUs
 * that run one 512-bit FMA per cycle. */
__attribute__ ((target ("avx512f"))) static void
s_ukr_avx512_16 (int64_t kc, const float *a, const float *b, int64_t ldb,
                 float *c, int64_t ldc, bool accumulate)
{
    __m512 c0 = _mm512_setzero_ps (), c1 = _mm512_setzero_ps ();
    __m512 c2 = _mm512_setzero_ps (), c3 = _mm512_setzero_ps ();
    __m512 c4 = _mm512_setzero_ps (), c5 = _mm512_setzero_ps ();
    __m512 c6 = _mm512_setzero_ps (), c7 = _mm512_setzero_ps ();
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; k++) {
        __m512 b0 = _mm512_loadu_ps (b);
        c0 = _mm512_fmadd_ps (_mm512_set1_ps (a[0]), b0, c0);
        c1 = _mm512_fmadd_ps (_mm512_set1_ps (a[1]), b0, c1);
        c2 = _mm512_fmadd_ps (_mm512_set1_ps (a[2]), b0, c2);
        c3 = _mm512_fmadd_ps (_mm512_set1_ps (a[3]), b0, c3);
        c4 = _mm512_fmadd_ps (_mm512_set1_ps (a[4]), b0, c4);
        c5 = _mm512_fmadd_ps (_mm512_set1_ps (a[5]), b0, c5);
        c6 = _mm512_fmadd_ps (_mm512_set1_ps (a[6]), b0, c6);
        c7 = _mm512_fmadd_ps (_mm512_set1_ps (a[7]), b0, c7);
        a += MR;
        b += ldb;
    }
#define S_STORE(r)                                                            \
    do {                                                                      \
        float *cr = c + (r) * ldc;                                            \
        if (accumulate)                                                       \
            c##r = _mm512_add_ps (c##r, _mm512_loadu_ps (cr));                \
        _mm512_storeu_ps (cr, c##r);                                          \
    } while (0)
    S_STORE (0); S_STORE (1); S_STORE (2); S_STORE (3);
    S_STORE (4); S_STORE (5); S_STORE (6); S_STORE (7);
#undef S_STORE
}

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

static void
s_ukr_avx2 (int64_t kc, const float *a, const float *b, int64_t ldb, float *c,
            int64_t ldc, bool accumulate)
{
    for (int r = 0; r < MR; r += 4)
        for (int h = 0; h < NR; h += 16)
            s_ukr_avx2_4x16 (kc, a + r, b + h, ldb, c + r * ldc + h, ldc,
                             accumulate);
}

static void
s_ukr_avx2_16 (int64_t kc, const float *a, const float *b, int64_t ldb,
               float *c, int64_t ldc, bool accumulate)
{
    for (int r = 0; r < MR; r += 4)
        s_ukr_avx2_4x16 (kc, a + r, b, ldb, c + r * ldc, ldc, accumulate);
}

#endif

/* One A panel from `rows` (at most MR) rows of kc floats, row r at p0 +
 * r·rs, plus (sign 1) or minus (sign -1) the row at p1 + r·rs when sign
 * is not 0: panel[kk·MR + r], the rows past `rows` zero. */
typedef void (s_rows_fn) (float *panel, const float *p0, const float *p1,
                          int sign, int64_t rows, int64_t kc, int64_t rs);

static void
s_panel_rows_c (float *panel, const float *p0, const float *p1, int sign,
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

#if defined(__x86_64__)

/* Eight rows of eight floats into eight columns. */
__attribute__ ((target ("avx2"))) static inline __attribute__ ((always_inline)) void
s_transpose8 (__m256 r[8])
{
    __m256 t0 = _mm256_unpacklo_ps (r[0], r[1]), t1 = _mm256_unpackhi_ps (r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps (r[2], r[3]), t3 = _mm256_unpackhi_ps (r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps (r[4], r[5]), t5 = _mm256_unpackhi_ps (r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps (r[6], r[7]), t7 = _mm256_unpackhi_ps (r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps (t0, t2, 0x44), u1 = _mm256_shuffle_ps (t0, t2, 0xee);
    __m256 u2 = _mm256_shuffle_ps (t1, t3, 0x44), u3 = _mm256_shuffle_ps (t1, t3, 0xee);
    __m256 u4 = _mm256_shuffle_ps (t4, t6, 0x44), u5 = _mm256_shuffle_ps (t4, t6, 0xee);
    __m256 u6 = _mm256_shuffle_ps (t5, t7, 0x44), u7 = _mm256_shuffle_ps (t5, t7, 0xee);
    r[0] = _mm256_permute2f128_ps (u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps (u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps (u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps (u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps (u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps (u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps (u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps (u3, u7, 0x31);
}

/* s_panel_rows_c by 8 × 8 transposes: the same values. */
__attribute__ ((target ("avx2"))) static void
s_panel_rows_avx2 (float *panel, const float *p0, const float *p1, int sign,
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
        s_transpose8 (v);
        for (int t = 0; t < 8; t++)
            _mm256_storeu_ps (panel + (kk + t) * MR, v[t]);
    }
    if (kk < kc)
        s_panel_rows_c (panel + kk * MR, p0 + kk, p1 ? p1 + kk : NULL, sign, rows,
                        kc - kk, rs);
}

#endif

static s_rows_fn *s_panel_rows = s_panel_rows_c;

static s_ukr_fn *s_ukr = s_ukr_generic;
static s_ukr_fn *s_ukr_7 = s_ukr_generic;  /* panels of 7 rows (and a zero) */
static s_ukr_fn *s_ukr_16 = s_ukr_generic_16;
static const char *s_isa = "generic";
static bool s_fin_avx512;       /* s_finish_avx512 may run */
static pthread_once_t s_isa_once = PTHREAD_ONCE_INIT;

static void
s_isa_init (void)
{
#if defined(__x86_64__)
    const char *want = getenv ("KILN_RT_ISA");
    bool any = !want || !want[0];
    __builtin_cpu_init ();
    if ((any || strcmp (want, "avx512") == 0) && __builtin_cpu_supports ("avx512f")) {
        s_ukr = s_ukr_avx512;
        s_ukr_7 = s_ukr_avx512_7;
        s_ukr_16 = s_ukr_avx512_16;
        s_panel_rows = s_panel_rows_avx2;
        s_fin_avx512 = true;
        s_isa = "avx512";
    } else if ((any || strcmp (want, "avx512") == 0 || strcmp (want, "avx2") == 0)
               && __builtin_cpu_supports ("avx2") && __builtin_cpu_supports ("fma")) {
        s_ukr = s_ukr_avx2;
        s_ukr_7 = s_ukr_avx2;
        s_ukr_16 = s_ukr_avx2_16;
        s_panel_rows = s_panel_rows_avx2;
        s_isa = "avx2";
    }
#endif
}

void
kiln_gemm_ukr (int width, int64_t kc, const float *a, const float *b,
               int64_t ldb, float *c, int64_t ldc, bool accumulate)
{
    pthread_once (&s_isa_once, s_isa_init);
    (width == NR ? s_ukr : s_ukr_16) (kc, a, b, ldb, c, ldc, accumulate);
}

static void s_finish (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0,
                      int64_t mr, int64_t nr, bool acc, bool last);

void
kiln_gemm_ukr_t (int rows, int64_t kc, const float *a, const float *b,
                 int64_t ldb, float *c, int64_t ldc, int64_t mr, int64_t nr,
                 bool accumulate)
{
    pthread_once (&s_isa_once, s_isa_init);
    float tmp[MR * NR] __attribute__ ((aligned (64)));
    (rows == MR ? s_ukr : s_ukr_7) (kc, a, b, ldb, tmp, NR, false);
    /* C'(r, q) at c[q·ldc + r]: the transposed finish, no epilogue */
    kiln_gemm_t g = { .m = mr, .n = nr, .c = c, .ldc = ldc, .c_trans = true,
                      .alpha = 1.0f, .act = KILN_ACT_NONE };
    s_finish (&g, tmp, 0, 0, mr, nr, accumulate, false);
}

const char *
kiln_gemm_isa (void)
{
    pthread_once (&s_isa_once, s_isa_init);
    return s_isa;
}

/* --- packing at run time --------------------------------------------- */


/* Rows m0..m0+mr-1, k0..k0+kc-1 of a strided A into panels of kc × MR,
 * `rp` rows (MR or 7) to a panel; the rest of a panel is zero. */
KILN_VCLONES static void
s_pack_a_strided (const kiln_gsrc_t *s, int64_t m0, int64_t mr, int64_t k0,
                  int64_t kc, float *dst, int64_t rp)
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
            if (rows == MR)
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
            s_panel_rows (panel, s->p + (m0 + p * rp) * s->rs + k0, NULL, 0, rows,
                          kc, s->rs);
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
    }
}

/* Columns n0..n0+nw-1, k0..k0+kc-1 of a strided B into panels of kc × NR. */
KILN_VCLONES static void
s_pack_b_strided (const kiln_gsrc_t *s, int64_t k0, int64_t kc, int64_t n0,
                  int64_t nw, float *dst)
{
    for (int64_t q = 0; q * NR < nw; q++) {
        float *panel = dst + q * kc * NR;
        int64_t j0 = n0 + q * NR, cols = s_min (NR, nw - q * NR);
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
    }
}

typedef struct {
    int off, len;           /* columns of the panel */
    int64_t oh, ow;         /* output position of the first */
} s_seg_t;

/* Columns n0..n0+nw-1 (output positions), k0..k0+kc-1 (tap-major) of the
 * im2col matrix of a convolution input, into panels of kc × `width`, `used`
 * of them filled: B panels (width and used NR), or A panels of the
 * transposed product (width MR, used MR or 7: the positions as rows).
 * For one tap and a run of output positions in one output row, every
 * input channel is read at the same offset in its plane: the loop over
 * channels is innermost. */
KILN_VCLONES static void
s_pack_conv (const kiln_gsrc_t *s, int64_t k0, int64_t kc, int64_t n0,
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
                        for (int64_t c = c0; c < c1; c++, src += hw, d += width)
                            memcpy (d, src, (size_t) len * sizeof *d);
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
                        memcpy (d + tlo, src + tlo, (size_t) (thi - tlo) * sizeof *d);
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

/* --- epilogue -------------------------------------------------------- */

/* The heavy activations (kiln_act_heavy) on n floats in place, in runs of
 * 64 through a buffer padded with zeros to a multiple of 16, so that the
 * vectorised loops (kiln_vmath.h) never fall into their scalar tails: a
 * tile epilogue's runs are 8, 14 or 28 floats long, and a run of 8 went
 * through the scalar tail 30 times slower a float.  The padding lanes
 * compute values nobody reads. */
KILN_VCLONES static void
s_act_heavy (float *v, int64_t n, kiln_act_t act, float a, float b)
{
    float t[64] __attribute__ ((aligned (64)));
    float u[64] __attribute__ ((aligned (64)));
    for (int64_t o = 0; o < n; o += 64) {
        int64_t m = n - o < 64 ? n - o : 64, m16 = (m + 15) & ~(int64_t) 15;
        float *x = v + o;
        memcpy (t, x, (size_t) m * sizeof *t);
        for (int64_t j = m; j < m16; j++)
            t[j] = 0.0f;
        switch (act) {
        case KILN_ACT_SIGMOID:
            kiln_vsigmoid (t, u, m16);
            break;
        case KILN_ACT_TANH:
            kiln_vtanh (t, u, m16);
            break;
        case KILN_ACT_SILU:
            /* Sigmoid, then Mul */
            kiln_vsigmoid (t, u, m16);
            for (int64_t j = 0; j < m16; j++)
                u[j] *= t[j];
            break;
        case KILN_ACT_GELU:
            /* Div by √2 (as a float), Erf, Add 1, Mul by x, Mul by 0.5 */
            for (int64_t j = 0; j < m16; j++)
                u[j] = t[j] / 1.41421353816986083984375f;
            kiln_verf (u, u, m16);
            for (int64_t j = 0; j < m16; j++)
                u[j] = (t[j] * (u[j] + 1.0f)) * 0.5f;
            break;
        case KILN_ACT_HARD_SWISH:
            /* ONNX HardSwish: x · max(0, min(1, x / 6 + 0.5)), NaN kept */
            for (int64_t j = 0; j < m16; j++) {
                float h = t[j] / 6.0f + 0.5f;
                h = h < 0.0f ? 0.0f : h;
                u[j] = t[j] * (h > 1.0f ? 1.0f : h);
            }
            break;
        case KILN_ACT_HARD_SIGMOID:
            for (int64_t j = 0; j < m16; j++) {
                float h = a * t[j] + b;
                h = h < 0.0f ? 0.0f : h;
                u[j] = h > 1.0f ? 1.0f : h;
            }
            break;
        default:
            return;
        }
        memcpy (x, u, (size_t) m * sizeof *x);
    }
}

#if defined(__x86_64__)
/* Whether the AVX-512 forms of the activations run: with the AVX-512
 * tile kernels (KILN_RT_ISA), so that a product's tiles and the other
 * kernels' outputs get the same values. */
static bool
s_act_avx512 (void)
{
    pthread_once (&s_isa_once, s_isa_init);
    return s_fin_avx512;
}

__attribute__ ((target ("avx512f"))) static void
s_act_apply_avx512 (float *v, int64_t n, kiln_act_t act, float a, float b)
{
    __m512 va = _mm512_set1_ps (a), vb = _mm512_set1_ps (b);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps (v + j, kiln_act16 (_mm512_loadu_ps (v + j), act, va, vb));
    if (j < n) {
        __mmask16 k = (__mmask16) ((1u << (n - j)) - 1);
        _mm512_mask_storeu_ps (v + j, k, kiln_act16 (_mm512_maskz_loadu_ps (k, v + j),
                                                     act, va, vb));
    }
}
#endif

KILN_VCLONES void
kiln_act_apply (float *v, int64_t n, kiln_act_t act, float a, float b)
{
    switch (act) {
    case KILN_ACT_RELU:
        for (int64_t j = 0; j < n; j++)
            v[j] = v[j] < 0.0f ? 0.0f : v[j];
        break;
    case KILN_ACT_CLIP:
        for (int64_t j = 0; j < n; j++) {
            float x = v[j] < a ? a : v[j];
            v[j] = x > b ? b : x;
        }
        break;
    case KILN_ACT_LEAKY:
        for (int64_t j = 0; j < n; j++)
            v[j] = v[j] < 0.0f ? v[j] * a : v[j];
        break;
    default:
#if defined(__x86_64__)
        if (kiln_act16_has (act) && s_act_avx512 ()) {
            s_act_apply_avx512 (v, n, act, a, b);
            break;
        }
#endif
        if (kiln_act_heavy (act))
            s_act_heavy (v, n, act, a, b);
        break;
    }
}

/* v[0..len-1] = act (alpha · v + addends) for product elements (i, j),
 * (i, j + 1), ... (along_j) or (i, j), (i + 1, j), ...: the epilogue of
 * a run of one row of C, or of one column when C is written transposed.
 * Every tile goes through here, in the same order of operations. */
static inline __attribute__ ((always_inline)) void
s_epi_run (const kiln_gemm_t *g, float *v, int64_t len, int64_t i, int64_t j,
           bool along_j)
{
    if (g->alpha != 1.0f)
        for (int64_t t = 0; t < len; t++)
            v[t] *= g->alpha;
    for (int a = 0; a < g->n_add; a++) {
        const kiln_gadd_t *ad = &g->add[a];
        const float *src = ad->p + i * ad->rs + j * ad->cs;
        int64_t st = along_j ? ad->cs : ad->rs;
        float sc = ad->scale;
        if (st == 0) {
            float val = sc * src[0];
            for (int64_t t = 0; t < len; t++)
                v[t] += val;
        } else if (st == 1 && sc == 1.0f) {
            for (int64_t t = 0; t < len; t++)
                v[t] += src[t];
        } else if (st == 1) {
            for (int64_t t = 0; t < len; t++)
                v[t] += sc * src[t];
        } else {
            for (int64_t t = 0; t < len; t++)
                v[t] += sc * src[t * st];
        }
    }
    switch (g->act) {
    case KILN_ACT_RELU:
        for (int64_t t = 0; t < len; t++)
            v[t] = v[t] < 0.0f ? 0.0f : v[t];
        break;
    case KILN_ACT_CLIP:
        for (int64_t t = 0; t < len; t++) {
            float x = v[t] < g->act_a ? g->act_a : v[t];
            v[t] = x > g->act_b ? g->act_b : x;
        }
        break;
    case KILN_ACT_LEAKY:
        for (int64_t t = 0; t < len; t++)
            v[t] = v[t] < 0.0f ? v[t] * g->act_a : v[t];
        break;
    default:                    /* heavy ones: by the caller, over the tile */
        break;
    }
}

/* Rows of a tile computed into t (MR × NR, row stride NR) written to C
 * at (i0, j0): C = (acc ? C : 0) + t, then the epilogue when `last`.
 * The tile passes through a row buffer once; C is written once. */
static inline __attribute__ ((always_inline)) void
s_finish_rows (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0,
               int64_t mr, int64_t nr, bool acc, bool last)
{
    for (int64_t r = 0; r < mr; r++) {
        float *row = g->c + (i0 + r) * g->ldc + j0;
        const float *tr = t + r * NR;
        float v[NR];
        if (acc)
            for (int64_t j = 0; j < nr; j++)
                v[j] = tr[j] + row[j];
        else
            for (int64_t j = 0; j < nr; j++)
                v[j] = tr[j];
        if (last)
            s_epi_run (g, v, nr, i0 + r, j0, true);
        if (last && kiln_act_heavy (g->act))
            kiln_act_apply (v, nr, g->act, g->act_a, g->act_b);
        for (int64_t j = 0; j < nr; j++)
            row[j] = v[j];
    }
}

/* The same for C written transposed: product column j0 + q is row
 * j0 + q of c, its elements i0 .. i0 + mr - 1 adjacent. */
static inline __attribute__ ((always_inline)) void
s_finish_cols (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0,
               int64_t mr, int64_t nr, bool acc, bool last)
{
    float tt[NR][MR];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < NR; q++)
            tt[q][r] = t[r * NR + q];
    for (int64_t q = 0; q < nr; q++) {
        float *col = g->c + (j0 + q) * g->ldc + i0;
        float *v = tt[q];
        if (acc)
            for (int64_t r = 0; r < mr; r++)
                v[r] += col[r];
        if (last)
            s_epi_run (g, v, mr, i0, j0 + q, false);
    }
    /* a heavy activation once over the tile (the lanes past mr unread) */
    if (last && kiln_act_heavy (g->act))
        kiln_act_apply (&tt[0][0], nr * MR, g->act, g->act_a, g->act_b);
    for (int64_t q = 0; q < nr; q++)
        memcpy (g->c + (j0 + q) * g->ldc + i0, tt[q], (size_t) mr * sizeof (float));
}

#if defined(__x86_64__)

/* The epilogue of s_epi_run on the lanes of v in `mask`, for addends
 * whose elements along the run are adjacent (step 1) or one value (step
 * 0): the same operations in the same order, so that a tile finished
 * here and one finished by s_finish are bit for bit alike. */
__attribute__ ((target ("avx512f"))) static inline __m512
s_epi_avx512 (const kiln_gemm_t *g, __m512 v, __mmask16 mask, int64_t i,
              int64_t j, bool along_j)
{
    if (g->alpha != 1.0f)
        v = _mm512_mul_ps (v, _mm512_set1_ps (g->alpha));
    for (int a = 0; a < g->n_add; a++) {
        const kiln_gadd_t *ad = &g->add[a];
        const float *src = ad->p + i * ad->rs + j * ad->cs;
        int64_t st = along_j ? ad->cs : ad->rs;
        if (st == 0) {
            v = _mm512_add_ps (v, _mm512_set1_ps (ad->scale * src[0]));
        } else {
            __m512 x = _mm512_maskz_loadu_ps (mask, src);
            if (ad->scale != 1.0f)
                x = _mm512_mul_ps (_mm512_set1_ps (ad->scale), x);
            v = _mm512_add_ps (v, x);
        }
    }
    __m512 zero = _mm512_setzero_ps ();
    switch (g->act) {
    case KILN_ACT_RELU:         /* max (0, v): see s_ukr_avx512_xb */
        v = _mm512_max_ps (zero, v);
        break;
    case KILN_ACT_CLIP:
        v = _mm512_min_ps (_mm512_set1_ps (g->act_b),
                           _mm512_max_ps (_mm512_set1_ps (g->act_a), v));
        break;
    case KILN_ACT_LEAKY:
        v = _mm512_mask_mul_ps (v, _mm512_cmp_ps_mask (v, zero, _CMP_LT_OQ), v,
                                _mm512_set1_ps (g->act_a));
        break;
    default:
        if (kiln_act16_has (g->act))
            v = kiln_act16 (v, g->act, _mm512_set1_ps (g->act_a), _mm512_set1_ps (g->act_b));
        break;
    }
    return v;
}

static __mmask16
s_mask16 (int64_t n)
{
    return n >= 16 ? (__mmask16) 0xffff : n <= 0 ? 0 : (__mmask16) ((1u << n) - 1);
}

/* s_finish for AVX-512: the rows of a tile as two vectors each, or (C
 * transposed) its columns by 8 × 8 transposes, eight rows to a vector. */
__attribute__ ((target ("avx512f"))) static void
s_finish_avx512 (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0,
                 int64_t mr, int64_t nr, bool acc, bool last)
{
    if (!g->c_trans) {
        __mmask16 k0 = s_mask16 (nr), k1 = s_mask16 (nr - 16);
        for (int64_t r = 0; r < mr; r++) {
            float *row = g->c + (i0 + r) * g->ldc + j0;
            __m512 v0 = _mm512_loadu_ps (t + r * NR);
            __m512 v1 = _mm512_loadu_ps (t + r * NR + 16);
            if (acc) {
                v0 = _mm512_add_ps (v0, _mm512_maskz_loadu_ps (k0, row));
                v1 = _mm512_add_ps (v1, _mm512_maskz_loadu_ps (k1, row + 16));
            }
            if (last) {
                v0 = s_epi_avx512 (g, v0, k0, i0 + r, j0, true);
                if (k1)
                    v1 = s_epi_avx512 (g, v1, k1, i0 + r, j0 + 16, true);
            }
            _mm512_mask_storeu_ps (row, k0, v0);
            _mm512_mask_storeu_ps (row + 16, k1, v1);
            if (last && kiln_act_heavy (g->act) && !kiln_act16_has (g->act))
                kiln_act_apply (row, nr, g->act, g->act_a, g->act_b);
        }
        return;
    }
    __mmask16 km = s_mask16 (mr < MR ? mr : MR);
    /* a heavy activation runs once over the tile's finished columns */
    bool heavy = last && kiln_act_heavy (g->act) && !kiln_act16_has (g->act);
    float fin[NR * MR] __attribute__ ((aligned (64)));
    for (int64_t q0 = 0; q0 < nr; q0 += 8) {
        __m256 col[8];
        for (int r = 0; r < MR; r++)
            col[r] = _mm256_loadu_ps (t + r * NR + q0);
        s_transpose8 (col);
        int64_t nq = nr - q0 < 8 ? nr - q0 : 8;
        for (int64_t q = 0; q < nq; q++) {
            float *c = g->c + (j0 + q0 + q) * g->ldc + i0;
            __m512 v = _mm512_castps256_ps512 (col[q]);
            if (acc)
                v = _mm512_add_ps (v, _mm512_maskz_loadu_ps (km, c));
            if (last)
                v = s_epi_avx512 (g, v, km, i0, j0 + q0 + q, false);
            if (heavy)
                _mm256_store_ps (fin + (q0 + q) * MR, _mm512_castps512_ps256 (v));
            else
                _mm512_mask_storeu_ps (c, km, v);
        }
    }
    if (heavy) {
        kiln_act_apply (fin, nr * MR, g->act, g->act_a, g->act_b);
        for (int64_t q = 0; q < nr; q++)
            _mm512_mask_storeu_ps (g->c + (j0 + q) * g->ldc + i0, km,
                                   _mm512_castps256_ps512 (_mm256_load_ps (fin + q * MR)));
    }
}


__attribute__ ((target ("avx512f"))) static void
s_ukr_avx512_x (int64_t kc, const float *a, int64_t ars, int64_t acs,
                const float *b, int64_t ldb, float *c, int64_t ldc,
                bool accumulate, const kiln_gemm_t *epi, int64_t i, int64_t j)
{
    s_ukr_avx512_xb (kc, a, ars, acs, b, ldb, c, ldc, accumulate, epi, i, j, NULL,
                     NULL, 0, NULL, 0, false);
}

/* The same, fetching a line from `pf` on into the cache at each step of
 * k: the next weight panel, while the last row panels of this one run. */
__attribute__ ((target ("avx512f"))) static void
s_ukr_avx512_xp (int64_t kc, const float *a, int64_t ars, int64_t acs,
                 const float *b, int64_t ldb, float *c, int64_t ldc,
                 bool accumulate, const kiln_gemm_t *epi, int64_t i, int64_t j,
                 const char *pf)
{
    s_ukr_avx512_xb (kc, a, ars, acs, b, ldb, c, ldc, accumulate, epi, i, j, pf,
                     NULL, 0, NULL, 0, false);
}

/* One of s_strassen's seven products for an MR × NR tile (k steps kc,
 * A's rows ars apart, B's steps NR apart): stored to, or added to or
 * subtracted from, the tile t2 (when not NULL); and stored to the tile
 * t (row stride NR), or added to the partial sum `acc` (a tile) and
 * finished into C at (i, j) with g's epilogue when `fin`. */
__attribute__ ((target ("avx512f"))) static void
s_ukr_avx512_s (int64_t kc, const float *a, int64_t ars, const float *b,
                const char *pf, float *t, const float *acc, const kiln_gemm_t *g,
                bool fin, int64_t i, int64_t j, float *t2, int t2_sign, bool t2_first)
{
    if (fin)
        s_ukr_avx512_xb (kc, a, ars, 1, b, NR, g->c + i * g->ldc + j, g->ldc, true,
                         s_no_epilogue (g) ? NULL : g, i, j, pf, acc, NR,
                         t2, t2_sign, t2_first);
    else
        s_ukr_avx512_xb (kc, a, ars, 1, b, NR, t, NR, acc != NULL, NULL, 0, 0, pf,
                         acc, NR, t2, t2_sign, t2_first);
}

#endif

/* s_finish_avx512 applies: the CPU has it and every addend is a vector
 * or one value along the runs it finishes. */
static bool
s_finish_fast (const kiln_gemm_t *g)
{
    if (!s_fin_avx512)
        return false;
    for (int a = 0; a < g->n_add; a++) {
        int64_t st = g->c_trans ? g->add[a].rs : g->add[a].cs;
        if (st != 0 && st != 1)
            return false;
    }
    return true;
}

KILN_VCLONES static void
s_finish_c (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0,
            int64_t mr, int64_t nr, bool acc, bool last)
{
    if (g->c_trans) {
        if (mr == MR)
            s_finish_cols (g, t, i0, j0, MR, nr, acc, last);
        else
            s_finish_cols (g, t, i0, j0, mr, nr, acc, last);
    } else if (nr == NR) {
        s_finish_rows (g, t, i0, j0, mr, NR, acc, last);
    } else {
        s_finish_rows (g, t, i0, j0, mr, nr, acc, last);
    }
}

static void
s_finish (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0,
          int64_t mr, int64_t nr, bool acc, bool last)
{
#if defined(__x86_64__)
    if (s_finish_fast (g)) {
        s_finish_avx512 (g, t, i0, j0, mr, nr, acc, last);
        return;
    }
#endif
    s_finish_c (g, t, i0, j0, mr, nr, acc, last);
}

/* --- driver ---------------------------------------------------------- */

typedef struct {
    int64_t kc, nkb;        /* k block, number of k blocks */
    int64_t mc, nc;         /* rows and columns of a tile */
    int64_t tm, tn;         /* tiles along m and n */
    int64_t rp;             /* rows of an A panel packed here: MR or 7 */
} s_block_t;

/* The k block: at most S_KC; but when B is a pre-packed weight and A is
 * packed here, as long as the A block (every row of the product, at most
 * S_A_FLOATS) stays in L2: each block past the first adds the partial
 * tile to C again (a transpose more when C is written transposed).  A
 * function of the product's shape only, never of the thread count: the
 * blocks fix the order of the sums. */
static int64_t
s_kc (int64_t m, int64_t k, bool a_packed, bool b_packed, int64_t *nkb)
{
    *nkb = (k + S_KC - 1) / S_KC;
    if (b_packed && !a_packed && *nkb > 1) {
        int64_t rows = s_min (s_round_up (m, MR), S_MC);
        int64_t fit = s_min (S_A_FLOATS / rows, S_KC_LONG);
        *nkb = (k + fit - 1) / fit;
    }
    return *nkb ? (k + *nkb - 1) / *nkb : 0;
}

/* Floats of the partial sums of a product written transposed over
 * several k blocks: its tiles are added up untransposed here, every row
 * and column of a tile (and MR rows of slack for the micro-kernel's
 * whole panels), and transposed once, with the last block.  0 when the
 * product has one k block, or when that would take more than
 * S_PART_FLOATS (the tiles are then added up in C, a transpose each). */
static int64_t
s_part_floats (int64_t m, int64_t n, int64_t k, bool a_packed, bool b_packed)
{
    int64_t nkb;
    s_kc (m, k, a_packed, b_packed, &nkb);
    if (a_packed || !b_packed || nkb < 2)
        return 0;
    int64_t f = (s_min (s_round_up (m, MR), S_MC) + MR) * s_round_up (n, NR);
    return f <= S_PART_FLOATS ? f : 0;
}

/* Floats of the A block packed here (panels of 7 rows take the room of 8). */
static int64_t
s_ablock_floats (int64_t m, int64_t kc)
{
    return kc * ((s_min (s_round_up (m, MR), S_MC) + 6) / 7 * MR);
}

static int64_t
s_max64 (int64_t a, int64_t b)
{
    return a > b ? a : b;
}

/* Strassen's one level (s_strassen_run) for a product of this shape:
 * halves of whole tiles; k long enough to pay for the sums, and A's
 * five sums (5/4 of A) within 320 KiB, in L2; columns enough to share
 * them.  (Over the transformer's FFN 2, k 2048 and n 256, it gained 2 %
 * alone and lost in the model: its A's sums are 1.25 MiB.) */
static bool
s_strassen_shape (int64_t m, int64_t n, int64_t k)
{
    return m % (2 * MR) == 0 && n % (2 * NR) == 0 && k % 32 == 0
           && m >= 4 * MR && n >= 16 * NR && k >= 256 && k <= 512
           && m * k <= 128 * 512;
}

/* Floats of a worker's workspace: A's five sums (worker 0's, read by
 * all), B's five sums for one pair of column panels, the four tiles
 * being summed and 64 bytes to align them. */
static int64_t
s_strassen_floats (int64_t m, int64_t k)
{
    return 5 * (m / 2) * (k / 2) + 5 * (k / 2) * NR + 4 * MR * NR + 16;
}

size_t
kiln_gemm_ws_bytes (int64_t m, int64_t n, int64_t k, bool a_packed,
                    bool b_packed)
{
    int64_t nkb, kc = s_kc (m, k, a_packed, b_packed, &nkb);
    int64_t floats = MR * NR;                           /* an edge tile */
    if (!b_packed)
        floats += kc * s_min (s_round_up (n, NR), S_NC);
    else    /* a half B widened: one panel, or the block (s_tile) */
        floats += kc * (a_packed ? s_min (s_round_up (n, NR), S_NC) : NR);
    if (!a_packed)
        floats += s_ablock_floats (m, kc);
    floats += s_part_floats (m, n, k, a_packed, b_packed);
    if (!a_packed && b_packed && s_strassen_shape (m, n, k))
        floats = s_max64 (floats, s_strassen_floats (m, k));
    return (size_t) floats * sizeof (float) + 64;
}

static void
s_blocking (const kiln_gemm_t *g, int64_t count, int threads, s_block_t *bl)
{
    bool a_packed = g->a.kind == KILN_GSRC_PACKED;
    bool b_packed = g->b.kind == KILN_GSRC_PACKED;
    bl->kc = s_kc (g->m, g->k, a_packed, b_packed, &bl->nkb);
    /* An A packed here may come in panels of 7 rows, which the 7-row
     * micro-kernel runs at the rate of 8: when that computes fewer rows
     * (49 = 7 · 7 rows, not 56). */
    bl->rp = !a_packed && s_round_up (g->m, 7) < s_round_up (g->m, MR) ? 7 : MR;
    bl->mc = a_packed ? s_round_up (g->m, MR)
                      : s_min (s_round_up (g->m, bl->rp), S_MC / bl->rp * bl->rp);
    /* A packed weight B needs no block of its own: a tile then spans
     * every column, so that its A block is packed once (s_tile). */
    bl->nc = b_packed && !a_packed ? s_round_up (g->n, NR)
                                   : s_min (s_round_up (g->n, NR), S_NC);
    if (bl->mc < bl->rp)
        bl->mc = bl->rp;
    if (bl->nc < NR)
        bl->nc = NR;
    /* With several threads, cut finer until there are a few tiles per
     * thread: columns first (each tile then packs its own B block once),
     * rows when the columns run out. */
    if (threads > 1) {
        int64_t want = 4 * (int64_t) threads;
        for (;;) {
            int64_t tiles = count * ((g->m + bl->mc - 1) / bl->mc)
                            * ((g->n + bl->nc - 1) / bl->nc);
            if (tiles >= want)
                break;
            if (bl->nc > NR && (g->n + bl->nc / 2 - 1) / (bl->nc / 2)
                                 > (g->n + bl->nc - 1) / bl->nc)
                bl->nc = s_round_up (bl->nc / 2, NR);
            else if (bl->mc > 4 * MR)
                bl->mc = s_round_up (bl->mc / 2, a_packed ? MR : bl->rp);
            else
                break;
        }
    }
    bl->tm = g->m ? (g->m + bl->mc - 1) / bl->mc : 0;
    bl->tn = g->n ? (g->n + bl->nc - 1) / bl->nc : 0;
}

/* One micro-tile: the micro-kernel writes C itself while the tile is a
 * partial sum (or needs no epilogue), else it goes through s_finish.
 * With `x` (AVX-512, C not transposed) it is s_ukr_avx512_x, whose A
 * (row r, step kk at a[r·ars + kk·acs]) may be a packed panel or the
 * rows themselves, and which applies the epilogue itself when `xepi`. */
static inline void
s_micro (const kiln_gemm_t *g, s_ukr_fn *ukr, int64_t rp, int64_t kc,
         const float *a, const float *b, int64_t i, int64_t j, bool acc,
         bool last, bool plain, float *tmp, float *part, int64_t ldp,
         bool x, bool xepi, int64_t ars, int64_t acs, const char *pf)
{
    int64_t mr = s_min (rp, g->m - i), nr = s_min (NR, g->n - j);
#if defined(__x86_64__)
    if (x) {
        if (mr == MR && nr == NR && (!last || plain || xepi)) {
            if (pf)
                s_ukr_avx512_xp (kc, a, ars, acs, b, NR, g->c + i * g->ldc + j,
                                 g->ldc, acc, last && !plain ? g : NULL, i, j, pf);
            else
                s_ukr_avx512_x (kc, a, ars, acs, b, NR, g->c + i * g->ldc + j,
                                g->ldc, acc, last && !plain ? g : NULL, i, j);
            return;
        }
        s_ukr_avx512_x (kc, a, ars, acs, b, NR, tmp, NR, false, NULL, 0, 0);
        s_finish (g, tmp, i, j, mr, nr, acc, last);
        return;
    }
#endif
    if (part && !last) {
        /* a partial sum of a transposed C: added up as it is */
        ukr (kc, a, b, NR, part, ldp, acc);
        return;
    }
    if (part) {
        ukr (kc, a, b, NR, tmp, NR, false);
        for (int r = 0; r < MR; r++)
            for (int q = 0; q < NR; q++)
                tmp[r * NR + q] = tmp[r * NR + q] + part[r * ldp + q];
        s_finish (g, tmp, i, j, mr, nr, false, true);
        return;
    }
    if ((!last || plain) && !g->c_trans && mr == MR && nr == NR) {
        ukr (kc, a, b, NR, g->c + i * g->ldc + j, g->ldc, acc);
        return;
    }
    ukr (kc, a, b, NR, tmp, NR, false);
    s_finish (g, tmp, i, j, mr, nr, acc, last);
}

/* Panel j (its first column) of a half B, its steps k0..k0+kc-1, widened
 * into dst (kc × NR floats): a packed panel is k-major, so its k block
 * is one run of kc × NR elements. */
static void
s_widen_panel (const kiln_gemm_t *g, int64_t j, int64_t k0, int64_t kc, float *dst)
{
    const uint16_t *src = (const uint16_t *) (const void *) g->b.p
                          + (j / NR) * g->k * NR + k0 * NR;
    kiln_convert_widen (g->b_half, src, dst, kc * NR);
}

static void
s_tile (const kiln_gemm_t *g, const s_block_t *bl, int64_t m0, int64_t m1,
        int64_t n0, int64_t n1, float *ws)
{
    /* rows of an A panel: a pre-packed A has MR, one packed here rp */
    int64_t rp = g->a.kind == KILN_GSRC_PACKED ? MR : bl->rp;
    s_ukr_fn *ukr = rp == MR ? s_ukr : s_ukr_7;
    bool b_half = g->b.kind == KILN_GSRC_PACKED && g->b_half;
    float *tmp = ws;                                    /* MR × NR */
    float *bws = tmp + MR * NR;
    float *aws = bws + (g->b.kind != KILN_GSRC_PACKED ? bl->kc * bl->nc
                        : !b_half ? 0
                        : bl->kc * (g->a.kind == KILN_GSRC_PACKED ? bl->nc : NR));
    /* a transposed C over several k blocks: partial sums (tile rows
     * ldp = nc apart) next to the A block */
    bool a_packed = g->a.kind == KILN_GSRC_PACKED;
    float *part = g->c_trans && s_part_floats (g->m, g->n, g->k, a_packed,
                                               g->b.kind == KILN_GSRC_PACKED)
                  ? aws + (a_packed ? 0 : s_ablock_floats (g->m, bl->kc)) : NULL;
    int64_t ldp = bl->nc;
    if (bl->nkb == 0) {
        /* k = 0: the epilogue of zeros */
        memset (tmp, 0, MR * NR * sizeof *tmp);
        for (int64_t i = m0; i < m1; i += rp)
            for (int64_t j = n0; j < n1; j += NR)
                s_finish (g, tmp, i, j, s_min (rp, m1 - i), s_min (NR, n1 - j),
                          false, true);
        return;
    }
    bool plain = !g->c_trans && g->alpha == 1.0f && g->n_add == 0
                 && g->act == KILN_ACT_NONE;
    /* A pre-packed B (a weight) with an A packed here: the A block (at
     * most S_MC × S_KC) stays in L2 while the B panels stream past it,
     * each used by every row panel before the next.  Otherwise the B
     * block packed here stays in L2 and each A panel in L1. */
    bool j_outer = g->b.kind == KILN_GSRC_PACKED && g->a.kind != KILN_GSRC_PACKED;
    /* AVX-512 and C not transposed: the tiles run on s_ukr_avx512_x,
     * which applies the epilogue itself when s_finish_avx512 could, and
     * reads the rows of an A laid along k (a MatMul's activations) where
     * they lie: only a last panel of fewer than MR rows is packed. */
    bool x = s_fin_avx512 && !g->c_trans && rp == MR;
    bool xepi = x && s_finish_fast (g);
    bool direct = x && g->a.kind == KILN_GSRC_STRIDED && g->a.cs == 1;
    int64_t m_full = m0 + (m1 - m0) / MR * MR;  /* rows read where they lie */
    for (int64_t kb = 0; kb < bl->nkb; kb++) {
        int64_t k0 = kb * bl->kc, kc = s_min (bl->kc, g->k - k0);
        bool last = kb == bl->nkb - 1, acc = kb > 0;
        const float *bp, *ap;
        int64_t bstride, astride;
        if (b_half) {
            /* widened into the workspace: the panel of each j in turn
             * (j_outer), else the tile's whole block now */
            bp = bws;
            bstride = kc * NR;
            for (int64_t j = n0; !j_outer && j < n1; j += NR)
                s_widen_panel (g, j, k0, kc, bws + (j - n0) / NR * bstride);
        } else if (g->b.kind == KILN_GSRC_PACKED) {
            bp = g->b.p + (n0 / NR) * g->k * NR + k0 * NR;
            bstride = g->k * NR;
        } else {
            if (g->b.kind == KILN_GSRC_CONV)
                s_pack_conv (&g->b, k0, kc, n0, n1 - n0, bws, NR, NR);
            else
                s_pack_b_strided (&g->b, k0, kc, n0, n1 - n0, bws);
            bp = bws;
            bstride = kc * NR;
        }
        if (g->a.kind == KILN_GSRC_PACKED) {
            ap = g->a.p + (m0 / MR) * g->k * MR + k0 * MR;
            astride = g->k * MR;
        } else if (direct) {
            if (m_full < m1)
                s_pack_a_strided (&g->a, m_full, m1 - m_full, k0, kc, aws, MR);
            ap = aws;
            astride = 0;
        } else {
            if (g->a.kind == KILN_GSRC_CONV)
                s_pack_conv (&g->a, k0, kc, m0, m1 - m0, aws, MR, rp);
            else
                s_pack_a_strided (&g->a, m0, m1 - m0, k0, kc, aws, rp);
            ap = aws;
            astride = kc * MR;
        }
        /* A of row panel i: its rows (ars apart) or its packed panel */
#define S_A_OF(i)                                                             \
    const float *ai = ap + ((i) - m0) / rp * astride;                         \
    int64_t ars = 1, acs = MR;                                                \
    if (direct && (i) < m_full) {                                             \
        ai = g->a.p + (i) * g->a.rs + k0;                                     \
        ars = g->a.rs;                                                        \
        acs = 1;                                                              \
    }
        if (j_outer) {
            /* (in order: a 7-row panel's zero eighth row lands in the
             * partial sums of the next panel before it writes them) */
            /* A weight streamed from memory would stall the first row
             * panel of each column panel: the last two row panels fetch
             * the next column panel (or the first of the next k block),
             * a line per step of k (a panel has two: NR floats a step),
             * so that it is in cache when its turn comes (the model's
             * transformer: 12.98 against 13.13 ms, side by side). */
            int64_t pf_from = m1 - 2 * rp;
            bool pf_on = x && g->b.kind == KILN_GSRC_PACKED && !b_half
                         && pf_from >= m0 + rp;
            for (int64_t j = n0; j < n1; j += NR) {
                const float *bj = bp + (j - n0) / NR * bstride;
                if (b_half) {
                    s_widen_panel (g, j, k0, kc, bws);
                    bj = bws;
                }
                const char *next = NULL;
                if (pf_on && j + NR < n1)
                    next = (const char *) (bp + (j + NR - n0) / NR * bstride);
                else if (pf_on && !last)
                    next = (const char *) (g->b.p + (n0 / NR) * g->k * NR
                                           + (k0 + kc) * NR);
                for (int64_t i = m0; i < m1; i += rp) {
                    S_A_OF (i);
                    const char *pf = next && i >= pf_from
                                     ? next + (i - pf_from) / rp * kc * 64 : NULL;
                    s_micro (g, ukr, rp, kc, ai, bj, i, j, acc, last, plain, tmp,
                             part ? part + (i - m0) * ldp + (j - n0) : NULL, ldp, x,
                             xepi, ars, acs, pf);
                }
            }
        } else {
            for (int64_t i = m0; i < m1; i += rp) {
                S_A_OF (i);
                for (int64_t j = n0; j < n1; j += NR)
                    s_micro (g, ukr, rp, kc, ai, bp + (j - n0) / NR * bstride, i, j,
                             acc, last, plain, tmp, NULL, 0, x, xepi, ars, acs, NULL);
            }
        }
#undef S_A_OF
    }
}

typedef struct {
    kiln_gemm_get_fn *get;
    const void *ctx;
    s_block_t bl;
    int64_t first;          /* task 0 of this section */
    float *ws;
    size_t ws_stride;       /* floats per worker */
} s_run_t;

static void
s_task (void *arg, int task, int worker)
{
    const s_run_t *r = arg;
    int64_t t = r->first + task, per = r->bl.tm * r->bl.tn;
    kiln_gemm_t g;
    r->get (r->ctx, t / per, &g);
    t %= per;
    int64_t m0 = t / r->bl.tn * r->bl.mc, n0 = t % r->bl.tn * r->bl.nc;
    s_tile (&g, &r->bl, m0, s_min (g.m, m0 + r->bl.mc), n0,
            s_min (g.n, n0 + r->bl.nc), r->ws + (size_t) worker * r->ws_stride);
}

/* --- Strassen -------------------------------------------------------
 *
 * One level of Strassen's algorithm for the products that spend most of
 * a transformer's time (a weight B pre-packed, A's rows read where they
 * lie, k 256-512, n >= 512: its FFN 1 and QKV projections): with the
 * halves A11 A12 / A21 A22 (rows, k) and B11 B12 / B21 B22 (k, columns),
 *   M1 = (A11 + A22)(B11 + B22)   M5 = (A11 + A12) B22
 *   M2 = (A21 + A22) B11          M6 = (A21 - A11)(B11 + B12)
 *   M3 = A11 (B12 - B22)          M7 = (A12 - A22)(B21 + B22)
 *   M4 = A22 (B21 - B11)
 *   C11 = M1 + M4 - M5 + M7       C12 = M3 + M5
 *   C21 = M2 + M4                 C22 = M1 - M2 + M3 + M6
 * seven half-size products where the direct product has eight: 1/8 of
 * the multiplications saved, against the sums of the halves.  Here:
 *  - A's five sums are formed once per product (5/4 of A, in L2);
 *  - B's five sums for a pair of column panels (q, q + n/2) by the task
 *    of that pair, from the packed weight as it lies: nothing more is
 *    stored in the artifact (seven packed operands, formed by the
 *    compiler, were 7/4 of the weight's bytes to stream each run, and
 *    lost in the model: docs/engine.md);
 *  - each M is a tile product (s_ukr_avx512_s) whose result goes to one
 *    or two of the four tiles of C being summed (in L1), the last into C
 *    itself with the epilogue, in the order written above.
 * The transformer's FFN 1 (128 × 256 × 2048, bias and relu): 1.187 ms
 * direct, 1.138 ms this way; the model 13.03 -> 12.85 ms.  The sums of
 * halves round differently: the largest error against double over that
 * product is 8.8e-7 of the output's magnitude, against 6.3e-7 direct.
 * Which products run this way depends on their shape and the ISA only,
 * never on the thread count, and each element's sums are the same
 * whichever worker runs its pair of panels: results are the same bits
 * for any KILN_RT_THREADS. */

#if defined(__x86_64__)
typedef struct {
    const kiln_gemm_t *g;
    float *ws;
    size_t ws_stride;
} s_str_t;

/* dst = x + sign · y, n floats (a multiple of 16) */
__attribute__ ((target ("avx512f"))) static void
s_vsum (float *dst, const float *x, const float *y, int sign, int64_t n)
{
    for (int64_t q = 0; q < n; q += 16) {
        __m512 a = _mm512_loadu_ps (x + q), b = _mm512_loadu_ps (y + q);
        _mm512_storeu_ps (dst + q, sign < 0 ? _mm512_sub_ps (a, b) : _mm512_add_ps (a, b));
    }
}

/* Pair of column panels `task`: B's sums, then each group of MR rows
 * of the upper and lower halves. */
static void
s_strassen_task (void *arg, int task, int worker)
{
    const s_str_t *st = arg;
    const kiln_gemm_t *g = st->g;
    int64_t h = g->k / 2, mh = g->m / 2, np = g->n / NR / 2;
    const float *as = st->ws;                   /* worker 0's: A's sums */
    float *w = st->ws + (size_t) worker * st->ws_stride + 5 * mh * h;
    float *tb = w, *tl = w + 5 * h * NR;
    tl = (float *) (((uintptr_t) tl + 63) & ~(uintptr_t) 63);
    float *t11 = tl, *t12 = tl + MR * NR, *t21 = tl + 2 * MR * NR;
    float *t22 = tl + 3 * MR * NR;
    int64_t q = task;
    const float *b11 = g->b.p + q * g->k * NR, *b21 = b11 + h * NR;
    const float *b12 = g->b.p + (q + np) * g->k * NR, *b22 = b12 + h * NR;
    float *T1 = tb, *T3 = tb + h * NR, *T4 = tb + 2 * h * NR;
    float *T6 = tb + 3 * h * NR, *T7 = tb + 4 * h * NR;
    s_vsum (T1, b11, b22, 1, h * NR);
    s_vsum (T3, b12, b22, -1, h * NR);
    s_vsum (T4, b21, b11, -1, h * NR);
    s_vsum (T6, b11, b12, 1, h * NR);
    s_vsum (T7, b21, b22, 1, h * NR);
    const float *S1 = as, *S2 = as + mh * h, *S5 = as + 2 * mh * h;
    const float *S6 = as + 3 * mh * h, *S7 = as + 4 * mh * h;
    int64_t ars = g->a.rs;
    /* the next pair's two panels (2·k·NR floats, 2·h lines each half)
     * fetched by the products of the last two row groups, h lines each */
    int64_t groups = mh / MR, pf_first = (groups - 2) * 7;
    const char *nx0 = q + 1 < np ? (const char *) (b11 + g->k * NR) : NULL;
    const char *nx1 = q + 1 < np ? (const char *) (b12 + g->k * NR) : NULL;
    int64_t call = 0;
#define S_PF()                                                                  \
    (nx0 && call >= pf_first && call < pf_first + 8                             \
         ? (call - pf_first < 4 ? nx0 + (call - pf_first) * h * 64              \
                                : nx1 + (call - pf_first - 4) * h * 64)         \
         : NULL)
    for (int64_t i = 0; i < mh; i += MR) {
        const float *a11 = g->a.p + i * ars, *a22 = g->a.p + (mh + i) * ars + h;
        int64_t jl = q * NR, jr = (q + np) * NR;
        /* C11 = M1 + M4 - M5 + M7, C12 = M3 + M5, C21 = M2 + M4,
         * C22 = M1 - M2 + M3 + M6, in that order */
        s_ukr_avx512_s (h, S1 + i * h, h, T1, S_PF (), t11, NULL, g, false, 0, 0,
                        t22, 1, true);
        call++;
        s_ukr_avx512_s (h, S2 + i * h, h, b11, S_PF (), t21, NULL, g, false, 0, 0,
                        t22, -1, false);
        call++;
        s_ukr_avx512_s (h, a11, ars, T3, S_PF (), t12, NULL, g, false, 0, 0,
                        t22, 1, false);
        call++;
        s_ukr_avx512_s (h, a22, ars, T4, S_PF (), NULL, t21, g, true, mh + i, jl,
                        t11, 1, false);
        call++;
        s_ukr_avx512_s (h, S5 + i * h, h, b22, S_PF (), NULL, t12, g, true, i, jr,
                        t11, -1, false);
        call++;
        s_ukr_avx512_s (h, S6 + i * h, h, T6, S_PF (), NULL, t22, g, true, mh + i, jr,
                        NULL, 0, false);
        call++;
        s_ukr_avx512_s (h, S7 + i * h, h, T7, S_PF (), NULL, t11, g, true, i, jl,
                        NULL, 0, false);
        call++;
    }
#undef S_PF
}

/* A's sums into worker 0's workspace (read by every task), then the
 * pairs of column panels on the pool. */
static void
s_strassen_run (const kiln_gemm_t *g, float *ws, size_t ws_stride)
{
    int64_t h = g->k / 2, mh = g->m / 2;
    const float *a = g->a.p;
    int64_t ars = g->a.rs;
    float *S1 = ws, *S2 = ws + mh * h, *S5 = ws + 2 * mh * h;
    float *S6 = ws + 3 * mh * h, *S7 = ws + 4 * mh * h;
    for (int64_t i = 0; i < mh; i++) {
        const float *a11 = a + i * ars, *a12 = a11 + h;
        const float *a21 = a + (mh + i) * ars, *a22 = a21 + h;
        s_vsum (S1 + i * h, a11, a22, 1, h);
        s_vsum (S2 + i * h, a21, a22, 1, h);
        s_vsum (S5 + i * h, a11, a12, 1, h);
        s_vsum (S6 + i * h, a21, a11, -1, h);
        s_vsum (S7 + i * h, a12, a22, -1, h);
    }
    s_str_t st = { g, ws, ws_stride };
    kiln_exec_parallel (s_strassen_task, &st, (int) (g->n / NR / 2));
}
#endif

bool
kiln_gemm_strassen (const kiln_gemm_t *g)
{
#if defined(__x86_64__)
    pthread_once (&s_isa_once, s_isa_init);
    return s_fin_avx512 && !g->c_trans && g->b.kind == KILN_GSRC_PACKED
           && !g->b_half && g->a.kind == KILN_GSRC_STRIDED && g->a.cs == 1
           && s_strassen_shape (g->m, g->n, g->k) && s_finish_fast (g);
#else
    (void) g;
    return false;
#endif
}

void
kiln_gemm_run (kiln_gemm_get_fn *get, const void *ctx, int64_t count)
{
    pthread_once (&s_isa_once, s_isa_init);
    if (count <= 0)
        return;
    kiln_gemm_t g;
    get (ctx, 0, &g);
    if (g.m == 0 || g.n == 0)
        return;
    s_run_t r = { .get = get, .ctx = ctx };
    s_blocking (&g, count, kiln_exec_threads (), &r.bl);
    size_t bytes;
    float *ws = kiln_exec_ws (&bytes);
    r.ws = (float *) (((uintptr_t) ws + 63) & ~(uintptr_t) 63);
    r.ws_stride = bytes / sizeof (float);
#if defined(__x86_64__)
    if (count == 1 && kiln_gemm_strassen (&g)) {
        s_strassen_run (&g, r.ws, r.ws_stride);
        return;
    }
#endif
    int64_t total = count * r.bl.tm * r.bl.tn;
    for (int64_t first = 0; first < total; first += 1 << 30) {
        r.first = first;
        kiln_exec_parallel (s_task, &r, (int) s_min (total - first, 1 << 30));
    }
}
