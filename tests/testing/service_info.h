// GetModelInfo for the service tests, and a wait for a server to become idle.
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "tpserve/v1/inference.grpc.pb.h"

namespace tpserve::service_test {

// The server's ModelInfo (an empty one, with a test failure, when the call fails).
inline tpserve::v1::ModelInfo Info(tpserve::v1::Inference::Stub& stub, int deadline_s = 10) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_s));
  tpserve::v1::ModelInfo info;
  const grpc::Status s = stub.GetModelInfo(&ctx, tpserve::v1::GetModelInfoRequest(), &info);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return info;
}

// Waits up to `seconds` until every KV block is free (cached prefix blocks count as free) and
// nothing runs or waits. A request's last response can reach the client before its blocks are
// released: with plans sent one step ahead the sequence is still in the step in flight.
inline bool WaitIdle(tpserve::v1::Inference::Stub& stub, double seconds) {
  const auto end = std::chrono::steady_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (std::chrono::steady_clock::now() < end) {
    const tpserve::v1::ModelInfo info = Info(stub);
    if (info.kv().free_blocks() == info.kv().total_blocks() && info.kv().running_sequences() == 0 &&
        info.kv().waiting_requests() == 0) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

}  // namespace tpserve::service_test
