/*
 * kiln_lower_shape — lowering of the data-movement, shape and window ops
 * (Transpose, Squeeze, Unsqueeze, Concat, Split, Slice, Gather, Pad,
 * Tile, Expand, Resize, DepthToSpace, SpaceToDepth, Einsum,
 * ConvTranspose, AveragePool, GlobalMaxPool) into the kernels of
 * runtime/kiln_kernels_shape.c.  Internal to the compiler; the functions
 * sit in the lowering table of kiln_cc_lower.c.
 *
 * Each op's parameters come from graph/kiln_shape_ops.h, the functions
 * shape inference used, so lowering and inference cannot disagree; each
 * lowering still checks that the inferred output shape is the one it
 * computes.  Most data movement becomes one `strided` op: a loop nest
 * over the output reading the input at computed strides (a transposition
 * permutes the strides, a slice scales them and starts at an offset, a
 * broadcast sets them to 0, a tile repeats a loop with stride 0).
 */
#ifndef KILN_LOWER_SHAPE_H
#define KILN_LOWER_SHAPE_H

#include "compiler/kiln_cc_lower.h"

/* Transpose, Slice, Expand, Tile, DepthToSpace, SpaceToDepth: one
 * strided op each. */
int kiln_lower_shape_strided (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                              kiln_kernel_t k, kiln_err_t *err);
/* Split: one strided op per output. */
int kiln_lower_shape_split (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                            kiln_kernel_t k, kiln_err_t *err);
/* Concat: concat ops of at most 8 inputs, chained when there are more. */
int kiln_lower_shape_concat (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                             kiln_kernel_t k, kiln_err_t *err);
int kiln_lower_shape_gather (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                             kiln_kernel_t k, kiln_err_t *err);
int kiln_lower_shape_pad (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                          kiln_kernel_t k, kiln_err_t *err);
int kiln_lower_shape_resize (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                             kiln_kernel_t k, kiln_err_t *err);
/* Einsum: strided transpositions around one matmul. */
int kiln_lower_shape_einsum (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                             kiln_kernel_t k, kiln_err_t *err);
int kiln_lower_shape_conv_transpose (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                                     kiln_kernel_t k, kiln_err_t *err);
int kiln_lower_shape_avgpool (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                              kiln_kernel_t k, kiln_err_t *err);
/* Emit the 2-D AveragePool of graph node `pool` (its window, ceil_mode
 * and count_include_pad) from program tensor px into py. */
int kiln_lower_avgpool_op (kiln_cc_ctx_t *cx, int pool, int px, int py, kiln_err_t *err);
int kiln_lower_shape_global_pool (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                                  kiln_kernel_t k, kiln_err_t *err);

/* Trilu (k a constant), CumSum (axis a constant), GatherElements. */
int kiln_lower_shape_trilu (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                            kiln_err_t *err);
int kiln_lower_shape_cumsum (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                             kiln_err_t *err);
int kiln_lower_shape_gather_elements (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                                      kiln_kernel_t k, kiln_err_t *err);

/* EyeLike (kernel eye). */
int kiln_lower_shape_eyelike (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                              kiln_err_t *err);

/* RNN, GRU and LSTM: one rnn kernel, then Y, Y_h and Y_c copied out. */
int kiln_lower_shape_rnn (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                          kiln_err_t *err);

/* ScatterND, ScatterElements (and Scatter), GatherND, TopK (K a constant:
 * topk's indices, then the values by gather_elements). */
int kiln_lower_shape_scatter (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                              kiln_err_t *err);
int kiln_lower_shape_gather_nd (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                                kiln_err_t *err);
int kiln_lower_shape_topk (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                           kiln_err_t *err);

/* MaxPool and AveragePool of rank 5: pool3d. */
int kiln_lower_shape_pool3d (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                             kiln_err_t *err);

/* GridSample of a 4-D X, bilinear or nearest. */
int kiln_lower_shape_grid_sample (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                                  kiln_kernel_t k, kiln_err_t *err);

#endif
