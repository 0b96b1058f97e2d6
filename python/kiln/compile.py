"""From ONNX bytes to a signed artifact: import into a kiln graph, then
compile on the farm (a broker) or locally.

Three ways to compile, as kiln.trace picks them:
  - a broker is given (broker= or $KILN_BROKER): libkilnclient sends the
    graph to the farm and waits, at most compiler_timeout; the farm's
    timeout (or ours) raises subprocess.TimeoutExpired;
  - local, no timeout: in-process with the builtin compiler;
  - local with a timeout: `kiln compile --local` in a child process,
    killed when the timeout expires, so that a timeout really stops the
    compile (an in-process compile cannot be interrupted).
Local builds are signed with the user's own key (created on first use in
$KILN_CONFIG_DIR/keys, by default ~/.config/kiln/keys).
"""

import ctypes
import json
import logging
import math
import os
import re
import shlex
import subprocess
import time

from . import _lib, errors

_JSON_MAX = 1 << 20


def config_dir():
    """kiln's configuration directory, as the C libraries compute it."""
    env = os.environ.get("KILN_CONFIG_DIR")
    if env:
        return env
    env = os.environ.get("XDG_CONFIG_HOME")
    if env:
        return os.path.join(env, "kiln")
    home = os.environ.get("HOME")
    if home:
        return os.path.join(home, ".config", "kiln")
    raise errors.KilnError("no config directory: set KILN_CONFIG_DIR or HOME",
                           errors.ENOTFOUND)


def user_keyring():
    """The directory holding the user's own key pair: the keyring that
    verifies local builds."""
    return os.path.join(config_dir(), "keys")


def trusted_keyring():
    """The user's keyring, ~/.config/kiln/keyring (under KILN_CONFIG_DIR):
    your own public key is put there when kiln makes or uses it, and
    `kiln trust` pins farms' keys there."""
    return os.path.join(config_dir(), "keyring")


def default_keyring():
    """Where kiln.load looks for trusted keys when given none: $KILN_KEYRING,
    else ~/.config/kiln/keyring when it exists, else the user's own keys."""
    env = os.environ.get("KILN_KEYRING")
    if env:
        return env
    shared = trusted_keyring()
    if os.path.isdir(shared):
        return shared
    return user_keyring()


def normalize_args(compiler_args):
    """compiler_args (None, a string or a list of strings) plus
    $KILN_CC_FLAGS, as one list of words."""
    if compiler_args is None:
        words = []
    elif isinstance(compiler_args, (str, bytes)):
        text = compiler_args.decode() if isinstance(compiler_args, bytes) else compiler_args
        words = shlex.split(text)
    else:
        words = []
        for a in compiler_args:
            if not isinstance(a, str):
                raise TypeError(f"compiler_args must be strings, got {a!r}")
            words.append(a)
    words += shlex.split(os.environ.get("KILN_CC_FLAGS", ""))
    for w in words:
        if not w or any(c.isspace() for c in w):
            raise ValueError(f"compiler argument {w!r} is empty or contains whitespace")
    return words


# Other tools' spellings of kiln's compiler flags: kiln.trace passes
# kiln's on (so that both spellings share one action key) and says so in
# compile.log, as the compiler does in its log.
FLAG_ALIASES = {"--neuroncore-pipeline-cores": "--pipeline-cores"}


def spell_flags(words):
    """`words` with other tools' spellings of kiln's flags replaced
    ("--neuroncore-pipeline-cores=2" too), and a note for each."""
    out, notes = [], []
    for w in words:
        name, eq, value = w.partition("=")
        if name in FLAG_ALIASES:
            notes.append(f"note: {name} is torch-neuron's spelling of "
                         f"{FLAG_ALIASES[name]}; compiling with {FLAG_ALIASES[name]}")
            w = FLAG_ALIASES[name] + eq + value
        out.append(w)
    return out, notes


def _ops_from_message(msg):
    """{'Clip': 35} from '... unsupported ops: Clip (35), Foo (1)'."""
    tail = msg.split("unsupported ops:", 1)[-1]
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"([A-Za-z_][\w.:]*) \((\d+)\)", tail)}


class Graph:
    """A kiln graph imported from ONNX, owned by libkilnclient."""

    def __init__(self, onnx_bytes, base_dir=None):
        """`base_dir`: the directory external data files are read from
        (confined to it); None for a self-contained model."""
        self._lib = _lib.client()
        err = _lib.Err()
        if base_dir is None:
            ptr = self._lib.kiln_capi_import_onnx(onnx_bytes, len(onnx_bytes),
                                                  ctypes.byref(err))
        else:
            ptr = self._lib.kiln_capi_import_onnx_dir(onnx_bytes, len(onnx_bytes),
                                                      _lib.fs(base_dir), ctypes.byref(err))
        if not ptr:
            if err.code == errors.EUNSUPPORTED:
                # An op list when ops are the cause; otherwise (a dtype, a
                # shape the importer refuses) the reason in words.
                raise errors.UnsupportedOperatorError(
                    f"kiln cannot compile this model: {err.message}", err.code,
                    ops=_ops_from_message(err.message) if "unsupported ops" in err.message
                    else None, reasons=[err.message])
            raise _lib.error_from(err, prefix="importing the traced model")
        self._ptr = ptr

    def info(self):
        buf = ctypes.create_string_buffer(_JSON_MAX)
        err = _lib.Err()
        if self._lib.kiln_capi_graph_info(self._ptr, buf, _JSON_MAX, ctypes.byref(err)):
            raise _lib.error_from(err)
        return json.loads(buf.value.decode())

    def save(self, path):
        err = _lib.Err()
        if self._lib.kiln_capi_graph_save(self._ptr, _lib.fs(path), ctypes.byref(err)):
            raise _lib.error_from(err)

    def dump(self, path):
        err = _lib.Err()
        if self._lib.kiln_capi_graph_dump(self._ptr, _lib.fs(path), ctypes.byref(err)):
            raise _lib.error_from(err)

    def close(self):
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr:
            self._lib.kiln_capi_graph_free(ptr)

    def __del__(self):
        self.close()


def dump_program(artifact_path, path):
    """Write the artifact's program IR as text."""
    err = _lib.Err()
    lib = _lib.client()
    if lib.kiln_capi_program_dump(_lib.fs(artifact_path), _lib.fs(path), ctypes.byref(err)):
        raise _lib.error_from(err)


class _Log:
    """compile.log in the work directory: what was run and what came of it."""

    def __init__(self, path):
        self.path = path
        self.lines = []

    def write(self, text):
        self.lines.append(text.rstrip("\n"))
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text.rstrip("\n") + "\n")


def progress_sink(progress):
    """The callable kiln.trace's `progress=` stands for, or None: a
    callable is itself; True logs each change of phase to the
    `kiln.progress` logger (INFO); None means $KILN_PROGRESS=1, else off."""
    if progress is None:
        progress = os.environ.get("KILN_PROGRESS", "") in ("1", "true", "yes")
    if progress is False:
        return None
    if progress is True:
        return _LogProgress()
    if callable(progress):
        return progress
    raise TypeError(f"progress must be None, a bool or a callable, got {progress!r}")


class _LogProgress:
    """Progress events as log lines, one per change of phase or worker."""

    def __init__(self):
        self.log = logging.getLogger("kiln.progress")
        self.last = None

    def __call__(self, ev):
        key = (ev["phase"], ev.get("worker"))
        if key == self.last:
            return
        self.last = key
        self.log.info("%s", describe_progress(ev))


def describe_progress(ev):
    """A progress event (a dict) in words."""
    phase = ev["phase"]
    eta = f", about {ev['eta_ms'] / 1000:.0f} s left" if ev.get("eta_ms") else ""
    if phase == "upload":
        return (f"uploading weights: {ev['sent_bytes'] / 2**20:.1f} of "
                f"{ev['total_bytes'] / 2**20:.1f} MiB")
    if phase == "queued":
        place = f", place {ev['position']} in your queue" if ev.get("position") else ""
        return f"queued on the farm{place}{eta}"
    if phase == "running":
        return f"compiling on {ev.get('worker', '?')}{eta}"
    if phase == "local":
        return "compiling locally"
    if phase == "download":
        reused = (f", {ev['reused_bytes'] / 2**20:.1f} MiB of it from the member cache"
                  if ev.get("reused_bytes") else "")
        return (f"downloading the artifact: {ev['sent_bytes'] / 2**20:.1f} of "
                f"{ev['total_bytes'] / 2**20:.1f} MiB{reused}")
    return "done"


def compile_graph(graph, kgraph_path, out_path, *, args, broker=None, timeout=None,
                  log_path=None, progress=None):
    """Compile `graph` (whose .kgraph is at `kgraph_path`) into a signed
    artifact at `out_path`.  Returns the compile result: artifact (content
    hash), action_key, graph_digest, cached, worker, mode."""
    log = _Log(log_path)
    args, notes = spell_flags(args)
    for note in notes:
        log.write(note)
    arg_text = " ".join(args)
    if timeout is not None:
        timeout = float(timeout)
        if not timeout > 0 or math.isinf(timeout):
            raise ValueError(f"compiler_timeout must be a positive number of seconds, "
                             f"got {timeout!r}")
    start = time.monotonic()
    if broker:
        mode = "farm"
        log.write(f"compile on the farm at {broker}, compiler arguments '{arg_text}', "
                  f"timeout {timeout if timeout is not None else 'default'}")
        res = _compile_lib(graph, broker, arg_text, timeout, out_path, log,
                           cmd=f"kiln compile --broker {broker}", progress=progress)
    elif timeout is None:
        mode = "local"
        if progress:
            progress({"phase": "local"})
        log.write(f"compile locally in-process, compiler arguments '{arg_text}'")
        res = _compile_lib(graph, None, arg_text, None, out_path, log, cmd="kiln compile")
    else:
        mode = "local-child"
        res = _compile_child(kgraph_path, out_path, arg_text, timeout, log)
    res["mode"] = mode
    log.write(f"done in {time.monotonic() - start:.3f} s: {json.dumps(res, sort_keys=True)}")
    return res


def _compile_lib(graph, broker, arg_text, timeout, out_path, log, cmd, progress=None):
    lib = _lib.client()
    buf = ctypes.create_string_buffer(_JSON_MAX)
    err = _lib.Err()
    timeout_ms = 0 if timeout is None else max(1, int(math.ceil(timeout * 1000)))
    raised = []

    def on_event(text, _arg):
        # An exception must not cross the C frames: keep the first, raise
        # it when the call returns.
        if raised:
            return
        try:
            progress(json.loads(text.decode()))
        except BaseException as e:       # noqa: BLE001 -- re-raised below
            raised.append(e)

    callback = _lib.PROGRESS_FN(on_event) if progress else _lib.PROGRESS_FN()
    rc = lib.kiln_capi_compile_progress(graph._ptr, _lib.fs(broker), arg_text.encode(),
                                        timeout_ms, None, _lib.fs(out_path), callback, None,
                                        buf, _JSON_MAX, ctypes.byref(err))
    if raised:
        raise raised[0]
    if rc != 0:
        log.write(f"failed: {err.message}")
        if err.code == errors.ETIMEOUT or (err.code == errors.EUNREACHABLE
                                           and timeout is not None):
            raise subprocess.TimeoutExpired(cmd, timeout, output=err.message.encode())
        raise _lib.error_from(err, default=errors.CompileError,
                              prefix="compiling the traced model")
    return json.loads(buf.value.decode())


def _compile_child(kgraph_path, out_path, arg_text, timeout, log):
    argv = [_lib.find_program("kiln"), "compile", "--local", str(kgraph_path), "-o",
            str(out_path), "--json"]
    if arg_text:
        argv.append(f"--compiler-args={arg_text}")
    log.write("compile locally in a child process, timeout "
              f"{timeout} s: {' '.join(shlex.quote(a) for a in argv)}")
    try:
        # subprocess.run kills the child when the timeout expires, then
        # raises TimeoutExpired: the compile really stops.
        proc = subprocess.run(argv, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        log.write(f"timed out after {timeout} s; the compiler was killed")
        for name, data in (("stdout", e.stdout), ("stderr", e.stderr)):
            if data:
                log.write(f"--- {name}\n{data.decode(errors='replace')}")
        raise
    for name, data in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        if data:
            log.write(f"--- {name}\n{data.decode(errors='replace')}")
    if proc.returncode != 0:
        msg = proc.stderr.decode(errors="replace").strip() or f"exit {proc.returncode}"
        msg = msg.replace("kiln compile: ", "", 1)
        raise errors.CompileError(f"compiling the traced model: {msg}", errors.ECOMPILE)
    res = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    return {k: res.get(k) for k in ("artifact", "action_key", "graph_digest", "cached",
                                    "worker")}
