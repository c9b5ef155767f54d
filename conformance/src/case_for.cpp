// The case an implementation receives: the golden file's inputs and metadata, with the
// declared output dtypes of the profile that judges it.
#include <map>
#include <string>

#include "attnoracle/conformance/compare.hpp"
#include "comparer.hpp"

namespace attnoracle::conformance {

namespace {

// The inputs and metadata of a golden file: what case_from_file keeps of it, without copying
// the golden tensors (most of the bytes) only to drop them.
SafeTensorsFile inputs_of(const SafeTensorsFile& golden) {
  SafeTensorsFile f;
  f.metadata = golden.metadata;
  for (const auto& t : golden.tensors)
    if (!is_golden_tensor_name(t.name)) f.tensors.push_back(t);
  return f;
}

// Where the profile returns lse in a dtype of its own and the case asks for lse in another,
// attn.output_dtypes of `md` (the case's metadata) gives lse that dtype; false when nothing changes.
bool declare_output_dtypes(const Case& c, const Profile& p, std::map<std::string, std::string>& md) {
  if (!p.lse_dtype || !c.want_lse || c.dtype_of("lse") == *p.lse_dtype) return false;
  std::string list;
  for (const auto& [name, t] : c.output_dtypes)
    if (name != "lse") list += name + ":" + std::string(dtype_name(t)) + ",";
  md["attn.output_dtypes"] = list + "lse:" + std::string(dtype_name(*p.lse_dtype));
  return true;
}

}  // namespace

namespace comparing {

// The case as the implementation is given it (case_for), read.
Case declared_case(const std::string& id, const SafeTensorsFile& golden, const Profile& p) {
  Case c = case_from_file(id, inputs_of(golden));
  std::map<std::string, std::string> md = c.file.metadata;  // (the tensors copied only when it changes)
  if (declare_output_dtypes(c, p, md)) {
    SafeTensorsFile f = std::move(c.file);
    f.metadata = std::move(md);
    c = case_from_file(id, std::move(f));
  }
  return c;
}

}  // namespace comparing

SafeTensorsFile strip_golden(const SafeTensorsFile& golden) {
  return case_from_file("golden", inputs_of(golden)).file;  // golden tensors and reference keys dropped
}

SafeTensorsFile case_for(const SafeTensorsFile& golden, const Profile& profile) {
  Case c = case_from_file("golden", inputs_of(golden));
  declare_output_dtypes(c, profile, c.file.metadata);
  return std::move(c.file);
}

}  // namespace attnoracle::conformance
