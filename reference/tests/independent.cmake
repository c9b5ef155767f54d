# The independent second evaluation of random problems (Boost.Multiprecision over MPFR, plain
# formula, the tests' own integer rounding), and its building blocks.

# Rounding into F64/F32/F16/BF16 by integer arithmetic on the significand.
add_library(attnoracle_int_round STATIC int_round.cpp)
target_include_directories(attnoracle_int_round PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}
                           ${PROJECT_SOURCE_DIR}/reference/include)
target_link_libraries(attnoracle_int_round PUBLIC PkgConfig::MPFR PkgConfig::GMP Boost::headers
                      PRIVATE attnoracle_warnings)

# Seeded random case files in memory, reusable by other tests.
add_library(attnoracle_random_case STATIC random_case.cpp)
target_link_libraries(attnoracle_random_case PUBLIC attnoracle::reference attnoracle_int_round
                      PRIVATE attnoracle_warnings)

attnoracle_add_test(reference_int_round_test SOURCES int_round_test.cpp LIBS attnoracle_int_round)
attnoracle_add_test(reference_independent_check_test SOURCES independent_check_test.cpp
                    LIBS attnoracle_random_case attnoracle::reference Boost::headers)
