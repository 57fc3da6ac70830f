/*
 * mockbroker.c - librdkafka's mock Kafka cluster as a standalone process,
 * for the tests and the local demo (there is no Kafka broker package here).
 *
 * usage: outbox-mockbroker [-b BROKERS] [-f BOOTSTRAP_FILE] [-c CONTROL_FILE]
 *                          [topic:partitions ...]
 *
 *   -b N     number of brokers (default 3), ids 1..N
 *   -f FILE  write the bootstrap address (one line) to FILE, atomically
 *   -c FILE  write the control address (one line) to FILE, atomically
 *   -p N     refused: librdkafka 2.0.2's mock API has no way to change the
 *            partition count of auto-created topics, which is always 4.
 *            Pre-create topics (positional args or the `topic` command).
 *   topic:partitions  topics created before the cluster is announced
 *            (replication factor min(3, brokers)).
 *
 * Once ready it prints, flushed, on stdout:
 *   BOOTSTRAP=127.0.0.1:PORT,...
 *   CONTROL=127.0.0.1:PORT
 *
 * CONTROL is a line protocol on 127.0.0.1, served by the main thread; each
 * command line gets exactly one answer line, "OK ..." or "ERR message":
 *   ping                      OK pong
 *   down | up                 all brokers down / up
 *   down ID | up ID           one broker (1..N)
 *   produce_errors N ERRNAME  the next N Produce requests fail with ERRNAME
 *                             (librdkafka name without RD_KAFKA_RESP_ERR_,
 *                             e.g. NOT_ENOUGH_REPLICAS, REQUEST_TIMED_OUT,
 *                             MSG_SIZE_TOO_LARGE, _TRANSPORT = disconnect)
 *   clear_errors              drop queued Produce errors
 *   rtt ID|all MS             delay broker responses by MS milliseconds
 *   topic NAME PARTS          create a topic
 *   quit                      close this control connection
 *
 * Signals: SIGTERM/SIGINT exit 0; SIGUSR1 all brokers down; SIGUSR2 all up.
 * Exit codes: 0 clean stop, 1 runtime failure, 2 usage.
 *
 * build: cc -std=gnu11 -o outbox-mockbroker mockbroker.c \
 *           $(pkg-config --cflags --libs rdkafka) -ldl
 */
#define _GNU_SOURCE
#include <librdkafka/rdkafka.h>
#include <librdkafka/rdkafka_mock.h>

#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_CLIENTS       16
#define LINE_SIZE         1024
#define PRODUCE_API_KEY   0 /* Kafka protocol ApiKey of ProduceRequest */
#define MAX_PUSHED_ERRORS 1000000

/*
 * accept() interposition.
 *
 * The mock brokers never set TCP_NODELAY on the sockets they accept, so with
 * Nagle on the server side and delayed ACK on the client side some responses
 * arrive ~40 ms late, which makes every test that waits on the broker slow.
 * Defining accept() in the executable shadows libc's for librdkafka too (it
 * calls accept(), not accept4()). MOCK_NAGLE=1 in the environment keeps
 * librdkafka's default behaviour.
 */
typedef int (*accept_fn)(int, struct sockaddr *, socklen_t *);
static accept_fn real_accept;
static int nodelay_on_accept = 1;

__attribute__((constructor)) static void interpose_init(void) {
        /* POSIX-blessed way to store a dlsym() result in a function pointer */
        *(void **)&real_accept = dlsym(RTLD_NEXT, "accept");
        nodelay_on_accept = getenv("MOCK_NAGLE") == NULL;
}

int accept(int fd, struct sockaddr *addr, socklen_t *addrlen) {
        int s, one = 1;

        if (!real_accept) {
                errno = ENOSYS;
                return -1;
        }
        s = real_accept(fd, addr, addrlen);
        /* Best effort: a socket that refuses the option is still usable. */
        if (s >= 0 && nodelay_on_accept)
                (void)setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        return s;
}

/* Signal state: the handler only sets these; the main loop acts on them. */
static volatile sig_atomic_t sig_stop, sig_down, sig_up;

static void on_signal(int sig) {
        switch (sig) {
        case SIGUSR1: sig_down = 1; break;
        case SIGUSR2: sig_up = 1; break;
        default: sig_stop = 1; break;
        }
}

struct client {
        int fd;         /* -1: free slot */
        size_t len;     /* bytes buffered in line */
        int discarding; /* dropping the rest of an over-long line */
        char line[LINE_SIZE];
};

struct mock {
        rd_kafka_t *rk;
        rd_kafka_mock_cluster_t *mc;
        int broker_cnt;
        int listen_fd;
        struct client clients[MAX_CLIENTS];
};

__attribute__((format(printf, 1, 2))) static void logmsg(const char *fmt, ...) {
        va_list ap;

        fputs("mockbroker: ", stderr);
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fputc('\n', stderr);
}

/* Parses a base-10 integer in [min, max]; returns 0 on success. */
static int parse_int(const char *s, long min, long max, long *out) {
        char *end;
        long v;

        if (!s || !*s)
                return -1;
        errno = 0;
        v = strtol(s, &end, 10);
        if (errno || *end || v < min || v > max)
                return -1;
        *out = v;
        return 0;
}

/* Maps a librdkafka error name ("NOT_ENOUGH_REPLICAS", "_TRANSPORT", with or
 * without the RD_KAFKA_RESP_ERR_ prefix) to its code; returns 0 if found. */
static int err_by_name(const char *name, rd_kafka_resp_err_t *out) {
        const struct rd_kafka_err_desc *descs;
        size_t cnt, i;
        static const char prefix[] = "RD_KAFKA_RESP_ERR_";

        if (strncmp(name, prefix, sizeof prefix - 1) == 0)
                name += sizeof prefix - 1;
        rd_kafka_get_err_descs(&descs, &cnt);
        for (i = 0; i < cnt; i++) {
                if (descs[i].name && strcmp(descs[i].name, name) == 0 &&
                    descs[i].code != RD_KAFKA_RESP_ERR_NO_ERROR) {
                        *out = descs[i].code;
                        return 0;
                }
        }
        return -1;
}

/* Creates topic NAME with PARTS partitions, replication min(3, brokers). */
static int topic_create(struct mock *m, const char *name, int parts, char *errstr,
                        size_t errstr_size) {
        rd_kafka_resp_err_t err;
        int rf = m->broker_cnt < 3 ? m->broker_cnt : 3;

        err = rd_kafka_mock_topic_create(m->mc, name, parts, rf);
        if (err) {
                snprintf(errstr, errstr_size, "topic %s: %s", name, rd_kafka_err2str(err));
                return -1;
        }
        return 0;
}

/* Sets broker ID (or -1 for all) down or up. */
static int broker_set(struct mock *m, int32_t id, int down, char *errstr, size_t errstr_size) {
        rd_kafka_resp_err_t err = down ? rd_kafka_mock_broker_set_down(m->mc, id)
                                       : rd_kafka_mock_broker_set_up(m->mc, id);
        if (err) {
                snprintf(errstr, errstr_size, "broker %d: %s", (int)id, rd_kafka_err2str(err));
                return -1;
        }
        if (id == -1)
                logmsg("all brokers %s", down ? "down" : "up");
        else
                logmsg("broker %d %s", (int)id, down ? "down" : "up");
        return 0;
}

/* Parses "ID" (1..broker_cnt) or "all" (-1). */
static int parse_broker(struct mock *m, const char *s, int32_t *id) {
        long v;

        if (s && strcmp(s, "all") == 0) {
                *id = -1;
                return 0;
        }
        if (parse_int(s, 1, m->broker_cnt, &v))
                return -1;
        *id = (int32_t)v;
        return 0;
}

/*
 * Executes one control command (line without its newline) and writes the
 * answer line (without newline) to reply. Returns 1 if the client asked to
 * close the connection, else 0.
 */
static int control_exec(struct mock *m, char *line, char *reply, size_t reply_size) {
        char errstr[512];
        char *save = NULL;
        char *cmd = strtok_r(line, " \t\r", &save);
        char *a1 = cmd ? strtok_r(NULL, " \t\r", &save) : NULL;
        char *a2 = a1 ? strtok_r(NULL, " \t\r", &save) : NULL;
        char *extra = a2 ? strtok_r(NULL, " \t\r", &save) : NULL;
        int32_t id;
        long n, parts;

        if (!cmd) {
                snprintf(reply, reply_size, "ERR empty command");
        } else if (extra) {
                snprintf(reply, reply_size, "ERR too many arguments");
        } else if (strcmp(cmd, "ping") == 0 && !a1) {
                snprintf(reply, reply_size, "OK pong");
        } else if (strcmp(cmd, "quit") == 0 && !a1) {
                snprintf(reply, reply_size, "OK bye");
                return 1;
        } else if ((strcmp(cmd, "down") == 0 || strcmp(cmd, "up") == 0) && !a2) {
                int down = cmd[0] == 'd';
                if (!a1)
                        id = -1;
                else if (parse_broker(m, a1, &id)) {
                        snprintf(reply, reply_size, "ERR broker id must be 1..%d or all",
                                 m->broker_cnt);
                        return 0;
                }
                if (broker_set(m, id, down, errstr, sizeof errstr))
                        snprintf(reply, reply_size, "ERR %s", errstr);
                else if (id == -1)
                        snprintf(reply, reply_size, "OK all brokers %s", cmd);
                else
                        snprintf(reply, reply_size, "OK broker %d %s", (int)id, cmd);
        } else if (strcmp(cmd, "produce_errors") == 0) {
                rd_kafka_resp_err_t err, *errs;
                long i;

                if (parse_int(a1, 1, MAX_PUSHED_ERRORS, &n) || !a2) {
                        snprintf(reply, reply_size, "ERR usage: produce_errors N(1..%d) ERRNAME",
                                 MAX_PUSHED_ERRORS);
                } else if (err_by_name(a2, &err)) {
                        snprintf(reply, reply_size, "ERR unknown error name %s", a2);
                } else if (!(errs = malloc((size_t)n * sizeof *errs))) {
                        snprintf(reply, reply_size, "ERR out of memory");
                } else {
                        for (i = 0; i < n; i++)
                                errs[i] = err;
                        rd_kafka_mock_push_request_errors_array(m->mc, PRODUCE_API_KEY, (size_t)n,
                                                                errs);
                        free(errs);
                        logmsg("%ld produce errors %s pushed", n, rd_kafka_err2name(err));
                        snprintf(reply, reply_size, "OK %ld %s", n, rd_kafka_err2name(err));
                }
        } else if (strcmp(cmd, "clear_errors") == 0 && !a1) {
                rd_kafka_mock_clear_request_errors(m->mc, PRODUCE_API_KEY);
                snprintf(reply, reply_size, "OK cleared");
        } else if (strcmp(cmd, "rtt") == 0) {
                rd_kafka_resp_err_t err;

                if (parse_broker(m, a1, &id) || parse_int(a2, 0, INT_MAX, &n)) {
                        snprintf(reply, reply_size, "ERR usage: rtt ID|all MS");
                } else if ((err = rd_kafka_mock_broker_set_rtt(m->mc, id, (int)n))) {
                        snprintf(reply, reply_size, "ERR %s", rd_kafka_err2str(err));
                } else {
                        snprintf(reply, reply_size, "OK rtt %s %ld", a1, n);
                }
        } else if (strcmp(cmd, "topic") == 0) {
                if (!a1 || parse_int(a2, 1, 100000, &parts))
                        snprintf(reply, reply_size, "ERR usage: topic NAME PARTS");
                else if (topic_create(m, a1, (int)parts, errstr, sizeof errstr))
                        snprintf(reply, reply_size, "ERR %s", errstr);
                else
                        snprintf(reply, reply_size, "OK topic %s %ld", a1, parts);
        } else {
                snprintf(reply, reply_size, "ERR unknown command or bad arguments: %s", cmd);
        }
        return 0;
}

static void client_close(struct client *c) {
        if (c->fd >= 0 && close(c->fd) != 0)
                logmsg("close: %s", strerror(errno));
        c->fd = -1;
        c->len = 0;
        c->discarding = 0;
}

/* Writes all of buf; returns 0 on success. Answers are short and the peer
 * is local, so a blocking write is fine. */
static int write_all(int fd, const char *buf, size_t len) {
        while (len > 0) {
                ssize_t w = send(fd, buf, len, MSG_NOSIGNAL);
                if (w < 0) {
                        if (errno == EINTR)
                                continue;
                        return -1;
                }
                buf += w;
                len -= (size_t)w;
        }
        return 0;
}

/* Reads what is available from a client and answers each complete line. */
static void client_read(struct mock *m, struct client *c) {
        char buf[LINE_SIZE], reply[LINE_SIZE + 64];
        ssize_t r;
        ssize_t i;

        r = recv(c->fd, buf, sizeof buf, 0);
        if (r < 0 && errno == EINTR)
                return;
        if (r <= 0) {
                client_close(c);
                return;
        }
        for (i = 0; i < r && c->fd >= 0; i++) {
                int quit = 0;
                size_t n;

                if (buf[i] != '\n') {
                        if (c->len < sizeof c->line - 1)
                                c->line[c->len++] = buf[i];
                        else
                                c->discarding = 1;
                        continue;
                }
                c->line[c->len] = '\0';
                if (c->discarding)
                        snprintf(reply, sizeof reply, "ERR line too long");
                else
                        quit = control_exec(m, c->line, reply, sizeof reply);
                c->len = 0;
                c->discarding = 0;
                n = strlen(reply);
                reply[n++] = '\n';
                if (write_all(c->fd, reply, n) != 0 || quit)
                        client_close(c);
        }
}

static void client_accept(struct mock *m) {
        int fd = accept(m->listen_fd, NULL, NULL);
        int i;

        if (fd < 0) {
                if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED)
                        logmsg("accept: %s", strerror(errno));
                return;
        }
        for (i = 0; i < MAX_CLIENTS; i++) {
                if (m->clients[i].fd < 0) {
                        m->clients[i].fd = fd;
                        return;
                }
        }
        static const char busy[] = "ERR too many control connections\n";
        (void)write_all(fd, busy, sizeof busy - 1);
        if (close(fd) != 0)
                logmsg("close: %s", strerror(errno));
}

/* Opens the control listener on 127.0.0.1:<ephemeral>; returns the fd or -1
 * and stores the port. */
static int control_listen(int *port) {
        struct sockaddr_in sin;
        socklen_t slen = sizeof sin;
        int fd, one = 1;

        fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
                logmsg("socket: %s", strerror(errno));
                return -1;
        }
        memset(&sin, 0, sizeof sin);
        sin.sin_family = AF_INET;
        sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        sin.sin_port = 0;
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
            bind(fd, (struct sockaddr *)&sin, sizeof sin) != 0 || listen(fd, 16) != 0 ||
            getsockname(fd, (struct sockaddr *)&sin, &slen) != 0) {
                logmsg("control socket: %s", strerror(errno));
                close(fd);
                return -1;
        }
        *port = ntohs(sin.sin_port);
        return fd;
}

/* Writes "content\n" to path via path.tmp + rename, so a reader polling for
 * the file never sees it half-written. */
static int write_file_atomic(const char *path, const char *content) {
        char tmp[PATH_MAX];
        FILE *f;
        int n = snprintf(tmp, sizeof tmp, "%s.tmp", path);

        if (n < 0 || (size_t)n >= sizeof tmp) {
                logmsg("%s: path too long", path);
                return -1;
        }
        if (!(f = fopen(tmp, "w"))) {
                logmsg("%s: %s", tmp, strerror(errno));
                return -1;
        }
        if (fprintf(f, "%s\n", content) < 0 || fclose(f) != 0) {
                logmsg("%s: write failed: %s", tmp, strerror(errno));
                (void)unlink(tmp);
                return -1;
        }
        if (rename(tmp, path) != 0) {
                logmsg("rename %s: %s", path, strerror(errno));
                (void)unlink(tmp);
                return -1;
        }
        return 0;
}

/* Parses "name:partitions" (partitions default 1 when no colon) and creates
 * the topic; returns 0 on success. */
static int topic_arg(struct mock *m, const char *arg) {
        char name[256], errstr[512]; /* Kafka topic names are <= 249 bytes */
        const char *colon = strrchr(arg, ':');
        long parts = 1;
        size_t len = colon ? (size_t)(colon - arg) : strlen(arg);

        if (len == 0 || len >= sizeof name || (colon && parse_int(colon + 1, 1, 100000, &parts))) {
                logmsg("bad topic argument '%s' (want name:partitions)", arg);
                return -1;
        }
        memcpy(name, arg, len);
        name[len] = '\0';
        if (topic_create(m, name, (int)parts, errstr, sizeof errstr)) {
                logmsg("%s", errstr);
                return -1;
        }
        return 0;
}

static void usage(const char *prog) {
        fprintf(stderr,
                "usage: %s [-b brokers] [-f bootstrap_file] [-c control_file] "
                "[topic:partitions ...]\n"
                "auto-created topics get 4 partitions (fixed by librdkafka's mock)\n",
                prog);
}

/* Main loop: serves the control port and applies signal requests until
 * SIGTERM/SIGINT. Signals are blocked except inside ppoll(), so a flag set
 * by a handler is always seen before the next wait. */
static int serve(struct mock *m, const sigset_t *waitmask) {
        struct pollfd pfd[1 + MAX_CLIENTS];
        int map[1 + MAX_CLIENTS];
        char errstr[512];

        while (!sig_stop) {
                nfds_t n = 0;
                int i, r;

                if (sig_down) {
                        sig_down = 0;
                        if (broker_set(m, -1, 1, errstr, sizeof errstr))
                                logmsg("%s", errstr);
                }
                if (sig_up) {
                        sig_up = 0;
                        if (broker_set(m, -1, 0, errstr, sizeof errstr))
                                logmsg("%s", errstr);
                }

                pfd[n].fd = m->listen_fd;
                pfd[n].events = POLLIN;
                map[n++] = -1;
                for (i = 0; i < MAX_CLIENTS; i++) {
                        if (m->clients[i].fd < 0)
                                continue;
                        pfd[n].fd = m->clients[i].fd;
                        pfd[n].events = POLLIN;
                        map[n++] = i;
                }

                r = ppoll(pfd, n, NULL, waitmask);
                if (r < 0) {
                        if (errno == EINTR)
                                continue;
                        logmsg("ppoll: %s", strerror(errno));
                        return -1;
                }
                for (i = 0; i < (int)n; i++) {
                        if (!pfd[i].revents)
                                continue;
                        if (map[i] < 0)
                                client_accept(m);
                        else
                                client_read(m, &m->clients[map[i]]);
                }
        }
        return 0;
}

int main(int argc, char **argv) {
        struct mock m = {.broker_cnt = 3, .listen_fd = -1};
        const char *bootstrap_file = NULL, *control_file = NULL;
        const char *bootstraps;
        char errstr[512], control_addr[64];
        rd_kafka_conf_t *conf = NULL;
        sigset_t blocked, waitmask;
        struct sigaction sa;
        int opt, i, port, ret = 1;
        long v;

        for (i = 0; i < MAX_CLIENTS; i++)
                m.clients[i].fd = -1;

        while ((opt = getopt(argc, argv, "b:f:c:p:h")) != -1) {
                switch (opt) {
                case 'b':
                        if (parse_int(optarg, 1, 64, &v)) {
                                logmsg("-b: want 1..64 brokers");
                                return 2;
                        }
                        m.broker_cnt = (int)v;
                        break;
                case 'f': bootstrap_file = optarg; break;
                case 'c': control_file = optarg; break;
                case 'p':
                        logmsg("-p: librdkafka 2.0.2's mock cluster has no API to set "
                               "the partition count of auto-created topics (always 4); "
                               "pre-create topics as topic:partitions instead");
                        return 2;
                case 'h': usage(argv[0]); return 0;
                default: usage(argv[0]); return 2;
                }
        }

        /* Block the signals we handle before librdkafka starts its threads
         * (they inherit the mask), so only ppoll() in this thread takes them. */
        sigemptyset(&blocked);
        sigaddset(&blocked, SIGTERM);
        sigaddset(&blocked, SIGINT);
        sigaddset(&blocked, SIGUSR1);
        sigaddset(&blocked, SIGUSR2);
        if (sigprocmask(SIG_BLOCK, &blocked, &waitmask) != 0) {
                logmsg("sigprocmask: %s", strerror(errno));
                return 1;
        }
        sigdelset(&waitmask, SIGTERM);
        sigdelset(&waitmask, SIGINT);
        sigdelset(&waitmask, SIGUSR1);
        sigdelset(&waitmask, SIGUSR2);
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_signal;
        sigemptyset(&sa.sa_mask);
        if (sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGINT, &sa, NULL) != 0 ||
            sigaction(SIGUSR1, &sa, NULL) != 0 || sigaction(SIGUSR2, &sa, NULL) != 0) {
                logmsg("sigaction: %s", strerror(errno));
                return 1;
        }
        /* A vanished control client must not kill us. */
        if (signal(SIGPIPE, SIG_IGN) == SIG_ERR) {
                logmsg("signal(SIGPIPE): %s", strerror(errno));
                return 1;
        }

        conf = rd_kafka_conf_new();
        if (rd_kafka_conf_set(conf, "log_level", "4", errstr, sizeof errstr) != RD_KAFKA_CONF_OK) {
                logmsg("conf: %s", errstr);
                rd_kafka_conf_destroy(conf);
                return 1;
        }
        /* The handle only hosts the mock cluster; it never connects anywhere. */
        m.rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, errstr, sizeof errstr);
        if (!m.rk) {
                logmsg("rd_kafka_new: %s", errstr);
                rd_kafka_conf_destroy(conf); /* not taken over on failure */
                return 1;
        }
        conf = NULL;
        m.mc = rd_kafka_mock_cluster_new(m.rk, m.broker_cnt);
        if (!m.mc) {
                logmsg("rd_kafka_mock_cluster_new failed");
                goto out;
        }
        for (i = optind; i < argc; i++)
                if (topic_arg(&m, argv[i]))
                        goto out;

        if ((m.listen_fd = control_listen(&port)) < 0)
                goto out;
        snprintf(control_addr, sizeof control_addr, "127.0.0.1:%d", port);
        bootstraps = rd_kafka_mock_cluster_bootstraps(m.mc);
        if (!bootstraps || !*bootstraps) {
                logmsg("no bootstrap address");
                goto out;
        }
        if (bootstrap_file && write_file_atomic(bootstrap_file, bootstraps))
                goto out;
        if (control_file && write_file_atomic(control_file, control_addr))
                goto out;
        if (printf("BOOTSTRAP=%s\nCONTROL=%s\n", bootstraps, control_addr) < 0 ||
            fflush(stdout) != 0) {
                logmsg("stdout: %s", strerror(errno));
                goto out;
        }
        logmsg("%d brokers ready at %s, control %s", m.broker_cnt, bootstraps, control_addr);

        if (serve(&m, &waitmask) == 0)
                ret = 0;
        logmsg("stopping");

out:
        for (i = 0; i < MAX_CLIENTS; i++)
                client_close(&m.clients[i]);
        if (m.listen_fd >= 0)
                close(m.listen_fd);
        if (m.mc)
                rd_kafka_mock_cluster_destroy(m.mc);
        rd_kafka_destroy(m.rk);
        return ret;
}
