// CPU_EXACT: matmul kernels whose every output is summed in one order, whatever the batch, the
// thread count or the weights' layout.
//
// llama.cpp's CPU kernels sum a one-token decode (a GEMV) and a batch of tokens (a GEMM, tiled or
// repacked) in different orders, so a speculative verify batch's rows differ from one-token decodes
// in the last bits, and each weight layout rounds its own way. Here every output (row r, token t) of
// a type with 32-weight blocks is, for every kernel, exactly
//
//     acc = 0
//     for each block b, in ascending order:
//         isum = sum_k w[r][b][k] * x[t][b][k]                 int32: exact, in any order
//         acc  = fma((float) isum, d_w[r][b] * d_x[t][b], acc)  the product of two fp16 is exact
//
// with the activations quantized per token and block by one function (an fp16 scale, 32 int8s and
// their sum). The kernels differ only in how many rows (16, in SIMD lanes) and tokens (a register
// tile) they compute at once, which changes no output's operations: a GEMV is the GEMM's one-token
// case, threads split rows and tokens but never a sum, and the plain layout is interleaved 16 rows
// at a time on the fly into the same kernel.
//
// K-quants (Q2_K to Q6_K) and IQ4_XS follow the same order per 32-weight block, their integer
// sub-block scales and mins applied to the exact sums (see the kernels' comment below). MXFP4's
// scale is a power of two (E8M0), so its product with the activations' fp16 scale is exact too.
//
// F16 and BF16 weights keep the file's layout and their activations stay F32: each output is summed
// in 16 lanes (lane l takes the weights k = l mod 16, ascending, by fma), the lanes then added in one
// fixed order (`lanes_sum`). Only batch-invariant mode's plain weights take them, at up to its
// rows (verify passes and decoding; prompts keep llama.cpp's GEMM).
//
// The interleaved layout puts 16 rows side by side: row r's 4 consecutive weights at bytes 4r..4r+3
// of each 64-byte chunk (what one 512-bit dot-product instruction takes against 4 broadcast
// activations), with the rows' scales beside them (`layout_info`). 4-bit values stay packed. For
// Q4_0, Q8_0, IQ4_NL, MXFP4, Q2_K and Q6_K the buffer is as large as the file's tensor; Q4_K, Q5_K,
// Q3_K and IQ4_XS take 1.5-4% more (their 6-bit scales unpacked).

#define GGML_COMMON_IMPL_CPP
#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"
#include "ggml-backend-impl.h"

#include "ggml-impl.h"
#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"
#include "traits.h"
#include "exact.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

constexpr int64_t QK    = 32;  // weights per block: the kernels' unit, a K-quant's super-block holds 8
constexpr int64_t GROUP = 16;  // rows interleaved together

// The one-token kernels' variant (ggml_cpu_exact_set_variant): how many 16-row groups a thread
// streams at once, and how far ahead it asks for the weights. Neither changes any output's
// operations, only how many loads are in flight, which suits each CPU's memory differently.
constexpr int GROUPS_MAX = 8;
std::atomic<int> gemv_groups{ 4 };
std::atomic<int> prefetch_bytes{ 2048 };

// The interleaved layout of a type, per 16-row group: a header per super-block (16 fp16 scales, and
// for Q4_K/Q5_K/Q2_K 16 fp16 mins), then per 32-weight block a unit: per-row integer scales
// (K-quants: Q4_K/Q5_K's scale and min, Q6_K's and Q3_K's two 16-weight scales, Q2_K's two scales
// each with its min in the high nibble, 16 bytes each; IQ4_XS's one scale), the low nibbles (or
// Q8_0's bytes; Q2_K/Q3_K: the low 2 bits in two chunks) in 64-byte chunks, and the high bits (Q5_K
// and Q3_K: one chunk, bit m for chunk register m; Q6_K: two chunks, 2 bits per register).
struct layout_info {
    int blocks;  // 32-weight blocks per super-block
    int header;  // bytes per super-block
    int unit;    // bytes per block
};

constexpr layout_info info_of(ggml_type type) {
    switch (type) {
        case GGML_TYPE_F16:
        case GGML_TYPE_BF16:   return { 1, 0, 0 };  // the file's rows (group_bytes)
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_IQ4_NL: return { 1, 32, 256 };
        case GGML_TYPE_MXFP4:  return { 1, 16, 256 };  // the rows' E8M0 scales, a byte each
        case GGML_TYPE_Q8_0:   return { 1, 32, 512 };
        case GGML_TYPE_IQ4_XS: return { 8, 32, 16 + 256 };
        case GGML_TYPE_Q4_K:   return { 8, 64, 32 + 256 };
        case GGML_TYPE_Q5_K:   return { 8, 64, 32 + 256 + 64 };
        case GGML_TYPE_Q6_K:   return { 8, 32, 32 + 256 + 128 };
        case GGML_TYPE_Q3_K:   return { 8, 32, 32 + 128 + 64 };   // 2-bit chunks, then a chunk of third bits
        case GGML_TYPE_Q2_K:   return { 8, 64, 32 + 128 };        // scale | min << 4 per 16 weights
        default:               return { 0, 0, 0 };
    }
}

bool covered(ggml_type type) {
    return info_of(type).blocks != 0;
}

constexpr bool is_float(ggml_type type) { return type == GGML_TYPE_F16 || type == GGML_TYPE_BF16; }

constexpr bool has_min(ggml_type type) { return type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K; }

// the header holds a second scale per row, for the mins (Q4_K, Q5_K, Q2_K)
constexpr bool has_dmin(ggml_type type) { return has_min(type) || type == GGML_TYPE_Q2_K; }

// a scale per 16 weights: two per 32-weight block (Q6_K, Q3_K signed; Q2_K's with a min each)
constexpr bool has_half_scales(ggml_type type) {
    return type == GGML_TYPE_Q6_K || type == GGML_TYPE_Q3_K || type == GGML_TYPE_Q2_K;
}

// 2-bit low parts: two 64-byte chunks, register m's 2 bits at bits 2 (m % 4) of chunk m / 4
constexpr bool has_two_bits(ggml_type type) { return type == GGML_TYPE_Q2_K || type == GGML_TYPE_Q3_K; }

// what the sum of each half of 16 takes off the stored values (Q6_K's and Q3_K's offset)
constexpr int32_t half_offset(ggml_type type) {
    return type == GGML_TYPE_Q6_K ? 32 : type == GGML_TYPE_Q3_K ? 4 : 0;
}

// bytes of integer scales at the start of a unit: 16 rows' scale (IQ4_XS), and their min (Q4_K,
// Q5_K) or second scale (Q6_K, Q3_K, Q2_K)
constexpr int scale_bytes(ggml_type type) {
    return type == GGML_TYPE_IQ4_XS ? 16 : (has_min(type) || has_half_scales(type)) ? 32 : 0;
}

// the weight values are a table's, looked up by 4-bit index
constexpr bool has_table(ggml_type type) {
    return type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_IQ4_XS || type == GGML_TYPE_MXFP4;
}

const int8_t * table_of(ggml_type type) {
    return type == GGML_TYPE_MXFP4 ? kvalues_mxfp4 : kvalues_iq4nl;
}

// bytes of one 16-row group over a row of K weights
int64_t group_bytes(ggml_type type, int64_t K) {
    if (is_float(type)) {
        return GROUP * (int64_t) ggml_row_size(type, K);
    }
    const layout_info I = info_of(type);
    return K / (QK * I.blocks) * (I.header + I.blocks * I.unit);
}

// bytes of one matrix (one expert) of the interleaved layout
int64_t matrix_bytes(const ggml_tensor * t) {
    return (t->ne[1] + GROUP - 1) / GROUP * group_bytes(t->type, t->ne[0]);
}

// ---------------------------------------------------------------------------------- activations

// a token's quantized activations: K int8s, then per block a float scale (an fp16 value), the sums
// of its two halves of 16 (int32), their total times the scale (exact: 13 bits times 11) and -8
// times the sums of the activations maddubs pairs into each 16-bit half of a 32-bit lane (k mod 4
// in {0, 1} low, {2, 3} high; int16s: at most 8 * 16 * 127); for F16 and BF16 weights its K floats
size_t act_row_bytes(ggml_type type, int64_t K) {
    return GGML_PAD(is_float(type) ? (size_t) K * sizeof(float) : (size_t) K + (size_t) (K / QK) * 20, 64);
}

struct act_row {
    const int8_t *   q;
    const float *    d;
    const int32_t *  s16;       // [2 * nb]
    const float *    sum_d;     // (s16[2b] + s16[2b + 1]) * d[b]
    const uint32_t * lane_off;  // int16 pairs: -8 * (the low half's activations, the high half's)
    const float *    f;         // the floats (F16 and BF16 weights)
};

act_row act_at(const uint8_t * row, int64_t K) {
    const int64_t nb = K / QK;
    return { (const int8_t *) row, (const float *) (row + K), (const int32_t *) (row + K + 4 * nb),
             (const float *) (row + K + 12 * nb), (const uint32_t *) (row + K + 16 * nb), (const float *) row };
}

// rounds to nearest, ties to even: what cvtps2dq does in the default rounding mode
void quantize_act(const float * x, uint8_t * row, int64_t K) {
    const int64_t nb = K / QK;
    int8_t *  q   = (int8_t *) row;
    float *   d   = (float *) (row + K);
    int32_t * s16 = (int32_t *) (row + K + 4 * nb);
    float *    sum_d    = (float *) (row + K + 12 * nb);
    uint32_t * lane_off = (uint32_t *) (row + K + 16 * nb);
    for (int64_t b = 0; b < nb; ++b) {
        const float * xb = x + b * QK;
        int8_t *      qb = q + b * QK;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#elif defined(__AVX2__)
        __m256 v[4];
        __m256 vmax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
        float amax = 0.0f;
        for (int k = 0; k < QK; ++k) {
            amax = std::max(amax, fabsf(xb[k]));
        }
#endif
        const float dd = amax / 127.0f;
        const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
        d[b] = GGML_CPU_FP16_TO_FP32(GGML_CPU_FP32_TO_FP16(dd));
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 vid = _mm512_set1_ps(id);
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));
        const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
        _mm_storeu_si128((__m128i *) qb, _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *) (qb + 16), _mm512_cvtepi32_epi8(i1));
        s16[2 * b]     = _mm512_reduce_add_epi32(i0);
        s16[2 * b + 1] = _mm512_reduce_add_epi32(i1);
#elif defined(__AVX2__)
        const __m256 vid = _mm256_set1_ps(id);
        __m256i iv[4];
        for (int i = 0; i < 4; ++i) {
            iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
        }
        // packs interleaves the 128-bit lanes: 4-byte runs in the order 0 2 4 6 | 1 3 5 7 of the 8
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
        _mm256_storeu_si256((__m256i *) qb, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        for (int h = 0; h < 2; ++h) {
            const __m256i s8 = _mm256_add_epi32(iv[2 * h], iv[2 * h + 1]);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s16[2 * b + h] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
        }
#else
        for (int h = 0; h < 2; ++h) {
            int32_t sum = 0;
            for (int k = 16 * h; k < 16 * h + 16; ++k) {
                const int v = (int) nearbyintf(xb[k] * id);
                qb[k] = (int8_t) v;
                sum += v;
            }
            s16[2 * b + h] = sum;
        }
#endif
        int32_t lo = 0, hi = 0;
        for (int k = 0; k < QK; ++k) {
            (k & 2 ? hi : lo) += qb[k];
        }
        sum_d[b]    = (float) (s16[2 * b] + s16[2 * b + 1]) * d[b];
        lane_off[b] = (uint32_t) (uint16_t) (-8 * lo) | (uint32_t) (uint16_t) (-8 * hi) << 16;
    }
}

// ---------------------------------------------------------------------------------- weights

uint32_t load32(const uint8_t * p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

void store32(uint8_t * p, uint32_t v) {
    memcpy(p, &v, 4);
}

// the packed nibbles of one 32-weight block whose weight l sits in the low (shift 0) or high
// (shift 4) nibble of lo[l] for l < 16 and of hi[l - 16] after: chunk m of row r gets weights
// 4m..4m+3 in its low nibbles and 16+4m.. in its high ones
void put_nibbles(const uint8_t * lo, const uint8_t * hi, int shift, uint8_t * u, int64_t r) {
    for (int m = 0; m < 4; ++m) {
        const uint32_t a = load32(lo + 4 * m), b = load32(hi + 4 * m);
        store32(u + 64 * m + 4 * r, shift == 0 ? (a & 0x0F0F0F0F) | ((b & 0x0F0F0F0F) << 4)
                                               : ((a >> 4) & 0x0F0F0F0F) | (b & 0xF0F0F0F0));
    }
}

// Q4_K/Q5_K's 6-bit scale and min of block j
void scale_min_k4(const uint8_t * sc, int j, uint8_t & scale, uint8_t & min) {
    if (j < 4) {
        scale = sc[j] & 63;
        min   = sc[j + 4] & 63;
    } else {
        scale = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
        min   = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

// where Q4_K/Q5_K/Q6_K's block j takes its packed nibbles in a super-block of the file: put_nibbles'
// lo (hi is 16 bytes on), from the block's start, and its shift
struct nibble_source {
    size_t lo_at;
    int    shift;
};

nibble_source nibbles_of(ggml_type type, int j) {
    if (type == GGML_TYPE_Q6_K) {  // half j / 4 of 128 weights: ql[l], ql[32 + l] low nibbles, then high
        return { offsetof(block_q6_K, ql) + 64 * (j / 4) + 32 * (j % 2), (j % 4) < 2 ? 0 : 4 };
    }
    // the low (even j) or high nibbles of 32 bytes
    return { (type == GGML_TYPE_Q5_K ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs)) + 32 * (j / 2), 4 * (j % 2) };
}

// row r of a 16-row group: one super-block of the file at src, into the group's super-block at h
// (nibbles false: Q4_K/Q5_K/Q6_K's packed nibbles left to put_nibbles_4rows)
void interleave_row(ggml_type type, const uint8_t * src, int64_t r, uint8_t * h, bool nibbles = true) {
    const layout_info I = info_of(type);
    const size_t d_at = type == GGML_TYPE_Q6_K ? offsetof(block_q6_K, d) : type == GGML_TYPE_Q3_K ? offsetof(block_q3_K, d)
                      : type == GGML_TYPE_Q2_K ? offsetof(block_q2_K, qs) + sizeof(block_q2_K::qs) : 0;  // Q2_K: d, dmin after qs
    if (type == GGML_TYPE_MXFP4) {
        h[r] = src[offsetof(block_mxfp4, e)];
    } else {
        memcpy(h + 2 * r, src + d_at, 2);  // d
    }
    if (has_dmin(type)) {
        memcpy(h + 32 + 2 * r, src + d_at + 2, 2);  // dmin, after d
    }
    uint8_t * u = h + I.header;
    switch (type) {
        case GGML_TYPE_Q8_0: {
            const uint8_t * qs = src + offsetof(block_q8_0, qs);
            for (int m = 0; m < 8; ++m) {
                store32(u + 64 * m + 4 * r, load32(qs + 4 * m));
            }
        } break;
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_IQ4_NL:
        case GGML_TYPE_MXFP4: {  // the file's byte k already holds weights k and 16+k
            const uint8_t * qs = src + (type == GGML_TYPE_MXFP4 ? offsetof(block_mxfp4, qs) : offsetof(block_q4_0, qs));
            for (int m = 0; m < 4; ++m) {
                store32(u + 64 * m + 4 * r, load32(qs + 4 * m));
            }
        } break;
        case GGML_TYPE_IQ4_XS: {
            const block_iq4_xs * blk = (const block_iq4_xs *) src;
            for (int j = 0; j < 8; ++j, u += I.unit) {  // block j: 16 bytes, weights k and 16+k in byte k
                const int ls = ((blk->scales_l[j / 2] >> 4 * (j % 2)) & 0x0F) | (((blk->scales_h >> 2 * j) & 3) << 4);
                u[r] = (uint8_t) (int8_t) (ls - 32);
                for (int m = 0; m < 4; ++m) {
                    store32(u + 16 + 64 * m + 4 * r, load32(blk->qs + 16 * j + 4 * m));
                }
            }
        } break;
        case GGML_TYPE_Q4_K:
        case GGML_TYPE_Q5_K: {
            const bool      q5 = type == GGML_TYPE_Q5_K;
            const uint8_t * sc = src + offsetof(block_q4_K, scales);
            const uint8_t * qh = src + offsetof(block_q5_K, qh);
            for (int j = 0; j < 8; ++j, u += I.unit) {
                scale_min_k4(sc, j, u[r], u[16 + r]);
                if (nibbles) {
                    const nibble_source n = nibbles_of(type, j);
                    put_nibbles(src + n.lo_at, src + n.lo_at + 16, n.shift, u + 32, r);
                }
                if (q5) {  // weight l's fifth bit is bit j of qh[l]: register m's bit goes to bit m
                    uint32_t bits = 0;
                    for (int m = 0; m < 8; ++m) {
                        bits |= ((load32(qh + 4 * m) >> j) & 0x01010101) << m;
                    }
                    store32(u + 32 + 256 + 4 * r, bits);
                }
            }
        } break;
        case GGML_TYPE_Q2_K:
        case GGML_TYPE_Q3_K: {
            // block j = 4 half + shift: weight k's low bits are bits 2 shift of qs[32 half + k]
            // (Q3_K: its third bit is bit j of hmask[k]); sub-blocks 2j and 2j + 1 are its halves
            const bool      q3 = type == GGML_TYPE_Q3_K;
            const uint8_t * qs = src + (q3 ? offsetof(block_q3_K, qs) : offsetof(block_q2_K, qs));
            int8_t sc3[16];
            if (q3) {  // the 16 6-bit scales, unpacked as dequantize_row_q3_K does
                const uint8_t * p = ((const block_q3_K *) src)->scales;
                for (int i = 0; i < 16; ++i) {
                    const int low  = i < 8 ? p[i] & 0x0F : p[i - 8] >> 4;
                    const int high = (p[8 + i % 4] >> (2 * (i / 4))) & 3;
                    sc3[i] = (int8_t) ((low | high << 4) - 32);
                }
            }
            for (int j = 0; j < 8; ++j, u += I.unit) {
                for (int half = 0; half < 2; ++half) {
                    u[16 * half + r] = q3 ? (uint8_t) sc3[2 * j + half] : ((const block_q2_K *) src)->scales[2 * j + half];
                }
                for (int c = 0; c < 2; ++c) {  // chunk c: registers 4c..4c+3, 2 bits each
                    uint32_t bits = 0;
                    for (int m = 0; m < 4; ++m) {
                        bits |= ((load32(qs + 32 * (j / 4) + 4 * (4 * c + m)) >> (2 * (j % 4))) & 0x03030303) << (2 * m);
                    }
                    store32(u + 32 + 64 * c + 4 * r, bits);
                }
                if (q3) {  // register m's third bit at bit m
                    const uint8_t * hm = ((const block_q3_K *) src)->hmask;
                    uint32_t bits = 0;
                    for (int m = 0; m < 8; ++m) {
                        bits |= ((load32(hm + 4 * m) >> j) & 0x01010101) << m;
                    }
                    store32(u + 32 + 128 + 4 * r, bits);
                }
            }
        } break;
        case GGML_TYPE_Q6_K: {
            const block_q6_K * blk = (const block_q6_K *) src;
            for (int j = 0; j < 8; ++j, u += I.unit) {
                u[r]      = (uint8_t) blk->scales[2 * j];
                u[16 + r] = (uint8_t) blk->scales[2 * j + 1];
                // half j / 4 of 128 weights: blocks 0..3 take ql[l], ql[32 + l] (low nibbles), then
                // the same high nibbles, and bits 2 (j % 4) of qh[l] as the top two bits
                const uint8_t * qh = blk->qh + 32 * (j / 4);
                const int       sh = 2 * (j % 4);
                if (nibbles) {
                    const nibble_source n = nibbles_of(type, j);
                    put_nibbles(src + n.lo_at, src + n.lo_at + 16, n.shift, u + 32, r);
                }
                for (int c = 0; c < 2; ++c) {  // chunk c: registers 4c..4c+3, 2 bits each
                    uint32_t bits = 0;
                    for (int m = 0; m < 4; ++m) {
                        bits |= ((load32(qh + 4 * (4 * c + m)) >> sh) & 0x03030303) << (2 * m);
                    }
                    store32(u + 32 + 256 + 64 * c + 4 * r, bits);
                }
            }
        } break;
        default: GGML_ABORT("CPU_EXACT: type %s", ggml_type_name(type));
    }
}

#if defined(__SSE2__)
// four rows' 16 bytes (x0 row r's, .. x3 row r + 3's) to chunks m = 0..3 of the group at u: row
// r + i's word m at u + 64 m + 4 (r + i)
void put_words_4rows(__m128i x0, __m128i x1, __m128i x2, __m128i x3, uint8_t * u, int64_t r) {
    const __m128i lo01 = _mm_unpacklo_epi32(x0, x1), lo23 = _mm_unpacklo_epi32(x2, x3);
    const __m128i hi01 = _mm_unpackhi_epi32(x0, x1), hi23 = _mm_unpackhi_epi32(x2, x3);
    _mm_storeu_si128((__m128i *) (u + 4 * r), _mm_unpacklo_epi64(lo01, lo23));
    _mm_storeu_si128((__m128i *) (u + 64 + 4 * r), _mm_unpackhi_epi64(lo01, lo23));
    _mm_storeu_si128((__m128i *) (u + 128 + 4 * r), _mm_unpacklo_epi64(hi01, hi23));
    _mm_storeu_si128((__m128i *) (u + 192 + 4 * r), _mm_unpackhi_epi64(hi01, hi23));
}

// put_nibbles for rows r..r+3 of one super-block, the file's rows `row_stride` apart from src
void put_nibbles_4rows(ggml_type type, const uint8_t * src, size_t row_stride, uint8_t * h, int64_t r) {
    const layout_info I   = info_of(type);
    const __m128i     low = _mm_set1_epi8(0x0F);
    for (int j = 0; j < 8; ++j) {
        const nibble_source n = nibbles_of(type, j);
        __m128i             x[4];
        for (int i = 0; i < 4; ++i) {
            const uint8_t * q = src + i * row_stride + n.lo_at;
            const __m128i   a = _mm_loadu_si128((const __m128i *) q);
            const __m128i   b = _mm_loadu_si128((const __m128i *) (q + 16));
            x[i] = n.shift == 0 ? _mm_or_si128(_mm_and_si128(a, low), _mm_slli_epi16(_mm_and_si128(b, low), 4))
                                : _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), low), _mm_andnot_si128(low, b));
        }
        put_words_4rows(x[0], x[1], x[2], x[3], h + I.header + j * I.unit + 32, r);
    }
}
#endif

// Q4_0, IQ4_NL, MXFP4 and Q8_0, whose block is a scale and then 4 or 8 words of weights that go
// unchanged to the group's 64-byte chunks (row r's word at 4 r): four rows at a time, a 4 x 4
// transpose of words per 16 bytes. A plain weight (the disk tier's experts, read from the file's
// mapping) is interleaved at every use, and interleave_row, called per block and row, took three
// times the matmul's own time there.
void interleave_group_words(ggml_type type, const uint8_t * src, size_t row_stride, int64_t n_rows, int64_t n_blocks,
                            uint8_t * dst) {
    const layout_info I     = info_of(type);
    const size_t      b_src = ggml_row_size(type, QK);
    const int64_t     b_dst = I.header + I.unit;
#if defined(__SSE2__)
    const bool   mx       = type == GGML_TYPE_MXFP4;  // a one-byte scale (E8M0), else an F16 one
    const size_t qs_at    = mx ? offsetof(block_mxfp4, qs) : type == GGML_TYPE_Q8_0 ? offsetof(block_q8_0, qs)
                                                                                    : offsetof(block_q4_0, qs);
    const int    n_chunks = I.unit / 64;
#endif
    for (int64_t s = 0; s < n_blocks; ++s) {
        const uint8_t * b = src + s * b_src;
        uint8_t *       h = dst + s * b_dst;
        int64_t         r = 0;
#if defined(__SSE2__)
        uint8_t * u = h + I.header;
        for (; r + 4 <= n_rows; r += 4) {
            const uint8_t * q = b + r * row_stride + qs_at;
            for (int c = 0; c < n_chunks; c += 4) {
                const __m128i x0 = _mm_loadu_si128((const __m128i *) (q + 4 * c));
                const __m128i x1 = _mm_loadu_si128((const __m128i *) (q + row_stride + 4 * c));
                const __m128i x2 = _mm_loadu_si128((const __m128i *) (q + 2 * row_stride + 4 * c));
                const __m128i x3 = _mm_loadu_si128((const __m128i *) (q + 3 * row_stride + 4 * c));
                put_words_4rows(x0, x1, x2, x3, u + 64 * c, r);
            }
            for (int64_t i = r; i < r + 4; ++i) {
                if (mx) {
                    h[i] = b[i * row_stride + offsetof(block_mxfp4, e)];
                } else {
                    memcpy(h + 2 * i, b + i * row_stride, 2);
                }
            }
        }
#endif
        for (; r < n_rows; ++r) {  // the rows left (and every row without SSE2) one by one
            interleave_row(type, b + r * row_stride, r, h);
        }
    }
}

// one 16-row group of the interleaved layout from n_rows rows of the file's blocks (rows past
// n_rows: zeros)
void interleave_group(ggml_type type, const uint8_t * src, size_t row_stride, int64_t n_rows, int64_t K, uint8_t * dst) {
    if (is_float(type)) {  // the file's rows, zeros past n_rows
        const size_t row = ggml_row_size(type, K);
        memset(dst, 0, GROUP * row);
        for (int64_t r = 0; r < n_rows; ++r) {
            memcpy(dst + r * row, src + r * row_stride, row);
        }
        return;
    }
    const layout_info I = info_of(type);
    const int64_t n_sb   = K / (QK * I.blocks);
    const size_t  sb_src = ggml_row_size(type, QK * I.blocks);
    const int64_t sb_dst = I.header + I.blocks * I.unit;
    if (n_rows < GROUP) {
        memset(dst, 0, (size_t) (n_sb * sb_dst));
    }
    if (type == GGML_TYPE_Q4_0 || type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_MXFP4 || type == GGML_TYPE_Q8_0) {
        interleave_group_words(type, src, row_stride, n_rows, n_sb, dst);
        return;
    }
    for (int64_t s = 0; s < n_sb; ++s) {
        int64_t r = 0;
#if defined(__SSE2__)
        const bool nibbles4 = type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K || type == GGML_TYPE_Q6_K;
        for (; nibbles4 && r + 4 <= n_rows; r += 4) {  // the scales row by row, the nibbles 4 rows at once
            for (int64_t i = r; i < r + 4; ++i) {
                interleave_row(type, src + i * row_stride + s * sb_src, i, dst + s * sb_dst, false);
            }
            put_nibbles_4rows(type, src + r * row_stride + s * sb_src, row_stride, dst + s * sb_dst, r);
        }
#endif
        for (; r < n_rows; ++r) {
            interleave_row(type, src + r * row_stride + s * sb_src, r, dst + s * sb_dst);
        }
    }
}

// ---------------------------------------------------------------------------------- the kernels
//
// Each computes the 16 rows of one group for T tokens (x: their activations, y: T rows of 16
// outputs), over every block, in exactly the order of the file's header. Per block b, with A the
// dot of the stored values and the activations (A0, A1 of the two halves of 16), S0, S1 the
// activations' sums over those halves and dx their scale:
//   Q4_0, Q8_0, IQ4_NL, MXFP4  acc = fma(A - off (S0 + S1), d dx, acc)     signed values: off = 0
//   IQ4_XS                     acc = fma(sc (A - off (S0 + S1)), d dx, acc)
//   Q4_K, Q5_K                 acc = fma(sc A, d dx, acc); acc = fma(mn (S0 + S1), -dmin dx, acc)
//   Q6_K, Q3_K                 acc = fma(sc0 (A0 - off S0) + sc1 (A1 - off S1), d dx, acc)   off 32, 4
//   Q2_K                       acc = fma(sc0 A0 + sc1 A1, d dx, acc); acc = fma(mn0 S0 + mn1 S1, -dmin dx, acc)
// The integer terms are exact in int32 and so are the products of two fp16 values in float (and of
// MXFP4's power of two and an fp16 value).

// the weight's value in the sum A: the unsigned stored value where the kernels offset it, else signed
[[maybe_unused]] int value_in_sum(ggml_type type, int stored) {
    switch (type) {
        case GGML_TYPE_Q4_0:   return stored - 8;
        case GGML_TYPE_Q8_0:   return (int8_t) stored;
        case GGML_TYPE_IQ4_NL:
        case GGML_TYPE_IQ4_XS:
        case GGML_TYPE_MXFP4:  return table_of(type)[stored];
        case GGML_TYPE_Q6_K:
        case GGML_TYPE_Q3_K:   return stored - half_offset(type);
        default:               return stored;
    }
}

// the stored value of row r's weight k of a unit's quants (past the unit's scales)
[[maybe_unused]] int stored_at(ggml_type type, const uint8_t * u, int r, int k) {
    const int m = k / 4, i = k % 4;
    if (type == GGML_TYPE_Q8_0) {
        return u[64 * m + 4 * r + i];
    }
    if (has_two_bits(type)) {
        const int v = (u[64 * (m / 4) + 4 * r + i] >> (2 * (m % 4))) & 3;
        return type == GGML_TYPE_Q3_K ? v | ((u[128 + 4 * r + i] >> m) & 1) << 2 : v;
    }
    int v = (u[64 * (m % 4) + 4 * r + i] >> (m < 4 ? 0 : 4)) & 0x0F;
    if (type == GGML_TYPE_Q5_K) {
        v |= ((u[256 + 4 * r + i] >> m) & 1) << 4;
    } else if (type == GGML_TYPE_Q6_K) {
        v |= ((u[256 + 64 * (m / 4) + 4 * r + i] >> (2 * (m % 4))) & 3) << 4;
    }
    return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define EXACT_KERNEL "avx512-vnni"
// a tile's tokens: an accumulator each, beside 8 zmm of weights (of 32). 16 rather than 8: a
// 512-token prompt of a Qwen3-30B-A3B shape (Q4_0) 868 -> 938 tok/s on a Zen 5, the same bits
constexpr int TILE_MAX = 16;
#define EXACT_KERNEL_TAKES_GROUPS  // tile_simd below computes G groups itself

// a table type's values offset by 128, as unsigned bytes
template <ggml_type TYPE>
const uint8_t * table_unsigned() {
    alignas(16) static uint8_t table[16];
    static const bool filled = [] {
        for (int i = 0; i < 16; ++i) {
            table[i] = (uint8_t) (table_of(TYPE)[i] + 128);
        }
        return true;
    }();
    GGML_UNUSED(filled);
    return table;
}

// the 16 rows' float scales in a super-block's header: fp16 values, or MXFP4's E8M0 exponents as
// ggml_e8m0_to_fp32_half reads them (2^(e-128); e < 2 a denormal)
template <ggml_type TYPE>
__m512 row_scales(const uint8_t * h) {
    if constexpr (TYPE == GGML_TYPE_MXFP4) {
        const __m512i e        = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) h));
        const __m512i normal   = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        const __m512i denormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
        return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, denormal));
    } else {
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) h));
    }
}

// rows in the 16 lanes; the weights as unsigned bytes for vpdpbusd against the signed activations
// (Q8_0's and the table types' values offset by 128, the offset times the activations' sum taken
// back).
// G groups (gstride bytes apart) at once for a single token: more independent loads in flight
// while the weights stream from memory.
template <ggml_type TYPE, int G, int T>
void tile_simd(const uint8_t * w, int64_t gstride, int64_t K, const act_row * x, float * y) {
    constexpr layout_info I = info_of(TYPE);
    constexpr int32_t off = TYPE == GGML_TYPE_Q4_0 ? 8 : (TYPE == GGML_TYPE_Q8_0 || has_table(TYPE)) ? 128 : 0;
    constexpr int64_t sb_bytes = I.header + I.blocks * I.unit;
    const __m512i m4  = _mm512_set1_epi8(0x0F);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *) table_unsigned<TYPE>()));
    __m512 acc[G][T];
    for (int c = 0; c < G; ++c) {
        for (int t = 0; t < T; ++t) {
            acc[c][t] = _mm512_setzero_ps();
        }
    }
    const int64_t n_sb = K / (QK * I.blocks);
    const int ahead = T <= 2 ? prefetch_bytes.load(std::memory_order_relaxed) : 0;
    for (int64_t s = 0; s < n_sb; ++s) {
        for (int j = 0; j < I.blocks; ++j) {
            const int64_t b = s * I.blocks + j;
            for (int c = 0; c < G; ++c) {
                const uint8_t * h = w + c * gstride + s * sb_bytes;
                const uint8_t * u = h + I.header + j * I.unit;
                // a few tokens read the weights once, from memory: ask for them ahead
                if (ahead > 0) {
                    for (int l = 0; l < I.unit + (j == 0 ? I.header : 0); l += 64) {
                        _mm_prefetch((const char *) (j == 0 ? h : u) + ahead + l, _MM_HINT_T0);
                    }
                }
                const __m512 d = row_scales<TYPE>(h);
                __m512 neg_dmin = _mm512_setzero_ps();
                if constexpr (has_dmin(TYPE)) {
                    neg_dmin = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (h + 32))));
                }
                __m512i sc0 = _mm512_setzero_si512(), sc1 = _mm512_setzero_si512();
                __m512i mn0 = _mm512_setzero_si512(), mn1 = _mm512_setzero_si512();  // Q2_K's mins
                const uint8_t * qp = u + scale_bytes(TYPE);
                if constexpr (TYPE == GGML_TYPE_Q2_K) {  // scale | min << 4
                    const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) u));
                    const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (u + 16)));
                    sc0 = _mm512_and_si512(b0, _mm512_set1_epi32(0x0F));
                    sc1 = _mm512_and_si512(b1, _mm512_set1_epi32(0x0F));
                    mn0 = _mm512_srli_epi32(b0, 4);
                    mn1 = _mm512_srli_epi32(b1, 4);
                } else if constexpr (has_min(TYPE)) {
                    sc0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) u));
                    sc1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (u + 16)));
                } else if constexpr (scale_bytes(TYPE) > 0) {  // signed: Q6_K's and Q3_K's two, IQ4_XS's one
                    sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) u));
                    if constexpr (scale_bytes(TYPE) == 32) {
                        sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (u + 16)));
                    }
                }
                __m512i q[8];
                if constexpr (TYPE == GGML_TYPE_Q8_0) {
                    for (int m = 0; m < 8; ++m) {
                        q[m] = _mm512_xor_si512(_mm512_loadu_si512(qp + 64 * m), _mm512_set1_epi8((char) 0x80));
                    }
                } else if constexpr (has_two_bits(TYPE)) {
                    const __m512i lo[2] = { _mm512_loadu_si512(qp), _mm512_loadu_si512(qp + 64) };
                    for (int m = 0; m < 8; ++m) {
                        q[m] = _mm512_and_si512(_mm512_srli_epi16(lo[m / 4], 2 * (m % 4)), _mm512_set1_epi8(3));
                    }
                    if constexpr (TYPE == GGML_TYPE_Q3_K) {  // the third bit as a byte mask: 4 added where set
                        const __m512i hb = _mm512_loadu_si512(qp + 128);
                        for (int m = 0; m < 8; ++m) {
                            const __mmask64 set = _mm512_test_epi8_mask(hb, _mm512_set1_epi8((char) (1 << m)));
                            q[m] = _mm512_mask_add_epi8(q[m], set, q[m], _mm512_set1_epi8(4));
                        }
                    }
                } else {
                    for (int m = 0; m < 4; ++m) {
                        const __m512i v = _mm512_loadu_si512(qp + 64 * m);
                        q[m]     = _mm512_and_si512(v, m4);
                        q[m + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    }
                    if constexpr (has_table(TYPE)) {
                        for (int m = 0; m < 8; ++m) {
                            q[m] = _mm512_shuffle_epi8(lut, q[m]);
                        }
                    } else if constexpr (TYPE == GGML_TYPE_Q5_K) {
                        const __m512i hb = _mm512_loadu_si512(qp + 256);
                        for (int m = 0; m < 8; ++m) {
                            const __m512i bit = _mm512_and_si512(_mm512_srli_epi16(hb, m), _mm512_set1_epi8(1));
                            q[m] = _mm512_or_si512(q[m], _mm512_slli_epi16(bit, 4));
                        }
                    } else if constexpr (TYPE == GGML_TYPE_Q6_K) {
                        for (int m = 0; m < 8; ++m) {
                            const __m512i hb   = _mm512_loadu_si512(qp + 256 + 64 * (m / 4));
                            const __m512i bits = _mm512_and_si512(_mm512_srli_epi16(hb, 2 * (m % 4)), _mm512_set1_epi8(3));
                            q[m] = _mm512_or_si512(q[m], _mm512_slli_epi16(bits, 4));
                        }
                    }
                }
                for (int t = 0; t < T; ++t) {
                    const int32_t * xq = (const int32_t *) (x[t].q + b * QK);
                    const int32_t   s0 = x[t].s16[2 * b], s1 = x[t].s16[2 * b + 1];
                    const __m512    dd = _mm512_mul_ps(d, _mm512_set1_ps(x[t].d[b]));
                    __m512i a0 = _mm512_setzero_si512();
                    __m512i a1 = _mm512_setzero_si512();
                    for (int m = 0; m < 4; ++m) {
                        a0 = _mm512_dpbusd_epi32(a0, q[m], _mm512_set1_epi32(xq[m]));
                        a1 = _mm512_dpbusd_epi32(a1, q[m + 4], _mm512_set1_epi32(xq[m + 4]));
                    }
                    __m512 & out = acc[c][t];
                    if constexpr (has_half_scales(TYPE)) {
                        a0 = _mm512_sub_epi32(a0, _mm512_set1_epi32(half_offset(TYPE) * s0));
                        a1 = _mm512_sub_epi32(a1, _mm512_set1_epi32(half_offset(TYPE) * s1));
                        const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(a0, sc0), _mm512_mullo_epi32(a1, sc1));
                        out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dd, out);
                        if constexpr (TYPE == GGML_TYPE_Q2_K) {
                            const __m512i mins = _mm512_add_epi32(_mm512_mullo_epi32(mn0, _mm512_set1_epi32(s0)),
                                                                  _mm512_mullo_epi32(mn1, _mm512_set1_epi32(s1)));
                            out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(neg_dmin, _mm512_set1_ps(x[t].d[b])), out);
                        }
                    } else if constexpr (has_min(TYPE)) {
                        const __m512i isum = _mm512_mullo_epi32(_mm512_add_epi32(a0, a1), sc0);
                        out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dd, out);
                        const __m512i mins = _mm512_mullo_epi32(sc1, _mm512_set1_epi32(s0 + s1));
                        out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(neg_dmin, _mm512_set1_ps(x[t].d[b])), out);
                    } else if constexpr (TYPE == GGML_TYPE_IQ4_XS) {
                        const __m512i a = _mm512_sub_epi32(_mm512_add_epi32(a0, a1), _mm512_set1_epi32(off * (s0 + s1)));
                        out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(a, sc0)), dd, out);
                    } else {
                        const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(a0, a1), _mm512_set1_epi32(off * (s0 + s1)));
                        out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dd, out);
                    }
                }
            }
        }
    }
    for (int c = 0; c < G; ++c) {
        for (int t = 0; t < T; ++t) {
            _mm512_storeu_ps(y + (c * T + t) * GROUP, acc[c][t]);
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EXACT_KERNEL "avx2"
// weights decoded once per 16 tokens (the accumulators live in L1): 8 was 5-20% faster than 4 on a
// Zen 3; 16 gives a 512-token prompt 5-9% more than 8 on a Zen 5 running this build (Q4_0 563 -> 614,
// Q4_K_M 546 -> 575, IQ4_XS 416 -> 448 tok/s, Qwen3-30B-A3B shapes, 2 threads)
constexpr int TILE_MAX = 16;

// rows 8h..8h+7's float scales in a super-block's header (see the AVX-512 kernel's row_scales)
template <ggml_type TYPE>
__m256 row_scales(const uint8_t * hdr, int h) {
    if constexpr (TYPE == GGML_TYPE_MXFP4) {
        const __m256i e        = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (hdr + 8 * h)));
        const __m256i normal   = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        const __m256i denormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, denormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
    } else {
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (hdr + 16 * h)));
    }
}

// the largest weight magnitude maddubs multiplies: a stored value, or a table's (Q8_0: |-128|)
constexpr int max_weight(ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q2_K:  return 3;
        case GGML_TYPE_Q3_K:  return 7;
        case GGML_TYPE_MXFP4: return 12;
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_K:  return 15;
        case GGML_TYPE_Q5_K:  return 31;
        case GGML_TYPE_Q6_K:  return 63;
        default:              return 128;
    }
}

// how many maddubs results add up in 16 bits without overflow: each is two products of a weight and
// an activation (|x| <= 127), so n of them stay within n * 2 * 127 * max_weight
constexpr int sums_in_16_bits(ggml_type type) {
    return std::min(8, 32767 / (2 * 127 * max_weight(type)));
}

// 8 rows' bytes a and b as int16 pairs (a_r, b_r) in lane r: what madd multiplies a row's two
// 16-bit sums by (a = b: one scale for both)
template <bool SIGNED>
__m256i byte_pairs(__m128i a, __m128i b) {
    const __m128i ab = _mm_unpacklo_epi8(a, b);
    return SIGNED ? _mm256_cvtepi8_epi16(ab) : _mm256_cvtepu8_epi16(ab);
}

// rows in 8 lanes, twice per group; the products through maddubs, which takes an unsigned byte:
// the unsigned stored values as they are (Q4_0's offset taken back with the activations' sum),
// the signed ones (Q8_0, the table types) as their magnitude against activations carrying their
// sign. No pair of products saturates 16 bits; runs of them are added in 16 bits (sums_in_16_bits:
// all 8 of a block for 4-bit weights) before one madd takes them to 32 bits, times each row's
// integer scale where the type has one. The integers are the same as one madd per product's.
template <ggml_type TYPE, int T>
void tile_one(const uint8_t * w, int64_t K, const act_row * x, float * y) {
    constexpr layout_info I = info_of(TYPE);
    constexpr bool is_signed = TYPE == GGML_TYPE_Q8_0 || has_table(TYPE);
    constexpr int  SUMS16    = sums_in_16_bits(TYPE);
    const __m256i m4   = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i lut  = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) table_of(TYPE)));
    __m256 acc[T][2];
    for (int t = 0; t < T; ++t) {
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    }
    const int64_t n_sb = K / (QK * I.blocks);
    const int ahead = T <= 2 ? prefetch_bytes.load(std::memory_order_relaxed) : 0;
    for (int64_t s = 0; s < n_sb; ++s) {
        const uint8_t * hdr = w;
        w += I.header;
        for (int j = 0; j < I.blocks; ++j, w += I.unit) {
            const int64_t b = s * I.blocks + j;
            if (ahead > 0) {  // as the AVX-512 kernel: a few tokens read the weights once, from memory
                for (int l = 0; l < I.unit + (j == 0 ? I.header : 0); l += 64) {
                    _mm_prefetch((const char *) (j == 0 ? hdr : w) + ahead + l, _MM_HINT_T0);
                }
            }
            for (int h = 0; h < 2; ++h) {
                const __m256 d = row_scales<TYPE>(hdr, h);
                __m256 neg_dmin = _mm256_setzero_ps();
                if constexpr (has_dmin(TYPE)) {
                    neg_dmin = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (hdr + 32 + 16 * h))));
                }
                // per row, as int16 pairs for madd: its integer scale (sc), Q6_K/Q3_K's two scales
                // side by side (sc01), Q2_K's two mins (mn01); Q4_K/Q5_K's min times -dmin (mnd, exact:
                // 6 bits times an fp16 value)
                __m256i sc0 = ones, sc1 = ones, sc01 = _mm256_setzero_si256(), mn01 = _mm256_setzero_si256();
                __m256  mnd = _mm256_setzero_ps();
                const uint8_t * qp = w + scale_bytes(TYPE);
                if constexpr (TYPE == GGML_TYPE_Q2_K) {  // scale | min << 4
                    const __m128i b0 = _mm_loadl_epi64((const __m128i *) (w + 8 * h));
                    const __m128i b1 = _mm_loadl_epi64((const __m128i *) (w + 16 + 8 * h));
                    const __m128i s0 = _mm_and_si128(b0, _mm_set1_epi8(0x0F)), s1 = _mm_and_si128(b1, _mm_set1_epi8(0x0F));
                    sc0  = byte_pairs<false>(s0, s0);
                    sc1  = byte_pairs<false>(s1, s1);
                    mn01 = byte_pairs<false>(_mm_and_si128(_mm_srli_epi16(b0, 4), _mm_set1_epi8(0x0F)),
                                            _mm_and_si128(_mm_srli_epi16(b1, 4), _mm_set1_epi8(0x0F)));
                } else if constexpr (has_min(TYPE)) {
                    const __m128i b0 = _mm_loadl_epi64((const __m128i *) (w + 8 * h));
                    sc0 = byte_pairs<false>(b0, b0);
                    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (w + 16 + 8 * h))));
                    mnd = _mm256_mul_ps(mn, neg_dmin);
                } else if constexpr (scale_bytes(TYPE) > 0) {  // signed: Q6_K's and Q3_K's two, IQ4_XS's one
                    const __m128i b0 = _mm_loadl_epi64((const __m128i *) (w + 8 * h));
                    sc0 = byte_pairs<true>(b0, b0);
                    if constexpr (scale_bytes(TYPE) == 32) {
                        const __m128i b1 = _mm_loadl_epi64((const __m128i *) (w + 16 + 8 * h));
                        sc1  = byte_pairs<true>(b1, b1);
                        sc01 = byte_pairs<true>(b0, b1);
                    }
                }
                __m256i q[8];
                if constexpr (TYPE == GGML_TYPE_Q8_0) {
                    for (int m = 0; m < 8; ++m) {
                        q[m] = _mm256_loadu_si256((const __m256i *) (qp + 64 * m + 32 * h));
                    }
                } else if constexpr (has_two_bits(TYPE)) {
                    for (int m = 0; m < 8; ++m) {
                        const __m256i lo = _mm256_loadu_si256((const __m256i *) (qp + 64 * (m / 4) + 32 * h));
                        q[m] = _mm256_and_si256(_mm256_srli_epi16(lo, 2 * (m % 4)), _mm256_set1_epi8(3));
                    }
                    if constexpr (TYPE == GGML_TYPE_Q3_K) {
                        const __m256i hb = _mm256_loadu_si256((const __m256i *) (qp + 128 + 32 * h));
                        for (int m = 0; m < 8; ++m) {
                            const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hb, m), _mm256_set1_epi8(1));
                            q[m] = _mm256_or_si256(q[m], _mm256_slli_epi16(bit, 2));
                        }
                    }
                } else {
                    for (int m = 0; m < 4; ++m) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *) (qp + 64 * m + 32 * h));
                        q[m]     = _mm256_and_si256(v, m4);
                        q[m + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    }
                    if constexpr (has_table(TYPE)) {
                        for (int m = 0; m < 8; ++m) {
                            q[m] = _mm256_shuffle_epi8(lut, q[m]);
                        }
                    } else if constexpr (TYPE == GGML_TYPE_Q5_K) {
                        const __m256i hb = _mm256_loadu_si256((const __m256i *) (qp + 256 + 32 * h));
                        for (int m = 0; m < 8; ++m) {
                            const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hb, m), _mm256_set1_epi8(1));
                            q[m] = _mm256_or_si256(q[m], _mm256_slli_epi16(bit, 4));
                        }
                    } else if constexpr (TYPE == GGML_TYPE_Q6_K) {
                        for (int m = 0; m < 8; ++m) {
                            const __m256i hb   = _mm256_loadu_si256((const __m256i *) (qp + 256 + 64 * (m / 4) + 32 * h));
                            const __m256i bits = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * (m % 4)), _mm256_set1_epi8(3));
                            q[m] = _mm256_or_si256(q[m], _mm256_slli_epi16(bits, 4));
                        }
                    }
                }
                for (int t = 0; t < T; ++t) {
                    const int32_t * xq = (const int32_t *) (x[t].q + b * QK);
                    const int32_t   s0 = x[t].s16[2 * b], s1 = x[t].s16[2 * b + 1];
                    const float     dx = x[t].d[b];
                    const __m256    dd = _mm256_mul_ps(d, _mm256_set1_ps(dx));
                    auto product = [&](int m) {  // 8 rows' pairs of products, 16 bits each
                        const __m256i xb = _mm256_set1_epi32(xq[m]);
                        return is_signed ? _mm256_maddubs_epi16(_mm256_sign_epi8(q[m], q[m]), _mm256_sign_epi8(xb, q[m]))
                                         : _mm256_maddubs_epi16(q[m], xb);
                    };
                    // registers m0..m0+n-1's products per row, times `scale`: runs of SUMS16 products
                    // added in 16 bits, each run then through one madd
                    auto dot = [&](int m0, int n, __m256i scale) {
                        __m256i s = _mm256_setzero_si256();
                        for (int c = m0; c < m0 + n; c += SUMS16) {
                            __m256i p = product(c);
                            for (int m = c + 1; m < std::min(c + SUMS16, m0 + n); ++m) {
                                p = _mm256_add_epi16(p, product(m));
                            }
                            if constexpr (TYPE == GGML_TYPE_Q4_0) {
                                // the offset 8 taken back in 16 bits: each half minus 8 times its
                                // activations, sum (q - 8) x over 16 weights (at most 8 * 16 * 127)
                                static_assert(SUMS16 == 8, "one run: a block's 32 products");
                                p = _mm256_add_epi16(p, _mm256_set1_epi32((int32_t) x[t].lane_off[b]));
                            }
                            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, scale));
                        }
                        return s;
                    };
                    if constexpr (has_half_scales(TYPE)) {
                        __m256i isum = _mm256_add_epi32(dot(0, 4, sc0), dot(4, 4, sc1));
                        // the activations' two half sums as int16 pairs, against sc01 or mn01
                        const __m256i s01 = _mm256_set1_epi32((int32_t) ((uint32_t) (uint16_t) s0 | (uint32_t) s1 << 16));
                        if constexpr (half_offset(TYPE) != 0) {  // minus off (sc0 S0 + sc1 S1); off a power of two
                            isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_madd_epi16(sc01, s01), __builtin_ctz(half_offset(TYPE))));
                        }
                        acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dd, acc[t][h]);
                        if constexpr (TYPE == GGML_TYPE_Q2_K) {
                            const __m256i mins = _mm256_madd_epi16(mn01, s01);
                            acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(neg_dmin, _mm256_set1_ps(dx)), acc[t][h]);
                        }
                    } else if constexpr (has_min(TYPE)) {
                        acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot(0, 8, sc0)), dd, acc[t][h]);
                        // mn S times -dmin dx, as (mn -dmin) times (S dx): both products exact (6 bits
                        // times 11, 13 times 11), so the fma rounds the same real number
                        acc[t][h] = _mm256_fmadd_ps(mnd, _mm256_set1_ps(x[t].sum_d[b]), acc[t][h]);
                    } else {  // sc0: IQ4_XS's scales, else ones
                        const __m256i isum = dot(0, 8, sc0);
                        acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dd, acc[t][h]);
                    }
                }
            }
        }
    }
    for (int t = 0; t < T; ++t) {
        _mm256_storeu_ps(y + t * GROUP, acc[t][0]);
        _mm256_storeu_ps(y + t * GROUP + 8, acc[t][1]);
    }
}

#else
#define EXACT_KERNEL "scalar"
constexpr int TILE_MAX = 8;

template <ggml_type TYPE, int T>
void tile_one(const uint8_t * w, int64_t K, const act_row * x, float * y) {
    constexpr layout_info I = info_of(TYPE);
    const int64_t n_sb = K / (QK * I.blocks);
    for (int t = 0; t < T; ++t) {
        for (int r = 0; r < GROUP; ++r) {
            float acc = 0.0f;
            const uint8_t * p = w;
            for (int64_t s = 0; s < n_sb; ++s) {
                const float d = TYPE == GGML_TYPE_MXFP4 ? GGML_E8M0_TO_FP32_HALF(p[r]) : GGML_CPU_FP16_TO_FP32(((const ggml_half *) p)[r]);
                const float dmin = has_dmin(TYPE) ? GGML_CPU_FP16_TO_FP32(((const ggml_half *) (p + 32))[r]) : 0.0f;
                p += I.header;
                for (int j = 0; j < I.blocks; ++j, p += I.unit) {
                    const int64_t b = s * I.blocks + j;
                    const uint8_t * qp = p + scale_bytes(TYPE);
                    int32_t a[2] = { 0, 0 };
                    for (int k = 0; k < QK; ++k) {
                        a[k / 16] += value_in_sum(TYPE, stored_at(TYPE, qp, r, k)) * x[t].q[b * QK + k];
                    }
                    const int32_t s0 = x[t].s16[2 * b], s1 = x[t].s16[2 * b + 1];
                    const float   dx = x[t].d[b];
                    if (TYPE == GGML_TYPE_Q6_K || TYPE == GGML_TYPE_Q3_K) {  // value_in_sum took the offset off already
                        const int32_t isum = (int8_t) p[r] * a[0] + (int8_t) p[16 + r] * a[1];
                        acc = fmaf((float) isum, d * dx, acc);
                    } else if (TYPE == GGML_TYPE_Q2_K) {
                        acc = fmaf((float) ((p[r] & 15) * a[0] + (p[16 + r] & 15) * a[1]), d * dx, acc);
                        acc = fmaf((float) ((p[r] >> 4) * s0 + (p[16 + r] >> 4) * s1), -dmin * dx, acc);
                    } else if (has_min(TYPE)) {
                        acc = fmaf((float) (p[r] * (a[0] + a[1])), d * dx, acc);
                        acc = fmaf((float) (p[16 + r] * (s0 + s1)), -dmin * dx, acc);
                    } else if (TYPE == GGML_TYPE_IQ4_XS) {
                        acc = fmaf((float) ((int8_t) p[r] * (a[0] + a[1])), d * dx, acc);
                    } else {
                        acc = fmaf((float) (a[0] + a[1]), d * dx, acc);
                    }
                }
            }
            y[t * GROUP + r] = acc;
        }
    }
}
#endif

#if !defined(EXACT_KERNEL_TAKES_GROUPS)
// one group at a time
template <ggml_type TYPE, int G, int T>
void tile_simd(const uint8_t * w, int64_t gstride, int64_t K, const act_row * x, float * y) {
    for (int c = 0; c < G; ++c) {
        tile_one<TYPE, T>(w + c * gstride, K, x, y + c * T * GROUP);
    }
}
#endif

// ---------------------------------------------------------------------------------- F16, BF16

// an output's 16 lane sums added in one fixed order, whatever the SIMD width that made them
float lanes_sum(const float * l) {
    float a[8], b[4];
    for (int i = 0; i < 8; ++i) {
        a[i] = l[i] + l[i + 8];
    }
    for (int i = 0; i < 4; ++i) {
        b[i] = a[i] + a[i + 4];
    }
    return ((b[0] + b[2]) + (b[1] + b[3]));
}

#if defined(__AVX2__) || defined(__AVX512F__)
// lanes_sum of lanes 0-7 (lo) and 8-15 (hi) in registers: the same adds in the same order, so the
// same bits, without a trip through memory (with rows of 256 weights the sum cost as much as the row)
inline float lanes_sum(__m256 lo, __m256 hi) {
    const __m256 a = _mm256_add_ps(lo, hi);                                                // a[i] = l[i] + l[i + 8]
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // b[i] = a[i] + a[i + 4]
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                                   // b0 + b2, b1 + b3
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));                               // (b0 + b2) + (b1 + b3)
}
#endif

// R rows (row_bytes apart) for T tokens: y[t * GROUP + r]. Lane l of an output's sum takes the
// weights k = l mod 16 in ascending order, whatever R, T and the SIMD width.
template <ggml_type TYPE, int R, int T>
void float_rows(const uint8_t * w, int64_t row_bytes, int64_t K, const act_row * x, float * y) {
    // prefetched: 2 KiB ahead in a row, or in the rows 4 calls ahead where rows are shorter (a
    // fixed 1 KiB in a row of 512 bytes, an expert's gate or up row at width 256, landed on the
    // rows computed now, and the next ones came late)
    [[maybe_unused]] const int64_t ahead = row_bytes >= 2048 ? 2048 : 4 * R * row_bytes;
#if defined(__AVX512F__)
    __m512 acc[R][T];
    for (int r = 0; r < R; ++r) {
        for (int t = 0; t < T; ++t) {
            acc[r][t] = _mm512_setzero_ps();
        }
    }
    for (int64_t k = 0; k < K; k += 16) {
        for (int r = 0; r < R; ++r) {
            const uint8_t * p = w + r * row_bytes + 2 * k;
            if (k % 32 == 0) {  // a cache line per 32 weights, asked for ahead
                _mm_prefetch((const char *) p + ahead, _MM_HINT_T0);
            }
            const __m256i h = _mm256_loadu_si256((const __m256i *) p);
            const __m512  v = TYPE == GGML_TYPE_F16 ? _mm512_cvtph_ps(h)
                                                    : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            for (int t = 0; t < T; ++t) {
                acc[r][t] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x[t].f + k), acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int t = 0; t < T; ++t) {
            y[t * GROUP + r] = lanes_sum(_mm512_castps512_ps256(acc[r][t]),
                                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][t]), 1)));
        }
    }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    __m256 acc[R][T][2];  // lanes 0-7 and 8-15
    for (int r = 0; r < R; ++r) {
        for (int t = 0; t < T; ++t) {
            acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
        }
    }
    for (int64_t k = 0; k < K; k += 16) {
        for (int r = 0; r < R; ++r) {
            const uint8_t * p = w + r * row_bytes + 2 * k;
            if (k % 32 == 0) {
                _mm_prefetch((const char *) p + ahead, _MM_HINT_T0);
            }
            for (int h = 0; h < 2; ++h) {
                const __m128i b = _mm_loadu_si128((const __m128i *) (p + 16 * h));
                const __m256  v = TYPE == GGML_TYPE_F16 ? _mm256_cvtph_ps(b)
                                                        : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
                for (int t = 0; t < T; ++t) {
                    acc[r][t][h] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x[t].f + k + 8 * h), acc[r][t][h]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int t = 0; t < T; ++t) {
            y[t * GROUP + r] = lanes_sum(acc[r][t][0], acc[r][t][1]);
        }
    }
#else
    float lanes[16];
    for (int r = 0; r < R; ++r) {
        const uint8_t * p = w + r * row_bytes;
        for (int t = 0; t < T; ++t) {
            for (int l = 0; l < 16; ++l) {
                lanes[l] = 0.0f;
            }
            for (int64_t k = 0; k < K; ++k) {
                const uint16_t bits = ((const uint16_t *) p)[k];
                const float    v    = TYPE == GGML_TYPE_F16 ? GGML_CPU_FP16_TO_FP32(bits) : GGML_BF16_TO_FP32(ggml_bf16_t{ bits });
                lanes[k % 16] = fmaf(v, x[t].f[k], lanes[k % 16]);
            }
            y[t * GROUP + r] = lanes_sum(lanes);
        }
    }
#endif
}

// rows of one token's sums in flight: one, a stream each thread's prefetchers follow. Four rows of
// 512 bytes side by side read 10-12 GB/s from memory on a Zen 3, one row 16-18 (llama.cpp's vec_dot
// 14-16); on a Zen 5 (AVX-512) four rows read 35.8 / 39.2 / 36.9 / 36.7 GB/s of the expert shapes
// 256->5632, 5632->256, 2048->768, 768->2048, two rows 34.6 / 37.5 / 33.2 / 36.7, one row 47.9 /
// 40.3 / 48.5 / 46.9 (llama.cpp 32.9 / 46.4 / 47.0 / 42.0). No sum's order changes.
constexpr int ONE_TOKEN_ROWS = 1;

// G groups of 16 rows for T tokens, rows a few at a time: enough independent sums in flight
template <ggml_type TYPE, int G, int T>
void float_groups(const uint8_t * w, int64_t gstride, int64_t K, const act_row * x, float * y) {
    constexpr int R = T == 1 ? ONE_TOKEN_ROWS : T == 2 ? 2 : 1;
    const int64_t row_bytes = gstride / GROUP;
    for (int c = 0; c < G; ++c) {
        for (int r = 0; r < GROUP; r += R) {
            float_rows<TYPE, R, T>(w + c * gstride + r * row_bytes, row_bytes, K, x, y + c * T * GROUP + r);
        }
    }
}

// G groups for T tokens: the quantized types' kernel, or F16/BF16's
template <ggml_type TYPE, int G, int T>
void groups_kernel(const uint8_t * w, int64_t gstride, int64_t K, const act_row * x, float * y) {
    if constexpr (is_float(TYPE)) {
        float_groups<TYPE, G, T>(w, gstride, K, x, y);
    } else {
        tile_simd<TYPE, G, T>(w, gstride, K, x, y);
    }
}

// one group for T tokens, 1 <= T <= TILE_MAX: the kernel compiled for T
template <ggml_type TYPE, int N = 1>
void tile_of_tokens(const uint8_t * w, int64_t gstride, int64_t K, int T, const act_row * x, float * y) {
    if constexpr (N < TILE_MAX) {
        if (T > N) {
            tile_of_tokens<TYPE, N + 1>(w, gstride, K, T, x, y);
            return;
        }
    }
    GGML_ASSERT(T == N);
    groups_kernel<TYPE, 1, N>(w, gstride, K, x, y);
}

// a single token's matmul takes G groups at once (gemv_groups)
template <ggml_type TYPE>
void tile(const uint8_t * w, int64_t gstride, int G, int64_t K, int T, const act_row * x, float * y) {
    if (G > 1) {
        GGML_ASSERT(T == 1);
        switch (G) {
            case 2: groups_kernel<TYPE, 2, 1>(w, gstride, K, x, y); break;
            case 4: groups_kernel<TYPE, 4, 1>(w, gstride, K, x, y); break;
            case 8: groups_kernel<TYPE, 8, 1>(w, gstride, K, x, y); break;
            default: GGML_ABORT("CPU_EXACT: %d groups at once", G);
        }
        return;
    }
    tile_of_tokens<TYPE>(w, gstride, K, T, x, y);
}

void run_tile(ggml_type type, const uint8_t * w, int64_t gstride, int G, int64_t K, int T, const act_row * x, float * y) {
    switch (type) {
        case GGML_TYPE_Q4_0:   tile<GGML_TYPE_Q4_0>(w, gstride, G, K, T, x, y); break;
        case GGML_TYPE_Q8_0:   tile<GGML_TYPE_Q8_0>(w, gstride, G, K, T, x, y); break;
        case GGML_TYPE_IQ4_NL: tile<GGML_TYPE_IQ4_NL>(w, gstride, G, K, T, x, y); break;
        case GGML_TYPE_IQ4_XS: tile<GGML_TYPE_IQ4_XS>(w, gstride, G, K, T, x, y); break;
        case GGML_TYPE_MXFP4:  tile<GGML_TYPE_MXFP4>(w, gstride, G, K, T, x, y); break;
        case GGML_TYPE_F16:    tile<GGML_TYPE_F16>(w, gstride, G, K, T, x, y); break;
        case GGML_TYPE_BF16:   tile<GGML_TYPE_BF16>(w, gstride, G, K, T, x, y); break;
        case GGML_TYPE_Q4_K:   tile<GGML_TYPE_Q4_K>(w, gstride, G, K, T, x, y); break;
        case GGML_TYPE_Q5_K:   tile<GGML_TYPE_Q5_K>(w, gstride, G, K, T, x, y); break;
        case GGML_TYPE_Q6_K:   tile<GGML_TYPE_Q6_K>(w, gstride, G, K, T, x, y); break;
        case GGML_TYPE_Q3_K:   tile<GGML_TYPE_Q3_K>(w, gstride, G, K, T, x, y); break;
        case GGML_TYPE_Q2_K:   tile<GGML_TYPE_Q2_K>(w, gstride, G, K, T, x, y); break;
        default: GGML_ABORT("CPU_EXACT: type %s", ggml_type_name(type));
    }
}

// G consecutive groups (1, or gemv_groups for a single token), gstride bytes apart, whose first
// row is row0, of a matrix of M rows, for n tokens: act(i) the i-th token's activation row, out(i)
// its output row (indexed by weight row)
template <typename Act, typename Out>
void groups_for_tokens(ggml_type type, const uint8_t * w, int64_t gstride, int G, int64_t K, int64_t n, Act act,
                       Out out, int64_t row0, int64_t M) {
    act_row x[TILE_MAX];
    alignas(64) float y[std::max(TILE_MAX, GROUPS_MAX) * GROUP];  // a tile's outputs, or a single token's groups
    for (int64_t i0 = 0; i0 < n; i0 += TILE_MAX) {
        const int T = (int) std::min<int64_t>(TILE_MAX, n - i0);
        for (int t = 0; t < T; ++t) {
            x[t] = act_at(act(i0 + t), K);
        }
        run_tile(type, w, gstride, G, K, T, x, y);
        for (int c = 0; c < G; ++c) {
            const int64_t r0 = row0 + c * GROUP;
            for (int t = 0; t < T; ++t) {
                memcpy(out(i0 + t) + r0, y + (c * T + t) * GROUP, (size_t) std::min<int64_t>(GROUP, M - r0) * sizeof(float));
            }
        }
    }
}

// ---------------------------------------------------------------------------------- the ops

struct mmid_pair {
    int32_t slot;   // i1: which of the token's chosen experts
    int32_t token;  // i2
};

class exact_traits : public ggml::cpu::tensor_traits {
  public:
    explicit exact_traits(bool plain) : plain(plain) {}

  private:
    const bool plain;  // the weights are in the file's layout: each group is interleaved on the fly

    static size_t scratch_bytes(const ggml_tensor * w) {
        return (size_t) group_bytes(w->type, w->ne[0]);
    }

    bool work_size(int n_threads, const ggml_tensor * op, size_t & size) override {
        const ggml_tensor * src0 = op->src[0];
        const ggml_tensor * src1 = op->src[1];
        const int64_t n_rows1 = src1->ne[1] * src1->ne[2] * src1->ne[3];
        size = GGML_PAD(act_row_bytes(src0->type, src0->ne[0]) * (size_t) n_rows1, 64);
        if (op->op == GGML_OP_MUL_MAT_ID) {
            const ggml_tensor * ids = op->src[2];
            const int64_t n_as = src0->ne[2];
            size += GGML_PAD(sizeof(int64_t) * (size_t) n_as, 64);
            size += GGML_PAD(sizeof(mmid_pair) * (size_t) (n_as * ids->ne[0] * ids->ne[1]), 64);
        }
        if (plain) {
            size += GGML_PAD(scratch_bytes(src0), 64) * (size_t) n_threads;
        }
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        if (op->op == GGML_OP_MUL_MAT) {
            forward_mul_mat(params, op);
            return true;
        }
        if (op->op == GGML_OP_MUL_MAT_ID) {
            forward_mul_mat_id(params, op);
            return true;
        }
        return false;
    }

    // group g of the weight matrix at `w`: in place when interleaved (or F16/BF16's whole rows),
    // else interleaved into scratch
    const uint8_t * group_at(const ggml_tensor * src0, const uint8_t * w, int64_t g, uint8_t * scratch) const {
        const int64_t n_rows = std::min<int64_t>(GROUP, src0->ne[1] - g * GROUP);
        if (!plain || (is_float(src0->type) && n_rows == GROUP)) {
            return w + g * group_bytes(src0->type, src0->ne[0]);
        }
        interleave_group(src0->type, w + g * GROUP * src0->nb[1], src0->nb[1], n_rows, src0->ne[0], scratch);
        return scratch;
    }

    // this thread's scratch for a plain group, after `used` bytes of wdata
    uint8_t * scratch_of(const ggml_compute_params * params, const ggml_tensor * src0, size_t used) const {
        if (!plain) {
            return nullptr;
        }
        return (uint8_t *) params->wdata + used + GGML_PAD(scratch_bytes(src0), 64) * (size_t) params->ith;
    }

    // every row of src1 (ne11 x ne12 x ne13), quantized into wdata (copied, for F16 and BF16
    // weights), rows split across threads
    static void quantize_src1(const ggml_compute_params * params, ggml_type type, const ggml_tensor * src1, uint8_t * wdata) {
        const int64_t K  = src1->ne[0];
        const size_t  rb = act_row_bytes(type, K);
        const int64_t n  = src1->ne[1] * src1->ne[2] * src1->ne[3];
        for (int64_t i = params->ith; i < n; i += params->nth) {
            const int64_t i11 = i % src1->ne[1];
            const int64_t i12 = (i / src1->ne[1]) % src1->ne[2];
            const int64_t i13 = i / (src1->ne[1] * src1->ne[2]);
            const float * x = (const float *) ((const char *) src1->data + i11 * src1->nb[1] + i12 * src1->nb[2] + i13 * src1->nb[3]);
            if (is_float(type)) {
                memcpy(wdata + i * rb, x, (size_t) K * sizeof(float));
            } else {
                quantize_act(x, wdata + i * rb, K);
            }
        }
    }

    void forward_mul_mat(ggml_compute_params * params, ggml_tensor * dst) const {
        const ggml_tensor * src0 = dst->src[0];
        const ggml_tensor * src1 = dst->src[1];
        const int64_t K = src0->ne[0], M = src0->ne[1];
        const int64_t ne11 = src1->ne[1], ne12 = src1->ne[2];
        const int64_t n  = ne11 * ne12 * src1->ne[3];
        const size_t  rb = act_row_bytes(src0->type, K);
        uint8_t * acts = (uint8_t *) params->wdata;
        quantize_src1(params, src0->type, src1, acts);
        ggml_barrier(params->threadpool);

        uint8_t * scratch = scratch_of(params, src0, GGML_PAD(rb * (size_t) n, 64));
        const int64_t n_groups = (M + GROUP - 1) / GROUP;
        auto act = [&](int64_t i) { return acts + i * rb; };
        auto out = [&](int64_t i) {
            const int64_t i11 = i % ne11, i12 = (i / ne11) % ne12, i13 = i / (ne11 * ne12);
            return (float *) ((char *) dst->data + i11 * dst->nb[1] + i12 * dst->nb[2] + i13 * dst->nb[3]);
        };
        // each thread a contiguous range of groups: long runs of memory for the prefetchers
        const int64_t g0 = n_groups * params->ith / params->nth, g1 = n_groups * (params->ith + 1) / params->nth;
        const int64_t gstride = group_bytes(src0->type, K);
        const int     groups  = gemv_groups.load(std::memory_order_relaxed);
        for (int64_t g = g0; g < g1;) {
            const int G = !plain && n == 1 && g + groups <= g1 ? groups : 1;
            const uint8_t * w = group_at(src0, (const uint8_t *) src0->data, g, scratch);
            groups_for_tokens(src0->type, w, gstride, G, K, n, act, out, g * GROUP, M);
            g += G;
        }
    }

    void forward_mul_mat_id(ggml_compute_params * params, ggml_tensor * dst) const {
        const ggml_tensor * src0 = dst->src[0];
        const ggml_tensor * src1 = dst->src[1];
        const ggml_tensor * ids  = dst->src[2];
        const int64_t K = src0->ne[0], M = src0->ne[1], n_as = src0->ne[2];
        const int64_t ne11  = src1->ne[1];
        const int64_t n_ids = ids->ne[0], n_tokens = ids->ne[1];
        const size_t  rb = act_row_bytes(src0->type, K);

        uint8_t * acts = (uint8_t *) params->wdata;
        size_t used = GGML_PAD(rb * (size_t) (ne11 * src1->ne[2] * src1->ne[3]), 64);
        int64_t * counts = (int64_t *) ((char *) params->wdata + used);
        used += GGML_PAD(sizeof(int64_t) * (size_t) n_as, 64);
        mmid_pair * pairs = (mmid_pair *) ((char *) params->wdata + used);  // [n_as][n_ids * n_tokens]
        used += GGML_PAD(sizeof(mmid_pair) * (size_t) (n_as * n_ids * n_tokens), 64);

        quantize_src1(params, src0->type, src1, acts);
        if (params->ith == 0) {
            memset(counts, 0, sizeof(int64_t) * (size_t) n_as);
            for (int64_t t = 0; t < n_tokens; ++t) {
                for (int64_t s = 0; s < n_ids; ++s) {
                    const int32_t e = *(const int32_t *) ((const char *) ids->data + t * ids->nb[1] + s * ids->nb[0]);
                    GGML_ASSERT(e >= -1 && e < n_as);
                    if (e < 0) {  // computed elsewhere (patch 0001): its output row is zero
                        memset((char *) dst->data + s * dst->nb[1] + t * dst->nb[2], 0, (size_t) M * sizeof(float));
                        continue;
                    }
                    pairs[e * n_ids * n_tokens + counts[e]++] = { (int32_t) s, (int32_t) t };
                }
            }
        }
        ggml_barrier(params->threadpool);

        uint8_t * scratch = scratch_of(params, src0, used);
        const int64_t n_groups = (M + GROUP - 1) / GROUP;
        // (expert, group) pairs in order, split into contiguous runs of about equal cost: a group's
        // weights read once (as much as WEIGHT_COST tokens) and its tokens
        constexpr int64_t WEIGHT_COST = 4;
        int64_t total = 0;
        for (int64_t e = 0; e < n_as; ++e) {
            total += counts[e] ? n_groups * (counts[e] + WEIGHT_COST) : 0;
        }
        int64_t done = 0;
        const int64_t gstride = group_bytes(src0->type, K);
        const int     groups  = gemv_groups.load(std::memory_order_relaxed);
        for (int64_t e = 0; e < n_as; ++e) {
            const int64_t n = counts[e];
            if (n == 0) {
                continue;
            }
            const mmid_pair * p = pairs + e * n_ids * n_tokens;
            auto act = [&](int64_t i) { return acts + ((p[i].slot % ne11) + p[i].token * ne11) * rb; };
            auto out = [&](int64_t i) {
                return (float *) ((char *) dst->data + p[i].slot * dst->nb[1] + p[i].token * dst->nb[2]);
            };
            const uint8_t * w0 = (const uint8_t *) src0->data + e * (plain ? (int64_t) src0->nb[2] : matrix_bytes(src0));
            for (int64_t g = 0; g < n_groups;) {
                const int G = !plain && n == 1 && g + groups <= n_groups ? groups : 1;
                const int64_t cost = G * (n + WEIGHT_COST);
                const int64_t owner = (2 * done + cost) * params->nth / (2 * total);  // by the unit's middle
                done += cost;
                if (owner == params->ith) {
                    const uint8_t * w = group_at(src0, w0, g, scratch);
                    groups_for_tokens(src0->type, w, gstride, G, K, n, act, out, g * GROUP, M);
                }
                g += G;
            }
        }
    }
};

exact_traits interleaved_traits(false);
exact_traits plain_traits(true);

bool is_extra_buft(ggml_backend_buffer_type_t buft) {
    for (auto * extra : ggml_backend_cpu_get_extra_buffer_types()) {
        if (extra == buft) {
            return true;
        }
    }
    return false;
}

// the shapes the kernels take: whole blocks, rows contiguous, F32 activations in host memory
bool shape_ok(const ggml_tensor * op) {
    const ggml_tensor * src0 = op->src[0];
    const ggml_tensor * src1 = op->src[1];
    if (!covered(src0->type) || src1->type != GGML_TYPE_F32 || src0->ne[0] % (QK * info_of(src0->type).blocks) != 0) {
        return false;
    }
    if (src1->buffer && !ggml_backend_buft_is_host(src1->buffer->buft)) {
        return false;
    }
    if (src0->nb[0] != ggml_type_size(src0->type) || src0->nb[1] != ggml_row_size(src0->type, src0->ne[0]) ||
        src1->nb[0] != sizeof(float) || op->nb[0] != sizeof(float)) {
        return false;
    }
    if (op->op == GGML_OP_MUL_MAT) {
        return ggml_n_dims(src0) == 2;
    }
    return op->op == GGML_OP_MUL_MAT_ID && src0->ne[3] == 1 && src1->ne[3] == 1 && op->src[2]->ne[1] == src1->ne[2];
}

}  // namespace

// ------------------------------------------------------------------------------ the buffer type

static enum ggml_status exact_buffer_init_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor) {
    tensor->extra = (void *) static_cast<ggml::cpu::tensor_traits *>(&interleaved_traits);
    GGML_UNUSED(buffer);
    return GGML_STATUS_SUCCESS;
}

static void exact_buffer_set_tensor(ggml_backend_buffer_t buffer, ggml_tensor * t, const void * data, size_t offset, size_t size) {
    GGML_ASSERT(offset == 0 && size == ggml_nbytes(t));
    GGML_ASSERT(covered(t->type) && t->ne[1] % GROUP == 0 && t->ne[0] % (QK * info_of(t->type).blocks) == 0);
    const size_t  row    = ggml_row_size(t->type, t->ne[0]);
    const int64_t n_mats = t->ne[2] * t->ne[3];
    for (int64_t e = 0; e < n_mats; ++e) {
        const uint8_t * src = (const uint8_t *) data + e * t->nb[2];
        uint8_t *       dst = (uint8_t *) t->data + e * matrix_bytes(t);
        for (int64_t g = 0; g < t->ne[1] / GROUP; ++g) {
            interleave_group(t->type, src + g * GROUP * row, row, GROUP, t->ne[0], dst + g * group_bytes(t->type, t->ne[0]));
        }
    }
    GGML_UNUSED(buffer);
}

static const char * exact_buffer_type_get_name(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return "CPU_EXACT";
}

static ggml_backend_buffer_t exact_buffer_type_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    ggml_backend_buffer_t buffer = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);
    if (buffer == nullptr) {
        return nullptr;
    }
    buffer->buft              = buft;
    buffer->iface.init_tensor = exact_buffer_init_tensor;
    buffer->iface.set_tensor  = exact_buffer_set_tensor;
    buffer->iface.get_tensor  = nullptr;
    buffer->iface.cpy_tensor  = nullptr;
    return buffer;
}

static size_t exact_buffer_type_get_alignment(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return TENSOR_ALIGNMENT;
}

// the K-quants' layout keeps their integer scales unpacked, a few percent more than the file
static size_t exact_buffer_type_get_alloc_size(ggml_backend_buffer_type_t buft, const ggml_tensor * t) {
    GGML_UNUSED(buft);
    if (!covered(t->type) || t->ne[0] % (QK * info_of(t->type).blocks) != 0) {
        return ggml_nbytes(t);
    }
    return std::max((size_t) (matrix_bytes(t) * t->ne[2] * t->ne[3]), ggml_nbytes(t));
}

namespace ggml::cpu::exact {
class extra_buffer_type : ggml::cpu::extra_buffer_type {
    bool supports_op(ggml_backend_dev_t, const ggml_tensor * op) override {
        const ggml_tensor * w = op->src[0];
        // F16 and BF16 are computed in the file's layout: no copy of them is taken
        return (op->op == GGML_OP_MUL_MAT || op->op == GGML_OP_MUL_MAT_ID) && w->buffer && w->view_src == nullptr &&
               w->buffer->buft == ggml_backend_cpu_exact_buffer_type() && w->ne[1] % GROUP == 0 && !is_float(w->type) &&
               shape_ok(op);
    }

    // this buffer type's weights; and, in batch-invariant mode, the plain layout of the types it
    // takes, so that either layout sums in the same order (F16 and BF16: at up to that mode's
    // rows, the batches it holds to one-token rows; a prompt keeps llama.cpp's GEMM)
    ggml::cpu::tensor_traits * get_tensor_traits(const ggml_tensor * op) override {
        if (op->op != GGML_OP_MUL_MAT && op->op != GGML_OP_MUL_MAT_ID) {
            return nullptr;
        }
        const ggml_tensor * w = op->src[0];
        if (w->buffer && w->buffer->buft == ggml_backend_cpu_exact_buffer_type()) {
            return &interleaved_traits;
        }
        const int rows = ggml_cpu_get_batch_invariant_rows();
        if (rows > 0 && w->buffer && ggml_backend_buft_is_host(w->buffer->buft) && !is_extra_buft(w->buffer->buft) &&
            shape_ok(op)) {
            const int64_t tokens = op->op == GGML_OP_MUL_MAT_ID ? op->src[2]->ne[1] : ggml_nrows(op->src[1]);
            if (!is_float(w->type) || tokens <= rows) {
                return &plain_traits;
            }
        }
        return nullptr;
    }
};
}  // namespace ggml::cpu::exact

ggml_backend_buffer_type_t ggml_backend_cpu_exact_buffer_type(void) {
    static ggml_backend_buffer_type buft = {
        /* .iface    = */ {
            /* .get_name         = */ exact_buffer_type_get_name,
            /* .alloc_buffer     = */ exact_buffer_type_alloc_buffer,
            /* .get_alignment    = */ exact_buffer_type_get_alignment,
            /* .get_max_size     = */ nullptr,
            /* .get_alloc_size   = */ exact_buffer_type_get_alloc_size,
            /* .is_host          = */ nullptr,
        },
        /* .device  = */ ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0),
        /* .context = */ new ggml::cpu::exact::extra_buffer_type(),
    };
    return &buft;
}

const char * ggml_cpu_exact_kernel(void) {
    return EXACT_KERNEL;
}

bool ggml_cpu_exact_set_variant(int groups, int prefetch) {
    if ((groups != 1 && groups != 2 && groups != 4 && groups != GROUPS_MAX) || prefetch < 0 || prefetch > 16384 ||
        prefetch % 64 != 0) {
        return false;
    }
    gemv_groups.store(groups, std::memory_order_relaxed);
    prefetch_bytes.store(prefetch, std::memory_order_relaxed);
    return true;
}

void ggml_cpu_exact_get_variant(int * groups, int * prefetch) {
    *groups   = gemv_groups.load(std::memory_order_relaxed);
    *prefetch = prefetch_bytes.load(std::memory_order_relaxed);
}
