#include "serve/kiln_serve.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/utsname.h>

#include "artifact/kiln_artifact.h"
#include "common/kiln_log.h"
#include "runtime/kiln_rt.h"
#include "serve/kiln_serve_metrics.h"

static char s_target[64 + sizeof ((struct utsname *) 0)->machine];
static pthread_once_t s_target_once = PTHREAD_ONCE_INIT;

static void
s_target_init (void)
{
    struct utsname u;
    if (uname (&u) == 0)
        snprintf (s_target, sizeof s_target, "cpu-%s", u.machine);
    else
        snprintf (s_target, sizeof s_target, "cpu-unknown");
}

const char *
kiln_serve_host_target (void)
{
    pthread_once (&s_target_once, s_target_init);
    return s_target;
}

/* A keyring that cannot be read, or holds no key, is a mistake to report
 * before serving, not a refusal of every release later. */
static int
s_check_keyring (const char *dir, const char *option, kiln_err_t *err)
{
    kiln_keyring_t *ring = kiln_keyring_load (dir, err);
    if (!ring)
        return kiln_error_prefix (err, "%s", option);
    int n = kiln_keyring_count (ring);
    kiln_keyring_destroy (&ring);
    if (n == 0)
        return kiln_error (err, KILN_EINVAL, "%s '%s' holds no public key", option, dir);
    return 0;
}

int
kiln_serve_run (const kiln_serve_config_t *cfg, kiln_err_t *err)
{
    sigset_t signals;
    sigemptyset (&signals);
    sigaddset (&signals, SIGHUP);
    sigaddset (&signals, SIGINT);
    sigaddset (&signals, SIGTERM);
    pthread_sigmask (SIG_BLOCK, &signals, NULL);
    signal (SIGPIPE, SIG_IGN);

    kiln_serve_repo_config_t rc = cfg->repo;
    if (!rc.target)
        rc.target = kiln_serve_host_target ();
    struct stat st;
    if (!rc.repo_dir || stat (rc.repo_dir, &st) != 0 || !S_ISDIR (st.st_mode))
        return kiln_error (err, KILN_EINVAL, "--repo '%s' is not a directory",
                           rc.repo_dir ? rc.repo_dir : "");
    int status = s_check_keyring (rc.keyring_dir, "--keyring", err);
    if (status == 0)
        status = s_check_keyring (rc.release_keyring_dir, "--release-keyring", err);
    if (status)
        return status;

    kiln_serve_metrics_t *metrics = NULL;
    kiln_serve_repo_t *repo = NULL;
    kiln_serve_http_t *http = NULL;
    kiln_rt_t *rt = kiln_rt_shared (err);
    if (!rt)
        return -err->code;
    int n_cores = kiln_rt_num_cores (rt);
    int *cpus = calloc ((size_t) n_cores + 1, sizeof *cpus);
    for (int c = 0; cpus && c < n_cores; c++)
        cpus[c] = kiln_rt_core_cpu (rt, c);
    int n_endpoints;
    const char *const *endpoints = kiln_serve_http_endpoints (&n_endpoints);
    if (!cpus)
        kiln_error (err, KILN_ENOMEM, "out of memory");
    else
        metrics = kiln_serve_metrics_new (endpoints, n_endpoints, n_cores, cpus, err);
    free (cpus);
    if (!metrics
        || !(repo = kiln_serve_repo_new (&rc, rt, metrics, err))
        || !(http = kiln_serve_http_new (&cfg->http, repo, metrics, err))) {
        status = -err->code;
        goto done;
    }
    kiln_log_notice ("listening on %s (port %d); repository '%s', target %s, %d execution "
                     "cores", cfg->http.listen, kiln_serve_http_port (http), rc.repo_dir,
                     rc.target, n_cores);
    kiln_err_t scan_err = { 0 };
    if (kiln_serve_repo_scan (repo, &scan_err) != 0)
        kiln_log_err ("%s", scan_err.msg);
    kiln_log_notice ("%s", kiln_serve_repo_ready (repo) ? "ready"
                                                        : "not ready: a model has no version");
    for (;;) {
        int sig = 0;
        if (sigwait (&signals, &sig) != 0)
            continue;
        if (sig == SIGHUP) {
            kiln_log_notice ("SIGHUP: rescanning the repository");
            kiln_err_clear (&scan_err);
            if (kiln_serve_repo_scan (repo, &scan_err) != 0)
                kiln_log_err ("%s", scan_err.msg);
            continue;
        }
        kiln_log_notice ("%s: stopping", sig == SIGINT ? "SIGINT" : "SIGTERM");
        break;
    }
done:
    kiln_serve_http_destroy (&http);
    kiln_serve_repo_destroy (&repo);
    kiln_serve_metrics_destroy (&metrics);
    return status;
}
