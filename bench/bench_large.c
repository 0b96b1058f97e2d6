/*
 * bench_large — the client's side of bench/bench_large.py: a model's
 * weights imported from ONNX external data and uploaded, printed as one
 * JSON line.  Not a test: nothing here passes or fails on time.
 *
 *   bench_large upload EP MODEL.onnx   import (weights mapped, and hashed
 *                                      unless the user's import cache knows
 *                                      them, as `kiln compile` imports),
 *                                      then kiln_client_upload twice: all
 *                                      the bytes to a broker that holds
 *                                      none, then again (it holds them all)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <czmq.h>

#include "client/kiln_client.h"
#include "graph/kiln_onnx.h"

static int
s_die (const char *what, const kiln_err_t *err)
{
    fprintf (stderr, "bench_large: %s: %s\n", what, err ? err->msg : "");
    return 1;
}

static int
s_upload (const char *endpoint, const char *model)
{
    kiln_err_t err = { 0 };
    int64_t t0 = zclock_usecs ();
    kiln_statcache_t *cache = kiln_statcache_default ();
    kiln_graph_t *g = kiln_onnx_import_cached (model, cache, &err);
    if (!g)
        return s_die ("import", &err);
    uint64_t hits = 0, misses = 0;
    kiln_statcache_counts (cache, &hits, &misses);
    kiln_statcache_save (cache);
    kiln_statcache_destroy (&cache);
    int64_t t1 = zclock_usecs ();
    uint64_t bytes = 0;
    for (int i = 0; i < g->n_weights; i++)
        bytes += g->weights[i].size;
    kiln_client_t *c = kiln_client_new (endpoint, &err);
    if (!c)
        return s_die ("connect", &err);
    uint64_t sent = 0, again = 0;
    if (kiln_client_upload (c, g, 0, &sent, &err) != 0)
        return s_die ("upload", &err);
    int64_t t2 = zclock_usecs ();
    if (kiln_client_upload (c, g, 0, &again, &err) != 0)
        return s_die ("second upload", &err);
    int64_t t3 = zclock_usecs ();
    double first_s = (double) (t2 - t1) / 1e6;
    printf ("{\"bench\":\"upload\",\"bytes\":%llu,\"sent\":%llu,\"import_s\":%.3f,"
            "\"first_s\":%.3f,\"first_mib_per_s\":%.1f,\"second_s\":%.3f,\"second_sent\":%llu,"
            "\"import_cache_hits\":%llu,\"import_cache_misses\":%llu}\n",
            (unsigned long long) bytes, (unsigned long long) sent, (double) (t1 - t0) / 1e6,
            first_s, (double) sent / (1 << 20) / first_s, (double) (t3 - t2) / 1e6,
            (unsigned long long) again, (unsigned long long) hits,
            (unsigned long long) misses);
    kiln_client_destroy (&c);
    kiln_graph_destroy (&g);
    return 0;
}

int
main (int argc, char **argv)
{
    if (argc == 4 && strcmp (argv[1], "upload") == 0)
        return s_upload (argv[2], argv[3]);
    fprintf (stderr, "usage: bench_large upload EP MODEL.onnx\n");
    return 2;
}
