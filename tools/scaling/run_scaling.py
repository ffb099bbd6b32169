#!/usr/bin/env python3
"""Scaling experiments: for each server configuration of a config file (tp, pp, GPU count, serve
flags), start `tpserve serve`, wait until health is SERVING, run `tpserve bench --json` for each
benchmark of the configuration (presets or explicit concurrency / lengths), stop the service, and
collect everything into one table (CSV + JSON) and PNG plots (throughput and latency against GPU
count). JSON reports of peers (tools/scaling/hf_peers.py) given with --peers join the table and
the plots as their own series.

Config (JSON, or YAML when PyYAML is installed):
  {
    "model": "/tmp/ds67",                    # model directory (relative: to the repo root)
    "device": "cuda",                        # cpu | cuda | auto (spawned workers)
    "serve_args": ["--max-num-seqs", "64"],  # added to every `tpserve serve`
    "bench_defaults": {"warmup": 1},         # added to every `tpserve bench` (flag: value)
    "startup_timeout_s": 900, "bench_timeout_s": 3600,
    "servers": [
      {"name": "tp1", "tp": 1, "pp": 1, "gpus": 1,
       "benches": ["latency", "batch32", "batch64", "chat"]},
      {"name": "tp2", "tp": 2, "gpus": 2,
       "benches": ["latency", {"label": "c16", "concurrency": 16, "prompt_len": 256,
                               "output_len": 128, "num_requests": 64}]}
    ]
  }
A bench is a preset name or a dict of `tpserve bench` flags (underscores or dashes; true for a
boolean flag; "label" names the row). gpus defaults to tp * pp; a server that needs more GPUs than
are visible is skipped (and listed as skipped). Servers run one after the other.

Usage:
  python3 tools/scaling/run_scaling.py --config tools/scaling/configs/one_gpu.json \
      --tpserve build/tools/tpserve --out scaling-out [--peers hf-out/*.json] [--dry-run]
  python3 tools/scaling/run_scaling.py --replot scaling-out   # table + plots from saved JSON
Outputs under --out: <server>/<bench>.json, <server>/serve.log, results.csv, results.json,
throughput_vs_gpus.png, latency_vs_gpus.png, presets.png (the benches side by side, tpserve and
peers, at the smallest GPU count), summary.md.
"""

import argparse
import csv
import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Columns of results.csv (the bench JSON fields, flattened).
COLUMNS = [
    "backend", "server", "label", "preset", "gpus", "tp", "pp", "mode", "concurrency",
    "request_rate", "num_requests", "completed", "failed", "errors", "prompt_len", "output_len",
    "duration_s", "request_throughput", "output_throughput", "total_token_throughput",
    "ttft_ms_mean", "ttft_ms_median", "ttft_ms_p90", "ttft_ms_p99",
    "tpot_ms_mean", "tpot_ms_median", "tpot_ms_p90", "tpot_ms_p99",
    "itl_ms_mean", "itl_ms_median", "itl_ms_p90", "itl_ms_p99",
    "e2e_ms_mean", "e2e_ms_median", "e2e_ms_p90", "e2e_ms_p99", "json",
]


def log(msg):
    print(f"[run_scaling {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_config(path):
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            sys.exit(f"{path}: YAML needs PyYAML (python3-yaml); or write the config as JSON")
        cfg = yaml.safe_load(text)
    else:
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            sys.exit(f"{path}: not valid JSON: {e}")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("servers"), list) or not cfg["servers"]:
        sys.exit(f"{path}: needs a non-empty 'servers' list")
    if "model" not in cfg:
        sys.exit(f"{path}: needs 'model' (a model directory)")
    for i, s in enumerate(cfg["servers"]):
        if not isinstance(s, dict):
            sys.exit(f"{path}: servers[{i}] is not an object")
        for key in ("tp", "pp", "gpus"):
            if key in s and (not isinstance(s[key], int) or s[key] < 1):
                sys.exit(f"{path}: servers[{i}].{key} must be an integer >= 1")
        if not s.get("benches"):
            sys.exit(f"{path}: servers[{i}] needs a non-empty 'benches' list")
        for j, b in enumerate(s["benches"]):
            if not isinstance(b, (str, dict)):
                sys.exit(f"{path}: servers[{i}].benches[{j}] must be a preset name or an object")
    return cfg


def visible_gpus(device):
    if device == "cpu":
        return None  # no limit
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return len([l for l in out.stdout.splitlines() if l.startswith("GPU ")])
    except (OSError, subprocess.TimeoutExpired):
        return 0


def bench_flags(bench, defaults):
    """(label, [flags]) of one bench entry: a preset name or a dict of flags."""
    entry = {"preset": bench} if isinstance(bench, str) else dict(bench)
    merged = dict(defaults or {})
    merged.update(entry)
    label = merged.pop("label", None) or merged.get("preset") or "custom"
    flags = []
    for key, value in merged.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        else:
            flags += [flag, str(value)]
    return label, flags


class Server:
    """`tpserve serve` in its own process group (workers included); stopped with SIGTERM, then
    SIGKILL of the group."""

    def __init__(self, cmd, log_path, env):
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=REPO)

    def wait_ready(self, ready_file, tpserve, timeout_s):
        end = time.time() + timeout_s
        address = None
        while time.time() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tpserve serve exited with {self.proc.returncode} during startup")
            if address is None and os.path.exists(ready_file):
                with open(ready_file) as f:
                    address = f.read().strip() or None
            if address:
                r = subprocess.run(tpserve + ["health", "--server", address, "--timeout", "5"],
                                   capture_output=True, text=True)
                if r.returncode == 0 and "SERVING" in r.stdout:
                    return address
            time.sleep(0.5)
        raise RuntimeError(f"not SERVING within {timeout_s} s")

    def stop(self, grace_s=60):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log(f"tpserve serve did not exit within {grace_s} s of SIGTERM: SIGKILL")
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftover workers of the group
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.log.close()
        return self.proc.returncode


def run_server(cfg, srv, tpserve, out_dir, dry_run):
    name = srv.get("name") or f"tp{srv.get('tp', 1)}pp{srv.get('pp', 1)}"
    tp, pp = srv.get("tp", 1), srv.get("pp", 1)
    gpus = srv.get("gpus", tp * pp)
    device = srv.get("device", cfg.get("device", "auto"))
    sdir = os.path.join(out_dir, name)
    os.makedirs(sdir, exist_ok=True)
    model = cfg["model"] if os.path.isabs(cfg["model"]) else os.path.join(REPO, cfg["model"])
    ready_file = os.path.join(sdir, "ready")
    if os.path.exists(ready_file):
        os.remove(ready_file)
    serve = tpserve + ["serve", "--model", model, "--tp", str(tp), "--pp", str(pp), "--device",
                       device, "--host", "127.0.0.1", "--port", "0", "--ready-file", ready_file]
    serve += [str(a) for a in cfg.get("serve_args", []) + srv.get("serve_args", [])]
    env = dict(os.environ)
    if device != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    benches = [bench_flags(b, cfg.get("bench_defaults")) for b in srv["benches"]]
    info = {"server": name, "tp": tp, "pp": pp, "gpus": gpus, "device": device}
    if dry_run:
        print(" ".join(shlex.quote(a) for a in serve))
        for label, flags in benches:
            print("  " + " ".join(shlex.quote(a) for a in tpserve + ["bench", "--server", "ADDR"]
                                  + flags + ["--json", os.path.join(sdir, label + ".json")]))
        return [], []
    rows, failures = [], []
    log(f"{name}: starting: {' '.join(serve)}")
    server = Server(serve, os.path.join(sdir, "serve.log"), env)
    try:
        t0 = time.time()
        address = server.wait_ready(ready_file, tpserve, cfg.get("startup_timeout_s", 900))
        log(f"{name}: SERVING at {address} after {time.time() - t0:.1f} s")
        for label, flags in benches:
            json_path = os.path.join(sdir, label + ".json")
            cmd = tpserve + ["bench", "--server", address, "--json", json_path, "--no-progress",
                             "--label", label] + flags
            log(f"{name}: {' '.join(cmd)}")
            with open(os.path.join(sdir, label + ".log"), "w") as blog:
                try:
                    r = subprocess.run(cmd, stdout=blog, stderr=subprocess.STDOUT, cwd=REPO,
                                       timeout=cfg.get("bench_timeout_s", 3600))
                    rc = r.returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            if os.path.exists(json_path):
                with open(json_path) as f:
                    result = json.load(f)
                rows.append(row_of(result, info, label, json_path))
                log(f"{name}/{label}: {rows[-1]['output_throughput']:.1f} tok/s, TTFT median "
                    f"{rows[-1]['ttft_ms_median']:.1f} ms, TPOT median "
                    f"{rows[-1]['tpot_ms_median']:.2f} ms, failed {rows[-1]['failed']} (rc {rc})")
            if rc != 0:
                failures.append(f"{name}/{label}: tpserve bench exited {rc} (see {sdir}/{label}.log)")
            if server.proc.poll() is not None:
                failures.append(f"{name}: the server exited with {server.proc.returncode} "
                                f"during {label}")
                break
    except RuntimeError as e:
        failures.append(f"{name}: {e} (see {sdir}/serve.log)")
    finally:
        rc = server.stop()
        log(f"{name}: stopped (exit {rc})")
    return rows, failures


def row_of(result, info, label, json_path):
    cfg = result.get("config", {})
    row = {
        "backend": result.get("backend", "tpserve"),
        "server": info.get("server", ""),
        "label": label,
        "preset": result.get("preset", ""),
        "gpus": info.get("gpus", result.get("world_size", 1)),
        "tp": result.get("tp", info.get("tp")),
        "pp": result.get("pp", info.get("pp")),
        "mode": cfg.get("mode", ""),
        "concurrency": cfg.get("concurrency", ""),
        "request_rate": cfg.get("request_rate", ""),
        "num_requests": result.get("num_requests", 0),
        "completed": result.get("completed", 0),
        "failed": result.get("failed", 0),
        "errors": " ".join(f"{k}={v}" for k, v in sorted(result.get("errors", {}).items())),
        "prompt_len": cfg.get("prompt_len", ""),
        "output_len": cfg.get("output_len", ""),
        "json": os.path.relpath(json_path),
    }
    for key in ("duration_s", "request_throughput", "output_throughput",
                "total_token_throughput"):
        row[key] = result.get(key, 0.0)
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = result.get(metric, {})
        for stat in ("mean", "median", "p90", "p99"):
            row[f"{metric}_{stat}"] = s.get(stat, 0.0)
    return row


def peer_rows(patterns):
    rows = []
    for pattern in patterns:
        paths = sorted(glob.glob(pattern)) or [pattern]
        for path in paths:
            with open(path) as f:
                data = json.load(f)
            for result in data if isinstance(data, list) else [data]:
                if "error" in result:
                    log(f"peer {path}: {result.get('backend')} {result.get('preset')}: "
                        f"{result['error'][:200]}")
                    continue
                info = {"server": result.get("backend", "peer"), "gpus": 1, "tp": 1, "pp": 1}
                rows.append(row_of(result, info, result.get("label") or result.get("preset", ""),
                                   path))
    return rows


def write_table(rows, out_dir):
    csv_path = os.path.join(out_dir, "results.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()})
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    # A markdown table for reports and closing notes.
    md = ["| backend | server | bench | GPUs | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms "
          "| TPOT p50 ms | ITL p99 ms | failed |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['backend']} | {r['server']} | {r['label']} | {r['gpus']} | "
                  f"{r['request_throughput']:.3f} | {r['output_throughput']:.1f} | "
                  f"{r['ttft_ms_median']:.1f} | {r['ttft_ms_p99']:.1f} | "
                  f"{r['tpot_ms_median']:.2f} | {r['itl_ms_p99']:.2f} | {r['failed']} |")
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return csv_path


def plot(rows, out_dir):
    """throughput_vs_gpus.png and latency_vs_gpus.png (one series per (backend, bench label)) and
    presets.png.
    Returns the written paths ([] without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots (apt-get install python3-matplotlib)")
        return []
    series = {}
    for r in rows:
        series.setdefault((r["backend"], r["label"]), []).append(r)
    paths = []

    def draw(ax, key_fn, ylabel, title):
        for (backend, label), rs in sorted(series.items()):
            rs = sorted(rs, key=lambda r: r["gpus"])
            xs = [r["gpus"] for r in rs]
            ys = [key_fn(r) for r in rs]
            style = "-o" if backend == "tpserve" else "--s"
            ax.plot(xs, ys, style, label=f"{backend} {label}")
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        gpus = sorted({r["gpus"] for r in rows})
        ax.set_xticks(gpus)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    draw(axes[0], lambda r: r["output_throughput"], "output tokens / s", "Output throughput")
    draw(axes[1], lambda r: r["request_throughput"], "requests / s", "Request throughput")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "throughput_vs_gpus.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    draw(axes[0], lambda r: r["ttft_ms_median"], "ms", "Time to first token (median)")
    draw(axes[1], lambda r: r["tpot_ms_median"], "ms", "Time per output token (median)")
    draw(axes[2], lambda r: r["itl_ms_p99"], "ms", "Inter-token latency (p99)")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "latency_vs_gpus.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    # The presets side by side at the smallest GPU count (on a one-GPU machine, the only plot
    # with more than one point per series): one group per bench, one bar per backend.
    gpus = min(r["gpus"] for r in rows)
    base = [r for r in rows if r["gpus"] == gpus]
    labels = sorted({r["label"] for r in base})
    backends = sorted({r["backend"] for r in base}, key=lambda b: (b != "tpserve", b))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / max(1, len(backends))
    for ax, key, title in ((axes[0], "output_throughput", "Output tokens / s"),
                           (axes[1], "ttft_ms_median", "TTFT median (ms)"),
                           (axes[2], "tpot_ms_median", "TPOT median (ms)")):
        for i, backend in enumerate(backends):
            values = {r["label"]: r[key] for r in base if r["backend"] == backend}
            xs = [k + i * width for k in range(len(labels))]
            ax.bar(xs, [values.get(l, 0.0) for l in labels], width, label=backend)
        ax.set_xticks([k + width * (len(backends) - 1) / 2 for k in range(len(labels))])
        ax.set_xticklabels(labels)
        ax.set_title(f"{title}, {gpus} GPU{'s' if gpus > 1 else ''}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "presets.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    for p in paths:
        log(f"wrote {p}")
    return paths


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", help="JSON (or YAML) list of server configurations")
    ap.add_argument("--tpserve", default=os.path.join(REPO, "build", "tools", "tpserve"),
                    help="the tpserve binary (or a command, e.g. 'env X=1 build/tools/tpserve')")
    ap.add_argument("--out", default="scaling-out")
    ap.add_argument("--peers", nargs="*", default=[],
                    help="peer JSON files (hf_peers.py output; globs allowed)")
    ap.add_argument("--only", default=None, help="comma-separated server names to run")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    ap.add_argument("--replot", metavar="DIR",
                    help="rebuild the table and plots from DIR/*/*.json (no runs)")
    args = ap.parse_args()

    if args.replot:
        rows = []
        for path in sorted(glob.glob(os.path.join(args.replot, "*", "*.json"))):
            with open(path) as f:
                result = json.load(f)
            if result.get("tool") != "tpserve bench":
                continue
            info = {"server": os.path.basename(os.path.dirname(path)),
                    "gpus": result.get("world_size", 1)}
            rows.append(row_of(result, info, result.get("label") or result.get("preset"), path))
        rows += peer_rows(args.peers)
        write_table(rows, args.replot)
        plot(rows, args.replot)
        return 0
    if not args.config:
        ap.error("--config is required (or --replot DIR)")
    cfg = load_config(args.config)
    tpserve = shlex.split(args.tpserve)
    if not args.dry_run and not os.path.exists(tpserve[-1]) and len(tpserve) == 1:
        sys.exit(f"--tpserve {args.tpserve}: no such binary")
    os.makedirs(args.out, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    rows, failures, skipped = [], [], []
    for srv in cfg["servers"]:
        name = srv.get("name") or f"tp{srv.get('tp', 1)}pp{srv.get('pp', 1)}"
        if only and name not in only:
            continue
        device = srv.get("device", cfg.get("device", "auto"))
        need = srv.get("gpus", srv.get("tp", 1) * srv.get("pp", 1))
        have = visible_gpus(device)
        if have is not None and device == "cuda" and need > have:
            skipped.append(f"{name}: needs {need} GPUs, {have} visible")
            log(f"skip {skipped[-1]}")
            continue
        r, f = run_server(cfg, srv, tpserve, args.out, args.dry_run)
        rows += r
        failures += f
    if args.dry_run:
        return 0
    rows += peer_rows(args.peers)
    if rows:
        write_table(rows, args.out)
        plot(rows, args.out)
    with open(os.path.join(args.out, "status.json"), "w") as f:
        json.dump({"failures": failures, "skipped": skipped, "rows": len(rows)}, f, indent=1)
    for s in skipped:
        log(f"skipped: {s}")
    for f in failures:
        log(f"FAILED: {f}")
    return 1 if failures or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
