/* kiln batch (MODEL... --out-dir DIR | --jobs FILE.jsonl) [--broker EP] ... */
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <czmq.h>
#include <jansson.h>

#include "client/kiln_client.h"
#include "client/kiln_cmds.h"
#include "client/kiln_junit.h"
#include "client/kiln_progress.h"
#include "common/kiln_error.h"
#include "common/kiln_log.h"

#define S_MAX_JOBS      100000        /* jobs in one batch */
#define S_MAX_LINE      (64u << 10)   /* one line of a jobs file */

static const char *s_usage =
    "usage: kiln batch MODEL... --out-dir DIR [options]\n"
    "       kiln batch --jobs FILE.jsonl [options]\n"
    "  Compile many models on the farm at once, over one connection, and print\n"
    "  one JSON line per job as it finishes, then a summary line.  Exit status:\n"
    "  0 every job succeeded, 4 some failed, 3 the farm could not be reached,\n"
    "  2 usage, 1 anything else (docs/ci.md).\n"
    "options:\n"
    "  --out-dir DIR             write MODEL's artifact to DIR/<model name>.kar\n"
    "  --jobs FILE.jsonl         one job per line: {\"model\": PATH, \"output\": PATH,\n"
    "                            \"compiler_args\": S, \"priority\": N, \"toolchain\": S,\n"
    "                            \"timeout\": SECONDS} (model and output required)\n"
    "  --broker tcp://HOST:PORT  the farm (default: $KILN_BROKER)\n"
    "  --compiler-args, --toolchain, --target, --timeout, --priority, --retry-failed,\n"
    "  --client-name, --cert, --broker-cert: as for `kiln compile`, for every job\n"
    "                            (a jobs file line overrides them)\n"
    "  --wait SECONDS            give up on what is left after this long\n"
    "  -q, --quiet               no progress line (it is shown only on a terminal,\n"
    "                            on stderr)\n"
    "  --junit FILE              also write a JUnit XML report: one testcase per\n"
    "                            model, a failure with the compiler's log tail\n";

typedef struct {
    char *model;                 /* owned */
    char *output;                /* owned */
    char *args, *toolchain;      /* owned, may be NULL */
} s_line_t;

/* What the per-job callback needs. */
typedef struct {
    const s_line_t *lines;
    int64_t t0;                  /* zclock_usecs at the batch's start */
    kiln_junit_t *junit;         /* NULL without --junit */
    kiln_progress_t *progress;   /* NULL unless stderr is a terminal */
} s_ctx_t;

/* Add job `index` to the JUnit report. */
static void
s_junit_job (s_ctx_t *ctx, const kiln_client_job_t *job, size_t index)
{
    bool ok = job->err.code == 0;
    kiln_junit_case_t c = {
        .name = ctx->lines[index].model,
        .seconds = (double) (zclock_usecs () - ctx->t0) / 1e6,
        .cached = ok ? job->result.cached : job->failure_cached,
        .artifact = ok ? job->result.artifact : NULL,
        .worker = ok ? job->result.worker : NULL,
        .error_code = ok ? NULL : kiln_errname (job->err.code),
        .error = ok ? NULL : job->err.msg,
    };
    kiln_err_t err = { 0 };
    if (kiln_junit_add (ctx->junit, &c, &err) != 0)
        kiln_print_error ("kiln batch", err.msg);
}

static void
s_print_job (kiln_client_job_t *job, size_t index, void *arg)
{
    s_ctx_t *ctx = arg;
    const s_line_t *lines = ctx->lines;
    if (ctx->junit)
        s_junit_job (ctx, job, index);
    json_t *obj;
    if (job->err.code == 0)
        obj = json_pack ("{s:I, s:s, s:s, s:b, s:s, s:s?, s:s, s:b}", "index", (json_int_t) index,
                         "model", lines[index].model, "output", lines[index].output,
                         "ok", 1, "artifact", job->result.artifact,
                         "worker", job->result.worker[0] ? job->result.worker : NULL,
                         "action_key", job->result.action_key, "cached",
                         (int) job->result.cached);
    else
        obj = json_pack ("{s:I, s:s, s:s, s:b, s:s, s:s, s:b}", "index", (json_int_t) index,
                         "model", lines[index].model, "output", lines[index].output, "ok", 0,
                         "code", kiln_errname (job->err.code), "error", job->err.msg,
                         "failure_cached", (int) job->failure_cached);
    char *text = obj ? json_dumps (obj, JSON_COMPACT) : NULL;
    kiln_progress_clear (ctx->progress);      /* stdout may be the same terminal */
    if (text) {
        puts (text);
        fflush (stdout);
    }
    free (text);
    json_decref (obj);
    kiln_progress_job_done (ctx->progress, job->err.code == 0,
                            job->err.code == 0 ? job->result.cached : job->failure_cached);
}

/* Read a jobs file into lines[]; returns the count or -1 (message printed). */
static long
s_read_jobs (const char *path, s_line_t *lines, size_t max)
{
    FILE *f = fopen (path, "re");
    if (!f) {
        fprintf (stderr, "kiln batch: could not open '%s'\n", path);
        return -1;
    }
    char *buf = malloc (S_MAX_LINE + 2);
    long n = 0, lineno = 0;
    while (buf && fgets (buf, S_MAX_LINE + 2, f)) {
        lineno++;
        size_t len = strlen (buf);
        if (len > S_MAX_LINE) {
            fprintf (stderr, "kiln batch: '%s' line %ld is longer than %u bytes\n", path,
                     lineno, S_MAX_LINE);
            n = -1;
            break;
        }
        if (strspn (buf, " \t\r\n") == len)
            continue;
        if ((size_t) n >= max) {
            fprintf (stderr, "kiln batch: more than %zu jobs in '%s'\n", max, path);
            n = -1;
            break;
        }
        json_error_t jerr;
        json_t *obj = json_loads (buf, 0, &jerr);
        const char *model = NULL, *output = NULL, *args = NULL, *toolchain = NULL;
        if (!obj || json_unpack_ex (obj, &jerr, 0, "{s:s, s:s, s?s, s?s}", "model", &model,
                                    "output", &output, "compiler_args", &args, "toolchain",
                                    &toolchain) != 0) {
            fprintf (stderr, "kiln batch: '%s' line %ld: %s\n", path, lineno, jerr.text);
            json_decref (obj);
            n = -1;
            break;
        }
        s_line_t *l = &lines[n++];
        l->model = strdup (model);
        l->output = strdup (output);
        l->args = args ? strdup (args) : NULL;
        l->toolchain = toolchain ? strdup (toolchain) : NULL;
        json_decref (obj);
    }
    free (buf);
    fclose (f);
    return n;
}

/* Per-line priority and timeout, read again from the file (numbers). */
static void
s_read_numbers (const char *path, kiln_client_job_t *jobs, size_t n)
{
    FILE *f = fopen (path, "re");
    char *buf = malloc (S_MAX_LINE + 2);
    size_t i = 0;
    while (f && buf && i < n && fgets (buf, S_MAX_LINE + 2, f)) {
        if (strspn (buf, " \t\r\n") == strlen (buf))
            continue;
        json_t *obj = json_loads (buf, 0, NULL);
        json_t *p = obj ? json_object_get (obj, "priority") : NULL;
        json_t *t = obj ? json_object_get (obj, "timeout") : NULL;
        if (json_is_integer (p))
            jobs[i].opts.priority = (int) json_integer_value (p);
        if (json_is_integer (t) && json_integer_value (t) > 0
            && json_integer_value (t) <= 7 * 24 * 3600)
            jobs[i].opts.timeout_ms = (int) json_integer_value (t) * 1000;
        json_decref (obj);
        i++;
    }
    free (buf);
    if (f)
        fclose (f);
}

int
cmd_batch (int argc, char **argv)
{
    const char *broker = getenv ("KILN_BROKER"), *out_dir = NULL, *jobs_file = NULL;
    const char *junit_path = NULL;
    kiln_client_config_t ccfg = { 0 };
    kiln_compile_opts_t base = { 0 };
    long wait_s = 0, v;
    int quiet = 0;
    enum { OPT_BROKER = 256, OPT_ARGS, OPT_TIMEOUT, OPT_WAIT, OPT_PRIORITY, OPT_RETRY,
           OPT_TOOLCHAIN, OPT_TARGET, OPT_NAME, OPT_CERT, OPT_BROKER_CERT, OPT_OUT_DIR,
           OPT_JOBS, OPT_JUNIT };
    static const struct option opts[] = {
        { "broker", required_argument, NULL, OPT_BROKER },
        { "compiler-args", required_argument, NULL, OPT_ARGS },
        { "timeout", required_argument, NULL, OPT_TIMEOUT },
        { "wait", required_argument, NULL, OPT_WAIT },
        { "priority", required_argument, NULL, OPT_PRIORITY },
        { "retry-failed", no_argument, NULL, OPT_RETRY },
        { "toolchain", required_argument, NULL, OPT_TOOLCHAIN },
        { "target", required_argument, NULL, OPT_TARGET },
        { "client-name", required_argument, NULL, OPT_NAME },
        { "cert", required_argument, NULL, OPT_CERT },
        { "broker-cert", required_argument, NULL, OPT_BROKER_CERT },
        { "out-dir", required_argument, NULL, OPT_OUT_DIR },
        { "jobs", required_argument, NULL, OPT_JOBS },
        { "junit", required_argument, NULL, OPT_JUNIT },
        { "quiet", no_argument, NULL, 'q' },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    int c;
    optind = 1;
    while ((c = getopt_long (argc, argv, "qh", opts, NULL)) != -1) {
        char *end;
        switch (c) {
        case OPT_BROKER: broker = optarg; break;
        case OPT_ARGS: base.compiler_args = optarg; break;
        case OPT_RETRY: base.retry_failed = true; break;
        case OPT_TOOLCHAIN: base.toolchain = optarg; break;
        case OPT_TARGET: base.target = optarg; break;
        case OPT_NAME: ccfg.name = optarg; break;
        case OPT_CERT: ccfg.cert = optarg; break;
        case OPT_BROKER_CERT: ccfg.broker_cert = optarg; break;
        case OPT_OUT_DIR: out_dir = optarg; break;
        case OPT_JOBS: jobs_file = optarg; break;
        case OPT_JUNIT: junit_path = optarg; break;
        case 'q': quiet = 1; break;
        case OPT_TIMEOUT:
        case OPT_WAIT:
            v = strtol (optarg, &end, 10);
            if (!*optarg || *end || v <= 0 || v > 7 * 24 * 3600)
                return kiln_cmd_usage (s_usage, "'%s' is not whole seconds", optarg);
            if (c == OPT_TIMEOUT)
                base.timeout_ms = (int) (v * 1000);
            else
                wait_s = v;
            break;
        case OPT_PRIORITY:
            v = strtol (optarg, &end, 10);
            if (!*optarg || *end || v < -1000 || v > 1000)
                return kiln_cmd_usage (s_usage, "--priority wants -1000..1000, got '%s'", optarg);
            base.priority = (int) v;
            break;
        case 'h': fputs (s_usage, stdout); return 0;
        default: return kiln_cmd_usage (s_usage, NULL);
        }
    }
    if (!broker || !*broker)
        return kiln_cmd_usage (s_usage, "kiln batch needs a farm: --broker or $KILN_BROKER");
    if (!jobs_file == !out_dir || (jobs_file && optind != argc) || (out_dir && optind == argc))
        return kiln_cmd_usage (s_usage, "give either MODEL... with --out-dir, or --jobs");

    size_t max = jobs_file ? S_MAX_JOBS : (size_t) (argc - optind);
    if (max > S_MAX_JOBS)
        return kiln_cmd_usage (s_usage, "more than %d models", S_MAX_JOBS);
    s_line_t *lines = calloc (max ? max : 1, sizeof *lines);
    kiln_client_job_t *jobs = NULL;
    kiln_client_t *client = NULL;
    s_ctx_t ctx = { .lines = lines };
    long n = 0;
    int status = KILN_EXIT_FAIL;
    if (!lines) {
        fprintf (stderr, "kiln batch: out of memory\n");
        return 1;
    }
    if (jobs_file) {
        if ((n = s_read_jobs (jobs_file, lines, max)) < 0)
            goto done;
    }
    else {
        for (int i = optind; i < argc; i++, n++) {
            const char *base_name = strrchr (argv[i], '/') ? strrchr (argv[i], '/') + 1 : argv[i];
            char path[PATH_MAX];
            snprintf (path, sizeof path, "%s/%.*s.kar", out_dir,
                      (int) (strrchr (base_name, '.') ? strrchr (base_name, '.') - base_name
                                                      : (long) strlen (base_name)), base_name);
            lines[n].model = strdup (argv[i]);
            lines[n].output = strdup (path);
        }
    }
    jobs = calloc ((size_t) n + 1, sizeof *jobs);
    if (!jobs) {
        fprintf (stderr, "kiln batch: out of memory\n");
        goto done;
    }
    for (long i = 0; i < n; i++) {
        kiln_err_t err = { 0 };
        if (!lines[i].model || !lines[i].output) {
            fprintf (stderr, "kiln batch: out of memory\n");
            goto done;
        }
        kiln_graph_t *g = kiln_cmd_load_model (lines[i].model, &err);
        if (!g) {
            status = kiln_cmd_fail ("batch", &err);
            goto done;
        }
        jobs[i].graph = g;
        jobs[i].out_path = lines[i].output;
        jobs[i].opts = base;
        if (lines[i].args)
            jobs[i].opts.compiler_args = lines[i].args;
        if (lines[i].toolchain)
            jobs[i].opts.toolchain = lines[i].toolchain;
    }
    if (jobs_file)
        s_read_numbers (jobs_file, jobs, (size_t) n);

    kiln_err_t err = { 0 };
    ccfg.endpoint = broker;
    if (!(client = kiln_client_new_config (&ccfg, &err))) {
        status = kiln_cmd_fail ("batch", &err);
        goto done;
    }
    if (junit_path && !(ctx.junit = kiln_junit_new ("kiln batch"))) {
        fprintf (stderr, "kiln batch: out of memory\n");
        goto done;
    }
    kiln_client_catch_signals ();
    if (!quiet && (ctx.progress = kiln_progress_new (STDERR_FILENO, (size_t) n)))
        kiln_client_set_progress (client, kiln_progress_event, ctx.progress, 1000);
    ctx.t0 = zclock_usecs ();
    int rc = kiln_client_compile_batch (client, jobs, (size_t) n, (int) (wait_s * 1000),
                                        s_print_job, &ctx, &err);
    double seconds = (double) (zclock_usecs () - ctx.t0) / 1e6;
    kiln_progress_destroy (&ctx.progress);
    size_t ok = 0;
    for (long i = 0; i < n; i++)
        ok += jobs[i].err.code == 0;
    kiln_client_stats_t st;
    kiln_client_stats (client, &st);
    json_t *sum = json_pack ("{s:{s:I, s:I, s:I, s:f, s:I, s:I, s:I, s:I, s:I}}", "summary",
                             "jobs", (json_int_t) n, "ok", (json_int_t) ok, "failed",
                             (json_int_t) ((size_t) n - ok), "seconds", seconds,
                             "requests", (json_int_t) st.requests, "resent",
                             (json_int_t) st.resent, "duplicates", (json_int_t) st.duplicates,
                             "uploaded_bytes", (json_int_t) st.uploaded_bytes,
                             "reconnects", (json_int_t) st.reconnects);
    char *text = sum ? json_dumps (sum, JSON_COMPACT) : NULL;
    if (text)
        puts (text);
    free (text);
    json_decref (sum);
    /* What failed decides the status: the farm never answering any job
     * is "unreachable", some jobs failing is "some jobs failed". */
    size_t unreachable = 0;
    for (long i = 0; i < n; i++)
        unreachable += jobs[i].err.code == KILN_EUNREACHABLE;
    if (rc != 0)
        status = kiln_cmd_fail ("batch", &err);
    else if (ok == (size_t) n)
        status = KILN_EXIT_OK;
    else if (ok == 0 && unreachable == (size_t) n)
        status = KILN_EXIT_UNREACHABLE;
    else
        status = KILN_EXIT_JOBS;
    if (ctx.junit) {
        kiln_err_t jerr = { 0 };
        if (kiln_junit_write (ctx.junit, junit_path, seconds, &jerr) != 0) {
            kiln_cmd_fail ("batch", &jerr);
            if (status == KILN_EXIT_OK)
                status = KILN_EXIT_FAIL;
        }
    }
done:
    kiln_progress_destroy (&ctx.progress);
    kiln_junit_destroy (&ctx.junit);
    kiln_client_destroy (&client);
    for (long i = 0; jobs && i < n; i++)
        kiln_graph_destroy ((kiln_graph_t **) &jobs[i].graph);
    for (size_t i = 0; i < max; i++) {
        free (lines[i].model);
        free (lines[i].output);
        free (lines[i].args);
        free (lines[i].toolchain);
    }
    free (lines);
    free (jobs);
    return status;
}
