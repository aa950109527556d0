// The torch version shims that are not templates: the PREMUL_SUM factor, and the stores of the
// process groups gradcomp made.
#include "torch_compat.h"

#include <mutex>
#include <unordered_map>

namespace gradcomp {
namespace torch_ext {
namespace compat {
namespace {

struct RecordedStore {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;  // a dead group's address may be reused
  c10::intrusive_ptr<c10d::Store> store;
};

std::mutex& stores_mu() {
  static std::mutex mu;
  return mu;
}

std::unordered_map<const c10d::ProcessGroup*, RecordedStore>& stores() {
  static std::unordered_map<const c10d::ProcessGroup*, RecordedStore> m;
  return m;
}

}  // namespace

void remember_store(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                    c10::intrusive_ptr<c10d::Store> store) {
  std::lock_guard<std::mutex> lock(stores_mu());
  auto& m = stores();
  for (auto it = m.begin(); it != m.end();) it = it->second.group.expired() ? m.erase(it) : ++it;
  m.insert_or_assign(group.get(), RecordedStore{c10::weak_intrusive_ptr<c10d::ProcessGroup>(group),
                                                std::move(store)});
}

double premul_sum_factor(const c10d::ReduceOp& op) {
  TORCH_CHECK(op.op_ == c10d::ReduceOp::PREMUL_SUM, "gradcomp: ReduceOp ", static_cast<int>(op.op_),
              " is not PREMUL_SUM");
  const auto* supplement = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(supplement != nullptr, "gradcomp: a PREMUL_SUM ReduceOp without its factor");
  if (supplement->tensor_factor.defined()) {
    return supplement->tensor_factor.to(at::kCPU, at::kDouble).item<double>();
  }
  return supplement->double_factor;
}

c10::intrusive_ptr<c10d::Store> recorded_store(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  std::lock_guard<std::mutex> lock(stores_mu());
  auto it = stores().find(group.get());
  if (it == stores().end() || it->second.group.lock() != group) return {};
  return it->second.store;
}

}  // namespace compat
}  // namespace torch_ext
}  // namespace gradcomp
