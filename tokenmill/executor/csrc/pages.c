/* Faulting in the pages of the KV cache before the first step. The cache is allocated untouched, so each page
 * costs a fault (the guest kernel zeroing it, and in a VM often the host backing it) the first time a step
 * writes there: 2-10 s of offline-64's run on the 2-core dev VM, depending on what the host had reclaimed.
 * Start-up has an idle core while the tokenizer loads; this runs there (a Python thread calls it, and ctypes
 * drops the GIL for the call).
 *
 * The same runs later between requests, so a server's resident memory reaches its KV reservation while idle
 * rather than creeping up under load; by then steps have written into the cache, so a touch keeps each byte.
 *
 * By stores, not madvise(MADV_POPULATE_WRITE): that holds the process's mmap lock through each call,
 * and the tokenizer's own allocations queued behind it (loading it took 6-9 s instead of 2.4 with the
 * madvise version running beside it, 2.7 s with this one). */
#include <stdint.h>

#include "tokenmill.h"

#define TOUCH_STRIDE 4096   /* the smallest page size: every page is written at least once */

/* For offsets start, start + chunk, ... below `bytes`: write into every page of that chunk of each of the n
 * buffers, until done or *stop becomes non-zero. An atomic OR of zero: one write fault per page, the byte
 * unchanged even if a step stores there at the same time. Buffers go chunk by chunk so that, with blocks
 * handed out from the lowest id up, the first blocks of every layer's K and V are ready first. Returns the
 * offset reached. */
static int64_t touch_pages(void *const *bufs, int n, int64_t start, int64_t bytes, int64_t chunk,
                           const volatile int *stop) {
    int64_t done = start;
    while (done < bytes && !*stop) {
        const int64_t len = bytes - done < chunk ? bytes - done : chunk;
        for (int i = 0; i < n; i++) {
            if (*stop) return done;
            char *b = (char *)bufs[i];
            for (int64_t at = done; at < done + len; at += TOUCH_STRIDE) __atomic_fetch_or(b + at, 0, __ATOMIC_RELAXED);
        }
        done += len;
    }
    return done;
}

TM_API int64_t tm_touch_pages(const tm_touch_pages_args *a) {
    return touch_pages((void *const *)a->bufs, a->n, a->start, a->bytes, a->chunk, a->stop);
}
