/*
 * kiln_gemm_epilogue — the matrix engine's epilogue: a tile written to C
 * with alpha, the addends and the activation (kiln_gemm_priv.h), and
 * kiln_act_apply (kiln_gemm.h).
 */
#include "runtime/kiln_gemm_priv.h"

#include <string.h>

#include "runtime/kiln_vmath.h"

/* The heavy activations (kiln_act_heavy) on n floats in place, in runs of
 * 64 through a buffer padded with zeros to a multiple of 16, so that the
 * vectorised loops (kiln_vmath.h) never fall into their scalar tails: a
 * tile epilogue's runs are 8, 14 or 28 floats long, and a run of 8 went
 * through the scalar tail 30 times slower a float.  The padding lanes
 * compute values nobody reads. */
KILN_VCLONES static void
s_act_heavy (float *v, int64_t n, kiln_act_t act, float a, float b)
{
    float t[64] __attribute__ ((aligned (64)));
    float u[64] __attribute__ ((aligned (64)));
    for (int64_t o = 0; o < n; o += 64) {
        int64_t m = n - o < 64 ? n - o : 64, m16 = (m + 15) & ~(int64_t) 15;
        float *x = v + o;
        memcpy (t, x, (size_t) m * sizeof *t);
        for (int64_t j = m; j < m16; j++)
            t[j] = 0.0f;
        switch (act) {
        case KILN_ACT_SIGMOID:
            kiln_vsigmoid (t, u, m16);
            break;
        case KILN_ACT_TANH:
            kiln_vtanh (t, u, m16);
            break;
        case KILN_ACT_SILU:
            /* Sigmoid, then Mul */
            kiln_vsigmoid (t, u, m16);
            for (int64_t j = 0; j < m16; j++)
                u[j] *= t[j];
            break;
        case KILN_ACT_GELU:
            /* Div by √2 (as a float), Erf, Add 1, Mul by x, Mul by 0.5 */
            for (int64_t j = 0; j < m16; j++)
                u[j] = t[j] / 1.41421353816986083984375f;
            kiln_verf (u, u, m16);
            for (int64_t j = 0; j < m16; j++)
                u[j] = (t[j] * (u[j] + 1.0f)) * 0.5f;
            break;
        case KILN_ACT_HARD_SWISH:
            /* ONNX HardSwish: x · max(0, min(1, alpha · x + 0.5)), alpha
             * the float 1/6, NaN kept */
            for (int64_t j = 0; j < m16; j++) {
                float h = t[j] * (1.0f / 6.0f) + 0.5f;
                h = h < 0.0f ? 0.0f : h;
                u[j] = t[j] * (h > 1.0f ? 1.0f : h);
            }
            break;
        case KILN_ACT_HARD_SIGMOID:
            for (int64_t j = 0; j < m16; j++) {
                float h = a * t[j] + b;
                h = h < 0.0f ? 0.0f : h;
                u[j] = h > 1.0f ? 1.0f : h;
            }
            break;
        default:
            return;
        }
        memcpy (x, u, (size_t) m * sizeof *x);
    }
}

#if defined(__x86_64__)
/* Whether the AVX-512 forms of the activations run: with the AVX-512
 * tile kernels (KILN_RT_ISA), so that a product's tiles and the other
 * kernels' outputs get the same values. */
static bool
s_act_avx512 (void)
{
    kiln_gisa_init ();
    return kiln_gisa.fin_avx512;
}
#endif

/* The activations the tiles apply in their registers (ReLU, Clip,
 * LeakyRelu) on n floats in place; false for the others.  Always inlined,
 * so that a constant act leaves one loop. */
static inline __attribute__ ((always_inline)) bool
s_act_cheap (float *v, int64_t n, kiln_act_t act, float a, float b)
{
    switch (act) {
    case KILN_ACT_RELU:
        for (int64_t j = 0; j < n; j++)
            v[j] = v[j] < 0.0f ? 0.0f : v[j];
        return true;
    case KILN_ACT_CLIP:
        for (int64_t j = 0; j < n; j++) {
            float x = v[j] < a ? a : v[j];
            v[j] = x > b ? b : x;
        }
        return true;
    case KILN_ACT_LEAKY:
        for (int64_t j = 0; j < n; j++)
            v[j] = v[j] < 0.0f ? v[j] * a : v[j];
        return true;
    default:
        return false;
    }
}

KILN_VCLONES void
kiln_act_apply (float *v, int64_t n, kiln_act_t act, float a, float b)
{
    if (s_act_cheap (v, n, act, a, b))
        return;
#if defined(__x86_64__)
    if (kiln_act16_has (act) && s_act_avx512 ()) {
        kiln_gact_apply_avx512 (v, n, act, a, b);
        return;
    }
#endif
    if (kiln_act_heavy (act))
        s_act_heavy (v, n, act, a, b);
}

KILN_VCLONES void
kiln_act_apply_rows (float *v, int64_t rows, int64_t n, int64_t stride, kiln_act_t act,
                     float a, float b)
{
#define S_ROWS(ACT)                                                     \
    case ACT:                                                           \
        for (int64_t r = 0; r < rows; r++)                              \
            s_act_cheap (v + r * stride, n, ACT, a, b);                 \
        return;
    switch (act) {
    S_ROWS (KILN_ACT_RELU)
    S_ROWS (KILN_ACT_CLIP)
    S_ROWS (KILN_ACT_LEAKY)
    default:
        break;
    }
#undef S_ROWS
#if defined(__x86_64__)
    if (kiln_act16_has (act) && s_act_avx512 ()) {
        for (int64_t r = 0; r < rows; r++)
            kiln_gact_apply_avx512 (v + r * stride, n, act, a, b);
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++)
        kiln_act_apply (v + r * stride, n, act, a, b);
}

/* v[0..len-1] = act (alpha · v + addends) for product elements (i, j),
 * (i, j + 1), ... (along_j) or (i, j), (i + 1, j), ...: the epilogue of
 * a run of one row of C, or of one column when C is written transposed.
 * Every tile goes through here, in the same order of operations. */
static inline __attribute__ ((always_inline)) void
s_epi_run (const kiln_gemm_t *g, float *v, int64_t len, int64_t i, int64_t j,
           bool along_j)
{
    if (g->alpha != 1.0f)
        for (int64_t t = 0; t < len; t++)
            v[t] *= g->alpha;
    for (int a = 0; a < g->n_add; a++) {
        const kiln_gadd_t *ad = &g->add[a];
        const float *src = ad->p + i * ad->rs + j * ad->cs;
        int64_t st = along_j ? ad->cs : ad->rs;
        float sc = ad->scale;
        if (st == 0) {
            float val = sc * src[0];
            for (int64_t t = 0; t < len; t++)
                v[t] += val;
        } else if (st == 1 && sc == 1.0f) {
            for (int64_t t = 0; t < len; t++)
                v[t] += src[t];
        } else if (st == 1) {
            for (int64_t t = 0; t < len; t++)
                v[t] += sc * src[t];
        } else {
            for (int64_t t = 0; t < len; t++)
                v[t] += sc * src[t * st];
        }
    }
    /* (the heavy ones: by the caller, over the tile) */
    s_act_cheap (v, len, g->act, g->act_a, g->act_b);
}

/* Rows of a tile computed into t (MR × NR, row stride NR) written to C
 * at (i0, j0): C = (acc ? C : 0) + t, then the epilogue when `last`.
 * The tile passes through a row buffer once; C is written once. */
static inline __attribute__ ((always_inline)) void
s_finish_rows (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0,
               int64_t mr, int64_t nr, bool acc, bool last)
{
    for (int64_t r = 0; r < mr; r++) {
        float *row = g->c + (i0 + r) * g->ldc + j0;
        const float *tr = t + r * NR;
        float v[NR];
        if (acc)
            for (int64_t j = 0; j < nr; j++)
                v[j] = tr[j] + row[j];
        else
            for (int64_t j = 0; j < nr; j++)
                v[j] = tr[j];
        if (last)
            s_epi_run (g, v, nr, i0 + r, j0, true);
        if (last && kiln_act_heavy (g->act))
            kiln_act_apply (v, nr, g->act, g->act_a, g->act_b);
        for (int64_t j = 0; j < nr; j++)
            row[j] = v[j];
    }
}

/* The same for C written transposed: product column j0 + q is row
 * j0 + q of c, its elements i0 .. i0 + mr - 1 adjacent. */
static inline __attribute__ ((always_inline)) void
s_finish_cols (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0,
               int64_t mr, int64_t nr, bool acc, bool last)
{
    float tt[NR][MR];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < NR; q++)
            tt[q][r] = t[r * NR + q];
    for (int64_t q = 0; q < nr; q++) {
        float *col = g->c + (j0 + q) * g->ldc + i0;
        float *v = tt[q];
        if (acc)
            for (int64_t r = 0; r < mr; r++)
                v[r] += col[r];
        if (last)
            s_epi_run (g, v, mr, i0, j0 + q, false);
    }
    /* a heavy activation once over the tile (the lanes past mr unread) */
    if (last && kiln_act_heavy (g->act))
        kiln_act_apply (&tt[0][0], nr * MR, g->act, g->act_a, g->act_b);
    for (int64_t q = 0; q < nr; q++)
        memcpy (g->c + (j0 + q) * g->ldc + i0, tt[q], (size_t) mr * sizeof (float));
}

/* kiln_gfinish_avx512 applies: the CPU has it and every addend is a vector
 * or one value along the runs it finishes. */
bool
kiln_gfinish_fast (const kiln_gemm_t *g)
{
    if (!kiln_gisa.fin_avx512)
        return false;
    for (int a = 0; a < g->n_add; a++) {
        int64_t st = g->c_trans ? g->add[a].rs : g->add[a].cs;
        if (st != 0 && st != 1)
            return false;
    }
    return true;
}

KILN_VCLONES static void
s_finish_c (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0,
            int64_t mr, int64_t nr, bool acc, bool last)
{
    if (g->c_trans) {
        if (mr == MR)
            s_finish_cols (g, t, i0, j0, MR, nr, acc, last);
        else
            s_finish_cols (g, t, i0, j0, mr, nr, acc, last);
    } else if (nr == NR) {
        s_finish_rows (g, t, i0, j0, mr, NR, acc, last);
    } else {
        s_finish_rows (g, t, i0, j0, mr, nr, acc, last);
    }
}

void
kiln_gfinish (const kiln_gemm_t *g, const float *t, int64_t i0, int64_t j0,
          int64_t mr, int64_t nr, bool acc, bool last)
{
#if defined(__x86_64__)
    if (kiln_gfinish_fast (g)) {
        kiln_gfinish_avx512 (g, t, i0, j0, mr, nr, acc, last);
        return;
    }
#endif
    s_finish_c (g, t, i0, j0, mr, nr, acc, last);
}
