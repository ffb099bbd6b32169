// tpserve-worker: one rank of the model. Connects to the coordinator, registers, loads its shard
// as assigned, reports its KV capacity, then runs StepPlans until told to shut down.
//   tpserve-worker --coordinator HOST:PORT [--rank R --world-size N] [--device cpu|cuda|auto]
//     [--cluster-secret-file F] [--all-reduce auto|nccl|custom]
// Under mpirun the rank and world size come from MPI (the coordinator, when it is part of the
// same MPMD job, is left out by a split of MPI_COMM_WORLD); without MPI from the flags or
// TPSERVE_RANK / TPSERVE_WORLD_SIZE, or SLURM_PROCID / SLURM_NTASKS.
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/cluster_secret.h"
#include "common/env.h"
#include "common/flags.h"
#include "common/logging.h"
#include "common/model_files.h"
#include "common/status.h"
#include "parallel/bootstrap.h"
#include "parallel/process_groups.h"
#include "parallel/shard_plan.h"
#include "proto/block_tables.h"
#include "worker/control_client.h"
#include "worker/engine.h"
#include "worker/shard_runner.h"
#ifdef TPSERVE_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

namespace tpserve {
namespace {

const CommandSpec& WorkerFlagSpec() {
  static const CommandSpec* const spec = new CommandSpec{
      "tpserve-worker",
      "One rank of the model: registers with the coordinator, loads its shard, runs steps.",
      {StringFlag("coordinator", "HOST:PORT", "the coordinator's control-plane address [required]"),
       IntFlag("rank", 0, 1 << 20,
               "this worker's rank (default: MPI, TPSERVE_RANK, SLURM_PROCID or 0)", "R"),
       IntFlag("world-size", 1, 1 << 20,
               "number of workers (default: MPI, TPSERVE_WORLD_SIZE, SLURM_NTASKS or 1)"),
       StringFlag("device", "cpu|cuda|auto", "where to run (default auto)"),
       IntFlag("gpu", 0, 1023, "CUDA device index (default: the node-local rank)", "INDEX"),
       StringFlag("cluster-secret-file", "PATH",
                  "the coordinator's --cluster-secret-file (default: TPSERVE_CLUSTER_SECRET, set "
                  "for the workers a coordinator spawns)"),
       StringFlag("all-reduce", "auto|nccl|custom",
                  "all-reduce of the TP group: nccl (the backend's), custom (CUDA IPC kernel, also "
                  "between ranks sharing one GPU) or auto (custom where every rank can map every "
                  "peer); default TPSERVE_ALL_REDUCE, else nccl"),
       IntFlag("connect-timeout", 1, 86400,
               "seconds to wait for the coordinator to accept the connection (default 60)", "S")},
      "Under mpirun the rank and world size come from MPI (a coordinator in the same MPMD job\n"
      "is left out by a split of MPI_COMM_WORLD)."};
  return *spec;
}

// The first of `vars` that is set, else `fallback`.
int64_t FirstSetInt(std::initializer_list<const EnvVar*> vars, int64_t fallback) {
  for (const EnvVar* v : vars) {
    if (EnvIsSet(*v)) return EnvInt(*v);
  }
  return fallback;
}

int64_t AvailableHostMemory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

// A "Key: N kB" line of a /proc file, in bytes (0 when absent).
int64_t ProcFieldBytes(const char* path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::atoll(line.c_str() + key.size()) * 1024;
  }
  return 0;
}

std::string Hostname() {
  char buf[256] = {};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

// Why the coordinator ended the control stream: a refused register (wrong secret, rank taken)
// carries the reason in the stream's status.
absl::Status StreamEnded(ControlClient& client, absl::string_view otherwise) {
  const absl::Status end = client.EndStatus();
  if (!end.ok()) {
    return absl::Status(end.code(),
                        absl::StrCat("the coordinator refused this worker: ", end.message()));
  }
  return absl::UnavailableError(otherwise);
}

// Everything after the connection; errors go to the coordinator as fatal_error.
absl::Status Serve(ControlClient& client, int rank, int world_size, bool mpi, MPI_Comm workers,
                   Ops* ops, const std::string& device, AllReduceImpl all_reduce) {
  worker::CoordinatorMessage msg;
  if (!client.Read(&msg)) {
    return StreamEnded(client, "the coordinator closed the control stream before assigning");
  }
  if (msg.has_shutdown()) return absl::OkStatus();
  if (!msg.has_assignment()) return absl::InternalError("expected an assignment");
  const worker::Assignment a = msg.assignment();
  if (a.rank() != rank) {
    return absl::InternalError(
        absl::StrCat("assigned rank ", a.rank(), " but this is rank ", rank));
  }
  const auto t0 = std::chrono::steady_clock::now();
  GroupOptions go;
  go.tp = a.tp();
  go.pp = a.pp();
  go.backend = device == "cuda" ? CommBackend::kNccl : CommBackend::kMpi;
  if (a.comm_timeout_seconds() > 0) go.timeout = absl::Seconds(a.comm_timeout_seconds());
  go.all_reduce = all_reduce;
  if (!a.all_reduce().empty()) {  // the coordinator's --all-reduce wins over the worker's own
    TP_ASSIGN_OR_RETURN(go.all_reduce, ParseAllReduceImpl(a.all_reduce()));
  }
#ifdef TPSERVE_HAVE_CUDA
  // NCCL runs on the stream of the ops so that collectives are ordered with the kernels.
  if (device == "cuda") go.cuda_stream = static_cast<CudaOps*>(ops)->stream();
#endif
  ProcessGroups groups;
  if (world_size == 1) {
    groups = MakeSingleRankGroups(ops);
  } else if (mpi) {
    TP_ASSIGN_OR_RETURN(groups, MakeProcessGroupsFromMpi(workers, go, ops));
  } else {
    NcclIdChannel channel;
    channel.send = [&client](const NcclGroupIds& ids) {
      worker::WorkerMessage out;
      for (const auto& id : ids.tp_ids) out.mutable_nccl_ids()->add_tp_ids(id);
      for (const auto& id : ids.pp_ids) out.mutable_nccl_ids()->add_pp_ids(id);
      return client.Send(out);
    };
    channel.receive = [&client](NcclGroupIds* ids) {
      worker::CoordinatorMessage in;
      if (!client.Read(&in) || !in.has_nccl_ids()) return false;
      ids->tp_ids.assign(in.nccl_ids().tp_ids().begin(), in.nccl_ids().tp_ids().end());
      ids->pp_ids.assign(in.nccl_ids().pp_ids().begin(), in.nccl_ids().pp_ids().end());
      return true;
    };
    TP_ASSIGN_OR_RETURN(
        NcclGroupIds ids,
        RelayNcclIds(
            a.make_nccl_ids(), [&a] { return NewNcclGroupIds(a.tp(), a.pp()); }, channel));
    TP_ASSIGN_OR_RETURN(groups, MakeProcessGroupsFromNcclIds(rank, go, ids, ops));
  }
  TP_ASSIGN_OR_RETURN(ModelFiles files, ModelFiles::Open(a.model_dir()));
  TP_RETURN_IF_ERROR(files.ValidateWeights());
  PlanOptions po;
  po.tp = a.tp();
  po.pp = a.pp();
  po.device_map = a.device_map();
  TP_ASSIGN_OR_RETURN(ShardPlan plan, PlanShards(files.config(), po));
  ShardRunnerOptions so;
  so.block_size = a.block_size();
  so.kv_cache_bytes = a.kv_cache_bytes();
  if (a.gpu_memory_utilization() > 0) so.gpu_memory_utilization = a.gpu_memory_utilization();
  so.model.max_batch_tokens = a.max_num_batched_tokens();
  so.model.max_batch_seqs = a.max_num_seqs();
  so.deterministic = a.deterministic();
  if (!a.kv_cache_dtype().empty()) {
    TP_ASSIGN_OR_RETURN(so.kv_cache_dtype, ParseKvCacheDType(a.kv_cache_dtype()));
  }
  if (EnvIsSet(env::kWorkerCudaGraphs)) so.cuda_graphs = EnvBool(env::kWorkerCudaGraphs);
  ParallelContext comms{groups.tp_comm.get(), groups.pp_comm.get()};
  TP_ASSIGN_OR_RETURN(auto runner, ShardRunner::Create(files, plan, rank, ops, comms, so));
  // Before the KV report: the coordinator turns SERVING only after every rank reported.
  TP_RETURN_IF_ERROR(runner->WarmUpGraphs());
  worker::WorkerMessage report;
  report.mutable_kv_report()->set_num_blocks(runner->num_blocks());
  report.mutable_kv_report()->set_block_size(so.block_size);
  report.mutable_kv_report()->set_kv_cache_dtype(std::string(KvCacheDTypeName(runner->kv_dtype())));
  report.mutable_kv_report()->set_weight_bytes(runner->model().weight_bytes());
  report.mutable_kv_report()->set_load_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  {
    size_t free_bytes = 0, total_bytes = 0;
    const bool device = ops->MemoryInfo(&free_bytes, &total_bytes);
    report.mutable_kv_report()->set_device_memory_used_bytes(
        device ? static_cast<int64_t>(total_bytes - free_bytes)
               : ProcFieldBytes("/proc/self/status", "VmRSS:"));
    report.mutable_kv_report()->set_device_memory_total_bytes(
        device ? static_cast<int64_t>(total_bytes) : ProcFieldBytes("/proc/meminfo", "MemTotal:"));
  }
  if (!client.Send(report)) return absl::UnavailableError("could not send the KV report");
  TP_LOG(INFO) << "loaded layers [" << runner->model().shard().layer_begin << ", "
               << runner->model().shard().layer_end << "), " << runner->num_blocks()
               << " KV blocks = " << static_cast<int64_t>(runner->num_blocks()) * so.block_size
               << " tokens";

  BlockTables tables;  // every sequence's KV block table, rebuilt from the plans' deltas
  // Steps launched and not yet reported, oldest first (at most two: see ShardRunner::Launch).
  // A plan that arrives while a step runs is launched at once when the runner can go ahead
  // (the step in flight feeds its sampled ids on the device), so the device does not wait for
  // the host's round trip between steps; the step in flight is reported right after.
  struct Launched {
    uint64_t step_id;
    std::chrono::steady_clock::time_point received;  // its plan arrived
    std::chrono::steady_clock::time_point launched;  // Launch returned
  };
  std::deque<Launched> launched;
  int64_t steps = 0, steps_ahead = 0;
  auto log_steps = [&] {
    TP_LOG(INFO) << "steps: " << steps << " launched, " << steps_ahead
                 << " of them ahead of the step in flight";
  };
  auto last_finish = std::chrono::steady_clock::now();
  // Finishes the oldest launched step and reports it (the sampling rank).
  auto report_oldest = [&]() -> absl::Status {
    const Launched l = launched.front();
    launched.pop_front();
    absl::StatusOr<worker::StepResult> result = runner->Finish();
    const auto now = std::chrono::steady_clock::now();
    worker::WorkerMessage out;
    worker::StepResult* r = out.mutable_step_result();
    if (result.ok()) *r = std::move(*result);  // the sampled ids and logprobs
    r->set_step_id(l.step_id);
    r->set_rank(rank);
    // The step's own time: from its plan's arrival, or from the end of the step it queued
    // behind, whichever is later.
    r->set_forward_seconds(
        std::chrono::duration<double>(now - std::max(l.received, last_finish)).count());
    last_finish = now;
    if (!result.ok()) {
      r->set_error(std::string(result.status().message()));
      client.Send(out);
      return result.status();
    }
    if (runner->is_sampler() && !client.Send(out)) {
      return absl::UnavailableError("the control stream to the coordinator closed");
    }
    return absl::OkStatus();
  };
  // TPSERVE_LAUNCH_AHEAD=1 on a backend that samples synchronously (the CPU, in tests): a step
  // is done when Launch returns, so the next plan could never meet it in flight; its report is
  // held for up to 2 ms for that plan to arrive, as a GPU step would still be running.
  const bool hold_reports = runner->launch_ahead() && !ops->AsyncSampling();
  client.StartReader();
  for (;;) {
    // The next message; meanwhile a launched step is reported as soon as it is done.
    ControlClient::ReadResult got = ControlClient::ReadResult::kTimeout;
    while (got == ControlClient::ReadResult::kTimeout) {
      if (launched.empty()) {
        got = client.Read(&msg) ? ControlClient::ReadResult::kMessage
                                : ControlClient::ReadResult::kEnded;
      } else if (!runner->launch_ahead() ||
                 (runner->OldestReady() &&
                  (!hold_reports || std::chrono::steady_clock::now() - launched.front().launched >
                                        std::chrono::milliseconds(2)))) {
        // Without launching ahead nothing can use the wait: block on the step's end as before.
        TP_RETURN_IF_ERROR(report_oldest());
      } else {
        got = client.ReadFor(&msg, std::chrono::microseconds(20));
      }
    }
    if (got == ControlClient::ReadResult::kEnded) break;
    if (msg.has_shutdown()) {
      while (!launched.empty()) TP_RETURN_IF_ERROR(report_oldest());
      log_steps();
      TP_LOG(INFO) << "shutdown: " << msg.shutdown().reason();
      return absl::OkStatus();
    }
    if (!msg.has_step()) continue;
    const auto received = std::chrono::steady_clock::now();
    absl::Status status = tables.Resolve(*msg.mutable_step());
    const bool ahead = status.ok() && !launched.empty() && runner->CanLaunchAhead(msg.step());
    if (!ahead) {
      while (!launched.empty()) TP_RETURN_IF_ERROR(report_oldest());
    }
    if (status.ok()) status = runner->Launch(msg.step());
    if (!status.ok()) {
      while (!launched.empty()) TP_RETURN_IF_ERROR(report_oldest());
      worker::WorkerMessage out;
      worker::StepResult* r = out.mutable_step_result();
      r->set_step_id(msg.step().step_id());
      r->set_rank(rank);
      r->set_error(std::string(status.message()));
      client.Send(out);
      return status;
    }
    launched.push_back({msg.step().step_id(), received, std::chrono::steady_clock::now()});
    ++steps;
    steps_ahead += ahead;
    // The step before it is reported while this one waits behind it on the device.
    if (ahead) TP_RETURN_IF_ERROR(report_oldest());
  }
  log_steps();
  return absl::UnavailableError("the control stream to the coordinator closed");
}

// SIGTERM / SIGINT (from mpirun, srun, Kubernetes): the coordinator drains and then tells the
// workers to shut down, so a worker keeps serving for a while; if nobody does, it exits.
void HandleTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // before any other thread starts
  std::thread([set] {
    int sig = 0;
    sigwait(&set, &sig);
    TP_LOG(INFO) << "signal " << sig << ": waiting up to 60 s for the coordinator's shutdown";
    std::this_thread::sleep_for(std::chrono::seconds(60));
    TP_LOG(WARNING) << "no shutdown from the coordinator after signal " << sig << "; exiting";
    _exit(1);
  }).detach();
}

int Main(int argc, char** argv) {
  HandleTerminationSignals();
  std::vector<std::string> args(argv + 1, argv + argc);
  auto parsed = Flags::Parse(WorkerFlagSpec(), args);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s\n", std::string(parsed.status().message()).c_str());
    return 2;
  }
  const Flags& a = *parsed;
  if (a.help()) return PrintUsage(WorkerFlagSpec()).ok() ? 0 : 1;
  if (!a.Has("coordinator")) {
    std::fprintf(stderr, "tpserve-worker: --coordinator is required (see --help)\n");
    return 2;
  }
  const bool mpi = UnderMpi();
  int rank = 0, world_size = 1, local_rank = 0;
  MpiWorkers mpi_workers;
  if (mpi) {
    absl::StatusOr<MpiWorkers> joined = JoinMpiAsWorker(&argc, &argv);
    if (!joined.ok()) {
      std::fprintf(stderr, "tpserve-worker: %s\n", std::string(joined.status().message()).c_str());
      return 1;
    }
    mpi_workers = *joined;
    rank = mpi_workers.rank;
    world_size = mpi_workers.world_size;
    local_rank = mpi_workers.local_rank;
  } else {
    const int64_t r = a.GetInt("rank", FirstSetInt({&env::kRank, &env::kSlurmProcid}, 0));
    const int64_t n =
        a.GetInt("world-size", FirstSetInt({&env::kWorldSize, &env::kSlurmNtasks}, 1));
    if (n < 1 || r < 0 || r >= n) {
      std::fprintf(stderr, "tpserve-worker: rank %lld is not in [0, world size %lld)\n",
                   static_cast<long long>(r), static_cast<long long>(n));
      return 2;
    }
    rank = static_cast<int>(r);
    world_size = static_cast<int>(n);
    local_rank = static_cast<int>(FirstSetInt({&env::kLocalRank, &env::kSlurmLocalid}, rank));
  }
  SetLogPrefix(absl::StrCat("worker rank ", rank));
  const std::string device = ResolveDevice(a.GetOr("device", "auto"));
  const int gpu_index = static_cast<int>(a.GetInt("gpu", local_rank));
  const int64_t connect_timeout_s = a.GetInt("connect-timeout", 60);
  const absl::StatusOr<AllReduceImpl> all_reduce =
      ParseAllReduceImpl(a.GetOr("all-reduce", EnvString(env::kAllReduce)));
  if (!all_reduce.ok()) {
    std::fprintf(stderr, "tpserve-worker: %s\n",
                 std::string(all_reduce.status().message()).c_str());
    if (mpi) LeaveMpiAsWorker(&mpi_workers, /*failed=*/true);
    return 2;
  }
  absl::StatusOr<std::string> secret = absl::InvalidArgumentError(
      "no cluster secret: give --cluster-secret-file (the coordinator's file) or set "
      "TPSERVE_CLUSTER_SECRET");
  if (a.Has("cluster-secret-file")) {
    secret = ReadClusterSecretFile(*a.Get("cluster-secret-file"));
  } else if (EnvIsSet(env::kClusterSecret) && !EnvString(env::kClusterSecret).empty()) {
    secret = EnvString(env::kClusterSecret);
  }
  if (!secret.ok()) {
    std::fprintf(stderr, "tpserve-worker: %s\n", std::string(secret.status().message()).c_str());
    if (mpi) LeaveMpiAsWorker(&mpi_workers, /*failed=*/true);
    return 2;
  }
  int code = 0;
  auto ops = MakeOps(device, gpu_index);
  const auto connect_deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(connect_timeout_s);
  // A refusal with ABORTED (the coordinator is replacing a failed group and has not reopened
  // registration yet) is answered by registering again, until the connect deadline.
  for (int attempt = 0;; ++attempt) {
    const auto left = std::chrono::duration_cast<std::chrono::seconds>(
        connect_deadline - std::chrono::steady_clock::now());
    auto client = ControlClient::Connect(*a.Get("coordinator"),
                                         std::max(left, std::chrono::seconds(1)), *secret);
    absl::Status st = !ops.ok() ? ops.status() : client.status();
    if (st.ok()) {
      worker::WorkerMessage reg;
      worker::Register* r = reg.mutable_register_();
      r->set_rank(rank);
      r->set_world_size(world_size);
      r->set_device(device);
      r->set_gpu_index(device == "cuda" ? gpu_index : -1);
      if (device == "cpu") {
        r->set_free_memory_bytes(AvailableHostMemory());
      } else if (ops.ok()) {
        size_t free_bytes = 0, total_bytes = 0;
        if ((*ops)->MemoryInfo(&free_bytes, &total_bytes)) {
          r->set_free_memory_bytes(static_cast<int64_t>(free_bytes));
          r->set_total_memory_bytes(static_cast<int64_t>(total_bytes));
        }
      }
      r->set_hostname(Hostname());
      r->set_mpi(mpi);
      r->set_pid(getpid());
      if (!(*client)->Send(reg)) {
        // The coordinator may refuse (and end the stream) before the register is written.
        worker::CoordinatorMessage ignored;
        while ((*client)->Read(&ignored)) {
        }
        st = StreamEnded(**client, "could not register with the coordinator");
      } else {
        (*client)->StartHeartbeats(std::chrono::milliseconds(1000), std::chrono::seconds(5));
        st = Serve(**client, rank, world_size, mpi, mpi_workers.comm, ops->get(), device,
                   *all_reduce);
        if (!st.ok()) {
          worker::WorkerMessage fatal;
          fatal.set_fatal_error(std::string(st.message()));
          (*client)->Send(fatal);
        }
        (*client)->Close();
      }
    }
    if (absl::IsAborted(st) &&
        std::chrono::steady_clock::now() + std::chrono::milliseconds(200) < connect_deadline) {
      TP_LOG(WARNING) << st.message() << " (attempt " << attempt + 1 << ")";
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      continue;
    }
    if (!st.ok()) {
      TP_LOG(ERROR) << st.message();
      code = 1;
    }
    break;
  }
  if (mpi) LeaveMpiAsWorker(&mpi_workers, /*failed=*/code != 0);
  return code;
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) { return tpserve::Main(argc, argv); }
