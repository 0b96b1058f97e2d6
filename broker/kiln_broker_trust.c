/*
 * kiln_broker_trust — revocation under CurveZMQ: the directory of trusted
 * certificates (--trust) is looked at again every heartbeat, and when it
 * changed, every registered worker and known client whose certificate is
 * no longer in it is cut off: a worker is dropped (its running jobs go
 * back to the queue, not counted as deaths) and a client's waiting
 * requests are answered with an error before its record goes.  Their
 * public keys are remembered as revoked, so that whatever the same
 * connection sends after (a DONE, a COMPILE, a HEARTBEAT) is refused
 * with an error that says why; ZeroMQ gives a ROUTER no way to close one
 * peer's connection, so this is what cutting it off means.  New
 * connections are refused by zauth, which reads the same directory
 * through a zcertstore of its own.
 *
 * Invariants: without CurveZMQ nothing here runs; `revoked` holds the
 * keys of cut-off peers whose certificate has not come back, at most
 * BROKER_MAX_REVOKED of them.
 */
#include "broker/kiln_broker_priv.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include <czmq.h>

#include "common/kiln_log.h"

/* A cheap fingerprint of the directory: each entry's name, inode, size
 * and modification time.  A certificate removed, added, replaced or
 * edited changes it. */
static uint64_t
s_signature (const char *dir)
{
    DIR *d = opendir (dir);
    if (!d)
        return 1;                            /* gone: every key is revoked */
    uint64_t sig = 0x9e3779b97f4a7c15ULL;
    struct dirent *de;
    while ((de = readdir (d))) {
        if (de->d_name[0] == '.')
            continue;
        struct stat st;
        uint64_t h = 1469598103934665603ULL;
        for (const char *p = de->d_name; *p; p++)
            h = (h ^ (uint8_t) *p) * 1099511628211ULL;
        if (fstatat (dirfd (d), de->d_name, &st, 0) == 0)
            h ^= ((uint64_t) st.st_ino * 31 + (uint64_t) st.st_size) * 0x100000001b3ULL
                 ^ ((uint64_t) st.st_mtim.tv_sec << 20) ^ (uint64_t) st.st_mtim.tv_nsec;
        sig += h * 0xff51afd7ed558ccdULL;    /* order of entries does not matter */
    }
    closedir (d);
    return sig ? sig : 2;
}

int
broker_trust_start (kiln_broker_t *self, const char *trust_dir, kiln_err_t *err)
{
    if (!(self->trust_dir = strdup (trust_dir)) || !(self->revoked = zhashx_new ())
        || !(self->trust = zcertstore_new (trust_dir)))
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    self->trust_sig = s_signature (trust_dir);
    return 0;
}

void
broker_trust_stop (kiln_broker_t *self)
{
    zcertstore_destroy (&self->trust);
    zhashx_destroy (&self->revoked);
    free (self->trust_dir);
    self->trust_dir = NULL;
}

bool
broker_trust_revoked (kiln_broker_t *self, const kiln_peer_t *peer)
{
    return self->curve && self->revoked && zhashx_lookup (self->revoked, peer->key) != NULL;
}

/* The certificate with this key is in the trust directory now. */
static bool
s_trusted (kiln_broker_t *self, const char *key)
{
    return key[0] && zcertstore_lookup (self->trust, key) != NULL;   /* rereads on change */
}

static void
s_remember (kiln_broker_t *self, const char *key)
{
    if (zhashx_size (self->revoked) >= BROKER_MAX_REVOKED)
        zhashx_purge (self->revoked);        /* zauth still refuses their new connections */
    zhashx_update (self->revoked, key, self);
}

bool
broker_trust_admit (kiln_broker_t *self, const kiln_peer_t *peer)
{
    if (!self->curve || s_trusted (self, peer->key))
        return true;
    s_remember (self, peer->key);
    return false;
}

void
broker_trust_why (const kiln_peer_t *peer, char *buf, size_t size)
{
    broker_fmt (buf, size, "the certificate of '%s' (public key %.40s) is no longer trusted: "
                "it was removed from the broker's trust directory", peer->name, peer->key);
}

/* Cut off a worker: tell it, requeue its jobs, forget it. */
static void
s_revoke_worker (kiln_broker_t *self, broker_worker_t *w, const char *why)
{
    kiln_msg_t *e = kiln_msg_new (KILN_CMD_ERROR);
    if (e && kiln_msg_set_error (e, KILN_EVERIFY, why, NULL) == 0)
        broker_send_now (self, w->rid, &e, w->name);
    kiln_msg_destroy (&e);
    broker_worker_drop (self, w, why, false);
}

/* Cut off a client: answer each of its waiting requests with the reason
 * (sent now: dropping it empties the outbox of its replies), forget it. */
static void
s_revoke_client (kiln_broker_t *self, broker_client_t *c, const char *why)
{
    for (broker_job_t *job = zhashx_first (self->jobs); job; job = zhashx_next (self->jobs))
        for (size_t i = 0; i < job->n_waiters; i++)
            if (job->waiters[i].client == c) {
                kiln_msg_t *e = kiln_msg_new (KILN_CMD_ERROR);
                if (e) {
                    e->req_id = job->waiters[i].req_id;
                    e->job_id = job->id;
                    if (kiln_msg_set_error (e, KILN_EVERIFY, why, NULL) == 0)
                        broker_send_now (self, c->rid, &e, c->tenant);
                    kiln_msg_destroy (&e);
                }
            }
    broker_client_drop (self, c, why);
}

/* Remember `key` as revoked, say so (`what` "worker" or "client", `name`
 * its identity), and put why into why[size] for the peer. */
static void
s_cut (kiln_broker_t *self, const char *what, const char *key, const char *name, char *why,
       size_t size)
{
    kiln_peer_t peer = { 0 };
    snprintf (peer.key, sizeof peer.key, "%s", key);
    snprintf (peer.name, sizeof peer.name, "%s", name);
    broker_trust_why (&peer, why, size);
    s_remember (self, key);
    kiln_log_warn ("%s %s revoked: %s", what, name, why);
}

void
broker_trust_check (kiln_broker_t *self)
{
    if (!self->curve || !self->trust_dir)
        return;
    uint64_t sig = s_signature (self->trust_dir);
    if (sig == self->trust_sig)
        return;
    self->trust_sig = sig;
    zlistx_t *gone = zlistx_new ();
    if (!gone)
        return;
    /* Read afresh (zcertstore's own check misses a file edited in place
     * within a second); then keys that came back are trusted again. */
    zcertstore_t *fresh = zcertstore_new (self->trust_dir);
    if (fresh) {
        zcertstore_destroy (&self->trust);
        self->trust = fresh;
    }
    for (void *it = zhashx_first (self->revoked); it; it = zhashx_next (self->revoked))
        if (s_trusted (self, zhashx_cursor (self->revoked)))
            zlistx_add_end (gone, (void *) zhashx_cursor (self->revoked));
    for (const char *k = zlistx_first (gone); k; k = zlistx_next (gone))
        zhashx_delete (self->revoked, k);
    zlistx_purge (gone);
    char why[256];
    for (broker_worker_t *w = zhashx_first (self->workers); w; w = zhashx_next (self->workers))
        if (!s_trusted (self, w->curve_key))
            zlistx_add_end (gone, w);
    for (broker_worker_t *w = zlistx_first (gone); w; w = zlistx_next (gone)) {
        s_cut (self, "worker", w->curve_key, w->name, why, sizeof why);
        s_revoke_worker (self, w, why);
    }
    zlistx_purge (gone);
    for (broker_client_t *c = zhashx_first (self->clients); c; c = zhashx_next (self->clients))
        if (!s_trusted (self, c->curve_key))
            zlistx_add_end (gone, c);
    for (broker_client_t *c = zlistx_first (gone); c; c = zlistx_next (gone)) {
        s_cut (self, "client", c->curve_key, c->tenant, why, sizeof why);
        s_revoke_client (self, c, why);
    }
    zlistx_destroy (&gone);
}
