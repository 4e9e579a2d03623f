# Shared build logic for every TrainStream core (a nanobind extension `_core`).
#
#   ts_add_core(<target> PACKAGE <import_name> SOURCES <cpp...> [CUDA_SOURCES <cu...>]
#               [SM90A_SOURCES <cu...>])
#
# SM90A_SOURCES use Hopper-only instructions (wgmma, setmaxnreg): they are
# built for sm_90a alone, and only when the architectures include 90, in
# which case the target gets TS_WITH_SM90A=1.
#
# Options (cache variables; scikit-build-core passes the environment variables
# of the same name through pyproject.toml):
#   TS_ENABLE_CUDA          AUTO (default) | ON | OFF. AUTO builds the CUDA
#                           sources when nvcc is found. Without CUDA every
#                           CUDA entry point raises a clear RuntimeError.
#   TS_CUDA_ARCHITECTURES   architectures for nvcc, default "80;90;100;120"
#                           (Ampere, Hopper, Blackwell datacenter and GeForce).
#                           Never "native" for wheels: it silently falls back
#                           when the build machine has no GPU.
include_guard(GLOBAL)

set(TS_NATIVE_DIR "${CMAKE_CURRENT_LIST_DIR}/.." CACHE INTERNAL "")
set(TS_ENABLE_CUDA "AUTO" CACHE STRING "Build CUDA kernels: AUTO, ON or OFF")
set_property(CACHE TS_ENABLE_CUDA PROPERTY STRINGS AUTO ON OFF)
set(TS_CUDA_ARCHITECTURES "80;90;100;120" CACHE STRING "CUDA architectures to compile for")

if(NOT CMAKE_BUILD_TYPE)
  set(CMAKE_BUILD_TYPE Release)
endif()
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)

# ---- CUDA: decided once, before any target --------------------------------
string(TOUPPER "${TS_ENABLE_CUDA}" _ts_cuda_mode)
if(NOT _ts_cuda_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "TS_ENABLE_CUDA=${TS_ENABLE_CUDA} is not valid; use AUTO, ON or OFF")
endif()
set(TS_WITH_CUDA OFF)
if(NOT _ts_cuda_mode STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # Must be set before enable_language(CUDA), or CMake probes the default.
    set(CMAKE_CUDA_ARCHITECTURES "${TS_CUDA_ARCHITECTURES}")
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(TS_WITH_CUDA ON)
  elseif(_ts_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "TS_ENABLE_CUDA=ON but no CUDA compiler was found; put nvcc on PATH "
                        "or set CMAKE_CUDA_COMPILER")
  endif()
endif()
message(STATUS "TrainStream core: CUDA ${TS_WITH_CUDA} (mode ${_ts_cuda_mode}, architectures ${TS_CUDA_ARCHITECTURES})")

# ---- Python and nanobind ---------------------------------------------------
find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)
if(NOT nanobind_ROOT)
  execute_process(COMMAND "${Python_EXECUTABLE}" -m nanobind --cmake_dir
                  OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE nanobind_ROOT)
endif()
find_package(nanobind CONFIG REQUIRED)

set(TS_NATIVE_SOURCES
    "${TS_NATIVE_DIR}/src/thread_pool.cpp"
    "${TS_NATIVE_DIR}/src/host_pool_registry.cpp"
    "${TS_NATIVE_DIR}/src/host_cpus.cpp"
    "${TS_NATIVE_DIR}/src/cgroup.cpp"
    "${TS_NATIVE_DIR}/src/cuda_check.cpp"
    "${TS_NATIVE_DIR}/src/host_memory_info.cpp"
    "${TS_NATIVE_DIR}/src/page_lock.cpp")

function(ts_add_core target)
  cmake_parse_arguments(ARG "" "PACKAGE" "SOURCES;CUDA_SOURCES;SM90A_SOURCES" ${ARGN})
  if(NOT ARG_PACKAGE)
    message(FATAL_ERROR "ts_add_core(${target}): PACKAGE <import_name> is required")
  endif()
  set(sources ${ARG_SOURCES} ${TS_NATIVE_SOURCES})
  if(TS_WITH_CUDA)
    list(APPEND sources ${ARG_CUDA_SOURCES})
  endif()
  # NB_STATIC: libnanobind is linked into this module, so cores of different
  # packages never share (or fight over) one nanobind runtime library.
  nanobind_add_module(${target} NB_STATIC STABLE_ABI ${sources})
  target_include_directories(${target} PRIVATE "${TS_NATIVE_DIR}/include"
                                               "${CMAKE_CURRENT_SOURCE_DIR}/csrc")
  find_package(Threads REQUIRED)
  target_link_libraries(${target} PRIVATE Threads::Threads)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-O3 -Wall -Wextra -Wno-unused-parameter>)
  endif()
  if(TS_WITH_CUDA)
    target_compile_definitions(${target} PRIVATE TS_WITH_CUDA=1)
    # Static runtime: the module depends on no libcudart (and never on
    # libtorch), so one wheel serves every torch build and imports without a
    # GPU driver.
    set_target_properties(${target} PROPERTIES CUDA_RUNTIME_LIBRARY Static
                                               CUDA_ARCHITECTURES "${TS_CUDA_ARCHITECTURES}")
    target_link_libraries(${target} PRIVATE CUDA::cudart_static)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -O3 -lineinfo>)
    if(ARG_SM90A_SOURCES AND ("90" IN_LIST TS_CUDA_ARCHITECTURES OR "90a" IN_LIST TS_CUDA_ARCHITECTURES))
      # The object files carry sm_90a machine code only; the module calls
      # into them only on compute capability 9.0 devices.
      add_library(${target}_sm90a OBJECT ${ARG_SM90A_SOURCES})
      set_target_properties(${target}_sm90a PROPERTIES CUDA_ARCHITECTURES "90a" CUDA_RUNTIME_LIBRARY Static
                                                        POSITION_INDEPENDENT_CODE ON)
      target_include_directories(${target}_sm90a PRIVATE "${TS_NATIVE_DIR}/include" "${CMAKE_CURRENT_SOURCE_DIR}/csrc")
      target_compile_definitions(${target}_sm90a PRIVATE TS_WITH_CUDA=1)
      target_compile_options(${target}_sm90a PRIVATE --expt-relaxed-constexpr -O3 -lineinfo)
      target_link_libraries(${target}_sm90a PRIVATE CUDA::cudart_static)
      target_sources(${target} PRIVATE $<TARGET_OBJECTS:${target}_sm90a>)
      target_compile_definitions(${target} PRIVATE TS_WITH_SM90A=1)
    endif()
  endif()
  install(TARGETS ${target} LIBRARY DESTINATION "${ARG_PACKAGE}")
endfunction()
