# tpserve_add_test(NAME LABEL <unit|multiprocess|gpu|bench> SOURCES ... [LIBS ...] [TIMEOUT s])
# Each test binary is a GoogleTest executable labelled by tier so that `ctest -L unit` runs one tier.
find_package(GTest REQUIRED)
function(tpserve_add_test name)
  cmake_parse_arguments(T "" "LABEL;TIMEOUT" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main GTest::gmock)
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  add_test(NAME ${name} COMMAND ${name} WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(${name} PROPERTIES LABELS ${T_LABEL} TIMEOUT ${T_TIMEOUT}
                       SKIP_REGULAR_EXPRESSION "no CUDA device, test skipped"
                       ENVIRONMENT "TPSERVE_SOURCE_DIR=${CMAKE_SOURCE_DIR};TPSERVE_BINARY_DIR=${CMAKE_BINARY_DIR}")
endfunction()
