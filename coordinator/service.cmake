# The coordinator service (included from coordinator/CMakeLists.txt): tpserve_coordinator (API
# layer: gRPC and the OpenAI-compatible HTTP front end with /metrics; scheduler, KV block
# manager, worker group, server) and the tpserve-coordinator binary.
# No CUDA, no worker/kernels: the planner, the tokenizer, the protos, common (and MPI for MPMD
# launches, through tpserve_bootstrap).
add_library(tpserve_coordinator STATIC
  ${CMAKE_CURRENT_LIST_DIR}/block_manager.cc
  ${CMAKE_CURRENT_LIST_DIR}/scheduler.cc
  ${CMAKE_CURRENT_LIST_DIR}/delivery.cc
  ${CMAKE_CURRENT_LIST_DIR}/worker_group.cc
  ${CMAKE_CURRENT_LIST_DIR}/inference_service.cc
  ${CMAKE_CURRENT_LIST_DIR}/intake_pool.cc
  ${CMAKE_CURRENT_LIST_DIR}/parse_error_interceptor.cc
  ${CMAKE_CURRENT_LIST_DIR}/api_keys.cc
  ${CMAKE_CURRENT_LIST_DIR}/metrics.cc
  ${CMAKE_CURRENT_LIST_DIR}/serving_metrics.cc
  ${CMAKE_CURRENT_LIST_DIR}/http/openai_api.cc
  ${CMAKE_CURRENT_LIST_DIR}/http/http_server.cc
  ${CMAKE_CURRENT_LIST_DIR}/server.cc
  ${CMAKE_CURRENT_LIST_DIR}/coordinator_flags.cc
)
target_link_libraries(tpserve_coordinator
  PUBLIC tpserve_proto tpserve_block_tables tpserve_planner tpserve_tokenizer tpserve_chat_template tpserve_common
         gRPC::grpc++ absl::status absl::statusor
         nlohmann_json::nlohmann_json absl::synchronization
  PRIVATE tpserve_grpc_reflection absl::strings absl::str_format absl::time Threads::Threads
          PkgConfig::HTTPLIB)

add_executable(tpserve-coordinator ${CMAKE_CURRENT_LIST_DIR}/coordinator_main.cc)
target_link_libraries(tpserve-coordinator PRIVATE tpserve_coordinator tpserve_bootstrap)
