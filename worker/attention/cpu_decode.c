/* Paged decode attention on CPU, over an fp32 or bf16 cache (fp32 arithmetic either way): each decoding sequence's one query row attends to its
 * keys and values where they sit in the paged KV cache (base.py's layout: [blocks, layers, 2,
 * block_size, kv_heads, head_dim]), reading each real key and value once - no gather into a
 * padded batch, no padding. Built and loaded by cpu_decode.py; plain C over raw pointers,
 * so it needs only a C compiler (no torch headers).
 *
 * Two passes per sequence: scores q.k for every cached position (kept in a scratch row per
 * query head), then softmax and p.v. The sequences run in parallel on the caller's OpenMP
 * threads (torch's own runtime: the library links libgomp.so.1 by soname, which torch has
 * already loaded).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_HEAD_DIM 256

/* One cache element as fp32: a bf16 is the upper half of the fp32 with the same value.
 * `bf16` is a constant at every call site (decode_one is inlined per cache type), so the
 * branch folds away and the loops over elements vectorise. */
static inline float load(const void *base, int64_t i, const int bf16) {
    if (!bf16) return ((const float *)base)[i];
    union { uint32_t u; float f; } x = {.u = (uint32_t)((const uint16_t *)base)[i] << 16};
    return x.f;
}

static inline float dot(const float *restrict q, const void *k, int64_t n, const int bf16) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += q[i] * load(k, i, bf16);
    return acc;
}

/* Prefetch one position's K (or V) row, all heads, in the sequence's next block: the blocks
 * of a sequence lie anywhere in the cache, and the hardware prefetcher loses the stream at
 * every block's end. Into L2 (locality 1, prefetcht2), not L1: an L1 prefetch holds one of
 * the core's few L1 miss buffers until its line arrives, which throttled the demand loads -
 * on this project's 2-core EPYC, one thread, the kernel read 8-11 GB/s of a cold cache with
 * L1 prefetches and 16.5-20.7 GB/s with L2 ones (`triptych bench attention`;
 * docs/benchmarks.md, 2026-12-06). */
static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(row + i, 0, 1);
}

/* One sequence: every query head against its cached keys and values, position by position
 * (each position's K or V row holds all heads, contiguous). Inlined with a constant
 * head_dim for the common sizes and a constant cache type, so the inner loops unroll into
 * whole vectors. Offsets into the cache are in elements. Each block's rows prefetch the
 * sequence's next block's; the last block's, the block at `next_first` (-1: none). */
static inline __attribute__((always_inline)) void decode_one(
    const float *qb, const void *cache, const int bf16, const int32_t *table, int64_t len,
    int64_t block_stride, int64_t v_offset, int64_t kv_heads, int64_t group, const int64_t head_dim,
    int64_t block_size, int64_t max_len, float scale, float *scores, float *ob, int64_t next_first) {
    const int64_t heads = kv_heads * group, esize = bf16 ? 2 : 4;
    const int64_t pos_stride = kv_heads * head_dim;
    const char *bytes = (const char *)cache;
    float top[heads], total[heads], acc[heads * head_dim];
    for (int64_t h = 0; h < heads; h++) top[h] = -FLT_MAX;
    /* Pass 1: q.k for every position and head. */
    for (int64_t pos = 0; pos < len; pos++) {
        const int64_t block = pos / block_size, offset = (pos % block_size) * pos_stride;
        const char *k = bytes + (table[block] * block_stride + offset) * esize;
        const int64_t next_block = pos + block_size < len ? table[block + 1] * block_stride : next_first;
        if (next_block >= 0) prefetch_row(bytes + (next_block + offset) * esize, pos_stride * esize);
        for (int64_t h = 0; h < heads; h++) {
            float s = dot(qb + h * head_dim, k + (h / group) * head_dim * esize, head_dim, bf16) * scale;
            scores[h * max_len + pos] = s;
            top[h] = s > top[h] ? s : top[h];
        }
    }
    /* Softmax weights, unnormalised; the sum divides the output once. */
    for (int64_t h = 0; h < heads; h++) {
        float *row = scores + h * max_len, sum = 0.f, m = top[h];
#pragma omp simd reduction(+ : sum)
        for (int64_t pos = 0; pos < len; pos++) {
            float e = expf(row[pos] - m);
            row[pos] = e;
            sum += e;
        }
        total[h] = sum;
    }
    /* Pass 2: p.v into per-head accumulators. */
    memset(acc, 0, sizeof(acc));
    for (int64_t pos = 0; pos < len; pos++) {
        const int64_t block = pos / block_size, offset = v_offset + (pos % block_size) * pos_stride;
        const char *v = bytes + (table[block] * block_stride + offset) * esize;
        const int64_t next_block = pos + block_size < len ? table[block + 1] * block_stride : next_first;
        if (next_block >= 0) prefetch_row(bytes + (next_block + offset) * esize, pos_stride * esize);
        for (int64_t h = 0; h < heads; h++) {
            const float p = scores[h * max_len + pos];
            const char *vh = v + (h / group) * head_dim * esize;
            float *a = acc + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) a[d] += p * load(vh, d, bf16);
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        const float inv = 1.f / total[h];
        for (int64_t d = 0; d < head_dim; d++) ob[h * head_dim + d] = acc[h * head_dim + d] * inv;
    }
}

/* q: each sequence's query row (fp32) at q + rows[b] * q_stride, heads [kv_heads * group,
 *    head_dim] (query head h uses kv head h / group, as in transformers);
 * cache: fp32, or bf16 where `bf16` is 1; layer `layer`'s K of block n at cache + n *
 *    block_stride elements (V at + v_offset), each [block_size, kv_heads, head_dim] contiguous;
 * tables: sequence b's block ids at tables + b * table_stride; lens[b]: its cached tokens;
 * out: the attention output (fp32) of sequence b at out + rows[b] * out_stride, like its query;
 * scratch: threads * kv_heads * group * max_len floats. Returns 0, or -1 on a bad shape. */
int paged_decode(const float *q, int64_t q_stride, const int64_t *rows, const void *cache, int bf16,
                 int64_t block_stride, int64_t v_offset, const int32_t *tables, int64_t table_stride,
                 const int32_t *lens, float *out, int64_t out_stride, int64_t batch, int64_t kv_heads,
                 int64_t group, int64_t head_dim, int64_t block_size, int64_t max_len, float scale,
                 int threads, float *scratch) {
    if (head_dim > MAX_HEAD_DIM || group < 1 || kv_heads < 1 || block_size < 1) return -1;
    for (int64_t b = 0; b < batch; b++)
        if (lens[b] < 1 || lens[b] > max_len) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < batch; b++) {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *scores = scratch + (int64_t)tid * kv_heads * group * max_len; /* [heads, max_len] */
        const float *qb = q + rows[b] * q_stride;
        float *ob = out + rows[b] * out_stride;
        const int32_t *table = tables + b * table_stride;
        const int64_t len = lens[b], g = group, bs = block_size;
        /* Where this thread's next sequence (about `threads` on: the schedule deals them out in
         * turn) starts its first block (elements), or -1: its rows are prefetched while this
         * one's last block is read (a short context is mostly its first block). */
        const int64_t ahead = threads > 1 ? threads : 1;
        const int64_t next = b + ahead < batch ? tables[(b + ahead) * table_stride] * block_stride : -1;
        /* Specialised copies: the common head sizes, each cache type. */
        if (head_dim == 64 && !bf16)
            decode_one(qb, cache, 0, table, len, block_stride, v_offset, kv_heads, g, 64, bs, max_len, scale, scores, ob, next);
        else if (head_dim == 64)
            decode_one(qb, cache, 1, table, len, block_stride, v_offset, kv_heads, g, 64, bs, max_len, scale, scores, ob, next);
        else if (head_dim == 128 && !bf16)
            decode_one(qb, cache, 0, table, len, block_stride, v_offset, kv_heads, g, 128, bs, max_len, scale, scores, ob, next);
        else if (head_dim == 128)
            decode_one(qb, cache, 1, table, len, block_stride, v_offset, kv_heads, g, 128, bs, max_len, scale, scores, ob, next);
        else if (!bf16)
            decode_one(qb, cache, 0, table, len, block_stride, v_offset, kv_heads, g, head_dim, bs, max_len, scale, scores, ob, next);
        else
            decode_one(qb, cache, 1, table, len, block_stride, v_offset, kv_heads, g, head_dim, bs, max_len, scale, scores, ob, next);
    }
    return 0;
}
