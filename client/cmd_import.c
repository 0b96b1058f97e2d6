/* kiln import MODEL.onnx -o MODEL.kgraph */
#include <getopt.h>
#include <stdio.h>

#include "client/kiln_cmds.h"
#include "graph/kiln_onnx.h"

static const char *s_usage =
    "usage: kiln import MODEL.onnx -o MODEL.kgraph [--quiet]\n"
    "  Import an ONNX model, check it and write a kiln graph.\n"
    "  Weights saved as ONNX external data are read from files in the\n"
    "  model's directory, and nowhere else.  Prints the graph digest.\n";

int
cmd_import (int argc, char **argv)
{
    const char *out = NULL;
    int quiet = 0;
    static const struct option opts[] = {
        { "output", required_argument, NULL, 'o' },
        { "quiet", no_argument, NULL, 'q' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    optind = 1;
    while ((c = getopt_long (argc, argv, "o:qh", opts, NULL)) != -1) {
        switch (c) {
        case 'o': out = optarg; break;
        case 'q': quiet = 1; break;
        case 'h': fputs (s_usage, stdout); return 0;
        default: return kiln_cmd_usage (s_usage, NULL);
        }
    }
    if (optind != argc - 1)
        return kiln_cmd_usage (s_usage, "import takes one model file");
    if (!out)
        return kiln_cmd_usage (s_usage, "missing -o MODEL.kgraph");

    kiln_err_t err = { 0 };
    char digest[KILN_HEX_LEN];
    kiln_graph_t *g = kiln_onnx_import (argv[optind], &err);
    if (!g)
        return kiln_cmd_fail ("import", &err);
    int rc = kiln_graph_save (g, out, &err);
    if (rc == 0)
        rc = kiln_graph_digest (g, digest, &err);
    if (rc == 0 && !quiet)
        printf ("%s\n", digest);
    kiln_graph_destroy (&g);
    return rc == 0 ? 0 : kiln_cmd_fail ("import", &err);
}
