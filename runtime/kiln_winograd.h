/*
 * kiln_winograd — 3x3, stride-1, ungrouped convolutions by Winograd's
 * F(2x2, 3x3) and F(4x4, 3x3) (Lavin and Gray, 2015).  Internal to
 * libkilnrt.
 *
 * Each t x t block of outputs (a tile) is A^T [(G g G^T) ⊙ (B^T d B)] A
 * for the (t+2) x (t+2) input patch d under it: (t+2)² products per tile
 * and channel pair where a direct convolution needs 9·t² (2.25 times
 * fewer for t = 2, 4 times for t = 4).  The weights arrive transformed
 * and packed by the compiler (common/kiln_pack.h, KILN_PACK_WINO_POINTS
 * packed A operands); the 16 products of each point are matrix products
 * over the channels, run by kiln_gemm's micro-kernel on blocks of 16 or
 * 32 tiles.  The input transform writes straight into the micro-kernel's
 * B panels and the output transform applies the epilogue (bias,
 * residual, activation) as it writes Y, so nothing of image size is
 * materialised.  With Winograd-T weights (kiln_pack.h) each point's
 * product runs transposed: the tiles of a block are the rows of the
 * engine's tiles (panels of 8, or of 7 when the tile count is a multiple
 * of 7: a 28 × 28 output is 49 tiles of 4 × 4), the output channels its
 * 32 columns, so that small planes neither leave columns empty nor fall
 * back to 16-wide tiles.  Rounding differs from a direct convolution by a few ulp
 * of the partial sums for t = 2, by some more for t = 4 (its transforms
 * have coefficients up to 8 and down to 1/24); the compiler uses them
 * from -O3 only.
 */
#ifndef KILN_WINOGRAD_H
#define KILN_WINOGRAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kiln_program.h"

typedef struct kiln_wino {
    int tile;                   /* t: 2 or 4 */
    int alpha;                  /* t + 2 */
    int points;                 /* alpha² */
    int64_t n, c, h, w;         /* input */
    int64_t m, oh, ow;          /* output */
    int64_t pt, pl;             /* padding before, rows and columns */
    int64_t th, tw, tiles;      /* tiles per image: th x tw */
    int64_t nb;                 /* tiles per block: 16 or 32 */
    int64_t kc, nkb;            /* channel block, number of blocks */
    int64_t mchunk;             /* output channels per task, a multiple of 8 */
    int64_t tbs, mcs;           /* tile blocks per image, m chunks */
    int64_t u_stride;           /* floats of packed weights per point */
    bool trans;                 /* Winograd-T: tiles as rows, rp to a panel */
    int64_t rp;                 /* rows of a tile panel (trans): 8 or 7 */
    /* Shared V (threads > 1 and too few tile blocks to go round): the
     * input is transformed once, by tasks of vpiece channels, into one V
     * for every block, and the product tasks read it instead of each
     * transforming the input under their tiles again. */
    bool shared;
    int64_t vpiece, vpieces;    /* channels per transform task, per block */
    int64_t v_floats;           /* shared V: every block, every image */
    int64_t own_floats;         /* a worker's: V (unless shared), M, panel */
    int64_t w_floats;           /* workspace per worker (kiln_exec_ws) */
} kiln_wino_t;

/* Plan F(tile x tile, 3x3) for input [n, c, h, w] and output [n, m, oh,
 * ow] with `threads` workers; `trans` for Winograd-T weights. */
void kiln_wino_plan (kiln_wino_t *wp, int tile, bool trans, int64_t n, int64_t c,
                     int64_t h, int64_t w, int64_t m, int64_t oh, int64_t ow,
                     int64_t pt, int64_t pl, int threads);

/* Workspace bytes per worker.  A shared V takes the front of the whole
 * workspace (threads × these bytes, one block: kiln_exec_ws), the
 * workers' own parts follow it. */
size_t kiln_wino_ws_bytes (const kiln_wino_t *wp);

/* Y = act (conv (X, W) + bias + residual) on the intra-op pool, with the
 * calling kernel's workspace.  `bias` (m) and `res` (like Y) may be NULL. */
void kiln_wino_run (const kiln_wino_t *wp, const float *x, const float *u,
                    const float *bias, const float *res, float *y,
                    kiln_act_t act, float act_a, float act_b);

#endif
