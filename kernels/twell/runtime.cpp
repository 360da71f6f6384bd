// The inference runtime of the sparse FFN: one C++ op per FFN call, sfl_twell::ffn, with a per-layer plan.
//
// The op's schema and its fake (meta) implementation are defined in Python (kernels/twell/ops.py), so the op exists
// and torch.compile can trace it on any machine; this file registers the CUDA implementation. Per call, nothing runs
// in Python: the checks, the dispatch decision, the workspaces, the kernels and the dense backup are all here.
//
// A plan (one per layer, keyed by an integer id the module owns) holds what persists between calls: the layer's
// measured activity (read back from pinned memory once its event completed, never waited on), the self-timing
// samples, the neuron-major copy of W_d (keyed to the weight's identity and version) and the configuration
// (KernelConfig, passed as its named fields: it arrives with the first call that names the plan).
//
// Dispatch (mode auto), documented in kernels/README.md:
//   sparse iff the last measured activity p of the unflagged rows is <= crossover(M) and (sync-free, or the
//   flagged-row fraction f <= flagged_dense_above); no measurement yet and no hint -> dense (which measures).
//   Eager M > decode_max_m with self_timing: a bucket the table sends sparse first runs dense until it has 2 dense
//   timings, and stays dense while min(sparse) > min(dense) (re-probed every 256th call of the bucket).
//   Eager M <= decode_max_m with self_timing and p <= 0.25: both paths are timed and the faster one runs (the
//   slower one re-probed every 256th call); under CUDA-graph capture the table decides. So do eager calls above
//   decode sizes of a layer with hot neurons (the table was calibrated without them).
// Paths:
//   dense     : the GEMMs HF runs, relu(g)*u in one pass that measures activity and accumulates the model's stats.
//   sparse    : M > decode_max_m: d2t (S = slots) -> up_down (one block per row), or (gated) from up_list_min_m rows
//               up_list (the rows' entries) -> slices (y over W_dT slice-major); rows flagged by d2t (a tile over
//               S, or a non-finite gate) go through the dense backup, exactly and without a host sync: a device list
//               of them, the first `cap` (from the layer's measured flagged fraction) by HF's dense math on a gathered
//               block, any beyond by dense_rows_fwd on CUDA cores (common/backup_rows.cu), which with cap 0 finds
//               them in the flags itself. Eager and captured alike.
//   hot/cold  : sparse above decode sizes with KernelConfig.hot_neurons = H > 0: the first H neurons by dense GEMMs
//               ([W_g; W_u]_hot stacked once per weight version, relu*mul, y += h W_d,hot^T), the rest as above.
//   decode    : M <= decode_max_m: S = 256 (no row can overflow), non-finite rows NaN; M <= fused_decode_max_m (at
//               most 8): the fused decode kernel; M <= rows_decode_max_m: a cuBLAS gate GEMM, then decode_rows (one
//               block per row and K slice: compaction, up and down).
// No path waits for the GPU: measurements reach the host through pinned memory and are read once their event has
// completed (one in flight per layer).
// The training op (kernels/train_ffn.py) takes its dispatch from plans of the same kind, through train_decide and
// train_measure at the end of this file: the same history, measurement model and backup-block rule, its own
// thresholds (KernelConfig.train_*).
#include <torch/extension.h>
#include <torch/library.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../common/backup_rows.h"
#include "../common/slices.h"
#include "launchers.h"

namespace sfl_runtime {

constexpr int kTileN = 256;
constexpr int kFusedDecodeMaxM = 8;   // the fused decode kernel's row limit (its workspace rows)
constexpr int kRowsDecodeMaxN = 24576;  // decode_rows keeps a row's active list in shared memory
constexpr int kSlicesRows = 1;       // slices' rows per block for the inference down step
constexpr int kTimingKeep = 3;       // timing samples kept per (bucket, path); decisions use their minimum
constexpr int kReprobeEvery = 256;   // a vetoed bucket runs sparse again every this many calls
constexpr int kRetimeEvery = 64;     // a bucket's samples are refreshed every this many calls
constexpr int kMeasureMax = 4;       // int64 values a measurement may carry (the training op's summary)
constexpr double kTimedDecodeMaxP = 0.25;  // eager decode sizes time both paths up to this activity (above it the
                                           // sparse path reads most of W_u/W_d anyway and cannot win)
enum Mode { kAuto = 0, kSparse = 1, kDense = 2 };

void check(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "TwELL kernel '", what, "' failed: ", cudaGetErrorString(e),
              " (invalid value = a shape or setting the kernels cannot serve; see kernels/README.md)");
}

// Memory a plan keeps between calls (W_d's neuron-major copy, the decode workspace, the measurement slots) is
// allocated on a helper thread, with a stream of our own current: torch.compile's CUDA graphs (cudagraph trees) route
// every allocation of the calling thread to the graph's memory pool during their warm-up calls, and a buffer that
// outlives the call there is refused at recording ("tensors in the cudagraph pool not tracked as outputs") or would
// dangle once the graph is freed. Recorded on the caller's stream, so that releasing it waits for that stream's work.
// Never called while capturing (it may need cudaMalloc): captures use per-call buffers. The caller fills it.
at::Tensor kept_empty(at::IntArrayRef size, const at::TensorOptions& opts, cudaStream_t use) {
  const int dev = opts.device().index();
  static std::mutex mu;
  static std::map<int, cudaStream_t> own;  // one per device, never destroyed (streams must outlive every plan)
  cudaStream_t s;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = own.find(dev);
    if (it == own.end()) {
      check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream create");
      own[dev] = s;
    } else {
      s = it->second;
    }
  }
  const std::vector<int64_t> shape(size.begin(), size.end());
  at::Tensor t;
  std::exception_ptr err;
  std::thread helper([&] {
    try {
      const c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(dev));
      const c10::cuda::CUDAStreamGuard stream_guard(c10::cuda::getStreamFromExternal(s, dev));
      t = at::empty(shape, opts);
    } catch (...) {
      err = std::current_exception();
    }
  });
  helper.join();
  if (err) std::rethrow_exception(err);
  c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), c10::cuda::getStreamFromExternal(use, dev));
  return t;
}

// KernelConfig, as the op receives it: "name=value;..." with every field this file reads, by its KernelConfig name
// (kernels/twell/ops.py: plan_spec). The defaults live in Python only: a missing or unknown name is an error.
struct Config {
  int mode, tile_n, slots, decode_max_m, measure_every, d2t_overlap_min_k, d2t_max_ctas;
  int decode_tiles_per_warp, fused_decode_max_m, rows_decode_max_m;
  int decode_rows_slices, backup_rows, up_list_min_m, hot_neurons;
  bool self_timing, fused_d2t;
  int64_t gate_scratch_mb;
  double flagged_dense_above, activity_hint;
  // the training op's auto dispatch (train_decide)
  double train_dense_above, train_dense_above_large, train_backup_dense_above;
  int64_t train_large_m, train_sparse_min_m;
  bool train_shrink;
  std::vector<int64_t> xo_m[2];  // crossover tables: [0] non-gated, [1] gated
  std::vector<double> xo_p[2];
};

// The named fields of one configuration; each read takes its field, and done() refuses any left over.
class ConfigFields {
 public:
  explicit ConfigFields(const std::string& spec) {
    size_t start = 0;
    while (start < spec.size()) {
      size_t end = spec.find(';', start);
      if (end == std::string::npos) end = spec.size();
      const std::string item = spec.substr(start, end - start);
      const size_t eq = item.find('=');
      TORCH_CHECK(eq != std::string::npos && eq > 0, "sfl_twell: malformed plan configuration item '", item,
                  "' (build it with kernels.twell.ops.plan_spec)");
      TORCH_CHECK(fields_.emplace(item.substr(0, eq), item.substr(eq + 1)).second,
                  "sfl_twell: KernelConfig.", item.substr(0, eq), " given twice in the plan configuration");
      start = end + 1;
    }
  }
  std::string text(const char* name) {
    auto it = fields_.find(name);
    TORCH_CHECK(it != fields_.end(), "sfl_twell: the plan configuration lacks KernelConfig.", name,
                " (build it with kernels.twell.ops.plan_spec)");
    std::string v = it->second;
    fields_.erase(it);
    return v;
  }
  int64_t integer(const char* name) { return to_integer(text(name), name); }
  double number(const char* name) { return to_number(text(name), name); }
  bool flag(const char* name) { return integer(name) != 0; }
  // a crossover table "m:p,m:p,..." (bucket starts ascending, as KernelConfig.crossover_table gives it)
  void table(const char* name, std::vector<int64_t>& ms, std::vector<double>& ps) {
    const std::string v = text(name);
    size_t start = 0;
    while (start < v.size()) {
      size_t end = v.find(',', start);
      if (end == std::string::npos) end = v.size();
      const std::string pair = v.substr(start, end - start);
      const size_t colon = pair.find(':');
      TORCH_CHECK(colon != std::string::npos, "sfl_twell: malformed KernelConfig.", name, " table");
      ms.push_back(to_integer(pair.substr(0, colon), name));
      ps.push_back(to_number(pair.substr(colon + 1), name));
      start = end + 1;
    }
    TORCH_CHECK(!ms.empty(), "sfl_twell: empty KernelConfig.", name, " table");
  }
  void done() const {
    TORCH_CHECK(fields_.empty(), "sfl_twell: unknown field KernelConfig.", fields_.empty() ? "" : fields_.begin()->first,
                " in the plan configuration (this build of the kernels does not read it: rebuild them)");
  }

 private:
  static int64_t to_integer(const std::string& v, const char* name) {
    char* end = nullptr;
    const long long r = std::strtoll(v.c_str(), &end, 10);
    TORCH_CHECK(!v.empty() && *end == '\0', "sfl_twell: KernelConfig.", name, "='", v, "' is not an integer");
    return r;
  }
  static double to_number(const std::string& v, const char* name) {
    char* end = nullptr;
    const double r = std::strtod(v.c_str(), &end);
    TORCH_CHECK(!v.empty() && *end == '\0', "sfl_twell: KernelConfig.", name, "='", v, "' is not a number");
    return r;
  }
  std::map<std::string, std::string> fields_;
};

Config parse_config(const std::string& spec) {
  ConfigFields f(spec);
  Config c;
  const std::string mode = f.text("mode"), d2t = f.text("d2t");
  TORCH_CHECK(mode == "auto" || mode == "sparse" || mode == "dense", "KernelConfig.mode must be auto, sparse or dense");
  c.mode = mode == "auto" ? kAuto : mode == "sparse" ? kSparse : kDense;
  TORCH_CHECK(d2t == "fused" || d2t == "cublas", "KernelConfig.d2t must be fused or cublas");
  c.fused_d2t = d2t == "fused";
  c.tile_n = (int)f.integer("tile_n"); c.slots = (int)f.integer("slots"); c.decode_max_m = (int)f.integer("decode_max_m");
  c.self_timing = f.flag("self_timing"); c.measure_every = (int)f.integer("measure_every");
  c.d2t_overlap_min_k = (int)f.integer("d2t_overlap_min_k"); c.d2t_max_ctas = (int)f.integer("d2t_max_ctas");
  c.gate_scratch_mb = f.integer("gate_scratch_mb"); c.decode_tiles_per_warp = (int)f.integer("decode_tiles_per_warp");
  c.fused_decode_max_m = (int)f.integer("fused_decode_max_m"); c.rows_decode_max_m = (int)f.integer("rows_decode_max_m");
  c.decode_rows_slices = (int)f.integer("decode_rows_slices"); c.backup_rows = (int)f.integer("backup_rows");
  c.up_list_min_m = (int)f.integer("up_list_min_m"); c.hot_neurons = (int)f.integer("hot_neurons");
  c.flagged_dense_above = f.number("flagged_dense_above");
  c.activity_hint = f.number("activity_hint");
  c.train_dense_above = f.number("train_dense_above");
  c.train_dense_above_large = f.number("train_dense_above_large");
  c.train_backup_dense_above = f.number("train_backup_dense_above");
  c.train_large_m = f.integer("train_large_m");
  c.train_sparse_min_m = f.integer("train_sparse_min_m");
  c.train_shrink = f.flag("train_shrink");
  f.table("crossover", c.xo_m[1], c.xo_p[1]);
  f.table("crossover_nongated", c.xo_m[0], c.xo_p[0]);
  f.done();
  TORCH_CHECK(c.tile_n == kTileN, "KernelConfig.tile_n must be 256: the CUDA kernels are built for 256-column tiles");
  TORCH_CHECK(c.slots >= 1 && c.slots <= kTileN, "KernelConfig.slots must be in 1..256");
  TORCH_CHECK(c.hot_neurons >= 0 && c.hot_neurons % kTileN == 0, "KernelConfig.hot_neurons must be a multiple of 256");
  return c;
}

struct Timed { cudaEvent_t start, end; int bucket; bool sparse; };

struct Plan {
  Config cfg;
  bool gated = true;
  // measured activity (the dispatch history)
  double p = -1.0, f = 0.0;
  int64_t measurements = 0, sparse_calls = 0, dense_calls = 0;
  int64_t* host_async = nullptr;        // pinned int64 [kMeasureMax] (cudaHostAlloc: a pageable target would make
                                        // the "asynchronous" copy synchronous)
  cudaEvent_t ev_async = nullptr;
  at::Tensor dev_stats;                 // int64 [2] on the device: the measurement slot, zeroed per use
  bool pending = false;
  int64_t pending_rows = 0, pending_n = 0;
  // where the measurement in flight lands (host_async, or the training op's own pinned summary, held) and the
  // positions in it of (unflagged non-zeros, flagged rows, the widest unflagged row or -1)
  const int64_t* pending_vals = nullptr;
  at::Tensor pending_summary;
  int pos_light = 0, pos_flagged = 1, pos_widest = -1;
  // the training op's history: the widest light row measured (the next sparse call's ELL width), and the path of the
  // layer's last forward (-1 none, 0 dense, 1 sparse), which an activation-checkpoint recompute takes again
  int64_t widest_light = -1;
  int train_forward = -1;
  // self-timing
  std::map<std::pair<int, bool>, std::deque<float>> times;
  std::vector<Timed> timed_pending;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> free_events;
  std::map<int, int64_t> bucket_calls;
  // the fused decode path's workspace: fp32 yacc [8, K] then int32 nnz [8], flag [8]; zeroed once, re-zeroed by
  // each call's decode_finish; used by eager calls on one stream (captures and other streams allocate their own)
  at::Tensor decode_ws;
  cudaStream_t decode_ws_stream = nullptr;
  bool decode_ws_dirty = false;         // a call was cut off between its two kernels: zero before reuse
  // a zero bias [N] for the non-gated dense call's ReLU epilogue (dense_path), made outside any capture
  at::Tensor zero_bias;
  // neuron-major W_d copy, keyed to the source tensor (held, so its memory cannot be reused) and its version
  at::Tensor wdt, wdt_src;
  const void* wdt_storage = nullptr;
  int64_t wdt_offset = -1, wdt_version = -1;
  // the hot neurons' [W_g; W_u] rows stacked (gated, hot_neurons > 0): one GEMM for both, keyed like wdt
  at::Tensor hot_w, hot_src_g, hot_src_u;
  int64_t hot_version_g = -1, hot_version_u = -1;
  // the last call, for tests and benchmark logs
  std::string last_path, last_d2t;
  int64_t last_flagged = -1;            // flagged rows in the latest measurement that reached the host
  int64_t last_cap = -1;                // the last sparse call's backup capacity (rows by dense GEMMs)
  int64_t last_hot = 0;                 // the last sparse call's neurons computed as dense GEMMs (hot/cold)
  int device = -1, sms = 0;

  ~Plan() {
    if (device < 0) return;
    int prev = 0;
    if (cudaGetDevice(&prev) != cudaSuccess) return;
    cudaSetDevice(device);
    if (ev_async) cudaEventDestroy(ev_async);
    if (host_async) cudaFreeHost(host_async);
    for (auto& t : timed_pending) { cudaEventDestroy(t.start); cudaEventDestroy(t.end); }
    for (auto& e : free_events) { cudaEventDestroy(e.first); cudaEventDestroy(e.second); }
    cudaSetDevice(prev);
  }

  void update(int64_t nnz_ok, int64_t flagged, int64_t rows, int64_t n, int64_t widest = -1) {
    p = rows == flagged ? 1.0 : (double)nnz_ok / ((double)(rows - flagged) * (double)n);
    f = (double)flagged / (double)std::max<int64_t>(1, rows);
    if (widest >= 0 && rows > flagged) widest_light = widest;
    last_flagged = flagged;
    ++measurements;
  }

  // rows of the backup block for an M-row call, both ops (KernelConfig.backup_rows; -1: this rule): 1.25x the
  // flagged fraction the last measurement saw + 32 rows, in multiples of 32; none when it saw none (a surprise
  // flagged row then costs a CUDA-core pass over the weights, and is measured); M / 16 before any measurement
  int64_t backup_cap(int64_t M) const {
    if (cfg.backup_rows >= 0) return std::min<int64_t>(M, cfg.backup_rows);
    if (p >= 0 && f <= 0.0) return 0;
    const int64_t want = p < 0 ? M / 16 : (int64_t)(1.25 * f * (double)M) + 32;
    return std::min(M, (want + 31) / 32 * 32);
  }

  void poll() {
    if (!pending || cudaEventQuery(ev_async) != cudaSuccess) return;
    pending = false;
    const int64_t* v = pending_vals;
    update(v[pos_light], v[pos_flagged], pending_rows, pending_n, pos_widest >= 0 ? v[pos_widest] : -1);
    pending_summary = at::Tensor();
  }

  double crossover(int64_t M) const {
    const auto& ms = cfg.xo_m[gated ? 1 : 0];
    const auto& ps = cfg.xo_p[gated ? 1 : 0];
    const auto it = std::upper_bound(ms.begin(), ms.end(), M);
    return it == ms.begin() ? 0.0 : ps[(it - ms.begin()) - 1];
  }

  // ---- self-timing
  void poll_timings() {
    std::vector<Timed> keep;
    for (auto& t : timed_pending) {
      if (cudaEventQuery(t.end) == cudaSuccess) {
        float ms = 0.f;
        if (cudaEventElapsedTime(&ms, t.start, t.end) == cudaSuccess) {
          auto& d = times[{t.bucket, t.sparse}];
          d.push_back(ms);
          while ((int)d.size() > kTimingKeep) d.pop_front();
        }
        free_events.emplace_back(t.start, t.end);
      } else {
        keep.push_back(t);
      }
    }
    timed_pending.swap(keep);
  }
  size_t samples(int bucket, bool sparse) const {
    const auto it = times.find({bucket, sparse});
    return it == times.end() ? 0 : it->second.size();
  }
  float best(int bucket, bool sparse) const {
    const auto& d = times.at({bucket, sparse});
    return *std::min_element(d.begin(), d.end());
  }
  bool want_timing(int bucket, bool sparse) const {
    if (timed_pending.size() >= 4) return false;
    const auto it = bucket_calls.find(bucket);
    const int64_t calls = it == bucket_calls.end() ? 0 : it->second;
    return samples(bucket, sparse) < kTimingKeep || calls % kRetimeEvery == 0;
  }
  // both paths timed (dense first, 2 samples each), then the faster one; the slower one re-runs every
  // kReprobeEvery-th call of the bucket so that a change (activity, batch, contention) is seen
  bool timed_choice(int bucket) const {
    if (samples(bucket, false) < 2) return false;
    if (samples(bucket, true) < 2) return true;
    const bool sparse_faster = best(bucket, true) < best(bucket, false);
    return bucket_calls.at(bucket) % kReprobeEvery == 0 ? !sparse_faster : sparse_faster;
  }
  bool sparse_slower(int bucket) const {
    const auto it = bucket_calls.find(bucket);
    if (it != bucket_calls.end() && it->second % kReprobeEvery == 0) return false;  // re-probe
    return samples(bucket, true) >= 2 && samples(bucket, false) >= 2 && best(bucket, true) > best(bucket, false);
  }
  std::pair<cudaEvent_t, cudaEvent_t> timing_events() {
    if (!free_events.empty()) {
      auto e = free_events.back();
      free_events.pop_back();
      return e;
    }
    std::pair<cudaEvent_t, cudaEvent_t> e;
    check(cudaEventCreate(&e.first), "event");
    check(cudaEventCreate(&e.second), "event");
    return e;
  }

  void ensure_device(int dev, cudaStream_t stream) {
    if (device == dev) return;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(stream, &cs), "stream capture query");
    TORCH_CHECK(cs == cudaStreamCaptureStatusNone, "sfl_twell::ffn: this layer's first call is being captured into a "
                "CUDA graph; run it once eagerly before capturing (the warm-up torch.cuda.graph's documentation asks "
                "for, and torch.compile's CUDA graphs do by themselves)");
    TORCH_CHECK(device < 0, "sfl_twell::ffn: a plan serves one device; this layer's plan was made on cuda:",
                std::to_string(device), " and is now called on cuda:", std::to_string(dev),
                " (make a new module/plan per device)");
    device = dev;
    void* h = nullptr;
    check(cudaHostAlloc(&h, kMeasureMax * sizeof(int64_t), cudaHostAllocDefault), "pinned host slot");
    host_async = static_cast<int64_t*>(h);
    dev_stats = kept_empty({2}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA, dev), stream);
    check(cudaEventCreateWithFlags(&ev_async, cudaEventDisableTiming), "event");
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "device attribute");
  }

  // a zeroed device int64 [2] for this call's measurement; stream order keeps it from being reused before its copy
  // to the host is done
  at::Tensor measurement_slot(cudaStream_t stream) {
    check(cudaMemsetAsync(dev_stats.data_ptr(), 0, 2 * sizeof(int64_t), stream), "memset");
    return dev_stats;
  }

  // copy a device int64 measurement of `rows` x `n` (at most kMeasureMax values: the unflagged rows' non-zeros at
  // light_at, the flagged rows at flagged_at, the training op's widest light row at widest_at, or -1 for none) to
  // pinned memory and record the event that poll() looks for
  void to_host(const at::Tensor& st, int64_t rows, int64_t n, cudaStream_t stream, int light_at = 0,
               int flagged_at = 1, int widest_at = -1) {
    check(cudaMemcpyAsync(host_async, st.data_ptr(), st.numel() * sizeof(int64_t), cudaMemcpyDeviceToHost, stream),
          "stats copy");
    await(host_async, rows, n, stream, light_at, flagged_at, widest_at);
  }

  // a measurement whose values land at `vals` (pinned) once the work queued so far on `stream` is done
  void await(const int64_t* vals, int64_t rows, int64_t n, cudaStream_t stream, int light_at, int flagged_at,
             int widest_at) {
    check(cudaEventRecord(ev_async, stream), "event record");
    pending = true;
    pending_rows = rows;
    pending_n = n;
    pending_vals = vals;
    pos_light = light_at;
    pos_flagged = flagged_at;
    pos_widest = widest_at;
  }

  // the persistent decode workspace for K, or an undefined tensor where a call must allocate its own
  at::Tensor decode_workspace(const at::Tensor& x, cudaStream_t stream) {
    const int64_t K = x.size(1), need = kFusedDecodeMaxM * K + 2 * kFusedDecodeMaxM;
    if (decode_ws.defined() && stream != decode_ws_stream) return at::Tensor();  // in use in another stream's order
    if (!decode_ws.defined() || decode_ws.numel() != need) {
      decode_ws = kept_empty({need}, x.options().dtype(at::kFloat), stream);
      check(cudaMemsetAsync(decode_ws.data_ptr(), 0, need * sizeof(float), stream), "memset");
      decode_ws_stream = stream;
      decode_ws_dirty = false;
    } else if (decode_ws_dirty) {
      check(cudaMemsetAsync(decode_ws.data_ptr(), 0, need * sizeof(float), stream), "memset");
      decode_ws_dirty = false;
    }
    return decode_ws;
  }

  // keyed by storage + offset + version, not tensor identity: callers may pass a fresh .detach() view per call.
  // The source is held, so its memory cannot be freed and reused by another weight while it is cached. A capture
  // that finds no valid copy transposes into a per-call buffer (part of the graph) and caches nothing.
  at::Tensor down_t(const at::Tensor& wd, cudaStream_t stream, bool capture) {
    // stored neuron-major (kernels/layout.py): the kernels read W_d^T as it is, nothing is copied or kept
    if (wd.t().is_contiguous() && reinterpret_cast<uintptr_t>(wd.data_ptr()) % 16 == 0) return wd.t();
    const void* st = wd.storage().unsafeGetStorageImpl();
    if (!wdt.defined() || st != wdt_storage || wd.storage_offset() != wdt_offset ||
        (int64_t)wd._version() != wdt_version || !wd.sizes().equals(wdt_src.sizes())) {
      if (capture) return wd.t().contiguous();
      wdt = kept_empty({wd.size(1), wd.size(0)}, wd.options(), stream);
      wdt.copy_(wd.t());
      wdt_src = wd;
      wdt_storage = st;
      wdt_offset = wd.storage_offset();
      wdt_version = (int64_t)wd._version();
    }
    return wdt;
  }

  // [W_g[:H]; W_u[:H]] as one [2H, K] tensor (H = cfg.hot_neurons), kept while both sources start at the same
  // addresses (held, so their memory cannot be reused meanwhile) at the same versions, as W_d's copy is keyed; a
  // capture that finds none stacks into a per-call buffer (part of the graph) and keeps nothing
  at::Tensor hot_stacked(const at::Tensor& wg, const at::Tensor& wu, cudaStream_t stream, bool capture) {
    const int64_t H = cfg.hot_neurons, K = wu.size(1);
    const bool same = hot_w.defined() && hot_w.size(1) == K && hot_src_g.data_ptr() == wg.data_ptr() &&
                      hot_src_u.data_ptr() == wu.data_ptr() && (int64_t)wg._version() == hot_version_g &&
                      (int64_t)wu._version() == hot_version_u;
    if (same) return hot_w;
    if (capture) return at::cat({wg.narrow(0, 0, H), wu.narrow(0, 0, H)});
    hot_w = kept_empty({2 * H, K}, wu.options(), stream);
    hot_w.narrow(0, 0, H).copy_(wg.narrow(0, 0, H));
    hot_w.narrow(0, H, H).copy_(wu.narrow(0, 0, H));
    hot_src_g = wg;
    hot_src_u = wu;
    hot_version_g = (int64_t)wg._version();
    hot_version_u = (int64_t)wu._version();
    return hot_w;
  }
};

std::mutex g_mutex;
// never destroyed: plans hold CUDA events, which must not be released after the CUDA context is gone at exit
auto& g_plans = *new std::unordered_map<int64_t, std::unique_ptr<Plan>>();

Plan& plan_for(int64_t id, c10::string_view spec, bool gated) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& slot = g_plans[id];
  if (!slot) {
    slot = std::make_unique<Plan>();
    slot->cfg = parse_config(std::string(spec.data(), spec.size()));
    slot->gated = gated;
  }
  TORCH_CHECK(slot->gated == gated, "sfl_twell::ffn: plan ", std::to_string(id), " was made for a ", slot->gated ? "gated" : "non-gated",
              " block; give each layer its own plan");
  return *slot;
}

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(s, &st), "stream capture query");
  return st != cudaStreamCaptureStatusNone;
}

int64_t* i64(const at::Tensor& t) { return t.data_ptr<int64_t>(); }
unsigned long long* u64(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<unsigned long long*>(t->data_ptr<int64_t>()) : nullptr;
}
int32_t* i32(const at::Tensor& t) { return t.data_ptr<int32_t>(); }

// An uninitialised tensor zeroed by one cudaMemsetAsync on `stream`: at::zeros goes through the dispatcher and a fill
// kernel (~10 us of host time each, a tenth of a decode-size call)
at::Tensor zeroed(at::IntArrayRef sizes, const at::TensorOptions& opts, cudaStream_t stream) {
  at::Tensor t = at::empty(sizes, opts);
  if (t.numel() > 0) check(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(), stream), "memset");
  return t;
}

// A copy only where the kernels cannot read the tensor as it is (non-contiguous, or not 16-byte aligned).
at::Tensor readable(const at::Tensor& t) {
  if (t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0) return t;
  return t.contiguous().data_ptr() == t.data_ptr() ? t.clone() : t.contiguous();
}

// W_d as it is when the kernels can read it: contiguous [K, N] (the plan keeps a neuron-major copy) or stored
// neuron-major (kernels/layout.py: w_down.t() contiguous, read directly); else a contiguous copy
at::Tensor readable_down(const at::Tensor& wd) {
  if (wd.t().is_contiguous() && reinterpret_cast<uintptr_t>(wd.data_ptr()) % 16 == 0) return wd;
  return readable(wd);
}

// Numbers in error messages go through std::to_string: streaming an integer into TORCH_CHECK's message crashed
// inside this extension on the GPU machine (std::num_put, seen 2026-11-25), so no message streams one.
std::string str(int64_t v) { return std::to_string(v); }
std::string dims(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}
std::string dev(const at::Device& d) { return d.str(); }

void check_inputs(const at::Tensor& x, const c10::optional<at::Tensor>& wg, const at::Tensor& wu,
                  const at::Tensor& wd, const c10::optional<at::Tensor>& stats) {
  auto need = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.is_cuda(), name, " is on ", dev(t.device()), ": the TwELL kernels run on CUDA tensors; move the inputs "
                "with .cuda(), or use kernels.reference / mlp_impl='reference' or 'dense' on other devices");
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " has dtype ", std::string(c10::toString(t.scalar_type())),
                ": the TwELL kernels take torch.bfloat16; cast with .to(torch.bfloat16)");
    TORCH_CHECK(t.device() == x.device(), name, " is on ", dev(t.device()), " but x is on ", dev(x.device()),
                ": put x and every weight on one device");
  };
  need(x, "x");
  need(wu, "w_up");
  need(wd, "w_down");
  const int64_t K = x.size(-1), N = wu.size(0);
  TORCH_CHECK(wu.dim() == 2 && wu.size(1) == K, "w_up must be [N, K] = [intermediate, hidden] (nn.Linear layout) "
              "with K = x.size(-1) = ", str(K), ", got ", dims(wu));
  TORCH_CHECK(wd.dim() == 2 && wd.size(0) == K && wd.size(1) == N, "w_down must be [K, N] = [", str(K), ", ",
              str(N), "] (nn.Linear layout of down_proj), got ", dims(wd), "; pass down_proj.weight, not its transpose");
  if (wg.has_value()) {
    need(*wg, "w_gate");
    TORCH_CHECK(wg->sizes() == wu.sizes(), "w_gate must have w_up's shape [N, K], got ", dims(*wg));
  }
  TORCH_CHECK(K % 64 == 0 && K <= 4096, "hidden size K=", str(K), " unsupported: the TwELL kernels need K % 64 == 0 and "
              "K <= 4096; use kernels.reference or mlp_impl='dense'");
  TORCH_CHECK(N % kTileN == 0 && N > 0, "intermediate size N=", str(N), " unsupported: the TwELL kernels need "
              "N % 256 == 0; use kernels.reference or mlp_impl='dense'");
  if (stats.has_value()) {
    TORCH_CHECK(stats->is_cuda() && stats->scalar_type() == at::kLong && stats->numel() == 3 &&
                    stats->is_contiguous() && stats->device() == x.device(),
                "stats must be a contiguous int64 [3] tensor on x's device (sum of non-zeros, max per token, tokens)");
  }
}

// ------------------------------------------------------------------------------------------------ paths
struct Call {
  Plan& P;
  const at::Tensor& x;          // [M, K] bf16, readable
  const at::Tensor* wg;         // nullptr: non-gated
  const at::Tensor& wu;
  const at::Tensor& wd;
  unsigned long long* acc;      // the model's statistics (nullptr: off)
  cudaStream_t stream;
  bool capture;
  int64_t M, K, N;
  const at::Tensor& gate_w() const { return wg ? *wg : wu; }
};

at::Tensor dense_ffn(const at::Tensor& x, const at::Tensor* wg, const at::Tensor& wu, const at::Tensor& wd) {
  // exactly HF's math: the same F.linear calls and elementwise rounding
  if (wg) return at::linear(at::relu(at::linear(x, *wg)) * at::linear(x, wu), wd);
  return at::linear(at::relu(at::linear(x, wu)), wd);
}

// The non-gated block's h = relu(x W_u^T) with the ReLU in the GEMM's epilogue (cuBLASLt RELU_BIAS, zero bias):
// HF's bits and non-finite pattern without its [M, N] ReLU pass, 1.05-1.16x of HF's linear-relu-linear at
// M 64-65536 (lab/results/kernel_bench.tar.xz: relu_epilogue_probe_h100_*). Undefined when no bias can be made (a capture
// before the layer has made it): the caller runs torch's relu.
at::Tensor relu_gemm(Call& c) {
  Plan& P = c.P;
  const at::Tensor& b = P.zero_bias;
  if (!b.defined() || b.size(0) != c.N || b.scalar_type() != c.x.scalar_type() || b.device() != c.x.device()) {
    if (c.capture) return at::Tensor();
    P.zero_bias = at::zeros({c.N}, c.x.options());
  }
  return at::_addmm_activation(P.zero_bias, c.x, c.wu.t());
}

at::Tensor dense_path(Call& c, bool table_dense) {
  Plan& P = c.P;
  bool measure = P.cfg.mode == kAuto && !c.capture && !P.pending;
  if (measure && table_dense && P.cfg.measure_every > 1 && P.dense_calls % P.cfg.measure_every) {
    // a layer measured above its crossover re-measures only every measure_every dense calls: the read-back (memset,
    // copy, event) costs ~3 small operations, comparable to the whole call at decode sizes; a fall in activity is
    // seen up to measure_every calls late (those calls stay dense: exact)
    measure = false;
  }
  ++P.dense_calls;
  P.last_path = "dense";
  P.last_d2t = "";
  if (!measure && !c.wg && c.acc == nullptr) {
    at::Tensor h = relu_gemm(c);
    if (!h.defined()) {
      h = at::mm(c.x, c.wu.t());
      at::relu_(h);
    }
    return at::mm(h, c.wd.t());
  }
  // at::mm with the transposed weight is the GEMM F.linear runs for a 2-D input (same cuBLAS call, same bits),
  // without linear/matmul's dispatcher hops
  at::Tensor g = at::mm(c.x, c.gate_w().t());
  at::Tensor u = c.wg ? at::mm(c.x, c.wu.t()) : at::Tensor();
  at::Tensor st = measure ? P.measurement_slot(c.stream) : at::Tensor();
  at::Tensor h = c.wg ? u : g;  // in place
  check(twell_relu_mul_stats_launch(g.data_ptr(), g.stride(0), c.wg ? u.data_ptr() : nullptr, c.wg ? u.stride(0) : 0,
                                    h.data_ptr(), h.stride(0), (int)c.M, (int)c.N, P.cfg.slots, (int)c.N,
                                    P.cfg.hot_neurons, nullptr,
                                    measure ? reinterpret_cast<unsigned long long*>(i64(st)) : nullptr, nullptr,
                                    c.acc, c.stream),
        "relu_mul_stats");
  at::Tensor y = at::mm(h, c.wd.t());
  if (measure) P.to_host(st, c.M, c.N, c.stream);
  return y;
}

// TwELL of relu(x W^T) into packed/counts/flag (flag zeroed): the fused d2t on sm_90, else cuBLAS + compaction
void d2t_into(const at::Tensor& x, const at::Tensor& w, at::Tensor& packed, at::Tensor& counts, at::Tensor& flag,
              const Config& cfg, cudaStream_t stream, std::string* variant) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int S = (int)packed.size(2);
  if (cfg.fused_d2t && twell_d2t_gemm_supported(x.get_device())) {
    check(twell_d2t_gemm_launch(x.data_ptr(), w.data_ptr(), (int)M, (int)N, (int)K, S, i32(packed), i32(counts),
                                i32(flag), K >= cfg.d2t_overlap_min_k ? 1 : 0, cfg.d2t_max_ctas, stream),
          "d2t_gemm");
    if (variant) *variant = "fused";
    return;
  }
  const int64_t chunk = std::max<int64_t>(256, (cfg.gate_scratch_mb << 20) / (2 * N));
  at::Tensor scratch = at::empty({std::min(chunk, M), N}, x.options());
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    const int64_t r1 = std::min(M, r0 + chunk);
    at::Tensor g = scratch.narrow(0, 0, r1 - r0);
    at::mm_out(g, x.narrow(0, r0, r1 - r0), w.t());
    check(twell_compact_launch(g.data_ptr(), g.stride(0), (int)(r1 - r0), (int)N, S, i32(packed) + r0 * (N / kTileN) * S,
                               i32(counts) + r0 * (N / kTileN), i32(flag) + r0, stream),
          "compact");
  }
  if (variant) *variant = "cublas";
}

at::Tensor fused_decode(Call& c, const at::Tensor& wdt, bool measure) {
  // two launches per call: the decode kernel and its finish (convert, measure, count, re-zero the workspace)
  Plan& P = c.P;
  const int64_t M = c.M, K = c.K;
  at::Tensor ws = c.capture ? at::Tensor() : P.decode_workspace(c.x, c.stream);
  const bool own = !ws.defined();
  if (own) ws = at::zeros({kFusedDecodeMaxM * K + 2 * kFusedDecodeMaxM}, c.x.options().dtype(at::kFloat));
  float* yacc = ws.data_ptr<float>();
  int32_t* nnz = reinterpret_cast<int32_t*>(yacc + kFusedDecodeMaxM * K);
  int32_t* flag = nnz + kFusedDecodeMaxM;
  at::Tensor y = at::empty({M, K}, c.x.options());
  at::Tensor st = measure ? P.measurement_slot(c.stream) : at::Tensor();
  if (!own) P.decode_ws_dirty = true;
  check(twell_decode_fused_launch(c.x.data_ptr(), c.gate_w().data_ptr(), c.wg ? c.wu.data_ptr() : nullptr,
                                  wdt.data_ptr(), (int)M, (int)K, (int)c.N, yacc, nnz, flag, c.stream),
        "decode_fused");
  check(twell_decode_finish_launch(yacc, nnz, flag, (int)M, (int)K, y.data_ptr(),
                                   measure ? reinterpret_cast<unsigned long long*>(i64(st)) : nullptr, c.acc, c.stream),
        "decode_finish");
  if (!own) P.decode_ws_dirty = false;
  if (measure) P.to_host(st, M, c.N, c.stream);
  P.last_path = "sparse-syncfree";
  P.last_d2t = "decode-fused";
  return y;
}

// Few rows, gate products on tensor cores: the cuBLAS gate GEMM (the dense path's bits), then decode_rows does
// ReLU, compaction, up, down, the measurement and the statistics per (row, K slice). Two launches, no workspace.
at::Tensor rows_decode(Call& c, const at::Tensor& wdt, bool measure) {
  Plan& P = c.P;
  at::Tensor g = at::mm(c.x, c.gate_w().t());
  at::Tensor y = at::empty({c.M, c.K}, c.x.options());
  at::Tensor st = measure ? P.measurement_slot(c.stream) : at::Tensor();
  check(twell_decode_rows_launch(g.data_ptr(), g.stride(0), c.x.data_ptr(), c.wg ? c.wu.data_ptr() : nullptr,
                                 wdt.data_ptr(), (int)c.M, (int)c.K, (int)c.N, P.cfg.decode_rows_slices, y.data_ptr(),
                                 measure ? reinterpret_cast<unsigned long long*>(i64(st)) : nullptr, c.acc, c.stream),
        "decode_rows");
  if (measure) P.to_host(st, c.M, c.N, c.stream);
  P.last_path = "sparse-syncfree";
  P.last_d2t = "decode-rows";
  return y;
}

// The rows d2t flagged, exactly, with no host sync. With a block (cap > 0): `rows` lists them (ascending, then -1)
// and st[1] counts them on the device; rows[0, cap) go through HF's dense math on a gathered block (zero rows past
// the count), rows[cap, count) through dense_rows_fwd on CUDA cores (none runs unless the count exceeds cap). Without
// one (the layer's last measurement saw no flagged row): dense_rows_fwd finds them in `flag` itself, so the common
// call pays one launch whose CTAs scan the flags and exit.
void backup_rows(Call& c, const at::Tensor& wdt, const at::Tensor& flag, const at::Tensor& st, int64_t cap,
                 at::Tensor& y) {
  Plan& P = c.P;
  const int64_t M = c.M, K = c.K;
  P.last_cap = cap;
  const int sms = std::max(1, P.sms);  // one CTA per SM fits (registers)
  if (cap == 0) {  // the CTAs scan the flags in chunks of 256 rows
    check(sfl_dense_rows_fwd_launch(c.wg ? 1 : 0, c.x.data_ptr(), c.gate_w().data_ptr(), c.wu.data_ptr(),
                                    wdt.data_ptr(), (int)M, (int)K, (int)c.N, nullptr, nullptr, 0, i32(flag),
                                    y.data_ptr(), nullptr, nullptr, (int)std::min<int64_t>((M + 255) / 256, sms),
                                    c.stream),
          "dense_rows_fwd");
    return;
  }
  const at::Tensor rows = at::nonzero_static(flag, M, -1).squeeze(1);
  const at::Tensor idx = rows.narrow(0, 0, cap);
  at::Tensor xb = at::empty({cap, K}, c.x.options());
  check(sfl_gather_rows_launch(c.x.data_ptr(), i64(idx), (int)cap, (int)K, xb.data_ptr(), c.stream), "gather_rows");
  const at::Tensor yb = dense_ffn(xb, c.wg, c.wu, c.wd).contiguous();
  check(sfl_scatter_rows_launch(yb.data_ptr(), nullptr, nullptr, i64(idx), (int)cap, (int)K, (int)c.N, y.data_ptr(),
                                nullptr, nullptr, c.stream),
        "scatter_rows");
  if (cap < M) {
    check(sfl_dense_rows_fwd_launch(c.wg ? 1 : 0, c.x.data_ptr(), c.gate_w().data_ptr(), c.wu.data_ptr(),
                                    wdt.data_ptr(), (int)M, (int)K, (int)c.N, i64(rows), i64(st) + 1, (int)cap,
                                    nullptr, y.data_ptr(), nullptr, nullptr, (int)std::min<int64_t>(M - cap, sms),
                                    c.stream),
          "dense_rows_fwd");
  }
}

// The TwELL steps of a sparse call over c's neurons (all of them, or the cold ones of a hot/cold call): d2t, the
// measurement, up and down, and above decode sizes the dense backup. extra (or null): active entries per row counted
// elsewhere (the hot neurons'), added to the measurement and the model's statistics; n_all: the layer's neurons,
// which the measured activity is a fraction of.
at::Tensor twell_steps(Call& c, const at::Tensor& wdt, bool small, bool measure, const int32_t* extra, int64_t n_all) {
  Plan& P = c.P;
  const int64_t M = c.M, K = c.K, N = c.N, T = N / kTileN;
  const int S = small ? kTileN : P.cfg.slots;  // decode sizes: no row can overflow a full tile
  const auto i32o = c.x.options().dtype(at::kInt);
  at::Tensor packed = at::empty({M, T, S}, i32o);
  at::Tensor counts = at::empty({M, T}, i32o);
  at::Tensor flag = zeroed({M}, i32o, c.stream);
  at::Tensor y = at::empty({M, K}, c.x.options());
  d2t_into(c.x, c.gate_w(), packed, counts, flag, P.cfg, c.stream, &P.last_d2t);
  // a backup block needs the flagged-row count on the device; the measurement slot is the layer's one
  const int64_t cap = small ? 0 : P.backup_cap(M);
  at::Tensor st = measure   ? P.measurement_slot(c.stream)
                  : cap > 0 ? zeroed({2}, c.x.options().dtype(at::kLong), c.stream)
                            : at::Tensor();
  if (st.defined() || c.acc) {
    check(twell_row_stats_launch(i32(counts), i32(flag), extra, (int)M, (int)N,
                                 st.defined() ? reinterpret_cast<unsigned long long*>(i64(st)) : nullptr, c.acc,
                                 c.stream),
          "row_stats");
  }
  const int tpw = std::max(1, std::min((int)T, P.cfg.decode_tiles_per_warp));
  if (small && tpw < T) {
    // few rows without the row decode (N above its limit, or it is off): tiles split across warps for
    // parallelism, fp32 atomics into an accumulator, then a conversion
    at::Tensor hval = c.wg ? at::empty({M, T, S}, c.x.options().dtype(at::kFloat)) : at::Tensor();
    float* hv = c.wg ? hval.data_ptr<float>() : nullptr;
    if (c.wg)
      check(twell_gated_up_launch(c.x.data_ptr(), c.wu.data_ptr(), (int)M, (int)K, (int)N, S, 1, i32(packed),
                                  i32(counts), i32(flag), hv, c.stream),
            "gated_up");
    at::Tensor yacc = zeroed({M, K}, c.x.options().dtype(at::kFloat), c.stream);
    check(twell_down_launch(wdt.data_ptr(), (int)M, (int)K, (int)N, S, 1, tpw, 1, i32(packed), i32(counts), i32(flag),
                            hv, y.data_ptr(), yacc.data_ptr<float>(), c.stream),
          "down");
    check(twell_finalize_launch(yacc.data_ptr<float>(), i32(flag), (int)M, (int)K, 1, y.data_ptr(), c.stream),
          "finalize");
  } else if (!small && c.wg && P.cfg.up_list_min_m > 0 && M >= P.cfg.up_list_min_m) {
    // gated: up (one block per row) writes the rows' entries; down reads W_dT one L2-sized slice at a time (same
    // bits). Non-gated there is no W_u row to read, and the split lost.
    at::Tensor lcol = at::empty({M, T * S}, i32o);
    at::Tensor lh = at::empty({M, T * S}, c.x.options().dtype(at::kFloat));
    at::Tensor lnnz = at::empty({M}, i32o);
    check(twell_up_list_launch(c.wg ? c.x.data_ptr() : nullptr, c.wg ? c.wu.data_ptr() : nullptr, (int)M, (int)K,
                               (int)N, S, i32(packed), i32(counts), i32(flag), i32(lcol), lh.data_ptr<float>(),
                               i32(lnnz), c.stream),
          "up_list");
    check(sfl_slices_launch(wdt.data_ptr(), nullptr, (int)M, (int)K, (int)(T * S), i32(lcol), i32(lnnz), i32(flag),
                            lh.data_ptr<float>(), nullptr, y.data_ptr(), kSlicesRows, c.stream),
          "down_slices");
  } else {  // one block per row: up and down in one kernel (flagged rows: NaN at decode sizes, else the backup's)
    check(twell_up_down_launch(c.wg ? c.x.data_ptr() : nullptr, c.wg ? c.wu.data_ptr() : nullptr, wdt.data_ptr(),
                               (int)M, (int)K, (int)N, S, small ? 1 : 0, i32(packed), i32(counts), i32(flag),
                               y.data_ptr(), c.stream),
          "up_down");
  }
  if (!small) backup_rows(c, wdt, flag, st, cap, y);
  if (measure) P.to_host(st, M, n_all, c.stream);
  return y;
}

// Hot/cold (KernelConfig.hot_neurons = H > 0, M above decode sizes): the layer's first H neurons (put there by
// models' order_hot_neurons_, by measured firing rate) as dense GEMMs, the others through TwELL.
//   gu = x [W_g; W_u]_hot^T (one GEMM on the plan's stacked copy; non-gated x W_u,hot^T), h = relu(g) * u in place
//   (relu_mul_stats: HF's elementwise bits, the hot entries counted per row), y = the TwELL steps on the other
//   neurons' rows, then y += h W_d,hot^T (cuBLAS, beta 1).
// Exact as the sparse path is: a flagged row's cold part comes from the dense backup and its hot part from the GEMMs,
// a non-finite hot gate propagates as in HF's math, and hot tiles flag nothing (they cannot overflow).
at::Tensor hot_cold(Call& c, const at::Tensor& wdt, bool measure) {
  Plan& P = c.P;
  const int64_t H = P.cfg.hot_neurons, Nc = c.N - H, M = c.M;
  const at::Tensor gu = c.wg ? at::mm(c.x, P.hot_stacked(*c.wg, c.wu, c.stream, c.capture).t())
                             : at::mm(c.x, c.wu.narrow(0, 0, H).t());
  const bool count = measure || c.acc;
  at::Tensor hot_nnz = count ? at::empty({M}, c.x.options().dtype(at::kInt)) : at::Tensor();
  const auto* g = static_cast<const at::BFloat16*>(gu.data_ptr());
  check(twell_relu_mul_stats_launch(g, gu.stride(0), c.wg ? g + H : nullptr, gu.stride(0), gu.data_ptr(),
                                    gu.stride(0), (int)M, (int)H, P.cfg.slots, (int)H, 0,
                                    count ? i32(hot_nnz) : nullptr, nullptr, nullptr, nullptr, c.stream),
        "relu_mul_stats");
  const at::Tensor wg_c = c.wg ? c.wg->narrow(0, H, Nc) : at::Tensor();
  const at::Tensor wu_c = c.wu.narrow(0, H, Nc), wd_c = c.wd.narrow(1, H, Nc);
  Call cold{P, c.x, c.wg ? &wg_c : nullptr, wu_c, wd_c, c.acc, c.stream, c.capture, M, c.K, Nc};
  at::Tensor y = twell_steps(cold, wdt.narrow(0, H, Nc), false, measure, count ? i32(hot_nnz) : nullptr, c.N);
  y.addmm_(gu.narrow(1, 0, H), wdt.narrow(0, 0, H));
  return y;
}

at::Tensor sparse_path(Call& c, bool sync_free) {
  Plan& P = c.P;
  ++P.sparse_calls;
  P.last_cap = -1;  // no backup block at decode sizes
  const at::Tensor wdt = P.down_t(c.wd, c.stream, c.capture);
  // decode sizes measure every measure_every-th call (the read-back is a few small operations, comparable to the
  // call), larger calls whenever the last measurement has reached the host
  const bool small = c.M <= P.cfg.decode_max_m;
  const bool measure = !c.capture && !P.pending &&
                       (!small || P.sparse_calls % P.cfg.measure_every == 1 % P.cfg.measure_every);
  P.last_hot = 0;
  if (sync_free && c.M <= std::min(P.cfg.fused_decode_max_m, kFusedDecodeMaxM)) return fused_decode(c, wdt, measure);
  if (sync_free && c.M <= P.cfg.rows_decode_max_m && c.N % 8 == 0 && c.N <= kRowsDecodeMaxN)
    return rows_decode(c, wdt, measure);
  at::Tensor y;
  if (!small && P.cfg.hot_neurons > 0) {
    P.last_hot = P.cfg.hot_neurons;
    y = hot_cold(c, wdt, measure);
  } else {
    y = twell_steps(c, wdt, small, measure, nullptr, c.N);
  }
  P.last_path = small ? "sparse-syncfree" : "sparse";
  return y;
}

// ------------------------------------------------------------------------------------------------ the op
at::Tensor ffn_cuda(const at::Tensor& x_in, const c10::optional<at::Tensor>& w_gate, const at::Tensor& w_up,
                    const at::Tensor& w_down, const c10::optional<at::Tensor>& stats, int64_t plan_id,
                    c10::string_view config) {
  check_inputs(x_in, w_gate, w_up, w_down, stats);
  const c10::cuda::CUDAGuard guard(x_in.device());
  Plan& P = plan_for(plan_id, config, w_gate.has_value());
  P.ensure_device(x_in.get_device(), c10::cuda::getCurrentCUDAStream().stream());
  const int64_t K = x_in.size(-1), N = w_up.size(0);
  const at::Tensor x = readable(x_in.reshape({-1, K}));
  const int64_t M = x.size(0);
  if (M == 0) return at::empty(x_in.sizes(), x_in.options());
  TORCH_CHECK(P.cfg.hot_neurons < N, "KernelConfig.hot_neurons=", str(P.cfg.hot_neurons), " must be below the ",
              "layer's intermediate size N=", str(N), " (the hot neurons are the first hot_neurons; 0 turns hot/cold ",
              "off)");
  const at::Tensor wu = readable(w_up), wd = readable_down(w_down);
  const at::Tensor wg = w_gate.has_value() ? readable(*w_gate) : at::Tensor();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  Call c{P, x, w_gate.has_value() ? &wg : nullptr, wu, wd, u64(stats), stream, capturing(stream), M, K, N};
  const bool sync_free = c.capture || M <= P.cfg.decode_max_m;
  bool sparse = P.cfg.mode == kSparse, table_dense = false, timed = false;
  int bucket = 0;
  if (!c.capture) P.poll();  // (event queries are not allowed while capturing) every mode: the backup's capacity
  if (P.cfg.mode == kAuto) {
    const bool known = P.p >= 0 || P.cfg.activity_hint > 0;
    const double p = P.p >= 0 ? P.p : P.cfg.activity_hint, f = P.p >= 0 ? P.f : 0.0;
    const double xo = P.crossover(M);
    sparse = known && p <= xo && (sync_free || f <= P.cfg.flagged_dense_above);
    table_dense = known && p > xo;
    // decode sizes are what CUDA graphs capture, after eager warm-up calls that may all have run dense (self-timing
    // times dense first): make W_d's neuron-major copy here, outside any capture, so that a captured sparse call
    // finds it instead of transposing W_d inside the graph on every replay; not where the table (which a capture
    // follows) sends this M dense at the measured activity: 23 MB per layer at the 1.5B shape
    if (!c.capture && M <= P.cfg.decode_max_m && !table_dense) P.down_t(wd, stream, false);
    if (P.cfg.self_timing && !c.capture) {  // event timing is not possible while capturing: graphs keep the table
      bucket = 64 - __builtin_clzll((unsigned long long)M);
      P.poll_timings();
      ++P.bucket_calls[bucket];
      if (sync_free && known && p <= kTimedDecodeMaxP) {
        // eager decode sizes: the faster path as timed on this layer, whatever the table says. The table is the
        // GPU time of graph replays; an eager decode step is mostly host time (launches), which events see too.
        sparse = P.timed_choice(bucket);
      } else if (!sync_free && P.cfg.hot_neurons > 0 && known && p <= kTimedDecodeMaxP) {
        // eager large M with hot neurons: the table, calibrated on calls without them, does not describe the
        // hot/cold call (its hot part costs the same at any activity); the faster path as timed on this layer
        sparse = P.timed_choice(bucket);
      } else if (!sync_free) {
        // eager large M: the table proposes sparse, timing may veto it
        if (sparse && P.samples(bucket, false) < 2) sparse = false;  // time dense here first
        else if (sparse && P.sparse_slower(bucket)) sparse = false;  // measured slower on this layer
      }
      timed = P.want_timing(bucket, sparse);
    }
  }
  std::pair<cudaEvent_t, cudaEvent_t> ev{nullptr, nullptr};
  if (timed) {
    ev = P.timing_events();
    check(cudaEventRecord(ev.first, stream), "event record");
  }
  at::Tensor y = sparse ? sparse_path(c, sync_free) : dense_path(c, table_dense);
  if (timed) {
    check(cudaEventRecord(ev.second, stream), "event record");
    P.timed_pending.push_back({ev.first, ev.second, bucket, sparse});
  }
  return y.view(x_in.sizes());
}

// d2t alone: (packed [M, T, slots], counts [M, T], flag [M]) of relu(x w_gate^T). variant: 0 fused where the GPU
// runs it, 1 cuBLAS + compaction.
std::tuple<at::Tensor, at::Tensor, at::Tensor> d2t_cuda(const at::Tensor& x_in, const at::Tensor& w_gate, int64_t slots,
                                                        c10::string_view config) {
  TORCH_CHECK(x_in.is_cuda() && w_gate.is_cuda() && x_in.device() == w_gate.device(),
              "d2t: x and w_gate must be CUDA tensors on one device");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && w_gate.scalar_type() == at::kBFloat16,
              "d2t: x and w_gate must be torch.bfloat16; cast with .to(torch.bfloat16)");
  TORCH_CHECK(w_gate.dim() == 2 && w_gate.size(1) == x_in.size(-1) && x_in.size(-1) % 64 == 0 &&
                  w_gate.size(0) % kTileN == 0,
              "d2t: w_gate must be [N, K] with K = x.size(-1), K % 64 == 0 and N % 256 == 0, got x ", dims(x_in),
              " and w_gate ", dims(w_gate));
  TORCH_CHECK(slots >= 1 && slots <= kTileN, "slots must be in 1..256, got ", std::to_string(slots));
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = readable(x_in.reshape({-1, x_in.size(-1)})), w = readable(w_gate);
  const int64_t M = x.size(0), T = w.size(0) / kTileN;
  const auto i32o = x.options().dtype(at::kInt);
  at::Tensor packed = at::empty({M, T, slots}, i32o), counts = at::empty({M, T}, i32o), flag = at::zeros({M}, i32o);
  if (M > 0) {
    const Config cfg = parse_config(std::string(config.data(), config.size()));
    d2t_into(x, w, packed, counts, flag, cfg, c10::cuda::getCurrentCUDAStream().stream(), nullptr);
  }
  return {packed, counts, flag};
}

}  // namespace sfl_runtime

TORCH_LIBRARY_IMPL(sfl_twell, CUDA, m) {
  m.impl("ffn", &sfl_runtime::ffn_cuda);
  m.impl("d2t", &sfl_runtime::d2t_cuda);
}

// ---- plan inspection and lifetime (pybind; binding.cpp exposes them)
namespace sfl_runtime {

void plan_free(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_plans.erase(id);
}

void plan_reset(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto it = g_plans.find(id);
  if (it == g_plans.end()) return;
  Plan& P = *it->second;
  P.p = -1.0; P.f = 0.0; P.measurements = P.sparse_calls = P.dense_calls = 0; P.pending = false;
  P.pending_summary = at::Tensor(); P.widest_light = -1; P.train_forward = -1;
  P.times.clear(); P.bucket_calls.clear();
}

py::dict plan_info(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  py::dict d;
  const auto it = g_plans.find(id);
  if (it == g_plans.end()) return d;
  const Plan& P = *it->second;
  d["p"] = P.p >= 0 ? py::cast(P.p) : py::none();
  d["f"] = P.f;
  d["measurements"] = P.measurements;
  d["sparse_calls"] = P.sparse_calls;
  d["dense_calls"] = P.dense_calls;
  d["pending"] = P.pending;
  d["path"] = P.last_path.empty() ? py::none() : py::cast(P.last_path);
  d["d2t"] = P.last_d2t.empty() ? py::none() : py::cast(P.last_d2t);
  d["flagged_rows"] = P.last_flagged >= 0 ? py::cast(P.last_flagged) : py::none();
  d["backup_cap"] = P.last_cap >= 0 ? py::cast(P.last_cap) : py::none();
  d["down_copy_bytes"] = P.wdt.defined() ? P.wdt.numel() * P.wdt.element_size() : 0;  // W_d's neuron-major copy
  d["hot_neurons"] = P.last_hot;   // the last sparse call's dense-computed neurons (KernelConfig.hot_neurons)
  d["hot_copy_bytes"] = P.hot_w.defined() ? P.hot_w.numel() * P.hot_w.element_size() : 0;  // stacked hot rows
  d["widest_light"] = P.widest_light >= 0 ? py::cast(P.widest_light) : py::none();  // training: widest light row
  py::dict t;
  for (const auto& kv : P.times) {
    t[py::make_tuple(kv.first.first, kv.first.second ? "sparse" : "dense")] =
        std::vector<float>(kv.second.begin(), kv.second.end());
  }
  d["timings"] = t;
  return d;
}

// ---- the training op's dispatch, on the same plans (kernels/train_ffn.py: a DispatchState is a handle on one)

namespace {

// auto: dense below train_sparse_min_m rows and before any measurement; sparse iff the measured activity is at
// most train_dense_above (train_dense_above_large from train_large_m rows) and the backup-row fraction at most
// train_backup_dense_above (kernels/train/README.md: where each was measured)
bool train_auto_sparse(const Plan& P, int64_t M) {
  const Config& c = P.cfg;
  if (M < c.train_sparse_min_m || P.p < 0) return false;
  const double limit = M >= c.train_large_m ? c.train_dense_above_large : c.train_dense_above;
  return P.p <= limit && P.f <= c.train_backup_dense_above;
}

// the ELL width of a sparse call: with train_shrink, the widest light row measured plus a quarter, rounded up to 8
// (rows above it are exact backup rows; the next measurement adapts), else `width`
int64_t train_width(const Plan& P, int64_t width) {
  if (!P.cfg.train_shrink || P.widest_light < 0) return width;
  return std::min(width, std::max<int64_t>(8, (P.widest_light * 5 / 4 + 1 + 7) / 8 * 8));
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace

// The next training call of an M-row block: (sparse, ELL width, backup block rows). mode as KernelConfig.train_mode
// (Mode). A call inside backward (an activation-checkpoint recompute) in auto mode takes the path of the layer's last
// forward, so that the recomputed saved tensors match what the checkpoint recorded. The measurement is polled, never
// waited for; while a graph is captured not even polled: the last eager decisions stand.
std::tuple<bool, int64_t, int64_t> train_decide(int64_t id, const std::string& spec, bool gated, int64_t mode,
                                                int64_t M, int64_t width, bool in_backward) {
  Plan& P = plan_for(id, spec, gated);
  if (P.device >= 0 && !capturing(current_stream())) P.poll();
  bool sparse = mode == kSparse;
  if (mode == kAuto) sparse = in_backward && P.train_forward >= 0 ? P.train_forward == 1 : train_auto_sparse(P, M);
  if (!in_backward) P.train_forward = sparse ? 1 : 0;
  return {sparse, train_width(P, width), P.backup_cap(M)};
}

// A training call's measurement of `rows` x `n`, taken as the plan's next one unless one is in flight or a graph is
// being captured (a captured call measures nothing: its replays would write at times no event tells). stats: int64
// on the device (copied here to pinned memory), or the training op's pinned summary, which the op's own copy fills in
// stream order; light_at, flagged_at, widest_at (-1: none): where its values are.
void train_measure(int64_t id, const std::string& spec, bool gated, const at::Tensor& stats, int64_t rows, int64_t n,
                   int64_t light_at, int64_t flagged_at, int64_t widest_at) {
  if (rows <= 0) return;
  Plan& P = plan_for(id, spec, gated);
  // a pinned summary was filled on the plan's device (the op's x), or, on a first call, the current one
  const int dev = stats.is_cuda() ? stats.get_device() : P.device >= 0 ? P.device : (int)c10::cuda::current_device();
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
  const cudaStream_t stream = current_stream();
  if (capturing(stream)) return;  // (the op's summary is then a placeholder: it copies nothing while capturing)
  TORCH_CHECK(stats.scalar_type() == at::kLong && stats.dim() == 1 && stats.is_contiguous() &&
                  stats.numel() <= kMeasureMax && std::max({light_at, flagged_at, widest_at}) < stats.numel() &&
                  light_at >= 0 && flagged_at >= 0,
              "train_measure: stats must be a contiguous int64 vector of at most ", std::to_string(kMeasureMax),
              " values holding the given positions");
  TORCH_CHECK(stats.is_cuda() || stats.is_pinned(), "train_measure: stats must be on the GPU or in pinned memory");
  P.ensure_device(dev, stream);
  P.poll();
  if (P.pending) return;  // one measurement in flight per layer
  if (stats.is_cuda()) {
    P.to_host(stats, rows, n, stream, (int)light_at, (int)flagged_at, (int)widest_at);
  } else {
    P.pending_summary = stats;  // held until read: the op's copy into it is queued on this stream
    P.await(stats.data_ptr<int64_t>(), rows, n, stream, (int)light_at, (int)flagged_at, (int)widest_at);
  }
}

// take in a plan's measurement if it has landed (for plan_info's readers; the op and train_decide poll by themselves)
void plan_poll(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto it = g_plans.find(id);
  if (it != g_plans.end() && it->second->device >= 0 && !capturing(current_stream())) it->second->poll();
}

}  // namespace sfl_runtime
