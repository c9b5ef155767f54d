// The inner loops of row_magnitudes (row_magnitudes.cpp): products of a block of query rows with
// the keys, exact in double or filtered in float, and the filter's scan of a row for the keys
// that may hold its maxima; each for AVX-512, AVX2 or SSE, picked at run time. Also the
// projections of kind mha, shared with value_magnitudes.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "attnoracle/reference/case_file.hpp"

namespace attnoracle::conformance::magnitudes {

constexpr std::int64_t kKeyAlign = 32;  // keys padded to a multiple of every kernel's key block
constexpr std::int64_t kRowBlock = 64;  // query rows per pass over the keys (a multiple of R)

// Products and sums for rows [0, kRowBlock) of q (row-major [kRowBlock][Dk]) against keys
// [j0, j1) of kt (transposed [Dk][ldk]): s[r][j] = sum_d q[r][d] kt[d][j], a[r][j] = sum_d
// qa[r][d] kat[d][j], each summed in d order. j0 and j1 are multiples of the key block.
// Exact: in double, no fused multiply-adds. Filter: in float, fused multiply-adds welcome.
using ExactFn = void (*)(const double* q, const double* qa, std::int64_t Dk, const double* kt, const double* kat,
                         std::int64_t ldk, std::int64_t j0, std::int64_t j1, double* s, double* a);
using FilterFn = void (*)(const float* q, const float* qa, std::int64_t Dk, const float* kt, const float* kat,
                          std::int64_t ldk, std::int64_t j0, std::int64_t j1, float* s, float* a);
ExactFn exact_kernel();
FilterFn filter_kernel();

// The filter's scan of one row over the allowed keys j in [lo, hi] (flags[j] != 0, or all when
// flags is null), on the float products s_j, a_j: with la = max a_j, thr_a = la (1 - 4R) and
// (when scores) ls = max (|s_j| - c8 a_j), writes to cand the keys with a_j >= thr_a or
// (when scores) |s_j| + c8 a_j >= ls, and returns their number; thr_a is returned too.
using ScanFn = std::int64_t (*)(const float* s, const float* a, const unsigned char* flags, std::int64_t lo,
                                std::int64_t hi, float c8, double R, bool scores, float& thr_out, std::int64_t* cand);
ScanFn scan_kernel();

// X W per head, in double, on values (abs = false) or on magnitudes |X| |W| (abs = true); each
// element summed in d order.
std::vector<double> project(const Case& c, const FloatTensor& x, const FloatTensor& w, std::int64_t N,
                            std::int64_t E, bool abs);

}  // namespace attnoracle::conformance::magnitudes
