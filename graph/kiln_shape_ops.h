/*
 * kiln_shape_ops — the parameters of kiln's data-movement, shape and
 * window ops (Slice, Pad, Split, Resize, ConvTranspose, Einsum, ...),
 * worked out once from a node's attributes and constant inputs.
 *
 * Shape inference (kiln_infer_shape.c), compile-time folding
 * (kiln_fold.c) and the compiler's lowering (compiler/kiln_lower_shape.c)
 * all call these functions, so the three cannot disagree on what a node
 * means.  Each takes the shapes of the node's inputs as arguments
 * (inference knows them before they are stored in the graph) and reads
 * attributes and constant inputs from the graph.
 *
 * Opset differences are resolved here: a parameter that moved from an
 * attribute to an input (Squeeze/Unsqueeze axes and Split's split at
 * opset 13, Slice's starts/ends at 10, Pad's pads at 11) is read from the
 * input when the node has it, else from the attribute.
 *
 * Errors are not prefixed with the node: the caller puts its label in
 * front (kiln_error_prefix).  A parameter computed at run time rather
 * than a constant is KILN_EUNSUPPORTED: kiln compiles for fixed shapes.
 */
#ifndef KILN_SHAPE_OPS_H
#define KILN_SHAPE_OPS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kiln_program.h"
#include "graph/kiln_graph.h"

/* --- constants ------------------------------------------------------- */

/* True when input i of `node` is present and a weight with its data. */
bool kiln_const_input (const kiln_graph_t *g, const kiln_node_t *node, int i);
/* The values of input i of `node`, an int64 or int32 constant of rank 0
 * or 1 with at most `max` values, into v[]; *n gets the count.  `what`
 * names the input in errors ("axes"). */
int kiln_const_ints (const kiln_graph_t *g, const kiln_node_t *node, int i,
                     const char *what, int max, int64_t *v, int *n,
                     kiln_err_t *err);
/* The values of input i, a float32/float64 (or integer) constant of rank
 * 0 or 1 with at most `max` values, as doubles. */
int kiln_const_floats (const kiln_graph_t *g, const kiln_node_t *node, int i,
                       const char *what, int max, double *v, int *n,
                       kiln_err_t *err);

/* --- reshaping ----------------------------------------------------- */

/* Transpose: `perm` (default: the axes reversed), checked to be a
 * permutation of 0..rank-1. */
int kiln_transpose_perm (const kiln_graph_t *g, const kiln_node_t *node,
                         int rank, int64_t *perm, kiln_err_t *err);
/* Squeeze: the output shape (the listed axes, each of size 1, removed;
 * without axes every dimension of size 1). */
int kiln_squeeze_shape (const kiln_graph_t *g, const kiln_node_t *node,
                        const kiln_shape_t *in, kiln_shape_t *out,
                        kiln_err_t *err);
/* Unsqueeze: the output shape (a 1 inserted at each listed output axis). */
int kiln_unsqueeze_shape (const kiln_graph_t *g, const kiln_node_t *node,
                          const kiln_shape_t *in, kiln_shape_t *out,
                          kiln_err_t *err);
/* Shape: the first and one-past-last dimension reported (opset 15's
 * start and end, clamped). */
int kiln_shape_range (const kiln_node_t *node, int rank, int *start, int *end,
                      kiln_err_t *err);
/* DepthToSpace (depth = true) or SpaceToDepth: blocksize, CRD mode, and
 * the output shape.  Input rank 4. */
int kiln_d2s_params (const kiln_node_t *node, bool depth, const kiln_shape_t *in,
                     int64_t *block, bool *crd, kiln_shape_t *out,
                     kiln_err_t *err);

/* --- selecting and joining ------------------------------------------ */

/* Concat: the axis (normalised) and the output shape of the node's
 * inputs (n of them, all present). */
int kiln_concat_params (const kiln_node_t *node, const kiln_shape_t *const *ins,
                        int n, int *axis, kiln_shape_t *out, kiln_err_t *err);
/* Split: the axis and the size along it of each of the node's outputs
 * (sizes[n_outputs]). */
int kiln_split_sizes (const kiln_graph_t *g, const kiln_node_t *node,
                      const kiln_shape_t *in, int *axis, int64_t *sizes,
                      kiln_err_t *err);
/* Slice: per axis of `in`, the first index read and the step (1 for
 * axes not sliced), and the output shape.  Negative starts and ends
 * count from the end and are clamped as ONNX says. */
int kiln_slice_params (const kiln_graph_t *g, const kiln_node_t *node,
                       const kiln_shape_t *in, int64_t *start, int64_t *step,
                       kiln_shape_t *out, kiln_err_t *err);
/* Gather: the axis (normalised) and the output shape. */
int kiln_gather_params (const kiln_node_t *node, const kiln_shape_t *data,
                        const kiln_shape_t *indices, int *axis,
                        kiln_shape_t *out, kiln_err_t *err);

/* --- growing --------------------------------------------------------- */

typedef enum {
    KILN_PAD_CONSTANT = 0,
    KILN_PAD_REFLECT = 1,
    KILN_PAD_EDGE = 2,
} kiln_pad_mode_t;

/* Pad: pads[2 * rank] (all begins, then all ends; negative crops), the
 * mode, the constant value, and the output shape. */
int kiln_pad_params (const kiln_graph_t *g, const kiln_node_t *node,
                     const kiln_shape_t *in, int64_t *pads,
                     kiln_pad_mode_t *mode, double *value, kiln_shape_t *out,
                     kiln_err_t *err);
/* Tile: the output shape (repeats from input 1). */
int kiln_tile_shape (const kiln_graph_t *g, const kiln_node_t *node,
                     const kiln_shape_t *in, kiln_shape_t *out,
                     kiln_err_t *err);
/* Expand: the output shape (input 1 broadcast with `in`, both ways). */
int kiln_expand_shape (const kiln_graph_t *g, const kiln_node_t *node,
                       const kiln_shape_t *in, kiln_shape_t *out,
                       kiln_err_t *err);

/* --- Resize ---------------------------------------------------------- */

typedef enum {
    KILN_RESIZE_NEAREST = 0,
    KILN_RESIZE_LINEAR = 1,
} kiln_resize_mode_t;

typedef enum {
    KILN_COORD_HALF_PIXEL = 0,
    KILN_COORD_ASYMMETRIC = 1,
    KILN_COORD_ALIGN_CORNERS = 2,
    KILN_COORD_PYTORCH_HALF_PIXEL = 3,
} kiln_resize_coord_t;

typedef enum {
    KILN_NEAREST_ROUND_PREFER_FLOOR = 0,
    KILN_NEAREST_ROUND_PREFER_CEIL = 1,
    KILN_NEAREST_FLOOR = 2,
    KILN_NEAREST_CEIL = 3,
} kiln_resize_nearest_t;

typedef struct kiln_resize {
    kiln_resize_mode_t mode;
    kiln_resize_coord_t coord;
    kiln_resize_nearest_t nearest;
    /* Per axis: the scale given by the `scales` input (a float32 value),
     * or 0 when the output size came from `sizes` (the scale is then
     * output / input, as ONNX says). */
    float scales[KILN_MAX_RANK];
} kiln_resize_t;

/* Resize: the interpolation and the output shape.  cubic,
 * tf_crop_and_resize, antialias and exclude_outside are refused. */
int kiln_resize_params (const kiln_graph_t *g, const kiln_node_t *node,
                        const kiln_shape_t *in, kiln_resize_t *rp,
                        kiln_shape_t *out, kiln_err_t *err);

/* --- ConvTranspose ------------------------------------------------- */

/* ConvTranspose of X `x` with weights `w` [C, M/group, k1..kn]: the
 * window (kernel, strides, dilations, explicit pads with auto_pad and
 * output_shape worked out), output_padding, the group and the output
 * shape [N, M, O1..On]. */
int kiln_convtr_params (const kiln_node_t *node, const kiln_shape_t *x,
                        const kiln_shape_t *w, kiln_window_t *win,
                        int64_t *out_pad, int64_t *group, kiln_shape_t *out,
                        kiln_err_t *err);

/* --- Einsum ---------------------------------------------------------- */

/* A parsed Einsum equation: each operand's and the output's labels (one
 * letter per axis).  Only equations without an ellipsis, without a label
 * repeated within one operand, and (with two operands) without a label
 * summed away that appears in one operand only are accepted: those are a
 * transposition (one operand) or a batched matrix product with
 * transpositions around it (two operands). */
typedef struct kiln_einsum {
    int n_in;                           /* 1 or 2 */
    char in[2][KILN_MAX_RANK + 1];      /* labels of each operand */
    char out[KILN_MAX_RANK + 1];        /* labels of the output */
} kiln_einsum_t;

/* Parse the node's `equation` against its inputs' shapes; fill `e` and
 * the output shape. */
int kiln_einsum_params (const kiln_node_t *node, const kiln_shape_t *const *ins,
                        int n, kiln_einsum_t *e, kiln_shape_t *out,
                        kiln_err_t *err);

/* --- recurrent ops: RNN, GRU, LSTM --------------------------------- */

/* A recurrent node's attributes and sizes.  Inputs X, W, R and the
 * optional B, sequence_lens, initial_h, initial_c (LSTM), P (LSTM) are
 * checked against each other; the activations (ONNX's defaults when the
 * node names none) and their alphas and betas, consumed in order by the
 * activations that take them, as ONNX Runtime does. */
typedef struct kiln_rnn {
    int cell;                   /* KILN_RNN_CELL_* */
    int direction;              /* 0 forward, 1 reverse, 2 bidirectional */
    int layout;                 /* 0: X [T, B, I]; 1: [B, T, I] */
    int64_t t, b, i, h, d, g;   /* steps, batch, input, hidden, directions, gates */
    int n_act;                  /* activations per direction */
    int act[KILN_RNN_MAX_ACTS];
    float aa[KILN_RNN_MAX_ACTS], ab[KILN_RNN_MAX_ACTS];
    double clip;                /* 0: none */
    bool input_forget, lbr;
    kiln_shape_t y, yh;         /* Y's shape; Y_h's (and Y_c's) */
} kiln_rnn_t;

/* ins[k] is input k's shape or NULL when absent (n inputs). */
int kiln_rnn_params (const kiln_node_t *node, const kiln_shape_t *const *ins, int n,
                     kiln_rnn_t *r, kiln_err_t *err);

/* --- ops whose indices are data: ScatterND, ScatterElements (and
 * opset 9's Scatter), GatherND, TopK --------------------------------- */

/* Check a scatter's data, indices and updates shapes against each other
 * (nd: ScatterND, else ScatterElements); *reduction gets its number
 * (0 none, 1 add, 2 mul, 3 max, 4 min) and *axis ScatterElements' axis,
 * made non-negative. */
int kiln_scatter_params (const kiln_node_t *node, bool nd, const kiln_shape_t *data,
                         const kiln_shape_t *indices, const kiln_shape_t *updates,
                         int *reduction, int *axis, kiln_err_t *err);
/* GatherND: *batch_dims and the output's shape. */
int kiln_gather_nd_params (const kiln_node_t *node, const kiln_shape_t *data,
                           const kiln_shape_t *indices, int *batch_dims, kiln_shape_t *out,
                           kiln_err_t *err);
/* TopK of X: its axis (non-negative), k (the constant input K, or
 * opset 1's attribute), largest, and the outputs' shape. */
int kiln_topk_params (const kiln_graph_t *g, const kiln_node_t *node, const kiln_shape_t *x,
                      int *axis, int64_t *k, bool *largest, kiln_shape_t *out,
                      kiln_err_t *err);

/* GridSample of X [N, C, H, W] at grid [N, oh, ow, 2]: *mode 0 bilinear
 * (opset 20's "linear"), 1 nearest (cubic is KILN_EUNSUPPORTED); *pad 0
 * zeros, 1 border, 2 reflection; the output [N, C, oh, ow]. */
int kiln_grid_sample_params (const kiln_node_t *node, const kiln_shape_t *x,
                             const kiln_shape_t *grid, int *mode, int *pad, bool *align,
                             kiln_shape_t *out, kiln_err_t *err);

#endif
