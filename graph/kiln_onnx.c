/*
 * kiln_onnx — ONNX model import.
 *
 * The import runs in passes over the decoded ModelProto, so that each
 * error is found where it is cheapest to explain:
 *   1. the protobuf bytes are checked for nesting depth (and the
 *      kiln.io_structure metadata for its length and NUL bytes), then
 *      decoded under a memory budget;
 *   2. the default-domain opset is checked, and every node's op is looked
 *      up; all unsupported ops are reported together, before any work;
 *   3. initializers, graph inputs and node outputs define the value names
 *      (each name once), Constant nodes becoming weights; a tensor whose
 *      bytes live in an external file is read from it here
 *      (graph/kiln_onnx_external.h);
 *   4. nodes are emitted with their inputs resolved by name and their
 *      attributes copied, then graph outputs are resolved;
 *   5. kiln_graph_validate checks the result and infers shapes.
 */
#include "graph/kiln_onnx.h"

#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <czmq.h>

#include "common/kiln_fs.h"
#include "common/kiln_half.h"
#include "common/kiln_limits.h"
#include "graph/kiln_fold.h"
#include "graph/kiln_onnx_external.h"
#include "onnx.pb-c.h"

/* ONNX raw_data is little-endian, as are kiln's weight blobs (the npy
 * descrs in kiln_dtype.h say "<"), and the importer copies the bytes as
 * they are.  A big-endian port would have to swap them here. */
#if !defined (__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kiln_onnx copies little-endian ONNX tensor bytes without swapping"
#endif

/* protobuf-c decodes nested messages by recursion without a depth limit,
 * so a few kilobytes of crafted input could exhaust the stack.  Real ONNX
 * models nest about 7 deep (model, graph, value info, type, tensor type,
 * shape, dimension), plus 3 per level of subgraph; 64 leaves ample room. */
#define S_MAX_PROTO_DEPTH 64

/* protobuf-c allocates a C struct for every message it decodes, and an
 * empty message costs two bytes on the wire but a hundred or more in
 * memory.  A real model needs at most a few times its file size (weights
 * once, structure up to ~8x for value_info-heavy graphs); decoding may use
 * S_DECODE_FACTOR times the input plus S_DECODE_SLACK before it fails
 * with KILN_ELIMIT instead of exhausting memory. */
#define S_DECODE_FACTOR 16
#define S_DECODE_SLACK  (256ull << 20)

/* The metadata_props key under which kiln.trace stores how the model's
 * inputs and outputs nest; the importer keeps its value as the graph's
 * io_structure and ignores every other key. */
#define S_IO_STRUCTURE_KEY "kiln.io_structure"

/* Longest string attribute (auto_pad, mode, an einsum equation...). */
#define S_MAX_ATTR_STRING KILN_MAX_ATTR_ELEMS

/* Room kept at the end of the unsupported-op list for the file name that
 * kiln_onnx_import puts in front of the message. */
#define S_ERR_PREFIX_ROOM 256

/* Ops the importer handles itself instead of passing them on.  Every
 * other op must be known to kiln_graph_op_supported, so that the list of
 * supported ops lives in one place (graph/kiln_graph.c). */
static const struct {
    const char *op;          /* ONNX op type in the default domain */
    const char *becomes;     /* kiln op emitted, or NULL for none */
} s_import_ops[] = {
    /* Constant nodes become weight tensors: a constant is data, and the
     * graph digest should not depend on whether an exporter wrote a
     * value as an initializer or as a node. */
    { "Constant", NULL },
    /* kiln compiles for inference, where Dropout passes its input
     * through; torch exports it only from modules left in train mode. */
    { "Dropout", "Identity" },
};

typedef struct {
    kiln_graph_t *g;         /* graph being built, owned until returned */
    zhashx_t *names;         /* value name -> tensor index + 1 */
    kiln_onnx_external_t *ext;   /* reads external data; the caller's */
    kiln_statcache_t *cache;     /* digests of external ranges by file identity, or
                                    NULL; the caller's */
    const Onnx__GraphProto *graph;   /* the graph being imported */
    zhashx_t *used;          /* names some node or the graph reads: made when
                                first needed (s_used) */
} importer_t;

typedef struct {
    char op[KILN_MAX_NAME + 1 + KILN_MAX_OP_NAME + 1];   /* "Op" or "domain.Op" */
    size_t count;            /* nodes using it */
    size_t first;            /* index of the first such node, for a stable order */
} op_count_t;

typedef struct {
    uint64_t used;           /* bytes handed to protobuf-c (frees not subtracted) */
    uint64_t budget;         /* most bytes the decode may take */
    bool exhausted;          /* an allocation was refused for the budget */
} decode_budget_t;


static const char *
s_str (const char *s)
{
    return s ? s : "";
}

static bool
s_streq (const char *a, const char *b)
{
    return strcmp (a, b) == 0;
}

/* Name of an ONNX enum value for messages ("GRAPH", "STRING"). */
static const char *
s_enum_name (const ProtobufCEnumDescriptor *desc, int value)
{
    const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value (desc, value);
    return v ? v->name : "unknown";
}

/* "node 'conv1' (Conv)", or "node #3 (Conv)" for an unnamed node: the form
 * kiln_graph_node_label uses, for a node not yet in the graph. */
static const char *
s_node_label (const Onnx__NodeProto *node, size_t i, char *buf, size_t size)
{
    const char *name = s_str (node->name);
    if (*name)
        snprintf (buf, size, "node '%s' (%s)", name, s_str (node->op_type));
    else
        snprintf (buf, size, "node #%zu (%s)", i, s_str (node->op_type));
    return buf;
}

/* Fail when a name from the file does not fit kiln's bound. */
static int
s_check_name (const char *name, const char *what, kiln_err_t *err)
{
    if (strnlen (name, KILN_MAX_NAME + 1) > KILN_MAX_NAME)
        return kiln_error (err, KILN_ELIMIT, "%s name '%.40s...' is longer than %d bytes",
                           what, name, KILN_MAX_NAME);
    return 0;
}

static bool
s_default_domain (const char *domain)
{
    return !domain || !*domain || s_streq (domain, "ai.onnx");
}


/* --- decoding -------------------------------------------------------- */

static int
s_varint (const uint8_t **p, const uint8_t *end, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (*p >= end)
            return -1;
        uint8_t b = *(*p)++;
        v |= (uint64_t) (b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

/* Check the value of a metadata_props entry [p, end) (already walked by
 * s_check_nesting) whose key is S_IO_STRUCTURE_KEY, on the wire: protobuf-c
 * hands strings over NUL-terminated, so a NUL byte inside would cut the
 * text short without a word, and it would allocate the value before kiln
 * could bound it.  A field given twice counts the last time, as protobuf-c
 * reads it.  Anything malformed is left for protobuf-c to refuse. */
static int
s_check_metadata_entry (const uint8_t *p, const uint8_t *end, kiln_err_t *err)
{
    const uint8_t *key = NULL, *value = NULL;
    uint64_t key_len = 0, value_len = 0;
    while (p < end) {
        uint64_t tag, skip;
        if (s_varint (&p, end, &tag))
            return 0;
        switch (tag & 7) {
        case 0:                                /* varint: nothing to skip after it */
            if (s_varint (&p, end, &skip))
                return 0;
            skip = 0;
            break;
        case 1:                                /* fixed64 */
            skip = 8;
            break;
        case 5:                                /* fixed32 */
            skip = 4;
            break;
        case 2:                                /* length-delimited */
            if (s_varint (&p, end, &skip))
                return 0;
            break;
        default:
            return 0;
        }
        if (skip > (uint64_t) (end - p))
            return 0;
        if ((tag & 7) == 2 && (tag >> 3) == 1) {
            key = p;
            key_len = skip;
        }
        else if ((tag & 7) == 2 && (tag >> 3) == 2) {
            value = p;
            value_len = skip;
        }
        p += skip;
    }
    if (!key || key_len != strlen (S_IO_STRUCTURE_KEY)
        || memcmp (key, S_IO_STRUCTURE_KEY, key_len) != 0)
        return 0;
    if (value_len > KILN_MAX_IO_STRUCTURE_BYTES)
        return kiln_error (err, KILN_ELIMIT,
                           "model metadata '%s' is %llu bytes, more than the limit of %u",
                           S_IO_STRUCTURE_KEY, (unsigned long long) value_len,
                           KILN_MAX_IO_STRUCTURE_BYTES);
    if (value && memchr (value, '\0', value_len))
        return kiln_error (err, KILN_EFORMAT, "model metadata '%s' holds a NUL byte",
                           S_IO_STRUCTURE_KEY);
    return 0;
}

/* Walk the wire format of one message of type `desc` in [p, end),
 * descending into fields that hold messages, and refuse nesting deeper
 * than S_MAX_PROTO_DEPTH before protobuf-c recurses into it.  Offsets in
 * messages are from `base`, the start of the file. */
static int
s_check_nesting (const ProtobufCMessageDescriptor *desc, const uint8_t *p,
                 const uint8_t *end, const uint8_t *base, int depth,
                 kiln_err_t *err)
{
    const uint8_t *at = p;
    if (depth > S_MAX_PROTO_DEPTH)
        return kiln_error (err, KILN_ELIMIT,
                           "protobuf messages nested more than %d deep at byte %zu",
                           S_MAX_PROTO_DEPTH, (size_t) (p - base));
    while (p < end) {
        uint64_t key, len;
        at = p;
        if (s_varint (&p, end, &key) || (key >> 3) == 0 || (key >> 3) > UINT32_MAX)
            goto err;
        switch (key & 7) {
        case 0:                                /* varint */
            if (s_varint (&p, end, &len))
                goto err;
            break;
        case 1:                                /* fixed64 */
            if (end - p < 8)
                goto err;
            p += 8;
            break;
        case 5:                                /* fixed32 */
            if (end - p < 4)
                goto err;
            p += 4;
            break;
        case 2: {                              /* length-delimited */
            if (s_varint (&p, end, &len) || len > (uint64_t) (end - p))
                goto err;
            const ProtobufCFieldDescriptor *field =
                protobuf_c_message_descriptor_get_field (desc, (unsigned) (key >> 3));
            if (field && field->type == PROTOBUF_C_TYPE_MESSAGE) {
                int rc = s_check_nesting (field->descriptor, p, p + len, base,
                                          depth + 1, err);
                if (rc)
                    return rc;
                if (desc == &onnx__model_proto__descriptor
                    && field->offset == offsetof (Onnx__ModelProto, metadata_props)
                    && (rc = s_check_metadata_entry (p, p + len, err)))
                    return rc;
            }
            p += len;
            break;
        }
        default:                               /* groups: not in onnx.proto */
            goto err;
        }
    }
    return 0;
err:
    return kiln_error (err, KILN_EFORMAT,
                       "not a valid ONNX model: malformed protobuf at byte %zu",
                       (size_t) (at - base));
}

static void *
s_budget_alloc (void *data, size_t size)
{
    decode_budget_t *b = data;
    if (size > b->budget - b->used) {
        b->exhausted = true;
        return NULL;
    }
    b->used += size;
    return malloc (size ? size : 1);
}

static void
s_budget_free (void *data, void *ptr)
{
    free (ptr);
}

/* Decode `len` bytes into a ModelProto allocated through `alloc` (whose
 * data is a decode_budget_t).  Caller frees it with
 * onnx__model_proto__free_unpacked (model, alloc). */
static Onnx__ModelProto *
s_unpack (const uint8_t *data, size_t len, ProtobufCAllocator *alloc,
          kiln_err_t *err)
{
    decode_budget_t *budget = alloc->allocator_data;
    if ((uint64_t) len > KILN_MAX_MODEL_BYTES) {
        kiln_error (err, KILN_ELIMIT, "model is %zu bytes, more than the limit of %llu",
                    len, (unsigned long long) KILN_MAX_MODEL_BYTES);
        return NULL;
    }
    if (len == 0) {
        kiln_error (err, KILN_EFORMAT, "not a valid ONNX model: the file is empty");
        return NULL;
    }
    if (s_check_nesting (&onnx__model_proto__descriptor, data, data + len, data, 0, err))
        return NULL;
    budget->used = 0;
    budget->exhausted = false;
    budget->budget = (uint64_t) len * S_DECODE_FACTOR + S_DECODE_SLACK;
    if (budget->budget > SIZE_MAX)
        budget->budget = SIZE_MAX;
    Onnx__ModelProto *model = onnx__model_proto__unpack (alloc, len, data);
    if (!model && budget->exhausted)
        kiln_error (err, KILN_ELIMIT,
                    "decoding the model needs more than %llu bytes of memory "
                    "(%d times its size plus %llu MiB)",
                    (unsigned long long) budget->budget, S_DECODE_FACTOR,
                    (unsigned long long) (S_DECODE_SLACK >> 20));
    else if (!model)
        kiln_error (err, KILN_EFORMAT,
                    "not a valid ONNX model: protobuf decoding failed "
                    "(truncated or not a ModelProto)");
    return model;
}


/* --- opset and op support ----------------------------------------------- */

static int
s_default_opset (const Onnx__ModelProto *model, int *opset, kiln_err_t *err)
{
    int64_t version = -1;
    for (size_t i = 0; i < model->n_opset_import; i++) {
        const Onnx__OperatorSetIdProto *o = model->opset_import[i];
        if (!s_default_domain (o->domain))
            continue;
        if (version >= 0)
            return kiln_error (err, KILN_EFORMAT,
                               "model imports the default ONNX domain twice");
        if (!o->has_version || o->version < 0)
            return kiln_error (err, KILN_EFORMAT,
                               "model imports the default ONNX domain without a version");
        version = o->version;
    }
    if (version < 0)
        return kiln_error (err, KILN_EFORMAT,
                           "model imports no opset for the default ONNX domain");
    if (version < KILN_ONNX_OLDEST_OPSET || version > KILN_ONNX_MAX_OPSET)
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "model uses opset %lld of the default ONNX domain; kiln "
                           "supports opsets %d..%d, so export with an opset_version in that range",
                           (long long) version, KILN_ONNX_OLDEST_OPSET, KILN_ONNX_MAX_OPSET);
    *opset = (int) version;
    return 0;
}

/* The ops a model of opset 1..6 may use: those whose definition is the
 * same at opset 7 for what kiln reads (the attributes they dropped by 7,
 * consumed_inputs and the like, are legacy hints with no effect on the
 * values).  Anything else, the broadcasting arithmetic above all (opset 7
 * replaced its `broadcast` attribute with numpy's rules), is refused. */
static const char *const s_old_ops[] = {
    "Abs", "Ceil", "Elu", "Exp", "Floor", "GlobalAveragePool", "GlobalMaxPool",
    "HardSigmoid", "Identity", "InstanceNormalization", "LeakyRelu", "Log", "MatMul",
    "Neg", "Not", "Reciprocal", "Relu", "Selu", "Sigmoid", "Softplus", "Softsign",
    "Sqrt", "Tanh", "Transpose",
};

/* A model of an opset before KILN_ONNX_MIN_OPSET: every node's op must be
 * in s_old_ops; the graph is then opset 7's. */
static int
s_check_old_opset (const Onnx__GraphProto *graph, int *opset, kiln_err_t *err)
{
    if (*opset >= KILN_ONNX_MIN_OPSET)
        return 0;
    for (size_t i = 0; i < graph->n_node; i++) {
        const char *op = graph->node[i]->op_type ? graph->node[i]->op_type : "";
        bool ok = false;
        for (size_t k = 0; k < sizeof s_old_ops / sizeof s_old_ops[0] && !ok; k++)
            ok = strcmp (op, s_old_ops[k]) == 0;
        if (!ok)
            return kiln_error (err, KILN_EUNSUPPORTED,
                               "model uses opset %d of the default ONNX domain, and '%s' "
                               "changed by opset %d; kiln takes opsets before %d only for ops "
                               "that did not, so export with an opset_version of %d..%d",
                               *opset, op, KILN_ONNX_MIN_OPSET, KILN_ONNX_MIN_OPSET,
                               KILN_ONNX_MIN_OPSET, KILN_ONNX_MAX_OPSET);
    }
    *opset = KILN_ONNX_MIN_OPSET;
    return 0;
}

/* The kiln op for a default-domain ONNX op the importer rewrites; sets
 * *handled to whether the op is in s_import_ops at all. */
static const char *
s_import_op (const char *op, bool *handled)
{
    for (size_t i = 0; i < sizeof s_import_ops / sizeof s_import_ops[0]; i++)
        if (s_streq (op, s_import_ops[i].op)) {
            *handled = true;
            return s_import_ops[i].becomes;
        }
    *handled = false;
    return NULL;
}

static bool
s_op_supported (const Onnx__NodeProto *node)
{
    if (!s_default_domain (node->domain))
        return false;
    bool handled;
    const char *becomes = s_import_op (node->op_type, &handled);
    if (handled)
        return !becomes || kiln_graph_op_supported (becomes);
    return kiln_graph_op_supported (node->op_type);
}

static int
s_op_count_cmp (const void *a, const void *b)
{
    const op_count_t *x = a, *y = b;
    if (x->count != y->count)
        return x->count > y->count ? -1 : 1;
    return x->first < y->first ? -1 : x->first > y->first;
}

/* Report every unsupported op with its count in one error, the most used
 * first, so that a user sees the whole gap at once.  Also checks each
 * node's op type and domain against their bounds. */
static int
s_check_ops (const Onnx__GraphProto *graph, kiln_err_t *err)
{
    int rc = 0;
    op_count_t *counts = NULL;
    size_t n_counts = 0, cap = 0;
    zhashx_t *seen = zhashx_new ();      /* "domain.Op" -> index + 1 in counts */
    if (!seen) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory");
        goto err;
    }
    for (size_t i = 0; i < graph->n_node; i++) {
        const Onnx__NodeProto *node = graph->node[i];
        char label[KILN_MAX_NAME + KILN_MAX_OP_NAME + 32];
        s_node_label (node, i, label, sizeof label);
        const char *op = s_str (node->op_type), *domain = s_str (node->domain);
        if (!*op) {
            rc = kiln_error (err, KILN_EFORMAT, "%s has no op type", label);
            goto err;
        }
        if (strnlen (op, KILN_MAX_OP_NAME + 1) > KILN_MAX_OP_NAME) {
            rc = kiln_error (err, KILN_ELIMIT, "node #%zu: op type '%.40s...' is longer than %d bytes",
                             i, op, KILN_MAX_OP_NAME);
            goto err;
        }
        if ((rc = s_check_name (domain, "domain", err))
            || (rc = s_check_name (s_str (node->name), "node", err)))
            goto err;
        if (s_op_supported (node))
            continue;

        char key[sizeof counts->op];
        if (s_default_domain (domain))
            snprintf (key, sizeof key, "%s", op);
        else
            snprintf (key, sizeof key, "%s.%s", domain, op);
        uintptr_t at = (uintptr_t) zhashx_lookup (seen, key);
        if (at) {
            counts[at - 1].count++;
            continue;
        }
        if (n_counts == cap) {
            size_t new_cap = cap ? 2 * cap : 16;
            op_count_t *grown = realloc (counts, new_cap * sizeof *counts);
            if (!grown) {
                rc = kiln_error (err, KILN_ENOMEM, "out of memory");
                goto err;
            }
            counts = grown;
            cap = new_cap;
        }
        memcpy (counts[n_counts].op, key, sizeof key);
        counts[n_counts].count = 1;
        counts[n_counts].first = i;
        n_counts++;
        zhashx_insert (seen, key, (void *) (uintptr_t) n_counts);
    }
    if (n_counts > 0) {
        qsort (counts, n_counts, sizeof *counts, s_op_count_cmp);
        /* Build the list in a local buffer that stops short of the error
         * message's size, so that a model with hundreds of unknown ops
         * still gets a readable message ending in "and N more". */
        char msg[KILN_ERR_MSG_MAX - S_ERR_PREFIX_ROOM];
        size_t len = (size_t) snprintf (msg, sizeof msg, "unsupported ops: ");
        for (size_t k = 0; k < n_counts; k++) {
            char item[sizeof counts->op + 32];
            int m = snprintf (item, sizeof item, "%s%s (%zu)", k ? ", " : "",
                              counts[k].op, counts[k].count);
            /* 32 bytes stay free for ", and 1048576 more". */
            if (len + (size_t) m + 32 >= sizeof msg) {
                snprintf (msg + len, sizeof msg - len, ", and %zu more", n_counts - k);
                break;
            }
            memcpy (msg + len, item, (size_t) m + 1);
            len += (size_t) m;
        }
        /* Say why for the ops kiln refuses by design. */
        bool control = false, data = false;
        for (size_t k = 0; k < n_counts; k++) {
            control |= s_streq (counts[k].op, "If") || s_streq (counts[k].op, "Loop")
                       || s_streq (counts[k].op, "Scan");
            data |= kiln_graph_op_data_dependent (counts[k].op);
        }
        rc = kiln_error (err, KILN_EUNSUPPORTED, "%s%s%s", msg,
                         control ? "; If, Loop and Scan are control flow, and kiln compiles "
                                   "straight-line graphs" : "",
                         data ? "; NonZero, Unique and the like give outputs whose shape "
                                "depends on run-time values, and kiln compiles for fixed "
                                "shapes" : "");
    }
err:
    zhashx_destroy (&seen);
    free (counts);
    return rc;
}


/* --- values ----------------------------------------------------------- */

/* Tensor index of the value `name`, or -1. */
static int
s_lookup (importer_t *imp, const char *name)
{
    uintptr_t at = (uintptr_t) zhashx_lookup (imp->names, name);
    return at ? (int) (at - 1) : -1;
}

/* Define the value `name` as a new tensor (dtype and shape may be unknown)
 * and return its index.  A name is defined once: by an initializer, a
 * graph input or a node output.  `what` says which, for the error. */
static int
s_define (importer_t *imp, const char *name, kiln_dtype_t dt,
          const kiln_shape_t *shape, const char *what, kiln_err_t *err)
{
    int rc = s_check_name (name, what, err);
    if (rc)
        return rc;
    if (s_lookup (imp, name) >= 0)
        return kiln_error (err, KILN_EFORMAT,
                           "%s '%s': a value of that name is already defined", what, name);
    if (imp->g->n_tensors >= KILN_MAX_TENSORS)
        return kiln_error (err, KILN_ELIMIT, "model has more than %d tensors",
                           KILN_MAX_TENSORS);
    int t = kiln_graph_add_tensor (imp->g, name, dt, shape, err);
    if (t < 0)
        return t;
    zhashx_insert (imp->names, name, (void *) (uintptr_t) (t + 1));
    return t;
}

#define S_MAP_EXTERNAL_BYTES (1u << 20)   /* external weights this big are mapped */

/* Define `name` as a weight tensor holding `size` bytes; takes ownership
 * of *data and NULLs it, whether or not it succeeds. */
static int
s_define_weight (importer_t *imp, const char *name, kiln_dtype_t dt,
                 const kiln_shape_t *shape, uint8_t **data, uint64_t size,
                 const char *what, kiln_err_t *err)
{
    int t = s_define (imp, name, dt, shape, what, err);
    int rc = t < 0 ? t : kiln_graph_set_weight (imp->g, t, data, size, err);
    free (*data);
    *data = NULL;
    return rc < 0 ? rc : t;
}

/* The bytes of tensor `t` as a kiln weight: its dtype, shape, and a
 * malloc'd little-endian buffer of *size bytes that the caller owns.
 * raw_data is taken from `t` rather than copied (protobuf-c allocated it
 * with malloc through s_budget_alloc), so a large model is not held
 * twice; external data is read through `ext`.  `name` is the value the
 * tensor defines, for errors. */
static int
s_tensor_data (Onnx__TensorProto *t, const char *name, kiln_onnx_external_t *ext,
               kiln_dtype_t *dt, kiln_shape_t *shape, uint8_t **data, uint64_t *size,
               int *ext_fd, uint64_t *ext_offset, kiln_err_t *err)
{
    *data = NULL;
    bool external = t->has_data_location
                    && t->data_location == ONNX__TENSOR_PROTO__DATA_LOCATION__EXTERNAL;
    /* onnx itself reads external_data only when data_location says
     * EXTERNAL; entries without it would leave the bytes ambiguous. */
    if (!external && t->n_external_data > 0)
        return kiln_error (err, KILN_EFORMAT, "weight '%s' has external_data entries but "
                           "its data_location is not EXTERNAL", name);
    if (t->segment)
        return kiln_error (err, KILN_EUNSUPPORTED, "weight '%s' is a segment of a tensor", name);
    if (!t->has_data_type || !kiln_dtype_valid (t->data_type))
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "weight '%s' has ONNX data type %s, which kiln does not support",
                           name, s_enum_name (&onnx__tensor_proto__data_type__descriptor,
                                              t->has_data_type ? t->data_type : 0));
    *dt = (kiln_dtype_t) t->data_type;
    if (t->n_dims > KILN_MAX_RANK)
        return kiln_error (err, KILN_ELIMIT, "weight '%s' has rank %zu, more than %d",
                           name, t->n_dims, KILN_MAX_RANK);
    shape->rank = (int) t->n_dims;
    for (size_t i = 0; i < t->n_dims; i++) {
        if (t->dims[i] < 0)
            return kiln_error (err, KILN_EFORMAT, "weight '%s': dimension %zu is %lld",
                               name, i, (long long) t->dims[i]);
        shape->dims[i] = t->dims[i];
    }
    int64_t numel;
    uint64_t bytes;
    int rc = kiln_shape_numel (shape, name, &numel, err);
    if (rc || (rc = kiln_shape_bytes (shape, *dt, name, &bytes, err)))
        return rc;
    if (bytes > KILN_MAX_BLOB_BYTES || bytes > SIZE_MAX)
        return kiln_error (err, KILN_ELIMIT, "weight '%s' is %llu bytes, more than the limit of %llu",
                           name, (unsigned long long) bytes,
                           (unsigned long long) KILN_MAX_BLOB_BYTES);

    /* The typed field the ONNX spec assigns to each dtype: narrow integer
     * types and the bit patterns of float16 and bfloat16 travel widened in
     * int32_data. */
    const void *typed = NULL;
    size_t n_typed = 0;
    const char *field = "";
    switch (*dt) {
    case KILN_DT_FLOAT32:
        typed = t->float_data; n_typed = t->n_float_data; field = "float_data";
        break;
    case KILN_DT_FLOAT64:
        typed = t->double_data; n_typed = t->n_double_data; field = "double_data";
        break;
    case KILN_DT_INT64:
        typed = t->int64_data; n_typed = t->n_int64_data; field = "int64_data";
        break;
    default:
        typed = t->int32_data; n_typed = t->n_int32_data; field = "int32_data";
        break;
    }

    char shape_text[128];
    kiln_shape_str (shape, shape_text, sizeof shape_text);
    if (external) {
        if ((t->has_raw_data && t->raw_data.len > 0) || n_typed > 0)
            return kiln_error (err, KILN_EFORMAT, "weight '%s' has both external data and %s",
                               name, n_typed > 0 ? field : "raw_data");
        char what[sizeof shape_text + 32];
        snprintf (what, sizeof what, "%s %s", kiln_dtype_name (*dt), shape_text);
        /* A large weight is mapped by the caller, not read here. */
        if (ext_fd && bytes >= S_MAP_EXTERNAL_BYTES) {
            if ((rc = kiln_onnx_external_open (ext, name, t->external_data,
                                               t->n_external_data, what, bytes, ext_fd,
                                               ext_offset, err)))
                return rc;
            *size = bytes;
            return 0;
        }
        if ((rc = kiln_onnx_external_read (ext, name, t->external_data,
                                           t->n_external_data, what, bytes, data, err)))
            return rc;
        *size = bytes;
        return 0;
    }
    if (t->has_raw_data && t->raw_data.len > 0) {
        if (n_typed > 0)
            return kiln_error (err, KILN_EFORMAT,
                               "weight '%s' has both raw_data and %s", name, field);
        if (t->raw_data.len != bytes)
            return kiln_error (err, KILN_EFORMAT,
                               "weight '%s' is %s %s (%llu bytes) but raw_data holds %zu bytes",
                               name, kiln_dtype_name (*dt), shape_text,
                               (unsigned long long) bytes, t->raw_data.len);
        *data = t->raw_data.data;
        t->raw_data.data = NULL;
        t->raw_data.len = 0;
        t->has_raw_data = 0;
        *size = bytes;
        return 0;
    }
    if (n_typed != (uint64_t) numel)
        return kiln_error (err, KILN_EFORMAT,
                           "weight '%s' is %s %s (%lld elements) but %s holds %zu values",
                           name, kiln_dtype_name (*dt), shape_text, (long long) numel,
                           field, n_typed);
    /* One spare byte so that an empty tensor still has a buffer. */
    uint8_t *buf = malloc ((size_t) bytes + 1);
    if (!buf)
        return kiln_error (err, KILN_ENOMEM, "out of memory for weight '%s'", name);
    if (*dt == KILN_DT_INT32 || kiln_dtype_size (*dt) == 8 || *dt == KILN_DT_FLOAT32) {
        if (bytes)
            memcpy (buf, typed, (size_t) bytes);
    }
    else {
        /* Narrow each int32 to its dtype, refusing values that do not fit
         * rather than wrapping them silently. */
        int64_t lo = 0, hi = 0;
        switch (*dt) {
        case KILN_DT_INT8:    lo = INT8_MIN; hi = INT8_MAX; break;
        case KILN_DT_UINT8:   lo = 0; hi = UINT8_MAX; break;
        case KILN_DT_BOOL:    lo = 0; hi = 1; break;
        case KILN_DT_FLOAT16: case KILN_DT_BFLOAT16: lo = 0; hi = UINT16_MAX; break;
        default: break;
        }
        const int32_t *v = typed;
        for (size_t i = 0; i < n_typed; i++) {
            if (v[i] < lo || v[i] > hi) {
                free (buf);
                return kiln_error (err, KILN_EFORMAT,
                                   "weight '%s': %s value %d at index %zu does not fit %s",
                                   name, field, (int) v[i], i, kiln_dtype_name (*dt));
            }
            if (kiln_dtype_size (*dt) == 2) {
                uint16_t bits = (uint16_t) v[i];
                memcpy (buf + 2 * i, &bits, 2);
            }
            else
                buf[i] = (uint8_t) v[i];
        }
    }
    *data = buf;
    *size = bytes;
    return 0;
}

/* Map tensor `t`'s external bytes (`size` at `offset` of `fd`), taking
 * their digest from the import cache when the file is the one hashed
 * before (kiln_statcache.h), else hashing them and remembering it. */
static int
s_map_cached (importer_t *imp, int t, int fd, uint64_t offset, uint64_t size,
              kiln_err_t *err)
{
    struct stat before, after;
    uint8_t digest[KILN_DIGEST_LEN];
    if (!imp->cache || fstat (fd, &before) != 0)
        return kiln_graph_map_weight (imp->g, t, fd, offset, size, NULL, err);
    if (kiln_statcache_lookup (imp->cache, &before, offset, size, digest))
        return kiln_graph_map_weight (imp->g, t, fd, offset, size, digest, err);
    int64_t start = kiln_statcache_now_ns ();
    int rc = kiln_graph_map_weight (imp->g, t, fd, offset, size, NULL, err);
    if (rc == 0 && fstat (fd, &after) == 0)
        kiln_statcache_remember (imp->cache, &before, &after, start, offset, size,
                                 imp->g->weights[imp->g->tensors[t].weight].digest);
    return rc;
}

static int
s_add_initializer (importer_t *imp, Onnx__TensorProto *t, size_t i, kiln_err_t *err)
{
    const char *name = s_str (t->name);
    if (!*name)
        return kiln_error (err, KILN_EFORMAT, "initializer #%zu has no name", i);
    int rc = s_check_name (name, "initializer", err);
    if (rc)
        return rc;
    kiln_dtype_t dt;
    kiln_shape_t shape;
    uint8_t *data;
    uint64_t size;
    int fd = -1;
    uint64_t offset = 0;
    if ((rc = s_tensor_data (t, name, imp->ext, &dt, &shape, &data, &size, &fd, &offset,
                             err)))
        return rc;
    if (fd >= 0) {
        /* External data, mapped: its pages cost nothing until used, and
         * hashing it gives them back. */
        int tensor = s_define (imp, name, dt, &shape, "initializer", err);
        rc = tensor < 0 ? tensor : s_map_cached (imp, tensor, fd, offset, size, err);
        close (fd);
        return rc < 0 ? rc : 0;
    }
    rc = s_define_weight (imp, name, dt, &shape, &data, size, "initializer", err);
    return rc < 0 ? rc : 0;
}

/* A graph input with its dtype and fixed shape.  An input that names an
 * initializer was defined already and is a constant: IR version 3 and
 * older exporters list every initializer among the inputs, and kiln
 * freezes the weights as torch.neuron.trace does. */
static int
s_add_input (importer_t *imp, const Onnx__ValueInfoProto *vi, size_t i, kiln_err_t *err)
{
    const char *name = s_str (vi->name);
    if (!*name)
        return kiln_error (err, KILN_EFORMAT, "graph input #%zu has no name", i);
    int t = s_lookup (imp, name);
    if (t >= 0 && imp->g->tensors[t].weight >= 0)
        return 0;
    if (t >= 0)
        return kiln_error (err, KILN_EFORMAT, "graph input '%s' is listed twice", name);
    if (!vi->type || vi->type->value_case != ONNX__TYPE_PROTO__VALUE_TENSOR_TYPE)
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "input '%s' is not a tensor; kiln takes tensor inputs only", name);
    const Onnx__TypeProto__Tensor *tt = vi->type->tensor_type;
    if (!tt->has_elem_type || !kiln_dtype_valid (tt->elem_type))
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "input '%s' has ONNX data type %s, which kiln does not support",
                           name, s_enum_name (&onnx__tensor_proto__data_type__descriptor,
                                              tt->has_elem_type ? tt->elem_type : 0));
    if (!tt->shape)
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "input '%s' has no shape; kiln compiles for fixed shapes, so "
                           "export the model with fixed input shapes", name);
    if (tt->shape->n_dim > KILN_MAX_RANK)
        return kiln_error (err, KILN_ELIMIT, "input '%s' has rank %zu, more than %d",
                           name, tt->shape->n_dim, KILN_MAX_RANK);
    kiln_shape_t shape = { .rank = (int) tt->shape->n_dim };
    for (size_t d = 0; d < tt->shape->n_dim; d++) {
        const Onnx__TensorShapeProto__Dimension *dim = tt->shape->dim[d];
        if (dim->value_case == ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_PARAM)
            return kiln_error (err, KILN_EUNSUPPORTED,
                               "input '%s': dimension %zu is symbolic ('%.64s'); kiln compiles "
                               "for fixed shapes, so export without dynamic axes",
                               name, d, s_str (dim->dim_param));
        if (dim->value_case != ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_VALUE)
            return kiln_error (err, KILN_EUNSUPPORTED,
                               "input '%s': dimension %zu is unknown; kiln compiles for "
                               "fixed shapes, so export with fixed input shapes", name, d);
        if (dim->dim_value < 0)
            return kiln_error (err, KILN_EFORMAT, "input '%s': dimension %zu is %lld",
                               name, d, (long long) dim->dim_value);
        shape.dims[d] = dim->dim_value;
    }
    int64_t numel;
    int rc = kiln_shape_numel (&shape, name, &numel, err);
    if (rc)
        return rc;
    if ((t = s_define (imp, name, (kiln_dtype_t) tt->elem_type, &shape, "graph input", err)) < 0)
        return t;
    return kiln_graph_add_input (imp->g, t, err);
}


/* --- nodes ------------------------------------------------------------ */

/* The attribute's type; exporters before IR version 2 could leave it out,
 * and then the field that is set says it. */
static Onnx__AttributeProto__AttributeType
s_attr_type (const Onnx__AttributeProto *a)
{
    if (a->has_type && a->type != ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__UNDEFINED)
        return a->type;
    if (a->has_f) return ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOAT;
    if (a->has_i) return ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INT;
    if (a->has_s) return ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__STRING;
    if (a->t) return ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__TENSOR;
    if (a->n_floats) return ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOATS;
    if (a->n_ints) return ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INTS;
    return ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__UNDEFINED;
}

/* A Constant node becomes a weight tensor named by its output. */
static int
s_add_constant (importer_t *imp, Onnx__NodeProto *node, const char *label, kiln_err_t *err)
{
    if (node->n_output != 1 || !*s_str (node->output[0]))
        return kiln_error (err, KILN_EFORMAT, "%s must have exactly one named output", label);
    if (node->n_attribute != 1)
        return kiln_error (err, KILN_EFORMAT, "%s must have exactly one attribute, has %zu",
                           label, node->n_attribute);
    const char *out = node->output[0];
    Onnx__AttributeProto *a = node->attribute[0];
    const char *aname = s_str (a->name);
    Onnx__AttributeProto__AttributeType type = s_attr_type (a);
    kiln_dtype_t dt;
    kiln_shape_t shape = { .rank = 0 };
    uint8_t *data = NULL;
    uint64_t size = 0;
    int rc = 0;
    Onnx__AttributeProto__AttributeType want;

    if (s_streq (aname, "value"))
        want = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__TENSOR;
    else if (s_streq (aname, "value_float"))
        want = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOAT;
    else if (s_streq (aname, "value_floats"))
        want = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOATS;
    else if (s_streq (aname, "value_int"))
        want = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INT;
    else if (s_streq (aname, "value_ints"))
        want = ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INTS;
    else
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "%s: attribute '%.64s' is not supported; kiln takes numeric constants only",
                           label, aname);
    if (type != want)
        return kiln_error (err, KILN_EFORMAT, "%s: attribute '%s' has type %s, expected %s",
                           label, aname,
                           s_enum_name (&onnx__attribute_proto__attribute_type__descriptor, type),
                           s_enum_name (&onnx__attribute_proto__attribute_type__descriptor, want));

    switch (want) {
    case ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__TENSOR:
        if (!a->t)
            return kiln_error (err, KILN_EFORMAT, "%s: attribute 'value' holds no tensor", label);
        if ((rc = s_tensor_data (a->t, out, imp->ext, &dt, &shape, &data, &size, NULL, NULL,
                                 err)))
            return rc;
        break;
    case ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOAT:
    case ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INT: {
        bool is_float = want == ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOAT;
        dt = is_float ? KILN_DT_FLOAT32 : KILN_DT_INT64;
        size = is_float ? sizeof a->f : sizeof a->i;
        if (!(data = malloc (size)))
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        memcpy (data, is_float ? (const void *) &a->f : (const void *) &a->i, size);
        break;
    }
    default: {                                   /* FLOATS, INTS */
        bool is_float = want == ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOATS;
        size_t n = is_float ? a->n_floats : a->n_ints;
        if (n > KILN_MAX_ATTR_ELEMS)
            return kiln_error (err, KILN_ELIMIT, "%s: attribute '%s' has %zu values, more than %d",
                               label, aname, n, KILN_MAX_ATTR_ELEMS);
        dt = is_float ? KILN_DT_FLOAT32 : KILN_DT_INT64;
        shape.rank = 1;
        shape.dims[0] = (int64_t) n;
        size = n * kiln_dtype_size (dt);
        if (!(data = malloc (size + 1)))
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        if (n)
            memcpy (data, is_float ? (const void *) a->floats : (const void *) a->ints, size);
        break;
    }
    }
    rc = s_define_weight (imp, out, dt, &shape, &data, size, "constant", err);
    return rc < 0 ? rc : 0;
}

/* ConstantOfShape's `value`, a one-element TENSOR attribute, becomes two
 * plain attributes: `value_dtype` (the ONNX data type) and `value` (an
 * int for integer and bool types, a float otherwise), so that the IR
 * needs no tensor-valued attributes (docs/graph-format.md). */
static int
s_add_fill_value (importer_t *imp, int n, const char *label, Onnx__TensorProto *t,
                  kiln_err_t *err)
{
    kiln_graph_t *g = imp->g;
    kiln_dtype_t dt;
    kiln_shape_t shape;
    uint8_t *data = NULL;
    uint64_t size;
    int rc = s_tensor_data (t, "value", imp->ext, &dt, &shape, &data, &size, NULL, NULL,
                           err);
    if (rc)
        return kiln_error_prefix (err, "%s", label);
    if (size != kiln_dtype_size (dt)) {
        free (data);
        return kiln_error (err, KILN_EFORMAT, "%s: attribute 'value' must hold one element", label);
    }
    double f = 0.0;
    int64_t i = 0;
    bool is_float = true;
    switch (dt) {
    case KILN_DT_FLOAT32: { float x; memcpy (&x, data, 4); f = x; break; }
    case KILN_DT_FLOAT64: memcpy (&f, data, 8); break;
    case KILN_DT_FLOAT16: { uint16_t x; memcpy (&x, data, 2); f = kiln_f16_to_f32 (x); break; }
    case KILN_DT_BFLOAT16: { uint16_t x; memcpy (&x, data, 2); f = kiln_bf16_to_f32 (x); break; }
    case KILN_DT_INT64: memcpy (&i, data, 8); is_float = false; break;
    case KILN_DT_INT32: { int32_t x; memcpy (&x, data, 4); i = x; is_float = false; break; }
    case KILN_DT_INT8: i = (int8_t) data[0]; is_float = false; break;
    case KILN_DT_UINT8: case KILN_DT_BOOL: i = data[0]; is_float = false; break;
    default:
        free (data);
        return kiln_error (err, KILN_EUNSUPPORTED, "%s: attribute 'value' is %s", label,
                           kiln_dtype_name (dt));
    }
    free (data);
    if ((rc = kiln_node_set_int (g, n, "value_dtype", dt, err)))
        return rc;
    return is_float ? kiln_node_set_float (g, n, "value", f, err)
                    : kiln_node_set_int (g, n, "value", i, err);
}

/* Copy one attribute onto kiln node `n`. */
static int
s_add_attr (importer_t *imp, int n, const char *label, const Onnx__AttributeProto *a,
            kiln_err_t *err)
{
    kiln_graph_t *g = imp->g;
    const char *name = s_str (a->name);
    int rc = 0;
    if (!*name)
        return kiln_error (err, KILN_EFORMAT, "%s has an attribute without a name", label);
    if ((rc = s_check_name (name, "attribute", err)))
        return rc;
    if (*s_str (a->ref_attr_name))
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "%s: attribute '%s' refers to a function attribute", label, name);
    Onnx__AttributeProto__AttributeType type = s_attr_type (a);
    switch (type) {
    case ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INT:
        return kiln_node_set_int (g, n, name, a->i, err);
    case ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOAT:
        return kiln_node_set_float (g, n, name, a->f, err);
    case ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__STRING: {
        if (a->s.len > S_MAX_ATTR_STRING)
            return kiln_error (err, KILN_ELIMIT, "%s: attribute '%s' is %zu bytes, more than %d",
                               label, name, a->s.len, S_MAX_ATTR_STRING);
        if (a->s.len && memchr (a->s.data, '\0', a->s.len))
            return kiln_error (err, KILN_EFORMAT, "%s: attribute '%s' holds a NUL byte",
                               label, name);
        char *s = malloc (a->s.len + 1);
        if (!s)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        if (a->s.len)
            memcpy (s, a->s.data, a->s.len);
        s[a->s.len] = '\0';
        rc = kiln_node_set_string (g, n, name, s, err);
        free (s);
        return rc;
    }
    case ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__STRINGS: {
        /* A list of strings (RNN, GRU and LSTM's activations) is kept as
         * one string, its elements joined by commas (graph-format.md). */
        size_t len = 0;
        for (size_t k = 0; k < a->n_strings; k++) {
            const ProtobufCBinaryData *e = &a->strings[k];
            if (e->len > S_MAX_ATTR_STRING
                || (e->len && (memchr (e->data, '\0', e->len) || memchr (e->data, ',', e->len))))
                return kiln_error (err, KILN_EFORMAT, "%s: attribute '%s': element %zu is "
                                   "longer than %d bytes or holds a NUL byte or a comma",
                                   label, name, k, S_MAX_ATTR_STRING);
            len += e->len + 1;
            if (len > S_MAX_ATTR_STRING + 1)
                return kiln_error (err, KILN_ELIMIT, "%s: attribute '%s' is more than %d "
                                   "bytes", label, name, S_MAX_ATTR_STRING);
        }
        char *s = calloc (len + 1, 1);
        if (!s)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        for (size_t k = 0, at = 0; k < a->n_strings; k++) {
            if (k)
                s[at++] = ',';
            if (a->strings[k].len)
                memcpy (s + at, a->strings[k].data, a->strings[k].len);
            at += a->strings[k].len;
        }
        rc = kiln_node_set_string (g, n, name, s, err);
        free (s);
        return rc;
    }
    case ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INTS: {
        static const int64_t none[1];
        if (a->n_ints > KILN_MAX_ATTR_ELEMS)
            return kiln_error (err, KILN_ELIMIT, "%s: attribute '%s' has %zu values, more than %d",
                               label, name, a->n_ints, KILN_MAX_ATTR_ELEMS);
        return kiln_node_set_ints (g, n, name, a->n_ints ? a->ints : none, a->n_ints, err);
    }
    case ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOATS: {
        if (a->n_floats > KILN_MAX_ATTR_ELEMS)
            return kiln_error (err, KILN_ELIMIT, "%s: attribute '%s' has %zu values, more than %d",
                               label, name, a->n_floats, KILN_MAX_ATTR_ELEMS);
        double *v = malloc ((a->n_floats + 1) * sizeof *v);
        if (!v)
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        for (size_t i = 0; i < a->n_floats; i++)
            v[i] = a->floats[i];
        rc = kiln_node_set_floats (g, n, name, v, a->n_floats, err);
        free (v);
        return rc;
    }
    case ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__TENSOR:
        if (s_streq (g->nodes[n].op, "ConstantOfShape") && s_streq (name, "value") && a->t)
            return s_add_fill_value (imp, n, label, a->t, err);
        /* fall through */
    default:
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "%s: attribute '%s' has type %s, which kiln does not support",
                           label, name,
                           s_enum_name (&onnx__attribute_proto__attribute_type__descriptor, type));
    }
}

/* Whether a node or the graph's outputs read the value `name`. */
static int
s_used (importer_t *imp, const char *name, bool *used, kiln_err_t *err)
{
    if (!imp->used) {
        if (!(imp->used = zhashx_new ()))
            return kiln_error (err, KILN_ENOMEM, "out of memory");
        for (size_t i = 0; i < imp->graph->n_node; i++)
            for (size_t j = 0; j < imp->graph->node[i]->n_input; j++)
                zhashx_update (imp->used, s_str (imp->graph->node[i]->input[j]), (void *) 1);
        for (size_t i = 0; i < imp->graph->n_output; i++)
            zhashx_update (imp->used, s_str (imp->graph->output[i]->name), (void *) 1);
    }
    *used = zhashx_lookup (imp->used, name) != NULL;
    return 0;
}

/* Pass 1 for one node: define the values it produces.  Empty output names
 * are absent optional outputs and define nothing. */
static int
s_define_outputs (importer_t *imp, Onnx__NodeProto *node, const char *label, kiln_err_t *err)
{
    bool handled;
    const char *becomes = s_import_op (node->op_type, &handled);
    if (handled && !becomes)
        return s_add_constant (imp, node, label, err);
    if (node->n_input > KILN_MAX_NODE_IO || node->n_output > KILN_MAX_NODE_IO)
        return kiln_error (err, KILN_ELIMIT, "%s has more than %d inputs or outputs",
                           label, KILN_MAX_NODE_IO);
    for (size_t j = 0; j < node->n_output; j++) {
        const char *out = s_str (node->output[j]);
        if (!*out)
            continue;
        /* Dropout's second output is the mask of dropped elements, which
         * has no meaning at inference: left out when nothing reads it (as
         * torch exports it from some modules), refused when something
         * does. */
        if (handled && j > 0) {
            bool used = true;
            int rc = s_used (imp, out, &used, err);
            if (rc)
                return rc;
            if (!used)
                continue;
            return kiln_error (err, KILN_EUNSUPPORTED,
                               "%s: output '%s' (the dropout mask) is read by the graph; "
                               "kiln compiles for inference, where it has no meaning",
                               label, out);
        }
        int t = s_define (imp, out, KILN_DT_UNDEFINED, NULL, "node output", err);
        if (t < 0)
            return t;
    }
    return 0;
}

/* The weight of value `name` when it is a constant with its data (its
 * dtype into *dt), else NULL. */
static const kiln_weight_t *
s_constant (importer_t *imp, const char *name, kiln_dtype_t *dt)
{
    int t = *name ? s_lookup (imp, name) : -1;
    const kiln_tensor_t *tensor = t >= 0 ? &imp->g->tensors[t] : NULL;
    const kiln_weight_t *w = tensor && tensor->weight >= 0 ? &imp->g->weights[tensor->weight]
                                                           : NULL;
    if (!w || !w->data)
        return NULL;
    *dt = tensor->dtype;
    return w;
}

/* Whether the float of dtype `dt` at `p` is zero (either sign). */
static bool
s_float_zero (kiln_dtype_t dt, const uint8_t *p)
{
    float f;
    double d;
    uint16_t h;
    switch (dt) {
    case KILN_DT_FLOAT32: memcpy (&f, p, sizeof f); return f == 0.0f;
    case KILN_DT_FLOAT64: memcpy (&d, p, sizeof d); return d == 0.0;
    case KILN_DT_FLOAT16:
    case KILN_DT_BFLOAT16: memcpy (&h, p, sizeof h); return (h & 0x7fff) == 0;
    default: return false;
    }
}

/* Pass 2 for one node: emit it with its inputs resolved by name. */
static int
s_add_node (importer_t *imp, const Onnx__NodeProto *node, const char *label, kiln_err_t *err)
{
    bool handled;
    const char *becomes = s_import_op (node->op_type, &handled);
    if (handled && !becomes)
        return 0;                                /* Constant: a weight already */
    int inputs[KILN_MAX_NODE_IO], outputs[KILN_MAX_NODE_IO];

    /* A rewritten op (Dropout) keeps only its data input: the ratio does
     * not matter at inference.  A training_mode input (opset 12 on) must
     * be a constant false, or the ratio a constant 0 (some torchvision
     * models export dropout with p = 0 in training mode): in training mode
     * Dropout drops elements, and passing them through would be a wrong
     * answer. */
    if (handled && node->n_input > 2 && *s_str (node->input[2])) {
        kiln_dtype_t tdt, rdt;
        const kiln_weight_t *w = s_constant (imp, s_str (node->input[2]), &tdt);
        const kiln_weight_t *r = s_constant (imp, s_str (node->input[1]), &rdt);
        bool no_drop = r && r->size == kiln_dtype_size (rdt) && s_float_zero (rdt, r->data);
        if ((!w || w->size != 1 || w->data[0] != 0) && !no_drop)
            return kiln_error (err, KILN_EUNSUPPORTED,
                               "%s: training_mode '%s' is not a constant false (and the "
                               "ratio not a constant 0); kiln compiles Dropout for "
                               "inference only", label, s_str (node->input[2]));
    }
    size_t n_in = handled && node->n_input > 1 ? 1 : node->n_input;
    for (size_t j = 0; j < n_in; j++) {
        const char *in = s_str (node->input[j]);
        inputs[j] = *in ? s_lookup (imp, in) : -1;
        if (*in && inputs[j] < 0)
            return kiln_error (err, KILN_EFORMAT,
                               "%s: input '%s' is not a graph input, an initializer "
                               "or the output of any node", label, in);
    }
    /* Trailing empty outputs are absent optional outputs.  An empty name
     * before a named one still takes its position, so it gets an unnamed
     * tensor: kiln node outputs are never -1. */
    size_t n_out = node->n_output;
    while (n_out > 0 && !*s_str (node->output[n_out - 1]))
        n_out--;
    if (handled && n_out > 1)
        n_out = 1;
    if (n_out == 0)
        return kiln_error (err, KILN_EFORMAT, "%s has no outputs", label);
    for (size_t j = 0; j < n_out; j++) {
        const char *out = s_str (node->output[j]);
        outputs[j] = *out ? s_lookup (imp, out)
                          : kiln_graph_add_tensor (imp->g, "", KILN_DT_UNDEFINED, NULL, err);
        if (outputs[j] < 0)
            return outputs[j];
    }
    int n = kiln_graph_add_node (imp->g, handled ? becomes : node->op_type,
                                 s_str (node->name), inputs, (int) n_in, outputs,
                                 (int) n_out, err);
    if (n < 0)
        return n;
    if (handled)
        return 0;                                /* Dropout's ratio and seed */
    if (node->n_attribute > KILN_MAX_ATTRS)
        return kiln_error (err, KILN_ELIMIT, "%s has %zu attributes, more than %d",
                           label, node->n_attribute, KILN_MAX_ATTRS);
    for (size_t k = 0; k < node->n_attribute; k++) {
        int rc = s_add_attr (imp, n, label, node->attribute[k], err);
        if (rc)
            return rc;
    }
    return 0;
}


/* --- model ------------------------------------------------------------ */

/* Keep the value of the model's S_IO_STRUCTURE_KEY metadata as the
 * graph's io_structure (its length and NUL bytes were checked on the
 * wire, by s_check_metadata_entry). */
static int
s_add_io_structure (kiln_graph_t *g, const Onnx__ModelProto *model, kiln_err_t *err)
{
    const char *text = NULL;
    for (size_t i = 0; i < model->n_metadata_props; i++) {
        const Onnx__StringStringEntryProto *e = model->metadata_props[i];
        if (!s_streq (s_str (e->key), S_IO_STRUCTURE_KEY))
            continue;
        if (text)
            return kiln_error (err, KILN_EFORMAT, "model metadata has the key '%s' twice",
                               S_IO_STRUCTURE_KEY);
        text = s_str (e->value);
    }
    if (kiln_graph_set_io_structure (g, text, err))
        return kiln_error_prefix (err, "model metadata '%s'", S_IO_STRUCTURE_KEY);
    return 0;
}

/* Import the decoded `model`, whose external data (if any) `ext` reads. */
static kiln_graph_t *
s_import_model (Onnx__ModelProto *model, kiln_onnx_external_t *ext, kiln_statcache_t *cache,
                kiln_err_t *err)
{
    importer_t imp = { NULL, NULL, ext, cache, NULL, NULL };
    Onnx__GraphProto *graph = model->graph;
    char label[KILN_MAX_NAME + KILN_MAX_OP_NAME + 32];
    int opset = 0;
    int rc = 0;

    if (!graph) {
        kiln_error (err, KILN_EFORMAT, "model has no graph");
        goto err;
    }
    imp.graph = graph;
    if (s_default_opset (model, &opset, err) || s_check_ops (graph, err)
        || s_check_old_opset (graph, &opset, err))
        goto err;
    if (graph->n_node > KILN_MAX_NODES) {
        kiln_error (err, KILN_ELIMIT, "graph has %zu nodes, more than %d",
                    graph->n_node, KILN_MAX_NODES);
        goto err;
    }
    if (graph->n_input > KILN_MAX_GRAPH_IO || graph->n_output > KILN_MAX_GRAPH_IO) {
        kiln_error (err, KILN_ELIMIT, "graph has more than %d inputs or outputs",
                    KILN_MAX_GRAPH_IO);
        goto err;
    }
    if (graph->n_output == 0) {
        kiln_error (err, KILN_EFORMAT, "graph has no outputs");
        goto err;
    }
    if (graph->n_sparse_initializer > 0) {
        kiln_error (err, KILN_EUNSUPPORTED, "graph has sparse initializers, which kiln does not support");
        goto err;
    }

    imp.g = kiln_graph_new ();
    imp.names = zhashx_new ();
    if (!imp.g || !imp.names) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        goto err;
    }
    imp.g->opset = opset;
    if ((rc = s_add_io_structure (imp.g, model, err)))
        goto err;

    for (size_t i = 0; i < graph->n_initializer; i++)
        if ((rc = s_add_initializer (&imp, graph->initializer[i], i, err)))
            goto err;
    for (size_t i = 0; i < graph->n_input; i++)
        if ((rc = s_add_input (&imp, graph->input[i], i, err)))
            goto err;
    /* Outputs are defined before any input is resolved, so that nodes
     * need not be in topological order here; kiln_graph_validate sorts
     * them. */
    for (size_t i = 0; i < graph->n_node; i++) {
        s_node_label (graph->node[i], i, label, sizeof label);
        if ((rc = s_define_outputs (&imp, graph->node[i], label, err)))
            goto err;
    }
    for (size_t i = 0; i < graph->n_node; i++) {
        s_node_label (graph->node[i], i, label, sizeof label);
        if ((rc = s_add_node (&imp, graph->node[i], label, err)))
            goto err;
    }
    for (size_t i = 0; i < graph->n_output; i++) {
        const char *name = s_str (graph->output[i]->name);
        int t = *name ? s_lookup (&imp, name) : -1;
        if (!*name) {
            kiln_error (err, KILN_EFORMAT, "graph output #%zu has no name", i);
            goto err;
        }
        if (t < 0) {
            kiln_error (err, KILN_EFORMAT, "graph output '%s' is not a graph input, "
                        "an initializer or the output of any node", name);
            goto err;
        }
        if ((rc = kiln_graph_add_output (imp.g, t, err)))
            goto err;
    }
    /* Folding validates too; before it, Shape-computed reshape targets
     * are not constants yet (graph/kiln_fold.h). */
    if ((rc = kiln_graph_fold (imp.g, err)) < 0)
        goto err;
    zhashx_destroy (&imp.names);
    zhashx_destroy (&imp.used);
    return imp.g;
err:
    zhashx_destroy (&imp.names);
    zhashx_destroy (&imp.used);
    kiln_graph_destroy (&imp.g);
    return NULL;
}

kiln_graph_t *
kiln_onnx_import_mem_dir (const uint8_t *data, size_t len, const char *base_dir,
                          kiln_err_t *err)
{
    kiln_err_t local;
    if (!err)
        err = &local;
    decode_budget_t budget = { 0, 0, false };
    ProtobufCAllocator alloc = { s_budget_alloc, s_budget_free, &budget };
    kiln_onnx_external_t *ext = kiln_onnx_external_new (base_dir, err);
    if (!ext)
        return NULL;
    Onnx__ModelProto *model = s_unpack (data, len, &alloc, err);
    kiln_graph_t *g = model ? s_import_model (model, ext, NULL, err) : NULL;
    if (model)
        onnx__model_proto__free_unpacked (model, &alloc);
    kiln_onnx_external_destroy (&ext);
    return g;
}

kiln_graph_t *
kiln_onnx_import_mem (const uint8_t *data, size_t len, kiln_err_t *err)
{
    return kiln_onnx_import_mem_dir (data, len, NULL, err);
}

/* The directory part of `path` ("." for a bare file name), in buf. */
static const char *
s_dirname (const char *path, char *buf, size_t size)
{
    const char *slash = strrchr (path, '/');
    if (!slash)
        snprintf (buf, size, ".");
    else if (slash == path)
        snprintf (buf, size, "/");
    else
        snprintf (buf, size, "%.*s", (int) (slash - path), path);
    return buf;
}

kiln_graph_t *
kiln_onnx_import (const char *path, kiln_err_t *err)
{
    return kiln_onnx_import_cached (path, NULL, err);
}

kiln_graph_t *
kiln_onnx_import_cached (const char *path, kiln_statcache_t *cache, kiln_err_t *err)
{
    kiln_err_t local;
    if (!err)
        err = &local;
    uint8_t *data = NULL;
    size_t len = 0;
    if (strlen (path) >= PATH_MAX) {
        kiln_error (err, KILN_ELIMIT, "model path '%.64s...' is longer than %d bytes",
                    path, PATH_MAX - 1);
        return NULL;
    }
    char dir[PATH_MAX];
    kiln_onnx_external_t *ext = kiln_onnx_external_new (s_dirname (path, dir, sizeof dir),
                                                        err);
    if (!ext || kiln_read_file (path, KILN_MAX_MODEL_BYTES, &data, &len, err)) {
        kiln_onnx_external_destroy (&ext);
        return NULL;
    }
    decode_budget_t budget = { 0, 0, false };
    ProtobufCAllocator alloc = { s_budget_alloc, s_budget_free, &budget };
    Onnx__ModelProto *model = s_unpack (data, len, &alloc, err);
    /* The decoded model holds its own copy of every byte, and the
     * importer takes the weights from it, so the file buffer goes now:
     * a large model is then held once, not twice. */
    free (data);
    kiln_graph_t *g = model ? s_import_model (model, ext, cache, err) : NULL;
    if (model)
        onnx__model_proto__free_unpacked (model, &alloc);
    kiln_onnx_external_destroy (&ext);
    if (!g)
        kiln_error_prefix (err, "'%s'", path);
    return g;
}
