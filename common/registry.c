/* registry.c - schema registry client: POST /subjects/<s>/versions, id cache. */
#include "registry.h"

#include <curl/curl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "encode.h"

#define BUCKETS  256
#define MAX_BODY (64 * 1024)

static const struct registry_error unavailable = {"REGISTRY_UNAVAILABLE", 1};
static const struct registry_error rejected = {"REGISTRY_REJECTED", 0};

struct entry {
        struct entry *next;
        uint64_t schema_hash;
        int id;
        char subject[];
};

struct registry {
        char *url; /* without a trailing '/' */
        char redacted[512];
        CURL *curl;
        struct curl_slist *headers;
        struct entry *buckets[BUCKETS];
        int auto_register; /* POST .../versions (register) or POST /subjects/<s> (look up) */
        double down_until; /* monotonic seconds */
        char down_reason[200];
        unsigned long requests;
};

static uint64_t fnv1a(const char *s) {
        uint64_t h = 0xcbf29ce484222325ULL;
        for (; *s; s++)
                h = (h ^ (unsigned char)*s) * 0x100000001b3ULL;
        return h;
}

/* url with its password replaced by ****, through libcurl's own URL parser
 * (what the requests use); "(not a URL)" when it cannot parse it. */
static void redact_url(const char *url, char *out, size_t size) {
        CURLU *u = curl_url();
        char *pw = NULL, *shown = NULL;
        if (u && curl_url_set(u, CURLUPART_URL, url, 0) == CURLUE_OK) {
                if (curl_url_get(u, CURLUPART_PASSWORD, &pw, 0) != CURLUE_OK ||
                    curl_url_set(u, CURLUPART_PASSWORD, "****", 0) == CURLUE_OK)
                        (void)curl_url_get(u, CURLUPART_URL, &shown, 0);
        }
        snprintf(out, size, "%s", shown ? shown : "(not a URL)");
        curl_free(pw);
        curl_free(shown);
        curl_url_cleanup(u);
}

struct registry *registry_new(const char *url, int auto_register, char *errstr,
                              size_t errstr_size) {
        if (strncmp(url, "http://", 7) && strncmp(url, "https://", 8)) {
                snprintf(errstr, errstr_size,
                         "schema registry URL must start with http:// or https://");
                return NULL;
        }
        struct registry *reg = calloc(1, sizeof *reg);
        if (!reg || curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
                free(reg);
                snprintf(errstr, errstr_size, "cannot initialise libcurl");
                return NULL;
        }
        reg->auto_register = auto_register;
        reg->url = strdup(url);
        if (!reg->url)
                goto oom;
        size_t n = strlen(reg->url);
        while (n > 0 && reg->url[n - 1] == '/')
                reg->url[--n] = '\0';
        redact_url(reg->url, reg->redacted, sizeof reg->redacted);
        reg->curl = curl_easy_init();
        reg->headers =
                curl_slist_append(NULL, "Content-Type: application/vnd.schemaregistry.v1+json");
        struct curl_slist *h =
                reg->headers ? curl_slist_append(reg->headers,
                                                 "Accept: application/vnd.schemaregistry.v1+json, "
                                                 "application/json")
                             : NULL;
        if (!reg->curl || !h)
                goto oom;
        reg->headers = h;
        return reg;
oom:
        registry_destroy(reg);
        snprintf(errstr, errstr_size, "out of memory");
        return NULL;
}

void registry_destroy(struct registry *reg) {
        if (!reg)
                return;
        for (int i = 0; i < BUCKETS; i++) {
                for (struct entry *e = reg->buckets[i], *next; e; e = next) {
                        next = e->next;
                        free(e);
                }
        }
        curl_slist_free_all(reg->headers);
        if (reg->curl)
                curl_easy_cleanup(reg->curl);
        free(reg->url);
        free(reg);
        curl_global_cleanup();
}

unsigned long registry_requests(const struct registry *reg) {
        return reg->requests;
}

static size_t on_body(char *data, size_t size, size_t nmemb, void *ctx) {
        struct buf *b = ctx;
        size_t n = size * nmemb;
        if (b->len + n > MAX_BODY || buf_append(b, data, n) != 0)
                return 0; /* aborts the transfer */
        return n;
}

/* Finds the integer after "key": in a JSON object body; 0 if found. */
static int json_int(const char *body, const char *key, long long *out) {
        char pat[64];
        snprintf(pat, sizeof pat, "\"%s\"", key);
        const char *p = strstr(body, pat);
        if (!p)
                return -1;
        p += strlen(pat);
        while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
                p++;
        if (*p++ != ':')
                return -1;
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p)
                return -1;
        *out = v;
        return 0;
}

/* Copies the "message" string of an error body (roughly, for the log). */
static void json_message(const char *body, char *out, size_t size) {
        const char *p = strstr(body, "\"message\"");
        out[0] = '\0';
        if (!p || !(p = strchr(p + 9, '"')))
                return;
        p++;
        size_t i = 0;
        while (*p && *p != '"' && i + 1 < size) {
                if (*p == '\\' && p[1])
                        p++;
                out[i++] = *p++;
        }
        out[i] = '\0';
}

int registry_parse_reply(long status, const char *body, int *id, const char **code, char *msg,
                         size_t msg_size) {
        long long v;
        msg[0] = '\0';
        if (status == 200 && json_int(body, "id", &v) == 0 && v >= 0 && v <= INT32_MAX) {
                *id = (int)v;
                return 0;
        }
        json_message(body, msg, msg_size);
        *code = status >= 500 || status == 429 ? "REGISTRY_UNAVAILABLE" : "REGISTRY_REJECTED";
        return -1;
}

/* One POST (register, or look up); 0 with *id, or -1 with *why and errstr. */
static int lookup(struct registry *reg, const char *subject, const char *schema_json, int *id,
                  struct registry_error *why, char *errstr, size_t errstr_size) {
        struct buf url = {0}, body = {0}, resp = {0};
        char *esc = curl_easy_escape(reg->curl, subject, 0);
        int rc = -1;
        *why = unavailable;
        if (!esc ||
            buf_appendf(&url, "%s/subjects/%s%s", reg->url, esc,
                        reg->auto_register ? "/versions" : "") ||
            buf_append(&body, "{\"schema\":", 10) || buf_append_json_string(&body, schema_json) ||
            buf_append(&body, "}", 1)) {
                snprintf(errstr, errstr_size, "out of memory");
                goto done;
        }
        CURL *c = reg->curl;
        curl_easy_reset(c);
        curl_easy_setopt(c, CURLOPT_URL, url.data);
        curl_easy_setopt(c, CURLOPT_HTTPHEADER, reg->headers);
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.data);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)body.len);
        curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
        curl_easy_setopt(c, CURLOPT_WRITEDATA, &resp);
        curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)REGISTRY_TIMEOUT_MS);
        curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, (long)REGISTRY_CONNECT_TIMEOUT_MS);
        curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
        reg->requests++;
        CURLcode cc = curl_easy_perform(c);
        if (cc != CURLE_OK) {
                snprintf(errstr, errstr_size, "schema registry %s: %s", reg->redacted,
                         curl_easy_strerror(cc));
                goto done;
        }
        long status = 0;
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
        char msg[120];
        const char *code;
        if (registry_parse_reply(status, resp.data ? resp.data : "", id, &code, msg, sizeof msg) ==
            0) {
                rc = 0;
                goto done;
        }
        if (strcmp(code, unavailable.code) != 0)
                *why = rejected;
        snprintf(errstr, errstr_size, "schema registry %s: subject %s: HTTP %ld%s%s%s",
                 reg->redacted, subject, status,
                 !reg->auto_register && status == 404 ? " (not registered; auto-registration off)"
                                                      : "",
                 *msg ? ": " : "", msg);
done:
        curl_free(esc);
        buf_free(&url);
        buf_free(&body);
        buf_free(&resp);
        return rc;
}

int registry_schema_id(struct registry *reg, const char *subject, const char *schema_json, int *id,
                       struct registry_error *why, char *errstr, size_t errstr_size) {
        uint64_t sh = fnv1a(schema_json);
        struct entry **slot = &reg->buckets[fnv1a(subject) % BUCKETS];
        for (struct entry **e = slot; *e; e = &(*e)->next) {
                if (strcmp((*e)->subject, subject))
                        continue;
                if ((*e)->schema_hash == sh) {
                        *id = (*e)->id;
                        return 0;
                }
                struct entry *stale = *e; /* same subject, another schema */
                *e = stale->next;
                free(stale);
                break;
        }
        if (reg->down_until > clock_mono_s()) {
                *why = unavailable;
                snprintf(errstr, errstr_size, "%s (not retried for %d ms)", reg->down_reason,
                         REGISTRY_RETRY_MS);
                return -1;
        }
        if (lookup(reg, subject, schema_json, id, why, errstr, errstr_size) != 0) {
                if (why->unavailable) {
                        reg->down_until = clock_mono_s() + REGISTRY_RETRY_MS / 1000.0;
                        snprintf(reg->down_reason, sizeof reg->down_reason, "%s", errstr);
                }
                return -1;
        }
        reg->down_until = 0;
        size_t n = strlen(subject);
        struct entry *e = malloc(sizeof *e + n + 1);
        if (e) { /* no memory: just not cached */
                memcpy(e->subject, subject, n + 1);
                e->schema_hash = sh;
                e->id = *id;
                e->next = *slot;
                *slot = e;
        }
        return 0;
}
