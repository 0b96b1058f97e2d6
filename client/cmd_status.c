/* kiln status [--broker EP] [--json] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/kiln_log.h"

#include "client/kiln_client.h"
#include "client/kiln_cmds.h"

static const char *s_usage =
    "usage: kiln status [--broker tcp://HOST:PORT] [--json]\n"
    "  Show the farm: each worker (identity, slots, busy, toolchains, last\n"
    "  heartbeat), the queue per client, the cache hit rate, jobs done and\n"
    "  failed.  --json prints the broker's report as it comes (its fields are\n"
    "  in docs/operations.md).\n"
    "options:\n"
    "  --broker tcp://HOST:PORT  the farm (default: $KILN_BROKER)\n"
    "  --cert FILE, --broker-cert FILE   CurveZMQ (default: $KILN_CERT, $KILN_BROKER_CERT)\n"
    "  --wait SECONDS            give up after this long (default 10)\n"
    "  --json                    print the report as JSON\n";

static json_int_t
s_int (json_t *obj, const char *path1, const char *path2)
{
    json_t *v = json_object_get (obj, path1);
    if (path2)
        v = json_object_get (v, path2);
    return json_integer_value (v);
}

static void
s_print (json_t *doc)
{
    printf ("broker %s at %s%s, up %.0f s\n", json_string_value (json_object_get (doc, "broker")),
            json_string_value (json_object_get (doc, "endpoint")),
            json_is_true (json_object_get (doc, "authenticated")) ? " (CurveZMQ)" : "",
            (double) s_int (doc, "up_ms", NULL) / 1000.0);
    json_t *workers = json_object_get (doc, "workers");
    printf ("workers: %zu\n", json_array_size (workers));
    size_t i;
    json_t *w;
    json_array_foreach (workers, i, w) {
        printf ("  %-24s slots %lld  busy %lld  last heartbeat %.1f s ago  done %lld  failed %lld\n",
                json_string_value (json_object_get (w, "name")),
                (long long) s_int (w, "slots", NULL), (long long) s_int (w, "busy", NULL),
                (double) s_int (w, "last_heartbeat_ms", NULL) / 1000.0,
                (long long) s_int (w, "done", NULL), (long long) s_int (w, "failed", NULL));
        size_t k;
        json_t *tc;
        json_array_foreach (json_object_get (w, "toolchains"), k, tc)
            printf ("      toolchain %s\n", json_string_value (tc));
        const char *why = json_string_value (json_object_get (w, "quarantined"));
        if (why) {
            fputs ("      QUARANTINED (no more jobs): ", stdout);
            kiln_fputs_escaped (why, stdout);
            fputc ('\n', stdout);
        }
    }
    json_t *xc = json_object_get (doc, "cross_check");
    if (xc)
        printf ("cross-check: policy %s, %lld checked, %lld agreed, %lld disagreed, %lld builds "
                "not checked, %zu workers quarantined\n",
                json_string_value (json_object_get (xc, "policy")),
                (long long) s_int (xc, "checked", NULL), (long long) s_int (xc, "agreed", NULL),
                (long long) s_int (xc, "disagreed", NULL),
                (long long) s_int (xc, "unchecked", NULL),
                json_object_size (json_object_get (xc, "quarantined")));
    json_t *queue = json_object_get (doc, "queue");
    printf ("queue: %lld queued, %lld running\n", (long long) s_int (queue, "queued", NULL),
            (long long) s_int (queue, "running", NULL));
    json_t *cl;
    json_array_foreach (json_object_get (queue, "clients"), i, cl)
        printf ("  %-24s %lld queued, %lld running, %lld served\n",
                json_string_value (json_object_get (cl, "client")),
                (long long) s_int (cl, "queued", NULL), (long long) s_int (cl, "running", NULL),
                (long long) s_int (cl, "served", NULL));
    json_t *cache = json_object_get (doc, "cache");
    printf ("cache: %lld hits of %lld lookups (%.0f%%), %lld cached failures served; store "
            "%lld artifacts, %lld blobs, %.1f of %.1f MiB; %lld artifacts pinned (%.1f MiB)\n",
            (long long) s_int (cache, "hits", NULL), (long long) s_int (cache, "lookups", NULL),
            100.0 * json_number_value (json_object_get (cache, "hit_rate")),
            (long long) s_int (cache, "failure_hits", NULL),
            (long long) s_int (cache, "artifacts", NULL), (long long) s_int (cache, "blobs", NULL),
            (double) s_int (cache, "bytes", NULL) / 1048576.0,
            (double) s_int (cache, "max_bytes", NULL) / 1048576.0,
            (long long) s_int (cache, "pinned", NULL),
            (double) s_int (cache, "pinned_bytes", NULL) / 1048576.0);
    json_t *jobs = json_object_get (doc, "jobs");
    printf ("jobs: %lld submitted, %lld done, %lld failed, %lld canceled, %lld requeued, "
            "%lld requests joined a running job\n",
            (long long) s_int (jobs, "submitted", NULL), (long long) s_int (jobs, "done", NULL),
            (long long) s_int (jobs, "failed", NULL), (long long) s_int (jobs, "canceled", NULL),
            (long long) s_int (jobs, "requeued", NULL), (long long) s_int (jobs, "joined", NULL));
}

int
cmd_status (int argc, char **argv)
{
    kiln_farm_opts_t fo = { .wait_s = 10, .wait_max_s = 3600 };
    int rc = kiln_cmd_farm_opts (argc, argv, s_usage, NULL, &fo);
    if (rc >= 0)
        return rc;
    if (optind != argc)
        return kiln_cmd_usage (s_usage, "status takes no arguments");
    if (!fo.broker || !*fo.broker)
        return kiln_cmd_usage (s_usage, "which farm? give --broker or set $KILN_BROKER");
    kiln_err_t err = { 0 };
    fo.ccfg.endpoint = fo.broker;
    kiln_client_t *client = kiln_client_new_config (&fo.ccfg, &err);
    char *text = NULL;
    rc = client ? kiln_client_status (client, (int) fo.wait_s * 1000, &text, &err) : -err.code;
    kiln_client_destroy (&client);
    if (rc != 0)
        return kiln_cmd_fail ("status", &err);
    if (fo.json)
        puts (text);
    else {
        json_t *doc = json_loads (text, 0, NULL);
        if (doc)
            s_print (doc);
        else
            puts (text);
        json_decref (doc);
    }
    free (text);
    return 0;
}
