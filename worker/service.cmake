# The tpserve-worker executable and its libraries (included from worker/CMakeLists.txt):
# tpserve_step_runner (a shard driven by StepPlans) and the control-plane client.
add_library(tpserve_step_runner STATIC
  ${CMAKE_CURRENT_LIST_DIR}/step_runner.cc
  ${CMAKE_CURRENT_LIST_DIR}/control_client.cc
)
target_link_libraries(tpserve_step_runner PUBLIC tpserve_worker tpserve_proto gRPC::grpc++)

add_executable(tpserve-worker ${CMAKE_CURRENT_LIST_DIR}/worker_main.cc)
target_link_libraries(tpserve-worker PRIVATE tpserve_step_runner MPI::MPI_CXX)
if(TARGET tpserve_kernels_cuda)
  target_link_libraries(tpserve-worker PRIVATE tpserve_kernels_cuda)
  target_compile_definitions(tpserve-worker PRIVATE TPSERVE_HAVE_CUDA=1)
endif()
