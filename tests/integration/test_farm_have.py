"""Issue 11, item 2: a client that already holds an artifact's weights by
digest does not download them again.

A real broker and worker on loopback; each test has its own member cache
(KILN_CACHE_DIR).  The first compile of a model with 6 MiB of weights
downloads its artifact whole and keeps weights.bin by its SHA-256; a
`kiln get` of the same artifact then receives only the tar headers and
small members (the GET's `have` names weights.bin, the broker sends a
PART naming it) and writes the cached bytes in place: the file is byte
for byte the first one.  A cache entry damaged on disk still gives the
right file (fetched again without the cache, the entry replaced); the
cache turned off downloads everything; a GET sent by hand with `have`
gets the member as a PART without bytes at its tar data offset, and one
without `have` gets every byte as before."""

import hashlib
import json
import os
import tarfile

import pytest

from conftest import kiln_bin
from farm_helpers import big_model, running_farm
from raw_zmtp import RawDealer

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(kiln_bin(p)) for p in ("kiln", "kiln-broker", "kiln-worker")),
    reason="build/bin lacks the farm's programs: run `make` first")

MiB = 1 << 20


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    with running_farm(tmp_path_factory.mktemp("farm")) as f:
        f.start_worker("w1")
        f.wait_for_workers(1)
        yield f


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(d))
    monkeypatch.delenv("KILN_MEMBER_CACHE", raising=False)
    monkeypatch.delenv("KILN_MEMBER_CACHE_MAX", raising=False)
    return d / "members"


def compile_json(farm, model, out):
    proc = farm.compile(model, out, "--json")
    assert proc.returncode == 0, f"{proc.stderr}\n{farm.logs()}"
    return json.loads(proc.stdout)


def get_json(farm, digest, out, env=None):
    import subprocess
    proc = subprocess.run([kiln_bin("kiln"), "get", digest, "-o", str(out), "--broker",
                           farm.endpoint, "--json"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{proc.stderr}\n{farm.logs()}"
    return json.loads(proc.stdout), proc.stderr


def weights_span(path):
    """(data offset, size, sha256) of weights.bin in the archive."""
    with tarfile.open(path) as t:
        m = t.getmember("weights.bin")
    with open(path, "rb") as f:
        f.seek(m.offset_data)
        data = f.read(m.size)
    return m.offset_data, m.size, hashlib.sha256(data).hexdigest()


def test_get_reuses_the_cached_weights_and_writes_the_same_file(farm, tmp_path, cache):
    built = compile_json(farm, big_model(tmp_path / "m.onnx", 6, seed=21), tmp_path / "a.kar")
    data = (tmp_path / "a.kar").read_bytes()
    off, size, digest = weights_span(tmp_path / "a.kar")
    assert size >= 6 * MiB and off % 4096 == 0
    # the compile fetched it whole and kept weights.bin by its digest
    assert built["download"] == {"received_bytes": len(data), "reused_bytes": 0}
    assert (cache / digest).read_bytes() == data[off:off + size]
    assert oct((cache / digest).stat().st_mode & 0o777) == "0o600"

    out, _ = get_json(farm, built["artifact"], tmp_path / "b.kar")
    assert (tmp_path / "b.kar").read_bytes() == data
    assert out["reused_bytes"] == size and not out["refetched"]
    assert out["received_bytes"] == len(data) - size < MiB
    # no file digest was taken (every member was checked instead)
    assert out["bytes"] == len(data) and out["sha256"] is None
    assert farm.status()["transfer"]["held_bytes"] >= size

    # a second compile (an action cache hit) reuses it too
    again = compile_json(farm, str(tmp_path / "m.onnx"), tmp_path / "c.kar")
    assert again["cached"] and again["download"]["reused_bytes"] == size
    assert (tmp_path / "c.kar").read_bytes() == data


def test_a_damaged_cache_entry_gives_the_right_file_fetched_again(farm, tmp_path, cache):
    built = compile_json(farm, big_model(tmp_path / "m.onnx", 4, seed=22), tmp_path / "a.kar")
    data = (tmp_path / "a.kar").read_bytes()
    off, size, digest = weights_span(tmp_path / "a.kar")
    entry = cache / digest
    with open(entry, "r+b") as f:                 # same size, one byte changed
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    out, err = get_json(farm, built["artifact"], tmp_path / "b.kar")
    assert (tmp_path / "b.kar").read_bytes() == data
    assert out["refetched"] and out["reused_bytes"] == 0
    assert out["received_bytes"] >= len(data)
    assert "without the member cache" in err, err
    # the damaged entry was replaced by the checked bytes
    assert entry.read_bytes() == data[off:off + size]
    # an entry others may write is not used
    os.chmod(entry, 0o666)
    out, _ = get_json(farm, built["artifact"], tmp_path / "c.kar")
    assert out["reused_bytes"] == 0 and (tmp_path / "c.kar").read_bytes() == data


def test_cache_off_downloads_everything(farm, tmp_path, cache):
    built = compile_json(farm, big_model(tmp_path / "m.onnx", 4, seed=23), tmp_path / "a.kar")
    data = (tmp_path / "a.kar").read_bytes()
    for env in ({"KILN_MEMBER_CACHE": "off"}, {"KILN_MEMBER_CACHE_MAX": "0"}):
        out, _ = get_json(farm, built["artifact"], tmp_path / "b.kar", env)
        assert out["received_bytes"] == len(data) and out["reused_bytes"] == 0
        assert (tmp_path / "b.kar").read_bytes() == data
    # a bound smaller than the member: nothing is kept
    (tmp_path / "small").mkdir()
    out, _ = get_json(farm, built["artifact"], tmp_path / "c.kar",
                      {"KILN_CACHE_DIR": str(tmp_path / "small"),
                       "KILN_MEMBER_CACHE_MAX": "1M"})
    assert out["reused_bytes"] == 0
    assert os.listdir(tmp_path / "small" / "members") == []


def test_get_by_hand_with_and_without_have(farm, tmp_path, cache):
    built = compile_json(farm, big_model(tmp_path / "m.onnx", 3, seed=24), tmp_path / "a.kar")
    data = (tmp_path / "a.kar").read_bytes()
    off, size, digest = weights_span(tmp_path / "a.kar")

    def fetch(req_id, have):
        hdr = {"v": 2, "cmd": "GET", "frames": 0, "req_id": req_id,
               "artifact": built["artifact"], "credit": 64}
        if have is not None:
            hdr["have"] = have
        parts = []
        with RawDealer(farm.port) as d:
            d.send(hdr)
            while not parts or parts[-1][0]["offset"] + (
                    parts[-1][0].get("length") or len(parts[-1][1][0])) < len(data):
                h, payload = d.recv()
                assert h["cmd"] == "PART" and h["req_id"] == req_id, h
                parts.append((h, payload))
        return parts

    # an old client: every byte, on the 1 MiB grid
    parts = fetch(1, None)
    assert [h["offset"] for h, _ in parts] == list(range(0, len(data), MiB))
    assert all("member" not in h and "length" not in h for h, _ in parts)
    assert b"".join(p[0] for _, p in parts) == data
    assert parts[-1][0]["digest"] == hashlib.sha256(data).hexdigest()

    # a client holding weights.bin (and a digest the artifact lacks)
    parts = fetch(2, [{"digest": "ab" * 32, "size": 5 * MiB},
                      {"digest": digest, "size": size}])
    held = [h for h, _ in parts if "member" in h]
    assert held == [{**held[0], "offset": off, "length": size, "member": digest}]
    rebuilt = bytearray()
    for h, p in parts:
        assert h["offset"] == len(rebuilt)
        if "member" in h:
            assert p == []
            rebuilt += data[off:off + size]     # what the client holds
        else:
            assert len(p[0]) == h["length"] <= MiB
            rebuilt += p[0]
    assert bytes(rebuilt) == data
    # the held bytes were neither read nor hashed: no file digest
    assert all("digest" not in h for h, _ in parts)
    assert sum(len(p[0]) for h, p in parts if "member" not in h) == len(data) - size

    # more than 64 entries: refused, naming the bound; the broker goes on
    with RawDealer(farm.port) as d:
        d.send({"v": 2, "cmd": "GET", "frames": 0, "req_id": 3,
                "artifact": built["artifact"], "credit": 4,
                "have": [{"digest": f"{i:064x}", "size": MiB} for i in range(65)]})
        h, _ = d.recv()
    assert h["cmd"] == "ERROR" and h["req_id"] == 3 and "64" in h["message"], h
    assert any("member" in h for h, _ in fetch(4, [{"digest": digest, "size": size}]))

    # the broker does not read the held bytes: with its stored copy of
    # them damaged, a GET naming them still gives the artifact
    stored = [os.path.join(r, f) for r, _, fs in os.walk(farm.state) for f in fs
              if f == built["artifact"]]
    assert len(stored) == 1, stored
    with open(stored[0], "r+b") as f:
        f.seek(off + size // 2)
        b = f.read(1)
        f.seek(off + size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    # (before, the broker hashed them: the file digest did not match, and
    # the refetch without the cache got the damaged bytes)
    out, _ = get_json(farm, built["artifact"], tmp_path / "d.kar")
    assert out["reused_bytes"] == size and not out["refetched"]
    assert (tmp_path / "d.kar").read_bytes() == data
