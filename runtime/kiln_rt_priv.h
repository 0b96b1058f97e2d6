/*
 * kiln_rt_priv — what the runtime's own files share about models and
 * cores; not installed, not for programs.
 */
#ifndef KILN_RT_PRIV_H
#define KILN_RT_PRIV_H

#include <stdint.h>

#include "runtime/kiln_cores.h"
#include "runtime/kiln_rt.h"

/* kiln_model_run's work, in the calling thread: check the inputs, copy
 * them in, run every op, copy the outputs out (under the model's lock).
 * kiln_model_run (kiln_batch.c) sends this to the model's core. */
int kiln_model_run_here (kiln_model_t *m, const kiln_rt_tensor_t *inputs,
                         int n_inputs, kiln_rt_tensor_t *outputs,
                         int n_outputs, kiln_err_t *err);

/* The checks of kiln_model_run_here (counts, dtypes, shapes, buffers),
 * without running. */
int kiln_model_check_run (const kiln_model_t *m, const kiln_rt_tensor_t *inputs,
                          int n_inputs, kiln_rt_tensor_t *outputs, int n_outputs,
                          kiln_err_t *err);

/* A 64-byte aligned, zeroed buffer of `size` bytes (at least one), or
 * NULL.  Caller owns it (free()). */
uint8_t *kiln_rt_aligned_zalloc (uint64_t size);

/* The core set of the runtime the model was loaded into (owned by it). */
kiln_cores_t *kiln_model_cores (const kiln_model_t *m);

/* A pipelined model's stages (kiln_pipeline.h), or NULL; owned by it. */
struct kiln_pipeline *kiln_model_pipeline (const kiln_model_t *m);

/* Run n checked inputs of a pipelined model through its stages, all in
 * flight at once as far as its slots allow: ins[r] and outs[r] are run
 * r's inputs and outputs (manifest order; outputs get dtype and shape). */
int kiln_model_run_pipelined (kiln_model_t *m, const kiln_rt_tensor_t *const *ins,
                              kiln_rt_tensor_t *const *outs, int n, kiln_err_t *err);

#endif
