/*
 * kiln_ops_shape — the ONNX ops that only move data (views, transposes,
 * slices, concatenation, gathers, padding), one row each.
 *
 * A row says everything the layers need to know of such an op but its
 * functions: the ONNX op; its input and output counts as a graph node
 * (fewest, most); the graph's inference function (graph/kiln_infer_shape.h
 * or graph/kiln_graph_infer.c); the compiler's lowering function
 * (compiler/kiln_lower_shape.h or compiler/kiln_cc_lower.c's view) and
 * the kernel it emits; and whether a half output needs no rounding after
 * it (`exact`: it holds the input's values).  Several ops share one
 * kernel (`strided` does Transpose, Slice, Expand, Tile, DepthToSpace,
 * SpaceToDepth and Split; `copy` is every view), so the kernels are
 * listed in common/kiln_program.h, each once.  From this list are
 * generated the graph's inference table (graph/kiln_graph_infer.c) and
 * the compiler's lowering table (compiler/kiln_cc_lower.c).  Adding such
 * an op is a row here and its two functions; the kernel, if it needs a
 * new one, is a row of KILN_KERNELS_SHAPE and its prepare and run in
 * runtime/kiln_kernels_shape.c (docs/engine.md, "Adding an op").
 *
 * Keep the rows sorted by ONNX name (strcmp order): inference looks
 * them up by binary search and checks the order.
 *
 * S is called as S (X, onnx, in_min, in_max, out_min, out_max, infer,
 * lower, kernel, exact).
 */
#ifndef KILN_OPS_SHAPE_H
#define KILN_OPS_SHAPE_H

#define KILN_SHAPE_OPS(S, X)                                                                   \
    S (X, "Concat",         1, KILN_MAX_NODE_IO, 1, 1, kiln_infer_concat,                      \
       kiln_lower_shape_concat, CONCAT, true)                                                  \
    S (X, "DepthToSpace",   1, 1, 1, 1, kiln_infer_depth_to_space,                             \
       kiln_lower_shape_strided, STRIDED, true)                                                \
    S (X, "Expand",         2, 2, 1, 1, kiln_infer_expand,                                     \
       kiln_lower_shape_strided, STRIDED, true)                                                \
    S (X, "EyeLike",        1, 1, 1, 1, kiln_infer_eyelike,                                    \
       kiln_lower_shape_eyelike, EYE, true)                                                    \
    S (X, "Flatten",        1, 1, 1, 1, s_infer_flatten, s_lower_view, COPY, true)             \
    S (X, "Gather",         2, 2, 1, 1, kiln_infer_gather,                                     \
       kiln_lower_shape_gather, GATHER, true)                                                  \
    S (X, "GatherElements", 2, 2, 1, 1, kiln_infer_gather_elements,                            \
       kiln_lower_shape_gather_elements, GATHER_ELEMENTS, true)                                \
    S (X, "GatherND",       2, 2, 1, 1, kiln_infer_gather_nd,                                  \
       kiln_lower_shape_gather_nd, GATHER_ND, true)                                            \
    S (X, "Identity",       1, 1, 1, 1, s_infer_identity, s_lower_view, COPY, true)            \
    S (X, "Pad",            1, 4, 1, 1, kiln_infer_pad, kiln_lower_shape_pad, PAD, false)      \
    S (X, "Reshape",        2, 2, 1, 1, s_infer_reshape, s_lower_view, COPY, true)             \
    S (X, "Slice",          1, 5, 1, 1, kiln_infer_slice,                                      \
       kiln_lower_shape_strided, STRIDED, true)                                                \
    S (X, "SpaceToDepth",   1, 1, 1, 1, kiln_infer_space_to_depth,                             \
       kiln_lower_shape_strided, STRIDED, true)                                                \
    S (X, "Split",          1, 2, 1, KILN_MAX_NODE_IO, kiln_infer_split,                       \
       kiln_lower_shape_split, STRIDED, true)                                                  \
    S (X, "Squeeze",        1, 2, 1, 1, kiln_infer_squeeze, s_lower_view, COPY, true)          \
    S (X, "Tile",           2, 2, 1, 1, kiln_infer_tile,                                       \
       kiln_lower_shape_strided, STRIDED, true)                                                \
    S (X, "Transpose",      1, 1, 1, 1, kiln_infer_transpose,                                  \
       kiln_lower_shape_strided, STRIDED, true)                                                \
    S (X, "Trilu",          1, 2, 1, 1, kiln_infer_trilu,                                      \
       kiln_lower_shape_trilu, TRILU, true)                                                    \
    S (X, "Unsqueeze",      1, 2, 1, 1, kiln_infer_unsqueeze, s_lower_view, COPY, true)

#endif
