/*
 * kiln_manifest — manifest.json: checking, encoding and strict decoding.
 *
 * The encoding is jansson's compact output with sorted keys, members
 * sorted by name.  The decoder accepts exactly that encoding: it parses
 * with bounds, then re-encodes what it parsed and compares the bytes, so
 * that one manifest has one spelling and one content hash.
 */
#include "artifact/kiln_artifact_priv.h"

#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#define S_FORMAT_NAME "kiln-artifact"

static const char *const s_reserved[KILN_N_RESERVED_MEMBERS] = {
    KILN_MEMBER_MANIFEST, KILN_MEMBER_MANIFEST_SIG, KILN_MEMBER_SIGNATURE,
    KILN_MEMBER_PROVENANCE, KILN_MEMBER_PROVENANCE_SIG,
};

bool
kiln_member_name_reserved (const char *name)
{
    for (int i = 0; i < KILN_N_RESERVED_MEMBERS; i++)
        if (strcmp (name, s_reserved[i]) == 0)
            return true;
    return false;
}

bool
kiln_member_name_ok (const char *name)
{
    size_t n = strnlen (name, KILN_MAX_MEMBER_NAME + 1);
    if (n == 0 || n > KILN_MAX_MEMBER_NAME)
        return false;
    //  "." and ".." match the character set but name directories.
    if (strcmp (name, ".") == 0 || strcmp (name, "..") == 0)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
                  || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
        if (!ok)
            return false;
    }
    return !kiln_member_name_reserved (name);
}

/* --- manifest ownership ---------------------------------------------- */

void
kiln_manifest_release (kiln_manifest_t *m)
{
    if (!m)
        return;
    free (m->inputs);
    free (m->outputs);
    free (m->io_structure);
    free (m->stages);
    memset (m, 0, sizeof *m);
}

static int
s_dup_ios (kiln_io_t **dst, const kiln_io_t *src, int n, kiln_err_t *err)
{
    *dst = NULL;
    if (n <= 0)
        return 0;
    *dst = malloc ((size_t) n * sizeof **dst);
    if (!*dst)
        return kiln_error (err, KILN_ENOMEM, "out of memory copying %d tensors", n);
    memcpy (*dst, src, (size_t) n * sizeof **dst);
    return 0;
}

int
kiln_manifest_copy (kiln_manifest_t *dst, const kiln_manifest_t *src,
                    kiln_err_t *err)
{
    kiln_manifest_t copy = *src;
    copy.inputs = NULL;
    copy.outputs = NULL;
    copy.io_structure = NULL;
    copy.stages = NULL;
    copy.n_stages = 0;
    int rc = kiln_manifest_set_pipeline (&copy, src->stages, src->n_stages, err);
    if (rc) {
        kiln_manifest_release (&copy);
        return rc;
    }
    if (s_dup_ios (&copy.inputs, src->inputs, src->n_inputs, err)
        || s_dup_ios (&copy.outputs, src->outputs, src->n_outputs, err)) {
        kiln_manifest_release (&copy);
        return -KILN_ENOMEM;
    }
    if (src->io_structure && !(copy.io_structure = strdup (src->io_structure))) {
        kiln_manifest_release (&copy);
        return kiln_error (err, KILN_ENOMEM, "out of memory copying io_structure");
    }
    *dst = copy;
    return 0;
}

/* --- checking -------------------------------------------------------- */

static int
s_check_str (const char *field, const char *s, size_t cap, bool required,
             kiln_err_t *err)
{
    if (strnlen (s, cap) >= cap)
        return kiln_error (err, KILN_ELIMIT,
                           "manifest field '%s' is longer than %zu bytes",
                           field, cap - 1);
    if (required && !*s)
        return kiln_error (err, KILN_EFORMAT, "manifest field '%s' is empty", field);
    return 0;
}

static int
s_check_io (const char *what, const kiln_io_t *io, kiln_err_t *err)
{
    if (strnlen (io->name, sizeof io->name) >= sizeof io->name)
        return kiln_error (err, KILN_ELIMIT, "manifest: %s name is longer than %d bytes",
                           what, KILN_MAX_NAME);
    if (!io->name[0])
        return kiln_error (err, KILN_EFORMAT, "manifest: %s has an empty name", what);
    if (!kiln_dtype_valid ((int) io->dtype))
        return kiln_error (err, KILN_EFORMAT, "manifest: %s '%s': invalid dtype %d",
                           what, io->name, (int) io->dtype);
    if (io->shape.rank < 0)
        return kiln_error (err, KILN_EFORMAT, "manifest: %s '%s': shape is not fixed",
                           what, io->name);
    int64_t numel;
    int rc = kiln_shape_numel (&io->shape, io->name, &numel, err);
    if (rc)
        return kiln_error_prefix (err, "manifest: %s", what);
    return 0;
}

static int
s_check_ios (const char *what, const kiln_io_t *ios, int n, kiln_err_t *err)
{
    if (n < 0 || n > KILN_MAX_GRAPH_IO)
        return kiln_error (err, KILN_ELIMIT, "manifest: %d %ss, outside 0..%d",
                           n, what, KILN_MAX_GRAPH_IO);
    if (n > 0 && !ios)
        return kiln_error (err, KILN_EINVAL, "manifest: %d %ss but no array", n, what);
    for (int i = 0; i < n; i++) {
        int rc = s_check_io (what, &ios[i], err);
        if (rc)
            return rc;
        for (int j = 0; j < i; j++)
            if (strcmp (ios[i].name, ios[j].name) == 0)
                return kiln_error (err, KILN_EFORMAT, "manifest: %s '%s' is listed twice",
                                   what, ios[i].name);
    }
    return 0;
}

/* The largest integer a stage field may hold: JSON readers that use
 * doubles (Python's json is exact, JavaScript's is not) read it exactly. */
#define S_STAGE_INT_MAX ((1LL << 53) - 1)

static int
s_check_stages (const kiln_stage_info_t *st, int n, kiln_err_t *err)
{
    if (n == 0)
        return 0;
    if (n < 2 || n > KILN_MAX_PIPELINE_STAGES || !st)
        return kiln_error (err, KILN_ELIMIT, "manifest: %d pipeline stages, outside "
                           "2..%d", n, KILN_MAX_PIPELINE_STAGES);
    for (int i = 0; i < n; i++) {
        const kiln_stage_info_t *s = &st[i];
        int want = i == 0 ? 0 : st[i - 1].first_op + st[i - 1].n_ops;
        if (s->first_op != want || s->n_ops < 1 || s->n_ops > (1 << 22))
            return kiln_error (err, KILN_EFORMAT, "manifest: pipeline stage %d "
                               "starts at op %d with %d ops (expected op %d, at "
                               "least one op)", i, s->first_op, s->n_ops, want);
        uint64_t max = (uint64_t) S_STAGE_INT_MAX;
        if (s->flops > max || s->moved_bytes > max || s->cost_ns > max
            || s->weights_bytes > max || s->handoff_bytes > max)
            return kiln_error (err, KILN_ELIMIT, "manifest: pipeline stage %d: a "
                               "count above 2^53", i);
    }
    return 0;
}

int
kiln_manifest_set_pipeline (kiln_manifest_t *m, const kiln_stage_info_t *stages,
                            int n, kiln_err_t *err)
{
    int rc = s_check_stages (stages, n, err);
    if (rc)
        return rc;
    kiln_stage_info_t *copy = NULL;
    if (n > 0) {
        if (!(copy = malloc ((size_t) n * sizeof *copy)))
            return kiln_error (err, KILN_ENOMEM, "out of memory copying %d stages", n);
        memcpy (copy, stages, (size_t) n * sizeof *copy);
    }
    free (m->stages);
    m->stages = copy;
    m->n_stages = n;
    return 0;
}

int
kiln_manifest_check (const kiln_manifest_t *m, kiln_err_t *err)
{
    if (m->format_version != KILN_ARTIFACT_FORMAT_VERSION)
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "unsupported artifact format version %d (this kiln handles version %d)",
                           m->format_version, KILN_ARTIFACT_FORMAT_VERSION);
    if (!kiln_is_digest_hex (m->graph_digest))
        return kiln_error (err, KILN_EFORMAT,
                           "manifest field 'graph_digest' is not 64 lower-case hex characters");
    if (!kiln_is_digest_hex (m->action_key))
        return kiln_error (err, KILN_EFORMAT,
                           "manifest field 'action_key' is not 64 lower-case hex characters");
    int rc;
    if ((rc = s_check_str ("compiler.id", m->compiler_id, sizeof m->compiler_id, true, err))
        || (rc = s_check_str ("compiler.version", m->compiler_version,
                              sizeof m->compiler_version, false, err))
        || (rc = s_check_str ("compiler.args", m->compiler_args,
                              sizeof m->compiler_args, false, err))
        || (rc = s_check_str ("target", m->target, sizeof m->target, true, err)))
        return rc;
    if (m->runtime_abi < 1)
        return kiln_error (err, KILN_EFORMAT, "manifest field 'runtime_abi' is %d, not positive",
                           m->runtime_abi);
    if ((rc = s_check_ios ("input", m->inputs, m->n_inputs, err))
        || (rc = s_check_ios ("output", m->outputs, m->n_outputs, err)))
        return rc;
    //  Absent is NULL, never "": the encoder leaves the field out only
    //  when it is NULL, and the decoder must give back what was encoded.
    if (m->io_structure
        && (rc = s_check_str ("io_structure", m->io_structure,
                              KILN_MAX_IO_STRUCTURE_BYTES + 1, true, err)))
        return rc;
    return s_check_stages (m->stages, m->n_stages, err);
}

int
kiln_manifest_set_io (kiln_manifest_t *m, bool outputs, const kiln_io_t *ios,
                      int n, kiln_err_t *err)
{
    const char *what = outputs ? "output" : "input";
    int rc = s_check_ios (what, ios, n, err);
    if (rc)
        return rc;
    kiln_io_t *copy;
    if ((rc = s_dup_ios (&copy, ios, n, err)))
        return rc;
    kiln_io_t **slot = outputs ? &m->outputs : &m->inputs;
    int *count = outputs ? &m->n_outputs : &m->n_inputs;
    free (*slot);
    *slot = copy;
    *count = n;
    return 0;
}

int
kiln_manifest_set_io_structure (kiln_manifest_t *m, const char *text,
                                kiln_err_t *err)
{
    char *copy = NULL;
    if (text && *text) {
        int rc = s_check_str ("io_structure", text, KILN_MAX_IO_STRUCTURE_BYTES + 1,
                              true, err);
        if (rc)
            return rc;
        if (!(copy = strdup (text)))
            return kiln_error (err, KILN_ENOMEM, "out of memory copying io_structure");
    }
    free (m->io_structure);
    m->io_structure = copy;
    return 0;
}

/* --- encoding -------------------------------------------------------- */

/* Builds JSON values; the first failure is kept in `rc` and every later
 * call is a no-op, so that an encoder reads as a list of fields. */
typedef struct {
    int rc;
    kiln_err_t *err;
} s_builder_t;

static void
s_set (s_builder_t *b, json_t *obj, const char *key, json_t *val)
{
    if (b->rc) {
        json_decref (val);
        return;
    }
    //  json_object_set_new takes the reference even when it fails.
    if (!val || !obj || json_object_set_new (obj, key, val) != 0)
        b->rc = kiln_error (b->err, KILN_ENOMEM, "out of memory encoding manifest field '%s'", key);
}

static void
s_append (s_builder_t *b, json_t *arr, json_t *val)
{
    if (b->rc) {
        json_decref (val);
        return;
    }
    if (!val || !arr || json_array_append_new (arr, val) != 0)
        b->rc = kiln_error (b->err, KILN_ENOMEM, "out of memory encoding manifest");
}

static void
s_set_str (s_builder_t *b, json_t *obj, const char *key, const char *field,
           const char *s)
{
    if (b->rc)
        return;
    json_t *v = json_string (s);
    if (!v) {
        b->rc = kiln_error (b->err, KILN_EFORMAT,
                            "manifest field '%s' is not valid UTF-8", field);
        return;
    }
    s_set (b, obj, key, v);
}

static json_t *
s_encode_ios (s_builder_t *b, const char *what, const kiln_io_t *ios, int n)
{
    json_t *arr = json_array ();
    for (int i = 0; i < n && !b->rc; i++) {
        json_t *io = json_object ();
        char field[64];
        snprintf (field, sizeof field, "%ss[%d].name", what, i);
        s_set_str (b, io, "name", field, ios[i].name);
        s_set (b, io, "dtype", json_string (kiln_dtype_name (ios[i].dtype)));
        json_t *shape = json_array ();
        for (int d = 0; d < ios[i].shape.rank; d++)
            s_append (b, shape, json_integer ((json_int_t) ios[i].shape.dims[d]));
        s_set (b, io, "shape", shape);
        s_append (b, arr, io);
    }
    return arr;
}

int
kiln_manifest_encode (const kiln_manifest_t *m, const kiln_member_t *members,
                      int n_members, char **out, size_t *len, kiln_err_t *err)
{
    *out = NULL;
    *len = 0;
    int rc = kiln_manifest_check (m, err);
    if (rc)
        return rc;
    if (n_members < 0 || n_members > KILN_MAX_MEMBERS)
        return kiln_error (err, KILN_ELIMIT, "%d members, more than the limit of %d",
                           n_members, KILN_MAX_MEMBERS);
    for (int i = 0; i < n_members; i++) {
        if (!kiln_member_name_ok (members[i].name))
            return kiln_error (err, KILN_EINVAL, "member name '%.80s' is not valid",
                               members[i].name);
        if (i > 0 && strcmp (members[i - 1].name, members[i].name) >= 0)
            return kiln_error (err, KILN_EINVAL, "members are not sorted by name at '%s'",
                               members[i].name);
        if (members[i].len > KILN_MAX_MEMBER_BYTES)
            return kiln_error (err, KILN_ELIMIT, "member '%s' is larger than %llu bytes",
                               members[i].name, (unsigned long long) KILN_MAX_MEMBER_BYTES);
    }

    s_builder_t b = { 0, err };
    json_t *root = json_object ();
    s_set (&b, root, "format", json_string (S_FORMAT_NAME));
    s_set (&b, root, "format_version", json_integer (m->format_version));
    s_set (&b, root, "graph_digest", json_string (m->graph_digest));
    s_set (&b, root, "action_key", json_string (m->action_key));
    json_t *compiler = json_object ();
    s_set_str (&b, compiler, "id", "compiler.id", m->compiler_id);
    s_set_str (&b, compiler, "version", "compiler.version", m->compiler_version);
    s_set_str (&b, compiler, "args", "compiler.args", m->compiler_args);
    s_set (&b, root, "compiler", compiler);
    s_set_str (&b, root, "target", "target", m->target);
    s_set (&b, root, "runtime_abi", json_integer (m->runtime_abi));
    s_set (&b, root, "inputs", s_encode_ios (&b, "input", m->inputs, m->n_inputs));
    s_set (&b, root, "outputs", s_encode_ios (&b, "output", m->outputs, m->n_outputs));
    //  Only when present, so that a manifest without it is the same bytes
    //  as before the field existed.
    if (m->io_structure)
        s_set_str (&b, root, "io_structure", "io_structure", m->io_structure);
    if (m->n_stages > 0) {
        json_t *pipe = json_object (), *stages = json_array ();
        for (int i = 0; i < m->n_stages; i++) {
            const kiln_stage_info_t *st = &m->stages[i];
            json_t *o = json_object ();
            s_set (&b, o, "first_op", json_integer (st->first_op));
            s_set (&b, o, "ops", json_integer (st->n_ops));
            s_set (&b, o, "flops", json_integer ((json_int_t) st->flops));
            s_set (&b, o, "moved_bytes", json_integer ((json_int_t) st->moved_bytes));
            s_set (&b, o, "cost_ns", json_integer ((json_int_t) st->cost_ns));
            s_set (&b, o, "weights_bytes", json_integer ((json_int_t) st->weights_bytes));
            s_set (&b, o, "handoff_bytes", json_integer ((json_int_t) st->handoff_bytes));
            s_append (&b, stages, o);
        }
        s_set (&b, pipe, "stages", stages);
        s_set (&b, root, "pipeline", pipe);
    }
    json_t *list = json_array ();
    for (int i = 0; i < n_members; i++) {
        json_t *mem = json_object ();
        s_set (&b, mem, "name", json_string (members[i].name));
        s_set (&b, mem, "sha256", json_string (members[i].sha256));
        s_set (&b, mem, "size", json_integer ((json_int_t) members[i].len));
        s_append (&b, list, mem);
    }
    s_set (&b, root, "members", list);

    if (!b.rc) {
        char *text = json_dumps (root, JSON_SORT_KEYS | JSON_COMPACT);
        if (!text)
            b.rc = kiln_error (err, KILN_ENOMEM, "out of memory encoding manifest");
        else if (strlen (text) > KILN_MAX_MANIFEST_BYTES) {
            b.rc = kiln_error (err, KILN_ELIMIT,
                               "manifest.json would be %zu bytes, more than the limit of %u",
                               strlen (text), KILN_MAX_MANIFEST_BYTES);
            free (text);
        }
        else {
            *out = text;
            *len = strlen (text);
        }
    }
    json_decref (root);
    return b.rc;
}

/* --- decoding -------------------------------------------------------- */

/* "manifest.json" or "manifest.json: <where>" for error messages; `where`
 * is NULL for the top-level object. */
static const char *
s_at (char buf[96], const char *where)
{
    if (!where)
        return "manifest.json";
    snprintf (buf, 96, "manifest.json: %s", where);
    return buf;
}

/* Fail unless every key of `obj` is one of `keys` (NULL-terminated). */
static int
s_only_keys (const json_t *obj, const char *where, const char *const *keys,
             kiln_err_t *err)
{
    char at[96];
    const char *key;
    json_t *val;
    json_object_foreach ((json_t *) obj, key, val) {
        (void) val;
        bool known = false;
        for (int i = 0; keys[i]; i++)
            if (strcmp (key, keys[i]) == 0)
                known = true;
        if (!known)
            return kiln_error (err, KILN_EFORMAT, "%s: unknown field '%.64s'",
                               s_at (at, where), key);
    }
    return 0;
}

static const json_t *
s_field (const json_t *obj, const char *where, const char *key, json_type type,
         const char *type_name, kiln_err_t *err)
{
    char at[96];
    const json_t *v = json_object_get (obj, key);
    if (!v) {
        kiln_error (err, KILN_EFORMAT, "%s: missing field '%s'", s_at (at, where), key);
        return NULL;
    }
    if (json_typeof (v) != type) {
        kiln_error (err, KILN_EFORMAT, "%s: field '%s' is not %s",
                    s_at (at, where), key, type_name);
        return NULL;
    }
    return v;
}

static int
s_get_str (const json_t *obj, const char *where, const char *key, char *buf,
           size_t cap, kiln_err_t *err)
{
    char at[96];
    const json_t *v = s_field (obj, where, key, JSON_STRING, "a string", err);
    if (!v)
        return -KILN_EFORMAT;
    size_t n = json_string_length (v);
    if (n >= cap)
        return kiln_error (err, KILN_ELIMIT,
                           "%s: field '%s' is longer than %zu bytes",
                           s_at (at, where), key, cap - 1);
    memcpy (buf, json_string_value (v), n);
    buf[n] = '\0';
    return 0;
}

static int
s_get_int (const json_t *obj, const char *where, const char *key, long long lo,
           long long hi, long long *out, kiln_err_t *err)
{
    char at[96];
    const json_t *v = s_field (obj, where, key, JSON_INTEGER, "an integer", err);
    if (!v)
        return -KILN_EFORMAT;
    long long x = (long long) json_integer_value (v);
    if (x < lo || x > hi)
        return kiln_error (err, KILN_ELIMIT,
                           "%s: field '%s' is %lld, outside %lld..%lld",
                           s_at (at, where), key, x, lo, hi);
    *out = x;
    return 0;
}

static int
s_decode_io (const json_t *obj, const char *where, kiln_io_t *io, kiln_err_t *err)
{
    static const char *const keys[] = { "name", "dtype", "shape", NULL };
    if (!json_is_object (obj))
        return kiln_error (err, KILN_EFORMAT, "manifest.json: %s is not an object", where);
    int rc;
    if ((rc = s_only_keys (obj, where, keys, err))
        || (rc = s_get_str (obj, where, "name", io->name, sizeof io->name, err)))
        return rc;
    char dtype[32];
    if ((rc = s_get_str (obj, where, "dtype", dtype, sizeof dtype, err)))
        return rc;
    io->dtype = kiln_dtype_from_name (dtype);
    if (io->dtype == KILN_DT_UNDEFINED)
        return kiln_error (err, KILN_EFORMAT, "manifest.json: %s '%s': unknown dtype '%s'",
                           where, io->name, dtype);
    const json_t *shape = s_field (obj, where, "shape", JSON_ARRAY, "an array", err);
    if (!shape)
        return -KILN_EFORMAT;
    size_t rank = json_array_size (shape);
    if (rank > KILN_MAX_RANK)
        return kiln_error (err, KILN_ELIMIT, "manifest.json: %s '%s': rank %zu is more than %d",
                           where, io->name, rank, KILN_MAX_RANK);
    io->shape.rank = (int) rank;
    for (size_t d = 0; d < rank; d++) {
        const json_t *dim = json_array_get (shape, d);
        if (!json_is_integer (dim))
            return kiln_error (err, KILN_EFORMAT,
                               "manifest.json: %s '%s': dimension %zu is not an integer",
                               where, io->name, d);
        long long x = (long long) json_integer_value (dim);
        if (x < 0 || x > KILN_MAX_DIM)
            return kiln_error (err, KILN_ELIMIT,
                               "manifest.json: %s '%s': dimension %zu is %lld, outside 0..%lld",
                               where, io->name, d, x, (long long) KILN_MAX_DIM);
        io->shape.dims[d] = x;
    }
    return 0;
}

static int
s_decode_ios (const json_t *root, const char *key, const char *what,
              kiln_io_t **ios, int *n, kiln_err_t *err)
{
    const json_t *arr = s_field (root, NULL, key, JSON_ARRAY, "an array", err);
    if (!arr)
        return -KILN_EFORMAT;
    size_t count = json_array_size (arr);
    if (count > KILN_MAX_GRAPH_IO)
        return kiln_error (err, KILN_ELIMIT, "manifest.json: %zu %s, more than the limit of %d",
                           count, key, KILN_MAX_GRAPH_IO);
    if (count == 0)
        return 0;
    *ios = calloc (count, sizeof **ios);
    if (!*ios)
        return kiln_error (err, KILN_ENOMEM, "out of memory reading manifest %s", key);
    *n = (int) count;
    for (size_t i = 0; i < count; i++) {
        char where[32];
        snprintf (where, sizeof where, "%s %zu", what, i);
        int rc = s_decode_io (json_array_get (arr, i), where, &(*ios)[i], err);
        if (rc)
            return rc;
    }
    return 0;
}

static int
s_decode_members (const json_t *root, kiln_member_t *members, int *n_members,
                  kiln_err_t *err)
{
    static const char *const keys[] = { "name", "sha256", "size", NULL };
    const json_t *arr = s_field (root, NULL, "members", JSON_ARRAY, "an array", err);
    if (!arr)
        return -KILN_EFORMAT;
    size_t count = json_array_size (arr);
    if (count > KILN_MAX_MEMBERS)
        return kiln_error (err, KILN_ELIMIT, "manifest.json: %zu members, more than the limit of %d",
                           count, KILN_MAX_MEMBERS);
    for (size_t i = 0; i < count; i++) {
        const json_t *obj = json_array_get (arr, i);
        char where[32];
        snprintf (where, sizeof where, "member %zu", i);
        if (!json_is_object (obj))
            return kiln_error (err, KILN_EFORMAT, "manifest.json: %s is not an object", where);
        kiln_member_t *m = &members[i];
        memset (m, 0, sizeof *m);
        long long size;
        int rc;
        if ((rc = s_only_keys (obj, where, keys, err))
            || (rc = s_get_str (obj, where, "name", m->name, sizeof m->name, err))
            || (rc = s_get_str (obj, where, "sha256", m->sha256, sizeof m->sha256, err))
            || (rc = s_get_int (obj, where, "size", 0, (long long) KILN_MAX_MEMBER_BYTES,
                                &size, err)))
            return rc;
        if (!kiln_member_name_ok (m->name))
            return kiln_error (err, KILN_EFORMAT,
                               "manifest.json: %s: name '%s' is reserved or not plain",
                               where, m->name);
        if (!kiln_is_digest_hex (m->sha256))
            return kiln_error (err, KILN_EFORMAT,
                               "manifest.json: member '%s': sha256 is not 64 lower-case hex characters",
                               m->name);
        if (i > 0 && strcmp (members[i - 1].name, m->name) >= 0)
            return kiln_error (err, KILN_EFORMAT,
                               "manifest.json: member '%s' is out of order or listed twice",
                               m->name);
        m->len = (size_t) size;
        *n_members = (int) i + 1;
    }
    return 0;
}

/* The optional io_structure: a non-empty string of at most
 * KILN_MAX_IO_STRUCTURE_BYTES (jansson has already refused invalid UTF-8
 * and, without JSON_ALLOW_NUL, a \u0000 escape). */
static int
s_decode_io_structure (const json_t *root, kiln_manifest_t *m, kiln_err_t *err)
{
    if (!json_object_get (root, "io_structure"))
        return 0;
    const json_t *v = s_field (root, NULL, "io_structure", JSON_STRING, "a string", err);
    if (!v)
        return -KILN_EFORMAT;
    size_t n = json_string_length (v);
    if (n > KILN_MAX_IO_STRUCTURE_BYTES)
        return kiln_error (err, KILN_ELIMIT,
                           "manifest.json: field 'io_structure' is longer than %u bytes",
                           KILN_MAX_IO_STRUCTURE_BYTES);
    if (n == 0)
        return kiln_error (err, KILN_EFORMAT, "manifest.json: field 'io_structure' is empty");
    if (!(m->io_structure = strdup (json_string_value (v))))
        return kiln_error (err, KILN_ENOMEM, "out of memory reading manifest io_structure");
    return 0;
}

/* The optional pipeline: {"stages": [{first_op, ops, flops, moved_bytes,
 * cost_ns, weights_bytes, handoff_bytes}, ...]}. */
static int
s_decode_pipeline (const json_t *root, kiln_manifest_t *m, kiln_err_t *err)
{
    static const char *const pipe_keys[] = { "stages", NULL };
    static const char *const stage_keys[] = {
        "first_op", "ops", "flops", "moved_bytes", "cost_ns", "weights_bytes",
        "handoff_bytes", NULL
    };
    if (!json_object_get (root, "pipeline"))
        return 0;
    const json_t *pipe = s_field (root, NULL, "pipeline", JSON_OBJECT, "an object", err);
    if (!pipe)
        return -KILN_EFORMAT;
    int rc = s_only_keys (pipe, "pipeline", pipe_keys, err);
    if (rc)
        return rc;
    const json_t *arr = s_field (pipe, "pipeline", "stages", JSON_ARRAY, "an array", err);
    if (!arr)
        return -KILN_EFORMAT;
    size_t n = json_array_size (arr);
    if (n < 2 || n > KILN_MAX_PIPELINE_STAGES)
        return kiln_error (err, KILN_ELIMIT, "manifest.json: pipeline: %zu stages, "
                           "outside 2..%d", n, KILN_MAX_PIPELINE_STAGES);
    kiln_stage_info_t st[KILN_MAX_PIPELINE_STAGES];
    memset (st, 0, sizeof st);
    for (size_t i = 0; i < n; i++) {
        const json_t *o = json_array_get (arr, i);
        char where[48];
        snprintf (where, sizeof where, "pipeline.stages[%zu]", i);
        if (!json_is_object (o))
            return kiln_error (err, KILN_EFORMAT, "manifest.json: %s is not an object",
                               where);
        long long v[7];
        if ((rc = s_only_keys (o, where, stage_keys, err)))
            return rc;
        for (int k = 0; k < 7; k++)
            if ((rc = s_get_int (o, where, stage_keys[k], 0, S_STAGE_INT_MAX, &v[k],
                                 err)))
                return rc;
        if (v[0] > (1 << 22) || v[1] > (1 << 22))
            return kiln_error (err, KILN_ELIMIT, "manifest.json: %s: more ops than a "
                               "program holds", where);
        st[i] = (kiln_stage_info_t) { (int) v[0], (int) v[1], (uint64_t) v[2],
                                      (uint64_t) v[3], (uint64_t) v[4],
                                      (uint64_t) v[5], (uint64_t) v[6] };
    }
    return kiln_manifest_set_pipeline (m, st, (int) n, err);
}

static int
s_decode (const json_t *root, kiln_manifest_t *m, kiln_member_t *members,
          int *n_members, kiln_err_t *err)
{
    static const char *const keys[] = {
        "format", "format_version", "graph_digest", "action_key", "compiler",
        "target", "runtime_abi", "inputs", "outputs", "members", "io_structure",
        "pipeline", NULL
    };
    static const char *const compiler_keys[] = { "id", "version", "args", NULL };
    if (!json_is_object (root))
        return kiln_error (err, KILN_EFORMAT, "manifest.json is not a JSON object");

    //  The format and its version come first, so that a newer artifact
    //  gets "unsupported version" rather than a complaint about a field.
    char format[32];
    long long version;
    int rc;
    if ((rc = s_get_str (root, NULL, "format", format, sizeof format, err)))
        return rc;
    if (strcmp (format, S_FORMAT_NAME) != 0)
        return kiln_error (err, KILN_EFORMAT, "manifest.json: format is '%s', not '%s'",
                           format, S_FORMAT_NAME);
    const json_t *v = s_field (root, NULL, "format_version", JSON_INTEGER,
                               "an integer", err);
    if (!v)
        return -KILN_EFORMAT;
    version = (long long) json_integer_value (v);
    if (version != KILN_ARTIFACT_FORMAT_VERSION)
        return kiln_error (err, KILN_EUNSUPPORTED,
                           "manifest.json: unsupported artifact format version %lld "
                           "(this kiln reads version %d)",
                           version, KILN_ARTIFACT_FORMAT_VERSION);
    m->format_version = (int) version;

    if ((rc = s_only_keys (root, NULL, keys, err))
        || (rc = s_get_str (root, NULL, "graph_digest", m->graph_digest,
                            sizeof m->graph_digest, err))
        || (rc = s_get_str (root, NULL, "action_key", m->action_key,
                            sizeof m->action_key, err))
        || (rc = s_get_str (root, NULL, "target", m->target, sizeof m->target, err)))
        return rc;
    long long abi;
    if ((rc = s_get_int (root, NULL, "runtime_abi", 1, 1 << 30, &abi, err)))
        return rc;
    m->runtime_abi = (int) abi;

    const json_t *compiler = s_field (root, NULL, "compiler", JSON_OBJECT,
                                      "an object", err);
    if (!compiler)
        return -KILN_EFORMAT;
    if ((rc = s_only_keys (compiler, "compiler", compiler_keys, err))
        || (rc = s_get_str (compiler, "compiler", "id", m->compiler_id,
                            sizeof m->compiler_id, err))
        || (rc = s_get_str (compiler, "compiler", "version", m->compiler_version,
                            sizeof m->compiler_version, err))
        || (rc = s_get_str (compiler, "compiler", "args", m->compiler_args,
                            sizeof m->compiler_args, err)))
        return rc;

    if ((rc = s_decode_ios (root, "inputs", "input", &m->inputs, &m->n_inputs, err))
        || (rc = s_decode_ios (root, "outputs", "output", &m->outputs, &m->n_outputs, err))
        || (rc = s_decode_io_structure (root, m, err))
        || (rc = s_decode_pipeline (root, m, err))
        || (rc = s_decode_members (root, members, n_members, err)))
        return rc;
    if ((rc = kiln_manifest_check (m, err)))
        return kiln_error_prefix (err, "manifest.json");
    return 0;
}

int
kiln_manifest_decode (const char *json, size_t len, kiln_manifest_t *m,
                      kiln_member_t *members, int *n_members, kiln_err_t *err)
{
    *n_members = 0;
    if (len > KILN_MAX_MANIFEST_BYTES)
        return kiln_error (err, KILN_ELIMIT,
                           "manifest.json is %zu bytes, more than the limit of %u",
                           len, KILN_MAX_MANIFEST_BYTES);
    json_error_t jerr;
    json_t *root = json_loadb (json, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return kiln_error (err, KILN_EFORMAT, "manifest.json is not valid JSON: %s (line %d, column %d)",
                           jerr.text, jerr.line, jerr.column);
    kiln_manifest_t parsed;
    memset (&parsed, 0, sizeof parsed);
    int rc = s_decode (root, &parsed, members, n_members, err);
    json_decref (root);

    if (rc == 0) {
        char *canon = NULL;
        size_t canon_len = 0;
        rc = kiln_manifest_encode (&parsed, members, *n_members, &canon, &canon_len, err);
        if (rc == 0 && (canon_len != len || memcmp (canon, json, len) != 0))
            rc = kiln_error (err, KILN_EFORMAT,
                             "manifest.json is not in canonical form "
                             "(compact JSON with sorted keys, members sorted by name)");
        free (canon);
    }
    if (rc) {
        kiln_manifest_release (&parsed);
        *n_members = 0;
        return rc;
    }
    kiln_manifest_release (m);
    *m = parsed;
    return 0;
}
