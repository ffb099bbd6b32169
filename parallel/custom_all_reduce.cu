// The custom all-reduce kernels (see custom_all_reduce.h for the buffer layout and the epoch
// protocol). The data is cut into 16-byte units (8 bf16 or 4 f32; the last one may be partial);
// every rank cuts it the same way whatever the tensor's alignment, and block b of every rank
// owns the same units, so a block only waits for the same block of its peers.
//  one-shot: stage own input into own buffer, signal, sum every rank's copy of the block's units
//            in rank order 0..n-1 (fp32) into the tensor.
//  two-shot: stage, signal; reduce this rank's segment (1/n of the units) in rank order into own
//            buffer and the tensor, signal; copy the other ranks' reduced segments.
// Both compute each element as the same fp32 sum in rank order rounded once, so all ranks (and
// both algorithms) give bit-identical results.
//  all-gather: stage own bytes, signal, copy every rank's staged copy of the block's units to
//            that rank's slot of the output (a one-shot without the sum).
//  all-reduce + add + RMSNorm: a one-shot over whole rows (block b: rows b, b + kBlocks, ...),
//            then the residual add and the norm of each summed row in the same block.
//  send / recv: the sender copies the block's units into its slot for the receiver once the
//            slot's previous message was acknowledged, then signals; the receiver waits for the
//            signal, copies the units out of the sender's slot, then acknowledges.
#include <cuda_bf16.h>

#include "kernels/cuda/cuda_util.cuh"  // Bf16x8, BlockSum: the norm kernel's arithmetic
#include "parallel/custom_all_reduce.h"

namespace tpserve::car {
namespace {

__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t* Flag(char* buffer, int phase, int block, int src) {
  return reinterpret_cast<uint64_t*>(buffer) + (phase * kBlocks + block) * kMaxRanks + src;
}

// Element types as raw bits: bf16 as uint16_t, f32 as float.
template <typename Raw>
struct Elem;
template <>
struct Elem<uint16_t> {
  __device__ static float ToFloat(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }
  __device__ static uint16_t FromFloat(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};
template <>
struct Elem<float> {
  __device__ static float ToFloat(float f) { return f; }
  __device__ static float FromFloat(float f) { return f; }
};

constexpr int kUnitBytes = 16;

template <typename Raw>
struct Unit {
  static constexpr int kElems = kUnitBytes / sizeof(Raw);
  union {
    uint4 v;
    Raw e[kElems];
  };
};

struct Range {
  int64_t begin = 0;
  int64_t end = 0;
};

// Block `block`'s share of units [begin, end).
__device__ __forceinline__ Range BlockShare(int64_t begin, int64_t end, int block) {
  const int64_t per = (end - begin + kBlocks - 1) / kBlocks;
  Range r;
  r.begin = min(end, begin + block * per);
  r.end = min(end, r.begin + per);
  return r;
}

// Rank j's segment of `units` (two-shot).
__device__ __forceinline__ Range Segment(int64_t units, int nranks, int j) {
  const int64_t per = (units + nranks - 1) / nranks;
  Range r;
  r.begin = min(units, j * per);
  r.end = min(units, r.begin + per);
  return r;
}

struct Kernel {
  const LaunchArgs& a;  // the kernel's __grid_constant__ parameter, read in place
  uint64_t epoch;
  uint64_t deadline;
  int* abort_shared;

  __device__ char* Data(int rank) const {
    return a.buffers[rank] + kFlagBytes + (epoch & 1) * a.max_bytes;
  }

  // After every thread's writes of this phase: make them visible to the peers, then raise this
  // block's flag in every rank's buffer.
  __device__ void Signal(int phase) const {
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < a.nranks) {
      StoreReleaseSys(Flag(a.buffers[threadIdx.x], phase, blockIdx.x, a.rank), epoch);
    }
  }

  // One thread: spins until *flag >= target, with the deadline. Gives up (recording `phase` and
  // `peer`) past the deadline, or stops when another thread or block gave up; the caller then
  // synchronises the block and asks Ok().
  __device__ void Spin(const uint64_t* flag, uint64_t target, int phase, int peer) const {
    uint64_t seen = LoadAcquireSys(flag);
    while (seen < target) {
      // Another thread of this block, or another block, gave up: this call is lost anyway.
      if (*reinterpret_cast<volatile int*>(abort_shared) != 0) break;
      if (*reinterpret_cast<volatile uint32_t*>(a.abort) != 0) {
        *reinterpret_cast<volatile int*>(abort_shared) = 1;
        break;
      }
      if (GlobalTimerNs() > deadline) {
        GiveUp(phase, peer, seen);
        break;
      }
      __nanosleep(64);
      seen = LoadAcquireSys(flag);
    }
  }

  __device__ bool Ok() const { return *reinterpret_cast<volatile int*>(abort_shared) == 0; }

  // Waits until every rank's block blockIdx.x raised its flag of `phase` for this epoch (thread t
  // watches rank t). False when a peer missed the deadline: the block must return.
  __device__ bool Wait(int phase) const {
    if (threadIdx.x < a.nranks) {
      Spin(Flag(a.buffers[a.rank], phase, blockIdx.x, threadIdx.x), epoch, phase, threadIdx.x);
    }
    __syncthreads();
    return Ok();
  }

  __device__ void GiveUp(int phase, int peer, uint64_t seen) const {
    *reinterpret_cast<volatile int*>(abort_shared) = 1;
    if (atomicCAS(a.abort, 0u, 1u) == 0u) {  // the first block to give up writes the record
      a.error->block = blockIdx.x;
      a.error->peer = peer;
      a.error->phase = phase;
      a.error->epoch = epoch;
      a.error->seen = seen;
      __threadfence_system();
      a.error->set = 1;
      __threadfence_system();
    }
  }
};

template <typename Raw>
__device__ __forceinline__ int UnitCount(int64_t u, int64_t numel) {
  const int64_t first = u * Unit<Raw>::kElems;
  const int64_t left = numel - first;
  return left < Unit<Raw>::kElems ? static_cast<int>(left) : Unit<Raw>::kElems;
}

// Loads unit u of the tensor (vector load when aligned and full).
template <typename Raw>
__device__ __forceinline__ Unit<Raw> LoadTensorUnit(const Raw* t, int64_t u, int64_t numel,
                                                    bool aligned) {
  Unit<Raw> x;
  const int n = UnitCount<Raw>(u, numel);
  if (aligned && n == Unit<Raw>::kElems) {
    x.v = *reinterpret_cast<const uint4*>(t + u * Unit<Raw>::kElems);
  } else {
    for (int i = 0; i < n; ++i) x.e[i] = t[u * Unit<Raw>::kElems + i];
  }
  return x;
}

template <typename Raw>
__device__ __forceinline__ void StoreTensorUnit(Raw* t, int64_t u, int64_t numel, bool aligned,
                                                const Unit<Raw>& x) {
  const int n = UnitCount<Raw>(u, numel);
  if (aligned && n == Unit<Raw>::kElems) {
    *reinterpret_cast<uint4*>(t + u * Unit<Raw>::kElems) = x.v;
  } else {
    for (int i = 0; i < n; ++i) t[u * Unit<Raw>::kElems + i] = x.e[i];
  }
}

// IPC buffers are 16-byte aligned and as long as the tensor rounded up to whole units: whole-unit
// accesses, bypassing L1 (peers write them).
__device__ __forceinline__ uint4 LoadBufferUnit(const char* data, int64_t u) {
  return __ldcg(reinterpret_cast<const uint4*>(data) + u);
}
__device__ __forceinline__ void StoreBufferUnit(char* data, int64_t u, uint4 v) {
  __stcg(reinterpret_cast<uint4*>(data) + u, v);
}

// The fp32 sum in rank order 0..n-1 of unit u of every rank's staged copy.
template <typename Raw>
__device__ __forceinline__ Unit<Raw> SumUnit(const Kernel& k, int64_t u) {
  float acc[Unit<Raw>::kElems];
  for (int r = 0; r < k.a.nranks; ++r) {
    Unit<Raw> x;
    x.v = LoadBufferUnit(k.Data(r), u);
#pragma unroll
    for (int i = 0; i < Unit<Raw>::kElems; ++i) {
      const float f = Elem<Raw>::ToFloat(x.e[i]);
      acc[i] = r == 0 ? f : acc[i] + f;
    }
  }
  Unit<Raw> out;
#pragma unroll
  for (int i = 0; i < Unit<Raw>::kElems; ++i) out.e[i] = Elem<Raw>::FromFloat(acc[i]);
  return out;
}

template <typename Raw>
__device__ __forceinline__ void Stage(const Kernel& k, Range units) {
  const Raw* t = static_cast<const Raw*>(k.a.data);
  const bool aligned = (reinterpret_cast<uintptr_t>(t) % kUnitBytes) == 0;
  char* mine = k.Data(k.a.rank);
  for (int64_t u = units.begin + threadIdx.x; u < units.end; u += blockDim.x) {
    StoreBufferUnit(mine, u, LoadTensorUnit(t, u, k.a.numel, aligned).v);
  }
}

template <typename Raw>
__device__ __forceinline__ void OneShot(const Kernel& k, Raw* t, bool aligned, int64_t units) {
  const Range mine = BlockShare(0, units, blockIdx.x);
  Stage<Raw>(k, mine);
  k.Signal(0);
  if (!k.Wait(0)) return;
  for (int64_t u = mine.begin + threadIdx.x; u < mine.end; u += blockDim.x) {
    StoreTensorUnit(t, u, k.a.numel, aligned, SumUnit<Raw>(k, u));
  }
}

template <typename Raw>
__device__ __forceinline__ void TwoShot(const Kernel& k, Raw* t, bool aligned, int64_t units) {
  const int rank = k.a.rank;
  for (int j = 0; j < k.a.nranks; ++j) {
    const Range seg = Segment(units, k.a.nranks, j);
    Stage<Raw>(k, BlockShare(seg.begin, seg.end, blockIdx.x));
  }
  k.Signal(0);
  if (!k.Wait(0)) return;
  const Range own_seg = Segment(units, k.a.nranks, rank);
  const Range own = BlockShare(own_seg.begin, own_seg.end, blockIdx.x);
  char* own_data = k.Data(rank);
  for (int64_t u = own.begin + threadIdx.x; u < own.end; u += blockDim.x) {
    const Unit<Raw> sum = SumUnit<Raw>(k, u);
    StoreBufferUnit(own_data, u, sum.v);  // only this thread reads unit u of own buffer now
    StoreTensorUnit(t, u, k.a.numel, aligned, sum);
  }
  k.Signal(1);
  if (!k.Wait(1)) return;
  for (int j = 0; j < k.a.nranks; ++j) {
    if (j == rank) continue;
    const Range seg = Segment(units, k.a.nranks, j);
    const Range part = BlockShare(seg.begin, seg.end, blockIdx.x);
    const char* peer = k.Data(j);
    for (int64_t u = part.begin + threadIdx.x; u < part.end; u += blockDim.x) {
      Unit<Raw> x;
      x.v = LoadBufferUnit(peer, u);
      StoreTensorUnit(t, u, k.a.numel, aligned, x);
    }
  }
}

// Every kernel's start: advance this block's counter in `counters` (the collectives' epochs, or a
// pair's message count; one per call, whatever the kind of call). False when an earlier call gave
// up: the block must return.
__device__ __forceinline__ bool BeginCall(const LaunchArgs& a, uint64_t* counters,
                                          int* abort_shared, uint64_t* epoch_shared) {
  if (threadIdx.x == 0) {
    *abort_shared = *reinterpret_cast<volatile uint32_t*>(a.abort) != 0;  // an earlier call gave up
    *epoch_shared = counters[blockIdx.x] + 1;
    counters[blockIdx.x] = *epoch_shared;
  }
  __syncthreads();
  return *abort_shared == 0;
}

template <typename Raw, bool kTwoShot>
__global__ void __launch_bounds__(kThreads) AllReduceKernel(const __grid_constant__ LaunchArgs a) {
  __shared__ int abort_shared;
  __shared__ uint64_t epoch_shared;
  if (!BeginCall(a, a.epochs, &abort_shared, &epoch_shared)) return;
  const Kernel k{a, epoch_shared, GlobalTimerNs() + a.timeout_ns, &abort_shared};
  Raw* t = static_cast<Raw*>(a.data);
  const bool aligned = (reinterpret_cast<uintptr_t>(t) % kUnitBytes) == 0;
  const int64_t units = (a.numel + Unit<Raw>::kElems - 1) / Unit<Raw>::kElems;
  if constexpr (kTwoShot) {
    TwoShot<Raw>(k, t, aligned, units);
  } else {
    OneShot<Raw>(k, t, aligned, units);
  }
}

template <typename Raw>
cudaError_t Launch(const LaunchArgs& args, cudaStream_t stream) {
  if (args.two_shot) {
    AllReduceKernel<Raw, true><<<kBlocks, kThreads, 0, stream>>>(args);
  } else {
    AllReduceKernel<Raw, false><<<kBlocks, kThreads, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

// Unit u (16 bytes, the last one maybe partial) of a byte array of `bytes` bytes.
union ByteUnit {
  uint4 v;
  char b[kUnitBytes];
};

__device__ __forceinline__ uint4 LoadByteUnit(const char* p, int64_t u, int64_t bytes) {
  ByteUnit x;
  const int64_t first = u * kUnitBytes;
  if (bytes - first >= kUnitBytes && (reinterpret_cast<uintptr_t>(p + first) % kUnitBytes) == 0) {
    x.v = *reinterpret_cast<const uint4*>(p + first);
  } else {
    x.v = make_uint4(0, 0, 0, 0);
    for (int64_t i = first; i < bytes && i < first + kUnitBytes; ++i) x.b[i - first] = p[i];
  }
  return x.v;
}

__device__ __forceinline__ void StoreByteUnit(char* p, int64_t u, int64_t bytes, uint4 v) {
  ByteUnit x;
  x.v = v;
  const int64_t first = u * kUnitBytes;
  if (bytes - first >= kUnitBytes && (reinterpret_cast<uintptr_t>(p + first) % kUnitBytes) == 0) {
    *reinterpret_cast<uint4*>(p + first) = x.v;
  } else {
    for (int64_t i = first; i < bytes && i < first + kUnitBytes; ++i) p[i] = x.b[i - first];
  }
}

// This block's share of a message of `bytes` bytes (the same on every rank for the same size).
__device__ __forceinline__ Range ByteShare(int64_t bytes) {
  return BlockShare(0, (bytes + kUnitBytes - 1) / kUnitBytes, blockIdx.x);
}

// The units `share` of the byte array `in` into the IPC buffer area `staged`, and back out.
__device__ __forceinline__ void StageBytes(char* staged, const char* in, int64_t bytes,
                                           Range share) {
  for (int64_t u = share.begin + threadIdx.x; u < share.end; u += blockDim.x) {
    StoreBufferUnit(staged, u, LoadByteUnit(in, u, bytes));
  }
}
__device__ __forceinline__ void UnstageBytes(char* out, const char* staged, int64_t bytes,
                                             Range share) {
  for (int64_t u = share.begin + threadIdx.x; u < share.end; u += blockDim.x) {
    StoreByteUnit(out, u, bytes, LoadBufferUnit(staged, u));
  }
}

// One-shot all-gather: stage own bytes, signal, copy every rank's staged bytes of this block's
// units to that rank's slot of the output.
__global__ void __launch_bounds__(kThreads) AllGatherKernel(const __grid_constant__ LaunchArgs a) {
  __shared__ int abort_shared;
  __shared__ uint64_t epoch_shared;
  if (!BeginCall(a, a.epochs, &abort_shared, &epoch_shared)) return;
  const Kernel k{a, epoch_shared, GlobalTimerNs() + a.timeout_ns, &abort_shared};
  const int64_t bytes = a.numel;
  const Range mine = ByteShare(bytes);
  StageBytes(k.Data(a.rank), static_cast<const char*>(a.data), bytes, mine);
  k.Signal(0);
  if (!k.Wait(0)) return;
  for (int j = 0; j < a.nranks; ++j) {
    UnstageBytes(static_cast<char*>(a.out) + j * bytes, k.Data(j), bytes, mine);
  }
}

// One-shot all-reduce + residual add + RMSNorm (see LaunchAllReduceAddRmsNorm). The norm part is
// kernels/cuda/rms_norm.cu's RmsNormKernel<true> line for line (same block size, loops and
// BlockSum), fed with the all-reduce's rounded sum.
__global__ void __launch_bounds__(kNormThreads)
    AllReduceAddRmsNormKernel(const __grid_constant__ LaunchArgs a,
                              const __grid_constant__ NormArgs n) {
  using cuda::Bf16x8;
  __shared__ int abort_shared;
  __shared__ uint64_t epoch_shared;
  __shared__ float scratch[32];
  if (!BeginCall(a, a.epochs, &abort_shared, &epoch_shared)) return;
  const Kernel k{a, epoch_shared, GlobalTimerNs() + a.timeout_ns, &abort_shared};
  const int vecs = n.hidden / 8;  // 16-byte units per row
  const uint4* x = static_cast<const uint4*>(a.data);
  char* staged = k.Data(a.rank);
  for (int64_t row = blockIdx.x; row < n.rows; row += kBlocks) {
    for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
      StoreBufferUnit(staged, row * vecs + i, x[row * vecs + i]);
    }
  }
  k.Signal(0);
  if (!k.Wait(0)) return;
  Bf16x8* residual = static_cast<Bf16x8*>(n.residual);
  const Bf16x8* weight = static_cast<const Bf16x8*>(n.weight);
  Bf16x8* out = static_cast<Bf16x8*>(n.normed);
  for (int64_t row = blockIdx.x; row < n.rows; row += kBlocks) {  // uniform in the block
    const int64_t base = row * vecs;
    float v[kNormMaxVecs][8];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < kNormMaxVecs; ++j) {
      const int i = threadIdx.x + j * kNormThreads;
      if (i < vecs) {
        const Unit<uint16_t> sum = SumUnit<uint16_t>(k, base + i);
        Bf16x8 s8;
        static_assert(sizeof(s8) == sizeof(sum.v), "16-byte units");
        memcpy(&s8, &sum.v, sizeof(s8));
        float fa[8], fr[8];
        cuda::Bf16x8ToFloat(s8, fa);
        cuda::Bf16x8ToFloat(residual[base + i], fr);
#pragma unroll
        for (int e = 0; e < 8; ++e) fr[e] += fa[e];
        const Bf16x8 r8 = cuda::FloatToBf16x8(fr);
        residual[base + i] = r8;
        cuda::Bf16x8ToFloat(r8, v[j]);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += v[j][e] * v[j][e];
      }
    }
    ss = cuda::BlockSum(ss, scratch);
    const float rstd = rsqrtf(ss / n.hidden + n.eps);
#pragma unroll
    for (int j = 0; j < kNormMaxVecs; ++j) {
      const int i = threadIdx.x + j * kNormThreads;
      if (i < vecs) {
        float w[8];
        cuda::Bf16x8ToFloat(weight[i], w);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[j][e] = v[j][e] * rstd * w[e];
        out[base + i] = cuda::FloatToBf16x8(v[j]);
      }
    }
  }
}

// Point-to-point: flag (src, block) raised by src in dst's buffer; ack (dst, block) raised by dst
// in src's buffer; src's slots for dst in src's buffer (see custom_all_reduce.h).
__device__ __forceinline__ uint64_t* P2pSentFlag(char* buffer, int src, int block) {
  return reinterpret_cast<uint64_t*>(buffer) + kP2pSentFlags + src * kBlocks + block;
}
__device__ __forceinline__ uint64_t* P2pAckFlag(char* buffer, int dst, int block) {
  return reinterpret_cast<uint64_t*>(buffer) + kP2pAckFlags + dst * kBlocks + block;
}
__device__ __forceinline__ char* P2pSlot(const LaunchArgs& a, int src, int dst, uint64_t n) {
  const int region = dst < src ? dst : dst - 1;  // src has no region for itself
  return a.buffers[src] + kFlagBytes + 2 * a.max_bytes +
         (static_cast<size_t>(region) * 2 + (n & 1)) * a.p2p_max_bytes;
}

// After every thread's accesses: make them visible (writes) or complete (reads) system-wide, then
// raise `flag` (in a peer's buffer) to `value`.
__device__ __forceinline__ void Release(uint64_t* flag, uint64_t value) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) StoreReleaseSys(flag, value);
}

__global__ void __launch_bounds__(kThreads) SendKernel(const __grid_constant__ LaunchArgs a) {
  __shared__ int abort_shared;
  __shared__ uint64_t seq_shared;
  if (!BeginCall(a, a.epochs + kSendCounters + a.peer * kBlocks, &abort_shared, &seq_shared)) {
    return;
  }
  const Kernel k{a, seq_shared, GlobalTimerNs() + a.timeout_ns, &abort_shared};
  const uint64_t n = seq_shared;
  // Slot n % 2 last held message n - 2: every block of the receiver must have read its share
  // (shares differ with the message size, so all of them). Thread t watches block t.
  if (n > 2 && threadIdx.x < kBlocks) {
    k.Spin(P2pAckFlag(a.buffers[a.rank], a.peer, threadIdx.x), n - 2, kWaitSlotFree, a.peer);
  }
  __syncthreads();
  if (!k.Ok()) return;
  StageBytes(P2pSlot(a, a.rank, a.peer, n), static_cast<const char*>(a.data), a.numel,
             ByteShare(a.numel));
  Release(P2pSentFlag(a.buffers[a.peer], a.rank, blockIdx.x), n);
}

__global__ void __launch_bounds__(kThreads) RecvKernel(const __grid_constant__ LaunchArgs a) {
  __shared__ int abort_shared;
  __shared__ uint64_t seq_shared;
  if (!BeginCall(a, a.epochs + kRecvCounters + a.peer * kBlocks, &abort_shared, &seq_shared)) {
    return;
  }
  const Kernel k{a, seq_shared, GlobalTimerNs() + a.timeout_ns, &abort_shared};
  const uint64_t n = seq_shared;
  if (threadIdx.x == 0) {
    k.Spin(P2pSentFlag(a.buffers[a.rank], a.peer, blockIdx.x), n, kWaitMessage, a.peer);
  }
  __syncthreads();
  if (!k.Ok()) return;
  UnstageBytes(static_cast<char*>(a.data), P2pSlot(a, a.peer, a.rank, n), a.numel,
               ByteShare(a.numel));
  Release(P2pAckFlag(a.buffers[a.peer], a.rank, blockIdx.x), n);
}

bool ValidGroup(const LaunchArgs& a) {
  return a.nranks >= 1 && a.nranks <= kMaxRanks && a.rank >= 0 && a.rank < a.nranks && a.numel >= 0;
}

bool ValidP2p(const LaunchArgs& a) {
  return ValidGroup(a) && a.peer >= 0 && a.peer < a.nranks && a.peer != a.rank &&
         static_cast<size_t>(a.numel) <= a.p2p_max_bytes && (a.numel == 0 || a.data != nullptr);
}

}  // namespace

cudaError_t LaunchSend(const LaunchArgs& args, cudaStream_t stream) {
  if (!ValidP2p(args)) return cudaErrorInvalidValue;
  if (args.numel == 0) return cudaSuccess;
  SendKernel<<<kBlocks, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t LaunchRecv(const LaunchArgs& args, cudaStream_t stream) {
  if (!ValidP2p(args)) return cudaErrorInvalidValue;
  if (args.numel == 0) return cudaSuccess;
  RecvKernel<<<kBlocks, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t LaunchAllGather(const LaunchArgs& args, cudaStream_t stream) {
  if (!ValidGroup(args) || static_cast<size_t>(args.numel) > args.max_bytes ||
      (args.numel > 0 && (args.data == nullptr || args.out == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (args.numel == 0) return cudaSuccess;
  AllGatherKernel<<<kBlocks, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t LaunchAllReduceAddRmsNorm(const LaunchArgs& args, const NormArgs& norm,
                                      cudaStream_t stream) {
  if (!ValidGroup(args) || args.f32 || args.two_shot || norm.rows < 0 || norm.hidden <= 0 ||
      norm.hidden % 8 != 0 || norm.hidden > kNormThreads * 8 * kNormMaxVecs ||
      args.numel != norm.rows * norm.hidden ||
      static_cast<size_t>(args.numel) * 2 > args.max_bytes || norm.residual == nullptr ||
      norm.weight == nullptr || norm.normed == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (args.numel == 0) return cudaSuccess;
  AllReduceAddRmsNormKernel<<<kBlocks, kNormThreads, 0, stream>>>(args, norm);
  return cudaGetLastError();
}

cudaError_t LaunchAllReduce(const LaunchArgs& args, cudaStream_t stream) {
  if (!ValidGroup(args) || static_cast<size_t>(args.numel) * (args.f32 ? 4 : 2) > args.max_bytes) {
    return cudaErrorInvalidValue;
  }
  if (args.numel == 0) return cudaSuccess;
  return args.f32 ? Launch<float>(args, stream) : Launch<uint16_t>(args, stream);
}

}  // namespace tpserve::car
