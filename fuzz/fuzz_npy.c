/*
 * fuzz_npy — the .npy reader (kiln_npy_parse: magic, version, the Python
 * dict header, dtype, shape and the data's size), what kiln-run reads for
 * every --input.  An accepted array must encode again.
 */
#include "fuzz/fuzz.h"
#include "runtime/kiln_npy.h"

FUZZ_QUIET_INIT

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
    kiln_err_t err = { 0 };
    kiln_npy_t npy;
    kiln_npy_init (&npy);
    int rc = kiln_npy_parse (data, size, &npy, &err);
    fuzz_refused (rc, &err);
    if (rc == 0) {
        uint8_t *out = NULL;
        size_t len = 0;
        if (kiln_npy_encode (npy.dtype, &npy.shape, npy.data, &out, &len, &err) != 0)
            abort ();
        free (out);
    }
    kiln_npy_release (&npy);
    return 0;
}
