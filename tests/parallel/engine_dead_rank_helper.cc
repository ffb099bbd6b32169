// Helper of engine_dead_rank_test, run under mpirun: every rank runs tiny-coder through Engine
// with a tp x pp layout over MPI communicators; the victim rank dies (abort, exit without
// MPI_Finalize) or stalls forever at its `die_at`-th communicator operation, i.e. in the middle
// of Generate. Survivors must get an error from Generate naming the group, rank and operation,
// print it and exit non-zero (what a worker does), or be ended by mpirun; nothing may hang.
// Usage: engine_dead_rank_helper <tp> <pp> <abort|exit|stall> <victim> <die_at> <timeout_ms>
#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/ops.h"
#include "parallel/process_groups.h"
#include "worker/engine.h"

namespace tpserve {
namespace {

// Forwards to a real communicator; the victim dies at the die_at-th operation (counted over
// both of its communicators).
class DyingCommunicator : public Communicator {
 public:
  DyingCommunicator(Communicator* inner, bool victim, const std::string& mode, int die_at,
                    std::atomic<int>* count)
      : inner_(inner), victim_(victim), mode_(mode), die_at_(die_at), count_(count) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }
  absl::Status AllReduceSum(Tensor t) override {
    MaybeDie("AllReduceSum");
    return inner_->AllReduceSum(t);
  }
  absl::Status AllGather(const Tensor& in, Tensor out) override {
    MaybeDie("AllGather");
    return inner_->AllGather(in, out);
  }
  absl::Status Send(const Tensor& t, int peer) override {
    MaybeDie("Send");
    return inner_->Send(t, peer);
  }
  absl::Status Recv(Tensor t, int peer) override {
    MaybeDie("Recv");
    return inner_->Recv(t, peer);
  }
  absl::Status Broadcast(Tensor t, int root) override {
    MaybeDie("Broadcast");
    return inner_->Broadcast(t, root);
  }

 private:
  void MaybeDie(const char* op) {
    if (!victim_ || ++*count_ != die_at_) return;
    fprintf(stderr, "engine_dead_rank_helper: victim %s now, before %s of %s\n", mode_.c_str(), op,
            inner_->name().c_str());
    fflush(stderr);
    if (mode_ == "abort") std::abort();
    if (mode_ == "exit") _exit(5);
    while (true) sleep(1000);  // stall
  }

  Communicator* inner_;
  bool victim_;
  std::string mode_;
  int die_at_;
  std::atomic<int>* count_;
};

int Main(int argc, char** argv) {
  if (argc != 7) {
    fprintf(stderr, "usage: %s <tp> <pp> <abort|exit|stall> <victim> <die_at> <timeout_ms>\n",
            argv[0]);
    return 2;
  }
  const int tp = std::atoi(argv[1]), pp = std::atoi(argv[2]);
  const std::string mode = argv[3];
  const int victim = std::atoi(argv[4]), die_at = std::atoi(argv[5]);
  const int timeout_ms = std::atoi(argv[6]);
  absl::Status s = InitMpi(&argc, &argv);
  if (!s.ok()) {
    fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 2;
  }
  std::unique_ptr<Ops> ops = MakeCpuOps();
  GroupOptions group_options;
  group_options.tp = tp;
  group_options.pp = pp;
  group_options.timeout = absl::Milliseconds(timeout_ms);
  absl::StatusOr<ProcessGroups> groups =
      MakeProcessGroupsFromMpi(MPI_COMM_WORLD, group_options, ops.get());
  if (!groups.ok()) {
    fprintf(stderr, "engine_dead_rank_helper: groups: %s\n", groups.status().ToString().c_str());
    return 3;
  }
  const int rank = groups->rank;
  std::atomic<int> count{0};
  DyingCommunicator tp_comm(groups->tp_comm.get(), rank == victim, mode, die_at, &count);
  DyingCommunicator pp_comm(groups->pp_comm.get(), rank == victim, mode, die_at, &count);

  EngineOptions options;
  options.device = "cpu";
  options.ops = ops.get();
  options.num_kv_blocks = 32;
  options.tp = tp;
  options.pp = pp;
  options.rank = rank;
  options.comms = {&tp_comm, &pp_comm};
  const char* src = std::getenv("TPSERVE_SOURCE_DIR");
  const std::string model = absl::StrCat(src != nullptr ? src : ".", "/models/tiny-coder");
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(model, options);
  if (!engine.ok()) {
    fprintf(stderr, "engine_dead_rank_helper: rank %d: Engine::Create: %s\n", rank,
            engine.status().ToString().c_str());
    return 3;
  }
  GenerateRequest request;
  for (int i = 0; i < 20; ++i) request.prompt.push_back(100 + 7 * i);
  request.max_new_tokens = 200;
  request.ignore_eos = true;
  absl::StatusOr<std::vector<GenerateResult>> results = (*engine)->Generate({request});
  if (!results.ok()) {
    // What a worker does: report the error and exit; mpirun then ends the other ranks.
    fprintf(stderr, "engine_dead_rank_helper: rank %d: Generate failed: %s\n", rank,
            results.status().ToString().c_str());
    fflush(stderr);
    _exit(4);
  }
  fprintf(stderr, "engine_dead_rank_helper: rank %d finished without noticing the dead rank\n",
          rank);
  engine->reset();
  MPI_Finalize();
  return 0;
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) { return tpserve::Main(argc, argv); }
