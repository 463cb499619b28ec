# mstar_rt::embed — needs the Python headers and libpython (Development.Embed) and pybind11's
# headers at build time only. MSTAR_BUILD_EMBED=AUTO builds it when they are found.
set(MSTAR_BUILD_EMBED "AUTO" CACHE STRING "Build mstar_rt::embed: AUTO | ON | OFF")
set(MSTAR_HAVE_EMBED OFF)
if(NOT MSTAR_BUILD_EMBED STREQUAL "OFF")
  if(MSTAR_BUILD_EMBED STREQUAL "ON")
    set(_mstar_embed_required REQUIRED)
  endif()
  find_package(Python 3.9 ${_mstar_embed_required} COMPONENTS Interpreter Development.Embed)
  find_package(pybind11 CONFIG QUIET)
  if(NOT pybind11_FOUND AND Python_EXECUTABLE)
    execute_process(COMMAND "${Python_EXECUTABLE}" -c "import pybind11; print(pybind11.get_cmake_dir())"
                    OUTPUT_VARIABLE _mstar_pybind11_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_mstar_pybind11_dir)
      find_package(pybind11 CONFIG QUIET PATHS "${_mstar_pybind11_dir}" NO_DEFAULT_PATH)
    endif()
  endif()
  if(Python_Development.Embed_FOUND AND pybind11_FOUND)
    set(MSTAR_HAVE_EMBED ON)
  elseif(MSTAR_BUILD_EMBED STREQUAL "ON")
    message(FATAL_ERROR "MSTAR_BUILD_EMBED=ON but pybind11 was not found")
  else()
    message(STATUS "mstar_rt: not building mstar_rt::embed (no Python embedding development files or pybind11)")
  endif()
endif()

if(MSTAR_HAVE_EMBED)
  add_library(mstar_embed STATIC src/embed/interpreter.cpp src/embed/python_model.cpp)
  add_library(mstar_rt::embed ALIAS mstar_embed)
  target_include_directories(mstar_embed PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
  # pybind11 is header-only and private: the installed target needs only libpython.
  target_link_libraries(mstar_embed PUBLIC mstar_runtime Python::Python
                                    PRIVATE $<BUILD_INTERFACE:pybind11::headers>)
  # The interpreter this was built against: the last fallback for finding site-packages.
  target_compile_definitions(mstar_embed PRIVATE
    MSTAR_BUILD_PYTHON_EXECUTABLE="${Python_EXECUTABLE}"
    MSTAR_PYTHON_VERSION="${Python_VERSION_MAJOR}.${Python_VERSION_MINOR}")
  target_compile_options(mstar_embed PRIVATE -Wall -Wextra -fvisibility=hidden)
  set_target_properties(mstar_embed PROPERTIES POSITION_INDEPENDENT_CODE ON EXPORT_NAME embed
                                               OUTPUT_NAME mstar_embed)
endif()
