/*
 * fuzz_graph — the .kgraph reader and the msgpack graph decoder
 * (kiln_graph_load, which kiln-cc and the worker run on what a client
 * sent), then what runs on an accepted graph: validation with shape
 * inference and constant folding, the canonical digest, and the builtin
 * compiler.  A program the compiler emits must be one the runtime's
 * decoder accepts: anything else aborts (a finding).
 */
#include <string.h>

#include "common/kiln_program.h"
#include "compiler/kiln_compiler.h"
#include "fuzz/fuzz.h"
#include "graph/kiln_graph.h"

FUZZ_QUIET_INIT

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
    kiln_err_t err = { 0 };
    kiln_graph_t *g = kiln_graph_load_mem (data, size, "fuzz.kgraph", &err);
    if (!g) {
        fuzz_refused (-1, &err);
        return 0;
    }
    char digest[KILN_HEX_LEN];
    int rc = kiln_graph_digest (g, digest, &err);
    fuzz_refused (rc, &err);
    kiln_artifact_t *art = kiln_cc_compile (g, "--optlevel 2", &err);
    if (!art)
        fuzz_refused (-1, &err);
    else {
        size_t plen = 0, wlen = 0;
        const uint8_t *prog = kiln_artifact_member (art, KILN_PROGRAM_MEMBER, &plen);
        const uint8_t *weights = kiln_artifact_member (art, KILN_WEIGHTS_MEMBER, &wlen);
        if (!prog || !weights)
            abort ();
        kiln_program_t *p = kiln_program_decode (prog, plen, wlen, &err);
        if (!p)
            abort ();                      /* the compiler and the runtime disagree */
        kiln_program_destroy (&p);
        kiln_artifact_destroy (&art);
    }
    kiln_graph_destroy (&g);
    return 0;
}
