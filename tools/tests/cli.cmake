# End-to-end refusals of `attnoracle eval`: runs the built binary.
attnoracle_add_test(tools_eval_refusal_test SOURCES tests/eval_refusal_test.cpp
                    LIBS attnoracle::reference nlohmann_json::nlohmann_json)
add_dependencies(tools_eval_refusal_test attnoracle)
