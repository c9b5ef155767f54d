// Every sum in a file that includes this header is rounded as written: no contraction into
// fused multiply-adds (which -march flags or a target attribute would otherwise allow), except
// where a function says so with ATTNORACLE_CONTRACT("fast") in its attributes.
#pragma once

#if defined(__clang__)
#pragma clang fp contract(off)
#define ATTNORACLE_CONTRACT(mode)
#else
#pragma GCC optimize("fp-contract=off")
#define ATTNORACLE_CONTRACT(mode) , optimize("fp-contract=" mode)
#endif
