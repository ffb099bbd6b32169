# `tpserve generate | info | health | serve` (included from tools/CMakeLists.txt; link
# tpserve_client_cmd into the tpserve executable).
add_library(tpserve_client_cmd STATIC ${CMAKE_CURRENT_LIST_DIR}/client_cmd.cc)
target_link_libraries(tpserve_client_cmd PUBLIC tpserve_coordinator tpserve_proto
                      absl::status PRIVATE absl::strings)
