/* Unit tests of registry: request shape, id cache, error codes. The registry
 * is a tiny HTTP server on a thread of the test process (127.0.0.1:0). */
#define _GNU_SOURCE /* strcasestr */
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "registry.h"

struct server {
        int fd;
        int port;
        pthread_t thread;
        const char *status; /* "200 OK" */
        const char *body;
        int hang_ms;        /* wait before answering (timeouts) */
        char request[8192]; /* the last request, head and body */
        int served;
};

static struct server srv;
static struct registry *reg;
static char err[512];

static void *serve(void *arg) {
        struct server *s = arg;
        for (;;) {
                int c = accept(s->fd, NULL, NULL);
                if (c < 0)
                        return NULL;
                size_t n = 0;
                ssize_t k;
                /* read head and body (Content-Length) */
                while ((k = read(c, s->request + n, sizeof s->request - 1 - n)) > 0) {
                        n += (size_t)k;
                        s->request[n] = '\0';
                        char *end = strstr(s->request, "\r\n\r\n");
                        const char *cl = strcasestr(s->request, "Content-Length:");
                        if (end && (!cl || strlen(end + 4) >= (size_t)atoi(cl + 15)))
                                break;
                }
                if (s->hang_ms)
                        usleep((useconds_t)s->hang_ms * 1000);
                char resp[1024];
                int len = snprintf(resp, sizeof resp,
                                   "HTTP/1.1 %s\r\nContent-Type: application/json\r\n"
                                   "Content-Length: %zu\r\nConnection: close\r\n\r\n%s",
                                   s->status, strlen(s->body), s->body);
                if (write(c, resp, (size_t)len) < 0) {
                        /* the client gave up (timeout test) */
                }
                s->served++;
                close(c);
        }
}

static void init(void) {
        memset(&srv, 0, sizeof srv);
        srv.status = "200 OK";
        srv.body = "{\"id\":42}";
        srv.fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t al = sizeof a;
        cr_assert_eq(bind(srv.fd, (struct sockaddr *)&a, sizeof a), 0);
        cr_assert_eq(listen(srv.fd, 16), 0);
        getsockname(srv.fd, (struct sockaddr *)&a, &al);
        srv.port = ntohs(a.sin_port);
        pthread_create(&srv.thread, NULL, serve, &srv);
}

static void fini(void) {
        registry_destroy(reg);
        reg = NULL;
        shutdown(srv.fd, SHUT_RDWR);
        close(srv.fd);
        pthread_join(srv.thread, NULL);
}
TestSuite(registry, .init = init, .fini = fini);

static struct registry *client(const char *userinfo) {
        char url[128];
        snprintf(url, sizeof url, "http://%s127.0.0.1:%d/", userinfo, srv.port);
        struct registry *r = registry_new(url, 1, err, sizeof err);
        cr_assert(r, "%s", err);
        return r;
}

Test(registry, registers_and_caches_per_subject) {
        reg = client("");
        int id = -1;
        struct registry_error why = {0};
        cr_assert_eq(registry_schema_id(reg, "orders-value", "{\"type\":\"string\"}", &id, &why,
                                        err, sizeof err),
                     0, "%s", err);
        cr_assert_eq(id, 42);
        cr_assert(strstr(srv.request, "POST /subjects/orders-value/versions HTTP/1.1\r\n"), "%s",
                  srv.request);
        cr_assert(strcasestr(srv.request, "Content-Type: application/vnd.schemaregistry.v1+json"));
        cr_assert(strstr(srv.request, "\r\n\r\n{\"schema\":\"{\\\"type\\\":\\\"string\\\"}\"}"),
                  "%s", srv.request);
        /* cached: no second request */
        srv.body = "{\"id\":7}";
        cr_assert_eq(registry_schema_id(reg, "orders-value", "{\"type\":\"string\"}", &id, &why,
                                        err, sizeof err),
                     0);
        cr_assert_eq(id, 42);
        cr_assert_eq(registry_requests(reg), 1);
        /* another subject: asked */
        cr_assert_eq(registry_schema_id(reg, "a b/c-value", "{\"type\":\"string\"}", &id, &why, err,
                                        sizeof err),
                     0);
        cr_assert_eq(id, 7);
        cr_assert(strstr(srv.request, "POST /subjects/a%20b%2Fc-value/versions "), "%s",
                  srv.request);
        cr_assert_eq(registry_requests(reg), 2);
}

Test(registry, rejected_is_its_own_code) {
        reg = client("");
        srv.status = "409 Conflict";
        srv.body = "{\"error_code\":409,\"message\":\"Schema being registered is incompatible\"}";
        int id = -1;
        struct registry_error why = {0};
        cr_assert_eq(registry_schema_id(reg, "s-value", "\"string\"", &id, &why, err, sizeof err),
                     -1);
        cr_assert_str_eq(why.code, "REGISTRY_REJECTED");
        cr_assert(!why.unavailable);
        cr_assert(strstr(err, "HTTP 409: Schema being registered is incompatible"), "%s", err);
        /* not negatively cached: the next call asks again */
        srv.status = "200 OK";
        srv.body = "{\"id\":3}";
        cr_assert_eq(registry_schema_id(reg, "s-value", "\"string\"", &id, &why, err, sizeof err),
                     0);
        cr_assert_eq(id, 3);
}

Test(registry, server_error_is_unavailable_and_not_retried_at_once) {
        reg = client("user:hunter2@");
        srv.status = "503 Service Unavailable";
        srv.body = "{}";
        int id = -1;
        struct registry_error why = {0};
        cr_assert_eq(registry_schema_id(reg, "s-value", "\"string\"", &id, &why, err, sizeof err),
                     -1);
        cr_assert_str_eq(why.code, "REGISTRY_UNAVAILABLE");
        cr_assert(why.unavailable);
        cr_assert(strstr(err, "HTTP 503"), "%s", err);
        cr_assert(!strstr(err, "hunter2"), "password in %s", err);
        cr_assert(strstr(err, "://user:****@127.0.0.1:"), "%s", err);
        cr_assert(strcasestr(srv.request, "Authorization: Basic "), "userinfo is basic auth");
        srv.status = "200 OK";
        cr_assert_eq(registry_schema_id(reg, "s-value", "\"string\"", &id, &why, err, sizeof err),
                     -1);
        cr_assert_str_eq(why.code, "REGISTRY_UNAVAILABLE");
        cr_assert(why.unavailable);
        cr_assert_eq(registry_requests(reg), 1, "asked again within REGISTRY_RETRY_MS");
        srv.body = "{\"id\":5}";
        usleep((REGISTRY_RETRY_MS + 100) * 1000);
        cr_assert_eq(registry_schema_id(reg, "s-value", "\"string\"", &id, &why, err, sizeof err),
                     0, "%s", err);
        cr_assert_eq(id, 5);
}

Test(registry, connection_refused_and_bad_body) {
        /* a port nobody listens on */
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t al = sizeof a;
        bind(fd, (struct sockaddr *)&a, sizeof a);
        getsockname(fd, (struct sockaddr *)&a, &al);
        close(fd);
        char url[64];
        snprintf(url, sizeof url, "http://127.0.0.1:%d", ntohs(a.sin_port));
        reg = registry_new(url, 1, err, sizeof err);
        cr_assert(reg);
        int id;
        struct registry_error why;
        cr_assert_eq(registry_schema_id(reg, "s-value", "\"string\"", &id, &why, err, sizeof err),
                     -1);
        cr_assert_str_eq(why.code, "REGISTRY_UNAVAILABLE");
        cr_assert(why.unavailable);
        registry_destroy(reg);

        reg = client("");
        srv.body = "{\"no\":\"id\"}";
        cr_assert_eq(registry_schema_id(reg, "s-value", "\"string\"", &id, &why, err, sizeof err),
                     -1);
        cr_assert_str_eq(why.code, "REGISTRY_REJECTED");
        cr_assert(!why.unavailable);
}

Test(registry, slow_registry_times_out, .timeout = 20) {
        reg = client("");
        srv.hang_ms = REGISTRY_TIMEOUT_MS + 1500;
        int id;
        struct registry_error why;
        cr_assert_eq(registry_schema_id(reg, "s-value", "\"string\"", &id, &why, err, sizeof err),
                     -1);
        cr_assert_str_eq(why.code, "REGISTRY_UNAVAILABLE");
        cr_assert(why.unavailable);
        cr_assert(strstr(err, "imeout") || strstr(err, "timed out"), "%s", err);
}

Test(registry, lookup_only_asks_the_subject_and_never_registers) {
        char url[128];
        int id;
        struct registry_error why;
        snprintf(url, sizeof url, "http://127.0.0.1:%d", srv.port);
        reg = registry_new(url, 0, err, sizeof err);
        cr_assert(reg, "%s", err);
        srv.body = "{\"subject\":\"o-value\",\"version\":3,\"id\":7,\"schema\":\"\\\"string\\\"\"}";
        cr_assert_eq(registry_schema_id(reg, "o-value", "\"string\"", &id, &why, err, sizeof err),
                     0, "%s", err);
        cr_assert_eq(id, 7);
        cr_assert(strstr(srv.request, "POST /subjects/o-value HTTP/1.1"), "%s", srv.request);
        cr_assert_null(strstr(srv.request, "/versions"));

        srv.status = "404 Not Found";
        srv.body = "{\"error_code\":40403,\"message\":\"Schema not found\"}";
        cr_assert_eq(registry_schema_id(reg, "p-value", "\"string\"", &id, &why, err, sizeof err),
                     -1);
        cr_assert_str_eq(why.code, "REGISTRY_REJECTED");
        cr_assert(!why.unavailable);
        cr_assert(strstr(err, "not registered"), "%s", err);
        cr_assert(strstr(err, "Schema not found"), "%s", err);
}

Test(registry, url_must_be_http) {
        cr_assert_null(registry_new("ftp://x", 1, err, sizeof err));
        cr_assert(strstr(err, "http://"), "%s", err);
}
