// Hopper warpgroup MMA (wgmma) helpers shared by the sm_90a kernels (the stream GEMM, the
// wgmma prefill attention): shared-memory matrix descriptors for the 128-byte swizzle, the
// fence / commit / wait of the asynchronous MMAs, mbarriers, and the m64nNk16 bf16 instructions
// with both operands in shared memory (Wgmma) or A in registers (WgmmaRegA).
//
// The 128-byte swizzle: a tile is stored as atoms of 8 rows x 128 bytes (1024 bytes, 1024-byte
// aligned); the 16-byte piece j of row r of an atom lies at r * 128 + (j ^ r % 8) * 16. Rows of
// more than 64 bf16 elements are cut into 64-element column blocks stored one after another.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/check.h"

namespace tpserve::cuda {

// True when this device runs the sm_90a code these kernels are built as (an H100 / H200).
inline bool Sm90aSupported() {
  static const bool ok = [] {
    int device = 0, major = 0, minor = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      return false;
    }
    return major == 9 && minor == 0;
  }();
  return ok;
}

// cuTensorMapEncodeTiled (the TMA descriptors), from the driver through the runtime (no link
// against libcuda).
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiledFn EncodeTiled() {
  static EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    TP_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                   cudaEnableDefault, &q));
    TP_CHECK(q == cudaDriverEntryPointSuccess && p != nullptr)
        << "cuTensorMapEncodeTiled is not available from the driver";
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

// The descriptor of a K-major operand (rows of the M or N dimension, 64 K elements = 128 bytes
// each, 8-row groups 1024 bytes apart: SBO; LBO unused, 1). A k16 step inside the 128 bytes
// advances the start address by 32 bytes.
__device__ __forceinline__ uint64_t SmemDesc(const void* p) {
  const uint64_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return ((a & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// The descriptor of an MN-major operand (wgmma's transpose bit set): rows of the K dimension,
// 64 M or N elements = 128 bytes each, 8-row groups of K 1024 bytes apart (SBO), and the next
// 64 M or N elements `mn_block_bytes` further on (LBO). A k16 step advances the start address
// by 16 rows = 2048 bytes.
__device__ __forceinline__ uint64_t SmemDescMn(const void* p, uint32_t mn_block_bytes) {
  const uint64_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return ((a & 0x3FFFF) >> 4) | (uint64_t{(mn_block_bytes >> 4) & 0x3FFF} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Waits until at most kPending committed groups of this warpgroup are still running.
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accesses of an accumulator (or reusing the register of an A
// operand) across the asynchronous wgmma.
__device__ __forceinline__ void FenceReg(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void FenceReg(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async proxy
// that wgmma reads through; the writing threads run it before the barrier that publishes them.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// mbarriers in shared memory (stage rings between producer and consumer threads).
__device__ __forceinline__ uint32_t SmemAddrOf(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddrOf(bar)), "r"(count)
               : "memory");
}
// Orders this thread's mbarrier.init operations above before its later release operations, so
// the other threads (of the block, or cluster) see initialized barriers once a barrier or
// release-acquire pair publishes them; the initializing thread runs it before the block's barrier.
__device__ __forceinline__ void FenceMbarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void MbarExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddrOf(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddrOf(bar)) : "memory");
}
// One bulk copy (TMA without a tensor map) of `bytes` (a multiple of 16; both addresses 16-byte
// aligned) from global to this block's shared memory, completing on `bar`'s transaction count.
__device__ __forceinline__ void BulkCopyToShared(void* dst, const void* src, uint32_t bytes,
                                                 uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(SmemAddrOf(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddrOf(bar))
      : "memory");
}
// One poll of the phase of `bar` with this parity (try_wait suspends the thread for a while).
__device__ __forceinline__ bool MbarTryWait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(SmemAddrOf(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
// Every wait has a deadline: a stage that never completes (a TMA fault, a bug in the ring)
// traps after ~2^26 polls (seconds: try_wait suspends the thread for a while each time) instead
// of hanging the stream.
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  uint32_t polls = 0;
  do {
    if (++polls == (1u << 26)) __trap();
  } while (!MbarTryWait(bar, parity));
}

// MbarWait for code that runs after setmaxnreg.inc (WarpgroupRegAlloc): its deadline faults on a
// store to address 0 (an illegal-address error) instead of trapping. ptxas allocates code that
// can reach a trap within the launch's register count: with __trap() (or PTX trap) in such a
// wait, the FA3 prefill kernel's consumers were held to 168 registers (330 bytes of spills,
// wgmma serialized: C7512) despite the increase to 224; with this store, none.
__device__ __forceinline__ void MbarWaitNoTrap(uint64_t* bar, uint32_t parity) {
  uint32_t polls = 0;
  do {
    if (++polls == (1u << 26)) {
      asm volatile("st.global.u32 [%0], %1;" ::"l"(uint64_t{0}), "r"(0u) : "memory");
    }
  } while (!MbarTryWait(bar, parity));
}

// One arrival on `bar` when all of this thread's earlier cp.async copies have completed, counted
// in the barrier's expected count (.noinc).
__device__ __forceinline__ void CpAsyncArriveNoinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(SmemAddrOf(bar))
               : "memory");
}

// Warpgroup register reallocation (setmaxnreg): every thread of the warpgroup runs it together
// (.sync.aligned) and its per-thread register count becomes kRegs (a multiple of 8 in [24, 256]).
// dec gives registers back to the block's pool, inc waits until the pool holds enough, so the
// increases of a block must not exceed what its decreases free: with a launch allocation of R a
// thread, sum over warpgroups of 128 * (kRegs - R) <= 0. ptxas then allocates the code after an
// inc up to kRegs (and that after a dec within kRegs).
template <int kRegs>
__device__ __forceinline__ void WarpgroupRegDealloc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg count");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void WarpgroupRegAlloc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg count");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Named barriers (ids 1-15; 0 is __syncthreads'): `count` threads (a multiple of 32) in all,
// whole warps. Sync waits for the barrier to complete, arrive only counts this warp in.
__device__ __forceinline__ void NamedBarrierSync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// D[64 x kN] += A[64 x 16] B[16 x kN] (D = A B when scale_d is 0: D's registers are not read),
// A and B K-major bf16 in shared memory, D fp32 in registers
// (thread t of warp w holds rows 16w + t/4 (+ 8), columns 8j + 2(t%4) (+ 1): d[4j + r], the
// layout of mma.m16n8 accumulators stacked over j).
template <int kN>
struct Wgmma;

template <>
struct Wgmma<16> {
  static __device__ __forceinline__ void Run(float* d, uint64_t a, uint64_t b, int scale_d = 1) {
    asm volatile(
        "{.reg .pred p; setp.ne.b32 p, %10, 0; "
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "l"(a), "l"(b), "r"(scale_d));
  }
};

template <>
struct Wgmma<32> {
  static __device__ __forceinline__ void Run(float* d, uint64_t a, uint64_t b, int scale_d = 1) {
    asm volatile(
        "{.reg .pred p; setp.ne.b32 p, %18, 0; "
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, "
        "1, 0, 0;}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(scale_d));
  }
};

template <>
struct Wgmma<64> {
  static __device__ __forceinline__ void Run(float* d, uint64_t a, uint64_t b, int scale_d = 1) {
    asm volatile(
        "{.reg .pred p; setp.ne.b32 p, %34, 0; "
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, "
        "0;}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(scale_d));
  }
};

template <>
struct Wgmma<128> {
  static __device__ __forceinline__ void Run(float* d, uint64_t a, uint64_t b, int scale_d = 1) {
    asm volatile(
        "{.reg .pred p; setp.ne.b32 p, %66, 0; "
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
        "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
        "%55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63])
        : "l"(a), "l"(b), "r"(scale_d));
  }
};

// D[64 x kN] += A[64 x 16] B[16 x kN], A bf16 in registers (warp w holds rows 16w..16w + 15 in
// the fragment layout of mma.m16n8k16's A), B MN-major in shared memory (SmemDescMn).
template <int kN>
struct WgmmaRegA;

template <>
struct WgmmaRegA<64> {
  static __device__ __forceinline__ void Run(float* d, const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, "
        "%36, 1, 1, 1, 1;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
};

template <>
struct WgmmaRegA<128> {
  static __device__ __forceinline__ void Run(float* d, const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
        "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
        "%55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
};

}  // namespace tpserve::cuda
