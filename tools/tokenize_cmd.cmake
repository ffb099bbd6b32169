# `tpserve tokenize` / `tpserve detokenize` subcommands (included from tools/CMakeLists.txt).
add_library(tpserve_tokenize_cmd STATIC ${CMAKE_CURRENT_LIST_DIR}/tokenize_cmd.cc)
target_link_libraries(tpserve_tokenize_cmd
  PUBLIC tpserve_tokenizer absl::status
  PRIVATE nlohmann_json::nlohmann_json absl::strings)
