// A table of cuBLASLt algorithm choices measured on one kind of GPU: for a problem (M, N, K, bias,
// pointer alignment) on a device (its name and SM count) with a cuBLASLt version, which of the
// heuristic's candidates to take instead of its first, because it measured faster with the
// weights cold (`tpserve-cuda-bench --lt-sweep` writes such a table). Unlike timing candidates
// at run time (TPSERVE_CUBLASLT_AUTOTUNE), every process on such a GPU makes the same choice, so
// a request still gives the same bits in the engine, in a worker and after a restart.
//
// The table is JSON: {"entries": [{"device": "NVIDIA H200", "sms": 132, "cublaslt": 130100,
// "m": 64, "n": 12288, "k": 4096, "bias": false, "alignment": 256, "candidate": 3,
// "config": "id=66 tile=...", ...}, ...]} ("config" is LtGemm::DescribeAlgo of the candidate:
// a plan takes the entry only when the heuristic's candidate at that index still describes so;
// other keys, such as the measured times, are kept for the reader). The built-in table is
// kernels/cuda/cublaslt_table.json, compiled in; TPSERVE_CUBLASLT_TABLE names another file or
// turns it off. Pure C++ (no CUDA), so that its parsing is tested on any machine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tpserve::cuda {

struct LtTableEntry {
  std::string device;  // cudaDeviceProp::name
  int sms = 0;         // cudaDeviceProp::multiProcessorCount
  int cublaslt = 0;    // cublasLtGetVersion()
  int64_t m = 0, n = 0, k = 0;
  bool bias = false;
  int alignment = 0;  // the smallest pointer alignment of the operands, bytes (as LtGemm keys it)
  int candidate = 0;  // index in cublasLtMatmulAlgoGetHeuristic's results, 0 = its first
  std::string config;
};

class LtTable {
 public:
  LtTable() = default;
  // Parses a table's JSON; `source` names it in errors. Every entry must have every key above
  // with a value of its type and range; two entries of the same problem and device are refused.
  static absl::StatusOr<LtTable> Parse(const std::string& json, const std::string& source);
  // The table of the entries two tables (JSON text, e.g. two sweeps of tpserve-cuda-bench
  // --lt-sweep) chose alike: the same GPU, cuBLASLt, problem, candidate and configuration. Each
  // kept entry is a's, with "first_us" / "best_us" the means of the two where both have them,
  // and "sweeps": 2. `about` becomes the result's "about". Either input not a valid table is an
  // error.
  static absl::StatusOr<std::string> Agreement(const std::string& a, const std::string& b,
                                               const std::string& about);
  // The built-in table (kernels/cuda/cublaslt_table.json).
  static const std::string& BuiltinJson();
  // The process's table: TPSERVE_CUBLASLT_TABLE = "builtin" (default), "off" (empty) or a path.
  // A file that cannot be read or parsed stops the process with the reason (at the first GEMM
  // plan, i.e. at start-up).
  static const LtTable& Process();

  // The entry of this problem on this device, or nullptr.
  const LtTableEntry* Find(const std::string& device, int sms, int cublaslt, int64_t m, int64_t n,
                           int64_t k, bool bias, int alignment) const;
  // The entries for this device and cuBLASLt version.
  int CountFor(const std::string& device, int sms, int cublaslt) const;
  const std::vector<LtTableEntry>& entries() const { return entries_; }
  const std::string& source() const { return source_; }

 private:
  std::vector<LtTableEntry> entries_;
  std::string source_;
};

}  // namespace tpserve::cuda
