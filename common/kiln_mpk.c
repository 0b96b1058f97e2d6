#include "common/kiln_mpk.h"

#include <stdlib.h>
#include <string.h>

bool
kiln_mpk_str_eq (const msgpack_object *obj, const char *s)
{
    size_t n = strlen (s);
    return obj->type == MSGPACK_OBJECT_STR && obj->via.str.size == n
           && memcmp (obj->via.str.ptr, s, n) == 0;
}

const msgpack_object *
kiln_mpk_get (const msgpack_object *map, const char *key)
{
    if (!map || map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    for (uint32_t i = 0; i < map->via.map.size; i++)
        if (kiln_mpk_str_eq (&map->via.map.ptr[i].key, key))
            return &map->via.map.ptr[i].val;
    return NULL;
}

static const msgpack_object *
s_require (const msgpack_object *map, const char *key, kiln_err_t *err)
{
    const msgpack_object *v = kiln_mpk_get (map, key);
    if (!v)
        kiln_error (err, KILN_EFORMAT, "missing field '%s'", key);
    return v;
}

int
kiln_mpk_get_str (const msgpack_object *map, const char *key, size_t max,
                  const char **s, size_t *len, kiln_err_t *err)
{
    const msgpack_object *v = s_require (map, key, err);
    if (!v)
        return -KILN_EFORMAT;
    if (v->type != MSGPACK_OBJECT_STR)
        return kiln_error (err, KILN_EFORMAT, "field '%s' is not a string", key);
    if (v->via.str.size > max)
        return kiln_error (err, KILN_ELIMIT, "field '%s' is %u bytes, more than %zu",
                           key, v->via.str.size, max);
    *s = v->via.str.ptr;
    *len = v->via.str.size;
    return 0;
}

int
kiln_mpk_get_strdup (const msgpack_object *map, const char *key, size_t max,
                     char **out, kiln_err_t *err)
{
    const char *s;
    size_t n;
    int rc = kiln_mpk_get_str (map, key, max, &s, &n, err);
    if (rc)
        return rc;
    if (memchr (s, '\0', n))
        return kiln_error (err, KILN_EFORMAT, "field '%s' contains a NUL byte", key);
    *out = malloc (n + 1);
    if (!*out)
        return kiln_error (err, KILN_ENOMEM, "out of memory");
    memcpy (*out, s, n);
    (*out)[n] = '\0';
    return 0;
}

int
kiln_mpk_get_strbuf (const msgpack_object *map, const char *key, char *buf,
                     size_t size, kiln_err_t *err)
{
    const char *s;
    size_t n;
    int rc = kiln_mpk_get_str (map, key, size - 1, &s, &n, err);
    if (rc)
        return rc;
    if (memchr (s, '\0', n))
        return kiln_error (err, KILN_EFORMAT, "field '%s' contains a NUL byte", key);
    memcpy (buf, s, n);
    buf[n] = '\0';
    return 0;
}

int
kiln_mpk_as_i64 (const msgpack_object *obj, int64_t *out)
{
    if (obj->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (obj->via.u64 > INT64_MAX)
            return -KILN_EFORMAT;
        *out = (int64_t) obj->via.u64;
        return 0;
    }
    if (obj->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *out = obj->via.i64;
        return 0;
    }
    return -KILN_EFORMAT;
}

int
kiln_mpk_get_i64 (const msgpack_object *map, const char *key, int64_t *out,
                  kiln_err_t *err)
{
    const msgpack_object *v = s_require (map, key, err);
    if (!v)
        return -KILN_EFORMAT;
    if (kiln_mpk_as_i64 (v, out) != 0)
        return kiln_error (err, KILN_EFORMAT, "field '%s' is not an integer", key);
    return 0;
}

int
kiln_mpk_opt_i64 (const msgpack_object *map, const char *key, int64_t fallback,
                  int64_t *out, kiln_err_t *err)
{
    const msgpack_object *v = kiln_mpk_get (map, key);
    if (!v || v->type == MSGPACK_OBJECT_NIL) {
        *out = fallback;
        return 0;
    }
    if (kiln_mpk_as_i64 (v, out) != 0)
        return kiln_error (err, KILN_EFORMAT, "field '%s' is not an integer", key);
    return 0;
}

int
kiln_mpk_opt_bool (const msgpack_object *map, const char *key, bool fallback,
                   bool *out, kiln_err_t *err)
{
    const msgpack_object *v = kiln_mpk_get (map, key);
    if (!v || v->type == MSGPACK_OBJECT_NIL) {
        *out = fallback;
        return 0;
    }
    if (v->type != MSGPACK_OBJECT_BOOLEAN)
        return kiln_error (err, KILN_EFORMAT, "field '%s' is not a boolean", key);
    *out = v->via.boolean;
    return 0;
}

int
kiln_mpk_get_bin (const msgpack_object *map, const char *key, size_t max,
                  const uint8_t **p, size_t *len, kiln_err_t *err)
{
    const msgpack_object *v = s_require (map, key, err);
    if (!v)
        return -KILN_EFORMAT;
    if (v->type != MSGPACK_OBJECT_BIN)
        return kiln_error (err, KILN_EFORMAT, "field '%s' is not binary", key);
    if (v->via.bin.size > max)
        return kiln_error (err, KILN_ELIMIT, "field '%s' is %u bytes, more than %zu",
                           key, v->via.bin.size, max);
    *p = (const uint8_t *) v->via.bin.ptr;
    *len = v->via.bin.size;
    return 0;
}

int
kiln_mpk_get_array (const msgpack_object *map, const char *key, size_t max,
                    const msgpack_object_array **arr, kiln_err_t *err)
{
    const msgpack_object *v = s_require (map, key, err);
    if (!v)
        return -KILN_EFORMAT;
    if (v->type != MSGPACK_OBJECT_ARRAY)
        return kiln_error (err, KILN_EFORMAT, "field '%s' is not an array", key);
    if (v->via.array.size > max)
        return kiln_error (err, KILN_ELIMIT, "field '%s' has %u elements, more than %zu",
                           key, v->via.array.size, max);
    *arr = &v->via.array;
    return 0;
}

int
kiln_mpk_get_map (const msgpack_object *map, const char *key,
                  const msgpack_object **out, kiln_err_t *err)
{
    const msgpack_object *v = s_require (map, key, err);
    if (!v)
        return -KILN_EFORMAT;
    if (v->type != MSGPACK_OBJECT_MAP)
        return kiln_error (err, KILN_EFORMAT, "field '%s' is not a map", key);
    *out = v;
    return 0;
}

void
kiln_mpk_pack_cstr (msgpack_packer *pk, const char *s)
{
    size_t n = s ? strlen (s) : 0;
    msgpack_pack_str (pk, n);
    msgpack_pack_str_body (pk, s ? s : "", n);
}

void
kiln_mpk_pack_kv_str (msgpack_packer *pk, const char *key, const char *val)
{
    kiln_mpk_pack_cstr (pk, key);
    kiln_mpk_pack_cstr (pk, val);
}

void
kiln_mpk_pack_kv_i64 (msgpack_packer *pk, const char *key, int64_t val)
{
    kiln_mpk_pack_cstr (pk, key);
    msgpack_pack_int64 (pk, val);
}

void
kiln_mpk_pack_kv_bool (msgpack_packer *pk, const char *key, bool val)
{
    kiln_mpk_pack_cstr (pk, key);
    if (val)
        msgpack_pack_true (pk);
    else
        msgpack_pack_false (pk);
}

void
kiln_mpk_pack_kv_bin (msgpack_packer *pk, const char *key, const void *data,
                      size_t len)
{
    kiln_mpk_pack_cstr (pk, key);
    msgpack_pack_bin (pk, len);
    msgpack_pack_bin_body (pk, data, len);
}

int
kiln_mpk_check (const uint8_t *data, size_t len, int max_depth,
                size_t max_objects, const char *what, size_t *used,
                kiln_err_t *err)
{
    /* Elements still due at each open container; depth is bounded by the
     * caller, so the stack lives on the heap only when it is deep. */
    uint64_t stack[64];
    if (max_depth < 0 || max_depth >= (int) (sizeof stack / sizeof stack[0]))
        return kiln_error (err, KILN_EINVAL, "%s: nesting bound %d is out of range",
                           what, max_depth);
    int depth = 0;
    size_t off = 0, objects = 0;
    stack[0] = 1;
    while (depth >= 0) {
        if (stack[depth] == 0) {
            depth--;
            continue;
        }
        stack[depth]--;
        if (off >= len)
            return kiln_error (err, KILN_EFORMAT, "%s: truncated msgpack (%zu bytes)",
                               what, len);
        if (++objects > max_objects)
            return kiln_error (err, KILN_ELIMIT, "%s: more than %zu msgpack objects",
                               what, max_objects);
        uint8_t b = data[off++];
        int lenbytes = 0;       /* big-endian length/count after the type byte */
        uint64_t skip = 0;      /* payload bytes that follow */
        uint64_t items = 0;     /* contained objects */
        bool container = false, map = false, sized = false;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
            ;
        else if (b <= 0x8f) { container = map = true; items = b & 0x0f; }
        else if (b <= 0x9f) { container = true; items = b & 0x0f; }
        else if (b <= 0xbf) skip = b & 0x1f;
        else {
            switch (b) {
            case 0xc4: case 0xd9: lenbytes = 1; sized = true; break;
            case 0xc5: case 0xda: lenbytes = 2; sized = true; break;
            case 0xc6: case 0xdb: lenbytes = 4; sized = true; break;
            case 0xca: case 0xce: case 0xd2: skip = 4; break;
            case 0xcb: case 0xcf: case 0xd3: skip = 8; break;
            case 0xcc: case 0xd0: skip = 1; break;
            case 0xcd: case 0xd1: skip = 2; break;
            case 0xdc: lenbytes = 2; container = true; break;
            case 0xdd: lenbytes = 4; container = true; break;
            case 0xde: lenbytes = 2; container = map = true; break;
            case 0xdf: lenbytes = 4; container = map = true; break;
            default:
                return kiln_error (err, KILN_EFORMAT,
                                   "%s: invalid msgpack type byte 0x%02x at offset %zu",
                                   what, b, off - 1);
            }
        }
        if ((size_t) lenbytes > len - off)
            return kiln_error (err, KILN_EFORMAT, "%s: truncated msgpack (%zu bytes)",
                               what, len);
        uint64_t n = 0;
        for (int i = 0; i < lenbytes; i++)
            n = n << 8 | data[off + i];
        off += (size_t) lenbytes;
        if (sized)
            skip = n;
        else if (lenbytes)
            items = n;
        if (skip > len - off)
            return kiln_error (err, KILN_EFORMAT, "%s: truncated msgpack (%zu bytes)",
                               what, len);
        off += (size_t) skip;
        if (container && items > 0) {
            if (map)
                items *= 2;
            if (items > len - off)
                return kiln_error (err, KILN_EFORMAT,
                                   "%s: container at offset %zu claims %llu elements but only %zu bytes remain",
                                   what, off, (unsigned long long) items, len - off);
            if (depth + 1 > max_depth)
                return kiln_error (err, KILN_EFORMAT, "%s: msgpack nested more than %d deep",
                                   what, max_depth);
            stack[++depth] = items;
        }
    }
    if (used)
        *used = off;
    return 0;
}
