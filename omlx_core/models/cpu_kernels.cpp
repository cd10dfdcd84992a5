// Vectorized exponentials for mlx's CPU backend, as two mlx primitives.
//
// mlx's CPU elementwise kernels are scalar off Apple silicon (its simd width is 1), so
// every exp in an attention softmax or an MLP's SiLU costs ~12-17 ns. These primitives
// do the same float32 arithmetic (softmax: exp(x - max) * (1 / sum); SwiGLU:
// gate * (1 / (1 + exp(-gate))) * x) with a polynomial exp the compiler vectorizes,
// as nodes of the graph: nothing is evaluated mid-forward, so a decode step keeps
// mlx's pipelining, and each writes its output into its input's buffer where mlx lets
// it (as mlx's own softmax does), so the memory a forward needs is unchanged.
// Built and loaded by omlx_core/models/cpu_kernels.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include <nanobind/nanobind.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
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

}  // namespace

NB_MODULE(_omlx_cpu_kernels, m) {
  m.doc() = "Vectorized float32 softmax and SwiGLU primitives for mlx's CPU backend";
  m.def("softmax", &softmax, nb::arg("x"),
        "Softmax over the last axis of a float32 array (mlx CPU stream).");
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("x"), "silu(gate) * x, float32.");
}
