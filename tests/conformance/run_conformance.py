#!/usr/bin/python3
"""Run the ONNX backend node tests through kiln and classify each one.

For every test directory (model.onnx + test_data_set_N/{input,output}_K.pb)
kiln imports the model, compiles it locally into a signed artifact, loads
the artifact with the runtime, runs it on each data set and compares the
outputs with the expected ones, with the tolerances of ONNX's own backend
test runner (onnx/backend/test/runner: numpy's assert_allclose with
rtol=1e-3, atol=1e-7 for every node test in onnx 1.12, dtypes equal).

Each test ends in one class:
  passed       every output of every data set matches;
  unsupported  a clean refusal: import or compile failed with an error
               message (an unsupported op, dtype or attribute; an input
               with a dynamic shape); counted as "skipped";
  wrong        a wrong answer (values, shape or dtype), or a crash: a
               process killed by a signal, a sanitizer report, a hang past
               the timeout, an unexpected exit code, an error without a
               message, or any failure after a successful compile (load,
               run); counted as "failed".

Tests run in a pool of supervised worker processes (default 2).  In the
default `inproc` mode a worker drives libkilnclient.so through ctypes; in
`cli` mode it runs `kiln import`, `kiln compile --local` and `kiln-run`
per test.  Either way a worker that dies or hangs is killed, its test is
classified wrong with what it printed, and a fresh worker takes over, so a
crash in one test never stops the run.

Fixed shapes: kiln compiles for fixed shapes, so inputs that ONNX lets
vary at run time but that decide shapes or static parameters (Reshape's
shape, Slice's starts/ends/axes/steps, a Reduce op's axes, TopK's k, ...;
STATIC_INPUTS below) are frozen into initializers holding the test's own
data, unless --no-freeze is given.  Every frozen input is listed in the
JSON report.

Writes OUT/report.txt and OUT/report.json; prints a summary of the
unsupported reasons grouped by op, and ends with exactly one line
"N passed, N failed, N skipped".  Exit status 0 when nothing failed,
1 when a test failed, 2 when the harness itself could not run.
"""

import argparse
import collections
import fnmatch
import glob
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("KILN_SRC", os.path.abspath(os.path.join(HERE, "..", "..")))

DEFAULT_RTOL = 1e-3   # onnx/backend/test/case/node/__init__.py, expect()
DEFAULT_ATOL = 1e-7

# Per-test tolerance overrides (name -> (rtol, atol)).  onnx 1.12 gives
# every node test the defaults; a test directory may also carry a
# data.json with rtol/atol, as the onnx loader reads for model tests.  Add
# an entry here only with a comment saying why.
TOLERANCE_OVERRIDES = {}

# Inputs that a fixed-shape compiler needs at compile time: op -> input
# positions.  They decide an output shape or are a static parameter of the
# op.  A graph input that feeds only such positions is frozen.
STATIC_INPUTS = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,),
    "Slice": (1, 2, 3, 4), "Pad": (1, 2, 3), "Squeeze": (1,), "Unsqueeze": (1,),
    "Split": (1,), "TopK": (1,), "Resize": (1, 2, 3), "Upsample": (1,),
    "OneHot": (1,), "Range": (0, 1, 2), "CenterCropPad": (1,), "Trilu": (1,),
    "CumSum": (1,), "Dropout": (1, 2), "Compress": (1,), "MaxUnpool": (2,),
    "Col2Im": (1, 2), "DFT": (1,), "STFT": (1, 3), "NonMaxSuppression": (2, 3, 4),
    "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,),
    "ReduceProd": (1,), "ReduceL1": (1,), "ReduceL2": (1,), "ReduceLogSum": (1,),
    "ReduceLogSumExp": (1,), "ReduceSumSquare": (1,),
    "HannWindow": (0,), "HammingWindow": (0,), "BlackmanWindow": (0,),
    "MelWeightMatrix": (0, 1, 2, 3, 4),
}

SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                     "runtime error:", "WARNING: ThreadSanitizer",
                     "ERROR: MemorySanitizer")

PASSED, UNSUPPORTED, WRONG = "passed", "unsupported", "wrong"


class HarnessError(Exception):
    pass


# --------------------------------------------------------------------------
# Worker side: one test at a time.
# --------------------------------------------------------------------------

def _sanitize(name):
    """kiln-run's file name for an output (runtime/main_run.c)."""
    out = []
    for i, c in enumerate(name):
        ok = c.isascii() and (c.isalnum() or c in "_-" or (c == "." and i > 0))
        out.append(c if ok else "_")
    return "".join(out) or "_"


def _sanitizer_report(text):
    for marker in SANITIZER_MARKERS:
        i = text.find(marker)
        if i >= 0:
            return text[max(0, text.rfind("\n", 0, i) + 1):][:2000]
    return None


def _test_op(model, name, data_root):
    """The op a test is about: the node's op, or for an expanded function
    test the op of the unexpanded test, else the distinct ops joined."""
    ops = [n.op_type for n in model.graph.node]
    if len(set(ops)) == 1:
        return ops[0]
    if name.endswith("_expanded"):
        base = os.path.join(data_root, name[:-len("_expanded")], "model.onnx")
        if os.path.exists(base):
            import onnx
            m = onnx.load(base)
            if len(m.graph.node) == 1:
                return m.graph.node[0].op_type
    seen = []
    for o in ops:
        if o not in seen:
            seen.append(o)
    return "+".join(seen) if seen else "(none)"


class Worker:
    """Runs tests inside a worker process.  All state lives here."""

    def __init__(self, opts):
        import numpy as np
        import onnx
        from onnx import numpy_helper
        self.np, self.onnx, self.nh = np, onnx, numpy_helper
        self.opts = opts
        self.workdir = opts["workdir"]
        os.makedirs(self.workdir, exist_ok=True)
        self.lib = None
        if opts["mode"] == "inproc":
            sys.path.insert(0, HERE)
            import kilnlib
            self.kilnlib = kilnlib
            self.lib = kilnlib.KilnLib(os.path.join(opts["lib"], "libkilnclient.so"), SRC)

    # -- data -------------------------------------------------------------
    def _load_pb(self, path, type_proto):
        onnx, nh = self.onnx, self.nh
        with open(path, "rb") as f:
            data = f.read()
        if type_proto.HasField("tensor_type"):
            t = onnx.TensorProto()
            t.ParseFromString(data)
            return nh.to_array(t)
        if type_proto.HasField("sequence_type"):
            s = onnx.SequenceProto()
            s.ParseFromString(data)
            return ("sequence", s)
        if type_proto.HasField("optional_type"):
            o = onnx.OptionalProto()
            o.ParseFromString(data)
            return ("optional", o)
        return ("other", data)

    def _data_sets(self, test_dir, model):
        sets = []
        for ds in sorted(glob.glob(os.path.join(test_dir, "test_data_set_*")),
                         key=lambda p: int(p.rsplit("_", 1)[1])):
            n_in = len(glob.glob(os.path.join(ds, "input_*.pb")))
            n_out = len(glob.glob(os.path.join(ds, "output_*.pb")))
            if n_in > len(model.graph.input) or n_out > len(model.graph.output):
                raise HarnessError(f"{ds}: more .pb files than the model has inputs/outputs")
            ins = [self._load_pb(os.path.join(ds, f"input_{i}.pb"), model.graph.input[i].type)
                   for i in range(n_in)]
            outs = [self._load_pb(os.path.join(ds, f"output_{i}.pb"), model.graph.output[i].type)
                    for i in range(n_out)]
            sets.append((ins, outs))
        if not sets:
            raise HarnessError(f"{test_dir}: no test_data_set_*")
        return sets

    def _freeze(self, model, sets):
        """Inputs to freeze into initializers (see STATIC_INPUTS): names."""
        np = self.np
        if self.opts["no_freeze"]:
            return []
        static, other = set(), set()
        for node in model.graph.node:
            pos = STATIC_INPUTS.get(node.op_type, ())
            for k, name in enumerate(node.input):
                (static if k in pos else other).add(name)
        out_names = {o.name for o in model.graph.output}
        frozen = []
        for i, vi in enumerate(model.graph.input):
            if vi.name not in static or vi.name in other or vi.name in out_names:
                continue
            if i >= len(sets[0][0]):
                continue
            vals = [s[0][i] for s in sets]
            if not all(isinstance(v, np.ndarray) for v in vals):
                continue
            if all(v.dtype == vals[0].dtype and v.shape == vals[0].shape
                   and np.array_equal(v, vals[0]) for v in vals[1:]):
                frozen.append(vi.name)
        return frozen

    def _frozen_model(self, model, sets, frozen):
        onnx, nh = self.onnx, self.nh
        m = onnx.ModelProto()
        m.CopyFrom(model)
        keep = []
        for i, vi in enumerate(model.graph.input):
            if vi.name in frozen:
                m.graph.initializer.append(nh.from_array(sets[0][0][i], vi.name))
            else:
                keep.append(vi)
        del m.graph.input[:]
        m.graph.input.extend(keep)
        return m

    # -- comparing ----------------------------------------------------------
    def _compare(self, name, got, exp, rtol, atol):
        """None when `got` matches `exp`, else what differs."""
        np = self.np
        if not isinstance(exp, np.ndarray):
            return f"output '{name}': expected a {exp[0]}, kiln produced a tensor"
        if got.dtype != exp.dtype:
            return f"output '{name}': dtype {got.dtype}, expected {exp.dtype}"
        if got.shape != exp.shape:
            return f"output '{name}': shape {list(got.shape)}, expected {list(exp.shape)}"
        if exp.dtype == object:
            if not np.array_equal(got, exp):
                return f"output '{name}': values differ"
            return None
        try:
            np.testing.assert_allclose(got, exp, rtol=rtol, atol=atol)
            return None
        except AssertionError:
            pass
        g = got.astype(np.float64)
        e = exp.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            bad = ~np.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
            diff = np.abs(g - e)
        idx = tuple(int(x) for x in np.argwhere(bad)[0]) if bad.any() else ()
        first = f"; first at {list(idx)}: got {g[idx]!r}, expected {e[idx]!r}" if bad.any() else ""
        return (f"output '{name}': {int(bad.sum())} of {exp.size} elements differ "
                f"(max abs diff {np.nanmax(np.where(bad, diff, 0)):.6g}, "
                f"rtol={rtol:g}, atol={atol:g}){first}")

    def _tolerances(self, name, test_dir):
        if name in TOLERANCE_OVERRIDES:
            return TOLERANCE_OVERRIDES[name]
        dj = os.path.join(test_dir, "data.json")
        if os.path.exists(dj):
            with open(dj) as f:
                d = json.load(f)
            return d.get("rtol", DEFAULT_RTOL), d.get("atol", DEFAULT_ATOL)
        return DEFAULT_RTOL, DEFAULT_ATOL

    # -- one test ---------------------------------------------------------
    def run_test(self, name, test_dir):
        t0 = time.monotonic()
        res = {"name": name, "status": None, "stage": None, "message": "",
               "op": None, "frozen_inputs": []}
        model = self.onnx.load(os.path.join(test_dir, "model.onnx"))
        orig_in = [vi.name for vi in model.graph.input]
        res["op"] = _test_op(model, name, os.path.dirname(test_dir))
        sets = self._data_sets(test_dir, model)
        frozen = self._freeze(model, sets)
        res["frozen_inputs"] = frozen
        bad = self._data_contradicts_model(model, sets, frozen)
        if frozen:
            model = self._frozen_model(model, sets, frozen)
        rtol, atol = self._tolerances(name, test_dir)
        if bad:
            # kiln compiles for the declared shapes and rightly refuses
            # other ones at run time: such a test cannot pass anywhere
            self._refused(res, "data", bad)
            res["seconds"] = round(time.monotonic() - t0, 4)
            return res
        # Harness self-tests (tests/integration/test_conformance_harness.py):
        # die the way a segfaulting kernel would, or hang like a bad loop.
        if self.opts.get("simulate_crash") == name:
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.opts.get("simulate_hang") == name:
            while True:
                time.sleep(1)
        if self.opts["mode"] == "inproc":
            self._run_inproc(res, model, orig_in, sets, rtol, atol)
        else:
            self._run_cli(res, model, orig_in, sets, rtol, atol)
        res["seconds"] = round(time.monotonic() - t0, 4)
        return res

    def _data_contradicts_model(self, model, sets, frozen):
        """A message when a test's input data (not frozen) has another
        shape than its model declares with fixed dimensions (onnx 1.12's
        CastLike tests of bfloat16 feed 'like' as [1] to a model that
        declares [3, 4]), else None."""
        for i, vi in enumerate(model.graph.input):
            if vi.name in frozen:
                continue
            tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
            if tt is None or not tt.HasField("shape"):
                continue
            dims = tt.shape.dim
            if not all(d.HasField("dim_value") for d in dims):
                continue
            want = [d.dim_value for d in dims]
            for ins, _ in sets:
                a = ins[i] if i < len(ins) else None
                if isinstance(a, self.np.ndarray) and list(a.shape) != want:
                    return (f"the test's data for input '{vi.name}' is {list(a.shape)}, "
                            f"but its model declares {want}: the test contradicts itself")
        return None

    def _inputs_by_name(self, orig_inputs, ins):
        return {orig_inputs[i]: v for i, v in enumerate(ins)}

    def _run_inproc(self, res, model, orig_in, sets, rtol, atol):
        np, lib = self.np, self.lib
        out_names = [vi.name for vi in model.graph.output]
        g, e = lib.import_onnx(model.SerializeToString())
        if not g:
            return self._refused(res, "import", e[1], e[0])
        try:
            e = lib.compile_local(g, self.opts["key"], self.kar)
        finally:
            lib.graph_destroy(g)
        if e:
            return self._refused(res, "compile", e[1], e[0])
        m, info = lib.load(self.kar, self.opts["keyring"])
        if not m:
            return self._wrong(res, "load", info)
        try:
            man_in, man_out = info
            if [o[0] for o in man_out] != out_names:
                return self._wrong(res, "load", f"artifact outputs {[o[0] for o in man_out]}, "
                                   f"the model's are {out_names}")
            for k, (ins, outs) in enumerate(sets):
                by_name = self._inputs_by_name(orig_in, ins)
                arrays = []
                for (iname, code, shape) in man_in:
                    a = by_name.get(iname)
                    if a is None:
                        return self._wrong(res, "run", f"artifact input '{iname}' has no data "
                                           "in the test")
                    if not isinstance(a, np.ndarray) or a.dtype not in self.kilnlib.NUMPY_TO_KILN:
                        kind = a.dtype if isinstance(a, np.ndarray) else a[0]
                        return self._wrong(res, "run", f"input '{iname}' is {kind}, which kiln "
                                           "has no dtype for, yet the model compiled")
                    arrays.append(np.asarray(a, order="C"))
                got, msg = lib.run(m, arrays, [(o[1], o[2]) for o in man_out])
                if got is None:
                    return self._wrong(res, "run", msg)
                for j, exp in enumerate(outs):
                    msg = self._compare(out_names[j], got[j], exp, rtol, atol)
                    if msg:
                        return self._wrong(res, "compare",
                                           msg if len(sets) == 1 else f"data set {k}: {msg}")
        finally:
            lib.model_destroy(m)
        res["status"], res["stage"] = PASSED, "compare"

    def _refused(self, res, stage, msg, code=None):
        res["stage"] = stage
        if code is not None:
            res["code"] = code
        if not msg.strip():
            res["status"] = WRONG
            res["message"] = f"{stage} failed without an error message"
        else:
            res["status"] = UNSUPPORTED
            res["message"] = msg.strip()

    def _wrong(self, res, stage, msg):
        res["status"], res["stage"], res["message"] = WRONG, stage, msg.strip()

    # -- the programs, one process per step --------------------------------
    def _exec(self, argv):
        """Run one kiln program.  None when it exited 0, else a tuple
        (refusal: bool, message)."""
        try:
            p = subprocess.run(argv, capture_output=True, text=True, errors="replace",
                               timeout=self.opts["timeout"], env=self.env)
        except subprocess.TimeoutExpired:
            return (False, f"{os.path.basename(argv[0])} hung: no exit after "
                           f"{self.opts['timeout']} s")
        report = _sanitizer_report(p.stderr)
        if report:
            return (False, f"sanitizer report from {os.path.basename(argv[0])}: {report}")
        if p.returncode == 0:
            return None
        msg = p.stderr.strip()
        if p.returncode < 0:
            sig = signal.Signals(-p.returncode).name
            return (False, f"{os.path.basename(argv[0])} killed by {sig}"
                           + (f": {msg[-1000:]}" if msg else ""))
        if p.returncode != 1:
            return (False, f"{os.path.basename(argv[0])} exited {p.returncode} "
                           f"(kiln programs exit 0 or 1): {msg[-1000:]}")
        if not msg:
            return (False, f"{os.path.basename(argv[0])} exited 1 without an error message")
        return (True, msg)

    def _run_cli(self, res, model, orig_in, sets, rtol, atol):
        np = self.np
        b = self.opts["bin"]
        wd = self.workdir
        onnx_path = os.path.join(wd, "model.onnx")
        kgraph = os.path.join(wd, "model.kgraph")
        for p in (onnx_path, kgraph, self.kar):
            if os.path.exists(p):
                os.unlink(p)
        with open(onnx_path, "wb") as f:
            f.write(model.SerializeToString())
        r = self._exec([os.path.join(b, "kiln"), "import", onnx_path,
                        "-o", kgraph, "--quiet"])
        if r:
            return (self._refused(res, "import", r[1]) if r[0]
                    else self._wrong(res, "import", r[1]))
        r = self._exec([os.path.join(b, "kiln"), "compile", "--local", kgraph,
                        "-o", self.kar, "--key", self.opts["key"]])
        if r:
            return (self._refused(res, "compile", r[1]) if r[0]
                    else self._wrong(res, "compile", r[1]))
        in_names = [vi.name for vi in model.graph.input]
        out_names = [vi.name for vi in model.graph.output]
        files = []
        for j, n in enumerate(out_names):
            f = _sanitize(n)
            if f in files:
                f = f"{f}-{j}"
            files.append(f)
        for k, (ins, outs) in enumerate(sets):
            by_name = self._inputs_by_name(orig_in, ins)
            outdir = os.path.join(wd, "out")
            shutil.rmtree(outdir, ignore_errors=True)
            argv = [self.opts["kiln_run"], self.kar, "--keyring", self.opts["keyring"],
                    "--output-dir", outdir]
            for i, n in enumerate(in_names):
                a = by_name.get(n)
                if a is None:
                    continue
                if not isinstance(a, np.ndarray):
                    return self._wrong(res, "run", f"input '{n}' is a {a[0]}, yet the model "
                                       "compiled")
                path = os.path.join(wd, f"in{i}.npy")
                np.save(path, np.asarray(a, order="C"))
                argv += ["--input", f"{n}={path}"]
            r = self._exec(argv)
            if r:
                return self._wrong(res, "run", r[1])
            for j, exp in enumerate(outs):
                path = os.path.join(outdir, files[j] + ".npy")
                if not os.path.exists(path):
                    return self._wrong(res, "run", f"kiln-run wrote no {files[j]}.npy")
                try:
                    got = np.load(path, allow_pickle=False)
                except Exception as e:  # a malformed .npy is kiln's fault
                    return self._wrong(res, "run", f"{files[j]}.npy does not load: {e}")
                msg = self._compare(out_names[j], got, exp, rtol, atol)
                if msg:
                    return self._wrong(res, "compare",
                                       msg if len(sets) == 1 else f"data set {k}: {msg}")
        res["status"], res["stage"] = PASSED, "compare"

    def serve(self, proto_out):
        """Read {"name","dir"} lines on stdin, answer one JSON line each."""
        self.kar = os.path.join(self.workdir, "model.kar")
        self.env = dict(os.environ)
        proto_out.write(json.dumps({"ready": True}) + "\n")
        proto_out.flush()
        for line in sys.stdin:
            req = json.loads(line)
            log = sys.stderr
            log.flush()
            start = os.fstat(2).st_size
            try:
                res = self.run_test(req["name"], req["dir"])
            except HarnessError as e:
                res = {"name": req["name"], "status": "harness-error", "message": str(e)}
            except Exception as e:
                # Bindings that no longer match the library, or a bug here:
                # a harness problem, never a verdict on kiln.
                import traceback
                res = {"name": req["name"], "status": "harness-error",
                       "message": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
            sys.stdout.flush()
            log.flush()
            # Anything the library printed during the test (fd 1 and 2 both
            # go to the worker's log): a sanitizer report there is a failure
            # even when the answer was right.
            text = ""
            try:
                with open(self.opts["log"], "rb") as f:
                    f.seek(start)
                    text = f.read(1 << 20).decode("utf-8", errors="replace")
            except OSError:
                pass
            report = _sanitizer_report(text)
            if report and res.get("status") != "harness-error":
                res["status"], res["message"] = WRONG, f"sanitizer report: {report}"
            proto_out.write(json.dumps(res) + "\n")
            proto_out.flush()


# Address space a worker (and, in cli mode, the programs it starts) may
# take: a test that makes kiln ask for absurd memory gets a failed
# allocation instead of starving a machine that others share.  Not under
# AddressSanitizer, which reserves terabytes of address space up front.
WORKER_ADDRESS_SPACE = 8 << 30


def worker_main(opts_json):
    opts = json.loads(opts_json)
    if not opts.get("asan"):
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_ADDRESS_SPACE, WORKER_ADDRESS_SPACE))
    # The protocol goes over a private copy of stdout; fd 1 joins fd 2 in
    # the worker's log so that nothing the library prints can corrupt it.
    proto_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", closefd=False)
    try:
        w = Worker(opts)
    except Exception as e:
        proto_out.write(json.dumps({"ready": False, "message": f"{type(e).__name__}: {e}"})
                        + "\n")
        proto_out.flush()
        return 2
    w.serve(proto_out)
    return 0


# --------------------------------------------------------------------------
# Supervisor side.
# --------------------------------------------------------------------------

class Slot:
    """One supervised worker process."""

    def __init__(self, idx, base_opts, run_dir, env):
        self.idx = idx
        self.dir = os.path.join(run_dir, f"w{idx}")
        os.makedirs(self.dir, exist_ok=True)
        self.log = os.path.join(self.dir, "worker.log")
        self.opts = dict(base_opts, workdir=self.dir, log=self.log)
        self.env = dict(env)
        # One execution core per worker, each on its own CPU, so that the
        # workers' runtimes do not all pin their models to the first CPU.
        if "KILN_RT_VISIBLE_CORES" not in env and "KILN_RT_NUM_CORES" not in env:
            cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
            self.env["KILN_RT_VISIBLE_CORES"] = str(cpus[idx % len(cpus)])
            self.env["KILN_RT_NUM_CORES"] = "1"
        self.proc = None
        self.buf = b""
        self.test = None        # (name, dir) being run
        self.deadline = None
        self.log_start = 0

    def start(self, ready_timeout=120):
        self.logf = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(self.opts)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.logf,
            env=self.env, start_new_session=True)
        self.buf = b""
        line = self._read_line(time.monotonic() + ready_timeout)
        if line is None:
            self.stop()
            raise HarnessError(f"worker {self.idx} did not start; see {self.log}")
        msg = json.loads(line)
        if not msg.get("ready"):
            self.stop()
            raise HarnessError(f"worker {self.idx} could not start: {msg.get('message')}")

    def _read_line(self, deadline):
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([self.proc.stdout], [], [], left)
            if not r:
                continue
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def send(self, name, test_dir, timeout):
        self.logf.flush()
        self.log_start = os.path.getsize(self.log)
        self.test = (name, test_dir)
        self.deadline = time.monotonic() + timeout
        self.proc.stdin.write((json.dumps({"name": name, "dir": test_dir}) + "\n").encode())
        self.proc.stdin.flush()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except Exception:
                    pass
        if getattr(self, "logf", None):
            self.logf.close()
            self.logf = None
        self.proc = None

    def log_tail(self):
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_start)
                text = f.read(1 << 20).decode("utf-8", errors="replace")
        except OSError:
            return ""
        return text.strip()


def _crash_result(name, stage, how, slot):
    tail = slot.log_tail()
    report = _sanitizer_report(tail)
    msg = how
    if report:
        msg += f"; sanitizer report: {report}"
    elif tail:
        msg += f"; last output: {tail[-1500:]}"
    return {"name": name, "status": WRONG, "stage": stage, "message": msg,
            "op": None, "frozen_inputs": []}


def _lib_needs_asan(lib_dir):
    """The path of libasan when libkilnclient.so was built with it: a
    Python process must preload it to load the library."""
    try:
        out = subprocess.run(["ldd", os.path.join(lib_dir, "libkilnclient.so")],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"(libasan\.so\S*)\s*=>\s*(\S+)", out)
    return m.group(2) if m else None


def supervise(tests, args, base_opts):
    env = dict(os.environ)
    env["KILN_CONFIG_DIR"] = base_opts["config_dir"]
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    asan = _lib_needs_asan(args.lib)
    base_opts["asan"] = bool(asan)
    if args.mode == "inproc":
        if asan:
            env["LD_PRELOAD"] = asan
            # Python itself leaks by design; kiln's own leaks are the unit
            # tests' business (make memcheck) and cli mode's.
            env["ASAN_OPTIONS"] = "detect_leaks=0:" + env.get("ASAN_OPTIONS", "")
    results = {}
    queue = collections.deque(tests)
    slots = [Slot(i, base_opts, base_opts["run_dir"], env)
             for i in range(max(1, min(args.jobs, len(tests))))]
    restarts = 0
    done = 0
    try:
        for s in slots:
            s.start()
        while queue or any(s.test for s in slots):
            for s in slots:
                if not s.test and queue:
                    name, d = queue.popleft()
                    s.send(name, d, base_opts["worker_timeout"])
            busy = [s for s in slots if s.test]
            now = time.monotonic()
            wait = max(0.0, min(s.deadline for s in busy) - now)
            r, _, _ = select.select([s.proc.stdout for s in busy], [], [], wait)
            for s in busy:
                name = s.test[0]
                res = None
                if s.proc.stdout in r:
                    chunk = os.read(s.proc.stdout.fileno(), 1 << 16)
                    if chunk:
                        s.buf += chunk
                        if b"\n" not in s.buf:
                            continue
                        line, s.buf = s.buf.split(b"\n", 1)
                        res = json.loads(line)
                        if res.get("status") == "harness-error":
                            raise HarnessError(f"{name}: {res.get('message')}")
                    else:
                        try:
                            rc = s.proc.wait(timeout=30)
                        except subprocess.TimeoutExpired:
                            rc = None
                        if rc is not None and rc < 0:
                            how = f"killed by {signal.Signals(-rc).name}"
                        else:
                            how = f"the worker exited {rc} in the middle of the test"
                        res = _crash_result(name, "crash", how, s)
                elif time.monotonic() >= s.deadline:
                    res = _crash_result(name, "hang", f"no answer after "
                                        f"{base_opts['worker_timeout']:g} s", s)
                else:
                    continue
                if res["status"] == WRONG and res.get("stage") in ("crash", "hang"):
                    s.stop()
                    restarts += 1
                    if restarts > max(20, len(tests) // 10):
                        raise HarnessError(f"more than {restarts - 1} worker restarts; "
                                           "giving up")
                    s.start()
                results[name] = res
                s.test = None
                done += 1
                if args.verbose:
                    print(f"[{done}/{len(tests)}] {name}: {res['status']}"
                          + (f" ({res['message'][:200]})" if res["status"] != PASSED else ""),
                          flush=True)
    finally:
        for s in slots:
            s.stop()
    return results


def _op_of_crash(test_dir):
    try:
        import onnx
        m = onnx.load(os.path.join(test_dir, "model.onnx"))
        return _test_op(m, os.path.basename(test_dir), os.path.dirname(test_dir))
    except Exception:
        return None


def _reason(msg):
    """A message with the test-specific parts taken out, for grouping."""
    msg = re.sub(r"^kiln \w+: ", "", msg)
    msg = re.sub(r"^'[^']*': ", "", msg)
    msg = re.sub(r"'[^']*'", "'…'", msg)
    msg = re.sub(r"\[[-0-9, ]*\]", "[…]", msg)
    msg = re.sub(r"#\d+", "#…", msg)
    return msg[:160]


class _atomic:
    """A text file written under a temporary name and renamed into place,
    so that a reader never sees half a report."""

    def __init__(self, path):
        self.path = path
        self.tmp = f"{path}.{os.getpid()}.tmp"

    def __enter__(self):
        self.f = open(self.tmp, "w")
        return self.f

    def __exit__(self, exc_type, exc, tb):
        self.f.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)


def write_reports(results, tests, args, elapsed):
    order = [n for n, _ in tests]
    counts = collections.Counter(results[n]["status"] for n in order)
    summary = {"passed": counts[PASSED], "failed": counts[WRONG],
               "skipped": counts[UNSUPPORTED], "total": len(order),
               "seconds": round(elapsed, 1)}
    os.makedirs(args.out, exist_ok=True)
    with _atomic(os.path.join(args.out, "report.json")) as f:
        json.dump({"summary": summary,
                   "config": {"mode": args.mode, "jobs": args.jobs, "timeout": args.timeout,
                              "freeze_static_inputs": not args.no_freeze,
                              "rtol": DEFAULT_RTOL, "atol": DEFAULT_ATOL,
                              "data": os.path.abspath(args.data)},
                   "tests": [results[n] for n in order]}, f, indent=1)
    width = max([len(n) for n in order] + [4])
    with _atomic(os.path.join(args.out, "report.txt")) as f:
        f.write(f"# kiln ONNX node-test conformance ({args.mode} mode, "
                f"{'frozen static inputs' if not args.no_freeze else 'no freezing'})\n")
        f.write(f"# {summary['passed']} passed, {summary['failed']} failed, "
                f"{summary['skipped']} skipped of {summary['total']} in {elapsed:.1f} s\n")
        for n in order:
            r = results[n]
            msg = r["message"].replace("\n", " | ")
            extra = f" [frozen: {','.join(r['frozen_inputs'])}]" if r.get("frozen_inputs") else ""
            f.write(f"{n:<{width}}  {r['status']:<11}  {r.get('stage') or '':<8}  "
                    f"{r.get('op') or ''}  {msg}{extra}\n")
    return summary


def print_summary(results, tests, summary):
    order = [n for n, _ in tests]
    by_op = collections.defaultdict(list)
    for n in order:
        r = results[n]
        if r["status"] == UNSUPPORTED:
            by_op[r.get("op") or "?"].append(r)
    if by_op:
        print(f"unsupported ({summary['skipped']}), by op:")
        for op in sorted(by_op, key=lambda o: (-len(by_op[o]), o)):
            reasons = collections.Counter(_reason(r["message"]) for r in by_op[op])
            top = "; ".join(f"{m} (x{c})" if c > 1 else m for m, c in reasons.most_common(3))
            more = f"; +{len(reasons) - 3} more" if len(reasons) > 3 else ""
            print(f"  {op:<28} {len(by_op[op]):>3}  {top}{more}")
    wrong = [results[n] for n in order if results[n]["status"] == WRONG]
    if wrong:
        print(f"FAILED ({len(wrong)}):")
        for r in wrong:
            msg = r["message"].replace("\n", " | ")
            print(f"  {r['name']} [{r.get('op')}] {r.get('stage')}: {msg[:400]}")


def find_tests(args):
    if not os.path.isdir(args.data):
        raise HarnessError(f"no test data in '{args.data}' (make conformance generates it)")
    names = sorted(d for d in os.listdir(args.data)
                   if d.startswith("test_") and os.path.exists(
                       os.path.join(args.data, d, "model.onnx")))
    if args.tests:
        wanted = set(args.tests)
        missing = wanted - set(names)
        if missing:
            raise HarnessError(f"no such test: {', '.join(sorted(missing))}")
        names = [n for n in names if n in wanted]
    if args.k:
        names = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in args.k)]
    return [(n, os.path.join(os.path.abspath(args.data), n)) for n in names]


def ensure_key(args, config_dir):
    """A private signing key and a keyring with its public half."""
    keys = os.path.join(config_dir, "keys")
    key = os.path.join(keys, "kiln.key")
    if not os.path.exists(key):
        os.makedirs(config_dir, exist_ok=True)
        p = subprocess.run([os.path.join(args.bin, "kiln"), "keygen", "--out", keys],
                           capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise HarnessError(f"kiln keygen failed: {p.stderr.strip()}")
    keyring = os.path.join(config_dir, "keyring")
    os.makedirs(keyring, exist_ok=True)
    shutil.copyfile(os.path.join(keys, "kiln.pub"), os.path.join(keyring, "kiln.pub"))
    return key, keyring


def main(argv):
    if len(argv) >= 2 and argv[1] == "--worker":
        return worker_main(argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tests", nargs="*", help="test names (default: all)")
    ap.add_argument("--data", default=os.path.join(SRC, "build", "conformance", "data", "node"),
                    help="directory of test_* directories")
    ap.add_argument("--out", default=os.path.join(SRC, "build", "conformance"),
                    help="where report.txt, report.json and scratch files go")
    ap.add_argument("--bin", default=os.environ.get("KILN_BIN", os.path.join(SRC, "build", "bin")))
    ap.add_argument("--lib", default=os.environ.get("KILN_LIB", os.path.join(SRC, "build", "lib")))
    ap.add_argument("--mode", choices=("inproc", "cli"), default="inproc",
                    help="inproc: libkilnclient.so through ctypes; cli: the programs")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per test")
    ap.add_argument("-k", action="append", default=[], metavar="GLOB",
                    help="only tests whose name matches (repeatable)")
    ap.add_argument("--no-freeze", action="store_true",
                    help="feed every input at run time, even shape inputs")
    ap.add_argument("--kiln-run", default=None,
                    help="cli mode: the kiln-run program to use (default: BIN/kiln-run)")
    ap.add_argument("--simulate-crash", default=None, metavar="TEST",
                    help="harness self-test: the worker kills itself with SIGSEGV on TEST")
    ap.add_argument("--simulate-hang", default=None, metavar="TEST",
                    help="harness self-test: the worker hangs on TEST")
    ap.add_argument("-v", "--verbose", action="store_true", help="a line per test")
    ap.add_argument("--baseline", default=None, metavar="FILE",
                    help="the tests that passed before (one name a line): any of them "
                         "run and not passing now fails the run")
    ap.add_argument("--write-baseline", default=None, metavar="FILE",
                    help="write the names of the tests that passed to FILE")
    args = ap.parse_args(argv[1:])

    t0 = time.monotonic()
    run_dir = None
    try:
        tests = find_tests(args)
        if not tests:
            raise HarnessError("no tests selected")
        os.makedirs(args.out, exist_ok=True)
        # Scratch space of this run alone (keys, artifacts, worker logs):
        # engineers sharing a tree may run `make test` at the same time.
        run_dir = tempfile.mkdtemp(prefix="run-", dir=os.path.abspath(args.out))
        config_dir = os.path.join(run_dir, "config")
        key, keyring = ensure_key(args, config_dir)
        base_opts = {"mode": args.mode, "bin": os.path.abspath(args.bin),
                     "lib": os.path.abspath(args.lib), "timeout": args.timeout,
                     "worker_timeout": args.timeout if args.mode == "inproc" else 3 * args.timeout + 5,
                     "no_freeze": args.no_freeze, "key": key, "keyring": keyring,
                     "config_dir": config_dir, "run_dir": run_dir,
                     "kiln_run": os.path.abspath(args.kiln_run) if args.kiln_run
                     else os.path.join(os.path.abspath(args.bin), "kiln-run"),
                     "simulate_crash": args.simulate_crash,
                     "simulate_hang": args.simulate_hang}
        results = supervise(tests, args, base_opts)
    except HarnessError as e:
        print(f"run_conformance: {e}", file=sys.stderr)
        return 2
    finally:
        if run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    for name, d in tests:
        if results[name].get("op") is None:
            results[name]["op"] = _op_of_crash(d)
    elapsed = time.monotonic() - t0
    summary = write_reports(results, tests, args, elapsed)
    print_summary(results, tests, summary)
    print(f"reports: {os.path.join(args.out, 'report.txt')}, "
          f"{os.path.join(args.out, 'report.json')} ({elapsed:.1f} s, {args.mode} mode, "
          f"{args.jobs} jobs)")
    print(f"{summary['passed']} passed, {summary['failed']} failed, "
          f"{summary['skipped']} skipped")
    passed = sorted(n for n, _ in tests if results[n].get("status") == PASSED)
    if args.write_baseline:
        with open(args.write_baseline, "w") as f:
            f.write("".join(n + "\n" for n in passed))
    lost = []
    if args.baseline:
        with open(args.baseline) as f:
            before = {line.strip() for line in f if line.strip() and not line.startswith("#")}
        ran = {n for n, _ in tests}
        lost = sorted((before & ran) - set(passed))
        for n in lost[:20]:
            print(f"run_conformance: {n} passed in {args.baseline} and does not now: "
                  f"{results[n].get('status')} ({results[n].get('message', '')})")
        print(f"baseline: {len(before & ran)} of the tests run passed before, "
              f"{len(lost)} no longer pass")
    return 1 if summary["failed"] or lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
