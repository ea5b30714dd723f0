/* An arena allocator for CPython that keeps one freed 16 KiB block for the next
 * request of that size, as CPython keeps one frame chunk per thread since the fix
 * of python/cpython#142183 (3.13 and 3.14 maintenance releases of March 2026).
 * Every other size is mapped and unmapped as CPython's own arena allocator does.
 * Installed by chunk_cache.py with PyObject_SetArenaAllocator; it is compatible
 * with blocks the default allocator mapped before it was installed. */
#include <stddef.h>
#include <sys/mman.h>

#define CHUNK_SIZE 16384 /* _PY_DATA_STACK_CHUNK_SIZE */

static void *cached = NULL;
static unsigned long mapped = 0;  /* blocks of CHUNK_SIZE mapped */
static unsigned long reused = 0;  /* requests of CHUNK_SIZE served from the cache */

void *chunk_cache_alloc(void *ctx, size_t size) {
    (void)ctx;
    if (size == CHUNK_SIZE && cached != NULL) {
        void *p = cached;
        cached = NULL;
        reused++;
        return p;
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        return NULL;
    }
    if (size == CHUNK_SIZE) {
        mapped++;
    }
    return p;
}

void chunk_cache_free(void *ctx, void *ptr, size_t size) {
    (void)ctx;
    if (size == CHUNK_SIZE && cached == NULL) {
        cached = ptr;
        return;
    }
    munmap(ptr, size);
}

unsigned long chunk_cache_mapped(void) { return mapped; }
unsigned long chunk_cache_reused(void) { return reused; }
