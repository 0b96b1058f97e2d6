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

#endif
