#!/usr/bin/env python3
"""make demo: the main job of kiln, end to end, on this machine.

Starts a broker and two workers on loopback, exports a small torch CNN to
ONNX, compiles it through the farm, runs the signed artifact with
kiln-run, compares with torch's own output, prints the max abs error and
which worker built it, and stops everything it started.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from kiln.farm import LocalFarm  # noqa: E402


class DemoCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.body(x))


def step(msg):
    print(f"==> {msg}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build", "bin"))
    args = ap.parse_args()
    kiln = os.path.join(args.bin, "kiln")
    kiln_run = os.path.join(args.bin, "kiln-run")

    with tempfile.TemporaryDirectory(prefix="kiln-demo-") as tmp:
        step("starting a broker and two workers on 127.0.0.1")
        with LocalFarm(args.bin, workers=2, workdir=os.path.join(tmp, "farm")) as farm:
            print(f"    broker {farm.endpoint}, farm key in {farm.keydir}")

            step("exporting a small CNN from torch to ONNX")
            torch.manual_seed(0)
            model = DemoCNN().eval()
            x = torch.rand(1, 3, 32, 32)
            with torch.no_grad():
                expected = model(x).numpy()
            onnx_path = os.path.join(tmp, "demo.onnx")
            torch.onnx.export(model, x, onnx_path,
                              input_names=["image"], output_names=["logits"],
                              opset_version=13)

            step("compiling through the farm")
            kar = os.path.join(tmp, "demo.kar")
            proc = subprocess.run([kiln, "compile", onnx_path, "-o", kar,
                                   "--broker", farm.endpoint, "--json"],
                                  capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                print(farm.logs(), file=sys.stderr)
                return 1
            res = json.loads(proc.stdout)
            print(f"    artifact {res['artifact']}")
            print(f"    built by {res['worker']}")

            step("compiling again: served from the action cache")
            again = subprocess.run([kiln, "compile", onnx_path, "-o", kar + ".2",
                                    "--broker", farm.endpoint, "--json"],
                                   capture_output=True, text=True, timeout=300)
            if again.returncode != 0:
                print(again.stderr, file=sys.stderr)
                return 1
            print(f"    cached: {json.loads(again.stdout)['cached']}")

            step("verifying and running the artifact with kiln-run")
            np.save(os.path.join(tmp, "image.npy"), x.numpy())
            out = os.path.join(tmp, "out")
            os.makedirs(out)
            proc = subprocess.run([kiln_run, kar, "--keyring", farm.keyring,
                                   "--input", "image=" + os.path.join(tmp, "image.npy"),
                                   "--output-dir", out],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1
            got = np.load(os.path.join(out, "logits.npy"))
            err = float(np.max(np.abs(got - expected)))
            print(f"    max abs error vs torch: {err:.3e}")
            print(f"    built by worker: {res['worker']}")
            step("stopping the farm")
        if err > 1e-4:
            print("demo: FAILED, kiln's output differs from torch's", file=sys.stderr)
            return 1
    print("demo: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
