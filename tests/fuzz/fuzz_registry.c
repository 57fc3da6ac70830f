/* fuzz_registry.c - the schema registry's answers: any HTTP status (first two
 * bytes) and any body (the rest, as curl hands it over) go through
 * registry_parse_reply(). An id comes only from a 200, the message is
 * NUL-terminated within its buffer, and the code is one of the two. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "registry.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (size < 2 || size > 256 * 1024)
                return 0;
        long status = (long)(data[0] << 8 | data[1]) % 600;
        char *body = malloc(size - 1);
        memcpy(body, data + 2, size - 2);
        body[size - 2] = '\0';
        char msg[120];
        memset(msg, 'x', sizeof msg);
        int id = -1;
        const char *code = NULL;
        if (registry_parse_reply(status, body, &id, &code, msg, sizeof msg) == 0) {
                if (status != 200 || id < 0)
                        abort();
        } else {
                if (!code ||
                    (strcmp(code, "REGISTRY_UNAVAILABLE") && strcmp(code, "REGISTRY_REJECTED")))
                        abort();
                if (!memchr(msg, '\0', sizeof msg))
                        abort();
                if ((status >= 500 || status == 429) != !strcmp(code, "REGISTRY_UNAVAILABLE"))
                        abort();
        }
        free(body);
        return 0;
}
