/*
 * kiln_kernels_priv — what the runtime's kernel files share: the checks
 * and parameter readers of their prepare steps, the window geometry of
 * convolutions and pools, and the kernels kiln_kernels.c's table takes
 * from the kind files.  Internal to libkilnrt; included by
 * kiln_kernels*.c only.
 *
 * The kernels are cut by kind (docs/engine.md has the map):
 *   kiln_kernels.c              the table, and the shared checks below;
 *   kiln_kernels_elementwise.c  copy, relu, float32 add/sub/mul/div;
 *   kiln_kernels_matmul.c       matmul, gemm;
 *   kiln_kernels_conv.c         conv2d, conv3d, conv_transpose2d;
 *   kiln_kernels_dwconv.c       depthwise conv2d;
 *   kiln_kernels_pool.c         maxpool2d, avgpool2d, global_avgpool,
 *                               global_maxpool;
 *   kiln_kernels_math.c         the typed math kernels' dispatch and unary
 *                               ops (kiln_kernels_math.h), with _binary.c
 *                               (broadcasting), _reduce.c, _norm.c;
 *   kiln_kernels_shape.c        data movement (kiln_kernels_shape.h);
 *   and _index.c, _rnn.c, _pool3d.c, _convtr3d.c, each with its header.
 * The symbols declared here are hidden: the library calls them directly.
 */
#ifndef KILN_KERNELS_PRIV_H
#define KILN_KERNELS_PRIV_H

#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "runtime/kiln_kernels.h"

/* Tensor `t` of program `p`. */
static inline const kiln_prog_tensor_t *
kiln_ktensor (const kiln_program_t *p, int t)
{
    return &p->tensors[t];
}

/* v[0] · v[1] · ... · v[n-1] into *out; false on overflow or a negative
 * factor.  For products of values read from a program. */
static inline bool
kiln_kprod (const int64_t *v, int n, int64_t *out)
{
    int64_t r = 1;
    for (int i = 0; i < n; i++)
        if (v[i] < 0 || __builtin_mul_overflow (r, v[i], &r))
            return false;
    *out = r;
    return true;
}

static inline bool
kiln_kmul3 (int64_t a, int64_t b, int64_t c, int64_t *out)
{
    int64_t v[3] = { a, b, c };
    return kiln_kprod (v, 3, out);
}

/* d[from] · ... · d[to-1], unchecked: for the dims of one tensor that
 * kiln_program_check bounded (their product is its element count). */
static inline int64_t
kiln_kdims_prod (const int64_t *d, int from, int to)
{
    int64_t n = 1;
    for (int i = from; i < to; i++)
        n *= d[i];
    return n;
}

/* A size OpenBLAS takes (an int). */
static inline bool
kiln_kblas_ok (int64_t v)
{
    return v >= 0 && v <= INT_MAX;
}

#pragma GCC visibility push(hidden)

/* Every operand and the result are float32. */
int kiln_kneed_f32 (const kiln_program_t *p, const kiln_kplan_t *plan,
                    kiln_err_t *err);

/* Operand `what` (tensor t) must hold exactly `want` elements. */
int kiln_kneed_numel (const kiln_program_t *p, int t, int64_t want,
                      const char *what, kiln_err_t *err);

/* A 0/1 parameter `name` (optional, 0), such as `packed_b`. */
int kiln_kget_packed (kiln_prog_op_t *op, const char *name, bool *out,
                      kiln_err_t *err);

/* --- the fused epilogue (kiln_kernel_epilogue, kiln_kernels.h) ---------- */

static inline bool
kiln_khas_epilogue (const kiln_kplan_t *plan)
{
    return plan->epi.act != KILN_ACT_NONE || plan->epi.residual >= 0;
}

/* The epilogue over a whole output of n floats, after a BLAS product. */
void kiln_kepilogue_after (const kiln_kplan_t *plan, void *const *data, float *y,
                           int64_t n);

/* What a kiln_gemm_get_fn of a kernel reads: its plan and the tensors. */
typedef struct {
    const kiln_kplan_t *plan;
    void *const *data;
} kiln_kgctx_t;

/* --- windows: conv2d, conv_transpose2d, the 2-D pools --------------------- */

/* `kernel`, `strides`, `dilations` (2 each) and `pads` (top, left,
 * bottom, right). */
typedef struct {
    int64_t k[2], s[2], d[2], p[4];
} kiln_kwin_t;

/* Read and bound the window's parameters of op `op`. */
int kiln_kget_window (kiln_prog_op_t *op, kiln_kwin_t *w, kiln_err_t *err);

/* Output size along axis `i` for input size `in`; -1 when the window does
 * not fit.  Every value is at most 2^31, so nothing here overflows. */
static inline int64_t
kiln_kout_size (const kiln_kwin_t *w, int i, int64_t in, bool ceil_mode)
{
    int64_t eff = (w->k[i] - 1) * w->d[i] + 1;
    int64_t span = in + w->p[i] + w->p[2 + i] - eff;
    if (span < 0)
        return -1;
    return (ceil_mode ? span + w->s[i] - 1 : span) / w->s[i] + 1;
}

/* N, C, H, W of a rank-3 (H = 1) or rank-4 tensor. */
static inline bool
kiln_knchw (const kiln_prog_tensor_t *t, int64_t v[4])
{
    if (t->shape.rank == 4) {
        memcpy (v, t->shape.dims, 4 * sizeof *v);
        return true;
    }
    if (t->shape.rank == 3) {
        v[0] = t->shape.dims[0];
        v[1] = t->shape.dims[1];
        v[2] = 1;
        v[3] = t->shape.dims[2];
        return true;
    }
    return false;
}

/* Dimensions [N, H, W, C] of a channels-last tensor reordered in place
 * to N, C, H, W. */
static inline void
kiln_kcl_dims (int64_t v[4])
{
    int64_t c = v[3];
    v[3] = v[2];
    v[2] = v[1];
    v[1] = c;
}

/* --- depthwise convolution (kiln_kernels_dwconv.c) ---------------------- */

/* Floats of a worker's workspace for depthwise conv2d `plan`. */
size_t kiln_kdw_ws_floats (const kiln_kplan_t *plan);

/* Run depthwise conv2d `plan`. */
void kiln_kdw_run (const kiln_kplan_t *plan, void *const *data);

/* A convolution of at most KILN_KFEW_MAX_C input channels (an image's)
 * from [N, C, H, W] to a channels-last Y, with packed-T weights: whether
 * kiln_kfew_run computes it (direct loops, kiln_kernels_dwconv.c), and
 * running it. */
#define KILN_KFEW_MAX_C 4
bool kiln_kfew_fits (const kiln_kplan_t *plan);
void kiln_kfew_run (const kiln_kplan_t *plan, void *const *data);

/* --- the kernels of the kind files --------------------------------------
 * Each defines kiln_kprepare_<id> and kiln_krun_<id>; kiln_kernels.c's
 * table points at them. */
#define KILN_KOWN_KERNELS(X)                                                  \
    X (COPY) X (RELU)                                      /* elementwise */  \
    X (MATMUL) X (GEMM) X (ATTENTION)                      /* matmul */       \
    X (CONV2D) X (CONV3D) X (CONV_TRANSPOSE2D)             /* conv */         \
    X (MAXPOOL2D) X (GLOBAL_AVGPOOL) X (AVGPOOL2D)         /* pool */         \
    X (GLOBAL_MAXPOOL)

#define KILN_KOWN_DECLARE(id)                                                 \
    int kiln_kprepare_##id (kiln_program_t *p, kiln_prog_op_t *op,            \
                            kiln_kplan_t *plan, kiln_err_t *err);             \
    void kiln_krun_##id (const kiln_kplan_t *plan, void *const *data);
KILN_KOWN_KERNELS (KILN_KOWN_DECLARE)
#undef KILN_KOWN_DECLARE

/* add, sub, mul, div (rows of common/kiln_ops_arith.h): the float32
 * loops of kiln_kernels_elementwise.c, other dtypes kiln_kmath_prepare_arith;
 * sets plan->run. */
int kiln_kprepare_arith (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                         kiln_err_t *err);

/* Output planes [first, first + count) of `plan`, with `ws` (the
 * kernel's plan->ws_bytes) to work in. */
typedef void (kiln_kplanes_fn) (const kiln_kplan_t *plan, void *const *data,
                                int64_t first, int64_t count, float *ws);

/* Rows [first, first + count) of a kernel whose rows are independent
 * (a softmax's, a layer norm's), by `arg`. */
typedef void (kiln_krows_fn) (void *arg, int64_t first, int64_t count);

/* Run `fn` over `rows` rows on the pool, about four tasks a thread, each
 * of at least `min` rows (work too small to share stays on the caller).
 * Each row is computed as it would be alone, so the results do not depend
 * on the thread count. */
void kiln_krows_run (kiln_krows_fn *fn, void *arg, int64_t rows, int64_t min);

/* Run `fn` over `planes` planes on the pool, about eight tasks a thread,
 * each a whole number of `align` planes, each worker with its own
 * workspace (kiln_exec_ws). */
void kiln_kplanes_run (kiln_kplanes_fn *fn, const kiln_kplan_t *plan, void *const *data,
                       int64_t planes, int64_t align);

#pragma GCC visibility pop

#endif
