#!/usr/bin/env python3
"""Trains tpserve's bundled model, models/tiny-coder: corpus packing, tokenizer, LLaMA training.

Two sub-commands:
  pack   (any machine, standard library only): collects the Python standard library's sources,
         splits them deterministically into train / val / test by a hash of the relative path,
         and writes a small .tar.xz with one JSON-lines file per split.
  train  (GPU machine, torch + transformers + tokenizers): trains a byte-level BPE tokenizer
         whose pre-tokenizer and special tokens follow DeepSeek-Coder's tokenizer.json, then a
         small LlamaForCausalLM (GQA, linear RoPE scaling as in DeepSeek-Coder), and writes the
         model directory (config.json in the older rope_theta / rope_scaling form).

See tools/README-tiny-coder.md for the exact commands and the results.
"""

import argparse
import hashlib
import io
import json
import math
import os
import sys
import tarfile
import time

# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------

# Directories (relative to the stdlib root) that are not the standard library or not code.
EXCLUDED_DIRS = ("dist-packages", "site-packages", "pydoc_data", "__pycache__")
EXCLUDED_PREFIXES = ("_sysconfigdata",)


def split_of(relpath):
    """Deterministic split: sha1(relpath) mod 20 == 0 -> test, == 1 -> val, else train."""
    h = int(hashlib.sha1(relpath.encode("utf-8")).hexdigest(), 16) % 20
    if h == 0:
        return "test"
    if h == 1:
        return "val"
    return "train"


def collect(src):
    docs = []
    skipped = []
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)
            if name.startswith(EXCLUDED_PREFIXES):
                skipped.append((rel, "sysconfig data"))
                continue
            try:
                with open(path, "rb") as f:
                    text = f.read().decode("utf-8")
            except (UnicodeDecodeError, OSError) as e:
                skipped.append((rel, "not utf-8: %s" % type(e).__name__))
                continue
            # Generated charmap codec tables (encodings/cp1252.py etc.) are data, not code.
            if rel.startswith("encodings" + os.sep) and "decoding_table = (" in text:
                skipped.append((rel, "charmap table"))
                continue
            text = text.replace("\r\n", "\n")
            if not text.strip():
                continue
            docs.append({"path": rel, "text": text})
    return docs, skipped


def cmd_pack(args):
    docs, skipped = collect(args.src)
    splits = {"train": [], "val": [], "test": []}
    for d in docs:
        splits[split_of(d["path"])].append(d)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tarfile.open(args.out, "w:xz", preset=9) as tar:
        for name, items in splits.items():
            data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in items).encode("utf-8")
            info = tarfile.TarInfo(name + ".jsonl")
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
        meta = {
                "source": os.path.abspath(args.src),
                "python": sys.version.split()[0],
                "rule": "sha1(relative path) % 20: 0 -> test, 1 -> val, else train",
                "excluded_dirs": list(EXCLUDED_DIRS),
                "skipped": skipped,
                "counts": {k: len(v) for k, v in splits.items()},
                "bytes": {k: sum(len(d["text"].encode("utf-8")) for d in v)
                          for k, v in splits.items()},
                "test_files": [d["path"] for d in splits["test"]],
        }
        data = json.dumps(meta, indent=1).encode("utf-8")
        info = tarfile.TarInfo("meta.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    print(json.dumps({k: meta[k] for k in ("counts", "bytes")}))
    print("skipped %d files; wrote %s (%d bytes)" %
          (len(skipped), args.out, os.path.getsize(args.out)))


def load_corpus(path):
    out = {}
    with tarfile.open(path, "r:xz") as tar:
        for m in tar.getmembers():
            data = tar.extractfile(m).read().decode("utf-8")
            if m.name == "meta.json":
                out["meta"] = json.loads(data)
            else:
                out[m.name.split(".")[0]] = [json.loads(l) for l in data.split("\n") if l.strip()]
    return out


# ----------------------------------------------------------------------------------------------
# Tokenizer (DeepSeek-Coder style)
# ----------------------------------------------------------------------------------------------

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
# DeepSeek-Coder's added tokens, in its id order (32013..32021), with its `special` flags.
ADDED_TOKENS = [
    (BOS, True),
    (EOS, True),
    ("<｜fim▁hole｜>", False),
    ("<｜fim▁begin｜>", False),
    ("<｜fim▁end｜>", False),
    ("<pad>", False),
    ("<|User|>", False),
    ("<|Assistant|>", False),
    ("<|EOT|>", True),
]
# The pre-tokenizer of deepseek-ai/deepseek-coder-6.7b-instruct's tokenizer.json: four isolated
# regex splits (newline, letters with an optional leading space, punctuation with an optional
# leading space, CJK runs), then single digits, then byte-level mapping without its own regex.
CJK_REGEX = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
SPLIT_REGEXES = ["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", CJK_REGEX]
VOCAB_SIZE = 4096  # model vocabulary (tokenizer size rounded up, as DeepSeek's 32022 -> 32256)


def build_tokenizer(train_texts, bpe_vocab):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
              for r in SPLIT_REGEXES]
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(train_texts, trainer=trainer, length=len(train_texts))
    for content, special in ADDED_TOKENS:
        t = AddedToken(content, lstrip=False, rstrip=False, single_word=False,
                       normalized=not special, special=special)
        if special:
            tok.add_special_tokens([t])
        else:
            tok.add_tokens([t])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=BOS + ":0 $A:0",
        pair=BOS + ":0 $A:0 " + BOS + ":1 $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def write_tokenizer_config(out_dir, tok):
    def added(content):
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True,
                "rstrip": False, "single_word": False}

    cfg = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": added(BOS),
        "eos_token": added(EOS),
        "pad_token": added(EOS),
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 2048,
        "sp_model_kwargs": {},
        # The generic fast tokenizer loads tokenizer.json as is (DeepSeek names
        # LlamaTokenizerFast, which transformers 5 may rebuild with Llama's own pre-tokenizer).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(tok.token_to_id(c)): {"content": c, "lstrip": False, "normalized": not s,
                                      "rstrip": False, "single_word": False, "special": s}
            for c, s in ADDED_TOKENS
        },
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


def old_form_config(args, bos_id, eos_id):
    """config.json exactly in DeepSeek-Coder's (pre transformers 5) layout."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "hidden_size": args.hidden,
        "initializer_range": 0.02,
        "intermediate_size": args.intermediate,
        "max_position_embeddings": args.max_positions,
        "model_type": "llama",
        "num_attention_heads": args.heads,
        "num_hidden_layers": args.layers,
        "num_key_value_heads": args.kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"factor": 4.0, "type": "linear"},
        "rope_theta": 100000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


def check_rope(model, cfg):
    """The model's inverse frequencies must be DeepSeek's: theta^(-2i/d) / factor."""
    import torch
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    expect = 1.0 / (cfg["rope_theta"] ** exponent)
    expect = expect / cfg["rope_scaling"]["factor"]
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        print("WARNING: cannot inspect RoPE frequencies; rope_parameters %s" %
              getattr(model.config, "rope_parameters", None))
        return True
    got = rotary.inv_freq.detach().double().cpu()
    err = (got - expect).abs().max().item() / expect.abs().max().item()
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    print("rope check: rel err %.3g, attention_scaling %s, rope_parameters %s" %
          (err, scaling, getattr(model.config, "rope_parameters", None)))
    return err < 1e-6 and scaling == 1.0


def cmd_train(args):
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    t_start = time.time()
    torch.manual_seed(args.seed)
    dev = torch.device("cuda")
    corpus = load_corpus(args.corpus)
    meta = corpus["meta"]
    print("corpus:", json.dumps({k: meta[k] for k in ("counts", "bytes")}))

    # --- tokenizer ---
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)
    train_texts = [d["text"] for d in corpus["train"]]
    t0 = time.time()
    tok = build_tokenizer(train_texts, VOCAB_SIZE - len(ADDED_TOKENS))
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    write_tokenizer_config(out_dir, tok)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    print("tokenizer: %d tokens (bos %d, eos %d), trained in %.1fs" %
          (n_tok, bos_id, eos_id, time.time() - t0))
    assert n_tok <= VOCAB_SIZE
    sample = "def quick_sort(arr):\n    if len(arr) <= 1:\n        return arr  # 2024\n"
    enc = tok.encode(sample)
    print("sample tokens:", enc.tokens)
    assert tok.decode(enc.ids, skip_special_tokens=True) == sample, "tokenizer does not round-trip"

    def encode_split(name):
        docs = corpus[name]
        encs = tok.encode_batch([d["text"] for d in docs])
        ids, starts, nbytes = [], [], 0
        for d, e in zip(docs, encs):
            starts.append(len(ids))
            ids.extend(e.ids)  # begins with BOS (post-processor)
            ids.append(eos_id)
            nbytes += len(d["text"].encode("utf-8"))
        return torch.tensor(ids, dtype=torch.long), torch.tensor(starts, dtype=torch.long), nbytes

    t0 = time.time()
    train_ids, train_starts, train_bytes = encode_split("train")
    val_ids, _, _ = encode_split("val")
    test_ids, _, test_bytes = encode_split("test")
    print("tokens: train %d (%.2f bytes/token), val %d, test %d; encoded in %.1fs" %
          (len(train_ids), train_bytes / len(train_ids), len(val_ids), len(test_ids),
           time.time() - t0))

    # --- model ---
    cfg_dict = old_form_config(args, bos_id, eos_id)
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg_dict, f, indent=2)
    config = LlamaConfig.from_pretrained(out_dir)
    model = LlamaForCausalLM(config).to(dev)
    old_form_ok = check_rope(model, cfg_dict)
    if not old_form_ok:
        # transformers did not read the older rope_scaling form: say so, use rope_parameters,
        # and write both forms into config.json.
        print("WARNING: old-form rope_scaling was not applied; using rope_parameters")
        cfg_dict["rope_parameters"] = {"rope_type": "linear", "factor": 4.0,
                                       "rope_theta": 100000.0}
        with open(cfg_path, "w") as f:
            json.dump(cfg_dict, f, indent=2)
        config = LlamaConfig.from_pretrained(out_dir)
        model = LlamaForCausalLM(config).to(dev)
        assert check_rope(model, cfg_dict), "cannot configure linear RoPE scaling"
    n_params = sum(p.numel() for p in model.parameters())
    print("model: %d params (%.2f MB in bf16)" % (n_params, n_params * 2 / 1e6))

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)

    seq = args.seq_len
    train_gpu = train_ids.to(dev)
    starts_gpu = train_starts[train_starts < len(train_ids) - seq - 1].to(dev)
    ar = torch.arange(seq + 1, device=dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)

    def batch():
        b = args.batch
        n_doc = b // 4  # a quarter of the windows start at a file's BOS, like inference does
        off_rand = torch.randint(0, len(train_gpu) - seq - 1, (b - n_doc,), device=dev,
                                 generator=gen)
        pick = torch.randint(0, len(starts_gpu), (n_doc,), device=dev, generator=gen)
        off = torch.cat([starts_gpu[pick], off_rand])
        w = train_gpu[off[:, None] + ar[None, :]]
        return w[:, :-1], w[:, 1:]

    def windows(ids):
        n = (len(ids) - 1) // seq
        x = ids[: n * seq].view(n, seq)
        y = ids[1: n * seq + 1].view(n, seq)
        return x, y

    @torch.no_grad()
    def evaluate(m, ids, fp32=False, max_windows=None):
        m.eval()
        x_all, y_all = windows(ids)
        if max_windows:
            x_all, y_all = x_all[:max_windows], y_all[:max_windows]
        tot, cnt = 0.0, 0
        for i in range(0, len(x_all), 64):
            x = x_all[i:i + 64].to(dev)
            y = y_all[i:i + 64].to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not fp32):
                logits = m(input_ids=x).logits
            tot += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                   reduction="sum").item()
            cnt += y.numel()
        m.train()
        return tot / cnt, cnt

    tokens_per_step = args.batch * seq
    max_steps_epochs = int(args.epochs * len(train_ids) / tokens_per_step)
    warmup = args.warmup
    total_steps = max_steps_epochs  # revised after timing the first steps
    min_lr = args.lr * 0.1

    def lr_at(step):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        p = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr + 0.5 * (args.lr - min_lr) * (1 + math.cos(math.pi * p))

    print("training: batch %d x %d tokens, peak lr %g, wd %g, epoch cap %.1f -> %d steps, "
          "time cap %ds" % (args.batch, seq, args.lr, args.weight_decay, args.epochs,
                            max_steps_epochs, args.seconds))
    model.train()
    t_train = time.time()
    best = (float("inf"), -1, None)
    step = 0
    timed_from = None
    loss_ema = None
    while step < total_steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = batch()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 10:
            torch.cuda.synchronize()
            timed_from = time.time()
        if step == 60:
            torch.cuda.synchronize()
            per_step = (time.time() - timed_from) / 50
            budget_steps = int((args.seconds - (time.time() - t_train)) / (per_step * 1.08)) + step
            total_steps = max(step + 100, min(max_steps_epochs, budget_steps))
            print("step time %.1f ms -> total steps %d (%.1f epochs)" %
                  (per_step * 1e3, total_steps, total_steps * tokens_per_step / len(train_ids)))
        if step % 50 == 0 or step == total_steps:
            cur = loss.item()
            loss_ema = cur if loss_ema is None else 0.9 * loss_ema + 0.1 * cur
        if step % args.eval_every == 0 or step == total_steps:
            vl, _ = evaluate(model, val_ids)
            tag = ""
            if vl < best[0]:
                best = (vl, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
                tag = " *"
            print("step %5d  lr %.2e  train loss %.4f (ema %.4f)  val loss %.4f  %.0fs%s" %
                  (step, lr_at(step - 1), loss.item(), loss_ema, vl, time.time() - t_train, tag),
                  flush=True)
    train_time = time.time() - t_train
    final_train_loss = loss_ema
    print("trained %d steps in %.1fs; best val loss %.4f at step %d" %
          (step, train_time, best[0], best[1]))
    model.load_state_dict(best[2])

    # --- save: bf16 weights, old-form config, generation config ---
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    with open(cfg_path, "w") as f:
        json.dump(cfg_dict, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}, f, indent=2)
        f.write("\n")
    for name in sorted(os.listdir(out_dir)):
        print("  %-28s %9d bytes" % (name, os.path.getsize(os.path.join(out_dir, name))))
    total = sum(os.path.getsize(os.path.join(out_dir, n)) for n in os.listdir(out_dir))
    print("model dir total %.2f MB" % (total / 1e6))

    # --- reload exactly as a user would, fp32 ---
    ref = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).to(dev)
    reload_rope_ok = check_rope(ref, cfg_dict)
    print("reloaded config: rope ok %s, kv heads %d, tied %s" %
          (reload_rope_ok, ref.config.num_key_value_heads, ref.config.tie_word_embeddings))
    sd_a, sd_b = model.state_dict(), ref.state_dict()
    same = sorted(sd_a) == sorted(sd_b) and all(
        torch.equal(sd_a[k].float(), sd_b[k].float()) for k in sd_a)
    print("reloaded weights identical to trained bf16 weights:", same,
          "(%d tensors)" % len(sd_b))
    if not (same and reload_rope_ok):
        print("ERROR: reloaded model differs from the trained one")
    test_loss, test_tokens = evaluate(ref, test_ids, fp32=True)
    val_loss32, _ = evaluate(ref, val_ids, fp32=True)
    ppl = math.exp(test_loss)
    # bits per byte over the windows evaluated (approximately all test bytes)
    bpb = test_loss * test_tokens / math.log(2) / (test_bytes * test_tokens / len(test_ids))
    print("held-out (test) loss %.4f  perplexity %.3f  (%d tokens, ~%.3f bits/byte); "
          "val loss %.4f" % (test_loss, ppl, test_tokens, bpb, val_loss32))

    # --- sanity continuation ---
    prompt = "def quick_sort(arr):"
    ids = torch.tensor([tok.encode(prompt).ids], device=dev)
    with torch.no_grad():
        outp = ref.generate(ids, do_sample=False, max_new_tokens=80)
    cont = tok.decode(outp[0].tolist(), skip_special_tokens=True)
    print("---- greedy continuation of %r ----\n%s\n----" % (prompt, cont))

    hyper_keys = ("hidden", "intermediate", "layers", "heads", "kv_heads", "seq_len", "batch",
                  "lr", "weight_decay", "epochs", "warmup", "seconds", "seed")
    stats = {
        "params": n_params, "steps": step, "best_step": best[1],
        "train_seconds": round(train_time, 1),
        "final_train_loss_ema": final_train_loss, "best_val_loss_bf16": best[0],
        "val_loss_fp32": val_loss32, "test_loss_fp32": test_loss, "test_perplexity": ppl,
        "test_tokens": test_tokens, "test_bits_per_byte": bpb,
        "tokens": {"train": len(train_ids), "val": len(val_ids), "test": len(test_ids)},
        "tokenizer_size": n_tok, "quick_sort": cont, "old_form_config_ok": old_form_ok,
        "reload_identical": bool(same and reload_rope_ok),
        "hyper": {k: getattr(args, k) for k in hyper_keys},
        "total_seconds": round(time.time() - t_start, 1),
        "corpus": {k: meta[k] for k in ("source", "python", "rule", "counts", "bytes")},
    }
    if args.stats:
        with open(args.stats, "w") as f:
            json.dump(stats, f, indent=1, ensure_ascii=False)
    print("stats:", json.dumps({k: v for k, v in stats.items() if k != "quick_sort"}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack")
    pk.add_argument("--src", default="/usr/lib/python3.11")
    pk.add_argument("--out", default=".carry/corpus.tar.xz")
    tr = sub.add_parser("train")
    tr.add_argument("--corpus", default=".carry/corpus.tar.xz")
    tr.add_argument("--out", default="models/tiny-coder")
    tr.add_argument("--stats", default="")
    tr.add_argument("--seconds", type=int, default=120, help="training time cap")
    tr.add_argument("--epochs", type=float, default=8.0, help="passes over the train split")
    tr.add_argument("--hidden", type=int, default=256)
    tr.add_argument("--intermediate", type=int, default=640)
    tr.add_argument("--layers", type=int, default=4)
    tr.add_argument("--heads", type=int, default=8)
    tr.add_argument("--kv-heads", dest="kv_heads", type=int, default=2)
    tr.add_argument("--max-positions", dest="max_positions", type=int, default=2048)
    tr.add_argument("--seq-len", dest="seq_len", type=int, default=512)
    tr.add_argument("--batch", type=int, default=32)
    tr.add_argument("--lr", type=float, default=2e-3)
    tr.add_argument("--weight-decay", dest="weight_decay", type=float, default=0.1)
    tr.add_argument("--warmup", type=int, default=100)
    tr.add_argument("--eval-every", dest="eval_every", type=int, default=100)
    tr.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    if args.cmd == "pack":
        cmd_pack(args)
    else:
        cmd_train(args)


if __name__ == "__main__":
    main()
