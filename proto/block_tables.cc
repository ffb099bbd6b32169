// Block-table deltas (see block_tables.h).
#include "proto/block_tables.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tpserve {

void EncodeBlockTable(std::span<const int32_t> table, SentBlockTable& sent, worker::SeqStep& step) {
  if (!sent.sent) {
    step.mutable_block_table()->Add(table.begin(), table.end());
    sent.sent = true;
    sent.blocks.assign(table.begin(), table.end());
    return;
  }
  // The common prefix stays; whatever follows (appended blocks, a block the prefix cache
  // swapped, a table rebuilt after preemption) is sent.
  const size_t n = std::min(table.size(), sent.blocks.size());
  size_t kept = 0;
  while (kept < n && table[kept] == sent.blocks[kept]) ++kept;
  step.set_kept_blocks(static_cast<int32_t>(kept));
  step.mutable_block_table()->Add(table.begin() + kept, table.end());
  sent.blocks.resize(kept);
  sent.blocks.insert(sent.blocks.end(), table.begin() + kept, table.end());
}

absl::Status BlockTables::Resolve(worker::StepPlan& plan) {
  for (uint64_t id : plan.finished_seq_ids()) tables_.erase(id);
  for (worker::SeqStep& s : *plan.mutable_seqs()) {
    std::vector<int32_t>& table = tables_[s.seq_id()];
    if (!s.has_kept_blocks()) {
      table.assign(s.block_table().begin(), s.block_table().end());
      continue;
    }
    if (s.kept_blocks() < 0 || static_cast<size_t>(s.kept_blocks()) > table.size()) {
      return absl::InternalError(absl::StrCat(
          "step ", plan.step_id(), ": sequence ", s.seq_id(), " keeps ", s.kept_blocks(),
          " blocks of its table but this worker holds ", table.size()));
    }
    table.resize(static_cast<size_t>(s.kept_blocks()));
    table.insert(table.end(), s.block_table().begin(), s.block_table().end());
    s.mutable_block_table()->Assign(table.begin(), table.end());
    s.clear_kept_blocks();
  }
  return absl::OkStatus();
}

}  // namespace tpserve
