"""Partitioning with CPU fallback (seeds 000 and 003): compile what kiln
supports, run the rest in torch.

The graph work is torch.fx's: `symbolic_trace` gives a graph of the
model's calls with the nested inputs and outputs intact, and
`CapabilityBasedPartitioner` (Debian's torch 1.13 ships it) groups the
supported nodes into maximal partitions that do not create cycles and
fuses each into a submodule.  kiln decides only which node is supported:
the node alone is exported to ONNX with the shapes it sees on the example
inputs, imported and compiled by kiln in-process, the same check the
whole model failed (so a setting kiln refuses, not only an op it lacks,
keeps the node in torch); the answer is cached per op and shapes.  Each partition is then
exported, compiled (locally or on the farm, its own artifact and cache
key) and put in the graph in place of its submodule; a partition whose
compile fails stays in torch.

on_kiln_ratio counts as seed 003 counts: the share of compute nodes
(calls of functions, methods and modules that produce a tensor) that run
in kiln; placeholders, outputs, parameter reads, tuple indexing and shape
queries are not ops.
"""

import collections
import contextlib
import dis
import inspect
import operator
import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from . import errors, structure

# Calls whose result describes a tensor rather than being one: with fixed
# shapes they are constants, computed on the CPU for free.
_SHAPE_METHODS = {"size", "dim", "numel", "type", "__len__"}


class _Recorder(torch.fx.Interpreter):
    """Runs the graph once, keeping every node's value."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        v = super().run_node(n)
        self.values[n] = v
        return v


def _op_name(gm, node):
    """What a node calls, for warnings and cpu_ops: 'cumsum',
    'Conv2d', 'view'."""
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    if node.op == "call_method":
        return str(node.target)
    t = node.target
    return getattr(t, "__name__", None) or str(t)


def _is_glue(node, values):
    """A node that is not an op for the ratio and is never compiled on its
    own: tuple indexing, attribute and shape queries, non-tensor results."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return True
    if node.op == "call_function" and node.target in (operator.getitem, getattr):
        return True
    if node.op == "call_method" and node.target in _SHAPE_METHODS:
        return True
    v = values.get(node)
    leaves_ok = True
    try:
        leaves, _ = structure.flatten(v)
        leaves_ok = bool(leaves)
    except structure.StructureError:
        leaves_ok = False
    return not leaves_ok


class _Support(OperatorSupportBase):
    """kiln's answer per node: exported alone and imported by kiln."""

    def __init__(self, gm, values, opset, user_fn, export_part, import_check, varying):
        self.gm, self.values, self.opset = gm, values, opset
        self.varying = varying
        self.user_fn = user_fn
        self.export_part = export_part
        self.import_check = import_check
        self.cache = {}
        self.answer = {}

    def is_node_supported(self, submodules, node):
        if node not in self.answer:
            self.answer[node] = self._decide(node)
        return self.answer[node]

    def _decide(self, node):
        if node.op not in ("call_function", "call_method", "call_module"):
            return False
        if self.user_fn is not None and not self.user_fn(node):
            return False
        # kiln compiles fixed shapes: a node that makes or takes a tensor
        # whose shape depends on the data stays in torch.
        if node in self.varying or any(a in self.varying for a in node.all_input_nodes):
            return False
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            return isinstance(src, torch.fx.Node) and self.is_node_supported(None, src)
        if _is_glue(node, self.values):
            return False
        key = self._key(node)
        if key not in self.cache:
            self.cache[key] = self._try(node)
        return self.cache[key]

    def _key(self, node):
        def desc(a):
            if isinstance(a, torch.fx.Node):
                v = self.values.get(a)
                if isinstance(v, torch.Tensor):
                    return ("T", str(v.dtype), tuple(v.shape))
                return ("V", repr(v)[:200])
            if isinstance(a, (list, tuple)):
                return tuple(desc(x) for x in a)
            return repr(a)[:200]
        target = node.target
        if node.op == "call_module":
            mod = self.gm.get_submodule(node.target)
            target = (type(mod).__name__, repr(mod))
        return (node.op, str(target), desc(node.args),
                tuple(sorted((k, desc(v)) for k, v in node.kwargs.items())))

    def _try(self, node):
        """Export `node` alone (its tensor inputs as inputs, anything else
        as the constant it was) and ask kiln's importer."""
        g = torch.fx.Graph()
        env, tensors = {}, []

        def arg(a):
            if a not in env:
                v = self.values.get(a)
                if isinstance(v, torch.Tensor):
                    env[a] = g.placeholder(f"in{len(tensors)}")
                    tensors.append(v)
                else:
                    env[a] = v
            return env[a]
        new = g.node_copy(node, arg)
        g.output(new)
        gm = torch.fx.GraphModule(self.gm, g)
        try:
            with torch.no_grad():
                out = gm(*tensors)
            onnx_bytes, _, base_dir = self.export_part(gm, tuple(tensors), {}, out,
                                                       self.opset)
            try:
                return self.import_check(onnx_bytes, base_dir)
            finally:
                if base_dir:
                    shutil.rmtree(base_dir, ignore_errors=True)
        except Exception:  # any failure to export or import: not kiln's
            return False


class _FlatGraph(torch.nn.Module):
    """The partitioned graph seen through flat tensors in and out, as
    TracedModule runs a model."""

    def __init__(self, gm, in_structure):
        super().__init__()
        self.gm = gm
        self.in_structure = in_structure

    def forward(self, *flat):
        value = structure.unflatten(self.in_structure, list(flat))
        out = self.gm(*value["args"], **value["kwargs"])
        leaves, _ = structure.flatten(out)
        return leaves


class _PartCall(torch.nn.Module):
    """A compiled partition in the graph: called as the fused submodule
    was, it hands its tensor arguments to the kiln module (non-tensor
    arguments were constants when it was compiled).  When the tensors it
    receives are not the compiled shapes (a shape that depends on the data
    upstream), the partition runs in torch instead, as it was traced."""

    def __init__(self, module, tensor_positions, original):
        super().__init__()
        self.module = module
        self.tensor_positions = list(tensor_positions)
        self.original = original

    def forward(self, *args):
        tensors = [args[i] for i in self.tensor_positions]
        if not torch.jit.is_tracing():
            specs = self.module.interface.leaves
            if any(tuple(t.shape) != tuple(shape) for t, (_, _, shape) in zip(tensors, specs)):
                return self.original(*args)
        return self.module(*tensors)


class _Baked(torch.nn.Module):
    """A fused submodule with its non-tensor arguments fixed, for export."""

    def __init__(self, sub, args, tensor_positions):
        super().__init__()
        self.sub = sub
        self.fixed = list(args)
        self.tensor_positions = list(tensor_positions)

    def forward(self, *tensors):
        a = list(self.fixed)
        for i, t in zip(self.tensor_positions, tensors):
            a[i] = t
        return self.sub(*a)


def _import_check(onnx_bytes, base_dir):
    """kiln imports the node and compiles it (in-process, into a file
    thrown away): an op kiln knows but refuses in this setting (an
    attribute value, a rank, a dtype its lowering does not take) stays in
    torch like an op kiln lacks, rather than failing its whole partition.
    A failure that is not about the node (no signing key here, say) leaves
    the answer to the partition's own compile."""
    from . import compile as _compile
    try:
        g = _compile.Graph(onnx_bytes, base_dir)
    except errors.KilnError:
        return False
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-node-") as d:
            _compile.compile_graph(g, None, os.path.join(d, "node.kart"), args=[])
    except (errors.UnsupportedOperatorError, errors.CompileError, errors.InputError):
        return False
    except errors.KilnError:
        return True
    finally:
        g.close()
    return True


def trace_partitioned(func, args, kwargs, output, *, opset, workdir, build,
                      subgraph_builder_function, make_interface, compile_onnx,
                      export_part, module_class):
    """A TracedModule running `func`'s supported partitions in kiln and
    the rest in torch; see the module comment."""
    root = func if isinstance(func, torch.nn.Module) else getattr(func, "__self__", None)
    try:
        with _fx_unpacking():
            if isinstance(func, torch.nn.Module) or not isinstance(root, torch.nn.Module):
                gm = torch.fx.symbolic_trace(func)
            else:
                gm = torch.fx.symbolic_trace(root)
    except Exception as e:
        raise errors.UnsupportedOperatorError(
            f"kiln cannot compile this model whole, and running part of it on the CPU "
            f"needs torch.fx.symbolic_trace, which fails on it: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}",
            reasons=[f"torch.fx: {e}"]) from None
    if not isinstance(gm, torch.fx.GraphModule):
        raise errors.UnsupportedOperatorError("torch.fx returned no graph for the model")
    gm.eval()

    in_value = {"args": tuple(args), "kwargs": dict(kwargs)}
    flat_in, in_structure = structure.flatten(in_value)
    rec = _Recorder(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with torch.no_grad():
        bound = _bind_placeholders(placeholders, args, kwargs)
        rec.run(*bound)

    varying = _varying_shapes(gm, placeholders, args, kwargs, rec.values)
    counted = [n for n in gm.graph.nodes if not _is_glue(n, rec.values)]
    # Named now: fusing rewrites gm in place.
    op_names = {n: _op_name(gm, n) for n in counted}
    support = _Support(gm, rec.values, opset, subgraph_builder_function, export_part,
                       _import_check, varying)
    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    partitions = partitioner.propose_partitions()
    # A partition of nothing but glue is not worth an artifact.
    partitions = [p for p in partitions if any(n in p.nodes for n in counted)]
    on_kiln = {n for p in partitions for n in p.nodes}
    fused = partitioner.fuse_partitions(partitions) if partitions else gm

    # Each fused submodule's arguments on the example inputs.
    calls = {}

    class _Calls(torch.fx.Interpreter):
        def call_module(self, target, a, kw):
            if target.startswith("fused_"):
                calls[target] = a
            return super().call_module(target, a, kw)
    with torch.no_grad():
        _Calls(fused).run(*_bind_placeholders(
            [n for n in fused.graph.nodes if n.op == "placeholder"], args, kwargs))

    infos, failed = [], []
    for k, name in enumerate(sorted(calls, key=lambda s: int(s.split("_")[1]))):
        sub = fused.get_submodule(name)
        call_args = calls[name]
        tpos = [i for i, a in enumerate(call_args) if isinstance(a, torch.Tensor)]
        baked = _Baked(sub, call_args, tpos)
        tensors = tuple(call_args[i] for i in tpos)
        try:
            with torch.no_grad():
                out = baked(*tensors)
            onnx_bytes, iface, base_dir = export_part(baked, tensors, {}, out, opset)
            part_dir = os.path.join(workdir, f"part{k}") if workdir else None
            try:
                part, info = compile_onnx(onnx_bytes, workdir=part_dir, base_dir=base_dir,
                                          **build)
            finally:
                if base_dir:
                    shutil.rmtree(base_dir, ignore_errors=True)
        except (errors.UnsupportedOperatorError, errors.CompileError) as e:
            failed.append((name, e))
            continue
        info["partition"] = name
        infos.append(info)
        setattr(fused, name, _PartCall(module_class(iface, part=part, compile_info=info),
                                       tpos, sub))
    for name, e in failed:
        warnings.warn(f"kiln.trace: partition {name} could not be compiled and runs on "
                      f"the CPU: {e}", UserWarning, stacklevel=3)
    # A partition that failed stays in torch: its nodes count as CPU
    # nodes.  fuse_partitions names them fused_<index> in the order given.
    failed_names = {n for n, _ in failed}
    for i, p in enumerate(partitions):
        if f"fused_{i}" in failed_names:
            on_kiln -= set(p.nodes)

    cpu_ops = collections.Counter(op_names[n] for n in counted if n not in on_kiln)
    total = len(counted)
    ratio = (sum(1 for n in counted if n in on_kiln) / total) if total else 0.0
    if not infos:
        raise errors.UnsupportedOperatorError(
            f"kiln could compile no part of this model; on the CPU: "
            f"{', '.join(f'{k} ({v})' for k, v in cpu_ops.items())}",
            ops=dict(cpu_ops), reasons=[str(e) for _, e in failed] or None)
    if cpu_ops:
        warnings.warn(f"kiln.trace: {sum(cpu_ops.values())} of {total} ops run on the CPU: "
                      f"{', '.join(f'{k} ({v})' for k, v in sorted(cpu_ops.items()))}; "
                      f"on_kiln_ratio {ratio:.3f}", UserWarning, stacklevel=3)
    iface = make_interface(func, args, kwargs, output)
    flat_graph = _FlatGraph(fused, in_structure)
    return module_class(iface, graph=flat_graph, on_kiln_ratio=ratio, cpu_ops=dict(cpu_ops),
                        compile_info={"mode": infos[0].get("mode"), "parts": infos})


def _shapes(v):
    try:
        leaves, _ = structure.flatten(v)
    except structure.StructureError:
        return None
    return [tuple(t.shape) for t in leaves]


def _varying_shapes(gm, placeholders, args, kwargs, values):
    """The nodes whose tensors change shape when the inputs' values change
    (nonzero, unique, masked_select and what they feed): the graph is run
    again on the example inputs with their floating-point values redrawn
    five ways, and every node whose shapes differ in any run is returned.
    A node this misses is still safe: _PartCall runs its partition in
    torch when the shapes at run time are not the compiled ones."""
    flat, s = structure.flatten({"args": tuple(args), "kwargs": dict(kwargs)})
    varying = set()
    for k in range(5):
        g = torch.Generator().manual_seed(12345 + k)

        def redraw(t):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or \
                    t.numel() < 2:
                return t
            lo, hi = float(t.min()), float(t.max())
            if k == 0:
                return torch.randn(t.shape, generator=g, dtype=t.dtype) * t.std() + t.mean()
            if k == 1:
                return torch.rand(t.shape, generator=g, dtype=t.dtype) * (hi - lo) + lo
            if k == 2:
                return -t
            # Values of no relation to the example's, for an example whose
            # values all sit on one side of a threshold.
            return torch.randn(t.shape, generator=g, dtype=t.dtype) * (10.0 ** (k - 3))
        other = structure.unflatten(s, [redraw(t) for t in flat])
        rec = _Recorder(gm)
        try:
            with torch.no_grad():
                rec.run(*_bind_placeholders(placeholders, other["args"], other["kwargs"]))
        except Exception:  # the model refuses other values: nothing to learn
            continue
        varying |= {n for n, v in values.items()
                    if n in rec.values and _shapes(v) != _shapes(rec.values[n])}
    return varying


@contextlib.contextmanager
def _fx_unpacking():
    """torch 1.13's fx finds the UNPACK_SEQUENCE that iterates a proxy
    (`a, b = torch.topk(...)`) by indexing the caller's instructions with
    f_lasti // 2, which Python 3.11's inline caches break (Debian 12 pairs
    the two).  For the trace, look the instruction up by its offset."""
    if sys.version_info < (3, 11):
        yield
        return
    proxy_cls = torch.fx.proxy.Proxy
    original = proxy_cls.__iter__

    def __iter__(self):
        caller = inspect.currentframe().f_back
        for inst in dis.get_instructions(caller.f_code):
            if inst.offset == caller.f_lasti:
                if inst.opname == "UNPACK_SEQUENCE":
                    return (self[i] for i in range(inst.argval))
                break
        return self.tracer.iter(self)
    proxy_cls.__iter__ = __iter__
    try:
        yield
    finally:
        proxy_cls.__iter__ = original


def _bind_placeholders(placeholders, args, kwargs):
    """The graph's positional inputs from the call: fx makes one
    placeholder per parameter of forward, in order."""
    out = list(args)
    for ph in placeholders[len(args):]:
        if ph.target in kwargs:
            out.append(kwargs[ph.target])
        elif ph.args:
            out.append(ph.args[0])          # the parameter's default
        else:
            raise errors.InputError(f"no value for the model's input '{ph.target}'")
    return out
