// The part of the torch version shims that needs state: stores of the process groups gradcomp made.
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
