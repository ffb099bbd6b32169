// The LLaMA forward pass over the ops interface (see model.h).
#include "worker/model.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/model_files.h"
#include "common/status.h"

namespace tpserve {

struct LlamaModel::Layer {
  Tensor input_norm, post_norm;
  Tensor wq, wk, wv;  // views into one fused [q + k + v rows, hidden] buffer
  Tensor bq, bk, bv;  // views into one fused bias buffer (when attention_bias)
  Tensor wo, bo;      // bo only on tp rank 0 (row-parallel bias is added once)
  Tensor w_gate_up;   // [2 * intermediate_local, hidden]: gate rows then up rows
  Tensor w_down;      // [hidden, intermediate_local]
  bool has_qkv_bias = false, has_o_bias = false;
};

namespace {

enum ActIndex {
  kResidual,
  kNormed,
  kQ,
  kK,
  kV,
  kAttn,
  kProj,  // o_proj output, then down_proj output
  kGateUp,
  kMlpAct,
  kLastRows,
  kLastNormed,
  kLogitsLocal,
  kLogitsGathered,
  kLogits,
  kNumActs,
};

}  // namespace

LlamaModel::LlamaModel(const ModelConfig& config, const ShardPlan& plan, int rank, Ops* ops,
                       ParallelContext comms, const ModelOptions& options)
    : config_(config),
      plan_(plan),
      shard_(plan.ForRank(config, rank)),
      ops_(ops),
      comms_(comms),
      options_(options) {}

LlamaModel::~LlamaModel() = default;

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const ModelFiles& files,
                                                             const ShardPlan& plan, int rank,
                                                             Ops* ops, ParallelContext comms,
                                                             const ModelOptions& options) {
  const ModelConfig& config = files.config();
  if (config.mlp_bias) {
    return absl::UnimplementedError("mlp_bias=true models are not supported yet");
  }
  if (config.sliding_window > 0 && config.sliding_window < config.max_position_embeddings) {
    return absl::UnimplementedError(
        absl::StrCat("sliding-window attention (sliding_window=", config.sliding_window,
                     ") is not supported yet; the model attends over its whole context"));
  }
  if (ops->device() == Device::kCuda && config.head_dim != 64 && config.head_dim != 128) {
    // The CUDA attention kernels are instantiated for these head sizes only.
    return absl::UnimplementedError(
        absl::StrCat("the CUDA attention kernels support head_dim 64 or 128; this model has ",
                     config.head_dim, " (run it with --device cpu)"));
  }
  if (rank < 0 || rank >= plan.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " outside the plan's ", plan.world_size(), " ranks"));
  }
  if (comms.tp == nullptr || comms.pp == nullptr || comms.tp->size() != plan.tp ||
      comms.pp->size() != plan.pp) {
    return absl::InvalidArgumentError("communicators do not match the shard plan's tp x pp grid");
  }
  std::unique_ptr<LlamaModel> model(new LlamaModel(config, plan, rank, ops, comms, options));
  TP_RETURN_IF_ERROR(model->LoadWeights(files));
  model->AllocateActivations();
  return model;
}

absl::Status LlamaModel::LoadWeights(const ModelFiles& files) {
  const DType dt = ops_->compute_dtype();
  const int64_t hidden = config_.hidden_size, d = config_.head_dim;
  const int64_t q_rows = shard_.num_q_heads * d, kv_rows = shard_.num_kv_heads * d;
  const int64_t inter = config_.intermediate_size, inter_local = shard_.intermediate_size;
  const int64_t vocab = config_.vocab_size;
  std::vector<char> staging;

  // Allocates a device tensor of `shape` and fills it through `read(host_dst)`.
  auto make = [&](std::initializer_list<int64_t> shape, auto&& read) -> absl::StatusOr<Tensor> {
    Tensor t(nullptr, shape, dt, ops_->device());
    weight_buffers_.emplace_back(ops_, t.bytes());
    t.data = weight_buffers_.back().get();
    weight_bytes_ += t.bytes();
    void* host = t.data;
    if (ops_->device() != Device::kCpu) {
      staging.assign(t.bytes(), 0);
      host = staging.data();
    } else {
      std::memset(host, 0, t.bytes());
    }
    TP_RETURN_IF_ERROR(read(static_cast<char*>(host)));
    if (ops_->device() != Device::kCpu) ops_->CopyToDevice(t.data, host, t.bytes());
    return t;
  };
  auto whole = [&](const std::string& name, std::vector<int64_t> shape) {
    return [&files, name, shape, dt](char* dst) { return files.Read(name, shape, dt, dst); };
  };
  // Vocab rows [vocab_begin, +vocab_shard); rows past the real vocabulary stay zero.
  auto vocab_rows = [&](const std::string& name) {
    return [&, name](char* dst) -> absl::Status {
      const int64_t begin = shard_.vocab_begin;
      const int64_t count = std::max<int64_t>(0, std::min(shard_.vocab_shard, vocab - begin));
      if (count == 0) return absl::OkStatus();
      return files.ReadRows(name, {vocab, hidden}, begin, count, dt, dst);
    };
  };

  if (shard_.first_stage()) {
    TP_ASSIGN_OR_RETURN(
        embed_, make({shard_.vocab_shard, hidden}, vocab_rows("model.embed_tokens.weight")));
  }
  if (shard_.last_stage) {
    TP_ASSIGN_OR_RETURN(final_norm_, make({hidden}, whole("model.norm.weight", {hidden})));
    const std::string head =
        config_.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    TP_ASSIGN_OR_RETURN(lm_head_, make({shard_.vocab_shard, hidden}, vocab_rows(head)));
  }

  const size_t esize = DTypeSize(dt);
  for (int l = shard_.layer_begin; l < shard_.layer_end; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    Layer layer;
    TP_ASSIGN_OR_RETURN(layer.input_norm,
                        make({hidden}, whole(p + "input_layernorm.weight", {hidden})));
    TP_ASSIGN_OR_RETURN(layer.post_norm,
                        make({hidden}, whole(p + "post_attention_layernorm.weight", {hidden})));
    const int64_t q_full = config_.num_heads * d, kv_full = config_.num_kv_heads * d;
    const int64_t q_begin = shard_.q_head_begin * d, kv_begin = shard_.kv_head_begin * d;
    Tensor qkv;
    TP_ASSIGN_OR_RETURN(
        qkv, make({q_rows + 2 * kv_rows, hidden}, [&](char* dst) -> absl::Status {
          TP_RETURN_IF_ERROR(files.ReadRows(p + "self_attn.q_proj.weight", {q_full, hidden},
                                            q_begin, q_rows, dt, dst));
          dst += q_rows * hidden * esize;
          TP_RETURN_IF_ERROR(files.ReadRows(p + "self_attn.k_proj.weight", {kv_full, hidden},
                                            kv_begin, kv_rows, dt, dst));
          dst += kv_rows * hidden * esize;
          return files.ReadRows(p + "self_attn.v_proj.weight", {kv_full, hidden}, kv_begin, kv_rows,
                                dt, dst);
        }));
    layer.wq = qkv.rows(0, q_rows);
    layer.wk = qkv.rows(q_rows, kv_rows);
    layer.wv = qkv.rows(q_rows + kv_rows, kv_rows);
    layer.has_qkv_bias = files.Has(p + "self_attn.q_proj.bias");
    if (layer.has_qkv_bias) {
      Tensor bias;
      TP_ASSIGN_OR_RETURN(
          bias, make({q_rows + 2 * kv_rows}, [&](char* dst) -> absl::Status {
            TP_RETURN_IF_ERROR(
                files.ReadRows(p + "self_attn.q_proj.bias", {q_full}, q_begin, q_rows, dt, dst));
            dst += q_rows * esize;
            TP_RETURN_IF_ERROR(
                files.ReadRows(p + "self_attn.k_proj.bias", {kv_full}, kv_begin, kv_rows, dt, dst));
            dst += kv_rows * esize;
            return files.ReadRows(p + "self_attn.v_proj.bias", {kv_full}, kv_begin, kv_rows, dt,
                                  dst);
          }));
      layer.bq = bias.rows(0, q_rows);
      layer.bk = bias.rows(q_rows, kv_rows);
      layer.bv = bias.rows(q_rows + kv_rows, kv_rows);
    } else if (config_.attention_bias) {
      return absl::NotFoundError(
          absl::StrCat("config has attention_bias but ", p, "self_attn.q_proj.bias is missing"));
    }
    TP_ASSIGN_OR_RETURN(layer.wo, make({hidden, q_rows}, [&](char* dst) {
                          return files.ReadCols(p + "self_attn.o_proj.weight", {hidden, q_full},
                                                q_begin, q_rows, dt, dst);
                        }));
    layer.has_o_bias = shard_.tp_rank == 0 && files.Has(p + "self_attn.o_proj.bias");
    if (layer.has_o_bias) {
      TP_ASSIGN_OR_RETURN(layer.bo, make({hidden}, whole(p + "self_attn.o_proj.bias", {hidden})));
    }
    TP_ASSIGN_OR_RETURN(
        layer.w_gate_up, make({2 * inter_local, hidden}, [&](char* dst) -> absl::Status {
          TP_RETURN_IF_ERROR(files.ReadRows(p + "mlp.gate_proj.weight", {inter, hidden},
                                            shard_.intermediate_begin, inter_local, dt, dst));
          dst += inter_local * hidden * esize;
          return files.ReadRows(p + "mlp.up_proj.weight", {inter, hidden},
                                shard_.intermediate_begin, inter_local, dt, dst);
        }));
    TP_ASSIGN_OR_RETURN(layer.w_down, make({hidden, inter_local}, [&](char* dst) {
                          return files.ReadCols(p + "mlp.down_proj.weight", {hidden, inter},
                                                shard_.intermediate_begin, inter_local, dt, dst);
                        }));
    layers_.push_back(layer);
  }

  // RoPE inverse frequencies stay fp32 on every backend.
  std::vector<float> inv = RopeInvFreq(config_.rope, static_cast<int>(d));
  weight_buffers_.emplace_back(ops_, inv.size() * sizeof(float));
  inv_freq_ = Tensor(weight_buffers_.back().get(), {static_cast<int64_t>(inv.size())}, DType::kF32,
                     ops_->device());
  ops_->CopyToDevice(inv_freq_.data, inv.data(), inv.size() * sizeof(float));
  return absl::OkStatus();
}

void LlamaModel::AllocateActivations() {
  const int64_t t = options_.max_batch_tokens, b = options_.max_batch_seqs;
  const int64_t h = config_.hidden_size, d = config_.head_dim;
  const int64_t q = shard_.num_q_heads * d, kv = shard_.num_kv_heads * d;
  const int64_t i = shard_.intermediate_size, vs = shard_.vocab_shard;
  const int64_t elems[kNumActs] = {t * h,
                                   t * h,
                                   t * q,
                                   t * kv,
                                   t * kv,
                                   t * q,
                                   t * h,
                                   t * 2 * i,
                                   t * i,
                                   b * h,
                                   b * h,
                                   b * vs,
                                   b * vs * plan_.tp,
                                   b * plan_.vocab_padded};
  const size_t esize = DTypeSize(ops_->compute_dtype());
  for (int a = 0; a < kNumActs; ++a) acts_.emplace_back(ops_, elems[a] * esize);
}

Tensor LlamaModel::Act(int index, int64_t rows, int64_t cols) {
  return Tensor(acts_[index].get(), {rows, cols}, ops_->compute_dtype(), ops_->device());
}

std::unique_ptr<KvCache> LlamaModel::MakeKvCache(int num_blocks, int block_size) const {
  return std::make_unique<KvCache>(ops_, num_local_layers(), num_blocks, block_size,
                                   shard_.num_kv_heads, static_cast<int>(config_.head_dim));
}

absl::StatusOr<Tensor> LlamaModel::Forward(const BatchMeta& meta, KvCache& cache) {
  ops_->SetBatch(meta);
  return Run(meta, cache);
}

absl::StatusOr<Tensor> LlamaModel::Run(const BatchMeta& meta, KvCache& cache) {
  const int64_t n = meta.num_tokens, rows = static_cast<int64_t>(meta.logits_rows.size());
  if (n > options_.max_batch_tokens || rows > options_.max_batch_seqs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch of ", n, " tokens / ", rows, " logit rows exceeds the model's limits of ",
        options_.max_batch_tokens, " / ", options_.max_batch_seqs));
  }
  const int64_t h = config_.hidden_size, d = config_.head_dim;
  const int nq = shard_.num_q_heads, nkv = shard_.num_kv_heads;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  Communicator& tp = *comms_.tp;

  Tensor residual = Act(kResidual, n, h), normed = Act(kNormed, n, h);
  Tensor q = Act(kQ, n, nq * d), k = Act(kK, n, nkv * d), v = Act(kV, n, nkv * d);
  Tensor attn = Act(kAttn, n, nq * d), proj = Act(kProj, n, h);
  Tensor gate_up = Act(kGateUp, n, 2 * shard_.intermediate_size);
  Tensor mlp_act = Act(kMlpAct, n, shard_.intermediate_size);

  if (shard_.first_stage()) {
    ops_->Embedding(embed_, shard_.vocab_begin, residual);
    if (plan_.tp > 1) TP_RETURN_IF_ERROR(tp.AllReduceSum(residual));
  } else {
    TP_RETURN_IF_ERROR(comms_.pp->Recv(residual, shard_.stage - 1));
  }

  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    if (l == 0) {
      ops_->RmsNorm(residual, layer.input_norm, eps, normed);
    } else {
      ops_->AddRmsNorm(residual, proj, layer.input_norm, eps, normed);  // proj = previous MLP
    }
    ops_->Gemm(normed, layer.wq, layer.has_qkv_bias ? &layer.bq : nullptr, q);
    ops_->Gemm(normed, layer.wk, layer.has_qkv_bias ? &layer.bk : nullptr, k);
    ops_->Gemm(normed, layer.wv, layer.has_qkv_bias ? &layer.bv : nullptr, v);
    ops_->Rope(q, k, inv_freq_, static_cast<int>(d));
    ops_->KvWrite(k, v, cache.k(static_cast<int>(l)), cache.v(static_cast<int>(l)));
    if (meta.all_decode()) {
      ops_->AttentionDecode(q, cache.k(static_cast<int>(l)), cache.v(static_cast<int>(l)), nq, nkv,
                            static_cast<int>(d), scale, attn);
    } else {
      ops_->AttentionPrefill(q, cache.k(static_cast<int>(l)), cache.v(static_cast<int>(l)), nq, nkv,
                             static_cast<int>(d), scale, attn);
    }
    ops_->Gemm(attn, layer.wo, layer.has_o_bias ? &layer.bo : nullptr, proj);
    if (plan_.tp > 1) TP_RETURN_IF_ERROR(tp.AllReduceSum(proj));
    ops_->AddRmsNorm(residual, proj, layer.post_norm, eps, normed);
    ops_->Gemm(normed, layer.w_gate_up, nullptr, gate_up);
    ops_->SiluMul(gate_up, mlp_act);
    ops_->Gemm(mlp_act, layer.w_down, nullptr, proj);
    if (plan_.tp > 1) TP_RETURN_IF_ERROR(tp.AllReduceSum(proj));
  }
  if (!layers_.empty()) ops_->Add(residual, proj, residual);

  if (!shard_.last_stage) {
    TP_RETURN_IF_ERROR(comms_.pp->Send(residual, shard_.stage + 1));
    return Tensor();
  }
  Tensor last = Act(kLastRows, rows, h), last_normed = Act(kLastNormed, rows, h);
  ops_->GatherLogitRows(residual, last);
  ops_->RmsNorm(last, final_norm_, eps, last_normed);
  Tensor local = Act(kLogitsLocal, rows, shard_.vocab_shard);
  ops_->Gemm(last_normed, lm_head_, nullptr, local);
  if (plan_.tp == 1) return local;
  Tensor gathered(acts_[kLogitsGathered].get(), {plan_.tp, rows, shard_.vocab_shard},
                  ops_->compute_dtype(), ops_->device());
  TP_RETURN_IF_ERROR(tp.AllGather(local, gathered));
  Tensor logits = Act(kLogits, rows, plan_.vocab_padded);
  ops_->InterleaveShards(gathered, logits);
  return logits;
}

}  // namespace tpserve
