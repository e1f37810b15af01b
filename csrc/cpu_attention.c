/* Paged attention for the CPU: float32, K/V read in place from the pages, each query token a row of its own.
 *
 * The torch reference (rollout_service/ops/attention.py) gathers every decode row's pages into one buffer, then
 * multiplies: on a CPU the gather is the larger half of decode attention's time, since the K/V it copies are
 * read from memory once per layer and step whatever we do. Here each (row, kv head) reads its pages in place and
 * keeps its scores in a per-thread buffer; keys past a row's length are never read (their slots may hold
 * anything, even NaN). A prompt's tokens are rows too, each with the keys up to its position (causal): a
 * prompt's pages stay in cache across its rows, and no K/V copy or repeat per GQA group is made.
 *
 * Plain C, no torch headers: it builds in a second with the system compiler (rollout_service/ops/cpu_ext.py)
 * and is called through ctypes. Threads: OpenMP, the same libgomp that torch loaded (soname libgomp.so.1).
 *
 * Layout (attention.py): the layer is [num_pages, 2, Hk, page_size, D], index 0 = K, 1 = V.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#define INLINE static inline __attribute__((always_inline)) /* so the dim == 64 call sees constants */

/* Ask for a tile's cache lines ahead of use, into L2 (measured on a 2-core EPYC: L1 as the target was slower). A
 * row's tiles are scattered 4 KB blocks, where the hardware prefetchers stop (they do not cross a 4 KB page):
 * without this the reads wait on memory latency, at about half the bandwidth. */
static inline void prefetch_tile(const float *tile, int64_t floats) {
#if defined(__GNUC__)
    for (int64_t i = 0; i < floats; i += 64 / sizeof(float)) __builtin_prefetch(tile + i, 0, 1);
#else
    (void)tile;
    (void)floats;
#endif
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
/* 16-float vectors (GCC/clang vector extensions: AVX-512 or pairs of AVX2 registers on x86, NEON quads on Arm).
 * The scalar loops below are the fallback (head dims that are not whole 16-float chunks, older compilers): plain
 * sums in key and dim order, several times slower. */
#define RS_VECTORS 1
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf16_unaligned __attribute__((vector_size(64), aligned(4)));
#define MAX_CHUNKS 16 /* head dims up to 256 */

INLINE vf16 load16(const float *p) { return *(const vf16_unaligned *)p; }
INLINE void store16(float *p, vf16 v) { *(vf16_unaligned *)p = v; }

#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)

/* sums[j] = the sum of a[j]'s 16 lanes: a butterfly of 15 shuffle-and-add steps for all 16 vectors, where summing
 * each vector alone would take 16 dependent steps. After it the lanes hold the keys in bit-reversed order. */
static inline vf16 sum_lanes(const vf16 a[16]) {
    vf16 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i) /* lanes 0-7: partial sums of a[2i], 8-15: of a[2i+1] */
        b[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        c[i] = SHUFFLE(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               SHUFFLE(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        d[i] = SHUFFLE(c[2 * i], c[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               SHUFFLE(c[2 * i], c[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    vf16 e = SHUFFLE(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
             SHUFFLE(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    return SHUFFLE(e, e, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

/* The scores of 16 keys (rows[j] their K rows) for one query q (chunks vectors, scale folded in): dim % 16 == 0. */
INLINE vf16 scores16(const vf16 *q, const float *const rows[16], int64_t chunks) {
    vf16 dots[16];
    for (int j = 0; j < 16; ++j) {
        vf16 acc = q[0] * load16(rows[j]);
        for (int64_t c = 1; c < chunks; ++c) acc += q[c] * load16(rows[j] + c * 16);
        dots[j] = acc;
    }
    return sum_lanes(dots);
}
#endif

/* A row's sums run over blocks of BLOCK keys in key order, whatever the page size: so a row's bits depend on its
 * query and keys only, not on the pages they sit in, its batch or the thread that computes it (batch-invariant
 * mode relies on this: the learner lays its keys out in pages of its own, ops/invariant.py). */
#define BLOCK 16

/* One (row, kv head) to attend: the row's page ids and key count. */
typedef struct {
    const int32_t *pages;
    int64_t len, head;
} Span;

/* One layer of the cache and its shape. */
typedef struct {
    const float *kv;
    int64_t num_kv_heads, page_size, dim;
} Cache;

/* The K (which 0) or V (1) rows of keys first .. first + BLOCK - 1 of a span; keys past its length repeat its
 * last one (their scores are computed and never used). */
INLINE void block_rows(Cache c, Span s, int64_t first, int which, const float *rows[BLOCK]) {
    const int64_t tile = c.page_size * c.dim, page_floats = 2 * c.num_kv_heads * tile;
    const float *base = c.kv + (which * c.num_kv_heads + s.head) * tile;
    int64_t page = first / c.page_size, offset = first % c.page_size;
    for (int i = 0; i < BLOCK; ++i) {
        rows[i] = first + i < s.len ? base + (int64_t)s.pages[page] * page_floats + offset * c.dim : rows[i - 1];
        if (++offset == c.page_size) offset = 0, ++page;
    }
}

INLINE void prefetch_rows(const float *const rows[BLOCK], int64_t dim) {
    for (int i = 0; i < BLOCK; ++i)
        if (i == 0 || rows[i] != rows[i - 1]) prefetch_tile(rows[i], dim);
}

/* Whether the vector code applies: whole 16-float chunks of the head dim. */
static inline int vectors_apply(int64_t dim) {
#ifdef RS_VECTORS
    return dim % 16 == 0 && dim / 16 <= MAX_CHUNKS;
#else
    (void)dim;
    return 0;
#endif
}

/* scores[g * stride + j] = q[g] . k[j] * scale for the block's keys (all BLOCK written: stride leaves room). */
INLINE void block_scores(const float *q, const float *const rows[BLOCK], int64_t group, int64_t dim, int vectors,
                         float scale, float *scores, int64_t stride) {
#ifdef RS_VECTORS
    if (vectors) {
        const int64_t chunks = dim / 16;
        for (int64_t g = 0; g < group; ++g) {
            vf16 qv[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; ++c) qv[c] = load16(q + g * dim + c * 16) * scale;
            store16(scores + g * stride, scores16(qv, rows, chunks));
        }
        return;
    }
#endif
    (void)vectors;
    for (int64_t g = 0; g < group; ++g)
        for (int j = 0; j < BLOCK; ++j) {
            float dot = 0.0f; /* in order: the scalar code must not depend on alignment either */
            for (int64_t d = 0; d < dim; ++d) dot += q[g * dim + d] * scale * rows[j][d];
            scores[g * stride + j] = dot;
        }
}

/* out[g] += probs[g * stride + j] * v[j] over the block's first n keys. */
INLINE void block_values(const float *probs, const float *const rows[BLOCK], int64_t n, int64_t group, int64_t dim,
                         int vectors, int64_t stride, float *out) {
#ifdef RS_VECTORS
    if (vectors) {
        const int64_t chunks = dim / 16;
        for (int64_t g = 0; g < group; ++g) {
            /* even and odd keys in separate sums: twice the independent additions in flight */
            vf16 even[MAX_CHUNKS], odd[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; ++c) even[c] = load16(out + g * dim + c * 16), odd[c] = even[c] * 0.0f;
            int64_t j = 0;
            for (; j + 1 < n; j += 2) {
                const float p0 = probs[g * stride + j], p1 = probs[g * stride + j + 1];
                for (int64_t c = 0; c < chunks; ++c) {
                    even[c] += p0 * load16(rows[j] + c * 16);
                    odd[c] += p1 * load16(rows[j + 1] + c * 16);
                }
            }
            if (j < n)
                for (int64_t c = 0; c < chunks; ++c) even[c] += probs[g * stride + j] * load16(rows[j] + c * 16);
            for (int64_t c = 0; c < chunks; ++c) store16(out + g * dim + c * 16, even[c] + odd[c]);
        }
        return;
    }
#endif
    (void)vectors;
    for (int64_t j = 0; j < n; ++j)
        for (int64_t g = 0; g < group; ++g) {
            const float p = probs[g * stride + j];
            for (int64_t d = 0; d < dim; ++d) out[g * dim + d] += p * rows[j][d];
        }
}

/* softmax over each query's `len` scores, in place (rows `stride` apart). The sum runs in LANES lanes, then a
 * fixed tree: the same order for every row of a length. */
static inline void softmax_rows(float *scores, int64_t len, int64_t group, int64_t stride) {
    for (int64_t g = 0; g < group; ++g) {
        float *s = scores + g * stride;
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t j = 0; j < len; ++j) top = s[j] > top ? s[j] : top;
        float lanes[LANES] = {0};
        for (int64_t first = 0; first < len; first += LANES) {
            const int64_t n = len - first < LANES ? len - first : LANES;
            for (int64_t i = 0; i < n; ++i) {
                s[first + i] = exp_nonpositive(s[first + i] - top);
                lanes[i] += s[first + i];
            }
        }
        const float inv = 1.0f / lanes_total(lanes);
        for (int64_t j = 0; j < len; ++j) s[j] *= inv;
    }
}

#define PREFETCH_BLOCKS 2 /* how far ahead the K rows are asked for */

/* One (row, kv head): out[g, :] = softmax(scale * q[g] . K^T) V over the row's keys; scores holds group * stride
 * floats. */
INLINE void attend(const float *q, Cache cache, Span task, Span next, int64_t group, float scale, float *scores,
                   int64_t stride, float *out) {
    const int64_t dim = cache.dim, blocks = (task.len + BLOCK - 1) / BLOCK;
    const int64_t next_blocks = (next.len + BLOCK - 1) / BLOCK;
    const int vectors = vectors_apply(dim);
    const float *rows[BLOCK], *ahead[BLOCK];
    for (int64_t b = 0; b < blocks; ++b) {
        /* while this block computes: its V (read after the softmax), and the K a few blocks on (this row's or the
         * next task's) */
        block_rows(cache, task, b * BLOCK, 1, ahead);
        prefetch_rows(ahead, dim);
        if (b + PREFETCH_BLOCKS < blocks) {
            block_rows(cache, task, (b + PREFETCH_BLOCKS) * BLOCK, 0, ahead);
            prefetch_rows(ahead, dim);
        } else if (b + PREFETCH_BLOCKS - blocks < next_blocks) {
            block_rows(cache, next, (b + PREFETCH_BLOCKS - blocks) * BLOCK, 0, ahead);
            prefetch_rows(ahead, dim);
        }
        block_rows(cache, task, b * BLOCK, 0, rows);
        block_scores(q, rows, group, dim, vectors, scale, scores + b * BLOCK, stride);
    }
    softmax_rows(scores, task.len, group, stride);
    memset(out, 0, (size_t)(group * dim) * sizeof(float));
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n = task.len - b * BLOCK < BLOCK ? task.len - b * BLOCK : BLOCK;
        block_rows(cache, task, b * BLOCK, 1, rows);
        block_values(scores + b * BLOCK, rows, n, group, dim, vectors, stride, out);
    }
}

/* q, out [rows, Hq, D], one query token per row; kv one layer; tables [rows, table_stride] page ids; lens [rows]:
 * the keys each row's query attends (>= 1; a prompt's token at position p attends p + 1). Returns 0, or 1 if a
 * scores buffer could not be allocated (out is then incomplete). */
int rs_paged_attention(const float *q, const float *kv, const int32_t *tables, const int32_t *lens, float *out,
                       int64_t rows, int64_t num_q_heads, int64_t num_kv_heads, int64_t page_size, int64_t dim,
                       int64_t table_stride, float scale, int num_threads) {
    const int64_t group = num_q_heads / num_kv_heads;
    const Cache cache = {kv, num_kv_heads, page_size, dim};
    int64_t longest = 0;
    for (int64_t row = 0; row < rows; ++row) longest = lens[row] > longest ? lens[row] : longest;
    const int64_t most = (longest + BLOCK - 1) / BLOCK * BLOCK; /* BLOCK floats = 64 bytes: rows stay aligned */
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* one buffer per thread, for all its tasks */
        float *scores = aligned_alloc(64, (size_t)(group * (most > 0 ? most : BLOCK)) * sizeof(float));
        failed = scores == NULL;
        /* heads outer, rows inner: one thread takes a head's rows in order, so the rows of one prompt and the
         * samples that share it find its pages in its cache */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * num_kv_heads; ++task) {
            if (scores == NULL) continue;
            const int64_t head = task / rows, row = task % rows, len = lens[row];
            const int64_t qo = (row * num_q_heads + head * group) * dim, stride = (len + BLOCK - 1) / BLOCK * BLOCK;
            const Span this = {tables + row * table_stride, len, head};
            const Span next = task + 1 < rows * num_kv_heads
                ? (Span){tables + ((task + 1) % rows) * table_stride, lens[(task + 1) % rows], (task + 1) / rows}
                : (Span){this.pages, 0, head};
            if (dim == 64) /* a constant lets the compiler unroll the head dim (SmolLM2, Llama 3.2 1B) */
                attend(q + qo, (Cache){kv, num_kv_heads, page_size, 64}, this, next, group, scale, scores, stride,
                       out + qo);
            else
                attend(q + qo, cache, this, next, group, scale, scores, stride, out + qo);
        }
        free(scores);
    }
    return failed;
}
