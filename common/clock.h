/* clock.h - seconds as doubles, for timeouts, rates and timestamps. */
#ifndef OUTBOX_CLOCK_H
#define OUTBOX_CLOCK_H

/* CLOCK_MONOTONIC in seconds: for durations and deadlines. */
double clock_mono_s(void);

/* CLOCK_REALTIME in seconds since the epoch: for timestamps others read. */
double clock_wall_s(void);

#endif
