#include "common/kiln_program.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "common/kiln_mpk.h"

/* --- kernels and kinds ---------------------------------------------- */

typedef struct {
    const char *name;
    int min_in, max_in, n_out;
} s_kernel_info_t;

static const s_kernel_info_t s_kernels[KILN_K_COUNT] = {
#define X(id, name, min_in, max_in, n_out) \
    [KILN_K_##id] = { name, min_in, max_in, n_out },
    KILN_KERNELS (X)
#undef X
};

const char *
kiln_kernel_name (kiln_kernel_t k)
{
    if ((int) k < 0 || k >= KILN_K_COUNT)
        return "unknown";
    return s_kernels[k].name;
}

int
kiln_kernel_from_name (const char *name, size_t len)
{
    for (int k = 0; k < KILN_K_COUNT; k++)
        if (strlen (s_kernels[k].name) == len
            && memcmp (s_kernels[k].name, name, len) == 0)
            return k;
    return -1;
}

void
kiln_kernel_arity (kiln_kernel_t k, int *min_in, int *max_in, int *n_out)
{
    *min_in = *max_in = *n_out = 0;
    if ((int) k < 0 || k >= KILN_K_COUNT)
        return;
    *min_in = s_kernels[k].min_in;
    *max_in = s_kernels[k].max_in;
    *n_out = s_kernels[k].n_out;
}

const char *
kiln_tensor_kind_name (kiln_tensor_kind_t kind)
{
    switch (kind) {
#define X(id, num, name) case KILN_TK_##id: return name;
        KILN_TENSOR_KINDS (X)
#undef X
    }
    return "unknown";
}

static int
s_kind_from_obj (const msgpack_object *o)
{
#define X(id, num, name) if (kiln_mpk_str_eq (o, name)) return KILN_TK_##id;
    KILN_TENSOR_KINDS (X)
#undef X
    return -1;
}

/* --- arithmetic ----------------------------------------------------- */

bool
kiln_prog_mul_u64 (uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_mul_overflow (a, b, out);
}

bool
kiln_prog_align_up (uint64_t n, uint64_t *out)
{
    if (n > UINT64_MAX - (KILN_PROG_ALIGN - 1))
        return false;
    *out = (n + KILN_PROG_ALIGN - 1) / KILN_PROG_ALIGN * KILN_PROG_ALIGN;
    return true;
}

/* --- building ------------------------------------------------------- */

kiln_program_t *
kiln_program_new (void)
{
    return calloc (1, sizeof (kiln_program_t));
}

void
kiln_program_destroy (kiln_program_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_program_t *p = *self_p;
    for (int i = 0; i < p->n_ops; i++)
        free (p->ops[i].params);
    free (p->ops);
    free (p->tensors);
    free (p->inputs);
    free (p->outputs);
    for (int i = 0; i < p->n_stages; i++)
        free (p->stages[i].handoff);
    free (p->stages);
    free (p);
    *self_p = NULL;
}

/* Make room for one more element in a growable array. */
static int
s_grow (void **arr, int *cap, int n, size_t elem, int max, const char *what,
        kiln_err_t *err)
{
    if (n < *cap)
        return 0;
    if (n >= max)
        return kiln_error (err, KILN_ELIMIT, "program has more than %d %s",
                           max, what);
    int ncap = *cap ? *cap * 2 : 16;
    if (ncap > max)
        ncap = max;
    void *p = realloc (*arr, (size_t) ncap * elem);
    if (!p)
        return kiln_error (err, KILN_ENOMEM, "out of memory growing %s", what);
    *arr = p;
    *cap = ncap;
    return 0;
}

int
kiln_program_add_tensor (kiln_program_t *p, kiln_dtype_t dtype,
                         const kiln_shape_t *shape, kiln_tensor_kind_t kind,
                         kiln_err_t *err)
{
    uint64_t bytes;
    char what[32];
    snprintf (what, sizeof what, "program tensor %d", p->n_tensors);
    int rc = kiln_shape_bytes (shape, dtype, what, &bytes, err);
    if (rc)
        return rc;
    rc = s_grow ((void **) &p->tensors, &p->cap_tensors, p->n_tensors,
                 sizeof *p->tensors, KILN_PROG_MAX_TENSORS, "tensors", err);
    if (rc)
        return rc;
    kiln_prog_tensor_t *t = &p->tensors[p->n_tensors];
    memset (t, 0, sizeof *t);
    t->dtype = dtype;
    t->shape = *shape;
    t->kind = kind;
    t->size = bytes;
    t->io = -1;
    return p->n_tensors++;
}

int
kiln_program_add_op (kiln_program_t *p, kiln_kernel_t kernel,
                     const int *inputs, int n_inputs, const int *outputs,
                     int n_outputs, kiln_err_t *err)
{
    if (n_inputs < 0 || n_inputs > KILN_PROG_MAX_OP_IO || n_outputs < 0
        || n_outputs > KILN_PROG_MAX_OP_IO)
        return kiln_error (err, KILN_ELIMIT, "op with %d inputs and %d outputs",
                           n_inputs, n_outputs);
    int rc = s_grow ((void **) &p->ops, &p->cap_ops, p->n_ops, sizeof *p->ops,
                     KILN_PROG_MAX_OPS, "ops", err);
    if (rc)
        return rc;
    kiln_prog_op_t *op = &p->ops[p->n_ops];
    memset (op, 0, sizeof *op);
    op->kernel = kernel;
    if (n_inputs)
        memcpy (op->inputs, inputs, (size_t) n_inputs * sizeof *inputs);
    op->n_inputs = n_inputs;
    if (n_outputs)
        memcpy (op->outputs, outputs, (size_t) n_outputs * sizeof *outputs);
    op->n_outputs = n_outputs;
    op->scratch = -1;
    return p->n_ops++;
}

int
kiln_program_add_io (kiln_program_t *p, bool output, int tensor,
                     kiln_err_t *err)
{
    int **arr = output ? &p->outputs : &p->inputs;
    int *n = output ? &p->n_outputs : &p->n_inputs;
    int *cap = output ? &p->cap_outputs : &p->cap_inputs;
    int rc = s_grow ((void **) arr, cap, *n, sizeof (int), KILN_MAX_GRAPH_IO,
                     output ? "outputs" : "inputs", err);
    if (rc)
        return rc;
    (*arr)[*n] = tensor;
    return (*n)++;
}

static kiln_prog_param_t *
s_param_slot (kiln_prog_op_t *op, const char *name, kiln_err_t *err)
{
    if (strlen (name) == 0 || strlen (name) > KILN_PROG_MAX_PARAM_NAME) {
        kiln_error (err, KILN_EINVAL, "bad parameter name '%s'", name);
        return NULL;
    }
    for (int i = 0; i < op->n_params; i++)
        if (strcmp (op->params[i].name, name) == 0)
            return &op->params[i];
    if (op->n_params >= KILN_PROG_MAX_PARAMS) {
        kiln_error (err, KILN_ELIMIT, "%s op: more than %d parameters",
                    kiln_kernel_name (op->kernel), KILN_PROG_MAX_PARAMS);
        return NULL;
    }
    kiln_prog_param_t *np = realloc (op->params,
                                     (size_t) (op->n_params + 1) * sizeof *np);
    if (!np) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    op->params = np;
    kiln_prog_param_t *pp = &op->params[op->n_params++];
    memset (pp, 0, sizeof *pp);
    memcpy (pp->name, name, strlen (name) + 1);   /* length checked above */
    return pp;
}

int
kiln_prog_op_set_int (kiln_prog_op_t *op, const char *name, int64_t v,
                      kiln_err_t *err)
{
    kiln_prog_param_t *pp = s_param_slot (op, name, err);
    if (!pp)
        return -err->code;
    pp->kind = KILN_PP_INT;
    pp->i = v;
    return 0;
}

int
kiln_prog_op_set_float (kiln_prog_op_t *op, const char *name, double v,
                        kiln_err_t *err)
{
    kiln_prog_param_t *pp = s_param_slot (op, name, err);
    if (!pp)
        return -err->code;
    pp->kind = KILN_PP_FLOAT;
    pp->f = v;
    return 0;
}

int
kiln_prog_op_set_ints (kiln_prog_op_t *op, const char *name, const int64_t *v,
                       int n, kiln_err_t *err)
{
    if (n < 0 || n > KILN_PROG_MAX_PARAM_INTS)
        return kiln_error (err, KILN_ELIMIT, "parameter '%s' has %d integers, "
                           "more than %d", name, n, KILN_PROG_MAX_PARAM_INTS);
    kiln_prog_param_t *pp = s_param_slot (op, name, err);
    if (!pp)
        return -err->code;
    pp->kind = KILN_PP_INTS;
    memcpy (pp->ints, v, (size_t) n * sizeof *v);
    pp->n = n;
    return 0;
}

/* --- reading parameters --------------------------------------------- */

static kiln_prog_param_t *
s_find (kiln_prog_op_t *op, const char *name)
{
    for (int i = 0; i < op->n_params; i++)
        if (strcmp (op->params[i].name, name) == 0) {
            op->params_used |= 1u << i;
            return &op->params[i];
        }
    return NULL;
}

static kiln_prog_param_t *
s_need (kiln_prog_op_t *op, const char *name, kiln_pparam_kind_t kind,
        kiln_err_t *err)
{
    static const char *kinds[] = { "?", "an integer", "a float", "an integer list" };
    kiln_prog_param_t *pp = s_find (op, name);
    if (!pp)
        kiln_error (err, KILN_EFORMAT, "missing parameter '%s'", name);
    else if (pp->kind != kind) {
        kiln_error (err, KILN_EFORMAT, "parameter '%s' is not %s", name,
                    kinds[kind]);
        pp = NULL;
    }
    return pp;
}

int
kiln_prog_op_int (kiln_prog_op_t *op, const char *name, int64_t *out,
                  kiln_err_t *err)
{
    kiln_prog_param_t *pp = s_need (op, name, KILN_PP_INT, err);
    if (!pp)
        return -KILN_EFORMAT;
    *out = pp->i;
    return 0;
}

int
kiln_prog_op_float (kiln_prog_op_t *op, const char *name, double *out,
                    kiln_err_t *err)
{
    kiln_prog_param_t *pp = s_need (op, name, KILN_PP_FLOAT, err);
    if (!pp)
        return -KILN_EFORMAT;
    *out = pp->f;
    return 0;
}

int
kiln_prog_op_ints_any (kiln_prog_op_t *op, const char *name,
                       int64_t out[KILN_PROG_MAX_PARAM_INTS], int *n,
                       kiln_err_t *err)
{
    kiln_prog_param_t *pp = s_need (op, name, KILN_PP_INTS, err);
    if (!pp)
        return -KILN_EFORMAT;
    memcpy (out, pp->ints, (size_t) pp->n * sizeof *out);
    *n = pp->n;
    return 0;
}

int
kiln_prog_op_ints (kiln_prog_op_t *op, const char *name, int n, int64_t *out,
                   kiln_err_t *err)
{
    int64_t tmp[KILN_PROG_MAX_PARAM_INTS];
    int got;
    int rc = kiln_prog_op_ints_any (op, name, tmp, &got, err);
    if (rc)
        return rc;
    if (got != n)
        return kiln_error (err, KILN_EFORMAT, "parameter '%s' has %d integers, "
                           "expected %d", name, got, n);
    memcpy (out, tmp, (size_t) n * sizeof *out);
    return 0;
}

bool
kiln_prog_op_has (kiln_prog_op_t *op, const char *name)
{
    return s_find (op, name) != NULL;
}

int
kiln_prog_op_all_used (const kiln_prog_op_t *op, kiln_err_t *err)
{
    for (int i = 0; i < op->n_params; i++)
        if (!(op->params_used & (1u << i)))
            return kiln_error (err, KILN_EUNSUPPORTED, "unknown parameter '%s'",
                               op->params[i].name);
    return 0;
}

/* --- checking ------------------------------------------------------- */

static int
s_check_tensor (const kiln_program_t *p, int i, uint64_t weights_len,
                uint64_t *arena_end, kiln_err_t *err)
{
    const kiln_prog_tensor_t *t = &p->tensors[i];
    char what[32];
    snprintf (what, sizeof what, "program tensor %d", i);
    if (!kiln_dtype_valid (t->dtype))
        return kiln_error (err, KILN_EFORMAT, "%s: unknown dtype %d", what,
                           (int) t->dtype);
    uint64_t bytes;
    int rc = kiln_shape_bytes (&t->shape, t->dtype, what, &bytes, err);
    if (rc)
        return rc;
    if (bytes != t->size)
        return kiln_error (err, KILN_EFORMAT, "%s: size %llu does not match "
                           "its dtype and shape (%llu bytes)", what,
                           (unsigned long long) t->size,
                           (unsigned long long) bytes);
    if (t->offset % KILN_PROG_ALIGN != 0)
        return kiln_error (err, KILN_EFORMAT, "%s: offset %llu is not a "
                           "multiple of %d", what,
                           (unsigned long long) t->offset, KILN_PROG_ALIGN);
    bool weight = t->kind == KILN_TK_WEIGHT;
    uint64_t limit = weight ? weights_len : p->arena_size;
    if (t->offset > limit || t->size > limit - t->offset)
        return kiln_error (err, KILN_EFORMAT, "%s: bytes %llu..%llu lie outside "
                           "%s (%llu bytes)", what,
                           (unsigned long long) t->offset,
                           (unsigned long long) t->offset + t->size,
                           weight ? "weights.bin" : "the arena",
                           (unsigned long long) limit);
    if (!weight && t->offset + t->size > *arena_end)
        *arena_end = t->offset + t->size;
    switch (t->kind) {
    case KILN_TK_INPUT:
        if (t->io < 0 || t->io >= p->n_inputs || p->inputs[t->io] != i)
            return kiln_error (err, KILN_EFORMAT, "%s: input position %d does "
                               "not list it", what, t->io);
        break;
    case KILN_TK_OUTPUT:
        if (t->io < 0 || t->io >= p->n_outputs || p->outputs[t->io] != i)
            return kiln_error (err, KILN_EFORMAT, "%s: output position %d does "
                               "not list it", what, t->io);
        break;
    case KILN_TK_WEIGHT:
    case KILN_TK_TEMP:
        if (t->io != -1)
            return kiln_error (err, KILN_EFORMAT, "%s: a %s tensor has an io "
                               "position", what, kiln_tensor_kind_name (t->kind));
        break;
    default:
        return kiln_error (err, KILN_EFORMAT, "%s: unknown kind %d", what,
                           (int) t->kind);
    }
    return 0;
}

static int
s_check_op (const kiln_program_t *p, int i, kiln_err_t *err)
{
    const kiln_prog_op_t *op = &p->ops[i];
    if ((int) op->kernel < 0 || op->kernel >= KILN_K_COUNT)
        return kiln_error (err, KILN_EFORMAT, "op %d: unknown kernel %d", i,
                           (int) op->kernel);
    const char *kn = kiln_kernel_name (op->kernel);
    int min_in, max_in, n_out;
    kiln_kernel_arity (op->kernel, &min_in, &max_in, &n_out);
    if (op->n_inputs < min_in || op->n_inputs > max_in)
        return kiln_error (err, KILN_EFORMAT, "op %d (%s): %d inputs, expected "
                           "%d..%d", i, kn, op->n_inputs, min_in, max_in);
    if (op->n_outputs != n_out)
        return kiln_error (err, KILN_EFORMAT, "op %d (%s): %d outputs, expected "
                           "%d", i, kn, op->n_outputs, n_out);
    for (int j = 0; j < op->n_inputs; j++)
        if (op->inputs[j] < 0 || op->inputs[j] >= p->n_tensors)
            return kiln_error (err, KILN_EFORMAT, "op %d (%s): input %d names "
                               "tensor %d, not in 0..%d", i, kn, j,
                               op->inputs[j], p->n_tensors - 1);
    for (int j = 0; j < op->n_outputs; j++) {
        int t = op->outputs[j];
        if (t < 0 || t >= p->n_tensors)
            return kiln_error (err, KILN_EFORMAT, "op %d (%s): output %d names "
                               "tensor %d, not in 0..%d", i, kn, j, t,
                               p->n_tensors - 1);
        kiln_tensor_kind_t k = p->tensors[t].kind;
        if (k == KILN_TK_WEIGHT || k == KILN_TK_INPUT)
            return kiln_error (err, KILN_EFORMAT, "op %d (%s): writes %s tensor "
                               "%d", i, kn, kiln_tensor_kind_name (k), t);
    }
    if (op->scratch != -1) {
        if (op->scratch < 0 || op->scratch >= p->n_tensors)
            return kiln_error (err, KILN_EFORMAT, "op %d (%s): scratch names "
                               "tensor %d, not in 0..%d", i, kn, op->scratch,
                               p->n_tensors - 1);
        const kiln_prog_tensor_t *s = &p->tensors[op->scratch];
        if (s->kind != KILN_TK_TEMP || s->dtype != KILN_DT_FLOAT32)
            return kiln_error (err, KILN_EFORMAT, "op %d (%s): scratch tensor "
                               "%d is not a float32 temp", i, kn, op->scratch);
    }
    if (op->n_params < 0 || op->n_params > KILN_PROG_MAX_PARAMS)
        return kiln_error (err, KILN_EFORMAT, "op %d (%s): %d parameters", i, kn,
                           op->n_params);
    for (int j = 0; j < op->n_params; j++) {
        const kiln_prog_param_t *pp = &op->params[j];
        size_t nl = strnlen (pp->name, sizeof pp->name);
        if (nl == 0 || nl > KILN_PROG_MAX_PARAM_NAME)
            return kiln_error (err, KILN_EFORMAT, "op %d (%s): bad parameter "
                               "name", i, kn);
        if (pp->kind == KILN_PP_INTS
            && (pp->n < 0 || pp->n > KILN_PROG_MAX_PARAM_INTS))
            return kiln_error (err, KILN_EFORMAT, "op %d (%s): parameter '%s' "
                               "has %d integers", i, kn, pp->name, pp->n);
        if (pp->kind < KILN_PP_INT || pp->kind > KILN_PP_INTS)
            return kiln_error (err, KILN_EFORMAT, "op %d (%s): parameter '%s' "
                               "has an unknown kind", i, kn, pp->name);
        for (int k = 0; k < j; k++)
            if (strcmp (op->params[k].name, pp->name) == 0)
                return kiln_error (err, KILN_EFORMAT, "op %d (%s): parameter "
                                   "'%s' appears twice", i, kn, pp->name);
    }
    return 0;
}

static int
s_check_stages (const kiln_program_t *p, kiln_err_t *err)
{
    if (p->n_stages == 0)
        return 0;
    if (p->n_stages < 2 || p->n_stages > KILN_PROG_MAX_STAGES || !p->stages)
        return kiln_error (err, KILN_EFORMAT, "%d pipeline stages (a pipelined "
                           "program has 2..%d)", p->n_stages, KILN_PROG_MAX_STAGES);
    for (int s = 0; s < p->n_stages; s++) {
        const kiln_prog_stage_t *st = &p->stages[s];
        int lo = s == 0 ? 0 : p->stages[s - 1].first_op + 1;
        if ((s == 0 && st->first_op != 0) || st->first_op < lo
            || st->first_op >= p->n_ops)
            return kiln_error (err, KILN_EFORMAT, "stage %d: first op %d (expected "
                               "%d..%d, after the stage before)", s, st->first_op,
                               lo, p->n_ops - 1);
        if (st->n_handoff < 0 || st->n_handoff > KILN_PROG_MAX_HANDOFF
            || (st->n_handoff > 0 && !st->handoff))
            return kiln_error (err, KILN_ELIMIT, "stage %d: %d handoff ranges "
                               "(at most %d)", s, st->n_handoff,
                               KILN_PROG_MAX_HANDOFF);
        if (s == 0 && st->n_handoff != 0)
            return kiln_error (err, KILN_EFORMAT, "stage 0 has a handoff: the "
                               "first stage starts from the inputs");
        uint64_t end = 0;
        for (int r = 0; r < st->n_handoff; r++) {
            const kiln_prog_range_t *rg = &st->handoff[r];
            if (rg->offset % KILN_PROG_ALIGN != 0 || rg->size == 0
                || rg->offset < end || rg->offset > p->arena_size
                || rg->size > p->arena_size - rg->offset)
                return kiln_error (err, KILN_EFORMAT, "stage %d: handoff range %d "
                                   "(bytes %llu..%llu) is unaligned, empty, out of "
                                   "order or outside the arena (%llu bytes)", s, r,
                                   (unsigned long long) rg->offset,
                                   (unsigned long long) (rg->offset + rg->size),
                                   (unsigned long long) p->arena_size);
            end = rg->offset + rg->size;
        }
    }
    return 0;
}

int
kiln_program_check (const kiln_program_t *p, uint64_t weights_len,
                    kiln_err_t *err)
{
    if (p->n_tensors < 0 || p->n_tensors > KILN_PROG_MAX_TENSORS
        || p->n_ops < 0 || p->n_ops > KILN_PROG_MAX_OPS
        || p->n_inputs < 0 || p->n_inputs > KILN_MAX_GRAPH_IO
        || p->n_outputs < 0 || p->n_outputs > KILN_MAX_GRAPH_IO)
        return kiln_error (err, KILN_ELIMIT, "program counts out of bounds");
    if (p->arena_size % KILN_PROG_ALIGN != 0
        || p->arena_size > KILN_PROG_MAX_ARENA_BYTES)
        return kiln_error (err, KILN_EFORMAT, "arena size %llu is not a multiple "
                           "of %d up to %llu", (unsigned long long) p->arena_size,
                           KILN_PROG_ALIGN,
                           (unsigned long long) KILN_PROG_MAX_ARENA_BYTES);
    for (int i = 0; i < p->n_inputs; i++) {
        int t = p->inputs[i];
        if (t < 0 || t >= p->n_tensors || p->tensors[t].kind != KILN_TK_INPUT
            || p->tensors[t].io != i)
            return kiln_error (err, KILN_EFORMAT, "program input %d: tensor %d "
                               "is not an input tensor at that position", i, t);
    }
    for (int i = 0; i < p->n_outputs; i++) {
        int t = p->outputs[i];
        if (t < 0 || t >= p->n_tensors)
            return kiln_error (err, KILN_EFORMAT, "program output %d: tensor %d "
                               "not in 0..%d", i, t, p->n_tensors - 1);
    }
    uint64_t arena_end = 0;
    for (int i = 0; i < p->n_tensors; i++) {
        int rc = s_check_tensor (p, i, weights_len, &arena_end, err);
        if (rc)
            return rc;
    }
    uint64_t need;
    if (!kiln_prog_align_up (arena_end, &need) || p->arena_size > need)
        return kiln_error (err, KILN_EFORMAT, "arena size %llu is larger than "
                           "its tensors need (%llu bytes)",
                           (unsigned long long) p->arena_size,
                           (unsigned long long) need);
    for (int i = 0; i < p->n_ops; i++) {
        int rc = s_check_op (p, i, err);
        if (rc)
            return rc;
    }
    return s_check_stages (p, err);
}

/* --- encoding ------------------------------------------------------- */

static int
s_param_cmp (const void *a, const void *b)
{
    return strcmp (((const kiln_prog_param_t *) a)->name,
                   ((const kiln_prog_param_t *) b)->name);
}

static void
s_pack_int_array (msgpack_packer *pk, const char *key, const int *v, int n)
{
    kiln_mpk_pack_cstr (pk, key);
    msgpack_pack_array (pk, (size_t) n);
    for (int i = 0; i < n; i++)
        msgpack_pack_int64 (pk, v[i]);
}

static void
s_pack_tensor (msgpack_packer *pk, const kiln_prog_tensor_t *t)
{
    bool io = t->kind == KILN_TK_INPUT || t->kind == KILN_TK_OUTPUT;
    msgpack_pack_map (pk, io ? 6 : 5);
    kiln_mpk_pack_kv_str (pk, "dtype", kiln_dtype_name (t->dtype));
    kiln_mpk_pack_cstr (pk, "shape");
    msgpack_pack_array (pk, (size_t) t->shape.rank);
    for (int d = 0; d < t->shape.rank; d++)
        msgpack_pack_int64 (pk, t->shape.dims[d]);
    kiln_mpk_pack_kv_str (pk, "kind", kiln_tensor_kind_name (t->kind));
    kiln_mpk_pack_cstr (pk, "offset");
    msgpack_pack_uint64 (pk, t->offset);
    kiln_mpk_pack_cstr (pk, "size");
    msgpack_pack_uint64 (pk, t->size);
    if (io)
        kiln_mpk_pack_kv_i64 (pk, "io", t->io);
}

static void
s_pack_op (msgpack_packer *pk, kiln_prog_op_t *op)
{
    if (op->n_params > 1)
        qsort (op->params, (size_t) op->n_params, sizeof *op->params, s_param_cmp);
    msgpack_pack_map (pk, op->scratch >= 0 ? 5 : 4);
    kiln_mpk_pack_kv_str (pk, "kernel", kiln_kernel_name (op->kernel));
    s_pack_int_array (pk, "inputs", op->inputs, op->n_inputs);
    s_pack_int_array (pk, "outputs", op->outputs, op->n_outputs);
    if (op->scratch >= 0)
        kiln_mpk_pack_kv_i64 (pk, "scratch", op->scratch);
    kiln_mpk_pack_cstr (pk, "params");
    msgpack_pack_map (pk, (size_t) op->n_params);
    for (int i = 0; i < op->n_params; i++) {
        const kiln_prog_param_t *pp = &op->params[i];
        kiln_mpk_pack_cstr (pk, pp->name);
        switch (pp->kind) {
        case KILN_PP_INT:
            msgpack_pack_int64 (pk, pp->i);
            break;
        case KILN_PP_FLOAT:
            msgpack_pack_double (pk, pp->f);
            break;
        case KILN_PP_INTS:
            msgpack_pack_array (pk, (size_t) pp->n);
            for (int k = 0; k < pp->n; k++)
                msgpack_pack_int64 (pk, pp->ints[k]);
            break;
        }
    }
}

int
kiln_program_encode (kiln_program_t *p, uint8_t **out, size_t *len,
                     kiln_err_t *err)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init (&sb);
    msgpack_packer pk;
    msgpack_packer_init (&pk, &sb, msgpack_sbuffer_write);

    /* "stages" only when pipelined: an unpipelined program keeps the
     * bytes it always had. */
    msgpack_pack_map (&pk, p->n_stages > 0 ? 8 : 7);
    kiln_mpk_pack_kv_str (&pk, "format", KILN_PROGRAM_FORMAT);
    kiln_mpk_pack_kv_i64 (&pk, "version", KILN_PROGRAM_VERSION);
    kiln_mpk_pack_cstr (&pk, "tensors");
    msgpack_pack_array (&pk, (size_t) p->n_tensors);
    for (int i = 0; i < p->n_tensors; i++)
        s_pack_tensor (&pk, &p->tensors[i]);
    kiln_mpk_pack_cstr (&pk, "ops");
    msgpack_pack_array (&pk, (size_t) p->n_ops);
    for (int i = 0; i < p->n_ops; i++)
        s_pack_op (&pk, &p->ops[i]);
    kiln_mpk_pack_cstr (&pk, "arena_size");
    msgpack_pack_uint64 (&pk, p->arena_size);
    s_pack_int_array (&pk, "inputs", p->inputs, p->n_inputs);
    s_pack_int_array (&pk, "outputs", p->outputs, p->n_outputs);
    if (p->n_stages > 0) {
        kiln_mpk_pack_cstr (&pk, "stages");
        msgpack_pack_array (&pk, (size_t) p->n_stages);
        for (int i = 0; i < p->n_stages; i++) {
            const kiln_prog_stage_t *st = &p->stages[i];
            msgpack_pack_map (&pk, 2);
            kiln_mpk_pack_kv_i64 (&pk, "first_op", st->first_op);
            kiln_mpk_pack_cstr (&pk, "handoff");
            msgpack_pack_array (&pk, (size_t) st->n_handoff);
            for (int r = 0; r < st->n_handoff; r++) {
                msgpack_pack_array (&pk, 2);
                msgpack_pack_uint64 (&pk, st->handoff[r].offset);
                msgpack_pack_uint64 (&pk, st->handoff[r].size);
            }
        }
    }

    if (!sb.data) {
        msgpack_sbuffer_destroy (&sb);
        return kiln_error (err, KILN_ENOMEM, "out of memory encoding program");
    }
    *len = sb.size;     /* before release, which resets it */
    *out = (uint8_t *) msgpack_sbuffer_release (&sb);
    msgpack_sbuffer_destroy (&sb);
    return 0;
}

/* --- decoding ------------------------------------------------------- */

/* Every key of `map` must be one of `allowed` (NULL-terminated, at most
 * 32), once: a field this decoder does not know would otherwise be
 * ignored, and an older runtime must refuse what it cannot honour. */
static int
s_known_keys (const msgpack_object *map, const char *const *allowed,
              const char *what, kiln_err_t *err)
{
    uint32_t seen = 0;
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        int found = -1;
        for (int j = 0; allowed[j] && found < 0; j++)
            if (kiln_mpk_str_eq (k, allowed[j]))
                found = j;
        if (found < 0) {
            if (k->type == MSGPACK_OBJECT_STR)
                return kiln_error (err, KILN_EFORMAT, "%s: unknown field '%.*s'",
                                   what, (int) (k->via.str.size > 64 ? 64
                                                : k->via.str.size),
                                   k->via.str.ptr);
            return kiln_error (err, KILN_EFORMAT, "%s: a key is not a string",
                               what);
        }
        if (seen & (1u << found))
            return kiln_error (err, KILN_EFORMAT, "%s: field '%s' appears twice",
                               what, allowed[found]);
        seen |= 1u << found;
    }
    return 0;
}

static const char *const s_root_keys[] = { "format", "version", "tensors", "ops",
                                           "arena_size", "inputs", "outputs",
                                           "stages", NULL };
static const char *const s_stage_keys[] = { "first_op", "handoff", NULL };
static const char *const s_tensor_keys[] = { "dtype", "shape", "kind", "offset",
                                             "size", "io", NULL };
static const char *const s_op_keys[] = { "kernel", "inputs", "outputs", "scratch",
                                         "params", NULL };

/* An array of tensor indices (bounded) into out[max]. */
static int
s_get_index_array (const msgpack_object *map, const char *key, int max,
                   int *out, int *n, const char *what, kiln_err_t *err)
{
    const msgpack_object_array *arr;
    int rc = kiln_mpk_get_array (map, key, (size_t) max, &arr, err);
    if (rc)
        return kiln_error_prefix (err, "%s", what);
    for (uint32_t i = 0; i < arr->size; i++) {
        int64_t v;
        if (kiln_mpk_as_i64 (&arr->ptr[i], &v) != 0 || v < -1 || v > INT32_MAX)
            return kiln_error (err, KILN_EFORMAT, "%s: '%s'[%u] is not a tensor "
                               "index", what, key, i);
        out[i] = (int) v;
    }
    *n = (int) arr->size;
    return 0;
}

static int
s_decode_tensor (const msgpack_object *o, kiln_prog_tensor_t *t, int i,
                 kiln_err_t *err)
{
    char what[32];
    snprintf (what, sizeof what, "program tensor %d", i);
    if (o->type != MSGPACK_OBJECT_MAP)
        return kiln_error (err, KILN_EFORMAT, "%s is not a map", what);
    int rc = s_known_keys (o, s_tensor_keys, what, err);
    if (rc)
        return rc;
    char dt[16];
    if (kiln_mpk_get_strbuf (o, "dtype", dt, sizeof dt, err))
        return kiln_error_prefix (err, "%s", what);
    t->dtype = kiln_dtype_from_name (dt);
    if (t->dtype == KILN_DT_UNDEFINED)
        return kiln_error (err, KILN_EFORMAT, "%s: unknown dtype '%s'", what, dt);
    const msgpack_object_array *shape;
    if (kiln_mpk_get_array (o, "shape", KILN_MAX_RANK, &shape, err))
        return kiln_error_prefix (err, "%s", what);
    t->shape.rank = (int) shape->size;
    for (uint32_t d = 0; d < shape->size; d++) {
        int64_t v;
        if (kiln_mpk_as_i64 (&shape->ptr[d], &v) != 0 || v < 0
            || v > KILN_MAX_DIM)
            return kiln_error (err, KILN_EFORMAT, "%s: dimension %u is not in "
                               "0..%lld", what, d, (long long) KILN_MAX_DIM);
        t->shape.dims[d] = v;
    }
    const msgpack_object *kind = kiln_mpk_get (o, "kind");
    int k = kind ? s_kind_from_obj (kind) : -1;
    if (k < 0)
        return kiln_error (err, KILN_EFORMAT, "%s: missing or unknown kind", what);
    t->kind = (kiln_tensor_kind_t) k;
    int64_t off, size, io;
    if (kiln_mpk_get_i64 (o, "offset", &off, err)
        || kiln_mpk_get_i64 (o, "size", &size, err)
        || kiln_mpk_opt_i64 (o, "io", -1, &io, err))
        return kiln_error_prefix (err, "%s", what);
    if (off < 0 || size < 0 || io < -1 || io >= KILN_MAX_GRAPH_IO)
        return kiln_error (err, KILN_EFORMAT, "%s: negative or out-of-range "
                           "offset, size or io", what);
    t->offset = (uint64_t) off;
    t->size = (uint64_t) size;
    t->io = (int) io;
    return 0;
}

static int
s_decode_param (const msgpack_object_kv *kv, kiln_prog_param_t *pp,
                const char *what, kiln_err_t *err)
{
    if (kv->key.type != MSGPACK_OBJECT_STR || kv->key.via.str.size == 0
        || kv->key.via.str.size > KILN_PROG_MAX_PARAM_NAME
        || memchr (kv->key.via.str.ptr, '\0', kv->key.via.str.size))
        return kiln_error (err, KILN_EFORMAT, "%s: bad parameter name", what);
    memcpy (pp->name, kv->key.via.str.ptr, kv->key.via.str.size);
    pp->name[kv->key.via.str.size] = '\0';
    const msgpack_object *v = &kv->val;
    switch (v->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        if (kiln_mpk_as_i64 (v, &pp->i) != 0)
            return kiln_error (err, KILN_EFORMAT, "%s: parameter '%s' is out of "
                               "range", what, pp->name);
        pp->kind = KILN_PP_INT;
        return 0;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        pp->kind = KILN_PP_FLOAT;
        pp->f = v->via.f64;
        return 0;
    case MSGPACK_OBJECT_ARRAY:
        if (v->via.array.size > KILN_PROG_MAX_PARAM_INTS)
            return kiln_error (err, KILN_ELIMIT, "%s: parameter '%s' has more "
                               "than %d integers", what, pp->name,
                               KILN_PROG_MAX_PARAM_INTS);
        for (uint32_t i = 0; i < v->via.array.size; i++)
            if (kiln_mpk_as_i64 (&v->via.array.ptr[i], &pp->ints[i]) != 0)
                return kiln_error (err, KILN_EFORMAT, "%s: parameter '%s'[%u] "
                                   "is not an integer", what, pp->name, i);
        pp->kind = KILN_PP_INTS;
        pp->n = (int) v->via.array.size;
        return 0;
    default:
        return kiln_error (err, KILN_EFORMAT, "%s: parameter '%s' is neither an "
                           "integer, a float nor an integer list", what, pp->name);
    }
}

static int
s_decode_op (const msgpack_object *o, kiln_prog_op_t *op, int i,
             kiln_err_t *err)
{
    char what[32];
    snprintf (what, sizeof what, "op %d", i);
    op->scratch = -1;
    if (o->type != MSGPACK_OBJECT_MAP)
        return kiln_error (err, KILN_EFORMAT, "%s is not a map", what);
    int rc = s_known_keys (o, s_op_keys, what, err);
    if (rc)
        return rc;
    const char *kn;
    size_t kl;
    if (kiln_mpk_get_str (o, "kernel", KILN_MAX_OP_NAME, &kn, &kl, err))
        return kiln_error_prefix (err, "%s", what);
    int k = kiln_kernel_from_name (kn, kl);
    if (k < 0)
        return kiln_error (err, KILN_EUNSUPPORTED, "%s: unknown kernel '%.*s'",
                           what, (int) kl, kn);
    op->kernel = (kiln_kernel_t) k;
    if (s_get_index_array (o, "inputs", KILN_PROG_MAX_OP_IO, op->inputs,
                           &op->n_inputs, what, err)
        || s_get_index_array (o, "outputs", KILN_PROG_MAX_OP_IO, op->outputs,
                              &op->n_outputs, what, err))
        return -err->code;
    int64_t scratch;
    if (kiln_mpk_opt_i64 (o, "scratch", -1, &scratch, err))
        return kiln_error_prefix (err, "%s", what);
    if (scratch < -1 || scratch > INT32_MAX)
        return kiln_error (err, KILN_EFORMAT, "%s: bad scratch index", what);
    op->scratch = (int) scratch;
    const msgpack_object *params;
    if (kiln_mpk_get_map (o, "params", &params, err))
        return kiln_error_prefix (err, "%s", what);
    if (params->via.map.size > KILN_PROG_MAX_PARAMS)
        return kiln_error (err, KILN_ELIMIT, "%s: more than %d parameters", what,
                           KILN_PROG_MAX_PARAMS);
    if (params->via.map.size) {
        op->params = calloc (params->via.map.size, sizeof *op->params);
        if (!op->params)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
    }
    for (uint32_t j = 0; j < params->via.map.size; j++) {
        rc = s_decode_param (&params->via.map.ptr[j], &op->params[j], what, err);
        if (rc)
            return rc;
        op->n_params++;
    }
    return 0;
}

/* The optional "stages" of a pipelined program; bounds are checked
 * before anything is allocated, the rest by s_check_stages. */
static int
s_decode_stages (const msgpack_object *root, kiln_program_t *p, kiln_err_t *err)
{
    if (!kiln_mpk_get (root, "stages"))
        return 0;
    const msgpack_object_array *stages;
    if (kiln_mpk_get_array (root, "stages", KILN_PROG_MAX_STAGES, &stages, err))
        return -err->code;
    if (stages->size < 2)
        return kiln_error (err, KILN_EFORMAT, "'stages' lists %u (a pipelined "
                           "program has 2..%d)", stages->size, KILN_PROG_MAX_STAGES);
    p->stages = calloc (stages->size, sizeof *p->stages);
    if (!p->stages)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    for (uint32_t i = 0; i < stages->size; i++) {
        const msgpack_object *o = &stages->ptr[i];
        kiln_prog_stage_t *st = &p->stages[i];
        p->n_stages++;
        char what[32];
        snprintf (what, sizeof what, "stage %u", i);
        if (o->type != MSGPACK_OBJECT_MAP)
            return kiln_error (err, KILN_EFORMAT, "%s is not a map", what);
        if (s_known_keys (o, s_stage_keys, what, err))
            return -err->code;
        int64_t first;
        const msgpack_object_array *ranges;
        if (kiln_mpk_get_i64 (o, "first_op", &first, err)
            || kiln_mpk_get_array (o, "handoff", KILN_PROG_MAX_HANDOFF, &ranges, err))
            return kiln_error_prefix (err, "%s", what);
        if (first < 0 || first > KILN_PROG_MAX_OPS)
            return kiln_error (err, KILN_EFORMAT, "%s: first op %lld is out of "
                               "range", what, (long long) first);
        st->first_op = (int) first;
        if (ranges->size) {
            st->handoff = calloc (ranges->size, sizeof *st->handoff);
            if (!st->handoff)
                return kiln_error (err, KILN_ENOMEM, "out of memory");
        }
        for (uint32_t r = 0; r < ranges->size; r++) {
            const msgpack_object *pair = &ranges->ptr[r];
            int64_t off, size;
            if (pair->type != MSGPACK_OBJECT_ARRAY || pair->via.array.size != 2
                || kiln_mpk_as_i64 (&pair->via.array.ptr[0], &off) != 0
                || kiln_mpk_as_i64 (&pair->via.array.ptr[1], &size) != 0
                || off < 0 || size < 0)
                return kiln_error (err, KILN_EFORMAT, "%s: handoff %u is not "
                                   "[offset, size]", what, r);
            st->handoff[r] = (kiln_prog_range_t) { (uint64_t) off, (uint64_t) size };
            st->n_handoff++;
        }
    }
    return 0;
}

static int
s_decode_root (const msgpack_object *root, kiln_program_t *p, kiln_err_t *err)
{
    if (root->type != MSGPACK_OBJECT_MAP)
        return kiln_error (err, KILN_EFORMAT, "program is not a map");
    if (s_known_keys (root, s_root_keys, "program", err))
        return -err->code;
    const char *fmt;
    size_t fl;
    if (kiln_mpk_get_str (root, "format", 64, &fmt, &fl, err))
        return -err->code;
    if (fl != strlen (KILN_PROGRAM_FORMAT) || memcmp (fmt, KILN_PROGRAM_FORMAT, fl))
        return kiln_error (err, KILN_EFORMAT, "format is '%.*s', not '%s'",
                           (int) fl, fmt, KILN_PROGRAM_FORMAT);
    int64_t version;
    if (kiln_mpk_get_i64 (root, "version", &version, err))
        return -err->code;
    if (version != KILN_PROGRAM_VERSION)
        return kiln_error (err, KILN_EUNSUPPORTED, "program version %lld, this "
                           "runtime reads version %d", (long long) version,
                           KILN_PROGRAM_VERSION);
    int64_t arena;
    if (kiln_mpk_get_i64 (root, "arena_size", &arena, err))
        return -err->code;
    if (arena < 0 || (uint64_t) arena > KILN_PROG_MAX_ARENA_BYTES)
        return kiln_error (err, KILN_ELIMIT, "arena size %lld is outside 0..%llu",
                           (long long) arena,
                           (unsigned long long) KILN_PROG_MAX_ARENA_BYTES);
    p->arena_size = (uint64_t) arena;

    const msgpack_object_array *tensors, *ops, *ins, *outs;
    if (kiln_mpk_get_array (root, "tensors", KILN_PROG_MAX_TENSORS, &tensors, err)
        || kiln_mpk_get_array (root, "ops", KILN_PROG_MAX_OPS, &ops, err)
        || kiln_mpk_get_array (root, "inputs", KILN_MAX_GRAPH_IO, &ins, err)
        || kiln_mpk_get_array (root, "outputs", KILN_MAX_GRAPH_IO, &outs, err))
        return -err->code;

    if (tensors->size) {
        p->tensors = calloc (tensors->size, sizeof *p->tensors);
        if (!p->tensors)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        p->cap_tensors = (int) tensors->size;
    }
    for (uint32_t i = 0; i < tensors->size; i++) {
        int rc = s_decode_tensor (&tensors->ptr[i], &p->tensors[i], (int) i, err);
        if (rc)
            return rc;
        p->n_tensors++;
    }
    if (ops->size) {
        p->ops = calloc (ops->size, sizeof *p->ops);
        if (!p->ops)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        p->cap_ops = (int) ops->size;
    }
    for (uint32_t i = 0; i < ops->size; i++) {
        /* Count the op first so that its params are freed on failure. */
        p->n_ops++;
        int rc = s_decode_op (&ops->ptr[i], &p->ops[i], (int) i, err);
        if (rc)
            return rc;
    }
    p->inputs = calloc (ins->size + 1, sizeof (int));
    p->outputs = calloc (outs->size + 1, sizeof (int));
    if (!p->inputs || !p->outputs)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    p->cap_inputs = (int) ins->size + 1;
    p->cap_outputs = (int) outs->size + 1;
    for (uint32_t i = 0; i < ins->size; i++) {
        int64_t v;
        if (kiln_mpk_as_i64 (&ins->ptr[i], &v) != 0 || v < 0 || v > INT32_MAX)
            return kiln_error (err, KILN_EFORMAT, "program input %u is not a "
                               "tensor index", i);
        p->inputs[p->n_inputs++] = (int) v;
    }
    for (uint32_t i = 0; i < outs->size; i++) {
        int64_t v;
        if (kiln_mpk_as_i64 (&outs->ptr[i], &v) != 0 || v < 0 || v > INT32_MAX)
            return kiln_error (err, KILN_EFORMAT, "program output %u is not a "
                               "tensor index", i);
        p->outputs[p->n_outputs++] = (int) v;
    }
    return s_decode_stages (root, p, err);
}

kiln_program_t *
kiln_program_decode (const uint8_t *data, size_t len, uint64_t weights_len,
                     kiln_err_t *err)
{
    kiln_program_t *p = kiln_program_new ();
    if (!p) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    if (kiln_mpk_check (data, len, 32, len, "program", NULL, err)) {
        kiln_program_destroy (&p);
        return NULL;
    }
    msgpack_unpacked up;
    msgpack_unpacked_init (&up);
    size_t off = 0;
    msgpack_unpack_return ur = msgpack_unpack_next (&up, (const char *) data,
                                                    len, &off);
    int rc;
    if (ur != MSGPACK_UNPACK_SUCCESS && ur != MSGPACK_UNPACK_EXTRA_BYTES)
        rc = kiln_error (err, KILN_EFORMAT, "program is not valid msgpack");
    else if (off != len)
        rc = kiln_error (err, KILN_EFORMAT, "program has %zu trailing bytes",
                         len - off);
    else
        rc = s_decode_root (&up.data, p, err);
    msgpack_unpacked_destroy (&up);
    if (rc == 0)
        rc = kiln_program_check (p, weights_len, err);
    if (rc) {
        kiln_program_destroy (&p);
        return NULL;
    }
    return p;
}
