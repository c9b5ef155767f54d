# The gate's mutation score on the committed core suite: every seeded bug of the NumPy adapter
# caught, no failed case for the correct implementations (NumPy under fp32, fp16, bf16, fp64;
# ONNX Runtime under fp32 and profiles/onnxruntime-fp16.json when its node_modules is installed).
# Included from conformance/CMakeLists.txt. About 35 s on 2 cores.
if(ATTNORACLE_TESTS)
  add_test(NAME conformance_mutation_score
           COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/tests/mutation_test.py
                   --cli $<TARGET_FILE:attnoracle>
                   --suite ${PROJECT_SOURCE_DIR}/vectors/core
                   --source ${PROJECT_SOURCE_DIR})
  set_tests_properties(conformance_mutation_score PROPERTIES
                       TIMEOUT 600
                       ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
endif()
