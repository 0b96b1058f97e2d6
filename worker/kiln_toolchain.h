/*
 * kiln_toolchain — what a worker can compile with: the builtin compiler
 * (kiln-cc, in a child process) and external toolchains given on the
 * command line as `--toolchain NAME[@VERSION]=COMMAND`.
 *
 * A toolchain is named by three words, "ID VERSION TARGET" (see
 * kiln_toolchain_id_t): the builtin one is "kiln-builtin 0.1.0 cpu-x86_64";
 * an external one takes its id and version from the spec (version "0"
 * when left out) and the worker's target.  A job names the three words it
 * needs (they are part of its action key) and goes only to a worker that
 * offers them.
 *
 * An external COMMAND is split into words like a shell would split it
 * (single and double quotes, backslash), without any expansion, and run
 * directly (no shell: write `sh -c '...'` to get one).  In each word these
 * placeholders are replaced:
 *   {input}    the graph to compile, WORKDIR/model.kgraph (docs/graph-format.md)
 *   {output}   the file the toolchain must write, WORKDIR/toolchain.out
 *   {workdir}  the job's private directory (also the current directory)
 *   {args:ALLOWED}
 *              the job's compiler arguments, one word per argument (none
 *              if empty), each of which must be one the operator allows:
 *              ALLOWED is a comma-separated list of arguments ("-O1"), or
 *              of prefixes ending in '*' ("--level=*") that take a value of
 *              1..64 characters of [A-Za-z0-9._+-] (no '/', so no path).
 *              A job with any other argument is refused, naming it.  The
 *              placeholder must be a word of its own; plain "{args}" is
 *              the same with nothing allowed.  (A client chose these
 *              words: passed unchecked, `cp {input} {output} {args}` with
 *              "-t DIR" copied the client's graph where it chose.)
 * The command exits 0 on success; then the worker wraps {output} into an
 * unsigned kiln artifact: the manifest (graph digest, action key,
 * toolchain id, version, arguments and target, and the graph's inputs and
 * outputs) and one payload member, "toolchain.out", holding the file's
 * bytes.  The broker checks that artifact against the job and signs it
 * like any other.  The worker wraps outputs of up to
 * KILN_TOOLCHAIN_WRAP_INLINE bytes itself; a bigger one (or a graph that
 * does not declare the shapes of its inputs and outputs) is wrapped by a
 * second child, `kiln-worker --wrap ...`, so that it never stalls the
 * worker's loop.
 *
 * COMMAND "@noop" is a toolchain that does no work: the worker answers at
 * once, without a child process, with an artifact whose "toolchain.out"
 * is the graph's structure.  It exists to measure the farm's own
 * overhead (bench/bench_farm.py) and in tests.
 */
#ifndef KILN_TOOLCHAIN_H
#define KILN_TOOLCHAIN_H

#include <stdbool.h>

#include "common/kiln_error.h"
#include "common/kiln_proto.h"

#define KILN_TOOLCHAIN_MAX_WORDS   256       /* words of one command */
#define KILN_TOOLCHAIN_MAX_COMMAND 4096      /* bytes of one command */
#define KILN_TOOLCHAIN_MEMBER      "toolchain.out"
#define KILN_TOOLCHAIN_WRAP_INLINE (64u << 20)    /* outputs the worker wraps itself */

typedef struct kiln_toolchain {
    kiln_toolchain_id_t id;      /* what it is called on the wire */
    bool builtin;                /* kiln-cc; else `words` */
    bool noop;                   /* COMMAND "@noop": no work, no child (see below) */
    char **words;                /* the command split, owned; "{args:...}" as "{args}" */
    int n_words;
    char **allow;                /* the compiler arguments allowed, owned ("P*": a prefix) */
    int n_allow;
} kiln_toolchain_t;

#define KILN_TOOLCHAIN_MAX_ALLOW   64        /* entries in {args:...} */

/* Parse "NAME[@VERSION]=COMMAND" for a worker whose target is `target`.
 * Release *out with kiln_toolchain_release. */
int kiln_toolchain_parse_spec (const char *spec, const char *target,
                               kiln_toolchain_t *out, kiln_err_t *err);
/* The builtin compiler as a toolchain. */
void kiln_toolchain_builtin (kiln_toolchain_t *out);
void kiln_toolchain_release (kiln_toolchain_t *tc);

/* Split `command` into words (quotes and backslash as in sh, nothing
 * expanded).  Caller frees each word and the array. */
int kiln_toolchain_split (const char *command, char ***words, int *n,
                          kiln_err_t *err);

/* The argument vector for one job: the command's words with the
 * placeholders replaced.  NULL-terminated; caller frees each string and
 * the array (kiln_toolchain_argv_free).  KILN_EINVAL naming the argument
 * when `args` holds one that {args:...} does not allow. */
char **kiln_toolchain_argv (const kiln_toolchain_t *tc, const char *input,
                            const char *output, const char *workdir,
                            const char *args, kiln_err_t *err);
void kiln_toolchain_argv_free (char **argv);

/* Create the empty {output} file before the command runs, O_EXCL |
 * O_NOFOLLOW (a file or link already there is an error), mode 0644. */
int kiln_toolchain_create_output (const char *path, kiln_err_t *err);

/* Read the command's {output} (at most `max` bytes) as the worker does:
 * never through a symbolic link (O_NOFOLLOW), only a regular file with
 * one link (a hard link to a file the command could read but not write,
 * made in place of the output, is refused too), without blocking on a
 * FIFO.  *size (may be NULL) gets its size even when it is over `max`
 * (then KILN_ELIMIT).  Caller frees *data. */
int kiln_toolchain_read_output (const char *path, uint64_t max, uint8_t **data,
                                size_t *len, uint64_t *size, kiln_err_t *err);

/* What the wrapper needs to know about the job. */
typedef struct kiln_wrap_job {
    const char *graph;           /* WORKDIR/model.kgraph */
    const char *output;          /* the toolchain's output file */
    const char *kar;             /* where the unsigned artifact goes */
    const char *action_key;
    const char *graph_digest;
    const char *args;            /* normalised */
    kiln_toolchain_id_t toolchain;
} kiln_wrap_job_t;

/* Wrap the toolchain's output into an unsigned artifact (see above). */
int kiln_toolchain_wrap (const kiln_wrap_job_t *job, kiln_err_t *err);

/* The same in memory: the graph's interface from its encoded structure,
 * the output's bytes taken from *output (freed, NULLed, also on failure).
 * *kar gets the archive (caller frees).  KILN_EUNSUPPORTED when the
 * structure does not declare the shapes of the inputs and outputs (the
 * file-based wrapper infers them). */
int kiln_toolchain_wrap_mem (const kiln_wrap_job_t *job, const uint8_t *structure,
                             size_t struct_len, uint8_t **output, size_t len,
                             uint8_t **kar, size_t *kar_len, kiln_err_t *err);

/* `kiln-worker --wrap ...`: run the command after "--" (if any), then
 * wrap its output.  Exits with the command's status, or 125 when wrapping
 * fails (the reason on stderr, which is the job's log). */
int kiln_toolchain_wrap_main (int argc, char **argv);

#endif
