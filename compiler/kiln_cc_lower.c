#include "compiler/kiln_cc_lower.h"

#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/kiln_map.h"
#include "common/kiln_ops_shape.h"

#define S_SCRATCH_MIN_BYTES (1u << 20)   /* made weights this big go to the scratch file */
#include "common/kiln_pack.h"
#include "compiler/kiln_cc_fuse.h"
#include "compiler/kiln_cc_layout.h"
#include "compiler/kiln_lower_math.h"
#include "compiler/kiln_lower_shape.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --- errors --------------------------------------------------------- */

/* Fail naming the node being lowered and its op. */
__attribute__ ((format (printf, 4, 5))) static int
s_fail (kiln_cc_ctx_t *cx, int code, kiln_err_t *err, const char *fmt, ...)
{
    char msg[KILN_ERR_MSG_MAX / 2];
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (msg, sizeof msg, fmt, ap);
    va_end (ap);
    if (cx->node < 0 || cx->node >= cx->g->n_nodes)
        return kiln_error (err, code, "graph outputs: %s", msg);
    const kiln_node_t *node = &cx->g->nodes[cx->node];
    if (node->name && node->name[0])
        return kiln_error (err, code, "node '%s' (%s): %s", node->name,
                           node->op, msg);
    return kiln_error (err, code, "node #%d (%s): %s", cx->node, node->op, msg);
}

static const char *
s_tname (const kiln_cc_ctx_t *cx, int gt)
{
    const char *n = cx->g->tensors[gt].name;
    return n && n[0] ? n : "(unnamed)";
}

/* --- context -------------------------------------------------------- */

int
kiln_cc_ctx_init (kiln_cc_ctx_t *cx, kiln_graph_t *g,
                  const kiln_cc_options_t *opts, kiln_err_t *err)
{
    memset (cx, 0, sizeof *cx);
    cx->scratch_fd = -1;
    cx->g = g;
    cx->opts = *opts;
    cx->prog = kiln_program_new ();
    cx->tmap = malloc ((size_t) (g->n_tensors + 1) * sizeof *cx->tmap);
    cx->hmap = malloc ((size_t) (g->n_tensors + 1) * sizeof *cx->hmap);
    cx->producer = malloc ((size_t) (g->n_tensors + 1) * sizeof *cx->producer);
    cx->skip = calloc ((size_t) g->n_nodes + 1, 1);
    cx->fusion = calloc ((size_t) g->n_nodes + 1, sizeof *cx->fusion);
    cx->cl = calloc ((size_t) g->n_tensors + 1, 1);
    cx->viewed = calloc ((size_t) g->n_tensors + 1, 1);
    if (!cx->prog || !cx->tmap || !cx->hmap || !cx->producer || !cx->skip
        || !cx->fusion || !cx->cl || !cx->viewed) {
        kiln_cc_ctx_release (cx);
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    for (int i = 0; i < g->n_tensors; i++)
        cx->tmap[i] = cx->hmap[i] = cx->producer[i] = -1;
    for (int i = 0; i < g->n_weights; i++)
        cx->weight_bytes += g->weights[i].size;
    for (int i = 0; i < g->n_nodes; i++)
        for (int o = 0; o < g->nodes[i].n_outputs; o++) {
            int t = g->nodes[i].outputs[o];
            if (t >= 0 && t < g->n_tensors)
                cx->producer[t] = i;
        }
    return 0;
}

void
kiln_cc_ctx_release (kiln_cc_ctx_t *cx)
{
    kiln_program_destroy (&cx->prog);
    for (int i = 0; i < cx->n_st; i++) {
        if (cx->st[i].map_len)
            munmap (cx->st[i].data, cx->st[i].map_len);
        else
            free (cx->st[i].data);
    }
    free (cx->tmap);
    free (cx->hmap);
    free (cx->producer);
    free (cx->skip);
    free (cx->fusion);
    free (cx->cl);
    free (cx->viewed);
    free (cx->storage_of);
    free (cx->st);
    memset (cx, 0, sizeof *cx);
}

static int
s_storage_new (kiln_cc_ctx_t *cx, bool weight, int graph_weight, uint64_t size,
               int def, kiln_err_t *err)
{
    if (cx->n_st == cx->cap_st) {
        int ncap = cx->cap_st ? cx->cap_st * 2 : 64;
        kiln_cc_storage_t *n = realloc (cx->st, (size_t) ncap * sizeof *n);
        if (!n)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        cx->st = n;
        cx->cap_st = ncap;
    }
    kiln_cc_storage_t *s = &cx->st[cx->n_st];
    memset (s, 0, sizeof *s);
    s->weight = weight;
    s->graph_weight = graph_weight;
    s->size = size;
    s->def = def;
    s->last = def;
    s->parent = -1;
    return cx->n_st++;
}

/* Add a program tensor backed by `storage`. */
static int
s_ptensor (kiln_cc_ctx_t *cx, kiln_dtype_t dt, const kiln_shape_t *shape,
           kiln_tensor_kind_t kind, int storage, kiln_err_t *err)
{
    int t = kiln_program_add_tensor (cx->prog, dt, shape, kind, err);
    if (t < 0)
        return t;
    if (t >= cx->cap_storage_of) {
        int ncap = cx->cap_storage_of ? cx->cap_storage_of * 2 : 64;
        int *n = realloc (cx->storage_of, (size_t) ncap * sizeof *n);
        if (!n)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        cx->storage_of = n;
        cx->cap_storage_of = ncap;
    }
    cx->storage_of[t] = storage;
    return t;
}

/* The weights.bin storage of graph weight `w`, shared with any earlier
 * weight holding the same bytes. */
static int
s_weight_storage (kiln_cc_ctx_t *cx, int w, kiln_err_t *err)
{
    const kiln_weight_t *gw = &cx->g->weights[w];
    for (int i = 0; i < cx->n_st; i++) {
        const kiln_cc_storage_t *s = &cx->st[i];
        if (!s->weight || s->graph_weight < 0)
            continue;
        const kiln_weight_t *o = &cx->g->weights[s->graph_weight];
        if (s->graph_weight == w
            || (o->size == gw->size
                && memcmp (o->digest, gw->digest, KILN_DIGEST_LEN) == 0))
            return i;
    }
    return s_storage_new (cx, true, w, gw->size, -1, err);
}

static int s_emit (kiln_cc_ctx_t *cx, kiln_kernel_t k, const int *ins, int n_in,
                   const int *outs, int n_out, kiln_err_t *err);

static bool
s_half (const kiln_cc_ctx_t *cx, int gt)
{
    return kiln_dtype_is_half (cx->g->tensors[gt].dtype);
}

/* The dtype the program computes graph tensor gt in. */
static kiln_dtype_t
s_dtype (const kiln_cc_ctx_t *cx, int gt)
{
    return s_half (cx, gt) ? KILN_DT_FLOAT32 : cx->g->tensors[gt].dtype;
}

/* The weights.bin tensor of graph weight tensor `gt`, in its own dtype
 * (a half weight's goes to hmap, any other's to tmap). */
static int
s_weight_tensor (kiln_cc_ctx_t *cx, int gt, kiln_err_t *err)
{
    int *map = s_half (cx, gt) ? cx->hmap : cx->tmap;
    if (map[gt] >= 0)
        return map[gt];
    const kiln_tensor_t *t = &cx->g->tensors[gt];
    if (t->weight < 0 || t->weight >= cx->g->n_weights)
        return s_fail (cx, KILN_ECOMPILE, err, "tensor '%s' is read before any "
                       "node produces it", s_tname (cx, gt));
    const kiln_weight_t *w = &cx->g->weights[t->weight];
    if (!w->data)
        return s_fail (cx, KILN_ECOMPILE, err, "weight '%s' has no data",
                       s_tname (cx, gt));
    uint64_t bytes;
    int rc = kiln_shape_bytes (&t->shape, t->dtype, s_tname (cx, gt), &bytes, err);
    if (rc)
        return rc;
    if (bytes > w->size)
        return s_fail (cx, KILN_ECOMPILE, err, "weight '%s' holds %llu bytes, "
                       "its shape needs %llu", s_tname (cx, gt),
                       (unsigned long long) w->size, (unsigned long long) bytes);
    int s = s_weight_storage (cx, t->weight, err);
    if (s < 0)
        return s;
    int pt = s_ptensor (cx, t->dtype, &t->shape, KILN_TK_WEIGHT, s, err);
    if (pt < 0)
        return pt;
    map[gt] = pt;
    return pt;
}

/* Half graph tensor gt, stored in 2 bytes as program tensor `src` (an
 * input or a weight), widened to a new float32 arena tensor by a `cast`
 * emitted now, before the op that reads it: tmap[gt].  The arena holds
 * the float32 copy from here to its last reader only. */
static int
s_widen (kiln_cc_ctx_t *cx, int gt, int src, kiln_err_t *err)
{
    const kiln_tensor_t *t = &cx->g->tensors[gt];
    uint64_t bytes;
    int rc = kiln_shape_bytes (&t->shape, KILN_DT_FLOAT32, s_tname (cx, gt),
                               &bytes, err);
    if (rc)
        return rc;
    int s = s_storage_new (cx, false, -1, bytes, cx->prog->n_ops, err);
    if (s < 0)
        return s;
    int pt = s_ptensor (cx, KILN_DT_FLOAT32, &t->shape, KILN_TK_TEMP, s, err);
    if (pt < 0)
        return pt;
    int op = s_emit (cx, KILN_K_CAST, &src, 1, &pt, 1, err);
    if (op < 0)
        return op;
    cx->tmap[gt] = pt;
    return pt;
}

/* The program tensor for graph tensor `gt` read by the node being lowered:
 * a graph input, a weight, or a tensor an earlier node produced; float32
 * for a half one (widened here when it is a weight). */
static int
s_operand (kiln_cc_ctx_t *cx, int gt, kiln_err_t *err)
{
    if (gt < 0 || gt >= cx->g->n_tensors)
        return s_fail (cx, KILN_ECOMPILE, err, "input tensor index %d is "
                       "invalid", gt);
    if (cx->tmap[gt] >= 0)
        return cx->tmap[gt];
    int pt = s_weight_tensor (cx, gt, err);
    if (pt < 0 || !s_half (cx, gt))
        return pt;
    return s_widen (cx, gt, pt, err);
}

/* [N, C, H, W] reordered to channels-last [N, H, W, C]. */
static void
s_cl_shape (kiln_shape_t *s)
{
    int64_t c = s->dims[1];
    s->dims[1] = s->dims[2];
    s->dims[2] = s->dims[3];
    s->dims[3] = c;
}

void
kiln_cc_cl_shape (kiln_shape_t *s)
{
    s_cl_shape (s);
}

/* A new arena tensor for graph tensor `gt`, written by the next op (in
 * the program's layout: channels-last when cx->cl says so). */
static int
s_result (kiln_cc_ctx_t *cx, int gt, kiln_err_t *err)
{
    if (gt < 0 || gt >= cx->g->n_tensors)
        return s_fail (cx, KILN_ECOMPILE, err, "output tensor index %d is "
                       "invalid", gt);
    if (cx->tmap[gt] >= 0)
        return s_fail (cx, KILN_ECOMPILE, err, "tensor '%s' is produced twice",
                       s_tname (cx, gt));
    const kiln_tensor_t *t = &cx->g->tensors[gt];
    uint64_t bytes;
    int rc = kiln_shape_bytes (&t->shape, s_dtype (cx, gt), s_tname (cx, gt), &bytes,
                               err);
    if (rc)
        return rc;
    int s = s_storage_new (cx, false, -1, bytes, cx->prog->n_ops, err);
    if (s < 0)
        return s;
    kiln_shape_t shape = t->shape;
    if (cx->cl[gt])
        s_cl_shape (&shape);
    int pt = s_ptensor (cx, s_dtype (cx, gt), &shape, KILN_TK_TEMP, s, err);
    if (pt < 0)
        return pt;
    cx->tmap[gt] = pt;
    return pt;
}

int
kiln_cc_root (const kiln_cc_ctx_t *cx, int s, uint64_t *off)
{
    uint64_t at = 0;
    for (; cx->st[s].parent >= 0; s = cx->st[s].parent)
        at += cx->st[s].sub;
    if (off)
        *off = at;
    return s;
}

/* Emit an op; records the reads for the planner.  Returns its index. */
static int
s_emit (kiln_cc_ctx_t *cx, kiln_kernel_t k, const int *ins, int n_in,
        const int *outs, int n_out, kiln_err_t *err)
{
    int op = kiln_program_add_op (cx->prog, k, ins, n_in, outs, n_out, err);
    if (op < 0)
        return op;
    for (int i = 0; i < n_in; i++) {
        kiln_cc_storage_t *s = &cx->st[kiln_cc_root (cx, cx->storage_of[ins[i]], NULL)];
        if (!s->weight && s->last < op)
            s->last = op;
    }
    return op;
}

/* Give op `op` a float32 workspace of `elems` elements. */
static int
s_scratch (kiln_cc_ctx_t *cx, int op, uint64_t elems, kiln_err_t *err)
{
    if (elems > (uint64_t) KILN_MAX_TENSOR_ELEMS)
        return s_fail (cx, KILN_ELIMIT, err, "workspace of %llu elements is "
                       "more than %lld", (unsigned long long) elems,
                       (long long) KILN_MAX_TENSOR_ELEMS);
    kiln_shape_t shape = { .rank = 1, .dims = { (int64_t) elems } };
    int s = s_storage_new (cx, false, -1, elems * 4, op, err);
    if (s < 0)
        return s;
    int pt = s_ptensor (cx, KILN_DT_FLOAT32, &shape, KILN_TK_TEMP, s, err);
    if (pt < 0)
        return pt;
    cx->prog->ops[op].scratch = pt;
    return 0;
}

/* --- helpers for the lowerings ------------------------------------- */

static const kiln_tensor_t *
s_gt (const kiln_cc_ctx_t *cx, int gt)
{
    return &cx->g->tensors[gt];
}

/* Input `i` of the node, or -1 when absent (optional). */
static int
s_in (const kiln_node_t *node, int i)
{
    return i < node->n_inputs ? node->inputs[i] : -1;
}

/* Every listed tensor must be computed in float32 (float32 or a half
 * type): the kernels compute in float32. */
static int
s_need_f32 (kiln_cc_ctx_t *cx, const int *gts, int n, kiln_err_t *err)
{
    for (int i = 0; i < n; i++) {
        if (gts[i] < 0)
            continue;
        const kiln_tensor_t *t = s_gt (cx, gts[i]);
        if (s_dtype (cx, gts[i]) != KILN_DT_FLOAT32)
            return s_fail (cx, KILN_EUNSUPPORTED, err, "tensor '%s' is %s; the "
                           "builtin compiler computes in float32 only (float16 and "
                           "bfloat16 through float32)",
                           s_tname (cx, gts[i]), kiln_dtype_name (t->dtype));
        if (t->shape.rank < 0)
            return s_fail (cx, KILN_ECOMPILE, err, "tensor '%s' has no inferred "
                           "shape", s_tname (cx, gts[i]));
    }
    return 0;
}

/* The inferred output shape must be what the lowering computed. */
static int
s_expect_shape (kiln_cc_ctx_t *cx, int gt, const kiln_shape_t *want,
                kiln_err_t *err)
{
    const kiln_shape_t *got = &s_gt (cx, gt)->shape;
    if (kiln_shape_equal (got, want))
        return 0;
    char a[128], b[128];
    return s_fail (cx, KILN_ECOMPILE, err, "output '%s' has inferred shape %s, "
                   "but the operator computes %s", s_tname (cx, gt),
                   kiln_shape_str (got, a, sizeof a),
                   kiln_shape_str (want, b, sizeof b));
}

/* An INTS attribute of exactly `n` values, or `dflt` (n values) when it is
 * absent. */
static int
s_attr_ints (kiln_cc_ctx_t *cx, const kiln_node_t *node, const char *name,
             int n, int64_t dflt, int64_t *out, kiln_err_t *err)
{
    const kiln_attr_t *a = kiln_node_attr (node, name);
    if (!a) {
        for (int i = 0; i < n; i++)
            out[i] = dflt;
        return 0;
    }
    if (a->kind != KILN_ATTR_INTS || a->n != (size_t) n)
        return s_fail (cx, KILN_ECOMPILE, err, "attribute '%s' must hold %d "
                       "integers", name, n);
    memcpy (out, a->ints, (size_t) n * sizeof *out);
    return 0;
}

static int
s_set_ints (kiln_cc_ctx_t *cx, int op, const char *name, const int64_t *v,
            int n, kiln_err_t *err)
{
    return kiln_prog_op_set_ints (&cx->prog->ops[op], name, v, n, err);
}

static int
s_set_int (kiln_cc_ctx_t *cx, int op, const char *name, int64_t v,
           kiln_err_t *err)
{
    return kiln_prog_op_set_int (&cx->prog->ops[op], name, v, err);
}

static int64_t
s_numel (const kiln_shape_t *s)
{
    int64_t n = 1;
    for (int i = 0; i < s->rank; i++)
        n *= s->dims[i];        /* bounded: shapes passed kiln_shape_numel */
    return n;
}

/* --- the same helpers for other files (kiln_cc_lower.h) ------------ */

int
kiln_cc_fail (kiln_cc_ctx_t *cx, int code, kiln_err_t *err, const char *fmt, ...)
{
    char msg[KILN_ERR_MSG_MAX / 2];
    va_list ap;
    va_start (ap, fmt);
    vsnprintf (msg, sizeof msg, fmt, ap);
    va_end (ap);
    return s_fail (cx, code, err, "%s", msg);
}

const char *
kiln_cc_tname (const kiln_cc_ctx_t *cx, int gt)
{
    return s_tname (cx, gt);
}

int
kiln_cc_operand (kiln_cc_ctx_t *cx, int gt, kiln_err_t *err)
{
    return s_operand (cx, gt, err);
}

int
kiln_cc_result (kiln_cc_ctx_t *cx, int gt, kiln_err_t *err)
{
    return s_result (cx, gt, err);
}

int
kiln_cc_emit (kiln_cc_ctx_t *cx, kiln_kernel_t k, const int *ins, int n_in,
              const int *outs, int n_out, kiln_err_t *err)
{
    return s_emit (cx, k, ins, n_in, outs, n_out, err);
}

int
kiln_cc_scratch (kiln_cc_ctx_t *cx, int op, uint64_t elems, kiln_err_t *err)
{
    return s_scratch (cx, op, elems, err);
}

int
kiln_cc_expect_shape (kiln_cc_ctx_t *cx, int gt, const kiln_shape_t *want,
                      kiln_err_t *err)
{
    return s_expect_shape (cx, gt, want, err);
}

int
kiln_cc_temp (kiln_cc_ctx_t *cx, kiln_dtype_t dt, const kiln_shape_t *shape,
              kiln_err_t *err)
{
    uint64_t bytes;
    int rc = kiln_shape_bytes (shape, dt, "temporary", &bytes, err);
    if (rc)
        return rc;
    int s = s_storage_new (cx, false, -1, bytes, cx->prog->n_ops, err);
    if (s < 0)
        return s;
    return s_ptensor (cx, dt, shape, KILN_TK_TEMP, s, err);
}

void
kiln_cc_drop_weight_pages (kiln_cc_ctx_t *cx)
{
    for (int i = 0; i < cx->n_st; i++)
        if (cx->st[i].map_len)
            kiln_map_drop (cx->st[i].data, cx->st[i].map_len);
    for (int w = 0; w < cx->g->n_weights; w++)
        if (cx->g->weights[w].map.base)
            kiln_map_drop (cx->g->weights[w].data, (size_t) cx->g->weights[w].size);
}

/* Zeroed room for a made weight of `bytes`: in the scratch file when
 * there is one and the weight is large (*map_len set), else malloc'd.
 * The pages of the weights made before (finished by now, or not: a
 * shared file mapping loses nothing) and of the graph's mapped weights
 * are given back first, so that packing a model's weights one by one
 * holds about one of them in memory. */
static uint8_t *
s_scratch_alloc (kiln_cc_ctx_t *cx, uint64_t bytes, size_t *map_len, kiln_err_t *err)
{
    *map_len = 0;
    if (cx->scratch_fd < 0 || bytes < S_SCRATCH_MIN_BYTES) {
        uint8_t *buf = calloc (1, bytes ? (size_t) bytes : 1);
        if (!buf)
            kiln_error (err, KILN_ENOMEM, "out of memory");
        return buf;
    }
    kiln_cc_drop_weight_pages (cx);
    long page = sysconf (_SC_PAGESIZE);
    uint64_t at = (cx->scratch_end + (uint64_t) page - 1) / (uint64_t) page * (uint64_t) page;
    if (ftruncate (cx->scratch_fd, (off_t) (at + bytes)) != 0) {
        kiln_error (err, KILN_EIO, "could not grow the compiler's scratch file to %llu "
                    "bytes: %s", (unsigned long long) (at + bytes), strerror (errno));
        return NULL;
    }
    void *p = mmap (NULL, (size_t) bytes, PROT_READ | PROT_WRITE, MAP_SHARED, cx->scratch_fd,
                    (off_t) at);
    if (p == MAP_FAILED) {
        kiln_error (err, KILN_ENOMEM, "could not map %llu bytes of the compiler's scratch "
                    "file: %s", (unsigned long long) bytes, strerror (errno));
        return NULL;
    }
    cx->scratch_end = at + bytes;
    *map_len = (size_t) bytes;
    return p;
}

int
kiln_cc_made_weight_dt (kiln_cc_ctx_t *cx, kiln_dtype_t dt, const kiln_shape_t *shape,
                        void **data, kiln_err_t *err)
{
    uint64_t bytes;
    int rc = kiln_shape_bytes (shape, dt, "folded weight", &bytes, err);
    if (rc)
        return rc;
    if (bytes > KILN_MAX_BLOB_BYTES)
        return s_fail (cx, KILN_ELIMIT, err, "a folded weight of %llu bytes is "
                       "too large", (unsigned long long) bytes);
    size_t map_len = 0;
    uint8_t *buf = s_scratch_alloc (cx, bytes, &map_len, err);
    if (!buf)
        return -err->code;
    int st = s_storage_new (cx, true, -1, bytes, -1, err);
    if (st < 0) {
        if (map_len)
            munmap (buf, map_len);
        else
            free (buf);
        return st;
    }
    cx->st[st].data = buf;
    cx->st[st].map_len = map_len;
    int pt = s_ptensor (cx, dt, shape, KILN_TK_WEIGHT, st, err);
    if (pt < 0)
        return pt;
    *data = buf;
    return pt;
}

int
kiln_cc_made_weight (kiln_cc_ctx_t *cx, const kiln_shape_t *shape, float **data,
                     kiln_err_t *err)
{
    void *d = NULL;
    int pt = kiln_cc_made_weight_dt (cx, KILN_DT_FLOAT32, shape, &d, err);
    if (pt >= 0)
        *data = d;
    return pt;
}

const float *
kiln_cc_const_f32 (const kiln_cc_ctx_t *cx, int gt)
{
    if (gt < 0 || gt >= cx->g->n_tensors)
        return NULL;
    const kiln_tensor_t *t = &cx->g->tensors[gt];
    if (t->dtype != KILN_DT_FLOAT32 || t->weight < 0 || t->weight >= cx->g->n_weights
        || t->shape.rank < 0)
        return NULL;
    const kiln_weight_t *w = &cx->g->weights[t->weight];
    uint64_t bytes = (uint64_t) s_numel (&t->shape) * 4;
    if (!w->data || w->size < bytes)
        return NULL;
    return (const float *) w->data;
}

const uint16_t *
kiln_cc_const_half (const kiln_cc_ctx_t *cx, int gt, kiln_dtype_t *dt)
{
    if (gt < 0 || gt >= cx->g->n_tensors)
        return NULL;
    const kiln_tensor_t *t = &cx->g->tensors[gt];
    if (!kiln_dtype_is_half (t->dtype) || t->weight < 0
        || t->weight >= cx->g->n_weights || t->shape.rank < 0)
        return NULL;
    const kiln_weight_t *w = &cx->g->weights[t->weight];
    uint64_t bytes = (uint64_t) s_numel (&t->shape) * 2;
    if (!w->data || w->size < bytes)
        return NULL;
    *dt = t->dtype;
    return (const uint16_t *) w->data;
}

kiln_dtype_t
kiln_cc_dtype (const kiln_cc_ctx_t *cx, int gt)
{
    return s_dtype (cx, gt);
}

int
kiln_cc_stored (kiln_cc_ctx_t *cx, int gt, kiln_err_t *err)
{
    if (gt < 0 || gt >= cx->g->n_tensors)
        return s_fail (cx, KILN_ECOMPILE, err, "input tensor index %d is "
                       "invalid", gt);
    if (cx->hmap[gt] >= 0)
        return cx->hmap[gt];
    if (s_half (cx, gt) && s_gt (cx, gt)->weight >= 0)
        return s_weight_tensor (cx, gt, err);
    return s_operand (cx, gt, err);
}

int
kiln_cc_round (kiln_cc_ctx_t *cx, int px, int py, kiln_dtype_t dt, kiln_err_t *err)
{
    int op = s_emit (cx, KILN_K_ROUND_HALF, &px, 1, &py, 1, err);
    if (op < 0)
        return op;
    int rc = kiln_prog_op_set_int (&cx->prog->ops[op], "dtype", dt, err);
    return rc < 0 ? rc : op;
}

bool
kiln_cc_available (const kiln_cc_ctx_t *cx, int gt, int node)
{
    if (gt < 0 || gt >= cx->g->n_tensors)
        return false;
    return cx->producer[gt] < node;
}

/* --- views: Identity, Reshape, Flatten ------------------------------- */

/* A view changes the shape, never the bytes.  From -O1 on, the output
 * shares the input's storage (an alias: no kernel runs); at -O0 it is a
 * copy, which keeps every tensor in its own buffer for debugging. */
static int
s_lower_view (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
              kiln_err_t *err)
{
    int x = s_in (node, 0), y = node->n_outputs > 0 ? node->outputs[0] : -1;
    if (x < 0 || y < 0)
        return s_fail (cx, KILN_ECOMPILE, err, "needs one input and one output");
    const kiln_tensor_t *tx = s_gt (cx, x), *ty = s_gt (cx, y);
    if (tx->shape.rank < 0 || ty->shape.rank < 0)
        return s_fail (cx, KILN_ECOMPILE, err, "shapes are not inferred");
    /* (a Cast from a half type to float32 is a view too: both are float32
     * in the program) */
    if (s_dtype (cx, x) != s_dtype (cx, y) || s_numel (&tx->shape) != s_numel (&ty->shape))
        return s_fail (cx, KILN_ECOMPILE, err, "output '%s' does not hold the "
                       "same %s elements as input '%s'", s_tname (cx, y),
                       kiln_dtype_name (tx->dtype), s_tname (cx, x));
    int px = s_operand (cx, x, err);
    if (px < 0)
        return px;
    if (cx->opts.optlevel >= 1) {
        if (cx->tmap[y] >= 0)
            return s_fail (cx, KILN_ECOMPILE, err, "tensor '%s' is produced "
                           "twice", s_tname (cx, y));
        kiln_tensor_kind_t kind = cx->prog->tensors[px].kind == KILN_TK_WEIGHT
                                  ? KILN_TK_WEIGHT : KILN_TK_TEMP;
        kiln_shape_t ys = ty->shape;
        if (cx->cl[y])
            s_cl_shape (&ys);
        int py = s_ptensor (cx, cx->prog->tensors[px].dtype, &ys, kind,
                            cx->storage_of[px], err);
        if (py < 0)
            return py;
        cx->tmap[y] = py;
        return 0;
    }
    int py = s_result (cx, y, err);
    if (py < 0)
        return py;
    int op = s_emit (cx, KILN_K_COPY, &px, 1, &py, 1, err);
    return op < 0 ? op : 0;
}

int
kiln_cc_lower_view (kiln_cc_ctx_t *cx, const kiln_node_t *node,
                    kiln_kernel_t k, kiln_err_t *err)
{
    return s_lower_view (cx, node, k, err);
}

/* --- elementwise ---------------------------------------------------- */

/* numpy broadcasting of a and b into out; false when incompatible. */
static bool
s_broadcast (const kiln_shape_t *a, const kiln_shape_t *b, kiln_shape_t *out)
{
    int r = a->rank > b->rank ? a->rank : b->rank;
    out->rank = r;
    for (int i = 0; i < r; i++) {
        int ia = i - (r - a->rank), ib = i - (r - b->rank);
        int64_t da = ia >= 0 ? a->dims[ia] : 1;
        int64_t db = ib >= 0 ? b->dims[ib] : 1;
        if (da != db && da != 1 && db != 1)
            return false;
        out->dims[i] = da == 1 ? db : da;
    }
    return true;
}

/* `s` right-aligned to rank `r` with leading 1s. */
static void
s_pad_dims (const kiln_shape_t *s, int r, int64_t *out)
{
    for (int i = 0; i < r; i++) {
        int j = i - (r - s->rank);
        out[i] = j >= 0 ? s->dims[j] : 1;
    }
}

static int
s_lower_unary (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
               kiln_err_t *err)
{
    int x = s_in (node, 0), y = node->n_outputs > 0 ? node->outputs[0] : -1;
    int all[2] = { x, y };
    if (x < 0 || y < 0)
        return s_fail (cx, KILN_ECOMPILE, err, "needs an input and an output");
    int rc = s_need_f32 (cx, all, 2, err);
    if (rc)
        return rc;
    if ((rc = s_expect_shape (cx, y, &s_gt (cx, x)->shape, err)))
        return rc;
    int px = s_operand (cx, x, err);
    if (px < 0)
        return px;
    int py = s_result (cx, y, err);
    if (py < 0)
        return py;
    int op = s_emit (cx, k, &px, 1, &py, 1, err);
    return op < 0 ? op : 0;
}

/* --- fusion (kiln_cc_fuse.h) ---------------------------------------- */

/* Append the residual the node's fusion adds, if any. */
static int
s_fused_operands (kiln_cc_ctx_t *cx, const kiln_cc_fusion_t *f, int *ins,
                  int *n_in, kiln_err_t *err)
{
    if (f->residual < 0)
        return 0;
    int r = s_operand (cx, f->residual, err);
    if (r < 0)
        return r;
    ins[(*n_in)++] = r;
    return 0;
}

/* The parameters of the fused epilogue (docs/program-format.md). */
int
kiln_cc_fused_params (kiln_cc_ctx_t *cx, int op, const kiln_cc_fusion_t *f,
                      kiln_err_t *err)
{
    kiln_prog_op_t *o = &cx->prog->ops[op];
    int rc;
    if (f->residual >= 0 && (rc = kiln_prog_op_set_int (o, "residual", 1, err)))
        return rc;
    if (f->act == KILN_ACT_NONE)
        return 0;
    if ((rc = kiln_prog_op_set_int (o, "activation", f->act, err)))
        return rc;
    bool two = f->act == KILN_ACT_CLIP || f->act == KILN_ACT_HARD_SIGMOID;
    if ((two || f->act == KILN_ACT_LEAKY)
        && (rc = kiln_prog_op_set_float (o, "act_alpha", f->act_a, err)))
        return rc;
    if (two
        && (rc = kiln_prog_op_set_float (o, "act_beta", f->act_b, err)))
        return rc;
    return 0;
}

/* Fold BatchNormalization node `bn` into a Gemm: op(B) (b as stored, tb
 * when transposed) scaled per column into *bf [k, n], and the bias per
 * column (beta·C − mean)·s + B_bn into *cf [n], with s = scale /
 * sqrt(var + epsilon), in double.  `c` has cn elements: 0 (no C), 1 or n.
 * Caller frees *bf and *cf. */
static int
s_fold_bn_gemm (kiln_cc_ctx_t *cx, int bn, const float *b, bool tb, int64_t k,
                int64_t n, const float *c, int64_t cn, double beta, float **bf,
                float **cf, kiln_err_t *err)
{
    const kiln_node_t *nd = &cx->g->nodes[bn];
    const float *scale = kiln_cc_const_f32 (cx, nd->inputs[1]);
    const float *bb = kiln_cc_const_f32 (cx, nd->inputs[2]);
    const float *mean = kiln_cc_const_f32 (cx, nd->inputs[3]);
    const float *var = kiln_cc_const_f32 (cx, nd->inputs[4]);
    double eps = kiln_node_attr_float (nd, "epsilon", 1e-5);
    if (!b || !scale || !bb || !mean || !var || (cn > 0 && !c))
        return s_fail (cx, KILN_ECOMPILE, err, "internal error: batch norm "
                       "folding needs constants");
    *bf = malloc ((size_t) (k * n) * sizeof **bf + 1);
    *cf = malloc ((size_t) n * sizeof **cf + 1);
    if (!*bf || !*cf) {
        free (*bf);
        free (*cf);
        *bf = *cf = NULL;
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    for (int64_t j = 0; j < n; j++) {
        double sc = (double) scale[j] / sqrt ((double) var[j] + eps);
        for (int64_t i = 0; i < k; i++)
            (*bf)[i * n + j] = (float) ((double) (tb ? b[j * k + i] : b[i * n + j]) * sc);
        double cv = cn == 0 ? 0.0 : beta * (double) c[cn == 1 ? 0 : j];
        (*cf)[j] = (float) ((cv - (double) mean[j]) * sc + (double) bb[j]);
    }
    return 0;
}

/* A model whose weights are over this many bytes streams them from
 * memory on every run: they do not stay in the caches from one run to
 * the next.  (Four 3×3 256 → 256 convolutions at 14 × 14, 38 MiB of
 * transformed weights, kept theirs on this project's VMs; resnet50,
 * 98 MiB of weights and about 160 with the transformed ones, did not.) */
#define S_STREAMED_BYTES ((uint64_t) 64 << 20)

/* A point's transformed weights, c · m floats streamed from memory, cost
 * about as much time as the products of this many tiles with them (c · m
 * multiply-adds a tile): 4 bytes a weight at the 7-8 GB/s one core
 * streams in a model against 2 flops a tile at 180-200 GFLOP/s gives 45;
 * taken lower, so that only outputs of 16 × 16 and less change tile. */
#define S_WINO_STREAM_TILES 32

/* The Winograd output tile for an oh x ow output: F(4x4, 3x3) does 36
 * products per 16 outputs where F(2x2, 3x3) does 16 per 4, but the
 * runtime computes blocks of 16 or 32 tiles, so on small outputs the
 * larger tile wastes more than it saves: pick the fewer products,
 * counting the padding of the last block, and, when the model's weights
 * are `streamed` from memory, the transformed weights' bytes (36 points'
 * against 16).  resnet50's six 256 → 256 at 14 × 14 (9.4 MiB each by
 * F(4x4), 4.2 by F(2x2)): 0.95-0.99 ms by F(2x2) against 1.13-1.32 by
 * F(4x4) in the model, the model 0.980-0.988 of the time at 1 thread
 * and 0.986-0.995 at 2 (two artifacts taking turns, median of the
 * pairs, two runs); with the weights in cache (four such convolutions
 * alone) F(4x4) is the faster, by 1.086. */
static int
s_wino_tile (int64_t oh, int64_t ow, bool streamed)
{
    int64_t best = 0;
    int pick = 2;
    for (int t = 2; t <= 4; t += 2) {
        int64_t tiles = ((oh + t - 1) / t) * ((ow + t - 1) / t);
        int64_t nb = tiles >= KILN_PACK_NR ? KILN_PACK_NR : KILN_PACK_NR / 2;
        int64_t work = KILN_PACK_WINO_POINTS (t)
                       * ((tiles + nb - 1) / nb * nb + (streamed ? S_WINO_STREAM_TILES : 0));
        if (t == 2 || work < best) {
            best = work;
            pick = t;
        }
    }
    return pick;
}

/* Whether Winograd pays on an oh × ow output of m channels from c by
 * F(2x2, 3x3) (s_wino_tile's pick for small outputs): not on one block
 * of 16 tiles or fewer (a 7 × 7 or 8 × 8 output) when its transformed
 * weights, 16/9 of the direct ones, are over 1 MiB: each transformed
 * weight then serves 16 tiles, and the weights, streamed from memory in a
 * model too large for the cache, cost more than the 2.25 times fewer
 * products save.  resnet50's 512 → 512 at 7 × 7 (16 MiB transformed):
 * 1.80 ms by Winograd against 1.40-1.45 direct inside the model, level
 * (1.15 ms) when the weights stay in cache; 128 → 128 (1 MiB) gains 6 %
 * by Winograd even then.  F(4x4, 3x3), four times fewer products, still
 * wins on its 16 tiles of a 14 × 14 output (0.77 against 1.28 ms). */
static bool
s_wino_pays (int64_t c, int64_t m, int64_t oh, int64_t ow, int tile)
{
    int64_t tiles = ((oh + tile - 1) / tile) * ((ow + tile - 1) / tile);
    /* Nor with few input channels: c is the k of every point's product,
     * and on short k the tiles' stores and the two transforms outweigh
     * the products saved, unless the plane is large.  One-op models,
     * Winograd against direct (-O3 against -O2, relu fused, 1 thread):
     * from 16 channels 1.10-2.24 on every plane up to 112 × 112; from 32
     * 1.05-1.66 up to 40 × 40, 0.93 at 56 × 56 and 0.69 at 112 × 112;
     * from 48 1.01 at 28 × 28, 0.78 at 56 × 56; from 64 1.20 at 14 × 14,
     * 1.08 at 27 × 27, 0.88 at 28 × 28 and 0.63-0.77 from 40 × 40; from
     * 80 0.86 at 14 × 14 (squeezenet's and googlenet's narrow 3×3 layers
     * had lost up to 1.3 times their time). */
    int64_t positions = oh * ow;
    if (c < 32 || (c < 64 && positions < 56 * 56) || (c < 80 && positions < 28 * 28))
        return false;
    /* F(2x2) on one block of 16 tiles (a 7 × 7 or 8 × 8 output) lost
     * below 128 input channels: 96 → 96 1.37, 64 → 128 1.43. */
    if (tile == 2 && tiles <= KILN_PACK_NR / 2 && c < 128)
        return false;
    /* Nor on one block of 16 tiles to 32 output channels or fewer: the
     * input's transform, for every input channel, outweighs the products
     * it saves; densenet121's 128 → 32 at 14 × 14 took 0.260 ms by
     * F(4x4) against 0.236 direct, at 7 × 7 0.103 by F(2x2) against
     * 0.066 (at 28 × 28, 49 tiles, still 0.535 against 0.554). */
    if (tiles <= KILN_PACK_NR / 2 && m <= 32)
        return false;
    return tile != 2 || tiles > KILN_PACK_NR / 2
           || (double) c * (double) m * KILN_PACK_WINO_POINTS (2) * 4.0 <= 1024.0 * 1024.0;
}

#define S_TRANS_GATHER 9

/* A convolution's product runs transposed (output positions as the rows
 * of the engine's 8 × 32 tiles, output channels along the 32) when that
 * computes clearly fewer padding elements (a 7×7 output is 49 positions,
 * 56 as rows but 64 as columns; a 14×14 one 200 against 224) and each
 * output sums enough products (k, the input channels times the kernel's
 * taps) to pay for its transposed store and for gathering the input's
 * positions into rows: k of 512, or 128 on planes of 64 positions or
 * fewer, whose columns would be mostly padding (49 in 64).  Measured on
 * one-op models, pointwise: transposed wins from k = 512 (512→2048 at
 * 7×7: 0.55 against 0.71 ms; 960→160: 0.090 against 0.110), is level
 * from 160 to 576 at 14×14, and loses below (64→384 at 14×14: 0.085
 * against 0.060 ms; 96→576: 0.165 against 0.129); in mobilenet_v2,
 * 320→1280 at 7×7 took 0.29 ms transposed and 0.49 ms not. */
static bool
s_conv_trans (int64_t mg, int64_t positions, int64_t k, int64_t taps, bool inplace)
{
    int64_t mr = KILN_PACK_MR, nr = KILN_PACK_NR;
    int64_t normal = (positions + nr - 1) / nr * nr * ((mg + mr - 1) / mr * mr);
    int64_t trans = (positions + mr - 1) / mr * mr * ((mg + nr - 1) / nr * nr);
    if (!((k >= 512 || (k >= 128 && positions <= 64)) && trans * 20 < normal * 19))
        return false;
    /* With several taps the rows of the transposed product are gathered
     * element by element (an output position's inputs lie a plane apart),
     * where the untransposed gather copies runs of positions: about
     * S_TRANS_GATHER multiply-adds of the product's time more per element
     * gathered, which the padding saved (per step of k) must pay for.
     * Chains of 3×3 convolutions from 128 channels (weights cold, 1
     * thread, ms a convolution transposed against not): at 14×14 to 32
     * channels 0.248 against 0.198, to 64 0.383 against 0.262, to 128
     * 0.494 against 0.513; at 7×7 to 64 0.075 against 0.083, to 32 level;
     * 9 is between the bounds these set (7.8 and 10.4).  Nothing is
     * gathered where the runtime reads the rows in place (`inplace`,
     * s_conv_inplace): DenseNet's 128 → 32 at 14×14 then took 0.135 ms
     * transposed against 0.182 not, at 7×7 0.049 against 0.068. */
    return taps == 1 || inplace || normal - trans > positions * S_TRANS_GATHER;
}

/* Winograd-T (the tiles as the rows of the engine's tiles, in panels of
 * 8 or 7; output channels along the 32 columns) when it computes clearly
 * fewer tile-channel products than the tiles as columns (blocks of 32
 * tiles, or 16 for fewer): each transposed tile costs about 170 cycles
 * more to store, against 16 per input channel of its product (measured:
 * a 28 × 28 output, 49 tiles in 7 panels of 7 against 64 columns, gains
 * 8 % with 128 channels; a 56 × 56 one, 196 tiles against 224, loses
 * with 64). */
static bool
s_wino_trans (int64_t c, int64_t m, int64_t oh, int64_t ow, int tile)
{
    int64_t tiles = ((oh + tile - 1) / tile) * ((ow + tile - 1) / tile);
    int64_t nb = tiles >= KILN_PACK_NR ? KILN_PACK_NR : KILN_PACK_NR / 2;
    int64_t r7 = (tiles + 6) / 7 * 7, r8 = (tiles + 7) / 8 * 8;
    double cc = (double) (c < 512 ? c : 512);
    double normal = (double) ((tiles + nb - 1) / nb * nb * ((m + 7) / 8 * 8))
                    * (16.0 * cc + 30.0);
    double trans = (double) ((r7 < r8 ? r7 : r8) * ((m + 31) / 32 * 32))
                   * (16.0 * cc + 200.0);
    return trans < normal;
}

/* Fold BatchNormalization node `bn` into a convolution's constant weights
 * w[m, per] and bias b[m] (or none): W' = W·s, B' = (B − mean)·s + beta
 * with s = scale / sqrt(var + epsilon), in double.  Caller frees *wf, *bf. */
static int
s_fold_bn (kiln_cc_ctx_t *cx, int bn, const float *w, const float *b, int64_t m,
           int64_t per, float **wf, float **bf, kiln_err_t *err)
{
    const kiln_node_t *n = &cx->g->nodes[bn];
    const float *scale = kiln_cc_const_f32 (cx, n->inputs[1]);
    const float *beta = kiln_cc_const_f32 (cx, n->inputs[2]);
    const float *mean = kiln_cc_const_f32 (cx, n->inputs[3]);
    const float *var = kiln_cc_const_f32 (cx, n->inputs[4]);
    double eps = kiln_node_attr_float (n, "epsilon", 1e-5);
    if (!w || !scale || !beta || !mean || !var)
        return s_fail (cx, KILN_ECOMPILE, err, "internal error: batch norm "
                       "folding needs constants");
    *wf = malloc ((size_t) (m * per) * sizeof **wf + 1);
    *bf = malloc ((size_t) m * sizeof **bf + 1);
    if (!*wf || !*bf) {
        free (*wf);
        free (*bf);
        *wf = *bf = NULL;
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    for (int64_t o = 0; o < m; o++) {
        double sc = (double) scale[o] / sqrt ((double) var[o] + eps);
        for (int64_t j = 0; j < per; j++)
            (*wf)[o * per + j] = (float) ((double) w[o * per + j] * sc);
        (*bf)[o] = (float) (((b ? (double) b[o] : 0.0) - (double) mean[o]) * sc
                            + (double) beta[o]);
    }
    return 0;
}

/* --- MatMul and Gemm ------------------------------------------------ */

/* The constant B[k, n] (element (kk, j) at b[kk·rs + j·cs]) as a packed
 * weight (B-packed). */
static int
s_pack_weight_b (kiln_cc_ctx_t *cx, const float *b, int64_t k, int64_t n,
                 int64_t rs, int64_t cs, kiln_err_t *err)
{
    int64_t elems = 0;
    float *pw;
    if (!kiln_pack_b_elems (k, n, &elems) || elems > KILN_MAX_TENSOR_ELEMS)
        return s_fail (cx, KILN_ELIMIT, err, "packed B too large");
    kiln_shape_t ps = { .rank = 1, .dims = { elems } };
    int t = kiln_cc_made_weight (cx, &ps, &pw, err);
    if (t < 0)
        return t;
    kiln_pack_b (b, k, n, rs, cs, pw);
    return t;
}

/* The same for a float16 or bfloat16 B (`dt`): packed as it is, in panels
 * of 2-byte elements, which the engine widens a panel at a time. */
static int
s_pack_weight_b_half (kiln_cc_ctx_t *cx, const uint16_t *b, kiln_dtype_t dt,
                      int64_t k, int64_t n, int64_t rs, int64_t cs, kiln_err_t *err)
{
    int64_t elems = 0;
    void *pw;
    if (!kiln_pack_b_elems (k, n, &elems) || elems > KILN_MAX_TENSOR_ELEMS)
        return s_fail (cx, KILN_ELIMIT, err, "packed B too large");
    kiln_shape_t ps = { .rank = 1, .dims = { elems } };
    int t = kiln_cc_made_weight_dt (cx, dt, &ps, &pw, err);
    if (t < 0)
        return t;
    kiln_pack_b_u16 (b, k, n, rs, cs, pw);
    return t;
}

/* Strides `os` of a MatMul operand or result of shape `sh` (from the
 * fusion pass) as the matmul op takes them: its batch dimensions padded
 * to `brank` (0 for the padding and for axes of size 1), then rows and
 * columns. */
static void
s_mm_strides (const kiln_shape_t *sh, const int64_t *os, int brank, int64_t *st)
{
    int lead = brank - (sh->rank - 2);
    for (int i = 0; i < brank + 2; i++) {
        int d = i - lead;       /* the operand's axis */
        st[i] = d < 0 || (sh->dims[d] == 1 && i < brank) ? 0 : os[d];
    }
}

/* One operand of an attention op: its strides (`<name>_strides`, its
 * batch dims padded to the op's batch rank `r`: 0 where it is
 * broadcast, rows and columns too) in its tensor (the view's source when
 * the fusion took one) and first element (`<name>_offset`). */
static int
s_attn_operand (kiln_cc_ctx_t *cx, int op, const char *name, int gt, int src,
                int64_t off, const int64_t *src_st, int r, kiln_err_t *err)
{
    const kiln_shape_t *sh = &s_gt (cx, gt)->shape;
    int64_t os[KILN_MAX_RANK] = { 0 }, st[KILN_MAX_RANK + 2];
    if (src >= 0)
        memcpy (os, src_st, sizeof os);
    else
        kiln_shape_strides (sh, os);
    s_mm_strides (sh, os, r, st);
    for (int d = 0; d < 2; d++)     /* (a mask may have fewer axes) */
        if (sh->rank - 2 + d >= 0 && sh->dims[sh->rank - 2 + d] == 1)
            st[r + d] = 0;
    char key[32];
    int rc;
    snprintf (key, sizeof key, "%s_strides", name);
    if ((rc = s_set_ints (cx, op, key, st, r + 2, err)))
        return rc;
    snprintf (key, sizeof key, "%s_offset", name);
    return off ? s_set_int (cx, op, key, off, err) : 0;
}

/* The MatMul of an attention's probabilities by V, with the scores'
 * MatMul, scale, mask and Softmax the fusion pass gave it
 * (kiln_cc_fuse.c): one attention op, Y = softmax (alpha·Q·Kᵀ + mask)·V. */
static int
s_lower_attention (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_err_t *err)
{
    const kiln_cc_fusion_t *f2 = &cx->fusion[cx->node], *f1 = &cx->fusion[f2->attn];
    const kiln_node_t *m1 = &cx->g->nodes[f2->attn];
    int q = m1->inputs[0], kt = m1->inputs[1], v = node->inputs[1], y = node->outputs[0];
    const kiln_shape_t *qs = &s_gt (cx, q)->shape, *ks = &s_gt (cx, kt)->shape,
                       *vs = &s_gt (cx, v)->shape, *ys = &s_gt (cx, y)->shape;
    int r = ys->rank - 2, rc;
    int ins[4], n_in = 3;
    if ((ins[0] = s_operand (cx, f1->src[0] >= 0 ? f1->src[0] : q, err)) < 0)
        return ins[0];
    if ((ins[1] = s_operand (cx, f1->src[1] >= 0 ? f1->src[1] : kt, err)) < 0)
        return ins[1];
    if ((ins[2] = s_operand (cx, f2->src[1] >= 0 ? f2->src[1] : v, err)) < 0)
        return ins[2];
    if (f2->attn_mask >= 0 && (ins[n_in++] = s_operand (cx, f2->attn_mask, err)) < 0)
        return ins[n_in - 1];
    int py = s_result (cx, f2->out >= 0 ? f2->out : y, err);
    if (py < 0)
        return py;
    int op = s_emit (cx, KILN_K_ATTENTION, ins, n_in, &py, 1, err);
    if (op < 0)
        return op;
    if ((rc = s_set_int (cx, op, "m", qs->dims[qs->rank - 2], err))
        || (rc = s_set_int (cx, op, "k", qs->dims[qs->rank - 1], err))
        || (rc = s_set_int (cx, op, "n", ks->dims[ks->rank - 1], err))
        || (rc = s_set_int (cx, op, "nv", vs->dims[vs->rank - 1], err))
        || (rc = s_set_ints (cx, op, "batch", ys->dims, r, err))
        || (rc = s_attn_operand (cx, op, "q", q, f1->src[0], f1->src_off[0], f1->src_st[0],
                                 r, err))
        || (rc = s_attn_operand (cx, op, "kt", kt, f1->src[1], f1->src_off[1],
                                 f1->src_st[1], r, err))
        || (rc = s_attn_operand (cx, op, "v", v, f2->src[1], f2->src_off[1], f2->src_st[1],
                                 r, err))
        || (f2->attn_mask >= 0
            && (rc = s_attn_operand (cx, op, "mask", f2->attn_mask, -1, 0, NULL, r, err))))
        return rc;
    if (f2->y_strided) {
        int64_t st[KILN_MAX_RANK + 2];
        s_mm_strides (ys, f2->y_st, r, st);
        if ((rc = s_set_ints (cx, op, "y_strides", st, r + 2, err)))
            return rc;
    }
    if (f1->alpha != 1.0
        && (rc = kiln_prog_op_set_float (&cx->prog->ops[op], "alpha", f1->alpha, err)))
        return rc;
    return 0;
}

/* numpy matmul: a 1-D operand is a row (A) or a column (B) vector whose
 * unit dimension is dropped from the result; leading dimensions broadcast. */
static int
s_lower_matmul (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                kiln_err_t *err)
{
    int a = s_in (node, 0), b = s_in (node, 1);
    int y = node->n_outputs > 0 ? node->outputs[0] : -1;
    int all[3] = { a, b, y };
    if (a < 0 || b < 0 || y < 0)
        return s_fail (cx, KILN_ECOMPILE, err, "needs two inputs and an output");
    if (cx->fusion[cx->node].attn >= 0)
        return s_lower_attention (cx, node, err);
    int rc = s_need_f32 (cx, all, 3, err);
    if (rc)
        return rc;
    const kiln_shape_t *sa = &s_gt (cx, a)->shape, *sb = &s_gt (cx, b)->shape;
    if (sa->rank < 1 || sb->rank < 1)
        return s_fail (cx, KILN_ESHAPE, err, "operands must have rank >= 1");
    /* Promote 1-D operands to matrices. */
    kiln_shape_t ma = *sa, mb = *sb;
    if (sa->rank == 1) {
        ma.rank = 2;
        ma.dims[0] = 1;
        ma.dims[1] = sa->dims[0];
    }
    if (sb->rank == 1) {
        mb.rank = 2;
        mb.dims[0] = sb->dims[0];
        mb.dims[1] = 1;
    }
    int64_t m = ma.dims[ma.rank - 2], kk = ma.dims[ma.rank - 1];
    int64_t n = mb.dims[mb.rank - 1];
    char s1[128], s2[128];
    if (mb.dims[mb.rank - 2] != kk)
        return s_fail (cx, KILN_ESHAPE, err, "inner dimensions of %s and %s "
                       "differ", kiln_shape_str (sa, s1, sizeof s1),
                       kiln_shape_str (sb, s2, sizeof s2));
    kiln_shape_t ba = ma, bb = mb, batch;
    ba.rank -= 2;
    bb.rank -= 2;
    if (!s_broadcast (&ba, &bb, &batch))
        return s_fail (cx, KILN_ESHAPE, err, "batch dimensions of %s and %s do "
                       "not broadcast", kiln_shape_str (sa, s1, sizeof s1),
                       kiln_shape_str (sb, s2, sizeof s2));
    kiln_shape_t out = batch;
    if (sa->rank > 1)
        out.dims[out.rank++] = m;
    if (sb->rank > 1)
        out.dims[out.rank++] = n;
    if ((rc = s_expect_shape (cx, y, &out, err)))
        return rc;

    /* A constant B that is one matrix is packed for the engine from -O2; a
     * half one as it is, in 2-byte panels. */
    const kiln_cc_fusion_t *f = &cx->fusion[cx->node];
    const float *bdata = kiln_cc_const_f32 (cx, b);
    kiln_dtype_t hdt = KILN_DT_UNDEFINED;
    const uint16_t *hdata = kiln_cc_const_half (cx, b, &hdt);
    int64_t b_mats = 1;             /* B's batch: its dims before the matrix */
    for (int d = 0; d + 2 < sb->rank; d++)
        b_mats *= sb->dims[d];
    bool pack = cx->opts.optlevel >= 2 && (bdata || hdata) && b_mats == 1
                && f->src[1] < 0;
    int ins[4], n_in = 2;
    if ((ins[0] = s_operand (cx, f->src[0] >= 0 ? f->src[0] : a, err)) < 0)
        return ins[0];
    if (f->src[1] >= 0) {
        if ((ins[1] = s_operand (cx, f->src[1], err)) < 0)
            return ins[1];
    } else if (pack) {
        ins[1] = bdata ? s_pack_weight_b (cx, bdata, kk, n, n, 1, err)
                       : s_pack_weight_b_half (cx, hdata, hdt, kk, n, n, 1, err);
        if (ins[1] < 0)
            return ins[1];
    } else if ((ins[1] = s_operand (cx, b, err)) < 0) {
        return ins[1];
    }
    if (f->bias >= 0 && (ins[n_in++] = s_operand (cx, f->bias, err)) < 0)
        return ins[n_in - 1];
    if ((rc = s_fused_operands (cx, f, ins, &n_in, err)))
        return rc;
    int py = s_result (cx, f->out >= 0 ? f->out : y, err);
    if (py < 0)
        return py;
    int op = s_emit (cx, k, ins, n_in, &py, 1, err);
    if (op < 0)
        return op;
    if ((pack && (rc = s_set_int (cx, op, "packed_b", 1, err)))
        || (rc = kiln_cc_fused_params (cx, op, f, err)))
        return rc;
    int64_t pa[KILN_MAX_RANK], pb[KILN_MAX_RANK];
    s_pad_dims (&ba, batch.rank, pa);
    s_pad_dims (&bb, batch.rank, pb);
    if ((rc = s_set_int (cx, op, "m", m, err))
        || (rc = s_set_int (cx, op, "k", kk, err))
        || (rc = s_set_int (cx, op, "n", n, err))
        || (rc = s_set_ints (cx, op, "batch", batch.dims, batch.rank, err))
        || (rc = s_set_ints (cx, op, "batch_a", pa, batch.rank, err))
        || (rc = s_set_ints (cx, op, "batch_b", pb, batch.rank, err)))
        return rc;
    int64_t st[KILN_MAX_RANK + 2];
    for (int w = 0; w < 2; w++) {
        if (f->src[w] < 0)
            continue;
        s_mm_strides (w ? sb : sa, f->src_st[w], batch.rank, st);
        if ((rc = s_set_ints (cx, op, w ? "b_strides" : "a_strides", st,
                              batch.rank + 2, err))
            || (rc = s_set_int (cx, op, w ? "b_offset" : "a_offset", f->src_off[w],
                                err)))
            return rc;
    }
    if (f->y_strided) {
        s_mm_strides (&out, f->y_st, batch.rank, st);
        if ((rc = s_set_ints (cx, op, "y_strides", st, batch.rank + 2, err)))
            return rc;
    }
    if (f->alpha != 1.0
        && (rc = kiln_prog_op_set_float (&cx->prog->ops[op], "alpha", f->alpha, err)))
        return rc;
    return 0;
}

static int
s_lower_gemm (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
              kiln_err_t *err)
{
    int a = s_in (node, 0), b = s_in (node, 1), c = s_in (node, 2);
    int y = node->n_outputs > 0 ? node->outputs[0] : -1;
    int all[4] = { a, b, c, y };
    if (a < 0 || b < 0 || y < 0)
        return s_fail (cx, KILN_ECOMPILE, err, "needs two inputs and an output");
    int rc = s_need_f32 (cx, all, 4, err);
    if (rc)
        return rc;
    const kiln_shape_t *sa = &s_gt (cx, a)->shape, *sb = &s_gt (cx, b)->shape;
    if (sa->rank != 2 || sb->rank != 2)
        return s_fail (cx, KILN_ESHAPE, err, "A and B must be matrices");
    int64_t ta = kiln_node_attr_int (node, "transA", 0);
    int64_t tb = kiln_node_attr_int (node, "transB", 0);
    double alpha = kiln_node_attr_float (node, "alpha", 1.0);
    double beta = kiln_node_attr_float (node, "beta", 1.0);
    int64_t m = ta ? sa->dims[1] : sa->dims[0];
    int64_t kk = ta ? sa->dims[0] : sa->dims[1];
    int64_t kb = tb ? sb->dims[1] : sb->dims[0];
    int64_t n = tb ? sb->dims[0] : sb->dims[1];
    if (kk != kb)
        return s_fail (cx, KILN_ESHAPE, err, "inner dimensions %lld and %lld "
                       "differ", (long long) kk, (long long) kb);
    kiln_shape_t out = { .rank = 2, .dims = { m, n } };
    if ((rc = s_expect_shape (cx, y, &out, err)))
        return rc;
    int64_t cdims[2] = { 1, 1 };
    if (c >= 0) {
        const kiln_shape_t *sc = &s_gt (cx, c)->shape;
        if (sc->rank > 2)
            return s_fail (cx, KILN_ESHAPE, err, "C has rank %d", sc->rank);
        s_pad_dims (sc, 2, cdims);
        if ((cdims[0] != 1 && cdims[0] != m) || (cdims[1] != 1 && cdims[1] != n))
            return s_fail (cx, KILN_ESHAPE, err, "C does not broadcast to "
                           "[%lld, %lld]", (long long) m, (long long) n);
    }
    bool with_c = c >= 0 && beta != 0.0;
    /* A constant B is packed as op(B) for the engine from -O2; a half one
     * as it is, in 2-byte panels. */
    const kiln_cc_fusion_t *f = &cx->fusion[cx->node];
    const float *bdata = kiln_cc_const_f32 (cx, b);
    kiln_dtype_t hdt = KILN_DT_UNDEFINED;
    const uint16_t *hdata = kiln_cc_const_half (cx, b, &hdt);
    float *bfold = NULL, *cfold = NULL;
    if (f->bn >= 0) {
        /* A BatchNormalization after it: op(B) scaled per column, C a
         * bias per column (kiln_cc_fuse.h checked that folding applies) */
        if ((rc = s_fold_bn_gemm (cx, f->bn, bdata, tb != 0, kk, n,
                                  with_c ? kiln_cc_const_f32 (cx, c) : NULL,
                                  with_c ? cdims[0] * cdims[1] : 0, beta, &bfold,
                                  &cfold, err)))
            return rc;
        bdata = bfold;
        tb = 0;                 /* bfold is op(B), [k, n] */
        with_c = true;
        beta = 1.0;
        cdims[0] = 1;
        cdims[1] = n;
    }
    bool pack = cx->opts.optlevel >= 2 && (bdata || hdata);
    int ins[4], n_in = with_c ? 3 : 2;
    if ((ins[0] = s_operand (cx, a, err)) < 0)
        rc = ins[0];
    if (!rc && bfold && !pack) {
        float *nb;
        kiln_shape_t bs = { .rank = 2, .dims = { kk, n } };
        if ((ins[1] = kiln_cc_made_weight (cx, &bs, &nb, err)) < 0)
            rc = ins[1];
        else
            memcpy (nb, bfold, (size_t) (kk * n) * sizeof *nb);
    }
    if (!rc && cfold) {
        float *nc;
        kiln_shape_t cs = { .rank = 2, .dims = { 1, n } };
        if ((ins[2] = kiln_cc_made_weight (cx, &cs, &nc, err)) < 0)
            rc = ins[2];
        else
            memcpy (nc, cfold, (size_t) n * sizeof *nc);
    }
    if (rc) {
        free (bfold);
        free (cfold);
        return rc;
    }
    if (bfold && !pack) {
        /* B is in ins[1] already */
    } else if (pack && bdata) {
        ins[1] = s_pack_weight_b (cx, bdata, kk, n, tb ? 1 : n, tb ? kk : 1, err);
    } else if (pack) {
        ins[1] = s_pack_weight_b_half (cx, hdata, hdt, kk, n, tb ? 1 : n, tb ? kk : 1,
                                       err);
    } else {
        ins[1] = s_operand (cx, b, err);
    }
    free (bfold);
    free (cfold);
    if (ins[1] < 0)
        return ins[1];
    if (with_c && f->bn < 0 && (ins[2] = s_operand (cx, c, err)) < 0)
        return ins[2];
    if ((rc = s_fused_operands (cx, f, ins, &n_in, err)))
        return rc;
    int py = s_result (cx, f->out >= 0 ? f->out : y, err);
    if (py < 0)
        return py;
    int op = s_emit (cx, k, ins, n_in, &py, 1, err);
    if (op < 0)
        return op;
    kiln_prog_op_t *o = &cx->prog->ops[op];
    if ((rc = kiln_prog_op_set_int (o, "trans_a", ta ? 1 : 0, err))
        || (rc = kiln_prog_op_set_int (o, "trans_b", tb && !pack ? 1 : 0, err))
        || (pack && (rc = kiln_prog_op_set_int (o, "packed_b", 1, err)))
        || (rc = kiln_cc_fused_params (cx, op, f, err))
        || (rc = kiln_prog_op_set_int (o, "m", m, err))
        || (rc = kiln_prog_op_set_int (o, "k", kk, err))
        || (rc = kiln_prog_op_set_int (o, "n", n, err))
        || (rc = kiln_prog_op_set_float (o, "alpha", alpha, err)))
        return rc;
    if (with_c
        && ((rc = kiln_prog_op_set_float (o, "beta", beta, err))
            || (rc = kiln_prog_op_set_ints (o, "shape_c", cdims, 2, err))))
        return rc;
    return 0;
}

/* The decomposed LayerNormalization that starts at this ReduceMean
 * (kiln_cc_fuse.h) as one layer_norm. */
static int
s_lower_fused_ln (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_err_t *err)
{
    const kiln_cc_fusion_t *f = &cx->fusion[cx->node];
    int ins[3], rc;
    if ((ins[0] = s_operand (cx, node->inputs[0], err)) < 0)
        return ins[0];
    if ((ins[1] = s_operand (cx, f->ln_scale, err)) < 0)
        return ins[1];
    if ((ins[2] = s_operand (cx, f->ln_bias, err)) < 0)
        return ins[2];
    int py = s_result (cx, f->out, err);
    if (py < 0)
        return py;
    int op = s_emit (cx, KILN_K_LAYER_NORM, ins, 3, &py, 1, err);
    if (op < 0)
        return op;
    if ((rc = s_set_int (cx, op, "axis", f->ln_axis, err))
        || (rc = kiln_prog_op_set_float (&cx->prog->ops[op], "epsilon", f->ln_eps,
                                         err)))
        return rc;
    return 0;
}

/* --- windows: Conv and MaxPool -------------------------------------- */

typedef struct {
    int ns;                         /* spatial dimensions: 1, 2 or 3 */
    int64_t in[3];                  /* input spatial size */
    int64_t kernel[3];
    int64_t strides[3];
    int64_t dilations[3];
    int64_t pads[6];                /* begin..., end... (ONNX order) */
    int64_t out[3];                 /* output spatial size */
} s_window_t;

/* The runtime reads this 1-D or 2-D convolution's positions in place
 * when it runs transposed (kiln_pack_conv_inplace: no gather to pay
 * for). */
static bool
s_conv_inplace (const s_window_t *w, int64_t cg)
{
    if (w->ns < 1 || w->ns > 2)
        return false;
    int a = w->ns - 1;              /* the last spatial axis: columns */
    int64_t kh = w->ns > 1 ? w->kernel[0] : 1;
    int64_t wp = kiln_pack_padded_extent (w->out[a], w->kernel[a], w->strides[a],
                                          w->dilations[a], w->pads[a], w->in[a]);
    return kiln_pack_conv_inplace (cg, kh, w->kernel[a], wp, w->out[a]);
}

/* Resolve strides, dilations, pads and auto_pad of a Conv or MaxPool
 * window whose kernel and input size are already in `w`, and compute the
 * output size (floor; ceil when `ceil_mode`). */
static int
s_resolve_window (kiln_cc_ctx_t *cx, const kiln_node_t *node, s_window_t *w,
                  bool ceil_mode, kiln_err_t *err)
{
    int ns = w->ns, rc;
    if ((rc = s_attr_ints (cx, node, "strides", ns, 1, w->strides, err))
        || (rc = s_attr_ints (cx, node, "dilations", ns, 1, w->dilations, err))
        || (rc = s_attr_ints (cx, node, "pads", 2 * ns, 0, w->pads, err)))
        return rc;
    for (int i = 0; i < ns; i++) {
        if (w->strides[i] < 1 || w->dilations[i] < 1 || w->kernel[i] < 1)
            return s_fail (cx, KILN_ECOMPILE, err, "kernel, strides and "
                           "dilations must be positive");
        if (w->pads[i] < 0 || w->pads[ns + i] < 0)
            return s_fail (cx, KILN_ECOMPILE, err, "pads must not be negative");
        if (w->kernel[i] > KILN_MAX_DIM || w->strides[i] > KILN_MAX_DIM
            || w->dilations[i] > KILN_MAX_DIM || w->pads[i] > KILN_MAX_DIM
            || w->pads[ns + i] > KILN_MAX_DIM)
            return s_fail (cx, KILN_ELIMIT, err, "window parameters too large");
    }
    const char *ap = kiln_node_attr_string (node, "auto_pad", "NOTSET");
    bool same_upper = strcmp (ap, "SAME_UPPER") == 0;
    bool same_lower = strcmp (ap, "SAME_LOWER") == 0;
    if (strcmp (ap, "VALID") == 0) {
        memset (w->pads, 0, sizeof w->pads);
    } else if (same_upper || same_lower) {
        for (int i = 0; i < ns; i++) {
            int64_t out = (w->in[i] + w->strides[i] - 1) / w->strides[i];
            int64_t eff = (w->kernel[i] - 1) * w->dilations[i] + 1;
            int64_t total = (out - 1) * w->strides[i] + eff - w->in[i];
            if (total < 0)
                total = 0;
            int64_t small = total / 2, big = total - small;
            w->pads[i] = same_upper ? small : big;
            w->pads[ns + i] = same_upper ? big : small;
        }
    } else if (strcmp (ap, "NOTSET") != 0 && ap[0] != '\0') {
        return s_fail (cx, KILN_EUNSUPPORTED, err, "auto_pad '%s'", ap);
    }
    for (int i = 0; i < ns; i++) {
        int64_t eff = (w->kernel[i] - 1) * w->dilations[i] + 1;
        int64_t span = w->in[i] + w->pads[i] + w->pads[ns + i] - eff;
        if (span < 0)
            return s_fail (cx, KILN_ESHAPE, err, "window of %lld is larger than "
                           "the padded input of %lld", (long long) eff,
                           (long long) (w->in[i] + w->pads[i] + w->pads[ns + i]));
        w->out[i] = (ceil_mode ? (span + w->strides[i] - 1) : span)
                    / w->strides[i] + 1;
    }
    return 0;
}

/* Window parameters as the 2-D kernels take them: a 1-D window is a 2-D
 * one of height 1. */
static int
s_set_window (kiln_cc_ctx_t *cx, int op, const s_window_t *w, kiln_err_t *err)
{
    int64_t k[2], s[2], d[2], p[4];
    if (w->ns == 1) {
        k[0] = 1; k[1] = w->kernel[0];
        s[0] = 1; s[1] = w->strides[0];
        d[0] = 1; d[1] = w->dilations[0];
        p[0] = 0; p[1] = w->pads[0]; p[2] = 0; p[3] = w->pads[1];
    } else {
        memcpy (k, w->kernel, sizeof k);
        memcpy (s, w->strides, sizeof s);
        memcpy (d, w->dilations, sizeof d);
        memcpy (p, w->pads, sizeof p);
    }
    int rc;
    if ((rc = s_set_ints (cx, op, "kernel", k, 2, err))
        || (rc = s_set_ints (cx, op, "strides", s, 2, err))
        || (rc = s_set_ints (cx, op, "dilations", d, 2, err))
        || (rc = s_set_ints (cx, op, "pads", p, 4, err)))
        return rc;
    return 0;
}

/* Emit kernel k of a product whose fusion is `f` (its residual operand
 * appended to ins[], its output f->out or y, its epilogue's parameters);
 * returns the op. */
static int
s_emit_fused (kiln_cc_ctx_t *cx, const kiln_cc_fusion_t *f, int y, kiln_kernel_t k, int *ins,
              int n_in, kiln_err_t *err)
{
    int rc = s_fused_operands (cx, f, ins, &n_in, err);
    if (rc)
        return rc;
    int py = s_result (cx, f->out >= 0 ? f->out : y, err);
    if (py < 0)
        return py;
    int op = s_emit (cx, k, ins, n_in, &py, 1, err);
    if (op < 0)
        return op;
    if ((rc = kiln_cc_fused_params (cx, op, f, err)))
        return rc;
    return op;
}

/* Append to ins[] the operand of graph tensor gt, or, when the compiler
 * folded new values for it (`fold`, n floats of `shape`), a weight made
 * of them. */
static int
s_folded_operand (kiln_cc_ctx_t *cx, int gt, const float *fold, const kiln_shape_t *shape,
                  int64_t n, int *ins, int *n_in, kiln_err_t *err)
{
    float *nw;
    int t = fold ? kiln_cc_made_weight (cx, shape, &nw, err) : s_operand (cx, gt, err);
    if (t < 0)
        return t;
    if (fold)
        memcpy (nw, fold, (size_t) n * sizeof *nw);
    ins[(*n_in)++] = t;
    return 0;
}

/* kiln_cc_lower.h */
int
kiln_cc_emit_conv (kiln_cc_ctx_t *cx, const kiln_node_t *node, const kiln_cc_fusion_t *f,
             kiln_kernel_t k, int packed, const float *wfold, const float *bfold, int64_t m,
             int64_t per, kiln_err_t *err)
{
    int x = s_in (node, 0), wt = s_in (node, 1), b = s_in (node, 2), y = node->outputs[0];
    int ins[5], n_in = 0, rc = 0;
    const kiln_node_t *pre = f && f->pre_bn >= 0 ? &cx->g->nodes[f->pre_bn] : NULL;
    if (pre)
        x = pre->inputs[0];
    if ((ins[n_in++] = s_operand (cx, x, err)) < 0)
        return ins[0];
    if (f && f->pool >= 0) {
        /* X pooled first (kiln_cc_fuse.h): the pool's output shape with
         * X's channels */
        kiln_shape_t ps = s_gt (cx, cx->g->nodes[f->pool].outputs[0])->shape;
        ps.dims[1] = s_gt (cx, x)->shape.dims[1];
        int pp = kiln_cc_temp (cx, KILN_DT_FLOAT32, &ps, err);
        if (pp < 0 || (rc = kiln_lower_avgpool_op (cx, f->pool, ins[0], pp, err)))
            return pp < 0 ? pp : rc;
        ins[0] = pp;
    }
    if (packed >= 0)
        ins[n_in++] = packed;
    else if ((rc = s_folded_operand (cx, wt, wfold, &s_gt (cx, wt)->shape, m * per, ins,
                                     &n_in, err)))
        return rc;
    kiln_shape_t bs = { .rank = 1, .dims = { m } };
    if ((bfold || b >= 0) && (rc = s_folded_operand (cx, b, bfold, &bs, m, ins, &n_in, err)))
        return rc;
    if (pre) {
        /* X's prologue: [2, C], the BatchNormalization's scale s =
         * scale / sqrt(var + epsilon) and shift beta − mean·s, in double */
        int64_t c = s_gt (cx, x)->shape.dims[1];
        const float *sc = kiln_cc_const_f32 (cx, pre->inputs[1]);
        const float *bb = kiln_cc_const_f32 (cx, pre->inputs[2]);
        const float *mean = kiln_cc_const_f32 (cx, pre->inputs[3]);
        const float *var = kiln_cc_const_f32 (cx, pre->inputs[4]);
        double eps = kiln_node_attr_float (pre, "epsilon", 1e-5);
        kiln_shape_t ps = { .rank = 2, .dims = { 2, c } };
        float *pw;
        if (!sc || !bb || !mean || !var)
            return s_fail (cx, KILN_ECOMPILE, err, "internal error: a prologue "
                           "needs constant statistics");
        if ((ins[n_in] = kiln_cc_made_weight (cx, &ps, &pw, err)) < 0)
            return ins[n_in];
        n_in++;
        for (int64_t i = 0; i < c; i++) {
            double s = (double) sc[i] / sqrt ((double) var[i] + eps);
            pw[i] = (float) s;
            pw[c + i] = (float) ((double) bb[i] - (double) mean[i] * s);
        }
    }
    if (f) {
        int op = s_emit_fused (cx, f, y, k, ins, n_in, err);
        if (op >= 0 && pre
            && (rc = s_set_int (cx, op, "prologue", f->pre_relu >= 0 ? 2 : 1, err)))
            return rc;
        return op;
    }
    int py = s_result (cx, y, err);
    return py < 0 ? py : s_emit (cx, k, ins, n_in, &py, 1, err);
}

/* A 3-D Conv: conv3d (im2col of a group, then the matrix engine), with
 * a BatchNormalization folded into its weights and the fused epilogue. */
static int
s_lower_conv3d (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_err_t *err)
{
    int x = s_in (node, 0), wt = s_in (node, 1), b = s_in (node, 2), y = node->outputs[0];
    const kiln_shape_t *sx = &s_gt (cx, x)->shape, *sw = &s_gt (cx, wt)->shape;
    if (sw->rank != 5)
        return s_fail (cx, KILN_ESHAPE, err, "W has rank %d, X rank 5", sw->rank);
    s_window_t w = { .ns = 3 };
    int64_t ks[3];
    int rc;
    for (int i = 0; i < 3; i++) {
        w.in[i] = sx->dims[2 + i];
        w.kernel[i] = sw->dims[2 + i];
    }
    if ((rc = s_attr_ints (cx, node, "kernel_shape", 3, 0, ks, err)))
        return rc;
    for (int i = 0; i < 3; i++)
        if (kiln_node_attr (node, "kernel_shape") && ks[i] != w.kernel[i])
            return s_fail (cx, KILN_ESHAPE, err, "kernel_shape does not match W");
    if ((rc = s_resolve_window (cx, node, &w, false, err)))
        return rc;
    int64_t group = kiln_node_attr_int (node, "group", 1);
    int64_t n = sx->dims[0], c = sx->dims[1], m = sw->dims[0];
    if (group < 1 || c % group != 0 || m % group != 0 || sw->dims[1] * group != c)
        return s_fail (cx, KILN_ESHAPE, err, "group %lld does not divide %lld input "
                       "channels into W's %lld and %lld output channels", (long long) group,
                       (long long) c, (long long) sw->dims[1], (long long) m);
    if (b >= 0 && (s_gt (cx, b)->shape.rank != 1 || s_gt (cx, b)->shape.dims[0] != m))
        return s_fail (cx, KILN_ESHAPE, err, "bias must have shape [%lld]", (long long) m);
    kiln_shape_t out = { .rank = 5, .dims = { n, m, w.out[0], w.out[1], w.out[2] } };
    if ((rc = s_expect_shape (cx, y, &out, err)))
        return rc;
    const kiln_cc_fusion_t *f = &cx->fusion[cx->node];
    int64_t rows = c / group * w.kernel[0] * w.kernel[1] * w.kernel[2];
    int64_t cols = w.out[0] * w.out[1] * w.out[2];
    float *wfold = NULL, *bfold = NULL;
    if (f->bn >= 0
        && (rc = s_fold_bn (cx, f->bn, kiln_cc_const_f32 (cx, wt),
                            b >= 0 ? kiln_cc_const_f32 (cx, b) : NULL, m, rows, &wfold, &bfold,
                            err)))
        return rc;
    int op = kiln_cc_emit_conv (cx, node, f, KILN_K_CONV3D, -1, wfold, bfold, m, rows, err);
    free (wfold);
    free (bfold);
    if (op < 0)
        return op;
    if ((rc = s_set_ints (cx, op, "kernel", w.kernel, 3, err))
        || (rc = s_set_ints (cx, op, "strides", w.strides, 3, err))
        || (rc = s_set_ints (cx, op, "dilations", w.dilations, 3, err))
        || (rc = s_set_ints (cx, op, "pads", w.pads, 6, err))
        || (rc = s_set_int (cx, op, "group", group, err)))
        return rc;
    bool pointwise = true;
    for (int i = 0; i < 3; i++)
        pointwise = pointwise && w.kernel[i] == 1 && w.strides[i] == 1 && w.pads[i] == 0
                    && w.pads[3 + i] == 0;
    uint64_t elems;
    if (!pointwise) {
        if (rows > KILN_MAX_TENSOR_ELEMS || cols > KILN_MAX_TENSOR_ELEMS
            || !kiln_prog_mul_u64 ((uint64_t) rows, (uint64_t) cols, &elems))
            return s_fail (cx, KILN_ELIMIT, err, "im2col workspace too large");
        if ((rc = s_scratch (cx, op, elems, err)))
            return rc;
    }
    return 0;
}

static int
s_lower_conv (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
              kiln_err_t *err)
{
    int x = s_in (node, 0), wt = s_in (node, 1), b = s_in (node, 2);
    int y = node->n_outputs > 0 ? node->outputs[0] : -1;
    int all[4] = { x, wt, b, y };
    if (x < 0 || wt < 0 || y < 0)
        return s_fail (cx, KILN_ECOMPILE, err, "needs X, W and an output");
    int rc = s_need_f32 (cx, all, 4, err);
    if (rc)
        return rc;
    const kiln_shape_t *sx = &s_gt (cx, x)->shape, *sw = &s_gt (cx, wt)->shape;
    if (sx->rank == 5)
        return s_lower_conv3d (cx, node, err);
    if (sx->rank != 3 && sx->rank != 4)
        return s_fail (cx, KILN_EUNSUPPORTED, err, "%d-D convolution (only 1-D, "
                       "2-D and 3-D are supported)", sx->rank - 2);
    if (sw->rank != sx->rank)
        return s_fail (cx, KILN_ESHAPE, err, "W has rank %d, X rank %d",
                       sw->rank, sx->rank);
    s_window_t w = { .ns = sx->rank - 2 };
    for (int i = 0; i < w.ns; i++) {
        w.in[i] = sx->dims[2 + i];
        w.kernel[i] = sw->dims[2 + i];
    }
    int64_t ks[2];
    if ((rc = s_attr_ints (cx, node, "kernel_shape", w.ns, 0, ks, err)))
        return rc;
    for (int i = 0; i < w.ns; i++)
        if (kiln_node_attr (node, "kernel_shape") && ks[i] != w.kernel[i])
            return s_fail (cx, KILN_ESHAPE, err, "kernel_shape does not match W");
    if ((rc = s_resolve_window (cx, node, &w, false, err)))
        return rc;
    int64_t group = kiln_node_attr_int (node, "group", 1);
    int64_t n = sx->dims[0], c = sx->dims[1], m = sw->dims[0];
    if (group < 1 || c % group != 0 || m % group != 0
        || sw->dims[1] * group != c)
        return s_fail (cx, KILN_ESHAPE, err, "group %lld does not divide %lld "
                       "input channels into W's %lld and %lld output channels",
                       (long long) group, (long long) c,
                       (long long) sw->dims[1], (long long) m);
    if (b >= 0) {
        const kiln_shape_t *sbias = &s_gt (cx, b)->shape;
        if (sbias->rank != 1 || sbias->dims[0] != m)
            return s_fail (cx, KILN_ESHAPE, err, "bias must have shape [%lld]",
                           (long long) m);
    }
    kiln_shape_t out = { .rank = sx->rank, .dims = { n, m } };
    for (int i = 0; i < w.ns; i++)
        out.dims[2 + i] = w.out[i];
    if ((rc = s_expect_shape (cx, y, &out, err)))
        return rc;

    const kiln_cc_fusion_t *f = &cx->fusion[cx->node];
    int64_t cg = c / group;
    int64_t per = cg;                   /* weights per output channel */
    for (int i = 0; i < w.ns; i++)
        per *= w.kernel[i];
    const float *wdata = kiln_cc_const_f32 (cx, wt);
    const float *bdata = b >= 0 ? kiln_cc_const_f32 (cx, b) : NULL;
    /* One input channel per group runs the direct depthwise loops from
     * -O2 on; other convolutions with constant weights get them packed
     * for the matrix-product engine. */
    bool depthwise = cg == 1 && cx->opts.optlevel >= 2;
    bool pack = cx->opts.optlevel >= 2 && wdata && !depthwise;
    /* -O3: 3x3 stride-1 convolutions by Winograd F(2x2, 3x3), when there
     * are enough channels for the transforms to pay off. */
    bool wino = cx->opts.optlevel >= 3 && pack && group == 1 && w.ns == 2
                && w.kernel[0] == 3 && w.kernel[1] == 3 && w.strides[0] == 1
                && w.strides[1] == 1 && w.dilations[0] == 1 && w.dilations[1] == 1
                && c >= 16 && m >= 16
                /* a few tiles of 2x2 at least: the transformed weights
                 * are 16/9 of the direct ones to stream */
                && ((w.out[0] + 1) / 2) * ((w.out[1] + 1) / 2) >= 8;
    int tile = wino ? s_wino_tile (w.out[0], w.out[1], cx->weight_bytes > S_STREAMED_BYTES)
                    : 0;
    if (wino && !s_wino_pays (c, m, w.out[0], w.out[1], tile))
        wino = false, tile = 0;
    int64_t positions = w.out[0] * (w.ns > 1 ? w.out[1] : 1);
    if (f->pool >= 0) {
        const kiln_shape_t *ps = &s_gt (cx, cx->g->nodes[f->pool].outputs[0])->shape;
        positions = ps->dims[2] * ps->dims[3];
    }
    bool trans = pack && (wino ? s_wino_trans (c, m, w.out[0], w.out[1], tile)
                               : s_conv_trans (m / group, positions, per, per / cg,
                                               f->pool < 0 && s_conv_inplace (&w, cg)));
    /* channels-last X or Y (kiln_cc_layout.h): a depthwise convolution
     * both ways with its weights tap-major, or a packed-T product */
    bool x_cl = cx->cl[f->pre_bn >= 0 ? cx->g->nodes[f->pre_bn].inputs[0] : x];
    bool y_cl = cx->cl[f->out >= 0 ? f->out : y];
    if (f->pre_bn >= 0 && (!pack || x_cl))
        return s_fail (cx, KILN_ECOMPILE, err, "internal error: a prologue "
                       "without packed weights or from channels-last");
    if ((x_cl || y_cl)
        && (depthwise ? !(x_cl && y_cl && m == c) : !pack || wino || group != 1))
        return s_fail (cx, KILN_ECOMPILE, err, "channels-last where the "
                       "convolution cannot take it");
    if (x_cl || y_cl)
        trans = pack;
    float *wfold = NULL, *bfold = NULL;
    if (f->bn >= 0 && (rc = s_fold_bn (cx, f->bn, wdata, bdata, m, per, &wfold,
                                       &bfold, err)))
        return rc;
    if (wfold)
        wdata = wfold;

    int packed = -1;
    if (pack) {
        int64_t elems = 0;
        float *pw;
        kiln_shape_t ps = { .rank = 1 };
        int64_t kw1 = w.ns > 1 ? w.kernel[1] : 1;
        if (!(wino ? (trans ? kiln_pack_wino_t_elems (m, c, tile, &elems)
                            : kiln_pack_wino_elems (m, c, tile, &elems))
              : trans ? kiln_pack_conv_t_elems (m, cg, w.kernel[0], kw1, group,
                                                &elems)
              : kiln_pack_conv_elems (m, cg, w.kernel[0], kw1, group, &elems))
            || elems > KILN_MAX_TENSOR_ELEMS)
            rc = s_fail (cx, KILN_ELIMIT, err, "packed weights too large");
        ps.dims[0] = elems;
        if (!rc && (packed = kiln_cc_made_weight (cx, &ps, &pw, err)) < 0)
            rc = packed;
        if (!rc && wino && trans)
            kiln_pack_wino_t (wdata, m, c, tile, pw);
        else if (!rc && wino)
            kiln_pack_wino (wdata, m, c, tile, pw);
        else if (!rc && trans)
            kiln_pack_conv_t (wdata, m, cg, w.kernel[0], kw1, group, pw);
        else if (!rc)
            kiln_pack_conv (wdata, m, cg, w.kernel[0], w.ns > 1 ? w.kernel[1] : 1,
                            group, pw);
    }
    if (!rc && depthwise && x_cl) {
        /* tap-major: [kh, kw, M] */
        kiln_shape_t ps = { .rank = 1, .dims = { m * per } };
        float *pw;
        if ((packed = kiln_cc_made_weight (cx, &ps, &pw, err)) < 0)
            rc = packed;
        for (int64_t o = 0; !rc && o < m; o++)
            for (int64_t t = 0; t < per; t++)
                pw[t * m + o] = wdata[o * per + t];
    }
    int op = rc ? rc : kiln_cc_emit_conv (cx, node, f, k, packed, wfold, bfold, m, per, err);
    free (wfold);
    free (bfold);
    if (op < 0)
        return op;
    if ((x_cl || y_cl)
        && (rc = s_set_int (cx, op, "layout", (x_cl ? 1 : 0) | (y_cl ? 2 : 0), err)))
        return rc;
    if ((rc = s_set_window (cx, op, &w, err))
        || (rc = s_set_int (cx, op, "group", group, err))
        || (pack && (rc = s_set_int (cx, op, wino ? "winograd" : "packed",
                                     wino ? tile : 1, err)))
        || (trans && (rc = s_set_int (cx, op, "transposed", 1, err))))
        return rc;
    /* A 1x1, stride-1, unpadded convolution is a plain matrix product over
     * the input as it is; packed weights and the depthwise loops read the
     * input in place too; any other needs the im2col workspace. */
    bool direct = pack || depthwise;
    bool pointwise = true;
    for (int i = 0; i < w.ns; i++)
        if (w.kernel[i] != 1 || w.strides[i] != 1 || w.pads[i] != 0
            || w.pads[w.ns + i] != 0)
            pointwise = false;
    if (!direct && !pointwise) {
        uint64_t rows = (uint64_t) (c / group), cols = 1;
        for (int i = 0; i < w.ns; i++) {
            rows *= (uint64_t) w.kernel[i];
            cols *= (uint64_t) w.out[i];
            if (rows > (uint64_t) KILN_MAX_TENSOR_ELEMS
                || cols > (uint64_t) KILN_MAX_TENSOR_ELEMS)
                return s_fail (cx, KILN_ELIMIT, err, "im2col workspace too large");
        }
        uint64_t elems;
        if (!kiln_prog_mul_u64 (rows, cols, &elems))
            return s_fail (cx, KILN_ELIMIT, err, "im2col workspace too large");
        if ((rc = s_scratch (cx, op, elems, err)))
            return rc;
    }
    return 0;
}

static int
s_lower_maxpool (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
                 kiln_err_t *err)
{
    int x = s_in (node, 0), y = node->n_outputs > 0 ? node->outputs[0] : -1;
    int all[2] = { x, y };
    if (x < 0 || y < 0)
        return s_fail (cx, KILN_ECOMPILE, err, "needs an input and an output");
    if (node->n_outputs > 1 && node->outputs[1] >= 0)
        return s_fail (cx, KILN_EUNSUPPORTED, err, "the Indices output");
    int rc = s_need_f32 (cx, all, 2, err);
    if (rc)
        return rc;
    if (kiln_node_attr_int (node, "storage_order", 0) != 0)
        return s_fail (cx, KILN_EUNSUPPORTED, err, "storage_order 1");
    const kiln_shape_t *sx = &s_gt (cx, x)->shape;
    if (sx->rank == 5)
        return kiln_lower_shape_pool3d (cx, node, KILN_K_POOL3D, err);
    if (sx->rank != 3 && sx->rank != 4)
        return s_fail (cx, KILN_EUNSUPPORTED, err, "%d-D pooling (only 1-D, 2-D "
                       "and 3-D are supported)", sx->rank - 2);
    /* A 1-D pool is a 2-D one of height 1 (s_set_window). */
    s_window_t w = { .ns = sx->rank - 2 };
    const kiln_attr_t *ks = kiln_node_attr (node, "kernel_shape");
    if (!ks || ks->kind != KILN_ATTR_INTS || ks->n != (size_t) w.ns)
        return s_fail (cx, KILN_ECOMPILE, err, "kernel_shape must hold %d "
                       "integers", w.ns);
    for (int i = 0; i < w.ns; i++) {
        w.in[i] = sx->dims[2 + i];
        w.kernel[i] = ks->ints[i];
    }
    bool ceil_mode = kiln_node_attr_int (node, "ceil_mode", 0) != 0;
    s_window_t wf = w;
    if ((rc = s_resolve_window (cx, node, &wf, false, err))
        || (rc = s_resolve_window (cx, node, &w, ceil_mode, err)))
        return rc;
    /* With ceil_mode, PyTorch drops a last window that would start in the
     * end padding, ONNX's reference does not: accept either, as the
     * runtime does (every window is clamped to the input). */
    const kiln_shape_t *sy = &s_gt (cx, y)->shape;
    kiln_shape_t out = { .rank = sx->rank, .dims = { sx->dims[0], sx->dims[1],
                                                     w.out[0], w.out[1] } };
    for (int i = 0; ceil_mode && i < w.ns; i++)
        if (sy->rank == sx->rank && sy->dims[2 + i] >= wf.out[i]
            && sy->dims[2 + i] <= w.out[i])
            out.dims[2 + i] = sy->dims[2 + i];
    if ((rc = s_expect_shape (cx, y, &out, err)))
        return rc;
    int px = s_operand (cx, x, err);
    if (px < 0)
        return px;
    int py = s_result (cx, y, err);
    if (py < 0)
        return py;
    int op = s_emit (cx, k, &px, 1, &py, 1, err);
    if (op < 0)
        return op;
    if ((rc = s_set_window (cx, op, &w, err))
        || (rc = s_set_int (cx, op, "ceil_mode", ceil_mode, err)))
        return rc;
    return 0;
}

static int
s_lower_gap (kiln_cc_ctx_t *cx, const kiln_node_t *node, kiln_kernel_t k,
             kiln_err_t *err)
{
    int x = s_in (node, 0), y = node->n_outputs > 0 ? node->outputs[0] : -1;
    int all[2] = { x, y };
    if (x < 0 || y < 0)
        return s_fail (cx, KILN_ECOMPILE, err, "needs an input and an output");
    int rc = s_need_f32 (cx, all, 2, err);
    if (rc)
        return rc;
    const kiln_shape_t *sx = &s_gt (cx, x)->shape;
    if (sx->rank < 3)
        return s_fail (cx, KILN_ESHAPE, err, "input must have rank >= 3");
    kiln_shape_t out = *sx;
    for (int i = 2; i < out.rank; i++)
        out.dims[i] = 1;
    if ((rc = s_expect_shape (cx, y, &out, err)))
        return rc;
    int px = s_operand (cx, x, err);
    if (px < 0)
        return px;
    int py = s_result (cx, y, err);
    if (py < 0)
        return py;
    int op = s_emit (cx, k, &px, 1, &py, 1, err);
    if (op >= 0 && cx->cl[x] && (rc = s_set_int (cx, op, "layout", 1, err)))
        return rc;
    return op < 0 ? op : 0;
}

/* --- the table ------------------------------------------------------ */

/* op, lowering, kernel, exact (kiln_cc_lowering_t): whether a half output
 * needs no round_half after it: views and data movement, ops that select
 * among their inputs' values (Relu, Max, Where, MaxPool, ...), and Cast,
 * which rounds itself.  (Clip is not: Clip-6's bounds are floats.) */
static const kiln_cc_lowering_t s_lowerings[] = {
    /* the math ops: compiler/kiln_lower_math.c */
    { "Neg",               kiln_lower_math_unary, KILN_K_NEG, true },
    { "Abs",               kiln_lower_math_unary, KILN_K_ABS, true },
    { "Sqrt",              kiln_lower_math_unary, KILN_K_SQRT, false },
    { "Reciprocal",        kiln_lower_math_unary, KILN_K_RECIPROCAL, false },
    { "Exp",               kiln_lower_math_unary, KILN_K_EXP, false },
    { "Log",               kiln_lower_math_unary, KILN_K_LOG, false },
    { "Floor",             kiln_lower_math_unary, KILN_K_FLOOR, false },
    { "Ceil",              kiln_lower_math_unary, KILN_K_CEIL, false },
    { "Erf",               kiln_lower_math_unary, KILN_K_ERF, false },
    { "Tanh",              kiln_lower_math_unary, KILN_K_TANH, false },
    { "Sigmoid",           kiln_lower_math_unary, KILN_K_SIGMOID, false },
    { "Softplus",          kiln_lower_math_unary, KILN_K_SOFTPLUS, false },
    { "Softsign",          kiln_lower_math_unary, KILN_K_SOFTSIGN, false },
    { "HardSwish",         kiln_lower_math_unary, KILN_K_HARD_SWISH, false },
    { "LeakyRelu",         kiln_lower_math_unary, KILN_K_LEAKY_RELU, false },
    { "Elu",               kiln_lower_math_unary, KILN_K_ELU, false },
    { "Selu",              kiln_lower_math_unary, KILN_K_SELU, false },
    { "Celu",              kiln_lower_math_unary, KILN_K_CELU, false },
    { "HardSigmoid",       kiln_lower_math_unary, KILN_K_HARD_SIGMOID, false },
    { "Not",               kiln_lower_math_unary, KILN_K_NOT, false },
    { "Cast",              kiln_lower_math_cast, KILN_K_CAST, true },
    { "CastLike",          kiln_lower_math_cast, KILN_K_CAST, true },
    { "Clip",              kiln_lower_math_clip, KILN_K_CLIP, false },
    { "NegativeLogLikelihoodLoss", kiln_lower_math_nll, KILN_K_NLL_LOSS, false },
    { "Hardmax",           kiln_lower_math_softmax, KILN_K_HARDMAX, true },
    { "IsInf",             kiln_lower_math_isinf, KILN_K_IS_INF, true },
    { "SoftmaxCrossEntropyLoss", kiln_lower_math_nll, KILN_K_NLL_LOSS, false },
    { "Where",             kiln_lower_math_broadcast, KILN_K_WHERE, true },
    { "Softmax",           kiln_lower_math_softmax, KILN_K_SOFTMAX, false },
    { "LogSoftmax",        kiln_lower_math_softmax, KILN_K_LOG_SOFTMAX, false },
    { "ReduceLogSumExp",   kiln_lower_math_reduce, KILN_K_REDUCE_LOG_SUM_EXP, false },
    { "BatchNormalization", kiln_lower_math_norm, KILN_K_BATCH_NORM, false },
    { "InstanceNormalization", kiln_lower_math_norm, KILN_K_INSTANCE_NORM, false },
    { "LayerNormalization", kiln_lower_math_norm, KILN_K_LAYER_NORM, false },
    { "LRN",               kiln_lower_math_norm, KILN_K_LRN, false },
    { "Relu",              s_lower_unary,   KILN_K_RELU, true },
    { "MatMul",            s_lower_matmul,  KILN_K_MATMUL, false },
    { "Gemm",              s_lower_gemm,    KILN_K_GEMM, false },
    { "Conv",              s_lower_conv,    KILN_K_CONV2D, false },
    { "MaxPool",           s_lower_maxpool, KILN_K_MAXPOOL2D, true },
    { "GlobalAveragePool", s_lower_gap,     KILN_K_GLOBAL_AVGPOOL, false },
    /* windows, scatters, recurrent: compiler/kiln_lower_shape.c */
    { "Resize",            kiln_lower_shape_resize, KILN_K_RESIZE, false },
    { "Einsum",            kiln_lower_shape_einsum, KILN_K_MATMUL, false },
    { "ConvTranspose",     kiln_lower_shape_conv_transpose, KILN_K_CONV_TRANSPOSE2D, false },
    { "AveragePool",       kiln_lower_shape_avgpool, KILN_K_AVGPOOL2D, false },
    { "GlobalMaxPool",     kiln_lower_shape_global_pool, KILN_K_GLOBAL_MAXPOOL, true },
    { "CumSum",            kiln_lower_shape_cumsum, KILN_K_CUMSUM, false },
    { "RNN",               kiln_lower_shape_rnn, KILN_K_RNN, false },
    { "GRU",               kiln_lower_shape_rnn, KILN_K_RNN, false },
    { "LSTM",              kiln_lower_shape_rnn, KILN_K_RNN, false },
    { "ScatterND",         kiln_lower_shape_scatter, KILN_K_SCATTER_ND, false },
    { "ScatterElements",   kiln_lower_shape_scatter, KILN_K_SCATTER_ELEMENTS, false },
    { "Scatter",           kiln_lower_shape_scatter, KILN_K_SCATTER_ELEMENTS, false },
    { "TopK",              kiln_lower_shape_topk, KILN_K_TOPK, true },
    { "GridSample",        kiln_lower_shape_grid_sample, KILN_K_GRID_SAMPLE, false },
    /* the float unary ops of common/kiln_ops_unary.h */
#define S_ROW(X_, id, name, onnx, an, ad, bn, bd, expr) \
    { onnx, kiln_lower_math_unary, KILN_K_##id, false },
    KILN_UNARY_OPS (S_ROW, _)
#undef S_ROW
    /* the ops of common/kiln_ops_binary.h and kiln_ops_reduce.h */
#define S_ROW(X_, id, name, onnx, kind, expr) \
    { onnx, kiln_lower_math_broadcast, KILN_K_##id, false },
    KILN_BINARY_OPS (S_ROW, _)
#undef S_ROW
#define S_ROW(X_, id, name, onnx, ex, i0, s0, f0, ints, i1, s1, f1) \
    { onnx, kiln_lower_math_reduce, KILN_K_##id, ex },
    KILN_REDUCE_OPS (S_ROW, _)
#undef S_ROW
    /* the ops of common/kiln_ops_shape.h */
#define S_ROW(X_, onnx, ilo, ihi, olo, ohi, infer, lower, kernel, exact) \
    { onnx, lower, KILN_K_##kernel, exact },
    KILN_SHAPE_OPS (S_ROW, _)
#undef S_ROW
    /* the ops of common/kiln_ops_arith.h */
#define S_ROW(X_, id, name, onnx, lo, nhi, khi, inf, low, ex, prep) \
    { onnx, low, KILN_K_##id, ex },
    KILN_ARITH_OPS (S_ROW, _)
#undef S_ROW
};

const kiln_cc_lowering_t *
kiln_cc_lowering_find (const char *op)
{
    for (size_t i = 0; i < sizeof s_lowerings / sizeof s_lowerings[0]; i++)
        if (op && strcmp (s_lowerings[i].op, op) == 0)
            return &s_lowerings[i];
    return NULL;
}

/* --- driver --------------------------------------------------------- */

/* After node `i` (lowered by `l`, NULL for the fused layer norm): each
 * half tensor it computed, rounded in place to its type, so that the
 * next op reads what a half tensor holds (the rounding torch does at
 * every op of a bfloat16 or float16 model). */
static int
s_round_outputs (kiln_cc_ctx_t *cx, int i, const kiln_cc_lowering_t *l,
                 kiln_err_t *err)
{
    if (l && l->exact)
        return 0;
    const kiln_node_t *node = &cx->g->nodes[i];
    int outs[KILN_MAX_NODE_IO + 1], n = 0;
    for (int o = 0; o < node->n_outputs; o++)
        outs[n++] = node->outputs[o];
    outs[n++] = cx->fusion[i].out;
    for (int k = 0; k < n; k++) {
        int gt = outs[k];
        bool seen = false;
        for (int j = 0; j < k; j++)
            seen = seen || outs[j] == gt;
        if (seen || gt < 0 || gt >= cx->g->n_tensors || cx->tmap[gt] < 0
            || !s_half (cx, gt))
            continue;
        int op = kiln_cc_round (cx, cx->tmap[gt], cx->tmap[gt], s_gt (cx, gt)->dtype,
                                err);
        if (op < 0)
            return op;
    }
    return 0;
}

/* The program tensor of half graph output gt, in its 2-byte type: the
 * stored input or weight itself, or the float32 result narrowed by a
 * `cast` emitted now, after the last node. */
static int
s_half_output (kiln_cc_ctx_t *cx, int gt, kiln_err_t *err)
{
    if (cx->hmap[gt] >= 0)
        return cx->hmap[gt];
    const kiln_tensor_t *t = s_gt (cx, gt);
    if (t->weight >= 0)
        return s_weight_tensor (cx, gt, err);
    int src = cx->tmap[gt];
    if (src < 0)
        return kiln_error (err, KILN_ECOMPILE, "graph output '%s' is produced by "
                           "no node", s_tname (cx, gt));
    uint64_t bytes;
    int rc = kiln_shape_bytes (&t->shape, t->dtype, s_tname (cx, gt), &bytes, err);
    if (rc)
        return rc;
    int s = s_storage_new (cx, false, -1, bytes, cx->prog->n_ops, err);
    if (s < 0)
        return s;
    int pt = s_ptensor (cx, t->dtype, &t->shape, KILN_TK_TEMP, s, err);
    if (pt < 0)
        return pt;
    int op = s_emit (cx, KILN_K_CAST, &src, 1, &pt, 1, err);
    if (op < 0)
        return op;
    cx->hmap[gt] = pt;
    return pt;
}

int
kiln_cc_lower (kiln_cc_ctx_t *cx, kiln_err_t *err)
{
    kiln_graph_t *g = cx->g;
    int rc;
    /* Graph inputs first, in order: they live from before the first op. */
    for (int i = 0; i < g->n_inputs; i++) {
        int gt = g->inputs[i];
        const kiln_tensor_t *t = &g->tensors[gt];
        if (t->weight >= 0)
            return kiln_error (err, KILN_EUNSUPPORTED, "graph input '%s' is "
                               "also a constant", s_tname (cx, gt));
        if (cx->tmap[gt] >= 0)
            return kiln_error (err, KILN_ECOMPILE, "graph input '%s' is listed "
                               "twice", s_tname (cx, gt));
        uint64_t bytes;
        if ((rc = kiln_shape_bytes (&t->shape, t->dtype, s_tname (cx, gt),
                                    &bytes, err)))
            return rc;
        int s = s_storage_new (cx, false, -1, bytes, -1, err);
        if (s < 0)
            return s;
        int pt = s_ptensor (cx, t->dtype, &t->shape, KILN_TK_INPUT, s, err);
        if (pt < 0)
            return pt;
        cx->prog->tensors[pt].io = i;
        (s_half (cx, gt) ? cx->hmap : cx->tmap)[gt] = pt;
        if ((rc = kiln_program_add_io (cx->prog, false, pt, err)) < 0)
            return rc;
    }
    /* Half inputs are computed in float32 from the first op on. */
    for (int i = 0; i < g->n_inputs; i++) {
        int gt = g->inputs[i];
        if (s_half (cx, gt) && (rc = s_widen (cx, gt, cx->hmap[gt], err)) < 0)
            return rc;
    }
    if ((rc = kiln_cc_fuse (cx, err)) || (rc = kiln_cc_layout (cx, err)))
        return rc;
    for (int i = 0; i < g->n_nodes; i++) {
        if (cx->skip[i])
            continue;
        cx->node = i;
        const kiln_node_t *node = &g->nodes[i];
        if (cx->fusion[i].ln_scale >= 0) {
            if ((rc = s_lower_fused_ln (cx, node, err))
                || (rc = s_round_outputs (cx, i, NULL, err)))
                return rc;
            continue;
        }
        const kiln_cc_lowering_t *l = kiln_cc_lowering_find (node->op);
        if (!l)
            return s_fail (cx, KILN_EUNSUPPORTED, err, "operator not supported "
                           "by the builtin compiler");
        if ((rc = l->fn (cx, node, l->kernel, err))
            || (rc = s_round_outputs (cx, i, l, err)))
            return rc;
    }
    for (int i = 0; i < g->n_outputs; i++) {
        int gt = g->outputs[i];
        int pt = gt >= 0 && gt < g->n_tensors ? cx->tmap[gt] : -1;
        cx->node = -1;          /* errors name the graph outputs */
        if (gt >= 0 && gt < g->n_tensors && s_half (cx, gt)) {
            pt = s_half_output (cx, gt, err);
            if (pt < 0)
                return pt;
        } else if (pt < 0 && gt >= 0 && gt < g->n_tensors
                   && g->tensors[gt].weight >= 0) {
            pt = s_operand (cx, gt, err);
            if (pt < 0)
                return pt;
        }
        if (pt < 0)
            return kiln_error (err, KILN_ECOMPILE, "graph output '%s' is "
                               "produced by no node",
                               gt >= 0 && gt < g->n_tensors ? s_tname (cx, gt)
                                                            : "?");
        kiln_prog_tensor_t *t = &cx->prog->tensors[pt];
        if (t->kind == KILN_TK_TEMP) {
            t->kind = KILN_TK_OUTPUT;
            t->io = i;
        }
        kiln_cc_storage_t *s = &cx->st[kiln_cc_root (cx, cx->storage_of[pt], NULL)];
        if (!s->weight)
            s->last = KILN_CC_END;
        if ((rc = kiln_program_add_io (cx->prog, true, pt, err)) < 0)
            return rc;
    }
    return 0;
}
