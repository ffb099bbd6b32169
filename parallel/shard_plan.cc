// The shard planner: balanced and manual device maps, validation with messages that say what
// would work, and the per-rank head/column/vocab slices.
#include "parallel/shard_plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "common/status.h"

namespace tpserve {
namespace {

std::string FormatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) return absl::StrFormat("%.2f GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return absl::StrFormat("%.2f MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return absl::StrFormat("%.2f KiB", b / 1024.0);
  return absl::StrCat(bytes, " B");
}

std::string LayerRange(int begin, int end) {  // [begin, end) as "a-b" or "a"
  if (end - begin == 1) return absl::StrCat(begin);
  return absl::StrCat(begin, "-", end - 1);
}

// Per-GPU bytes of the pieces a stage holds, for one TP rank.
struct Costs {
  int64_t layer_weights = 0;  // one layer's weights
  int64_t layer_kv = 0;       // one layer's KV cache for the context budget
  int64_t first_extra = 0;    // embedding rows (first stage)
  int64_t last_extra = 0;     // final norm + lm_head rows (last stage)
  int64_t context_tokens = 0;
  int64_t layer() const { return layer_weights + layer_kv; }
};

Costs ComputeCosts(const ModelConfig& c, int tp, bool kv_replicated, int64_t vocab_padded, int pp,
                   int64_t bytes_per_elem, int64_t context_tokens) {
  const int64_t q = c.num_heads / tp * c.head_dim;
  const int64_t kv = (kv_replicated ? 1 : c.num_kv_heads / tp) * c.head_dim;
  const int64_t inter = c.intermediate_size / tp;
  const int64_t h = c.hidden_size;
  int64_t n = 2 * h * q + 2 * h * kv;  // q, o; k, v
  if (c.attention_bias) n += q + 2 * kv;
  if (c.o_proj_bias) n += h;
  n += 3 * h * inter;
  if (c.mlp_bias) n += 2 * inter + h;
  n += 2 * h;  // input and post-attention norms
  Costs costs;
  costs.context_tokens = context_tokens;
  costs.layer_weights = n * bytes_per_elem;
  costs.layer_kv = 2 * kv * context_tokens * bytes_per_elem;
  const int64_t vocab_rows = vocab_padded / tp * h * bytes_per_elem;
  costs.first_extra = vocab_rows;
  // A tied lm_head shares the embedding when both sit on one stage.
  costs.last_extra = h * bytes_per_elem + ((c.tie_word_embeddings && pp == 1) ? 0 : vocab_rows);
  return costs;
}

int64_t StageBytes(const Costs& costs, int stage, int pp, int num_layers) {
  int64_t b = num_layers * costs.layer();
  if (stage == 0) b += costs.first_extra;
  if (stage == pp - 1) b += costs.last_extra;
  return b;
}

// Splits `num_layers` uniform layers into `pp` non-empty contiguous ranges minimizing the
// largest load / free ratio; among those, the sum of squared ratios (so the remaining stages
// stay even too). Returns stage_layer_begin and the largest ratio.
std::pair<std::vector<int>, double> BalanceLayers(const Costs& costs, int pp, int num_layers,
                                                  const std::vector<int64_t>& free) {
  auto ratio = [&](int stage, int n) {
    const double f = free.empty() ? 1.0 : static_cast<double>(free[stage]);
    return static_cast<double>(StageBytes(costs, stage, pp, n)) / f;
  };
  const double kInf = std::numeric_limits<double>::infinity();
  const int L = num_layers;
  // best[s][j]: smallest max ratio placing layers [0, j) on stages [0, s).
  std::vector<std::vector<double>> best(pp + 1, std::vector<double>(L + 1, kInf));
  best[0][0] = 0;
  for (int s = 1; s <= pp; ++s) {
    for (int j = s; j <= L; ++j) {
      for (int i = s - 1; i < j; ++i) {
        if (best[s - 1][i] == kInf) continue;
        best[s][j] = std::min(best[s][j], std::max(best[s - 1][i], ratio(s - 1, j - i)));
      }
    }
  }
  const double max_ratio = best[pp][L];
  const double cap = max_ratio * (1 + 1e-12);
  // Second pass: smallest sum of squares with every stage under the optimal maximum.
  std::vector<std::vector<double>> sq(pp + 1, std::vector<double>(L + 1, kInf));
  std::vector<std::vector<int>> from(pp + 1, std::vector<int>(L + 1, -1));
  sq[0][0] = 0;
  for (int s = 1; s <= pp; ++s) {
    for (int j = s; j <= L; ++j) {
      for (int i = s - 1; i < j; ++i) {
        if (sq[s - 1][i] == kInf) continue;
        const double r = ratio(s - 1, j - i);
        if (r > cap) continue;
        const double v = sq[s - 1][i] + r * r;
        if (v < sq[s][j] * (1 - 1e-15)) {
          sq[s][j] = v;
          from[s][j] = i;
        }
      }
    }
  }
  std::vector<int> begin(pp + 1);
  begin[pp] = L;
  for (int s = pp, j = L; s > 0; --s) {
    j = from[s][j];
    TP_CHECK(j >= 0) << "balancing failed";
    begin[s - 1] = j;
  }
  return {begin, max_ratio};
}

absl::Status CheckTp(const ModelConfig& config, int tp) {
  auto what_works = [&] {
    return absl::StrCat("; tp values that work for this model: ",
                        absl::StrJoin(ValidTpValues(config), ", "));
  };
  if (config.num_heads % tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tp=", tp, " does not divide the ", config.num_heads, " attention heads", what_works()));
  }
  if (config.intermediate_size % tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tp=", tp,
                                                   " does not divide the MLP intermediate_size ",
                                                   config.intermediate_size, what_works()));
  }
  if (config.num_kv_heads % tp != 0 && tp % config.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tp=", tp, " neither divides the ", config.num_kv_heads,
        " KV heads nor is a multiple of them (needed to replicate KV heads)", what_works()));
  }
  return absl::OkStatus();
}

// Stage bytes of a plan and, when free memory is known, an error naming the first stage that
// does not fit.
absl::Status CheckFit(const Costs& costs, const ShardPlan& plan, const std::vector<int64_t>& free) {
  if (free.empty()) return absl::OkStatus();
  for (int s = 0; s < plan.pp; ++s) {
    if (plan.stage_bytes[s] <= free[s]) continue;
    const int n = plan.num_layers(s);
    std::string extras;
    if (s == 0) absl::StrAppend(&extras, " + embedding ", FormatBytes(costs.first_extra));
    if (s == plan.pp - 1) {
      absl::StrAppend(&extras, " + final norm and lm_head ", FormatBytes(costs.last_extra));
    }
    return absl::ResourceExhaustedError(
        absl::StrCat("stage ", s, " (layers ",
                     LayerRange(plan.stage_layer_begin[s], plan.stage_layer_begin[s + 1]),
                     ") needs ", FormatBytes(plan.stage_bytes[s]), " per GPU (", n,
                     " layers x (weights ", FormatBytes(costs.layer_weights), " + KV cache for ",
                     costs.context_tokens, " tokens ", FormatBytes(costs.layer_kv), ")", extras,
                     ") but its GPUs have ", FormatBytes(free[s]), " free"));
  }
  return absl::OkStatus();
}

struct Resolved {
  int64_t vocab_padded;
  bool kv_replicated;
  int64_t context_tokens;
};

Resolved Resolve(const ModelConfig& config, int tp, const PlanOptions& options) {
  Resolved r;
  r.vocab_padded = (config.vocab_size + tp - 1) / tp * tp;
  r.kv_replicated = config.num_kv_heads % tp != 0;
  r.context_tokens =
      options.context_tokens > 0 ? options.context_tokens : config.max_position_embeddings;
  return r;
}

// Would a balanced plan with (tp, pp) fit when every stage has `free` bytes per GPU, with
// `context_tokens` of KV?
bool BalancedFits(const ModelConfig& config, int tp, int pp, int64_t context_tokens,
                  int64_t bytes_per_elem, const std::vector<int64_t>& free) {
  const bool kv_replicated = config.num_kv_heads % tp != 0;
  const int64_t vocab_padded = (config.vocab_size + tp - 1) / tp * tp;
  Costs costs =
      ComputeCosts(config, tp, kv_replicated, vocab_padded, pp, bytes_per_elem, context_tokens);
  return BalanceLayers(costs, pp, static_cast<int>(config.num_layers), free).second <= 1.0;
}

// What would fit instead: a larger pp or tp (every GPU with the smallest free memory given), or
// a smaller context budget with the same layout.
std::string FitSuggestions(const ModelConfig& config, const PlanOptions& options, const Resolved& r,
                           const std::vector<int>* manual_begin) {
  std::vector<std::string> options_that_fit;
  const int64_t min_free =
      *std::min_element(options.stage_free_bytes.begin(), options.stage_free_bytes.end());
  for (int pp = options.pp + 1; pp <= config.num_layers; ++pp) {
    if (BalancedFits(config, options.tp, pp, r.context_tokens, options.bytes_per_elem,
                     std::vector<int64_t>(pp, min_free))) {
      options_that_fit.push_back(absl::StrCat("pp=", pp, " (tp=", options.tp, ")"));
      break;
    }
  }
  for (int tp : ValidTpValues(config)) {
    if (tp <= options.tp) continue;
    if (BalancedFits(config, tp, options.pp, r.context_tokens, options.bytes_per_elem,
                     options.stage_free_bytes)) {
      options_that_fit.push_back(absl::StrCat("tp=", tp, " (pp=", options.pp, ")"));
      break;
    }
  }
  // Largest context budget that fits with this tp and pp (and the manual map if any).
  auto fits_with_context = [&](int64_t ctx) {
    Costs costs = ComputeCosts(config, options.tp, r.kv_replicated, r.vocab_padded, options.pp,
                               options.bytes_per_elem, ctx);
    if (manual_begin == nullptr) {
      return BalanceLayers(costs, options.pp, static_cast<int>(config.num_layers),
                           options.stage_free_bytes)
                 .second <= 1.0;
    }
    for (int s = 0; s < options.pp; ++s) {
      const int n = (*manual_begin)[s + 1] - (*manual_begin)[s];
      if (StageBytes(costs, s, options.pp, n) > options.stage_free_bytes[s]) return false;
    }
    return true;
  };
  if (fits_with_context(1)) {
    int64_t lo = 1, hi = r.context_tokens;  // fits(lo), !fits(hi)
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (fits_with_context(mid) ? lo : hi) = mid;
    }
    options_that_fit.push_back(absl::StrCat("a context budget of at most ", lo, " tokens"));
  }
  if (manual_begin != nullptr && BalancedFits(config, options.tp, options.pp, r.context_tokens,
                                              options.bytes_per_elem, options.stage_free_bytes)) {
    Costs costs = ComputeCosts(config, options.tp, r.kv_replicated, r.vocab_padded, options.pp,
                               options.bytes_per_elem, r.context_tokens);
    ShardPlan balanced;
    balanced.pp = options.pp;
    balanced.stage_layer_begin =
        BalanceLayers(costs, options.pp, static_cast<int>(config.num_layers),
                      options.stage_free_bytes)
            .first;
    options_that_fit.insert(options_that_fit.begin(),
                            absl::StrCat("the balanced device map ", balanced.DeviceMapString()));
  }
  if (options_that_fit.empty()) {
    return "; no larger tp or pp on GPUs of this size fits it";
  }
  return absl::StrCat("; it would fit with ", absl::StrJoin(options_that_fit, ", or "));
}

}  // namespace

std::vector<int64_t> StageFreeBytes(const std::vector<RankMemory>& ranks, int tp, int pp,
                                    double gpu_memory_utilization) {
  if (tp <= 0 || pp <= 0 || static_cast<int64_t>(ranks.size()) != int64_t{tp} * pp) return {};
  auto device_key = [](const RankMemory& m) {
    return absl::StrCat(m.hostname, m.cuda ? "/gpu" : "/host", m.cuda ? m.gpu_index : -1);
  };
  std::map<std::string, int> sharing;
  for (const RankMemory& m : ranks) {
    if (m.free_bytes <= 0) return {};
    ++sharing[device_key(m)];
  }
  std::vector<int64_t> stage(pp, std::numeric_limits<int64_t>::max());
  for (size_t r = 0; r < ranks.size(); ++r) {
    const RankMemory& m = ranks[r];
    int64_t usable = m.free_bytes;
    if (m.total_bytes > 0) {
      usable -= std::llround((1.0 - gpu_memory_utilization) * static_cast<double>(m.total_bytes));
    }
    usable = std::max<int64_t>(usable, 0) / sharing[device_key(m)];
    int64_t& s = stage[r / static_cast<size_t>(tp)];
    s = std::min(s, usable);
  }
  return stage;
}

std::vector<int> ValidTpValues(const ModelConfig& config) {
  std::vector<int> out;
  for (int64_t t = 1; t <= config.num_heads; ++t) {
    if (config.num_heads % t != 0 || config.intermediate_size % t != 0) continue;
    if (config.num_kv_heads % t != 0 && t % config.num_kv_heads != 0) continue;
    out.push_back(static_cast<int>(t));
  }
  return out;
}

RankShard ShardPlan::ForRank(const ModelConfig& config, int rank) const {
  TP_CHECK(rank >= 0 && rank < world_size()) << "rank " << rank << " of " << world_size();
  RankShard s;
  s.rank = rank;
  s.tp_rank = rank % tp;
  s.stage = rank / tp;
  s.layer_begin = stage_layer_begin[s.stage];
  s.layer_end = stage_layer_begin[s.stage + 1];
  s.last_stage = s.stage == pp - 1;
  s.num_q_heads = static_cast<int>(config.num_heads / tp);
  s.q_head_begin = s.tp_rank * s.num_q_heads;
  if (kv_replicated) {
    // Each rank's q heads fall inside one KV group: it keeps that one KV head.
    int64_t group = config.num_heads / config.num_kv_heads;
    s.num_kv_heads = 1;
    s.kv_head_begin = static_cast<int>(s.q_head_begin / group);
  } else {
    s.num_kv_heads = static_cast<int>(config.num_kv_heads / tp);
    s.kv_head_begin = s.tp_rank * s.num_kv_heads;
  }
  s.intermediate_size = config.intermediate_size / tp;
  s.intermediate_begin = s.tp_rank * s.intermediate_size;
  s.vocab_shard = vocab_padded / tp;
  s.vocab_begin = s.tp_rank * s.vocab_shard;
  return s;
}

std::string ShardPlan::DeviceMapString() const {
  std::vector<std::string> parts;
  for (int s = 0; s < pp; ++s) {
    parts.push_back(absl::StrCat(stage_layer_begin[s], "-", stage_layer_begin[s + 1] - 1, ":", s));
  }
  return absl::StrJoin(parts, ",");
}

absl::StatusOr<std::vector<int>> ParseDeviceMap(const std::string& map, int64_t num_layers,
                                                int pp) {
  const std::string where = absl::StrCat("device map '", map, "'");
  std::vector<int> owner(num_layers, -1);  // stage of each layer
  std::vector<absl::string_view> entries = absl::StrSplit(map, ',');
  for (size_t e = 0; e < entries.size(); ++e) {
    absl::string_view entry = absl::StripAsciiWhitespace(entries[e]);
    auto bad_entry = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": entry ", e + 1, " '", entry, "' ", why,
                       " (expected 'first-last:stage' or 'layer:stage', e.g. '0-15:0,16-31:1')"));
    };
    std::vector<absl::string_view> ls = absl::StrSplit(entry, ':');
    if (ls.size() != 2) return bad_entry("needs exactly one ':'");
    std::vector<absl::string_view> range = absl::StrSplit(ls[0], '-');
    int64_t first = 0, last = 0, stage = 0;
    if (range.size() > 2 || !absl::SimpleAtoi(range[0], &first) ||
        !absl::SimpleAtoi(range.back(), &last)) {
      return bad_entry("has no valid layer range");
    }
    if (!absl::SimpleAtoi(ls[1], &stage)) return bad_entry("has no valid stage number");
    if (first < 0 || last < first) {
      return bad_entry("has an empty or negative layer range");
    }
    if (last >= num_layers) {
      return bad_entry(absl::StrCat("names layer ", last, " but the model has ", num_layers,
                                    " layers (0-", num_layers - 1, ")"));
    }
    if (stage < 0 || stage >= pp) {
      return bad_entry(absl::StrCat("names stage ", stage, " but pp=", pp, " (stages 0-", pp - 1,
                                    "); set pp to the number of stages in the map"));
    }
    for (int64_t l = first; l <= last; ++l) {
      if (owner[l] >= 0) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": layer ", l,
                                                       " is assigned twice (to stage ", owner[l],
                                                       " and to stage ", stage, ")"));
      }
      owner[l] = static_cast<int>(stage);
    }
  }
  // Unassigned layers, reported as ranges.
  std::vector<std::string> missing;
  for (int64_t l = 0; l < num_layers;) {
    if (owner[l] >= 0) {
      ++l;
      continue;
    }
    int64_t end = l;
    while (end < num_layers && owner[end] < 0) ++end;
    missing.push_back(LayerRange(static_cast<int>(l), static_cast<int>(end)));
    l = end;
  }
  if (!missing.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": layers ", absl::StrJoin(missing, ", "),
                                                   " are not assigned to any stage"));
  }
  std::vector<int> first_layer(pp, -1), last_layer(pp, -1), count(pp, 0);
  for (int l = 0; l < num_layers; ++l) {
    const int s = owner[l];
    if (first_layer[s] < 0) first_layer[s] = l;
    last_layer[s] = l;
    ++count[s];
  }
  for (int s = 0; s < pp; ++s) {
    if (count[s] == 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": stage ", s,
                                                     " has no layers; each of the pp=", pp,
                                                     " stages needs at least one"));
    }
    if (last_layer[s] - first_layer[s] + 1 != count[s]) {
      std::vector<std::string> ranges;
      for (int l = first_layer[s]; l <= last_layer[s];) {
        if (owner[l] != s) {
          ++l;
          continue;
        }
        int end = l;
        while (end <= last_layer[s] && owner[end] == s) ++end;
        ranges.push_back(LayerRange(l, end));
        l = end;
      }
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": stage ", s, " owns layers ", absl::StrJoin(ranges, " and "),
          ", which are not contiguous; each stage owns one range of consecutive layers"));
    }
  }
  std::vector<int> begin(pp + 1);
  for (int s = 0; s < pp; ++s) {
    if (s > 0 && first_layer[s] != last_layer[s - 1] + 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": stage ", s, " owns layers ", LayerRange(first_layer[s], last_layer[s] + 1),
          " but stage ", s - 1, " owns ", LayerRange(first_layer[s - 1], last_layer[s - 1] + 1),
          "; activations flow from stage 0 to stage ", pp - 1,
          ", so stage s must own the layers right after stage s-1"));
    }
    begin[s] = first_layer[s];
  }
  begin[pp] = static_cast<int>(num_layers);
  return begin;
}

absl::StatusOr<ShardPlan> PlanShards(const ModelConfig& config, const PlanOptions& options) {
  ShardPlan plan;
  plan.tp = options.tp;
  plan.pp = options.pp;
  if (plan.tp < 1 || plan.pp < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tp and pp must be at least 1 (got tp=", plan.tp, ", pp=", plan.pp, ")"));
  }
  if (config.num_layers < 1 || config.num_heads < 1 || config.num_kv_heads < 1 ||
      config.vocab_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model config has no layers, heads, KV heads or vocabulary (num_hidden_layers=",
        config.num_layers, ", num_attention_heads=", config.num_heads,
        ", num_key_value_heads=", config.num_kv_heads, ", vocab_size=", config.vocab_size, ")"));
  }
  if (options.bytes_per_elem < 1 || options.context_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("bytes_per_elem (", options.bytes_per_elem,
                                                   ") must be >= 1 and context_tokens (",
                                                   options.context_tokens, ") >= 0"));
  }
  if (absl::Status s = CheckTp(config, plan.tp); !s.ok()) return s;
  if (plan.pp > config.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pp=", plan.pp, " stages but the model has only ", config.num_layers,
        " layers (each stage needs at least one); use pp between 1 and ", config.num_layers));
  }
  const std::vector<int64_t>& free = options.stage_free_bytes;
  if (!free.empty()) {
    if (static_cast<int>(free.size()) != plan.pp) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stage_free_bytes has ", free.size(), " entries but pp=", plan.pp, " (one per stage)"));
    }
    for (int s = 0; s < plan.pp; ++s) {
      if (free[s] <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("stage ", s, " reports no free GPU memory (", free[s], " bytes)"));
      }
    }
  }

  const Resolved r = Resolve(config, plan.tp, options);
  plan.vocab_padded = r.vocab_padded;
  plan.kv_replicated = r.kv_replicated;
  if (plan.kv_replicated) {
    plan.notes.push_back(absl::StrCat("tp=", plan.tp, " exceeds the ", config.num_kv_heads,
                                      " KV heads: each KV head is replicated on ",
                                      plan.tp / config.num_kv_heads, " TP ranks"));
  }
  if (plan.vocab_padded != config.vocab_size) {
    plan.notes.push_back(absl::StrCat("vocab ", config.vocab_size, " padded to ", plan.vocab_padded,
                                      " rows so that tp=", plan.tp,
                                      " divides it (padding rows are zero, their logits ignored)"));
  }
  const Costs costs = ComputeCosts(config, plan.tp, r.kv_replicated, r.vocab_padded, plan.pp,
                                   options.bytes_per_elem, r.context_tokens);
  const bool manual = !options.device_map.empty();
  if (manual) {
    TP_ASSIGN_OR_RETURN(plan.stage_layer_begin,
                        ParseDeviceMap(options.device_map, config.num_layers, plan.pp));
  } else {
    plan.stage_layer_begin =
        BalanceLayers(costs, plan.pp, static_cast<int>(config.num_layers), free).first;
  }
  for (int s = 0; s < plan.pp; ++s) {
    plan.stage_bytes.push_back(StageBytes(costs, s, plan.pp, plan.num_layers(s)));
  }
  if (absl::Status fit = CheckFit(costs, plan, free); !fit.ok()) {
    const std::string how = manual ? absl::StrCat("device map ", options.device_map)
                                   : std::string("balanced device map ") + plan.DeviceMapString();
    return absl::ResourceExhaustedError(absl::StrCat(
        "the model does not fit with tp=", plan.tp, ", pp=", plan.pp, " and ", how, ": ",
        fit.message(),
        FitSuggestions(config, options, r, manual ? &plan.stage_layer_begin : nullptr)));
  }
  return plan;
}

}  // namespace tpserve
