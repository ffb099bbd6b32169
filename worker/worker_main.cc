// tpserve-worker: one rank of the model. Connects to the coordinator, registers, loads its shard
// as assigned, reports its KV capacity, then runs StepPlans until told to shut down.
//   tpserve-worker --coordinator HOST:PORT [--rank R --world-size N] [--device cpu|cuda|auto]
// Under mpirun the rank and world size come from MPI (the coordinator, when it is part of the
// same MPMD job, is left out by a split of MPI_COMM_WORLD); without MPI from the flags or
// TPSERVE_RANK / TPSERVE_WORLD_SIZE, or SLURM_PROCID / SLURM_NTASKS.
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/model_files.h"
#include "common/status.h"
#include "parallel/process_groups.h"
#include "parallel/shard_plan.h"
#include "tools/cli_args.h"
#include "worker/control_client.h"
#include "worker/engine.h"
#include "worker/shard_runner.h"
#ifdef TPSERVE_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

namespace tpserve {
namespace {

constexpr char kUsage[] =
    "usage: tpserve-worker --coordinator HOST:PORT [--rank R --world-size N]\n"
    "                      [--device cpu|cuda|auto] [--gpu INDEX] [--connect-timeout S]";

bool UnderMpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
         std::getenv("PMIX_RANK") != nullptr;
}

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoll(v) : fallback;
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

std::string Hostname() {
  char buf[256] = {};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

// Everything after the connection; errors go to the coordinator as fatal_error.
absl::Status Serve(ControlClient& client, int rank, int world_size, bool mpi, MPI_Comm workers,
                   Ops* ops, const std::string& device) {
  worker::CoordinatorMessage msg;
  if (!client.Read(&msg)) {
    return absl::UnavailableError("the coordinator closed the control stream before assigning");
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
    NcclGroupIds ids;
    if (a.make_nccl_ids()) {
      TP_ASSIGN_OR_RETURN(ids, NewNcclGroupIds(a.tp(), a.pp()));
      worker::WorkerMessage out;
      for (const auto& id : ids.tp_ids) out.mutable_nccl_ids()->add_tp_ids(id);
      for (const auto& id : ids.pp_ids) out.mutable_nccl_ids()->add_pp_ids(id);
      if (!client.Send(out)) return absl::UnavailableError("could not send the NCCL ids");
    } else {
      if (!client.Read(&msg) || !msg.has_nccl_ids()) {
        return absl::UnavailableError("expected the NCCL ids from the coordinator");
      }
      ids.tp_ids.assign(msg.nccl_ids().tp_ids().begin(), msg.nccl_ids().tp_ids().end());
      ids.pp_ids.assign(msg.nccl_ids().pp_ids().begin(), msg.nccl_ids().pp_ids().end());
    }
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
  if (const char* g = std::getenv("TPSERVE_WORKER_CUDA_GRAPHS"))
    so.cuda_graphs = std::string(g) != "0";
  ParallelContext comms{groups.tp_comm.get(), groups.pp_comm.get()};
  TP_ASSIGN_OR_RETURN(auto runner, ShardRunner::Create(files, plan, rank, ops, comms, so));
  // Before the KV report: the coordinator turns SERVING only after every rank reported.
  TP_RETURN_IF_ERROR(runner->WarmUpGraphs());
  worker::WorkerMessage report;
  report.mutable_kv_report()->set_num_blocks(runner->num_blocks());
  report.mutable_kv_report()->set_block_size(so.block_size);
  report.mutable_kv_report()->set_weight_bytes(runner->model().weight_bytes());
  report.mutable_kv_report()->set_load_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  if (!client.Send(report)) return absl::UnavailableError("could not send the KV report");
  TP_LOG(INFO) << "loaded layers [" << runner->model().shard().layer_begin << ", "
               << runner->model().shard().layer_end << "), " << runner->num_blocks()
               << " KV blocks = " << static_cast<int64_t>(runner->num_blocks()) * so.block_size
               << " tokens";

  while (client.Read(&msg)) {
    if (msg.has_shutdown()) {
      TP_LOG(INFO) << "shutdown: " << msg.shutdown().reason();
      return absl::OkStatus();
    }
    if (!msg.has_step()) continue;
    const auto s0 = std::chrono::steady_clock::now();
    absl::StatusOr<worker::StepResult> result = runner->Run(msg.step());
    worker::WorkerMessage out;
    worker::StepResult* r = out.mutable_step_result();
    if (result.ok()) *r = std::move(*result);  // the sampled ids and logprobs
    r->set_step_id(msg.step().step_id());
    r->set_rank(rank);
    r->set_forward_seconds(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count());
    if (!result.ok()) {
      r->set_error(std::string(result.status().message()));
      client.Send(out);
      return result.status();
    }
    if (runner->is_sampler()) {
      if (!client.Send(out)) break;
    }
  }
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
  auto parsed = CliArgs::Parse(
      args, {"coordinator", "rank", "world-size", "device", "gpu", "connect-timeout"}, {});
  if (!parsed.ok()) {
    std::fprintf(stderr, "tpserve-worker: %s\n%s\n", std::string(parsed.status().message()).c_str(),
                 kUsage);
    return 2;
  }
  const CliArgs& a = *parsed;
  if (!a.Has("coordinator")) {
    std::fprintf(stderr, "tpserve-worker: --coordinator is required\n%s\n", kUsage);
    return 2;
  }
  const bool mpi = UnderMpi();
  int rank = 0, world_size = 1, local_rank = 0;
  MPI_Comm workers = MPI_COMM_NULL;
  if (mpi) {
    absl::Status st = InitMpi(&argc, &argv);
    if (!st.ok()) {
      std::fprintf(stderr, "tpserve-worker: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    int world_rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    // Color 0 = workers; a coordinator in the same MPMD job splits off with color 1.
    MPI_Comm_split(MPI_COMM_WORLD, 0, world_rank, &workers);
    MPI_Comm_rank(workers, &rank);
    MPI_Comm_size(workers, &world_size);
    MPI_Comm local = MPI_COMM_NULL;
    MPI_Comm_split_type(workers, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
    MPI_Comm_rank(local, &local_rank);
    MPI_Comm_free(&local);
  } else {
    auto r = a.GetInt("rank", EnvInt("TPSERVE_RANK", EnvInt("SLURM_PROCID", 0)));
    auto n = a.GetInt("world-size", EnvInt("TPSERVE_WORLD_SIZE", EnvInt("SLURM_NTASKS", 1)));
    if (!r.ok() || !n.ok() || *n < 1 || *r < 0 || *r >= *n) {
      std::fprintf(stderr, "tpserve-worker: --rank must be in [0, --world-size)\n%s\n", kUsage);
      return 2;
    }
    rank = static_cast<int>(*r);
    world_size = static_cast<int>(*n);
    local_rank = static_cast<int>(EnvInt("LOCAL_RANK", EnvInt("SLURM_LOCALID", rank)));
  }
  SetLogPrefix(absl::StrCat("worker ", rank));
  const std::string device = ResolveDevice(a.GetOr("device", "auto"));
  auto gpu = a.GetInt("gpu", local_rank);
  const int gpu_index = gpu.ok() ? static_cast<int>(*gpu) : 0;
  auto timeout = a.GetInt("connect-timeout", 60);
  int code = 0;
  {
    auto ops = MakeOps(device, gpu_index);
    auto client = ControlClient::Connect(*a.Get("coordinator"),
                                         std::chrono::seconds(timeout.ok() ? *timeout : 60));
    absl::Status st = !ops.ok() ? ops.status() : client.status();
    if (st.ok()) {
      worker::WorkerMessage reg;
      worker::Register* r = reg.mutable_register_();
      r->set_rank(rank);
      r->set_world_size(world_size);
      r->set_device(device);
      r->set_gpu_index(device == "cuda" ? gpu_index : -1);
      r->set_free_memory_bytes(device == "cpu" ? AvailableHostMemory() : 0);
      r->set_hostname(Hostname());
      r->set_mpi(mpi);
      r->set_pid(getpid());
      if (!(*client)->Send(reg)) {
        st = absl::UnavailableError("could not register with the coordinator");
      } else {
        (*client)->StartHeartbeats(std::chrono::milliseconds(1000), std::chrono::seconds(5));
        st = Serve(**client, rank, world_size, mpi, workers, ops->get(), device);
        if (!st.ok()) {
          worker::WorkerMessage fatal;
          fatal.set_fatal_error(std::string(st.message()));
          (*client)->Send(fatal);
        }
        (*client)->Close();
      }
    }
    if (!st.ok()) {
      TP_LOG(ERROR) << st.message();
      code = 1;
    }
  }
  if (mpi) {
    if (code != 0) MPI_Abort(MPI_COMM_WORLD, code);  // the job cannot continue without this rank
    MPI_Comm_free(&workers);
    MPI_Finalize();
  }
  return code;
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) { return tpserve::Main(argc, argv); }
