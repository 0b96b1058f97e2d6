/*
 * kiln_gemm_strassen — Strassen's one level in the matrix engine.
 *
 * One level of Strassen's algorithm for the products that spend most of
 * a transformer's time (a weight B pre-packed, A's rows read where they
 * lie, k 256-512, n >= 512: its FFN 1 and QKV projections): with the
 * halves A11 A12 / A21 A22 (rows, k) and B11 B12 / B21 B22 (k, columns),
 *   M1 = (A11 + A22)(B11 + B22)   M5 = (A11 + A12) B22
 *   M2 = (A21 + A22) B11          M6 = (A21 - A11)(B11 + B12)
 *   M3 = A11 (B12 - B22)          M7 = (A12 - A22)(B21 + B22)
 *   M4 = A22 (B21 - B11)
 *   C11 = M1 + M4 - M5 + M7       C12 = M3 + M5
 *   C21 = M2 + M4                 C22 = M1 - M2 + M3 + M6
 * seven half-size products where the direct product has eight: 1/8 of
 * the multiplications saved, against the sums of the halves.  Here:
 *  - A's five sums are formed once per product (5/4 of A, in L2);
 *  - B's five sums for a pair of column panels (q, q + n/2) by the task
 *    of that pair, from the packed weight as it lies: nothing more is
 *    stored in the artifact (seven packed operands, formed by the
 *    compiler, were 7/4 of the weight's bytes to stream each run, and
 *    lost in the model: docs/engine.md);
 *  - each M is a tile product (kiln_gukr_avx512_s) whose result goes to one
 *    or two of the four tiles of C being summed (in L1), the last into C
 *    itself with the epilogue, in the order written above.
 * The transformer's FFN 1 (128 × 256 × 2048, bias and relu): 1.187 ms
 * direct, 1.138 ms this way; the model 13.03 -> 12.85 ms.  The sums of
 * halves round differently: the largest error against double over that
 * product is 8.8e-7 of the output's magnitude, against 6.3e-7 direct.
 * Which products run this way depends on their shape and the ISA only,
 * never on the thread count, and each element's sums are the same
 * whichever worker runs its pair of panels: results are the same bits
 * for any KILN_RT_THREADS. */

#include "runtime/kiln_gemm_priv.h"

#include "runtime/kiln_exec.h"

/* Strassen's one level (kiln_gstrassen_run) for a product of this shape:
 * halves of whole tiles; k long enough to pay for the sums, and A's
 * five sums (5/4 of A) within 320 KiB, in L2; columns enough to share
 * them.  (Over the transformer's FFN 2, k 2048 and n 256, it gained 2 %
 * alone and lost in the model: its A's sums are 1.25 MiB.) */
bool
kiln_gstrassen_shape (int64_t m, int64_t n, int64_t k)
{
    return m % (2 * MR) == 0 && n % (2 * NR) == 0 && k % 32 == 0
           && m >= 4 * MR && n >= 16 * NR && k >= 256 && k <= 512
           && m * k <= 128 * 512;
}

/* Floats of a worker's workspace: A's five sums (worker 0's, read by
 * all), B's five sums for one pair of column panels, the four tiles
 * being summed and 64 bytes to align them. */
int64_t
kiln_gstrassen_floats (int64_t m, int64_t k)
{
    return 5 * (m / 2) * (k / 2) + 5 * (k / 2) * NR + 4 * MR * NR + 16;
}

#if defined(__x86_64__)
typedef struct {
    const kiln_gemm_t *g;
    float *ws;
    size_t ws_stride;
} s_str_t;

/* dst = x + sign · y, n floats (a multiple of 16) */
__attribute__ ((target ("avx512f"))) static void
s_vsum (float *dst, const float *x, const float *y, int sign, int64_t n)
{
    for (int64_t q = 0; q < n; q += 16) {
        __m512 a = _mm512_loadu_ps (x + q), b = _mm512_loadu_ps (y + q);
        _mm512_storeu_ps (dst + q, sign < 0 ? _mm512_sub_ps (a, b) : _mm512_add_ps (a, b));
    }
}

/* Pair of column panels `task`: B's sums, then each group of MR rows
 * of the upper and lower halves. */
static void
s_strassen_task (void *arg, int task, int worker)
{
    const s_str_t *st = arg;
    const kiln_gemm_t *g = st->g;
    int64_t h = g->k / 2, mh = g->m / 2, np = g->n / NR / 2;
    const float *as = st->ws;                   /* worker 0's: A's sums */
    float *w = st->ws + (size_t) worker * st->ws_stride + 5 * mh * h;
    float *tb = w, *tl = w + 5 * h * NR;
    tl = (float *) (((uintptr_t) tl + 63) & ~(uintptr_t) 63);
    float *t11 = tl, *t12 = tl + MR * NR, *t21 = tl + 2 * MR * NR;
    float *t22 = tl + 3 * MR * NR;
    int64_t q = task;
    const float *b11 = g->b.p + q * g->k * NR, *b21 = b11 + h * NR;
    const float *b12 = g->b.p + (q + np) * g->k * NR, *b22 = b12 + h * NR;
    float *T1 = tb, *T3 = tb + h * NR, *T4 = tb + 2 * h * NR;
    float *T6 = tb + 3 * h * NR, *T7 = tb + 4 * h * NR;
    s_vsum (T1, b11, b22, 1, h * NR);
    s_vsum (T3, b12, b22, -1, h * NR);
    s_vsum (T4, b21, b11, -1, h * NR);
    s_vsum (T6, b11, b12, 1, h * NR);
    s_vsum (T7, b21, b22, 1, h * NR);
    const float *S1 = as, *S2 = as + mh * h, *S5 = as + 2 * mh * h;
    const float *S6 = as + 3 * mh * h, *S7 = as + 4 * mh * h;
    int64_t ars = g->a.rs;
    /* the next pair's two panels (2·k·NR floats, 2·h lines each half)
     * fetched by the products of the last two row groups, h lines each */
    int64_t groups = mh / MR, pf_first = (groups - 2) * 7;
    const char *nx0 = q + 1 < np ? (const char *) (b11 + g->k * NR) : NULL;
    const char *nx1 = q + 1 < np ? (const char *) (b12 + g->k * NR) : NULL;
    int64_t call = 0;
#define S_PF()                                                                  \
    (nx0 && call >= pf_first && call < pf_first + 8                             \
         ? (call - pf_first < 4 ? nx0 + (call - pf_first) * h * 64              \
                                : nx1 + (call - pf_first - 4) * h * 64)         \
         : NULL)
    for (int64_t i = 0; i < mh; i += MR) {
        const float *a11 = g->a.p + i * ars, *a22 = g->a.p + (mh + i) * ars + h;
        int64_t jl = q * NR, jr = (q + np) * NR;
        /* C11 = M1 + M4 - M5 + M7, C12 = M3 + M5, C21 = M2 + M4,
         * C22 = M1 - M2 + M3 + M6, in that order */
        kiln_gukr_avx512_s (h, S1 + i * h, h, T1, S_PF (), t11, NULL, g, false, 0, 0,
                        t22, 1, true);
        call++;
        kiln_gukr_avx512_s (h, S2 + i * h, h, b11, S_PF (), t21, NULL, g, false, 0, 0,
                        t22, -1, false);
        call++;
        kiln_gukr_avx512_s (h, a11, ars, T3, S_PF (), t12, NULL, g, false, 0, 0,
                        t22, 1, false);
        call++;
        kiln_gukr_avx512_s (h, a22, ars, T4, S_PF (), NULL, t21, g, true, mh + i, jl,
                        t11, 1, false);
        call++;
        kiln_gukr_avx512_s (h, S5 + i * h, h, b22, S_PF (), NULL, t12, g, true, i, jr,
                        t11, -1, false);
        call++;
        kiln_gukr_avx512_s (h, S6 + i * h, h, T6, S_PF (), NULL, t22, g, true, mh + i, jr,
                        NULL, 0, false);
        call++;
        kiln_gukr_avx512_s (h, S7 + i * h, h, T7, S_PF (), NULL, t11, g, true, i, jl,
                        NULL, 0, false);
        call++;
    }
#undef S_PF
}

/* A's sums into worker 0's workspace (read by every task), then the
 * pairs of column panels on the pool. */
void
kiln_gstrassen_run (const kiln_gemm_t *g, float *ws, size_t ws_stride)
{
    int64_t h = g->k / 2, mh = g->m / 2;
    const float *a = g->a.p;
    int64_t ars = g->a.rs;
    float *S1 = ws, *S2 = ws + mh * h, *S5 = ws + 2 * mh * h;
    float *S6 = ws + 3 * mh * h, *S7 = ws + 4 * mh * h;
    for (int64_t i = 0; i < mh; i++) {
        const float *a11 = a + i * ars, *a12 = a11 + h;
        const float *a21 = a + (mh + i) * ars, *a22 = a21 + h;
        s_vsum (S1 + i * h, a11, a22, 1, h);
        s_vsum (S2 + i * h, a21, a22, 1, h);
        s_vsum (S5 + i * h, a11, a12, 1, h);
        s_vsum (S6 + i * h, a21, a11, -1, h);
        s_vsum (S7 + i * h, a12, a22, -1, h);
    }
    s_str_t st = { g, ws, ws_stride };
    kiln_exec_parallel (s_strassen_task, &st, (int) (g->n / NR / 2));
}
#endif

bool
kiln_gemm_strassen (const kiln_gemm_t *g)
{
#if defined(__x86_64__)
    kiln_gisa_init ();
    return kiln_gemm_a_in_place (g) && g->b.kind == KILN_GSRC_PACKED && !g->b_half
           && kiln_gstrassen_shape (g->m, g->n, g->k) && kiln_gfinish_fast (g);
#else
    (void) g;
    return false;
#endif
}
