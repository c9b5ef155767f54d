// exp on double-double arguments in [kExpMin, 8], to relative error kExpRel.
#pragma once

#include "dd.hpp"

namespace attnoracle::fast {

// exp(x) for kExpMin <= x.hi <= 8; relative error at most kExpRel (error_bounds.hpp).
DD exp_dd(DD x);

}  // namespace attnoracle::fast
