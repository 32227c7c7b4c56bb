# Compiler set-up shared by every Loom target: ccache, warnings, the torch PCH.

find_program(LOOM_CCACHE ccache)
if(LOOM_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER "${LOOM_CCACHE}")
  set(CMAKE_CUDA_COMPILER_LAUNCHER "${LOOM_CCACHE}")
  message(STATUS "Loom: compiling through ccache (${LOOM_CCACHE})")
endif()

# Sanitizers (tools/run-tests.sh --sanitize=...): every Loom target compiles and links with
# -fsanitize=$LOOM_SANITIZE, e.g. "address,undefined" or "thread". Dependencies (libtorch,
# gRPC, Gloo) stay uninstrumented: their own bugs are out of reach, and ours inside them too.
# UBSan's vptr check (the dynamic type behind every member call and downcast of a polymorphic
# object) is left out unless LOOM_UBSAN_VPTR is ON: with ASan it makes each file a quarter
# slower to compile (parallel/fsdp.cpp: 60 CPU-s with it, 47.5 without), which CI cannot
# afford; every other UBSan check stays.
set(LOOM_SANITIZE "" CACHE STRING "Sanitizers to build with: address,undefined or thread; empty: none")
option(LOOM_UBSAN_VPTR "With LOOM_SANITIZE=...undefined: keep UBSan's vptr check" OFF)
if(LOOM_SANITIZE)
  add_compile_options(-fsanitize=${LOOM_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  if(LOOM_SANITIZE MATCHES "undefined" AND NOT LOOM_UBSAN_VPTR)
    add_compile_options(-fno-sanitize=vptr)
  endif()
  add_link_options(-fsanitize=${LOOM_SANITIZE})
  message(STATUS "Loom: sanitizers ${LOOM_SANITIZE}")
endif()

# Warnings apply to Loom's own sources only: torch and other dependencies come in through
# imported targets, whose include directories are SYSTEM and so exempt.
function(loom_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror -Wno-unused-parameter -Wno-missing-field-initializers>)
endfunction()

# One precompiled <torch/torch.h> (and the standard headers around it), built once by the
# loom library and reused by every other target that links torch.
set(LOOM_PCH_HEADERS
  <torch/torch.h> <vector> <string> <memory> <functional> <chrono> <filesystem>)

# The PCH goes only to the target's files that include <torch/torch.h>. Loading it costs about
# 13 s per file on the 2-core machine (it is ~600 MB), more than a file that includes only ATen
# or nothing of torch takes to compile without it; a file that includes <torch/torch.h> saves
# about 7 s.
function(loom_use_torch_pch target)
  if(NOT LOOM_USE_PCH)
    return()
  endif()
  target_precompile_headers(${target} REUSE_FROM loom_pch)
  get_target_property(sources ${target} SOURCES)
  get_target_property(source_dir ${target} SOURCE_DIR)
  foreach(source IN LISTS sources)
    if(NOT source MATCHES "\\.(cpp|cc)$")
      continue()
    endif()
    if(IS_ABSOLUTE "${source}")
      set(path "${source}")
    else()
      set(path "${source_dir}/${source}")
    endif()
    file(STRINGS "${path}" includes_torch REGEX "^#include <torch/torch\\.h>")
    if(NOT includes_torch)
      set_source_files_properties(${source} TARGET_DIRECTORY ${target}
        PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
    endif()
  endforeach()
endfunction()
