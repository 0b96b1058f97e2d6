/*
 * kiln_sched — per-tenant queues ordered by (priority, arrival), served
 * round-robin within the best priority.
 */
#include "broker/kiln_sched.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define S_MAX_IDLE_TENANTS 1024    /* empty tenants remembered for their turn */

typedef struct s_tenant s_tenant_t;

struct kiln_sched_item {
    void *job;                       /* not owned */
    int priority;
    int64_t seq;                     /* arrival: front entries negative */
    s_tenant_t *tenant;
    kiln_sched_item_t *prev, *next;  /* in the tenant's queue */
};

struct s_tenant {
    char name[KILN_SCHED_MAX_TENANT + 1];
    kiln_sched_item_t *head, *tail;  /* ordered by (priority, seq) */
    size_t size;
    uint64_t last_served;            /* pop counter when last served; 0 = never */
    uint64_t served;                 /* jobs popped */
    s_tenant_t *next;                /* in the scheduler's list */
};

struct kiln_sched {
    s_tenant_t *tenants;             /* owned */
    size_t n_tenants;
    size_t size;                     /* queued jobs */
    int64_t back_seq, front_seq;
    uint64_t pops;
};

kiln_sched_t *
kiln_sched_new (void)
{
    return calloc (1, sizeof (kiln_sched_t));
}

void
kiln_sched_destroy (kiln_sched_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_sched_t *self = *self_p;
    s_tenant_t *t = self->tenants;
    while (t) {
        s_tenant_t *next = t->next;
        kiln_sched_item_t *it = t->head;
        while (it) {
            kiln_sched_item_t *n = it->next;
            free (it);
            it = n;
        }
        free (t);
        t = next;
    }
    free (self);
    *self_p = NULL;
}

/* Forget the least recently served empty tenant when too many are kept. */
static void
s_trim_tenants (kiln_sched_t *self)
{
    size_t empty = 0;
    for (s_tenant_t *t = self->tenants; t; t = t->next)
        empty += t->size == 0;
    if (empty <= S_MAX_IDLE_TENANTS)
        return;
    s_tenant_t **oldest = NULL;
    for (s_tenant_t **p = &self->tenants; *p; p = &(*p)->next)
        if ((*p)->size == 0 && (!oldest || (*p)->last_served < (*oldest)->last_served))
            oldest = p;
    if (oldest) {
        s_tenant_t *gone = *oldest;
        *oldest = gone->next;
        free (gone);
        self->n_tenants--;
    }
}

static s_tenant_t *
s_tenant (kiln_sched_t *self, const char *name, bool create)
{
    for (s_tenant_t *t = self->tenants; t; t = t->next)
        if (strcmp (t->name, name) == 0)
            return t;
    if (!create)
        return NULL;
    s_tenant_t *t = calloc (1, sizeof *t);
    if (!t)
        return NULL;
    snprintf (t->name, sizeof t->name, "%s", name);
    /* New tenants go last in the list, so that iteration order (the last
     * tie-breaker) is arrival order. */
    s_tenant_t **p = &self->tenants;
    while (*p)
        p = &(*p)->next;
    *p = t;
    self->n_tenants++;
    s_trim_tenants (self);
    return t;
}

static bool
s_before (const kiln_sched_item_t *a, const kiln_sched_item_t *b)
{
    return a->priority < b->priority || (a->priority == b->priority && a->seq < b->seq);
}

/* Put `it` in its tenant's queue at its place. */
static void
s_insert (s_tenant_t *t, kiln_sched_item_t *it, bool from_front)
{
    kiln_sched_item_t *after = NULL;       /* insert after this one; NULL = at head */
    if (from_front) {
        kiln_sched_item_t *p = t->head;
        while (p && s_before (p, it)) {
            after = p;
            p = p->next;
        }
    }
    else {
        after = t->tail;
        while (after && s_before (it, after))
            after = after->prev;
    }
    it->prev = after;
    it->next = after ? after->next : t->head;
    if (it->next)
        it->next->prev = it;
    else
        t->tail = it;
    if (after)
        after->next = it;
    else
        t->head = it;
    t->size++;
}

static void
s_unlink (s_tenant_t *t, kiln_sched_item_t *it)
{
    if (it->prev)
        it->prev->next = it->next;
    else
        t->head = it->next;
    if (it->next)
        it->next->prev = it->prev;
    else
        t->tail = it->prev;
    it->prev = it->next = NULL;
    t->size--;
}

kiln_sched_item_t *
kiln_sched_push (kiln_sched_t *self, const char *tenant, int priority, bool front, void *job)
{
    s_tenant_t *t = s_tenant (self, tenant ? tenant : "", true);
    kiln_sched_item_t *it = t ? calloc (1, sizeof *it) : NULL;
    if (!it)
        return NULL;
    it->job = job;
    it->priority = priority;
    it->seq = front ? --self->front_seq : ++self->back_seq;
    it->tenant = t;
    s_insert (t, it, front);
    self->size++;
    return it;
}

void
kiln_sched_remove (kiln_sched_t *self, kiln_sched_item_t **item_p)
{
    kiln_sched_item_t *it = item_p ? *item_p : NULL;
    if (!it)
        return;
    s_unlink (it->tenant, it);
    self->size--;
    free (it);
    *item_p = NULL;
}

void
kiln_sched_set_priority (kiln_sched_t *self, kiln_sched_item_t *item, int priority)
{
    if (!item || item->priority == priority)
        return;
    s_unlink (item->tenant, item);
    item->priority = priority;
    s_insert (item->tenant, item, false);
}

int
kiln_sched_priority (const kiln_sched_item_t *item)
{
    return item ? item->priority : 0;
}

void *
kiln_sched_pop (kiln_sched_t *self, kiln_sched_can_run_fn *can_run, void *arg)
{
    kiln_sched_item_t *best = NULL;
    for (s_tenant_t *t = self->tenants; t; t = t->next) {
        int looked = 0;
        for (kiln_sched_item_t *it = t->head; it && looked < KILN_SCHED_SCAN;
             it = it->next, looked++) {
            /* Nothing further in this queue can beat the best so far. */
            if (best && it->priority > best->priority)
                break;
            if (can_run && !can_run (it->job, arg))
                continue;
            if (!best || it->priority < best->priority
                || (it->priority == best->priority
                    && t->last_served < best->tenant->last_served))
                best = it;
            break;
        }
    }
    if (!best)
        return NULL;
    s_tenant_t *t = best->tenant;
    void *job = best->job;
    s_unlink (t, best);
    self->size--;
    free (best);
    t->last_served = ++self->pops;
    t->served++;
    return job;
}

size_t
kiln_sched_size (const kiln_sched_t *self)
{
    return self->size;
}

size_t
kiln_sched_tenant_size (const kiln_sched_t *self, const char *tenant)
{
    for (s_tenant_t *t = self->tenants; t; t = t->next)
        if (strcmp (t->name, tenant) == 0)
            return t->size;
    return 0;
}

size_t
kiln_sched_position (const kiln_sched_item_t *item, size_t max)
{
    size_t pos = 1;
    for (const kiln_sched_item_t *it = item->tenant->head; it && it != item && pos < max;
         it = it->next)
        pos++;
    return pos;
}

void
kiln_sched_each_tenant (const kiln_sched_t *self, kiln_sched_tenant_fn *fn, void *arg)
{
    for (s_tenant_t *t = self->tenants; t; t = t->next)
        fn (t->name, t->size, t->served, arg);
}
