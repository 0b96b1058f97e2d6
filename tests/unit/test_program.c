/*
 * Unit tests for common/kiln_program: the program format shared by the
 * compiler and the runtime.  Encoding round trips and is deterministic;
 * the checker refuses every way a program could point outside its
 * buffers; the decoder never allocates more than its input justifies.
 */
#include <check.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kiln_program.h"
#include "tests/unit/testlib.h"

/* input x[2,3] -> relu -> y (output), plus a weight w[3] and an add. */
static kiln_program_t *
s_sample (void)
{
    kiln_err_t err = { 0 };
    kiln_program_t *p = kiln_program_new ();
    kiln_shape_t s23 = { .rank = 2, .dims = { 2, 3 } }, s3 = { .rank = 1, .dims = { 3 } };
    int x = kiln_program_add_tensor (p, KILN_DT_FLOAT32, &s23, KILN_TK_INPUT, &err);
    int t = kiln_program_add_tensor (p, KILN_DT_FLOAT32, &s23, KILN_TK_TEMP, &err);
    int w = kiln_program_add_tensor (p, KILN_DT_FLOAT32, &s3, KILN_TK_WEIGHT, &err);
    int y = kiln_program_add_tensor (p, KILN_DT_FLOAT32, &s23, KILN_TK_OUTPUT, &err);
    ck_assert (x == 0 && t == 1 && w == 2 && y == 3);
    p->tensors[x].io = 0;
    p->tensors[y].io = 0;
    p->tensors[t].offset = 64;
    p->tensors[y].offset = 0;      /* reuses x's bytes: x is dead by then */
    p->arena_size = 128;
    ck_assert (kiln_program_add_io (p, false, x, &err) == 0);
    ck_assert (kiln_program_add_io (p, true, y, &err) == 0);
    int op = kiln_program_add_op (p, KILN_K_RELU, &x, 1, &t, 1, &err);
    ck_assert (op == 0);
    int ins[2] = { t, w };
    op = kiln_program_add_op (p, KILN_K_ADD, ins, 2, &y, 1, &err);
    int64_t sa[2] = { 2, 3 }, sb[2] = { 1, 3 };
    ck_assert (kiln_prog_op_set_ints (&p->ops[op], "shape_b", sb, 2, &err) == 0);
    ck_assert (kiln_prog_op_set_ints (&p->ops[op], "shape_a", sa, 2, &err) == 0);
    ck_assert (kiln_prog_op_set_float (&p->ops[op], "alpha", 0.5, &err) == 0);
    ck_assert (kiln_prog_op_set_int (&p->ops[op], "mode", -3, &err) == 0);
    ck_assert_msg (kiln_program_check (p, 64, &err) == 0, "%s", err.msg);
    return p;
}

START_TEST (test_program_round_trips_and_encodes_deterministically)
{
    kiln_err_t err = { 0 };
    kiln_program_t *p = s_sample ();
    uint8_t *a, *b;
    size_t la, lb;
    ck_assert (kiln_program_encode (p, &a, &la, &err) == 0);
    kiln_program_t *q = kiln_program_decode (a, la, 64, &err);
    ck_assert_msg (q, "%s", err.msg);
    ck_assert_int_eq (q->n_tensors, 4);
    ck_assert_int_eq (q->n_ops, 2);
    ck_assert_uint_eq (q->arena_size, 128);
    ck_assert_int_eq (q->tensors[3].kind, KILN_TK_OUTPUT);
    ck_assert_uint_eq (q->tensors[1].offset, 64);
    ck_assert_uint_eq (q->tensors[2].size, 12);
    ck_assert_int_eq (q->ops[1].kernel, KILN_K_ADD);
    int64_t v;
    double f;
    int64_t sb[2];
    ck_assert (kiln_prog_op_int (&q->ops[1], "mode", &v, &err) == 0 && v == -3);
    ck_assert (kiln_prog_op_float (&q->ops[1], "alpha", &f, &err) == 0 && f == 0.5);
    ck_assert (kiln_prog_op_ints (&q->ops[1], "shape_b", 2, sb, &err) == 0);
    ck_assert (sb[0] == 1 && sb[1] == 3);
    /* Parameters come out sorted by name whatever order they went in. */
    ck_assert_str_eq (q->ops[1].params[0].name, "alpha");
    ck_assert_str_eq (q->ops[1].params[3].name, "shape_b");
    ck_assert (kiln_program_encode (q, &b, &lb, &err) == 0);
    ck_assert (la == lb && memcmp (a, b, la) == 0);
    free (a);
    free (b);
    kiln_program_destroy (&q);
    kiln_program_destroy (&p);
}
END_TEST

START_TEST (test_program_param_getters_check_kind_count_and_use)
{
    kiln_err_t err = { 0 };
    kiln_program_t *p = s_sample ();
    kiln_prog_op_t *op = &p->ops[1];
    int64_t v[4];
    double f;
    ck_assert (kiln_prog_op_int (op, "nope", v, &err) == -KILN_EFORMAT);
    ck_assert (strstr (err.msg, "missing parameter 'nope'"));
    ck_assert (kiln_prog_op_int (op, "alpha", v, &err) == -KILN_EFORMAT);
    ck_assert (strstr (err.msg, "'alpha' is not an integer"));
    ck_assert (kiln_prog_op_ints (op, "shape_a", 3, v, &err) == -KILN_EFORMAT);
    ck_assert (strstr (err.msg, "expected 3"));
    op->params_used = 0;
    ck_assert (kiln_prog_op_float (op, "alpha", &f, &err) == 0);
    ck_assert (kiln_prog_op_has (op, "shape_a") && kiln_prog_op_has (op, "shape_b"));
    ck_assert (kiln_prog_op_all_used (op, &err) == -KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "unknown parameter 'mode'"), "%s", err.msg);
    ck_assert (kiln_prog_op_has (op, "mode"));
    ck_assert (kiln_prog_op_all_used (op, &err) == 0);
    /* Setting replaces; bounds hold. */
    ck_assert (kiln_prog_op_set_int (op, "mode", 4, &err) == 0);
    ck_assert_int_eq (op->n_params, 4);
    int64_t many[KILN_PROG_MAX_PARAM_INTS + 1] = { 0 };
    ck_assert (kiln_prog_op_set_ints (op, "big", many, KILN_PROG_MAX_PARAM_INTS + 1, &err)
               == -KILN_ELIMIT);
    ck_assert (kiln_prog_op_set_int (op, "a_name_that_is_far_too_long_for_a_param", 1, &err) != 0);
    kiln_program_destroy (&p);
}
END_TEST

START_TEST (test_kernel_table_names_round_trip)
{
    for (int k = 0; k < KILN_K_COUNT; k++) {
        const char *n = kiln_kernel_name ((kiln_kernel_t) k);
        ck_assert_int_eq (kiln_kernel_from_name (n, strlen (n)), k);
        for (int j = 0; j < k; j++)
            ck_assert_str_ne (n, kiln_kernel_name ((kiln_kernel_t) j));
        int lo, hi, no;
        kiln_kernel_arity ((kiln_kernel_t) k, &lo, &hi, &no);
        ck_assert (lo >= 1 && lo <= hi && hi <= KILN_PROG_MAX_OP_IO && no >= 1
                   && no <= KILN_PROG_MAX_OP_IO);
    }
    ck_assert_int_eq (kiln_kernel_from_name ("conv4d", 6), -1);
    ck_assert_str_eq (kiln_kernel_name (KILN_K_COUNT), "unknown");
}
END_TEST

typedef void (*breaker_t) (kiln_program_t *p);
static void b_offset (kiln_program_t *p) { p->tensors[1].offset = 128; }
static void b_misaligned (kiln_program_t *p) { p->tensors[1].offset = 32; }
static void b_size (kiln_program_t *p) { p->tensors[1].size = 28; }
static void b_weight (kiln_program_t *p) { p->tensors[2].offset = 64; }
static void b_arena_big (kiln_program_t *p) { p->arena_size = 192; }
static void b_arena_odd (kiln_program_t *p) { p->arena_size = 100; }
static void b_io (kiln_program_t *p) { p->tensors[0].io = 1; }
static void b_output_io (kiln_program_t *p) { p->tensors[3].io = -1; }
static void b_temp_io (kiln_program_t *p) { p->tensors[1].io = 0; }
static void b_in_index (kiln_program_t *p) { p->ops[0].inputs[0] = 4; }
static void b_out_index (kiln_program_t *p) { p->ops[0].outputs[0] = -1; }
static void b_write_input (kiln_program_t *p) { p->ops[0].outputs[0] = 0; }
static void b_write_weight (kiln_program_t *p) { p->ops[1].outputs[0] = 2; }
static void b_arity (kiln_program_t *p) { p->ops[0].n_inputs = 2; p->ops[0].inputs[1] = 0; }
static void b_scratch (kiln_program_t *p) { p->ops[0].scratch = 2; }
static void b_dup_param (kiln_program_t *p) { strcpy (p->ops[1].params[1].name, p->ops[1].params[0].name); }
static void b_inputs (kiln_program_t *p) { p->inputs[0] = 1; }
static void b_dtype (kiln_program_t *p) { p->tensors[1].dtype = (kiln_dtype_t) 99; }

START_TEST (test_program_check_refuses_what_could_escape_a_buffer)
{
    struct { breaker_t fn; const char *want; } cases[] = {
        { b_offset, "outside the arena" },
        { b_misaligned, "not a multiple of 64" },
        { b_size, "does not match" },
        { b_weight, "outside weights.bin" },
        { b_arena_big, "larger than its tensors need" },
        { b_arena_odd, "not a multiple" },
        { b_io, "program input 0" },
        { b_output_io, "output position" },
        { b_temp_io, "io position" },
        { b_in_index, "names tensor 4" },
        { b_out_index, "names tensor -1" },
        { b_write_input, "writes input" },
        { b_write_weight, "writes weight" },
        { b_arity, "2 inputs" },
        { b_scratch, "scratch" },
        { b_dup_param, "twice" },
        { b_inputs, "program input 0" },
        { b_dtype, "unknown dtype" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_program_t *p = s_sample ();
        kiln_err_t err = { 0 };
        cases[i].fn (p);
        ck_assert_msg (kiln_program_check (p, 64, &err) != 0, "case %zu accepted", i);
        ck_assert_msg (strstr (err.msg, cases[i].want), "case %zu: '%s' lacks '%s'",
                       i, err.msg, cases[i].want);
        kiln_program_destroy (&p);
    }
}
END_TEST

START_TEST (test_program_decode_refuses_oversized_declarations_cheaply)
{
    kiln_err_t err = { 0 };
    /* An array claiming 4 billion elements in 6 bytes: refused before
     * msgpack-c would try to allocate room for them. */
    const uint8_t huge[] = { 0xdd, 0xff, 0xff, 0xff, 0xf0, 0x01 };
    ck_assert (kiln_program_decode (huge, sizeof huge, 0, &err) == NULL);
    ck_assert_msg (strstr (err.msg, "claims 4294967280 elements"), "%s", err.msg);
    const uint8_t str[] = { 0xdb, 0x7f, 0xff, 0xff, 0xff, 'a' };
    ck_assert (kiln_program_decode (str, sizeof str, 0, &err) == NULL);
    ck_assert (strstr (err.msg, "truncated"));
    const uint8_t bad[] = { 0xc1 };
    ck_assert (kiln_program_decode (bad, sizeof bad, 0, &err) == NULL);
    ck_assert (kiln_program_decode (NULL, 0, 0, &err) == NULL);
    const uint8_t notmap[] = { 0x93, 1, 2, 3 };
    ck_assert (kiln_program_decode (notmap, sizeof notmap, 0, &err) == NULL);
    ck_assert (strstr (err.msg, "not a map"));

    /* Every truncation and every single-byte change of a valid program
     * is decoded or refused, never crashes. */
    kiln_program_t *p = s_sample ();
    uint8_t *a;
    size_t la;
    ck_assert (kiln_program_encode (p, &a, &la, &err) == 0);
    kiln_program_destroy (&p);

    /* A field this decoder does not know is refused, not ignored. */
    ck_assert_int_eq (a[0], 0x87);
    uint8_t *more = malloc (la + 4);
    memcpy (more, a, la);
    more[0] = 0x88;
    memcpy (more + la, "\xa2zz\x01", 4);
    ck_assert (kiln_program_decode (more, la + 4, 64, &err) == NULL);
    ck_assert_msg (strstr (err.msg, "unknown field 'zz'"), "%s", err.msg);
    more[la + 1] = 'o';
    more[la + 2] = 'p';
    memcpy (more + la, "\xa3ops", 4);
    more = realloc (more, la + 5);
    more[la + 4] = 0x90;
    ck_assert (kiln_program_decode (more, la + 5, 64, &err) == NULL);
    ck_assert_msg (strstr (err.msg, "'ops' appears twice"), "%s", err.msg);
    free (more);
    for (size_t cut = 0; cut < la; cut++)
        ck_assert (kiln_program_decode (a, cut, 64, &err) == NULL);
    for (size_t i = 0; i < la; i++)
        for (int v = 0; v < 256; v += 17) {
            uint8_t keep = a[i];
            a[i] = (uint8_t) v;
            kiln_program_t *q = kiln_program_decode (a, la, 64, &err);
            kiln_program_destroy (&q);
            a[i] = keep;
        }
    free (a);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("program");
    TCase *tc = tcase_create ("program");
    tcase_add_test (tc, test_program_round_trips_and_encodes_deterministically);
    tcase_add_test (tc, test_program_param_getters_check_kind_count_and_use);
    tcase_add_test (tc, test_kernel_table_names_round_trip);
    tcase_add_test (tc, test_program_check_refuses_what_could_escape_a_buffer);
    tcase_add_test (tc, test_program_decode_refuses_oversized_declarations_cheaply);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run (s_suite ());
}
