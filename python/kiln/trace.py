"""kiln.trace: the trace API of seeds 000, 001 and 003 (torch.neuron.trace,
torch_neuronx.trace, tensorflow.neuron.trace), compiled by kiln, and the
module it returns.

trace() calls the model as the user does (a tensor, a tuple or list, a
dict meaning keyword arguments, example_kwarg_inputs), traces it with
torch.jit.trace, exports the trace to ONNX (kiln.export) and imports it
into a kiln graph.  When every op can be compiled, the whole model is
compiled on the farm or locally into one signed artifact.  When some
cannot, the model is partitioned (kiln.partition): each maximal supported
subgraph becomes an artifact of its own and the rest runs in torch on the
CPU.  The result is a TracedModule: called as the original was, it
returns outputs of the same structure (tensors in nested tuples, lists
and dicts).  `.save(path)` writes the artifact, `torch.jit.save` a
TorchScript file whose compiled parts are kiln's TorchScript class
(kiln.torchscript), loadable by torch.jit.load in any process and by C++.
"""

import inspect
import json
import os
import shutil
import tempfile
import warnings
import weakref

import torch

from . import check as _checker
from . import compile as _compile
from . import errors, export, structure
from ._runtime import describe, dtype_name, run_batched, runtime

_ARTIFACT = "model.kar"
_STRUCTURE_KEY = "kiln.io_structure"


# --- the caller's inputs ----------------------------------------------------

def _call_inputs(func, example_inputs, example_kwarg_inputs):
    """(args, kwargs) the way `func` is called: a tensor is one argument,
    a tuple or list the positional arguments (seed 000 passes [image]), a
    dict the keyword arguments (seed 003: func(**example_inputs));
    example_kwarg_inputs (seed 004) adds keyword arguments."""
    if example_inputs is None and example_kwarg_inputs is None:
        raise TypeError("kiln.trace needs example_inputs or example_kwarg_inputs")
    args, kwargs = (), {}
    if isinstance(example_inputs, torch.Tensor):
        args = (example_inputs,)
    elif isinstance(example_inputs, (tuple, list)):
        args = tuple(example_inputs)
    elif isinstance(example_inputs, dict):
        kwargs = dict(example_inputs)
    elif example_inputs is not None:
        raise TypeError(f"example_inputs must be a tensor, a tuple or list, or a dict "
                        f"of tensors, got {type(example_inputs).__name__}")
    if example_kwarg_inputs is not None:
        if not isinstance(example_kwarg_inputs, dict):
            raise TypeError(f"example_kwarg_inputs must be a dict, got "
                            f"{type(example_kwarg_inputs).__name__}")
        for k in example_kwarg_inputs:
            if k in kwargs:
                raise TypeError(f"keyword input '{k}' is given twice")
        kwargs.update(example_kwarg_inputs)
    for k in kwargs:
        if not isinstance(k, str):
            raise TypeError(f"keyword input names must be strings, got {k!r}")
    return args, kwargs


def _owner_module(func):
    """The nn.Module whose training flag decides (seed 000): the module
    itself, or the owner of a bound forward; None for a plain function."""
    if isinstance(func, torch.nn.Module):
        return func
    owner = getattr(func, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return owner
    return None


def _param_names(func, n):
    """Names for `n` positional arguments: the function's own parameter
    names when it has enough plain ones (x, y), else input0, input1, ..."""
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


class Interface:
    """How a module is called and what it returns: the parameters (name,
    positional or keyword, structure), the output structure, and each flat
    input tensor's name, dtype and shape.  Its JSON form is the artifact
    manifest's io_structure."""

    def __init__(self, params, out, leaves):
        self.params = params          # [[name, "arg"|"kwarg", structure], ...]
        self.out = out                # structure of the output
        self.leaves = leaves          # [[name, dtype name, [dims]], ...] per flat input

    @classmethod
    def of_call(cls, func, args, kwargs, output):
        names = _param_names(func, len(args))
        params, leaves = [], []
        for name, kind, value in ([(n, "arg", a) for n, a in zip(names, args)]
                                  + [(k, "kwarg", v) for k, v in kwargs.items()]):
            tensors, s = structure.flatten(value, f"input '{name}'")
            params.append([name, kind, s])
            for leaf_name, t in zip(structure.leaf_names(s, name), tensors):
                leaves.append([leaf_name, dtype_name(t.dtype), list(t.shape)])
        if len({n for n, _, _ in leaves}) != len(leaves):
            for i, leaf in enumerate(leaves):
                leaf[0] = f"input{i}"
        _, out = structure.flatten(output, "the model's output")
        return cls(params, out, leaves)

    @classmethod
    def of_model(cls, model):
        """The interface recorded in a loaded model's manifest, or a flat
        one (positional tensors in, a tensor or tuple out) for an artifact
        that has none."""
        text = model.io_structure
        if text:
            try:
                d = json.loads(text)
                return cls(d["params"], d["out"], d["inputs"])
            except (ValueError, KeyError, TypeError) as e:
                raise errors.KilnError(f"the artifact's io_structure is not valid: "
                                       f"{e}") from None
        leaves = [[s.name, dtype_name(s.dtype), list(s.shape)] for s in model.inputs]
        params = [[s.name, "arg", structure.TENSOR] for s in model.inputs]
        n = len(model.outputs)
        out = structure.TENSOR if n == 1 else {"tuple": [structure.TENSOR] * n}
        return cls(params, out, leaves)

    def to_json(self):
        return json.dumps({"params": self.params, "out": self.out, "inputs": self.leaves},
                          sort_keys=True, separators=(",", ":"))

    @property
    def leaf_names(self):
        return [leaf[0] for leaf in self.leaves]

    def in_structure(self):
        """The structure FlatCall unflattens: {"args": ..., "kwargs": ...}."""
        return {"dict": [["args", {"tuple": [s for _, k, s in self.params if k == "arg"]}],
                         ["kwargs", {"dict": [[n, s] for n, k, s in self.params
                                              if k == "kwarg"]}]]}

    def bind(self, args, kwargs):
        """The flat input tensors of a call: positional arguments fill the
        parameters in order, keywords by name; each must have the traced
        structure.  InputError otherwise."""
        names = [p[0] for p in self.params]
        if len(args) > len(self.params):
            raise errors.InputError(
                f"the model takes {len(self.params)} input"
                f"{'s' if len(self.params) != 1 else ''} ({', '.join(names)}), "
                f"received {len(args)}", errors.ESHAPE)
        values = {}
        for (name, _, _), a in zip(self.params, args):
            values[name] = a
        for k, v in kwargs.items():
            if k not in names:
                raise errors.InputError(f"the model has no input '{k}' (its inputs: "
                                        f"{', '.join(names)})", errors.ESHAPE)
            if k in values:
                raise errors.InputError(f"input '{k}' given twice", errors.ESHAPE)
            values[k] = v
        missing = [n for n in names if n not in values]
        if missing:
            raise errors.InputError(
                f"the model takes {len(self.params)} input"
                f"{'s' if len(self.params) != 1 else ''} ({', '.join(names)}), "
                f"received {len(values)}; missing {', '.join(missing)}", errors.ESHAPE)
        flat = []
        for name, _, s in self.params:
            if s == structure.TENSOR and not isinstance(values[name], torch.Tensor):
                raise errors.InputError(
                    f"input '{name}': expected a tensor, received a "
                    f"{type(values[name]).__name__}", errors.ESHAPE)
            try:
                tensors, got = structure.flatten(values[name], f"input '{name}'")
            except structure.StructureError as e:
                raise errors.InputError(str(e), errors.ESHAPE) from None
            if got != s:
                if s == structure.TENSOR:
                    raise errors.InputError(
                        f"input '{name}': expected a tensor, received a "
                        f"{type(values[name]).__name__}", errors.ESHAPE)
                raise errors.InputError(f"input '{name}' does not have the traced "
                                        f"structure {json.dumps(s)}", errors.ESHAPE)
            flat += tensors
        return flat


# --- running ------------------------------------------------------------------

class KilnPart(torch.nn.Module):
    """One compiled artifact, verified and loaded on an execution core.

    Called with its inputs in manifest order (contiguous CPU tensors of
    the compiled shapes), it returns its outputs as a list.  Under
    torch.jit.trace it records kiln's TorchScript op instead of running
    through ctypes, so a trace of it never holds uninitialised memory.
    It owns a private copy of its artifact: replicas load from it,
    saving copies it, and no one else's file can change under it."""

    def __init__(self, artifact_path, keyring, *, take_dir=None):
        super().__init__()
        self._dir = take_dir or tempfile.mkdtemp(prefix="kiln-module-")
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._dir, True)
        self.path = os.path.join(self._dir, _ARTIFACT)
        if os.path.abspath(artifact_path) != os.path.abspath(self.path):
            shutil.copyfile(artifact_path, self.path)
        self.keyring = os.fspath(keyring)
        try:
            self.model = runtime().load(self.path, self.keyring)
        except errors.KilnError as e:
            # Name the caller's file, not the private copy.
            msg = str(e).replace(self.path, os.fspath(artifact_path))
            raise type(e)(msg, e.code) from None
        self.replicas = [self.model]
        self.input_specs = list(self.model.inputs)
        self.output_specs = list(self.model.outputs)
        self.dynamic_batching = False
        self.kiln_model = None
        from . import torchscript
        if torchscript.available():
            self.kiln_model = torchscript.new_model(self.path, self.keyring)

    def run(self, tensors):
        if self.dynamic_batching:
            return run_batched(self.replicas, tensors)
        return self.model.run(tensors)

    def forward(self, *tensors):
        if torch.jit.is_tracing():
            if self.kiln_model is None:
                from . import torchscript
                torchscript.require()
            return torch.ops.kiln.run(self.kiln_model, list(tensors))
        return self.run([t.detach().contiguous() for t in tensors])

    def enable_dynamic_batch(self):
        self.model.batch_size      # raises when the model cannot be batched
        # A pipelined model already spans the cores: the chunks of a batch
        # stream through its stages instead of going to replicas.
        if len(self.replicas) == 1 and self.model.stages == 1:
            rt = runtime()
            for k in range(1, rt.num_cores):
                core = (self.model.core + k) % rt.num_cores
                self.replicas.append(rt.load(self.path, self.keyring, core=core))
        self.dynamic_batching = True

    def __reduce_ex__(self, protocol):
        raise TypeError("a kiln module cannot be pickled: write it with "
                        "torch.jit.save(module, path) or module.save(path)")


class _NotWhole(errors.KilnError, AttributeError):
    """What a partitioned module does not have (an AttributeError too, so
    that hasattr answers False)."""


class TracedModule(torch.nn.Module):
    """A model compiled by kiln, loaded on execution cores.

    Called as the original was (positional and keyword arguments, nested
    tuples, lists and dicts of CPU tensors of the traced shapes), it
    returns what the original returned, with kiln's outputs in place.
    When the whole model compiled it is one artifact (`core`, `save` to a
    .kar, dynamic batching); when part of it runs on the CPU,
    `on_kiln_ratio` says how much was compiled and `cpu_ops` what was not.
    Build one with kiln.trace or kiln.load, not directly."""

    def __init__(self, interface, *, part=None, graph=None, compile_info=None,
                 on_kiln_ratio=1.0, cpu_ops=None):
        super().__init__()
        self.interface = interface
        self._part = part
        self._graph = graph
        self.compile_info = dict(compile_info or {})
        self.on_kiln_ratio = float(on_kiln_ratio)
        self.cpu_ops = dict(cpu_ops or {})
        if part is not None:
            names = interface.leaf_names
            self.input_specs = part.input_specs
            self.output_specs = part.output_specs
            missing = [s.name for s in part.input_specs if s.name not in names]
            if missing:
                raise errors.KilnError(f"the artifact's inputs {missing} are not in its "
                                       f"io_structure")
            # Which flat inputs the artifact reads: ONNX export drops an
            # input the model never uses.
            self._arg_index = [names.index(s.name) for s in part.input_specs]
        else:
            self.input_specs = None
            self.output_specs = None
            self._arg_index = None
        self._arg_names = interface.leaf_names

    # --- what it is ---------------------------------------------------

    @property
    def partitioned(self):
        """True when part of the model runs in torch on the CPU."""
        return self._graph is not None

    @property
    def parts(self):
        """The compiled parts (KilnPart), one per artifact."""
        if self._part is not None:
            return [self._part]
        return [m for m in self._graph.modules() if isinstance(m, KilnPart)]

    def _whole(self, what):
        if self._part is None:
            raise _NotWhole(f"{what} needs a model compiled whole; this one runs "
                                   f"{len(self.parts)} kiln parts with "
                                   f"{', '.join(self.cpu_ops) or 'some ops'} on the CPU")
        return self._part

    @property
    def _model(self):
        return self._whole("the model handle").model

    @property
    def _replicas(self):
        return self._whole("replicas").replicas

    @property
    def _path(self):
        return self._whole("the artifact path").path

    @property
    def _keyring(self):
        return self.parts[0].keyring if self.parts else None

    @property
    def dynamic_batching(self):
        return self._part is not None and self._part.dynamic_batching

    @property
    def core(self):
        """The execution core the module runs on (its first part's)."""
        return self.parts[0].model.core if self.parts else None

    @property
    def cores(self):
        """The cores of every loaded replica or part (every stage's, for a
        pipelined one), each once, in order of first use."""
        seen = []
        for p in self.parts:
            for m in p.replicas:
                for c in m.stage_cores:
                    if c not in seen:
                        seen.append(c)
        return seen

    @property
    def stages(self):
        """How many pipeline stages the module runs as (its first part's):
        N when compiled with `--pipeline-cores N` (or torch-neuron's
        `--neuroncore-pipeline-cores N`), else 1."""
        return self.parts[0].model.stages if self.parts else 0

    @property
    def stage_cores(self):
        """The core of each pipeline stage (its first part's)."""
        return list(self.parts[0].model.stage_cores) if self.parts else []

    @property
    def artifact(self):
        """The artifact's content hash, when known (a whole model)."""
        return self.compile_info.get("artifact")

    def extra_repr(self):
        if self._part is None:
            return (f"parts={len(self.parts)}, on_kiln_ratio={self.on_kiln_ratio:.3f}, "
                    f"cpu_ops={self.cpu_ops}")
        ins = ", ".join(f"{s.name}: {describe(s.dtype, s.shape)}" for s in self.input_specs)
        outs = ", ".join(f"{s.name}: {describe(s.dtype, s.shape)}" for s in self.output_specs)
        where = (f"stages={self.stages}, stage_cores={self.stage_cores}"
                 if self.stages > 1 else f"core={self.core}")
        return (f"inputs=({ins}), outputs=({outs}), {where}, "
                f"dynamic_batching={self.dynamic_batching}")

    # --- running ------------------------------------------------------

    def _check_flat(self, flat, dynamic):
        """The flat inputs checked against the traced dtypes and shapes,
        detached and contiguous.  InputError names the input, what was
        expected and what was received."""
        batch, first = None, None
        out = []
        for (name, dtype, shape), t in zip(self.interface.leaves, flat):
            shape = tuple(shape)
            want = f"{dtype} [{', '.join(str(d) for d in shape)}]"
            if dynamic and shape:
                want = f"{dtype} [N{''.join(f', {d}' for d in shape[1:])}]"
            if not isinstance(t, torch.Tensor):
                raise errors.InputError(f"input '{name}': expected a tensor {want}, "
                                        f"received a {type(t).__name__}", errors.ESHAPE)
            if t.device.type != "cpu":
                raise errors.InputError(f"input '{name}': expected a CPU tensor, "
                                        f"received one on {t.device}", errors.ESHAPE)
            got = tuple(t.shape)
            if dynamic:
                if (dtype_name(t.dtype) != dtype or len(got) != len(shape)
                        or got[1:] != shape[1:]):
                    raise errors.InputError(
                        f"input '{name}': expected {want} with any N, received "
                        f"{describe(t.dtype, got)}; dynamic batching only changes "
                        f"dimension 0", errors.ESHAPE)
                if batch is None:
                    batch, first = got[0], name
                elif got[0] != batch:
                    raise errors.InputError(
                        f"inputs differ in dimension 0: '{first}' has {batch}, "
                        f"'{name}' has {got[0]}; dynamic batching needs the same batch "
                        f"in every input", errors.ESHAPE)
            elif dtype_name(t.dtype) != dtype or got != shape:
                raise errors.InputError(f"input '{name}': expected {want}, received "
                                        f"{describe(t.dtype, got)}", errors.ESHAPE)
            out.append(t.detach().contiguous())
        return out

    def _check_inputs(self, args, dynamic, kwargs=None):
        """The part's inputs in manifest order from a call's arguments."""
        flat = self.interface.bind(args, kwargs or {})
        flat = self._check_flat(flat, dynamic)
        return [flat[i] for i in self._arg_index]

    def _pack(self, outs):
        """Flat outputs in the original's structure."""
        return structure.unflatten(self.interface.out, list(outs))

    def forward(self, *args, **kwargs):
        flat = self.interface.bind(args, kwargs)
        if torch.jit.is_tracing():
            return self._pack(self._flat_forward(flat))
        flat = self._check_flat(flat, self.dynamic_batching)
        return self._pack(self._flat_forward(flat))

    def _flat_forward(self, flat):
        if self._part is not None:
            return self._part(*[flat[i] for i in self._arg_index])
        out = self._graph(*flat)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    # --- dynamic batching ---------------------------------------------

    def _enable_dynamic_batch(self):
        self._whole("dynamic batching").enable_dynamic_batch()

    # --- saving -------------------------------------------------------

    def to_torchscript(self):
        """A torch.jit.ScriptModule computing the same thing, its kiln
        parts as kiln's TorchScript op: what torch.jit.save writes.  It
        takes the flat input tensors positionally (keyword inputs in the
        traced order) and returns the original's output structure."""
        from . import torchscript
        torchscript.require()
        flat = [torch.zeros(shape, dtype=getattr(torch, dtype))
                for _, dtype, shape in self.interface.leaves]
        return torchscript.trace_module(_Flat(self), flat)

    def save(self, path, _extra_files=None):
        """Write the module to `path`, atomically.  A model compiled whole
        is written as its signed artifact (kiln.load reads it back); a
        partitioned one, or a call from torch.jit.save, as TorchScript
        (torch.jit.load or kiln.load read it back)."""
        path = os.fspath(path)
        if _extra_files is not None or self._part is None:
            script = self.to_torchscript()
            _atomic_write(path, lambda f: f.write(script.save_to_buffer(
                _extra_files=_extra_files or {})))
            return
        with open(self._part.path, "rb") as src:
            _atomic_write(path, lambda f: shutil.copyfileobj(src, f))

    def save_to_buffer(self, _extra_files=None):
        """TorchScript bytes (torch.jit.save to a file object)."""
        return self.to_torchscript().save_to_buffer(_extra_files=_extra_files or {})

    def __reduce_ex__(self, protocol):
        raise TypeError("a kiln module cannot be pickled (torch.save): write it with "
                        "torch.jit.save(module, path) or module.save(path), and read "
                        "it with torch.jit.load or kiln.load(path, keyring=...)")


class _Flat(torch.nn.Module):
    """A TracedModule seen through its flat inputs: what TorchScript
    traces, so that the saved module's graph holds only tensors."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *flat):
        m = self.module
        return structure.unflatten(_scriptable(m.interface.out),
                                   list(m._flat_forward(list(flat))))


def _scriptable(s):
    """`s` as TorchScript can return it: a dict whose values are not all
    tensors (TorchScript dicts hold one value type) becomes the tuple of
    its values, in order; everything else is kept."""
    if s == structure.TENSOR or not isinstance(s, dict):
        return s
    (kind, body), = s.items()
    if kind in ("tuple", "list"):
        return {kind: [_scriptable(x) for x in body]}
    if kind == "dict":
        if all(v == structure.TENSOR for _, v in body):
            return s
        return {"tuple": [_scriptable(v) for _, v in body]}
    return s


def _atomic_write(path, write):
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".kiln-save-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def save(module, path):
    """kiln.save(module, path): the same as module.save(path)."""
    if not isinstance(module, TracedModule):
        raise TypeError(f"kiln.save wants a module from kiln.trace or kiln.load, got "
                        f"{type(module).__name__}")
    module.save(path)


def load(path, keyring=None):
    """Verify what is at `path` and load it onto the next execution core.

    An artifact (.kar) is checked (its signature against the public keys
    in directory `keyring`, every member against the manifest) and
    returned as a TracedModule; a TorchScript file written by
    torch.jit.save / module.save is loaded with torch.jit.load, each
    embedded artifact verified against `keyring` the same way.  keyring
    defaults to $KILN_KEYRING, else ~/.config/kiln/keyring when it exists,
    else your own key's directory.  A tampered or untrusted artifact
    raises kiln.VerifyError."""
    path = os.fspath(path)
    keyring = os.fspath(keyring) if keyring is not None else _compile.default_keyring()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no artifact at '{path}'")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] == b"PK":
        from . import torchscript
        return torchscript.load(path, keyring)
    try:
        part = KilnPart(path, keyring)
    except errors.VerifyError as e:
        if keyring in str(e):
            raise
        raise errors.VerifyError(f"{e} (keyring '{keyring}')", e.code) from None
    return TracedModule(Interface.of_model(part.model), part=part)


# --- trace ----------------------------------------------------------------------

def _export(func, args, kwargs, output, opset):
    """(ONNX bytes, Interface, directory) of `func` called on (args,
    kwargs).  The directory is None, or for a model of
    export.EXTERNAL_DATA_BYTES or more the temporary directory holding the
    exported model and its external data files (the caller removes it)."""
    iface = Interface.of_call(func, args, kwargs, output)
    flat, _ = structure.flatten({"args": tuple(args), "kwargs": dict(kwargs)})
    # The interface's own structure, without the leaf names: FlatCall
    # rebuilds the call from it.
    wrapper = export.FlatCall(func, structure.flatten(
        {"args": tuple(args), "kwargs": dict(kwargs)})[1])
    traced = export.jit_trace(wrapper, flat)
    n_out = structure.count(iface.out)
    out_names = structure.leaf_names(iface.out, "output") if n_out > 1 else ["output"]
    if len(set(out_names)) != len(out_names) or set(out_names) & set(iface.leaf_names):
        out_names = [f"output{i}" for i in range(n_out)]
    base_dir = None
    if export.parameter_bytes(wrapper) >= export.EXTERNAL_DATA_BYTES:
        base_dir = tempfile.mkdtemp(prefix="kiln-export-")
    try:
        onnx_bytes = export.export_onnx(
            traced, flat, iface.leaf_names, out_names, opset,
            path=os.path.join(base_dir, "model.onnx") if base_dir else None)
        onnx_bytes = export.set_metadata(onnx_bytes, _STRUCTURE_KEY, iface.to_json())
    except BaseException:
        if base_dir:
            shutil.rmtree(base_dir, ignore_errors=True)
        raise
    return onnx_bytes, iface, base_dir


def compile_onnx(onnx_bytes, *, args, broker, keyring, timeout, workdir, base_dir=None,
                 progress=None):
    """Import and compile ONNX bytes into a loaded KilnPart and the
    compile result.  `base_dir` holds the model's external data files, if
    any.  `workdir` (or None) keeps model.onnx (and its external data),
    model.kgraph, graph.txt, compile.log, model.kar and program.txt."""
    build_dir = tempfile.mkdtemp(prefix="kiln-trace-")
    try:
        keep = workdir is not None
        if keep:
            os.makedirs(workdir, exist_ok=True)
            if base_dir:
                for name in os.listdir(base_dir):
                    if name != "model.onnx":
                        shutil.copyfile(os.path.join(base_dir, name),
                                        os.path.join(workdir, name))
            with open(os.path.join(workdir, "model.onnx"), "wb") as f:
                f.write(onnx_bytes)
            log_path = os.path.join(workdir, "compile.log")
            if os.path.exists(log_path):
                os.unlink(log_path)
        else:
            log_path = None
        kgraph_path = os.path.join(build_dir, "model.kgraph")
        graph = _compile.Graph(onnx_bytes, base_dir)
        try:
            if keep or (broker is None and timeout is not None):
                graph.save(kgraph_path)
            if keep:
                shutil.copyfile(kgraph_path, os.path.join(workdir, "model.kgraph"))
                graph.dump(os.path.join(workdir, "graph.txt"))
            artifact_path = os.path.join(build_dir, _ARTIFACT)
            info = _compile.compile_graph(graph, kgraph_path, artifact_path, args=args,
                                          broker=broker, timeout=timeout,
                                          log_path=log_path, progress=progress)
        finally:
            graph.close()
        if keep:
            shutil.copyfile(artifact_path, os.path.join(workdir, _ARTIFACT))
            _compile.dump_program(artifact_path, os.path.join(workdir, "program.txt"))
        if broker:
            keyring = keyring if keyring is not None else _compile.default_keyring()
        else:
            keyring = _compile.user_keyring()
        for name in os.listdir(build_dir):
            if name != _ARTIFACT:
                os.unlink(os.path.join(build_dir, name))
        try:
            part = KilnPart(artifact_path, keyring, take_dir=build_dir)
        except errors.KilnError as e:
            # An untrusted key, or no keyring at all yet: either way the
            # farm's key is not trusted here, and `kiln trust` is the cure.
            if not broker or not (isinstance(e, errors.VerifyError) or keyring in str(e)
                                  or not os.path.isdir(keyring)):
                raise
            raise errors.VerifyError(
                f"{e}: the farm at {broker} signed the artifact with a key that keyring "
                f"'{keyring}' does not hold; run `kiln trust {broker}` (it shows the key's "
                f"fingerprint and pins it in {_compile.trusted_keyring()}), or pass keyring= "
                f"(or set KILN_KEYRING) to a directory with the farm's kiln.pub",
                errors.EVERIFY) from None
        build_dir = None        # the part owns it now
        return part, info
    finally:
        if build_dir is not None:
            shutil.rmtree(build_dir, ignore_errors=True)


def trace(func, example_inputs=None, *, example_kwarg_inputs=None, compiler_args=None,
          compiler_timeout=None, compiler_workdir=None, check_trace=True,
          check_inputs=None, check_tolerance=1e-5, subgraph_builder_function=None,
          fallback=True, broker=None, keyring=None, progress=None):
    """Trace `func` (a function, an nn.Module or a module's forward) on
    example inputs, compile it with kiln and return a TracedModule that
    runs the compiled code.

    Following torch.neuron.trace (seed 000), torch_neuronx.trace (seed
    001), tensorflow.neuron.trace (seed 003) and torch.jit.trace (004):
      example_inputs    a tensor, a tuple or list (positional arguments,
                        each a tensor or nested tuples/lists/dicts of
                        tensors), or a dict (keyword arguments)
      example_kwarg_inputs  a dict of keyword arguments
      compiler_args     list of strings or a string; $KILN_CC_FLAGS is added;
                        kiln.trace itself takes `--opset N` (13..17, default
                        17), `--workdir DIR`, `--dynamic-batch-size` and
                        `--extract-weights` (seed 003; kiln.export.TraceFlags)
      compiler_timeout  seconds; past it, subprocess.TimeoutExpired
      compiler_workdir  keeps model.onnx, model.kgraph, graph.txt,
                        compile.log, model.kar and program.txt there (one
                        folder per part when the model is partitioned)
      check_trace       run compiled and original on the example inputs and
                        each entry of check_inputs (kiln.check says how)
      subgraph_builder_function  fn(torch.fx.Node) -> bool: a node for which
                        it returns False runs in torch on the CPU
      fallback          (kiln) when some ops cannot be compiled, run them in
                        torch on the CPU (default); False raises
                        kiln.UnsupportedOperatorError listing every one
      broker            compile on this farm (default $KILN_BROKER), else
                        locally
      keyring           (kiln) directory of public keys that verifies a farm
                        build (default $KILN_KEYRING, ~/.config/kiln/keyring);
                        local builds are verified with your own key
      progress          (kiln) a callable that gets each event of a farm
                        compile as a dict ({"phase": "upload" | "queued" |
                        "running" | "download" | "local" | "done", bytes, queue place,
                        worker, "eta_ms", ...}); True logs each phase to the
                        `kiln.progress` logger (INFO); default off ($KILN_PROGRESS=1
                        turns the logging on)
    A module in training mode is returned as it is, with a warning.
    """
    args, kwargs = _call_inputs(func, example_inputs, example_kwarg_inputs)
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
        check_sets.append(("example_inputs", args, kwargs))
        for i, ci in enumerate(check_inputs or []):
            ca, ck = _call_inputs(func, ci, None)
            check_sets.append((f"check_inputs[{i}]", ca, ck))
    cc_args = _compile.normalize_args(compiler_args)
    flags, cc_args = export.TraceFlags.take(cc_args)
    opset = flags.opset
    broker = broker if broker is not None else os.environ.get("KILN_BROKER") or None
    workdir = os.fspath(compiler_workdir) if compiler_workdir is not None else flags.workdir
    build = dict(args=cc_args, broker=broker, keyring=keyring, timeout=compiler_timeout,
                 progress=_compile.progress_sink(progress))

    with torch.no_grad():
        output = func(*args, **kwargs)
    try:
        structure.flatten(output, "the model's output")
    except structure.StructureError as e:
        raise TypeError(f"the traced function returned something kiln cannot hold: "
                        f"{e}") from None

    module = None
    if subgraph_builder_function is None:
        try:
            onnx_bytes, iface, base_dir = _export(func, args, kwargs, output, opset)
            try:
                part, info = compile_onnx(onnx_bytes, workdir=workdir, base_dir=base_dir,
                                          **build)
            finally:
                if base_dir:
                    shutil.rmtree(base_dir, ignore_errors=True)
            module = TracedModule(iface, part=part, compile_info=info)
        except errors.UnsupportedOperatorError as e:
            if not fallback:
                raise
            refusal = e
    if module is None:
        from . import partition
        if subgraph_builder_function is None:
            warnings.warn(f"kiln.trace: {refusal}; compiling what kiln supports and "
                          f"running the rest on the CPU", UserWarning, stacklevel=2)
        module = partition.trace_partitioned(
            func, args, kwargs, output, opset=opset, workdir=workdir, build=build,
            subgraph_builder_function=subgraph_builder_function,
            make_interface=Interface.of_call, compile_onnx=compile_onnx,
            export_part=_export, module_class=TracedModule)

    if flags.dynamic_batch:
        module._enable_dynamic_batch()
    for label, ca, ck in check_sets:
        with torch.no_grad():
            want, _ = structure.flatten(func(*ca, **ck))
            got, _ = structure.flatten(module(*ca, **ck))
        names = structure.leaf_names(module.interface.out, "output") \
            if len(want) > 1 else ["output"]
        _checker.compare(label, names, got, want, check_tolerance)
    return module
