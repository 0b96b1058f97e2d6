/*
 * kiln_kernels_shape — the runtime's data-movement kernels: strided (one
 * kernel for Transpose, Slice, Split, Expand, Tile, DepthToSpace and
 * SpaceToDepth), concat, gather, pad, resize, trilu, gather_elements,
 * cumsum and eye.  The plan below also serves conv_transpose2d
 * (kiln_kernels_conv.c), avgpool2d and global_maxpool
 * (kiln_kernels_pool.c).  Internal to libkilnrt.
 *
 * The data-movement kernels copy elements of any dtype (they only look at
 * its size).  `strided` is the workhorse: the compiler describes the
 * output as a loop nest over `dims` reading X at `offset` plus the sum of
 * each loop index times its stride (in elements, possibly 0 or
 * negative); prepare proves that the lowest and highest element the nest
 * can reach lie inside X, so run needs no check.  resize,
 * conv_transpose2d and the pools compute in float32.
 *
 * Like the math kernels, every kernel here is registered in kiln_kernels.c
 * with kiln_kshape_prepare as its prepare, which sets plan->run.
 */
#ifndef KILN_KERNELS_SHAPE_H
#define KILN_KERNELS_SHAPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kiln_program.h"

struct kiln_kplan;

/* The KILN_KERNELS ids this file implements. */
#define KILN_KSHAPE_KERNELS(X)                                             \
    X (STRIDED) X (CONCAT) X (GATHER) X (PAD) X (RESIZE) X (TRILU)         \
    X (GATHER_ELEMENTS) X (CUMSUM) X (EYE)

/* What a shape kernel's prepare step works out; lives in kiln_kplan_t. */
typedef struct kiln_kshape_plan {
    size_t esz;                             /* bytes per element */
    /* strided: the loop nest (merged), source strides, first element;
     * pad and resize: X's and Y's dims (rank) */
    int rank;
    int64_t dims[KILN_PROG_MAX_PARAM_INTS];
    int64_t st[KILN_PROG_MAX_PARAM_INTS];
    int64_t offset;
    int64_t in_dims[KILN_MAX_RANK];
    /* concat, gather: around the axis */
    int64_t outer, inner, axis_len, n_idx;
    int64_t chunk[KILN_PROG_MAX_OP_IO];     /* concat: bytes per input and outer step */
    bool idx64;                             /* gather: int64 (else int32) indices */
    /* pad */
    int64_t pads[2 * KILN_MAX_RANK];
    int mode;                               /* pad: kiln_pad_mode_t; resize: 0 nearest, 1 linear */
    uint8_t value[8];                       /* pad: the constant as one element */
    /* resize */
    int coord, nearest;
    kiln_dtype_t dt;                        /* cumsum: the type it sums in */
    double scale[KILN_MAX_RANK];            /* per axis, as the coordinate mapping uses it */
    /* windows: conv_transpose2d, avgpool2d (rank 3 reads as height 1) */
    int64_t n, c, h, w, m, oh, ow;
    int64_t kh, kw, sh, sw, dh, dw, pt, pl, pb, pr;
    int64_t group;
    bool bias, include_pad;
    int64_t planes, spatial;                /* global_maxpool */
} kiln_kshape_plan_t;

/* Check and plan op `op` of `p`, one of KILN_KSHAPE_KERNELS; sets
 * plan->run.  Errors name the operand or parameter at fault (the caller
 * prefixes the op). */
int kiln_kshape_prepare (kiln_program_t *p, kiln_prog_op_t *op,
                         struct kiln_kplan *plan, kiln_err_t *err);

#endif
