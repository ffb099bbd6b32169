#!/usr/bin/env python3
"""Unit tests of tools/scaling/*.py without a server or a GPU: the HF peers' statistics and JSON
fields (the same percentile rule and field names as `tpserve bench --json`), and the scaling
runner's config checks, bench flags, table and (when matplotlib exists) plots."""

import csv
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.environ.get("TPSERVE_SOURCE_DIR") or os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "scaling"))

import hf_peers  # noqa: E402
import run_scaling  # noqa: E402
import tp_model  # noqa: E402

# The fields `tpserve bench --json` writes (tools/bench/bench_cmd.cc ReportJson).
BENCH_FIELDS = {
    "tool", "backend", "label", "preset", "server", "model", "tp", "pp", "world_size",
    "rank_devices", "config", "num_requests", "completed", "failed", "errors",
    "output_length_mismatches", "duration_s", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput", "ttft_ms", "tpot_ms",
    "itl_ms", "e2e_ms", "server_ttft_ms",
}
SUMMARY_FIELDS = {"count", "mean", "median", "p90", "p99", "min", "max"}


class Args:
    seed = 0


class HfPeersTest(unittest.TestCase):
    def test_percentiles_match_the_cpp_rule(self):
        v = list(range(1, 11))
        self.assertAlmostEqual(hf_peers.percentile(v, 50), 5.5)
        self.assertAlmostEqual(hf_peers.percentile(v, 90), 9.1)
        self.assertAlmostEqual(hf_peers.percentile(v, 99), 9.91)
        s = hf_peers.summarize([(i * 37) % 100 + 1 for i in range(100)])
        self.assertEqual(s["count"], 100)
        self.assertAlmostEqual(s["mean"], 50.5)
        self.assertAlmostEqual(s["p90"], 90.1)
        self.assertAlmostEqual(s["p99"], 99.01)
        self.assertEqual(hf_peers.summarize([])["count"], 0)

    def test_report_has_the_bench_fields(self):
        # A batch of 2 requests: prefill 0.1 s, then 3 decode steps of 0.02 s.
        times = [0.1, 0.12, 0.14, 0.16]
        records = [hf_peers.batch_records(512, times) for _ in range(2)]
        spec = hf_peers.PRESETS["batch32"]
        r = hf_peers.report("eager-bf16", "batch32", "/tmp/ds67", spec, records, 0.2, Args())
        self.assertEqual(set(r) - {"peak_gpu_gib"}, BENCH_FIELDS)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            self.assertEqual(set(r[key]), SUMMARY_FIELDS)
        self.assertEqual(r["backend"], "hf-eager-bf16")
        self.assertEqual(r["model"], "ds67")
        self.assertEqual(r["completed"], 2)
        self.assertEqual(r["total_output_tokens"], 8)
        self.assertEqual(r["total_input_tokens"], 1024)
        self.assertAlmostEqual(r["output_throughput"], 40.0)
        self.assertAlmostEqual(r["ttft_ms"]["median"], 100.0)
        self.assertAlmostEqual(r["tpot_ms"]["mean"], 20.0)
        self.assertEqual(r["itl_ms"]["count"], 6)
        self.assertAlmostEqual(r["itl_ms"]["p99"], 20.0)

    def test_presets_match_the_cpp_presets(self):
        p = hf_peers.PRESETS
        self.assertEqual((p["latency"]["prompt_len"], p["latency"]["output_len"],
                          p["latency"]["batch"]), (512, 512, 1))
        self.assertEqual(p["batch32"]["batch"], 32)
        self.assertEqual(p["batch64"]["batch"], 64)
        self.assertEqual((p["chat"]["turns"], p["chat"]["conversations"], p["chat"]["batch"],
                          p["chat"]["user_turn_len"]), (4, 16, 8, 128))
        # The last chat turn: 256 + 4 * 128 outputs + 3 * 128 user turns.
        self.assertEqual(hf_peers.cache_len(p["chat"]), 256 + 512 + 384)


class RunScalingTest(unittest.TestCase):
    def write(self, d, name, obj):
        path = os.path.join(d, name)
        with open(path, "w") as f:
            f.write(obj if isinstance(obj, str) else json.dumps(obj))
        return path

    def test_bench_flags(self):
        label, flags = run_scaling.bench_flags("latency", {"warmup": 2})
        self.assertEqual(label, "latency")
        self.assertEqual(flags, ["--warmup", "2", "--preset", "latency"])
        label, flags = run_scaling.bench_flags(
            {"label": "c8", "concurrency": 8, "prompt_len": 64, "no_stream": True,
             "allow_errors": False}, None)
        self.assertEqual(label, "c8")
        self.assertEqual(flags, ["--concurrency", "8", "--prompt-len", "64", "--no-stream"])

    def test_bad_configs_name_the_field(self):
        with tempfile.TemporaryDirectory() as d:
            for cfg, needle in [
                ("{", "not valid JSON"),
                ({"model": "m"}, "'servers'"),
                ({"servers": [{"benches": ["latency"]}]}, "'model'"),
                ({"model": "m", "servers": [{"tp": 0, "benches": ["latency"]}]},
                 "servers[0].tp"),
                ({"model": "m", "servers": [{"tp": 1}]}, "servers[0] needs"),
            ]:
                path = self.write(d, "c.json", cfg)
                r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "scaling",
                                                                 "run_scaling.py"),
                                    "--config", path, "--dry-run"],
                                   capture_output=True, text=True)
                self.assertNotEqual(r.returncode, 0)
                self.assertIn(needle, r.stderr, cfg)

    def test_table_and_plots_from_results(self):
        with tempfile.TemporaryDirectory() as d:
            rows = []
            for gpus, tput in ((1, 100.0), (2, 180.0)):
                result = {"tool": "tpserve bench", "backend": "tpserve", "preset": "batch32",
                          "tp": gpus, "pp": 1, "world_size": gpus, "num_requests": 4,
                          "completed": 4, "failed": 0, "errors": {},
                          "config": {"mode": "closed", "concurrency": 32},
                          "duration_s": 2.0, "request_throughput": 2.0,
                          "output_throughput": tput, "total_token_throughput": tput * 2}
                for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                    result[m] = {"mean": 1.0, "median": 1.0, "p90": 2.0, "p99": 3.0}
                path = self.write(d, f"r{gpus}.json", result)
                rows.append(run_scaling.row_of(result, {"server": f"tp{gpus}", "gpus": gpus},
                                               "batch32", path))
            peer = hf_peers.report("eager-bf16", "batch32", "/tmp/m", hf_peers.PRESETS["batch32"],
                                   [hf_peers.batch_records(512, [0.1, 0.2])], 1.0, Args())
            rows += run_scaling.peer_rows([self.write(d, "hf.json", peer)])
            csv_path = run_scaling.write_table(rows, d)
            with open(csv_path) as f:
                table = list(csv.DictReader(f))
            self.assertEqual(len(table), 3)
            self.assertEqual(table[0]["gpus"], "1")
            self.assertEqual(float(table[1]["output_throughput"]), 180.0)
            self.assertEqual(table[2]["backend"], "hf-eager-bf16")
            self.assertEqual(list(table[0].keys()), run_scaling.COLUMNS)
            self.assertTrue(os.path.exists(os.path.join(d, "summary.md")))
            paths = run_scaling.plot(rows, d)
            try:
                import matplotlib  # noqa: F401
                self.assertEqual(len(paths), 3)
                for p in paths:
                    self.assertGreater(os.path.getsize(p), 1000)
            except ImportError:
                self.assertEqual(paths, [])


class TpModelTest(unittest.TestCase):
    """tools/scaling/tp_model.py: calibrated to the measured TP = 1 figures, and the shape its
    terms must give (sub-linear speedups, a faster all-reduce never predicting slower)."""

    def assert_tp_speedups_grow_sublinearly(self, rows):
        """Per all-reduce, TP = 2 < 4 < 8 in batch-1 speedup, each below its TP (batch 64 too)."""
        for impl in ("custom", "vllm"):
            prev = 1.0
            for tp in (2, 4, 8):
                r = rows[(f"tp{tp}", impl)]
                self.assertGreater(r["batch1_speedup"], prev)
                self.assertLess(r["batch1_speedup"], tp)
                self.assertLess(r["batch64_speedup"], tp)
                prev = r["batch1_speedup"]

    def test_tp1_reproduces_the_measurement(self):
        m = tp_model.MEASURED
        rows = {(r["config"], r["all_reduce"]): r for r in tp_model.table()}
        self.assertAlmostEqual(rows[("tp1", "-")]["batch1_ms"], m["batch1_ms"], places=9)
        self.assertAlmostEqual(tp_model.batch1_ms(m, 1, 123.0), m["batch1_ms"], places=9)
        self.assertAlmostEqual(tp_model.batch64_tps(m, 1, 99.0), 64 / m["batch64_ms"] * 1e3,
                               places=6)

    def test_speedups_are_sublinear_and_ordered(self):
        rows = {(r["config"], r["all_reduce"]): r for r in tp_model.table()}
        self.assert_tp_speedups_grow_sublinearly(rows)
        for tp in (2, 4, 8):
            self.assertGreater(rows[(f"tp{tp}", "custom")]["batch1_speedup"],
                               rows[(f"tp{tp}", "vllm")]["batch1_speedup"])
        for pp in (2, 4):  # a pipeline does not speed up one sequence
            self.assertLess(rows[(f"pp{pp}", "-")]["batch1_speedup"], 1.0)
            self.assertGreater(rows[(f"pp{pp}", "-")]["batch64_speedup"], 1.0)

    def test_all_reduce_interpolation(self):
        t = tp_model.PUBLISHED_AR_US["custom"][8]
        self.assertEqual(tp_model.ar_us("custom", 8, 4096), t[4096])
        self.assertEqual(tp_model.ar_us("custom", 8, 524288), t[524288])
        mid = tp_model.ar_us("custom", 8, 8192)  # a third of the way in log2 from 4 KB to 32 KB
        self.assertAlmostEqual(mid, t[4096] + (t[32768] - t[4096]) / 3, places=9)
        with self.assertRaises(ValueError):
            tp_model.ar_us("custom", 8, 1 << 30)

    def test_shard_model_reproduces_tp1_and_keeps_its_shape(self):
        m = tp_model.MEASURED
        rows = {(r["config"], r["all_reduce"]): r for r in tp_model.shard_table()}
        self.assertAlmostEqual(rows[("tp1", "-")]["batch1_ms"], m["batch1_ms"], places=9)
        self.assertAlmostEqual(rows[("tp1", "-")]["batch64_tokens_per_s"],
                               64 / m["batch64_ms"] * 1e3, places=6)
        self.assert_tp_speedups_grow_sublinearly(rows)
        # Slower shard kernels than the bandwidth model assumes: never a better prediction.
        bw = {(r["config"], r["all_reduce"]): r for r in tp_model.table()}
        for tp in (2, 4, 8):
            self.assertLessEqual(rows[(f"tp{tp}", "custom")]["batch1_speedup"],
                                 bw[(f"tp{tp}", "custom")]["batch1_speedup"])

    def test_cli_json(self):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "scaling", "tp_model.py"),
                              "--json"], capture_output=True, text=True, check=True).stdout
        j = json.loads(out)
        self.assertEqual(len(j["rows"]), 1 + 2 * 3 + 2)
        self.assertGreater(j["fixed_layer_us"], 0)


if __name__ == "__main__":
    unittest.main()
