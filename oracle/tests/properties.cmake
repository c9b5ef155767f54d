# RapidCheck properties of the reference and the oracle over generated attention problems.
# RapidCheck's default is 100 cases per property; RC_PARAMS="max_success=2000" runs more, and a
# failure prints the RC_PARAMS="reproduce=..." string that replays it.
attnoracle_add_test(oracle_properties_test SOURCES properties_test.cpp gen_case.cpp LIBS attnoracle::oracle)
