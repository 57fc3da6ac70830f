/* zstd_reuse.c - one zstd compression context per librdkafka thread, reused.
 *
 * librdkafka compresses every message set with a context of its own:
 * ZSTD_createCStream(), compress, ZSTD_freeCStream(). A batch spread over 64
 * partitions is 64 message sets of a few messages each, so creating the
 * context costs about as much as compressing: zstd allocates and zeroes its
 * workspace and probes the CPU with `cpuid`, which a virtual machine traps.
 *
 * This file defines the two functions itself; the dynamic linker binds
 * librdkafka's calls to the executable's definitions first
 * (tests/integration/test_relay.py checks the binding), which is why the
 * program must link this file: zstd_reuse_init() does. A freed context is
 * reset (session and parameters: as good as new) and kept for the thread's
 * next message set; a second one is really freed; a thread's kept context is
 * freed when the thread exits. Without zstd in the process (librdkafka built
 * without it) librdkafka never calls them.
 *
 * Declared here rather than through <zstd.h>, whose package the build does not
 * otherwise need; these are zstd's stable API (1.4.0 on). */
#define _GNU_SOURCE /* RTLD_NEXT */
#include "zstd_reuse.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>

typedef struct ZSTD_CCtx_s ZSTD_CStream;
enum { ZSTD_RESET_SESSION_AND_PARAMETERS = 3 };

ZSTD_CStream *ZSTD_createCStream(void);
size_t ZSTD_freeCStream(ZSTD_CStream *zcs);

static ZSTD_CStream *(*zstd_real_create)(void);
static size_t (*zstd_real_free)(ZSTD_CStream *);
static size_t (*zstd_reset)(ZSTD_CStream *, int);
static pthread_key_t zstd_kept;
static int zstd_usable; /* the real functions were found and the key made */
static pthread_once_t zstd_once = PTHREAD_ONCE_INIT;

static void zstd_free_kept(void *zcs) {
        zstd_real_free(zcs);
}

static void zstd_init(void) {
        /* clang-format 14 and 19 space these casts differently */
        /* clang-format off */
        zstd_real_create = (ZSTD_CStream * (*)(void)) dlsym(RTLD_NEXT, "ZSTD_createCStream");
        zstd_real_free = (size_t(*)(ZSTD_CStream *))dlsym(RTLD_NEXT, "ZSTD_freeCStream");
        zstd_reset = (size_t(*)(ZSTD_CStream *, int))dlsym(RTLD_NEXT, "ZSTD_CCtx_reset");
        /* clang-format on */
        zstd_usable = zstd_real_create && zstd_real_free && zstd_reset &&
                      pthread_key_create(&zstd_kept, zstd_free_kept) == 0;
}

void zstd_reuse_init(void) {
        pthread_once(&zstd_once, zstd_init);
}

ZSTD_CStream *ZSTD_createCStream(void) {
        pthread_once(&zstd_once, zstd_init);
        if (!zstd_real_create)
                return NULL; /* no zstd loaded: the caller reports a compression error */
        if (zstd_usable) {
                ZSTD_CStream *zcs = pthread_getspecific(zstd_kept);
                if (zcs) {
                        pthread_setspecific(zstd_kept, NULL);
                        return zcs;
                }
        }
        return zstd_real_create();
}

size_t ZSTD_freeCStream(ZSTD_CStream *zcs) {
        pthread_once(&zstd_once, zstd_init);
        if (!zcs || !zstd_real_free)
                return 0;
        /* ZSTD_CCtx_reset() returns 0 on success, an error code otherwise */
        if (zstd_usable && !pthread_getspecific(zstd_kept) &&
            zstd_reset(zcs, ZSTD_RESET_SESSION_AND_PARAMETERS) == 0 &&
            pthread_setspecific(zstd_kept, zcs) == 0)
                return 0;
        return zstd_real_free(zcs);
}
