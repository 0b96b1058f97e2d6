/*
 * kiln_artifact — the signed artifact archive (.kar).
 *
 * An artifact is a plain pax tar, written and read with libarchive, whose
 * members are, in this order:
 *   manifest.json     the manifest (below), compact JSON with sorted keys
 *   manifest.sig      64-byte raw Ed25519 signature over manifest.json
 *   signature.json    {"algorithm":"ed25519","key_id":...,"signs":"manifest.json"}
 *   provenance.json   who built it, where and when (optional)
 *   provenance.sig    Ed25519 signature over provenance.json (with it)
 *   <payload members> listed in the manifest with SHA-256 and size
 *                     (the builtin compiler writes program.kbin and
 *                     weights.bin)
 * Tar headers carry mtime 0, uid/gid 0 and mode 0644 so that the same
 * content and key give the same bytes.  A payload member of at least
 * KILN_ARTIFACT_ALIGN bytes starts its data at a multiple of
 * KILN_ARTIFACT_ALIGN in the file: the writer puts a pax extended header
 * holding only a "comment" record of the right length before it (stock
 * tar ignores it), so that the runtime can map the member's pages
 * straight from the file.
 *
 * The artifact's content hash is the SHA-256 of manifest.json.  The
 * manifest holds no builder and no time, so it does not depend on who
 * built the artifact or when; provenance.json does, and is signed apart.
 *
 * Invariants of a kiln_artifact_t: the manifest's member list is derived
 * from the payload members when the manifest is serialised (so it cannot
 * disagree with them), and an artifact read from disk has had every
 * payload member's size and digest checked against its manifest.
 *
 * Keys are Ed25519 through OpenSSL's EVP API, stored as PEM: PKCS#8 for
 * the private key (mode 0600) and SubjectPublicKeyInfo for the public key.
 * A key id is the first 16 hex characters of the SHA-256 of the public
 * key's DER encoding.  A keyring is a directory of public-key .pem files.
 */
#ifndef KILN_ARTIFACT_H
#define KILN_ARTIFACT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kiln_dtype.h"
#include "common/kiln_error.h"
#include "common/kiln_hash.h"

#define KILN_ARTIFACT_FORMAT_VERSION 1
#define KILN_RUNTIME_ABI_VERSION     1
#define KILN_KEY_ID_LEN              17     /* 16 hex chars + NUL */
#define KILN_MAX_MEMBER_NAME         64     /* bytes in a payload member name */
#define KILN_SIG_LEN                 64     /* bytes in an Ed25519 signature */
#define KILN_ARTIFACT_ALIGN          4096   /* file offset of a large member's data */

typedef struct kiln_io {
    char name[KILN_MAX_NAME + 1];   /* graph input/output name */
    kiln_dtype_t dtype;
    kiln_shape_t shape;
} kiln_io_t;

/* One stage of a pipelined model (--pipeline-cores), as the compiler cut
 * it: the manifest's record of what each core will do, by the cost model
 * of common/kiln_cost.h.  The program (program.kbin, "stages") holds what
 * the runtime executes; the two must agree on the stages' ops. */
typedef struct kiln_stage_info {
    int first_op;                        /* its first op in program.kbin */
    int n_ops;                           /* its ops */
    uint64_t flops;                      /* arithmetic, 2 per multiply-add */
    uint64_t moved_bytes;                /* operands and results of its ops */
    uint64_t cost_ns;                    /* the cost model's estimate per run */
    uint64_t weights_bytes;              /* the weights its ops read */
    uint64_t handoff_bytes;              /* arena bytes handed to it per run */
} kiln_stage_info_t;

typedef struct kiln_manifest {
    int format_version;                  /* KILN_ARTIFACT_FORMAT_VERSION */
    char graph_digest[KILN_HEX_LEN];     /* digest of the source graph */
    char action_key[KILN_HEX_LEN];       /* key of the compilation */
    char compiler_id[64];                /* "kiln-builtin" or a toolchain name */
    char compiler_version[64];
    char compiler_args[KILN_MAX_ARGS_BYTES];   /* normalised */
    char target[64];                     /* e.g. "cpu-x86_64" */
    int runtime_abi;                     /* KILN_RUNTIME_ABI_VERSION */
    kiln_io_t *inputs;   int n_inputs;   /* owned */
    kiln_io_t *outputs;  int n_outputs;  /* owned */
    char *io_structure;                  /* how inputs/outputs nest (the graph's
                                            JSON text), owned; NULL when absent */
    kiln_stage_info_t *stages;           /* pipeline stages, owned; NULL when */
    int n_stages;                        /* not pipelined (0), else 2.. */
} kiln_manifest_t;

typedef struct kiln_artifact kiln_artifact_t;
typedef struct kiln_key kiln_key_t;

/* --- artifacts ----------------------------------------------------- */

/* Create an empty, unsigned artifact.  Caller owns it. */
kiln_artifact_t *kiln_artifact_new (void);
void kiln_artifact_destroy (kiln_artifact_t **self_p);

/* The manifest, to fill in before writing.  Owned by the artifact.
 * Use kiln_manifest_set_io to set inputs/outputs, and
 * kiln_manifest_set_io_structure to set io_structure. */
kiln_manifest_t *kiln_artifact_manifest (kiln_artifact_t *self);
int kiln_manifest_set_io (kiln_manifest_t *m, bool outputs,
                          const kiln_io_t *ios, int n, kiln_err_t *err);
/* Set io_structure to a copy of `text`; NULL or "" removes it.  Fails
 * (leaving the old value) when the text is longer than
 * KILN_MAX_IO_STRUCTURE_BYTES. */
int kiln_manifest_set_io_structure (kiln_manifest_t *m, const char *text,
                                    kiln_err_t *err);

/* Record the pipeline stages (a copy of stages[n]; n 0 removes them).
 * Fails (leaving the old value) when n is not 0 or
 * 2..KILN_MAX_PIPELINE_STAGES. */
int kiln_manifest_set_pipeline (kiln_manifest_t *m, const kiln_stage_info_t *stages,
                                int n, kiln_err_t *err);

/* Add a payload member; copies `data`.  Names are [A-Za-z0-9._-]{1,64}
 * and not one of the reserved names above. */
int kiln_artifact_add_member (kiln_artifact_t *self, const char *name,
                              const void *data, size_t len, kiln_err_t *err);
/* Add a payload member, taking ownership of *data (malloc'd); NULLs it.
 * *data is consumed on error too (freed and NULLed). */
int kiln_artifact_take_member (kiln_artifact_t *self, const char *name,
                               uint8_t **data, size_t len, kiln_err_t *err);
/* A payload member's bytes, or NULL when absent.  Owned by the artifact. */
const uint8_t *kiln_artifact_member (const kiln_artifact_t *self,
                                     const char *name, size_t *len);
/* Number of payload members and the name of the i-th (artifact owns). */
int kiln_artifact_member_count (const kiln_artifact_t *self);
const char *kiln_artifact_member_name (const kiln_artifact_t *self, int i);

/* The manifest.json bytes, serialised now from the manifest and members
 * (deterministic).  Caller owns *out (free()). */
int kiln_artifact_manifest_json (kiln_artifact_t *self, char **out,
                                 size_t *len, kiln_err_t *err);
/* The content hash: SHA-256 of manifest.json, as hex. */
int kiln_artifact_digest (kiln_artifact_t *self, char out[KILN_HEX_LEN],
                          kiln_err_t *err);

/* Sign the manifest with `key` and, when `provenance_json` is not NULL,
 * attach and sign it too.  Replaces any earlier signature. */
int kiln_artifact_sign (kiln_artifact_t *self, const kiln_key_t *key,
                        const char *provenance_json, kiln_err_t *err);
bool kiln_artifact_is_signed (const kiln_artifact_t *self);
/* Key id of the signer ("" when unsigned); owned by the artifact. */
const char *kiln_artifact_signer (const kiln_artifact_t *self);
/* provenance.json text, or NULL; owned by the artifact. */
const char *kiln_artifact_provenance (const kiln_artifact_t *self);

/* Write the archive to `path` atomically, or to memory (caller owns
 * *out).  An unsigned artifact is written without signature members. */
int kiln_artifact_write (kiln_artifact_t *self, const char *path,
                         kiln_err_t *err);
int kiln_artifact_write_mem (kiln_artifact_t *self, uint8_t **out,
                             size_t *len, kiln_err_t *err);

/* Write the archive to the open file `fd` from its current position, as
 * libarchive produces it (never whole in memory: mapped members are
 * streamed from their mapping, whose pages are given back as they are
 * written); *len (may be NULL) gets its size.  The caller syncs and
 * closes `fd`. */
int kiln_artifact_write_fd (kiln_artifact_t *self, int fd, uint64_t *len,
                            kiln_err_t *err);

/* Add a payload member made of `len` bytes of the file `fd` at `offset`
 * (a multiple of KILN_ARTIFACT_ALIGN for a member of at least that
 * size): mapped read-only and hashed, its pages given back as they are
 * hashed, not copied into memory; smaller members are read.  The file
 * must not change while the artifact lives (what is written is what is
 * mapped then).  `fd` stays the caller's.  Names as for
 * kiln_artifact_add_member. */
int kiln_artifact_map_member (kiln_artifact_t *self, const char *name, int fd,
                              uint64_t offset, uint64_t len, kiln_err_t *err);

/* Read an archive (bounded by KILN_MAX_* limits), parse its manifest and
 * check every payload member's size and SHA-256 against it; an error
 * names the member at fault.  Does not check the signature.  Caller owns
 * the result. */
kiln_artifact_t *kiln_artifact_read (const char *path, kiln_err_t *err);
kiln_artifact_t *kiln_artifact_read_mem (const uint8_t *data, size_t len,
                                         kiln_err_t *err);

/* Check the signature (algorithm and key id first, then Ed25519 over
 * manifest.json; and provenance.sig over provenance.json when present)
 * against the public keys in directory `keyring_dir`.  Fails with
 * KILN_EVERIFY naming the reason: unsigned, unknown key id, bad signature. */
int kiln_artifact_verify (const kiln_artifact_t *self, const char *keyring_dir,
                          kiln_err_t *err);

/* read + verify: what every loader calls.  Caller owns the result. */
kiln_artifact_t *kiln_artifact_open_verified (const char *path,
                                              const char *keyring_dir,
                                              kiln_err_t *err);

/* --- keys ---------------------------------------------------------- */

/* Generate an Ed25519 key pair.  Caller owns it. */
kiln_key_t *kiln_key_generate (kiln_err_t *err);
/* Load a private key PEM (PKCS#8).  Caller owns it. */
kiln_key_t *kiln_key_load_private (const char *path, kiln_err_t *err);
/* Load a public key PEM (SubjectPublicKeyInfo).  Caller owns it. */
kiln_key_t *kiln_key_load_public (const char *path, kiln_err_t *err);
void kiln_key_destroy (kiln_key_t **self_p);
/* The key id (16 hex chars); owned by the key. */
const char *kiln_key_id (const kiln_key_t *self);
/* Write DIR/kiln.key (private, 0600, O_EXCL|O_NOFOLLOW) and DIR/kiln.pub
 * (public, 0644), creating DIR.  Fails when the private key exists. */
int kiln_key_write_pair (const kiln_key_t *self, const char *dir,
                         kiln_err_t *err);
/* Write only the public key PEM to `path` (0644, atomic). */
int kiln_key_write_public (const kiln_key_t *self, const char *path,
                           kiln_err_t *err);
/* The key's fingerprint: SHA-256 of its public key's DER encoding, 64 hex
 * characters (the key id is its first 16).  Owned by the key. */
const char *kiln_key_fingerprint (const kiln_key_t *self);
/* The public key as PEM text (SubjectPublicKeyInfo).  Caller frees
 * *pem (free()). */
int kiln_key_public_pem (const kiln_key_t *self, char **pem, kiln_err_t *err);
/* Parse a public key from PEM text of at most KILN_MAX_KEY_BYTES; `what`
 * names it in errors.  Caller owns the key. */
kiln_key_t *kiln_key_parse_public (const char *pem, size_t len, const char *what,
                                   kiln_err_t *err);

/* --- additions ---------------------------------------------------- */

/* Deep-copy `src` into `dst` (whose old contents are not freed).  Release
 * `dst` with kiln_manifest_release. */
int kiln_manifest_copy (kiln_manifest_t *dst, const kiln_manifest_t *src,
                        kiln_err_t *err);
/* Free the inputs, outputs and io_structure a manifest owns and zero it.
 * For copies made with kiln_manifest_copy; an artifact's own manifest is
 * released by kiln_artifact_destroy. */
void kiln_manifest_release (kiln_manifest_t *m);

/* read_mem + verify, for archives that arrive over the wire.  Caller
 * owns the result. */
kiln_artifact_t *kiln_artifact_open_verified_mem (const uint8_t *data,
                                                  size_t len,
                                                  const char *keyring_dir,
                                                  kiln_err_t *err);

/* Flags of kiln_artifact_read_fd. */
#define KILN_ARTIFACT_MAP  1u   /* map large members instead of reading them */
#define KILN_ARTIFACT_SKIM 2u   /* check the manifest, signature members and every
                                   member's name and size, but skip the payload
                                   bytes: neither read nor hashed, so the result
                                   has no member data (kiln_artifact_member gives
                                   NULL) and must not be written.  For a store
                                   that wrote and hashed the file itself and
                                   serves it to readers who check every byte. */

/* Read the archive open on `fd` as kiln_artifact_read does (from offset 0;
 * the file position moves); `path` names it in errors.  `fd` stays the
 * caller's: close it when you like, the mappings do not need it.
 *
 * With KILN_ARTIFACT_MAP, a payload member of at least KILN_ARTIFACT_ALIGN
 * bytes whose data starts at a page boundary of the file is not read into
 * memory: its range of the file is mapped read-only (MAP_SHARED) and its
 * SHA-256 is computed over the mapped pages, so that the bytes checked
 * against the manifest are the very bytes kiln_artifact_member hands out.
 * Only a file that nobody but this process's effective user and root can
 * change is mapped (owned by one of them, no group or other write bit, no
 * access ACL); any other file, a member that does not start at a page
 * boundary (artifacts written before members were aligned), and a file
 * that cannot be mapped are read into memory as without the flag.  When
 * anything was mapped, the file must have the same inode, size, mtime and
 * ctime after reading as before (KILN_EVERIFY "changed while it was being
 * read" otherwise).  What kiln guarantees when the file changes after
 * that: docs/artifact-format.md, "Mapped members".  Caller owns the
 * result. */
kiln_artifact_t *kiln_artifact_read_fd (int fd, const char *path,
                                        unsigned flags, kiln_err_t *err);

/* True when payload member `name` is pages mapped from the archive file
 * (kiln_artifact_read_fd with KILN_ARTIFACT_MAP), false when its bytes
 * are in memory or there is no such member. */
bool kiln_artifact_member_mapped (const kiln_artifact_t *self,
                                  const char *name);

/* Where payload member i's data lies in the archive file it was read
 * from (kiln_artifact_read_fd, any flags): its byte offset in the file,
 * its size and its SHA-256 in hex (as the manifest lists it).  For
 * serving or reusing members by digest; the offset is where the reader
 * found the data, so whoever relies on it still checks the bytes.
 * -KILN_EINVAL when i is out of range or the artifact was not read from
 * a file. */
int kiln_artifact_member_span (const kiln_artifact_t *self, int i, uint64_t *offset,
                               uint64_t *len, char sha256[KILN_HEX_LEN]);

/* True when the key holds a private part (can sign). */
bool kiln_key_has_private (const kiln_key_t *self);

/* A keyring loaded once, for a process that verifies many artifacts (the
 * broker).  kiln_artifact_verify (self, dir) is kiln_keyring_load (dir) +
 * kiln_artifact_verify_keyring.  Loading reads every regular file in `dir`
 * ending in .pub or .pem that parses as an Ed25519 PUBLIC key, skipping
 * private keys and other files silently, so that a `kiln keygen` output
 * directory works as a keyring.  A missing or unreadable directory, or
 * more than KILN_MAX_KEYRING_KEYS keys, is an error.  Caller owns it. */
typedef struct kiln_keyring kiln_keyring_t;
kiln_keyring_t *kiln_keyring_load (const char *dir, kiln_err_t *err);
void kiln_keyring_destroy (kiln_keyring_t **self_p);
/* Number of keys, and the i-th (owned by the keyring). */
int kiln_keyring_count (const kiln_keyring_t *self);
const kiln_key_t *kiln_keyring_key (const kiln_keyring_t *self, int i);
/* The key with id `key_id`, or NULL; owned by the keyring. */
const kiln_key_t *kiln_keyring_find (const kiln_keyring_t *self,
                                     const char *key_id);
/* The directory the keyring was loaded from; owned by the keyring. */
const char *kiln_keyring_dir (const kiln_keyring_t *self);
/* kiln_artifact_verify against an already loaded keyring. */
int kiln_artifact_verify_keyring (const kiln_artifact_t *self,
                                  const kiln_keyring_t *ring, kiln_err_t *err);

#endif
