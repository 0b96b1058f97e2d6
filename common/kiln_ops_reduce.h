/*
 * kiln_ops_reduce — the reductions over axes (ReduceSum, ...), one row
 * each.
 *
 * A row is the whole definition of such a reduction: the program
 * kernel's id and name, the ONNX op, whether its result holds one of the
 * input's values (`exact`: a half output then needs no rounding), and
 * its accumulator for float32 and float64 input (type AC = double):
 * the initial value, the statement adding one element `v` (of the input's
 * type T) to `acc`, and the result from `acc` and the element count `n`;
 * then whether int32 and int64 are reduced too (1 or 0) and their
 * accumulator (AC = int64_t; sums and products wrap through uint64), `_`
 * when they are not.  From this list are generated: the kernel list
 * (common/kiln_program.h), the graph's inference table
 * (graph/kiln_graph_infer.c: kiln_infer_reduce), the compiler's lowering
 * table (compiler/kiln_cc_lower.c: kiln_lower_math_reduce) and the
 * runtime's loops, dtype tables and dispatch (runtime/kiln_kernels_math.c).
 * Adding such a reduction is adding a row here (docs/engine.md, "Adding
 * an op").  ReduceLogSumExp (two passes over the data) is not a row.
 *
 * R is called as R (X, id, name, onnx, exact, init, step, fini, ints,
 * iinit, istep, ifini).
 */
#ifndef KILN_OPS_REDUCE_H
#define KILN_OPS_REDUCE_H

#define KILN_REDUCE_OPS(R, X)                                                         \
    R (X, REDUCE_SUM, "reduce_sum", "ReduceSum", false,                                \
       0, acc += (AC) v, (T) acc,                                                      \
       1, 0, acc = (AC) ((uint64_t) acc + (uint64_t) v), (T) acc)                      \
    R (X, REDUCE_MEAN, "reduce_mean", "ReduceMean", false,                             \
       0, acc += (AC) v, (T) (acc / (AC) n),                                           \
       1, 0, acc = (AC) ((uint64_t) acc + (uint64_t) v), (T) (n ? acc / n : 0))        \
    /* NaN wins, as in torch and ONNX Runtime */                                      \
    R (X, REDUCE_MAX, "reduce_max", "ReduceMax", true,                                 \
       -INFINITY, acc = (v > acc || v != v) ? (AC) v : acc, (T) acc,                   \
       1, INT64_MIN, acc = v > acc ? (AC) v : acc, (T) acc)                            \
    R (X, REDUCE_MIN, "reduce_min", "ReduceMin", true,                                 \
       INFINITY, acc = (v < acc || v != v) ? (AC) v : acc, (T) acc,                    \
       1, INT64_MAX, acc = v < acc ? (AC) v : acc, (T) acc)                            \
    R (X, REDUCE_PROD, "reduce_prod", "ReduceProd", false,                             \
       1, acc *= (AC) v, (T) acc,                                                      \
       1, 1, acc = (AC) ((uint64_t) acc * (uint64_t) v), (T) acc)                      \
    R (X, REDUCE_L1, "reduce_l1", "ReduceL1", false,                                   \
       0, acc += fabs ((AC) v), (T) acc, 0, _, _, _)                                   \
    R (X, REDUCE_L2, "reduce_l2", "ReduceL2", false,                                   \
       0, acc += (AC) v * (AC) v, (T) sqrt (acc), 0, _, _, _)                          \
    R (X, REDUCE_SUM_SQUARE, "reduce_sum_square", "ReduceSumSquare", false,            \
       0, acc += (AC) v * (AC) v, (T) acc, 0, _, _, _)                                 \
    R (X, REDUCE_LOG_SUM, "reduce_log_sum", "ReduceLogSum", false,                     \
       0, acc += (AC) v, (T) log (acc), 0, _, _, _)

/* Helpers for the lists generated from it. */
#define KILN_REDUCE_KERNEL_ROW(X, id, name, onnx, ex, i0, s0, f0, ints, i1, s1, f1) \
    X (id, name, 1, 1, 1)
#define KILN_REDUCE_ID_ROW(X, id, name, onnx, ex, i0, s0, f0, ints, i1, s1, f1) X (id)

#endif
