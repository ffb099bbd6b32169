// Fatal check macros for device and communication libraries: CUDA, cuBLAS, NCCL, MPI.
// A failed call inside device code is a bug or a dead device: abort with file:line and the
// library's own error string. (At API boundaries, return absl::Status instead.)
#pragma once

#include "common/logging.h"

#define TP_CUDA_CHECK(expr)                                               \
  do {                                                                    \
    cudaError_t _tp_err = (expr);                                         \
    if (_tp_err != cudaSuccess) {                                         \
      TP_LOG(FATAL) << "CUDA error " << cudaGetErrorName(_tp_err) << " (" \
                    << cudaGetErrorString(_tp_err) << ") in " #expr;      \
    }                                                                     \
  } while (0)

// Checks the last launch error (after <<<...>>>).
#define TP_CUDA_CHECK_LAUNCH() TP_CUDA_CHECK(cudaGetLastError())

#define TP_CUBLAS_CHECK(expr)                                                            \
  do {                                                                                   \
    cublasStatus_t _tp_st = (expr);                                                      \
    if (_tp_st != CUBLAS_STATUS_SUCCESS) {                                               \
      TP_LOG(FATAL) << "cuBLAS error " << cublasGetStatusString(_tp_st) << " in " #expr; \
    }                                                                                    \
  } while (0)

#define TP_NCCL_CHECK(expr)                                                          \
  do {                                                                               \
    ncclResult_t _tp_res = (expr);                                                   \
    if (_tp_res != ncclSuccess && _tp_res != ncclInProgress) {                       \
      TP_LOG(FATAL) << "NCCL error " << ncclGetErrorString(_tp_res) << " in " #expr; \
    }                                                                                \
  } while (0)

#define TP_MPI_CHECK(expr)                                      \
  do {                                                          \
    int _tp_rc = (expr);                                        \
    if (_tp_rc != MPI_SUCCESS) {                                \
      char _tp_msg[MPI_MAX_ERROR_STRING];                       \
      int _tp_len = 0;                                          \
      MPI_Error_string(_tp_rc, _tp_msg, &_tp_len);              \
      TP_LOG(FATAL) << "MPI error " << _tp_msg << " in " #expr; \
    }                                                           \
  } while (0)
