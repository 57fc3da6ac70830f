/* test_db_conninfo.c - OUTBOX_DATABASE_URL as libpq reads it: every form libpq
 * accepts passes and is shown without its password; what libpq refuses fails
 * with a line that holds no value of the string; and libpq itself, asked to
 * connect (to sockets that do not exist: nothing leaves the machine), agrees
 * with every verdict. libpq is included here only as that oracle. */
#include <criterion/criterion.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <string.h>

#include "db_conninfo.h"

/* Forms libpq accepts; each password is SECRET (or FIRST, then SECRET). */
static const char *const good[] = {
        "postgresql://outbox:SECRET@db:5432/outbox?sslmode=require",
        "postgres://outbox:SECRET@db/outbox",
        "postgresql://outbox:SE%43RET@db/outbox?application_name=a%20b",
        "postgresql://outbox:SECRET@[::1]:5432/outbox",
        "postgresql://outbox:SECRET@a:5432,b:5433/outbox?target_session_attrs=read-write",
        "postgresql:///outbox?host=/var/run/postgresql&user=outbox&password=SECRET",
        "postgresql://%2Fvar%2Frun%2Fpostgresql/outbox",
        "host=db port=5432 dbname=outbox user=outbox password=SECRET",
        "host=db\nport=5432\ndbname=outbox\nuser=outbox\npassword=SECRET\n",
        "\thost=db\tuser=outbox\r\n\tpassword=SECRET\f\v",
        "host = db password = SECRET",
        "host=db password='SE CR\\'ET \\\\ x' application_name='a b'",
        "host=db password=SE\\'CRET",
        "password=FIRST host=db password=SECRET",
        "host=db passfile=/run/secrets/pgpass",
        "host=db sslpassword=SECRET sslmode=verify-full sslrootcert=/etc/ca.crt",
        "host=a,b hostaddr=127.0.0.1,::1 port=5432",
        "host=a,b port=5432,5433 keepalives=1 keepalives_idle=30 connect_timeout= 10 ",
        "host=db ssl_min_protocol_version=tlsv1.2 ssl_max_protocol_version=TLSv1.3",
        "host=db gssencmode=disable channel_binding=require target_session_attrs=prefer-standby",
        "outbox", /* a bare database name, as PQconnectdbParams' expand_dbname takes it */
};

/* What libpq refuses, at parse or at connect time. */
static const char *const bad[] = {
        "postgresql://outbox:SECRET@[::1:5432/outbox",
        "postgresql://outbox:SECRET@db/outbox?sslmode=bogus",
        "postgresql://outbox:SECRET@db/outbox?foo=bar",
        "host=db password=SECRET port=notaport",
        "host=db password=SECRET port=0",
        "host=db password=SECRET port=65536",
        "host=db password=SECRET port=5432,x",
        "host=db password='SECRET",
        "host=db password=SE CRET",
        "host=db password=SECRET sslmod=require",
        "postgresql://outbox:SECRET@db/outbox?password",
        "postgresql://outbox:SECRET@db/outbox?a=b=c",
        "postgresql://outbox:SECRET@db/outbox%zz",
        "postgresql://outbox:SECRET@db/outbox%00",
        "postgresql://outbox:SECRET@[]/outbox",
        "postgresql://outbox:SECRET@db:54x2/outbox",
        "host=db password=SECRET keepalives=x",
        "host=db password=SECRET connect_timeout=1.5",
        "host=db password=SECRET connect_timeout=",
        "host=db password=SECRET gssencmode=maybe",
        "host=db password=SECRET channel_binding=always",
        "host=db password=SECRET target_session_attrs=master",
        "host=db password=SECRET ssl_min_protocol_version=TLSv1.4",
        "host=db password=SECRET ssl_min_protocol_version=TLSv1.3 ssl_max_protocol_version=TLSv1.2",
        "host=a,b password=SECRET hostaddr=127.0.0.1",
        "host=a,b,c password=SECRET port=1,2",
        "hostaddr=not-an-address password=SECRET",
        "host=db password=SECRET sslmode=",
};

Test(db_conninfo, accepts_every_form_libpq_accepts) {
        for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
                char err[512] = "", shown[1024], again[1024];
                cr_expect_eq(db_conninfo_check(good[i], err, sizeof err), 0, "%s: %s", good[i],
                             err);
                db_conninfo_redact(good[i], shown, sizeof shown);
                cr_expect_null(strstr(shown, "SECRET"), "%s", shown);
                cr_expect_null(strstr(shown, "SE CR"), "%s", shown);
                cr_expect_null(strstr(shown, "FIRST"), "%s", shown);
                cr_expect_null(strstr(shown, "SE\\'CRET"), "%s", shown);
                if (strstr(good[i], "password"))
                        cr_expect_not_null(strstr(shown, "password=****"), "%s", shown);
                /* the shown form is itself a string libpq reads the same way */
                cr_expect_eq(db_conninfo_check(shown, err, sizeof err), 0, "%s: %s", shown, err);
                db_conninfo_redact(shown, again, sizeof again);
                cr_expect_str_eq(again, shown);
        }
}

Test(db_conninfo, redacted_form_comes_from_the_parsed_options) {
        char out[512];
        db_conninfo_redact("postgresql://outbox:SECRET@db:5432/outbox?sslmode=require", out,
                           sizeof out);
        cr_expect_str_eq(out, "user=outbox password=**** dbname=outbox host=db port=5432 "
                              "sslmode=require");
        db_conninfo_redact("host=db\n\tapplication_name='a b\\'c'\npassword='x y'", out,
                           sizeof out);
        cr_expect_str_eq(out, "password=**** host=db application_name='a b\\'c'");
        db_conninfo_redact("outbox", out, sizeof out);
        cr_expect_str_eq(out, "dbname=outbox");
        db_conninfo_redact("postgresql://outbox:SECRET@[::1:5432/outbox", out, sizeof out);
        cr_expect_str_eq(out, "(not a valid connection string)");
        char small[24];
        db_conninfo_redact("user=u password=abcdefghijklmnopqrstuvwxyz host=db", small,
                           sizeof small);
        cr_expect_null(strstr(small, "abc"), "%s", small);
        db_conninfo_redact("", small, sizeof small);
        cr_expect_str_eq(small, "");
}

Test(db_conninfo, refuses_what_libpq_refuses_without_the_password) {
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
                char err[512] = "";
                cr_expect_eq(db_conninfo_check(bad[i], err, sizeof err), -1, "%s accepted", bad[i]);
                cr_expect_neq(err[0], '\0', "%s", bad[i]);
                cr_expect_null(strstr(err, "SECRET"), "%s: %s", bad[i], err);
                cr_expect_null(strstr(err, "CRET"), "%s: %s", bad[i], err);
                cr_expect_null(strchr(err, '\n'), "%s: %s", bad[i], err);
        }
        char err[512];
        cr_expect_eq(db_conninfo_check("host=db sslmode=bogus", err, sizeof err), -1);
        cr_expect_str_eq(err, "libpq would refuse it: sslmode: not one of disable, allow, prefer, "
                              "require, verify-ca or verify-full");
        cr_expect_eq(db_conninfo_check("postgresql://u:SECRET@db/x?foo=bar", err, sizeof err), -1);
        cr_expect_not_null(strstr(err, "an unknown URI query parameter"), "%s", err);
}

/* libpq's verdict when it connects: refused for an option, or a failure to
 * reach a server (there is none at these addresses). */
static int libpq_refuses(const char *conninfo) {
        const char *keys[] = {"connect_timeout", "dbname", NULL};
        const char *vals[] = {"2", conninfo, NULL};
        PGconn *c = PQconnectdbParams(keys, vals, 1);
        cr_assert_not_null(c);
        cr_assert_neq(PQstatus(c), CONNECTION_OK, "%s connected", conninfo);
        const char *msg = PQerrorMessage(c);
        /* an option libpq reads per host comes as "connection to server at
         * ... failed: invalid integer value ..." */
        int refused = strstr(msg, "connection to server") == NULL || strstr(msg, "invalid ");
        PQfinish(c);
        return refused;
}

/* The good and bad strings with every host replaced by a socket directory
 * that does not exist or a closed loopback port, so asking libpq costs no
 * network and no name lookup. */
Test(db_conninfo, agrees_with_libpq_connecting) {
        static const char *const cases[] = {
                "host=/nonexistent-outbox port=5432 password=SECRET",
                "host=/nonexistent-outbox\n\tpassword='SE CR\\'ET'\r\nport=5433\n",
                "postgresql://outbox:SECRET@%2Fnonexistent-outbox/outbox?sslmode=disable",
                "postgresql://outbox:SECRET@127.0.0.1:1/outbox?target_session_attrs=any",
                "postgresql://outbox:SECRET@[::1]:1/outbox",
                "hostaddr=127.0.0.1,127.0.0.1 port=1,1 password=SECRET",
                "host=/nonexistent-outbox passfile=/nonexistent-outbox/pgpass",
                "hostaddr=127.0.0.1 port=1 keepalives=1 keepalives_idle= 30 ",
                "host=/nonexistent-outbox ssl_min_protocol_version=TLSv1.2",
                "host=/nonexistent-outbox gssencmode=disable channel_binding=prefer",
                "host=/nonexistent-outbox port=notaport",
                "host=/nonexistent-outbox port=0",
                "host=/nonexistent-outbox port=65536",
                "host=/nonexistent-outbox port=1,x",
                "host=/nonexistent-outbox sslmode=bogus",
                "host=/nonexistent-outbox sslmode=Require",
                "host=/nonexistent-outbox sslmode=",
                "host=/nonexistent-outbox gssencmode=maybe",
                "host=/nonexistent-outbox channel_binding=always",
                "host=/nonexistent-outbox target_session_attrs=master",
                /* libpq reads these for TCP hosts only */
                "hostaddr=127.0.0.1 port=1 keepalives=x",
                "hostaddr=127.0.0.1 port=1 tcp_user_timeout=abc",
                "hostaddr=127.0.0.1 port=1 keepalives_count=",
                "hostaddr=127.0.0.1 port=1 connect_timeout=1.5",
                "hostaddr=127.0.0.1 port=1 connect_timeout= 3 ",
                "host=/nonexistent-outbox ssl_min_protocol_version=TLSv1.4",
                "host=/nonexistent-outbox ssl_min_protocol_version=TLSv1.3 "
                "ssl_max_protocol_version=TLSv1.2",
                "host=/nonexistent-outbox,/nonexistent-outbox hostaddr=127.0.0.1",
                "host=/nonexistent-outbox,/x,/y port=1,2",
                "hostaddr=not-an-address",
                "postgresql://outbox:SECRET@[::1:5432/outbox",
                "postgresql://outbox:SECRET@%2Fnonexistent-outbox/outbox?foo=bar",
                "host=/nonexistent-outbox password='SECRET",
                "host=/nonexistent-outbox sslmod=require",
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                char err[512];
                int ours = db_conninfo_check(cases[i], err, sizeof err) != 0;
                cr_expect_eq(ours, libpq_refuses(cases[i]), "%s: we say %s, libpq disagrees",
                             cases[i], ours ? "refused" : "accepted");
        }
}

Test(db_conninfo, scrub_hides_secrets_in_messages) {
        char text[200];
        snprintf(text, sizeof text, "auth failed with SECRET for \"SECRET\"");
        db_conninfo_scrub("host=db password=SECRET", text);
        cr_expect_str_eq(text, "auth failed with **** for \"****\"");
        snprintf(text, sizeof text, "x ab y");
        db_conninfo_scrub("host=db password=ab", text);
        cr_expect_str_eq(text, "x ** y");
        snprintf(text, sizeof text, "nothing secret");
        db_conninfo_scrub("not a conninfo = '", text);
        cr_expect_str_eq(text, "nothing secret");
}
