"""Shared steps of the engine tests that compare a small torch model with
kiln: a signing key, export + import, compile at an --optlevel, run, and
the kernels a KILN_RT_PROFILE=all report names."""

import os
import subprocess

import numpy as np
import torch

from conftest import run


def signing_dir(tmp_path_factory, name):
    """A new directory holding key.pem and keyring/ (its public key)."""
    d = tmp_path_factory.mktemp(name)
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(d / "key.pem")],
                   check=True, capture_output=True)
    (d / "keyring").mkdir()
    subprocess.run(["openssl", "pkey", "-in", str(d / "key.pem"), "-pubout", "-out",
                    str(d / "keyring" / "k.pub")], check=True, capture_output=True)
    return d


def seeded_model(make):
    """make() in eval mode after torch.manual_seed(0), its BatchNorms'
    running statistics made non-trivial."""
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model


def random_bn(c, weight=(0.5, 1.5)):
    """A BatchNorm2d of c channels with non-trivial running statistics,
    its scales drawn from `weight`, its shifts from [-0.3, 0.3]."""
    bn = torch.nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(*weight)
        bn.bias.uniform_(-0.3, 0.3)
    return bn


def export(workdir, name, model, x):
    """torch's output for x (float64), and the model exported (opset 14)
    and imported: (want, kgraph, path of x as .npy)."""
    with torch.no_grad():
        want = model(x).numpy().astype(np.float64)
    onnx_path = workdir / f"{name}.onnx"
    torch.onnx.export(model, (x,), str(onnx_path), input_names=["x"], output_names=["y"],
                      opset_version=14)
    kgraph = workdir / f"{name}.kgraph"
    proc = run(["kiln", "import", onnx_path, "-o", kgraph], timeout=120)
    assert proc.returncode == 0, proc.stderr
    xpath = workdir / f"{name}_x.npy"
    np.save(xpath, x.numpy())
    return want, kgraph, xpath


def compile_kar(workdir, kgraph, kar_name, compiler_args):
    kar = workdir / kar_name
    proc = run(["kiln-cc", kgraph, "-o", kar, "--key", workdir / "key.pem",
                "--compiler-args", compiler_args], timeout=120)
    assert proc.returncode == 0, proc.stderr
    return kar


def run_kar(workdir, kar, xpath, out_name, env):
    """Output y of one run, and the run's stderr."""
    out = workdir / out_name
    proc = run(["kiln-run", kar, "--keyring", workdir / "keyring", "--input",
                f"x={xpath}", "--output-dir", out], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return np.load(os.path.join(out, "y.npy")), proc.stderr


def profiles_within(workdir, name, kgraph, xpath, want, tolerance):
    """Compile at -O2 and -O3, run on every micro-kernel this CPU has and
    with 2 and 3 threads (KILN_RT_PROFILE=all), assert each output within
    tolerance of want's largest magnitude, and return the runs' profiles
    (stderr)."""
    scale = float(np.abs(want).max())
    assert scale > 0
    profiles = []
    for opt in ("2", "3"):
        kar = compile_kar(workdir, kgraph, f"{name}.O{opt}.kar", f"--optlevel {opt}")
        envs = [{"KILN_RT_ISA": isa} for isa in isas()]
        envs += [{"KILN_RT_THREADS": "2"}, {"KILN_RT_THREADS": "3"}]
        for env in envs:
            env = dict(env, KILN_RT_PROFILE="all")
            got, stderr = run_kar(workdir, kar, xpath,
                                  f"{name}.O{opt}.{'.'.join(env.values())}", env)
            assert got.shape == want.shape
            err = float(np.abs(got - want).max())
            assert err <= tolerance * scale, f"{name} -O{opt} {env}: error {err:.3g} of {scale:.3g}"
            profiles.append(stderr)
    return profiles


def kernel_ops(stderr):
    """Ops per kernel name in a KILN_RT_PROFILE=all report's per-kernel
    table (name, ms per run, share, ops)."""
    ops = {}
    for line in stderr.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2].endswith("%") and parts[3].isdigit():
            ops[parts[0]] = int(parts[3])
    return ops


def isas():
    """The micro-kernels this CPU can run (KILN_RT_ISA values)."""
    flags = open("/proc/cpuinfo").read()
    found = ["generic"]
    if " avx2" in flags and " fma" in flags:
        found.append("avx2")
    if " avx512f" in flags:
        found.append("avx512")
    return found
