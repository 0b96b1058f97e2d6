/*
 * kiln_serve_v2 — the KServe v2 / Open Inference Protocol's JSON, as
 * kiln-serve speaks it (docs/serving.md): inference requests decoded
 * into a batch job checked against the model's interface, responses,
 * metadata, the repository index and error bodies.
 *
 * Decoding checks everything about a request against the interface —
 * each input named once, its datatype the model's, its shape the
 * model's (dimension 0 may be 1..max_rows for a batchable model, the
 * same in every input), the number of elements or of binary bytes the
 * shape's — before the job's buffers are allocated, and a cheap count of
 * the body's commas bounds what the JSON parser may allocate to what the
 * interface can hold.  Every refusal is an error whose message names the
 * input and says what was expected and what came.
 *
 * The binary tensor extension: when the request carries an
 * Inference-Header-Content-Length, the body is that many bytes of JSON
 * followed by the raw little-endian bytes of each input whose
 * "parameters" give a "binary_data_size", in the order of the "inputs"
 * array.  Outputs asked for with "parameters": {"binary_data": true} (or
 * every output, with the request's "binary_data_output") come back the
 * same way: the response's JSON names their "binary_data_size", and the
 * bytes follow it.
 */
#ifndef KILN_SERVE_V2_H
#define KILN_SERVE_V2_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kiln_dtype.h"
#include "common/kiln_error.h"
#include "common/kiln_limits.h"
#include "serve/kiln_serve_batch.h"
#include "serve/kiln_serve_repo.h"

#define KILN_SERVE_NAME    "kiln-serve"
#define KILN_SERVE_VERSION "0.1.0"

/* The v2 datatype of each kiln dtype: kiln name, v2 name. */
#define KILN_SERVE_V2_DTYPES(X) \
    X (BOOL,    "BOOL")         \
    X (UINT8,   "UINT8")        \
    X (INT8,    "INT8")         \
    X (INT32,   "INT32")        \
    X (INT64,   "INT64")        \
    X (FLOAT16, "FP16")         \
    X (BFLOAT16, "BF16")        \
    X (FLOAT32, "FP32")         \
    X (FLOAT64, "FP64")

/* "FP32" for KILN_DT_FLOAT32; NULL for a dtype v2 has no name for. */
const char *kiln_serve_v2_dtype_name (kiln_dtype_t dt);
/* KILN_DT_FLOAT32 for "FP32"; KILN_DT_UNDEFINED for anything else. */
kiln_dtype_t kiln_serve_v2_dtype_parse (const char *name);

/* A decoded inference request. */
typedef struct kiln_serve_v2_request {
    char id[KILN_SERVE_MAX_REQUEST_ID + 1];   /* echoed back when has_id */
    bool has_id;
    kiln_serve_job_t *job;          /* owned; its inputs filled */
    int n_outputs;                  /* the model's */
    bool *want;                     /* per model output: in the response */
    bool *binary;                   /* per model output: as binary data */
} kiln_serve_v2_request_t;

/* Decode a POST .../infer body of `len` bytes whose first `json_len` are
 * JSON (json_len == len without the binary extension) against `iface`.
 * KILN_EFORMAT, KILN_ESHAPE or KILN_ELIMIT for a request the server
 * answers with 400 (req->job is then NULL).  Release `req` with
 * kiln_serve_v2_request_release, also on error. */
int kiln_serve_v2_decode_infer (const kiln_serve_iface_t *iface, const uint8_t *body,
                                size_t len, size_t json_len, kiln_serve_v2_request_t *req,
                                kiln_err_t *err);
void kiln_serve_v2_request_release (kiln_serve_v2_request_t *req);

/* The response to `req`, whose job has run, for model `model` at
 * `version`.  Caller owns *out (free()); *json_len is the length of its
 * JSON, *len of the whole (they differ when an output is binary). */
int kiln_serve_v2_encode_infer (const kiln_serve_iface_t *iface,
                                const kiln_serve_v2_request_t *req, const char *model,
                                uint64_t version, uint8_t **out, size_t *len,
                                size_t *json_len, kiln_err_t *err);

/* {"error": "<msg>"}.  Caller owns the result (free()); NULL only when
 * out of memory. */
char *kiln_serve_v2_error (const char *msg, size_t *len);

/* GET /v2/models/{name}: the model's metadata, with kiln's extension
 * field "kiln" (the version serving, its release, the last refusal).
 * Caller owns *out. */
int kiln_serve_v2_model_metadata (const kiln_serve_model_status_t *st, char **out,
                                  size_t *len, kiln_err_t *err);
/* POST /v2/repository/index: every model, its version and state. */
int kiln_serve_v2_repository_index (kiln_serve_repo_t *repo, char **out, size_t *len,
                                    kiln_err_t *err);
/* GET /v2: the server's name, version and extensions. */
int kiln_serve_v2_server_metadata (char **out, size_t *len, kiln_err_t *err);

#endif
