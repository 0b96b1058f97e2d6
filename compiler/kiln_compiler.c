#include "compiler/kiln_compiler.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <unistd.h>

#include "common/kiln_log.h"
#include "common/kiln_program.h"
#include "compiler/kiln_cc_lower.h"
#include "compiler/kiln_cc_pipeline.h"
#include "compiler/kiln_cc_plan.h"
#include "graph/kiln_fold.h"

/* --- target and arguments ------------------------------------------- */

static char s_target[64 + sizeof ((struct utsname *) 0)->machine];
static pthread_once_t s_target_once = PTHREAD_ONCE_INIT;

static void
s_target_init (void)
{
    struct utsname u;
    if (uname (&u) == 0 && u.machine[0])
        snprintf (s_target, sizeof s_target, "cpu-%s", u.machine);
    else
        snprintf (s_target, sizeof s_target, "cpu-unknown");
}

const char *
kiln_cc_target (void)
{
    pthread_once (&s_target_once, s_target_init);
    return s_target;
}

/* The flags the builtin compiler understands, as data: a flag with a
 * value names its bounds; an alias names the flag it stands for. */
typedef struct {
    const char *flag;
    int min, max;
    size_t field;           /* offsetof in kiln_cc_options_t (an int) */
    const char *alias_of;   /* another tool's spelling of that flag, or NULL */
} s_flag_t;

static const s_flag_t s_flags[] = {
    { "--optlevel", 0, 3, offsetof (kiln_cc_options_t, optlevel), NULL },
    { "--pipeline-cores", 1, KILN_MAX_PIPELINE_STAGES,
      offsetof (kiln_cc_options_t, pipeline_cores), NULL },
    { "--neuroncore-pipeline-cores", 1, KILN_MAX_PIPELINE_STAGES,
      offsetof (kiln_cc_options_t, pipeline_cores), "--pipeline-cores" },
};

static int
s_set_flag (const s_flag_t *f, const char *value, kiln_cc_options_t *opts,
            kiln_err_t *err)
{
    char *end;
    long v = strtol (value, &end, 10);
    if (!value[0] || *end || v < f->min || v > f->max)
        return kiln_error (err, KILN_EINVAL, "bad value '%s' for %s (expected "
                           "%d..%d)", value, f->flag, f->min, f->max);
    *(int *) ((char *) opts + f->field) = (int) v;
    return 0;
}

int
kiln_cc_parse_args (const char *args, kiln_cc_options_t *opts, kiln_err_t *err)
{
    memset (opts, 0, sizeof *opts);
    opts->optlevel = 2;
    opts->pipeline_cores = 1;
    if (!args)
        return 0;
    if (strlen (args) > KILN_MAX_ARGS_BYTES)
        return kiln_error (err, KILN_ELIMIT, "compiler arguments are longer "
                           "than %d bytes", KILN_MAX_ARGS_BYTES);
    char buf[KILN_MAX_ARGS_BYTES + 1];
    snprintf (buf, sizeof buf, "%s", args);
    char *save = NULL;
    for (char *tok = strtok_r (buf, " \t\n\r", &save); tok;
         tok = strtok_r (NULL, " \t\n\r", &save)) {
        const s_flag_t *f = NULL;
        const char *value = NULL;
        for (size_t i = 0; i < sizeof s_flags / sizeof s_flags[0]; i++) {
            size_t n = strlen (s_flags[i].flag);
            if (strncmp (tok, s_flags[i].flag, n) == 0
                && (tok[n] == '\0' || tok[n] == '=')) {
                f = &s_flags[i];
                value = tok[n] == '=' ? tok + n + 1 : NULL;
            }
        }
        if (!f)
            return kiln_error (err, KILN_EINVAL, "unknown compiler argument "
                               "'%s'", tok);
        if (!value) {
            value = strtok_r (NULL, " \t\n\r", &save);
            if (!value)
                return kiln_error (err, KILN_EINVAL, "%s needs a value", f->flag);
        }
        int rc = s_set_flag (f, value, opts, err);
        if (rc)
            return rc;
        if (f->alias_of)
            kiln_log_notice ("compiler argument %s is torch-neuron's spelling of "
                             "%s: taken as %s %s", f->flag, f->alias_of, f->alias_of,
                             value);
    }
    return 0;
}

/* --- compiling ------------------------------------------------------ */

/* Refuse every op the builtin compiler cannot lower before validation
 * runs, so that the error is the same whether or not the graph library
 * knows the op. */
static int
s_check_ops (const kiln_graph_t *g, bool before_fold, kiln_err_t *err)
{
    for (int i = 0; i < g->n_nodes; i++) {
        const kiln_node_t *n = &g->nodes[i];
        if (kiln_cc_lowering_find (n->op))
            continue;
        /* Shape, Range and the like may fold away. */
        if (before_fold && kiln_graph_fold_evaluates (n->op))
            continue;
        if (n->name && n->name[0])
            return kiln_error (err, KILN_EUNSUPPORTED, "node '%s' (%s): operator "
                               "not supported by the builtin compiler",
                               n->name, n->op ? n->op : "?");
        return kiln_error (err, KILN_EUNSUPPORTED, "node #%d (%s): operator not "
                           "supported by the builtin compiler", i,
                           n->op ? n->op : "?");
    }
    return 0;
}

static int
s_ios (const kiln_graph_t *g, const int *ts, int n, kiln_io_t **out,
       kiln_err_t *err)
{
    kiln_io_t *ios = calloc ((size_t) n + 1, sizeof *ios);
    if (!ios)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    for (int i = 0; i < n; i++) {
        const kiln_tensor_t *t = &g->tensors[ts[i]];
        if (!t->name || !t->name[0] || strlen (t->name) > KILN_MAX_NAME) {
            free (ios);
            return kiln_error (err, KILN_ECOMPILE, "graph input/output %d has "
                               "no usable name", i);
        }
        snprintf (ios[i].name, sizeof ios[i].name, "%s", t->name);
        ios[i].dtype = t->dtype;
        ios[i].shape = t->shape;
    }
    *out = ios;
    return 0;
}

static int
s_fill_manifest (kiln_artifact_t *art, kiln_graph_t *g, const char *digest,
                 const char *norm, kiln_err_t *err)
{
    kiln_manifest_t *m = kiln_artifact_manifest (art);
    m->format_version = KILN_ARTIFACT_FORMAT_VERSION;
    snprintf (m->graph_digest, sizeof m->graph_digest, "%s", digest);
    kiln_action_key (digest, norm, KILN_COMPILER_ID, KILN_COMPILER_VERSION,
                     kiln_cc_target (), m->action_key);
    snprintf (m->compiler_id, sizeof m->compiler_id, "%s", KILN_COMPILER_ID);
    snprintf (m->compiler_version, sizeof m->compiler_version, "%s",
              KILN_COMPILER_VERSION);
    snprintf (m->compiler_args, sizeof m->compiler_args, "%s", norm);
    snprintf (m->target, sizeof m->target, "%s", kiln_cc_target ());
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

kiln_artifact_t *
kiln_cc_compile_ex (kiln_graph_t *g, const char *args, kiln_cc_stats_t *stats,
                    kiln_err_t *err)
{
    return kiln_cc_compile_spill (g, args, stats, NULL, err);
}

/* A file in `dir` that nobody else can open (unlinked at once): weights.bin
 * is written there and mapped from it.  -1 with `err` on failure. */
static int
s_spill_file (const char *dir, kiln_err_t *err)
{
    char path[PATH_MAX];
    if (snprintf (path, sizeof path, "%s/.kiln-weights.XXXXXX", dir) >= (int) sizeof path) {
        kiln_error (err, KILN_ELIMIT, "directory '%s': path too long", dir);
        return -1;
    }
    int fd = mkostemp (path, O_CLOEXEC);
    if (fd < 0) {
        kiln_error (err, KILN_EIO, "could not create a weights file in '%s': %s", dir,
                    strerror (errno));
        return -1;
    }
    unlink (path);
    return fd;
}

kiln_artifact_t *
kiln_cc_compile_spill (kiln_graph_t *g, const char *args, kiln_cc_stats_t *stats,
                       const char *spill_dir, kiln_err_t *err)
{
    int spill_fd = -1;
    kiln_cc_options_t opts;
    char norm[KILN_MAX_ARGS_BYTES], digest[KILN_HEX_LEN], given[KILN_HEX_LEN];
    if (kiln_cc_parse_args (args, &opts, err)
        || kiln_args_normalize (args ? args : "", norm, sizeof norm, err))
        return NULL;
    if (!kiln_graph_complete (g)) {
        kiln_error (err, KILN_ECOMPILE, "the graph is missing weight data");
        return NULL;
    }
    /* The manifest names the graph that was submitted.  Folding (which
     * also validates) changes nothing in an imported graph, which the
     * importer folded already; when it does change a graph, the digest
     * is the one taken before, which is what the broker computed. */
    if (s_check_ops (g, true, err) || kiln_graph_digest (g, given, err))
        return NULL;
    int folded = kiln_graph_fold (g, err);
    if (folded < 0 || s_check_ops (g, false, err) || kiln_graph_validate (g, err))
        return NULL;
    if (folded > 0)
        memcpy (digest, given, sizeof digest);
    else if (kiln_graph_digest (g, digest, err))
        return NULL;

    kiln_cc_ctx_t cx;
    kiln_artifact_t *art = NULL;
    uint8_t *weights = NULL, *prog = NULL;
    size_t weights_len = 0, prog_len = 0;
    if (kiln_cc_ctx_init (&cx, g, &opts, err))
        return NULL;
    if ((spill_dir && (cx.scratch_fd = s_spill_file (spill_dir, err)) < 0)
        || kiln_cc_lower (&cx, err)
        || (spill_dir && (spill_fd = s_spill_file (spill_dir, err)) < 0)
        || kiln_cc_plan (&cx, spill_fd, &weights, &weights_len, stats, err))
        goto fail;
    kiln_stage_info_t stages[KILN_MAX_PIPELINE_STAGES];
    int n_stages = opts.pipeline_cores > 1 ? opts.pipeline_cores : 0;
    if (n_stages && kiln_cc_pipeline_cut (&cx, n_stages, stages, err))
        goto fail;
    /* The runtime will refuse anything that breaks the format; so must
     * the compiler, before it signs off on it. */
    if (kiln_program_check (cx.prog, weights_len, err)) {
        kiln_error_prefix (err, "internal error: emitted program is invalid");
        goto fail;
    }
    if (kiln_program_encode (cx.prog, &prog, &prog_len, err))
        goto fail;
    art = kiln_artifact_new ();
    if (!art) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto fail;
    }
    if (s_fill_manifest (art, g, digest, norm, err)
        || kiln_manifest_set_pipeline (kiln_artifact_manifest (art), stages, n_stages,
                                       err)
        || kiln_artifact_take_member (art, KILN_PROGRAM_MEMBER, &prog, prog_len,
                                      err)
        || (spill_fd < 0 && kiln_artifact_take_member (art, KILN_WEIGHTS_MEMBER, &weights,
                                                       weights_len, err))
        || (spill_fd >= 0 && kiln_artifact_map_member (art, KILN_WEIGHTS_MEMBER, spill_fd, 0,
                                                       weights_len, err)))
        goto fail;
    free (prog);
    free (weights);
    if (spill_fd >= 0)
        close (spill_fd);        /* the mapping keeps the (unlinked) file */
    if (cx.scratch_fd >= 0)
        close (cx.scratch_fd);
    kiln_cc_ctx_release (&cx);
    return art;
fail:
    kiln_artifact_destroy (&art);
    free (prog);
    free (weights);
    if (spill_fd >= 0)
        close (spill_fd);
    if (cx.scratch_fd >= 0)
        close (cx.scratch_fd);
    kiln_cc_ctx_release (&cx);
    return NULL;
}

kiln_artifact_t *
kiln_cc_compile (kiln_graph_t *g, const char *args, kiln_err_t *err)
{
    return kiln_cc_compile_ex (g, args, NULL, err);
}
