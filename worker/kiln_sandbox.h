/*
 * kiln_sandbox — how a worker runs a compile: inside a bubblewrap sandbox
 * (`--sandbox bwrap`, the default) or as a plain child (`--sandbox none`),
 * under resource limits either way.  docs/security.md, "Compile sandbox",
 * says what it stops and why.
 *
 * The child (after fork, in kiln_sandbox_exec) sets RLIMIT_AS (the
 * worker's --max-memory), RLIMIT_CPU (the job's timeout times the CPUs
 * online: a compile cannot burn more than the whole host for its whole
 * timeout), RLIMIT_FSIZE (KILN_MAX_COMPILE_FILE_BYTES) and RLIMIT_CORE 0,
 * then runs, with `bwrap`:
 *
 *   bwrap --ro-bind / / --dev /dev --proc /proc
 *         --size KILN_MAX_COMPILE_TMP_BYTES --perms 1777 --tmpfs /tmp
 *         --perms 0755 --size 65536 --tmpfs HIDDEN ...   (see below)
 *         --ro-bind FILE FILE ...                          (see below)
 *         --bind WORKDIR WORKDIR  --remount-ro HIDDEN ...
 *         --unshare-ipc --unshare-pid --unshare-net --unshare-uts
 *         --unshare-cgroup-try  [--unshare-user --disable-userns]
 *         --die-with-parent --new-session --cap-drop ALL
 *         [--cap-add CAP_SETUID --cap-add CAP_SETGID]
 *         --clearenv --setenv PATH .. --setenv HOME WORKDIR --setenv TMPDIR /tmp
 *         --chdir /
 *         -- kiln-worker --sandbox-exec --chdir WORKDIR --procs N [--uid U]
 *            -- COMMAND...
 *
 * HIDDEN are the directories the compile must not see, each covered by
 * an empty read-only tmpfs: the parent of the job directories (the other
 * jobs), the blob cache (other clients' weights) and the directory of the
 * worker's certificate (its secret key).  Each FILE is bound read-only on
 * top, so that it runs even from under /tmp: this program (for
 * --sandbox-exec and --wrap), the builtin compiler, and the files that a
 * toolchain's COMMAND (as the operator wrote it, never the job's
 * arguments) names by absolute path; files, not their directories, and
 * none that lies in a hidden directory.
 *
 * Processes: `--sandbox-exec` (this program, inside the sandbox) sets
 * RLIMIT_NPROC to --max-procs just before it runs COMMAND.  The kernel
 * counts that limit per user and user namespace, never for root:
 *   - a worker that is not root runs bwrap unprivileged, which makes a
 *     user namespace per job, so the count is the job's own processes
 *     and threads;
 *   - a root worker runs bwrap privileged (no user namespace) and
 *     `--sandbox-exec --uid U` drops to uid and gid U = --sandbox-uid +
 *     slot, with no supplementary groups and no capabilities left, so
 *     the count is that slot's; the job directory is chowned to U.
 * Either way the pid namespace ends every process of the job when its
 * first one exits or the worker kills bwrap (timeout, cancel), and
 * nothing in it can signal the worker.
 *
 * kiln_sandbox_new checks that bwrap is there and works here by running
 * `true` through the very same sandbox; the worker refuses to start when
 * it does not (unless `--sandbox none`), so that a farm never compiles
 * unsandboxed by accident.
 */
#ifndef KILN_SANDBOX_H
#define KILN_SANDBOX_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kiln_error.h"

#define KILN_SANDBOX_MAX_PATHS     8          /* hidden or shown directories */
#define KILN_SANDBOX_DEFAULT_PROCS 512        /* --max-procs */
#define KILN_SANDBOX_MAX_PROCS     65536
#define KILN_SANDBOX_DEFAULT_UID   65536      /* --sandbox-uid: root workers */
#define KILN_SANDBOX_MIN_MEMORY    (64ULL << 20)

typedef enum {
    KILN_SANDBOX_BWRAP = 0,                 /* the default */
    KILN_SANDBOX_NONE,                      /* limits only */
} kiln_sandbox_kind_t;

typedef struct kiln_sandbox kiln_sandbox_t;

typedef struct kiln_sandbox_config {
    kiln_sandbox_kind_t kind;
    uint64_t max_memory;         /* RLIMIT_AS per compile; 0 = 3/4 of RAM / slots, >= 1 GiB */
    int max_procs;               /* RLIMIT_NPROC in the sandbox; 0 = KILN_SANDBOX_DEFAULT_PROCS */
    unsigned uid_base;           /* root workers: slot i runs as uid base + i; 0 = default */
    int slots;                   /* the worker's slots (for the defaults) */
    const char *helper;          /* this program (kiln-worker), for --sandbox-exec */
    const char *jobs_dir;        /* where job directories are made (hidden) */
    const char *hide[KILN_SANDBOX_MAX_PATHS];   /* more directories to hide */
    int n_hide;
} kiln_sandbox_config_t;

/* Check the configuration; for bwrap, find it and run a probe through
 * the sandbox.  Caller owns the result (kiln_sandbox_destroy). */
kiln_sandbox_t *kiln_sandbox_new (const kiln_sandbox_config_t *cfg, kiln_err_t *err);
void kiln_sandbox_destroy (kiln_sandbox_t **self_p);

/* One line for the worker's start-up log. */
const char *kiln_sandbox_describe (const kiln_sandbox_t *self, char *buf, size_t size);

uint64_t kiln_sandbox_max_memory (const kiln_sandbox_t *self);

/* What a forked child runs: prepared in the parent, because the child
 * may only call async-signal-safe functions. */
typedef struct kiln_sandbox_cmd {
    char **argv;                 /* owned, NULL-terminated: bwrap's or COMMAND's */
    char *workdir;               /* owned */
    bool bwrap;                  /* exec argv[0] as a path; else chdir + execvp */
    uint64_t max_memory;
    uint64_t cpu_s;              /* RLIMIT_CPU soft limit */
} kiln_sandbox_cmd_t;

/* Prepare COMMAND (`argv`, NULL-terminated, not taken) to run for `slot`
 * in `workdir` for at most `timeout_ms`.  `files` are the compiler
 * program or the words of the toolchain's own command (the operator's,
 * not the job's): those that are absolute paths of regular files outside
 * the hidden directories are bound read-only, as is `helper`.  With bwrap run by root, hands the workdir and what
 * is in it to the slot's uid.  Release *cmd with kiln_sandbox_cmd_release
 * (also after a failure). */
int kiln_sandbox_prepare (const kiln_sandbox_t *self, int slot, const char *workdir,
                          char *const *argv, char *const *files, int n_files,
                          uint64_t timeout_ms, kiln_sandbox_cmd_t *cmd, kiln_err_t *err);
void kiln_sandbox_cmd_release (kiln_sandbox_cmd_t *cmd);

/* In the forked child, with stdin/stdout/stderr set: limits, then exec.
 * Does not return; exits 127 (its reason on stderr) when exec fails. */
void kiln_sandbox_exec (const kiln_sandbox_cmd_t *cmd) __attribute__ ((noreturn));

/* Why a compile that did not exit 0 failed, in words for the client:
 * the limit it ran into (KILN_ELIMIT: memory, CPU time, file size,
 * processes), the signal that killed it (KILN_EREMOTE), or its exit
 * status (KILN_ECOMPILE).  `log` is its output.  Only KILN_ECOMPILE is a
 * failure of the compile itself; the others depend on the worker, and
 * the broker does not cache them. */
int kiln_sandbox_explain (const kiln_sandbox_t *self, int status, const char *log,
                          char *text, size_t size);
/* Whether a failed compile's output `log` says it ran out of memory (what
 * kiln_sandbox_explain reports as the memory limit). */
bool kiln_sandbox_out_of_memory (const char *log);

/* `kiln-worker --sandbox-exec --chdir DIR --procs N [--uid U] -- COMMAND...`,
 * inside the sandbox: set RLIMIT_NPROC, drop to U (as root), chdir, exec. */
int kiln_sandbox_exec_main (int argc, char **argv);

#endif
