// Batch-invariant flash attention for a few query rows (see attn_rows.h).
//
// In batch-invariant mode every row of a decode or a verify pass takes flash attention's one-chunk
// path: per row, the KV positions in ascending order, each one's score (the K type's vec_dot
// against the row's converted query), then one online-softmax step (a new maximum rescales the
// accumulator and the sum) and the V row added with its weight. That path walks the whole cache
// once per row: a GQA model's 8 query heads per KV head, times the tokens of a verify pass, read
// every K and V row 8-72 times, and at 4,096 cached tokens a one-token decode took 1.35x llama.cpp's
// split-KV path. Here the rows that share a KV head (up to ROWS_MAX at a time) walk the cache
// together: position by position, each row does the same operations as before, in the same order,
// on state of its own, so every row's bits are the one-chunk path's, whichever rows go with it.

#include "attn_rows.h"

#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#include "ggml-cpu.h"
#include "simd-mappings.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

constexpr int     ROWS_MAX = 8;    // query rows that walk one KV head together
constexpr int64_t DK_MAX   = 576;  // the rows' state lives on the stack: head sizes up to these
constexpr int64_t DV_MAX   = 512;

struct row_state {
    const ggml_fp16_t * mask;  // the row's mask (or null)
    float slope;               // ALiBi's, 1 without
    int64_t iq1, iq2, iq3;     // token, head, sequence
    int64_t iv2, iv3;          // its V head
    float S;                   // softmax sum
    float M;                   // running maximum
};

}  // namespace

bool ggml_cpu_flash_attn_rows_supported(const ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    const ggml_type vec_dot_type = ggml_get_type_traits_cpu(k->type)->vec_dot_type;
    return q->type == GGML_TYPE_F32 && k->ne[0] <= DK_MAX && v->ne[0] <= DV_MAX &&
           ggml_row_size(vec_dot_type, k->ne[0]) <= (size_t) DK_MAX * sizeof(float) &&
           ggml_get_type_traits_cpu(k->type)->vec_dot && ggml_get_type_traits_cpu(vec_dot_type)->from_float &&
           (v->type == GGML_TYPE_F32 || ggml_get_type_traits(v->type)->to_float) &&
           q->nb[0] == ggml_type_size(q->type) && k->nb[0] == ggml_type_size(k->type) &&
           v->nb[0] == ggml_type_size(v->type) && dst->nb[0] == sizeof(float);
}

void ggml_cpu_flash_attn_rows(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * q     = dst->src[0];
    const ggml_tensor * k     = dst->src[1];
    const ggml_tensor * v     = dst->src[2];
    const ggml_tensor * mask  = dst->src[3];
    const ggml_tensor * sinks = dst->src[4];

    const int64_t DK = k->ne[0], DV = v->ne[0];
    const int64_t n_kv = k->ne[1];
    const int64_t N = q->ne[1], n_head = q->ne[2], n_seq = q->ne[3];
    const int64_t rk2 = n_head / k->ne[2], rk3 = n_seq / k->ne[3];
    const int64_t rv2 = n_head / v->ne[2], rv3 = n_seq / v->ne[3];

    float scale, max_bias, logit_softcap;
    memcpy(&scale,         (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias,      (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&logit_softcap, (const float *) dst->op_params + 2, sizeof(float));
    if (logit_softcap != 0) {
        scale /= logit_softcap;
    }
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2((double) n_head));
    const float m0 = powf(2.0f, -(max_bias       ) / n_head_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / n_head_log2);

    const ggml_type         k_vec_dot_type = ggml_get_type_traits_cpu(k->type)->vec_dot_type;
    const ggml_from_float_t q_to_vec_dot   = ggml_get_type_traits_cpu(k_vec_dot_type)->from_float;
    const ggml_vec_dot_t    kq_vec_dot     = ggml_get_type_traits_cpu(k->type)->vec_dot;
    const ggml_to_float_t   v_to_float     = v->type == GGML_TYPE_F32 ? nullptr : ggml_get_type_traits(v->type)->to_float;
    const bool v_f16 = v->type == GGML_TYPE_F16;

    // work units: runs of at most ROWS_MAX rows of one (sequence, KV head); rows are numbered
    // token-fastest, then head, then sequence, so a KV head's rows are consecutive
    const int64_t group_rows = rk2 * N;  // the query heads of a KV head, times the tokens
    const int64_t per_group  = (group_rows + ROWS_MAX - 1) / ROWS_MAX;
    const int64_t n_units    = k->ne[2] * n_seq * per_group;
    const int64_t u0 = n_units * params->ith / params->nth, u1 = n_units * (params->ith + 1) / params->nth;

    row_state st[ROWS_MAX];
    alignas(64) char  q_conv[ROWS_MAX][DK_MAX * sizeof(float)];  // the queries as the K type's vec_dot takes them
    alignas(64) float acc[ROWS_MAX][DV_MAX];                     // VKQ: F32, or F16 in the first half for F16 V
    alignas(64) float v32[DV_MAX];                               // a V row as F32 (other V types)
    alignas(64) float out[DV_MAX];

    for (int64_t u = u0; u < u1; ++u) {
        const int64_t group = u / per_group;          // (sequence, KV head)
        const int64_t ik2 = group % k->ne[2], iq3 = group / k->ne[2], ik3 = iq3 / rk3;
        const int64_t first = (u % per_group) * ROWS_MAX;
        const int n_rows = (int) std::min<int64_t>(ROWS_MAX, group_rows - first);
        for (int j = 0; j < n_rows; ++j) {
            row_state & r = st[j];
            r.iq3 = iq3;
            r.iq2 = ik2 * rk2 + (first + j) / N;
            r.iq1 = (first + j) % N;
            r.iv2 = r.iq2 / rv2;
            r.iv3 = r.iq3 / rv3;
            const uint32_t h = (uint32_t) r.iq2;
            r.slope = (max_bias > 0.0f) ? h < n_head_log2 ? powf(m0, h + 1) : powf(m1, 2*(h - n_head_log2) + 1) : 1.0f;
            r.mask = mask ? (const ggml_fp16_t *) ((const char *) mask->data + r.iq1*mask->nb[1] +
                                                   (r.iq2%mask->ne[2])*mask->nb[2] + (r.iq3%mask->ne[3])*mask->nb[3])
                          : nullptr;
            r.S = 0.0f;
            r.M = -INFINITY;
            if (v_f16) {
                memset(acc[j], 0, DV*sizeof(ggml_fp16_t));
            } else {
                memset(acc[j], 0, DV*sizeof(float));
            }
            const float * pq = (const float *) ((const char *) q->data + r.iq1*q->nb[1] + r.iq2*q->nb[2] + r.iq3*q->nb[3]);
            q_to_vec_dot(pq, q_conv[j], DK);
        }

        for (int64_t ic = 0; ic < n_kv; ++ic) {
            const char * k_data = (const char *) k->data + ic*k->nb[1] + ik2*k->nb[2] + ik3*k->nb[3];
            for (int j = 0; j < n_rows; ++j) {
                row_state & r = st[j];
                const float mv = r.mask ? r.slope*GGML_CPU_FP16_TO_FP32(r.mask[ic]) : 0.0f;
                if (mv == -INFINITY) {
                    continue;
                }

                float s;
                kq_vec_dot(DK, &s, 0, k_data, 0, q_conv[j], 0, 1);

                s = s*scale;

                if (logit_softcap != 0.0f) {
                    s = logit_softcap*tanhf(s);
                }

                s += mv;

                const float Mold = r.M;
                float ms = 1.0f;  // a new maximum rescales the accumulator and the sum by this
                float vs = 1.0f;  // the position's weight, expf(s - M)

                const char * v_data = (const char *) v->data + ic*v->nb[1] + r.iv2*v->nb[2] + r.iv3*v->nb[3];
                if (v_f16) {
                    ggml_fp16_t * vkq16 = (ggml_fp16_t *) acc[j];
                    if (s > r.M) {
                        r.M = s;
                        ms = expf(Mold - r.M);
                        ggml_vec_scale_f16(DV, vkq16, ms);
                    } else {
                        vs = expf(s - r.M);
                    }
                    ggml_vec_mad_f16(DV, vkq16, (const ggml_fp16_t *) v_data, vs);
                } else {
                    if (s > r.M) {
                        r.M = s;
                        ms = expf(Mold - r.M);
                        ggml_vec_scale_f32(DV, acc[j], ms);
                    } else {
                        vs = expf(s - r.M);
                    }
                    if (v_to_float) {
                        v_to_float(v_data, v32, DV);
                        ggml_vec_mad_f32(DV, acc[j], v32, vs);
                    } else {
                        ggml_vec_mad_f32(DV, acc[j], (const float *) v_data, vs);
                    }
                }

                r.S = r.S*ms + vs;
            }
        }

        for (int j = 0; j < n_rows; ++j) {
            row_state & r = st[j];
            if (v_f16) {
                const ggml_fp16_t * vkq16 = (const ggml_fp16_t *) acc[j];
                for (int64_t d = 0; d < DV; ++d) {
                    out[d] = GGML_CPU_FP16_TO_FP32(vkq16[d]);
                }
            } else {
                memcpy(out, acc[j], DV*sizeof(float));
            }

            if (sinks) {  // one more logit per head, with no value
                const float s = ((const float *) sinks->data)[r.iq2];
                float ms = 1.0f;
                float vs = 1.0f;
                if (s > r.M) {
                    ms = expf(r.M - s);
                    r.M = s;
                    ggml_vec_scale_f32(DV, out, ms);
                } else {
                    vs = expf(s - r.M);
                }
                r.S = r.S*ms + vs;
            }

            const float S_inv = r.S == 0.0f ? 0.0f : 1.0f/r.S;
            ggml_vec_scale_f32(DV, out, S_inv);

            // the output is permuted (0, 2, 1, 3): [DV, head, token, sequence]
            memcpy((char *) dst->data + (r.iq3*dst->ne[2]*dst->ne[1] + r.iq2 + r.iq1*dst->ne[1])*dst->nb[1], out, dst->nb[1]);
        }
    }
}
