/*
 * kiln_compiler — the builtin compiler: a validated kiln graph in, an
 * unsigned artifact (manifest + program.kbin + weights.bin) out.
 *
 * Deterministic: the same graph, arguments and compiler version give the
 * same bytes.  The artifact's manifest is filled in completely (graph
 * digest, action key, compiler id/version/arguments, target, runtime ABI,
 * inputs and outputs); signing is the caller's business (kiln-cc, the
 * client's local path, the broker).
 */
#ifndef KILN_COMPILER_H
#define KILN_COMPILER_H

#include <stdint.h>

#include "artifact/kiln_artifact.h"
#include "graph/kiln_graph.h"

#define KILN_COMPILER_ID      "kiln-builtin"
/* Part of every action key: bump it whenever the programs the compiler
 * emits change, so that a farm's action cache never serves an artifact
 * built by an older compiler for a newer one's arguments.  0.2.0: the
 * engine (fusion, packed weights, Winograd at -O3). */
#define KILN_COMPILER_VERSION "0.2.0"

typedef struct kiln_cc_options {
    int optlevel;               /* --optlevel 0..3, default 2 */
    int pipeline_cores;         /* --pipeline-cores N: stages (1: none) */
} kiln_cc_options_t;

/* The target this compiler builds for, e.g. "cpu-x86_64". */
const char *kiln_cc_target (void);

/* Parse a compiler argument string ("--optlevel 1"); unknown flags and
 * bad values are an error naming them.  `opts` gets the defaults first.
 * torch-neuron's spelling --neuroncore-pipeline-cores is taken for
 * --pipeline-cores, with a notice in the log. */
int kiln_cc_parse_args (const char *args, kiln_cc_options_t *opts,
                        kiln_err_t *err);

/* Validate and compile `g` (which must have all its weight data) with
 * `args`.  Caller owns the returned unsigned artifact. */
kiln_artifact_t *kiln_cc_compile (kiln_graph_t *g, const char *args,
                                  kiln_err_t *err);

/* What a compilation produced, for reports (kiln-cc --json, logs). */
typedef struct kiln_cc_stats {
    uint64_t arena_bytes;       /* the planned arena */
    uint64_t naive_bytes;       /* one buffer per arena tensor, no reuse */
    uint64_t weights_bytes;     /* weights.bin, alignment included */
    int n_ops;                  /* kernel calls in the program */
} kiln_cc_stats_t;

/* kiln_cc_compile that also fills `stats` (which may be NULL). */
kiln_artifact_t *kiln_cc_compile_ex (kiln_graph_t *g, const char *args,
                                     kiln_cc_stats_t *stats, kiln_err_t *err);

/* kiln_cc_compile_ex that writes weights.bin into an unlinked file in
 * `spill_dir` (NULL: in memory, as kiln_cc_compile_ex) and maps it into
 * the artifact, so that neither the graph's weights (when they are
 * mapped, kiln_graph_map_weight) nor weights.bin are whole in memory;
 * kiln_artifact_write then streams it.  For kiln-cc, which writes the
 * artifact beside the spill file. */
kiln_artifact_t *kiln_cc_compile_spill (kiln_graph_t *g, const char *args,
                                        kiln_cc_stats_t *stats, const char *spill_dir,
                                        kiln_err_t *err);

#endif
