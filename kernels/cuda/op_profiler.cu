// The op profiler's event bookkeeping, its table, and the stall kernel (see op_profiler.h).
#include "kernels/cuda/op_profiler.h"

#include <algorithm>
#include <cstdio>

#include "common/check.h"

namespace tpserve {

std::string FormatOpProfile(const std::vector<OpProfileRow>& rows, int steps) {
  steps = std::max(steps, 1);
  double step_us = 0, op_us = 0;
  for (const auto& r : rows) (r.op == "step" ? step_us : op_us) += r.total_us;
  const double denom = step_us > 0 ? step_us : op_us;
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "%-22s %-34s %9s %9s %10s %6s %8s\n", "op", "shape", "calls/st",
                "us/call", "us/step", "%", "GB/s");
  out += line;
  auto add = [&](const OpProfileRow& r) {
    const double gbps = r.bytes > 0 && r.total_us > 0 ? r.bytes / (r.total_us * 1e3) : 0;
    std::snprintf(line, sizeof line, "%-22s %-34s %9.1f %9.2f %10.1f %6.1f %8s\n", r.op.c_str(),
                  r.shape.c_str(), double(r.calls) / steps,
                  r.total_us / std::max<int64_t>(r.calls, 1), r.total_us / steps,
                  denom > 0 ? 100 * r.total_us / denom : 0.0,
                  gbps > 0 ? std::to_string(static_cast<int>(gbps + 0.5)).c_str() : "");
    out += line;
  };
  for (const auto& r : rows) {
    if (r.op != "step") add(r);
  }
  std::snprintf(line, sizeof line, "%-22s %-34s %9s %9s %10.1f %6.1f\n", "(sum of ops)", "", "", "",
                op_us / steps, denom > 0 ? 100 * op_us / denom : 0.0);
  out += line;
  for (const auto& r : rows) {
    if (r.op == "step") add(r);
  }
  return out;
}

namespace cuda {
namespace {

__global__ void StallKernel(int64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (static_cast<int64_t>(t - t0) < ns);
}

}  // namespace

void LaunchStall(int us, cudaStream_t stream) {
  StallKernel<<<1, 1, 0, stream>>>(int64_t{us} * 1000);
  TP_CUDA_CHECK_LAUNCH();
}

OpProfiler::~OpProfiler() {
  cudaStreamSynchronize(stream_);
  for (auto& [token, p] : pending_) {
    cudaEventDestroy(p.start);
    cudaEventDestroy(p.end);
  }
  for (auto e : free_events_) cudaEventDestroy(e);
}

cudaEvent_t OpProfiler::NewEvent() {
  if (free_events_.empty()) {
    cudaEvent_t e;
    TP_CUDA_CHECK(cudaEventCreate(&e));
    return e;
  }
  cudaEvent_t e = free_events_.back();
  free_events_.pop_back();
  return e;
}

int OpProfiler::Begin(const char* op, const std::string& shape, double bytes) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TP_CUDA_CHECK(cudaStreamIsCapturing(stream_, &status));
  if (status != cudaStreamCaptureStatusNone) return -1;
  if (pending_.size() >= 8192) Drain();  // bounds the events alive at once
  auto key = std::make_pair(std::string(op), shape);
  auto it = index_.find(key);
  if (it == index_.end()) {
    it = index_.emplace(key, static_cast<int>(rows_.size())).first;
    rows_.push_back(OpProfileRow{op, shape});
  }
  rows_[it->second].calls += 1;
  rows_[it->second].bytes += bytes;
  Pending p{it->second, NewEvent(), NewEvent(), false};
  TP_CUDA_CHECK(cudaEventRecord(p.start, stream_));
  const int token = next_token_++ & 0x3fffffff;
  pending_[token] = p;
  return token;
}

void OpProfiler::End(int token) {
  if (token < 0) return;
  Pending& p = pending_.at(token);
  TP_CUDA_CHECK(cudaEventRecord(p.end, stream_));
  p.ended = true;
}

void OpProfiler::Drain() {
  TP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (auto it = pending_.begin(); it != pending_.end();) {
    Pending& p = it->second;
    if (!p.ended) {  // an open range (a profiled step): stays
      ++it;
      continue;
    }
    float ms = 0;
    TP_CUDA_CHECK(cudaEventElapsedTime(&ms, p.start, p.end));
    rows_[p.row].total_us += ms * 1e3;
    free_events_.push_back(p.start);
    free_events_.push_back(p.end);
    it = pending_.erase(it);
  }
}

std::vector<OpProfileRow> OpProfiler::Take() {
  Drain();
  TP_CHECK(pending_.empty()) << "OpProfiler::Take inside a profiled step";
  std::vector<OpProfileRow> rows = std::move(rows_);
  rows_.clear();
  index_.clear();
  std::stable_sort(rows.begin(), rows.end(), [](const OpProfileRow& a, const OpProfileRow& b) {
    return a.total_us > b.total_us;
  });
  return rows;
}

}  // namespace cuda
}  // namespace tpserve
