#!/usr/bin/env python3
"""Hugging Face transformers baselines for the benchmarks (run on the GPU machine).

Scenario of the well-known DeepSeek-Coder bf16 guide: batch 1, a prompt of --prompt-len tokens,
--new-tokens greedy tokens. Modes:
  eager-bf16     transformers eager, bf16 weights
  eager-fp32     transformers eager, fp32 weights (TF32 off)
  compile-bf16   bf16 with a static KV cache and torch.compile(mode="reduce-overhead") on the
                 decode step (what transformers documents for fast generation)
For each mode: time to first token (prefill), median ms per decode token (CUDA events around
each decode step, after warm-up), end-to-end seconds and peak GPU memory. Prints one JSON line
per mode and writes them all to --out.

Example: python3 tools/hf_bench.py --model /tmp/ds67 --modes eager-bf16,compile-bf16 --out hf.json
"""

import argparse
import json
import statistics
import time


def bench_mode(model_dir, mode, prompt_len, new_tokens, seed):
    import torch
    from transformers import AutoModelForCausalLM, StaticCache

    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = torch.float32 if mode == "eager-fp32" else torch.bfloat16
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model = model.to("cuda").eval()
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, prompt_len), generator=g).to("cuda")
    torch.cuda.reset_peak_memory_stats()

    def run_once(record):
        ev = lambda: torch.cuda.Event(enable_timing=True)
        with torch.no_grad():
            if mode == "compile-bf16":
                cache = StaticCache(config=model.config, max_batch_size=1,
                                    max_cache_len=prompt_len + new_tokens + 8,
                                    device="cuda", dtype=dtype)
            else:
                cache = None
            start = time.perf_counter()
            s, e = ev(), ev()
            s.record()
            pos = torch.arange(prompt_len, device="cuda")
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=pos)
            e.record()
            torch.cuda.synchronize()
            ttft_ms = s.elapsed_time(e)
            past = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
            step_ms = []
            step = decode_step if mode == "compile-bf16" else plain_step
            for i in range(new_tokens - 1):
                s, e = ev(), ev()
                s.record()
                cp = torch.tensor([prompt_len + i], device="cuda")
                logits = step(tok, past, cp)
                tok = logits[:, -1:].argmax(-1)
                e.record()
                e.synchronize()
                step_ms.append(s.elapsed_time(e))
            torch.cuda.synchronize()
            total_s = time.perf_counter() - start
        return ttft_ms, step_ms, total_s

    def plain_step(tok, past, cp):
        return model(input_ids=tok, past_key_values=past, use_cache=True, cache_position=cp).logits

    compiled = None
    if mode == "compile-bf16":
        compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def decode_step(tok, past, cp):
        out = compiled(input_ids=tok, past_key_values=past, use_cache=True, cache_position=cp)
        return out.logits.clone()

    run_once(False)  # warm-up (and compilation)
    ttft_ms, step_ms, total_s = run_once(True)
    result = {
        "system": "hf-transformers", "mode": mode, "prompt_len": prompt_len,
        "new_tokens": new_tokens, "load_s": round(load_s, 2), "ttft_ms": round(ttft_ms, 2),
        "decode_ms_per_token_median": round(statistics.median(step_ms), 3),
        "decode_ms_per_token_mean": round(statistics.mean(step_ms), 3),
        "e2e_s": round(total_s, 3),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    del model
    torch.cuda.empty_cache()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--modes", default="eager-bf16,eager-fp32,compile-bf16")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    for mode in args.modes.split(","):
        try:
            r = bench_mode(args.model, mode, args.prompt_len, args.new_tokens, args.seed)
        except Exception as e:  # report and go on with the other modes
            r = {"system": "hf-transformers", "mode": mode, "error": repr(e)[:500]}
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
