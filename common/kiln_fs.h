/*
 * kiln_fs — bounded file reads, atomic durable writes, directories.
 *
 * kiln_write_file_atomic writes a temporary file beside the target,
 * fsyncs it, renames it over the target and fsyncs the directory, so that
 * after a crash the target holds either the old or the new bytes, never a
 * mix.  The store and the action cache depend on this.
 */
#ifndef KILN_FS_H
#define KILN_FS_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <sys/types.h>

#include "common/kiln_error.h"

/* Open `path` for reading, only when it is a regular file: opened with
 * O_NONBLOCK (so that a FIFO or a device does not block the open or the
 * reads) plus `flags` (e.g. O_NOFOLLOW), checked with fstat, then set
 * back to blocking.  `what` names the file in errors ("artifact": "could
 * not open artifact 'x.kar': ...", "artifact 'x.kar' is not a regular
 * file"); NULL for none.  Returns the descriptor (caller closes it) and
 * fills *st when not NULL; a negative error code when the path cannot be
 * opened or is a FIFO, a socket, a device or a directory. */
struct stat;
int kiln_open_regular (const char *path, const char *what, int flags,
                       struct stat *st, kiln_err_t *err);

/* Read a whole file of at most `max` bytes (kiln_open_regular: regular
 * files only).  Caller owns *data (free()).
 * *data is NUL-terminated one byte past *len for convenience. */
int kiln_read_file (const char *path, uint64_t max, uint8_t **data,
                    size_t *len, kiln_err_t *err);
/* The same with more open(2) flags (O_NOFOLLOW: a symbolic link is
 * refused, "'PATH' is a symbolic link"). */
int kiln_read_file_flags (const char *path, int flags, uint64_t max, uint8_t **data,
                          size_t *len, kiln_err_t *err);

/* Write `len` bytes to `path` atomically and durably with `mode`. */
int kiln_write_file_atomic (const char *path, const void *data, size_t len,
                            mode_t mode, kiln_err_t *err);

/* The directory part of `path` into dir[size] ("." when it has none). */
void kiln_dirname (const char *path, char *dir, size_t size);

/* Write all `len` bytes to `fd` (retrying short writes); -1 with errno. */
int kiln_write_all (int fd, const void *data, size_t len);

/* Read `len` bytes at `offset` of `fd` into buf, at most KILN_CHUNK_BYTES a
 * call (retrying short reads and EINTR).  Returns the bytes read (fewer
 * than `len` only where the file ends), or -1 with errno. */
int64_t kiln_pread_all (int fd, void *buf, uint64_t len, uint64_t offset);

/* A new file "PATH.tmp.XXXXXX" beside `path` with `mode`, its name into
 * tmp[size]: returns its descriptor, to be written and then given to
 * kiln_tmp_commit (or closed and unlinked by the caller on failure). */
int kiln_tmp_beside (const char *path, char *tmp, size_t size, mode_t mode,
                     kiln_err_t *err);
/* fsync and close `fd`, rename `tmp` onto `path`, fsync the directory.
 * Consumes `fd`; `tmp` is removed on failure. */
int kiln_tmp_commit (int fd, const char *tmp, const char *path, kiln_err_t *err);

/* Create a new file with O_EXCL|O_NOFOLLOW and `mode`, write, fsync.
 * Fails if the file exists: used for private keys. */
int kiln_write_file_excl (const char *path, const void *data, size_t len,
                          mode_t mode, kiln_err_t *err);

/* mkdir -p with `mode` for the directories it creates. */
int kiln_mkdir_p (const char *path, mode_t mode, kiln_err_t *err);

/* Create a fresh private directory under $TMPDIR (or /tmp) named
 * "<prefix>XXXXXX".  Caller owns the returned string (free()) and removes
 * the directory with kiln_rm_rf. */
char *kiln_mkdtemp (const char *prefix, kiln_err_t *err);

/* Remove `path` and everything below it; missing is not an error. */
int kiln_rm_rf (const char *path);

bool kiln_file_exists (const char *path);

/* True when two fstat results describe the same file with the same
 * contents as far as the kernel tells: device, inode, size, mtime and
 * ctime all equal (any write or truncation moves ctime). */
bool kiln_file_unchanged (const struct stat *a, const struct stat *b);

/* True when `st` is this user's and no one else may write it: what a
 * cache must be before kiln believes what it says. */
bool kiln_stat_private (const struct stat *st);

/* The user's kiln config directory: $KILN_CONFIG_DIR, else
 * $XDG_CONFIG_HOME/kiln, else $HOME/.config/kiln.  Written into buf. */
int kiln_config_dir (char *buf, size_t size, kiln_err_t *err);

/* The user's kiln cache directory (what may be lost without harm, e.g.
 * the import cache): $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else
 * $HOME/.cache/kiln.  Written into buf. */
int kiln_cache_dir (char *buf, size_t size, kiln_err_t *err);

/* Path of the directory holding the running executable (for finding
 * sibling programs such as kiln-cc next to kiln-worker). */
int kiln_exe_dir (char *buf, size_t size, kiln_err_t *err);

/* Parse a whole number in [lo, hi] with an optional K/M/G suffix (powers
 * of 1024), as command-line options give sizes; -1 when `text` is not one. */
long long kiln_parse_number (const char *text, long long lo, long long hi);

#endif
