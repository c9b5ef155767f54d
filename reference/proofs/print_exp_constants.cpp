// Prints the constants exp_dd holds (LN2 and the Taylor coefficients 1/i! as double-doubles),
// as hex floats, so that the proof driver can compare them with what exp_poly.sollya certifies.
// It compiles exp_dd.cpp itself into this program: the values printed are those the code
// computes at start-up, by the code that computes them.
#include <cstdio>

#include "fast/exp_dd.cpp"

int main() {
  const auto& k = attnoracle::fast::exp_constants();
  std::printf("ln2 %a %a\n", k.ln2.hi, k.ln2.lo);
  for (unsigned i = 0; i < k.inv_fact.size(); ++i)
    std::printf("coef %u %a %a\n", i, k.inv_fact[i].hi, k.inv_fact[i].lo);
  return 0;
}
