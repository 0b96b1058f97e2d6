/*
 * fuzz_wire — the farm's wire decoder (kiln_msg_decode): what a broker,
 * a worker and a client do with every multipart message a peer sends.
 *
 * The input is the message's frames joined by FUZZ_WIRE_SEP, two 0xc1
 * bytes: 0xc1 is the one byte msgpack never uses, so a header frame never
 * holds it and the mutator cannot confuse the two.  A decoded message has
 * its payload parts joined (what the receiver does next) and is encoded
 * again (every field of a decoded message must pass the encoder's checks,
 * which are the decoder's).
 */
#include <string.h>

#include "common/kiln_proto.h"
#include "fuzz/fuzz.h"

#define FUZZ_WIRE_SEP       "\xc1\xc1"
#define FUZZ_WIRE_MAX_FRAMES 64

FUZZ_QUIET_INIT

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
    zmsg_t *raw = zmsg_new ();
    const uint8_t *p = data, *end = data + size;
    int frames = 0;
    for (;;) {
        const uint8_t *sep = frames + 1 < FUZZ_WIRE_MAX_FRAMES
                             ? memmem (p, (size_t) (end - p), FUZZ_WIRE_SEP, 2) : NULL;
        const uint8_t *stop = sep ? sep : end;
        zmsg_addmem (raw, p, (size_t) (stop - p));
        frames++;
        if (!sep)
            break;
        p = sep + 2;
    }
    kiln_err_t err = { 0 };
    uint64_t req_id = 0;
    kiln_msg_t *msg = kiln_msg_decode (&raw, &req_id, &err);
    if (raw)
        abort ();                          /* decode consumes the message */
    if (!msg) {
        fuzz_refused (-1, &err);
        return 0;
    }
    size_t parts = 0;
    switch (kiln_cmd_payload (msg->cmd)) {
    case KILN_PAYLOAD_GRAPH:
        parts = 1;
        for (uint32_t i = 0; i < msg->n_blobs; i++)
            if (msg->blobs[i].in_msg) {
                uint8_t *blob = NULL;
                size_t len = 0;
                if (kiln_msg_blob_part (msg, i, &blob, &len, &err) == 0
                    && len != msg->blobs[i].size)
                    abort ();              /* the layout was checked */
                free (blob);
            }
        break;
    case KILN_PAYLOAD_ARTIFACT:
        parts = msg->artifact_size ? 1 : 0;
        break;
    default:
        break;
    }
    for (size_t i = 0; i < parts; i++) {
        uint8_t *bytes = NULL;
        size_t len = 0;
        if (kiln_msg_part (msg, i, &bytes, &len, &err) != 0)
            fuzz_refused (-1, &err);
        free (bytes);
    }
    zmsg_t *again = kiln_msg_encode (&msg, &err);
    if (!again)
        abort ();                          /* what was decoded encodes */
    zmsg_destroy (&again);
    return 0;
}
