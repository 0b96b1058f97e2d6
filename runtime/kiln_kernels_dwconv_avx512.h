/*
 * kiln_kernels_dwconv_avx512 — depthwise convolution planes on AVX-512:
 * sixteen output columns a vector, eight output rows at once (eight
 * independent sums, so the multiply-adds do not wait on each other).
 * kiln_kernels_dwconv.c keeps the portable loops for other strides and
 * kernels, for other ISAs (KILN_RT_ISA) and for small planes.  Internal
 * to libkilnrt.
 */
#ifndef KILN_KERNELS_DWCONV_AVX512_H
#define KILN_KERNELS_DWCONV_AVX512_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kiln_program.h"

typedef struct {
    int64_t h, w;               /* input plane */
    int64_t oh, ow;             /* output plane */
    int64_t kh, kw;
    int64_t sh, sw, dh, dw;     /* strides, dilations */
    int64_t pt, pl;             /* padding before rows, columns */
} kiln_dw_geo_t;

/* Whether kiln_dw16_plane computes this geometry: AVX-512 in use
 * (kiln_gemm_isa), output rows of at least 8, and stride 2 (any kernel,
 * any dilation) or stride 1 with a kernel 3, 5 or 7 wide, undilated. */
bool kiln_dw16_fits (const kiln_dw_geo_t *g);

/* One output plane: y = bias + Σ taps w · x (+ res when not NULL), each
 * output's taps added in row-major order, with `ws` (kiln_dw16_ws_floats)
 * to work in. */
void kiln_dw16_plane (const kiln_dw_geo_t *g, const float *x, const float *w, float bias,
                      const float *res, float *y, float *ws);

/* Floats of workspace kiln_dw16_plane needs. */
int64_t kiln_dw16_ws_floats (const kiln_dw_geo_t *g);

/* The zero-padded plane the windows read: every input element has a
 * place (at pt, pl), and so does every element a window reaches. */
void kiln_dw_extent (const kiln_dw_geo_t *g, int64_t *hp, int64_t *wp);

/* Small planes sixteen at a time, one plane a lane of a vector: the
 * inputs transposed into a zero-padded [row][column][lane] block, every
 * tap one multiply-add for sixteen planes, the outputs transposed back.
 * For output planes up to KILN_DWC16_MAX_OUT elements (there the plane
 * at a time path spends most of its time on a plane's fixed costs) on
 * AVX-512. */
#define KILN_DWC16_MAX_OUT 1024
bool kiln_dwc16_fits (const kiln_dw_geo_t *g);
int64_t kiln_dwc16_ws_floats (const kiln_dw_geo_t *g);
/* Planes 0 .. nl - 1 (nl <= 16): y[l] = act (bias[l] + Σ taps w[l] ·
 * x[l] (+ res[l] when res and res[l] are not NULL)). */
void kiln_dwc16_planes (const kiln_dw_geo_t *g, int nl, const float *const x[16],
                        const float *const w[16], const float bias[16],
                        const float *const res[16], float *const y[16], kiln_act_t act,
                        float act_a, float act_b, float *ws);

#endif
