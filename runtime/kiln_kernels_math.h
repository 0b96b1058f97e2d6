/*
 * kiln_kernels_math — the runtime's math kernels: elementwise arithmetic,
 * activations, comparisons, logic, Where, Cast and round_half, reductions,
 * ArgMax/ArgMin, softmax and the normalisations.  Internal to libkilnrt.
 *
 * Unlike the first kernels (float32 only), these look at the dtypes of
 * their operands: a prepare step checks them and picks a typed inner loop
 * (float32 is the fast path; float64 and the integer types exist because
 * ONNX models and tests use them; comparisons give bool; Cast converts).
 * Broadcasting follows numpy and is worked out from the operands' shapes
 * once, at load time: every operand's shape, right-aligned to the
 * result's rank, has each dimension equal to the result's or 1; strides
 * are computed with 0 for a broadcast dimension, and neighbouring
 * dimensions that are contiguous in every operand are merged so that the
 * inner loop is as long as possible.  Inner loops are simple counted loops
 * over contiguous or strided elements, with separate loops for the common
 * patterns (all contiguous, one side a scalar) so that -O2 vectorises them.
 *
 * Integer arithmetic wraps (it is done in unsigned arithmetic, so never
 * undefined); integer division by zero gives 0; a float that does not fit
 * the integer type of a Cast saturates, and NaN becomes 0.  Every kernel
 * is deterministic: reductions always run in the same order.
 *
 * kiln_kernels.c registers every kernel listed in KILN_KMATH_KERNELS with
 * kiln_kmath_prepare as its prepare; kiln_kmath_prepare sets plan->run,
 * which kiln_kernel_run calls instead of the table's run.  It also hands
 * add/sub/mul/div on non-float32 operands to kiln_kmath_prepare_arith.
 */
#ifndef KILN_KERNELS_MATH_H
#define KILN_KERNELS_MATH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kiln_program.h"

struct kiln_kplan;

/* The KILN_KERNELS ids kiln_kmath_prepare dispatches (those of
 * common/kiln_ops_arith.h name their prepare in their row). */
#define KILN_KMATH_KERNELS(X)                                              \
    X (NEG) X (ABS) X (SQRT) X (RECIPROCAL) X (EXP) X (LOG) X (FLOOR)      \
    X (CEIL) X (ERF) X (TANH) X (SIGMOID) X (SOFTPLUS) X (SOFTSIGN)        \
    X (HARD_SWISH) X (LEAKY_RELU) X (ELU) X (SELU) X (CELU)                \
    X (HARD_SIGMOID) X (CLIP) X (NOT) X (CAST) X (ROUND_HALF)              \
    X (FMOD) X (WHERE) X (REDUCE_LOG_SUM_EXP)                              \
    X (SOFTMAX) X (LOG_SOFTMAX) X (BATCH_NORM) X (INSTANCE_NORM)           \
    X (LAYER_NORM) X (LAYER_NORM_STATS) X (LRN) X (NLL_LOSS) X (HARDMAX) X (IS_INF) \
    KILN_UNARY_OPS (KILN_UNARY_ID_ROW, X)                                  \
    KILN_BINARY_OPS (KILN_BINARY_ID_ROW, X)                                \
    KILN_REDUCE_OPS (KILN_REDUCE_ID_ROW, X)

/* What a math kernel's prepare step works out; lives in kiln_kplan_t. */
typedef struct kiln_kmath_plan {
    void (*fn) (void);              /* the typed inner loop (cast back to call) */
    kiln_dtype_t dt;                /* dtype the kernel computes on */
    kiln_dtype_t dt2;               /* pow: the exponent's; cast: the result's */
    /* elementwise: the result's dims after merging, and each operand's
     * element strides over them (0 = broadcast); st[n_src] is the
     * result's own (contiguous) strides */
    int n_src;
    int rank;                       /* >= 1 */
    int64_t dims[KILN_MAX_RANK];
    int64_t st[KILN_PROG_MAX_OP_IO + 1][KILN_MAX_RANK];
    size_t esz[KILN_PROG_MAX_OP_IO + 1];    /* bytes per element */
    /* reductions, softmax, arg*, norms: X seen as [pre, len, post] around
     * the reduced (or normalised) axes when those are one block; the
     * general reduction walks kept dims (kd, ks) and reduced dims (rd, rs) */
    int64_t pre, len, post;
    int nk, nr;
    int64_t kd[KILN_MAX_RANK], ks[KILN_MAX_RANK];
    int64_t rd[KILN_MAX_RANK], rs[KILN_MAX_RANK];
    bool block;                     /* the reduced axes are one block */
    double f[4];                    /* float parameters */
    int64_t i0;                     /* an integer parameter (nll_loss: the ignored class) */
    int64_t sc_st, b_st;            /* layer_norm: scale and bias strides (0/1) */
    int out2, out3;                 /* layer_norm_stats: Mean and InvStdDev */
    int has_lo, has_hi;             /* clip: bound from an input (its index) or 0;
                                     * nll_loss: an ignored class, the reduction */
} kiln_kmath_plan_t;

/* Check and plan op `op` of `p`, one of KILN_KMATH_KERNELS; sets
 * plan->run.  Errors name the operand or parameter at fault (the caller
 * prefixes the op). */
int kiln_kmath_prepare (kiln_program_t *p, kiln_prog_op_t *op,
                        struct kiln_kplan *plan, kiln_err_t *err);

/* add, sub, mul, div on operands other than float32 (the float32 loops
 * are kiln_kernels_elementwise.c's); reads the same shape_a/shape_b parameters. */
int kiln_kmath_prepare_arith (kiln_program_t *p, kiln_prog_op_t *op,
                              struct kiln_kplan *plan, kiln_err_t *err);

#endif
