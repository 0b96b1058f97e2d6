/*
 * kiln_kernels_convtr3d — `conv_transpose3d`: ConvTranspose of rank-5
 * tensors (docs/program-format.md).  Internal to libkilnrt.
 */
#ifndef KILN_KERNELS_CONVTR3D_H
#define KILN_KERNELS_CONVTR3D_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kiln_program.h"

struct kiln_kplan;

/* The KILN_KERNELS ids this file implements. */
#define KILN_KCONVTR3D_KERNELS(X) X (CONV_TRANSPOSE3D)

/* What conv_transpose3d's prepare step works out; lives in kiln_kplan_t. */
typedef struct kiln_kconvtr3d_plan {
    bool bias;
    int64_t n, c, m, group;     /* batch, input and output channels */
    int64_t in[3], out[3], k[3], s[3], d[3], pb[3];
} kiln_kconvtr3d_plan_t;

/* Check and plan a conv_transpose3d op; sets plan->run. */
int kiln_kconvtr3d_prepare (kiln_program_t *p, kiln_prog_op_t *op, struct kiln_kplan *plan,
                            kiln_err_t *err);

#endif
