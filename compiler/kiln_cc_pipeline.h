/*
 * kiln_cc_pipeline — cutting a program into pipeline stages
 * (--pipeline-cores N, internal to the compiler).
 *
 * The program is lowered and planned as for one core; the cut only adds
 * where each stage starts and which arena bytes each stage receives from
 * the one before (program.kbin "stages", docs/program-format.md).  So a
 * pipelined program runs the very kernels, on the very offsets, of the
 * unpipelined one, and one input alone gives the same bits.
 *
 * The cut makes the stages' costs as even as it can: it minimises the
 * most expensive stage (the pipeline's throughput is one input per
 * slowest stage), where a stage's cost is its ops' cost by the model of
 * common/kiln_cost.h plus the copies of the bytes handed to it and from
 * it.  Stages are contiguous runs of ops, at least one op each.
 */
#ifndef KILN_CC_PIPELINE_H
#define KILN_CC_PIPELINE_H

#include "artifact/kiln_artifact.h"
#include "compiler/kiln_cc_lower.h"

/* Cut the lowered and planned program of `cx` (kiln_cc_plan has run)
 * into `n` stages, 2..KILN_MAX_PIPELINE_STAGES: sets cx->prog->stages and
 * fills info[n] for the manifest.  An error names the flag when the
 * program has fewer ops than stages. */
int kiln_cc_pipeline_cut (kiln_cc_ctx_t *cx, int n, kiln_stage_info_t *info,
                          kiln_err_t *err);

#endif
