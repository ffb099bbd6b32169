#!/usr/bin/env python3
"""The presets of `tpserve bench` run against Hugging Face transformers (the peer column of a
report), writing JSON with the same fields as `tpserve bench --json` (backend "hf-<mode>").

Presets (as in tools/bench/workload.cc):
  latency   batch 1: 512-token prompt, 512 new tokens, one request after the other
  batch32   static batches of 32 prompts (512 -> 512): transformers has no continuous batching,
            so the peer of 32 concurrent clients is generate() on 32 prompts at once
  batch64   the same with 64
  chat      16 conversations of 4 turns, 8 at a time (one batch of 8 per turn, in lockstep):
            each turn resends the whole history (previous prompt + previous output + a new
            128-token user turn) with no cache reuse across turns; 256-token first prompt,
            128 new tokens per turn
Modes:
  eager-bf16     transformers eager, bf16, dynamic KV cache
  compile-bf16   bf16, static KV cache, decode step under torch.compile(mode="reduce-overhead")
Decoding is greedy with EOS ignored (every request makes exactly its new tokens). Prompts are
random token ids from a seeded generator. Each decode step is timed on the host after a CUDA
synchronize, so a request's TTFT is its batch's prefill (+ first sampled token) and its
inter-token latencies are the batch's decode steps; all requests of a batch share them.

Usage (GPU machine):
  python3 tools/scaling/hf_peers.py --model /tmp/ds67 --modes eager-bf16,compile-bf16 \
      --presets latency,batch32,batch64,chat --out hf-out
  then: python3 tools/scaling/run_scaling.py ... --peers 'hf-out/*.json'
Options --num-requests (rounded up to whole batches: 1 gives 1 latency request, one batch of 32,
one of 64) and --num-conversations (a multiple of 8 keeps the chat batches full) shorten the
presets for a time budget.
"""

import argparse
import json
import math
import os
import sys
import time

PRESETS = {
    "latency": dict(prompt_len=512, output_len=512, batch=1, num_requests=10),
    "batch32": dict(prompt_len=512, output_len=512, batch=32, num_requests=64),
    "batch64": dict(prompt_len=512, output_len=512, batch=64, num_requests=128),
    "chat": dict(prompt_len=256, output_len=128, batch=8, turns=4, conversations=16,
                 user_turn_len=128),
}


def percentile(sorted_values, q):
    """Linear interpolation between closest ranks (numpy's default; tools/bench/stats.cc)."""
    if not sorted_values:
        return 0.0
    rank = q / 100.0 * (len(sorted_values) - 1)
    lo = int(math.floor(rank))
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def summarize(values):
    v = sorted(values)
    if not v:
        return dict(count=0, mean=0.0, median=0.0, p90=0.0, p99=0.0, min=0.0, max=0.0)
    return dict(count=len(v), mean=sum(v) / len(v), median=percentile(v, 50),
                p90=percentile(v, 90), p99=percentile(v, 99), min=v[0], max=v[-1])


def report(mode, preset, model_dir, spec, records, duration_s, args):
    """`tpserve bench --json` fields from per-request records:
    dict(prompt_tokens, output_tokens, ttft_s, e2e_s, itl_s=[...])."""
    ttft = [r["ttft_s"] * 1e3 for r in records]
    tpot = [(r["e2e_s"] - r["ttft_s"]) * 1e3 / (r["output_tokens"] - 1)
            for r in records if r["output_tokens"] > 1]
    itl = [g * 1e3 for r in records for g in r["itl_s"]]
    e2e = [r["e2e_s"] * 1e3 for r in records]
    inp = sum(r["prompt_tokens"] for r in records)
    out = sum(r["output_tokens"] for r in records)
    chat = "turns" in spec
    return {
        "tool": "hf_peers.py",
        "backend": f"hf-{mode}",
        "label": preset,
        "preset": preset,
        "server": "in-process",
        "model": os.path.basename(os.path.normpath(model_dir)),
        "tp": 1, "pp": 1, "world_size": 1, "rank_devices": ["cuda:0"],
        "config": {
            "mode": "static-batch", "concurrency": spec["batch"], "request_rate": None,
            "num_requests": len(records), "prompt_len": str(spec["prompt_len"]),
            "output_len": str(spec["output_len"]), "turns": spec.get("turns", 0),
            "num_conversations": spec.get("conversations", 0) if chat else 0,
            "user_turn_len": str(spec["user_turn_len"]) if chat else None,
            "prompt_kind": "ids", "stream": True, "ignore_eos": True, "seed": args.seed,
            "warmup": 1, "sampling": {},
        },
        "num_requests": len(records), "completed": len(records), "failed": 0, "errors": {},
        "output_length_mismatches": 0,
        "duration_s": duration_s,
        "total_input_tokens": inp, "total_output_tokens": out,
        "request_throughput": len(records) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": out / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (inp + out) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": summarize(ttft), "tpot_ms": summarize(tpot), "itl_ms": summarize(itl),
        "e2e_ms": summarize(e2e), "server_ttft_ms": summarize([]),
    }


class Generator:
    """Greedy decoding of a batch of equal-length prompts with per-step host timestamps."""

    def __init__(self, model_dir, mode):
        import torch
        from transformers import AutoModelForCausalLM
        self.torch = torch
        self.mode = mode
        torch.backends.cuda.matmul.allow_tf32 = False
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").to("cuda").eval()
        self.vocab = self.model.config.vocab_size
        self.compiled = None
        if mode == "compile-bf16":
            self.compiled = torch.compile(self.model.forward, mode="reduce-overhead",
                                          fullgraph=True)
        elif mode != "eager-bf16":
            raise ValueError(f"unknown mode {mode}")

    def generate(self, ids, new_tokens, cache_len):
        """ids: LongTensor [B, L] on cuda. Returns (output ids [B, new_tokens], times) with
        times = host seconds after the prefill token and after each decode step, from start.
        cache_len: the static cache's length, the same for all calls of a preset so that the
        compiled decode step is not recompiled for every history length."""
        torch = self.torch
        batch, length = ids.shape
        cache = None
        if self.compiled is not None:
            from transformers import StaticCache
            size = max(cache_len, length + new_tokens)
            try:
                cache = StaticCache(config=self.model.config, max_batch_size=batch,
                                    max_cache_len=size, device="cuda", dtype=torch.bfloat16)
            except TypeError:  # newer transformers: batch, device and dtype come lazily
                cache = StaticCache(config=self.model.config, max_cache_len=size)
        times, outs = [], []
        with torch.no_grad():
            torch.cuda.synchronize()
            start = time.perf_counter()
            pos = torch.arange(length, device="cuda")
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                             cache_position=pos)
            past = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
            outs.append(tok)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            for i in range(new_tokens - 1):
                cp = torch.tensor([length + i], device="cuda")
                if self.compiled is not None:
                    logits = self.compiled(input_ids=tok, past_key_values=past, use_cache=True,
                                           cache_position=cp).logits.clone()
                else:
                    o = self.model(input_ids=tok, past_key_values=past, use_cache=True,
                                   cache_position=cp)
                    logits, past = o.logits, o.past_key_values
                tok = logits[:, -1:].argmax(-1)
                outs.append(tok)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        return torch.cat(outs, dim=1), times

    def random_ids(self, gen, batch, length):
        return self.torch.randint(0, self.vocab, (batch, length), generator=gen).to("cuda")


def batch_records(ids_len, times):
    ttft = times[0]
    itl = [b - a for a, b in zip(times, times[1:])]
    return dict(prompt_tokens=ids_len, output_tokens=len(times), ttft_s=ttft, e2e_s=times[-1],
                itl_s=itl)


def cache_len(spec):
    """Tokens of the longest sequence of a preset (a chat's last turn)."""
    if "turns" in spec:
        return (spec["prompt_len"] + spec["turns"] * spec["output_len"] +
                (spec["turns"] - 1) * spec["user_turn_len"])
    return spec["prompt_len"] + spec["output_len"]


def run_preset(g, preset, spec, args):
    torch = g.torch
    L = cache_len(spec)
    gen = torch.Generator().manual_seed(args.seed)
    records = []
    if "turns" in spec:
        conversations = args.num_conversations or spec["conversations"]
        b = spec["batch"]
        # Warm-up at the largest shape (and compilation).
        g.generate(g.random_ids(gen, b, spec["prompt_len"]), 4, L)
        t0 = time.perf_counter()
        for first in range(0, conversations, b):
            n = min(b, conversations - first)
            history = g.random_ids(gen, n, spec["prompt_len"])
            for turn in range(spec["turns"]):
                if turn > 0:
                    history = torch.cat([history, g.random_ids(gen, n, spec["user_turn_len"])], 1)
                out, times = g.generate(history, spec["output_len"], L)
                records += [batch_records(history.shape[1], times) for _ in range(n)]
                history = torch.cat([history, out], 1)
        return records, time.perf_counter() - t0
    b = spec["batch"]
    # An override is rounded up to whole batches: a batch preset keeps its batch size.
    n_req = -(-args.num_requests // b) * b if args.num_requests else spec["num_requests"]
    g.generate(g.random_ids(gen, b, spec["prompt_len"]), 4, L)  # warm-up (and compilation)
    t0 = time.perf_counter()
    for first in range(0, n_req, b):
        n = min(b, n_req - first)
        _, times = g.generate(g.random_ids(gen, n, spec["prompt_len"]), spec["output_len"], L)
        records += [batch_records(spec["prompt_len"], times) for _ in range(n)]
    return records, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--modes", default="eager-bf16,compile-bf16")
    ap.add_argument("--presets", default="latency,batch32,batch64,chat")
    ap.add_argument("--num-requests", type=int, default=0,
                    help="override the presets' counts (rounded up to whole batches)")
    ap.add_argument("--num-conversations", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="hf-out")
    args = ap.parse_args()
    presets = args.presets.split(",")
    for p in presets:
        if p not in PRESETS:
            sys.exit(f"--presets: unknown preset '{p}' (one of {', '.join(PRESETS)})")
    os.makedirs(args.out, exist_ok=True)
    failed = 0
    for mode in args.modes.split(","):
        try:
            g = Generator(args.model, mode)
        except Exception as e:  # report and go on with the other modes
            print(json.dumps({"backend": f"hf-{mode}", "error": repr(e)[:500]}), flush=True)
            failed += 1
            continue
        for preset in presets:
            spec = PRESETS[preset]
            path = os.path.join(args.out, f"hf-{mode}-{preset}.json")
            try:
                records, duration = run_preset(g, preset, spec, args)
                result = report(mode, preset, args.model, spec, records, duration, args)
                result["peak_gpu_gib"] = round(g.torch.cuda.max_memory_allocated() / 2**30, 2)
            except Exception as e:
                result = {"backend": f"hf-{mode}", "preset": preset, "error": repr(e)[:500]}
                failed += 1
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
            brief = {k: result.get(k) for k in ("backend", "preset", "output_throughput",
                                                "request_throughput", "error")}
            if "ttft_ms" in result:
                brief["ttft_ms_median"] = result["ttft_ms"]["median"]
                brief["tpot_ms_median"] = result["tpot_ms"]["median"]
            print(json.dumps(brief), flush=True)
            g.torch.cuda.empty_cache()
        del g
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
