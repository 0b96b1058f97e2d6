/*
 * kiln_mem — large buffers on huge pages.
 *
 * The kernels stride through their buffers: a convolution reads its
 * input's planes a plane apart (12 KiB at 56 × 56), the rows of a
 * pointwise convolution's B panel each from another page, and a model's
 * arena and weights span tens to hundreds of MiB.  With 4 KiB pages
 * almost every such step is a TLB miss, and under a hypervisor's nested
 * paging a miss walks two sets of tables.  So buffers of
 * KILN_MEM_HUGE_MIN bytes or more are 2 MiB aligned, rounded up to whole
 * 2 MiB, and advised to the kernel as transparent-huge-page memory
 * (madvise MADV_HUGEPAGE) before anything touches them: where the
 * system's transparent huge pages are "madvise" (Debian's default) or
 * "always" they are then backed by 2 MiB pages; where they are "never",
 * or the kernel has none, the advice changes nothing and the buffer is
 * ordinary memory.  Smaller buffers are 64-byte aligned (a vector line).
 * Both are freed with free().
 */
#ifndef KILN_MEM_H
#define KILN_MEM_H

#include <stdbool.h>
#include <stddef.h>

#define KILN_MEM_HUGE ((size_t) 2 << 20)       /* a huge page */
#define KILN_MEM_HUGE_MIN ((size_t) 1 << 20)   /* from this size on */

/* A buffer of at least `size` bytes (1 when 0), uninitialised, as above;
 * NULL when out of memory (or when the rounding would overflow). */
void *kiln_mem_alloc (size_t size);

/* Whether `p` lies in memory advised as huge-page memory, from
 * /proc/self/smaps (its VmFlags' "hg"): for tests and diagnostics; false
 * where that file cannot be read. */
bool kiln_mem_advised_huge (const void *p);

#endif
