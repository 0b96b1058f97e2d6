/*
 * kiln_gemm — the runtime's single-precision matrix-product engine, used
 * by the convolution and matrix-product kernels.  Internal to libkilnrt.
 *
 * C[m, n] = act (alpha · A[m, k] · B[k, n] + addends), computed in tiles
 * of KILN_PACK_MR × KILN_PACK_NR by a register-blocked micro-kernel for
 * the CPU at hand (AVX-512, AVX2 + FMA, or portable C; KILN_RT_ISA=avx2 or
 * generic forces a narrower one, for tests).  Operands are read from the
 * packed layouts of common/kiln_pack.h: a weight packed by the compiler
 * is used where it lies; any other operand is packed block by block into
 * a per-worker workspace as the product runs.  A convolution's B operand
 * (its im2col matrix) is never built: the blocks are gathered straight
 * from the input planes.  A packed weight B may hold float16 or bfloat16
 * elements (half weights, stored in 2 bytes): each k block of a column
 * panel is widened to float32 into the workspace (kiln_convert.h) just
 * before the row panels that use it, so the weight is never float32 in
 * memory as a whole.  The epilogue (alpha, a bias per row or per
 * column, a residual, an activation) is applied to each tile while it is
 * still in cache, so a fused Conv + bias + Add + Relu writes its output
 * once.
 *
 * A product may also write C transposed (c_trans): a convolution whose
 * output planes are small runs as Yᵀ = im2col(X)ᵀ · Wᵀ, output positions
 * as the rows of the tiles and output channels along the vectors, so that
 * a 7×7 or 14×14 plane fills the tiles (49 positions are 7 panels of 8
 * rows, where 32-wide columns would compute 64).
 *
 * Work is split into tasks (column blocks, and row blocks when there are
 * few columns) run on the intra-op pool (kiln_exec.h).  The sum over k of
 * one element is always accumulated in the same order, whatever the
 * thread count, so results do not depend on KILN_RT_THREADS.
 */
#ifndef KILN_GEMM_H
#define KILN_GEMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kiln_pack.h"
#include "common/kiln_program.h"

/* One group's convolution geometry: the B operand is the im2col matrix
 * of `x` (c planes of h × w), rows tap-major (kiln_pack.h), columns the
 * oh × ow output positions. */
typedef struct kiln_gconv {
    int64_t c, h, w, oh, ow;
    int64_t kh, kw, sh, sw, dh, dw, pt, pl;
} kiln_gconv_t;

typedef enum {
    KILN_GSRC_PACKED = 1,       /* p is the whole operand, packed */
    KILN_GSRC_STRIDED = 2,      /* element (i, j) at p[i·rs + j·cs] */
    KILN_GSRC_CONV = 3,         /* B: im2col of p by `conv`; A: its transpose */
} kiln_gsrc_kind_t;

typedef struct kiln_gsrc {
    kiln_gsrc_kind_t kind;
    const float *p;
    int64_t rs, cs;
    const kiln_gconv_t *conv;
} kiln_gsrc_t;

/* A STRIDED operand's prologue, or s NULL: its element at kk along k is
 * read as v · s[kk] + b[kk], then max (·, 0) when relu, as it is packed
 * (a pre-activation BatchNormalization and Relu before a pointwise
 * convolution).  Such an operand is always packed: never read in place,
 * by Strassen or by the gemv path. */
typedef struct kiln_gpro {
    const float *s, *b;
    bool relu;
} kiln_gpro_t;

/* An addend: scale · p[i·rs + j·cs] (a stride of 0 broadcasts). */
typedef struct kiln_gadd {
    const float *p;
    int64_t rs, cs;
    float scale;
} kiln_gadd_t;

typedef struct kiln_gemm {
    int64_t m, n, k;
    kiln_gsrc_t a, b;
    kiln_dtype_t b_half;        /* with a PACKED b: KILN_DT_FLOAT16 or
                                 * KILN_DT_BFLOAT16 when b.p holds 2-byte
                                 * elements (cast), widened a panel at a
                                 * time as the product runs; 0: floats */
    float *c;
    int64_t ldc;                /* C(i, j) at c[i·ldc + j], or c[j·ldc + i] */
    bool c_trans;               /* C is written transposed */
    float alpha;
    kiln_gadd_t add[2];
    int n_add;
    kiln_act_t act;
    float act_a, act_b;         /* clip's bounds, leaky_relu's slope */
    kiln_gpro_t a_pro, b_pro;   /* the operands' prologues (s NULL: none) */
} kiln_gemm_t;

/* Products with one shape that a kernel runs together (a batch, the
 * groups of a convolution): `get` fills product `idx` of `count`. */
typedef void (kiln_gemm_get_fn) (const void *ctx, int64_t idx, kiln_gemm_t *g);

/* Workspace bytes one worker needs for products of this shape. */
size_t kiln_gemm_ws_bytes (int64_t m, int64_t n, int64_t k, bool a_packed,
                           bool b_packed);

/* Run products 0..count-1 (all of the shape of product 0) on the pool,
 * with the calling kernel's workspace (kiln_exec_ws). */
void kiln_gemm_run (kiln_gemm_get_fn *get, const void *ctx, int64_t count);

/* Run one product on the calling thread alone, in its tiles (never by
 * Strassen's algorithm nor the one-row path), with the workspace `ws`
 * (64-byte aligned, kiln_gemm_ws_bytes for its shape): for a kernel
 * whose own tasks each run a few products in turn (attention's two per
 * block of queries, kiln_kernels_matmul.c): the tiles kiln_gemm_run
 * would run on one thread, each sum in the same order. */
void kiln_gemm_here (const kiln_gemm_t *g, float *ws);

/* Whether kiln_gemm_run computes this product (alone: count 1) by one
 * level of Strassen's algorithm (kiln_gemm_strassen.c): a function of its shape,
 * operand kinds and the CPU, never of the thread count. */
bool kiln_gemm_strassen (const kiln_gemm_t *g);

/* Apply an activation to n floats in place (also for other kernels). */
void kiln_act_apply (float *v, int64_t n, kiln_act_t act, float a, float b);

/* The same on `rows` runs of n floats, `stride` floats apart (the
 * channels of one block at each position of a channels-last row): one
 * call where a call a run cost as much as a run's work. */
void kiln_act_apply_rows (float *v, int64_t rows, int64_t n, int64_t stride, kiln_act_t act,
                          float a, float b);

/* The activations with a transcendental or a product in them (sigmoid,
 * SiLU, GELU, hard swish, hard sigmoid, tanh): the tile epilogues apply
 * the cheap ones in registers and these, after the tile's store, by
 * kiln_act_apply on the rows just written (in L1), so that every path
 * (AVX-512, AVX2, portable, Winograd, depthwise) computes them with the
 * same loops and gives the same bits. */
static inline bool
kiln_act_heavy (kiln_act_t act)
{
    return act >= KILN_ACT_SIGMOID;
}

/* The micro-kernel, for kernels that block their own products (Winograd):
 * c[MR × width] (row stride ldc) = (accumulate ? c : 0) + Σ over kc steps
 * of a[MR] ⊗ b[width], a packed as an A panel, b's steps ldb apart.
 * width is KILN_PACK_NR or KILN_PACK_NR / 2.  On AVX-512 it also
 * fetches pf_n cache lines from pf on (a panel to come, streamed from
 * memory), spread over its steps; pf may be NULL. */
void kiln_gemm_ukr (int width, int64_t kc, const float *a, const float *b,
                    int64_t ldb, float *c, int64_t ldc, bool accumulate,
                    const void *pf, int64_t pf_n);

/* The transposed tile, for Winograd's products with the tiles as rows:
 * c[q·ldc + r] = (accumulate ? c[q·ldc + r] : 0) + Σ over kc steps of
 * a[r] · b[q], a packed as an A panel (of `rows`, 8 or 7, rows used, the
 * rest zero), b's steps ldb apart (NR wide), for r < mr, q < nr; pf
 * and pf_n as for kiln_gemm_ukr. */
void kiln_gemm_ukr_t (int rows, int64_t kc, const float *a, const float *b,
                      int64_t ldb, float *c, int64_t ldc, int64_t mr, int64_t nr,
                      bool accumulate, const void *pf, int64_t pf_n);

/* A convolution's product tile read where its input lies: rows i .. i + mr - 1 and columns
 * j .. j + nr - 1 of g's C, finished with g's epilogue, = Σ over `taps`
 * taps and cg steps of k of A(r, t, kk) = a[off[t] + r·ars + kk·acs]
 * times the packed B panel b (NR floats a step, the taps' steps in
 * order); MR rows are read whatever mr (the rest must be readable).
 * AVX-512 broadcasts A from where it lies; the other micro-kernels copy
 * it into panels first (no gather: plain strided copies). */
void kiln_gemm_taps (const kiln_gemm_t *g, const float *a, const int64_t *off, int taps,
                     int64_t cg, int64_t ars, int64_t acs, const float *b, int64_t i,
                     int64_t j, int64_t mr, int64_t nr);

/* Its untransposed twin: rows i .. i + mr - 1 of g's C (output
 * channels) from the packed A panel a (MR floats a step, the taps' steps
 * in order) and B read where it lies, its row of step kk of tap t at
 * b[off[t] + kk·bcs] (NR floats: positions v0 .. v0 + NR - 1 of a
 * row-major grid vw wide, whose columns ow and beyond, and positions vn
 * and beyond, are not outputs: C's column of position (r, col) is
 * r·ow + col), finished with g's epilogue. */
void kiln_gemm_taps_b (const kiln_gemm_t *g, const float *a, const float *b,
                       const int64_t *off, int taps, int64_t cg, int64_t bcs, int64_t i,
                       int64_t mr, int64_t v0, int64_t vw, int64_t ow, int64_t vn);

/* "avx512", "avx2" or "generic": the micro-kernel in use. */
const char *kiln_gemm_isa (void);

/* The micro-kernel in use is AVX-512 (the CPU has it and KILN_RT_ISA
 * does not force a narrower one): the kernels' own AVX-512 loops may run. */
bool kiln_gemm_avx512 (void);

#endif
