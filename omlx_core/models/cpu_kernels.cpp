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
// Each is a node of the graph: nothing is evaluated mid-forward, so a decode step keeps
// mlx's pipelining; softmax and SwiGLU write into their input's buffer where mlx lets
// them (as mlx's own softmax does), so the memory a forward needs is unchanged.
// Built and loaded by omlx_core/models/cpu_kernels.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

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
    encoder.dispatch([xp = x.data<float>(), op = offset.data<int32_t>(),
                      fp = inv_freqs.data<float>(), y = out.data<float>(), batch, heads, steps,
                      width, offsets = static_cast<int64_t>(offset.size()),
                      xs = std::vector<int64_t>(x.strides().begin(), x.strides().end()),
                      dims = dims_, traditional = traditional_, scale = scale_]() {
      int half = dims / 2;
      std::vector<float> cosines(half), sines(half);
      for (int64_t b = 0; b < batch; ++b) {
        float shift = static_cast<float>(op[offsets == 1 ? 0 : b]);
        for (int64_t t = 0; t < steps; ++t) {
          float position = (static_cast<float>(t) + shift) * scale;
          for (int i = 0; i < half; ++i) {
            mx::simd::Simd<float, 1> theta(position * fp[i]);
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

OMLX_CLONES float dot(const float* a, const float* b, int64_t n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) s[k] += a[i + k] * b[i + k];
  float out = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) out += a[i] * b[i];
  return out;
}

OMLX_CLONES void add_scaled(float* y, const float* x, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

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
};

// One query row per (sequence, head): softmax(q k^T * scale, masked) v, reading the
// keys and values through ``Rows``. The mask, when there is one, is a bool (batch or 1,
// 1, 1, keys) array (a decode lane's left padding).
template <typename Rows>
void decode_attention_rows(const float* qp, const std::vector<int64_t>& qs, const Rows& kr,
                           const Rows& vr, const bool* mp, const std::vector<int64_t>& ms,
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
    const float hidden = -std::numeric_limits<float>::max();
    for (int64_t l = 0; l < keys; ++l) {
      bool shown = mp == nullptr || mp[b * ms[0] + l * ms[3]];
      if (!shown) {
        for (int64_t r = 0; r < repeats; ++r) scores[r * keys + l] = hidden;
        continue;
      }
      const float* key = kr.row(b, g, l, buffer.data());
      for (int64_t r = 0; r < repeats; ++r)
        scores[r * keys + l] = dot(query.data() + r * width, key, width);
    }
    float* yg = y + (b * heads + g * repeats) * width;
    std::fill(yg, yg + repeats * width, 0.0f);
    for (int64_t r = 0; r < repeats; ++r) {
      float* sr = scores.data() + r * keys;
      float m = row_max(sr, keys);
      exp_shifted(sr, sr, keys, m);
      scale_row(sr, keys, 1.0f / row_sum(sr, keys));
    }
    for (int64_t l = 0; l < keys; ++l) {
      if (mp != nullptr && !mp[b * ms[0] + l * ms[3]]) continue;  // its weight is exactly 0
      const float* value = vr.row(b, g, l, buffer.data());
      for (int64_t r = 0; r < repeats; ++r)
        add_scaled(yg + r * width, value, scores[r * keys + l], width);
    }
  };
  int64_t groups = batch * kv_heads;
  auto run = [&](int64_t first, int64_t last) {
    std::vector<float> query(repeats * width), scores(repeats * keys), buffer(width);
    for (int64_t i = first; i < last; ++i)
      one_group(i / kv_heads, i % kv_heads, query, scores, buffer);
  };
  // Two halves on two threads once there is enough work to pay for a thread.
  if (groups >= 2 && groups * repeats * keys * width >= (1 << 18)) {
    std::thread other(run, groups / 2, groups);
    run(0, groups / 2);
    other.join();
  } else {
    run(0, groups);
  }
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

// The same over an mlx-quantized KV cache: inputs q, the keys' words, scales and
// biases, the values' words, scales and biases, then the mask if any. No layer's keys
// and values are expanded whole: one row at a time, into a buffer the size of a row.
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
    auto rows = [&](size_t first) {
      auto word_strides = strides_of(inputs[first]);
      for (auto& stride : word_strides) stride *= 4;  // uint32 words, read as bytes
      return QuantizedRows{reinterpret_cast<const uint8_t*>(inputs[first].data<uint32_t>()),
                           word_strides, inputs[first + 1].data<float>(),
                           strides_of(inputs[first + 1]), inputs[first + 2].data<float>(),
                           strides_of(inputs[first + 2]), width, group_, bits_};
    };
    auto [mp, ms] = masked_ ? mask_of(inputs[7]) : std::pair<const bool*, std::vector<int64_t>>{};
    encoder.dispatch([qp = q.data<float>(), qs = strides_of(q), kr = rows(1), vr = rows(4), mp,
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
                   {x, mx::contiguous(offset, false, s), mx::contiguous(inv_freqs, false, s)});
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

}  // namespace

NB_MODULE(_omlx_cpu_kernels, m) {
  m.doc() = "float32 softmax, SwiGLU, RMS norm, RoPE and decode attention (over float32 or quantized KV) primitives for mlx's CPU backend";
  m.def("softmax", &softmax, nb::arg("x"),
        "Softmax over the last axis of a float32 array (mlx CPU stream).");
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("x"), "silu(gate) * x, float32.");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"),
        "mlx.core.fast.rms_norm's arithmetic over the last axis, float32.");
  m.def("rope", &rope, nb::arg("x"), nb::arg("offset"), nb::arg("inv_freqs"), nb::arg("dims"),
        nb::arg("traditional"), nb::arg("scale"),
        "mlx.core.fast.rope's arithmetic on a float32 (B, H, T, D) array.");
  m.def("decode_attention", &decode_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("mask").none(), nb::arg("scale"),
        "softmax(q k^T * scale) v for one query row per sequence and head, float32.");
  m.def("quantized_decode_attention", &quantized_decode_attention, nb::arg("q"),
        nb::arg("k_words"), nb::arg("k_scales"), nb::arg("k_biases"), nb::arg("v_words"),
        nb::arg("v_scales"), nb::arg("v_biases"), nb::arg("mask").none(), nb::arg("scale"),
        nb::arg("group_size"), nb::arg("bits"),
        "decode_attention over mlx-quantized keys and values (affine, 4 or 8 bits), read a "
        "row at a time.");
}
