/*
 * kiln_client — libkilnclient: compile a kiln graph on the farm or
 * locally and get a signed artifact.
 *
 * kiln_client_compile talks to a kiln-broker (docs/protocol.md): it sends
 * the graph structure and the weight blobs, waits for the signed artifact
 * and writes it to a file.  kiln_compile_local does the same in-process
 * with the builtin compiler, signing with the user's own key.
 */
#ifndef KILN_CLIENT_H
#define KILN_CLIENT_H

#include <stdbool.h>

#include "common/kiln_error.h"
#include "common/kiln_hash.h"
#include "graph/kiln_graph.h"

typedef struct kiln_client kiln_client_t;

typedef struct kiln_compile_opts {
    const char *compiler_args;   /* raw argument string, may be NULL */
    int timeout_ms;              /* whole request; 0 = library default */
} kiln_compile_opts_t;

typedef struct kiln_compile_result {
    char artifact[KILN_HEX_LEN];     /* content hash (SHA-256 of manifest) */
    char action_key[KILN_HEX_LEN];
    char graph_digest[KILN_HEX_LEN];
    bool cached;                     /* served from the action cache */
    char worker[128];                /* who built it; "" when cached or local */
} kiln_compile_result_t;

/* Connect to the broker at `endpoint` ("tcp://host:port").  Caller owns
 * the client. */
kiln_client_t *kiln_client_new (const char *endpoint, kiln_err_t *err);
void kiln_client_destroy (kiln_client_t **self_p);

/* Compile `g` (with all weight data) on the farm and write the signed
 * artifact atomically to `out_path`.  Errors from the farm (a compile
 * error, a refusal, a timeout) come back with their message. */
int kiln_client_compile (kiln_client_t *self, const kiln_graph_t *g,
                         const kiln_compile_opts_t *opts, const char *out_path,
                         kiln_compile_result_t *res, kiln_err_t *err);

/* Compile `g` in-process and sign with the private key at `key_path`
 * (NULL: the user's key in kiln_config_dir()/keys, created on first
 * use).  Writes the artifact atomically to `out_path`. */
int kiln_compile_local (kiln_graph_t *g, const kiln_compile_opts_t *opts,
                        const char *key_path, const char *out_path,
                        kiln_compile_result_t *res, kiln_err_t *err);

#endif
