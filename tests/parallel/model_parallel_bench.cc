// The cost of the host-staged MPI communicator for the whole model on the CPU: decode ms per
// token (and prefill ms) of Engine::Generate with a tp x pp layout over MPI, to compare with
// one rank. Run under mpirun with tp * pp ranks:
//   mpirun -np 2 model_parallel_bench --tp 2 --pp 1 [--model DIR] [--batch 1] [--prompt 32]
//       [--new-tokens 128] [--repeats 3]
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

namespace tpserve {
namespace {

// Forwards to a real communicator and adds up the wall time spent in it.
class TimedCommunicator : public Communicator {
 public:
  TimedCommunicator(Communicator* inner, double* total_ms) : inner_(inner), total_ms_(total_ms) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }
  bool buffers_small_sends() const override { return inner_->buffers_small_sends(); }
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
    } else {
      fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  std::unique_ptr<Ops> ops = MakeCpuOps();
  GroupOptions group_options;
  group_options.tp = tp;
  group_options.pp = pp;
  absl::StatusOr<ProcessGroups> groups =
      MakeProcessGroupsFromMpi(MPI_COMM_WORLD, group_options, ops.get());
  if (!groups.ok()) {
    fprintf(stderr, "groups: %s\n", groups.status().ToString().c_str());
    return 3;
  }
  EngineOptions options;
  options.ops = ops.get();
  options.num_kv_blocks = 256;
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
      "model_parallel_bench: rank %d of tp=%d pp=%d (micro-batches %d), batch=%d prompt=%d "
      "new_tokens=%d: prefill %.3f ms, decode %.3f ms/step, %.0f tokens/s overall (medians of "
      "%d runs); in the communicators %.3f ms/step (%.1f calls/step, all steps)\n",
      groups->rank, tp, pp, micro, batch, prompt_len, new_tokens, Median(prefill), Median(decode),
      Median(tokens_per_s), repeats, measured_steps > 0 ? measured_comm_ms / measured_steps : 0.0,
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
