/*
 * Unit tests for compiler/: argument parsing, the target, the manifest a
 * compilation fills in, determinism of the emitted bytes, refusals of
 * what the builtin compiler cannot lower, weight packing, and the memory
 * planner (it saves memory, and no two tensors that are live at the same
 * time share a byte — checked independently from the emitted program).
 */
#include <check.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>

#include "common/kiln_program.h"
#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"
#include "tests/unit/testlib.h"

/* --- helpers -------------------------------------------------------- */

/* A float32 constant whose bytes depend on `salt`. */
static int
s_weight (kiln_graph_t *g, const char *name, kiln_shape_t shape, unsigned salt)
{
    kiln_err_t err;
    int t = kiln_graph_add_tensor (g, name, KILN_DT_FLOAT32, &shape, &err);
    ck_assert (t >= 0);
    int64_t n = testlib_numel (&shape);
    float *v = malloc ((size_t) (n ? n : 1) * sizeof *v);
    for (int64_t i = 0; i < n; i++)
        v[i] = (float) ((i * 31 + salt * 7) % 17) / 8.0f - 1.0f;
    uint8_t *data = (uint8_t *) v;
    ck_assert_msg (kiln_graph_set_weight (g, t, &data, (uint64_t) n * 4, &err) == 0,
                   "%s", err.msg);
    return t;
}

/* A residual block: x -> conv -> relu -> conv -> add(x) -> relu -> gap ->
 * flatten -> gemm.  `salt` varies the weights. */
static kiln_graph_t *
s_resnetish (unsigned salt)
{
    kiln_err_t err;
    kiln_graph_t *g = kiln_graph_new ();
    int x = testlib_input_dt (g, "x", KILN_DT_FLOAT32, SH (1, 8, 12, 12));
    int w1 = s_weight (g, "w1", SH (8, 8, 3, 3), salt);
    int w2 = s_weight (g, "w2", SH (8, 8, 3, 3), salt + 1);
    int wl = s_weight (g, "wl", SH (4, 8), salt + 2);
    int t[8];
    testlib_tensors (g, t, 8);
    int y = testlib_tensor (g, "y");
    int64_t pads[4] = { 1, 1, 1, 1 };
    int n = testlib_node (g, "Conv", "c1", (int[]) { x, w1 }, 2, t[0]);
    ck_assert (kiln_node_set_ints (g, n, "pads", pads, 4, &err) == 0);
    testlib_node (g, "Relu", "r1", &t[0], 1, t[1]);
    n = testlib_node (g, "Conv", "c2", (int[]) { t[1], w2 }, 2, t[2]);
    ck_assert (kiln_node_set_ints (g, n, "pads", pads, 4, &err) == 0);
    testlib_node (g, "Add", "add", (int[]) { t[2], x }, 2, t[3]);
    testlib_node (g, "Relu", "r2", &t[3], 1, t[4]);
    testlib_node (g, "GlobalAveragePool", "gap", &t[4], 1, t[5]);
    testlib_node (g, "Flatten", "flat", &t[5], 1, t[6]);
    n = testlib_node (g, "Gemm", "fc", (int[]) { t[6], wl }, 2, y);
    ck_assert (kiln_node_set_int (g, n, "transB", 1, &err) == 0);
    testlib_output (g, y);
    return g;
}

/* --- arguments and target ------------------------------------------- */

START_TEST (test_parse_args_defaults_and_accepts_optlevel)
{
    kiln_cc_options_t o;
    kiln_err_t err = { 0 };
    struct { const char *args; int want; } cases[] = {
        { NULL, 2 }, { "", 2 }, { "--optlevel 1", 1 }, { "--optlevel=3", 3 },
        { "  --optlevel\t0  ", 0 }, { "--optlevel 1 --optlevel 2", 2 },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ck_assert_msg (kiln_cc_parse_args (cases[i].args, &o, &err) == 0, "%s", err.msg);
        ck_assert_int_eq (o.optlevel, cases[i].want);
    }
}
END_TEST

START_TEST (test_parse_args_refuses_unknown_flags_and_bad_values_naming_them)
{
    kiln_cc_options_t o;
    struct { const char *args; const char *want; } cases[] = {
        { "--fast", "unknown compiler argument '--fast'" },
        { "--optlevel 1 --bogus=2", "'--bogus=2'" },
        { "--optlevel 4", "bad value '4' for --optlevel" },
        { "--optlevel -1", "bad value '-1'" },
        { "--optlevel x", "bad value 'x'" },
        { "--optlevel=", "bad value ''" },
        { "--optlevel", "--optlevel needs a value" },
        { "-O2", "'-O2'" },
        { "--optlevels 2", "'--optlevels'" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_err_t err = { 0 };
        ck_assert_int_eq (kiln_cc_parse_args (cases[i].args, &o, &err), -KILN_EINVAL);
        ck_assert_msg (strstr (err.msg, cases[i].want), "'%s': '%s' lacks '%s'",
                       cases[i].args, err.msg, cases[i].want);
    }
    char *longargs = malloc (KILN_MAX_ARGS_BYTES + 10);
    memset (longargs, ' ', KILN_MAX_ARGS_BYTES + 9);
    longargs[KILN_MAX_ARGS_BYTES + 9] = '\0';
    kiln_err_t err = { 0 };
    ck_assert_int_eq (kiln_cc_parse_args (longargs, &o, &err), -KILN_ELIMIT);
    free (longargs);
}
END_TEST

START_TEST (test_target_is_cpu_and_the_machine)
{
    struct utsname u;
    ck_assert (uname (&u) == 0);
    char want[128];
    snprintf (want, sizeof want, "cpu-%s", u.machine);
    ck_assert_str_eq (kiln_cc_target (), want);
}
END_TEST

/* --- compilation ---------------------------------------------------- */

START_TEST (test_compile_fills_the_manifest)
{
    kiln_graph_t *g = s_resnetish (1);
    kiln_err_t err = { 0 };
    kiln_cc_stats_t st = { 0 };
    kiln_artifact_t *art = kiln_cc_compile_ex (g, "  --optlevel\t1 ", &st, &err);
    ck_assert_msg (art, "%s", err.msg);
    const kiln_manifest_t *m = kiln_artifact_manifest (art);
    char digest[KILN_HEX_LEN], key[KILN_HEX_LEN];
    ck_assert (kiln_graph_digest (g, digest, &err) == 0);
    ck_assert_str_eq (m->graph_digest, digest);
    ck_assert_str_eq (m->compiler_args, "--optlevel 1");
    kiln_action_key (digest, "--optlevel 1", KILN_COMPILER_ID, KILN_COMPILER_VERSION,
                     kiln_cc_target (), key);
    ck_assert_str_eq (m->action_key, key);
    ck_assert_str_eq (m->compiler_id, KILN_COMPILER_ID);
    ck_assert_str_eq (m->compiler_version, KILN_COMPILER_VERSION);
    ck_assert_str_eq (m->target, kiln_cc_target ());
    ck_assert_int_eq (m->runtime_abi, KILN_RUNTIME_ABI_VERSION);
    ck_assert_int_eq (m->n_inputs, 1);
    ck_assert_int_eq (m->n_outputs, 1);
    ck_assert_str_eq (m->inputs[0].name, "x");
    ck_assert_int_eq (m->inputs[0].dtype, KILN_DT_FLOAT32);
    kiln_shape_t xs = SH (1, 8, 12, 12), ys = SH (1, 4);
    ck_assert (kiln_shape_equal (&m->inputs[0].shape, &xs));
    ck_assert_str_eq (m->outputs[0].name, "y");
    ck_assert (kiln_shape_equal (&m->outputs[0].shape, &ys));
    ck_assert_int_eq (kiln_artifact_member_count (art), 2);

    kiln_program_t *p = testlib_program_of (art);
    ck_assert_uint_eq (p->arena_size, st.arena_bytes);
    ck_assert_int_eq (p->n_ops, st.n_ops);
    ck_assert_int_eq (p->n_ops, 7);            /* Flatten is an alias at -O1 */
    kiln_program_destroy (&p);
    kiln_artifact_destroy (&art);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_compile_is_deterministic)
{
    kiln_err_t err = { 0 };
    /* The same graph twice, and an identical graph built separately. */
    kiln_graph_t *g1 = s_resnetish (3), *g2 = s_resnetish (3);
    kiln_artifact_t *a = kiln_cc_compile (g1, "--optlevel 2", &err);
    kiln_artifact_t *b = kiln_cc_compile (g1, "--optlevel 2", &err);
    kiln_artifact_t *c = kiln_cc_compile (g2, "--optlevel 2", &err);
    ck_assert_msg (a && b && c, "%s", err.msg);
    char da[KILN_HEX_LEN], db[KILN_HEX_LEN], dc[KILN_HEX_LEN];
    ck_assert (kiln_artifact_digest (a, da, &err) == 0);
    ck_assert (kiln_artifact_digest (b, db, &err) == 0);
    ck_assert (kiln_artifact_digest (c, dc, &err) == 0);
    ck_assert_str_eq (da, db);
    ck_assert_str_eq (da, dc);
    const char *members[] = { KILN_PROGRAM_MEMBER, KILN_WEIGHTS_MEMBER };
    for (int i = 0; i < 2; i++) {
        size_t la, lc;
        const uint8_t *ma = kiln_artifact_member (a, members[i], &la);
        const uint8_t *mc = kiln_artifact_member (c, members[i], &lc);
        ck_assert (la == lc && memcmp (ma, mc, la) == 0);
    }
    uint8_t *wa, *wc;
    size_t lwa, lwc;
    ck_assert (kiln_artifact_write_mem (a, &wa, &lwa, &err) == 0);
    ck_assert (kiln_artifact_write_mem (c, &wc, &lwc, &err) == 0);
    ck_assert (lwa == lwc && memcmp (wa, wc, lwa) == 0);
    free (wa);
    free (wc);

    /* Different weights or different arguments: a different artifact and
     * a different action key. */
    kiln_graph_t *g3 = s_resnetish (4);
    kiln_artifact_t *d = kiln_cc_compile (g3, "--optlevel 2", &err);
    kiln_artifact_t *e = kiln_cc_compile (g1, "--optlevel 1", &err);
    ck_assert (d && e);
    char dd[KILN_HEX_LEN], de[KILN_HEX_LEN];
    ck_assert (kiln_artifact_digest (d, dd, &err) == 0);
    ck_assert (kiln_artifact_digest (e, de, &err) == 0);
    ck_assert_str_ne (da, dd);
    ck_assert_str_ne (da, de);
    ck_assert_str_ne (kiln_artifact_manifest (a)->action_key,
                      kiln_artifact_manifest (e)->action_key);
    kiln_artifact_destroy (&a);
    kiln_artifact_destroy (&b);
    kiln_artifact_destroy (&c);
    kiln_artifact_destroy (&d);
    kiln_artifact_destroy (&e);
    kiln_graph_destroy (&g1);
    kiln_graph_destroy (&g2);
    kiln_graph_destroy (&g3);
}
END_TEST

START_TEST (test_compile_copies_the_io_structure_into_the_manifest)
{
    kiln_err_t err = { 0 };
    const char *text = "{\"kind\":\"tuple\",\"items\":[{\"tensor\":0}]}";
    kiln_graph_t *plain = s_resnetish (5), *g = s_resnetish (5);
    ck_assert (kiln_graph_set_io_structure (g, text, &err) == 0);
    kiln_artifact_t *a = kiln_cc_compile (plain, NULL, &err);
    kiln_artifact_t *b = kiln_cc_compile (g, NULL, &err);
    ck_assert_msg (a && b, "%s", err.msg);
    const kiln_manifest_t *ma = kiln_artifact_manifest (a);
    const kiln_manifest_t *mb = kiln_artifact_manifest (b);
    ck_assert_ptr_null (ma->io_structure);
    ck_assert_ptr_nonnull (mb->io_structure);
    ck_assert_str_eq (mb->io_structure, text);
    /* The structure is part of the graph's interface: another digest,
     * another action, the same program. */
    ck_assert_str_ne (ma->graph_digest, mb->graph_digest);
    ck_assert_str_ne (ma->action_key, mb->action_key);
    size_t la, lb;
    const uint8_t *pa = kiln_artifact_member (a, KILN_PROGRAM_MEMBER, &la);
    const uint8_t *pb = kiln_artifact_member (b, KILN_PROGRAM_MEMBER, &lb);
    ck_assert (la == lb && memcmp (pa, pb, la) == 0);
    char *json;
    size_t len;
    ck_assert (kiln_artifact_manifest_json (a, &json, &len, &err) == 0);
    ck_assert_ptr_null (strstr (json, "io_structure"));
    free (json);

    /* Written and read back by the strict reader. */
    uint8_t *kar;
    ck_assert_msg (kiln_artifact_write_mem (b, &kar, &len, &err) == 0, "%s", err.msg);
    kiln_artifact_t *r = kiln_artifact_read_mem (kar, len, &err);
    ck_assert_msg (r, "%s", err.msg);
    ck_assert_str_eq (kiln_artifact_manifest (r)->io_structure, text);
    kiln_artifact_destroy (&r);
    free (kar);
    kiln_artifact_destroy (&a);
    kiln_artifact_destroy (&b);
    kiln_graph_destroy (&plain);
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_compile_refuses_unsupported_ops_naming_node_and_op)
{
    const char *ops[] = { "NonMaxSuppression", "NonZero", "FancyCustomOp" };
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        kiln_graph_t *g = kiln_graph_new ();
        int x = testlib_input_dt (g, "x", KILN_DT_FLOAT32, SH (2, 3));
        int r = testlib_tensor (g, "r"), y = testlib_tensor (g, "y");
        testlib_node (g, "Relu", "fine", &x, 1, r);
        testlib_node (g, ops[i], "the_node", &r, 1, y);
        testlib_output (g, y);
        kiln_err_t err = { 0 };
        ck_assert (kiln_cc_compile (g, NULL, &err) == NULL);
        ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
        ck_assert_msg (strstr (err.msg, "'the_node'") && strstr (err.msg, ops[i]),
                       "%s", err.msg);
        kiln_graph_destroy (&g);
    }
}
END_TEST

START_TEST (test_compile_refuses_what_the_kernels_cannot_run)
{
    kiln_err_t err = { 0 };
    /* MaxPool's Indices: no kernel computes them. */
    kiln_graph_t *g = kiln_graph_new ();
    int a = testlib_input_dt (g, "a", KILN_DT_FLOAT32, SH (1, 1, 4, 4));
    int y = testlib_tensor (g, "y"), ind = testlib_tensor (g, "ind");
    int n = kiln_graph_add_node (g, "MaxPool", "pool", &a, 1, (int[]) { y, ind }, 2,
                                 &err);
    ck_assert_msg (n >= 0, "%s", err.msg);
    testlib_ints (g, n, "kernel_shape", 2, 2, 2);
    testlib_output (g, y);
    testlib_output (g, ind);
    ck_assert (kiln_cc_compile (g, NULL, &err) == NULL);
    ck_assert_int_eq (err.code, KILN_EUNSUPPORTED);
    ck_assert_msg (strstr (err.msg, "'pool'") && strstr (err.msg, "Indices"), "%s", err.msg);
    kiln_graph_destroy (&g);

    /* 4-D convolution (1-D to 3-D are kiln's). */
    g = kiln_graph_new ();
    int x = testlib_input_dt (g, "x", KILN_DT_FLOAT32, SH (1, 2, 4, 4, 4, 4));
    int w = s_weight (g, "w", SH (3, 2, 1, 1, 1, 1), 0);
    y = testlib_tensor (g, "y");
    testlib_node (g, "Conv", "conv4d", (int[]) { x, w }, 2, y);
    testlib_output (g, y);
    ck_assert (kiln_cc_compile (g, NULL, &err) == NULL);
    ck_assert_msg (err.code == KILN_EUNSUPPORTED || err.code == KILN_ESHAPE
                   || err.code == KILN_EFORMAT, "%d %s", err.code, err.msg);
    ck_assert_msg (strstr (err.msg, "conv4d"), "%s", err.msg);
    kiln_graph_destroy (&g);

    /* Bad compiler arguments fail before any work. */
    g = s_resnetish (0);
    ck_assert (kiln_cc_compile (g, "--optlevel 9", &err) == NULL);
    ck_assert (strstr (err.msg, "--optlevel"));
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_weights_are_aligned_deduplicated_and_exact)
{
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_graph_new ();
    int x = testlib_input_dt (g, "x", KILN_DT_FLOAT32, SH (3, 5));
    int w1 = s_weight (g, "w1", SH (5), 9);
    int w2 = s_weight (g, "w2", SH (5), 9);      /* same bytes as w1 */
    int w3 = s_weight (g, "w3", SH (3, 1), 2);
    int t0 = testlib_tensor (g, "t0"), t1 = testlib_tensor (g, "t1"), y = testlib_tensor (g, "y");
    testlib_node (g, "Add", "a", (int[]) { x, w1 }, 2, t0);
    testlib_node (g, "Mul", "m", (int[]) { t0, w2 }, 2, t1);
    testlib_node (g, "Sub", "s", (int[]) { t1, w3 }, 2, y);
    testlib_output (g, y);
    kiln_artifact_t *art = kiln_cc_compile (g, NULL, &err);
    ck_assert_msg (art, "%s", err.msg);
    size_t wlen;
    const uint8_t *wb = kiln_artifact_member (art, KILN_WEIGHTS_MEMBER, &wlen);
    kiln_program_t *p = testlib_program_of (art);
    ck_assert_uint_eq (wlen, 128);               /* two blobs, 64 bytes each */
    int64_t offs[3] = { -1, -1, -1 };
    int gts[3] = { w1, w2, w3 }, k = 0;
    for (int t = 0; t < p->n_tensors; t++) {
        const kiln_prog_tensor_t *pt = &p->tensors[t];
        if (pt->kind != KILN_TK_WEIGHT)
            continue;
        ck_assert_uint_eq (pt->offset % 64, 0);
        const kiln_weight_t *gw = &g->weights[g->tensors[gts[k]].weight];
        ck_assert (memcmp (wb + pt->offset, gw->data, gw->size) == 0);
        offs[k++] = (int64_t) pt->offset;
    }
    ck_assert_int_eq (k, 3);
    ck_assert_int_eq (offs[0], offs[1]);
    ck_assert_int_ne (offs[0], offs[2]);
    /* Padding is zero, so the bytes depend on nothing else. */
    for (size_t i = 20; i < 64; i++)
        ck_assert_int_eq (wb[i], 0);
    kiln_program_destroy (&p);
    kiln_artifact_destroy (&art);
    kiln_graph_destroy (&g);
}
END_TEST

/* --- the planner ---------------------------------------------------- */

/* Tensor b lies wholly inside tensor a's bytes. */
static bool
s_inside (const kiln_prog_tensor_t *a, const kiln_prog_tensor_t *b)
{
    return a->offset <= b->offset && b->offset + b->size <= a->offset + a->size;
}

/* From the program alone: no two arena tensors whose lifetimes overlap
 * share a byte (aliases, which have the same offset and size and are
 * views of one another, are the exception the compiler makes on purpose:
 * they are recognised by identical offset and size).  A tensor no op
 * writes (the output of a Concat done in place) holds the tensors that
 * lie inside it: it lives from the first write of any of them, and they
 * may share its bytes. */
static void
s_assert_plan_is_safe (const kiln_program_t *p)
{
    int n = p->n_tensors;
    int *def = malloc ((size_t) n * sizeof *def), *last = malloc ((size_t) n * sizeof *last);
    for (int t = 0; t < n; t++) {
        def[t] = p->tensors[t].kind == KILN_TK_INPUT ? -1 : INT32_MAX;
        last[t] = p->tensors[t].kind == KILN_TK_INPUT ? -1 : INT32_MIN;
    }
    for (int i = 0; i < p->n_ops; i++) {
        const kiln_prog_op_t *op = &p->ops[i];
        for (int j = 0; j < op->n_inputs; j++)
            if (last[op->inputs[j]] < i)
                last[op->inputs[j]] = i;
        int w[2] = { op->outputs[0], op->scratch };
        for (int j = 0; j < 2; j++) {
            if (w[j] < 0)
                continue;
            if (def[w[j]] > i)
                def[w[j]] = i;
            if (last[w[j]] < i)
                last[w[j]] = i;
        }
    }
    for (int i = 0; i < p->n_outputs; i++)
        last[p->outputs[i]] = INT32_MAX;
    bool *unwritten = calloc ((size_t) n + 1, sizeof *unwritten);
    for (int a = 0; a < n; a++)
        if (p->tensors[a].kind != KILN_TK_WEIGHT && p->tensors[a].kind != KILN_TK_INPUT
            && def[a] == INT32_MAX) {
            unwritten[a] = true;
            for (int b = 0; b < n; b++)
                if (b != a && p->tensors[b].kind != KILN_TK_WEIGHT && def[b] != INT32_MAX
                    && s_inside (&p->tensors[a], &p->tensors[b]) && def[b] < def[a])
                    def[a] = def[b];
        }
    for (int a = 0; a < n; a++)
        for (int b = a + 1; b < n; b++) {
            const kiln_prog_tensor_t *ta = &p->tensors[a], *tb = &p->tensors[b];
            if (ta->kind == KILN_TK_WEIGHT || tb->kind == KILN_TK_WEIGHT
                || ta->size == 0 || tb->size == 0 || def[a] > last[a]
                || def[b] > last[b])
                continue;
            if (ta->offset == tb->offset && ta->size == tb->size)
                continue;       /* a view */
            if ((unwritten[a] && s_inside (ta, tb)) || (unwritten[b] && s_inside (tb, ta)))
                continue;       /* a part of an in-place Concat */
            bool bytes = ta->offset < tb->offset + tb->size
                         && tb->offset < ta->offset + ta->size;
            bool time = def[a] <= last[b] && def[b] <= last[a];
            ck_assert_msg (!(bytes && time), "tensors %d and %d overlap in "
                           "memory and in time", a, b);
        }
    free (unwritten);
    free (def);
    free (last);
}

/* Graph g compiled at --optlevel opt (*st gets the stats): its program,
 * which s_assert_plan_is_safe has checked; the caller destroys it. */
static kiln_program_t *
s_safe_program (kiln_graph_t *g, int opt, kiln_cc_stats_t *st)
{
    kiln_err_t err = { 0 };
    char args[32];
    snprintf (args, sizeof args, "--optlevel %d", opt);
    kiln_artifact_t *art = kiln_cc_compile_ex (g, args, st, &err);
    ck_assert_msg (art, "%s", err.msg);
    kiln_program_t *p = testlib_program_of (art);
    kiln_artifact_destroy (&art);
    s_assert_plan_is_safe (p);
    return p;
}

START_TEST (test_planner_reuses_memory_on_a_chain)
{
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_graph_new ();
    int prev = testlib_input_dt (g, "x", KILN_DT_FLOAT32, SH (1, 1024));
    const int n = 10;
    for (int i = 0; i < n; i++) {
        char name[16];
        snprintf (name, sizeof name, "r%d", i);
        int t = testlib_tensor (g, name);
        testlib_node (g, "Relu", name, &prev, 1, t);
        prev = t;
    }
    testlib_output (g, prev);
    for (int opt = 0; opt <= 3; opt++) {
        char args[32];
        snprintf (args, sizeof args, "--optlevel %d", opt);
        kiln_cc_stats_t st;
        kiln_artifact_t *art = kiln_cc_compile_ex (g, args, &st, &err);
        ck_assert_msg (art, "%s", err.msg);
        ck_assert_uint_eq (st.naive_bytes, (n + 1) * 4096);
        /* Two buffers suffice for a chain: each step reads one, writes the
         * other; at -O0 nothing is shared. */
        ck_assert_uint_eq (st.arena_bytes, opt == 0 ? (n + 1) * 4096 : 2 * 4096);
        kiln_program_t *p = testlib_program_of (art);
        s_assert_plan_is_safe (p);
        kiln_program_destroy (&p);
        kiln_artifact_destroy (&art);
    }
    kiln_graph_destroy (&g);
}
END_TEST

/* densenet's nesting on vectors: c1 = cat(r0, r1), c2 = cat(r0, r1, r2)
 * with r2 computed from c1, temporaries between that the planner may
 * place anywhere not live, and c1 read again after c2's last reader (its
 * buffer must live on).  From -O1 both concatenations are free (no
 * concat op) and the plan is still safe; at -O0 they are copies. */
START_TEST (test_planner_is_safe_with_nested_concats_in_place)
{
    kiln_graph_t *g = kiln_graph_new ();
    int x = testlib_input_dt (g, "x", KILN_DT_FLOAT32, SH (1, 16));
    int t[11];
    testlib_tensors (g, t, 11);
    testlib_node (g, "Relu", "r0", &x, 1, t[0]);
    testlib_node (g, "Sigmoid", "r1", &t[0], 1, t[1]);
    int n = testlib_node (g, "Concat", "c1", t, 2, t[2]);
    testlib_int (g, n, "axis", 1);
    testlib_node (g, "Tanh", "a", &t[2], 1, t[3]);
    testlib_node (g, "Relu", "r2", &t[3], 1, t[4]);
    int ins[3] = { t[0], t[1], t[4] };
    n = testlib_node (g, "Concat", "c2", ins, 3, t[5]);
    testlib_int (g, n, "axis", -1);
    testlib_node (g, "Sigmoid", "b", &t[5], 1, t[6]);
    int both[2] = { t[6], t[5] };
    testlib_node (g, "Add", "y", both, 2, t[7]);
    /* after the last read of c2: a new tensor, then c1 read again (its
     * bytes, inside c2's, must still be live) */
    testlib_node (g, "Sigmoid", "f", &t[7], 1, t[8]);
    testlib_node (g, "Relu", "e", &t[2], 1, t[9]);
    testlib_output (g, t[8]);
    testlib_output (g, t[9]);
    for (int opt = 0; opt <= 3; opt++) {
        kiln_cc_stats_t st;
        kiln_program_t *p = s_safe_program (g, opt, &st);
        int concats = 0;
        for (int i = 0; i < p->n_ops; i++)
            concats += p->ops[i].kernel == KILN_K_CONCAT;
        ck_assert_int_eq (concats, opt == 0 ? 2 : 0);
        kiln_program_destroy (&p);
    }
    kiln_graph_destroy (&g);
}
END_TEST

START_TEST (test_planner_is_safe_with_branches_scratch_and_views)
{
    for (int opt = 0; opt <= 2; opt++) {
        kiln_graph_t *g = s_resnetish (5);
        kiln_cc_stats_t st;
        kiln_program_t *p = s_safe_program (g, opt, &st);
        if (opt > 0)
            ck_assert (st.arena_bytes < st.naive_bytes);
        /* Below -O2 the convolutions have an im2col workspace; from -O2
         * their weights are packed and they read the input in place.  The
         * residual input stays live across both of them. */
        int scratch = 0;
        for (int i = 0; i < p->n_ops; i++)
            scratch += p->ops[i].scratch >= 0;
        ck_assert_int_eq (scratch, opt < 2 ? 2 : 0);
        kiln_program_destroy (&p);
        kiln_graph_destroy (&g);
    }
}
END_TEST

static Suite *
s_suite (void)
{
    Suite *s = suite_create ("compiler");
    TCase *tc = tcase_create ("compiler");
    tcase_add_test (tc, test_parse_args_defaults_and_accepts_optlevel);
    tcase_add_test (tc, test_parse_args_refuses_unknown_flags_and_bad_values_naming_them);
    tcase_add_test (tc, test_target_is_cpu_and_the_machine);
    tcase_add_test (tc, test_compile_fills_the_manifest);
    tcase_add_test (tc, test_compile_is_deterministic);
    tcase_add_test (tc, test_compile_copies_the_io_structure_into_the_manifest);
    tcase_add_test (tc, test_compile_refuses_unsupported_ops_naming_node_and_op);
    tcase_add_test (tc, test_compile_refuses_what_the_kernels_cannot_run);
    tcase_add_test (tc, test_weights_are_aligned_deduplicated_and_exact);
    tcase_add_test (tc, test_planner_reuses_memory_on_a_chain);
    tcase_add_test (tc, test_planner_is_safe_with_branches_scratch_and_views);
    tcase_add_test (tc, test_planner_is_safe_with_nested_concats_in_place);
    suite_add_tcase (s, tc);
    return s;
}

int
main (void)
{
    return testlib_run (s_suite ());
}
