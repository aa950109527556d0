// The hierarchical allreduce: a reduce-scatter inside the node, the compressed exchange of each
// shard across nodes, an allgather inside the node.
#include <exception>
#include <sstream>
#include <vector>

#include "allreduce_bucket.h"
#include "collective_queue.h"

namespace gradcomp {
namespace {

using Buffer = detail::BackendBuffer;

}  // namespace

void CompressedAllreduce::reduce_hierarchical(Bucket& b, const Segment* segments, int num_segments,
                                              DType dtype) {
  const size_t esize = dtype_size(dtype);
  const size_t shard_bytes = static_cast<size_t>(b.numel) * esize;
  // One segment of L whole shards (the usual DDP bucket) is exchanged in place; otherwise the
  // segments are gathered into a zero-padded buffer first and scattered back at the end.
  const int local = local_world_size();
  const bool in_place =
      num_segments == 1 && segments[0].offset == 0 && b.numel * local == b.full_numel;
  if (!in_place) {
    if (b.node_send.get() == nullptr) {
      b.node_send = Buffer(backend_, shard_bytes * local);
      backend_.fill_zero(b.node_send.get(), shard_bytes * local);  // the padding stays zero
      b.node_gathered = Buffer(backend_, shard_bytes * local);
    }
    for (int i = 0; i < num_segments; ++i) {
      backend_.copy(b.node_send.get() + static_cast<size_t>(segments[i].offset) * esize,
                    segments[i].data, static_cast<size_t>(segments[i].numel) * esize);
    }
  }
  const uint8_t* bucket_in =
      in_place ? static_cast<const uint8_t*>(segments[0].data) : b.node_send.get();
  uint8_t* bucket_out = in_place ? static_cast<uint8_t*>(segments[0].data) : b.node_gathered.get();
  InFlight shard;
  shard.bucket = &b;
  shard.segments = {Segment{b.node_shard.get(), 0, b.numel}};
  shard.dtype = dtype;
  detail::CollectiveQueue& node_queue = node_collectives_for(b);
  try {
    if (pipelines_node_stages(b)) {
      // Piece p of every inter-node chunk is reduced inside the node (a strided reduce-scatter of
      // that piece of every local rank's shard) while earlier pieces are encoded and on the
      // wire, and gathered back inside the node while later pieces are decoded.
      const int nodes = comm_.world_size();
      // Piece p of chunk c: its byte offset in a shard, and its elements.
      auto piece_at = [&](int c, int p) {
        return static_cast<size_t>(b.piece_begin(c, p)) * esize;
      };
      auto piece_n = [&](int c, int p) { return static_cast<size_t>(b.piece_numel(c, p)); };
      std::vector<uint64_t> reduced(b.pieces);
      for (int p = 0; p < b.pieces; ++p) {
        for (int c = 0; c < nodes; ++c) {
          const size_t at = piece_at(c, p), n = piece_n(c, p);
          if (n == 0) continue;
          uint8_t* out = b.node_shard.get() + at;
          const uint8_t* in = bucket_in + at;
          const int64_t stride = b.numel;
          reduced[p] = node_queue.post([this, in, out, n, stride, dtype] {
            node_->reduce_scatter_mean_strided(in, stride, out, static_cast<int64_t>(n), dtype);
          });
        }
      }
      std::exception_ptr rejected;
      bool node_failed = false;  // the node's reduce-scatter, not the exchange between nodes
      try {
        post_q4_two_phase(b, shard, shard.segments.data(), 1, static_cast<uint8_t>(dtype),
                          [&](int p) {
                            try {
                              node_queue.wait(reduced[p]);
                            } catch (...) {
                              node_failed = true;
                              throw;
                            }
                          });
        check_q4_two_phase(b, shard);
      } catch (...) {
        rejected = node_failed ? std::current_exception() : between_nodes(std::current_exception());
      }
      agree_in_node(b, rejected);
      decode_q4_two_phase(b, shard, [&](int p) {
        for (int c = 0; c < nodes; ++c) {
          const size_t at = piece_at(c, p), n = piece_n(c, p);
          if (n == 0) continue;
          const uint8_t* in = b.node_shard.get() + at;
          uint8_t* out = bucket_out + at;
          const size_t bytes = n * esize;
          node_queue.post([this, in, out, bytes, shard_bytes] {
            node_->all_gather_strided(in, out, bytes, shard_bytes);
          });
        }
      });
      // The last ticket: every piece's allgather is done.
      node_queue.wait(node_queue.post([] {}));
    } else {
      node_blocking(
          [&] { node_->reduce_scatter_mean(bucket_in, b.node_shard.get(), b.numel, dtype); });
      std::exception_ptr rejected;
      try {
        post_compressed(b, shard, shard.segments.data(), 1);
        finish_compressed(b, shard);
      } catch (...) {
        rejected = between_nodes(std::current_exception());
      }
      agree_in_node(b, rejected);
      node_blocking([&] { node_->all_gather(b.node_shard.get(), bucket_out, shard_bytes); });
    }
  } catch (...) {
    node_queue.drain();
    throw;
  }
  if (!in_place) {
    for (int i = 0; i < num_segments; ++i) {
      backend_.copy(segments[i].data,
                    b.node_gathered.get() + static_cast<size_t>(segments[i].offset) * esize,
                    static_cast<size_t>(segments[i].numel) * esize);
    }
  }
  // A non-finite shard was decoded only by the ranks that reduced it: the scan of the gathered
  // bucket lets every rank of the node keep its residuals alike.
  NonfiniteScanParams scan;
  scan.segments = segments;
  scan.num_segments = num_segments;
  scan.dtype = static_cast<uint8_t>(dtype);
  scan.numel = b.full_numel;
  backend_.scan_nonfinite(scan);
}

bool CompressedAllreduce::pipelines_node_stages(const Bucket& b) const {
  return node_ != nullptr && !backend_.is_cuda() && block_codec(config_.codec) &&
         config_.q4_algorithm == Q4Algorithm::kTwoPhase && config_.piece_numel != 0 && b.pieces > 1;
}

std::exception_ptr CompressedAllreduce::between_nodes(std::exception_ptr error) const {
  // The exchange's errors name its own ranks (one per node).
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    const int local = local_world_size();
    std::ostringstream o;
    o << "in the exchange between nodes, whose rank i is global rank " << local << " i + "
      << global_rank_ % local << ": " << e.what();
    if (dynamic_cast<const PayloadError*>(&e) != nullptr)
      return std::make_exception_ptr(PayloadError(o.str()));
    return std::make_exception_ptr(Error(o.str()));
  } catch (...) {
    return error;
  }
}

void CompressedAllreduce::agree_in_node(const Bucket& b, std::exception_ptr rejected) {
  // Each local rank decodes other payloads (its own shard's), so one may reject what the others
  // accepted; they must not wait for its allgather until the transport's timeout. On a device the
  // decodes report later, through the stream (synchronize), and nothing is agreed here.
  if (backend_.is_cuda()) {
    if (rejected) std::rethrow_exception(rejected);
    return;
  }
  const int local = local_world_size();
  const int32_t mine = rejected ? 1 : 0;
  static_assert(sizeof mine == kNodeAgreementBytes, "the agreement is one word per rank");
  std::vector<int32_t> all(local);
  try {
    Buffer send(backend_, sizeof mine), recv(backend_, sizeof mine * local);
    backend_.copy_from_host(send.get(), &mine, sizeof mine);
    node_blocking([&] { node_->all_gather(send.get(), recv.get(), sizeof mine); });
    backend_.copy_to_host(all.data(), recv.get(), sizeof mine * local);
  } catch (...) {
    // The first error is the one to report; a node that cannot agree has failed anyway.
    if (rejected) std::rethrow_exception(rejected);
    throw;
  }
  if (rejected) std::rethrow_exception(rejected);
  const int node = comm_.rank();
  for (int w = 0; w < local; ++w) {
    GRADCOMP_CHECK(all[w] == 0, "bucket " << b.id << ": rank " << node * local + w
                                          << " (local rank " << w << " of node " << node
                                          << ") rejected a payload of its shard, so rank "
                                          << global_rank_ << " stops the bucket too");
  }
}

}  // namespace gradcomp
