# Every external dependency, found once. Debian 12 packages: tools/install-deps.sh.

find_package(Torch REQUIRED)
find_package(Threads REQUIRED)
find_package(spdlog REQUIRED)
find_package(fmt REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(tomlplusplus REQUIRED)
find_package(ZLIB REQUIRED)
find_package(Gloo REQUIRED)  # CPU collectives (libgloo-dev); target gloo
find_package(CLI11 CONFIG REQUIRED)  # the loom tool and the benchmarks' command lines
find_package(PkgConfig REQUIRED)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)  # checksums (libxxhash-dev)
find_package(PNG REQUIRED)   # image fields of record datasets: PNG (libpng-dev)
find_package(JPEG REQUIRED)  # and JPEG (libjpeg-dev: libjpeg-turbo)
find_package(CURL 7.75 REQUIRED)  # remote datasets: http(s) and S3 SigV4 (libcurl4-openssl-dev)
# cpp-httplib (libcpp-httplib-dev): the agents' snapshot replication server, and the tests'
# faulty HTTP server.
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
# SentencePiece is used through its command-line tools (spm_train, spm_encode): its library
# bundles protobuf 3.14, which clashes with the protobuf libtorch loads (a crash at start-up).

# The control plane (coordinator, launcher): gRPC and protobuf, and their code generators.
if(LOOM_WITH_GRPC)
  find_package(Protobuf REQUIRED)
  find_package(gRPC CONFIG REQUIRED)
  find_program(LOOM_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)
endif()

# Torch's flags (the C++11 ABI define) are already on the torch target; nothing global.

# CUDA: AUTO builds kernels/ and the NCCL code when nvcc exists (/usr/local/cuda here).
set(LOOM_CUDA_ENABLED OFF)
if(NOT LOOM_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(LOOM_CUDA_ENABLED ON)
  elseif(LOOM_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "LOOM_WITH_CUDA=ON but no CUDA compiler was found; "
                        "install the CUDA toolkit or set -DCUDAToolkit_ROOT=/usr/local/cuda")
  endif()
endif()
message(STATUS "Loom: CUDA ${LOOM_CUDA_ENABLED}")
