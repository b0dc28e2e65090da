// XLA FFI handlers of the gfx950 kernels: check the buffers XLA passes, pack FlyDSL's launch
// arguments and launch on XLA's stream. One handler per custom call target:
//   jsm_sparse_mla, jsm_mla_decode_partials, jsm_mla_decode_combine,
//   jsm_ultraquant_partials, jsm_ultraquant_reduce; and the diagnostics jsm_mfma_probe and
//   jsm_ds_read_tr_probe.
// The argument orders and preconditions are those of jax_sparse_mla/kernels/gfx950/*.py.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "jsm_configs.h"  // generated from kernels/gfx950/configs.py by build_lib.py
#include "jsm_ffi.h"

namespace ffi = xla::ffi;
using ffi::AnyBuffer;
using ffi::DataType;
using ffi::Error;

namespace jsm {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kKvDim = 576;         // K = latent (512) ‖ rope (64)
constexpr int64_t kLatentDim = 512;     // V
constexpr int64_t kRecordBytes = 656;   // one fp8_ds_mla record
constexpr int64_t kUqHeadDim = 256;

#ifdef JSM_RECORDING
// The recording build runs on XLA CPU, which has no stream or device: fixed stand-ins.
struct HostStream {};
struct HostDevice {};
constexpr uintptr_t kRecordingStream = 0x5157;
}  // namespace
}  // namespace jsm
namespace xla::ffi {
template <>
struct CtxDecoding<jsm::HostStream> {
  using Type = void*;
  static std::optional<Type> Decode(const XLA_FFI_Api*, XLA_FFI_ExecutionContext*,
                                    DiagnosticEngine&) {
    return reinterpret_cast<void*>(jsm::kRecordingStream);
  }
};
template <>
struct CtxDecoding<jsm::HostDevice> {
  using Type = int32_t;
  static std::optional<Type> Decode(const XLA_FFI_Api*, XLA_FFI_ExecutionContext*,
                                    DiagnosticEngine&) {
    return 0;
  }
};
}  // namespace xla::ffi
namespace jsm {
namespace {
using StreamCtx = HostStream;
using DeviceCtx = HostDevice;
#else
using StreamCtx = ffi::PlatformStream<void*>;
using DeviceCtx = ffi::DeviceOrdinal;
#endif

// ------------------------------------------------------------------------------------------
// Checking buffers: every failure names the target, the argument and what was expected.
// ------------------------------------------------------------------------------------------

const char* TypeName(DataType t) {
  switch (t) {
    case DataType::U8: return "u8";
    case DataType::S32: return "s32";
    case DataType::U32: return "u32";
    case DataType::BF16: return "bf16";
    case DataType::F32: return "f32";
    case DataType::F16: return "f16";
    case DataType::S8: return "s8";
    case DataType::S64: return "s64";
    case DataType::F64: return "f64";
    case DataType::F8E4M3FN: return "f8e4m3fn";
    default: return "another type";
  }
}

std::string Describe(const AnyBuffer& b) {
  std::string s = std::string(TypeName(b.element_type())) + "[";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// `dims`: the expected dimensions, -1 for any; `what`: how to say them, e.g. "[n_q, H, 576]".
Error Expect(const char* target, const char* name, const AnyBuffer& b, DataType dtype,
             std::vector<int64_t> dims, const std::string& what) {
  bool ok = b.element_type() == dtype && b.dimensions().size() == dims.size();
  for (size_t i = 0; ok && i < dims.size(); ++i) {
    ok = dims[i] < 0 || b.dimensions()[i] == dims[i];
  }
  if (ok) return Error::Success();
  return Error::InvalidArgument(std::string(target) + ": " + name + " must be " +
                                TypeName(dtype) + what + ", got " + Describe(b));
}

Error Limit(const char* target, const std::string& what, int64_t value, int64_t max) {
  if (value <= max) return Error::Success();
  return Error::InvalidArgument(std::string(target) + ": " + what + " = " +
                                std::to_string(value) + " exceeds the kernel's limit " +
                                std::to_string(max));
}

std::string Shape(std::initializer_list<std::string> parts) {
  std::string s = "[";
  for (const auto& p : parts) s += (s.size() > 1 ? ", " : "") + p;
  return s + "]";
}

// ------------------------------------------------------------------------------------------
// Launch grids, as the kernel modules' launchers compute them (threads per workgroup from
// configs.py, all in x). HSA caps a dispatch's grid at 2^32 - 1 work-items (workgroups x
// threads per workgroup) in each dimension; y and z are at most INT32_MAX workgroups of one
// work-item each here (the handlers' other limits), so x is the dimension to check.
// ------------------------------------------------------------------------------------------

constexpr int64_t kGridWorkItemsMax = (int64_t{1} << 32) - 1;

struct Grid {
  int64_t x, y, z;     // workgroups per dimension
  int64_t threads;     // per workgroup, along x
  const char* x_is;    // what x is, for the error message
};

// One workgroup per (row, split, head group), whole rounds of 8 (one per XCD) per group.
Grid SparseMlaGrid(int64_t n_q, int64_t splits, int64_t groups) {
  return {8 * groups * ((n_q * splits + 7) / 8), 1, 1, kSparseMlaThreads,
          "8 * head groups * ceil(n_q * S / 8)"};
}

// cta_rows = 128: the 128-row kernel (H / 128 head groups), else the 16-row ones.
Grid MlaDecodePartialsGrid(int64_t batch, int64_t heads, int64_t splits, int64_t qlen,
                           int64_t cta_rows) {
  const int64_t items = 8 * ((batch * splits + 7) / 8);
  if (cta_rows == kMlaDecodeM128Rows) {
    return {heads / kMlaDecodeM128Rows * items, 1, 1, kMlaDecodePartialsThreads,
            "8 * (H / 128) * ceil(B * S / 8)"};
  }
  const int64_t head_groups = (heads * qlen + kMlaDecodeRows - 1) / kMlaDecodeRows;
  return {head_groups * items, 1, 1, kMlaDecodePartialsThreads,
          "8 * ceil(H * qlen / 16) * ceil(B * S / 8)"};
}

Grid MlaDecodeCombineGrid(int64_t n, int64_t heads) {
  return {(n * heads + 3) / 4, 1, 1, kMlaDecodeCombineThreads, "ceil(n * H / 4)"};
}

Grid UltraquantPartialsGrid(int64_t batch, int64_t hk, int64_t parts) {
  return {batch, hk, parts, kUltraquantThreads, "B"};
}

Grid UltraquantReduceGrid(int64_t batch, int64_t hq) {
  return {batch, hq, 1, kUltraquantThreads, "B"};
}

Error CheckGrid(const char* target, const Grid& g) {
  const int64_t items = g.x * g.threads;
  if (items <= kGridWorkItemsMax) return Error::Success();
  return Error::InvalidArgument(
      std::string(target) + ": the grid's x dimension, " + g.x_is + " = " + std::to_string(g.x) +
      " workgroups of " + std::to_string(g.threads) + " threads = " + std::to_string(items) +
      " work-items, exceeds the HSA limit of 2^32 - 1 = " + std::to_string(kGridWorkItemsMax) +
      " work-items per grid dimension");
}

#define JSM_CHECK(expr)                       \
  do {                                        \
    if (Error e = (expr); e.failure()) return e; \
  } while (0)

const char* Ptr(const AnyBuffer& b, int64_t byte_offset = 0) {
  return static_cast<const char*>(b.untyped_data()) + byte_offset;
}

// ------------------------------------------------------------------------------------------
// sparse_mla: per (row, split, group of 16 heads) one workgroup. One launch serves the full groups
// (configuration h16), a second the remainder of H % 16 heads (q, out, lse offset by its first
// head). out / lse are [n_q, S, H(, 512)]: S = 1 the result, S > 1 the partials of the combine.
// ------------------------------------------------------------------------------------------

Error SparseMla(void* stream, int32_t device, AnyBuffer q, AnyBuffer kv, AnyBuffer idx,
                AnyBuffer indptr, ffi::Result<AnyBuffer> out, ffi::RemainingRets rest,
                float sm_scale) {
  constexpr const char* T = "jsm_sparse_mla";
  JSM_CHECK(Expect(T, "q", q, DataType::BF16, {-1, -1, kKvDim}, "[n_q, H, 576]"));
  const int64_t n_q = q.dimensions()[0], heads = q.dimensions()[1];
  const auto nq = std::to_string(n_q), h = std::to_string(heads);
  JSM_CHECK(Expect(T, "kv", kv, DataType::U8, {-1, kRecordBytes}, "[rows, 656]"));
  JSM_CHECK(Expect(T, "idx", idx, DataType::S32, {-1}, "[nnz]"));
  JSM_CHECK(Expect(T, "indptr", indptr, DataType::S32, {n_q + 1}, Shape({nq + " + 1"})));
  JSM_CHECK(Expect(T, "out", *out, DataType::BF16, {n_q, -1, heads, kLatentDim},
                   Shape({nq, "S", h, "512"})));
  const int64_t splits = out->dimensions()[1];
  const auto ss = std::to_string(splits);
  if (rest.size() > 1) {
    return Error::InvalidArgument(std::string(T) + ": expects 1 or 2 results (out[, lse]), got " +
                                  std::to_string(1 + rest.size()));
  }
  const bool with_lse = rest.size() == 1;
  if (splits < 1 || (splits > 1 && !with_lse)) {
    return Error::InvalidArgument(std::string(T) + ": S = " + ss + " splits: needs S >= 1, and "
                                  "the lse result when S > 1 (the combine's weights)");
  }
  const void* lse = nullptr;
  if (with_lse) {
    auto r = rest.get<AnyBuffer>(0);
    if (!r.has_value()) return r.error();
    JSM_CHECK(Expect(T, "lse", **r, DataType::F32, {n_q, splits, heads}, Shape({nq, ss, h})));
    lse = (*r)->untyped_data();
  }
  const int64_t nnz = idx.dimensions()[0];
  const int64_t full = heads / kSparseMaxHeads, rem = heads % kSparseMaxHeads;
  JSM_CHECK(Limit(T, "n_q * S", n_q * splits, kInt32Max - 7));
  JSM_CHECK(Limit(T, "nnz", nnz, (int64_t{1} << 30) - 1));  // a row holds < 2^30 entries
  JSM_CHECK(Limit(T, "q elements per row", heads * kKvDim, kInt32Max));
  JSM_CHECK(CheckGrid(T, SparseMlaGrid(n_q, splits, std::max<int64_t>(full, 1))));
  const int64_t kv_rows = std::min(kv.dimensions()[0], kInt32Max);  // idx cannot reach further
  // (first head, heads per workgroup, head groups) of each launch
  const int64_t launches[2][3] = {{0, kSparseMaxHeads, full}, {full * kSparseMaxHeads, rem, 1}};
  for (const auto& [h0, group, groups] : launches) {
    if (n_q == 0 || group == 0 || groups == 0) continue;
    const std::string symbol = "jsm_sparse_mla_h" + std::to_string(group) + "_l" +
                               (with_lse ? "1" : "0");
    LaunchArgs args;
    args.Tensor("Q", Ptr(q, h0 * kKvDim * 2), q.element_count() - h0 * kKvDim)
        .Tensor("KV", kv.untyped_data(), kv.element_count())
        .Tensor("IDX", idx.untyped_data(), idx.element_count())
        .Tensor("IPTR", indptr.untyped_data(), indptr.element_count())
        .Tensor("OUT", Ptr(*out, h0 * kLatentDim * 2), out->element_count() - h0 * kLatentDim)
        .Tensor("LSE", lse ? static_cast<const char*>(lse) + h0 * 4 : nullptr,
                lse ? n_q * splits * heads - h0 : 0)
        .I32("n_q", n_q).I32("nnz", nnz).I32("kv_rows", kv_rows)
        .I32("num_splits", splits).I32("head_groups", groups)
        .I32("q_row_stride", heads * kKvDim).I32("q_head_stride", kKvDim)
        .I32("out_row_stride", heads * kLatentDim).I32("out_head_stride", kLatentDim)
        .I32("lse_row_stride", heads).F32("sm_scale", sm_scale).Stream(stream);
    JSM_CHECK(Launch(symbol, args, device));
  }
  return Error::Success();
}

// ------------------------------------------------------------------------------------------
// mla_decode: split-KV partials, and the combine (also merge_attn_states).
// ------------------------------------------------------------------------------------------

Error MlaDecodePartials(void* stream, int32_t device, AnyBuffer q, AnyBuffer kv,
                        AnyBuffer kv_indices, AnyBuffer kv_indptr, ffi::Result<AnyBuffer> o_parts,
                        ffi::Result<AnyBuffer> lse_parts, int32_t qlen, int32_t cta_rows,
                        float k_scale, float v_scale, float sm_scale) {
  constexpr const char* T = "jsm_mla_decode_partials";
  if (!KernelQlen(qlen)) {
    return Error::InvalidArgument(std::string(T) + ": qlen must be one of " + KernelQlenText +
                                  " (the compiled kernels), got " + std::to_string(qlen));
  }
  if (cta_rows != kMlaDecodeRows && cta_rows != kMlaDecodeM128Rows) {
    return Error::InvalidArgument(std::string(T) + ": cta_rows (query rows per CTA) must be " +
                                  std::to_string(kMlaDecodeRows) + " or " +
                                  std::to_string(kMlaDecodeM128Rows) + ", got " +
                                  std::to_string(cta_rows));
  }
  JSM_CHECK(Expect(T, "kv_indptr", kv_indptr, DataType::S32, {-1}, "[B + 1]"));
  if (kv_indptr.dimensions()[0] == 0) {
    return Error::InvalidArgument(std::string(T) + ": kv_indptr must hold B + 1 >= 1 entries");
  }
  const int64_t batch = kv_indptr.dimensions()[0] - 1;
  const int64_t rows = batch * qlen;
  const auto r = std::to_string(rows);
  JSM_CHECK(Expect(T, "q", q, DataType::BF16, {rows, -1, kKvDim},
                   Shape({"B * qlen = " + r, "H", "576"})));
  const int64_t heads = q.dimensions()[1];
  JSM_CHECK(Expect(T, "kv", kv, DataType::U8, {-1, kKvDim}, "[tokens, 576]"));
  JSM_CHECK(Expect(T, "kv_indices", kv_indices, DataType::S32, {-1}, "[n]"));
  JSM_CHECK(Expect(T, "o_parts", *o_parts, DataType::BF16, {rows, -1, heads, kLatentDim},
                   Shape({r, "S", std::to_string(heads), "512"})));
  const int64_t splits = o_parts->dimensions()[1];
  JSM_CHECK(Expect(T, "lse_parts", *lse_parts, DataType::F32, {rows, splits, heads},
                   Shape({r, std::to_string(splits), std::to_string(heads)})));
  const int64_t n_indices = kv_indices.dimensions()[0];
  JSM_CHECK(Limit(T, "kv_indices length", n_indices, (int64_t{1} << 29) - 1));
  if (cta_rows == kMlaDecodeM128Rows && !MlaDecodeM128Serves(qlen, heads)) {
    return Error::InvalidArgument(std::string(T) + ": the 128-row kernel serves qlen 1 and H a "
                                  "positive multiple of 128, got qlen " + std::to_string(qlen) +
                                  ", H " + std::to_string(heads));
  }
  const Grid grid = MlaDecodePartialsGrid(batch, heads, splits, qlen, cta_rows);
  JSM_CHECK(Limit(T, "the grid (8 * head groups * ceil(B * S / 8) CTAs)", grid.x, kInt32Max));
  JSM_CHECK(CheckGrid(T, grid));
  if (batch == 0 || heads == 0 || splits == 0) return Error::Success();
  LaunchArgs args;
  args.Tensor("Q", q.untyped_data(), q.element_count())
      .Tensor("KV", kv.untyped_data(), kv.element_count())
      .Tensor("IDX", kv_indices.untyped_data(), kv_indices.element_count())
      .Tensor("IPTR", kv_indptr.untyped_data(), kv_indptr.element_count())
      .Tensor("OP", o_parts->untyped_data(), o_parts->element_count())
      .Tensor("LP", lse_parts->untyped_data(), lse_parts->element_count())
      .I32("num_requests", batch).I32("num_heads", heads).I32("num_splits", splits)
      .I32("n_indices", n_indices).I32("tokens", std::min(kv.dimensions()[0], kInt32Max))
      .F32("k_scale", k_scale).F32("v_scale", v_scale).F32("sm_scale", sm_scale)
      .Stream(stream);
  const std::string kernel = cta_rows == kMlaDecodeM128Rows
                                 ? std::string(kMlaDecodeM128)
                                 : "jsm_mla_decode_partials_q" + std::to_string(qlen);
  return Launch(kernel, args, device);
}

Error MlaDecodeCombine(void* stream, int32_t device, AnyBuffer o_parts, AnyBuffer lse_parts,
                       ffi::Result<AnyBuffer> out, ffi::Result<AnyBuffer> lse) {
  constexpr const char* T = "jsm_mla_decode_combine";
  JSM_CHECK(Expect(T, "o_parts", o_parts, DataType::BF16, {-1, -1, -1, kLatentDim},
                   "[n, S, H, 512]"));
  const auto d = o_parts.dimensions();
  const int64_t n = d[0], splits = d[1], heads = d[2];
  const auto sn = std::to_string(n), ss = std::to_string(splits), sh = std::to_string(heads);
  JSM_CHECK(Expect(T, "lse_parts", lse_parts, DataType::F32, {n, splits, heads},
                   Shape({sn, ss, sh})));
  JSM_CHECK(Expect(T, "out", *out, DataType::BF16, {n, heads, kLatentDim}, Shape({sn, sh, "512"})));
  JSM_CHECK(Expect(T, "lse", *lse, DataType::F32, {n, heads}, Shape({sn, sh})));
  JSM_CHECK(Limit(T, "n * H", n * heads, kInt32Max - 3));
  JSM_CHECK(CheckGrid(T, MlaDecodeCombineGrid(n, heads)));
  if (n == 0 || heads == 0) return Error::Success();
  if (splits == 0) {
    return Error::InvalidArgument(std::string(T) + ": o_parts needs at least one split (S >= 1)");
  }
  LaunchArgs args;
  args.Tensor("OP", o_parts.untyped_data(), o_parts.element_count())
      .Tensor("LP", lse_parts.untyped_data(), lse_parts.element_count())
      .Tensor("OUT", out->untyped_data(), out->element_count())
      .Tensor("LOUT", lse->untyped_data(), lse->element_count())
      .I32("num_rows", n * heads).I32("num_heads", heads).I32("num_splits", splits)
      .Stream(stream);
  return Launch("jsm_mla_decode_combine", args, device);
}

// ------------------------------------------------------------------------------------------
// ultraquant_decode: per-partition partials, then their reduce.
// ------------------------------------------------------------------------------------------

Error UltraquantPartials(void* stream, int32_t device, AnyBuffer q, AnyBuffer cache,
                         AnyBuffer block_tables, AnyBuffer seq_lens,
                         ffi::Result<AnyBuffer> out_parts, ffi::Result<AnyBuffer> max_logits,
                         ffi::Result<AnyBuffer> exp_sums, float sm_scale) {
  constexpr const char* T = "jsm_ultraquant_partials";
  JSM_CHECK(Expect(T, "cache", cache, DataType::U8, {-1, -1, -1, -1},
                   "[num_blocks, block_size, Hk, slot_bytes]"));
  const auto c = cache.dimensions();
  const int64_t num_blocks = c[0], block_size = c[1], hk = c[2], slot_bytes = c[3];
  if (!KernelBlockSize(block_size)) {
    return Error::InvalidArgument(std::string(T) + ": cache block_size must be one of " +
                                  KernelBlockSizeText + " (the compiled kernels), got " +
                                  std::to_string(block_size));
  }
  if (slot_bytes < 272 || slot_bytes % 4 != 0) {
    return Error::InvalidArgument(std::string(T) + ": cache slot_bytes must be >= 272 and a "
                                  "multiple of 4, got " + std::to_string(slot_bytes));
  }
  JSM_CHECK(Expect(T, "q", q, DataType::BF16, {-1, -1, kUqHeadDim}, "[B, Hq, 256]"));
  const int64_t batch = q.dimensions()[0], hq = q.dimensions()[1];
  if (hk == 0 || hq % hk != 0 || !KernelGroupSize(hq / hk)) {
    return Error::InvalidArgument(std::string(T) + ": Hq / Hk must be one of " +
                                  KernelGroupSizeText + " (the compiled kernels), got Hq = " +
                                  std::to_string(hq) + ", Hk = " + std::to_string(hk));
  }
  const int64_t g = hq / hk;
  const auto sb = std::to_string(batch), shk = std::to_string(hk), sg = std::to_string(g);
  JSM_CHECK(Expect(T, "block_tables", block_tables, DataType::S32, {batch, -1},
                   Shape({sb, "max_blocks"})));
  JSM_CHECK(Expect(T, "seq_lens", seq_lens, DataType::S32, {batch}, Shape({sb})));
  JSM_CHECK(Expect(T, "out_parts", *out_parts, DataType::BF16, {batch, hk, -1, g, kUqHeadDim},
                   Shape({sb, shk, "P", sg, "256"})));
  const int64_t parts = out_parts->dimensions()[2];
  const auto sp = std::to_string(parts);
  JSM_CHECK(Expect(T, "max_logits", *max_logits, DataType::F32, {batch, hk, parts, g},
                   Shape({sb, shk, sp, sg})));
  JSM_CHECK(Expect(T, "exp_sums", *exp_sums, DataType::F32, {batch, hk, parts, g},
                   Shape({sb, shk, sp, sg})));
  const int64_t max_blocks = block_tables.dimensions()[1];
  JSM_CHECK(Limit(T, "16 * Hk * slot_bytes", 16 * hk * slot_bytes, kInt32Max));
  JSM_CHECK(Limit(T, "max_blocks * block_size", max_blocks * block_size, kInt32Max));
  JSM_CHECK(Limit(T, "B * Hq * P", batch * hq * parts, kInt32Max));
  JSM_CHECK(Limit(T, "num_blocks", num_blocks, kInt32Max));
  JSM_CHECK(CheckGrid(T, UltraquantPartialsGrid(batch, hk, parts)));
  if (batch == 0 || parts == 0) return Error::Success();
  LaunchArgs args;
  args.Tensor("out_parts", out_parts->untyped_data(), out_parts->element_count())
      .Tensor("max_logits", max_logits->untyped_data(), max_logits->element_count())
      .Tensor("exp_sums", exp_sums->untyped_data(), exp_sums->element_count())
      .Tensor("q", q.untyped_data(), q.element_count())
      .Tensor("cache", cache.untyped_data(), cache.element_count())
      .Tensor("block_tables", block_tables.untyped_data(), block_tables.element_count())
      .Tensor("seq_lens", seq_lens.untyped_data(), seq_lens.element_count())
      .I32("num_seqs", batch).I32("num_kv_heads", hk).I32("slot_bytes", slot_bytes)
      .I32("num_blocks", num_blocks).I32("max_blocks_per_seq", max_blocks)
      .I32("num_partitions", parts).I32("stride_q_seq", hq * kUqHeadDim)
      .I32("stride_q_head", kUqHeadDim).F32("sm_scale", sm_scale).Stream(stream);
  return Launch("jsm_ultraquant_decode_g" + std::to_string(g) + "_bs" +
                    std::to_string(block_size), args, device);
}

Error UltraquantReduce(void* stream, int32_t device, AnyBuffer out_parts, AnyBuffer max_logits,
                       AnyBuffer exp_sums, ffi::Result<AnyBuffer> out) {
  constexpr const char* T = "jsm_ultraquant_reduce";
  JSM_CHECK(Expect(T, "out_parts", out_parts, DataType::BF16, {-1, -1, -1, -1, kUqHeadDim},
                   "[B, Hk, P, G, 256]"));
  const auto d = out_parts.dimensions();
  const int64_t batch = d[0], hk = d[1], parts = d[2], g = d[3];
  const auto sb = std::to_string(batch), shk = std::to_string(hk), sp = std::to_string(parts),
             sg = std::to_string(g);
  JSM_CHECK(Expect(T, "max_logits", max_logits, DataType::F32, {batch, hk, parts, g},
                   Shape({sb, shk, sp, sg})));
  JSM_CHECK(Expect(T, "exp_sums", exp_sums, DataType::F32, {batch, hk, parts, g},
                   Shape({sb, shk, sp, sg})));
  JSM_CHECK(Expect(T, "out", *out, DataType::BF16, {batch, hk * g, kUqHeadDim},
                   Shape({sb, std::to_string(hk * g), "256"})));
  JSM_CHECK(Limit(T, "B * Hq * P", batch * hk * g * parts, kInt32Max));
  JSM_CHECK(CheckGrid(T, UltraquantReduceGrid(batch, hk * g)));
  if (batch == 0 || hk == 0 || g == 0) return Error::Success();
  if (parts == 0) {
    return Error::InvalidArgument(std::string(T) + ": needs at least one partition (P >= 1)");
  }
  LaunchArgs args;
  args.Tensor("out", out->untyped_data(), out->element_count())
      .Tensor("out_parts", out_parts.untyped_data(), out_parts.element_count())
      .Tensor("max_logits", max_logits.untyped_data(), max_logits.element_count())
      .Tensor("exp_sums", exp_sums.untyped_data(), exp_sums.element_count())
      .I32("num_seqs", batch).I32("num_kv_heads", hk).I32("query_group_size", g)
      .I32("num_partitions", parts).Stream(stream);
  return Launch("jsm_ultraquant_reduce", args, device);
}

// ------------------------------------------------------------------------------------------
// The diagnostic probes (kernels/gfx950/probe.py): one scaled MFMA on per-lane operand registers;
// one transposing LDS read (ds_read_b64_tr_b8 / _b16) of given LDS bytes at per-lane addresses.
// ------------------------------------------------------------------------------------------

Error MfmaProbe(void* stream, int32_t device, AnyBuffer a, AnyBuffer b, AnyBuffer scales,
                ffi::Result<AnyBuffer> c, int32_t a_format) {
  constexpr const char* T = "jsm_mfma_probe";
  if (!KernelAFormat(a_format)) {
    return Error::InvalidArgument(std::string(T) + ": a_format must be 0 (e4m3) or 4 (e2m1), got " +
                                  std::to_string(a_format));
  }
  JSM_CHECK(Expect(T, "a", a, DataType::U8, {64, 32}, "[64 lanes, 32 bytes]"));
  JSM_CHECK(Expect(T, "b", b, DataType::U8, {64, 32}, "[64 lanes, 32 bytes]"));
  JSM_CHECK(Expect(T, "scales", scales, DataType::S32, {64, 2}, "[64 lanes, 2]"));
  JSM_CHECK(Expect(T, "c", *c, DataType::F32, {64, 4}, "[64 lanes, 4]"));
  LaunchArgs args;
  args.Tensor("A", a.untyped_data(), a.element_count())
      .Tensor("B", b.untyped_data(), b.element_count())
      .Tensor("S", scales.untyped_data(), scales.element_count())
      .Tensor("C", c->untyped_data(), c->element_count())
      .Stream(stream);
  return Launch("jsm_mfma_probe_f" + std::to_string(a_format), args, device);
}

Error DsReadTrProbe(void* stream, int32_t device, AnyBuffer lds, AnyBuffer addrs,
                    ffi::Result<AnyBuffer> regs, int32_t bits) {
  constexpr const char* T = "jsm_ds_read_tr_probe";
  if (!KernelReadBits(bits)) {
    return Error::InvalidArgument(std::string(T) + ": bits must be 8 (ds_read_b64_tr_b8) or 16 " +
                                  "(ds_read_b64_tr_b16), got " + std::to_string(bits));
  }
  JSM_CHECK(Expect(T, "lds", lds, DataType::U8, {1024}, "[1024 bytes]"));
  JSM_CHECK(Expect(T, "addrs", addrs, DataType::S32, {64}, "[64 lanes]"));
  JSM_CHECK(Expect(T, "regs", *regs, DataType::U32, {64, 2}, "[64 lanes, 2]"));
  LaunchArgs args;
  args.Tensor("L", lds.untyped_data(), lds.element_count())
      .Tensor("A", addrs.untyped_data(), addrs.element_count())
      .Tensor("R", regs->untyped_data(), regs->element_count())
      .Stream(stream);
  return Launch("jsm_ds_read_tr_probe_b" + std::to_string(bits), args, device);
}

}  // namespace
}  // namespace jsm

#ifdef JSM_RECORDING
// For the CPU tests: `target`'s launch grid (x, y, z workgroups, threads per workgroup) for
// its quantities `q` and the handler's grid check (no handler call reaches the HSA limit with
// less than 8 GiB of buffers). q: jsm_sparse_mla {n_q, S, head groups};
// jsm_mla_decode_partials {B, H, S, qlen, rows per CTA}; jsm_mla_decode_combine {n, H};
// jsm_ultraquant_partials {B, Hk, P}; jsm_ultraquant_reduce {B, Hq}. Writes the check's
// message (empty when it passes) to `message`; returns -1 for an unknown target, else 0.
extern "C" __attribute__((visibility("default"))) int jsm_record_grid(
    const char* target, const int64_t* q, int64_t* grid, char* message, size_t capacity) {
  const std::string t(target);
  jsm::Grid g;
  if (t == "jsm_sparse_mla") g = jsm::SparseMlaGrid(q[0], q[1], q[2]);
  else if (t == "jsm_mla_decode_partials")
    g = jsm::MlaDecodePartialsGrid(q[0], q[1], q[2], q[3], q[4]);
  else if (t == "jsm_mla_decode_combine") g = jsm::MlaDecodeCombineGrid(q[0], q[1]);
  else if (t == "jsm_ultraquant_partials") g = jsm::UltraquantPartialsGrid(q[0], q[1], q[2]);
  else if (t == "jsm_ultraquant_reduce") g = jsm::UltraquantReduceGrid(q[0], q[1]);
  else return -1;
  grid[0] = g.x, grid[1] = g.y, grid[2] = g.z, grid[3] = g.threads;
  const ffi::Error e = jsm::CheckGrid(target, g);
  const std::string text = e.failure() ? e.message() : "";
  std::snprintf(message, capacity, "%s", text.c_str());
  return 0;
}
#endif

// ------------------------------------------------------------------------------------------
// The exported handler symbols (registered from Python for platform "ROCM", or "cpu" for the
// recording build).
// ------------------------------------------------------------------------------------------

#pragma GCC visibility push(default)

#define JSM_BIND ffi::Ffi::Bind().Ctx<jsm::StreamCtx>().Ctx<jsm::DeviceCtx>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmSparseMla, jsm::SparseMla,
                              JSM_BIND.Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Ret<AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<float>("sm_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmMlaDecodePartials, jsm::MlaDecodePartials,
                              JSM_BIND.Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Ret<AnyBuffer>()
                                  .Ret<AnyBuffer>()
                                  .Attr<int32_t>("qlen")
                                  .Attr<int32_t>("cta_rows")
                                  .Attr<float>("k_scale")
                                  .Attr<float>("v_scale")
                                  .Attr<float>("sm_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmMlaDecodeCombine, jsm::MlaDecodeCombine,
                              JSM_BIND.Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Ret<AnyBuffer>()
                                  .Ret<AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmUltraquantPartials, jsm::UltraquantPartials,
                              JSM_BIND.Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Ret<AnyBuffer>()
                                  .Ret<AnyBuffer>()
                                  .Ret<AnyBuffer>()
                                  .Attr<float>("sm_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmUltraquantReduce, jsm::UltraquantReduce,
                              JSM_BIND.Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Ret<AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmMfmaProbe, jsm::MfmaProbe,
                              JSM_BIND.Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Ret<AnyBuffer>()
                                  .Attr<int32_t>("a_format"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDsReadTrProbe, jsm::DsReadTrProbe,
                              JSM_BIND.Arg<AnyBuffer>()
                                  .Arg<AnyBuffer>()
                                  .Ret<AnyBuffer>()
                                  .Attr<int32_t>("bits"));

#pragma GCC visibility pop
