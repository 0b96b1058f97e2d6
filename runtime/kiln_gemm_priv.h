/*
 * kiln_gemm_priv — what the pieces of the matrix engine (kiln_gemm.h)
 * share.  Internal to libkilnrt; included by kiln_gemm*.c only.
 *
 * The engine is cut by job:
 *   kiln_gemm.c           the micro-kernels' choice for the CPU at hand
 *                         (kiln_gisa), the blocking and the driver;
 *   kiln_gemm_generic.c   portable micro-kernels and A panels;
 *   kiln_gemm_avx2.c      AVX2 + FMA micro-kernels, 8 × 8-transpose panels;
 *   kiln_gemm_avx512.c    AVX-512 micro-kernels (epilogue in registers)
 *                         and the AVX-512 finish of a tile;
 *   kiln_gemm_pack.c      packing at run time (strided, im2col, half B);
 *   kiln_gemm_epilogue.c  a tile written to C with its epilogue, and
 *                         kiln_act_apply;
 *   kiln_gemm_strassen.c  Strassen's one level.
 * The ISA files are compiled for any x86-64 CPU: every function that
 * uses wider instructions carries its target attribute, and only
 * kiln_gemm.c's s_isa_init, having asked the CPU, points kiln_gisa at
 * them.  The symbols here are hidden: libkilnrt calls them directly,
 * never through the PLT, as when they were one file's statics.
 */
#ifndef KILN_GEMM_PRIV_H
#define KILN_GEMM_PRIV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "runtime/kiln_gemm.h"

#define MR KILN_PACK_MR
#define NR KILN_PACK_NR

static inline int64_t
s_min (int64_t a, int64_t b)
{
    return a < b ? a : b;
}

static inline int64_t
s_round_up (int64_t v, int64_t to)
{
    return (v + to - 1) / to * to;
}

#pragma GCC visibility push(hidden)

/* --- micro-kernels ---------------------------------------------------
 * c[MR × NR] (row stride ldc) = (accumulate ? c : 0) + a-panel · b-panel
 * over kc steps; a holds MR floats per step, b NR floats per step at a
 * stride of ldb.  The narrow kernels do MR × NR/2. */
typedef void (kiln_gukr_fn) (int64_t kc, const float *a, const float *b,
                             int64_t ldb, float *c, int64_t ldc, bool accumulate);

/* One A panel from `rows` (at most MR) rows of kc floats, row r at p0 +
 * r·rs, plus (sign 1) or minus (sign -1) the row at p1 + r·rs when sign
 * is not 0: panel[kk·MR + r], the rows past `rows` zero. */
typedef void (kiln_grows_fn) (float *panel, const float *p0, const float *p1,
                              int sign, int64_t rows, int64_t kc, int64_t rs);

/* Eight columns of a B panel (NR floats a step) whose columns lie along
 * k (a matrix read transposed: attention's keys): `cols` of them (at
 * most 8; the rest zero), column c's run of kc floats at src + c·cs,
 * into panel[kk·NR + c]. */
typedef void (kiln_gcols_fn) (float *panel, const float *src, int64_t cols, int64_t kc,
                              int64_t cs);

/* The micro-kernels in use, chosen once (kiln_gisa_init) for the CPU and
 * KILN_RT_ISA. */
typedef struct {
    kiln_gukr_fn *ukr;          /* MR × NR */
    kiln_gukr_fn *ukr_7;        /* panels of 7 rows (and a zero) */
    kiln_gukr_fn *ukr_16;       /* MR × NR/2 */
    kiln_grows_fn *panel_rows;  /* A panels from rows along k */
    kiln_gcols_fn *panel_cols;  /* B panels from columns along k */
    const char *name;           /* "avx512", "avx2" or "generic" */
    bool fin_avx512;            /* kiln_gfinish_avx512 may run */
} kiln_gisa_t;

extern kiln_gisa_t kiln_gisa;

/* Fill kiln_gisa, once; every entry point calls it first. */
void kiln_gisa_init (void);

/* AVX-512 tiles read A's rows where they lie (kiln_gukr_avx512_x): a
 * strided A laid along k, no prologue, C not transposed.  Nothing of A
 * is packed then but a last panel of fewer than MR rows. */
static inline bool
kiln_gemm_a_in_place (const kiln_gemm_t *g)
{
    return kiln_gisa.fin_avx512 && !g->c_trans && g->a.kind == KILN_GSRC_STRIDED
           && g->a.cs == 1 && !g->a_pro.s;
}

/* kiln_gemm_generic.c */
kiln_gukr_fn kiln_gukr_generic;
kiln_gukr_fn kiln_gukr_generic_16;
kiln_grows_fn kiln_gpanel_rows_c;
kiln_gcols_fn kiln_gpanel_cols_c;

#if defined(__x86_64__)

/* kiln_gemm_avx2.c */
kiln_gukr_fn kiln_gukr_avx2;
kiln_gukr_fn kiln_gukr_avx2_16;
__attribute__ ((target ("avx2"))) void
kiln_gpanel_rows_avx2 (float *panel, const float *p0, const float *p1, int sign,
                       int64_t rows, int64_t kc, int64_t rs);
__attribute__ ((target ("avx2"))) void
kiln_gpanel_cols_avx2 (float *panel, const float *src, int64_t cols, int64_t kc,
                       int64_t cs);

/* kiln_gemm_avx512.c.  _x: A's row r, step kk at a[r·ars + kk·acs] (a
 * packed panel or the rows where they lie) and, with `epi`, that
 * product's epilogue applied in registers to tile (i, j); _xp the same,
 * fetching pf_n lines from `pf` on into the cache, spread over the steps
 * of k (as do _7p and _16p, twins of _7 and _16); _xm the same for
 * the panel's first `cols` columns, under masks; _s one of Strassen's
 * seven products (kiln_gemm_strassen.c). */
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512 (int64_t kc, const float *a, const float *b, int64_t ldb,
                  float *c, int64_t ldc, bool accumulate);
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_7 (int64_t kc, const float *a, const float *b, int64_t ldb,
                    float *c, int64_t ldc, bool accumulate);
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_16 (int64_t kc, const float *a, const float *b, int64_t ldb,
                     float *c, int64_t ldc, bool accumulate);
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_x (int64_t kc, const float *a, int64_t ars, int64_t acs,
                    const float *b, int64_t ldb, float *c, int64_t ldc,
                    bool accumulate, const kiln_gemm_t *epi, int64_t i, int64_t j);
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_xp (int64_t kc, const float *a, int64_t ars, int64_t acs,
                     const float *b, int64_t ldb, float *c, int64_t ldc,
                     bool accumulate, const kiln_gemm_t *epi, int64_t i, int64_t j,
                     const char *pf, int64_t pf_n);
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_16p (int64_t kc, const float *a, const float *b, int64_t ldb,
                      float *c, int64_t ldc, bool accumulate, const char *pf,
                      int64_t pf_n);
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_7p (int64_t kc, const float *a, const float *b, int64_t ldb,
                     float *c, int64_t ldc, bool accumulate, const char *pf,
                     int64_t pf_n);
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_xpk (int64_t kc, const float *a, int64_t ars, int64_t acs,
                      const float *b, int64_t ldb, float *c, int64_t ldc,
                      bool accumulate, const kiln_gemm_t *epi, int64_t i, int64_t j,
                      float *bpk, const kiln_gpro_t *pro);
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_xm (int64_t kc, const float *a, int64_t ars, int64_t acs,
                     const float *b, float *c, int64_t ldc, bool accumulate,
                     const kiln_gemm_t *epi, int64_t i, int64_t j, int64_t cols);
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_x7 (int64_t kc, const float *a, int64_t ars, int64_t acs,
                     const float *b, float *c, int64_t ldc, bool accumulate,
                     const kiln_gemm_t *epi, int64_t i, int64_t j, int64_t cols,
                     const char *pf, int64_t pf_n);
__attribute__ ((target ("avx512f"))) void
kiln_gfinish_x (const kiln_gemm_t *g, const float *t, int64_t i, int64_t j, int64_t cols);
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_s (int64_t kc, const float *a, int64_t ars, const float *b,
                    const char *pf, float *t, const float *acc, const kiln_gemm_t *g,
                    bool fin, int64_t i, int64_t j, float *t2, int t2_sign,
                    bool t2_first);
/* A convolution's tile from its padded input (kiln_gemm_taps): A's row
 * r, step kk of tap t at a[off[t] + r·ars + kk·acs]; into the aligned
 * MR × NR tile c. */
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_taps (const float *a, const int64_t *off, int taps, int64_t cg,
                       int64_t ars, int64_t acs, const float *b, float *c);
/* Its untransposed twin (kiln_gemm_taps_b): A a packed panel, B's row
 * of step kk of tap t at b[off[t] + kk·bcs]. */
__attribute__ ((target ("avx512f"))) void
kiln_gukr_avx512_tapsb (const float *a, const float *b, const int64_t *off, int taps,
                        int64_t cg, int64_t bcs, float *c);
__attribute__ ((target ("avx512f"))) void
kiln_gfinish_avx512 (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0,
                     int64_t mr, int64_t nr, bool acc, bool last);
__attribute__ ((target ("avx512f"))) void
kiln_gact_apply_avx512 (float *v, int64_t n, kiln_act_t act, float a, float b);
/* One row a (element kk at a[kk·as]) times `np` (at most KILN_GGEMV_PANELS)
 * packed B panels of k steps from b on: out[q·NR + c] for panel q,
 * column c.  The panels stream side by side, one sum per half panel. */
#define KILN_GGEMV_PANELS 4
__attribute__ ((target ("avx512f"))) void
kiln_ggemv_avx512 (int64_t k, const float *a, int64_t as, const float *b, int np,
                   float *out);

/* Eight rows of eight floats into eight columns. */
__attribute__ ((target ("avx2"))) static inline __attribute__ ((always_inline)) void
kiln_gtranspose8 (__m256 r[8])
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

#endif

/* --- packing at run time (kiln_gemm_pack.c) --------------------------- */

/* Rows m0..m0+mr-1, k0..k0+kc-1 of a strided A into panels of kc × MR,
 * `rp` rows (MR or 7) to a panel; the rest of a panel is zero. */
void kiln_gpack_a_strided (const kiln_gsrc_t *s, const kiln_gpro_t *pro, int64_t m0,
                           int64_t mr, int64_t k0, int64_t kc, float *dst, int64_t rp);

/* Columns n0..n0+nw-1, k0..k0+kc-1 of a strided B into panels of kc × NR. */
void kiln_gpack_b_strided (const kiln_gsrc_t *s, const kiln_gpro_t *pro, int64_t k0,
                           int64_t kc, int64_t n0, int64_t nw, float *dst);

/* Columns n0..n0+nw-1 (output positions), k0..k0+kc-1 (tap-major) of the
 * im2col matrix of a convolution input, into panels of kc × `width`,
 * `used` of them filled (B panels, or A panels of a transposed product). */
void kiln_gpack_conv (const kiln_gsrc_t *s, int64_t k0, int64_t kc, int64_t n0,
                      int64_t nw, float *dst, int64_t width, int64_t used);

/* Panel j (its first column) of a half B, its steps k0..k0+kc-1, widened
 * into dst (kc × NR floats). */
void kiln_gwiden_panel (const kiln_gemm_t *g, int64_t j, int64_t k0, int64_t kc,
                        float *dst);

/* --- epilogue (kiln_gemm_epilogue.c) ----------------------------------- */

/* A tile computed into t (MR × NR, row stride NR) written to C at
 * (i0, j0): C = (acc ? C : 0) + t, then g's epilogue when `last`. */
void kiln_gfinish (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0,
                   int64_t mr, int64_t nr, bool acc, bool last);

/* kiln_gfinish_avx512 applies: the CPU has it and every addend is a
 * vector or one value along the runs it finishes. */
bool kiln_gfinish_fast (const kiln_gemm_t *g);

/* --- Strassen (kiln_gemm_strassen.c) ----------------------------------- */

/* Strassen's one level is worth it for a product of this shape. */
bool kiln_gstrassen_shape (int64_t m, int64_t n, int64_t k);

/* Floats of a worker's workspace it needs. */
int64_t kiln_gstrassen_floats (int64_t m, int64_t k);

#if defined(__x86_64__)
/* Run product g that way, on the pool (kiln_gemm_strassen true). */
void kiln_gstrassen_run (const kiln_gemm_t *g, float *ws, size_t ws_stride);
#endif

#pragma GCC visibility pop

#endif
