# `tpserve generate | info | health | serve` (included from tools/CMakeLists.txt; link
# tpserve_client_cmd into the tpserve executable), and how every client command (these and
# `tpserve bench`) reaches a server: tpserve_server_endpoint.
add_library(tpserve_server_endpoint STATIC ${CMAKE_CURRENT_LIST_DIR}/server_endpoint.cc)
target_link_libraries(tpserve_server_endpoint PUBLIC tpserve_common gRPC::grpc++ absl::statusor
                      PRIVATE absl::strings)
add_library(tpserve_client_cmd STATIC ${CMAKE_CURRENT_LIST_DIR}/client_cmd.cc)
target_link_libraries(tpserve_client_cmd PUBLIC tpserve_coordinator tpserve_proto
                      absl::status PRIVATE tpserve_server_endpoint absl::strings)
