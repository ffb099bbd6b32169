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

# tpserve_add_python_test(NAME SCRIPT script.py LABEL <tier> [TIMEOUT s] [ARGS ...] [ENV ...]
#                         [SKIP_RETURN_CODE n]): a Python test script run by python3 from the
# source root (TPSERVE_SOURCE_DIR set, plus ENV); nothing is added where python3 is missing.
find_program(TPSERVE_PYTHON3 python3)
function(tpserve_add_python_test name)
  cmake_parse_arguments(T "" "SCRIPT;LABEL;TIMEOUT;SKIP_RETURN_CODE" "ARGS;ENV" ${ARGN})
  if(NOT TPSERVE_PYTHON3)
    return()
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 60)
  endif()
  add_test(NAME ${name} COMMAND ${TPSERVE_PYTHON3} ${T_SCRIPT} ${T_ARGS}
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set(env "TPSERVE_SOURCE_DIR=${CMAKE_SOURCE_DIR}" ${T_ENV})
  set_tests_properties(${name} PROPERTIES LABELS ${T_LABEL} TIMEOUT ${T_TIMEOUT}
                       ENVIRONMENT "${env}")
  if(T_SKIP_RETURN_CODE)
    set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE ${T_SKIP_RETURN_CODE})
  endif()
endfunction()
