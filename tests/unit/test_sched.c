/* Unit tests of the broker's scheduler: first come first served within a
 * client, round robin between clients, lower priority values first,
 * requeued jobs at the head, jobs no worker can take skipped. */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "broker/kiln_sched.h"
#include "tests/unit/testlib.h"

typedef struct {
    const char *tenant;
    int id;
    bool runnable;
} s_job_t;

static bool
s_runnable (void *job, void *arg)
{
    return ((s_job_t *) job)->runnable;
}

static int
s_pop_id (kiln_sched_t *s)
{
    s_job_t *job = kiln_sched_pop (s, s_runnable, NULL);
    return job ? job->id : -1;
}

START_TEST (test_a_queued_jobs_position_follows_priority_and_removals)
{
    kiln_sched_t *s = kiln_sched_new ();
    s_job_t jobs[4];
    kiln_sched_item_t *items[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (s_job_t) { "a", i, true };
        items[i] = kiln_sched_push (s, "a", 0, false, &jobs[i]);
        ck_assert_ptr_nonnull (items[i]);
    }
    /* another client's job does not count in a's queue */
    s_job_t other = { "b", 9, true };
    ck_assert_ptr_nonnull (kiln_sched_push (s, "b", 0, false, &other));
    for (int i = 0; i < 4; i++)
        ck_assert_uint_eq (kiln_sched_position (items[i], 1000), (size_t) i + 1);
    /* a more urgent job goes first; a removed one no longer counts */
    kiln_sched_set_priority (s, items[3], -5);
    ck_assert_uint_eq (kiln_sched_position (items[3], 1000), 1);
    ck_assert_uint_eq (kiln_sched_position (items[0], 1000), 2);
    kiln_sched_remove (s, &items[0]);
    ck_assert_uint_eq (kiln_sched_position (items[2], 1000), 3);
    /* the walk is bounded */
    ck_assert_uint_eq (kiln_sched_position (items[2], 2), 2);
    kiln_sched_destroy (&s);
}
END_TEST

START_TEST (test_one_client_is_first_come_first_served)
{
    kiln_sched_t *s = kiln_sched_new ();
    s_job_t jobs[5];
    for (int i = 0; i < 5; i++) {
        jobs[i] = (s_job_t) { "a", i, true };
        ck_assert_ptr_nonnull (kiln_sched_push (s, "a", 0, false, &jobs[i]));
    }
    ck_assert_uint_eq (kiln_sched_size (s), 5);
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq (s_pop_id (s), i);
    ck_assert_int_eq (s_pop_id (s), -1);
    ck_assert_uint_eq (kiln_sched_size (s), 0);
    kiln_sched_destroy (&s);
    ck_assert_ptr_null (s);
}
END_TEST

START_TEST (test_a_single_job_passes_another_clients_batch)
{
    kiln_sched_t *s = kiln_sched_new ();
    s_job_t batch[500], single = { "laptop", 1000, true };
    for (int i = 0; i < 500; i++) {
        batch[i] = (s_job_t) { "ci", i, true };
        kiln_sched_push (s, "ci", 0, false, &batch[i]);
    }
    /* Two slots start two batch jobs; then the laptop asks for one. */
    ck_assert_int_eq (s_pop_id (s), 0);
    ck_assert_int_eq (s_pop_id (s), 1);
    kiln_sched_push (s, "laptop", 0, false, &single);
    ck_assert_uint_eq (kiln_sched_tenant_size (s, "ci"), 498);
    ck_assert_uint_eq (kiln_sched_tenant_size (s, "laptop"), 1);
    /* The next free slot goes to the laptop, not to the batch. */
    ck_assert_int_eq (s_pop_id (s), 1000);
    ck_assert_int_eq (s_pop_id (s), 2);
    kiln_sched_destroy (&s);
}
END_TEST

START_TEST (test_clients_with_work_take_turns)
{
    kiln_sched_t *s = kiln_sched_new ();
    s_job_t a[3], b[3], c[3];
    for (int i = 0; i < 3; i++) {
        a[i] = (s_job_t) { "a", 10 + i, true };
        b[i] = (s_job_t) { "b", 20 + i, true };
        c[i] = (s_job_t) { "c", 30 + i, true };
        kiln_sched_push (s, "a", 0, false, &a[i]);
        kiln_sched_push (s, "b", 0, false, &b[i]);
        kiln_sched_push (s, "c", 0, false, &c[i]);
    }
    int want[] = { 10, 20, 30, 11, 21, 31, 12, 22, 32 };
    for (int i = 0; i < 9; i++)
        ck_assert_int_eq (s_pop_id (s), want[i]);
    kiln_sched_destroy (&s);
}
END_TEST

START_TEST (test_lower_priority_values_run_first_and_requeued_jobs_lead)
{
    kiln_sched_t *s = kiln_sched_new ();
    s_job_t j[5] = { { "a", 0, true }, { "a", 1, true }, { "b", 2, true },
                     { "a", 3, true }, { "b", 4, true } };
    kiln_sched_push (s, "a", 0, false, &j[0]);
    kiln_sched_push (s, "a", 5, false, &j[1]);
    kiln_sched_push (s, "b", 0, false, &j[2]);
    kiln_sched_push (s, "a", -3, false, &j[3]);
    /* the urgent one first, across clients */
    ck_assert_int_eq (s_pop_id (s), 3);
    /* a job that ran and came back goes before b's job of its priority */
    kiln_sched_push (s, "b", 0, true, &j[4]);
    ck_assert_int_eq (s_pop_id (s), 4);
    ck_assert_int_eq (s_pop_id (s), 0);
    ck_assert_int_eq (s_pop_id (s), 2);
    ck_assert_int_eq (s_pop_id (s), 1);
    kiln_sched_destroy (&s);
}
END_TEST

START_TEST (test_jobs_no_worker_can_take_do_not_block_the_others)
{
    kiln_sched_t *s = kiln_sched_new ();
    s_job_t j[3] = { { "a", 0, false }, { "a", 1, true }, { "b", 2, false } };
    for (int i = 0; i < 3; i++)
        kiln_sched_push (s, j[i].tenant, 0, false, &j[i]);
    ck_assert_int_eq (s_pop_id (s), 1);
    ck_assert_int_eq (s_pop_id (s), -1);
    ck_assert_uint_eq (kiln_sched_size (s), 2);
    j[2].runnable = true;
    ck_assert_int_eq (s_pop_id (s), 2);
    kiln_sched_destroy (&s);
}
END_TEST

START_TEST (test_removed_and_reprioritized_jobs)
{
    kiln_sched_t *s = kiln_sched_new ();
    s_job_t j[3] = { { "a", 0, true }, { "a", 1, true }, { "a", 2, true } };
    kiln_sched_item_t *items[3];
    for (int i = 0; i < 3; i++)
        items[i] = kiln_sched_push (s, "a", 0, false, &j[i]);
    kiln_sched_remove (s, &items[0]);
    ck_assert_ptr_null (items[0]);
    kiln_sched_set_priority (s, items[2], -1);
    ck_assert_int_eq (kiln_sched_priority (items[2]), -1);
    ck_assert_int_eq (s_pop_id (s), 2);
    ck_assert_int_eq (s_pop_id (s), 1);
    ck_assert_int_eq (s_pop_id (s), -1);
    kiln_sched_destroy (&s);
}
END_TEST

static void
s_count (const char *tenant, size_t queued, uint64_t served, void *arg)
{
    uint64_t *sum = arg;
    sum[0] += queued;
    sum[1] += served;
}

START_TEST (test_a_job_deep_in_a_queue_is_found_within_the_scan_depth_only)
{
    kiln_sched_t *s = kiln_sched_new ();
    s_job_t *j = calloc (KILN_SCHED_SCAN + 1, sizeof *j);
    for (int i = 0; i <= KILN_SCHED_SCAN; i++) {
        j[i] = (s_job_t) { "a", i, i == KILN_SCHED_SCAN };
        kiln_sched_push (s, "a", 0, false, &j[i]);
    }
    /* The only runnable job is past the scan depth: not found (bounded
     * work per pop); one within it is. */
    ck_assert_int_eq (s_pop_id (s), -1);
    j[KILN_SCHED_SCAN - 1].runnable = true;
    ck_assert_int_eq (s_pop_id (s), KILN_SCHED_SCAN - 1);
    uint64_t sum[2] = { 0, 0 };
    kiln_sched_each_tenant (s, s_count, sum);
    ck_assert_uint_eq (sum[0], KILN_SCHED_SCAN);
    ck_assert_uint_eq (sum[1], 1);
    kiln_sched_destroy (&s);
    free (j);
}
END_TEST

int
main (void)
{
    Suite *s = suite_create ("sched");
    TCase *tc = tcase_create ("sched");
    tcase_add_test (tc, test_one_client_is_first_come_first_served);
    tcase_add_test (tc, test_a_single_job_passes_another_clients_batch);
    tcase_add_test (tc, test_clients_with_work_take_turns);
    tcase_add_test (tc, test_lower_priority_values_run_first_and_requeued_jobs_lead);
    tcase_add_test (tc, test_jobs_no_worker_can_take_do_not_block_the_others);
    tcase_add_test (tc, test_removed_and_reprioritized_jobs);
    tcase_add_test (tc, test_a_job_deep_in_a_queue_is_found_within_the_scan_depth_only);
    tcase_add_test (tc, test_a_queued_jobs_position_follows_priority_and_removals);
    suite_add_tcase (s, tc);
    return testlib_run (s);
}
