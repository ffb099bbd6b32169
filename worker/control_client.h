// The worker's side of the control plane (worker.proto): one bidirectional stream to the
// coordinator; writes are serialized, a background thread sends heartbeats, and a worker whose
// stream breaks while it is stuck (e.g. in a collective whose peer died) exits on its own.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker.grpc.pb.h"

namespace tpserve {

class ControlClient {
 public:
  // Connects (retrying until `connect_timeout`) and opens the control stream, sending the
  // cluster secret as metadata.
  static absl::StatusOr<std::unique_ptr<ControlClient>> Connect(
      const std::string& address, std::chrono::seconds connect_timeout,
      const std::string& cluster_secret);
  ~ControlClient();

  bool Send(const worker::WorkerMessage& msg);
  // Blocks for the next coordinator message other than a heartbeat; false when the stream ended.
  bool Read(worker::CoordinatorMessage* msg);
  // From now on a thread of its own reads the stream into a queue (Read takes from it), so that
  // a worker can wait for the next message with a deadline (ReadFor) while a step runs.
  void StartReader();
  enum class ReadResult { kMessage, kTimeout, kEnded };
  // Read waiting at most `timeout` (after StartReader).
  ReadResult ReadFor(worker::CoordinatorMessage* msg, std::chrono::microseconds timeout);
  // After Read returned false: why the coordinator ended the stream (e.g. a refused register:
  // wrong secret, rank taken), as a status; OK when it ended it normally.
  absl::Status EndStatus();
  // Starts heartbeats every `interval`. If sending fails (the coordinator is gone) and the worker
  // has not finished on its own `grace` later, the process exits with status 3.
  void StartHeartbeats(std::chrono::milliseconds interval, std::chrono::milliseconds grace);
  // The worker is exiting normally: stop heartbeats, close the stream.
  void Close();

 private:
  ControlClient() = default;

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<worker::WorkerControl::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<worker::WorkerMessage, worker::CoordinatorMessage>>
      stream_;
  std::mutex write_mu_;
  bool writes_done_ = false;
  bool ended_ = false;  // Finish was called (EndStatus)
  absl::Status end_status_;
  std::atomic<bool> closing_{false};
  std::thread heartbeat_;
  // StartReader's thread and its queue.
  std::thread reader_;
  std::mutex read_mu_;
  std::condition_variable read_cv_;
  std::deque<worker::CoordinatorMessage> inbox_;
  bool read_ended_ = false;
};

}  // namespace tpserve
