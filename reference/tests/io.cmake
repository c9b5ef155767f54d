attnoracle_add_test(reference_safetensors_test SOURCES safetensors_test.cpp
                    LIBS attnoracle::reference)
attnoracle_add_test(reference_case_file_test SOURCES case_file_test.cpp LIBS attnoracle::reference)
