/*
 * kiln_lower_math — lowering of the math ops (elementwise, comparisons,
 * logic, Where, Cast, Clip, Softmax, reductions, ArgMax/ArgMin and the
 * normalisations) into the kernels of runtime/kiln_kernels_math.c.
 * Internal to the compiler; the functions sit in the lowering table of
 * kiln_cc_lower.c.
 *
 * Each function resolves what the runtime must not think about: ONNX
 * attribute defaults, opset-dependent meanings (through the resolvers of
 * graph/kiln_infer_math.h, the same ones inference used), negative axes,
 * and which inputs are compile-time constants (a ReduceSum's axes).  It
 * checks that the output shape inferred for the graph is the one it
 * computes.  Operands keep their dtypes: the kernels check and dispatch
 * on them.
 */
#ifndef KILN_LOWER_MATH_H
#define KILN_LOWER_MATH_H

#include "compiler/kiln_cc_lower.h"

/* X -> Y of the same shape and dtype; float parameters with their ONNX
 * defaults (alpha, beta, gamma) by op. */
int kiln_lower_math_unary (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                           kiln_kernel_t k, kiln_err_t *err);
int kiln_lower_math_cast (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                          kiln_kernel_t k, kiln_err_t *err);
int kiln_lower_math_clip (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                          kiln_kernel_t k, kiln_err_t *err);
/* add/sub/mul/div: two operands with shape_a/shape_b parameters. */
int kiln_lower_math_arith (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                           kiln_kernel_t k, kiln_err_t *err);
/* Every input an operand, broadcast to the output: Pow, Max, Min, Sum,
 * Mean, comparisons, logic, Where. */
/* Mod: the floored remainder (fmod 0) or C's fmod (fmod 1). */
int kiln_lower_math_mod (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                         kiln_err_t *err);
int kiln_lower_math_broadcast (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                               kiln_kernel_t k, kiln_err_t *err);
int kiln_lower_math_softmax (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                             kiln_kernel_t k, kiln_err_t *err);
int kiln_lower_math_reduce (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                            kiln_kernel_t k, kiln_err_t *err);
int kiln_lower_math_arg (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                         kiln_kernel_t k, kiln_err_t *err);
int kiln_lower_math_norm (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                          kiln_kernel_t k, kiln_err_t *err);

/* NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (kernel nll_loss). */
int kiln_lower_math_nll (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                         kiln_err_t *err);

/* IsInf (kernel is_inf). */
int kiln_lower_math_isinf (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                           kiln_err_t *err);

#endif
