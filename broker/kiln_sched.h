/*
 * kiln_sched — the broker's queue of jobs waiting for a worker: fair
 * share across tenants, priority, first come first served within.
 *
 * A tenant is who asked for a job: the client's authenticated identity
 * (or, without CurveZMQ, the name the client gives).  Each tenant has its
 * own queue ordered by (priority, arrival): lower priority values first,
 * like nice(1) and REAPI's ExecutionPolicy.priority; a requeued job goes
 * before the jobs of its priority that never ran.
 *
 * kiln_sched_pop picks the job to run next: for each tenant, the first
 * job in its order that `can_run` accepts (a worker with its toolchain is
 * idle), looking at most KILN_SCHED_SCAN jobs deep; of those, the one
 * with the lowest priority value wins, and among equals the tenant that
 * was served least recently.  So one tenant's 500-job batch and another
 * tenant's single job alternate: the single job runs as soon as a slot
 * frees, not behind the batch.  Within a priority level this is
 * round-robin over tenants (Buildbarn's in-memory scheduler does the same
 * over "invocations").
 *
 * The scheduler does not own the jobs; it hands back the pointers it was
 * given.  Every operation is O(tenants × scan depth) at worst; pushing a
 * job at the back of its priority level is O(1).
 */
#ifndef KILN_SCHED_H
#define KILN_SCHED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KILN_SCHED_SCAN        64     /* jobs looked at per tenant per pop */
#define KILN_SCHED_MAX_TENANT  127    /* bytes of a tenant name */

typedef struct kiln_sched kiln_sched_t;
typedef struct kiln_sched_item kiln_sched_item_t;

/* Create an empty scheduler.  Caller owns it.  NULL when out of memory. */
kiln_sched_t *kiln_sched_new (void);
/* Free the scheduler and its queue entries (not the jobs). */
void kiln_sched_destroy (kiln_sched_t **self_p);

/* Queue `job` for `tenant` at `priority`; `front` puts it before the
 * tenant's jobs of the same priority (a job that was already running).
 * Returns the entry (owned by the scheduler, valid until the job is
 * popped or removed), NULL when out of memory. */
kiln_sched_item_t *kiln_sched_push (kiln_sched_t *self, const char *tenant, int priority,
                                    bool front, void *job);
/* Take a queued job out (cancelled); *item_p becomes NULL. */
void kiln_sched_remove (kiln_sched_t *self, kiln_sched_item_t **item_p);
/* Move a queued job to `priority` (a more urgent waiter joined it). */
void kiln_sched_set_priority (kiln_sched_t *self, kiln_sched_item_t *item, int priority);
int kiln_sched_priority (const kiln_sched_item_t *item);

/* Whether a worker could take `job` right now. */
typedef bool (kiln_sched_can_run_fn) (void *job, void *arg);

/* The job to run next (see above), removed from the queue; NULL when no
 * queued job can run. */
void *kiln_sched_pop (kiln_sched_t *self, kiln_sched_can_run_fn *can_run, void *arg);

/* Jobs queued, in all and for one tenant. */
size_t kiln_sched_size (const kiln_sched_t *self);
size_t kiln_sched_tenant_size (const kiln_sched_t *self, const char *tenant);

/* A queued job's place in its tenant's order (1: its next), counting at
 * most `max` (a bound on the walk: O(position)). */
size_t kiln_sched_position (const kiln_sched_item_t *item, size_t max);

/* Call fn for each tenant that has queued jobs or was served: its name,
 * queued jobs and jobs dispatched so far. */
typedef void (kiln_sched_tenant_fn) (const char *tenant, size_t queued, uint64_t served,
                                     void *arg);
void kiln_sched_each_tenant (const kiln_sched_t *self, kiln_sched_tenant_fn *fn, void *arg);

#endif
