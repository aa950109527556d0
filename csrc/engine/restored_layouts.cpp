// The first step after a restart: the saved bucket layouts, reduced as segment lists over the
// buckets the front end presents instead.
#include <algorithm>
#include <unordered_map>

#include "gradcomp/engine.h"

namespace gradcomp {

void BucketEngine::reduce_restored_layouts(const std::vector<Held>& held) {
  // Where each parameter's gradient is in this step's buckets, and in which dtype.
  struct Place {
    char* data;
    int64_t numel;
    DType dtype;
  };
  std::unordered_map<int64_t, Place> where;
  for (const Held& h : held) {
    char* base = static_cast<char*>(h.bucket.data);
    const int64_t element = static_cast<int64_t>(dtype_size(h.bucket.dtype));
    for (const ParamSlice& p : h.bucket.params)
      where[p.param] = Place{base + p.offset * element, p.numel, h.bucket.dtype};
  }
  std::vector<std::pair<int64_t, uint64_t>> order;  // saved bucket index, identity
  size_t saved_params = 0;
  bool complete = true;
  for (const auto& [id, layout] : restored_) {
    order.emplace_back(layout.index, id);
    saved_params += layout.params.size();
    for (const auto& [param, numel] : layout.params) {
      auto it = where.find(param);
      complete &=
          it != where.end() && it->second.numel == numel && it->second.dtype == layout.dtype;
    }
  }
  if (!complete || saved_params != where.size()) {
    // Another model than the checkpoint's: reduce the buckets as they are.
    for (const Held& h : held) {
      reduce_segments({Segment{h.bucket.data, 0, h.bucket.numel}}, h.bucket.dtype, h.bucket.numel,
                      h.bucket.identity);
      step_ids_.insert(h.bucket.identity);
    }
    return;
  }
  std::sort(order.begin(), order.end());
  for (const auto& entry : order) {
    const uint64_t identity = entry.second;
    const BucketLayout& layout = restored_.at(identity);
    std::vector<Segment> segments;
    int64_t offset = 0;
    for (const auto& [param, numel] : layout.params) {
      segments.push_back(Segment{where.at(param).data, offset, numel});
      offset += numel;
    }
    reduce_segments(segments, layout.dtype, offset, identity);
    step_ids_.insert(identity);
    layouts_[identity] = layout;
  }
  for (const Held& h : held) {
    if (restored_.count(h.bucket.identity) == 0) layouts_.erase(h.bucket.identity);
  }
}

}  // namespace gradcomp
