// y = x W^T for a few rows of x (a decoding step or a verification window) on the CPU, float32,
// and those rows' attention over the KV pool. Why, and how it is built and loaded:
// specd/runtime/rows.py.
#include <torch/library.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__FMA__) || defined(__AVX2__)
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

#if defined(__AVX2__)
// A vector's eight-lane half sums: lane j plus lane j + 8 with AVX-512, else the vector itself.
inline __m256 halves(vec v) {
#if defined(__AVX512F__)
  const __m512 w = (__m512)v;
  return _mm256_add_ps(_mm512_castps512_ps256(w), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1)));
#else
  return (__m256)v;
#endif
}

// reduce of four vectors at once, by the same tree, so the same bits: halves added (16 lanes,
// then 8), then, lanes ordered 0 2 1 3, two horizontal adds give (0 + 2) + (1 + 3). The scalar
// tree went through memory, a stored sum reloaded for every add (docs/engine.md).
inline __m128 reduce4(const vec v[4]) {
  __m128 q[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 h = halves(v[i]);
    q[i] = _mm_permute_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), 0xD8);  // 0 2 1 3
  }
  return _mm_hadd_ps(_mm_hadd_ps(q[0], q[1]), _mm_hadd_ps(q[2], q[3]));
}

typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));

// Lane i: the sum of v[i]'s lanes. Eight lanes: ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)) for
// every i; sixteen (AVX-512): each lane j of the low half plus lane j + 8 first, then that tree.
inline vec8 sum_each(const vec v[8]) {
  __m256 h[8];
  for (int u = 0; u < 8; ++u) h[u] = halves(v[u]);
  const __m256 a = _mm256_hadd_ps(h[0], h[1]), b = _mm256_hadd_ps(h[2], h[3]);
  const __m256 c = _mm256_hadd_ps(h[4], h[5]), d = _mm256_hadd_ps(h[6], h[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // per half: lanes 0-3, then 4-7
  return (vec8)_mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}
#endif

// exp of every lane (Cephes' single-precision method: 2^n times a polynomial of the remainder,
// within about 2 float ulps), lane by lane the same operations, so a score's exp does not depend
// on the lanes beside it. For x <= 0 (softmax scores less their maximum).
typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vec exp_lanes(vec x) {
  x = x < -87.0f ? vec{} - 87.0f : x;
  vec fx = x * 1.44269504088896341f + 0.5f;
  ivec n = __builtin_convertvector(fx, ivec);  // truncated; then floor
  vec whole = __builtin_convertvector(n, vec);
  const ivec below = whole > fx;
  n += below;  // a true comparison is -1
  whole = __builtin_convertvector(n, vec);
  x = x - whole * 0.693359375f;
  x = x - whole * -2.12194440e-4f;
  const vec z = x * x;
  vec y = vec{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const ivec bits = (n + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// Rows of x a block of kOuts weight rows multiplies at a time: their kOuts partial sums each,
// the weight vectors and one input vector fit the registers (32 with AVX-512: 24 sums, 4 weights;
// 16 with AVX2: 12 and 4). With 4 on an AVX2-only CPU the compiler re-read the input from memory
// in every multiply-add, and a window's products cost far more than a step's (docs/engine.md,
// "The few-row product"). The rows left over go in one pass of their own count.
#if defined(__AVX512F__)
constexpr int kRows = 6;
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
    for (int j = 0; j < OUTS; ++j) __builtin_prefetch(w + (OUTS + j) * K + k, 0, 2);  // the next block's rows, to L2
    for (int r = 0; r < RB; ++r) {
      const vec xv = load(x + r * ldx + k);
      for (int j = 0; j < OUTS; ++j) acc[r][j] = madd(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    float sums[OUTS];
#if defined(__AVX2__)
    if constexpr (OUTS == 4) {
      _mm_storeu_ps(sums, reduce4(acc[r]));
    } else
#endif
    {
      for (int j = 0; j < OUTS; ++j) sums[j] = reduce(acc[r][j]);
    }
    for (int j = 0; j < OUTS; ++j) {
      float s = sums[j];
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
  switch (M - m) {  // the rest in one pass
    case 7: block<7, OUTS>(x + m * K, K, w, K, y + m * N, N); break;
    case 6: block<6, OUTS>(x + m * K, K, w, K, y + m * N, N); break;
    case 5: block<5, OUTS>(x + m * K, K, w, K, y + m * N, N); break;
    case 4: block<4, OUTS>(x + m * K, K, w, K, y + m * N, N); break;
    case 3: block<3, OUTS>(x + m * K, K, w, K, y + m * N, N); break;
    case 2: block<2, OUTS>(x + m * K, K, w, K, y + m * N, N); break;
    case 1: block<1, OUTS>(x + m * K, K, w, K, y + m * N, N); break;
  }
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

// Attention of a few query rows over the KV pool, reading each row's keys and values where they
// lie (no gathered copy) and only the keys each query sees: out[b, h, t] = softmax(scale *
// q[b, h, t] . K[slot b, h / groups, 0..qpos[b, t]]) . V[same]. Every query is computed alone,
// in the same order whatever the batch, so a window's rows equal the decoding steps' bit for bit.
// q [B, H, T, D]; k, v [slots, KV heads, columns, D] (the pool); slots [B]; qpos [B, T].
at::Tensor rows_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& slots_in, const at::Tensor& qpos_in, double scale) {
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "rows_attention: float32 only");
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(),
              "rows_attention: q [B, H, T, D], k and v [slots, heads, columns, D]");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.size(3) == q_in.size(3) && q_in.size(1) % k.size(1) == 0,
              "rows_attention: shapes do not match");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous(), qpos = qpos_in.to(at::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  TORCH_CHECK(slots.numel() == B && qpos.numel() == B * T, "rows_attention: slots [B] and qpos [B, T]");
  const int64_t groups = H / k.size(1), columns = k.size(2);
  const int64_t k_slot = k.stride(0), k_head = k.stride(1), k_col = k.stride(2);
  const int64_t v_slot = v.stride(0), v_head = v.stride(1), v_col = v.stride(2);
  at::Tensor out = at::empty_like(q);
  const float* qp = q.const_data_ptr<float>();
  const float* kp = k.const_data_ptr<float>();
  const float* vp = v.const_data_ptr<float>();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t* pp = qpos.const_data_ptr<int64_t>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t body = D - D % kLanes, chunks = body / kLanes;
  const float fscale = static_cast<float>(scale);
  // An item: one row's KV head and up to kBlock of its positions, all the query heads that share
  // that KV head: each key and value read once for all of them.
  constexpr int64_t kBlock = 4;
  const int64_t blocks = (T + kBlock - 1) / kBlock, kv_heads = k.size(1);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, groups * kBlock * columns * D));
  at::parallel_for(0, B * kv_heads * blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, totals;
    std::vector<int64_t> seen, index;
    std::vector<vec> acc;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (kv_heads * blocks), kvh = (item / blocks) % kv_heads, t0 = (item % blocks) * kBlock;
      const int64_t t1 = std::min(T, t0 + kBlock);
      seen.clear();
      index.clear();
      int64_t most = 0;
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t t = t0; t < t1; ++t) {
          index.push_back((b * H + kvh * groups + g) * T + t);  // the query's row in q and out
          seen.push_back(std::min<int64_t>(pp[b * T + t], columns - 1) + 1);  // it sees keys 0..qpos
          most = std::max(most, seen.back());
        }
      }
      const int64_t nq = static_cast<int64_t>(index.size());
      const float* keys = kp + sp[b] * k_slot + kvh * k_head;
      const float* values = vp + sp[b] * v_slot + kvh * v_head;
      const int64_t stride = (most + kLanes - 1) / kLanes * kLanes;  // whole vectors per query
      scores.assign(nq * stride, 0.f);
#if defined(__AVX2__)
      // Eight keys at a time: their eight vectors of partial sums reduced together into one
      // vector of eight scores, each by the same tree. Keys past the pool's last column are read
      // as that column (their scores, like any past a query's position, are never used).
      for (int64_t s0 = 0; s0 < most; s0 += 8) {
        const float* key[8];
        for (int u = 0; u < 8; ++u) key[u] = keys + std::min(s0 + u, columns - 1) * k_col;
        for (int u = 0; u < 8; ++u) {  // the keys two groups ahead, their cache lines
          const float* ahead = keys + std::min(s0 + 16 + u, most - 1) * k_col;
          for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(ahead + d);
        }
        for (int64_t j = 0; j < nq; ++j) {
          if (s0 >= seen[j]) continue;
          const float* qv = qp + index[j] * D;
          vec sums[8] = {};
          for (int64_t d = 0; d < body; d += kLanes) {
            const vec x = load(qv + d);
            for (int u = 0; u < 8; ++u) sums[u] = madd(x, load(key[u] + d), sums[u]);
          }
          vec8 dots = sum_each(sums);
          for (int64_t d = body; d < D; ++d) {
            for (int u = 0; u < 8; ++u) dots[u] += qv[d] * key[u][d];
          }
          const vec8 scaled = dots * fscale;
          std::memcpy(scores.data() + j * stride + s0, &scaled, sizeof(scaled));
        }
      }
#else
      for (int64_t s = 0; s < most; ++s) {
        const float* key = keys + s * k_col;
        for (int64_t j = 0; j < nq; ++j) {
          if (s >= seen[j]) continue;
          const float* qv = qp + index[j] * D;
          vec sum = {};
          for (int64_t d = 0; d < body; d += kLanes) sum = madd(load(qv + d), load(key + d), sum);
          float dot = reduce(sum);
          for (int64_t d = body; d < D; ++d) dot += qv[d] * key[d];
          scores[j * stride + s] = dot * fscale;
        }
      }
#endif
      totals.assign(nq, 0.f);
      for (int64_t j = 0; j < nq; ++j) {
        // The maximum and the sum a vector at a time, not as chains of dependent scalar
        // operations: the sum lane by lane, then reduce's tree, then the last keys in order, so
        // it depends only on the query's own keys.
        float* row = scores.data() + j * stride;
        const int64_t n = seen[j], whole = n - n % kLanes;
        vec tops = vec{} - INFINITY;
        for (int64_t s = 0; s < whole; s += kLanes) {
          const vec r = load(row + s);
          tops = r > tops ? r : tops;
        }
        float top = -INFINITY;
        for (int l = 0; l < kLanes; ++l) top = std::max(top, tops[l]);
        for (int64_t s = whole; s < n; ++s) top = std::max(top, row[s]);
        for (int64_t s = 0; s < n; s += kLanes) {  // lanes past the query's keys are never read
          const vec e = exp_lanes(load(row + s) - top);
          std::memcpy(row + s, &e, sizeof(e));
        }
        vec sum = {};
        for (int64_t s = 0; s < whole; s += kLanes) sum += load(row + s);
        totals[j] = reduce(sum);
        for (int64_t s = whole; s < n; ++s) totals[j] += row[s];
        float* o = op + index[j] * D;
        for (int64_t d = body; d < D; ++d) o[d] = 0.f;
      }
      acc.assign(nq * chunks, vec{});
      for (int64_t s = 0; s < most; ++s) {
        const float* value = values + s * v_col;
        const float* ahead = values + std::min(s + 8, most - 1) * v_col;  // a value 8 keys ahead
        for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(ahead + d);
        for (int64_t j = 0; j < nq; ++j) {
          if (s >= seen[j]) continue;
          const float w = scores[j * stride + s];
          const vec wv = vec{} + w;
          for (int64_t c = 0; c < chunks; ++c) acc[j * chunks + c] = madd(wv, load(value + c * kLanes), acc[j * chunks + c]);
          float* o = op + index[j] * D;
          for (int64_t d = body; d < D; ++d) o[d] += w * value[d];
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        float* o = op + index[j] * D;
        const float inv = 1.f / totals[j];
        for (int64_t c = 0; c < chunks; ++c) {
          const vec r = acc[j * chunks + c] * inv;
          std::memcpy(o + c * kLanes, &r, sizeof(r));
        }
        for (int64_t d = body; d < D; ++d) o[d] *= inv;
      }
    }
  });
  return out;
}

int64_t rows_lanes() { return kLanes; }

}  // namespace

// The compiled forward (AOTInductor) calls these C functions directly, as it calls torch's own
// operators, rather than through its proxy executor (boxed arguments, a lookup by name, for each
// of a step's 150 calls). rows.c_shims declares them to the compiler; rows.load makes them visible
// to the library that calls them.
extern "C" {
using torch::aot_inductor::new_tensor_handle;
using torch::aot_inductor::tensor_handle_to_tensor_pointer;

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_rows_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                            AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(rows_linear(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(weight)));
  });
}

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_rows_linear_cat(AtenTensorHandle x, const AtenTensorHandle* weights,
                                                                int64_t weights_len_, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    std::vector<at::Tensor> ws;
    ws.reserve(weights_len_);
    for (int64_t i = 0; i < weights_len_; ++i) ws.push_back(*tensor_handle_to_tensor_pointer(weights[i]));
    *ret0 = new_tensor_handle(rows_linear_cat(*tensor_handle_to_tensor_pointer(x), ws));
  });
}

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_rows_attention(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                               AtenTensorHandle slots, AtenTensorHandle qpos,
                                                               double scale, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(rows_attention(*tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k),
                                             *tensor_handle_to_tensor_pointer(v), *tensor_handle_to_tensor_pointer(slots),
                                             *tensor_handle_to_tensor_pointer(qpos), scale));
  });
}
}

TORCH_LIBRARY(specd, m) {
  m.def("rows_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("rows_linear_cat(Tensor x, Tensor[] weights) -> Tensor");
  m.def("rows_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor qpos, float scale) -> Tensor");
  m.def("rows_lanes() -> int", &rows_lanes);  // the floats of one vector, as built here
}

TORCH_LIBRARY_IMPL(specd, CPU, m) {
  m.impl("rows_linear", &rows_linear);
  m.impl("rows_linear_cat", &rows_linear_cat);
  m.impl("rows_attention", &rows_attention);
}
