/*
 * kiln_cost — the cost model of a program's ops: what the compiler cuts a
 * program into pipeline stages by (compiler/kiln_cc_pipeline.c) and what
 * the runtime's profiler reports beside the times it measured
 * (runtime/kiln_exec.c), so that the two can be compared.
 *
 * An op costs its arithmetic (the multiply-adds of a convolution or a
 * matrix product, counted as 2 FLOP each, as the profiler's GFLOP/s
 * always were) plus the bytes it reads and writes (every operand, weights
 * included, and every result).  The estimate in nanoseconds divides each
 * by one core's rate: KILN_COST_FLOPS_PER_NS for arithmetic,
 * KILN_COST_BYTES_PER_NS for memory traffic, measured on the development
 * VM (docs/program-format.md, "Pipeline stages").  Only ratios matter for
 * cutting: a faster machine scales every stage alike.
 *
 * The model reads nothing but the program (shapes and parameters), so
 * that the compiler, which does not link the runtime, and the runtime
 * compute the same numbers.
 */
#ifndef KILN_COST_H
#define KILN_COST_H

#include "common/kiln_program.h"

#define KILN_COST_FLOPS_PER_NS  100.0   /* 100 GFLOP/s: a product on one core */
#define KILN_COST_BYTES_PER_NS  8.0     /* 8 GB/s: elementwise and data movement */

typedef struct kiln_cost {
    double flops;           /* arithmetic, 2 per multiply-add */
    double bytes;           /* operands and results */
} kiln_cost_t;

/* The cost of op `op` of `p` (which kiln_program_check accepted). */
kiln_cost_t kiln_cost_op (const kiln_program_t *p, int op);

/* The estimate of `c` in nanoseconds on one core. */
double kiln_cost_ns (kiln_cost_t c);

#endif
