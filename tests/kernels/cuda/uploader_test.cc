// The pinned uploader (kernels/cuda/uploader.h) with 1 MiB staging buffers, so that copies
// span buffers, wait for them to come back around, and pack strided rows: the device receives
// exactly the bytes, for whole ranges, column slices and many small pieces between flushes.
// Without a CUDA device the test prints "no CUDA device, test skipped" and is skipped.
#include "kernels/cuda/uploader.h"

#include <cuda_runtime.h>

#include <cstring>
#include <iostream>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cuda/cuda_ops.h"

namespace tpserve {
namespace {

TEST(PinnedUploaderTest, DeviceGetsExactlyTheBytes) {
  if (CudaDeviceCount() == 0) {
    std::cout << "no CUDA device, test skipped" << std::endl;
    GTEST_SKIP() << "no CUDA device";
  }
  CudaOps ops(0);
  std::mt19937 rng(3);
  const size_t n = (size_t{5} << 20) + 12345;  // 5+ staging buffers
  std::vector<char> src(n);
  for (char& c : src) c = static_cast<char>(rng());
  cuda::UploaderOptions options;
  options.buffer_bytes = size_t{1} << 20;
  options.num_buffers = 3;
  options.threads = 4;
  auto up = cuda::MakePinnedUploader(0, options);
  char* dev = static_cast<char*>(ops.Alloc(3 * n));

  // Whole range, then a column slice [rows, 1000 of 3000 bytes from column 700], then many small
  // pieces in reverse order, all before one Flush.
  up->Upload(dev, src.data(), n);
  const size_t rows = 1500, pitch = 3000, width = 1000, col = 700;
  up->UploadRows(dev + n, src.data() + col, rows, width, pitch);
  const size_t piece = 777;
  for (size_t off = (n / piece - 1) * piece;; off -= piece) {
    up->Upload(dev + 2 * n + off, src.data() + off, piece);
    if (off == 0) break;
  }
  up->Flush();
  EXPECT_EQ(up->stats().bytes, static_cast<int64_t>(n + rows * width + n / piece * piece));

  std::vector<char> back(3 * n);
  ops.CopyToHost(back.data(), dev, back.size());
  EXPECT_EQ(std::memcmp(back.data(), src.data(), n), 0);
  for (size_t r = 0; r < rows; ++r) {
    ASSERT_EQ(std::memcmp(back.data() + n + r * width, src.data() + col + r * pitch, width), 0)
        << "row " << r;
  }
  EXPECT_EQ(std::memcmp(back.data() + 2 * n, src.data(), n / piece * piece), 0);
  ops.Free(dev);
}

}  // namespace
}  // namespace tpserve
