/*
 * kiln_capi — flat entry points of libkilnclient for bindings that cannot
 * read kiln's structs (Python's ctypes, used by kiln.trace): only
 * pointers, integers, strings and kiln_err_t cross this boundary, and
 * structured answers come back as JSON text in a caller's buffer of
 * bounded size.
 *
 * The flow kiln.trace drives: ONNX bytes -> kiln_capi_import_onnx (a
 * validated kiln graph, or one error listing every unsupported op) ->
 * kiln_capi_compile (on the farm when a broker is given, else in-process
 * with the builtin compiler, signed with the user's key) -> an artifact
 * file that libkilnrt verifies and loads.  The dumps write the two IRs as
 * text for compiler_workdir.
 */
#ifndef KILN_CAPI_H
#define KILN_CAPI_H

#include <stddef.h>
#include <stdint.h>

#include "common/kiln_error.h"
#include "graph/kiln_graph.h"

/* Import `len` bytes of ONNX (kiln_onnx_import_mem).  A model with
 * external data is refused: it needs kiln_capi_import_onnx_dir.  Caller
 * owns the graph and frees it with kiln_capi_graph_free. */
kiln_graph_t *kiln_capi_import_onnx (const uint8_t *data, size_t len,
                                     kiln_err_t *err);

/* Import `len` bytes of ONNX whose external data files are in `base_dir`
 * (kiln_onnx_import_mem_dir: confined to that directory; NULL or "" is
 * kiln_capi_import_onnx).  Caller owns the graph and frees it with
 * kiln_capi_graph_free. */
kiln_graph_t *kiln_capi_import_onnx_dir (const uint8_t *data, size_t len,
                                         const char *base_dir, kiln_err_t *err);
void kiln_capi_graph_free (kiln_graph_t *g);

/* Write the graph as a .kgraph file (structure and weights). */
int kiln_capi_graph_save (const kiln_graph_t *g, const char *path,
                          kiln_err_t *err);

/* {"digest": hex, "opset": n, "nodes": n, "weights_bytes": n,
 *  "inputs": [{"name", "dtype", "shape"}], "outputs": [...],
 *  "ops": {"Conv": 20, ...}} into json[size]; an answer that does not fit
 * is a KILN_ELIMIT error. */
int kiln_capi_graph_info (const kiln_graph_t *g, char *json, size_t size,
                          kiln_err_t *err);

/* The graph IR as text, one line per node, written to `path`. */
int kiln_capi_graph_dump (const kiln_graph_t *g, const char *path,
                          kiln_err_t *err);

/* The program IR of the artifact at `artifact_path` as text (tensors with
 * their placement, ops with their parameters), written to `path`.  The
 * artifact's member digests are checked, not its signature: this is for
 * looking at a build, not for running it. */
int kiln_capi_program_dump (const char *artifact_path, const char *path,
                            kiln_err_t *err);

/* Compile `g` into a signed artifact at `out_path`: on the farm at
 * `broker` when it is not NULL or empty (waiting at most `timeout_ms`,
 * 0 = the library's default; a timeout is KILN_ETIMEOUT), else
 * in-process, signed with the private key at `key_path` (NULL: the
 * user's key, created on first use).  `compiler_args` may be NULL.
 * Answers {"artifact", "action_key", "graph_digest", "cached", "worker"}
 * in json[size]. */
int kiln_capi_compile (kiln_graph_t *g, const char *broker,
                       const char *compiler_args, long timeout_ms,
                       const char *key_path, const char *out_path,
                       char *json, size_t size, kiln_err_t *err);

/* kiln_capi_compile with progress: `fn` (may be NULL) gets each event of
 * a farm compile as compact JSON, {"phase": "upload"|"queued"|"running"|
 * "done", and what the phase has: "sent_bytes", "total_bytes",
 * "position", "queued", "running", "worker", "elapsed_ms",
 * "estimate_ms", "eta_ms"}, on the calling thread, while the call runs;
 * the broker is asked where the job is every second. */
typedef void (kiln_capi_progress_fn) (const char *json, void *arg);
int kiln_capi_compile_progress (kiln_graph_t *g, const char *broker,
                                const char *compiler_args, long timeout_ms,
                                const char *key_path, const char *out_path,
                                kiln_capi_progress_fn *fn, void *arg,
                                char *json, size_t size, kiln_err_t *err);

/* The user's kiln configuration directory (kiln_config_dir): local
 * builds are signed with the key in its keys/ folder. */
int kiln_capi_config_dir (char *buf, size_t size, kiln_err_t *err);

#endif
