/*
 * kiln_infer_math — shape inference for the math ops: elementwise
 * arithmetic and activations, comparisons and logic, Where, Cast,
 * Softmax/LogSoftmax, the Reduce* family, ArgMax/ArgMin and the
 * normalisations (BatchNormalization at inference, InstanceNormalization,
 * LayerNormalization, LRN).  The infer functions are registered in the op
 * table of kiln_graph_infer.c; semantics are ONNX's, opsets 7..18, with
 * numpy (multidirectional) broadcasting where ONNX has it.
 *
 * Which dtypes an op takes is what the runtime's kernels implement
 * (runtime/kiln_kernels_math.c): float32 and float64 for the float math,
 * the integer types too for arithmetic, comparisons, Clip, Max/Min and
 * Sum/Mean/Max/Min/Prod reductions, bool for logic; float16 and bfloat16
 * wherever float32 goes (the compiler computes them in float32 and rounds
 * each result to the type: docs/engine.md).  A dtype an op does not take
 * is KILN_ESHAPE.
 *
 * The resolvers below work out what opset-dependent attributes mean; the
 * compiler's lowering (compiler/kiln_lower_math.c) calls them too, so that
 * inference and code generation cannot disagree.
 */
#ifndef KILN_INFER_MATH_H
#define KILN_INFER_MATH_H

#include <stdbool.h>

#include "graph/kiln_infer.h"

/* --- infer functions (kiln_graph_infer.c's op table) --------------- */

int kiln_infer_float_unary (kiln_infer_ctx_t *ctx);  /* Exp, Sigmoid, Elu, ... */
int kiln_infer_neg_abs (kiln_infer_ctx_t *ctx);      /* Neg, Abs */
int kiln_infer_not (kiln_infer_ctx_t *ctx);
int kiln_infer_clip (kiln_infer_ctx_t *ctx);
int kiln_infer_cast (kiln_infer_ctx_t *ctx);        /* Cast, CastLike */
int kiln_infer_prelu (kiln_infer_ctx_t *ctx);
int kiln_infer_arith (kiln_infer_ctx_t *ctx);        /* Add, Sub, Mul, Div */
int kiln_infer_pow (kiln_infer_ctx_t *ctx);
int kiln_infer_variadic (kiln_infer_ctx_t *ctx);     /* Max, Min, Sum, Mean */
int kiln_infer_compare (kiln_infer_ctx_t *ctx);      /* Equal, Less, ... */
int kiln_infer_logical (kiln_infer_ctx_t *ctx);      /* And, Or, Xor */
int kiln_infer_where (kiln_infer_ctx_t *ctx);
int kiln_infer_softmax (kiln_infer_ctx_t *ctx);      /* Softmax, LogSoftmax */
int kiln_infer_reduce (kiln_infer_ctx_t *ctx);       /* Reduce* */
int kiln_infer_arg (kiln_infer_ctx_t *ctx);          /* ArgMax, ArgMin */
int kiln_infer_batch_norm (kiln_infer_ctx_t *ctx);
int kiln_infer_instance_norm (kiln_infer_ctx_t *ctx);
int kiln_infer_layer_norm (kiln_infer_ctx_t *ctx);
int kiln_infer_lrn (kiln_infer_ctx_t *ctx);
int kiln_infer_trilu (kiln_infer_ctx_t *ctx);         /* k a constant */
int kiln_infer_cumsum (kiln_infer_ctx_t *ctx);        /* axis a constant */
int kiln_infer_gather_elements (kiln_infer_ctx_t *ctx);
int kiln_infer_rnn (kiln_infer_ctx_t *ctx);           /* RNN, GRU, LSTM */
int kiln_infer_scatter (kiln_infer_ctx_t *ctx);       /* ScatterND, ScatterElements, Scatter */
int kiln_infer_gather_nd (kiln_infer_ctx_t *ctx);
int kiln_infer_topk (kiln_infer_ctx_t *ctx);          /* K a constant */
int kiln_infer_grid_sample (kiln_infer_ctx_t *ctx);
int kiln_infer_nll (kiln_infer_ctx_t *ctx);
int kiln_infer_isinf (kiln_infer_ctx_t *ctx);
int kiln_infer_eyelike (kiln_infer_ctx_t *ctx);           /* and SoftmaxCrossEntropyLoss */

/* --- resolvers (also used by the compiler) ------------------------- */

/* The axes a Reduce* node of graph `g` reduces on an input of rank
 * `rank`: reduced[i] for i < rank, and keepdims.  Axes come from the
 * `axes` attribute, or from a constant int64 input (ReduceSum from opset
 * 13, every Reduce* from opset 18).  No axes reduces all of them, unless
 * noop_with_empty_axes is 1: then none is (each output element "reduces"
 * the one input element at its place).  Errors do not name the node (the
 * caller prefixes it). */
int kiln_math_reduce_axes (const kiln_graph_t *g, const kiln_node_t *node,
                           int rank, bool reduced[KILN_MAX_RANK],
                           bool *keepdims, kiln_err_t *err);

/* Softmax/LogSoftmax's axis, normalised to 0..rank-1, and whether the
 * input is flattened to 2-D around it first (opset < 13: the op runs
 * over every axis from `axis` on) or not (opset >= 13: one axis). */
int kiln_math_softmax_axis (const kiln_graph_t *g, const kiln_node_t *node,
                            int rank, int *axis, bool *flatten,
                            kiln_err_t *err);

/* Clip's bounds: before opset 11 the float attributes min and max (each
 * *has_* set when present); from opset 11 on the optional inputs 1 and 2
 * (*min_input / *max_input get the tensor index or -1). */
int kiln_math_clip_bounds (const kiln_graph_t *g, const kiln_node_t *node,
                           bool *has_min, double *min, bool *has_max,
                           double *max, int *min_input, int *max_input,
                           kiln_err_t *err);

#endif
