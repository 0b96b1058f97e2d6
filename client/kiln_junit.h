/*
 * kiln_junit — a JUnit XML report of a batch of compiles, for CI systems
 * (GitLab's `artifacts:reports:junit`, GitHub's test reporters, Jenkins).
 *
 * One <testsuite> named after the batch, one <testcase> per job: its
 * name (the model), classname "kiln.batch", time in seconds, a property
 * "cached" (and "artifact", "worker" when it succeeded), and for a failed
 * job a <failure> whose message is the error's first line and whose text
 * is the whole error with the compiler's log tail.  Text is escaped and
 * characters XML 1.0 cannot hold are replaced with '?', so any compiler
 * output gives a well-formed file.
 *
 * Bounds: at most KILN_JUNIT_MAX_CASES cases, each text field cut to
 * KILN_JUNIT_MAX_TEXT bytes (the cut is marked).
 */
#ifndef KILN_JUNIT_H
#define KILN_JUNIT_H

#include <stdbool.h>
#include <stddef.h>

#include "common/kiln_error.h"

#define KILN_JUNIT_MAX_CASES  1000000
#define KILN_JUNIT_MAX_TEXT   (64u << 10)

typedef struct kiln_junit kiln_junit_t;

/* One job's outcome.  `error` NULL: it passed. */
typedef struct kiln_junit_case {
    const char *name;            /* the model (path as given) */
    double seconds;              /* from the batch's start until it finished */
    bool cached;                 /* served from the action (or failure) cache */
    const char *artifact;        /* content hash, or NULL */
    const char *worker;          /* who built it, or NULL */
    const char *error_code;      /* "ECOMPILE", ... (failure type), or NULL */
    const char *error;           /* the message, with the log tail; NULL = passed */
} kiln_junit_case_t;

/* A report for the suite `name`.  Caller owns it; NULL when out of
 * memory. */
kiln_junit_t *kiln_junit_new (const char *name);
void kiln_junit_destroy (kiln_junit_t **self_p);

/* Add a case (copied).  Fails with ELIMIT past KILN_JUNIT_MAX_CASES. */
int kiln_junit_add (kiln_junit_t *self, const kiln_junit_case_t *c, kiln_err_t *err);

/* The report as XML.  Caller frees (free()); NULL when out of memory. */
char *kiln_junit_xml (const kiln_junit_t *self, double total_seconds);

/* Write the report to `path` atomically (a temporary file renamed). */
int kiln_junit_write (const kiln_junit_t *self, const char *path, double total_seconds,
                      kiln_err_t *err);

#endif
