/*
 * kiln_worker — registration, heartbeats, blob fetching, jobs and their
 * child processes.
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
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <czmq.h>
#include <msgpack.h>

#include "common/kiln_fs.h"
#include "common/kiln_log.h"
#include "common/kiln_mpk.h"
#include "common/kiln_proto.h"
#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"
#include "worker/kiln_blobcache.h"
#include "worker/kiln_outgoing.h"
#include "worker/kiln_sandbox.h"
#include "worker/kiln_toolchain.h"

#define S_TICK_MS        25      /* how often children are looked at anyway */
#define S_LOG_RESERVE    96      /* room for the "[log cut]" note */
#define S_EXIT_EXEC      127     /* the child's status when exec failed */
#define S_EXIT_WRAP      125     /* the wrapper's status when wrapping failed */
#define S_EXIT_KGRAPH    124     /* the child's status when model.kgraph could not be written */
#define S_MAX_READS      64      /* pipe reads per child per wake-up */
#define S_LOG_EVERY_MS   1000    /* new output goes to the broker this often */
#define S_LOG_CHUNK      (64u << 10)   /* at most this much per LOG */
#define S_FETCH_STALL_MS 30000   /* a fetch with no chunk for this long fails its job */
#define S_READY_BLOBS    4096    /* cached blobs named in READY */

/* A job's phases: its blobs arrive; its toolchain runs (kiln-cc, or an
 * external command); an external toolchain's big output is wrapped by a
 * second child (see kiln_toolchain.h). */
typedef enum { S_FETCHING, S_RUNNING, S_WRAPPING } s_phase_t;

/* One blob being downloaded from the broker. */
typedef struct {
    char hex[KILN_HEX_LEN];
    uint8_t digest[KILN_DIGEST_LEN];
    uint64_t size;
    uint64_t requested;                  /* bytes asked for so far */
    uint64_t job_id;                     /* the job it is fetched for */
    int64_t last_chunk;                  /* zclock_mono */
    kiln_blobcache_writer_t *writer;     /* owned */
} s_fetch_t;

/* One job: fetching its blobs, then running in a child process. */
typedef struct {
    uint64_t id;                         /* the broker's job id */
    int slot;                            /* its index in runs[] */
    char action_key[KILN_HEX_LEN];
    char graph_digest[KILN_HEX_LEN];
    const kiln_toolchain_t *tc;          /* one of the worker's */
    char *args;                          /* normalised compiler args, owned */
    uint8_t *structure;                  /* owned */
    size_t struct_len;
    kiln_blob_ref_t *blobs;              /* owned */
    uint32_t n_blobs;
    bool pinned;                         /* its blobs are pinned in the cache */
    s_phase_t phase;
    uint64_t timeout_ms;                 /* effective */
    char *workdir;                       /* private temp dir, owned */
    pid_t pid;                           /* child; also its process group */
    int fd;                              /* read end of its stdout/stderr, or -1 */
    int pidfd;                           /* readable when the child exits, or -1 */
    char *log;                           /* captured output, owned */
    size_t log_len;
    size_t log_sent;                     /* bytes already sent as LOG */
    size_t log_dropped;                  /* bytes past the bound, not kept */
    int64_t received;                    /* zclock_mono when the JOB came */
    int64_t started;                     /* zclock_mono when the child started */
    int64_t deadline;                    /* zclock_mono after which it is killed */
    int64_t log_at;                      /* zclock_mono of the last LOG */
    bool timed_out;
    bool exited;
    int status;                          /* waitpid status once exited */
} s_run_t;

struct kiln_worker {
    kiln_worker_config_t cfg;            /* with defaults; strings point below */
    char *endpoint;                      /* owned */
    char name[KILN_PROTO_MAX_NAME + 1];
    char cc[PATH_MAX];                   /* the builtin compiler program */
    char self_exe[PATH_MAX];             /* this program, for --wrap */
    kiln_toolchain_t *toolchains;        /* owned */
    int n_toolchains;
    char *cache_dir;                     /* owned */
    bool own_cache;                      /* remove it at exit */
    kiln_blobcache_t *cache;
    kiln_sandbox_t *sandbox;             /* how children run (kiln_sandbox.h) */
    zsock_t *dealer;                     /* to the broker; NULL when down */
    zactor_t *monitor;                   /* zmonitor on dealer: refused handshakes */
    zloop_t *loop;
    s_run_t **runs;                      /* cfg.slots entries, NULL = free */
    zhashx_t *fetches;                   /* hex digest -> s_fetch_t (owns) */
    kiln_outgoing_t *outgoing;           /* large artifacts the broker collects */
    int64_t broker_seen;                 /* zclock_mono of the broker's last message */
    uint64_t session;                    /* of our last READY; JOBs of older ones are stale */
    bool reconnect;                      /* the loop stopped to reconnect */
    int64_t refused_at;                  /* zclock_mono of a READY the broker refused
                                            (EBUSY: our name is taken); 0 = none */
};

static void s_run_advance (kiln_worker_t *self, int slot);

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
    msg->max_memory = kiln_sandbox_max_memory (self->sandbox);
    msg->session = ++self->session;
    int rc = kiln_msg_set_str (&msg->name, self->name);
    for (int i = 0; rc == 0 && i < self->n_toolchains; i++) {
        char tc[KILN_PROTO_MAX_TOOLCHAIN + 1];
        rc = kiln_msg_add_strs (&msg->toolchains, &msg->n_toolchains,
                                kiln_toolchain_format (&self->toolchains[i].id, tc, sizeof tc));
    }
    uint8_t (*digests)[KILN_DIGEST_LEN] = malloc (S_READY_BLOBS * KILN_DIGEST_LEN);
    uint64_t *sizes = malloc (S_READY_BLOBS * sizeof *sizes);
    if (rc == 0 && digests && sizes) {
        size_t n = kiln_blobcache_list (self->cache, digests, sizes, S_READY_BLOBS);
        msg->blobs = calloc (n ? n : 1, sizeof *msg->blobs);
        for (size_t i = 0; msg->blobs && i < n; i++) {
            memcpy (msg->blobs[i].digest, digests[i], KILN_DIGEST_LEN);
            msg->blobs[i].size = sizes[i];
            msg->n_blobs++;
        }
    }
    free (digests);
    free (sizes);
    if (rc != 0) {
        kiln_msg_destroy (&msg);
        return;
    }
    s_send (self, &msg);
}

/* DONE with ok=false; `code` tells the broker whether another worker may
 * try (ECANCELED, ESYS, EIO, EVERIFY, ENOTFOUND) or the failure is final. */
static void
s_send_failure_oom (kiln_worker_t *self, uint64_t job_id, int code, const char *message,
                    const char *log, bool oom)
{
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_DONE);
    if (!msg)
        return;
    msg->job_id = job_id;
    msg->ok = false;
    msg->out_of_memory = oom;
    char text[KILN_ERR_MSG_MAX];
    snprintf (text, sizeof text, "%s", message);
    if (kiln_msg_set_error (msg, code, text, log && *log ? log : NULL) != 0) {
        kiln_msg_destroy (&msg);
        return;
    }
    s_send (self, &msg);
}

static void
s_send_failure (kiln_worker_t *self, uint64_t job_id, int code, const char *message,
                const char *log)
{
    s_send_failure_oom (self, job_id, code, message, log, false);
}

/* --- runs ------------------------------------------------------------------ */

static void
s_run_unwatch (kiln_worker_t *self, s_run_t *run)
{
    if (run->pidfd >= 0) {
        zmq_pollitem_t item = { NULL, run->pidfd, ZMQ_POLLIN, 0 };
        zloop_poller_end (self->loop, &item);
        close (run->pidfd);
        run->pidfd = -1;
    }
    if (run->fd >= 0) {
        zmq_pollitem_t item = { NULL, run->fd, ZMQ_POLLIN, 0 };
        zloop_poller_end (self->loop, &item);
        close (run->fd);
        run->fd = -1;
    }
}

/* Kill a child's process group, reap it, stop watching it, remove its
 * workdir, unpin its blobs, drop its fetches and free the run. */
static void
s_run_destroy (kiln_worker_t *self, s_run_t **self_p)
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
    s_run_unwatch (self, run);
    if (run->workdir) {
        kiln_rm_rf (run->workdir);
        free (run->workdir);
    }
    if (run->pinned)
        for (uint32_t i = 0; i < run->n_blobs; i++)
            kiln_blobcache_unpin (self->cache, run->blobs[i].digest);
    zlistx_t *mine = zlistx_new ();
    for (s_fetch_t *f = zhashx_first (self->fetches); mine && f; f = zhashx_next (self->fetches))
        if (f->job_id == run->id)
            zlistx_add_end (mine, f->hex);
    for (const char *hex = mine ? zlistx_first (mine) : NULL; hex; hex = zlistx_next (mine))
        zhashx_delete (self->fetches, hex);
    zlistx_destroy (&mine);
    free (run->args);
    free (run->structure);
    free (run->blobs);
    free (run->log);
    free (run);
    *self_p = NULL;
}

/* Read what the child wrote, keeping at most the log bound; at the end
 * of the output stop watching the pipe. */
static void
s_run_drain (kiln_worker_t *self, s_run_t *run)
{
    char buf[16384];
    for (int i = 0; run->fd >= 0 && i < S_MAX_READS; i++) {
        ssize_t n = read (run->fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n == 0) {
            zmq_pollitem_t item = { NULL, run->fd, ZMQ_POLLIN, 0 };
            zloop_poller_end (self->loop, &item);
            close (run->fd);
            run->fd = -1;
            return;
        }
        if (n < 0)
            return;              /* EAGAIN: nothing more for now */
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

/* Send the output written since the last LOG. */
static void
s_run_send_log (kiln_worker_t *self, s_run_t *run)
{
    if (run->log_sent >= run->log_len)
        return;
    size_t n = run->log_len - run->log_sent;
    if (n > S_LOG_CHUNK)
        n = S_LOG_CHUNK;
    char *text = malloc (n + 1);
    kiln_msg_t *msg = text ? kiln_msg_new (KILN_CMD_LOG) : NULL;
    if (!msg) {
        free (text);
        return;
    }
    memcpy (text, run->log + run->log_sent, n);
    text[n] = '\0';
    msg->job_id = run->id;
    msg->log = text;
    run->log_sent += n;
    run->log_at = zclock_mono ();
    s_send (self, &msg);
}

/* WORKDIR/model.kgraph, as the compile's child writes it before it runs
 * the toolchain: everything that needs memory or the blob cache is worked
 * out here, so that the child (after fork) only opens, writes and copies
 * (copy_file_range, in the kernel), and the worker's loop does not stall
 * for the seconds that copying gigabytes of weights takes.  The layout is
 * the .kgraph's (docs/graph-format.md): a map {"format", "version",
 * "graph"}, then one [digest, data] pair per blob. */
typedef struct {
    uint8_t *head;                       /* the header map, packed */
    size_t head_len;
    uint32_t n;
    uint8_t (*pair)[KILN_GRAPH_BLOB_HEAD_MAX];   /* per blob: array(2), bin digest, bin head */
    uint8_t *pair_len;
    char **path;                         /* per blob: its file in the cache */
    uint64_t *size;
} s_kgraph_t;

static void
s_kgraph_free (s_kgraph_t *k)
{
    if (!k)
        return;
    for (uint32_t i = 0; k->path && i < k->n; i++)
        free (k->path[i]);
    free (k->path);
    free (k->pair);
    free (k->pair_len);
    free (k->size);
    free (k->head);
    free (k);
}

static s_kgraph_t *
s_kgraph_plan (kiln_worker_t *self, s_run_t *run, kiln_err_t *err)
{
    s_kgraph_t *k = calloc (1, sizeof *k);
    msgpack_sbuffer sbuf;
    msgpack_sbuffer_init (&sbuf);
    msgpack_packer pk;
    msgpack_packer_init (&pk, &sbuf, msgpack_sbuffer_write);
    uint32_t n = run->n_blobs;
    if (!k || !(k->pair = calloc (n + 1, sizeof *k->pair))
        || !(k->pair_len = calloc (n + 1, 1)) || !(k->path = calloc (n + 1, sizeof *k->path))
        || !(k->size = calloc (n + 1, sizeof *k->size))) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    k->n = n;
    msgpack_pack_map (&pk, 3);
    kiln_mpk_pack_kv_str (&pk, "format", "kiln-graph");
    kiln_mpk_pack_kv_i64 (&pk, "version", KILN_GRAPH_FORMAT_VERSION);
    kiln_mpk_pack_kv_bin (&pk, "graph", run->structure, run->struct_len);
    if (!(k->head = malloc (sbuf.size))) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    memcpy (k->head, sbuf.data, sbuf.size);
    k->head_len = sbuf.size;
    uint64_t at = sbuf.size;
    for (uint32_t i = 0; i < n; i++) {
        const kiln_blob_ref_t *b = &run->blobs[i];
        k->pair_len[i] = (uint8_t) kiln_graph_blob_head (at, b->digest, b->size, k->pair[i]);
        at += k->pair_len[i] + b->size;
        k->size[i] = b->size;
        char blob[PATH_MAX];
        if (kiln_blobcache_path (self->cache, b->digest, blob, sizeof blob, err) != 0)
            goto fail;
        if (!(k->path[i] = strdup (blob))) {
            kiln_error (err, KILN_ENOMEM, "out of memory");
            goto fail;
        }
    }
    msgpack_sbuffer_destroy (&sbuf);
    /* Created empty here, so that the sandbox's preparation gives it to the
     * compile's user with the rest of the job's directory; the child fills it. */
    char path[PATH_MAX];
    snprintf (path, sizeof path, "%s/model.kgraph", run->workdir);
    int fd = open (path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        kiln_error (err, KILN_EIO, "could not create '%s': %s", path, strerror (errno));
        s_kgraph_free (k);
        return NULL;
    }
    close (fd);
    return k;
fail:
    msgpack_sbuffer_destroy (&sbuf);
    s_kgraph_free (k);
    return NULL;
}

/* write(2) all of it, in the child. */
static bool
s_child_write (int fd, const uint8_t *p, size_t len)
{
    while (len > 0) {
        ssize_t n = write (fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return false;
        p += n;
        len -= (size_t) n;
    }
    return true;
}

/* In the child, after fork: write the planned kgraph at `path` with
 * system calls only.  False (errno set) on failure. */
static bool
s_kgraph_write_child (const s_kgraph_t *k, const char *path)
{
    int fd = open (path, O_WRONLY | O_TRUNC | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0 || !s_child_write (fd, k->head, k->head_len))
        return false;
    for (uint32_t i = 0; i < k->n; i++) {
        if (!s_child_write (fd, k->pair[i], k->pair_len[i]))
            return false;
        int in = open (k->path[i], O_RDONLY | O_CLOEXEC);
        if (in < 0)
            return false;
        uint64_t left = k->size[i];
        while (left > 0) {
            ssize_t n = copy_file_range (in, NULL, fd, NULL, (size_t) left, 0);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0) {
                if (n == 0)
                    errno = EIO;         /* the cached blob is short */
                close (in);
                return false;
            }
            left -= (uint64_t) n;
        }
        close (in);
    }
    return close (fd) == 0;
}

static int
s_on_child_event (zloop_t *loop, zmq_pollitem_t *item, void *arg);

/* Start the toolchain on WORKDIR/model.kgraph.  The argument vector is
 * built before fork so that the child only calls async-signal-safe
 * functions. */
static int
s_run_spawn (kiln_worker_t *self, s_run_t *run, const s_kgraph_t *kgraph_plan,
             kiln_err_t *err)
{
    char kgraph[PATH_MAX], out[PATH_MAX], tool_out[PATH_MAX], tc[KILN_PROTO_MAX_TOOLCHAIN + 1];
    snprintf (kgraph, sizeof kgraph, "%s/model.kgraph", run->workdir);
    snprintf (out, sizeof out, "%s/out.kar", run->workdir);
    snprintf (tool_out, sizeof tool_out, "%s/toolchain.out", run->workdir);
    if (!run->tc->builtin && run->phase == S_RUNNING
        && kiln_toolchain_create_output (tool_out, err) != 0)
        return -err->code;
    char *fixed[24];
    char **argv = fixed, **command = NULL;
    int argc = 0;
    if (run->tc->builtin) {
        argv[argc++] = self->cc;
        argv[argc++] = kgraph;
        argv[argc++] = "-o";
        argv[argc++] = out;
        argv[argc++] = "--unsigned";
        if (run->args[0]) {
            argv[argc++] = "--compiler-args";
            argv[argc++] = run->args;
        }
        argv[argc] = NULL;
    }
    else if (run->phase == S_RUNNING) {
        /* The command itself, with no process of ours around it. */
        command = kiln_toolchain_argv (run->tc, kgraph, tool_out, run->workdir, run->args, err);
        if (!command)
            return -err->code;
        argv = command;
    }
    else {
        argv[argc++] = self->self_exe;
        argv[argc++] = "--wrap";
        argv[argc++] = "--graph";
        argv[argc++] = kgraph;
        argv[argc++] = "--output";
        argv[argc++] = tool_out;
        argv[argc++] = "--kar";
        argv[argc++] = out;
        argv[argc++] = "--action-key";
        argv[argc++] = run->action_key;
        argv[argc++] = "--graph-digest";
        argv[argc++] = run->graph_digest;
        argv[argc++] = "--args";
        argv[argc++] = run->args;
        argv[argc++] = "--toolchain";
        argv[argc++] = kiln_toolchain_format (&run->tc->id, tc, sizeof tc);
        argv[argc++] = "--";
        argv[argc] = NULL;
    }
    /* The child runs in the sandbox, under the job's limits; what it
     * runs is prepared here. */
    kiln_sandbox_cmd_t sb;
    int64_t left_ms = run->phase == S_WRAPPING ? run->deadline - zclock_mono ()
                                               : (int64_t) run->timeout_ms;
    char *cc_file[] = { self->cc };
    bool tool = run->phase == S_RUNNING && !run->tc->builtin;
    int rc = kiln_sandbox_prepare (self->sandbox, run->slot, run->workdir, argv,
                                   tool ? run->tc->words : cc_file,
                                   tool ? run->tc->n_words : run->tc->builtin ? 1 : 0,
                                   left_ms > 0 ? (uint64_t) left_ms : 1, &sb, err);
    int fds[2] = { -1, -1 };
    int devnull = -1;
    if (rc != 0)
        goto done;
    if (pipe2 (fds, O_CLOEXEC) != 0) {
        rc = kiln_error (err, KILN_ESYS, "pipe: %s", strerror (errno));
        goto done;
    }
    devnull = open ("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull < 0) {
        rc = kiln_error (err, KILN_ESYS, "/dev/null: %s", strerror (errno));
        goto done;
    }
    pid_t parent = getpid ();
    pid_t pid = fork ();
    if (pid < 0) {
        rc = kiln_error (err, KILN_ESYS, "fork: %s", strerror (errno));
        goto done;
    }
    if (pid == 0) {
        /* The child: its own process group (so a timeout kills what it
         * starts too), dies with the worker, output into the pipe, then
         * the sandbox and the limits (kiln_sandbox_exec does not
         * return). */
        setpgid (0, 0);
        prctl (PR_SET_PDEATHSIG, SIGKILL);
        if (getppid () != parent)
            _exit (S_EXIT_EXEC);
        if (dup2 (devnull, 0) < 0 || dup2 (fds[1], 1) < 0 || dup2 (fds[1], 2) < 0)
            _exit (S_EXIT_EXEC);
        if (kgraph_plan && !s_kgraph_write_child (kgraph_plan, kgraph)) {
            static const char text[] = "kiln-worker: could not write the job's model.kgraph\n";
            ssize_t ignored = write (2, text, sizeof text - 1);
            (void) ignored;
            _exit (S_EXIT_KGRAPH);
        }
        kiln_sandbox_exec (&sb);
    }
    setpgid (pid, pid);      /* also here, so that a kill before the child ran works */
    int flags = fcntl (fds[0], F_GETFL);
    fcntl (fds[0], F_SETFL, flags | O_NONBLOCK);
    run->pid = pid;
    run->fd = fds[0];
    fds[0] = -1;
    run->started = zclock_mono ();
    run->log_at = run->started;
    run->deadline = run->started + (int64_t) run->timeout_ms;
    /* Wake up when the child exits (pidfd) or writes, not on the next tick. */
    run->pidfd = (int) syscall (SYS_pidfd_open, pid, 0);
    zmq_pollitem_t item = { NULL, run->fd, ZMQ_POLLIN, 0 };
    zloop_poller (self->loop, &item, s_on_child_event, self);
    if (run->pidfd >= 0) {
        zmq_pollitem_t pitem = { NULL, run->pidfd, ZMQ_POLLIN, 0 };
        zloop_poller (self->loop, &pitem, s_on_child_event, self);
    }
done:
    if (fds[0] >= 0)
        close (fds[0]);
    if (fds[1] >= 0)
        close (fds[1]);
    if (devnull >= 0)
        close (devnull);
    kiln_sandbox_cmd_release (&sb);
    kiln_toolchain_argv_free (command);
    return rc;
}

/* DONE with the unsigned artifact (consumes *bytes). */
static void
s_send_artifact (kiln_worker_t *self, s_run_t *run, uint8_t **bytes, size_t len,
                 const char *log)
{
    kiln_err_t err = { 0 };
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_DONE);
    if (!msg || kiln_msg_put_artifact (msg, *bytes, len, &err) != 0
        || (log && *log && kiln_msg_set_str (&msg->log, log) != 0)) {
        kiln_msg_destroy (&msg);
        kiln_log_err ("job %llu action %.12s: the artifact cannot be sent: %s",
                      (unsigned long long) run->id, run->action_key, err.msg);
        s_send_failure (self, run->id, KILN_ECOMPILE, err.msg, log);
    }
    else {
        msg->job_id = run->id;
        msg->ok = true;
        kiln_log_notice ("job %llu action %.12s: compiled in %lld ms (%zu bytes)",
                         (unsigned long long) run->id, run->action_key,
                         (long long) (zclock_mono () - run->started), len);
        s_send (self, &msg);
    }
    free (*bytes);
    *bytes = NULL;
}

/* DONE for an artifact too large for one message: its size only; the
 * file is kept open for the broker's COLLECTs (kiln_outgoing.h).  False
 * when the artifact at `path` is small (or unreadable): the caller sends
 * it inline, or reports why it cannot. */
static bool
s_send_artifact_apart (kiln_worker_t *self, s_run_t *run, const char *path, const char *log)
{
    int fd = open (path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat (fd, &st) != 0 || !S_ISREG (st.st_mode)
        || (uint64_t) st.st_size <= KILN_PROTO_INLINE_TOTAL
        || (uint64_t) st.st_size > KILN_MAX_ARTIFACT_BYTES) {
        if (fd >= 0)
            close (fd);
        return false;
    }
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_DONE);
    if (!msg || (log && *log && kiln_msg_set_str (&msg->log, log) != 0)) {
        kiln_msg_destroy (&msg);
        close (fd);
        return false;
    }
    msg->job_id = run->id;
    msg->ok = true;
    msg->artifact_apart = (uint64_t) st.st_size;
    kiln_outgoing_add (self->outgoing, run->id, &fd, (uint64_t) st.st_size);
    kiln_log_notice ("job %llu action %.12s: compiled in %lld ms (%llu bytes, to be collected)",
                     (unsigned long long) run->id, run->action_key,
                     (long long) (zclock_mono () - run->started),
                     (unsigned long long) st.st_size);
    s_send (self, &msg);
    return true;
}

/* COLLECT: send the broker the slices of an artifact it asked for. */
static void
s_on_collect (kiln_worker_t *self, kiln_msg_t *msg)
{
    kiln_err_t err = { 0 };
    if (!self->dealer
        || kiln_outgoing_collect (self->outgoing, self->dealer, msg->job_id, msg->offset,
                                  msg->count, &err) == 0)
        return;
    kiln_log_warn ("%s", err.msg);
    s_send_failure (self, msg->job_id, err.code == KILN_ENOTFOUND ? KILN_ENOTFOUND : KILN_EIO,
                    err.msg, NULL);
}

/* The job's keys, for wrapping an external toolchain's output. */
static kiln_wrap_job_t
s_wrap_job (s_run_t *run, const char *kgraph, const char *output, const char *kar)
{
    kiln_wrap_job_t job = { kgraph, output, kar, run->action_key, run->graph_digest, run->args,
                            run->tc->id };
    return job;
}

/* An external toolchain succeeded: wrap {output} here when it is small,
 * else start the wrapper child.  Returns true when the run goes on (the
 * wrapper runs), false when DONE (or the failure) was sent. */
static bool
s_wrap_output (kiln_worker_t *self, int slot, const char *log)
{
    s_run_t *run = self->runs[slot];
    kiln_err_t err = { 0 };
    char kgraph[PATH_MAX], tool_out[PATH_MAX], kar_path[PATH_MAX];
    snprintf (kgraph, sizeof kgraph, "%s/model.kgraph", run->workdir);
    snprintf (tool_out, sizeof tool_out, "%s/toolchain.out", run->workdir);
    snprintf (kar_path, sizeof kar_path, "%s/out.kar", run->workdir);
    /* Never through a link the command left in place of {output}: the
     * worker reads what the sandboxed command could not. */
    uint8_t *bytes = NULL;
    size_t len = 0;
    uint64_t size = 0;
    int rc = kiln_toolchain_read_output (tool_out, KILN_TOOLCHAIN_WRAP_INLINE, &bytes, &len,
                                         &size, &err);
    if ((rc != 0 && rc != -KILN_ELIMIT) || size == 0) {
        char text[KILN_ERR_MSG_MAX + 160];
        snprintf (text, sizeof text, "toolchain '%s' exited 0 but wrote no output ({output})%s%s",
                  run->tc->id.id, rc ? ": " : "", rc ? err.msg : "");
        free (bytes);
        s_send_failure (self, run->id, KILN_ECOMPILE, text, log);
        return false;
    }
    kiln_wrap_job_t job = s_wrap_job (run, kgraph, tool_out, kar_path);
    if (rc == 0) {
        uint8_t *kar = NULL;
        size_t kar_len = 0;
        rc = kiln_toolchain_wrap_mem (&job, run->structure, run->struct_len, &bytes, len,
                                      &kar, &kar_len, &err);
        free (bytes);
        if (rc == 0) {
            s_send_artifact (self, run, &kar, kar_len, log);
            return false;
        }
        if (rc != -KILN_EUNSUPPORTED) {
            char text[KILN_ERR_MSG_MAX + 160];
            snprintf (text, sizeof text, "the output of toolchain '%s' could not be made into "
                      "an artifact: %s", run->tc->id.id, err.msg);
            s_send_failure (self, run->id, KILN_ECOMPILE, text, log);
            return false;
        }
    }
    /* Big, or the graph must be loaded to learn its interface: a child
     * does it, under the job's deadline. */
    int64_t started = run->started, deadline = run->deadline;
    s_run_unwatch (self, run);
    run->pid = 0;
    run->exited = false;
    run->status = 0;
    run->phase = S_WRAPPING;
    if (s_run_spawn (self, run, NULL, &err) != 0) {
        s_send_failure (self, run->id, KILN_ESYS, err.msg, log);
        return false;
    }
    run->started = started;
    run->deadline = deadline;
    return true;
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
        snprintf (text, sizeof text, "compiler killed after the %llu s timeout",
                  (unsigned long long) (run->timeout_ms + 999) / 1000);
        kiln_log_warn ("job %llu action %.12s: %s", (unsigned long long) run->id,
                       run->action_key, text);
        s_send_failure (self, run->id, KILN_ETIMEOUT, text, log);
    }
    else if (WIFEXITED (run->status) && WEXITSTATUS (run->status) == 0) {
        if (!run->tc->builtin && run->phase == S_RUNNING) {
            if (s_wrap_output (self, slot, run->log_len ? log : NULL))
                return;                  /* the wrapper runs; the slot stays taken */
        }
        else if (s_send_artifact_apart (self, run, out, run->log_len ? log : NULL))
            ;                            /* large: the broker collects it */
        else {
            uint8_t *bytes = NULL;
            size_t len = 0;
            if (kiln_read_file_flags (out, O_NOFOLLOW, KILN_MAX_ARTIFACT_BYTES, &bytes, &len,
                                      &err) != 0) {
                kiln_log_err ("job %llu action %.12s: the compiler succeeded but its artifact "
                              "cannot be read: %s", (unsigned long long) run->id,
                              run->action_key, err.msg);
                s_send_failure (self, run->id, KILN_ECOMPILE, err.msg, log);
            }
            else
                s_send_artifact (self, run, &bytes, len, run->log_len ? log : NULL);
        }
    }
    else {
        char text[PATH_MAX + 64];
        int code = KILN_ECOMPILE;
        if (WIFEXITED (run->status) && WEXITSTATUS (run->status) == S_EXIT_KGRAPH
            && run->phase == S_RUNNING) {
            snprintf (text, sizeof text, "could not write the job's model.kgraph in %s "
                      "(is its disk full?)", run->workdir);
            code = KILN_ESYS;
        }
        else if (WIFEXITED (run->status) && WEXITSTATUS (run->status) == S_EXIT_EXEC) {
            snprintf (text, sizeof text, "could not run the toolchain '%s'",
                      run->tc->builtin ? self->cc : run->tc->words[0]);
            code = KILN_ESYS;
        }
        else if (WIFEXITED (run->status) && run->phase == S_WRAPPING
                 && WEXITSTATUS (run->status) == S_EXIT_WRAP)
            snprintf (text, sizeof text, "the output of toolchain '%s' could not be made into "
                      "an artifact", run->tc->id.id);
        else if (strncmp (log, "bwrap: ", 7) == 0) {
            /* The sandbox itself failed to set up (bwrap says so first):
             * another worker may do better. */
            snprintf (text, sizeof text, "the compile sandbox failed: %.*s",
                      (int) strcspn (log + 7, "\n"), log + 7);
            code = KILN_ESYS;
        }
        else
            /* A limit (memory, CPU time, file size, processes), a signal,
             * or the compiler's own failure: only the last is a property
             * of the job (KILN_ECOMPILE, which the broker caches). */
            code = kiln_sandbox_explain (self->sandbox, run->status, log, text, sizeof text);
        kiln_log_warn ("job %llu action %.12s: %s after %lld ms",
                       (unsigned long long) run->id, run->action_key, text, ms);
        /* A compile stopped at the memory limit: the broker may try a
         * worker that gives compiles more. */
        s_send_failure_oom (self, run->id, code, text, log,
                            code == KILN_ELIMIT && kiln_sandbox_out_of_memory (log));
    }
    s_run_destroy (self, &self->runs[slot]);
}

/* Collect output, reap, enforce the timeout; finish an exited child. */
static void
s_run_poll (kiln_worker_t *self, int slot, int64_t now)
{
    s_run_t *run = self->runs[slot];
    if (!run || run->phase == S_FETCHING)
        return;
    s_run_drain (self, run);
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
        s_run_drain (self, run);
        s_run_finish (self, slot);
        return;
    }
    if (now - run->log_at >= S_LOG_EVERY_MS)
        s_run_send_log (self, run);
}

static int
s_on_child_event (zloop_t *loop, zmq_pollitem_t *item, void *arg)
{
    kiln_worker_t *self = arg;
    int64_t now = zclock_mono ();
    for (int i = 0; i < self->cfg.slots; i++) {
        s_run_t *run = self->runs[i];
        if (!run || (run->fd != item->fd && run->pidfd != item->fd))
            continue;
        s_run_poll (self, i, now);
        break;
    }
    return 0;
}

/* The run holding job `id`, or -1. */
static int
s_find_run (kiln_worker_t *self, uint64_t id)
{
    for (int i = 0; i < self->cfg.slots; i++)
        if (self->runs[i] && self->runs[i]->id == id)
            return i;
    return -1;
}

/* A job cannot go on here: tell the broker and free its slot. */
static void
s_run_fail (kiln_worker_t *self, int slot, int code, const char *message)
{
    s_run_t *run = self->runs[slot];
    kiln_log_err ("job %llu action %.12s: %s", (unsigned long long) run->id, run->action_key,
                  message);
    s_send_failure (self, run->id, code, message, NULL);
    s_run_destroy (self, &self->runs[slot]);
}

/* --- fetching blobs ----------------------------------------------------------- */

static void
s_fetch_destroy (s_fetch_t **self_p)
{
    if (!*self_p)
        return;
    kiln_blobcache_abort (&(*self_p)->writer);
    free (*self_p);
    *self_p = NULL;
}

/* Ask for more chunks when fewer than half the window are in flight. */
static void
s_fetch_more (kiln_worker_t *self, s_fetch_t *f)
{
    uint64_t received = kiln_blobcache_received (f->writer);
    uint64_t window = (uint64_t) self->cfg.window * KILN_CHUNK_BYTES;
    uint64_t in_flight = f->requested - received;
    if (f->requested >= f->size && f->size > 0)
        return;
    if (f->size > 0 && in_flight > window / 2)
        return;
    kiln_msg_t *msg = kiln_msg_new (KILN_CMD_FETCH);
    if (!msg)
        return;
    uint64_t left = (f->size - f->requested + KILN_CHUNK_BYTES - 1) / KILN_CHUNK_BYTES;
    uint64_t room = (window - in_flight) / KILN_CHUNK_BYTES;
    msg->job_id = f->job_id;
    memcpy (msg->digest, f->hex, KILN_HEX_LEN);
    msg->offset = f->requested;
    msg->count = left < room ? left : room;
    if (msg->count == 0)
        msg->count = 1;              /* a blob of 0 bytes: one empty chunk */
    f->requested += msg->count * KILN_CHUNK_BYTES;
    if (f->requested > f->size)
        f->requested = f->size;
    s_send (self, &msg);
}

static void
s_advance_all (kiln_worker_t *self)
{
    for (int i = 0; i < self->cfg.slots; i++)
        if (self->runs[i] && self->runs[i]->phase == S_FETCHING)
            s_run_advance (self, i);
}

static void
s_on_chunk (kiln_worker_t *self, kiln_msg_t *msg)
{
    s_fetch_t *f = zhashx_lookup (self->fetches, msg->digest);
    if (!f || f->job_id != msg->job_id || msg->blob_size != f->size)
        return;                       /* left over from a cancelled fetch */
    kiln_err_t err = { 0 };
    zframe_t *frame = kiln_msg_chunk_frame (msg);
    f->last_chunk = zclock_mono ();
    int rc = kiln_blobcache_write (f->writer, msg->offset, frame ? zframe_data (frame) : NULL,
                                   frame ? zframe_size (frame) : 0, &err);
    if (rc == 0 && kiln_blobcache_received (f->writer) < f->size) {
        s_fetch_more (self, f);
        return;
    }
    if (rc == 0) {
        rc = kiln_blobcache_finish (self->cache, &f->writer, &err);
        if (rc == 0)
            kiln_log_info ("blob %.12s fetched (%llu bytes)", f->hex,
                           (unsigned long long) f->size);
    }
    uint64_t job_id = f->job_id;
    zhashx_delete (self->fetches, msg->digest);
    if (rc != 0) {
        int slot = s_find_run (self, job_id);
        if (slot >= 0)
            s_run_fail (self, slot, err.code == KILN_EVERIFY ? KILN_EVERIFY : KILN_EIO, err.msg);
    }
    s_advance_all (self);
}

/* Move a FETCHING run on: pin its cached blobs and start on the next
 * missing one, or run the toolchain when none is missing. */
static void
s_run_advance (kiln_worker_t *self, int slot)
{
    s_run_t *run = self->runs[slot];
    kiln_err_t err = { 0 };
    for (uint32_t i = 0; i < run->n_blobs; i++) {
        const kiln_blob_ref_t *b = &run->blobs[i];
        if (kiln_blobcache_has (self->cache, b->digest))
            continue;
        char hex[KILN_HEX_LEN];
        kiln_hex (b->digest, KILN_DIGEST_LEN, hex);
        if (zhashx_lookup (self->fetches, hex))
            return;                   /* on its way, for this job or another */
        s_fetch_t *f = calloc (1, sizeof *f);
        if (!f || !(f->writer = kiln_blobcache_begin (self->cache, b->digest, b->size, &err))) {
            free (f);
            s_run_fail (self, slot, KILN_EIO, err.msg[0] ? err.msg : "out of memory");
            return;
        }
        memcpy (f->hex, hex, KILN_HEX_LEN);
        memcpy (f->digest, b->digest, KILN_DIGEST_LEN);
        f->size = b->size;
        f->job_id = run->id;
        f->last_chunk = zclock_mono ();
        zhashx_insert (self->fetches, f->hex, f);
        s_fetch_more (self, f);
        return;
    }
    /* Every blob is here: pin them and go. */
    for (uint32_t i = 0; i < run->n_blobs; i++)
        kiln_blobcache_pin (self->cache, run->blobs[i].digest);
    run->pinned = true;
    if (run->tc->noop) {
        /* No work and no child: the structure is the output. */
        uint8_t *copy = malloc (run->struct_len ? run->struct_len : 1), *kar = NULL;
        size_t kar_len = 0;
        kiln_wrap_job_t job = s_wrap_job (run, NULL, NULL, NULL);
        run->started = zclock_mono ();
        if (!copy) {
            s_run_fail (self, slot, KILN_ESYS, "out of memory");
            return;
        }
        memcpy (copy, run->structure, run->struct_len);
        if (kiln_toolchain_wrap_mem (&job, run->structure, run->struct_len, &copy,
                                     run->struct_len, &kar, &kar_len, &err) != 0) {
            s_run_fail (self, slot, KILN_ECOMPILE, err.msg);
            return;
        }
        s_send_artifact (self, run, &kar, kar_len, NULL);
        s_run_destroy (self, &self->runs[slot]);
        return;
    }
    run->phase = S_RUNNING;
    s_kgraph_t *plan = s_kgraph_plan (self, run, &err);
    if (!plan || s_run_spawn (self, run, plan, &err) != 0) {
        s_kgraph_free (plan);
        /* An argument the toolchain does not allow is the job's fault,
         * not this host's: the job fails (uncached), not requeued. */
        s_run_fail (self, slot, err.code == KILN_EINVAL ? KILN_EINVAL : KILN_ESYS, err.msg);
        return;
    }
    s_kgraph_free (plan);
    char tc[KILN_PROTO_MAX_TOOLCHAIN + 1];
    kiln_log_notice ("job %llu action %.12s: compiling with %s in %s (args '%s', blobs ready "
                     "after %lld ms)", (unsigned long long) run->id, run->action_key,
                     kiln_toolchain_format (&run->tc->id, tc, sizeof tc), run->workdir,
                     run->args, (long long) (run->started - run->received));
}

/* A JOB: take its inline blobs, then fetch the rest and run. */
static void
s_on_job (kiln_worker_t *self, kiln_msg_t *msg)
{
    kiln_err_t err = { 0 };
    if (msg->session && msg->session != self->session) {
        /* Given before our last READY, which made the broker take it back. */
        kiln_log_info ("job %llu: given to an earlier registration (session %llu, now %llu); "
                       "ignored", (unsigned long long) msg->job_id,
                       (unsigned long long) msg->session, (unsigned long long) self->session);
        return;
    }
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
    const kiln_toolchain_t *tc = NULL;
    for (int i = 0; i < self->n_toolchains && !tc; i++)
        if (strcmp (self->toolchains[i].id.id, msg->compiler_id) == 0
            && strcmp (self->toolchains[i].id.version, msg->compiler_version) == 0
            && strcmp (self->toolchains[i].id.target, msg->target) == 0)
            tc = &self->toolchains[i];
    if (!tc) {
        char text[256];
        snprintf (text, sizeof text, "this worker has no toolchain %s %s %s",
                  msg->compiler_id, msg->compiler_version, msg->target);
        s_send_failure (self, msg->job_id, KILN_ENOTFOUND, text, NULL);
        return;
    }
    s_run_t *run = calloc (1, sizeof *run);
    if (!run || !(run->log = malloc (KILN_MAX_LOG_BYTES + 1))) {
        free (run);
        s_send_failure (self, msg->job_id, KILN_ESYS, "out of memory", NULL);
        return;
    }
    run->fd = run->pidfd = -1;
    run->id = msg->job_id;
    run->tc = tc;
    run->received = zclock_mono ();
    memcpy (run->action_key, msg->action_key, KILN_HEX_LEN);
    memcpy (run->graph_digest, msg->graph_digest, KILN_HEX_LEN);
    run->slot = slot;
    uint64_t max_ms = (uint64_t) self->cfg.timeout_s * 1000;
    run->timeout_ms = msg->timeout_ms && msg->timeout_ms < max_ms ? msg->timeout_ms : max_ms;
    self->runs[slot] = run;
    run->args = strdup (msg->compiler_args ? msg->compiler_args : "");
    run->blobs = calloc (msg->n_blobs ? msg->n_blobs : 1, sizeof *run->blobs);
    if (!run->args || !run->blobs) {
        s_run_fail (self, slot, KILN_ESYS, "out of memory");
        return;
    }
    memcpy (run->blobs, msg->blobs, msg->n_blobs * sizeof *run->blobs);
    run->n_blobs = msg->n_blobs;
    if (kiln_msg_part (msg, 0, &run->structure, &run->struct_len, &err) != 0) {
        s_run_fail (self, slot, KILN_EPROTO, err.msg);
        return;
    }
    for (uint32_t i = 0; i < msg->n_blobs; i++) {
        if (!msg->blobs[i].in_msg)
            continue;
        uint8_t *data = NULL;
        size_t len = 0;
        if (kiln_msg_blob_part (msg, i, &data, &len, &err) != 0
            || kiln_blobcache_put (self->cache, msg->blobs[i].digest, data, len, &err) != 0) {
            free (data);
            s_run_fail (self, slot, err.code == KILN_EVERIFY ? KILN_EVERIFY : KILN_EIO, err.msg);
            return;
        }
        free (data);
    }
    if (!tc->noop && !(run->workdir = kiln_mkdtemp ("kiln-job-", &err))) {
        s_run_fail (self, slot, KILN_ESYS, err.msg);
        return;
    }
    run->phase = S_FETCHING;
    s_run_advance (self, slot);
}

static void
s_on_cancel (kiln_worker_t *self, kiln_msg_t *msg)
{
    kiln_outgoing_drop (self->outgoing, msg->job_id);
    int slot = s_find_run (self, msg->job_id);
    if (slot < 0)
        return;
    kiln_log_notice ("job %llu action %.12s: canceled by the broker",
                     (unsigned long long) msg->job_id, self->runs[slot]->action_key);
    s_run_destroy (self, &self->runs[slot]);
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
            s_run_destroy (self, &self->runs[i]);
        }
    zhashx_purge (self->fetches);
    kiln_outgoing_purge (self->outgoing);
}

/* --- the loop ---------------------------------------------------------------- */

static int
s_on_message (zloop_t *loop, zsock_t *sock, void *arg)
{
    kiln_worker_t *self = arg;
    for (int batch = 0; batch < 64; batch++) {
        kiln_err_t err = { 0 };
        kiln_msg_t *msg = kiln_msg_recv (sock, NULL, NULL, &err);
        if (!msg) {
            if (err.code == KILN_ECANCELED)
                return 0;
            /* It may have been a JOB, which the broker now counts as ours
             * and would wait for forever.  Registering again makes it
             * requeue whatever it thinks we hold. */
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
        case KILN_CMD_CHUNK:
            s_on_chunk (self, msg);
            break;
        case KILN_CMD_CANCEL:
            s_on_cancel (self, msg);
            break;
        case KILN_CMD_COLLECT:
            s_on_collect (self, msg);
            break;
        case KILN_CMD_HEARTBEAT:
            break;
        case KILN_CMD_ERROR:
            kiln_log_warn ("broker says %s: %s", kiln_errname ((int) msg->code), msg->message);
            if (msg->job_id && s_find_run (self, msg->job_id) >= 0)
                s_run_fail (self, s_find_run (self, msg->job_id), KILN_EIO, msg->message);
            else if (msg->code == KILN_EBUSY && !msg->job_id) {
                /* Our READY was refused: another live worker has our name.
                 * Stay quiet (a HEARTBEAT would only be answered "send
                 * READY") and ask again after a liveness period, by which
                 * time a predecessor that died has been dropped. */
                kiln_log_err ("the broker refused to register this worker: %s; trying again "
                              "in %d ms", msg->message ? msg->message : "",
                              self->cfg.liveness_ms);
                s_drop_runs (self, "the broker refused our registration");
                self->refused_at = zclock_mono ();
            }
            else if (msg->code == KILN_ENOTFOUND && !self->refused_at) {
                /* The broker does not know us (it restarted): whatever we
                 * run was given by its previous life. */
                s_drop_runs (self, "the broker restarted");
                s_send_ready (self);
            }
            break;
        default:
            kiln_log_warn ("ignored %s from the broker", kiln_cmd_name (msg->cmd));
            break;
        }
        kiln_msg_destroy (&msg);
        if (!self->dealer || !(zsock_events (self->dealer) & ZMQ_POLLIN))
            break;
    }
    return 0;
}

/* Every tick: collect output, enforce timeouts, reap children, notice
 * stalled fetches. */
static int
s_on_tick (zloop_t *loop, int timer_id, void *arg)
{
    kiln_worker_t *self = arg;
    int64_t now = zclock_mono ();
    for (int i = 0; i < self->cfg.slots; i++)
        s_run_poll (self, i, now);
    for (s_fetch_t *f = zhashx_first (self->fetches); f; f = zhashx_next (self->fetches))
        if (now - f->last_chunk > S_FETCH_STALL_MS) {
            int slot = s_find_run (self, f->job_id);
            char text[128];
            snprintf (text, sizeof text, "no chunk of blob %.12s from the broker for %d s",
                      f->hex, S_FETCH_STALL_MS / 1000);
            if (slot >= 0)
                s_run_fail (self, slot, KILN_EIO, text);     /* drops the fetch too */
            else
                zhashx_delete (self->fetches, f->hex);
            break;                  /* the table changed: one per tick */
        }
    kiln_outgoing_expire (self->outgoing, now);
    return 0;
}

static int
s_on_heartbeat (zloop_t *loop, int timer_id, void *arg)
{
    kiln_worker_t *self = arg;
    if (self->refused_at) {
        if (zclock_mono () - self->refused_at < self->cfg.liveness_ms)
            return 0;
        self->refused_at = 0;
        self->broker_seen = zclock_mono ();
        s_send_ready (self);
        return 0;
    }
    if (zclock_mono () - self->broker_seen > self->cfg.liveness_ms) {
        self->reconnect = true;
        return -1;                           /* leave the loop; run() reconnects */
    }
    kiln_msg_t *hb = kiln_msg_new (KILN_CMD_HEARTBEAT);
    if (hb && kiln_msg_set_str (&hb->name, self->name) == 0)
        s_send (self, &hb);
    kiln_msg_destroy (&hb);
    return 0;
}

static void
s_disconnect (kiln_worker_t *self)
{
    if (!self->dealer)
        return;
    if (self->monitor) {
        zloop_reader_end (self->loop, zactor_sock (self->monitor));
        zactor_destroy (&self->monitor);
    }
    zloop_reader_end (self->loop, self->dealer);
    zsock_destroy (&self->dealer);
}

/* The broker refused our handshake: say why (the transport keeps trying,
 * so that a certificate added to the broker's --trust later lets us in). */
static int
s_on_monitor (zloop_t *loop, zsock_t *sock, void *arg)
{
    kiln_worker_t *self = arg;
    zmsg_t *ev = zmsg_recv (sock);
    char *name = ev ? zmsg_popstr (ev) : NULL;
    if (name && strcmp (name, "HANDSHAKE_FAILED_AUTH") == 0)
        kiln_log_err ("the broker at %s refused this worker's certificate: is it in the "
                      "broker's --trust directory?", self->endpoint);
    else if (name)
        kiln_log_err ("the handshake with the broker at %s failed (%s): %s", self->endpoint,
                      name, self->cfg.cert_path ? "is it the broker whose certificate we have?"
                      : "it may require CurveZMQ (--cert and --broker-cert)");
    zstr_free (&name);
    zmsg_destroy (&ev);
    return 0;
}

static int
s_connect (kiln_worker_t *self, kiln_err_t *err)
{
    self->dealer = zsock_new (ZMQ_DEALER);
    if (!self->dealer)
        return kiln_error (err, KILN_ESYS, "could not create a ZeroMQ socket");
    kiln_proto_socket_defaults (self->dealer);
    zsock_set_sndtimeo (self->dealer, 0);
    zsock_set_sndhwm (self->dealer, 10000);
    zsock_set_rcvhwm (self->dealer, 10000);
    if (strchr (self->endpoint, '['))
        zsock_set_ipv6 (self->dealer, 1);
    if (self->cfg.cert_path
        && kiln_proto_curve_client (self->dealer, self->cfg.cert_path, self->cfg.broker_cert,
                                    err) != 0) {
        zsock_destroy (&self->dealer);
        return -err->code;
    }
    self->monitor = zactor_new (zmonitor, self->dealer);
    if (self->monitor) {
        zstr_sendx (self->monitor, "LISTEN", "HANDSHAKE_FAILED_NO_DETAIL",
                    "HANDSHAKE_FAILED_PROTOCOL", "HANDSHAKE_FAILED_AUTH", NULL);
        zstr_sendx (self->monitor, "START", NULL);
        zsock_wait (self->monitor);
        zloop_reader (self->loop, zactor_sock (self->monitor), s_on_monitor, self);
    }
    if (zsock_connect (self->dealer, "%s", self->endpoint) != 0) {
        s_disconnect (self);
        return kiln_error (err, KILN_EINVAL, "could not connect to '%s': %s", self->endpoint,
                           zmq_strerror (zmq_errno ()));
    }
    if (zloop_reader (self->loop, self->dealer, s_on_message, self) != 0) {
        s_disconnect (self);
        return kiln_error (err, KILN_ESYS, "could not watch the socket");
    }
    zloop_reader_set_tolerant (self->loop, self->dealer);
    self->broker_seen = zclock_mono ();
    self->refused_at = 0;
    s_send_ready (self);
    return 0;
}

/* The sandbox children run in: it hides the job directories' parent,
 * the blob cache and the certificate's directory (kiln_sandbox.h). */
static int
s_sandbox_new (kiln_worker_t *self, const kiln_worker_config_t *cfg, kiln_err_t *err)
{
    kiln_sandbox_config_t sc = { .kind = cfg->sandbox, .max_memory = cfg->max_memory,
                                 .max_procs = cfg->max_procs, .uid_base = cfg->sandbox_uid,
                                 .slots = self->cfg.slots, .helper = self->self_exe };
    const char *tmp = getenv ("TMPDIR");
    sc.jobs_dir = tmp && *tmp ? tmp : "/tmp";
    char cert_dir[PATH_MAX];
    sc.hide[sc.n_hide++] = self->cache_dir;
    if (cfg->cert_path) {
        snprintf (cert_dir, sizeof cert_dir, "%s", cfg->cert_path);
        char *slash = strrchr (cert_dir, '/');
        if (!slash)
            snprintf (cert_dir, sizeof cert_dir, ".");
        else
            slash[slash == cert_dir ? 1 : 0] = '\0';
        sc.hide[sc.n_hide++] = cert_dir;
    }
    self->sandbox = kiln_sandbox_new (&sc, err);
    return self->sandbox ? 0 : -err->code;
}

kiln_worker_t *
kiln_worker_new (const kiln_worker_config_t *cfg, kiln_err_t *err)
{
    if (!cfg->endpoint) {
        kiln_error (err, KILN_EINVAL, "the worker needs a broker endpoint");
        return NULL;
    }
    if (!cfg->cert_path != !cfg->broker_cert) {
        kiln_error (err, KILN_EINVAL, "CurveZMQ needs both the worker's certificate (--cert) "
                    "and the broker's (--broker-cert)");
        return NULL;
    }
    if (!cfg->cert_path && !kiln_proto_endpoint_is_local (cfg->endpoint))
        kiln_log_warn ("connecting to '%s' without CurveZMQ: a broker that is not on this "
                       "host will refuse this worker", cfg->endpoint);
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
    if (self->cfg.window <= 0)
        self->cfg.window = 16;
    if (self->cfg.window > KILN_PROTO_MAX_CREDIT)
        self->cfg.window = KILN_PROTO_MAX_CREDIT;
    if (self->cfg.cache_max_bytes == 0)
        self->cfg.cache_max_bytes = 16ULL << 30;
    if (self->cfg.slots > KILN_PROTO_MAX_SLOTS) {
        kiln_error (err, KILN_EINVAL, "--slots %d is more than %d", self->cfg.slots,
                    KILN_PROTO_MAX_SLOTS);
        goto fail;
    }
    /* Its certificate names a worker, as the broker, status and
     * provenance know it; else the host and process. */
    const char *cert_name = NULL;
    zcert_t *cert = !cfg->name && cfg->cert_path ? zcert_load (cfg->cert_path) : NULL;
    if (cert && zcert_meta (cert, "name") && kiln_proto_name_ok (zcert_meta (cert, "name")))
        cert_name = zcert_meta (cert, "name");
    if (cfg->name)
        snprintf (self->name, sizeof self->name, "%s", cfg->name);
    else if (cert_name)
        snprintf (self->name, sizeof self->name, "%s", cert_name);
    else {
        char host[64] = "worker";
        gethostname (host, sizeof host - 1);
        snprintf (self->name, sizeof self->name, "%s:%d", host, (int) getpid ());
    }
    zcert_destroy (&cert);
    if (!kiln_proto_name_ok (self->name)) {
        kiln_error (err, KILN_EINVAL, "worker name '%s' must be 1..%d characters of "
                    "[A-Za-z0-9._:@-]", self->name, KILN_PROTO_MAX_NAME);
        goto fail;
    }
    char dir[PATH_MAX - 16];
    if (kiln_exe_dir (dir, sizeof dir, err) != 0)
        goto fail;
    snprintf (self->self_exe, sizeof self->self_exe, "%s/kiln-worker", dir);
    if (cfg->cc_path) {
        if (snprintf (self->cc, sizeof self->cc, "%s", cfg->cc_path) >= (int) sizeof self->cc) {
            kiln_error (err, KILN_ELIMIT, "compiler path too long");
            goto fail;
        }
    }
    else
        snprintf (self->cc, sizeof self->cc, "%s/kiln-cc", dir);
    if (cfg->n_toolchains < 0 || cfg->n_toolchains > KILN_WORKER_MAX_TOOLCHAINS) {
        kiln_error (err, KILN_ELIMIT, "more than %d toolchains", KILN_WORKER_MAX_TOOLCHAINS);
        goto fail;
    }
    self->toolchains = calloc ((size_t) cfg->n_toolchains + 1, sizeof *self->toolchains);
    if (!self->toolchains) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    if (!cfg->no_builtin) {
        if (access (self->cc, X_OK) != 0) {
            kiln_error (err, KILN_ENOTFOUND, "compiler '%s' is not an executable file",
                        self->cc);
            goto fail;
        }
        kiln_toolchain_builtin (&self->toolchains[self->n_toolchains++]);
    }
    const char *target = cfg->target ? cfg->target : kiln_cc_target ();
    for (int i = 0; i < cfg->n_toolchains; i++) {
        kiln_toolchain_t *tc = &self->toolchains[self->n_toolchains];
        if (kiln_toolchain_parse_spec (cfg->toolchains[i], target, tc, err) != 0)
            goto fail;
        self->n_toolchains++;
        for (int k = 0; k < self->n_toolchains - 1; k++)
            if (strcmp (self->toolchains[k].id.id, tc->id.id) == 0
                && strcmp (self->toolchains[k].id.version, tc->id.version) == 0) {
                kiln_error (err, KILN_EINVAL, "toolchain %s@%s is given twice", tc->id.id,
                            tc->id.version);
                goto fail;
            }
    }
    if (self->n_toolchains == 0) {
        kiln_error (err, KILN_EINVAL, "--no-builtin and no --toolchain: nothing to offer");
        goto fail;
    }
    if (cfg->cache_dir)
        self->cache_dir = strdup (cfg->cache_dir);
    else {
        self->cache_dir = kiln_mkdtemp ("kiln-worker-cache-", err);
        self->own_cache = self->cache_dir != NULL;
        if (!self->cache_dir)
            goto fail;
    }
    if (!self->cache_dir) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    if (!(self->cache = kiln_blobcache_new (self->cache_dir, self->cfg.cache_max_bytes, err)))
        goto fail;
    if (s_sandbox_new (self, cfg, err) != 0)
        goto fail;
    self->endpoint = strdup (cfg->endpoint);
    self->runs = calloc ((size_t) self->cfg.slots, sizeof *self->runs);
    self->fetches = zhashx_new ();
    self->outgoing = kiln_outgoing_new ();
    self->loop = zloop_new ();
    if (!self->endpoint || !self->runs || !self->loop || !self->fetches || !self->outgoing) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    zhashx_set_destructor (self->fetches, (zhashx_destructor_fn *) s_fetch_destroy);
    /* Sessions are per process; starting at the clock keeps them apart
     * across restarts too. */
    self->session = (uint64_t) zclock_time ();
    self->cfg.endpoint = self->endpoint;
    self->cfg.name = NULL;
    self->cfg.cc_path = NULL;
    self->cfg.cache_dir = NULL;
    self->cfg.target = NULL;
    self->cfg.n_toolchains = 0;
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
            s_run_destroy (self, &self->runs[i]);
    free (self->runs);
    zhashx_destroy (&self->fetches);
    kiln_outgoing_destroy (&self->outgoing);
    if (self->loop)
        s_disconnect (self);
    zloop_destroy (&self->loop);
    kiln_blobcache_destroy (&self->cache);
    kiln_sandbox_destroy (&self->sandbox);
    if (self->own_cache && self->cache_dir)
        kiln_rm_rf (self->cache_dir);
    free (self->cache_dir);
    for (int i = 0; self->toolchains && i < self->n_toolchains; i++)
        kiln_toolchain_release (&self->toolchains[i]);
    free (self->toolchains);
    free (self->endpoint);
    free (self);
    *self_p = NULL;
}

int
kiln_worker_run (kiln_worker_t *self)
{
    kiln_err_t err = { 0 };
    char tc[KILN_PROTO_MAX_TOOLCHAIN + 1];
    kiln_log_notice ("worker %s: %d slot%s, %d toolchain%s (%s%s), cache %s (%zu blobs), "
                     "broker %s", self->name, self->cfg.slots, self->cfg.slots == 1 ? "" : "s",
                     self->n_toolchains, self->n_toolchains == 1 ? "" : "s",
                     kiln_toolchain_format (&self->toolchains[0].id, tc, sizeof tc),
                     self->n_toolchains > 1 ? ", ..." : "", self->cache_dir,
                     kiln_blobcache_count (self->cache), self->endpoint);
    char sandbox[PATH_MAX + 160];
    kiln_log_notice ("worker %s: %s", self->name,
                     kiln_sandbox_describe (self->sandbox, sandbox, sizeof sandbox));
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
