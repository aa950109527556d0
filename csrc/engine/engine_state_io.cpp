// EngineState as bytes, for front ends that checkpoint without Python (GradSync): a versioned,
// checksummed record that is parsed in full before anything of it is used.
#include <cstring>

#include "gradcomp/engine.h"

namespace gradcomp {
namespace {

constexpr uint32_t kStateMagic = 0x53454347u;  // "GCES" in little-endian byte order
constexpr uint32_t kStateVersion = 3;          // 2 added the top-k velocities, 3 the ranks per node

uint64_t fnv1a64(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

class Writer {
 public:
  template <typename T>
  void put(T v) {
    const size_t at = out.size();
    out.resize(at + sizeof v);
    std::memcpy(out.data() + at, &v, sizeof v);
  }
  void bytes(const std::vector<uint8_t>& b) {
    put<uint64_t>(b.size());
    out.insert(out.end(), b.begin(), b.end());
  }
  std::vector<uint8_t> out;
};

class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  template <typename T>
  T get(const char* what) {
    T v;
    need(sizeof v, what);
    std::memcpy(&v, p_ + at_, sizeof v);
    at_ += sizeof v;
    return v;
  }
  std::vector<uint8_t> bytes(const char* what) {
    const uint64_t size = get<uint64_t>(what);
    need(size, what);
    std::vector<uint8_t> v(p_ + at_, p_ + at_ + size);
    at_ += size;
    return v;
  }
  // A count of records of at least `each` bytes, which the rest of the data must be able to hold.
  uint64_t count(size_t each, const char* what) {
    const uint64_t c = get<uint64_t>(what);
    GRADCOMP_CHECK(c <= (n_ - at_) / each, "engine state: " << what << " count " << c
                                                            << " does not fit in the remaining "
                                                            << n_ - at_ << " bytes");
    return c;
  }
  size_t offset() const { return at_; }

 private:
  void need(uint64_t bytes, const char* what) {
    GRADCOMP_CHECK(bytes <= n_ - at_, "engine state is truncated: "
                                          << what << " needs " << bytes << " bytes at offset "
                                          << at_ << ", " << n_ - at_ << " remain");
  }
  const uint8_t* p_;
  size_t n_;
  size_t at_ = 0;
};

void write_residuals(Writer& w, const std::map<uint64_t, std::vector<uint8_t>>& m) {
  w.put<uint64_t>(m.size());
  for (const auto& [id, bytes] : m) {
    w.put<uint64_t>(id);
    w.bytes(bytes);
  }
}

std::map<uint64_t, std::vector<uint8_t>> read_residuals(Reader& r, const char* what) {
  std::map<uint64_t, std::vector<uint8_t>> m;
  const uint64_t n = r.count(16, what);
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t id = r.get<uint64_t>(what);
    GRADCOMP_CHECK(m.count(id) == 0, "engine state: bucket " << id << " appears twice in " << what);
    m[id] = r.bytes(what);
  }
  return m;
}

}  // namespace

std::vector<uint8_t> serialize_engine_state(const EngineState& s) {
  Writer w;
  w.put<uint32_t>(kStateMagic);
  w.put<uint32_t>(kStateVersion);
  w.put<uint64_t>(s.compression.seed);
  w.put<uint32_t>(s.compression.step);
  w.put<uint8_t>(s.started ? 1 : 0);
  w.put<int32_t>(s.world_size);
  w.put<int32_t>(s.local_world_size);
  write_residuals(w, s.compression.residuals);
  write_residuals(w, s.compression.chunk_residuals);
  write_residuals(w, s.compression.velocities);
  w.put<uint64_t>(s.layouts.size());
  for (const auto& [id, layout] : s.layouts) {
    w.put<uint64_t>(id);
    w.put<int64_t>(layout.index);
    w.put<uint8_t>(static_cast<uint8_t>(layout.dtype));
    w.put<uint64_t>(layout.params.size());
    for (const auto& [param, numel] : layout.params) {
      w.put<int64_t>(param);
      w.put<int64_t>(numel);
    }
  }
  w.put<uint64_t>(fnv1a64(w.out.data(), w.out.size()));
  return w.out;
}

EngineState parse_engine_state(const uint8_t* data, size_t size) {
  GRADCOMP_CHECK(data != nullptr || size == 0, "engine state: no data");
  GRADCOMP_CHECK(size >= 8 + 8, "engine state of " << size << " bytes is too short to be one");
  uint64_t checksum;
  std::memcpy(&checksum, data + size - 8, 8);
  Reader r(data, size - 8);
  GRADCOMP_CHECK(r.get<uint32_t>("magic") == kStateMagic,
                 "not a gradcomp engine state (bad magic)");
  const uint32_t version = r.get<uint32_t>("version");
  GRADCOMP_CHECK(version >= 1 && version <= kStateVersion,
                 "engine state version " << version << " is not supported (expected 1 to "
                                         << kStateVersion << ")");
  GRADCOMP_CHECK(checksum == fnv1a64(data, size - 8),
                 "engine state checksum mismatch: the checkpoint is corrupted");
  EngineState s;
  s.compression.seed = r.get<uint64_t>("seed");
  s.compression.step = r.get<uint32_t>("step");
  const uint8_t started = r.get<uint8_t>("started");
  GRADCOMP_CHECK(started <= 1, "engine state: 'started' is " << int(started));
  s.started = started == 1;
  s.world_size = r.get<int32_t>("world size");
  GRADCOMP_CHECK(s.world_size >= 0, "engine state: world size " << s.world_size);
  if (version >= 3) {
    s.local_world_size = r.get<int32_t>("ranks per node");
    GRADCOMP_CHECK(
        s.local_world_size >= 0 && (s.world_size == 0 || s.local_world_size <= s.world_size),
        "engine state: " << s.local_world_size << " ranks per node in a world of " << s.world_size);
  }
  s.compression.residuals = read_residuals(r, "residuals");
  s.compression.chunk_residuals = read_residuals(r, "chunk residuals");
  if (version >= 2) s.compression.velocities = read_residuals(r, "velocities");
  const uint64_t layouts = r.count(25, "layouts");
  for (uint64_t i = 0; i < layouts; ++i) {
    const uint64_t id = r.get<uint64_t>("layout");
    BucketLayout layout;
    layout.index = r.get<int64_t>("layout index");
    const uint8_t dtype = r.get<uint8_t>("layout dtype");
    GRADCOMP_CHECK(math::dtype_valid(dtype),
                   "engine state: layout of bucket " << id << " has dtype code " << int(dtype));
    layout.dtype = static_cast<DType>(dtype);
    const uint64_t params = r.count(16, "layout parameters");
    for (uint64_t j = 0; j < params; ++j) {
      const int64_t param = r.get<int64_t>("parameter");
      const int64_t numel = r.get<int64_t>("parameter size");
      GRADCOMP_CHECK(param >= 0 && numel >= 0, "engine state: layout of bucket "
                                                   << id << " has parameter " << param << " of "
                                                   << numel << " elements");
      layout.params.emplace_back(param, numel);
    }
    GRADCOMP_CHECK(s.layouts.count(id) == 0, "engine state: bucket " << id << " has two layouts");
    s.layouts[id] = std::move(layout);
  }
  GRADCOMP_CHECK(r.offset() == size - 8,
                 "engine state has " << size - 8 - r.offset() << " bytes after its last field");
  return s;
}

}  // namespace gradcomp
