"""The nested structure of a model's inputs and outputs.

kiln compiles a model whose interface is a flat list of tensors; users
write models that take and return tensors in tuples, lists and dicts,
nested.  A structure is the shape of such a value with its tensors taken
out, as plain JSON so that it travels in the artifact's manifest
(`io_structure`, docs/artifact-format.md) and a module loaded in another
process rebuilds the same values:

    "T"                               a tensor (the next one in flat order)
    {"tuple": [s, ...]}               a tuple of structures
    {"list": [s, ...]}                a list
    {"dict": [[key, s], ...]}         a dict, keys (str or int) in order
    {"none": null}                    None (a model may return it)

The whole of a model's interface is {"args": s, "kwargs": s, "out": s}
(docs/artifact-format.md, io_structure).
"""

import torch

TENSOR = "T"
MAX_DEPTH = 32          # nesting deeper than this is refused, not recursed into
MAX_LEAVES = 4096       # tensors in one value


class StructureError(TypeError):
    """A value kiln cannot take apart into tensors, or a structure text
    that does not describe one."""


def flatten(value, what="the value"):
    """(tensors, structure) of `value`: its tensors in depth-first order
    (dict entries in insertion order) and its structure."""
    leaves = []

    def walk(v, path, depth):
        if depth > MAX_DEPTH:
            raise StructureError(f"{what} is nested more than {MAX_DEPTH} deep at {path}")
        if isinstance(v, torch.Tensor):
            if len(leaves) >= MAX_LEAVES:
                raise StructureError(f"{what} holds more than {MAX_LEAVES} tensors")
            leaves.append(v)
            return TENSOR
        if v is None:
            return {"none": None}
        if isinstance(v, tuple):      # namedtuples come back as plain tuples
            return {"tuple": [walk(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]}
        if isinstance(v, list):
            return {"list": [walk(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]}
        if isinstance(v, dict):
            items = []
            for k, x in v.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise StructureError(f"{what} has a dict key {k!r} at {path}; kiln "
                                         f"keeps str and int keys")
                items.append([k, walk(x, f"{path}[{k!r}]", depth + 1)])
            return {"dict": items}
        raise StructureError(f"{what} holds a {type(v).__name__} at {path}; kiln takes "
                             f"tensors in (nested) tuples, lists and dicts")

    structure = walk(value, "the top", 0)
    return leaves, structure


def unflatten(structure, tensors):
    """The value of `structure` with `tensors` (a sequence, consumed in
    order) in its places."""
    it = iter(tensors)
    n_used = [0]

    def build(s, depth):
        if depth > MAX_DEPTH:
            raise StructureError(f"structure nested more than {MAX_DEPTH} deep")
        if s == TENSOR:
            try:
                t = next(it)
            except StopIteration:
                raise StructureError("the structure names more tensors than there "
                                     "are") from None
            n_used[0] += 1
            return t
        if not isinstance(s, dict) or len(s) != 1:
            raise StructureError(f"not a structure: {s!r:.80}")
        (kind, body), = s.items()
        if kind == "none":
            return None
        if kind in ("tuple", "list"):
            if not isinstance(body, list):
                raise StructureError(f"{kind} structure is not a list")
            items = [build(x, depth + 1) for x in body]
            return tuple(items) if kind == "tuple" else items
        if kind == "dict":
            if not isinstance(body, list):
                raise StructureError("dict structure is not a list of pairs")
            out = {}
            for pair in body:
                if (not isinstance(pair, list) or len(pair) != 2
                        or not isinstance(pair[0], (str, int))):
                    raise StructureError(f"bad dict entry {pair!r:.80}")
                out[pair[0]] = build(pair[1], depth + 1)
            return out
        raise StructureError(f"unknown structure kind {kind!r}")

    value = build(structure, 0)
    if next(it, None) is not None:
        raise StructureError("there are more tensors than the structure names")
    return value


def count(structure):
    """How many tensors `structure` holds."""
    if structure == TENSOR:
        return 1
    if not isinstance(structure, dict) or len(structure) != 1:
        raise StructureError(f"not a structure: {structure!r:.80}")
    (kind, body), = structure.items()
    if kind == "none":
        return 0
    if kind in ("tuple", "list"):
        return sum(count(x) for x in body)
    if kind == "dict":
        return sum(count(x[1]) for x in body)
    raise StructureError(f"unknown structure kind {kind!r}")


def leaf_names(structure, prefix):
    """A name for each tensor of `structure`, from its place: 'logits',
    'out.0', 'aux.boxes'; `prefix` names the whole value.  Characters
    outside [A-Za-z0-9_.] become '_'."""
    names = []

    def clean(k):
        return "".join(c if c.isalnum() or c in "_." else "_" for c in str(k)) or "_"

    def walk(s, path):
        if s == TENSOR:
            names.append(path)
            return
        (kind, body), = s.items()
        if kind in ("tuple", "list"):
            for i, x in enumerate(body):
                walk(x, f"{path}.{i}" if path else str(i))
        elif kind == "dict":
            for k, x in body:
                walk(x, f"{path}.{clean(k)}" if path else clean(k))

    walk(structure, prefix)
    return names
