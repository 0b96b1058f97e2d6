/*
 * kiln_infer — the toolkit of shape-inference functions, internal to
 * graph/.
 *
 * The op table (s_ops in kiln_graph_infer.c) maps an op name to an infer
 * function.  The functions of a family of ops may live in their own file
 * (kiln_infer_math.c: elementwise, reductions, normalisations); they use
 * the helpers declared here, which are the ones kiln_graph_infer.c's own
 * infer functions use.  An infer function reads its inputs' types with
 * kiln_infer_in, its attributes with the kiln_infer_attr_* getters (which
 * reject an attribute of the wrong kind or an out-of-range value), reports
 * with kiln_infer_fail (which prefixes the node label) and writes each
 * output's dtype and shape through kiln_infer_out.  The generic code
 * around it checks input and output counts, required inputs, output
 * bounds and declared shapes.
 */
#ifndef KILN_INFER_H
#define KILN_INFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "graph/kiln_graph.h"

/* Room for a shape string ("[1, 3, 224, 224]") in messages. */
#define KILN_INFER_SHAPE_MAX 160
/* Room for "input 'name'" in messages. */
#define KILN_INFER_NAME_MAX (KILN_MAX_NAME + 16)

typedef struct kiln_infer_type {
    kiln_dtype_t dtype;
    kiln_shape_t shape;
} kiln_infer_type_t;

typedef struct kiln_infer_ctx {
    const kiln_graph_t *g;
    const kiln_node_t *node;
    const char *label;                      /* "node 'conv1' (Conv)" */
    const kiln_infer_type_t *const *in;     /* each input's type, NULL when absent */
    int n_in;
    kiln_infer_type_t *const *out;          /* where each output's type goes */
    kiln_err_t *err;
} kiln_infer_ctx_t;

typedef int (*kiln_infer_fn) (kiln_infer_ctx_t *ctx);

/* Fail with "<node label>: <message>"; returns the negative code. */
int kiln_infer_fail (kiln_infer_ctx_t *ctx, int code, const char *fmt, ...)
    __attribute__ ((format (printf, 3, 4)));
/* Type of input i, or NULL when absent (or beyond the node's inputs). */
const kiln_infer_type_t *kiln_infer_in (kiln_infer_ctx_t *ctx, int i);
/* Where output i's type goes. */
kiln_infer_type_t *kiln_infer_out (kiln_infer_ctx_t *ctx, int i);
/* "input 'x'" (or "input #12" when unnamed) into buf; returns buf. */
const char *kiln_infer_in_name (kiln_infer_ctx_t *ctx, int i, char *buf,
                                size_t size);
/* "[2, 3]" into buf (KILN_INFER_SHAPE_MAX bytes); returns buf. */
const char *kiln_infer_shape_str (const kiln_shape_t *shape, char *buf);
/* Input i (when present) must be float32. */
int kiln_infer_want_float (kiln_infer_ctx_t *ctx, int i);
/* Input i must have rank lo..hi. */
int kiln_infer_want_rank (kiln_infer_ctx_t *ctx, int i, int lo, int hi);
/* The attribute `name` when present (*out NULL when not), checked to be
 * of `kind`. */
int kiln_infer_attr (kiln_infer_ctx_t *ctx, const char *name,
                     kiln_attr_kind_t kind, const kiln_attr_t **out);
/* Integer attribute within lo..hi, `fallback` when absent. */
int kiln_infer_attr_int (kiln_infer_ctx_t *ctx, const char *name,
                         int64_t fallback, int64_t lo, int64_t hi, int64_t *v);
/* List-of-ints attribute of exactly `count` values each within lo..hi,
 * into v[count]; *present says whether it was there. */
int kiln_infer_attr_ints (kiln_infer_ctx_t *ctx, const char *name, int count,
                          int64_t lo, int64_t hi, int64_t *v, bool *present);
/* numpy (multidirectional) broadcast of inputs ia's and ib's shapes `a`
 * and `b` into `out`. */
int kiln_infer_broadcast (kiln_infer_ctx_t *ctx, const kiln_shape_t *a, int ia,
                          const kiln_shape_t *b, int ib, kiln_shape_t *out);
/* Product of dims[from..to) into *out, failing past KILN_MAX_DIM. */
int kiln_infer_dim_product (kiln_infer_ctx_t *ctx, const int64_t *dims,
                            int from, int to, int64_t *out);

/* --- node by node (the folding pass, kiln_fold.c) -------------------- */

/* The structural checks of kiln_graph_validate, then a stable
 * topological order of the nodes into order[n_nodes]. */
int kiln_infer_order (const kiln_graph_t *g, int *order, kiln_err_t *err);
/* Check node n against its op and infer its outputs' types into
 * types[] (indexed by tensor), reading its inputs' types from there. */
int kiln_infer_node (const kiln_graph_t *g, int n, kiln_infer_type_t *types,
                     kiln_err_t *err);
/* True for an op the folding pass can evaluate at compile time (Shape,
 * Range, ConstantOfShape, Mod, ...), whether or not it is in the op
 * table. */
bool kiln_fold_op_known (const char *op);
/* The error for node n, an op only folding knows, left in the graph
 * because its inputs are not constants. */
int kiln_fold_refuse (const kiln_graph_t *g, int n, const char *label,
                      kiln_err_t *err);

/* --- constant inputs (kiln_infer_shape.c) ---------------------------- */

/* The values of input i, which must be an int64 or int32 constant
 * (a weight with its data) of rank 0 or 1 holding at most `max` values,
 * into v[]; *n gets the count.  An input computed at run time is
 * KILN_EUNSUPPORTED, naming it: kiln compiles for fixed shapes. */
int kiln_infer_const_ints (kiln_infer_ctx_t *ctx, int i, int max, int64_t *v,
                           int *n);
/* True when input i is present and a constant with its data. */
bool kiln_infer_is_const (kiln_infer_ctx_t *ctx, int i);

/* --- shape, data-movement and window ops (kiln_infer_shape.c) -------- */

int kiln_infer_transpose (kiln_infer_ctx_t *ctx);
int kiln_infer_squeeze (kiln_infer_ctx_t *ctx);
int kiln_infer_unsqueeze (kiln_infer_ctx_t *ctx);
int kiln_infer_concat (kiln_infer_ctx_t *ctx);
int kiln_infer_split (kiln_infer_ctx_t *ctx);
int kiln_infer_slice (kiln_infer_ctx_t *ctx);
int kiln_infer_gather (kiln_infer_ctx_t *ctx);
int kiln_infer_pad (kiln_infer_ctx_t *ctx);
int kiln_infer_tile (kiln_infer_ctx_t *ctx);
int kiln_infer_expand (kiln_infer_ctx_t *ctx);
int kiln_infer_resize (kiln_infer_ctx_t *ctx);
int kiln_infer_depth_to_space (kiln_infer_ctx_t *ctx);
int kiln_infer_space_to_depth (kiln_infer_ctx_t *ctx);
int kiln_infer_einsum (kiln_infer_ctx_t *ctx);
int kiln_infer_conv_transpose (kiln_infer_ctx_t *ctx);

#endif
