/*
 * kiln_npy — read and write NumPy .npy files (format versions 1, 2, 3).
 *
 * Only what kiln exchanges with Python: little-endian (or byte-sized)
 * kiln dtypes in C order.  The header is parsed strictly: a dict with
 * exactly 'descr', 'fortran_order' and 'shape'; a big-endian or Fortran-
 * order array is refused, not converted.  Every size is bounded (header
 * length, rank, dimensions, element count) and the data length must be
 * exactly what the header's dtype and shape need, so a malformed file is
 * an error naming it, never a crash or an oversized allocation.
 *
 * kiln_npy_t is an embedded struct: kiln_npy_init / kiln_npy_release.
 */
#ifndef KILN_NPY_H
#define KILN_NPY_H

#include <stddef.h>
#include <stdint.h>

#include "common/kiln_dtype.h"
#include "common/kiln_error.h"

#define KILN_NPY_MAX_HEADER (64u << 10)       /* header bytes */
#define KILN_NPY_MAX_BYTES  (8ULL << 30)      /* a whole .npy file */

typedef struct kiln_npy {
    kiln_dtype_t dtype;
    kiln_shape_t shape;
    void *data;             /* owned (free()), `size` bytes */
    size_t size;
} kiln_npy_t;

void kiln_npy_init (kiln_npy_t *npy);
/* Free the data and reset. */
void kiln_npy_release (kiln_npy_t *npy);

/* Parse `len` bytes of a .npy file into `npy` (data copied). */
int kiln_npy_parse (const uint8_t *buf, size_t len, kiln_npy_t *npy,
                    kiln_err_t *err);
/* Read the .npy file at `path`; errors are prefixed with the path. */
int kiln_npy_read (const char *path, kiln_npy_t *npy, kiln_err_t *err);

/* Encode an array as a version 1.0 .npy (header padded to 64 bytes, as
 * numpy writes it).  Caller owns *out (free()). */
int kiln_npy_encode (kiln_dtype_t dtype, const kiln_shape_t *shape,
                     const void *data, uint8_t **out, size_t *len,
                     kiln_err_t *err);
/* Write an array to `path` atomically (mode 0644). */
int kiln_npy_write (const char *path, kiln_dtype_t dtype,
                    const kiln_shape_t *shape, const void *data,
                    kiln_err_t *err);

#endif
