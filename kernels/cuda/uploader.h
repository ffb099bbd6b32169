// The CUDA weight uploader: host bytes (typically a memory-mapped checkpoint in the page cache)
// are copied by a team of host threads into a ring of pinned staging buffers, each sent to the
// device with cudaMemcpyAsync on its own copy stream, so that filling the next buffer overlaps
// the DMA of the previous ones.
#pragma once

#include <cstddef>
#include <memory>

#include "kernels/ops.h"

namespace tpserve::cuda {

struct UploaderOptions {
  size_t buffer_bytes = size_t{64} << 20;  // each pinned staging buffer
  int num_buffers = 4;
  int threads = 0;  // host copy threads; 0: TPSERVE_LOAD_THREADS, else min(8, hardware threads)
};

std::unique_ptr<DeviceUploader> MakePinnedUploader(int device, const UploaderOptions& options = {});

}  // namespace tpserve::cuda
