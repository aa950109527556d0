// One backend allocation, zeroed when made and released (never throwing) when dropped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "gradcomp/backend.h"

namespace gradcomp {
namespace detail {

class BackendBuffer {
 public:
  BackendBuffer() = default;
  BackendBuffer(Backend& backend, size_t bytes) : backend_(&backend), bytes_(bytes) {
    ptr_ = backend.allocate(bytes);
    backend.fill_zero(ptr_, bytes);
  }
  BackendBuffer(BackendBuffer&& o) noexcept { *this = std::move(o); }
  BackendBuffer& operator=(BackendBuffer&& o) noexcept {
    std::swap(backend_, o.backend_);
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  BackendBuffer(const BackendBuffer&) = delete;
  BackendBuffer& operator=(const BackendBuffer&) = delete;
  ~BackendBuffer() {
    if (backend_ != nullptr && ptr_ != nullptr) backend_->release(ptr_);
  }
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace detail
}  // namespace gradcomp
