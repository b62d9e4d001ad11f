// CPU Adam without Python, for ASan/UBSan: every SIMD path the CPU has must
// equal the scalar reference bit for bit, and a non-finite gradient must
// leave every buffer untouched.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "check.hpp"
#include "cpu/adam.hpp"
#include "cpu/crc32c.hpp"
#include "cpu/lowp.hpp"
#include "cpu/simd.hpp"

using namespace infinity::cpu;

struct State {
  std::vector<float> p, m, v, g32;
  std::vector<uint16_t> g16, out;
};

static State make_state(size_t n, unsigned seed, Dtype gdt) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  State s;
  // One spare element in front so every array is also tested misaligned.
  s.p.resize(n + 1);
  s.m.resize(n + 1);
  s.v.resize(n + 1);
  s.g32.resize(n + 1);
  s.g16.resize(n + 1);
  s.out.resize(n + 1);
  for (size_t i = 0; i <= n; ++i) {
    s.p[i] = nd(rng);
    s.m[i] = 0.1f * nd(rng);
    s.v[i] = std::fabs(0.01f * nd(rng));
    s.g32[i] = nd(rng);
    s.g16[i] = gdt == Dtype::kF16 ? f32_to_f16(s.g32[i]) : f32_to_bf16(s.g32[i]);
  }
  return s;
}

// Bit-equal, or NaN on both sides: which NaN's payload an operation passes on (when both operands are NaN)
// is up to the compiler's operand order, in the reference as in the SIMD code.
static bool same_f32(const std::vector<float>& x, const std::vector<float>& y) {
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i)
    if (std::memcmp(&x[i], &y[i], 4) != 0 && !(std::isnan(x[i]) && std::isnan(y[i]))) return false;
  return true;
}

static bool same_16(const std::vector<uint16_t>& x, const std::vector<uint16_t>& y, uint16_t inf) {
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i)
    if (x[i] != y[i] && !((x[i] & 0x7fff) > inf && (y[i] & 0x7fff) > inf)) return false;
  return true;
}

static AdamArgs args_for(State& s, size_t n, Dtype gdt, bool lowp, Dtype ldt) {
  AdamArgs a;
  a.param = s.p.data() + 1;
  a.exp_avg = s.m.data() + 1;
  a.exp_avg_sq = s.v.data() + 1;
  a.grad = gdt == Dtype::kF32 ? static_cast<const void*>(s.g32.data() + 1) : s.g16.data() + 1;
  a.grad_dtype = gdt;
  a.out_lowp = lowp ? s.out.data() + 1 : nullptr;
  a.lowp_dtype = ldt;
  a.n = n;
  a.lr = 1e-2;
  a.weight_decay = 0.1;
  return a;
}

int main() {
  SimdLevel hw = detected_simd();
  for (SimdLevel level : {SimdLevel::kAvx2, SimdLevel::kAvx512, SimdLevel::kAvx512Bf16}) {
    if (static_cast<int>(level) > static_cast<int>(hw)) {
      std::printf("skip %s: not supported by this CPU\n", simd_name(level));
      continue;
    }
    int before = g_failures;
    for (size_t n : {0ul, 1ul, 15ul, 17ul, 100003ul}) {
      for (Dtype gdt : {Dtype::kF32, Dtype::kBF16, Dtype::kF16}) {
        for (int mode = 0; mode < 4; ++mode) {
          bool lowp = mode > 0;
          Dtype ldt = mode == 2 ? Dtype::kF16 : Dtype::kBF16;
          State a = make_state(n, static_cast<unsigned>(n) + mode, gdt), b = a;
          AdamArgs x = args_for(a, n, gdt, lowp, ldt), y = args_for(b, n, gdt, lowp, ldt);
          if (mode == 3) x.adamw = y.adamw = false;
          for (int step = 1; step <= 3; ++step) {
            x.step = y.step = step;
            CHECK(!adam_step(x, level));
            CHECK(!adam_step(y, SimdLevel::kScalar));
          }
          CHECK(a.p == b.p && a.m == b.m && a.v == b.v && a.out == b.out);
        }
      }
    }
    // bf16 moments, both roundings, every copy mode: every SIMD path equals the scalar reference bit for bit.
    // The sizes cover the two-vector loop (see [Note: bf16 pairs by word permutes]), one more vector, and
    // the scalar tail. With `special`, the gradients hold NaN, inf, subnormals and values whose squares
    // overflow, and nothing checks them first: NaN moments and near-overflow roundings go through the
    // same conversions.
    for (size_t n : {1ul, 17ul, 33ul, 49ul, 100003ul}) {
      for (int cfg = 0; cfg < 6; ++cfg) {
      const int mode = cfg % 3;  // no copy, bf16 copy, fp16 copy
      const bool special = cfg >= 3;
      for (Rounding rnd : {Rounding::kNearest, Rounding::kStochastic}) {
        for (Dtype gdt : {Dtype::kF32, Dtype::kBF16}) {
          State a = make_state(n, static_cast<unsigned>(n) + 7, gdt);
          if (special) {
            const float odd[] = {std::nanf(""), -std::nanf(""), INFINITY, -INFINITY, 1e-40f, -3e-39f, 3e38f,
                                 -2e19f, 1.5e-45f, 0.0f, -0.0f};
            for (size_t i = 0; i <= n; i += 3) {
              a.g32[i] = odd[(i / 3) % (sizeof odd / sizeof odd[0])];
              a.g16[i] = f32_to_bf16(a.g32[i]);
              if (i % 2) a.m[i] = odd[(i / 2) % (sizeof odd / sizeof odd[0])];
            }
          }
          std::vector<uint16_t> am(n + 1), av(n + 1);
          for (size_t i = 0; i <= n; ++i) {
            am[i] = f32_to_bf16(a.m[i]);
            av[i] = f32_to_bf16(a.v[i]);
          }
          State b = a;
          std::vector<uint16_t> bm = am, bv = av;
          const Dtype ldt = mode == 2 ? Dtype::kF16 : Dtype::kBF16;
          AdamArgs x = args_for(a, n, gdt, mode > 0, ldt), y = args_for(b, n, gdt, mode > 0, ldt);
          x.check_finite = y.check_finite = !special;
          x.exp_avg = am.data() + 1, x.exp_avg_sq = av.data() + 1;
          y.exp_avg = bm.data() + 1, y.exp_avg_sq = bv.data() + 1;
          x.moment_dtype = y.moment_dtype = Dtype::kBF16;
          x.moment_rounding = y.moment_rounding = rnd;
          for (int step = 1; step <= 3; ++step) {
            x.step = y.step = step;
            x.moment_seed = y.moment_seed = 1000u + static_cast<uint32_t>(step);
            CHECK(!adam_step(x, level));
            CHECK(!adam_step(y, SimdLevel::kScalar));
          }
          if (!special) {
            CHECK(a.p == b.p && am == bm && av == bv && a.out == b.out);
          } else {
            CHECK(same_f32(a.p, b.p) && same_16(am, bm, 0x7f80) && same_16(av, bv, 0x7f80));
            CHECK(same_16(a.out, b.out, mode == 2 ? 0x7c00 : 0x7f80));
          }
        }
      }
      }
    }
    // 8-bit moments, both roundings, every copy mode: every SIMD path equals the scalar reference bit for bit,
    // over whole blocks, a last partial block, several threads' ranges, and (special) NaN/inf gradients.
    for (size_t n : {1ul, 255ul, 256ul, 257ul, 100003ul}) {
      for (int cfg = 0; cfg < 6; ++cfg) {
      const int mode = cfg % 3;
      const bool special = cfg >= 3;
      for (Rounding rnd : {Rounding::kNearest, Rounding::kStochastic}) {
        for (Dtype gdt : {Dtype::kF32, Dtype::kBF16}) {
          State a = make_state(n, static_cast<unsigned>(n) + 11, gdt);
          if (special) {
            const float odd[] = {std::nanf(""), INFINITY, -INFINITY, 1e-40f, 3e38f, -2e19f, 0.0f, -0.0f};
            for (size_t i = 0; i <= n; i += 5) {
              a.g32[i] = odd[(i / 5) % (sizeof odd / sizeof odd[0])];
              a.g16[i] = f32_to_bf16(a.g32[i]);
            }
          }
          const size_t blocks = (n + kMomentBlock - 1) / kMomentBlock;
          std::vector<uint8_t> am(n + 1), av(n + 1);
          std::vector<float> ams(blocks + 1, 0.0f), avs(blocks + 1, 0.0f);
          State b = a;
          std::vector<uint8_t> bm = am, bv = av;
          std::vector<float> bms = ams, bvs = avs;
          const Dtype ldt = mode == 2 ? Dtype::kF16 : Dtype::kBF16;
          AdamArgs x = args_for(a, n, gdt, mode > 0, ldt), y = args_for(b, n, gdt, mode > 0, ldt);
          x.check_finite = y.check_finite = !special;
          x.exp_avg = am.data() + 1, x.exp_avg_sq = av.data() + 1;
          y.exp_avg = bm.data() + 1, y.exp_avg_sq = bv.data() + 1;
          x.exp_avg_scale = ams.data() + 1, x.exp_avg_sq_scale = avs.data() + 1;
          y.exp_avg_scale = bms.data() + 1, y.exp_avg_sq_scale = bvs.data() + 1;
          x.moment_dtype = y.moment_dtype = Dtype::kI8;
          x.moment_rounding = y.moment_rounding = rnd;
          for (int step = 1; step <= 3; ++step) {
            x.step = y.step = step;
            x.moment_seed = y.moment_seed = 2000u + static_cast<uint32_t>(step);
            CHECK(!adam_step(x, level));
            CHECK(!adam_step(y, SimdLevel::kScalar));
          }
          CHECK(am == bm && av == bv && same_f32(ams, bms) && same_f32(avs, bvs));
          CHECK(special ? same_f32(a.p, b.p) : a.p == b.p);
          CHECK(special ? same_16(a.out, b.out, mode == 2 ? 0x7c00 : 0x7f80) : a.out == b.out);
        }
      }
      }
    }
    // The 8-bit codes: a decoded value encodes to its own code, and the block exponent's floor.
    for (uint32_t e : {16u, 100u, 127u, 200u})
      for (uint32_t c = 0; c < 256; ++c) {
        CHECK(encode8<3>(decode8<3>(c, e), e, 0, true) == (c & 0x7f ? c : c & 0x80));
        CHECK(encode8<4>(decode8<4>(c, e), e, 0, true) == c);
        CHECK(encode8<3>(decode8<3>(c, e), e, 0xffffu << 4, false) == (c & 0x7f ? c : c & 0x80));
      }
    CHECK(block_exponent(0, kExpFloorM) == 16 && block_exponent(0x3f800000u, kExpFloorM) == 127);
    CHECK(block_exponent(0, kExpFloorV) == 79 && block_exponent(0x3f800000u, kExpFloorV) == 127);
    // exp_avg_sq is stored as u = sqrt(v): for every block exponent and code, v = u * u is exact and its sqrt
    // encodes back to the code (what a checkpoint of decoded v relies on).
    for (uint32_t e = kExpFloorV; e < 191; ++e)
      for (uint32_t c = 0; c < 256; ++c) {
        const float u = decode8<4>(c, e), v = u * u;
        CHECK(std::sqrt(v) == u && encode8<4>(std::sqrt(v), e, 0, true) == c);
      }
    // A NaN deep inside a large gradient: nothing may be written.
    State s = make_state(200000, 9, Dtype::kF32);
    s.g32[150001] = std::nanf("");
    State saved = s;
    AdamArgs a = args_for(s, 200000, Dtype::kF32, true, Dtype::kBF16);
    CHECK(adam_step(a, level));
    CHECK(std::memcmp(s.p.data(), saved.p.data(), s.p.size() * 4) == 0);
    CHECK(std::memcmp(s.m.data(), saved.m.data(), s.m.size() * 4) == 0);
    CHECK(std::memcmp(s.v.data(), saved.v.data(), s.v.size() * 4) == 0);
    CHECK(s.out == saved.out);
    std::printf("%s: %s\n", simd_name(level), g_failures == before ? "ok" : "FAILED");
  }
  // The moments' nearest rounding (as VCVTNE2PS2BF16): subnormals to zero of their sign, NaN quieted with its
  // payload's top, ties to even, and no subnormal flush for the parameter copy's rounding (f32_to_bf16).
  CHECK(f32_to_bf16_flush(bits_f32(0x00400000u)) == 0x0000 && f32_to_bf16_flush(bits_f32(0x80000001u)) == 0x8000);
  CHECK(f32_to_bf16(bits_f32(0x00400000u)) == 0x0040);
  CHECK(f32_to_bf16_flush(bits_f32(0x7f810000u)) == 0x7fc1 && f32_to_bf16_flush(bits_f32(0xffc00001u)) == 0xffc0);
  CHECK(f32_to_bf16_flush(bits_f32(0x3f808000u)) == 0x3f80 && f32_to_bf16_flush(bits_f32(0x3f818000u)) == 0x3f82);
  CHECK(f32_to_bf16_flush(bits_f32(0x00800000u)) == 0x0080 && f32_to_bf16_flush(bits_f32(0x7f7fffffu)) == 0x7f80);
  // Stochastic rounding is unbiased: x = 1 + 2^-10 lies 1/8 of the way from bf16 1.0 to the next value
  // (1 + 2^-7), so about 1/8 of the hashed indices round it up.
  {
    const uint32_t u = f32_bits(1.0f + 1.0f / 1024.0f);
    size_t up = 0, n = 1 << 16;
    for (uint32_t i = 0; i < n; ++i) up += f32_to_bf16_stochastic(u, moment_bits(42u, i) & 0xffffu) != 0x3f80;
    CHECK(up > n / 8 - n / 64 && up < n / 8 + n / 64);
    size_t up_hi = 0;
    for (uint32_t i = 0; i < n; ++i) up_hi += f32_to_bf16_stochastic(u, moment_bits(42u, i) >> 16) != 0x3f80;
    CHECK(up_hi > n / 8 - n / 64 && up_hi < n / 8 + n / 64);
    CHECK(f32_to_bf16_stochastic(f32_bits(std::nanf("")), 0xffffu) == 0xffff);
    CHECK(f32_to_bf16_stochastic(0x7f800000u, 0xffffu) == 0x7f80);  // inf stays inf
    CHECK(f32_to_bf16_stochastic(0x3f800000u, 0xffffu) == 0x3f80);  // an exact value never moves
  }
  // CRC-32C: the standard check value, and hardware == table at odd offsets and lengths.
  const char* check = "123456789";
  CHECK(crc32c(check, 9) == 0xE3069283u && crc32c_portable(check, 9) == 0xE3069283u);
  std::vector<unsigned char> bytes(100003);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 2654435761u >> 13);
  for (size_t off : {0ul, 1ul, 3ul, 7ul})
    for (size_t len : {0ul, 1ul, 7ul, 8ul, 9ul, 4096ul, 12287ul, 12288ul, 12289ul, 24581ul, 99990ul})
      CHECK(crc32c(bytes.data() + off, len) == crc32c_portable(bytes.data() + off, len));
  // Chaining through the seed, across the three-lane chunks: crc(A||B) == crc(B, seed = crc(A)).
  for (size_t split : {1ul, 12288ul, 12290ul, 50000ul})
    CHECK(crc32c(bytes.data() + split, bytes.size() - split, crc32c(bytes.data(), split)) ==
          crc32c_portable(bytes.data(), bytes.size()));
  // Combining finished CRCs: crc(A||B) from crc(A), crc(B) and |B|, at splits inside and across lanes.
  for (size_t split : {0ul, 1ul, 4097ul, 12288ul, 50000ul, bytes.size()})
    CHECK(crc32c_combine(crc32c(bytes.data(), split), crc32c(bytes.data() + split, bytes.size() - split),
                         bytes.size() - split) == crc32c_portable(bytes.data(), bytes.size()));
  std::printf("%s\n", g_failures ? "adam tests FAILED" : "adam tests passed");
  return g_failures ? 1 : 0;
}
