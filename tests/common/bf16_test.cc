// bf16 / fp16 <-> fp32 conversions: exact values, rounding to nearest even, specials, and
// agreement with the safetensors element converter.
#include "common/bf16.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/safetensors.h"
#include "gtest/gtest.h"

namespace tpserve {
namespace {

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

TEST(Bf16Test, ExactValuesRoundTrip) {
  for (float v : {0.0f, 1.0f, -1.0f, 0.5f, 3.0f, -2.25f, 65536.0f, std::ldexp(1.0f, 100),
                  -std::ldexp(1.0f, -100), 1.5f * std::ldexp(1.0f, -130) /* subnormal */}) {
    EXPECT_EQ(Bf16ToF32(F32ToBf16(v)), v) << v;
  }
  EXPECT_EQ(F32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(F32ToBf16(-2.25f), 0xc010);
  EXPECT_EQ(Bits(Bf16ToF32(F32ToBf16(-0.0f))), 0x80000000u);
}

TEST(Bf16Test, RoundsToNearestEven) {
  // 1 + 2^-8 is exactly between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(F32ToBf16(FromBits(0x3f808000u)), 0x3f80);
  // 1.0078125 + half ulp: tie, rounds to even 0x3f82.
  EXPECT_EQ(F32ToBf16(FromBits(0x3f818000u)), 0x3f82);
  // Just above the tie rounds up.
  EXPECT_EQ(F32ToBf16(FromBits(0x3f808001u)), 0x3f81);
  // Just below rounds down.
  EXPECT_EQ(F32ToBf16(FromBits(0x3f807fffu)), 0x3f80);
}

TEST(Bf16Test, Specials) {
  EXPECT_TRUE(std::isinf(Bf16ToF32(F32ToBf16(std::numeric_limits<float>::infinity()))));
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload lives only in the low 16 bits must stay NaN (not become inf).
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(FromBits(0x7f800001u)))));
  // The largest finite float rounds to infinity in bf16.
  EXPECT_TRUE(std::isinf(Bf16ToF32(F32ToBf16(std::numeric_limits<float>::max()))));
}

TEST(Bf16Test, RelativeErrorBound) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 10.0f);
  for (int i = 0; i < 100000; ++i) {
    float v = dist(rng);
    float r = Bf16ToF32(F32ToBf16(v));
    EXPECT_LE(std::fabs(r - v), std::fabs(v) * (1.0f / 256.0f)) << v;
  }
}

TEST(F16Test, ExactValues) {
  EXPECT_EQ(F32ToF16(1.0f), 0x3c00);
  EXPECT_EQ(F32ToF16(-2.0f), 0xc000);
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bff);
  EXPECT_EQ(F16ToF32(0x3c00), 1.0f);
  EXPECT_EQ(F16ToF32(0x7bff), 65504.0f);
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(F16ToF32(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(Bits(F16ToF32(0x8000)), 0x80000000u);
}

TEST(F16Test, AllHalfValuesRoundTrip) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = F16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(f)))) << h;
      continue;
    }
    EXPECT_EQ(F32ToF16(f), h) << std::hex << h;
  }
}

TEST(F16Test, OverflowUnderflowAndTies) {
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);  // rounds up to infinity
  EXPECT_EQ(F32ToF16(65519.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(1e-10f), 0x0000);
  EXPECT_EQ(F32ToF16(-1e-10f), 0x8000);
  // 1 + 2^-11 ties to even (1.0); 1 + 3*2^-11 ties to 1 + 2^-9.
  EXPECT_EQ(F32ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(F32ToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_TRUE(std::isinf(F16ToF32(F32ToF16(std::numeric_limits<float>::infinity()))));
}

TEST(ConvertElementsTest, MatchesScalarConversions) {
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  const int n = 1001;
  std::vector<float> f32(n);
  for (float& v : f32) v = dist(rng);
  std::vector<uint16_t> bf16(n), f16(n);
  ASSERT_TRUE(ConvertElements(DType::kF32, f32.data(), DType::kBF16, bf16.data(), n).ok());
  ASSERT_TRUE(ConvertElements(DType::kF32, f32.data(), DType::kF16, f16.data(), n).ok());
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(bf16[i], F32ToBf16(f32[i]));
    EXPECT_EQ(f16[i], F32ToF16(f32[i]));
  }
  std::vector<float> back(n);
  ASSERT_TRUE(ConvertElements(DType::kBF16, bf16.data(), DType::kF32, back.data(), n).ok());
  for (int i = 0; i < n; ++i) EXPECT_EQ(back[i], Bf16ToF32(bf16[i]));
  ASSERT_TRUE(ConvertElements(DType::kF16, f16.data(), DType::kF32, back.data(), n).ok());
  for (int i = 0; i < n; ++i) EXPECT_EQ(back[i], F16ToF32(f16[i]));
  std::vector<uint16_t> cross(n);
  ASSERT_TRUE(ConvertElements(DType::kF16, f16.data(), DType::kBF16, cross.data(), n).ok());
  for (int i = 0; i < n; ++i) EXPECT_EQ(cross[i], F32ToBf16(F16ToF32(f16[i])));
  // Unaligned source.
  std::vector<char> raw(n * 4 + 1);
  std::memcpy(raw.data() + 1, f32.data(), n * 4);
  ASSERT_TRUE(ConvertElements(DType::kF32, raw.data() + 1, DType::kF32, back.data(), n).ok());
  EXPECT_EQ(back, f32);
  EXPECT_FALSE(ConvertElements(DType::kI32, f32.data(), DType::kF32, back.data(), 1).ok());
}

}  // namespace
}  // namespace tpserve
