/*
 * fuzz_artifact — the artifact reader (kiln_artifact_read_mem: tar
 * headers through libarchive, member names and bounds, the manifest's
 * strict parser, digests, signature members) and verification against a
 * keyring, what `kiln verify`, kiln-run, kiln-serve and kiln.load do
 * before anything else.  The keyring holds one key made at start; the
 * seeds are signed by another, so the mutator meets both "not in
 * keyring" and, for inputs it builds from the dictionary, bad signatures.
 */
#include <string.h>

#include "artifact/kiln_artifact.h"
#include "fuzz/fuzz.h"

FUZZ_KEYRING_INIT (s_ring)

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
    kiln_err_t err = { 0 };
    kiln_artifact_t *art = kiln_artifact_read_mem (data, size, &err);
    if (!art) {
        fuzz_refused (-1, &err);
        return 0;
    }
    int rc = kiln_artifact_verify_keyring (art, s_ring, &err);
    fuzz_refused (rc, &err);
    char digest[KILN_HEX_LEN];
    if (kiln_artifact_digest (art, digest, &err) != 0)
        abort ();                          /* a manifest that was read encodes */
    for (int i = 0; i < kiln_artifact_member_count (art); i++) {
        size_t len = 0;
        if (!kiln_artifact_member (art, kiln_artifact_member_name (art, i), &len) && len)
            abort ();
    }
    kiln_artifact_destroy (&art);
    return 0;
}
