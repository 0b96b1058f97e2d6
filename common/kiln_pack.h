/*
 * kiln_pack — the packed weight layouts of the program format, written
 * once for the compiler (which packs constant weights when it emits a
 * program) and the runtime (whose matrix-product engine reads them, and
 * packs activations the same way while it runs).
 *
 * A matrix product C[m, n] = A[m, k] · B[k, n] is computed in tiles of
 * KILN_PACK_MR rows by KILN_PACK_NR columns.  Packed, each operand is a
 * sequence of panels that the tile loop reads front to back:
 *
 *   A packed: ceil(m / MR) panels; panel p holds rows p·MR .. p·MR+MR-1,
 *             k-major: element (p·MR + r, kk) at [p][kk][r], i.e.
 *             p·k·MR + kk·MR + r.  Rows past m are zero.
 *   B packed: ceil(n / NR) panels; panel q holds columns q·NR .. q·NR+NR-1,
 *             k-major: element (kk, q·NR + j) at q·k·NR + kk·NR + j.
 *             Columns past n are zero.
 *
 * A convolution's weights W[M, C/group, kh, kw] are, per group, the A
 * operand with rows = that group's output channels and k running
 * tap-major: kk = (i·kw + j)·(C/group) + c for tap (i, j) and input
 * channel c, so that a run of k for one tap reads the same place of
 * consecutive input planes.  The packed conv weights are the groups'
 * packed A operands one after the other.
 *
 * The same weights transposed (conv-packed-T, for convolutions whose
 * output planes are small: the runtime then computes Yᵀ = im2col(X)ᵀ ·
 * Wᵀ, the output positions as rows): per group, the B-packed operand
 * Wᵀ[(C/group)·kh·kw, M/group], k tap-major as above, the groups one after
 * another.
 *
 * Winograd F(t x t, 3x3) weights, t = 2 or 4 (a 3x3, stride-1,
 * ungrouped convolution at -O3): U = G·g·Gᵀ for each output channel m and
 * input channel c, an a x a matrix (a = t + 2) whose element (i, j) is
 * transform point ξ = a·i + j, with
 *   t = 2: G = [[1, 0, 0], [1/2, 1/2, 1/2], [1/2, -1/2, 1/2], [0, 0, 1]]
 *   t = 4: G = [[1/4, 0, 0], [-1/6, -1/6, -1/6], [-1/6, 1/6, -1/6],
 *               [1/24, 1/12, 1/6], [1/24, -1/12, 1/6], [0, 0, 1]]
 * (Lavin and Gray's matrices).  The packed weights are, for ξ = 0 ..
 * a² - 1 in turn, the packed A operand of U[ξ] as an [M, C] matrix (rows
 * m, k running over c).
 *
 * Winograd-T (the transposed product, the tiles as rows): for ξ = 0 ..
 * a² - 1 in turn, the packed B operand of U[ξ]ᵀ as a [C, M] matrix (k
 * running over c, columns m).
 *
 * These layouts are part of the program format (docs/program-format.md):
 * changing them changes what a `packed` weight means.
 */
#ifndef KILN_PACK_H
#define KILN_PACK_H

#include <stdbool.h>
#include <stdint.h>

#define KILN_PACK_MR 8      /* rows of an A panel */
#define KILN_PACK_NR 32     /* columns of a B panel */

/* Transform points of Winograd F(t x t, 3x3): (t + 2)², t = 2 or 4. */
#define KILN_PACK_WINO_POINTS(t) (((t) + 2) * ((t) + 2))

/* Elements of packed A for [m, k] (ceil(m / MR)·MR·k), and of packed B
 * for [k, n]; false on overflow of int64_t. */
bool kiln_pack_a_elems (int64_t m, int64_t k, int64_t *out);
bool kiln_pack_b_elems (int64_t k, int64_t n, int64_t *out);
/* Elements of packed conv weights: group · packed A of [M/group, K]. */
bool kiln_pack_conv_elems (int64_t m, int64_t cg, int64_t kh, int64_t kw,
                           int64_t group, int64_t *out);

/* Elements of conv-packed-T weights: group · packed B of [K, M/group]. */
bool kiln_pack_conv_t_elems (int64_t m, int64_t cg, int64_t kh, int64_t kw,
                             int64_t group, int64_t *out);

/* The extent along one axis of an input zero-padded for a window (out
 * outputs of a window k wide, stride s, dilation d, pad_begin before
 * the in inputs): every input and the padding the windows reach. */
int64_t kiln_pack_padded_extent (int64_t out, int64_t k, int64_t s, int64_t d,
                                 int64_t pad_begin, int64_t in);

/* Whether the runtime reads a transposed convolution's positions where
 * they lie, with no gather (runtime/kiln_kernels_conv.c, "read in
 * place"), given cg input channels a group, a kh × kw kernel, the
 * padded input's width wp and the output's ow: output rows that row
 * panels of 8 or 7 positions fill exactly, 2 to KILN_PACK_INPLACE_TAPS
 * taps, and the input a tile reads (kh rows of wp floats for each of
 * cg channels) at most KILN_PACK_INPLACE_BYTES, so that it stays in L1
 * while the tile streams the weights past it.  The compiler's choice
 * of the transposed product counts no gather for these. */
#define KILN_PACK_INPLACE_TAPS 64
#define KILN_PACK_INPLACE_BYTES (32 * 1024)
bool kiln_pack_conv_inplace (int64_t cg, int64_t kh, int64_t kw, int64_t wp,
                             int64_t ow);

/* Elements of packed Winograd F(t x t, 3x3) weights for m output and c
 * input channels: points · packed A of [m, c]; false for a t other than
 * 2 and 4. */
bool kiln_pack_wino_elems (int64_t m, int64_t c, int tile, int64_t *out);

/* Elements of packed Winograd-T weights: points · packed B of [c, m]. */
bool kiln_pack_wino_t_elems (int64_t m, int64_t c, int tile, int64_t *out);

/* Pack A[m, k], element (i, kk) at a[i·rs + kk·cs], into out (A packed). */
void kiln_pack_a (const float *a, int64_t m, int64_t k, int64_t rs, int64_t cs,
                  float *out);
/* Pack B[k, n], element (kk, j) at b[kk·rs + j·cs], into out (B packed). */
void kiln_pack_b (const float *b, int64_t k, int64_t n, int64_t rs, int64_t cs,
                  float *out);
/* The same for a B of 2-byte elements (float16 or bfloat16 bits): the
 * B-packed layout with 2-byte elements, columns past n zero (+0 in both
 * types).  The matrix engine widens it a panel at a time. */
void kiln_pack_b_u16 (const uint16_t *b, int64_t k, int64_t n, int64_t rs,
                      int64_t cs, uint16_t *out);
/* Pack conv weights w[m, cg, kh, kw] (ONNX layout, all groups) into out. */
void kiln_pack_conv (const float *w, int64_t m, int64_t cg, int64_t kh,
                     int64_t kw, int64_t group, float *out);

/* Pack conv weights w[m, cg, kh, kw] (ONNX layout, all groups) into out,
 * conv-packed-T. */
void kiln_pack_conv_t (const float *w, int64_t m, int64_t cg, int64_t kh,
                       int64_t kw, int64_t group, float *out);

/* Transform 3x3 conv weights w[m, c, 3, 3] and pack them (Winograd, or
 * Winograd-T with `trans`); `out` must be zeroed first (padding rows or
 * columns stay zero). */
void kiln_pack_wino (const float *w, int64_t m, int64_t c, int tile, float *out);
void kiln_pack_wino_t (const float *w, int64_t m, int64_t c, int tile, float *out);

#endif
