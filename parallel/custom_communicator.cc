// The custom communicator: the IPC buffers (allocate, export, exchange, map), the check that
// every rank can map every peer, and the dispatch between the IPC kernel and the inner
// communicator.
#include "parallel/custom_communicator.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/check.h"
#include "common/logging.h"
#include "common/status.h"
#include "parallel/bootstrap.h"
#include "parallel/comm_util.h"
#include "parallel/custom_all_reduce.h"
#include "parallel/mpi_communicator.h"

namespace tpserve {

BytesAllGather MpiBytesAllGather(MPI_Comm comm, absl::Duration timeout, std::string what) {
  return [comm, timeout,
          what](const std::string& mine) -> absl::StatusOr<std::vector<std::string>> {
    int size = 1;
    MPI_Comm_size(comm, &size);
    std::string all(mine.size() * size, '\0');
    MPI_Request req;
    const int rc = MPI_Iallgather(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, all.data(),
                                  static_cast<int>(mine.size()), MPI_BYTE, comm, &req);
    if (rc != MPI_SUCCESS) {
      return absl::UnavailableError(absl::StrCat(what, ": MPI_Iallgather failed: ", MpiError(rc)));
    }
    TP_RETURN_IF_ERROR(MpiWaitWithDeadline(&req, absl::Now() + timeout, what));
    std::vector<std::string> out;
    for (int r = 0; r < size; ++r) out.push_back(all.substr(r * mine.size(), mine.size()));
    return out;
  };
}

BytesAllGather DeviceBytesAllGather(Communicator* comm) {
  return [comm](const std::string& mine) -> absl::StatusOr<std::vector<std::string>> {
    const int size = comm->size();
    const int64_t n = static_cast<int64_t>(mine.size());
    char* d = nullptr;
    TP_CUDA_CHECK(cudaMalloc(&d, n * (size + 1)));
    TP_CUDA_CHECK(cudaMemcpy(d, mine.data(), n, cudaMemcpyHostToDevice));
    TP_CUDA_CHECK(cudaDeviceSynchronize());  // a pageable copy may return before its DMA ends
    absl::Status s = comm->AllGather(Tensor(d, {n}, DType::kI8, Device::kCuda),
                                     Tensor(d + n, {n * size}, DType::kI8, Device::kCuda));
    // NCCL is stream-ordered on its compute stream: wait for the device, then ask whether the
    // transfer finished (a watchdog abort ends the wait but leaves garbage).
    if (s.ok()) TP_CUDA_CHECK(cudaDeviceSynchronize());
    if (s.ok()) s = comm->Health();
    std::string all(n * size, '\0');
    if (s.ok()) TP_CUDA_CHECK(cudaMemcpy(all.data(), d + n, n * size, cudaMemcpyDeviceToHost));
    cudaFree(d);
    TP_RETURN_IF_ERROR(s);
    std::vector<std::string> out;
    for (int r = 0; r < size; ++r) out.push_back(all.substr(r * n, n));
    return out;
  };
}

namespace {

std::string CudaErrorText(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// What a rank tells its peers about itself before anything is mapped.
struct PeerInfo {
  char host[64] = {};     // hostname
  char boot_id[40] = {};  // the kernel's boot id: containers on one machine share it
  char bus_id[32] = {};   // finds the peer's GPU among this process's devices
  char uuid[16] = {};     // the same GPU (MIG instances of one GPU differ here)
  int32_t mps = 0;        // this process's contexts on the GPU are shared through MPS
};

PeerInfo ThisRank(int device) {
  PeerInfo info;
  gethostname(info.host, sizeof(info.host) - 1);
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    if (std::fgets(info.boot_id, sizeof(info.boot_id), f) == nullptr) info.boot_id[0] = 0;
    std::fclose(f);
  }
  TP_CUDA_CHECK(cudaDeviceGetPCIBusId(info.bus_id, sizeof(info.bus_id) - 1, device));
  cudaDeviceProp prop;
  TP_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::memcpy(info.uuid, prop.uuid.bytes, sizeof(info.uuid));
  int mps = 0;
  if (cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, device) != cudaSuccess) {
    cudaGetLastError();
    mps = 0;
  }
  info.mps = mps;
  return info;
}

// One machine: the same kernel boot id (containers of one machine share it), else the same
// hostname.
bool OneMachine(const PeerInfo& a, const PeerInfo& b) {
  return a.boot_id[0] != 0 && b.boot_id[0] != 0
             ? std::memcmp(a.boot_id, b.boot_id, sizeof(a.boot_id)) == 0
             : std::strncmp(a.host, b.host, sizeof(a.host)) == 0;
}

// The same GPU of one machine (MIG instances of one GPU differ in their uuid).
bool SameGpu(const PeerInfo& a, const PeerInfo& b) {
  return OneMachine(a, b) && std::memcmp(a.uuid, b.uuid, sizeof(a.uuid)) == 0;
}

// A NUL-padded fixed-size text field as a string.
template <size_t N>
std::string Text(const char (&field)[N]) {
  return std::string(field, strnlen(field, N));
}

template <typename T>
std::string Bytes(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(v));
}
template <typename T>
T FromBytes(const std::string& s) {
  T v;
  TP_CHECK(s.size() == sizeof(T));
  std::memcpy(&v, s.data(), sizeof(T));
  return v;
}

// Collective: every rank's PeerInfo (for the current CUDA device), in rank order.
absl::StatusOr<std::vector<PeerInfo>> ExchangePeerInfos(const BytesAllGather& exchange) {
  int device = 0;
  TP_CUDA_CHECK(cudaGetDevice(&device));
  TP_ASSIGN_OR_RETURN(std::vector<std::string> all, exchange(Bytes(ThisRank(device))));
  std::vector<PeerInfo> infos;
  for (const std::string& b : all) infos.push_back(FromBytes<PeerInfo>(b));
  return infos;
}

// A fixed-size verdict: ok, or why not.
struct Verdict {
  int32_t ok = 1;
  char reason[220] = {};
};

Verdict Refuse(const std::string& why) {
  Verdict v;
  v.ok = 0;
  std::snprintf(v.reason, sizeof(v.reason), "%s", why.c_str());
  return v;
}

// Whether this rank (on device `device`) can map the memory of every rank in `infos`.
Verdict CanMapEveryPeer(const std::vector<PeerInfo>& infos, int rank, int device) {
  const PeerInfo& me = infos[rank];
  for (int s = 0; s < static_cast<int>(infos.size()); ++s) {
    if (s == rank) continue;
    const PeerInfo& p = infos[s];
    if (!OneMachine(me, p)) {
      return Refuse(absl::StrCat("rank ", s, " runs on host ", p.host, ", rank ", rank, " on ",
                                 me.host, " (CUDA IPC needs one host)"));
    }
    if (SameGpu(me, p)) continue;
    int peer_device = -1;
    if (cudaDeviceGetByPCIBusId(&peer_device, p.bus_id) != cudaSuccess) {
      cudaGetLastError();
      return Refuse(absl::StrCat("rank ", rank, " does not see rank ", s, "'s GPU ", p.bus_id,
                                 " (CUDA_VISIBLE_DEVICES)"));
    }
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, device, peer_device) != cudaSuccess || can == 0) {
      cudaGetLastError();
      return Refuse(absl::StrCat("rank ", rank, "'s GPU ", me.bus_id,
                                 " has no peer access to rank ", s, "'s GPU ", p.bus_id));
    }
  }
  return Verdict{};
}

// Every rank's verdict; the reasons of those that refused, empty when all agree.
absl::StatusOr<std::vector<std::string>> Agree(const BytesAllGather& exchange,
                                               const Verdict& mine) {
  TP_ASSIGN_OR_RETURN(std::vector<std::string> all, exchange(Bytes(mine)));
  std::vector<std::string> reasons;
  for (const std::string& b : all) {
    const Verdict v = FromBytes<Verdict>(b);
    if (v.ok == 0) reasons.push_back(Text(v.reason));
  }
  return reasons;
}

}  // namespace

absl::StatusOr<std::string> RanksSharingAGpu(const BytesAllGather& exchange) {
  TP_ASSIGN_OR_RETURN(const std::vector<PeerInfo> infos, ExchangePeerInfos(exchange));
  for (size_t r = 0; r < infos.size(); ++r) {
    for (size_t s = r + 1; s < infos.size(); ++s) {
      if (SameGpu(infos[r], infos[s])) {
        return absl::StrCat("ranks ", r, " and ", s, " share the GPU ", Text(infos[r].bus_id),
                            " on ", Text(infos[r].host));
      }
    }
  }
  return std::string();
}

absl::StatusOr<std::string> CustomKernelsUnreliable(const BytesAllGather& exchange) {
  TP_ASSIGN_OR_RETURN(const std::vector<PeerInfo> infos, ExchangePeerInfos(exchange));
  for (size_t r = 0; r < infos.size(); ++r) {
    if (infos[r].mps == 0) continue;
    std::vector<size_t> sharing;
    for (size_t s = 0; s < infos.size(); ++s) {
      if (SameGpu(infos[r], infos[s])) sharing.push_back(s);
    }
    if (static_cast<int>(sharing.size()) > kMaxProcessesPerGpuUnderMps) {
      return absl::StrCat(
          sharing.size(), " ranks (", absl::StrJoin(sharing, ", "), ") share the GPU ",
          Text(infos[r].bus_id),
          " under MPS, where the custom kernels lose flag stores with more than ",
          kMaxProcessesPerGpuUnderMps,
          " processes (kernels/cuda/NOTES.md); run them without MPS (time-sliced) or with at most ",
          kMaxProcessesPerGpuUnderMps, " per GPU");
    }
  }
  return std::string();
}

struct CustomAllReduceCommunicator::State {
  int rank = 0;
  int size = 1;
  CustomAllReduceOptions options;
  char* own = nullptr;                       // this rank's IPC buffer
  char* buffers[car::kMaxRanks] = {};        // every rank's, mapped here (own included)
  uint64_t* epochs = nullptr;                // device counters [car::kNumCounters]
  car::ErrorRecord* error_host = nullptr;    // mapped host memory
  car::ErrorRecord* error_device = nullptr;  // its device address
  cudaEvent_t done = nullptr;

  // The launch arguments every kernel shares (the group, the buffers, the epochs, the deadline).
  car::LaunchArgs Args() const {
    car::LaunchArgs a;
    a.rank = rank;
    a.nranks = size;
    std::copy(buffers, buffers + car::kMaxRanks, a.buffers);
    a.max_bytes = options.max_bytes;
    a.epochs = epochs;
    a.abort = reinterpret_cast<uint32_t*>(epochs + car::kAbortCounter);
    a.p2p_max_bytes = options.p2p_max_bytes;
    a.error = error_device;
    a.timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(options.timeout));
    return a;
  }

  // CUDA IPC: every importer must close its mapping before the exporter frees the buffer, so
  // the group closes, then passes a barrier, then frees.
  void CloseImports() {
    for (int r = 0; r < size; ++r) {
      if (r != rank && buffers[r] != nullptr) cudaIpcCloseMemHandle(buffers[r]);
      buffers[r] = nullptr;
    }
  }

  ~State() {
    if (done != nullptr) cudaEventDestroy(done);
    CloseImports();
    if (own != nullptr) cudaFree(own);
    if (epochs != nullptr) cudaFree(epochs);
    if (error_host != nullptr) cudaFreeHost(error_host);
  }
};

CustomAllReduceCommunicator::CustomAllReduceCommunicator(std::unique_ptr<Communicator> inner,
                                                         std::unique_ptr<State> state)
    : inner_(std::move(inner)), state_(std::move(state)) {}

CustomAllReduceCommunicator::~CustomAllReduceCommunicator() {
  // This rank's kernels finish (they give up at their deadline), then nothing here reads a
  // peer's buffer any more; every rank closes its mappings and waits for the others to have
  // done so (a barrier over the inner communicator, bounded by its timeout) before freeing its
  // own buffer.
  cudaDeviceSynchronize();
  state_->CloseImports();
  const int n = size();
  // Heap, kept on failure: MPI may still write into the buffers of an abandoned operation.
  auto* host = new int32_t[n + 1]();
  absl::Status s =
      inner_->AllGather(Tensor(host, {1}, DType::kI32), Tensor(host + 1, {n}, DType::kI32));
  if (s.code() == absl::StatusCode::kInvalidArgument) {  // NCCL: device tensors only
    int32_t* d = nullptr;
    if (cudaMalloc(&d, (n + 1) * sizeof(int32_t)) == cudaSuccess) {
      s = inner_->AllGather(Tensor(d, {1}, DType::kI32, Device::kCuda),
                            Tensor(d + 1, {n}, DType::kI32, Device::kCuda));
      if (s.ok()) cudaFree(d);
    }
  }
  if (s.ok()) {
    delete[] host;
  } else {
    TP_LOG(WARNING) << name() << ": rank " << state_->rank << " teardown barrier: " << s.message();
  }
}

int CustomAllReduceCommunicator::rank() const { return inner_->rank(); }
int CustomAllReduceCommunicator::size() const { return inner_->size(); }
std::string CustomAllReduceCommunicator::name() const {
  return absl::StrCat(inner_->name(), " + custom all-reduce",
                      state_->options.p2p_max_bytes > 0 ? " and p2p" : "");
}
int CustomAllReduceCommunicator::buffered_small_sends() const {
  // The p2p kernels: two slots per pair (a Send waits, on the device, for the Recv of the
  // message two before it). Without them the inner communicator sends.
  return state_->options.p2p_max_bytes > 0 ? 2 : inner_->buffered_small_sends();
}
size_t CustomAllReduceCommunicator::stream_ordered_p2p_max_bytes() const {
  return state_->options.p2p_max_bytes > 0 ? state_->options.p2p_max_bytes
                                           : inner_->stream_ordered_p2p_max_bytes();
}

absl::Status CustomAllReduceCommunicator::CheckHealthy(const char* op) {
  if (broken_.ok() && state_->error_host->set != 0) {
    const car::ErrorRecord& e = *state_->error_host;
    const auto epoch = static_cast<unsigned long long>(e.epoch);
    const auto seen = static_cast<unsigned long long>(e.seen);
    std::string what;
    switch (e.phase) {
      case car::kWaitSlotFree:
        what = absl::StrFormat(
            "a Send kernel (message %llu to rank %d, block %d) gave up after %.3gs waiting for "
            "rank %d to receive message %llu (it acknowledged %llu)",
            epoch, e.peer, e.block, absl::ToDoubleSeconds(state_->options.timeout), e.peer,
            epoch - 2, seen);
        break;
      case car::kWaitMessage:
        what = absl::StrFormat(
            "a Recv kernel (message %llu from rank %d, block %d) gave up after %.3gs waiting for "
            "rank %d to send it (its flag says message %llu)",
            epoch, e.peer, e.block, absl::ToDoubleSeconds(state_->options.timeout), e.peer, seen);
        break;
      default:
        what = absl::StrFormat(
            "an all-reduce kernel (call %llu, block %d) gave up after %.3gs waiting for rank %d "
            "to %s (its flag says call %llu)",
            epoch, e.block, absl::ToDoubleSeconds(state_->options.timeout), e.peer,
            e.phase == car::kWaitInputs ? "stage its input" : "reduce its segment", seen);
    }
    broken_ = absl::DeadlineExceededError(absl::StrCat(
        name(), ": rank ", state_->rank, ": ", what,
        ": a peer died, stalled or is in a different operation; the custom communicator is "
        "unusable, the process should exit"));
  }
  if (broken_.ok()) return absl::OkStatus();
  return absl::Status(broken_.code(), absl::StrCat(op, ": ", broken_.message()));
}

absl::Status CustomAllReduceCommunicator::Health() {
  TP_RETURN_IF_ERROR(CheckHealthy("Health"));
  return inner_->Health();
}

absl::Status CustomAllReduceCommunicator::AllReduceSum(Tensor t) {
  TP_RETURN_IF_ERROR(CheckHealthy("AllReduceSum"));
  const State& s = *state_;
  const size_t bytes = t.bytes();
  if (t.device != Device::kCuda || (t.dtype != DType::kBF16 && t.dtype != DType::kF32) ||
      bytes > s.options.max_bytes) {
    return inner_->AllReduceSum(t);
  }
  if (t.numel() == 0) return absl::OkStatus();
  car::LaunchArgs a = s.Args();
  a.data = t.data;
  a.numel = t.numel();
  a.f32 = t.dtype == DType::kF32;
  a.two_shot = bytes > s.options.one_shot_max_bytes;
  return Launched("all-reduce", car::LaunchAllReduce(a, s.options.stream));
}

absl::StatusOr<bool> CustomAllReduceCommunicator::AllReduceAddRmsNorm(Tensor x, Tensor residual,
                                                                      const Tensor& weight,
                                                                      float eps, Tensor normed) {
  TP_RETURN_IF_ERROR(CheckHealthy("AllReduceAddRmsNorm"));
  const State& s = *state_;
  auto on_device_bf16 = [](const Tensor& t) {
    return t.device == Device::kCuda && t.dtype == DType::kBF16;
  };
  if (!s.options.fuse_add_rms_norm || !on_device_bf16(x) || !on_device_bf16(residual) ||
      !on_device_bf16(weight) || !on_device_bf16(normed) || x.ndim < 1) {
    return false;
  }
  const int64_t hidden = x.dim(-1);
  if (hidden <= 0 || hidden % 8 != 0 || hidden > car::kNormThreads * 8 * car::kNormMaxVecs ||
      weight.numel() != hidden || residual.numel() != x.numel() || normed.numel() != x.numel() ||
      x.bytes() > s.options.one_shot_max_bytes || x.bytes() > s.options.max_bytes) {
    return false;
  }
  const Tensor* all[] = {&x, &residual, &weight, &normed};
  for (const Tensor* t : all) {
    if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0) return false;  // 16-byte rows
  }
  if (x.numel() == 0) return true;
  car::LaunchArgs a = s.Args();
  a.data = x.data;
  a.numel = x.numel();
  car::NormArgs n;
  n.residual = residual.data;
  n.weight = weight.data;
  n.normed = normed.data;
  n.rows = x.numel() / hidden;
  n.hidden = static_cast<int>(hidden);
  n.eps = eps;
  TP_RETURN_IF_ERROR(
      Launched("all-reduce + RMSNorm", car::LaunchAllReduceAddRmsNorm(a, n, s.options.stream)));
  return true;
}

absl::Status CustomAllReduceCommunicator::AllGather(const Tensor& in, Tensor out) {
  TP_RETURN_IF_ERROR(CheckHealthy("AllGather"));
  const State& s = *state_;
  if (in.device != Device::kCuda || out.device != Device::kCuda ||
      in.bytes() > s.options.max_bytes) {
    return inner_->AllGather(in, out);
  }
  TP_RETURN_IF_ERROR(comm_internal::CheckAllGatherShapes(name(), in, out, s.size));
  if (in.bytes() == 0) return absl::OkStatus();
  car::LaunchArgs a = s.Args();
  a.data = in.data;
  a.numel = static_cast<int64_t>(in.bytes());
  a.out = out.data;
  return Launched("all-gather", car::LaunchAllGather(a, s.options.stream));
}

absl::Status CustomAllReduceCommunicator::Launched(const char* kernel, cudaError_t e) {
  if (e == cudaSuccess) return absl::OkStatus();
  broken_ =
      absl::InternalError(absl::StrCat(name(), ": rank ", state_->rank, " could not launch the ",
                                       kernel, " kernel: ", CudaErrorText(e)));
  return broken_;
}
bool CustomAllReduceCommunicator::ByKernel(const Tensor& t, int peer) const {
  const State& s = *state_;
  return t.device == Device::kCuda && t.bytes() <= s.options.p2p_max_bytes && peer >= 0 &&
         peer < s.size && peer != s.rank;
}

absl::Status CustomAllReduceCommunicator::LaunchP2p(const char* kernel, const Tensor& t, int peer,
                                                    cudaError_t (*launch)(const car::LaunchArgs&,
                                                                          cudaStream_t)) {
  if (t.bytes() == 0) return absl::OkStatus();
  car::LaunchArgs a = state_->Args();
  a.data = t.data;
  a.numel = static_cast<int64_t>(t.bytes());
  a.peer = peer;
  return Launched(kernel, launch(a, state_->options.stream));
}
absl::Status CustomAllReduceCommunicator::Send(const Tensor& t, int peer) {
  TP_RETURN_IF_ERROR(CheckHealthy("Send"));
  if (!ByKernel(t, peer)) return inner_->Send(t, peer);
  return LaunchP2p("send", t, peer, car::LaunchSend);
}
absl::Status CustomAllReduceCommunicator::Recv(Tensor t, int peer) {
  TP_RETURN_IF_ERROR(CheckHealthy("Recv"));
  if (!ByKernel(t, peer)) return inner_->Recv(t, peer);
  return LaunchP2p("recv", t, peer, car::LaunchRecv);
}
absl::Status CustomAllReduceCommunicator::Broadcast(Tensor t, int root) {
  TP_RETURN_IF_ERROR(CheckHealthy("Broadcast"));
  return inner_->Broadcast(t, root);
}

absl::Status CustomAllReduceCommunicator::Synchronize() {
  TP_CUDA_CHECK(cudaEventRecord(state_->done, state_->options.stream));
  // The kernels give up after the timeout themselves; a little more for the launch queue.
  const absl::Time deadline = absl::Now() + state_->options.timeout + absl::Seconds(10);
  while (true) {
    const cudaError_t e = cudaEventQuery(state_->done);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      broken_ = absl::InternalError(
          absl::StrCat(name(), ": rank ", state_->rank, ": CUDA error ", CudaErrorText(e)));
      return broken_;
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          name(), ": rank ", state_->rank, ": the stream did not finish within the timeout"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return CheckHealthy("Synchronize");
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeCustomAllReduceCommunicator(
    std::unique_ptr<Communicator> inner, const BytesAllGather& exchange,
    const CustomAllReduceOptions& options) {
  const int rank = inner->rank();
  const int size = inner->size();
  const std::string who = absl::StrCat(inner->name(), ": rank ", rank, " custom all-reduce");
  if (options.impl == AllReduceImpl::kBackend) return inner;
  if (options.max_bytes == 0 || options.max_bytes % 256 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": max_bytes must be a positive multiple of 256, got ", options.max_bytes));
  }
  if (options.p2p_max_bytes % 256 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": p2p_max_bytes must be a multiple of 256, got ", options.p2p_max_bytes));
  }
  int device = 0;
  TP_CUDA_CHECK(cudaGetDevice(&device));

  // 1. Can every rank map every peer?
  TP_ASSIGN_OR_RETURN(const std::vector<PeerInfo> infos, ExchangePeerInfos(exchange));
  Verdict verdict = size > car::kMaxRanks
                        ? Refuse(absl::StrCat("the group has ", size, " ranks, at most ",
                                              car::kMaxRanks, " are supported"))
                        : CanMapEveryPeer(infos, rank, device);
  TP_ASSIGN_OR_RETURN(std::vector<std::string> refusals, Agree(exchange, verdict));
  auto refuse =
      [&](const std::vector<std::string>& why) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    const std::string reasons = absl::StrJoin(why, "; ");
    if (options.impl == AllReduceImpl::kAuto) {
      if (rank == 0) {
        TP_LOG(INFO) << inner->name() << ": all-reduce by the backend (" << reasons << ")";
      }
      return std::move(inner);
    }
    return absl::FailedPreconditionError(
        absl::StrCat(who, " is not possible: ", reasons, " (use --all-reduce nccl or auto)"));
  };
  if (!refusals.empty()) return refuse(refusals);

  // 2. Allocate, export, exchange, map.
  auto state = std::make_unique<CustomAllReduceCommunicator::State>();
  state->rank = rank;
  state->size = size;
  state->options = options;
  // A failure here (out of memory, IPC not supported) is agreed on like a refusal, so that no
  // rank waits for the handles of a rank that gave up.
  cudaIpcMemHandle_t handle = {};
  const char* step = "";
  const size_t buffer_bytes =
      car::IpcBufferBytes(options.max_bytes, options.p2p_max_bytes, std::max(size, 1));
  auto allocate = [&]() -> cudaError_t {
    cudaError_t e;
    step = "allocating its IPC buffer";
    if ((e = cudaMalloc(&state->own, buffer_bytes)) != cudaSuccess) {
      return e;
    }
    if ((e = cudaMemset(state->own, 0, car::kFlagBytes)) != cudaSuccess) return e;
    if ((e = cudaMalloc(&state->epochs, car::kNumCounters * sizeof(uint64_t))) != cudaSuccess) {
      return e;
    }
    if ((e = cudaMemset(state->epochs, 0, car::kNumCounters * sizeof(uint64_t))) != cudaSuccess) {
      return e;
    }
    step = "allocating its mapped error record";
    if ((e = cudaHostAlloc(&state->error_host, sizeof(car::ErrorRecord), cudaHostAllocMapped)) !=
        cudaSuccess) {
      return e;
    }
    std::memset(static_cast<void*>(state->error_host), 0, sizeof(car::ErrorRecord));
    if ((e = cudaHostGetDevicePointer(&state->error_device, state->error_host, 0)) != cudaSuccess) {
      return e;
    }
    if ((e = cudaEventCreateWithFlags(&state->done, cudaEventDisableTiming)) != cudaSuccess) {
      return e;
    }
    step = "zeroing its flags";  // before any peer can write them
    if ((e = cudaDeviceSynchronize()) != cudaSuccess) return e;
    step = "exporting its IPC handle";
    return cudaIpcGetMemHandle(&handle, state->own);
  };
  if (const cudaError_t e = allocate(); e != cudaSuccess) {
    cudaGetLastError();
    verdict = Refuse(absl::StrCat("rank ", rank, " failed ", step, " (", buffer_bytes,
                                  " bytes): ", CudaErrorText(e)));
  }
  TP_ASSIGN_OR_RETURN(refusals, Agree(exchange, verdict));
  if (!refusals.empty()) {
    state.reset();
    return refuse(refusals);
  }
  TP_ASSIGN_OR_RETURN(std::vector<std::string> handles, exchange(Bytes(handle)));
  verdict = Verdict{};
  for (int s = 0; s < size; ++s) {
    if (s == rank) {
      state->buffers[s] = state->own;
      continue;
    }
    void* peer = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&peer, FromBytes<cudaIpcMemHandle_t>(handles[s]),
                                               cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      verdict = Refuse(absl::StrCat("rank ", rank, " could not open rank ", s,
                                    "'s IPC handle: ", CudaErrorText(e)));
      break;
    }
    state->buffers[s] = static_cast<char*>(peer);
  }
  TP_ASSIGN_OR_RETURN(refusals, Agree(exchange, verdict));
  if (!refusals.empty()) {
    state->CloseImports();
    TP_RETURN_IF_ERROR(Agree(exchange, Verdict{}).status());  // every rank closed: free
    state.reset();
    return refuse(refusals);
  }
  if (rank == 0) {
    TP_LOG(INFO) << inner->name() << ": custom all-reduce over CUDA IPC, " << size
                 << " ranks, up to " << (options.max_bytes >> 10) << " KiB"
                 << (options.p2p_max_bytes > 0
                         ? absl::StrCat("; p2p up to ", options.p2p_max_bytes >> 10, " KiB")
                         : std::string());
  }
  return std::unique_ptr<Communicator>(
      new CustomAllReduceCommunicator(std::move(inner), std::move(state)));
}

}  // namespace tpserve
