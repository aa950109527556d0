// One backend allocation, zeroed when made and released (never throwing) when dropped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "gradcomp/backend.h"
#include "gradcomp/types.h"

namespace gradcomp {
namespace detail {

class BackendBuffer {
 public:
  BackendBuffer() = default;
  BackendBuffer(Backend& backend, size_t bytes) : BackendBuffer(backend, bytes, bytes) {}
  // Room for `capacity` bytes, of which the first `bytes` are in use (see resize()).
  BackendBuffer(Backend& backend, size_t bytes, size_t capacity)
      : backend_(&backend), bytes_(bytes), capacity_(capacity) {
    GRADCOMP_CHECK(bytes <= capacity,
                   "BackendBuffer: " << bytes << " bytes in a buffer of " << capacity);
    ptr_ = backend.allocate(capacity);
    backend.fill_zero(ptr_, capacity);
  }
  BackendBuffer(BackendBuffer&& o) noexcept { *this = std::move(o); }
  BackendBuffer& operator=(BackendBuffer&& o) noexcept {
    std::swap(backend_, o.backend_);
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    std::swap(capacity_, o.capacity_);
    return *this;
  }
  BackendBuffer(const BackendBuffer&) = delete;
  BackendBuffer& operator=(const BackendBuffer&) = delete;
  ~BackendBuffer() {
    if (backend_ != nullptr && ptr_ != nullptr) backend_->release(ptr_);
  }
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }
  size_t bytes() const { return bytes_; }
  size_t capacity() const { return capacity_; }
  // Reuse for `bytes` bytes (at most the capacity); the contents stay as they were.
  void resize(size_t bytes) {
    GRADCOMP_CHECK(bytes <= capacity_,
                   "BackendBuffer: " << bytes << " bytes in a buffer of " << capacity_);
    bytes_ = bytes;
  }

 private:
  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  size_t capacity_ = 0;
};

}  // namespace detail
}  // namespace gradcomp
