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

/* /readyz: fn fills body with the conditions as a small JSON object and
 * returns 1 (ready: 200), 0 (not ready: 503) or -1 (out of memory). It runs
 * on the server's thread, whenever a probe asks, so it must only read state
 * it can read safely while the main loop runs (or is stuck). Without fn,
 * /readyz answers 503. Set it before the first probe can come. */
struct buf;
typedef int(http_ready_fn)(void *arg, struct buf *body);
void http_set_ready_fn(struct http *h, http_ready_fn *fn, void *arg);

/* Stops the thread, closes every socket, frees. NULL is a no-op. */
void http_stop(struct http *h);

#endif
