"""check_trace: the compiled module against the original, on the example
inputs and each of check_inputs.

torch.jit.trace's checker (seeds 002/004) compares element by element,
|got - want| <= atol + rtol * |want|, with rtol = check_tolerance and atol
torch's default for the dtype (1e-5 for float32).  That rule suits two
runs of the same kernels.  A compiler reorders floating-point sums (tiled
and blocked products, Winograd convolutions, fused epilogues): the error
of an output element is then a few ulps of the terms that were summed,
not of the element, and an element that is a near-cancellation of large
terms (a logit near zero, say) fails the elementwise rule although the
whole output agrees with torch to 1e-6 of its magnitude.  So kiln scales
the relative part by the output's largest magnitude instead of each
element's own:

    max |got - want|  <=  atol + check_tolerance * max |want|

per output tensor (NaN where the original has NaN is equal; integer and
bool outputs must be equal).  For float16 and bfloat16 outputs the
relative part is at least 4 units of the type's precision (HALF_RTOL):
both sides round after every op.  A miscompile (a wrong weight, a wrong
kernel) moves outputs by far more than 1e-5 of their scale; float
reassociation moves them by about 1e-6 on the deepest torchvision
classifiers.  docs/python.md has the numbers.
"""

import torch

from . import errors

DEFAULT_ATOL = {torch.float32: 1e-5, torch.float64: 1e-7, torch.float16: 1e-3,
                torch.bfloat16: 1e-2}

# A half-precision output is rounded to its type after every op, by torch
# and by kiln alike, in orders that differ: a few units of the type's
# precision of the output's scale apart is agreement.  The relative part
# of the rule is at least this for such outputs (4 ulps at 1.0).
HALF_RTOL = {torch.float16: 4 * 2.0 ** -10, torch.bfloat16: 4 * 2.0 ** -7}


def output_error(got, want):
    """(max abs error, scale) of one output: scale is max |want| over its
    finite elements."""
    gd, wd = got.detach().double(), want.detach().double()
    both_nan = torch.isnan(gd) & torch.isnan(wd)
    same_inf = torch.isinf(wd) & (gd == wd)
    diff = (gd - wd).abs()
    diff = torch.where(both_nan | same_inf, torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=float("inf"))
    finite = wd[torch.isfinite(wd)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return (float(diff.max()) if diff.numel() else 0.0), scale


def compare(label, names, got, want, tolerance):
    """Raise TraceCheckError naming the first output of `got` that differs
    from `want` (flat lists of tensors) more than `tolerance` allows."""
    if len(got) != len(want):
        raise errors.TraceCheckError(
            f"check_trace on {label}: the compiled module returns {len(got)} outputs, "
            f"the original {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        name = names[i] if i < len(names) else str(i)
        if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
            raise errors.TraceCheckError(
                f"check_trace on {label}: output {i} ('{name}') is {g.dtype} "
                f"{list(g.shape)}, the original's {w.dtype} {list(w.shape)}", output=i)
        if g.numel() == 0:
            continue
        if not (w.is_floating_point() or w.is_complex()):
            if not torch.equal(g, w):
                n = int((g != w).sum())
                raise errors.TraceCheckError(
                    f"check_trace on {label}: output {i} ('{name}') differs from the "
                    f"original in {n} of {g.numel()} elements", output=i,
                    max_error=float((g.double() - w.double()).abs().max()))
            continue
        err, scale = output_error(g, w)
        atol = DEFAULT_ATOL.get(w.dtype, 1e-5)
        allowed = atol + max(tolerance, HALF_RTOL.get(w.dtype, 0.0)) * scale
        if not err <= allowed:
            raise errors.TraceCheckError(
                f"check_trace on {label}: output {i} ('{name}') differs from the "
                f"original by a max abs error of {err:.6g} at a scale (max |output|) of "
                f"{scale:.6g}, more than check_tolerance {tolerance:g} allows "
                f"({allowed:.3g}); if the model is nondeterministic or the difference "
                f"is expected, pass check_trace=False or a larger check_tolerance",
                output=i, max_error=err)
