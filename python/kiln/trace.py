"""kiln.trace: the trace API of seeds 000 and 001 (torch.neuron.trace,
torch_neuronx.trace), compiled by kiln, and the module it returns.

trace() runs the model locally with torch.jit.trace, exports the trace to
ONNX, imports that into a kiln graph (refusing, in one error, every op
kiln cannot compile), compiles it on the farm or locally into a signed
artifact, loads the artifact onto the next execution core, checks the
result against the original, and returns a TracedModule: called with CPU
tensors, it returns CPU tensors; `.save(path)` writes the artifact, which
`kiln.load(path, keyring=...)` verifies and loads in any process.
"""

import inspect
import io
import os
import shutil
import tempfile
import warnings
import weakref

import torch

from . import compile as _compile
from . import errors
from ._runtime import describe, dtype_name, run_batched, runtime

ONNX_OPSET = 13
_ARTIFACT = "model.kar"


def _as_tuple(inputs, what="example_inputs"):
    """A tensor becomes a 1-tuple; a list a tuple (seed 000 passes
    example_inputs=[image])."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)):
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}[{i}] is a {type(t).__name__}, not a torch.Tensor")
        return tuple(inputs)
    raise TypeError(f"{what} must be a tensor or a tuple of tensors, got "
                    f"{type(inputs).__name__}")


def _owner_module(func):
    """The nn.Module whose training flag decides (seed 000): the module
    itself, or the owner of a bound forward; None for a plain function."""
    if isinstance(func, torch.nn.Module):
        return func
    owner = getattr(func, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return owner
    return None


def _input_names(func, n):
    """Names for the model's inputs: its parameters' names when it has
    enough plain ones (x, y), else input0, input1, ..."""
    target = func.forward if isinstance(func, torch.nn.Module) else func
    names = []
    try:
        for p in inspect.signature(target).parameters.values():
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                names.append(p.name)
            else:
                break
    except (TypeError, ValueError):
        names = []
    if len(names) < n or len(set(names[:n])) < n:
        return [f"input{i}" for i in range(n)]
    return names[:n]


def _flatten(out):
    """The tensors of a (possibly nested) tuple/list output, in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        flat = []
        for o in out:
            flat += _flatten(o)
        return flat
    raise TypeError(f"the traced function returned a {type(out).__name__}; kiln.trace "
                    f"needs tensors or (nested) tuples of tensors")


def _describe_tensor(t):
    return describe(t.dtype, tuple(t.shape))


class TracedModule(torch.nn.Module):
    """A compiled kiln model, loaded on an execution core.

    Called with CPU tensors of the traced shapes and dtypes, it returns CPU
    tensors (a tuple when the model has several outputs).  `core` is the
    core it runs on; `save(path)` writes its signed artifact.  Build one
    with kiln.trace or kiln.load, not directly.
    """

    def __init__(self, artifact_path, keyring, *, arg_names=None, compile_info=None,
                 _take_dir=None):
        super().__init__()
        # The module owns a private copy of its artifact: replicas for
        # dynamic batching are loaded from it, save() copies it, and no
        # one else's file can change under it.
        self._dir = _take_dir or tempfile.mkdtemp(prefix="kiln-module-")
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._dir, True)
        self._path = os.path.join(self._dir, _ARTIFACT)
        if os.path.abspath(artifact_path) != os.path.abspath(self._path):
            shutil.copyfile(artifact_path, self._path)
        self._keyring = os.fspath(keyring)
        try:
            self._model = runtime().load(self._path, self._keyring)
        except errors.KilnError as e:
            # Name the caller's file, not the private copy.
            msg = str(e).replace(self._path, os.fspath(artifact_path))
            raise type(e)(msg, e.code) from None
        self._replicas = [self._model]
        self.dynamic_batching = False
        self.compile_info = dict(compile_info or {})
        self.input_specs = list(self._model.inputs)
        self.output_specs = list(self._model.outputs)
        # Positions of the caller's arguments that are model inputs: ONNX
        # export drops an argument the model never reads.
        self._arg_names = list(arg_names) if arg_names else [s.name for s in self.input_specs]
        names = [s.name for s in self.input_specs]
        if all(n in self._arg_names for n in names):
            self._arg_index = [self._arg_names.index(n) for n in names]
        else:
            self._arg_names = names
            self._arg_index = list(range(len(names)))

    # --- what it is ---------------------------------------------------

    @property
    def core(self):
        """The execution core the module runs on."""
        return self._model.core

    @property
    def cores(self):
        """The cores of every loaded replica (one unless dynamic batching)."""
        return [m.core for m in self._replicas]

    @property
    def artifact(self):
        """The artifact's content hash, when known."""
        return self.compile_info.get("artifact")

    def extra_repr(self):
        ins = ", ".join(f"{s.name}: {describe(s.dtype, s.shape)}" for s in self.input_specs)
        outs = ", ".join(f"{s.name}: {describe(s.dtype, s.shape)}" for s in self.output_specs)
        return (f"inputs=({ins}), outputs=({outs}), core={self.core}, "
                f"dynamic_batching={self.dynamic_batching}")

    # --- running ------------------------------------------------------

    def _check_inputs(self, args, dynamic):
        """The caller's arguments as contiguous CPU tensors in model-input
        order, or an InputError naming the input, what was expected and
        what was received."""
        if len(args) != len(self._arg_names):
            raise errors.InputError(
                f"the model takes {len(self._arg_names)} input"
                f"{'s' if len(self._arg_names) != 1 else ''} "
                f"({', '.join(self._arg_names)}), received {len(args)}", errors.ESHAPE)
        tensors = []
        batch, first = None, None
        for spec, pos in zip(self.input_specs, self._arg_index):
            t = args[pos]
            want = describe(spec.dtype, spec.shape)
            if dynamic and spec.shape:
                want = f"{dtype_name(spec.dtype)} [N{''.join(f', {d}' for d in spec.shape[1:])}]"
            if not isinstance(t, torch.Tensor):
                raise errors.InputError(f"input '{spec.name}': expected a tensor {want}, "
                                        f"received a {type(t).__name__}", errors.ESHAPE)
            if t.device.type != "cpu":
                raise errors.InputError(f"input '{spec.name}': expected a CPU tensor, "
                                        f"received one on {t.device}", errors.ESHAPE)
            shape = tuple(t.shape)
            if dynamic:
                ok = (t.dtype == spec.dtype and len(shape) == len(spec.shape)
                      and shape[1:] == tuple(spec.shape[1:]))
                if not ok:
                    raise errors.InputError(
                        f"input '{spec.name}': expected {want} with any N, received "
                        f"{_describe_tensor(t)}; dynamic batching only changes "
                        f"dimension 0", errors.ESHAPE)
                if batch is None:
                    batch, first = shape[0], spec.name
                elif shape[0] != batch:
                    raise errors.InputError(
                        f"inputs differ in dimension 0: '{first}' has {batch}, "
                        f"'{spec.name}' has {shape[0]}; dynamic batching needs the "
                        f"same batch in every input", errors.ESHAPE)
            elif t.dtype != spec.dtype or shape != tuple(spec.shape):
                raise errors.InputError(f"input '{spec.name}': expected {want}, received "
                                        f"{_describe_tensor(t)}", errors.ESHAPE)
            tensors.append(t.detach().contiguous())
        return tensors

    def forward(self, *args):
        tensors = self._check_inputs(args, self.dynamic_batching)
        if self.dynamic_batching:
            outs = run_batched(self._replicas, tensors)
        else:
            outs = self._model.run(tensors)
        return outs[0] if len(outs) == 1 else tuple(outs)

    # --- dynamic batching ---------------------------------------------

    def _enable_dynamic_batch(self):
        self._model.batch_size      # raises when the model cannot be batched
        if len(self._replicas) == 1:
            rt = runtime()
            for k in range(1, rt.num_cores):
                core = (self._model.core + k) % rt.num_cores
                self._replicas.append(rt.load(self._path, self._keyring, core=core))
        self.dynamic_batching = True

    # --- saving -------------------------------------------------------

    def save(self, path):
        """Write the signed artifact to `path` (atomically); load it with
        kiln.load(path, keyring=...)."""
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".kiln-save-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as out, open(self._path, "rb") as src:
                shutil.copyfileobj(src, out)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def __reduce_ex__(self, protocol):
        raise TypeError("a kiln module cannot be pickled (torch.save, torch.jit.save): "
                        "write it with module.save(path) and read it with "
                        "kiln.load(path, keyring=...)")


def save(module, path):
    """kiln.save(module, path): the same as module.save(path)."""
    if not isinstance(module, TracedModule):
        raise TypeError(f"kiln.save wants a module from kiln.trace or kiln.load, got "
                        f"{type(module).__name__}")
    module.save(path)


def load(path, keyring=None):
    """Verify the artifact at `path` (its signature against the public keys
    in directory `keyring`, every member against the manifest) and load it
    onto the next execution core.  keyring defaults to $KILN_KEYRING, else
    ~/.config/kiln/keyring when it exists, else your own key's directory.
    A tampered or untrusted artifact raises kiln.VerifyError."""
    path = os.fspath(path)
    keyring = os.fspath(keyring) if keyring is not None else _compile.default_keyring()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no artifact at '{path}'")
    try:
        return TracedModule(path, keyring)
    except errors.VerifyError as e:
        if keyring in str(e):
            raise
        raise errors.VerifyError(f"{e} (keyring '{keyring}')", e.code) from None


# --- trace ----------------------------------------------------------------

def _export_onnx(func, example_inputs, names, n_outputs):
    """torch.jit.trace, then ONNX bytes of the trace."""
    buf = io.BytesIO()
    out_names = ["output"] if n_outputs == 1 else [f"output{i}" for i in range(n_outputs)]
    with torch.no_grad():
        # torch.jit.trace's TracerWarnings (data-dependent control flow, ...)
        # are the user's to see; the exporter's chatter is not.
        traced = torch.jit.trace(func, example_inputs, check_trace=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(traced, example_inputs, buf, input_names=list(names),
                              output_names=out_names, opset_version=ONNX_OPSET,
                              do_constant_folding=True)
        except Exception as e:  # torch raises several types here
            if "not supported" in str(e) or type(e).__name__ == "UnsupportedOperatorError":
                raise errors.UnsupportedOperatorError(
                    f"the model uses an operator that cannot be exported to ONNX: {e}",
                    ops={}) from None
            raise
    return buf.getvalue()


def _check(module, func, sets, tolerance):
    """check_trace: compiled against original on each input set."""
    for label, inputs in sets:
        with torch.no_grad():
            expected = _flatten(func(*inputs))
        got = module(*inputs)
        got = list(got) if isinstance(got, tuple) else [got]
        if len(got) != len(expected):
            raise errors.TraceCheckError(
                f"check_trace on {label}: the compiled module returns {len(got)} "
                f"outputs, the original {len(expected)}")
        for i, (g, e) in enumerate(zip(got, expected)):
            name = module.output_specs[i].name
            if tuple(g.shape) != tuple(e.shape):
                raise errors.TraceCheckError(
                    f"check_trace on {label}: output {i} ('{name}') is "
                    f"{_describe_tensor(g)}, the original's {_describe_tensor(e)}",
                    output=i)
            if g.numel() == 0:
                continue
            gd, ed = g.double(), e.detach().double()
            diff = (gd - ed).abs()
            bad = ~torch.isclose(gd, ed, rtol=tolerance, atol=tolerance, equal_nan=True)
            if bool(bad.any()):
                max_err = float(torch.nan_to_num(diff, nan=float("inf")).max())
                raise errors.TraceCheckError(
                    f"check_trace on {label}: output {i} ('{name}') differs from the "
                    f"original by a max abs error of {max_err:.6g}, more than "
                    f"check_tolerance {tolerance:g} allows ({int(bad.sum())} of "
                    f"{g.numel()} elements); if the model is nondeterministic or the "
                    f"difference is expected, pass check_trace=False or a larger "
                    f"check_tolerance", output=i, max_error=max_err)


def trace(func, example_inputs, *, compiler_args=None, compiler_timeout=None,
          compiler_workdir=None, check_trace=True, check_inputs=None,
          check_tolerance=1e-5, broker=None, keyring=None):
    """Trace `func` (a function, an nn.Module or a module's forward) on
    `example_inputs` (a tensor or a tuple of tensors), compile it with kiln
    and return a TracedModule that runs the compiled code.

    Following torch.neuron.trace (seed 000) and torch_neuronx.trace (seed
    001):
      compiler_args     list of strings or a string; $KILN_CC_FLAGS is added
      compiler_timeout  seconds; past it, subprocess.TimeoutExpired
      compiler_workdir  keeps model.onnx, model.kgraph, graph.txt (the graph
                        IR), compile.log, model.kar and program.txt (the
                        program IR) there
      check_trace       run compiled and original on example_inputs and on
                        each tuple of check_inputs; kiln.TraceCheckError
                        naming the output and max error when they differ by
                        more than check_tolerance (relative to the value,
                        absolute near zero, as torch.isclose)
      broker            compile on this farm (default $KILN_BROKER), else
                        locally
      keyring           (kiln) directory of public keys that verifies a farm
                        build (default $KILN_KEYRING, ~/.config/kiln/keyring);
                        local builds are verified with your own key
    A module in training mode is returned as it is, with a warning.
    """
    example_inputs = _as_tuple(example_inputs)
    owner = _owner_module(func)
    if owner is not None and owner.training:
        warnings.warn(f"{type(owner).__name__} is in training mode: kiln.trace returns "
                      f"it as it is, uncompiled; call .eval() on it first to compile "
                      f"it for inference", UserWarning, stacklevel=2)
        return func
    if not callable(func):
        raise TypeError(f"kiln.trace needs a function or an nn.Module, got "
                        f"{type(func).__name__}")
    check_sets = []
    if check_trace:
        check_sets.append(("example_inputs", example_inputs))
        for i, ci in enumerate(check_inputs or []):
            check_sets.append((f"check_inputs[{i}]", _as_tuple(ci, f"check_inputs[{i}]")))
    args = _compile.normalize_args(compiler_args)
    broker = broker if broker is not None else os.environ.get("KILN_BROKER") or None

    with torch.no_grad():
        n_outputs = len(_flatten(func(*example_inputs)))
    names = _input_names(func, len(example_inputs))
    onnx_bytes = _export_onnx(func, example_inputs, names, n_outputs)

    build_dir = tempfile.mkdtemp(prefix="kiln-trace-")
    try:
        workdir = build_dir
        if compiler_workdir is not None:
            workdir = os.fspath(compiler_workdir)
            os.makedirs(workdir, exist_ok=True)
        keep = compiler_workdir is not None
        onnx_path = os.path.join(workdir, "model.onnx")
        kgraph_path = os.path.join(build_dir, "model.kgraph")
        if keep:
            with open(onnx_path, "wb") as f:
                f.write(onnx_bytes)
            log_path = os.path.join(workdir, "compile.log")
            if os.path.exists(log_path):
                os.unlink(log_path)
        else:
            log_path = None
        graph = _compile.Graph(onnx_bytes)
        try:
            if keep or (broker is None and compiler_timeout is not None):
                graph.save(kgraph_path)
            if keep:
                shutil.copyfile(kgraph_path, os.path.join(workdir, "model.kgraph"))
                graph.dump(os.path.join(workdir, "graph.txt"))
            artifact_path = os.path.join(build_dir, _ARTIFACT)
            info = _compile.compile_graph(graph, kgraph_path, artifact_path, args=args,
                                          broker=broker, timeout=compiler_timeout,
                                          log_path=log_path)
        finally:
            graph.close()
        if keep:
            shutil.copyfile(artifact_path, os.path.join(workdir, _ARTIFACT))
            _compile.dump_program(artifact_path, os.path.join(workdir, "program.txt"))
        if broker:
            keyring = keyring if keyring is not None else _compile.default_keyring()
        else:
            keyring = _compile.user_keyring()
        # Only the artifact stays in the module's directory.
        for name in os.listdir(build_dir):
            if name != _ARTIFACT:
                os.unlink(os.path.join(build_dir, name))
        try:
            module = TracedModule(artifact_path, keyring, arg_names=names,
                                  compile_info=info, _take_dir=build_dir)
        except errors.VerifyError as e:
            if not broker:
                raise
            raise errors.VerifyError(
                f"{e}: the farm at {broker} signed the artifact with a key that keyring "
                f"'{keyring}' does not hold; pass keyring= (or set KILN_KEYRING) to a "
                f"directory with the farm's kiln.pub", e.code) from None
        build_dir = None        # the module owns it now
    finally:
        if build_dir is not None:
            shutil.rmtree(build_dir, ignore_errors=True)

    if check_sets:
        _check(module, func, check_sets, check_tolerance)
    return module
