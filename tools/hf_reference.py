#!/usr/bin/env python3
"""Reference logits from Hugging Face transformers for any LLaMA-family model directory.

Runs the prompt through the model once (prefill), then N greedy decode steps over the KV cache,
and writes a safetensors file:
  prompt_ids      int32 [L]
  prefill_logits  f32   [V]      logits at the last prompt position (all positions [L, V]
                                 with --all-prefill)
  greedy_ids      int32 [N]      greedy tokens after the prompt; greedy_ids[0] = argmax(prefill)
  decode_ids      int32 [N]      tokens fed to the N decode steps (= greedy_ids)
  decode_logits   f32   [N, V]   decode_logits[i]: logits after feeding greedy_ids[i] at
                                 position L + i, so argmax(decode_logits[i]) = greedy_ids[i + 1]
With --force-ids A,B,...: teacher forcing. The decode steps feed these ids (decode_ids = them,
N = their count) instead of the model's own choices; greedy_ids still holds each row's argmax.
Used to score a bf16 run on the continuation an fp32 run chose, so the two compare row by row.

Example (on the GPU machine):
  python3 tools/hf_reference.py --model DIR --prompt-ids 1,2,3 --steps 8 --dtype bf16 \
      --device cuda --out ref.safetensors
fp32 runs use eager attention and disable TF32, so results are plain fp32 math.
"""

import argparse
import json
import sys
import time


def setup_fp32_determinism(torch):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        torch.set_float32_matmul_precision("highest")
    except Exception:  # older torch
        pass


def load_model(model_dir, dtype="fp32", device="cpu", attn="eager"):
    import torch
    from transformers import AutoModelForCausalLM

    setup_fp32_determinism(torch)
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype, attn_implementation=attn)
    model = model.to(device)
    model.eval()
    return model


def greedy_reference(model, prompt_ids, steps, force_ids=None):
    """Prefill + `steps` greedy decode steps with the KV cache (feeding `force_ids` instead of
    the argmax when given). Returns float32 CPU tensors."""
    import torch

    dev = next(model.parameters()).device
    with torch.no_grad():
        x = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
        out = model(input_ids=x, use_cache=True)
        prefill = out.logits[0].float().cpu()  # [L, V]
        past = out.past_key_values
        nxt = int(torch.argmax(prefill[-1]))
        greedy, fed, dec_logits = [], [], []
        for i in range(steps):
            greedy.append(nxt)
            feed = nxt if force_ids is None else force_ids[i]
            fed.append(feed)
            out = model(input_ids=torch.tensor([[feed]], device=dev), past_key_values=past,
                        use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float().cpu()
            dec_logits.append(logits)
            nxt = int(torch.argmax(logits))
    dec = torch.stack(dec_logits) if dec_logits else torch.zeros(0, prefill.shape[-1])
    return {
        "prompt_ids": torch.tensor(list(prompt_ids), dtype=torch.int32),
        "prefill_logits": prefill,
        "greedy_ids": torch.tensor(greedy, dtype=torch.int32),
        "decode_ids": torch.tensor(fed, dtype=torch.int32),
        "decode_logits": dec,
    }


def top2_gaps(logits_rows):
    """Top-1 minus top-2 logit for each row (how close greedy is to a tie)."""
    import torch

    top = torch.topk(logits_rows.float(), 2, dim=-1).values
    return (top[..., 0] - top[..., 1]).tolist()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--steps", type=int, default=8, help="greedy decode steps")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--device", default="cpu", help="cpu or cuda (or cuda:N)")
    p.add_argument("--attn", default="eager", help="attention implementation (eager, sdpa)")
    p.add_argument("--force-ids", default="",
                   help="comma-separated ids fed to the decode steps (teacher forcing); "
                        "sets --steps to their count")
    p.add_argument("--all-prefill", action="store_true",
                   help="store the logits of every prompt position, not only the last")
    p.add_argument("--out", required=True, help="output .safetensors file")
    args = p.parse_args()

    import torch
    from safetensors.torch import save_file

    try:
        ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError:
        sys.exit("--prompt-ids: expected comma-separated integers, got %r" % args.prompt_ids)
    if not ids:
        sys.exit("--prompt-ids: empty")
    force = None
    if args.force_ids:
        try:
            force = [int(t) for t in args.force_ids.split(",") if t.strip()]
        except ValueError:
            sys.exit("--force-ids: expected comma-separated integers, got %r" % args.force_ids)
        args.steps = len(force)
    t0 = time.time()
    model = load_model(args.model, args.dtype, args.device, args.attn)
    vocab = model.config.vocab_size
    bad = [i for i in ids + (force or []) if i < 0 or i >= vocab]
    if bad:
        sys.exit("--prompt-ids/--force-ids: ids %s outside the vocabulary [0, %d)"
                 % (bad[:5], vocab))
    t1 = time.time()
    ref = greedy_reference(model, ids, args.steps, force)
    t2 = time.time()
    tensors = dict(ref)
    if not args.all_prefill:
        tensors["prefill_logits"] = ref["prefill_logits"][-1].contiguous()
    meta = {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "attn": args.attn,
        "steps": str(args.steps),
        "top2_gaps": json.dumps([round(g, 6) for g in
                                 top2_gaps(torch.cat([ref["prefill_logits"][-1:],
                                                      ref["decode_logits"]]))]),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, args.out, metadata=meta)
    print(json.dumps({"out": args.out, "greedy_ids": ref["greedy_ids"].tolist(),
                      "load_s": round(t1 - t0, 2), "run_s": round(t2 - t1, 2)}))


if __name__ == "__main__":
    main()
