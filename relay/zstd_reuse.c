/* zstd_reuse.c - one zstd compression context per librdkafka thread, reused.
 *
 * librdkafka (2.0) compresses every message set with a context of its own:
 * ZSTD_createCStream(), compress, ZSTD_freeCStream(). A batch spread over 64
 * partitions is 64 message sets of a few messages each, so creating the
 * context costs about as much as compressing: zstd allocates and zeroes its
 * workspace and probes the CPU with `cpuid`, which a virtual machine traps
 * (1-2 % of all CPU in the benchmark's relay run, tests/bench/RESULTS.md).
 *
 * The relay defines the two functions itself; the dynamic linker binds
 * librdkafka's calls to the executable's definitions first. A freed context is
 * reset (session and parameters: as good as new) and kept for the thread's
 * next message set; a second one is really freed; a thread's kept context is
 * freed when the thread exits. Nothing changes in what is compressed. Without
 * zstd in the process (librdkafka built without it) librdkafka never calls
 * them.
 *
 * Declared here rather than through <zstd.h>, whose package the build does not
 * otherwise need; these are zstd's stable API (1.4.0 on). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>

typedef struct ZSTD_CCtx_s ZSTD_CStream;
enum { ZSTD_RESET_SESSION_AND_PARAMETERS = 3 };

ZSTD_CStream *ZSTD_createCStream(void);
size_t ZSTD_freeCStream(ZSTD_CStream *zcs);

static ZSTD_CStream *(*real_create)(void);
static size_t (*real_free)(ZSTD_CStream *);
static size_t (*reset)(ZSTD_CStream *, int);
static pthread_key_t kept;
static int usable; /* the real functions were found and the key made */
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void free_kept(void *zcs) {
        real_free(zcs);
}

static void init(void) {
        real_create = (ZSTD_CStream * (*)(void)) dlsym(RTLD_NEXT, "ZSTD_createCStream");
        real_free = (size_t(*)(ZSTD_CStream *))dlsym(RTLD_NEXT, "ZSTD_freeCStream");
        reset = (size_t(*)(ZSTD_CStream *, int))dlsym(RTLD_NEXT, "ZSTD_CCtx_reset");
        usable = real_create && real_free && reset && pthread_key_create(&kept, free_kept) == 0;
}

ZSTD_CStream *ZSTD_createCStream(void) {
        pthread_once(&once, init);
        if (!real_create)
                return NULL; /* no zstd loaded: the caller reports a compression error */
        if (usable) {
                ZSTD_CStream *zcs = pthread_getspecific(kept);
                if (zcs) {
                        pthread_setspecific(kept, NULL);
                        return zcs;
                }
        }
        return real_create();
}

size_t ZSTD_freeCStream(ZSTD_CStream *zcs) {
        pthread_once(&once, init);
        if (!zcs || !real_free)
                return 0;
        /* ZSTD_CCtx_reset() returns 0 on success, an error code otherwise */
        if (usable && !pthread_getspecific(kept) &&
            reset(zcs, ZSTD_RESET_SESSION_AND_PARAMETERS) == 0 &&
            pthread_setspecific(kept, zcs) == 0)
                return 0;
        return real_free(zcs);
}
