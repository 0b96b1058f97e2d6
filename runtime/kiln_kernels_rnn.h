/*
 * kiln_kernels_rnn — the recurrent kernel `rnn` (ONNX RNN, GRU and LSTM;
 * docs/program-format.md).  Internal to libkilnrt.
 *
 * Per direction, the input projection of every time step is one product
 * of the matrix engine (X as [T·B, I] times Wᵀ, plus Wb); each step is
 * then one product h·Rᵀ + Rb of [B, H] by [H, G·H] (two for a GRU whose
 * linear_before_reset is 0: the reset gate's h first), and the gates'
 * elementwise work.  Sequence lengths are read at run time: one outside
 * 0..T is a fault of the run (kiln_exec_fault), not a read past X.
 */
#ifndef KILN_KERNELS_RNN_H
#define KILN_KERNELS_RNN_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kiln_program.h"

struct kiln_kplan;

/* The KILN_KERNELS ids this file implements. */
#define KILN_KRNN_KERNELS(X) X (RNN)

/* What the rnn kernel's prepare step works out; lives in kiln_kplan_t. */
typedef struct kiln_krnn_plan {
    int cell;                   /* KILN_RNN_CELL_* */
    int64_t t, b, i, h, d, g;   /* steps, batch, input size, hidden size,
                                 * directions, gates (1, 3, 4) */
    int direction;              /* 0 forward, 1 reverse, 2 both */
    int layout;                 /* 0: X [T, B, I]; 1: X [B, T, I] */
    int bias, seq, h0, c0, peep;    /* operand slot (plan->in) or -1 */
    bool seq_i64;               /* sequence_lens is int64 (else int32) */
    int64_t pack1, pack2;       /* floats of Rᵀ packed: the step's product
                                 * (GRU, linear_before_reset 0: its z and r
                                 * columns, then the h gate's apart) */
    float clip;                 /* bound on the gates' inputs, 0: none */
    bool input_forget;          /* LSTM: f = 1 - i */
    bool lbr;                   /* GRU: linear_before_reset */
    int n_act;                  /* activations per direction */
    int act[KILN_RNN_MAX_ACTS];
    float aa[KILN_RNN_MAX_ACTS], ab[KILN_RNN_MAX_ACTS];
} kiln_krnn_plan_t;

/* Check and plan an rnn op; sets plan->run and plan->ws_bytes.  Its
 * scratch tensor holds at least P + T·B·G·H + B·G·H + 3·B·H floats, P
 * those of Rᵀ [H, G·H] packed (kiln_pack_b_elems; a GRU with
 * linear_before_reset 0: of [H, 2·H] and [H, H]). */
int kiln_krnn_prepare (kiln_program_t *p, kiln_prog_op_t *op, struct kiln_kplan *plan,
                       kiln_err_t *err);

#endif
