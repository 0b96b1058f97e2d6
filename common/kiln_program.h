/*
 * kiln_program — the program format: the contract between the builtin
 * compiler (which emits it) and the runtime (which runs it).
 *
 * A program is a list of tensors and a list of kernel calls ("ops") run in
 * order.  Every tensor lives either in the arena (one 64-byte aligned
 * buffer the runtime allocates per loaded model) or in weights.bin (the
 * artifact member holding the constant data), at a fixed byte offset the
 * compiler chose.  Inputs are copied into the arena before the first op
 * and outputs copied out after the last.  It is encoded as msgpack in the
 * artifact member program.kbin; docs/program-format.md has the layout.
 *
 * The runtime never links the graph IR or the compiler, so the format is
 * defined here, in common/, once: the kernel list (KILN_KERNELS), the
 * tensor kinds, the encoder and a decoder that refuses every program that
 * could make a kernel read or write outside its buffers.  Invariants of a
 * program that kiln_program_check accepts:
 *   - every tensor's size is the byte size of its dtype and shape, and
 *     offset + size lies within the arena (or weights.bin for weights);
 *     every offset is a multiple of KILN_PROG_ALIGN;
 *   - arena_size is a multiple of KILN_PROG_ALIGN, at most
 *     KILN_PROG_MAX_ARENA_BYTES, and no larger than the end of the last
 *     arena tensor rounded up to KILN_PROG_ALIGN;
 *   - every tensor index in ops, inputs and outputs is valid; no op writes
 *     a weight or an input; an op's scratch tensor is a float32 temp;
 *   - inputs[i] is a tensor of kind input whose io is i, and every input
 *     tensor is listed there; an output tensor t has outputs[t.io] == t;
 *   - each op's input and output counts are within its kernel's bounds,
 *     its parameters have unique names of at most KILN_PROG_MAX_PARAM_NAME
 *     bytes and at most KILN_PROG_MAX_PARAM_INTS integers each;
 *   - a pipelined program has 2..KILN_PROG_MAX_STAGES stages whose first
 *     ops start at 0 and strictly increase below n_ops; stage 0 has no
 *     handoff, and every other stage's handoff ranges are aligned,
 *     non-empty, sorted, disjoint and inside the arena.
 * What a kernel's parameters mean, and whether they agree with its
 * operands' shapes, is checked by the kernel itself (the runtime's
 * prepare step): that is kernel semantics, not format.
 */
#ifndef KILN_PROGRAM_H
#define KILN_PROGRAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kiln_dtype.h"
#include "common/kiln_error.h"
#include "common/kiln_limits.h"
#include "common/kiln_ops_arith.h"
#include "common/kiln_ops_binary.h"
#include "common/kiln_ops_reduce.h"
#include "common/kiln_ops_unary.h"

#define KILN_PROGRAM_FORMAT       "kiln-program"
#define KILN_PROGRAM_VERSION      1
#define KILN_PROGRAM_MEMBER       "program.kbin"
#define KILN_WEIGHTS_MEMBER       "weights.bin"

#define KILN_PROG_ALIGN           64              /* every tensor offset */
#define KILN_PROG_MAX_TENSORS     (1 << 22)       /* tensors in a program */
#define KILN_PROG_MAX_OPS         (1 << 22)       /* ops in a program */
#define KILN_PROG_MAX_OP_IO       8               /* inputs or outputs of an op */
#define KILN_PROG_MAX_PARAMS      16              /* parameters of an op */
#define KILN_PROG_MAX_PARAM_NAME  31              /* bytes in a parameter name */
#define KILN_PROG_MAX_PARAM_INTS  (2 * KILN_MAX_RANK) /* ints in one parameter */
#define KILN_PROG_MAX_ARENA_BYTES (32ULL << 30)   /* one model's arena */
#define KILN_PROG_MAX_STAGES      KILN_MAX_PIPELINE_STAGES /* stages of a program */
#define KILN_PROG_MAX_HANDOFF     4096            /* arena ranges handed to one stage */

/* The kernels, written once for both sides.  The name is what the program
 * carries (so the enum may be renumbered); the bounds are checked when a
 * program is decoded.  Adding a kernel here without implementing it in
 * the runtime is a compile error there.
 *
 *  id               name              min_in max_in outputs */
#define KILN_KERNELS(X)                                    \
    X (COPY,           "copy",            1, 1, 1)         \
    X (RELU,           "relu",            1, 1, 1)         \
    X (MATMUL,         "matmul",          2, 4, 1)         \
    X (GEMM,           "gemm",            2, 4, 1)         \
    X (ATTENTION,      "attention",       3, 4, 1)         \
    X (CONV2D,         "conv2d",          2, 5, 1)         \
    X (MAXPOOL2D,      "maxpool2d",       1, 1, 1)         \
    X (GLOBAL_AVGPOOL, "global_avgpool",  1, 1, 1)         \
    KILN_ARITH_OPS (KILN_ARITH_KERNEL_ROW, X)                     \
    KILN_KERNELS_MATH (X)                                         \
    KILN_KERNELS_SHAPE (X)

/* The math kernels (runtime/kiln_kernels_math.c). */
#define KILN_KERNELS_MATH(X)                                       \
    X (NEG,                "neg",                1, 1, 1)          \
    X (ABS,                "abs",                1, 1, 1)          \
    X (SQRT,               "sqrt",               1, 1, 1)          \
    X (RECIPROCAL,         "reciprocal",         1, 1, 1)          \
    X (EXP,                "exp",                1, 1, 1)          \
    X (LOG,                "log",                1, 1, 1)          \
    X (FLOOR,              "floor",              1, 1, 1)          \
    X (CEIL,               "ceil",               1, 1, 1)          \
    X (ERF,                "erf",                1, 1, 1)          \
    X (TANH,               "tanh",               1, 1, 1)          \
    X (SIGMOID,            "sigmoid",            1, 1, 1)          \
    X (SOFTPLUS,           "softplus",           1, 1, 1)          \
    X (SOFTSIGN,           "softsign",           1, 1, 1)          \
    X (HARD_SWISH,         "hard_swish",         1, 1, 1)          \
    X (LEAKY_RELU,         "leaky_relu",         1, 1, 1)          \
    X (ELU,                "elu",                1, 1, 1)          \
    X (SELU,               "selu",               1, 1, 1)          \
    X (CELU,               "celu",               1, 1, 1)          \
    X (HARD_SIGMOID,       "hard_sigmoid",       1, 1, 1)          \
    X (CLIP,               "clip",               1, 3, 1)          \
    X (NOT,                "not",                1, 1, 1)          \
    X (CAST,               "cast",               1, 1, 1)          \
    X (ROUND_HALF,         "round_half",         1, 1, 1)          \
    X (FMOD,               "fmod",               2, 2, 1)          \
    X (WHERE,              "where",              3, 3, 1)          \
    X (REDUCE_LOG_SUM_EXP, "reduce_log_sum_exp", 1, 1, 1)          \
    X (SOFTMAX,            "softmax",            1, 1, 1)          \
    X (LOG_SOFTMAX,        "log_softmax",        1, 1, 1)          \
    X (BATCH_NORM,         "batch_norm",         5, 5, 1)          \
    X (INSTANCE_NORM,      "instance_norm",      3, 3, 1)          \
    X (LAYER_NORM,         "layer_norm",         2, 3, 1)          \
    X (LAYER_NORM_STATS,   "layer_norm_stats",   2, 3, 3)          \
    X (LRN,                "lrn",                1, 1, 1)          \
    X (NLL_LOSS,           "nll_loss",           2, 3, 1)          \
    X (HARDMAX,            "hardmax",            1, 1, 1)          \
    X (IS_INF,             "is_inf",             1, 1, 1)          \
    KILN_UNARY_OPS (KILN_UNARY_KERNEL_ROW, X)                     \
    KILN_BINARY_OPS (KILN_BINARY_KERNEL_ROW, X)                   \
    KILN_REDUCE_OPS (KILN_REDUCE_KERNEL_ROW, X)

/* The data-movement, resize and window kernels
 * (runtime/kiln_kernels_shape.c). */
#define KILN_KERNELS_SHAPE(X)                                      \
    X (STRIDED,            "strided",            1, 1, 1)          \
    X (CONCAT,             "concat",             1, 8, 1)          \
    X (GATHER,             "gather",             2, 2, 1)          \
    X (PAD,                "pad",                1, 1, 1)          \
    X (RESIZE,             "resize",             1, 1, 1)          \
    X (CONV_TRANSPOSE2D,   "conv_transpose2d",   2, 3, 1)          \
    X (AVGPOOL2D,          "avgpool2d",          1, 1, 1)          \
    X (GLOBAL_MAXPOOL,     "global_maxpool",     1, 1, 1)          \
    X (TRILU,              "trilu",              1, 1, 1)          \
    X (GATHER_ELEMENTS,    "gather_elements",    2, 2, 1)          \
    X (CUMSUM,             "cumsum",             1, 1, 1)          \
    X (EYE,                "eye",                1, 1, 1)          \
    X (RNN,                "rnn",                3, 8, 1)          \
    X (SCATTER_ND,         "scatter_nd",         3, 3, 1)          \
    X (SCATTER_ELEMENTS,   "scatter_elements",   3, 3, 1)          \
    X (GATHER_ND,          "gather_nd",          2, 2, 1)          \
    X (TOPK,               "topk",               1, 1, 1)          \
    X (CONV3D,             "conv3d",             2, 4, 1)          \
    X (POOL3D,             "pool3d",             1, 1, 1)          \
    X (GRID_SAMPLE,        "grid_sample",        2, 2, 1)          \
    X (CONV_TRANSPOSE3D,   "conv_transpose3d",   2, 3, 1)

typedef enum {
#define KILN_K_ENUM(id, name, min_in, max_in, n_out) KILN_K_##id,
    KILN_KERNELS (KILN_K_ENUM)
#undef KILN_K_ENUM
    KILN_K_COUNT
} kiln_kernel_t;

/* The activations conv2d, gemm and matmul apply to their result (the
 * optional parameter `activation`, with `act_alpha` / `act_beta`), after
 * the bias and the residual: the compiler fuses a following Relu, Clip,
 * LeakyRelu, Sigmoid, HardSwish, HardSigmoid or Tanh node, a SiLU
 * (Sigmoid and Mul) or an erf GELU (Div, Erf, Add, Mul, Mul) into the
 * product that feeds it.  Values 4 and up are "heavy": the runtime
 * applies them to each finished tile with kiln_act_apply. */
#define KILN_ACTS(X)                                                      \
    X (NONE,  0, "none")                                                  \
    X (RELU,  1, "relu")       /* max(v, 0); NaN stays NaN */             \
    X (CLIP,  2, "clip")       /* min(max(v, act_alpha), act_beta) */     \
    X (LEAKY, 3, "leaky_relu") /* v < 0 ? act_alpha * v : v */           \
    X (SIGMOID, 4, "sigmoid")  /* 1 / (1 + exp(-v)) */                    \
    X (SILU,  5, "silu")       /* v * sigmoid(v) (Sigmoid, Mul) */        \
    X (GELU,  6, "gelu")       /* (v * (erf(v / sqrt 2) + 1)) * 0.5 */    \
    X (HARD_SWISH, 7, "hard_swish") /* v * min(max(v · (1/6) + 0.5, 0), 1) */ \
    X (HARD_SIGMOID, 8, "hard_sigmoid") /* min(max(a * v + b, 0), 1) */   \
    X (TANH,  9, "tanh")

typedef enum {
#define KILN_ACT_ENUM(id, num, name) KILN_ACT_##id = num,
    KILN_ACTS (KILN_ACT_ENUM)
#undef KILN_ACT_ENUM
    KILN_ACT_COUNT
} kiln_act_t;

#define KILN_RNN_MAX_ACTS 6         /* 3 per direction (LSTM), 2 directions */

/* The cells and activations, as the `cell` and `acts` parameters number
 * them (docs/program-format.md, kernel `rnn`). */
enum { KILN_RNN_CELL_RNN = 0, KILN_RNN_CELL_GRU = 1, KILN_RNN_CELL_LSTM = 2 };
#define KILN_RNN_ACTS(X)                                                  \
    X (SIGMOID, 0, "Sigmoid")                                             \
    X (TANH, 1, "Tanh")                                                   \
    X (RELU, 2, "Relu")                                                   \
    X (HARD_SIGMOID, 3, "HardSigmoid")  /* min(max(a·v + b, 0), 1) */     \
    X (LEAKY_RELU, 4, "LeakyRelu")      /* v < 0 ? a·v : v */             \
    X (AFFINE, 5, "Affine")             /* a·v + b */                     \
    X (SCALED_TANH, 6, "ScaledTanh")    /* a·tanh(b·v) */                 \
    X (THRESHOLDED_RELU, 7, "ThresholdedRelu") /* v > a ? v : 0 */       \
    X (ELU, 8, "Elu")                   /* v < 0 ? a·(exp(v) - 1) : v */  \
    X (SOFTSIGN, 9, "Softsign")         /* v / (1 + |v|) */               \
    X (SOFTPLUS, 10, "Softplus")        /* log(1 + exp(v)) */
enum {
#define S_RNN_ACT_ENUM(id, num, name) KILN_RNN_ACT_##id = num,
    KILN_RNN_ACTS (S_RNN_ACT_ENUM)
#undef S_RNN_ACT_ENUM
    KILN_RNN_ACT_COUNT
};


/* Where a tensor lives and what the runtime does with it. */
#define KILN_TENSOR_KINDS(X)                                              \
    X (INPUT,  1, "input")    /* arena; copied in before the first op */  \
    X (OUTPUT, 2, "output")   /* arena; copied out after the last op */   \
    X (WEIGHT, 3, "weight")   /* weights.bin; read-only */                \
    X (TEMP,   4, "temp")     /* arena; intermediate or scratch */

typedef enum {
#define KILN_TK_ENUM(id, num, name) KILN_TK_##id = num,
    KILN_TENSOR_KINDS (KILN_TK_ENUM)
#undef KILN_TK_ENUM
} kiln_tensor_kind_t;

typedef enum {
    KILN_PP_INT = 1,        /* i */
    KILN_PP_FLOAT = 2,      /* f */
    KILN_PP_INTS = 3,       /* ints[n] */
} kiln_pparam_kind_t;

typedef struct kiln_prog_param {
    char name[KILN_PROG_MAX_PARAM_NAME + 1];
    kiln_pparam_kind_t kind;
    int64_t i;                                  /* KILN_PP_INT */
    double f;                                   /* KILN_PP_FLOAT */
    int64_t ints[KILN_PROG_MAX_PARAM_INTS];     /* KILN_PP_INTS */
    int n;                                      /* elements of ints */
} kiln_prog_param_t;

typedef struct kiln_prog_tensor {
    kiln_dtype_t dtype;
    kiln_shape_t shape;
    kiln_tensor_kind_t kind;
    uint64_t offset;        /* bytes into the arena, or weights.bin for weights */
    uint64_t size;          /* bytes; equal to the dtype and shape's size */
    int io;                 /* position in inputs/outputs for INPUT/OUTPUT, else -1 */
} kiln_prog_tensor_t;

typedef struct kiln_prog_op {
    kiln_kernel_t kernel;
    int inputs[KILN_PROG_MAX_OP_IO];     /* tensor indices */
    int n_inputs;
    int outputs[KILN_PROG_MAX_OP_IO];    /* tensor indices */
    int n_outputs;
    int scratch;                         /* float32 temp workspace or -1 */
    kiln_prog_param_t *params;           /* owned, sorted by name on encode */
    int n_params;
    uint32_t params_used;                /* bit i: params[i] was read */
} kiln_prog_op_t;

/* A byte range of the arena. */
typedef struct kiln_prog_range {
    uint64_t offset;        /* a multiple of KILN_PROG_ALIGN */
    uint64_t size;          /* > 0 */
} kiln_prog_range_t;

/* One stage of a pipelined program (--pipeline-cores): the ops from
 * first_op to the next stage's first_op (or the end), run on a core of
 * its own with an arena of its own.  `handoff` lists the arena bytes that
 * are live when the stage starts (written by an earlier stage, or a graph
 * input, and read by this stage or a later one, or a graph output
 * written earlier): the runtime copies them from the previous stage's
 * arena into this stage's, at the same offsets.  Stage 0's is empty (the
 * inputs are copied in as in an unpipelined run). */
typedef struct kiln_prog_stage {
    int first_op;
    kiln_prog_range_t *handoff;   /* owned; sorted, disjoint */
    int n_handoff;
} kiln_prog_stage_t;

/* Transparent, like the graph IR: the compiler builds it and the runtime
 * walks it; the functions below keep the invariants above. */
typedef struct kiln_program {
    kiln_prog_tensor_t *tensors;  int n_tensors;  int cap_tensors;
    kiln_prog_op_t *ops;          int n_ops;      int cap_ops;
    int *inputs;                  int n_inputs;   int cap_inputs;
    int *outputs;                 int n_outputs;  int cap_outputs;
    uint64_t arena_size;          /* bytes */
    kiln_prog_stage_t *stages;    /* owned; NULL when not pipelined */
    int n_stages;                 /* 0, or 2..KILN_PROG_MAX_STAGES */
} kiln_program_t;

/* --- kernels and kinds ---------------------------------------------- */

/* "conv2d"; "unknown" for a value outside the enum. */
const char *kiln_kernel_name (kiln_kernel_t k);
/* Kernel id of `name` (length `len`), or -1 when unknown. */
int kiln_kernel_from_name (const char *name, size_t len);
/* Input count bounds and output count of a kernel. */
void kiln_kernel_arity (kiln_kernel_t k, int *min_in, int *max_in, int *n_out);
/* "weight"; "unknown" for a value outside the enum. */
const char *kiln_tensor_kind_name (kiln_tensor_kind_t kind);

/* --- building ------------------------------------------------------- */

/* An empty program.  Caller owns it; kiln_program_destroy frees it. */
kiln_program_t *kiln_program_new (void);
void kiln_program_destroy (kiln_program_t **self_p);

/* Add a tensor (offset 0, io -1; the size is computed from dtype and
 * shape, checked against the bounds).  Returns its index or an error. */
int kiln_program_add_tensor (kiln_program_t *p, kiln_dtype_t dtype,
                             const kiln_shape_t *shape, kiln_tensor_kind_t kind,
                             kiln_err_t *err);
/* Add an op with no parameters and no scratch.  Returns its index. */
int kiln_program_add_op (kiln_program_t *p, kiln_kernel_t kernel,
                         const int *inputs, int n_inputs, const int *outputs,
                         int n_outputs, kiln_err_t *err);
/* Append to the program's input or output list. */
int kiln_program_add_io (kiln_program_t *p, bool output, int tensor,
                         kiln_err_t *err);
/* Set a parameter on op `op` (replacing one of the same name). */
int kiln_prog_op_set_int (kiln_prog_op_t *op, const char *name, int64_t v,
                          kiln_err_t *err);
int kiln_prog_op_set_float (kiln_prog_op_t *op, const char *name, double v,
                            kiln_err_t *err);
int kiln_prog_op_set_ints (kiln_prog_op_t *op, const char *name,
                           const int64_t *v, int n, kiln_err_t *err);

/* --- reading parameters (the runtime's kernels) --------------------- */

/* Required parameters; an error names the parameter (the caller adds the
 * op).  Each marks the parameter used (params_used). */
int kiln_prog_op_int (kiln_prog_op_t *op, const char *name, int64_t *out,
                      kiln_err_t *err);
int kiln_prog_op_float (kiln_prog_op_t *op, const char *name, double *out,
                        kiln_err_t *err);
/* Exactly `n` integers into out[n]. */
int kiln_prog_op_ints (kiln_prog_op_t *op, const char *name, int n,
                       int64_t *out, kiln_err_t *err);
/* Any number (0..KILN_PROG_MAX_PARAM_INTS) of integers; *n gets it. */
int kiln_prog_op_ints_any (kiln_prog_op_t *op, const char *name,
                           int64_t out[KILN_PROG_MAX_PARAM_INTS], int *n,
                           kiln_err_t *err);
/* True when the parameter is present (and marks it used). */
bool kiln_prog_op_has (kiln_prog_op_t *op, const char *name);
/* Fails naming the first parameter no getter read: a parameter this
 * runtime does not know would otherwise be silently ignored. */
int kiln_prog_op_all_used (const kiln_prog_op_t *op, kiln_err_t *err);

/* --- encoding ------------------------------------------------------- */

/* Check the invariants above against a weights.bin of `weights_len`
 * bytes.  Errors name the tensor or op at fault. */
int kiln_program_check (const kiln_program_t *p, uint64_t weights_len,
                        kiln_err_t *err);
/* Encode as msgpack (deterministic: fixed key order, parameters sorted by
 * name).  Caller owns *out (free()). */
int kiln_program_encode (kiln_program_t *p, uint8_t **out, size_t *len,
                         kiln_err_t *err);
/* Decode `len` bytes and check them (kiln_program_check) against a
 * weights.bin of `weights_len` bytes.  Every count, string and size is
 * bounded; a malformed program is an error, never a crash.  Caller owns
 * the result. */
kiln_program_t *kiln_program_decode (const uint8_t *data, size_t len,
                                     uint64_t weights_len, kiln_err_t *err);

/* Round `n` up to KILN_PROG_ALIGN; false when that overflows. */
bool kiln_prog_align_up (uint64_t n, uint64_t *out);
/* a * b into *out; false on overflow of uint64_t. */
bool kiln_prog_mul_u64 (uint64_t a, uint64_t b, uint64_t *out);

#endif
