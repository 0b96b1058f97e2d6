/*
 * kiln_limits — every bound on a size that comes from outside.
 *
 * Anything read from the network, a file or a user is checked against one
 * of these before memory is allocated for it.  Exceeding a bound is a
 * KILN_ELIMIT error that names the bound, never a crash or an OOM.
 */
#ifndef KILN_LIMITS_H
#define KILN_LIMITS_H

#define KILN_MAX_RANK            8            /* dimensions of one tensor */
#define KILN_MAX_DIM             (1LL << 31)  /* one dimension */
#define KILN_MAX_TENSOR_ELEMS    (1LL << 32)  /* elements of one tensor */
#define KILN_MAX_NAME            256          /* tensor, node, input names */
#define KILN_MAX_OP_NAME         64           /* operator type names */
#define KILN_MAX_NODES           (1 << 20)    /* nodes in one graph */
#define KILN_MAX_TENSORS         (1 << 21)    /* tensors in one graph */
#define KILN_MAX_ATTRS           64           /* attributes on one node */
#define KILN_MAX_ATTR_ELEMS      (1 << 16)    /* ints/floats in one attribute */
#define KILN_MAX_NODE_IO         1024         /* inputs or outputs of a node */
#define KILN_MAX_GRAPH_IO        1024         /* graph inputs or outputs */
#define KILN_MAX_STRUCT_BYTES    (256u << 20) /* encoded graph structure */
#define KILN_MAX_BLOB_BYTES      (4ULL << 30) /* one weight blob */
#define KILN_MAX_MODEL_BYTES     (8ULL << 30) /* an ONNX or kgraph file */
#define KILN_MAX_ARTIFACT_BYTES  (8ULL << 30) /* a whole artifact archive */
#define KILN_MAX_MEMBER_BYTES    (8ULL << 30) /* one archive member */
#define KILN_MAX_MANIFEST_BYTES  (1u << 20)   /* manifest.json */
#define KILN_MAX_MEMBERS         64           /* members in one archive */
#define KILN_MAX_ARGS_BYTES      4096         /* compiler argument string */
#define KILN_MAX_KEY_BYTES       (64u << 10)  /* a PEM key file */
#define KILN_MAX_KEYRING_KEYS    1024         /* keys in one keyring dir */
#define KILN_MAX_FRAME_BYTES     (64u << 20)  /* one ZeroMQ frame */
#define KILN_MAX_FRAMES          4096         /* frames in one message */
#define KILN_CHUNK_BYTES         (1u << 20)   /* blob chunk on the wire */
#define KILN_MAX_LOG_BYTES       (1u << 20)   /* compile log kept per job */
#define KILN_MAX_IO_STRUCTURE_BYTES (64u << 10) /* a model's I/O structure text */
#define KILN_MAX_PIPELINE_STAGES 32           /* stages of a pipelined model (--pipeline-cores) */
#define KILN_MAX_RELEASE_BYTES   (4u << 10)   /* a signed release record file */
#define KILN_MAX_MODEL_NAME      64           /* a released model's name */
#define KILN_MAX_RELEASE_SECONDS (365LL * 86400) /* a release record's lifetime */
#define KILN_MAX_DOWNLOADS       64           /* GETs a broker answers at once */
#define KILN_MAX_CLIENT_DOWNLOADS 8           /* GETs one connection has at once */
#define KILN_MAX_DOWNLOAD_CHUNKS 128          /* chunks of all GETs ZeroMQ holds at once */
#define KILN_MAX_PINS            65536        /* artifacts pinned in one store */
#define KILN_MAX_FOLD_BYTES      (256u << 20) /* bytes constant folding materialises per graph */
#define KILN_MAX_COMPILE_FILE_BYTES (2 * KILN_MAX_ARTIFACT_BYTES) /* one file a compile writes */
#define KILN_MAX_COMPILE_TMP_BYTES (256u << 20) /* the fresh /tmp of a compile's sandbox */
#define KILN_SERVE_MAX_MODELS    256          /* models in one kiln-serve repository */
#define KILN_SERVE_MAX_REPO_ENTRIES 4096      /* directory entries a repository scan reads */
#define KILN_SERVE_MAX_REPLICAS  64           /* kiln-serve --replicas */
#define KILN_SERVE_MAX_BATCH     1024         /* rows in one request or server-side batch */
#define KILN_SERVE_MAX_QUEUE     65536        /* kiln-serve --max-queue */
#define KILN_SERVE_MAX_BODY      (1ULL << 30) /* kiln-serve --max-body */
#define KILN_SERVE_MAX_CONNECTIONS 4096       /* kiln-serve --max-connections */
#define KILN_SERVE_MAX_RESPONSE  (1ULL << 32) /* one HTTP response body */
#define KILN_SERVE_MAX_METRICS_BYTES (16u << 20) /* one /metrics page */
#define KILN_SERVE_MAX_REQUEST_ID 256         /* an inference request's "id" */

#endif
