/* clock.c - see clock.h. clock_gettime cannot fail for these clocks on
 * Linux, so neither function reports errors. */
#include "clock.h"

#include <time.h>

static double read_clock(clockid_t id) {
        struct timespec ts;
        clock_gettime(id, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

double clock_mono_s(void) {
        return read_clock(CLOCK_MONOTONIC);
}

double clock_wall_s(void) {
        return read_clock(CLOCK_REALTIME);
}
