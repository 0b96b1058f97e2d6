/*
 * kiln_cc_lower — lowering a validated kiln graph into a program (internal
 * to the compiler).
 *
 * Each graph node becomes zero or more kernel calls, chosen by a table of
 * lowering functions keyed by op type (kiln_cc_lowering_find).  A lowering
 * function resolves everything the runtime must not have to think about:
 * attribute defaults, auto_pad, broadcast shapes, 1-D convolutions as 2-D
 * ones with a unit height, and it checks that the shape inference of the
 * graph agrees with its own geometry.
 *
 * Memory is described by storages: a storage is one region of the arena
 * or of weights.bin, and several program tensors may share one (a Reshape
 * is an alias of its input).  Lowering records, for every arena storage,
 * the first op that writes it and the last op that reads it; the planner
 * (kiln_cc_plan) then gives each storage an offset.
 *
 * Half precision: a float16 or bfloat16 graph tensor is computed in
 * float32 (kiln_cc_dtype).  It is stored in 2 bytes where it enters or
 * leaves the program: a graph input is widened by a `cast` before the
 * first op, a weight where an op first reads it (or packed as it is, in
 * 2-byte panels, for the matrix engine), a graph output narrowed by a
 * `cast` after the last.  In between, every node that computes a half
 * tensor is followed by a `round_half` of it, in place, so that it holds
 * exactly the values a half tensor can (docs/engine.md).
 *
 * Invariants of a kiln_cc_ctx_t after kiln_cc_lower succeeds:
 *   - tmap[g] is the program tensor of graph tensor g, or -1 when the
 *     program does not need it (a Reshape's shape input, an unused weight);
 *     for a half tensor it is float32;
 *   - hmap[g] is the 2-byte program tensor of a half graph tensor that has
 *     one (an input, a weight read as stored, an output), else -1;
 *   - storage_of[t] is the storage of program tensor t;
 *   - an arena storage has def <= last; def is -1 for graph inputs and
 *     last is KILN_CC_END for graph outputs;
 *   - a storage with a parent (kiln_cc_plan_concat) lies wholly inside it,
 *     at a multiple of KILN_PROG_ALIGN; its lifetime is counted in its
 *     root's (the storage at the top of the chain of parents): def and
 *     last are kept on the root only.
 */
#ifndef KILN_CC_LOWER_H
#define KILN_CC_LOWER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kiln_program.h"
#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"

#define KILN_CC_END INT32_MAX       /* "live until the end of the run" */

typedef struct kiln_cc_storage {
    bool weight;            /* in weights.bin (else in the arena) */
    int graph_weight;       /* weights[] index when `weight`, -1 when `data` */
    uint8_t *data;          /* a weight the compiler made (folded, packed):
                             * its bytes, owned; else NULL */
    size_t map_len;         /* data is mapped from the scratch file (munmap
                             * this many bytes), not malloc'd; else 0 */
    uint64_t size;          /* bytes */
    int def;                /* first op writing it; -1 before the first op */
    int last;               /* last op reading it; KILN_CC_END for outputs */
    uint64_t offset;        /* chosen by the planner */
    int parent;             /* the storage this one lies inside (a Concat's
                             * output that its producers write into), or -1;
                             * the planner places only storages without one */
    uint64_t sub;           /* its byte offset in `parent` */
} kiln_cc_storage_t;

/* What the fusion pass (kiln_cc_fuse.h) decided for one Conv, Gemm or
 * MatMul node: the nodes after it that its kernel computes as well. */
typedef struct kiln_cc_fusion {
    int bn;                 /* BatchNormalization folded into the weights, or -1 */
    int pool;               /* AveragePool after a pointwise Conv, run before it
                             * on its input instead (both are linear), or -1 */
    int pre_bn, pre_relu;   /* a pointwise Conv's X made by a BatchNormalization
                             * (and a Relu after it): applied to the
                             * BatchNormalization's input as the product packs
                             * it (op attribute "prologue"), or -1 */
    int bias;               /* MatMul: constant tensor of n added per row, or -1 */
    int residual;           /* tensor added before the activation, or -1 */
    kiln_act_t act;         /* activation applied last */
    double act_a, act_b;    /* clip's bounds, leaky_relu's slope */
    int out;                /* graph tensor the fused op writes, or -1 when
                             * nothing is fused (the node's own output) */
    /* MatMul: the views (Transpose, Slice, Reshape) and the Mul / Div by
     * a constant scalar that made an operand, read through strides and
     * applied as alpha; a Transpose of the result, written through
     * strides. */
    double alpha;           /* Y = alpha·A·B (1: no scale taken) */
    int src[2];             /* tensor read for A / B instead of the input, or -1 */
    int64_t src_off[2];     /* its first element */
    int64_t src_st[2][KILN_MAX_RANK]; /* per axis of the operand, in src */
    bool y_strided;         /* Y written into `out` at y_st */
    int64_t y_st[KILN_MAX_RANK];      /* per axis of the MatMul's output */
    /* A ReduceMean that starts the decomposed LayerNormalization torch
     * exports before opset 17: the whole pattern is one layer_norm. */
    int ln_scale, ln_bias;  /* its constant scale and bias, or -1 */
    int ln_axis;            /* first normalised axis */
    double ln_eps;
    /* The MatMul of an attention's probabilities by V: the MatMul of the
     * scores before it (Q·Kᵀ, its operands' views and alpha in that
     * node's fusion), a Mul / Div of the scores by a constant scalar, an
     * Add of a mask and the Softmax are one attention op with it. */
    int attn;               /* the scores' MatMul, or -1 */
    int attn_mask;          /* the mask added to the scores, or -1 */
    /* An AveragePool: the Pad of zeros that alone makes its input, taken
     * as the pool's own padding, counted (torch exports count_include_pad
     * so), or -1; and that Pad's pads before and after each spatial axis. */
    int pad;
    int64_t pad_lo[2], pad_hi[2];
} kiln_cc_fusion_t;

typedef struct kiln_cc_ctx {
    kiln_graph_t *g;                /* the validated graph (not owned) */
    kiln_cc_options_t opts;
    kiln_program_t *prog;           /* owned until handed to the caller */
    int *tmap;                      /* graph tensor -> program tensor or -1 */
    int *hmap;                      /* half graph tensor -> its 2-byte tensor or -1 */
    int *storage_of;                /* program tensor -> storage */
    int cap_storage_of;
    kiln_cc_storage_t *st;          /* storages */
    int n_st, cap_st;
    int node;                       /* node being lowered, for errors */
    int *producer;                  /* graph tensor -> node writing it, or -1 */
    uint8_t *skip;                  /* per node: 1 when dead or fused away */
    kiln_cc_fusion_t *fusion;       /* per node (kiln_cc_fuse.h) */
    uint8_t *viewed;                /* per graph tensor: 1 when an output of a
                                     * Split that its reader takes as a view of
                                     * the Split's input (kiln_cc_fuse.c): the
                                     * Split does not write it */
    uint8_t *cl;                    /* per graph tensor: 1 when the program holds
                                     * it channels-last, [N, H, W, C]
                                     * (kiln_cc_layout.h) */
    uint64_t weight_bytes;          /* the graph's weights, all of them: over
                                     * S_STREAMED_BYTES (kiln_cc_lower.c) a
                                     * run streams them from memory */
    int scratch_fd;                 /* large made weights live in this file, or -1:
                                     * mapped, their pages given back as more are
                                     * made, so that they are never whole in memory */
    uint64_t scratch_end;           /* bytes of the scratch file in use */
} kiln_cc_ctx_t;

/* Give back the pages of every made weight in the scratch file and of the
 * graph's mapped weights (they are read again from their files when
 * next touched). */
void kiln_cc_drop_weight_pages (kiln_cc_ctx_t *cx);

/* Lower one node; `kernel` is the kernel of its table entry (ops that
 * share a lowering, such as Add and Sub, differ only in it). */
typedef int (*kiln_cc_lower_fn) (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                                 kiln_kernel_t kernel, kiln_err_t *err);

typedef struct kiln_cc_lowering {
    const char *op;             /* ONNX op type, e.g. "Conv" */
    kiln_cc_lower_fn fn;
    kiln_kernel_t kernel;
    bool exact;                 /* its outputs hold values of its inputs (views,
                                 * data movement), or it rounds them itself
                                 * (Cast): a half output is not rounded after it */
} kiln_cc_lowering_t;

/* The lowering of op type `op`, or NULL when the builtin compiler does not
 * support it. */
const kiln_cc_lowering_t *kiln_cc_lowering_find (const char *op);

/* --- helpers for lowering functions in other files ------------------
 * (kiln_lower_math.c and the like); the same ones the lowerings of
 * kiln_cc_lower.c use.  Each returns a negative code with `err` filled in
 * on failure. */

/* Fail with "node 'name' (Op): <message>". */
int kiln_cc_fail (kiln_cc_ctx_t *cx, int code, kiln_err_t *err,
                  const char *fmt, ...) __attribute__ ((format (printf, 4, 5)));
/* Graph tensor gt's name, "(unnamed)" when it has none. */
const char *kiln_cc_tname (const kiln_cc_ctx_t *cx, int gt);
/* The program tensor for graph tensor gt read by the node being lowered
 * (a graph input, a weight, or an earlier node's result). */
int kiln_cc_operand (kiln_cc_ctx_t *cx, int gt, kiln_err_t *err);
/* A new arena tensor for graph tensor gt, written by the next op. */
int kiln_cc_result (kiln_cc_ctx_t *cx, int gt, kiln_err_t *err);
/* The fused epilogue's parameters (residual, activation) of op `op`
 * from fusion `f` (docs/program-format.md). */
int kiln_cc_fused_params (kiln_cc_ctx_t *cx, int op, const kiln_cc_fusion_t *f,
                          kiln_err_t *err);
/* The storage at the top of storage s's chain of parents; *off (when
 * not NULL) gets s's byte offset inside it. */
int kiln_cc_root (const kiln_cc_ctx_t *cx, int s, uint64_t *off);
/* Emit an op (recording its reads for the planner); returns its index. */
int kiln_cc_emit (kiln_cc_ctx_t *cx, kiln_kernel_t k, const int *ins,
                  int n_in, const int *outs, int n_out, kiln_err_t *err);
/* The operands and op of a convolution node (Conv or ConvTranspose):
 * X, then W — the weight tensor `packed` the caller made, when >= 0,
 * else W's values folded by the compiler (`wfold`, m·per floats) or W as
 * it is — then the bias, folded (`bfold`, m floats) or as it is, if any;
 * emitted as kernel k with the fusion f (NULL: none).  Returns the op. */
int kiln_cc_emit_conv (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                       const kiln_cc_fusion_t *f, kiln_kernel_t k, int packed,
                       const float *wfold, const float *bfold, int64_t m, int64_t per,
                       kiln_err_t *err);
/* Give op `op` a float32 workspace of `elems` elements. */
int kiln_cc_scratch (kiln_cc_ctx_t *cx, int op, uint64_t elems,
                     kiln_err_t *err);
/* The inferred shape of graph tensor gt must be `want`. */
int kiln_cc_expect_shape (kiln_cc_ctx_t *cx, int gt, const kiln_shape_t *want,
                          kiln_err_t *err);
/* A new arena tensor no graph tensor stands for (an output the graph
 * does not use), written by the next op. */
int kiln_cc_temp (kiln_cc_ctx_t *cx, kiln_dtype_t dt, const kiln_shape_t *shape,
                  kiln_err_t *err);
/* A new float32 weight of `shape` whose bytes the compiler computes (a
 * folded or packed weight): *data gets its zeroed buffer, owned by the
 * context, to fill before planning.  Returns the program tensor. */
int kiln_cc_made_weight (kiln_cc_ctx_t *cx, const kiln_shape_t *shape,
                         float **data, kiln_err_t *err);
/* The same of dtype `dt` (a half weight packed as it is). */
int kiln_cc_made_weight_dt (kiln_cc_ctx_t *cx, kiln_dtype_t dt,
                            const kiln_shape_t *shape, void **data,
                            kiln_err_t *err);
/* The float32 data of graph tensor gt when it is a constant with its
 * bytes, else NULL. */
const float *kiln_cc_const_f32 (const kiln_cc_ctx_t *cx, int gt);
/* The 2-byte data of graph tensor gt when it is a float16 or bfloat16
 * constant with its bytes (*dt gets which), else NULL. */
const uint16_t *kiln_cc_const_half (const kiln_cc_ctx_t *cx, int gt,
                                    kiln_dtype_t *dt);
/* The dtype the program computes graph tensor gt in: float32 for a half
 * tensor, else its own. */
kiln_dtype_t kiln_cc_dtype (const kiln_cc_ctx_t *cx, int gt);
/* The program tensor holding graph tensor gt as it is stored: for a half
 * graph input or weight its 2-byte tensor (not widened; a Gather of a
 * half embedding table reads it so), else kiln_cc_operand's. */
int kiln_cc_stored (kiln_cc_ctx_t *cx, int gt, kiln_err_t *err);
/* Emit Y = X rounded to half type `dt` (float32 X and Y, which may be the
 * same tensor): round_half.  Returns the op. */
int kiln_cc_round (kiln_cc_ctx_t *cx, int px, int py, kiln_dtype_t dt,
                   kiln_err_t *err);
/* Graph tensor gt is, or will be, computed by the time node `node` runs
 * (a graph input, a constant, or the output of an earlier node). */
bool kiln_cc_available (const kiln_cc_ctx_t *cx, int gt, int node);

/* A 4-D shape [N, C, H, W] reordered to channels-last [N, H, W, C]. */
void kiln_cc_cl_shape (kiln_shape_t *s);

/* Lower output 0 of `node` as a view of its input 0 (an alias from -O1,
 * a copy at -O0). */
int kiln_cc_lower_view (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                        kiln_kernel_t k, kiln_err_t *err);

/* Set up `cx` for graph `g`; release with kiln_cc_ctx_release. */
int kiln_cc_ctx_init (kiln_cc_ctx_t *cx, kiln_graph_t *g,
                      const kiln_cc_options_t *opts, kiln_err_t *err);
void kiln_cc_ctx_release (kiln_cc_ctx_t *cx);

/* Lower every node of the (validated, complete) graph into cx->prog, and
 * list the program's inputs and outputs.  Errors name the node and op. */
int kiln_cc_lower (kiln_cc_ctx_t *cx, kiln_err_t *err);

#endif
