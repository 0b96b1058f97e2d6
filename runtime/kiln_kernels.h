/*
 * kiln_kernels — the runtime's CPU kernels, one per entry of KILN_KERNELS
 * (common/kiln_program.h).  Internal to libkilnrt.
 *
 * Each kernel has two halves.  `prepare` runs once when a model is loaded:
 * it reads the op's parameters, checks them and the shapes of its
 * operands against each other, and computes a plan (loop bounds, strides,
 * BLAS dimensions).  Every check that keeps a kernel inside its buffers
 * happens there, with an error that names the op.  `run` executes a plan
 * and cannot fail: by then every index it computes has been proven in
 * range.  The table in kiln_kernels.c is built from KILN_KERNELS, so a
 * kernel added to the format without an implementation does not compile.
 *
 * The compute kernels here are float32 (a packed weight B of matmul and
 * gemm may be float16 or bfloat16).  A convolution, gemm or matmul
 * whose weights the compiler packed, or that carries a fused epilogue,
 * runs on the matrix engine (kiln_gemm.h) or, for `winograd`
 * convolutions, on kiln_winograd.h; a depthwise convolution on direct
 * loops; anything else as at -O0: cblas_sgemm (OpenBLAS), convolutions
 * through im2col + sgemm (a 1x1, stride-1, unpadded convolution multiplies
 * the input in place).  Kernels that need per-thread workspace say how
 * much in plan->ws_bytes (kiln_exec.h allocates it at load).  The math
 * kernels (kiln_kernels_math.c and its kin; add/sub/mul/div on other
 * dtypes too) dispatch on their operands' dtypes at prepare time.  Each
 * kind of kernel has a file of its own (kiln_kernels_priv.h lists them).
 */
#ifndef KILN_KERNELS_H
#define KILN_KERNELS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kiln_program.h"
#include "runtime/kiln_gemm.h"
#include "runtime/kiln_kernels_convtr3d.h"
#include "runtime/kiln_kernels_index.h"
#include "runtime/kiln_kernels_math.h"
#include "runtime/kiln_kernels_pool3d.h"
#include "runtime/kiln_kernels_rnn.h"
#include "runtime/kiln_kernels_shape.h"
#include "runtime/kiln_winograd.h"

/* Elements of program tensor `t`; bounded, since kiln_program_check ran
 * kiln_shape_numel on every tensor.  For the kernels' prepare steps. */
static inline int64_t
kiln_ktensor_numel (const kiln_prog_tensor_t *t)
{
    return kiln_shape_count (&t->shape);
}

/* An attention op's plan (kiln_kernels_matmul.c). */
typedef struct {
    int64_t m, n, k, nv;    /* queries, keys, their width, V's width */
    int rank;               /* batch rank */
    int64_t batch[KILN_MAX_RANK];
    int64_t nbatch;
    /* batch strides (0: broadcast), first elements, and the
     * strides of Q (i, kk), Kᵀ (kk, j), V (j, c), Y (i, c) and
     * the mask (i, j) within one batch element */
    int64_t sq[KILN_MAX_RANK], sk[KILN_MAX_RANK], sv[KILN_MAX_RANK],
        sy[KILN_MAX_RANK], sm[KILN_MAX_RANK];
    int64_t qoff, koff, voff, moff;
    int64_t qrs, qcs, krs, kcs, vrs, vcs, yrs, mrs, mcs;
    float alpha;            /* scores = alpha·Q·Kᵀ (+ mask) */
    bool mask;              /* input 3 */
    int64_t qb;             /* queries a task */
    int64_t ldp;            /* row stride of a task's scores */
} kiln_kattn_plan_t;

typedef struct kiln_kplan {
    kiln_kernel_t kernel;
    /* When set (by prepare), runs instead of the table's run: a variant
     * for the operands' dtypes (kiln_kernels_math.c). */
    void (*run) (const struct kiln_kplan *plan, void *const *data);
    int in[KILN_PROG_MAX_OP_IO];    /* operand tensor indices */
    int n_in;
    int out;                        /* result tensor index */
    int scratch;                    /* workspace tensor index or -1 */
    size_t ws_bytes;                /* per-worker workspace (kiln_exec.h) */
    struct {                        /* fused epilogue: conv2d, gemm, matmul */
        kiln_act_t act;
        float a, b;                 /* clip's bounds, leaky_relu's slope */
        int residual;               /* operand index of the residual or -1 */
    } epi;
    union {
        struct {                    /* add, sub, mul, div */
            int rank;               /* after merging dimensions, >= 1 */
            int64_t dims[KILN_MAX_RANK];
            int64_t sa[KILN_MAX_RANK];   /* element strides, 0 = broadcast */
            int64_t sb[KILN_MAX_RANK];
        } bin;
        struct {                    /* relu (elements), copy (bytes) */
            int64_t n;
        } flat;
        struct {                    /* matmul */
            int m, n, k;
            int rank;               /* batch rank */
            int64_t batch[KILN_MAX_RANK];
            int64_t sa[KILN_MAX_RANK];   /* batch strides in elements */
            int64_t sb[KILN_MAX_RANK];
            int64_t sy[KILN_MAX_RANK];   /* Y's batch strides */
            int64_t aoff, boff;     /* A's and B's first element in their tensors */
            int64_t ars, acs;       /* A's element (i, kk) at a[i·ars + kk·acs] */
            int64_t brs, bcs;       /* B's element (kk, j) at b[kk·brs + j·bcs] */
            int64_t yrs;            /* Y's element (i, j) at y[i·yrs + j] */
            float alpha;            /* Y = alpha·A·B (+ bias, residual) */
            int64_t nbatch;
            bool flat;              /* B shared: one product over all rows */
            bool packed_b;          /* B is the weight, packed */
            kiln_dtype_t b_half;    /* its 2-byte dtype, or 0 for float32 */
            int bias;               /* operand index of the bias or -1 */
        } mm;
        kiln_kattn_plan_t attn;     /* attention */
        struct {                    /* gemm */
            int m, n, k;
            bool ta, tb;
            float alpha, beta;
            bool has_c;
            int64_t c0, c1;         /* C's shape broadcast to [m, n] */
            bool packed_b;          /* op(B) is the weight, packed */
            kiln_dtype_t b_half;    /* its 2-byte dtype, or 0 for float32 */
        } gemm;
        struct {                    /* conv2d */
            int64_t n, c, h, w, m, oh, ow;
            int64_t kh, kw, sh, sw, dh, dw, pt, pl;
            int64_t group;
            bool bias, im2col;
            bool packed;            /* W packed (kiln_pack.h): kiln_gemm */
            bool trans;             /* W conv-packed-T: Yᵀ = im2col(X)ᵀ · Wᵀ */
            bool depthwise;         /* one channel per group, direct loops */
            bool pointwise;         /* 1x1, stride 1, unpadded */
            bool x_cl, y_cl;        /* X / Y (and the residual) channels-last:
                                     * [N, H, W, C] (op attribute "layout") */
            bool few;               /* a few channels to channels-last: direct
                                     * loops (kiln_kfew_run), not the engine */
            bool inplace;           /* transposed, its tiles read from a padded
                                     * copy of X (s_inplace_run), no gather */
            int64_t irp;            /* then: positions a row panel (7 or 8) */
            int64_t ihp, iwp;       /* the copy's rows and columns */
            bool phased;            /* not transposed, B read from X's phases
                                     * (s_phased_run), no gather */
            int64_t php, pwp;       /* then: a phase's rows and columns */
            int pro;                /* operand index of X's prologue ([2, C]:
                                     * scales, then shifts) or -1 */
            bool pro_relu;          /* and max (·, 0) after it */
            int64_t wpg;            /* packed W floats per group */
            kiln_gconv_t geo;       /* one group's geometry for kiln_gemm */
            bool winograd;          /* W transformed for F(t×t, 3x3) */
            kiln_wino_t wino;
        } conv;
        struct {                    /* conv3d */
            int64_t n, c, m, group, rows, cols;     /* cols: output positions */
            int64_t in[3], out[3], k[3], s[3], d[3], p[3];
            bool bias, pointwise;   /* 1x1x1, stride 1, unpadded: no im2col */
        } conv3;
        struct {                    /* maxpool2d */
            int64_t planes, h, w, oh, ow;
            int64_t kh, kw, sh, sw, dh, dw, pt, pl;
        } pool;
        struct {                    /* global_avgpool */
            int64_t planes, spatial;
            int64_t c;              /* X channels-last [N, spatial, c]: the
                                     * channels, else 0 */
            int64_t chunks;         /* then: blocks of S_GAP_ROWS positions
                                     * summed apart (1: by channels) */
        } gap;
        kiln_kmath_plan_t math;     /* kiln_kernels_math.h */
        kiln_kshape_plan_t shape;   /* kiln_kernels_shape.h */
        kiln_krnn_plan_t rnn;       /* kiln_kernels_rnn.h */
        kiln_kindex_plan_t index;   /* kiln_kernels_index.h */
        kiln_kpool3d_plan_t pool3d; /* kiln_kernels_pool3d.h */
        kiln_kconvtr3d_plan_t convtr3d; /* kiln_kernels_convtr3d.h */
    } u;
} kiln_kplan_t;

/* Check op `i` of `p` and plan it.  Errors are prefixed with the op
 * ("op 3 (conv2d): ...").  Marks the parameters it reads in the op. */
int kiln_kernel_prepare (kiln_program_t *p, int i, kiln_kplan_t *plan,
                         kiln_err_t *err);

/* The fused epilogue's parameters of op `op` into plan->epi
 * (kiln_kernels.c; docs/program-format.md). */
int kiln_kernel_epilogue (const kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                          kiln_err_t *err);

/* Run a prepared op; `data[t]` is the address of tensor t. */
void kiln_kernel_run (const kiln_kplan_t *plan, void *const *data);

#endif
