/*
 * kiln_rt_priv — what the runtime's own files share about models and
 * cores; not installed, not for programs.
 */
#ifndef KILN_RT_PRIV_H
#define KILN_RT_PRIV_H

#include "runtime/kiln_cores.h"
#include "runtime/kiln_rt.h"

/* kiln_model_run's work, in the calling thread: check the inputs, copy
 * them in, run every op, copy the outputs out (under the model's lock).
 * kiln_model_run (kiln_batch.c) sends this to the model's core. */
int kiln_model_run_here (kiln_model_t *m, const kiln_rt_tensor_t *inputs,
                         int n_inputs, kiln_rt_tensor_t *outputs,
                         int n_outputs, kiln_err_t *err);

/* The core set of the runtime the model was loaded into (owned by it). */
kiln_cores_t *kiln_model_cores (const kiln_model_t *m);

#endif
