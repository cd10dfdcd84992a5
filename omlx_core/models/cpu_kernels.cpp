// CPU primitives for mlx's CPU backend, where its "fast" ops are compositions of
// scalar elementwise ops (its simd width is 1 off Apple silicon).
//
// - softmax and SwiGLU: the same float32 arithmetic (softmax: exp(x - max) * (1 / sum);
//   SwiGLU: gate * (1 / (1 + exp(-gate))) * x) with a polynomial exp the compiler
//   vectorizes;
// - RMS norm and RoPE: mlx's fallback arithmetic in one pass, bit for bit (its sin,
//   cos and rsqrt, the same order of operations; built with -ffp-contract=off so no
//   multiply-add is fused where mlx rounds twice): a decode step's 60 norms and 60
//   rotations were ~20 % of a one-row step in op dispatch alone;
// - decode attention: one query row per sequence and head (a decode step's), scores,
//   mask, softmax and the weighted values in one pass over each head's keys and values
//   (the scores differ from BLAS's in the order of a dot product's sums); over a
//   quantized KV cache, each row expanded as mx.dequantize does, one row at a time.
//
// - encoder layers (plugins/encoder): the exact (erf) GELU, layer norm with the residual
//   add before it, and bidirectional attention of sequences packed on one token axis
//   (each token over its own sequence's keys), split over the cores: on 32 short texts
//   of all-MiniLM-L6-v2 mlx's ops took 34 ms of a 73 ms layer for the GELU alone.
//
// Each is a node of the graph: nothing is evaluated mid-forward, so a decode step keeps
// mlx's pipelining; softmax and SwiGLU write into their input's buffer where mlx lets
// them (as mlx's own softmax does), so the memory a forward needs is unchanged.
// Built and loaded by omlx_core/models/cpu_kernels.py.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <sched.h>
#include <stdexcept>
#include <thread>
#include <vector>

#include <pthread.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/simd/simd.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

// exp(x) in float32: Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial
// (about 1 ulp). Below -87 the result is flushed to 0 (exp(-87) is 1.6e-38, the
// smallest normal float is 1.2e-38); above 88 it saturates at exp(88).
inline float poly_exp(float x) {
  float xc = std::min(std::max(x, -87.0f), 88.0f);
  float fn = xc * 1.44269504088896341f;
  fn = (fn + 12582912.0f) - 12582912.0f;  // nearest integer
  int32_t n = static_cast<int32_t>(fn);
  float r = xc - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  float y = p * scale;
  return x < -87.0f ? 0.0f : y;
}

// One build runs on any x86-64: the loader picks the widest clone the CPU has.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define OMLX_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define OMLX_CLONES
#endif

OMLX_CLONES void exp_shifted(const float* x, float* y, int64_t n, float shift) {
  for (int64_t i = 0; i < n; ++i) {
    y[i] = poly_exp(x[i] - shift);
  }
}

OMLX_CLONES float row_max(const float* x, int64_t n) {
  float m[8];
  for (int k = 0; k < 8; ++k) m[k] = -INFINITY;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) m[k] = x[i + k] > m[k] ? x[i + k] : m[k];
  float out = m[0];
  for (int k = 1; k < 8; ++k) out = m[k] > out ? m[k] : out;
  for (; i < n; ++i) out = x[i] > out ? x[i] : out;
  return out;
}

OMLX_CLONES float row_sum(const float* x, int64_t n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) s[k] += x[i + k];
  float out = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) out += x[i];
  return out;
}

OMLX_CLONES void scale_row(float* y, int64_t n, float a) {
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

OMLX_CLONES void swiglu_span(const float* g, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    y[i] = gi * (1.0f / (1.0f + poly_exp(-gi))) * x[i];
  }
}

void softmax_rows(const float* x, float* y, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    float m = row_max(xr, cols);
    exp_shifted(xr, yr, cols, m);
    scale_row(yr, cols, 1.0f / row_sum(yr, cols));
  }
}

// The element offsets of a strided array, in row-major order of its shape.
struct Strided {
  std::vector<int64_t> shape, strides;
  explicit Strided(const mx::array& a) {
    for (int i = 0; i < a.ndim(); ++i) {
      shape.push_back(a.shape(i));
      strides.push_back(a.strides()[i]);
    }
  }
  int64_t offset(int64_t index) const {
    int64_t at = 0;
    for (int i = static_cast<int>(shape.size()) - 1; i >= 0 && index > 0; --i) {
      at += (index % shape[i]) * strides[i];
      index /= shape[i];
    }
    return at;
  }
};

// A dense row-major copy of a strided (transposed, sliced, broadcast) input into y.
void gather(const float* x, const Strided& layout, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[layout.offset(i)];
}

// The output's buffer: the input's where mlx lets it be reused (a dense intermediate no
// one else holds, as mlx's own softmax does), else a new one.
void allocate_like(const mx::array& in, mx::array& out) {
  if (in.flags().row_contiguous && in.is_donatable() && in.itemsize() == out.itemsize()) {
    out.copy_shared_buffer(in);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
}

// -- threads -------------------------------------------------------------------------

// The CPUs this process may run on (its affinity), at least 1.
int64_t usable_cores() {
  static const int64_t cores = [] {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max<int64_t>(1, CPU_COUNT(&set));
    return std::max<int64_t>(1, std::thread::hardware_concurrency());
  }();
  return cores;
}

// Helper threads kept between calls: a decode step runs ~200 products and ~30 attention
// calls, and a thread started per call costs tens of microseconds. ``run`` hands out a
// call's chunks one at a time to whoever asks first, this thread included, so a helper
// that is slow to wake (the machine is shared) delays nothing: this thread takes the
// chunks it has not, and waits only for chunks a helper already took. A helper spins
// for the next call a little (kHelperSpin pauses), then sleeps on a futex
// (std::atomic::wait). It spun 20,000 pauses (0.49 ms here) before: through every gap
// between a step's products it held the core the step's other threads need (the
// Python thread building the next step's graph, the server's HTTP threads), and the
// default model's steps ran no faster for it: 16-row steps 40.5-44.0 ms and 1-row
// steps 21.7-25.1 ms spinning 20,000 (3 runs), and over 12 alternating runs spinning
// 1,000 or 0 or yielding the core instead 39.5-46.5 and 21.2-23.2 ms, the machine's
// swings. One call uses the
// helpers at a time (another stream's call meanwhile runs on its own thread); after a
// fork the child runs every chunk itself.
// Pauses a helper spins for the next call before it sleeps (~25 us here): long enough for
// back-to-back products, short of the gaps between a layer's parts.
constexpr int kHelperSpin = 1000;

class Helpers {
 public:
  static Helpers& shared() {
    static Helpers* helpers = new Helpers(usable_cores() - 1);  // never joined: lives to exit
    return *helpers;
  }

  // fn(chunk) once for every chunk in [0, chunks), on this thread and the helpers.
  template <typename F>
  void run(int64_t chunks, F& fn) {
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (chunks <= 1 || slots_.empty() || forked_ || !lock.owns_lock()) {
      for (int64_t c = 0; c < chunks; ++c) fn(c);
      return;
    }
    job_ = [](void* f, int64_t c) { (*static_cast<F*>(f))(c); };
    arg_ = &fn;
    chunks_ = chunks;
    next_.store(0, std::memory_order_relaxed);
    open_.store(true);
    for (size_t i = 0; i < slots_.size() && i + 1 < static_cast<size_t>(chunks); ++i) {
      slots_[i].go.fetch_add(1, std::memory_order_release);
      slots_[i].go.notify_one();
    }
    work();
    open_.store(false);  // a helper waking from now on finds nothing to join
    while (active_.load() != 0) spin_pause();
  }

  int64_t threads() const { return static_cast<int64_t>(slots_.size()) + 1; }

 private:
  struct Slot {
    std::atomic<uint32_t> go{0};
  };

  explicit Helpers(int64_t count) : slots_(std::max<int64_t>(0, count)) {
    pthread_atfork(nullptr, nullptr, [] { forked_ = true; });
    for (size_t i = 0; i < slots_.size(); ++i) std::thread([this, i] { loop(i); }).detach();
  }

  static void spin_pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  void work() {
    for (int64_t c = next_.fetch_add(1); c < chunks_; c = next_.fetch_add(1)) job_(arg_, c);
  }

  void loop(size_t index) {
    auto& go = slots_[index].go;
    uint32_t seen = 0;
    for (;;) {
      uint32_t now = go.load(std::memory_order_acquire);
      for (int spin = 0; spin < kHelperSpin && now == seen; ++spin) {
        spin_pause();
        now = go.load(std::memory_order_acquire);
      }
      if (now == seen) {
        go.wait(seen, std::memory_order_acquire);
        continue;
      }
      seen = now;
      // Counted before looking: run() returns only once no helper is counted and the
      // call is closed, so a helper inside never outlives the call it works on.
      active_.fetch_add(1);
      if (open_.load()) work();
      active_.fetch_sub(1);
    }
  }

  std::vector<Slot> slots_;
  std::mutex busy_;
  std::atomic<bool> open_{false};
  std::atomic<int64_t> active_{0};
  std::atomic<int64_t> next_{0};
  int64_t chunks_ = 0;
  void (*job_)(void*, int64_t) = nullptr;
  void* arg_ = nullptr;
  static inline std::atomic<bool> forked_{false};
};

// fn(first, last) over [0, count) in contiguous chunks of at least ``min_part`` (a
// helper's wake-up costs microseconds: small work stays on this thread), up to 8 a thread,
// spread over the helper threads (:class:`Helpers`).
template <typename F>
void parallel_parts(int64_t count, int64_t min_part, F fn) {
  auto& helpers = Helpers::shared();
  int64_t chunks = std::clamp<int64_t>(count / std::max<int64_t>(1, min_part), 1,
                                       8 * helpers.threads());
  auto chunk = [&](int64_t c) { fn(count * c / chunks, count * (c + 1) / chunks); };
  helpers.run(chunks, chunk);
}

class RowSoftmax : public mx::Primitive {
 public:
  explicit RowSoftmax(mx::Stream s) : mx::Primitive(s) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& in = inputs[0];
    auto& out = outputs[0];
    allocate_like(in, out);
    int64_t cols = in.shape().back();
    int64_t rows = cols == 0 ? 0 : static_cast<int64_t>(in.size()) / cols;
    bool dense = in.flags().row_contiguous;
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([x = in.data<float>(), y = out.data<float>(), rows, cols, dense,
                      layout = Strided(in)]() {
      if (dense) {
        softmax_rows(x, y, rows, cols);
      } else {
        gather(x, layout, y, rows * cols);
        softmax_rows(y, y, rows, cols);
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("omlx softmax: CPU only");
  }
  const char* name() const override { return "OmlxRowSoftmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

class SwiGLU : public mx::Primitive {
 public:
  explicit SwiGLU(mx::Stream s) : mx::Primitive(s) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& g = inputs[0];
    const auto& x = inputs[1];
    auto& out = outputs[0];
    bool dense = g.flags().row_contiguous && x.flags().row_contiguous;
    if (dense && g.is_donatable()) {
      out.copy_shared_buffer(g);
    } else if (dense && x.is_donatable()) {
      out.copy_shared_buffer(x);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(g);
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    encoder.dispatch([gp = g.data<float>(), xp = x.data<float>(), y = out.data<float>(),
                      n = static_cast<int64_t>(out.size()), dense, g_layout = Strided(g),
                      x_layout = Strided(x)]() {
      if (dense) {
        swiglu_span(gp, xp, y, n);
        return;
      }
      for (int64_t i = 0; i < n; ++i) {  // strided inputs: rare, one element at a time
        float gi = gp[g_layout.offset(i)];
        y[i] = gi * (1.0f / (1.0f + poly_exp(-gi))) * xp[x_layout.offset(i)];
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("omlx swiglu: CPU only");
  }
  const char* name() const override { return "OmlxSwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

// -- RMS norm ------------------------------------------------------------------------

// mlx's fallback: y = (x * rsqrt(mean(x * x) + eps)) * w, the mean a sequential float32
// sum times 1/n, rsqrt as 1 / sqrt.
void rms_norm_row(const float* x, const float* w, float* y, int64_t n, float eps, float inv_n) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float square = x[i] * x[i];
    acc += square;
  }
  float scale = 1.0f / std::sqrt(acc * inv_n + eps);
  for (int64_t i = 0; i < n; ++i) {
    float normed = x[i] * scale;
    y[i] = normed * w[i];
  }
}

class RmsNorm : public mx::Primitive {
 public:
  RmsNorm(mx::Stream s, float eps) : mx::Primitive(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    int64_t cols = x.shape().back();
    int64_t rows = cols == 0 ? 0 : static_cast<int64_t>(x.size()) / cols;
    bool dense = x.flags().row_contiguous && w.flags().row_contiguous;
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    encoder.dispatch([xp = x.data<float>(), wp = w.data<float>(), y = out.data<float>(), rows,
                      cols, dense, eps = eps_, layout = Strided(x), w_layout = Strided(w)]() {
      float inv_n = static_cast<float>(1.0 / static_cast<double>(cols));
      std::vector<float> row, weight;
      const float* wr = wp;
      if (!dense) {
        weight.resize(cols);
        gather(wp, w_layout, weight.data(), cols);
        wr = weight.data();
        row.resize(cols);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xp + r * cols;
        if (!dense) {
          for (int64_t i = 0; i < cols; ++i) row[i] = xp[layout.offset(r * cols + i)];
          xr = row.data();
        }
        rms_norm_row(xr, wr, y + r * cols, cols, eps, inv_n);
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("omlx rms_norm: CPU only");
  }
  const char* name() const override { return "OmlxRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

// -- RoPE ------------------------------------------------------------------------------

// mlx's fallback: positions (t + offset) * scale, theta = position * inv_freq, mlx's own
// sin and cos; out1 = x1 cos - x2 sin, out2 = x1 sin + x2 cos, over pairs (2i, 2i+1)
// (traditional) or halves (i, i + dims/2); dimensions past dims pass through.
class Rope : public mx::Primitive {
 public:
  Rope(mx::Stream s, int dims, bool traditional, float scale)
      : mx::Primitive(s), dims_(dims), traditional_(traditional), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const auto& offset = inputs[1];
    const auto& inv_freqs = inputs[2];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(offset);
    encoder.set_input_array(inv_freqs);
    encoder.set_output_array(out);
    int64_t batch = x.shape(0), heads = x.shape(1), steps = x.shape(2), width = x.shape(3);
    // The offsets and frequencies are read where they lie (a view's strides), so the graph
    // needs no Contiguous node for them: two fewer nodes a rotation, 120 a decode step.
    encoder.dispatch([xp = x.data<float>(), op = offset.data<int32_t>(),
                      os = offset.size() == 1 ? int64_t{0} : int64_t{offset.strides()[0]},
                      fp = inv_freqs.data<float>(), fs = int64_t{inv_freqs.strides()[0]},
                      y = out.data<float>(), batch, heads, steps,
                      width, offsets = static_cast<int64_t>(offset.size()),
                      xs = std::vector<int64_t>(x.strides().begin(), x.strides().end()),
                      dims = dims_, traditional = traditional_, scale = scale_]() {
      int half = dims / 2;
      std::vector<float> cosines(half), sines(half);
      for (int64_t b = 0; b < batch; ++b) {
        float shift = static_cast<float>(op[offsets == 1 ? 0 : b * os]);
        for (int64_t t = 0; t < steps; ++t) {
          float position = (static_cast<float>(t) + shift) * scale;
          for (int i = 0; i < half; ++i) {
            mx::simd::Simd<float, 1> theta(position * fp[i * fs]);
            cosines[i] = mx::simd::cos(theta).value;
            sines[i] = mx::simd::sin(theta).value;
          }
          for (int64_t h = 0; h < heads; ++h) {
            const float* xr = xp + b * xs[0] + h * xs[1] + t * xs[2];
            float* yr = y + ((b * heads + h) * steps + t) * width;
            int64_t step = xs[3];
            for (int i = 0; i < half; ++i) {
              int64_t a = traditional ? 2 * i : i, c = traditional ? 2 * i + 1 : i + half;
              float x1 = xr[a * step], x2 = xr[c * step];
              float p = x1 * cosines[i], q = x2 * sines[i];
              float u = x1 * sines[i], v = x2 * cosines[i];
              yr[a] = p - q;
              yr[c] = u + v;
            }
            for (int64_t d = dims; d < width; ++d) yr[d] = xr[d * step];
          }
        }
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("omlx rope: CPU only");
  }
  const char* name() const override { return "OmlxRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int dims_;
  bool traditional_;
  float scale_;
};

// -- decode attention -------------------------------------------------------------------

// Where the decode kernels read a key or value row: a float32 row in place, or an
// mlx-quantized row (affine, ``bits`` 4 or 8, packed little-end first in uint32 words,
// a float32 scale and bias per ``group`` values) expanded into a row buffer with
// mx.dequantize's arithmetic (w * scale + bias, rounded apart), so both kernels compute
// on the same floats.
struct FloatRows {
  const float* base;
  std::vector<int64_t> strides;  // (batch, kv heads, keys, dim), in floats
  const float* row(int64_t b, int64_t g, int64_t l, float*) const {
    return base + b * strides[0] + g * strides[1] + l * strides[2];
  }
  // Rows [l, l + count) of (b, g) where they lie (``*stride`` apart), no copy.
  const float* block(int64_t b, int64_t g, int64_t l, int64_t, float*, int64_t* stride) const {
    *stride = strides[2];
    return row(b, g, l, nullptr);
  }
};

OMLX_CLONES void expand_bytes(const uint8_t* w, const float* scales, const float* biases,
                              float* y, int64_t n, int64_t group) {
  for (int64_t first = 0; first < n; first += group) {
    const float scale = scales[first / group], bias = biases[first / group];
    for (int64_t i = first; i < first + group; ++i) y[i] = static_cast<float>(w[i]) * scale + bias;
  }
}

OMLX_CLONES void expand_nibbles(const uint8_t* w, const float* scales, const float* biases,
                                float* y, int64_t n, int64_t group) {
  // Low nibble first: values 2i and 2i + 1 share byte i. A group is split into bytes
  // first (group_size <= 256, checked where the node is made), so both loops vectorize.
  uint8_t split[256];
  for (int64_t first = 0; first < n; first += group) {
    const uint8_t* pairs = w + first / 2;
    for (int64_t i = 0; i < group / 2; ++i) {
      split[2 * i] = pairs[i] & 0x0F;
      split[2 * i + 1] = pairs[i] >> 4;
    }
    const float scale = scales[first / group], bias = biases[first / group];
    for (int64_t i = 0; i < group; ++i) y[first + i] = static_cast<float>(split[i]) * scale + bias;
  }
}

struct QuantizedRows {
  const uint8_t* words;
  std::vector<int64_t> word_strides;  // in bytes
  const float* scales;
  std::vector<int64_t> scale_strides;  // in floats
  const float* biases;
  std::vector<int64_t> bias_strides;
  int64_t width, group, bits;
  const float* row(int64_t b, int64_t g, int64_t l, float* buffer) const {
    const uint8_t* w = words + b * word_strides[0] + g * word_strides[1] + l * word_strides[2];
    const float* s = scales + b * scale_strides[0] + g * scale_strides[1] + l * scale_strides[2];
    const float* z = biases + b * bias_strides[0] + g * bias_strides[1] + l * bias_strides[2];
    if (bits == 8) {
      expand_bytes(w, s, z, buffer, width, group);
    } else {
      expand_nibbles(w, s, z, buffer, width, group);
    }
    return buffer;
  }
  // Rows [l, l + count) of (b, g) expanded into ``buffer`` (count x width floats).
  const float* block(int64_t b, int64_t g, int64_t l, int64_t count, float* buffer,
                     int64_t* stride) const {
    for (int64_t i = 0; i < count; ++i) row(b, g, l + i, buffer + i * width);
    *stride = width;
    return buffer;
  }
};

// Keys quantized per channel over tiles of ``group`` tokens (omlx_core/scheduling/
// kv_tiles.py), stored in arrays shaped like per-row groups: a tile's words are its
// ``width`` channels one after another, each its ``group`` codes packed low bits first,
// and its ``width`` scales (and biases) are consecutive. Expanded a tile at a time with
// mx.dequantize's arithmetic (code * scale + bias), so both paths compute on the same
// floats. ``l`` and ``count`` are whole tiles.
struct TiledRows {
  const uint8_t* words;
  std::vector<int64_t> word_strides;  // in bytes
  const float* scales;
  std::vector<int64_t> scale_strides;  // in floats
  const float* biases;
  std::vector<int64_t> bias_strides;
  int64_t width, group, bits;
  const float* block(int64_t b, int64_t g, int64_t l, int64_t count, float* buffer,
                     int64_t* stride) const {
    const int64_t tile_bytes = group * bits / 8;
    for (int64_t first = l; first < l + count; first += group) {
      const uint8_t* w = words + b * word_strides[0] + g * word_strides[1] + first * word_strides[2];
      const float* s = scales + b * scale_strides[0] + g * scale_strides[1] + first * scale_strides[2];
      const float* z = biases + b * bias_strides[0] + g * bias_strides[1] + first * bias_strides[2];
      float* out = buffer + (first - l) * width;
      for (int64_t d = 0; d < width; ++d) {
        const uint8_t* codes = w + d * tile_bytes;
        const float scale = s[d], bias = z[d];
        if (bits == 8) {
          for (int64_t j = 0; j < group; ++j) out[j * width + d] = static_cast<float>(codes[j]) * scale + bias;
        } else {
          for (int64_t j = 0; j < group; j += 2) {
            out[j * width + d] = static_cast<float>(codes[j / 2] & 0x0F) * scale + bias;
            out[(j + 1) * width + d] = static_cast<float>(codes[j / 2] >> 4) * scale + bias;
          }
        }
      }
    }
    *stride = width;
    return buffer;
  }
};

// Rows [0, split) from ``head`` and the rest from ``tail`` (its row 0 at ``split``): a
// decode lane's tiles, then its window. A block across the split is gathered into the
// buffer (``split`` is a whole number of tiles, so the head's part is too).
template <typename Head, typename Tail>
struct SplitRows {
  Head head;
  Tail tail;
  int64_t split, width;
  const float* block(int64_t b, int64_t g, int64_t l, int64_t count, float* buffer,
                     int64_t* stride) const {
    if (l + count <= split) return head.block(b, g, l, count, buffer, stride);
    if (l >= split) return tail.block(b, g, l - split, count, buffer, stride);
    int64_t first = split - l, inner = 0;
    const float* rows = head.block(b, g, l, first, buffer, &inner);
    if (rows != buffer) {
      for (int64_t i = 0; i < first; ++i) std::memcpy(buffer + i * width, rows + i * inner, width * sizeof(float));
    }
    rows = tail.block(b, g, 0, count - first, buffer + first * width, &inner);
    if (rows != buffer + first * width) {
      for (int64_t i = 0; i < count - first; ++i)
        std::memcpy(buffer + (first + i) * width, rows + i * inner, width * sizeof(float));
    }
    *stride = width;
    return buffer;
  }
};

// A group's query heads against a block of key rows and back over value rows, with
// the key (or value) row loaded once for all the group's heads and several independent
// sums in flight. Computed as one call per row and head, each score was a chain of
// dependent adds behind a call through the clones' resolver: ~13 ms of a 16-row step of
// the default model at 100 cached tokens. Four keys' scores are summed side by side, a
// value row is added into output rows held in registers, and rows 8 ahead are fetched
// while these are summed: over 30 layers' keys and values read from memory, a 16-row
// step's attention 1.15-1.18x as fast, paired (BENCHMARKS.md). The arithmetic is theirs, lane
// for lane: a score sums the products in 8 lanes (lane k: elements k, k + 8, ...), then
// ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then the tail in order; an output
// element adds weight x value key after key, in key order.
typedef float v8f __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

static inline __attribute__((always_inline)) float lanes_sum(v8f s) {
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// scores[r * keys + l] = query row r . key row l for l in [0, count), ``R`` query rows
// (``width`` apart) and keys ``stride`` apart.
template <int R>
static inline __attribute__((always_inline)) void block_scores(
    const float* query, const float* key, int64_t stride, int64_t count, int64_t width,
    float* scores, int64_t keys) {
  int64_t full = width / 8 * 8;
  int64_t l = 0;
  if (full == width) {
    // four keys at a time: four independent chains per query row, each key's sums as in
    // the loop below
    for (; l + 4 <= count; l += 4) {
      const float* k = key + l * stride;
      for (int j = 8; j < 12; ++j)
        for (int64_t d = 0; d < width; d += 16) __builtin_prefetch(k + j * stride + d);
      v8f acc[4][R];
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < R; ++r) acc[j][r] = v8f{0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t d = 0; d < full; d += 8) {
        v8f k0 = load8(k + d), k1 = load8(k + stride + d), k2 = load8(k + 2 * stride + d),
            k3 = load8(k + 3 * stride + d);
        for (int r = 0; r < R; ++r) {
          v8f q = load8(query + r * width + d);
          acc[0][r] += q * k0;
          acc[1][r] += q * k1;
          acc[2][r] += q * k2;
          acc[3][r] += q * k3;
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) scores[r * keys + l + j] = lanes_sum(acc[j][r]);
    }
  }
  for (; l < count; ++l) {
    const float* k = key + l * stride;
    for (int64_t d = 0; d < width; d += 16) __builtin_prefetch(k + 8 * stride + d);
    v8f acc[R];
    for (int r = 0; r < R; ++r) acc[r] = v8f{0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t d = 0; d < full; d += 8) {
      v8f kv = load8(k + d);
      for (int r = 0; r < R; ++r) acc[r] += load8(query + r * width + d) * kv;
    }
    for (int r = 0; r < R; ++r) {
      float out = lanes_sum(acc[r]);
      for (int64_t d = full; d < width; ++d) out += query[r * width + d] * k[d];
      scores[r * keys + l] = out;
    }
  }
}

// y[r] += weight[r * keys + l] x value row l[0, 64) for R (at most 3) rows ``width``
// apart, keys in order, skipping hidden ones, the 64 outputs of each row in registers.
template <int R>
static inline __attribute__((always_inline)) void strip_values(
    const float* weights, const float* value, int64_t stride, int64_t count, int64_t width,
    const bool* shown, int64_t shown_stride, float* y, int64_t keys) {
  v8f acc[R][8];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 8; ++c) acc[r][c] = load8(y + r * width + c * 8);
  for (int64_t l = 0; l < count; ++l) {
    const float* v = value + l * stride;
    for (int d = 0; d < 64; d += 16) __builtin_prefetch(v + 8 * stride + d);
    if (shown != nullptr && !shown[l * shown_stride]) continue;  // its weight is exactly 0
    v8f vc[8];
    for (int c = 0; c < 8; ++c) vc[c] = load8(v + c * 8);
    for (int r = 0; r < R; ++r) {
      float a = weights[r * keys + l];
      v8f av = v8f{a, a, a, a, a, a, a, a};
      for (int c = 0; c < 8; ++c) acc[r][c] += av * vc[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 8; ++c) std::memcpy(y + r * width + c * 8, &acc[r][c], sizeof(v8f));
}

// y[r] += weight[r * keys + l] x value row l, keys in order, skipping hidden ones.
template <int R>
static inline __attribute__((always_inline)) void block_values(
    const float* weights, const float* value, int64_t stride, int64_t count, int64_t width,
    const bool* shown, int64_t shown_stride, float* y, int64_t keys) {
  if (width % 64 == 0) {
    // strips of 64 outputs for up to 3 rows at a time: the running sums stay in registers
    for (int64_t column = 0; column < width; column += 64) {
      for (int r = 0; r < R; r += 3) {
        const float* w = weights + r * keys;
        const float* v = value + column;
        float* yr = y + r * width + column;
        switch (std::min(3, R - r)) {
          case 1: strip_values<1>(w, v, stride, count, width, shown, shown_stride, yr, keys); break;
          case 2: strip_values<2>(w, v, stride, count, width, shown, shown_stride, yr, keys); break;
          default: strip_values<3>(w, v, stride, count, width, shown, shown_stride, yr, keys);
        }
      }
    }
    return;
  }
  for (int64_t l = 0; l < count; ++l) {
    if (shown != nullptr && !shown[l * shown_stride]) continue;  // its weight is exactly 0
    const float* v = value + l * stride;
    for (int64_t d = 0; d < width; d += 16) __builtin_prefetch(v + 8 * stride + d);
    for (int r = 0; r < R; ++r) {
      float a = weights[r * keys + l];
      float* yr = y + r * width;
      for (int64_t d = 0; d < width; ++d) yr[d] += a * v[d];
    }
  }
}

template <int R>
static inline __attribute__((always_inline)) void group_block(
    bool values, const float* query, const float* rows, int64_t stride, int64_t count,
    int64_t width, float* scores, int64_t keys, const bool* shown, int64_t shown_stride,
    float* y) {
  if (values) {
    block_values<R>(scores, rows, stride, count, width, shown, shown_stride, y, keys);
  } else {
    block_scores<R>(query, rows, stride, count, width, scores, keys);
  }
}

// One block of a group's keys (``values`` false: their scores) or values (true: their
// weighted sum into y), for ``repeats`` query heads.
OMLX_CLONES void attend_block(bool values, int64_t repeats, const float* query,
                              const float* rows, int64_t stride, int64_t count, int64_t width,
                              float* scores, int64_t keys, const bool* shown,
                              int64_t shown_stride, float* y) {
  switch (repeats) {
    case 1: return group_block<1>(values, query, rows, stride, count, width, scores, keys, shown, shown_stride, y);
    case 2: return group_block<2>(values, query, rows, stride, count, width, scores, keys, shown, shown_stride, y);
    case 3: return group_block<3>(values, query, rows, stride, count, width, scores, keys, shown, shown_stride, y);
    case 4: return group_block<4>(values, query, rows, stride, count, width, scores, keys, shown, shown_stride, y);
    case 5: return group_block<5>(values, query, rows, stride, count, width, scores, keys, shown, shown_stride, y);
    case 6: return group_block<6>(values, query, rows, stride, count, width, scores, keys, shown, shown_stride, y);
    case 7: return group_block<7>(values, query, rows, stride, count, width, scores, keys, shown, shown_stride, y);
    case 8: return group_block<8>(values, query, rows, stride, count, width, scores, keys, shown, shown_stride, y);
    default:
      for (int64_t r = 0; r < repeats; ++r)
        group_block<1>(values, values ? nullptr : query + r * width, rows, stride, count, width,
                       scores + r * keys, keys, shown, shown_stride, values ? y + r * width : nullptr);
  }
}

// Keys (and values) a group reads per block: a quantized cache expands a block at a time.
constexpr int64_t kDecodeBlock = 256;

// One query row per (sequence, head): softmax(q k^T * scale, masked) v, reading the
// keys and values through ``Rows``. The mask, when there is one, is a bool (batch or 1,
// 1, 1, keys) array (a decode lane's left padding).
template <typename KeyRows, typename ValueRows>
void decode_attention_rows(const float* qp, const std::vector<int64_t>& qs, const KeyRows& kr,
                           const ValueRows& vr, const bool* mp, const std::vector<int64_t>& ms,
                           float* y, int64_t batch, int64_t heads, int64_t kv_heads,
                           int64_t keys, int64_t width, float scale) {
  int64_t repeats = heads / kv_heads;
  auto one_group = [&](int64_t b, int64_t g, std::vector<float>& query, std::vector<float>& scores,
                       std::vector<float>& buffer) {
    // The group's query heads share each key and value row: read it once.
    for (int64_t r = 0; r < repeats; ++r) {
      const float* qr = qp + b * qs[0] + (g * repeats + r) * qs[1];
      for (int64_t d = 0; d < width; ++d) query[r * width + d] = qr[d * qs[3]] * scale;
    }
    const bool* shown = mp == nullptr ? nullptr : mp + b * ms[0];
    int64_t shown_stride = mp == nullptr ? 0 : ms[3];
    int64_t stride = 0;
    for (int64_t l = 0; l < keys; l += kDecodeBlock) {
      int64_t count = std::min(kDecodeBlock, keys - l);
      const float* rows = kr.block(b, g, l, count, buffer.data(), &stride);
      attend_block(false, repeats, query.data(), rows, stride, count, width, scores.data() + l,
                   keys, nullptr, 0, nullptr);
    }
    const float hidden = -std::numeric_limits<float>::max();
    if (shown != nullptr) {
      for (int64_t l = 0; l < keys; ++l)
        if (!shown[l * shown_stride])
          for (int64_t r = 0; r < repeats; ++r) scores[r * keys + l] = hidden;
    }
    float* yg = y + (b * heads + g * repeats) * width;
    std::fill(yg, yg + repeats * width, 0.0f);
    for (int64_t r = 0; r < repeats; ++r) {
      float* sr = scores.data() + r * keys;
      float m = row_max(sr, keys);
      exp_shifted(sr, sr, keys, m);
      scale_row(sr, keys, 1.0f / row_sum(sr, keys));
    }
    for (int64_t l = 0; l < keys; l += kDecodeBlock) {
      int64_t count = std::min(kDecodeBlock, keys - l);
      const float* rows = vr.block(b, g, l, count, buffer.data(), &stride);
      attend_block(true, repeats, nullptr, rows, stride, count, width, scores.data() + l, keys,
                   shown == nullptr ? nullptr : shown + l * shown_stride, shown_stride, yg);
    }
  };
  int64_t groups = batch * kv_heads;
  auto run = [&](int64_t first, int64_t last) {
    std::vector<float> query(repeats * width), scores(repeats * keys),
        buffer(kDecodeBlock * width);
    for (int64_t i = first; i < last; ++i)
      one_group(i / kv_heads, i % kv_heads, query, scores, buffer);
  };
  // Over the helper threads once a chunk has enough work to pay for a wake-up.
  parallel_parts(groups, std::max<int64_t>(1, (1 << 17) / std::max<int64_t>(1, repeats * keys * width)),
                 run);
}

std::vector<int64_t> strides_of(const mx::array& a) {
  return std::vector<int64_t>(a.strides().begin(), a.strides().end());
}

// The mask's pointer and strides (a batch of one broadcast over the batch).
std::pair<const bool*, std::vector<int64_t>> mask_of(const mx::array& m) {
  auto ms = strides_of(m);
  if (m.shape(0) == 1) ms[0] = 0;
  return {m.data<bool>(), ms};
}

class DecodeAttention : public mx::Primitive {
 public:
  DecodeAttention(mx::Stream s, float scale, bool masked)
      : mx::Primitive(s), scale_(scale), masked_(masked) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& q = inputs[0];
    const auto& k = inputs[1];
    const auto& v = inputs[2];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    auto [mp, ms] = masked_ ? mask_of(inputs[3]) : std::pair<const bool*, std::vector<int64_t>>{};
    encoder.dispatch([qp = q.data<float>(), qs = strides_of(q),
                      kr = FloatRows{k.data<float>(), strides_of(k)},
                      vr = FloatRows{v.data<float>(), strides_of(v)}, mp, ms,
                      y = out.data<float>(), batch = q.shape(0), heads = q.shape(1),
                      kv_heads = k.shape(1), keys = k.shape(2), width = q.shape(3),
                      scale = scale_]() {
      decode_attention_rows(qp, qs, kr, vr, mp, ms, y, batch, heads, kv_heads, keys, width, scale);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("omlx decode_attention: CPU only");
  }
  const char* name() const override { return "OmlxDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeAttention&>(other);
    return scale_ == o.scale_ && masked_ == o.masked_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[2].shape(3);
    return {shape};
  }

 private:
  float scale_;
  bool masked_;
};

// Rows of the quantized triple at ``inputs[first]``, ``first + 1``, ``first + 2``.
QuantizedRows quantized_rows(const std::vector<mx::array>& inputs, size_t first, int64_t width,
                             int64_t group, int64_t bits) {
  auto word_strides = strides_of(inputs[first]);
  for (auto& stride : word_strides) stride *= 4;  // uint32 words, read as bytes
  return QuantizedRows{reinterpret_cast<const uint8_t*>(inputs[first].data<uint32_t>()),
                       word_strides, inputs[first + 1].data<float>(), strides_of(inputs[first + 1]),
                       inputs[first + 2].data<float>(), strides_of(inputs[first + 2]), width, group,
                       bits};
}

// The same over an mlx-quantized KV cache: inputs q, the keys' words, scales and
// biases, the values' words, scales and biases, then the mask if any. No layer's keys
// and values are expanded whole: a block of up to 256 rows at a time (kDecodeBlock), into
// a buffer of that size per thread.
class QuantizedDecodeAttention : public mx::Primitive {
 public:
  QuantizedDecodeAttention(mx::Stream s, float scale, int group, int bits, bool masked)
      : mx::Primitive(s), scale_(scale), group_(group), bits_(bits), masked_(masked) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& q = inputs[0];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    int64_t width = q.shape(3);
    auto [mp, ms] = masked_ ? mask_of(inputs[7]) : std::pair<const bool*, std::vector<int64_t>>{};
    encoder.dispatch([qp = q.data<float>(), qs = strides_of(q),
                      kr = quantized_rows(inputs, 1, width, group_, bits_),
                      vr = quantized_rows(inputs, 4, width, group_, bits_), mp,
                      ms, y = out.data<float>(), batch = q.shape(0), heads = q.shape(1),
                      kv_heads = inputs[1].shape(1), keys = inputs[1].shape(2), width,
                      scale = scale_]() {
      decode_attention_rows(qp, qs, kr, vr, mp, ms, y, batch, heads, kv_heads, keys, width, scale);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("omlx quantized_decode_attention: CPU only");
  }
  const char* name() const override { return "OmlxQuantizedDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedDecodeAttention&>(other);
    return scale_ == o.scale_ && group_ == o.group_ && bits_ == o.bits_ && masked_ == o.masked_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  int group_;
  int bits_;
  bool masked_;
};

// The same over a decode lane's tiled KV (omlx_core/scheduling/kv_tiles.py): inputs q,
// the tiles' key words, scales, biases and value words, scales, biases (positions
// [0, split)), the window's float keys and value words, scales, biases (the next
// positions), then the mask. A block of up to 256 rows is expanded at a time.
class TiledDecodeAttention : public mx::Primitive {
 public:
  TiledDecodeAttention(mx::Stream s, float scale, int group, int bits)
      : mx::Primitive(s), scale_(scale), group_(group), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& q = inputs[0];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    int64_t width = q.shape(3), split = inputs[1].shape(2);
    auto word_strides = strides_of(inputs[1]);
    for (auto& stride : word_strides) stride *= 4;
    TiledRows tiles{reinterpret_cast<const uint8_t*>(inputs[1].data<uint32_t>()), word_strides,
                    inputs[2].data<float>(), strides_of(inputs[2]), inputs[3].data<float>(),
                    strides_of(inputs[3]), width, group_, bits_};
    SplitRows<TiledRows, FloatRows> kr{tiles, FloatRows{inputs[7].data<float>(), strides_of(inputs[7])},
                                       split, width};
    SplitRows<QuantizedRows, QuantizedRows> vr{quantized_rows(inputs, 4, width, group_, bits_),
                                               quantized_rows(inputs, 8, width, group_, bits_), split, width};
    auto [mp, ms] = mask_of(inputs[11]);
    encoder.dispatch([qp = q.data<float>(), qs = strides_of(q), kr, vr, mp, ms, y = out.data<float>(),
                      batch = q.shape(0), heads = q.shape(1), kv_heads = inputs[7].shape(1),
                      keys = split + inputs[7].shape(2), width, scale = scale_]() {
      decode_attention_rows(qp, qs, kr, vr, mp, ms, y, batch, heads, kv_heads, keys, width, scale);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("omlx tiled_decode_attention: CPU only");
  }
  const char* name() const override { return "OmlxTiledDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const TiledDecodeAttention&>(other);
    return scale_ == o.scale_ && group_ == o.group_ && bits_ == o.bits_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  int group_;
  int bits_;
};

// -- encoder layers: exact GELU, layer norm, short-sequence attention ------------------

// 0.5 x (1 + erf(x / sqrt 2)), erf by Abramowitz and Stegun 7.1.26 (absolute error under
// 1.5e-7, float32's own rounding): erfc(z) = t P(t) exp(-z^2), t = 1 / (1 + p z), z >= 0;
// 1 + erf(x / sqrt 2) is 2 - erfc for x >= 0 and erfc itself below, so no cancellation.
OMLX_CLONES void gelu_span(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i];
    float z = std::fabs(v) * 0.70710678118654752f;
    float t = 1.0f / (1.0f + 0.3275911f * z);
    float p = 1.061405429f;
    p = p * t - 1.453152027f;
    p = p * t + 1.421413741f;
    p = p * t - 0.284496736f;
    p = p * t + 0.254829592f;
    float erfc = p * t * poly_exp(-(z * z));
    float one_plus_erf = v >= 0.0f ? 2.0f - erfc : erfc;
    y[i] = 0.5f * v * one_plus_erf;
  }
}

class Gelu : public mx::Primitive {
 public:
  explicit Gelu(mx::Stream s) : mx::Primitive(s) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& in = inputs[0];
    auto& out = outputs[0];
    allocate_like(in, out);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([x = in.data<float>(), y = out.data<float>(),
                      n = static_cast<int64_t>(in.size())]() {
      parallel_parts(n, 1 << 16, [&](int64_t first, int64_t last) {
        gelu_span(x + first, y + first, last - first);
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("omlx gelu: CPU only");
  }
  const char* name() const override { return "OmlxGelu"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

// y = (s - mean(s)) / sqrt(var(s) + eps) * w + b over the last axis, s = x (+ residual):
// two passes over each row (mean, then the centred squares), as mlx's layer_norm.
OMLX_CLONES void layer_norm_row(const float* x, const float* r, const float* w, const float* b,
                                float* y, int64_t n, float eps) {
  if (r != nullptr) {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] + r[i];
  } else if (y != x) {
    std::memcpy(y, x, n * sizeof(float));
  }
  float mean = row_sum(y, n) / static_cast<float>(n);
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) {
      float d = y[i + k] - mean;
      s[k] += d * d;
    }
  float var = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) var += (y[i] - mean) * (y[i] - mean);
  float scale = 1.0f / std::sqrt(var / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) y[j] = (y[j] - mean) * scale * w[j] + b[j];
}

class LayerNorm : public mx::Primitive {
 public:
  LayerNorm(mx::Stream s, float eps, bool residual)
      : mx::Primitive(s), eps_(eps), residual_(residual) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    // inputs: x, weight, bias (all row-contiguous, made so where the node is built), then
    // the residual if any
    const auto& x = inputs[0];
    auto& out = outputs[0];
    if (x.is_donatable()) {
      out.copy_shared_buffer(x);
    } else if (residual_ && inputs[3].is_donatable()) {
      out.copy_shared_buffer(inputs[3]);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    int64_t cols = x.shape().back();
    int64_t rows = cols == 0 ? 0 : static_cast<int64_t>(x.size()) / cols;
    encoder.dispatch([xp = x.data<float>(), wp = inputs[1].data<float>(),
                      bp = inputs[2].data<float>(),
                      rp = residual_ ? inputs[3].data<float>() : nullptr, y = out.data<float>(),
                      rows, cols, eps = eps_]() {
      parallel_parts(rows, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, cols)),
                     [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; ++r)
          layer_norm_row(xp + r * cols, rp == nullptr ? nullptr : rp + r * cols, wp, bp,
                         y + r * cols, cols, eps);
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("omlx layer_norm: CPU only");
  }
  const char* name() const override { return "OmlxLayerNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const LayerNorm&>(other);
    return eps_ == o.eps_ && residual_ == o.residual_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
  bool residual_;
};

// Bidirectional attention of packed sequences: one (tokens, 3 x hidden) projection
// (queries, keys and values side by side, heads of ``width`` in each) holding the
// sequences one after another, sequence s at tokens [offsets[s], offsets[s + 1]); each
// token attends to its own sequence's tokens only, so no position is padding. Out:
// (tokens, hidden), heads side by side, as the next projection reads them. Scores,
// softmax and the weighted values in one pass per (sequence, head, query), nothing
// materialized but one score row.
// One (sequence, head): the helpers are written out here, not called, so that each
// clone of this function inlines and vectorizes them (a call into another clone goes
// through its resolver: at ~10 tokens and 32 dims the calls were most of the time).
OMLX_CLONES void segment_head(const float* qkv, int64_t stride, int64_t tokens, int64_t width,
                              float scale, float* y, int64_t y_stride, int64_t key_offset,
                              int64_t value_offset, float* scores) {
  for (int64_t i = 0; i < tokens; ++i) {
    const float* q = qkv + i * stride;
    float m = -INFINITY;
    for (int64_t j = 0; j < tokens; ++j) {
      const float* k = qkv + j * stride + key_offset;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t d = 0;
      for (; d + 8 <= width; d += 8)
        for (int l = 0; l < 8; ++l) acc[l] += q[d + l] * k[d + l];
      float score = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; d < width; ++d) score += q[d] * k[d];
      score *= scale;
      scores[j] = score;
      m = score > m ? score : m;
    }
    float total = 0.0f;
    for (int64_t j = 0; j < tokens; ++j) {
      scores[j] = poly_exp(scores[j] - m);
      total += scores[j];
    }
    float inverse = 1.0f / total;
    float* out = y + i * y_stride;
    for (int64_t d = 0; d < width; ++d) out[d] = 0.0f;
    for (int64_t j = 0; j < tokens; ++j) {
      const float* v = qkv + j * stride + value_offset;
      float weight = scores[j] * inverse;
      for (int64_t d = 0; d < width; ++d) out[d] += weight * v[d];
    }
  }
}

class PackedAttention : public mx::Primitive {
 public:
  PackedAttention(mx::Stream s, int heads, float scale)
      : mx::Primitive(s), heads_(heads), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& qkv = inputs[0];
    const auto& offsets = inputs[1];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(qkv);
    encoder.set_input_array(offsets);
    encoder.set_output_array(out);
    int64_t hidden = qkv.shape().back() / 3;
    int64_t tokens = static_cast<int64_t>(qkv.size()) / (3 * hidden);
    encoder.dispatch([xp = qkv.data<float>(), op = offsets.data<int32_t>(), y = out.data<float>(),
                      sequences = static_cast<int64_t>(offsets.size()) - 1, tokens, hidden,
                      heads = static_cast<int64_t>(heads_), scale = scale_]() {
      int64_t width = hidden / heads;
      int64_t longest = 0, pairs = 0;
      for (int64_t s = 0; s < sequences; ++s) {
        int64_t first = std::clamp<int64_t>(op[s], 0, tokens);
        int64_t last = std::clamp<int64_t>(op[s + 1], first, tokens);
        longest = std::max(longest, last - first);
        pairs += (last - first) * (last - first);
      }
      // (sequence, head) tasks; a part of them per core once a part is worth a thread
      int64_t per_task = std::max<int64_t>(1, pairs * width / std::max<int64_t>(1, sequences));
      parallel_parts(sequences * heads, std::max<int64_t>(1, (1 << 16) / per_task),
                     [&](int64_t first_task, int64_t last_task) {
        std::vector<float> scores(std::max<int64_t>(1, longest));
        for (int64_t task = first_task; task < last_task; ++task) {
          int64_t s = task / heads, h = task % heads;
          int64_t first = std::clamp<int64_t>(op[s], 0, tokens);
          int64_t last = std::clamp<int64_t>(op[s + 1], first, tokens);
          segment_head(xp + first * 3 * hidden + h * width, 3 * hidden, last - first, width,
                       scale, y + first * hidden + h * width, hidden, hidden, 2 * hidden,
                       scores.data());
        }
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("omlx packed_attention: CPU only");
  }
  const char* name() const override { return "OmlxPackedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PackedAttention&>(other);
    return heads_ == o.heads_ && scale_ == o.scale_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() /= 3;
    return {shape};
  }

 private:
  int heads_;
  float scale_;
};

// -- linear layers: a weight packed in panels ----------------------------------------

// y = x w^T for a float32 linear layer whose weight (N outputs x K inputs) is stored in
// panels of W outputs (48, 32 or 16: the widest that divides N), each panel K x W (an
// output's weights down a column): a row of x times a panel is W running sums that read
// the panel once, front to back, in full vector loads. BLAS packs the weight into a layout like this on every call; for the
// few rows of a decode step that copy is most of the product (on the default model, a
// 16-row product of all its linear layers: 60 ms in OpenBLAS, 25 ms here). Every output
// is one chain of fused multiply-adds over k = 0 .. K-1 from zero, whatever the rows, the
// vector width or the thread: a row's result does not depend on what it is batched with.

#if defined(__x86_64__)
// MB rows of x times one panel of 16 NV outputs over k in [k0, k1): y[r, 0 : 16 NV] for
// r < MB, NV 16-wide running sums a row (AVX-512: 8 rows x 3 sums is 24 of its 32
// registers). From zero when k0 is 0, else from y, where the same sums left off: a sum
// stored and loaded again is the same float32, so the chain over k is unbroken.
template <int MB, int NV>
__attribute__((target("avx512f"))) void panel_rows_512(const float* x, int64_t ldx,
                                                       const float* panel, int64_t k0, int64_t k1,
                                                       float* y, int64_t ldy) {
  __m512 acc[MB][NV];
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < NV; ++j)
      acc[r][j] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy + 16 * j);
  for (int64_t k = k0; k < k1; ++k) {
    const float* w = panel + k * 16 * NV;
    __m512 wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = _mm512_loadu_ps(w + 16 * j);
    for (int r = 0; r < MB; ++r) {
      __m512 v = _mm512_set1_ps(x[r * ldx + k]);
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_fmadd_ps(v, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(y + r * ldy + 16 * j, acc[r][j]);
}

// The same with AVX2 (16 registers): the panel's 16 NV outputs in parts of VP 8-wide sums
// a row. Parts of 16 (VP 2: MB x 2 sums) fit any panel; a 48-output panel's four rows run
// as two parts of 24 (VP 3: twelve sums), so a k's three weight loads and four broadcasts
// feed twelve multiply-adds, not eight: twelve independent sums keep both FMA units busy
// through their latency where eight barely do (a 256-row prefill chunk's products are
// compute bound). Each output is the same chain over k whatever the part width.
template <int MB, int NV, int VP = 2>
__attribute__((target("avx2,fma"))) void panel_rows_256(const float* x, int64_t ldx,
                                                        const float* panel, int64_t k0, int64_t k1,
                                                        float* y, int64_t ldy) {
  static_assert((2 * NV) % VP == 0, "a panel is whole parts");
  for (int part = 0; part < 2 * NV / VP; ++part) {
    float* out = y + 8 * VP * part;
    __m256 acc[MB][VP];
    for (int r = 0; r < MB; ++r)
      for (int j = 0; j < VP; ++j)
        acc[r][j] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + r * ldy + 8 * j);
    for (int64_t k = k0; k < k1; ++k) {
      const float* w = panel + k * 16 * NV + 8 * VP * part;
      __m256 wv[VP];
      for (int j = 0; j < VP; ++j) wv[j] = _mm256_loadu_ps(w + 8 * j);
      for (int r = 0; r < MB; ++r) {
        __m256 v = _mm256_set1_ps(x[r * ldx + k]);
        for (int j = 0; j < VP; ++j) acc[r][j] = _mm256_fmadd_ps(v, wv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < MB; ++r)
      for (int j = 0; j < VP; ++j) _mm256_storeu_ps(out + r * ldy + 8 * j, acc[r][j]);
  }
}
#endif

// The vector width the CPU runs the product at: 512, 256, or 0 (not at all here).
int packed_matmul_bits() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 256;
#endif
  return 0;
}

// Rows [0, rows) of x times panels [first, last) of 16 NV outputs each: rows in chunks
// of 64 (a chunk of x stays in L2 while it meets each panel), each chunk 8, 4, 2, then 1
// rows at a time (AVX2: 4, 2, 1). Where a chunk has more rows than the largest block,
// every block meets a slice of kPanelSlice k's of the panel before the next slice: the panel comes
// from memory once, while all the chunk's rows are summed (block by block over the whole
// panel, the first block waited for memory with a quarter of the multiply-adds to hide
// it, the others found it in L2 with nothing left to fetch).
constexpr int64_t kPanelSlice = 64;

template <int NV>
void panels_times_rows(const float* x, int64_t rows, int64_t k_len, const float* packed,
                       int64_t first, int64_t last, float* y, int64_t n, int bits) {
  constexpr int64_t width = 16 * NV;
  const int64_t widest = bits == 512 ? 8 : 4;  // rows of the largest block
  for (int64_t chunk = 0; chunk < rows; chunk += 64) {
    int64_t chunk_end = std::min(rows, chunk + 64);
    int64_t slice = chunk_end - chunk > widest ? kPanelSlice : k_len;
    for (int64_t p = first; p < last; ++p) {
      const float* panel = packed + p * k_len * width;
      for (int64_t k0 = 0; k0 < k_len; k0 += slice) {
        int64_t k1 = std::min(k_len, k0 + slice);
        int64_t r = chunk;
        auto go = [&](auto block, int64_t mb) {
          for (; r + mb <= chunk_end; r += mb)
            block(x + r * k_len, k_len, panel, k0, k1, y + r * n + p * width, n);
        };
#if defined(__x86_64__)
        if (bits == 512) {
          go(panel_rows_512<8, NV>, 8);
          go(panel_rows_512<4, NV>, 4);
          go(panel_rows_512<2, NV>, 2);
          go(panel_rows_512<1, NV>, 1);
        } else {
          go(panel_rows_256<4, NV, NV == 3 ? 3 : 2>, 4);
          go(panel_rows_256<2, NV>, 2);
          go(panel_rows_256<1, NV>, 1);
        }
#else
        (void)go;  // packed_matmul_bits() is 0: the product is never built here
#endif
      }
    }
  }
}

// One product, one or several outputs: output i is the product of panels
// [splits[0] + ... + splits[i - 1], ... + splits[i]) (sibling layers called on one
// input, q/k/v or gate/up, are one weight and one call: their own outputs, no slices).
class PackedMatmul : public mx::Primitive {
 public:
  PackedMatmul(mx::Stream s, int bits, std::vector<int64_t> splits)
      : mx::Primitive(s), bits_(bits), splits_(std::move(splits)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    // inputs: x (..., K) and the panels (N / W, K, W), W 48, 32 or 16, both row-contiguous
    const auto& x = inputs[0];
    const auto& packed = inputs[1];
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(packed);
    std::vector<float*> ys;
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      encoder.set_output_array(out);
      ys.push_back(out.data<float>());
    }
    int64_t k_len = packed.shape(1);
    int64_t panels = packed.shape(0);
    int64_t width = packed.shape(2);
    // x is read row-major: in place where it is (almost always: a norm's or a kernel's
    // output), else copied so first, in the task (its values are ready only there).
    float* dense = nullptr;
    if (!x.flags().row_contiguous) {
      mx::array copy(x.shape(), mx::float32, nullptr, {});
      copy.set_data(mx::allocator::malloc(copy.nbytes()));
      dense = copy.data<float>();
      encoder.add_temporary(std::move(copy));
    }
    encoder.dispatch([source = x.data<float>(), layout = Strided(x), dense,
                      wp = packed.data<float>(), ys = std::move(ys),
                      splits = splits_, rows = static_cast<int64_t>(x.size()) / k_len, k_len,
                      panels, width, bits = bits_]() {
      const float* xp = source;
      if (dense != nullptr) {
        gather(source, layout, dense, rows * k_len);
        xp = dense;
      }
      auto& helpers = Helpers::shared();
      // Chunks of at least ~64k multiply-adds (a helper's wake-up costs microseconds), up
      // to 8 a thread (what a thread that starts late leaves is taken by the others).
      int64_t chunks = std::min({8 * helpers.threads(), panels,
                                 std::max<int64_t>(1, rows * panels * width * k_len / (1 << 16))});
      auto chunk = [&](int64_t c) {
        int64_t first = panels * c / chunks, last = panels * (c + 1) / chunks;
        int64_t start = 0;  // the first panel of output i
        for (size_t i = 0; i < splits.size(); start += splits[i], ++i) {
          int64_t from = std::max(first, start), to = std::min(last, start + splits[i]);
          if (from >= to) continue;
          const float* w = wp + start * k_len * width;
          int64_t n = splits[i] * width;
          if (width == 48) panels_times_rows<3>(xp, rows, k_len, w, from - start, to - start, ys[i], n, bits);
          else if (width == 32) panels_times_rows<2>(xp, rows, k_len, w, from - start, to - start, ys[i], n, bits);
          else panels_times_rows<1>(xp, rows, k_len, w, from - start, to - start, ys[i], n, bits);
        }
      };
      helpers.run(chunks, chunk);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("omlx packed_matmul: CPU only");
  }
  const char* name() const override { return "OmlxPackedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PackedMatmul&>(other);
    return bits_ == o.bits_ && splits_ == o.splits_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes;
    for (int64_t panels : splits_) {
      auto shape = inputs[0].shape();
      shape.back() = static_cast<int>(panels * inputs[1].shape(2));
      shapes.push_back(shape);
    }
    return shapes;
  }

 private:
  int bits_;
  std::vector<int64_t> splits_;
};

mx::Stream cpu_stream() { return mx::default_stream(mx::Device::cpu); }

mx::array softmax(const mx::array& x) {
  if (x.dtype() != mx::float32 || x.ndim() == 0) {
    throw std::invalid_argument("softmax: needs a float32 array of at least one axis");
  }
  auto s = cpu_stream();
  return mx::array(x.shape(), mx::float32, std::make_shared<RowSoftmax>(s), {x});
}

mx::array swiglu(const mx::array& gate, const mx::array& x) {
  if (gate.dtype() != mx::float32 || x.dtype() != mx::float32 || gate.shape() != x.shape()) {
    throw std::invalid_argument("swiglu: needs two float32 arrays of one shape");
  }
  auto s = cpu_stream();
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(s), {gate, x});
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || x.ndim() == 0 ||
      weight.ndim() != 1 || weight.shape(0) != x.shape().back()) {
    throw std::invalid_argument("rms_norm: needs float32 x and a float32 weight of x's last axis");
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(cpu_stream(), eps), {x, weight});
}

mx::array rope(const mx::array& x, const mx::array& offset, const mx::array& inv_freqs, int dims,
               bool traditional, float scale) {
  if (x.dtype() != mx::float32 || x.ndim() != 4 || dims % 2 || dims > x.shape(3) ||
      offset.dtype() != mx::int32 || offset.ndim() > 1 ||
      (offset.size() != 1 && offset.size() != static_cast<size_t>(x.shape(0))) ||
      inv_freqs.dtype() != mx::float32 || inv_freqs.ndim() != 1 || inv_freqs.shape(0) != dims / 2) {
    throw std::invalid_argument("rope: needs float32 (B, H, T, D) x, int32 offset(s), "
                                "float32 inverse frequencies of dims / 2");
  }
  auto s = cpu_stream();
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(s, dims, traditional, scale),
                   {x, offset, inv_freqs});
}

mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           std::optional<mx::array> mask, float scale) {
  bool shapes = q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 && q.shape(2) == 1 &&
                k.shape(0) == q.shape(0) && v.shape(0) == q.shape(0) && k.shape(1) == v.shape(1) &&
                q.shape(1) % k.shape(1) == 0 && k.shape(2) == v.shape(2) && k.shape(3) == q.shape(3);
  if (!shapes || q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32) {
    throw std::invalid_argument("decode_attention: needs float32 q (B, H, 1, D), k and v (B, Hkv, L, D)");
  }
  auto s = cpu_stream();
  std::vector<mx::array> inputs{q, k, v};
  // The kernel reads each key and value row densely.
  for (size_t i = 1; i < 3; ++i) {
    if (inputs[i].strides()[3] != 1) inputs[i] = mx::contiguous(inputs[i], false, s);
  }
  if (mask) {
    const auto& m = *mask;
    if (m.dtype() != mx::bool_ || m.ndim() != 4 || m.shape(1) != 1 || m.shape(2) != 1 ||
        (m.shape(0) != 1 && m.shape(0) != q.shape(0)) || m.shape(3) != k.shape(2)) {
      throw std::invalid_argument("decode_attention: the mask must be bool (B or 1, 1, 1, L)");
    }
    inputs.push_back(m);
  }
  mx::Shape shape{q.shape(0), q.shape(1), 1, v.shape(3)};
  return mx::array(shape, mx::float32,
                   std::make_shared<DecodeAttention>(s, scale, mask.has_value()), inputs);
}

mx::array quantized_decode_attention(const mx::array& q, const mx::array& k_words,
                                     const mx::array& k_scales, const mx::array& k_biases,
                                     const mx::array& v_words, const mx::array& v_scales,
                                     const mx::array& v_biases, std::optional<mx::array> mask,
                                     float scale, int group_size, int bits) {
  std::vector<mx::array> inputs{q, k_words, k_scales, k_biases, v_words, v_scales, v_biases};
  bool shapes = q.ndim() == 4 && q.shape(2) == 1 && q.dtype() == mx::float32 &&
                (bits == 4 || bits == 8) && group_size > 0 && group_size % 2 == 0 && group_size <= 256 &&
                q.shape(3) % group_size == 0;
  for (size_t i = 1; shapes && i < inputs.size(); ++i) {
    const auto& a = inputs[i];
    bool words = i % 3 == 1;
    int64_t last = words ? q.shape(3) * bits / 32 : q.shape(3) / group_size;
    shapes = a.ndim() == 4 && a.shape(0) == q.shape(0) && a.shape(1) == k_words.shape(1) &&
             a.shape(2) == k_words.shape(2) && a.shape(3) == last &&
             a.dtype() == (words ? mx::uint32 : mx::float32);
  }
  if (!shapes || q.shape(1) % k_words.shape(1) != 0) {
    throw std::invalid_argument(
        "quantized_decode_attention: needs float32 q (B, H, 1, D), and for keys and values "
        "uint32 words (B, Hkv, L, D * bits / 32) with float32 scales and biases "
        "(B, Hkv, L, D / group_size); bits 4 or 8, an even group_size up to 256");
  }
  auto s = cpu_stream();
  // The kernel reads each row's words, scales and biases densely.
  for (size_t i = 1; i < inputs.size(); ++i) {
    if (inputs[i].strides()[3] != 1) inputs[i] = mx::contiguous(inputs[i], false, s);
  }
  if (mask) {
    const auto& m = *mask;
    if (m.dtype() != mx::bool_ || m.ndim() != 4 || m.shape(1) != 1 || m.shape(2) != 1 ||
        (m.shape(0) != 1 && m.shape(0) != q.shape(0)) || m.shape(3) != k_words.shape(2)) {
      throw std::invalid_argument("quantized_decode_attention: the mask must be bool (B or 1, 1, 1, L)");
    }
    inputs.push_back(m);
  }
  return mx::array(q.shape(), mx::float32,
                   std::make_shared<QuantizedDecodeAttention>(s, scale, group_size, bits,
                                                              mask.has_value()),
                   inputs);
}

mx::array tiled_decode_attention(const mx::array& q, const std::vector<mx::array>& tiles,
                                 const mx::array& window_keys, const std::vector<mx::array>& window_values,
                                 const mx::array& mask, float scale, int group_size, int bits) {
  bool shapes = q.ndim() == 4 && q.shape(2) == 1 && q.dtype() == mx::float32 && tiles.size() == 6 &&
                window_values.size() == 3 && (bits == 4 || bits == 8) && group_size >= 32 &&
                group_size <= 256 && q.shape(3) % group_size == 0 && window_keys.ndim() == 4 &&
                window_keys.dtype() == mx::float32 && window_keys.shape(0) == q.shape(0) &&
                window_keys.shape(3) == q.shape(3) && q.shape(1) % window_keys.shape(1) == 0;
  std::vector<mx::array> inputs{q};
  for (const auto& a : tiles) inputs.push_back(a);
  inputs.push_back(window_keys);
  for (const auto& a : window_values) inputs.push_back(a);
  for (size_t i = 1; shapes && i < 11; ++i) {
    if (i == 7) continue;
    const auto& a = inputs[i];
    bool words = i == 1 || i == 4 || i == 8;
    int64_t last = words ? q.shape(3) * bits / 32 : q.shape(3) / group_size;
    shapes = a.ndim() == 4 && a.shape(0) == q.shape(0) && a.shape(1) == window_keys.shape(1) &&
             a.shape(2) == (i < 7 ? tiles[0].shape(2) : window_keys.shape(2)) && a.shape(3) == last &&
             a.dtype() == (words ? mx::uint32 : mx::float32);
  }
  shapes = shapes && tiles[0].shape(2) % group_size == 0;
  if (!shapes) {
    throw std::invalid_argument(
        "tiled_decode_attention: needs float32 q (B, H, 1, D); tiles of keys and values as "
        "uint32 words (B, Hkv, T, D * bits / 32) with float32 scales and biases "
        "(B, Hkv, T, D / group_size), T whole tiles; window keys float32 (B, Hkv, W, D) and "
        "window values quantized like the tiles'");
  }
  auto s = cpu_stream();
  // The kernel reads a tile's words, scales and biases as one dense block.
  for (size_t i = 1; i < inputs.size(); ++i) {
    const auto& a = inputs[i];
    if (a.strides()[3] != 1 || (i < 7 && a.strides()[2] != a.shape(3))) inputs[i] = mx::contiguous(a, false, s);
  }
  if (mask.dtype() != mx::bool_ || mask.ndim() != 4 || mask.shape(1) != 1 || mask.shape(2) != 1 ||
      (mask.shape(0) != 1 && mask.shape(0) != q.shape(0)) ||
      mask.shape(3) != tiles[0].shape(2) + window_keys.shape(2)) {
    throw std::invalid_argument("tiled_decode_attention: the mask must be bool (B or 1, 1, 1, T + W)");
  }
  inputs.push_back(mask);
  return mx::array(q.shape(), mx::float32,
                   std::make_shared<TiledDecodeAttention>(s, scale, group_size, bits), inputs);
}

mx::array gelu(const mx::array& x) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("gelu: needs a float32 array");
  auto s = cpu_stream();
  return mx::array(x.shape(), mx::float32, std::make_shared<Gelu>(s),
                   {mx::contiguous(x, false, s)});
}

mx::array layer_norm(const mx::array& x, std::optional<mx::array> residual, const mx::array& weight,
                     const mx::array& bias, float eps) {
  bool fits = x.dtype() == mx::float32 && x.ndim() >= 1 && weight.dtype() == mx::float32 &&
              bias.dtype() == mx::float32 && weight.ndim() == 1 && bias.ndim() == 1 &&
              weight.shape(0) == x.shape().back() && bias.shape(0) == x.shape().back() &&
              (!residual || (residual->dtype() == mx::float32 && residual->shape() == x.shape()));
  if (!fits) {
    throw std::invalid_argument("layer_norm: needs float32 x (and a residual of its shape), a "
                                "float32 weight and bias of x's last axis");
  }
  auto s = cpu_stream();
  std::vector<mx::array> inputs{mx::contiguous(x, false, s), mx::contiguous(weight, false, s),
                                mx::contiguous(bias, false, s)};
  if (residual) inputs.push_back(mx::contiguous(*residual, false, s));
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<LayerNorm>(s, eps, residual.has_value()), inputs);
}

mx::array packed_attention(const mx::array& qkv, const mx::array& offsets, int heads, float scale) {
  bool fits = qkv.dtype() == mx::float32 && qkv.ndim() >= 2 && heads > 0 &&
              qkv.shape().back() % (3 * heads) == 0 && offsets.ndim() == 1 &&
              offsets.shape(0) >= 1 && offsets.dtype() == mx::int32;
  if (!fits) {
    throw std::invalid_argument("packed_attention: needs float32 qkv (..., tokens, 3 x heads x "
                                "head_dim) and int32 offsets (sequences + 1,)");
  }
  auto s = cpu_stream();
  auto shape = qkv.shape();
  shape.back() /= 3;
  return mx::array(shape, mx::float32, std::make_shared<PackedAttention>(s, heads, scale),
                   {mx::contiguous(qkv, false, s), mx::contiguous(offsets, false, s)});
}

std::vector<mx::array> packed_matmul_split(const mx::array& x, const mx::array& packed, int bits,
                                           std::vector<int64_t> splits) {
  bool fits = x.dtype() == mx::float32 && packed.dtype() == mx::float32 && x.ndim() >= 1 &&
              packed.ndim() == 3 && x.shape().back() == packed.shape(1) &&
              (packed.shape(2) == 48 || packed.shape(2) == 32 || packed.shape(2) == 16);
  if (!fits) {
    throw std::invalid_argument("packed_matmul: needs float32 x (..., K) and float32 panels "
                                "(N / W, K, W), W 48, 32 or 16");
  }
  if ((bits != 512 && bits != 256) || bits > packed_matmul_bits()) {
    throw std::invalid_argument("packed_matmul: bits must be 512 or 256, at most "
                                "packed_matmul_bits() (what this CPU has)");
  }
  int64_t total = 0;
  for (int64_t panels : splits) {
    if (panels <= 0) throw std::invalid_argument("packed_matmul_split: every split needs a panel");
    total += panels;
  }
  if (splits.empty() || total != packed.shape(0)) {
    throw std::invalid_argument("packed_matmul_split: the splits must add up to the panels");
  }
  auto s = cpu_stream();
  auto primitive = std::make_shared<PackedMatmul>(s, bits, splits);
  // A sibling's own panels are a slice of the weights packed as one: dense, but mlx's
  // contiguous() copies a slice (1.3 MB for a 576 x 576 weight, every call).
  bool dense = packed.is_available() && packed.flags().row_contiguous;
  std::vector<mx::array> inputs = {x, dense ? packed : mx::contiguous(packed, false, s)};
  auto shapes = primitive->output_shapes(inputs);
  return mx::array::make_arrays(std::move(shapes),
                                std::vector<mx::Dtype>(shapes.size(), mx::float32), primitive,
                                inputs);
}

mx::array packed_matmul(const mx::array& x, const mx::array& packed, int bits) {
  if (packed.ndim() != 3) {
    throw std::invalid_argument("packed_matmul: needs float32 x (..., K) and float32 panels "
                                "(N / W, K, W), W 48, 32 or 16");
  }
  return packed_matmul_split(x, packed, bits, {static_cast<int64_t>(packed.shape(0))})[0];
}

}  // namespace

NB_MODULE(_omlx_cpu_kernels, m) {
  m.doc() = "float32 softmax, SwiGLU, RMS norm, RoPE, decode attention (over float32 or quantized KV), GELU, layer norm and packed attention primitives for mlx's CPU backend";
  m.def("packed_matmul", &packed_matmul, nb::arg("x"), nb::arg("packed"), nb::arg("bits"),
        "x w^T for a float32 weight w (N x K) packed as panels (N / W, K, W), W 48, 32 or 16: "
        "panel p, row k is w[W p : W p + W, k]; bits: the vector width (packed_matmul_bits()).");
  m.def("packed_matmul_split", &packed_matmul_split, nb::arg("x"), nb::arg("packed"),
        nb::arg("bits"), nb::arg("splits"),
        "packed_matmul's product as one output per split: output i is the product of the next "
        "splits[i] panels (sibling layers' weights packed as one).");
  m.def("packed_matmul_bits", &packed_matmul_bits,
        "The vector width packed_matmul runs at on this CPU: 512, 256, or 0 (it cannot).");
  m.def("softmax", &softmax, nb::arg("x"),
        "Softmax over the last axis of a float32 array (mlx CPU stream).");
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("x"), "silu(gate) * x, float32.");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"),
        "mlx.core.fast.rms_norm's arithmetic over the last axis, float32.");
  m.def("rope", &rope, nb::arg("x"), nb::arg("offset"), nb::arg("inv_freqs"), nb::arg("dims"),
        nb::arg("traditional"), nb::arg("scale"),
        "mlx.core.fast.rope's arithmetic on a float32 (B, H, T, D) array.");
  m.def("gelu", &gelu, nb::arg("x"),
        "0.5 x (1 + erf(x / sqrt 2)) of a float32 array (the exact GELU).");
  m.def("layer_norm", &layer_norm, nb::arg("x"), nb::arg("residual").none(), nb::arg("weight"),
        nb::arg("bias"), nb::arg("eps"),
        "layer_norm(x + residual) * weight + bias over the last axis, float32.");
  m.def("packed_attention", &packed_attention, nb::arg("qkv"), nb::arg("offsets"),
        nb::arg("heads"), nb::arg("scale"),
        "Bidirectional attention of sequences packed one after another in one (..., tokens, "
        "3 x hidden) projection, sequence s at tokens offsets[s]:offsets[s + 1]; "
        "(..., tokens, hidden).");
  m.def("decode_attention", &decode_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("mask").none(), nb::arg("scale"),
        "softmax(q k^T * scale) v for one query row per sequence and head, float32.");
  m.def("quantized_decode_attention", &quantized_decode_attention, nb::arg("q"),
        nb::arg("k_words"), nb::arg("k_scales"), nb::arg("k_biases"), nb::arg("v_words"),
        nb::arg("v_scales"), nb::arg("v_biases"), nb::arg("mask").none(), nb::arg("scale"),
        nb::arg("group_size"), nb::arg("bits"),
        "decode_attention over mlx-quantized keys and values (affine, 4 or 8 bits), read a "
        "row at a time.");
  m.def("tiled_decode_attention", &tiled_decode_attention, nb::arg("q"), nb::arg("tiles"),
        nb::arg("window_keys"), nb::arg("window_values"), nb::arg("mask"), nb::arg("scale"),
        nb::arg("group_size"), nb::arg("bits"),
        "decode_attention over a decode lane's tiled KV: keys per channel in tiles, then a "
        "window of float keys; values quantized per row.");
}
