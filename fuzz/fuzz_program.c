/*
 * fuzz_program — the program decoder (kiln_program_decode, the check that
 * stands between a signed artifact's program.kbin and the kernels) and
 * kernel preparation (kiln_kernel_prepare for every op), as libkilnrt
 * does when it loads an artifact.  A program small enough (arena and
 * weights within FUZZ_PROG_MAX_BYTES) is then run once on zeroed tensors:
 * whatever the decoder and the planner accept must keep every kernel
 * inside its buffers, which ASan checks.
 *
 * The input is program.kbin alone; weights.bin is FUZZ_PROG_WEIGHTS
 * zero bytes.
 */
#include <string.h>

#include "common/kiln_cost.h"
#include "common/kiln_program.h"
#include "fuzz/fuzz.h"
#include "runtime/kiln_exec.h"
#include "runtime/kiln_kernels.h"

#define FUZZ_PROG_WEIGHTS   (1u << 20)
#define FUZZ_PROG_MAX_BYTES (1u << 20)
#define FUZZ_PROG_MAX_FLOPS 1e7

static uint8_t *s_weights;

int
LLVMFuzzerInitialize (int *argc, char ***argv)
{
    fuzz_quiet ();
    s_weights = aligned_alloc (KILN_PROG_ALIGN, FUZZ_PROG_WEIGHTS);
    if (!s_weights)
        abort ();
    memset (s_weights, 0, FUZZ_PROG_WEIGHTS);
    return 0;
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
    kiln_err_t err = { 0 };
    kiln_program_t *p = kiln_program_decode (data, size, FUZZ_PROG_WEIGHTS, &err);
    if (!p) {
        fuzz_refused (-1, &err);
        return 0;
    }
    kiln_kplan_t *plans = calloc ((size_t) p->n_ops + 1, sizeof *plans);
    void **ptrs = calloc ((size_t) p->n_tensors + 1, sizeof *ptrs);
    uint8_t *arena = NULL;
    kiln_exec_t *exec = NULL;
    if (!plans || !ptrs)
        abort ();
    int rc = 0;
    double flops = 0;
    for (int i = 0; rc == 0 && i < p->n_ops; i++) {
        rc = kiln_kernel_prepare (p, i, &plans[i], &err);
        if (rc == 0)
            flops += kiln_cost_op (p, i).flops;
    }
    fuzz_refused (rc, &err);
    if (rc != 0 || p->arena_size > FUZZ_PROG_MAX_BYTES || flops > FUZZ_PROG_MAX_FLOPS)
        goto done;
    if (!(exec = kiln_exec_new (p, plans, &err))) {
        fuzz_refused (-1, &err);
        goto done;
    }
    arena = aligned_alloc (KILN_PROG_ALIGN, p->arena_size ? p->arena_size : KILN_PROG_ALIGN);
    if (!arena)
        abort ();
    memset (arena, 0, p->arena_size);
    //  Weights are read-only to the kernels; a kernel that writes one
    //  would change the next run's zeros, so they are zeroed again.
    for (int t = 0; t < p->n_tensors; t++)
        ptrs[t] = p->tensors[t].kind == KILN_TK_WEIGHT ? (void *) (s_weights + p->tensors[t].offset)
                                                       : (void *) (arena + p->tensors[t].offset);
    (void) kiln_exec_run (exec, ptrs, NULL);
    memset (s_weights, 0, FUZZ_PROG_WEIGHTS);
done:
    kiln_exec_destroy (&exec);
    free (arena);
    free (ptrs);
    free (plans);
    kiln_program_destroy (&p);
    return 0;
}
