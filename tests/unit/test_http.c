/* test_http.c - the /metrics, /healthz and /readyz server, over plain sockets
 * on 127.0.0.1 with an ephemeral port. */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <netinet/in.h>
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

TestSuite(http, .init = setup, .fini = teardown, .timeout = 30);

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int connect_local(int port) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        cr_assert_geq(fd, 0);
        struct timeval tv = {5, 0};
        cr_assert_eq(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv), 0);
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
        return fd;
}

/* Sends `request` as is and returns the whole response (caller frees); *status
 * gets the status code. */
static char *exchange(const char *request, int *status) {
        int fd = connect_local(http_port(srv));
        size_t n = strlen(request);
        cr_assert_eq(send(fd, request, n, MSG_NOSIGNAL), (ssize_t)n);
        size_t cap = 1 << 16, len = 0;
        char *resp = malloc(cap);
        cr_assert_not_null(resp);
        for (;;) {
                if (len + 1 == cap) {
                        cap *= 2;
                        resp = realloc(resp, cap);
                        cr_assert_not_null(resp);
                }
                ssize_t r = recv(fd, resp + len, cap - 1 - len, 0);
                cr_assert_geq(r, 0, "recv failed or timed out");
                if (r == 0)
                        break;
                len += (size_t)r;
        }
        resp[len] = '\0';
        close(fd);
        cr_assert_eq(sscanf(resp, "HTTP/1.0 %d ", status), 1, "bad status line: %.80s", resp);
        return resp;
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
                struct timespec pause = {0, 50 * 1000000L};
                nanosleep(&pause, NULL);
        }
}

Test(http, metrics_200_with_content_type_and_length) {
        metrics_add(M_BATCHES, NULL, 7);
        int status = 0;
        char *resp = get("/metrics", &status);
        cr_expect_eq(status, 200);
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

Test(http, readyz_follows_set_ready) {
        int status = 0;
        char *resp = get("/readyz", &status);
        cr_expect_eq(status, 503);
        cr_expect_str_eq(body_of(resp), "not ready\n");
        free(resp);

        http_set_ready(srv, 1);
        resp = get("/readyz", &status);
        cr_expect_eq(status, 200);
        cr_expect_str_eq(body_of(resp), "ready\n");
        free(resp);

        http_set_ready(srv, 0);
        free(get("/readyz", &status));
        cr_expect_eq(status, 503);
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

Test(http, non_get_405) {
        int status = 0;
        char *resp = exchange("POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n", &status);
        cr_expect_eq(status, 405);
        cr_expect_not_null(strstr(resp, "\r\nAllow: GET\r\n"));
        free(resp);
        free(exchange("DELETE /healthz HTTP/1.1\r\nHost: x\r\n\r\n", &status));
        cr_expect_eq(status, 405);
}

Test(http, malformed_400) {
        int status = 0;
        free(exchange("GARBAGE\r\n\r\n", &status));
        cr_expect_eq(status, 400);
}

Test(http, bare_request_line_answered_at_once) {
        int status = 0;
        double t0 = now_s();
        free(exchange("GET /healthz\r\n", &status));
        cr_expect_eq(status, 200);
        cr_expect_lt(now_s() - t0, 1.0);
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

Test(http, stop_returns_quickly) {
        int status = 0;
        free(get("/healthz", &status));
        double t0 = now_s();
        http_stop(srv);
        srv = NULL;
        cr_expect_lt(now_s() - t0, 0.5, "http_stop took %.3f s", now_s() - t0);
}

Test(http, stop_with_a_silent_client_connected) {
        int fd = connect_local(http_port(srv));
        struct timespec pause = {0, 100 * 1000000L};
        nanosleep(&pause, NULL); /* let the thread pick it up */
        double t0 = now_s();
        http_stop(srv);
        srv = NULL;
        cr_expect_lt(now_s() - t0, 0.5, "http_stop took %.3f s", now_s() - t0);
        close(fd);
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
