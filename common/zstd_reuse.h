/* zstd_reuse.h - one zstd compression context per thread, reused: a
 * process-wide override of zstd's ZSTD_createCStream() and
 * ZSTD_freeCStream() for librdkafka, which compresses every message set with
 * a fresh context. Nothing changes in what is compressed. */
#ifndef OUTBOX_ZSTD_REUSE_H
#define OUTBOX_ZSTD_REUSE_H

/* Links the override into the program and finds zstd's own functions. Call
 * once, before the first producer; a program that never calls it keeps
 * zstd's allocation per message set. */
void zstd_reuse_init(void);

#endif
