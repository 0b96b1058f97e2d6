/*
 * kiln_progress — the progress line of `kiln compile` and `kiln batch`.
 */
#include "client/kiln_progress.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

struct kiln_progress {
    int fd;
    size_t jobs;                     /* 1: a compile; more: a batch */
    bool shown;                      /* a line is on the terminal */
    int64_t start_ms, drawn_ms;      /* monotonic */
    int64_t upload_start_ms;         /* first upload news */
    int64_t download_start_ms;       /* first download news */
    int last_phase;                  /* what was drawn last (-1: a text phase) */
    char line[KILN_PROGRESS_MAX_LINE];
    /* a batch's counts */
    size_t done, failed, cached, queued, running;
};

static int64_t
s_now_ms (void)
{
    struct timespec ts;
    clock_gettime (CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

const char *
kiln_progress_bytes (char *buf, size_t size, double bytes)
{
    static const char *units[] = { "B", "KiB", "MiB", "GiB", "TiB" };
    int u = 0;
    while (bytes >= 1024 && u < 4) {
        bytes /= 1024;
        u++;
    }
    snprintf (buf, size, u ? "%.1f %s" : "%.0f %s", bytes, units[u]);
    return buf;
}

const char *
kiln_progress_duration (char *buf, size_t size, double seconds)
{
    long s = seconds > 0 ? (long) (seconds + 0.5) : 0;
    if (s < 60)
        snprintf (buf, size, "%ld s", s);
    else if (s < 3600)
        snprintf (buf, size, "%ldm%02lds", s / 60, s % 60);
    else
        snprintf (buf, size, "%ldh%02ldm", s / 3600, (s % 3600) / 60);
    return buf;
}

kiln_progress_t *
kiln_progress_new (int fd, size_t jobs)
{
    if (!isatty (fd))
        return NULL;
    kiln_progress_t *self = calloc (1, sizeof *self);
    if (!self)
        return NULL;
    self->fd = fd;
    self->jobs = jobs ? jobs : 1;
    self->start_ms = s_now_ms ();
    self->last_phase = -2;
    return self;
}

/* Write all of `text` to the terminal (a short write is retried). */
static void
s_write (kiln_progress_t *self, const char *text, size_t len)
{
    while (len > 0) {
        ssize_t n = write (self->fd, text, len);
        if (n <= 0)
            return;
        text += n;
        len -= (size_t) n;
    }
}

void
kiln_progress_clear (kiln_progress_t *self)
{
    if (!self || !self->shown)
        return;
    s_write (self, "\r\033[K", 4);
    self->shown = false;
}

void
kiln_progress_destroy (kiln_progress_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kiln_progress_clear (*self_p);
    free (*self_p);
    *self_p = NULL;
}

/* Draw `fmt` as the line, cut to the terminal's width; `phase` changes
 * draw at once, the same phase at most every KILN_PROGRESS_REDRAW_MS. */
static void
s_draw (kiln_progress_t *self, int phase, const char *fmt, ...)
    __attribute__ ((format (printf, 3, 4)));

static void
s_draw (kiln_progress_t *self, int phase, const char *fmt, ...)
{
    int64_t now = s_now_ms ();
    if (phase == self->last_phase && self->shown && now - self->drawn_ms < KILN_PROGRESS_REDRAW_MS)
        return;
    va_list ap;
    va_start (ap, fmt);
    char text[KILN_PROGRESS_MAX_LINE];
    vsnprintf (text, sizeof text, fmt, ap);
    va_end (ap);
    struct winsize ws;
    size_t width = ioctl (self->fd, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1 ? ws.ws_col : 80;
    size_t len = strlen (text);
    if (len > width - 1) {
        len = width - 1;             /* the cursor stays on the line */
        while (len > 0 && ((unsigned char) text[len] & 0xC0) == 0x80)
            len--;                   /* not inside a UTF-8 sequence */
    }
    char out[KILN_PROGRESS_MAX_LINE + 8];
    int n = snprintf (out, sizeof out, "\r\033[K%.*s", (int) len, text);
    s_write (self, out, (size_t) n);
    self->shown = true;
    self->drawn_ms = now;
    self->last_phase = phase;
}

void
kiln_progress_phase (kiln_progress_t *self, const char *text)
{
    if (self)
        s_draw (self, -1, "kiln: %s", text);
}

/* ", about 40 s left" / ", longer than the usual 20 s" / "" into buf. */
static const char *
s_eta (char *buf, size_t size, const kiln_progress_event_t *ev)
{
    char d[32];
    if (ev->eta_ms)
        snprintf (buf, size, ", about %s left",
                  kiln_progress_duration (d, sizeof d, (double) ev->eta_ms / 1e3));
    else if (ev->estimate_ms && ev->phase == KILN_PHASE_RUNNING)
        snprintf (buf, size, ", longer than the usual %s",
                  kiln_progress_duration (d, sizeof d, (double) ev->estimate_ms / 1e3));
    else
        buf[0] = '\0';
    return buf;
}

/* An upload's or a download's line: `what` X of Y (P%) at R/s, the rate
 * since *start_ms (set at the first news); the last one is always drawn
 * (as phase `done_phase`: 100% is not throttled away). */
static void
s_transfer (kiln_progress_t *self, const kiln_progress_event_t *ev, const char *what,
            int64_t *start_ms, int done_phase)
{
    char a[32], b[32], c[48], r[32];
    int64_t now = s_now_ms ();
    if (!*start_ms)
        *start_ms = now;
    double secs = (double) (now - *start_ms) / 1e3;
    if (secs > 0.05)
        snprintf (c, sizeof c, " at %s/s",
                  kiln_progress_bytes (r, sizeof r, (double) ev->sent_bytes / secs));
    else
        c[0] = '\0';
    double pct = ev->total_bytes ? 100.0 * (double) ev->sent_bytes / (double) ev->total_bytes
                                 : 100.0;
    char reused[64] = "", d[32];
    if (ev->reused_bytes)
        snprintf (reused, sizeof reused, ", %s of it from the member cache",
                  kiln_progress_bytes (d, sizeof d, (double) ev->reused_bytes));
    s_draw (self, ev->sent_bytes >= ev->total_bytes ? done_phase : (int) ev->phase,
            "kiln: %s %s of %s (%.0f%%)%s%s", what,
            kiln_progress_bytes (a, sizeof a, (double) ev->sent_bytes),
            kiln_progress_bytes (b, sizeof b, (double) ev->total_bytes), pct, c, reused);
}

/* A compile's line for `ev`. */
static void
s_compile_event (kiln_progress_t *self, const kiln_progress_event_t *ev)
{
    char a[32], eta[64];
    switch (ev->phase) {
    case KILN_PHASE_UPLOAD:
        s_transfer (self, ev, "uploading weights", &self->upload_start_ms, 100);
        break;
    case KILN_PHASE_QUEUED:
        if (ev->position)
            s_draw (self, ev->phase, "kiln: queued, place %llu in your queue (%llu of yours "
                    "waiting), %s%s", (unsigned long long) ev->position,
                    (unsigned long long) ev->queued,
                    kiln_progress_duration (a, sizeof a, (double) ev->elapsed_ms / 1e3),
                    s_eta (eta, sizeof eta, ev));
        else
            s_draw (self, ev->phase, "kiln: queued on the farm");
        break;
    case KILN_PHASE_RUNNING:
        s_draw (self, ev->phase, "kiln: compiling on %s, %s%s", ev->worker ? ev->worker : "?",
                kiln_progress_duration (a, sizeof a, (double) ev->elapsed_ms / 1e3),
                s_eta (eta, sizeof eta, ev));
        break;
    case KILN_PHASE_DONE:
        s_draw (self, ev->phase, "kiln: receiving the artifact");
        break;
    case KILN_PHASE_DOWNLOAD:
        s_transfer (self, ev, "downloading the artifact", &self->download_start_ms, 101);
        break;
    }
}

/* A batch's line. */
static void
s_batch_line (kiln_progress_t *self, int phase)
{
    char a[32], b[32];
    double secs = (double) (s_now_ms () - self->start_ms) / 1e3;
    size_t left = self->jobs - self->done;
    if (self->done && left)
        snprintf (b, sizeof b, ", ETA %s",
                  kiln_progress_duration (a, sizeof a, secs * (double) left / (double) self->done));
    else
        b[0] = '\0';
    char elapsed[32];
    s_draw (self, phase, "kiln batch: %zu/%zu done (%zu cached, %zu failed), %zu running, "
            "%zu queued, %s%s", self->done, self->jobs, self->cached, self->failed,
            self->running, self->queued,
            kiln_progress_duration (elapsed, sizeof elapsed, secs), b);
}

void
kiln_progress_event (const kiln_progress_event_t *ev, void *arg)
{
    kiln_progress_t *self = arg;
    if (!self)
        return;
    if (self->jobs == 1) {
        s_compile_event (self, ev);
        return;
    }
    if (ev->phase == KILN_PHASE_UPLOAD || ev->phase == KILN_PHASE_DOWNLOAD) {
        s_compile_event (self, ev);       /* the batch's transfers, as a compile's */
        return;
    }
    if (ev->phase == KILN_PHASE_QUEUED || ev->phase == KILN_PHASE_RUNNING) {
        if (ev->queued || ev->running || ev->position) {
            self->queued = ev->queued;
            self->running = ev->running;
        }
        s_batch_line (self, KILN_PHASE_QUEUED);
    }
}

void
kiln_progress_job_done (kiln_progress_t *self, bool ok, bool cached)
{
    if (!self)
        return;
    self->done++;
    self->failed += !ok;
    self->cached += cached;
    s_batch_line (self, KILN_PHASE_DONE);
}
