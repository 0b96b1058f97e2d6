/*
 * fuzz_onnx — the ONNX importer (kiln_onnx_import_mem: protobuf decoding,
 * opset checks, initializers, the conversion of every node, shape
 * inference and the folding of shape arithmetic), what `kiln import`,
 * `kiln compile` and kiln.trace run on a model file.  An imported graph
 * must encode and decode again (the .kgraph a client sends).
 */
#include "fuzz/fuzz.h"
#include "graph/kiln_graph.h"
#include "graph/kiln_onnx.h"

FUZZ_QUIET_INIT

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_onnx_import_mem (data, size, &err);
    if (!g) {
        fuzz_refused (-1, &err);
        return 0;
    }
    uint8_t *enc = NULL;
    size_t len = 0;
    if (kiln_graph_encode (g, &enc, &len, &err) != 0)
        abort ();                          /* an imported graph encodes */
    kiln_graph_t *back = kiln_graph_decode (enc, len, &err);
    if (!back)
        abort ();                          /* and decodes */
    kiln_graph_destroy (&back);
    free (enc);
    kiln_graph_destroy (&g);
    return 0;
}
