/*
 * kiln_map — read-only views of file ranges whose pages are given back
 * as they are streamed.
 *
 * Weights are the bulk of a model and are only ever streamed: hashed,
 * sent in chunks, copied into an archive.  Mapping the file they live in
 * lets every consumer see them as bytes in memory without a copy, and
 * kiln_map_drop hands the pages a stream has passed back to the kernel
 * (they stay in the page cache; touching them again faults them back in
 * from the file), so that the resident set of a process streaming 10 GB
 * of weights stays at a few MiB.
 *
 * Invariants: a kiln_map_t maps exactly the pages that hold its range,
 * read-only and shared, so dropping pages never loses data; kiln_map_drop
 * is only ever given ranges inside a mapping made here (dropping pages of
 * ordinary memory would zero them).
 *
 * The file must not shrink while it is mapped: a page past the new end
 * of the file raises SIGBUS when touched.  Callers that map files they do
 * not own say so in their docs.
 */
#ifndef KILN_MAP_H
#define KILN_MAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kiln_error.h"
#include "common/kiln_hash.h"

typedef struct kiln_map {
    void *base;          /* start of the mapping (page aligned), or NULL */
    size_t len;          /* bytes mapped */
} kiln_map_t;

/* Map `size` bytes of `fd` from `offset` (any alignment) read-only into
 * *m; *data gets the first byte of the range.  A range of 0 bytes maps
 * nothing (*data points at a static empty byte).  `what` names the range
 * in errors.  The descriptor may be closed afterwards. */
int kiln_map_range (int fd, uint64_t offset, uint64_t size, const char *what,
                    kiln_map_t *m, const uint8_t **data, kiln_err_t *err);
/* Unmap; *m is zeroed.  Nothing when it maps nothing. */
void kiln_map_release (kiln_map_t *m);

/* Give back the whole pages inside [p, p + len) of a kiln_map_range
 * mapping: they leave the resident set and are read from the file again
 * when next touched. */
void kiln_map_drop (const void *p, size_t len);

/* Map in the pages of [p, p + len) of a kiln_map_range mapping at once
 * (one call, not a page fault each), before they are read.  A hint: on a
 * kernel without MADV_POPULATE_READ, nothing happens. */
void kiln_map_prefault (const void *p, size_t len);

/* SHA-256 of `len` mapped bytes at `p`, read in steps whose pages are
 * given back behind it (kiln_map_drop). */
void kiln_sha256_mapped (const void *p, size_t len, uint8_t out[KILN_DIGEST_LEN]);

#endif
