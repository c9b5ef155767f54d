# cmake --install: the command, the libraries with their public headers, a CMake package
# (find_package(AttnOracle): AttnOracle::plugin, AttnOracle::format, AttnOracle::reference,
# AttnOracle::oracle, AttnOracle::conformance, AttnOracle::metamorphic, AttnOracle::vectors) and
# a pkg-config file (attnoracle.pc); cpack -G DEB makes a Debian package of the same.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

get_property(libraries GLOBAL PROPERTY ATTNORACLE_LIBRARIES)
install(TARGETS attnoracle RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS ${libraries} attnoracle_version attnoracle_plugin EXPORT AttnOracleTargets
        ARCHIVE DESTINATION lib
        LIBRARY DESTINATION lib
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(folder reference oracle conformance vectors)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${folder}/include/attnoracle
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endforeach()
install(FILES ${PROJECT_BINARY_DIR}/generated/attnoracle/version.hpp
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/attnoracle)

set(cmake_dir lib/cmake/AttnOracle)
install(EXPORT AttnOracleTargets NAMESPACE AttnOracle:: DESTINATION ${cmake_dir})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/AttnOracleConfig.cmake.in
  ${PROJECT_BINARY_DIR}/AttnOracleConfig.cmake INSTALL_DESTINATION ${cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/AttnOracleConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/AttnOracleConfig.cmake
              ${PROJECT_BINARY_DIR}/AttnOracleConfigVersion.cmake DESTINATION ${cmake_dir})

configure_file(${PROJECT_SOURCE_DIR}/cmake/attnoracle.pc.in ${PROJECT_BINARY_DIR}/attnoracle.pc @ONLY)
# Relocatable (prefix from the file's own place): lib/pkgconfig under the prefix.
install(FILES ${PROJECT_BINARY_DIR}/attnoracle.pc DESTINATION lib/pkgconfig)

set(CPACK_PACKAGE_NAME attnoracle)
set(CPACK_PACKAGE_CONTACT "AttnOracle maintainers")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "certified reference and conformance gate for attention")
set(CPACK_DEBIAN_PACKAGE_DEPENDS "libmpfr6, libgmp10, libnettle8, libstdc++6")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_GENERATOR DEB)
include(CPack)
