/*
 * bench_farm — measurements of the farm from the C client library, each
 * printed as one JSON line; bench/bench_farm.py starts the farms and
 * prints the table.  Not a test: nothing here passes or fails on time.
 *
 *   bench_farm raw MIB                      raw ZeroMQ loopback throughput: a
 *                                           child process receives MIB MiB in
 *                                           1 MiB messages over TCP (the
 *                                           baseline of the upload figure)
 *   bench_farm sha MIB                      SHA-256 of MIB MiB on one core:
 *                                           the bound the broker's check of
 *                                           every uploaded byte sets
 *   bench_farm upload EP MIB BLOBS          a graph with BLOBS weights of MIB
 *                                           MiB in all: kiln_client_upload
 *                                           twice (all bytes, then none)
 *   bench_farm hits EP N                    build one tiny graph, then N
 *                                           compiles of it served from the
 *                                           action cache: latency percentiles
 *   bench_farm batch EP N TOOLCHAIN         N distinct jobs (one graph, N
 *                                           compiler argument strings) in one
 *                                           batch: wall time and jobs/s
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <czmq.h>

#include "client/kiln_client.h"
#include "common/kiln_hash.h"
#include "graph/kiln_graph.h"

static int
s_die (const char *what, const kiln_err_t *err)
{
    fprintf (stderr, "bench_farm: %s: %s\n", what, err ? err->msg : "");
    return 1;
}

/* y = x + w_1 + ... + w_k, each w_i of `floats` float32 drawn from `seed`. */
static kiln_graph_t *
s_graph (int k, int64_t floats, uint32_t seed, kiln_err_t *err)
{
    kiln_graph_t *g = kiln_graph_new ();
    kiln_shape_t shape = { .rank = 1, .dims = { floats } };
    int x = kiln_graph_add_tensor (g, "x", KILN_DT_FLOAT32, &shape, err);
    if (x < 0 || kiln_graph_add_input (g, x, err) != 0)
        goto fail;
    int prev = x;
    for (int i = 0; i < k; i++) {
        char name[32];
        snprintf (name, sizeof name, "w%d", i);
        int w = kiln_graph_add_tensor (g, name, KILN_DT_FLOAT32, &shape, err);
        size_t bytes = (size_t) floats * 4;
        uint8_t *data = malloc (bytes ? bytes : 1);
        if (w < 0 || !data) {
            free (data);
            goto fail;
        }
        uint32_t *p = (uint32_t *) data;
        uint32_t s = seed * 2654435761u + (uint32_t) i * 40503u + 1;
        for (int64_t j = 0; j < floats; j++) {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            p[j] = (s & 0x007fffff) | 0x3f000000;        /* a float in [0.5, 1) */
        }
        if (kiln_graph_set_weight (g, w, &data, bytes, err) != 0)
            goto fail;
        snprintf (name, sizeof name, "y%d", i);
        int y = kiln_graph_add_tensor (g, i == k - 1 ? "y" : name, KILN_DT_FLOAT32, &shape, err);
        int ins[2] = { prev, w };
        if (y < 0 || kiln_graph_add_node (g, "Add", NULL, ins, 2, &y, 1, err) < 0)
            goto fail;
        prev = y;
    }
    if (kiln_graph_add_output (g, prev, err) != 0 || kiln_graph_validate (g, err) != 0)
        goto fail;
    return g;
fail:
    kiln_graph_destroy (&g);
    return NULL;
}

static void
s_nofree (void *data, void *hint)
{
}

/* Raw ZeroMQ: a child ROUTER receives `mib` 1 MiB messages from our
 * DEALER over loopback TCP and acks the last. */
static int
s_raw (int mib)
{
    /* A free port, found without ZeroMQ: a process must not fork after it
     * started ZeroMQ's threads. */
    int port = 0;
    {
        int fd = socket (AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = 0,
                                 .sin_addr.s_addr = htonl (INADDR_LOOPBACK) };
        socklen_t len = sizeof a;
        if (fd < 0 || bind (fd, (struct sockaddr *) &a, sizeof a) != 0
            || getsockname (fd, (struct sockaddr *) &a, &len) != 0)
            return s_die ("raw: no free port", NULL);
        port = ntohs (a.sin_port);
        close (fd);
    }
    pid_t child = fork ();
    if (child == 0) {
        zsock_t *r = zsock_new (ZMQ_ROUTER);
        zsock_set_rcvhwm (r, 0);
        if (zsock_bind (r, "tcp://127.0.0.1:%d", port) < 0)
            _exit (1);
        void *h = zsock_resolve (r);
        for (int i = 0; i <= mib; i++) {             /* a hello, then the data */
            zmq_msg_t id, m;
            zmq_msg_init (&id);
            zmq_msg_init (&m);
            zmq_msg_recv (&id, h, 0);
            zmq_msg_recv (&m, h, 0);
            if (i == mib) {
                zmq_send (h, zmq_msg_data (&id), zmq_msg_size (&id), ZMQ_SNDMORE);
                zmq_send (h, "ok", 2, 0);
            }
            zmq_msg_close (&m);
            zmq_msg_close (&id);
        }
        zclock_sleep (200);
        zsock_destroy (&r);
        _exit (0);
    }
    zsock_t *d = zsock_new (ZMQ_DEALER);
    zsock_set_sndhwm (d, 0);
    zsock_connect (d, "tcp://127.0.0.1:%d", port);
    zstr_send (d, "hello");
    zclock_sleep (300);
    size_t size = 1u << 20;
    /* KILN_BENCH_RAW_SPREAD=1: each message from its own MiB of a buffer
     * as large as the whole transfer (as an upload sends), not one MiB
     * sent again and again from the cache */
    const char *spread_env = getenv ("KILN_BENCH_RAW_SPREAD");
    size_t span = spread_env && *spread_env == '1' ? size * (size_t) mib : size;
    char *buf = malloc (span);
    if (getenv ("KILN_BENCH_RAW_HUGE"))
        madvise ((void *) (((uintptr_t) buf + 4095) & ~(uintptr_t) 4095), span - 4096,
                 MADV_HUGEPAGE);
    memset (buf, 7, span);
    void *h = zsock_resolve (d);
    int64_t t0 = zclock_usecs ();
    for (int i = 0; i < mib; i++) {
        zmq_msg_t m;
        zmq_msg_init_data (&m, buf + (span > size ? (size_t) i * size : 0), size, s_nofree,
                           NULL);
        zmq_msg_send (&m, h, 0);
    }
    char ok[8];
    zsock_set_rcvtimeo (d, 120000);
    int got = zmq_recv (h, ok, sizeof ok, 0);
    int64_t t1 = zclock_usecs ();
    zsock_destroy (&d);
    free (buf);
    int status = 0;
    waitpid (child, &status, 0);
    if (got != 2)
        return s_die ("raw", NULL);
    printf ("{\"bench\":\"raw\",\"mib\":%d,\"seconds\":%.4f,\"mib_per_s\":%.1f}\n", mib,
            (double) (t1 - t0) / 1e6, mib / ((double) (t1 - t0) / 1e6));
    return 0;
}

static double
s_tv (const struct timeval *tv)
{
    return (double) tv->tv_sec + (double) tv->tv_usec / 1e6;
}

static int
s_upload (const char *ep, int mib, int blobs)
{
    kiln_err_t err = { 0 };
    int64_t floats = (int64_t) mib * (1 << 20) / 4 / blobs;
    kiln_graph_t *g = s_graph (blobs, floats, (uint32_t) getpid (), &err);
    if (!g)
        return s_die ("graph", &err);
    kiln_client_t *c = kiln_client_new (ep, &err);
    if (!c)
        return s_die ("client", &err);
    double seconds[2], user = 0, sys = 0;
    uint64_t sent[2];
    for (int i = 0; i < 2; i++) {
        struct rusage r0, r1;
        getrusage (RUSAGE_SELF, &r0);
        int64_t t0 = zclock_usecs ();
        if (kiln_client_upload (c, g, 600000, &sent[i], &err) != 0)
            return s_die ("upload", &err);
        seconds[i] = (double) (zclock_usecs () - t0) / 1e6;
        getrusage (RUSAGE_SELF, &r1);
        if (i == 0) {                /* the first upload's CPU, all threads */
            user = s_tv (&r1.ru_utime) - s_tv (&r0.ru_utime);
            sys = s_tv (&r1.ru_stime) - s_tv (&r0.ru_stime);
        }
    }
    printf ("{\"bench\":\"upload\",\"mib\":%d,\"blobs\":%d,\"seconds\":%.4f,\"mib_per_s\":%.1f,"
            "\"sent_bytes\":%llu,\"second_seconds\":%.4f,\"second_sent_bytes\":%llu,"
            "\"user_s\":%.3f,\"sys_s\":%.3f}\n", mib, blobs, seconds[0], mib / seconds[0],
            (unsigned long long) sent[0], seconds[1], (unsigned long long) sent[1], user, sys);
    kiln_client_destroy (&c);
    kiln_graph_destroy (&g);
    return 0;
}

static int
s_cmp_double (const void *a, const void *b)
{
    double x = *(const double *) a, y = *(const double *) b;
    return x < y ? -1 : x > y;
}

static int
s_hits (const char *ep, int n)
{
    kiln_err_t err = { 0 };
    kiln_graph_t *g = s_graph (1, 4, (uint32_t) getpid (), &err);
    kiln_client_t *c = g ? kiln_client_new (ep, &err) : NULL;
    if (!c)
        return s_die ("setup", &err);
    kiln_client_job_t job;
    memset (&job, 0, sizeof job);
    job.graph = g;
    if (kiln_client_compile_batch (c, &job, 1, 120000, NULL, NULL, &err) != 0 || job.err.code)
        return s_die ("first build", job.err.code ? &job.err : &err);
    double *ms = calloc ((size_t) n, sizeof *ms);
    for (int i = 0; i < n; i++) {
        int64_t t0 = zclock_usecs ();
        if (kiln_client_compile_batch (c, &job, 1, 60000, NULL, NULL, &err) != 0 || job.err.code)
            return s_die ("hit", job.err.code ? &job.err : &err);
        ms[i] = (double) (zclock_usecs () - t0) / 1000.0;
        if (!job.result.cached)
            return s_die ("hit", NULL);
    }
    qsort (ms, (size_t) n, sizeof *ms, s_cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += ms[i];
    printf ("{\"bench\":\"hits\",\"n\":%d,\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"mean_ms\":%.3f,"
            "\"max_ms\":%.3f}\n", n, ms[n / 2], ms[(int) ((double) n * 0.99)], sum / n,
            ms[n - 1]);
    free (ms);
    kiln_client_destroy (&c);
    kiln_graph_destroy (&g);
    return 0;
}

static int
s_batch (const char *ep, int n, const char *toolchain)
{
    kiln_err_t err = { 0 };
    kiln_graph_t *g = s_graph (1, 4, (uint32_t) getpid (), &err);
    kiln_client_t *c = g ? kiln_client_new (ep, &err) : NULL;
    if (!c)
        return s_die ("setup", &err);
    kiln_client_job_t *jobs = calloc ((size_t) n, sizeof *jobs);
    char (*args)[32] = calloc ((size_t) n, sizeof *args);
    for (int i = 0; i < n; i++) {
        snprintf (args[i], sizeof args[i], "--job %d", i);
        jobs[i].graph = g;
        jobs[i].opts.compiler_args = args[i];
        jobs[i].opts.toolchain = toolchain;
    }
    int64_t t0 = zclock_usecs ();
    if (kiln_client_compile_batch (c, jobs, (size_t) n, 3600000, NULL, NULL, &err) != 0)
        return s_die ("batch", &err);
    double seconds = (double) (zclock_usecs () - t0) / 1e6;
    int ok = 0, cached = 0;
    for (int i = 0; i < n; i++) {
        ok += jobs[i].err.code == 0;
        cached += jobs[i].result.cached;
    }
    if (ok != n) {
        for (int i = 0; i < n; i++)
            if (jobs[i].err.code)
                return s_die ("a job", &jobs[i].err);
    }
    printf ("{\"bench\":\"batch\",\"n\":%d,\"toolchain\":\"%s\",\"seconds\":%.4f,"
            "\"jobs_per_s\":%.1f,\"cached\":%d}\n", n, toolchain, seconds, n / seconds, cached);
    free (jobs);
    free (args);
    kiln_client_destroy (&c);
    kiln_graph_destroy (&g);
    return 0;
}

/* SHA-256 on one core, the check the broker runs over every uploaded
 * byte: `mib` MiB hashed in 1 MiB updates, as chunks arrive. */
static int
s_sha (int mib)
{
    size_t size = 64u << 20;
    uint8_t *buf = malloc (size), out[KILN_DIGEST_LEN];
    if (!buf)
        return s_die ("sha: out of memory", NULL);
    memset (buf, 7, size);
    kiln_sha256_t *sha = kiln_sha256_new ();
    int64_t t0 = zclock_usecs ();
    for (int i = 0; i < mib; i++)
        kiln_sha256_update (sha, buf + ((size_t) i << 20) % size, 1u << 20);
    kiln_sha256_final (&sha, out);
    double seconds = (double) (zclock_usecs () - t0) / 1e6;
    printf ("{\"bench\":\"sha\",\"mib\":%d,\"seconds\":%.4f,\"mib_per_s\":%.1f}\n", mib,
            seconds, mib / seconds);
    free (buf);
    return 0;
}

int
main (int argc, char **argv)
{
    if (argc >= 3 && strcmp (argv[1], "sha") == 0)
        return s_sha (atoi (argv[2]));
    if (argc >= 3 && strcmp (argv[1], "raw") == 0)
        return s_raw (atoi (argv[2]));
    if (argc >= 5 && strcmp (argv[1], "upload") == 0)
        return s_upload (argv[2], atoi (argv[3]), atoi (argv[4]));
    if (argc >= 4 && strcmp (argv[1], "hits") == 0)
        return s_hits (argv[2], atoi (argv[3]));
    if (argc >= 5 && strcmp (argv[1], "batch") == 0)
        return s_batch (argv[2], atoi (argv[3]), argv[4]);
    fprintf (stderr, "usage: bench_farm raw MIB | sha MIB | upload EP MIB BLOBS | hits EP N | "
                     "batch EP N TOOLCHAIN\n");
    return 2;
}
