/*
 * fuzz.h — what the libFuzzer harnesses in fuzz/ share (docs/security.md,
 * "Fuzzing").  Each harness is one file, fuzz_<name>.c, with
 * LLVMFuzzerTestOneInput feeding the input to one parser the way the
 * programs do, and then to what runs on what the parser accepts.  A harness
 * never checks a result beyond "no crash, no leak, no undefined
 * behaviour, a named error when refused": ASan, UBSan and libFuzzer's leak
 * check do the rest.
 */
#ifndef KILN_FUZZ_H
#define KILN_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <stdio.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_error.h"
#include "common/kiln_fs.h"
#include "common/kiln_log.h"

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);
int LLVMFuzzerInitialize (int *argc, char ***argv);

/* A refused input must say why: an error without a message is a bug. */
static inline void
fuzz_refused (int rc, const kiln_err_t *err)
{
    if (rc != 0 && err->msg[0] == '\0')
        abort ();
}

/* The library logs what it refuses; a fuzzer refuses millions. */
static inline void
fuzz_quiet (void)
{
    kiln_log_init ("fuzz", LOG_CRIT);
}

/* The LLVMFuzzerInitialize of a harness that needs nothing but quiet. */
#define FUZZ_QUIET_INIT                                                     \
    int LLVMFuzzerInitialize (int *argc, char ***argv)                      \
    {                                                                       \
        fuzz_quiet ();                                                      \
        return 0;                                                           \
    }

/* A keyring of one key made now (its directory is gone again; the
 * keyring is in memory).  Never freed: it lives as long as the fuzzer. */
static inline kiln_keyring_t *
fuzz_keyring (void)
{
    kiln_err_t err = { 0 };
    kiln_keyring_t *ring = NULL;
    char *dir = kiln_mkdtemp ("kiln-fuzz-ring-", &err);
    kiln_key_t *key = kiln_key_generate (&err);
    if (!dir || !key || kiln_key_write_pair (key, dir, &err) != 0
        || !(ring = kiln_keyring_load (dir, &err))) {
        fprintf (stderr, "fuzz: no keyring: %s\n", err.msg);
        abort ();
    }
    kiln_key_destroy (&key);
    kiln_rm_rf (dir);
    free (dir);
    return ring;
}

/* `static kiln_keyring_t *ring` and the LLVMFuzzerInitialize that
 * makes it (fuzz_keyring). */
#define FUZZ_KEYRING_INIT(ring)                                             \
    static kiln_keyring_t *ring;                                            \
    int LLVMFuzzerInitialize (int *argc, char ***argv)                      \
    {                                                                       \
        fuzz_quiet ();                                                      \
        ring = fuzz_keyring ();                                             \
        return 0;                                                           \
    }

#endif
