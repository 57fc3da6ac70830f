/* fuzz_http.c - the HTTP request handling: each input is sent as is to the
 * real server (common/http.c on libmicrohttpd, 127.0.0.1, an ephemeral
 * port), the write side is closed, and the answer read to the end. The
 * answer is nothing or an HTTP/1.x status line, and the server serves a
 * probe after every input. libmicrohttpd itself is Debian's build: the
 * sanitizers and coverage see our handler, and MHD's parser runs for real. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "http.h"
#include "metrics.h"

static struct http *srv;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        char err[256];
        (void)argc;
        (void)argv;
        if (metrics_init("outbox-relay") != 0)
                return 1;
        metrics_add(M_BATCHES, NULL, 3);
        srv = http_start("127.0.0.1:0", err, sizeof err);
        if (!srv) {
                fprintf(stderr, "fuzz_http: %s\n", err);
                return 1;
        }
        return 0;
}

/* connect(), finished when libFuzzer's timer signal (SIGALRM) interrupts it. */
static int connect_eintr(int fd, const struct sockaddr_in *sa) {
        if (connect(fd, (const struct sockaddr *)sa, sizeof *sa) == 0)
                return 0;
        if (errno != EINTR)
                return -1;
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int err = 0;
        socklen_t len = sizeof err;
        while (poll(&p, 1, 5000) < 0)
                if (errno != EINTR)
                        return -1;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err) {
                errno = err;
                return -1;
        }
        return 0;
}

/* Sends req, closes the write side, returns the answer's length (its first
 * bytes in head) or -1 when the server neither answered nor closed. The
 * server closes first, so each connection leaves a TIME_WAIT entry behind:
 * the client binds a different loopback source address each time (127.x.y.z)
 * so thousands of exchanges a second never run out of ports. */
static long exchange(const void *req, size_t n, char *head, size_t head_size) {
        static uint32_t next;
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct timeval tv = {5, 0};
        struct sockaddr_in sa = {.sin_family = AF_INET,
                                 .sin_port = htons((uint16_t)http_port(srv))};
        struct sockaddr_in src = {.sin_family = AF_INET};
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        src.sin_addr.s_addr = htonl(0x7F000002u + next++ % 0xFFFFF0u);
        if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
            bind(fd, (struct sockaddr *)&src, sizeof src) != 0 || connect_eintr(fd, &sa) != 0) {
                perror("fuzz_http: connect");
                abort();
        }
        while (send(fd, req, n, MSG_NOSIGNAL) < 0 && errno == EINTR)
                ; /* the server may close before it all went: not an error here */
        (void)shutdown(fd, SHUT_WR);
        long total = 0;
        char chunk[16384];
        for (;;) {
                ssize_t r = recv(fd, chunk, sizeof chunk, 0);
                if (r < 0 && errno == EINTR)
                        continue;
                if (r < 0) {
                        total = r == -1 && total == 0 ? -1 : total;
                        break;
                }
                if (r == 0)
                        break;
                if ((size_t)total < head_size) {
                        size_t k = head_size - (size_t)total < (size_t)r ? head_size - (size_t)total
                                                                         : (size_t)r;
                        memcpy(head + total, chunk, k);
                }
                total += r;
        }
        close(fd);
        return total;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (size > 64 * 1024)
                return 0;
        char head[16] = "";
        http_heartbeat(srv); /* a main loop that turns: /healthz 200 */
        long n = exchange(data, size, head, sizeof head - 1);
        if (n > 0 && strncmp(head, "HTTP/1.", n < 7 ? (size_t)n : 7) != 0)
                abort(); /* an answer that is not HTTP */
        static const char probe[] = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
        memset(head, 0, sizeof head);
        errno = 0;
        n = exchange(probe, sizeof probe - 1, head, sizeof head - 1);
        if (n <= 0 || strncmp(head, "HTTP/1.1 200", 12) != 0) {
                fprintf(stderr, "fuzz_http: probe got %ld bytes (%s), errno %d\n", n, head, errno);
                abort(); /* the server stopped serving */
        }
        return 0;
}
