/* RoPE of a step's q and k, and the k and v written into their cache slots, in one pass (CPU, float32).
 *
 * The torch ops take five passes over q and k (two products, a swap of halves, a sum, a copy) and an indexed
 * write per K and V; a 4096-token prefill spent 15 ms a layer there. The arithmetic is the torch reference's
 * (ops/rope.py), operation for operation: each half is x * cos and y * sin rounded, then added, with no fused
 * multiply-add (this file is compiled without contraction), so the bits are HF's and the torch ops'.
 *
 * Layout: q [T, Hq, D], k and v [T, Hk, D], each token's heads contiguous with `*_stride` floats from one token
 * to the next (slices of the fused qkv product); cos_sin [positions, D] holds cos then sin, D / 2 each; the cache
 * layer is [num_pages, 2, Hk, page_size, D] (ops/attention.py).
 */
#include <stdint.h>
#include <string.h>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* out = x rotated by the angle whose cos and sin halves are given: D / 2 pairs (x1[i], x2[i]). */
static inline void rotate(const float *x, const float *cos, const float *sin, int64_t half, float *out) {
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[half + i];
        out[i] = x1 * cos[i] - x2 * sin[i];
        out[half + i] = x2 * cos[i] + x1 * sin[i];
    }
}

void rs_rope_write_kv(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                      int64_t v_stride, const int64_t *positions, const float *cos_sin, const int64_t *slots,
                      float *kv, float *q_out, int64_t tokens, int64_t num_q_heads, int64_t num_kv_heads,
                      int64_t page_size, int64_t dim, int num_threads) {
    const int64_t half = dim / 2, tile = page_size * dim;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *cos = cos_sin + positions[t] * dim, *sin = cos + half;
        for (int64_t h = 0; h < num_q_heads; ++h)
            rotate(q + t * q_stride + h * dim, cos, sin, half, q_out + (t * num_q_heads + h) * dim);
        const int64_t page = slots[t] / page_size, offset = slots[t] % page_size;
        float *k_dst = kv + page * 2 * num_kv_heads * tile + offset * dim, *v_dst = k_dst + num_kv_heads * tile;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            rotate(k + t * k_stride + h * dim, cos, sin, half, k_dst + h * tile);
            memcpy(v_dst + h * tile, v + t * v_stride + h * dim, (size_t)dim * sizeof(float));
        }
    }
}
