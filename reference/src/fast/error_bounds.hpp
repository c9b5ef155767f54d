// Every error constant of the fast path, in one place. Each is a power of two above the bound
// it covers; the comment cites where that bound comes from. u = 2^-53, the unit roundoff of F64.
#pragma once

namespace attnoracle::fast {

inline constexpr double kU = 0x1p-53;

// Double-double operations, relative to the exact result of the operation on their operands
// (Joldes, Muller, Popescu 2017, see dd.hpp).
inline constexpr double kAddFP = 0x1p-104;  // DWPlusFP: 2u^2 = 2^-105
inline constexpr double kAddDD = 0x1p-103;  // AccurateDWPlusDW: 3u^2 / (1 - 4u) < 2^-104.4
inline constexpr double kMulFP = 0x1p-104;  // DWTimesFP3: 2u^2 = 2^-105
inline constexpr double kMulDD = 0x1p-103;  // DWTimesDW3: 5u^2 < 2^-103.6
inline constexpr double kDivDD = 0x1p-101;  // DWDivDW2 as coded: 12u^2 (proofs/dd_div.g)

// exp_dd on [-620, 8], relative: reduction 2^-94.8, polynomial 2^-103.7 then ten squarings
// 2^-92.7, truncation 2^-136 (exp_dd.cpp tallies it); a factor 16 above the sum.
inline constexpr double kExpRel = 0x1p-88;

// Radii are computed in F64 with rounding to nearest, by formulas of at most 15 operations on
// nonnegative numbers: their relative error is below gamma_15 < 2^-48.9, so each radius is
// multiplied by 1 + kRadiusSlack; kRadiusFloor absorbs underflow in those formulas.
inline constexpr double kRadiusSlack = 0x1p-45;
inline constexpr double kRadiusFloor = 0x1p-1020;

// Dot2 (Ogita, Rump, Oishi 2005, Theorem 5.3): s + c encloses x.y within gamma_n^2 sum |x_i y_i|
// (before the final rounding, which is not done here); the code uses 2 gamma_n^2.

// P V over n keys (fast_row.cpp), in blocks of kSumBlock = 64 keys summed from zero like Dot2,
// each block's result added to a double-double total (kAddDD each). One block of b <= 64 keys
// misses by at most gamma_{b+1} (gamma_{b-1} (1 + u) + 2u) A_block (docs/PROOFS.md, section 9),
// A = sum |x_j y_j|; with nb <= kMaxSumBlocks blocks the total misses by at most
// (kBlockSum + nb kAddDD (1 + kSumMag)) A, and A <= |total of the magnitudes.hi| (1 + kSumMag).
inline constexpr double kBlockSum = 0x1p-93;
inline constexpr double kSumMag = 0x1p-50;
inline constexpr double kMaxSumBlocks = 0x1p40;

// Inputs the fast path accepts (else the row goes to MPFR): nonzero magnitudes within
// [kMinInput, kMaxInput], so that products neither underflow (TwoProd stays exact above 2^-969)
// nor overflow, and exp's argument range, below which a weight is enclosed by [0, kTinyExp].
inline constexpr double kMinInput = 0x1p-480;
inline constexpr double kMaxInput = 0x1p+480;
inline constexpr double kExpMin = -620;
inline constexpr double kTinyExp = 0x1p-894;  // exp(-620) < 2^-894.4

// Ball arithmetic's own margins (fast_row.cpp); each relation is checked in proofs/margins.txt.
// |x| <= |hi| (1 + u) and |x| >= |hi| (1 - u) for a normalised double-double (|lo| <= u |hi|).
inline constexpr double kMagRel = 0x1p-52;
// The ends mid -/+ rad are one DWPlusFP (kAddFP) of a result below (|mid| + rad)(1 + 2^-44).
inline constexpr double kEndRel = 0x1p-102;
// |am/bm| <= |m| / (1 - kDivDD) <= |m| (1 + kDivQuotient).
inline constexpr double kDivQuotient = 0x1p-100;
// exp(am) <= |m| / (1 - kExpRel) <= |m| (1 + kExpMid).
inline constexpr double kExpMid = 0x1p-80;

// Thresholds of decisions (not error bounds): past them the row goes to MPFR.
// exp's ball rule |e^d - 1| <= r (1 + r) needs r <= 1; exp_constants.sollya uses kExpMaxRad.
inline constexpr double kExpMaxRad = 0x1p-20;
// exp_dd's tally (exp_dd.cpp, exp_reduction.g) holds for arguments up to kExpMax.
inline constexpr double kExpMax = 8;
// A quotient by a ball needs bm > kDivMargin rb with kDivMargin >= 2, so that bm - rb >= bm/2.
inline constexpr double kDivMargin = 2;

}  // namespace attnoracle::fast
