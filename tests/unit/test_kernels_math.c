/*
 * Unit tests of the math kernels (runtime/kiln_kernels_math.c), driven
 * directly through kiln_kernel_prepare / kiln_kernel_run on programs
 * built in memory: what a kernel refuses at load time (every check that
 * keeps it inside its buffers), and the semantics numpy and torch do not
 * pin down (integer division by zero, Cast of NaN and out-of-range
 * floats, reductions over axes that are not one block).  End-to-end
 * numerics against numpy and torch are in
 * tests/integration/test_ops_math.py.
 */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/kiln_program.h"
#include "runtime/kiln_kernels.h"
#include "tests/unit/testlib.h"

#define SCALAR ((kiln_shape_t) { .rank = 0 })

/* A program being built, with a buffer per tensor. */
typedef struct {
    kiln_program_t *p;
    void *data[32];
} s_prog_t;

static void
s_init (s_prog_t *sp)
{
    memset (sp, 0, sizeof *sp);
    sp->p = kiln_program_new ();
    ck_assert_ptr_nonnull (sp->p);
}

static void
s_release (s_prog_t *sp)
{
    for (int i = 0; i < 32; i++)
        free (sp->data[i]);
    kiln_program_destroy (&sp->p);
}

static int
s_tensor (s_prog_t *sp, kiln_dtype_t dt, kiln_shape_t shape)
{
    kiln_err_t err = { 0 };
    int t = kiln_program_add_tensor (sp->p, dt, &shape, KILN_TK_TEMP, &err);
    ck_assert_msg (t >= 0 && t < 32, "%s", err.msg);
    sp->data[t] = calloc (1, sp->p->tensors[t].size + 1);
    ck_assert_ptr_nonnull (sp->data[t]);
    return t;
}

static kiln_prog_op_t *
s_op (s_prog_t *sp, kiln_kernel_t k, const int *ins, int n_in, const int *outs, int n_out)
{
    kiln_err_t err = { 0 };
    int op = kiln_program_add_op (sp->p, k, ins, n_in, outs, n_out, &err);
    ck_assert_msg (op >= 0, "%s", err.msg);
    return &sp->p->ops[op];
}

/* Prepare the last op; 0 or the error code with `err` filled in. */
static int
s_prepare (s_prog_t *sp, kiln_kplan_t *plan, kiln_err_t *err)
{
    return kiln_kernel_prepare (sp->p, sp->p->n_ops - 1, plan, err);
}

static void
s_prepare_run (s_prog_t *sp)
{
    kiln_kplan_t plan;
    kiln_err_t err = { 0 };
    ck_assert_msg (s_prepare (sp, &plan, &err) == 0, "%s", err.msg);
    kiln_kernel_run (&plan, sp->data);
}

static void
s_set_ints (kiln_prog_op_t *op, const char *name, const int64_t *v, int n)
{
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_prog_op_set_ints (op, name, v, n, &err) == 0, "%s", err.msg);
}

static void
s_set_int (kiln_prog_op_t *op, const char *name, int64_t v)
{
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_prog_op_set_int (op, name, v, &err) == 0, "%s", err.msg);
}

static void
s_set_float (kiln_prog_op_t *op, const char *name, double v)
{
    kiln_err_t err = { 0 };
    ck_assert_msg (kiln_prog_op_set_float (op, name, v, &err) == 0, "%s", err.msg);
}

/* --- semantics ------------------------------------------------------- */

START_TEST (test_integer_division_by_zero_gives_zero_and_min_over_minus_one_wraps)
{
    s_prog_t sp;
    s_init (&sp);
    int a = s_tensor (&sp, KILN_DT_INT64, SH (5));
    int b = s_tensor (&sp, KILN_DT_INT64, SH (5));
    int y = s_tensor (&sp, KILN_DT_INT64, SH (5));
    memcpy (sp.data[a], (int64_t[]) { 7, -7, INT64_MIN, 5, 0 }, 5 * sizeof (int64_t));
    memcpy (sp.data[b], (int64_t[]) { 0, 2, -1, -2, 0 }, 5 * sizeof (int64_t));
    kiln_prog_op_t *op = s_op (&sp, KILN_K_DIV, (int[]) { a, b }, 2, &y, 1);
    s_set_ints (op, "shape_a", (int64_t[]) { 5 }, 1);
    s_set_ints (op, "shape_b", (int64_t[]) { 5 }, 1);
    s_prepare_run (&sp);
    const int64_t want[5] = { 0, -3, INT64_MIN, -2, 0 };
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq (((int64_t *) sp.data[y])[i], want[i]);
    s_release (&sp);
}
END_TEST

START_TEST (test_cast_saturates_and_maps_nan_to_zero)
{
    s_prog_t sp;
    s_init (&sp);
    int x = s_tensor (&sp, KILN_DT_FLOAT32, SH (7));
    int i32 = s_tensor (&sp, KILN_DT_INT32, SH (7));
    int u8 = s_tensor (&sp, KILN_DT_UINT8, SH (7));
    int b = s_tensor (&sp, KILN_DT_BOOL, SH (7));
    const float in[7] = { NAN, 1e10f, -1e10f, 3.9f, -3.9f, INFINITY, 0.0f };
    memcpy (sp.data[x], in, sizeof in);
    s_op (&sp, KILN_K_CAST, &x, 1, &i32, 1);
    s_prepare_run (&sp);
    s_op (&sp, KILN_K_CAST, &x, 1, &u8, 1);
    s_prepare_run (&sp);
    s_op (&sp, KILN_K_CAST, &x, 1, &b, 1);
    s_prepare_run (&sp);
    const int32_t want32[7] = { 0, INT32_MAX, INT32_MIN, 3, -3, INT32_MAX, 0 };
    const uint8_t want8[7] = { 0, 255, 0, 3, 0, 255, 0 };
    const uint8_t wantb[7] = { 1, 1, 1, 1, 1, 1, 0 };
    for (int i = 0; i < 7; i++) {
        ck_assert_int_eq (((int32_t *) sp.data[i32])[i], want32[i]);
        ck_assert_int_eq (((uint8_t *) sp.data[u8])[i], want8[i]);
        ck_assert_int_eq (((uint8_t *) sp.data[b])[i], wantb[i]);
    }
    s_release (&sp);
}
END_TEST

/* Sum over `axes` of a [2, 3, 70] float32 tensor, against a naive loop:
 * covers the row-at-a-time path across a 64-column chunk boundary and the
 * element-by-element path for axes that are not one block. */
START_TEST (test_reduce_sum_over_blocks_and_spread_axes_matches_naive_loop)
{
    static const struct {
        int64_t axes[3];
        int n;
    } cases[] = { { { 1 }, 1 }, { { 0, 2 }, 2 }, { { 0 }, 1 }, { { 2 }, 1 },
                  { { 0, 1, 2 }, 3 }, { { 0, 1 }, 2 } };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        s_prog_t sp;
        s_init (&sp);
        int64_t d[3] = { 2, 3, 70 }, outn = 1;
        bool red[3] = { false, false, false };
        for (int i = 0; i < cases[c].n; i++)
            red[cases[c].axes[i]] = true;
        for (int i = 0; i < 3; i++)
            outn *= red[i] ? 1 : d[i];
        int x = s_tensor (&sp, KILN_DT_FLOAT32, SH (2, 3, 70));
        int y = s_tensor (&sp, KILN_DT_FLOAT32, SH (outn));
        float *xv = sp.data[x];
        for (int i = 0; i < 2 * 3 * 70; i++)
            xv[i] = (float) ((i * 37) % 101) / 16.0f;
        kiln_prog_op_t *op = s_op (&sp, KILN_K_REDUCE_SUM, &x, 1, &y, 1);
        s_set_ints (op, "axes", cases[c].axes, cases[c].n);
        s_prepare_run (&sp);
        double want[2 * 3 * 70] = { 0 };
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 3; j++)
                for (int k = 0; k < 70; k++) {
                    int64_t o = 0;
                    int64_t idx[3] = { i, j, k };
                    for (int a = 0; a < 3; a++)
                        if (!red[a])
                            o = o * d[a] + idx[a];
                    want[o] += xv[(i * 3 + j) * 70 + k];
                }
        for (int64_t o = 0; o < outn; o++)
            ck_assert_msg (fabs (((float *) sp.data[y])[o] - want[o]) < 1e-3,
                           "case %zu, element %lld: %f, expected %f", c, (long long) o,
                           ((float *) sp.data[y])[o], want[o]);
        s_release (&sp);
    }
}
END_TEST

START_TEST (test_layer_norm_stats_writes_mean_and_inverse_std)
{
    s_prog_t sp;
    s_init (&sp);
    int x = s_tensor (&sp, KILN_DT_FLOAT32, SH (2, 4));
    int s = s_tensor (&sp, KILN_DT_FLOAT32, SCALAR);
    int y = s_tensor (&sp, KILN_DT_FLOAT32, SH (2, 4));
    int m = s_tensor (&sp, KILN_DT_FLOAT32, SH (2, 1));
    int inv = s_tensor (&sp, KILN_DT_FLOAT32, SH (2, 1));
    memcpy (sp.data[x], (float[]) { 1, 2, 3, 4, -2, -2, 2, 2 }, 8 * sizeof (float));
    *(float *) sp.data[s] = 2.0f;
    kiln_prog_op_t *op = s_op (&sp, KILN_K_LAYER_NORM_STATS, (int[]) { x, s }, 2,
                               (int[]) { y, m, inv }, 3);
    s_set_int (op, "axis", 1);
    s_set_float (op, "epsilon", 0.0);
    s_prepare_run (&sp);
    const float *mv = sp.data[m], *iv = sp.data[inv], *yv = sp.data[y];
    ck_assert_float_eq_tol (mv[0], 2.5f, 1e-6f);
    ck_assert_float_eq_tol (mv[1], 0.0f, 1e-6f);
    ck_assert_float_eq_tol (iv[0], (float) (1 / sqrt (1.25)), 1e-6f);
    ck_assert_float_eq_tol (iv[1], 0.5f, 1e-6f);
    ck_assert_float_eq_tol (yv[4], -2.0f, 1e-6f);
    ck_assert_float_eq_tol (yv[7], 2.0f, 1e-6f);
    s_release (&sp);
}
END_TEST

/* --- refusals ---------------------------------------------------------- */

typedef void (*s_builder_t) (s_prog_t *sp);

static void
b_axes_not_ascending (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_FLOAT32, SH (2, 3));
    int y = s_tensor (sp, KILN_DT_FLOAT32, SCALAR);
    s_set_ints (s_op (sp, KILN_K_REDUCE_SUM, &x, 1, &y, 1), "axes", (int64_t[]) { 1, 0 }, 2);
}

static void
b_reduce_output_too_small (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_FLOAT32, SH (2, 3));
    int y = s_tensor (sp, KILN_DT_FLOAT32, SH (2));
    s_set_ints (s_op (sp, KILN_K_REDUCE_MAX, &x, 1, &y, 1), "axes", (int64_t[]) { 0 }, 1);
}

static void
b_argmax_axis_out_of_range (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_FLOAT32, SH (2, 3));
    int y = s_tensor (sp, KILN_DT_INT64, SH (2));
    kiln_prog_op_t *op = s_op (sp, KILN_K_ARGMAX, &x, 1, &y, 1);
    s_set_int (op, "axis", 2);
    s_set_int (op, "select_last", 0);
}

static void
b_argmax_output_not_int64 (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_FLOAT32, SH (2, 3));
    int y = s_tensor (sp, KILN_DT_INT32, SH (2));
    kiln_prog_op_t *op = s_op (sp, KILN_K_ARGMAX, &x, 1, &y, 1);
    s_set_int (op, "axis", 1);
    s_set_int (op, "select_last", 0);
}

static void
b_int_add_shape_param_disagrees (s_prog_t *sp)
{
    int a = s_tensor (sp, KILN_DT_INT64, SH (2, 3));
    int b = s_tensor (sp, KILN_DT_INT64, SH (3));
    int y = s_tensor (sp, KILN_DT_INT64, SH (2, 3));
    kiln_prog_op_t *op = s_op (sp, KILN_K_ADD, (int[]) { a, b }, 2, &y, 1);
    s_set_ints (op, "shape_a", (int64_t[]) { 2, 3 }, 2);
    s_set_ints (op, "shape_b", (int64_t[]) { 3, 1 }, 2);
}

static void
b_operands_do_not_broadcast (s_prog_t *sp)
{
    int a = s_tensor (sp, KILN_DT_FLOAT64, SH (3));
    int b = s_tensor (sp, KILN_DT_FLOAT64, SH (4));
    int y = s_tensor (sp, KILN_DT_FLOAT64, SH (3));
    s_op (sp, KILN_K_MAX, (int[]) { a, b }, 2, &y, 1);
}

static void
b_operand_dtypes_differ (s_prog_t *sp)
{
    int a = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    int b = s_tensor (sp, KILN_DT_INT64, SH (3));
    int y = s_tensor (sp, KILN_DT_BOOL, SH (3));
    s_op (sp, KILN_K_LESS, (int[]) { a, b }, 2, &y, 1);
}

static void
b_comparison_output_not_bool (s_prog_t *sp)
{
    int a = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    int y = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    s_op (sp, KILN_K_EQUAL, (int[]) { a, a }, 2, &y, 1);
}

static void
b_where_condition_not_bool (s_prog_t *sp)
{
    int c = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    int x = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    int y = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    s_op (sp, KILN_K_WHERE, (int[]) { c, x, x }, 3, &y, 1);
}

static void
b_clip_bound_input_unnamed (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    int lo = s_tensor (sp, KILN_DT_FLOAT32, SCALAR);
    int y = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    s_op (sp, KILN_K_CLIP, (int[]) { x, lo }, 2, &y, 1);
}

static void
b_clip_bound_not_scalar (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_INT32, SH (3));
    int lo = s_tensor (sp, KILN_DT_INT32, SH (3));
    int y = s_tensor (sp, KILN_DT_INT32, SH (3));
    s_set_int (s_op (sp, KILN_K_CLIP, (int[]) { x, lo }, 2, &y, 1), "min_input", 1);
}

static void
b_unary_float_op_on_integers (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_INT64, SH (3));
    int y = s_tensor (sp, KILN_DT_INT64, SH (3));
    s_op (sp, KILN_K_EXP, &x, 1, &y, 1);
}

static void
b_leaky_relu_without_alpha (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    int y = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    s_op (sp, KILN_K_LEAKY_RELU, &x, 1, &y, 1);
}

static void
b_unknown_parameter (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    int y = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    s_set_float (s_op (sp, KILN_K_SIGMOID, &x, 1, &y, 1), "fused_scale", 2.0);
}

static void
b_softmax_flatten_not_boolean (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_FLOAT32, SH (2, 3));
    int y = s_tensor (sp, KILN_DT_FLOAT32, SH (2, 3));
    kiln_prog_op_t *op = s_op (sp, KILN_K_SOFTMAX, &x, 1, &y, 1);
    s_set_int (op, "axis", 1);
    s_set_int (op, "flatten", 2);
}

static void
b_layer_norm_scale_wrong_size (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_FLOAT32, SH (2, 4));
    int s = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    int y = s_tensor (sp, KILN_DT_FLOAT32, SH (2, 4));
    kiln_prog_op_t *op = s_op (sp, KILN_K_LAYER_NORM, (int[]) { x, s }, 2, &y, 1);
    s_set_int (op, "axis", 1);
    s_set_float (op, "epsilon", 1e-5);
}

static void
b_batch_norm_nan_epsilon (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_FLOAT32, SH (2, 3, 4));
    int c = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    int y = s_tensor (sp, KILN_DT_FLOAT32, SH (2, 3, 4));
    s_set_float (s_op (sp, KILN_K_BATCH_NORM, (int[]) { x, c, c, c, c }, 5, &y, 1),
                 "epsilon", NAN);
}

static void
b_batch_norm_channel_vector_wrong_size (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_FLOAT32, SH (2, 3, 4));
    int c = s_tensor (sp, KILN_DT_FLOAT32, SH (3));
    int d = s_tensor (sp, KILN_DT_FLOAT32, SH (4));
    int y = s_tensor (sp, KILN_DT_FLOAT32, SH (2, 3, 4));
    s_set_float (s_op (sp, KILN_K_BATCH_NORM, (int[]) { x, c, c, c, d }, 5, &y, 1),
                 "epsilon", 1e-5);
}

static void
b_lrn_size_zero (s_prog_t *sp)
{
    int x = s_tensor (sp, KILN_DT_FLOAT32, SH (1, 3, 2));
    int y = s_tensor (sp, KILN_DT_FLOAT32, SH (1, 3, 2));
    kiln_prog_op_t *op = s_op (sp, KILN_K_LRN, &x, 1, &y, 1);
    s_set_int (op, "size", 0);
    s_set_float (op, "alpha", 1e-4);
    s_set_float (op, "beta", 0.75);
    s_set_float (op, "bias", 1.0);
}

START_TEST (test_prepare_refuses_inconsistent_ops_naming_the_culprit)
{
    static const struct {
        s_builder_t build;
        const char *want;       /* must appear in the message */
    } cases[] = {
        { b_axes_not_ascending, "'axes'" },
        { b_reduce_output_too_small, "the output holds 2 elements" },
        { b_argmax_axis_out_of_range, "'axis' is 2" },
        { b_argmax_output_not_int64, "the output is int32" },
        { b_int_add_shape_param_disagrees, "'shape_b'" },
        { b_operands_do_not_broadcast, "does not broadcast" },
        { b_operand_dtypes_differ, "input 1 is int64" },
        { b_comparison_output_not_bool, "expected bool" },
        { b_where_condition_not_bool, "condition" },
        { b_clip_bound_input_unnamed, "input 1 is neither bound" },
        { b_clip_bound_not_scalar, "min_input holds 3 elements" },
        { b_unary_float_op_on_integers, "input 0 is int64" },
        { b_leaky_relu_without_alpha, "alpha" },
        { b_unknown_parameter, "fused_scale" },
        { b_softmax_flatten_not_boolean, "'flatten'" },
        { b_layer_norm_scale_wrong_size, "input 1 holds 3 elements" },
        { b_batch_norm_nan_epsilon, "'epsilon' is not finite" },
        { b_batch_norm_channel_vector_wrong_size, "input 4 holds 4 elements" },
        { b_lrn_size_zero, "'size'" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        s_prog_t sp;
        s_init (&sp);
        cases[i].build (&sp);
        kiln_kplan_t plan;
        kiln_err_t err = { 0 };
        ck_assert_msg (s_prepare (&sp, &plan, &err) != 0, "case %zu was accepted", i);
        ck_assert_msg (strstr (err.msg, cases[i].want) && strstr (err.msg, "op 0 ("),
                       "case %zu: '%s' does not say '%s'", i, err.msg, cases[i].want);
        s_release (&sp);
    }
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("kernels_math");
    TCase *tc = tcase_create ("core");
    tcase_add_test (tc, test_integer_division_by_zero_gives_zero_and_min_over_minus_one_wraps);
    tcase_add_test (tc, test_cast_saturates_and_maps_nan_to_zero);
    tcase_add_test (tc, test_reduce_sum_over_blocks_and_spread_axes_matches_naive_loop);
    tcase_add_test (tc, test_layer_norm_stats_writes_mean_and_inverse_std);
    tcase_add_test (tc, test_prepare_refuses_inconsistent_ops_naming_the_culprit);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run (s_suite ());
}
