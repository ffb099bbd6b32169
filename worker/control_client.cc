// The worker's control-plane client (see control_client.h).
#include "worker/control_client.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/cluster_secret.h"
#include "common/logging.h"

namespace tpserve {

absl::StatusOr<std::unique_ptr<ControlClient>> ControlClient::Connect(
    const std::string& address, std::chrono::seconds connect_timeout,
    const std::string& cluster_secret) {
  std::unique_ptr<ControlClient> c(new ControlClient());
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  c->channel_ = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  const auto deadline = std::chrono::system_clock::now() + connect_timeout;
  if (!c->channel_->WaitForConnected(deadline)) {
    return absl::UnavailableError(absl::StrCat("could not reach the coordinator at ", address,
                                               " within ", connect_timeout.count(), " s"));
  }
  c->stub_ = worker::WorkerControl::NewStub(c->channel_);
  c->context_.AddMetadata(kClusterSecretMetadata, cluster_secret);
  c->stream_ = c->stub_->Control(&c->context_);
  if (c->stream_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("could not open the control stream to ", address));
  }
  return c;
}

ControlClient::~ControlClient() {
  Close();
  if (heartbeat_.joinable()) heartbeat_.join();
  if (reader_.joinable()) reader_.join();
}

bool ControlClient::Send(const worker::WorkerMessage& msg) {
  std::lock_guard<std::mutex> lock(write_mu_);
  if (writes_done_) return false;
  return stream_->Write(msg);
}

bool ControlClient::Read(worker::CoordinatorMessage* msg) {
  if (reader_.joinable()) {
    std::unique_lock<std::mutex> lock(read_mu_);
    read_cv_.wait(lock, [&] { return !inbox_.empty() || read_ended_; });
    if (inbox_.empty()) return false;
    *msg = std::move(inbox_.front());
    inbox_.pop_front();
    return true;
  }
  while (stream_->Read(msg)) {
    if (!msg->has_heartbeat()) return true;
  }
  return false;
}

void ControlClient::StartReader() {
  if (reader_.joinable()) return;
  reader_ = std::thread([this] {
    worker::CoordinatorMessage msg;
    while (stream_->Read(&msg)) {
      if (msg.has_heartbeat()) continue;
      std::lock_guard<std::mutex> lock(read_mu_);
      inbox_.push_back(std::move(msg));
      read_cv_.notify_all();
    }
    std::lock_guard<std::mutex> lock(read_mu_);
    read_ended_ = true;
    read_cv_.notify_all();
  });
}

ControlClient::ReadResult ControlClient::ReadFor(worker::CoordinatorMessage* msg,
                                                 std::chrono::microseconds timeout) {
  std::unique_lock<std::mutex> lock(read_mu_);
  read_cv_.wait_for(lock, timeout, [&] { return !inbox_.empty() || read_ended_; });
  if (inbox_.empty()) return read_ended_ ? ReadResult::kEnded : ReadResult::kTimeout;
  *msg = std::move(inbox_.front());
  inbox_.pop_front();
  return ReadResult::kMessage;
}

absl::Status ControlClient::EndStatus() {
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (ended_) return end_status_;
    ended_ = true;
    writes_done_ = true;  // no write may race with Finish
  }
  const grpc::Status st = stream_->Finish();
  end_status_ = absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
  return end_status_;
}

void ControlClient::StartHeartbeats(std::chrono::milliseconds interval,
                                    std::chrono::milliseconds grace) {
  heartbeat_ = std::thread([this, interval, grace] {
    while (!closing_.load()) {
      worker::WorkerMessage beat;
      beat.mutable_heartbeat()->set_unix_micros(
          std::chrono::duration_cast<std::chrono::microseconds>(
              std::chrono::system_clock::now().time_since_epoch())
              .count());
      if (!Send(beat)) {
        const auto end = std::chrono::steady_clock::now() + grace;
        while (!closing_.load() && std::chrono::steady_clock::now() < end) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        if (!closing_.load()) {
          TP_LOG(ERROR) << "the control stream to the coordinator broke and this worker is "
                           "stuck; exiting";
          _exit(3);
        }
        return;
      }
      const auto end = std::chrono::steady_clock::now() + interval;
      while (!closing_.load() && std::chrono::steady_clock::now() < end) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  });
}

void ControlClient::Close() {
  if (closing_.exchange(true)) return;
  if (heartbeat_.joinable()) heartbeat_.join();
  std::lock_guard<std::mutex> lock(write_mu_);
  // A client whose Connect failed (no coordinator within the connect timeout) has no stream:
  // its destructor closes it too, and once segfaulted here.
  if (!writes_done_ && stream_ != nullptr) {
    writes_done_ = true;
    stream_->WritesDone();
  }
  context_.TryCancel();
  // The cancelled stream ends the reader's Read.
  if (reader_.joinable()) reader_.join();
}

}  // namespace tpserve
