# shardserve_cc_library / shardserve_cc_binary / shardserve_cc_test: one small target per folder with
# explicit, PRIVATE-by-default dependencies (after absl_cc_library). Our warning flags and sanitizers
# apply to these targets only, never to generated code or third-party headers.

set(SHARDSERVE_WARNINGS -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wcast-align
    -Wunused -Woverloaded-virtual -Wnull-dereference -Wformat=2 -Wimplicit-fallthrough
    # Designated initializers rely on default member initializers; GCC 12 warns on them anyway.
    -Wno-missing-field-initializers)
if(SHARDSERVE_WERROR)
  list(APPEND SHARDSERVE_WARNINGS -Werror)
endif()
if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  list(APPEND SHARDSERVE_WARNINGS -Wthread-safety)
endif()

set(SHARDSERVE_SANITIZER_FLAGS "")
if(SHARDSERVE_SANITIZE STREQUAL "address")
  set(SHARDSERVE_SANITIZER_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
elseif(SHARDSERVE_SANITIZE STREQUAL "thread")
  set(SHARDSERVE_SANITIZER_FLAGS -fsanitize=thread -fno-omit-frame-pointer)
elseif(SHARDSERVE_SANITIZE STREQUAL "fuzzer")
  # Coverage instrumentation for libFuzzer targets (clang), with ASan+UBSan.
  set(SHARDSERVE_SANITIZER_FLAGS -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all
      -fno-omit-frame-pointer)
elseif(NOT SHARDSERVE_SANITIZE STREQUAL "")
  message(FATAL_ERROR "SHARDSERVE_SANITIZE must be '', 'address', 'thread' or 'fuzzer', not '${SHARDSERVE_SANITIZE}'")
endif()

function(_shardserve_common_flags target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${SHARDSERVE_WARNINGS}>)
  if(SHARDSERVE_SANITIZER_FLAGS)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${SHARDSERVE_SANITIZER_FLAGS}>)
    target_link_options(${target} PRIVATE ${SHARDSERVE_SANITIZER_FLAGS})
  endif()
endfunction()

# shardserve_cc_library(NAME n SRCS ... DEPS ... PUBLIC_DEPS ... [HEADER_ONLY])
function(shardserve_cc_library)
  cmake_parse_arguments(A "HEADER_ONLY" "NAME" "SRCS;DEPS;PUBLIC_DEPS" ${ARGN})
  if(A_HEADER_ONLY)
    add_library(${A_NAME} INTERFACE)
    target_include_directories(${A_NAME} INTERFACE ${PROJECT_SOURCE_DIR})
    target_link_libraries(${A_NAME} INTERFACE ${A_PUBLIC_DEPS} ${A_DEPS})
    return()
  endif()
  add_library(${A_NAME} STATIC ${A_SRCS})
  target_include_directories(${A_NAME} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${A_NAME} PUBLIC ${A_PUBLIC_DEPS} PRIVATE ${A_DEPS})
  set_target_properties(${A_NAME} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  _shardserve_common_flags(${A_NAME})
endfunction()

# shardserve_cc_binary(NAME n OUTPUT_NAME o SRCS ... DEPS ...)
function(shardserve_cc_binary)
  cmake_parse_arguments(A "" "NAME;OUTPUT_NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS})
  if(A_OUTPUT_NAME)
    set_target_properties(${A_NAME} PROPERTIES OUTPUT_NAME ${A_OUTPUT_NAME})
  endif()
  set_target_properties(${A_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
  _shardserve_common_flags(${A_NAME})
endfunction()

# shardserve_cc_test(NAME n SRCS ... DEPS ... [LABELS ...]) — a GoogleTest binary registered with ctest.
# Tests run from the source tree so they can read tests/golden/... and ../shared/models/....
function(shardserve_cc_test)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gmock GTest::gtest_main)
  _shardserve_common_flags(${A_NAME})
  # An empty LABELS value would swallow the next key of PROPERTIES: list it only when given.
  set(_props TIMEOUT 600)
  if(A_LABELS)
    list(APPEND _props LABELS "${A_LABELS}")
  endif()
  gtest_discover_tests(${A_NAME} WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
                       PROPERTIES ${_props} DISCOVERY_TIMEOUT 60)
  # Tests labelled gpu are collected so that one target (gpu_tests, tests/CMakeLists.txt) builds
  # them all for the GPU bundle (tests/gpu/bundle.sh).
  if("gpu" IN_LIST A_LABELS)
    set_property(GLOBAL APPEND PROPERTY SHARDSERVE_GPU_TESTS ${A_NAME})
  endif()
endfunction()
