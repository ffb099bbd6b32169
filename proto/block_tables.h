// Block-table deltas of the control plane (worker.proto, SeqStep.kept_blocks): the coordinator
// sends a sequence's KV block table whole once, then only what changed since the last plan that
// held it; every worker keeps the tables it was sent and rebuilds the whole ones.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "worker.pb.h"

namespace tpserve {

// The coordinator's record of what the workers hold for one sequence.
struct SentBlockTable {
  bool sent = false;            // a table was sent (the workers keep it until the sequence ends)
  std::vector<int32_t> blocks;  // the table they hold
};

// Writes `table` into `step` (block_table and kept_blocks): whole the first time, afterwards
// as the number of leading entries the workers keep and the entries after them. Updates `sent`.
void EncodeBlockTable(std::span<const int32_t> table, SentBlockTable& sent, worker::SeqStep& step);

// A worker's tables: Resolve turns every step's delta into the whole table, in place, for the
// shard runner. Plans must be resolved in the order the coordinator sent them.
class BlockTables {
 public:
  // Forgets plan.finished_seq_ids, then rebuilds each sequence's table. INTERNAL, naming the
  // step and sequence, when a delta keeps more entries than the worker holds.
  absl::Status Resolve(worker::StepPlan& plan);
  size_t size() const { return tables_.size(); }

 private:
  absl::flat_hash_map<uint64_t, std::vector<int32_t>> tables_;
};

}  // namespace tpserve
