/*
 * kiln_progress — one line of progress on a terminal for `kiln compile`
 * and `kiln batch`, redrawn in place on stderr.
 *
 * A compile shows its phase: importing, uploading (bytes, share, rate),
 * queued (place in our queue, how many of ours wait, time so far, the
 * farm's ETA), compiling (on which worker, for how long, the farm's ETA),
 * downloading a large artifact (bytes, share, rate);
 * a batch one line of overall progress (done, cached, failed, running,
 * queued, elapsed, ETA).  kiln_progress_new returns NULL unless `fd` is a
 * terminal, so a pipe, a file or CI's log never sees a control character;
 * the caller also passes NULL's worth (does not create one) for --json and
 * --quiet.  The line is cleared before anything else is printed to the
 * terminal (kiln_progress_clear) and when the display is destroyed, so
 * that the output left behind is what it would be without it.
 *
 * Redraws are at most every KILN_PROGRESS_REDRAW_MS, except when the
 * phase changes; the line is cut to the terminal's width.
 */
#ifndef KILN_PROGRESS_H
#define KILN_PROGRESS_H

#include <stdbool.h>
#include <stddef.h>

#include "client/kiln_client.h"

#define KILN_PROGRESS_REDRAW_MS  100
#define KILN_PROGRESS_MAX_LINE   512

typedef struct kiln_progress kiln_progress_t;

/* A display on `fd` for `jobs` jobs (1: a compile, more: a batch), or
 * NULL when `fd` is not a terminal or out of memory.  Caller owns it. */
kiln_progress_t *kiln_progress_new (int fd, size_t jobs);
/* Clear the line and free; *self_p becomes NULL.  NULL is fine. */
void kiln_progress_destroy (kiln_progress_t **self_p);

/* Show `text` as the phase ("importing model.onnx"); NULL-safe. */
void kiln_progress_phase (kiln_progress_t *self, const char *text);
/* A kiln_progress_fn: the client's news (arg is the display). */
void kiln_progress_event (const kiln_progress_event_t *ev, void *arg);
/* A batch job finished: how. */
void kiln_progress_job_done (kiln_progress_t *self, bool ok, bool cached);
/* Clear the line now (before printing something else to the terminal);
 * the next news draws it again.  NULL-safe. */
void kiln_progress_clear (kiln_progress_t *self);

/* "1.5 KiB", "12.0 MiB": bytes for people, into buf. */
const char *kiln_progress_bytes (char *buf, size_t size, double bytes);
/* "45 s", "3m05s", "2h10m": a duration for people, into buf. */
const char *kiln_progress_duration (char *buf, size_t size, double seconds);

#endif
