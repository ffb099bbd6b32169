// The cost of model parallelism for the whole model: decode ms per token (and prefill ms) of
// Engine::Generate with a tp x pp layout, to compare with one rank. On the CPU through the
// host-staged MPI communicator; with --device cuda every rank on one GPU (or rank % GPUs), the
// TP group's collectives by the backend (MPI when ranks share a GPU, else NCCL) or by the custom
// IPC kernels (--all-reduce custom, which at pp > 1 also carries the PP chain's Send / Recv),
// decode steps as CUDA graphs unless --graphs 0 (graphs need stream-ordered collectives and, at
// pp > 1, stream-ordered Send / Recv: custom or NCCL). Run under mpirun with tp * pp ranks:
//   mpirun -np 2 model_parallel_bench --tp 2 --pp 1 [--model DIR] [--batch 1] [--prompt 32]
//       [--new-tokens 128] [--repeats 3] [--device cpu|cuda] [--all-reduce backend|custom]
//       [--graphs 0|1]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/ops.h"
#include "parallel/process_groups.h"
#include "worker/engine.h"
#ifdef TPSERVE_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

namespace tpserve {
namespace {

// Forwards to a real communicator and adds up the wall time spent in it.
class TimedCommunicator : public Communicator {
 public:
  TimedCommunicator(Communicator* inner, double* total_ms) : inner_(inner), total_ms_(total_ms) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }
  int buffered_small_sends() const override { return inner_->buffered_small_sends(); }
  size_t stream_ordered_p2p_max_bytes() const override {
    return inner_->stream_ordered_p2p_max_bytes();
  }
  // Stream-ordered calls only enqueue: the time counted is the host's, not the transfer's.
  bool stream_ordered_collectives() const override { return inner_->stream_ordered_collectives(); }
  absl::Status Health() override { return inner_->Health(); }
  void TrackStreamWork(const char* what) override { inner_->TrackStreamWork(what); }
  absl::Status AllReduceSum(Tensor t) override {
    return Time([&] { return inner_->AllReduceSum(t); });
  }
  absl::Status AllGather(const Tensor& in, Tensor out) override {
    return Time([&] { return inner_->AllGather(in, out); });
  }
  absl::Status Send(const Tensor& t, int peer) override {
    return Time([&] { return inner_->Send(t, peer); });
  }
  absl::Status Recv(Tensor t, int peer) override {
    return Time([&] { return inner_->Recv(t, peer); });
  }
  absl::Status Broadcast(Tensor t, int root) override {
    return Time([&] { return inner_->Broadcast(t, root); });
  }
  int64_t calls() const { return calls_; }

 private:
  template <typename F>
  absl::Status Time(F&& f) {
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = f();
    *total_ms_ +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    ++calls_;
    return s;
  }
  Communicator* inner_;
  double* total_ms_;
  int64_t calls_ = 0;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main(int argc, char** argv) {
  absl::Status s = InitMpi(&argc, &argv);
  if (!s.ok()) {
    fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 2;
  }
  int tp = 1, pp = 1, batch = 1, prompt_len = 32, new_tokens = 128, repeats = 3, micro = 0;
  int graphs = 1;
  std::string device = "cpu", all_reduce = "backend";
  const char* src = std::getenv("TPSERVE_SOURCE_DIR");
  std::string model = absl::StrCat(src != nullptr ? src : ".", "/models/tiny-coder");
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--tp") {
      tp = std::atoi(value);
    } else if (flag == "--pp") {
      pp = std::atoi(value);
    } else if (flag == "--batch") {
      batch = std::atoi(value);
    } else if (flag == "--prompt") {
      prompt_len = std::atoi(value);
    } else if (flag == "--new-tokens") {
      new_tokens = std::atoi(value);
    } else if (flag == "--micro-batches") {
      micro = std::atoi(value);
    } else if (flag == "--repeats") {
      repeats = std::atoi(value);
    } else if (flag == "--model") {
      model = value;
    } else if (flag == "--device") {
      device = value;
    } else if (flag == "--all-reduce") {
      all_reduce = value;
    } else if (flag == "--graphs") {
      graphs = std::atoi(value);
    } else {
      fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if ((device != "cpu" && device != "cuda") ||
      (all_reduce != "backend" && all_reduce != "custom")) {
    fprintf(stderr, "--device takes cpu or cuda, --all-reduce backend or custom\n");
    return 2;
  }
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  int gpu = 0;  // rank % GPUs: every rank on the one GPU of a one-GPU machine
#ifdef TPSERVE_HAVE_CUDA
  if (device == "cuda" && CudaDeviceCount() > 0) gpu = world_rank % CudaDeviceCount();
#endif
  absl::StatusOr<std::unique_ptr<Ops>> made_ops = MakeOps(device, gpu);
  if (!made_ops.ok()) {
    fprintf(stderr, "ops: %s\n", made_ops.status().ToString().c_str());
    return 3;
  }
  std::unique_ptr<Ops> ops = std::move(made_ops).value();
  GroupOptions group_options;
  group_options.tp = tp;
  group_options.pp = pp;
  if (device == "cuda") {
    // NCCL across GPUs; ranks that share a GPU fall back to MPI by themselves.
    group_options.backend = CommBackend::kNccl;
#ifdef TPSERVE_HAVE_CUDA
    group_options.cuda_stream = static_cast<CudaOps*>(ops.get())->stream();
#endif
    if (all_reduce == "custom") group_options.all_reduce = AllReduceImpl::kCustom;
  } else if (all_reduce == "custom") {
    fprintf(stderr, "--all-reduce custom needs --device cuda\n");
    return 2;
  }
  absl::StatusOr<ProcessGroups> groups =
      MakeProcessGroupsFromMpi(MPI_COMM_WORLD, group_options, ops.get());
  if (!groups.ok()) {
    fprintf(stderr, "groups: %s\n", groups.status().ToString().c_str());
    return 3;
  }
  EngineOptions options;
  options.ops = ops.get();
  options.num_kv_blocks = 256;
  options.cuda_graphs = graphs != 0;
  // Graph buckets (captured at warm-up) up to the batch, not up to the default 256 sequences.
  options.model.max_batch_seqs = std::max(batch, 1);
  options.model.max_batch_tokens = std::max(2048, batch * prompt_len);
  options.tp = tp;
  options.pp = pp;
  options.rank = groups->rank;
  options.pp_micro_batches = micro;
  double comm_ms = 0;
  TimedCommunicator tp_comm(groups->tp_comm.get(), &comm_ms);
  TimedCommunicator pp_comm(groups->pp_comm.get(), &comm_ms);
  options.comms = {&tp_comm, &pp_comm};
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(model, options);
  if (!engine.ok()) {
    fprintf(stderr, "rank %d: %s\n", groups->rank, engine.status().ToString().c_str());
    return 3;
  }
  std::vector<GenerateRequest> requests(batch);
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < prompt_len; ++i) requests[b].prompt.push_back(100 + 13 * i + b);
    requests[b].max_new_tokens = new_tokens;
    requests[b].ignore_eos = true;
  }
  std::vector<double> decode, prefill, tokens_per_s;
  double measured_comm_ms = 0;
  int64_t measured_steps = 0, measured_calls = 0;
  for (int r = 0; r < repeats + 1; ++r) {  // the first run warms up
    const double comm_before = comm_ms;
    const int64_t calls_before = tp_comm.calls() + pp_comm.calls();
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<GenerateResult>> results = (*engine)->Generate(requests);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!results.ok()) {
      fprintf(stderr, "rank %d: %s\n", groups->rank, results.status().ToString().c_str());
      return 4;
    }
    if (r == 0) continue;
    const std::vector<double>& ms = (*results)[0].step_ms;
    measured_comm_ms += comm_ms - comm_before;
    measured_calls += tp_comm.calls() + pp_comm.calls() - calls_before;
    measured_steps += static_cast<int64_t>(ms.size());
    prefill.push_back(ms[0]);
    tokens_per_s.push_back(double(batch) * new_tokens / seconds);
    decode.push_back(Median(std::vector<double>(ms.begin() + 1, ms.end())));
  }
  // Every rank reports: the time in communicator calls includes waiting for slower peers.
  printf(
      "model_parallel_bench: rank %d of tp=%d pp=%d (micro-batches %d) on %s, %s, %s, batch=%d "
      "prompt=%d new_tokens=%d: prefill %.3f ms, decode %.3f ms/step, %.0f tokens/s overall "
      "(medians of %d runs); in the communicators %.3f ms/step (%.1f calls/step, all steps)\n",
      groups->rank, tp, pp, micro, device.c_str(), groups->tp_comm->name().c_str(),
      (*engine)->runner().num_graphs() > 0 ? "decode graphs" : "eager decode", batch, prompt_len,
      new_tokens, Median(prefill), Median(decode), Median(tokens_per_s), repeats,
      measured_steps > 0 ? measured_comm_ms / measured_steps : 0.0,
      measured_steps > 0 ? static_cast<double>(measured_calls) / measured_steps : 0.0);
  fflush(stdout);
  engine->reset();
  // The communicators free their MPI communicators: before MPI_Finalize, not at scope exit.
  groups->tp_comm.reset();
  groups->pp_comm.reset();
  MPI_Finalize();
  return 0;
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) { return tpserve::Main(argc, argv); }
