// y = x W^T for a few rows of x (a decoding step or a verification window) on the CPU, float32.
// Why, and how it is built and loaded: specd/models/rows.py.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// One vector of partial sums per (row, output), as wide as the machine's registers: 16 floats
// with AVX-512, else 8. A 16-float vector on an AVX2-only CPU is split by the compiler into
// pairs of registers and runs several times slower (docs/bench/kernels-avx2-epyc).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

// acc + x * w, rounded once where the CPU has a fused multiply-add, in every variant of the kernel
// alike: the compiler's own contraction (-ffp-contract) fused it in some row-block variants and
// not others, so it stays off and the fused instruction is asked for by name.
inline vec madd(vec x, vec w, vec acc) {
#if defined(__AVX512F__)
  return (vec)_mm512_fmadd_ps((__m512)x, (__m512)w, (__m512)acc);
#elif defined(__FMA__)
  return (vec)_mm256_fmadd_ps((__m256)x, (__m256)w, (__m256)acc);
#else
  return acc + x * w;
#endif
}

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float reduce(vec v) {  // a fixed tree, halving the vector: the same order for every output
  float a[kLanes];
  std::memcpy(a, &v, sizeof(a));
  for (int n = kLanes / 2; n >= 1; n /= 2) {
    for (int i = 0; i < n; ++i) a[i] += a[i + n];
  }
  return a[0];
}

// Rows of x a block of kOuts weight rows multiplies at a time: their kOuts partial sums each,
// the weight vectors and one input vector fit the registers (32 with AVX-512, 16 with AVX2).
// With 4 on an AVX2-only CPU the compiler re-read the input from memory in every multiply-add,
// and a window's products cost far more than a step's (docs/engine.md, "The few-row product").
#if defined(__AVX512F__)
constexpr int kRows = 4;
#else
constexpr int kRows = 3;
#endif

// RB rows of x against OUTS weight rows: each weight row is read once for all RB rows.
// Every (row, output) sum runs the same lanes in the same order whatever RB and OUTS are, so a
// row's result does not depend on how many rows came with it.
template <int RB, int OUTS>
inline void block(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  vec acc[RB][OUTS] = {};
  const int64_t body = K - K % kLanes;
  for (int64_t k = 0; k < body; k += kLanes) {
    vec wv[OUTS];
    for (int j = 0; j < OUTS; ++j) wv[j] = load(w + j * K + k);
    for (int j = 0; j < OUTS; ++j) __builtin_prefetch(w + (OUTS + j) * K + k);  // the next block's rows
    for (int r = 0; r < RB; ++r) {
      const vec xv = load(x + r * ldx + k);
      for (int j = 0; j < OUTS; ++j) acc[r][j] = madd(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int j = 0; j < OUTS; ++j) {
      float s = reduce(acc[r][j]);
      for (int64_t k = body; k < K; ++k) s += x[r * ldx + k] * w[j * K + k];
      y[r * ldy + j] = s;
    }
  }
}

// All rows of x against OUTS weight rows, RB rows at a time.
template <int OUTS>
void outputs(const float* x, int64_t M, const float* w, int64_t K, float* y, int64_t N) {
  constexpr int RB = OUTS >= 4 ? kRows : 8;
  int64_t m = 0;
  for (; m + RB <= M; m += RB) block<RB, OUTS>(x + m * K, K, w, K, y + m * N, N);
  for (; m + 2 <= M; m += 2) block<2, OUTS>(x + m * K, K, w, K, y + m * N, N);
  if (m < M) block<1, OUTS>(x + m * K, K, w, K, y + m * N, N);
}

constexpr int64_t kMaxRows = 48;  // beyond this many rows the tiled product is as fast (measured)
constexpr int kOuts = 4;  // weight rows a block reads together (measured best of 4 and 8)

// x against each weight in turn, their outputs side by side in one tensor [..., sum of N]: one
// parallel pass over every block of every weight (q/k/v, or gate/up). Each output is computed
// exactly as rows_linear computes it, so the result equals the concatenated separate products.
at::Tensor rows_linear_cat(const at::Tensor& x_in, at::TensorList ws_in) {
  TORCH_CHECK(!ws_in.empty(), "rows_linear: no weight");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "rows_linear: float32 only");
  std::vector<at::Tensor> ws;
  ws.reserve(ws_in.size());
  int64_t N = 0;
  for (const at::Tensor& w : ws_in) {
    TORCH_CHECK(w.scalar_type() == at::kFloat, "rows_linear: float32 only");
    TORCH_CHECK(w.dim() == 2 && x_in.size(-1) == w.size(1), "rows_linear: shapes do not match");
    ws.push_back(w.contiguous());
    N += w.size(0);
  }
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(-1), M = x.numel() / K;
  if (M > kMaxRows) {  // a large batch: a tiled product does better
    std::vector<at::Tensor> outs;
    for (const at::Tensor& w : ws) outs.push_back(at::matmul(x, w.t()));
    return outs.size() == 1 ? outs[0] : at::cat(outs, -1);
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  const float* xp = x.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  struct Part { const float* w; int64_t n, col, first; };  // weight, its rows, its first output, block
  std::vector<Part> parts;
  int64_t blocks = 0, col = 0;
  for (const at::Tensor& w : ws) {
    parts.push_back({w.const_data_ptr<float>(), w.size(0), col, blocks});
    blocks += (w.size(0) + kOuts - 1) / kOuts;
    col += w.size(0);
  }
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    size_t p = 0;
    for (int64_t b = begin; b < end; ++b) {
      while (p + 1 < parts.size() && parts[p + 1].first <= b) ++p;
      const Part& part = parts[p];
      const int64_t n = (b - part.first) * kOuts;
      const int64_t outs = std::min<int64_t>(kOuts, part.n - n);
      const float* wp = part.w + n * K;
      float* out = yp + part.col + n;
      if (outs == kOuts) {
        outputs<kOuts>(xp, M, wp, K, out, N);
      } else {
        for (int64_t j = 0; j < outs; ++j) outputs<1>(xp, M, wp + j * K, K, out + j, N);
      }
    }
  });
  return y;
}

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& w) { return rows_linear_cat(x, {w}); }

int64_t rows_lanes() { return kLanes; }

}  // namespace

TORCH_LIBRARY(specd, m) {
  m.def("rows_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("rows_linear_cat(Tensor x, Tensor[] weights) -> Tensor");
  m.def("rows_lanes() -> int", &rows_lanes);  // the floats of one vector, as built here
}

TORCH_LIBRARY_IMPL(specd, CPU, m) {
  m.impl("rows_linear", &rows_linear);
  m.impl("rows_linear_cat", &rows_linear_cat);
}
