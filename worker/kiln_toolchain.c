/*
 * kiln_toolchain — toolchain specs, command templates and the wrapper
 * that turns an external toolchain's output into an unsigned artifact.
 */
#include "worker/kiln_toolchain.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_fs.h"
#include "common/kiln_limits.h"
#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"

#define S_EXIT_WRAP 125     /* the wrapper's status when wrapping failed */

void
kiln_toolchain_builtin (kiln_toolchain_t *out)
{
    memset (out, 0, sizeof *out);
    snprintf (out->id.id, sizeof out->id.id, "%s", KILN_COMPILER_ID);
    snprintf (out->id.version, sizeof out->id.version, "%s", KILN_COMPILER_VERSION);
    snprintf (out->id.target, sizeof out->id.target, "%s", kiln_cc_target ());
    out->builtin = true;
}

void
kiln_toolchain_release (kiln_toolchain_t *tc)
{
    if (!tc)
        return;
    for (int i = 0; i < tc->n_words; i++)
        free (tc->words[i]);
    free (tc->words);
    tc->words = NULL;
    tc->n_words = 0;
    for (int i = 0; i < tc->n_allow; i++)
        free (tc->allow[i]);
    free (tc->allow);
    tc->allow = NULL;
    tc->n_allow = 0;
}

/* A value a "P*" entry of {args:...} takes: 1..64 of [A-Za-z0-9._+-]. */
static bool
s_plain_value (const char *v)
{
    size_t n = strlen (v);
    if (n < 1 || n > 64)
        return false;
    for (const char *p = v; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9')
              || *p == '.' || *p == '_' || *p == '+' || *p == '-'))
            return false;
    return true;
}

/* An entry of {args:...} as the operator may write it: 1..64 printable
 * characters, no space, no comma, '*' only at the end. */
static bool
s_allow_entry_ok (const char *e)
{
    size_t n = strlen (e);
    if (n < 1 || n > 64)
        return false;
    for (size_t i = 0; i < n; i++)
        if (e[i] <= ' ' || e[i] > '~' || e[i] == ',' || (e[i] == '*' && i + 1 != n))
            return false;
    return true;
}

/* Find the {args} placeholder in tc->words: a word of its own, "{args}"
 * or "{args:A,B,...}" (the list goes to tc->allow and the word becomes
 * "{args}"); anywhere else in a word it is an error. */
static int
s_parse_args_word (kiln_toolchain_t *tc, kiln_err_t *err)
{
    for (int i = 0; i < tc->n_words; i++) {
        char *w = tc->words[i];
        if (!strstr (w, "{args"))
            continue;
        size_t n = strlen (w);
        bool list = strncmp (w, "{args:", 6) == 0 && w[n - 1] == '}';
        if (strcmp (w, "{args}") != 0 && !list)
            return kiln_error (err, KILN_EINVAL, "'%s': {args} must be a word of its own, "
                               "{args} or {args:ALLOWED,...}", w);
        if (tc->allow)
            return kiln_error (err, KILN_EINVAL, "{args} appears twice");
        if (!(tc->allow = calloc (KILN_TOOLCHAIN_MAX_ALLOW + 1, sizeof *tc->allow)))
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        if (!list)
            continue;
        w[n - 1] = '\0';
        size_t ln = strlen (w + 6);
        if (ln && (w[6] == ',' || w[6 + ln - 1] == ',' || strstr (w + 6, ",,")))
            return kiln_error (err, KILN_EINVAL, "{args:%s}: an empty argument in the list",
                               w + 6);
        for (char *save = NULL, *e = strtok_r (w + 6, ",", &save); e;
             e = strtok_r (NULL, ",", &save)) {
            if (!s_allow_entry_ok (e))
                return kiln_error (err, KILN_EINVAL, "{args:...}: '%s' is not an argument "
                                   "(1..64 printable characters, '*' only at the end)", e);
            if (tc->n_allow == KILN_TOOLCHAIN_MAX_ALLOW)
                return kiln_error (err, KILN_ELIMIT, "{args:...} lists more than %d arguments",
                                   KILN_TOOLCHAIN_MAX_ALLOW);
            if (!(tc->allow[tc->n_allow++] = strdup (e)))
                return kiln_error (err, KILN_ENOMEM, "out of memory");
        }
        char *plain = strdup ("{args}");
        if (!plain)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        free (tc->words[i]);
        tc->words[i] = plain;
    }
    return 0;
}

/* Whether {args:...} allows the job's argument `arg`. */
static bool
s_arg_allowed (const kiln_toolchain_t *tc, const char *arg)
{
    for (int i = 0; i < tc->n_allow; i++) {
        const char *e = tc->allow[i];
        size_t n = strlen (e);
        if (e[n - 1] == '*') {
            if (strncmp (arg, e, n - 1) == 0 && s_plain_value (arg + n - 1))
                return true;
        }
        else if (strcmp (arg, e) == 0)
            return true;
    }
    return false;
}

int
kiln_toolchain_split (const char *command, char ***words_out, int *n_out, kiln_err_t *err)
{
    *words_out = NULL;
    *n_out = 0;
    size_t len = strlen (command);
    if (len > KILN_TOOLCHAIN_MAX_COMMAND)
        return kiln_error (err, KILN_ELIMIT, "command is %zu bytes, more than %d", len,
                           KILN_TOOLCHAIN_MAX_COMMAND);
    char **words = calloc (KILN_TOOLCHAIN_MAX_WORDS + 1, sizeof *words);
    char *word = malloc (len + 1);
    if (!words || !word) {
        free (words);
        free (word);
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    int n = 0;
    size_t w = 0;
    bool in_word = false;
    char quote = 0;
    int rc = 0;
    for (const char *p = command;; p++) {
        char c = *p;
        if (c == '\0' && quote) {
            rc = kiln_error (err, KILN_EINVAL, "unterminated %c quote in '%s'", quote, command);
            break;
        }
        if (quote) {
            if (c == quote)
                quote = 0;
            else if (c == '\\' && quote == '"' && (p[1] == '"' || p[1] == '\\'))
                word[w++] = *++p;
            else
                word[w++] = c;
            continue;
        }
        if (c == '\0' || c == ' ' || c == '\t' || c == '\n') {
            if (in_word) {
                if (n >= KILN_TOOLCHAIN_MAX_WORDS) {
                    rc = kiln_error (err, KILN_ELIMIT, "command has more than %d words",
                                     KILN_TOOLCHAIN_MAX_WORDS);
                    break;
                }
                word[w] = '\0';
                if (!(words[n++] = strdup (word))) {
                    rc = kiln_error (err, KILN_ENOMEM, "out of memory");
                    break;
                }
                w = 0;
                in_word = false;
            }
            if (c == '\0')
                break;
            continue;
        }
        in_word = true;
        if (c == '\'' || c == '"')
            quote = c;
        else if (c == '\\' && p[1])
            word[w++] = *++p;
        else
            word[w++] = c;
    }
    free (word);
    if (rc == 0 && n == 0)
        rc = kiln_error (err, KILN_EINVAL, "empty command");
    if (rc != 0) {
        for (int i = 0; i < n; i++)
            free (words[i]);
        free (words);
        return rc;
    }
    *words_out = words;
    *n_out = n;
    return 0;
}

int
kiln_toolchain_parse_spec (const char *spec, const char *target, kiln_toolchain_t *out,
                           kiln_err_t *err)
{
    memset (out, 0, sizeof *out);
    const char *eq = strchr (spec, '=');
    if (!eq || eq == spec || !eq[1])
        return kiln_error (err, KILN_EINVAL, "toolchain '%s' is not NAME[@VERSION]=COMMAND",
                           spec);
    char name[2 * KILN_PROTO_MAX_ID + 2];
    size_t n = (size_t) (eq - spec);
    if (n >= sizeof name)
        return kiln_error (err, KILN_EINVAL, "toolchain name in '%s' is too long", spec);
    memcpy (name, spec, n);
    name[n] = '\0';
    char *at = strchr (name, '@');
    const char *version = "0";
    if (at) {
        *at = '\0';
        version = at + 1;
    }
    if (!kiln_toolchain_word_ok (name) || !kiln_toolchain_word_ok (version)
        || !kiln_toolchain_word_ok (target))
        return kiln_error (err, KILN_EINVAL, "toolchain '%s': name, version and target must "
                           "be 1..%d characters of [A-Za-z0-9._+-]", spec, KILN_PROTO_MAX_ID);
    if (strcmp (name, KILN_COMPILER_ID) == 0)
        return kiln_error (err, KILN_EINVAL, "toolchain '%s': '%s' is the builtin compiler's "
                           "name", spec, KILN_COMPILER_ID);
    /* lengths checked by kiln_toolchain_word_ok */
    memcpy (out->id.id, name, strlen (name) + 1);
    memcpy (out->id.version, version, strlen (version) + 1);
    memcpy (out->id.target, target, strlen (target) + 1);
    if (strcmp (eq + 1, "@noop") == 0) {
        out->noop = true;
        return 0;
    }
    int rc = kiln_toolchain_split (eq + 1, &out->words, &out->n_words, err);
    if (rc == 0)
        rc = s_parse_args_word (out, err);
    if (rc) {
        kiln_toolchain_release (out);
        return kiln_error_prefix (err, "toolchain '%s'", name);
    }
    return 0;
}

/* `word` with every placeholder replaced; caller frees. */
static char *
s_substitute (const char *word, const char *const keys[], const char *const values[], int n)
{
    size_t cap = strlen (word) + 1;
    for (int i = 0; i < n; i++)
        for (const char *p = strstr (word, keys[i]); p; p = strstr (p + 1, keys[i]))
            cap += strlen (values[i]);
    char *out = malloc (cap);
    if (!out)
        return NULL;
    size_t len = 0;
    for (const char *p = word; *p;) {
        int k = -1;
        for (int i = 0; i < n && k < 0; i++)
            if (strncmp (p, keys[i], strlen (keys[i])) == 0)
                k = i;
        if (k < 0) {
            out[len++] = *p++;
            continue;
        }
        size_t vl = strlen (values[k]);
        memcpy (out + len, values[k], vl);
        len += vl;
        p += strlen (keys[k]);
    }
    out[len] = '\0';
    return out;
}

void
kiln_toolchain_argv_free (char **argv)
{
    if (!argv)
        return;
    for (char **p = argv; *p; p++)
        free (*p);
    free (argv);
}

char **
kiln_toolchain_argv (const kiln_toolchain_t *tc, const char *input, const char *output,
                     const char *workdir, const char *args, kiln_err_t *err)
{
    char **arg_words = NULL;
    int n_args = 0;
    if (args && *args && kiln_toolchain_split (args, &arg_words, &n_args, err) != 0)
        return NULL;
    for (int k = 0; tc->allow && k < n_args; k++)
        if (!s_arg_allowed (tc, arg_words[k])) {
            kiln_error (err, KILN_EINVAL, "compiler argument '%s' is not one that toolchain "
                        "'%s' allows (its {args:...} on the worker)", arg_words[k], tc->id.id);
            for (int j = 0; j < n_args; j++)
                free (arg_words[j]);
            free (arg_words);
            return NULL;
        }
    size_t cap = (size_t) tc->n_words + (size_t) n_args + 1;
    char **argv = calloc (cap, sizeof *argv);
    static const char *const keys[] = { "{input}", "{output}", "{workdir}" };
    const char *values[] = { input, output, workdir };
    size_t n = 0;
    bool ok = argv != NULL;
    for (int i = 0; ok && i < tc->n_words; i++) {
        if (strcmp (tc->words[i], "{args}") == 0) {
            for (int k = 0; ok && k < n_args; k++)
                ok = (argv[n++] = strdup (arg_words[k])) != NULL;
            continue;
        }
        ok = (argv[n++] = s_substitute (tc->words[i], keys, values, 3)) != NULL;
    }
    for (int k = 0; k < n_args; k++)
        free (arg_words[k]);
    free (arg_words);
    if (!ok) {
        kiln_toolchain_argv_free (argv);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    return argv;
}

/* --- the command's output ------------------------------------------------------ */

int
kiln_toolchain_create_output (const char *path, kiln_err_t *err)
{
    int fd = open (path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0)
        return kiln_error (err, KILN_ESYS, "could not create the toolchain's output '%s': %s",
                           path, strerror (errno));
    close (fd);
    return 0;
}

int
kiln_toolchain_read_output (const char *path, uint64_t max, uint8_t **data, size_t *len,
                            uint64_t *size, kiln_err_t *err)
{
    *data = NULL;
    *len = 0;
    struct stat st;
    int fd = kiln_open_regular (path, "the toolchain's output", O_NOFOLLOW, &st, err);
    if (fd < 0)
        return fd;
    if (size)
        *size = (uint64_t) st.st_size;
    int rc = 0;
    if (st.st_nlink != 1)
        rc = kiln_error (err, KILN_EIO, "the toolchain's output '%s' has %llu links, not one",
                         path, (unsigned long long) st.st_nlink);
    else if ((uint64_t) st.st_size > max)
        rc = kiln_error (err, KILN_ELIMIT, "the toolchain's output '%s' is %lld bytes, more "
                         "than %llu", path, (long long) st.st_size, (unsigned long long) max);
    else if (!(*data = malloc ((size_t) st.st_size + 1)))
        rc = kiln_error (err, KILN_ENOMEM, "out of memory reading '%s'", path);
    while (rc == 0 && *len < (size_t) st.st_size) {
        ssize_t n = read (fd, *data + *len, (size_t) st.st_size - *len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            rc = kiln_error (err, KILN_EIO, "could not read '%s': %s", path,
                             n < 0 ? strerror (errno) : "file shrank while reading");
        else
            *len += (size_t) n;
    }
    close (fd);
    if (rc) {
        free (*data);
        *data = NULL;
        *len = 0;
    }
    return rc;
}

/* --- wrapping ------------------------------------------------------------------ */

static int
s_ios (const kiln_graph_t *g, const int *ts, int n, kiln_io_t **out, kiln_err_t *err)
{
    kiln_io_t *ios = calloc ((size_t) n + 1, sizeof *ios);
    if (!ios)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    for (int i = 0; i < n; i++) {
        const kiln_tensor_t *t = &g->tensors[ts[i]];
        if (!t->name || !t->name[0] || strlen (t->name) > KILN_MAX_NAME) {
            free (ios);
            return kiln_error (err, KILN_EFORMAT, "graph input/output %d has no usable name", i);
        }
        snprintf (ios[i].name, sizeof ios[i].name, "%s", t->name);
        ios[i].dtype = t->dtype;
        ios[i].shape = t->shape;
    }
    *out = ios;
    return 0;
}

static bool
s_ios_known (const kiln_graph_t *g)
{
    for (int i = 0; i < g->n_inputs; i++)
        if (g->tensors[g->inputs[i]].shape.rank < 0
            || g->tensors[g->inputs[i]].dtype == KILN_DT_UNDEFINED)
            return false;
    for (int i = 0; i < g->n_outputs; i++)
        if (g->tensors[g->outputs[i]].shape.rank < 0
            || g->tensors[g->outputs[i]].dtype == KILN_DT_UNDEFINED)
            return false;
    return true;
}

/* The manifest of a wrapped output: the job's keys and the graph's interface. */
static int
s_fill_manifest (kiln_artifact_t *art, const kiln_wrap_job_t *job, const kiln_graph_t *g,
                 kiln_err_t *err)
{
    kiln_manifest_t *m = kiln_artifact_manifest (art);
    m->format_version = KILN_ARTIFACT_FORMAT_VERSION;
    snprintf (m->graph_digest, sizeof m->graph_digest, "%s", job->graph_digest);
    snprintf (m->action_key, sizeof m->action_key, "%s", job->action_key);
    snprintf (m->compiler_id, sizeof m->compiler_id, "%s", job->toolchain.id);
    snprintf (m->compiler_version, sizeof m->compiler_version, "%s", job->toolchain.version);
    snprintf (m->compiler_args, sizeof m->compiler_args, "%s", job->args ? job->args : "");
    snprintf (m->target, sizeof m->target, "%s", job->toolchain.target);
    m->runtime_abi = KILN_RUNTIME_ABI_VERSION;
    kiln_io_t *ins = NULL, *outs = NULL;
    int rc = s_ios (g, g->inputs, g->n_inputs, &ins, err);
    if (rc == 0)
        rc = s_ios (g, g->outputs, g->n_outputs, &outs, err);
    if (rc == 0)
        rc = kiln_manifest_set_io (m, false, ins, g->n_inputs, err);
    if (rc == 0)
        rc = kiln_manifest_set_io (m, true, outs, g->n_outputs, err);
    if (rc == 0)
        rc = kiln_manifest_set_io_structure (m, g->io_structure, err);
    free (ins);
    free (outs);
    return rc;
}

int
kiln_toolchain_wrap_mem (const kiln_wrap_job_t *job, const uint8_t *structure,
                         size_t struct_len, uint8_t **output, size_t len, uint8_t **kar,
                         size_t *kar_len, kiln_err_t *err)
{
    *kar = NULL;
    *kar_len = 0;
    kiln_artifact_t *art = NULL;
    kiln_graph_t *g = kiln_graph_decode (structure, struct_len, err);
    int rc;
    if (!g) {
        rc = -err->code;
        goto done;
    }
    if (!s_ios_known (g)) {
        rc = kiln_error (err, KILN_EUNSUPPORTED, "the graph does not declare the shapes of its "
                         "inputs and outputs");
        goto done;
    }
    if (!(art = kiln_artifact_new ())) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory");
        goto done;
    }
    if ((rc = s_fill_manifest (art, job, g, err)) != 0
        || (rc = kiln_artifact_take_member (art, KILN_TOOLCHAIN_MEMBER, output, len, err)) != 0)
        goto done;
    rc = kiln_artifact_write_mem (art, kar, kar_len, err);
done:
    if (output && *output) {
        free (*output);
        *output = NULL;
    }
    kiln_artifact_destroy (&art);
    kiln_graph_destroy (&g);
    return rc;
}

int
kiln_toolchain_wrap (const kiln_wrap_job_t *job, kiln_err_t *err)
{
    kiln_graph_t *g = NULL;
    kiln_artifact_t *art = NULL;
    uint8_t *bytes = NULL;
    size_t len = 0;
    int rc;
    if (!(g = kiln_graph_load (job->graph, err))) {
        rc = -err->code;
        goto done;
    }
    /* The interface goes into the manifest with fixed shapes; infer them
     * when the graph does not declare them. */
    if (!s_ios_known (g) && (rc = kiln_graph_validate (g, err)) != 0) {
        kiln_error_prefix (err, "cannot describe the graph's inputs and outputs");
        goto done;
    }
    if ((rc = kiln_toolchain_read_output (job->output, KILN_MAX_MEMBER_BYTES, &bytes, &len,
                                          NULL, err)) != 0) {
        kiln_error_prefix (err, "the toolchain's output");
        goto done;
    }
    if (!(art = kiln_artifact_new ())) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory");
        goto done;
    }
    if ((rc = s_fill_manifest (art, job, g, err)) != 0
        || (rc = kiln_artifact_take_member (art, KILN_TOOLCHAIN_MEMBER, &bytes, len, err)) != 0
        || (rc = kiln_artifact_write (art, job->kar, err)) != 0)
        goto done;
done:
    free (bytes);
    kiln_artifact_destroy (&art);
    kiln_graph_destroy (&g);
    return rc;
}

int
kiln_toolchain_wrap_main (int argc, char **argv)
{
    kiln_wrap_job_t job;
    memset (&job, 0, sizeof job);
    const char *toolchain = NULL;
    enum { O_GRAPH = 256, O_OUTPUT, O_KAR, O_ACTION, O_DIGEST, O_ARGS, O_TOOLCHAIN, O_WRAP };
    static const struct option opts[] = {
        { "wrap", no_argument, NULL, O_WRAP },
        { "graph", required_argument, NULL, O_GRAPH },
        { "output", required_argument, NULL, O_OUTPUT },
        { "kar", required_argument, NULL, O_KAR },
        { "action-key", required_argument, NULL, O_ACTION },
        { "graph-digest", required_argument, NULL, O_DIGEST },
        { "args", required_argument, NULL, O_ARGS },
        { "toolchain", required_argument, NULL, O_TOOLCHAIN },
        { NULL, 0, NULL, 0 },
    };
    int c;
    optind = 1;
    while ((c = getopt_long (argc, argv, "+", opts, NULL)) != -1) {
        switch (c) {
        case O_WRAP: break;
        case O_GRAPH: job.graph = optarg; break;
        case O_OUTPUT: job.output = optarg; break;
        case O_KAR: job.kar = optarg; break;
        case O_ACTION: job.action_key = optarg; break;
        case O_DIGEST: job.graph_digest = optarg; break;
        case O_ARGS: job.args = optarg; break;
        case O_TOOLCHAIN: toolchain = optarg; break;
        default:
            fprintf (stderr, "kiln-worker --wrap: bad arguments\n");
            return S_EXIT_WRAP;
        }
    }
    kiln_err_t err = { 0 };
    if (!job.graph || !job.output || !job.kar || !job.action_key || !job.graph_digest
        || !toolchain || kiln_toolchain_parse (toolchain, &job.toolchain, &err) != 0) {
        fprintf (stderr, "kiln-worker --wrap: incomplete job description%s%s\n",
                 err.msg[0] ? ": " : "", err.msg);
        return S_EXIT_WRAP;
    }
    if (optind >= argc) {            /* nothing to run: wrap what is there */
        if (kiln_toolchain_wrap (&job, &err) != 0) {
            fprintf (stderr, "kiln-worker: could not wrap the output of toolchain '%s': %s\n",
                     job.toolchain.id, err.msg);
            return S_EXIT_WRAP;
        }
        return 0;
    }
    /* Run the command as our child, in our process group (so that the
     * worker's timeout kills it with us), and dying with us. */
    pid_t parent = getpid ();
    pid_t pid = fork ();
    if (pid < 0) {
        fprintf (stderr, "kiln-worker --wrap: fork: %s\n", strerror (errno));
        return S_EXIT_WRAP;
    }
    if (pid == 0) {
        prctl (PR_SET_PDEATHSIG, SIGKILL);
        if (getppid () != parent)
            _exit (127);
        execvp (argv[optind], argv + optind);
        fprintf (stderr, "kiln-worker: could not run '%s': %s\n", argv[optind],
                 strerror (errno));
        _exit (127);
    }
    int status = 0;
    while (waitpid (pid, &status, 0) < 0)
        if (errno != EINTR) {
            fprintf (stderr, "kiln-worker --wrap: waitpid: %s\n", strerror (errno));
            return S_EXIT_WRAP;
        }
    if (WIFSIGNALED (status)) {
        fprintf (stderr, "kiln-worker: toolchain '%s' killed by signal %d\n",
                 job.toolchain.id, WTERMSIG (status));
        return 128 + WTERMSIG (status);
    }
    if (WEXITSTATUS (status) != 0)
        return WEXITSTATUS (status);
    if (kiln_toolchain_wrap (&job, &err) != 0) {
        fprintf (stderr, "kiln-worker: could not wrap the output of toolchain '%s': %s\n",
                 job.toolchain.id, err.msg);
        return S_EXIT_WRAP;
    }
    return 0;
}
