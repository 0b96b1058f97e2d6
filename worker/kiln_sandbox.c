/*
 * kiln_sandbox — the compile sandbox (bubblewrap) and the limits of a
 * compile's child process.
 */
#include "worker/kiln_sandbox.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/kiln_fs.h"
#include "common/kiln_limits.h"

#define S_EXIT_EXEC      127             /* the child's status when exec failed */
#define S_PROBE_MS       10000           /* the start-up probe's time limit */
#define S_PROBE_OUT      2048            /* the probe's output kept for the error */
#define S_HIDE_BYTES     "65536"         /* size of the tmpfs covering a hidden dir */
#define S_CPU_GRACE_S    10              /* RLIMIT_CPU hard limit past the soft one */
#define S_MAX_ARGS       (KILN_SANDBOX_MAX_PATHS * 8 + 224)  /* bwrap's own words */

struct kiln_sandbox {
    kiln_sandbox_kind_t kind;
    char bwrap[PATH_MAX];                /* the bwrap program */
    char helper[PATH_MAX];               /* kiln-worker, for --sandbox-exec */
    bool root;                           /* the worker runs as root: drop to uid_base + slot */
    unsigned uid_base;
    uint64_t max_memory;
    int max_procs;
    int slots;
    long cpus;                           /* online, for RLIMIT_CPU */
    char *hide[KILN_SANDBOX_MAX_PATHS + 1];  /* owned, canonical, shortest first */
    int n_hide;
    char path_env[PATH_MAX];             /* PATH inside */
};

/* --- sizes in words --------------------------------------------------- */

static const char *
s_bytes (uint64_t n, char *buf, size_t size)
{
    if (n >= (1ULL << 30) && n % (1ULL << 30) == 0)
        snprintf (buf, size, "%llu GiB", (unsigned long long) (n >> 30));
    else if (n >= (1ULL << 20) && n % (1ULL << 20) == 0)
        snprintf (buf, size, "%llu MiB", (unsigned long long) (n >> 20));
    else
        snprintf (buf, size, "%llu bytes", (unsigned long long) n);
    return buf;
}

/* --- configuration ------------------------------------------------------- */

/* Directories a compile needs, which may not be hidden. */
static bool
s_system_dir (const char *path)
{
    static const char *const dirs[] = { "/", "/usr", "/etc", "/bin", "/sbin", "/lib",
                                        "/lib32", "/lib64", "/libx32", "/proc", "/dev",
                                        "/sys", "/var", "/run", "/opt", "/home", "/srv",
                                        "/boot", "/tmp" };
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++)
        if (strcmp (path, dirs[i]) == 0)
            return true;
    return false;
}

/* Find `name` in $PATH (or the usual places); 0 with its path in buf. */
static int
s_find_program (const char *name, char *buf, size_t size)
{
    const char *path = getenv ("PATH");
    if (!path)
        path = "/usr/local/bin:/usr/bin:/bin";
    while (*path) {
        const char *end = strchr (path, ':');
        size_t len = end ? (size_t) (end - path) : strlen (path);
        if (len > 0 && (int) snprintf (buf, size, "%.*s/%s", (int) len, path, name) < (int) size
            && access (buf, X_OK) == 0)
            return 0;
        path += len + (end ? 1 : 0);
    }
    return -1;
}

static int
s_add_path (char **list, int *n, int max, const char *path, const char *what, kiln_err_t *err)
{
    char real[PATH_MAX];
    if (!realpath (path, real))
        return kiln_error (err, KILN_ENOTFOUND, "%s '%s': %s", what, path, strerror (errno));
    for (int i = 0; i < *n; i++)
        if (strcmp (list[i], real) == 0)
            return 0;
    if (*n >= max)
        return kiln_error (err, KILN_ELIMIT, "more than %d directories for the sandbox", max);
    if (!(list[*n] = strdup (real)))
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    (*n)++;
    return 0;
}

/* True when `path` is strictly below directory `dir`. */
static bool
s_under (const char *path, const char *dir)
{
    size_t len = strlen (dir);
    return strncmp (path, dir, len) == 0 && path[len] == '/' && path[len + 1];
}

static int
s_cmp_len (const void *a, const void *b)
{
    size_t la = strlen (*(char *const *) a), lb = strlen (*(char *const *) b);
    return la < lb ? -1 : la > lb;
}

static uint64_t
s_default_memory (int slots)
{
    long pages = sysconf (_SC_PHYS_PAGES), page = sysconf (_SC_PAGESIZE);
    uint64_t ram = pages > 0 && page > 0 ? (uint64_t) pages * (uint64_t) page : 8ULL << 30;
    uint64_t share = ram / 4 * 3 / (uint64_t) (slots > 0 ? slots : 1);
    share &= ~((1ULL << 20) - 1);            /* whole MiB, for the messages */
    return share < (1ULL << 30) ? 1ULL << 30 : share;
}

/* --- preparing a command ------------------------------------------------- */

void
kiln_sandbox_cmd_release (kiln_sandbox_cmd_t *cmd)
{
    if (!cmd)
        return;
    for (int i = 0; cmd->argv && cmd->argv[i]; i++)
        free (cmd->argv[i]);
    free (cmd->argv);
    free (cmd->workdir);
    memset (cmd, 0, sizeof *cmd);
}

/* Append a copy of each string (NULL ends); -1 when out of memory. */
static int
s_push (char **argv, int *n, int max, ...)
{
    va_list ap;
    va_start (ap, max);
    const char *s;
    int rc = 0;
    while ((s = va_arg (ap, const char *))) {
        if (*n >= max || !(argv[*n] = strdup (s))) {
            rc = -1;
            break;
        }
        (*n)++;
    }
    va_end (ap);
    return rc;
}

/* Give the job's directory and what it holds to the slot's uid. */
static int
s_chown_workdir (const char *workdir, uid_t uid, kiln_err_t *err)
{
    if (lchown (workdir, uid, (gid_t) uid) != 0)
        return kiln_error (err, KILN_ESYS, "could not hand '%s' to uid %u: %s", workdir,
                           (unsigned) uid, strerror (errno));
    DIR *dir = opendir (workdir);
    if (!dir)
        return kiln_error (err, KILN_ESYS, "'%s': %s", workdir, strerror (errno));
    struct dirent *ent;
    int rc = 0;
    while (rc == 0 && (ent = readdir (dir))) {
        if (strcmp (ent->d_name, ".") == 0 || strcmp (ent->d_name, "..") == 0)
            continue;
        if (fchownat (dirfd (dir), ent->d_name, uid, (gid_t) uid, AT_SYMLINK_NOFOLLOW) != 0)
            rc = kiln_error (err, KILN_ESYS, "could not hand '%s/%s' to uid %u: %s", workdir,
                             ent->d_name, (unsigned) uid, strerror (errno));
    }
    closedir (dir);
    return rc;
}

int
kiln_sandbox_prepare (const kiln_sandbox_t *self, int slot, const char *workdir,
                      char *const *argv, char *const *files, int n_files, uint64_t timeout_ms,
                      kiln_sandbox_cmd_t *cmd, kiln_err_t *err)
{
    memset (cmd, 0, sizeof *cmd);
    int n_cmd = 0;
    while (argv[n_cmd])
        n_cmd++;
    cmd->max_memory = self->max_memory;
    uint64_t secs = (timeout_ms + 999) / 1000;
    cmd->cpu_s = secs * (uint64_t) self->cpus + 1;
    char real[PATH_MAX];
    if (!realpath (workdir, real))
        return kiln_error (err, KILN_ESYS, "job directory '%s': %s", workdir, strerror (errno));
    if (!(cmd->workdir = strdup (real)))
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    /* bwrap's own words, the command's, and for each file to show a --dir
     * per parent and the bind. */
    int max = S_MAX_ARGS + n_cmd + 1, n = 0;
    for (int i = -1; i < n_files; i++)
        for (const char *c = i < 0 ? self->helper : files[i]; *c && max < INT_MAX / 4; c++)
            max += *c == '/' ? 4 : 0;
    cmd->argv = calloc ((size_t) max + 1, sizeof *cmd->argv);
    if (!cmd->argv)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    if (self->kind == KILN_SANDBOX_NONE) {
        for (int i = 0; i < n_cmd; i++)
            if (s_push (cmd->argv, &n, max, argv[i], NULL) != 0)
                return kiln_error (err, KILN_ENOMEM, "out of memory");
        return 0;
    }
    cmd->bwrap = true;
    uid_t uid = (uid_t) (self->uid_base + (unsigned) slot);
    if (self->root && s_chown_workdir (real, uid, err) != 0)
        return -err->code;
    char num[32];
    int rc = s_push (cmd->argv, &n, max, self->bwrap, "--ro-bind", "/", "/", "--dev", "/dev",
                     "--proc", "/proc", NULL);
    snprintf (num, sizeof num, "%u", KILN_MAX_COMPILE_TMP_BYTES);
    rc |= s_push (cmd->argv, &n, max, "--size", num, "--perms", "1777", "--tmpfs", "/tmp", NULL);
    for (int i = 0; i < self->n_hide; i++)
        rc |= s_push (cmd->argv, &n, max, "--perms", "0755", "--size", S_HIDE_BYTES, "--tmpfs",
                      self->hide[i], NULL);
    /* The programs: this one (--sandbox-exec, --wrap), the compiler, and
     * the files a toolchain's command names by absolute path (its script,
     * say), which may sit under the fresh /tmp.  Files, not their
     * directories; only the operator's words, never the job's arguments;
     * and nothing in a hidden place. */
    for (int i = -1; i < n_files; i++) {
        const char *name = i < 0 ? self->helper : files[i];
        struct stat st;
        char file[PATH_MAX];
        if (name[0] != '/' || stat (name, &st) != 0 || !S_ISREG (st.st_mode)
            || !realpath (name, file))
            continue;
        bool hidden = false;
        for (int h = 0; h < self->n_hide && !hidden; h++)
            hidden = s_under (file, self->hide[h]);
        if (hidden)
            continue;
        /* bwrap makes a file's missing parents mode 0700, which a root
         * worker's compile uid could not enter: make them 0755 first. */
        for (char *slash = strchr (file + 1, '/'); slash; slash = strchr (slash + 1, '/')) {
            *slash = '\0';
            if (s_under (file, "/tmp"))
                rc |= s_push (cmd->argv, &n, max, "--perms", "0755", "--dir", file, NULL);
            *slash = '/';
        }
        rc |= s_push (cmd->argv, &n, max, "--ro-bind", file, file, NULL);
    }
    /* kiln's own programs and libraries (this program's directory and
     * the lib/ beside it), read-only: a toolchain script runs kiln-cc from
     * there, and an installation unpacked under /tmp would otherwise be
     * hidden by the fresh /tmp. */
    char bindir[PATH_MAX];
    if (self->helper[0] == '/' && realpath (self->helper, bindir)) {
        char *slash = strrchr (bindir, '/');
        if (slash && slash != bindir) {
            *slash = '\0';
            char libdir[PATH_MAX + 8];
            snprintf (libdir, sizeof libdir, "%s/../lib", bindir);
            char libreal[PATH_MAX];
            const char *dirs[2] = { bindir, realpath (libdir, libreal) ? libreal : NULL };
            for (int d = 0; d < 2; d++) {
                struct stat st;
                if (!dirs[d] || !s_under (dirs[d], "/tmp") || stat (dirs[d], &st) != 0
                    || !S_ISDIR (st.st_mode))
                    continue;
                bool hidden = false;
                for (int h = 0; h < self->n_hide && !hidden; h++)
                    hidden = s_under (dirs[d], self->hide[h]);
                if (hidden)
                    continue;
                char path[PATH_MAX];
                snprintf (path, sizeof path, "%s", dirs[d]);
                for (char *sl = strchr (path + 1, '/'); sl; sl = strchr (sl + 1, '/')) {
                    *sl = '\0';
                    rc |= s_push (cmd->argv, &n, max, "--perms", "0755", "--dir", path, NULL);
                    *sl = '/';
                }
                rc |= s_push (cmd->argv, &n, max, "--ro-bind", dirs[d], dirs[d], NULL);
            }
        }
    }
    rc |= s_push (cmd->argv, &n, max, "--bind", real, real, NULL);
    for (int i = 0; i < self->n_hide; i++)
        rc |= s_push (cmd->argv, &n, max, "--remount-ro", self->hide[i], NULL);
    rc |= s_push (cmd->argv, &n, max, "--unshare-ipc", "--unshare-pid", "--unshare-net",
                  "--unshare-uts", "--unshare-cgroup-try", NULL);
    if (!self->root)
        rc |= s_push (cmd->argv, &n, max, "--unshare-user", "--disable-userns", NULL);
    rc |= s_push (cmd->argv, &n, max, "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                  NULL);
    if (self->root)
        rc |= s_push (cmd->argv, &n, max, "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                      NULL);
    rc |= s_push (cmd->argv, &n, max, "--clearenv", "--setenv", "PATH", self->path_env,
                  "--setenv", "HOME", real, "--setenv", "TMPDIR", "/tmp", NULL);
    static const char *const keep[] = { "LANG", "LC_ALL", "TZ" };
    for (size_t i = 0; i < sizeof keep / sizeof keep[0]; i++) {
        const char *v = getenv (keep[i]);
        if (v && *v)
            rc |= s_push (cmd->argv, &n, max, "--setenv", keep[i], v, NULL);
    }
    snprintf (num, sizeof num, "%d", self->max_procs);
    rc |= s_push (cmd->argv, &n, max, "--chdir", "/", "--", self->helper, "--sandbox-exec",
                  "--chdir", real, "--procs", num, NULL);
    if (self->root) {
        snprintf (num, sizeof num, "%u", (unsigned) uid);
        rc |= s_push (cmd->argv, &n, max, "--uid", num, NULL);
    }
    rc |= s_push (cmd->argv, &n, max, "--", NULL);
    for (int i = 0; i < n_cmd; i++)
        rc |= s_push (cmd->argv, &n, max, argv[i], NULL);
    if (rc != 0)
        return kiln_error (err, KILN_ENOMEM, "out of memory (or too many words) preparing "
                           "the sandbox");
    return 0;
}

/* --- the child ------------------------------------------------------------ */

static void
s_write_str (int fd, const char *s)
{
    ssize_t ignored = write (fd, s, strlen (s));
    (void) ignored;
}

void
kiln_sandbox_exec (const kiln_sandbox_cmd_t *cmd)
{
    struct rlimit as = { cmd->max_memory, cmd->max_memory };
    struct rlimit cpu = { cmd->cpu_s, cmd->cpu_s + S_CPU_GRACE_S };
    struct rlimit fsize = { KILN_MAX_COMPILE_FILE_BYTES, KILN_MAX_COMPILE_FILE_BYTES };
    struct rlimit core = { 0, 0 };
#if defined(__SANITIZE_ADDRESS__)
    /* An AddressSanitizer build (make san-test) reserves terabytes of
     * shadow address space as it starts: an address-space limit would stop
     * every compile.  That build is for tests; the memory limit is tested
     * in the normal one. */
    as.rlim_cur = as.rlim_max = RLIM_INFINITY;
#endif
    if (setrlimit (RLIMIT_AS, &as) != 0 || setrlimit (RLIMIT_CPU, &cpu) != 0
        || setrlimit (RLIMIT_FSIZE, &fsize) != 0 || setrlimit (RLIMIT_CORE, &core) != 0) {
        s_write_str (2, "kiln-worker: could not set the compile's resource limits\n");
        _exit (S_EXIT_EXEC);
    }
    if (cmd->bwrap)
        execv (cmd->argv[0], cmd->argv);
    else if (chdir (cmd->workdir) == 0)
        execvp (cmd->argv[0], cmd->argv);
    s_write_str (2, "kiln-worker: could not execute '");
    s_write_str (2, cmd->argv[0]);
    const char *why = strerrordesc_np (errno);    /* no locale: async-signal-safe */
    s_write_str (2, "': ");
    s_write_str (2, why ? why : "?");
    s_write_str (2, "\n");
    _exit (S_EXIT_EXEC);
}

/* `kiln-worker --sandbox-exec ...`, the first process of the job inside
 * bwrap. */
int
kiln_sandbox_exec_main (int argc, char **argv)
{
    const char *dir = NULL;
    long long procs = -1, uid = -1;
    int i = 2;
    for (; i + 1 < argc && strcmp (argv[i], "--") != 0; i += 2) {
        if (strcmp (argv[i], "--chdir") == 0)
            dir = argv[i + 1];
        else if (strcmp (argv[i], "--procs") == 0)
            procs = kiln_parse_number (argv[i + 1], 1, KILN_SANDBOX_MAX_PROCS);
        else if (strcmp (argv[i], "--uid") == 0)
            uid = kiln_parse_number (argv[i + 1], 1, 0x7fffffffLL);
        else
            break;
    }
    if (i >= argc || strcmp (argv[i], "--") != 0 || i + 1 >= argc || !dir || procs < 0) {
        fprintf (stderr, "usage: kiln-worker --sandbox-exec --chdir DIR --procs N [--uid U] "
                 "-- COMMAND...\n");
        return S_EXIT_EXEC;
    }
    struct rlimit np = { (rlim_t) procs, (rlim_t) procs };
    if (setrlimit (RLIMIT_NPROC, &np) != 0) {
        fprintf (stderr, "kiln-worker: could not limit the compile to %lld processes: %s\n",
                 procs, strerror (errno));
        return S_EXIT_EXEC;
    }
    if (uid >= 0) {
        /* Every id, real, effective and saved, so that nothing is left to
         * go back to; root's capabilities go with the uid. */
        if (setgroups (0, NULL) != 0 || setresgid ((gid_t) uid, (gid_t) uid, (gid_t) uid) != 0
            || setresuid ((uid_t) uid, (uid_t) uid, (uid_t) uid) != 0
            || getuid () != (uid_t) uid || geteuid () != (uid_t) uid) {
            fprintf (stderr, "kiln-worker: could not run the compile as uid %lld: %s\n", uid,
                     strerror (errno));
            return S_EXIT_EXEC;
        }
    }
    if (getuid () == 0 || geteuid () == 0) {
        fprintf (stderr, "kiln-worker: refusing to run a compile as root in the sandbox\n");
        return S_EXIT_EXEC;
    }
    if (chdir (dir) != 0) {
        fprintf (stderr, "kiln-worker: cannot enter the job directory '%s': %s\n", dir,
                 strerror (errno));
        return S_EXIT_EXEC;
    }
    execvp (argv[i + 1], argv + i + 1);
    fprintf (stderr, "kiln-worker: could not execute '%s': %s\n", argv[i + 1], strerror (errno));
    return S_EXIT_EXEC;
}

/* --- set-up and the probe ---------------------------------------------------- */

/* Run `true` through the sandbox, as a job would run; 0 when it works,
 * else the reason with what bwrap said. */
static int
s_probe (kiln_sandbox_t *self, kiln_err_t *err)
{
    char *dir = kiln_mkdtemp ("kiln-sandbox-probe-", err);
    if (!dir)
        return -err->code;
    kiln_sandbox_cmd_t cmd;
    char *argv[] = { "true", NULL };
    int rc = kiln_sandbox_prepare (self, 0, dir, argv, NULL, 0, S_PROBE_MS, &cmd, err);
    int fds[2] = { -1, -1 };
    char out[S_PROBE_OUT + 1];
    size_t len = 0;
    if (rc == 0 && pipe2 (fds, O_CLOEXEC) != 0)
        rc = kiln_error (err, KILN_ESYS, "pipe: %s", strerror (errno));
    pid_t pid = rc == 0 ? fork () : -1;
    if (rc == 0 && pid < 0)
        rc = kiln_error (err, KILN_ESYS, "fork: %s", strerror (errno));
    if (pid == 0) {
        int devnull = open ("/dev/null", O_RDONLY);
        if (devnull < 0 || dup2 (devnull, 0) < 0 || dup2 (fds[1], 1) < 0 || dup2 (fds[1], 2) < 0)
            _exit (S_EXIT_EXEC);
        kiln_sandbox_exec (&cmd);
    }
    if (fds[1] >= 0)
        close (fds[1]);
    int status = 0;
    if (pid > 0) {
        struct timespec t0;
        clock_gettime (CLOCK_MONOTONIC, &t0);
        bool done = false;
        while (!done) {
            struct timespec now;
            clock_gettime (CLOCK_MONOTONIC, &now);
            long ms = (now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000;
            if (ms >= S_PROBE_MS) {
                kill (pid, SIGKILL);
                snprintf (out, sizeof out, "it did not finish within %d s", S_PROBE_MS / 1000);
                len = strlen (out);
                break;
            }
            struct pollfd p = { fds[0], POLLIN, 0 };
            if (poll (&p, 1, (int) (S_PROBE_MS - ms)) < 0 && errno != EINTR)
                break;
            char buf[512];
            ssize_t r = read (fds[0], buf, sizeof buf);
            if (r > 0) {
                size_t keep = (size_t) r < S_PROBE_OUT - len ? (size_t) r : S_PROBE_OUT - len;
                memcpy (out + len, buf, keep);
                len += keep;
            }
            else if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN))
                done = true;
        }
        while (waitpid (pid, &status, 0) < 0 && errno == EINTR)
            ;
        out[len] = '\0';
        while (len > 0 && (out[len - 1] == '\n' || out[len - 1] == ' '))
            out[--len] = '\0';
        for (size_t i = 0; i < len; i++)
            if (out[i] == '\n')
                out[i] = ' ';
        if (!WIFEXITED (status) || WEXITSTATUS (status) != 0)
            rc = kiln_error (err, KILN_ESYS, "the compile sandbox (bubblewrap, '%s') does not "
                             "work on this host: %s", self->bwrap,
                             len ? out : "it failed without saying why");
    }
    if (fds[0] >= 0)
        close (fds[0]);
    kiln_sandbox_cmd_release (&cmd);
    kiln_rm_rf (dir);
    free (dir);
    return rc;
}

kiln_sandbox_t *
kiln_sandbox_new (const kiln_sandbox_config_t *cfg, kiln_err_t *err)
{
    kiln_sandbox_t *self = calloc (1, sizeof *self);
    if (!self) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    self->kind = cfg->kind;
    self->slots = cfg->slots > 0 ? cfg->slots : 1;
    self->max_memory = cfg->max_memory ? cfg->max_memory : s_default_memory (self->slots);
    self->max_procs = cfg->max_procs > 0 ? cfg->max_procs : KILN_SANDBOX_DEFAULT_PROCS;
    self->uid_base = cfg->uid_base ? cfg->uid_base : KILN_SANDBOX_DEFAULT_UID;
    self->root = geteuid () == 0;
    self->cpus = sysconf (_SC_NPROCESSORS_ONLN);
    if (self->cpus < 1)
        self->cpus = 1;
    if (self->max_memory < KILN_SANDBOX_MIN_MEMORY) {
        kiln_error (err, KILN_EINVAL, "--max-memory must be at least %llu MiB",
                    KILN_SANDBOX_MIN_MEMORY >> 20);
        goto fail;
    }
    if (self->max_procs > KILN_SANDBOX_MAX_PROCS) {
        kiln_error (err, KILN_EINVAL, "--max-procs must be at most %d", KILN_SANDBOX_MAX_PROCS);
        goto fail;
    }
    if (self->kind == KILN_SANDBOX_NONE)
        return self;
    if ((uint64_t) self->uid_base + (uint64_t) self->slots > 0x7fffffffULL) {
        kiln_error (err, KILN_EINVAL, "--sandbox-uid %u leaves no room for %d slots",
                    self->uid_base, self->slots);
        goto fail;
    }
    if (!cfg->helper || snprintf (self->helper, sizeof self->helper, "%s", cfg->helper)
                        >= (int) sizeof self->helper) {
        kiln_error (err, KILN_EINVAL, "the sandbox needs the worker's own program");
        goto fail;
    }
    if (s_find_program ("bwrap", self->bwrap, sizeof self->bwrap) != 0) {
        kiln_error (err, KILN_ENOTFOUND, "the compile sandbox needs bubblewrap (bwrap), which "
                    "is not installed here (Debian: apt-get install bubblewrap); start the "
                    "worker with --sandbox none to compile without a sandbox");
        goto fail;
    }
    const char *path = getenv ("PATH");
    snprintf (self->path_env, sizeof self->path_env, "%s",
              path && *path ? path : "/usr/local/bin:/usr/bin:/bin");
    /* What the compile must not see; the job directories' parent first. */
    if (cfg->jobs_dir) {
        char real[PATH_MAX];
        if (!realpath (cfg->jobs_dir, real)) {
            kiln_error (err, KILN_ENOTFOUND, "job directory parent '%s': %s", cfg->jobs_dir,
                        strerror (errno));
            goto fail;
        }
        if (strcmp (real, "/tmp") != 0
            && s_add_path (self->hide, &self->n_hide, KILN_SANDBOX_MAX_PATHS + 1, real,
                           "job directory parent", err) != 0)
            goto fail;
    }
    for (int i = 0; i < cfg->n_hide && i < KILN_SANDBOX_MAX_PATHS; i++) {
        char real[PATH_MAX];
        if (!realpath (cfg->hide[i], real) || strcmp (real, "/tmp") == 0
            || (strncmp (real, "/tmp/", 5) == 0))
            continue;                    /* gone, or under the fresh /tmp anyway */
        if (s_add_path (self->hide, &self->n_hide, KILN_SANDBOX_MAX_PATHS + 1, real,
                        "directory to hide", err) != 0)
            goto fail;
    }
    for (int i = 0; i < self->n_hide; i++)
        if (s_system_dir (self->hide[i])) {
            kiln_error (err, KILN_EINVAL, "the compile sandbox would hide '%s', which compiles "
                        "need: keep the worker's TMPDIR, --cache and certificate in "
                        "directories of their own", self->hide[i]);
            goto fail;
        }
    qsort (self->hide, (size_t) self->n_hide, sizeof self->hide[0], s_cmp_len);
    if (s_probe (self, err) != 0) {
        char text[KILN_ERR_MSG_MAX];
        snprintf (text, sizeof text, "%s", err->msg);
        kiln_error (err, KILN_ESYS, "%s; install bubblewrap and allow namespaces%s, or start "
                    "the worker with --sandbox none to compile without a sandbox", text,
                    self->root ? "" : " (unprivileged user namespaces)");
        goto fail;
    }
    return self;
fail:
    kiln_sandbox_destroy (&self);
    return NULL;
}

void
kiln_sandbox_destroy (kiln_sandbox_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_sandbox_t *self = *self_p;
    for (int i = 0; i < self->n_hide; i++)
        free (self->hide[i]);
    free (self);
    *self_p = NULL;
}

uint64_t
kiln_sandbox_max_memory (const kiln_sandbox_t *self)
{
    return self->max_memory;
}

const char *
kiln_sandbox_describe (const kiln_sandbox_t *self, char *buf, size_t size)
{
    char mem[32];
    s_bytes (self->max_memory, mem, sizeof mem);
    if (self->kind == KILN_SANDBOX_NONE)
        snprintf (buf, size, "compiles run WITHOUT a sandbox (--sandbox none), with %s of "
                  "memory each", mem);
    else if (self->root)
        snprintf (buf, size, "compiles run in the sandbox (%s) as uid %u + slot, with %s of "
                  "memory and %d processes each", self->bwrap, self->uid_base, mem,
                  self->max_procs);
    else
        snprintf (buf, size, "compiles run in the sandbox (%s), with %s of memory and %d "
                  "processes each", self->bwrap, mem, self->max_procs);
    return buf;
}

/* --- why a compile failed ----------------------------------------------------- */

static bool
s_log_has (const char *log, const char *const *words, size_t n)
{
    for (size_t i = 0; log && i < n; i++)
        if (strcasestr (log, words[i]))
            return true;
    return false;
}

/* What allocators, runtimes and shells print when memory runs out (C,
 * Python, C++, Go, glibc's strerror, bison/gcc). */
static const char *const s_oom[] = { "out of memory", "MemoryError", "bad_alloc",
                                     "Cannot allocate memory", "memory exhausted" };

bool
kiln_sandbox_out_of_memory (const char *log)
{
    return s_log_has (log, s_oom, sizeof s_oom / sizeof s_oom[0]);
}

int
kiln_sandbox_explain (const kiln_sandbox_t *self, int status, const char *log, char *text,
                      size_t size)
{
    /* ... and when fork or thread creation is refused (EAGAIN). */
    static const char *const nproc[] = { "Resource temporarily unavailable", "BlockingIOError",
                                         "fork: retry", "Cannot fork", "can't fork",
                                         "can't start new thread" };
    static const char *const fbig[] = { "File too large" };
    int sig = 0, code = -1;
    if (WIFSIGNALED (status))
        sig = WTERMSIG (status);
    else if (WIFEXITED (status)) {
        code = WEXITSTATUS (status);
        /* bwrap (like a shell) exits 128 + N when its command died of
         * signal N. */
        if (self->kind == KILN_SANDBOX_BWRAP && code > 128 && code < 128 + 65)
            sig = code - 128;
    }
    char mem[32];
    if (kiln_sandbox_out_of_memory (log)) {
        snprintf (text, size, "compile ran out of its %s memory limit (--max-memory)",
                  s_bytes (self->max_memory, mem, sizeof mem));
        return KILN_ELIMIT;
    }
    if (sig == SIGXCPU) {
        snprintf (text, size, "compile used up its CPU time limit (the job's timeout times "
                  "%ld CPUs)", self->cpus);
        return KILN_ELIMIT;
    }
    if (sig == SIGXFSZ || s_log_has (log, fbig, 1)) {
        snprintf (text, size, "compile wrote a file past the %s limit per file",
                  s_bytes (KILN_MAX_COMPILE_FILE_BYTES, mem, sizeof mem));
        return KILN_ELIMIT;
    }
    if (self->kind == KILN_SANDBOX_BWRAP && s_log_has (log, nproc, sizeof nproc / sizeof nproc[0])) {
        snprintf (text, size, "compile could not start more processes: it hit its limit of %d "
                  "processes and threads (--max-procs)", self->max_procs);
        return KILN_ELIMIT;
    }
    if (sig > 0) {
        const char *name = sigabbrev_np (sig);
        snprintf (text, size, "compiler killed by signal %d (SIG%s)%s", sig, name ? name : "?",
                  sig == SIGKILL || sig == SIGSEGV || sig == SIGABRT || sig == SIGBUS
                  ? "; it may have run out of memory" : "");
        return KILN_EREMOTE;
    }
    snprintf (text, size, "compiler exited with status %d", code);
    return KILN_ECOMPILE;
}
