#include "attnoracle/vectors/model_store.hpp"

namespace attnoracle::vectors {
namespace {
ModelStore& installed() {
  static ModelStore store;
  return store;
}
}  // namespace

void install_model_store(ModelStore store) { installed() = store; }
const ModelStore& model_store() { return installed(); }

}  // namespace attnoracle::vectors
