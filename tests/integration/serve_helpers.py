"""kiln-serve from the outside, with nothing but the standard library:
start it on a port it picks, talk KServe v2 to it with http.client, stop
it (SIGTERM, then SIGKILL), and read its /metrics as Prometheus text.
Shared by tests/integration/test_serve.py and bench/bench_serve.py.
Every wait is bounded."""

import http.client
import json
import os
import re
import signal
import subprocess
import time

import numpy as np

# v2 datatype names of numpy dtypes.
V2_DTYPES = {np.dtype("float32"): "FP32", np.dtype("float64"): "FP64",
             np.dtype("int64"): "INT64", np.dtype("int32"): "INT32",
             np.dtype("int8"): "INT8", np.dtype("uint8"): "UINT8",
             np.dtype("bool"): "BOOL", np.dtype("float16"): "FP16"}
NP_DTYPES = {v: k for k, v in V2_DTYPES.items()}


class Server:
    """One kiln-serve process listening on 127.0.0.1 (port 0: it picks a
    free one and logs it).  Use as a context manager, or call stop() in a
    finally."""

    def __init__(self, binary, repo, keyring, release_keyring, state, log_path, *extra,
                 env=None, start_timeout=60.0):
        self.log_path = str(log_path)
        self._log = open(self.log_path, "wb")
        argv = [binary, "--repo", str(repo), "--listen", "127.0.0.1:0", "--keyring",
                str(keyring), "--release-keyring", str(release_keyring), "--state", str(state),
                *[str(a) for a in extra]]
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env)
        self.port = None
        try:
            port = self.wait_for_log(r"listening on \S+ \(port (\d+)\)", start_timeout)
            self.port = int(port.group(1))
            self.wait_for_log(r"notice: (not )?ready", start_timeout)
        except BaseException:
            self.stop()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_for_log(self, pattern, timeout=30.0, count=1):
        """The count-th match of `pattern` in the log, waiting at most
        `timeout` seconds; AssertionError with the log otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            matches = list(re.finditer(pattern, self.log()))
            if len(matches) >= count:
                return matches[count - 1]
            if self.proc.poll() is not None:
                raise AssertionError(f"kiln-serve exited {self.proc.returncode} before "
                                     f"logging {pattern!r}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"kiln-serve did not log {pattern!r} within {timeout} s:"
                                     f"\n{self.log()}")
            time.sleep(0.02)

    def signal(self, sig):
        self.proc.send_signal(sig)

    def stop(self, timeout=15.0):
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def connect(self, timeout=60.0):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method, path, body=None, headers=None, conn=None, timeout=60.0):
        """(status, headers dict with lower-case names, body bytes)."""
        own = conn is None
        conn = conn or self.connect(timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body)
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
        finally:
            if own:
                conn.close()

    def get_json(self, path, conn=None):
        status, _, data = self.request("GET", path, conn=conn)
        return status, json.loads(data)

    def metadata(self, model):
        status, doc = self.get_json(f"/v2/models/{model}")
        assert status == 200, doc
        return doc

    def metrics(self):
        status, headers, data = self.request("GET", "/metrics")
        assert status == 200, data
        assert headers["content-type"].startswith("text/plain; version=0.0.4")
        return parse_prometheus(data.decode())


def infer_request(inputs, binary=False, binary_output=False, request_id=None, nested=False):
    """(body, headers) of a v2 inference request for {name: ndarray}."""
    doc = {"inputs": []}
    blobs = []
    if request_id is not None:
        doc["id"] = request_id
    for name, array in inputs.items():
        entry = {"name": name, "shape": list(array.shape),
                 "datatype": V2_DTYPES[array.dtype]}
        if binary:
            raw = np.ascontiguousarray(array).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = array.tolist() if nested else array.reshape(-1).tolist()
        doc["inputs"].append(entry)
    if binary_output:
        doc["parameters"] = {"binary_data_output": True}
    header = json.dumps(doc).encode()
    headers = {"Content-Type": "application/json"}
    if binary:
        headers = {"Content-Type": "application/octet-stream",
                   "Inference-Header-Content-Length": str(len(header))}
    return header + b"".join(blobs), headers


def infer_outputs(headers, body):
    """(response JSON, {name: ndarray}) of a v2 inference response, with
    the binary tensor extension or without."""
    hlen = int(headers.get("inference-header-content-length", len(body)))
    doc = json.loads(body[:hlen])
    outputs, offset = {}, hlen
    for out in doc["outputs"]:
        dtype = NP_DTYPES[out["datatype"]]
        size = out.get("parameters", {}).get("binary_data_size")
        if size is not None:
            outputs[out["name"]] = np.frombuffer(body[offset:offset + size],
                                                 dtype=dtype).reshape(out["shape"])
            offset += size
        else:
            outputs[out["name"]] = np.array(out["data"], dtype=dtype).reshape(out["shape"])
    assert offset == len(body), "bytes left over after the binary outputs"
    return doc, outputs


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')


def parse_prometheus(text):
    """Prometheus text format 0.0.4 into {"types": {family: type},
    "samples": [(name, {label: value}, float)]}; AssertionError on any line
    that is not a comment, a blank or a sample."""
    types, samples = {}, []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                assert parts[3] in ("counter", "gauge", "histogram", "summary", "untyped"), line
                types[parts[2]] = parts[3]
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        labels, rest = {}, m.group(3) or ""
        while rest:
            lm = _LABEL.match(rest)
            assert lm, f"bad labels in {line!r}"
            labels[lm.group(1)] = lm.group(2)
            rest = rest[lm.end():]
        value = m.group(4)
        samples.append((m.group(1), labels, float(value)))
    return {"types": types, "samples": samples}


def metric(parsed, name, **labels):
    """The sum of the samples of `name` whose labels include `labels`."""
    return sum(v for n, ls, v in parsed["samples"]
               if n == name and all(ls.get(k) == str(x) for k, x in labels.items()))


def percentile(sorted_values, q):
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[i]

