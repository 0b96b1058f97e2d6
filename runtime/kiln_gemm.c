/*
 * kiln_gemm — packed matrix products with fused epilogues: the choice of
 * micro-kernels for the CPU at hand, the blocking and the driver.  See
 * kiln_gemm.h for the contract, common/kiln_pack.h for the layouts and
 * kiln_gemm_priv.h for the pieces in the other kiln_gemm_*.c files.
 */
#include "runtime/kiln_gemm_priv.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/kiln_exec.h"

/* Blocking.  k runs in blocks of at most S_KC (the B block of a tile is
 * S_KC × S_NC floats, 256 KiB, in L2; an A panel, S_KC × MR, in L1).  A
 * block of A packed at run time holds at most S_MC rows. */
#define S_KC 256
#define S_NC 256
#define S_NC_FLOATS (128 * 1024)    /* but a B block packed here against a
                                       packed weight A, S_NC columns or as
                                       many more as a block of 512 KiB holds
                                       (s_nc) */
#define S_MC 256
#define S_A_FLOATS (128 * 1024)     /* an A block of a long k (s_kc) */
#define S_KC_LONG 512               /* and its k block at most: longer runs
                                       of sums in one accumulator lose
                                       accuracy (resnet50's error against
                                       torch: 4e-7 at 256, 5e-7 at 512,
                                       1.2e-6 unbounded) */
#define S_PART_FLOATS (256 * 1024)  /* partial sums of a transposed C */
#define S_TILES_PER_THREAD 4        /* tiles a product is cut into, at
                                       least, per thread (s_blocking) */
#define S_B_L1_FLOATS (8 * 1024)    /* a packed weight's k block of a tile's
                                       columns this small stays in L1 */
#define S_B_L2_FLOATS (256 * 1024)  /* and one this small in L2 */

/* The micro-kernels in use: the portable ones until s_isa_init picks
 * the CPU's (KILN_RT_ISA=avx2 or generic forces a narrower one). */
kiln_gisa_t kiln_gisa = {
    .ukr = kiln_gukr_generic,
    .ukr_7 = kiln_gukr_generic,
    .ukr_16 = kiln_gukr_generic_16,
    .panel_rows = kiln_gpanel_rows_c,
    .panel_cols = kiln_gpanel_cols_c,
    .name = "generic",
};
static pthread_once_t s_isa_once = PTHREAD_ONCE_INIT;

static void
s_isa_init (void)
{
#if defined(__x86_64__)
    const char *want = getenv ("KILN_RT_ISA");
    bool any = !want || !want[0];
    __builtin_cpu_init ();
    if ((any || strcmp (want, "avx512") == 0) && __builtin_cpu_supports ("avx512f")) {
        kiln_gisa.ukr = kiln_gukr_avx512;
        kiln_gisa.ukr_7 = kiln_gukr_avx512_7;
        kiln_gisa.ukr_16 = kiln_gukr_avx512_16;
        kiln_gisa.panel_rows = kiln_gpanel_rows_avx2;
        kiln_gisa.panel_cols = kiln_gpanel_cols_avx2;
        kiln_gisa.fin_avx512 = true;
        kiln_gisa.name = "avx512";
    } else if ((any || strcmp (want, "avx512") == 0 || strcmp (want, "avx2") == 0)
               && __builtin_cpu_supports ("avx2") && __builtin_cpu_supports ("fma")) {
        kiln_gisa.ukr = kiln_gukr_avx2;
        kiln_gisa.ukr_7 = kiln_gukr_avx2;
        kiln_gisa.ukr_16 = kiln_gukr_avx2_16;
        kiln_gisa.panel_rows = kiln_gpanel_rows_avx2;
        kiln_gisa.panel_cols = kiln_gpanel_cols_avx2;
        kiln_gisa.name = "avx2";
    }
#endif
}

void
kiln_gisa_init (void)
{
    pthread_once (&s_isa_once, s_isa_init);
}

void
kiln_gemm_ukr (int width, int64_t kc, const float *a, const float *b,
               int64_t ldb, float *c, int64_t ldc, bool accumulate,
               const void *pf, int64_t pf_n)
{
    pthread_once (&s_isa_once, s_isa_init);
#if defined(__x86_64__)
    if (pf && kiln_gisa.fin_avx512) {
        if (width == NR)
            kiln_gukr_avx512_xp (kc, a, 1, MR, b, ldb, c, ldc, accumulate, NULL, 0, 0,
                                 pf, pf_n);
        else
            kiln_gukr_avx512_16p (kc, a, b, ldb, c, ldc, accumulate, pf, pf_n);
        return;
    }
#endif
    (width == NR ? kiln_gisa.ukr : kiln_gisa.ukr_16) (kc, a, b, ldb, c, ldc, accumulate);
}

/* The packed-panel micro-kernel of `rows` (MR or 7) rows into c, or
 * (pf: AVX-512 only) its twin that also fetches pf_n lines from pf on
 * (the next weight panel). */
static void
s_ukr_rows (int64_t rows, int64_t kc, const float *a, const float *b, int64_t ldb,
            float *c, int64_t ldc, bool accumulate, const void *pf, int64_t pf_n)
{
#if defined(__x86_64__)
    if (pf && kiln_gisa.fin_avx512) {
        if (rows == MR)
            kiln_gukr_avx512_xp (kc, a, 1, MR, b, ldb, c, ldc, accumulate, NULL, 0, 0, pf,
                                 pf_n);
        else
            kiln_gukr_avx512_7p (kc, a, b, ldb, c, ldc, accumulate, pf, pf_n);
        return;
    }
#endif
    (rows == MR ? kiln_gisa.ukr : kiln_gisa.ukr_7) (kc, a, b, ldb, c, ldc, accumulate);
}

void
kiln_gemm_ukr_t (int rows, int64_t kc, const float *a, const float *b,
                 int64_t ldb, float *c, int64_t ldc, int64_t mr, int64_t nr,
                 bool accumulate, const void *pf, int64_t pf_n)
{
    pthread_once (&s_isa_once, s_isa_init);
    float tmp[MR * NR] __attribute__ ((aligned (64)));
    s_ukr_rows (rows, kc, a, b, ldb, tmp, NR, false, pf, pf_n);
    /* C'(r, q) at c[q·ldc + r]: the transposed finish, no epilogue */
    kiln_gemm_t g = { .m = mr, .n = nr, .c = c, .ldc = ldc, .c_trans = true,
                      .alpha = 1.0f, .act = KILN_ACT_NONE };
    kiln_gfinish (&g, tmp, 0, 0, mr, nr, accumulate, false);
}

/* The tile of kiln_gemm_taps (aoff: A where it lies, B a packed panel)
 * or kiln_gemm_taps_b (boff: B where it lies, A a packed panel) into
 * tmp: AVX-512 reads the operand where it lies; the other micro-kernels
 * read packed panels, S_KC steps at a time copied from where it lies
 * (no bounds to test: the copy is padded), the partial tiles added up
 * in tmp. */
static void
s_taps_tile (const float *a, const int64_t *aoff, int64_t ars, int64_t acs,
             const float *b, const int64_t *boff, int64_t bcs, int taps, int64_t cg,
             float *tmp)
{
    pthread_once (&s_isa_once, s_isa_init);
#if defined(__x86_64__)
    if (kiln_gisa.fin_avx512) {
        if (aoff)
            kiln_gukr_avx512_taps (a, aoff, taps, cg, ars, acs, b, tmp);
        else
            kiln_gukr_avx512_tapsb (a, b, boff, taps, cg, bcs, tmp);
        return;
    }
#endif
    float panel[S_KC * NR] __attribute__ ((aligned (64)));     /* A's or B's */
    int64_t k0 = 0, kc = 0;
    for (int t = 0; t < taps; t++) {
        const float *at = aoff ? a + aoff[t] : NULL, *bt = boff ? b + boff[t] : NULL;
        for (int64_t c = 0; c < cg; c++) {
            if (aoff && ars == 1)
                memcpy (panel + kc * MR, at + c * acs, MR * sizeof *panel);
            else if (aoff)
                for (int r = 0; r < MR; r++)
                    panel[kc * MR + r] = at[c * acs + r * ars];
            else
                memcpy (panel + kc * NR, bt + c * bcs, NR * sizeof *panel);
            if (++kc == S_KC || (t == taps - 1 && c == cg - 1)) {
                kiln_gisa.ukr (kc, aoff ? panel : a + k0 * MR,
                               boff ? panel : b + k0 * NR, NR, tmp, NR, k0 > 0);
                k0 += kc;
                kc = 0;
            }
        }
    }
}

void
kiln_gemm_taps (const kiln_gemm_t *g, const float *a, const int64_t *off, int taps,
                int64_t cg, int64_t ars, int64_t acs, const float *b, int64_t i,
                int64_t j, int64_t mr, int64_t nr)
{
    float tmp[MR * NR] __attribute__ ((aligned (64)));
    s_taps_tile (a, off, ars, acs, b, NULL, NR, taps, cg, tmp);
    kiln_gfinish (g, tmp, i, j, mr, nr, false, true);
}

void
kiln_gemm_taps_b (const kiln_gemm_t *g, const float *a, const float *b, const int64_t *off,
                  int taps, int64_t cg, int64_t bcs, int64_t i, int64_t mr, int64_t v0,
                  int64_t vw, int64_t ow, int64_t vn)
{
    /* (NR floats past the tile: a run's finish reads whole rows from
     * its first column on) */
    float tmp[MR * NR + NR] __attribute__ ((aligned (64)));
    s_taps_tile (a, NULL, 1, MR, b, off, bcs, taps, cg, tmp);
    /* the outputs among the tile's positions: runs of one row each */
    for (int64_t q = 0; q < NR && v0 + q < vn;) {
        int64_t row = (v0 + q) / vw, col = (v0 + q) % vw;
        if (col >= ow) {
            q += vw - col;
            continue;
        }
        int64_t len = s_min (ow - col, NR - q);
#if defined(__x86_64__)
        /* on AVX-512 the epilogue in registers, under masks */
        if (kiln_gisa.fin_avx512 && mr == MR && !g->c_trans && kiln_gfinish_fast (g)) {
            kiln_gfinish_x (g, tmp + q, i, row * ow + col, len);
            q += len;
            continue;
        }
#endif
        kiln_gfinish (g, tmp + q, i, row * ow + col, mr, len, false, true);
        q += len;
    }
}

const char *
kiln_gemm_isa (void)
{
    pthread_once (&s_isa_once, s_isa_init);
    return kiln_gisa.name;
}

bool
kiln_gemm_avx512 (void)
{
    return strcmp (kiln_gemm_isa (), "avx512") == 0;
}

/* --- driver ---------------------------------------------------------- */

typedef struct {
    int64_t kc, nkb;        /* k block, number of k blocks */
    int64_t mc, nc;         /* rows and columns of a tile */
    int64_t tm, tn;         /* tiles along m and n */
    int64_t rp;             /* rows of an A panel packed here: MR or 7 */
} s_block_t;

/* The k block: at most S_KC; but when B is a pre-packed weight and A is
 * packed here, as long as the A block (every row of the product, at most
 * S_A_FLOATS) stays in L2: each block past the first adds the partial
 * tile to C again (a transpose more when C is written transposed).  A
 * function of the product's shape only, never of the thread count: the
 * blocks fix the order of the sums. */
static int64_t
s_kc (int64_t m, int64_t k, bool a_packed, bool b_packed, int64_t *nkb)
{
    *nkb = (k + S_KC - 1) / S_KC;
    if (b_packed && !a_packed && *nkb > 1) {
        int64_t rows = s_min (s_round_up (m, MR), S_MC);
        int64_t fit = s_min (S_A_FLOATS / rows, S_KC_LONG);
        *nkb = (k + fit - 1) / fit;
    }
    return *nkb ? (k + *nkb - 1) / *nkb : 0;
}

/* Columns of a tile at most.  A B packed here against a packed weight A
 * (a pointwise convolution's activations, the taps of a convolution)
 * takes S_NC_FLOATS in L2 when k is short: the tile's rows of C and of a
 * residual then run on over a row of the plane, instead of 1 KiB of each
 * of its rows a tile (resnet50's 1×1 64 → 256 at 56 × 56 with its
 * residual, 3136 positions a row: 0.86 of the time with tiles of 2048
 * columns; densenet121's 1×1 at 56 × 56 0.92; sums unchanged). */
static int64_t
s_nc (int64_t kc, bool a_packed, bool b_packed)
{
    if (!a_packed || b_packed || kc == 0)
        return S_NC;
    int64_t wide = S_NC_FLOATS / kc / NR * NR;
    return wide > S_NC ? wide : S_NC;
}

/* Floats of the partial sums of a product written transposed over
 * several k blocks: its tiles are added up untransposed here, every row
 * and column of a tile (and MR rows of slack for the micro-kernel's
 * whole panels), and transposed once, with the last block.  0 when the
 * product has one k block, or when that would take more than
 * S_PART_FLOATS (the tiles are then added up in C, a transpose each). */
static int64_t
s_part_floats (int64_t m, int64_t n, int64_t k, bool a_packed, bool b_packed)
{
    int64_t nkb;
    s_kc (m, k, a_packed, b_packed, &nkb);
    if (a_packed || !b_packed || nkb < 2)
        return 0;
    int64_t f = (s_min (s_round_up (m, MR), S_MC) + MR) * s_round_up (n, NR);
    return f <= S_PART_FLOATS ? f : 0;
}

/* Floats of the A block packed here (panels of 7 rows take the room of 8). */
static int64_t
s_ablock_floats (int64_t m, int64_t kc)
{
    return kc * ((s_min (s_round_up (m, MR), S_MC) + 6) / 7 * MR);
}

static int64_t
s_max64 (int64_t a, int64_t b)
{
    return a > b ? a : b;
}

size_t
kiln_gemm_ws_bytes (int64_t m, int64_t n, int64_t k, bool a_packed,
                    bool b_packed)
{
    int64_t nkb, kc = s_kc (m, k, a_packed, b_packed, &nkb);
    int64_t floats = MR * NR;                           /* an edge tile */
    if (!b_packed)
        floats += kc * s_min (s_round_up (n, NR), s_nc (kc, a_packed, b_packed));
    else    /* a half B widened: one panel, or the block (s_tile) */
        floats += kc * (a_packed ? s_min (s_round_up (n, NR), S_NC) : NR);
    if (!a_packed)
        floats += s_ablock_floats (m, kc);
    floats += s_part_floats (m, n, k, a_packed, b_packed);
    if (!a_packed && b_packed && kiln_gstrassen_shape (m, n, k))
        floats = s_max64 (floats, kiln_gstrassen_floats (m, k));
    return (size_t) floats * sizeof (float) + 64;
}

/* One product in one tile (an A packed here against a packed weight B:
 * a convolution's small output plane, run transposed) cut for `threads`
 * into r row tiles by c column tiles, r · c = threads: each row tile
 * streams the weight's columns of its tile (from memory: a 3×3
 * convolution's weights at 7×7 are 9.4 MB), each column tile packs its
 * rows of A again (a convolution's taps gathered, about six times the
 * cost of streaming a weight float; a plain matrix's rows 1.5).  The
 * split that streams and packs least per tile: a 3×3 512 → 512 at 7×7,
 * 2 threads, by columns (1.02 ms against 1.12 by rows and 1.52 for the
 * eight tiles cut before, 1.78 on one thread); a stride-2 3×3 to 14×14
 * by rows (0.97 against 1.16 and 1.22). */
static void
s_split_one (const kiln_gemm_t *g, int threads, s_block_t *bl)
{
    double gather = g->a.kind == KILN_GSRC_CONV ? 6.0 : 1.5, best = -1.0;
    int64_t mc = bl->mc, nc = bl->nc;
    for (int c = 1; c <= threads; c++) {
        if (threads % c != 0)
            continue;
        int64_t r = threads / c;
        int64_t mr = s_round_up ((g->m + r - 1) / r, bl->rp);
        int64_t nr = s_round_up ((g->n + c - 1) / c, NR);
        double cost = (double) nr + gather * (double) mr;
        if (best < 0.0 || cost < best) {
            best = cost;
            mc = mr;
            nc = nr;
        }
    }
    bl->mc = mc;
    bl->nc = nc;
}

static void
s_blocking (const kiln_gemm_t *g, int64_t count, int threads, s_block_t *bl)
{
    bool a_packed = g->a.kind == KILN_GSRC_PACKED;
    bool b_packed = g->b.kind == KILN_GSRC_PACKED;
    bl->kc = s_kc (g->m, g->k, a_packed, b_packed, &bl->nkb);
    /* An A packed here may come in panels of 7 rows, which the 7-row
     * micro-kernel runs at the rate of 8: when that computes fewer rows
     * (49 = 7 · 7 rows, not 56). */
    bool seven = s_round_up (g->m, 7) < s_round_up (g->m, MR);
    bl->rp = !a_packed && seven ? 7 : MR;
    /* Rows that AVX-512 reads where they lie (kiln_gukr_avx512_x:
     * nothing packed, the epilogue in registers) are not packed into
     * those panels (packing them cost more than the 56 rows computed for
     * 49: a channels-last 1×1 convolution on a 7 × 7 plane took 0.87-0.93
     * of the time in place, on a 14 × 14 one 0.64-0.78, mobilenet_v2).
     * Against a packed weight they run in panels of 7 read in place
     * instead (kiln_gukr_avx512_x7) when those cover fewer rows: 49 × 960
     * → 320 0.845 of the time, 98 rows 0.92, 147 0.946 (one product,
     * paired); mobilenet_v2 0.958, mobilenet_v3_large 0.968,
     * efficientnet_b0 0.960, convnext_tiny 0.979 at 1 thread (0.964,
     * 0.973, 0.964, 0.954 at 2), paired in one process.  Else panels of
     * MR. */
    if (kiln_gemm_a_in_place (g))
        bl->rp = b_packed && seven ? 7 : MR;
    bl->mc = a_packed ? s_round_up (g->m, MR)
                      : s_min (s_round_up (g->m, bl->rp), S_MC / bl->rp * bl->rp);
    /* A packed weight B needs no block of its own: a tile then spans
     * every column, so that its A block is packed once (s_tile). */
    bl->nc = b_packed && !a_packed ? s_round_up (g->n, NR)
                                   : s_min (s_round_up (g->n, NR),
                                            s_nc (bl->kc, a_packed, b_packed));
    if (bl->mc < bl->rp)
        bl->mc = bl->rp;
    if (bl->nc < NR)
        bl->nc = NR;
    /* With several threads, cut finer until there are a few tiles per
     * thread, along the side whose cut packs nothing twice: columns
     * first when B is packed here (each tile then packs its own B block
     * once, where cutting the rows would have every row tile pack the
     * same B), rows first when A is packed here against a packed weight
     * B (each column tile would pack the whole A again: a 14 × 14
     * pointwise convolution with 1024 channels in, run transposed, packed
     * its 800 KB of activations eight times and gained nothing from a
     * second thread).  One product in one tile with A packed here is cut
     * by s_split_one instead. */
    bool rows_first = b_packed && !a_packed;
    if (threads > 1 && rows_first && count == 1 && g->m <= bl->mc && g->n <= bl->nc) {
        s_split_one (g, threads, bl);
        /* Rows of A read where they lie (kiln_gemm_a_in_place) pack
         * nothing per tile: their column tiles are cut on until each
         * thread has S_TILES_PER_THREAD, so that a thread slowed by its
         * host hands its last tiles to the other (kiln_exec_parallel).  A
         * transformer's products at 2 threads, paired run by run in one
         * process: vit_b_16 0.973 and BERT-base 0.962 of the time (median
         * ratio) while the host was slow, 0.997 and 0.996 while quiet. */
        while (kiln_gemm_a_in_place (g) && bl->nc >= 4 * NR
               && ((g->m + bl->mc - 1) / bl->mc) * ((g->n + bl->nc - 1) / bl->nc)
                      < S_TILES_PER_THREAD * threads)
            bl->nc = s_round_up (bl->nc / 2, NR);
    } else if (threads > 1) {
        int64_t want = S_TILES_PER_THREAD * (int64_t) threads;
        for (;;) {
            int64_t tiles = count * ((g->m + bl->mc - 1) / bl->mc)
                            * ((g->n + bl->nc - 1) / bl->nc);
            if (tiles >= want)
                break;
            bool cut_n = bl->nc > NR && (g->n + bl->nc / 2 - 1) / (bl->nc / 2)
                                            > (g->n + bl->nc - 1) / bl->nc;
            bool cut_m = bl->mc > 4 * MR;
            if (cut_n && !(rows_first && cut_m))
                bl->nc = s_round_up (bl->nc / 2, NR);
            else if (cut_m)
                bl->mc = s_round_up (bl->mc / 2, a_packed ? MR : bl->rp);
            else
                break;
        }
    }
    bl->tm = g->m ? (g->m + bl->mc - 1) / bl->mc : 0;
    bl->tn = g->n ? (g->n + bl->nc - 1) / bl->nc : 0;
}

/* One micro-tile: the micro-kernel writes C itself while the tile is a
 * partial sum (or needs no epilogue), else it goes through kiln_gfinish.
 * With `x` (AVX-512, C not transposed) it is kiln_gukr_avx512_x (or _x7
 * for a whole panel of 7 rows read in place), whose A (row r, step kk at
 * a[r·ars + kk·acs]) may be a packed panel or the rows themselves, and
 * which applies the epilogue itself when `xepi`. */
static inline void
s_micro (const kiln_gemm_t *g, int64_t rp, int64_t kc,
         const float *a, const float *b, int64_t i, int64_t j, bool acc,
         bool last, bool plain, float *tmp, float *part, int64_t ldp,
         bool x, bool xepi, int64_t ars, int64_t acs, const char *pf,
         int64_t pf_n)
{
    int64_t mr = s_min (rp, g->m - i), nr = s_min (NR, g->n - j);
#if defined(__x86_64__)
    if (x) {
        /* C written by the tile itself (all its rows) */
        if (mr == rp && (!last || plain || xepi)) {
            const kiln_gemm_t *epi = last && !plain ? g : NULL;
            float *c = g->c + i * g->ldc + j;
            if (rp < MR)
                kiln_gukr_avx512_x7 (kc, a, ars, acs, b, c, g->ldc, acc, epi, i, j, nr, pf,
                                     pf_n);
            else if (nr < NR)    /* the last column panel of a product ending there */
                kiln_gukr_avx512_xm (kc, a, ars, acs, b, c, g->ldc, acc, epi, i, j, nr);
            else if (pf)
                kiln_gukr_avx512_xp (kc, a, ars, acs, b, NR, c, g->ldc, acc, epi, i, j, pf,
                                     pf_n);
            else
                kiln_gukr_avx512_x (kc, a, ars, acs, b, NR, c, g->ldc, acc, epi, i, j);
            return;
        }
        kiln_gukr_avx512_x (kc, a, ars, acs, b, NR, tmp, NR, false, NULL, 0, 0);
        kiln_gfinish (g, tmp, i, j, mr, nr, acc, last);
        return;
    }
#endif
    if (part && !last) {
        /* a partial sum of a transposed C: added up as it is */
        s_ukr_rows (rp, kc, a, b, NR, part, ldp, acc, pf, pf_n);
        return;
    }
    if (part) {
        s_ukr_rows (rp, kc, a, b, NR, tmp, NR, false, pf, pf_n);
        for (int r = 0; r < MR; r++)
            for (int q = 0; q < NR; q++)
                tmp[r * NR + q] = tmp[r * NR + q] + part[r * ldp + q];
        kiln_gfinish (g, tmp, i, j, mr, nr, false, true);
        return;
    }
    if ((!last || plain) && !g->c_trans && mr == MR && nr == NR) {
        s_ukr_rows (rp, kc, a, b, NR, g->c + i * g->ldc + j, g->ldc, acc, pf, pf_n);
        return;
    }
    s_ukr_rows (rp, kc, a, b, NR, tmp, NR, false, pf, pf_n);
    kiln_gfinish (g, tmp, i, j, mr, nr, acc, last);
}


static void
s_tile (const kiln_gemm_t *g, const s_block_t *bl, int64_t m0, int64_t m1,
        int64_t n0, int64_t n1, float *ws)
{
    /* rows of an A panel: a pre-packed A has MR, one packed here rp */
    int64_t rp = g->a.kind == KILN_GSRC_PACKED ? MR : bl->rp;
    bool b_half = g->b.kind == KILN_GSRC_PACKED && g->b_half;
    float *tmp = ws;                                    /* MR × NR */
    float *bws = tmp + MR * NR;
    float *aws = bws + (g->b.kind != KILN_GSRC_PACKED ? bl->kc * bl->nc
                        : !b_half ? 0
                        : bl->kc * (g->a.kind == KILN_GSRC_PACKED ? bl->nc : NR));
    /* a transposed C over several k blocks: partial sums (tile rows
     * ldp = nc apart) next to the A block */
    bool a_packed = g->a.kind == KILN_GSRC_PACKED;
    float *part = g->c_trans && s_part_floats (g->m, g->n, g->k, a_packed,
                                               g->b.kind == KILN_GSRC_PACKED)
                  ? aws + (a_packed ? 0 : s_ablock_floats (g->m, bl->kc)) : NULL;
    int64_t ldp = bl->nc;
    if (bl->nkb == 0) {
        /* k = 0: the epilogue of zeros */
        memset (tmp, 0, MR * NR * sizeof *tmp);
        for (int64_t i = m0; i < m1; i += rp)
            for (int64_t j = n0; j < n1; j += NR)
                kiln_gfinish (g, tmp, i, j, s_min (rp, m1 - i), s_min (NR, n1 - j),
                          false, true);
        return;
    }
    bool plain = !g->c_trans && g->alpha == 1.0f && g->n_add == 0
                 && g->act == KILN_ACT_NONE;
    /* A pre-packed B (a weight) with an A packed here: the A block (at
     * most S_MC × S_KC) stays in L2 while the B panels stream past it,
     * each used by every row panel before the next.  Otherwise the B
     * block packed here stays in L2 and each A panel in L1. */
    bool j_outer = g->b.kind == KILN_GSRC_PACKED && g->a.kind != KILN_GSRC_PACKED;
    /* AVX-512 and C not transposed: the tiles run on kiln_gukr_avx512_x,
     * which applies the epilogue itself when kiln_gfinish_avx512 could, and
     * reads the rows of an A laid along k (a MatMul's activations) where
     * they lie: only a last panel of fewer than MR rows is packed. */
    bool x = kiln_gisa.fin_avx512 && !g->c_trans
             && (rp == MR || (rp == 7 && kiln_gemm_a_in_place (g)));
    bool xepi = x && kiln_gfinish_fast (g);
    bool direct = x && kiln_gemm_a_in_place (g);
    int64_t m_full = m0 + (m1 - m0) / rp * rp;  /* rows read where they lie */
    /* A B of rows along k (a pointwise convolution's X, a MatMul's
     * activations) that the row panels share: the first, a whole panel
     * of MR rows, reads B's whole column panels where they lie and stores
     * them packed (its prologue applied) for the others
     * (kiln_gukr_avx512_xpk), instead of a packing pass over the block
     * before any product; pointwise convolutions with few output
     * channels spent up to a fifth of their time in that pass.  The same
     * values in the same order as packing first. */
    bool fuse = x && !j_outer && !b_half && g->b.kind == KILN_GSRC_STRIDED
                && g->b.cs == 1 && m1 - m0 >= MR;
    for (int64_t kb = 0; kb < bl->nkb; kb++) {
        int64_t k0 = kb * bl->kc, kc = s_min (bl->kc, g->k - k0);
        bool last = kb == bl->nkb - 1, acc = kb > 0;
        const float *bp, *ap;
        int64_t bstride, astride;
        bool packing = false;       /* the first row panel packs B */
        kiln_gpro_t pro_k = { g->b_pro.s ? g->b_pro.s + k0 : NULL,
                              g->b_pro.s ? g->b_pro.b + k0 : NULL, g->b_pro.relu };
        if (b_half) {
            /* widened into the workspace: the panel of each j in turn
             * (j_outer), else the tile's whole block now */
            bp = bws;
            bstride = kc * NR;
            for (int64_t j = n0; !j_outer && j < n1; j += NR)
                kiln_gwiden_panel (g, j, k0, kc, bws + (j - n0) / NR * bstride);
        } else if (g->b.kind == KILN_GSRC_PACKED) {
            bp = g->b.p + (n0 / NR) * g->k * NR + k0 * NR;
            bstride = g->k * NR;
        } else if (fuse && (!last || plain || xepi)) {
            /* the first row panel packs the whole panels as it goes
             * (below): only a last panel of fewer columns is packed now */
            int64_t whole = n0 + (n1 - n0) / NR * NR;
            if (whole < n1)
                kiln_gpack_b_strided (&g->b, &g->b_pro, k0, kc, whole, n1 - whole,
                                      bws + (whole - n0) / NR * kc * NR);
            bp = bws;
            bstride = kc * NR;
            packing = true;
        } else {
            if (g->b.kind == KILN_GSRC_CONV)
                kiln_gpack_conv (&g->b, k0, kc, n0, n1 - n0, bws, NR, NR);
            else
                kiln_gpack_b_strided (&g->b, &g->b_pro, k0, kc, n0, n1 - n0, bws);
            bp = bws;
            bstride = kc * NR;
        }
        if (g->a.kind == KILN_GSRC_PACKED) {
            ap = g->a.p + (m0 / MR) * g->k * MR + k0 * MR;
            astride = g->k * MR;
        } else if (direct) {
            if (m_full < m1)
                kiln_gpack_a_strided (&g->a, &g->a_pro, m_full, m1 - m_full, k0, kc, aws, MR);
            ap = aws;
            astride = 0;
        } else {
            if (g->a.kind == KILN_GSRC_CONV)
                kiln_gpack_conv (&g->a, k0, kc, m0, m1 - m0, aws, MR, rp);
            else
                kiln_gpack_a_strided (&g->a, &g->a_pro, m0, m1 - m0, k0, kc, aws, rp);
            ap = aws;
            astride = kc * MR;
        }
        /* A of row panel i: its rows (ars apart) or its packed panel */
#define S_A_OF(i)                                                             \
    const float *ai = ap + ((i) - m0) / rp * astride;                         \
    int64_t ars = 1, acs = MR;                                                \
    if (direct && (i) < m_full) {                                             \
        ai = g->a.p + (i) * g->a.rs + k0;                                     \
        ars = g->a.rs;                                                        \
        acs = 1;                                                              \
    }
        /* With a weight B whose block of the tile's columns is whole in
         * L1 (a channels-last pointwise convolution of few channels: 16 ->
         * 64 is 4 KiB) the row panels go outermost too (below), each
         * writing its rows of C whole before the next, instead of a
         * column panel of every row at a time (mobilenet_v2 0.984 of the
         * time at 1 thread and 0.981 at 2, mobilenet_v3_large 0.990 and
         * 0.983, paired run by run; 4 to 16 K floats alike, all the
         * weight 1.013).  So too when A's rows, read where they lie, run
         * over several row blocks and the weight's block stays in L2
         * while every row panel reads it: convnext_tiny's first stage
         * (3136 rows, 96 -> 384 and 384 -> 96) took 0.89 of the time
         * that way, its second (784 rows, 192 -> 768, 576 KiB of
         * weight) 0.925 at 1 thread and 0.919 at 2, the model 0.967
         * with the first stage's alone (paired in one process; not
         * measured again with both, the host too noisy then); 1024 ->
         * 512 -> 1024 at 1024 rows (2 MiB of weight) 1.18, so not past
         * 1 MiB.  A transformer's products (128 or 197 rows, one block)
         * and mobilenet_v2's at 14 × 14 (196 rows) are left as they
         * were, the latter 1.014 of the time turned. */
        bool b_in_l2 = direct && g->m > bl->mc && kc * (n1 - n0) <= S_B_L2_FLOATS;
        if (j_outer && (part || b_half || (kc * (n1 - n0) > S_B_L1_FLOATS && !b_in_l2))) {
            /* (in order: a 7-row panel's zero eighth row lands in the
             * partial sums of the next panel before it writes them) */
            /* A weight streamed from memory would stall the first row
             * panel of each column panel: the row panels of each column
             * panel fetch the next one (or the first of the next k
             * block), each its share of the lines, spread over its steps
             * of k, so that it is in cache when its turn comes. */
            int64_t panels = (m1 - m0 + rp - 1) / rp;
            bool pf_on = kiln_gisa.fin_avx512 && g->b.kind == KILN_GSRC_PACKED && !b_half;
            for (int64_t j = n0; j < n1; j += NR) {
                const float *bj = bp + (j - n0) / NR * bstride;
                if (b_half) {
                    kiln_gwiden_panel (g, j, k0, kc, bws);
                    bj = bws;
                }
                const char *next = NULL;
                int64_t lines = 0;      /* of the next panel: NR floats a step */
                if (pf_on && j + NR < n1) {
                    next = (const char *) (bp + (j + NR - n0) / NR * bstride);
                    lines = kc * NR * (int64_t) sizeof (float) / 64;
                } else if (pf_on && !last) {
                    next = (const char *) (g->b.p + (n0 / NR) * g->k * NR
                                           + (k0 + kc) * NR);
                    lines = s_min (bl->kc, g->k - k0 - kc) * NR * (int64_t) sizeof (float) / 64;
                }
                int64_t share = (lines + panels - 1) / panels;
                for (int64_t i = m0; i < m1; i += rp) {
                    S_A_OF (i);
                    int64_t first = (i - m0) / rp * share;
                    const char *pf = next && first < lines ? next + first * 64 : NULL;
                    int64_t pf_n = pf ? s_min (share, lines - first) : 0;
                    s_micro (g, rp, kc, ai, bj, i, j, acc, last, plain, tmp,
                             part ? part + (i - m0) * ldp + (j - n0) : NULL, ldp, x,
                             xepi, ars, acs, pf, pf_n);
                }
            }
        } else {
            for (int64_t i = m0; i < m1; i += rp) {
                S_A_OF (i);
                for (int64_t j = n0; j < n1; j += NR) {
#if defined(__x86_64__)
                    if (packing && i == m0 && j + NR <= n1) {
                        kiln_gukr_avx512_xpk (kc, ai, ars, acs, g->b.p + k0 * g->b.rs + j,
                                              g->b.rs, g->c + i * g->ldc + j, g->ldc, acc,
                                              last && !plain ? g : NULL, i, j,
                                              bws + (j - n0) / NR * bstride,
                                              g->b_pro.s ? &pro_k : NULL);
                        continue;
                    }
#endif
                    s_micro (g, rp, kc, ai, bp + (j - n0) / NR * bstride, i, j, acc,
                             last, plain, tmp, NULL, 0, x, xepi, ars, acs, NULL, 0);
                }
            }
        }
#undef S_A_OF
    }
}

typedef struct {
    kiln_gemm_get_fn *get;
    const void *ctx;
    s_block_t bl;
    int64_t first;          /* task 0 of this section */
    float *ws;
    size_t ws_stride;       /* floats per worker */
} s_run_t;

static void
s_task (void *arg, int task, int worker)
{
    const s_run_t *r = arg;
    int64_t t = r->first + task, per = r->bl.tm * r->bl.tn;
    kiln_gemm_t g;
    r->get (r->ctx, t / per, &g);
    t %= per;
    int64_t m0 = t / r->bl.tn * r->bl.mc, n0 = t % r->bl.tn * r->bl.nc;
    s_tile (&g, &r->bl, m0, s_min (g.m, m0 + r->bl.mc), n0,
            s_min (g.n, n0 + r->bl.nc), r->ws + (size_t) worker * r->ws_stride);
}


/* --- one row against a packed weight ------------------------------- */

/* A single row of A against a packed float weight B (a batch-1
 * classifier; a squeeze-and-excitation's small convolutions, run
 * transposed: one position, C written as a column): the tiles
 * would compute 7 rows of zeros for each real one, and B, read once, is
 * the whole cost.  Tasks of KILN_GGEMV_PANELS column panels, streamed side
 * by side from memory; each panel's k sum in one run, so the results do
 * not depend on the thread count either. */
static bool
s_gemv (const kiln_gemm_t *g)
{
    return kiln_gisa.fin_avx512 && g->m == 1 && g->k > 0
           && g->a.kind == KILN_GSRC_STRIDED && !g->a_pro.s
           && g->b.kind == KILN_GSRC_PACKED && !g->b_half;
}

static void
s_gemv_task (void *arg, int task, int worker)
{
    (void) worker;
#if defined(__x86_64__)
    const kiln_gemm_t *g = arg;
    int64_t panels = (g->n + NR - 1) / NR, p0 = (int64_t) task * KILN_GGEMV_PANELS;
    int np = (int) s_min (KILN_GGEMV_PANELS, panels - p0);
    float out[KILN_GGEMV_PANELS * NR];
    float tile[MR * NR] __attribute__ ((aligned (64)));
    kiln_ggemv_avx512 (g->k, g->a.p, g->a.cs, g->b.p + p0 * g->k * NR, np, out);
    for (int q = 0; q < np; q++) {
        int64_t j = (p0 + q) * NR;
        memcpy (tile, out + q * NR, NR * sizeof *tile);
        kiln_gfinish (g, tile, 0, j, 1, s_min (NR, g->n - j), false, true);
    }
#else
    (void) arg, (void) task;
#endif
}

void
kiln_gemm_here (const kiln_gemm_t *g, float *ws)
{
    pthread_once (&s_isa_once, s_isa_init);
    if (g->m == 0 || g->n == 0)
        return;
    s_block_t bl;
    s_blocking (g, 1, 1, &bl);
    for (int64_t m0 = 0; m0 < g->m; m0 += bl.mc)
        for (int64_t n0 = 0; n0 < g->n; n0 += bl.nc)
            s_tile (g, &bl, m0, s_min (g->m, m0 + bl.mc), n0, s_min (g->n, n0 + bl.nc), ws);
}

void
kiln_gemm_run (kiln_gemm_get_fn *get, const void *ctx, int64_t count)
{
    pthread_once (&s_isa_once, s_isa_init);
    if (count <= 0)
        return;
    kiln_gemm_t g;
    get (ctx, 0, &g);
    if (g.m == 0 || g.n == 0)
        return;
    if (count == 1 && s_gemv (&g)) {
        int64_t panels = (g.n + NR - 1) / NR;
        kiln_exec_parallel (s_gemv_task, &g,
                            (int) ((panels + KILN_GGEMV_PANELS - 1) / KILN_GGEMV_PANELS));
        return;
    }
    s_run_t r = { .get = get, .ctx = ctx };
    s_blocking (&g, count, kiln_exec_threads (), &r.bl);
    size_t bytes;
    float *ws = kiln_exec_ws (&bytes);
    r.ws = (float *) (((uintptr_t) ws + 63) & ~(uintptr_t) 63);
    r.ws_stride = bytes / sizeof (float);
#if defined(__x86_64__)
    if (count == 1 && kiln_gemm_strassen (&g)) {
        kiln_gstrassen_run (&g, r.ws, r.ws_stride);
        return;
    }
#endif
    int64_t total = count * r.bl.tm * r.bl.tn;
    for (int64_t first = 0; first < total; first += 1 << 30) {
        r.first = first;
        kiln_exec_parallel (s_task, &r, (int) s_min (total - first, 1 << 30));
    }
}
