#include "serve/kiln_serve_v2.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kiln_half.h"
#include "serve/kiln_serve_buf.h"

/* Fields a request may have; anything else is refused (a typo such as
 * "input" must not be silently ignored). */
static const char *const s_request_fields[] = { "id", "parameters", "inputs", "outputs", NULL };
static const char *const s_input_fields[] = { "name", "shape", "datatype", "parameters", "data",
                                              NULL };
static const char *const s_output_fields[] = { "name", "parameters", NULL };

/* JSON values a request may hold beyond its tensors' elements. */
#define S_VALUES_SLACK 1024

const char *
kiln_serve_v2_dtype_name (kiln_dtype_t dt)
{
    switch (dt) {
#define S_CASE(kiln, v2) case KILN_DT_##kiln: return v2;
    KILN_SERVE_V2_DTYPES (S_CASE)
#undef S_CASE
    default:
        return NULL;
    }
}

kiln_dtype_t
kiln_serve_v2_dtype_parse (const char *name)
{
    static const struct {
        kiln_dtype_t dt;
        const char *name;
    } table[] = {
#define S_ROW(kiln, v2) { KILN_DT_##kiln, v2 },
        KILN_SERVE_V2_DTYPES (S_ROW)
#undef S_ROW
    };
    for (size_t i = 0; name && i < sizeof table / sizeof table[0]; i++)
        if (strcmp (table[i].name, name) == 0)
            return table[i].dt;
    return KILN_DT_UNDEFINED;
}

/* The v2 name, or kiln's own for a dtype v2 has no name for (such a
 * tensor can be described, never sent). */
static const char *
s_dtype_label (kiln_dtype_t dt)
{
    const char *name = kiln_serve_v2_dtype_name (dt);
    return name ? name : kiln_dtype_name (dt);
}

/* --- decoding a request ----------------------------------------------- */

static char *
s_shape_str (const kiln_serve_iface_t *iface, const kiln_serve_io_t *io, char *buf,
             size_t size)
{
    char sh[200];
    kiln_shape_str (&io->shape, sh, sizeof sh);
    if (iface->compiled_batch > 0 && iface->max_rows > 1) {
        const char *rest = strpbrk (sh, ",]");
        snprintf (buf, size, "[N%s with N 1..%lld", rest ? rest : "]",
                  (long long) iface->max_rows);
    }
    else
        snprintf (buf, size, "%s", sh);
    return buf;
}

static int
s_unknown_fields (const json_t *obj, const char *const *allowed, const char *what,
                  kiln_err_t *err)
{
    const char *key;
    json_t *value;
    json_object_foreach ((json_t *) obj, key, value) {
        bool ok = false;
        for (int i = 0; allowed[i] && !ok; i++)
            ok = strcmp (key, allowed[i]) == 0;
        if (!ok)
            return kiln_error (err, KILN_EFORMAT, "%s has an unknown field '%.64s'", what, key);
    }
    return 0;
}

/* The shape a request gives for input `io`, against the interface; sets
 * *rows to its dimension 0 (1 for an unbatched model). */
static int
s_check_shape (const kiln_serve_iface_t *iface, const kiln_serve_io_t *io,
               const json_t *shape, int64_t *rows, kiln_err_t *err)
{
    char want[256];
    if (!json_is_array (shape))
        return kiln_error (err, KILN_EFORMAT, "input '%s': \"shape\" must be an array of "
                           "integers", io->name);
    kiln_shape_t got = { .rank = (int) json_array_size (shape) };
    if (json_array_size (shape) > KILN_MAX_RANK)
        return kiln_error (err, KILN_ESHAPE, "input '%s': shape has %zu dimensions, the model "
                           "takes %s", io->name, json_array_size (shape),
                           s_shape_str (iface, io, want, sizeof want));
    for (int d = 0; d < got.rank; d++) {
        const json_t *v = json_array_get (shape, (size_t) d);
        if (!json_is_integer (v) || json_integer_value (v) < 0
            || json_integer_value (v) > KILN_MAX_DIM)
            return kiln_error (err, KILN_EFORMAT, "input '%s': \"shape\" element %d is not a "
                               "dimension (an integer 0..%lld)", io->name, d,
                               (long long) KILN_MAX_DIM);
        got.dims[d] = json_integer_value (v);
    }
    bool batched = iface->compiled_batch > 0;
    bool ok = got.rank == io->shape.rank;
    for (int d = batched ? 1 : 0; ok && d < got.rank; d++)
        ok = got.dims[d] == io->shape.dims[d];
    if (ok && batched)
        ok = got.dims[0] >= 1 && got.dims[0] <= iface->max_rows;
    if (!ok) {
        char sh[200];
        return kiln_error (err, KILN_ESHAPE, "input '%s': shape %s, the model takes %s",
                           io->name, kiln_shape_str (&got, sh, sizeof sh),
                           s_shape_str (iface, io, want, sizeof want));
    }
    *rows = batched ? got.dims[0] : 1;
    return 0;
}

/* Flattening one input's "data" (flat or nested) into its buffer. */
typedef struct {
    const kiln_serve_io_t *io;
    uint8_t *dst;
    int64_t want;                   /* elements the shape has */
    int64_t n;                      /* written so far */
} s_fill_t;

static int
s_put (s_fill_t *f, const json_t *v, kiln_err_t *err)
{
    const kiln_serve_io_t *io = f->io;
    uint8_t *p = f->dst + (size_t) f->n * kiln_dtype_size (io->dtype);
    long long lo = 0, hi = 0;
    switch (io->dtype) {
    case KILN_DT_FLOAT32:
    case KILN_DT_FLOAT64:
    case KILN_DT_FLOAT16:
    case KILN_DT_BFLOAT16:
        if (!json_is_number (v))
            return kiln_error (err, KILN_EFORMAT, "input '%s': element %lld is not a number",
                               io->name, (long long) f->n);
        if (io->dtype == KILN_DT_FLOAT64) {
            double x = json_number_value (v);
            memcpy (p, &x, sizeof x);
        }
        else if (io->dtype == KILN_DT_FLOAT32) {
            float x = (float) json_number_value (v);
            memcpy (p, &x, sizeof x);
        }
        else {
            /* Rounded to the 2-byte type as torch rounds (kiln_half.h). */
            float w = (float) json_number_value (v);
            uint16_t x = io->dtype == KILN_DT_FLOAT16 ? kiln_f32_to_f16 (w) : kiln_f32_to_bf16 (w);
            memcpy (p, &x, sizeof x);
        }
        return 0;
    case KILN_DT_BOOL:
        if (!json_is_boolean (v))
            return kiln_error (err, KILN_EFORMAT, "input '%s': element %lld is not true or "
                               "false", io->name, (long long) f->n);
        *p = json_is_true (v) ? 1 : 0;
        return 0;
    case KILN_DT_INT64: lo = INT64_MIN; hi = INT64_MAX; break;
    case KILN_DT_INT32: lo = INT32_MIN; hi = INT32_MAX; break;
    case KILN_DT_INT8:  lo = INT8_MIN;  hi = INT8_MAX;  break;
    case KILN_DT_UINT8: lo = 0;         hi = UINT8_MAX; break;
    default:
        return kiln_error (err, KILN_EUNSUPPORTED, "input '%s': %s has no v2 datatype",
                           io->name, kiln_dtype_name (io->dtype));
    }
    if (!json_is_integer (v) || json_integer_value (v) < lo || json_integer_value (v) > hi)
        return kiln_error (err, KILN_EFORMAT, "input '%s': element %lld is not an integer in "
                           "%lld..%lld", io->name, (long long) f->n, lo, hi);
    long long x = json_integer_value (v);
    if (io->dtype == KILN_DT_INT64) {
        int64_t y = (int64_t) x;
        memcpy (p, &y, sizeof y);
    }
    else if (io->dtype == KILN_DT_INT32) {
        int32_t y = (int32_t) x;
        memcpy (p, &y, sizeof y);
    }
    else if (io->dtype == KILN_DT_INT8)
        *(int8_t *) p = (int8_t) x;
    else
        *p = (uint8_t) x;
    return 0;
}

static int
s_fill (s_fill_t *f, const json_t *v, int depth, kiln_err_t *err)
{
    if (json_is_array (v)) {
        if (depth >= KILN_MAX_RANK)
            return kiln_error (err, KILN_EFORMAT, "input '%s': \"data\" nests deeper than %d "
                               "arrays", f->io->name, KILN_MAX_RANK);
        size_t i;
        json_t *e;
        json_array_foreach ((json_t *) v, i, e) {
            int rc = s_fill (f, e, depth + 1, err);
            if (rc)
                return rc;
        }
        return 0;
    }
    if (depth == 0)
        return kiln_error (err, KILN_EFORMAT, "input '%s': \"data\" must be an array",
                           f->io->name);
    if (f->n >= f->want)
        return kiln_error (err, KILN_ESHAPE, "input '%s': \"data\" holds more than the %lld "
                           "elements of its shape", f->io->name, (long long) f->want);
    int rc = s_put (f, v, err);
    if (rc == 0)
        f->n++;
    return rc;
}

/* What the first pass learns about one input of the request. */
typedef struct {
    int index;                      /* the model's input */
    const json_t *data;             /* JSON data, or NULL when binary */
    int64_t binary_size;            /* bytes, when binary */
} s_input_t;

static int
s_binary_param (const json_t *params, const char *key, const char *what, bool *value,
                kiln_err_t *err)
{
    const json_t *v = params ? json_object_get (params, key) : NULL;
    if (!v)
        return 0;
    if (!json_is_boolean (v))
        return kiln_error (err, KILN_EFORMAT, "%s: parameter \"%s\" must be true or false",
                           what, key);
    *value = json_is_true (v);
    return 0;
}

static int
s_decode_outputs (const kiln_serve_iface_t *iface, const json_t *root,
                  kiln_serve_v2_request_t *req, kiln_err_t *err)
{
    bool all_binary = false;
    int rc = s_binary_param (json_object_get (root, "parameters"), "binary_data_output",
                             "the request", &all_binary, err);
    if (rc)
        return rc;
    const json_t *outputs = json_object_get (root, "outputs");
    for (int o = 0; o < iface->n_outputs; o++) {
        req->want[o] = outputs == NULL;
        req->binary[o] = all_binary;
    }
    if (!outputs)
        return 0;
    if (!json_is_array (outputs))
        return kiln_error (err, KILN_EFORMAT, "\"outputs\" must be an array");
    size_t i;
    json_t *out;
    json_array_foreach ((json_t *) outputs, i, out) {
        const json_t *name = json_object_get (out, "name");
        if (!json_is_object (out) || !json_is_string (name))
            return kiln_error (err, KILN_EFORMAT, "\"outputs\" element %zu must be an object "
                               "with a \"name\"", i);
        if ((rc = s_unknown_fields (out, s_output_fields, "an output", err)))
            return rc;
        int o = -1;
        for (int k = 0; k < iface->n_outputs && o < 0; k++)
            if (strcmp (iface->outputs[k].name, json_string_value (name)) == 0)
                o = k;
        if (o < 0)
            return kiln_error (err, KILN_EFORMAT, "the model has no output '%.80s'",
                               json_string_value (name));
        if (req->want[o])
            return kiln_error (err, KILN_EFORMAT, "output '%s' is asked for twice",
                               iface->outputs[o].name);
        req->want[o] = true;
        const json_t *params = json_object_get (out, "parameters");
        if (params && !json_is_object (params))
            return kiln_error (err, KILN_EFORMAT, "output '%s': \"parameters\" must be an "
                               "object", iface->outputs[o].name);
        if ((rc = s_binary_param (params, "binary_data", "an output", &req->binary[o], err)))
            return rc;
    }
    return 0;
}

/* One element of "inputs": name, datatype and shape checked; *rows set. */
static int
s_decode_input (const kiln_serve_iface_t *iface, const json_t *in, size_t pos, s_input_t *seen,
                int n_seen, s_input_t *out, int64_t *rows, kiln_err_t *err)
{
    const json_t *name = json_object_get (in, "name");
    if (!json_is_object (in) || !json_is_string (name))
        return kiln_error (err, KILN_EFORMAT, "\"inputs\" element %zu must be an object with "
                           "a \"name\"", pos);
    int rc = s_unknown_fields (in, s_input_fields, "an input", err);
    if (rc)
        return rc;
    int idx = -1;
    for (int k = 0; k < iface->n_inputs && idx < 0; k++)
        if (strcmp (iface->inputs[k].name, json_string_value (name)) == 0)
            idx = k;
    if (idx < 0) {
        char names[512] = "";
        size_t used = 0;
        for (int k = 0; k < iface->n_inputs && used < sizeof names; k++)
            used += (size_t) snprintf (names + used, sizeof names - used, "%s'%s'",
                                       k ? ", " : "", iface->inputs[k].name);
        return kiln_error (err, KILN_EFORMAT, "the model has no input '%.80s' (its inputs: %s)",
                           json_string_value (name), names);
    }
    const kiln_serve_io_t *io = &iface->inputs[idx];
    for (int k = 0; k < n_seen; k++)
        if (seen[k].index == idx)
            return kiln_error (err, KILN_EFORMAT, "input '%s' is given twice", io->name);
    const json_t *dt = json_object_get (in, "datatype");
    if (!json_is_string (dt))
        return kiln_error (err, KILN_EFORMAT, "input '%s': \"datatype\" is missing", io->name);
    kiln_dtype_t got = kiln_serve_v2_dtype_parse (json_string_value (dt));
    if (got != io->dtype)
        return kiln_error (err, KILN_ESHAPE, "input '%s': datatype %.32s, the model takes %s",
                           io->name, json_string_value (dt), s_dtype_label (io->dtype));
    if ((rc = s_check_shape (iface, io, json_object_get (in, "shape"), rows, err)))
        return rc;
    out->index = idx;
    out->data = json_object_get (in, "data");
    out->binary_size = -1;
    const json_t *params = json_object_get (in, "parameters");
    if (params && !json_is_object (params))
        return kiln_error (err, KILN_EFORMAT, "input '%s': \"parameters\" must be an object",
                           io->name);
    const json_t *bsize = params ? json_object_get (params, "binary_data_size") : NULL;
    if (bsize) {
        if (!json_is_integer (bsize) || json_integer_value (bsize) < 0)
            return kiln_error (err, KILN_EFORMAT, "input '%s': \"binary_data_size\" must be a "
                               "byte count", io->name);
        if (out->data)
            return kiln_error (err, KILN_EFORMAT, "input '%s' has both \"data\" and "
                               "\"binary_data_size\"", io->name);
        out->binary_size = json_integer_value (bsize);
        out->data = NULL;
    }
    else if (!out->data)
        return kiln_error (err, KILN_EFORMAT, "input '%s': \"data\" is missing", io->name);
    return 0;
}

/* The comma count bounds the number of JSON values, and so what the
 * parser allocates, before it runs. */
static int
s_precheck (const kiln_serve_iface_t *iface, const uint8_t *json, size_t len,
            kiln_err_t *err)
{
    uint64_t values = S_VALUES_SLACK, commas = 0;
    for (int i = 0; i < iface->n_inputs; i++)
        values += (uint64_t) iface->max_rows * (uint64_t) iface->inputs[i].row_elems;
    for (const uint8_t *p = json, *end = json + len;
         (p = memchr (p, ',', (size_t) (end - p))) != NULL; p++)
        commas++;
    if (commas > values)
        return kiln_error (err, KILN_ELIMIT, "the request holds more than %llu JSON values, "
                           "more than the model's inputs take", (unsigned long long) values);
    return 0;
}

int
kiln_serve_v2_decode_infer (const kiln_serve_iface_t *iface, const uint8_t *body,
                            size_t len, size_t json_len, kiln_serve_v2_request_t *req,
                            kiln_err_t *err)
{
    memset (req, 0, sizeof *req);
    req->n_outputs = iface->n_outputs;
    req->want = calloc ((size_t) iface->n_outputs + 1, sizeof *req->want);
    req->binary = calloc ((size_t) iface->n_outputs + 1, sizeof *req->binary);
    s_input_t *inputs = calloc ((size_t) iface->n_inputs + 1, sizeof *inputs);
    json_t *root = NULL;
    int rc = 0, n = 0;
    int64_t rows = -1;
    if (!req->want || !req->binary || !inputs) {
        rc = kiln_error (err, KILN_ENOMEM, "out of memory");
        goto done;
    }
    if (json_len > len || json_len == 0) {
        rc = kiln_error (err, KILN_EFORMAT, "the JSON header is %zu bytes of a %zu-byte body",
                         json_len, len);
        goto done;
    }
    if ((rc = s_precheck (iface, body, json_len, err)))
        goto done;
    json_error_t je;
    root = json_loadb ((const char *) body, json_len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        rc = kiln_error (err, KILN_EFORMAT, "malformed JSON at line %d, column %d: %s",
                         je.line, je.column, je.text);
        goto done;
    }
    if (!json_is_object (root)) {
        rc = kiln_error (err, KILN_EFORMAT, "the request is not a JSON object");
        goto done;
    }
    if ((rc = s_unknown_fields (root, s_request_fields, "the request", err)))
        goto done;
    const json_t *id = json_object_get (root, "id");
    if (id) {
        if (!json_is_string (id) || json_string_length (id) > KILN_SERVE_MAX_REQUEST_ID) {
            rc = kiln_error (err, KILN_EFORMAT, "\"id\" must be a string of at most %d bytes",
                             KILN_SERVE_MAX_REQUEST_ID);
            goto done;
        }
        snprintf (req->id, sizeof req->id, "%s", json_string_value (id));
        req->has_id = true;
    }
    const json_t *params = json_object_get (root, "parameters");
    if (params && !json_is_object (params)) {
        rc = kiln_error (err, KILN_EFORMAT, "\"parameters\" must be an object");
        goto done;
    }
    const json_t *ins = json_object_get (root, "inputs");
    if (!json_is_array (ins)) {
        rc = kiln_error (err, KILN_EFORMAT, "\"inputs\" must be an array");
        goto done;
    }
    size_t pos;
    json_t *in;
    json_array_foreach ((json_t *) ins, pos, in) {
        if (n == iface->n_inputs) {
            rc = kiln_error (err, KILN_EFORMAT, "\"inputs\" has %zu elements, the model takes "
                             "%d inputs", json_array_size (ins), iface->n_inputs);
            goto done;
        }
        int64_t r = 0;
        if ((rc = s_decode_input (iface, in, pos, inputs, n, &inputs[n], &r, err)))
            goto done;
        if (rows >= 0 && r != rows) {
            rc = kiln_error (err, KILN_ESHAPE, "input '%s' has %lld in dimension 0, input "
                             "'%s' %lld: every input must have the same batch",
                             iface->inputs[inputs[n].index].name, (long long) r,
                             iface->inputs[inputs[0].index].name, (long long) rows);
            goto done;
        }
        rows = r;
        n++;
    }
    if (n < iface->n_inputs) {
        for (int k = 0; k < iface->n_inputs; k++) {
            bool given = false;
            for (int j = 0; j < n && !given; j++)
                given = inputs[j].index == k;
            if (!given) {
                rc = kiln_error (err, KILN_EFORMAT, "input '%s' is missing",
                                 iface->inputs[k].name);
                goto done;
            }
        }
    }
    if ((rc = s_decode_outputs (iface, root, req, err)))
        goto done;

    /* Everything is checked: now the buffers, of the size the shapes say. */
    if (!(req->job = kiln_serve_job_new (iface, rows < 1 ? 1 : rows, err))) {
        rc = -err->code;
        goto done;
    }
    const uint8_t *bin = body + json_len;
    size_t bin_left = len - json_len;
    for (int j = 0; j < n; j++) {
        const kiln_serve_io_t *io = &iface->inputs[inputs[j].index];
        uint64_t bytes = io->row_bytes * (uint64_t) req->job->rows;
        uint8_t *dst = req->job->inputs[inputs[j].index];
        if (inputs[j].binary_size >= 0) {
            if ((uint64_t) inputs[j].binary_size != bytes) {
                rc = kiln_error (err, KILN_ESHAPE, "input '%s': %lld bytes of binary data, its "
                                 "shape has %llu", io->name,
                                 (long long) inputs[j].binary_size, (unsigned long long) bytes);
                goto done;
            }
            if (bytes > bin_left) {
                rc = kiln_error (err, KILN_EFORMAT, "input '%s': the body ends %llu bytes into "
                                 "its %llu bytes of binary data", io->name,
                                 (unsigned long long) bin_left, (unsigned long long) bytes);
                goto done;
            }
            memcpy (dst, bin, (size_t) bytes);
            bin += bytes;
            bin_left -= (size_t) bytes;
            continue;
        }
        s_fill_t f = { .io = io, .dst = dst, .want = io->row_elems * req->job->rows };
        if ((rc = s_fill (&f, inputs[j].data, 0, err)))
            goto done;
        if (f.n != f.want) {
            rc = kiln_error (err, KILN_ESHAPE, "input '%s': \"data\" holds %lld elements, its "
                             "shape %lld", io->name, (long long) f.n, (long long) f.want);
            goto done;
        }
    }
    if (bin_left)
        rc = kiln_error (err, KILN_EFORMAT, "%zu bytes of binary data follow the inputs that "
                         "no input claims", bin_left);
done:
    if (rc)
        kiln_serve_job_destroy (&req->job);
    json_decref (root);
    free (inputs);
    return rc;
}

void
kiln_serve_v2_request_release (kiln_serve_v2_request_t *req)
{
    kiln_serve_job_destroy (&req->job);
    free (req->want);
    free (req->binary);
    memset (req, 0, sizeof *req);
}

/* --- encoding a response ---------------------------------------------- */

static void
s_put_double (kiln_serve_buf_t *b, double x, bool single)
{
    if (!isfinite (x))
        kiln_serve_buf_str (b, "null");     /* JSON has no NaN or infinity */
    else
        kiln_serve_buf_printf (b, single ? "%.9g" : "%.17g", x);
}

static void
s_put_data (kiln_serve_buf_t *b, const kiln_serve_io_t *io, const uint8_t *p, int64_t n)
{
    kiln_serve_buf_reserve (b, (size_t) n * 12 + 2);
    kiln_serve_buf_str (b, "[");
    for (int64_t i = 0; i < n; i++) {
        if (i)
            kiln_serve_buf_str (b, ",");
        switch (io->dtype) {
        case KILN_DT_FLOAT32: {
            float x;
            memcpy (&x, p + i * 4, sizeof x);
            s_put_double (b, x, true);
            break;
        }
        case KILN_DT_FLOAT64: {
            double x;
            memcpy (&x, p + i * 8, sizeof x);
            s_put_double (b, x, false);
            break;
        }
        case KILN_DT_FLOAT16:
        case KILN_DT_BFLOAT16: {
            uint16_t x;
            memcpy (&x, p + i * 2, sizeof x);
            s_put_double (b, io->dtype == KILN_DT_FLOAT16 ? kiln_f16_to_f32 (x)
                                                          : kiln_bf16_to_f32 (x), true);
            break;
        }
        case KILN_DT_INT64: {
            int64_t x;
            memcpy (&x, p + i * 8, sizeof x);
            kiln_serve_buf_printf (b, "%lld", (long long) x);
            break;
        }
        case KILN_DT_INT32: {
            int32_t x;
            memcpy (&x, p + i * 4, sizeof x);
            kiln_serve_buf_printf (b, "%d", x);
            break;
        }
        case KILN_DT_INT8:
            kiln_serve_buf_printf (b, "%d", ((const int8_t *) p)[i]);
            break;
        case KILN_DT_UINT8:
            kiln_serve_buf_printf (b, "%u", p[i]);
            break;
        case KILN_DT_BOOL:
            kiln_serve_buf_str (b, p[i] ? "true" : "false");
            break;
        default:
            kiln_serve_buf_str (b, "null");
        }
    }
    kiln_serve_buf_str (b, "]");
}

int
kiln_serve_v2_encode_infer (const kiln_serve_iface_t *iface,
                            const kiln_serve_v2_request_t *req, const char *model,
                            uint64_t version, uint8_t **out, size_t *len, size_t *json_len,
                            kiln_err_t *err)
{
    const kiln_serve_job_t *job = req->job;
    bool batched = iface->compiled_batch > 0;
    kiln_serve_buf_t b;
    kiln_serve_buf_init (&b, (size_t) (KILN_SERVE_MAX_RESPONSE - 1), "the response");
    kiln_serve_buf_str (&b, "{\"model_name\":");
    kiln_serve_buf_json_str (&b, model);
    kiln_serve_buf_printf (&b, ",\"model_version\":\"%llu\"", (unsigned long long) version);
    if (req->has_id) {
        kiln_serve_buf_str (&b, ",\"id\":");
        kiln_serve_buf_json_str (&b, req->id);
    }
    kiln_serve_buf_str (&b, ",\"outputs\":[");
    bool first = true;
    for (int o = 0; o < iface->n_outputs; o++) {
        if (!req->want[o])
            continue;
        const kiln_serve_io_t *io = &iface->outputs[o];
        kiln_shape_t shape = io->shape;
        if (batched)
            shape.dims[0] = job->rows;
        kiln_serve_buf_str (&b, first ? "{\"name\":" : ",{\"name\":");
        first = false;
        kiln_serve_buf_json_str (&b, io->name);
        kiln_serve_buf_printf (&b, ",\"datatype\":\"%s\",\"shape\":[",
                               s_dtype_label (io->dtype));
        for (int d = 0; d < shape.rank; d++)
            kiln_serve_buf_printf (&b, "%s%lld", d ? "," : "", (long long) shape.dims[d]);
        kiln_serve_buf_str (&b, "]");
        if (req->binary[o])
            kiln_serve_buf_printf (&b, ",\"parameters\":{\"binary_data_size\":%llu}}",
                                   (unsigned long long) (io->row_bytes * (uint64_t) job->rows));
        else {
            kiln_serve_buf_str (&b, ",\"data\":");
            s_put_data (&b, io, job->outputs[o], io->row_elems * job->rows);
            kiln_serve_buf_str (&b, "}");
        }
    }
    kiln_serve_buf_str (&b, "]}");
    *json_len = b.len;
    for (int o = 0; o < iface->n_outputs; o++)
        if (req->want[o] && req->binary[o])
            kiln_serve_buf_add (&b, job->outputs[o],
                                (size_t) (iface->outputs[o].row_bytes * (uint64_t) job->rows));
    int rc = kiln_serve_buf_check (&b, err);
    if (rc == 0)
        *out = (uint8_t *) kiln_serve_buf_take (&b, len);
    kiln_serve_buf_release (&b);
    return rc;
}

/* --- the other documents ---------------------------------------------- */

static int
s_dump (json_t *root, char **out, size_t *len, kiln_err_t *err)
{
    if (!root)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    *out = json_dumps (root, JSON_COMPACT);
    json_decref (root);
    if (!*out)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    *len = strlen (*out);
    return 0;
}

char *
kiln_serve_v2_error (const char *msg, size_t *len)
{
    char *out = NULL;
    kiln_err_t err = { 0 };
    s_dump (json_pack ("{s:s}", "error", msg), &out, len, &err);
    return out;
}

static json_t *
s_tensors (const kiln_serve_iface_t *iface, bool outputs)
{
    json_t *arr = json_array ();
    int n = outputs ? iface->n_outputs : iface->n_inputs;
    for (int i = 0; arr && i < n; i++) {
        const kiln_serve_io_t *io = outputs ? &iface->outputs[i] : &iface->inputs[i];
        json_t *shape = json_array ();
        for (int d = 0; shape && d < io->shape.rank; d++)
            json_array_append_new (shape, json_integer (
                d == 0 && iface->compiled_batch > 0 && iface->max_rows > 1 ? -1
                                                                          : io->shape.dims[d]));
        json_array_append_new (arr, json_pack ("{s:s,s:s,s:o}", "name", io->name, "datatype",
                                               s_dtype_label (io->dtype), "shape", shape));
    }
    return arr;
}

static json_t *
s_time (int64_t t)
{
    char text[KILN_RELEASE_TIME_LEN];
    kiln_release_format_time (t, text);
    return json_string (text);
}

static json_t *
s_refusal (const kiln_serve_model_status_t *st)
{
    if (!st->has_refusal)
        return json_null ();
    const kiln_serve_refusal_info_t *r = &st->refusal;
    return json_pack ("{s:s,s:s,s:o,s:o,s:o}", "reason", kiln_serve_refusal_label (r->reason),
                      "message", r->message, "seq",
                      r->seq ? json_integer ((json_int_t) r->seq) : json_null (), "artifact",
                      r->artifact[0] ? json_string (r->artifact) : json_null (), "at",
                      s_time (r->at));
}

int
kiln_serve_v2_model_metadata (const kiln_serve_model_status_t *st, char **out, size_t *len,
                              kiln_err_t *err)
{
    json_t *kiln = json_pack ("{s:s,s:I,s:o}", "state", st->version ? "READY" : "UNAVAILABLE",
                              "refusals", (json_int_t) st->refusals, "last_refusal",
                              s_refusal (st));
    json_t *root = NULL;
    if (!kiln)
        return s_dump (NULL, out, len, err);
    if (!st->version) {
        root = json_pack ("{s:s,s:[],s:s,s:[],s:[],s:o}", "name", st->name, "versions",
                          "platform", "kiln", "inputs", "outputs", "kiln", kiln);
        return s_dump (root, out, len, err);
    }
    const kiln_serve_iface_t *iface = kiln_serve_version_iface (st->version);
    const kiln_release_t *rec = &st->record;
    json_t *cores = json_array ();
    for (int r = 0; cores && r < st->n_replicas; r++)
        json_array_append_new (cores, json_integer (st->cores[r]));
    json_object_update_new (kiln, json_pack (
        "{s:s,s:I,s:s,s:i,s:o,s:o,s:s,s:o,s:i,s:o,s:I,s:I}",
        "digest", rec->artifact, "seq", (json_int_t) rec->seq, "target", rec->target,
        "runtime_abi", rec->runtime_abi, "issued_at", s_time (rec->issued_at), "expires_at",
        s_time (rec->expires_at), "release_key", rec->key_id, "loaded_at",
        s_time (st->loaded_at), "replicas", st->n_replicas, "cores", cores,
        "compiled_batch", (json_int_t) iface->compiled_batch, "max_batch",
        (json_int_t) iface->max_rows));
    char version[32];
    snprintf (version, sizeof version, "%llu", (unsigned long long) rec->seq);
    root = json_pack ("{s:s,s:[s],s:s,s:o,s:o,s:o}", "name", st->name, "versions", version,
                      "platform", "kiln", "inputs", s_tensors (iface, false), "outputs",
                      s_tensors (iface, true), "kiln", kiln);
    return s_dump (root, out, len, err);
}

int
kiln_serve_v2_repository_index (kiln_serve_repo_t *repo, char **out, size_t *len,
                                kiln_err_t *err)
{
    char (*names)[KILN_MAX_MODEL_NAME + 1] = calloc (KILN_SERVE_MAX_MODELS, sizeof *names);
    if (!names)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    int n = kiln_serve_repo_models (repo, names, KILN_SERVE_MAX_MODELS);
    json_t *arr = json_array ();
    for (int i = 0; arr && i < n; i++) {
        kiln_serve_model_status_t st;
        if (kiln_serve_repo_status (repo, names[i], &st, NULL) != 0)
            continue;
        json_t *entry = json_pack ("{s:s,s:s}", "name", st.name, "state",
                                   st.version ? "READY" : "UNAVAILABLE");
        if (entry && st.version) {
            char version[32];
            snprintf (version, sizeof version, "%llu", (unsigned long long) st.record.seq);
            json_object_set_new (entry, "version", json_string (version));
        }
        if (entry && !st.version && st.has_refusal)
            json_object_set_new (entry, "reason", json_string (st.refusal.message));
        json_array_append_new (arr, entry);
        kiln_serve_model_status_release (&st);
    }
    free (names);
    return s_dump (arr, out, len, err);
}

int
kiln_serve_v2_server_metadata (char **out, size_t *len, kiln_err_t *err)
{
    return s_dump (json_pack ("{s:s,s:s,s:[s,s]}", "name", KILN_SERVE_NAME, "version",
                              KILN_SERVE_VERSION, "extensions", "binary_tensor_data",
                              "model_repository"), out, len, err);
}
