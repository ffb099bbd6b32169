#!/usr/bin/env python3
"""Row-by-row comparison of two tools/hf_reference.py outputs for the same prompt and decode ids
(e.g. transformers fp32 and bf16 teacher-forced with --force-ids): relative L2 error of each
logits row, RMS difference, top-2 gap of the first file, and whether the argmaxes agree.
Prints one JSON line per row and a summary line.

Example: python3 tools/logits_diff.py ref32.safetensors ref16.safetensors
"""
import json
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: logits_diff.py TRUTH.safetensors OTHER.safetensors")
    import torch
    from safetensors.torch import load_file

    a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
    if not torch.equal(a["prompt_ids"], b["prompt_ids"]) or not torch.equal(
            a["decode_ids"], b["decode_ids"]):
        sys.exit("the two files did not score the same ids")
    rows_a = torch.cat([a["prefill_logits"].reshape(-1, a["decode_logits"].shape[-1])[-1:],
                        a["decode_logits"]]).double()
    rows_b = torch.cat([b["prefill_logits"].reshape(-1, b["decode_logits"].shape[-1])[-1:],
                        b["decode_logits"]]).double()
    errs, flips = [], 0
    for i, (x, y) in enumerate(zip(rows_a, rows_b)):
        rel = float((y - x).norm() / x.norm())
        rms = float((y - x).pow(2).mean().sqrt())
        top = torch.topk(x, 2).values
        same = int(x.argmax()) == int(y.argmax())
        flips += not same
        errs.append(rel)
        print(json.dumps({"row": i, "rel_err": round(rel, 5), "rms_diff": round(rms, 5),
                          "logit_rms": round(float(x.pow(2).mean().sqrt()), 5),
                          "top2_gap": round(float(top[0] - top[1]), 5), "argmax_same": same}))
    print(json.dumps({"rows": len(errs), "worst_rel_err": max(errs),
                      "mean_rel_err": sum(errs) / len(errs), "argmax_differs": flips}))


if __name__ == "__main__":
    main()
