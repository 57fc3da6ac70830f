/* http.h - /metrics, /healthz and /readyz over libmicrohttpd on its own
 * thread (GET and HEAD, HTTP/1.0 and 1.1, one request per connection). */
#ifndef OUTBOX_HTTP_H
#define OUTBOX_HTTP_H

#include <stddef.h>

struct http;

/* Listens on `addr` ("host:port"; port 0 picks a free one) and serves on a
 * background thread. NULL on failure (errstr says why). */
struct http *http_start(const char *addr, char *errstr, size_t errstr_size);

/* The port actually bound. */
int http_port(const struct http *h);

/* The main loop calls this every turn: /healthz answers 200 while the last
 * call is at most `stall_s` seconds old (set by http_set_stall, default 60). */
void http_heartbeat(struct http *h);
void http_set_stall(struct http *h, int stall_s);

/* /readyz answers 200 while the last value set is nonzero. */
void http_set_ready(struct http *h, int ready);

/* Stops the thread, closes every socket, frees. NULL is a no-op. */
void http_stop(struct http *h);

#endif
