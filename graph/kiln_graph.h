/*
 * kiln_graph — the kiln graph IR, version 1.
 *
 * A graph is a list of tensors (dtype + fixed shape), a list of nodes
 * (op, input and output tensor indices, attributes), the graph's named
 * inputs and outputs, and weight blobs: the data of constant tensors,
 * kept apart from the structure and addressed by SHA-256.
 *
 * Unlike kiln's other types, kiln_graph_t is transparent: the importer
 * builds it and the compiler's passes walk and rewrite it, and hiding its
 * arrays behind accessors would make every pass harder to read.  The
 * functions below keep its invariants; code that edits the arrays directly
 * must keep them too:
 *   - every index in nodes[].inputs/outputs, inputs[], outputs[] is a
 *     valid tensor index (an optional node input may be -1);
 *   - a tensor is produced by at most one node, and a graph input or a
 *     weight-backed tensor by none;
 *   - tensors[i].weight is -1 or a valid index into weights[];
 *   - nodes are in topological order once kiln_graph_validate succeeds;
 *   - io_structure is NULL or a non-empty, NUL-free UTF-8 text of at most
 *     KILN_MAX_IO_STRUCTURE_BYTES bytes (set it with
 *     kiln_graph_set_io_structure, which checks).
 *
 * io_structure is how the model's inputs and outputs nest (tuples, lists,
 * dicts of tensors), as JSON text written by kiln.trace and carried from
 * the ONNX file's metadata to the artifact's manifest, so that a loader
 * can hand outputs back in the shape the model returned them.  kiln does
 * not parse it.
 *
 * The graph digest is the SHA-256 of the canonical encoding: nodes in
 * their (topological) order, tensors renumbered by first use, node and
 * internal tensor names dropped, attributes sorted by name, weights by
 * digest.  Graph input and output names are kept: they are the model's
 * interface, and so is the I/O structure when the graph has one (a graph
 * without it has the digest it had before the field existed).  So the
 * same model exported twice, or with internal names changed, has the
 * same digest, and changing one weight byte changes it.
 */
#ifndef KILN_GRAPH_H
#define KILN_GRAPH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kiln_dtype.h"
#include "common/kiln_error.h"
#include "common/kiln_hash.h"
#include "common/kiln_map.h"

#define KILN_GRAPH_FORMAT_VERSION 1

typedef enum {
    KILN_ATTR_INT = 1,      /* i */
    KILN_ATTR_FLOAT = 2,    /* f */
    KILN_ATTR_STRING = 3,   /* s (NUL-terminated) */
    KILN_ATTR_INTS = 4,     /* ints[n] */
    KILN_ATTR_FLOATS = 5,   /* floats[n] */
} kiln_attr_kind_t;

typedef struct kiln_attr {
    char *name;             /* attribute name, owned */
    kiln_attr_kind_t kind;  /* which of the value fields below is set */
    int64_t i;              /* KILN_ATTR_INT */
    double f;               /* KILN_ATTR_FLOAT (stored as float32 value) */
    char *s;                /* KILN_ATTR_STRING, owned */
    int64_t *ints;          /* KILN_ATTR_INTS, owned, n elements */
    double *floats;         /* KILN_ATTR_FLOATS, owned, n elements */
    size_t n;               /* element count of ints/floats */
} kiln_attr_t;

typedef struct kiln_tensor {
    char *name;             /* tensor name, owned; may be "" */
    kiln_dtype_t dtype;     /* KILN_DT_UNDEFINED until inferred */
    kiln_shape_t shape;     /* rank -1 until inferred */
    int weight;             /* index into weights[] or -1 */
} kiln_tensor_t;

typedef struct kiln_weight {
    uint8_t digest[KILN_DIGEST_LEN];   /* SHA-256 of data */
    uint64_t size;                     /* bytes */
    uint8_t *data;                     /* owned; NULL until the blob is attached */
    kiln_map_t map;                    /* when data is mapped read-only from a file
                                          (kiln_graph_map_weight), else zero: never
                                          write through data then */
} kiln_weight_t;

typedef struct kiln_node {
    char *name;             /* node name, owned; may be "" */
    char *op;               /* operator type, e.g. "Conv", owned */
    int *inputs;            /* tensor indices, -1 for an absent optional input */
    int n_inputs;
    int *outputs;           /* tensor indices */
    int n_outputs;
    kiln_attr_t *attrs;     /* owned */
    int n_attrs;
} kiln_node_t;

typedef struct kiln_graph {
    kiln_tensor_t *tensors;  int n_tensors;  int cap_tensors;
    kiln_node_t *nodes;      int n_nodes;    int cap_nodes;
    kiln_weight_t *weights;  int n_weights;  int cap_weights;
    int *inputs;             int n_inputs;   /* graph inputs: tensor indices */
    int *outputs;            int n_outputs;  /* graph outputs: tensor indices */
    int opset;               /* ONNX default-domain opset the graph came from */
    char *io_structure;      /* how inputs/outputs nest (JSON text), owned; NULL when absent */
} kiln_graph_t;

/* --- building ------------------------------------------------------ */

/* Create an empty graph.  Caller owns it; kiln_graph_destroy frees it. */
kiln_graph_t *kiln_graph_new (void);
/* Free the graph and everything it owns; *self_p becomes NULL. */
void kiln_graph_destroy (kiln_graph_t **self_p);

/* Add a tensor; `shape` may be NULL (unknown).  Returns its index (>= 0)
 * or a negative error. */
int kiln_graph_add_tensor (kiln_graph_t *g, const char *name, kiln_dtype_t dt,
                           const kiln_shape_t *shape, kiln_err_t *err);
/* Make tensor `t` a constant holding `size` bytes.  Takes ownership of
 * *data (malloc'd) and NULLs it; computes the digest.  The byte count must
 * match the tensor's dtype and shape.  Ownership passes even on failure
 * (the bytes are freed then), so the caller never frees *data after the
 * call.  *data may be NULL only when `size` is 0.  A tensor that already
 * has a weight gets the new bytes in its place. */
int kiln_graph_set_weight (kiln_graph_t *g, int t, uint8_t **data,
                           uint64_t size, kiln_err_t *err);
/* Make tensor `t` a constant whose `size` bytes are `size` bytes of the
 * file `fd` at `offset`, mapped read-only rather than read (kiln_map.h):
 * a model's weights then cost no memory until used, and streaming them
 * (hashing, uploading) gives their pages back.  `digest` is the bytes'
 * SHA-256 when the caller knows it, else NULL: hashed here.  `fd` stays
 * the caller's.  The file must not shrink while the graph lives. */
int kiln_graph_map_weight (kiln_graph_t *g, int t, int fd, uint64_t offset,
                           uint64_t size, const uint8_t *digest, kiln_err_t *err);
/* Give back a weight's bytes (free or unmap); data becomes NULL. */
void kiln_weight_release (kiln_weight_t *w);
/* Add a node.  Returns its index or a negative error. */
int kiln_graph_add_node (kiln_graph_t *g, const char *op, const char *name,
                         const int *inputs, int n_inputs, const int *outputs,
                         int n_outputs, kiln_err_t *err);
/* Set attributes on node `n` (replacing one of the same name). */
int kiln_node_set_int (kiln_graph_t *g, int n, const char *name, int64_t v,
                       kiln_err_t *err);
int kiln_node_set_float (kiln_graph_t *g, int n, const char *name, double v,
                         kiln_err_t *err);
int kiln_node_set_string (kiln_graph_t *g, int n, const char *name,
                          const char *v, kiln_err_t *err);
int kiln_node_set_ints (kiln_graph_t *g, int n, const char *name,
                        const int64_t *v, size_t count, kiln_err_t *err);
int kiln_node_set_floats (kiln_graph_t *g, int n, const char *name,
                          const double *v, size_t count, kiln_err_t *err);
/* Set the graph's I/O structure to a copy of `text`; NULL or "" clears
 * it.  Fails (leaving the old value) when the text is longer than
 * KILN_MAX_IO_STRUCTURE_BYTES or not valid UTF-8. */
int kiln_graph_set_io_structure (kiln_graph_t *g, const char *text,
                                 kiln_err_t *err);
/* Append graph input / output tensor `t`. */
int kiln_graph_add_input (kiln_graph_t *g, int t, kiln_err_t *err);
int kiln_graph_add_output (kiln_graph_t *g, int t, kiln_err_t *err);
/* Index of the tensor named `name`, or -1. */
int kiln_graph_find_tensor (const kiln_graph_t *g, const char *name);
/* Write how errors name node `n` -- "node 'conv1' (Conv)", or
 * "node #3 (Conv)" when it has no name -- into buf[size]; returns buf.
 * Use it so that every message about a node reads the same. */
char *kiln_graph_node_label (const kiln_graph_t *g, int n, char *buf,
                             size_t size);

/* --- attributes ---------------------------------------------------- */

/* The attribute named `name` on `node`, or NULL. */
const kiln_attr_t *kiln_node_attr (const kiln_node_t *node, const char *name);
/* Integer attribute or `fallback` when absent. */
int64_t kiln_node_attr_int (const kiln_node_t *node, const char *name,
                            int64_t fallback);
/* Float attribute or `fallback` when absent. */
double kiln_node_attr_float (const kiln_node_t *node, const char *name,
                             double fallback);
/* String attribute or `fallback` when absent. */
const char *kiln_node_attr_string (const kiln_node_t *node, const char *name,
                                   const char *fallback);

/* --- encoding ------------------------------------------------------ */

/* Encode the structure (everything but weight bytes) as msgpack.  Caller
 * owns *out (free()). */
int kiln_graph_encode (const kiln_graph_t *g, uint8_t **out, size_t *len,
                       kiln_err_t *err);
/* Decode a structure; weights come back with data == NULL.  Every count,
 * string and dimension is bounded (kiln_limits.h).  Caller owns result. */
kiln_graph_t *kiln_graph_decode (const uint8_t *data, size_t len,
                                 kiln_err_t *err);
/* Attach the bytes of every weight whose digest is `digest`, copying
 * them; the bytes must hash to `digest`.  Returns the number of weights
 * that took the blob (0 when no weight has that digest). */
int kiln_graph_attach_blob (kiln_graph_t *g, const uint8_t digest[KILN_DIGEST_LEN],
                            const uint8_t *data, uint64_t size, kiln_err_t *err);
/* True when every weight has its data. */
bool kiln_graph_complete (const kiln_graph_t *g);

/* A .kgraph file: a msgpack stream of the header map
 * {"format":"kiln-graph","version":1,"graph":<structure bin>} followed
 * by one [digest bin32, data bin] array per distinct weight blob. */
int kiln_graph_save (const kiln_graph_t *g, const char *path, kiln_err_t *err);

/* The msgpack head of a .kgraph `[digest, data]` entry that starts at file
 * offset `at` (array, digest and the data's bin head), in the forms that
 * put the data on a multiple of 8 bytes, else of 4.  Returns its length.
 * Every writer of .kgraph files uses it. */
#define KILN_GRAPH_BLOB_HEAD_MAX 48
size_t kiln_graph_blob_head (uint64_t at, const uint8_t digest[KILN_DIGEST_LEN],
                             uint64_t size, uint8_t out[KILN_GRAPH_BLOB_HEAD_MAX]);
/* Load a .kgraph file with all its blobs (a regular file: a FIFO or a
 * device is refused, not waited on).  Caller owns the result. */
kiln_graph_t *kiln_graph_load (const char *path, kiln_err_t *err);
/* The same from `len` bytes in memory, named `name` in errors. */
kiln_graph_t *kiln_graph_load_mem (const uint8_t *data, size_t len, const char *name,
                                   kiln_err_t *err);

/* The canonical encoding (see above).  Caller owns *out (free()). */
int kiln_graph_canonical (const kiln_graph_t *g, uint8_t **out, size_t *len,
                          kiln_err_t *err);
/* SHA-256 of the canonical encoding as hex. */
int kiln_graph_digest (const kiln_graph_t *g, char out[KILN_HEX_LEN],
                       kiln_err_t *err);

/* --- validation ---------------------------------------------------- */

/* Check the invariants, sort nodes topologically, and infer the dtype and
 * shape of every tensor produced by a node.  Fails with an error that
 * names the node (name and op) and says what is wrong: an unknown op, a
 * missing input, a shape or dtype mismatch, a cycle, an output no node
 * produces.  Ops known here are listed by kiln_graph_op_supported.
 *
 * All or nothing: on failure the graph is left exactly as it was.  A
 * node output that already has a dtype or shape (declared by the importer,
 * or inferred by an earlier run) must agree with what is inferred; a pass
 * that changes what a node computes resets its outputs to
 * KILN_DT_UNDEFINED / rank -1 first.  Reshape reads its target shape from
 * the data of its int64 weight input, so that data must be attached. */
int kiln_graph_validate (kiln_graph_t *g, kiln_err_t *err);

/* True when validation and shape inference know `op`. */
bool kiln_graph_op_supported (const char *op);

/* The sliding window of a Conv or MaxPool node, resolved: the kernel from
 * the weight (Conv) or kernel_shape (MaxPool), strides and dilations with
 * their defaults, and explicit pads with auto_pad worked out (SAME_UPPER
 * puts the odd padding at the end, SAME_LOWER at the start, VALID none),
 * exactly as kiln_graph_validate computed the output shape. */
typedef struct kiln_window {
    int n;                                /* spatial axes (input rank - 2) */
    int64_t kernel[KILN_MAX_RANK];        /* kernel size per spatial axis */
    int64_t strides[KILN_MAX_RANK];
    int64_t dilations[KILN_MAX_RANK];
    int64_t pads[2 * KILN_MAX_RANK];      /* ONNX order: all begins, then all ends */
    bool ceil_mode;                       /* MaxPool: last window may overhang */
} kiln_window_t;

/* Fill `w` for node `n` of a validated graph (input shapes known). */
int kiln_graph_window (const kiln_graph_t *g, int n, kiln_window_t *w,
                       kiln_err_t *err);

#endif
