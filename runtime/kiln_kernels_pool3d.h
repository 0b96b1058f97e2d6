/*
 * kiln_kernels_pool3d — `pool3d`: MaxPool and AveragePool of rank-5
 * tensors (docs/program-format.md).  Internal to libkilnrt.
 */
#ifndef KILN_KERNELS_POOL3D_H
#define KILN_KERNELS_POOL3D_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kiln_program.h"

struct kiln_kplan;

/* The KILN_KERNELS ids this file implements. */
#define KILN_KPOOL3D_KERNELS(X) X (POOL3D)

/* What pool3d's prepare step works out; lives in kiln_kplan_t. */
typedef struct kiln_kpool3d_plan {
    bool avg;                   /* else max */
    bool include_pad;           /* avg: divide by the window within the padded input */
    int64_t planes;             /* N·C */
    int64_t in[3], out[3], k[3], s[3], d[3], pb[3], pe[3];
} kiln_kpool3d_plan_t;

/* Check and plan a pool3d op; sets plan->run. */
int kiln_kpool3d_prepare (kiln_program_t *p, kiln_prog_op_t *op, struct kiln_kplan *plan,
                          kiln_err_t *err);

#endif
