/*
 * testlib — helpers shared by the unit tests (tests/unit/test_*.c): a
 * per-test temporary directory with a signing key, deterministic random
 * numbers, building float32 graphs, compiling, signing and re-signing
 * artifacts, and running a Check suite.
 *
 * Every helper fails the current test (ck_assert) on an unexpected error
 * instead of returning it, so tests read as the behaviour they check.
 * The random numbers are one stream per process; a test's setup resets it
 * with testlib_seed, which makes each test (Check forks one process per
 * test) see the same numbers whatever ran before it.
 */
#ifndef KILN_TESTLIB_H
#define KILN_TESTLIB_H

#include <check.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_program.h"
#include "graph/kiln_graph.h"
#include "runtime/kiln_gemm.h"

/* --- temporary directories and keys --------------------------------- */

/* Make a fresh temporary directory whose name starts with `prefix`.  When
 * `keys` is not NULL it receives DIR/keys (PATH_MAX bytes); when `key_p`
 * is not NULL a new key pair is generated and written there, so that DIR/
 * keys is also a keyring that trusts it.  Caller owns the returned path
 * (free it with testlib_rmdir) and *key_p (kiln_key_destroy). */
char *testlib_keydir (const char *prefix, char *keys, kiln_key_t **key_p);

/* "DIR/NAME" in one of four buffers used in turn: valid until the fourth
 * call after this one. */
char *testlib_path (const char *dir, const char *name);

/* Remove the directory *dir_p and all it holds, free the path and set
 * *dir_p to NULL; nothing when it is already NULL. */
void testlib_rmdir (char **dir_p);

/* --- random numbers --------------------------------------------------- */

/* Restart the random stream at `seed`. */
void testlib_seed (unsigned seed);

/* Advance the random stream and return its new state (every bit usable). */
unsigned testlib_randu (void);

/* The next random float, uniform in [-1, 1). */
float testlib_randf (void);

/* `n` random floats from testlib_randf; caller frees the array. */
float *testlib_rand (int64_t n);

/* --- shapes and graphs ------------------------------------------------ */

/* A shape from `rank` dimensions. */
kiln_shape_t testlib_shape (const int64_t *dims, int rank);

/* SH (2, 3, 4): a shape from its dimensions (up to 8). */
#define SH(...) testlib_shape ((int64_t[]) { __VA_ARGS__ }, TESTLIB_NARGS (__VA_ARGS__))
#define TESTLIB_NARGS(...) TESTLIB_NARGS_ (__VA_ARGS__, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define TESTLIB_NARGS_(a, b, c, d, e, f, g, h, n, ...) n

/* The number of elements of `s`. */
int64_t testlib_numel (const kiln_shape_t *s);

/* A graph input of type `dt`; returns its tensor. */
int testlib_input_dt (kiln_graph_t *g, const char *name, kiln_dtype_t dt,
                      kiln_shape_t shape);

/* A float32 graph input; returns its tensor. */
int testlib_input (kiln_graph_t *g, const char *name, kiln_shape_t shape);

/* A float32 constant: random values times `scale`, plus `offset`. */
int testlib_const (kiln_graph_t *g, const char *name, kiln_shape_t shape,
                   float scale, float offset);

/* A float32 constant with random values in [-1, 1). */
int testlib_weight (kiln_graph_t *g, const char *name, kiln_shape_t shape);

/* A tensor whose type and shape the graph infers. */
int testlib_tensor (kiln_graph_t *g, const char *name);

/* n such tensors, named t0 .. t<n-1>, into t[]. */
void testlib_tensors (kiln_graph_t *g, int *t, int n);

/* A node with `n_in` inputs and the one output `out`; returns the node. */
int testlib_node (kiln_graph_t *g, const char *op, const char *name,
                  const int *ins, int n_in, int out);

/* Set the ints attribute `name` of node `n` to `count` values from `v`. */
void testlib_ints_ (kiln_graph_t *g, int n, const char *name, const int64_t *v,
                    int count);

/* testlib_ints (g, node, "pads", 4, 1, 1, 1, 1) */
#define testlib_ints(g, n, name, count, ...) \
    testlib_ints_ (g, n, name, (int64_t[]) { __VA_ARGS__ }, count)

/* Set the int attribute `name` of node `n`. */
void testlib_int (kiln_graph_t *g, int n, const char *name, int64_t v);

/* Set the float attribute `name` of node `n`. */
void testlib_float (kiln_graph_t *g, int n, const char *name, double v);

/* Make tensor `t` a graph output. */
void testlib_output (kiln_graph_t *g, int t);

/* --- artifacts -------------------------------------------------------- */

/* The decoded program of a compiled artifact; caller destroys it with
 * kiln_program_destroy. */
kiln_program_t *testlib_program_of (const kiln_artifact_t *art);

/* Sign *art_p with `key` and write it to `path`.  Takes ownership of the
 * artifact: destroys it and sets *art_p to NULL. */
void testlib_sign_write (kiln_artifact_t **art_p, const kiln_key_t *key,
                         const char *path);

/* Write to `path` a copy of `src` (manifest and weights) whose program is
 * `prog` [`len` bytes], signed with `key`; `src` stays the caller's. */
void testlib_resign (kiln_artifact_t *src, const uint8_t *prog, size_t len,
                     const kiln_key_t *key, const char *path);

/* Copy a tar archive entry by entry with libarchive's own pax writer,
 * records of 10240 bytes as tar writes them, each header first passed to
 * `edit` (may be NULL).  Caller frees the result (*out_len bytes). */
struct archive_entry;
uint8_t *testlib_tar_copy (const uint8_t *data, size_t len,
                           void (*edit) (struct archive_entry *), size_t *out_len);

/* --- running -------------------------------------------------------- */

/* Run every test of `suite` and return the process's exit status.  Takes
 * ownership of the suite. */
/* Run one matrix product `g` with a workspace of its own. */
void testlib_gemm (const kiln_gemm_t *g);

int testlib_run (Suite *suite);

/* testlib_run with TMPDIR set to a fresh directory that is removed
 * afterwards, so that a test that fails before its teardown leaves
 * nothing behind; `name` names the program in the prefix and errors. */
int testlib_run_in_tmpdir (Suite *suite, const char *name);

#endif
