#include "common/kiln_fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kiln_limits.h"

int
kiln_open_regular (const char *path, const char *what, int flags, struct stat *st_out,
                   kiln_err_t *err)
{
    const char *sp = what ? " " : "";
    what = what ? what : "";
    int fd = open (path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | flags);
    if (fd < 0) {
        if (errno == ELOOP && (flags & O_NOFOLLOW))
            return kiln_error (err, KILN_EIO, "%s%s'%s' is a symbolic link", what, sp, path);
        return kiln_error (err, errno == ENOENT ? KILN_ENOTFOUND : KILN_EIO,
                           "could not open %s%s'%s': %s", what, sp, path, strerror (errno));
    }
    struct stat st;
    int fl;
    if (fstat (fd, &st) != 0 || !S_ISREG (st.st_mode)) {
        close (fd);
        return kiln_error (err, KILN_EIO, "%s%s'%s' is not a regular file", what, sp, path);
    }
    if ((fl = fcntl (fd, F_GETFL)) < 0 || fcntl (fd, F_SETFL, fl & ~O_NONBLOCK) < 0) {
        int e = errno;
        close (fd);
        return kiln_error (err, KILN_EIO, "could not open %s%s'%s': %s", what, sp, path,
                           strerror (e));
    }
    if (st_out)
        *st_out = st;
    return fd;
}

int
kiln_read_file (const char *path, uint64_t max, uint8_t **data, size_t *len,
                kiln_err_t *err)
{
    return kiln_read_file_flags (path, 0, max, data, len, err);
}

int
kiln_read_file_flags (const char *path, int flags, uint64_t max, uint8_t **data, size_t *len,
                      kiln_err_t *err)
{
    *data = NULL;
    *len = 0;
    struct stat st;
    int fd = kiln_open_regular (path, NULL, flags, &st, err);
    if (fd < 0)
        return fd;
    if ((uint64_t) st.st_size > max) {
        close (fd);
        return kiln_error (err, KILN_ELIMIT, "'%s' is %lld bytes, more than the limit of %llu",
                           path, (long long) st.st_size, (unsigned long long) max);
    }
    size_t size = (size_t) st.st_size;
    uint8_t *buf = malloc (size + 1);
    if (!buf) {
        close (fd);
        return kiln_error (err, KILN_ENOMEM, "out of memory reading '%s'", path);
    }
    size_t got = 0;
    while (got < size) {
        ssize_t n = read (fd, buf + got, size - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            int e = n < 0 ? errno : EIO;
            free (buf);
            close (fd);
            return kiln_error (err, KILN_EIO, "could not read '%s': %s", path,
                               n < 0 ? strerror (e) : "file shrank while reading");
        }
        got += (size_t) n;
    }
    close (fd);
    buf[size] = '\0';
    *data = buf;
    *len = size;
    return 0;
}

static int
s_write_all (int fd, const void *data, size_t len)
{
    const uint8_t *p = data;
    while (len > 0) {
        ssize_t n = write (fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -1;
        p += n;
        len -= (size_t) n;
    }
    return 0;
}

void
kiln_dirname (const char *path, char *dir, size_t size)
{
    snprintf (dir, size, "%s", path);
    char *slash = strrchr (dir, '/');
    if (slash == dir)
        slash[1] = '\0';
    else if (slash)
        *slash = '\0';
    else
        snprintf (dir, size, ".");
}

static void
s_fsync_dir_of (const char *path)
{
    char dir[PATH_MAX];
    kiln_dirname (path, dir, sizeof dir);
    int fd = open (dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync (fd);
        close (fd);
    }
}

int
kiln_write_all (int fd, const void *data, size_t len)
{
    return s_write_all (fd, data, len);
}

int64_t
kiln_pread_all (int fd, void *buf, uint64_t len, uint64_t offset)
{
    uint64_t done = 0;
    while (done < len) {
        size_t want = len - done < KILN_CHUNK_BYTES ? (size_t) (len - done) : KILN_CHUNK_BYTES;
        ssize_t n = pread (fd, (uint8_t *) buf + done, want, (off_t) (offset + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -1;
        if (n == 0)
            break;
        done += (uint64_t) n;
    }
    return (int64_t) done;
}

int
kiln_tmp_beside (const char *path, char *tmp, size_t size, mode_t mode, kiln_err_t *err)
{
    if (snprintf (tmp, size, "%s.tmp.XXXXXX", path) >= (int) size)
        return kiln_error (err, KILN_ELIMIT, "path too long: '%s'", path);
    int fd = mkostemp (tmp, O_CLOEXEC);
    if (fd < 0)
        return kiln_error (err, KILN_EIO, "could not create '%s': %s", tmp,
                           strerror (errno));
    if (fchmod (fd, mode) != 0) {
        int e = errno;
        close (fd);
        unlink (tmp);
        return kiln_error (err, KILN_EIO, "could not create '%s': %s", tmp, strerror (e));
    }
    return fd;
}

int
kiln_tmp_commit (int fd, const char *tmp, const char *path, kiln_err_t *err)
{
    if (fsync (fd) != 0) {
        int e = errno;
        close (fd);
        unlink (tmp);
        return kiln_error (err, KILN_EIO, "could not write '%s': %s", path, strerror (e));
    }
    close (fd);
    if (rename (tmp, path) != 0) {
        int e = errno;
        unlink (tmp);
        return kiln_error (err, KILN_EIO, "could not rename onto '%s': %s", path,
                           strerror (e));
    }
    s_fsync_dir_of (path);
    return 0;
}

int
kiln_write_file_atomic (const char *path, const void *data, size_t len,
                        mode_t mode, kiln_err_t *err)
{
    char tmp[PATH_MAX];
    int fd = kiln_tmp_beside (path, tmp, sizeof tmp, mode, err);
    if (fd < 0)
        return fd;
    if (s_write_all (fd, data, len) != 0) {
        int e = errno;
        close (fd);
        unlink (tmp);
        return kiln_error (err, KILN_EIO, "could not write '%s': %s", path,
                           strerror (e));
    }
    return kiln_tmp_commit (fd, tmp, path, err);
}

int
kiln_write_file_excl (const char *path, const void *data, size_t len,
                      mode_t mode, kiln_err_t *err)
{
    int fd = open (path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd < 0)
        return kiln_error (err, KILN_EIO, "could not create '%s': %s", path,
                           strerror (errno));
    if (fchmod (fd, mode) != 0 || s_write_all (fd, data, len) != 0
        || fsync (fd) != 0) {
        int e = errno;
        close (fd);
        unlink (path);
        return kiln_error (err, KILN_EIO, "could not write '%s': %s", path,
                           strerror (e));
    }
    close (fd);
    s_fsync_dir_of (path);
    return 0;
}

int
kiln_mkdir_p (const char *path, mode_t mode, kiln_err_t *err)
{
    char buf[PATH_MAX];
    if (snprintf (buf, sizeof buf, "%s", path) >= (int) sizeof buf)
        return kiln_error (err, KILN_ELIMIT, "path too long: '%s'", path);
    for (char *p = buf + 1; ; p++) {
        if (*p == '/' || *p == '\0') {
            char saved = *p;
            *p = '\0';
            if (mkdir (buf, mode) != 0 && errno != EEXIST)
                return kiln_error (err, KILN_EIO, "could not create directory '%s': %s",
                                   buf, strerror (errno));
            *p = saved;
            if (saved == '\0')
                break;
        }
    }
    struct stat st;
    if (stat (path, &st) != 0 || !S_ISDIR (st.st_mode))
        return kiln_error (err, KILN_EIO, "'%s' is not a directory", path);
    return 0;
}

char *
kiln_mkdtemp (const char *prefix, kiln_err_t *err)
{
    const char *base = getenv ("TMPDIR");
    if (!base || !*base)
        base = "/tmp";
    char *path = NULL;
    if (asprintf (&path, "%s/%sXXXXXX", base, prefix) < 0) {
        kiln_error (err, KILN_ENOMEM, "out of memory");
        return NULL;
    }
    if (!mkdtemp (path)) {
        kiln_error (err, KILN_EIO, "could not create a temporary directory in '%s': %s",
                    base, strerror (errno));
        free (path);
        return NULL;
    }
    return path;
}

int
kiln_rm_rf (const char *path)
{
    struct stat st;
    if (lstat (path, &st) != 0)
        return errno == ENOENT ? 0 : -KILN_EIO;
    if (S_ISDIR (st.st_mode)) {
        DIR *dir = opendir (path);
        if (!dir)
            return -KILN_EIO;
        struct dirent *ent;
        while ((ent = readdir (dir))) {
            if (strcmp (ent->d_name, ".") == 0 || strcmp (ent->d_name, "..") == 0)
                continue;
            char child[PATH_MAX];
            if (snprintf (child, sizeof child, "%s/%s", path, ent->d_name)
                < (int) sizeof child)
                kiln_rm_rf (child);
        }
        closedir (dir);
        return rmdir (path) == 0 ? 0 : -KILN_EIO;
    }
    return unlink (path) == 0 ? 0 : -KILN_EIO;
}

bool
kiln_file_exists (const char *path)
{
    struct stat st;
    return stat (path, &st) == 0;
}

bool
kiln_stat_private (const struct stat *st)
{
    return st->st_uid == geteuid () && !(st->st_mode & (S_IWGRP | S_IWOTH));
}

bool
kiln_file_unchanged (const struct stat *a, const struct stat *b)
{
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino
           && a->st_size == b->st_size
           && a->st_mtim.tv_sec == b->st_mtim.tv_sec
           && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec
           && a->st_ctim.tv_sec == b->st_ctim.tv_sec
           && a->st_ctim.tv_nsec == b->st_ctim.tv_nsec;
}

/* $VAR, else $XDG_VAR/kiln, else $HOME/HOMESUB/kiln, into buf. */
static int
s_user_dir (const char *var, const char *xdg, const char *home_sub, char *buf, size_t size,
            kiln_err_t *err)
{
    const char *env = getenv (var);
    int n;
    if (env && *env)
        n = snprintf (buf, size, "%s", env);
    else if ((env = getenv (xdg)) && *env)
        n = snprintf (buf, size, "%s/kiln", env);
    else if ((env = getenv ("HOME")) && *env)
        n = snprintf (buf, size, "%s/%s/kiln", env, home_sub);
    else
        return kiln_error (err, KILN_ENOTFOUND, "no %s directory: set %s or HOME",
                           home_sub + 1, var);
    if (n < 0 || (size_t) n >= size)
        return kiln_error (err, KILN_ELIMIT, "%s directory path too long", home_sub + 1);
    return 0;
}

int
kiln_config_dir (char *buf, size_t size, kiln_err_t *err)
{
    return s_user_dir ("KILN_CONFIG_DIR", "XDG_CONFIG_HOME", ".config", buf, size, err);
}

int
kiln_cache_dir (char *buf, size_t size, kiln_err_t *err)
{
    return s_user_dir ("KILN_CACHE_DIR", "XDG_CACHE_HOME", ".cache", buf, size, err);
}

int
kiln_exe_dir (char *buf, size_t size, kiln_err_t *err)
{
    ssize_t n = readlink ("/proc/self/exe", buf, size - 1);
    if (n <= 0 || (size_t) n >= size - 1)
        return kiln_error (err, KILN_ESYS, "could not read /proc/self/exe");
    buf[n] = '\0';
    char *slash = strrchr (buf, '/');
    if (slash)
        *slash = '\0';
    return 0;
}

long long
kiln_parse_number (const char *text, long long lo, long long hi)
{
    char *end;
    long long v = strtoll (text, &end, 10);
    if (end == text)
        return -1;
    long long mult = 1;
    if (*end == 'K' || *end == 'k')
        mult = 1LL << 10;
    else if (*end == 'M' || *end == 'm')
        mult = 1LL << 20;
    else if (*end == 'G' || *end == 'g')
        mult = 1LL << 30;
    if (mult != 1)
        end++;
    if (*end || v < 0 || v > hi / mult)
        return -1;
    v *= mult;
    return v >= lo && v <= hi ? v : -1;
}
