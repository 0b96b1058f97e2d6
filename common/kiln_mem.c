#include "common/kiln_mem.h"

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

void *
kiln_mem_alloc (size_t size)
{
    if (size < KILN_MEM_HUGE_MIN) {
        size_t n = size ? (size + 63) & ~(size_t) 63 : 64;
        return aligned_alloc (64, n);
    }
    if (size > SIZE_MAX - KILN_MEM_HUGE)
        return NULL;
    size_t n = (size + KILN_MEM_HUGE - 1) & ~(KILN_MEM_HUGE - 1);
    void *p = aligned_alloc (KILN_MEM_HUGE, n);
    /* advice only: where it fails (no transparent huge pages) the buffer
     * is ordinary memory */
    if (p)
        (void) madvise (p, n, MADV_HUGEPAGE);
    return p;
}

bool
kiln_mem_advised_huge (const void *p)
{
    FILE *f = fopen ("/proc/self/smaps", "r");
    if (!f)
        return false;
    char line[512];
    bool in = false, huge = false;
    uintptr_t at = (uintptr_t) p;
    while (fgets (line, sizeof line, f)) {
        uintmax_t lo, hi;
        char c;
        /* a mapping's first line: "lo-hi perms ..." in hex */
        if (sscanf (line, "%" SCNxMAX "-%" SCNxMAX " %c", &lo, &hi, &c) == 3) {
            in = at >= lo && at < hi;
            continue;
        }
        if (in && strncmp (line, "VmFlags:", 8) == 0) {
            huge = strstr (line + 8, " hg") != NULL;
            break;
        }
    }
    fclose (f);
    return huge;
}
