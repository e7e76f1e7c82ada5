#pragma once
// Layout-independent checkpoints (DESIGN.md §1.3, docs/checkpoints.md).
//
// A checkpoint is a directory DIR/step-<8 digits>/ holding one safetensors file per writing rank
// (shard-<world rank>.safetensors: the local slices of every parameter under its GLOBAL name, plus
// "<name>:exp_avg" / "<name>:exp_avg_sq" when optimizer moments are saved) and an index.json that lists,
// for every global tensor, its global shape and the slices that make it up. Loading assembles each
// local slice of any layout from the overlapping saved slices, so TP/PP/DP can change between save and
// load. Saves are atomic: everything is written into DIR.tmp-<step>/ and renamed into place last.
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "model/params.h"

namespace ndt {

// What one rank contributes. full_m / full_v: Adam moments for this rank's WHOLE local flat buffer
// (same layout as params.flat_values(); the caller all-gathers ZeRO shards over DP before saving), or
// undefined tensors when there is no optimizer state. writer: whether this rank writes its slices
// (the caller passes true only on DP rank 0 of each tensor/pipeline coordinate, so every slice is
// written once).
struct CheckpointMeta {
  int64_t step = 0;
  int64_t optimizer_steps = 0;
  std::string config_yaml;
  std::string layout;
};

// Collective over world. Writes DIR.tmp-<step>/shard-<world rank>.safetensors from each writer, then
// world rank 0 gathers every writer's slice list and writes index.json, renames DIR.tmp-<step> to
// DIR/step-<step 8 digits>, writes DIR/latest (tmp + rename) and deletes step dirs older than the newest
// keep_last (0 = keep all). Every rank returns the same Status.
// Test hook: env NDT_CHECKPOINT_CRASH_AFTER_SHARDS=1 makes world rank 0 call std::_Exit(3) after the
// shards are written and before the index/rename.
// write_dense = false: this writer writes only its expert params (Param::expert; under expert parallelism
// every EP rank of a replica writes its experts, one rank the rest).
// fault (reliability tests, train/fault.h): this rank's shard write fails as on a full disk, or the shard is
// truncated after a successful write (a disk that lied: only a later load notices). On any failure the
// staging directory is removed and the previous checkpoints stay as they were.
enum class CheckpointFault { None, WriteError, ShortWrite };
Status save_checkpoint(const std::string& dir, const ParamStore& params, const Tensor& full_m,
                       const Tensor& full_v, const CheckpointMeta& meta, bool writer, int keep_last,
                       Communicator& world, bool write_dense = true,
                       CheckpointFault fault = CheckpointFault::None);

// Resolves DIR (a step dir with index.json, or a parent with `latest`) to a step dir path.
Result<std::string> resolve_checkpoint(const std::string& dir);
Result<CheckpointMeta> read_checkpoint_meta(const std::string& step_dir);

// Fills every local param's value (and full_m / full_v, same layout as the flat buffer, when non-null)
// from the checkpoint, whatever layout wrote it. Errors name the file and the tensor.
Status load_checkpoint(const std::string& step_dir, ParamStore& params, Tensor* full_m, Tensor* full_v);

// ---- Lower-level pieces (used by save_checkpoint; exposed so tests can write several ranks' shards
// from one process) ----

// One saved slice of a global tensor.
struct CheckpointSlice {
  std::string name;    // global parameter name
  Shape global_shape;  // shape of the whole tensor
  std::string dtype = "F32";
  std::string file;    // shard file name, relative to the step dir
  int shard_dim = -1;  // -1: the slice is the whole tensor
  int64_t offset = 0;  // first global index along shard_dim
  Shape shape;         // slice shape
};

// "DIR/step-00000042"-style directory name for a step ("step-00000042").
std::string checkpoint_step_name(int64_t step);

// Writes the local slices of `params` (and moments, when full_m/full_v are defined; both or neither)
// into step_dir/file and returns the slice list.
Result<std::vector<CheckpointSlice>> write_checkpoint_shard(const std::string& step_dir,
                                                            const std::string& file, const ParamStore& params,
                                                            const Tensor& full_m, const Tensor& full_v,
                                                            bool write_dense = true);

// Writes step_dir/index.json from the slices of all writers. Identical slices written by several ranks
// (TP-replicated params, the tied embedding on two pipeline stages) are listed once (the first file).
// Fails when a tensor's slices disagree on the global shape or do not cover it.
Status write_checkpoint_index(const std::string& step_dir, const std::vector<CheckpointSlice>& slices,
                              const CheckpointMeta& meta, bool has_moments);

// Renames tmp_dir to dir/step-<step>, points dir/latest at it and deletes old step dirs beyond keep_last.
Status publish_checkpoint(const std::string& dir, const std::string& tmp_dir, int64_t step, int keep_last);

// Slice lists as JSON text (what travels between ranks during a save).
std::string checkpoint_slices_to_json(const std::vector<CheckpointSlice>& slices);
Result<std::vector<CheckpointSlice>> checkpoint_slices_from_json(const std::string& text);

}  // namespace ndt
