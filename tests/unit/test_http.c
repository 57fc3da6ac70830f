/* test_http.c - the /metrics, /healthz and /readyz server, over plain sockets
 * on 127.0.0.1 with an ephemeral port. */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "http.h"
#include "metrics.h"

static struct http *srv;

static void setup(void) {
        char err[256] = "";
        cr_assert_eq(metrics_init("outbox-relay"), 0);
        srv = http_start("127.0.0.1:0", err, sizeof err);
        cr_assert_not_null(srv, "http_start: %s", err);
        cr_assert_gt(http_port(srv), 0);
}

static void teardown(void) {
        http_stop(srv);
        srv = NULL;
        metrics_destroy();
}

TestSuite(http, .init = setup, .fini = teardown, .timeout = 60);

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void pause_ms(long ms) {
        struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
}

/* A connected socket, or -1 (no assertion: usable from helper threads). */
static int try_connect(int port) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0)
                return -1;
        struct timeval tv = {5, 0};
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
            connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
                close(fd);
                return -1;
        }
        return fd;
}

static int connect_local(int port) {
        int fd = try_connect(port);
        cr_assert_geq(fd, 0, "connect: %s", strerror(errno));
        return fd;
}

/* Sends `request` as is and reads until the server closes; returns the whole
 * response (caller frees, "" when the server closed without one) or NULL on
 * a receive error or timeout. *status gets the status code (0 without one),
 * *minor the HTTP/1.x minor version of the status line. */
static char *try_exchange(int port, const char *request, size_t n, int *status, int *minor) {
        int fd = try_connect(port);
        if (fd < 0)
                return NULL;
        if (send(fd, request, n, MSG_NOSIGNAL) != (ssize_t)n) {
                close(fd);
                return NULL;
        }
        size_t cap = 1 << 16, len = 0;
        char *resp = malloc(cap);
        for (;;) {
                if (!resp)
                        break;
                if (len + 1 == cap) {
                        char *bigger = realloc(resp, cap *= 2);
                        if (!bigger) {
                                free(resp);
                                resp = NULL;
                                break;
                        }
                        resp = bigger;
                }
                ssize_t r = recv(fd, resp + len, cap - 1 - len, 0);
                if (r < 0) {
                        free(resp);
                        resp = NULL;
                        break;
                }
                if (r == 0)
                        break;
                len += (size_t)r;
        }
        close(fd);
        if (!resp)
                return NULL;
        resp[len] = '\0';
        *status = *minor = 0;
        if (len && sscanf(resp, "HTTP/1.%d %d ", minor, status) != 2)
                *status = -1;
        return resp;
}

static char *exchange_v(const char *request, int *status, int *minor) {
        char *resp = try_exchange(http_port(srv), request, strlen(request), status, minor);
        cr_assert_not_null(resp, "recv failed or timed out");
        cr_assert_geq(*status, 0, "bad status line: %.80s", resp);
        return resp;
}

static char *exchange(const char *request, int *status) {
        int minor;
        return exchange_v(request, status, &minor);
}

static char *get(const char *path, int *status) {
        char req[256];
        snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: localhost\r\nUser-Agent: test\r\n\r\n",
                 path);
        return exchange(req, status);
}

static const char *body_of(const char *resp) {
        const char *b = strstr(resp, "\r\n\r\n");
        cr_assert_not_null(b);
        return b + 4;
}

/* Polls `path` until it answers `want` or `timeout_s` pass; returns the last status. */
static int wait_status(const char *path, int want, double timeout_s) {
        double deadline = now_s() + timeout_s;
        int status = 0;
        for (;;) {
                free(get(path, &status));
                if (status == want || now_s() > deadline)
                        return status;
                pause_ms(50);
        }
}

Test(http, metrics_200_with_content_type_and_length) {
        metrics_add(M_BATCHES, NULL, 7);
        int status = 0, minor = -1;
        char *resp = exchange_v("GET /metrics HTTP/1.0\r\n\r\n", &status, &minor);
        cr_expect_eq(status, 200);
        cr_expect_eq(minor, 0, "an HTTP/1.0 request gets an HTTP/1.0 answer: %.40s", resp);
        cr_expect_not_null(
                strstr(resp, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"),
                "%.300s", resp);
        cr_expect_not_null(strstr(resp, "\r\nConnection: close\r\n"));
        const char *body = body_of(resp);
        size_t clen = 0;
        const char *cl = strstr(resp, "\r\nContent-Length: ");
        cr_assert_not_null(cl);
        cr_expect_eq(sscanf(cl, "\r\nContent-Length: %zu", &clen), 1);
        cr_expect_eq(clen, strlen(body));
        cr_expect_not_null(strstr(body, "\noutbox_batches_total 7\n"));
        cr_expect_not_null(strstr(body, "# TYPE outbox_publish_latency_seconds histogram\n"));
        free(resp);
}

Test(http, http_1_1_answered_in_1_1_and_closed) {
        int status = 0, minor = -1;
        char *resp = exchange_v("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", &status, &minor);
        cr_expect_eq(status, 200);
        cr_expect_eq(minor, 1, "%.40s", resp);
        cr_expect_not_null(strstr(resp, "\r\nConnection: close\r\n"), "%s", resp);
        cr_expect_str_eq(body_of(resp), "ok\n");
        free(resp);
}

Test(http, head_has_the_headers_and_no_body) {
        int status = 0;
        char *resp = exchange("HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n", &status);
        cr_expect_eq(status, 200);
        size_t clen = 0;
        const char *cl = strstr(resp, "\r\nContent-Length: ");
        cr_assert_not_null(cl, "%s", resp);
        cr_expect_eq(sscanf(cl, "\r\nContent-Length: %zu", &clen), 1);
        cr_expect_gt(clen, 100, "the length of GET's body");
        cr_expect_str_eq(body_of(resp), "");
        free(resp);
        resp = exchange("HEAD /readyz HTTP/1.0\r\n\r\n", &status);
        cr_expect_eq(status, 503);
        cr_expect_str_eq(body_of(resp), "");
        free(resp);
}

Test(http, metrics_ignores_query_string) {
        int status = 0;
        free(get("/metrics?name[]=x", &status));
        cr_expect_eq(status, 200);
}

Test(http, healthz_follows_heartbeat) {
        int status = 0;
        http_heartbeat(srv);
        char *resp = get("/healthz", &status);
        cr_expect_eq(status, 200);
        cr_expect_str_eq(body_of(resp), "ok\n");
        free(resp);

        http_set_stall(srv, 1);
        double t0 = now_s();
        cr_expect_eq(wait_status("/healthz", 503, 5), 503, "no 503 after a 1 s stall");
        cr_expect_geq(now_s() - t0, 0.9, "503 before the stall limit");

        http_heartbeat(srv);
        cr_expect_eq(wait_status("/healthz", 200, 0), 200, "heartbeat did not restore 200");
}

Test(http, healthz_200_right_after_start) {
        int status = 0;
        free(get("/healthz", &status));
        cr_expect_eq(status, 200);
}

/* A readiness answer the test sets: ready or not, with one condition. */
static int test_ready;
static int ready_fn(void *arg, struct buf *body) {
        (void)arg;
        return buf_appendf(body,
                           "{\"ready\":%s,\"conditions\":{\"test\":{\"ok\":%s,"
                           "\"reason\":\"set by the test\"}}}\n",
                           test_ready ? "true" : "false", test_ready ? "true" : "false")
                       ? -1
                       : test_ready;
}

Test(http, readyz_answers_what_the_readiness_function_says) {
        int status = 0;
        char *resp = get("/readyz", &status);
        cr_expect_eq(status, 503);
        cr_expect(strstr(body_of(resp), "\"ready\":false") != NULL, "%s", body_of(resp));
        cr_expect(strstr(resp, "application/json") != NULL);
        free(resp);

        test_ready = 1;
        http_set_ready_fn(srv, ready_fn, NULL);
        resp = get("/readyz", &status);
        cr_expect_eq(status, 200);
        cr_expect(strstr(body_of(resp), "\"ready\":true") != NULL, "%s", body_of(resp));
        free(resp);

        test_ready = 0;
        resp = get("/readyz", &status);
        cr_expect_eq(status, 503);
        cr_expect(strstr(body_of(resp), "\"reason\":\"set by the test\"") != NULL);
        free(resp);
        http_set_ready_fn(srv, NULL, NULL);
}

Test(http, unknown_path_404) {
        int status = 0;
        free(get("/nope", &status));
        cr_expect_eq(status, 404);
        free(get("/metricsx", &status));
        cr_expect_eq(status, 404);
        free(get("/", &status));
        cr_expect_eq(status, 404);
}

Test(http, other_methods_405) {
        int status = 0;
        char *resp = exchange("POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n", &status);
        cr_expect_eq(status, 405);
        cr_expect_not_null(strstr(resp, "\r\nAllow: GET, HEAD\r\n"), "%s", resp);
        free(resp);
        free(exchange("DELETE /healthz HTTP/1.1\r\nHost: x\r\n\r\n", &status));
        cr_expect_eq(status, 405);
        free(exchange("POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nabcde",
                      &status));
        cr_expect_eq(status, 405);
}

/* Garbage is refused (400, 431, 505, or closed without an answer): at once,
 * or, when it never ends a line, at the idle timeout. The server goes on
 * serving. */
Test(http, garbage_refused) {
        static const char big_header[] = "GET /healthz HTTP/1.1\r\nX: ";
        char *big = malloc(40000);
        cr_assert_not_null(big);
        memcpy(big, big_header, sizeof big_header - 1);
        memset(big + sizeof big_header - 1, 'a', 30000);
        strcpy(big + sizeof big_header - 1 + 30000, "\r\n\r\n");
        const struct {
                const char *req;
                size_t len;
        } cases[] = {
                {"GARBAGE\r\n\r\n", 11},
                {"GARBAGE / x\r\n\r\n", 15},
                {"GET /healthz\r\n", 14}, /* HTTP/0.9 is not served */
                {"GET /healthz HTTP/2.0\r\n\r\n", 25},
                {"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11}, /* a TLS ClientHello */
                {"\0\0\0\0\r\n\r\n", 8},
                {"GET /healthz HTTP/1.1\r\nBad Header\r\n\r\n", 38},
                {big, strlen(big)},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                int status = -2, minor = 0;
                double t0 = now_s();
                char *resp =
                        try_exchange(http_port(srv), cases[i].req, cases[i].len, &status, &minor);
                cr_assert_not_null(resp, "case %zu: no answer and no close", i);
                cr_expect_lt(now_s() - t0, 3.5, "case %zu took %.2f s", i, now_s() - t0);
                cr_expect(status == 0 || status == 400 || status == 431 || status == 505,
                          "case %zu: status %d", i, status);
                free(resp);
        }
        free(big);
        int status = 0;
        free(get("/healthz", &status));
        cr_expect_eq(status, 200);
}

Test(http, silent_client_dropped_after_timeout) {
        int fd = connect_local(http_port(srv));
        double t0 = now_s();
        char c;
        ssize_t r = recv(fd, &c, 1, 0);
        double took = now_s() - t0;
        close(fd);
        cr_expect_eq(r, 0, "server did not close the idle connection");
        cr_expect_geq(took, 1.5);
        cr_expect_lt(took, 4.0);
        int status = 0;
        free(get("/healthz", &status)); /* still serving */
        cr_expect_eq(status, 200);
}

/* Clients that misbehave while the probes run: IDLE connections that send
 * nothing (reopened as soon as the server drops them) and SLOW ones that send
 * a request one byte every 200 ms and never finish it. */
#define IDLE 100
#define SLOW 10

struct abuse {
        int port;
        volatile int stop;
        int idle[IDLE], slow[SLOW];
        size_t slow_sent[SLOW];
        int reopened;
};

static void *abuse_thread(void *arg) {
        static const char request[] = "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "
                                      "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
        struct abuse *a = arg;
        while (!a->stop) {
                for (int i = 0; i < IDLE; i++) {
                        char c;
                        if (recv(a->idle[i], &c, 1, MSG_DONTWAIT) == 0) {
                                close(a->idle[i]);
                                a->idle[i] = try_connect(a->port);
                                a->reopened++;
                        }
                }
                for (int i = 0; i < SLOW; i++) {
                        size_t n = a->slow_sent[i]++ % (sizeof request - 1);
                        (void)send(a->slow[i], request + n, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
                }
                pause_ms(200);
        }
        return NULL;
}

Test(http, probes_answer_within_100ms_beside_idle_and_slow_clients) {
        struct abuse a = {.port = http_port(srv)};
        for (int i = 0; i < IDLE; i++)
                a.idle[i] = connect_local(a.port);
        for (int i = 0; i < SLOW; i++)
                a.slow[i] = connect_local(a.port);
        pthread_t t;
        cr_assert_eq(pthread_create(&t, NULL, abuse_thread, &a), 0);
        pause_ms(200);

        /* past the idle timeout, so dropped idle clients have come back */
        double worst = 0, deadline = now_s() + 5.0;
        int probes = 0;
        while (now_s() < deadline) {
                int status = 0;
                double t0 = now_s();
                free(get(probes % 2 ? "/healthz" : "/readyz", &status));
                double took = now_s() - t0;
                worst = took > worst ? took : worst;
                cr_expect_eq(status, probes % 2 ? 200 : 503);
                probes++;
                pause_ms(100);
        }
        a.stop = 1;
        pthread_join(t, NULL);
        for (int i = 0; i < IDLE; i++)
                if (a.idle[i] >= 0)
                        close(a.idle[i]);
        for (int i = 0; i < SLOW; i++)
                close(a.slow[i]);
        cr_expect_lt(worst, 0.100, "slowest probe: %.3f s over %d probes", worst, probes);
        cr_expect_gt(probes, 20);
        cr_expect_gt(a.reopened, 0, "the idle clients were never dropped");
}

/* 200 scrapes at once all get their 200 (none refused by a connection limit). */
#define SCRAPERS 200

struct scraper {
        int port;
        pthread_barrier_t *start;
        int status;
};

static void *scrape_thread(void *arg) {
        struct scraper *s = arg;
        static const char req[] = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
        int minor;
        pthread_barrier_wait(s->start);
        char *resp = try_exchange(s->port, req, sizeof req - 1, &s->status, &minor);
        if (resp && !strstr(resp, "\noutbox_build_info{"))
                s->status = -3;
        free(resp);
        return NULL;
}

Test(http, two_hundred_concurrent_scrapes) {
        static struct scraper s[SCRAPERS];
        static pthread_t t[SCRAPERS];
        pthread_barrier_t start;
        cr_assert_eq(pthread_barrier_init(&start, NULL, SCRAPERS), 0);
        for (int i = 0; i < SCRAPERS; i++) {
                s[i] = (struct scraper){.port = http_port(srv), .start = &start, .status = -1};
                cr_assert_eq(pthread_create(&t[i], NULL, scrape_thread, &s[i]), 0);
        }
        int ok = 0;
        for (int i = 0; i < SCRAPERS; i++) {
                pthread_join(t[i], NULL);
                ok += s[i].status == 200;
        }
        pthread_barrier_destroy(&start);
        cr_expect_eq(ok, SCRAPERS, "%d of %d scrapes answered 200", ok, SCRAPERS);
}

static int open_fds(void) {
        DIR *d = opendir("/proc/self/fd");
        int n = 0;
        cr_assert_not_null(d);
        while (readdir(d))
                n++;
        closedir(d);
        return n;
}

Test(http, stop_returns_quickly_and_closes_every_socket) {
        http_stop(srv);
        srv = NULL;
        int before = open_fds();
        char err[256];
        srv = http_start("127.0.0.1:0", err, sizeof err);
        cr_assert_not_null(srv, "%s", err);
        int status = 0;
        free(get("/healthz", &status));
        int fd = connect_local(http_port(srv)); /* a client still connected */
        pause_ms(100);
        double t0 = now_s();
        http_stop(srv);
        srv = NULL;
        cr_expect_lt(now_s() - t0, 0.5, "http_stop took %.3f s", now_s() - t0);
        close(fd);
        cr_expect_eq(open_fds(), before, "descriptors left open by the server");
}

Test(http, bad_addresses_fail_with_errstr) {
        const char *bad[] = {"nonsense",     "127.0.0.1:99999", "127.0.0.1:",
                             "127.0.0.1:x1", "::1:80",          "no-such-host.invalid:0"};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
                char err[256] = "";
                struct http *h = http_start(bad[i], err, sizeof err);
                cr_expect_null(h, "%s accepted", bad[i]);
                http_stop(h);
                cr_expect_neq(err[0], '\0', "%s: empty errstr", bad[i]);
        }
        http_stop(NULL);
}

Test(http, port_in_use_fails) {
        char addr[64], err[256] = "";
        snprintf(addr, sizeof addr, "127.0.0.1:%d", http_port(srv));
        struct http *h = http_start(addr, err, sizeof err);
        cr_expect_null(h);
        http_stop(h);
        cr_expect_not_null(strstr(err, "in use"), "errstr: %s", err);
}

Test(http, wildcard_and_name) {
        char err[256] = "";
        struct http *h = http_start("0.0.0.0:0", err, sizeof err);
        cr_assert_not_null(h, "%s", err);
        cr_expect_gt(http_port(h), 0);
        http_stop(h);
        h = http_start("localhost:0", err, sizeof err);
        cr_assert_not_null(h, "%s", err);
        http_stop(h);
}
