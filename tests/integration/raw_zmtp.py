"""A peer that speaks the farm's wire by hand, for tests that must send
what no kiln program would: ZMTP 3.0 (the NULL mechanism) over a plain TCP
socket, and msgpack headers built byte by byte.  With it a test can send
garbage, lying sizes and commands out of order, and read exactly what the
broker answers.  Debian's Python has neither pyzmq nor msgpack installed
by default, and a hostile client should not lean on a well-behaved
library anyway.

Every read has a timeout; the socket is closed by `close()` (or `with`).
"""

import socket
import struct
import time


# --- msgpack: the subset the protocol's headers use ----------------------

def _pack_uint(n):
    if n < 0x80:
        return bytes([n])
    if n < 0x100:
        return b"\xcc" + bytes([n])
    if n < 0x10000:
        return b"\xcd" + struct.pack(">H", n)
    if n < 0x100000000:
        return b"\xce" + struct.pack(">I", n)
    return b"\xcf" + struct.pack(">Q", n)


def _pack_str(s):
    b = s.encode() if isinstance(s, str) else s
    if len(b) < 32:
        return bytes([0xa0 | len(b)]) + b
    if len(b) < 0x100:
        return b"\xd9" + bytes([len(b)]) + b
    if len(b) < 0x10000:
        return b"\xda" + struct.pack(">H", len(b)) + b
    return b"\xdb" + struct.pack(">I", len(b)) + b


def pack(value):
    """msgpack of a dict / list / str / bytes / int >= 0 / bool / None."""
    if value is None:
        return b"\xc0"
    if value is True:
        return b"\xc3"
    if value is False:
        return b"\xc2"
    if isinstance(value, int):
        if value < 0:
            return b"\xd3" + struct.pack(">q", value)
        return _pack_uint(value)
    if isinstance(value, (str, bytes)):
        return _pack_str(value)
    if isinstance(value, (list, tuple)):
        head = bytes([0x90 | len(value)]) if len(value) < 16 else \
            b"\xdc" + struct.pack(">H", len(value))
        return head + b"".join(pack(v) for v in value)
    if isinstance(value, dict):
        head = bytes([0x80 | len(value)]) if len(value) < 16 else \
            b"\xde" + struct.pack(">H", len(value))
        return head + b"".join(pack(k) + pack(v) for k, v in value.items())
    raise TypeError(f"cannot pack {type(value)}")


def unpack(data):
    """The first msgpack object in `data` (the same subset, plus negative
    ints), as Python values."""
    value, _ = _unpack(data, 0)
    return value


def _unpack(d, i):
    b = d[i]
    i += 1
    if b < 0x80:
        return b, i
    if b >= 0xe0:
        return b - 0x100, i
    if 0x80 <= b <= 0x8f:
        return _unpack_map(d, i, b & 0x0f)
    if 0x90 <= b <= 0x9f:
        return _unpack_array(d, i, b & 0x0f)
    if 0xa0 <= b <= 0xbf:
        n = b & 0x1f
        return d[i:i + n].decode(errors="replace"), i + n
    fixed = {0xc0: None, 0xc2: False, 0xc3: True}
    if b in fixed:
        return fixed[b], i
    sizes = {0xcc: ">B", 0xcd: ">H", 0xce: ">I", 0xcf: ">Q",
             0xd0: ">b", 0xd1: ">h", 0xd2: ">i", 0xd3: ">q"}
    if b in sizes:
        fmt = sizes[b]
        n = struct.calcsize(fmt)
        return struct.unpack(fmt, d[i:i + n])[0], i + n
    if b in (0xd9, 0xda, 0xdb):
        fmt = {0xd9: ">B", 0xda: ">H", 0xdb: ">I"}[b]
        k = struct.calcsize(fmt)
        n = struct.unpack(fmt, d[i:i + k])[0]
        return d[i + k:i + k + n].decode(errors="replace"), i + k + n
    if b in (0xdc, 0xdd):
        k = 2 if b == 0xdc else 4
        n = int.from_bytes(d[i:i + k], "big")
        return _unpack_array(d, i + k, n)
    if b in (0xde, 0xdf):
        k = 2 if b == 0xde else 4
        n = int.from_bytes(d[i:i + k], "big")
        return _unpack_map(d, i + k, n)
    raise ValueError(f"msgpack type 0x{b:02x} not handled")


def _unpack_map(d, i, n):
    out = {}
    for _ in range(n):
        k, i = _unpack(d, i)
        v, i = _unpack(d, i)
        out[k] = v
    return out, i


def _unpack_array(d, i, n):
    out = []
    for _ in range(n):
        v, i = _unpack(d, i)
        out.append(v)
    return out, i


# --- ZMTP 3.0 as a DEALER --------------------------------------------------

class RawDealer:
    """A DEALER connected to a ROUTER at 127.0.0.1:port, frames by hand."""

    def __init__(self, port, timeout=10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.settimeout(timeout)
        # greeting: signature, version 3.0, mechanism NULL, as-server 0
        self.sock.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00"
                          + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31)
        greeting = self._read(64)
        if greeting[0] != 0xff or greeting[9] != 0x7f:
            raise ConnectionError(f"not a ZMTP peer: {greeting[:10]!r}")
        self._send_command(b"READY", {b"Socket-Type": b"DEALER", b"Identity": b""})
        flags, body = self._read_frame()
        if not flags & 0x04 or not body[1:].startswith(b"READY"):
            raise ConnectionError(f"expected READY from the broker, got {body[:16]!r}")

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _read(self, n):
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the broker closed the connection")
            out += chunk
        return out

    def _read_frame(self):
        flags = self._read(1)[0]
        size = struct.unpack(">Q", self._read(8))[0] if flags & 0x02 else self._read(1)[0]
        return flags, self._read(size)

    def _send_command(self, name, props):
        body = bytes([len(name)]) + name
        for k, v in props.items():
            body += bytes([len(k)]) + k + struct.pack(">I", len(v)) + v
        self.sock.sendall(self._frame_header(0x04, len(body)) + body)

    @staticmethod
    def _frame_header(flags, size):
        if size > 255:
            return bytes([flags | 0x02]) + struct.pack(">Q", size)
        return bytes([flags, size])

    def send_frames(self, frames):
        """One message of raw frames (bytes)."""
        out = b""
        for i, f in enumerate(frames):
            more = 0x01 if i < len(frames) - 1 else 0
            out += self._frame_header(more, len(f)) + f
        self.sock.sendall(out)

    def send_frame_header(self, size, more=False):
        """Announce a frame of `size` bytes and send none of them: a lie."""
        self.sock.sendall(self._frame_header(0x01 if more else 0, size))

    def send(self, header, *payload):
        """A protocol message: `header` (a dict) packed as frame 0."""
        self.send_frames([pack(header), *payload])

    def recv(self, timeout=10.0):
        """The next message as (header dict, [payload frames]); ZMTP
        commands (PING) are skipped."""
        deadline = time.monotonic() + timeout
        frames = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no message from the broker")
            self.sock.settimeout(left)
            flags, body = self._read_frame()
            if flags & 0x04:
                continue
            frames.append(body)
            if not flags & 0x01:
                return unpack(frames[0]), frames[1:]

    def recv_until(self, pred, timeout=10.0):
        """Messages until one for which pred(header) holds; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            header, payload = self.recv(max(0.05, deadline - time.monotonic()))
            if pred(header):
                return header, payload
