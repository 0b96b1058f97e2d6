#include "common/kiln_dtype.h"

#include <stdio.h>
#include <string.h>

const char *
kiln_dtype_name (kiln_dtype_t dt)
{
    switch (dt) {
#define X(name, onnx, text, size, descr) case KILN_DT_##name: return text;
        KILN_DTYPES (X)
#undef X
    default: return "undefined";
    }
}

size_t
kiln_dtype_size (kiln_dtype_t dt)
{
    switch (dt) {
#define X(name, onnx, text, size, descr) case KILN_DT_##name: return size;
        KILN_DTYPES (X)
#undef X
    default: return 0;
    }
}

const char *
kiln_dtype_npy_descr (kiln_dtype_t dt)
{
    switch (dt) {
#define X(name, onnx, text, size, descr) case KILN_DT_##name: return descr;
        KILN_DTYPES (X)
#undef X
    default: return NULL;
    }
}

kiln_dtype_t
kiln_dtype_from_name (const char *name)
{
#define X(n, onnx, text, size, descr) \
    if (name && strcmp (name, text) == 0) return KILN_DT_##n;
    KILN_DTYPES (X)
#undef X
    return KILN_DT_UNDEFINED;
}

kiln_dtype_t
kiln_dtype_from_npy_descr (const char *descr)
{
    if (!descr)
        return KILN_DT_UNDEFINED;
#define X(n, onnx, text, size, d) \
    if (strcmp (descr, d) == 0) return KILN_DT_##n;
    KILN_DTYPES (X)
#undef X
    /* numpy writes one-byte types with '|' but accepts '<' too */
    if (strcmp (descr, "<u1") == 0) return KILN_DT_UINT8;
    if (strcmp (descr, "<i1") == 0) return KILN_DT_INT8;
    if (strcmp (descr, "<b1") == 0) return KILN_DT_BOOL;
    /* bfloat16's two raw bytes, as numpy writes a void type */
    if (strcmp (descr, "|V2") == 0) return KILN_DT_BFLOAT16;
    return KILN_DT_UNDEFINED;
}

bool
kiln_dtype_valid (int value)
{
    switch (value) {
#define X(name, onnx, text, size, descr) case onnx: return true;
        KILN_DTYPES (X)
#undef X
    default: return false;
    }
}

bool
kiln_dtype_is_half (kiln_dtype_t dt)
{
    return dt == KILN_DT_FLOAT16 || dt == KILN_DT_BFLOAT16;
}

int
kiln_shape_numel (const kiln_shape_t *shape, const char *what,
                  int64_t *numel, kiln_err_t *err)
{
    if (shape->rank < 0 || shape->rank > KILN_MAX_RANK)
        return kiln_error (err, KILN_ELIMIT, "tensor '%s': rank %d is outside 0..%d",
                           what, shape->rank, KILN_MAX_RANK);
    int64_t n = 1;
    for (int i = 0; i < shape->rank; i++) {
        int64_t d = shape->dims[i];
        if (d < 0 || d > KILN_MAX_DIM)
            return kiln_error (err, KILN_ELIMIT,
                               "tensor '%s': dimension %d is %lld, outside 0..%lld",
                               what, i, (long long) d, (long long) KILN_MAX_DIM);
        if (d != 0 && n > KILN_MAX_TENSOR_ELEMS / d)
            return kiln_error (err, KILN_ELIMIT,
                               "tensor '%s': more than %lld elements", what,
                               (long long) KILN_MAX_TENSOR_ELEMS);
        n *= d;
    }
    *numel = n;
    return 0;
}

int
kiln_shape_bytes (const kiln_shape_t *shape, kiln_dtype_t dt, const char *what,
                  uint64_t *bytes, kiln_err_t *err)
{
    int64_t n;
    int rc = kiln_shape_numel (shape, what, &n, err);
    if (rc)
        return rc;
    size_t es = kiln_dtype_size (dt);
    if (es == 0)
        return kiln_error (err, KILN_EUNSUPPORTED, "tensor '%s': unknown dtype %d",
                           what, (int) dt);
    *bytes = (uint64_t) n * es;
    return 0;
}

bool
kiln_shape_equal (const kiln_shape_t *a, const kiln_shape_t *b)
{
    if (a->rank != b->rank)
        return false;
    for (int i = 0; i < a->rank; i++)
        if (a->dims[i] != b->dims[i])
            return false;
    return true;
}

char *
kiln_shape_str (const kiln_shape_t *shape, char *buf, size_t size)
{
    size_t used = 0;
    if (size == 0)
        return buf;
    buf[0] = '\0';
    if (shape->rank < 0) {
        snprintf (buf, size, "[?]");
        return buf;
    }
    used += snprintf (buf + used, size - used, "[");
    for (int i = 0; i < shape->rank && used < size; i++)
        used += snprintf (buf + used, size - used, "%s%lld", i ? ", " : "",
                          (long long) shape->dims[i]);
    if (used < size)
        snprintf (buf + used, size - used, "]");
    return buf;
}
