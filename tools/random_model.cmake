# tpserve_random_model: the `tpserve random-model` subcommand (included from tools/CMakeLists.txt).
add_library(tpserve_random_model STATIC ${CMAKE_CURRENT_LIST_DIR}/random_model.cc)
target_link_libraries(tpserve_random_model PUBLIC tpserve_common Threads::Threads)
