/* http.c - /metrics, /healthz and /readyz served by libmicrohttpd on its own
 * internal thread, every connection at once: an idle, slow or half-sent
 * request does not delay anyone else's. The thread waits in poll(2), level
 * triggered: in 0.9.75's epoll mode (edge triggered) a client that sent part
 * of a request and closed its side was noticed only at the idle timeout.
 *
 * Limits, so that no client can starve the probes: an idle connection (no
 * byte either way) is closed after HTTP_IDLE_TIMEOUT_S; one peer address
 * holds at most half of the connections the server takes, so a scanner, a
 * stuck scraper or a slow-loris client leaves room for the kubelet and
 * Prometheus; the total stays within half the process's file descriptor
 * limit, so a flood cannot take the sockets the database and the brokers
 * need; a request's line and headers may take HTTP_MEMORY_LIMIT bytes. */
#include "http.h"

#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include "clock.h"
#include "encode.h"
#include "log.h"
#include "metrics.h"

#define HTTP_IDLE_TIMEOUT_S  2
#define HTTP_MAX_CONNECTIONS 1024
#define HTTP_MEMORY_LIMIT    (16 * 1024)
#define HTTP_LISTEN_BACKLOG  256
#define HTTP_DEFAULT_STALL_S 60
#define TEXT_PLAIN           "text/plain; charset=utf-8"
#define PROMETHEUS_TEXT      "text/plain; version=0.0.4; charset=utf-8"
#define APPLICATION_JSON     "application/json"

struct http {
        struct MHD_Daemon *daemon;
        int fd; /* the listening socket; MHD closes it when it stops */
        int port;
        pthread_mutex_t ready_lock; /* guards ready_fn and ready_arg */
        http_ready_fn *ready_fn;    /* called on the server's thread */
        void *ready_arg;
        atomic_int stall_s;
        atomic_llong last_beat_ms; /* CLOCK_MONOTONIC */
};

static long long now_ms(void) {
        return (long long)(clock_mono_s() * 1000.0);
}

/* Splits "host:port", "[v6]:port" or ":port" into host (empty: any address)
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

/* A listening, non-blocking socket on addr, or -1 with errstr. The socket is
 * ours (not MHD's), so "host:port" means what it always meant: a name or an
 * address of either family, port 0 for any free port. */
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
                    bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
                    listen(fd, HTTP_LISTEN_BACKLOG) == 0)
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

/* Queues `body` (copied, or taken over and freed by MHD with `owned`) as the
 * answer, in the HTTP version the client spoke, and closes the connection
 * after it: a probe or a scrape is one request. */
static enum MHD_Result answer(struct MHD_Connection *c, const char *version, unsigned status,
                              const char *content_type, char *body, size_t len, int owned) {
        struct MHD_Response *r = MHD_create_response_from_buffer(
                len, body, owned ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_MUST_COPY);
        if (!r) {
                if (owned)
                        free(body);
                return MHD_NO; /* MHD closes the connection */
        }
        enum MHD_Result rc = MHD_NO;
        if (version && strcmp(version, MHD_HTTP_VERSION_1_0) == 0 &&
            MHD_set_response_options(r, MHD_RF_HTTP_1_0_SERVER, MHD_RO_END) != MHD_YES)
                goto out;
        if (MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, content_type) != MHD_YES ||
            MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close") != MHD_YES ||
            (status == MHD_HTTP_METHOD_NOT_ALLOWED &&
             MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD") != MHD_YES))
                goto out;
        rc = MHD_queue_response(c, status, r);
out:
        MHD_destroy_response(r);
        return rc;
}

static enum MHD_Result answer_text(struct MHD_Connection *c, const char *version, unsigned status,
                                   const char *text) {
        return answer(c, version, status, TEXT_PLAIN, (char *)text, strlen(text), 0);
}

/* MHD's request handler: the first call for a request has the line and
 * headers; the answer is queued at once (a request body, which none of these
 * paths takes, is not waited for). HEAD gets GET's headers without the body
 * (MHD leaves it out). */
static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **req_cls) {
        struct http *h = cls;
        (void)upload_data;
        (void)upload_data_size;
        (void)req_cls;
        log_debug("http", "request", "method=%s path=%s version=%s", method, url, version);

        if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
                return answer_text(c, version, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed\n");
        if (strcmp(url, "/metrics") == 0) {
                struct buf body = {0};
                if (metrics_render(&body) != 0) {
                        buf_free(&body);
                        return answer_text(c, version, MHD_HTTP_INTERNAL_SERVER_ERROR,
                                           "cannot render metrics\n");
                }
                if (!body.data)
                        return answer(c, version, MHD_HTTP_OK, PROMETHEUS_TEXT, (char *)"", 0, 0);
                return answer(c, version, MHD_HTTP_OK, PROMETHEUS_TEXT, body.data, body.len, 1);
        }
        if (strcmp(url, "/healthz") == 0) {
                long long age = now_ms() - atomic_load(&h->last_beat_ms);
                if (age <= (long long)atomic_load(&h->stall_s) * 1000)
                        return answer_text(c, version, MHD_HTTP_OK, "ok\n");
                return answer_text(c, version, MHD_HTTP_SERVICE_UNAVAILABLE, "stalled\n");
        }
        if (strcmp(url, "/readyz") == 0) {
                struct buf body = {0};
                int ready = 0;
                pthread_mutex_lock(&h->ready_lock);
                if (h->ready_fn)
                        ready = h->ready_fn(h->ready_arg, &body);
                else if (buf_appendf(&body, "{\"ready\":false,\"conditions\":{\"starting\":"
                                            "{\"ok\":false,\"reason\":\"starting\"}}}\n"))
                        ready = -1;
                pthread_mutex_unlock(&h->ready_lock);
                if (ready < 0 || !body.data) {
                        buf_free(&body);
                        return answer_text(c, version, MHD_HTTP_INTERNAL_SERVER_ERROR,
                                           "cannot tell\n");
                }
                return answer(c, version, ready ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE,
                              APPLICATION_JSON, body.data, body.len, 1);
        }
        return answer_text(c, version, MHD_HTTP_NOT_FOUND, "not found\n");
}

/* MHD's own messages (a client that sent garbage, a reset connection):
 * debug level, since any peer can cause them. */
__attribute__((format(printf, 2, 0))) static void on_mhd_log(void *cls, const char *fmt,
                                                             va_list ap) {
        (void)cls;
        if (!log_enabled(LOG_DEBUG))
                return;
        char text[512];
        vsnprintf(text, sizeof text, fmt, ap);
        text[strcspn(text, "\n")] = '\0';
        log_debug("http", "libmicrohttpd", "text=%s", text);
}

/* The connection limit: HTTP_MAX_CONNECTIONS, or half the descriptors the
 * process may open if that is less. */
static unsigned connection_limit(void) {
        struct rlimit rl;
        unsigned limit = HTTP_MAX_CONNECTIONS;
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
            rl.rlim_cur / 2 < limit)
                limit = (unsigned)(rl.rlim_cur / 2);
        return limit > 8 ? limit : 8;
}

struct http *http_start(const char *addr, char *errstr, size_t errstr_size) {
        struct http *h = calloc(1, sizeof *h);
        if (!h) {
                snprintf(errstr, errstr_size, "http: out of memory");
                return NULL;
        }
        h->fd = listen_on(addr, errstr, errstr_size);
        if (h->fd < 0)
                goto fail;

        struct sockaddr_storage ss;
        socklen_t sslen = sizeof ss;
        if (getsockname(h->fd, (struct sockaddr *)&ss, &sslen) != 0) {
                snprintf(errstr, errstr_size, "http: getsockname: %s", strerror(errno));
                goto fail;
        }
        h->port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                           : ntohs(((struct sockaddr_in *)&ss)->sin_port);
        atomic_init(&h->stall_s, HTTP_DEFAULT_STALL_S);
        pthread_mutex_init(&h->ready_lock, NULL);
        atomic_init(&h->last_beat_ms, now_ms()); /* grace of stall_s after start */

        unsigned limit = connection_limit();
        /* Signals go to the main thread: MHD's thread inherits a full mask. */
        sigset_t all, old;
        sigfillset(&all);
        int perr = pthread_sigmask(SIG_SETMASK, &all, &old);
        if (perr != 0) {
                snprintf(errstr, errstr_size, "http: cannot block signals: %s", strerror(perr));
                goto fail;
        }
        h->daemon = MHD_start_daemon(
                MHD_USE_POLL_INTERNAL_THREAD | MHD_USE_ERROR_LOG, 0, NULL, NULL, on_request, h,
                MHD_OPTION_LISTEN_SOCKET, (MHD_socket)h->fd, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log,
                NULL, MHD_OPTION_CONNECTION_LIMIT, limit, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                limit / 2, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTP_IDLE_TIMEOUT_S,
                MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)HTTP_MEMORY_LIMIT, MHD_OPTION_END);
        (void)pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (!h->daemon) {
                snprintf(errstr, errstr_size, "http: libmicrohttpd did not start on %s", addr);
                goto fail;
        }
        return h;
fail:
        if (h->fd >= 0)
                close(h->fd);
        free(h);
        return NULL;
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

void http_set_ready_fn(struct http *h, http_ready_fn *fn, void *arg) {
        if (!h)
                return;
        pthread_mutex_lock(&h->ready_lock);
        h->ready_fn = fn;
        h->ready_arg = arg;
        pthread_mutex_unlock(&h->ready_lock);
}

void http_stop(struct http *h) {
        if (!h)
                return;
        MHD_stop_daemon(h->daemon); /* joins its thread, closes every socket */
        pthread_mutex_destroy(&h->ready_lock);
        free(h);
}
