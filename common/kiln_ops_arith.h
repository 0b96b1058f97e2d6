/*
 * kiln_ops_arith — the broadcasting arithmetic ops (Add, Sub, Mul, Div,
 * Pow, PRelu, Mod, the variadic Max, Min, Sum and Mean) and ArgMax /
 * ArgMin, one row each.
 *
 * A row says everything the layers need to know of such an op but its
 * functions: the program kernel's id and name, the ONNX op, its input
 * counts (the fewest; the most a graph node may have; the most the
 * kernel takes), the graph's inference function
 * (graph/kiln_infer_math.h: kiln_infer_<infer>), the compiler's lowering
 * function (compiler/kiln_lower_math.h), whether a half output needs no
 * rounding after it (`exact`: it is one of the inputs' values), and the
 * runtime's prepare step, which checks the operands, picks the loop and
 * sets plan->run (runtime/kiln_kernels_priv.h, kiln_kernels_math_priv.h).
 * From this list are generated: the kernel list (common/kiln_program.h),
 * the graph's inference table (graph/kiln_graph_infer.c), the compiler's
 * lowering table (compiler/kiln_cc_lower.c) and the runtime's kernel
 * table (runtime/kiln_kernels.c).  Adding such an op is a row here and
 * its functions (docs/engine.md, "Adding an op").
 *
 * A is called as A (X, id, name, onnx, in_min, node_in_max, kernel_in_max,
 * infer, lower, exact, prepare).
 */
#ifndef KILN_OPS_ARITH_H
#define KILN_OPS_ARITH_H

#define KILN_ARITH_OPS(A, X)                                                                \
    A (X, ADD,    "add",    "Add",    2, 2, 2, arith, kiln_lower_math_arith, false,           \
       kiln_kprepare_arith)                                                                 \
    A (X, SUB,    "sub",    "Sub",    2, 2, 2, arith, kiln_lower_math_arith, false,           \
       kiln_kprepare_arith)                                                                 \
    A (X, MUL,    "mul",    "Mul",    2, 2, 2, arith, kiln_lower_math_arith, false,           \
       kiln_kprepare_arith)                                                                 \
    A (X, DIV,    "div",    "Div",    2, 2, 2, arith, kiln_lower_math_arith, false,           \
       kiln_kprepare_arith)                                                                 \
    A (X, POW,    "pow",    "Pow",    2, 2, 2, pow, kiln_lower_math_broadcast, false,         \
       kiln_km_prep_broadcast)                                                              \
    A (X, PRELU,  "prelu",  "PRelu",  2, 2, 2, prelu, kiln_lower_math_broadcast, false,       \
       kiln_km_prep_broadcast)                                                              \
    /* fmod=1 lowers to the kernel fmod (common/kiln_program.h) */                          \
    A (X, MOD,    "mod",    "Mod",    2, 2, 2, arith, kiln_lower_math_mod, false,             \
       kiln_km_prep_broadcast)                                                              \
    A (X, MAX,    "max",    "Max",    1, KILN_MAX_NODE_IO, KILN_PROG_MAX_OP_IO, variadic,     \
       kiln_lower_math_broadcast, true, kiln_km_prep_broadcast)                             \
    A (X, MIN,    "min",    "Min",    1, KILN_MAX_NODE_IO, KILN_PROG_MAX_OP_IO, variadic,     \
       kiln_lower_math_broadcast, true, kiln_km_prep_broadcast)                             \
    A (X, SUM,    "sum",    "Sum",    1, KILN_MAX_NODE_IO, KILN_PROG_MAX_OP_IO, variadic,     \
       kiln_lower_math_broadcast, false, kiln_km_prep_broadcast)                            \
    A (X, MEAN,   "mean",   "Mean",   1, KILN_MAX_NODE_IO, KILN_PROG_MAX_OP_IO, variadic,     \
       kiln_lower_math_broadcast, false, kiln_km_prep_broadcast)                            \
    A (X, ARGMAX, "argmax", "ArgMax", 1, 1, 1, arg, kiln_lower_math_arg, false,               \
       kiln_km_prep_arg)                                                                    \
    A (X, ARGMIN, "argmin", "ArgMin", 1, 1, 1, arg, kiln_lower_math_arg, false,               \
       kiln_km_prep_arg)

/* Helpers for the lists generated from it. */
#define KILN_ARITH_KERNEL_ROW(X, id, name, onnx, lo, nhi, khi, inf, low, ex, prep) \
    X (id, name, lo, khi, 1)

#endif
