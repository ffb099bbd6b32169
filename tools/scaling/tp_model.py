#!/usr/bin/env python3
"""The TP / PP scaling model of tpserve's decode on one 8 x H200 NVLink node (issue 21):
predicted batch-1 ms/token and batch-64 tokens/s for TP = 1, 2, 4, 8 and PP = 2, 4, from what
one H200 measured (kernels/cuda/NOTES.md) and published all-reduce latencies. A model, not a
measurement: kernels/cuda/NOTES.md "TP and PP scaling model" says what each term rests on and
what only a multi-GPU run can show.

  /usr/bin/python3 tools/scaling/tp_model.py [--shards] [--json]

Batch 1, TP = k (per layer, two all-reduces of the hidden state):
  layer(k) = W_layer / (k * BW) + A + 2 * L_ar(k, 8 KB)
  token(k) = layers * layer(k) + W_head / (k * BW) + L_ar(k, 8 KB) * head_gather
A is the non-weight time of a layer at TP = 1 inside the CUDA graph (the measured token minus its
weight floor, per layer: attention's latency, the small kernels), assumed not to shrink with k.
Batch 64, TP = k: the step is the measured TP = 1 step's ratio to its bytes floor times the
floor of 1/k of the weights and of the KV cache, plus 2 * layers all-reduces of 64 x hidden bf16.
Batch 64, PP = p with p micro-batches in flight: a stage streams 1/p of the weights and the KV
of its layers for one micro-batch of 64 / p sequences; the pipeline delivers a micro-batch per
stage time (send/recv of 64 / p x hidden bf16 between stages overlaps the next micro-batch).

The shard model (--shards; the "shards" rows) replaces the bandwidth terms by kernel times
measured on one H200 at each TP's shard shapes (`tpserve-cuda-bench --shards`, SHARDS below):
  layer(k) = f * (G(k) + Att(k)) + 2 * L_ar(k)      token(k) = layers * layer(k) + f * H(k) + L_ar
where G(k) is the sum of the layer's four GEMMs (qkv and gate_up with N / k, o and down with K / k)
timed one by one, Att(k) decode attention over 32 / k heads, H(k) the lm_head shard, and f the
ratio of the measured TP = 1 token (in its CUDA graph, where fused kernels and programmatic
dependent launch overlap the kernels) to the same sum at TP = 1, assumed the same at every k.
Batch 64 likewise, from the kernels at M = 64 and batch-64 attention at context 1024.
"""

import argparse
import json
import math
import sys

# Measured on one H200 (kernels/cuda/NOTES.md, 2026-12-04 02:28 UTC, binaries of 6ff5e70, random
# DeepSeek-Coder-6.7B-shaped bf16 checkpoint, bf16 KV cache, `tpserve-engine-bench`).
MEASURED = {
    "copy_TBps": 4.24,          # device-to-device copy, read + write
    "weight_GB": 13.481,        # all weights
    "head_GB": 0.264,           # lm_head (32256 x 4096 bf16); the embedding is read by row
    "embed_GB": 0.264,
    "layers": 32,
    "hidden": 4096,
    "batch1_ms": 3.456,         # batch 1, prompt 512, 128 new tokens (CUDA graphs)
    "batch64_ms": 12.919,       # batch 64, context 1024, one decode step
    "batch64_floor_ms": 11.409, # its bytes floor (weights + KV at context 1024)
}

# One decode layer's kernels at the shard shapes of TP = k on one H200, microseconds
# (`tpserve-cuda-bench --shards`, 2026-12-04 14:02 UTC, session 11; copy 4,229 GB/s). gemm_m1 /
# gemm_m64: qkv + o + gate_up + down at M = 1 / 64 through the default path (the skinny kernel
# at M = 1, cuBLASLt at 64); attn_b1: decode attention at batch 1, context 576, 32 / k heads;
# attn_b64: batch 64, context 1024; head_m1 / head_m64: the lm_head shard.
SHARDS = {
    1: {"gemm_m1": 111.5, "attn_b1": 10.8, "head_m1": 63.8,
        "gemm_m64": 126.7, "attn_b64": 262.5, "head_m64": 68.7},
    2: {"gemm_m1": 67.8, "attn_b1": 10.1, "head_m1": 34.4,
        "gemm_m64": 75.3, "attn_b64": 142.1, "head_m64": 37.0},
    4: {"gemm_m1": 45.5, "attn_b1": 9.8, "head_m1": 20.1,
        "gemm_m64": 51.7, "attn_b64": 76.1, "head_m64": 23.2},
    8: {"gemm_m1": 34.6, "attn_b1": 9.7, "head_m1": 13.0,
        "gemm_m64": 45.7, "attn_b64": 45.7, "head_m64": 14.2},
}

# Published all-reduce latencies, microseconds, on 8 x H100 SXM (NVLink 4, the H200's fabric),
# without CUDA graphs: sgl-project/sglang pull request #2904 ("optimize custom allreduce
# kernel", 2025-01-15), its unit-test tables, by message bytes. "custom": the TensorRT-LLM-style
# one-shot kernel SGLang adopted; "vllm": vLLM's custom all-reduce in the same tables. Batch 1
# moves 8 KB (4096 bf16, interpolated in log2 of the size), batch 64 512 KB.
PUBLISHED_AR_US = {
    "custom": {2: {4096: 3.9, 32768: 4.5, 524288: 12.5},
               4: {4096: 3.7, 32768: 4.8, 524288: 20.2},
               8: {4096: 5.7, 32768: 7.8, 524288: 22.1}},
    "vllm": {2: {4096: 8.8, 32768: 8.7, 524288: 17.7},
             4: {4096: 8.5, 32768: 9.2, 524288: 26.9},
             8: {4096: 9.3, 32768: 11.8, 524288: 30.4}},
}


def ar_us(impl, tp, nbytes):
    """The published latency at nbytes, linear in log2(bytes) between the table's sizes."""
    pts = sorted(PUBLISHED_AR_US[impl][tp].items())
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if b0 <= nbytes <= b1:
            f = (math.log2(nbytes) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
            return t0 + f * (t1 - t0)
    raise ValueError(f"{nbytes} bytes is outside the published sizes")


def layer_weight_us(m):
    per_layer_gb = (m["weight_GB"] - m["head_GB"] - m["embed_GB"]) / m["layers"]
    return per_layer_gb / m["copy_TBps"] * 1e3  # GB / (TB/s) = ms; * 1e3 -> us


def head_us(m):
    return m["head_GB"] / m["copy_TBps"] * 1e3


def fixed_layer_us(m):
    """A: the non-weight time of a layer at TP = 1 (measured token minus its weight floor)."""
    floor_ms = m["weight_GB"] / m["copy_TBps"]
    return (m["batch1_ms"] - floor_ms) * 1e3 / m["layers"]


def batch1_ms(m, tp, ar_us):
    """Predicted batch-1 ms/token at TP = tp with an all-reduce of 8 KB taking ar_us."""
    layer = layer_weight_us(m) / tp + fixed_layer_us(m) + (2 * ar_us if tp > 1 else 0.0)
    floor_rest_us = (m["weight_GB"] / m["copy_TBps"] * 1e3) - m["layers"] * layer_weight_us(m)
    # The embedding row and the lm_head (vocab-parallel: 1/tp of it, then one gather).
    rest = floor_rest_us - head_us(m) + head_us(m) / tp + (ar_us if tp > 1 else 0.0)
    return (m["layers"] * layer + rest) / 1e3


def batch64_tps(m, tp, ar_us):
    """Predicted batch-64 output tokens/s at context 1024 for TP = tp (ar_us: 512 KB)."""
    ratio = m["batch64_ms"] / m["batch64_floor_ms"]
    step_ms = ratio * m["batch64_floor_ms"] / tp + (2 * m["layers"] * ar_us / 1e3 if tp > 1 else 0)
    return 64 / step_ms * 1e3


def pp_batch64_tps(m, pp):
    """Predicted batch-64 tokens/s for PP = pp with pp micro-batches of 64 / pp in flight."""
    ratio = m["batch64_ms"] / m["batch64_floor_ms"]
    weights_ms = m["weight_GB"] / m["copy_TBps"]
    kv_ms = m["batch64_floor_ms"] - weights_ms  # the KV of 64 sequences over all layers
    stage_ms = ratio * (weights_ms / pp + kv_ms / pp / pp)  # 1/pp layers, 64/pp sequences
    return (64 / pp) / stage_ms * 1e3


def pp_batch1_ms(m, pp, p2p_us=10.0):
    """Batch 1 through pp stages: the same layers in sequence plus pp - 1 hand-offs."""
    return m["batch1_ms"] + (pp - 1) * p2p_us / 1e3


def shard_overlap(m=MEASURED, shards=SHARDS, batch=1):
    """f: the measured TP = 1 token (batch 1) or step (batch 64) over its kernels timed alone."""
    k = shards[1]
    if batch == 1:
        return m["batch1_ms"] * 1e3 / (m["layers"] * (k["gemm_m1"] + k["attn_b1"]) + k["head_m1"])
    return m["batch64_ms"] * 1e3 / (m["layers"] * (k["gemm_m64"] + k["attn_b64"]) + k["head_m64"])


def shard_batch1_ms(m, tp, ar, shards=SHARDS):
    """Batch-1 ms/token at TP = tp from the shard-shape kernel times (ar: an 8 KB all-reduce)."""
    k, f = shards[tp], shard_overlap(m, shards, 1)
    ar = ar if tp > 1 else 0.0
    return (m["layers"] * (f * (k["gemm_m1"] + k["attn_b1"]) + 2 * ar) + f * k["head_m1"] + ar) / 1e3


def shard_batch64_tps(m, tp, ar, shards=SHARDS):
    """Batch-64 tokens/s at TP = tp from the shard-shape kernel times (ar: a 512 KB all-reduce)."""
    k, f = shards[tp], shard_overlap(m, shards, 64)
    ar = ar if tp > 1 else 0.0
    step_us = (m["layers"] * (f * (k["gemm_m64"] + k["attn_b64"]) + 2 * ar) + f * k["head_m64"] +
               ar)
    return 64 / step_us * 1e6


def shard_table(m=MEASURED, shards=SHARDS):
    rows = []
    base1, base64 = m["batch1_ms"], 64 / m["batch64_ms"] * 1e3
    for tp in (1, 2, 4, 8):
        for impl in (("-",) if tp == 1 else ("custom", "vllm")):
            hidden_bytes = 2 * m["hidden"]
            b1 = shard_batch1_ms(m, tp, ar_us(impl, tp, hidden_bytes) if tp > 1 else 0.0, shards)
            b64 = shard_batch64_tps(m, tp, ar_us(impl, tp, 64 * hidden_bytes) if tp > 1 else 0.0,
                                    shards)
            rows.append({"config": f"tp{tp}", "all_reduce": impl, "batch1_ms": b1,
                         "batch1_speedup": base1 / b1, "batch64_tokens_per_s": b64,
                         "batch64_speedup": b64 / base64})
    return rows


def table(m=MEASURED):
    rows = []
    base1, base64 = m["batch1_ms"], 64 / m["batch64_ms"] * 1e3
    rows.append({"config": "tp1", "all_reduce": "-", "batch1_ms": base1, "batch1_speedup": 1.0,
                 "batch64_tokens_per_s": base64, "batch64_speedup": 1.0})
    for impl in ("custom", "vllm"):
        for tp in (2, 4, 8):
            hidden_bytes = 2 * m["hidden"]
            b1 = batch1_ms(m, tp, ar_us(impl, tp, hidden_bytes))
            b64 = batch64_tps(m, tp, ar_us(impl, tp, 64 * hidden_bytes))
            rows.append({"config": f"tp{tp}", "all_reduce": impl, "batch1_ms": b1,
                         "batch1_speedup": base1 / b1, "batch64_tokens_per_s": b64,
                         "batch64_speedup": b64 / base64})
    for pp in (2, 4):
        b1 = pp_batch1_ms(m, pp)
        b64 = pp_batch64_tps(m, pp)
        rows.append({"config": f"pp{pp}", "all_reduce": "-", "batch1_ms": b1,
                     "batch1_speedup": base1 / b1, "batch64_tokens_per_s": b64,
                     "batch64_speedup": b64 / base64})
    return rows


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object")
    ap.add_argument("--shards", action="store_true",
                    help="the shard model (kernel times at each TP's shard shapes)")
    a = ap.parse_args(argv)
    rows = shard_table() if a.shards else table()
    if a.json:
        print(json.dumps({"measured": MEASURED, "fixed_layer_us": fixed_layer_us(MEASURED),
                          "layer_weight_us": layer_weight_us(MEASURED), "shards": SHARDS,
                          "overlap_batch1": shard_overlap(MEASURED, SHARDS, 1),
                          "overlap_batch64": shard_overlap(MEASURED, SHARDS, 64),
                          "rows": rows}))
        return 0
    if a.shards:
        print(f"shard model: measured TP=1 token / its kernels timed alone: batch 1 "
              f"{shard_overlap(MEASURED, SHARDS, 1):.3f}, batch 64 "
              f"{shard_overlap(MEASURED, SHARDS, 64):.3f}")
    else:
        print(f"per layer at TP=1: weights {layer_weight_us(MEASURED):.1f} us, "
              f"non-weight {fixed_layer_us(MEASURED):.1f} us")
    print("| config | all-reduce | batch 1 ms/token | speedup | batch 64 tokens/s | speedup |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['config']} | {r['all_reduce']} | {r['batch1_ms']:.3f} | "
              f"{r['batch1_speedup']:.2f}x | {r['batch64_tokens_per_s']:.0f} | "
              f"{r['batch64_speedup']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
