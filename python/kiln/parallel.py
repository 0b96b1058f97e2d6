"""Dynamic batching (seed 001's torch_neuronx.dynamic_batch) and
DataParallel (torch.neuron.DataParallel): one compiled model, replicas on
several execution cores, a batch split across them.

Both rest on libkilnrt's kiln_model_run_batched: the batch is split along
dimension 0 into chunks of the traced batch (the last one zero-padded),
the chunks run on the replicas' cores concurrently, and the outputs are
joined and trimmed.  Each replica holds its own copy of the weights.
"""

import concurrent.futures

import torch

from . import errors
from ._runtime import run_batched, runtime
from .trace import TracedModule


def dynamic_batch(module):
    """Let `module` (from kiln.trace or kiln.load) take batches of any size
    in dimension 0: in place, and returns it.  Replicas are loaded on the
    runtime's other cores so that the chunks of a batch run concurrently.
    Inputs that differ from the traced ones in any other dimension, or in
    dimension 0 from each other, raise ValueError (kiln.InputError)."""
    if not isinstance(module, TracedModule):
        raise TypeError(f"kiln.dynamic_batch wants a module from kiln.trace or "
                        f"kiln.load, got {type(module).__name__}")
    module._enable_dynamic_batch()
    return module


class DataParallel(torch.nn.Module):
    """Run a compiled module on several execution cores, splitting each
    batch across them.

    module      a module from kiln.trace or kiln.load
    device_ids  the cores to use (default: every core of the runtime); the
                module is loaded once on each
    dim         the dimension a batch is split along (default 0)

    Along dimension 0, dynamic batching is on, as in torch.neuron's
    DataParallel: any batch size works, in chunks of the traced batch
    spread over the cores.  disable_dynamic_batching() makes each core's
    share have to be exactly the traced shape; that is also the rule when
    dim is not 0.
    """

    def __init__(self, module, device_ids=None, dim=0):
        super().__init__()
        if not isinstance(module, TracedModule):
            raise TypeError(f"kiln.DataParallel wants a module from kiln.trace or "
                            f"kiln.load, got {type(module).__name__}")
        rt = runtime()
        ids = list(range(rt.num_cores)) if device_ids is None else list(device_ids)
        if not ids:
            raise ValueError("device_ids is empty")
        for c in ids:
            if not isinstance(c, int) or not 0 <= c < rt.num_cores:
                raise ValueError(f"device_ids: no core {c!r}; the runtime has "
                                 f"{rt.num_cores} (0..{rt.num_cores - 1}; set "
                                 f"KILN_RT_VISIBLE_CORES to change them)")
        if len(set(ids)) != len(ids):
            raise ValueError(f"device_ids lists a core twice: {ids}")
        self.module = module
        self.device_ids = ids
        self.dim = int(dim)
        self.dynamic_batching = True
        self._models = [rt.load(module._path, module._keyring, core=c) for c in ids]
        self._pool = None

    def disable_dynamic_batching(self):
        self.dynamic_batching = False

    def enable_dynamic_batching(self):
        self.dynamic_batching = True

    def forward(self, *args):
        m = self.module
        if self.dim == 0 and self.dynamic_batching:
            return m._pack(run_batched(self._models, m._check_inputs(args, True)))
        return self._forward_split(args)

    def _forward_split(self, args):
        """Split along self.dim into one piece per core; each piece must be
        the traced shape."""
        m = self.module
        k = len(self._models)
        if len(args) != len(m._arg_names):
            m._check_inputs(args, False)        # raises, naming the inputs
        tensors = []
        for spec, pos in zip(m.input_specs, m._arg_index):
            t = args[pos]
            if not isinstance(t, torch.Tensor):
                raise errors.InputError(f"input '{spec.name}': expected a tensor",
                                        errors.ESHAPE)
            if not -t.dim() <= self.dim < t.dim():
                raise errors.InputError(f"input '{spec.name}' has {t.dim()} dimensions, "
                                        f"cannot split along dimension {self.dim}",
                                        errors.ESHAPE)
            pieces = torch.tensor_split(t, k, dim=self.dim)
            tensors.append(pieces)
        per_core = []
        for c in range(k):
            piece_args = list(args)
            for pos, pieces in zip(m._arg_index, tensors):
                piece_args[pos] = pieces[c]
            per_core.append(m._check_inputs(tuple(piece_args), False))
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=k)
        futures = [self._pool.submit(model.run, ins)
                   for model, ins in zip(self._models, per_core)]
        results = [f.result() for f in futures]
        outs = [torch.cat([r[i] for r in results], dim=self.dim)
                for i in range(len(m.output_specs))]
        return m._pack(outs)

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
