// Shared pieces of the ops interface: batch metadata helpers and RoPE frequencies.
#include "kernels/ops.h"

#include <algorithm>
#include <cmath>

namespace tpserve {

int BatchMeta::max_query_len() const {
  int m = 0;
  for (int s = 0; s < num_seqs; ++s) m = std::max(m, query_start[s + 1] - query_start[s]);
  return m;
}

int BatchMeta::max_context_len() const {
  int m = 0;
  for (int s = 0; s < num_seqs; ++s) m = std::max(m, context_lens[s]);
  return m;
}

std::vector<float> RopeInvFreq(const RopeConfig& rope, int head_dim) {
  // As transformers' rope init functions: inv_freq = 1 / base^(2i/d), computed in fp32.
  std::vector<float> inv(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) {
    float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv[i] = 1.0f / std::pow(static_cast<float>(rope.theta), exponent);
  }
  if (rope.scaling == RopeScalingType::kLinear) {
    for (float& f : inv) f /= static_cast<float>(rope.factor);
  } else if (rope.scaling == RopeScalingType::kLlama3) {
    // _compute_llama3_parameters: long wavelengths scaled by factor, short kept, smooth between.
    const double low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor;
    const double high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor;
    for (float& f : inv) {
      double wavelen = 2 * M_PI / f;
      if (wavelen > low_freq_wavelen) {
        f = static_cast<float>(f / rope.factor);
      } else if (wavelen >= high_freq_wavelen) {
        double smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) /
                        (rope.high_freq_factor - rope.low_freq_factor);
        f = static_cast<float>((1 - smooth) * f / rope.factor + smooth * f);
      }
    }
  }
  return inv;
}

}  // namespace tpserve
