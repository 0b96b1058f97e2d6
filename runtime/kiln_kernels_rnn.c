/*
 * kiln_kernels_rnn — RNN, GRU and LSTM (see kiln_kernels_rnn.h).
 *
 * Output S is [T + n_state, D, B, H]: S[t, d, b] the hidden state of
 * direction d for batch b after time step t (zeros past the batch's
 * sequence length), S[T] the last hidden state of each direction and,
 * for an LSTM, S[T + 1] the last cell state.  The compiler copies Y, Y_h
 * and Y_c out of it in the layout the node asks for.
 */
#include "runtime/kiln_kernels.h"

#include <math.h>
#include <string.h>

#include "common/kiln_pack.h"
#include "runtime/kiln_exec.h"

/* --- activations ---------------------------------------------------- */

/* Apply activation `act` (KILN_RNN_ACT_*) with its a and b to v[n]. */
static void
s_act (float *v, int64_t n, int act, float a, float b)
{
    switch (act) {
    case KILN_RNN_ACT_SIGMOID: kiln_act_apply (v, n, KILN_ACT_SIGMOID, 0, 0); return;
    case KILN_RNN_ACT_TANH: kiln_act_apply (v, n, KILN_ACT_TANH, 0, 0); return;
    case KILN_RNN_ACT_RELU: kiln_act_apply (v, n, KILN_ACT_RELU, 0, 0); return;
    case KILN_RNN_ACT_HARD_SIGMOID:
        kiln_act_apply (v, n, KILN_ACT_HARD_SIGMOID, a, b);
        return;
    case KILN_RNN_ACT_LEAKY_RELU: kiln_act_apply (v, n, KILN_ACT_LEAKY, a, 0); return;
    default: break;
    }
    for (int64_t j = 0; j < n; j++) {
        float x = v[j];
        switch (act) {
        case KILN_RNN_ACT_AFFINE: x = a * x + b; break;
        case KILN_RNN_ACT_SCALED_TANH: x = a * tanhf (b * x); break;
        case KILN_RNN_ACT_THRESHOLDED_RELU: x = x > a ? x : 0.0f; break;
        case KILN_RNN_ACT_ELU: x = x < 0 ? a * expm1f (x) : x; break;
        case KILN_RNN_ACT_SOFTSIGN: x = x / (1.0f + fabsf (x)); break;
        default: x = x > 20.0f ? x : log1pf (expf (x)); break;     /* softplus */
        }
        v[j] = x;
    }
}

/* Clip v[n] to ±c (c > 0), then activation k of direction d. */
static void
s_gate (const kiln_krnn_plan_t *rp, int d, int k, float *v, int64_t n)
{
    if (rp->clip > 0)
        for (int64_t j = 0; j < n; j++)
            v[j] = v[j] < -rp->clip ? -rp->clip : v[j] > rp->clip ? rp->clip : v[j];
    int a = d * rp->n_act + k;
    s_act (v, n, rp->act[a], rp->aa[a], rp->ab[a]);
}

/* --- products --------------------------------------------------------- */

typedef struct {
    kiln_gemm_t g;
} s_prod_t;

static void
s_prod_get (const void *ctx, int64_t idx, kiln_gemm_t *g)
{
    (void) idx;
    *g = ((const s_prod_t *) ctx)->g;
}

/* c[m, n] (row stride ldc) = a[m, k] (row stride lda) · Bᵀ + bias, where
 * B[n, k] is rows of a weight (row stride k), or with `packed` Bᵀ packed
 * by kiln_pack_b; bias (n floats) may be NULL. */
static void
s_product (int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b,
           bool packed, const float *bias, float *c, int64_t ldc)
{
    s_prod_t ctx;
    memset (&ctx, 0, sizeof ctx);
    ctx.g.m = m;
    ctx.g.n = n;
    ctx.g.k = k;
    ctx.g.a = (kiln_gsrc_t) { KILN_GSRC_STRIDED, a, lda, 1, NULL };
    ctx.g.b = packed ? (kiln_gsrc_t) { KILN_GSRC_PACKED, b, 0, 0, NULL }
                     : (kiln_gsrc_t) { KILN_GSRC_STRIDED, b, 1, k, NULL };
    ctx.g.c = c;
    ctx.g.ldc = ldc;
    ctx.g.alpha = 1.0f;
    if (bias)
        ctx.g.add[ctx.g.n_add++] = (kiln_gadd_t) { bias, 0, 1, 1.0f };
    ctx.g.act = KILN_ACT_NONE;
    kiln_gemm_run (s_prod_get, &ctx, 1);
}

/* --- run -------------------------------------------------------------- */

static int64_t
s_len (const kiln_kplan_t *plan, void *const *data, int64_t b)
{
    const kiln_krnn_plan_t *rp = &plan->u.rnn;
    if (rp->seq < 0)
        return rp->t;
    return rp->seq_i64 ? ((const int64_t *) data[plan->in[rp->seq]])[b]
                       : ((const int32_t *) data[plan->in[rp->seq]])[b];
}

static void
s_run_rnn (const kiln_kplan_t *plan, void *const *data)
{
    const kiln_krnn_plan_t *rp = &plan->u.rnn;
    int64_t T = rp->t, B = rp->b, I = rp->i, H = rp->h, D = rp->d, G = rp->g, GH = G * H;
    const float *x = data[plan->in[0]], *w = data[plan->in[1]], *r = data[plan->in[2]];
    const float *bias = rp->bias >= 0 ? data[plan->in[rp->bias]] : NULL;
    const float *h0 = rp->h0 >= 0 ? data[plan->in[rp->h0]] : NULL;
    const float *c0 = rp->c0 >= 0 ? data[plan->in[rp->c0]] : NULL;
    const float *pp = rp->peep >= 0 ? data[plan->in[rp->peep]] : NULL;
    float *s = data[plan->out];
    /* scratch: Rᵀ packed (the reset gate's rows of a GRU with
     * linear_before_reset 0 on their own), every step's projection, the
     * step's products, h, c and a row of temporaries */
    float *rp1 = data[plan->scratch], *rp2 = rp1 + rp->pack1;
    float *xw = rp2 + rp->pack2;
    float *rc = xw + T * B * GH, *hs = rc + B * GH, *cs = hs + B * H, *tmp = cs + B * H;
    bool lstm = rp->cell == KILN_RNN_CELL_LSTM, gru = rp->cell == KILN_RNN_CELL_GRU;

    for (int64_t b = 0; b < B; b++) {
        int64_t len = s_len (plan, data, b);
        if (len < 0 || len > T) {
            kiln_exec_fault ("sequence_lens[%lld] is %lld, not in 0..%lld", (long long) b,
                             (long long) len, (long long) T);
            return;
        }
    }
    for (int64_t d = 0; d < D; d++) {
        bool rev = rp->direction == 1 || (rp->direction == 2 && d == 1);
        const float *wd = w + d * GH * I, *rd = r + d * GH * H;
        const float *wb = bias ? bias + d * 2 * GH : NULL, *rb = bias ? wb + GH : NULL;
        const float *pd = pp ? pp + d * 3 * H : NULL;
        /* every step's input projection: rows in X's order */
        s_product (T * B, GH, I, x, I, wd, false, wb, xw, GH);
        bool two = gru && !rp->lbr;
        kiln_pack_b (rd, H, two ? 2 * H : GH, 1, H, rp1);
        if (two)
            kiln_pack_b (rd + 2 * H * H, H, H, 1, H, rp2);
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < H; j++) {
                int64_t at = (rp->layout ? b * D + d : d * B + b) * H + j;
                hs[b * H + j] = h0 ? h0[at] : 0.0f;
                cs[b * H + j] = c0 ? c0[at] : 0.0f;
            }
        for (int64_t step = 0; step < T; step++) {
            int64_t t = rev ? T - 1 - step : step;
            float *y = s + (t * D + d) * B * H;
            /* the recurrent products */
            if (two) {
                s_product (B, 2 * H, H, hs, H, rp1, true, rb, rc, GH);
                for (int64_t b = 0; b < B; b++) {
                    float *v = rc + b * GH;
                    const float *xr = xw + (rp->layout ? b * T + t : t * B + b) * GH;
                    for (int64_t j = 0; j < 2 * H; j++)
                        v[j] += xr[j];
                    s_gate (rp, (int) d, 0, v, 2 * H);
                    for (int64_t j = 0; j < H; j++)
                        tmp[b * H + j] = v[H + j] * hs[b * H + j];
                }
                s_product (B, H, H, tmp, H, rp2, true, rb ? rb + 2 * H : NULL, rc + 2 * H, GH);
            }
            else
                s_product (B, GH, H, hs, H, rp1, true, rb, rc, GH);
            for (int64_t b = 0; b < B; b++) {
                float *v = rc + b * GH, *hb = hs + b * H, *cb = cs + b * H;
                const float *xr = xw + (rp->layout ? b * T + t : t * B + b) * GH;
                if (t >= s_len (plan, data, b)) {
                    memset (y + b * H, 0, (size_t) H * sizeof *y);
                    continue;
                }
                if (rp->cell == KILN_RNN_CELL_RNN) {
                    for (int64_t j = 0; j < H; j++)
                        v[j] += xr[j];
                    s_gate (rp, (int) d, 0, v, H);
                    memcpy (hb, v, (size_t) H * sizeof *hb);
                }
                else if (gru) {
                    float *z = v, *rr = v + H, *hh = v + 2 * H;
                    if (rp->lbr) {
                        for (int64_t j = 0; j < 2 * H; j++)
                            v[j] += xr[j];
                        s_gate (rp, (int) d, 0, v, 2 * H);
                        for (int64_t j = 0; j < H; j++)
                            hh[j] = xr[2 * H + j] + rr[j] * hh[j];
                    }
                    else
                        for (int64_t j = 0; j < H; j++)
                            hh[j] += xr[2 * H + j];
                    s_gate (rp, (int) d, 1, hh, H);
                    for (int64_t j = 0; j < H; j++)
                        hb[j] = (1.0f - z[j]) * hh[j] + z[j] * hb[j];
                }
                else {
                    /* gates i, o, f, c; peepholes Pi, Po, Pf */
                    float *gi = v, *go = v + H, *gf = v + 2 * H, *gc = v + 3 * H;
                    for (int64_t j = 0; j < GH; j++)
                        v[j] += xr[j];
                    if (pd)
                        for (int64_t j = 0; j < H; j++) {
                            gi[j] += pd[j] * cb[j];
                            gf[j] += pd[2 * H + j] * cb[j];
                        }
                    s_gate (rp, (int) d, 0, gi, H);
                    if (rp->input_forget)
                        for (int64_t j = 0; j < H; j++)
                            gf[j] = 1.0f - gi[j];
                    else
                        s_gate (rp, (int) d, 0, gf, H);
                    s_gate (rp, (int) d, 1, gc, H);
                    for (int64_t j = 0; j < H; j++)
                        cb[j] = gf[j] * cb[j] + gi[j] * gc[j];
                    if (pd)
                        for (int64_t j = 0; j < H; j++)
                            go[j] += pd[H + j] * cb[j];
                    s_gate (rp, (int) d, 0, go, H);
                    float *hc = tmp + b * H;
                    memcpy (hc, cb, (size_t) H * sizeof *hc);
                    int ah = (int) d * rp->n_act + 2;   /* h(C): not clipped */
                    s_act (hc, H, rp->act[ah], rp->aa[ah], rp->ab[ah]);
                    for (int64_t j = 0; j < H; j++)
                        hb[j] = go[j] * hc[j];
                }
                memcpy (y + b * H, hb, (size_t) H * sizeof *y);
            }
        }
        memcpy (s + (T * D + d) * B * H, hs, (size_t) (B * H) * sizeof *s);
        if (lstm)
            memcpy (s + ((T + 1) * D + d) * B * H, cs, (size_t) (B * H) * sizeof *s);
    }
}

/* --- prepare ---------------------------------------------------------- */

/* Operand slot `slot` must be a float32 tensor of `n` elements. */
static int
s_want (const kiln_program_t *p, const kiln_kplan_t *plan, int slot, int64_t n,
        const char *what, kiln_err_t *err)
{
    const kiln_prog_tensor_t *t = &p->tensors[plan->in[slot]];
    int64_t m = 1;
    for (int i = 0; i < t->shape.rank; i++)
        m *= t->shape.dims[i];
    if (t->dtype != KILN_DT_FLOAT32 || m != n)
        return kiln_error (err, KILN_EFORMAT, "%s must be float32 of %lld elements, is %s "
                           "of %lld", what, (long long) n, kiln_dtype_name (t->dtype),
                           (long long) m);
    return 0;
}

int
kiln_krnn_prepare (kiln_program_t *p, kiln_prog_op_t *op, kiln_kplan_t *plan,
                   kiln_err_t *err)
{
    kiln_krnn_plan_t *rp = &plan->u.rnn;
    int64_t cell, direction, layout, has[5], input_forget, lbr, acts[KILN_PROG_MAX_PARAM_INTS];
    int64_t ab[KILN_PROG_MAX_PARAM_INTS];
    double clip;
    int rc, n_acts, n_ab;
    if ((rc = kiln_prog_op_int (op, "cell", &cell, err))
        || (rc = kiln_prog_op_int (op, "direction", &direction, err))
        || (rc = kiln_prog_op_int (op, "layout", &layout, err))
        || (rc = kiln_prog_op_ints (op, "has", 5, has, err))
        || (rc = kiln_prog_op_float (op, "clip", &clip, err))
        || (rc = kiln_prog_op_int (op, "input_forget", &input_forget, err))
        || (rc = kiln_prog_op_int (op, "linear_before_reset", &lbr, err))
        || (rc = kiln_prog_op_ints_any (op, "acts", acts, &n_acts, err))
        || (rc = kiln_prog_op_ints_any (op, "act_params", ab, &n_ab, err)))
        return rc;
    if (cell < 0 || cell > 2 || direction < 0 || direction > 2 || layout < 0 || layout > 1
        || !(clip >= 0) || clip > 3.4e38)
        return kiln_error (err, KILN_EFORMAT, "cell, direction, layout or clip out of range");
    const kiln_prog_tensor_t *x = &p->tensors[plan->in[0]], *w = &p->tensors[plan->in[1]];
    const kiln_prog_tensor_t *y = &p->tensors[plan->out];
    if (x->shape.rank != 3 || w->shape.rank != 3 || y->shape.rank != 4)
        return kiln_error (err, KILN_EFORMAT, "X and W must have rank 3 and S rank 4");
    rp->cell = (int) cell;
    rp->g = cell == KILN_RNN_CELL_RNN ? 1 : cell == KILN_RNN_CELL_GRU ? 3 : 4;
    rp->n_act = cell == KILN_RNN_CELL_RNN ? 1 : cell == KILN_RNN_CELL_GRU ? 2 : 3;
    rp->direction = (int) direction;
    rp->layout = (int) layout;
    rp->d = direction == 2 ? 2 : 1;
    rp->t = x->shape.dims[layout ? 1 : 0];
    rp->b = x->shape.dims[layout ? 0 : 1];
    rp->i = x->shape.dims[2];
    rp->h = y->shape.dims[3];
    int n_state = cell == KILN_RNN_CELL_LSTM ? 2 : 1;
    int64_t T = rp->t, B = rp->b, H = rp->h, D = rp->d, GH = rp->g * rp->h;
    if (y->dtype != KILN_DT_FLOAT32 || y->shape.dims[0] != T + n_state
        || y->shape.dims[1] != D || y->shape.dims[2] != B || T < 1 || B < 1 || H < 1
        || rp->i < 1)
        return kiln_error (err, KILN_EFORMAT, "S must be float32 [T + %d, D, B, H] of X's "
                           "T and B, each at least 1", n_state);
    if (n_acts != rp->d * rp->n_act || n_ab != 2 * n_acts)
        return kiln_error (err, KILN_EFORMAT, "acts must hold %lld activations and "
                           "act_params twice as many", (long long) (rp->d * rp->n_act));
    for (int a = 0; a < n_acts; a++) {
        if (acts[a] < 0 || acts[a] >= KILN_RNN_ACT_COUNT
            || ab[2 * a] < 0 || ab[2 * a] > UINT32_MAX || ab[2 * a + 1] < 0
            || ab[2 * a + 1] > UINT32_MAX)
            return kiln_error (err, KILN_EFORMAT, "activation %d or its parameters out of "
                               "range", a);
        uint32_t bits[2] = { (uint32_t) ab[2 * a], (uint32_t) ab[2 * a + 1] };
        rp->act[a] = (int) acts[a];
        memcpy (&rp->aa[a], &bits[0], 4);
        memcpy (&rp->ab[a], &bits[1], 4);
    }
    rp->clip = (float) clip;
    rp->input_forget = input_forget != 0;
    rp->lbr = lbr != 0;
    if (x->dtype != KILN_DT_FLOAT32)
        return kiln_error (err, KILN_EFORMAT, "X must be float32");
    if ((rc = s_want (p, plan, 1, D * GH * rp->i, "W", err))
        || (rc = s_want (p, plan, 2, D * GH * H, "R", err)))
        return rc;
    int slot = 3;
    int *slots[5] = { &rp->bias, &rp->seq, &rp->h0, &rp->c0, &rp->peep };
    int64_t want[5] = { D * 2 * GH, B, D * B * H, D * B * H, D * 3 * H };
    const char *names[5] = { "B", "sequence_lens", "initial_h", "initial_c", "P" };
    for (int k = 0; k < 5; k++) {
        *slots[k] = -1;
        if (!has[k])
            continue;
        if (slot >= plan->n_in)
            return kiln_error (err, KILN_EFORMAT, "has says %s is there; the op has %d "
                               "operands", names[k], plan->n_in);
        *slots[k] = slot++;
        if (k == 1) {
            const kiln_prog_tensor_t *sl = &p->tensors[plan->in[rp->seq]];
            int64_t m = sl->shape.rank == 1 ? sl->shape.dims[0] : -1;
            if ((sl->dtype != KILN_DT_INT32 && sl->dtype != KILN_DT_INT64) || m != B)
                return kiln_error (err, KILN_EFORMAT, "sequence_lens must be int32 or "
                                   "int64 [B]");
            rp->seq_i64 = sl->dtype == KILN_DT_INT64;
        }
        else if ((rc = s_want (p, plan, *slots[k], want[k], names[k], err)))
            return rc;
    }
    if (slot != plan->n_in)
        return kiln_error (err, KILN_EFORMAT, "%d operands, has says %d", plan->n_in, slot);
    if ((rp->c0 >= 0 || rp->peep >= 0 || rp->input_forget) && cell != KILN_RNN_CELL_LSTM)
        return kiln_error (err, KILN_EFORMAT, "initial_c, P and input_forget are an LSTM's");
    int64_t need, tb_gh;
    bool two = cell == KILN_RNN_CELL_GRU && !rp->lbr;
    if (!kiln_pack_b_elems (H, two ? 2 * H : GH, &rp->pack1)
        || !kiln_pack_b_elems (H, two ? H : 0, &rp->pack2))
        return kiln_error (err, KILN_ELIMIT, "R packed is too large");
    if (__builtin_mul_overflow (T * B, GH, &tb_gh)
        || __builtin_add_overflow (tb_gh, B * GH + 3 * B * H + rp->pack1 + rp->pack2, &need))
        return kiln_error (err, KILN_ELIMIT, "T·B·G·H overflows");
    const kiln_prog_tensor_t *sc = plan->scratch >= 0 ? &p->tensors[plan->scratch] : NULL;
    int64_t have = 0;
    if (sc && sc->dtype == KILN_DT_FLOAT32) {
        have = 1;
        for (int i = 0; i < sc->shape.rank; i++)
            have *= sc->shape.dims[i];
    }
    if (have < need)
        return kiln_error (err, KILN_EFORMAT, "needs a float32 scratch tensor of %lld "
                           "elements", (long long) need);
    size_t ws1 = kiln_gemm_ws_bytes (T * B, GH, rp->i, false, false);
    size_t ws2 = kiln_gemm_ws_bytes (B, GH, H, false, true);
    plan->ws_bytes = ws1 > ws2 ? ws1 : ws2;
    plan->run = s_run_rnn;
    return 0;
}
