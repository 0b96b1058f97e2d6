/*
 * Unit tests for compile-time folding (graph/kiln_fold.c), the shape-op
 * parameters shared by inference and lowering (graph/kiln_shape_ops.c),
 * and the refusals of the runtime's shape kernels
 * (runtime/kiln_kernels_shape.c).
 *
 * Expected values are worked out by hand from the ONNX operator
 * definitions; each test says which rule it exercises.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kiln_program.h"
#include "graph/kiln_fold.h"
#include "graph/kiln_graph.h"
#include "graph/kiln_shape_ops.h"
#include "runtime/kiln_kernels.h"
#include "tests/unit/testlib.h"

/* --- building graphs ------------------------------------------------ */

static int
s_input (kiln_graph_t *g, const char *name, kiln_dtype_t dt, int rank, const int64_t *dims)
{
    kiln_err_t err;
    kiln_shape_t s = { .rank = rank };
    for (int i = 0; i < rank; i++)
        s.dims[i] = dims[i];
    int t = kiln_graph_add_tensor (g, name, dt, &s, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    ck_assert_msg (kiln_graph_add_input (g, t, &err) == 0, "%s", err.msg);
    return t;
}

/* An int64 constant of rank 1 (rank 0 when `scalar`). */
static int
s_const_i64 (kiln_graph_t *g, const char *name, const int64_t *v, int n, bool scalar)
{
    kiln_err_t err;
    kiln_shape_t s = { .rank = scalar ? 0 : 1, .dims = { n } };
    int t = kiln_graph_add_tensor (g, name, KILN_DT_INT64, &s, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    uint8_t *data = malloc ((size_t) n * 8 + 1);
    memcpy (data, v, (size_t) n * 8);
    ck_assert_msg (kiln_graph_set_weight (g, t, &data, (uint64_t) n * 8, &err) == 0, "%s",
                   err.msg);
    return t;
}

static int
s_value (kiln_graph_t *g, const char *name)
{
    kiln_err_t err;
    int t = kiln_graph_add_tensor (g, name, KILN_DT_UNDEFINED, NULL, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    return t;
}

static int
s_node (kiln_graph_t *g, const char *op, const char *name, const int *ins, int n_in, int out)
{
    kiln_err_t err;
    int n = kiln_graph_add_node (g, op, name, ins, n_in, &out, 1, &err);
    ck_assert_msg (n >= 0, "%s", err.msg);
    return n;
}

static int
s_count_op (const kiln_graph_t *g, const char *op)
{
    int k = 0;
    for (int i = 0; i < g->n_nodes; i++)
        k += strcmp (g->nodes[i].op, op) == 0;
    return k;
}

static const int64_t *
s_i64_data (const kiln_graph_t *g, int t)
{
    ck_assert_int_ge (g->tensors[t].weight, 0);
    return (const int64_t *) (const void *) g->weights[g->tensors[t].weight].data;
}

/* x [3, 2, 8] -> Reshape (x, Concat (Unsqueeze (Gather (Shape (x), 0)), [-1, 4])) */
static kiln_graph_t *
s_reshape_from_shape (int *shape_t, int *y_t)
{
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err;
    int x = s_input (g, "x", KILN_DT_FLOAT32, 3, (int64_t[]) { 3, 2, 8 });
    int zero = s_const_i64 (g, "zero", (int64_t[]) { 0 }, 1, true);
    int ax = s_const_i64 (g, "ax", (int64_t[]) { 0 }, 1, false);
    int tail = s_const_i64 (g, "tail", (int64_t[]) { -1, 4 }, 2, false);
    int s = s_value (g, "s"), n = s_value (g, "n"), n1 = s_value (g, "n1");
    int shape = s_value (g, "shape"), y = s_value (g, "y");
    s_node (g, "Shape", "shape_of_x", &x, 1, s);
    s_node (g, "Gather", "first", (int[]) { s, zero }, 2, n);
    s_node (g, "Unsqueeze", "unsq", (int[]) { n, ax }, 2, n1);
    int c = s_node (g, "Concat", "cat", (int[]) { n1, tail }, 2, shape);
    ck_assert_int_eq (kiln_node_set_int (g, c, "axis", 0, &err), 0);
    s_node (g, "Reshape", "reshape", (int[]) { x, shape }, 2, y);
    ck_assert_int_eq (kiln_graph_add_output (g, y, &err), 0);
    *shape_t = shape;
    *y_t = y;
    return g;
}

/* --- folding -------------------------------------------------------- */

START_TEST (test_fold_turns_a_shape_computation_into_a_reshape_constant)
{
    int shape, y;
    kiln_graph_t *g = s_reshape_from_shape (&shape, &y);
    kiln_err_t err;
    /* Without folding, Reshape's shape is computed at run time. */
    ck_assert_int_ne (kiln_graph_validate (g, &err), 0);
    int removed = kiln_graph_fold (g, &err);
    ck_assert_msg (removed == 4, "removed %d: %s", removed, err.msg);
    ck_assert_int_eq (g->n_nodes, 1);
    ck_assert_str_eq (g->nodes[0].op, "Reshape");
    const int64_t *v = s_i64_data (g, shape);
    ck_assert_int_eq (v[0], 3);
    ck_assert_int_eq (v[1], -1);
    ck_assert_int_eq (v[2], 4);
    ck_assert_int_eq (g->tensors[y].shape.rank, 3);
    ck_assert_int_eq (g->tensors[y].shape.dims[1], 4);
    /* Folding a folded graph changes nothing. */
    ck_assert_int_eq (kiln_graph_fold (g, &err), 0);
    ck_assert_int_eq (g->n_nodes, 1);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_fold_drops_the_constants_it_made_but_keeps_initializers)
{
    int shape, y;
    kiln_graph_t *g = s_reshape_from_shape (&shape, &y);
    kiln_err_t err;
    ck_assert_int_ge (kiln_graph_fold (g, &err), 0);
    /* Three initializers (zero, ax, tail) plus the one shape Reshape
     * reads; the intermediate constants (s, n, n1) are gone. */
    ck_assert_int_eq (g->n_weights, 4);
    ck_assert_int_lt (g->tensors[kiln_graph_find_tensor (g, "n1")].weight, 0);
    ck_assert_int_ge (g->tensors[kiln_graph_find_tensor (g, "tail")].weight, 0);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_fold_evaluates_range_constant_of_shape_and_where)
{
    /* Range (1, 10, 3) = [1, 4, 7]; ConstantOfShape ([2]) of int64 5;
     * Where ([1, 4, 7] > 3, [1, 4, 7], 5) over broadcast = [5, 4, 7]. */
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err;
    int x = s_input (g, "x", KILN_DT_INT64, 1, (int64_t[]) { 3 });
    int a = s_const_i64 (g, "a", (int64_t[]) { 1 }, 1, true);
    int b = s_const_i64 (g, "b", (int64_t[]) { 10 }, 1, true);
    int d = s_const_i64 (g, "d", (int64_t[]) { 3 }, 1, true);
    int three = s_const_i64 (g, "three", (int64_t[]) { 3 }, 1, true);
    int one = s_const_i64 (g, "one", (int64_t[]) { 1 }, 1, false);
    int r = s_value (g, "r"), c = s_value (g, "c"), gt = s_value (g, "gt");
    int w = s_value (g, "w"), y = s_value (g, "y");
    s_node (g, "Range", "range", (int[]) { a, b, d }, 3, r);
    int cs = s_node (g, "ConstantOfShape", "fill", &one, 1, c);
    ck_assert_int_eq (kiln_node_set_int (g, cs, "value_dtype", KILN_DT_INT64, &err), 0);
    ck_assert_int_eq (kiln_node_set_int (g, cs, "value", 5, &err), 0);
    s_node (g, "Greater", "gt", (int[]) { r, three }, 2, gt);
    s_node (g, "Where", "where", (int[]) { gt, r, c }, 3, w);
    s_node (g, "Add", "add", (int[]) { x, w }, 2, y);
    ck_assert_int_eq (kiln_graph_add_output (g, y, &err), 0);
    /* Add on int64 is the math engineer's op; if inference refuses it,
     * folding has still produced w: check the constant either way. */
    int rc = kiln_graph_fold (g, &err);
    int wt = g->tensors[w].weight;
    ck_assert_msg (wt >= 0, "Where was not folded: %d %s", rc, err.msg);
    const int64_t *v = s_i64_data (g, w);
    ck_assert_int_eq (g->tensors[w].shape.rank, 1);
    ck_assert_int_eq (g->tensors[w].shape.dims[0], 3);
    ck_assert_int_eq (v[0], 5);
    ck_assert_int_eq (v[1], 4);
    ck_assert_int_eq (v[2], 7);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_fold_refuses_range_of_a_graph_input_naming_node_and_input)
{
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err;
    int lim = s_input (g, "limit", KILN_DT_INT64, 0, NULL);
    int a = s_const_i64 (g, "a", (int64_t[]) { 0 }, 1, true);
    int d = s_const_i64 (g, "d", (int64_t[]) { 1 }, 1, true);
    int r = s_value (g, "r");
    s_node (g, "Range", "my_range", (int[]) { a, lim, d }, 3, r);
    ck_assert_int_eq (kiln_graph_add_output (g, r, &err), 0);
    ck_assert_int_lt (kiln_graph_fold (g, &err), 0);
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "my_range") && strstr (err.msg, "'limit'")
                   && strstr (err.msg, "run time"), "message: %s", err.msg);
    /* The graph is still whole: nothing was folded. */
    ck_assert_int_eq (g->n_nodes, 1);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_fold_refuses_a_constant_larger_than_the_limit)
{
    /* ConstantOfShape of 2^21 elements: more than KILN_FOLD_MAX_ELEMS. */
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err;
    int s = s_const_i64 (g, "s", (int64_t[]) { 2048, 1024 }, 2, false);
    int c = s_value (g, "c");
    s_node (g, "ConstantOfShape", "big", &s, 1, c);
    ck_assert_int_eq (kiln_graph_add_output (g, c, &err), 0);
    ck_assert_int_lt (kiln_graph_fold (g, &err), 0);
    ck_assert_int_eq (err.code, KILN_ELIMIT);
    ck_assert_msg (strstr (err.msg, "'big'") != NULL, "message: %s", err.msg);
    kiln_graph_destroy (&g);
}
END_TEST

/* Div of two int64 constants, folded; returns the error code. */
static int
s_fold_int_div (int64_t a, int64_t b, kiln_err_t *err)
{
    kiln_graph_t *g = kiln_graph_new ();
    int ta = s_const_i64 (g, "a", (int64_t[]) { a }, 1, false);
    int tb = s_const_i64 (g, "b", (int64_t[]) { b }, 1, false);
    int q = s_value (g, "q");
    s_node (g, "Div", "quotient", (int[]) { ta, tb }, 2, q);
    ck_assert_int_eq (kiln_graph_add_output (g, q, err), 0);
    int rc = kiln_graph_fold (g, err);
    kiln_graph_destroy (&g);
    return rc;
}

START_TEST (test_fold_tells_int64_overflow_from_division_by_zero)
{
    /* INT64_MIN / -1 has no int64 value: an overflow, named as one (it
     * was reported as a division by zero, issue 14 finding 10). */
    kiln_err_t err;
    ck_assert_int_lt (s_fold_int_div (INT64_MIN, -1, &err), 0);
    ck_assert_int_eq (err.code, KILN_EINVAL);
    ck_assert_msg (strstr (err.msg, "overflow") && strstr (err.msg, "-9223372036854775808 / -1")
                   && strstr (err.msg, "quotient") && !strstr (err.msg, "by zero"),
                   "message: %s", err.msg);
    ck_assert_int_lt (s_fold_int_div (7, 0, &err), 0);
    ck_assert_msg (strstr (err.msg, "division by zero") && strstr (err.msg, "quotient"),
                   "message: %s", err.msg);
    ck_assert_int_ge (s_fold_int_div (INT64_MIN, 1, &err), 0);
}
END_TEST

START_TEST (test_fold_removes_dead_nodes_and_keeps_live_ones)
{
    /* y = Relu (x); an unused Transpose of x is dead code. */
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err;
    int x = s_input (g, "x", KILN_DT_FLOAT32, 2, (int64_t[]) { 2, 3 });
    int t = s_value (g, "t"), y = s_value (g, "y");
    s_node (g, "Transpose", "unused", &x, 1, t);
    s_node (g, "Relu", "relu", &x, 1, y);
    ck_assert_int_eq (kiln_graph_add_output (g, y, &err), 0);
    ck_assert_int_eq (kiln_graph_fold (g, &err), 1);
    ck_assert_int_eq (g->n_nodes, 1);
    ck_assert_int_eq (s_count_op (g, "Relu"), 1);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_fold_of_a_view_of_a_weight_shares_its_bytes)
{
    /* Unsqueeze of an initializer becomes the same weight, reshaped. */
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err;
    int x = s_input (g, "x", KILN_DT_INT64, 2, (int64_t[]) { 1, 2 });
    int w = s_const_i64 (g, "w", (int64_t[]) { 7, 9 }, 2, false);
    int ax = s_const_i64 (g, "ax", (int64_t[]) { 0 }, 1, false);
    int u = s_value (g, "u"), y = s_value (g, "y");
    s_node (g, "Unsqueeze", "unsq", (int[]) { w, ax }, 2, u);
    s_node (g, "Concat", "cat", (int[]) { x, u }, 2, y);
    ck_assert_int_eq (kiln_node_set_int (g, 1, "axis", 0, &err), 0);
    ck_assert_int_eq (kiln_graph_add_output (g, y, &err), 0);
    ck_assert_msg (kiln_graph_fold (g, &err) >= 0, "%s", err.msg);
    ck_assert_int_eq (g->tensors[u].weight, g->tensors[w].weight);
    ck_assert_int_eq (g->tensors[u].shape.rank, 2);
    ck_assert_int_eq (g->tensors[y].shape.dims[0], 2);
    kiln_graph_destroy (&g);
}
END_TEST

/* --- parameters of the shape ops -------------------------------------- */

START_TEST (test_slice_params_clamp_and_count_from_the_end)
{
    /* x [5, 6]: rows -4..INT64_MAX step 1 -> 1..5 (4 rows); columns from
     * -1 down to -INT64_MAX step -2 -> 5, 3, 1 (3 columns). */
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err;
    int x = s_input (g, "x", KILN_DT_FLOAT32, 2, (int64_t[]) { 5, 6 });
    int st = s_const_i64 (g, "st", (int64_t[]) { -4, -1 }, 2, false);
    int en = s_const_i64 (g, "en", (int64_t[]) { INT64_MAX, -INT64_MAX }, 2, false);
    int ax = s_const_i64 (g, "ax", (int64_t[]) { 0, 1 }, 2, false);
    int sp = s_const_i64 (g, "sp", (int64_t[]) { 1, -2 }, 2, false);
    int y = s_value (g, "y");
    int n = s_node (g, "Slice", "slice", (int[]) { x, st, en, ax, sp }, 5, y);
    int64_t start[2], step[2];
    kiln_shape_t out;
    ck_assert_int_eq (kiln_slice_params (g, &g->nodes[n], &g->tensors[x].shape, start, step, &out,
                                         &err), 0);
    ck_assert_int_eq (out.dims[0], 4);
    ck_assert_int_eq (out.dims[1], 3);
    ck_assert_int_eq (start[0], 1);
    ck_assert_int_eq (start[1], 5);
    ck_assert_int_eq (step[1], -2);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_convtranspose_params_follow_the_onnx_formulas)
{
    /* in 3, stride 2, kernel 3, pads 1/0, output_padding 1:
     * 2*(3-1) + 1 + 3 - 1 - 0 = 7.  With output_shape 6 (NOTSET): total
     * padding 2*2 + 1 + 3 - 6 = 2, split 1/1. */
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err;
    int x = s_input (g, "x", KILN_DT_FLOAT32, 3, (int64_t[]) { 1, 2, 3 });
    int y = s_value (g, "y");
    int n = s_node (g, "ConvTranspose", "ct", &x, 1, y);
    ck_assert_int_eq (kiln_node_set_ints (g, n, "strides", (int64_t[]) { 2 }, 1, &err), 0);
    ck_assert_int_eq (kiln_node_set_ints (g, n, "pads", (int64_t[]) { 1, 0 }, 2, &err), 0);
    ck_assert_int_eq (kiln_node_set_ints (g, n, "output_padding", (int64_t[]) { 1 }, 1, &err), 0);
    kiln_shape_t ws = { .rank = 3, .dims = { 2, 4, 3 } }, out;
    kiln_window_t w;
    int64_t opad[KILN_MAX_RANK], group;
    ck_assert_int_eq (kiln_convtr_params (&g->nodes[n], &g->tensors[x].shape, &ws, &w, opad, &group,
                                          &out, &err), 0);
    ck_assert_int_eq (out.dims[1], 4);
    ck_assert_int_eq (out.dims[2], 7);
    ck_assert_int_eq (kiln_node_set_ints (g, n, "output_shape", (int64_t[]) { 6 }, 1, &err), 0);
    ck_assert_int_eq (kiln_convtr_params (&g->nodes[n], &g->tensors[x].shape, &ws, &w, opad, &group,
                                          &out, &err), 0);
    ck_assert_int_eq (out.dims[2], 6);
    ck_assert_int_eq (w.pads[0], 1);
    ck_assert_int_eq (w.pads[1], 1);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_einsum_refuses_what_is_not_a_matrix_product)
{
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err;
    int x = s_input (g, "x", KILN_DT_FLOAT32, 2, (int64_t[]) { 3, 3 });
    int y = s_value (g, "y");
    int n = s_node (g, "Einsum", "e", &x, 1, y);
    const kiln_shape_t *ins[1] = { &g->tensors[x].shape };
    kiln_einsum_t e;
    kiln_shape_t out;
    static const struct { const char *eq; const char *why; } bad[] = {
        { "ii->i", "diagonal" }, { "ij->i", "sums over label 'j'" }, { "...i->i", "ellipsis" },
        { "ij,jk->ik", "more terms" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ck_assert_int_eq (kiln_node_set_string (g, n, "equation", bad[i].eq, &err), 0);
        ck_assert_int_ne (kiln_einsum_params (&g->nodes[n], ins, 1, &e, &out, &err), 0);
        ck_assert_msg (strstr (err.msg, bad[i].why), "%s: %s", bad[i].eq, err.msg);
    }
    ck_assert_int_eq (kiln_node_set_string (g, n, "equation", "ij->ji", &err), 0);
    ck_assert_int_eq (kiln_einsum_params (&g->nodes[n], ins, 1, &e, &out, &err), 0);
    ck_assert_str_eq (e.out, "ji");
    kiln_graph_destroy (&g);
}
END_TEST

/* --- runtime kernels ------------------------------------------------ */

/* A program with X of `xn` float32 elements and Y of `yn`, and one op of
 * kernel k from X to Y. */
static kiln_program_t *
s_prog (kiln_kernel_t k, int64_t xn, int64_t yn)
{
    kiln_err_t err;
    kiln_program_t *p = kiln_program_new ();
    kiln_shape_t xs = { .rank = 1, .dims = { xn } }, ys = { .rank = 1, .dims = { yn } };
    int x = kiln_program_add_tensor (p, KILN_DT_FLOAT32, &xs, KILN_TK_INPUT, &err);
    int y = kiln_program_add_tensor (p, KILN_DT_FLOAT32, &ys, KILN_TK_OUTPUT, &err);
    ck_assert_int_ge (kiln_program_add_op (p, k, &x, 1, &y, 1, &err), 0);
    return p;
}

START_TEST (test_strided_kernel_refuses_reads_outside_its_input)
{
    kiln_err_t err;
    kiln_kplan_t plan;
    /* 4 elements at stride 3 from offset 0 reach element 9 of a 10: fine;
     * from offset 1 they reach 10, one past the end. */
    for (int off = 0; off < 2; off++) {
        kiln_program_t *p = s_prog (KILN_K_STRIDED, 10, 4);
        kiln_prog_op_t *op = &p->ops[0];
        ck_assert_int_eq (kiln_prog_op_set_ints (op, "dims", (int64_t[]) { 4 }, 1, &err), 0);
        ck_assert_int_eq (kiln_prog_op_set_ints (op, "strides", (int64_t[]) { 3 }, 1, &err), 0);
        ck_assert_int_eq (kiln_prog_op_set_int (op, "offset", off, &err), 0);
        int rc = kiln_kernel_prepare (p, 0, &plan, &err);
        if (off == 0)
            ck_assert_msg (rc == 0, "%s", err.msg);
        else {
            ck_assert_int_ne (rc, 0);
            ck_assert_msg (strstr (err.msg, "strided") && strstr (err.msg, "10"), "%s", err.msg);
        }
        kiln_program_destroy (&p);
    }
    /* A negative stride must not reach below element 0 either. */
    kiln_program_t *p = s_prog (KILN_K_STRIDED, 10, 4);
    kiln_prog_op_t *op = &p->ops[0];
    ck_assert_int_eq (kiln_prog_op_set_ints (op, "dims", (int64_t[]) { 4 }, 1, &err), 0);
    ck_assert_int_eq (kiln_prog_op_set_ints (op, "strides", (int64_t[]) { -3 }, 1, &err), 0);
    ck_assert_int_eq (kiln_prog_op_set_int (op, "offset", 8, &err), 0);
    ck_assert_int_ne (kiln_kernel_prepare (p, 0, &plan, &err), 0);
    kiln_program_destroy (&p);
}
END_TEST

START_TEST (test_strided_kernel_reverses_and_strides)
{
    kiln_err_t err;
    kiln_kplan_t plan;
    kiln_program_t *p = s_prog (KILN_K_STRIDED, 6, 4);
    kiln_prog_op_t *op = &p->ops[0];
    /* Y[i][j] = X[5 - 3 i - j] for i < 2, j < 2: [5, 4, 2, 1]. */
    ck_assert_int_eq (kiln_prog_op_set_ints (op, "dims", (int64_t[]) { 2, 2 }, 2, &err), 0);
    ck_assert_int_eq (kiln_prog_op_set_ints (op, "strides", (int64_t[]) { -3, -1 }, 2, &err), 0);
    ck_assert_int_eq (kiln_prog_op_set_int (op, "offset", 5, &err), 0);
    ck_assert_msg (kiln_kernel_prepare (p, 0, &plan, &err) == 0, "%s", err.msg);
    float x[6] = { 0, 1, 2, 3, 4, 5 }, y[4] = { 0 };
    void *data[2] = { x, y };
    kiln_kernel_run (&plan, data);
    ck_assert (y[0] == 5 && y[1] == 4 && y[2] == 2 && y[3] == 1);
    kiln_program_destroy (&p);
}
END_TEST

START_TEST (test_pad_and_resize_kernels_refuse_inconsistent_shapes)
{
    kiln_err_t err;
    kiln_kplan_t plan;
    /* pad: 1 + 3 + 1 is 5, not the output's 6. */
    kiln_program_t *p = s_prog (KILN_K_PAD, 3, 6);
    kiln_prog_op_t *op = &p->ops[0];
    ck_assert_int_eq (kiln_prog_op_set_ints (op, "pads", (int64_t[]) { 1, 1 }, 2, &err), 0);
    ck_assert_int_eq (kiln_prog_op_set_int (op, "mode", 1, &err), 0);
    ck_assert_int_eq (kiln_prog_op_set_float (op, "value", 0.0, &err), 0);
    ck_assert_int_ne (kiln_kernel_prepare (p, 0, &plan, &err), 0);
    ck_assert_msg (strstr (err.msg, "pad") != NULL, "%s", err.msg);
    kiln_program_destroy (&p);
    /* resize: an empty input cannot be resized to 4 elements. */
    p = s_prog (KILN_K_RESIZE, 0, 4);
    op = &p->ops[0];
    ck_assert_int_eq (kiln_prog_op_set_int (op, "mode", 1, &err), 0);
    ck_assert_int_eq (kiln_prog_op_set_int (op, "coord", 0, &err), 0);
    ck_assert_int_eq (kiln_prog_op_set_int (op, "nearest", 0, &err), 0);
    ck_assert_int_eq (kiln_prog_op_set_ints (op, "scales", (int64_t[]) { 0 }, 1, &err), 0);
    ck_assert_int_ne (kiln_kernel_prepare (p, 0, &plan, &err), 0);
    ck_assert_msg (strstr (err.msg, "empty") != NULL, "%s", err.msg);
    kiln_program_destroy (&p);
}
END_TEST

/* --- the budget ------------------------------------------------------ */

/* A float32 scalar constant. */
static int
s_const_f32 (kiln_graph_t *g, const char *name, float v)
{
    kiln_err_t err;
    kiln_shape_t s = { .rank = 0 };
    int t = kiln_graph_add_tensor (g, name, KILN_DT_FLOAT32, &s, &err);
    ck_assert_msg (t >= 0, "%s", err.msg);
    uint8_t *data = malloc (5);
    memcpy (data, &v, 4);
    ck_assert_msg (kiln_graph_set_weight (g, t, &data, 4, &err) == 0, "%s", err.msg);
    return t;
}

/* The hostile chain of issue 14: c = ConstantOfShape ([2^20]) of float32
 * (4 MiB), then a_k = a_(k-1) + 1 for k = 1..n, each 4 MiB more if
 * folded; returns a_n.  `x` is a graph input of the same shape. */
static int
s_fill_and_add_chain (kiln_graph_t *g, int n, int *x)
{
    kiln_err_t err;
    char name[32];
    *x = s_input (g, "x", KILN_DT_FLOAT32, 1, (int64_t[]) { 1 << 20 });
    int dims = s_const_i64 (g, "dims", (int64_t[]) { 1 << 20 }, 1, false);
    int one = s_const_f32 (g, "one", 1.0f);
    int cur = s_value (g, "c");
    int cs = s_node (g, "ConstantOfShape", "fill", &dims, 1, cur);
    ck_assert_int_eq (kiln_node_set_int (g, cs, "value_dtype", KILN_DT_FLOAT32, &err), 0);
    for (int k = 1; k <= n; k++) {
        snprintf (name, sizeof name, "a%d", k);
        int next = s_value (g, name);
        snprintf (name, sizeof name, "add%d", k);
        s_node (g, "Add", name, (int[]) { cur, one }, 2, next);
        cur = next;
    }
    return cur;
}

static uint64_t
s_weight_bytes (const kiln_graph_t *g)
{
    uint64_t sum = 0;
    for (int w = 0; w < g->n_weights; w++)
        sum += g->weights[w].size;
    return sum;
}

START_TEST (test_fold_stops_at_its_budget_and_leaves_the_rest_to_run)
{
    /* 100 Adds of 4 MiB would materialise 400 MiB: past the budget they
     * stay in the graph as nodes, and shape arithmetic after them (a
     * Shape of the last one, feeding a Reshape) still folds. */
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err;
    int x, n = 100;
    int last = s_fill_and_add_chain (g, n, &x);
    int sum = s_value (g, "sum"), shape = s_value (g, "shape"), y = s_value (g, "y");
    s_node (g, "Add", "use", (int[]) { x, last }, 2, sum);
    s_node (g, "Shape", "shape_of_last", &last, 1, shape);
    s_node (g, "Reshape", "reshape", (int[]) { sum, shape }, 2, y);
    ck_assert_int_eq (kiln_graph_add_output (g, y, &err), 0);
    int removed = kiln_graph_fold (g, &err);
    ck_assert_msg (removed > 0, "fold failed: %s", err.msg);
    int adds = s_count_op (g, "Add");
    /* Some folded (the budget holds about 60 of them), not all. */
    ck_assert_msg (adds > 1 && adds < n + 1, "%d Adds left of %d", adds, n + 1);
    ck_assert_int_eq (s_count_op (g, "ConstantOfShape"), 0);
    ck_assert_int_eq (s_count_op (g, "Shape"), 0);
    ck_assert_int_eq (s_count_op (g, "Reshape"), 1);
    ck_assert_uint_le (s_weight_bytes (g), (uint64_t) KILN_MAX_FOLD_BYTES);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_fold_refuses_a_compile_time_op_past_its_budget_naming_node_and_budget)
{
    /* After the chain has used the budget, a ConstantOfShape (which only
     * folding can evaluate) of 4 MiB more cannot be left to run. */
    kiln_graph_t *g = kiln_graph_new ();
    kiln_err_t err;
    int x;
    int last = s_fill_and_add_chain (g, 80, &x);
    int shape = s_value (g, "shape"), late = s_value (g, "late"), y = s_value (g, "y");
    s_node (g, "Shape", "shape_of_last", &last, 1, shape);
    int cs = s_node (g, "ConstantOfShape", "late_fill", &shape, 1, late);
    ck_assert_int_eq (kiln_node_set_int (g, cs, "value_dtype", KILN_DT_FLOAT32, &err), 0);
    s_node (g, "Add", "use", (int[]) { x, late }, 2, y);
    ck_assert_int_eq (kiln_graph_add_output (g, y, &err), 0);
    ck_assert_int_lt (kiln_graph_fold (g, &err), 0);
    ck_assert_int_eq (err.code, KILN_ELIMIT);
    ck_assert_msg (strstr (err.msg, "late_fill") && strstr (err.msg, "KILN_MAX_FOLD_BYTES")
                   && strstr (err.msg, "256 MiB"), "message: %s", err.msg);
    kiln_graph_destroy (&g);
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("fold");
    TCase *tc = tcase_create ("fold");
    tcase_add_test (tc, test_fold_turns_a_shape_computation_into_a_reshape_constant);
    tcase_add_test (tc, test_fold_drops_the_constants_it_made_but_keeps_initializers);
    tcase_add_test (tc, test_fold_evaluates_range_constant_of_shape_and_where);
    tcase_add_test (tc, test_fold_refuses_range_of_a_graph_input_naming_node_and_input);
    tcase_add_test (tc, test_fold_refuses_a_constant_larger_than_the_limit);
    tcase_add_test (tc, test_fold_removes_dead_nodes_and_keeps_live_ones);
    tcase_add_test (tc, test_fold_tells_int64_overflow_from_division_by_zero);
    tcase_add_test (tc, test_fold_of_a_view_of_a_weight_shares_its_bytes);
    tcase_add_test (tc, test_slice_params_clamp_and_count_from_the_end);
    tcase_add_test (tc, test_convtranspose_params_follow_the_onnx_formulas);
    tcase_add_test (tc, test_einsum_refuses_what_is_not_a_matrix_product);
    tcase_add_test (tc, test_strided_kernel_refuses_reads_outside_its_input);
    tcase_add_test (tc, test_strided_kernel_reverses_and_strides);
    tcase_add_test (tc, test_pad_and_resize_kernels_refuse_inconsistent_shapes);
    suite_add_tcase (s, tc);
    /* These fold a few hundred MiB to reach the budget: seconds, more on a
     * loaded machine. */
    TCase *budget = tcase_create ("budget");
    tcase_set_timeout (budget, 120);
    tcase_add_test (budget, test_fold_stops_at_its_budget_and_leaves_the_rest_to_run);
    tcase_add_test (budget,
        test_fold_refuses_a_compile_time_op_past_its_budget_naming_node_and_budget);
    suite_add_tcase (s, budget);
    return s;
}

int
main (void)
{
    return testlib_run (s_suite ());
}
