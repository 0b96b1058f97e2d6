#!/usr/bin/python3
"""kiln.DataParallel on one core against two: the same compiled model
(traced at batch 1), a batch of 8 split across the cores, side by side
with eager torch on the same machine.  Prints the times and the speedup;
asserts nothing about time.

    PYTHONPATH=python /usr/bin/python3 bench/bench_dataparallel.py
    ... --model cnn --repeat 3        # a small model, for a quick look

Each core runs one chunk at a time on a thread pinned to its CPU with one
BLAS thread, so two cores should come close to twice the throughput of
one when the machine has two idle CPUs.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import kiln  # noqa: E402


def _model(name):
    torch.manual_seed(0)
    if name == "resnet18":
        import torchvision
        return torchvision.models.resnet18().eval(), (1, 3, 224, 224)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).eval()
    return model, (1, 3, 64, 64)


def _time(fn, repeat):
    fn()                                    # warm up (threads, caches)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["resnet18", "cnn"], default="resnet18")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    model, shape = _model(args.model)
    traced = kiln.trace(model, torch.rand(*shape))
    batch = torch.rand(args.batch, *shape[1:])
    n_cores = kiln.num_cores()
    with torch.no_grad():
        want = model(batch)

    results = {"model": args.model, "batch": args.batch, "cores_available": n_cores}
    one = kiln.DataParallel(traced, device_ids=[0])
    assert torch.allclose(one(batch), want, rtol=1e-3, atol=1e-4)
    results["one_core_s"] = _time(lambda: one(batch), args.repeat)
    if n_cores >= 2:
        two = kiln.DataParallel(traced, device_ids=[0, 1])
        assert torch.allclose(two(batch), want, rtol=1e-3, atol=1e-4)
        results["two_cores_s"] = _time(lambda: two(batch), args.repeat)
        results["speedup"] = results["one_core_s"] / results["two_cores_s"]
    with torch.no_grad():
        results["torch_eager_s"] = _time(lambda: model(batch), args.repeat)
    results["torch_threads"] = torch.get_num_threads()

    print(f"{args.model}, batch {args.batch} on a batch-1 trace, "
          f"median of {args.repeat}:")
    print(f"  kiln, 1 core : {results['one_core_s'] * 1e3:8.1f} ms")
    if "two_cores_s" in results:
        print(f"  kiln, 2 cores: {results['two_cores_s'] * 1e3:8.1f} ms")
        print(f"  ratio 1 core / 2 cores: {results['speedup']:.2f}x")
    else:
        print("  (only one core is available: no 2-core measurement)")
    print(f"  torch eager  : {results['torch_eager_s'] * 1e3:8.1f} ms "
          f"({results['torch_threads']} threads)")
    print(json.dumps(results, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
