#!/usr/bin/env python3
"""tools/scaling/run_scaling.py end to end on the CPU: one `tpserve serve` of models/tiny-coder
(CPU workers), two small benches (closed loop and chat), then the CSV / JSON table. Checks exact
counts and that the service was stopped.
Usage: run_scaling_test.py TPSERVE_BINARY   (exit 77 = skipped: the binary has no `bench`)"""

import csv
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.environ.get("TPSERVE_SOURCE_DIR") or os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def main():
    tpserve = sys.argv[1]
    probe = subprocess.run([tpserve, "bench", "--help"], capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"{tpserve} has no `bench` command yet: skipped")
        return 77
    cfg = {
        "model": "models/tiny-coder",
        "device": "cpu",
        "serve_args": ["--max-num-seqs", "8"],
        "bench_defaults": {"warmup": 0, "timeout": 300},
        "startup_timeout_s": 180,
        "bench_timeout_s": 300,
        "servers": [{"name": "cpu1", "tp": 1, "benches": [
            {"label": "c2", "concurrency": 2, "num_requests": 4, "prompt_len": 16,
             "output_len": 6},
            {"label": "chat", "preset": "chat", "num_conversations": 2, "turns": 2,
             "prompt_len": 8, "user_turn_len": 4, "output_len": 5, "concurrency": 2}]}],
    }
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "cfg.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        out = os.path.join(d, "out")
        r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "scaling", "run_scaling.py"),
                            "--config", path, "--tpserve", tpserve, "--out", out], cwd=ROOT,
                           timeout=900)
        failures = []
        if r.returncode != 0:
            failures.append(f"run_scaling.py exited {r.returncode}")
            log = os.path.join(out, "cpu1", "serve.log")
            if os.path.exists(log):
                print(open(log).read()[-4000:])
        rows = list(csv.DictReader(open(os.path.join(out, "results.csv"))))
        by_label = {row["label"]: row for row in rows}
        expect = {"c2": (4, 4 * 6, 4 * 16), "chat": (4, 4 * 5, 2 * (8 + (8 + 5 + 4)))}
        for label, (n, out_tokens, in_tokens) in expect.items():
            row = by_label.get(label)
            if row is None:
                failures.append(f"no row {label}")
                continue
            if int(row["completed"]) != n or int(row["failed"]) != 0:
                failures.append(f"{label}: completed {row['completed']} failed {row['failed']}")
            bench = json.load(open(os.path.join(out, "cpu1", f"{label}.json")))
            if bench["total_output_tokens"] != out_tokens:
                failures.append(f"{label}: {bench['total_output_tokens']} output tokens, "
                                f"expected {out_tokens}")
            if bench["total_input_tokens"] != in_tokens:
                failures.append(f"{label}: {bench['total_input_tokens']} input tokens, "
                                f"expected {in_tokens}")
        status = json.load(open(os.path.join(out, "status.json")))
        if status["failures"]:
            failures += status["failures"]
        # The server is gone: its address no longer answers.
        ready = open(os.path.join(out, "cpu1", "ready")).read().strip()
        h = subprocess.run([tpserve, "health", "--server", ready, "--timeout", "2"],
                           capture_output=True, text=True)
        if h.returncode == 0:
            failures.append(f"the server at {ready} still answers after run_scaling.py")
        for f in failures:
            print("FAILED:", f)
        print("run_scaling_test:", "FAILED" if failures else "OK")
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
