# exp_dd (exp_dd.cpp) as a whole: the relative error of its result against exp(x), for
# kExpMin <= x.hi <= 8.
#   polynomial  p0 = Horner's scheme on t with the stored coefficients C_i = hi_i + lo_i:
#               p_i = add(mul(p_{i+1}, t), C_i), each DD operation with the relative error of
#               the header's kMulDD / kAddDD. Where |p t| underflows, DWTimesDW3's error is
#               absolute instead, at most 4 * 2^-1075 (four roundings; TwoSum/Fast2Sum have
#               none): modelled as e_i, moved onto the addend C_i.
#               Exact value: P0 = P(t), the same polynomial in exact arithmetic, and
#               P(t) = exp(t)(1 + e), |e| <= exp_poly_rel (exp_poly.sollya, |t| <= T).
#   squarings   q_{s+1} = mul(q_s, q_s), ten times: q10 ~ exp(t)^1024 = exp(tau) (tau = 2^10 t).
#   reduction   exp(tau) = exp(R) exp(tau - R), |tau - R| <= exp_reduction_abs
#               (exp_reduction.g), so exp(tau) = exp(R)(1 + d) with
#               |d| <= exp_reduction_rel, as |e^a - 1| <= |a|(1 + |a|) for |a| <= 1.
#   2^k         scale2(q10, k): hi stays normal (k >= exp_k_min >= -1021); lo may round to a
#               subnormal, an absolute error <= 2^-1075 against a result >= 0.7 * 2^k:
#               relative <= exp_scale_rel.
# Result: scale2(q10, k) = 2^k exp(R) (1 + rho) = exp(x)(1 + rho), |rho| <= exp_dd_rel.
# The ranges of exp(t) and exp(R) in the hypotheses are enclosed by exp_poly.sollya (exp_ranges).
# establishes: exp_dd_rel = 0x1.4p-92
# establishes: exp_reduction_rel = 0x1.4p-95
# establishes: exp_scale_rel = 0x1p-180
# covers: kExpRel >= exp_dd_rel
# covers: exp_reduction_rel >= exp_reduction_abs * (1 + exp_reduction_abs)
# covers: exp_scale_rel * 0.7 * 2^exp_k_min >= 2^-1075
# covers: exp_k_min >= -1021
# code: exp_dd.cpp: DD p = K.inv_fact[9]; for (int i = 8; i >= 0; --i) p = add(mul(p, t), K.inv_fact[static_cast<unsigned>(i)]);
# code: exp_dd.cpp: for (int s = 0; s < 10; ++s) p = mul(p, p);
# code: exp_dd.cpp: return scale2(p, static_cast<int>(k));
# code: dd.hpp: inline DD scale2(DD x, int k) { return {std::ldexp(x.hi, k), std::ldexp(x.lo, k)}; }
C0 = @coef_0_hi@ + @coef_0_lo@;
C1 = @coef_1_hi@ + @coef_1_lo@;
C2 = @coef_2_hi@ + @coef_2_lo@;
C3 = @coef_3_hi@ + @coef_3_lo@;
C4 = @coef_4_hi@ + @coef_4_lo@;
C5 = @coef_5_hi@ + @coef_5_lo@;
C6 = @coef_6_hi@ + @coef_6_lo@;
C7 = @coef_7_hi@ + @coef_7_lo@;
C8 = @coef_8_hi@ + @coef_8_lo@;
C9 = @coef_9_hi@ + @coef_9_lo@;
t = tau * 0x1p-10;
p8 = add_rel<@prec:kAddDD@>(mul_rel<@prec:kMulDD@>(C9, t), C8 + e8);
p7 = add_rel<@prec:kAddDD@>(mul_rel<@prec:kMulDD@>(p8, t), C7 + e7);
p6 = add_rel<@prec:kAddDD@>(mul_rel<@prec:kMulDD@>(p7, t), C6 + e6);
p5 = add_rel<@prec:kAddDD@>(mul_rel<@prec:kMulDD@>(p6, t), C5 + e5);
p4 = add_rel<@prec:kAddDD@>(mul_rel<@prec:kMulDD@>(p5, t), C4 + e4);
p3 = add_rel<@prec:kAddDD@>(mul_rel<@prec:kMulDD@>(p4, t), C3 + e3);
p2 = add_rel<@prec:kAddDD@>(mul_rel<@prec:kMulDD@>(p3, t), C2 + e2);
p1 = add_rel<@prec:kAddDD@>(mul_rel<@prec:kMulDD@>(p2, t), C1 + e1);
p0 = add_rel<@prec:kAddDD@>(mul_rel<@prec:kMulDD@>(p1, t), C0 + e0);
P8 = C9 * t + (C8 + 0);
P7 = P8 * t + (C7 + 0);
P6 = P7 * t + (C6 + 0);
P5 = P6 * t + (C5 + 0);
P4 = P5 * t + (C4 + 0);
P3 = P4 * t + (C3 + 0);
P2 = P3 * t + (C2 + 0);
P1 = P2 * t + (C1 + 0);
P0 = P1 * t + (C0 + 0);
q1 = mul_rel<@prec:kMulDD@>(p0, p0);
q2 = mul_rel<@prec:kMulDD@>(q1, q1);
q3 = mul_rel<@prec:kMulDD@>(q2, q2);
q4 = mul_rel<@prec:kMulDD@>(q3, q3);
q5 = mul_rel<@prec:kMulDD@>(q4, q4);
q6 = mul_rel<@prec:kMulDD@>(q5, q5);
q7 = mul_rel<@prec:kMulDD@>(q6, q6);
q8 = mul_rel<@prec:kMulDD@>(q7, q7);
q9 = mul_rel<@prec:kMulDD@>(q8, q8);
q10 = mul_rel<@prec:kMulDD@>(q9, q9);
E1 = Et * Et;
E2 = E1 * E1;
E3 = E2 * E2;
E4 = E3 * E3;
E5 = E4 * E4;
E6 = E5 * E5;
E7 = E6 * E6;
E8 = E7 * E7;
E9 = E8 * E8;
E10 = E9 * E9;                   # exp(t)^1024 = exp(tau)
{ tau in [-@exp_reduced_abs@, @exp_reduced_abs@]
  /\ |e8| <= 0x1p-1073 /\ |e7| <= 0x1p-1073 /\ |e6| <= 0x1p-1073 /\ |e5| <= 0x1p-1073
  /\ |e4| <= 0x1p-1073 /\ |e3| <= 0x1p-1073 /\ |e2| <= 0x1p-1073 /\ |e1| <= 0x1p-1073
  /\ |e0| <= 0x1p-1073
  /\ P0 -/ Et in [-@exp_poly_rel@, @exp_poly_rel@]
  /\ E10 -/ ExpR in [-@exp_reduction_rel@, @exp_reduction_rel@]
  /\ res -/ q10 in [-@exp_scale_rel@, @exp_scale_rel@]
  /\ Et in [0x1.fcp-1, 0x1.03p0] /\ ExpR in [0x1.6p-1, 0x1.7p0]
  -> res -/ ExpR in [-@exp_dd_rel@, @exp_dd_rel@]
  /\ q10 in [0.7, 1.42] }
