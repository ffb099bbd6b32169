// An Ops stand-in for communicator tests: memory ops on host memory (memcpy), reporting either
// the CPU or a "CUDA" device so that the MPI communicator's host staging path runs on a CPU-only
// machine. Compute ops are not needed and abort.
#pragma once

#include <cstdlib>
#include <cstring>

#include "common/logging.h"
#include "kernels/ops.h"

namespace tpserve {

class FakeOps : public Ops {
 public:
  explicit FakeOps(Device device) : device_(device) {}

  Device device() const override { return device_; }
  DType compute_dtype() const override { return DType::kF32; }
  void* Alloc(size_t bytes) override { return std::malloc(bytes); }
  void Free(void* ptr) override { std::free(ptr); }
  void CopyToDevice(void* dst, const void* src, size_t bytes) override {
    ++to_device;
    std::memcpy(dst, src, bytes);
  }
  void CopyToHost(void* dst, const void* src, size_t bytes) override {
    ++to_host;
    std::memcpy(dst, src, bytes);
  }
  void CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    ++device_to_device;
    std::memcpy(dst, src, bytes);
  }
  void Synchronize() override {}
  void SetBatch(const BatchMeta&) override { Unused(); }
  void Embedding(const Tensor&, int64_t, Tensor) override { Unused(); }
  void RmsNorm(const Tensor&, const Tensor&, float, Tensor) override { Unused(); }
  void AddRmsNorm(Tensor, const Tensor&, const Tensor&, float, Tensor) override { Unused(); }
  void Gemm(const Tensor&, const Tensor&, const Tensor*, Tensor) override { Unused(); }
  void Rope(Tensor, Tensor, const Tensor&, int) override { Unused(); }
  void KvWrite(const Tensor&, const Tensor&, Tensor, Tensor) override { Unused(); }
  void RopeKvWrite(const Tensor&, const Tensor&, int, int, int, Tensor, Tensor, Tensor) override {
    Unused();
  }
  void AttentionPrefill(const Tensor&, const Tensor&, const Tensor&, int, int, int, float,
                        Tensor) override {
    Unused();
  }
  void AttentionDecode(const Tensor&, const Tensor&, const Tensor&, int, int, int, float,
                       Tensor) override {
    Unused();
  }
  void SiluMul(const Tensor&, Tensor) override { Unused(); }
  void Add(const Tensor&, const Tensor&, Tensor) override { Unused(); }
  void GatherLogitRows(const Tensor&, Tensor) override { Unused(); }
  void InterleaveShards(const Tensor&, Tensor) override { Unused(); }
  using Ops::Sample;
  std::vector<int32_t> Sample(const Tensor&, int64_t, const std::vector<SamplingParams>&,
                              std::vector<std::optional<TokenLogprobs>>*) override {
    Unused();
    return {};
  }

  int to_device = 0;
  int to_host = 0;
  int device_to_device = 0;

 private:
  [[noreturn]] static void Unused() {
    TP_LOG(FATAL) << "FakeOps: compute ops are not part of the communicator tests";
    std::abort();
  }
  Device device_;
};

}  // namespace tpserve
