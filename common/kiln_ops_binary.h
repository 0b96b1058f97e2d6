/*
 * kiln_ops_binary — the broadcasting binary ops with a boolean result
 * (comparisons and logical ops), one row each.
 *
 * A row is the whole definition of such an op: the program kernel's id
 * and name, the ONNX op, its kind — `compare` (float, integer and bool
 * operands of one dtype) or `logical` (bool operands) — and the
 * expression of one result from the elements `a` and `b`.  From this
 * list are generated: the kernel list (common/kiln_program.h), the
 * graph's inference table (graph/kiln_graph_infer.c: kiln_infer_<kind>),
 * the compiler's lowering table (compiler/kiln_cc_lower.c: broadcast)
 * and the runtime's loops for every dtype of the kind, their dtype table
 * and dispatch (runtime/kiln_kernels_math.c).  Adding such an op is
 * adding a row here (docs/engine.md, "Adding an op").
 *
 * B is called as B (X, id, name, onnx, kind, expr).
 */
#ifndef KILN_OPS_BINARY_H
#define KILN_OPS_BINARY_H

#define KILN_BINARY_OPS(B, X)                                                      \
    B (X, EQUAL,         "equal",         "Equal",          compare, (a) == (b))   \
    B (X, LESS,          "less",          "Less",           compare, (a) < (b))    \
    B (X, GREATER,       "greater",       "Greater",        compare, (a) > (b))    \
    B (X, LESS_EQUAL,    "less_equal",    "LessOrEqual",    compare, (a) <= (b))   \
    B (X, GREATER_EQUAL, "greater_equal", "GreaterOrEqual", compare, (a) >= (b))   \
    B (X, AND,           "and",           "And",  logical, ((a) != 0) & ((b) != 0)) \
    B (X, OR,            "or",            "Or",   logical, ((a) != 0) | ((b) != 0)) \
    B (X, XOR,           "xor",           "Xor",  logical, ((a) != 0) ^ ((b) != 0))

/* Helpers for the lists generated from it. */
#define KILN_BINARY_KERNEL_ROW(X, id, name, onnx, kind, expr) X (id, name, 2, 2, 1)
#define KILN_BINARY_ID_ROW(X, id, name, onnx, kind, expr) X (id)

#endif
