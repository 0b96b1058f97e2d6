/*
 * kiln_gemm_avx512 — the matrix engine's AVX-512 micro-kernels, with
 * the epilogue applied in registers, and its AVX-512 finish of a tile
 * (kiln_gemm_priv.h).  Built for any x86-64 CPU: each function carries
 * its target attribute, and kiln_gemm.c picks them at run time.
 */
#include "runtime/kiln_gemm_priv.h"

#include "runtime/kiln_vmath.h"

#if defined(__x86_64__)

/* steps of k ahead that kiln_gukr_avx512_xpk fetches B's rows */
#define S_PK_AHEAD 16

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
s_epi_tile_init (const kiln_gemm_t *g, int64_t i, int64_t j, bool half, __mmask16 k0,
                 __mmask16 k1, s_epi_tile_t *e)
{
    e->n_add = g->n_add;
    for (int a = 0; a < g->n_add && a < 2; a++) {
        const kiln_gadd_t *ad = &g->add[a];
        e->scale[a] = ad->scale;
        e->p[a] = ad->p + i * ad->rs + j * ad->cs;
        e->rs[a] = ad->rs;
        if (ad->rs == 0 && ad->cs == 1) {
            e->kind[a] = 0;
            for (int h = 0; h < 2 - half; h++) {
                __m512 x = _mm512_maskz_loadu_ps (h ? k1 : k0, ad->p + j + 16 * h);
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

/* Fetching n cache lines from p on into the cache while a micro-kernel
 * runs kc steps of k: one line every kc / n steps (every step when n is
 * larger), the next weight panel while this one is used. */
typedef struct {
    const char *p, *end;
    int64_t every, at;
} s_pf_t;

__attribute__ ((always_inline)) static inline s_pf_t
s_pf_init (const char *p, int64_t n, int64_t kc)
{
    s_pf_t f = { p, p ? p + n * 64 : NULL, n > 0 && kc / n > 1 ? kc / n : 1, 0 };
    return f;
}

__attribute__ ((always_inline)) static inline void
s_pf_step (s_pf_t *f, int64_t kk)
{
    if (f->p && kk == f->at && f->p < f->end) {
        __builtin_prefetch (f->p, 0, 3);
        f->p += 64;
        f->at += f->every;
    }
}

/* The 8 × 32 AVX-512 kernel of kiln_gukr_avx512 with two things more, for
 * the tiles of the driver (s_tile):
 *  - A read where it lies: row r's element kk at a[r·ars + kk·acs], so
 *    that a packed panel (ars 1, acs MR) and eight rows of a row-major
 *    activation (ars its row stride, acs 1) are read by the same loop.
 *    The latter spares packing the activations of a transformer's
 *    products (8 × 8 transposes of every A block, 2 % of the model's
 *    time): each row's cache line serves 16 steps of k.
 *  - the epilogue (`epi`, not NULL: tile (i, j) of that product, the
 *    last k block) applied in registers before the single store, with
 *    the operations of kiln_gfinish_avx512 in the same order, instead of
 *    storing the tile to a buffer and loading it back for kiln_gfinish (3 %
 *    of the transformer's time).
 * The sums over k run in the order of kiln_gukr_avx512: results are the
 * same bits.  With `pf`, pf_n lines from pf on are fetched into the
 * cache, spread over the steps of k (kiln_gukr_avx512_xp).  With `r7`
 * the tile has 7 rows: the eighth is neither read from A nor written
 * (kiln_gukr_avx512_x7). */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_ukr_avx512_xb (int64_t kc, const float *a, int64_t ars, int64_t acs,
                 const float *b, int64_t ldb, float *c, int64_t ldc,
                 bool accumulate, const kiln_gemm_t *epi, int64_t i, int64_t j,
                 const char *pf, int64_t pf_n, const float *acc_src, int64_t acc_ld,
                 float *t2, int t2_sign, bool t2_first, float *bpk,
                 const kiln_gpro_t *pro, const bool half, const bool masked,
                 int64_t ncols, const bool r7)
{
    /* `masked`: only the tile's first ncols columns are C's (the last
     * column panel of a product), read and written under masks */
    const __mmask16 k0 = !masked || ncols >= 16 ? 0xffff : (__mmask16) ((1u << ncols) - 1);
    const __mmask16 k1 = !masked || ncols >= 32 ? 0xffff
                         : ncols > 16 ? (__mmask16) ((1u << (ncols - 16)) - 1) : 0;
#define S_LD(p, h) \
    (masked ? _mm512_maskz_loadu_ps ((h) ? k1 : k0, (p)) : _mm512_loadu_ps (p))
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
    s_pf_t pfs = s_pf_init (pf, pf_n, kc);
#define S_ROW(r, o)                                               \
    do {                                                          \
        __m512 ar = _mm512_set1_ps (a[o]);                        \
        c##r##0 = _mm512_fmadd_ps (ar, b0, c##r##0);              \
        if (!half)                                                \
            c##r##1 = _mm512_fmadd_ps (ar, b1, c##r##1);          \
    } while (0)
#pragma GCC unroll 4
    for (int64_t kk = 0; kk < kc; kk++) {
        __m512 b0 = _mm512_loadu_ps (b);
        __m512 b1 = half ? b0 : _mm512_loadu_ps (b + 16);
        if (bpk && pro) {
            /* B's prologue, as kiln_gpack_b_strided applies it: v · s + b
             * (two roundings), then max (0, ·) keeping NaN and -0 */
            __m512 sv = _mm512_set1_ps (pro->s[kk]), tv = _mm512_set1_ps (pro->b[kk]);
            b0 = _mm512_add_ps (_mm512_mul_ps (b0, sv), tv);
            b1 = _mm512_add_ps (_mm512_mul_ps (b1, sv), tv);
            if (pro->relu) {
                b0 = _mm512_max_ps (_mm512_setzero_ps (), b0);
                b1 = _mm512_max_ps (_mm512_setzero_ps (), b1);
            }
        }
        if (bpk) {
            _mm512_storeu_ps (bpk, b0);
            _mm512_storeu_ps (bpk + 16, b1);
            bpk += NR;
            __builtin_prefetch (b + S_PK_AHEAD * ldb, 0, 3);
            __builtin_prefetch (b + S_PK_AHEAD * ldb + 16, 0, 3);
        }
        S_ROW (0, 0); S_ROW (1, o1); S_ROW (2, o2); S_ROW (3, o3);
        S_ROW (4, o4); S_ROW (5, o5); S_ROW (6, o6);
        if (!r7)
            S_ROW (7, o7);
        s_pf_step (&pfs, kk);
        a += acs;
        b += ldb;
    }
#undef S_ROW
    /* Then, stage by stage over the tile's 16 vectors (each decision
     * once per tile): the partial sum already in C, alpha, the addends
     * in order, the activation; the same operations in the same order
     * for each element as kiln_gfinish_avx512. */
#define S_ALL(OP)                                                               \
    do {                                                                        \
        OP (0, 0); OP (1, 0); OP (2, 0); OP (3, 0);                             \
        OP (4, 0); OP (5, 0); OP (6, 0);                                        \
        if (!r7)                                                                \
            OP (7, 0);                                                          \
        if (!half) {                                                            \
            OP (0, 1); OP (1, 1); OP (2, 1); OP (3, 1);                         \
            OP (4, 1); OP (5, 1); OP (6, 1);                                    \
            if (!r7)                                                            \
                OP (7, 1);                                                      \
        }                                                                       \
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
    c##r##h = _mm512_add_ps (c##r##h, S_LD (acc_src + (r) * acc_ld + 16 * (h), h))
    if (accumulate)
        S_ALL (S_ACC);
#undef S_ACC
    if (epi) {
        s_epi_tile_t et;
        s_epi_tile_init (epi, i, j, half, k0, k1, &et);
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
#define S_VEC(r, h) c##r##h = _mm512_add_ps (c##r##h, S_LD (src + (r) * rs + 16 * (h), h))
#define S_VECS(r, h) \
    c##r##h = _mm512_add_ps (c##r##h, _mm512_mul_ps (sc, S_LD (src + (r) * rs + 16 * (h), h)))
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
        /* the others inline, one loop each (kiln_act16 with a constant
         * act): a call per vector made the compiler spill the tile's
         * sixteen accumulators around each (no vector register survives
         * a call) */
#define S_ACT16(A)                                                      \
        case A:                                                         \
            S_ALL (S_ACT16_##A);                                        \
            break;
#define S_ACT16_4(r, h) c##r##h = kiln_act16 (c##r##h, 4, et.lo, et.hi)
#define S_ACT16_5(r, h) c##r##h = kiln_act16 (c##r##h, 5, et.lo, et.hi)
#define S_ACT16_6(r, h) c##r##h = kiln_act16 (c##r##h, 6, et.lo, et.hi)
#define S_ACT16_7(r, h) c##r##h = kiln_act16 (c##r##h, 7, et.lo, et.hi)
#define S_ACT16_8(r, h) c##r##h = kiln_act16 (c##r##h, 8, et.lo, et.hi)
        S_ACT16 (4)
        S_ACT16 (5)
        S_ACT16 (6)
        S_ACT16 (7)
        S_ACT16 (8)
#undef S_ACT16
#undef S_ACT16_4
#undef S_ACT16_5
#undef S_ACT16_6
#undef S_ACT16_7
#undef S_ACT16_8
        default:
            break;
        }
#undef S_RELU
#undef S_CLIP
#undef S_LEAKY
    }
#define S_ST(r, h)                                                      \
    do {                                                                \
        if (masked)                                                     \
            _mm512_mask_storeu_ps (c + (r) * ldc + 16 * (h), (h) ? k1 : k0, c##r##h); \
        else                                                            \
            _mm512_storeu_ps (c + (r) * ldc + 16 * (h), c##r##h);       \
    } while (0)
    S_ALL (S_ST);
#undef S_ST
#undef S_ALL
#undef S_LD
    if (epi && kiln_act_heavy (epi->act) && !kiln_act16_has (epi->act))
        for (int r = 0; r < (r7 ? MR - 1 : MR); r++)
            kiln_act_apply (c + r * ldc, masked ? ncols : half ? NR / 2 : NR, epi->act,
                            epi->act_a, epi->act_b);
}

/* The packed 8 × 32 tile: s_ukr_avx512_xb on an A panel (MR floats a
 * step of k), with nothing more. */
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512 (int64_t kc, const float *a, const float *b, int64_t ldb,
              float *c, int64_t ldc, bool accumulate)
{
    s_ukr_avx512_xb (kc, a, 1, MR, b, ldb, c, ldc, accumulate, NULL, 0, 0, NULL, 0,
                     NULL, 0, NULL, 0, false, NULL, NULL, false, false, NR, false);
}

/* A convolution's 8 × 32 tile read where its input lies (kiln_kernels_
 * conv.c: a padded copy of it, or its stride's phases), no gather: the
 * sums over `taps` runs of cg steps of k, in one run over all of them,
 * stored to the MR × NR tile c (row stride NR).  Step kk of tap t reads
 * A's row r at at[r·ars] and B's NR floats at bt, where at starts at
 * a + aoff[t] and bt at b + boff[t] for each tap and step by acs and
 * bcs; without aoff (boff) A (B) runs on from tap to tap, a packed
 * panel.  Always inlined with one of them NULL. */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_ukr_avx512_taps (const float *a, const int64_t *aoff, int64_t ars, int64_t acs,
                   const float *b, const int64_t *boff, int64_t bcs, int taps,
                   int64_t cg, float *c)
{
    __m512 c00 = _mm512_setzero_ps (), c01 = _mm512_setzero_ps ();
    __m512 c10 = _mm512_setzero_ps (), c11 = _mm512_setzero_ps ();
    __m512 c20 = _mm512_setzero_ps (), c21 = _mm512_setzero_ps ();
    __m512 c30 = _mm512_setzero_ps (), c31 = _mm512_setzero_ps ();
    __m512 c40 = _mm512_setzero_ps (), c41 = _mm512_setzero_ps ();
    __m512 c50 = _mm512_setzero_ps (), c51 = _mm512_setzero_ps ();
    __m512 c60 = _mm512_setzero_ps (), c61 = _mm512_setzero_ps ();
    __m512 c70 = _mm512_setzero_ps (), c71 = _mm512_setzero_ps ();
    const int64_t o1 = ars, o2 = 2 * ars, o3 = 3 * ars, o4 = 4 * ars;
    const int64_t o5 = 5 * ars, o6 = 6 * ars, o7 = 7 * ars;
#define S_ROW(r, o)                                               \
    do {                                                          \
        __m512 ar = _mm512_set1_ps (at[o]);                       \
        c##r##0 = _mm512_fmadd_ps (ar, b0, c##r##0);              \
        c##r##1 = _mm512_fmadd_ps (ar, b1, c##r##1);              \
    } while (0)
    for (int t = 0; t < taps; t++) {
        const float *at = aoff ? a + aoff[t] : a;
        const float *bt = boff ? b + boff[t] : b;
#pragma GCC unroll 4
        for (int64_t kk = 0; kk < cg; kk++) {
            __m512 b0 = _mm512_loadu_ps (bt);
            __m512 b1 = _mm512_loadu_ps (bt + 16);
            S_ROW (0, 0); S_ROW (1, o1); S_ROW (2, o2); S_ROW (3, o3);
            S_ROW (4, o4); S_ROW (5, o5); S_ROW (6, o6); S_ROW (7, o7);
            at += acs;
            bt += bcs;
        }
        if (!aoff)
            a = at;
        if (!boff)
            b = bt;
    }
#undef S_ROW
    _mm512_store_ps (c + 0 * NR, c00); _mm512_store_ps (c + 0 * NR + 16, c01);
    _mm512_store_ps (c + 1 * NR, c10); _mm512_store_ps (c + 1 * NR + 16, c11);
    _mm512_store_ps (c + 2 * NR, c20); _mm512_store_ps (c + 2 * NR + 16, c21);
    _mm512_store_ps (c + 3 * NR, c30); _mm512_store_ps (c + 3 * NR + 16, c31);
    _mm512_store_ps (c + 4 * NR, c40); _mm512_store_ps (c + 4 * NR + 16, c41);
    _mm512_store_ps (c + 5 * NR, c50); _mm512_store_ps (c + 5 * NR + 16, c51);
    _mm512_store_ps (c + 6 * NR, c60); _mm512_store_ps (c + 6 * NR + 16, c61);
    _mm512_store_ps (c + 7 * NR, c70); _mm512_store_ps (c + 7 * NR + 16, c71);
}

/* Positions as rows (transposed): A where it lies, B a packed panel. */
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_taps (const float *a, const int64_t *off, int taps, int64_t cg,
                       int64_t ars, int64_t acs, const float *b, float *c)
{
    s_ukr_avx512_taps (a, off, ars, acs, b, NULL, NR, taps, cg, c);
}

/* Positions as columns: A a packed panel, B where it lies.  Three
 * channels a tap (an RGB image's stem: resnet50's and densenet121's 7×7)
 * as a constant, the steps of each tap unrolled whole: the stem 0.95 of
 * the time at 1 and 2 threads (paired runs, run by run), where the loop
 * unrolled by 4 went to its remainder for every tap.  Eight (RegNet's
 * grouped 3×3) was level. */
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_tapsb (const float *a, const float *b, const int64_t *off, int taps,
                        int64_t cg, int64_t bcs, float *c)
{
    if (cg == 3)
        s_ukr_avx512_taps (a, NULL, 1, MR, b, off, bcs, taps, 3, c);
    else
        s_ukr_avx512_taps (a, NULL, 1, MR, b, off, bcs, taps, cg, c);
}

/* 7 × NR, for panels of 7 rows (a 7 × 7 plane's 49 positions are seven
 * of them): the same per-row rate as 8 × NR, the eighth row written as
 * zeros.  Only ever writes a tile buffer (s_micro). */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_ukr_avx512_7 (int64_t kc, const float *a, const float *b, int64_t ldb,
                float *c, int64_t ldc, bool accumulate, const char *pf, int64_t pf_n)
{
    s_pf_t pfs = s_pf_init (pf, pf_n, kc);
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
        s_pf_step (&pfs, k);
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

__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_7 (int64_t kc, const float *a, const float *b, int64_t ldb,
                float *c, int64_t ldc, bool accumulate)
{
    s_ukr_avx512_7 (kc, a, b, ldb, c, ldc, accumulate, NULL, 0);
}

/* The same, fetching pf_n lines from `pf` on into the cache, spread over
 * the steps of k (kiln_gukr_avx512_xp's). */
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_7p (int64_t kc, const float *a, const float *b, int64_t ldb,
                     float *c, int64_t ldc, bool accumulate, const char *pf,
                     int64_t pf_n)
{
    s_ukr_avx512_7 (kc, a, b, ldb, c, ldc, accumulate, pf, pf_n);
}

/* MR × 16: eight accumulators, enough to hide the FMA latency on CPUs
 * that run one 512-bit FMA per cycle. */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_ukr_avx512_16 (int64_t kc, const float *a, const float *b, int64_t ldb,
                 float *c, int64_t ldc, bool accumulate, const char *pf, int64_t pf_n)
{
    s_pf_t pfs = s_pf_init (pf, pf_n, kc);
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
        s_pf_step (&pfs, k);
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

__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_16 (int64_t kc, const float *a, const float *b, int64_t ldb,
                 float *c, int64_t ldc, bool accumulate)
{
    s_ukr_avx512_16 (kc, a, b, ldb, c, ldc, accumulate, NULL, 0);
}

/* The same, fetching pf_n lines from `pf` on, spread over the steps of k. */
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_16p (int64_t kc, const float *a, const float *b, int64_t ldb,
                      float *c, int64_t ldc, bool accumulate, const char *pf,
                      int64_t pf_n)
{
    s_ukr_avx512_16 (kc, a, b, ldb, c, ldc, accumulate, pf, pf_n);
}


__attribute__ ((target ("avx512f"))) void
kiln_gact_apply_avx512 (float *v, int64_t n, kiln_act_t act, float a, float b)
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

/* The epilogue of s_epi_run on the lanes of v in `mask`, for addends
 * whose elements along the run are adjacent (step 1) or one value (step
 * 0): the same operations in the same order, so that a tile finished
 * here and one finished by kiln_gfinish are bit for bit alike. */
__attribute__ ((target ("avx512f"), always_inline)) static inline __m512
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

/* The transposed finish (C'(r, q) at c[q·ldc + r]) of kiln_gfinish_avx512:
 * the tile's columns by 8 × 8 transposes, eight rows to a vector, each
 * through s_epi_avx512 inlined with `act` a constant where this is
 * inlined; a heavy activation once over the tile's finished columns.  A
 * 1×1 convolution at 14 × 14 run transposed (256 -> 1024, bias and Relu)
 * took 0.90 of the time with s_epi_avx512 a call a column. */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_fin_t (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0, int64_t nr,
         __mmask16 km, bool acc, bool last, kiln_act_t act)
{
    kiln_gemm_t ge = *g;
    ge.act = act;
    bool heavy = last && kiln_act_heavy (act) && !kiln_act16_has (act);
    float fin[NR * MR] __attribute__ ((aligned (64)));
    for (int64_t q0 = 0; q0 < nr; q0 += 8) {
        __m256 col[8];
        for (int r = 0; r < MR; r++)
            col[r] = _mm256_loadu_ps (t + r * NR + q0);
        kiln_gtranspose8 (col);
        int64_t nq = nr - q0 < 8 ? nr - q0 : 8;
        for (int64_t q = 0; q < nq; q++) {
            float *c = g->c + (j0 + q0 + q) * g->ldc + i0;
            __m512 v = _mm512_castps256_ps512 (col[q]);
            if (acc)
                v = _mm512_add_ps (v, _mm512_maskz_loadu_ps (km, c));
            if (last)
                v = s_epi_avx512 (&ge, v, km, i0, j0 + q0 + q, false);
            if (heavy)
                _mm256_store_ps (fin + (q0 + q) * MR, _mm512_castps512_ps256 (v));
            else
                _mm512_mask_storeu_ps (c, km, v);
        }
    }
    if (heavy) {
        kiln_act_apply (fin, nr * MR, act, g->act_a, g->act_b);
        for (int64_t q = 0; q < nr; q++)
            _mm512_mask_storeu_ps (g->c + (j0 + q) * g->ldc + i0, km,
                                   _mm512_castps256_ps512 (_mm256_load_ps (fin + q * MR)));
    }
}

/* kiln_gfinish for AVX-512: the rows of a tile as two vectors each, or (C
 * transposed) its columns by 8 × 8 transposes, eight rows to a vector. */
__attribute__ ((target ("avx512f"))) void
kiln_gfinish_avx512 (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0,
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
    kiln_act_t act = last ? g->act : KILN_ACT_NONE;
    if (act == KILN_ACT_RELU)
        s_fin_t (g, t, i0, j0, nr, km, acc, last, KILN_ACT_RELU);
    else if (act == KILN_ACT_NONE)
        s_fin_t (g, t, i0, j0, nr, km, acc, last, KILN_ACT_NONE);
    else
        s_fin_t (g, t, i0, j0, nr, km, acc, last, act);
}


__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_x (int64_t kc, const float *a, int64_t ars, int64_t acs,
                const float *b, int64_t ldb, float *c, int64_t ldc,
                bool accumulate, const kiln_gemm_t *epi, int64_t i, int64_t j)
{
    s_ukr_avx512_xb (kc, a, ars, acs, b, ldb, c, ldc, accumulate, epi, i, j, NULL, 0,
                     NULL, 0, NULL, 0, false, NULL, NULL, false, false, NR, false);
}

/* s_ukr_avx512_xb on the tile's first `cols` columns (at most NR): the
 * whole tile, or under masks (fewer than NR), in half the multiply-adds
 * when 16 or fewer; the partial sum from acc_src (rows acc_ld apart) when
 * not NULL, pf_n lines from pf fetched, and 7 rows with `r7`, as in
 * s_ukr_avx512_xb. */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_ukr_avx512_cols (int64_t kc, const float *a, int64_t ars, int64_t acs, const float *b,
                   float *c, int64_t ldc, bool accumulate, const kiln_gemm_t *epi,
                   int64_t i, int64_t j, const float *acc_src, int64_t acc_ld,
                   int64_t cols, const char *pf, int64_t pf_n, const bool r7)
{
    if (cols <= NR / 2)
        s_ukr_avx512_xb (kc, a, ars, acs, b, NR, c, ldc, accumulate, epi, i, j, pf, pf_n,
                         acc_src, acc_ld, NULL, 0, false, NULL, NULL, true, cols < NR,
                         cols, r7);
    else
        s_ukr_avx512_xb (kc, a, ars, acs, b, NR, c, ldc, accumulate, epi, i, j, pf, pf_n,
                         acc_src, acc_ld, NULL, 0, false, NULL, NULL, false, cols < NR,
                         cols, r7);
}

/* kiln_gukr_avx512_x on a panel's first `cols` columns (under NR: the
 * last column panel of a product whose columns end there, a channels-last
 * 1×1 convolution to 16 channels, a plane of 14 × 14 or 7 × 7), written
 * where they go under masks, in half the multiply-adds when 16 or fewer:
 * instead of the whole tile into a buffer and kiln_gfinish from there. */
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_xm (int64_t kc, const float *a, int64_t ars, int64_t acs,
                     const float *b, float *c, int64_t ldc, bool accumulate,
                     const kiln_gemm_t *epi, int64_t i, int64_t j, int64_t cols)
{
    s_ukr_avx512_cols (kc, a, ars, acs, b, c, ldc, accumulate, epi, i, j, NULL, 0, cols,
                       NULL, 0, false);
}

/* Seven rows (A's rows read where they lie: a 7 × 7 plane's 49 positions
 * are seven panels of seven, where panels of eight compute 56), the
 * tile's first `cols` columns as kiln_gukr_avx512_xm, fetching pf_n lines
 * from `pf` as kiln_gukr_avx512_xp. */
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_x7 (int64_t kc, const float *a, int64_t ars, int64_t acs,
                     const float *b, float *c, int64_t ldc, bool accumulate,
                     const kiln_gemm_t *epi, int64_t i, int64_t j, int64_t cols,
                     const char *pf, int64_t pf_n)
{
    s_ukr_avx512_cols (kc, a, ars, acs, b, c, ldc, accumulate, epi, i, j, NULL, 0, cols,
                       pf, pf_n, true);
}

/* kiln_gukr_avx512_x fetching pf_n lines from `pf` on into the cache, one every
 * kc / pf_n steps of k: the next weight panel, while this one is used
 * (s_tile, Winograd's products). */
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_xp (int64_t kc, const float *a, int64_t ars, int64_t acs,
                 const float *b, int64_t ldb, float *c, int64_t ldc,
                 bool accumulate, const kiln_gemm_t *epi, int64_t i, int64_t j,
                 const char *pf, int64_t pf_n)
{
    s_ukr_avx512_xb (kc, a, ars, acs, b, ldb, c, ldc, accumulate, epi, i, j, pf, pf_n,
                     NULL, 0, NULL, 0, false, NULL, NULL, false, false, NR, false);
}

/* kiln_gukr_avx512_x on a B read where it lies (its rows ldb apart) that
 * also stores the panel it reads, packed (NR floats a step of k), to
 * `bpk`, B's prologue applied first when `pro` (its s and b from this
 * k block's first step), and fetches B's rows S_PK_AHEAD steps ahead
 * (rows a plane apart, which the hardware's prefetchers do not follow:
 * 1×1 convolutions 1-7 % faster with it at 8-32 steps, 16 taken).  The
 * first row panel of a block packs B for the others as it computes,
 * instead of a pass of its own before them. */
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_xpk (int64_t kc, const float *a, int64_t ars, int64_t acs,
                      const float *b, int64_t ldb, float *c, int64_t ldc,
                      bool accumulate, const kiln_gemm_t *epi, int64_t i, int64_t j,
                      float *bpk, const kiln_gpro_t *pro)
{
    s_ukr_avx512_xb (kc, a, ars, acs, b, ldb, c, ldc, accumulate, epi, i, j, NULL, 0,
                     NULL, 0, NULL, 0, false, bpk, pro, false, false, NR, false);
}

/* A tile already summed (t, rows NR apart: a convolution's product read
 * from its input's phases) finished into C at (i, j), its first `cols`
 * columns, with the epilogue in registers: what kiln_gfinish does through
 * its own loops (the sums are added to zeros first: a -0 sum comes out
 * +0 where no addend or activation follows).  resnet50's 7×7 stem 0.93
 * of the time alone, 0.965 in the model; regnet_y_400mf 0.95. */
__attribute__ ((target ("avx512f"))) void
kiln_gfinish_x (const kiln_gemm_t *g, const float *t, int64_t i, int64_t j, int64_t cols)
{
    s_ukr_avx512_cols (0, NULL, 0, 0, NULL, g->c + i * g->ldc + j, g->ldc, true,
                       s_no_epilogue (g) ? NULL : g, i, j, t, NR, cols, NULL, 0, false);
}

/* One of s_strassen's seven products for an MR × NR tile (k steps kc,
 * A's rows ars apart, B's steps NR apart): stored to, or added to or
 * subtracted from, the tile t2 (when not NULL); and stored to the tile
 * t (row stride NR), or added to the partial sum `acc` (a tile) and
 * finished into C at (i, j) with g's epilogue when `fin`. */
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_s (int64_t kc, const float *a, int64_t ars, const float *b,
                const char *pf, float *t, const float *acc, const kiln_gemm_t *g,
                bool fin, int64_t i, int64_t j, float *t2, int t2_sign, bool t2_first)
{
    if (fin)
        s_ukr_avx512_xb (kc, a, ars, 1, b, NR, g->c + i * g->ldc + j, g->ldc, true,
                         s_no_epilogue (g) ? NULL : g, i, j, pf, kc, acc, NR,
                         t2, t2_sign, t2_first, NULL, NULL, false, false, NR, false);
    else
        s_ukr_avx512_xb (kc, a, ars, 1, b, NR, t, NR, acc != NULL, NULL, 0, 0, pf,
                         kc, acc, NR, t2, t2_sign, t2_first, NULL, NULL, false, false, NR, false);
}

#endif

/* Panels 0 .. NP - 1 of kiln_ggemv_avx512, NP constant when inlined. */
__attribute__ ((target ("avx512f"), always_inline)) static inline void
s_gemv_panels (int64_t k, const float *a, int64_t as, const float *b, float *out,
               const int NP)
{
    __m512 c[KILN_GGEMV_PANELS][2];
#pragma GCC unroll 4
    for (int q = 0; q < NP; q++)
        c[q][0] = c[q][1] = _mm512_setzero_ps ();
    for (int64_t kk = 0; kk < k; kk++) {
        __m512 x = _mm512_set1_ps (a[kk * as]);
#pragma GCC unroll 4
        for (int q = 0; q < NP; q++) {
            const float *bq = b + (q * k + kk) * NR;
            c[q][0] = _mm512_fmadd_ps (x, _mm512_loadu_ps (bq), c[q][0]);
            c[q][1] = _mm512_fmadd_ps (x, _mm512_loadu_ps (bq + 16), c[q][1]);
        }
    }
#pragma GCC unroll 4
    for (int q = 0; q < NP; q++) {
        _mm512_storeu_ps (out + q * NR, c[q][0]);
        _mm512_storeu_ps (out + q * NR + 16, c[q][1]);
    }
}

__attribute__ ((target ("avx512f"))) void
kiln_ggemv_avx512 (int64_t k, const float *a, int64_t as, const float *b, int np,
                   float *out)
{
    switch (np) {
    case 1:
        s_gemv_panels (k, a, as, b, out, 1);
        break;
    case 2:
        s_gemv_panels (k, a, as, b, out, 2);
        break;
    case 3:
        s_gemv_panels (k, a, as, b, out, 3);
        break;
    default:
        s_gemv_panels (k, a, as, b, out, 4);
        break;
    }
}
