/*
 * kiln_mpk — small helpers over msgpack-c for kiln's map-shaped records.
 *
 * Every record kiln puts in msgpack (graph structure, wire messages,
 * program) is a map with string keys.  The getters look a key up and check
 * its type and its size bound in one call, so that decoders read as a list
 * of fields and every error names the field at fault.  Decoding input
 * always goes through msgpack_unpack_next on a length-bounded buffer.
 */
#ifndef KILN_MPK_H
#define KILN_MPK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <msgpack.h>

#include "common/kiln_error.h"

/* The value under string key `key` in map `map`, or NULL when `map` is not
 * a map or has no such key. */
const msgpack_object *kiln_mpk_get (const msgpack_object *map, const char *key);

/* Required string of at most `max` bytes: *s points into the object (not
 * NUL-terminated), *len its length. */
int kiln_mpk_get_str (const msgpack_object *map, const char *key, size_t max,
                      const char **s, size_t *len, kiln_err_t *err);
/* Required string copied into a NUL-terminated heap string (caller frees). */
int kiln_mpk_get_strdup (const msgpack_object *map, const char *key,
                         size_t max, char **out, kiln_err_t *err);
/* Required string copied into buf[size] (at most size-1 bytes). */
int kiln_mpk_get_strbuf (const msgpack_object *map, const char *key,
                         char *buf, size_t size, kiln_err_t *err);
/* Required integer (positive or negative fixint/int/uint). */
int kiln_mpk_get_i64 (const msgpack_object *map, const char *key,
                      int64_t *out, kiln_err_t *err);
/* Optional integer: `fallback` when the key is absent. */
int kiln_mpk_opt_i64 (const msgpack_object *map, const char *key,
                      int64_t fallback, int64_t *out, kiln_err_t *err);
/* Optional boolean: `fallback` when the key is absent. */
int kiln_mpk_opt_bool (const msgpack_object *map, const char *key,
                       bool fallback, bool *out, kiln_err_t *err);
/* Required bin of at most `max` bytes (points into the object). */
int kiln_mpk_get_bin (const msgpack_object *map, const char *key, size_t max,
                      const uint8_t **p, size_t *len, kiln_err_t *err);
/* Required array of at most `max` elements. */
int kiln_mpk_get_array (const msgpack_object *map, const char *key,
                        size_t max, const msgpack_object_array **arr,
                        kiln_err_t *err);
/* Required map. */
int kiln_mpk_get_map (const msgpack_object *map, const char *key,
                      const msgpack_object **out, kiln_err_t *err);

/* Walk one msgpack object at data[0..len) without allocating, before
 * handing the bytes to msgpack-c: msgpack-c allocates a container's
 * element array as soon as it reads the header, so a five-byte input
 * claiming 2^32 elements would make it reserve gigabytes.  Checks that
 * the object is complete, that no container claims more elements than
 * there are bytes left (each element takes at least one byte), that it
 * nests at most `max_depth` deep and holds at most `max_objects` objects.
 * Extension types are refused: kiln uses none.  *used (may be NULL) gets
 * the object's length; `what` names the input in errors. */
int kiln_mpk_check (const uint8_t *data, size_t len, int max_depth,
                    size_t max_objects, const char *what, size_t *used,
                    kiln_err_t *err);

/* Integer value of an object (any int type); -KILN_EFORMAT if not int. */
int kiln_mpk_as_i64 (const msgpack_object *obj, int64_t *out);
/* Compare a msgpack string object with a C string. */
bool kiln_mpk_str_eq (const msgpack_object *obj, const char *s);

/* Packing helpers: a C string, and key/value pairs for maps. */
void kiln_mpk_pack_cstr (msgpack_packer *pk, const char *s);
void kiln_mpk_pack_kv_str (msgpack_packer *pk, const char *key, const char *val);
void kiln_mpk_pack_kv_i64 (msgpack_packer *pk, const char *key, int64_t val);
void kiln_mpk_pack_kv_bool (msgpack_packer *pk, const char *key, bool val);
void kiln_mpk_pack_kv_bin (msgpack_packer *pk, const char *key,
                           const void *data, size_t len);

#endif
