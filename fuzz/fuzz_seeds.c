/*
 * fuzz-seeds — the seed corpora of the harnesses, made from the tests'
 * own inputs: `fuzz-seeds OUTDIR MODEL.onnx...` writes OUTDIR/<harness>/
 * for every harness in fuzz/:
 *
 *   onnx      the ONNX models given (tests/data/onnx, and the conformance
 *             node tests' models for long runs)
 *   graph     each model that imports, as a .kgraph
 *   program   each one that compiles: its program.kbin
 *   artifact  the same compiled and signed (a key made here), as a .kar
 *   release   a signed release record of each artifact, and its record
 *   npy       arrays of every dtype in a few shapes, as .npy
 *   wire      every command of the protocol with its fields, encoded
 *
 * A model that does not import or compile is still an onnx seed.  Seeds
 * are named by content, so running this again adds nothing twice.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "artifact/kiln_artifact.h"
#include "artifact/kiln_release.h"
#include "common/kiln_fs.h"
#include "common/kiln_hash.h"
#include "common/kiln_log.h"
#include "common/kiln_program.h"
#include "common/kiln_proto.h"
#include "compiler/kiln_compiler.h"
#include "graph/kiln_graph.h"
#include "graph/kiln_onnx.h"
#include "runtime/kiln_npy.h"

static const char *s_out;
static int s_written;
static uint8_t *s_small_kar;         /* the smallest artifact made, for the wire */
static size_t s_small_kar_len;

/* OUTDIR/<harness>/<sha256 of the bytes, 16 hex>. */
static void
s_seed (const char *harness, const void *data, size_t len)
{
    char dir[PATH_MAX], path[PATH_MAX], hex[KILN_HEX_LEN];
    uint8_t digest[KILN_DIGEST_LEN];
    kiln_sha256 (data, len, digest);
    kiln_hex (digest, KILN_DIGEST_LEN, hex);
    snprintf (dir, sizeof dir, "%s/%s", s_out, harness);
    snprintf (path, sizeof path, "%s/seed-%.16s", dir, hex);
    kiln_err_t err = { 0 };
    if (kiln_mkdir_p (dir, 0755, &err) != 0
        || kiln_write_file_atomic (path, data, len, 0644, &err) != 0) {
        fprintf (stderr, "fuzz-seeds: %s\n", err.msg);
        exit (1);
    }
    s_written++;
}

/* One model: the onnx seed, then whatever it turns into. */
static void
s_model (const char *path, const kiln_key_t *key)
{
    kiln_err_t err = { 0 };
    uint8_t *bytes = NULL, *kar = NULL, *kg = NULL;
    size_t len = 0, kar_len = 0, kg_len = 0;
    kiln_graph_t *g = NULL;
    kiln_artifact_t *art = NULL;
    char *env = NULL, *rec = NULL;
    if (kiln_read_file (path, KILN_MAX_MODEL_BYTES, &bytes, &len, &err) != 0) {
        fprintf (stderr, "fuzz-seeds: %s\n", err.msg);
        exit (1);
    }
    s_seed ("onnx", bytes, len);
    char tmp[PATH_MAX];
    snprintf (tmp, sizeof tmp, "%s/.model.kgraph", s_out);
    if (!(g = kiln_onnx_import_mem (bytes, len, &err))
        || kiln_graph_save (g, tmp, &err) != 0
        || kiln_read_file (tmp, KILN_MAX_MODEL_BYTES, &kg, &kg_len, &err) != 0)
        goto done;
    s_seed ("graph", kg, kg_len);
    if (!(art = kiln_cc_compile (g, "", &err)))
        goto done;
    size_t plen;
    const uint8_t *prog = kiln_artifact_member (art, KILN_PROGRAM_MEMBER, &plen);
    if (prog)
        s_seed ("program", prog, plen);
    if (kiln_artifact_sign (art, key, "{\"worker\":\"worker-1\"}", &err) != 0
        || kiln_artifact_write_mem (art, &kar, &kar_len, &err) != 0)
        goto done;
    s_seed ("artifact", kar, kar_len);
    if (!s_small_kar || kar_len < s_small_kar_len) {
        free (s_small_kar);
        s_small_kar = kar;
        s_small_kar_len = kar_len;
        kar = NULL;
    }
    kiln_release_t rel;
    size_t env_len, rec_len;
    if (kiln_release_init (&rel, art, "model", 1, (int64_t) time (NULL), 30 * 86400, &err) != 0
        || kiln_release_sign (&rel, key, &env, &env_len, &err) != 0
        || kiln_release_encode (&rel, &rec, &rec_len, &err) != 0)
        goto done;
    s_seed ("release", env, env_len);
    s_seed ("release", rec, rec_len);
done:
    if (err.msg[0])
        fprintf (stderr, "fuzz-seeds: %s: %s (an onnx seed only)\n", path, err.msg);
    unlink (tmp);
    free (env);
    free (rec);
    free (kar);
    free (kg);
    free (bytes);
    kiln_artifact_destroy (&art);
    kiln_graph_destroy (&g);
}

/* Arrays of every dtype: a scalar, a vector and a 2x3x1 block. */
static void
s_npys (void)
{
    static const kiln_dtype_t dts[] = {
#define S_DT(name, onnx, text, size, descr) KILN_DT_##name,
        KILN_DTYPES (S_DT)
#undef S_DT
    };
    kiln_shape_t shapes[] = { { 0, { 0 } }, { 1, { 5 } }, { 3, { 2, 3, 1 } } };
    uint8_t zeros[6 * 8];
    for (size_t i = 0; i < sizeof zeros; i++)
        zeros[i] = (uint8_t) (i * 37);
    for (size_t d = 0; d < sizeof dts / sizeof *dts; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
            kiln_err_t err = { 0 };
            uint8_t *out;
            size_t len;
            if (kiln_npy_encode (dts[d], &shapes[s], zeros, &out, &len, &err) != 0) {
                fprintf (stderr, "fuzz-seeds: npy: %s\n", err.msg);
                exit (1);
            }
            s_seed ("npy", out, len);
            free (out);
        }
}

/* Every field of `m` its command carries, set to a value in bounds. */
static void
s_fill (kiln_msg_t *m)
{
    static const char hex[] = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
#define S_SET_U64(f)   m->f = 1;
#define S_SET_I64(f)   m->f = 1;
#define S_SET_SINT(f)  m->f = -1;
#define S_SET_BOOL(f)  m->f = true;
#define S_SET_STR(f)   kiln_msg_set_str (&m->f, "worker-1");
#define S_SET_HEX(f)   memcpy (m->f, hex, sizeof hex);
#define S_SET_BLOBS(f)  if ((m->f = calloc (1, sizeof *m->f))) { m->n_##f = 1; m->f->size = 16; }
#define S_SET_STRS(f)  kiln_msg_add_strs (&m->f, &m->n_##f, "kiln-builtin 0.1.0 cpu-x86_64");
#define S_SET(name, kind, max, doc) S_SET_##kind (name)
    KILN_PROTO_FIELDS (S_SET)
#undef S_SET
    m->offset = 0;
    m->artifact_size = 0;
    m->blob_size = 0;
    m->struct_size = 0;
}

/* Every command, encoded with its payload, frames joined by 0xc1 0xc1
 * (fuzz_wire.c). */
static void
s_wire (const uint8_t *kar, size_t kar_len)
{
    for (int c = 0; c < KILN_CMD_COUNT; c++) {
        kiln_err_t err = { 0 };
        kiln_msg_t *m = kiln_msg_new ((kiln_cmd_t) c);
        s_fill (m);
        uint8_t digest[KILN_DIGEST_LEN];
        static const char blob[] = "sixteen bytes!!";
        kiln_sha256 (blob, sizeof blob, digest);
        int rc = 0;
        switch (kiln_cmd_payload ((kiln_cmd_t) c)) {
        case KILN_PAYLOAD_GRAPH:
            free (m->blobs);                 /* the payload lists its own */
            m->blobs = NULL;
            m->n_blobs = 0;
            rc = kiln_msg_put_structure (m, "structure", 9, &err);
            if (rc == 0)
                rc = kiln_msg_put_blob (m, digest, blob, sizeof blob, &err);
            if (rc == 0)
                rc = kiln_msg_add_blob_ref (m, digest, 1 << 20, &err);
            break;
        case KILN_PAYLOAD_ARTIFACT:
            m->artifact_size = kar_len;
            rc = kiln_msg_put_artifact (m, kar, kar_len, &err);
            break;
        case KILN_PAYLOAD_CHUNK:
            m->blob_size = sizeof blob;
            rc = kiln_msg_put_chunk (m, blob, sizeof blob, &err);
            break;
        case KILN_PAYLOAD_PART:
            m->artifact_size = sizeof blob;
            rc = kiln_msg_put_chunk (m, blob, sizeof blob, &err);
            break;
        default:
            break;
        }
        zmsg_t *raw = rc == 0 ? kiln_msg_encode (&m, &err) : NULL;
        kiln_msg_destroy (&m);
        if (!raw) {
            fprintf (stderr, "fuzz-seeds: %s: %s\n", kiln_cmd_name ((kiln_cmd_t) c), err.msg);
            continue;
        }
        size_t len = 0;
        for (zframe_t *f = zmsg_first (raw); f; f = zmsg_next (raw))
            len += zframe_size (f) + 2;
        uint8_t *buf = malloc (len), *p = buf;
        for (zframe_t *f = zmsg_first (raw); f; f = zmsg_next (raw)) {
            if (p != buf) {
                *p++ = 0xc1;
                *p++ = 0xc1;
            }
            memcpy (p, zframe_data (f), zframe_size (f));
            p += zframe_size (f);
        }
        s_seed ("wire", buf, (size_t) (p - buf));
        free (buf);
        zmsg_destroy (&raw);
    }
}

int
main (int argc, char **argv)
{
    if (argc < 2) {
        fprintf (stderr, "usage: fuzz-seeds OUTDIR MODEL.onnx...\n");
        return 2;
    }
    kiln_log_init ("fuzz-seeds", LOG_CRIT);
    s_out = argv[1];
    kiln_err_t err = { 0 };
    kiln_key_t *key = kiln_key_generate (&err);
    if (!key || kiln_mkdir_p (s_out, 0755, &err) != 0) {
        fprintf (stderr, "fuzz-seeds: %s\n", err.msg);
        return 1;
    }
    for (int i = 2; i < argc; i++)
        s_model (argv[i], key);
    s_npys ();
    if (!s_small_kar) {
        fprintf (stderr, "fuzz-seeds: no model compiled, so no artifact for the wire\n");
        return 1;
    }
    s_wire (s_small_kar, s_small_kar_len);
    free (s_small_kar);
    kiln_key_destroy (&key);
    printf ("fuzz-seeds: %d seeds in %s\n", s_written, s_out);
    return 0;
}
