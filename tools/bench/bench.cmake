# `tpserve bench` (included from tools/CMakeLists.txt; link tpserve_bench_cmd into the tpserve
# executable): tpserve_bench_core (statistics, workloads, presets, the load generator, the
# determinism check) and the command.
add_library(tpserve_bench_core STATIC
  ${CMAKE_CURRENT_LIST_DIR}/stats.cc
  ${CMAKE_CURRENT_LIST_DIR}/workload.cc
  ${CMAKE_CURRENT_LIST_DIR}/load_gen.cc
  ${CMAKE_CURRENT_LIST_DIR}/determinism.cc)
target_link_libraries(tpserve_bench_core PUBLIC tpserve_proto tpserve_common
                      tpserve_server_endpoint absl::status absl::statusor PRIVATE absl::strings
                      gRPC::grpc++ Threads::Threads)

add_library(tpserve_bench_cmd STATIC ${CMAKE_CURRENT_LIST_DIR}/bench_cmd.cc)
target_link_libraries(tpserve_bench_cmd PUBLIC tpserve_bench_core absl::status
                      PRIVATE tpserve_worker nlohmann_json::nlohmann_json absl::strings)
