#!/usr/bin/env python3
"""Writes tests/data/tiny_coder_golden.{safetensors,json}: HF transformers fp32 reference logits.

For each prompt (tokenized by the model's tokenizer.json, with BOS), stores the prefill logits,
the logits of the first 8 greedy decode steps over the KV cache and the 32-token greedy
continuation, computed by transformers in fp32 with eager attention on the CPU. Also checks the
greedy tokens against model.generate(do_sample=False), recomputes everything on the GPU in fp32
(TF32 off) when one is present and reports the difference, and records the top-2 logit gap of
each greedy choice so near-ties are visible.

Tensors, for prompt N:
  pN.prompt_ids         int32 [L]
  pN.prefill_positions  int32 [K]      prompt positions whose logits are stored (usually 0..L-1)
  pN.prefill_logits     f32   [K, V]
  pN.decode_ids         int32 [8]      tokens fed to the decode steps (the first 8 greedy tokens)
  pN.decode_logits      f32   [8, V]   logits after feeding decode_ids[i] at position L + i
  pN.greedy_ids         int32 [32]     greedy continuation (greedy_ids[0] = argmax of prefill)

Usage: python3 tools/make_golden.py --model models/tiny-coder --out-dir tests/data
"""

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_reference  # noqa: E402

PROMPTS = [
    "def quick_sort(arr):",
    "import os\n",
    "class Stack:\n    def __init__(self):",
    ('import json\nfrom collections import defaultdict\n\n\n'
     'def load_counts(path):\n'
     '    """Return a mapping from each word to the number of times it appears."""\n'
     '    counts = defaultdict(int)\n'
     '    with open(path, encoding="utf-8") as f:\n'
     '        for line in f:\n'
     '            for word in line.split():\n'
     '                counts[word.lower()] += 1\n'
     '    return dict(counts)\n\n\n'
     'def top_words(counts, n=10):\n'),
]
DECODE_STEPS = 8
GREEDY_TOKENS = 32
MAX_PREFILL_ROWS = 150  # keeps the file under ~3 MB for a 4096-token vocabulary


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/tiny-coder")
    p.add_argument("--out-dir", default="tests/data")
    p.add_argument("--name", default="tiny_coder_golden")
    args = p.parse_args()

    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    torch.manual_seed(0)
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    try:
        from transformers import AutoTokenizer
        hf_tok = AutoTokenizer.from_pretrained(args.model)
    except Exception as e:  # informative only
        print("AutoTokenizer failed: %r" % e)
        hf_tok = None

    model = hf_reference.load_model(args.model, "fp32", "cpu", "eager")
    cfg = model.config
    with open(os.path.join(args.model, "generation_config.json")) as f:
        eos_id = json.load(f)["eos_token_id"]

    encoded = [tok.encode(t).ids for t in PROMPTS]
    n_short = sum(len(ids) for ids in encoded[:-1])
    tensors = {}
    prompts_json = []
    for n, (text, ids) in enumerate(zip(PROMPTS, encoded)):
        if hf_tok is not None:
            hf_ids = hf_tok(text)["input_ids"]
            if hf_ids != ids:
                print("WARNING: AutoTokenizer ids differ for prompt %d: %s vs %s" %
                      (n, hf_ids, ids))
        ref = hf_reference.greedy_reference(model, ids, GREEDY_TOKENS)
        L = len(ids)
        if n == len(PROMPTS) - 1 and n_short + L > MAX_PREFILL_ROWS:
            keep = max(8, MAX_PREFILL_ROWS - n_short)
            positions = list(range(L - keep, L))
        else:
            positions = list(range(L))
        greedy = ref["greedy_ids"].tolist()

        # model.generate must agree (it stops early only at EOS).
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=GREEDY_TOKENS,
                                 pad_token_id=eos_id)[0, L:].tolist()
        gen_ok = gen == greedy[:len(gen)] and (len(gen) == GREEDY_TOKENS or gen[-1] == eos_id)
        # Greedy choice gaps: the last prefill row chooses greedy[0], decode row i greedy[i+1].
        choice_rows = torch.cat([ref["prefill_logits"][-1:], ref["decode_logits"][:-1]])
        gaps = hf_reference.top2_gaps(choice_rows)
        decode_gaps = hf_reference.top2_gaps(ref["decode_logits"][:DECODE_STEPS])

        key = "p%d." % n
        tensors[key + "prompt_ids"] = torch.tensor(ids, dtype=torch.int32)
        tensors[key + "prefill_positions"] = torch.tensor(positions, dtype=torch.int32)
        tensors[key + "prefill_logits"] = ref["prefill_logits"][positions].contiguous()
        tensors[key + "decode_ids"] = ref["decode_ids"][:DECODE_STEPS].contiguous()
        tensors[key + "decode_logits"] = ref["decode_logits"][:DECODE_STEPS].contiguous()
        tensors[key + "greedy_ids"] = ref["greedy_ids"].contiguous()
        prompts_json.append({
            "name": "p%d" % n,
            "text": text,
            "prompt_ids": ids,
            "prefill_positions": [positions[0], positions[-1] + 1],
            "greedy_ids": greedy,
            "greedy_text": tok.decode(greedy, skip_special_tokens=False),
            "greedy_top2_gap": [round(g, 6) for g in gaps],
            "min_greedy_top2_gap": round(min(gaps), 6),
            "decode_top2_gap": [round(g, 6) for g in decode_gaps],
            "generate_matches": gen_ok,
            "generate_ids": gen,
        })
        print("p%d: %d prompt tokens, greedy %s, min gap %.4f, generate matches: %s" %
              (n, L, greedy, min(gaps), gen_ok))
        print("    continuation: %r" % tok.decode(greedy))
        if not gen_ok:
            print("ERROR: greedy loop and model.generate disagree for p%d: %s" % (n, gen))

    # Cross-check on the GPU in fp32 (TF32 off): how far apart two fp32 implementations land.
    gpu_check = None
    if torch.cuda.is_available():
        gm = hf_reference.load_model(args.model, "fp32", "cuda", "eager")
        worst = 0.0
        same_greedy = True
        for n, ids in enumerate(encoded):
            r = hf_reference.greedy_reference(gm, ids, GREEDY_TOKENS)
            for name in ("prefill_logits", "decode_logits"):
                a = tensors["p%d.%s" % (n, name)]
                if name == "prefill_logits":
                    b = r[name][tensors["p%d.prefill_positions" % n].long()]
                else:
                    b = r[name][:DECODE_STEPS]
                rel = ((a - b).abs().max() / a.abs().max()).item()
                worst = max(worst, rel)
            same_greedy &= r["greedy_ids"].tolist() == tensors["p%d.greedy_ids" % n].tolist()
        gpu_check = {"max_rel_err_vs_cpu": worst, "same_greedy": same_greedy}
        print("GPU fp32 vs CPU fp32: max |diff| / max |logit| = %.3g, same greedy: %s" %
              (worst, same_greedy))

    os.makedirs(args.out_dir, exist_ok=True)
    st_path = os.path.join(args.out_dir, args.name + ".safetensors")
    save_file(tensors, st_path, metadata={"format": "pt", "source": "tools/make_golden.py"})
    import transformers
    doc = {
        "description": "HF transformers fp32 (eager attention, CPU) reference for "
                       "models/tiny-coder",
        "generated_by": "tools/make_golden.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model_safetensors_sha256": sha256(os.path.join(args.model, "model.safetensors")),
        "tokenizer_json_sha256": sha256(os.path.join(args.model, "tokenizer.json")),
        "vocab_size": cfg.vocab_size,
        "bos_token_id": tok.token_to_id("<｜begin▁of▁sentence｜>"),
        "eos_token_id": eos_id,
        "decode_steps": DECODE_STEPS,
        "greedy_tokens": GREEDY_TOKENS,
        "tensors": {
            "pN.prompt_ids": "int32 [L], tokenizer.json encoding of text, BOS first",
            "pN.prefill_positions": "int32 [K], prompt positions whose logits are stored",
            "pN.prefill_logits": "f32 [K, V], logits at those positions after one prefill",
            "pN.decode_ids": "int32 [8], tokens fed to decode steps 0..7 (= greedy_ids[:8])",
            "pN.decode_logits": "f32 [8, V], logits after feeding decode_ids[i] at position L+i",
            "pN.greedy_ids": "int32 [32], greedy continuation; greedy_ids[0] = argmax of the "
                             "last prefill row, greedy_ids[i+1] = argmax of the decode row i",
        },
        "greedy_top2_gap": "top-1 minus top-2 logit of the row that chose each greedy token",
        "gpu_fp32_check": gpu_check,
        "prompts": prompts_json,
    }
    js_path = os.path.join(args.out_dir, args.name + ".json")
    with open(js_path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("wrote %s (%d bytes) and %s (%d bytes)" % (st_path, os.path.getsize(st_path), js_path,
                                                     os.path.getsize(js_path)))
    if not all(pj["generate_matches"] for pj in prompts_json):
        sys.exit(1)


if __name__ == "__main__":
    main()
