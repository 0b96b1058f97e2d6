// ONNX Runtime's side of bench/bench_runtime.py: a long-lived process that
// loads one model with ONNX Runtime's CPU execution provider (the npm
// package onnxruntime-node, its Node.js binding), then, for each line on
// stdin, times ITERS runs and prints their latencies (ms) as JSON.
//
//   node ort_worker.js MODEL.onnx THREADS ITERS INPUT_NAME DTYPE SHAPE FILE.bin [PROFILE]
//
// DTYPE is float32 or int64, SHAPE like 1x3x224x224, FILE.bin the raw
// little-endian tensor.  Graph optimisation level "all", one intra-op
// thread pool of THREADS, sequential execution: ONNX Runtime's own speed
// on one request, as a user would configure it.  With PROFILE (a path
// prefix; bench/bench_ops_ort.py) it runs ITERS times with ONNX Runtime's
// profiler on instead, which writes PROFILE*.json (each node's kernel
// time for every run), and exits.
"use strict";
const fs = require("fs");
const readline = require("readline");
const ort = require("onnxruntime-node");

async function main() {
  const [model, threads, iters, name, dtype, shapeText, file, profile] = process.argv.slice(2);
  const shape = shapeText.split("x").map(Number);
  const raw = fs.readFileSync(file);
  const buf = raw.buffer.slice(raw.byteOffset, raw.byteOffset + raw.byteLength);
  const data = dtype === "int64" ? new BigInt64Array(buf) : new Float32Array(buf);
  const session = await ort.InferenceSession.create(model, {
    graphOptimizationLevel: "all",
    intraOpNumThreads: Number(threads),
    interOpNumThreads: 1,
    executionMode: "sequential",
    ...(profile ? { enableProfiling: true, profileFilePrefix: profile } : {}),
  });
  const feeds = { [name]: new ort.Tensor(dtype, data, shape) };
  if (profile) {
    for (let i = 0; i < Number(iters); i++) await session.run(feeds);
    session.endProfiling();
    return;
  }
  let out = null;
  for (let i = 0; i < 3; i++) out = await session.run(feeds);
  const first = out[session.outputNames[0]];
  fs.writeFileSync(file + ".ort.bin", Buffer.from(first.data.buffer, first.data.byteOffset,
                                                  first.data.byteLength));
  process.stdout.write(JSON.stringify({ ready: true, version: ort.env.versions
    ? ort.env.versions.common : null }) + "\n");
  const rl = readline.createInterface({ input: process.stdin });
  for await (const _line of rl) {
    const times = [];
    const c0 = process.cpuUsage();
    for (let i = 0; i < Number(iters); i++) {
      const t0 = process.hrtime.bigint();
      await session.run(feeds);
      times.push(Number(process.hrtime.bigint() - t0) / 1e6);
    }
    // CPU time (user + system, every thread) per run: on a shared machine
    // it moves less than the wall clock when other processes take the CPUs.
    const c = process.cpuUsage(c0);
    const cpu_ms = (c.user + c.system) / 1e3 / Number(iters);
    process.stdout.write(JSON.stringify({ times, cpu_ms }) + "\n");
  }
}

main().catch((e) => { process.stderr.write(String(e && e.stack || e) + "\n"); process.exit(1); });
