// Device helpers shared by the CUDA kernels: bf16 vectors of 8 (16-byte loads), reductions,
// and the host-side shape checks every launcher uses.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "common/check.h"
#include "common/dtype.h"
#include "common/logging.h"

namespace tpserve::cuda {

// log2(e): the attention kernels' softmax runs in the log2 domain (exp2 of scores scaled by it).
inline constexpr float kLog2e = 1.4426950408889634f;

// Eight bf16 values, one 16-byte access.
struct alignas(16) Bf16x8 {
  __nv_bfloat162 h[4];
};

__device__ __forceinline__ void Bf16x8ToFloat(const Bf16x8& v, float f[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(v.h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ Bf16x8 FloatToBf16x8(const float f[8]) {
  Bf16x8 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// The rotation of a RoPE pair (a, b) = elements (i, i + D/2) by the angle with cosine c and sine
// s, each product and sum rounded on its own (no contraction into an FMA), so that every kernel
// that rotates (RopeKvWrite, the GEMMs' RoPE/KV epilogues) gets the same bits.
__device__ __forceinline__ void RopeRotate(float a, float b, float c, float s, float& ra,
                                           float& rb) {
  ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  rb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// silu(g) * u as SiluMul computes it (before its bf16 rounding); the GEMMs that read SiluMul's
// output from gate_up directly use the same expression.
__device__ __forceinline__ float SiluMulValue(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, __expf(-g))), u);
}

// 2^x by one MUFU.EX2, results under 2^-126 flushed to zero (ex2.approx.ftz.f32, what
// --use_fast_math makes of exp2f). exp2f() is ex2.approx.f32, which keeps subnormal results: the
// MUFU flushes them, so the compiler wraps it in a range check and a rescaling. A softmax weight
// under 1e-38 changes no sum it enters.
__device__ __forceinline__ float Exp2Ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Streaming 16-byte load that skips L1 (weights and KV read exactly once).
__device__ __forceinline__ uint4 LoadStreaming(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). All threads get the result.
template <typename T>
__device__ __forceinline__ T BlockSum(T v, T* scratch /* [32] shared */) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : T{0};
  return WarpSum(v);
}

// cos and sin of position * inv_freq[i] for i < half into shared memory (a block per token, as
// the RoPE kernels run), then a barrier.
__device__ __forceinline__ void FillRopeTable(float pos, const float* __restrict__ inv_freq,
                                              int half, float* cos_s, float* sin_s) {
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    sincosf(pos * inv_freq[i], &s, &c);
    cos_s[i] = c;
    sin_s[i] = s;
  }
  __syncthreads();
}

// Programmatic dependent launch (Hopper): a kernel launched with LaunchPdl may start while the
// previous kernel in the stream is still running. Everything before PdlWait() must read only
// data that no kernel of the current forward writes (weights, the batch arrays uploaded by
// SetBatch, KV rows of earlier steps); PdlWait() returns once the previous kernel has completed
// and its writes are visible (read them with LoadProduced, below: an ld.global.nc may be
// scheduled above the wait; a few left so are checked by tools/pdl_sass_check.py). Every
// kernel calls PdlLaunchDependents() early so that the next one can be scheduled onto SMs as soon
// as all of this kernel's blocks are resident. Both are no-ops for a kernel launched without the
// attribute.
__device__ __forceinline__ void PdlWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void PdlLaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A load of data that the previous kernel writes (an activation, q), after PdlWait(): coherent
// and cached in L2 only (ld.global.cg; T: any type __ldcg takes). Not __ldg, LoadStreaming or a
// plain load through a const __restrict__ pointer (nvcc makes those ld.global.nc): ptxas takes an
// ld.global.nc as reading memory that nothing writes while the kernel runs, and may schedule it
// above griddepcontrol.wait when its address is known before the wait. It did so with the bf16
// mma decode kernel's q loads in 7972ea7 (SASS: the LDG.E.128.CONSTANT of q above the ACQBULK),
// which then read the previous kernel's q before RoPE had written it. tools/pdl_sass_check.py
// lists such loads in a cubin.
template <typename T>
__device__ __forceinline__ T LoadProduced(const T* p) {
  return __ldcg(p);
}

// The current device's SMs (cudaDevAttrMultiProcessorCount), for launchers that size a grid by
// them.
inline int CurrentDeviceSms() {
  int device = 0, sms = 0;
  TP_CUDA_CHECK(cudaGetDevice(&device));
  TP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// True when kernels are launched with programmatic stream serialization: a Hopper-or-newer
// device, TPSERVE_PDL not set to 0 (read once), and the current batch (CudaOps::SetBatch on
// this thread) decode-sized (at most 256 tokens).
bool PdlEnabled();

// Launches `kernel` with the programmatic-stream-serialization attribute when PdlEnabled().
// Works inside stream capture (the graph gets programmatic edges).
template <typename... KernelArgs, typename... Args>
void LaunchPdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
               cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = PdlEnabled() ? 1 : 0;
  TP_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

inline bool IsAligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline int CeilDiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace tpserve::cuda

// Shape/dtype checks in launchers.
#define TP_CHECK_CUDA_TENSOR(t, dt)                                                                \
  TP_CHECK((t).device == ::tpserve::Device::kCuda && (t).dtype == (dt) && (t).data != nullptr)     \
      << #t " must be a " << ::tpserve::DTypeName(dt) << " CUDA tensor, got " << (t).ShapeString() \
      << ((t).device == ::tpserve::Device::kCuda ? " (cuda)" : " (cpu)")

namespace tpserve::cuda {

// The bias check of every GEMM launcher: none, or bf16 on the device, one value per output column.
inline void CheckGemmBias(const char* op, const Tensor* bias, int64_t n) {
  if (bias == nullptr) return;
  TP_CHECK_CUDA_TENSOR(*bias, DType::kBF16);
  TP_CHECK(bias->numel() == n) << op << ": bias " << bias->ShapeString() << ", N " << n;
}

}  // namespace tpserve::cuda
