#include "compiler/kiln_cc_pipeline.h"

#include <stdlib.h>
#include <string.h>

#include "common/kiln_cost.h"

/* What the cut works from: per op its cost, per cut point (before op c)
 * the arena bytes live there. */
typedef struct {
    int n_ops;
    double *prefix;         /* prefix[i]: the cost of ops 0..i-1, ns */
    double *handoff_ns;     /* handoff_ns[c]: copying what is live at c, once */
    uint64_t *live;         /* live[c]: bytes live at cut c (0 at 0 and n_ops) */
} s_cut_t;

/* A stage of ops [a, b): its ops, the copy out of the stage before and
 * into it, the copy out of it. */
static double
s_stage_ns (const s_cut_t *c, int a, int b)
{
    return c->prefix[b] - c->prefix[a] + 2 * c->handoff_ns[a] + 2 * c->handoff_ns[b];
}

/* The fewest stages whose costs are all at most t, each ending as far on
 * as it can; cuts[] gets the starts.  Returns the count, or n + 1 when
 * more than n would be needed. */
static int
s_greedy (const s_cut_t *c, double t, int n, int *cuts)
{
    int count = 0, a = 0;
    while (a < c->n_ops) {
        if (count == n)
            return n + 1;
        cuts[count++] = a;
        int best = -1;
        for (int b = a + 1; b <= c->n_ops; b++) {
            if (c->prefix[b] - c->prefix[a] > t)
                break;
            if (s_stage_ns (c, a, b) <= t)
                best = b;
        }
        if (best < 0)
            return n + 1;
        a = best;
    }
    return count;
}

/* Split stages until there are n: each time the costliest stage with two
 * ops or more, at the point that makes its larger half smallest. */
static void
s_fill (const s_cut_t *c, int *cuts, int count, int n)
{
    while (count < n) {
        int worst = -1;
        double worst_ns = -1;
        for (int s = 0; s < count; s++) {
            int a = cuts[s], b = s + 1 < count ? cuts[s + 1] : c->n_ops;
            if (b - a >= 2 && s_stage_ns (c, a, b) > worst_ns) {
                worst = s;
                worst_ns = s_stage_ns (c, a, b);
            }
        }
        int a = cuts[worst], b = worst + 1 < count ? cuts[worst + 1] : c->n_ops;
        int at = a + 1;
        double at_ns = -1;
        for (int m = a + 1; m < b; m++) {
            double l = s_stage_ns (c, a, m), r = s_stage_ns (c, m, b);
            double worse = l > r ? l : r;
            if (at_ns < 0 || worse < at_ns) {
                at = m;
                at_ns = worse;
            }
        }
        memmove (&cuts[worst + 2], &cuts[worst + 1],
                 (size_t) (count - worst - 1) * sizeof *cuts);
        cuts[worst + 1] = at;
        count++;
    }
}

/* The arena byte ranges live at cut c: every arena storage written
 * before op c (or a graph input) and read at or after it (or a graph
 * output), merged where only alignment padding lies between two. */
static int
s_handoff (const kiln_cc_ctx_t *cx, int cut, kiln_prog_stage_t *st,
           kiln_err_t *err)
{
    int n = 0;
    for (int i = 0; i < cx->n_st; i++) {
        const kiln_cc_storage_t *s = &cx->st[i];
        n += !s->weight && s->parent < 0 && s->size > 0 && s->def < cut
             && s->last >= cut;
    }
    if (n == 0)
        return 0;
    kiln_prog_range_t *r = calloc ((size_t) n, sizeof *r);
    if (!r)
        return kiln_error (err, KILN_ENOMEM, "out of memory cutting the pipeline");
    n = 0;
    for (int i = 0; i < cx->n_st; i++) {
        const kiln_cc_storage_t *s = &cx->st[i];
        if (!s->weight && s->parent < 0 && s->size > 0 && s->def < cut
            && s->last >= cut)
            r[n++] = (kiln_prog_range_t) { s->offset, s->size };
    }
    /* Insertion sort by offset: a cut holds few live storages. */
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && r[j - 1].offset > r[j].offset; j--) {
            kiln_prog_range_t t = r[j];
            r[j] = r[j - 1];
            r[j - 1] = t;
        }
    int m = 0;
    for (int i = 0; i < n; i++) {
        uint64_t end_al;
        if (m > 0 && kiln_prog_align_up (r[m - 1].offset + r[m - 1].size, &end_al)
            && r[i].offset <= end_al) {
            uint64_t end = r[i].offset + r[i].size;
            if (end > r[m - 1].offset + r[m - 1].size)
                r[m - 1].size = end - r[m - 1].offset;
        } else {
            r[m++] = r[i];
        }
    }
    if (m > KILN_PROG_MAX_HANDOFF) {
        free (r);
        return kiln_error (err, KILN_ELIMIT, "%d separate arena ranges are live "
                           "before op %d, more than a stage may receive (%d)", m, cut,
                           KILN_PROG_MAX_HANDOFF);
    }
    st->handoff = r;
    st->n_handoff = m;
    return 0;
}

/* Fill the manifest's record of stage s, ops [a, b). */
static void
s_info (const kiln_cc_ctx_t *cx, const s_cut_t *c, int a, int b, int *seen, int s,
        kiln_stage_info_t *info)
{
    const kiln_program_t *p = cx->prog;
    double flops = 0, bytes = 0;
    uint64_t weights = 0;
    for (int i = a; i < b; i++) {
        kiln_cost_t k = kiln_cost_op (p, i);
        flops += k.flops;
        bytes += k.bytes;
        const kiln_prog_op_t *op = &p->ops[i];
        for (int j = 0; j < op->n_inputs; j++) {
            int t = op->inputs[j];
            int st = cx->storage_of[t];
            if (p->tensors[t].kind == KILN_TK_WEIGHT && seen[st] != s) {
                seen[st] = s;
                weights += cx->st[st].size;
            }
        }
    }
    *info = (kiln_stage_info_t) {
        .first_op = a, .n_ops = b - a, .flops = (uint64_t) flops,
        .moved_bytes = (uint64_t) bytes,
        .cost_ns = (uint64_t) (s_stage_ns (c, a, b) + 0.5),
        .weights_bytes = weights, .handoff_bytes = c->live[a],
    };
}

int
kiln_cc_pipeline_cut (kiln_cc_ctx_t *cx, int n, kiln_stage_info_t *info,
                      kiln_err_t *err)
{
    kiln_program_t *p = cx->prog;
    if (n < 2 || n > KILN_MAX_PIPELINE_STAGES)
        return kiln_error (err, KILN_EINVAL, "--pipeline-cores %d: a pipeline has "
                           "2..%d stages", n, KILN_MAX_PIPELINE_STAGES);
    if (p->n_ops < n)
        return kiln_error (err, KILN_EINVAL, "--pipeline-cores %d: the program has "
                           "%d op%s, fewer than the stages asked for", n, p->n_ops,
                           p->n_ops == 1 ? "" : "s");
    s_cut_t c = { .n_ops = p->n_ops };
    c.prefix = calloc ((size_t) p->n_ops + 1, sizeof *c.prefix);
    c.handoff_ns = calloc ((size_t) p->n_ops + 2, sizeof *c.handoff_ns);
    c.live = calloc ((size_t) p->n_ops + 2, sizeof *c.live);
    int *seen = malloc ((size_t) cx->n_st * sizeof *seen + 1);
    int cuts[KILN_MAX_PIPELINE_STAGES + 1];
    int rc = 0;
    if (!c.prefix || !c.handoff_ns || !c.live || !seen) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory cutting the pipeline");
        goto done;
    }
    for (int i = 0; i < p->n_ops; i++)
        c.prefix[i + 1] = c.prefix[i] + kiln_cost_ns (kiln_cost_op (p, i));
    /* live[c] = the bytes of every arena storage with def < c <= last,
     * for the inner cuts 1..n_ops-1, by a difference array. */
    int64_t *delta = calloc ((size_t) p->n_ops + 2, sizeof *delta);
    if (!delta) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory cutting the pipeline");
        goto done;
    }
    for (int i = 0; i < cx->n_st; i++) {
        const kiln_cc_storage_t *s = &cx->st[i];
        if (s->weight || s->parent >= 0 || s->size == 0)
            continue;
        int from = s->def + 1, to = s->last >= p->n_ops ? p->n_ops : s->last + 1;
        if (from < 1)
            from = 1;
        if (from < to) {
            delta[from] += (int64_t) s->size;
            delta[to] -= (int64_t) s->size;
        }
    }
    int64_t run = 0;
    for (int i = 1; i < p->n_ops; i++) {
        run += delta[i];
        c.live[i] = (uint64_t) run;
        c.handoff_ns[i] = (double) run / KILN_COST_BYTES_PER_NS;
    }
    free (delta);

    /* The smallest bound on a stage's cost that n stages can meet, by
     * bisection between the costliest op and the whole program. */
    double lo = 0, hi = s_stage_ns (&c, 0, p->n_ops);
    for (int i = 0; i < p->n_ops; i++) {
        double one = s_stage_ns (&c, i, i + 1);
        if (one > lo)
            lo = one;
    }
    if (hi < lo)
        hi = lo;
    for (int it = 0; it < 100 && hi - lo > 1e-6 * hi; it++) {
        double mid = (lo + hi) / 2;
        if (s_greedy (&c, mid, n, cuts) <= n)
            hi = mid;
        else
            lo = mid;
    }
    int count = s_greedy (&c, hi, n, cuts);
    if (count > n) {
        rc = kiln_error (err, KILN_ECOMPILE, "internal error: no cut into %d stages", n);
        goto done;
    }
    s_fill (&c, cuts, count, n);
    cuts[n] = p->n_ops;

    p->stages = calloc ((size_t) n, sizeof *p->stages);
    if (!p->stages) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory cutting the pipeline");
        goto done;
    }
    p->n_stages = n;
    for (int i = 0; i < cx->n_st; i++)
        seen[i] = -1;
    for (int s = 0; s < n; s++) {
        p->stages[s].first_op = cuts[s];
        if (s > 0 && (rc = s_handoff (cx, cuts[s], &p->stages[s], err)))
            goto done;
        s_info (cx, &c, cuts[s], cuts[s + 1], seen, s, &info[s]);
    }
done:
    free (c.prefix);
    free (c.handoff_ns);
    free (c.live);
    free (seen);
    return rc;
}
