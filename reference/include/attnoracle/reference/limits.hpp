// The limits every reader enforces on what it is given (docs/CONTRACT.md, "Limits"). Input past
// a limit is refused as bad input, with the limit in the message.
#pragma once

#include <cstdint>
#include <string_view>

namespace attnoracle::limits {

// JSON texts (safetensors headers, manifests, suite specs, profiles, jobs lines): nesting depth
// of arrays and objects. The formats themselves need 4 at most.
inline constexpr int kJsonDepth = 64;
// A safetensors header, in bytes.
inline constexpr std::uint64_t kHeaderBytes = 100'000'000;
// Tensors in one safetensors file.
inline constexpr std::uint64_t kTensors = 4096;
// Any file read whole (a case file, a result, a golden file), in bytes.
inline constexpr std::uint64_t kFileBytes = 64ULL << 30;
// A manifest or a suite spec, in bytes.
inline constexpr std::uint64_t kManifestBytes = 64ULL << 20;
// Cases in one vector set.
inline constexpr std::uint64_t kCases = 100'000;
// Elements of one tensor shape.
inline constexpr std::uint64_t kElements = 1ULL << 40;

// The nesting depth of a JSON text's arrays and objects, outside strings, counted without
// parsing (so that a parser never recurses deeper than the limit); stops counting past `cap`.
int json_depth(std::string_view text, int cap = kJsonDepth + 1);
// The number of members of the outermost JSON object (its keys, counted as the colons at depth
// 1 outside strings), without parsing: a reader can refuse too many before a parser builds them.
std::uint64_t json_top_level_members(std::string_view text);

}  // namespace attnoracle::limits
