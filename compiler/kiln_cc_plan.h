/*
 * kiln_cc_plan — memory planning for the builtin compiler (internal).
 *
 * Every arena storage lives from the op that first writes it to the op
 * that last reads it (graph inputs from before the first op, graph
 * outputs to the end of the run).  Storages whose lifetimes do not
 * overlap may share bytes.  The plan is greedy first fit: storages are
 * placed in the order they are defined, each at the lowest 64-byte
 * aligned offset that does not overlap a storage still live when it is
 * defined.  It is not optimal (a later planner may order by size), but it
 * is simple, deterministic and linear in the number of live storages per
 * placement.  At -O0 nothing is shared, which keeps every intermediate
 * tensor inspectable.  A storage with a parent (a Concat's input written
 * in place, kiln_cc_plan_concat) is not placed itself: its tensors lie at
 * its root's offset plus its own offset in the root.
 *
 * Weights are packed into weights.bin in first-use order, each at a
 * 64-byte aligned offset, with zero bytes in between, so that the same
 * graph always gives the same bytes.
 */
#ifndef KILN_CC_PLAN_H
#define KILN_CC_PLAN_H

#include "compiler/kiln_cc_lower.h"

/* Lower Concat `node` along `axis` with no copy when it can be (from -O1):
 * when the output's dimensions before the axis are all 1, each input is
 * one contiguous range of the output, so the storage of each input (its
 * root's, if it already lies in another Concat's output) is made to lie
 * inside the output's, and the producers write there.  It cannot be, and
 * 0 is returned for the caller to copy, when an input is a weight or a
 * graph input (or a view of one), would start at an offset that is not a
 * multiple of KILN_PROG_ALIGN, or would need a buffer it already lies in
 * in two places or overlapping another input's.  Returns 1 when done
 * (the output's program tensor is made), a negative code on error. */
int kiln_cc_plan_concat (kiln_cc_ctx_t *cx, const kiln_node_t *node, int axis,
                         kiln_err_t *err);

/* Place every storage of `cx`, set the offset of every program tensor and
 * the arena size, and build weights.bin: in memory (caller owns *weights,
 * free()) when `spill_fd` is -1, else written into the empty file
 * `spill_fd` from offset 0 (*weights is NULL then): each weight copied
 * from the graph's bytes, whose mapped pages are given back as they are
 * copied, so that a model's weights are never whole in memory. */
int kiln_cc_plan (kiln_cc_ctx_t *cx, int spill_fd, uint8_t **weights, size_t *weights_len,
                  kiln_cc_stats_t *stats, kiln_err_t *err);

#endif
