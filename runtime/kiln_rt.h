/*
 * kiln_rt — libkilnrt, the runtime on inference hosts.
 *
 * A model is loaded only after its artifact's signature has been checked
 * against a keyring and every member's digest against the manifest
 * (kiln_artifact_read_fd, then kiln_artifact_verify: runtime/
 * kiln_artcache.h); a tampered artifact is never run.  The
 * runtime links neither the graph IR nor the compiler: it reads the
 * program the compiler emitted (docs/program-format.md) and runs it with
 * its own CPU kernels.
 *
 * A runtime owns execution cores (runtime/kiln_cores.h): each model is
 * placed on one, round-robin, and every run of it executes on that core's
 * pinned thread; kiln_model_run_batched spreads a batch of any size over
 * replicas on several cores (dynamic batching); a pipelined model's
 * stages run on consecutive cores (runtime/kiln_pipeline.h).
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

/* Create a runtime with its execution cores: the CPUs listed in
 * KILN_RT_VISIBLE_CORES ("0-3", "0,2"), the first KILN_RT_NUM_CORES of
 * them, by default every CPU the process may run on; a bad value is an
 * error.  Caller owns it.  Each model holds a reference to its runtime,
 * so models and runtime may be destroyed in any order. */
kiln_rt_t *kiln_rt_new (kiln_err_t *err);
void kiln_rt_destroy (kiln_rt_t **self_p);

/* The process-wide runtime, created (as kiln_rt_new does) on the first
 * call that succeeds; later calls return the same one, from any thread.
 * Every binding in a process (ctypes, the TorchScript extension) loads
 * through it, so that they share one set of cores and one round-robin
 * placement.  The caller does not own it: it lives until the process
 * exits, and kiln_rt_destroy on it only NULLs the caller's pointer.  When
 * creating it fails, NULL with `err` filled in, and the next call tries
 * again. */
kiln_rt_t *kiln_rt_shared (kiln_err_t *err);

/* Number of execution cores (>= 1), and the CPU core i's thread is pinned
 * to (-1 when there is no core i). */
int kiln_rt_num_cores (const kiln_rt_t *rt);
int kiln_rt_core_cpu (const kiln_rt_t *rt, int core);

/* Verify the artifact at `path` against `keyring_dir` and load it.
 * Caller owns the model.
 *
 * An artifact of up to 1 GiB (an eighth of the host's memory when that
 * is less) is read into memory on advised huge pages, hashed as it is
 * read; a larger one's weights (or any artifact's, KILN_RT_MMAP=1) are
 * pages mapped read-only from the file (whose members the archive lays
 * out page-aligned), hashed as they are mapped.  Either way every model a
 * runtime loads from the same unchanged file — replicas for dynamic
 * batching, DataParallel, kiln-serve --replicas — shares that one copy or
 * mapping, so N replicas hold the weights once.  A file that users other
 * than this process's and root may change, one written before members
 * were aligned, or any file when KILN_RT_MMAP=0 is read into memory.
 * What holds when the file is changed while loaded:
 * docs/artifact-format.md, "Mapped members". */
kiln_model_t *kiln_rt_load (kiln_rt_t *rt, const char *path,
                            const char *keyring_dir, kiln_err_t *err);
void kiln_model_destroy (kiln_model_t **self_p);

/* Placement (seed 001): kiln_rt_load puts each model on the next core,
 * round-robin, and all its runs execute on a thread pinned to that core,
 * so models on different cores run concurrently.  kiln_rt_load_on puts
 * it on core `core` (0..kiln_rt_num_cores - 1; -1: round-robin).  Caller
 * owns the model. */
kiln_model_t *kiln_rt_load_on (kiln_rt_t *rt, const char *path,
                               const char *keyring_dir, int core,
                               kiln_err_t *err);
/* The core the model runs on (a pipelined model's first stage's). */
int kiln_model_core (const kiln_model_t *m);

/* Pipelining (compiled with --pipeline-cores N, docs/program-format.md):
 * the model's program runs as N stages, stage s on core (core + s) mod
 * the runtime's cores, each in an arena of its own; consecutive inputs
 * (concurrent kiln_model_run calls, the chunks of kiln_model_run_batched)
 * are in different stages at once, handed from stage to stage through a
 * bounded number of slots (2·N).  A pipelined model takes N turns of the
 * round-robin placement; loading it on a runtime with fewer than N cores
 * is a KILN_EUNSUPPORTED error that says so, unless
 * KILN_RT_PIPELINE_SHARE=1 lets its stages share the cores.  The number
 * of stages (1 for a model that is not pipelined), and the core of stage
 * s (-1 when there is no stage s). */
int kiln_model_stage_count (const kiln_model_t *m);
int kiln_model_stage_core (const kiln_model_t *m, int stage);

/* The model's manifest (inputs, outputs, digests); owned by the model. */
const kiln_manifest_t *kiln_model_manifest (const kiln_model_t *m);
/* The artifact's content hash (SHA-256 of its manifest.json, the digest
 * `kiln compile` prints and `kiln get` takes), as hex into `out`. */
int kiln_model_digest (const kiln_model_t *m, char out[KILN_HEX_LEN],
                       kiln_err_t *err);

/* Run once.  `inputs` in manifest order, each matching the manifest's
 * dtype and shape exactly (an error names the input, the expected and the
 * received shape/dtype); `outputs[i].data` must point to a buffer of the
 * output's size, the runtime fills dtype and shape. */
int kiln_model_run (kiln_model_t *m, const kiln_rt_tensor_t *inputs,
                    int n_inputs, kiln_rt_tensor_t *outputs, int n_outputs,
                    kiln_err_t *err);

/* Dynamic batching (seed 001).  The batch a model was compiled for: the
 * size of dimension 0, which every input and output must share; an error
 * (KILN_EUNSUPPORTED, naming the tensor) when the model cannot be batched
 * that way. */
int64_t kiln_model_batch_size (const kiln_model_t *m, kiln_err_t *err);

/* Run inputs whose dimension 0 (the same in every input) is any size N:
 * they are split along it into chunks of the compiled batch, the last
 * chunk padded with zeros, the chunks run on `replicas` (models loaded
 * from the same artifact, ideally on different cores) round-robin and
 * concurrently, and each output joined and trimmed to N in dimension 0.
 * `outputs[i].data` must hold the output's size with N in dimension 0;
 * the runtime fills dtype and shape.  An input whose dtype, rank or any
 * other dimension differs from the compiled one, or inputs that differ in
 * dimension 0, are a KILN_ESHAPE error naming the input. */
int kiln_model_run_batched (kiln_model_t *const *replicas, int n_replicas,
                            const kiln_rt_tensor_t *inputs, int n_inputs,
                            kiln_rt_tensor_t *outputs, int n_outputs,
                            kiln_err_t *err);

/* Interface of a model for bindings that cannot read kiln_manifest_t
 * (ctypes): the number of inputs (outputs when `output`), and the name
 * (owned by the model), dtype and shape of the i-th.  Returns its rank,
 * or a negative error when there is no such tensor. */
int kiln_model_io_count (const kiln_model_t *m, int output);
int kiln_model_io (const kiln_model_t *m, int output, int i,
                   const char **name, int *dtype,
                   int64_t dims[KILN_MAX_RANK], kiln_err_t *err);
/* How the model's inputs and outputs nest (tuples, lists, dicts of
 * tensors): the manifest's io_structure, JSON text written by kiln.trace,
 * or NULL when the artifact has none.  Owned by the model. */
const char *kiln_model_io_structure (const kiln_model_t *m);
/* Introspection, for tests and diagnostics: the address of the model's
 * weights (the first byte of its weights.bin; replicas sharing them give
 * the same address), and 1 when they are pages mapped from the artifact
 * file, 0 when they were read into memory.  Owned by the model (and the
 * replicas sharing them); read-only. */
const void *kiln_model_weights_ptr (const kiln_model_t *m);
int kiln_model_weights_mapped (const kiln_model_t *m);

/* sizeof (kiln_rt_tensor_t) and sizeof (kiln_err_t), for bindings to
 * check their copies of the layouts against. */
size_t kiln_rt_tensor_sizeof (void);
size_t kiln_rt_err_sizeof (void);

#endif
