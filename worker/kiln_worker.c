/*
 * kiln_worker — registration, heartbeats, jobs and their child processes.
 */
#include "worker/kiln_worker.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <czmq.h>

#include "common/kiln_fs.h"
#include "common/kiln_log.h"
#include "common/kiln_proto.h"
#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"

#define S_TICK_MS        25      /* how often children are polled */
#define S_LOG_RESERVE    96      /* room for the "[log cut]" note */
#define S_EXIT_EXEC      127     /* the child's status when exec failed */
#define S_MAX_READS      64      /* pipe reads per child per tick */

/* One job running in a child process. */
typedef struct {
    uint64_t id;                         /* the broker's job id */
    char action_key[KILN_HEX_LEN];
    char *workdir;                       /* private temp dir, owned */
    pid_t pid;                           /* child; also its process group */
    int fd;                              /* read end of its stdout/stderr, or -1 */
    char *log;                           /* captured output, owned */
    size_t log_len;
    size_t log_dropped;                  /* bytes past the bound, not kept */
    int64_t started;                     /* zclock_mono */
    int64_t deadline;                    /* zclock_mono after which it is killed */
    bool timed_out;
    bool exited;
    int status;                          /* waitpid status once exited */
} s_run_t;

struct kiln_worker {
    kiln_worker_config_t cfg;            /* with defaults; strings point below */
    char *endpoint;                      /* owned */
    char name[KILN_PROTO_MAX_NAME + 1];
    char cc[PATH_MAX];                   /* the compiler program */
    zsock_t *dealer;                     /* to the broker; NULL when down */
    zloop_t *loop;
    s_run_t **runs;                      /* cfg.slots entries, NULL = free */
    int64_t broker_seen;                 /* zclock_mono of the broker's last message */
    bool reconnect;                      /* the loop stopped to reconnect */
};

/* --- runs ------------------------------------------------------------------ */

/* Kill a child's process group, reap it, close its pipe, remove its
 * workdir and free the run. */
static void
s_run_destroy (s_run_t **self_p)
{
    s_run_t *run = *self_p;
    if (!run)
        return;
    if (run->pid > 0) {
        kill (-run->pid, SIGKILL);
        if (!run->exited)
            while (waitpid (run->pid, &run->status, 0) < 0 && errno == EINTR)
                ;
    }
    if (run->fd >= 0)
        close (run->fd);
    if (run->workdir) {
        kiln_rm_rf (run->workdir);
        free (run->workdir);
    }
    free (run->log);
    free (run);
    *self_p = NULL;
}

/* Read what the child wrote, keeping at most the log bound. */
static void
s_run_drain (s_run_t *run)
{
    char buf[16384];
    for (int i = 0; run->fd >= 0 && i < S_MAX_READS; i++) {
        ssize_t n = read (run->fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return;                      /* EAGAIN: nothing more for now */
        if (n == 0) {
            close (run->fd);
            run->fd = -1;
            return;
        }
        size_t room = KILN_MAX_LOG_BYTES - S_LOG_RESERVE - run->log_len;
        size_t keep = (size_t) n < room ? (size_t) n : room;
        for (size_t j = 0; j < keep; j++)
            run->log[run->log_len++] = buf[j] ? buf[j] : '?';
        run->log_dropped += (size_t) n - keep;
    }
}

/* The log as a string, with a note when it was cut. */
static const char *
s_run_log (s_run_t *run)
{
    run->log[run->log_len] = '\0';
    if (run->log_dropped)
        snprintf (run->log + run->log_len, S_LOG_RESERVE, "\n[log cut: %zu more bytes]\n",
                  run->log_dropped);
    return run->log;
}

/* Start the compiler on WORKDIR/model.kgraph.  The argument vector is built
 * before fork so that the child only calls async-signal-safe functions. */
static int
s_run_spawn (kiln_worker_t *self, s_run_t *run, const char *args, kiln_err_t *err)
{
    char kgraph[PATH_MAX], out[PATH_MAX];
    snprintf (kgraph, sizeof kgraph, "%s/model.kgraph", run->workdir);
    snprintf (out, sizeof out, "%s/out.kar", run->workdir);
    char *argv[8];
    int argc = 0;
    argv[argc++] = self->cc;
    argv[argc++] = kgraph;
    argv[argc++] = "-o";
    argv[argc++] = out;
    argv[argc++] = "--unsigned";
    if (args && *args) {
        argv[argc++] = "--compiler-args";
        argv[argc++] = (char *) args;
    }
    argv[argc] = NULL;

    int fds[2];
    if (pipe2 (fds, O_CLOEXEC) != 0)
        return kiln_error (err, KILN_ESYS, "pipe: %s", strerror (errno));
    int devnull = open ("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull < 0) {
        close (fds[0]);
        close (fds[1]);
        return kiln_error (err, KILN_ESYS, "/dev/null: %s", strerror (errno));
    }
    pid_t parent = getpid ();
    pid_t pid = fork ();
    if (pid < 0) {
        int e = errno;
        close (fds[0]);
        close (fds[1]);
        close (devnull);
        return kiln_error (err, KILN_ESYS, "fork: %s", strerror (e));
    }
    if (pid == 0) {
        /* The child: its own process group (so a timeout kills what it
         * starts too), dies with the worker, output into the pipe. */
        setpgid (0, 0);
        prctl (PR_SET_PDEATHSIG, SIGKILL);
        if (getppid () != parent)
            _exit (S_EXIT_EXEC);
        if (dup2 (devnull, 0) < 0 || dup2 (fds[1], 1) < 0 || dup2 (fds[1], 2) < 0
            || chdir (run->workdir) != 0)
            _exit (S_EXIT_EXEC);
        execv (argv[0], argv);
        static const char msg[] = "kiln-worker: could not execute the compiler\n";
        ssize_t ignored = write (2, msg, sizeof msg - 1);
        (void) ignored;
        _exit (S_EXIT_EXEC);
    }
    setpgid (pid, pid);      /* also here, so that a kill before the child ran works */
    close (fds[1]);
    close (devnull);
    int flags = fcntl (fds[0], F_GETFL);
    fcntl (fds[0], F_SETFL, flags | O_NONBLOCK);
    run->pid = pid;
    run->fd = fds[0];
    run->started = zclock_mono ();
    run->deadline = run->started + (int64_t) self->cfg.timeout_s * 1000;
    return 0;
}

/* --- messages to the broker -------------------------------------------------- */

static void
s_send (kiln_worker_t *self, kiln_msg_t **msg)
{
    kiln_err_t err = { 0 };
    const char *name = *msg ? kiln_cmd_name ((*msg)->cmd) : "?";
    if (!self->dealer) {
        kiln_msg_destroy (msg);
        return;
    }
    if (kiln_msg_send (msg, self->dealer, NULL, &err) != 0)
        kiln_log_warn ("could not send %s to the broker: %s", name, err.msg);
}

static void
s_send_ready (kiln_worker_t *self)
{
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_READY);
    if (!msg)
        return;
    msg->slots = (uint64_t) self->cfg.slots;
    if (kiln_msg_set_str (&msg->name, self->name) != 0
        || kiln_msg_set_str (&msg->compiler_id, KILN_COMPILER_ID) != 0
        || kiln_msg_set_str (&msg->compiler_version, KILN_COMPILER_VERSION) != 0
        || kiln_msg_set_str (&msg->target, kiln_cc_target ()) != 0) {
        kiln_msg_destroy (&msg);
        return;
    }
    s_send (self, &msg);
}

/* DONE with ok=false; `code` tells the broker whether another worker may
 * try (ECANCELED, ESYS) or the failure is final. */
static void
s_send_failure (kiln_worker_t *self, uint64_t job_id, int code, const char *message,
                const char *log)
{
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_DONE);
    if (!msg)
        return;
    msg->job_id = job_id;
    msg->ok = false;
    char text[KILN_ERR_MSG_MAX];
    snprintf (text, sizeof text, "%s", message);
    if (kiln_msg_set_error (msg, code, text, log && *log ? log : NULL) != 0) {
        kiln_msg_destroy (&msg);
        return;
    }
    s_send (self, &msg);
}

/* The child has exited: answer DONE and free the slot. */
static void
s_run_finish (kiln_worker_t *self, int slot)
{
    s_run_t *run = self->runs[slot];
    kiln_err_t err = { 0 };
    const char *log = s_run_log (run);
    long long ms = (long long) (zclock_mono () - run->started);
    char out[PATH_MAX];
    snprintf (out, sizeof out, "%s/out.kar", run->workdir);

    if (run->timed_out) {
        char text[128];
        snprintf (text, sizeof text, "compiler killed after the %d s timeout",
                  self->cfg.timeout_s);
        kiln_log_warn ("job %llu action %.12s: %s", (unsigned long long) run->id,
                       run->action_key, text);
        s_send_failure (self, run->id, KILN_ETIMEOUT, text, log);
    }
    else if (WIFEXITED (run->status) && WEXITSTATUS (run->status) == 0) {
        uint8_t *bytes = NULL;
        size_t len = 0;
        kiln_msg_t *msg = kiln_msg_new (KILN_CMD_DONE);
        if (!msg || kiln_read_file (out, KILN_MAX_ARTIFACT_BYTES, &bytes, &len, &err) != 0
            || kiln_msg_put_artifact (msg, bytes, len, &err) != 0
            || (run->log_len && kiln_msg_set_str (&msg->log, log) != 0)) {
            kiln_msg_destroy (&msg);
            kiln_log_err ("job %llu action %.12s: the compiler succeeded but its artifact "
                          "cannot be sent: %s", (unsigned long long) run->id,
                          run->action_key, err.msg);
            s_send_failure (self, run->id, KILN_ECOMPILE, err.msg, log);
        }
        else {
            msg->job_id = run->id;
            msg->ok = true;
            kiln_log_notice ("job %llu action %.12s: compiled in %lld ms (%zu bytes)",
                             (unsigned long long) run->id, run->action_key, ms, len);
            s_send (self, &msg);
        }
        free (bytes);
    }
    else {
        char text[PATH_MAX + 64];
        int code = KILN_ECOMPILE;
        if (WIFEXITED (run->status) && WEXITSTATUS (run->status) == S_EXIT_EXEC) {
            snprintf (text, sizeof text, "could not run the compiler '%s'", self->cc);
            code = KILN_ESYS;
        }
        else if (WIFEXITED (run->status))
            snprintf (text, sizeof text, "compiler exited with status %d",
                      WEXITSTATUS (run->status));
        else
            snprintf (text, sizeof text, "compiler killed by signal %d",
                      WTERMSIG (run->status));
        kiln_log_warn ("job %llu action %.12s: %s after %lld ms",
                       (unsigned long long) run->id, run->action_key, text, ms);
        s_send_failure (self, run->id, code, text, log);
    }
    s_run_destroy (&self->runs[slot]);
}

/* Write the job's graph into a fresh workdir and start the compiler. */
static void
s_on_job (kiln_worker_t *self, kiln_msg_t *msg)
{
    kiln_err_t err = { 0 };
    int slot = -1;
    for (int i = 0; i < self->cfg.slots && slot < 0; i++)
        if (!self->runs[i])
            slot = i;
    if (slot < 0) {
        kiln_log_warn ("job %llu: all %d slots busy; giving it back",
                       (unsigned long long) msg->job_id, self->cfg.slots);
        s_send_failure (self, msg->job_id, KILN_ECANCELED, "worker has no free slot", NULL);
        return;
    }
    int code = KILN_ESYS;
    kiln_graph_t *g = NULL;
    uint8_t *structure = NULL;
    size_t struct_len = 0;
    s_run_t *run = calloc (1, sizeof *run);
    if (!run || !(run->log = malloc (KILN_MAX_LOG_BYTES + 1))) {
        free (run);
        run = NULL;
        kiln_error (&err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    run->fd = -1;
    run->id = msg->job_id;
    memcpy (run->action_key, msg->action_key, KILN_HEX_LEN);
    if (!(run->workdir = kiln_mkdtemp ("kiln-job-", &err)))
        goto fail;

    code = KILN_EPROTO;
    if (kiln_msg_part (msg, 0, &structure, &struct_len, &err) != 0
        || !(g = kiln_graph_decode (structure, struct_len, &err)))
        goto fail;
    for (uint32_t i = 0; i < msg->n_blobs; i++) {
        uint8_t *data = NULL;
        size_t len = 0;
        if (kiln_msg_part (msg, 1 + i, &data, &len, &err) != 0)
            goto fail;
        int used = kiln_graph_attach_blob (g, msg->blobs[i].digest, data, len, &err);
        free (data);
        if (used < 0)
            goto fail;
    }
    if (!kiln_graph_complete (g)) {
        kiln_error (&err, KILN_EPROTO, "the job's graph is missing weight data");
        goto fail;
    }
    char kgraph[PATH_MAX];
    snprintf (kgraph, sizeof kgraph, "%s/model.kgraph", run->workdir);
    code = KILN_ESYS;
    if (kiln_graph_save (g, kgraph, &err) != 0
        || s_run_spawn (self, run, msg->compiler_args, &err) != 0)
        goto fail;
    kiln_log_notice ("job %llu action %.12s: compiling in %s (args '%s')",
                     (unsigned long long) run->id, run->action_key, run->workdir,
                     msg->compiler_args ? msg->compiler_args : "");
    self->runs[slot] = run;
    kiln_graph_destroy (&g);
    free (structure);
    return;
fail:
    kiln_log_err ("job %llu: %s", (unsigned long long) msg->job_id, err.msg);
    s_send_failure (self, msg->job_id, code, err.msg, NULL);
    s_run_destroy (&run);
    kiln_graph_destroy (&g);
    free (structure);
}

/* Stop every child and forget its job: used when the broker that gave the
 * jobs is gone (it requeues them) and at shutdown. */
static void
s_drop_runs (kiln_worker_t *self, const char *why)
{
    for (int i = 0; i < self->cfg.slots; i++)
        if (self->runs[i]) {
            kiln_log_notice ("job %llu action %.12s: stopped: %s",
                             (unsigned long long) self->runs[i]->id,
                             self->runs[i]->action_key, why);
            s_run_destroy (&self->runs[i]);
        }
}

/* --- the loop ---------------------------------------------------------------- */

static int
s_on_message (zloop_t *loop, zsock_t *sock, void *arg)
{
    kiln_worker_t *self = arg;
    kiln_err_t err = { 0 };
    kiln_msg_t *msg = kiln_msg_recv (sock, NULL, NULL, &err);
    if (!msg) {
        if (err.code == KILN_ECANCELED)
            return 0;
        /* It may have been a JOB, which the broker now counts as ours and
         * would wait for forever.  Registering again makes it requeue
         * whatever it thinks we hold (at most max_attempts times). */
        kiln_log_err ("unreadable message from the broker: %s; registering again",
                      err.msg);
        s_drop_runs (self, "unreadable message from the broker");
        s_send_ready (self);
        return 0;
    }
    self->broker_seen = zclock_mono ();
    switch (msg->cmd) {
    case KILN_CMD_JOB:
        s_on_job (self, msg);
        break;
    case KILN_CMD_HEARTBEAT:
        break;
    case KILN_CMD_ERROR:
        kiln_log_warn ("broker says %s: %s", kiln_errname ((int) msg->code), msg->message);
        if (msg->code == KILN_ENOTFOUND) {
            /* The broker does not know us (it restarted): whatever we run
             * was given by its previous life. */
            s_drop_runs (self, "the broker restarted");
            s_send_ready (self);
        }
        break;
    default:
        kiln_log_warn ("ignored %s from the broker", kiln_cmd_name (msg->cmd));
        break;
    }
    kiln_msg_destroy (&msg);
    return 0;
}

/* Every tick: collect output, enforce timeouts, reap children. */
static int
s_on_tick (zloop_t *loop, int timer_id, void *arg)
{
    kiln_worker_t *self = arg;
    int64_t now = zclock_mono ();
    for (int i = 0; i < self->cfg.slots; i++) {
        s_run_t *run = self->runs[i];
        if (!run)
            continue;
        s_run_drain (run);
        if (!run->exited) {
            pid_t r = waitpid (run->pid, &run->status, WNOHANG);
            if (r == run->pid)
                run->exited = true;
            else if (r < 0 && errno != EINTR) {
                run->exited = true;          /* not ours any more: treat as failed */
                run->status = S_EXIT_EXEC << 8;
            }
        }
        if (!run->exited && !run->timed_out && now > run->deadline) {
            kill (-run->pid, SIGKILL);
            run->timed_out = true;
        }
        if (run->exited) {
            s_run_drain (run);
            s_run_finish (self, i);
        }
    }
    return 0;
}

static int
s_on_heartbeat (zloop_t *loop, int timer_id, void *arg)
{
    kiln_worker_t *self = arg;
    if (zclock_mono () - self->broker_seen > self->cfg.liveness_ms) {
        self->reconnect = true;
        return -1;                           /* leave the loop; run() reconnects */
    }
    kiln_msg_t *hb = kiln_msg_new (KILN_CMD_HEARTBEAT);
    if (hb)
        s_send (self, &hb);
    return 0;
}

static void
s_disconnect (kiln_worker_t *self)
{
    if (!self->dealer)
        return;
    zloop_reader_end (self->loop, self->dealer);
    zsock_destroy (&self->dealer);
}

static int
s_connect (kiln_worker_t *self, kiln_err_t *err)
{
    self->dealer = zsock_new (ZMQ_DEALER);
    if (!self->dealer)
        return kiln_error (err, KILN_ESYS, "could not create a ZeroMQ socket");
    kiln_proto_socket_defaults (self->dealer);
    zsock_set_sndtimeo (self->dealer, 0);
    if (strstr (self->endpoint, "[::1]"))
        zsock_set_ipv6 (self->dealer, 1);
    if (zsock_connect (self->dealer, "%s", self->endpoint) != 0) {
        zsock_destroy (&self->dealer);
        return kiln_error (err, KILN_EINVAL, "could not connect to '%s': %s", self->endpoint,
                           zmq_strerror (zmq_errno ()));
    }
    if (zloop_reader (self->loop, self->dealer, s_on_message, self) != 0) {
        zsock_destroy (&self->dealer);
        return kiln_error (err, KILN_ESYS, "could not watch the socket");
    }
    zloop_reader_set_tolerant (self->loop, self->dealer);
    self->broker_seen = zclock_mono ();
    s_send_ready (self);
    return 0;
}

kiln_worker_t *
kiln_worker_new (const kiln_worker_config_t *cfg, kiln_err_t *err)
{
    if (!cfg->endpoint) {
        kiln_error (err, KILN_EINVAL, "the worker needs a broker endpoint");
        return NULL;
    }
    kiln_worker_t *self = calloc (1, sizeof *self);
    if (!self) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    self->cfg = *cfg;
    if (self->cfg.slots <= 0)
        self->cfg.slots = 1;
    if (self->cfg.timeout_s <= 0)
        self->cfg.timeout_s = 600;
    if (self->cfg.heartbeat_ms <= 0)
        self->cfg.heartbeat_ms = 1000;
    if (self->cfg.liveness_ms <= 0)
        self->cfg.liveness_ms = 5000;
    if (self->cfg.slots > KILN_PROTO_MAX_SLOTS) {
        kiln_error (err, KILN_EINVAL, "--slots %d is more than %d", self->cfg.slots,
                    KILN_PROTO_MAX_SLOTS);
        goto fail;
    }
    if (cfg->name)
        snprintf (self->name, sizeof self->name, "%s", cfg->name);
    else {
        char host[64] = "worker";
        gethostname (host, sizeof host - 1);
        snprintf (self->name, sizeof self->name, "%s:%d", host, (int) getpid ());
    }
    if (!kiln_proto_name_ok (self->name)) {
        kiln_error (err, KILN_EINVAL, "worker name '%s' must be 1..%d characters of "
                    "[A-Za-z0-9._:@-]", self->name, KILN_PROTO_MAX_NAME);
        goto fail;
    }
    if (cfg->cc_path) {
        if (snprintf (self->cc, sizeof self->cc, "%s", cfg->cc_path) >= (int) sizeof self->cc) {
            kiln_error (err, KILN_ELIMIT, "compiler path too long");
            goto fail;
        }
    }
    else {
        char dir[PATH_MAX - 16];
        if (kiln_exe_dir (dir, sizeof dir, err) != 0)
            goto fail;
        snprintf (self->cc, sizeof self->cc, "%s/kiln-cc", dir);
    }
    if (access (self->cc, X_OK) != 0) {
        kiln_error (err, KILN_ENOTFOUND, "compiler '%s' is not an executable file", self->cc);
        goto fail;
    }
    self->endpoint = strdup (cfg->endpoint);
    self->runs = calloc ((size_t) self->cfg.slots, sizeof *self->runs);
    self->loop = zloop_new ();
    if (!self->endpoint || !self->runs || !self->loop) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    self->cfg.endpoint = self->endpoint;
    self->cfg.name = NULL;
    self->cfg.cc_path = NULL;
    if (zloop_timer (self->loop, S_TICK_MS, 0, s_on_tick, self) < 0
        || zloop_timer (self->loop, (size_t) self->cfg.heartbeat_ms, 0, s_on_heartbeat,
                        self) < 0) {
        kiln_error (err, KILN_ESYS, "could not set up the event loop");
        goto fail;
    }
    return self;
fail:
    kiln_worker_destroy (&self);
    return NULL;
}

void
kiln_worker_destroy (kiln_worker_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_worker_t *self = *self_p;
    if (self->runs)
        for (int i = 0; i < self->cfg.slots; i++)
            s_run_destroy (&self->runs[i]);
    free (self->runs);
    if (self->loop)
        s_disconnect (self);
    zloop_destroy (&self->loop);
    free (self->endpoint);
    free (self);
    *self_p = NULL;
}

int
kiln_worker_run (kiln_worker_t *self)
{
    kiln_err_t err = { 0 };
    kiln_log_notice ("worker %s: %d slot%s, compiler %s (%s %s for %s), broker %s",
                     self->name, self->cfg.slots, self->cfg.slots == 1 ? "" : "s", self->cc,
                     KILN_COMPILER_ID, KILN_COMPILER_VERSION, kiln_cc_target (),
                     self->endpoint);
    /* One pass per connection: the loop ends on a signal, or when the
     * broker has been silent too long and the worker starts afresh. */
    while (!zsys_interrupted) {
        if (s_connect (self, &err) != 0) {
            kiln_log_err ("%s", err.msg);
            return -1;
        }
        self->reconnect = false;
        zloop_start (self->loop);
        if (!self->reconnect)
            break;
        kiln_log_warn ("no word from the broker for %d ms; connecting again",
                       self->cfg.liveness_ms);
        s_drop_runs (self, "lost the broker");
        s_disconnect (self);
    }
    kiln_log_notice ("stopping");
    s_drop_runs (self, "worker stopping");
    if (self->dealer) {
        kiln_msg_t *bye = kiln_msg_new (KILN_CMD_DISCONNECT);
        if (bye)
            s_send (self, &bye);
        zsock_set_linger (self->dealer, 500);   /* let DISCONNECT leave */
        s_disconnect (self);
    }
    return 0;
}
