// The gate's stored model (CONTRACT section 3, "The model's magnitudes") as the vectors library
// sees it: two functions the program installs (the attnoracle command installs the gate's), so
// that this library needs nothing of the gate. Without them `gen --model` is refused, and a
// golden file's stored model is carried as written, neither checked nor recomputed.
#pragma once

#include "attnoracle/reference/case_file.hpp"

namespace attnoracle::vectors {

struct ModelStore {
  void (*put)(const Case&, SafeTensorsFile&) = nullptr;          // adds model.* to a golden file
  void (*check)(const Case&, const SafeTensorsFile&) = nullptr;  // throws InputError when wrong
};

void install_model_store(ModelStore store);
const ModelStore& model_store();

}  // namespace attnoracle::vectors
