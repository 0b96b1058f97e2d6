/*
 * kiln_dtype — element types and fixed shapes, shared by the graph IR,
 * the artifact manifest and the runtime.
 *
 * The numeric values are ONNX's TensorProto.DataType values so that the
 * importer maps them one to one.  numpy has no bfloat16: its .npy descr
 * is ml_dtypes' "<V2" (two raw bytes, which numpy reads back as void and
 * ml_dtypes as bfloat16), and numpy's own "|V2" reads as bfloat16 too.
 * The 2-byte float types and their conversions are common/kiln_half.h.  A shape has a fixed rank and fixed
 * dimensions: kiln compiles for fixed shapes, as the trace APIs do.
 */
#ifndef KILN_DTYPE_H
#define KILN_DTYPE_H

#include <stdint.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/kiln_error.h"
#include "common/kiln_limits.h"

/*  name      onnx  text       size  numpy descr */
#define KILN_DTYPES(X)                          \
    X (FLOAT32, 1,  "float32", 4, "<f4")        \
    X (UINT8,   2,  "uint8",   1, "|u1")        \
    X (INT8,    3,  "int8",    1, "|i1")        \
    X (INT32,   6,  "int32",   4, "<i4")        \
    X (INT64,   7,  "int64",   8, "<i8")        \
    X (BOOL,    9,  "bool",    1, "|b1")        \
    X (FLOAT16, 10, "float16", 2, "<f2")        \
    X (FLOAT64, 11, "float64", 8, "<f8")        \
    X (BFLOAT16, 16, "bfloat16", 2, "<V2")

typedef enum {
    KILN_DT_UNDEFINED = 0,
#define KILN_DT_ENUM(name, onnx, text, size, descr) KILN_DT_##name = onnx,
    KILN_DTYPES (KILN_DT_ENUM)
#undef KILN_DT_ENUM
} kiln_dtype_t;

/* "float32"; "undefined" for an unknown value. */
const char *kiln_dtype_name (kiln_dtype_t dt);
/* Bytes per element; 0 for an unknown value. */
size_t kiln_dtype_size (kiln_dtype_t dt);
/* numpy's descr ("<f4"); NULL for an unknown value. */
const char *kiln_dtype_npy_descr (kiln_dtype_t dt);
/* Parse "float32"; KILN_DT_UNDEFINED when unknown. */
kiln_dtype_t kiln_dtype_from_name (const char *name);
/* Parse a numpy descr ("<f4", "float32" spellings too); UNDEFINED if not. */
kiln_dtype_t kiln_dtype_from_npy_descr (const char *descr);
/* True for a value in KILN_DTYPES. */
bool kiln_dtype_valid (int value);
/* True for float16 and bfloat16: stored in 2 bytes, computed in float32
 * (common/kiln_half.h). */
bool kiln_dtype_is_half (kiln_dtype_t dt);

typedef struct kiln_shape {
    int rank;                        /* 0..KILN_MAX_RANK; -1 when unknown */
    int64_t dims[KILN_MAX_RANK];     /* each 0..KILN_MAX_DIM */
} kiln_shape_t;

/* Number of elements, checking each dim and the product against the
 * bounds in kiln_limits.h.  `what` names the tensor in the error. */
int kiln_shape_numel (const kiln_shape_t *shape, const char *what,
                      int64_t *numel, kiln_err_t *err);
/* Number of elements of a shape that kiln_shape_numel has accepted (its
 * dims and their product are bounded, so nothing overflows): for the
 * passes after that check. */
static inline int64_t
kiln_shape_count (const kiln_shape_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < shape->rank; i++)
        n *= shape->dims[i];
    return n;
}

/* The row-major strides of an accepted shape, in elements, into st[rank]. */
static inline void
kiln_shape_strides (const kiln_shape_t *shape, int64_t *st)
{
    int64_t c = 1;
    for (int i = shape->rank - 1; i >= 0; i--) {
        st[i] = c;
        c *= shape->dims[i];
    }
}

/* Bytes for `shape` of `dt`, checked like kiln_shape_numel. */
int kiln_shape_bytes (const kiln_shape_t *shape, kiln_dtype_t dt,
                      const char *what, uint64_t *bytes, kiln_err_t *err);
bool kiln_shape_equal (const kiln_shape_t *a, const kiln_shape_t *b);
/* Write "[1, 3, 224, 224]" into buf; returns buf. */
char *kiln_shape_str (const kiln_shape_t *shape, char *buf, size_t size);

#endif
