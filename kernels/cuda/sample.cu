// GPU sampling (see sample.h). Per row: argmax (greedy), or probabilities e_i = exp(x_i - max x)
// with x = logits / temperature, packed as 64-bit keys (probability bits, then ~id) so that one
// segmented radix sort orders candidates by (probability desc, id asc) with no ties; then a
// block scan in double precision applies top-k, top-p and the Philox draw. Rows that ask for
// log-probabilities then get, one block each, an fp32 logsumexp over the vocabulary and the top
// N (a sorted list of N per thread, merged by N block arg-max rounds over the list heads).
#include "kernels/cuda/sample.h"

#include <climits>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/philox.h"

namespace tpserve::cuda {
namespace {

constexpr int kThreads = 1024;
// Rows sorted per pass, so that scratch stays near 64 MB for large vocabularies.
constexpr int64_t kMaxSortElems = int64_t{4} << 20;

__device__ __forceinline__ float LoadLogit(const float* p) { return *p; }
__device__ __forceinline__ float LoadLogit(const __nv_bfloat16* p) { return __bfloat162float(*p); }

struct ArgMax {
  float v;
  int i;
};
struct ArgMaxOp {
  __device__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    if (a.v > b.v || (a.v == b.v && a.i < b.i)) return a;
    return b;
  }
};

// Greedy rows write their id; sampled rows write their keys and segment bounds.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    PrepareKernel(const T* __restrict__ logits, int64_t row_stride, int vocab, int row0,
                  const DeviceSampleParams* __restrict__ params, uint64_t* __restrict__ keys,
                  int32_t* __restrict__ seg_begin, int32_t* __restrict__ seg_end,
                  int32_t* __restrict__ ids) {
  using Reduce = cub::BlockReduce<ArgMax, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ ArgMax best_s;
  const int r = blockIdx.x;  // row within this pass
  const int row = row0 + r;
  const T* l = logits + row * row_stride;
  ArgMax best{-INFINITY, vocab};
  for (int i = threadIdx.x; i < vocab; i += kThreads) {
    float v = LoadLogit(l + i);
    if (v > best.v || (v == best.v && i < best.i)) best = {v, i};
  }
  best = Reduce(tmp).Reduce(best, ArgMaxOp());
  if (threadIdx.x == 0) best_s = best;
  __syncthreads();
  best = best_s;
  const DeviceSampleParams p = params[row];
  const int32_t base = r * vocab;
  if (!(p.temperature > 0.0f)) {
    if (threadIdx.x == 0) {
      ids[row] = best.i < vocab ? best.i : 0;
      seg_begin[r] = base;
      seg_end[r] = base;  // empty segment: nothing to sort
    }
    return;
  }
  if (threadIdx.x == 0) {
    seg_begin[r] = base;
    seg_end[r] = base + vocab;
  }
  const float xmax = best.v / p.temperature;
  for (int i = threadIdx.x; i < vocab; i += kThreads) {
    float e = expf(LoadLogit(l + i) / p.temperature - xmax);
    keys[base + i] = (static_cast<uint64_t>(__float_as_uint(e)) << 32) |
                     static_cast<uint64_t>(0xFFFFFFFFu - static_cast<uint32_t>(i));
  }
}

constexpr int kLogprobThreads = 256;

struct FloatMaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// One row's log-probabilities as they cross to the host.
struct DeviceLogprobs {
  float chosen;  // of the sampled id
  int32_t count;
  int32_t ids[kMaxLogprobs];
  float logprobs[kMaxLogprobs];
};

// One block per row; rows that did not ask return at once. Runs after the ids are chosen.
template <typename T>
__global__ void __launch_bounds__(kLogprobThreads)
    LogprobKernel(const T* __restrict__ logits, int64_t row_stride, int vocab,
                  const DeviceSampleParams* __restrict__ params, const int32_t* __restrict__ ids,
                  DeviceLogprobs* __restrict__ out) {
  const int row = blockIdx.x;
  const DeviceSampleParams p = params[row];
  if (p.logprobs < 0) return;
  const T* l = logits + row * row_stride;
  const int n = min(p.logprobs, min(vocab, kMaxLogprobs));
  // Pass 1: the maximum, and this thread's n best by (value desc, id asc), sorted. A thread
  // visits ids in ascending order, so an equal value never displaces an earlier one.
  float top_v[kMaxLogprobs];
  int top_i[kMaxLogprobs];
  int have = 0;
  float local_max = -INFINITY;
  for (int i = threadIdx.x; i < vocab; i += kLogprobThreads) {
    const float v = LoadLogit(l + i);
    local_max = fmaxf(local_max, v);
    if (n > 0 && (have < n || v > top_v[n - 1])) {
      int j = have < n ? have++ : n - 1;
      for (; j > 0 && v > top_v[j - 1]; --j) {
        top_v[j] = top_v[j - 1];
        top_i[j] = top_i[j - 1];
      }
      top_v[j] = v;
      top_i[j] = i;
    }
  }
  using FloatReduce = cub::BlockReduce<float, kLogprobThreads>;
  using ArgReduce = cub::BlockReduce<ArgMax, kLogprobThreads>;
  __shared__ union {
    typename FloatReduce::TempStorage f;
    typename ArgReduce::TempStorage a;
  } tmp;
  __shared__ float max_s, log_sum_s;
  __shared__ ArgMax win_s;
  float m = FloatReduce(tmp.f).Reduce(local_max, FloatMaxOp());
  if (threadIdx.x == 0) max_s = m;
  __syncthreads();
  m = max_s;
  // Pass 2: sum of exp(x - max), so that logprob(x) = x - max - log(sum).
  float sum = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += kLogprobThreads) sum += expf(LoadLogit(l + i) - m);
  sum = FloatReduce(tmp.f).Sum(sum);
  if (threadIdx.x == 0) log_sum_s = logf(sum);
  __syncthreads();
  const float log_sum = log_sum_s;
  DeviceLogprobs& o = out[p.logprob_slot];
  // Merge: n rounds, each taking the best of the threads' list heads.
  int next = 0;
  for (int k = 0; k < n; ++k) {
    ArgMax mine = next < have ? ArgMax{top_v[next], top_i[next]} : ArgMax{-INFINITY, INT_MAX};
    ArgMax best = ArgReduce(tmp.a).Reduce(mine, ArgMaxOp());
    if (threadIdx.x == 0) win_s = best;
    __syncthreads();
    best = win_s;
    if (next < have && top_i[next] == best.i) ++next;
    if (threadIdx.x == 0) {
      o.ids[k] = best.i;
      o.logprobs[k] = (best.v - m) - log_sum;
    }
    __syncthreads();  // win_s and tmp are reused
  }
  if (threadIdx.x == 0) {
    o.chosen = (LoadLogit(l + ids[row]) - m) - log_sum;
    o.count = n;
  }
}

__device__ __forceinline__ double KeyProb(uint64_t k) {
  return static_cast<double>(__uint_as_float(static_cast<uint32_t>(k >> 32)));
}
__device__ __forceinline__ int KeyId(uint64_t k) {
  return static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(k));
}

// Index of the first sorted candidate (< limit) whose inclusive cumulative mass satisfies
// cum > target (strict) or cum >= target; limit - 1 if none does.
__device__ int FirstCrossing(const uint64_t* sorted, int limit, double target, bool strict,
                             double* total_out) {
  using Scan = cub::BlockScan<double, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int found_s;
  __shared__ double carry_s;
  if (threadIdx.x == 0) {
    found_s = limit;
    carry_s = 0.0;
  }
  __syncthreads();
  for (int base = 0; base < limit; base += kThreads) {
    int i = base + threadIdx.x;
    double p = i < limit ? KeyProb(sorted[i]) : 0.0;
    double incl, chunk_total;
    Scan(scan_tmp).InclusiveSum(p, incl, chunk_total);
    double cum = carry_s + incl;
    bool hit = i < limit && (strict ? cum > target : cum >= target);
    if (hit) atomicMin(&found_s, i);
    __syncthreads();
    if (threadIdx.x == 0) carry_s += chunk_total;
    __syncthreads();
    if (found_s < limit) break;
  }
  int found = found_s;
  if (total_out != nullptr) *total_out = carry_s;
  return found < limit ? found : limit - 1;
}

__global__ void __launch_bounds__(kThreads)
    ChooseKernel(const uint64_t* __restrict__ sorted, int vocab, int row0,
                 const DeviceSampleParams* __restrict__ params, int32_t* __restrict__ ids) {
  const int r = blockIdx.x, row = row0 + r;
  const DeviceSampleParams p = params[row];
  if (!(p.temperature > 0.0f)) return;
  const uint64_t* s = sorted + static_cast<int64_t>(r) * vocab;
  int keep = p.top_k > 0 ? min(p.top_k, vocab) : vocab;
  // Mass of the top-k candidates (the top-p cut is relative to it).
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage red_tmp;
  __shared__ double mass_s;
  double part = 0.0;
  for (int i = threadIdx.x; i < keep; i += kThreads) part += KeyProb(s[i]);
  double mass = Reduce(red_tmp).Sum(part);
  if (threadIdx.x == 0) mass_s = mass;
  __syncthreads();
  mass = mass_s;
  if (p.top_p < 1.0f) {
    int last = FirstCrossing(s, keep, static_cast<double>(p.top_p) * mass, false, nullptr);
    keep = last + 1;
  }
  __syncthreads();
  double total = 0.0;
  for (int i = threadIdx.x; i < keep; i += kThreads) total += KeyProb(s[i]);
  total = Reduce(red_tmp).Sum(total);
  __syncthreads();
  if (threadIdx.x == 0) mass_s = total;
  __syncthreads();
  total = mass_s;
  int chosen = FirstCrossing(s, keep, static_cast<double>(p.u) * total, true, nullptr);
  if (threadIdx.x == 0) ids[row] = KeyId(s[chosen]);
}

}  // namespace

GpuSampler::~GpuSampler() {
  cudaFree(keys_in_);
  cudaFree(keys_out_);
  cudaFree(seg_begin_);
  cudaFree(seg_end_);
  cudaFree(params_dev_);
  cudaFree(ids_dev_);
  cudaFree(sort_temp_);
  cudaFree(logprobs_dev_);
  for (Slot& slot : slots_) {
    cudaFreeHost(slot.params_host);
    cudaFreeHost(slot.ids_host);
    cudaFreeHost(slot.logprobs_host);
    if (slot.done != nullptr) cudaEventDestroy(slot.done);
  }
}

void GpuSampler::ReserveRows(int rows, Slot& slot, cudaStream_t stream) {
  // At least 256 rows at once, so that decode batches never grow the buffers while a launch is
  // in flight (growing waits for the stream: the device buffers of the launch in flight, and
  // the ids a fed token may still read, are freed).
  if (rows > cap_rows_) {
    const int cap = std::max(rows, 256);
    TP_CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaFree(params_dev_);
    cudaFree(ids_dev_);
    cudaFree(seg_begin_);
    cudaFree(seg_end_);
    cudaFree(logprobs_dev_);
    TP_CUDA_CHECK(cudaMalloc(&params_dev_, cap * sizeof(DeviceSampleParams)));
    TP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ids_dev_), cap * sizeof(int32_t)));
    TP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&seg_begin_), cap * sizeof(int32_t)));
    TP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&seg_end_), cap * sizeof(int32_t)));
    TP_CUDA_CHECK(cudaMalloc(&logprobs_dev_, cap * sizeof(DeviceLogprobs)));
    cap_rows_ = cap;
  }
  if (slot.done == nullptr) {
    TP_CUDA_CHECK(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
  }
  if (rows > slot.cap) {
    // This slot is not in flight (Launch checks): its host buffers are free to move.
    const int cap = std::max(rows, 256);
    cudaFreeHost(slot.params_host);
    cudaFreeHost(slot.ids_host);
    cudaFreeHost(slot.logprobs_host);
    TP_CUDA_CHECK(cudaMallocHost(&slot.params_host, cap * sizeof(DeviceSampleParams)));
    TP_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&slot.ids_host), cap * sizeof(int32_t)));
    TP_CUDA_CHECK(cudaMallocHost(&slot.logprobs_host, cap * sizeof(DeviceLogprobs)));
    slot.cap = cap;
  }
}

void GpuSampler::ReserveSort(int64_t elems, int segments, cudaStream_t stream) {
  if (elems > sort_elems_cap_) {
    TP_CUDA_CHECK(cudaStreamSynchronize(stream));  // a launch in flight may still sort
    cudaFree(keys_in_);
    cudaFree(keys_out_);
    TP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&keys_in_), elems * sizeof(uint64_t)));
    TP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&keys_out_), elems * sizeof(uint64_t)));
    sort_elems_cap_ = elems;
  }
  size_t bytes = 0;
  TP_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortKeysDescending(
      nullptr, bytes, keys_in_, keys_out_, static_cast<int>(elems), segments, seg_begin_,
      seg_end_));
  if (bytes > sort_temp_bytes_) {
    TP_CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaFree(sort_temp_);
    TP_CUDA_CHECK(cudaMalloc(&sort_temp_, bytes));
    sort_temp_bytes_ = bytes;
  }
}

std::vector<int32_t> GpuSampler::Sample(const Tensor& logits, int64_t vocab_size,
                                        const std::vector<SamplingParams>& params,
                                        std::vector<std::optional<TokenLogprobs>>* logprobs,
                                        cudaStream_t stream) {
  TP_CHECK(in_flight_.empty()) << "Sample while " << in_flight_.size()
                               << " asynchronous samplings are in flight";
  // Launch refuses a row that asks for logprobs when there is no output vector.
  Launch(logits, vocab_size, params, logprobs != nullptr, stream);
  return Wait(logprobs);
}

void GpuSampler::Launch(const Tensor& logits, int64_t vocab_size,
                        const std::vector<SamplingParams>& params, bool want_logprobs,
                        cudaStream_t stream) {
  const int rows = static_cast<int>(params.size());
  TP_CHECK(logits.device == Device::kCuda &&
           (logits.dtype == DType::kF32 || logits.dtype == DType::kBF16) && logits.ndim == 2 &&
           logits.dim(0) == rows && vocab_size > 0 && vocab_size <= logits.dim(1) &&
           vocab_size < kMaxSortElems)
      << "Sample: logits " << logits.ShapeString() << " (f32 or bf16 [rows, V] on the GPU), "
      << rows << " params, vocab_size " << vocab_size;
  TP_CHECK(in_flight_.size() < 2) << "Sample: two samplings already in flight";
  const int slot_index = next_slot_;
  next_slot_ ^= 1;
  Slot& slot = slots_[slot_index];
  ReserveRows(std::max(rows, 1), slot, stream);
  const int vocab = static_cast<int>(vocab_size);
  auto* hp = static_cast<DeviceSampleParams*>(slot.params_host);
  bool any_sampled = false;
  int logprob_rows = 0;
  for (int r = 0; r < rows; ++r) {
    const SamplingParams& p = params[r];
    TP_CHECK(p.top_k >= 0 && p.top_p > 0.0f && p.top_p <= 1.0f && p.temperature >= 0.0f &&
             p.logprobs >= -1 && p.logprobs <= kMaxLogprobs && (p.logprobs < 0 || want_logprobs))
        << "Sample: row " << r << " has temperature " << p.temperature << ", top_k " << p.top_k
        << ", top_p " << p.top_p << ", logprobs " << p.logprobs << " (at most " << kMaxLogprobs
        << ", and only with an output vector)";
    // Greedy below kGreedyTemperature: the kernels treat temperature 0 as argmax.
    const float temperature = IsGreedy(p.temperature) ? 0.0f : p.temperature;
    hp[r] = {temperature, p.top_k,
             p.top_p,     PhiloxUniform(p.seed, static_cast<uint64_t>(p.position)),
             p.logprobs,  p.logprobs >= 0 ? logprob_rows++ : -1};
    any_sampled |= temperature > 0.0f;
  }
  slot.rows = rows;
  slot.logprob_rows = logprob_rows;
  latest_rows_ = rows;
  if (rows > 0) {
    TP_CUDA_CHECK(cudaMemcpyAsync(params_dev_, slot.params_host, rows * sizeof(DeviceSampleParams),
                                  cudaMemcpyHostToDevice, stream));
    const int pass_rows =
        any_sampled
            ? static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, kMaxSortElems / vocab)))
            : rows;
    if (any_sampled) ReserveSort(int64_t{pass_rows} * vocab, pass_rows, stream);
    const auto* dp = static_cast<const DeviceSampleParams*>(params_dev_);
    for (int row0 = 0; row0 < rows; row0 += pass_rows) {
      const int n = std::min(pass_rows, rows - row0);
      if (logits.dtype == DType::kF32) {
        PrepareKernel<<<n, kThreads, 0, stream>>>(logits.ptr<const float>(), logits.dim(1), vocab,
                                                  row0, dp, keys_in_, seg_begin_, seg_end_,
                                                  ids_dev_);
      } else {
        PrepareKernel<<<n, kThreads, 0, stream>>>(logits.ptr<const __nv_bfloat16>(), logits.dim(1),
                                                  vocab, row0, dp, keys_in_, seg_begin_, seg_end_,
                                                  ids_dev_);
      }
      TP_CUDA_CHECK_LAUNCH();
      if (!any_sampled) continue;
      size_t bytes = sort_temp_bytes_;
      TP_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortKeysDescending(
          sort_temp_, bytes, keys_in_, keys_out_, n * vocab, n, seg_begin_, seg_end_, 0, 64,
          stream));
      ChooseKernel<<<n, kThreads, 0, stream>>>(keys_out_, vocab, row0, dp, ids_dev_);
      TP_CUDA_CHECK_LAUNCH();
    }
    auto* lp_dev = static_cast<DeviceLogprobs*>(logprobs_dev_);
    if (logprob_rows > 0) {
      if (logits.dtype == DType::kF32) {
        LogprobKernel<<<rows, kLogprobThreads, 0, stream>>>(
            logits.ptr<const float>(), logits.dim(1), vocab, dp, ids_dev_, lp_dev);
      } else {
        LogprobKernel<<<rows, kLogprobThreads, 0, stream>>>(
            logits.ptr<const __nv_bfloat16>(), logits.dim(1), vocab, dp, ids_dev_, lp_dev);
      }
      TP_CUDA_CHECK_LAUNCH();
      TP_CUDA_CHECK(cudaMemcpyAsync(slot.logprobs_host, lp_dev,
                                    logprob_rows * sizeof(DeviceLogprobs), cudaMemcpyDeviceToHost,
                                    stream));
    }
    TP_CUDA_CHECK(cudaMemcpyAsync(slot.ids_host, ids_dev_, rows * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, stream));
  }
  TP_CUDA_CHECK(cudaEventRecord(slot.done, stream));
  in_flight_.push_back(slot_index);
}

std::vector<int32_t> GpuSampler::Wait(std::vector<std::optional<TokenLogprobs>>* logprobs) {
  TP_CHECK(!in_flight_.empty()) << "Sample: nothing in flight to wait for";
  Slot& slot = slots_[in_flight_.front()];
  in_flight_.erase(in_flight_.begin());
  TP_CUDA_CHECK(cudaEventSynchronize(slot.done));
  if (logprobs != nullptr) logprobs->assign(slot.rows, std::nullopt);
  if (slot.logprob_rows > 0 && logprobs != nullptr) {
    const auto* hp = static_cast<const DeviceSampleParams*>(slot.params_host);
    const auto* lp_host = static_cast<const DeviceLogprobs*>(slot.logprobs_host);
    for (int r = 0; r < slot.rows; ++r) {
      const DeviceSampleParams& p = hp[r];
      if (p.logprob_slot < 0) continue;
      const DeviceLogprobs& d = lp_host[p.logprob_slot];
      TokenLogprobs t;
      t.logprob = d.chosen;
      for (int k = 0; k < d.count; ++k) t.top.push_back({d.ids[k], d.logprobs[k]});
      (*logprobs)[r] = std::move(t);
    }
  }
  return std::vector<int32_t>(slot.ids_host, slot.ids_host + slot.rows);
}

bool GpuSampler::Ready() {
  if (in_flight_.empty()) return true;
  const cudaError_t e = cudaEventQuery(slots_[in_flight_.front()].done);
  if (e == cudaErrorNotReady) return false;
  TP_CUDA_CHECK(e);
  return true;
}

}  // namespace tpserve::cuda
