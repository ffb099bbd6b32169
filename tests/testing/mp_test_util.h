// Helpers of the multiprocess model tests (run under mpirun): the world communicator, a main
// that prints progress on rank 0 and failures on every rank, error measures of logits rows and
// the broadcast of a reference computed on one rank.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status.h"
#include "parallel/mpi_communicator.h"
#include "parallel/process_groups.h"

namespace tpserve::mp_test {

inline int WorldRank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int WorldSize() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// A host-memory communicator over MPI_COMM_WORLD for the tests' own traffic (references,
// barriers); every wait has `timeout` as deadline.
inline std::unique_ptr<Communicator> MakeWorld(absl::Duration timeout) {
  absl::StatusOr<std::unique_ptr<Communicator>> c =
      MakeMpiCommunicator(MPI_COMM_WORLD, nullptr, timeout, "test world");
  TP_CHECK(c.ok()) << c.status();
  return std::move(c).value();
}

// Relative L2 error of a row: |got - want|_2 / |want|_2.
inline double RelL2(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    num += double(got[i] - want[i]) * (got[i] - want[i]);
    den += double(want[i]) * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Largest element error relative to the row's largest magnitude: max|got - want| / max|want|.
inline double RelMax(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    num = std::max(num, std::fabs(double(got[i]) - want[i]));
    den = std::max(den, std::fabs(double(want[i])));
  }
  return den > 0 ? num / den : num;
}

// Broadcasts `floats` and `ints` from `root` (sizes first; the other ranks' vectors are
// resized). A root that could not compute its data passes ok = false; then every rank returns
// an error instead of waiting for data that never comes.
inline absl::Status BroadcastBlob(Communicator& world, int root, bool ok,
                                  std::vector<float>& floats, std::vector<int32_t>& ints) {
  int32_t sizes[3] = {ok ? 1 : 0, static_cast<int32_t>(floats.size()),
                      static_cast<int32_t>(ints.size())};
  TP_RETURN_IF_ERROR(world.Broadcast(Tensor(sizes, {3}, DType::kI32), root));
  if (sizes[0] == 0) {
    return absl::InternalError(absl::StrCat("rank ", root, " could not compute the reference"));
  }
  floats.resize(sizes[1]);
  ints.resize(sizes[2]);
  if (sizes[1] > 0) {
    TP_RETURN_IF_ERROR(world.Broadcast(Tensor(floats.data(), {sizes[1]}, DType::kF32), root));
  }
  if (sizes[2] > 0) {
    TP_RETURN_IF_ERROR(world.Broadcast(Tensor(ints.data(), {sizes[2]}, DType::kI32), root));
  }
  return absl::OkStatus();
}

// Only rank 0 prints the usual progress; other ranks print their failures, prefixed.
class FailuresOnly : public ::testing::EmptyTestEventListener {
 public:
  explicit FailuresOnly(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed()) {
      fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, result.file_name(), result.line_number(),
              result.summary());
    }
  }

 private:
  int rank_;
};

// The main of a GoogleTest binary run under mpirun.
inline int RunMpiTests(int* argc, char** argv) {
  ::testing::InitGoogleTest(argc, argv);
  absl::Status s = InitMpi(argc, &argv);
  if (!s.ok()) {
    fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 1;
  }
  const int rank = WorldRank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailuresOnly(rank));
  }
  const int rc = RUN_ALL_TESTS();
  MPI_Finalize();
  return rc;
}

}  // namespace tpserve::mp_test
