/* kiln inspect ARTIFACT.kar | MODEL.kgraph | MODEL.onnx */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "artifact/kiln_artifact.h"
#include "client/kiln_cmds.h"
#include "common/kiln_log.h"

static const char *s_usage =
    "usage: kiln inspect ARTIFACT.kar | MODEL.kgraph | MODEL.onnx\n"
    "  An artifact: print its manifest.json (not verified; see kiln verify).\n"
    "  A model: print its digest, inputs, outputs, I/O structure and op counts.\n";

static int
s_inspect_artifact (const char *path)
{
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_artifact_read (path, &err);
    char *json = NULL;
    size_t len;
    if (!art || kiln_artifact_manifest_json (art, &json, &len, &err) != 0) {
        kiln_artifact_destroy (&art);
        return kiln_cmd_fail ("inspect", &err);
    }
    fwrite (json, 1, len, stdout);
    if (len == 0 || json[len - 1] != '\n')
        putchar ('\n');
    free (json);
    kiln_artifact_destroy (&art);
    return 0;
}

static void
s_print_tensor (const kiln_graph_t *g, int t)
{
    char shape[128], name[4 * KILN_MAX_NAME + 1];
    printf ("  %s %s %s\n", kiln_text_escape (g->tensors[t].name, name, sizeof name),
            kiln_dtype_name (g->tensors[t].dtype),
            kiln_shape_str (&g->tensors[t].shape, shape, sizeof shape));
}

static int
s_inspect_model (const char *path)
{
    kiln_err_t err = { 0 };
    char digest[KILN_HEX_LEN];
    kiln_graph_t *g = kiln_cmd_load_model (path, &err);
    if (!g || kiln_graph_validate (g, &err) != 0
        || kiln_graph_digest (g, digest, &err) != 0) {
        kiln_graph_destroy (&g);
        return kiln_cmd_fail ("inspect", &err);
    }
    uint64_t weight_bytes = 0;
    for (int i = 0; i < g->n_weights; i++)
        weight_bytes += g->weights[i].size;
    printf ("graph %s\nnodes %d, tensors %d, weights %d (%llu bytes), opset %d\n",
            digest, g->n_nodes, g->n_tensors, g->n_weights,
            (unsigned long long) weight_bytes, g->opset);
    printf ("inputs:\n");
    for (int i = 0; i < g->n_inputs; i++)
        s_print_tensor (g, g->inputs[i]);
    printf ("outputs:\n");
    for (int i = 0; i < g->n_outputs; i++)
        s_print_tensor (g, g->outputs[i]);
    if (g->io_structure) {
        printf ("io structure: ");
        kiln_fputs_escaped (g->io_structure, stdout);
        putchar ('\n');
    }
    printf ("ops:\n");
    /* Count ops in order of first appearance: small graphs, quadratic is fine. */
    for (int i = 0; i < g->n_nodes; i++) {
        int seen = 0, count = 0;
        for (int j = 0; j < i && !seen; j++)
            seen = strcmp (g->nodes[j].op, g->nodes[i].op) == 0;
        if (seen)
            continue;
        for (int j = i; j < g->n_nodes; j++)
            count += strcmp (g->nodes[j].op, g->nodes[i].op) == 0;
        char op[4 * KILN_MAX_NAME + 1];
        printf ("  %s %d\n", kiln_text_escape (g->nodes[i].op, op, sizeof op), count);
    }
    kiln_graph_destroy (&g);
    return 0;
}

int
cmd_inspect (int argc, char **argv)
{
    if (argc == 2 && (strcmp (argv[1], "-h") == 0 || strcmp (argv[1], "--help") == 0)) {
        fputs (s_usage, stdout);
        return 0;
    }
    if (argc != 2)
        return kiln_cmd_usage (s_usage, "inspect takes one file");
    size_t n = strlen (argv[1]);
    if (n > 4 && strcmp (argv[1] + n - 4, ".kar") == 0)
        return s_inspect_artifact (argv[1]);
    return s_inspect_model (argv[1]);
}
