/*
 * kiln_ops_unary — the float elementwise ops with one input, one row each.
 *
 * A row is the whole definition of such an op: the program kernel's id
 * and name, the ONNX op it implements, up to two float attributes (their
 * ONNX names, which are also the program parameters' names, and ONNX's
 * defaults) and the expression of one element `x` of type T (float or
 * double; <tgmath.h> picks sin or sinf), with A and B the attributes.
 * From this list are generated: the kernel list (common/kiln_program.h),
 * the graph's inference table (graph/kiln_graph_infer.c), the compiler's
 * lowering table (compiler/kiln_cc_lower.c, kiln_lower_math.c) and the
 * runtime's loops, dtype tables and parameter checks
 * (runtime/kiln_kernels_math.c).  Adding such an op is adding a row here
 * (docs/engine.md, "Adding an op").
 *
 * U is called as U (X, id, name, onnx, a_name, a_default, b_name,
 * b_default, expr); X is passed through for the user's own use.
 */
#ifndef KILN_OPS_UNARY_H
#define KILN_OPS_UNARY_H

#define KILN_UNARY_OPS(U, X)                                                      \
    U (X, SIN,   "sin",   "Sin",   NULL, 0, NULL, 0, sin (x))                     \
    U (X, COS,   "cos",   "Cos",   NULL, 0, NULL, 0, cos (x))                     \
    U (X, TAN,   "tan",   "Tan",   NULL, 0, NULL, 0, tan (x))                     \
    U (X, ASIN,  "asin",  "Asin",  NULL, 0, NULL, 0, asin (x))                    \
    U (X, ACOS,  "acos",  "Acos",  NULL, 0, NULL, 0, acos (x))                    \
    U (X, ATAN,  "atan",  "Atan",  NULL, 0, NULL, 0, atan (x))                    \
    U (X, SINH,  "sinh",  "Sinh",  NULL, 0, NULL, 0, sinh (x))                    \
    U (X, COSH,  "cosh",  "Cosh",  NULL, 0, NULL, 0, cosh (x))                    \
    U (X, ASINH, "asinh", "Asinh", NULL, 0, NULL, 0, asinh (x))                   \
    U (X, ACOSH, "acosh", "Acosh", NULL, 0, NULL, 0, acosh (x))                   \
    U (X, ATANH, "atanh", "Atanh", NULL, 0, NULL, 0, atanh (x))                   \
    /* to nearest, ties to even (the default rounding mode) */                   \
    U (X, ROUND, "round", "Round", NULL, 0, NULL, 0, nearbyint (x))               \
    /* 0 and NaN stay what they are */                                           \
    U (X, SIGN,  "sign",  "Sign",  NULL, 0, NULL, 0,                              \
       (x) > 0 ? (T) 1 : (x) < 0 ? (T) -1 : (x))                                  \
    U (X, THRESHOLDED_RELU, "thresholded_relu", "ThresholdedRelu", "alpha", 1.0,  \
       NULL, 0, (x) > A ? (x) : (T) 0)                                            \
    U (X, SHRINK, "shrink", "Shrink", "lambd", 0.5, "bias", 0.0,                  \
       (x) < -A ? (x) + B : (x) > A ? (x) - B : (T) 0)

/* Helpers for the lists generated from it. */
#define KILN_UNARY_KERNEL_ROW(X, id, name, onnx, an, ad, bn, bd, expr) X (id, name, 1, 1, 1)
#define KILN_UNARY_ID_ROW(X, id, name, onnx, an, ad, bn, bd, expr) X (id)

#endif
