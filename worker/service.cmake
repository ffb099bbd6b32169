# The tpserve-worker executable and its libraries (included from worker/CMakeLists.txt):
# tpserve_worker_client: the control-plane client of a worker process.
add_library(tpserve_worker_client STATIC
  ${CMAKE_CURRENT_LIST_DIR}/control_client.cc
)
target_link_libraries(tpserve_worker_client PUBLIC tpserve_worker tpserve_proto
                                                   tpserve_block_tables gRPC::grpc++)

add_executable(tpserve-worker ${CMAKE_CURRENT_LIST_DIR}/worker_main.cc)
target_link_libraries(tpserve-worker PRIVATE tpserve_worker_client MPI::MPI_CXX)
if(TARGET tpserve_kernels_cuda)
  target_link_libraries(tpserve-worker PRIVATE tpserve_kernels_cuda)
  target_compile_definitions(tpserve-worker PRIVATE TPSERVE_HAVE_CUDA=1)
endif()
