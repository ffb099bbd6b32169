#!/usr/bin/env python3
"""Hugging Face reference for the tokenizer conformance test, and HF encode throughput.

Runs where Python `tokenizers` (and optionally `transformers`) are installed (the GPU machine):

  python3 tools/hf_tokenizer_reference.py --corpus tests/tokenizer_conformance/corpus.json \
      --tokenizer llama3=DIR ... --out OUT_DIR [--bench-text FILE --bench-seconds 3]

For each tokenizer DIR (holding tokenizer.json and maybe tokenizer_config.json) writes
OUT_DIR/hf_<name>.json: {"tokenizer", "source": "hf", versions, "cases": [{"name", "ids",
"ids_special", "ids_special_tokenizers", "decoded", "decoded_skip"}]} where
  ids                    = tokenizers.Tokenizer.encode(text, add_special_tokens=False).ids
  ids_special_tokenizers = tokenizers.Tokenizer.encode(text, add_special_tokens=True).ids
  ids_special            = transformers.AutoTokenizer(text, add_special_tokens=True) input_ids
                           (applies tokenizer_config.json add_bos_token / add_eos_token), or
                           ids_special_tokenizers when transformers is unavailable
  decoded / decoded_skip = tokenizers.Tokenizer.decode(ids, skip_special_tokens=False/True)
Corpus cases with "hex" (invalid UTF-8) are encoded as bytes.decode("utf-8", "replace"), the
lossy text tpserve encodes for such input.

With --bench-text: single-thread encode throughput (MB/s) on that UTF-8 file, cut into chunks of
at most 8 KiB at line ends exactly like tests/coordinator/tokenizer_bench.cc; "cold" = first pass
with a fresh tokenizer, "warm" = best later pass. Writes OUT_DIR/hf_bench.json too.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tokenizers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402


def case_text(c):
    if "hex" in c:
        return bytes.fromhex(c["hex"]).decode("utf-8", "replace")
    return c["text"] * c.get("repeat", 1)


def chunks(data: bytes, max_chunk=8192):
    out = []
    start = 0
    n = len(data)
    while start < n:
        end = min(n, start + max_chunk)
        if end < n:
            nl = data.rfind(b"\n", start, end)
            if nl != -1:
                end = nl + 1
        out.append(data[start:end].decode("utf-8"))
        start = end
    return out


def reference(name, path, corpus, out_dir):
    tk = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    auto = None
    tf_version = None
    try:
        import transformers
        from transformers import AutoTokenizer

        tf_version = transformers.__version__
        auto = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers missing or cannot load: tokenizers only
        print(f"{name}: transformers unavailable ({e!r}); ids_special from tokenizers",
              file=sys.stderr)
    cases = []
    for c in corpus["cases"]:
        text = case_text(c)
        ids = tk.encode(text, add_special_tokens=False).ids
        ids_sp_tk = tk.encode(text, add_special_tokens=True).ids
        ids_sp = ids_sp_tk
        extra = {}
        if auto is not None:
            ids_sp = list(auto(text, add_special_tokens=True)["input_ids"])
            ids_tf = list(auto(text, add_special_tokens=False)["input_ids"])
            if ids_tf != ids:
                print(f"{name}/{c['name']}: transformers (no specials) differs from tokenizers",
                      file=sys.stderr)
                extra["ids_transformers"] = ids_tf
        cases.append({
            "name": c["name"],
            "ids": ids,
            "ids_special": ids_sp,
            "ids_special_tokenizers": ids_sp_tk,
            **extra,
            "decoded": tk.decode(ids, skip_special_tokens=False),
            "decoded_skip": tk.decode(ids, skip_special_tokens=True),
        })
    out = {"tokenizer": name, "source": "hf", "tokenizers_version": tokenizers.__version__,
           "transformers_version": tf_version, "cases": cases}
    with open(os.path.join(out_dir, f"hf_{name}.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
    print(f"wrote hf_{name}.json ({len(cases)} cases)")


def bench(name, path, text_chunks, total_bytes, seconds):
    tk = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    mb = total_bytes / 1e6

    def one_pass():
        n = 0
        t0 = time.perf_counter()
        for ch in text_chunks:
            n += len(tk.encode(ch, add_special_tokens=False).ids)
        return time.perf_counter() - t0, n

    cold, n_tokens = one_pass()
    best, total, passes = 1e30, 0.0, 0
    while total < seconds or passes < 2:
        t, _ = one_pass()
        best = min(best, t)
        total += t
        passes += 1
    r = {"tokenizer": name, "tokens": n_tokens, "cold_mb_s": mb / cold, "warm_mb_s": mb / best,
         "passes": passes}
    print(f"hf      {name:<12} tokens={n_tokens} cold={mb / cold:.2f} MB/s "
          f"warm={mb / best:.2f} MB/s ({passes} passes)")
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokenizer", action="append", required=True, help="NAME=DIR")
    ap.add_argument("--out", required=True)
    ap.add_argument("--bench-text")
    ap.add_argument("--bench-seconds", type=float, default=3.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(args.corpus, encoding="utf-8") as f:
        corpus = json.load(f)
    toks = []
    for t in args.tokenizer:
        name, _, path = t.partition("=")
        if not os.path.exists(os.path.join(path, "tokenizer.json")):
            print(f"skip {name}: no tokenizer.json in {path}", file=sys.stderr)
            continue
        toks.append((name, path))
    print(f"tokenizers {tokenizers.__version__}")
    for name, path in toks:
        reference(name, path, corpus, args.out)
    if args.bench_text:
        with open(args.bench_text, "rb") as f:
            data = f.read()
        text_chunks = chunks(data)
        print(f"bench text: {args.bench_text}, {len(data)} bytes, {len(text_chunks)} chunks")
        results = [bench(n, p, text_chunks, len(data), args.bench_seconds) for n, p in toks]
        with open(os.path.join(args.out, "hf_bench.json"), "w") as f:
            json.dump({"text_bytes": len(data), "chunks": len(text_chunks),
                       "tokenizers_version": tokenizers.__version__, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
