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
set(SHARDSERVE_SANITIZER_COMPILE_ONLY "")
if(SHARDSERVE_SANITIZE STREQUAL "address")
  set(SHARDSERVE_SANITIZER_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
elseif(SHARDSERVE_SANITIZE STREQUAL "thread")
  # -U__SANITIZE_THREAD__: Debian's libprotobuf is built without TSan, and protobuf's map_field.h
  # gives MapFieldBase two more members when __SANITIZE_THREAD__ is defined (72 -> 80 bytes). Our
  # instrumented code would then lay out every message with a map field (SamplingParams.logit_bias)
  # otherwise than the uninstrumented generated code and library that serialize it: the fields after
  # the map were read as garbage (stage 1 refused "repetition_penalty must be in (0, 2], got
  # -0.363307" in about one run of direct_answer_test in three). No other header of our
  # dependencies changes a layout on it; the instrumentation itself comes from -fsanitize=thread.
  # SHARDSERVE_TSAN tells our own code (tests/testing/alloc_counter.cc) that it runs under TSan.
  set(SHARDSERVE_SANITIZER_FLAGS -fsanitize=thread -fno-omit-frame-pointer)
  set(SHARDSERVE_SANITIZER_COMPILE_ONLY -U__SANITIZE_THREAD__ -DSHARDSERVE_TSAN=1)
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
    set(compile_flags ${SHARDSERVE_SANITIZER_FLAGS} ${SHARDSERVE_SANITIZER_COMPILE_ONLY})
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${compile_flags}>)
    target_link_options(${target} PRIVATE ${SHARDSERVE_SANITIZER_FLAGS})
  endif()
endfunction()

# Include paths follow declared dependencies. A library's headers are staged (as symbolic links,
# at their repository paths) under build/include/<library>/, and that folder is the library's only
# include path: a file sees the headers of its own library and of the libraries it depends on, and
# `#include` of any other project header is a compile error ("No such file or directory"), the way
# a layering check would report it. Headers under an `internal/` folder are staged privately: only
# the library's own sources see them.
#
# A library's headers: each source's same-named .h/.cuh beside it, plus those listed in HDRS (headers
# without a source of their own). A header that no library declares cannot be included at all.
function(_shardserve_stage_headers target public_dir private_dir)
  file(REMOVE_RECURSE ${public_dir} ${private_dir})
  file(MAKE_DIRECTORY ${public_dir} ${private_dir})
  foreach(h IN LISTS ARGN)
    get_filename_component(abs ${h} ABSOLUTE BASE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
    if(NOT EXISTS ${abs})
      message(FATAL_ERROR "${target}: header ${h} does not exist")
    endif()
    file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${abs})
    if(rel MATCHES "(^|/)internal/")
      set(link ${private_dir}/${rel})
    else()
      set(link ${public_dir}/${rel})
    endif()
    get_filename_component(link_dir ${link} DIRECTORY)
    file(MAKE_DIRECTORY ${link_dir})
    file(CREATE_LINK ${abs} ${link} SYMBOLIC)
  endforeach()
endfunction()

# The default header list: each source's same-named header beside it.
function(_shardserve_default_headers out)
  set(hdrs "")
  foreach(src IN LISTS ARGN)
    get_filename_component(abs ${src} ABSOLUTE BASE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
    get_filename_component(dir ${abs} DIRECTORY)
    get_filename_component(stem ${abs} NAME_WLE)
    foreach(ext .h .cuh)
      if(EXISTS ${dir}/${stem}${ext})
        list(APPEND hdrs ${dir}/${stem}${ext})
      endif()
    endforeach()
  endforeach()
  set(${out} ${hdrs} PARENT_SCOPE)
endfunction()

# The test tree's headers (tests/testing/..., fixtures' helpers) for test and benchmark targets.
set(SHARDSERVE_TEST_INCLUDE_DIR ${PROJECT_BINARY_DIR}/include-tests)
file(REMOVE_RECURSE ${SHARDSERVE_TEST_INCLUDE_DIR})
file(MAKE_DIRECTORY ${SHARDSERVE_TEST_INCLUDE_DIR})
file(CREATE_LINK ${PROJECT_SOURCE_DIR}/tests ${SHARDSERVE_TEST_INCLUDE_DIR}/tests SYMBOLIC)

# shardserve_cc_library(NAME n SRCS ... [HDRS ...] DEPS ... PUBLIC_DEPS ... [HEADER_ONLY])
function(shardserve_cc_library)
  cmake_parse_arguments(A "HEADER_ONLY" "NAME" "SRCS;HDRS;DEPS;PUBLIC_DEPS" ${ARGN})
  _shardserve_default_headers(default_hdrs ${A_SRCS})
  list(APPEND A_HDRS ${default_hdrs})
  if(A_HEADER_ONLY AND NOT A_HDRS)
    message(FATAL_ERROR "${A_NAME}: a HEADER_ONLY library needs HDRS")
  endif()
  set(public_dir ${PROJECT_BINARY_DIR}/include/${A_NAME})
  set(private_dir ${PROJECT_BINARY_DIR}/include-private/${A_NAME})
  _shardserve_stage_headers(${A_NAME} ${public_dir} ${private_dir} ${A_HDRS})
  if(A_HEADER_ONLY)
    add_library(${A_NAME} INTERFACE)
    target_include_directories(${A_NAME} INTERFACE ${public_dir})
    target_link_libraries(${A_NAME} INTERFACE ${A_PUBLIC_DEPS} ${A_DEPS})
    return()
  endif()
  add_library(${A_NAME} STATIC ${A_SRCS})
  target_include_directories(${A_NAME} PUBLIC ${public_dir} PRIVATE ${private_dir})
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

# shardserve_cc_test(NAME n SRCS ... DEPS ... [LABELS ...] [INTERNALS_OF lib ...]) — a GoogleTest binary registered with ctest.
# Tests run from the source tree so they can read tests/golden/... and ../shared/models/....
function(shardserve_cc_test)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS;LABELS;INTERNALS_OF" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gmock GTest::gtest_main)
  # Test code may include the test tree's own helpers (tests/...) besides its libraries' headers,
  # and a test that checks a library's internals says so: INTERNALS_OF lib ... (its internal/ headers).
  target_include_directories(${A_NAME} PRIVATE ${SHARDSERVE_TEST_INCLUDE_DIR})
  foreach(lib IN LISTS A_INTERNALS_OF)
    target_include_directories(${A_NAME} PRIVATE ${PROJECT_BINARY_DIR}/include-private/${lib})
  endforeach()
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
