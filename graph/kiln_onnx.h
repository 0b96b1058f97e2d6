/*
 * kiln_onnx — import an ONNX model into a kiln graph.
 *
 * This is how a traced model enters kiln: the Python front-end exports it
 * with torch.onnx.export and the client imports the file here.  The result
 * is a graph that kiln_graph_validate has already checked, so every tensor
 * has its dtype and fixed shape.
 *
 * What the importer guarantees:
 *   - the model's default-domain opset is 7..18 and is kept in g->opset;
 *   - initializers and Constant nodes become weight tensors, and Constant
 *     nodes are not emitted as nodes; a graph input that is also an
 *     initializer (older exporters list them in both) is a constant, not
 *     an input, as it is when torch.neuron.trace freezes a module;
 *   - every graph input has a fixed shape: a symbolic or unknown dimension
 *     is refused with an error naming the input and the dimension;
 *   - a model using ops kiln does not know fails with ONE KILN_EUNSUPPORTED
 *     error listing each of them with its count, so a user learns the
 *     whole gap at once ("unsupported ops: NonZero (2), Loop (1)");
 *   - the model's metadata_props entry "kiln.io_structure" (how the
 *     model's inputs and outputs nest, written by kiln.trace) becomes
 *     g->io_structure: at most KILN_MAX_IO_STRUCTURE_BYTES, no NUL byte,
 *     valid UTF-8, else an error naming the key; other keys are ignored;
 *   - a tensor whose bytes live in an external file (ONNX external data)
 *     is read from the model's directory and nowhere else: a location that
 *     is absolute, has "..", or leads outside it through a symlink, a range
 *     past the end of the file, or a length that disagrees with the
 *     tensor's shape is an error naming the tensor
 *     (graph/kiln_onnx_external.h);
 *   - every size read from the file is bounded (kiln_limits.h), and a
 *     malformed or truncated file is a KILN_EFORMAT error, never a crash.
 *
 * Which ops are supported is decided by kiln_graph_op_supported, so that
 * the list lives in one place; the importer only adds the ops it rewrites
 * itself (Constant into weights, Dropout into Identity at inference).
 */
#ifndef KILN_ONNX_H
#define KILN_ONNX_H

#include <stddef.h>
#include <stdint.h>

#include "common/kiln_error.h"
#include "common/kiln_statcache.h"
#include "graph/kiln_graph.h"

#define KILN_ONNX_MIN_OPSET 7     /* oldest default-domain opset accepted */
/* Opsets 1..6 are accepted when every node's op is one whose definition
 * (for what kiln reads of it) did not change by opset 7; the graph then
 * records opset 7 (s_old_ops in kiln_onnx.c, docs/graph-format.md). */
#define KILN_ONNX_OLDEST_OPSET 1
#define KILN_ONNX_MAX_OPSET 18    /* newest default-domain opset accepted */

/* Import the ONNX model file at `path` (at most KILN_MAX_MODEL_BYTES) and
 * validate it; tensors with external data are read from files in the
 * directory of `path`.  Errors are prefixed with the path.  Caller owns
 * the returned graph and must destroy it with kiln_graph_destroy.  NULL
 * with `err` filled in on failure. */
kiln_graph_t *kiln_onnx_import (const char *path, kiln_err_t *err);

/* The same, taking the digests of mapped external-data weights from
 * `cache` when their files are the ones hashed before, and remembering
 * those it hashes (kiln_statcache.h; the caller saves the cache).  With
 * `cache` NULL, kiln_onnx_import. */
kiln_graph_t *kiln_onnx_import_cached (const char *path, kiln_statcache_t *cache,
                                       kiln_err_t *err);

/* Import an ONNX model held in memory (`len` at most KILN_MAX_MODEL_BYTES);
 * `data` is only read, and may be freed once this returns.  The model has
 * no directory, so a tensor with external data is a KILN_EUNSUPPORTED
 * error naming it.  Caller owns the returned graph.  NULL with `err`
 * filled in on failure. */
kiln_graph_t *kiln_onnx_import_mem (const uint8_t *data, size_t len,
                                    kiln_err_t *err);

/* kiln_onnx_import_mem for a model whose external data lives in
 * `base_dir`, as if the bytes had been read from a file there (NULL or
 * "": no directory, as kiln_onnx_import_mem).  For a binding that holds
 * the model's bytes but knows where it came from.  Caller owns the
 * returned graph.  NULL with `err` filled in on failure. */
kiln_graph_t *kiln_onnx_import_mem_dir (const uint8_t *data, size_t len,
                                        const char *base_dir, kiln_err_t *err);

#endif
