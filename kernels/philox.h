// Philox-4x32-10 counter-based RNG (Salmon et al., SC'11), usable on host and device.
// Sampling draws u = Uniform(seed, position): the same (seed, position) gives the same number
// on every rank, batch layout and backend.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TP_HOST_DEVICE __host__ __device__
#else
#define TP_HOST_DEVICE
#endif

namespace tpserve {

TP_HOST_DEVICE inline void Philox4x32(uint32_t counter[4], uint32_t key[2]) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(kMul0) * counter[0];
    uint64_t p1 = static_cast<uint64_t>(kMul1) * counter[2];
    uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    uint32_t c0 = hi1 ^ counter[1] ^ key[0];
    uint32_t c2 = hi0 ^ counter[3] ^ key[1];
    counter[0] = c0;
    counter[1] = lo1;
    counter[2] = c2;
    counter[3] = lo0;
    key[0] += kW0;
    key[1] += kW1;
  }
}

// A uniform float in [0, 1) from (seed, position, stream).
TP_HOST_DEVICE inline float PhiloxUniform(uint64_t seed, uint64_t position, uint32_t stream = 0) {
  uint32_t counter[4] = {static_cast<uint32_t>(position), static_cast<uint32_t>(position >> 32),
                         stream, 0x74707376u};
  uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  Philox4x32(counter, key);
  // 24 random bits -> [0, 1) exactly representable in float.
  return static_cast<float>(counter[0] >> 8) * (1.0f / 16777216.0f);
}

}  // namespace tpserve
