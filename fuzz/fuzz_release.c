/*
 * fuzz_release — release records (docs/release-format.md): the envelope
 * parser with its algorithm and key checks (kiln_release_open, what
 * kiln-serve and `kiln release verify` run on release.json), and the
 * record parser behind it (kiln_release_decode), which the signature
 * check would otherwise keep the mutator from reaching.  A record that
 * parses must encode to the same bytes (the parser accepts only the
 * canonical form).
 */
#include <string.h>

#include "artifact/kiln_artifact.h"
#include "artifact/kiln_release.h"
#include "fuzz/fuzz.h"

FUZZ_KEYRING_INIT (s_ring)

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
    kiln_err_t err = { 0 };
    kiln_release_t rel;
    memset (&rel, 0, sizeof rel);
    int rc = kiln_release_open (data, size, s_ring, &rel, &err);
    fuzz_refused (rc, &err);
    memset (&rel, 0, sizeof rel);
    rc = kiln_release_decode ((const char *) data, size, &rel, &err);
    fuzz_refused (rc, &err);
    if (rc == 0) {
        char *out = NULL;
        size_t len = 0;
        if (kiln_release_encode (&rel, &out, &len, &err) != 0 || len != size
            || memcmp (out, data, len) != 0)
            abort ();                      /* only the canonical form parses */
        free (out);
    }
    return 0;
}
