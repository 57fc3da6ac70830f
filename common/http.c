/* http.c - HTTP/1.0 for /metrics, /healthz and /readyz on one background
 * thread: one connection at a time, GET only, Connection: close. */
#include "http.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "encode.h"
#include "log.h"
#include "metrics.h"

#define HTTP_POLL_MS         200  /* how often the thread looks at the stop flag */
#define HTTP_IO_TIMEOUT_MS   2000 /* reading the whole request */
#define HTTP_SEND_TIMEOUT_MS 5000 /* writing the whole response */
#define HTTP_REQUEST_MAX     4096 /* request line and headers we read */
#define HTTP_DEFAULT_STALL_S 60

struct http {
        int fd;
        int port;
        pthread_t thread;
        atomic_int stop;
        atomic_int ready;
        atomic_int stall_s;
        atomic_llong last_beat_ms; /* CLOCK_MONOTONIC */
};

static long long now_ms(void) {
        return (long long)(clock_mono_s() * 1000.0);
}

/* Splits "host:port", "[v6]:port" or ":port" into host (NULL: any address)
 * and port. 0 on success. */
static int parse_addr(const char *addr, char *host, size_t host_size, char *port,
                      size_t port_size) {
        const char *colon = addr ? strrchr(addr, ':') : NULL;
        if (!colon)
                return -1;
        const char *h = addr;
        size_t hlen = (size_t)(colon - addr);
        if (hlen >= 2 && h[0] == '[' && h[hlen - 1] == ']') {
                h++;
                hlen -= 2;
        } else if (memchr(h, ':', hlen)) {
                return -1; /* a bare IPv6 address needs brackets */
        }
        const char *p = colon + 1;
        size_t plen = strlen(p);
        if (plen == 0 || plen >= port_size || hlen >= host_size ||
            strspn(p, "0123456789") != plen || atol(p) > 65535)
                return -1;
        memcpy(host, h, hlen);
        host[hlen] = '\0';
        memcpy(port, p, plen + 1);
        return 0;
}

/* A listening, non-blocking socket on addr, or -1 with errstr. */
static int listen_on(const char *addr, char *errstr, size_t errstr_size) {
        char host[256], port[8];
        struct addrinfo hints, *res = NULL;
        int fd = -1, err = 0;

        if (parse_addr(addr, host, sizeof host, port, sizeof port) != 0) {
                snprintf(errstr, errstr_size, "http: bad listen address %s (want host:port)",
                         addr ? addr : "(null)");
                goto out;
        }
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
        int gai = getaddrinfo(*host ? host : NULL, port, &hints, &res);
        if (gai != 0) {
                snprintf(errstr, errstr_size, "http: cannot resolve %s: %s", addr,
                         gai_strerror(gai));
                goto out;
        }
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
                int one = 1;
                fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                            ai->ai_protocol);
                if (fd >= 0 && setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0 &&
                    bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 16) == 0)
                        goto out;
                err = errno;
                if (fd >= 0)
                        close(fd);
                fd = -1;
        }
        snprintf(errstr, errstr_size, "http: cannot listen on %s: %s", addr,
                 strerror(err ? err : EADDRNOTAVAIL));
out:
        if (res)
                freeaddrinfo(res);
        return fd;
}

/* Sends all of p before `deadline` (now_ms() clock). 0 on success. */
static int send_all(int fd, const char *p, size_t n, long long deadline) {
        while (n > 0) {
                ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
                if (w > 0) {
                        p += w;
                        n -= (size_t)w;
                        continue;
                }
                if (w < 0 && errno == EINTR)
                        continue;
                long long left = deadline - now_ms();
                if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && left > 0) {
                        struct pollfd pfd = {.fd = fd, .events = POLLOUT};
                        if (poll(&pfd, 1, (int)left) >= 0 || errno == EINTR)
                                continue;
                }
                return -1;
        }
        return 0;
}

static int respond(int fd, int status, const char *content_type, const char *body,
                   size_t body_len) {
        const char *reason = status == 200   ? "OK"
                             : status == 400 ? "Bad Request"
                             : status == 404 ? "Not Found"
                             : status == 405 ? "Method Not Allowed"
                             : status == 503 ? "Service Unavailable"
                                             : "Internal Server Error";
        char head[512];
        int n = snprintf(head, sizeof head,
                         "HTTP/1.0 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s"
                         "Connection: close\r\n\r\n",
                         status, reason, content_type, body_len,
                         status == 405 ? "Allow: GET\r\n" : "");
        if (n < 0 || (size_t)n >= sizeof head)
                return -1;
        long long deadline = now_ms() + HTTP_SEND_TIMEOUT_MS;
        if (send_all(fd, head, (size_t)n, deadline) != 0)
                return -1;
        return send_all(fd, body, body_len, deadline);
}

static int respond_text(int fd, int status, const char *body) {
        return respond(fd, status, "text/plain; charset=utf-8", body, strlen(body));
}

/* Reads until the end of the headers (or, for a request line without a
 * version, its end), the buffer is full, the peer closes, 2 s pass or the
 * server stops. Returns bytes read (buf NUL-terminated), -1 on timeout/error. */
static int read_request(struct http *h, int fd, char *buf, size_t size) {
        long long deadline = now_ms() + HTTP_IO_TIMEOUT_MS;
        size_t len = 0;
        buf[0] = '\0';
        while (len + 1 < size) {
                char *eol = strchr(buf, '\n');
                if (eol) {
                        *eol = '\0';
                        int versioned = strstr(buf, " HTTP/") != NULL;
                        *eol = '\n';
                        if (!versioned || strstr(buf, "\r\n\r\n") || strstr(buf, "\n\n"))
                                break;
                }
                long long left = deadline - now_ms();
                if (left <= 0 || atomic_load(&h->stop))
                        return -1;
                struct pollfd pfd = {.fd = fd, .events = POLLIN};
                int pr = poll(&pfd, 1, (int)(left < HTTP_POLL_MS ? left : HTTP_POLL_MS));
                if (pr < 0 && errno != EINTR)
                        return -1;
                if (pr <= 0)
                        continue;
                ssize_t r = recv(fd, buf + len, size - 1 - len, 0);
                if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
                        continue;
                if (r <= 0)
                        break; /* peer closed: answer what we have */
                len += (size_t)r;
                buf[len] = '\0';
        }
        return (int)len;
}

static void serve_metrics(int fd) {
        struct buf body = {0};
        if (metrics_render(&body) != 0) {
                (void)respond_text(fd, 500, "cannot render metrics\n");
                goto out;
        }
        (void)respond(fd, 200, "text/plain; version=0.0.4; charset=utf-8",
                      body.data ? body.data : "", body.len);
out:
        buf_free(&body);
}

static void serve(struct http *h, int fd) {
        char req[HTTP_REQUEST_MAX];
        if (read_request(h, fd, req, sizeof req) <= 0)
                return; /* timed out or empty: just close */

        /* Request line: METHOD SP target [SP version]. */
        char *eol = strpbrk(req, "\r\n");
        if (eol)
                *eol = '\0';
        char *method = req, *target = strchr(req, ' ');
        if (!target || target == method) {
                (void)respond_text(fd, 400, "bad request\n");
                return;
        }
        *target++ = '\0';
        target[strcspn(target, " ?#")] = '\0';
        log_debug("http", "request", "method=%s path=%s", method, target);

        if (strcmp(method, "GET") != 0) {
                (void)respond_text(fd, 405, "method not allowed\n");
        } else if (strcmp(target, "/metrics") == 0) {
                serve_metrics(fd);
        } else if (strcmp(target, "/healthz") == 0) {
                long long age = now_ms() - atomic_load(&h->last_beat_ms);
                if (age <= (long long)atomic_load(&h->stall_s) * 1000)
                        (void)respond_text(fd, 200, "ok\n");
                else
                        (void)respond_text(fd, 503, "stalled\n");
        } else if (strcmp(target, "/readyz") == 0) {
                if (atomic_load(&h->ready))
                        (void)respond_text(fd, 200, "ready\n");
                else
                        (void)respond_text(fd, 503, "not ready\n");
        } else {
                (void)respond_text(fd, 404, "not found\n");
        }
}

/* Closes fd without a reset: half-close, then drop what the client still sent. */
static void close_conn(int fd) {
        char sink[512];
        (void)shutdown(fd, SHUT_WR);
        for (int i = 0; i < 8 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; i++)
                ;
        close(fd);
}

static void *http_thread(void *arg) {
        struct http *h = arg;
        long long last_warn = 0;
        while (!atomic_load(&h->stop)) {
                struct pollfd pfd = {.fd = h->fd, .events = POLLIN};
                int pr = poll(&pfd, 1, HTTP_POLL_MS);
                if (pr <= 0)
                        continue; /* timeout or EINTR: look at the flag again */
                int c = accept(h->fd, NULL, NULL);
                if (c < 0) {
                        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ||
                            errno == ECONNABORTED)
                                continue;
                        if (now_ms() - last_warn > 10000) {
                                last_warn = now_ms();
                                log_warn("http", "accept failed", "err=%s", strerror(errno));
                        }
                        struct timespec pause = {0, HTTP_POLL_MS * 1000000L};
                        nanosleep(&pause, NULL); /* e.g. EMFILE: do not spin */
                        continue;
                }
                /* Non-blocking: reads and writes wait in poll() against deadlines. */
                int fl = fcntl(c, F_GETFL);
                if (fl < 0 || fcntl(c, F_SETFL, fl | O_NONBLOCK) < 0 ||
                    fcntl(c, F_SETFD, FD_CLOEXEC) < 0) {
                        close(c);
                        continue;
                }
                serve(h, c);
                close_conn(c);
        }
        return NULL;
}

struct http *http_start(const char *addr, char *errstr, size_t errstr_size) {
        struct http *h = calloc(1, sizeof *h);
        int started = 0;
        if (!h) {
                snprintf(errstr, errstr_size, "http: out of memory");
                goto out;
        }
        h->fd = listen_on(addr, errstr, errstr_size);
        if (h->fd < 0)
                goto out;

        struct sockaddr_storage ss;
        socklen_t sslen = sizeof ss;
        if (getsockname(h->fd, (struct sockaddr *)&ss, &sslen) != 0) {
                snprintf(errstr, errstr_size, "http: getsockname: %s", strerror(errno));
                goto out;
        }
        h->port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                           : ntohs(((struct sockaddr_in *)&ss)->sin_port);
        atomic_init(&h->stop, 0);
        atomic_init(&h->ready, 0);
        atomic_init(&h->stall_s, HTTP_DEFAULT_STALL_S);
        atomic_init(&h->last_beat_ms, now_ms()); /* grace of stall_s after start */

        /* Signals go to the main thread: the server thread blocks them all. */
        sigset_t all, old;
        sigfillset(&all);
        int perr = pthread_sigmask(SIG_SETMASK, &all, &old);
        if (perr == 0) {
                perr = pthread_create(&h->thread, NULL, http_thread, h);
                (void)pthread_sigmask(SIG_SETMASK, &old, NULL);
        }
        if (perr != 0) {
                snprintf(errstr, errstr_size, "http: cannot start thread: %s", strerror(perr));
                goto out;
        }
        started = 1;
out:
        if (!started && h) {
                if (h->fd >= 0)
                        close(h->fd);
                free(h);
                h = NULL;
        }
        return h;
}

int http_port(const struct http *h) {
        return h ? h->port : -1;
}

void http_heartbeat(struct http *h) {
        if (h)
                atomic_store(&h->last_beat_ms, now_ms());
}

void http_set_stall(struct http *h, int stall_s) {
        if (h)
                atomic_store(&h->stall_s, stall_s > 0 ? stall_s : 1);
}

void http_set_ready(struct http *h, int ready) {
        if (h)
                atomic_store(&h->ready, ready ? 1 : 0);
}

void http_stop(struct http *h) {
        if (!h)
                return;
        atomic_store(&h->stop, 1);
        (void)pthread_join(h->thread, NULL);
        close(h->fd);
        free(h);
}
