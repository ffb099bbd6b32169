// The LLaMA forward pass over the ops interface (see model.h).
#include "worker/model.h"

#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/model_files.h"
#include "common/progress.h"
#include "common/status.h"
#include "worker/kv_budget.h"

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
  kQ,    // rotated q (RopeKvWrite)
  kQkv,  // the fused q/k/v projection
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

// The view of three tensors that are consecutive rows of one buffer (the fused q/k/v weight
// and bias) as one [rows, cols] tensor.
Tensor ConsecutiveRows(const Tensor& a, const Tensor& b, const Tensor& c) {
  const char* base = static_cast<const char*>(a.data);
  TP_CHECK(b.data == base + a.bytes() && c.data == base + a.bytes() + b.bytes() &&
           a.dtype == b.dtype && b.dtype == c.dtype && a.ndim == b.ndim && b.ndim == c.ndim &&
           (a.ndim == 1 || (a.ndim == 2 && a.dim(1) == b.dim(1) && b.dim(1) == c.dim(1))))
      << "q/k/v are not consecutive rows of one buffer: " << a.ShapeString() << ", "
      << b.ShapeString() << ", " << c.ShapeString();
  const int64_t rows = a.dim(0) + b.dim(0) + c.dim(0);
  if (a.ndim == 1) return Tensor(a.data, {rows}, a.dtype, a.device);
  return Tensor(a.data, {rows, a.dim(1)}, a.dtype, a.device);
}

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

// One weight tensor of the shard and the checkpoint slices that fill it, one after another;
// whatever the parts leave (vocabulary padding rows) is zeros.
struct LlamaModel::PlannedWeight {
  // Rows [begin, begin + count) along dim 0 of a stored tensor, or with `cols` the columns
  // [begin, begin + count) of a stored 2-D tensor.
  struct Part {
    std::string name;
    std::vector<int64_t> shape;  // as stored
    bool cols = false;
    int64_t begin = 0, count = 0;
    int64_t Elems() const {
      if (shape.empty()) return 0;
      int64_t inner = 1;
      for (size_t i = 1; i < shape.size(); ++i) inner *= shape[i];
      return cols ? shape[0] * count : count * inner;
    }
  };
  Tensor* out = nullptr;
  std::vector<int64_t> shape;
  std::vector<Part> parts;
  bool gemm = false;  // a GEMM's weight [N, K] (Ops::PrepareGemmWeight)
};

namespace {

// Every weight tensor starts on a 256-byte boundary of the one weight allocation.
constexpr size_t kWeightAlign = 256;
size_t AlignUp(size_t n) { return (n + kWeightAlign - 1) / kWeightAlign * kWeightAlign; }

Tensor MakeTensor(void* data, const std::vector<int64_t>& shape, DType dt, Device device) {
  if (shape.size() == 1) return Tensor(data, {shape[0]}, dt, device);
  return Tensor(data, {shape[0], shape[1]}, dt, device);
}

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

absl::Status LlamaModel::CheckSupported(const ModelConfig& config, const ShardPlan& plan, int rank,
                                        Ops* ops) {
  if (config.mlp_bias) {
    return absl::UnimplementedError("mlp_bias=true models are not supported yet");
  }
  if (config.sliding_window > 0 && config.sliding_window < config.max_position_embeddings) {
    return absl::UnimplementedError(
        absl::StrCat("sliding-window attention (sliding_window=", config.sliding_window,
                     ") is not supported yet; the model attends over its whole context"));
  }
  if (ops->device() == Device::kCuda && !CudaSupportsHeadDim(config.head_dim)) {
    // The CUDA attention kernels are instantiated for these head sizes only.
    return absl::UnimplementedError(absl::StrCat("the CUDA attention kernels support head_dim ",
                                                 kCudaHeadDims, "; this model has ",
                                                 config.head_dim, " (run it with --device cpu)"));
  }
  if (rank < 0 || rank >= plan.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " outside the plan's ", plan.world_size(), " ranks"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ShardMemory> LlamaModel::EstimateMemory(const ModelFiles& files,
                                                       const ShardPlan& plan, int rank, Ops* ops,
                                                       const ModelOptions& options) {
  TP_RETURN_IF_ERROR(CheckSupported(files.config(), plan, rank, ops));
  LlamaModel m(files.config(), plan, rank, ops, ParallelContext{}, options);
  std::vector<Tensor> fused;
  TP_ASSIGN_OR_RETURN(std::vector<PlannedWeight> weights, m.PlanWeights(files, fused));
  const DType dt = ops->compute_dtype();
  ShardMemory out;
  for (const PlannedWeight& w : weights) {
    out.weight_bytes += AlignUp(MakeTensor(nullptr, w.shape, dt, ops->device()).bytes());
    if (w.gemm) out.weight_bytes += ops->PreparedGemmWeightBytes(w.shape[0], w.shape[1]);
  }
  for (int64_t elems : m.ActivationElems()) out.activation_bytes += elems * DTypeSize(dt);
  return out;
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const ModelFiles& files,
                                                             const ShardPlan& plan, int rank,
                                                             Ops* ops, ParallelContext comms,
                                                             const ModelOptions& options) {
  const ModelConfig& config = files.config();
  TP_RETURN_IF_ERROR(CheckSupported(config, plan, rank, ops));
  if (comms.tp == nullptr || comms.pp == nullptr || comms.tp->size() != plan.tp ||
      comms.pp->size() != plan.pp) {
    return absl::InvalidArgumentError("communicators do not match the shard plan's tp x pp grid");
  }
  std::unique_ptr<LlamaModel> model(new LlamaModel(config, plan, rank, ops, comms, options));
  TP_RETURN_IF_ERROR(model->LoadWeights(files));
  model->AllocateActivations();
  return model;
}

absl::StatusOr<std::vector<LlamaModel::PlannedWeight>> LlamaModel::PlanWeights(
    const ModelFiles& files, std::vector<Tensor>& fused) {
  using Part = PlannedWeight::Part;
  const int64_t hidden = config_.hidden_size, d = config_.head_dim;
  const int64_t q_rows = shard_.num_q_heads * d, kv_rows = shard_.num_kv_heads * d;
  const int64_t q_full = config_.num_heads * d, kv_full = config_.num_kv_heads * d;
  const int64_t q_begin = shard_.q_head_begin * d, kv_begin = shard_.kv_head_begin * d;
  const int64_t inter = config_.intermediate_size, inter_local = shard_.intermediate_size;
  const int64_t inter_begin = shard_.intermediate_begin;
  const int64_t vocab = config_.vocab_size;
  auto rows = [](std::string name, std::vector<int64_t> shape, int64_t begin, int64_t count) {
    return Part{std::move(name), std::move(shape), false, begin, count};
  };
  auto cols = [](std::string name, std::vector<int64_t> shape, int64_t begin, int64_t count) {
    return Part{std::move(name), std::move(shape), true, begin, count};
  };
  auto whole = [](std::string name, int64_t n) { return Part{std::move(name), {n}, false, 0, n}; };
  // Vocab rows [vocab_begin, +vocab_shard); rows past the real vocabulary stay zero.
  const int64_t vocab_count =
      std::max<int64_t>(0, std::min(shard_.vocab_shard, vocab - shard_.vocab_begin));

  std::vector<PlannedWeight> plan;
  layers_.assign(num_local_layers(), Layer());
  fused.assign(2 * layers_.size(), Tensor());
  if (shard_.first_stage()) {
    plan.push_back(
        {&embed_,
         {shard_.vocab_shard, hidden},
         {rows("model.embed_tokens.weight", {vocab, hidden}, shard_.vocab_begin, vocab_count)}});
  }
  if (shard_.last_stage) {
    plan.push_back({&final_norm_, {hidden}, {whole("model.norm.weight", hidden)}});
    const std::string head =
        config_.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    plan.push_back({&lm_head_,
                    {shard_.vocab_shard, hidden},
                    {rows(head, {vocab, hidden}, shard_.vocab_begin, vocab_count)},
                    /*gemm=*/true});
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    const std::string p = absl::StrCat("model.layers.", shard_.layer_begin + i, ".");
    Layer& layer = layers_[i];
    plan.push_back({&layer.input_norm, {hidden}, {whole(p + "input_layernorm.weight", hidden)}});
    plan.push_back(
        {&layer.post_norm, {hidden}, {whole(p + "post_attention_layernorm.weight", hidden)}});
    plan.push_back({&fused[2 * i],
                    {q_rows + 2 * kv_rows, hidden},
                    {rows(p + "self_attn.q_proj.weight", {q_full, hidden}, q_begin, q_rows),
                     rows(p + "self_attn.k_proj.weight", {kv_full, hidden}, kv_begin, kv_rows),
                     rows(p + "self_attn.v_proj.weight", {kv_full, hidden}, kv_begin, kv_rows)},
                    /*gemm=*/true});
    layer.has_qkv_bias = files.Has(p + "self_attn.q_proj.bias");
    if (layer.has_qkv_bias) {
      plan.push_back({&fused[2 * i + 1],
                      {q_rows + 2 * kv_rows},
                      {rows(p + "self_attn.q_proj.bias", {q_full}, q_begin, q_rows),
                       rows(p + "self_attn.k_proj.bias", {kv_full}, kv_begin, kv_rows),
                       rows(p + "self_attn.v_proj.bias", {kv_full}, kv_begin, kv_rows)}});
    } else if (config_.attention_bias) {
      return absl::NotFoundError(
          absl::StrCat("config has attention_bias but ", p, "self_attn.q_proj.bias is missing"));
    }
    plan.push_back({&layer.wo,
                    {hidden, q_rows},
                    {cols(p + "self_attn.o_proj.weight", {hidden, q_full}, q_begin, q_rows)},
                    /*gemm=*/true});
    layer.has_o_bias = shard_.tp_rank == 0 && files.Has(p + "self_attn.o_proj.bias");
    if (layer.has_o_bias) {
      plan.push_back({&layer.bo, {hidden}, {whole(p + "self_attn.o_proj.bias", hidden)}});
    }
    plan.push_back({&layer.w_gate_up,
                    {2 * inter_local, hidden},
                    {rows(p + "mlp.gate_proj.weight", {inter, hidden}, inter_begin, inter_local),
                     rows(p + "mlp.up_proj.weight", {inter, hidden}, inter_begin, inter_local)},
                    /*gemm=*/true});
    plan.push_back({&layer.w_down,
                    {hidden, inter_local},
                    {cols(p + "mlp.down_proj.weight", {hidden, inter}, inter_begin, inter_local)},
                    /*gemm=*/true});
  }
  return plan;
}

absl::Status LlamaModel::LoadWeights(const ModelFiles& files) {
  using Part = PlannedWeight::Part;
  const auto t0 = std::chrono::steady_clock::now();
  const DType dt = ops_->compute_dtype();
  const Device device = ops_->device();
  const size_t esize = DTypeSize(dt);
  std::vector<Tensor> fused;
  TP_ASSIGN_OR_RETURN(std::vector<PlannedWeight> plan, PlanWeights(files, fused));

  // One allocation holds every tensor: one check against free memory, no fragmentation.
  std::vector<size_t> offsets;
  size_t total = 0;
  for (const PlannedWeight& w : plan) {
    offsets.push_back(total);
    total += AlignUp(MakeTensor(nullptr, w.shape, dt, device).bytes());
  }
  weight_buffers_.emplace_back(ops_, total);
  weight_bytes_ = total;
  char* arena = static_cast<char*>(weight_buffers_.back().get());
  const double alloc_s = SecondsSince(t0);

  // On a device: parts stored in the compute dtype go from the mapped file through the
  // uploader's staging; others are converted on the host first. On the CPU the tensors are
  // host memory already: read (and convert) in place.
  std::unique_ptr<DeviceUploader> uploader =
      device == Device::kCpu ? nullptr : ops_->MakeUploader();
  int64_t streamed = 0, converted = 0;
  auto load_part = [&](const Part& p, char* dst) -> absl::Status {
    const int64_t elems = p.Elems();
    if (elems == 0) return absl::OkStatus();
    auto read = [&](char* out) {
      return p.cols ? files.ReadCols(p.name, p.shape, p.begin, p.count, dt, out)
                    : files.ReadRows(p.name, p.shape, p.begin, p.count, dt, out);
    };
    if (uploader == nullptr) return read(dst);
    TP_ASSIGN_OR_RETURN(WeightInfo info, files.Info(p.name));
    const int64_t dim0 = p.shape.empty() ? 0 : p.shape[0];
    const bool in_range = p.begin >= 0 && p.count >= 0 &&
                          (p.cols ? p.shape.size() == 2 && p.begin + p.count <= p.shape[1]
                                  : p.begin + p.count <= dim0);
    if (info.has_dtype && info.dtype == dt && info.shape == p.shape && in_range) {
      TP_ASSIGN_OR_RETURN(std::string_view raw, files.RawBytes(p.name));
      if (p.cols) {
        uploader->UploadRows(dst, raw.data() + p.begin * esize, p.shape[0], p.count * esize,
                             p.shape[1] * esize);
      } else {
        const size_t row_bytes = elems / p.count * esize;
        uploader->Upload(dst, raw.data() + p.begin * row_bytes, p.count * row_bytes);
      }
      streamed += elems * static_cast<int64_t>(esize);
      return absl::OkStatus();
    }
    std::vector<char> host(elems * esize);
    TP_RETURN_IF_ERROR(read(host.data()));  // also reports shape and range errors
    uploader->Upload(dst, host.data(), host.size());
    uploader->Flush();  // `host` is released below
    converted += static_cast<int64_t>(host.size());
    return absl::OkStatus();
  };
  ByteProgress progress(
      absl::StrCat("loading weights of layers [", shard_.layer_begin, ", ", shard_.layer_end, ")"),
      static_cast<int64_t>(total));
  for (size_t i = 0; i < plan.size(); ++i) {
    const PlannedWeight& w = plan[i];
    char* dst = arena + offsets[i];
    progress.Update(static_cast<int64_t>(offsets[i]));
    const Tensor t = MakeTensor(dst, w.shape, dt, device);
    size_t filled = 0;
    for (const Part& p : w.parts) {
      TP_RETURN_IF_ERROR(load_part(p, dst + filled));
      filled += p.Elems() * esize;
    }
    if (filled > t.bytes()) {
      return absl::InternalError(absl::StrCat("weight plan overflows a tensor of ", t.bytes(),
                                              " bytes (", w.parts.front().name, ")"));
    }
    if (filled < t.bytes()) {  // vocabulary padding
      if (uploader == nullptr) {
        std::memset(dst + filled, 0, t.bytes() - filled);
      } else {
        std::vector<char> zeros(t.bytes() - filled, 0);
        uploader->Upload(dst + filled, zeros.data(), zeros.size());
        uploader->Flush();
      }
    }
    *w.out = t;
  }
  if (uploader != nullptr) uploader->Flush();
  const double load_s = SecondsSince(t0);

  const int64_t q_rows = shard_.num_q_heads * config_.head_dim;
  const int64_t kv_rows = shard_.num_kv_heads * config_.head_dim;
  for (size_t i = 0; i < layers_.size(); ++i) {
    Layer& layer = layers_[i];
    const Tensor& qkv = fused[2 * i];
    layer.wq = qkv.rows(0, q_rows);
    layer.wk = qkv.rows(q_rows, kv_rows);
    layer.wv = qkv.rows(q_rows + kv_rows, kv_rows);
    if (layer.has_qkv_bias) {
      const Tensor& bias = fused[2 * i + 1];
      layer.bq = bias.rows(0, q_rows);
      layer.bk = bias.rows(q_rows, kv_rows);
      layer.bv = bias.rows(q_rows + kv_rows, kv_rows);
    }
  }

  // The ops' other layouts of the GEMM weights (the fused q/k/v, o, gate/up, down, lm_head),
  // made once every upload has landed.
  int64_t prepared_bytes = 0;
  for (const PlannedWeight& w : plan) {
    if (!w.gemm) continue;
    if (std::unique_ptr<Ops::PreparedWeight> p = ops_->PrepareGemmWeight(*w.out)) {
      prepared_bytes += ops_->PreparedGemmWeightBytes(w.shape[0], w.shape[1]);
      prepared_.push_back(std::move(p));
    }
  }
  if (!prepared_.empty()) {
    TP_LOG(INFO) << "GEMM weights also in the ops' decode layout: " << prepared_.size()
                 << " tensors, " << BytesString(prepared_bytes);
  }

  // RoPE inverse frequencies stay fp32 on every backend.
  std::vector<float> inv = RopeInvFreq(config_.rope, static_cast<int>(config_.head_dim));
  weight_buffers_.emplace_back(ops_, inv.size() * sizeof(float));
  inv_freq_ =
      Tensor(weight_buffers_.back().get(), {static_cast<int64_t>(inv.size())}, DType::kF32, device);
  ops_->CopyToDevice(inv_freq_.data, inv.data(), inv.size() * sizeof(float));

  if (uploader != nullptr) {
    const DeviceUploader::Stats st = uploader->stats();
    TP_LOG(INFO) << absl::StrFormat(
        "weights: %s in %d tensors, %.3f s (%.2f GB/s): allocation %.3f s, host copies into "
        "staging %.3f s on %d threads, waiting for the device %.3f s; %s streamed as stored, "
        "%s converted on the host",
        BytesString(total), plan.size(), load_s, total / 1e9 / load_s, alloc_s, st.host_copy_s,
        st.threads, st.wait_s, BytesString(streamed), BytesString(converted));
  } else {
    TP_LOG(INFO) << absl::StrFormat("weights: %s in %d tensors, %.3f s (read as %s in place)",
                                    BytesString(total), plan.size(), load_s,
                                    std::string(DTypeName(dt)));
  }
  return absl::OkStatus();
}

std::vector<int64_t> LlamaModel::ActivationElems() const {
  const int64_t t = options_.max_batch_tokens, b = options_.max_batch_seqs;
  const int64_t h = config_.hidden_size, d = config_.head_dim;
  const int64_t q = shard_.num_q_heads * d, kv = shard_.num_kv_heads * d;
  const int64_t i = shard_.intermediate_size, vs = shard_.vocab_shard;
  return {t * h,
          t * h,
          t * q,
          t * (q + 2 * kv),
          t * q,
          t * h,
          t * 2 * i,
          t * i,
          b * h,
          b * h,
          b * vs,
          b * vs * plan_.tp,
          b * plan_.vocab_padded};
}

void LlamaModel::AllocateActivations() {
  const std::vector<int64_t> elems = ActivationElems();
  TP_CHECK(elems.size() == static_cast<size_t>(kNumActs))
      << "ActivationElems lists " << elems.size() << " buffers";
  const size_t esize = DTypeSize(ops_->compute_dtype());
  for (int a = 0; a < kNumActs; ++a) {
    acts_.emplace_back(ops_, elems[a] * esize);
    activation_bytes_ += elems[a] * esize;
  }
}

Tensor LlamaModel::Act(int index, int64_t rows, int64_t cols) {
  return Tensor(acts_[index].get(), {rows, cols}, ops_->compute_dtype(), ops_->device());
}

std::unique_ptr<KvCache> LlamaModel::MakeKvCache(int num_blocks, int block_size,
                                                 DType kv_dtype) const {
  return std::make_unique<KvCache>(ops_, num_local_layers(), num_blocks, block_size,
                                   shard_.num_kv_heads, static_cast<int>(config_.head_dim),
                                   kv_dtype);
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
  Tensor q = Act(kQ, n, nq * d), qkv = Act(kQkv, n, (nq + 2 * nkv) * d);
  Tensor attn = Act(kAttn, n, nq * d), proj = Act(kProj, n, h);
  Tensor gate_up = Act(kGateUp, n, 2 * shard_.intermediate_size);
  Tensor mlp_act = Act(kMlpAct, n, shard_.intermediate_size);

  if (shard_.first_stage()) {
    ops_->Embedding(embed_, shard_.vocab_begin, residual);
    if (plan_.tp > 1) TP_RETURN_IF_ERROR(tp.AllReduceSum(residual));
  } else {
    TP_RETURN_IF_ERROR(comms_.pp->Recv(residual, shard_.stage - 1));
  }

  // Without tensor parallelism nothing stands between a projection into the residual stream and
  // the next RMSNorm: they go to the backend as one op, which may defer the norm's row scale to
  // the projection that reads `normed` (`pending`; CUDA does for decode batches). The last
  // layer's MLP output joins the residual after the loop, as with tensor parallelism.
  // With tensor parallelism the communicator may fuse each all-reduce with the residual add and
  // the next RMSNorm (AllReduceAddRmsNorm; same bits as the two steps): `normed_ready` says the
  // previous layer's MLP all-reduce already produced this layer's normed input.
  const bool fuse_norms = plan_.tp == 1;
  // Deterministic mode's AddRmsNorm has its own arithmetic (the chain GEMMs' deferred norm),
  // which the communicator's fused kernel does not have: the two steps there.
  const bool fuse_all_reduce_norms = !ops_->deterministic();
  RowScale pending;
  bool normed_ready = false;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    if (l == 0) {
      ops_->RmsNorm(residual, layer.input_norm, eps, normed);
    } else if (!fuse_norms && !normed_ready) {
      ops_->AddRmsNorm(residual, proj, layer.input_norm, eps, normed);  // proj = previous MLP
    }
    normed_ready = false;
    // One GEMM for q, k and v (their weights are consecutive rows of one buffer), RoPE and the
    // cache write fused after it.
    const Tensor wqkv = ConsecutiveRows(layer.wq, layer.wk, layer.wv);
    const Tensor bqkv =
        layer.has_qkv_bias ? ConsecutiveRows(layer.bq, layer.bk, layer.bv) : Tensor();
    ops_->QkvRopeKvWrite(normed, pending, wqkv, layer.has_qkv_bias ? &bqkv : nullptr, inv_freq_, nq,
                         nkv, static_cast<int>(d), qkv, q, cache.k(static_cast<int>(l)),
                         cache.v(static_cast<int>(l)));
    pending = RowScale();
    if (meta.all_decode()) {
      ops_->AttentionDecode(q, cache.k(static_cast<int>(l)), cache.v(static_cast<int>(l)), nq, nkv,
                            static_cast<int>(d), scale, attn);
    } else {
      ops_->AttentionPrefill(q, cache.k(static_cast<int>(l)), cache.v(static_cast<int>(l)), nq, nkv,
                             static_cast<int>(d), scale, attn);
    }
    const Tensor* o_bias = layer.has_o_bias ? &layer.bo : nullptr;
    if (fuse_norms) {
      pending = ops_->GemmAddRmsNorm(attn, layer.wo, o_bias, proj, residual, layer.post_norm, eps,
                                     normed);
    } else {
      ops_->Gemm(attn, layer.wo, o_bias, proj);
      bool fused = false;
      if (fuse_all_reduce_norms) {
        TP_ASSIGN_OR_RETURN(fused,
                            tp.AllReduceAddRmsNorm(proj, residual, layer.post_norm, eps, normed));
      }
      if (!fused) {
        TP_RETURN_IF_ERROR(tp.AllReduceSum(proj));
        ops_->AddRmsNorm(residual, proj, layer.post_norm, eps, normed);
      }
    }
    ops_->GemmScaledRows(normed, pending, layer.w_gate_up, nullptr, gate_up);
    pending = RowScale();
    if (fuse_norms && l + 1 < layers_.size()) {
      pending = ops_->SiluMulGemmAddRmsNorm(gate_up, layer.w_down, mlp_act, proj, residual,
                                            layers_[l + 1].input_norm, eps, normed);
    } else {
      ops_->SiluMulGemm(gate_up, layer.w_down, mlp_act, proj);
      if (plan_.tp > 1 && l + 1 < layers_.size() && fuse_all_reduce_norms) {
        TP_ASSIGN_OR_RETURN(
            normed_ready,
            tp.AllReduceAddRmsNorm(proj, residual, layers_[l + 1].input_norm, eps, normed));
      }
      if (plan_.tp > 1 && !normed_ready) TP_RETURN_IF_ERROR(tp.AllReduceSum(proj));
    }
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
