# Installs headers, the static libraries and a CMake package config, so that a C++ project finds
# them with find_package(mstar_rt CONFIG): mstar_rt::core (streaming core, Conductor, control),
# mstar_rt::runtime (Model, Runtime, Tensor, ChunkFeeder) and, where it was built,
# mstar_rt::embed (Python models through an embedded interpreter; links libpython). Inside a
# wheel everything goes under the mstar_rt/ package folder.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

if(DEFINED SKBUILD)
  # In a wheel: mstar_rt/{include,lib} and the config in mstar_rt/cmake/, which CMake finds as
  # <prefix>/mstar_rtConfig.cmake with prefix = `python -m mstar_rt --cmake-prefix`.
  set(MSTAR_INCLUDE_DIR "mstar_rt/include")
  set(MSTAR_LIB_DIR "mstar_rt/lib")
  set(MSTAR_CMAKE_DIR "mstar_rt/cmake")
  set(MSTAR_IN_WHEEL ON)
else()
  set(MSTAR_INCLUDE_DIR "${CMAKE_INSTALL_INCLUDEDIR}")
  set(MSTAR_LIB_DIR "${CMAKE_INSTALL_LIBDIR}")
  set(MSTAR_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/mstar_rt")
  set(MSTAR_IN_WHEEL OFF)
endif()

install(TARGETS mstar_core mstar_runtime EXPORT mstar_rtTargets
        ARCHIVE DESTINATION ${MSTAR_LIB_DIR}
        INCLUDES DESTINATION ${MSTAR_INCLUDE_DIR})
install(DIRECTORY cpp/include/mstar DESTINATION ${MSTAR_INCLUDE_DIR})
install(EXPORT mstar_rtTargets NAMESPACE mstar_rt:: DESTINATION ${MSTAR_CMAKE_DIR})
# The embed target in a file of its own: the config loads it only when Python's embedding
# files are found, so that a core-only consumer needs no Python at all.
if(MSTAR_HAVE_EMBED)
  install(TARGETS mstar_embed EXPORT mstar_rtEmbedTargets
          ARCHIVE DESTINATION ${MSTAR_LIB_DIR}
          INCLUDES DESTINATION ${MSTAR_INCLUDE_DIR})
  install(EXPORT mstar_rtEmbedTargets NAMESPACE mstar_rt:: DESTINATION ${MSTAR_CMAKE_DIR})
  set(MSTAR_EMBED_PYTHON_VERSION "${Python_VERSION_MAJOR}.${Python_VERSION_MINOR}")
  set(MSTAR_EMBED_BUILD_PYTHON "${Python_EXECUTABLE}")
endif()

configure_package_config_file(cmake/mstar_rtConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/mstar_rtConfig.cmake INSTALL_DESTINATION ${MSTAR_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/mstar_rtConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/mstar_rtConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/mstar_rtConfigVersion.cmake
        DESTINATION ${MSTAR_CMAKE_DIR})
