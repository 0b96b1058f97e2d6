/*
 * kiln_kernels_index — kernels whose indices are data: scatter_nd,
 * scatter_elements, gather_nd, topk, and grid_sample, whose sampling
 * coordinates are (docs/program-format.md).  Internal
 * to libkilnrt.
 *
 * Every index read at run time is checked against the axis it indexes
 * (negative ones count from the end); one out of range is a fault of the
 * run (kiln_exec_fault): the kernel stops without writing past its
 * output, and kiln_model_run returns the error naming the op.
 */
#ifndef KILN_KERNELS_INDEX_H
#define KILN_KERNELS_INDEX_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kiln_program.h"

struct kiln_kplan;

/* The KILN_KERNELS ids this file implements. */
#define KILN_KINDEX_KERNELS(X) \
    X (SCATTER_ND) X (SCATTER_ELEMENTS) X (GATHER_ND) X (TOPK) X (GRID_SAMPLE)

/* The `reduction` parameter of the scatters; the compiler writes the
 * same numbers. */
enum { KILN_SCATTER_NONE = 0, KILN_SCATTER_ADD = 1, KILN_SCATTER_MUL = 2,
       KILN_SCATTER_MAX = 3, KILN_SCATTER_MIN = 4 };

/* What an index kernel's prepare step works out; lives in kiln_kplan_t. */
typedef struct kiln_kindex_plan {
    kiln_dtype_t dt;            /* data's dtype */
    size_t esz;                 /* its element size */
    bool idx64;                 /* indices are int64 (else int32) */
    int reduction;              /* KILN_SCATTER_* */
    int rank;                   /* data's rank */
    int64_t dims[KILN_MAX_RANK];    /* data's dims */
    int64_t idims[KILN_MAX_RANK];   /* indices' dims (scatter_elements) */
    int irank;
    int axis;                   /* scatter_elements, topk */
    int64_t n_data;             /* elements of data */
    int64_t k;                  /* nd: index tuple length; topk: k */
    int64_t batch;              /* gather_nd: batches (product of batch dims) */
    int64_t n_idx;              /* nd: index tuples per batch; elements: indices */
    int64_t slice;              /* nd: elements a tuple addresses */
    int64_t outer, len, inner;  /* topk: X as [outer, len, inner] */
    bool largest;
    /* grid_sample: X [n, c, h, w], grid [n, oh, ow, 2] */
    int64_t gn, gc, gh, gw, goh, gow;
    int gmode;                  /* 0 bilinear, 1 nearest */
    int gpad;                   /* 0 zeros, 1 border, 2 reflection */
    bool galign;                /* align_corners */
} kiln_kindex_plan_t;

/* Check and plan an op of KILN_KINDEX_KERNELS; sets plan->run. */
int kiln_kindex_prepare (kiln_program_t *p, kiln_prog_op_t *op, struct kiln_kplan *plan,
                         kiln_err_t *err);

#endif
