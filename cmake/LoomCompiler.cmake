# Compiler set-up shared by every Loom target: ccache, warnings, the torch PCH.

find_program(LOOM_CCACHE ccache)
if(LOOM_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER "${LOOM_CCACHE}")
  set(CMAKE_CUDA_COMPILER_LAUNCHER "${LOOM_CCACHE}")
  message(STATUS "Loom: compiling through ccache (${LOOM_CCACHE})")
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

function(loom_use_torch_pch target)
  if(LOOM_USE_PCH)
    target_precompile_headers(${target} REUSE_FROM loom_pch)
  endif()
endfunction()
