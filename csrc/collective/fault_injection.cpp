// The test transport's faults: damaged slots as every rank receives them, failures, pauses.
#include "gradcomp/fault_injection.h"

#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

namespace gradcomp {

FaultSpec::Action FaultSpec::parse_action(const std::string& name) {
  if (name == "none") return Action::kNone;
  if (name == "flip_bits") return Action::kFlipBits;
  if (name == "truncate") return Action::kTruncate;
  if (name == "replace") return Action::kReplace;
  if (name == "fail") return Action::kFail;
  if (name == "pause") return Action::kPause;
  GRADCOMP_CHECK(false, "unknown fault action '" << name
                                                 << "' (none, flip_bits, truncate, replace, "
                                                    "fail, pause)");
}

FaultInjectingCommunicator::FaultInjectingCommunicator(Communicator& inner, FaultSpec spec)
    : inner_(inner), spec_(std::move(spec)) {
  GRADCOMP_CHECK(spec_.collective == "all_to_all" || spec_.collective == "all_gather" ||
                     spec_.collective == "allreduce" || spec_.collective == "reduce_scatter",
                 "fault collective must be all_to_all, all_gather, allreduce or reduce_scatter, "
                 "got '"
                     << spec_.collective << "'");
  GRADCOMP_CHECK(spec_.rank >= 0 && spec_.rank < inner_.world_size(),
                 "fault rank " << spec_.rank << " outside the group");
  GRADCOMP_CHECK(!inner_.device_memory() || spec_.action == FaultSpec::Action::kNone ||
                     spec_.action == FaultSpec::Action::kFail ||
                     spec_.action == FaultSpec::Action::kPause,
                 "damaged slots are injected on host memory only");
}

bool FaultInjectingCommunicator::strikes(const char* collective) {
  static const char* const kCollectives[] = {"all_to_all", "all_gather", "allreduce",
                                             "reduce_scatter"};
  int which = 0;
  while (std::strcmp(collective, kCollectives[which]) != 0) ++which;
  const uint64_t call = calls_[which]++;
  return spec_.action != FaultSpec::Action::kNone && spec_.collective == collective &&
         spec_.call == call;
}

void FaultInjectingCommunicator::misbehave() {
  GRADCOMP_CHECK(spec_.action != FaultSpec::Action::kFail, "injected transport failure ("
                                                               << spec_.collective << " call "
                                                               << spec_.call << ")");
  std::ofstream(spec_.pause_file) << rank() << "\n";
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

void FaultInjectingCommunicator::before(bool strike) {
  const bool on_this_rank = strike && rank() == spec_.rank;
  if (on_this_rank && !spec_.after &&
      (spec_.action == FaultSpec::Action::kFail || spec_.action == FaultSpec::Action::kPause))
    misbehave();
}

void FaultInjectingCommunicator::after(bool strike, uint8_t* slots, size_t bytes_per_rank) {
  if (!strike) return;
  if (spec_.action == FaultSpec::Action::kFail || spec_.action == FaultSpec::Action::kPause) {
    if (spec_.after && rank() == spec_.rank) misbehave();
    return;
  }
  if (slots == nullptr || bytes_per_rank == 0) return;
  uint8_t* slot = slots + bytes_per_rank * static_cast<size_t>(spec_.rank);
  std::mt19937_64 gen(spec_.seed);  // the same damage on every rank
  switch (spec_.action) {
    case FaultSpec::Action::kFlipBits:
      for (int i = 0; i < 3; ++i)
        slot[gen() % bytes_per_rank] ^= static_cast<uint8_t>(1u << (gen() % 8));
      break;
    case FaultSpec::Action::kTruncate:
      std::memset(slot + bytes_per_rank / 2, 0, bytes_per_rank - bytes_per_rank / 2);
      break;
    case FaultSpec::Action::kReplace:
      for (size_t i = 0; i < bytes_per_rank; ++i) slot[i] = static_cast<uint8_t>(gen());
      break;
    default:
      break;
  }
}

void FaultInjectingCommunicator::run_all_to_all(const void* send, void* recv, size_t bytes) {
  const bool strike = strikes("all_to_all");
  before(strike);
  inner_.all_to_all(send, recv, bytes);
  after(strike, static_cast<uint8_t*>(recv), bytes);
}

void FaultInjectingCommunicator::run_all_gather(const void* send, void* recv, size_t bytes) {
  const bool strike = strikes("all_gather");
  before(strike);
  inner_.all_gather(send, recv, bytes);
  after(strike, static_cast<uint8_t*>(recv), bytes);
}

void FaultInjectingCommunicator::run_allreduce_mean(void* data, int64_t numel, DType dtype) {
  const bool strike = strikes("allreduce");
  before(strike);
  inner_.allreduce_mean(data, numel, dtype);
  after(strike, nullptr, 0);
}

void FaultInjectingCommunicator::run_reduce_scatter_mean(const void* send, void* recv,
                                                         int64_t numel_per_rank, DType dtype) {
  const bool strike = strikes("reduce_scatter");
  before(strike);
  inner_.reduce_scatter_mean(send, recv, numel_per_rank, dtype);
  after(strike, nullptr, 0);
}

}  // namespace gradcomp
