// The coordinator's control plane (see worker_group.h).
#include "coordinator/worker_group.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cluster_secret.h"
#include "common/logging.h"
#include "common/logprobs.h"
#include "common/status.h"
#include "coordinator/thread_cpu.h"

namespace tpserve {

using Clock = std::chrono::steady_clock;

struct WorkerGroup::Slot {
  bool registered = false;
  bool kv_reported = false;
  worker::Register info;
  worker::KvReport kv;
  Clock::time_point last_seen;
  // Writes are serialized by write_mu; the stream pointers are cleared under it when the
  // handler returns.
  std::mutex write_mu;
  grpc::ServerContext* context = nullptr;
  grpc::ServerReaderWriter<worker::CoordinatorMessage, worker::WorkerMessage>* stream = nullptr;
};

WorkerGroup::WorkerGroup(const WorkerGroupOptions& options, const ModelConfig& config)
    : options_(options), config_(config) {
  for (int r = 0; r < options.world_size; ++r) slots_.push_back(std::make_unique<Slot>());
  sender_ = std::thread([this] { SendLoop(); });
}

WorkerGroup::~WorkerGroup() {
  Shutdown("the coordinator is exiting");
  if (monitor_.joinable()) monitor_.join();
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    send_stop_ = true;
  }
  send_cv_.notify_all();
  sender_.join();
}

void WorkerGroup::SendLoop() {
  std::unique_ptr<worker::CoordinatorMessage> msg;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(send_mu_);
      if (msg != nullptr) send_free_.push_back(std::move(msg));
      sending_ = false;
      send_idle_cv_.notify_all();
      send_cv_.wait(lock, [&] { return send_stop_ || !send_queue_.empty(); });
      if (send_stop_) return;  // the streams are closed: what is left cannot be sent
      msg = std::move(send_queue_.front());
      send_queue_.pop_front();
      sending_ = true;
    }
    const double start = ThreadCpuSeconds();
    for (int r = 0; r < options_.world_size; ++r) {
      if (!Send(r, *msg)) Fail(r, "could not send a step plan (stream closed)");
    }
    sender_cpu_seconds_.store(sender_cpu_seconds_.load() + ThreadCpuSeconds() - start);
  }
}

void WorkerGroup::SetFailureCallback(std::function<void(const absl::Status&)> callback) {
  std::lock_guard<std::mutex> lock(mu_);
  on_failure_ = std::move(callback);
}

absl::Status WorkerGroup::failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

std::vector<std::string> WorkerGroup::rank_devices() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& s : slots_) {
    std::string d = s->info.device();
    if (d == "cuda") d = absl::StrCat("cuda:", s->info.gpu_index());
    out.push_back(absl::StrCat(d, "@", s->info.hostname()));
  }
  return out;
}

int WorkerGroup::failed_rank() {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_rank_;
}

std::vector<int64_t> WorkerGroup::worker_pids() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  for (const auto& s : slots_) out.push_back(s->registered ? s->info.pid() : 0);
  return out;
}

absl::Status WorkerGroup::Reset(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (shutdown_) return absl::FailedPreconditionError("the worker group is shut down");
  if (failure_.ok()) {
    // A start that did not complete (a deadline): its streams end like a failed group's.
    failure_ = absl::UnavailableError("the worker group is being replaced");
    lock.unlock();
    cv_.notify_all();
    for (auto& s : slots_) {
      std::lock_guard<std::mutex> wlock(s->write_mu);
      if (s->context != nullptr) s->context->TryCancel();
    }
    lock.lock();
  }
  // Fail cancelled every stream; their handlers return once gRPC ends them.
  if (!cv_.wait_for(lock, timeout, [&] { return active_streams_ == 0; })) {
    return absl::DeadlineExceededError(
        absl::StrCat(active_streams_,
                     " control streams of the failed worker group did not end "
                     "within ",
                     timeout.count(), " ms"));
  }
  lock.unlock();
  if (monitor_.joinable()) monitor_.join();  // it returns once it sees the failure
  {
    // Plans for the failed group are never sent to the next one, and a write in progress ends
    // (its stream is gone) before the slots are cleared: its failure must not mark the new group.
    std::unique_lock<std::mutex> send_lock(send_mu_);
    while (!send_queue_.empty()) {
      send_free_.push_back(std::move(send_queue_.front()));
      send_queue_.pop_front();
    }
    if (!send_idle_cv_.wait_for(send_lock, timeout, [&] { return !sending_; })) {
      return absl::DeadlineExceededError(
          "a step plan write to the failed worker group did not end in time");
    }
  }
  lock.lock();
  for (auto& s : slots_) {
    std::lock_guard<std::mutex> wlock(s->write_mu);
    s->registered = s->kv_reported = false;
    s->info.Clear();
    s->kv.Clear();
  }
  started_ = false;
  failure_ = absl::OkStatus();
  failed_rank_ = -1;
  results_.clear();
  expected_.clear();
  forward_seconds_.clear();
  num_blocks_ = 0;
  return absl::OkStatus();
}

std::vector<worker::KvReport> WorkerGroup::kv_reports() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<worker::KvReport> out;
  for (const auto& s : slots_) out.push_back(s->kv);
  return out;
}

bool WorkerGroup::Send(int rank, const worker::CoordinatorMessage& msg) {
  Slot& slot = *slots_[rank];
  std::lock_guard<std::mutex> lock(slot.write_mu);
  if (slot.stream == nullptr) return false;
  return slot.stream->Write(msg);
}

void WorkerGroup::Fail(int rank, const std::string& reason) {
  std::function<void(const absl::Status&)> callback;
  absl::Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok() || shutdown_) return;
    failed_rank_ = rank;
    if (rank < 0) {
      failure_ = absl::UnavailableError(absl::StrCat("the worker group failed: ", reason));
    } else {
      const worker::Register& info = slots_[rank]->info;
      failure_ = absl::UnavailableError(absl::StrCat(
          "worker rank ", rank,
          info.hostname().empty() ? std::string()
                                  : absl::StrCat(" (", info.hostname(), ", pid ", info.pid(), ")"),
          " failed: ", reason));
    }
    status = failure_;
    callback = on_failure_;
  }
  TP_LOG(ERROR) << status.message();
  // The callback (health NOT_SERVING, the scheduler refusing work) runs before a step waiting in
  // Collect wakes: a client whose request fails on this sees the new health state already.
  if (callback) callback(status);
  cv_.notify_all();
  // The group is unusable: close every stream so the other workers exit too.
  for (auto& s : slots_) {
    std::lock_guard<std::mutex> lock(s->write_mu);
    if (s->context != nullptr) s->context->TryCancel();
  }
}

grpc::Status WorkerGroup::Control(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<worker::CoordinatorMessage, worker::WorkerMessage>* stream) {
  // Refused before reading anything: more streams than the cap, or no valid secret. Such a
  // stream holds no handler thread beyond this check.
  const int cap = options_.max_control_streams > 0 ? options_.max_control_streams
                                                   : 2 * options_.world_size + 16;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (control_handlers_ >= cap) {
      TP_LOG(WARNING) << "refused a control stream from " << context->peer() << ": " << cap
                      << " control streams are open already";
      return grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("register: the coordinator already has ", cap, " control streams open"));
    }
    ++control_handlers_;
  }
  struct Release {
    WorkerGroup* group;
    ~Release() {
      std::lock_guard<std::mutex> lock(group->mu_);
      --group->control_handlers_;
    }
  } release{this};
  if (!options_.cluster_secret.empty()) {
    const auto& md = context->client_metadata();
    const auto it = md.find(kClusterSecretMetadata);
    const bool ok =
        it != md.end() && ConstantTimeEquals(std::string_view(it->second.data(), it->second.size()),
                                             options_.cluster_secret);
    if (!ok) {
      const std::string why = it == md.end()
                                  ? "no cluster secret was sent"
                                  : "the cluster secret does not match the coordinator's";
      TP_LOG(WARNING) << "refused a worker registration from " << context->peer() << ": " << why;
      return grpc::Status(
          grpc::StatusCode::UNAUTHENTICATED,
          absl::StrCat("register refused: ", why,
                       " (give the worker the coordinator's --cluster-secret-file; workers the "
                       "coordinator spawns get it in TPSERVE_CLUSTER_SECRET)"));
    }
  }
  worker::WorkerMessage msg;
  if (!stream->Read(&msg)) return grpc::Status(grpc::StatusCode::CANCELLED, "no register");
  if (!msg.has_register_()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the first control message must be a register");
  }
  const worker::Register reg = msg.register_();
  const int rank = reg.rank();
  if (reg.world_size() != options_.world_size) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("register: world_size ", reg.world_size(),
                                     " but the coordinator expects ", options_.world_size));
  }
  if (rank < 0 || rank >= options_.world_size) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("register: rank ", rank, " outside [0, ", options_.world_size, ")"));
  }
  Slot& slot = *slots_[rank];
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (slot.registered || started_ || shutdown_) {
      // A group that failed and is not yet reset: a worker restarted at once by its launcher
      // (--rejoin) arrives before Reset reopens registration; ABORTED tells it to register
      // again (tpserve-worker does, until its --connect-timeout).
      const bool replacing = started_ && !failure_.ok() && !shutdown_;
      const std::string why =
          shutdown_   ? "the coordinator is shutting down"
          : replacing ? "the worker group is being replaced after a failure; register again"
          : started_  ? "the worker group is complete (registration is closed)"
                      : absl::StrCat("rank ", rank, " is already taken by ", slot.info.hostname(),
                                     " pid ", slot.info.pid());
      TP_LOG(WARNING) << "refused a worker registration for rank " << rank << " from "
                      << context->peer() << ": " << why;
      return grpc::Status(replacing ? grpc::StatusCode::ABORTED : grpc::StatusCode::ALREADY_EXISTS,
                          absl::StrCat("register refused: ", why));
    }
    slot.registered = true;
    slot.info = reg;
    slot.last_seen = Clock::now();
    std::lock_guard<std::mutex> wlock(slot.write_mu);
    slot.context = context;
    slot.stream = stream;
    ++active_streams_;
  }
  cv_.notify_all();
  TP_LOG(INFO) << "worker rank " << rank << " registered (" << reg.device() << " on "
               << reg.hostname() << ", pid " << reg.pid() << ")";

  while (stream->Read(&msg)) {
    std::unique_lock<std::mutex> lock(mu_);
    slot.last_seen = Clock::now();
    switch (msg.msg_case()) {
      case worker::WorkerMessage::kKvReport:
        slot.kv = msg.kv_report();
        slot.kv_reported = true;
        lock.unlock();
        cv_.notify_all();
        break;
      case worker::WorkerMessage::kStepResult: {
        const worker::StepResult& r = msg.step_result();
        if (!r.error().empty()) {
          lock.unlock();
          Fail(rank, absl::StrCat("step ", r.step_id(), ": ", r.error()));
        } else if (rank == sampler_rank_) {
          auto expected = expected_.find(r.step_id());
          const absl::Status valid =
              expected == expected_.end()
                  ? absl::InternalError(
                        absl::StrCat("a result for step ", r.step_id(), ", which is not in flight"))
                  : ValidateStepResult(r, expected->second.first, expected->second.second,
                                       config_.vocab_size);
          if (!valid.ok()) {
            lock.unlock();
            Fail(rank, absl::StrCat("returned a malformed step result: ", valid.message()));
            break;
          }
          expected_.erase(expected);
          results_[r.step_id()] = r;
          forward_seconds_[r.step_id()] = r.forward_seconds();
          lock.unlock();
          cv_.notify_all();
        }
        break;
      }
      case worker::WorkerMessage::kNcclIds: {
        lock.unlock();
        worker::CoordinatorMessage relay;
        *relay.mutable_nccl_ids() = msg.nccl_ids();
        for (int r = 0; r < options_.world_size; ++r) {
          if (r != rank) Send(r, relay);
        }
        break;
      }
      case worker::WorkerMessage::kFatalError:
        lock.unlock();
        Fail(rank, msg.fatal_error());
        break;
      default:
        break;
    }
  }
  Fail(rank, "its control stream closed (the worker exited or lost its connection)");
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::lock_guard<std::mutex> wlock(slot.write_mu);
    slot.stream = nullptr;
    slot.context = nullptr;
    --active_streams_;
  }
  cv_.notify_all();
  return grpc::Status::OK;
}

absl::Status WorkerGroup::Start(std::chrono::seconds register_timeout,
                                std::chrono::seconds load_timeout) {
  const int n = options_.world_size;
  std::unique_lock<std::mutex> lock(mu_);
  auto all = [&](bool Slot::*field) {
    return std::all_of(slots_.begin(), slots_.end(), [&](const auto& s) { return (*s).*field; });
  };
  if (!cv_.wait_for(lock, register_timeout,
                    [&] { return all(&Slot::registered) || !failure_.ok() || shutdown_; })) {
    std::vector<int> missing;
    for (int r = 0; r < n; ++r) {
      if (!slots_[r]->registered) missing.push_back(r);
    }
    return absl::DeadlineExceededError(absl::StrCat(
        "only ", n - static_cast<int>(missing.size()), " of ", n, " workers registered within ",
        register_timeout.count(), " s; missing ranks: ", absl::StrJoin(missing, ", ")));
  }
  if (!failure_.ok()) return failure_;
  if (shutdown_) return absl::CancelledError("shut down while waiting for workers");
  const std::string device = slots_[0]->info.device();
  bool all_mpi = true;
  for (int r = 0; r < n; ++r) {
    if (slots_[r]->info.device() != device) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker rank 0 runs on ", device, " but rank ", r, " on ",
                       slots_[r]->info.device(), "; all workers must use the same device"));
    }
    all_mpi = all_mpi && slots_[r]->info.mpi();
  }
  PlanOptions plan_options;
  plan_options.tp = options_.tp > 0 ? options_.tp : n;
  plan_options.pp = options_.tp > 0 ? options_.pp : 1;
  plan_options.device_map = options_.device_map;
  plan_options.bytes_per_elem = device == "cpu" ? 4 : 2;
  // Balance and check the fit against the memory every rank reported (unequal GPUs, ranks that
  // share one).
  std::vector<RankMemory> memory;
  for (int r = 0; r < n; ++r) {
    const worker::Register& info = slots_[r]->info;
    memory.push_back({info.hostname(), info.device() == "cuda", info.gpu_index(),
                      info.free_memory_bytes(), info.total_memory_bytes()});
  }
  plan_options.stage_free_bytes =
      StageFreeBytes(memory, plan_options.tp, plan_options.pp,
                     options_.gpu_memory_utilization > 0 ? options_.gpu_memory_utilization : 0.90);
  if (plan_options.tp * plan_options.pp != n) {
    return absl::InvalidArgumentError(absl::StrCat("--tp ", plan_options.tp, " x --pp ",
                                                   plan_options.pp, " does not match the ", n,
                                                   " workers"));
  }
  auto plan = PlanShards(config_, plan_options);
  if (!plan.ok()) return plan.status();
  plan_ = *plan;
  for (const std::string& note : plan_.notes) TP_LOG(INFO) << "plan: " << note;
  sampler_rank_ = (plan_.pp - 1) * plan_.tp;
  const bool relay = n > 1 && !all_mpi;
  if (relay && device == "cpu") {
    return absl::FailedPreconditionError(
        "CPU workers with a world size above 1 communicate over MPI: launch them with mpirun "
        "(e.g. mpirun -np N tpserve-worker --coordinator ADDR) or use `tpserve serve`, which "
        "does");
  }
  started_ = true;
  lock.unlock();
  for (int r = 0; r < n; ++r) {
    worker::CoordinatorMessage msg;
    worker::Assignment* a = msg.mutable_assignment();
    a->set_model_dir(options_.model_dir);
    a->set_tp(plan_.tp);
    a->set_pp(plan_.pp);
    a->set_device_map(plan_.DeviceMapString());
    a->set_rank(r);
    a->set_kv_cache_bytes(options_.kv_cache_bytes);
    a->set_gpu_memory_utilization(options_.gpu_memory_utilization);
    a->set_block_size(options_.block_size);
    a->set_max_num_batched_tokens(options_.max_num_batched_tokens);
    a->set_max_num_seqs(options_.max_num_seqs);
    a->set_wait_for_nccl_ids(relay);
    a->set_make_nccl_ids(relay && r == 0);
    a->set_comm_timeout_seconds(options_.comm_timeout_seconds);
    a->set_deterministic(options_.deterministic);
    a->set_all_reduce(options_.all_reduce);
    a->set_kv_cache_dtype(options_.kv_cache_dtype);
    if (!Send(r, msg)) Fail(r, "could not send its assignment");
  }
  TP_LOG(INFO) << "assignments sent: tp=" << plan_.tp << " pp=" << plan_.pp << " layers "
               << plan_.DeviceMapString() << "; waiting for the workers to load";
  monitor_ = std::thread([this] { Monitor(); });
  lock.lock();
  if (!cv_.wait_for(lock, load_timeout,
                    [&] { return all(&Slot::kv_reported) || !failure_.ok() || shutdown_; })) {
    return absl::DeadlineExceededError(
        absl::StrCat("the workers did not load the model within ", load_timeout.count(), " s"));
  }
  if (!failure_.ok()) return failure_;
  if (shutdown_) return absl::CancelledError("shut down while loading");
  num_blocks_ = slots_[0]->kv.num_blocks();
  for (int r = 0; r < n; ++r) {
    const worker::KvReport& kv = slots_[r]->kv;
    if (kv.block_size() != options_.block_size) {
      return absl::InternalError(absl::StrCat("worker rank ", r, " reports KV blocks of ",
                                              kv.block_size(), " tokens, expected ",
                                              options_.block_size));
    }
    num_blocks_ = std::min(num_blocks_, kv.num_blocks());
    if (kv.kv_cache_dtype() != slots_[0]->kv.kv_cache_dtype()) {
      return absl::InternalError(absl::StrCat("worker rank ", r, " stores its KV cache in ",
                                              kv.kv_cache_dtype(), ", rank 0 in ",
                                              slots_[0]->kv.kv_cache_dtype()));
    }
    TP_LOG(INFO) << "worker rank " << r << ": " << kv.num_blocks() << " KV blocks ("
                 << kv.kv_cache_dtype() << "), " << kv.weight_bytes() / (1 << 20)
                 << " MiB of weights, loaded in " << kv.load_seconds() << " s";
  }
  if (num_blocks_ <= 0) return absl::ResourceExhaustedError("a worker has no KV cache blocks");
  // A worker's report sizes the block manager: an absurd count is refused, not allocated.
  constexpr int kMaxBlocks = 1 << 26;
  if (num_blocks_ > kMaxBlocks) {
    return absl::InternalError(
        absl::StrCat("the workers report ", num_blocks_, " KV blocks (at most ", kMaxBlocks, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateStepResult(const worker::StepResult& result, int sampled, int with_logprobs,
                                int64_t vocab_size) {
  if (result.token_ids_size() != sampled) {
    return absl::InternalError(absl::StrCat("step ", result.step_id(), ": ",
                                            result.token_ids_size(), " token ids for ", sampled,
                                            " sampled sequences"));
  }
  auto check = [&](int32_t id) {
    return id >= 0 && id < vocab_size ? absl::OkStatus()
                                      : absl::InternalError(absl::StrCat(
                                            "step ", result.step_id(), ": token id ", id,
                                            " is outside the vocabulary [0, ", vocab_size, ")"));
  };
  for (int32_t id : result.token_ids()) TP_RETURN_IF_ERROR(check(id));
  if (result.logprobs_size() != with_logprobs) {
    return absl::InternalError(absl::StrCat("step ", result.step_id(), ": ", result.logprobs_size(),
                                            " logprobs entries for ", with_logprobs,
                                            " sequences that asked"));
  }
  for (const worker::SampledLogprobs& lp : result.logprobs()) {
    if (lp.top_size() > kMaxLogprobs) {
      return absl::InternalError(absl::StrCat("step ", result.step_id(), ": ", lp.top_size(),
                                              " logprob alternatives (at most ", kMaxLogprobs,
                                              ")"));
    }
    for (const worker::TokenLogprob& t : lp.top()) TP_RETURN_IF_ERROR(check(t.token_id()));
  }
  return absl::OkStatus();
}

absl::StatusOr<worker::StepResult> WorkerGroup::Execute(const worker::StepPlan& plan) {
  TP_RETURN_IF_ERROR(Submit(plan));
  return Collect(plan.step_id());
}

int WorkerGroup::max_in_flight() const {
  // Pipeline stages work on different steps at once: stage s runs step n while stage s + 1
  // runs step n - 1. The workers take plans in order from their streams.
  return std::max(1, plan_.pp);
}

absl::Status WorkerGroup::Submit(const worker::StepPlan& plan) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) return failure_;
    if (shutdown_) return absl::UnavailableError("the worker group is shut down");
  }
  {
    int sampled = 0, with_logprobs = 0;
    for (const worker::SeqStep& s : plan.seqs()) {
      sampled += s.sample();
      with_logprobs += s.sample() && s.sampling().has_logprobs();
    }
    std::lock_guard<std::mutex> lock(mu_);
    expected_[plan.step_id()] = {sampled, with_logprobs};
  }
  std::unique_ptr<worker::CoordinatorMessage> msg;
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    if (!send_free_.empty()) {
      msg = std::move(send_free_.back());
      send_free_.pop_back();
    }
  }
  if (msg == nullptr) msg = std::make_unique<worker::CoordinatorMessage>();
  msg->mutable_step()->CopyFrom(plan);  // into a used message: no allocation
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    send_queue_.push_back(std::move(msg));
  }
  send_cv_.notify_one();
  // A failed write fails the group (Fail): Collect returns that failure.
  return absl::OkStatus();
}

absl::StatusOr<worker::StepResult> WorkerGroup::Collect(uint64_t id) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, options_.step_timeout,
                    [&] { return results_.count(id) > 0 || !failure_.ok() || shutdown_; })) {
    lock.unlock();
    Fail(sampler_rank_,
         absl::StrCat("no result for step ", id, " within ", options_.step_timeout.count(), " s"));
    lock.lock();
  }
  if (!failure_.ok()) return failure_;
  if (shutdown_) return absl::UnavailableError("the worker group is shut down");
  worker::StepResult result = std::move(results_[id]);
  results_.erase(id);
  last_forward_seconds_ = forward_seconds_[id];
  forward_seconds_.erase(id);
  return result;
}

void WorkerGroup::Monitor() {
  Clock::time_point last_beat = Clock::now();
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return shutdown_; })) return;
      if (!failure_.ok()) return;
    }
    const Clock::time_point now = Clock::now();
    int silent = -1;
    double silent_s = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int r = 0; r < options_.world_size; ++r) {
        const double s = std::chrono::duration<double>(now - slots_[r]->last_seen).count();
        if (slots_[r]->registered && now - slots_[r]->last_seen > options_.heartbeat_timeout) {
          silent = r;
          silent_s = s;
          break;
        }
      }
    }
    if (silent >= 0) {
      Fail(silent, absl::StrCat("no heartbeat for ", static_cast<int>(silent_s * 10) / 10.0, " s"));
      return;
    }
    if (now - last_beat >= options_.heartbeat_interval) {
      last_beat = now;
      worker::CoordinatorMessage beat;
      beat.mutable_heartbeat()->set_unix_micros(
          std::chrono::duration_cast<std::chrono::microseconds>(
              std::chrono::system_clock::now().time_since_epoch())
              .count());
      for (int r = 0; r < options_.world_size; ++r) Send(r, beat);
    }
  }
}

void WorkerGroup::Shutdown(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) return;
    shutdown_ = true;
  }
  cv_.notify_all();
  worker::CoordinatorMessage msg;
  msg.mutable_shutdown()->set_reason(reason);
  for (int r = 0; r < options_.world_size; ++r) Send(r, msg);
  // The workers close their streams when they get the message; cancel the ones that do not.
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(3), [&] { return active_streams_ == 0; });
  }
  for (auto& s : slots_) {
    std::lock_guard<std::mutex> lock(s->write_mu);
    if (s->context != nullptr) s->context->TryCancel();
  }
}

}  // namespace tpserve
