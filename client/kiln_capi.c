/*
 * kiln_capi — flat entry points for bindings; see kiln_capi.h.
 */
#include "client/kiln_capi.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "artifact/kiln_artifact.h"
#include "client/kiln_client.h"
#include "common/kiln_fs.h"
#include "common/kiln_program.h"
#include "graph/kiln_onnx.h"

#define S_LINE_MAX 4096         /* one line of a dump, attributes cut */

kiln_graph_t *
kiln_capi_import_onnx (const uint8_t *data, size_t len, kiln_err_t *err)
{
    return kiln_capi_import_onnx_dir (data, len, NULL, err);
}

kiln_graph_t *
kiln_capi_import_onnx_dir (const uint8_t *data, size_t len, const char *base_dir,
                           kiln_err_t *err)
{
    if (!data && len > 0) {
        kiln_error (err, KILN_EINVAL, "no ONNX bytes");
        return NULL;
    }
    return kiln_onnx_import_mem_dir (data, len, base_dir, err);
}

void
kiln_capi_graph_free (kiln_graph_t *g)
{
    kiln_graph_destroy (&g);
}

int
kiln_capi_graph_save (const kiln_graph_t *g, const char *path, kiln_err_t *err)
{
    if (!g || !path)
        return kiln_error (err, KILN_EINVAL, "kiln_capi_graph_save needs a graph "
                           "and a path");
    return kiln_graph_save (g, path, err);
}

/* Dump `obj` (a reference is taken) as compact JSON into json[size]. */
static int
s_json_out (json_t *obj, char *json, size_t size, kiln_err_t *err)
{
    if (!obj)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    char *text = json_dumps (obj, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref (obj);
    if (!text)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    size_t n = strlen (text);
    int rc = 0;
    if (!json || n + 1 > size)
        rc = kiln_error (err, KILN_ELIMIT, "the answer takes %zu bytes, the buffer "
                         "holds %zu", n + 1, json ? size : 0);
    else
        memcpy (json, text, n + 1);
    free (text);
    return rc;
}

static json_t *
s_shape_json (const kiln_shape_t *s)
{
    json_t *a = json_array ();
    for (int d = 0; a && d < s->rank; d++)
        json_array_append_new (a, json_integer (s->dims[d]));
    return a;
}

static json_t *
s_ios_json (const kiln_graph_t *g, const int *ts, int n)
{
    json_t *a = json_array ();
    for (int i = 0; a && i < n; i++) {
        const kiln_tensor_t *t = &g->tensors[ts[i]];
        json_array_append_new (a, json_pack ("{s:s, s:s, s:o}", "name",
                                             t->name ? t->name : "", "dtype",
                                             kiln_dtype_name (t->dtype), "shape",
                                             s_shape_json (&t->shape)));
    }
    return a;
}

int
kiln_capi_graph_info (const kiln_graph_t *g, char *json, size_t size,
                      kiln_err_t *err)
{
    if (!g)
        return kiln_error (err, KILN_EINVAL, "no graph");
    char digest[KILN_HEX_LEN];
    int rc = kiln_graph_digest (g, digest, err);
    if (rc)
        return rc;
    json_t *ops = json_object ();
    for (int n = 0; ops && n < g->n_nodes; n++) {
        const char *op = g->nodes[n].op;
        json_t *c = json_object_get (ops, op);
        json_object_set_new (ops, op, json_integer (c ? json_integer_value (c) + 1 : 1));
    }
    uint64_t wbytes = 0;
    for (int w = 0; w < g->n_weights; w++)
        wbytes += g->weights[w].size;
    json_t *obj = json_pack ("{s:s, s:i, s:i, s:I, s:o, s:o, s:o}", "digest", digest,
                             "opset", g->opset, "nodes", g->n_nodes, "weights_bytes",
                             (json_int_t) wbytes, "inputs",
                             s_ios_json (g, g->inputs, g->n_inputs), "outputs",
                             s_ios_json (g, g->outputs, g->n_outputs), "ops",
                             ops ? ops : json_object ());
    return s_json_out (obj, json, size, err);
}

/* --- dumps ---------------------------------------------------------- */

/* Append printf output to line[S_LINE_MAX], silently cut at the end. */
__attribute__ ((format (printf, 3, 4))) static void
s_cat (char *line, size_t *used, const char *fmt, ...)
{
    if (*used + 1 >= S_LINE_MAX)
        return;
    va_list ap;
    va_start (ap, fmt);
    int n = vsnprintf (line + *used, S_LINE_MAX - *used, fmt, ap);
    va_end (ap);
    if (n > 0)
        *used = *used + (size_t) n < S_LINE_MAX ? *used + (size_t) n : S_LINE_MAX - 1;
}

static void
s_cat_ints (char *line, size_t *used, const int64_t *v, size_t n)
{
    s_cat (line, used, "[");
    for (size_t i = 0; i < n && i < 64; i++)
        s_cat (line, used, "%s%" PRId64, i ? ", " : "", v[i]);
    s_cat (line, used, "%s]", n > 64 ? ", ..." : "");
}

static void
s_cat_tensor (char *line, size_t *used, const kiln_graph_t *g, int t)
{
    if (t < 0) {
        s_cat (line, used, "-");
        return;
    }
    const kiln_tensor_t *tensor = &g->tensors[t];
    const char *name = tensor->name && *tensor->name ? tensor->name : "";
    if (*name)
        s_cat (line, used, "%s", name);
    else
        s_cat (line, used, "#%d", t);
    if (tensor->weight >= 0)
        s_cat (line, used, "*");
}

int
kiln_capi_graph_dump (const kiln_graph_t *g, const char *path, kiln_err_t *err)
{
    if (!g || !path)
        return kiln_error (err, KILN_EINVAL, "kiln_capi_graph_dump needs a graph and "
                           "a path");
    char digest[KILN_HEX_LEN];
    int rc = kiln_graph_digest (g, digest, err);
    if (rc)
        return rc;
    FILE *f = fopen (path, "w");
    if (!f)
        return kiln_error (err, KILN_EIO, "could not write '%s'", path);
    char *line = malloc (S_LINE_MAX);
    if (!line) {
        fclose (f);
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    char sh[200];
    fprintf (f, "kiln graph %s\nopset %d, %d nodes, %d tensors, %d weights "
             "(* marks a weight)\n", digest, g->opset, g->n_nodes, g->n_tensors,
             g->n_weights);
    for (int o = 0; o < 2; o++) {
        const int *ts = o ? g->outputs : g->inputs;
        int n = o ? g->n_outputs : g->n_inputs;
        fprintf (f, "%s:\n", o ? "outputs" : "inputs");
        for (int i = 0; i < n; i++) {
            const kiln_tensor_t *t = &g->tensors[ts[i]];
            fprintf (f, "  %s %s %s\n", t->name ? t->name : "",
                     kiln_dtype_name (t->dtype), kiln_shape_str (&t->shape, sh, sizeof sh));
        }
    }
    fprintf (f, "nodes:\n");
    for (int n = 0; n < g->n_nodes; n++) {
        const kiln_node_t *node = &g->nodes[n];
        size_t used = 0;
        line[0] = '\0';
        s_cat (line, &used, "  %4d %s", n, node->op);
        if (node->name && *node->name)
            s_cat (line, &used, " '%s'", node->name);
        s_cat (line, &used, " (");
        for (int i = 0; i < node->n_inputs; i++) {
            s_cat (line, &used, "%s", i ? ", " : "");
            s_cat_tensor (line, &used, g, node->inputs[i]);
        }
        s_cat (line, &used, ") ->");
        for (int i = 0; i < node->n_outputs; i++) {
            int t = node->outputs[i];
            s_cat (line, &used, "%s ", i ? "," : "");
            s_cat_tensor (line, &used, g, t);
            s_cat (line, &used, " %s %s", kiln_dtype_name (g->tensors[t].dtype),
                   kiln_shape_str (&g->tensors[t].shape, sh, sizeof sh));
        }
        for (int a = 0; a < node->n_attrs; a++) {
            const kiln_attr_t *at = &node->attrs[a];
            s_cat (line, &used, "%s%s=", a ? ", " : "  {", at->name);
            switch (at->kind) {
            case KILN_ATTR_INT: s_cat (line, &used, "%" PRId64, at->i); break;
            case KILN_ATTR_FLOAT: s_cat (line, &used, "%g", at->f); break;
            case KILN_ATTR_STRING: s_cat (line, &used, "'%s'", at->s ? at->s : ""); break;
            case KILN_ATTR_INTS: s_cat_ints (line, &used, at->ints, at->n); break;
            case KILN_ATTR_FLOATS:
                s_cat (line, &used, "[%zu floats]", at->n);
                break;
            }
            if (a == node->n_attrs - 1)
                s_cat (line, &used, "}");
        }
        fprintf (f, "%s\n", line);
    }
    free (line);
    if (fclose (f) != 0)
        return kiln_error (err, KILN_EIO, "could not write '%s'", path);
    return 0;
}

int
kiln_capi_program_dump (const char *artifact_path, const char *path,
                        kiln_err_t *err)
{
    if (!artifact_path || !path)
        return kiln_error (err, KILN_EINVAL, "kiln_capi_program_dump needs an "
                           "artifact and a path");
    kiln_program_t *p = NULL;
    FILE *f = NULL;
    char *line = NULL;
    int rc;
    kiln_artifact_t *art = kiln_artifact_read (artifact_path, err);
    if (!art)
        return -err->code;
    size_t plen = 0, wlen = 0;
    const uint8_t *pbytes = kiln_artifact_member (art, KILN_PROGRAM_MEMBER, &plen);
    if (!pbytes || !kiln_artifact_member (art, KILN_WEIGHTS_MEMBER, &wlen)) {
        rc = kiln_error (err, KILN_EFORMAT, "'%s' has no program", artifact_path);
        goto done;
    }
    if (!(p = kiln_program_decode (pbytes, plen, wlen, err))) {
        rc = kiln_error_prefix (err, "'%s'", artifact_path);
        goto done;
    }
    if (!(f = fopen (path, "w")) || !(line = malloc (S_LINE_MAX))) {
        rc = kiln_error (err, KILN_EIO, "could not write '%s'", path);
        goto done;
    }
    const kiln_manifest_t *man = kiln_artifact_manifest (art);
    fprintf (f, "kiln program (%s %s, target %s, args '%s')\n%d ops, %d tensors, "
             "arena %" PRIu64 " bytes, weights %zu bytes\ntensors:\n",
             man->compiler_id, man->compiler_version, man->target, man->compiler_args,
             p->n_ops, p->n_tensors, p->arena_size, wlen);
    char sh[200];
    for (int t = 0; t < p->n_tensors; t++) {
        const kiln_prog_tensor_t *pt = &p->tensors[t];
        fprintf (f, "  t%-5d %-6s %s %s @%s+%" PRIu64 " (%" PRIu64 " bytes)", t,
                 kiln_tensor_kind_name (pt->kind), kiln_dtype_name (pt->dtype),
                 kiln_shape_str (&pt->shape, sh, sizeof sh),
                 pt->kind == KILN_TK_WEIGHT ? "weights" : "arena", pt->offset, pt->size);
        if (pt->io >= 0)
            fprintf (f, " io %d", pt->io);
        fprintf (f, "\n");
    }
    fprintf (f, "ops:\n");
    for (int i = 0, stage = 0; i < p->n_ops; i++) {
        const kiln_prog_op_t *op = &p->ops[i];
        size_t used = 0;
        line[0] = '\0';
        if (stage < p->n_stages && p->stages[stage].first_op == i) {
            const kiln_prog_stage_t *st = &p->stages[stage];
            uint64_t bytes = 0;
            for (int r = 0; r < st->n_handoff; r++)
                bytes += st->handoff[r].size;
            fprintf (f, "  -- stage %d of %d: receives %d range%s, %" PRIu64 " bytes\n",
                     stage, p->n_stages, st->n_handoff, st->n_handoff == 1 ? "" : "s",
                     bytes);
            stage++;
        }
        s_cat (line, &used, "  %4d %s (", i, kiln_kernel_name (op->kernel));
        for (int k = 0; k < op->n_inputs; k++)
            s_cat (line, &used, "%st%d", k ? ", " : "", op->inputs[k]);
        s_cat (line, &used, ") ->");
        for (int k = 0; k < op->n_outputs; k++)
            s_cat (line, &used, "%s t%d", k ? "," : "", op->outputs[k]);
        if (op->scratch >= 0)
            s_cat (line, &used, " scratch t%d", op->scratch);
        for (int k = 0; k < op->n_params; k++) {
            const kiln_prog_param_t *pp = &op->params[k];
            s_cat (line, &used, "%s%s=", k ? ", " : "  {", pp->name);
            if (pp->kind == KILN_PP_INT)
                s_cat (line, &used, "%" PRId64, pp->i);
            else if (pp->kind == KILN_PP_FLOAT)
                s_cat (line, &used, "%g", pp->f);
            else
                s_cat_ints (line, &used, pp->ints, (size_t) pp->n);
            if (k == op->n_params - 1)
                s_cat (line, &used, "}");
        }
        fprintf (f, "%s\n", line);
    }
    rc = 0;
done:
    free (line);
    if (f && fclose (f) != 0 && rc == 0)
        rc = kiln_error (err, KILN_EIO, "could not write '%s'", path);
    kiln_program_destroy (&p);
    kiln_artifact_destroy (&art);
    return rc;
}

/* --- compiling ------------------------------------------------------ */

int
kiln_capi_compile (kiln_graph_t *g, const char *broker, const char *compiler_args,
                   long timeout_ms, const char *key_path, const char *out_path,
                   char *json, size_t size, kiln_err_t *err)
{
    return kiln_capi_compile_progress (g, broker, compiler_args, timeout_ms, key_path,
                                       out_path, NULL, NULL, json, size, err);
}

/* The caller's progress callback and its argument. */
typedef struct {
    kiln_capi_progress_fn *fn;
    void *arg;
} s_progress_t;

/* A kiln_progress_fn: the event as JSON for the caller. */
static void
s_progress_json (const kiln_progress_event_t *ev, void *arg)
{
    static const char *names[] = { "upload", "queued", "running", "done", "download" };
    const s_progress_t *p = arg;
    json_t *obj = json_pack ("{s:s}", "phase", names[ev->phase]);
    if (!obj)
        return;
    if (ev->phase == KILN_PHASE_UPLOAD || ev->phase == KILN_PHASE_DOWNLOAD) {
        json_object_set_new (obj, "sent_bytes", json_integer ((json_int_t) ev->sent_bytes));
        json_object_set_new (obj, "total_bytes", json_integer ((json_int_t) ev->total_bytes));
        if (ev->phase == KILN_PHASE_DOWNLOAD)
            json_object_set_new (obj, "reused_bytes",
                                 json_integer ((json_int_t) ev->reused_bytes));
    }
    if (ev->phase == KILN_PHASE_QUEUED || ev->phase == KILN_PHASE_RUNNING) {
        json_object_set_new (obj, "position", json_integer ((json_int_t) ev->position));
        json_object_set_new (obj, "queued", json_integer ((json_int_t) ev->queued));
        json_object_set_new (obj, "running", json_integer ((json_int_t) ev->running));
        json_object_set_new (obj, "elapsed_ms", json_integer ((json_int_t) ev->elapsed_ms));
        json_object_set_new (obj, "estimate_ms", json_integer ((json_int_t) ev->estimate_ms));
        json_object_set_new (obj, "eta_ms", json_integer ((json_int_t) ev->eta_ms));
        if (ev->worker)
            json_object_set_new (obj, "worker", json_string (ev->worker));
    }
    char *text = json_dumps (obj, JSON_COMPACT | JSON_SORT_KEYS);
    if (text)
        p->fn (text, p->arg);
    free (text);
    json_decref (obj);
}

int
kiln_capi_compile_progress (kiln_graph_t *g, const char *broker, const char *compiler_args,
                            long timeout_ms, const char *key_path, const char *out_path,
                            kiln_capi_progress_fn *fn, void *arg, char *json, size_t size,
                            kiln_err_t *err)
{
    if (!g || !out_path)
        return kiln_error (err, KILN_EINVAL, "kiln_capi_compile needs a graph and "
                           "an output path");
    if (timeout_ms < 0 || timeout_ms > (long) 7 * 24 * 3600 * 1000)
        return kiln_error (err, KILN_EINVAL, "timeout of %ld ms is out of range",
                           timeout_ms);
    /* compiler_timeout bounds the whole wait, as in the trace APIs: the
     * compile on the farm is killed after it, and the call gives up (and
     * cancels its request) after it too, queueing included. */
    kiln_compile_opts_t opts = { .compiler_args = compiler_args,
                                 .timeout_ms = (int) timeout_ms,
                                 .wait_ms = (int) timeout_ms };
    kiln_compile_result_t res;
    memset (&res, 0, sizeof res);
    int rc;
    if (broker && *broker) {
        kiln_client_t *client = kiln_client_new (broker, err);
        if (!client)
            return -err->code;
        s_progress_t progress = { fn, arg };
        if (fn)
            kiln_client_set_progress (client, s_progress_json, &progress, 1000);
        rc = kiln_client_compile (client, g, &opts, out_path, &res, err);
        kiln_client_destroy (&client);
    }
    else
        rc = kiln_compile_local (g, &opts, key_path, out_path, &res, err);
    if (rc)
        return rc;
    json_t *obj = json_pack ("{s:s, s:s, s:s, s:b, s:s?}", "artifact", res.artifact,
                             "action_key", res.action_key, "graph_digest",
                             res.graph_digest, "cached", res.cached, "worker",
                             res.worker[0] ? res.worker : NULL);
    return s_json_out (obj, json, size, err);
}

int
kiln_capi_config_dir (char *buf, size_t size, kiln_err_t *err)
{
    if (!buf || size == 0)
        return kiln_error (err, KILN_EINVAL, "no buffer");
    return kiln_config_dir (buf, size, err);
}
