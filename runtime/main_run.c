/*
 * kiln-run — verify an artifact, run it once on .npy inputs and write one
 * OUTPUTNAME.npy per output; with --bench N, time N runs after a warm-up
 * (like onnxruntime_perf_test or trtexec).  Links only libkilnrt.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "common/kiln_fs.h"
#include "runtime/kiln_npy.h"
#include "runtime/kiln_rt.h"
#include "common/kiln_log.h"

#define S_MAX_INPUTS KILN_MAX_GRAPH_IO

static const char s_usage[] =
    "usage: kiln-run ARTIFACT.kar --keyring DIR --input NAME=x.npy ...\n"
    "                --output-dir DIR [--dynamic-batch [--replicas N]]\n"
    "                [--bench N [--json | --bench-stdin]]\n"
    "\n"
    "Verify ARTIFACT.kar against the public keys in the keyring, run it once\n"
    "and write one OUTPUTNAME.npy per output into the output directory.\n"
    "A model with a single input also takes --input x.npy.\n"
    "\n"
    "  --dynamic-batch  inputs may have any size in dimension 0 (the same in\n"
    "                   all): they run in chunks of the compiled batch, padded,\n"
    "                   across replicas of the model on the runtime's cores\n"
    "                   (KILN_RT_VISIBLE_CORES, KILN_RT_NUM_CORES), and the\n"
    "                   outputs are joined and trimmed\n"
    "  --replicas N     with --dynamic-batch: load the model N times, one per\n"
    "                   core round-robin (default: one per core, at most one\n"
    "                   per chunk; a model compiled with --pipeline-cores S\n"
    "                   takes S cores, and its chunks stream through its\n"
    "                   stages, several in flight)\n"
    "  --bench N        after a warm-up, run N more times and print the latency\n"
    "                   per inference (min, median, p99, mean), the rows per\n"
    "                   second at the median, the peak RSS\n"
    "                   and whether the weights are mapped from the artifact\n"
    "                   and shared by the replicas; --output-dir is then\n"
    "                   optional.  Intra-op threads: KILN_RT_THREADS;\n"
    "                   per-kernel times: KILN_RT_PROFILE=1; weights mapped\n"
    "                   or read into memory: KILN_RT_MMAP=1 or 0 (default\n"
    "                   auto: read up to 1 GiB, mapped above)\n"
    "  --json           with --bench: print one JSON object instead\n"
    "  --bench-stdin    with --bench N: after the warm-up print {\"ready\":true},\n"
    "                   then for each line read on stdin time N runs and print\n"
    "                   {\"times\":[ms, ...],\"cpu_ms\":ms a run}, until stdin\n"
    "                   ends: a harness takes turns between kiln and another\n"
    "                   engine, each in a process of its own, a few runs at a\n"
    "                   time (bench/bench_runtime.py)\n";

#define S_MAX_BENCH 1000000

static int
s_cmp_double (const void *a, const void *b)
{
    double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

/* Peak resident set of this process in KiB: VmHWM, which exec resets
 * (getrusage's ru_maxrss keeps the parent's peak across fork and exec). */
static long
s_peak_rss_kib (void)
{
    FILE *f = fopen ("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    while (f && fgets (line, sizeof line, f))
        if (strncmp (line, "VmHWM:", 6) == 0)
            kib = strtol (line + 6, NULL, 10);
    if (f)
        fclose (f);
    if (kib < 0) {
        struct rusage ru;
        kib = getrusage (RUSAGE_SELF, &ru) == 0 ? ru.ru_maxrss : -1;
    }
    return kib;
}

static double
s_now_ms (void)
{
    struct timespec ts;
    clock_gettime (CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec * 1e3 + (double) ts.tv_nsec / 1e6;
}

/* CPU time of the whole process (user + system, every thread), ms. */
static double
s_cpu_ms (void)
{
    struct timespec ts;
    clock_gettime (CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double) ts.tv_sec * 1e3 + (double) ts.tv_nsec / 1e6;
}

#define S_MAX_REPLICAS 1024

static int
s_fail (const char *msg)
{
    kiln_print_error ("kiln-run", msg);
    return 1;
}

/* A file name for output `name`: [A-Za-z0-9._-] kept, anything else '_',
 * no leading dot (so no "..", no hidden file), never empty. */
static void
s_sanitize (const char *name, char *out, size_t size)
{
    size_t n = 0;
    for (const char *p = name; *p && n + 1 < size; p++) {
        char c = *p;
        bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z')
                  || (c >= '0' && c <= '9') || c == '_' || c == '-'
                  || (c == '.' && n > 0);
        out[n++] = ok ? c : '_';
    }
    if (n == 0)
        out[n++] = '_';
    out[n] = '\0';
}

/* --bench-stdin: the warm-up, then `runs` timed runs for each line on
 * stdin, their times and the process's CPU time a run printed as one
 * JSON line each; returns at the end of stdin, or -1 with err set. */
static int
s_bench_stdin (kiln_model_t *model, const kiln_rt_tensor_t *ins, int n_in,
               kiln_rt_tensor_t *outs, int n_out, long runs, kiln_err_t *err)
{
    for (int r = 0; r < 3; r++)
        if (kiln_model_run (model, ins, n_in, outs, n_out, err))
            return -1;
    printf ("{\"ready\":true}\n");
    fflush (stdout);
    char line[256];
    while (fgets (line, sizeof line, stdin)) {
        if (!strchr (line, '\n') && !feof (stdin))
            continue;       /* the rest of a long line: one round a line */
        double cpu0 = s_cpu_ms ();
        printf ("{\"times\":[");
        for (long r = 0; r < runs; r++) {
            double t0 = s_now_ms ();
            if (kiln_model_run (model, ins, n_in, outs, n_out, err))
                return -1;
            printf ("%s%.4f", r ? "," : "", s_now_ms () - t0);
        }
        printf ("],\"cpu_ms\":%.4f}\n", (s_cpu_ms () - cpu0) / (double) runs);
        fflush (stdout);
    }
    return 0;
}

int
main (int argc, char **argv)
{
    const char *artifact = NULL, *keyring = NULL, *outdir = NULL;
    const char *specs[S_MAX_INPUTS];
    int n_specs = 0;
    bool dynamic = false, json = false, from_stdin = false;
    long replicas_opt = 0, bench = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp (a, "-h") == 0 || strcmp (a, "--help") == 0) {
            fputs (s_usage, stdout);
            return 0;
        }
        const char **slot = NULL;
        if (strcmp (a, "--dynamic-batch") == 0) {
            dynamic = true;
            continue;
        }
        if (strcmp (a, "--json") == 0) {
            json = true;
            continue;
        }
        if (strcmp (a, "--bench-stdin") == 0) {
            from_stdin = true;
            continue;
        }
        if (strcmp (a, "--bench") == 0) {
            char *end = NULL;
            bench = i + 1 < argc ? strtol (argv[++i], &end, 10) : 0;
            if (!end || *end || bench < 1 || bench > S_MAX_BENCH) {
                fprintf (stderr, "kiln-run: --bench wants 1..%d\n", S_MAX_BENCH);
                return 1;
            }
            continue;
        }
        if (strcmp (a, "--replicas") == 0) {
            char *end = NULL;
            replicas_opt = i + 1 < argc ? strtol (argv[++i], &end, 10) : 0;
            if (!end || *end || replicas_opt < 1 || replicas_opt > S_MAX_REPLICAS) {
                fprintf (stderr, "kiln-run: --replicas wants 1..%d\n", S_MAX_REPLICAS);
                return 1;
            }
            continue;
        }
        if (strcmp (a, "--keyring") == 0)
            slot = &keyring;
        else if (strcmp (a, "--output-dir") == 0)
            slot = &outdir;
        else if (strcmp (a, "--input") == 0) {
            if (n_specs >= S_MAX_INPUTS)
                return s_fail ("too many --input options");
            slot = &specs[n_specs++];
        } else if (a[0] == '-') {
            fputs (s_usage, stderr);
            fprintf (stderr, "kiln-run: unknown option '%s'\n", a);
            return 1;
        } else if (!artifact) {
            artifact = a;
            continue;
        } else {
            fprintf (stderr, "kiln-run: unexpected argument '%s'\n", a);
            return 1;
        }
        if (i + 1 >= argc) {
            fprintf (stderr, "kiln-run: %s needs a value\n", a);
            return 1;
        }
        *slot = argv[++i];
    }
    if (!artifact || !keyring || (!outdir && !bench)) {
        fputs (s_usage, stderr);
        return s_fail ("an artifact, --keyring and --output-dir are required");
    }
    if (json && !bench)
        return s_fail ("--json goes with --bench");
    if (from_stdin && (!bench || json || dynamic))
        return s_fail ("--bench-stdin goes with --bench, without --json or "
                       "--dynamic-batch");
    if (replicas_opt && !dynamic)
        return s_fail ("--replicas goes with --dynamic-batch");

    kiln_err_t err = { 0 };
    kiln_rt_t *rt = NULL;
    kiln_model_t *model = NULL;
    kiln_npy_t *arrays = NULL;
    kiln_rt_tensor_t *ins = NULL, *outs = NULL;
    kiln_model_t *replicas[S_MAX_REPLICAS] = { NULL };
    int n_in = 0, n_out = 0, n_replicas = 0, status = 1;
    int64_t batch = 0, compiled_batch = 1;
    char msg[KILN_ERR_MSG_MAX + 512] = "";

    if (!(rt = kiln_rt_new (&err))
        || !(model = kiln_rt_load (rt, artifact, keyring, &err)))
        goto done;
    const kiln_manifest_t *man = kiln_model_manifest (model);
    n_in = man->n_inputs;
    n_out = man->n_outputs;
    arrays = calloc ((size_t) n_in + 1, sizeof *arrays);
    ins = calloc ((size_t) n_in + 1, sizeof *ins);
    outs = calloc ((size_t) n_out + 1, sizeof *outs);
    if (!arrays || !ins || !outs) {
        snprintf (msg, sizeof msg, "out of memory");
        goto done;
    }

    /* Match each --input to a manifest input: NAME=path, or a bare path
     * when the model has exactly one input. */
    const char *paths[S_MAX_INPUTS] = { 0 };
    for (int s = 0; s < n_specs; s++) {
        const char *eq = strchr (specs[s], '=');
        int which = -1;
        const char *path = specs[s];
        for (int i = 0; eq && i < n_in; i++) {
            size_t nl = (size_t) (eq - specs[s]);
            if (strlen (man->inputs[i].name) == nl
                && memcmp (man->inputs[i].name, specs[s], nl) == 0) {
                which = i;
                path = eq + 1;
            }
        }
        /* A bare path for a one-input model; a path may hold '=' too. */
        if (which < 0 && n_in == 1 && n_specs == 1
            && (!eq || kiln_file_exists (specs[s])))
            which = 0;
        if (which < 0) {
            size_t used = (size_t) snprintf (msg, sizeof msg, "--input '%s' names "
                                             "no input of the model (inputs:",
                                             specs[s]);
            for (int i = 0; i < n_in && used < sizeof msg; i++)
                used += (size_t) snprintf (msg + used, sizeof msg - used, " %s",
                                           man->inputs[i].name);
            if (used < sizeof msg)
                snprintf (msg + used, sizeof msg - used, "; write NAME=FILE.npy)");
            goto done;
        }
        if (paths[which]) {
            snprintf (msg, sizeof msg, "input '%s' is given twice",
                      man->inputs[which].name);
            goto done;
        }
        paths[which] = path;
    }
    for (int i = 0; i < n_in; i++) {
        if (!paths[i]) {
            snprintf (msg, sizeof msg, "input '%s' is missing (--input %s=FILE.npy)",
                      man->inputs[i].name, man->inputs[i].name);
            goto done;
        }
        if (kiln_npy_read (paths[i], &arrays[i], &err))
            goto done;
        ins[i].dtype = arrays[i].dtype;
        ins[i].shape = arrays[i].shape;
        ins[i].data = arrays[i].data;
    }
    if (dynamic) {
        /* The batch is the inputs' dimension 0; kiln_model_run_batched
         * checks that they agree and that nothing else differs. */
        if ((compiled_batch = kiln_model_batch_size (model, &err)) < 0)
            goto done;
        batch = n_in > 0 && ins[0].shape.rank >= 1 ? ins[0].shape.dims[0] : 0;
        int64_t chunks = (batch + compiled_batch - 1) / compiled_batch;
        int stages = kiln_model_stage_count (model);
        long want = replicas_opt ? replicas_opt : kiln_rt_num_cores (rt) / stages;
        if (want < 1)
            want = 1;
        if (!replicas_opt && want > chunks)
            want = chunks > 0 ? (long) chunks : 1;
        replicas[n_replicas++] = model;
        while (n_replicas < want)
            if (!(replicas[n_replicas++] = kiln_rt_load (rt, artifact, keyring, &err)))
                goto done;
    }
    for (int i = 0; i < n_out; i++) {
        uint64_t bytes;
        if (kiln_shape_bytes (&man->outputs[i].shape, man->outputs[i].dtype,
                              man->outputs[i].name, &bytes, &err))
            goto done;
        if (dynamic
            && __builtin_mul_overflow (bytes / (uint64_t) compiled_batch,
                                       (uint64_t) batch, &bytes)) {
            snprintf (msg, sizeof msg, "a batch of %lld is too large",
                      (long long) batch);
            goto done;
        }
        if (!(outs[i].data = malloc (bytes ? (size_t) bytes : 1))) {
            snprintf (msg, sizeof msg, "out of memory");
            goto done;
        }
    }
    if (from_stdin) {
        if (s_bench_stdin (model, ins, n_in, outs, n_out, bench, &err))
            goto done;
        status = 0;
        goto done;
    }
    /* The first run is part of the warm-up when benchmarking. */
    long warmup = bench / 10 < 1 ? 1 : bench / 10 > 10 ? 10 : bench / 10;
    double *times = bench ? calloc ((size_t) bench, sizeof *times) : NULL;
    if (bench && !times) {
        snprintf (msg, sizeof msg, "out of memory");
        goto done;
    }
    /* CPU time of the process (every thread) over the timed runs: on a
     * shared machine it moves less than the wall clock. */
    double cpu0 = 0, cpu_ms = 0;
    for (long r = 0; r < (bench ? warmup + bench : 1); r++) {
        if (bench && r == warmup)
            cpu0 = s_cpu_ms ();
        double t0 = s_now_ms ();
        if (dynamic ? kiln_model_run_batched (replicas, n_replicas, ins, n_in, outs,
                                              n_out, &err)
                    : kiln_model_run (model, ins, n_in, outs, n_out, &err)) {
            free (times);
            goto done;
        }
        if (bench && r >= warmup)
            times[r - warmup] = s_now_ms () - t0;
    }
    if (bench) {
        cpu_ms = (s_cpu_ms () - cpu0) / (double) bench;
        double sum = 0;
        for (long r = 0; r < bench; r++)
            sum += times[r];
        qsort (times, (size_t) bench, sizeof *times, s_cmp_double);
        long p99 = (long) ((double) bench * 0.99 + 0.999999) - 1;
        long rss_kib = s_peak_rss_kib ();
        const char *thr = getenv ("KILN_RT_THREADS");
        /* Whether the weights are the artifact's pages, and how many of
         * the replicas share them, so that the peak RSS can be read. */
        int mapped = kiln_model_weights_mapped (model), sharing = 1;
        /* Rows of dimension 0 per run: the batch given with
         * --dynamic-batch, else the compiled one (1 when not batched). */
        int64_t rows = dynamic ? batch : n_in > 0 && ins[0].shape.rank >= 1
                                         ? ins[0].shape.dims[0] : 1;
        double per_s = times[bench / 2] > 0 ? (double) rows * 1e3 / times[bench / 2] : 0;
        int stages = kiln_model_stage_count (model);
        char where[160] = "";
        size_t wl = (size_t) snprintf (where, sizeof where, "%d stage%s on core%s",
                                       stages, stages == 1 ? "" : "s",
                                       stages == 1 ? "" : "s");
        for (int st = 0; st < stages && wl < sizeof where; st++)
            wl += (size_t) snprintf (where + wl, sizeof where - wl, "%s%d",
                                     st ? ", " : " ", kiln_model_stage_core (model, st));
        for (int r = 1; r < n_replicas; r++)
            sharing += kiln_model_weights_ptr (replicas[r])
                       == kiln_model_weights_ptr (model);
        if (json)
            printf ("{\"runs\":%ld,\"warmup\":%ld,\"min_ms\":%.4f,\"median_ms\":"
                    "%.4f,\"p99_ms\":%.4f,\"mean_ms\":%.4f,\"peak_rss_kib\":%ld,"
                    "\"weights_mapped\":%s,\"replicas_sharing_weights\":%d,"
                    "\"rows\":%lld,\"rows_per_s\":%.3f,\"stages\":%d,"
                    "\"replicas\":%d,\"cpu_ms\":%.4f}\n",
                    bench, warmup, times[0], times[bench / 2],
                    times[p99 < 0 ? 0 : p99], sum / (double) bench, rss_kib,
                    mapped ? "true" : "false", sharing, (long long) rows, per_s,
                    stages, n_replicas ? n_replicas : 1, cpu_ms);
        else
            printf ("%ld runs after %ld warm-up (KILN_RT_THREADS=%s)\n"
                    "latency per inference: min %.3f ms, median %.3f ms, "
                    "p99 %.3f ms, mean %.3f ms\ncpu time per inference: %.3f ms\n"
                    "throughput: %.2f rows/s (%lld "
                    "per run, at the median)\npeak RSS: %.1f MiB\n"
                    "weights: %s, one copy for %d model%s\nplacement: %s\n", bench,
                    warmup, thr ? thr : "default", times[0], times[bench / 2],
                    times[p99 < 0 ? 0 : p99], sum / (double) bench, cpu_ms, per_s,
                    (long long) rows, (double) rss_kib / 1024.0,
                    mapped ? "mapped from the artifact" : "read into memory",
                    sharing, sharing == 1 ? "" : "s", where);
    }
    free (times);
    if (!outdir) {
        status = 0;
        goto done;
    }
    if (kiln_mkdir_p (outdir, 0755, &err))
        goto done;

    /* Output names may collide once sanitized: later ones get a suffix. */
    char (*names)[KILN_MAX_NAME + 16] = calloc ((size_t) n_out + 1, sizeof *names);
    if (!names) {
        snprintf (msg, sizeof msg, "out of memory");
        goto done;
    }
    bool failed = false;
    for (int i = 0; i < n_out && !failed; i++) {
        s_sanitize (man->outputs[i].name, names[i], KILN_MAX_NAME + 1);
        for (int j = 0; j < i; j++)
            if (strcmp (names[i], names[j]) == 0) {
                size_t l = strlen (names[i]);
                snprintf (names[i] + l, sizeof names[i] - l, "-%d", i);
                break;
            }
        size_t plen = strlen (outdir) + strlen (names[i]) + 8;
        char *path = malloc (plen);
        if (!path) {
            snprintf (msg, sizeof msg, "out of memory");
            failed = true;
            break;
        }
        /* "out/" and "out" name the same directory: one slash either way. */
        size_t dlen = strlen (outdir);
        while (dlen > 1 && outdir[dlen - 1] == '/')
            dlen--;
        snprintf (path, plen, "%.*s/%s.npy", (int) dlen, outdir, names[i]);
        if (kiln_npy_write (path, outs[i].dtype, &outs[i].shape, outs[i].data,
                            &err))
            failed = true;
        else
            printf ("%s\n", path);
        free (path);
    }
    free (names);
    if (!failed)
        status = 0;
done:
    if (status)
        fprintf (stderr, "kiln-run: %s\n", msg[0] ? msg : err.msg);
    for (int i = 0; arrays && i < n_in; i++)
        kiln_npy_release (&arrays[i]);
    for (int i = 0; outs && i < n_out; i++)
        free (outs[i].data);
    free (arrays);
    free (ins);
    free (outs);
    for (int r = 1; r < n_replicas; r++)
        kiln_model_destroy (&replicas[r]);
    kiln_model_destroy (&model);
    kiln_rt_destroy (&rt);
    return status;
}
