/*
 * kiln_cc_fuse — the graph-level passes the lowering relies on (internal
 * to the compiler): dead-node removal and the fusion plan.
 *
 * Nothing in the graph is rewritten: the pass marks nodes to skip
 * (cx->skip) and records, for each Conv, Gemm and MatMul, the nodes after
 * it whose work its kernel takes over (cx->fusion); the lowering of that
 * node then emits one op writing the last of their outputs.
 *
 *   -O1  dead nodes (no output reaches a graph output) are dropped, and a
 *        BatchNormalization whose input is a Conv or a Gemm with constant
 *        weights (and a Gemm's C one value per column) is folded into
 *        those weights;
 *   -O2  also, after a Conv, Gemm or MatMul, in this order: a constant
 *        bias of n (MatMul), a residual Add of a tensor of the same shape
 *        computed before the product, and a Relu, Clip (constant bounds)
 *        or LeakyRelu.  Before a MatMul, the chain of views (Transpose,
 *        Slice, reshapes) and Mul / Div by a constant scalar that made an
 *        operand, when the operand is then a strided view of the chain's
 *        input with a contiguous last axis: the product reads it through
 *        strides and scales by alpha; after one with nothing else fused,
 *        a Transpose keeping the last axis last: the product writes
 *        through strides.  A Transpose whose input is such a view of
 *        another tensor copies from that tensor.  Before a pointwise Conv (1×1,
 *        stride 1, unpadded, one group, constant weights), the
 *        BatchNormalization, or BatchNormalization and Relu, that made its
 *        input: the Conv reads the BatchNormalization's input and applies
 *        both per channel as it packs it (a prologue).  Attention's
 *        MatMul → [Mul / Div by a constant scalar] → [Add of a mask] →
 *        Softmax over the last axis → MatMul is one attention op,
 *        emitted where the second MatMul was (its Q and K through their
 *        views, K's transpose too, and V's).
 *
 * A node is taken over only when the tensor between the two is read by
 * that node alone and is not a graph output, so no intermediate anyone
 * else needs disappears; and a residual only when it exists by the time
 * the product runs, where the fused op is emitted.
 */
#ifndef KILN_CC_FUSE_H
#define KILN_CC_FUSE_H

#include "compiler/kiln_cc_lower.h"

/* Fill cx->skip and cx->fusion for cx->g at cx->opts.optlevel. */
int kiln_cc_fuse (kiln_cc_ctx_t *cx, kiln_err_t *err);

#endif
