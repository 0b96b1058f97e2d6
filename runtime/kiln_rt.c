#include "runtime/kiln_rt.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kiln_log.h"
#include "common/kiln_mem.h"
#include "common/kiln_program.h"
#include "runtime/kiln_artcache.h"
#include "runtime/kiln_cores.h"
#include "runtime/kiln_exec.h"
#include "runtime/kiln_kernels.h"
#include "runtime/kiln_pipeline.h"
#include "runtime/kiln_rt_priv.h"

struct kiln_rt {
    _Atomic unsigned n_loaded;      /* models placed round-robin so far */
    kiln_cores_t *cores;            /* execution cores (kiln_cores.h) */
    kiln_artcache_t *cache;         /* loaded artifacts, shared by replicas */
    _Atomic int refs;               /* the creator's, plus one per model */
    bool shared;                    /* kiln_rt_shared's: never destroyed */
};

/* kiln_rt_shared's runtime; written once, under s_shared_lock. */
static kiln_rt_t *_Atomic s_shared;
static pthread_mutex_t s_shared_lock = PTHREAD_MUTEX_INITIALIZER;

struct kiln_model {
    kiln_artifact_t *art;           /* verified artifact: manifest, members;
                                       shared through rt->cache, read-only */
    kiln_program_t *prog;           /* decoded and checked program */
    kiln_kplan_t *plans;            /* one per op */
    kiln_exec_t *exec;              /* workspace, profile (kiln_exec.h) */
    uint8_t *arena;                 /* 64-byte aligned, prog->arena_size */
    const uint8_t *weights;         /* weights.bin, in art (mapped or read)
                                       or weights_copy */
    uint8_t *weights_copy;          /* aligned copy when the member is not */
    void **data;                    /* address of each tensor */
    pthread_mutex_t lock;           /* one run at a time: the arena is shared */
    kiln_rt_t *rt;                  /* holds a reference */
    int core;                       /* where its runs execute (stage 0's) */
    kiln_pipeline_t *pipe;          /* a pipelined program's stages, or NULL
                                       (then exec, arena and data are unused) */
};

kiln_rt_t *
kiln_rt_new (kiln_err_t *err)
{
    kiln_rt_t *self = calloc (1, sizeof *self);
    if (!self) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    self->cores = kiln_cores_new (getenv ("KILN_RT_VISIBLE_CORES"),
                                  getenv ("KILN_RT_NUM_CORES"), err);
    if (!self->cores) {
        free (self);
        return NULL;
    }
    const char *mmap_env = getenv ("KILN_RT_MMAP");
    int mode = kiln_artcache_mode (mmap_env);
    if (mode < 0) {
        kiln_log_warn ("KILN_RT_MMAP='%s' is not 0, 1 or auto; using auto", mmap_env);
        mode = KILN_ARTCACHE_AUTO;
    }
    self->cache = kiln_artcache_new ((kiln_artcache_mode_t) mode);
    if (!self->cache) {
        kiln_cores_destroy (&self->cores);
        free (self);
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    atomic_init (&self->n_loaded, 0);
    atomic_init (&self->refs, 1);
    return self;
}

/* Drop one reference; the last one joins the cores and frees. */
static void
s_rt_unref (kiln_rt_t *self)
{
    if (self && atomic_fetch_sub (&self->refs, 1) == 1) {
        kiln_cores_destroy (&self->cores);
        kiln_artcache_destroy (&self->cache);
        free (self);
    }
}

void
kiln_rt_destroy (kiln_rt_t **self_p)
{
    if (self_p && *self_p) {
        /* The shared runtime keeps its creator's reference for ever. */
        if (!(*self_p)->shared)
            s_rt_unref (*self_p);
        *self_p = NULL;
    }
}

kiln_rt_t *
kiln_rt_shared (kiln_err_t *err)
{
    kiln_rt_t *rt = atomic_load (&s_shared);
    if (rt)
        return rt;
    /* A mutex rather than pthread_once, so that a failed creation (a bad
     * KILN_RT_VISIBLE_CORES) is reported to every caller and retried. */
    pthread_mutex_lock (&s_shared_lock);
    rt = atomic_load (&s_shared);
    if (!rt) {
        rt = kiln_rt_new (err);
        if (rt) {
            rt->shared = true;
            atomic_store (&s_shared, rt);
        }
    }
    pthread_mutex_unlock (&s_shared_lock);
    return rt;
}

int
kiln_rt_num_cores (const kiln_rt_t *rt)
{
    return rt ? kiln_cores_count (rt->cores) : 0;
}

int
kiln_rt_core_cpu (const kiln_rt_t *rt, int core)
{
    return rt ? kiln_cores_cpu (rt->cores, core) : -1;
}

int
kiln_model_core (const kiln_model_t *m)
{
    return m ? m->core : -1;
}

kiln_cores_t *
kiln_model_cores (const kiln_model_t *m)
{
    return m->rt->cores;
}

void
kiln_model_destroy (kiln_model_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_model_t *m = *self_p;
    kiln_pipeline_destroy (&m->pipe);
    pthread_mutex_destroy (&m->lock);
    kiln_exec_destroy (&m->exec);
    free (m->data);
    free (m->plans);
    free (m->arena);
    free (m->weights_copy);
    kiln_program_destroy (&m->prog);
    if (m->rt)
        kiln_artcache_put (m->rt->cache, &m->art);
    s_rt_unref (m->rt);
    free (m);
    *self_p = NULL;
}

uint8_t *
kiln_rt_aligned_zalloc (uint64_t size)
{
    uint64_t n;
    if (!kiln_prog_align_up (size ? size : 1, &n) || n > SIZE_MAX)
        return NULL;
    uint8_t *p = kiln_mem_alloc ((size_t) n);    /* (KILN_PROG_ALIGN at least) */
    if (p)
        memset (p, 0, (size_t) n);
    return p;
}

static char *
s_io_str (kiln_dtype_t dt, const kiln_shape_t *shape, char *buf, size_t size)
{
    char sh[160];
    snprintf (buf, size, "%s %s", kiln_dtype_name (dt),
              kiln_shape_str (shape, sh, sizeof sh));
    return buf;
}

/* The program's inputs and outputs must be the manifest's, in order. */
static int
s_check_io (const kiln_manifest_t *man, const kiln_program_t *p,
            kiln_err_t *err)
{
    if (man->n_inputs != p->n_inputs || man->n_outputs != p->n_outputs)
        return kiln_error (err, KILN_EFORMAT, "the manifest lists %d inputs and "
                           "%d outputs, the program %d and %d", man->n_inputs,
                           man->n_outputs, p->n_inputs, p->n_outputs);
    for (int o = 0; o < 2; o++) {
        const kiln_io_t *ios = o ? man->outputs : man->inputs;
        const int *ts = o ? p->outputs : p->inputs;
        int n = o ? p->n_outputs : p->n_inputs;
        for (int i = 0; i < n; i++) {
            const kiln_prog_tensor_t *t = &p->tensors[ts[i]];
            if (t->dtype != ios[i].dtype || !kiln_shape_equal (&t->shape, &ios[i].shape)) {
                char a[200], b[200];
                return kiln_error (err, KILN_EFORMAT, "%s '%s': the manifest "
                                   "says %s, the program %s",
                                   o ? "output" : "input", ios[i].name,
                                   s_io_str (ios[i].dtype, &ios[i].shape, a, sizeof a),
                                   s_io_str (t->dtype, &t->shape, b, sizeof b));
            }
        }
    }
    return 0;
}

/* Everything after the signature check: decode, check, plan, allocate. */
static int
s_prepare (kiln_model_t *m, kiln_err_t *err)
{
    const kiln_manifest_t *man = kiln_artifact_manifest (m->art);
    if (man->runtime_abi != KILN_RUNTIME_ABI_VERSION)
        return kiln_error (err, KILN_EUNSUPPORTED, "artifact needs runtime ABI "
                           "%d, this runtime provides %d", man->runtime_abi,
                           KILN_RUNTIME_ABI_VERSION);
    size_t plen, wlen;
    const uint8_t *pbytes = kiln_artifact_member (m->art, KILN_PROGRAM_MEMBER, &plen);
    const uint8_t *wbytes = kiln_artifact_member (m->art, KILN_WEIGHTS_MEMBER, &wlen);
    if (!pbytes)
        return kiln_error (err, KILN_EFORMAT, "artifact has no member '%s'",
                           KILN_PROGRAM_MEMBER);
    if (!wbytes)
        return kiln_error (err, KILN_EFORMAT, "artifact has no member '%s'",
                           KILN_WEIGHTS_MEMBER);
    m->prog = kiln_program_decode (pbytes, plen, wlen, err);
    if (!m->prog)
        return kiln_error_prefix (err, "member '%s'", KILN_PROGRAM_MEMBER);
    kiln_program_t *p = m->prog;
    int rc = s_check_io (man, p, err);
    if (rc)
        return kiln_error_prefix (err, "member '%s'", KILN_PROGRAM_MEMBER);

    if ((rc = kiln_pipeline_check_manifest (man, p, err)))
        return rc;

    m->plans = calloc ((size_t) p->n_ops + 1, sizeof *m->plans);
    m->data = calloc ((size_t) p->n_tensors + 1, sizeof *m->data);
    if (!m->plans || !m->data)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    for (int i = 0; i < p->n_ops; i++)
        if ((rc = kiln_kernel_prepare (p, i, &m->plans[i], err)))
            return kiln_error_prefix (err, "member '%s'", KILN_PROGRAM_MEMBER);

    /* Weights are used where they lie — pages mapped from the artifact
     * file (page-aligned) or the artifact's malloc'd copy (16-byte
     * aligned), in both cases shared with the replicas loaded from the
     * same file — since every weight's offset is a multiple of 64 and no
     * kernel needs more than 16 bytes of alignment today.  Only bytes that
     * are not so aligned (never, from a file) are copied, per model, to a
     * 64-byte aligned buffer. */
    m->weights = wbytes;
    if ((uintptr_t) wbytes % _Alignof (max_align_t) != 0) {
        m->weights_copy = kiln_rt_aligned_zalloc (wlen);
        if (!m->weights_copy)
            return kiln_error (err, KILN_ENOMEM, "out of memory copying %zu "
                               "bytes of weights", wlen);
        memcpy (m->weights_copy, wbytes, wlen);
        m->weights = m->weights_copy;
    }
    /* A pipelined program's stages get their workspaces and arenas when
     * they are placed (kiln_pipeline_new). */
    if (p->n_stages > 0)
        return 0;
    if (!(m->exec = kiln_exec_new (p, m->plans, err)))
        return kiln_error_prefix (err, "member '%s'", KILN_PROGRAM_MEMBER);
    m->arena = kiln_rt_aligned_zalloc (p->arena_size);
    if (!m->arena)
        return kiln_error (err, KILN_ENOMEM, "out of memory allocating an arena "
                           "of %llu bytes", (unsigned long long) p->arena_size);
    for (int t = 0; t < p->n_tensors; t++) {
        const kiln_prog_tensor_t *pt = &p->tensors[t];
        m->data[t] = pt->kind == KILN_TK_WEIGHT
                     ? (void *) (m->weights + pt->offset)
                     : (void *) (m->arena + pt->offset);
    }
    return 0;
}

kiln_model_t *
kiln_rt_load (kiln_rt_t *rt, const char *path, const char *keyring_dir,
              kiln_err_t *err)
{
    return kiln_rt_load_on (rt, path, keyring_dir, -1, err);
}

kiln_model_t *
kiln_rt_load_on (kiln_rt_t *rt, const char *path, const char *keyring_dir,
                 int core, kiln_err_t *err)
{
    if (!rt || !path || !keyring_dir) {
        kiln_error (err, KILN_EINVAL, "kiln_rt_load needs a runtime, a path "
                    "and a keyring");
        return NULL;
    }
    if (core < -1 || core >= kiln_rt_num_cores (rt)) {
        kiln_error (err, KILN_EINVAL, "no core %d: the runtime has %d (0..%d)",
                    core, kiln_rt_num_cores (rt), kiln_rt_num_cores (rt) - 1);
        return NULL;
    }
    kiln_model_t *m = calloc (1, sizeof *m);
    if (!m) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    pthread_mutex_init (&m->lock, NULL);
    m->rt = rt;
    atomic_fetch_add (&rt->refs, 1);
    /* Nothing of the artifact is looked at before its signature and every
     * member digest have been checked; replicas of a model loaded before
     * share its artifact, weights included (kiln_artcache.h). */
    m->art = kiln_artcache_get (rt->cache, path, keyring_dir, err);
    if (!m->art) {
        kiln_model_destroy (&m);
        return NULL;
    }
    if (s_prepare (m, err)) {
        kiln_error_prefix (err, "%s", path);
        kiln_model_destroy (&m);
        return NULL;
    }
    /* Placed only once loaded, so that a failed load takes no turn; a
     * model placed on a given core takes none either.  A pipelined model
     * takes one turn per stage, its stages on consecutive cores. */
    int turns = m->prog->n_stages > 0 ? m->prog->n_stages : 1;
    if (turns > kiln_rt_num_cores (rt) && !kiln_pipeline_may_share ()) {
        kiln_error (err, KILN_EUNSUPPORTED, "%s: the model is pipelined over %d "
                    "cores (compiled with --pipeline-cores %d) but this runtime has "
                    "%d (KILN_RT_VISIBLE_CORES, KILN_RT_NUM_CORES); give it %d cores, "
                    "or set KILN_RT_PIPELINE_SHARE=1 to run its stages together on "
                    "fewer", path, turns, turns, kiln_rt_num_cores (rt), turns);
        kiln_model_destroy (&m);
        return NULL;
    }
    m->core = core >= 0 ? core
                        : (int) (atomic_fetch_add (&rt->n_loaded, (unsigned) turns)
                                 % (unsigned) kiln_rt_num_cores (rt));
    if (m->prog->n_stages > 0) {
        int cores[KILN_PROG_MAX_STAGES];
        for (int s = 0; s < m->prog->n_stages; s++)
            cores[s] = (m->core + s) % kiln_rt_num_cores (rt);
        if (!(m->pipe = kiln_pipeline_new (m->prog, m->plans, m->weights, rt->cores,
                                           cores, err))) {
            kiln_error_prefix (err, "%s", path);
            kiln_model_destroy (&m);
            return NULL;
        }
    }
    return m;
}

const void *
kiln_model_weights_ptr (const kiln_model_t *m)
{
    return m ? m->weights : NULL;
}

int
kiln_model_weights_mapped (const kiln_model_t *m)
{
    return m && !m->weights_copy
           && kiln_artifact_member_mapped (m->art, KILN_WEIGHTS_MEMBER);
}

const kiln_manifest_t *
kiln_model_manifest (const kiln_model_t *m)
{
    return kiln_artifact_manifest (m->art);
}

int
kiln_model_digest (const kiln_model_t *m, char out[KILN_HEX_LEN],
                   kiln_err_t *err)
{
    /* Serialising the manifest only reads the artifact. */
    return kiln_artifact_digest (m->art, out, err);
}

static int
s_check_tensor (const char *what, const kiln_io_t *io,
                const kiln_rt_tensor_t *t, kiln_err_t *err)
{
    if (t->dtype != io->dtype || !kiln_shape_equal (&t->shape, &io->shape)) {
        char a[200], b[200];
        kiln_shape_t got = t->shape;
        if (got.rank < 0 || got.rank > KILN_MAX_RANK)
            got.rank = -1;
        return kiln_error (err, KILN_ESHAPE, "%s '%s': expected %s, received %s",
                           what, io->name,
                           s_io_str (io->dtype, &io->shape, a, sizeof a),
                           s_io_str (t->dtype, &got, b, sizeof b));
    }
    /* A tensor with no elements needs no buffer. */
    bool empty = false;
    for (int d = 0; d < t->shape.rank; d++)
        empty = empty || t->shape.dims[d] == 0;
    if (!t->data && !empty)
        return kiln_error (err, KILN_EINVAL, "%s '%s': no data", what, io->name);
    return 0;
}

int
kiln_model_check_run (const kiln_model_t *m, const kiln_rt_tensor_t *inputs,
                      int n_inputs, kiln_rt_tensor_t *outputs, int n_outputs,
                      kiln_err_t *err)
{
    const kiln_manifest_t *man = kiln_model_manifest (m);
    if (n_inputs != man->n_inputs || n_outputs != man->n_outputs)
        return kiln_error (err, KILN_EINVAL, "the model takes %d inputs and %d "
                           "outputs, got %d and %d", man->n_inputs,
                           man->n_outputs, n_inputs, n_outputs);
    for (int i = 0; i < n_inputs; i++) {
        int rc = s_check_tensor ("input", &man->inputs[i], &inputs[i], err);
        if (rc)
            return rc;
    }
    for (int i = 0; i < n_outputs; i++)
        if (!outputs[i].data)
            return kiln_error (err, KILN_EINVAL, "output '%s': no buffer",
                               man->outputs[i].name);
    return 0;
}

int
kiln_model_run_here (kiln_model_t *m, const kiln_rt_tensor_t *inputs,
                     int n_inputs, kiln_rt_tensor_t *outputs, int n_outputs,
                     kiln_err_t *err)
{
    const kiln_manifest_t *man = kiln_model_manifest (m);
    const kiln_program_t *p = m->prog;
    int rc = kiln_model_check_run (m, inputs, n_inputs, outputs, n_outputs, err);
    if (rc)
        return rc;
    if (m->pipe)
        return kiln_model_run_pipelined (m, &inputs, &outputs, 1, err);

    pthread_mutex_lock (&m->lock);
    for (int i = 0; i < n_inputs; i++) {
        int t = p->inputs[i];
        memcpy (m->data[t], inputs[i].data, (size_t) p->tensors[t].size);
    }
    if ((rc = kiln_exec_run (m->exec, m->data, err))) {
        pthread_mutex_unlock (&m->lock);
        return rc;
    }
    for (int i = 0; i < n_outputs; i++) {
        int t = p->outputs[i];
        outputs[i].dtype = man->outputs[i].dtype;
        outputs[i].shape = man->outputs[i].shape;
        memcpy (outputs[i].data, m->data[t], (size_t) p->tensors[t].size);
    }
    pthread_mutex_unlock (&m->lock);
    return 0;
}

kiln_pipeline_t *
kiln_model_pipeline (const kiln_model_t *m)
{
    return m ? m->pipe : NULL;
}

int
kiln_model_stage_count (const kiln_model_t *m)
{
    if (!m)
        return 0;
    return m->pipe ? kiln_pipeline_stages (m->pipe) : 1;
}

int
kiln_model_stage_core (const kiln_model_t *m, int stage)
{
    if (!m)
        return -1;
    if (!m->pipe)
        return stage == 0 ? m->core : -1;
    return kiln_pipeline_core (m->pipe, stage);
}
