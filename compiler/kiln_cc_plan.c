#include "compiler/kiln_cc_plan.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/kiln_map.h"

#define S_SPILL_STEP (8u << 20)     /* bytes copied into the weights file at once */

#include <stdlib.h>
#include <string.h>

typedef struct {
    int def;        /* sort key */
    int idx;        /* storage index, the tie breaker */
} s_order_t;

static int
s_order_cmp (const void *a, const void *b)
{
    const s_order_t *x = a, *y = b;
    if (x->def != y->def)
        return x->def < y->def ? -1 : 1;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

static int
s_too_big (uint64_t what, kiln_err_t *err)
{
    return kiln_error (err, KILN_ELIMIT, "arena of more than %llu bytes needed "
                       "(at least %llu)",
                       (unsigned long long) KILN_PROG_MAX_ARENA_BYTES,
                       (unsigned long long) what);
}

/* Place the arena storages; sets cx->st[].offset and *arena_end. */
static int
s_plan_arena (kiln_cc_ctx_t *cx, uint64_t *arena_end, kiln_err_t *err)
{
    int n = 0;
    s_order_t *order = malloc ((size_t) (cx->n_st + 1) * sizeof *order);
    int *active = malloc ((size_t) (cx->n_st + 1) * sizeof *active);
    if (!order || !active) {
        free (order);
        free (active);
        return kiln_error (err, KILN_ENOMEM, "out of memory planning memory");
    }
    for (int i = 0; i < cx->n_st; i++)
        if (!cx->st[i].weight && cx->st[i].parent < 0)
            order[n++] = (s_order_t) { cx->st[i].def, i };
    qsort (order, (size_t) n, sizeof *order, s_order_cmp);

    bool reuse = cx->opts.optlevel >= 1;
    int n_active = 0;               /* live storages, sorted by offset */
    uint64_t end = 0;
    int rc = 0;
    for (int i = 0; i < n; i++) {
        kiln_cc_storage_t *s = &cx->st[order[i].idx];
        uint64_t size;
        if (!kiln_prog_align_up (s->size, &size) || size > KILN_PROG_MAX_ARENA_BYTES) {
            rc = s_too_big (s->size, err);
            break;
        }
        uint64_t at = 0;
        if (!reuse) {
            at = end;
        } else {
            /* Storages placed earlier that died before this one is
             * defined can never overlap it or any later one. */
            int k = 0;
            for (int j = 0; j < n_active; j++)
                if (cx->st[active[j]].last >= s->def)
                    active[k++] = active[j];
            n_active = k;
            int pos = 0;
            for (; pos < n_active; pos++) {
                const kiln_cc_storage_t *a = &cx->st[active[pos]];
                if (at + size <= a->offset)
                    break;
                uint64_t a_end = a->offset + a->size, a_end_al;
                if (!kiln_prog_align_up (a_end, &a_end_al)) {
                    rc = s_too_big (a_end, err);
                    break;
                }
                if (a_end_al > at)
                    at = a_end_al;
            }
            if (rc)
                break;
            if (size > 0) {
                memmove (&active[pos + 1], &active[pos],
                         (size_t) (n_active - pos) * sizeof *active);
                active[pos] = order[i].idx;
                n_active++;
            }
        }
        if (at > KILN_PROG_MAX_ARENA_BYTES - size) {
            rc = s_too_big (at + size, err);
            break;
        }
        s->offset = at;
        if (at + size > end)
            end = at + size;
    }
    free (order);
    free (active);
    *arena_end = end;
    return rc;
}

/* Write weights.bin (`total` bytes, offsets set) into the file `fd`: the
 * gaps stay holes of zeros, and a mapped weight's pages are given back
 * as they are copied. */
static int
s_spill_weights (kiln_cc_ctx_t *cx, int fd, uint64_t total, kiln_err_t *err)
{
    if (ftruncate (fd, (off_t) total) != 0)
        return kiln_error (err, KILN_EIO, "could not size the weights file (%llu bytes): %s",
                           (unsigned long long) total, strerror (errno));
    for (int i = 0; i < cx->n_st; i++) {
        const kiln_cc_storage_t *s = &cx->st[i];
        if (!s->weight || !s->size)
            continue;
        const kiln_weight_t *gw = s->data ? NULL : &cx->g->weights[s->graph_weight];
        const uint8_t *src = s->data ? s->data : gw->data;
        for (uint64_t done = 0; done < s->size; ) {
            uint64_t n = s->size - done < S_SPILL_STEP ? s->size - done : S_SPILL_STEP;
            ssize_t w = pwrite (fd, src + done, (size_t) n, (off_t) (s->offset + done));
            if (w <= 0)
                return kiln_error (err, KILN_EIO, "could not write the weights file: %s",
                                   w < 0 ? strerror (errno) : "short write");
            if ((gw && gw->map.base) || s->map_len)
                kiln_map_drop (src + done, (size_t) w);
            done += (uint64_t) w;
        }
    }
    return 0;
}

/* The made weights in the scratch file are in weights.bin now: unmap
 * them, so that the compile's address space (the worker's --max-memory)
 * holds the graph's weights and weights.bin, not a third copy. */
static void
s_unmap_made (kiln_cc_ctx_t *cx)
{
    for (int i = 0; i < cx->n_st; i++) {
        kiln_cc_storage_t *s = &cx->st[i];
        if (s->map_len) {
            munmap (s->data, s->map_len);
            s->data = NULL;
            s->map_len = 0;
        }
    }
}

/* Lay out weights.bin and copy the weight bytes into it (memory or the
 * file spill_fd). */
static int
s_pack_weights (kiln_cc_ctx_t *cx, int spill_fd, uint8_t **out, size_t *out_len,
                kiln_err_t *err)
{
    uint64_t total = 0;
    for (int i = 0; i < cx->n_st; i++) {
        kiln_cc_storage_t *s = &cx->st[i];
        if (!s->weight)
            continue;
        uint64_t size;
        if (!kiln_prog_align_up (s->size, &size)
            || total > KILN_MAX_MEMBER_BYTES - size)
            return kiln_error (err, KILN_ELIMIT, "weights need more than %llu "
                               "bytes", (unsigned long long) KILN_MAX_MEMBER_BYTES);
        s->offset = total;
        total += size;
    }
    if (spill_fd >= 0) {
        *out = NULL;
        *out_len = (size_t) total;
        int rc = s_spill_weights (cx, spill_fd, total, err);
        s_unmap_made (cx);
        return rc;
    }
    uint8_t *buf = calloc (1, total ? (size_t) total : 1);
    if (!buf)
        return kiln_error (err, KILN_ENOMEM, "out of memory packing %llu bytes "
                           "of weights", (unsigned long long) total);
    for (int i = 0; i < cx->n_st; i++) {
        const kiln_cc_storage_t *s = &cx->st[i];
        if (s->weight && s->size)
            memcpy (buf + s->offset, s->data ? s->data
                                             : cx->g->weights[s->graph_weight].data,
                    (size_t) s->size);
    }
    *out = buf;
    *out_len = (size_t) total;
    return 0;
}

int
kiln_cc_plan_concat (kiln_cc_ctx_t *cx, const kiln_node_t *node, int axis,
                     kiln_err_t *err)
{
    int n = node->n_inputs, y = node->outputs[0];
    const kiln_shape_t *ys = &cx->g->tensors[y].shape;
    if (cx->opts.optlevel < 1 || n > KILN_MAX_NODE_IO)
        return 0;
    for (int d = 0; d < axis; d++)
        if (ys->dims[d] != 1)
            return 0;           /* each input is several runs of the output */
    kiln_dtype_t dt = kiln_cc_dtype (cx, y);
    int roots[KILN_MAX_NODE_IO], n_roots = 0;
    uint64_t base[KILN_MAX_NODE_IO], at = 0;
    for (int i = 0; i < n; i++) {
        int pt = kiln_cc_operand (cx, node->inputs[i], err);
        if (pt < 0)
            return pt;
        const kiln_prog_tensor_t *t = &cx->prog->tensors[pt];
        uint64_t in_root;
        int root = kiln_cc_root (cx, cx->storage_of[pt], &in_root);
        const kiln_cc_storage_t *rs = &cx->st[root];
        /* A weight, a graph input (or a view of one: def -1) stays where
         * it is; an input must start at an aligned offset of the output,
         * and where its root starts (below it) must be inside the output. */
        if (t->kind != KILN_TK_TEMP || t->dtype != dt || rs->weight || rs->def < 0
            || at % KILN_PROG_ALIGN != 0 || in_root > at)
            return 0;
        uint64_t b = at - in_root;
        int j = 0;
        while (j < n_roots && roots[j] != root)
            j++;
        if (j < n_roots) {
            if (base[j] != b)
                return 0;       /* one tensor, or one buffer, in two places */
        } else {
            roots[n_roots] = root;
            base[n_roots++] = b;
        }
        at += t->size;
    }
    /* Each root's bytes must fit inside the output and overlap no other
     * root's: a root's bytes outside this Concat's inputs would otherwise
     * be overwritten by another input's producer. */
    for (int j = 0; j < n_roots; j++) {
        uint64_t e = base[j] + cx->st[roots[j]].size;
        if (e > at)
            return 0;
        for (int k = 0; k < j; k++)
            if (base[k] < e && base[j] < base[k] + cx->st[roots[k]].size)
                return 0;
    }
    int py = kiln_cc_result (cx, y, err);
    if (py < 0)
        return py;
    int out = cx->storage_of[py];
    kiln_cc_storage_t *os = &cx->st[out];
    if (os->size != at)
        return kiln_error (err, KILN_ECOMPILE, "internal error: concat '%s' of %llu "
                           "bytes from inputs of %llu", kiln_cc_tname (cx, y),
                           (unsigned long long) os->size, (unsigned long long) at);
    os->def = cx->st[roots[0]].def;
    os->last = cx->st[roots[0]].last;
    for (int j = 0; j < n_roots; j++) {
        kiln_cc_storage_t *rs = &cx->st[roots[j]];
        rs->parent = out;
        rs->sub = base[j];
        if (rs->def < os->def)
            os->def = rs->def;
        if (rs->last > os->last)
            os->last = rs->last;
    }
    return 1;
}

int
kiln_cc_plan (kiln_cc_ctx_t *cx, int spill_fd, uint8_t **weights, size_t *weights_len,
              kiln_cc_stats_t *stats, kiln_err_t *err)
{
    uint64_t end = 0;
    int rc = s_plan_arena (cx, &end, err);
    if (rc)
        return rc;
    rc = s_pack_weights (cx, spill_fd, weights, weights_len, err);
    if (rc)
        return rc;
    kiln_program_t *p = cx->prog;
    uint64_t naive = 0;
    for (int t = 0; t < p->n_tensors; t++) {
        kiln_prog_tensor_t *pt = &p->tensors[t];
        uint64_t sub;
        int root = kiln_cc_root (cx, cx->storage_of[t], &sub);
        pt->offset = cx->st[root].offset + sub;
        if (pt->kind != KILN_TK_WEIGHT) {
            uint64_t sz;
            if (kiln_prog_align_up (pt->size, &sz))
                naive += sz;
        }
    }
    for (int i = 0; i < cx->n_st; i++) {
        uint64_t sub;
        int root = kiln_cc_root (cx, i, &sub);
        if (root != i)
            cx->st[i].offset = cx->st[root].offset + sub;
    }
    p->arena_size = end;    /* a sum of aligned sizes: already aligned */
    if (stats) {
        stats->arena_bytes = end;
        stats->naive_bytes = naive;
        stats->weights_bytes = *weights_len;
        stats->n_ops = p->n_ops;
    }
    return 0;
}
