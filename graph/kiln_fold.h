/*
 * kiln_fold — compile-time folding of the parts of a graph whose values
 * are known before it runs (docs/graph-format.md, "Folding").
 *
 * kiln compiles for fixed shapes, so Shape and Size are constants, and so
 * is everything computed from constants only: the reshape targets an
 * exported transformer computes from its input's shape, attention masks
 * built with ConstantOfShape/Range/Where, casts and arithmetic on them.
 * kiln_graph_fold evaluates those nodes and turns their outputs into
 * weights, removes what no output needs, and validates the result.  Both
 * the ONNX importer (before its validation) and the builtin compiler
 * (before lowering) call it; on a graph already folded it changes
 * nothing.
 *
 * Invariants after a successful kiln_graph_fold: those of
 * kiln_graph_validate, and no node left in the graph is one that only
 * folding knows (Shape, Size, Range, ConstantOfShape, NonZero, ...).
 */
#ifndef KILN_FOLD_H
#define KILN_FOLD_H

#include "graph/kiln_graph.h"

/* The most elements one folded tensor may hold.  A node whose result
 * would be larger is left to run (or refused when only folding knows its
 * op). */
#define KILN_FOLD_MAX_ELEMS (1 << 20)

/* The budget: one kiln_graph_fold materialises at most KILN_MAX_FOLD_BYTES
 * (common/kiln_limits.h) in all, so that a chain of folded nodes (each
 * output within KILN_FOLD_MAX_ELEMS) cannot make import or compile take
 * gigabytes.  Outputs larger than KILN_FOLD_SMALL_BYTES may use the budget
 * only up to KILN_FOLD_RESERVE_BYTES before its end: the rest is kept for
 * small ones, so that shape arithmetic still folds after big constants
 * have used up their share.  A node past the budget is left to run, like
 * one past KILN_FOLD_MAX_ELEMS; one only folding knows (ConstantOfShape,
 * Range, Shape, Size) is refused with an error naming the node and the
 * budget. */
#define KILN_FOLD_SMALL_BYTES   (64u << 10)
#define KILN_FOLD_RESERVE_BYTES (16u << 20)

/* Fold every node whose value is known at compile time into a weight,
 * drop the nodes no graph output depends on and the weights nothing
 * reads, then validate (kiln_graph_validate).  Returns the number of
 * nodes removed (>= 0) or a negative error naming the node at fault: an
 * op whose output shape depends on run-time data (NonZero, Unique), or a
 * compile-time-only op (Range, ConstantOfShape) whose input is computed
 * at run time.  On failure the graph computes what it computed before,
 * but may be partly folded. */
int kiln_graph_fold (kiln_graph_t *g, kiln_err_t *err);

/* True when folding can evaluate nodes of `op` (given constant inputs;
 * Shape and Size given a known input shape). */
bool kiln_graph_fold_evaluates (const char *op);

/* True for an op whose output shape depends on its input's values
 * (NonZero, Unique, ...): kiln cannot compile it. */
bool kiln_graph_op_data_dependent (const char *op);

#endif
