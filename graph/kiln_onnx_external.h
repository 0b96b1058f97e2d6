/*
 * kiln_onnx_external — the bytes of ONNX tensors kept in external files.
 *
 * An ONNX tensor with data_location = EXTERNAL holds no bytes itself: its
 * external_data entries name a file (`location`, relative to the
 * directory of the .onnx file) and a byte range in it (`offset`, default
 * 0; `length`, default to the end of the file).  torch and onnx write
 * models over 2 GB this way, since protobuf cannot hold them.
 *
 * A model file is input from outside, so its locations are confined to
 * the model's directory, as the ONNX spec asks: reading one must never
 * pull /etc/shadow or a private key into a weight that is then shipped to
 * a farm.  What the reader guarantees:
 *   - a location is refused, with an error naming the tensor and the
 *     location, when it is empty, absolute, has a ".." component, names
 *     something that after resolving symlinks (realpath) is not inside the
 *     model directory's own realpath, or is not a regular file;
 *   - offset and length are decimal byte counts (no sign, no spaces, at
 *     most 2^64 - 1); the range must lie inside the file (checked without
 *     overflow) and its length must equal the tensor's byte size;
 *   - the bytes are read with pread in chunks of at most KILN_CHUNK_BYTES,
 *     and all external bytes of one model total at most
 *     KILN_MAX_MODEL_BYTES, the bound of the .kgraph that will hold them;
 *   - `checksum` and unknown keys are ignored; a key given twice is an
 *     error, since which one counts would be a guess.
 *
 * The model directory is resolved once, at the first external tensor, so
 * a model without external data costs nothing here.
 */
#ifndef KILN_ONNX_EXTERNAL_H
#define KILN_ONNX_EXTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "common/kiln_error.h"
#include "onnx.pb-c.h"

typedef struct kiln_onnx_external kiln_onnx_external_t;

/* A reader for the external data of a model whose directory is `dir`
 * (copied).  With `dir` NULL or "" the model came from memory and has no
 * directory: every tensor with external data is then refused with an
 * error saying so.  Caller owns the reader and destroys it with
 * kiln_onnx_external_destroy.  NULL with `err` filled in on failure. */
kiln_onnx_external_t *kiln_onnx_external_new (const char *dir, kiln_err_t *err);

/* Destroy the reader and set *self_p to NULL; nothing when it is NULL. */
void kiln_onnx_external_destroy (kiln_onnx_external_t **self_p);

/* Read the bytes of the tensor `name` (for errors: "weight 'name'") that
 * its `n` external_data `entries` place in a file of the model's
 * directory; the tensor's dtype and shape (`what`, e.g. "float32 [2,3]")
 * make `bytes` bytes.  On success *data is a malloc'd buffer of `bytes`
 * bytes (plus one spare, so an empty tensor has a buffer too) that the
 * caller owns; on failure *data is NULL. */
int kiln_onnx_external_read (kiln_onnx_external_t *self, const char *name,
                             Onnx__StringStringEntryProto *const *entries,
                             size_t n, const char *what, uint64_t bytes,
                             uint8_t **data, kiln_err_t *err);

/* The same checks as kiln_onnx_external_read, without reading: on
 * success *fd is the external file, open for reading (the caller closes
 * it), and *offset where the tensor's `bytes` bytes start in it, so that
 * the caller can map them (kiln_graph_map_weight). */
int kiln_onnx_external_open (kiln_onnx_external_t *self, const char *name,
                             Onnx__StringStringEntryProto *const *entries,
                             size_t n, const char *what, uint64_t bytes,
                             int *fd, uint64_t *offset, kiln_err_t *err);

#endif
