/* fuzz_config.c - the --config file parser: the input is the file (through a
 * memfd), read for the relay or the sweeper (first byte) with an empty
 * environment, then validated as at start. Whatever it holds, config_load
 * returns 0 or -1 with a one-line error, and config_destroy frees all. */
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "config.h"

static FILE *devnull;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        (void)argc;
        (void)argv;
        clearenv(); /* the file is the only source besides the defaults */
        devnull = fopen("/dev/null", "w");
        return devnull ? 0 : 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (size < 1 || size > 64 * 1024)
                return 0;
        int fd = memfd_create("outbox-config", MFD_CLOEXEC);
        if (fd < 0)
                abort();
        if (write(fd, data + 1, size - 1) != (ssize_t)(size - 1))
                abort();
        char path[64];
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        char *argv[] = {data[0] & 1 ? "outbox-sweeper" : "outbox-relay", "--config", path, NULL};
        struct config cfg;
        char err[512];
        int rc = config_load(&cfg, data[0] & 1 ? CONFIG_SWEEPER : CONFIG_RELAY, 3, argv, devnull,
                             err, sizeof err);
        if (rc != 0 && (rc != -1 || !err[0] || strchr(err, '\n')))
                abort(); /* an error is one line */
        if (rc == 0 && (!cfg.database_url || !cfg.table || !cfg.relay_id || !cfg.http_addr))
                abort();
        config_destroy(&cfg);
        close(fd);
        return 0;
}
