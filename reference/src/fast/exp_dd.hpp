// exp on double-double arguments in [kExpMin, 8], to relative error kExpRel.
#pragma once

#include <array>

#include "dd.hpp"

namespace attnoracle::fast {

// exp(x) for kExpMin <= x.hi <= 8; relative error at most kExpRel (error_bounds.hpp).
DD exp_dd(DD x);

// Its constants: ln 2 and 1/i! for i < 10, each the nearest double-double.
struct ExpConstants {
  DD ln2;
  std::array<DD, 10> inv_fact;
};
const ExpConstants& exp_constants();

}  // namespace attnoracle::fast
