/*
 * kiln_map — read-only file views whose pages are given back as they are
 * streamed.
 */
#include "common/kiln_map.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define S_HASH_STEP (8u << 20)      /* bytes hashed between two drops */

static size_t
s_page (void)
{
    static size_t page;
    if (!page) {
        long p = sysconf (_SC_PAGESIZE);
        page = p > 0 ? (size_t) p : 4096;
    }
    return page;
}

int
kiln_map_range (int fd, uint64_t offset, uint64_t size, const char *what,
                kiln_map_t *m, const uint8_t **data, kiln_err_t *err)
{
    static const uint8_t empty[1];
    memset (m, 0, sizeof *m);
    *data = empty;
    if (size == 0)
        return 0;
    uint64_t page = s_page ();
    uint64_t start = offset - offset % page;
    uint64_t lead = offset - start;
    if (size > SIZE_MAX - lead)
        return kiln_error (err, KILN_ELIMIT, "%s: %llu bytes cannot be mapped", what,
                           (unsigned long long) size);
    void *base = mmap (NULL, (size_t) (lead + size), PROT_READ, MAP_SHARED, fd, (off_t) start);
    if (base == MAP_FAILED)
        return kiln_error (err, errno == ENOMEM ? KILN_ENOMEM : KILN_EIO,
                           "%s: could not map %llu bytes at offset %llu: %s", what,
                           (unsigned long long) size, (unsigned long long) offset,
                           strerror (errno));
    m->base = base;
    m->len = (size_t) (lead + size);
    *data = (const uint8_t *) base + lead;
    return 0;
}

void
kiln_map_release (kiln_map_t *m)
{
    if (m->base)
        munmap (m->base, m->len);
    m->base = NULL;
    m->len = 0;
}

void
kiln_map_drop (const void *p, size_t len)
{
    uintptr_t page = s_page ();
    uintptr_t start = ((uintptr_t) p + page - 1) / page * page;
    uintptr_t end = ((uintptr_t) p + len) / page * page;
    if (end > start)
        madvise ((void *) start, end - start, MADV_DONTNEED);
}

void
kiln_map_prefault (const void *p, size_t len)
{
    uintptr_t page = s_page ();
    uintptr_t start = (uintptr_t) p / page * page;
    uintptr_t end = ((uintptr_t) p + len + page - 1) / page * page;
    if (len > 0)
        madvise ((void *) start, end - start, MADV_POPULATE_READ);
}

void
kiln_sha256_mapped (const void *p, size_t len, uint8_t out[KILN_DIGEST_LEN])
{
    kiln_sha256_t *sha = kiln_sha256_new ();
    if (!sha) {
        kiln_sha256 (p, len, out);
        return;
    }
    const uint8_t *at = p;
    for (size_t done = 0; done < len; ) {
        size_t n = len - done < S_HASH_STEP ? len - done : S_HASH_STEP;
        kiln_sha256_update (sha, at + done, n);
        kiln_map_drop (at + done, n);
        done += n;
    }
    kiln_sha256_final (&sha, out);
}
