// The device side of the custom all-reduce and point-to-point transfers over CUDA IPC peer memory
// (internal to parallel/; custom_communicator.h is the public face). Every rank owns one device
// allocation, the "IPC buffer", exported with cudaIpcGetMemHandle and opened by every peer:
//   [flags: kFlagBytes]
//     all-reduce flags: kPhases x kBlocks x kMaxRanks u64
//     p2p sent flags:   kMaxRanks (src) x kBlocks u64
//     p2p ack flags:    kMaxRanks (dst) x kBlocks u64
//   [data half 0: max_bytes][data half 1: max_bytes]
//   [p2p slots: (nranks - 1) destinations x 2 slots x p2p_max_bytes]
// All-reduce / all-gather. Flag (phase, block, src) in rank r's buffer holds the epoch of the last
// call in which block `block` of rank `src` finished phase `phase`; it is written by src
// (st.release.sys) and read by r (ld.acquire.sys). Epochs are per block, kept in device memory
// and advanced by the kernel itself, so a captured CUDA graph replays correctly and nothing is
// ever reset. Calls alternate between the two data halves by epoch parity: a rank writes half
// (e % 2) in call e only after every peer signalled call e - 1, and a peer signals e - 1 only once
// its kernel of e - 2 (the last reader of that half) has finished (kernels of a stream do not
// overlap), so no end barrier is needed. Block b of a rank only ever waits for block b of the
// other ranks, so the blocks of one kernel never wait for each other, and a wait has a deadline
// (globaltimer): ranks that share one GPU without MPS are time-sliced, a spinning kernel is
// preempted, never deadlocked, and a peer that never comes makes the kernel give up and record
// the error in mapped host memory instead of hanging.
// Point-to-point (Send / Recv, the pipeline's activations). Each ordered pair (src, dst) numbers
// its messages 1, 2, 3, ... with counters of its own (per block, in device memory, advanced by
// the kernels: graph replays work, and a pair's numbers never depend on calls between other
// ranks). Message n travels in slot (n % 2) of src's region for dst: block b of src first waits
// until every block of dst acknowledged message n - 2 (ack flag (dst, block) in src's buffer, the
// count of messages dst consumed), copies its share of the bytes into the slot and raises sent
// flag (src, b) in dst's buffer to n; block b of dst waits for that flag, copies the same share
// out of src's slot (ld.global.cg) and raises ack flag (dst, b) in src's buffer to n. So a Send
// completes before its Recv is posted as long as the pair has at most two messages in flight,
// and a slot is never overwritten before it was read. Both waits have the deadline and the error
// record of the all-reduce.
// C++17 (included by the .cu file): no abseil here.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tpserve::car {

inline constexpr int kMaxRanks = 8;
inline constexpr int kBlocks = 32;  // grid of every all-reduce kernel (fixed: epochs are per block)
inline constexpr int kThreads = 512;  // threads per block
inline constexpr int kPhases = 2;     // 0: inputs staged, 1: own segment reduced (two-shot)
inline constexpr size_t kFlagBytes = 16384;
// Offsets (in u64) of the p2p flags in the flag area.
inline constexpr int kP2pSentFlags = kPhases * kBlocks * kMaxRanks;
inline constexpr int kP2pAckFlags = kP2pSentFlags + kMaxRanks * kBlocks;
static_assert((kP2pAckFlags + kMaxRanks * kBlocks) * sizeof(uint64_t) <= kFlagBytes, "flag area");
// Device counters of one communicator (u64): kBlocks all-reduce epochs, the abort word, then the
// p2p message counters [sent to dst: kMaxRanks x kBlocks][received from src: kMaxRanks x kBlocks].
inline constexpr int kAbortCounter = kBlocks;
inline constexpr int kSendCounters = kBlocks + 1;
inline constexpr int kRecvCounters = kSendCounters + kMaxRanks * kBlocks;
inline constexpr int kNumCounters = kRecvCounters + kMaxRanks * kBlocks;

// Bytes of the IPC buffer for all-reduces of up to `max_bytes` and messages of up to
// `p2p_max_bytes` (multiples of 256; p2p_max_bytes may be 0) in a group of `nranks`.
inline size_t IpcBufferBytes(size_t max_bytes, size_t p2p_max_bytes, int nranks) {
  return kFlagBytes + 2 * max_bytes + static_cast<size_t>(nranks - 1) * 2 * p2p_max_bytes;
}

// What a kernel that gave up was waiting for (ErrorRecord::phase).
enum WaitPhase : int32_t {
  kWaitInputs = 0,    // all-reduce / all-gather: a peer staging its input
  kWaitReduced = 1,   // two-shot all-reduce: a peer reducing its segment
  kWaitSlotFree = 2,  // Send: the peer receiving message epoch - 2 (the slot's last use)
  kWaitMessage = 3,   // Recv: the peer sending message epoch
};

// Written once, by the first block that gives up, into host memory mapped to the device;
// `set` is written last.
struct ErrorRecord {
  int32_t block;
  int32_t peer;   // the rank whose signal never came
  int32_t phase;  // WaitPhase
  int32_t pad;
  uint64_t epoch;  // the call (per-block counter, 1 for the first call); p2p: the message
  uint64_t seen;   // the peer's flag when giving up
  volatile uint32_t set;
};

struct LaunchArgs {
  void* data = nullptr;  // the tensor, reduced in place (all-gather: this rank's input)
  int64_t numel = 0;     // elements (all-gather: bytes of this rank's input)
  void* out = nullptr;   // all-gather only: [nranks][numel bytes], in rank order
  bool f32 = false;      // else bf16
  int rank = 0;
  int nranks = 0;
  char* buffers[kMaxRanks] = {};  // every rank's IPC buffer, mapped into this process
  size_t max_bytes = 0;           // of one data half
  uint64_t* epochs = nullptr;     // device [kNumCounters] (see kAbortCounter), zero at start
  uint32_t* abort = nullptr;      // device word, zero at start; set when any block gave up
  ErrorRecord* error = nullptr;   // device view of the mapped host record
  uint64_t timeout_ns = 0;
  bool two_shot = false;
  int peer = -1;             // Send / Recv: the other rank
  size_t p2p_max_bytes = 0;  // of one p2p slot (0: no p2p slots in the buffers)
};

// Enqueues one all-reduce kernel on `stream` (graph-capturable: no host synchronisation).
// Returns the launch error, if any.
cudaError_t LaunchAllReduce(const LaunchArgs& args, cudaStream_t stream);
// The residual add and RMSNorm fused after an all-reduce (LaunchAllReduceAddRmsNorm): bf16
// tensors [rows, hidden], hidden a multiple of 8 and at most kNormThreads * 8 * kNormMaxVecs.
inline constexpr int kNormThreads = 256;  // the block of kernels/cuda/rms_norm.cu, for its bits
inline constexpr int kNormMaxVecs = 8;
struct NormArgs {
  void* residual = nullptr;      // [rows, hidden], += the sum
  const void* weight = nullptr;  // [hidden]
  void* normed = nullptr;        // [rows, hidden] out
  int64_t rows = 0;
  int hidden = 0;
  float eps = 0;
};

// Enqueues one all-reduce of args.data (bf16 [rows, hidden]: numel = rows * hidden) fused with
// the residual add and the RMSNorm: one-shot, a block per row (rows b, b + kBlocks, ...), the
// sum rounded to bf16 as the all-reduce's, then exactly kernels/cuda/rms_norm.cu's arithmetic
// (256 threads, the same sum-of-squares order), so the bits equal the unfused pair's.
cudaError_t LaunchAllReduceAddRmsNorm(const LaunchArgs& args, const NormArgs& norm,
                                      cudaStream_t stream);
// Enqueues one all-gather kernel: like a one-shot all-reduce (same epochs, flags and data
// halves, so all-reduces and all-gathers may alternate on one stream), but every rank copies
// each rank's staged bytes to its slot of `out` instead of summing them.
cudaError_t LaunchAllGather(const LaunchArgs& args, cudaStream_t stream);
// Enqueues a Send of `numel` bytes at `data` to rank `peer` (bytes up to p2p_max_bytes, any
// alignment), or a Recv of as many bytes from `peer` into `data`. The two ranks of a pair must
// pass the same sizes in the same order.
cudaError_t LaunchSend(const LaunchArgs& args, cudaStream_t stream);
cudaError_t LaunchRecv(const LaunchArgs& args, cudaStream_t stream);

}  // namespace tpserve::car
