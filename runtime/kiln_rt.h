/*
 * kiln_rt — libkilnrt, the runtime on inference hosts.
 *
 * A model is loaded only after its artifact's signature has been checked
 * against a keyring and every member's digest against the manifest
 * (kiln_artifact_open_verified); a tampered artifact is never run.  The
 * runtime links neither the graph IR nor the compiler: it reads the
 * program the compiler emitted (docs/program-format.md) and runs it with
 * its own CPU kernels.
 */
#ifndef KILN_RT_H
#define KILN_RT_H

#include <stddef.h>
#include <stdint.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_dtype.h"
#include "common/kiln_error.h"

typedef struct kiln_rt kiln_rt_t;
typedef struct kiln_model kiln_model_t;

/* A tensor handed to or returned from kiln_model_run: a view, the caller
 * owns `data`. */
typedef struct kiln_rt_tensor {
    kiln_dtype_t dtype;
    kiln_shape_t shape;
    void *data;
} kiln_rt_tensor_t;

/* Create a runtime.  Caller owns it; destroy after its models. */
kiln_rt_t *kiln_rt_new (kiln_err_t *err);
void kiln_rt_destroy (kiln_rt_t **self_p);

/* Verify the artifact at `path` against `keyring_dir` and load it.
 * Caller owns the model. */
kiln_model_t *kiln_rt_load (kiln_rt_t *rt, const char *path,
                            const char *keyring_dir, kiln_err_t *err);
void kiln_model_destroy (kiln_model_t **self_p);

/* The model's manifest (inputs, outputs, digests); owned by the model. */
const kiln_manifest_t *kiln_model_manifest (const kiln_model_t *m);

/* Run once.  `inputs` in manifest order, each matching the manifest's
 * dtype and shape exactly (an error names the input, the expected and the
 * received shape/dtype); `outputs[i].data` must point to a buffer of the
 * output's size, the runtime fills dtype and shape. */
int kiln_model_run (kiln_model_t *m, const kiln_rt_tensor_t *inputs,
                    int n_inputs, kiln_rt_tensor_t *outputs, int n_outputs,
                    kiln_err_t *err);

#endif
