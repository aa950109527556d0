// The shared-memory transport: a segment with one slot per rank and a futex barrier.
#include "gradcomp/shm_communicator.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

namespace gradcomp {

struct ShmCommunicator::Header {
  uint32_t magic;
  uint32_t world;
  uint64_t slot_bytes;
  std::atomic<uint32_t> arrived;
  std::atomic<uint32_t> generation;
  std::atomic<uint32_t> attached;
  std::atomic<uint32_t> failed;  // a rank gave up: the group is unusable
  std::atomic<uint32_t> ready;   // rank 0 finished setting the segment up
};

namespace {

constexpr uint32_t kShmMagic = 0x4d484347u;  // "GCHM"
constexpr size_t kHeaderBytes = 256;         // slots start cache-line aligned after it
static_assert(sizeof(ShmCommunicator::Header) <= kHeaderBytes, "header fits its space");

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Sleeps until *word may differ from `value` (or a short while passes).
void wait_on(std::atomic<uint32_t>& word, uint32_t value) {
#if defined(__linux__)
  timespec ts{0, 20 * 1000 * 1000};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, value, &ts, nullptr, 0);
#else
  (void)word;
  (void)value;
  std::this_thread::yield();
#endif
}

void wake_all(std::atomic<uint32_t>& word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, 1 << 30, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

}  // namespace

ShmCommunicator::ShmCommunicator(const std::string& name, int rank, int world,
                                 double timeout_seconds, size_t slot_bytes)
    : name_(name),
      rank_(rank),
      world_(world),
      timeout_s_(timeout_seconds),
      slot_bytes_(slot_bytes / 64 * 64) {
  GRADCOMP_CHECK(world >= 1 && rank >= 0 && rank < world,
                 "shared-memory group: rank " << rank << " of " << world);
  GRADCOMP_CHECK(name.size() > 1 && name[0] == '/' && name.find('/', 1) == std::string::npos,
                 "shared-memory group: name '" << name << "' must be '/' and one path component");
  GRADCOMP_CHECK(slot_bytes_ >= 64 * static_cast<size_t>(world),
                 "shared-memory group: slots of " << slot_bytes << " bytes are too small");
  mapped_bytes_ = kHeaderBytes + slot_bytes_ * static_cast<size_t>(world);
  const auto deadline = deadline_after(timeout_s_);
  int fd = -1;
  if (rank == 0) {
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    GRADCOMP_CHECK(fd >= 0, "shared-memory group '" << name << "': cannot create it ("
                                                    << std::strerror(errno) << ")");
    // Reserved now, so that a full /dev/shm (a container's 64 MB default) is an error here and
    // not a SIGBUS at the first write.
    const int err = posix_fallocate(fd, 0, static_cast<off_t>(mapped_bytes_));
    if (err != 0) {
      close(fd);
      shm_unlink(name.c_str());
      GRADCOMP_CHECK(false, "shared-memory group '"
                                << name << "': cannot reserve " << mapped_bytes_ << " bytes ("
                                << std::strerror(err)
                                << "); give /dev/shm more room or use the intra-node process "
                                   "group (node_transport='group', node_shared_memory = false)");
    }
  } else {
    // Rank 0 may not have created it yet.
    while ((fd = shm_open(name.c_str(), O_RDWR, 0600)) < 0) {
      GRADCOMP_CHECK(errno == ENOENT && Clock::now() < deadline,
                     "shared-memory group '" << name << "': rank " << rank
                                             << " cannot open it within " << timeout_s_ << " s ("
                                             << std::strerror(errno) << ")");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    struct stat st;
    for (;;) {
      if (fstat(fd, &st) != 0) {
        const int err = errno;
        close(fd);
        GRADCOMP_CHECK(false, "shared-memory group '" << name << "': rank " << rank
                                                      << " cannot stat it (" << std::strerror(err)
                                                      << ")");
      }
      if (static_cast<size_t>(st.st_size) >= mapped_bytes_) break;
      if (Clock::now() >= deadline) {
        close(fd);
        GRADCOMP_CHECK(false, "shared-memory group '" << name << "' has " << st.st_size
                                                      << " bytes, rank " << rank << " expects "
                                                      << mapped_bytes_);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  void* p = mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    if (rank == 0) shm_unlink(name.c_str());
    GRADCOMP_CHECK(false, "shared-memory group '" << name << "': mmap of " << mapped_bytes_
                                                  << " bytes failed (" << std::strerror(errno)
                                                  << ")");
  }
  header_ = static_cast<Header*>(p);
  if (rank == 0) {
    new (header_) Header{};
    header_->magic = kShmMagic;
    header_->world = static_cast<uint32_t>(world);
    header_->slot_bytes = slot_bytes_;
    header_->ready.store(1, std::memory_order_release);
  } else {
    while (header_->ready.load(std::memory_order_acquire) == 0) {
      if (Clock::now() >= deadline) {
        munmap(header_, mapped_bytes_);
        GRADCOMP_CHECK(false, "shared-memory group '"
                                  << name << "': rank 0 did not set it up within " << timeout_s_
                                  << " s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (header_->magic != kShmMagic || header_->world != static_cast<uint32_t>(world) ||
        header_->slot_bytes != slot_bytes_) {
      munmap(header_, mapped_bytes_);
      GRADCOMP_CHECK(false, "shared-memory group '" << name << "' was made for another group");
    }
  }
  header_->attached.fetch_add(1);
  try {
    barrier("attach");
  } catch (...) {
    if (rank == 0) shm_unlink(name.c_str());
    munmap(header_, mapped_bytes_);
    header_ = nullptr;
    throw;
  }
  // Everyone has it mapped: the name can go, the memory lives until the last rank unmaps it.
  if (rank == 0) shm_unlink(name.c_str());
}

ShmCommunicator::~ShmCommunicator() {
  if (header_ != nullptr) munmap(header_, mapped_bytes_);
}

uint8_t* ShmCommunicator::slot(int rank) const {
  return reinterpret_cast<uint8_t*>(header_) + kHeaderBytes +
         slot_bytes_ * static_cast<size_t>(rank);
}

void ShmCommunicator::barrier(const char* what) {
  Header& h = *header_;
  GRADCOMP_CHECK(h.failed.load() == 0, "shared-memory "
                                           << what << ": a peer of rank " << rank_
                                           << " gave up earlier; the group is unusable");
  const uint32_t gen = h.generation.load(std::memory_order_acquire);
  if (h.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(world_)) {
    h.arrived.store(0, std::memory_order_relaxed);
    h.generation.fetch_add(1, std::memory_order_release);
    wake_all(h.generation);
    // A peer that gave up while counted as arrived: this barrier did not really complete.
    GRADCOMP_CHECK(h.failed.load() == 0, "shared-memory " << what << ": a peer of rank " << rank_
                                                          << " gave up; the group is unusable");
    return;
  }
  const auto deadline = deadline_after(timeout_s_);
  while (h.generation.load(std::memory_order_acquire) == gen) {
    if (h.failed.load() != 0) {
      GRADCOMP_CHECK(false, "shared-memory " << what << ": a peer of rank " << rank_
                                             << " gave up; the group is unusable");
    }
    if (Clock::now() >= deadline) {
      const uint32_t arrived = h.arrived.load();
      h.failed.store(1);
      wake_all(h.generation);
      GRADCOMP_CHECK(false, "shared-memory " << what << ": rank " << rank_ << " waited "
                                             << timeout_s_ << " s; only " << arrived << " of "
                                             << world_ << " ranks arrived");
    }
    wait_on(h.generation, gen);
  }
  GRADCOMP_CHECK(h.failed.load() == 0, "shared-memory " << what << ": a peer of rank " << rank_
                                                        << " gave up; the group is unusable");
}

void ShmCommunicator::run_all_gather(const void* send, void* recv, size_t bytes) {
  run_all_gather_strided(send, recv, bytes, bytes);
}

void ShmCommunicator::run_all_gather_strided(const void* send, void* recv, size_t bytes,
                                             size_t recv_stride) {
  const auto* in = static_cast<const uint8_t*>(send);
  auto* out = static_cast<uint8_t*>(recv);
  for (size_t off = 0; off < bytes; off += slot_bytes_) {
    const size_t n = std::min(slot_bytes_, bytes - off);
    std::memcpy(slot(rank_), in + off, n);
    barrier("all_gather");
    for (int w = 0; w < world_; ++w) std::memcpy(out + recv_stride * w + off, slot(w), n);
    barrier("all_gather");
  }
}

void ShmCommunicator::run_all_to_all(const void* send, void* recv, size_t bytes) {
  const auto* in = static_cast<const uint8_t*>(send);
  auto* out = static_cast<uint8_t*>(recv);
  const size_t piece = slot_bytes_ / static_cast<size_t>(world_);
  for (size_t off = 0; off < bytes; off += piece) {
    const size_t n = std::min(piece, bytes - off);
    for (int w = 0; w < world_; ++w) std::memcpy(slot(rank_) + piece * w, in + bytes * w + off, n);
    barrier("all_to_all");
    for (int w = 0; w < world_; ++w) std::memcpy(out + bytes * w + off, slot(w) + piece * rank_, n);
    barrier("all_to_all");
  }
}

void ShmCommunicator::mean_of_slots(size_t piece_offset, int64_t numel, DType dtype,
                                    void* out) const {
  const uint8_t code = static_cast<uint8_t>(dtype);
  const float scale = 1.0f / static_cast<float>(world_);
  if (dtype == DType::kFloat32) {
    // The same arithmetic without conversions, in loops the compiler vectorises (the build
    // keeps mul and add apart: no FMA).
    float* sum = static_cast<float*>(out);
    const float* first = reinterpret_cast<const float*>(slot(0) + piece_offset);
    for (int64_t i = 0; i < numel; ++i) sum[i] = 0.0f + first[i] * scale;
    for (int w = 1; w < world_; ++w) {
      const float* from = reinterpret_cast<const float*>(slot(w) + piece_offset);
      for (int64_t i = 0; i < numel; ++i) sum[i] = sum[i] + from[i] * scale;
    }
    return;
  }
  std::vector<float> sum(static_cast<size_t>(numel), 0.0f);
  for (int w = 0; w < world_; ++w) {
    const uint8_t* from = slot(w) + piece_offset;
    for (int64_t i = 0; i < numel; ++i)
      sum[i] = math::add_rn(sum[i], math::mul_rn(math::load_as_float(from, i, code), scale));
  }
  for (int64_t i = 0; i < numel; ++i) math::store_from_float(out, i, code, sum[i]);
}

void ShmCommunicator::run_reduce_scatter_mean(const void* send, void* recv, int64_t numel_per_rank,
                                              DType dtype) {
  run_reduce_scatter_mean_strided(send, numel_per_rank, recv, numel_per_rank, dtype);
}

void ShmCommunicator::run_reduce_scatter_mean_strided(const void* send, int64_t send_stride,
                                                      void* recv, int64_t numel_per_rank,
                                                      DType dtype) {
  const size_t esize = dtype_size(dtype);
  const int64_t piece = static_cast<int64_t>(slot_bytes_ / esize / static_cast<size_t>(world_));
  const auto* in = static_cast<const uint8_t*>(send);
  auto* out = static_cast<uint8_t*>(recv);
  for (int64_t off = 0; off < numel_per_rank; off += piece) {
    const int64_t n = std::min(piece, numel_per_rank - off);
    for (int w = 0; w < world_; ++w) {
      std::memcpy(slot(rank_) + static_cast<size_t>(piece * w) * esize,
                  in + static_cast<size_t>(send_stride * w + off) * esize,
                  static_cast<size_t>(n) * esize);
    }
    barrier("reduce_scatter");
    mean_of_slots(static_cast<size_t>(piece * rank_) * esize, n, dtype,
                  out + static_cast<size_t>(off) * esize);
    barrier("reduce_scatter");
  }
}

void ShmCommunicator::run_allreduce_mean(void* data, int64_t numel, DType dtype) {
  const size_t esize = dtype_size(dtype);
  const int64_t piece = static_cast<int64_t>(slot_bytes_ / esize);
  auto* io = static_cast<uint8_t*>(data);
  for (int64_t off = 0; off < numel; off += piece) {
    const int64_t n = std::min(piece, numel - off);
    std::memcpy(slot(rank_), io + static_cast<size_t>(off) * esize, static_cast<size_t>(n) * esize);
    barrier("allreduce");
    mean_of_slots(0, n, dtype, io + static_cast<size_t>(off) * esize);
    barrier("allreduce");
  }
}

}  // namespace gradcomp
